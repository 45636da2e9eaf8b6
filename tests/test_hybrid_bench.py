"""benchmarks/hybrid_peers.py --quick --json: a smoke run of the Qwen3.5-MoE, Qwen3-Next,
GLM-4.7-Flash, ERNIE-4.5 and GLM-4.5-Air same-file benchmark (the random GGUF written the
converter's way, specmoe's row with the step split by part and, for the last two, the one-call
paths against torch glue (--ab 1), and llama.cpp's row or the reason it did not run), and of
benchmarks/mla_blocks.py --quick (MLA on a GGUF file's attn_k_b / attn_v_b blocks against bf16
absorbed weights), and of benchmarks/hybrid_spec.py --quick (what a verification costs on a
recording cache), and of benchmarks/hybrid_serve.py --quick (the server's worker decoding
a hybrid's requests batched and one by one), and of benchmarks/hybrid_prefill.py --quick (a
prompt forward against llama.cpp's).  Run by `make test-bench`."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not os.environ.get("SPECMOE_TEST_BENCH"),
                                reason="benchmark smoke runs: make test-bench runs them")

ROOT = Path(__file__).resolve().parent.parent


def _quick(tmp_path, script, *args):
    """``benchmarks/SCRIPT --quick --json --threads 1 --workdir TMP ARGS``: its JSON object."""
    env = dict(os.environ, SPECMOE_CACHE=str(tmp_path / "cache"))
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--quick", "--json",
                        "--threads", "1", "--workdir", str(tmp_path), *args],
                       cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout)


@pytest.mark.parametrize("arch", ["qwen35moe", "qwen3next", "glm47flash", "ernie45",
                                  "glm45air"])
def test_quick_run_reads_one_file_on_both_sides(tmp_path, arch):
    env = dict(os.environ, SPECMOE_CACHE=str(tmp_path / "cache"))
    hybrid = arch in ("qwen35moe", "qwen3next")
    ab = ["--ab", "1"] if arch in ("ernie45", "glm45air") else []
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "hybrid_peers.py"), "--quick",
                        "--json", "--threads", "1", "--workdir", str(tmp_path), "--arch", arch,
                        *ab], cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout)
    assert out["config"]["quick"] and out["config"]["machine"]["cpu"]
    assert out["config"]["model"].startswith(arch)
    assert out["config"]["dense"] == "gguf"  # the file's own blocks
    rows = {(r["name"], r["threads"]): r for r in out["rows"]}
    s, ll = rows[("specmoe-gguf", 1)], rows[("llama.cpp-Q4_0", 1)]
    assert s["tok_per_s_runs"][0] > 0 and not s["errors"], s
    assert s["planned_steps_runs"] == [32]  # every timed step one _C.DecodePlan call
    parts = s["step_ms_by_part_runs"][0]
    kinds = ("full_attention_layers",) + (("linear_attention_layers",) if hybrid else ())
    assert set(kinds) | {"other"} == set(parts)
    assert all(parts[k] > 0 for k in kinds), parts
    if ab:  # the same decode with the one-call paths off, then on
        assert s["one_call_tok_s_runs"][0] > 0 and s["torch_glue_tok_s_runs"][0] > 0
        assert len(s["one_call_vs_torch_glue_runs"]) == 1
    # llama.cpp runs where it is built; otherwise its row says why (never dropped)
    assert ll["tok_per_s_runs"][0] or "llama-bench" in " ".join(ll["errors"] or []), ll
    assert len(s["vs_llama_cpp_runs"]) == (1 if ll["tok_per_s_runs"][0] else 0)


def test_mla_blocks_quick_run_times_both_forms(tmp_path):
    """benchmarks/mla_blocks.py --quick: the tiny DeepSeek-V3 GGUF file's attention on its
    attn_k_b / attn_v_b blocks against bf16 absorbed from kv_b_proj, one round each."""
    out = _quick(tmp_path, "mla_blocks.py")
    assert out["config"]["machine"]["cpu"] and out["config"]["file"]["quick"]
    assert (out["config"]["mla"]["dtype"], out["config"]["mla"]["uv_dtype"]) == ("q4_0", "q4_0")
    (row,) = out["rows"]
    assert row["threads"] == 1 and row["gguf-blocks_tok_per_s_runs"][0] > 0
    assert row["bf16-absorbed_tok_per_s_runs"][0] > 0 and row["blocks_vs_bf16_runs"][0] > 0


def test_hybrid_spec_quick_run_prices_a_verification(tmp_path):
    """benchmarks/hybrid_spec.py --quick: plain steps and verifications of 1..3 tokens on a
    recording cache of the tiny Qwen3.5-MoE file, and the break-even figures from them."""
    out = _quick(tmp_path, "hybrid_spec.py", "--g-max", "3")
    assert out["config"]["machine"]["cpu"] and out["config"]["g_max"] == 3
    (row,) = out["rows"]
    assert "error" not in row, row
    assert row["plain_step_ms"] > 0 and row["planned_steps"] > 0  # the one-call plan
    assert set(row["verify_ms"]) == {"1", "2", "3"}
    assert all(v > 0 for v in row["verify_ms"].values())
    for g, t in row["break_even_tokens"].items():
        assert abs(t - row["verify_ms"][g] / row["plain_step_ms"]) < 0.01 * t + 1e-3


def test_hybrid_serve_quick_run_batches_decode_steps(tmp_path):
    """benchmarks/hybrid_serve.py --quick: the server's worker on the tiny Qwen3.5-MoE file,
    3 requests decoded in batched forwards and one forward each: both give every request the
    same tokens, only the batched mode runs batched steps, and the figures are consistent."""
    out = _quick(tmp_path, "hybrid_serve.py")
    assert out["config"]["machine"]["cpu"] and out["config"]["clients"] == [1, 3]
    assert "not run here" in out["peers"]["llama-server"]
    rows = {r["clients"]: r for r in out["rows"]}
    assert set(rows) == {1, 3} and all("error" not in r for r in rows.values()), out["rows"]
    for B, r in rows.items():
        assert r["same_tokens_runs"] == [True]
        assert r["alone_batched_steps_runs"] == [0]
        assert (r["batched_batched_steps_runs"][0] > 0) == (B > 1)
        assert r["vs_alone_runs"] == [round(r["batched_decode_tok_s_runs"][0]
                                            / r["alone_decode_tok_s_runs"][0], 3)]
        assert 0 < r["batched_out_tok_s_runs"][0] <= r["batched_decode_tok_s_runs"][0] * 1.5


def test_hybrid_serve_quick_run_verifies_drafts_in_a_batch(tmp_path):
    """benchmarks/hybrid_serve.py --quick --drafter self: at 3 clients the batched mode verifies
    drafts in batched forwards, the alone mode in none; all three modes (plain decoding
    included) give every request the same tokens, and the ratios are per round."""
    out = _quick(tmp_path, "hybrid_serve.py", "--drafter", "self")
    assert out["config"]["drafter"] == "self" and out["config"]["controller"] == "static:3"
    assert out["config"]["servers"] == "kept"  # one worker per mode and B, as a server
    rows = {r["clients"]: r for r in out["rows"]}
    assert set(rows) == {1, 3} and all("error" not in r for r in rows.values()), out["rows"]
    r = rows[3]
    assert r["same_tokens_runs"] == [True] and r["batched_batched_verifications_runs"][0] > 0
    assert r["alone_batched_verifications_runs"] == [0] and r["alone_proposed_runs"][0] > 0
    assert r["plain_proposed_runs"] == [None] and len(r["vs_plain_runs"]) == 1


def test_hybrid_prefill_quick_run_times_both_engines_and_both_rule_forms(tmp_path):
    """benchmarks/hybrid_prefill.py --quick --rule-ab 1: the tiny Qwen3.5-MoE file's prompt
    forward at 32 and 512 tokens, split by part, llama.cpp's prompt processing or why it did
    not run, and the chunked rule against the kernel on one and on 16 prompts."""
    out = _quick(tmp_path, "hybrid_prefill.py", "--rule-ab", "1")
    assert out["config"]["machine"]["cpu"] and out["config"]["prompt_tokens"] == [32, 512]
    rows = {(r["name"], r["prompt_tokens"]): r for r in out["rows"]}
    for T in (32, 512):
        s, ll = rows[("specmoe-gguf", T)], rows[("llama.cpp-Q4_0", T)]
        assert s["tok_per_s_runs"][0] > 0 and not s["errors"], s
        parts = s["ms_by_part_runs"][0]
        assert set(parts) == {"linear_attn", "self_attn", "moe", "other"}
        assert parts["linear_attn"] > 0 and parts["moe"] > 0, parts
        assert ll["tok_per_s_runs"][0] or "llama-bench" in " ".join(ll["errors"] or []), ll
    (ab,) = out["rule_ab_runs"]
    assert set(ab) == {"1x32", "1x512", "16x32"}
    assert all(len(v["chunked_over_kernel_runs"]) == 1 and v["kernel_s"][0] > 0
               for v in ab.values()), ab

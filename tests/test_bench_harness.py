"""benchmarks/c/ffn_rows.c (the one-token row loops timed in C, ffn_fast.c's notes cite it)
includes ffn_fast.c itself, so a change to that file's internals can break it unseen: build it
here with warnings as errors, and run it on a small rotation where the CPU has the fast path.
benchmarks/c/mla_decode.c (the absorbed MLA call timed in C, mla.c's notes cite it) likewise,
against csrc/kernels/attn.h."""
import json
import os
import subprocess
from pathlib import Path

import pytest

from specmoe import _C

# The C benchmark harnesses' builds and smoke runs (benchmark tools, not the library):
# `make test-bench`, which .ci/run calls, runs them
pytestmark = pytest.mark.skipif(not os.environ.get("SPECMOE_TEST_BENCH"),
                                reason="benchmark smoke runs: make test-bench runs them")

REPO = Path(__file__).resolve().parent.parent


def _build(tmp_path_factory, cc: str, name: str, srcs: list, flags: list) -> Path:
    """benchmarks/c/<name> and ``srcs`` built by cc with warnings as errors."""
    out = tmp_path_factory.mktemp("harness") / name
    k = REPO / "csrc" / "kernels"
    r = subprocess.run([cc, "-O1", *flags, "-Wall", "-Wextra", "-Werror", f"-I{REPO / 'csrc'}",
                        f"-I{k}", "-o", str(out), str(REPO / "benchmarks" / "c" / f"{name}.c"),
                        *(str(k / f) for f in srcs), str(REPO / "csrc" / "common.c"), "-lm",
                        "-lpthread"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(scope="module")
def ffn_rows(tmp_path_factory, c_compiler):
    return _build(tmp_path_factory, c_compiler, "ffn_rows",
                  ["ffn.c", "ffn_avx2.c", "ffn_avx512.c", "ffn_fast_avx2.c", "ffn_i2.c",
                   "ffn_blocks.c", "pool.c"], [])


@pytest.mark.parametrize("args", [["int4", "256", "512", "128"], ["int4", "256", "2560", "64"],
                                  ["int8", "256", "512"]])
def test_ffn_rows_builds_and_reports(ffn_rows, args):
    if not _C.KernelContext(1).features.get("avx512_vnni"):
        pytest.skip("the harness runs the AVX-512 VNNI fast path only")
    r = subprocess.run([str(ffn_rows), *args, "3"], capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, FFN_ROWS_ROTATION=str(8 << 20)))
    assert r.returncode == 0, r.stderr
    row = json.loads(r.stdout)
    assert row["dtype"] == args[0] and row["I"] == int(args[2]) and row["copies"] >= 3
    for key in ("read_gbps", "gateup_gbps", "down_gbps", "expert_gbps"):
        assert row[key] > 0, row


def test_ffn_rows_refuses_bad_shapes(ffn_rows):
    r = subprocess.run([str(ffn_rows), "int4", "100", "512"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "multiples of 64" in r.stderr
    r = subprocess.run([str(ffn_rows), "f16", "256", "512"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "int4 or int8" in r.stderr


@pytest.fixture(scope="module")
def mla_decode(tmp_path_factory, c_compiler):
    # every kernel file: GGUF block weights go through ffn_blocks.c's rows (smoe_blocks_matvec)
    kernels = sorted(p.name for p in (REPO / "csrc" / "kernels").glob("*.c"))
    return _build(tmp_path_factory, c_compiler, "mla_decode", kernels,
                  ["-std=c11", "-D_GNU_SOURCE"])


@pytest.mark.parametrize("S,threads", [(1, 1), (37, 2)])
def test_mla_decode_builds_and_reports(mla_decode, S, threads):
    r = subprocess.run([str(mla_decode), str(S), str(threads), "2"], capture_output=True,
                       text=True, timeout=120,
                       env=dict(os.environ, MLA_ROTATION=str(4 << 20), MLA_HEADS="2"))
    assert r.returncode == 0, r.stderr
    row = json.loads(r.stdout)
    assert row["S"] == S and row["threads"] == threads and row["heads"] == 2
    assert row["layers"] >= 2 and row["finite"] is True
    for key in ("call_us", "call_gbps", "read_gbps", "frac_of_read"):
        assert row[key] > 0, row


def test_mla_decode_refuses_bad_arguments(mla_decode):
    r = subprocess.run([str(mla_decode), "0"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "S must be" in r.stderr


def test_dense_gguf_benchmark_smoke(tmp_path, monkeypatch):
    """benchmarks/dense_gguf.py on a tiny Q4_0 GGUF file: one round at one thread, a row per
    dense format with its tok/s and bytes (the file's blocks fewer bytes than bf16)."""
    import sys

    import torch

    from specmoe.models.testing import save_gguf, tiny_model
    monkeypatch.setenv("SPECMOE_CACHE", str(tmp_path / "cache"))
    path, _ = save_gguf(tiny_model("qwen3_moe", hidden=256, dtype=torch.bfloat16),
                        tmp_path / "t.gguf", qtype="Q4_0")
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "dense_gguf.py"), str(path),
                        "--threads", "1", "--rounds", "1", "--json"],
                       capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, SPECMOE_CACHE=str(tmp_path / "cache")))
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    run = out["runs"][0]
    assert out["host"]["threads"] == [1] and run["threads"] == 1
    assert all(len(run["tok_per_s_runs"][d]) == 1 and run["tok_per_s_runs"][d][0] > 0
               for d in ("bf16", "gguf", "int4"))
    assert run["dense_bytes"]["gguf"] < run["dense_bytes"]["bf16"]
    assert len(run["gguf_vs_bf16_runs"]) == 1


def test_dense_linear_benchmark_smoke():
    """benchmarks/dense_linear.py on one small shape: a row per dtype and token count, the
    bf16 rows with the widened product's time beside torch's and the C kernels', and the
    host and torch's bf16 answer in the results."""
    import sys
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "dense_linear.py"),
                        "--shapes", "96x64", "--dtypes", "bf16,int8", "--tokens", "1,20",
                        "--threads", "1", "--repeats", "3", "--calls", "1", "--json"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["host"]["threads"] == 1 and isinstance(out["config"]["torch_bf16_fast"], bool)
    rows = {(x["dtype"], x["tokens"]): x for x in out["rows"]}
    assert set(rows) == {(d, t) for d in ("bf16", "int8") for t in (1, 20)}
    for (dt, _), x in rows.items():
        assert x["torch_ms"] > 0 and x["c_ms"] > 0
        assert ("widened_ms" in x) == (dt == "bf16")
        if dt == "bf16":
            assert x["widened_ms"] > 0 and x["widened_vs_torch"] > 0 and x["widened_vs_c"] > 0


def test_bf16_prefill_benchmark_smoke(tmp_path):
    """benchmarks/bf16_prefill.py on tiny shapes: every setting timed in every round, the
    per-round ratios, and the host and torch's bf16 answer in the results."""
    import sys
    r = subprocess.run([sys.executable, str(REPO / "benchmarks" / "bf16_prefill.py"), "--quick",
                        "--layers", "2", "--prompt-tokens", "24", "--rounds", "2", "--threads",
                        "1", "--workdir", str(tmp_path), "--json"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["host"]["threads"] == 1 and isinstance(out["config"]["torch_bf16_fast"], bool)
    (row,) = out["rows"]
    assert row["prompt_tokens"] == 24
    assert all(len(v) == 2 and min(v) > 0 for v in row["seconds"].values())
    assert set(row["seconds"]) == {"torch_bf16", "c_kernels", "widened"}
    assert len(row["widened_vs_c_kernels"]["runs"]) == 2
    assert isinstance(row["greedy_token_equal"], bool)


def test_int_products_builds_checks_and_reports(tmp_path_factory, c_compiler):
    """benchmarks/c/int_products.c (the AVX2 rows' compute ceiling, performance.md's Zen 1
    section): built with warnings as errors; its loops' results checked against plain C by
    the harness itself (exit 1 otherwise), then one round timed."""
    if _C.KernelContext(1).isa_max not in ("avx2", "avx512"):
        pytest.skip("needs AVX2")
    exe = _build(tmp_path_factory, c_compiler, "int_products", [], ["-mavx2", "-mfma"])
    r = subprocess.run([str(exe), "1"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    row = json.loads(r.stdout)
    assert row["rounds"] == 1 and row["int4_gbps"] > 0 and row["int8_gbps"] > 0, row

"""Qwen3.5-MoE (or Qwen3-Next, or GLM-4.7-Flash) decode speed on the same GGUF file: specmoe
against llama.cpp, and where a specmoe decode step spends its time.

    python benchmarks/hybrid_peers.py --json [--rounds 2] [--threads 1,2] [--layers 4]
    python benchmarks/hybrid_peers.py --arch qwen3next --json    # Qwen3-Next-80B-A3B's shapes
    python benchmarks/hybrid_peers.py --arch glm47flash --json   # GLM-4.7-Flash's shapes
    python benchmarks/hybrid_peers.py --arch ernie45 --ab 3 --json   # ERNIE-4.5-21B-A3B's
    python benchmarks/hybrid_peers.py --arch glm45air --ab 3 --json  # GLM-4.5-Air's
    python benchmarks/hybrid_peers.py --quick --json     # small shapes, 1 round: a smoke test

Qwen3.5's MoE models (Qwen3.5-35B-A3B and its family) put three gated-DeltaNet
(linear-attention) layers before each full-attention one; llama.cpp reads them as
``qwen35moe`` GGUF files, and so does specmoe (``specmoe.storage.gguf``).  This measures how
fast specmoe decodes such a file where the attention of most layers is not a kind its C
decoder layer runs.

Model.  A random-weight Qwen3.5-MoE text model at Qwen3.5-35B-A3B's per-layer shapes (hidden
2048; full attention: 16 heads of 256, 2 k/v heads, the output gate in q_proj, a quarter of
each head rotary; gated DeltaNet: 16 key heads and 32 value heads of 128, conv kernel 4;
experts of FFN 512, top-8, a shared expert of 512), with fewer layers (``--layers``, default
4: three linear-attention layers and a full-attention one, the model's own pattern), fewer
experts (``--experts``, default 32 of 256: the bytes a token reads do not depend on the
count) and the zoo tokenizer's 8192-token vocabulary (llama.cpp needs a vocabulary in the
file).  ``--arch qwen3next``: Qwen3-Next-80B-A3B's shapes instead (the same widths, q, k, v, z
interleaved per key head in one projection, top-10 of 512 experts, no MRoPE; llama.cpp's
``qwen3next`` files).  ``--arch glm47flash``: GLM-4.7-Flash's shapes (hidden 2048; MLA with
20 heads, q rank 768, kv rank 512, nope/rope/value dims 192/64/256; a dense first layer of
10240; experts of 1536, top-4, a shared expert, DeepSeek-V3's sigmoid router with a
correction bias, one group) as a ``deepseek2`` file: not a hybrid, the same harness (its
layers all count as full attention).  ``--arch ernie45``: ERNIE-4.5-21B-A3B's shapes (hidden
2560, 20 heads of 128, 4 k/v heads, the rotary on each head's pairs; a dense first layer of
12288; experts of 1536, top-6, two shared experts, the softmax router with a correction
bias), an ``ernie4_5-moe`` file; ``--arch glm45air``: GLM-4.5-Air's (hidden 4096, 96 heads of
128, 8 k/v heads, q/k/v biases, half of each head rotary; a dense first layer of 10944;
experts of 1408, top-8, a shared expert, the sigmoid router), a ``glm4moe`` file.  Written
once as a Q4_0 GGUF file by ``specmoe.models.testing.save_gguf`` (the way llama.cpp's
converter writes it: its checked against the converter in
tests/test_gguf_converter.py and against llama-server in tests/test_gguf_llama_cpp.py), every
matrix Q4_0, norms and routers F32, under ``--workdir`` (default ``~/.cache/specmoe/bench``;
never committed).

Rows (each round runs both, in alternating order, each thread count of ``--threads``):

* ``llama.cpp-Q4_0``: ``llama-bench -m FILE -p 0 -n 32 -d 64 -r 1``: 32 generated tokens
  after a 64-token context (its ``avg_ts``).
* ``specmoe-gguf``: ``specmoe.from_pretrained(FILE, cache=1.0)`` (defaults: the Q4_0 experts
  kept as they are, every dense matrix the file holds in blocks run on those blocks,
  ``dense="auto"``), every expert loaded before timing; ``model.generate`` (greedy, no
  end-of-sequence stop) of 33 tokens after a 64-token prompt, 32 decode steps timed between
  the logits of the first forward pass and the last (as ``benchmarks/decode_peers.py`` times
  ``model.generate``, as plain decoding does on every model), after a warm-up
  generation.  Each step of the timed generation is one ``_C.DecodePlan`` call (every layer
  of these models is one C call: ``planned_steps`` counts them).  Then an instrumented
  generation: wall time inside the linear-attention and the full-attention decoder layers
  (forward hooks on the layers, each with its norms and MoE block), per decode step; the rest
  of a step is ``other`` (embedding, rotary, masks, final norm, lm_head, sampling, the loop).
  The hooks set the plan aside, so that generation takes the per-layer path (each layer one
  C call from Python, the model's forward around them): its ``other`` is that path's.

``--ab N``: in the specmoe worker, after each thread count's row, N interleaved repeats of
the timed decode with specmoe's one-call paths off (the class forwards and no decode step:
torch glue around the same C projections, attention kernel, norms and experts, the router in
torch) and on, in the same process on the same loaded model (``one_call_vs_torch_glue``).

``vs_llama_cpp`` is specmoe's tok/s over llama.cpp's in the same round; ``vs_llama_cpp_runs``
lists every round.  The results name the host (CPU model, ISA, threads).  llama.cpp is the
build under ``$SPECMOE_PEERS`` (``benchmarks/big_model.py --build-peers``); a row that cannot
run carries ``error`` with the reason.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import hostinfo  # noqa: E402
from gptoss_peers import one_call_forwards, set_forwards  # noqa: E402

PROMPT, DECODE, WARM = 64, 32, 8


def log(*a: Any) -> None:
    print("[hybrid_peers]", *a, file=sys.stderr, flush=True)


ARCHS = {"qwen35moe": "Qwen3.5-35B-A3B", "qwen3next": "Qwen3-Next-80B-A3B",
         "glm47flash": "GLM-4.7-Flash", "ernie45": "ERNIE-4.5-21B-A3B",
         "glm45air": "GLM-4.5-Air"}


def config(layers: int, experts: int, vocab: int, quick: bool = False,
           arch: str = "qwen35moe") -> Any:
    """Qwen3.5-35B-A3B's per-layer shapes (see the module docstring), or with ``arch``
    "qwen3next" Qwen3-Next-80B-A3B's (the same widths, top-10, full rotary theta 10^7, no
    MRoPE), or "glm47flash" GLM-4.7-Flash's, "ernie45" ERNIE-4.5-21B-A3B's, "glm45air"
    GLM-4.5-Air's; ``quick``: an eighth of every width, for a smoke run."""
    from transformers import (DeepseekV3Config, Ernie4_5_MoeConfig, Glm4MoeConfig,
                              Qwen3_5MoeTextConfig, Qwen3NextConfig)
    kinds = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention"
             for i in range(layers)]
    w = 8 if quick else 1
    if arch == "ernie45":  # the rotary on each head's pairs, a dense first layer, 2 shared
        return Ernie4_5_MoeConfig(
            vocab_size=vocab, hidden_size=2560 // w, num_hidden_layers=layers,
            num_attention_heads=20 // w, num_key_value_heads=max(1, 4 // w),
            intermediate_size=12288 // w, moe_intermediate_size=1536 // w,
            moe_num_experts=experts, moe_k=6, moe_num_shared_experts=2,
            moe_layer_start_index=1, moe_layer_end_index=layers - 1, moe_layer_interval=1,
            max_position_embeddings=4096, tie_word_embeddings=False, use_bias=False,
            rope_parameters={"rope_type": "default", "rope_theta": 500000.0},
            bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "glm45air":  # q/k/v biases, half of each head rotary, a dense first layer
        return Glm4MoeConfig(
            vocab_size=vocab, hidden_size=4096 // w, num_hidden_layers=layers,
            num_attention_heads=96 // w, num_key_value_heads=8 // w, head_dim=128 // w,
            intermediate_size=10944 // w // 32 * 32,  # (whole blocks in quick runs too)
            moe_intermediate_size=1408 // w // 32 * 32,
            n_routed_experts=experts, num_experts_per_tok=8, n_shared_experts=1,
            first_k_dense_replace=1, n_group=1, topk_group=1, norm_topk_prob=True,
            routed_scaling_factor=1.0, attention_bias=True, use_qk_norm=False,
            num_nextn_predict_layers=0, max_position_embeddings=4096,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0,
                             "partial_rotary_factor": 0.5},
            bos_token_id=1, eos_token_id=2, pad_token_id=0)
    if arch == "glm47flash":  # DeepSeek-V3's form: MLA, a dense first layer, sigmoid routing
        return DeepseekV3Config(
            vocab_size=vocab, hidden_size=2048 // w, num_hidden_layers=layers,
            num_attention_heads=20 // w, num_key_value_heads=20 // w,
            q_lora_rank=768 // w, kv_lora_rank=512 // w, qk_nope_head_dim=192 // w,
            qk_rope_head_dim=64 // w, v_head_dim=256 // w, intermediate_size=10240 // w,
            moe_intermediate_size=1536 // w, n_routed_experts=experts,
            num_experts_per_tok=4, n_shared_experts=1, first_k_dense_replace=1, n_group=1,
            topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.8,
            max_position_embeddings=4096, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
            bos_token_id=1, eos_token_id=2, pad_token_id=0)
    rope = {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25}
    common = dict(  # the two models' shared widths
        vocab_size=vocab, hidden_size=2048 // w, num_hidden_layers=layers,
        num_attention_heads=16 // w, num_key_value_heads=2, head_dim=256 // w,
        max_position_embeddings=4096, linear_conv_kernel_dim=4,
        linear_key_head_dim=128 // w, linear_value_head_dim=128 // w,
        linear_num_key_heads=16 // w, linear_num_value_heads=32 // w,
        moe_intermediate_size=512 // w, shared_expert_intermediate_size=512 // w,
        num_experts=experts, layer_types=kinds, tie_word_embeddings=False, bos_token_id=1,
        eos_token_id=2, pad_token_id=0)
    if arch == "qwen3next":
        return Qwen3NextConfig(
            **common, intermediate_size=5120 // w, num_experts_per_tok=min(10, experts),
            norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[],
            rope_parameters=rope)
    return Qwen3_5MoeTextConfig(
        **common, num_experts_per_tok=8,
        rope_parameters={**rope, "mrope_section": [11, 11, 10], "mrope_interleaved": True})


def write_file(path: Path, layers: int, experts: int, quick: bool = False,
               arch: str = "qwen35moe") -> dict[str, Any]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specmoe import zoo
    from specmoe.models.testing import save_gguf
    if path.is_file():
        return {"path": str(path), "bytes": path.stat().st_size, "written": False}
    tok = AutoTokenizer.from_pretrained(zoo.path("tiny-moe"))
    torch.manual_seed(0)
    t0 = time.time()
    cfg = config(layers, experts, tok.vocab_size, quick, arch)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # routers far from uniform, as in trained models
        for n, p in model.named_parameters():
            if n.endswith("mlp.gate.weight"):
                p.normal_(0.0, 0.02 * 8)
        for n, b in model.named_buffers():  # (GLM-4.7-Flash's sigmoid router's bias)
            if n.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    tmp = path.with_suffix(".tmp")
    path.parent.mkdir(parents=True, exist_ok=True)
    save_gguf(model, tmp, qtype="Q4_0", tokenizer=tok)
    tmp.rename(path)
    log(f"wrote {path} ({path.stat().st_size / 2**20:.0f} MiB) in {time.time() - t0:.0f} s")
    return {"path": str(path), "bytes": path.stat().st_size, "written": True,
            "seconds": round(time.time() - t0, 1)}


def llama_row(bench: Path, path: Path, threads: int) -> dict[str, Any]:
    argv = [str(bench), "-m", str(path), "-p", "0", "-n", str(DECODE), "-d", str(PROMPT),
            "-r", "1", "-t", str(threads), "-o", "json"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=1800,
                       env=hostinfo.peer_env())
    if r.returncode != 0:
        return {"error": "llama-bench failed: " + " | ".join(r.stderr.strip().splitlines()[-3:])}
    try:
        res = json.loads(r.stdout)
        return {"tok_per_s": float(res[-1]["avg_ts"])}
    except (ValueError, KeyError, IndexError) as exc:
        return {"error": f"llama-bench printed no result ({exc}): {r.stdout[-300:]}"}


def worker(path: str, threads: list[int], ab: int = 0) -> None:
    """One specmoe process: every thread count in turn, then (ab) that many interleaved
    repeats of the decode with the one-call paths off and on; one JSON line on stdout."""
    import numpy as np
    import torch

    import specmoe
    from specmoe.runtime import kernels
    from big_model import load_every_expert
    model = specmoe.from_pretrained(path, cache=1.0, progress=False, prefetch=False)
    eng = specmoe.engine_of(model)
    load_every_expert(eng)
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    prompt = rng.integers(3, vocab, PROMPT).tolist()
    warm = rng.integers(3, vocab, PROMPT).tolist()

    class Clock:
        """A logits processor: the time of each forward pass of model.generate (the first is
        the prefill); at the first one the parts' sums restart (``spent``, below)."""

        def __init__(self) -> None:
            self.t: list[float] = []

        def __call__(self, ids: Any, scores: Any) -> Any:
            if not self.t:
                spent.clear()
            self.t.append(time.perf_counter())
            return scores

    def steps(ids: list[int], n: int) -> Clock:
        """n decode steps after the prompt ``ids`` by model.generate (plain decoding:
        speculation's costs on these models are benchmarks/hybrid_spec.py's)."""
        from transformers import LogitsProcessorList
        clock = Clock()
        x = torch.tensor([ids])
        with torch.inference_mode():
            model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n + 1,
                           do_sample=False, logits_processor=LogitsProcessorList([clock]),
                           pad_token_id=0)
        if len(clock.t) != n + 1:
            raise RuntimeError(f"expected {n + 1} forward passes, saw {len(clock.t)}")
        return clock

    model.generation_config.eos_token_id = None  # (as llama.cpp's --ignore-eos)
    # where a step goes: wall time inside each kind of decoder layer (forward hooks on the
    # layers: a linear-attention layer is one C call, its module and MoE block inside it),
    # counted from the end of the prefill (the first forward pass's logits) to the last step's
    spent: dict[str, float] = {}
    mods = [("linear_attention_layers" if getattr(layer, "linear_attn", None) is not None
             else "full_attention_layers", layer) for layer in model.model.layers]
    out: dict[str, Any] = {"dense": eng.dense.dtype if getattr(eng, "dense", None) else None,
                           "rows": {}}
    fused = one_call_forwards(model)
    out["one_call_modules"] = len(fused)
    for th in threads:
        torch.set_num_threads(th)
        kernels.set_num_threads(th)
        steps(warm, WARM)
        from specmoe.models.decode_step import decode_step_of
        dstep = decode_step_of(model)
        p0 = dstep.planned if dstep is not None else 0
        c = steps(prompt, DECODE)
        row: dict[str, Any] = {"tok_per_s": DECODE / (c.t[-1] - c.t[0]),
                               "loop": "model.generate",
                               # steps that were one _C.DecodePlan call (the hooked run's
                               # are not: a hook on a layer sets the plan aside)
                               "planned_steps": (dstep.planned - p0) if dstep else 0}
        with part_timers(mods, spent):
            clock = steps(prompt, DECODE)
        step_ms = (clock.t[-1] - clock.t[0]) / DECODE * 1e3
        parts = {k: v / DECODE * 1e3 for k, v in spent.items()}
        parts["other"] = step_ms - sum(parts.values())
        row["instrumented_step_ms"] = round(step_ms, 3)
        row["step_ms_by_part"] = {k: round(v, 3) for k, v in parts.items()}
        for _ in range(ab):  # --ab: specmoe's one-call paths off, then on, the same model
            for on in (False, True):
                set_forwards(fused, on)
                if dstep is not None:
                    dstep.enabled = on
                steps(warm, 2)  # (a warm-up after the switch)
                c = steps(prompt, DECODE)
                row.setdefault("one_call_tok_s_runs" if on else "torch_glue_tok_s_runs",
                               []).append(round(DECODE / (c.t[-1] - c.t[0]), 3))
        if ab:
            row["one_call_vs_torch_glue_runs"] = [
                round(x / y, 3) for x, y in zip(row["one_call_tok_s_runs"],
                                                row["torch_glue_tok_s_runs"])]
        out["rows"][str(th)] = row
    eng.close()
    print(json.dumps(out))


def run_worker(script: str, path: Path, args: list[str]) -> dict[str, Any]:
    """``script --_worker PATH ARGS`` in a process of its own: the JSON object of its last
    stdout line, or {"error": ...} with the last lines of its stderr (how hybrid_peers,
    hybrid_spec and hybrid_serve run their timed part)."""
    r = subprocess.run([sys.executable, script, "--_worker", str(path), *args],
                       capture_output=True, text=True, timeout=3600)
    if r.returncode != 0:
        return {"error": "specmoe worker failed: " +
                " | ".join(r.stderr.strip().splitlines()[-3:])}
    return json.loads(r.stdout.strip().splitlines()[-1])


def specmoe_row(path: Path, threads: list[int], ab: int = 0) -> dict[str, Any]:
    return run_worker(__file__, path, ["--threads", ",".join(map(str, threads)), "--ab", str(ab)])


@contextlib.contextmanager
def part_timers(mods: list[tuple[str, Any]], spent: dict[str, float]) -> Iterator[None]:
    """While the block runs, forward hooks on each ``(kind, module)`` of ``mods`` add the wall
    seconds spent inside the module to ``spent[kind]`` (hybrid_peers' layers, hybrid_prefill's
    mixers and MoE blocks); the hooks are removed at the end."""
    start: dict[int, float] = {}

    def pre(m: Any, a: Any) -> None:
        start[id(m)] = time.perf_counter()

    def post(kind: str) -> Any:
        def hook(m: Any, a: Any, o: Any) -> None:
            spent[kind] = spent.get(kind, 0.0) + time.perf_counter() - start.pop(id(m))
        return hook
    handles = [h for kind, mod in mods for h in (mod.register_forward_pre_hook(pre),
                                                 mod.register_forward_hook(post(kind)))]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def paired_runs(rounds: list[dict[str, Any]], key: str
                ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[float]]:
    """For one row ``key`` (a thread count, a prompt length) of :func:`peer_rounds`' rounds:
    specmoe's row and llama.cpp's in each round (llama.cpp's whole result where it has no
    such row: its error), and specmoe / llama.cpp tok/s of the rounds where both ran."""
    sm = [r["specmoe"].get("rows", {}).get(key, {}) for r in rounds]
    lc = [r["llama.cpp"].get(key, r["llama.cpp"]) for r in rounds]
    ratios = [s["tok_per_s"] / c["tok_per_s"] for s, c in zip(sm, lc)
              if "tok_per_s" in s and "tok_per_s" in c]
    return sm, lc, ratios


def peer_rounds(n: int, specmoe: Callable[[], dict[str, Any]],
                llama: Callable[[Path], dict[str, Any]], tag: str = "hybrid_peers"
                ) -> list[dict[str, Any]]:
    """``n`` rounds, each ``{"specmoe": specmoe(), "llama.cpp": llama(llama_bench_path)}`` in
    alternating order (llama.cpp first in the first round); where llama-bench is not built
    under ``$SPECMOE_PEERS``, llama.cpp's entry is an ``error`` saying so (how hybrid_peers and
    hybrid_prefill interleave their two engines)."""
    peers = Path(os.environ.get("SPECMOE_PEERS", "~/.cache/specmoe/peers")).expanduser()
    bench = peers / "llama.cpp-build" / "bin" / "llama-bench"
    rounds: list[dict[str, Any]] = []
    for k in range(n):
        got: dict[str, Any] = {}
        for who in (["llama.cpp", "specmoe"] if k % 2 == 0 else ["specmoe", "llama.cpp"]):
            print(f"[{tag}] round {k + 1}/{n}: {who}", file=sys.stderr, flush=True)
            if who == "specmoe":
                got[who] = specmoe()
            elif not bench.is_file():
                got[who] = {"error": f"llama-bench not built under {peers} "
                                     "(benchmarks/big_model.py --build-peers)"}
            else:
                got[who] = llama(bench)
        rounds.append(got)
    return rounds


def common_args(ap: argparse.ArgumentParser, rounds: int) -> None:
    """The options this benchmark shares with benchmarks/hybrid_spec.py (the file, its shapes,
    the rounds and threads, where the results go)."""
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    ap.add_argument("--quick", action="store_true",
                    help="an eighth of every width, 8 experts, 1 round: a smoke test")
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--workdir", default=os.environ.get("SPECMOE_BENCH",
                                                        "~/.cache/specmoe/bench"))
    ap.add_argument("--save", help="also write the JSON object to this file")
    ap.add_argument("--_worker", help=argparse.SUPPRESS)


def gguf_path(a: argparse.Namespace) -> Path:
    """The benchmark file for the parsed options ``a`` (written once by :func:`write_file`)."""
    work = Path(a.workdir).expanduser() / "hybrid_peers"
    return work / f"{a.arch}-L{a.layers}-E{a.experts}{'-quick' if a.quick else ''}-Q4_0.gguf"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_args(ap, rounds=2)
    ap.add_argument("--arch", choices=sorted(ARCHS), default="qwen35moe",
                    help="the model's form: Qwen3.5-MoE (default), Qwen3-Next, or (not "
                         "hybrids, the same harness) GLM-4.7-Flash (DeepSeek-V3's MLA and "
                         "sigmoid-routed MoE), ERNIE-4.5-21B-A3B, GLM-4.5-Air")
    ap.add_argument("--ab", type=int, default=0, metavar="N",
                    help="in the specmoe worker, N interleaved repeats with the one-call paths "
                         "off (class forwards, no decode step: torch glue around the same C "
                         "kernels, the router in torch) and on")
    a = ap.parse_args()
    threads = [int(t) for t in a.threads.split(",")]
    if a._worker:
        worker(a._worker, threads, a.ab)
        return
    if a.quick:
        a.experts, a.rounds = 8, 1
    path = gguf_path(a)
    made = write_file(path, a.layers, a.experts, a.quick, a.arch)
    rounds = peer_rounds(a.rounds, lambda: specmoe_row(path, threads, a.ab),
                         lambda bench: {str(t): llama_row(bench, path, t) for t in threads})
    rows = []
    for t in threads:
        sm, lc, ratios = paired_runs(rounds, str(t))
        rows.append({"name": "specmoe-gguf", "threads": t,
                     "tok_per_s_runs": [s.get("tok_per_s") for s in sm],
                     "planned_steps_runs": [s.get("planned_steps") for s in sm],
                     "step_ms_by_part_runs": [s.get("step_ms_by_part") for s in sm],
                     "vs_llama_cpp": statistics.median(ratios) if ratios else None,
                     "vs_llama_cpp_runs": [round(x, 4) for x in ratios],
                     **{k: [v for s in sm for v in s.get(k, [])]
                        for k in ("one_call_tok_s_runs", "torch_glue_tok_s_runs",
                                  "one_call_vs_torch_glue_runs") if a.ab},
                     "errors": [r["specmoe"]["error"] for r in rounds
                                if "error" in r["specmoe"]] or None})
        rows.append({"name": "llama.cpp-Q4_0", "threads": t,
                     "tok_per_s_runs": [c.get("tok_per_s") for c in lc],
                     "errors": [c["error"] for c in lc if "error" in c] or None})
    res = {"config": {"model": f"{a.arch} ({ARCHS[a.arch]} per-layer shapes)",
                      "layers": a.layers, "experts": a.experts, "quick": a.quick,
                      "prompt_tokens": PROMPT,
                      "decode_tokens": DECODE, "rounds": a.rounds, "file": made,
                      "machine": hostinfo.host(threads),
                      "dense": next((r["specmoe"].get("dense") for r in rounds
                                     if "dense" in r["specmoe"]), None)},
           "rows": rows}
    hostinfo.emit(res, a.save, a.json)


if __name__ == "__main__":
    main()

"""A hybrid's prompt forward (prefill) against llama.cpp on the same GGUF file, and where
specmoe's forward spends its time: the figure behind the hybrid server's first tokens.

    python benchmarks/hybrid_prefill.py --json [--rounds 3] [--threads 2] [--prompt-tokens 32,512]
    python benchmarks/hybrid_prefill.py --quick --json     # small shapes, 1 round: a smoke test

The file is ``benchmarks/hybrid_peers.py``'s (Qwen3.5-MoE's per-layer shapes, 4 layers, 32
experts, every matrix Q4_0; ``--arch qwen3next`` Qwen3-Next's), written once.  The server
(``benchmarks/hybrid_serve.py``, ``serve.py --models hybrid``) prefills each hybrid prompt in
one forward of its own (or, with ``--batch-prefill``, prompts of one length together): its
first tokens wait on this forward, at the prompt's length (32 tokens there) or at the group's
total (16 x 32 = 512).

Rows, per round, per prompt length T (the two in alternating order by round):

* ``llama.cpp-Q4_0``: ``llama-bench -m FILE -p T -n 0 -r 2``: its prompt-processing tok/s
  (``avg_ts``, the mean of 2 repetitions);
* ``specmoe-gguf``: ``specmoe.from_pretrained(FILE, cache=1.0)`` (the defaults, as
  ``hybrid_peers.py``), every expert loaded before timing, one warm-up forward per length,
  then the best of 2 forwards ``model(ids, use_cache=True, logits_to_keep=1)`` of T random
  token ids on a fresh cache (what the server's prefill runs): T / seconds.  Then one
  instrumented forward per length: wall time inside the parts (forward hooks) ``linear_attn``
  (the gated DeltaNet mixers: their projections in C, the chunked delta rule in torch),
  ``self_attn`` (the full-attention mixers), ``moe`` (the sparse MoE blocks: router, experts,
  shared expert), ``other`` (norms, embedding, lm_head, masks, the model's glue), in ms.

``--rule-ab N``: in the specmoe worker, N interleaved repeats of each length's forward and of
a grouped prefill (16 prompts of the first length in one forward of
:class:`specmoe.speculation.batch.BatchKV`, what the server's ``--batch-prefill`` runs) with
the gated delta rule of a prompt in transformers' chunked torch code and in specmoe's
per-token kernel (``specmoe.models.linear_attn``), on the same loaded model:
``rule_ab`` holds the seconds of each and ``chunked_over_kernel_runs`` their ratio per repeat.

``vs_llama_cpp_runs``: specmoe's tok/s over llama.cpp's in the same round.  The results name
the host (CPU model, ISA, threads).  A row that cannot run carries ``error`` with the reason.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import hostinfo  # noqa: E402
from hybrid_peers import (ARCHS, common_args, gguf_path, paired_runs, part_timers,  # noqa: E402
                          peer_rounds, run_worker, write_file)
from hybrid_serve import HYBRIDS  # noqa: E402
PARTS = ("linear_attn", "self_attn", "moe")


def llama_prefill(bench: Path, path: Path, T: int, threads: int) -> dict[str, Any]:
    """llama-bench's prompt processing of T tokens on ``path``: {"tok_per_s"} or {"error"}."""
    argv = [str(bench), "-m", str(path), "-p", str(T), "-n", "0", "-r", "2",
            "-t", str(threads), "-o", "json"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=1800,
                       env=hostinfo.peer_env())
    if r.returncode != 0:
        return {"error": "llama-bench failed: " + " | ".join(r.stderr.strip().splitlines()[-3:])}
    try:
        return {"tok_per_s": round(float(json.loads(r.stdout)[-1]["avg_ts"]), 3)}
    except (ValueError, KeyError, IndexError) as exc:
        return {"error": f"llama-bench printed no result ({exc}): {r.stdout[-300:]}"}


def rule_ab(model: Any, lengths: list[int], repeats: int, rng: Any) -> dict[str, Any]:
    """--rule-ab: each length's forward and a grouped prefill of 16 prompts, ``repeats``
    times, with the prompt's gated delta rule in transformers' chunked code and in the kernel
    (alternating which goes first), on the same model: seconds and chunked / kernel."""
    import torch

    from specmoe.speculation.batch import BatchKV
    from specmoe.speculation.decoding import cache_kwargs, new_kv
    ns = sys.modules[type(model.model.layers[0].linear_attn).__module__]
    kernel = getattr(ns, "torch_chunk_gated_delta_rule")
    chunked = getattr(kernel, "_specmoe_original", None)
    if chunked is None:
        return {"error": "the chunked rule is not dispatched to the kernel on this model"}
    vocab = model.config.vocab_size

    def timed(B: int, T: int) -> float:
        ids = torch.tensor(rng.integers(3, vocab, (B, T)))
        t0 = time.perf_counter()
        with torch.inference_mode():
            if B == 1:
                model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True,
                      logits_to_keep=1, **cache_kwargs(model, new_kv(model)))
            else:
                BatchKV(model, B).prefill(ids, torch.ones_like(ids), last_logits=True)
        return time.perf_counter() - t0

    shapes = [(1, T) for T in lengths] + [(16, lengths[0])]
    out: dict[str, Any] = {}
    try:
        for k in range(repeats):
            for B, T in shapes:
                key = f"{B}x{T}"
                for name, fn in ((("kernel", kernel), ("chunked", chunked)) if k % 2 == 0
                                 else (("chunked", chunked), ("kernel", kernel))):
                    setattr(ns, "torch_chunk_gated_delta_rule", fn)
                    if k == 0:
                        timed(B, T)  # (a warm-up of each form)
                    out.setdefault(key, {}).setdefault(f"{name}_s", []).append(
                        round(timed(B, T), 4))
    finally:
        setattr(ns, "torch_chunk_gated_delta_rule", kernel)
    for key, v in out.items():
        v["chunked_over_kernel_runs"] = [round(a / b, 3) for a, b in zip(v["chunked_s"],
                                                                         v["kernel_s"])]
    return out


def worker(path: str, threads: int, lengths: list[int], ab: int = 0) -> None:
    """One specmoe process: each length's timed forwards, then its instrumented one (then,
    with ``ab``, :func:`rule_ab`); one JSON line on stdout."""
    import numpy as np
    import torch

    import specmoe
    from big_model import load_every_expert
    from specmoe.runtime import kernels
    from specmoe.speculation.decoding import cache_kwargs, new_kv
    torch.set_num_threads(threads)
    kernels.set_num_threads(threads)
    model = specmoe.from_pretrained(path, cache=1.0, progress=False, prefetch=False)
    eng = specmoe.engine_of(model)
    load_every_expert(eng)
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size

    def forward(T: int) -> float:
        ids = torch.tensor([rng.integers(3, vocab, T).tolist()])
        t0 = time.perf_counter()
        with torch.inference_mode():
            model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=True,
                  logits_to_keep=1, **cache_kwargs(model, new_kv(model)))
        return time.perf_counter() - t0

    spent: dict[str, float] = {}
    mods = [(kind, getattr(layer, kind if kind != "moe" else "mlp"))
            for layer in model.model.layers for kind in PARTS
            if getattr(layer, kind if kind != "moe" else "mlp", None) is not None]
    out: dict[str, Any] = {"rows": {}}
    for T in lengths:
        forward(T)  # warm-up (threads, this length's buffers)
        secs = min(forward(T) for _ in range(2))
        spent.clear()
        with part_timers(mods, spent):
            total = forward(T)
        parts = {k: round(spent.get(k, 0.0) * 1e3, 2) for k in PARTS}
        parts["other"] = round(total * 1e3 - sum(parts.values()), 2)
        out["rows"][str(T)] = {"tok_per_s": round(T / secs, 3),
                               "instrumented_ms": round(total * 1e3, 2), "ms_by_part": parts}
    if ab:
        out["rule_ab"] = rule_ab(model, lengths, ab, rng)
    eng.close()
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_args(ap, rounds=3)
    ap.add_argument("--arch", choices=HYBRIDS, default="qwen35moe")
    ap.add_argument("--prompt-tokens", default="32,512",
                    help="prompt lengths, comma-separated (default: the server benchmark's "
                         "32-token prompt, and 16 of them together)")
    ap.add_argument("--rule-ab", type=int, default=0, metavar="N",
                    help="in the specmoe worker, N interleaved repeats with a prompt's gated "
                         "delta rule in transformers' chunked torch code and in the kernel")
    a = ap.parse_args()
    threads = int(a.threads.split(",")[-1])  # one thread count: the largest given
    lengths = [int(t) for t in a.prompt_tokens.split(",")]
    if a._worker:
        worker(a._worker, threads, lengths, a.rule_ab)
        return
    if a.quick:
        a.experts, a.rounds = 8, 1
    path = gguf_path(a)
    made = write_file(path, a.layers, a.experts, a.quick, a.arch)
    argv = ["--threads", str(threads), "--prompt-tokens", a.prompt_tokens,
            "--rule-ab", str(a.rule_ab)]
    rounds = peer_rounds(
        a.rounds, lambda: run_worker(__file__, path, argv),
        lambda bench: {str(T): llama_prefill(bench, path, T, threads) for T in lengths},
        "hybrid_prefill")
    rows = []
    for T in lengths:
        sm, lc, ratios = paired_runs(rounds, str(T))
        rows.append({"name": "specmoe-gguf", "prompt_tokens": T, "threads": threads,
                     "tok_per_s_runs": [s.get("tok_per_s") for s in sm],
                     "ms_by_part_runs": [s.get("ms_by_part") for s in sm],
                     "vs_llama_cpp": round(statistics.median(ratios), 3) if ratios else None,
                     "vs_llama_cpp_runs": [round(x, 3) for x in ratios],
                     "errors": [r["specmoe"]["error"] for r in rounds
                                if "error" in r["specmoe"]] or None})
        rows.append({"name": "llama.cpp-Q4_0", "prompt_tokens": T, "threads": threads,
                     "tok_per_s_runs": [c.get("tok_per_s") for c in lc],
                     "errors": [c["error"] for c in lc if "error" in c] or None})
    res = {"config": {"model": f"{a.arch} ({ARCHS[a.arch]} per-layer shapes)",
                      "layers": a.layers, "experts": a.experts, "quick": a.quick,
                      "prompt_tokens": lengths, "rounds": a.rounds, "rule_ab": a.rule_ab,
                      "file": made, "machine": hostinfo.host(threads)},
           "rows": rows}
    if a.rule_ab:  # each round's worker's repeats
        res["rule_ab_runs"] = [r["specmoe"].get("rule_ab") for r in rounds]
    hostinfo.emit(res, a.save, a.json)


if __name__ == "__main__":
    main()

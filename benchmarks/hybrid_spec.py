"""What a verification costs on a gated-DeltaNet hybrid, and so when speculative decoding can
pay there: Qwen3.5-MoE (or Qwen3-Next) at its per-layer shapes, the same GGUF file as
``benchmarks/hybrid_peers.py``.

    python benchmarks/hybrid_spec.py --json [--rounds 3] [--threads 1,2] [--g-max 6]
    python benchmarks/hybrid_spec.py --arch qwen3next --json
    python benchmarks/hybrid_spec.py --quick --json      # small shapes, 1 round: a smoke test

Speculative decoding cuts the cache back to the accepted drafts after each verification.  A
linear-attention layer folds every position into one state, so from transformers 5.25 on
specmoe's cache records the states after each of the last tokens of a forward
(``specmoe.speculation.decoding.new_kv(rollback=True, window=...)``): a copy of every layer's
state per token until the next crop.  A verification's tokens go through each gated DeltaNet
module in one ``GdnBlock.steps`` call (the projections of all g tokens at once, the recurrent
steps token by token writing each state where the cache records it), the rest of the layer
(norms, the MoE block over the union of the g tokens' experts, the attention layers) as in any
multi-token forward.  That is the price of a verification; this measures it.

Rows, each thread count of ``--threads``, each round interleaving the two kinds of forward on
the same loaded model (every expert resident, ``cache=1.0``), after a 64-token prompt:

* ``plain_step_ms``: one decode step on a cache that records nothing, the way
  ``model.generate`` decodes (one ``_C.DecodePlan`` call): the median of 32 steps.
* ``verify_ms[g]``: one forward of g tokens on a recording cache (window ``--g-max``) then the
  cut back to where it was (``crop_kv``), g = 1 .. ``--g-max``: the median of 8 each.  g = 1
  is what a step without drafts would cost if it recorded; ``specmoe.generate`` runs such
  steps unrecorded (``specmoe.speculation.decoding.unrecorded``), at the plain step's cost.
* ``generate_*``: decode tok/s (the prefill left out) of generations of 32 tokens after a
  64-token prompt that repeats a 16-token phrase: ``model.generate`` (plain) against
  ``specmoe.generate`` with the n-gram drafter under its defaults (Cascade, tau "auto": the
  measured utility decides whether and how far to speculate), interleaved;
  ``spec_vs_plain_runs`` their ratio in each round, with the drafts' acceptance and the mean
  K.  The random model seldom continues the phrase, so
  this is the case where speculation must switch itself off.

``break_even_tokens[g]`` = verify_ms[g] / plain_step_ms: the tokens a verification of g - 1
drafts must yield on average (accepted drafts + the target's own) for speculation to beat
plain decoding, drafting free (the n-gram drafter's microseconds); ``break_even_acceptance[g]``
the per-draft acceptance rate alpha that yields them, (1 - alpha^g) / (1 - alpha) tokens
(independent drafts), or null where even alpha = 1 does not.  ``*_runs``: every round.
The results name the host (CPU model, ISA, threads).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import hostinfo  # noqa: E402
from hybrid_peers import ARCHS, common_args, gguf_path, run_worker, write_file  # noqa: E402

PROMPT, STEPS, VERIFIES, GEN = 64, 32, 8, 32
HYBRIDS = ("qwen35moe", "qwen3next")


def log(*a: Any) -> None:
    print("[hybrid_spec]", *a, file=sys.stderr, flush=True)


def alpha_for(tokens: float, g: int) -> float | None:
    """The acceptance rate alpha with (1 - alpha^g) / (1 - alpha) = tokens (bisection), None
    when tokens > g (not reachable) ; 0 when tokens <= 1."""
    if tokens <= 1.0:
        return 0.0
    if tokens > g:
        return None
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid ** i for i in range(g)) < tokens:
            lo = mid
        else:
            hi = mid
    return round((lo + hi) / 2, 4)


def worker(path: str, threads: list[int], g_max: int, rounds: int) -> None:
    """One process: per thread count, ``rounds`` interleaved repeats of the plain steps and the
    verifications; one JSON line on stdout."""
    import numpy as np
    import torch

    import specmoe
    from big_model import load_every_expert
    from specmoe.runtime import kernels
    from specmoe.speculation.decoding import cache_kwargs, crop_kv, new_kv
    model = specmoe.from_pretrained(path, cache=1.0, progress=False, prefetch=False)
    eng = specmoe.engine_of(model)
    load_every_expert(eng)
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    prompt = torch.tensor([rng.integers(3, vocab, PROMPT).tolist()])
    toks = rng.integers(3, vocab, 4 * STEPS).tolist()

    def fwd(ids: list[int], kv: Any) -> Any:
        with torch.inference_mode():
            return model(input_ids=torch.tensor([ids]), use_cache=True,
                         **cache_kwargs(model, kv))

    def plain() -> float:
        kv = new_kv(model)
        fwd(prompt[0].tolist(), kv)
        ts = []
        for i in range(STEPS):
            t0 = time.perf_counter()
            fwd([toks[i]], kv)
            ts.append(time.perf_counter() - t0)
        return statistics.median(ts) * 1e3

    def verify() -> dict[int, float]:
        kv = new_kv(model, rollback=True, window=g_max)
        fwd(prompt[0].tolist(), kv)
        n = int(kv.get_seq_length())
        crop_kv(kv, n)  # (drops the prefill's recorded states)
        out: dict[int, list[float]] = {g: [] for g in range(1, g_max + 1)}
        for r in range(VERIFIES):
            for g in range(1, g_max + 1):
                ids = toks[(r * g_max + g) % STEPS:][:g]
                t0 = time.perf_counter()
                fwd(ids, kv)
                crop_kv(kv, n)
                out[g].append(time.perf_counter() - t0)
        return {g: statistics.median(v) * 1e3 for g, v in out.items()}

    from specmoe.speculation.drafters import NgramDrafter
    # a prompt that repeats itself: the n-gram drafter proposes at every step, and the random
    # model rejects nearly everything, so only the controller's measured utility (tau "auto",
    # Cascade) keeps speculative decoding from costing more than plain decoding
    loop = rng.integers(3, vocab, 16).tolist() * 4

    from transformers import LogitsProcessorList

    def gen_plain() -> float:
        """Decode tok/s of model.generate: from the prefill's logits to the last step's."""
        x = torch.tensor([loop])
        t: list[float] = []

        def clock(ids: Any, scores: Any) -> Any:
            t.append(time.perf_counter())
            return scores
        with torch.inference_mode():
            model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=GEN,
                           do_sample=False, pad_token_id=0,
                           logits_processor=LogitsProcessorList([clock]))
        return (GEN - 1) / (t[-1] - t[0])

    def gen_spec() -> dict[str, float]:
        """Decode tok/s of specmoe.generate: its iterations, after its prefill (of all but the
        last prompt token, which its first iteration reads)."""
        out = specmoe.generate(model, torch.tensor(loop), drafter=NgramDrafter(),
                               max_new_tokens=GEN, eos_token_id=None)
        it = out.iterations
        st = out.stats
        return {"tok_s": GEN / (it[-1]["t_end"] - (it[0]["t_end"] - it[0]["t_iter"])),
                "k_mean": st["k_mean"], "acceptance": st["acceptance"]}

    model.generation_config.eos_token_id = None
    from specmoe.models.decode_step import decode_step_of
    dstep = decode_step_of(model)
    res: dict[str, Any] = {}
    for th in threads:
        torch.set_num_threads(th)
        kernels.set_num_threads(th)
        plain()
        verify()  # warm-up
        row: dict[str, Any] = {"plain_step_ms_runs": [], "verify_ms_runs": []}
        p0 = dstep.planned if dstep is not None else 0
        for k in range(rounds):
            for which in (("plain", "verify") if k % 2 == 0 else ("verify", "plain")):
                if which == "plain":
                    row["plain_step_ms_runs"].append(round(plain(), 3))
                else:
                    row["verify_ms_runs"].append({str(g): round(v, 3)
                                                  for g, v in verify().items()})
        row["planned_steps"] = (dstep.planned - p0) if dstep is not None else 0
        gen_plain()
        gen_spec()  # (warm-ups; the first also measures tau for this thread count)
        for k in range(rounds):
            for which in (("plain", "spec") if k % 2 == 0 else ("spec", "plain")):
                if which == "plain":
                    row.setdefault("generate_plain_tok_s_runs", []).append(round(gen_plain(), 3))
                else:
                    g = gen_spec()
                    for key, v in g.items():
                        row.setdefault(f"generate_spec_{key}_runs", []).append(
                            None if v is None else round(float(v), 3))  # (none proposed)
        row["spec_vs_plain_runs"] = [round(a / b, 3) for a, b in zip(
            row["generate_spec_tok_s_runs"], row["generate_plain_tok_s_runs"])]
        res[str(th)] = row
    eng.close()
    print(json.dumps(res))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_args(ap, rounds=3)
    ap.add_argument("--arch", choices=HYBRIDS, default="qwen35moe")
    ap.add_argument("--g-max", type=int, default=6, help="longest verification (drafts + 1)")
    a = ap.parse_args()
    threads = [int(t) for t in a.threads.split(",")]
    if a.quick:
        a.experts, a.rounds = 8, 1
    if a._worker:
        worker(a._worker, threads, a.g_max, a.rounds)
        return
    path = gguf_path(a)  # (hybrid_peers.py's files)
    made = write_file(path, a.layers, a.experts, a.quick, a.arch)
    got = run_worker(__file__, path, ["--threads", a.threads, "--g-max", str(a.g_max),
                                      "--rounds", str(a.rounds)] + (["--quick"] if a.quick else []))
    rows: list[dict[str, Any]] = []
    if "error" in got:
        rows.append({"name": "specmoe", **got})
    else:
        for t in threads:
            w = got[str(t)]
            plain = statistics.median(w["plain_step_ms_runs"])
            verify = {g: statistics.median(v[str(g)] for v in w["verify_ms_runs"])
                      for g in range(1, a.g_max + 1)}
            ratio_runs = {str(g): [round(v[str(g)] / p, 3) for v, p in
                                   zip(w["verify_ms_runs"], w["plain_step_ms_runs"])]
                          for g in verify}
            be = {g: v / plain for g, v in verify.items()}
            gen = {k: w[k] for k in w if k.startswith("generate_") or k == "spec_vs_plain_runs"}
            rows.append({"name": "specmoe", "threads": t,
                         "plain_step_ms": round(plain, 3),
                         "plain_step_ms_runs": w["plain_step_ms_runs"],
                         "planned_steps": w["planned_steps"],
                         "verify_ms": {str(g): round(v, 3) for g, v in verify.items()},
                         "verify_ms_runs": w["verify_ms_runs"],
                         "break_even_tokens": {str(g): round(v, 3) for g, v in be.items()},
                         "break_even_tokens_runs": ratio_runs,
                         "break_even_acceptance": {str(g): alpha_for(v, g)
                                                   for g, v in be.items()}, **gen})
    res = {"config": {"model": f"{a.arch} ({ARCHS[a.arch]} per-layer shapes)",
                      "layers": a.layers, "experts": a.experts, "quick": a.quick,
                      "prompt_tokens": PROMPT, "plain_steps": STEPS,
                      "verifications_per_g": VERIFIES, "g_max": a.g_max,
                      "rounds": a.rounds, "file": made,
                      "machine": hostinfo.host(threads)},
           "rows": rows}
    hostinfo.emit(res, a.save, a.json)


if __name__ == "__main__":
    main()

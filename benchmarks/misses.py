"""What SpecMD's miss handling and cache-aware routing cost in output quality, next to what they
save in time, on the zoo's trained tiny-moe (specmoe/zoo, docs/zoo.md).

For each setting (miss mode, drop's keep, routing lambda, the low-bit levels of lowest_bit and
priority -- SpecMD's int4 -> int2 cascade -- and priority's int2 rank) the offloaded model
decodes held-out
text (the zoo corpus's held-out stdlib files, code and docstrings; training/corpus.py) teacher-
forced, one token per forward pass with the KV cache, exactly as generation runs; the unmodified
transformers model does the same.  Per setting:

* ``agreement``: fraction of positions where the offloaded model's greedy next token equals the
  plain model's (token agreement with plain decoding);
* ``ppl`` / ``ppl_plain``: perplexity of the held-out continuation under each;
* ``tok_per_s``, ``stall_s``, ``hit_rate``, ``misses`` (demand loads) and the step-4 counters
  per token (``dropped``, ``substituted``, ``lowbit``, ``lowbit2`` -- of those, from the int2
  level --, ``rerouted``).

The cache holds ``--cache`` of the experts with prefetch on and Least-Stale; the store reads go
through the link throttle (``--throttle GBps,latency_us``; SpecMD A.4) so that a load costs what
it would on a slow link rather than a page-cache copy.  ``--json`` prints one JSON object.

    python benchmarks/misses.py --json
"""
from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "training"))

import hostinfo  # noqa: E402,F401  (before torch: its OpenMP wait policy)

import torch  # noqa: E402

import specmoe  # noqa: E402
from specmoe import zoo  # noqa: E402

import corpus  # noqa: E402  (training/corpus.py: the held-out split rule and stdlib walk)

SETTINGS = [  # (miss, keep, route_lambda, miss_levels, miss_keep2 or None for the default)
    ("fetch", 2, 0.0, "int4", None), ("drop", 1, 0.0, "int4", None),
    ("drop", 0, 0.0, "int4", None), ("substitute", 2, 0.0, "int4", None),
    ("lowest_bit", 2, 0.0, "int4", None), ("lowest_bit", 2, 0.0, "int2", None),
    ("priority", 1, 0.0, "int4", None), ("priority", 1, 0.0, "int2", None),
    ("priority", 0, 0.0, "int4:int2", None),  # rank 0 from int4, rank 1 from int2
    ("fetch", 2, 0.3, "int4", None), ("fetch", 2, 0.5, "int4", None),
    ("lowest_bit", 2, 0.3, "int4", None),
]


def parse_settings(spec: str) -> List[tuple]:
    """``miss:keep:lambda[:levels[:keep2]]`` comma-separated, levels joined by ``+``
    (``priority:0:0:int4+int2``)."""
    out = []
    for item in spec.split(","):
        f = item.split(":")
        if not 3 <= len(f) <= 5:
            raise SystemExit(f"--settings: {item!r} is not miss:keep:lambda[:levels[:keep2]]")
        levels = f[3].replace("+", ":") if len(f) > 3 else "int4"
        out.append((f[0], int(f[1]), float(f[2]), levels, int(f[4]) if len(f) > 4 else None))
    return out


def heldout_texts(n: int, seed: int) -> List[str]:
    """n held-out stdlib sources (code) and docstrings (prose), alternating, seeded."""
    root = corpus.stdlib_dir()
    code, prose = [], []
    for p in corpus.stdlib_files(root):
        rel = str(p.relative_to(root))
        if not corpus.is_heldout(rel):
            continue
        text = corpus.read_source(p)
        if not text or len(text) < 4000:
            continue
        code.append(text)
        d = corpus.docstrings(text)
        if len(d) > 2000:
            prose.append(d)
    rng = random.Random(seed)
    rng.shuffle(code)
    rng.shuffle(prose)
    out = []
    for i in range(n):
        src = prose if i % 2 and prose else code
        out.append(src[(i // 2) % len(src)])
    return out


def windows(tok: Any, texts: List[str], length: int, seed: int) -> List[torch.Tensor]:
    rng = random.Random(seed)
    out = []
    for t in texts:
        enc = tok.encode(t)
        ids = enc.ids if hasattr(enc, "ids") else enc
        if len(ids) <= length:
            continue
        s = rng.randrange(0, len(ids) - length)
        out.append(torch.tensor(ids[s:s + length]).unsqueeze(0))
    return out


@torch.no_grad()
def decode(model: Any, ids: torch.Tensor, prompt: int) -> torch.Tensor:
    """Logits [n - prompt, V] predicting tokens prompt..n-1: prefill the prompt, then one token
    per forward with the KV cache (teacher-forced)."""
    out = model(ids[:, :prompt], use_cache=True)
    past, logits = out.past_key_values, [out.logits[0, -1]]
    for i in range(prompt, ids.shape[1] - 1):
        out = model(ids[:, i:i + 1], past_key_values=past, use_cache=True)
        past = out.past_key_values
        logits.append(out.logits[0, -1])
    return torch.stack(logits)


def nll(logits: torch.Tensor, target: torch.Tensor) -> float:
    return float(torch.nn.functional.cross_entropy(logits.float(), target, reduction="sum"))


def main(argv: List[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--texts", type=int, default=8, help="held-out windows")
    ap.add_argument("--length", type=int, default=96, help="tokens per window")
    ap.add_argument("--prompt", type=int, default=16, help="prefilled tokens per window")
    ap.add_argument("--cache", default="25%")
    ap.add_argument("--dtype", default="bf16", help="store dtype of the experts")
    ap.add_argument("--throttle", default="2,20", help="GB/s,latency_us of the emulated link "
                    "('0,0': off)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--settings", default=None,
                    help="comma-separated miss:keep:lambda[:levels[:keep2]], levels joined by + "
                    "(default: the built-in list)")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    gbps, lat = (float(v) for v in a.throttle.split(","))
    plain, tok = zoo.load("tiny-moe")
    target, _ = zoo.load("tiny-moe")
    plain.eval()
    target.eval()
    wins = windows(tok, heldout_texts(a.texts, a.seed), a.length, a.seed)
    ref = []
    t0 = time.perf_counter()
    for w in wins:
        ref.append(decode(plain, w, a.prompt))
    t_plain = time.perf_counter() - t0
    n_tok = sum(r.shape[0] for r in ref)
    ppl_plain = math.exp(sum(nll(r, w[0, a.prompt:]) for r, w in zip(ref, wins)) / n_tok)
    eng = specmoe.offload(target, cache=a.cache, dtype=a.dtype, policy="least_stale",
                          throttle=(gbps, lat))
    rows: List[Dict[str, Any]] = []
    settings = SETTINGS if not a.settings else parse_settings(a.settings)
    for miss, keep, lam, levels, keep2 in settings:
        eng.set_miss(miss, keep, lam, miss_levels=levels,
                     miss_keep2="auto" if keep2 is None else keep2)
        eng.set_cache(a.cache)  # every setting starts from an empty cache
        eng.reset_stats()
        agree = 0
        total_nll = 0.0
        t0 = time.perf_counter()
        for w, r in zip(wins, ref):
            lg = decode(target, w, a.prompt)
            agree += int((lg.argmax(-1) == r.argmax(-1)).sum())
            total_nll += nll(lg, w[0, a.prompt:])
        dt = time.perf_counter() - t0
        s = eng.stats()
        rows.append({
            "miss": miss, "miss_keep": keep, "route_lambda": lam,
            "miss_levels": levels if miss in ("lowest_bit", "priority") else None,
            "miss_keep2": eng.miss_keep2 if miss == "priority" else None,
            "agreement": agree / n_tok, "ppl": math.exp(total_nll / n_tok),
            "ppl_vs_plain": math.exp(total_nll / n_tok) / ppl_plain,
            "tok_per_s": n_tok / dt, "stall_s": s["stall_s"], "hit_rate": s["hit_rate"],
            "misses_per_token": s["misses"] / s["tokens"],
            **{f"{k}_per_token": s[k] / s["tokens"]
               for k in ("dropped", "substituted", "lowbit", "lowbit2", "rerouted")},
        })
    eng.close()
    out = {
        "model": "zoo tiny-moe (4 MoE layers x 16 experts, top-2)", "store_dtype": a.dtype,
        "cache": a.cache, "policy": "least_stale", "prefetch": True,
        "throttle_gbps_latency_us": [gbps, lat], "threads": a.threads,
        "windows": len(wins), "tokens_scored": n_tok, "prompt": a.prompt,
        "ppl_plain": ppl_plain, "plain_tok_per_s": n_tok / t_plain, "rows": rows,
    }
    if a.json:
        print(json.dumps(out))
    else:
        print(f"{len(wins)} windows, {n_tok} tokens scored; plain ppl {ppl_plain:.3f}, "
              f"{out['plain_tok_per_s']:.1f} tok/s (torch, all in memory)")
        print(f"{'miss':<11}{'levels':>10}{'keep':>5}{'lam':>5}{'agree':>8}{'ppl':>8}"
              f"{'tok/s':>8}{'stall_s':>9}{'hit':>7}{'miss/t':>8}")
        for r in rows:
            print(f"{r['miss']:<11}{r['miss_levels'] or '-':>10}{r['miss_keep']:>5}"
                  f"{r['route_lambda']:>5}"
                  f"{r['agreement']:>8.3f}{r['ppl']:>8.3f}{r['tok_per_s']:>8.1f}"
                  f"{r['stall_s']:>9.3f}{r['hit_rate']:>7.3f}{r['misses_per_token']:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

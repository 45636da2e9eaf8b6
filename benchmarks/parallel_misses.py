"""A layer's misses loaded in parallel with its resident experts' compute (issue 11, csrc/layer.h
step 5) against the blocking path, behind emulated links of several speeds.

    python benchmarks/parallel_misses.py [--json] [--quick] [--links none,4:20,1:50]

Setup: the zoo's ``tiny-moe`` (or ``--shape``: a random-weight Mixtral at larger shapes, random
prompts) offloaded (``--cache`` 25 % of the experts, f32, LRU, next-layer
prefetch on, one torch thread), plain greedy decoding of ``--new-tokens`` tokens (EOS ignored)
on held-out code and prose prompts (``benchmarks/speculation.py``'s prompt rules).  Links:
``none`` (the store read from the page cache) or ``GBPS:LATENCY_US``, SpecMD's link emulation
(``specmoe.runtime.misses``): every expert load occupies one emulated link for latency + bytes / bandwidth.

Method: per link, ``--repeats`` rounds; each round runs every prompt with parallel misses off and
on back to back (order alternating by round), each request from an empty cache; tok/s = new
tokens / wall time of ``model.generate`` summed over the prompts.  ``ratio`` = median over rounds
of (on / off) tok/s; ``stall_ms_per_token`` = time the layer calls spent waiting for expert
loads, per new token (the cache's stall clock); ``overlapped_per_token`` = experts queued to the
worker ahead of their layer's compute; ``outputs_equal``: greedy tokens of on and off agree.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "training"))

import hostinfo  # noqa: E402,F401  (before torch: its OpenMP wait policy)

import torch  # noqa: E402

import specmoe  # noqa: E402
from specmoe import zoo  # noqa: E402


def parse_links(text: str) -> List[Optional[Tuple[float, float]]]:
    out: List[Optional[Tuple[float, float]]] = []
    for part in text.split(","):
        part = part.strip()
        if part == "none":
            out.append(None)
            continue
        try:
            gbps, lat = (float(x) for x in part.split(":"))
        except ValueError:
            raise SystemExit(f"--links: 'none' or GBPS:LATENCY_US, got {part!r}") from None
        out.append((gbps, lat))
    return out


def run_one(model: Any, eng: Any, ids: List[int], new: int) -> Tuple[float, List[int], float, int]:
    eng.set_cache(eng.cache_frac)  # every request from an empty cache
    eng.reset_stats()
    x = torch.tensor([ids])
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(x, do_sample=False, max_new_tokens=new, min_new_tokens=new)
    dt = time.perf_counter() - t0
    st = eng.stats()
    return dt, out[0, len(ids):].tolist(), float(st["stall_s"]), int(st["overlapped"])


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--quick", action="store_true", help="smoke: 2 prompts, 8 tokens, 1 round")
    ap.add_argument("--links", default="none,4:20,1:50")
    ap.add_argument("--cache", type=float, default=0.25)
    ap.add_argument("--prompts", type=int, default=4, help="prompts (half code, half prose)")
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--shape", default=None, metavar="H,I,E,K,L",
                    help="a random-weight Mixtral of hidden H, expert ffn I, E experts, top-K, "
                         "L layers instead of tiny-moe (random prompts of 64 tokens)")
    a = ap.parse_args(argv)
    if a.quick:
        a.prompts, a.new_tokens, a.repeats = 2, 8, 1
    links = parse_links(a.links)
    torch.set_num_threads(1)
    if a.shape:
        try:
            H, I, E, K, L = (int(v) for v in a.shape.split(","))
        except ValueError:
            ap.error(f"--shape: H,I,E,K,L ints, got {a.shape!r}")
        from specmoe.models.testing import tiny_model
        model = tiny_model("mixtral", seed=0, hidden=H, inter=I, experts=E, top_k=K, layers=L,
                           vocab=1024)
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(0, 1024, (64,), generator=g).tolist()
                   for _ in range(a.prompts)]
    else:
        import speculation as specbench  # the held-out prompt rules
        model, tok = zoo.load("tiny-moe", experts_implementation="eager")
        docs = specbench.heldout_documents()
        half = max(1, a.prompts // 2)
        prompts = [p for d in ("code", "prose")
                   for _, p in specbench.make_prompts(tok, docs[d], d, half, 0)]
    eng = specmoe.offload(model, cache=a.cache, dtype="f32")
    load0 = os.getloadavg()[0]
    t_all = time.perf_counter()
    rows = []
    from tqdm import tqdm
    bar = tqdm(total=len(links) * a.repeats * 2 * len(prompts), desc="parallel_misses",
               unit="req", file=sys.stderr)
    try:
        run_one(model, eng, prompts[0], 4)  # warm-up
        for link in links:
            eng.set_miss(throttle=link)
            tps: Dict[bool, List[float]] = {False: [], True: []}
            stall: Dict[bool, List[float]] = {False: [], True: []}
            over: Dict[bool, int] = {False: 0, True: 0}
            outs: Dict[bool, List[List[int]]] = {False: [], True: []}
            ratios = []
            for r in range(a.repeats):
                tot = {False: 0.0, True: 0.0}
                for on in ((False, True) if r % 2 == 0 else (True, False)):
                    eng.set_parallel_misses(on)
                    for p in prompts:
                        dt, o, s, ov = run_one(model, eng, p, a.new_tokens)
                        tot[on] += dt
                        stall[on].append(s)
                        over[on] += ov
                        if r == 0:
                            outs[on].append(o)
                        bar.update(1)
                n_tok = a.new_tokens * len(prompts)
                for on in (False, True):
                    tps[on].append(n_tok / tot[on])
                ratios.append(tps[True][-1] / tps[False][-1])
            n_all = a.new_tokens * len(prompts) * a.repeats
            rows.append({
                "link": "none" if link is None else {"gb_per_s": link[0], "latency_us": link[1]},
                "tok_per_s_off": round(statistics.median(tps[False]), 2),
                "tok_per_s_on": round(statistics.median(tps[True]), 2),
                "ratio": round(statistics.median(ratios), 4),
                "ratio_per_repeat": [round(x, 3) for x in ratios],
                "stall_ms_per_token_off": round(1e3 * sum(stall[False]) / n_all, 3),
                "stall_ms_per_token_on": round(1e3 * sum(stall[True]) / n_all, 3),
                "overlapped_per_token": round(over[True] / n_all, 3),
                "outputs_equal": outs[True] == outs[False],
            })
    finally:
        bar.close()
        eng.close()
    res = {"benchmark": "parallel_misses",
           "config": {"model": f"random mixtral H,I,E,K,L={a.shape}" if a.shape
                      else "tiny-moe", "cache": a.cache, "dtype": "f32", "threads": 1,
                      "prompts": len(prompts), "new_tokens": a.new_tokens,
                      "repeats": a.repeats, "machine": f"{platform.machine()}, "
                                                      f"{os.cpu_count()} cpus",
                      "loadavg_start": round(load0, 2),
                      "loadavg_end": round(os.getloadavg()[0], 2),
                      "wall_s": round(time.perf_counter() - t_all, 1)},
           "rows": rows}
    if a.json:
        print(json.dumps(res))
    else:
        for x in rows:
            print(f"{str(x['link']):45} off {x['tok_per_s_off']:8.1f} on {x['tok_per_s_on']:8.1f}"
                  f" ratio {x['ratio']:.3f} stall/tok {x['stall_ms_per_token_off']:.3f} -> "
                  f"{x['stall_ms_per_token_on']:.3f} ms  equal {x['outputs_equal']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

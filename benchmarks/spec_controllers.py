"""Speculation controllers on a real routing trace with a modelled cost: does each controller
find the K that pays when verifying K drafts loads the union of their experts?

    python benchmarks/spec_controllers.py [--trace DIR|FILE.npz] [--tokens 1000] [--json]

Model (documented, not measured): decoding walks the trace's tokens in text order.  An
iteration with K drafts verifies tokens i..i+K; it touches, per MoE layer, the union of their
routed experts (the trace's true routing stands in for the drafts' routing), in an LRU cache of
--cache-frac of all experts; each miss costs --t-load seconds.  The forward over g = K+1 tokens
costs t1 * (1 + --slope * (g-1)), drafting --t-draft per token.  Draft token at trace position
j is accepted iff u_j < p(j) (u_j drawn once, shared by every controller; p = --p-accept in the
first half, --p-accept2 in the second, a regime change).  The iteration yields accepted+1 tokens.

Ceiling: the best static K chosen offline on the same stream.  Reported: tokens/s of every
controller and its ratio to the ceiling and to plain decoding (K=0).  --json prints one object.
"""
from __future__ import annotations

import argparse
import json
import sys
from collections import OrderedDict
from pathlib import Path
from typing import Callable, Dict, List

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from specmoe import load_trace  # noqa: E402
from specmoe.speculation.controllers import (Cascade, Controller, Heuristic, SpeqGovernor,
                                             StaticK)  # noqa: E402


class Sim:
    def __init__(self, experts: np.ndarray, num_experts: int, a: argparse.Namespace) -> None:
        n, L, _ = experts.shape
        self.n, self.L, self.E = n, L, num_experts
        self.keys = [[set((l * num_experts + experts[t, l]).tolist()) for l in range(L)]
                     for t in range(n)]
        self.a = a
        rng = np.random.default_rng(a.seed)
        u = rng.random(n + 64)
        p = np.where(np.arange(n + 64) < n // 2, a.p_accept, a.p_accept2)
        self.ok = u < p
        self.cap = max(1, round(a.cache_frac * L * num_experts))

    def run(self, ctl: Controller, k_max: int) -> Dict[str, float]:
        a = self.a
        cache: "OrderedDict[int, None]" = OrderedDict()
        i = 0
        total = 0.0
        iters = 0
        loads = 0
        while i < self.n - 1:
            if isinstance(ctl, SpeqGovernor):
                ctl.set_io_cost([self.missing(cache, i, k) * a.t_load for k in range(k_max + 1)])
            k = min(ctl.next_k(), self.n - 1 - i)
            miss = 0
            for l in range(self.L):
                u = set().union(*(self.keys[j][l] for j in range(i, i + k + 1)))
                for key in u:
                    if key in cache:
                        cache.move_to_end(key)
                    else:
                        miss += 1
                        cache[key] = None
                        if len(cache) > self.cap:
                            cache.popitem(last=False)
            acc = 0
            while acc < k and self.ok[i + 1 + acc]:
                acc += 1
            t_draft = a.t_draft * k
            t_io = miss * a.t_load
            t = a.t1 * (1 + a.slope * k) + t_draft + t_io
            ctl.observe(k, acc, t, miss, t_draft=t_draft, t_io=t_io)
            total += t
            i += acc + 1
            iters += 1
            loads += miss
        return {"tokens_per_s": i / total, "iterations": iters, "expert_loads": loads,
                "mean_k": float(np.mean(ctl.telemetry()["k"]))}

    def missing(self, cache: "OrderedDict[int, None]", i: int, k: int) -> int:
        k = min(k, self.n - 1 - i)
        return sum(len(set().union(*(self.keys[j][l] for j in range(i, i + k + 1))) - cache.keys())
                   for l in range(self.L))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trace", default=str(HERE.parent / "tests" / "data" / "puffin"))
    ap.add_argument("--tokens", type=int, default=1000)
    ap.add_argument("--k-max", type=int, default=8)
    ap.add_argument("--cache-frac", type=float, default=0.25)
    ap.add_argument("--t1", type=float, default=0.020, help="seconds of a 1-token forward")
    ap.add_argument("--slope", type=float, default=0.05, help="extra forward cost per token")
    ap.add_argument("--t-draft", type=float, default=0.001)
    ap.add_argument("--t-load", type=float, default=0.0005, help="seconds per expert miss")
    ap.add_argument("--p-accept", type=float, default=0.8)
    ap.add_argument("--p-accept2", type=float, default=0.3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    tr = load_trace(a.trace)
    sim = Sim(tr.experts[:a.tokens], tr.num_experts, a)
    K = a.k_max
    makers: Dict[str, Callable[[], Controller]] = {
        f"static_{k}": (lambda k=k: StaticK(k, k_max=K)) for k in range(K + 1)}
    makers.update({"heuristic": lambda: Heuristic(initial=min(5, K), k_max=K),
                   "cascade": lambda: Cascade(k_max=K),
                   "speq": lambda: SpeqGovernor(k_max=K)})
    res = {name: sim.run(make(), K) for name, make in makers.items()}
    statics = {n: r for n, r in res.items() if n.startswith("static_")}
    best = max(statics, key=lambda n: statics[n]["tokens_per_s"])
    ceil = res[best]["tokens_per_s"]
    plain = res["static_0"]["tokens_per_s"]
    for r in res.values():
        r["vs_best_static"] = r["tokens_per_s"] / ceil
        r["vs_plain"] = r["tokens_per_s"] / plain
    out = {"model": vars(a) | {"tokens": sim.n}, "best_static": best, "results": res}
    if a.json:
        print(json.dumps(out))
    else:
        print(f"best static: {best}   ({sim.n} tokens, cache {sim.cap} of {sim.L * sim.E} experts)")
        for n, r in res.items():
            print(f"{n:12s} {r['tokens_per_s']:7.2f} tok/s  x{r['vs_best_static']:.3f} of best static"
                  f"  x{r['vs_plain']:.3f} of plain  mean K {r['mean_k']:.2f}  loads {r['expert_loads']}")


if __name__ == "__main__":
    main()

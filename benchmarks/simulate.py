"""How fast is the simulator's per-access loop?  LRU (or ``--policy``), no prefetch, on the shared
traces (or the carried subset when ../shared is absent), against two peers measured in the same
run:

* ``python_lru``: the same LRU replay in plain Python (collections.OrderedDict), on a slice;
* ``replay``: the policies' demand-only C replay (``_C.replay``, no time model), when built in;

and the ceiling of touching every access once (``np.bincount`` over the key array).
``--json`` prints one JSON object.  Target: >= 20 M accesses/s per core for LRU.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from collections import OrderedDict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specmoe import _C  # noqa: E402
from specmoe.sim.hardware import PROFILES, ModelCost, sim_timing  # noqa: E402
from specmoe.sim.traces import load_puffin  # noqa: E402


def best_of(fn, reps):
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--trace", default=None)
    ap.add_argument("--capacity", type=float, default=0.10, help="fraction of all experts")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--policy", default="lru", help="built-in policy name (simulate and replay)")
    ap.add_argument("--order", type=int, default=0,
                    help="least_stale order: 0 layer, 1 lru, 2 fifo")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    shared = ROOT.parent / "shared" / "traces" / "deepseek-v2-lite-puffin"
    if not shared.is_dir():
        shared = ROOT.parent.parent / "shared" / "traces" / "deepseek-v2-lite-puffin"
    path = Path(args.trace) if args.trace else (shared if shared.is_dir() else
                                               ROOT / "tests" / "data" / "puffin")
    tr = load_puffin(path)
    keys = tr.keys()
    n = len(keys)
    nslots = max(1, int(args.capacity * tr.num_layers * tr.num_experts))
    kw = sim_timing(PROFILES["a100-pcie4"], ModelCost.for_trace(tr))

    sim_s = []
    for _ in range(args.reps):
        r = _C.simulate(tr.experts, tr.num_experts, args.policy, nslots, order=args.order, **kw)
        sim_s.append(r["elapsed_s"])
    sim_best = min(sim_s)

    ceiling = best_of(lambda: np.bincount(keys, minlength=tr.num_layers * tr.num_experts),
                      args.reps)

    m = min(n, 200_000)
    sl = keys[:m].tolist()

    def py_lru():
        od, hits = OrderedDict(), 0
        for k in sl:
            if k in od:
                hits += 1
                od.move_to_end(k)
            else:
                if len(od) >= nslots:
                    od.popitem(last=False)
                od[k] = 1
        return hits

    py_s = best_of(py_lru, 1) * n / m
    out = {
        "trace": str(path), "policy": args.policy, "order": args.order,
        "accesses": n, "nslots": nslots,
        "sim_accesses_per_s": n / sim_best,
        "ceiling_bincount_accesses_per_s": n / ceiling,
        "python_lru_accesses_per_s": n / py_s,
        "ratio_sim_vs_python": py_s / sim_best,
        "ratio_sim_vs_ceiling": ceiling / sim_best,
        "target_accesses_per_s": 20e6,
        "meets_target": n / sim_best >= 20e6,
        "hit_rate": r["hits"] / n,
    }
    if hasattr(_C, "replay") and hasattr(_C, "Policy"):
        pass_stride = tr.num_layers * tr.top_k
        rep_s = float("inf")
        for _ in range(args.reps):
            pol = _C.Policy(args.policy, nslots, tr.num_layers, tr.num_experts,
                            order=args.order if args.policy == "least_stale" else None)
            t0 = time.perf_counter()
            hits, _v = _C.replay(pol, keys, pass_stride)
            rep_s = min(rep_s, time.perf_counter() - t0)
        out["replay_accesses_per_s"] = n / rep_s
        out["ratio_sim_vs_replay"] = rep_s / sim_best
        out["replay_hits_equal"] = int(hits.sum()) == r["hits"]
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:>34}: {v:,.3f}" if isinstance(v, float) else f"{k:>34}: {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Hit rate of every eviction policy on a routing trace, demand-only replay (no prefetch), one
forward pass per token, at caches of several fractions of all experts.

    python benchmarks/policy_hit_rates.py [--traces DIR|FILE.npz] [--fractions 0.05,0.1,0.25] [--json]

Belady (the offline optimum on the same sequence) is the ceiling; every ratio is hit rate over
Belady's.  --json prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from specmoe import load_trace  # noqa: E402
from specmoe.runtime.policies import (FIFO, LFU, LRU, MRU, Belady, LeastStale, Random,
                                      replay)  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--traces", default=str(HERE.parent.parent / "shared" / "traces" /
                                            "deepseek-v2-lite-puffin"))
    ap.add_argument("--fractions", default="0.05,0.1,0.25")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if not Path(a.traces).exists():
        a.traces = str(HERE.parent / "tests" / "data" / "puffin")
    tr = load_trace(a.traces)
    specs = {"lru": LRU(), "lfu": LFU(), "fifo": FIFO(), "mru": MRU(), "random": Random(0),
             "least_stale_layer": LeastStale("layer"), "least_stale_lru": LeastStale("lru"),
             "least_stale_fifo": LeastStale("fifo"), "belady": Belady(tr)}
    n = tr.num_layers * tr.num_experts
    out = {"traces": a.traces, "accesses": tr.num_accesses, "keys": n, "capacities": {}}
    for f in (float(x) for x in a.fractions.split(",")):
        nslots = max(1, round(f * n))
        row = {}
        for name, spec in specs.items():
            t0 = time.perf_counter()
            hits = replay(spec, tr, nslots)[0]
            row[name] = {"hit_rate": round(float(hits.mean()), 4),
                         "seconds": round(time.perf_counter() - t0, 3)}
        for r in row.values():
            r["vs_belady"] = round(r["hit_rate"] / max(row["belady"]["hit_rate"], 1e-12), 4)
        out["capacities"][f"{f:g}"] = {"nslots": nslots, "policies": row}
        if not a.json:
            print(f"capacity {f:.0%} ({nslots} slots): " +
                  ", ".join(f"{k} {v['hit_rate']:.3f}" for k, v in row.items()), flush=True)
    if a.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()

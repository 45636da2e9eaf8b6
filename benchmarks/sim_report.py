"""Regenerate the numbers and plots of docs/simulator.md from the shared traces.

Runs two sweeps of the simulator over ../shared/traces/deepseek-v2-lite-puffin:
  1. every built-in policy at 1..50 % capacity, demand only (hit rate against the Belady bound);
  2. LRU, Least-Stale and Belady at 5/10/25 % on each hardware profile with each predictor
     (stall time, time per token).
Writes docs/sim_hit_rate.png, docs/sim_stall.png and docs/sim_results.json, and prints the
markdown tables.  ``--json`` prints one JSON object instead of the tables.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from specmoe import _C  # noqa: E402
from specmoe.sim.traces import shared_trace_dir  # noqa: E402
from specmoe.sim.sweep import plot_hit_rate, plot_stall, sweep  # noqa: E402
from specmoe.sim.traces import load_puffin  # noqa: E402

ALL = ["lru", "lfu", "fifo", "mru", "random", "least_stale", "least_stale:order=lru", "belady"]
PREDICTORS = ["none", "oracle:depth=2", "history", "history:topk=10"]
HARDWARE = ["a100-pcie4", "rtx4090", "laptop"]


def available(spec: str) -> bool:
    try:
        import numpy as np

        _C.simulate(np.zeros((1, 1, 1), np.int16), 1, spec.split(":")[0], 1, expert_bytes=1.0,
                    fast_bw=1.0, link_bw=1.0, link_latency_s=0.0)
        return True
    except ValueError:
        return False


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--trace", default=str(shared_trace_dir()))
    ap.add_argument("--out", default=str(ROOT / "docs"))
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    tr = load_puffin(args.trace)
    pols = [p for p in ALL if available(p)]
    caps = ["1%", "2%", "5%", "10%", "15%", "20%", "25%", "35%", "50%"]
    hit_rows = sweep(tr, pols, caps, ["a100-pcie4"], ["none"], processes=args.processes,
                     progress=not args.json)
    main_pols = [p for p in ("lru", "least_stale", "belady") if p in pols]
    stall_rows = sweep(tr, main_pols, ["5%", "10%", "25%"], HARDWARE, PREDICTORS,
                       processes=args.processes, progress=not args.json)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    plot_hit_rate(hit_rows, out / "sim_hit_rate.png")
    plot_stall(stall_rows, out / "sim_stall.png", capacity="10%", hardware="laptop")
    keep = ("policy", "capacity", "capacity_slots", "hardware", "predictor", "hit_rate",
            "collision_misses", "prefetch_precision", "prefetch_recall", "predictor_recall",
            "stall_s", "est_tpot_ms", "ttft_ms", "tokens")
    slim = {"hit_rate": [{k: r[k] for k in keep} for r in hit_rows],
            "prefetch": [{k: r[k] for k in keep} for r in stall_rows]}
    (out / "sim_results.json").write_text(json.dumps(slim, indent=0))
    if args.json:
        print(json.dumps(slim))
        return 0
    by = {(r["policy"], r["capacity"]): r for r in hit_rows}
    print("| policy | 5% | 10% | 25% | collision misses at 10% |")
    print("|---|---|---|---|---|")
    for p in pols:
        print(f"| {p} | " + " | ".join(f"{by[(p, c)]['hit_rate']:.3f}" for c in ("5%", "10%", "25%"))
              + f" | {by[(p, '10%')]['collision_misses']:,} |")
    print()
    print("| hardware | policy | predictor | hit 5% | hit 10% | hit 25% | tpot ms 5% | tpot ms 10% "
          "| tpot ms 25% | stall/token ms 10% | prefetch precision / recall 10% |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    sb = {(r["hardware"], r["policy"], r["predictor"], r["capacity"]): r for r in stall_rows}
    for h in HARDWARE:
        for p in main_pols:
            for pr in dict.fromkeys(r["predictor"] for r in stall_rows):
                rs = [sb[(h, p, pr, c)] for c in ("5%", "10%", "25%")]
                m = rs[1]
                print(f"| {h} | {p} | {pr} | " + " | ".join(f"{r['hit_rate']:.3f}" for r in rs)
                      + " | " + " | ".join(f"{r['est_tpot_ms']:.1f}" for r in rs)
                      + f" | {1e3 * m['stall_s'] / m['tokens']:.1f} | "
                      f"{m['prefetch_precision']:.2f} / {m['prefetch_recall']:.2f} |")
    ttft = {r["hardware"]: r["ttft_ms"] for r in stall_rows if r["predictor"] == "none"}
    print()
    print("TTFT (mean over requests, ms, no prefetch):", {h: round(v, 1) for h, v in ttft.items()})
    return 0


if __name__ == "__main__":
    sys.exit(main())

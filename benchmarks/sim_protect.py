"""What MoE-SpeQ's lookahead-aware eviction (Sec. 3.3) is worth on a real routing trace: hit
rate with and without the shield (``simulate(..., protect=True)``), one-token passes and
verification passes of K+1 tokens, per policy and cache size.

    python benchmarks/sim_protect.py [--traces DIR|FILE.npz] [--passes 1,4]
        [--policies lru,least_stale,spac] [--capacities 5%,10%,25%] [--json]

The shield here protects each pass's experts as the trace routes them: a draft whose routing
is exact, so these hit rates bound what a real draft's lookahead can reach.  The replay is the
live cache's slot table (csrc/slots.h) with the live shield rule.  Hit rates do not depend on
the host; --json prints one JSON object.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from specmoe import load_trace, simulate  # noqa: E402
from specmoe.sim.traces import shared_trace_dir  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--traces", default=str(shared_trace_dir()))
    ap.add_argument("--passes", default="1,4", help="tokens per pass (K+1), comma-separated")
    ap.add_argument("--policies", default="lru,least_stale,spac")
    ap.add_argument("--capacities", default="5%,10%,25%")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if not Path(a.traces).exists():
        a.traces = str(HERE.parent / "tests" / "data" / "puffin")
    tr = load_trace(a.traces, progress=not a.json) if Path(a.traces).is_dir() else \
        load_trace(a.traces)
    rows = []
    for g in (int(x) for x in a.passes.split(",")):
        for pol in a.policies.split(","):
            for cap in a.capacities.split(","):
                off = simulate(tr, pol, cap, verify_tokens=g)
                on = simulate(tr, pol, cap, verify_tokens=g, protect=True)
                rows.append({"tokens_per_pass": g, "policy": pol, "capacity": cap,
                             "slots": on.capacity_slots, "hit_rate": round(off.hit_rate, 4),
                             "hit_rate_protect": round(on.hit_rate, 4),
                             "collision_misses": off.collision_misses,
                             "collision_misses_protect": on.collision_misses,
                             "protected_evictions": on.extra["protected_evictions"]})
    out = {"traces": a.traces, "trace": repr(tr), "rows": rows}
    if a.json:
        print(json.dumps(out))
        return
    print(out["trace"])
    print(f"{'K+1':>4} {'policy':<12} {'cache':>6} {'hit':>7} {'hit+shield':>11} "
          f"{'collisions':>11} {'->':>9} {'prot.ev':>8}")
    for r in rows:
        print(f"{r['tokens_per_pass']:>4} {r['policy']:<12} {r['capacity']:>6} "
              f"{r['hit_rate']:>7.4f} {r['hit_rate_protect']:>11.4f} "
              f"{r['collision_misses']:>11} {r['collision_misses_protect']:>9} "
              f"{r['protected_evictions']:>8}")


if __name__ == "__main__":
    main()

"""The hybrid GPU tier (issue 37, MoE-SpAc section 3.3) in the simulator, on real routing:
simulated time per token of copying every miss against splitting each layer's misses between
copies and the host CPU (``simulate(..., hybrid=True)``: Eq. 9's cut, Eq. 10's admissions),
per cache size, without prefetch and with the oracle next-layer prefetch (its bound).

    python benchmarks/sim_hybrid.py [--traces DIR|FILE.npz] [--hardware h200]
        [--policies lru,least_stale] [--capacities 5%,10%,25%] [--json]

The profile's ``cpu_bw`` prices an expert on the CPU (``h200``: the H200 host's, measured by
the hybrid tier at load there); ``link_bw`` / ``fast_bw`` the copies and the device's
compute.  Times are the simulator's, not a measurement: they do not depend on this host.
``vs_copy_every_miss`` is the copy-every-miss row's time per token over the hybrid row's.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from specmoe import load_trace, simulate  # noqa: E402
from specmoe.sim.calibration import get_hardware  # noqa: E402
from specmoe.sim.traces import shared_trace_dir  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--traces", default=str(shared_trace_dir()))
    ap.add_argument("--hardware", default="h200")
    ap.add_argument("--policies", default="lru,least_stale")
    ap.add_argument("--capacities", default="5%,10%,25%")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    import hostinfo

    if not Path(a.traces).exists():
        a.traces = str(HERE.parent / "tests" / "data" / "puffin")
    tr = load_trace(a.traces, progress=not a.json) if Path(a.traces).is_dir() else \
        load_trace(a.traces)
    hw = get_hardware(a.hardware)
    rows = []
    for pol in a.policies.split(","):
        for cap in a.capacities.split(","):
            for pf in (None, "oracle"):
                base = None
                for hy in (False, True):
                    r = simulate(tr, pol, cap, prefetch=pf, hardware=hw, hybrid=hy)
                    d = r.to_dict()
                    n = max(r.tokens, 1)
                    row = {"policy": pol, "capacity": cap, "prefetch": pf or "none",
                           "hybrid": hy, "est_tpot_ms": r.est_tpot_ms, "hit_rate": r.hit_rate,
                           "demand_loads_per_token": (r.misses - r.prefetch_late) / n,
                           "prefetch_issued_per_token": r.prefetch_issued / n,
                           "cpu_experts_per_token": d["hybrid_cpu"] / n,
                           "admitted_per_token": d["hybrid_admitted"] / n,
                           "cpu_wait_ms_per_token": 1e3 * d["hybrid_cpu_wait_s"] / n}
                    if hy and base:
                        row["vs_copy_every_miss"] = base / r.est_tpot_ms
                    base = r.est_tpot_ms
                    rows.append(row)
                    if not a.json:
                        print(f"{pol:12s} {cap:>4s} {row['prefetch']:6s} "
                              f"{'hybrid' if hy else 'copy  '} {r.est_tpot_ms:7.2f} ms/token  "
                              f"hit {r.hit_rate:.3f}  CPU {row['cpu_experts_per_token']:5.1f}"
                              f"/token  {row.get('vs_copy_every_miss', '')}")
    res = {"trace": {"source": a.traces, "tokens": tr.num_tokens, "layers": tr.num_layers,
                     "experts": tr.num_experts, "top_k": tr.top_k},
           "hardware": hw.to_dict(), "host": hostinfo.host(1), "rows": rows}
    if a.out:
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")
    if a.json:
        print(json.dumps(res))


if __name__ == "__main__":
    main()

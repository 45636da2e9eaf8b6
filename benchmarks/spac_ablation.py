"""MoE-SpAc's ablation (its §4.4, Table 4) in the simulator, on real routing (issue 39 item 4).

    python benchmarks/spac_ablation.py [--json] [--trace DIR] [--quick] [--save FILE]

Each of SpAc's components is removed in turn from the one C policy (``csrc/policy/spac.c``;
the options of :class:`specmoe.runtime.policies.SpAc`) and replayed through the simulator on
the shared DeepSeek-V2-Lite traces (all prompts; or any folder of traces in that layout with
``--trace``), at 5 / 10 / 25 % of the experts on three hardware profiles (laptop: DDR5 +
NVMe; rtx4090-nvme: a 24 GB GPU streaming experts from a PCIe 4.0 x4 NVMe; a100-pcie4:
experts in host memory over PCIe 4.0 x16).  Two tables, because the simulator replays
verification passes of g > 1 tokens demand only, and prefetch one token a pass:

1. **passes** (g = 2, 4, 8: the pass's per-expert counts feed the estimator, gamma = g - 1):
   ``spac`` as published; "w/o SpecUE" (binary utility, levels = 1); "w/o AdaBC" (fixed
   boundaries theta_up = 3, theta_down = 1, the paper's values); ``counts`` (no estimator:
   the pass's count itself is the level, min(K, f)); "w/o SG-Evictor" (LRU in its place).
2. **prefetch** (one token a pass; predictors ``history`` and ``learned``): ``spac`` (its
   prefetcher processes only experts with utility >= tau, §3.4); "separate scores" (the
   prefetcher not gated by tau: prefetch ranked by the predictor, eviction by the utility);
   "w/o HetWB" (a static tau = 2 instead of Eq. 11-12's); "w/o SG-Prefetcher" (no
   prefetch); "w/o SG-Evictor" (LRU with the same predictor).

Every row carries ``variant``, ``policy`` (the spec string), ``capacity``, ``hardware``,
``hit_rate``, ``est_tpot_ms`` and ``vs_spac`` (its time per token over spac's in the same
setting: above 1 means the component helped).  The paper's "w/o SD" row is not simulated:
the simulator's time per token for a pass of g tokens assumes every drafted token is
accepted, so it is not a speculative-decoding speedup.  Every figure is simulated
(csrc/sim.c's time model), not measured on hardware; the JSON records the host only for the
wall time.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE.parent / "training"))

from hostinfo import host  # noqa: E402
from predictors import HARDWARE, add_trace_arg, trace_dir  # noqa: E402  (issue 42's profiles)

from specmoe.sim.replay import simulate  # noqa: E402
from specmoe.sim.traces import load_puffin  # noqa: E402

# (variant, policy spec): the estimator's ablations, replayed in verification passes
PASS_VARIANTS = (("spac", "spac"), ("w/o SpecUE (K=1)", "spac:levels=1"),
                 ("w/o AdaBC (theta 3/1)", "spac:up=3,dn=1"),
                 ("no estimator (counts)", "spac:estimator=counts"),
                 ("w/o SG-Evictor (lru)", "lru"))
# (variant, policy spec, prefetch on): the prefetcher's and the balancer's ablations
PREFETCH_VARIANTS = (("spac", "spac", True), ("separate scores (no tau gate)", "spac:gate=0", True),
                     ("w/o HetWB (tau=2)", "spac:tau=2", True),
                     ("w/o SG-Prefetcher", "spac", False),
                     ("w/o SG-Evictor (lru)", "lru", True))


def row(tr, variant: str, spec: str, cap: str, hw: str, g: int = 1,
        pred: str | None = None) -> dict:
    r = simulate(tr, spec, cap, prefetch=pred, hardware=HARDWARE[hw], verify_tokens=g)
    return {"variant": variant, "policy": spec, "verify_tokens": g, "predictor": pred or "none",
            "capacity": cap, "hardware": hw, "hit_rate": round(r.hit_rate, 4),
            "prefetch_issued": r.prefetch_issued, "prefetch_dropped": r.prefetch_dropped,
            "est_tpot_ms": round(r.est_tpot_ms, 3)}


def with_ratios(rows: list[dict], key: tuple[str, ...]) -> list[dict]:
    """vs_spac: each row's est_tpot_ms over the spac row's with the same `key` fields."""
    base = {tuple(r[k] for k in key): r["est_tpot_ms"] for r in rows if r["variant"] == "spac"}
    for r in rows:
        r["vs_spac"] = round(r["est_tpot_ms"] / base[tuple(r[k] for k in key)], 4)
    return rows


def summary(rows: list[dict]) -> dict:
    """Per variant: the range of vs_spac over every setting, and in how many settings it is
    slower than spac by more than 1 %."""
    out: dict = {}
    for r in rows:
        s = out.setdefault(r["variant"], {"min": r["vs_spac"], "max": r["vs_spac"],
                                          "slower_than_spac": 0, "settings": 0})
        s["min"], s["max"] = min(s["min"], r["vs_spac"]), max(s["max"], r["vs_spac"])
        s["slower_than_spac"] += r["vs_spac"] > 1.01
        s["settings"] += 1
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    add_trace_arg(ap)
    ap.add_argument("--quick", action="store_true",
                    help="10 %% capacity, laptop, g = 4, history only")
    ap.add_argument("--save", type=Path, help="also write the JSON object to this file")
    a = ap.parse_args()
    path = trace_dir(a)
    t0 = time.time()
    tr = load_puffin(path)
    caps = ("10%",) if a.quick else ("5%", "10%", "25%")
    hws = ("laptop",) if a.quick else tuple(HARDWARE)
    passes = (4,) if a.quick else (2, 4, 8)
    preds = ("history",) if a.quick else ("history", "learned")
    p_rows = [row(tr, v, spec, cap, hw, g=g) for g in passes for cap in caps for hw in hws
              for v, spec in PASS_VARIANTS]
    f_rows = [dict(row(tr, v, spec, cap, hw, pred=pred if on else None), group=pred)
              for pred in preds for cap in caps for hw in hws
              for v, spec, on in PREFETCH_VARIANTS]
    out = {"machine": host(), "trace": str(path), "tokens": tr.num_tokens,
           "layers": tr.num_layers, "experts": tr.num_experts,
           "passes": with_ratios(p_rows, ("verify_tokens", "capacity", "hardware")),
           "prefetch": with_ratios(f_rows, ("group", "capacity", "hardware")),
           "wall_seconds": None}
    out["summary"] = {"passes": summary(out["passes"]), "prefetch": summary(out["prefetch"])}
    out["wall_seconds"] = round(time.time() - t0, 1)
    text = json.dumps(out, indent=None if a.json else 1)
    if a.save:
        a.save.write_text(json.dumps(out, indent=1) + "\n")
    print(text)


if __name__ == "__main__":
    main()

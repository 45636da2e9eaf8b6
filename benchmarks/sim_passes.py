"""Hit rate and collision misses of every eviction policy, including MoE-SpAc as published
(``spac``) beside the earlier EMA estimator (``spac_ema``) and SpecMD's LHU / FLD / score-based
baselines, on the real routing traces, demand only, at several cache sizes and forward passes
of 1, 2, 4 and 8 tokens (``simulate(..., verify_tokens=g)``: a pass of g tokens accesses the
union of their experts per layer once and first feeds the policies that learn from counts the
pass's per-expert activation counts; ``spac`` takes the draft length gamma = g - 1).

    python benchmarks/sim_passes.py [--traces DIR] [--fractions 0.05,0.1,0.25] \
        [--passes 1,2,4,8] [--max-tokens N] [--out benchmarks/results/sim_passes.json] \
        [--markdown] [--json]

Belady (the offline optimum) only with one token per pass: its future is the per-token access
sequence, which is not the access sequence of longer passes.  --markdown prints the table that
docs/simulator.md carries; --json prints the JSON object that --out writes.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from specmoe import load_trace, simulate  # noqa: E402

POLICIES = ["lru", "lfu", "fifo", "mru", "random", "least_stale", "least_stale:order=lru",
            "spac_ema", "spac", "lhu", "fld", "score", "belady"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--traces", default=str(HERE.parent.parent / "shared" / "traces" /
                                            "deepseek-v2-lite-puffin"))
    ap.add_argument("--fractions", default="0.05,0.1,0.25")
    ap.add_argument("--passes", default="1,2,4,8")
    ap.add_argument("--max-tokens", type=int, default=0, help="replay only the first N tokens")
    ap.add_argument("--out", default="")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    if not Path(a.traces).exists():
        a.traces = str(HERE.parent / "tests" / "data" / "puffin")
    tr = load_trace(a.traces)
    if a.max_tokens:
        tr = tr.slice(0, min(a.max_tokens, tr.num_tokens))
    fracs = [float(x) for x in a.fractions.split(",")]
    passes = [int(x) for x in a.passes.split(",")]
    rows = []
    t_all = time.perf_counter()
    for g in passes:
        for f in fracs:
            for p in POLICIES:
                if p == "belady" and g != 1:
                    continue
                r = simulate(tr, p, f, verify_tokens=g)
                rows.append({"policy": p, "capacity": f, "slots": r.capacity_slots,
                             "verify_tokens": g, "accesses": r.accesses,
                             "hit_rate": round(r.hit_rate, 4),
                             "collision_misses": r.collision_misses,
                             "evictions": r.evictions})
                if not (a.json or a.markdown):
                    print(f"g={g} {f:.0%} {p}: hit {r.hit_rate:.4f} collisions "
                          f"{r.collision_misses}", flush=True)
    out = {"traces": a.traces, "tokens": tr.num_tokens, "num_layers": tr.num_layers,
           "num_experts": tr.num_experts, "fractions": fracs, "passes": passes,
           "seconds": round(time.perf_counter() - t_all, 1), "rows": rows}
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1) + "\n")
    if a.json:
        print(json.dumps(out))
    if a.markdown:
        print(markdown(out))


def markdown(out: dict) -> str:
    """Hit rate per policy (rows) and capacity x pass length (columns); collision misses at
    10 % in a second table."""
    fr, ps = out["fractions"], out["passes"]
    get = {(r["policy"], r["capacity"], r["verify_tokens"]): r for r in out["rows"]}
    head = "| policy | " + " | ".join(f"{f:.0%} g={g}" for f in fr for g in ps) + " |"
    lines = [head, "|---" * (1 + len(fr) * len(ps)) + "|"]
    for p in POLICIES:
        cells = []
        for f in fr:
            col = [get[(q, f, g)]["hit_rate"] for q in POLICIES for g in ps
                   if (q, f, g) in get and q != "belady"]
            for g in ps:
                r = get.get((p, f, g))
                if r is None:
                    cells.append("-")
                    continue
                best = p != "belady" and r["hit_rate"] == max(
                    get[(q, f, g)]["hit_rate"] for q in POLICIES if q != "belady"
                    and (q, f, g) in get)
                cells.append(f"**{r['hit_rate']:.3f}**" if best and col else
                             f"{r['hit_rate']:.3f}")
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    lines += ["", "| collision misses at 10 % | " + " | ".join(f"g={g}" for g in ps) + " |",
              "|---" * (1 + len(ps)) + "|"]
    for p in POLICIES:
        cells = [f"{get[(p, 0.1, g)]['collision_misses']:,}" if (p, 0.1, g) in get else "-"
                 for g in ps]
        lines.append(f"| {p} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

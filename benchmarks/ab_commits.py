"""A/B of two checkouts of specmoe on one benchmark, interleaved: is a change speed-neutral?

    python benchmarks/ab_commits.py --base /tmp/wt-base --new . --rounds 3 --out results/x.json \
        -- decode_peers.py --models dsv2lite --rows specmoe-int4 --threads 1,2 --repeats 1

Each round runs the benchmark script of each checkout (its own copy, with ``PYTHONPATH`` set to
that checkout, so each side imports its own package and extension) once, the order alternating
between rounds (base first in odd rounds, new first in even ones) so that drift on a shared
machine does not favour one side.  The benchmark must accept ``--json`` and print one JSON
object whose ``rows`` carry ``tok_per_s`` (decode_peers.py and big_model.py do).  Reported per
row (model, name, threads): every round's tok/s on both sides, the per-round ratio new / base,
and their median, min and max; with the host's CPU model, ISA and thread count.  A row that
fails on one side is reported with the error, not dropped.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hostinfo  # noqa: E402


def host() -> dict:
    """CPU model, ISA level and core count of this machine (hostinfo.cpu)."""
    d = hostinfo.cpu()
    d["isa"] = d["cpu_isa"]
    return d


def run(tree: Path, script: str, args: list[str], timeout: float) -> dict:
    env = dict(os.environ, PYTHONPATH=str(tree))
    cmd = [sys.executable, str(tree / "benchmarks" / script), *args, "--json"]
    t0 = time.perf_counter()
    p = subprocess.run(cmd, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        return {"error": f"rc={p.returncode}: {p.stderr.strip()[-800:]}", "wall_s": wall}
    out = p.stdout.strip()
    try:
        d = json.loads(out[out.index("{"):])
    except ValueError as e:
        return {"error": f"no JSON on stdout ({e}): {out[-400:]}", "wall_s": wall}
    d["wall_s"] = wall
    return d


def _key(r: dict) -> str:
    return f"{r.get('model', '-')}/{r.get('name')}/t{r.get('threads', '-')}"


def rows_of(d: dict) -> dict:
    """tok/s per row (None where the row failed)."""
    return {_key(r): r.get("tok_per_s") if not r.get("error") else None
            for r in d.get("rows", [])}


def errors_of(d: dict) -> dict:
    """The error of each row that failed."""
    return {_key(r): str(r["error"]) for r in d.get("rows", []) if r.get("error")}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base", required=True, help="checkout before the change")
    ap.add_argument("--new", required=True, help="checkout after the change")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=3600.0, help="seconds per benchmark run")
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("bench", nargs=argparse.REMAINDER, help="-- SCRIPT [ARGS...]")
    a = ap.parse_args(argv)
    bench = a.bench[1:] if a.bench[:1] == ["--"] else a.bench
    if not bench:
        ap.error("give the benchmark after --: SCRIPT [ARGS...]")
    script, args = bench[0], bench[1:]
    trees = {"base": Path(a.base).resolve(), "new": Path(a.new).resolve()}
    per: dict[str, dict[str, list]] = {}
    runs = []
    side_runs: dict[str, list] = {"base": [], "new": []}
    for rnd in range(a.rounds):
        order = ["base", "new"] if rnd % 2 == 0 else ["new", "base"]
        got = {}
        for side in order:
            d = run(trees[side], script, args, a.timeout)
            got[side] = d
            side_runs[side].append(d)
            errs = errors_of(d)
            runs.append({"round": rnd + 1, "side": side, "wall_s": d.get("wall_s"),
                         "error": d.get("error"), "row_errors": errs or None})
            print(f"round {rnd + 1} {side}: {d.get('error') or rows_of(d)}"
                  + (f" errors: {errs}" if errs else ""), file=sys.stderr)
        for side in ("base", "new"):
            for k, v in rows_of(got[side]).items():
                per.setdefault(k, {"base": [], "new": []})[side].append(v)
    summary = {}
    for k, v in sorted(per.items()):
        ratios = [n / b for b, n in zip(v["base"], v["new"]) if b and n]
        summary[k] = {"base_tok_per_s": v["base"], "new_tok_per_s": v["new"],
                      "ratios_new_over_base": ratios,
                      "median": statistics.median(ratios) if ratios else None,
                      "min": min(ratios) if ratios else None,
                      "max": max(ratios) if ratios else None}
    configs = {side: next((r["config"] for r in side_runs[side] if "config" in r), None)
               for side in ("base", "new")}
    res = {"host": host(), "benchmark": [script, *args], "rounds": a.rounds,
           "config": configs,  # each side's benchmark configuration (its first run's)
           "base": str(trees["base"]), "new": str(trees["new"]),
           "base_commit": _commit(trees["base"]), "new_commit": _commit(trees["new"]),
           "rows": summary, "runs": runs}
    text = json.dumps(res, indent=1)
    if a.out:
        Path(a.out).write_text(text + "\n")
    print(text)


def _commit(tree: Path) -> str | None:
    try:
        return subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


if __name__ == "__main__":
    main()

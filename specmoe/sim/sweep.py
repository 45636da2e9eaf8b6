"""Sweeps of the simulator over policies x capacities x hardware x predictors, in parallel
over processes, with CSV/JSON output and plots.

>>> rows = sweep(trace, ["lru", "lfu", "belady"], ["5%", "10%", "25%"],
...              hardware=["a100-pcie4", "laptop"], predictors=["none", "history:topk=8"])
>>> write_results(rows, "out/")   # out/results.csv, out/results.json, out/hit_rate.png, ...
"""
from __future__ import annotations

import csv
import json
import multiprocessing as mp
import os
from itertools import product
from pathlib import Path
from typing import Any, Iterable, Sequence

from .calibration import get_hardware
from .hardware import Hardware, ModelCost
from .replay import Predictor, simulate
from .traces import Trace

__all__ = ["sweep", "write_results", "plot_hit_rate", "plot_stall"]

# Work of the current sweep, inherited by forked workers (nothing but an index is pickled, so
# policies defined in a notebook work too).
_JOB: dict[str, Any] = {}


def _run(i: int) -> dict:
    trace, tasks, model = _JOB["trace"], _JOB["tasks"], _JOB["model"]
    policy, cap, hw, pred = tasks[i]
    d = simulate(trace, policy, cap, pred, hw, model=model,
                 verify_tokens=_JOB.get("verify_tokens", 1)).to_dict()
    d["capacity"] = str(cap)
    return d


def sweep(trace: Trace, policies: Sequence[Any], capacities: Sequence["int | float | str"],
          hardware: Sequence["str | Hardware"] = ("a100-pcie4",),
          predictors: Sequence["str | Predictor | None"] = ("none",), *,
          processes: int | None = None, progress: bool = True,
          model: ModelCost | None = None, verify_tokens: int = 1) -> list[dict]:
    """Simulate every combination; returns one dict per run (``SimResult.to_dict()`` plus
    ``capacity`` as given), in product order.  ``processes``: worker processes (default: the
    CPU count; 1 runs in this process).  Policies are names, ``_C.Policy`` factories or other
    :func:`specmoe.sim.replay.simulate` policy arguments (a ``_C.Policy`` object can serve one run
    only, so pass a factory).  ``verify_tokens``: tokens per pass for every run (see
    :func:`specmoe.sim.replay.simulate`)."""
    hws = [get_hardware(h) for h in hardware]  # calibrate once, in the parent
    preds = [Predictor.parse(p) for p in predictors]
    tasks = list(product(policies, capacities, hws, preds))
    if processes is None:
        processes = os.cpu_count() or 1
    processes = max(1, min(processes, len(tasks)))
    _JOB.update(trace=trace, tasks=tasks, model=model, verify_tokens=verify_tokens)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(tasks), desc="sweep", unit="run")
    try:
        if processes == 1 or "fork" not in mp.get_all_start_methods():
            rows = []
            for i in range(len(tasks)):
                rows.append(_run(i))
                if bar:
                    bar.update()
        else:
            with mp.get_context("fork").Pool(processes) as pool:
                rows = []
                for r in pool.imap(_run, range(len(tasks))):
                    rows.append(r)
                    if bar:
                        bar.update()
    finally:
        _JOB.clear()
        if bar:
            bar.close()
    return rows


def write_results(rows: Sequence[dict], out_dir: "str | os.PathLike", *,
                  plots: bool = True) -> dict[str, Path]:
    """Write ``results.csv`` and ``results.json`` (and ``hit_rate.png``, ``stall.png`` when
    ``plots`` and matplotlib is installed) into ``out_dir``; returns the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"csv": out / "results.csv", "json": out / "results.json"}
    cols: list[str] = []
    for r in rows:
        cols += [k for k in r if k not in cols]
    with open(paths["csv"], "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows(rows)
    paths["json"].write_text(json.dumps(list(rows), indent=1))
    if plots:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            return paths
        paths["hit_rate"] = plot_hit_rate(rows, out / "hit_rate.png")
        paths["stall"] = plot_stall(rows, out / "stall.png")
    return paths


def _subset(rows: Iterable[dict], **eq) -> list[dict]:
    return [r for r in rows if all(r.get(k) == v for k, v in eq.items())]


def plot_hit_rate(rows: Sequence[dict], path: "str | os.PathLike | None" = None, *,
                  predictor: str = "none", hardware: str | None = None, ax=None):
    """Hit rate against capacity, one line per policy, Belady (when present) as the dashed
    bound.  Saves to ``path`` when given (returns it), else returns the axes."""
    import matplotlib

    if path is not None and ax is None:
        matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    hardware = hardware or (rows[0]["hardware"] if rows else None)
    sel = _subset(rows, predictor=predictor, hardware=hardware)
    fig = None
    if ax is None:
        fig, ax = plt.subplots(figsize=(5.6, 3.6), dpi=100)
    for pol in dict.fromkeys(r["policy"] for r in sel):
        pts = sorted((r["capacity_fraction"], r["hit_rate"]) for r in sel if r["policy"] == pol)
        xs, ys = [100 * p[0] for p in pts], [p[1] for p in pts]
        if pol == "belady":
            ax.plot(xs, ys, "k--", label="belady (bound)")
        else:
            ax.plot(xs, ys, "o-", label=pol, markersize=3)
    ax.set_xlabel("capacity (% of all experts)")
    ax.set_ylabel("hit rate")
    ax.set_title(f"hit rate vs capacity (prefetch: {predictor})", fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if fig is not None and path is not None:
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
        return Path(path)
    return ax


def plot_stall(rows: Sequence[dict], path: "str | os.PathLike | None" = None, *,
               capacity: str | None = None, hardware: str | None = None, ax=None):
    """Stall time per token (ms) per policy (groups) and predictor (bars) at one capacity and
    hardware (default: the first in ``rows``)."""
    import matplotlib

    if path is not None and ax is None:
        matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    import numpy as np

    if not rows:
        raise ValueError("no rows to plot")
    capacity = capacity or rows[0]["capacity"]
    hardware = hardware or rows[0]["hardware"]
    sel = _subset(rows, capacity=capacity, hardware=hardware)
    pols = list(dict.fromkeys(r["policy"] for r in sel))
    preds = list(dict.fromkeys(r["predictor"] for r in sel))
    fig = None
    if ax is None:
        fig, ax = plt.subplots(figsize=(5.6, 3.6), dpi=100)
    width = 0.8 / max(len(preds), 1)
    for j, pr in enumerate(preds):
        ys = []
        for p in pols:
            m = [r for r in sel if r["policy"] == p and r["predictor"] == pr]
            ys.append(1e3 * m[0]["stall_s"] / max(m[0]["tokens"], 1) if m else np.nan)
        ax.bar(np.arange(len(pols)) + j * width, ys, width, label=pr)
    ax.set_xticks(np.arange(len(pols)) + width * (len(preds) - 1) / 2)
    ax.set_xticklabels(pols, fontsize=8)
    ax.set_ylabel("stall per token (ms)")
    ax.set_title(f"stall by policy and predictor ({capacity}, {hardware})", fontsize=10)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3, axis="y")
    if fig is not None and path is not None:
        fig.tight_layout()
        fig.savefig(path)
        plt.close(fig)
        return Path(path)
    return ax


"""MoE-SpeQ's Amortization Roofline (Sec. 3.2.1, Eq. 1; Fig. 8): where each draft length k puts
speculative offloading between the compute it runs and the synchronous expert I/O it waits for.

For a draft length k the :class:`~specmoe.speculation.controllers.SpeqGovernor`'s model gives
E[N(k)], the expected tokens a cycle yields (Eq. 2's numerator), and T_cycle(k) =
T_draft(k) + T_first + T_verify(k + 1) + T_io(k) (Eq. 3), each term learned online.  With the
link's bandwidth BW:

* **amortization intensity** (x axis, Eq. 1): I(k) = W * E[N(k)] / B_sync(k), the useful work
  per byte of synchronous I/O, where B_sync(k) = BW * (T_first + T_io(k)) are the bytes a
  cycle waits for and W the work per token (1 by default);
* **effective throughput** (y axis, Eq. 2): Theta(k) = E[N(k)] / T_cycle(k), tokens per second
  as the governor models a cycle (compute and I/O in series);
* **compute roof**: E[N(k)] / (T_draft(k) + T_verify(k + 1)), the throughput with the I/O
  hidden entirely; it depends on k, one horizontal roof per k;
* **I/O roof**: BW * I(k) / W = E[N(k)] / (T_first + T_io(k)), the throughput when a cycle
  is only its synchronous fetches: a slanted line of slope BW / W through the origin;
* **attainable**: min(compute roof, I/O roof), the bound with compute and I/O overlapped.

The governor picks argmax Theta(k) (Eq. 4); :func:`amortization_roofline` lays every k out
so a plot (:func:`plot_roofline`) shows how far that point sits below its roofs, i.e. how
much overlapping the I/O with drafting (MoE-SpeQ's pipeline) could still gain.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Dict, List, Optional, Sequence

from .controllers import SpeqGovernor

__all__ = ["RooflinePoint", "amortization_roofline", "plot_roofline"]


@dataclass(frozen=True)
class RooflinePoint:
    """One draft length on the roofline (module docstring; seconds, bytes, tokens/s)."""

    k: int
    expected_tokens: float      # E[N(k)]
    t_draft: float              # T_draft(k): k draft tokens
    t_first: float              # the first mandatory fetch
    t_verify: float             # T_verify(k + 1)
    t_io: float                 # the experts the draft adds
    sync_bytes: float           # B_sync(k) = BW * (t_first + t_io)
    intensity: float            # I(k), Eq. 1 (inf with no synchronous I/O)
    throughput: float           # Theta(k), Eq. 2
    compute_roof: float
    io_roof: float              # inf with no synchronous I/O
    attainable: float

    @property
    def cycle_s(self) -> float:
        """T_cycle(k) (Eq. 3)."""
        return self.t_draft + self.t_first + self.t_verify + self.t_io

    def as_dict(self) -> Dict[str, Any]:
        return asdict(self)


def _pos(name: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
        raise ValueError(f"{name} must be a finite number > 0, got {v!r}")
    return float(v)


def amortization_roofline(governor: SpeqGovernor, bandwidth: float, work: float = 1.0,
                          ks: Optional[Sequence[int]] = None) -> List[RooflinePoint]:
    """The roofline coordinates of ``governor``'s current model for every k in ``ks``
    (default 0..k_max).  ``bandwidth``: the link's bytes per second (the store or PCIe rate
    the expert loads see); ``work``: W, the work per token (Eq. 1).  ValueError on a
    non-positive bandwidth or work, a k outside 0..k_max; TypeError for another controller."""
    if not isinstance(governor, SpeqGovernor):
        raise TypeError(f"the amortization roofline is the SpeqGovernor's model, got "
                        f"{type(governor).__name__}")
    bw, w = _pos("bandwidth", bandwidth), _pos("work", work)
    out = []
    for k in (range(governor.k_max + 1) if ks is None else ks):
        e, _ = governor.model(int(k))
        t_draft, t_first, t_verify, t_io = governor.model_parts(int(k))
        sync = t_first + t_io
        compute = t_draft + t_verify
        comp_roof = e / compute if compute > 0 else math.inf
        io_roof = e / sync if sync > 0 else math.inf
        out.append(RooflinePoint(
            k=int(k), expected_tokens=e, t_draft=t_draft, t_first=t_first, t_verify=t_verify,
            t_io=t_io, sync_bytes=bw * sync,
            intensity=w * e / (bw * sync) if sync > 0 else math.inf,
            throughput=e / max(compute + sync, 1e-12), compute_roof=comp_roof,
            io_roof=io_roof, attainable=min(comp_roof, io_roof)))
    return out


def plot_roofline(points: Sequence[RooflinePoint], bandwidth: float, work: float = 1.0,
                  chosen: Optional[int] = None, ax: Any = None) -> Any:
    """Fig. 8's picture on matplotlib axes (made when ``ax`` is None): the I/O roof (slope
    BW / W), each k's compute roof from its knee on, each k's modelled throughput at its
    intensity, ``chosen`` (the governor's k) marked.  The x axis reads intensity per MB
    (1e6 bytes).  Returns the axes."""
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.ticker import NullFormatter
    bw, w = _pos("bandwidth", bandwidth), _pos("work", work)
    if ax is None:
        _, ax = plt.subplots(figsize=(7, 4.5))
    pts = [p for p in points if math.isfinite(p.intensity) and p.intensity > 0]
    if not pts:
        raise ValueError("no point with synchronous I/O: the roofline has no I/O side")
    lo = min(p.intensity for p in pts) / 4
    hi = max(max(p.intensity for p in pts), max(p.compute_roof * w / bw for p in pts)) * 4
    x = np.geomspace(lo, hi, 200)
    mb = 1e6  # the axis in tokens per MB
    ax.loglog(x * mb, bw * x / w, color="black", lw=1.5,
              label=f"I/O roof ({bw / 1e9:.2g} GB/s)")
    cmap = plt.get_cmap("viridis")
    for i, p in enumerate(pts):
        c = cmap(i / max(1, len(pts) - 1))
        knee = p.compute_roof * w / bw
        ax.hlines(p.compute_roof, knee * mb, hi * mb, colors=[c], lw=1, alpha=0.6)
        ax.plot([p.intensity * mb], [p.throughput], "o", color=c, ms=7 if p.k != chosen else 11,
                mec="red" if p.k == chosen else c, mew=2 if p.k == chosen else 1,
                label=f"k={p.k}" + (" (governor)" if p.k == chosen else ""))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("amortization intensity I(k) = W E[N(k)] / synchronous MB")
    ax.set_ylabel("tokens / s")
    ax.set_title("MoE-SpeQ amortization roofline (Sec. 3.2.1)")
    ax.legend(fontsize=8, ncol=2)
    return ax

"""SpecMD's miss handling, cache-aware routing and link emulation, as settings of an
:class:`specmoe.runtime.engine.Engine` (the mechanisms themselves run in C: csrc/layer.h step 4 and
csrc/cache.h's throttle).

SpecMD (Hoang et al., "SpecMD: A Comprehensive Study on Speculative Expert Prefetching"):

* **miss handling** (Sec. 3.1.2), what a layer does with a routed expert that is not resident:

  - ``"fetch"`` -- load it and wait (the default; exact output);
  - ``"drop"`` -- skip it unless some token ranks it in its top ``miss_keep`` (by routing
    weight), which are always fetched (SpecMD after Skliar et al.: resilient beyond rank 2,
    so ``miss_keep=2``); the other weights are not renormalised (Algorithm 1 line 6);
  - ``"substitute"`` -- use instead the resident expert of the layer, not already chosen by
    the token, whose router score is closest to the missing one's (score proximity, after
    Zhu et al.), with the missing expert's weight; nothing resident: fetch;
  - ``"lowest_bit"`` -- compute it from a resident low-bit copy of every expert
    (fetch-lowest-bit: the lowest of ``miss_levels``, no load);
  - ``"priority"`` -- fetch-priority (Sec. 3.1.2, 5.3: "int8 -> int4 -> int2"): fetch it at
    full precision if some token ranks it in its top ``miss_keep``, else compute the pair from
    a resident low-bit copy chosen by the pair's own rank: ranks ``miss_keep .. miss_keep2-1``
    from the first of ``miss_levels``, ranks from ``miss_keep2`` on from the second.  SpecMD
    degrades the bottom 60 % by gating score: ``miss_keep = ceil(0.4 * top_k)``; it does not
    say how the degraded ranks split between its int4 and int2 levels, so ``miss_keep2``
    defaults to the lower half of them (``miss_keep + (top_k - miss_keep) // 2``);

* **the low-bit levels** ``miss_levels``: ``"int4"`` (default), ``"int2"``, ``"int8"``, or two
  of them highest first in SpecMD's notation, ``"int4:int2"``.  Each is a resident copy of
  every routed expert, built from the store on first use and shared with the self-draft
  (:meth:`Engine.enable_self_draft`) when the formats agree: about 1/7 (int4) or 3/32 (int2,
  groups of 64 with an f32 scale and offset) of the f32 size of all experts.  int2 is
  asymmetric (HQQ-style scale and zero point, refined by least squares; specmoe.storage.quant);

* **cache-aware routing** (Sec. 3.1.1, Eq. 1): ``z' = z + lambda * Delta_avg * 1_C`` on the
  router logits of each token before its experts are chosen, the resident experts' logits
  raised; the weights stay those of the unmodified logits (Appendix A.1).  ``route_lambda``
  is lambda (0: off; Sec. 5.4 finds 0.1-0.5 best); Delta_avg is the running mean of each
  token's logit range at that layer (see csrc/layer.h for why the range);

* **hardware emulation** (Appendix A.4): ``throttle=(GB_per_s, latency_us)`` makes every store
  read of the cache (demand loads and the prefetch worker's) take at least
  ``latency + block_bytes / bandwidth``, the reads sharing one emulated link.
"""
from __future__ import annotations

import math
from typing import Any

__all__ = ["MISS_MODES", "MISS_SETTINGS", "LOWBIT_DTYPES", "check_miss", "check_levels",
           "check_throttle"]

MISS_MODES = ("fetch", "drop", "substitute", "lowest_bit", "priority")
# the settings the C layers hold (Layers.set_miss, read back by Layers.config())
MISS_SETTINGS = ("miss", "miss_keep", "route_lambda", "miss_keep2")
LOWBIT_DTYPES = ("int8", "int4", "int2")  # formats of a resident low-bit copy, highest first


def check_levels(miss_levels: Any, miss_keep2: Any, miss_keep: int,
                 top_k: int) -> tuple[tuple[str, ...], int]:
    """Validate ``miss_levels`` (``"int4"``, ``"int4:int2"``, or a sequence of formats, highest
    precision first, one or two of :data:`LOWBIT_DTYPES`) and ``miss_keep2`` (None: the lower
    half of the degraded ranks with two levels, top_k with one); returns (levels, keep2)."""
    if isinstance(miss_levels, str):
        levels = tuple(miss_levels.split(":"))
    elif isinstance(miss_levels, (tuple, list)) and all(isinstance(v, str) for v in miss_levels):
        levels = tuple(miss_levels)
    else:
        raise TypeError(f"miss_levels must be a string like 'int4' or 'int4:int2' (or a tuple of "
                        f"formats); got {miss_levels!r}")
    if not 1 <= len(levels) <= 2 or any(v not in LOWBIT_DTYPES for v in levels):
        raise ValueError(f"miss_levels={miss_levels!r}: one or two of {LOWBIT_DTYPES}, highest "
                         f"precision first (SpecMD's 'int4:int2')")
    if len(levels) == 2 and LOWBIT_DTYPES.index(levels[0]) >= LOWBIT_DTYPES.index(levels[1]):
        raise ValueError(f"miss_levels={miss_levels!r}: the second level must have fewer bits "
                         f"than the first")
    if miss_keep2 is None:
        keep2 = miss_keep + (top_k - miss_keep) // 2 if len(levels) == 2 else top_k
    else:
        if isinstance(miss_keep2, bool) or not isinstance(miss_keep2, int):
            raise TypeError(f"miss_keep2 must be an int or None, got {miss_keep2!r}")
        if len(levels) == 1 and miss_keep2 < top_k:
            raise ValueError(f"miss_keep2={miss_keep2} sends ranks to a second low-bit level, "
                             f"but miss_levels={miss_levels!r} has one")
        keep2 = min(int(miss_keep2), top_k)
        if keep2 < miss_keep:
            raise ValueError(f"miss_keep2 ({miss_keep2}) must be >= miss_keep ({miss_keep})")
    return levels, keep2


def check_miss(miss: Any, miss_keep: Any, route_lambda: Any, top_k: int) -> tuple[str, int, float]:
    """Validate the miss settings; returns them normalised (miss_keep capped at top_k).
    ValueError/TypeError name the argument that is wrong."""
    if not isinstance(miss, str):
        raise TypeError(f"miss must be a string, one of {MISS_MODES}; got {miss!r}")
    if miss not in MISS_MODES:
        raise ValueError(f"miss={miss!r} is not a miss mode; choose one of {MISS_MODES}")
    if isinstance(miss_keep, bool) or not isinstance(miss_keep, int):
        raise TypeError(f"miss_keep must be an int, got {miss_keep!r}")
    if miss_keep < 0:
        raise ValueError(f"miss_keep must be >= 0, got {miss_keep}")
    if isinstance(route_lambda, bool) or not isinstance(route_lambda, (int, float)):
        raise TypeError(f"route_lambda must be a number, got {route_lambda!r}")
    if not (math.isfinite(route_lambda) and route_lambda >= 0):
        raise ValueError(f"route_lambda must be finite and >= 0, got {route_lambda}")
    # keep >= top_k: every rank is fetched (the default 2 on a top-1 model)
    return miss, min(int(miss_keep), top_k), float(route_lambda)


def check_throttle(throttle: Any) -> tuple[float, float]:
    """``None`` or ``(GB_per_s, latency_us)`` -> (bytes per second, seconds); (0, 0) is off.
    A bandwidth of 0 means no bandwidth limit (latency only)."""
    if throttle is None:
        return 0.0, 0.0
    if not isinstance(throttle, (tuple, list)) or len(throttle) != 2 or any(
            isinstance(v, bool) or not isinstance(v, (int, float)) for v in throttle):
        raise TypeError(f"throttle must be None or (GB_per_s, latency_us), got {throttle!r}")
    gbps, lat_us = float(throttle[0]), float(throttle[1])
    if not (math.isfinite(gbps) and gbps >= 0 and math.isfinite(lat_us) and lat_us >= 0):
        raise ValueError(f"throttle=(GB/s, latency_us) must be finite and >= 0, got {throttle!r}")
    return gbps * 1e9, lat_us * 1e-6


def copies_in_use(engine: Any, settings: dict[str, Any]) -> list[str]:
    """The formats of the low-bit copies the C layers get under the miss ``settings``
    (:data:`MISS_SETTINGS`), copy 0 first: the miss mode's levels (lowest_bit: the lowest;
    priority: the first, and the second when some rank uses it), else the self-draft's copy
    (the MTP drafter's masks compute their misses from copy 0)."""
    if settings["miss"] == "lowest_bit":
        return [engine.miss_levels[-1]]
    if settings["miss"] == "priority":
        return list(engine.miss_levels[:2 if settings["miss_keep2"] < engine.top_k else 1])
    return [engine.draft_copy.dtype] if engine.draft_copy is not None else []


def apply(engine: Any, settings: dict[str, Any] | None = None) -> None:
    """Set the miss ``settings`` (:data:`MISS_SETTINGS`; None: the engine's own, as its C
    layers hold them) in the engine's C layer object with the low-bit copies they use, and the
    link throttle in its cache (called whenever either is (re)built or a setting changes)."""
    lay, cache = engine.layers, engine.cache
    if lay is None or cache is None:
        return
    s = {k: getattr(engine, k) for k in MISS_SETTINGS} if settings is None \
        else dict(settings)  # (read before anything changes)
    copies = [engine.lowbit_copy(dt) for dt in copies_in_use(engine, s)]  # built before any
    lay.set_miss("fetch", s["miss_keep"], 0.0)  # no copy in use while they change
    lay.set_lowbit(None, level=1)
    if copies:
        for level, c in enumerate(copies):
            lay.set_lowbit(engine.copy_buffer(c), c.desc, c.block_bytes, level=level,
                           size=c.buf.nbytes)
    else:
        lay.set_lowbit(None, level=0)
    # (keep2 < top_k with priority always has the second copy: check_levels)
    lay.set_miss(s["miss"], s["miss_keep"], s["route_lambda"], keep2=s["miss_keep2"])
    cache.set_throttle(engine.throttle)
    engine.prune_copies({c.dtype for c in copies})

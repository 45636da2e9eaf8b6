"""SpecMD's miss handling, cache-aware routing and link emulation, as settings of an
:class:`specmoe.hf.Engine` (the mechanisms themselves run in C: csrc/layer.h step 4 and
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
  - ``"lowest_bit"`` -- compute it from a resident low-bit copy (fetch-lowest-bit): the int4
    copy of every expert the self-draft keeps (:meth:`Engine.enable_self_draft`, built on
    first use if absent: about 1/7 of the f32 size of all experts);
  - ``"priority"`` -- fetch-priority (Sec. 3.1.2, 5.3): fetch it at full precision if some
    token ranks it in its top ``miss_keep``, else compute it from the low-bit copy.  SpecMD
    degrades the bottom 60 % by gating score: ``miss_keep = ceil(0.4 * top_k)``.  Two levels
    (the store's precision, then int4); SpecMD's int8 -> int4 -> int2 cascade has a third,
    int2, which specmoe has no format for;

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

__all__ = ["MISS_MODES", "check_miss", "check_throttle"]

MISS_MODES = ("fetch", "drop", "substitute", "lowest_bit", "priority")


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


def apply(engine: Any) -> None:
    """Push the engine's settings into its C layer object and cache (called whenever either is
    (re)built or a setting changes)."""
    lay, cache = engine._layers, engine._cache
    if lay is None or cache is None:
        return
    if engine.miss in ("lowest_bit", "priority") and engine._draft is None:
        engine.enable_self_draft("int4")  # calls apply() again with the copy in place
        return
    if engine._draft is not None:
        d = engine._draft
        lay.set_lowbit(d.buf, d.desc, d.block_bytes)
    lay.set_miss(engine.miss, engine.miss_keep, engine.route_lambda)
    cache.native.set_throttle(*check_throttle(engine.throttle))

"""specmoe: run Mixture-of-Experts models whose experts do not fit in fast memory.

Routed experts live in a slow tier (:class:`ExpertStore`, one safetensors-compatible file), a
bounded set of them in fast memory (:class:`ExpertCache`) under a pluggable eviction policy,
with a prefetch worker thread loading the experts predicted next.  The per-token paths run in
the C extension ``specmoe._C``; this package is the thin, typed Python surface over it.
"""
from __future__ import annotations

from ._C import CacheError, PolicyError, SpecmoeError, StoreError
from . import kernels, quant  # expert FFN kernels and weight formats

__version__ = "0.1.0"

__all__ = [
    "SpecmoeError",
    "StoreError",
    "CacheError",
    "PolicyError",
]

"""The fast tier: a bounded cache of expert blocks over an :class:`~specmoe.ExpertStore`.

:class:`ExpertCache` holds ``capacity`` slots, each one store block (all tensors of one
(layer, expert)).  :meth:`ExpertCache.acquire` pins an expert and returns its bytes, loading it
from the store on a miss; :meth:`ExpertCache.release` unpins it.  A pinned expert is never
evicted.  When every slot is full the eviction policy (``"lru"`` and the other built-ins, or
any policy object from :mod:`specmoe.runtime.policies`) picks the slot to give up.  A background
worker thread loads prefetch requests (:meth:`ExpertCache.prefetch`) in priority order into
free slots or evictable ones not used in the current forward pass (:meth:`begin_pass`).

All the work happens in C (``specmoe._C.Cache``), with the GIL released around every call, so
several Python threads may use one cache at once.

Counters (:meth:`ExpertCache.stats`):

* ``hits`` / ``misses``: demand accesses that found the expert ready / did not (a demand
  access that waits for a prefetch still loading is a miss, and also ``prefetch_late``).
* ``collision_misses``: misses on an expert evicted earlier in the same forward pass.
* ``prefetch_issued`` (loads started), ``prefetch_used`` (prefetched experts later used by
  demand, late ones included), ``prefetch_wasted`` (evicted before any demand use),
  ``prefetch_dropped`` (requests dropped: no slot could be given up), ``prefetch_refused``
  (requests the admission rule refused, :meth:`ExpertCache.set_admission`), ``prefetch_failed``.
* ``evictions``, ``bytes_read`` (from the store by this cache), ``stall_s`` (seconds demand
  accesses spent blocked on loads).
"""
from __future__ import annotations

import math
import re
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np

from .. import _C
from .._C import CacheError

__all__ = ["ExpertCache", "parse_capacity", "check_capacity", "CacheError"]

_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z%]*)\s*$")


def check_capacity(capacity: int | float | str) -> tuple[str, float]:
    """Check a capacity spec's form and range without knowing the model: returns
    ``("slots", n)``, ``("fraction", f)`` or ``("bytes", b)``.  Raises ValueError for anything
    :func:`parse_capacity` would refuse whatever the model (so a bad spec fails before a
    conversion, not after it)."""
    if isinstance(capacity, bool):
        raise ValueError(f"capacity must be an int, float or str, got {capacity!r}")
    if isinstance(capacity, (int, np.integer)):
        n = int(capacity)
        if n < 1:
            raise ValueError(f"capacity must be at least 1 slot, got {n}")
        return "slots", n
    if isinstance(capacity, (float, np.floating)):
        f = float(capacity)
        if not (0.0 < f <= 1.0):
            raise ValueError("a float capacity is a fraction of all experts and must be in "
                             f"(0, 1], got {f}")
        return "fraction", f
    if not isinstance(capacity, str):
        raise ValueError(f"capacity must be an int, float or str, got {type(capacity).__name__}")
    m = _SIZE_RE.match(capacity)
    if not m:
        raise ValueError(f"cannot parse capacity {capacity!r}: expected e.g. '512MiB', "
                         "'2GB' or '25%'")
    value, unit = float(m.group(1)), m.group(2).lower()
    if not math.isfinite(value):  # "1e400GiB": math.floor(inf) would be OverflowError
        raise ValueError(f"capacity {capacity!r}: value out of range")
    if unit == "%":
        if not (0.0 < value <= 100.0):
            raise ValueError(f"capacity {capacity!r}: percentage must be in (0, 100]")
        return "fraction", value / 100.0
    if unit not in _UNITS:
        raise ValueError(f"capacity {capacity!r}: unknown unit {m.group(2)!r} (use B, KB, MB, "
                         "GB, TB, KiB, MiB, GiB, TiB or %)")
    return "bytes", value * _UNITS[unit]


def parse_capacity(capacity: int | float | str, *, total_experts: int, slot_bytes: int) -> int:
    """Turn a capacity spec into a slot count.

    * ``int``: that many slots.
    * ``float`` in (0, 1]: that fraction of all ``total_experts`` (rounded down, at least 1).
    * ``str``: a size (``"512MiB"``, ``"2GB"``, ``"4096"`` bytes; units B, KB, MB, GB, TB in
      powers of 1000 and KiB, MiB, GiB, TiB in powers of 1024) giving
      ``floor(bytes / slot_bytes)`` slots, or a percentage (``"25%"``) of all experts.

    The result is capped at ``total_experts`` (more slots could never be used).  Raises
    ValueError for anything else (:func:`check_capacity`) or a result below one slot.
    """
    if total_experts <= 0 or slot_bytes <= 0:
        raise ValueError(f"total_experts ({total_experts}) and slot_bytes ({slot_bytes}) must be "
                         "positive")
    kind, value = check_capacity(capacity)
    if kind == "slots":
        n = int(value)
    elif kind == "fraction":
        n = max(1, math.floor(value * total_experts + 1e-9))
    else:
        n = math.floor(value / slot_bytes + 1e-9)
        if n < 1:
            raise ValueError(f"capacity {capacity!r} ({int(value)} bytes) holds no expert: "
                             f"one slot is {slot_bytes} bytes")
    return min(n, total_experts)


def _make_policy(spec: Any, nslots: int, num_layers: int, num_experts: int) -> Any:
    """Policy argument for the C cache: a ``_C.Policy`` built by
    :func:`specmoe.runtime.policies.make_policy` (names, specs, Python policies), or, in a build without
    the policy objects, a built-in policy name (str) that the C binding looks up itself."""
    if hasattr(_C, "Policy"):
        from .policies import make_policy

        return make_policy(spec, nslots, num_layers, num_experts)
    if isinstance(spec, str):
        return spec
    raise TypeError(f"policy must be a policy name (str), got {type(spec).__name__}")


class ExpertCache:
    """A bounded cache of experts from ``store`` in fast memory.

    ``ExpertCache(store, capacity, policy="lru", *, top_k=None, prefetch=True)``

    * ``store``: an open :class:`specmoe.ExpertStore` (or ``_C.Store``); it must stay open
      while the cache is used (the cache does not close it).
    * ``capacity``: slots (int), a fraction of all experts (float in (0, 1]), or a size /
      percentage string (``"512MiB"``, ``"2GB"``, ``"25%"``); see :func:`parse_capacity`.
    * ``policy``: an eviction policy name (``"lru"``, ...), a ``_C.Policy`` or any spec that
      :func:`specmoe.runtime.policies.make_policy` accepts.
    * ``top_k``: experts pinned at once by one token (default: ``store.top_k``, else 1); a
      capacity below it raises ValueError.
    * ``prefetch``: start the prefetch worker thread.
    """

    def __init__(self, store: Any, capacity: int | float | str, policy: Any = "lru", *,
                 top_k: int | None = None, prefetch: bool = True) -> None:
        nl, ne, bb = int(store.num_layers), int(store.num_experts), int(store.block_bytes)
        nslots = parse_capacity(capacity, total_experts=nl * ne, slot_bytes=bb)
        if top_k is None:
            top_k = getattr(store, "top_k", None) or 1
        if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 1:
            raise ValueError(f"top_k must be a positive int, got {top_k!r}")
        top_k = int(top_k)
        if nslots < top_k:
            raise ValueError(f"cache capacity {capacity!r} gives {nslots} slots, fewer than "
                             f"top_k = {top_k}: one token needs {top_k} experts pinned at once")
        self._store = store
        self._top_k = top_k
        self._c = _C.Cache(store, nslots, _make_policy(policy, nslots, nl, ne),
                           min_slots=top_k, prefetch=bool(prefetch))

    # -- facts -----------------------------------------------------------------------------
    @property
    def capacity(self) -> int:
        """Number of slots."""
        return int(self._c.nslots)

    @property
    def top_k(self) -> int:
        """Minimum number of slots this cache was checked against."""
        return self._top_k

    @property
    def store(self) -> Any:
        """The store the cache reads from."""
        return self._store

    @property
    def slot_bytes(self) -> int:
        """Bytes per slot (the store's block size)."""
        return int(self._c.slot_bytes)

    @property
    def policy(self) -> str:
        """Name of the current eviction policy."""
        return str(self._c.policy_name)

    @property
    def pass_id(self) -> int:
        """Current forward pass id (starts at 1, incremented by :meth:`begin_pass`)."""
        return int(self._c.pass_id)

    @property
    def native(self) -> Any:
        """The underlying ``specmoe._C.Cache`` (for C code using the cache directly)."""
        return self._c

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return bool(self._c.closed)

    def _key(self, layer: int, expert: int) -> int:
        nl, ne = self._c.num_layers, self._c.num_experts
        if not (0 <= int(layer) < nl and 0 <= int(expert) < ne):
            raise ValueError(f"expert (layer {layer}, expert {expert}) out of range: the store "
                             f"has {nl} layers of {ne} experts")
        return int(layer) * ne + int(expert)

    # -- demand path -----------------------------------------------------------------------
    def acquire(self, layer: int, expert: int) -> np.ndarray:
        """Pin expert (layer, expert) and return its block as a read-only uint8 array.

        Loads it from the store on a miss (blocking, GIL released).  The array stays valid
        while it exists, but its bytes belong to the expert only until the matching
        :meth:`release`.  Raises StoreError when the load fails (the cache stays usable).
        """
        return self._c.acquire(layer, expert)

    def release(self, layer: int, expert: int) -> None:
        """Drop one pin of (layer, expert); CacheError when it is not pinned."""
        self._c.release(layer, expert)

    @contextmanager
    def expert(self, layer: int, expert: int) -> Iterator[dict[str, np.ndarray] | np.ndarray]:
        """Context manager: acquire (layer, expert), yield its tensors, release on exit.

        Yields the store's tensor views of the block (``store.tensors_of``) when the store
        has a schema, else the raw uint8 block.
        """
        block = self._c.acquire(layer, expert)
        try:
            tensors_of = getattr(self._store, "tensors_of", None)
            yield tensors_of(block) if tensors_of is not None else block
        finally:
            self._c.release(layer, expert)

    def begin_pass(self) -> int:
        """Start a new forward pass (the policy's pass boundary); returns the new pass id."""
        return int(self._c.begin_pass())

    # -- prefetch --------------------------------------------------------------------------
    def prefetch(self, requests: Any, replace: bool = False, *, probs: Any = None,
                 steps: int = 1) -> None:
        """Queue prefetch requests for the worker thread.

        ``requests``: a sequence of ``(layer, expert, priority)`` triples, an array of shape
        ``(n, 3)``, or a tuple of three 1-D arrays ``(layers, experts, priorities)``.  Higher
        priority loads first; equal priorities in request order.  A request for an expert
        already queued replaces its priority (and takes a new place in request order); one
        for an expert resident or loading is ignored.  ``replace=True`` first cancels all
        queued requests.  CacheError when the cache has no prefetch worker.

        For the admission rule (:meth:`set_admission`): ``probs``, each request's probability
        that its expert is used (None: unknown, and such a request is let through), and
        ``steps``, how many layer steps after now it is needed.
        """
        if (isinstance(requests, tuple) and len(requests) == 3
                and all(isinstance(a, np.ndarray) and a.ndim == 1 for a in requests)):
            layers, experts, prio = (np.asarray(a) for a in requests)
            if not (len(layers) == len(experts) == len(prio)):
                raise ValueError(f"prefetch: layers, experts and priorities differ in length "
                                 f"({len(layers)}, {len(experts)}, {len(prio)})")
        else:
            arr = np.asarray(requests, dtype=np.float64)
            if arr.size == 0:
                arr = arr.reshape(0, 3)
            if arr.ndim != 2 or arr.shape[1] != 3:
                raise ValueError("prefetch: requests must be (layer, expert, priority) triples, "
                                 f"got an array of shape {arr.shape}")
            layers, experts, prio = arr[:, 0], arr[:, 1], arr[:, 2]
        layers_i = np.asarray(layers).astype(np.int64)
        experts_i = np.asarray(experts).astype(np.int64)
        if np.any(layers_i != np.asarray(layers)) or np.any(experts_i != np.asarray(experts)):
            raise ValueError("prefetch: layer and expert ids must be integers")
        nl, ne = self._c.num_layers, self._c.num_experts
        bad = (layers_i < 0) | (layers_i >= nl) | (experts_i < 0) | (experts_i >= ne)
        if np.any(bad):
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(f"prefetch request {i}: expert (layer {layers_i[i]}, expert "
                             f"{experts_i[i]}) out of range: the store has {nl} layers of "
                             f"{ne} experts")
        prio_f = np.asarray(prio, dtype=np.float32)
        if np.any(np.isnan(prio_f)):
            raise ValueError("prefetch: priorities must not be NaN")
        keys = (layers_i * ne + experts_i).astype(np.int32)
        probs_f = None
        if probs is not None:
            probs_f = np.asarray(probs, dtype=np.float32).reshape(-1)
            if len(probs_f) != len(keys):
                raise ValueError(f"prefetch: {len(keys)} requests but {len(probs_f)} probs")
            if np.any(~((probs_f >= 0) & (probs_f <= 1))):
                raise ValueError("prefetch: probs must be probabilities in [0, 1]")
        if isinstance(steps, bool) or not isinstance(steps, (int, np.integer)) or \
                not 1 <= int(steps) <= 2**31:
            raise ValueError(f"prefetch: steps must be a positive int, got {steps!r}")
        self._c.prefetch(keys, prio_f, replace=bool(replace), probs=probs_f, steps=int(steps))

    def set_admission(self, on: bool, byte_budget: bool = True) -> None:
        """Prefetch admission by expected benefit on or off (off by default; issue 42,
        ``csrc/admit.h``): when the worker could start a request's load, it loads it only if
        its probability of use times the stall it would save (the time left before the expert
        is needed, at most one load) exceeds what it costs -- the link time of a load that
        turns out unused, as far as demand loads wait for it, and the chance that its victim
        is needed again times the measured stall of a miss -- and while the loads prefetching
        added (copies evicted unused, demand loads of experts a prefetch evicted) stay within
        8 % of the loads that were needed (its byte budget; ``byte_budget=False``: the time
        terms alone, which on a link-bound CPU reads a few percent more for a few percent more
        speed, docs/simulator.md).  The load time, the layer step time, the link's busy share
        and the miss stall are measured by the cache itself.  The simulator runs the same rule
        (``simulate(..., admission=True, byte_budget=...)``)."""
        for name, v in (("on", on), ("byte_budget", byte_budget)):
            if not isinstance(v, bool):
                raise TypeError(f"set_admission({name}): a bool, got {type(v).__name__}")
        self._c.set_admission(on, byte_budget)

    def admission(self) -> dict[str, Any]:
        """The admission rule's state: ``on``, its measured estimates (``load_s``, ``step_s``
        (-1 before the first pass), ``busy``, ``contention``, ``demand_s``, ``fetch_s`` (-1
        before the first), ``measured_regret``), its byte budget (``byte_budget``: on or not;
        ``needed_loads`` and
        ``added_loads``, decayed counts of the loads that were needed and of those prefetching
        added; ``over_budget`` while the added exceed 8 % of the needed and every request is
        refused) and ``refused`` (``csrc/admit.h``)."""
        return dict(self._c.admission())

    def cancel(self, layer: int | None = None, expert: int | None = None) -> None:
        """Drop queued prefetch requests: all (no arguments), one layer's, or one expert's.

        Loads already in flight complete.
        """
        if layer is None:
            if expert is not None:
                raise ValueError("cancel: give a layer with the expert")
            self._c.cancel(-1)
        elif expert is None:
            base = self._key(layer, 0)
            for e in range(self._c.num_experts):
                self._c.cancel(base + e)
        else:
            self._c.cancel(self._key(layer, expert))

    def wait_idle(self) -> None:
        """Block until the prefetch queue is empty and the worker idle."""
        self._c.wait_idle()

    def pause_prefetch(self, paused: bool = True) -> None:
        """Stop (or, with ``False``, resume) starting new prefetch loads.

        While paused, requests stay queued (and can be cancelled or reprioritised); a load
        already in flight completes.  :meth:`wait_idle` then waits only for that load.
        """
        self._c.pause_prefetch(bool(paused))

    def resume_prefetch(self) -> None:
        """Resume prefetch loads after :meth:`pause_prefetch`."""
        self._c.pause_prefetch(False)

    def queued(self) -> int:
        """Number of prefetch requests waiting in the queue."""
        return int(self._c.queue_len())

    def check_prefetch_error(self) -> None:
        """Raise the first prefetch load error since the last call (StoreError), if any."""
        self._c.take_prefetch_error()

    # -- utility-space policies (spac) ----------------------------------------------------
    def _keys_of(self, what: str, layers: Any, experts: Any) -> np.ndarray:
        la = np.asarray(layers)
        ea = np.asarray(experts)
        if la.ndim == 0:
            la = la.reshape(1)
        if ea.ndim == 0:
            ea = ea.reshape(1)
        if la.ndim != 1 or ea.ndim != 1:
            raise ValueError(f"{what}: layers and experts must be 1-D (got {la.ndim}-D and "
                             f"{ea.ndim}-D)")
        if len(la) != len(ea):
            raise ValueError(f"{what}: layers and experts differ in length ({len(la)}, {len(ea)})")
        if len(la) and (not np.issubdtype(la.dtype, np.integer)
                        or not np.issubdtype(ea.dtype, np.integer)):
            raise ValueError(f"{what}: layer and expert ids must be integers")
        li = la.astype(np.int64)
        ei = ea.astype(np.int64)
        nl, ne = self._c.num_layers, self._c.num_experts
        bad = (li < 0) | (li >= nl) | (ei < 0) | (ei >= ne)
        if np.any(bad):
            i = int(np.flatnonzero(bad)[0])
            raise ValueError(f"{what} entry {i}: expert (layer {li[i]}, expert {ei[i]}) out of "
                             f"range: the store has {nl} layers of {ne} experts")
        return (li * ne + ei).astype(np.int32)

    def observe_counts(self, layers: Any, experts: Any, counts: Any) -> None:
        """Feed the policy the activation counts of one verification pass.

        ``counts[i]`` tokens of the pass (the K draft tokens plus one) activate expert
        ``(layers[i], experts[i])``.  Every layer that appears in ``layers`` is *observed*:
        its experts not listed count 0 this pass.  Call it once per pass, before the pass's
        expert accesses (the draft's routing predicts them).  A no-op for policies that do not
        use counts (every built-in except ``"spac"``).  ValueError on unequal lengths, ids out
        of range, or negative / non-integer counts.
        """
        keys = self._keys_of("observe_counts", layers, experts)
        ca = np.asarray(counts)
        if ca.ndim == 0:
            ca = ca.reshape(1)
        if ca.ndim != 1 or len(ca) != len(keys):
            raise ValueError(f"observe_counts: {len(keys)} experts but counts has shape "
                             f"{ca.shape}")
        if len(ca) and not np.issubdtype(ca.dtype, np.integer):
            raise ValueError("observe_counts: counts must be integers")
        ci = ca.astype(np.int64)
        if np.any(ci < 0):
            i = int(np.flatnonzero(ci < 0)[0])
            raise ValueError(f"observe_counts: count {ci[i]} at entry {i} is negative")
        if np.any(ci >= 2**31):
            raise ValueError("observe_counts: counts must be below 2**31")
        self._c.observe_counts(keys, ci.astype(np.int32))

    def protect(self, layers: Any = (), experts: Any = ()) -> None:
        """Lookahead-aware eviction for any policy (MoE-SpeQ's expert lookahead buffer): the
        given experts become the protected set, replacing the previous one (no arguments:
        clear it).  A victim is then chosen by the policy among the evictable slots holding
        unprotected experts, and only when there is none among all evictable slots;
        ``stats()["protected_evictions"]`` counts the latter."""
        la, ea = np.asarray(layers), np.asarray(experts)
        if la.size == 0 and ea.size == 0:
            self._c.protect(np.zeros(0, np.int32))
            return
        self._c.protect(self._keys_of("protect", la, ea))

    def utility(self, layers: Any, experts: Any) -> np.ndarray:
        """The policy's current integer utility of each expert (resident or not), int32.

        For ``"spac"`` a level in ``0..levels``; victims are taken lowest utility first, and a
        caller orders prefetches by passing these values as priorities to :meth:`prefetch`.
        PolicyError when the current policy has no utility.
        """
        keys = self._keys_of("utility", layers, experts)
        return self._c.utility(keys)

    # -- policy, contents, counters --------------------------------------------------------
    def set_policy(self, policy: Any) -> None:
        """Swap the eviction policy keeping the cache contents.

        The new policy learns the resident experts oldest-access first.
        """
        self._c.set_policy(_make_policy(policy, self.capacity, int(self._c.num_layers),
                                        int(self._c.num_experts)))

    def resident(self) -> list[tuple[int, int]]:
        """(layer, expert) of every expert loaded in the cache, in slot order."""
        ne = int(self._c.num_experts)
        return [(int(k) // ne, int(k) % ne) for k in self._c.resident()]

    def stats(self) -> dict[str, Any]:
        """The counters (see the module docstring) as a dict."""
        return dict(self._c.stats())

    def reset_stats(self) -> None:
        """Zero every counter."""
        self._c.reset_stats()

    def set_throttle(self, throttle: tuple[float, float] | None) -> None:
        """Emulate a slower link (SpecMD Appendix A.4): ``(GB_per_s, latency_us)`` makes every
        store read of this cache, demand or prefetch, take at least ``latency + block_bytes /
        bandwidth``, the reads queueing on one emulated link; None turns it off."""
        from .misses import check_throttle
        self._c.set_throttle(*check_throttle(throttle))

    def bench_hits(self, experts: Sequence[tuple[int, int]] | np.ndarray, iters: int) -> float:
        """Seconds for ``iters`` rounds of acquire+release over ``experts`` in one C loop.

        For benchmarks of the hit path: load the experts first.
        """
        keys = np.asarray([self._key(l, e) for l, e in experts], dtype=np.int32)
        return float(self._c.bench_hits(keys, int(iters)))

    # -- lifetime --------------------------------------------------------------------------
    def close(self) -> None:
        """Stop the prefetch worker (queued requests cancelled, an in-flight load finished).

        Later calls raise CacheError.  Arrays returned by :meth:`acquire` stay readable; the
        memory is freed when the last of them and the cache are gone.
        """
        self._c.close()

    def __enter__(self) -> ExpertCache:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        if self.closed:
            return "<ExpertCache closed>"
        return (f"<ExpertCache {self.capacity} slots of {self.slot_bytes} bytes, policy "
                f"{self.policy}, pass {self.pass_id}>")

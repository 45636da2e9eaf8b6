"""Eviction policies: typed specs, the notebook base class for policies written in Python,
and :func:`make_policy`, which turns any of them into a C policy (``specmoe._C.Policy``) for a
cache, the simulator or :func:`replay`.

Built-in policies (all in C, ``csrc/policy/*.c``; the tie-breaks are part of the contract and
are reproduced by the plain-Python references in ``tests/ref_policies.py``):

``LRU()``            evict the least recently touched slot (touch = access or insert).
``LFU()``            fewest accesses since insert (a demand insert counts 1, a prefetch insert
                     0; counts are forgotten on eviction); ties: least recently touched.
``FIFO()``           oldest insert (demand or prefetch); accesses do not matter.
``MRU()``            most recently touched slot.
``Random(seed)``     splitmix64 seeded with ``seed``; one draw r per victim choice; victim =
                     the (r mod n)-th of the n evictable resident slots in slot order.
``LeastStale(order)`` (SpecMD) slots not touched since the current forward pass began are
                     stale and go first; a current-pass slot only when no stale one is
                     evictable.  ``order`` ranks inside each group: ``"layer"`` (default) =
                     furthest next use by layer position from the layer of the latest demand
                     access (d(j) = j-cur if j>cur else j-cur+L; max d first, ties oldest
                     touch; among stale slots the current layer's come last, since the
                     layer's remaining accesses may still want them), ``"lru"`` = oldest
                     touch, ``"fifo"`` = oldest insert.
``SpAc(levels, gamma)`` (MoE-SpAc, as published) Algorithm 1: a per-expert integer utility
                     in 0..levels moved by +-1 when the change of its activation count between
                     verification passes crosses per-expert adaptive boundaries (initial
                     floor(gamma/2), calibrated with forgetting factor 0.1); the hot/cold
                     threshold tau_t (the simulator prefetches only utility >= tau); eviction
                     from multi-level queues: lowest utility first, FIFO inside a level (see
                     ``csrc/policy/spac.c``).  ``gamma`` is the draft length (paper: 8).
``SpAcEMA(levels)``  our earlier reading of MoE-SpAc from its abstract: EMA of the clamped
                     counts (forgetting factor 0.1), per-layer quantile levels; victim = lowest
                     utility, ties least recently touched; with no counts it is LRU
                     (``csrc/policy/spac_ema.c``).  Both are fed with
                     ``ExpertCache.observe_counts`` once per pass; read utilities with
                     ``ExpertCache.utility`` (e.g. as prefetch priorities).
``LHU()``            (SpecMD App. B, after HOBBIT) fewest demand uses over the whole run (counts
                     survive eviction; a prefetch insert is not a use); ties least recently
                     touched.  One precision per cache, so every use is high-precision.
``FLD()``            (SpecMD App. B, after HOBBIT) largest |layer - current layer| first (current
                     = layer of the latest demand access); ties least recently touched.
``Score()``          (SpecMD App. B, after Zhu et al. 2025) lowest accumulated activation score
                     (the per-pass activation counts fed with ``observe_counts``, summed over
                     the run; a token adds 1 where the paper adds its gate weight); ties least
                     recently touched.
``NextUse(model)``   (issue 42) Belady's rule with a learned future: evict the slot of least
                     q / (dl + c) + beta * r / (dl + L + c), q a logistic model's probability
                     that the expert is used when its layer next runs (recent use, use rates,
                     and the experts the same pass chose at the layer before), dl the layer
                     steps to that run, r a long-run use rate (``csrc/policy/nextuse.h``).
                     ``model``: a :class:`~specmoe.sim.nextuse.NextUseModel` or its file;
                     None = the packaged one, trained on DeepSeek-V2-Lite's routing (its
                     temporal part alone for other shapes); ties: lowest slot.
``Belady(future)``   offline optimum: the key next used furthest in ``future`` (a key array or
                     a :class:`~specmoe.sim.traces.Trace`); never again = infinitely far; ties:
                     lowest slot.

Least-Stale order, measured by demand-only replay of all 200 DeepSeek-V2-Lite puffin traces
(one pass per token, 1664 expert keys), hit rate at 5% / 10% / 25% of the experts:
``layer`` 0.133 / 0.263 / 0.458, ``lru`` 0.000 / 0.262 / 0.439 (identical to plain LRU: with
one pass per token the stale slots are exactly the oldest), ``fifo`` 0.000 / 0.197 / 0.402.
``layer`` is best at every size, so it is the default (docs/simulator.md for longer passes).

A policy in Python: subclass :class:`PythonPolicy` and implement ``victim``.  Its methods are
called by C through the Python bridge with the GIL taken on each event: this is the slow path
(a Python call per access), meant for experiments; a callback that raises turns into
:class:`~specmoe.PolicyError` from the cache/replay call.

A ``_C.Policy`` object serves exactly one cache, simulator or replay; build a new one with
:func:`make_policy` for each use.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

import numpy as np

from .. import _C
from ..sim.traces import Trace

__all__ = [
    "PolicySpec", "LRU", "LFU", "FIFO", "MRU", "Random", "LeastStale", "Belady", "SpAc",
    "SpAcEMA", "LHU", "FLD", "Score", "NextUse", "COUNT_POLICIES", "UTILITY_POLICIES",
    "PythonPolicy",
    "PolicyLike", "POLICY_NAMES", "check_policy", "make_policy", "replay",
]

#: Names accepted by :func:`make_policy` as strings.
POLICY_NAMES: tuple[str, ...] = tuple(n.strip() for n in _C.POLICY_NAMES.split(","))

LeastStaleOrder = Literal["layer", "lru", "fifo"]


class PolicySpec:
    """Base of the typed policy specs: a name plus the parameters of one C policy."""

    name: str = ""

    def _kwargs(self) -> dict:
        return {}

    def build(self, nslots: int, num_layers: int, num_experts: int) -> _C.Policy:
        """A fresh C policy for a cache of ``nslots`` slots over ``num_layers*num_experts`` keys."""
        return _C.Policy(self.name, nslots, num_layers, num_experts, **self._kwargs())


@dataclass(frozen=True)
class LRU(PolicySpec):
    """Least recently used (touch = access or insert)."""

    name = "lru"


@dataclass(frozen=True)
class LFU(PolicySpec):
    """Least frequently used since insert; ties least recently used."""

    name = "lfu"


@dataclass(frozen=True)
class FIFO(PolicySpec):
    """First in, first out (insert order)."""

    name = "fifo"


@dataclass(frozen=True)
class MRU(PolicySpec):
    """Most recently used first."""

    name = "mru"


@dataclass(frozen=True)
class Random(PolicySpec):
    """Uniform among evictable slots, deterministic given ``seed`` (splitmix64)."""

    seed: int = 0
    name = "random"

    def _kwargs(self) -> dict:
        return {"seed": int(self.seed)}


@dataclass(frozen=True)
class LeastStale(PolicySpec):
    """SpecMD Least-Stale: experts not touched in the current forward pass go first."""

    order: LeastStaleOrder = "layer"
    name = "least_stale"

    def __post_init__(self) -> None:
        if self.order not in ("layer", "lru", "fifo"):
            raise ValueError(f"LeastStale order must be 'layer', 'lru' or 'fifo', got {self.order!r}")

    def _kwargs(self) -> dict:
        return {"order": self.order}


def _check_levels(cls: str, levels: object) -> None:
    if isinstance(levels, bool) or not isinstance(levels, (int, np.integer)) \
            or not 1 <= int(levels) <= 255:
        raise ValueError(f"{cls} levels must be an int in 1..255, got {levels!r}")


@dataclass(frozen=True)
class SpAc(PolicySpec):
    """MoE-SpAc as published (Algorithm 1, tau_t, multi-level eviction queues): integer utility
    0..levels from per-pass activation counts; ``gamma`` the draft length (initial boundaries
    floor(gamma/2); None = the paper's 8, and the simulator uses ``verify_tokens - 1``).

    The ablations of the paper's §4.4 (Table 4), for ``benchmarks/spac_ablation.py``; the
    defaults are the published design:

    - ``levels=1``: "w/o SpecUE", binary utility (K = 1);
    - ``up=3, dn=1``: "w/o AdaBC", fixed boundaries theta_up / theta_down (both or neither);
    - ``tau=2``: "w/o HetWB", a static hot/cold threshold instead of Eq. 11-12's tau_t;
    - ``estimator="counts"``: no estimator, the utility is the pass's count itself, min(K, f);
    - ``gate=False``: the simulator's prefetcher is not gated by tau, so prefetch follows the
      predictor's ranking and eviction the utility (separate prefetch and eviction scores;
      the live prefetch worker never gates by tau)."""

    levels: int = 4
    gamma: Optional[int] = None
    up: Optional[int] = None
    dn: Optional[int] = None
    tau: Optional[int] = None
    estimator: str = "alg1"
    gate: bool = True
    name = "spac"

    def __post_init__(self) -> None:
        _check_levels("SpAc", self.levels)
        if self.gamma is not None and (isinstance(self.gamma, bool) or
                                       not isinstance(self.gamma, (int, np.integer)) or
                                       not 0 <= int(self.gamma) <= 65536):
            raise ValueError(f"SpAc gamma (draft length) must be an int in 0..65536 or None, "
                             f"got {self.gamma!r}")
        for what, v, hi in (("up", self.up, 65536), ("dn", self.dn, 65536),
                            ("tau", self.tau, int(self.levels))):
            if v is not None and (isinstance(v, bool) or not isinstance(v, (int, np.integer))
                                  or not 1 <= int(v) <= hi):
                raise ValueError(f"SpAc {what} must be an int in 1..{hi} or None, got {v!r}")
        if (self.up is None) != (self.dn is None):
            raise ValueError(f"SpAc fixed boundaries need both up and dn (or neither), got "
                             f"up={self.up!r} dn={self.dn!r}")
        if self.estimator not in ("alg1", "counts"):
            raise ValueError(f"SpAc estimator must be 'alg1' (Algorithm 1) or 'counts', got "
                             f"{self.estimator!r}")
        if not isinstance(self.gate, (bool, np.bool_)):
            raise TypeError(f"SpAc gate must be a bool, got {type(self.gate).__name__}")

    def _kwargs(self) -> dict:
        kw: dict[str, Any] = {"levels": int(self.levels)}
        if self.gamma is not None:
            kw["gamma"] = int(self.gamma)
        if self.up is not None:
            kw.update(up=int(self.up), dn=int(self.dn))  # type: ignore[arg-type]
        if self.tau is not None:
            kw["tau"] = int(self.tau)
        if self.estimator == "counts":
            kw["counts"] = True
        if not self.gate:
            kw["gate"] = False
        return kw


@dataclass(frozen=True)
class SpAcEMA(PolicySpec):
    """The earlier utility estimator (EMA of the counts, per-layer quantile levels)."""

    levels: int = 4
    name = "spac_ema"

    def __post_init__(self) -> None:
        _check_levels("SpAcEMA", self.levels)

    def _kwargs(self) -> dict:
        return {"levels": int(self.levels)}


@dataclass(frozen=True)
class LHU(PolicySpec):
    """SpecMD's Least High-precision Used: fewest demand uses over the whole run."""

    name = "lhu"


@dataclass(frozen=True)
class FLD(PolicySpec):
    """SpecMD's Farthest Layer Distance: largest |layer - current layer| first."""

    name = "fld"


@dataclass(frozen=True)
class Score(PolicySpec):
    """SpecMD's score-based eviction: lowest accumulated activation score first."""

    name = "score"


@dataclass(frozen=True, eq=False)
class NextUse(PolicySpec):
    """Learned next-use eviction (``csrc/policy/nextuse.h``).  ``model``: a
    :class:`~specmoe.sim.nextuse.NextUseModel`, a path to one (``training/nextuse.py`` writes
    them), or None: the packaged model when the cache's shape is DeepSeek-V2-Lite's (26 MoE
    layers x 64 experts), else its temporal part (no layer-to-layer table).  ``token_prior``:
    evict with the model's token weights where the pass's token prior is given (off by
    default: on the DeepSeek-V2-Lite traces it lowers the hit rate; the prior serves the
    ``learned`` prefetch predictor, docs/simulator.md)."""

    model: Any = field(default=None, repr=False)
    token_prior: bool = False
    name = "nextuse"

    def resolve(self, num_layers: int, num_experts: int) -> Any:
        """The :class:`~specmoe.sim.nextuse.NextUseModel` this spec runs for that shape."""
        from ..sim.nextuse import NextUseModel, default_model

        if self.model is None:
            return default_model(num_layers, num_experts)
        if isinstance(self.model, NextUseModel):
            return self.model
        if isinstance(self.model, (str, os.PathLike)):
            return NextUseModel.load(self.model)
        raise TypeError(f"NextUse(model=...) takes a NextUseModel, a path or None, got "
                        f"{type(self.model).__name__}")

    def build(self, nslots: int, num_layers: int, num_experts: int) -> _C.Policy:
        return _C.Policy("nextuse", nslots, num_layers, num_experts,
                         model=self.resolve(num_layers, num_experts).flat(self.token_prior))


#: Built-in policies that learn from per-pass activation counts (``observe_counts``).
COUNT_POLICIES: frozenset[str] = frozenset({"spac", "spac_ema", "score"})
#: Count-fed built-in policies whose integer utility (``ExpertCache.utility``) orders the draft's
#: lookahead prefetches.  ``nextuse`` has a utility too (its value of keeping an expert), which
#: only the shared prefetch rule reads.
UTILITY_POLICIES: frozenset[str] = frozenset({"spac", "spac_ema"})


@dataclass(frozen=True, eq=False)
class Belady(PolicySpec):
    """Offline optimum over ``future``, the demand key sequence (array or Trace)."""

    future: Union[np.ndarray, Trace, list] = field(repr=False)
    name = "belady"

    def keys(self) -> np.ndarray:
        return self.future.keys() if isinstance(self.future, Trace) else np.asarray(self.future)

    def _kwargs(self) -> dict:
        return {"future": self.keys()}


class PythonPolicy:
    """Base class for eviction policies written in Python (the slow path).

    Override :meth:`victim` (required) and any of the event methods (no-ops here).  Events
    follow the contract of ``csrc/policy/policy.h``: a demand miss is ``on_insert(slot, key,
    False)`` (after ``on_evict`` of the victim), a hit ``on_access``, a prefetch load
    ``on_insert(slot, key, True)``, a new forward pass ``on_pass(pass_id)`` (ids 1, 2, ...).
    Keys are ``layer * num_experts + expert``.

    Optional, not defined here (define them to opt in): ``on_counts(keys, counts)`` receives
    the activation counts of each verification pass (lists of ints; see
    ``ExpertCache.observe_counts`` and the simulator's ``verify_tokens``), and
    ``utility(key) -> int`` (>= 0) makes ``ExpertCache.utility`` answer for the policy.
    """

    def on_insert(self, slot: int, key: int, prefetch: bool) -> None:
        """``key`` was loaded into ``slot`` (by a demand miss or, if ``prefetch``, a prefetch)."""

    def on_access(self, slot: int, key: int) -> None:
        """A demand hit on ``slot``."""

    def on_evict(self, slot: int, key: int) -> None:
        """``slot`` (holding ``key``) was given up."""

    def on_pass(self, pass_id: int) -> None:
        """Forward pass ``pass_id`` begins."""

    def victim(self, candidates: list[int]) -> int:
        """Return one of ``candidates`` (the evictable resident slots, in slot order)."""
        raise NotImplementedError("PythonPolicy subclasses must implement victim(candidates)")


PolicyLike = Union[PolicySpec, str, PythonPolicy, "_C.Policy"]


def check_policy(spec: object) -> None:
    """Raise, before any work, for a policy argument :func:`make_policy` would refuse whatever
    the cache's size: an unknown name, ``"belady"`` (it needs the future), or an object that is
    no policy.  Sizes of a ready ``_C.Policy`` are checked when the cache is built."""
    if isinstance(spec, (_C.Policy, PolicySpec)):
        return
    if isinstance(spec, str):
        name = spec.strip().lower()
        if name == "belady":
            raise ValueError("belady needs the future access sequence: use Belady(future)")
        if name not in POLICY_NAMES:
            raise ValueError(f"unknown policy {spec!r}; valid names: {', '.join(POLICY_NAMES)}")
        return
    if isinstance(spec, PythonPolicy) or callable(getattr(spec, "victim", None)):
        return
    raise TypeError(f"cannot make a policy from {type(spec).__name__}; pass a PolicySpec, a "
                    f"name ({', '.join(POLICY_NAMES)}), a PythonPolicy or a _C.Policy")


def make_policy(spec: PolicyLike, nslots: int, num_layers: int, num_experts: int) -> _C.Policy:
    """Build a C policy from a spec object, a name (``"lru"``, ``"least_stale"``, ...), a
    :class:`PythonPolicy` (or any object with a ``victim`` method), or pass through an existing
    ``_C.Policy`` after checking its sizes."""
    check_policy(spec)
    if isinstance(spec, _C.Policy):
        if spec.in_use:
            raise _C.PolicyError(f"policy {spec.name} already in use; make a new one")
        got = (spec.nslots, spec.num_layers, spec.num_experts)
        if got != (nslots, num_layers, num_experts):
            raise ValueError(f"policy built for (nslots, num_layers, num_experts)={got}, "
                             f"needed {(nslots, num_layers, num_experts)}")
        return spec
    if isinstance(spec, PolicySpec):
        return spec.build(nslots, num_layers, num_experts)
    if isinstance(spec, str):
        name = spec.strip().lower()
        if name == "nextuse":  # the packaged model, not only the C built-in's temporal weights
            return NextUse().build(nslots, num_layers, num_experts)
        return _C.Policy(name, nslots, num_layers, num_experts)
    return _C.Policy("python", nslots, num_layers, num_experts, pyobj=spec)


def replay(policy: PolicyLike, keys: Union[np.ndarray, Trace], nslots: int, *,
           num_layers: int | None = None, num_experts: int | None = None,
           pass_starts: Union[int, np.ndarray, None, Literal["token"]] = "token",
           mask_seed: int = 0, counts: "tuple | None" = None) -> tuple[np.ndarray, np.ndarray]:
    """Demand-only replay of ``keys`` (or a Trace's :meth:`~Trace.keys`) through a fresh
    policy: returns ``(hits uint8[n], victims int32[n])`` (victim key or -1 per access).

    For a Trace, ``num_layers``/``num_experts`` default to the trace's and ``pass_starts="token"``
    starts a pass at every token; for a key array ``"token"`` means no passes.  The name
    ``"belady"`` is accepted here and uses the replayed keys as its future.  ``counts``:
    ``(keys, counts, offsets)`` activation counts fed to the policy at each pass start
    (entries ``offsets[j]:offsets[j+1]`` right after pass ``j+1`` begins; see ``_C.replay``).
    """
    if isinstance(keys, Trace):
        tr = keys
        num_layers = tr.num_layers if num_layers is None else num_layers
        num_experts = tr.num_experts if num_experts is None else num_experts
        karr = tr.keys()
        if isinstance(pass_starts, str) and pass_starts == "token":
            pass_starts = tr.num_layers * tr.top_k
    else:
        karr = np.asarray(keys)
        if isinstance(pass_starts, str) and pass_starts == "token":
            pass_starts = None
    if num_layers is None or num_experts is None:
        raise ValueError("replay of a key array needs num_layers and num_experts")
    if isinstance(policy, str) and policy.strip().lower() == "belady":
        policy = Belady(karr)
    pol = make_policy(policy, nslots, num_layers, num_experts)
    return _C.replay(pol, karr, pass_starts, mask_seed=mask_seed, counts=counts)

"""Trace-driven simulator: replay a routing trace through an expert cache under a policy, with a
prefetch predictor, and estimate hit rate, stalls and time per token on a hardware profile.

The replay loop is C (``csrc/sim.c``) and uses the same policy objects as the live
:class:`ExpertCache`, with the same event contract (``csrc/policy/policy.h``), so demand-only
hit and miss counts equal the live cache's on the same trace.  The time model is described in
:mod:`specmoe.sim.hardware` and ``csrc/sim.h``.

>>> r = simulate(trace, "lru", "10%", prefetch="history:topk=8", hardware="rtx4090")
>>> r.hit_rate, r.stall_s, r.est_tpot_ms
"""
from __future__ import annotations

import dataclasses
import re
import time
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Callable, Union

import numpy as np

from .. import _C
from .calibration import get_hardware
from .hardware import Hardware, ModelCost, sim_timing
from .traces import Trace

__all__ = ["Predictor", "SimResult", "simulate", "parse_capacity", "parse_policy",
           "live_policy", "PREDICTORS"]

PREDICTORS = {"none": 0, "oracle": 1, "router": 2, "history": 3, "learned": 4}
_LS_ORDERS = {"layer": 0, "lru": 1, "fifo": 2}
_SPAC_ABLATIONS = ("up", "dn", "tau", "estimator", "gate")  # runtime.policies.SpAc
# The options each built-in policy takes in a spec string (the others take none).
_POLICY_OPTIONS = {"random": ("seed",), "least_stale": ("order",),
                   "spac": ("levels", "gamma") + _SPAC_ABLATIONS, "spac_ema": ("levels",)}


@dataclass(frozen=True)
class Predictor:
    """A prefetch predictor of the simulator.

    ``kind``: ``none``; ``oracle`` (the true experts of the next ``depth`` layer positions);
    ``router`` (the next layer's recorded router logits; needs ``trace.logits``); ``history``
    (how often the target layer used each expert in the last ``history`` tokens, mixed with
    layer-to-layer co-activation counts learnt online with weight ``cooc_weight``; 0.8 gave
    the best next-layer recall on the DeepSeek-V2-Lite traces, 0.47 against 0.35 at 0.5);
    ``learned`` (the ``nextuse`` model's probability that each expert of the target layer is
    used at its next run, fed the routing as it is replayed: the packaged model for
    DeepSeek-V2-Lite's shape, its temporal part elsewhere; 0.54 next-layer precision on the
    validation prompts, ``benchmarks/predictors.py``).
    Selection: the ``topk`` best-scoring experts per predicted layer (0: the trace's top-k;
    more over-fetches), or with ``percentile`` > 0 the experts scoring at or above that
    quantile of the layer's scores (capped at ``topk`` when set).
    """

    kind: str = "none"
    depth: int = 1
    topk: int = 0
    percentile: float = 0.0
    history: int = 16
    cooc_weight: float = 0.8

    def __post_init__(self) -> None:
        if self.kind not in PREDICTORS:
            raise ValueError(f"unknown predictor {self.kind!r}; known: {', '.join(PREDICTORS)}")

        def whole(name: str, lo: int, hi: int) -> None:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not lo <= v <= hi:
                raise ValueError(f"predictor {name} must be an int in {lo}..{hi}, got {v!r}")

        def frac(name: str, hi_open: bool) -> None:
            v = getattr(self, name)
            ok = (not isinstance(v, bool) and isinstance(v, (int, float, np.integer, np.floating))
                  and 0.0 <= float(v) and (float(v) < 1.0 if hi_open else float(v) <= 1.0))
            if not ok:
                raise ValueError(f"predictor {name} must be a number in "
                                 f"[0, 1{')' if hi_open else ']'}, got {v!r}")

        whole("depth", 1, 4096)
        whole("topk", 0, 32768)  # 0: the trace's top-k (the default; see the class docstring)
        whole("history", 1, 2**32 - 1)
        frac("percentile", True)
        frac("cooc_weight", False)

    @staticmethod
    def parse(spec: "str | Predictor | None") -> "Predictor":
        """``"none"``, ``"oracle:depth=2"``, ``"history:topk=8,history=32"``,
        ``"router:percentile=0.9"``, or a Predictor."""
        if spec is None:
            return Predictor()
        if isinstance(spec, Predictor):
            return spec
        if not isinstance(spec, str):
            raise TypeError(f"prefetch must be a predictor spec string or a Predictor, got "
                            f"{type(spec).__name__}")
        kind, _, opts = spec.strip().partition(":")
        kw: dict[str, Any] = {}
        types = {f.name: f.type for f in fields(Predictor)}
        for part in filter(None, (p.strip() for p in opts.split(","))):
            k, eq, v = part.partition("=")
            k = k.strip()
            if not eq or k not in types or k == "kind":
                raise ValueError(f"bad predictor option {part!r} in {spec!r}; options: depth, "
                                 f"topk, percentile, history, cooc_weight")
            try:
                kw[k] = float(v) if k in ("percentile", "cooc_weight") else int(v)
            except ValueError:
                raise ValueError(f"bad value {v!r} for {k} in {spec!r}") from None
            if k == "topk" and kw[k] < 1:
                # Written out, topk means "this many experts per layer": 0 would silently mean
                # "the trace's top-k" (the default), so it is refused; omit topk for that.
                raise ValueError(f"predictor topk must be >= 1 in {spec!r} (omit topk for the "
                                 f"trace's top-k), got {kw[k]}")
        return Predictor(kind=kind.strip() or "none", **kw)

    @property
    def label(self) -> str:
        if self.kind == "none":
            return "none"
        default = Predictor(kind=self.kind)
        opts = [f"{f.name}={getattr(self, f.name)}" for f in fields(self)
                if f.name != "kind" and getattr(self, f.name) != getattr(default, f.name)]
        return self.kind + (":" + ",".join(opts) if opts else "")

    def c_args(self) -> dict:
        return dict(predictor=PREDICTORS[self.kind], depth=self.depth, topk=self.topk,
                    percentile=self.percentile, history=self.history,
                    cooc_weight=self.cooc_weight)


@dataclass
class SimResult:
    """One simulated run.  Rates are fractions; times in seconds unless named ``_ms``."""

    policy: str
    capacity_slots: int
    capacity_fraction: float
    predictor: str
    hardware: str
    tokens: int
    accesses: int
    hits: int
    misses: int
    hit_rate: float
    collision_misses: int
    evictions: int
    prefetch_issued: int
    prefetch_used: int
    prefetch_late: int
    prefetch_wasted: int
    prefetch_dropped: int
    prefetch_refused: int      # requests the admission rule refused (admission=True)
    prefetch_precision: float  # prefetched experts used by demand / prefetches issued
    prefetch_recall: float     # demand needs covered by a prefetch / all demand needs of a load
    predictor_precision: float # next-layer predictions that were right / predictions
    predictor_recall: float    # next-layer true experts that were predicted / true experts
    stall_s: float
    compute_s: float
    total_s: float
    est_tpot_ms: float
    ttft_ms: float
    elapsed_s: float
    accesses_per_s: float
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.update(d.pop("extra"))
        return d


PolicyArg = Union[str, Any, Callable[[int, int, int], Any]]


def parse_capacity(cap: "int | float | str", *, num_layers: int, num_experts: int,
                   expert_bytes: float) -> int:
    """Slots for a capacity: an int or a digit string is a slot count; ``"10%"`` or a float
    in (0, 1] a fraction of all ``num_layers * num_experts`` experts; ``"2GB"``, ``"512MiB"``
    bytes of fast tier (``expert_bytes`` per slot).  Capped at all experts; ValueError below
    one slot.  (The cache's :func:`specmoe.parse_capacity` with digit strings as slots.)"""
    from ..runtime.cache import parse_capacity as cache_capacity

    if isinstance(cap, str) and re.fullmatch(r"[0-9]+", cap.strip()):
        cap = int(cap.strip())
    return cache_capacity(cap, total_experts=num_layers * num_experts,
                          slot_bytes=max(1, int(round(expert_bytes))))


def parse_policy(spec: str) -> tuple[str, dict]:
    """``"lru"``, ``"least_stale:order=lru"``, ``"random:seed=3"``, ``"spac:levels=3"``,
    ``"spac:gamma=7"``, SpAc's ablations ``"spac:up=3,dn=1"``, ``"spac:tau=2"``,
    ``"spac:estimator=counts"``, ``"spac:gate=0"`` -> (name, options)."""
    if not isinstance(spec, str):
        raise TypeError(f"policy spec must be a str, got {type(spec).__name__}")
    name, _, opts = spec.strip().partition(":")
    name = name.strip()
    if not name:
        raise ValueError(f"no policy name in policy spec {spec!r}")
    kw: dict[str, Any] = {}
    for part in filter(None, (p.strip() for p in opts.split(","))):
        k, eq, v = part.partition("=")
        k, v = k.strip(), v.strip()
        if k == "seed" and eq:
            # an explicit range check: the C binding would wrap -1 to 2**64 - 1 silently
            if not re.fullmatch(r"[0-9]{1,20}", v) or int(v) > 2**64 - 1:
                raise ValueError(f"policy seed must be an int in 0..2**64-1 in {spec!r}, "
                                 f"got {v!r}")
            kw["seed"] = int(v)
        elif k == "order" and eq and v in _LS_ORDERS:
            kw["order"] = _LS_ORDERS[v]
        elif k == "levels" and eq and re.fullmatch(r"[0-9]{1,3}", v) and 1 <= int(v) <= 255:
            kw["levels"] = int(v)
        elif k == "gamma" and eq and re.fullmatch(r"[0-9]{1,5}", v) and int(v) <= 65536:
            kw["gamma"] = int(v)
        elif k in ("up", "dn", "tau") and eq and re.fullmatch(r"[0-9]{1,5}", v) and 1 <= int(v):
            kw[k] = int(v)
        elif k == "estimator" and eq and v in ("alg1", "counts"):
            kw[k] = v
        elif k == "gate" and eq and v in ("0", "1"):
            kw[k] = v == "1"
        else:
            raise ValueError(f"bad policy option {part!r} in {spec!r}: options are seed=N, "
                             f"order=layer|lru|fifo, levels=1..255, gamma=0..65536 and spac's "
                             f"ablations up=N,dn=N, tau=N, estimator=alg1|counts, gate=0|1")
    takes = _POLICY_OPTIONS.get(name, ())
    for k in kw:
        if k not in takes:  # (it used to be ignored: "lru:seed=3" ran plain LRU)
            raise ValueError(f"policy option {k!r} in {spec!r}: {name!r} takes "
                             + (f"only {', '.join(takes)}" if takes else "no options"))
    return name, kw


def live_policy(spec: str) -> Any:
    """A simulator policy spec string in the form the live cache takes (:class:`ExpertCache`,
    :func:`specmoe.offload`, :func:`specmoe.from_pretrained`): the name when it has no options
    (``"lru"``), else the typed spec (``"random:seed=3"`` -> ``Random(seed=3)``,
    ``"least_stale:order=lru"`` -> ``LeastStale(order="lru")``).  ValueError as
    :func:`parse_policy`."""
    name, kw = parse_policy(spec)
    if not kw:
        return name
    from ..runtime.policies import LeastStale, Random, SpAc, SpAcEMA

    if "order" in kw:
        kw["order"] = {v: k for k, v in _LS_ORDERS.items()}[kw["order"]]
    cls = {"random": Random, "least_stale": LeastStale, "spac": SpAc, "spac_ema": SpAcEMA}[name]
    return cls(**kw)


def _policy_label(policy: PolicyArg) -> str:
    if isinstance(policy, str):
        return policy
    if isinstance(policy, type):
        return policy.__name__
    name = getattr(policy, "name", None)
    if isinstance(name, str) and name and name != "python":
        return name
    return getattr(policy, "__name__", None) or type(policy).__name__


def _policy_object(policy: Any, nslots: int, nl: int, E: int) -> Any:
    """A ``_C.Policy`` for a non-string policy argument (see :func:`simulate`)."""
    if hasattr(_C, "Policy") and isinstance(policy, _C.Policy):
        return policy
    try:
        from ..runtime.policies import PolicySpec, PythonPolicy, make_policy
    except ImportError:  # the policies module is not built in
        PolicySpec = PythonPolicy = make_policy = None  # type: ignore[assignment,misc]
    if make_policy is not None:
        if isinstance(policy, type) and issubclass(policy, PythonPolicy):
            return make_policy(policy(), nslots, nl, E)
        if isinstance(policy, (PolicySpec, PythonPolicy)) or \
                callable(getattr(policy, "victim", None)):
            return make_policy(policy, nslots, nl, E)
    if callable(policy):
        return policy(nslots, nl, E)
    return policy


def _learned_model(num_layers: int, num_experts: int) -> np.ndarray:
    from .nextuse import default_model

    return default_model(num_layers, num_experts).flat()


def _token_priors(trace: Trace, models: list[Any]) -> dict[str, np.ndarray]:
    """The simulator's prior_table / prior_rows for ``trace``'s tokens: from the first of
    ``models`` (NextUseModel, in order of precedence) that has a token prior of the trace's
    shape; {} when none has one or the trace has no token pieces."""
    if trace.tokens is None:
        return {}
    for m in models:
        tok = getattr(m, "tokens", None)
        if tok is not None and tok.shape == (trace.num_layers, trace.num_experts):
            return {"prior_table": tok.table(), "prior_rows": tok.rows(trace.tokens)}
    return {}


def ttft_seconds(trace: Trace, hw: Hardware, model: ModelCost, overlap: bool) -> np.ndarray:
    """Prefill time of every request (see :mod:`specmoe.sim.hardware` for the approximation)."""
    n, nl, k = trace.experts.shape
    E = trace.num_experts
    if n == 0:
        return np.zeros(0)
    starts = np.asarray(trace.request_starts, np.int64)
    req = np.searchsorted(starts, np.arange(n), side="right") - 1
    R = len(starts)
    idx = ((req[:, None, None] * nl + np.arange(nl)[None, :, None]) * E + trace.experts)
    counts = np.bincount(idx.reshape(-1), minlength=R * nl * E).reshape(R, nl, E)
    plen = np.diff(np.append(starts, n)).astype(np.float64)
    params = model.expert_bytes / model.bytes_per_param
    comp = np.maximum(model.expert_bytes / hw.fast_bw, 2 * params * counts / hw.flops)
    comp = np.where(counts > 0, comp, 0.0).sum(axis=2)  # [R, L]
    loads = (counts > 0).sum(axis=2) * hw.load_s(model.expert_bytes)
    lparams = model.layer_fixed_bytes / model.bytes_per_param
    fixed = np.maximum(model.layer_fixed_bytes / hw.fast_bw, 2 * lparams * plen / hw.flops)
    layer = (np.maximum(loads, comp) if overlap else loads + comp) + fixed[:, None]
    tparams = model.token_fixed_bytes / model.bytes_per_param
    tok = np.maximum(model.token_fixed_bytes / hw.fast_bw, 2 * tparams * plen / hw.flops)
    return layer.sum(axis=1) + tok


# _C.simulate's miss mode of the hybrid tier (csrc/sim.h SMOE_SIM_HYBRID; 0-4 are MISS_MODES)
_SIM_HYBRID = 5


def simulate(trace: Trace, policy: PolicyArg = "lru", capacity: "int | float | str" = "10%",
             prefetch: "str | Predictor | None" = None, hardware: "str | Hardware" = "a100-pcie4",
             *, model: ModelCost | None = None, verify_tokens: int = 1, miss: str = "fetch",
             miss_keep: int = 2, lowbit_ratio: float = 0.25, miss_keep2: int | None = None,
             lowbit2_ratio: float = 0.1875, protect: bool = False,
             admission: bool = False, byte_budget: bool = True, hybrid: bool = False,
             token_prior: bool = True) -> SimResult:
    """Replay ``trace`` through a cache of ``capacity`` under ``policy`` and return a SimResult.

    ``policy``: a built-in name with options (``"lru"``, ``"least_stale:order=lru"``,
    ``"belady"``: the offline optimum, given the trace's future), a policy spec or a
    :class:`~specmoe.runtime.policies.PythonPolicy` instance or subclass (built with
    ``make_policy``; a subclass gets a fresh instance per run), a ``_C.Policy`` built for the
    resulting slot count, or a factory ``f(nslots, num_layers, num_experts) -> policy``.
    ``capacity``: slots, a fraction/percentage of all experts, or bytes (see
    :func:`parse_capacity`).  ``prefetch``: a predictor spec (see :class:`Predictor`).
    ``hardware``: a profile name or :class:`Hardware`; ``model`` the byte counts (default from
    the trace's shape, see :meth:`ModelCost.for_trace`).  ``verify_tokens``: tokens per
    forward pass (a speculative verification of ``verify_tokens - 1`` drafts plus one): each
    pass accesses the union of its tokens' experts per layer once and first gives the policy
    the per-expert activation counts of its tokens (what ``"spac"``, ``"spac_ema"`` and
    ``"score"`` learn from); 1 = one token per pass.  ``"spac"`` without an explicit ``gamma``
    takes the draft length ``verify_tokens - 1`` (its boundaries start at floor(gamma/2)).
    Values above 1 need ``prefetch=None`` (see ``csrc/sim.h``).
    ``miss``: SpecMD's miss handling (Sec. 3.1.2) -- ``"fetch"`` (load and wait), ``"drop"``
    (skip a missing expert the token ranks at ``miss_keep`` or below; ranks from the trace's
    logits when it has them, else its recorded order), ``"substitute"`` (the resident expert
    of the layer with the closest logit, counted a hit), ``"lowest_bit"`` (computed from a
    resident low-bit copy costing ``lowbit_ratio`` of an expert's compute, no load; 0.25 =
    int4 of a 16-bit expert), ``"priority"`` (fetch-priority: ranks below ``miss_keep``
    demanded, the others as ``"lowest_bit"``, except ranks from ``miss_keep2`` on (None: none),
    which come from a second copy costing ``lowbit2_ratio``: SpecMD's int4 -> int2 cascade;
    0.1875 = specmoe's int2, 2 bits plus 1 bit of scale and offset per weight, of a 16-bit
    expert); the result's ``extra`` counts ``missing``, ``dropped``, ``substituted``,
    ``lowbit`` and ``lowbit2`` accesses (``csrc/sim.h``, ``smoe_sim_miss``).  Needs
    ``verify_tokens=1``.  The simulator measures speed only: the quality cost of a miss mode
    is measured on the live engine (``benchmarks/misses.py``).
    ``protect``: MoE-SpeQ's lookahead-aware eviction (Sec. 3.3) as ``Engine.protect_lookahead``
    runs it: before each pass the experts its tokens route to (the draft's routing, exact in a
    trace) are protected from eviction, each layer's released once it has run; a protected
    expert is evicted only when no other can go (``extra["protected_evictions"]``).  Demand
    only (``prefetch=None``, ``miss="fetch"``).  The simulated cache is the live cache's slot
    table (``csrc/slots.h``): the same victims and policy events for the same accesses.
    ``admission``: prefetch admission by expected benefit (``csrc/admit.h``, issue 42), the
    live caches' rule (``Engine.set_prefetch(admission=True)``): a predicted expert is loaded
    only when its probability of use times the stall it would save exceeds the link time it
    would waste and the cost of its victim, and while the loads prefetching added stay within
    its byte budget (8 % of the loads that were needed); ``prefetch_refused`` counts the rest.
    Needs a predictor.  ``byte_budget=False``: the rule without its budget (time only; the
    offline bound of ``benchmarks/predictors.py``).
    ``hybrid``: the hybrid GPU tier (issue 37, ``from_pretrained(..., gpu_cache=...)``): per
    layer the token's missing experts are split by MoE-SpAc's Eq. 9 (the live tier's C rule)
    between copies to the cache and the host CPU, the CPU's costing ``expert_bytes /
    hardware.cpu_bw`` each beside the device's part; with a predictor the CPU's hottest are
    queued for admission (Eq. 10).  ``extra`` counts ``hybrid_copied``, ``hybrid_cpu``,
    ``hybrid_admitted`` and ``hybrid_cpu_wait_s``.  Needs ``hardware.cpu_bw`` (the ``h200``
    profile has the H200 host's), ``miss="fetch"`` and ``verify_tokens=1``.
    ``token_prior``: where the trace has token pieces and the ``nextuse`` policy's model or
    the ``learned`` predictor's has a token prior (``specmoe.sim.nextuse.TokenPrior``), each
    pass gives it its token's prior before the layers run (one token per pass only); False
    replays without it (the ablation).
    """
    if not isinstance(trace, Trace):
        raise TypeError(f"trace must be a specmoe.Trace, got {type(trace).__name__}")
    hw = get_hardware(hardware)
    model = model or ModelCost.for_trace(trace)
    pred = Predictor.parse(prefetch)
    if pred.kind == "router" and trace.logits is None:
        raise ValueError("the router predictor needs router logits and this trace has none "
                         "(trace.logits is None)")
    if isinstance(verify_tokens, bool) or not isinstance(verify_tokens, (int, np.integer)) \
            or not 1 <= int(verify_tokens) <= 65536:
        raise ValueError(f"verify_tokens must be an int in 1..65536, got {verify_tokens!r}")
    if admission and pred.kind == "none":
        raise ValueError("admission=True decides which prefetches to load: it needs a predictor "
                         "(prefetch=...)")
    if verify_tokens > 1 and pred.kind != "none":
        raise ValueError("verify_tokens > 1 replays demand only: prefetch predictors are defined "
                         "per token (use prefetch=None)")
    from ..runtime.misses import MISS_MODES
    if not isinstance(miss, str) or miss not in MISS_MODES:
        raise ValueError(f"miss={miss!r} is not a miss mode; choose one of {MISS_MODES}")
    if isinstance(miss_keep, bool) or not isinstance(miss_keep, (int, np.integer)) \
            or int(miss_keep) < 0:
        raise ValueError(f"miss_keep must be an int >= 0, got {miss_keep!r}")
    miss_keep = min(int(miss_keep), trace.top_k)  # keep >= top_k: every rank is fetched
    if isinstance(lowbit_ratio, bool) or not isinstance(lowbit_ratio, (int, float)) \
            or not 0 < float(lowbit_ratio) <= 1:
        raise ValueError(f"lowbit_ratio must be a number in (0, 1], got {lowbit_ratio!r}")
    if miss_keep2 is None:
        miss_keep2 = trace.top_k
    if isinstance(miss_keep2, bool) or not isinstance(miss_keep2, (int, np.integer)) \
            or not miss_keep <= int(miss_keep2):
        raise ValueError(f"miss_keep2 must be None or an int >= miss_keep ({miss_keep}), got "
                         f"{miss_keep2!r}")
    if isinstance(lowbit2_ratio, bool) or not isinstance(lowbit2_ratio, (int, float)) \
            or not 0 < float(lowbit2_ratio) <= 1:
        raise ValueError(f"lowbit2_ratio must be a number in (0, 1], got {lowbit2_ratio!r}")
    if miss != "fetch" and verify_tokens > 1:
        raise ValueError(f"miss={miss!r} replays one token per pass: use verify_tokens=1")
    if not isinstance(protect, (bool, np.bool_)):
        raise TypeError(f"protect must be a bool, got {type(protect).__name__}")
    if protect and (pred.kind != "none" or miss != "fetch"):
        raise ValueError("protect (the lookahead shield) replays demand only: use prefetch=None "
                         "and miss='fetch'")
    if not isinstance(hybrid, (bool, np.bool_)):
        raise TypeError(f"hybrid must be a bool, got {type(hybrid).__name__}")
    if hybrid and (miss != "fetch" or verify_tokens > 1 or protect):
        raise ValueError("hybrid (the hybrid GPU tier) replays one token per pass with "
                         "miss='fetch', verify_tokens=1 and protect=False")
    if hybrid and not hw.cpu_bw > 0:
        raise ValueError(f"hybrid=True needs the host CPU's expert rate: hardware {hw.name!r} "
                         f"has cpu_bw = {hw.cpu_bw} (use the 'h200' profile, or one whose "
                         f"cpu_bw is set: specmoe.sim.hardware.with_(hw, cpu_bw=...))")
    nl, E = trace.num_layers, trace.num_experts
    nslots = parse_capacity(capacity, num_layers=nl, num_experts=E,
                            expert_bytes=model.expert_bytes)
    kw: dict[str, Any] = {}
    label = _policy_label(policy)
    if isinstance(policy, str):
        name, kw = parse_policy(policy)
        pol: Any = name
        if name == "spac" and set(kw) & set(_SPAC_ABLATIONS):  # through the typed spec
            from ..runtime.policies import SpAc

            policy, kw = SpAc(**kw), {}
        elif name == "spac" and "gamma" not in kw:  # the pass's draft length (spac.c)
            kw["gamma"] = int(verify_tokens) - 1
        if name == "nextuse":  # with the packaged model, not the C built-in's weights alone
            from ..runtime.policies import NextUse

            policy = NextUse()
    if not isinstance(policy, str):
        from ..runtime.policies import SpAc

        if isinstance(policy, SpAc) and policy.gamma is None:
            policy = dataclasses.replace(policy, gamma=int(verify_tokens) - 1)
        pol = _policy_object(policy, nslots, nl, E)
    priors: dict[str, np.ndarray] = {}
    if token_prior and verify_tokens == 1 and not protect:
        from ..runtime.policies import NextUse
        from .nextuse import default_model

        models = [policy.resolve(nl, E)] if isinstance(policy, NextUse) and \
            policy.token_prior else []
        if pred.kind == "learned":
            models.append(default_model(nl, E))
        priors = _token_priors(trace, models)
    t0 = time.perf_counter()
    r = _C.simulate(trace.experts, E, pol, nslots,
                    logits=trace.logits if pred.kind == "router" or miss in ("drop", "substitute",
                                                                              "priority")
                    else None,
                    **pred.c_args(), **sim_timing(hw, model), verify_tokens=int(verify_tokens),
                    miss=_SIM_HYBRID if hybrid else MISS_MODES.index(miss),
                    miss_keep=int(miss_keep),
                    lowbit_ratio=float(lowbit_ratio),
                    miss_keep2=min(int(miss_keep2), trace.top_k),
                    lowbit2_ratio=float(lowbit2_ratio), protect=bool(protect),
                    model=_learned_model(nl, E) if pred.kind == "learned" else None,
                    admission=(1 if byte_budget else 2) if admission else 0,
                    cpu_expert_s=model.expert_bytes / hw.cpu_bw if hybrid else 0.0, **priors,
                    **kw)
    wall = time.perf_counter() - t0
    n = max(trace.num_tokens, 1)
    acc = r["accesses"]
    demand_loads = r["misses"] - r["prefetch_late"]
    ttft = ttft_seconds(trace, hw, model, overlap=pred.kind != "none")
    return SimResult(
        policy=label, capacity_slots=nslots, capacity_fraction=nslots / (nl * E),
        predictor=pred.label, hardware=hw.name, tokens=trace.num_tokens, accesses=acc, hits=r["hits"],
        misses=r["misses"], hit_rate=r["hits"] / acc if acc else 0.0,
        collision_misses=r["collision_misses"], evictions=r["evictions"],
        prefetch_issued=r["prefetch_issued"], prefetch_used=r["prefetch_used"],
        prefetch_late=r["prefetch_late"], prefetch_wasted=r["prefetch_wasted"],
        prefetch_dropped=r["prefetch_dropped"], prefetch_refused=r["prefetch_refused"],
        prefetch_precision=r["prefetch_used"] / r["prefetch_issued"] if r["prefetch_issued"] else 0.0,
        prefetch_recall=(r["prefetch_used"] / (r["prefetch_used"] + demand_loads)
                         if r["prefetch_used"] + demand_loads else 0.0),
        predictor_precision=r["predicted_true"] / r["predicted"] if r["predicted"] else 0.0,
        predictor_recall=r["predicted_true"] / r["next_true"] if r["next_true"] else 0.0,
        stall_s=r["stall_s"], compute_s=r["compute_s"], total_s=r["total_s"],
        est_tpot_ms=1e3 * r["total_s"] / n, ttft_ms=1e3 * float(ttft.mean()) if len(ttft) else 0.0,
        elapsed_s=r["elapsed_s"],
        accesses_per_s=acc / r["elapsed_s"] if r["elapsed_s"] > 0 else 0.0,
        extra={"wall_s": wall, "verify_tokens": int(verify_tokens), "miss": miss,
               "protect": bool(protect), "admission": bool(admission),
               "byte_budget": bool(admission and byte_budget),
               "hybrid": bool(hybrid),
               **{k: r[k] for k in ("missing", "dropped", "substituted", "lowbit", "lowbit2",
                                    "protected_evictions", "hybrid_copied", "hybrid_cpu",
                                    "hybrid_admitted", "hybrid_cpu_wait_s")}})

"""Speculative-decoding control: how many draft tokens K to verify per iteration, and drafters.

In an MoE, verifying K draft tokens touches the union of their experts, so speculation that
pays on a dense model can slow an MoE down.  The controllers here decide K from what each
iteration actually cost and yielded; all of them run in C (``csrc/spec/``, where the exact
state machines and every open choice are documented in ``controller.h``):

* :class:`StaticK` -- a fixed K.
* :class:`Heuristic` -- transformers' "heuristic" schedule (+2 after a fully accepted draft,
  -1 otherwise), the peer.
* :class:`Cascade` -- utility U = ETR / (t_iter_spec / t_iter_base) measured in test phases
  of up to M trials, then a set phase at the best K; K=0 with doubling back-off when U < 1.
* :class:`SpeqGovernor` -- MoE-SpeQ's k* = argmax E[N(k)] / T_cycle(k) with per-position
  acceptance EMAs and the caller's expected I/O cost of missing experts per k.

Every controller has ``next_k()``, ``observe(k, accepted, t_iter, experts_loaded=0)``,
``telemetry()`` and ``set_tau(tau)`` (gamma-tolerance pruning: K is allowed only when
(K+1) * tau(K+1) > 1, tau from :func:`measure_tau`).

Drafters share the :class:`Drafter` protocol; :class:`NgramDrafter` is prompt lookup in C.
:func:`accept` is the per-iteration acceptance rule (greedy or speculative sampling) in C.
"""
from __future__ import annotations

import math
import statistics
import time
from typing import Callable, Dict, Iterable, Mapping, Optional, Protocol, Sequence, Union

import numpy as np

from . import _C

__all__ = [
    "PHASES",
    "Controller",
    "StaticK",
    "Heuristic",
    "Cascade",
    "SpeqGovernor",
    "Drafter",
    "NgramDrafter",
    "measure_tau",
    "speedup",
    "accept",
]

#: Phase codes found in ``telemetry()["phase"]`` and ``Controller.phase``.
PHASES: Dict[int, str] = {0: "none", 1: "base", 2: "test", 3: "set", 4: "backoff"}

TauLike = Union[Sequence[float], np.ndarray, Mapping[int, float]]


def _check_int(name: str, v: object, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if int(v) < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v}")
    return int(v)


def _rows(name: str, x: Sequence[int]) -> np.ndarray:
    """Per-sequence counts as a 1-D int32 array (integers >= 0 only)."""
    a = np.asarray(x)
    if a.ndim != 1 or a.size == 0:
        raise ValueError(f"{name} must be a non-empty 1-D sequence, got shape {a.shape}")
    if a.dtype.kind not in "iu":
        raise TypeError(f"{name} must hold integers, got dtype {a.dtype}")
    if a.min() < 0 or a.max() > 2**31 - 1:
        raise ValueError(f"{name} must lie in [0, 2**31), got {a.min()}..{a.max()}")
    return np.ascontiguousarray(a, dtype=np.int32)


def speedup(lam: float, tau_next: float, delta: float, gamma: int) -> float:
    """The gamma-tolerance paper's speedup model, section 3.1, equation (1):
    S = lambda * tau(gamma+1) / (1 + gamma * delta * tau(gamma+1)), for gamma draft tokens
    verified over gamma+1 positions, lambda the expected tokens per step (accepted drafts plus
    the bonus token), tau_next = tau(gamma+1) = T(1)/T(gamma+1) and delta = T_D/T(1) the
    drafter's per-token cost relative to a plain step.  S > 1: speculation pays."""
    gamma = _check_int("gamma", gamma, 0)
    for n, v in (("lam", lam), ("tau_next", tau_next), ("delta", delta)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
            raise ValueError(f"{n} must be a finite number >= 0, got {v!r}")
    if lam < 1:
        raise ValueError(f"lam counts the bonus token and must be >= 1, got {lam}")
    if tau_next <= 0:
        raise ValueError(f"tau_next must be > 0, got {tau_next}")
    return lam * tau_next / (1.0 + gamma * delta * tau_next)


def _tau_vector(tau: TauLike) -> np.ndarray:
    """tau as the vector (tau(1), tau(2), ..., tau(n)); a mapping must hold keys 1..n."""
    if isinstance(tau, Mapping):
        keys = sorted(int(g) for g in tau)
        if keys != list(range(1, len(keys) + 1)):
            raise ValueError(f"tau mapping must have the keys 1..n, got {keys}")
        vec = np.array([float(tau[g]) for g in keys], dtype=np.float64)
    else:
        vec = np.asarray(tau, dtype=np.float64)
    if vec.ndim != 1:
        raise ValueError(f"tau must be 1-D, got shape {vec.shape}")
    return vec


class Controller:
    """Common surface of the speculation controllers (a thin wrapper over ``_C.SpecController``).

    The loop is ``k = ctl.next_k()``; draft up to k tokens and verify them; then
    ``ctl.observe(k_used, accepted, t_iter, experts_loaded)``.  ``k_used`` may be smaller than
    ``k`` (a drafter may find fewer tokens); controllers learn from what ran.
    """

    def __init__(self, name: str, **params: Union[int, float]) -> None:
        self._c = _C.SpecController(name, **params)  # type: ignore[arg-type]

    @property
    def name(self) -> str:
        """Controller name: "static", "heuristic", "cascade" or "speq"."""
        return str(self._c.name)

    @property
    def k_max(self) -> int:
        """Largest K this controller may answer."""
        return int(self._c.k_max)

    @property
    def phase(self) -> str:
        """Current phase name (see :data:`PHASES`)."""
        return PHASES[int(self._c.phase)]

    @property
    def allowed(self) -> list[int]:
        """K values that gamma-tolerance pruning allows (all of 0..k_max before set_tau)."""
        return list(self._c.allowed)

    @property
    def base(self) -> float:
        """Median t_iter of the last plain (K=0) iterations; NaN before the first one."""
        return float(self._c.base)

    def begin_request(self) -> None:
        """A new request starts (:func:`specmoe.generate` calls it).  Cascade drops its
        per-request state (phase, trial pools, back-off, hill-climbing centre) and keeps the
        measured plain-step time; the other controllers keep theirs (see controller.h)."""
        self._c.begin_request()

    def next_k(self) -> int:
        """K for the next iteration (0 = plain decoding).  Does not change state."""
        return int(self._c.next_k())

    def observe(self, k: int, accepted: int, t_iter: float, experts_loaded: int = 0, *,
                t_draft: float = 0.0, t_io: float = 0.0,
                rows_k: Optional[Sequence[int]] = None,
                rows_accepted: Optional[Sequence[int]] = None) -> None:
        """Learn from one iteration.

        Args:
            k: draft tokens verified (0..k_max).
            accepted: accepted draft tokens (0..k); the bonus token is implied.
            t_iter: wall seconds of the whole iteration (finite, > 0).
            experts_loaded: experts loaded from the slow tier during the iteration.
            t_draft: seconds of ``t_iter`` spent drafting (used by the speq governor).
            t_io: seconds of ``t_iter`` stalled on expert loads (used by the speq governor).
            rows_k, rows_accepted: a batch step: drafts verified and accepted per sequence
                (``k`` their maximum).  The step's ETR is then the mean of rows_accepted + 1
                (the batch's tokens per sequence; controller.h, "Batches"), and per-position
                acceptance learns from every row.

        Raises:
            ValueError: any argument out of range or not finite.
        """
        if rows_k is None and rows_accepted is None:
            self._c.observe(k, accepted, t_iter, experts_loaded, t_draft, t_io)
            return
        if rows_k is None or rows_accepted is None:
            raise ValueError("observe: give both rows_k and rows_accepted or neither")
        rk, ra = _rows("rows_k", rows_k), _rows("rows_accepted", rows_accepted)
        self._c.observe(k, accepted, t_iter, experts_loaded, t_draft, t_io, rk, ra)

    def set_batch(self, batch: int) -> None:
        """Batch size of the coming steps (:func:`specmoe.generate` calls it).  A change
        empties the plain-step timing (measured again at the new size) and begins a new
        request (controller.h, "Batches")."""
        self._c.set_batch(_check_int("batch", batch, 1))

    def set_success(self, on: bool = True, *, min_obs: int = 4, probe: int = 64) -> None:
        """Prune K by the gamma-tolerance paper's success condition (section 3.1, eq. 1):
        K >= 1 is allowed only when S(K) = lambda(K) tau(K+1) / (1 + K delta tau(K+1)) > 1,
        lambda and delta measured online (controller.h, "Success condition"), on top of the
        tau rule.  ``min_obs`` decisions per draft position before its acceptance counts
        (optimistic 1 until then); ``probe`` blocked plain steps before the measurements are
        forgotten and K may be tried again.  ``on=False`` returns to the tau rule alone."""
        if not isinstance(on, bool):
            raise TypeError(f"on must be a bool, got {type(on).__name__}")
        self._c.set_success(on, _check_int("min_obs", min_obs, 1), _check_int("probe", probe, 1))

    def success_model(self) -> Dict[str, object]:
        """The success model now: ``lambda`` [k_max+1] (expected tokens per step at each K),
        ``speedup`` [k_max+1] (S(K), S(0) = 1), ``delta`` (drafter cost per draft token over
        a plain step; None before it was measured) and ``batch``."""
        lam, sp, delta, has, batch = self._c.success_model()
        return {"lambda": list(lam), "speedup": list(sp), "delta": delta if has else None,
                "batch": int(batch)}

    def set_tau(self, tau: TauLike) -> None:
        """Gamma-tolerance pruning from tau(g) = T(1)/T(g) (g = 1..n, e.g. from
        :func:`measure_tau`): K >= 1 is allowed iff (K+1)*tau(K+1) > 1 and K+1 <= n.
        An empty tau removes the pruning."""
        self._c.set_tau(_tau_vector(tau))

    def telemetry(self) -> Dict[str, np.ndarray]:
        """Per-iteration records, oldest first: ``iter``, ``k`` (k_used), ``accepted``,
        ``t_iter``, ``utility`` (the controller's estimate, see controller.h), ``phase``,
        ``k_planned`` (what next_k answered) and ``experts_loaded``."""
        return dict(self._c.telemetry())

    def __repr__(self) -> str:
        return f"{type(self).__name__}(k_max={self.k_max}, next_k={self.next_k()}, phase={self.phase!r})"


class StaticK(Controller):
    """A fixed K (lowered to the largest allowed K after :meth:`set_tau`)."""

    def __init__(self, k: int, *, k_max: Optional[int] = None, telemetry_cap: int = 0) -> None:
        k = _check_int("k", k, 0)
        km = max(k, 1) if k_max is None else _check_int("k_max", k_max, 1)
        super().__init__("static", k=k, k_max=km, telemetry_cap=telemetry_cap)


class Heuristic(Controller):
    """transformers' "heuristic" schedule: K += 2 after a fully accepted draft, K -= 1
    otherwise, within [1, k_max] (transformers starts at 20 with no upper bound)."""

    def __init__(self, initial: int = 5, *, k_max: int = 8, telemetry_cap: int = 0) -> None:
        initial = _check_int("initial", initial, 1)
        k_max = _check_int("k_max", k_max, 1)
        if initial > k_max:
            raise ValueError(f"initial={initial} exceeds k_max={k_max}")
        super().__init__("heuristic", initial=initial, k_max=k_max, telemetry_cap=telemetry_cap)


class Cascade(Controller):
    """Cascade's utility-driven test-and-set controller (state machine in controller.h).

    Args:
        k_max: largest K tried.
        trials: M, trials per test phase.
        trial_len: t, iterations per trial.
        set_len: S, iterations of a set phase (and the first back-off length).
        backoff_max: cap of the doubling back-off length.
        base_len: plain iterations whose median is t_iter_base.
        base_refresh: iterations after which t_iter_base is measured again.
        initial: the first hill-climbing centre (default 2, or k_max if smaller); later test
            phases start from the best K of the last test phase that found one paying.
        trial_pool: iterations at a K whose ETR and time make a trial's utility: the trial's
            own and the most recent earlier ones at that K (trial_len: the trial's alone).
        converge: a test phase ends when two successive trials' utilities differ by at most
            this fraction of the larger (the paper's third early exit, 10 %); None: never.
    """

    def __init__(self, *, k_max: int = 8, trials: int = 4, trial_len: int = 4, set_len: int = 16,
                 backoff_max: int = 1024, base_len: int = 4, base_refresh: int = 100,
                 initial: Optional[int] = None, trial_pool: int = 12,
                 converge: Optional[float] = 0.10, telemetry_cap: int = 0) -> None:
        if initial is None:  # 2, lowered to k_max
            initial = min(2, _check_int("k_max", k_max, 1))
        vals = dict(k_max=k_max, trials=trials, trial_len=trial_len, set_len=set_len,
                    backoff_max=backoff_max, base_len=base_len, base_refresh=base_refresh,
                    initial=initial, trial_pool=trial_pool)
        for n, v in vals.items():
            _check_int(n, v, 1)
        if initial > k_max:
            raise ValueError(f"initial={initial} exceeds k_max={k_max}")
        if converge is not None and not (isinstance(converge, (int, float)) and
                                         0 < converge < 1):
            raise ValueError(f"converge must be in (0, 1) or None, got {converge!r}")
        super().__init__("cascade", telemetry_cap=telemetry_cap,
                         converge=-1.0 if converge is None else float(converge), **vals)


class SpeqGovernor(Controller):
    """MoE-SpeQ's amortization governor: K = argmax_k E[N(k)] / T_cycle(k).

    E[N(k)] = 1 + sum_i prod_{j<=i} p_j with per-position acceptance p_j tracked by an EMA;
    T_cycle(k) = k*t_draft_tok + T_verify(k+1) + io_cost[k], with the draft and verify times
    learned online from ``observe(..., t_draft=, t_io=)`` and io_cost supplied per iteration
    through :meth:`set_io_cost`.  After ``probe`` consecutive iterations at K=0 it tries the
    best K >= 1 once, so a pessimistic acceptance estimate cannot switch speculation off for
    good (-1: never probe).
    """

    def __init__(self, *, k_max: int = 8, alpha: float = 0.2, p_init: float = 0.6,
                 initial: int = 1, probe: int = 16, telemetry_cap: int = 0) -> None:
        k_max = _check_int("k_max", k_max, 1)
        if probe != -1:
            probe = _check_int("probe", probe, 1)
        initial = _check_int("initial", initial, 1)
        if not (0.0 < alpha <= 1.0):
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if not (0.0 <= p_init <= 1.0):
            raise ValueError(f"p_init must be in [0, 1], got {p_init}")
        super().__init__("speq", k_max=k_max, alpha=float(alpha), p_init=float(p_init),
                         initial=initial, probe=probe, telemetry_cap=telemetry_cap)

    def set_io_cost(self, cost: Union[Sequence[float], np.ndarray]) -> None:
        """cost[k] = expected seconds to load the experts that the draft predicts for k draft
        tokens and that are missing from the cache (k = 0..len-1; the rest count as 0)."""
        self._c.set_io_cost(np.asarray(cost, dtype=np.float64))

    def model(self, k: int) -> tuple[float, float]:
        """(E[N(k)], T_cycle(k)) of the governor's current model."""
        e, t = self._c.speq_model(k)
        return float(e), float(t)


class Drafter(Protocol):
    """What a drafter offers the generate loop."""

    def propose(self, history: Optional[Sequence[int]], k: int) -> list[int]: ...
    def append(self, tokens: Iterable[int]) -> None: ...
    def reset(self) -> None: ...


def _tokens(x: Union[Iterable[int], np.ndarray]) -> np.ndarray:
    """Token ids as an integer array; floats and other dtypes are refused (TypeError)."""
    if not isinstance(x, (np.ndarray, Sequence)):
        x = list(x)
    a = np.asarray(x)
    if a.size == 0:
        return a.astype(np.int64)
    if a.dtype.kind not in "iu":
        raise TypeError(f"token ids must be integers, got dtype {a.dtype}")
    return a


class NgramDrafter:
    """Prompt-lookup drafter in C: the tokens that followed the most recent earlier occurrence
    of the history's last n tokens (n = max_n down to min_n), continued periodically when the
    match runs into the end of the history (definition in csrc/spec/ngram.h).

    The index is incremental: appending a token costs O(max_n), a proposal O(max_n + k).
    """

    def __init__(self, max_n: int = 3, min_n: int = 1) -> None:
        self._g = _C.NgramDrafter(_check_int("max_n", max_n, 1), _check_int("min_n", min_n, 1))
        self._n = (int(max_n), int(min_n))

    def clone(self) -> "NgramDrafter":
        """A new drafter with the same settings and an empty history (one per sequence of a
        batch: :func:`specmoe.generate` gives every sequence its own index)."""
        return NgramDrafter(*self._n)

    @property
    def length(self) -> int:
        """Tokens in the drafter's history."""
        return int(self._g.length)

    def propose(self, history: Optional[Union[Sequence[int], np.ndarray]], k: int) -> list[int]:
        """Propose k draft tokens, or none when no n-gram of the history's end recurs.

        Args:
            history: the full token history (ids >= 0).  The drafter compares it with the one
                it holds (a memcmp), appends the new tail, and rebuilds its index only if the
                history diverged.  None keeps the held history (after :meth:`append`).
            k: number of tokens wanted (>= 0).

        Raises:
            ValueError: negative k, bad token ids, or an empty history.
        """
        k = _check_int("k", k, 0)
        return list(self._g.propose(None if history is None else _tokens(history), k))

    def append(self, tokens: Union[Iterable[int], np.ndarray]) -> None:
        """Extend the held history by tokens (ids >= 0)."""
        self._g.append(_tokens(tokens))

    def reset(self) -> None:
        """Forget the history."""
        self._g.reset()


def measure_tau(forward_fn: Callable[[int], object], gammas: Iterable[int] = range(1, 9), *,
                repeats: int = 5, warmup: int = 1,
                sync: Optional[Callable[[], object]] = None,
                progress: bool = False, stat: str = "median") -> Dict[int, float]:
    """Measure tau(g) = T(1)/T(g) of a target forward over g tokens.

    Args:
        forward_fn: called as ``forward_fn(g)``; runs one forward over g tokens at the batch
            size in use.
        gammas: the g values; must include 1.
        repeats: timed calls per g (the median is used), made in interleaved rounds over
            all g.
        warmup: untimed calls per g first.
        sync: called after each forward before the clock is read (e.g.
            ``torch.cuda.synchronize``).
        progress: show a tqdm bar over the rounds.
        stat: how the repeats of one g make T(g): "median", or "min" (the uncontended cost;
            robust where other processes share the cores and only slow calls down).

    Returns:
        {g: tau(g)} in increasing g; pass it to ``Controller.set_tau``.
    """
    gs = sorted({_check_int("gamma", g, 1) for g in gammas})
    if not gs or gs[0] != 1:
        raise ValueError("gammas must include 1 (tau is relative to T(1))")
    repeats = _check_int("repeats", repeats, 1)
    warmup = _check_int("warmup", warmup, 0)
    if stat not in ("median", "min"):
        raise ValueError(f"stat must be 'median' or 'min', got {stat!r}")
    def timed(g: int) -> float:
        t0 = time.perf_counter()
        forward_fn(g)
        if sync is not None:
            sync()
        return time.perf_counter() - t0

    for g in gs:
        for _ in range(warmup):
            timed(g)
    # interleaved rounds (the g order rotates each round), so drift and bursts of load on a
    # shared machine spread over every g instead of biasing the ones measured during them
    samples: Dict[int, list] = {g: [] for g in gs}
    rounds: Iterable[int] = range(repeats)
    if progress:
        from tqdm.auto import tqdm
        rounds = tqdm(rounds, desc="measure_tau", unit="round")
    for r in rounds:
        shift = r % len(gs)
        for g in gs[shift:] + gs[:shift]:
            samples[g].append(timed(g))
    agg = statistics.median if stat == "median" else min
    times = {g: agg(v) for g, v in samples.items()}
    t1 = times[1]
    out: Dict[int, float] = {}
    for g in gs:
        if not (times[g] > 0.0 and math.isfinite(times[g])):
            raise ValueError(f"measure_tau: non-positive time for gamma={g}")
        out[g] = t1 / times[g]
    return out


def accept(p: np.ndarray, draft: Union[Sequence[int], np.ndarray],
           q: Optional[np.ndarray] = None,
           u: Optional[np.ndarray] = None, *, check: bool = True) -> tuple[int, int]:
    """How many of the K draft tokens one verification accepts, and the next token.

    The iteration emits ``draft[:n]`` followed by ``next_token`` (n + 1 tokens).

    Greedy (``u is None``): draft i is accepted, in order, while it equals ``argmax(p[i])``
    (ties to the lowest id); ``next_token = argmax(p[n])``.  ``q`` is ignored.  Only each
    row's argmax matters, so a greedy caller may pass rows of logits with ``check=False``
    (what :func:`specmoe.generate` does: no softmax per token, ties decided on the logits).

    Sampling (``u`` given): the speculative-sampling rule (Leviathan et al. 2023, Chen et al.
    2023), under which every emitted token follows the target distribution exactly, whatever
    the draft distribution.  Draft ``d = draft[i]`` is accepted iff
    ``u[i, 0] < p[i, d] / q[i, d]`` (q = 0 < p: accepted; p = q = 0: rejected).  At the first
    rejection the next token is drawn from the residual ``max(0, p[i] - q[i])`` renormalised
    (from ``p[i]`` if that is all zero through rounding); if all K are accepted, the bonus
    token is drawn from ``p[K]``.  Draws use ``u[row, 1]`` and the inverse CDF: the smallest
    id whose cumulative weight (summed in float64) exceeds ``u * total``; an id of probability
    0 is never drawn.  ``u[K, 0]`` is unused.

    Args:
        p: float32 C-contiguous ``[K+1, V]``, the target's probabilities; row i is the
            distribution of the token after position i of the verified input.  Rows must be
            non-negative, finite, and sum to 1 within 1e-3.
        draft: the K draft ids in ``[0, V)`` (any integer sequence/array; K may be 0).
        q: float32 C-contiguous ``[K, V]``, the draft's probabilities the drafts were
            sampled from, or None for deterministic proposals (n-gram lookup, greedy drafter):
            then ``q[i]`` is one-hot at ``draft[i]``.
        u: float64 C-contiguous ``[K+1, 2]`` uniforms in ``[0, 1)`` from the caller's seeded
            generator (e.g. ``rng.random((K + 1, 2))``), or None for greedy decoding.
        check: scan every entry of p and q (finite, >= 0, rows summing to 1).  False skips
            that O((2K+1)V) scan, for a loop that computes its rows with softmax itself;
            shapes, dtypes, draft ids and u are still checked, so bad values cannot crash,
            but they give an unspecified answer (or ValueError) instead of a named error.

    Returns:
        ``(n_accepted, next_token)``.

    Raises:
        TypeError: an array of the wrong type or dtype (no silent conversion of p, q, u), or
            non-integer draft ids.
        ValueError: wrong shapes or layout, a non-probability row (NaN, inf, negative, bad
            sum), a draft id out of range, or u outside ``[0, 1)``.
    """
    return _C.spec_accept(p, draft, q, u, check=check)

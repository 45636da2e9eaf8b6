"""The controller base class, the gamma-tolerance speedup model and tau measurement, shared by
every controller in :mod:`specmoe.speculation.controllers`."""
from __future__ import annotations

import math
import statistics
import time
from typing import Callable, Dict, Iterable, Mapping, Optional, Sequence, Union

import numpy as np

from ... import _C

#: Phase codes found in ``telemetry()["phase"]`` and ``Controller.phase``.
PHASES: Dict[int, str] = {0: "none", 1: "base", 2: "test", 3: "set", 4: "backoff"}

TauLike = Union[Sequence[float], np.ndarray, Mapping[int, float]]


def check_int(name: str, v: object, lo: int) -> int:
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
        raise TypeError(f"{name} must be an int, got {type(v).__name__}")
    if int(v) < lo:
        raise ValueError(f"{name} must be >= {lo}, got {v}")
    return int(v)


def check_budget(budget: Optional[float]) -> float:
    """The slowdown budget as the C controller takes it: a fraction in (0, 1], or None (off,
    passed as -1)."""
    if budget is None:
        return -1.0
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or \
            not (0.0 < budget <= 1.0):
        raise ValueError(f"budget must be a fraction in (0, 1] or None (off), got {budget!r}")
    return float(budget)


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
    gamma = check_int("gamma", gamma, 0)
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

    @property
    def spent(self) -> tuple[float, float]:
        """(L, T) of the slowdown budget: the seconds speculation has cost against plain steps
        of the measured plain-step time (negative when it gained) and the seconds observed.
        Cascade's test phases and SpeQ's probes run only while L + W <= budget * T, W the
        largest loss of one speculative iteration so far (``csrc/spec/controller.h``)."""
        loss, total = self._c.spent
        return float(loss), float(total)

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
        self._c.set_batch(check_int("batch", batch, 1))

    def set_success(self, on: bool = True, *, min_obs: int = 4, probe: int = 64) -> None:
        """Prune K by the gamma-tolerance paper's success condition (section 3.1, eq. 1):
        K >= 1 is allowed only when S(K) = lambda(K) tau(K+1) / (1 + K delta tau(K+1)) > 1,
        lambda and delta measured online (controller.h, "Success condition"), on top of the
        tau rule.  ``min_obs`` decisions per draft position before its acceptance counts
        (optimistic 1 until then); ``probe`` blocked plain steps before the measurements are
        forgotten and K may be tried again.  ``on=False`` returns to the tau rule alone."""
        if not isinstance(on, bool):
            raise TypeError(f"on must be a bool, got {type(on).__name__}")
        self._c.set_success(on, check_int("min_obs", min_obs, 1), check_int("probe", probe, 1))

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


def measure_times(forward_fn: Callable[[int], object], gammas: Iterable[int], *,
                  repeats: int = 5, warmup: int = 1,
                  sync: Optional[Callable[[], object]] = None,
                  progress: bool = False, stat: str = "median") -> Dict[int, float]:
    """T(g): seconds of ``forward_fn(g)`` for each g, the median (or, ``stat="min"``, the
    fastest) of ``repeats`` timed calls made in interleaved rounds over all g after
    ``warmup`` untimed calls each; ``sync`` is called after each call before the clock is
    read.  :func:`measure_tau` divides T(1) by these."""
    gs = sorted({check_int("gamma", g, 1) for g in gammas})
    if not gs:
        raise ValueError("measure_times: no g to time")
    repeats = check_int("repeats", repeats, 1)
    warmup = check_int("warmup", warmup, 0)
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
        rounds = tqdm(rounds, desc="measure_times", unit="round")
    for r in rounds:
        shift = r % len(gs)
        for g in gs[shift:] + gs[:shift]:
            samples[g].append(timed(g))
    agg = statistics.median if stat == "median" else min
    times = {g: agg(v) for g, v in samples.items()}
    for g, t in times.items():
        if not (t > 0.0 and math.isfinite(t)):
            raise ValueError(f"measure_times: non-positive time for g={g}")
    return times


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
    gs = sorted({check_int("gamma", g, 1) for g in gammas})
    if not gs or gs[0] != 1:
        raise ValueError("gammas must include 1 (tau is relative to T(1))")
    times = measure_times(forward_fn, gs, repeats=repeats, warmup=warmup, sync=sync,
                          progress=progress, stat=stat)
    return {g: times[1] / times[g] for g in gs}

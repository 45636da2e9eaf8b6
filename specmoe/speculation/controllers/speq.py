"""MoE-SpeQ's amortization governor (state machine in C, ``csrc/spec/speq.c``)."""
from __future__ import annotations

import math
from typing import Mapping, Optional, Sequence, Union

import numpy as np

from .base import Controller, check_budget, check_int


class SpeqGovernor(Controller):
    """MoE-SpeQ's amortization governor: K = argmax_k E[N(k)] / T_cycle(k) (Sec. 3.2, Eq. 4).

    E[N(k)] = 1 + sum_i prod_{j<=i} p_j with per-position acceptance p_j tracked by an EMA;
    T_cycle(k) = k*t_draft_tok + t_first + T_verify(k+1) + io_cost[k] (Eq. 3), with the draft
    and verify times learned online from ``observe(..., t_draft=, t_io=)``, io_cost[k] learned
    from ``observe``'s ``experts_loaded`` and ``t_io`` (experts loaded per iteration verifying k
    drafts times seconds per load, both EMAs; an unseen k extrapolated from the nearest seen in
    proportion to k+1: ``csrc/spec/controller.h``) unless :meth:`set_io_cost` gives it, and
    ``t_first`` the profiled latency of a
    cycle's first mandatory expert fetch (seconds, default 0).  After ``probe`` consecutive
    iterations at K=0 it tries one K >= 1 once (the smallest never verified, else the best of
    its model), so a pessimistic estimate cannot switch speculation off for good nor keep it
    from the K where loads amortize (-1: never probe), while what speculation has cost
    so far against plain steps is within ``budget`` of the time observed (the slowdown budget,
    ``csrc/spec/controller.h``; None: probes are not limited).  ``k_max`` bounds the search;
    :func:`ttft_k_max` gives the bound that keeps time-to-first-token within a budget (the
    paper's offline SLO-based bounding, Sec. 3.2.3).
    """

    def __init__(self, *, k_max: int = 8, alpha: float = 0.2, p_init: float = 0.6,
                 initial: int = 1, probe: int = 16, t_first: float = 0.0,
                 budget: Optional[float] = 0.05, telemetry_cap: int = 0) -> None:
        k_max = check_int("k_max", k_max, 1)
        if probe != -1:
            probe = check_int("probe", probe, 1)
        initial = check_int("initial", initial, 1)
        if not (0.0 < alpha <= 1.0):
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if not (0.0 <= p_init <= 1.0):
            raise ValueError(f"p_init must be in [0, 1], got {p_init}")
        if isinstance(t_first, bool) or not isinstance(t_first, (int, float)) or \
                not (0.0 <= t_first < 1e6):
            raise ValueError(f"t_first must be seconds in [0, 1e6), got {t_first!r}")
        super().__init__("speq", k_max=k_max, alpha=float(alpha), p_init=float(p_init),
                         initial=initial, probe=probe, t_first=float(t_first),
                         budget=check_budget(budget),
                         telemetry_cap=telemetry_cap)

    def set_io_cost(self, cost: Union[Sequence[float], np.ndarray]) -> None:
        """cost[k] = expected seconds to load the experts that the draft predicts for k draft
        tokens and that are missing from the cache (k = 0..len-1; the rest count as 0).  From
        then on this replaces the estimate the governor learns from its observations."""
        self._c.set_io_cost(np.asarray(cost, dtype=np.float64))

    def model(self, k: int) -> tuple[float, float]:
        """(E[N(k)], T_cycle(k)) of the governor's current model."""
        e, t = self._c.speq_model(k)
        return float(e), float(t)

    def model_parts(self, k: int) -> tuple[float, float, float, float]:
        """T_cycle(k)'s terms (Eq. 3) in seconds: (drafting k tokens, the first mandatory
        fetch, verifying k + 1 tokens, loading the experts the draft adds); compute is the
        first and third, synchronous I/O the second and fourth
        (:mod:`specmoe.speculation.roofline`)."""
        return tuple(float(x) for x in self._c.speq_parts(check_int("k", k, 0)))  # type: ignore[return-value]


def ttft_k_max(budget_s: float, t_prefill: float,
               t_draft_tok: Union[float, Mapping[int, float]],
               t_verify: Mapping[int, float], t_first: float = 0.0, k_max: int = 8) -> int:
    """The largest draft length whose first token arrives within ``budget_s`` (MoE-SpeQ Sec.
    3.2.3, offline SLO-based bounding): the largest k in 0..k_max with
    ``t_prefill + t_draft(k) + t_first + t_verify[k + 1] <= budget_s``, all in seconds from a
    profiling run (``t_verify[g]``: one verification forward over g tokens, e.g.
    ``T(1) / tau(g)`` from :func:`specmoe.speculation.generation.target_tau`; ``t_draft(k)``:
    ``k * t_draft_tok`` for a number, ``t_draft_tok[k]`` for a table of the seconds drafting
    k tokens takes, k = 1..k_max, as :func:`specmoe.speculation.tau.profile_ttft` measures
    it).  Pass the result as :class:`SpeqGovernor`'s ``k_max``.  ValueError when even k = 0
    misses the budget or a needed ``t_verify`` / ``t_draft_tok`` entry is missing."""
    vals = dict(budget_s=budget_s, t_prefill=t_prefill, t_first=t_first)
    if not isinstance(t_draft_tok, Mapping):
        vals["t_draft_tok"] = t_draft_tok
    for n, v in vals.items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
                or v < 0:
            raise ValueError(f"{n} must be a finite number of seconds >= 0, got {v!r}")
    k_max = check_int("k_max", k_max, 0)
    best = -1
    for k in range(k_max + 1):
        if k + 1 not in t_verify:
            raise ValueError(f"t_verify has no entry for {k + 1} tokens (needed up to "
                             f"{k_max + 1})")
        if not isinstance(t_draft_tok, Mapping):
            draft = k * float(t_draft_tok)
        elif k == 0:
            draft = 0.0
        elif k in t_draft_tok:
            draft = float(t_draft_tok[k])
        else:
            raise ValueError(f"t_draft_tok has no entry for {k} tokens (needed up to {k_max})")
        if t_prefill + draft + t_first + float(t_verify[k + 1]) <= budget_s:
            best = k
    if best < 0:
        raise ValueError(f"even k = 0 misses the TTFT budget of {budget_s} s "
                         f"(prefill {t_prefill} s + verify {t_verify[1]} s + first fetch "
                         f"{t_first} s)")
    return best

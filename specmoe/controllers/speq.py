"""MoE-SpeQ's amortization governor (state machine in C, ``csrc/spec/speq.c``)."""
from __future__ import annotations

from typing import Sequence, Union

import numpy as np

from .base import Controller, _check_int


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

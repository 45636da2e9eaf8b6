"""Cascade's utility-driven test-and-set controller (state machine in C,
``csrc/spec/cascade.c``)."""
from __future__ import annotations

from typing import Optional

from .base import Controller, check_budget, check_int


class Cascade(Controller):
    """Cascade's utility-driven test-and-set controller (state machine in controller.h).

    Args:
        k_max: largest K tried.
        trials: M, trials per test phase.
        trial_len: t, iterations per trial.
        set_len: S, iterations of a set phase (and the first back-off length).
        backoff_max: cap of the doubling back-off length.
        base_len: plain iterations whose median is t_iter_base.  The controller's first SET is
            confirmed by base_len more plain iterations after its trials (the smaller of the
            two bases decides: plain steps fall while an offloaded cache warms).
        base_refresh: iterations after which t_iter_base is measured again.
        initial: the first hill-climbing centre (default 2, or k_max if smaller); later test
            phases start from the best K of the last test phase that found one paying.
        trial_pool: iterations at a K whose ETR and time make a trial's utility: the trial's
            own and the most recent earlier ones at that K (trial_len: the trial's alone).
        converge: a test phase ends when two successive trials' utilities differ by at most
            this fraction of the larger (the paper's third early exit, 10 %); None: never.
        budget: the slowdown budget: a test phase starts only while what speculation has
            cost so far against plain steps is at most this fraction of the time observed
            (the paper's 5 % promise, kept on short requests too); None: off.  See
            :attr:`spent` and ``csrc/spec/controller.h``.
    """

    def __init__(self, *, k_max: int = 8, trials: int = 4, trial_len: int = 4, set_len: int = 16,
                 backoff_max: int = 1024, base_len: int = 4, base_refresh: int = 100,
                 initial: Optional[int] = None, trial_pool: int = 12,
                 converge: Optional[float] = 0.10, budget: Optional[float] = 0.05,
                 telemetry_cap: int = 0) -> None:
        if initial is None:  # 2, lowered to k_max
            initial = min(2, check_int("k_max", k_max, 1))
        vals = dict(k_max=k_max, trials=trials, trial_len=trial_len, set_len=set_len,
                    backoff_max=backoff_max, base_len=base_len, base_refresh=base_refresh,
                    initial=initial, trial_pool=trial_pool)
        for n, v in vals.items():
            check_int(n, v, 1)
        if initial > k_max:
            raise ValueError(f"initial={initial} exceeds k_max={k_max}")
        if converge is not None and not (isinstance(converge, (int, float)) and
                                         0 < converge < 1):
            raise ValueError(f"converge must be in (0, 1) or None, got {converge!r}")
        super().__init__("cascade", telemetry_cap=telemetry_cap, budget=check_budget(budget),
                         converge=-1.0 if converge is None else float(converge), **vals)

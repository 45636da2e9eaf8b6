"""transformers' "heuristic" schedule, the peer controller."""
from __future__ import annotations

from .base import Controller, check_int


class Heuristic(Controller):
    """transformers' "heuristic" schedule: K += 2 after a fully accepted draft, K -= 1
    otherwise, within [1, k_max] (transformers starts at 20 with no upper bound)."""

    def __init__(self, initial: int = 5, *, k_max: int = 8, telemetry_cap: int = 0) -> None:
        initial = check_int("initial", initial, 1)
        k_max = check_int("k_max", k_max, 1)
        if initial > k_max:
            raise ValueError(f"initial={initial} exceeds k_max={k_max}")
        super().__init__("heuristic", initial=initial, k_max=k_max, telemetry_cap=telemetry_cap)

"""A fixed K."""
from __future__ import annotations

from typing import Optional

from .base import Controller, check_int


class StaticK(Controller):
    """A fixed K (lowered to the largest allowed K after :meth:`set_tau`)."""

    def __init__(self, k: int, *, k_max: Optional[int] = None, telemetry_cap: int = 0) -> None:
        k = check_int("k", k, 0)
        km = max(k, 1) if k_max is None else check_int("k_max", k_max, 1)
        super().__init__("static", k=k, k_max=km, telemetry_cap=telemetry_cap)

"""Former home of the speculation controllers, drafters and acceptance rule (kept so that old
imports work): :mod:`specmoe.controllers` (StaticK, Heuristic, Cascade, SpeqGovernor,
measure_tau, speedup), :mod:`specmoe.drafters` (NgramDrafter, the Drafter protocol) and
:mod:`specmoe.verify` (accept)."""
from __future__ import annotations

from .controllers import (PHASES, Cascade, Controller, Heuristic, SpeqGovernor,  # noqa: F401
                          StaticK, TauLike, measure_tau, speedup)
from .drafters import Drafter, NgramDrafter  # noqa: F401
from .verify import accept  # noqa: F401

__all__ = ["PHASES", "Controller", "StaticK", "Heuristic", "Cascade", "SpeqGovernor", "Drafter",
           "NgramDrafter", "measure_tau", "speedup", "accept"]

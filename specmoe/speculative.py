"""Former home of :func:`specmoe.generate` and the model drafters (kept so that old imports
work): :mod:`specmoe.generation` (generate, GenerateOutput, measure_tau_grid, target_tau),
:mod:`specmoe.drafters` (Draft, DraftModel, SelfDraft, recurrent_layer_types) and
:mod:`specmoe.sampling` (Sampling)."""
from __future__ import annotations

from .drafters import Draft, DraftModel, SelfDraft, recurrent_layer_types  # noqa: F401
from .generation import (GenerateOutput, find_engine, generate, measure_tau_grid,  # noqa: F401
                         target_tau)
from .sampling import Sampling  # noqa: F401

__all__ = ["Draft", "DraftModel", "SelfDraft", "Sampling", "GenerateOutput", "generate",
           "find_engine", "measure_tau_grid", "target_tau", "recurrent_layer_types"]

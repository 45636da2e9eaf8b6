"""The offloaded experts module every MoE layer of a served model gets
(:class:`SpecmoeExperts`), and :func:`engine_of`, which finds the engine behind a model.

Below the engines and the model adapters: :mod:`specmoe.models.arch` recognises an offloaded layer by
this class, and the speculation code finds a model's engine through :func:`engine_of` without
importing the engines.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from .gpu_engine import GpuEngine
    from .engine import Engine

__all__ = ["SpecmoeExperts", "engine_of", "find_engine"]


class SpecmoeExperts(nn.Module):
    """Drop-in replacement of a transformers experts module; holds no expert weights."""

    def __init__(self, engine: "Engine | None", position: int, num_experts: int, hidden: int):
        super().__init__()
        self._engine = engine  # None while the store is being written
        self.position = position
        self.num_experts = num_experts
        self.hidden_dim = hidden

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        if self._engine is None:
            raise RuntimeError("these experts were offloaded but no specmoe Engine serves them "
                               "(the conversion failed): reload the model")
        return self._engine.layer_forward(self.position, hidden_states, top_k_index,
                                           top_k_weights)

    def extra_repr(self) -> str:
        return f"position={self.position}, num_experts={self.num_experts}, offloaded"


def engine_of(model: nn.Module) -> Engine | GpuEngine:
    """The engine serving ``model``'s experts: an :class:`Engine`, or a
    :class:`specmoe.runtime.gpu_engine.GpuEngine` on the GPU tier (ValueError if specmoe does not)."""
    for m in model.modules():
        if isinstance(m, SpecmoeExperts) and m._engine is not None:
            return m._engine
    raise ValueError(f"{type(model).__name__} is not served by specmoe (use "
                     "specmoe.from_pretrained or specmoe.offload)")


def find_engine(model: nn.Module) -> Any:
    """The engine that offloaded ``model`` (:func:`engine_of`), or None."""
    try:
        return engine_of(model)
    except ValueError:
        return None

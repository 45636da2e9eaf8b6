"""Sampling settings of :func:`specmoe.generate` (temperature, top-k, top-p), shared by the
drafters and the generate loop."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["Sampling"]


@dataclass(frozen=True)
class Sampling:
    """How logits become the distribution tokens are drawn from (target and draft alike).

    ``temperature`` > 0 divides the logits; ``top_k`` keeps the k most likely tokens; ``top_p``
    keeps the smallest set whose probability reaches p (nucleus).  The rejection rule then
    makes the output follow exactly this processed target distribution."""

    temperature: float = 1.0
    top_k: Optional[int] = None
    top_p: Optional[float] = None

    def __post_init__(self) -> None:
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature > 0):
            raise ValueError(f"temperature must be a finite number > 0, got {self.temperature!r}")
        if self.top_k is not None and (not isinstance(self.top_k, int) or self.top_k < 1):
            raise ValueError(f"top_k must be an int >= 1 or None, got {self.top_k!r}")
        if self.top_p is not None and not (0 < self.top_p <= 1):
            raise ValueError(f"top_p must be in (0, 1] or None, got {self.top_p!r}")

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """Rows of probabilities (float32, C-contiguous) from rows of logits [n, V]."""
        x = logits.detach().float() / float(self.temperature)
        if self.top_k is not None and self.top_k < x.shape[-1]:
            kth = torch.topk(x, self.top_k, dim=-1).values[..., -1:]
            x = x.masked_fill(x < kth, float("-inf"))
        p = torch.softmax(x, dim=-1)
        if self.top_p is not None and self.top_p < 1:
            sp, si = torch.sort(p, dim=-1, descending=True)
            before = torch.cumsum(sp, dim=-1) - sp
            sp = sp.masked_fill(before >= self.top_p, 0.0)
            p = torch.zeros_like(p).scatter(-1, si, sp)
            p = p / p.sum(-1, keepdim=True)
        return p.contiguous()

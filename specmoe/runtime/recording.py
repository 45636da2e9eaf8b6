"""Recording an offloaded model's routing as a :class:`specmoe.sim.traces.Trace`.

``with engine.trace() as t: model.generate(...)``: every MoE layer call of the Engine hands its
routing (top-k ids and weights, optionally the router logits) to a :class:`Recorder`; a forward
pass over all layers becomes one row per token; a pass with more than one token (a prefill)
starts a new request.  The simulator replays the result (``specmoe simulate --trace``).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from .engine import Engine
    from .gpu_engine import GpuEngine

__all__ = ["TraceRecording"]


@dataclass
class Recorder:
    num_layers: int
    logits: bool
    experts: list = field(default_factory=list)   # per forward: [T, L, k]
    weights: list = field(default_factory=list)
    logit_rows: list = field(default_factory=list)
    starts: list = field(default_factory=list)
    _cur_e: list | None = None
    _cur_w: list | None = None
    _cur_g: list | None = None
    ntok: int = 0

    def layer(self, pos: int, idx: torch.Tensor, w: torch.Tensor, lg: torch.Tensor | None) -> None:
        if pos == 0:
            self._flush()
            self._cur_e, self._cur_w, self._cur_g = [], [], []
        if self._cur_e is None:
            return
        # .cpu(): the GPU tier records its device tensors (a copy; a no-op view on the CPU)
        self._cur_e.append(idx.detach().to(torch.int16).cpu().numpy().copy())
        self._cur_w.append(w.detach().float().cpu().numpy().copy())
        if lg is not None:
            self._cur_g.append(lg.detach().float().cpu().numpy().copy())
        if pos == self.num_layers - 1:
            self._flush()

    def _flush(self) -> None:
        if self._cur_e and len(self._cur_e) == self.num_layers:
            e = np.stack(self._cur_e, 1)
            if e.shape[0] > 1 or not self.starts:  # a prefill (or the first pass) opens a request
                self.starts.append(self.ntok)
            self.experts.append(e)
            self.weights.append(np.stack(self._cur_w, 1))
            if self.logits and len(self._cur_g) == self.num_layers:
                self.logit_rows.append(np.stack(self._cur_g, 1))
            self.ntok += e.shape[0]
        self._cur_e = self._cur_w = self._cur_g = None


class TraceRecording:
    """Context manager returned by ``engine.trace()`` (the CPU :class:`Engine` or the GPU
    tier's ``GpuEngine``); :meth:`result` gives the Trace."""

    def __init__(self, engine: "Engine | GpuEngine", logits: bool):
        self._engine = engine
        self._rec = Recorder(len(engine.layer_ids), logits)

    def __enter__(self) -> "TraceRecording":
        self._engine.recorder = self._rec
        return self

    def __exit__(self, *exc: Any) -> None:
        self._rec._flush()
        self._engine.recorder = None

    def result(self):
        """The recorded routing as a :class:`specmoe.sim.traces.Trace` (tokens in forward order;
        a forward pass with more than one token, i.e. a prefill, starts a new request; with
        batch > 1 the rows of a pass are recorded in flattened batch order)."""
        from ..sim.traces import Trace
        r = self._rec
        r._flush()
        k = self._engine.top_k
        L = len(self._engine.layer_ids)
        ex = np.concatenate(r.experts) if r.experts else np.zeros((0, L, k), np.int16)
        w = np.concatenate(r.weights) if r.weights else np.zeros((0, L, k), np.float32)
        lg = np.concatenate(r.logit_rows) if (r.logits and r.logit_rows) else None
        return Trace(experts=ex, num_experts=self._engine.num_experts,
                     request_starts=np.asarray(r.starts or [0], np.int64),
                     layer_ids=np.asarray(self._engine.layer_ids, np.int32), weights=w,
                     logits=lg, model=self._engine.model_type,
                     source=f"specmoe.runtime.{type(self._engine).__name__}")

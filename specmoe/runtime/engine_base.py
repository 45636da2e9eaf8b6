"""What the CPU :class:`specmoe.runtime.engine.Engine` and the GPU tier's
:class:`specmoe.runtime.gpu_engine.GpuEngine` share (:class:`EngineCommon`)."""
from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator

import numpy as np
from torch import nn

__all__ = ["EngineCommon", "check_prefetch"]


def check_prefetch(overfetch: float | None, mass: float | None | str) -> None:
    """The prediction settings both engines' ``set_prefetch`` take: overfetch >= 1 (or None:
    unchanged); mass in (0, 1], None (the overfetch rule) or "keep"."""
    if isinstance(mass, str) and mass != "keep":
        raise ValueError(f"mass must be a number in (0, 1], None or 'keep', got {mass!r}")
    if not isinstance(mass, str) and mass is not None and not (0 < mass <= 1):
        raise ValueError(f"mass must be in (0, 1], got {mass}")
    if overfetch is not None and not overfetch >= 1:
        raise ValueError(f"overfetch must be >= 1, got {overfetch}")


class EngineCommon:
    """What the CPU :class:`Engine` and the GPU tier's
    :class:`specmoe.runtime.gpu_engine.GpuEngine` share: both keep ``model`` and a cache ``_cache``
    (``stats()``, ``slot_bytes``; None once closed) over a store file (``_store``, deleted on
    close when ``_own_store``)."""

    model: nn.Module | None
    _cache: Any
    _store: Any
    _store_path: str | None
    _own_store: bool

    def _close_storage(self) -> None:
        """Close the cache and the store; delete the store file when it was a temporary one."""
        if self._cache is not None:
            self._cache.close()
            self._cache = None
        if self._store is not None:
            self._store.close()
            self._store = None
        if self._own_store and self._store_path and os.path.exists(self._store_path):
            os.unlink(self._store_path)
            self._own_store = False

    # set by the engines: the trace recorder in use (trace()), the routers the predictor reads,
    # the self-draft's copy and the draft forwards' routing (drafting())
    recorder: Any
    _draft: Any
    _drafting: list | None
    _draft_prefetch: bool
    _draft_flags: Any
    model_type: str
    _routers: list
    _router_bias: list
    arch: Any

    def _router_copies(self) -> list[tuple[Any, Any, Any]]:
        """Each MoE layer's router as host f32 arrays (weight [E,H], bias, correction bias):
        the C layers' copy, from which they predict the next layer's experts (and route,
        where the C path routes) on either tier."""
        import torch

        def f32(t: Any) -> Any:
            return None if t is None else \
                np.ascontiguousarray(t.detach().to(torch.float32).cpu()
                                     .reshape(t.shape[0], -1).squeeze(-1).numpy())
        out = []
        for r, corr in zip(self._routers, self._router_bias):
            out.append((f32(r.weight), f32(getattr(r, "bias", None)),
                        None if corr is None else f32(corr.reshape(-1))))
        return out

    def trace(self, logits: bool = False) -> Any:
        """``with engine.trace() as t: model.generate(...)``; then ``t.result()`` is a
        :class:`specmoe.sim.traces.Trace` (save with ``.save(path)`` as .npz).  The same on
        both tiers: every MoE layer call hands its routing to the recorder."""
        from .recording import TraceRecording
        return TraceRecording(self, logits)

    def router_scores(self, pos: int, x: Any) -> Any:
        """Layer ``pos``'s router scores on ``x`` [T, H] (torch, on x's device): the logits, or
        with a correction bias the model's score function plus it (csrc/route.h's rule)."""
        import torch
        r = self._routers[pos]
        w = r.weight
        lg = torch.nn.functional.linear(x.to(w.dtype), w, getattr(r, "bias", None)).float()
        bias = self._router_bias[pos]
        if bias is not None:
            lg = (lg.sigmoid() if self.arch.sigmoid_router else lg.softmax(-1)) + \
                bias.float().reshape(-1)
        return lg

    def record_layer(self, pos: int, hidden: Any, idx: Any, w: Any) -> None:
        """Hand layer ``pos``'s routing to the trace recorder, if one is on (trace())."""
        rec = self.recorder
        if rec is not None:
            lg = self.router_scores(pos, hidden.detach()) if rec.logits else None
            rec.layer(pos, idx, w, lg)

    @contextlib.contextmanager
    def drafting(self, prefetch: bool = False) -> Iterator[list[tuple[int, Any]]]:
        """Within the block, the model's MoE layers run on the resident self-draft copy
        (:meth:`enable_self_draft`), touch no expert of the cache, and append
        ``(moe_layer_position, top_k_index[T, k])`` of every layer call to the yielded list.
        ``prefetch``: also queue, layer by layer as the draft routes it, the experts of the
        newest token to the cache's prefetch worker (when the engine prefetches), so their
        loads overlap the rest of the draft; ``stats()["draft_prefetch_queued"]`` counts
        them."""
        if self._draft is None:
            raise RuntimeError("drafting() needs enable_self_draft() first")
        if self._drafting is not None:
            raise RuntimeError("drafting() does not nest")
        rec: list[tuple[int, Any]] = []
        self._drafting = rec
        self._draft_prefetch = bool(prefetch)
        try:
            yield rec
        finally:
            self._drafting = None
            self._draft_prefetch = False

    @contextlib.contextmanager
    def draft_tokens(self, flags: Any) -> Iterator[None]:
        """Within the block, the MoE layers treat the flagged tokens as draft tokens (one flag
        per token of each forward, in the flattened [batch, sequence] order the layers see):
        their missing experts are never loaded -- computed from the resident low-bit copy when
        there is one (:meth:`enable_self_draft`), else skipped -- unless resident or loaded for
        a real token anyway, and they take no part in next-layer prediction or the policy's
        counts (csrc/layer.h's rule; the GPU tier applies the same in
        ``GpuEngine._split_draft_pairs``).  The MTP drafter's mask tokens run this way.  One forward at a
        time; ``stats()["draft_kept"]`` counts the pairs served without a load."""
        f = np.ascontiguousarray(np.asarray(flags).reshape(-1).astype(bool), dtype=np.uint8)
        if self._draft_flags is not None:
            raise RuntimeError("draft_tokens: already inside a draft_tokens block")
        self._draft_flags = f
        try:
            yield
        finally:
            self._draft_flags = None

    @property
    def cache(self) -> Any:
        """The expert cache (an :class:`specmoe.ExpertCache`, or the GPU tier's
        :class:`specmoe.runtime.cuda.GpuExpertCache`); None once closed."""
        return self._cache

    def loads(self) -> tuple[int, float]:
        """(experts loaded from the store, seconds stalled on loads) since the last reset."""
        if self._cache is None:
            return 0, 0.0
        c = self._cache.stats()
        return int(c.get("bytes_read", 0)) // max(1, self._cache.slot_bytes), float(
            c.get("stall_s", 0.0))

    def generate(self, input_ids: Any, **kw: Any) -> Any:
        """:func:`specmoe.generate` on this engine's model (same arguments)."""
        from ..speculation.generation import generate
        return generate(self.model, input_ids, engine=self, **kw)



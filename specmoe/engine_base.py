"""What the CPU :class:`specmoe.hf.Engine` and the GPU tier's
:class:`specmoe.gpu_engine.GpuEngine` share (:class:`EngineCommon`)."""
from __future__ import annotations

import os
from typing import Any, Dict

from torch import nn

__all__ = ["EngineCommon", "TauTables"]


class EngineCommon:
    """What the CPU :class:`Engine` and the GPU tier's
    :class:`specmoe.gpu_engine.GpuEngine` share: both keep ``model`` and a cache ``_cache``
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

    def loads(self) -> tuple[int, float]:
        """(experts loaded from the store, seconds stalled on loads) since the last reset."""
        if self._cache is None:
            return 0, 0.0
        c = self._cache.stats()
        return int(c.get("bytes_read", 0)) // max(1, self._cache.slot_bytes), float(
            c.get("stall_s", 0.0))

    def generate(self, input_ids: Any, **kw: Any) -> Any:
        """:func:`specmoe.generate` on this engine's model (same arguments)."""
        from .generation import generate
        return generate(self.model, input_ids, engine=self, **kw)


class TauTables(Dict[int, Dict[int, float]]):
    """tau(g) tables of one model, one per batch size: ``{batch: {g: tau}}`` (a dict).  An
    engine owns one (``engine.tau``) and clears it when its cache changes, since tau counts
    expert loads; :func:`specmoe.speculation.tau.target_tau` fills it, a caller may also
    store a table measured elsewhere (``engine.tau[4] = {...}``)."""

    def table(self, batch: int) -> Dict[int, float]:
        """The table at ``batch`` (empty until :func:`target_tau` measures it)."""
        return self.setdefault(int(batch), {})

"""The self-draft's resident low-bit copy of every routed expert (:class:`ExpertCopy`).

Engine-side (owned by :class:`specmoe.runtime.engine.Engine`, lent to the C layers for SpecMD's
``lowest_bit`` miss handling), so it lives apart from the drafters: the engine modules never
import the speculative-decoding side (``tests/test_layout.py`` checks the direction).
"""
from __future__ import annotations

from typing import Any, Dict

import numpy as np

from .. import _C

__all__ = ["ExpertCopy"]


class ExpertCopy:
    """Every routed expert of a store resident in one buffer at ``dtype``: the weights of
    MoE-SpeQ's quantized self-draft (:class:`SelfDraft`), which SpecMD's ``lowest_bit`` miss
    handling also computes from.  Owned by :class:`specmoe.runtime.engine.Engine`
    (:meth:`~specmoe.runtime.engine.Engine.enable_self_draft`).

    Built from the store, dequantized to f32 and requantized to ``dtype``, through a temporary
    store file deleted at once (the same writer as any store); it costs ``dtype``'s size of
    all experts (int4: about 1/7 of f32)."""

    def __init__(self, store: Any, dtype: str, ffn_args: Dict[str, Any], model_type: str,
                 top_k: int) -> None:
        import os
        import tempfile

        from ..storage.conversion import write_experts
        from .kernels import FFNSpec
        from ..storage.quant import dequantize_expert
        from ..storage.store import ExpertStore
        L, E = int(store.num_layers), int(store.num_experts)
        fd, path = tempfile.mkstemp(prefix="specmoe-draft-", suffix=".smoe")
        os.close(fd)
        try:
            write_experts(path, lambda p, e: dequantize_expert(store.read_expert(p, e)),
                          num_layers=L, num_experts=E, dtype=dtype, model=model_type,
                          top_k=top_k, extra={}, progress=False)
            with ExpertStore(path, verify=False) as st:
                bb = int(st.block_bytes)
                buf = st.read_all()
                spec = FFNSpec.from_store_schema(st.tensors, bb, **ffn_args)
        finally:
            os.unlink(path)
        self.dtype = dtype
        self.num_experts = E
        self.buf: np.ndarray = buf
        self.spec = spec  # the copy's FFNSpec (the GPU tier computes from it)
        self.desc: Dict[str, Any] = spec.desc()
        self.block_bytes = bb

    def forward(self, kctx: Any, pos: int, x: np.ndarray, idx: np.ndarray, w: np.ndarray,
                out: np.ndarray, used: np.ndarray) -> None:
        """One MoE layer (position ``pos``) on the copy: ``out`` = the weighted sum of the
        routed experts' FFNs (the C path of the cache, GIL released)."""
        _C.moe_forward(self.buf, kctx, self.desc, self.block_bytes, pos, self.num_experts, x,
                       idx, w, out, used)

"""Shared by the decode-attention tests (test_mla_c.py, test_attention.py, test_attn_block.py,
test_mla_block.py): the ISAs this CPU runs, transformers-style causal masks, and the decoder
layers' outputs of models compared with each other."""
from __future__ import annotations

import numpy as np

from specmoe import _C

_ORDER = ["scalar", "avx2", "avx512"]
ISAS = _ORDER[:_ORDER.index(_C.KernelContext(1).isa_max) + 1]


def causal(T: int, S: int, rows: int = 1) -> np.ndarray:
    """Additive float32 [rows, T, S] mask: the T queries are the last T of S positions, later
    positions get the most negative float (transformers' eager masks)."""
    i = np.arange(T)[:, None] + (S - T)
    j = np.arange(S)[None, :]
    m = np.where(j > i, np.finfo(np.float32).min, 0.0).astype(np.float32)
    return np.broadcast_to(m, (rows, T, S)).copy()


def mask_of(kind: str, T: int, S: int, B: int) -> np.ndarray | None:
    """The masks the kernel tests cover: "none" (None), "shared" (one causal [1, T, S]) and
    "per_row" (causal per row, and row b's first b positions -inf: left padding)."""
    if kind == "none":
        return None
    if kind == "shared":
        return causal(T, S)
    bias = causal(T, S, B)
    for b in range(B):
        bias[b, :, :min(b, S - 1)] = -np.inf
    return bias


def layer_outputs(**models) -> dict:
    """{name: list} filled with a clone of every decoder layer output of each model, in call
    order (forward hooks on ``model.model.layers``)."""
    outs: dict = {tag: [] for tag in models}
    for tag, mdl in models.items():
        for layer in mdl.model.layers:
            layer.register_forward_hook(
                lambda mod, args, out, tag=tag: outs[tag].append(out.clone()))
    return outs

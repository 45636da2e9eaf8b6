"""The models' own attention at decode sizes in C (``specmoe._C.AttnDecode``).

transformers runs a decoder's attention through one function chosen by
``config._attn_implementation`` (its ``AttentionInterface``).  On a CPU, torch's
``scaled_dot_product_attention`` in bf16 at one query token is slow: 254 us for 16 heads of
128 over 100 cached positions on one thread, against 33 us in f32 and 62 us for the same
products written out (eager) -- about 1 ms of a 4-layer OLMoE-shaped decode step.

:func:`use_c_attention` registers two implementations with transformers, ``specmoe_sdpa`` and
``specmoe_eager``, and switches a model from ``sdpa`` / ``eager`` to the matching one.  Each runs
inputs of at most ``max_tokens`` query tokens on CPU tensors (decode, speculative verification)
through the C kernel -- multi-head, grouped-query or multi-query attention over the KV cache as
transformers keeps it, the mask as transformers builds it for the original implementation, f32
arithmetic with one online softmax (``csrc/kernels/mha.c``) on specmoe's kernel threads -- and
hands everything else (prefill, training, attention sinks, soft-capping, other devices and
dtypes) to the original function, so prefill and the cache stay transformers' own.
"""
from __future__ import annotations

import math
import sys
from typing import Any

import torch
from torch import nn

from . import _C
from .kernels import tensor_array
from .mla import _mask_bias, _mask_readable

__all__ = ["ATTENTION_MAX_TOKENS", "use_c_attention"]

# Query tokens up to which the C kernel runs (decode and verification chunks); longer inputs
# are prefill, where torch's attention is the better kernel.
ATTENTION_MAX_TOKENS = 16
_OURS = {"sdpa": "specmoe_sdpa", "eager": "specmoe_eager"}
# keyword arguments that change what attention computes: with any of them set, the original
_UNSUPPORTED = ("s_aux", "sinks", "softcap", "head_mask", "position_bias")


def _original(name: str, module: nn.Module) -> Any:
    """The attention function the implementation ``name`` stands for, for ``module``'s model
    (``eager`` is each model file's own ``eager_attention_forward``)."""
    if name == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    return ALL_ATTENTION_FUNCTIONS[name]


def _c_attention(orig_name: str) -> Any:
    def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, attention_mask: torch.Tensor | None,
                  dropout: float = 0.0, scaling: float | None = None, **kwargs: Any) -> Any:
        kernel = getattr(module, "_specmoe_attn", None)
        B, H, T, D = query.shape
        if (kernel is None or T > ATTENTION_MAX_TOKENS or module.training or dropout
                or query.device.type != "cpu" or key.dtype not in (torch.float32, torch.bfloat16)
                or value.dtype != key.dtype or key.shape != value.shape
                or any(kwargs.get(k) is not None for k in _UNSUPPORTED)
                or not _mask_readable(attention_mask, T)
                or (attention_mask is not None and attention_mask.shape[1] != 1)):
            return _original(orig_name, module)(module, query, key, value, attention_mask,
                                                dropout=dropout, scaling=scaling, **kwargs)
        S = key.shape[2]
        if attention_mask is None and not getattr(module, "is_causal", True):
            bias = None
        else:
            bias = _mask_bias(attention_mask, T, S, torch.float32)
            if bias is not None:
                bias = bias.reshape(bias.shape[0], T, S).contiguous().numpy()
        k, v = key, value
        if k.stride(-1) != 1 or k.stride(-2) != D:
            k = k.contiguous()
        if v.stride() != k.stride():
            v = v.contiguous()
            k = k.contiguous()
        out = torch.empty(B, T, H, D, dtype=torch.float32)
        kernel.forward(query.float().contiguous().numpy(), tensor_array(k), tensor_array(v), bias, out.numpy(),
                       float(scaling if scaling is not None else 1.0 / math.sqrt(D)))
        return out.to(query.dtype), None
    attention.__name__ = f"specmoe_c_attention_over_{orig_name}"
    return attention


def _register() -> None:
    """Make the two implementations known to transformers (idempotent)."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    for orig, ours in _OURS.items():
        if ours not in ALL_ATTENTION_FUNCTIONS:
            AttentionInterface.register(ours, _c_attention(orig))
        if ours not in ALL_MASK_ATTENTION_FUNCTIONS:
            # the original implementation's mask, so the fallback sees what it always saw
            AttentionMaskInterface.register(ours, ALL_MASK_ATTENTION_FUNCTIONS[orig])


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    """Modules that call the attention interface: the ones with q/k/v projections and a
    ``layer_idx`` (transformers' decoder attention classes), MLA excluded (specmoe.mla)."""
    from .mla import is_mla_attention
    return [m for m in model.modules()
            if hasattr(m, "layer_idx") and hasattr(m, "o_proj") and not is_mla_attention(m)
            and (hasattr(m, "q_proj") or hasattr(m, "qkv_proj"))]


def use_c_attention(model: nn.Module, ctx: _C.KernelContext | None = None) -> str | None:
    """Run ``model``'s attention through the C kernel at decode sizes (module docstring).

    Returns the implementation now in use (``"specmoe_sdpa"`` / ``"specmoe_eager"``), or None
    when nothing changed: an implementation other than sdpa/eager (flash, flex), a model that
    cannot switch implementations, or no attention module found.  Idempotent.
    """
    cfg = getattr(model, "config", None)
    impl = getattr(cfg, "_attn_implementation", None)
    if impl in _OURS.values():
        return impl
    if impl not in _OURS or not hasattr(model, "set_attn_implementation"):
        return None
    mods = _attention_modules(model)
    if not mods:
        return None
    if ctx is None:
        from .kernels import context
        ctx = context()
    _register()
    kernel = _C.AttnDecode(ctx)
    model.set_attn_implementation(_OURS[impl])
    if cfg._attn_implementation != _OURS[impl]:      # transformers refused: leave it as it was
        return None
    for m in mods:
        m._specmoe_attn = kernel
    return _OURS[impl]

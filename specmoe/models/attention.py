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
transformers keeps it, the mask as transformers builds it for the original implementation,
GPT-OSS's attention sinks (``s_aux``), f32 arithmetic with one online softmax
(``csrc/kernels/mha.c``) on specmoe's kernel threads -- and hands everything else (prefill,
training, soft-capping, other devices and dtypes) to the original function, so prefill and the
cache stay transformers' own.

:func:`fuse_attention` goes one step further for the Llama-family attention modules whose
projections are specmoe's (:class:`specmoe.models.layers.CLinear`): at decode sizes the whole module
runs in two C calls around transformers' KV-cache update (``specmoe._C.AttnBlock``): the q/k/v
projections, OLMoE's / Qwen3's q and k RMSNorms and the rotary embedding in one, attention and
the output projection in the other -- instead of some thirty torch operations, each a few
microseconds of dispatch at one token.  A bf16 model's intermediate roundings are reproduced
step by step (``csrc/kernels/block.h``).
"""
from __future__ import annotations

import contextlib
import math
import sys
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from .. import _C
from ..runtime.kernels import tensor_array
from .arch import (FUSABLE_ATTENTION, FUSABLE_LAYERS, GATED_ATTENTION, PAIRS_ROPE_ATTENTION,
                   SINK_ATTENTION)
from .layers import (BLOCK_DTYPES, BlockRoute, ChainStep, CLinear, CRMSNorm, adapter_active,
                     chain_step, decode_route, dense_in_call, fuse_qkv, rms_norm_form,
                     set_chain_step, set_dense_mlp, silu_mlp_parts)
from ..runtime.kvcache import kv_advance, kv_append, kv_buffers
from .mla import mask_bias, mask_readable, per_step_rope

__all__ = ["ATTENTION_MAX_TOKENS", "BLOCK_MAX_TOKENS", "convert_norms", "fuse_attention",
           "use_c_attention"]

# Query tokens up to which the C kernel runs (decode and verification chunks); longer inputs
# are prefill, where torch's attention is the better kernel.
ATTENTION_MAX_TOKENS = 16
# tokens of one fused-block call in all, a batch's rows together (serve's verification of 16
# rows of K + 1 tokens); the block's buffers start at 16 tokens and grow on first use
BLOCK_MAX_TOKENS = 64
_OURS = {"sdpa": "specmoe_sdpa", "eager": "specmoe_eager"}
# keyword arguments that change what attention computes: with any of them set, the original
# (GPT-OSS's attention sinks, ``s_aux`` [heads], the C kernel takes: attn.h)
_UNSUPPORTED = ("sinks", "softcap", "head_mask", "position_bias")


def _original(name: str, module: nn.Module) -> Any:
    """The attention function the implementation ``name`` stands for, for ``module``'s model
    (``eager`` is each model file's own ``eager_attention_forward``)."""
    if name == "eager":
        return sys.modules[type(module).__module__].eager_attention_forward
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    return ALL_ATTENTION_FUNCTIONS[name]


def _bias_array(mask: torch.Tensor | None, T: int, S: int) -> np.ndarray | None:
    """transformers' mask as the C attention kernels take it: additive float32 [1 or B, T, S],
    or None when nothing is masked."""
    bias = mask_bias(mask, T, S, torch.float32)
    return None if bias is None else bias.reshape(bias.shape[0], T, S).contiguous().numpy()


def _c_attention(orig_name: str) -> Any:
    def attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor,
                  value: torch.Tensor, attention_mask: torch.Tensor | None,
                  dropout: float = 0.0, scaling: float | None = None, **kwargs: Any) -> Any:
        kernel = getattr(module, "_specmoe_attn", None)
        B, H, T, D = query.shape
        s_aux = kwargs.get("s_aux")
        if (kernel is None or T > ATTENTION_MAX_TOKENS or module.training or dropout
                or query.device.type != "cpu" or key.dtype not in (torch.float32, torch.bfloat16)
                or value.dtype != key.dtype or key.shape != value.shape
                or any(kwargs.get(k) is not None for k in _UNSUPPORTED)
                or (s_aux is not None and (s_aux.shape != (H,) or s_aux.device.type != "cpu"))
                or not mask_readable(attention_mask, T)
                or (attention_mask is not None and attention_mask.shape[1] != 1)):
            return _original(orig_name, module)(module, query, key, value, attention_mask,
                                                dropout=dropout, scaling=scaling, **kwargs)
        S = key.shape[2]
        if attention_mask is None and not getattr(module, "is_causal", True):
            bias = None
        else:
            bias = _bias_array(attention_mask, T, S)
        k, v = key, value
        if k.stride(-1) != 1 or k.stride(-2) != D:
            k = k.contiguous()
        if v.stride() != k.stride():
            v = v.contiguous()
            k = k.contiguous()
        out = torch.empty(B, T, H, D, dtype=torch.float32)
        sinks = None if s_aux is None else s_aux.detach().float().contiguous().numpy()
        kernel.forward(query.float().contiguous().numpy(), tensor_array(k), tensor_array(v),
                       bias, out.numpy(),
                       float(scaling if scaling is not None else 1.0 / math.sqrt(D)), sinks)
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
    ``layer_idx`` (transformers' decoder attention classes), MLA excluded (specmoe.models.mla)."""
    from .mla import is_mla_layout
    return [m for m in model.modules()
            if hasattr(m, "layer_idx") and hasattr(m, "o_proj") and not is_mla_layout(m)
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
        from ..runtime.kernels import context
        ctx = context()
    _register()
    kernel = _C.AttnDecode(ctx)
    model.set_attn_implementation(_OURS[impl])
    if cfg._attn_implementation != _OURS[impl]:      # transformers refused: leave it as it was
        return None
    for m in mods:
        m._specmoe_attn = kernel
    return _OURS[impl]


def convert_norms(model: nn.Module) -> list[str]:
    """Replace every Llama-form, zero-centred or f32-scaled RMSNorm module of ``model`` by a
    :class:`CRMSNorm` (the final norm, MLA's latent norm, and the layer norms of decoder layers
    that are not fused); returns their qualified names.  Idempotent."""
    done = []
    for name, mod in list(model.named_modules()):
        if isinstance(mod, CRMSNorm) or not name or rms_norm_form(mod) is None:
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if isinstance(parent, CRMSNorm):                  # an earlier call's inner module
            continue
        setattr(parent, attr, CRMSNorm(mod))
        done.append(name)
    return done


def _rotary_dim(cfg: Any, D: int) -> int:
    """The rotary width of a head as transformers' default rotary embedding computes it:
    ``int(head_dim * partial_rotary_factor)`` (rope_parameters first)."""
    rp = getattr(cfg, "rope_parameters", None)
    f = rp.get("partial_rotary_factor") if isinstance(rp, dict) else None
    if f is None:
        f = getattr(cfg, "partial_rotary_factor", None) or 1.0
    return int(D * float(f))


class BlockForm(NamedTuple):
    """What a fused attention module's ``_C.AttnBlock`` was built for, kept beside it as the
    module's ``_specmoe_block_form`` (read in this file only)."""

    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    dtype: torch.dtype  # the block's input, output and KV dtype
    rot: int  # the width of the rotary cos and sin
    zero_centred: bool  # its norms' form, which the decoder layer's norms must share
    gated: bool  # Qwen3-Next's / Qwen3.5's output gate (the block runs whole layers only)
    half_rope: bool  # cos / sin half a head wide (GPT-OSS, _full_width_rope)
    scaling: float  # the softmax scale


def fuse_attention(model: nn.Module, ctx: _C.KernelContext | None = None) -> list[str]:
    """Run each fusable attention module of ``model`` through one ``specmoe._C.AttnBlock`` at
    decode sizes (module docstring); returns the qualified names of the modules switched.

    A module is fusable when its class is one of the Llama-family forms listed in
    ``specmoe.models.arch.FUSABLE_ATTENTION``, it runs the C attention (:func:`use_c_attention`),
    its four projections are :class:`specmoe.models.layers.CLinear`, its q/k norms (if the form has
    them) are plain RMSNorms, nothing clips q/k/v, and the model's weights are f32 or bf16.
    Everything the block does not cover at call time -- more than ``ATTENTION_MAX_TOKENS``
    tokens per row or ``BLOCK_MAX_TOKENS`` in all (a batch of B rows of T tokens counts B * T:
    serve's decode batch and its verification steps run through the block, each row its own
    positions, cache row and mask), another device or
    dtype, a mask or argument the C attention does not read, training -- goes to the module's
    own forward.

    The decoder layers around fused modules, when of a ``specmoe.models.arch.FUSABLE_LAYERS`` form
    with plain RMSNorms, fold their input norm, first residual add and post-attention norm into the
    block's calls; and when their MoE block routes in C (``Engine._install_routing``) and the
    KV cache is transformers' ``DynamicCache``, a decode step of the layer is one C call
    (``_C.AttnBlock.layer``: the block, the new positions written into the cache's buffers
    (:func:`specmoe.runtime.kvcache.kv_buffers`), the MoE block, the residual adds); so is a
    step of a dense layer (GLM-4.5's first layers, ERNIE-4.5's) whose SiLU MLP's projections
    are CLinear of the block's dtype (the block's ``set_mlp``).

    Qwen3-Next's and Qwen3.5's gated attention (``specmoe.models.arch.GATED_ATTENTION``: q_proj
    with a gate per head, zero-centred norms, a partial rotary) runs only as that one-call
    layer: its steps that cannot (a cache other than a DynamicCache, a MoE block routing in
    Python) take the layer's and the module's own forwards, over the C projections and the C
    attention kernel.  GPT-OSS's attention (``specmoe.models.arch.SINK_ATTENTION``) takes its
    sinks into the block, its half-table rotary as the rotate-half form's (each half of cos and
    sin repeated: :func:`_full_width_rope`) and its decoder's f32-scaled norms as the block's
    zero-centred form; its sliding-window layers, whose cache (transformers' sliding one) has
    no buffers to write into, run pre and post around that cache's update.  ERNIE-4.5's
    (``specmoe.models.arch.PAIRS_ROPE_ATTENTION``) turns each head's pairs (x[2i], x[2i+1])
    in place: the block's ``rope="pairs"``, on the same (cos, sin).  Idempotent."""
    if ctx is None:
        from ..runtime.kernels import context
        ctx = context()
    done = []
    for name, m in model.named_modules():
        form = FUSABLE_ATTENTION.get(type(m).__name__)
        if form is None or getattr(m, "_specmoe_block", None) is not None:
            if getattr(m, "_specmoe_block", None) is not None:
                done.append(name)
            continue
        projs = [getattr(m, p, None) for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
        if getattr(m, "_specmoe_attn", None) is None or not all(isinstance(p, CLinear)
                                                                for p in projs):
            continue
        dt = projs[0].out_dtype
        if dt not in BLOCK_DTYPES or getattr(m.config, "clip_qkv", None) is not None:
            continue
        cfg = m.config
        D = int(m.head_dim)
        H = int(cfg.num_attention_heads)
        Hkv = int(getattr(cfg, "num_key_value_heads", None) or H)
        gated = type(m).__name__ in GATED_ATTENTION
        if getattr(m, "q_norm", None) is None and getattr(m, "k_norm", None) is None \
                and getattr(m, "use_qk_norm", True) is False:
            form = "none"  # (GLM-4.5's q/k norms are optional)
        kw: dict[str, Any] = {"norm": form, "rotary_dim": _rotary_dim(cfg, D)}
        if gated:
            kw["gate"] = True
        if type(m).__name__ in PAIRS_ROPE_ATTENTION:
            kw["rope"] = "pairs"
        sinks = type(m).__name__ in SINK_ATTENTION
        if sinks:  # GPT-OSS: its sinks, and its decoder's f32-scaled norms (the zc form)
            if getattr(m, "sinks", None) is None:
                continue
            kw["sinks"] = np.ascontiguousarray(m.sinks.detach().float().numpy())
            kw["zero_centred"] = True
        if form != "none":
            qn = rms_norm_form(getattr(m, "q_norm", None))
            kn = rms_norm_form(getattr(m, "k_norm", None))
            if qn is None or kn is None or qn[1:] != kn[1:]:
                continue
            kw.update(q_norm=qn[0], k_norm=kn[0], eps=qn[1], zero_centred=qn[2])
        kw["qkv"] = fuse_qkv(projs[:3], ctx)
        try:
            blk = _C.AttnBlock(ctx, *(p._c for p in projs), H, Hkv, D,
                               bf16=dt == torch.bfloat16, max_tokens=BLOCK_MAX_TOKENS, **kw)
        except (ValueError, TypeError):
            continue  # shapes this form does not have (e.g. a head_dim the config disagrees on)
        m._specmoe_block = blk
        m._specmoe_block_form = BlockForm(
            H, Hkv, D, int(projs[3].out_features), dt, int(kw.get("rotary_dim") or D),
            bool(kw.get("zero_centred")), gated, sinks,
            float(getattr(m, "scaling", None) or 1.0 / math.sqrt(D)))
        if not gated:  # (a gated block runs whole layers only)
            m.forward = _fused_forward(m, m.forward)
        done.append(name)
    for layer in model.modules():
        attn = getattr(layer, "self_attn", None)
        if type(layer).__name__ not in FUSABLE_LAYERS or attn is None \
                or getattr(attn, "_specmoe_block", None) is None \
                or chain_step(layer) is not None:  # fused already
            continue
        ln = [rms_norm_form(getattr(layer, n, None))
              for n in ("input_layernorm", "post_attention_layernorm")]
        zc = attn._specmoe_block_form.zero_centred
        if ln[0] is None or ln[1] is None or ln[0][2] != zc \
                or ln[1][2] != zc:  # (the block's one norm form)
            continue
        # a dense layer (GLM-4.5's first layers, ERNIE-4.5's): its MLP in the block's call
        dense = None if hasattr(layer.mlp, "experts") or attn._specmoe_block_form.gated \
            else silu_mlp_parts(layer.mlp)
        if dense is not None and dense[1] != attn._specmoe_block_form.dtype:
            dense = None
        set_dense_mlp(layer, dense)
        if dense is not None:
            attn._specmoe_block.set_mlp(dense[0])
        layer.forward = _fused_layer_forward(layer, layer.forward)
        set_chain_step(layer, ChainStep(chain_call, chain_rope,
                                        norms=(ln[0][0], ln[0][1], ln[1][0], ln[1][1])))
    return done


_HALF_LAST: tuple = (None, None)  # (the last half-table rotary, its full-width form)


def _full_width_rope(module: nn.Module, pe: Any) -> Any:
    """The position embeddings the block takes for ``module``: pe itself, or for a rotary
    whose cos / sin are half a head wide and turn a head's two halves (GPT-OSS's
    ``_apply_rotary_emb``: first * cos - second * sin, second * cos + first * sin) the
    rotate-half form's, each repeated -- the same products, rounded alike.  Made once per
    decode step (the entry holds pe, so its identity is not reused while kept)."""
    global _HALF_LAST
    form = getattr(module, "_specmoe_block_form", None)
    if pe is None or form is None or not form.half_rope:
        return pe
    last = _HALF_LAST
    if last[0] is pe:
        return last[1]
    full = tuple(torch.cat((p, p), -1) for p in pe)
    _HALF_LAST = (pe, full)
    return full


def _rows_rope(pe: Any, B: int, T: int, R: int) -> tuple:
    """cos, sin [B * T, R] (contiguous) of B rows of T tokens, each row at its own positions,
    from the position embeddings pe ([1 or B, T, R] each, as _decodable checked)."""
    return tuple(p.expand(B, T, R).reshape(B * T, R).contiguous() for p in pe)


def _layer_args(layer: nn.Module, x: torch.Tensor, out: torch.Tensor, pe: Any,
                attention_mask: Any, bufs: tuple, route: BlockRoute | None) -> tuple:
    """The arguments of ``_C.AttnBlock.layer`` for B rows of T tokens x [B, T, hidden] into
    out (the same shape and dtype, another tensor) on the KV buffers ``bufs`` (kv_buffers,
    [B, ...]) and the Engine route ``route`` (decode_route), or None for a dense layer's MLP
    (dense_in_call)."""
    attn = layer.self_attn
    form = attn._specmoe_block_form
    hidden, R = form.hidden, form.rot
    _, _, _, ka, va, S = bufs
    layers, pos, flags = (None, -1, 0) if route is None \
        else (route.engine.layers, route.pos, route.flags)
    B, T = x.shape[0], x.shape[1]
    if B == 1:
        cos, sin = per_step_rope(pe, T, R, lambda: tuple(a for _, a in chain_rope(layer, pe, T)))
    else:  # each row at its own positions (_decodable checked pe [1 or B, T, R])
        cos, sin = (tensor_array(p) for p in _rows_rope(pe, B, T, R))
    ln1, e1, ln2, e2 = chain_step(layer).norms
    return (layers, pos, flags, tensor_array(x.reshape(B * T, hidden).contiguous()), cos,
            sin, ka, va, S, _bias_array(attention_mask, T, S + T), form.scaling, ln1,
            e1, ln2, e2, tensor_array(out.view(B * T, hidden)))


def _layer_call(layer: nn.Module, x: torch.Tensor, pe: Any, attention_mask: Any, bufs: tuple,
                route: BlockRoute | None) -> torch.Tensor:
    """A whole decoder layer of T tokens in one C call (``_C.AttnBlock.layer``): the attention
    block with its norms and residual add, the new positions written straight into the KV
    buffers, the MoE block routed in C (route; None: a dense layer's MLP, set_mlp), the
    second residual add."""
    out = torch.empty(x.shape, dtype=x.dtype)
    # the Engine's layers are read inside: set_cache swaps them
    slot = contextlib.nullcontext() if route is None else route.engine.layer_call_slot()
    with slot:
        layer.self_attn._specmoe_block.layer(*_layer_args(layer, x, out, pe, attention_mask,
                                                          bufs, route))
    kv_advance(bufs, x.shape[1])
    return out


def chain_rope(layer: nn.Module, pe: Any, T: int) -> tuple:
    """The rotary arrays among ``_C.AttnBlock.layer``'s arguments for the last T positions of
    the decoder's position embeddings ``pe`` (cos, sin): ((index, array), ...).  Over a table
    of every position they are a ``_C.DecodePlan``'s rotary tables (specmoe.models.decode_step)."""
    R = layer.self_attn._specmoe_block_form.rot
    cos, sin = (tensor_array(p.reshape(-1, R)[-T:].contiguous()) for p in pe)
    return ((4, cos), (5, sin))


def chain_call(layer: nn.Module, x: torch.Tensor, out: torch.Tensor, pe: Any,
               cache: Any) -> tuple | None:
    """One decode step of a fused decoder layer as an item of ``_C.layer_chain``: (block,
    ``layer()`` arguments, KV buffers, Engine) for x [1, T, hidden] into out with no mask
    (every cached position seen), or None when the step must take the layer's forward (the
    checks of that forward; a block that is not a plain ``_C.AttnBlock``).  A dense layer
    whose MLP the block runs (set_mlp) is an item too, with no Engine."""
    attn = layer.self_attn
    blk = attn._specmoe_block
    if type(blk) is not _C.AttnBlock or layer.training or attn._specmoe_block_form.half_rope \
            or not _decodable(attn, x, pe, None, {}):
        return None  # (a half-table rotary's model is no DecodePlan model)
    route = decode_route(layer, x)
    if route is None and not dense_in_call(layer, x.shape[1]):
        return None
    bufs = kv_buffers(cache, attn.layer_idx, x.shape[1])
    if bufs is None:
        return None
    return (blk, _layer_args(layer, x, out, pe, None, bufs, route), bufs,
            None if route is None else route.engine)


def _decodable(module: nn.Module, x: torch.Tensor, pe: Any, attention_mask: Any,
               kwargs: dict[str, Any]) -> bool:
    """Whether the attention block serves this call of ``module`` (else its own forward)."""
    form = module._specmoe_block_form
    dt, R = form.dtype, form.rot
    B, T = x.shape[0], x.shape[1]   # a batch of B sequences (serve's decode batch) in one call
    return not (T > ATTENTION_MAX_TOKENS or B * T > BLOCK_MAX_TOKENS or x.dtype != dt
                or x.device.type != "cpu" or module.training or pe is None
                or pe[0].shape[-1] != R or pe[0].dtype not in BLOCK_DTYPES
                or (B > 1 and (pe[0].dim() != 3 or pe[0].shape[0] not in (1, B)
                               or pe[0].shape[1] != T or pe[1].shape != pe[0].shape))
                or pe[1].dtype != pe[0].dtype
                or any(kwargs.get(k) is not None for k in _UNSUPPORTED + ("s_aux",))
                or not mask_readable(attention_mask, T)
                or (attention_mask is not None and attention_mask.shape[1] != 1)
                or adapter_active(module))  # an MTP forward's masks: the LoRA in torch


def _block_call(module: nn.Module, x: torch.Tensor, pe: Any, attention_mask: Any, cache: Any,
                kwargs: dict[str, Any], norms: tuple | None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One attention module of T <= ATTENTION_MAX_TOKENS tokens per row (B * T <=
    BLOCK_MAX_TOKENS in all) through its AttnBlock: pre,
    transformers' cache update, post.  norms None: returns (attention output, None); else
    (input_layernorm w, eps, post_attention_layernorm w, eps): x is the decoder layer's input,
    the input norm runs first, and the return is (x + attention output, its post-attention
    norm)."""
    blk = module._specmoe_block        # looked up at each call: one attribute read, and
    form = module._specmoe_block_form  # tests may wrap it
    H, Hkv, D, hidden, dt, R = form[:6]
    B, T = x.shape[0], x.shape[1]      # B rows: every row's tokens are the block's B * T
    if B == 1:
        cos, sin = (p.reshape(-1, R)[-T:] for p in pe)
    else:  # each row at its own positions ([1 or B, T, R], _decodable checked)
        cos, sin = _rows_rope(pe, B, T, R)
    q = torch.empty(B, H, T, D, dtype=torch.float32)
    k = torch.empty(B, Hkv, T, D, dtype=dt)
    v = torch.empty(B, Hkv, T, D, dtype=dt)
    xa = tensor_array(x.reshape(B * T, hidden).contiguous())
    if norms is None:
        blk.pre(xa, tensor_array(cos.contiguous()), tensor_array(sin.contiguous()), q.numpy(),
                tensor_array(k), tensor_array(v))
    else:
        blk.pre(xa, tensor_array(cos.contiguous()), tensor_array(sin.contiguous()), q.numpy(),
                tensor_array(k), tensor_array(v), norms[0], norms[1])
    if cache is not None:
        k, v = kv_append(cache, module.layer_idx, k, v, kwargs)
    S = k.shape[2]
    bias = _bias_array(attention_mask, T, S)
    if k.stride(-1) != 1 or k.stride(-2) != D or v.stride() != k.stride():
        k, v = k.contiguous(), v.contiguous()
    out = torch.empty(B, T, hidden, dtype=dt)
    if norms is None:
        blk.post(q.numpy(), tensor_array(k), tensor_array(v), bias, form.scaling,
                 tensor_array(out.view(B * T, hidden)))
        return out, None
    normed = torch.empty(B, T, hidden, dtype=dt)
    blk.post(q.numpy(), tensor_array(k), tensor_array(v), bias, form.scaling,
             tensor_array(out.view(B * T, hidden)), xa, norms[2], norms[3],
             tensor_array(normed.view(B * T, hidden)))
    return out, normed


def _fused_forward(module: nn.Module, original: Any) -> Any:
    """``module``'s forward with its decode steps through its AttnBlock."""
    def forward(hidden_states: torch.Tensor, position_embeddings: Any = None,
                attention_mask: torch.Tensor | None = None, cache: Any = None,
                **kwargs: Any) -> Any:
        if cache is None:
            cache = kwargs.pop("past_key_values", None)
        pe = _full_width_rope(module, position_embeddings)
        if not _decodable(module, hidden_states, pe, attention_mask, kwargs):
            return original(hidden_states=hidden_states, position_embeddings=position_embeddings,
                            attention_mask=attention_mask, cache=cache, **kwargs)
        return _block_call(module, hidden_states, pe, attention_mask, cache, kwargs, None)
    forward.__name__ = f"specmoe_fused_{type(module).__name__}_forward"
    return forward


def _fused_layer_forward(layer: nn.Module, original: Any) -> Any:
    """A decoder layer's forward (a ``specmoe.models.arch.FUSABLE_LAYERS`` form) with its decode steps
    as: the attention block with the input norm, the residual add and the post-attention norm
    folded into its two calls; then the layer's own ``mlp`` and the second residual add in
    torch (or all of it in one call, see :func:`fuse_attention`)."""
    attn = layer.self_attn

    def forward(hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: Any = None, cache: Any = None, use_cache: Any = False,
                position_embeddings: Any = None, **kwargs: Any) -> Any:
        if cache is None:
            cache = kwargs.pop("past_key_values", None)
        pe = _full_width_rope(attn, position_embeddings)
        if layer.training or not _decodable(attn, hidden_states, pe, attention_mask, kwargs):
            return original(hidden_states, attention_mask=attention_mask,
                            position_ids=position_ids, cache=cache, use_cache=use_cache,
                            position_embeddings=position_embeddings, **kwargs)
        route = decode_route(layer, hidden_states)
        if route is not None or dense_in_call(layer, hidden_states.shape[1]):
            # (a sliding-window layer's cache has no buffers: two calls)
            bufs = kv_buffers(cache, attn.layer_idx, hidden_states.shape[1], rows=True)
            if bufs is not None:
                return _layer_call(layer, hidden_states, pe, attention_mask, bufs, route)
        # a gated block runs whole layers only: here the module's own forward in the layer's
        if attn._specmoe_block_form.gated:
            return original(hidden_states, attention_mask=attention_mask,
                            position_ids=position_ids, cache=cache, use_cache=use_cache,
                            position_embeddings=position_embeddings, **kwargs)
        kwargs["position_ids"] = position_ids
        kwargs["use_cache"] = use_cache
        h, normed = _block_call(attn, hidden_states, pe, attention_mask, cache, kwargs,
                                chain_step(layer).norms)
        out = layer.mlp(normed)
        return h + (out[0] if isinstance(out, tuple) else out)  # (GPT-OSS's: (out, scores))
    forward.__name__ = f"specmoe_fused_{type(layer).__name__}_forward"
    return forward

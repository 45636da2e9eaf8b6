"""Multi-head latent attention (DeepSeek-V2/V3) decoded in the absorbed form.

transformers caches MLA's compressed latent ``c_KV`` (``kv_lora_rank`` wide, after
``kv_a_layernorm``) and the shared rotary key, but at every step it expands the *whole* cached
latent back into per-head keys and values with ``kv_b_proj`` (DeepSeek-V2 paper, Sec. 2.1.2,
Eq. 10-11): a ``[S, r] x [r, H*(d_nope+d_v)]`` product whose cost grows with the context and
that, on DeepSeek-V2-Lite shapes on a CPU, is about half of a decode step.

The same paper (Sec. 2.1.2, "during inference ... W^UK can be absorbed into W^Q, and W^UV
into W^O") gives the decode form used here, per head h:

    q_lat_h = W^UK_h^T q^C_h                       (d_nope -> r)
    score_h(j) = q_lat_h . c_j + q^R_h . k^R_j      (no per-position key expansion)
    o_lat_h = sum_j softmax(score_h)(j) c_j         (r wide)
    o_h = W^UV_h o_lat_h                            (r -> d_v), then W^O as before

which reads ``kv_b_proj``'s weight once per step and the cached latent once per head group,
whatever the context length.  Scores are the same numbers as the expanded form's up to
rounding: (W^UK_h^T q_h) . c_j = q_h . (W^UK_h c_j).

:func:`absorb_mla` installs this on every MLA attention module of a model for inputs of at
most ``max_tokens`` tokens (decode and speculative verification); longer inputs (prefill),
training mode and attention masks it cannot read go to the module's own forward, so the KV
cache layout is transformers' own and both paths share it.

The absorbed attention itself (scores, softmax, the two per-head products) runs in C
(``specmoe._C.MLADecode``, ``csrc/kernels/mla.c``) on the kernel context's threads, for CPU
tensors with an f32 or bf16 cache.  At DeepSeek-V2-Lite shapes (16 heads, r = 512, bf16, 97
cached positions) it takes 0.19-0.22 ms per layer on one thread against 0.24-0.27 ms for the
same algebra in torch, and 0.09-0.11 ms on two threads, where torch runs single-threaded
during decode (specmoe.models.dense.DecodeThreads); at 512 positions on one thread torch's bf16 GEMMs
are faster (0.4 against 0.5 ms).  It reads bf16 caches and f32/bf16/int8/int4 weights
directly and computes in f32.  Other cases (a CUDA model, an f16 cache) take the same algebra
in torch (:func:`_attend_torch`).
"""
from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass
from typing import Any, Callable, NamedTuple

import numpy as np
import torch
from torch import nn

from .. import _C
from ..runtime.kernels import GGUF_BLOCKS, dtype_code, tensor_array
from ..runtime.kvcache import kv_advance, kv_append, kv_buffers
from .layers import (ChainStep, CLinear, adapter_active, chain_step, decode_route,
                     dense_in_call, dense_mlp, fuse_qkv, int4_group, norm_weight,
                     set_chain_step, set_dense_mlp, silu_mlp_parts)
from ..storage.ggml_blocks import dequantize
from ..storage.quant import quantize_int4, quantize_int8

__all__ = ["MLA_MAX_TOKENS", "MlaState", "absorb_mla", "fuse_mla", "int4_values",
           "is_mla_attention", "is_mla_layout"]

# Inputs up to this many tokens take the absorbed path: the absorbed form's per-query work
# is r/(d_nope) ~ 4x the expanded form's, so for long inputs (prefill) expanding the latent
# once is cheaper; at decode and verification sizes the expansion of the whole context
# dominates.
MLA_MAX_TOKENS = 16
# A fused layer's call takes B rows (a batched decode or verification step: serve's continuous
# batch, generate's speculative batch) of at most MLA_MAX_TOKENS tokens each, and at most this
# many tokens in all (the GQA block's bound, attention.BLOCK_MAX_TOKENS); its buffers grow to
# the largest call seen.
MLA_BLOCK_MAX_TOKENS = 64
# masked scores: the most negative finite f32, as transformers' eager masks, so that a query
# row with every key masked (a left-padding position) gets finite uniform weights, not NaN
_NEG = torch.finfo(torch.float32).min


def is_mla_attention(mod: nn.Module) -> bool:
    """True for a transformers MLA attention module of DeepSeek-V2/V3's form
    (``specmoe.models.arch.MLA_ATTENTION``): ``kv_b_proj`` expanding a ``kv_lora_rank``
    latent, and the head dimensions the absorbed form needs."""
    from .arch import MLA_ATTENTION
    return type(mod).__name__ in MLA_ATTENTION and is_mla_layout(mod)


def is_mla_layout(mod: nn.Module) -> bool:
    """True for any module laid out as multi-head latent attention (``kv_b_proj`` expanding a
    ``kv_lora_rank`` latent, and the head dimensions), whatever its forward: the GQA paths
    (specmoe.models.attention) leave all of them alone."""
    return (hasattr(mod, "kv_b_proj") and hasattr(mod, "kv_a_proj_with_mqa")
            and hasattr(mod, "kv_a_layernorm") and hasattr(mod, "qk_nope_head_dim")
            and hasattr(mod, "v_head_dim") and hasattr(mod, "kv_lora_rank")
            and hasattr(mod, "qk_rope_head_dim") and hasattr(mod, "scaling"))


def _kv_b_weight(mod: nn.Module) -> torch.Tensor | None:
    """kv_b_proj's float weight [H*(d_nope+d_v), r]: an nn.Linear's, or the tensor a
    CLinear's f32/bf16 kernel reads (the same memory); None for an int8/int4 CLinear."""
    kv_b = mod.kv_b_proj
    w = getattr(kv_b, "weight", None)
    if w is None:
        w = getattr(kv_b, "weight_view", None)
    return w if isinstance(w, torch.Tensor) else None


def int4_values(packed: np.ndarray) -> np.ndarray:
    """int4 rows packed as :func:`specmoe.storage.quant.quantize_int4` packs them (column 2j in the low
    nibble of byte j, value u - 8) as the MLA kernel holds them: one int8 value in [-8, 7] per
    column (``csrc/kernels/attn.h`` says why)."""
    p = np.asarray(packed, dtype=np.uint8)
    q = np.empty(p.shape[:-1] + (2 * p.shape[-1],), dtype=np.int8)
    q[..., 0::2] = (p & 15).astype(np.int8) - 8
    q[..., 1::2] = (p >> 4).astype(np.int8) - 8
    return q


@dataclass(eq=False)
class MlaState:
    """What :func:`absorb_mla` keeps on an MLA attention module, as its ``_specmoe_mla`` (read
    in this file only): the settings of its absorbed decode form and what it wraps."""

    ctx: Any = None  # the C kernel context, None for the torch path
    fmt: str | None = None  # the absorbed weights' format: None, "int8", "int4" or "gguf"
    blocks: tuple | None = None  # a GGUF file's attn_k_b / attn_v_b blocks and kinds ("gguf")
    weights: "_Absorbed | None" = None  # the absorbed weights (_absorbed builds them)
    max_tokens: int = 0  # the most tokens a forward takes the absorbed path for
    orig_forward: Callable[..., Any] | None = None  # transformers' forward it wraps


_NO_STATE = MlaState()  # what a module never absorbed reads as (never written)


def _state_of(mod: nn.Module) -> MlaState:
    """``mod``'s MlaState to read (an empty one, not stored, when it has none)."""
    return mod.__dict__.get("_specmoe_mla") or _NO_STATE


def _own_state(mod: nn.Module) -> MlaState:
    """``mod``'s MlaState to write, made on first use."""
    st = mod.__dict__.get("_specmoe_mla")
    if st is None:
        st = MlaState()
        object.__setattr__(mod, "_specmoe_mla", st)
    return st


class MlaParts(NamedTuple):
    """What a fused DeepSeek decoder layer's MLABlock is built from (:func:`fuse_mla`), kept as
    the layer's ``_specmoe_mlab_parts`` (read in this file only) so the block can be built
    again when its attention's absorbed kernel is."""

    projs: list  # the CLinear projections: (q_a, q_b | q), kv_a, o
    ctx: Any  # the C kernel context
    dtype: torch.dtype  # the layer's activations (float32 or bfloat16)
    rope: str  # the rotary form (_rope_form)


class MlaBlockRef(NamedTuple):
    """A fused layer's current MLABlock, as its ``_specmoe_mlab`` (read in this file only),
    with what it was built over: rebuilt when the attention's absorbed kernel or its token
    limit changes (:func:`_mla_block`).  Tests and benchmarks wrap ``block`` with
    ``_replace``."""

    block: Any  # the _C.MLABlock
    kernel: Any  # the absorbed _C.MLADecode it reads
    max_tokens: int  # the attention's max_tokens when it was built


class _Absorbed:
    """One module's absorbed weights: the C kernel object (None without a kernel context) and
    the float W^UK [H, d_nope, r] / W^UV [H, d_v, r] the torch path reads (built when first
    needed).  ``fmt``: None (kv_b_proj's own float dtype), "int8" or "int4" (specmoe.storage.quant's
    formats per row of kv_b_proj, the torch path reading their dequantized values), or "gguf":
    a GGUF file's attn_k_b / attn_v_b blocks (the module's ``MlaState.blocks``,
    :meth:`specmoe.storage.gguf.GgufCheckpoint.mla_blocks`), read as the file holds them."""

    def __init__(self, mod: nn.Module, w: torch.Tensor | None, fmt: str | None, ctx: Any,
                 key: Any):
        H, dn, dv, r = mod.num_heads, mod.qk_nope_head_dim, mod.v_head_dim, mod.kv_lora_rank
        self.key, self.fmt, self.ctx = key, fmt, ctx
        self.dtype = w.dtype if w is not None else torch.float32
        self._rope_dim, self._scale = mod.qk_rope_head_dim, float(mod.scaling)
        if fmt == "gguf":
            self._blocks = _state_of(mod).blocks
            k_b, _, v_b, _ = self._blocks
            if k_b.shape[:2] != (H, r) or v_b.shape[:2] != (H, dv):
                raise ValueError(f"GGUF attn_k_b {k_b.shape[:2]} / attn_v_b {v_b.shape[:2]} "
                                 f"do not fit heads {H}, kv_lora_rank {r}, v_head_dim {dv}")
            self._uk = self._uv = None
            self._device = torch.device("cpu")
            self.set_ctx(ctx)
            return
        wv = w.detach().view(H, dn + dv, r)
        uk, uv = wv[:, :dn, :], wv[:, dn:, :]
        self.kernel = None
        self._uk: torch.Tensor | None = None
        self._uv: torch.Tensor | None = None
        if fmt is None:
            # contiguous per-head copies: in kv_b_proj's layout each head's d_nope and d_v
            # rows alternate, and torch's bmm copies such strided views on every call
            self._uk, self._uv = uk.contiguous(), uv.contiguous()
            if ctx is not None and w.device.type == "cpu":
                self.kernel = _C.MLADecode(ctx, tensor_array(self._uk, True),
                                           tensor_array(self._uv, True), mod.qk_rope_head_dim,
                                           float(mod.scaling))
            return
        group = int4_group(r) if fmt == "int4" else None
        if fmt == "int4" and group is None:
            raise ValueError(f"int4 absorbed MLA weights need kv_lora_rank ({r}) divisible by "
                             "32")
        self._group = group
        self._q = [self._quantize(t.float().cpu().numpy(), fmt, group) for t in (uk, uv)]
        self._device = w.device
        self.set_ctx(ctx)

    def set_ctx(self, ctx: Any) -> None:
        """Run the C kernel on ``ctx`` (None: the torch path).  For quantized weights this
        needs no float weights (kv_b_proj may be int8/int4 by now)."""
        self.ctx = ctx
        if self.fmt is None:
            raise AssertionError("float absorbed weights are rebuilt from kv_b_proj instead")
        self.kernel = None
        if ctx is not None and self.fmt == "gguf":
            k_b, kk, v_b, vk = self._blocks
            self.kernel = _C.MLADecode(ctx, k_b, v_b, self._rope_dim, self._scale,
                                       blocks=(dtype_code(kk), dtype_code(vk)))
        elif ctx is not None and self._device.type == "cpu":
            (quk, suk), (quv, suv) = self._q
            self.kernel = _C.MLADecode(ctx, quk, quv, self._rope_dim, self._scale, suk, suv)

    @staticmethod
    def _quantize(w: np.ndarray, fmt: str, group: int | None) -> tuple[Any, Any]:
        """[H, rows, r] float -> (values, scale) as the kernel takes them: the rows quantized
        as CLinear quantizes kv_b_proj's rows (int4: one value a byte, int4_values)."""
        h, rows, r = w.shape
        flat = w.reshape(h * rows, r)
        if fmt == "int8":
            q, sc = quantize_int8(flat)
            return q.reshape(h, rows, r), sc.reshape(h, rows)
        q, sc = quantize_int4(flat, group or 0)
        return int4_values(q.reshape(h, rows, r // 2)), sc.reshape(h, rows, r // (group or 1))

    def torch_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W^UK, W^UV as float tensors for the torch path (dequantized on first use)."""
        if self._uk is None and self.fmt == "gguf":
            k_b, kk, v_b, vk = self._blocks
            uk = dequantize(k_b.reshape(k_b.shape[0] * k_b.shape[1], -1, GGUF_BLOCKS[kk][1]))
            uv = dequantize(v_b.reshape(v_b.shape[0] * v_b.shape[1], -1, GGUF_BLOCKS[vk][1]))
            self._uk = torch.from_numpy(np.ascontiguousarray(
                uk.reshape(k_b.shape[0], k_b.shape[1], -1).transpose(0, 2, 1))).to(self.dtype)
            self._uv = torch.from_numpy(uv.reshape(v_b.shape[0], v_b.shape[1], -1)).to(self.dtype)
        if self._uk is None:
            deq = []
            for q, sc in self._q:
                v = q.astype(np.float32)
                if self.fmt == "int8":
                    v *= sc[..., None]
                else:
                    g = self._group or 1
                    v = (v.reshape(*q.shape[:2], -1, g) * sc[..., None]).reshape(q.shape)
                deq.append(torch.from_numpy(v).to(self._device, self.dtype))
            self._uk, self._uv = deq
        return self._uk, self._uv  # type: ignore[return-value]


def _absorbed(mod: nn.Module) -> _Absorbed:
    """The module's absorbed weights, built from kv_b_proj's float weight once and again when
    that tensor or the settings change.  Once kv_b_proj itself is int8/int4 (converted after
    :func:`absorb_mla`) the weights absorbed before stay in use; ValueError if there are
    none."""
    w = _kv_b_weight(mod)
    st = _state_of(mod)
    ctx, fmt, cached = st.ctx, st.fmt, st.weights
    if fmt == "gguf":  # the file's blocks, whatever kv_b_proj (the prefill path's) is now
        key = ("gguf", id(st.blocks))
        if cached is None or cached.key != key:
            cached = _own_state(mod).weights = _Absorbed(mod, w, fmt, ctx, key)
        elif cached.ctx is not ctx:
            cached.set_ctx(ctx)
        return cached
    if w is None:
        if cached is None:
            raise ValueError("absorbed MLA needs kv_b_proj's weights in f32/bf16 (an int8/int4 "
                             "kv_b_proj cannot be absorbed: absorb_mla(weights='int8' or "
                             "'int4') first, then convert kv_b_proj)")
        if cached.fmt != fmt:
            raise ValueError(f"kv_b_proj is int8/int4 now: the absorbed weights "
                             f"({cached.fmt}) cannot be rebuilt at another precision ({fmt})")
        if cached.ctx is not ctx:
            cached.set_ctx(ctx)
        return cached
    key = (w.data_ptr(), w.dtype, w._version, fmt)
    if cached is None or cached.key != key or cached.ctx is not ctx:
        cached = _Absorbed(mod, w, fmt, ctx, key)
        _own_state(mod).weights = cached
    return cached


def _rope(mod: nn.Module, q: torch.Tensor, k: torch.Tensor,
          position_embeddings: Any) -> tuple[torch.Tensor, torch.Tensor]:
    """The module's own rotary embedding, as its forward applies it: DeepSeek-V2 passes
    complex frequencies to ``apply_rotary_emb``; DeepSeek-V3 passes (cos, sin) to
    ``apply_rotary_pos_emb`` or its interleaved variant."""
    ns = sys.modules[type(mod).__module__]
    form = _rope_form(mod)
    if form == "complex" and isinstance(position_embeddings, torch.Tensor):
        return ns.apply_rotary_emb(q, k, position_embeddings.to(q.device))
    cos, sin = position_embeddings
    if form == "interleave":
        return ns.apply_rotary_pos_emb_interleave(q, k, cos, sin)
    return ns.apply_rotary_pos_emb(q, k, cos, sin)


def mask_readable(mask: Any, T: int) -> bool:
    """Whether this path reads ``mask``: None, or a 4-D boolean or additive tensor with T
    query rows (a flex-attention BlockMask and the like go to the module's own forward)."""
    return mask is None or (isinstance(mask, torch.Tensor) and mask.dim() == 4
                            and mask.shape[-2] == T)


def mask_bias(mask: torch.Tensor | None, T: int, S: int,
               dtype: torch.dtype) -> torch.Tensor | None:
    """The additive mask [B or 1, 1, T, S] for scores; None when nothing is masked."""
    if mask is None:
        if T == 1:
            return None
        # causal, the T queries being the last T positions of the S keys
        i = torch.arange(T).unsqueeze(1) + (S - T)
        j = torch.arange(S).unsqueeze(0)
        return torch.zeros(T, S, dtype=dtype).masked_fill_(j > i, _NEG)[None, None]
    if mask.shape[-1] < S:
        raise ValueError(f"attention mask covers {mask.shape[-1]} keys, the cache holds {S}")
    mask = mask[..., :S]
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype).masked_fill_(~mask, _NEG)
    return mask.to(dtype)


def _absorbed_forward(mod: nn.Module, hidden_states: torch.Tensor, position_embeddings: Any,
                      attention_mask: torch.Tensor | None, past_key_values: Any) -> torch.Tensor:
    """One MLA attention in the absorbed form (the mask already checked by mask_readable)."""
    B, T = hidden_states.shape[:2]
    H = mod.num_heads
    dn, dr, dv, r = mod.qk_nope_head_dim, mod.qk_rope_head_dim, mod.v_head_dim, mod.kv_lora_rank
    if mod.q_lora_rank is None:
        q = mod.q_proj(hidden_states)
    else:
        q = mod.q_b_proj(mod.q_a_layernorm(mod.q_a_proj(hidden_states)))
    q = q.view(B, T, H, dn + dr).transpose(1, 2)
    q_nope, q_pe = torch.split(q, [dn, dr], dim=-1)
    ckv = mod.kv_a_proj_with_mqa(hidden_states)
    c, k_pe = torch.split(ckv, [r, dr], dim=-1)
    c = mod.kv_a_layernorm(c).view(B, 1, T, r)
    k_pe = k_pe.view(B, 1, T, dr)
    q_pe, k_pe = _rope(mod, q_pe, k_pe, position_embeddings)
    if past_key_values is not None:   # the latent as keys, the rotary key as values
        c, k_pe = kv_append(past_key_values, mod.layer_idx, c, k_pe, {})
    S = c.shape[2]
    bias = mask_bias(attention_mask, T, S, torch.float32)
    ab = _absorbed(mod)
    o = None
    if ab.kernel is not None and c.device.type == "cpu":
        o = _attend_c(ab.kernel, dv, q_nope, q_pe, c[:, 0], k_pe[:, 0], bias)
    if o is None:
        w_uk, w_uv = ab.torch_weights()                   # [H, dn, r], [H, dv, r]
        o = _attend_torch(mod, q_nope, q_pe, c[:, 0], k_pe[:, 0], bias, w_uk, w_uv)
    return mod.o_proj(o.to(hidden_states.dtype))


def _attend_c(kernel: Any, dv: int, q_nope: torch.Tensor, q_pe: torch.Tensor, c: torch.Tensor,
              k_pe: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor | None:
    """The absorbed attention in C: [B, T, H*d_v] float32, or None when the cache's dtype is
    one the kernel does not read (then the torch path runs)."""
    ca, ka = tensor_array(c.contiguous()), tensor_array(k_pe.contiguous())
    if ca is None or ka is None or (bias is not None and bias.shape[1] != 1):
        return None
    B, H, T, _ = q_nope.shape
    out = torch.empty(B, T, H * dv, dtype=torch.float32)
    b = None
    if bias is not None:
        b = bias.reshape(bias.shape[0], T, bias.shape[-1]).contiguous().numpy()
    kernel.forward(q_nope.float().contiguous().numpy(), q_pe.float().contiguous().numpy(), ca,
                   ka, b, out.numpy())
    return out


def _attend_torch(mod: nn.Module, q_nope: torch.Tensor, q_pe: torch.Tensor, c0: torch.Tensor,
                  kp0: torch.Tensor, bias: torch.Tensor | None, w_uk: torch.Tensor,
                  w_uv: torch.Tensor) -> torch.Tensor:
    """The absorbed attention in torch, in the cache's dtype: [B, T, H*d_v]."""
    B, H, T, dn = q_nope.shape
    dr, dv, r = mod.qk_rope_head_dim, mod.v_head_dim, mod.kv_lora_rank
    S = c0.shape[1]
    cdt = c0.dtype
    if w_uk.dtype != cdt:
        w_uk, w_uv = w_uk.to(cdt), w_uv.to(cdt)
    w_uv_t = w_uv.transpose(1, 2)                         # [H, r, dv], a view
    # q_lat_h = W^UK_h^T q_h: heads as the batch of one bmm, (B, T) as its rows
    qn = q_nope.to(cdt).transpose(0, 1).reshape(H, B * T, dn)
    q_lat = torch.bmm(qn, w_uk).view(H, B, T, r).transpose(0, 1).reshape(B, H * T, r)
    # the rotary part in f32 (DeepSeek-V3's rotation returns f32, which its own forward keeps)
    qp = q_pe.float().reshape(B, H * T, dr)
    kp0 = kp0.float()                                     # [B, S, dr]
    scores = torch.bmm(q_lat, c0.transpose(1, 2)).float()
    scores = scores.baddbmm_(qp, kp0.transpose(1, 2)).mul_(mod.scaling).view(B, H, T, S)
    if bias is not None:
        scores = scores + bias
    p = torch.softmax(scores, dim=-1).to(cdt).view(B, H * T, S)
    o_lat = torch.bmm(p, c0)                              # [B, H*T, r]
    o_lat = o_lat.view(B, H, T, r).transpose(0, 1).reshape(H, B * T, r)
    return torch.bmm(o_lat, w_uv_t).view(H, B, T, dv).permute(1, 2, 0, 3).reshape(B, T, H * dv)


def _cache_of(a: dict[str, Any]) -> Any:
    """The KV cache among an attention forward's bound arguments: ``past_key_values`` up to
    transformers 5.23, ``cache`` from 5.24 (which still accepts the old name as a deprecated
    keyword: then it may arrive in ``**kwargs``)."""
    extra = a.get("kwargs") or {}
    for name in ("cache", "past_key_values"):
        if a.get(name) is not None:
            return a[name]
        if extra.get(name) is not None:
            return extra[name]
    return None


def absorb_mla(model: nn.Module, max_tokens: int = MLA_MAX_TOKENS, *,
               kernel: str = "c", ctx: _C.KernelContext | None = None,
               weights: str | None = None,
               blocks: dict[str, tuple[np.ndarray, str, np.ndarray, str]] | None = None
               ) -> list[str]:
    """Decode ``model``'s MLA attention modules in the absorbed form (see the module
    docstring) for inputs of at most ``max_tokens`` tokens; returns the modules' names.

    kernel: ``"c"`` (the C kernel on ``ctx``, default the process's
    :func:`specmoe.runtime.kernels.context`, where the tensors allow it) or ``"torch"``.  weights:
    ``"int8"`` / ``"int4"`` (kv_b_proj's rows quantized as :class:`specmoe.models.layers.CLinear`
    quantizes them, so that kv_b_proj itself can then be converted for prefill) or None (as
    kv_b_proj is: its float dtype, or, once it is int8/int4, the weights absorbed before).
    Idempotent; a second call changes the settings (the precision only while kv_b_proj is
    float).  blocks: by attention module name, a GGUF file's attn_k_b / attn_v_b and their
    kinds (:meth:`specmoe.storage.gguf.GgufCheckpoint.mla_blocks`): those modules read them as
    the file holds them (``weights`` applies to the others).  The KV cache and the prefill
    path stay transformers' own."""
    if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an int >= 1, got {max_tokens!r}")
    if kernel not in ("c", "torch"):
        raise ValueError(f"kernel must be 'c' or 'torch', got {kernel!r}")
    if weights not in (None, "int8", "int4"):
        raise ValueError(f"weights must be None, 'int8' or 'int4', got {weights!r}")
    if kernel == "c" and ctx is None:
        from ..runtime.kernels import context
        ctx = context()
    found = [(name, mod) for name, mod in model.named_modules() if is_mla_attention(mod)]
    fmts: list[str | None] = []
    blocks = blocks or {}
    for name, mod in found:  # every module checked before any is changed: fails now, not at
        # the first token, if it cannot be absorbed
        if name not in blocks and weights is None \
                and _state_of(mod).fmt == "gguf":
            fmts.append("gguf")  # a second call keeps the file's blocks
            continue
        if name in blocks:
            k_b, kk, v_b, vk = blocks[name]
            if kk not in GGUF_BLOCKS or vk not in GGUF_BLOCKS:
                raise ValueError(f"{name}: GGUF blocks {kk!r} / {vk!r}: the kernels read "
                                 f"{', '.join(GGUF_BLOCKS)}")
            fmts.append("gguf")
            continue
        fmts.append(weights)
        if _kv_b_weight(mod) is None:
            cached = _state_of(mod).weights
            if cached is None:
                _absorbed(mod)  # raises
            if weights is None:
                fmts[-1] = cached.fmt
            elif cached.fmt != weights:
                raise ValueError(f"kv_b_proj is int8/int4 now: the absorbed weights "
                                 f"({cached.fmt}) cannot be rebuilt at another precision "
                                 f"({weights})")
        if weights == "int4" and mod.kv_lora_rank % 32:
            raise ValueError(f"int4 absorbed MLA weights need kv_lora_rank "
                             f"({mod.kv_lora_rank}) divisible by 32")
    for (name, mod), fmt in zip(found, fmts):
        st = _own_state(mod)
        st.ctx = ctx if kernel == "c" else None
        st.fmt = fmt
        if name in blocks:
            st.blocks = blocks[name]
        _absorbed(mod)
    done = []
    for name, mod in found:
        st = _own_state(mod)
        orig = st.orig_forward or mod.forward
        sig = inspect.signature(orig)

        def forward(*args: Any, _mod: nn.Module = mod, _st: MlaState = st,
                    _sig: inspect.Signature = sig, **kwargs: Any) -> Any:
            # decoder layers pass everything by keyword: then the keywords are the arguments
            # (binding the signature cost ~70 us a call on a cold decode step)
            a = kwargs if not args and "hidden_states" in kwargs \
                else _sig.bind(*args, **kwargs).arguments
            hs = a["hidden_states"]
            if (not _mod.training and hs.dim() == 3 and hs.shape[1] <= _st.max_tokens
                    and a.get("position_embeddings") is not None
                    and mask_readable(a.get("attention_mask"), hs.shape[1])):
                with torch.no_grad():
                    return _absorbed_forward(_mod, hs, a["position_embeddings"],
                                             a.get("attention_mask"), _cache_of(a)), None
            return _st.orig_forward(*args, **kwargs)

        st.orig_forward = orig
        st.max_tokens = max_tokens
        mod.forward = forward
        done.append(name)
    return done


# -- a whole DeepSeek-V2/V3 decoder layer in one C call ---------------------------------------

def fuse_mla(model: nn.Module, ctx: _C.KernelContext | None = None) -> list[str]:
    """Run the decode steps of ``model``'s DeepSeek-V2/V3 decoder layers through one
    ``specmoe._C.MLABlock`` each; returns the qualified names of the attention modules
    switched.

    A layer qualifies when its class is in ``specmoe.models.arch.FUSABLE_MLA_LAYERS``, its attention
    is absorbed with the C kernel (:func:`absorb_mla`), its projections (``q_proj`` or
    ``q_a_proj`` / ``q_b_proj``, ``kv_a_proj_with_mqa``, ``o_proj``) are
    :class:`specmoe.models.layers.CLinear`, its norms plain RMSNorms, and the model's dtype f32 or
    bf16.  A decode step of such a layer (batch 1, at most ``max_tokens`` tokens, transformers'
    ``DynamicCache``; DeepSeek-V2's complex rotary frequencies, or DeepSeek-V3's (cos, sin) in
    its interleaved or rotate-half form) is then one C call: the input
    norm, the MLA module with the new latent and rotary key written straight into the cache's
    buffers (:func:`specmoe.runtime.kvcache.kv_buffers`), the residual add, the post-attention norm,
    and -- when the MoE block routes in C (``Engine._install_routing``) -- the MoE block and
    the second add (``MLABlock.layer``); a dense-MLP layer, or a block whose routing must stay
    in Python at the time (drafts, a predictor, trace recording), runs its ``mlp`` in torch
    after ``MLABlock.attn``.  The roundings are the absorbed path's (:func:`_absorbed_forward`)
    step by step, so a bf16 layer's output is bit for bit that path's.  Everything else goes to
    the layer's own forward.  Idempotent."""
    from .arch import FUSABLE_MLA_LAYERS
    if ctx is None:
        from ..runtime.kernels import context
        ctx = context()
    done = []
    for name, layer in model.named_modules():
        attn = getattr(layer, "self_attn", None)
        if type(layer).__name__ not in FUSABLE_MLA_LAYERS or attn is None \
                or not is_mla_attention(attn):
            continue
        if getattr(layer, "_specmoe_mlab", None) is not None:
            done.append(f"{name}.self_attn" if name else "self_attn")
            continue
        rope = _rope_form(attn)
        names = (("q_a_proj", "q_b_proj") if attn.q_lora_rank is not None else ("q_proj",)) \
            + ("kv_a_proj_with_mqa", "o_proj")
        projs = [getattr(attn, n, None) for n in names]
        ln = [norm_weight(getattr(layer, n, None))
              for n in ("input_layernorm", "post_attention_layernorm")]
        norms = [attn.kv_a_layernorm] + ([attn.q_a_layernorm] if attn.q_lora_rank else [])
        if not all(isinstance(p, CLinear) for p in projs) or ln[0] is None or ln[1] is None \
                or any(norm_weight(n) is None for n in norms) \
                or projs[0].out_dtype not in (torch.float32, torch.bfloat16) \
                or _state_of(attn).ctx is not ctx or rope is None:
            continue
        layer._specmoe_mlab_parts = MlaParts(projs, ctx, projs[0].out_dtype, rope)
        layer._specmoe_mlab = None
        # a dense layer (DeepSeek's first_k_dense_replace): its MLP in the block's call too
        dense = None if hasattr(layer.mlp, "experts") else silu_mlp_parts(layer.mlp)
        set_dense_mlp(layer, dense if dense is not None and dense[1] == projs[0].out_dtype
                      else None)
        if _mla_block(layer) is None:
            del layer._specmoe_mlab_parts, layer._specmoe_mlab
            set_dense_mlp(layer, None)
            continue
        layer.forward = _mla_layer_forward(layer, layer.forward)
        set_chain_step(layer, ChainStep(
            chain_call, chain_rope,
            norms=(ln[0], float(layer.input_layernorm.variance_epsilon),
                   ln[1], float(layer.post_attention_layernorm.variance_epsilon))))
        done.append(f"{name}.self_attn" if name else "self_attn")
    return done


def _mla_block(layer: nn.Module) -> Any:
    """The layer's MLABlock over its attention's current absorbed kernel and token limit
    (built again when the kernel was rebuilt -- kv_b_proj's weights or the settings changed --
    or absorb_mla changed max_tokens); None when the module has no C kernel now."""
    attn = layer.self_attn
    ab = _absorbed(attn)
    mx = _state_of(attn).max_tokens
    cur = layer._specmoe_mlab
    if cur is not None and cur.kernel is ab.kernel and cur.max_tokens == mx:
        return cur.block
    if ab.kernel is None:
        return None
    parts = layer._specmoe_mlab_parts
    projs, ctx = parts.projs, parts.ctx
    kw: dict[str, Any] = {}
    if attn.q_lora_rank is not None:
        q_a, q_b, kv_a, o = projs
        kw.update(q_a=q_a._c, q_a_norm=norm_weight(attn.q_a_layernorm),
                  q_a_eps=float(attn.q_a_layernorm.variance_epsilon))
        first = [q_a, kv_a]
    else:
        q_b, kv_a, o = projs
        first = [q_b, kv_a]
    joint = fuse_qkv(first, ctx)    # int8/int4: the two matrices read as one
    if joint is not None:
        kw["joint"] = joint
    blk = _C.MLABlock(ctx, ab.kernel, q_b._c, kv_a._c, o._c, norm_weight(attn.kv_a_layernorm),
                      float(attn.kv_a_layernorm.variance_epsilon),
                      bf16=parts.dtype == torch.bfloat16,
                      max_tokens=max(mx, MLA_BLOCK_MAX_TOKENS), rope=parts.rope, **kw)
    dense = dense_mlp(layer)
    if dense is not None:
        blk.set_mlp(dense[0])
    layer._specmoe_mlab = MlaBlockRef(blk, ab.kernel, mx)
    return blk


def _rope_form(attn: nn.Module) -> str | None:
    """The rotary form of an MLA module, one rule for :func:`_rope` and the MLABlock:
    ``"complex"`` (DeepSeek-V2's apply_rotary_emb), ``"interleave"`` / ``"half"``
    (DeepSeek-V3's apply_rotary_pos_emb_interleave / apply_rotary_pos_emb, by
    ``config.rope_interleave``); None for a module file with neither form."""
    ns = sys.modules[type(attn).__module__]
    if hasattr(ns, "apply_rotary_emb"):
        return "complex"
    if not hasattr(ns, "apply_rotary_pos_emb"):
        return None
    return "interleave" if getattr(attn.config, "rope_interleave", False) else "half"


def _rope_ok(pe: Any, rope: str, T: int, dr: int, B: int = 1) -> bool:
    """Whether the decoder's position embeddings ``pe`` are what the layer's rotary form reads:
    complex64 frequencies [..., dr / 2] ("complex"), or a (cos, sin) pair of f32/bf16 tensors
    [..., dr]; covering T tokens (B > 1 rows: [1 or B, T, ...], each row's own positions)."""
    parts = (pe,) if rope == "complex" else pe
    if rope == "complex":
        if not (isinstance(pe, torch.Tensor) and pe.dtype == torch.complex64):
            return False
        w = dr // 2
    else:
        if not (isinstance(pe, tuple) and len(pe) == 2 and all(
                isinstance(p, torch.Tensor) and p.dtype in (torch.float32, torch.bfloat16)
                for p in pe)):
            return False
        w = dr
    if B > 1:
        return all(p.dim() == 3 and p.shape[0] in (1, B) and p.shape[1] == T
                   and p.shape[2] == w for p in parts)
    return all(p.shape[-1] == w and p.numel() >= T * w for p in parts)


def _rope_array(pe: Any, rope: str, T: int, dr: int, B: int = 1) -> np.ndarray:
    """The freqs argument of MLABlock for T tokens: float32 [T, dr / 2, 2] ("complex") or
    [T, 2, dr] (cos, sin); B > 1 rows of T tokens ([1 or B, T, ...], _rope_ok): [B T, ...],
    each row at its own positions."""
    if rope == "complex":
        f = pe.reshape(-1, dr // 2)[-T:] if B == 1 else \
            pe.expand(B, T, dr // 2).reshape(B * T, dr // 2)
        return torch.view_as_real(f).contiguous().numpy()
    if B == 1:
        cos, sin = (p.reshape(-1, dr)[-T:].float() for p in pe)
    else:
        cos, sin = (p.expand(B, T, dr).reshape(B * T, dr).float() for p in pe)
    return torch.stack((cos, sin), 1).contiguous().numpy()


def _mla_layer_forward(layer: nn.Module, original: Any) -> Any:
    """A DeepSeek-V2/V3 decoder layer's forward with its decode steps through its MLABlock
    (:func:`fuse_mla`)."""
    attn = layer.self_attn
    rope = layer._specmoe_mlab_parts.rope
    dr = attn.qk_rope_head_dim

    def forward(hidden_states: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: Any = None, cache: Any = None, use_cache: Any = False,
                position_embeddings: Any = None, **kwargs: Any) -> Any:
        if cache is None:
            cache = kwargs.pop("past_key_values", None)
        x = hidden_states
        pe = position_embeddings
        bufs = None
        if _mla_decodable(layer, x, pe, attention_mask):  # B rows: each writes its own
            bufs = kv_buffers(cache, attn.layer_idx, x.shape[1], rows=x.shape[0] > 1)
        blk = _mla_block(layer) if bufs is not None else None
        if blk is None:
            return original(hidden_states, attention_mask=attention_mask,
                            position_ids=position_ids, cache=cache, use_cache=use_cache,
                            position_embeddings=position_embeddings, **kwargs)
        with torch.no_grad():
            return _mla_layer_call(layer, blk, x, pe, rope, dr, attention_mask, bufs)
    forward.__name__ = f"specmoe_fused_{type(layer).__name__}_forward"
    return forward


# (position embeddings, T, width, arrays) of the last per_step_rope call: every layer of a
# decode step gets the same position-embeddings object from the decoder, so layers 2..L reuse
# layer 1's arrays.  One tuple, replaced whole (atomic under the GIL).
_ROPE_LAST: tuple = (None, 0, 0, None)


def per_step_rope(pe: Any, T: int, width: int, make: Any) -> Any:
    """``make()`` -- the C layer call's arrays of the decoder's rotary table ``pe`` for T
    tokens of ``width`` values -- computed once per decode step.  On a step whose weights have
    just streamed through the CPU caches those few torch operations cost ~50 us a layer
    (DeepSeek-V2-Lite, int4, 2 threads).  The entry holds ``pe`` itself, so its identity is
    not reused while it is kept."""
    global _ROPE_LAST
    last = _ROPE_LAST
    if last[0] is pe and last[1] == T and last[2] == width:
        return last[3]
    value = make()
    _ROPE_LAST = (pe, T, width, value)
    return value


def _mla_args(layer: nn.Module, x: torch.Tensor, pe: Any, rope: str, dr: int,
              attention_mask: torch.Tensor | None, bufs: tuple) -> tuple:
    """The arguments common to ``_C.MLABlock.attn`` and ``.layer`` for B rows of T tokens x
    [B, T, hidden] on the KV buffers ``bufs`` (kv_buffers, [B, ...]): x, freqs, cbuf, kbuf, S,
    bias, ln1, eps1, ln2, eps2."""
    _, _, _, ca, ka, S = bufs
    B, T, hidden = x.shape
    if B == 1:
        freqs = per_step_rope(pe, T, dr, lambda: _rope_array(pe, rope, T, dr))
    else:
        freqs = _rope_array(pe, rope, T, dr, B)
    bias = mask_bias(attention_mask, T, S + T, torch.float32)
    if bias is not None:  # [1 or B, 1, T, S + T] (_mla_decodable)
        bias = bias.reshape(bias.shape[0], T, S + T).contiguous().numpy()
    return (tensor_array(x.reshape(B * T, hidden).contiguous()), freqs, ca, ka, S, bias,
            *chain_step(layer).norms)


def _mla_layer_call(layer: nn.Module, blk: Any, x: torch.Tensor, pe: Any, rope: str, dr: int,
                    attention_mask: torch.Tensor | None, bufs: tuple) -> torch.Tensor:
    """One decode step of the layer through its MLABlock (see :func:`fuse_mla`): B rows of T
    tokens, x [B, T, hidden], in calls of at most MLA_BLOCK_MAX_TOKENS tokens (whole rows)."""
    B, T, hidden = x.shape
    G = max(1, max(_state_of(layer.self_attn).max_tokens, MLA_BLOCK_MAX_TOKENS) // T)  # rows a call
    route = decode_route(layer, x)
    dense = route is None and dense_in_call(layer, T)
    out = torch.empty(B, T, hidden, dtype=x.dtype)
    normed = None if route is not None or dense else torch.empty(B, T, hidden, dtype=x.dtype)
    for b0 in range(0, B, G):
        b1 = min(B, b0 + G)
        rows = slice(b0, b1)
        pr = pe if B <= G else _rows_of(pe, rows)
        mr = attention_mask if B <= G or attention_mask is None or attention_mask.shape[0] == 1 \
            else attention_mask[rows]
        br = bufs if B <= G else bufs[:3] + (bufs[3][rows], bufs[4][rows], bufs[5])
        args = _mla_args(layer, x[rows], pr, rope, dr, mr, br)
        o = tensor_array(out[rows].view((b1 - b0) * T, hidden))
        if route is not None:
            eng, pos, flags, _ = route
            with eng.layer_call_slot():
                blk.layer(eng.layers, pos, flags, *args, o)
        elif dense:
            blk.layer(None, -1, 0, *args, o)
        else:
            blk.attn(*args, o, tensor_array(normed[rows].view((b1 - b0) * T, hidden)))
    kv_advance(bufs, T)
    if normed is not None:
        out = out + layer.mlp(normed)
    return out


def _rows_of(pe: Any, rows: slice) -> Any:
    """The position embeddings of rows ``rows`` of a B-row call (pe's tensors [1 or B, ...])."""
    def cut(p: torch.Tensor) -> torch.Tensor:
        return p if p.shape[0] == 1 else p[rows]
    return cut(pe) if isinstance(pe, torch.Tensor) else tuple(cut(p) for p in pe)


def _mla_decodable(layer: nn.Module, x: torch.Tensor, pe: Any,
                   attention_mask: torch.Tensor | None) -> bool:
    """Whether the layer's MLABlock serves this call (else the layer's own forward): B rows
    of T <= the absorbed path's tokens each (_mla_layer_call groups the rows)."""
    attn = layer.self_attn
    parts = layer._specmoe_mlab_parts
    dt, rope = parts.dtype, parts.rope
    B, T = (x.shape[0], x.shape[1]) if x.dim() == 3 else (0, 0)
    return (not layer.training and x.dim() == 3 and B >= 1
            and 1 <= T <= _state_of(attn).max_tokens
            and x.dtype == dt and x.device.type == "cpu"
            and _rope_ok(pe, rope, T, attn.qk_rope_head_dim, B)
            and mask_readable(attention_mask, T)
            and (attention_mask is None or (attention_mask.shape[0] in (1, B)
                                            and attention_mask.shape[1] == 1))
            and not adapter_active(attn))  # an MTP forward's masks: the LoRA in torch


def chain_rope(layer: nn.Module, pe: Any, T: int) -> tuple:
    """The rotary array among ``_C.MLABlock.layer``'s arguments for the last T positions of the
    decoder's position embeddings ``pe`` (freqs): ((index, array),), as :func:`chain_call`
    passes it; over a table of every position, a ``_C.DecodePlan``'s rotary table."""
    return ((4, _rope_array(pe, layer._specmoe_mlab_parts.rope, T,
                            layer.self_attn.qk_rope_head_dim)),)


def chain_call(layer: nn.Module, x: torch.Tensor, out: torch.Tensor, pe: Any,
               cache: Any) -> tuple | None:
    """One decode step of a fused DeepSeek decoder layer as an item of ``_C.layer_chain``:
    (block, ``layer()`` arguments, KV buffers, Engine or None) for x [1, T, hidden] into out
    with no mask, or None when the step must take the layer's forward (its checks; a layer
    whose MoE block does not route in C now).  A dense layer whose MLP the block runs
    (set_mlp) is an item too, with no Engine."""
    if not _mla_decodable(layer, x, pe, None):
        return None
    T, hidden = x.shape[1], x.shape[2]
    route = decode_route(layer, x)
    if route is None and not dense_in_call(layer, T):
        return None
    attn = layer.self_attn
    bufs = kv_buffers(cache, attn.layer_idx, T)
    blk = None if bufs is None else _mla_block(layer)
    if type(blk) is not _C.MLABlock:
        return None
    eng, pos, flags = (None, -1, 0) if route is None else (route.engine, route.pos, route.flags)
    args = _mla_args(layer, x, pe, layer._specmoe_mlab_parts.rope, attn.qk_rope_head_dim,
                     None, bufs)
    return (blk, (None if eng is None else eng.layers, pos, flags, *args,
                  tensor_array(out.view(T, hidden))), bufs, eng)

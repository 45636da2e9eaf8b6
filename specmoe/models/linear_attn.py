"""Recurrent (linear-attention, state-space and short-convolution) layers of hybrid models on the
CPU: what an offloaded model's decode step would otherwise spend most of its time on.

transformers runs these layers' per-token work in torch reference code when the CUDA packages
it prefers (flash-linear-attention, causal-conv1d, mamba-ssm) are absent, as on every CPU
machine.  Two parts of it dominate a decode step there (a Qwen3.5-MoE layer at Qwen3.5-35B-A3B's
shapes, AMD EPYC Zen 2, one thread, ``benchmarks/hybrid_peers.py``):

* the depthwise short convolution in bf16: 35 ms a token per layer, where the same
  convolution in f32 takes 0.2 ms (:func:`f32_short_convs`);
* the gated delta rule's recurrent step (Qwen3-Next, Qwen3.5): 2.6 ms a layer in torch, one
  call of the C kernel ``smoe_gated_delta`` (csrc/kernels/gdelta.c) here
  (:func:`use_c_gated_delta`), which takes the rule's chunked form over a prompt's tokens too,
  token by token (a Qwen3.5-MoE prompt forward 1.06-1.30x faster at 32 tokens, 1.13-1.29x
  for 16 such prompts together; Zen 4, ``benchmarks/hybrid_prefill.py --rule-ab``);
* then the forty-odd torch operations around it at one token (the short convolution's window,
  the gates, the gated RMSNorm): 1.4 ms of a 3.0 ms layer whose five matrix products take 1.5
  ms.  :func:`fuse_gated_deltanet` runs a Qwen3.5 or Qwen3-Next module's whole decode step in
  one C call (``specmoe._C.GdnBlock``, csrc/gdn_block.c) when its projections are specmoe's,
  and with its decoder layer's norms and MoE block when that routes in C.

:func:`prepare` applies both to a model the engine offloads.  A model that is not offloaded
keeps transformers' own code (the C step is chosen per module instance, see
:func:`use_c_gated_delta`).
"""
from __future__ import annotations

import contextvars
import functools
import inspect
import re
import sys
import warnings
from typing import Any, Callable, NamedTuple

import numpy as np
import torch
from torch import nn

from .. import _C
from ..runtime.kernels import tensor_array
from .arch import FUSABLE_GATED_DELTANET, FUSABLE_GDN_LAYERS
from .layers import (BLOCK_DTYPES, ChainStep, CLinear, CRMSNorm, chain_step, decode_route,
                     fuse_qkv, set_chain_step)

__all__ = ["prepare", "f32_short_convs", "use_c_gated_delta", "fuse_gated_deltanet",
           "GDN_MAX_ROWS"]

# sequences of one fused gated DeltaNet call (a decode batch); more go to the module's forward
GDN_MAX_ROWS = 64

# (the KernelContext the gated delta rule runs on, whether it may update a state in place) while
# a converted module's forward runs, else None (transformers' own torch code)
_CTX: contextvars.ContextVar[Any] = contextvars.ContextVar("specmoe_gated_delta", default=None)
_FN = "torch_recurrent_gated_delta_rule"
# its chunked form, which transformers runs over a prompt's tokens (all but the ones a recording
# cache keeps a state for): the same kernel takes it token by token (:func:`use_c_gated_delta`)
_CHUNK_FN = "torch_chunk_gated_delta_rule"
# transformers 5.25's depthwise short convolution of a recurrent layer, given the nn.Conv1d
_CONV_FORWARD = "causal_conv1d_forward"


class GdnShape(NamedTuple):
    """The shape of a fused gated-DeltaNet module's state, kept as its ``_specmoe_gdn_shape``
    (read in this file only): what its cache's conv window and recurrent state must be for
    the GdnBlock to take a call (:func:`_layer_states`)."""

    conv_channels: int  # C = 2 Hk dk + Hv dv: the conv window's channels (q, k and v)
    v_heads: int  # Hv
    k_dim: int  # dk
    v_dim: int  # dv
    dtype: torch.dtype  # the module's activations (the block's dtype)


def prepare(model: nn.Module, ctx: Any) -> dict[str, list[str]]:
    """:func:`f32_short_convs` and :func:`use_c_gated_delta` on ``model``; the modules each
    changed, by qualified name."""
    return {"f32_convs": f32_short_convs(model), "c_gated_delta": use_c_gated_delta(model, ctx)}


@functools.lru_cache(maxsize=None)
def _class_source(cls: type) -> str | None:
    """``cls``'s source (inspect reads and tokenizes its file: cached, as every offload asks)."""
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):
        return None


def f32_short_convs(model: nn.Module) -> list[str]:
    """Hold the depthwise ``nn.Conv1d`` kernels of ``model``'s recurrent layers (the short
    convolutions of Qwen3-Next's and Qwen3.5's gated DeltaNet, Mamba-2, LFM2, Kimi-Linear,
    Jamba) in f32 when the model is bf16 / f16, in place; returns their qualified names.

    transformers runs them through ``causal_conv1d_update`` / ``causal_conv1d_fn``, which cast
    the input to the kernel's dtype and back: in f32 the depthwise convolution takes torch's
    fast path, in bf16 torch's CPU convolution loops over the channels one group at a time
    (8192 channels, one decode token: 35 ms in bf16, 0.2 ms in f32; torch 2.13, one thread).
    The states and outputs keep the model's dtype (the casts are transformers'); only the
    product is formed in f32.  A module whose class calls its conv directly (``self.conv(x)``,
    where an f32 kernel would meet a bf16 input) or never reads its weight is left alone."""
    out = []
    for parent_name, parent in model.named_modules():
        for attr, conv in parent.named_children():
            if not (isinstance(conv, nn.Conv1d) and conv.groups == conv.in_channels > 1
                    and conv.weight.dtype in (torch.bfloat16, torch.float16)):
                continue
            if not _reads_weight_only(parent, attr):
                continue
            conv.float()
            out.append(f"{parent_name}.{attr}" if parent_name else attr)
    return out


def _reads_weight_only(parent: nn.Module, attr: str) -> bool:
    """Whether ``parent``'s class uses its conv ``attr`` only through the conv's weight: its
    source reads ``self.<attr>.weight`` (transformers <= 5.24), or hands ``self.<attr>`` to its
    modeling module's ``causal_conv1d_forward`` (5.25 on), whose source reads the conv's
    weight and never calls the conv; and never calls ``self.<attr>(...)`` itself."""
    src = _class_source(type(parent))
    a = re.escape(attr)
    if src is None or re.search(rf"self\.{a}\(", src):
        return False
    if re.search(rf"self\.{a}\.weight\b", src):
        return True
    if not re.search(rf"\b{_CONV_FORWARD}\(\s*self\.{a}\s*,", src):
        return False
    fsrc = _function_source(type(parent).__module__, _CONV_FORWARD)
    return fsrc is not None and re.search(r"\bconv1d\.weight\b", fsrc) is not None \
        and re.search(r"\bconv1d\(", fsrc) is None


@functools.lru_cache(maxsize=None)
def _function_source(module: str, name: str) -> str | None:
    """The text of the top-level ``def name`` in ``module``'s source, or None.  Read from the
    file rather than the object: transformers wraps such functions in objects of the Hub
    ``kernels`` package (an nn.Module whose forward calls the function) whose source is not
    the function's."""
    ns = sys.modules.get(module)
    try:
        src = inspect.getsource(ns) if ns is not None else None
    except (OSError, TypeError):
        return None
    m = re.search(rf"^def {re.escape(name)}\(.*?(?=^[^\s)])", src or "", re.M | re.S)
    return m.group(0) if m else None


def _c_step(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            g: torch.Tensor, beta: torch.Tensor, initial_state: torch.Tensor | None,
            output_final_state: bool, l2norm: bool, inplace: bool = True
            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """torch_recurrent_gated_delta_rule's result from the C kernel: the output in the query's
    dtype, the final state in f32.  With ``inplace`` the state passed is updated in place when
    it is f32 and contiguous and the final state is asked for (transformers copies it into its
    cache right after); without, as while a cache records its past (transformers 5.25 keeps
    each token's state of a multi-token forward, and clones the cache's state before storing
    the new one), it is never written."""
    B, T, Hk, dk = key.shape
    Hv, dv = value.shape[-2:]

    def f32(x: torch.Tensor) -> np.ndarray:
        return x.detach().to(torch.float32).contiguous().numpy()

    if (inplace and initial_state is not None and output_final_state
            and initial_state.is_contiguous()
            and initial_state.dtype == torch.float32 and not initial_state.requires_grad):
        state = initial_state
    elif initial_state is not None:
        state = initial_state.detach().to(torch.float32).clone(memory_format=torch.contiguous_format)
    else:
        state = torch.zeros((B, Hv, dk, dv), dtype=torch.float32)
    out = torch.empty((B, T, Hv, dv), dtype=torch.float32)
    ctx.gated_delta(f32(query), f32(key), f32(value), f32(g), f32(beta), state.numpy(),
                    out.numpy(), bool(l2norm))
    return out.to(query.dtype), (state if output_final_state else None)


def _dispatcher(original: Callable, name: str = _FN) -> Callable:
    """``original`` (transformers' ``name``, the recurrent or the chunked gated delta rule of
    one modeling module) behind a switch: the C kernel while a converted module's forward runs
    (:data:`_CTX`), the original everywhere else and for what the kernel does not take
    (variable-length packed sequences, tensors off the CPU, autograd, no tokens).  The chunked
    form's ``chunk_size`` only shapes its torch computation: the kernel's is per token."""
    chunked = name == _CHUNK_FN

    def rule(query, key, value, g, beta, initial_state=None, output_final_state=False,
             use_qk_l2norm_in_kernel=False, **kw):
        cur = _CTX.get()
        if (cur is None or kw.get("cu_seqlens") is not None or query.device.type != "cpu"
                or query.shape[1] == 0 or (torch.is_grad_enabled() and query.requires_grad)):
            return original(query, key, value, g=g, beta=beta, initial_state=initial_state,
                            output_final_state=output_final_state,
                            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kw)
        if chunked:
            kw.pop("chunk_size", None)
        return _c_step(cur[0], query, key, value, g, beta, initial_state, output_final_state,
                       use_qk_l2norm_in_kernel, cur[1])
    rule.__name__ = rule.__qualname__ = name
    rule._specmoe_original = original  # type: ignore[attr-defined]
    return rule


def _agrees(ctx: Any, original: Callable, lengths: tuple[int, ...] = (3,)) -> bool:
    """Whether the C kernel gives ``original``'s result on small random problems (grouped
    value heads, each of ``lengths`` tokens, both q/k normalisations): a transformers version
    whose rule differs keeps its own code."""
    g = torch.Generator().manual_seed(0)
    B, Hk, Hv, dk, dv = 2, 2, 4, 16, 8
    for T in lengths:
        q, k = (torch.randn(B, T, Hk, dk, generator=g) for _ in range(2))
        v = torch.randn(B, T, Hv, dv, generator=g)
        decay, beta = -torch.rand(B, T, Hv, generator=g), torch.rand(B, T, Hv, generator=g)
        s0 = torch.randn(B, Hv, dk, dv, generator=g)
        for l2 in (True, False):
            if not l2:  # unit keys, as the normalised form's: a state that stays bounded
                q, k = q / q.norm(dim=-1, keepdim=True), k / k.norm(dim=-1, keepdim=True)
            want, ws = original(q, k, v, g=decay, beta=beta, initial_state=s0.clone(),
                                output_final_state=True, use_qk_l2norm_in_kernel=l2)
            got, gs = _c_step(ctx, q, k, v, decay, beta, s0.clone(), True, l2)
            if not (torch.allclose(got, want, atol=1e-4, rtol=1e-4)
                    and torch.allclose(gs, ws, atol=1e-4, rtol=1e-4)):
                return False
    return True


def _convert_rules(ctx: Any, ns: Any, src: str) -> bool:
    """Put :func:`_dispatcher` in front of modeling module ``ns``'s recurrent rule, and of its
    chunked rule where the class source ``src`` calls it, each only where the kernel agrees with
    it (:func:`_agrees`; the chunked one also across a 64-token chunk's end); whether the
    recurrent one agrees (a module is switched on only then).

    The chunked form computes the same outputs and state as the recurrent one (up to rounding:
    within 2e-6 at Qwen3.5's head shapes), and the kernel's per-token form was the faster at
    every prompt length timed (the rule alone, one run, 2 threads, Zen 4, 32 value heads of
    128: 2.6 against 12.2 ms at 32 tokens, 45 against 195 ms for 16 prompts of 32, 42 against
    67 ms at 512; whole forwards: ``benchmarks/hybrid_prefill.py --rule-ab``)."""
    for fname, lengths in ((_FN, (3,)), (_CHUNK_FN, (3, 70))):
        fn = getattr(ns, fname, None)
        if fn is None or (fname == _CHUNK_FN and f"{fname}(" not in src):
            continue
        original = getattr(fn, "_specmoe_original", fn)
        if not _agrees(ctx, original, lengths):
            warnings.warn(f"{ns.__name__}.{fname} does not agree with specmoe's gated delta "
                          "kernel; it keeps transformers' torch code", stacklevel=4)
            if fname == _FN:
                return False
            continue
        if fn is original:
            setattr(ns, fname, _dispatcher(original, fname))
    return True


def use_c_gated_delta(model: nn.Module, ctx: Any) -> list[str]:
    """Run the recurrent gated delta rule of ``model``'s gated DeltaNet layers (Qwen3-Next,
    Qwen3.5, ...: the modules whose forward calls their modeling module's
    ``torch_recurrent_gated_delta_rule``) through the C kernel on ``ctx`` (a KernelContext);
    returns the modules' qualified names.

    The modeling module's function is replaced once by a dispatcher (:func:`_dispatcher`) that
    runs the kernel only inside these modules' forwards (each instance's forward sets the
    switch), so another model of the same class in the process, an unmodified reference for
    instance, keeps transformers' code.  Only where the kernel agrees with that module's own
    function on a random problem (:func:`_agrees`): a transformers version with another rule is
    left as it is, with a warning."""
    done = []
    checked: dict[str, bool] = {}
    with torch.inference_mode(False), torch.no_grad():
        for name, mod in model.named_modules():
            ns = sys.modules.get(type(mod).__module__)
            fn = getattr(ns, _FN, None) if ns is not None else None
            if fn is None:  # (most modules: checked before reading any source)
                continue
            src = _class_source(type(mod))
            if src is None or f"{_FN}(" not in src or "def forward" not in src:
                continue
            if ns.__name__ not in checked:
                checked[ns.__name__] = _convert_rules(ctx, ns, src)
            if not checked[ns.__name__] or getattr(mod, "_specmoe_c_gated_delta", False):
                continue
            _switch_on(mod, ctx)
            done.append(name)
    return done


def _switch_on(mod: nn.Module, ctx: Any) -> None:
    """``mod``'s forward with the switch of :data:`_CTX` set to ``ctx`` while it runs (states
    updated in place unless the call's cache records this layer's past)."""
    inner = mod.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        recording = getattr(cache, "is_recording_past", None)
        idx = getattr(mod, "layer_idx", None)
        # (a cache passed by position is not looked for: never in place then)
        inplace = len(args) <= 1 and not (recording is not None and idx is not None
                                          and recording(idx))
        token = _CTX.set((ctx, inplace))
        try:
            return inner(*args, **kwargs)
        finally:
            _CTX.reset(token)
    mod.forward = forward  # type: ignore[method-assign]
    mod._specmoe_c_gated_delta = True  # type: ignore[assignment]


# a module's input projections: Qwen3.5's four, or Qwen3-Next's two (q, k, v, z interleaved per
# key head in one, b and a in the other: _next_order)
_GDN_INPUTS = (("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"),
               ("in_proj_qkvz", "in_proj_ba"))


def _next_order(Hk: int, Hv: int, dk: int, dv: int) -> np.ndarray:
    """Where each value of y = [q|k|v | z | b | a] lies in Qwen3-Next's projections side by side
    (in_proj_qkvz: per key head h, [q_h | k_h | its r = Hv / Hk value heads' v | their z];
    in_proj_ba: per key head, [its r b | its r a]), as transformers'
    fix_query_key_value_ordering reads them."""
    r = Hv // Hk
    G = 2 * dk + 2 * r * dv  # one key head's group in in_proj_qkvz
    h = np.arange(Hk)[:, None]
    q = (h * G + np.arange(dk)).ravel()
    k = (h * G + dk + np.arange(dk)).ravel()
    v = (h * G + 2 * dk + np.arange(r * dv)).ravel()
    z = (h * G + 2 * dk + r * dv + np.arange(r * dv)).ravel()
    ba = Hk * G + h * 2 * r
    b = (ba + np.arange(r)).ravel()
    a = (ba + r + np.arange(r)).ravel()
    return np.ascontiguousarray(np.concatenate([q, k, v, z, b, a]).astype(np.int32))


def fuse_gated_deltanet(model: nn.Module, ctx: Any) -> list[str]:
    """Run the decode steps of ``model``'s gated DeltaNet modules (Qwen3.5's and Qwen3-Next's:
    the classes of ``specmoe.models.arch.FUSABLE_GATED_DELTANET``) in one ``specmoe._C.GdnBlock``
    call each; returns the modules' qualified names.

    A module is fused when its projections are :class:`specmoe.models.layers.CLinear` of one f32
    / bf16 output dtype, its activation SiLU, its convolution depthwise and its norm gated with
    a weight.  The block reproduces the module's arithmetic for one token with a cache
    (csrc/decoder.h, ``smoe_gdn_block_step``; a bf16 model's roundings step by step), and the
    tokens of a speculative verification on a cache that records its past in one
    ``GdnBlock.steps`` call (:func:`_gdn_recorded`); everything
    else -- prefill and several tokens a row, the first step without a state, a padding mask,
    another device or dtype, a cache without transformers' linear-attention API, gradients --
    goes to the module's own forward.  The input projections run as one matrix where their
    formats allow (:func:`specmoe.models.layers.fuse_qkv`); Qwen3-Next's interleaved outputs
    are put in order by the block (:func:`_next_order`).  Decoder layers of a
    ``FUSABLE_GDN_LAYERS`` form around a fused module get a forward whose decode steps are one
    ``GdnBlock.layer`` call when their MoE block routes in C.  Idempotent."""
    done = []
    for name, m in model.named_modules():
        if type(m).__name__ not in FUSABLE_GATED_DELTANET:
            continue
        if getattr(m, "_specmoe_gdn", None) is not None:
            done.append(name)
            continue
        names = next((n for n in _GDN_INPUTS if hasattr(m, n[0])), _GDN_INPUTS[0])
        inputs = [getattr(m, p, None) for p in names]
        projs = inputs + [getattr(m, "out_proj", None)]
        norm, conv = getattr(m, "norm", None), getattr(m, "conv1d", None)
        if not all(isinstance(p, CLinear) for p in projs) \
                or len({p.out_dtype for p in projs}) != 1 \
                or projs[0].out_dtype not in BLOCK_DTYPES \
                or getattr(m, "activation", None) != "silu" or not isinstance(conv, nn.Conv1d) \
                or conv.groups != conv.in_channels or getattr(norm, "weight", None) is None \
                or getattr(norm, "activation", "silu") != "silu":
            continue
        dt = projs[0].out_dtype
        Hk, Hv = int(m.num_k_heads), int(m.num_v_heads)
        dk, dv = int(m.head_k_dim), int(m.head_v_dim)

        def f32(t: torch.Tensor) -> np.ndarray:
            return np.ascontiguousarray(t.detach().float().numpy())
        with torch.no_grad():
            weights = {"conv_weight": f32(conv.weight.reshape(conv.weight.shape[0], -1)),
                       "decay": f32(-m.A_log.float().exp()), "dt_bias": f32(m.dt_bias),
                       "norm_weight": f32(norm.weight)}
            if conv.bias is not None:
                weights["conv_bias"] = f32(conv.bias)
        if names is _GDN_INPUTS[1]:
            if Hv % Hk:
                continue
            weights["order"] = _next_order(Hk, Hv, dk, dv)
        try:
            joint = fuse_qkv(inputs, ctx)
            blk = _C.GdnBlock(ctx, (joint,) if joint is not None else tuple(p._c for p in inputs),
                              projs[-1]._c, **weights, k_heads=Hk, v_heads=Hv, k_dim=dk,
                              v_dim=dv, eps=float(norm.variance_epsilon),
                              bf16=dt == torch.bfloat16, max_rows=GDN_MAX_ROWS)
        except (ValueError, TypeError):
            continue  # shapes the block does not take
        m._specmoe_gdn = blk
        m._specmoe_gdn_shape = GdnShape(2 * Hk * dk + Hv * dv, Hv, dk, dv, dt)
        m.forward = _gdn_forward(m, m.forward)
        done.append(name)
    for layer in model.modules():
        attn = getattr(layer, "linear_attn", None)
        if type(layer).__name__ in FUSABLE_GDN_LAYERS and attn is not None \
                and getattr(attn, "_specmoe_gdn", None) is not None \
                and chain_step(layer) is None:  # not wrapped yet
            layer.forward = _gdn_layer_forward(layer, layer.forward)
            set_chain_step(layer, ChainStep(gdn_chain_call, gdn_chain_rope, gdn_chain_state,
                                            gdn_chain_count))
    return done


def gdn_chain_call(layer: nn.Module, x: torch.Tensor, out: torch.Tensor, pe: Any,
                   cache: Any) -> tuple | None:
    """One decode step of a fused linear-attention decoder layer as an item of
    ``_C.layer_chain`` (specmoe.models.decode_step): (block, ``GdnBlock.layer`` arguments for x
    [1, 1, hidden] into out, None -- no KV positions to advance --, Engine), or None when the
    step must take the layer's forward (:func:`_gdn_layer_args`; a block that is not a plain
    ``_C.GdnBlock``)."""
    blk = layer.linear_attn._specmoe_gdn
    if type(blk) is not _C.GdnBlock or layer.training:
        return None
    a = _gdn_layer_args(layer, x, cache, None, {})
    if a is None:
        return None
    eng = a[0]
    return blk, (eng.layers, *a[1:], tensor_array(out.view(x.shape[0], x.shape[-1]))), None, eng


def gdn_chain_rope(layer: nn.Module, pe: Any, T: int) -> tuple:
    """A linear-attention layer's rotary arrays among its chain item's arguments: none."""
    return ()


def gdn_chain_state(layer: nn.Module, cache: Any) -> tuple | None:
    """What a decode plan's item of this layer writes in place in ``cache`` (its conv window
    and recurrent state tensors: a plan holds while they are the same objects), or None when
    the layer's step cannot be a plan's now (a cache recording its past for a rollback)."""
    idx = layer.linear_attn.layer_idx
    recording = getattr(cache, "is_recording_past", None)
    if recording is not None and recording(idx):
        return None
    return cache.get_conv_state(idx), cache.get_recurrent_state(idx)


def gdn_chain_count(layer: nn.Module, cache: Any) -> None:
    """After a chain or plan step of this layer: its token counted in ``cache``
    (:func:`count_step`)."""
    count_step(cache, layer.linear_attn.layer_idx)


def _block_may_run(m: nn.Module, x: torch.Tensor, cache: Any, attention_mask: Any,
                   kwargs: dict) -> bool:
    """Whether ``m``'s GdnBlock may take this call at all: a CPU input of the block's dtype
    without a padding mask, gradients or packed sequences, on a cache with transformers'
    linear-attention API, in eval mode (the conditions :func:`_gdn_states` and
    :func:`_gdn_recorded` share)."""
    dt = m._specmoe_gdn_shape.dtype
    return not (cache is None or attention_mask is not None or x.dtype != dt
                or x.device.type != "cpu" or m.training
                or (torch.is_grad_enabled() and x.requires_grad)
                or kwargs.get("cu_seq_lens_q") is not None
                or not hasattr(cache, "get_conv_state")
                or not hasattr(cache, "get_recurrent_state"))


def _layer_states(m: nn.Module, cache: Any, B: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The conv window [B, C, columns] and recurrent state [B, Hv, dk, dv] of ``m``'s layer in
    ``cache`` when they have the forms the block reads (CPU, the window in f32 / bf16, the
    state f32 and contiguous), else None."""
    C, Hv, dk, dv, _ = m._specmoe_gdn_shape
    idx = m.layer_idx
    conv, rec = cache.get_conv_state(idx), cache.get_recurrent_state(idx)
    if conv is None or rec is None or conv.dtype not in BLOCK_DTYPES \
            or rec.dtype != torch.float32 or not rec.is_contiguous() \
            or conv.device.type != "cpu" or rec.device.type != "cpu" \
            or conv.dim() != 3 or tuple(conv.shape[:2]) != (B, C) \
            or tuple(rec.shape) != (B, Hv, dk, dv):
        return None
    return conv, rec


def _gdn_states(m: nn.Module, x: torch.Tensor, cache: Any, attention_mask: Any,
                kwargs: dict) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The conv window and recurrent state of ``m``'s layer in ``cache`` when the block can run
    x [B, 1, hidden] on them in place, else None (the module's own forward runs)."""
    B, T = x.shape[0], x.shape[1]
    if T != 1 or B > GDN_MAX_ROWS or not _block_may_run(m, x, cache, attention_mask, kwargs):
        return None
    recording = getattr(cache, "is_recording_past", None)
    if recording is not None and recording(m.layer_idx):
        return None
    states = _layer_states(m, cache, B)
    if states is None or not states[0].is_contiguous():
        return None
    return states


def _gdn_recorded(m: nn.Module, x: torch.Tensor, cache: Any, attention_mask: Any,
                  kwargs: dict) -> torch.Tensor | None:
    """x [B, T, hidden] through ``m``, one ``GdnBlock.steps`` call per row, when ``cache`` records
    ``m``'s layer (a speculative verification, ``specmoe.speculation.decoding.new_kv(rollback=
    True)``) and keeps at least T states, as transformers' forward computes it there (every
    token a recurrent step, the window grown by the T inputs, the state after each token
    recorded so a crop can restore it), else None (the module's own forward runs).  The cache
    is updated through its own API: ``update_conv_state`` with the T new columns (it grows the
    window and counts the tokens), ``update_recurrent_state`` with the T states.  B > 1: the
    rows of a batch's verification (:class:`specmoe.speculation.batch.BatchKV` recording),
    each row the very call its verification alone makes, so it keeps that call's bits."""
    C, Hv, dk, dv, _ = m._specmoe_gdn_shape
    B, T = x.shape[0], x.shape[1]
    recording = getattr(cache, "is_recording_past", None)
    keep = getattr(cache, "get_recurrent_states_to_keep", None)
    if (B < 1 or B > GDN_MAX_ROWS or T > GDN_MAX_ROWS or recording is None or keep is None
            or not hasattr(cache, "update_conv_state")
            or not hasattr(cache, "update_recurrent_state")
            or not _block_may_run(m, x, cache, attention_mask, kwargs)):
        return None
    idx = m.layer_idx
    if not recording(idx) or T > int(keep(idx) or 0):
        return None
    states = _layer_states(m, cache, B)
    K = int(m.conv1d.kernel_size[0])
    if states is None or states[0].shape[-1] < K - 1:
        return None
    conv, rec = states
    L0 = conv.shape[-1]
    win = torch.empty(B, C, L0 + T, dtype=conv.dtype)
    win[:, :, :L0] = conv
    hist = torch.empty(B, T, Hv, dk, dv)   # row b's T states side by side, as steps writes them
    xa = x.detach()
    if not xa.is_contiguous():
        xa = xa.contiguous()
    out = torch.empty_like(xa)
    r = rec.detach()
    for b in range(B):  # (steps reads the row's state and writes its T successors to hist)
        m._specmoe_gdn.steps(tensor_array(xa[b]), tensor_array(win[b]), r[b].numpy(),
                             hist[b].numpy(), tensor_array(out[b]))
    cache.update_conv_state(win[:, :, L0:], idx, conv_kernel_size=K)
    # the cache keeps [B, ...] states per token: one batch's state after each of the T tokens
    steps = list(hist.unbind(1)) if B == 1 else list(hist.transpose(0, 1).contiguous().unbind(0))
    cache.update_recurrent_state(steps, idx)
    return out


def count_step(cache: Any, idx: int) -> None:
    """Count one token in layer ``idx`` of ``cache`` after a fused step wrote its conv window in
    place.  transformers 5.25's linear-attention cache layers keep their own token count, which
    the cache's ``get_seq_length`` reads when layer 0 is one (Qwen3-Next, Qwen3.5), and which its
    in-place decode path advances with ``increase_count``; earlier versions have neither."""
    inc = getattr(cache, "increase_count", None)
    if inc is not None:
        inc(idx, 0)


def _gdn_forward(m: nn.Module, original: Callable) -> Callable:
    """``m``'s forward with its one-token cached steps through its GdnBlock."""
    def forward(hidden_states: torch.Tensor, cache: Any = None,
                attention_mask: torch.Tensor | None = None, **kwargs: Any) -> Any:
        states = _gdn_states(m, hidden_states, cache, attention_mask, kwargs)
        if states is None:
            out = _gdn_recorded(m, hidden_states, cache, attention_mask, kwargs)
            if out is not None:
                return out
            return original(hidden_states, cache=cache, attention_mask=attention_mask, **kwargs)
        conv, rec = states
        B, _, hidden = hidden_states.shape
        x = hidden_states.detach().reshape(B, hidden)
        if not x.is_contiguous():
            x = x.contiguous()
        out = torch.empty_like(x)
        m._specmoe_gdn.step(tensor_array(x), tensor_array(conv), rec.detach().numpy(),
                            tensor_array(out))
        count_step(cache, m.layer_idx)
        return out.reshape(B, 1, hidden)
    forward.__name__ = f"specmoe_fused_{type(m).__name__}_forward"
    return forward


def _gdn_layer_args(layer: nn.Module, x: torch.Tensor, cache: Any, attention_mask: Any,
                    kwargs: dict) -> tuple | None:
    """``_C.GdnBlock.layer``'s arguments but the output for x [B, 1, hidden] through a Qwen3.5
    decoder layer whose linear attention is fused, or None when the layer's own forward must
    run: the module's own conditions (:func:`_gdn_states`), its MoE block routed in C now
    (``decode_route``), both norms :class:`CRMSNorm` of one form in the layer's dtype."""
    attn = layer.linear_attn
    route = decode_route(layer, x) if not layer.training else None
    if route is None:
        return None
    norms = (layer.input_layernorm, layer.post_attention_layernorm)
    if not all(type(n) is CRMSNorm and not n.training and n.weight.dtype == x.dtype
               and n.c_weight.shape == (x.shape[-1],) for n in norms) \
            or norms[0].zero_centred != norms[1].zero_centred:
        return None
    states = _gdn_states(attn, x, cache, attention_mask, kwargs)
    if states is None:
        return None
    conv, rec = states
    eng, pos, flags = route.engine, route.pos, route.flags
    B, _, hidden = x.shape
    xa = x.detach().reshape(B, hidden)
    if not xa.is_contiguous():
        xa = xa.contiguous()
    return (eng, pos, flags, tensor_array(xa), tensor_array(conv), rec.detach().numpy(),
            norms[0].c_weight, norms[0].variance_epsilon, norms[1].c_weight,
            norms[1].variance_epsilon,
            norms[0].zero_centred)


def _gdn_layer_forward(layer: nn.Module, original: Callable) -> Callable:
    """A Qwen3.5 decoder layer's forward whose one-token cached steps of a linear-attention
    layer are one ``_C.GdnBlock.layer`` call: input norm, the gated DeltaNet module, residual
    add, post-attention norm, the MoE block routed in C (router, experts, gated shared expert),
    residual add -- each as the module-by-module path computes it."""
    def forward(hidden_states: torch.Tensor, *args: Any, attention_mask: Any = None,
                cache: Any = None, **kwargs: Any) -> Any:
        if cache is None:
            cache = kwargs.get("past_key_values")
        a = None if args else _gdn_layer_args(layer, hidden_states, cache, attention_mask,
                                                kwargs)
        if a is None:
            if cache is not None and "past_key_values" not in kwargs:
                kwargs["cache"] = cache
            return original(hidden_states, *args, attention_mask=attention_mask, **kwargs)
        eng = a[0]
        out = torch.empty(hidden_states.shape, dtype=hidden_states.dtype)
        B, _, hidden = hidden_states.shape
        with eng.layer_call_slot():  # the Engine's layers read inside: set_cache swaps them
            layer.linear_attn._specmoe_gdn.layer(eng.layers, *a[1:],
                                                 tensor_array(out.view(B, hidden)))
        count_step(cache, layer.linear_attn.layer_idx)
        return out
    forward.__name__ = f"specmoe_fused_{type(layer).__name__}_forward"
    return forward

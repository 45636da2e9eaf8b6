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
  (:func:`use_c_gated_delta`).

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
from typing import Any, Callable

import numpy as np
import torch
from torch import nn

__all__ = ["prepare", "f32_short_convs", "use_c_gated_delta"]

# the KernelContext the gated delta rule runs on while a converted module's forward runs, else
# None (transformers' own torch code)
_CTX: contextvars.ContextVar[Any] = contextvars.ContextVar("specmoe_gated_delta", default=None)
_FN = "torch_recurrent_gated_delta_rule"


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
            src = _class_source(type(parent))
            if src is None or re.search(rf"self\.{re.escape(attr)}\(", src) \
                    or not re.search(rf"self\.{re.escape(attr)}\.weight\b", src):
                continue
            conv.float()
            out.append(f"{parent_name}.{attr}" if parent_name else attr)
    return out


def _c_step(ctx: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
            g: torch.Tensor, beta: torch.Tensor, initial_state: torch.Tensor | None,
            output_final_state: bool, l2norm: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """torch_recurrent_gated_delta_rule's result from the C kernel: the output in the query's
    dtype, the final state in f32 (the state passed is updated in place when it is f32 and
    contiguous and the final state is asked for: transformers copies it into its cache right
    after)."""
    B, T, Hk, dk = key.shape
    Hv, dv = value.shape[-2:]

    def f32(x: torch.Tensor) -> np.ndarray:
        return x.detach().to(torch.float32).contiguous().numpy()

    if (initial_state is not None and output_final_state and initial_state.is_contiguous()
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


def _dispatcher(original: Callable) -> Callable:
    """``original`` (transformers' torch_recurrent_gated_delta_rule of one modeling module)
    behind a switch: the C kernel while a converted module's forward runs (:data:`_CTX`), the
    original everywhere else and for what the kernel does not take (variable-length packed
    sequences, tensors off the CPU, autograd)."""
    def torch_recurrent_gated_delta_rule(query, key, value, g, beta, initial_state=None,
                                         output_final_state=False,
                                         use_qk_l2norm_in_kernel=False, **kw):
        ctx = _CTX.get()
        if (ctx is None or kw.get("cu_seqlens") is not None or query.device.type != "cpu"
                or (torch.is_grad_enabled() and query.requires_grad)):
            return original(query, key, value, g=g, beta=beta, initial_state=initial_state,
                            output_final_state=output_final_state,
                            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **kw)
        return _c_step(ctx, query, key, value, g, beta, initial_state, output_final_state,
                       use_qk_l2norm_in_kernel)
    torch_recurrent_gated_delta_rule._specmoe_original = original  # type: ignore[attr-defined]
    return torch_recurrent_gated_delta_rule


def _agrees(ctx: Any, original: Callable) -> bool:
    """Whether the C kernel gives ``original``'s result on a small random problem (grouped
    value heads, three tokens, both q/k normalisations): a transformers version whose rule
    differs keeps its own code."""
    g = torch.Generator().manual_seed(0)
    B, T, Hk, Hv, dk, dv = 2, 3, 2, 4, 16, 8
    q, k = (torch.randn(B, T, Hk, dk, generator=g) for _ in range(2))
    v = torch.randn(B, T, Hv, dv, generator=g)
    decay, beta = -torch.rand(B, T, Hv, generator=g), torch.rand(B, T, Hv, generator=g)
    s0 = torch.randn(B, Hv, dk, dv, generator=g)
    for l2 in (True, False):
        want, ws = original(q, k, v, g=decay, beta=beta, initial_state=s0.clone(),
                            output_final_state=True, use_qk_l2norm_in_kernel=l2)
        got, gs = _c_step(ctx, q, k, v, decay, beta, s0.clone(), True, l2)
        if not (torch.allclose(got, want, atol=1e-4, rtol=1e-4)
                and torch.allclose(gs, ws, atol=1e-4, rtol=1e-4)):
            return False
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
            original = getattr(fn, "_specmoe_original", fn)
            if ns.__name__ not in checked:
                checked[ns.__name__] = _agrees(ctx, original)
                if not checked[ns.__name__]:
                    warnings.warn(f"{ns.__name__}.{_FN} does not agree with specmoe's gated "
                                  "delta kernel; its layers keep transformers' torch code",
                                  stacklevel=3)
                elif fn is original:
                    setattr(ns, _FN, _dispatcher(original))
            if not checked[ns.__name__] or getattr(mod, "_specmoe_c_gated_delta", False):
                continue
            _switch_on(mod, ctx)
            done.append(name)
    return done


def _switch_on(mod: nn.Module, ctx: Any) -> None:
    """``mod``'s forward with the switch of :data:`_CTX` set to ``ctx`` while it runs."""
    inner = mod.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        token = _CTX.set(ctx)
        try:
            return inner(*args, **kwargs)
        finally:
            _CTX.reset(token)
    mod.forward = forward  # type: ignore[method-assign]
    mod._specmoe_c_gated_delta = True  # type: ignore[assignment]

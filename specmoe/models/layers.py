"""The C-backed torch modules the model adapters build on: :class:`CLinear` (an ``nn.Linear``
computed by specmoe's kernels), :class:`CRMSNorm` (a Llama-form RMSNorm at decode sizes) and
the weight helpers shared by the attention, MLA and dense-layer conversions.

This module sits below :mod:`specmoe.models.attention`, :mod:`specmoe.models.mla` and :mod:`specmoe.models.dense`,
which all build on it and on nothing of each other's that would close a cycle.
"""
from __future__ import annotations

import contextlib
import contextvars
import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterator, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .. import _C
from .arch import F32_SCALED_RMSNORMS, LLAMA_RMSNORMS, ZERO_CENTRED_RMSNORMS
from ..runtime.kernels import GGUF_BLOCKS, context, dtype_code, tensor_array
from ..storage.quant import quantize_int4, quantize_int8

__all__ = ["DENSE_DTYPES", "TORCH_ABOVE", "BLOCK_DTYPES", "CLinear", "CRMSNorm", "fuse_qkv",
           "linear_widened", "torch_bf16_gemm_fast",
           "int4_group", "norm_weight", "zero_centred_norm", "per_sequence", "sequence_rows",
           "sequences", "silu_mlp_parts", "split_sequences", "split_shared_gate",
           "dense_in_call", "dense_mlp", "set_dense_mlp", "ChainStep", "BlockRoute",
           "decode_route", "set_block_route", "chain_step", "set_chain_step"]


@dataclass(frozen=True)
class ChainStep:
    """How a fused decoder layer takes part in a decode step's one C call
    (specmoe.models.decode_step: ``_C.layer_chain`` and ``_C.DecodePlan``).  The module that
    fused the layer (specmoe.models.attention, .mla, .linear_attn) gives the layer one
    (:func:`set_chain_step`); decode_step reads it (:func:`chain_step`; and
    specmoe.models.dense, to tell that every layer has one).  Every function takes the layer
    first.

    * ``call(layer, x, out, pe, cache)``: the step of x [1, T, hidden] into out as a
      ``_C.layer_chain`` item (block, arguments, KV buffers or None, Engine or None), or None
      when this step must take the layer's forward;
    * ``rope(layer, pe, T)``: ((index, array), ...), the rotary arrays among the item's
      arguments for the last T positions of ``pe`` (over a table of every position: a plan's
      rotary tables);
    * ``state(layer, cache)``: what the item writes in place in ``cache`` (a plan holds while
      it is the same objects), None when no plan may run now; None for a layer without
      recurrent state;
    * ``count(layer, cache)``: after a chain or plan step, the layer's token counted in
      ``cache``; None for a layer whose KV buffers' advance counts it;
    * ``norms``: (input norm weight, its epsilon, post-attention norm weight, its epsilon) as
      the fused block's C call takes them (attention and MLA layers; None for the others)."""

    call: Callable[..., Any]
    rope: Callable[..., Any]
    state: Callable[..., Any] | None = None
    count: Callable[..., Any] | None = None
    norms: tuple[Any, float, Any, float] | None = None


def set_chain_step(layer: nn.Module, step: ChainStep) -> None:
    """Give a fused decoder layer its :class:`ChainStep`; the one writer of what
    :func:`chain_step` reads."""
    object.__setattr__(layer, "_specmoe_chain", step)


def chain_step(layer: nn.Module) -> ChainStep | None:
    """The :class:`ChainStep` of a fused decoder layer, None for a layer nobody fused."""
    return getattr(layer, "_specmoe_chain", None)


class BlockRoute(NamedTuple):
    """What a fused decoder layer needs to run its MoE block inside its own C call
    (``_C.AttnBlock.layer``, ``_C.MLABlock.layer``, ``_C.GdnBlock.layer``): set by
    ``Engine._install_routing`` on the block (:func:`set_block_route`), read through
    :func:`decode_route`."""

    engine: Any  # the specmoe.runtime.engine.Engine (its layers, routable(), layer_call_slot())
    pos: int  # the block's MoE layer position
    flags: int  # the C route flags (_C.ROUTE_*)
    dtype: Any  # the torch dtype the block routes in


DENSE_DTYPES = ("f32", "bf16", "int8", "int4")
# a CLinear's dtype may also be a GGUF block kind (q4_0, q8_0, q4_k, ...: GGUF_BLOCKS), its
# weight then the blocks a GGUF file holds (blocks=; dense="gguf", specmoe.models.dense)
_ALIGN = 64


# Decode-sized inputs: up to this many tokens the C kernels beat torch's GEMM on this machine
# class (benchmarks/dense_linear.py measures the crossover); beyond it f32/bf16 go to torch.
TORCH_ABOVE = 16
# linear_widened's chunk: the bf16 weight rows it widens at once into its one f32 buffer, 2 MiB
# of them or 256 rows, whichever is more (at K = 10944, 47-row chunks ran the [1024, K] product
# about 1.2x slower than 256-row ones on two Zen 1 cores; 512 rows were no faster)
_WIDEN_CHUNK_BYTES = 2 << 20
_WIDEN_MIN_ROWS = 256

# sequences of one length side by side in the forward running in this thread (sequences())
_SEQUENCES: contextvars.ContextVar[int] = contextvars.ContextVar("specmoe_sequences", default=1)


@contextlib.contextmanager
def sequences(n: int) -> Iterator[None]:
    """Within the block, the forwards of this thread hold ``n`` sequences of one length side
    by side (a batch of equal-length prompts, specmoe.speculation.batch.BatchKV.prefill):
    specmoe's switches between its C kernels (decode sizes) and torch (longer inputs) --
    CLinear's ``torch_above``, CRMSNorm's rows, a shared FFN's bound -- count one sequence's
    rows (:func:`sequence_rows`), so each sequence takes the implementations it would take
    alone.  With the C kernels batch invariant and the products left in torch run one sequence
    at a time (:func:`per_sequence`), a sequence then gets the bits of its forward alone.
    Outside any block: 1, the whole input counts."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"sequences: n must be an int >= 1, got {n!r}")
    tok = _SEQUENCES.set(n)
    try:
        yield
    finally:
        _SEQUENCES.reset(tok)


def sequence_rows(rows: int) -> int:
    """The rows of one sequence out of an input of ``rows`` rows (tokens, or tokens x heads):
    ``rows`` divided by the sequences of the enclosing :func:`sequences` block (``rows`` itself
    outside one, or when they do not divide it)."""
    n = _SEQUENCES.get()
    return rows // n if n > 1 and rows % n == 0 else rows


def per_sequence(fn: Callable[..., Any], x: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
    """``fn(x)`` for a row-wise ``fn`` (a torch GEMM, a norm, a router), computed one
    sequence at a time inside a :func:`sequences` block of n > 1 whose count divides x's rows
    (x's leading dimensions flattened, the sequences one after another: a batch-first
    ``[n, L, ...]`` or ``[n * L, ...]``); plain ``fn(x)`` otherwise.  Each sequence's rows
    then go through the call its forward alone makes, so they get its bits whatever the host's
    BLAS does with more rows: MKL's bf16 and f32 GEMMs on an Intel Xeon with AMX gave rows
    0-19 of a 40-row product other bits than the 20-row product of those rows alone (the
    AMD EPYC hosts this suite passed on before gave the same).  It costs one call per sequence
    where a prefill batch runs in torch.  The parts' outputs are joined along their first
    dimension, and take x's leading dimensions back where ``fn`` kept its part's (a GEMM, a
    norm); an output that ``fn`` flattened to rows (a router's) stays as joined.  A tuple
    (a router's logits, weights and indices) is joined item by item, None passed through.
    Further arguments go to every part unchanged (LFM2-MoE's router takes its expert bias)."""
    n = _SEQUENCES.get()
    rows = x.numel() // x.shape[-1] if x.dim() and x.shape[-1] else 0
    if n <= 1 or rows == 0 or rows % n:
        return fn(x, *args, **kwargs)
    # batch-first input: each sequence as the [1, L, ...] its forward alone passes (a block's
    # forward unpacks three dimensions); else [L, H] parts of the flattened rows
    whole = x.dim() >= 3 and x.shape[0] == n
    parts = [x[i:i + 1] for i in range(n)] if whole else \
        list(x.reshape(n, rows // n, x.shape[-1]).unbind(0))
    tok = _SEQUENCES.set(1)  # each part is one sequence to what fn calls in turn
    try:
        outs = [fn(part, *args, **kwargs) for part in parts]
    finally:
        _SEQUENCES.reset(tok)

    def join(items: list[torch.Tensor]) -> torch.Tensor:
        out = torch.cat(items, 0)
        if items[0].shape[:-1] == parts[0].shape[:-1]:  # fn kept the part's dimensions
            out = out.reshape(*x.shape[:-1], out.shape[-1])
        return out
    if isinstance(outs[0], tuple):
        return tuple(join([o[j] for o in outs]) if isinstance(first, torch.Tensor) else first
                     for j, first in enumerate(outs[0]))
    return join(outs)


def split_sequences(module: nn.Module) -> nn.Module:
    """Make ``module``'s forward run one sequence at a time inside a :func:`sequences` block
    (:func:`per_sequence`; a plain call elsewhere), once however often it is called: for a
    row-wise module whose product stays in torch -- a MoE block's router, whose f32 or bf16
    GEMM would otherwise give a prompt of a batched prefill other bits than its prefill
    alone on a host whose BLAS rounds by shape.  Returns ``module``."""
    if not module.__dict__.get("_specmoe_split_sequences", False):
        module.forward = functools.partial(per_sequence, module.forward)
        module._specmoe_split_sequences = True
    return module


# the blocks that take a sigmoid gate of their shared expert in torch (one forward, the same in
# each), by the router class of transformers 5's form (logits, weights and indices)
SHARED_GATE_BLOCKS = {"Qwen2MoeSparseMoeBlock": "Qwen2MoeTopKRouter",
                      "Qwen3NextSparseMoeBlock": "Qwen3NextTopKRouter",
                      "Qwen3_5MoeSparseMoeBlock": "Qwen3_5MoeTopKRouter"}


def split_shared_gate(block: nn.Module) -> bool:
    """Give a Qwen2-MoE block (Qwen3-Next's, Qwen3.5-MoE's: ``SHARED_GATE_BLOCKS``) a forward
    whose shared expert's sigmoid gate runs one sequence at a time inside :func:`sequences`
    (:func:`per_sequence`); the same operations in the same order as transformers' forward
    otherwise.  Its forward takes that sigmoid in torch over the whole batch, and torch's
    vector sigmoid gives a tensor's tail other bits than its body (on an Intel Xeon with
    AVX-512: 32 rows against the same 8 alone), so a prompt of a batched prefill left its
    bits.  Returns whether ``block`` was one (transformers 5's form: the
    router returning logits, weights and indices; ``tests/test_generate.py`` holds every
    architecture to the unmodified model's greedy output)."""
    router = SHARED_GATE_BLOCKS.get(type(block).__name__)
    if router is None or type(getattr(block, "gate", None)).__name__ != router \
            or not all(hasattr(block, a) for a in ("experts", "shared_expert",
                                                   "shared_expert_gate")):
        return False
    if block.__dict__.get("_specmoe_split_shared_gate", False):
        return True

    def gate(x: torch.Tensor) -> torch.Tensor:
        return F.sigmoid(block.shared_expert_gate(x))

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        batch, length, hidden = hidden_states.shape
        x = hidden_states.view(-1, hidden)
        shared = block.shared_expert(x)
        _, weights, experts = block.gate(x)
        out = block.experts(x, experts, weights)
        out = out + per_sequence(gate, x) * shared
        return out.reshape(batch, length, hidden)
    forward.__name__ = "specmoe_split_shared_gate_forward"
    block.forward = forward
    block._specmoe_split_shared_gate = True
    return True


def int4_group(K: int) -> int | None:
    for g in (128, 64, 32):
        if K % g == 0:
            return g
    return None


def _file_mapped(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory lies in a mapping of a file (a checkpoint transformers loaded
    through safetensors' mmap), per ``/proc/self/maps``; False where that cannot be read."""
    p = t.data_ptr()
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                span, _, rest = line.partition(" ")
                lo, _, hi = span.partition("-")
                if int(lo, 16) <= p < int(hi, 16):
                    fields = rest.split(None, 4)  # perms, offset, device, inode, path
                    return len(fields) > 3 and fields[3] != "0"
    except (OSError, ValueError):
        return False
    return False


_PACK_CHUNK_BYTES = 32 << 20  # f32 bytes of the rows _pack quantizes at once


def _pack(weight: torch.Tensor, dtype: str, copy_mapped: bool = True,
          group: int | None = None) -> tuple[np.ndarray, dict[str, Any], torch.Tensor | None]:
    """The weight as the kernels read it: (uint8 block, descriptor, torch view).  f32/bf16: the
    block IS the weight tensor's memory when it already has that dtype (shared, not copied;
    else a converted copy) and the torch view is that tensor -- except, with ``copy_mapped``,
    a tensor in a file mapping (a checkpoint's mmap), which is copied into memory of its own:
    OLMoE's attention projections (bf16, 16 x 8 MB back to back, 1 thread, interleaved in one
    process) read 20.0 GB/s from safetensors' mapping against 23.2 from an anonymous copy
    (huge pages or not: 22.7), 27.7 against 29.1 at 2 threads; int8/int4: quantized weight and
    scales in one block (64-byte aligned parts), no torch view."""
    N, K = (int(s) for s in weight.shape)
    w = weight.detach()
    if dtype in ("f32", "bf16"):
        tw = w.to(torch.float32 if dtype == "f32" else torch.bfloat16).contiguous()
        if copy_mapped and tw.data_ptr() == w.data_ptr() and _file_mapped(tw):
            tw = tw.clone()
        block = tw.view(torch.uint8).reshape(-1).numpy()
        return block, {"N": N, "K": K, "dtype": dtype_code(dtype), "weight": 0}, tw
    group = None if dtype == "int8" else (group or int4_group(K))

    def quantize(rows: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        a = rows.float().numpy()
        return quantize_int8(a) if dtype == "int8" else quantize_int4(a, group or 0)

    # in chunks of rows (each row's values and scales are its own), so that converting a large
    # matrix (an lm_head of 102400 x 2048) holds one chunk in f32, not the whole matrix: the
    # load peak a memory plan counts on (specmoe.runtime.memplan)
    step = max(1, _PACK_CHUNK_BYTES // (4 * K))
    q0, s0 = quantize(w[:min(step, N)])
    qrow, srow = q0.nbytes // q0.shape[0], s0.nbytes // q0.shape[0]
    s_off = -(-(qrow * N) // _ALIGN) * _ALIGN
    block = np.zeros(s_off + srow * N, dtype=np.uint8)
    for r0 in range(0, N, step):
        q, sc = (q0, s0) if r0 == 0 else quantize(w[r0:r0 + step])
        n = q.shape[0]
        block[r0 * qrow:(r0 + n) * qrow] = q.reshape(-1).view(np.uint8)
        block[s_off + r0 * srow:s_off + (r0 + n) * srow] = sc.reshape(-1).view(np.uint8)
    desc = {"N": N, "K": K, "dtype": dtype_code(dtype), "group": group, "weight": 0,
            "weight_scale": s_off}
    return block, desc, None


def _pack_blocks(blocks: np.ndarray, kind: str, N: int, K: int
                 ) -> tuple[np.ndarray, dict[str, Any]]:
    """A GGUF block matrix (uint8 [N, K / block columns, block bytes] of ``kind``) as the
    kernels read it: the same bytes, one row of blocks after another (no copy when they are
    contiguous already)."""
    cols, nbytes = GGUF_BLOCKS[kind]
    want = (N, K // cols, nbytes)
    if not isinstance(blocks, np.ndarray) or blocks.dtype != np.uint8 or K % cols \
            or tuple(blocks.shape) != want:
        got = (f"{blocks.dtype} {tuple(blocks.shape)}" if isinstance(blocks, np.ndarray)
               else type(blocks).__name__)
        raise ValueError(f"{kind} blocks of a {K} -> {N} linear layer must be uint8 {want} "
                         f"(K a multiple of {cols}), got {got}")
    block = np.ascontiguousarray(blocks).reshape(-1)
    return block, {"N": N, "K": K, "dtype": dtype_code(kind), "weight": 0}


@functools.lru_cache(maxsize=None)
def torch_bf16_gemm_fast() -> bool:
    """Whether torch's bf16 matrix products run through oneDNN on this CPU (it needs AVX-512;
    AVX-512 BF16 or AMX make them native).  Where not (AVX2-only hosts), torch takes a
    fallback GEMM, and :class:`CLinear` computes long bf16 inputs with :func:`linear_widened`
    there: on two Zen 1 cores a 1024-token prompt forward of the 4-layer DeepSeek-V2-Lite-shaped
    model took 60-70 s through torch's bf16 GEMM and 24-25 s widened
    (benchmarks/results/bf16_prefill_dsv2lite_L4_epyc_zen1.json)."""
    try:
        return bool(torch.backends.mkldnn.is_available()
                    and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a torch without the query: assume the fallback
        return False


def linear_widened(x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` for a bf16 ``weight``, computed by torch's f32 GEMM: the
    weight's rows are widened to f32 a chunk at a time (2 MiB or 256 rows) into one buffer (so
    the f32 copy never exists whole: an lm_head of 102400 x 2048 would take 800 MiB), each
    chunk's product written to its rows of a transposed [out, tokens] f32 result (that result
    is f32 whatever the output dtype: at bf16 it is twice the output's bytes until the end).
    ``x`` is read in f32 as it is (not rounded to bf16 first, as the C kernels read it);
    ``bias`` (any float dtype) is added in f32; one rounding to x's dtype (f32 for other input
    dtypes) at the end.  For hosts where torch's own bf16 GEMM is the slow fallback
    (:func:`torch_bf16_gemm_fast`)."""
    N, K = (int(s) for s in weight.shape)
    if x.shape[-1] != K:
        raise ValueError(f"linear_widened: input has {x.shape[-1]} features, weight {K}")
    lead, weight = x.shape[:-1], weight.detach()  # inference only (mm's out= takes no grad)
    xt = x.detach().reshape(-1, K).to(torch.float32).t()  # [K, T]
    T = int(xt.shape[1])
    out_t = torch.empty(N, T, dtype=torch.float32)
    step = max(1, min(N, max(_WIDEN_MIN_ROWS, _WIDEN_CHUNK_BYTES // (4 * max(K, 1)))))
    buf = torch.empty(step, K, dtype=torch.float32)
    for r0 in range(0, N, step):
        n = min(step, N - r0)
        buf[:n].copy_(weight[r0:r0 + n])
        torch.mm(buf[:n], xt, out=out_t[r0:r0 + n])
    if bias is not None:
        out_t.add_(bias.detach().to(torch.float32)[:, None])
    odt = x.dtype if x.dtype in (torch.float32, torch.bfloat16) else torch.float32
    out = torch.empty(T, N, dtype=odt)
    out.copy_(out_t.t())
    return out.reshape(*lead, N)


class CLinear(nn.Module):
    """Inference-only replacement of an ``nn.Linear`` computed by specmoe's C kernels.

    ``CLinear(linear, dtype, ctx=None, torch_above=TORCH_ABOVE, copy_mapped=True)``: ``dtype``
    is one of :data:`DENSE_DTYPES`; ``ctx`` the :class:`specmoe._C.KernelContext` (default:
    the process one).  Output dtype and shape are those of ``linear``; the computation is in
    f32 on the stored weights.  The original module's parameters are not kept.  f32/bf16
    weights are read in place, unless they lie in a file mapping (a checkpoint's mmap) and
    ``copy_mapped``: then the layer reads a copy of its own (faster; see ``_pack``).
    ``group``: int4's group size (default: the largest of 128, 64, 32 dividing in_features;
    32 is GGUF's Q4_0 block).  ``dtype`` may also be a GGUF block kind (``"q4_0"``,
    ``"q8_0"``, ``"q4_k"``, ... :data:`specmoe.runtime.kernels.GGUF_BLOCKS`): ``blocks`` is
    then the weight as a GGUF file holds it, uint8 [out_features, in_features / block columns,
    block bytes] (:meth:`specmoe.storage.gguf.GgufCheckpoint.dense_blocks`), read by the
    experts' block kernels as it is; like int8/int4, every input size runs in C.
    """

    def __init__(self, linear: nn.Linear, dtype: str, ctx: _C.KernelContext | None = None,
                 torch_above: int | None = TORCH_ABOVE, copy_mapped: bool = True,
                 group: int | None = None, blocks: np.ndarray | None = None):
        super().__init__()
        if dtype not in DENSE_DTYPES and dtype not in GGUF_BLOCKS:
            raise ValueError(f"dense dtype must be one of {DENSE_DTYPES} or a GGUF block kind "
                             f"({', '.join(GGUF_BLOCKS)}), got {dtype!r}")
        if (blocks is None) != (dtype not in GGUF_BLOCKS):
            raise ValueError(f"dtype {dtype!r}: " + (
                "a GGUF block kind needs blocks=, the weight's blocks as the file holds them"
                if blocks is None else "blocks= is for the GGUF block kinds only"))
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"CLinear replaces an nn.Linear, got {type(linear).__name__}")
        if blocks is None and (linear.weight.device.type != "cpu" or linear.weight.is_meta):
            raise ValueError("CLinear needs the layer's weights on the CPU")  # (blocks: read
            # as given, the layer's weight only says its shape and dtype and may be meta)
        if dtype == "int4" and int4_group(linear.in_features) is None:
            raise ValueError(f"int4 needs in_features to be a multiple of 32, got "
                             f"{linear.in_features}")
        if group is not None and (dtype != "int4" or group % 32 or linear.in_features % group):
            raise ValueError(f"group={group}: int4 only, a multiple of 32 dividing in_features "
                             f"({linear.in_features}); got dtype {dtype!r}")
        self.in_features = int(linear.in_features)
        self.out_features = int(linear.out_features)
        self.dtype = dtype
        self.out_dtype = linear.weight.dtype
        # f32/bf16: _tw is the weight tensor the kernels read (torch runs long inputs on it)
        if blocks is not None:
            self._block, self._desc = _pack_blocks(blocks, dtype, self.out_features,
                                                   self.in_features)
            self._tw = None
        else:
            self._block, self._desc, self._tw = _pack(linear.weight, dtype, copy_mapped, group)
        b = linear.bias
        self._bias = None if b is None else np.ascontiguousarray(b.detach().float().numpy())
        self._tb = None if b is None or self._tw is None else b.detach().to(self._tw.dtype)
        self._c = _C.Linear(ctx if ctx is not None else context(), self._desc, self._block,
                            self._bias)
        self.torch_above = torch_above
        self.train(linear.training)

    @property
    def weight_view(self) -> torch.Tensor | None:
        """The f32/bf16 weight the C kernel reads, as a tensor (the original parameter's memory
        when it had that dtype); None for int8/int4 and GGUF blocks."""
        return self._tw

    @property
    def nbytes(self) -> int:
        """Bytes of this layer's weights and scales as the kernels read them."""
        return int(self._block.nbytes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"CLinear({self.in_features} -> {self.out_features}): input has "
                             f"{x.shape[-1]} features")
        lead = x.shape[:-1]
        T = x.numel() // self.in_features if self.in_features else 0
        if self._tw is not None and self.torch_above is not None \
                and sequence_rows(T) > self.torch_above:
            if self._tw.dtype == torch.bfloat16 and not torch_bf16_gemm_fast():
                b = None if self._bias is None else torch.from_numpy(self._bias)
                return per_sequence(lambda v: linear_widened(v, self._tw, b),
                                    x).to(self.out_dtype)
            return per_sequence(lambda v: F.linear(v.to(self._tw.dtype), self._tw, self._tb),
                                x).to(self.out_dtype)
        # f32 and bf16 go to the kernel as they are (it widens bf16 and rounds a bf16 output
        # as torch would): no casts around the call at decode sizes
        xf = x.detach().reshape(T, self.in_features)
        if xf.dtype not in (torch.float32, torch.bfloat16):
            xf = xf.to(torch.float32)
        if not xf.is_contiguous():
            xf = xf.contiguous()
        odt = self.out_dtype if self.out_dtype in (torch.float32, torch.bfloat16) \
            else torch.float32
        out = torch.empty(T, self.out_features, dtype=odt)
        self._c.forward(tensor_array(xf), tensor_array(out))
        if odt != self.out_dtype:
            out = out.to(self.out_dtype)
        return out.reshape(*lead, self.out_features)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, "
                f"dtype={self.dtype}, bias={self._bias is not None}")


def set_block_route(block: nn.Module, route: BlockRoute) -> None:
    """Give a MoE block the Engine route its fused decoder layer runs it under
    (``Engine._install_routing``); the one writer of what :func:`decode_route` reads."""
    object.__setattr__(block, "_specmoe_route", route)


def decode_route(layer: nn.Module, x: torch.Tensor) -> BlockRoute | None:
    """The Engine route (:class:`BlockRoute`) under which a one-call decoder layer
    (AttnBlock.layer, MLABlock.layer, GdnBlock.layer) runs its MoE block inside the call: set
    by ``Engine._install_routing`` on the layer's ``mlp`` (:func:`set_block_route`); None when
    the block has none, is training, or must route in Python now (``Engine.routable``)."""
    route = getattr(layer.mlp, "_specmoe_route", None)
    if route is None or layer.mlp.training \
            or not route.engine.routable(x, route.dtype, fused=True):
        return None
    return route


def mark_adapter_gate(mod: nn.Module, gate: Any | None) -> None:
    """Record (or, with None, forget) that a gated adapter wraps some of ``mod``'s projections
    and is switched by ``gate`` (an object whose ``index`` is None while the adapter is off).
    The one writer of the mark :func:`adapter_active` reads, so the attribute it keeps on
    the transformers module has one owner (issue 36)."""
    if gate is None:
        mod.__dict__.pop("_specmoe_gate", None)
    else:
        object.__setattr__(mod, "_specmoe_gate", gate)


def adapter_active(mod: nn.Module) -> bool:
    """Whether a gated adapter (:mod:`specmoe.speculation.mtp`'s GatedLoRA, whose modules are
    marked with its gate by :func:`mark_adapter_gate`) changes some of ``mod``'s projections
    in the forward running now.  The fused C blocks are built from the base weights: while
    this holds they must step aside for the module's own forward, whose wrapped projections
    apply the adapter."""
    g = getattr(mod, "_specmoe_gate", None)
    return g is not None and g.index is not None


def silu_mlp_parts(mlp: nn.Module | None) -> tuple[tuple[Any, Any, Any], torch.dtype,
                                                   int | None] | None:
    """A SiLU MLP module (``gate_proj``, ``up_proj``, ``down_proj``, ``act_fn``) as specmoe's C
    layer calls run it: its (gate, up, down) ``_C.Linear``, the dtype it computes in and the
    most tokens it runs in C (its CLinears' ``torch_above`` for f32/bf16 weights, else None);
    None unless the three projections are :class:`CLinear` of one f32/bf16 output dtype and
    the activation is SiLU.  The one rule for a DeepSeek MoE block's shared experts
    (``Engine._install_routing``) and a dense decoder layer's MLP (:mod:`specmoe.models.mla`)."""
    projs = [getattr(mlp, n, None) for n in ("gate_proj", "up_proj", "down_proj")]
    act = getattr(mlp, "act_fn", None)
    if mlp is None or not all(isinstance(p, CLinear) for p in projs) or \
            type(act).__name__ not in ("SiLUActivation", "SiLU"):
        return None
    dtypes = {p.out_dtype for p in projs}
    if len(dtypes) != 1 or not dtypes <= {torch.float32, torch.bfloat16}:
        return None
    most = projs[0].torch_above if projs[0].weight_view is not None else None
    return (projs[0]._c, projs[1]._c, projs[2]._c), dtypes.pop(), most


def set_dense_mlp(layer: nn.Module, parts: tuple[tuple[Any, Any, Any], torch.dtype,
                                                 int | None] | None) -> None:
    """Record that a dense decoder layer's MLP runs inside its fused block's C call:
    ``parts`` is :func:`silu_mlp_parts` of it as :mod:`specmoe.models.attention` /
    :mod:`specmoe.models.mla` gave it to the block's ``set_mlp`` (None: it does not).  The
    one writer of what :func:`dense_mlp` and :func:`dense_in_call` read."""
    if parts is None:
        layer.__dict__.pop("_specmoe_dense", None)
    else:
        object.__setattr__(layer, "_specmoe_dense", parts)


def dense_mlp(layer: nn.Module) -> tuple[tuple[Any, Any, Any], torch.dtype, int | None] | None:
    """What :func:`set_dense_mlp` recorded for ``layer``, or None."""
    return getattr(layer, "_specmoe_dense", None)


def dense_in_call(layer: nn.Module, T: int) -> bool:
    """Whether a dense decoder layer's MLP runs inside its block's one C call for T tokens
    (:func:`dense_mlp` of it; its CLinears' torch_above bounds the tokens, as for a shared
    FFN)."""
    dense = dense_mlp(layer)
    return dense is not None and not layer.mlp.training and (dense[2] is None or T <= dense[2])


BLOCK_DTYPES = (torch.float32, torch.bfloat16)


# the Llama-form RMSNorm classes, and specmoe's own replacement of them
_RMSNORMS = LLAMA_RMSNORMS + ("CRMSNorm",)


# rows up to which CRMSNorm runs in C (one thread); longer inputs are prefill, torch's
_NORM_MAX_ROWS = 64


def norm_weight(norm: nn.Module | None) -> np.ndarray | None:
    """An RMSNorm of the Llama family's form as its f32 weights, or None when ``norm`` is not
    one (a zero-centred one included, replaced by a CRMSNorm or not)."""
    if norm is None or type(norm).__name__ not in _RMSNORMS or getattr(norm, "zero_centred", 0) \
            or not hasattr(norm, "variance_epsilon") or getattr(norm, "weight", None) is None:
        return None
    return np.ascontiguousarray(norm.weight.detach().float().numpy())


def rms_norm_form(norm: nn.Module | None) -> tuple[np.ndarray, float, bool] | None:
    """An RMSNorm as the C kernels take it: (f32 weights, eps, zero-centred), the weights 1 +
    the module's for the zero-centred form; the f32-scaled form (``F32_SCALED_RMSNORMS``:
    GPT-OSS) is the zero-centred one with the module's weights as they are (both scale in f32
    and round once); a :class:`CRMSNorm` of any form included; None for any other module."""
    if isinstance(norm, CRMSNorm):
        return norm.c_weight, norm.variance_epsilon, norm.zero_centred
    w = norm_weight(norm)
    if w is not None:
        return w, float(norm.variance_epsilon), False
    if zero_centred_norm(norm):
        return (np.ascontiguousarray((1.0 + norm.weight.detach().float()).numpy()),
                float(norm.eps), True)
    if norm is not None and type(norm).__name__ in F32_SCALED_RMSNORMS \
            and isinstance(getattr(norm, "variance_epsilon", None), float) \
            and getattr(norm, "weight", None) is not None:
        return (np.ascontiguousarray(norm.weight.detach().float().numpy()),
                float(norm.variance_epsilon), True)
    return None


def zero_centred_norm(norm: nn.Module | None) -> bool:
    """Whether ``norm`` is a zero-centred RMSNorm (``ZERO_CENTRED_RMSNORMS``) with its weight
    and eps."""
    return norm is not None and type(norm).__name__ in ZERO_CENTRED_RMSNORMS \
        and isinstance(getattr(norm, "eps", None), float) \
        and getattr(norm, "weight", None) is not None


class CRMSNorm(nn.Module):
    """A Llama-form or zero-centred RMSNorm whose decode-sized calls run in C
    (``specmoe._C.rms_norm``, one call instead of seven torch operations; a bf16 model's
    roundings as torch makes them).  ``inner`` is the original module: it serves training,
    other devices and dtypes, and inputs of more than ``_NORM_MAX_ROWS`` rows; ``weight`` and
    ``variance_epsilon`` are its.

    The zero-centred form (``specmoe.models.arch.ZERO_CENTRED_RMSNORMS``: Qwen3-Next, Qwen3.5)
    scales by ``1 + w`` in f32 and rounds once at the end: the kernel gets ``1 + w`` (the f32
    values torch forms) and no intermediate bf16 rounding (:meth:`c_bf16`)."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        form = None if isinstance(norm, CRMSNorm) else rms_norm_form(norm)
        if form is None:
            forms = LLAMA_RMSNORMS + ZERO_CENTRED_RMSNORMS + F32_SCALED_RMSNORMS
            raise TypeError("CRMSNorm replaces a Llama-form, zero-centred or f32-scaled "
                            f"RMSNorm ({', '.join(forms)}), got {type(norm).__name__}")
        self.inner = norm
        self._w, self.variance_epsilon, self.zero_centred = form
        self.train(norm.training)  # an eval-mode model stays in eval mode (C path on)

    @property
    def weight(self) -> torch.Tensor:
        return self.inner.weight

    @property
    def c_weight(self) -> np.ndarray:
        """The f32 weights ``_C.rms_norm`` and the one-call layers take: the module's (Llama
        form) or 1 + the module's (zero-centred form)."""
        return self._w

    def c_bf16(self, dtype: torch.dtype) -> bool:
        """``_C.rms_norm``'s ``bf16`` argument for inputs of ``dtype`` (the per-step roundings
        of the Llama form; the zero-centred form rounds only its output)."""
        return dtype == torch.bfloat16 and not self.zero_centred

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[-1]
        dt = self.inner.weight.dtype
        if (self.training or x.device.type != "cpu" or x.dtype != dt or n != self._w.shape[0]
                or dt not in BLOCK_DTYPES or sequence_rows(x.numel() // n) > _NORM_MAX_ROWS):
            return per_sequence(self.inner, x)
        xf = x.reshape(-1, n).contiguous()
        out = torch.empty_like(xf)
        _C.rms_norm(tensor_array(xf), self._w, self.variance_epsilon, tensor_array(out),
                    self.c_bf16(dt))
        return out.reshape(x.shape)


def fuse_qkv(projs: list[Any], ctx: _C.KernelContext) -> _C.Linear | None:
    """One ``_C.Linear`` over the q, k and v projections' rows together, for int8/int4
    projections and GGUF blocks of one kind (None otherwise): one call streams the three
    matrices (an int4 2048x2048 projection ran at ~14 GB/s alone, the three together at
    ~18.5; bf16 gained nothing).  The three CLinears are rebuilt over the joint block (their
    rows and scales at offsets in it), so the weights are held once.  Rows are quantized
    independently (int8 per row, int4 per row group, a GGUF row its own blocks), so the rows
    of the joint matrix are exactly the three's."""
    if any(p.dtype not in ("int8", "int4") and p.dtype not in GGUF_BLOCKS for p in projs) \
            or len({(p.dtype, p._desc.get("group"), p.in_features) for p in projs}) != 1:
        return None
    K, dt = projs[0].in_features, projs[0].dtype
    if dt in GGUF_BLOCKS:  # the scales are inside the blocks
        rb, sb = K // GGUF_BLOCKS[dt][0] * GGUF_BLOCKS[dt][1], 0
    else:
        rb = K if dt == "int8" else K // 2                         # weight bytes per row
        sb = 4 * (1 if dt == "int8" else K // projs[0]._desc["group"])  # scale bytes per row
    Ns = [p.out_features for p in projs]
    N = sum(Ns)
    s_off = -(-N * rb // 64) * 64
    block = np.zeros(s_off + N * sb, np.uint8)
    row = 0
    for p, n in zip(projs, Ns):
        w0 = p._desc["weight"]
        block[row * rb:(row + n) * rb] = p._block[w0:w0 + n * rb]
        if sb:
            s0 = p._desc["weight_scale"]
            block[s_off + row * sb:s_off + (row + n) * sb] = p._block[s0:s0 + n * sb]
        row += n
    biases = [p._bias for p in projs]
    bias = None
    if any(b is not None for b in biases):
        bias = np.concatenate([b if b is not None else np.zeros(n, np.float32)
                               for b, n in zip(biases, Ns)])
    scale_at = (lambda r: {"weight_scale": s_off + r * sb}) if sb else (lambda r: {})
    row = 0
    for p, n in zip(projs, Ns):                 # each projection now reads the joint block
        p._desc = dict(p._desc, weight=row * rb, **scale_at(row))
        p._block = block
        p._c = _C.Linear(ctx, p._desc, block, p._bias)
        row += n
    desc = dict(projs[0]._desc, N=N, weight=0, **scale_at(0))
    return _C.Linear(ctx, desc, block, bias)

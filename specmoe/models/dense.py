"""Dense layers through specmoe's C kernels: attention projections, shared-expert and dense MLP
projections and ``lm_head``.

At decode a MoE model's step is mostly matrix-vector products: once the routed experts run in
C, torch's attention projections and ``lm_head`` are most of what is left (docs/architecture.md,
benchmarks/decode_peers.py).  :func:`convert_dense` replaces every such ``nn.Linear`` with a
:class:`CLinear` that runs specmoe's expert kernels (the down-projection row kernels of
``csrc/kernels``, one routine per weight format) on decode-sized inputs:

* ``"f32"`` / ``"bf16"`` keep the weights exactly: the kernels read the model's own weight
  tensors (no copy when the model already has that dtype -- except weights still in the
  checkpoint's mmap, read ~15 % slower there: those get a copy of their own, the file's pages
  left to the page cache); inputs of more than ``torch_above`` tokens (prefill) go to torch's
  ``F.linear`` on the same tensors.
* ``"int8"`` (per output row) and ``"int4"`` (groups of 128, 64 or 32 input columns) quantize
  the weights like the experts (:mod:`specmoe.storage.quant`); every input size then runs in C (long
  inputs in chunks of 64 tokens), so prefill and decode see the same weights.
* ``"gguf"`` (a model loaded from a GGUF file): the layers the file holds in a block format
  the kernels read run on those blocks as they are (the experts' block kernels, every input
  size in C); the others keep the model's exact format.

The routers are never converted (routing must match the model's); neither are the routed
experts (they are specmoe's already) nor the input embeddings.  A tied ``lm_head`` keeps
sharing its table with the embedding when the format keeps the weights exactly.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import re
import threading
from typing import Any, Callable, ContextManager, Iterable, Iterator, Mapping

import numpy as np
import torch
from torch import nn

from .. import _C
from ..runtime.kernels import context
from .attention import convert_norms, fuse_attention, use_c_attention
from .decode_step import install_decode_step
from .layers import DENSE_DTYPES, TORCH_ABOVE, CLinear, chain_step, int4_group
from .linear_attn import fuse_gated_deltanet
from .mla import absorb_mla, fuse_mla

__all__ = ["DecodeThreads", "DenseReport", "GgufDense", "convert_dense", "generation_session",
           "resolve_dense"]


@dataclasses.dataclass(frozen=True)
class GgufDense:
    """A GGUF file's dense weights in the block formats the kernels read, as
    :func:`specmoe.from_pretrained` (``dense="gguf"``) hands them to the
    :class:`specmoe.runtime.engine.Engine` that converts the model (:func:`convert_dense`'s
    ``blocks`` and ``mla_blocks``).  layers: a linear layer's qualified name to (blocks, kind)
    (:meth:`specmoe.storage.gguf.GgufCheckpoint.dense_blocks`); mla: an MLA attention module's
    name to its attn_k_b / attn_v_b blocks and kinds
    (:meth:`specmoe.storage.gguf.GgufCheckpoint.mla_blocks`)."""
    layers: Mapping[str, tuple[np.ndarray, str]]
    mla: Mapping[str, tuple[np.ndarray, str, np.ndarray, str]]


@dataclasses.dataclass
class DenseReport:
    """What :func:`convert_dense` did: layers converted (qualified names), bytes before and
    after, layers left in torch with the reason, the MLA attention modules decoded in the
    absorbed form (:mod:`specmoe.models.mla`), the attention implementation running the other
    attention modules' decode steps in C (:mod:`specmoe.models.attention`; None: unchanged), the
    attention modules whose decode steps run whole in C (``fused``,
    :func:`specmoe.models.attention.fuse_attention`, :func:`specmoe.models.mla.fuse_mla`), the RMSNorms run
    in C at decode sizes (``norms``, :class:`specmoe.models.layers.CRMSNorm`);
    ``decode_torch_threads``: torch's intra-op threads during decode-sized forwards
    (:class:`DecodeThreads`), None when unchanged; ``decode_step``: one-token forwards skip
    the model's own Python around the layers (:mod:`specmoe.models.decode_step`); ``formats``:
    the converted layers of each :class:`CLinear` dtype (``"gguf"`` mixes the file's block
    kinds with the model's own format)."""

    dtype: str | None
    converted: list[str] = dataclasses.field(default_factory=list)
    skipped: dict[str, str] = dataclasses.field(default_factory=dict)
    mla: list[str] = dataclasses.field(default_factory=list)
    attention: str | None = None
    fused: list[str] = dataclasses.field(default_factory=list)
    norms: list[str] = dataclasses.field(default_factory=list)
    decode_torch_threads: int | None = None
    decode_step: bool = False
    bytes_before: int = 0
    bytes_after: int = 0
    formats: dict[str, int] = dataclasses.field(default_factory=dict)  # CLinear dtype -> layers

    def __str__(self) -> str:
        if self.dtype is None:
            return "dense layers: torch"
        how = self.dtype
        if len(self.formats) > 1 or self.dtype not in self.formats:
            how += ": " + ", ".join(f"{k} {v}" for k, v in sorted(self.formats.items()))
        return (f"dense layers: {len(self.converted)} in C ({how}), "
                f"{self.bytes_before / 2**20:.1f} MiB -> {self.bytes_after / 2**20:.1f} MiB"
                + (f", {len(self.skipped)} left in torch" if self.skipped else "")
                + (f", {len(self.mla)} MLA attentions absorbed" if self.mla else "")
                + (f", attention {self.attention}" if self.attention else "")
                + (f" ({len(self.fused)} fused)" if self.fused else ""))


def resolve_dense(dense: str | bool | None, model_dtype: torch.dtype) -> str | None:
    """The dense format ``dense`` asks for with weights of ``model_dtype``: None (torch) for
    ``None``/``False``/``"torch"``; for ``"auto"``/``True``: ``"bf16"`` (weights kept exactly)
    for a bf16 model on a CPU with AVX2 or better, else None -- the documented rule measured by
    benchmarks/dense_linear.py: at decode sizes the bf16 kernels beat torch's bf16 GEMM
    (1.1-1.35x up to 16 tokens), while torch's f32 GEMV (MKL) already reads at the memory
    limit, so f32 models stay in torch; an explicit format otherwise (``"gguf"``: a GGUF
    file's own blocks, see :func:`convert_dense`)."""
    if dense is None or dense is False or dense == "torch":
        return None
    if dense is True or dense == "auto":
        if model_dtype != torch.bfloat16 or context().isa == "scalar":
            return None
        return "bf16"
    if dense not in DENSE_DTYPES + ("gguf",):
        raise ValueError(f"dense must be 'auto', 'torch', None, 'gguf' or one of "
                         f"{DENSE_DTYPES}, got {dense!r}")
    return dense


class DecodeThreads:
    """Forward hooks that run torch single-threaded during decode-sized forwards of a model
    whose dense layers are in C.

    Once the matrix products of a decode step run in specmoe's kernel pool, what torch still
    runs is a few hundred small operations (norms, rotary embeddings, casts, softmax, cache
    appends) on tensors of a few kilobytes; each intra-op parallel region then costs a thread
    wake-up (OpenMP waits passively, see ``specmoe/__init__``) that is more than its work.
    Measured on DeepSeek-V2-Lite shapes, int4, 2 threads: 36.4 tok/s with torch on 2 threads
    vs 43.5 with torch on 1 and the kernel pool on 2 (benchmarks/decode_peers.py).  Forwards
    of more than ``max_tokens`` tokens (prefill, large batches), whose torch GEMMs do use the
    threads, keep the user's setting.  Process-wide (torch's thread count is global): the first
    decode forward in flight saves the count and sets 1, the last one out restores it, also
    when the forward raises.

    Inside a generation (:meth:`session`: ``model.generate`` and :func:`specmoe.generate` open
    one) the count stays at 1 from one decode forward to the next, through the sampling
    operations between them (a logits copy, argmax, the id concatenation), and is restored when
    the generation ends or before its next long forward: restoring it after every step made
    each step's first parallel torch operation wake the OpenMP workers, and the step's kernels
    ran slower beside them (OLMoE shape, int4, torch and the kernel pool on 2 threads: 13.7 ms a
    step, 11.7 with torch held at 1; 2026-11-25)."""

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self._lock = threading.Lock()
        self._depth = 0          # [_lock] decode forwards in flight
        self._saved = 1          # [_lock] torch's thread count before the first of them
        self._sessions = 0       # [_lock] generations in flight (session())
        self._held = False       # [_lock] count left at 1 after the last decode forward, for a
        #                          generation in flight
        self._tls = threading.local()  # per thread: stack of "this forward entered" flags

    def _restore(self) -> None:
        """Give torch back the saved count ([_lock] held by the caller)."""
        self._held = False
        if self._saved > 1:
            torch.set_num_threads(self._saved)

    @contextlib.contextmanager
    def session(self) -> Iterator[None]:
        """A generation: torch stays single-threaded between its decode forwards (see the class
        docstring); the user's count is back when the block exits, also on an exception."""
        with self._lock:
            self._sessions += 1
        try:
            yield
        finally:
            with self._lock:
                self._sessions -= 1
                if self._sessions == 0 and self._held and self._depth == 0:
                    self._restore()

    @staticmethod
    def _tokens(args: tuple, kwargs: dict) -> int | None:
        x = kwargs.get("input_ids", args[0] if args else None)
        if isinstance(x, torch.Tensor) and x.dim() == 2:
            return int(x.numel())
        e = kwargs.get("inputs_embeds")
        if isinstance(e, torch.Tensor) and e.dim() == 3:
            return int(e.shape[0] * e.shape[1])
        return None

    def pre(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        n = self._tokens(args, kwargs)
        entered = n is not None and n <= self.max_tokens
        stack = getattr(self._tls, "stack", None)
        if stack is None:
            stack = self._tls.stack = []
        stack.append(entered)
        with self._lock:
            if not entered:             # a long forward: the user's count, if we still hold 1
                if self._held and self._depth == 0:
                    self._restore()
                return
            if self._depth == 0 and not self._held:
                self._saved = torch.get_num_threads()
                if self._saved > 1:
                    torch.set_num_threads(1)
            self._held = False
            self._depth += 1

    def post(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        stack = getattr(self._tls, "stack", None)
        if not stack or not stack.pop():
            return
        with self._lock:
            self._depth -= 1
            if self._depth == 0:
                if self._sessions:
                    self._held = True   # until the generation ends or runs a long forward
                else:
                    self._restore()

    def install(self, model: nn.Module) -> None:
        """The hooks on ``model``, and ``model.generate`` wrapped in :meth:`session`."""
        model.register_forward_pre_hook(self.pre, with_kwargs=True)
        model.register_forward_hook(self.post, with_kwargs=True, always_call=True)
        gen = getattr(model, "generate", None)
        if callable(gen):
            @functools.wraps(gen)
            def generate(*args: Any, **kwargs: Any) -> Any:
                with self.session():
                    return gen(*args, **kwargs)
            model.generate = generate


def generation_session(model: nn.Module) -> ContextManager[None]:
    """The model's :meth:`DecodeThreads.session` when :func:`convert_dense` gave it the hooks
    (dense layers in C), else a context that does nothing: what a generation loop (this
    module's :func:`decode_session`, the serving scheduler's worker) runs inside."""
    hooks = getattr(model, "_specmoe_decode_threads", None)
    return hooks.session() if hooks is not None else contextlib.nullcontext()


def decode_session(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Decorator for generation loops ``fn(model, ...)``: the call runs in
    :func:`generation_session` of the model."""
    @functools.wraps(fn)
    def wrapper(model: nn.Module, *args: Any, **kwargs: Any) -> Any:
        with generation_session(model):
            return fn(model, *args, **kwargs)
    return wrapper


@functools.lru_cache(maxsize=None)
def _reads_weight(cls: type, attr: str) -> bool:
    """Whether a method of ``cls`` (its forward, or the paths forward dispatches to) reads
    ``self.<attr>.weight`` or ``.bias`` itself: a layer that must stay an nn.Linear (a CLinear
    has no weight to read)."""
    try:
        src = inspect.getsource(cls)
    except (OSError, TypeError):
        return False
    return re.search(rf"self\.{re.escape(attr)}\.(weight|bias)\b", src) is not None


def convert_dense(model: nn.Module, dtype: str | bool | None = "auto", *,
                  skip: Iterable[nn.Module] = (), ctx: _C.KernelContext | None = None,
                  torch_above: int | None = TORCH_ABOVE,
                  blocks: Mapping[str, tuple[np.ndarray, str]] | None = None,
                  mla_blocks: Mapping[str, tuple[np.ndarray, str, np.ndarray, str]] | None = None
                  ) -> DenseReport:
    """Replace ``model``'s dense ``nn.Linear`` layers by :class:`CLinear` in place.

    dtype: see :func:`resolve_dense` (``"auto"``: the model's precision where the C kernels
    are faster, else nothing changes).  skip: modules whose ``nn.Linear`` descendants stay in
    torch (the engine passes the routers).  Layers whose shape the format cannot hold (int4
    with in_features not a multiple of 32) stay in torch and are listed in the report.
    ``"gguf"``: the layers a GGUF file holds in a block format the kernels read (Q4_0, Q8_0,
    Q4_K, Q6_K, ...; Q5_0 widened to Q8_0) run on those blocks as the file holds them, the
    same bits llama.cpp reads; ``blocks`` maps a layer's qualified name to (blocks, kind)
    (:meth:`specmoe.storage.gguf.GgufCheckpoint.dense_blocks`; :func:`specmoe.from_pretrained`
    with ``dense="gguf"`` hands them to the Engine as a :class:`GgufDense`).  The other layers (F32,
    F16 or BF16 in the file, DeepSeek's joined ``kv_b_proj``, a tied ``lm_head``) keep the
    model's exact format (bf16, else f32); the report counts the layers of each format.
    MLA attention modules (DeepSeek-V2/V3) also switch to the absorbed decode form
    (:func:`specmoe.models.mla.absorb_mla`, the C kernel at the same precision: int8/int4 absorbed
    weights are ``kv_b_proj``'s rows quantized as here; with ``"gguf"``, the file's own
    ``attn_k_b`` / ``attn_v_b`` blocks where ``mla_blocks`` has them); the other
    attention modules run their
    decode steps through the C attention kernel (:func:`specmoe.models.attention.use_c_attention`).
    Decode-sized forwards of ``model`` then run torch
    single-threaded (:class:`DecodeThreads`).
    """
    params = [p for p in model.parameters()]
    model_dtype = params[0].dtype if params else torch.float32
    fmt = resolve_dense(dtype, model_dtype)
    report = DenseReport(fmt)
    if fmt is None:
        return report
    exact = "bf16" if model_dtype == torch.bfloat16 else "f32"  # gguf's other layers
    if fmt == "gguf":
        if blocks is None:
            raise ValueError("dense='gguf' runs the dense layers on a GGUF file's own blocks: "
                             "load the model from a GGUF file with specmoe.from_pretrained("
                             "..., dense='gguf') (or pass blocks=)")
    skipped_ids = set()
    for m in skip:
        for sub in m.modules():
            skipped_ids.add(id(sub))
    # absorbed before kv_b_proj is converted: with int8/int4 the absorbed weights are its rows
    # quantized as CLinear quantizes them, then kv_b_proj itself (the prefill path) converts
    mla_blocks = mla_blocks if fmt == "gguf" else None
    report.mla = absorb_mla(model, ctx=ctx, weights=fmt if fmt in ("int8", "int4") else None,
                            blocks=mla_blocks)
    report.attention = use_c_attention(model, ctx)
    targets = [(name, mod) for name, mod in model.named_modules()
               if isinstance(mod, nn.Linear) and id(mod) not in skipped_ids]
    # a tied lm_head keeps reading the embedding's table (one copy of it), mapped or not
    try:
        emb_w = model.get_input_embeddings().weight
    except (AttributeError, NotImplementedError):
        emb_w = None
    for name, mod in targets:
        parent_name, _, attr = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        if _reads_weight(type(parent), attr):
            # the parent reads the layer's weight instead of (or besides) calling it: a Mamba
            # mixer (Jamba) multiplies by dt_proj.weight and adds dt_proj.bias itself;
            # DeepSeek-V3.2's indexer casts its input to weights_proj.weight.dtype
            report.skipped[name] = f"the model reads its weight directly ({attr})"
            continue
        if fmt == "int4" and int4_group(mod.in_features) is None:
            report.skipped[name] = f"in_features {mod.in_features} is not a multiple of 32"
            continue
        report.bytes_before += mod.weight.numel() * mod.weight.element_size()
        if fmt == "gguf" and name in blocks:
            raw, kind = blocks[name]
            new = CLinear(mod, kind, ctx, torch_above, blocks=raw)
        else:
            new = CLinear(mod, exact if fmt == "gguf" else fmt, ctx, torch_above,
                          copy_mapped=mod.weight is not emb_w)
        report.formats[new.dtype] = report.formats.get(new.dtype, 0) + 1
        report.bytes_after += new.nbytes
        setattr(parent, attr, new)
        report.converted.append(name)
    if fmt == "gguf":  # a layer left out above would keep a weight that was never loaded
        left = sorted(n for n, m in model.named_modules() if n in blocks
                      and isinstance(m, nn.Linear) and m.weight.is_meta)
        if left:
            raise ValueError(f"dense='gguf': layers held as GGUF blocks were not converted "
                             f"(skipped: {', '.join(left[:4])})")
    report.fused = (fuse_attention(model, ctx) + fuse_mla(model, ctx)
                    + fuse_gated_deltanet(model, ctx))
    if report.converted:
        report.norms = convert_norms(model)
    hooks = getattr(model, "_specmoe_decode_threads", None)
    if report.converted and hooks is None:
        hooks = DecodeThreads(torch_above if torch_above is not None else TORCH_ABOVE)
        hooks.install(model)
        model._specmoe_decode_threads = hooks
    if hooks is not None:
        report.decode_torch_threads = 1
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is not None and len(layers) and all(
            chain_step(lyr) is not None for lyr in layers):
        # every decoder layer is fused (fuse_attention / fuse_mla gave it a chain item too):
        # its forward reads a None mask at one token as the model's full mask
        report.decode_step = install_decode_step(model, own_hooks=hooks)
    return report


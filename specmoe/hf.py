"""HuggingFace transformers (5.x) integration: run a MoE model with its routed experts offloaded.

:func:`offload` takes a loaded ``transformers`` MoE model, writes every MoE layer's routed experts
in the canonical layout to an expert store, deletes the expert parameters from the model and puts
in their place a :class:`SpecmoeExperts` module.  That module is called exactly like the one it
replaces (``experts(hidden[T,H], top_k_index[T,k], top_k_weights[T,k])``, after all of the
model's own routing) and runs the whole layer in one C call (``_C.moe_forward``) with the GIL
released: tokens grouped by expert, each needed expert fetched once, its FFN run on all of its
tokens, ``weight * output`` accumulated.  Routers, attention, shared experts and dense layers
stay in torch, untouched.

Canonical expert layout (one dict per MoE layer, arrays over all E experts):
``gate [E,I,H]``, ``up [E,I,H]``, ``down [E,H,I]`` and, for GPT-OSS, ``gate.bias [E,I]``,
``up.bias [E,I]``, ``down.bias [E,H]`` (the names of csrc/kernels/kernels.h and
:func:`specmoe.quant.expert_tensors`, which converts them per expert to the stored dtype).
GPT-OSS stores ``gate_up_proj`` transposed ``[E,H,2I]`` with gate and up interleaved (even
columns gate, odd up): :func:`extract_experts` de-interleaves and transposes it.

Typical use::

    eng = specmoe.offload(model, cache=0.25, policy="lru", prefetch=True, dtype="bf16")
    model.generate(...)                 # unchanged transformers API (KV cache, batches)
    eng.stats()                         # hits, misses, hit_rate, stall_s, prefetch precision...
    with eng.trace() as t:
        model.generate(...)
    t.result().save("routing.npz")      # a specmoe.traces.Trace
    eng.close()

Supported architectures (``config.model_type``): see :data:`SUPPORTED`.
"""
from __future__ import annotations

import contextlib
import math
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch import nn

from . import _C

__all__ = [
    "SUPPORTED",
    "Engine",
    "SpecmoeExperts",
    "UnsupportedModelError",
    "available_policies",
    "extract_experts",
    "iter_experts_modules",
    "moe_layers",
    "offload",
    "tiny_config",
    "tiny_model",
]


class UnsupportedModelError(ValueError):
    """The model is not one of the MoE architectures specmoe can offload."""


@dataclass(frozen=True)
class _Arch:
    router_attr: str  # attribute of the MoE block holding the router module
    gptoss: bool = False  # transposed, interleaved, biased experts with clamped SwiGLU
    sigmoid_router: bool = False  # DeepSeek-V3: sigmoid scores + correction bias choose experts


SUPPORTED: dict[str, _Arch] = {
    "mixtral": _Arch("gate"),
    "qwen2_moe": _Arch("gate"),
    "qwen3_moe": _Arch("gate"),
    "olmoe": _Arch("gate"),
    "phimoe": _Arch("router"),
    "deepseek_v3": _Arch("gate", sigmoid_router=True),
    "gpt_oss": _Arch("router", gptoss=True),
}

DTYPES = ("f32", "bf16", "int8", "int4")


def _arch(model: nn.Module) -> tuple[str, _Arch]:
    mt = getattr(getattr(model, "config", None), "model_type", None)
    if mt not in SUPPORTED:
        raise UnsupportedModelError(
            f"model_type {mt!r} is not supported; supported MoE architectures: "
            f"{', '.join(sorted(SUPPORTED))}")
    return mt, SUPPORTED[mt]


def _decoder(model: nn.Module) -> nn.Module:
    inner = getattr(model, "model", model)
    if not hasattr(inner, "layers"):
        raise UnsupportedModelError(f"{type(model).__name__} has no .model.layers")
    return inner


def moe_layers(model: nn.Module) -> list[int]:
    """Decoder layer indices whose MLP has routed experts (dense layers, e.g. DeepSeek-V3's
    first ``first_k_dense_replace``, are skipped)."""
    _arch(model)
    return [i for i, layer in enumerate(_decoder(model).layers)
            if hasattr(getattr(layer, "mlp", None), "experts")]


# ---------------------------------------------------------------------------------------------
# conversion to the canonical layout


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float32).cpu().contiguous().numpy()


def _extract_one(experts: nn.Module, e: int, gptoss: bool) -> dict[str, np.ndarray]:
    """Expert e of one MoE layer as canonical float32 arrays (see module docstring)."""
    gu, down = experts.gate_up_proj[e].detach(), experts.down_proj[e].detach()
    if gptoss:  # gate_up [H, 2I] interleaved (even columns gate, odd up); down [I, H]
        gu_t = gu.transpose(0, 1)
        return {"gate": _np(gu_t[0::2]), "up": _np(gu_t[1::2]), "down": _np(down.transpose(0, 1)),
                "gate.bias": _np(experts.gate_up_proj_bias[e, 0::2]),
                "up.bias": _np(experts.gate_up_proj_bias[e, 1::2]),
                "down.bias": _np(experts.down_proj_bias[e])}
    I = gu.shape[0] // 2  # gate_up [2I, H]: first half gate, second half up; down [H, I]
    return {"gate": _np(gu[:I]), "up": _np(gu[I:]), "down": _np(down)}


def extract_experts(experts: nn.Module, gptoss: bool = False) -> dict[str, np.ndarray]:
    """One MoE layer's routed experts as canonical float32 arrays [E, ...] (module docstring)."""
    if isinstance(experts, SpecmoeExperts):
        raise ValueError("these experts are already offloaded")
    per = [_extract_one(experts, e, gptoss) for e in range(experts.gate_up_proj.shape[0])]
    return {n: np.stack([p[n] for p in per]) for n in per[0]}


def _convert_experts(experts: nn.Module, gptoss: bool, dtype: str) -> dict[str, np.ndarray]:
    """The stored tensors [E, ...] of one layer in ``dtype``, converted one expert at a time
    (peak memory: one layer in the stored dtype plus one expert in f32)."""
    return _stack_converted(int(experts.gate_up_proj.shape[0]),
                            lambda e: _extract_one(experts, e, gptoss), dtype)


def _stack_converted(E: int, expert_f32: Callable[[int], dict[str, np.ndarray]],
                     dtype: str) -> dict[str, np.ndarray]:
    """Tensors [E, ...] in ``dtype`` from ``expert_f32(e)``, the canonical f32 arrays of expert
    e (biases included), converted one expert at a time."""
    from .quant import expert_tensors
    out: dict[str, np.ndarray] = {}
    for e in range(E):
        d = expert_f32(e)
        biases = {n: d[n + ".bias"] for n in ("gate", "up", "down") if n + ".bias" in d}
        t = expert_tensors(d["gate"], d["up"], d["down"], dtype, biases=biases or None)
        if not out:
            out = {n: np.empty((E,) + a.shape, a.dtype) for n, a in t.items()}
        for n, a in t.items():
            out[n][e] = a
    return out


# ---------------------------------------------------------------------------------------------
# the replacement experts module


class SpecmoeExperts(nn.Module):
    """Drop-in replacement of a transformers experts module; holds no expert weights."""

    def __init__(self, engine: "Engine", position: int, num_experts: int, hidden: int):
        super().__init__()
        self._engine = engine
        self.position = position
        self.num_experts = num_experts
        self.hidden_dim = hidden

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        return self._engine._layer_forward(self.position, hidden_states, top_k_index,
                                           top_k_weights)

    def extra_repr(self) -> str:
        return f"position={self.position}, num_experts={self.num_experts}, offloaded"


@dataclass
class _Recorder:
    num_layers: int
    logits: bool
    experts: list = field(default_factory=list)   # per forward: [T, L, k]
    weights: list = field(default_factory=list)
    logit_rows: list = field(default_factory=list)
    starts: list = field(default_factory=list)
    _cur_e: list | None = None
    _cur_w: list | None = None
    _cur_g: list | None = None
    ntok: int = 0

    def layer(self, pos: int, idx: torch.Tensor, w: torch.Tensor, lg: torch.Tensor | None) -> None:
        if pos == 0:
            self._flush()
            self._cur_e, self._cur_w, self._cur_g = [], [], []
        if self._cur_e is None:
            return
        self._cur_e.append(idx.detach().to(torch.int16).numpy().copy())
        self._cur_w.append(w.detach().float().numpy().copy())
        if lg is not None:
            self._cur_g.append(lg.detach().float().numpy().copy())
        if pos == self.num_layers - 1:
            self._flush()

    def _flush(self) -> None:
        if self._cur_e and len(self._cur_e) == self.num_layers:
            e = np.stack(self._cur_e, 1)
            if e.shape[0] > 1 or not self.starts:  # a prefill (or the first pass) opens a request
                self.starts.append(self.ntok)
            self.experts.append(e)
            self.weights.append(np.stack(self._cur_w, 1))
            if self.logits and len(self._cur_g) == self.num_layers:
                self.logit_rows.append(np.stack(self._cur_g, 1))
            self.ntok += e.shape[0]
        self._cur_e = self._cur_w = self._cur_g = None


class TraceRecording:
    """Context manager returned by :meth:`Engine.trace`; :meth:`result` gives the Trace."""

    def __init__(self, engine: "Engine", logits: bool):
        self._engine = engine
        self._rec = _Recorder(len(engine.layer_ids), logits)

    def __enter__(self) -> "TraceRecording":
        self._engine._recorder = self._rec
        return self

    def __exit__(self, *exc: Any) -> None:
        self._rec._flush()
        self._engine._recorder = None

    def result(self):
        """The recorded routing as a :class:`specmoe.traces.Trace` (tokens in forward order;
        a forward pass with more than one token, i.e. a prefill, starts a new request; with
        batch > 1 the rows of a pass are recorded in flattened batch order)."""
        from .traces import Trace
        r = self._rec
        r._flush()
        k = self._engine.top_k
        L = len(self._engine.layer_ids)
        ex = np.concatenate(r.experts) if r.experts else np.zeros((0, L, k), np.int16)
        w = np.concatenate(r.weights) if r.weights else np.zeros((0, L, k), np.float32)
        lg = np.concatenate(r.logit_rows) if (r.logits and r.logit_rows) else None
        return Trace(experts=ex, num_experts=self._engine.num_experts,
                     request_starts=np.asarray(r.starts or [0], np.int64),
                     layer_ids=np.asarray(self._engine.layer_ids, np.int32), weights=w,
                     logits=lg, model=self._engine.model_type, source="specmoe.hf")


class Engine:
    """The running offload of one model.  Create with :func:`offload`."""

    def __init__(self) -> None:  # filled by offload()
        self.model: nn.Module | None = None
        self.model_type = ""
        self.layer_ids: list[int] = []
        self.num_experts = 0
        self.top_k = 0
        self.dtype = "f32"
        self.cache_frac = 1.0
        self.policy = "lru"
        self.prefetch = True
        self.overfetch = 1.5
        self.mass: float | None = None
        self._desc: dict[str, Any] = {}
        self._block_bytes = 0
        self._kctx: Any = None
        self._source: Any = None
        self._routers: list[nn.Module] = []
        self._predictor: Callable[[int, torch.Tensor], Any] | None = None
        self._sigmoid_router = False
        self._recorder: _Recorder | None = None
        self._pred: dict[int, np.ndarray] = {}
        self._pf = {"predicted": 0, "true_positive": 0, "actual": 0}
        self._tokens = 0
        self._passes = 0
        self._store_path: str | None = None
        self._store: Any = None
        self._cache: Any = None
        self._own_store = False
        self._closed = False
        self._originals: list[tuple[nn.Module, nn.Module]] = []
        # self-draft (MoE-SpeQ): every routed expert resident in a low-bit copy
        self._draft_buf: np.ndarray | None = None
        self._draft_desc: dict[str, Any] = {}
        self._draft_block_bytes = 0
        self.draft_dtype: str | None = None
        self._drafting: list[tuple[int, np.ndarray]] | None = None  # routing of draft forwards
        # draft-driven lookahead (position -> predicted experts mask) and its accounting
        self._lookahead: dict[int, np.ndarray] = {}
        self._la = {"predicted": 0, "true_positive": 0, "actual": 0}
        self._tau: dict[int, dict[int, float]] = {}  # batch size -> tau(g), see generate()

    # -- the per-layer path -------------------------------------------------------------------
    def _router_scores(self, pos: int, x: torch.Tensor) -> torch.Tensor:
        r = self._routers[pos]
        w = r.weight
        lg = torch.nn.functional.linear(x.to(w.dtype), w, getattr(r, "bias", None)).float()
        if self._sigmoid_router:
            lg = lg.sigmoid() + r.e_score_correction_bias.float()
        return lg

    def _predict(self, sc: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """Experts to prefetch from next-layer scores [T,E]: per token the top
        ceil(k * overfetch), or (mass mode) the fewest experts, at least k, whose softmax
        probability sums to >= mass.  Returns (mask [E], priority [E]: max over tokens)."""
        E = self.num_experts
        if self.mass is None:
            m = min(E, max(self.top_k, math.ceil(self.top_k * self.overfetch)))
            top = torch.topk(sc, m, dim=-1)
            ids, vals = top.indices, top.values
            keep = torch.ones_like(ids, dtype=torch.bool)
        else:
            prob = torch.softmax(sc, dim=-1)
            vals, ids = torch.sort(prob, dim=-1, descending=True)
            before = torch.cumsum(vals, dim=-1) - vals  # mass of the experts ranked above
            keep = before < self.mass
            keep[:, :min(E, self.top_k)] = True
        ids_k = ids[keep].numpy()
        p = np.zeros(E, bool)
        p[ids_k] = True
        pri = np.full(E, -np.inf, np.float32)
        np.maximum.at(pri, ids_k, vals[keep].float().numpy())
        return p, pri

    def _layer_forward(self, pos: int, hidden: torch.Tensor, idx: torch.Tensor,
                       w: torch.Tensor) -> torch.Tensor:
        if self._closed:
            raise RuntimeError("this specmoe Engine is closed")
        if self._drafting is not None:
            return self._draft_layer(pos, hidden, idx, w)
        x, ix, wt, out, used = self._buffers(hidden, idx, w)
        if pos == 0:
            self._passes += 1
            self._tokens += x.shape[0]
            self._begin_pass()
        # lookahead: queue layer pos+1's predicted experts before running this layer, so their
        # loads overlap this layer's compute
        if self.prefetch and pos + 1 < len(self._routers):
            with torch.no_grad():
                if self._predictor is not None:
                    sc = torch.as_tensor(self._predictor(pos + 1, hidden.detach())).float()
                else:
                    sc = self._router_scores(pos + 1, hidden.detach())
                p, pri = self._predict(sc)
            self._pred[pos + 1] = p
            experts = np.nonzero(p)[0]
            self._queue_prefetch(pos + 1, experts, pri[experts])
        if self._counts_fed:
            # utility-space policies (spac) learn from how many of this pass's tokens use each
            # expert, before the pass's accesses (the simulator feeds them at the same point)
            cnt = np.bincount(ix.numpy().ravel(), minlength=self.num_experts)
            nz = np.flatnonzero(cnt)
            self._cache.observe_counts(np.full(len(nz), pos, np.int64), nz, cnt[nz])
        self._forward_c(pos, x.numpy(), ix.numpy(), wt.numpy(), out.numpy(), used)
        la = self._lookahead.pop(pos, None)
        if pos == len(self.layer_ids) - 1:
            self._lookahead.clear()  # a lookahead is for one pass
        if la is not None:
            act = used.astype(bool)
            self._la["predicted"] += int(la.sum())
            self._la["actual"] += int(act.sum())
            self._la["true_positive"] += int((la & act).sum())
        # prefetch accounting: compare this layer's prediction with what it used
        pred = self._pred.pop(pos, None)
        if pred is not None:
            act = used.astype(bool)
            self._pf["predicted"] += int(pred.sum())
            self._pf["actual"] += int(act.sum())
            self._pf["true_positive"] += int((pred & act).sum())
        rec = self._recorder
        if rec is not None:
            lg = self._router_scores(pos, hidden.detach()) if rec.logits else None
            rec.layer(pos, idx, w, lg)
        return out.to(hidden.dtype)

    # backend: the ExpertCache over the store (or, in a build without them, a resident buffer)
    def _open_cache(self) -> None:
        from .cache import ExpertCache
        new = ExpertCache(self._store, self.cache_frac, self.policy, top_k=self.top_k,
                          prefetch=True)  # built first: a bad policy/capacity keeps the old one
        if self._cache is not None:
            self._cache.close()
        self._cache = new
        self._source = new._c

    def _begin_pass(self) -> None:
        if self._cache is not None:
            self._cache.begin_pass()

    def _forward_c(self, pos, x, ix, wt, out, used) -> None:
        _C.moe_forward(self._source, self._kctx, self._desc, self._block_bytes, pos,
                       self.num_experts, x, ix, wt, out, used)

    def _queue_prefetch(self, pos: int, experts: np.ndarray, priorities: np.ndarray) -> None:
        if self._cache is not None and len(experts):
            layers = np.full(len(experts), pos, np.int64)
            # a draft-driven lookahead queued for this pass must survive the per-layer requests
            self._cache.prefetch((layers, experts.astype(np.int64),
                                  np.asarray(priorities, np.float32)),
                                 replace=not self._lookahead)

    @property
    def _counts_fed(self) -> bool:
        return self._cache is not None and self.policy == "spac"

    # -- self-draft and draft-driven lookahead (used by specmoe.generate) ---------------------
    def enable_self_draft(self, dtype: str = "int4") -> None:
        """Keep a ``dtype`` copy of every routed expert resident in memory, so the target itself
        can draft (MoE-SpeQ's quantized self-draft, see :class:`specmoe.speculative.SelfDraft`).

        The copy is built from the store (dequantized to f32, requantized to ``dtype``) through
        a temporary store file that is deleted at once; it costs ``dtype``'s size of all experts
        (int4: about 1/7 of f32).  Calling it again with another dtype rebuilds the copy."""
        if self._closed or self._store is None:
            raise RuntimeError("this specmoe Engine is closed")
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} not supported; choose one of {DTYPES}")
        if self.draft_dtype == dtype and self._draft_buf is not None:
            return
        from .kernels import FFNSpec
        from .quant import dequantize_expert, store_dtypes
        from .store import ExpertStore, aligned_empty, write_store
        src = self._store
        E, L = self.num_experts, len(self.layer_ids)

        def layer(p: int) -> dict[str, np.ndarray]:
            return _stack_converted(E, lambda e: dequantize_expert(src.read_expert(p, e)), dtype)

        fd, path = tempfile.mkstemp(prefix="specmoe-draft-", suffix=".smoe")
        os.close(fd)
        try:
            first = layer(0)
            write_store(path, lambda p: first if p == 0 else layer(p), num_layers=L,
                        model=self.model_type, top_k=self.top_k, dtypes=store_dtypes(first),
                        progress=False).close()
            with ExpertStore(path, verify=False) as st:
                bb = int(st.block_bytes)
                buf = aligned_empty(L * E * bb)
                for p in range(L):
                    for e in range(E):
                        st.read_block(p, e, out=buf[(p * E + e) * bb:(p * E + e + 1) * bb])
                ex = dict(src.extra)
                spec = FFNSpec.from_store_schema(st.tensors, bb,
                                                 activation=ex.get("activation", "silu"),
                                                 alpha=float(ex.get("alpha", 1.702)),
                                                 limit=float(ex.get("limit", 7.0)))
        finally:
            os.unlink(path)
        self._draft_buf, self._draft_desc, self._draft_block_bytes = buf, spec.desc(), bb
        self.draft_dtype = dtype

    def _buffers(self, hidden: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> tuple:
        """The C layer's inputs (f32 hidden, int64 ids, f32 weights, contiguous), its output
        buffer and the per-expert "used" flags."""
        x = hidden.detach().to(torch.float32).contiguous()
        return (x, idx.detach().to(torch.int64).contiguous(),
                w.detach().to(torch.float32).contiguous(), torch.empty_like(x),
                np.zeros(self.num_experts, np.uint8))

    def _draft_layer(self, pos: int, hidden: torch.Tensor, idx: torch.Tensor,
                     w: torch.Tensor) -> torch.Tensor:
        if self._draft_buf is None:
            raise RuntimeError("drafting() needs enable_self_draft() first")
        x, ix, wt, out, used = self._buffers(hidden, idx, w)
        _C.moe_forward(self._draft_buf, self._kctx, self._draft_desc, self._draft_block_bytes,
                       pos, self.num_experts, x.numpy(), ix.numpy(), wt.numpy(), out.numpy(),
                       used)
        assert self._drafting is not None
        self._drafting.append((pos, ix.numpy().copy()))
        return out.to(hidden.dtype)

    @contextlib.contextmanager
    def drafting(self) -> Iterator[list[tuple[int, np.ndarray]]]:
        """Within the block, the model's MoE layers run on the resident self-draft copy
        (:meth:`enable_self_draft`), touch neither the cache nor the statistics, and append
        ``(moe_layer_position, top_k_index[T, k])`` of every layer call to the yielded list."""
        if self._draft_buf is None:
            raise RuntimeError("drafting() needs enable_self_draft() first")
        if self._drafting is not None:
            raise RuntimeError("drafting() does not nest")
        rec: list[tuple[int, np.ndarray]] = []
        self._drafting = rec
        try:
            yield rec
        finally:
            self._drafting = None

    def lookahead(self, counts: dict[int, np.ndarray]) -> None:
        """Draft-driven prefetch (MoE-SpeQ's expert lookahead buffer) for the next forward pass:
        ``counts[pos]`` [E] holds how many of the pass's tokens the draft expects to route to
        each expert of MoE layer ``pos`` (0: not expected).  Every expected expert is queued to
        the prefetch worker at once, earlier layers first; within a layer, under a
        utility-space policy (spac), by utility and then count, higher first.  The next pass's
        per-layer router prefetch adds to this queue instead of replacing it, and the pass's
        last layer ends the lookahead.  The precision and recall of the prediction against what
        the pass used are counted in :meth:`stats` (``lookahead_precision``,
        ``lookahead_recall``)."""
        L, E = len(self.layer_ids), self.num_experts
        self._lookahead = {}
        lay, exp, pri = [], [], []
        for pos, c in counts.items():
            c = np.asarray(c)
            if not (0 <= pos < L) or c.shape != (E,):
                raise ValueError(f"lookahead: position {pos} with counts of shape {c.shape}; "
                                 f"expected 0 <= position < {L} and shape ({E},)")
            self._lookahead[pos] = c > 0
            ids = np.flatnonzero(c > 0)
            pr = np.zeros(len(ids), np.float64)
            if self._counts_fed:  # integer utility first, the count breaks ties
                pr = self._cache.utility(np.full(len(ids), pos), ids).astype(np.float64) + \
                    c[ids] / (c.max() + 1.0)
            # layer order dominates: squash the within-layer priority into (0, 1)
            lay.append(np.full(len(ids), pos, np.int64))
            exp.append(ids.astype(np.int64))
            pri.append((L - pos) + 0.5 + np.arctan(pr) / np.pi)
        if self.prefetch and self._cache is not None and lay:
            self._cache.prefetch((np.concatenate(lay), np.concatenate(exp),
                                  np.concatenate(pri).astype(np.float32)), replace=True)

    def loads(self) -> tuple[int, float]:
        """(experts loaded from the store, seconds stalled on loads) since the last reset."""
        if self._cache is None:
            return 0, 0.0
        c = self._cache.stats()
        return int(c.get("bytes_read", 0)) // max(1, self._cache.slot_bytes), float(
            c.get("stall_s", 0.0))

    def generate(self, input_ids: Any, **kw: Any) -> Any:
        """:func:`specmoe.generate` on this engine's model (same arguments)."""
        from .speculative import generate
        return generate(self.model, input_ids, engine=self, **kw)

    # -- public -------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters since the last reset: tokens, forward passes, prefetch precision/recall of
        the next-layer router predictor, and the cache's hits/misses/stall time."""
        pf = self._pf
        s: dict[str, Any] = {
            "tokens": self._tokens, "passes": self._passes, "policy": self.policy,
            "cache_frac": self.cache_frac, "dtype": self.dtype, "prefetch": self.prefetch,
            "prefetch_precision": pf["true_positive"] / pf["predicted"] if pf["predicted"] else None,
            "prefetch_recall": pf["true_positive"] / pf["actual"] if pf["actual"] else None,
            "lookahead_precision": (self._la["true_positive"] / self._la["predicted"]
                                    if self._la["predicted"] else None),
            "lookahead_recall": (self._la["true_positive"] / self._la["actual"]
                                 if self._la["actual"] else None),
            "lookahead_predicted": self._la["predicted"],
            "lookahead_used": self._la["actual"],
            "lookahead_hits": self._la["true_positive"],
        }
        s.update(self._cache_stats())
        return s

    def _cache_stats(self) -> dict[str, Any]:
        if self._cache is None:
            return {"hits": None, "misses": None, "hit_rate": None, "stall_s": 0.0}
        c = dict(self._cache.stats())
        n = c.get("hits", 0) + c.get("misses", 0)
        c["hit_rate"] = c.get("hits", 0) / n if n else None
        c["capacity"] = self._cache.capacity
        c["cache_bytes"] = self._cache.capacity * self._cache.slot_bytes
        return c

    def reset_stats(self) -> None:
        self._pf = {"predicted": 0, "true_positive": 0, "actual": 0}
        self._la = {"predicted": 0, "true_positive": 0, "actual": 0}
        self._tokens = self._passes = 0
        if self._cache is not None:
            self._cache.reset_stats()

    def set_policy(self, policy: str) -> None:
        """Switch the cache's eviction policy (contents kept)."""
        self.set_cache(self.cache_frac, policy)

    def set_cache(self, frac: float, policy: str | None = None) -> None:
        """Rebuild the cache over the same store with a new capacity (fraction of all experts)
        and optionally a new policy.  Statistics restart."""
        if not (0 < frac <= 1):
            raise ValueError(f"cache must be a fraction in (0, 1], got {frac}")
        old = (self.cache_frac, self.policy)
        self.cache_frac = float(frac)
        if policy is not None:
            self.policy = policy
        self._tau.clear()  # tau includes expert loads, which depend on the cache
        if self._store is not None:
            try:
                self._open_cache()
            except BaseException:
                self.cache_frac, self.policy = old
                raise
        self._pred.clear()

    def set_prefetch(self, on: bool, overfetch: float | None = None,
                     predictor: Callable[[int, torch.Tensor], Any] | None | str = "keep",
                     mass: float | None | str = "keep") -> None:
        """Switch lookahead prefetch on/off.  overfetch: experts predicted per token
        = ceil(top_k * overfetch).  mass: instead of a fixed count, per token the fewest
        experts (at least top_k) whose softmax probability of the scores sums to >= mass
        (None: back to overfetch).  predictor: ``f(next_layer_position, hidden[T,H]) ->
        scores[T,E]`` (higher = more likely needed), or None for the default, layer l+1's router
        applied to layer l's router input."""
        if not isinstance(mass, str):
            if mass is not None and not (0 < mass <= 1):
                raise ValueError(f"mass must be in (0, 1], got {mass}")
            self.mass = mass
        self.prefetch = bool(on)
        if not isinstance(predictor, str):
            self._predictor = predictor
        if overfetch is not None:
            if overfetch < 1:
                raise ValueError(f"overfetch must be >= 1, got {overfetch}")
            self.overfetch = float(overfetch)
        self._pred.clear()

    def trace(self, logits: bool = False) -> TraceRecording:
        """``with engine.trace() as t: model.generate(...)``; then ``t.result()`` is a
        :class:`specmoe.traces.Trace` (save with ``.save(path)`` as .npz)."""
        return TraceRecording(self, logits)

    def close(self) -> None:
        """Release the cache and the store (deleting the temporary store file if offload made
        one).  The model keeps its SpecmoeExperts modules, which raise RuntimeError when called
        afterwards: the expert weights are gone from the model and are not restored."""
        if self._closed:
            return
        self._closed = True
        self._source = None
        self._draft_buf = None
        if self._cache is not None:
            self._cache.close()
            self._cache = None
        if self._store is not None:
            self._store.close()
            self._store = None
        if self._own_store and self._store_path and os.path.exists(self._store_path):
            os.unlink(self._store_path)

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def available_policies() -> list[str]:
    """Eviction policy names :func:`offload` accepts."""
    names = getattr(_C, "POLICY_NAMES", "lru")
    # Belady needs the future access sequence: a simulator policy, not a live one
    return [n.strip() for n in names.split(",") if n.strip() and n.strip() != "belady"]


def offload(model: nn.Module, store: str | os.PathLike | None = None, cache: float = 0.25,
            policy: str = "lru", prefetch: bool = True, dtype: str = "f32",
            overfetch: float = 1.5, direct: bool = False) -> Engine:
    """Move ``model``'s routed experts to a store and run them through specmoe.

    store: path of the store file to write (None: a temporary file, deleted by close());
    direct: read it with O_DIRECT.  cache: fraction (0, 1] of all experts kept in fast memory.
    policy: eviction policy name (:func:`available_policies`).  prefetch: next-layer lookahead
    (the next layer's router on this layer's input, top ceil(k * overfetch) experts per token)
    queued to the cache's prefetch worker.  dtype: how experts are stored ("f32", "bf16",
    "int8" per-row, "int4" per-group; see specmoe.quant).  The model is modified in place: each MoE layer's ``mlp.experts`` becomes
    a :class:`SpecmoeExperts` and the expert parameters are deleted, layer by layer while the
    store is written; if writing fails part way, the layers already converted stay offloaded
    to nothing usable (the Engine is closed and the error raised): reload the model.
    """
    mt, arch = _arch(model)
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} not supported; choose one of {DTYPES}")
    if not (0 < cache <= 1):
        raise ValueError(f"cache must be a fraction in (0, 1], got {cache}")
    cfg = model.config
    act = getattr(cfg, "hidden_act", "silu")
    if not arch.gptoss and act != "silu":
        raise UnsupportedModelError(f"hidden_act {act!r} not supported (only silu)")
    ids = moe_layers(model)
    if not ids:
        raise UnsupportedModelError(f"{type(model).__name__} has no MoE layers")
    dec = _decoder(model)
    eng = Engine()
    eng.model, eng.model_type, eng.layer_ids = model, mt, ids
    eng.dtype, eng.cache_frac, eng.policy, eng.prefetch = dtype, float(cache), policy, prefetch
    eng.overfetch = float(overfetch)
    eng._sigmoid_router = arch.sigmoid_router
    for i in ids:
        eng._routers.append(getattr(dec.layers[i].mlp, arch.router_attr))
    gu = dec.layers[ids[0]].mlp.experts.gate_up_proj
    E = int(gu.shape[0])
    H = int(gu.shape[1] if arch.gptoss else gu.shape[2])
    eng.num_experts = E
    eng.top_k = int(cfg.num_experts_per_tok)
    if eng.top_k > E:
        raise ValueError(f"top_k {eng.top_k} > num_experts {E}")
    alpha = float(getattr(cfg, "swiglu_alpha", 1.702)) if arch.gptoss else 1.702
    limit = float(getattr(cfg, "swiglu_limit", 7.0)) if arch.gptoss else 7.0

    def layer(pos: int) -> dict[str, Any]:
        mlp = dec.layers[ids[pos]].mlp
        t = _convert_experts(mlp.experts, arch.gptoss, dtype)
        # free this layer's expert parameters as soon as they are converted (peak memory stays
        # about one layer above the model's own size)
        mlp.experts = SpecmoeExperts(eng, pos, E, H)
        return t

    from .kernels import FFNSpec, context
    from .quant import store_dtypes
    from .store import ExpertStore, write_store
    if store is None:
        fd, path = tempfile.mkstemp(prefix="specmoe-", suffix=".smoe")
        os.close(fd)
        eng._own_store = True
    else:
        path = os.fspath(store)
    eng._store_path = path
    try:
        first = layer(0)
        write_store(path, lambda p: first if p == 0 else layer(p), num_layers=len(ids), model=mt,
                    top_k=eng.top_k, dtypes=store_dtypes(first),
                    extra={"architecture": mt, "dtype": dtype, "layer_ids": ids,
                           "activation": "gptoss" if arch.gptoss else "silu",
                           "alpha": alpha, "limit": limit},
                    progress=False).close()
        del first
        eng._store = ExpertStore(path, direct=direct, verify=False)
        spec = FFNSpec.from_store_schema(eng._store.tensors, int(eng._store.block_bytes),
                                         activation="gptoss" if arch.gptoss else "silu",
                                         alpha=alpha, limit=limit)
        eng._desc = spec.desc()
        eng._block_bytes = int(eng._store.block_bytes)
        eng._kctx = context()
        eng._open_cache()
    except BaseException:
        eng.close()
        if eng._own_store and os.path.exists(path):
            os.unlink(path)
        raise
    return eng


# ---------------------------------------------------------------------------------------------
# tiny offline models for tests, the demo and benchmarks


def tiny_config(arch: str, *, hidden: int = 64, inter: int = 96, layers: int = 3,
                experts: int = 8, top_k: int = 2, vocab: int = 128):
    """A small config of architecture ``arch`` (a key of SUPPORTED) that builds offline."""
    import transformers as tf
    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    hd = hidden // 4
    if arch == "mixtral":
        return tf.MixtralConfig(intermediate_size=inter, num_local_experts=experts,
                                num_experts_per_tok=top_k, **common)
    if arch == "qwen2_moe":
        return tf.Qwen2MoeConfig(intermediate_size=2 * inter, moe_intermediate_size=inter,
                                 shared_expert_intermediate_size=inter, num_experts=experts,
                                 num_experts_per_tok=top_k, **common)
    if arch == "qwen3_moe":
        return tf.Qwen3MoeConfig(intermediate_size=2 * inter, moe_intermediate_size=inter,
                                 num_experts=experts, num_experts_per_tok=top_k, head_dim=hd,
                                 **common)
    if arch == "olmoe":
        return tf.OlmoeConfig(intermediate_size=inter, num_experts=experts,
                              num_experts_per_tok=top_k, **common)
    if arch == "phimoe":
        return tf.PhimoeConfig(intermediate_size=inter, num_local_experts=experts,
                               num_experts_per_tok=top_k, **common)
    if arch == "deepseek_v3":
        return tf.DeepseekV3Config(intermediate_size=2 * inter, moe_intermediate_size=inter,
                                   n_routed_experts=experts, num_experts_per_tok=top_k,
                                   n_shared_experts=1, first_k_dense_replace=1, n_group=2,
                                   topk_group=2, q_lora_rank=None, kv_lora_rank=32,
                                   qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=hd,
                                   **common)
    if arch == "gpt_oss":
        return tf.GptOssConfig(intermediate_size=inter, num_local_experts=experts,
                               num_experts_per_tok=top_k, head_dim=hd, sliding_window=64,
                               **common)
    raise UnsupportedModelError(f"no tiny config for {arch!r}; supported: {sorted(SUPPORTED)}")


def tiny_model(arch: str, seed: int = 0, dtype: torch.dtype = torch.float32,
               router_std: float = 1.0, **kw) -> nn.Module:
    """A randomly initialised eval-mode model from :func:`tiny_config`, eager experts, with its
    routers re-initialised at ``router_std`` so routing is far from uniform."""
    import logging

    from transformers import AutoModelForCausalLM
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(seed)
    cfg = tiny_config(arch, **kw)
    model = AutoModelForCausalLM.from_config(cfg, experts_implementation="eager", dtype=dtype)
    a = SUPPORTED[arch]
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for i in moe_layers(model):
            mlp = model.model.layers[i].mlp
            r = getattr(mlp, a.router_attr)
            r.weight.copy_(torch.randn(r.weight.shape, generator=g) * router_std
                           / math.sqrt(r.weight.shape[1]) * 4)
            if getattr(r, "bias", None) is not None:
                r.bias.copy_(torch.randn(r.bias.shape, generator=g) * 0.5)
            ex = mlp.experts
            for name, p in ex.named_parameters():
                if "bias" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model.eval()


def iter_experts_modules(model: nn.Module) -> Iterator[nn.Module]:
    """The routed-experts module of every MoE layer, in layer order."""
    dec = _decoder(model)
    for i in moe_layers(model):
        yield dec.layers[i].mlp.experts

"""HuggingFace transformers (5.x) integration: run a MoE model with its routed experts offloaded.

Two ways in, one :class:`Engine`:

* :func:`specmoe.from_pretrained` (``specmoe/models/pretrained.py``) builds the model from a checkpoint
  folder without ever materialising its experts: the skeleton on the meta device, the other
  weights loaded from the shards, the experts streamed into a persistent store.
* :func:`offload` takes a model transformers already loaded, writes its experts to a store and
  frees them layer by layer.

Either way each MoE layer's ``experts`` module becomes a :class:`SpecmoeExperts`, called exactly
like the one it replaces (``experts(hidden[T,H], top_k_index[T,k], top_k_weights[T,k])``, after
all of the model's own routing), which runs the whole layer in one C call (``_C.Layers``,
csrc/layer.h) with the GIL released: the next layer's prediction and prefetch, tokens grouped
by expert, each needed expert fetched once through the cache, its FFN run on all of its tokens,
``weight * output`` accumulated.  Routers, attention,
shared experts and dense layers stay in torch, untouched.  Which models fit and how their
experts are laid out: :mod:`specmoe.models.arch`; the store: :mod:`specmoe.storage.conversion`.

Typical use::

    model = specmoe.from_pretrained("path/to/checkpoint", cache="6GiB", dtype="int4")
    model.generate(...)                 # unchanged transformers API (KV cache, batches)
    eng = specmoe.engine_of(model)
    eng.stats()                         # hits, misses, hit_rate, stall_s, prefetch precision...
    with eng.trace() as t:
        model.generate(...)
    t.result().save("routing.npz")      # a specmoe.sim.traces.Trace
    eng.close()
"""
from __future__ import annotations

import contextlib
import os
import tempfile
import threading
from typing import TYPE_CHECKING, Any, Callable, Iterator, Sequence

import numpy as np
import torch
from torch import nn

from .. import _C
from . import engine_base, misses
from ..models.arch import (ROUTED_BLOCKS, SUPPORTED, UNSUPPORTED, ArchInfo, UnsupportedModelError,
                           describe, expert_module, extract_expert, extract_experts, getpath,
                           iter_experts_modules, moe_block, moe_layers)
from ..storage.conversion import store_settings, write_experts
from ..models.dense import GgufDense, resolve_dense
from ..models.layers import (BlockRoute, CLinear, sequence_rows, set_block_route, silu_mlp_parts,
                             split_sequences, split_shared_gate)
from .engine_base import PREDICTORS, EngineCommon, check_prefetch, check_prefetch_arg
from .tau_tables import TauTables

from .expert_copy import ExpertCopy
from .memplan import trim_heap
from .experts import SpecmoeExperts, engine_of
from .lookahead import LookaheadBuffer, draft_step_priorities, lookahead_queue
from .recording import Recorder
from .policies import COUNT_POLICIES, UTILITY_POLICIES

if TYPE_CHECKING:
    from .gpu_engine import GpuEngine

__all__ = [
    "SUPPORTED",
    "UNSUPPORTED",
    "Engine",
    "SpecmoeExperts",
    "UnsupportedModelError",
    "available_policies",
    "engine_of",
    "extract_experts",
    "iter_experts_modules",
    "moe_layers",
    "offload",
]

DTYPES = ("f32", "bf16", "int8", "int4", "int2")


def _check_capacity(cache: Any, total: int | None = None, slot_bytes: int = 1) -> None:
    """Raise ValueError naming ``cache=`` for a capacity spec the cache would refuse: its form
    and range alone (``total`` None: before the model is known), else also that it holds at
    least one ``slot_bytes`` expert of ``total``."""
    from .cache import check_capacity, parse_capacity
    try:
        if total is None:
            check_capacity(cache)
        else:
            parse_capacity(cache, total_experts=total, slot_bytes=slot_bytes)
    except ValueError as exc:
        raise ValueError(f"cache={cache!r}: {exc}") from None


def _check_flag(name: str, value: Any) -> None:
    """A switch must be a bool (or 0/1): a string such as "no" would otherwise read as True."""
    if not isinstance(value, (bool, np.bool_)) and (
            not isinstance(value, (int, np.integer)) or value not in (0, 1)):
        raise TypeError(f"{name} must be a bool, got {value!r}")


def check_early(dtype: str, cache: Any, policy: Any, prefetch: Any) -> None:
    """The checks of offload/from_pretrained's arguments that need no model: they run before
    any conversion, so a typo does not cost a conversion first."""
    from .policies import check_policy
    check_dtype(dtype)
    _check_capacity(cache)
    check_policy(policy)
    check_prefetch_arg(prefetch)


def check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} not supported; choose one of {DTYPES}")


# ---------------------------------------------------------------------------------------------
# the replacement experts module


class _LayerCallSlot:
    """Engine.layer_call_slot's context manager.  A class rather than a generator-based
    context manager: on a decode step, whose weights have just streamed through the CPU caches,
    the generator's enter/exit cost ~35 us a layer call (DeepSeek-V2-Lite, int4, 2 threads)."""

    __slots__ = ("eng",)

    def __init__(self, eng: "Engine") -> None:
        self.eng = eng

    def __enter__(self) -> None:
        e = self.eng
        with e._cv:
            if e._exclusive_owner:
                # counted as waiting, so that the next exclusive section lets this call in
                # first: a thread calling set_cache in a loop cannot starve generation
                e._waiting += 1
                try:
                    while e._exclusive_owner:
                        e._cv.wait()
                finally:
                    e._waiting -= 1
                    if not e._waiting:
                        e._cv.notify_all()
            if e._closed:
                raise RuntimeError("this specmoe Engine is closed")
            e._inflight += 1

    def __exit__(self, *exc: Any) -> None:
        e = self.eng
        with e._cv:
            e._inflight -= 1
            if not e._inflight:
                e._cv.notify_all()


def _gated_shared_parts(block: nn.Module, dtype: torch.dtype) -> tuple[tuple, int | None] | None:
    """A Qwen2-MoE-form block's shared expert as ``_C.Layers.set_block`` takes it, (gate, up,
    down, output gate) ``_C.Linear``, and the most tokens it runs in C (None: any), when the
    expert is a SiLU MLP of :class:`CLinear` and ``shared_expert_gate`` a one-row CLinear, all
    computing in ``dtype``; else None."""
    mlp = silu_mlp_parts(getattr(block, "shared_expert", None))
    og = getattr(block, "shared_expert_gate", None)
    if mlp is None or not isinstance(og, CLinear) or og.out_features != 1 or mlp[1] != dtype \
            or og.out_dtype != dtype:
        return None
    most = [m for m in (mlp[2], og.torch_above if og.weight_view is not None else None)
            if m is not None]
    return mlp[0] + (og._c,), min(most) if most else None


class Engine(EngineCommon):
    """The running offload of one model: the store, the cache over it, the kernels' context and
    the per-layer path.  Made by :func:`offload` and :func:`specmoe.from_pretrained`; find a
    model's with :func:`engine_of`."""

    _down_codes: list[int] | None = None  # per-layer down formats of a GGUF block store

    def __init__(self, model: nn.Module, store: str | os.PathLike[str], *,
                 cache: int | float | str = 0.25, policy: Any = "lru",
                 prefetch: bool | str = True, overfetch: float = 1.5,
                 direct: bool | None = False, verify: bool = True,
                 own_store: bool = False, dense: str | bool | None = "auto",
                 miss: str = "fetch", miss_keep: int = 2,
                 route_lambda: float = 0.0, throttle: tuple[float, float] | None = None,
                 miss_levels: str | Sequence[str] = "int4",
                 miss_keep2: int | None = None, gguf_dense: GgufDense | None = None) -> None:
        """Serve ``model``'s routed experts from the store file ``store`` (written for this
        model by :mod:`specmoe.storage.conversion`): every MoE layer's ``experts`` module becomes a
        :class:`SpecmoeExperts` (whatever it held is dropped).

        cache: slots (int), a fraction of all experts (``0.25``, ``"25%"``) or a byte size
        (``"6GiB"``), as :func:`specmoe.parse_capacity`.  direct: read the store with O_DIRECT;
        None decides by size (O_DIRECT when the store exceeds half the memory this process may
        use: the page cache could not hold it anyway and would only compete with the cache).
        verify: check every block read against its CRC32C.  own_store: delete the file on
        :meth:`close`.  dense: the model's other linear layers (attention projections,
        shared-expert and dense MLPs, lm_head; never the routers) through specmoe's C kernels:
        ``"auto"`` (bf16 weights kept exactly where the kernels are faster), ``"torch"``/None
        (untouched), or a format ``"f32"``, ``"bf16"``, ``"int8"``, ``"int4"`` (see
        :mod:`specmoe.models.dense`); what was done is in ``engine.dense``.  miss, miss_keep,
        route_lambda, throttle, miss_levels, miss_keep2: SpecMD's miss handling (``"fetch"``,
        ``"drop"``, ``"substitute"``, ``"lowest_bit"``, ``"priority"``), cache-aware routing,
        link emulation and the low-bit fallback levels (``"int4"``, ``"int4:int2"``), see
        :mod:`specmoe.runtime.misses`.  gguf_dense: with ``dense="gguf"``, the GGUF file's dense
        blocks the layers run on (:class:`specmoe.models.dense.GgufDense`, what
        :func:`specmoe.from_pretrained` passes)."""
        from ..models.dense import convert_dense
        from ..models.linear_attn import prepare as prepare_recurrent
        from .kernels import FFNSpec, context, down_dtype_codes
        from ..storage.store import ExpertStore
        info, ids = describe(model)
        if overfetch < 1:
            raise ValueError(f"overfetch must be >= 1, got {overfetch}")
        resolve_dense(dense, torch.float32)  # a bad value fails before anything is touched
        pred_name = check_prefetch_arg(prefetch)
        if pred_name == "oracle":
            raise ValueError("prefetch='oracle' predicts from a routing replay: build the engine, "
                             "call replay_routing(trace), then set_prefetch(True, "
                             "predictor='oracle') (from_pretrained(route='replay') does this)")
        cfg = model.config
        miss, miss_keep, route_lambda = misses.check_miss(
            miss, miss_keep, route_lambda, int(cfg.num_experts_per_tok))
        self.miss_levels, miss_keep2 = misses.check_levels(
            miss_levels, miss_keep2, miss_keep, int(cfg.num_experts_per_tok))
        self._miss = {"miss": miss, "miss_keep": miss_keep, "route_lambda": route_lambda,
                      "miss_keep2": miss_keep2}  # the C layers' once they exist (EngineCommon)
        misses.check_throttle(throttle)
        self.throttle = throttle
        self.model: nn.Module | None = model
        self.arch: ArchInfo = info
        self.model_type = info.model_type
        self.layer_ids: list[int] = ids
        self.top_k = int(cfg.num_experts_per_tok)
        self.policy: Any = policy
        self._prediction = {"prefetch": pred_name is not None, "overfetch": float(overfetch),
                            "mass": 0.0, "predictor": pred_name or "router"}
        # ^ the C layers' once they exist (EngineCommon)
        # a routing replay (replay_routing): the trace's experts, pushed into new C layers,
        # which own the position (_replay_start carries it across a rebuild)
        self._replay: np.ndarray | None = None
        self._replay_start = 0
        self._replay_tokens = None  # the replay's token pieces (their priors: _push_priors)
        blocks = [moe_block(model, info, i) for i in ids]
        # the prefetch predictor's view of each layer's router: the module holding weight [E,H]
        # (and bias), and the correction bias added to the scores when choosing experts
        # Inside a batched prefill (sequences(n)) a router whose product runs in torch runs
        # one prompt at a time: each prompt's routing keeps its prefill's bits (split_sequences)
        self._routers: list[nn.Module] = [split_sequences(getpath(b, info.router_attr))
                                          for b in blocks]
        for b in blocks:  # the same for Qwen2-MoE's sigmoid gate of its shared expert
            split_shared_gate(b)
        self._router_bias: list[torch.Tensor | None] = [
            getpath(b, info.bias_attr) if info.bias_attr else None for b in blocks]
        self._predictor: Callable[[int, torch.Tensor], Any] | None = None
        self.recorder: Recorder | None = None
        self._adopt_store(store, own_store)
        self._store: Any = None
        self._cache: Any = None
        self._layers: Any = None  # _C.Layers over the cache: the per-layer path and counters
        self._closed = False
        # Threads: layer calls run concurrently (the C objects lock for themselves); close()
        # and set_cache() wait for the calls in flight and hold new ones off meanwhile.
        self._cv = threading.Condition()
        self._inflight = 0  # [_cv] layer calls running
        self._waiting = 0   # [_cv] layer calls waiting for an exclusive section to end
        self._exclusive_owner = False  # [_cv] close/set_cache running
        # resident low-bit copies of every routed expert, by format: the self-draft's
        # (MoE-SpeQ) and SpecMD's fallback levels share them (lowbit_copy)
        self._copies: dict[str, ExpertCopy] = {}
        # self-draft (MoE-SpeQ): one of _copies, the one the draft forwards run on
        self._draft: ExpertCopy | None = None
        self._drafting: list[tuple[int, np.ndarray, np.ndarray]] | None = None  # draft routing
        self._draft_prefetch = False  # drafting(prefetch=True) in progress
        # lookahead-aware eviction (MoE-SpeQ): the lookahead buffer's experts are evicted last
        # (ExpertCache.protect), each layer's until that layer of the verification has run
        self.protect_lookahead = True
        # each layer's misses load on the prefetch worker while its resident experts compute
        # (csrc/layer.h step 5); set_parallel_misses().  On by default: 1.10-1.12x tok/s behind
        # emulated 4 and 1 GB/s links at hidden 1024, 1.04x from the page cache
        # (benchmarks/results/parallel_misses_*.json); outputs never depend on the worker's
        # timing (a token's experts are summed in ascending id, csrc/moe.h fixed_sum)
        self.parallel_misses = True
        # draft tokens of the forward in progress (draft_tokens()): their misses never load
        self._draft_flags: np.ndarray | None = None
        self._draft_queued = 0  # experts queued by draft steps since the last reset
        # draft-driven lookahead: the next pass's predicted experts and their accounting
        self._la = LookaheadBuffer(len(ids), 0)  # num_experts known once the store is open
        self.tau = TauTables()  # tau(g) per batch size, measured by specmoe.generate
        # per MoE layer routed in C with a routing scale and a shared FFN: (scale, its (gate,
        # up, down[, output gate]) _C.Linear, the most tokens it runs in C or None, (n_group,
        # topk_group) of a sigmoid router), applied to every _C.Layers built
        # (_configure_layers)
        self._blocks: dict[int, tuple[float, tuple[Any, ...], int | None,
                                      tuple[int, int]]] = {}
        try:
            path = self._store_path
            if direct is None:
                direct = os.path.getsize(path) > engine_base.memory_limit() // 2
            st = self._store = ExpertStore(path, direct=bool(direct), verify=verify)
            ex = st.extra
            if st.num_layers != len(ids) or ex.get("layer_ids", ids) != ids:
                raise ValueError(f"{path}: the store holds {st.num_layers} MoE layers "
                                 f"{ex.get('layer_ids')}, the model has {ids}")
            self.num_experts = int(st.num_experts)
            self._la = LookaheadBuffer(len(ids), self.num_experts)
            self.dtype = str(ex.get("dtype", "f32"))
            act = ex.get("activation", "silu")
            self._ffn_args = dict(activation=act, alpha=float(ex.get("alpha", 1.702)),
                                  limit=float(ex.get("limit", 7.0)))
            spec = FFNSpec.from_store_schema(st.tensors, int(st.block_bytes), **self._ffn_args)
            self._desc = spec.desc()
            # a GGUF block store whose layers' down projections differ (Q4_K_M: Q4_K / Q6_K)
            self._down_codes = down_dtype_codes(ex.get("gguf_down_kinds"), len(ids))
            self._block_bytes = int(st.block_bytes)
            self._kctx = context()
            if self.top_k > self.num_experts:
                raise ValueError(f"top_k {self.top_k} > num_experts {self.num_experts}")
            _check_capacity(cache, self.num_experts * len(ids), self._block_bytes)
        except BaseException:
            self.close()
            raise
        for pos, i in enumerate(ids):
            block = moe_block(model, info, i)
            block.experts = SpecmoeExperts(self, pos, self.num_experts, spec.H)
            block.experts.train(block.training)
        # the dense layers are converted before the cache takes its memory: a checkpoint's
        # weights load at their own dtype, and under a budget planned for int8 dense layers
        # (specmoe.runtime.memplan) the bf16 copies must be gone before the slots are taken
        self.dense = convert_dense(
            model, dense, skip=self._routers, ctx=self._kctx,
            blocks=gguf_dense.layers if gguf_dense is not None else None,
            mla_blocks=gguf_dense.mla if gguf_dense is not None else None)
        # the recurrent layers' per-token work that transformers' torch code makes slow on a
        # CPU (bf16 depthwise convolutions, the gated delta rule): specmoe.models.linear_attn
        self.recurrent = prepare_recurrent(model, self._kctx)
        trim_heap()  # the freed copies' pages back to the kernel before the slots are taken
        try:
            self._open_cache(cache)
        except BaseException:
            self.close()
            raise
        # the MoE blocks whose routing runs in C (layer positions), see _install_routing
        self.routed_in_c: list[int] = self._install_routing(model, info, ids)

    def _install_routing(self, model: nn.Module, info: ArchInfo, ids: list[int]) -> list[int]:
        """With the dense layers in C (``dense`` a format), each MoE block of a
        ``ROUTED_BLOCKS`` form computes its routing in the same C call as its experts
        (``_C.Layers.forward_routed``: the router copy's GEMV, softmax, top-k, the model's
        renormalisation and casts) instead of torch's router module plus the experts call.  The
        routing equals torch's up to the logits' summation order, the same order of difference
        as the C projections feeding it (a near-tie at the k-th expert may go either way).
        Returns the layer positions switched; the routers stay in torch without dense layers
        in C, and every call the path does not cover (drafts, a Python predictor, trace
        recording, training, another dtype) takes the block's own forward (a lookahead does
        not: :meth:`routable`)."""
        if self.dense.dtype is None or not hasattr(self._layers, "forward_routed"):
            return []
        done = []
        for pos, i in enumerate(ids):
            block = moe_block(model, info, i)
            kind = ROUTED_BLOCKS.get(type(block).__name__)
            gate = getpath(block, info.router_attr)
            # (a sigmoid router's arch: its C layers score with sigmoid + corr; ERNIE's softmax
            # router has a correction bias too)
            v3 = kind in ("deepseek_v3", "minimax_m2")
            corr = v3 or kind == "ernie"
            if kind is None or gate is None or gate is not self._routers[pos] \
                    or (self._router_bias[pos] is not None) != corr \
                    or bool(self.arch.sigmoid_router) != v3 \
                    or getattr(gate, "weight", None) is None \
                    or gate.weight.dtype not in (torch.float32, torch.bfloat16):
                continue
            dtype = gate.weight.dtype  # the dtype the block computes in
            flags = 0
            if kind == "minimax_m2":
                # MiniMax-M2's router: logits in the weights' dtype (bf16: rounded), sigmoid in
                # f32 plus the block's correction bias for the choice, the chosen sigmoid
                # scores renormalised as f32 weights; no groups, scale or shared experts
                if getattr(gate, "top_k", None) != self.top_k:
                    continue
                flags = _C.ROUTE_RENORM | (_C.ROUTE_BF16_LOGITS if dtype == torch.bfloat16
                                           else 0)
            elif v3:
                # DeepSeek-V3's router (V3, R1, Kimi-K2, GLM-4.5 / 4.7-Flash, dots1): f32
                # logits from f32 weights, sigmoid, the correction bias and the groups for the
                # choice, the sigmoid scores renormalised (norm_topk_prob) and scaled as
                # weights; the shared experts' MLP added in the same call
                shared = silu_mlp_parts(getattr(block, "shared_experts", None))
                groups = (int(getattr(gate, "num_group", 0)), int(getattr(gate, "topk_group", 0)))
                if shared is None or getattr(gate, "top_k", None) != self.top_k \
                        or min(groups) < 1:  # (any weight dtype: the router widens it to f32)
                    continue
                linears, dtype, most = shared  # (the block computes in its experts' dtype)
                flags = (_C.ROUTE_BF16_OUT if dtype == torch.bfloat16 else 0) \
                    | (_C.ROUTE_RENORM if gate.norm_topk_prob else 0)
                if not self._set_block(pos, float(gate.routed_scaling_factor), linears, most,
                                       groups):
                    continue  # groups this layer's experts do not fit
            elif kind == "gpt_oss":
                # GPT-OSS's router: logits in the weights' dtype (bf16: rounded) with the
                # router's bias, the top-k logits' softmax in that dtype as the weights
                if getattr(gate, "top_k", None) != self.top_k:
                    continue
                flags = _C.ROUTE_TOPK_SOFTMAX | (
                    _C.ROUTE_BF16_LOGITS | _C.ROUTE_BF16_WEIGHTS if dtype == torch.bfloat16
                    else 0)
            elif kind == "ernie":
                # ERNIE-4.5's router: f32 logits from f32 weights, softmax, the choice by the
                # probabilities plus the correction bias, the chosen probabilities over their
                # sum (at least moe_norm_min, 1e-12 in C) cast to the model's dtype; the shared
                # experts' MLP added in the same call
                shared = silu_mlp_parts(getattr(block, "shared_experts", None))
                if shared is None or getattr(gate, "top_k", None) != self.top_k \
                        or getattr(gate, "norm_min", None) != 1e-12:
                    continue  # (any router dtype: it computes in f32)
                linears, dtype, most = shared  # (the block computes in its experts' dtype)
                flags = _C.ROUTE_RENORM | (_C.ROUTE_BF16_OUT | _C.ROUTE_BF16_WEIGHTS
                                           if dtype == torch.bfloat16 else 0)
                if not self._set_block(pos, 1.0, linears, most):
                    continue  # (without its shared experts the C call would drop them)
            elif kind == "deepseek":
                shared = silu_mlp_parts(getattr(block, "shared_experts", None))
                if getattr(gate, "topk_method", None) != "greedy" or shared is None:
                    continue
                # DeepSeek-V2's router: f32 logits and weights, no renormalisation, times
                # routed_scaling_factor; the shared experts' MLP added in the same call
                linears, dtype, most = shared
                flags = _C.ROUTE_BF16_OUT if dtype == torch.bfloat16 else 0
                if not self._set_block(pos, float(gate.routed_scaling_factor), linears,
                                       most):
                    continue
            else:
                if kind in ("mixtral", "qwen_shared_renorm") \
                        or getattr(gate, "norm_topk_prob", False):
                    flags |= _C.ROUTE_RENORM
                if dtype == torch.bfloat16:
                    flags |= _C.ROUTE_BF16_LOGITS | (_C.ROUTE_BF16_WEIGHTS if kind != "mixtral"
                                                     else 0)
                if kind.startswith("qwen_shared"):
                    # the shared expert times sigmoid(shared_expert_gate x), in the same call
                    shared = _gated_shared_parts(block, dtype)
                    if shared is None:
                        continue
                    linears, most = shared
                    flags |= _C.ROUTE_BF16_OUT if dtype == torch.bfloat16 else 0
                    if not self._set_block(pos, 1.0, linears, most):
                        continue
            block.forward = self._routed_forward(block, pos, flags, dtype, block.forward,
                                                 scores_out=kind == "gpt_oss")
            # what a fused decoder layer needs to run this block inside its own C call
            # (specmoe.models.attention, _C.AttnBlock.layer)
            set_block_route(block, BlockRoute(self, pos, flags, dtype))
            done.append(pos)
        return done

    def _set_block(self, pos: int, scale: float, linears: tuple[Any, ...], most: int | None,
                   groups: tuple[int, int] = (1, 1)) -> bool:
        """MoE layer ``pos``'s routing scale, shared FFN and expert groups into the C layers
        and ``_blocks`` (which every later _C.Layers gets: _configure_layers); False, nothing
        kept, when the C layers refuse the groups."""
        try:
            self._layers.set_block(pos, scale, linears, *groups)
        except ValueError:
            return False
        self._blocks[pos] = (scale, linears, most, groups)
        return True

    def _routed_forward(self, block: nn.Module, pos: int, flags: int, dtype: torch.dtype,
                        original: Callable[..., Any], scores_out: bool = False
                        ) -> Callable[..., Any]:
        """The block's forward routed in C (:meth:`_layer_routed`) where :meth:`routable`;
        ``scores_out``: the block returns (output, router scores), as GPT-OSS's does, and
        the C path gives (output, None) (the decoder layer drops the scores)."""
        # a shared FFN of f32/bf16 weights goes to torch above its CLinears' torch_above
        # tokens (prefill): then the block's own forward runs
        most = self._blocks[pos][2] if pos in self._blocks else None

        def forward(hidden_states: torch.Tensor) -> Any:
            if block.training or not self.routable(hidden_states, dtype):
                return original(hidden_states)
            if most is not None and sequence_rows(
                    hidden_states.numel() // hidden_states.shape[-1]) > most:
                # the block's own forward: its router and shared FFN one sequence at a time
                # (split_sequences, CLinear), its experts in one call for all rows
                return original(hidden_states)
            shape = hidden_states.shape
            out = self._layer_routed(pos, hidden_states.reshape(-1, shape[-1]),
                                     flags).reshape(shape)
            return (out, None) if scores_out else out
        forward.__name__ = f"specmoe_routed_{type(block).__name__}_forward"
        return forward

    def routable(self, hidden: torch.Tensor, dtype: torch.dtype, fused: bool = False) -> bool:
        """Whether a routed block's call on ``hidden`` may route in C now: none of the paths
        that need the routing in Python (drafts, a Python predictor, trace recording) is on.
        ``fused``: a call that runs the block inside a one-call decoder layer or step, which
        a draft-driven lookahead also keeps out (its per-layer bookkeeping is done by the
        block's own call, :meth:`_layer_routed`).  A lookahead does not route in Python: the
        C router's weights round differently from torch's, and a verification must give the
        bits of the plain steps it is checked against."""
        return (hidden.dtype == dtype and hidden.device.type == "cpu" and self._drafting is None
                and self._predictor is None and self.recorder is None
                and self._draft_flags is None and not (fused and self._la.active))

    def _layer_routed(self, pos: int, hidden: torch.Tensor, flags: int) -> torch.Tensor:
        """One MoE block, routing and experts, in one C call (see _install_routing); under a
        draft-driven lookahead the layer's prefetch request adds to the lookahead's queue and
        the lookahead's bookkeeping follows, as on the per-layer path (_layer_call)."""
        with self.layer_call_slot():
            x = hidden.detach().to(torch.float32).contiguous()
            T = x.shape[0]
            out = torch.empty_like(x)
            idx = np.empty((T, self.top_k), np.int64)
            used = np.empty(self.num_experts, np.uint8)
            la = self._la.active
            self._layers.forward_routed(pos, x.numpy(), idx,
                                        np.empty((T, self.top_k), np.float32), out.numpy(),
                                        used, flags, not la)
            if la:
                self._lookahead_layer_done(pos, used, idx)
            return out.to(hidden.dtype)

    def _lookahead_layer_done(self, pos: int, used: np.ndarray, idx: Any) -> None:
        """MoE layer ``pos`` of a pass under a lookahead ran, using the experts flagged in
        ``used``, routed to ``idx`` [T, k] (the router's own top-k, before any miss handling
        re-routes a copy of it): the lookahead's bookkeeping, and its experts unprotected."""
        if self._la.rows:
            self._la.layer_done(pos, used, np.asarray(idx))
        else:
            self._la.layer_done(pos, used)
        if self.protect_lookahead and self._cache is not None:
            self._protect()  # this layer's experts are used: unprotect them

    # -- the per-layer path -------------------------------------------------------------------
    def layer_forward(self, pos: int, hidden: torch.Tensor, idx: torch.Tensor,
                       w: torch.Tensor) -> torch.Tensor:
        """One MoE layer: everything per token runs in ``_C.Layers.forward`` (csrc/layer.h):
        pass start, next-layer router prediction and prefetch, policy counts, the experts,
        prediction counters.  Python keeps the torch glue, the optional Python predictor,
        the draft-driven lookahead accounting and trace recording."""
        with self.layer_call_slot():
            if self._drafting is not None:
                return self._draft_layer(pos, hidden, idx, w)
            return self._layer_call(pos, hidden, idx, w)

    @property
    def layers(self) -> Any:
        """The ``_C.Layers`` the per-layer calls go through (None once closed).  Replaced by
        :meth:`set_cache`; hold it only inside :meth:`layer_call_slot`."""
        return self._layers

    @property
    def draft_copy(self) -> ExpertCopy | None:
        """The self-draft's resident low-bit copy of every expert (MoE-SpeQ), or None."""
        return self._draft

    def layer_call_slot(self) -> _LayerCallSlot:
        """A layer call in flight (``with``): waits out close/set_cache (_exclusive), refuses a
        closed Engine, and counts itself in _inflight for them."""
        return _LayerCallSlot(self)

    @contextlib.contextmanager
    def _exclusive(self) -> Iterator[None]:
        """No layer call runs inside the block (they wait at its end, and the layer calls that
        waited for one exclusive block run before the next block starts)."""
        with self._cv:
            while self._exclusive_owner or self._waiting:  # (waiting calls go first)
                self._cv.wait()
            self._exclusive_owner = True
            while self._inflight:
                self._cv.wait()
        try:
            yield
        finally:
            with self._cv:
                self._exclusive_owner = False
                self._cv.notify_all()

    def _layer_call(self, pos: int, hidden: torch.Tensor, idx: torch.Tensor,
                    w: torch.Tensor) -> torch.Tensor:
        if self._replay is not None:
            raise RuntimeError(
                f"replay_routing: MoE layer {pos} was routed in Python (a Python predictor, "
                f"trace recording, drafting or a prefill whose shared experts run in torch), "
                f"which a routing replay cannot follow; run passes that route in C")
        x, ix, wt, out, used = self._buffers(hidden, idx, w)
        scores = None
        if self._predictor is not None and self.prefetch and pos + 1 < len(self.layer_ids):
            with torch.no_grad():  # the documented slow path: a predictor written in Python
                sc = torch.as_tensor(self._predictor(pos + 1, hidden.detach()))
                scores = sc.detach().to(torch.float32).contiguous().numpy()
        flags = self._draft_flags
        if flags is not None and flags.shape[0] != x.shape[0]:
            raise ValueError(f"draft_tokens: {flags.shape[0]} flags, but MoE layer {pos} got "
                             f"{x.shape[0]} tokens")
        # a draft-driven lookahead queued for this pass must survive the per-layer requests
        self._layers.forward(pos, x.numpy(), ix.numpy(), wt.numpy(), out.numpy(), used, scores,
                             not self._la.active, flags)
        if self._la.active:
            self._lookahead_layer_done(pos, used, idx.detach())
        if self.recorder is not None:  # trace() on: no call per layer otherwise
            self.record_layer(pos, hidden, idx, w)
        return out.to(hidden.dtype)

    # backend: the ExpertCache over the store (or, in a build without them, a resident buffer)
    def _open_cache(self, capacity: int | float | str) -> None:
        from .cache import ExpertCache
        _check_capacity(capacity, self.num_experts * len(self.layer_ids), self._block_bytes)
        new = ExpertCache(self._store, capacity, self.policy, top_k=self.top_k,
                          prefetch=True)  # built first: a bad policy/capacity keeps the old one
        try:
            layers = _C.Layers(new, self._kctx, self._desc, self._router_copies(), self.top_k,
                               sigmoid=self.arch.sigmoid_router)
            if self._down_codes is not None:
                layers.set_down_dtypes(self._down_codes)
        except BaseException:
            new.close()
            raise
        if self._cache is not None:
            self._cache.close()
        self._keep_settings()  # the old layers' settings go to the new ones
        if self._layers is not None and self._replay is not None:
            self._replay_start = self._layers.replay_position()[0]
        self._cache, self._layers = new, layers
        new.set_admission(self.admission, self.byte_budget)  # kept across rebuilds
        self._configure_layers()

    def _configure_layers(self) -> None:
        """Push every setting into the C layers (new ones, or after _keep_settings)."""
        p = self._prediction
        self._layers.configure(p["prefetch"], p["overfetch"], p["mass"], self._counts_fed)
        if self._replay is not None:  # before the predictor: the oracle needs it
            self._layers.set_replay(self._replay, start=self._replay_start)
        self._push_predictor(p.get("predictor", "router"))
        for pos, (scale, shared, _, groups) in self._blocks.items():
            self._layers.set_block(pos, scale, shared, *groups)
        self._layers.set_parallel(self.parallel_misses)
        misses.apply(self, self._miss)

    @property
    def cache_frac(self) -> float:
        """The cache's capacity as a fraction of all routed experts."""
        if self._cache is None:
            return 0.0
        return self._cache.capacity / (self.num_experts * len(self.layer_ids))

    @property
    def _counts_fed(self) -> bool:
        # any utility-space policy, named or given as an object
        return self._cache is not None and self._cache.policy in COUNT_POLICIES

    # -- self-draft and draft-driven lookahead (used by specmoe.generate) ---------------------
    def enable_self_draft(self, dtype: str = "int4") -> None:
        """Keep a ``dtype`` copy of every routed expert resident in memory, so the target itself
        can draft (MoE-SpeQ's quantized self-draft, see :class:`specmoe.speculation.drafters.SelfDraft`).

        The copy is built from the store (dequantized to f32, requantized to ``dtype``) through
        a temporary store file that is deleted at once; it costs ``dtype``'s size of all experts
        (int4: about 1/7 of f32).  It is shared with SpecMD's miss handling when that uses the
        same format (``miss_levels``).  Calling it again with another dtype switches copies."""
        check_dtype(dtype)
        if self._draft is not None and self._draft.dtype == dtype:
            return
        self._draft = self.lowbit_copy(dtype)
        misses.apply(self)  # the draft tokens' copy when no miss mode uses one

    @property
    def draft_dtype(self) -> str | None:
        """The self-draft copy's format, None before :meth:`enable_self_draft`."""
        return self._draft.dtype if self._draft is not None else None

    def _buffers(self, hidden: torch.Tensor, idx: torch.Tensor, w: torch.Tensor) -> tuple:
        """The C layer's inputs (f32 hidden, int64 ids, f32 weights, contiguous), its output
        buffer and the per-expert "used" flags (per call: calls may run in several threads)."""
        x = hidden.detach().to(torch.float32).contiguous()
        return (x, idx.detach().to(torch.int64).contiguous(),
                w.detach().to(torch.float32).contiguous(), torch.empty_like(x),
                np.empty(self.num_experts, np.uint8))

    def _draft_layer(self, pos: int, hidden: torch.Tensor, idx: torch.Tensor,
                     w: torch.Tensor) -> torch.Tensor:
        if self._draft is None:
            raise RuntimeError("drafting() needs enable_self_draft() first")
        x, ix, wt, out, used = self._buffers(hidden, idx, w)
        self._draft.forward(self._kctx, pos, x.numpy(), ix.numpy(), wt.numpy(), out.numpy(),
                            used)
        assert self._drafting is not None
        self._drafting.append((pos, ix.numpy().copy(), wt.numpy().copy()))
        if self._draft_prefetch and self.prefetch and self._cache is not None:
            # MoE-SpeQ's draft-guided pipeline (Sec. 3): the experts this draft step routes
            # its newest token to are queued now, with the router's weight as confidence,
            # so the target's copies load while the draft goes on.  Earlier layers first, as
            # lookahead() orders them; lookahead() later replaces the queue with the whole
            # buffer.  (Only the last row: a first draft forward also re-reads tokens the
            # target has already verified.)
            e = ix[-1].numpy()
            pri = draft_step_priorities(pos, wt[-1].numpy(), len(self.layer_ids))
            self._cache.prefetch((np.full(len(e), pos, np.int64), e.astype(np.int64), pri))
            self._draft_queued += len(e)
        return out.to(hidden.dtype)

    def lookahead(self, counts: dict[int, np.ndarray],
                  tokens: dict[int, np.ndarray] | None = None,
                  confidence: dict[int, np.ndarray] | None = None) -> None:
        """Draft-driven prefetch (MoE-SpeQ's expert lookahead buffer) for the next forward pass:
        ``counts[pos]`` [E] holds how many of the pass's tokens the draft expects to route to
        each expert of MoE layer ``pos`` (0: not expected).  Every expected expert is queued to
        the prefetch worker at once, earlier layers first; within a layer, under a
        utility-space policy (spac, spac_ema), by utility and then count, higher first.  The next pass's
        per-layer router prefetch adds to this queue instead of replacing it, and the pass's
        last layer ends the lookahead.  With ``protect_lookahead`` (default True) the expected
        experts are also evicted last, under any policy (:meth:`ExpertCache.protect`), each
        layer's until the pass has run that layer (MoE-SpeQ's lookahead-aware eviction).  The
        precision and recall of the prediction against what the pass used are counted in
        :meth:`stats` (``lookahead_precision``, ``lookahead_recall``); with ``tokens[pos]``,
        the draft's top-k per token [n, k] of the pass's first n tokens, so is its routing
        fidelity (``routing_fidelity``: hard / soft / mismatch shares, MoE-SpeQ Fig. 6;
        :mod:`specmoe.runtime.lookahead`); with ``confidence[pos]`` [n, k], those rows' scores
        (the draft router's weights: the ELB's confidence, MoE-SpeQ Sec. 3.3.1), a layer's
        experts are queued surest first (after the utility, under a utility-space policy)."""
        arrays = self._la.set(counts, tokens, confidence)  # validated before any change
        utility = self._cache.utility if (self._counts_fed and self._cache is not None and
                                          self._cache.policy in UTILITY_POLICIES) else None
        lay, exp, pri = lookahead_queue(arrays, len(self.layer_ids), utility,
                                        self._la.confidence())
        if self.protect_lookahead and self._cache is not None:
            self._protect()
        if self.prefetch and self._cache is not None and len(lay):
            self._cache.prefetch((lay, exp, pri), replace=True)

    def _protect(self) -> None:
        """Protect the lookahead's experts of the layers still to run (none: clear)."""
        lay, exp = self._la.pending()
        if len(lay):
            self._cache.protect(lay, exp)
        else:
            self._cache.protect()

    # -- public -------------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Counters since the last reset: tokens, forward passes, prefetch precision/recall of
        the next-layer router predictor, and the cache's hits/misses/stall time."""
        pf = self._layers.counters() if self._layers is not None else \
            {"tokens": 0, "passes": 0, "predicted": 0, "true_positive": 0, "actual": 0}
        s: dict[str, Any] = {
            "tokens": pf["tokens"], "passes": pf["passes"], "policy": self.policy,
            "cache_frac": self.cache_frac, "dtype": self.dtype, "prefetch": self.prefetch,
            "dense": self.dense.dtype, "dense_layers": len(self.dense.converted),
            "prefetch_precision": pf["true_positive"] / pf["predicted"] if pf["predicted"] else None,
            "prefetch_recall": pf["true_positive"] / pf["actual"] if pf["actual"] else None,
            **self._la.stats(),
            "draft_prefetch_queued": self._draft_queued,
            "miss": self.miss, "route_lambda": self.route_lambda,
            "miss_levels": ":".join(self.miss_levels), "miss_keep2": self.miss_keep2,
            **{k: pf.get(k, 0) for k in ("rerouted", "missing", "dropped", "substituted",
                                          "lowbit", "lowbit2", "overlapped", "draft_kept")},
            "parallel_misses": self.parallel_misses, "admission": self.admission,
            "byte_budget": self.byte_budget,
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
        self._la.reset_stats()
        self._draft_queued = 0
        if self._layers is not None:
            self._layers.counters(reset=True)
        if self._cache is not None:
            self._cache.reset_stats()

    def set_policy(self, policy: Any) -> None:
        """Switch the cache's eviction policy (a name or a policy object); contents kept."""
        if self._cache is None:
            raise RuntimeError("this specmoe Engine is closed")
        self._cache.set_policy(policy)
        self.policy = policy
        self._keep_settings()  # (the settings stay; only the count feeding changes)
        self._configure_layers()  # a utility-space policy is fed activation counts

    def set_cache(self, capacity: int | float | str, policy: Any = None) -> None:
        """Rebuild the cache over the same store with a new capacity (slots, a fraction of all
        experts, ``"25%"`` or a byte size such as ``"6GiB"``) and optionally a new policy.  The
        cache starts empty and its statistics restart."""
        with self._exclusive():  # layer calls in other threads finish first, then wait
            if self._store is None or self._closed:
                raise RuntimeError("this specmoe Engine is closed")
            old = self.policy
            if policy is not None:
                self.policy = policy
            try:
                self._open_cache(capacity)
            except BaseException:
                self.policy = old
                raise
            self.tau.clear()  # tau includes expert loads, which depend on the cache

    def set_parallel_misses(self, on: bool) -> None:
        """Overlap each MoE layer's cache misses with the compute of its resident experts: the
        misses are queued to the prefetch worker at the highest priority, the resident experts
        pinned and computed first, the missing ones last (csrc/layer.h, step 5).  Needs the
        prefetch worker (a cache built with prefetch on).  On by default.  Each token's
        experts are then summed in ascending id from per-pair outputs whatever order they were
        computed in, so results never depend on the worker's timing (they differ from the
        plain path's accumulate-as-you-go sum at the f32 rounding level);
        ``stats()["overlapped"]`` counts the experts queued this way."""
        if not isinstance(on, bool):
            raise TypeError(f"set_parallel_misses(on): a bool, got {type(on).__name__}")
        self.parallel_misses = on
        if self._layers is not None:
            self._layers.set_parallel(on)

    def set_prefetch(self, on: bool, overfetch: float | None = None,
                     predictor: Callable[[int, torch.Tensor], Any] | None | str = "keep",
                     mass: float | None | str = "keep", admission: bool | None = None,
                     byte_budget: bool | None = None) -> None:
        """Switch lookahead prefetch on/off.  overfetch: experts predicted per token
        = ceil(top_k * overfetch).  mass: instead of a fixed count, per token the fewest
        experts (at least top_k) whose softmax probability of the scores sums to >= mass
        (None: back to overfetch; the router predictor only).  predictor: ``"router"`` (the
        default: layer l+1's router applied to layer l's router input; None says the same),
        ``"learned"`` (the packaged nextuse model's probability that each expert of layer l+1
        is used at its next run, learnt from the routing seen so far: ``csrc/layer.h``
        ``smoe_layers_set_predictor``, the simulator's ``prefetch="learned"``), ``"oracle"``
        (during :meth:`replay_routing` only: the trace's true experts of layer l+1), or a
        Python callable ``f(next_layer_position, hidden[T,H]) -> scores[T,E]`` (higher = more
        likely needed; routing then runs in Python).  admission (None: keep; off by default):
        prefetch admission by expected benefit (:meth:`specmoe.ExpertCache.set_admission`,
        ``csrc/admit.h``): a predicted expert is loaded only when its probability of use (the
        router's probability, the learned q, 1 for the oracle) times the stall it would save
        exceeds the cost of reading it and of its victim, and while the loads prefetching added
        stay within 8 % of those that were needed; refused requests are counted in
        ``stats()["prefetch_refused"]``.  byte_budget (None: keep; on by default): False runs
        the rule's time terms alone."""
        _check_flag("on", on)
        for name, v in (("admission", admission), ("byte_budget", byte_budget)):
            if v is not None:
                _check_flag(name, v)
        check_prefetch(overfetch, mass)
        if isinstance(predictor, str) and predictor not in PREDICTORS + ("keep",):
            raise ValueError(f"predictor must be one of {PREDICTORS}, a callable, None or "
                             f"'keep', got {predictor!r}")
        if predictor is not None and not isinstance(predictor, str) and not callable(predictor):
            raise TypeError(f"predictor must be callable as f(next_layer_position, hidden), got "
                            f"{type(predictor).__name__}")
        if predictor is None or (isinstance(predictor, str) and predictor != "keep"):
            self._push_predictor(predictor or "router")  # checks the oracle's replay first
            self._predictor = None
        elif not isinstance(predictor, str):
            self._push_predictor("router")
            self._predictor = predictor
        self._set_prediction(bool(on), overfetch, mass)  # the C layers forget old predictions
        if admission is not None or byte_budget is not None:
            if admission is not None:
                self.admission = bool(admission)
            if byte_budget is not None:
                self.byte_budget = bool(byte_budget)
            if self._cache is not None:
                self._cache.set_admission(self.admission, self.byte_budget)

    def replay_routing(self, trace: Any, *, start: int = 0) -> None:
        """Route every token by a recorded routing trace instead of the router (issue 41; for
        benchmarks and research: with random or stand-in weights the cache, the prefetch
        worker, the store's reads and the kernels see a real model's access pattern).

        trace: a :class:`specmoe.Trace` (or its ``experts`` array, int [tokens, MoE layers,
        top_k]) of this model's shape; None turns the replay off.  Each forward pass of T
        tokens takes the trace's next T tokens (from ``start``), each MoE layer routes token t
        to the trace's experts of that (token, layer) with the weights of the model's router
        probabilities restricted to them (renormalised as the model does).  A pass past the
        trace's end raises :class:`specmoe.CacheError` before it runs.  Needs every MoE layer
        routed in C (``engine.routed_in_c``); a call that would route in Python (a Python
        predictor, trace recording, drafting, a prefill whose shared experts run in torch)
        raises RuntimeError.  The simulator replaying the same trace demand-only at the same
        slot count counts the same hits, misses and collision misses (``tests/test_replay.py``;
        the live engine visits a layer's experts in ascending id, so give the simulator the
        trace with each row sorted, :meth:`specmoe.Trace.sorted_rows`)."""
        if trace is None:
            if self.predictor == "oracle":
                raise ValueError("replay_routing(None): the oracle predictor is set and predicts "
                                 "from the replay; choose another first (set_prefetch)")
            if self._layers is not None:
                self._layers.set_replay(None)  # refuses while the oracle predicts from it
            self._replay, self._replay_start, self._replay_tokens = None, 0, None
            if self._layers is not None:
                self._push_priors(self._layers)
            return
        ex = trace.experts if hasattr(trace, "experts") else trace
        ex = np.asarray(ex)
        L, k = len(self.layer_ids), self.top_k
        if ex.ndim != 3 or ex.shape[1:] != (L, k):
            raise ValueError(f"replay_routing: the trace routes [tokens, layers, top_k] = "
                             f"{list(ex.shape)}, this model [tokens, {L}, {k}]")
        ne = getattr(trace, "num_experts", None)
        if ne is not None and ne != self.num_experts:
            raise ValueError(f"replay_routing: the trace has {ne} experts per layer, this model "
                             f"{self.num_experts}")
        missing = sorted(set(range(L)) - set(self.routed_in_c))
        if missing:
            raise ValueError(f"replay_routing needs every MoE layer routed in C; layer "
                             f"positions {missing[:8]} route in torch (a router C does not "
                             f"take, such as a softmax one with a correction bias, or "
                             f"dense='torch')")
        if not np.issubdtype(ex.dtype, np.integer):
            raise ValueError(f"replay_routing: expert ids must be integers, got {ex.dtype}")
        if ex.size and (ex.min() < 0 or ex.max() >= self.num_experts):
            raise ValueError(f"replay_routing: expert ids must be in 0..{self.num_experts - 1}, "
                             f"got {int(ex.min())}..{int(ex.max())}")
        ex = np.ascontiguousarray(ex, dtype=np.int16)
        if self._layers is not None:
            self._layers.set_replay(ex, start=int(start))  # validates rows and start
        elif not 0 <= int(start) <= len(ex):
            raise ValueError(f"replay_routing: start {start} outside 0..{len(ex)}")
        self._replay, self._replay_start = ex, int(start)
        toks = getattr(trace, "tokens", None)
        self._replay_tokens = list(toks) if toks is not None and len(toks) == len(ex) else None
        if self._layers is not None:
            self._push_priors(self._layers)

    @property
    def replay_position(self) -> tuple[int, int]:
        """(trace tokens replayed so far, tokens in the trace); (0, 0) without a replay."""
        if self._replay is None:
            return (0, 0)
        if self._layers is None:
            return (self._replay_start, len(self._replay))
        used, n = self._layers.replay_position()
        return (int(used), int(n))

    def close(self) -> None:
        """Release the cache and the store (deleting the temporary store file if offload made
        one).  The model keeps its SpecmoeExperts modules, which raise RuntimeError when called
        afterwards: the expert weights are gone from the model and are not restored.  Layer
        calls running in other threads finish first; their next call raises RuntimeError."""
        with self._exclusive():
            if self._closed:
                return
            self._closed = True
            self._drop_prior_hook()
            self._release()

    def _release(self) -> None:
        self._keep_settings()
        self._layers = None
        self._draft = None
        self._copies = {}
        self._close_storage()

    def __enter__(self) -> "Engine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _trim_heap() -> None:
    """Hand freed heap memory back to the OS (glibc's malloc_trim; a no-op elsewhere): freed
    tensors of a few MB stay in malloc's arenas otherwise, and the process's resident memory
    would not show the experts that offload freed."""
    import ctypes
    import ctypes.util
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.malloc_trim(0)
    except (OSError, AttributeError):
        pass


def available_policies() -> list[str]:
    """Eviction policy names :func:`offload` accepts."""
    names = getattr(_C, "POLICY_NAMES", "lru")
    # Belady needs the future access sequence: a simulator policy, not a live one
    return [n.strip() for n in names.split(",") if n.strip() and n.strip() != "belady"]


def offload(model: nn.Module, store: str | os.PathLike | None = None,
            cache: int | float | str = 0.25, policy: Any = "lru", prefetch: bool | str = True,
            dtype: str = "f32", overfetch: float = 1.5, direct: bool | None = False,
            progress: bool = False, dense: str | bool | None = "auto", miss: str = "fetch",
            miss_keep: int = 2, route_lambda: float = 0.0,
            throttle: tuple[float, float] | None = None,
            miss_levels: str | Sequence[str] = "int4", miss_keep2: int | None = None,
            device: Any = "cpu", balance: Any = False) -> Engine | GpuEngine:
    """Move ``model``'s routed experts to a store and run them through specmoe.

    For a model already in memory (loaded by transformers); to load a checkpoint larger than
    memory use :func:`specmoe.from_pretrained`, which never materialises the experts.

    store: path of the store file to write (None: a temporary file, deleted by close());
    direct: read it with O_DIRECT (None: decide by size, see :class:`Engine`).  cache: slots,
    a fraction of all experts (``0.25``, ``"25%"``) or a byte size (``"512MiB"``).
    policy: eviction policy name (:func:`available_policies`) or policy object.  prefetch:
    next-layer lookahead (the next layer's router on this layer's input, top
    ceil(k * overfetch) experts per token) queued to the cache's prefetch worker.  dtype: how
    experts are stored ("f32", "bf16", "int8" per-row, "int4" per-group, "int2" per-group with
    scale and offset; see specmoe.storage.quant).
    progress: a progress bar while converting.  dense: the other linear layers through the C
    kernels (``"auto"``, ``"torch"``, ``"f32"``, ``"bf16"``, ``"int8"``, ``"int4"``; see
    :class:`Engine`).  miss, miss_keep, route_lambda, throttle, miss_levels, miss_keep2:
    SpecMD's miss handling, cache-aware routing, link emulation and low-bit fallback levels
    (:mod:`specmoe.runtime.misses`).  device: ``"cpu"`` (an :class:`Engine`: experts cached in RAM,
    run by the C kernels) or ``"cuda"``/``"cuda:N"`` (a :class:`specmoe.runtime.gpu_engine.GpuEngine`:
    experts cached in GPU memory, the store's pinned copy in host memory behind it, the
    model's other weights moved to that GPU; ``dense`` "auto"/"torch", ``miss="fetch"``
    only; ``balance=True`` turns on MoE-SpAc's CPU/GPU workload balancer, see
    :mod:`specmoe.runtime.gpu_engine`), or ``"emulate"`` (that GPU tier's code on the CPU: its
    cache in host memory, the CPU kernels for the CUDA ones; for tests).  The model is modified in place: each MoE
    layer's ``experts`` becomes a :class:`SpecmoeExperts` and the expert parameters are
    deleted, layer by layer while the store is written; if writing fails part way, the layers
    already converted stay offloaded to nothing usable (the error is raised): reload the model.
    Returns the engine.
    """
    from .gpu_engine import resolve_device
    info, ids = describe(model)
    check_early(dtype, cache, policy, prefetch)
    gpu = resolve_device(device, dtype=dtype, policy=policy, dense=dense, miss=miss,
                         route_lambda=route_lambda, throttle=throttle, balance=balance,
                         miss_levels=miss_levels)
    if overfetch < 1:
        raise ValueError(f"overfetch must be >= 1, got {overfetch}")
    first = expert_module(model, info, ids[0])
    if isinstance(first, SpecmoeExperts):
        raise ValueError("this model's experts are already offloaded")
    E = int(first.gate_up_proj.shape[0])
    H = int(first.gate_up_proj.shape[1] if info.gptoss else first.gate_up_proj.shape[2])
    resolve_dense(dense, torch.float32)
    cfg = model.config
    k = int(cfg.num_experts_per_tok)
    levels, _ = misses.check_levels(miss_levels, miss_keep2,
                                    misses.check_miss(miss, miss_keep, route_lambda, k)[1], k)
    # the grouped formats need expert shapes they can group: fail before the model is touched
    # (the gate/up projection is [E, 2I, H], or [E, H, 2I] for gpt-oss)
    I = int(first.gate_up_proj.shape[2] if info.gptoss else first.gate_up_proj.shape[1]) // 2
    for fmt in {dtype} | (set(levels) if miss in ("lowest_bit", "priority") else set()):
        if fmt in ("int4", "int2"):
            from ..storage.quant import pick_group
            pick_group(H, I, fmt)
    misses.check_throttle(throttle)
    if store is None:
        fd, path = tempfile.mkstemp(prefix="specmoe-", suffix=".smoe")
        os.close(fd)
    else:
        path = os.fspath(store)

    def expert_f32(pos: int, e: int) -> dict[str, np.ndarray]:
        return extract_expert(expert_module(model, info, ids[pos]), e, info.gptoss)

    def free(pos: int) -> None:
        # this layer's expert parameters go as soon as they are converted (peak memory stays
        # about one layer above the model's own size); the Engine attaches the placeholder
        moe_block(model, info, ids[pos]).experts = SpecmoeExperts(None, pos, E, H)

    try:
        write_experts(path, expert_f32, num_layers=len(ids), num_experts=E, dtype=dtype,
                      model=info.model_type, top_k=int(cfg.num_experts_per_tok),
                      extra=store_settings(cfg, info, ids, dtype), progress=progress,
                      after_layer=free)
        if gpu is not None:
            from .gpu_engine import GpuEngine
            return GpuEngine(model, path, device=gpu, cache=cache, policy=policy,
                             prefetch=prefetch, overfetch=overfetch, verify=True,
                             own_store=store is None, balance=balance, miss=miss,
                             miss_keep=miss_keep, route_lambda=route_lambda,
                             miss_levels=miss_levels, miss_keep2=miss_keep2,
                             throttle=throttle)
        eng = Engine(model, path, cache=cache, policy=policy, prefetch=prefetch,
                     overfetch=overfetch, direct=direct, verify=True, own_store=store is None,
                     dense=dense, miss=miss, miss_keep=miss_keep, route_lambda=route_lambda,
                     throttle=throttle, miss_levels=miss_levels, miss_keep2=miss_keep2)
        _trim_heap()  # the freed expert parameters leave the resident set now, not later
        return eng
    except BaseException:
        if store is None and os.path.exists(path):
            os.unlink(path)
        raise



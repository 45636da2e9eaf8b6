"""A model's routed experts served from GPU memory (issue 12 item 4): :class:`GpuEngine`.

The GPU counterpart of :class:`specmoe.runtime.engine.Engine`, made by ``specmoe.offload(model,
device="cuda")`` and ``specmoe.from_pretrained(path, device="cuda")``.  The non-expert weights
(attention, norms, routers, shared experts, lm_head) live on the GPU and run in torch; every
MoE layer's ``experts`` module becomes a :class:`specmoe.runtime.engine.SpecmoeExperts` whose
call is one C call, :func:`specmoe.runtime.cuda.layer_call` (csrc/layer.c over cuda/gtier.h):
the layer's tokens grouped by expert, each expert acquired from a
:class:`specmoe.runtime.cuda.GpuExpertCache` (slots in one GPU allocation, filled from a pinned
host copy of the store by ``cudaMemcpyAsync`` on the cache's copy stream) on torch's current
stream, run by the GPU FFN kernels (grouped launches), released.

Prefetch: at MoE layer ``l`` the next layer's router is applied to this layer's input on the
device, and the CPU tier's own rule (``_C.predict_next`` over csrc/route.h, the routine the C
layers call: MoE-SpAc's "next-layer gating", csrc/layer.h step 1) picks the experts -- the top
``ceil(k * overfetch)`` per token, or the ``mass`` rule -- queued to the cache's prefetch worker
with each expert's best score as its priority.  Its precision and recall against the experts the
next layer really used are counted in :meth:`GpuEngine.stats`.

The hybrid tier, MoE-SpAc's heterogeneous workload balancer (``balance=True``, §3.3; issue
37): per layer, in the same C call, the experts that are neither resident nor loading are
split between a copy to the GPU and the CPU kernels over the host copy (pinned, or the store
file mapped into memory when it does not fit), the split
minimising ``|T_cpu - T_gpu|`` (Eq. 7-9, csrc/route.h ``smoe_route_balance_cut``) with
per-expert costs measured at load; the CPU's share runs while the GPU computes its own and is
added on the GPU, and the experts it computed are offered to the cache's policy for admission
(:meth:`GpuEngine.set_balance`).  A utility-space policy (``"spac"``, ``"spac_ema"``,
``"score"``) receives every layer's activation counts.

MoE-SpeQ on this tier: :meth:`enable_self_draft` keeps a low-bit copy of every expert in GPU
memory (built as the CPU Engine's :class:`~specmoe.runtime.expert_copy.ExpertCopy`, copied to
the device once); inside :meth:`drafting` the MoE layers compute from it and record their
routing; :meth:`lookahead` queues and shields the experts the draft expects (the CPU's rule,
:mod:`specmoe.runtime.lookahead`).  So :class:`specmoe.speculation.drafters.SelfDraft` and
``specmoe.generate(..., lookahead=True)`` run here as on the CPU, and so does the MTP
drafter (:meth:`draft_tokens`: the mask tokens' missing experts never load).

What the CPU Engine has and this one has not (yet): dense layers in C (the model's own GPU
layers run); asking for them raises.  Shared with the CPU Engine:
Python policies (the same bridge), the prediction rule (csrc/route.c), trace recording
(:meth:`trace`, the same recorder), the self-draft's copy and the lookahead's queue rule.

One compute stream: all layer calls of one engine must come from one thread (the cache's slot
events assume one stream); a lock serialises them and :meth:`close`.
"""
from __future__ import annotations

import dataclasses
import os
import threading
from typing import Any

import numpy as np
import torch
from torch import nn

from .. import _C
from ..models.arch import describe, getpath, moe_block
from . import engine_base
from .engine_base import PREDICTORS, EngineCommon, check_prefetch, check_prefetch_arg
from .tau_tables import TauTables

from .experts import SpecmoeExperts
from .lookahead import LookaheadBuffer, draft_step_priorities, lookahead_queue

__all__ = ["GpuEngine", "cuda_device", "check_gpu_options", "resolve_device"]


EMULATE = "emulate"  # the GPU tier's code on the CPU (host emulation; see cuda_device)


def cuda_device(device: Any) -> torch.device | None:
    """``device`` as a CUDA ``torch.device`` with an index, or None for the CPU tier;
    ValueError for anything else.  ``"emulate"`` gives ``torch.device("cpu")``: the GPU tier's
    own code (its engine, cache bookkeeping, prediction, policies, recording) run on the CPU,
    the GPU cache's slots in host memory and the CPU kernels in place of the CUDA ones -- how
    every machine tests the GPU path (no CUDA device needed, only the built extension)."""
    if device == EMULATE:
        return torch.device("cpu")
    try:
        d = torch.device(device)
    except (TypeError, RuntimeError) as e:
        raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:N' or 'emulate', got "
                         f"{device!r}") from e
    if d.type == "cpu":
        return None
    if d.type != "cuda":
        raise ValueError(f"device must be 'cpu', 'cuda', 'cuda:N' or 'emulate', got {device!r}")
    return torch.device("cuda", 0 if d.index is None else d.index)


def check_gpu_options(*, dtype: str = "f32", policy: Any = "lru", dense: Any = "auto",
                      miss: str = "fetch", route_lambda: float = 0.0,
                      throttle: Any = None, balance: Any = False,
                      miss_levels: Any = "int4") -> None:
    """Refuse, before anything is touched, the options of :func:`specmoe.offload` /
    :func:`specmoe.from_pretrained` that the GPU tier does not serve."""
    from .cuda import BalanceProfile
    if not (isinstance(balance, (bool, BalanceProfile)) or balance is None):
        raise TypeError(f"balance must be a bool or a specmoe.runtime.cuda.BalanceProfile, got "
                        f"{type(balance).__name__}")
    if not isinstance(policy, str) and not callable(getattr(policy, "victim", None)):
        raise TypeError("the GPU tier takes a built-in policy name (str) or a Python policy "
                        "(an object with a victim(candidates) method, e.g. "
                        f"specmoe.PythonPolicy), got {type(policy).__name__}")
    if dtype == "int2":
        raise ValueError("the GPU kernels take f32, bf16, int8 and int4 experts, not int2")
    if dense not in ("auto", "torch", None, False):
        raise ValueError(f"dense={dense!r}: specmoe's dense kernels run on the CPU; with a "
                         "CUDA device the model's own layers run on the GPU (dense='torch')")
    from .misses import check_throttle
    check_throttle(throttle)  # (GB/s, latency_us) or None; the GPU cache emulates it too
    levels = miss_levels.split(":") if isinstance(miss_levels, str) else miss_levels
    if miss in ("lowest_bit", "priority") and "int2" in tuple(levels or ()):
        raise ValueError(f"miss_levels={miss_levels!r}: the GPU kernels take int8 and int4 "
                         "low-bit copies, not int2 (SpecMD's int2 level runs on the CPU)")


def resolve_device(device: Any, **options: Any) -> torch.device | str | None:
    """The CUDA device :func:`specmoe.offload` / :func:`specmoe.from_pretrained` were asked for
    (None: the CPU tier; ``"emulate"``: the GPU tier's host emulation), after refusing what the GPU tier does not serve (``options``:
    :func:`check_gpu_options`' keywords) and checking that a GPU is usable
    (:class:`specmoe.runtime.cuda.CudaUnavailable` with the reason otherwise), all before anything is
    touched."""
    gpu = cuda_device(device)
    if gpu is None:
        if options.get("balance") not in (False, None):
            raise ValueError("balance: the CPU/GPU balancer needs device='cuda'")
        return None
    check_gpu_options(**options)
    from . import cuda
    if gpu.type == "cpu":  # emulation: the extension without a device
        if options.get("balance") is True:
            raise ValueError("balance=True measures the GPU's costs: with device='emulate' "
                             "give a specmoe.runtime.cuda.BalanceProfile")
        cuda.extension()
        return EMULATE
    cuda.load()
    return gpu


class GpuEngine(EngineCommon):
    """The running GPU offload of one model: the store, the GPU cache over it and the per-layer
    path.  Made by :func:`specmoe.offload` / :func:`specmoe.from_pretrained` with
    ``device="cuda"``; :func:`specmoe.engine_of` finds it."""

    def __init__(self, model: nn.Module, store: str | os.PathLike[str], *,
                 device: Any = "cuda", cache: int | float | str = 0.25, policy: str = "lru",
                 prefetch: bool | str = True, overfetch: float = 1.5, mode: str = "auto",
                 verify: bool = True, own_store: bool = False,
                 balance: bool | Any = False, miss: str = "fetch", miss_keep: int = 2,
                 route_lambda: float = 0.0, miss_levels: str | Any = "int4",
                 miss_keep2: int | None = None, throttle: tuple[float, float] | None = None
                 ) -> None:
        """Serve ``model``'s routed experts from the store file ``store`` through a GPU cache
        on ``device`` ("cuda" or "cuda:N"); the model's other weights are moved there.

        cache: slots, a fraction of all experts or a byte size (:func:`specmoe.parse_capacity`),
        allocated on the GPU at once.  policy: a built-in eviction policy name or a Python
        policy (:class:`specmoe.PythonPolicy`, the CPU cache's own bridge).  prefetch,
        overfetch: the next-layer prediction (module docstring).  mode: the slow tier,
        ``"host"`` (a pinned host-memory copy of the whole store, read now: loads are pure
        host-to-device copies), ``"staged"`` (the store file read per load into pinned
        staging buffers: for a store larger than memory) or ``"auto"`` (host when the store
        takes at most half the memory this process may use, else staged).  verify: check
        every block read against its CRC32C.  own_store: delete the store file on
        :meth:`close`.  balance: the hybrid tier, MoE-SpAc's CPU/GPU workload balancer
        (:meth:`set_balance`): True measures its costs now
        (:func:`specmoe.runtime.cuda.measure_balance_profile`), a
        :class:`specmoe.runtime.cuda.BalanceProfile` gives them, False copies every miss
        (:meth:`set_balance` switches it later; with ``mode="staged"`` the CPU computes from
        the store file mapped into memory, the OS page cache the RAM tier between the disk
        and the GPU).  miss, miss_keep,
        route_lambda, miss_levels, miss_keep2: SpecMD's miss handling and cache-aware routing,
        as on the CPU (:mod:`specmoe.runtime.misses`; the same C code), with the low-bit copies
        resident in GPU memory (int8 or int4).  throttle: ``(GB_per_s, latency_us)``, the
        link emulation of SpecMD A.4 on the GPU cache's loads (None: off)."""
        from . import cuda
        from .kernels import FFNSpec
        from ..storage.store import ExpertStore

        dev = cuda_device(device)
        if dev is None:
            raise ValueError("GpuEngine needs a CUDA device (or 'emulate'); the CPU path is "
                             "specmoe.runtime.engine.Engine")
        from . import misses
        check_gpu_options(policy=policy, miss=miss, route_lambda=route_lambda,
                          miss_levels=miss_levels, balance=balance)
        k = int(model.config.num_experts_per_tok)
        miss, miss_keep, route_lambda = misses.check_miss(miss, miss_keep, route_lambda, k)
        self.miss_levels, miss_keep2 = misses.check_levels(miss_levels, miss_keep2, miss_keep, k)
        self._miss = {"miss": miss, "miss_keep": miss_keep, "route_lambda": route_lambda,
                      "miss_keep2": miss_keep2}  # the C layers' once they exist (EngineCommon)
        misses.check_throttle(throttle)
        self.throttle = throttle  # the link emulation of the GPU cache's loads (misses.apply)
        if overfetch < 1:
            raise ValueError(f"overfetch must be >= 1, got {overfetch}")
        self.emulated = dev.type == "cpu"
        if self.emulated:
            cuda.extension()  # CudaUnavailable when specmoe._cuda was not built
            if balance is True:
                raise ValueError("balance=True measures the GPU's costs: with device='emulate' "
                                 "give a specmoe.runtime.cuda.BalanceProfile")
        else:
            cuda.load()  # CudaUnavailable (with the reason) before anything is touched
        if mode == "auto":
            mode = "host" if os.path.getsize(store) <= engine_base.memory_limit() // 2 \
                else "staged"
        if mode not in ("host", "staged"):
            raise ValueError(f"mode must be 'host', 'staged' or 'auto', got {mode!r}")
        info, ids = describe(model)
        cfg = model.config
        self.model: nn.Module | None = model
        self.arch = info
        self.model_type = info.model_type
        self.layer_ids: list[int] = ids
        self.device = dev
        self.top_k = int(cfg.num_experts_per_tok)
        self.policy = policy
        pred = check_prefetch_arg(prefetch)
        if pred == "oracle":
            raise ValueError("prefetch='oracle' predicts from a routing replay, which runs on "
                             "the CPU tier (Engine.replay_routing)")
        self._prediction = {"prefetch": pred is not None, "overfetch": float(overfetch),
                            "mass": 0.0, "predictor": pred or "router"}
        # ^ the C layers' once they exist (EngineCommon)
        self.mode = mode
        self.balance: Any = None  # the BalanceProfile in use, None: every miss is copied
        self.recorder: Any = None  # trace(): the routing recorder in use
        # the resident low-bit copies (host side, by format; EngineCommon.lowbit_copy) and
        # their device copies (copy_buffer; the emulation uses the host ones)
        self._copies: dict[str, Any] = {}
        self._dev_copies: dict[str, torch.Tensor] = {}
        # MoE-SpeQ on this tier: the self-draft's resident low-bit copy (enable_self_draft,
        # one of _copies, lent to the C layers' set_draft), the draft forwards'
        # routing while drafting(), the lookahead buffer (lookahead) and its eviction shield
        self._draft: Any = None
        self._drafting: list[tuple[int, np.ndarray, np.ndarray]] | None = None
        self._draft_prefetch = False
        self._draft_queued = 0
        self.protect_lookahead = True
        self._la = LookaheadBuffer(len(ids), 0)  # num_experts known once the store is open
        # draft tokens of the forward in progress (draft_tokens()): their misses never load
        self._draft_flags: np.ndarray | None = None
        self._routers: list[nn.Module] = []  # set once the model is on the device
        self._router_bias: list[torch.Tensor | None] = []
        self._adopt_store(store, own_store)
        self._store: Any = None
        self._cache: Any = None
        self._tier: Any = None  # _cuda.Tier: the GPU cache as the C layers' expert tier
        self._layers: Any = None  # _C.Layers over it: the per-layer path and its counters
        self._slots = 0
        self._closed = False
        # [_lock] one layer call at a time (one compute stream), close() waits for it
        self._lock = threading.Lock()
        self.tau = TauTables()  # tau(g) per batch size, measured by specmoe.generate
        self._admit = True  # the hybrid tier's CPU experts go to the worker (set_balance)
        self._la_gated = 0  # [_lock] lookahead experts the hybrid tier's gate left unqueued
        # [_lock] experts computed by the layer calls (the rest of the counters are the C
        # layers')
        self._counters = {"gpu_experts": 0}
        try:
            st = self._store = ExpertStore(self._store_path, verify=verify)
            ex = st.extra
            if st.num_layers != len(ids) or ex.get("layer_ids", ids) != ids:
                raise ValueError(f"{self._store_path}: the store holds {st.num_layers} MoE "
                                 f"layers {ex.get('layer_ids')}, the model has {ids}")
            self.num_experts = int(st.num_experts)
            self._la = LookaheadBuffer(len(ids), self.num_experts)
            if self.top_k > self.num_experts:
                raise ValueError(f"top_k {self.top_k} > num_experts {self.num_experts}")
            self.dtype = str(ex.get("dtype", "f32"))
            self._ffn_args = {"activation": ex.get("activation", "silu"),
                              "alpha": float(ex.get("alpha", 1.702)),
                              "limit": float(ex.get("limit", 7.0))}
            self.spec = FFNSpec.from_store_schema(st.tensors, int(st.block_bytes),
                                                  **self._ffn_args)
            self._cache = cuda.GpuExpertCache(st, cache, policy,
                                              device=-1 if self.emulated else dev.index,
                                              mode=mode, top_k=self.top_k, prefetch=True)
            self._slots = self._cache.capacity
            self.set_balance(balance)
        except BaseException:
            self.close()
            raise
        from .policies import COUNT_POLICIES
        self._feed_counts = policy in COUNT_POLICIES  # utility-space policies learn from counts
        for pos, i in enumerate(ids):
            block = moe_block(model, info, i)
            block.experts = SpecmoeExperts(self, pos, self.num_experts, self.spec.H)
            block.experts.train(block.training)
        model.to(dev)  # the non-expert weights (a no-op where they are there already)
        if not self.emulated:
            torch.cuda.empty_cache()  # the expert weights' GPU memory, if they were there
        # the predictor's routers, taken after the move (.to() replaces buffers, such as the
        # score-correction biases, by new tensors)
        blocks = [moe_block(model, info, i) for i in ids]
        self._routers = [getpath(b, info.router_attr) for b in blocks]
        self._router_bias = [getpath(b, info.bias_attr) if info.bias_attr else None
                             for b in blocks]
        try:  # the per-layer path: csrc/layer.c over the GPU cache as its expert tier
            from .kernels import context
            self._tier = self._cache.tier(self.spec)
            self._layers = _C.Layers(self._tier.capsule, context(), self.spec.desc(),
                                     self._router_copies(), self.top_k,
                                     sigmoid=bool(self.arch.sigmoid_router))
            self._configure_layers()
            misses.apply(self, self._miss)
        except BaseException:
            self.close()
            raise

    def _configure_layers(self) -> None:
        """Push the prediction settings into the C layers (new ones, or after
        _keep_settings) with the policy's count feeding."""
        if self._layers is not None:
            p = self._prediction
            self._layers.configure(p["prefetch"], p["overfetch"], p["mass"], self._feed_counts)
            self._push_predictor(p.get("predictor", "router"))
            self._push_balance()

    def _push_balance(self) -> None:
        """The balancer's profile (or none) into the C layers' hybrid split."""
        if self._layers is None:
            return
        b = self.balance
        if b is None:
            self._layers.set_hybrid(False)
        else:
            self._layers.set_hybrid(True, b.t_io, b.t_gpu, b.t_cpu, admit=self._admit)

    # -- the per-layer path -------------------------------------------------------------------
    def layer_forward(self, pos: int, hidden: torch.Tensor, idx: torch.Tensor,
                       w: torch.Tensor) -> torch.Tensor:
        """One MoE layer's routed experts on the GPU (SpecmoeExperts' call)."""
        with self._lock:
            if self._closed:
                raise RuntimeError("this specmoe GpuEngine is closed")
            if hidden.device != self.device:
                raise ValueError(f"MoE layer {pos} got hidden states on {hidden.device}, the "
                                 f"engine serves {self.device}")
            if self._drafting is not None:
                return self._draft_layer(pos, hidden, idx, w)
            flags = self._draft_flags
            if flags is not None and flags.shape[0] != hidden.shape[0]:
                raise ValueError(f"draft_tokens: {flags.shape[0]} flags, but MoE layer {pos} "
                                 f"got {hidden.shape[0]} tokens")
            return self._layer_call(pos, hidden, idx, w, flags)

    def _layer_call(self, pos: int, hidden: torch.Tensor, idx: torch.Tensor, w: torch.Tensor,
                    flags: np.ndarray | None) -> torch.Tensor:
        """One MoE layer in one C call (``_C.Layers.forward_on``, csrc/layer.h over the GPU
        tier, cuda/gtier.h; :func:`specmoe.runtime.cuda.layer_call`): the pass, the next
        layer's prediction and prefetch, the policy's counts, the draft tokens' rule, SpecMD's
        miss rules and cache-aware routing, then the experts grouped and run on the compute
        stream -- the CPU tier's code.  Called with ``_lock`` held."""
        from .cuda import layer_call
        used = np.zeros(self.num_experts, np.uint8)
        # a lookahead queued for this pass must survive the per-layer requests (as on the CPU)
        out = layer_call(self._layers, pos, hidden, idx.reshape(-1, self.top_k), w, used,
                         replace=not self._la.active, draft=flags)
        self._counters["gpu_experts"] += int(used.sum())
        self._after_layer(pos, used, hidden, idx, w)
        return out.to(hidden.dtype)

    def _after_layer(self, pos: int, used: np.ndarray, hidden: torch.Tensor,
                     idx: torch.Tensor, w: torch.Tensor) -> None:
        """What Python keeps after a layer (as the CPU Engine): the lookahead's accounting and
        shield, and trace recording."""
        if self._la.active:  # this layer of the lookahead's pass ran: count, unshield
            self._la.layer_done(pos, used, idx.detach().cpu().numpy() if self._la.rows
                                else None)
            if self.protect_lookahead:
                self._protect()
        if self.recorder is not None:  # trace(): the same recorder as the CPU's
            self.record_layer(pos, hidden, idx, w)

    def _draft_layer(self, pos: int, hidden: torch.Tensor, idx: torch.Tensor,
                     w: torch.Tensor) -> torch.Tensor:
        """A draft forward's MoE layer (inside :meth:`drafting`): the experts from the
        resident self-draft copy, no cache access; the routing recorded for the lookahead and,
        with ``drafting(prefetch=True)``, the newest token's experts queued to the cache (as
        the CPU Engine's ``_draft_layer``).  The experts run in one C call
        (``_C.Layers.forward_draft``: the device tier's grouping and kernels on the draft copy).
        Called with ``_lock`` held."""
        x = hidden.detach().to(torch.float32).contiguous()
        T = x.shape[0]
        ix = idx.detach().to(torch.int64).reshape(T, self.top_k).cpu().numpy()
        wh = w.detach().to(torch.float32).reshape(T, self.top_k).contiguous().cpu().numpy()
        out = torch.empty_like(x)
        stream = 0 if self.emulated else torch.cuda.current_stream(self.device).cuda_stream
        self._layers.forward_draft(pos, ix, wh, np.zeros(self.num_experts, np.uint8),
                                   x.data_ptr(), out.data_ptr(), stream)
        assert self._drafting is not None
        self._drafting.append((pos, ix.copy(), wh.copy()))
        if self._draft_prefetch and self.prefetch and self._cache is not None:
            e = ix[-1]
            pri = draft_step_priorities(pos, w[-1].detach().float().cpu().numpy(),
                                        len(self.layer_ids))
            self._cache.prefetch([pos * self.num_experts + int(k) for k in e], pri.tolist())
            self._draft_queued += len(e)
        return out.to(hidden.dtype)

    # -- what specmoe.generate asks of an engine (loads, generate: EngineCommon) ---------------
    def enable_self_draft(self, dtype: str = "int4") -> None:
        """Keep a ``dtype`` copy of every routed expert resident in GPU memory (host memory in
        the emulation), so the target itself can draft (MoE-SpeQ's quantized self-draft,
        :class:`specmoe.speculation.drafters.SelfDraft`): built as the CPU Engine builds it
        (:meth:`lowbit_copy`), then copied to the device once; SpecMD's miss handling shares it
        when it uses the same format.  Costs ``dtype``'s size of all experts in GPU memory
        besides the cache."""
        from . import misses
        if dtype not in ("int8", "int4", "bf16", "f32"):
            raise ValueError(f"the GPU tier's self-draft copy takes f32, bf16, int8 or int4, "
                             f"got {dtype!r}")
        with self._lock:
            if self._closed or self._store is None:
                raise RuntimeError("this specmoe GpuEngine is closed")
            if self._draft is not None and self._draft.dtype == dtype:
                return
            copy = self.lowbit_copy(dtype)
            self._layers.set_draft(self.copy_buffer(copy), copy.desc, copy.block_bytes,
                                   size=copy.buf.nbytes)
            self._draft = copy
        misses.apply(self)  # the draft tokens' copy when no miss mode uses one

    def _copy_address(self, copy: Any) -> int:
        """``copy``'s address in the tier's memory (copied to the device on first use)."""
        if self.emulated:
            return int(copy.buf.ctypes.data)
        dev = self._dev_copies.get(copy.dtype)
        if dev is None:
            dev = self._dev_copies[copy.dtype] = torch.from_numpy(copy.buf).to(self.device)
        return int(dev.data_ptr())

    def copy_buffer(self, copy: Any) -> Any:
        """What the C layers' ``set_lowbit`` takes: the host buffer in the emulation (the
        tier's memory is host memory), else the copy's device address."""
        return copy.buf if self.emulated else self._copy_address(copy)

    def prune_copies(self, in_use: set[str]) -> None:
        """Free the copies (and their device memory) neither the C layers nor the self-draft
        use."""
        super().prune_copies(in_use)
        self._dev_copies = {k: v for k, v in self._dev_copies.items() if k in self._copies}

    @property
    def layers(self) -> Any:
        """The ``_C.Layers`` the per-layer calls go through (over this engine's GPU tier), None
        once closed."""
        return self._layers

    @property
    def draft_copy(self) -> Any:
        """The self-draft's low-bit copy (its host-side :class:`ExpertCopy`), or None."""
        return self._draft

    @property
    def draft_dtype(self) -> str | None:
        """The self-draft copy's format, None before :meth:`enable_self_draft`."""
        return self._draft.dtype if self._draft is not None else None

    def lookahead(self, counts: dict[int, np.ndarray],
                  tokens: dict[int, np.ndarray] | None = None,
                  confidence: dict[int, np.ndarray] | None = None) -> None:
        """Draft-driven prefetch for the next forward pass, as :meth:`specmoe.Engine.lookahead`
        (MoE-SpeQ's expert lookahead buffer): every expected expert queued at once, earlier
        layers first (:func:`specmoe.runtime.lookahead.lookahead_queue`, the CPU's rule; the GPU
        cache does not answer utilities, so within a layer the order is by ``confidence``
        when given, else by expert), the next
        pass's per-layer prefetch added to it, and with ``protect_lookahead`` the expected
        experts evicted last until their layer has run; ``tokens``: the draft's top-k per
        token, for the routing fidelity, and ``confidence`` their scores, which order a
        layer's experts (as on the CPU)."""
        with self._lock:
            arrays = self._la.set(counts, tokens, confidence)  # validated before any change
            if self._cache is None:
                return
            lay, exp, pri = lookahead_queue(arrays, len(self.layer_ids),
                                            confidence=self._la.confidence())
            if self.balance is not None and len(lay):  # the hybrid tier: what pays only
                keep = self._lookahead_pays(arrays)
                sel = np.array([(int(p), int(e)) in keep for p, e in zip(lay, exp)], bool)
                self._la_gated += int((~sel).sum())
                lay, exp, pri = lay[sel], exp[sel], pri[sel]
            if self.protect_lookahead:
                self._protect()
            if self.prefetch and len(lay):
                self._cache.prefetch([int(p) * self.num_experts + int(e)
                                      for p, e in zip(lay, exp)], pri.tolist(), replace=True)

    def _lookahead_pays(self, arrays: dict[int, np.ndarray]) -> set[tuple[int, int]]:
        """The hybrid tier's gate on a lookahead (issue 37 item 3; MoE-SpAc §3.3, Eq. 10 with
        its drafting term): per layer, the expected experts already on the GPU (resident or
        loading) stay queued (the worker skips them; the shield keeps them), and of the
        others, most expected tokens first, those whose copy pays and fits the window
        ``T_total + gamma * T_draft / L`` (csrc/route.h ``smoe_route_balance_admit``), where
        T_total is estimated as the GPU's time for the layer's expected experts
        (``t_gpu`` each) and gamma * T_draft is the draft forwards' measured time since the
        last lookahead (:meth:`drafting`), shared evenly by the L layers.  The rest run on
        the CPU when the pass comes, as the split decides then."""
        b = self.balance
        draft_s, self._draft_s = getattr(self, "_draft_s", 0.0), 0.0
        share = draft_s / max(1, len(self.layer_ids))
        keep: set[tuple[int, int]] = set()
        for pos, c in arrays.items():
            ids = np.flatnonzero(c > 0)
            states = self._cache.layer_states(pos)
            keep.update((pos, int(e)) for e in ids if states[e] != 0)
            absent = sorted((int(e) for e in ids if states[e] == 0),
                            key=lambda e: (-c[e], e))
            cnt = np.ceil(c[absent]).astype(np.uint32) if absent else np.zeros(0, np.uint32)
            n = _C.balance_admit(cnt, b.t_io, b.t_gpu, b.t_cpu, b.t_gpu * len(ids) + share)
            keep.update((pos, e) for e in absent[:n])
        return keep

    def _protect(self) -> None:
        """Shield the lookahead's experts of the layers still to run (none: clear)."""
        lay, exp = self._la.pending()
        self._cache.protect([(int(p), int(e)) for p, e in zip(lay, exp)])

    # -- public -------------------------------------------------------------------------------
    @property
    def cache_frac(self) -> float:
        """The cache's slots as a fraction of all routed experts."""
        return self._slots / (self.num_experts * len(self.layer_ids))

    def stats(self) -> dict[str, Any]:
        """Counters since the last reset: tokens, forward passes, the next-layer predictor's
        precision and recall, and the GPU cache's hits/misses/prefetches/stall time."""
        c = dict(self._counters)
        if self._layers is not None:
            c.update(self._layers.counters())
        s: dict[str, Any] = {
            "device": str(self.device), "tokens": c["tokens"], "passes": c["passes"],
            "policy": self.policy, "cache_frac": self.cache_frac, "dtype": self.dtype,
            "prefetch": self.prefetch, "mode": self.mode,
            "prefetch_precision": c["true_positive"] / c["predicted"] if c["predicted"] else None,
            "prefetch_recall": c["true_positive"] / c["actual"] if c["actual"] else None,
            **self._la.stats(), "draft_prefetch_queued": self._draft_queued,
            "lookahead_gated": self._la_gated,
            "balance": None if self.balance is None else dataclasses.asdict(self.balance),
            "miss": self.miss, "route_lambda": self.route_lambda,
            "miss_levels": ":".join(self.miss_levels), "miss_keep2": self.miss_keep2,
            # experts computed per layer call on each device (the hybrid tier's CPU share)
            "gpu_experts": c["gpu_experts"] - c.get("hybrid_cpu_experts", 0),
            "cpu_experts": c.get("hybrid_cpu_experts", 0),
            **{k: c.get(k, 0) for k in ("rerouted", "missing", "dropped", "substituted",
                                         "lowbit", "lowbit2", "draft_kept", "hybrid_cpu_pairs",
                                         "hybrid_copied", "hybrid_admitted")},
        }
        if self._cache is not None:
            cs = self._cache.stats()
            n = cs.get("hits", 0) + cs.get("misses", 0)
            s.update(cs)
            s["hit_rate"] = cs.get("hits", 0) / n if n else None
            s["capacity"] = self._slots
            s["cache_bytes"] = self._slots * self._cache.slot_bytes
        return s

    def reset_stats(self) -> None:
        with self._lock:
            self._counters = dict.fromkeys(self._counters, 0)
            self._la.reset_stats()
            self._draft_queued = 0
            self._la_gated = 0
            if self._layers is not None:
                self._layers.counters(reset=True)
            if self._cache is not None:
                self._cache.reset_stats()

    def set_prefetch(self, on: bool, overfetch: float | None = None,
                     mass: float | None | str = "keep", predictor: str = "keep",
                     admission: bool | None = None, byte_budget: bool | None = None) -> None:
        """Turn the next-layer prefetch on or off, as :meth:`specmoe.Engine.set_prefetch`:
        overfetch: experts predicted per token = ceil(top_k * overfetch); mass: instead, per
        token the fewest experts (at least top_k) whose probability sums to >= mass (None: back
        to overfetch); predictor: ``"router"`` or ``"learned"`` (the C layers' predictors,
        csrc/layer.h ``smoe_layers_set_predictor``), ``"keep"``; admission, byte_budget (None:
        keep): the prefetch admission rule of the cache's slot table (``csrc/admit.h``) and its
        byte budget."""
        check_prefetch(overfetch, mass)
        for name, v in (("admission", admission), ("byte_budget", byte_budget)):
            if v is not None and not isinstance(v, bool):
                raise TypeError(f"{name} must be a bool or None, got {type(v).__name__}")
        if predictor not in ("router", "learned", "keep"):
            raise ValueError(f"predictor must be 'router', 'learned' or 'keep' on the GPU tier "
                             f"(of {PREDICTORS}, 'oracle' needs a CPU routing replay), got "
                             f"{predictor!r}")
        with self._lock:
            if predictor != "keep":
                self._push_predictor(predictor)
            self._set_prediction(bool(on), overfetch, mass)
            if admission is not None or byte_budget is not None:
                if self._cache is None:
                    raise RuntimeError("this specmoe GpuEngine is closed")
                adm = self.admission if admission is None else admission
                budget = self.byte_budget if byte_budget is None else byte_budget
                self._cache.set_admission(adm, budget)
                self.admission, self.byte_budget = adm, budget

    def set_balance(self, balance: bool | Any, admit: bool | None = None) -> None:
        """The hybrid tier, MoE-SpAc's CPU/GPU balancer (§3.3), on or off: per MoE layer the
        experts neither resident nor loading are split between a copy to the GPU cache and
        the CPU kernels on the pinned host copy (csrc/layer.h ``smoe_layers_set_hybrid``, the
        rule of csrc/route.h ``smoe_route_balance_cut``, Eq. 7-9).  balance: True measures its
        costs now (:func:`specmoe.runtime.cuda.measure_balance_profile`), a
        :class:`specmoe.runtime.cuda.BalanceProfile` gives them, False copies every miss.
        admit (None: keep): the experts the CPU computed are queued to the cache's prefetch
        worker, whose policy's admission rule lets them in or not (``"spac"``: MoE-SpAc's
        utility levels), so the GPU cache fills from what the CPU ran instead of every miss
        being copied on the layer's path."""
        from . import cuda
        if admit is not None:
            self._admit = bool(admit)
        if balance is False or balance is None:
            with self._lock:
                self.balance = None
                self._push_balance()
            return
        if balance is not True and not isinstance(balance, cuda.BalanceProfile):
            raise TypeError(f"balance must be a bool or a specmoe.runtime.cuda.BalanceProfile, got "
                            f"{type(balance).__name__}")
        with self._lock:
            if self._cache is None:
                raise RuntimeError("this specmoe GpuEngine is closed")
            if balance is True:
                if self.emulated:
                    raise ValueError("balance=True measures the GPU's costs: with "
                                     "device='emulate' give a specmoe.runtime.cuda.BalanceProfile")
                balance = cuda.measure_balance_profile(self._cache, self.spec)
            self.balance = balance
            self._push_balance()

    def set_miss(self, miss: str | None = None, miss_keep: int | None = None,
                 route_lambda: float | None = None, throttle: Any = "keep",
                 miss_levels: Any = None, miss_keep2: int | None | str = "auto") -> None:
        """SpecMD's miss handling and cache-aware routing, as :meth:`specmoe.Engine.set_miss`
        (the same C code runs them, and the same link emulation on the GPU cache's loads),
        with int8/int4 low-bit levels."""
        check_gpu_options(
            miss=self.miss if miss is None else miss,
            route_lambda=self.route_lambda if route_lambda is None else route_lambda,
            miss_levels=self.miss_levels if miss_levels is None else miss_levels)
        super().set_miss(miss, miss_keep, route_lambda, throttle, miss_levels, miss_keep2)

    def set_policy(self, policy: Any) -> None:
        """Switch the GPU cache's eviction policy (a built-in name or a Python policy);
        contents kept."""
        check_gpu_options(policy=policy)
        with self._lock:
            if self._cache is None:
                raise RuntimeError("this specmoe GpuEngine is closed")
            self._cache.set_policy(policy)
            self.policy = policy
            from .policies import COUNT_POLICIES
            self._feed_counts = policy in COUNT_POLICIES
            self._keep_settings()
            self._configure_layers()

    def close(self) -> None:
        """Free the GPU cache and its pinned host memory, close the store (deleted if it was
        a temporary one).  The model's MoE layers refuse calls afterwards."""
        with self._lock:
            self._closed = True
            self._drop_prior_hook()
            self._keep_settings()
            self._layers = self._tier = None  # before the cache they borrow closes
            self._draft = None  # the low-bit copies' memory
            self._copies, self._dev_copies = {}, {}
            self._close_storage()

    def __enter__(self) -> "GpuEngine":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

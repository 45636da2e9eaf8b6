"""Plan a memory budget (issue 41 item 0): how much of it the dense weights take, in which
format, and how much is left for the expert cache, so that the time per token is lowest.

``from_pretrained(path, memory="8GiB")`` (or ``"auto"``: the memory cgroup's limit, else the
memory available) and ``specmoe run --memory`` call :func:`plan_memory` and print the plan;
``cache=`` and ``dense=`` given explicitly win over it.

The rule.  The budget holds, besides the expert cache: a reserve for the interpreter, torch
and the working buffers (for a given budget, which holds the whole process: what the process
holds when it plans plus 512 MiB, at least 512 MiB as ``benchmarks/big_model.py`` budgets;
for ``"auto"``, whose headroom already leaves out what the process holds, 512 MiB), the KV
cache of ``max_tokens`` tokens (:meth:`ModelSizes.kv_bytes`: what transformers' cache
holds, with the spare room of specmoe's KV buffers), the weights the dense kernels never
convert (embeddings, norms, routers: at the model's dtype), with ``prefetch="learned"``
the next-use model's token-prior table (25 MB for DeepSeek-V2-Lite's shape,
:func:`specmoe.sim.nextuse.prior_table_bytes`), and the convertible dense weights
(attention, shared and dense MLPs, lm_head; an MLA model's ``kv_b_proj`` twice, the absorbed
decode copy beside the prefill matrix) in format ``d`` (they load at the model's dtype
and are converted before the cache takes its memory, so the budget must also hold them once
at that dtype).  For every
``d`` of ``dense_options`` (default: the exact format of the model's weights, and int8 per row;
for a GGUF file also ``"gguf"``, its dense layers on the file's own blocks, which never load at
the model's dtype)
the cache gets the rest, in whole experts, at most every expert and at least ``top_k``, and the
time per token is estimated as

    t(d) = W_d / r_d  +  L * k * (t_x + (1 - h(s / S)) * t_l)

``W_d`` the dense bytes in format ``d``, ``r_d`` the rate this machine's dense kernel reads
format ``d`` at one token (measured); L MoE layers of top-``k`` routing, ``t_x`` one expert's
compute at one token (measured on a block of the store's dtype), ``t_l`` one expert's load
from the store (ExpertStore O_DIRECT reads of that block size on the store's disk:
:func:`specmoe.sim.calibration.calibrate`), ``h`` the demand hit rate at a cache of s of the
S experts: the ``nextuse`` policy's on DeepSeek-V2-Lite's real routing (the shared traces,
:data:`HIT_CURVE`, interpolated linearly; a prior on other models, whose routing the planner
cannot know before it runs).  The plan is the ``d`` of least ``t``; a format within
:data:`EXACT_MARGIN` of the fastest that keeps the weights more exactly wins the tie.
Prefetch is left out of ``t`` (it hides loads behind compute on every plan alike), and so
are attention over the KV cache and the framework's own time per token: the estimate ranks
plans, it is not a speed figure (on the tiny zoo model it says 750 tok/s where 105 run).
"""
from __future__ import annotations

import ctypes
import math
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

__all__ = ["HIT_CURVE", "EXACT_MARGIN", "KV_SPARE", "RESERVE", "WORK_MARGIN", "MemoryPlan",
           "ModelSizes", "MachineRates", "kv_capacity", "plan_memory", "memory_budget",
           "memory_limit", "model_sizes", "kv_layout", "recording_layout", "measure_rates",
           "process_reserve", "trim_heap"]

MiB = 1 << 20
#: The budget's fixed part: interpreter, torch, the kernels' buffers.
RESERVE = 512 * MiB
#: A format within this fraction of the fastest plan's time that keeps the weights more
#: exactly is chosen instead (int8 rounds the weights; bf16 of a bf16 model does not).
EXACT_MARGIN = 0.03
#: Demand hit rate of the ``nextuse`` policy against the cache's share of all experts, on the
#: 200 DeepSeek-V2-Lite-Chat routing traces of ``../shared/traces`` (``specmoe.simulate``,
#: demand only; measured 2026-11-29).
HIT_CURVE: tuple[tuple[float, float], ...] = (
    (0.0, 0.0), (0.025, 0.098), (0.05, 0.166), (0.10, 0.274), (0.25, 0.500), (0.5, 0.747),
    (0.75, 0.910), (0.9, 0.975), (1.0, 1.0))
# rank by how exactly a format keeps the weights ("gguf": a GGUF file's own blocks, the
# weights the file holds, where bf16 or int8 of them round them once more)
_EXACTNESS = {"gguf": -1, "f32": 0, "bf16": 1, "int8": 2, "int4": 3}
_BYTES_PER_PARAM = {"f32": 4.0, "bf16": 2.0, "int8": 1.0 + 4.0 / 2048, "int4": 0.5 + 4.0 / 128}


@dataclass(frozen=True)
class ModelSizes:
    """What a plan needs to know about a model: parameters of the convertible dense weights
    (``dense_params``: attention, shared and dense MLPs, lm_head) and of the rest outside the
    routed experts (``other_params``: embeddings, norms, routers) with their dtype's bytes per
    parameter (``param_bytes``), the routed experts (``num_layers`` MoE layers x
    ``num_experts``, ``top_k`` per token, ``block_bytes`` per expert in the store), and one
    sequence's KV cache (:meth:`kv_bytes`): ``kv_bytes_per_token`` of the layers that keep
    every position, ``kv_windows`` (bytes a position, positions kept) of each sliding-window
    layer, ``kv_state_bytes`` of fixed state (linear-attention layers).  ``mla_params``: the
    parameters of the MLA attentions' ``kv_b_proj``, which the dense formats hold twice (the
    absorbed decode form's W^UK / W^UV beside the prefill path's matrix,
    specmoe.models.mla); ``gguf_mla_bytes`` their absorbed copy's bytes with ``dense="gguf"``
    (a file's own ``attn_k_b`` / ``attn_v_b`` blocks, else the model's dtype)."""

    dense_params: int
    other_params: int
    param_bytes: float
    num_layers: int
    num_experts: int
    top_k: int
    block_bytes: int
    kv_bytes_per_token: int
    model_dtype: str = "bf16"
    # a GGUF file's dense layers on its own blocks (dense="gguf"): their bytes (the blocks of
    # the layers the file holds in a kept kind, the others at the model's dtype) and the kind
    # holding most of them (whose kernel rate stands for all); None: not a GGUF file
    gguf_dense_bytes: int | None = None
    gguf_kind: str | None = None
    kv_windows: tuple[tuple[int, int], ...] = ()
    kv_state_bytes: int = 0
    mla_params: int = 0
    gguf_mla_bytes: int | None = None
    # a cache recording the last tokens of each forward for speculative decoding
    # (:func:`recording_layout`): bytes per recorded token, and the one more state a
    # verification keeps
    record_bytes_per_token: int = 0
    record_state_bytes: int = 0

    def record_bytes(self, tokens: int) -> int:
        """What a cache that records ``tokens`` tokens of each forward (a speculative
        verification of ``tokens - 1`` drafts on a hybrid model) holds at most beyond
        :meth:`kv_bytes`: 0 for ``tokens`` 0 or a model without recurrent layers."""
        n = int(tokens)
        return n * self.record_bytes_per_token + self.record_state_bytes if n > 0 else 0

    def kv_bytes(self, tokens: int) -> int:
        """One sequence's KV cache at ``tokens`` positions as the process holds it: the layers
        that keep every position in buffers with their spare room (:func:`kv_capacity`),
        each sliding-window layer at most its window, the fixed states."""
        n = int(tokens)
        return (self.kv_bytes_per_token * kv_capacity(n)
                + sum(b * min(n, w) for b, w in self.kv_windows) + self.kv_state_bytes)

    def dense_format_bytes(self, fmt: str) -> int:
        """The dense weights' bytes in format ``fmt`` (:func:`dense_bytes`; "gguf":
        ``gguf_dense_bytes``), with the absorbed MLA copy of ``kv_b_proj`` in that format."""
        if fmt == "gguf":
            if self.gguf_dense_bytes is None:
                raise ValueError("dense format 'gguf': the model's sizes carry no GGUF dense "
                                 "bytes (a GGUF file's plan only)")
            mla = self.gguf_mla_bytes
            if mla is None:
                mla = int(self.mla_params * self.param_bytes)
            return self.gguf_dense_bytes + mla
        return dense_bytes(self.dense_params + self.mla_params, fmt)


@dataclass(frozen=True)
class MachineRates:
    """This machine's rates (seconds, bytes/s): ``dense_rate[d]`` the dense kernel's read rate
    of format ``d`` at one token, ``expert_s`` one expert's compute at one token, ``load_s``
    one expert's load from the store."""

    dense_rate: dict
    expert_s: float
    load_s: float


@dataclass
class MemoryPlan:
    """A budget split (bytes) and the estimate behind it; ``candidates`` holds every format
    considered (``fits``, ``cache_slots``, ``hit_rate``, ``est_tpot_s``)."""

    budget_bytes: int
    reserve_bytes: int
    kv_bytes: int
    other_bytes: int
    dense: str
    dense_bytes: int
    cache_slots: int
    cache_bytes: int
    cache_fraction: float
    est_hit_rate: float
    est_tpot_s: float
    candidates: list = field(default_factory=list)
    source: str = ""
    predictor_bytes: int = 0
    # the recurrent states a speculative verification of record_tokens tokens records
    # (ModelSizes.record_bytes), inside kv_bytes; 0 when none are planned
    record_tokens: int = 0
    record_bytes: int = 0

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        g = lambda b: f"{b / 2**30:.2f} GiB"  # noqa: E731
        lines = [f"memory plan for a budget of {g(self.budget_bytes)} ({self.source}):",
                 f"  reserve {g(self.reserve_bytes)}, KV cache {g(self.kv_bytes)}"
                 + (f" (with {g(self.record_bytes)} of states recorded over "
                    f"{self.record_tokens} tokens for speculation)" if self.record_bytes
                    else "")
                 + f", embeddings/norms/routers {g(self.other_bytes)}"
                 + (f", learned predictor {g(self.predictor_bytes)}" if self.predictor_bytes
                    else ""),
                 f"  dense layers {self.dense} {g(self.dense_bytes)}, expert cache "
                 f"{self.cache_slots} experts ({self.cache_fraction:.1%}) {g(self.cache_bytes)}",
                 f"  estimated hit rate {self.est_hit_rate:.2f}, "
                 f"{1.0 / self.est_tpot_s:.2f} tok/s"]
        for c in self.candidates:
            if c["fits"]:
                lines.append(f"    dense {c['dense']}: cache {c['cache_slots']} experts, "
                             f"est. {1.0 / c['est_tpot_s']:.2f} tok/s")
            else:
                lines.append(f"    dense {c['dense']}: does not fit ({c['why']})")
        return "\n".join(lines)


def hit_rate(fraction: float) -> float:
    """:data:`HIT_CURVE` at a cache of ``fraction`` of all experts (linear in between)."""
    f = min(max(float(fraction), 0.0), 1.0)
    xs, ys = zip(*HIT_CURVE)
    return float(np.interp(f, xs, ys))


#: Positions of spare room a buffered KV layer takes at least when it grows
#: (specmoe.runtime.kvcache.BufferedLayer, which reads it here).
KV_SPARE = 256


def kv_capacity(positions: int) -> int:
    """The most positions a buffered KV layer holds room for while it holds ``positions``:
    it grows, when full, to what it must hold plus a quarter of that, at least
    :data:`KV_SPARE` more (specmoe.runtime.kvcache.BufferedLayer.room)."""
    n = int(positions)
    return n + max(KV_SPARE, n // 4)


def dense_bytes(params: int, fmt: str) -> int:
    """Bytes of ``params`` dense weights in format ``fmt`` (int8: a float scale per row of
    2048; int4: groups of 128 with a float scale)."""
    return int(math.ceil(params * _BYTES_PER_PARAM[fmt]))


def plan_memory(sizes: ModelSizes, budget: int, rates: MachineRates, *,
                dense_options: Sequence[str] | None = None, max_tokens: int = 2048,
                reserve: int = RESERVE, source: str = "given",
                predictor: int = 0, record_tokens: int = 0) -> MemoryPlan:
    """The plan of least estimated time per token (module docstring).  ``budget`` in bytes;
    ``dense_options``: the dense formats to consider (default the model's own exact format
    and ``"int8"``); ``predictor``: bytes the learned prefetch predictor will hold beside
    (its token-prior table, :func:`specmoe.sim.nextuse.prior_table_bytes`), set aside with
    the reserve.  ``record_tokens``: the tokens of each forward a speculative verification
    records (``k_max + 1``; 0: no speculation), whose recurrent states
    (:meth:`ModelSizes.record_bytes`) are set aside beside the KV cache.  Raises ValueError
    naming the smallest budget that would fit when no format leaves room for ``top_k``
    experts."""
    if record_tokens < 0:
        raise ValueError(f"record_tokens must be >= 0, got {record_tokens}")
    if predictor < 0:
        raise ValueError(f"predictor bytes must be >= 0, got {predictor}")
    if budget <= 0:
        raise ValueError(f"memory budget must be positive, got {budget}")
    opts = list(dense_options) if dense_options else [sizes.model_dtype, "int8"]
    for d in opts:
        if d == "gguf":
            sizes.dense_format_bytes(d)  # (raises without GGUF dense bytes)
        if d not in _BYTES_PER_PARAM and d != "gguf":
            raise ValueError(f"dense format {d!r}: choose from "
                             f"{sorted(_BYTES_PER_PARAM) + ['gguf']}")
        if d not in rates.dense_rate:
            raise ValueError(f"no measured rate for dense format {d!r}")
    S = sizes.num_layers * sizes.num_experts
    record = sizes.record_bytes(record_tokens)
    kv = sizes.kv_bytes(max_tokens) + record
    other = int(sizes.other_params * sizes.param_bytes)
    held = reserve + int(predictor) + other  # whatever the dense format and the cache
    cands = []
    for d in dict.fromkeys(opts):
        db = sizes.dense_format_bytes(d)
        # loading: the dense weights arrive at the model's dtype and are converted before the
        # cache takes its slots, so the budget must hold them once as they are (gguf: the
        # layers held as blocks are never dequantized, the rest arrive as they stay)
        load = held + (db if d == "gguf" else int(sizes.dense_params * sizes.param_bytes))
        room = budget - held - kv - db
        slots = min(S, room // sizes.block_bytes) if room > 0 else 0
        c: dict[str, Any] = {"dense": d, "dense_bytes": db, "cache_slots": int(slots),
                             "fits": slots >= sizes.top_k and load <= budget}
        if not c["fits"]:
            need = max(load, held + kv + db + sizes.top_k * sizes.block_bytes)
            c["why"] = f"needs at least {need / 2**30:.2f} GiB"
            c["min_budget"] = need
        else:
            h = 1.0 if slots >= S else hit_rate(slots / S)
            t = db / rates.dense_rate[d] + sizes.num_layers * sizes.top_k * (
                rates.expert_s + (1.0 - h) * rates.load_s)
            c.update(hit_rate=h, est_tpot_s=t)
        cands.append(c)
    ok = [c for c in cands if c["fits"]]
    if not ok:
        small = min(cands, key=lambda c: c["min_budget"])
        least = small["min_budget"]
        raise ValueError(f"memory budget {budget / 2**30:.2f} GiB is too small for this model: "
                         f"the smallest plan (dense {small['dense']}, "
                         f"{sizes.top_k} experts cached) needs {least / 2**30:.2f} GiB "
                         f"(reserve, KV cache of {max_tokens} tokens"
                         + (f" and {record_tokens} recorded" if record else "")
                         + ", embeddings and dense weights)")
    best = min(ok, key=lambda c: c["est_tpot_s"])
    close = [c for c in ok if c["est_tpot_s"] <= best["est_tpot_s"] * (1 + EXACT_MARGIN)]
    pick = min(close, key=lambda c: (_EXACTNESS[c["dense"]], c["est_tpot_s"]))
    return MemoryPlan(budget_bytes=int(budget), reserve_bytes=int(reserve), kv_bytes=int(kv),
                      other_bytes=other, dense=pick["dense"],
                      dense_bytes=pick["dense_bytes"], predictor_bytes=int(predictor),
                      cache_slots=pick["cache_slots"],
                      cache_bytes=pick["cache_slots"] * sizes.block_bytes,
                      cache_fraction=pick["cache_slots"] / S, est_hit_rate=pick["hit_rate"],
                      est_tpot_s=pick["est_tpot_s"], candidates=cands, source=source,
                      record_tokens=int(record_tokens) if record else 0, record_bytes=record)


# -- what a plan reads: the budget, the model, the machine ---------------------------------------

def trim_heap() -> bool:
    """Hand the C heap's free pages back to the kernel (glibc's ``malloc_trim(0)``); False
    where there is no such call (another C library).

    Loading a model frees gigabytes of short-lived tensors (a GGUF file's weights dequantized
    a few thousand rows at a time, the exact copies of dense layers converted to int8).  Past
    glibc's dynamic mmap threshold those live in the heap, and the heap keeps freed pages: a
    full-depth DeepSeek-V2-Lite loaded from GGUF with int8 dense layers held 1.95 GB of freed
    bf16 weights as resident memory (3.84 GB anonymous after loading where 1.89 GB is live),
    which a memory cgroup charges like live memory."""
    try:
        fn = ctypes.CDLL(None).malloc_trim
    except (OSError, AttributeError):
        return False
    fn.argtypes = [ctypes.c_size_t]
    fn.restype = ctypes.c_int
    fn(0)
    return True


# what a plan keeps above this process's anonymous memory at planning time (the interpreter,
# torch and transformers already loaded): the load's transients, the allocator's slack and
# the activations of a step.  Qwen3-30B-A3B's shapes at a 7.2 GiB budget: 256 MiB was
# OOM-killed in the cgroup mid-generation, 512 MiB ran (130 tokens, two prompts)
WORK_MARGIN = 512 * MiB


def anon_bytes() -> int | None:
    """This process's anonymous resident memory (Linux's ``RssAnon``), None where unknown."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def process_reserve(floor: int = RESERVE) -> int:
    """The reserve of a plan for a given budget, which holds the whole process: what this
    process already holds (after :func:`trim_heap`) plus :data:`WORK_MARGIN`, at least
    ``floor``.  A fixed 512 MiB was short for Qwen3-30B-A3B's shapes: the process held 720 MiB
    above its planned weights after loading, and the cgroup OOM-killed it mid-generation."""
    trim_heap()
    anon = anon_bytes()
    return floor if anon is None else max(floor, anon + WORK_MARGIN)


def memory_limit() -> int:
    """Bytes this process may still use: MemAvailable, or its memory cgroup's headroom
    (v1 or v2) when that is lower."""
    avail = 1 << 62
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        with open("/proc/self/cgroup") as f:
            lines = f.read().splitlines()
    except OSError:
        return avail
    for line in lines:
        _, ctrl, rel = line.split(":", 2)
        if ctrl == "memory":  # v1
            files = (f"/sys/fs/cgroup/memory{rel}/memory.limit_in_bytes",
                     f"/sys/fs/cgroup/memory{rel}/memory.usage_in_bytes")
        elif ctrl == "":  # v2
            files = (f"/sys/fs/cgroup{rel}/memory.max", f"/sys/fs/cgroup{rel}/memory.current")
        else:
            continue
        try:
            with open(files[0]) as f:
                lim = f.read().strip()
            with open(files[1]) as f:
                used = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if lim.isdigit():
            avail = min(avail, max(0, int(lim) - used))
    return avail


def memory_budget(memory: int | str) -> tuple[int, str]:
    """(bytes, where it came from) of a ``memory=`` argument: bytes, a size string
    (``"8GiB"``, ``"16GB"``), or ``"auto"``: what this process may still use, the memory the
    kernel reports available or the memory cgroup's headroom when lower
    (:func:`memory_limit`)."""
    if memory == "auto":
        avail = memory_limit()
        if avail >= 1 << 62:
            raise ValueError("memory='auto': no MemAvailable in /proc/meminfo and no memory "
                             "cgroup limit; give the budget as a size, e.g. memory='8GiB'")
        return avail, "the memory this process may still use"
    from .cache import check_capacity
    if isinstance(memory, bool):
        raise TypeError("memory must be a size such as '8GiB', a byte count, or 'auto'")
    if isinstance(memory, (int, np.integer)):
        if memory <= 0:
            raise ValueError(f"memory must be positive, got {memory}")
        return int(memory), "given"
    try:
        kind, value = check_capacity(memory)
    except (TypeError, ValueError):
        kind, value = None, None
    if kind != "bytes" or value < 1 or not re.search(r"[A-Za-z]", str(memory)):
        raise ValueError(f"memory={memory!r}: give a size such as '8GiB' or '16GB', a byte "
                         f"count, or 'auto'")
    return int(value), "given"


def model_sizes(model: Any, *, num_layers: int, num_experts: int, top_k: int,
                block_bytes: int) -> ModelSizes:
    """:class:`ModelSizes` of a transformers MoE model (on the meta device or not) whose routed
    experts are the parameters under an ``experts`` module: the ``nn.Linear`` weights elsewhere
    are the convertible dense weights, except routers (a ``gate``/``router`` linear with one
    output per expert); the rest (embeddings, norms, biases, routers) stays as it is.  The
    MLA attentions' ``kv_b_proj`` weights count once more as ``mla_params`` (their absorbed
    copy).  The KV cache as :func:`kv_layout` reads the config."""
    from torch import nn
    dense = other = mla = 0
    seen: set[int] = set()
    for name, mod in model.named_modules():
        parts = name.split(".")
        if "experts" in parts:  # the routed experts (fused, or one module per expert)
            seen.update(id(p) for p in mod.parameters(recurse=False))
            continue
        router = parts[-1] in ("gate", "router") and getattr(mod, "out_features", 0) == num_experts
        if isinstance(mod, nn.Linear) and not router:
            dense += mod.weight.numel()
            seen.add(id(mod.weight))
        if getattr(mod, "kv_lora_rank", None) and isinstance(getattr(mod, "kv_b_proj", None),
                                                             nn.Linear):
            mla += mod.kv_b_proj.weight.numel()  # (an MLA attention: absorbed at decode)
    for p in model.parameters():
        if id(p) not in seen:
            other += p.numel()
            seen.add(id(p))
    dt = next(model.parameters()).dtype
    pb = float(dt.itemsize) if hasattr(dt, "itemsize") else 2.0
    per_token, windows, state = kv_layout(model.config, int(pb))
    rec_token, rec_state = recording_layout(model.config, int(pb))
    name = {4.0: "f32", 2.0: "bf16"}.get(pb, "bf16")
    return ModelSizes(dense_params=int(dense), other_params=int(other), param_bytes=pb,
                      num_layers=num_layers, num_experts=num_experts, top_k=top_k,
                      block_bytes=int(block_bytes), kv_bytes_per_token=per_token,
                      kv_windows=windows, kv_state_bytes=state, mla_params=int(mla),
                      model_dtype=name, record_bytes_per_token=rec_token,
                      record_state_bytes=rec_state)


def kv_layout(cfg: Any, dtype_bytes: int) -> tuple[int, tuple[tuple[int, int], ...], int]:
    """One sequence's cache as transformers' ``DynamicCache`` holds it for a model of config
    ``cfg`` at ``dtype_bytes`` a value: (bytes a position of the layers that keep every
    position, ((bytes a position, positions kept), ...) of the sliding-window layers, bytes of
    fixed state).  An attention layer keeps keys and values of every key/value head; an MLA
    layer (DeepSeek-V2/V3) its latent and rotary key, ``kv_lora_rank + qk_rope_head_dim``
    values; a ``sliding_attention`` layer at most ``sliding_window`` positions; a
    ``linear_attention`` layer of Qwen3-Next's form (``linear_*`` settings) no positions but
    its short-convolution state (``2 key + value`` channels by the kernel width, at the
    model's dtype) and its f32 recurrent state (value heads x key dim x value dim).  Other
    layer types (Mamba, short-convolution layers) are counted as attention layers: more than
    they hold."""
    layers = int(cfg.num_hidden_layers)
    types = list(getattr(cfg, "layer_types", None) or ())[:layers]
    types += ["full_attention"] * (layers - len(types))
    if getattr(cfg, "kv_lora_rank", None):
        per = (int(cfg.kv_lora_rank) + int(cfg.qk_rope_head_dim)) * dtype_bytes
    else:
        hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kvh = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        per = 2 * int(kvh) * int(hd) * dtype_bytes
    window = getattr(cfg, "sliding_window", None)
    full, windows, state = 0, [], 0
    for t in types:
        if t == "sliding_attention" and window:
            windows.append((per, int(window)))
        elif t == "linear_attention" and getattr(cfg, "linear_num_value_heads", None):
            hk, dk = int(cfg.linear_num_key_heads), int(cfg.linear_key_head_dim)
            hv, dv = int(cfg.linear_num_value_heads), int(cfg.linear_value_head_dim)
            conv = (2 * hk * dk + hv * dv) * int(cfg.linear_conv_kernel_dim) * dtype_bytes
            state += conv + hv * dk * dv * 4
        else:
            full += per
    return full, tuple(windows), state


def recording_layout(cfg: Any, dtype_bytes: int) -> tuple[int, int]:
    """What one sequence's cache holds beyond :func:`kv_layout` while it records the last
    tokens of a forward so a speculative verification can be cut back (transformers >= 5.25,
    ``specmoe.speculation.decoding.new_kv(rollback=True, window=...)``): (bytes per recorded
    token, bytes of one more state).  Each ``linear_attention`` layer of Qwen3-Next's form
    keeps, until the crop, its conv window grown by one column a token (``2 key + value``
    channels at the model's dtype) and its f32 recurrent state after each token, and the
    state from before the forward.  (Sliding-window layers keep the few positions past their
    window; Mamba layers are not counted.)"""
    layers = int(cfg.num_hidden_layers)
    types = list(getattr(cfg, "layer_types", None) or ())[:layers]
    per = state = 0
    for t in types:
        if t == "linear_attention" and getattr(cfg, "linear_num_value_heads", None):
            hk, dk = int(cfg.linear_num_key_heads), int(cfg.linear_key_head_dim)
            hv, dv = int(cfg.linear_num_value_heads), int(cfg.linear_value_head_dim)
            s = hv * dk * dv * 4
            per += (2 * hk * dk + hv * dv) * dtype_bytes + s
            state += s
    return per, state


def measure_rates(sizes: ModelSizes, expert_dtype: str, *, hidden: int, inter: int,
                  formats: Sequence[str], directory: str | None = None) -> MachineRates:
    """This machine's :class:`MachineRates`, in about a second: each dense format's kernel on a
    ``4 * hidden`` x ``hidden`` weight at one token (best of 5; ``"gguf"``: blocks of
    ``sizes.gguf_kind``), one expert of ``expert_dtype``
    (``"gguf"``: measured as int4) at one token (best of 10), and the store's read time for one
    block of ``block_bytes`` (:func:`specmoe.sim.calibration.calibrate` in ``directory``)."""
    import torch

    from ..models.layers import CLinear
    from ..sim.calibration import calibrate
    from ..storage import quant
    from . import kernels

    def best(fn, reps: int) -> float:
        fn()
        t = float("inf")
        for _ in range(reps):
            a = time.perf_counter()
            fn()
            t = min(t, time.perf_counter() - a)
        return t

    g = torch.Generator().manual_seed(0)
    rates: dict[str, float] = {}
    x = torch.randn(1, hidden, generator=g)
    for d in dict.fromkeys(formats):
        lin = torch.nn.Linear(hidden, 4 * hidden, bias=False)
        with torch.no_grad():
            lin.weight.normal_(0.0, 0.02, generator=g)
        if d == "bf16":
            lin = lin.to(torch.bfloat16)
        if d == "gguf":  # the blocks of the kind holding most of the file's dense bytes
            from ..storage.ggml_blocks import BLOCKS, QUANTIZERS
            kind = sizes.gguf_kind or "q8_0"
            if hidden % BLOCKS[kind][0]:
                kind = "q8_0"
            cl = CLinear(lin, kind, blocks=QUANTIZERS[kind](lin.weight.detach().numpy()))
        else:
            cl = CLinear(lin, d)
        xi = x.to(lin.weight.dtype)
        with torch.no_grad():
            t = best(lambda: cl(xi), 5)
        rates[d] = cl.nbytes / t
    rng = np.random.default_rng(0)
    gt = rng.standard_normal((inter, hidden), dtype=np.float32) * 0.02
    dn = rng.standard_normal((hidden, inter), dtype=np.float32) * 0.02
    edt = "int4" if expert_dtype == "gguf" else expert_dtype
    block, entries = kernels.pack_block(quant.expert_tensors(gt, gt, dn, edt))
    spec = kernels.FFNSpec.from_store_schema(entries, block_bytes=block.nbytes)
    xe = rng.standard_normal((1, hidden), dtype=np.float32)
    expert_s = best(lambda: kernels.ffn(block, xe, spec=spec), 10)
    hw = calibrate(block_bytes=max(1 << 16, sizes.block_bytes), blocks=6, directory=directory,
                   refresh=True)
    return MachineRates(dense_rate=rates, expert_s=expert_s, load_s=hw.load_s(sizes.block_bytes))

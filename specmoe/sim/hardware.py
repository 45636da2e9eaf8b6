"""Hardware profiles and the simulator's time model.

A :class:`Hardware` profile says how fast the fast tier is read (``fast_bw``), how fast and with
what fixed latency an expert moves from the slow tier over the link (``link_bw``,
``link_latency_s``), and the dense compute rate (``flops``, used for prefill only).  A
:class:`ModelCost` says how many bytes one routed expert has and how many resident bytes every
MoE layer and every token read besides the routed experts.

Time model (implemented in ``csrc/sim.c``; batch-1 decoding, one request stream):

* **Decode compute is weight-read bound.**  Computing one expert for one token costs
  ``expert_bytes / fast_bw``.  Each MoE layer adds ``layer_fixed_s = layer_fixed_bytes /
  fast_bw + kernel_overhead_s`` (attention, router, shared experts: resident weights) and each
  token ``token_fixed_s = token_fixed_bytes / fast_bw`` (dense layers, LM head).
* **Loads.**  One expert load takes ``link_latency_s + expert_bytes / link_bw``.  A demand miss
  loads at once and compute waits for it (stall).  Prefetches run on a separate copy engine,
  one at a time in predicted order, overlapping compute; the link is shared, so a demand load
  pushes the in-flight prefetch back by its own duration.  A demand access to an expert whose
  prefetch is still in flight waits for it (stall; counted as a miss, "late").
* **The hybrid GPU tier** (``simulate(hybrid=True)``, issue 37): a layer's missing experts are
  split between copies and the host CPU by MoE-SpAc's Eq. 9 (the live tier's C rule), the
  CPU's costing ``expert_bytes / cpu_bw`` each and running beside the device's part (the
  layer ends at the later of the two); with a predictor the CPU's hottest are queued for
  admission by Eq. 10 (``csrc/sim.h``, ``SMOE_SIM_HYBRID``).
* **Per token**: ``est_tpot_ms`` is the simulated decode time divided by the token count.
* **Prefill (TTFT)**: each request's tokens are taken as its prompt, processed as one batch.
  Per MoE layer, every distinct expert the prompt routes to is loaded once over the link (cold
  cache: an upper bound) and computed once; an expert's compute is
  ``max(expert_bytes / fast_bw, 2 * params * tokens_routed / flops)``; the layer's resident
  part is ``max(layer_fixed_bytes / fast_bw, 2 * layer_params * prompt_len / flops)``.  Without
  a predictor loads and compute add up; with one, loads overlap compute (``max`` of the two).
  Attention's quadratic term is ignored.  ``ttft_ms`` is the mean over requests.

The built-in profiles use effective (not peak) bandwidths: about 75-80 % of the HBM/GDDR peak
that decoding kernels reach, and about 25 GB/s for pinned host-to-device copies over PCIe 4.0
x16 (31.5 GB/s raw).  ``h200`` is measured instead (:func:`specmoe.runtime.cuda.calibrate`): specmoe's
GPU tier is launch-bound at batch 1, so its ``fast_bw`` is one expert call's effective rate;
the model charges the resident (non-expert) bytes at that rate too, which overstates them
there (torch reads them at HBM speed).
"""
from __future__ import annotations

import json
import math
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields, replace
from typing import Any

__all__ = ["Hardware", "ModelCost", "PROFILES", "load_profile", "link_fit", "sim_timing",
           "DEEPSEEK_V2_LITE"]

_RATES = ("fast_bw", "link_bw", "flops")  # > 0
_AMOUNTS = ("link_latency_s", "fast_bytes", "kernel_overhead_s", "cpu_bw")  # >= 0


@dataclass(frozen=True)
class Hardware:
    """One machine: fast tier, link, compute.  Bandwidths in bytes/s, times in seconds.

    A profile measured on one machine (:func:`calibrate`, :func:`specmoe.runtime.cuda.calibrate`) can
    be saved with :meth:`save` and used elsewhere as ``get_hardware("profile.json")`` or
    ``python -m specmoe simulate --hardware profile.json``."""

    name: str
    fast_bw: float
    link_bw: float
    link_latency_s: float
    flops: float
    fast_bytes: float = 0.0  # fast-tier size (informational; capacities are given explicitly)
    kernel_overhead_s: float = 0.0  # per MoE layer per token (launches, synchronisation)
    description: str = ""
    # the host CPU's expert kernel at one token, bytes/s (the hybrid GPU tier's t_cpu is
    # expert_bytes / cpu_bw); 0: not measured (simulate(hybrid=True) refuses)
    cpu_bw: float = 0.0

    def load_s(self, nbytes: float) -> float:
        """Time to load one block of ``nbytes`` over the link."""
        return self.link_latency_s + nbytes / self.link_bw

    def __post_init__(self) -> None:
        for name in _RATES + _AMOUNTS:
            v = getattr(self, name)
            rate = name in _RATES
            if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v)
                    or (v <= 0 if rate else v < 0)):
                raise ValueError(f"Hardware.{name} must be a finite number "
                                 f"{'> 0' if rate else '>= 0'}, got {v!r}")

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Hardware":
        """The profile :meth:`to_dict` wrote (``name``, ``fast_bw``, ``link_bw``, ``flops``
        and ``link_latency_s`` required; unknown keys are an error, so a misspelt field is
        never silently ignored)."""
        known = [f.name for f in fields(cls)]
        unknown = sorted(set(d) - set(known))
        if unknown:
            raise ValueError(f"unknown Hardware fields {unknown}; known: {', '.join(known)}")
        missing = [k for k in ("name",) + _RATES + ("link_latency_s",) if k not in d]
        if missing:
            raise ValueError(f"Hardware profile lacks {', '.join(missing)}")
        return cls(**d)

    def save(self, path: "str | os.PathLike[str]") -> None:
        """Write the profile as JSON; :func:`load_profile` (or ``get_hardware(path)``) reads it
        back."""
        with open(path, "w") as f:
            json.dump(self.to_dict(), f, indent=1)
            f.write("\n")


@dataclass(frozen=True)
class ModelCost:
    """Byte counts of a model, for the time model (bf16 weights: 2 bytes per parameter)."""

    name: str
    expert_bytes: float
    layer_fixed_bytes: float = 0.0
    token_fixed_bytes: float = 0.0
    bytes_per_param: float = 2.0

    @staticmethod
    def for_trace(trace) -> "ModelCost":
        """DeepSeek-V2-Lite for its traces (26 MoE layers x 64 experts), else a generic cost
        with 16 MiB experts and no resident part."""
        if (trace.num_layers, trace.num_experts, trace.top_k) == (26, 64, 6) or \
                "deepseek-v2-lite" in (trace.model or "").lower():
            return DEEPSEEK_V2_LITE
        return ModelCost(name="generic", expert_bytes=16 * 2**20)

    def measured(self, *, expert_bytes: float, fixed_s: float, fast_bw: float,
                 num_layers: int) -> "ModelCost":
        """This model's cost as a live engine measured it: experts of ``expert_bytes``, and
        ``fixed_s``, the time of one decode pass that is not expert kernels (attention,
        routers, shared experts, dense layers, LM head), as bytes read at ``fast_bw``.

        That time is split between the ``num_layers`` MoE layers and the token as this
        model's resident bytes are (``num_layers * layer_fixed_bytes`` against
        ``token_fixed_bytes``), all of it per token for a model with none.  Where it falls
        matters to prefetching: the simulator starts a prefetch for the next layers after a
        layer's routing, and the copy has until those layers run to land.  Charged all at the
        token's start, the fixed time gives that copy only the experts' compute (about a
        millisecond a layer for DeepSeek-V2-Lite on a CPU) where the live engine also has the
        next layer's attention and shared experts."""
        if not (fixed_s >= 0.0 and fast_bw > 0.0 and num_layers >= 1):
            raise ValueError(f"measured: fixed_s >= 0, fast_bw > 0 and num_layers >= 1, got "
                             f"{fixed_s}, {fast_bw}, {num_layers}")
        per_layer = num_layers * self.layer_fixed_bytes
        resident = per_layer + self.token_fixed_bytes
        share = per_layer / resident if resident > 0 else 0.0
        total = fixed_s * fast_bw
        return ModelCost(name=f"{self.name}, measured", expert_bytes=expert_bytes,
                         layer_fixed_bytes=total * share / num_layers,
                         token_fixed_bytes=total * (1.0 - share),
                         bytes_per_param=self.bytes_per_param)


def _ds_v2_lite() -> ModelCost:
    h, inter, dense_inter, vocab = 2048, 1408, 10944, 102400
    expert = 3 * h * inter  # gate, up, down
    attn = h * 16 * 192 + h * (512 + 64) + 512 * 16 * 256 + 16 * 128 * h  # MLA, no q LoRA
    layer = attn + 2 * expert + 64 * h  # attention, 2 shared experts, router
    token = attn + 3 * h * dense_inter + vocab * h  # dense layer 0, LM head
    return ModelCost(name="DeepSeek-V2-Lite (bf16)", expert_bytes=2.0 * expert,
                     layer_fixed_bytes=2.0 * layer, token_fixed_bytes=2.0 * token)


DEEPSEEK_V2_LITE = _ds_v2_lite()

PROFILES: dict[str, Hardware] = {
    "a100-pcie4": Hardware(
        name="a100-pcie4", fast_bw=1.2e12, link_bw=25e9, link_latency_s=10e-6, flops=250e12,
        fast_bytes=40e9, kernel_overhead_s=20e-6,
        description="data-centre GPU, A100-40GB class: HBM2 1.56 TB/s peak, PCIe 4.0 x16 "
                    "host link, 312 TFLOP/s bf16 peak"),
    "rtx4090": Hardware(
        name="rtx4090", fast_bw=0.85e12, link_bw=22e9, link_latency_s=10e-6, flops=140e12,
        fast_bytes=24e9, kernel_overhead_s=20e-6,
        description="consumer GPU, RTX 4090 class: GDDR6X 1.0 TB/s peak, PCIe 4.0 x16"),
    "laptop": Hardware(
        name="laptop", fast_bw=60e9, link_bw=5e9, link_latency_s=100e-6, flops=1.5e12,
        fast_bytes=32e9, kernel_overhead_s=5e-6,
        description="laptop CPU: dual-channel DDR5-5600 (90 GB/s peak) as fast tier, PCIe 4.0 "
                    "x4 NVMe (7 GB/s sequential peak) as slow tier"),
    "h200": Hardware(
        name="h200", fast_bw=298e9, link_bw=54.9e9, link_latency_s=10.6e-6, flops=40.8e12,
        fast_bytes=150e9, kernel_overhead_s=389e-6, cpu_bw=73.3e9,
        description="specmoe's GPU tier on an NVIDIA H200 (PCIe 5.0 host link), measured by "
                    "specmoe.runtime.cuda.calibrate (median of 3 runs, 2026-11-26, "
                    "benchmarks/results/gpu_profile_h200.json): fast_bw and flops are the "
                    "effective rates of one bf16 expert call at 1 and 1024 tokens with its "
                    "launch work (the tier is launch-bound at batch 1, far below HBM's 4.8 TB/s), "
                    "kernel_overhead_s the fixed cost per layer of the per-expert Python path "
                    "of then (cuda.moe_forward, since removed); cpu_bw the "
                    "host CPU's bf16 expert at one token (16-core Xeon, 16 threads: t_cpu "
                    "236 us for a 17.3 MB expert), the hybrid tier's load-time profile in "
                    "benchmarks/results/gpu_hybrid_h200_bf16.json"),
}
PROFILES["a100"] = PROFILES["a100-pcie4"]


def load_profile(path: "str | os.PathLike[str]") -> Hardware:
    """The profile :meth:`Hardware.save` wrote at ``path`` (ValueError naming the file and
    what is wrong with it otherwise)."""
    try:
        with open(path) as f:
            d = json.load(f)
    except OSError as e:
        raise ValueError(f"cannot read the hardware profile {os.fspath(path)!r}: "
                         f"{e.strerror or e}") from None
    except ValueError as e:
        raise ValueError(f"the hardware profile {os.fspath(path)!r} is not JSON: {e}") from None
    if not isinstance(d, dict):
        raise ValueError(f"the hardware profile {os.fspath(path)!r} must hold one JSON object, "
                         f"got {type(d).__name__}")
    try:
        return Hardware.from_dict(d)
    except (TypeError, ValueError) as e:
        raise ValueError(f"the hardware profile {os.fspath(path)!r}: {e}") from None


def link_fit(small_bytes: int, t_small: float, big_bytes: int, t_big: float
             ) -> tuple[float, float]:
    """``(link_bw, link_latency_s)`` of the line through two load times: the rate is the slope's
    inverse, the latency the intercept (0 if the fit puts it below; the slope floored so that a
    noisy pair never gives an infinite rate)."""
    per_byte = max((t_big - t_small) / (big_bytes - small_bytes), 1e-15)
    return 1.0 / per_byte, max(t_small - small_bytes * per_byte, 0.0)


def sim_timing(hw: Hardware, model: ModelCost) -> dict:
    """The keyword arguments of ``_C.simulate`` for the time model of (hw, model)."""
    return dict(expert_bytes=float(model.expert_bytes), fast_bw=float(hw.fast_bw),
                link_bw=float(hw.link_bw), link_latency_s=float(hw.link_latency_s),
                layer_fixed_s=model.layer_fixed_bytes / hw.fast_bw + hw.kernel_overhead_s,
                token_fixed_s=model.token_fixed_bytes / hw.fast_bw)


def with_(hw: Hardware, **changes) -> Hardware:
    """A copy of ``hw`` with some fields changed (e.g. ``with_(hw, link_bw=50e9)``)."""
    return replace(hw, **changes)

"""The GPU tier (issue 12): expert FFN kernels on the GPU and a GPU expert cache.

Everything here goes through the separate extension ``specmoe._cuda``, built only where a CUDA
toolkit was found (see setup.py) and imported lazily on first use, so ``import specmoe`` never
needs CUDA.  :func:`load` returns the module or raises :class:`CudaUnavailable` saying why
(not built, cuBLAS library missing, no driver, no device); :func:`available` answers without
raising.

* :func:`ffn` runs one expert block that lives in GPU memory (a torch uint8 CUDA tensor, or
  a slot of :class:`GpuExpertCache`) on CUDA tensors, with the same block layout and math as
  :func:`specmoe.runtime.kernels.ffn` (bf16/f32 by cuBLAS or by the dequantizing kernels, int8 and
  int4 by the dequantizing kernels).
* :func:`layer_call` runs one MoE layer in one C call of csrc/layer.c over a cache (the
  engine's path); :class:`ExpertLayers` is that path over a cache without a model (the
  benchmarks' and the calibration's).
* :class:`GpuExpertCache` keeps expert blocks in one GPU allocation; loads are
  ``cudaMemcpyAsync`` from pinned host memory on the cache's copy stream, ordered by one
  event per slot (details in cuda/gcache.h).  ``device=-1`` runs the same bookkeeping on host
  memory, without CUDA (used by the tests on machines without a GPU).

* :func:`calibrate` measures the simulator's profile of this tier.

Tested on an H200 (tests/test_cuda.py); what ran there and the figures: docs/gpu.md.
"""
from __future__ import annotations

import ctypes
import glob
import importlib
import math
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import numpy as np

__all__ = ["CudaUnavailable", "load", "available", "unusable_reason", "ffn", "GpuExpertCache",
           "PATHS", "BalanceProfile", "balance_split", "measure_balance_profile",
           "layer_call", "ExpertLayers"]

PATHS = {"auto": 0, "dequant": 1, "cublas": 2}

# names this module had and what replaces them (module __getattr__ below)
_REMOVED = {
    "moe_forward": "the per-expert Python layer was removed (2026-12-05): one MoE layer is one "
                   "C call, specmoe.runtime.cuda.layer_call, or ExpertLayers(cache, spec, "
                   "top_k).forward(layer, hidden, ids, weights) without a model; its "
                   "balance= is ExpertLayers.set_hybrid(profile)",
    "group_by_expert": "the C layer call groups the pairs by expert itself "
                       "(specmoe.runtime.cuda.layer_call)",
    "ExpertGroups": "the C layer call groups the pairs by expert itself "
                    "(specmoe.runtime.cuda.layer_call)",
}


def __getattr__(name: str) -> Any:
    if name in _REMOVED:
        raise AttributeError(f"specmoe.runtime.cuda.{name}: {_REMOVED[name]}")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


class CudaUnavailable(RuntimeError):
    """The GPU tier cannot be used here; the message says why."""


_MOD: ModuleType | None = None
_WHY: str | None = None


def _preload_cublas() -> str | None:
    """Load libcublasLt/libcublas (RTLD_GLOBAL) from the nvidia-cublas wheel or the system,
    so that specmoe._cuda's dependency on the soname resolves.  Returns a reason on failure."""
    names = ("libcublasLt.so.13", "libcublas.so.13")
    dirs: list[str] = []
    for entry in sys.path:
        for sub in ("nvidia/cu13/lib", "nvidia/cublas/lib"):
            d = os.path.join(entry or ".", sub)
            if os.path.isdir(d):
                dirs.append(d)
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            dirs += [os.path.join(os.environ[env], "lib64"), os.path.join(os.environ[env], "lib")]
    errors = []
    for name in names:
        for d in dirs + [""]:
            path = os.path.join(d, name) if d else name
            if d and not glob.glob(path):
                continue
            try:
                ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                break
            except OSError as e:
                errors.append(f"{path}: {e}")
        else:
            return (f"cannot load {name} (install the nvidia-cublas wheel or a CUDA toolkit): "
                    + "; ".join(errors[-2:]))
    return None


def load() -> ModuleType:
    """Import ``specmoe._cuda`` (once) and check that a device is usable; raises
    :class:`CudaUnavailable` naming the reason otherwise."""
    global _MOD, _WHY
    if _MOD is not None:
        return _MOD
    if _WHY is not None:
        raise CudaUnavailable(_WHY)
    mod = _import_ext()
    try:
        n = mod.device_count()
    except mod.CudaError as e:
        _WHY = f"specmoe._cuda is built but no GPU is usable: {e}"
        raise CudaUnavailable(_WHY) from None
    if n == 0:
        _WHY = "specmoe._cuda is built but the CUDA runtime sees no device"
        raise CudaUnavailable(_WHY)
    _MOD = mod
    return mod


def _import_ext() -> ModuleType:
    """specmoe._cuda without the device check (the host-emulated cache needs no GPU)."""
    global _WHY
    from importlib.util import find_spec

    if find_spec("specmoe._cuda") is None:
        _WHY = ("specmoe._cuda is not built: no CUDA toolkit was found at build time (install "
                "requirements-dev.txt's nvidia-* wheels or set SPECMOE_NVCC/CUDA_HOME, then "
                "rebuild; SPECMOE_CUDA=1 makes a missing toolkit an error)")
        raise CudaUnavailable(_WHY)
    why = _preload_cublas()
    try:
        return importlib.import_module("specmoe._cuda")
    except ImportError as e:
        _WHY = f"specmoe._cuda is built but cannot be loaded: {e}" + (f" ({why})" if why else "")
        raise CudaUnavailable(_WHY) from None


def available() -> tuple[bool, str]:
    """(True, device name) when a GPU is usable, else (False, the reason)."""
    try:
        mod = load()
    except CudaUnavailable as e:
        return False, str(e)
    return True, str(mod.device_info(0)["name"])


def unusable_reason() -> str:
    """"" when torch and ``specmoe._cuda`` can both use a GPU here, else why not (torch not
    installed, a CPU-only torch or no device, the extension not built or not loadable)."""
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device: torch.cuda.is_available() is False"
    ok, why = available()
    return "" if ok else why


def extension() -> ModuleType:
    """``specmoe._cuda`` itself (no device needed), or CudaUnavailable."""
    return _import_ext()


# ---- FFN -----------------------------------------------------------------------------------

_FFN_CTX: dict[tuple[int, int, int], tuple[Any, int]] = {}


def ffn_context(device: int, H: int, I: int, max_tokens: int = 256) -> Any:
    """The cached ``_cuda.FFN`` context (cuBLAS handle + scratch for ``max_tokens`` tokens;
    more are processed in chunks) for (device, H, I)."""
    key = (device, H, I)
    have = _FFN_CTX.get(key)
    if have is None or have[1] < max_tokens:
        have = (load().FFN(device, H, I, max_tokens), max_tokens)
        _FFN_CTX[key] = have
    return have[0]


def ffn(block: Any, spec: Any, x: Any, *, rows: Any = None, scale: Any = None, out: Any = None,
        path: str = "auto", stream: Any = None) -> Any:
    """``out[rows[t]] += scale[t] * FFN(x[rows[t]])`` on the GPU for one expert block.

    ``block``: a 1-D uint8 CUDA tensor laid out as ``spec`` (:class:`specmoe.runtime.kernels.FFNSpec`)
    says, or an int device address (a cache slot); ``x``: f32 CUDA tensor [N, H]; ``rows``
    int32 CUDA tensor (default all rows), ``scale`` f32 CUDA tensor (default 1); ``out``
    f32 CUDA tensor [N, H] (zeros if None).  ``path``: "auto" (cuBLAS for f32/bf16 unless
    ``spec.precise``), "dequant" (exact widening, f32 accumulation: the CPU precise math) or
    "cublas".  Runs on ``stream`` (a torch.cuda.Stream; default torch's current stream),
    asynchronously."""
    import torch

    load()
    if path not in PATHS:
        raise ValueError(f"path must be one of {tuple(PATHS)}, got {path!r}")
    if not (isinstance(x, torch.Tensor) and x.is_cuda and x.dtype == torch.float32 and x.dim() == 2):
        raise ValueError("x must be a 2-D float32 CUDA tensor")
    if x.shape[1] != spec.H or x.stride(1) != 1:
        raise ValueError(f"x must be [N, {spec.H}] with unit column stride, got {tuple(x.shape)}")
    if out is None:
        out = torch.zeros_like(x)
    if not (isinstance(out, torch.Tensor) and out.is_cuda and out.dtype == torch.float32
            and out.dim() == 2 and out.shape[1] == spec.H and out.stride(1) == 1):
        raise ValueError(f"out must be a float32 CUDA tensor [N, {spec.H}]")
    if isinstance(block, torch.Tensor):
        if not (block.is_cuda and block.dtype == torch.uint8 and block.dim() == 1
                and block.is_contiguous()):
            raise ValueError("block must be a contiguous 1-D uint8 CUDA tensor")
        if block.numel() < spec.block_bytes:
            raise ValueError(f"block has {block.numel()} bytes, the spec needs {spec.block_bytes}")
        baddr = block.data_ptr()
    elif isinstance(block, int) and block > 0:
        baddr = block
    else:
        raise TypeError("block must be a uint8 CUDA tensor or a device address (int)")
    if rows is None:
        T = x.shape[0]
        raddr = 0
        if out.shape[0] < T:
            raise ValueError("out has fewer rows than x")
    else:
        if not (isinstance(rows, torch.Tensor) and rows.is_cuda and rows.dtype == torch.int32
                and rows.dim() == 1 and rows.is_contiguous()):
            raise ValueError("rows must be a contiguous 1-D int32 CUDA tensor")
        T = rows.numel()
        raddr = rows.data_ptr()
    if scale is not None:
        if not (isinstance(scale, torch.Tensor) and scale.is_cuda
                and scale.dtype == torch.float32 and scale.numel() == T and scale.is_contiguous()):
            raise ValueError(f"scale must be a contiguous float32 CUDA tensor of {T} values")
    st = stream if stream is not None else torch.cuda.current_stream(x.device)
    ctx = ffn_context(x.device.index or 0, spec.H, spec.I)
    ctx.forward(spec.desc(), baddr, x.data_ptr(), x.stride(0), raddr,
                0 if scale is None else scale.data_ptr(), T, out.data_ptr(), out.stride(0),
                PATHS[path], st.cuda_stream)
    return out


# ---- cache ---------------------------------------------------------------------------------

class GpuExpertCache:
    """Expert blocks of ``store`` cached in GPU memory.

    ``GpuExpertCache(store, capacity, policy="lru", *, device=0, mode="host", stages=2,
    top_k=None, prefetch=True)``

    * ``capacity``: slots, as :func:`specmoe.parse_capacity` reads it (int, fraction, size,
      percentage).  One ``cudaMalloc`` of capacity x block bytes at construction.
    * ``policy``: a built-in policy name (the C objects of csrc/policy) or a Python policy (an
      object with a ``victim(candidates)`` method, :class:`specmoe.PythonPolicy`), run by the
      same bridge as on the CPU cache (csrc/bindings/py_bridge.c).
    * ``mode``: ``"host"`` keeps a pinned copy of the whole store in host memory (read once
      now; loads are pure PCIe copies) or ``"staged"`` reads the store file into ``stages``
      pinned staging buffers per load.
    * ``device=-1``: host emulation (no CUDA; for tests of the bookkeeping).

    ``acquire(layer, expert, stream)`` returns the slot's device address and makes ``stream``
    wait for the slot's copy; ``release(layer, expert, stream)`` records the slot's free
    event on ``stream``.  ``stream`` is a torch.cuda.Stream, a raw handle (int), or None (torch's
    current stream on a GPU, 0 in emulation).
    """

    def __init__(self, store: Any, capacity: int | float | str, policy: Any = "lru", *,
                 device: int = 0, mode: str = "host", stages: int = 2,
                 top_k: int | None = None, prefetch: bool = True) -> None:
        from .cache import parse_capacity

        if not isinstance(policy, str) and not callable(getattr(policy, "victim", None)):
            raise TypeError("the GPU cache takes a built-in policy name (str) or a Python "
                            "policy (an object with a victim(candidates) method), got "
                            f"{type(policy).__name__}")
        if not isinstance(device, int) or device < -1:
            raise ValueError(f"device must be a CUDA device index or -1 (emulation), got {device!r}")
        mod = extension() if device < 0 else load()
        total = store.num_layers * store.num_experts
        n = parse_capacity(capacity, total_experts=total, slot_bytes=store.block_bytes)
        crc = None
        meta = getattr(store, "metadata", None)
        if getattr(store, "verify", False) and isinstance(meta, dict) and "crc32c" in meta:
            crc = np.array([int(h, 16) for row in meta["crc32c"] for h in row], dtype=np.uint32)
        self.store = store
        self.device = device
        self.mode = mode
        self._c = mod.GpuCache(store.path, store.data_offset, store.block_bytes,
                               store.num_layers, store.num_experts, n, policy, device, mode,
                               stages, int(top_k or 1), bool(prefetch), crc)

    @property
    def capacity(self) -> int:
        return int(self._c.nslots)

    @property
    def slot_bytes(self) -> int:
        return int(self._c.slot_bytes)

    def _stream(self, stream: Any) -> int:
        if stream is None:
            if self.device < 0:
                return 0
            import torch

            return int(torch.cuda.current_stream(self.device).cuda_stream)
        if isinstance(stream, int):
            return stream
        return int(stream.cuda_stream)

    def acquire(self, layer: int, expert: int, stream: Any = None) -> int:
        return int(self._c.acquire(layer, expert, self._stream(stream)))

    def set_throttle(self, throttle: tuple[float, float] | None) -> None:
        """Emulate a slower link (SpecMD Appendix A.4, the CPU cache's rule, csrc/link.h):
        ``(GB_per_s, latency_us)`` makes every load of this cache, demand or prefetch, return
        no earlier than ``latency + block_bytes / bandwidth`` after the emulated link is free
        (a demand load holds the layer call that long; the copy itself runs at the hardware's
        speed); None turns it off."""
        from .misses import check_throttle
        self._c.set_throttle(*check_throttle(throttle))

    def tier(self, spec: Any, grouped: bool | None = None) -> Any:
        """This cache as the expert tier of ``specmoe._C.Layers`` (``_cuda.Tier``, cuda/gtier.h):
        its ``capsule`` makes the C per-layer path run on this cache and the GPU kernels
        (the CPU kernels in the host emulation) for experts of ``spec``'s shape.

        ``grouped``: a layer's experts of few tokens in one launch group (three kernels per
        layer at decode) rather than one kernel call per expert; default True, or
        ``SPECMOE_GPU_GROUPED=0`` in the environment for the per-expert calls (A/B runs)."""
        if grouped is None:
            grouped = os.environ.get("SPECMOE_GPU_GROUPED", "1") != "0"
        mod = extension() if self.device < 0 else load()
        return mod.Tier(self._c, spec.H, spec.I, grouped=bool(grouped))

    def release(self, layer: int, expert: int, stream: Any = None) -> None:
        self._c.release(layer, expert, self._stream(stream))

    def begin_pass(self) -> None:
        self._c.begin_pass()

    def prefetch(self, keys: Sequence[int] | Sequence[tuple[int, int]],
                 priorities: Sequence[float] | None = None, replace: bool = False) -> None:
        """Queue prefetches of keys (layer * num_experts + expert) or (layer, expert) pairs."""
        ne = self.store.num_experts
        ks = [int(k[0]) * ne + int(k[1]) if isinstance(k, tuple) else int(k) for k in keys]
        self._c.prefetch(ks, None if priorities is None else [float(p) for p in priorities],
                         replace)

    def cancel(self, key: int = -1) -> None:
        self._c.cancel(key)

    def wait_idle(self) -> None:
        self._c.wait_idle()

    def pause_worker(self, paused: bool = True) -> None:
        self._c.pause_worker(paused)

    def stats(self) -> dict[str, Any]:
        return dict(self._c.stats())

    def reset_stats(self) -> None:
        self._c.reset_stats()

    def set_admission(self, on: bool, byte_budget: bool = True) -> None:
        """Prefetch admission by expected benefit, as :meth:`specmoe.ExpertCache.set_admission`
        (the same table and rule, ``csrc/admit.h``)."""
        self._c.set_admission(bool(on), bool(byte_budget))

    def resident(self) -> list[int]:
        return list(self._c.resident())

    def queued(self) -> list[tuple[int, float]]:
        """The prefetch queue's (key, priority) pairs in the worker's order (highest priority
        first, then request order; csrc/slots.h ``smoe_slots_queued``): a snapshot."""
        return list(self._c.queued())

    def layer_states(self, layer: int) -> np.ndarray:
        """Each expert of ``layer``'s slot state now, without loading anything: uint8
        [num_experts], 0 absent, 1 loading, 2 ready (a snapshot)."""
        return np.frombuffer(self._c.layer_states(int(layer)), dtype=np.uint8)

    def host_block(self, layer: int, expert: int) -> np.ndarray:
        """The expert's block in the pinned host copy of the store (``mode="host"``), as a
        uint8 array over that memory (no copy; valid until :meth:`close`)."""
        base = int(self._c.host_copy)
        if not base:
            raise ValueError("the GPU cache keeps no host copy of the store (mode='staged', "
                             "or closed)")
        ne, nl = self.store.num_experts, self.store.num_layers
        if not (0 <= layer < nl and 0 <= expert < ne):
            raise ValueError(f"(layer, expert) ({layer}, {expert}) out of range {nl} x {ne}")
        bb = self.slot_bytes
        addr = base + (int(layer) * ne + int(expert)) * bb
        return np.ctypeslib.as_array((ctypes.c_uint8 * bb).from_address(addr))

    def set_policy(self, policy: Any) -> None:
        self._c.set_policy(policy)

    def counts(self, keys: Sequence[int], counts: Sequence[int]) -> None:
        self._c.counts(list(keys), list(counts))

    def protect(self, keys: Sequence[int] | Sequence[tuple[int, int]] = ()) -> None:
        """Lookahead-aware eviction, as :meth:`specmoe.runtime.cache.ExpertCache.protect`: these keys
        (layer * num_experts + expert, or (layer, expert) pairs) become the protected set,
        evicted only when no unprotected slot is evictable (``stats()["protected_evictions"]``);
        no keys clears it.  Integer keys only (TypeError otherwise)."""
        ne = self.store.num_experts
        ks = []
        for k in keys:
            parts = k if isinstance(k, tuple) else (k,)
            if any(isinstance(v, bool) or not isinstance(v, (int, np.integer)) for v in parts):
                raise TypeError(f"protect: keys must be integers or (layer, expert) pairs, "
                                f"got {k!r}")
            ks.append(int(k[0]) * ne + int(k[1]) if isinstance(k, tuple) else int(k))
        self._c.protect(ks)

    def close(self) -> None:
        self._c.close()

    def __enter__(self) -> "GpuExpertCache":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# ---- MoE-SpAc's heterogeneous workload balancer --------------------------------------------

@dataclass(frozen=True)
class BalanceProfile:
    """Per-expert costs of the balancer (MoE-SpAc §3.3, Table 1), in seconds, measured by
    :func:`measure_balance_profile` (or given).

    t_io: ``T_io^u``, one expert block copied host to device; t_gpu: ``T_gpu^u``, one expert's
    FFN on the GPU at decode size; t_cpu: ``T_cpu^u``, one token through one expert on the CPU
    kernels, reading the block from the pinned host copy."""

    t_io: float
    t_gpu: float
    t_cpu: float

    def __post_init__(self) -> None:
        for name in ("t_io", "t_gpu", "t_cpu"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"BalanceProfile.{name} must be a finite number >= 0, got {v!r}")


def balance_split(counts: Sequence[int], on_gpu: int, profile: BalanceProfile) -> int:
    """How many of a layer's missing experts to copy to the GPU; the rest run on the CPU.

    ``counts``: the tokens routed to each missing expert, in descending order (the ones
    copied are the first n: hot on the GPU, cold on the CPU, MoE-SpAc §2.3).  ``on_gpu``:
    experts of the layer already resident or loading.  For n copies (§3.3):

    * ``T_cpu(n) = t_cpu * sum(counts[n:])`` (Eq. 7: the CPU's token-expert products);
    * ``T_gpu(n) = t_io * n + t_gpu * (on_gpu + n)`` (Eq. 8: the GPU's experts, each once
      for all its tokens; plus the n copies, Eq. 10's ``T_io^u n``, which at decode have no
      drafting window to hide in and so lie on the GPU's path);

    and the answer minimises ``|T_cpu(n) - T_gpu(n)|`` (Eq. 9) over n in 0..len(counts), the
    smaller n on a tie.  Deviations: the decision variable is the cut n in the order of this
    layer's token counts rather than a threshold tau on the estimator's utility levels
    (every tau of Eq. 12 is such a cut; at decode the counts are what is known exactly); the
    memory constraint (Eq. 11) holds by construction (the cache evicts to make room; experts
    on the CPU take no slot).  Like Appendix C.2's solution it evaluates the convex
    objective in O(len(counts)).  The rule is csrc/route.h's ``smoe_route_balance_cut``,
    the one the hybrid tier's C layer call runs."""
    from .. import _C
    return int(_C.balance_cut(np.asarray(counts, dtype=np.uint32), int(on_gpu),
                              float(profile.t_io), float(profile.t_gpu), float(profile.t_cpu)))


def measure_balance_profile(cache: GpuExpertCache, spec: Any, *, repeats: int = 5,
                            batch: int = 8, layer: int = 0,
                            expert: int = 0) -> BalanceProfile:
    """Measure :class:`BalanceProfile` on this machine, the median of ``repeats`` rounds after
    one warm-up: ``t_io``, ``batch`` back-to-back pinned host-to-device copies of one block
    (CUDA events) over ``batch``; ``t_gpu``, ``batch`` one-token GPU FFNs of one expert,
    launched and synchronised (wall clock, so one expert's launch work counts) over
    ``batch``; ``t_cpu``, one token through the CPU kernels over the block in the cache's
    pinned host copy (wall clock)."""
    import time

    import torch

    from . import kernels

    if repeats < 1 or batch < 1:
        raise ValueError(f"repeats and batch must be >= 1, got {repeats}, {batch}")
    load()
    # the CPU computes from the pinned host copy, or in staged mode from the mapped store file
    # (whose pages a read through the store brings into the page cache just the same)
    host = cache.host_block(layer, expert) if cache.mode == "host" else \
        cache.store.read_block(layer, expert)
    dev = torch.device("cuda", cache.device)
    src = torch.from_numpy(np.array(host)).pin_memory()
    block = torch.empty(cache.slot_bytes, dtype=torch.uint8, device=dev)
    x = torch.randn(1, spec.H, device=dev) * 0.1
    xh = x.cpu().numpy()
    st = torch.cuda.current_stream(dev)
    t_io, t_gpu, t_cpu = [], [], []
    for i in range(repeats + 1):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(st)
        for _ in range(batch):
            block.copy_(src, non_blocking=True)
        b.record(st)
        b.synchronize()
        t0 = time.perf_counter()
        for _ in range(batch):
            ffn(block, spec, x, stream=st)
        st.synchronize()
        t1 = time.perf_counter()
        kernels.ffn(host, xh, spec=spec)
        t2 = time.perf_counter()
        if i:  # the first round warms up
            t_io.append(a.elapsed_time(b) / 1e3 / batch)
            t_gpu.append((t1 - t0) / batch)
            t_cpu.append(t2 - t1)
    return BalanceProfile(float(np.median(t_io)), float(np.median(t_gpu)),
                          float(np.median(t_cpu)))


# ---- the per-layer C call on this tier ------------------------------------------------------

def layer_call(layers: Any, pos: int, hidden: Any, idx: Any, w: Any, used: np.ndarray, *,
               replace: bool = True, draft: np.ndarray | None = None) -> Any:
    """One MoE layer in one C call on the GPU tier (``_C.Layers.forward_on``: csrc/layer.h over
    cuda/gtier.h): the pass, the next layer's prediction and prefetch, the policy's counts,
    SpecMD's miss rules, the hybrid split, then the experts grouped and run on torch's current
    stream -- the CPU tier's code.  ``layers``: a ``_C.Layers`` over a :meth:`GpuExpertCache.tier`
    capsule; ``hidden`` [T, H] on the cache's device (a CPU tensor in the host emulation);
    ``idx``, ``w`` [T, k]; ``used`` uint8 [E], set to 1 for each expert the layer ran.
    ``replace``: this layer's prefetch requests replace the queued ones; ``draft``: uint8 [T],
    the draft tokens whose misses never load.  Returns the experts' sum [T, H] in f32.

    Routing's device-to-host read (the ids, the input and the weights, in one copy) is the
    layer's only one.  :class:`specmoe.runtime.gpu_engine.GpuEngine`, :class:`ExpertLayers`
    and the calibration all run their layers through here."""
    import torch

    x = hidden.detach().to(torch.float32).contiguous()
    T, H = x.shape
    k = int(idx.shape[-1])
    ix = idx.detach().to(torch.int64).reshape(T, k)
    wt = w.detach().to(torch.float32).reshape(T, k)
    if x.device.type == "cpu":  # the host emulation
        xh, ih, wh = x.numpy(), ix.contiguous().numpy(), wt.contiguous().numpy()
        stream = 0
    else:  # ids first: their int64 view needs an 8-byte aligned offset
        packed = torch.cat([ix.reshape(-1).view(torch.float32), x.reshape(-1),
                            wt.reshape(-1)]).cpu()
        n = 2 * T * k
        ih = packed[:n].view(torch.int64).view(T, k).numpy()
        xh = packed[n:n + T * H].view(T, H).numpy()
        wh = packed[n + T * H:].view(T, k).numpy()
        stream = torch.cuda.current_stream(x.device).cuda_stream
    out = torch.empty_like(x)
    layers.forward_on(pos, xh, ih, wh, used, x.data_ptr(), out.data_ptr(), stream, None,
                      replace, draft)
    return out


class ExpertLayers:
    """The GPU tier's per-layer path over a :class:`GpuExpertCache` without a model, for the
    benchmarks and the calibration that drive the routed experts alone: a ``_C.Layers`` whose
    routers are zeros (so it never predicts: the caller prefetches, or nothing does) over
    ``cache.tier(spec)``.  ``forward`` is :func:`layer_call`, the engine's own; ``set_hybrid``
    turns on MoE-SpAc's balancer exactly as :meth:`GpuEngine.set_balance` does.  The cache
    must outlive this object; one thread calls it (one compute stream)."""

    def __init__(self, cache: GpuExpertCache, spec: Any, top_k: int) -> None:
        from .. import _C
        from .kernels import context

        L, E = int(cache.store.num_layers), int(cache.store.num_experts)
        self.num_experts = E
        self.tier = cache.tier(spec)  # kept: the C layers use its capsule
        zero = np.zeros((E, int(spec.H)), np.float32)
        self.layers = _C.Layers(self.tier.capsule, context(), spec.desc(),
                                [(zero, None, None)] * L, int(top_k))
        self.layers.configure(False, 1.0, 0.0, False)
        self.experts = 0  # expert calls run by forward (on either device)

    def set_hybrid(self, profile: BalanceProfile | None, admit: bool = True) -> None:
        """MoE-SpAc's CPU/GPU split with ``profile``'s costs (None: copy every miss)."""
        if profile is None:
            self.layers.set_hybrid(False)
        else:
            self.layers.set_hybrid(True, profile.t_io, profile.t_gpu, profile.t_cpu,
                                   admit=admit)

    def forward(self, pos: int, hidden: Any, idx: Any, w: Any) -> Any:
        """Layer ``pos``'s routed experts (:func:`layer_call`), the output in ``hidden``'s
        dtype."""
        used = np.zeros(self.num_experts, np.uint8)
        out = layer_call(self.layers, pos, hidden, idx, w, used).to(hidden.dtype)
        self.experts += int(used.sum())
        return out

    def counters(self, reset: bool = False) -> dict[str, int]:
        """The expert calls on each device since the last reset (``gpu_experts``,
        ``cpu_experts``: the hybrid split's, each a copy avoided) and the C layers' own
        counters (``hybrid_copied``, ``hybrid_admitted``, ...)."""
        c = dict(self.layers.counters(reset))
        cpu = int(c.get("hybrid_cpu_experts", 0))
        c.update(gpu_experts=self.experts - cpu, cpu_experts=cpu)
        if reset:
            self.experts = 0
        return c


# ---- the simulator's profile of this GPU tier ----------------------------------------------



"""Measured hardware profiles for the simulator's time model (:mod:`specmoe.sim.hardware`): the CPU
tier's (:func:`calibrate`: this machine's kernels and store reads) and the GPU tier's
(:func:`calibrate_gpu`: a CUDA device's expert cache and kernels), and :func:`get_hardware`,
which resolves a profile by name, file or measurement.

It sits above :mod:`specmoe.sim.hardware` (the plain profile records) and :mod:`specmoe.runtime.cuda`
(the GPU tier), which do not import each other.
"""
from __future__ import annotations

import os
import tempfile
import time
from typing import Any

import numpy as np

from .hardware import PROFILES, Hardware, link_fit, load_profile

__all__ = ["calibrate", "calibrate_gpu", "get_hardware"]


def get_hardware(hw: "str | Hardware") -> Hardware:
    """A profile by name (``a100-pcie4``, ``rtx4090``, ``laptop``, ``h200``; ``calibrate``
    measures this machine's CPU tier, ``calibrate-gpu`` its GPU tier on device 0), a
    ``.json`` file :meth:`Hardware.save` wrote, or as given."""
    if isinstance(hw, Hardware):
        return hw
    if not isinstance(hw, str):
        raise TypeError(f"hardware must be a profile name or a Hardware, got {type(hw).__name__}")
    if hw == "calibrate":
        return calibrate()
    if hw == "calibrate-gpu":
        return calibrate_gpu()
    if hw.endswith(".json"):
        return load_profile(hw)
    try:
        return PROFILES[hw]
    except KeyError:
        raise ValueError(f"unknown hardware profile {hw!r}; known: "
                         f"{', '.join(sorted(PROFILES))}, calibrate, calibrate-gpu, or a "
                         f"profile .json file") from None
_CALIBRATED: Hardware | None = None


def calibrate(*, block_bytes: int = 8 * 2**20, blocks: int = 8, refresh: bool = False,
              directory: str | None = None, expert_shape: tuple[int, int] = (2048, 1408)
              ) -> Hardware:
    """Measure a profile on this machine with the real kernels and store (cached for the
    process; ``refresh`` re-measures).  Takes about a second.

    ``fast_bw``: bytes of one bf16 expert of ``expert_shape`` = (hidden H, intermediate I)
    (default DeepSeek-V2-Lite's) divided by the time of one batch-1 call of the C expert
    kernel (:func:`specmoe.runtime.kernels.ffn`, best of 10): the decode step the time model charges.
    ``flops``: the same kernel on 64 tokens.  ``link_bw`` / ``link_latency_s``: a specmoe store
    of ``blocks`` blocks of ``block_bytes`` is written in ``directory`` (default: the temp dir)
    and read back block by block through :class:`specmoe.ExpertStore` with O_DIRECT (where
    the filesystem allows it; the file is also dropped from the page cache), CRC checks on: the
    path a cache miss takes.  The latency is the intercept of the line through the read times
    of ``block_bytes`` and 4 KiB blocks.
    """
    global _CALIBRATED
    if _CALIBRATED is not None and not refresh:
        return _CALIBRATED
    from ..runtime import kernels

    fast_bw, flops = _cpu_expert_rates(expert_shape)
    link_bw, latency = link_fit(4096, _store_read_time(4096, blocks, directory),
                                block_bytes, _store_read_time(block_bytes, blocks, directory))
    _CALIBRATED = Hardware(name="calibrate", fast_bw=fast_bw, link_bw=link_bw,
                           link_latency_s=latency, flops=flops,
                           description=f"measured on this machine by specmoe.sim.calibration.calibrate "
                                       f"(bf16 expert kernel, {kernels.isa()}, "
                                       f"{kernels.num_threads()} threads; ExpertStore reads)")
    return _CALIBRATED


def _cpu_expert_rates(expert_shape: tuple[int, int], flops: bool = True
                      ) -> tuple[float, float | None]:
    """(bytes/s, FLOP/s) of this machine's C expert kernel on one bf16 expert of
    ``expert_shape`` = (H, I): its weight bytes over one batch-1 call (best of 10), and its
    FLOPs on 64 tokens (best of 3; None without ``flops``)."""
    from ..runtime import kernels
    from ..storage import quant

    H, I = expert_shape
    rng = np.random.default_rng(0)
    g = rng.standard_normal((I, H), dtype=np.float32) * 0.02
    d = rng.standard_normal((H, I), dtype=np.float32) * 0.02
    block, entries = kernels.pack_block(quant.expert_tensors(g, g, d, "bf16"))
    spec = kernels.FFNSpec.from_store_schema(entries, block_bytes=block.nbytes)

    def best(x: np.ndarray, reps: int) -> float:
        kernels.ffn(block, x, spec=spec)
        t = float("inf")
        for _ in range(reps):
            t0 = time.perf_counter()
            kernels.ffn(block, x, spec=spec)
            t = min(t, time.perf_counter() - t0)
        return t

    bw = spec.weight_bytes / best(rng.standard_normal((1, H), dtype=np.float32), 10)
    if not flops:
        return bw, None
    return bw, 2 * 3 * H * I * 64 / best(rng.standard_normal((64, H), dtype=np.float32), 3)


def _store_read_time(nbytes: int, blocks: int, directory: str | None) -> float:
    """Mean seconds per block read of a fresh store with ``blocks`` blocks of ``nbytes``."""
    from ..storage.store import ExpertStore, aligned_empty, write_store

    tmp = tempfile.mkdtemp(prefix="specmoe-calib-", dir=directory)
    path = os.path.join(tmp, "calib.smoe")
    try:
        layer = {"w": np.frombuffer(os.urandom(nbytes * blocks), np.uint8).reshape(blocks, nbytes)}
        write_store(path, [layer], progress=False).close()
        with open(path, "rb") as f:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        with ExpertStore(path, direct=True) as st:
            out = aligned_empty(st.block_bytes)
            t0 = time.perf_counter()
            for e in range(blocks):
                st.read_block(0, e, out)
            return (time.perf_counter() - t0) / blocks
    finally:
        if os.path.exists(path):
            os.unlink(path)
        os.rmdir(tmp)
_GPU_CALIBRATED: dict[int, Any] = {}


def calibrate_gpu(device: int = 0, *, expert_shape: tuple[int, int] = (2048, 1408), experts: int = 8,
              top_k: int = 6, repeats: int = 3, refresh: bool = False,
              directory: str | None = None) -> Any:
    """Measure a simulator profile (:class:`specmoe.sim.hardware.Hardware`) of the GPU tier on
    CUDA device ``device``: the GPU counterpart of :func:`specmoe.sim.calibration.calibrate`, and what
    ``get_hardware("calibrate-gpu")`` returns.  Cached per device for the process (``refresh``
    re-measures).  Takes a few seconds; writes two small stores in ``directory`` (default: the
    temp dir) and removes them.

    Every figure is taken through the paths a decode step takes (the time model of
    :mod:`specmoe.sim.hardware`):

    * ``link_bw`` / ``link_latency_s``: demand misses of a :class:`GpuExpertCache`
      (``mode="host"``: pinned host copy, ``cudaMemcpyAsync`` on the copy stream, the compute
      stream waiting on the slot's event), two slots cycled over ``experts`` blocks so every
      acquire misses; wall clock from ``acquire`` to the stream's completion, median per load.
      Measured for bf16 experts of ``expert_shape`` = (hidden H, intermediate I) and for
      4 KiB blocks; the latency is the intercept of the line through the two.
    * ``fast_bw``: the expert's weight bytes over the wall-clock time per expert of
      back-to-back one-token :func:`ffn` calls on a resident slot (``path="auto"``): launch
      work included.
    * ``kernel_overhead_s``: one token's layer call over ``top_k`` resident experts (the
      engine's C path, :class:`ExpertLayers`: routing's device-to-host read, the pass, the
      grouped launches), less ``top_k`` expert calls; 0 if negative (grouped launches can
      cost less than ``top_k`` separate ones).
    * ``flops``: the same expert on 1024 tokens (CUDA events).
    """
    import functools
    import statistics
    import tempfile
    import time

    import torch

    from ..runtime import kernels
    from ..runtime.cuda import ExpertLayers, GpuExpertCache, ffn, ffn_context, load
    from ..storage.store import ExpertStore, write_store

    have = _GPU_CALIBRATED.get(device)
    if have is not None and not refresh:
        return have
    if experts < 3 or top_k < 1 or top_k > experts or repeats < 1:
        raise ValueError(f"need experts >= 3, 1 <= top_k <= experts and repeats >= 1, got "
                         f"experts={experts}, top_k={top_k}, repeats={repeats}")
    load()
    H, I = expert_shape
    dev = torch.device("cuda", device)
    stream = torch.cuda.current_stream(dev)
    gen = torch.Generator().manual_seed(0)

    def bf16(*shape: int) -> Any:
        return (torch.randn(*shape, generator=gen) * 0.02).to(torch.bfloat16)

    def miss_time(st: ExpertStore) -> float:
        """Median seconds of one demand miss (every acquire of two slots cycled over the
        store's experts misses)."""
        cache = GpuExpertCache(st, 2, "lru", device=device, mode="host", prefetch=False)
        try:
            n = st.num_experts * (repeats + 1)
            times = []
            for i in range(n):
                e = i % st.num_experts
                stream.synchronize()
                t0 = time.perf_counter()
                cache.acquire(0, e, stream)
                stream.synchronize()
                t = time.perf_counter() - t0
                cache.release(0, e, stream)
                if i >= st.num_experts:  # the first round warms up
                    times.append(t)
            misses = cache.stats()["misses"]
            if misses != n:
                raise RuntimeError(f"calibrate: {misses} of {n} acquires missed; every one "
                                   "must (two slots cycled over more experts)")
        finally:
            cache.close()
        return statistics.median(times)

    def per_call(fn: Any, n: int) -> float:
        """Wall-clock seconds per call of n back-to-back calls, synchronised at the end."""
        fn()
        stream.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        stream.synchronize()
        return (time.perf_counter() - t0) / n

    tmp = tempfile.mkdtemp(prefix="specmoe-gpu-calib-", dir=directory)
    big, small = os.path.join(tmp, "experts.smoe"), os.path.join(tmp, "small.smoe")
    try:
        layer = {"gate": bf16(experts, I, H), "up": bf16(experts, I, H),
                 "down": bf16(experts, H, I)}
        write_store(big, [layer], top_k=top_k, progress=False).close()
        raw = np.frombuffer(os.urandom(4096 * experts), np.uint8).reshape(experts, 4096)
        write_store(small, [{"w": raw}], progress=False).close()
        with ExpertStore(small) as st:
            t_small = miss_time(st)
            small_bytes = st.block_bytes
        with ExpertStore(big) as st:
            t_big = miss_time(st)
            spec = kernels.FFNSpec.from_store_schema(st.tensors, block_bytes=st.block_bytes)
            link_bw, latency = link_fit(small_bytes, t_small, st.block_bytes, t_big)
            cache = GpuExpertCache(st, experts, "lru", device=device, mode="host",
                                   prefetch=False, top_k=top_k)
            try:
                addrs = [cache.acquire(0, e, stream) for e in range(experts)]
                stream.synchronize()
                for e in range(experts):  # resident and unpinned: nothing evicts them here
                    cache.release(0, e, stream)
                x = torch.randn(1, H, generator=gen).to(dev) * 0.1
                out = torch.zeros_like(x)
                reps = 50 * repeats
                t_expert = per_call(lambda: ffn(addrs[0], spec, x, out=out, stream=stream),
                                    reps)
                ids = torch.arange(top_k, dtype=torch.int64, device=dev).reshape(1, top_k)
                w = torch.full((1, top_k), 1.0 / top_k, device=dev)
                lay = ExpertLayers(cache, spec, top_k)  # the engine's C layer call
                t_layer = per_call(functools.partial(lay.forward, 0, x, ids, w), reps)
                del lay  # before the cache closes
                ffn_context(device, H, I, max_tokens=1024)
                xb = torch.randn(1024, H, generator=gen).to(dev) * 0.1
                outb = torch.zeros_like(xb)
                ffn(addrs[0], spec, xb, out=outb, stream=stream)
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record(stream)
                for _ in range(10 * repeats):
                    ffn(addrs[0], spec, xb, out=outb, stream=stream)
                b.record(stream)
                b.synchronize()
                t_batch = a.elapsed_time(b) / 1e3 / (10 * repeats)
                if cache.stats()["misses"] != experts:
                    raise RuntimeError("calibrate: a resident expert was evicted")
            finally:
                cache.close()
    finally:
        for p in (big, small):
            if os.path.exists(p):
                os.unlink(p)
        os.rmdir(tmp)
    name = torch.cuda.get_device_name(dev)
    prof = Hardware(
        name="calibrate-gpu", fast_bw=spec.weight_bytes / t_expert, link_bw=link_bw,
        link_latency_s=latency,
        flops=2 * 3 * H * I * 1024 / t_batch,
        fast_bytes=float(torch.cuda.get_device_properties(dev).total_memory),
        kernel_overhead_s=max(t_layer - top_k * t_expert, 0.0),
        cpu_bw=_cpu_expert_rates(expert_shape, flops=False)[0],
        description=f"measured by specmoe.sim.calibration.calibrate_gpu on {name}: GpuExpertCache demand "
                    f"misses from pinned host memory, bf16 {H}x{I} expert calls and "
                    f"one layer call of {top_k} resident experts (the engine's C path), launch "
                    f"work included; cpu_bw "
                    f"the host's C expert kernel at one token ({kernels.isa()}, "
                    f"{kernels.num_threads()} threads: the hybrid tier's t_cpu)")
    _GPU_CALIBRATED[device] = prof
    return prof

"""The GPU tier (issue 12): specmoe._cuda.

Two groups:

* bookkeeping of the GPU cache in HOST EMULATION (device=-1: the same C code with memcpy in
  place of cudaMemcpyAsync): counters, residency and bytes against the plain-Python cache
  model of tests/test_cache.py.  Runs wherever specmoe._cuda is built (CI builds it from the
  nvidia-* wheels), no GPU needed.
* GPU tests (FFN kernels against a numpy float64 reference, the CPU kernels and torch; the GPU
  cache's device path; the grouped MoE layer): skip with the reason when torch sees no CUDA
  device or specmoe._cuda cannot run.  They have NOT run in the session that wrote them
  (no GPU was lent); docs/gpu.md says how to run them.
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from specmoe import kernels, quant
from specmoe.store import ExpertStore, write_store

cuda = pytest.importorskip("specmoe.cuda")

try:
    _EXT = cuda.extension()
    _EXT_WHY = ""
except cuda.CudaUnavailable as e:  # not built here, or cuBLAS missing
    _EXT = None
    _EXT_WHY = str(e)

need_ext = pytest.mark.skipif(_EXT is None, reason=f"specmoe._cuda unavailable: {_EXT_WHY}")


def _gpu_reason() -> str:
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    if not torch.cuda.is_available():
        return "no CUDA device: torch.cuda.is_available() is False (GPU tests run on a GPU " \
               "machine, see docs/gpu.md)"
    ok, why = cuda.available()
    return "" if ok else why


_GPU_WHY = _gpu_reason()
need_gpu = pytest.mark.skipif(bool(_GPU_WHY), reason=_GPU_WHY)

NL, NE = 3, 6
ROWS, COLS = 16, 64  # one 4096-byte block per expert


def _layers(seed=0):
    rng = np.random.default_rng(seed)
    return [{"w": rng.standard_normal((NE, ROWS, COLS)).astype(np.float32)} for _ in range(NL)]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    layers = _layers()
    path = tmp_path_factory.mktemp("gcache") / "experts.smoe"
    write_store(path, layers, top_k=1, progress=False).close()
    return path, layers


@pytest.fixture
def store(written):
    st = ExpertStore(written[0])
    yield st
    st.close()


def _host_bytes(addr: int, n: int) -> np.ndarray:
    return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(addr)).copy()


# ---------- build / loader ----------

def test_loader_reports_a_reason_without_a_gpu():
    ok, why = cuda.available()
    if ok:
        assert why  # the device name
    else:
        assert "specmoe._cuda" in why  # names what is missing: not built / cannot load / no GPU
        with pytest.raises(cuda.CudaUnavailable):
            cuda.load()


def test_import_specmoe_does_not_load_cuda():
    import subprocess
    import sys
    code = "import sys, specmoe; print('specmoe._cuda' in sys.modules)"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert r.stdout.strip() == "False"


# ---------- GPU cache bookkeeping, host emulation ----------

def _counters(st):
    return tuple(st[k] for k in ("hits", "misses", "collision_misses", "evictions",
                                 "prefetch_issued", "prefetch_used", "prefetch_wasted",
                                 "prefetch_dropped", "bytes_read"))


@need_ext
@pytest.mark.parametrize("mode", ["host", "staged"])
@pytest.mark.parametrize("name", ["lru", "fifo", "lfu", "least_stale", "spac"])
def test_emulated_gpu_cache_matches_cpu_cache_and_model(store, written, mode, name):
    """Random demand accesses with pins held, pass boundaries, prefetch batches and policy
    swaps, driven in lockstep on the GPU cache's bookkeeping (emulated), the CPU ExpertCache
    (csrc/cache.c) and, for lru and fifo, the plain-Python model of tests/test_cache.py:
    counters and residency equal at every step, and every acquired slot holds the expert's
    bytes as written."""
    from specmoe.cache import ExpertCache
    from tests.test_cache import RefCache, _ref_policy

    nslots = 5
    ref = RefCache(nslots, _ref_policy(name)) if name in ("lru", "fifo") else None
    cpu = ExpertCache(store, nslots, name, top_k=1)
    cache = cuda.GpuExpertCache(store, nslots, name, device=-1, mode=mode, stages=2)
    rng = np.random.default_rng(7)
    held: list[int] = []
    bb = store.block_bytes
    try:
        for step in range(200):
            r = rng.random()
            if r < 0.08:
                for c in (cache, cpu, ref):
                    if c is not None:
                        c.begin_pass()
            elif r < 0.22:
                keys = rng.choice(NL * NE, int(rng.integers(1, 4)), replace=False)
                prios = rng.permutation(len(keys)).astype(float)
                cache.pause_worker(True)
                cache.prefetch([int(k) for k in keys], list(prios))
                cache.pause_worker(False)
                cache.wait_idle()
                cpu.pause_prefetch()
                cpu.prefetch([(int(k) // NE, int(k) % NE, p) for k, p in zip(keys, prios)])
                cpu.resume_prefetch()
                cpu.wait_idle()
                if ref is not None:
                    for i in np.argsort(-prios, kind="stable"):
                        if int(keys[i]) not in ref.where:
                            ref.prefetch(int(keys[i]), pinned=set(held))
            elif r < 0.25:
                cache.set_policy(name)
                cpu.set_policy(name)
                if ref is not None:
                    ref.set_policy(_ref_policy(name))
            elif r < 0.32 and ref is None:  # lookahead-aware eviction (the model has none)
                keys = rng.choice(NL * NE, int(rng.integers(0, 4)), replace=False)
                cache.protect([(int(k) // NE, int(k) % NE) for k in keys])
                cpu.protect([int(k) // NE for k in keys], [int(k) % NE for k in keys])
            else:
                key = int(rng.integers(0, NL * NE))
                l, e = divmod(key, NE)
                if name == "spac":
                    cnt = int(rng.integers(1, 4))
                    cache.counts([key], [cnt])
                    cpu.observe_counts([l], [e], [cnt])
                addr = cache.acquire(l, e)
                cpu.acquire(l, e)
                if ref is not None:
                    ref.access(key, pinned=set(held))
                t = store.tensors_of(_host_bytes(addr, bb))
                np.testing.assert_array_equal(t["w"], written[1][l]["w"][e])
                held.append(key)
                while len(held) > 2 or (held and rng.random() < 0.5):
                    k = held.pop(0)
                    cache.release(k // NE, k % NE)
                    cpu.release(k // NE, k % NE)
            res = cache.resident()
            assert res == [l * NE + e for l, e in cpu.resident()], f"step {step}"
            st = cache.stats()
            assert _counters(st) == _counters(cpu.stats()), f"step {step}"
            assert st["protected_evictions"] == cpu.stats()["protected_evictions"], f"step {step}"
            if ref is not None:
                assert sorted(res) == sorted(ref.resident()), f"step {step}"
                assert _counters(st)[:8] == (ref.hits, ref.misses, ref.collisions,
                                             ref.evictions, ref.issued, ref.used, ref.wasted,
                                             ref.dropped), f"step {step}"
        assert st["bytes_read"] == (st["misses"] + st["prefetch_issued"]) * bb
        assert st["misses"] > 40 and st["prefetch_issued"] > 5 and st["evictions"] > 20
    finally:
        for k in held:
            cache.release(k // NE, k % NE)
            cpu.release(k // NE, k % NE)
        cache.close()
        cpu.close()


@need_ext
def test_emulated_gpu_cache_protect_bad_input(store):
    c = cuda.GpuExpertCache(store, 3, device=-1, prefetch=False)
    try:
        with pytest.raises(TypeError, match="integers"):
            c.protect([1.5])
        with pytest.raises(ValueError):
            c.protect([NL * NE])  # outside the store's keys
        c.protect([(0, 1), 2])
        c.protect()  # clears
    finally:
        c.close()


@need_ext
def test_emulated_gpu_cache_bad_input(store):
    with pytest.raises(ValueError, match="mode"):
        cuda.GpuExpertCache(store, 4, device=-1, mode="disk")
    with pytest.raises(ValueError, match="unknown eviction policy"):
        cuda.GpuExpertCache(store, 4, "nope", device=-1)
    with pytest.raises(TypeError, match="policy name"):
        cuda.GpuExpertCache(store, 4, object(), device=-1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="top_k"):
        cuda.GpuExpertCache(store, 2, device=-1, top_k=3)
    with pytest.raises(ValueError, match="device"):
        cuda.GpuExpertCache(store, 2, device=-2)
    c = cuda.GpuExpertCache(store, 3, device=-1, prefetch=False)
    with pytest.raises(ValueError, match="out of range"):
        c.acquire(NL, 0)
    with pytest.raises(Exception, match="not pinned"):
        c.release(0, 0)
    with pytest.raises(Exception, match="no running prefetch worker"):
        c.prefetch([1])
    c.close()
    with pytest.raises(Exception, match="closed"):
        c.acquire(0, 0)


@need_ext
def test_emulated_spac_counts_drive_prefetch_refusal(store):
    """Under spac the prefetcher never evicts a slot of higher utility than the request
    (cache.h); fed counts make resident experts more useful than the requested one."""
    cache = cuda.GpuExpertCache(store, 2, "spac", device=-1)
    try:
        for e in (0, 1):
            cache.release(0, e) if cache.acquire(0, e) else None
        cache.begin_pass()
        cache.counts([0, 1, 2], [5, 5, 0])  # layer 0 observed: keys 0, 1 hot; key 2 cold
        cache.prefetch([2], [1.0])
        cache.wait_idle()
        assert sorted(cache.resident()) == [0, 1]
        assert cache.stats()["prefetch_dropped"] == 1
    finally:
        cache.close()


# ---------- GPU: FFN kernels ----------

def _ref_ffn(tensors, x, activation):
    w = {k: v.astype(np.float64) for k, v in quant.dequantize_expert(tensors).items()}
    x = x.astype(np.float64)
    g = x @ w["gate"].T + w.get("gate.bias", 0.0)
    u = x @ w["up"].T + w.get("up.bias", 0.0)
    if activation == "silu":
        a = g / (1.0 + np.exp(-g)) * u
    else:
        g = np.minimum(g, 7.0)
        u = np.clip(u, -7.0, 7.0)
        a = (u + 1.0) * g / (1.0 + np.exp(-1.702 * g))
    return a @ w["down"].T + w.get("down.bias", 0.0)


def _expert(seed, H, I, dtype, bias):
    rng = np.random.default_rng(seed)
    g = (rng.standard_normal((I, H)) * 0.05).astype(np.float32)
    u = (rng.standard_normal((I, H)) * 0.05).astype(np.float32)
    d = (rng.standard_normal((H, I)) * 0.05).astype(np.float32)
    b = None
    if bias:
        b = {"gate": (rng.standard_normal(I) * 0.5).astype(np.float32),
             "up": (rng.standard_normal(I) * 0.5).astype(np.float32),
             "down": (rng.standard_normal(H) * 0.1).astype(np.float32)}
    return quant.expert_tensors(g, u, d, dtype, b)


@need_gpu
@pytest.mark.parametrize("dtype", ["f32", "bf16", "int8", "int4"])
@pytest.mark.parametrize("activation", ["silu", "gptoss"])
@pytest.mark.parametrize("T", [1, 5, 300])
@pytest.mark.parametrize("path", ["dequant", "auto"])
def test_gpu_ffn_matches_reference_and_cpu(dtype, activation, T, path):
    import torch

    H, I = 256, 384
    tensors = _expert(3, H, I, dtype, bias=activation == "gptoss")
    block, entries = kernels.pack_block(tensors)
    spec = kernels.FFNSpec.from_store_schema(entries, block_bytes=block.nbytes,
                                             activation=activation, precise=path == "dequant")
    rng = np.random.default_rng(4)
    N = T + 3
    x = rng.standard_normal((N, H)).astype(np.float32)
    rows = rng.integers(0, N, T).astype(np.int32)
    rows[-1] = rows[0]  # a repeated row accumulates twice
    scale = rng.random(T).astype(np.float32)
    want = np.zeros((N, H))
    ref = _ref_ffn(tensors, x[rows], activation)
    for t in range(T):
        want[rows[t]] += scale[t] * ref[t]
    cpu = kernels.ffn(block, x, spec=spec, rows=rows, scale=scale, precise=True)
    dev = torch.device("cuda", 0)
    out = cuda.ffn(torch.from_numpy(block).to(dev), spec, torch.from_numpy(x).to(dev),
                   rows=torch.from_numpy(rows).to(dev), scale=torch.from_numpy(scale).to(dev),
                   path=path)
    got = out.cpu().numpy()
    tol = 2e-3 if (path == "auto" and dtype == "bf16") else 1e-4  # bf16 x/act rounding
    scale_ref = np.abs(want).max()
    assert np.abs(got - want).max() <= tol * scale_ref + 1e-6
    if path == "dequant":  # same math as the CPU precise path, only summation order differs
        np.testing.assert_allclose(got, cpu, rtol=1e-4, atol=1e-5 * scale_ref)


@need_gpu
def test_gpu_ffn_bad_input():
    import torch

    tensors = _expert(1, 64, 64, "int8", bias=False)
    block, entries = kernels.pack_block(tensors)
    spec = kernels.FFNSpec.from_store_schema(entries, block_bytes=block.nbytes)
    dev = torch.device("cuda", 0)
    b = torch.from_numpy(block).to(dev)
    x = torch.zeros(2, 64, device=dev)
    with pytest.raises(ValueError, match="path"):
        cuda.ffn(b, spec, x, path="fast")
    with pytest.raises(ValueError, match="cuBLAS path"):
        cuda.ffn(b, spec, x, path="cublas")
    with pytest.raises(ValueError, match="x must"):
        cuda.ffn(b, spec, x.double())
    with pytest.raises(ValueError, match="block has"):
        cuda.ffn(b[:100], spec, x)


# ---------- GPU: cache on the device, grouped MoE layer ----------

@need_gpu
@pytest.mark.parametrize("mode", ["host", "staged"])
def test_gpu_cache_slots_hold_the_store_blocks(store, written, mode):
    import torch

    cache = cuda.GpuExpertCache(store, 4, "lru", device=0, mode=mode)
    bb = store.block_bytes
    try:
        s = torch.cuda.current_stream()
        for key in [0, 5, 7, 0, 11, 13, 5, 2]:
            l, e = divmod(key, NE)
            addr = cache.acquire(l, e, s)
            # copy the slot out on the same stream: ordered after the slot's copy by the event
            dst = torch.empty(bb, dtype=torch.uint8, device="cuda")
            cuda.load().memcpy_async(dst.data_ptr(), addr, bb, s.cuda_stream)
            cache.release(l, e, s)
            got = store.tensors_of(dst.cpu().numpy())
            np.testing.assert_array_equal(got["w"], written[1][l]["w"][e])
        cache.prefetch([1, 3], [1.0, 2.0])
        cache.wait_idle()
        assert cache.stats()["prefetch_issued"] == 2
    finally:
        cache.close()


@need_gpu
def test_gpu_moe_forward_matches_reference(tmp_path):
    import torch

    H, I, E, L, K = 128, 256, 8, 2, 2
    rng = np.random.default_rng(5)
    experts = [[_expert(100 * l + e, H, I, "int4", bias=False) for e in range(E)]
               for l in range(L)]
    layers = [{n: np.stack([experts[l][e][n] for e in range(E)]) for n in experts[l][0]}
              for l in range(L)]
    path = tmp_path / "moe.smoe"
    write_store(path, layers, top_k=K, progress=False).close()
    with ExpertStore(path) as st:
        spec = kernels.FFNSpec.from_store_schema(st.tensors, block_bytes=st.block_bytes)
        cache = cuda.GpuExpertCache(st, 5, "lru", device=0, top_k=K)
        try:
            T = 7
            x = rng.standard_normal((T, H)).astype(np.float32)
            ids = np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int64)
            w = rng.random((T, K)).astype(np.float32)
            for layer in range(L):
                want = np.zeros((T, H))
                for t in range(T):
                    for j in range(K):
                        want[t] += w[t, j] * _ref_ffn(experts[layer][ids[t, j]], x[t:t + 1],
                                                      "silu")[0]
                got = cuda.moe_forward(cache, spec, layer, torch.from_numpy(x).cuda(),
                                       torch.from_numpy(ids).cuda(), torch.from_numpy(w).cuda())
                np.testing.assert_allclose(got.cpu().numpy(), want, rtol=1e-4,
                                           atol=1e-4 * np.abs(want).max())
        finally:
            cache.close()

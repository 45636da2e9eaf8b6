"""Expert-parallel MoE layers (csrc/moe.h): decode-sized calls whose source can pin every expert
at once run a whole expert per thread (smoe_ffn_forward_many) instead of splitting each
expert's rows across the threads.  Checked against a numpy reference on the dequantized
weights, bit for bit against the one-expert-at-a-time path, and on a failing load."""
from __future__ import annotations

import numpy as np
import pytest

from specmoe import _C
from specmoe.storage import quant
from specmoe.runtime.cache import ExpertCache
from specmoe.runtime.kernels import FFNSpec
from specmoe.storage.store import ExpertStore, write_store

L, E, H, I, K = 2, 8, 128, 128, 4  # H, I multiples of 128: the fast bf16/int4 paths too


def _layers(seed):
    rng = np.random.default_rng(seed)
    return [[(rng.standard_normal((I, H), dtype=np.float32) * 0.1,
              rng.standard_normal((I, H), dtype=np.float32) * 0.1,
              rng.standard_normal((H, I), dtype=np.float32) * 0.1) for _ in range(E)]
            for _ in range(L)]


def _write(path, dtype, seed=0):
    layers = []
    for per_layer in _layers(seed):
        per = [quant.expert_tensors(g, u, d, dtype) for g, u, d in per_layer]
        layers.append({n: np.stack([p[n] for p in per]) for n in per[0]})
    return write_store(path, layers, top_k=K, progress=False,
                       dtypes=quant.store_dtypes(layers[0]))


@pytest.fixture(scope="module", params=["f32", "bf16", "int4"])
def store(request, tmp_path_factory):
    st = _write(tmp_path_factory.mktemp("ep") / f"{request.param}.smoe", request.param)
    yield st, request.param
    st.close()


def _inputs(T, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, H), dtype=np.float32)
    idx = np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int64)
    w = rng.random((T, K), dtype=np.float32)
    return x, idx, w


def _reference(st, pos, x, idx, w):
    """numpy f32 on the dequantized weights: sum_j w[t, j] * FFN_idx[t, j](x[t]), SiLU."""
    out = np.zeros((x.shape[0], H))
    for t in range(x.shape[0]):
        for j in range(K):
            ft = quant.dequantize_expert(st.read_expert(pos, int(idx[t, j])))
            xt = x[t].astype(np.float64)
            g, u = ft["gate"] @ xt, ft["up"] @ xt
            out[t] += w[t, j] * (ft["down"] @ (g / (1 + np.exp(-g)) * u))
    return out


def _run(source, ctx, desc, bb, pos, x, idx, w):
    out = np.empty_like(x)
    used = np.zeros(E, np.uint8)
    _C.moe_forward(source, ctx, desc, bb, pos, E, x, idx, w, out, used)
    return out, used


@pytest.mark.parametrize("T", [1, 2, 9])
def test_parallel_equals_one_at_a_time(store, T):
    store, dtype = store
    """1-2 tokens (at most 4 per expert, at least 2 experts): expert-parallel on a 2-thread
    context with a source that can pin every expert (a resident buffer, a cache with a slot
    for every expert); the same call on 1 thread, and through a cache too small to pin them
    all, takes experts one at a time.  Outputs are bit-identical and match numpy.  9 tokens
    route more than 4 to some expert: one at a time everywhere."""
    desc = FFNSpec.from_store_schema(store.tensors, int(store.block_bytes)).desc()
    bb = int(store.block_bytes)
    buf = store.read_all()
    full = ExpertCache(store, L * E, "lru", top_k=K, prefetch=False)
    part = ExpertCache(store, K + 1, "lru", top_k=K, prefetch=False)
    k1, k2 = _C.KernelContext(1), _C.KernelContext(2)
    try:
        x, idx, w = _inputs(T, seed=T)
        ep = T <= 2 and np.bincount(idx.ravel(), minlength=E).max() <= 4
        runs = {}
        for name, src, ctx in [("buffer/2", buf, k2), ("cache-all/2", full._c, k2),
                               ("cache-part/2", part._c, k2), ("buffer/1", buf, k1)]:
            before = ctx.parallel_calls
            runs[name] = _run(src, ctx, desc, bb, 1, x, idx, w)
            went_parallel = ctx.parallel_calls - before
            want = ep and name in ("buffer/2", "cache-all/2")
            assert went_parallel == int(want), (name, went_parallel)
        base, used = runs["buffer/1"]
        for name, (out, u) in runs.items():
            np.testing.assert_array_equal(out, base, err_msg=name)
            np.testing.assert_array_equal(u, used)
        assert set(np.flatnonzero(used)) == set(idx.ravel().tolist())
        tol = {"f32": 1e-5, "bf16": 1e-2, "int4": 3e-2}[dtype]  # the fast paths' bounds
        ref = _reference(store, 1, x, idx, w)
        assert np.linalg.norm(base - ref) <= tol * np.linalg.norm(ref)
        # every pin was dropped: each used expert can be evicted by the partial cache's reuse
        for e in np.flatnonzero(used):
            with pytest.raises(Exception, match="not pinned"):
                full.release(1, int(e))
    finally:
        full.close()
        part.close()


def test_failed_load_releases_the_pins(tmp_path):
    """A block that fails its checksum while the other experts of the call are already pinned:
    the call raises, every pin it took is dropped, and the cache serves the next call."""
    st = _write(tmp_path / "s.smoe", "f32")
    bb, off = int(st.block_bytes), int(st.data_offset)
    st.close()
    x, idx, w = _inputs(1, seed=3)
    bad = int(idx.max())  # pinned last in ascending order: the others are held by then
    with open(tmp_path / "s.smoe", "r+b") as f:
        f.seek(off + (1 * E + bad) * bb + 8)
        b = f.read(1)
        f.seek(off + (1 * E + bad) * bb + 8)
        f.write(bytes([b[0] ^ 0xFF]))
    st = ExpertStore(tmp_path / "s.smoe", verify=True)
    desc = FFNSpec.from_store_schema(st.tensors, bb).desc()
    cache = ExpertCache(st, L * E, "lru", top_k=K, prefetch=False)
    k2 = _C.KernelContext(2)
    try:
        with pytest.raises(Exception, match="(?i)checksum|crc|corrupt"):
            _run(cache._c, k2, desc, bb, 1, x, idx, w)
        for e in idx.ravel():
            with pytest.raises(Exception, match="not pinned"):
                cache.release(1, int(e))
        good = np.array([[e for e in range(E) if e != bad][:K]], np.int64)
        before = k2.parallel_calls
        out, _ = _run(cache._c, k2, desc, bb, 1, x, good, w)
        assert k2.parallel_calls == before + 1 and np.isfinite(out).all()
    finally:
        cache.close()
        st.close()

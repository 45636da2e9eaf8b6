"""SpecMD miss handling and cache-aware routing on the per-layer C path (csrc/layer.h step 4)
and the link throttle of the cache (csrc/cache.h), each against a plain numpy re-implementation
of the same rule: the reference decides which expert serves each (token, slot) pair with which
weight, and the output is then computed by _C.moe_forward over a resident buffer of every block
(a dropped pair gets weight 0, which adds exactly 0)."""
from __future__ import annotations

import time

import numpy as np
import pytest

from specmoe import _C
from specmoe.storage import quant
from specmoe.runtime.cache import ExpertCache
from specmoe.runtime.kernels import FFNSpec
from specmoe.storage.store import write_store
from specmoe.runtime.experts import SpecmoeExperts

L, E, H, I, K = 2, 12, 64, 64, 4  # int2 needs multiples of 64


def _write(path, dtype, seed=0):
    rng = np.random.default_rng(seed)
    layers = []
    for _ in range(L):
        per = [quant.expert_tensors(rng.standard_normal((I, H), dtype=np.float32) * 0.2,
                                    rng.standard_normal((I, H), dtype=np.float32) * 0.2,
                                    rng.standard_normal((H, I), dtype=np.float32) * 0.2, dtype)
               for _ in range(E)]
        layers.append({n: np.stack([p[n] for p in per]) for n in per[0]})
    return write_store(path, layers, top_k=K, progress=False)


def _resident(st):
    bb = int(st.block_bytes)
    return st.read_all(), FFNSpec.from_store_schema(st.tensors, bb).desc(), bb


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    d = tmp_path_factory.mktemp("misses")
    full, low = _write(d / "f32.smoe", "f32"), _write(d / "int4.smoe", "int4")
    yield full, _resident(full), _resident(low)
    full.close()
    low.close()


@pytest.fixture(scope="module")
def int2buf(tmp_path_factory):
    """The int2 copy of the same experts as `stores` (same seed)."""
    st = _write(tmp_path_factory.mktemp("misses2") / "int2.smoe", "int2")
    yield _resident(st)
    st.close()


def _routers(seed=1):
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal((E, H), dtype=np.float32),
             rng.standard_normal(E, dtype=np.float32) * 0.1, None) for _ in range(L)]


def _make(full, routers, resident, capacity=8):
    """A cache holding exactly `resident` (layer, expert) pairs, prefetch off."""
    cache = ExpertCache(full, capacity, "lru", top_k=K)
    for p, e in resident:
        cache.acquire(p, e)
        cache.release(p, e)
    desc = FFNSpec.from_store_schema(full.tensors, int(full.block_bytes)).desc()
    lay = _C.Layers(cache, None, desc, routers, K)
    lay.configure(False, 1.0, 0.0, False)
    cache.reset_stats()
    return cache, lay


def _inputs(routers, pos, T, seed=2):
    """x, and the model's own routing: top-k of the logits, weights = softmax renormalised over
    the top-k (the norm_topk_prob convention)."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, H), dtype=np.float32)
    z = _logits(routers, pos, x)
    idx = np.argsort(-z, axis=1, kind="stable")[:, :K].astype(np.int64)
    p = _softmax(z)
    w = np.take_along_axis(p, idx, 1)
    w = (w / w.sum(1, keepdims=True)).astype(np.float32)
    return x, idx, w


def _logits(routers, pos, x):
    wr, b, _ = routers[pos]
    return x.astype(np.float64) @ wr.T.astype(np.float64) + b


def _softmax(z):
    p = np.exp(z - z.max(1, keepdims=True))
    return p / p.sum(1, keepdims=True)


def _moe(buf_desc_bb, pos, x, idx, w):
    buf, desc, bb = buf_desc_bb
    out = np.empty_like(x)
    _C.moe_forward(buf, None, desc, bb, pos, E, x, idx, w.astype(np.float32), out)
    return out


def _run(lay, pos, x, idx, w):
    out = np.empty_like(x)
    used = np.zeros(E, np.uint8)
    lay.forward(pos, x, idx, w, out, used)
    return out, used


# ---- the reference rules ----------------------------------------------------------------------

def ref_drop(idx, w, res, keep):
    """SpecMD drop: a missing expert is skipped unless some token ranks it (by weight, ties by
    slot) in its top `keep`; then it is fetched and serves every token."""
    need = set()
    for t in range(idx.shape[0]):
        order = sorted(range(K), key=lambda j: (-w[t, j], j))
        for r, j in enumerate(order):
            if r < keep and not res[idx[t, j]]:
                need.add(int(idx[t, j]))
    w2 = w.copy()
    for t in range(idx.shape[0]):
        for j in range(K):
            e = int(idx[t, j])
            if not res[e] and e not in need:
                w2[t, j] = 0.0
    return w2, need


def ref_substitute(idx, z, res):
    idx2 = idx.copy()
    n = 0
    for t in range(idx.shape[0]):
        have = set(int(e) for e in idx[t])
        for j in range(K):
            e = int(idx[t, j])
            if res[e]:
                continue
            cands = [c for c in range(E) if res[c] and c not in have]
            if not cands:
                continue
            c = min(cands, key=lambda c: (abs(z[t, c] - z[t, e]), c))
            idx2[t, j] = c
            have.add(c)
            n += 1
    return idx2, n


def ref_route(idx, w, z, res, lam, hist):
    """Eq. 1 of SpecMD, z' = z + lambda * Delta_avg * 1_C, with Delta_avg the running mean of the
    per-token logit range (hist: [sum, n], updated); the new set is the top-k of z' (the test
    inputs route by the top-k of z, so the C rule's swaps must give exactly that), weights of
    the newcomers from the unmodified probabilities scaled like the model's own."""
    p = _softmax(z)
    idx2, w2 = idx.copy(), w.copy()
    moved = 0
    for t in range(idx.shape[0]):
        hist[0] += z[t].max() - z[t].min()
        hist[1] += 1
        zp = z[t] + lam * hist[0] / hist[1] * res
        new = set(np.argsort(-zp, kind="stable")[:K].tolist())
        old = [int(e) for e in idx[t]]
        c = w[t].sum() / p[t, old].sum()
        gone = [j for j in range(K) if old[j] not in new]
        come = sorted(new - set(old), key=lambda e: -zp[e])
        # C swaps the lowest-scoring leaver for the best newcomer first
        gone.sort(key=lambda j: z[t, old[j]])
        for j, e in zip(gone, come):
            idx2[t, j] = e
            w2[t, j] = c * p[t, e]
            moved += 1
    return idx2, w2, moved


# ---- tests ---------------------------------------------------------------------------------------

RES = [(0, 0), (0, 3), (0, 5), (0, 7), (0, 9), (1, 2)]


def _mask(pos):
    m = np.zeros(E, bool)
    for p, e in RES:
        if p == pos:
            m[e] = True
    return m


def test_fetch_is_unchanged(stores):
    full, fullbuf, _ = stores
    routers = _routers()
    cache, lay = _make(full, routers, RES)
    x, idx, w = _inputs(routers, 0, 6)
    out, _ = _run(lay, 0, x, idx, w)
    np.testing.assert_array_equal(out, _moe(fullbuf, 0, x, idx, w))
    c = lay.counters()
    assert c["missing"] == 0 and c["dropped"] == 0  # step 4 off: nothing counted
    cache.close()


@pytest.mark.parametrize("keep", [0, 1, 2, K])
def test_drop_matches_reference(stores, keep):
    full, fullbuf, _ = stores
    routers = _routers()
    cache, lay = _make(full, routers, RES, capacity=12)
    lay.set_miss("drop", keep, 0.0)
    x, idx, w = _inputs(routers, 0, 6)
    res = _mask(0)
    w_ref, need = ref_drop(idx, w, res, keep)
    out, used = _run(lay, 0, x, idx, w)
    np.testing.assert_allclose(out, _moe(fullbuf, 0, x, idx, w_ref), rtol=1e-5, atol=1e-6)
    c = lay.counters()
    assert c["missing"] == int((~res[idx]).sum())
    assert c["dropped"] == int(((~res[idx]) & (w_ref == 0)).sum())
    assert cache.stats()["misses"] == len(need)  # only the kept ranks were fetched
    assert set(np.flatnonzero(used)) == set(int(e) for e in idx[w_ref != 0])
    if keep == K:
        assert c["dropped"] == 0
    if keep == 0:
        assert cache.stats()["misses"] == 0
    cache.close()


def test_substitute_matches_reference(stores):
    full, fullbuf, _ = stores
    routers = _routers()
    cache, lay = _make(full, routers, RES)
    lay.set_miss("substitute", 2, 0.0)
    x, idx, w = _inputs(routers, 0, 6)
    res = _mask(0)
    z = _logits(routers, 0, x)
    idx_ref, n = ref_substitute(idx, z, res)
    assert n > 0
    out, _ = _run(lay, 0, x, idx, w)
    np.testing.assert_allclose(out, _moe(fullbuf, 0, x, idx_ref, w), rtol=1e-5, atol=1e-6)
    assert lay.counters()["substituted"] == n
    assert cache.stats()["misses"] == 0
    # layer 1 has one resident expert: tokens whose every expert misses get it once, the
    # rest of their misses are fetched
    x1, idx1, w1 = _inputs(routers, 1, 4, seed=5)
    idx1_ref, _ = ref_substitute(idx1, _logits(routers, 1, x1), _mask(1))
    out1, _ = _run(lay, 1, x1, idx1, w1)
    np.testing.assert_allclose(out1, _moe(fullbuf, 1, x1, idx1_ref, w1), rtol=1e-5, atol=1e-6)
    cache.close()


def test_lowest_bit_matches_reference(stores):
    full, fullbuf, lowbuf = stores
    routers = _routers()
    cache, lay = _make(full, routers, RES)
    with pytest.raises(ValueError, match="low-bit copy"):
        lay.set_miss("lowest_bit", 2, 0.0)  # nothing to compute from yet
    lay.set_lowbit(*lowbuf)
    lay.set_miss("lowest_bit", 2, 0.0)
    x, idx, w = _inputs(routers, 0, 6)
    res = _mask(0)
    hit = res[idx]
    ref = _moe(fullbuf, 0, x, idx, np.where(hit, w, 0)) + \
        _moe(lowbuf, 0, x, idx, np.where(hit, 0, w))
    out, used = _run(lay, 0, x, idx, w)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    assert lay.counters()["lowbit"] == int((~hit).sum()) > 0
    assert cache.stats()["misses"] == 0
    assert set(np.flatnonzero(used)) == set(idx.ravel().tolist())
    with pytest.raises(_C.CacheError if hasattr(_C, "CacheError") else Exception):
        lay.set_lowbit(None)  # in use
    lay.set_miss("fetch", 2, 0.0)
    lay.set_lowbit(None)
    cache.close()


@pytest.mark.parametrize("keep", [0, 1, 2])
def test_priority_matches_reference(stores, keep):
    """fetch-priority: the missing experts some token ranks in its top `keep` are fetched at
    full precision (drop's rule, ref_drop), the other missing pairs come from the int4 copy."""
    full, fullbuf, lowbuf = stores
    routers = _routers()
    cache, lay = _make(full, routers, RES, capacity=12)
    with pytest.raises(ValueError, match="priority needs a resident"):
        lay.set_miss("priority", keep, 0.0)
    lay.set_lowbit(*lowbuf)
    lay.set_miss("priority", keep, 0.0)
    x, idx, w = _inputs(routers, 0, 6)
    res = _mask(0)
    w_full, need = ref_drop(idx, w, res, keep)  # pairs served at full precision
    ref = _moe(fullbuf, 0, x, idx, w_full) + _moe(lowbuf, 0, x, idx, w - w_full)
    out, used = _run(lay, 0, x, idx, w)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    c = lay.counters()
    assert c["missing"] == int((~res[idx]).sum())
    assert c["lowbit"] == int(((~res[idx]) & (w_full == 0)).sum())
    assert c["dropped"] == 0
    assert cache.stats()["misses"] == len(need)
    assert set(np.flatnonzero(used)) == set(idx.ravel().tolist())
    if keep == 0:
        assert cache.stats()["misses"] == 0 and c["lowbit"] == c["missing"] > 0
    with pytest.raises(Exception, match="in use by miss mode priority"):
        lay.set_lowbit(None)
    lay.set_miss("fetch", 2, 0.0)
    lay.set_lowbit(None)
    cache.close()


def _rank(w, t, j):
    """Rank of slot j among token t's weights (descending, ties by slot), as the C rule."""
    return sorted(range(K), key=lambda q: (-w[t, q], q)).index(j)


@pytest.mark.parametrize("keep,keep2", [(1, 2), (0, 2), (1, 1), (2, 3), (1, K)])
def test_priority_three_levels_matches_reference(stores, int2buf, keep, keep2):
    """SpecMD's int8 -> int4 -> int2 cascade: fetched as drop's rule keeps (ranks < keep),
    then per pair by its own rank: ranks < keep2 from copy 0 (int4), the rest from copy 1
    (int2); keep2 = K is the two-level mode."""
    full, fullbuf, lowbuf = stores
    routers = _routers()
    cache, lay = _make(full, routers, RES, capacity=12)
    lay.set_lowbit(*lowbuf)
    if keep2 < K:
        with pytest.raises(ValueError, match="needs a second resident low-bit copy"):
            lay.set_miss("priority", keep, 0.0, keep2=keep2)
    with pytest.raises(Exception, match="set low-bit copy 0 before copy 1"):
        lay.set_lowbit(None)
        lay.set_lowbit(*int2buf, level=1)
    lay.set_lowbit(*lowbuf)
    lay.set_lowbit(*int2buf, level=1)
    lay.set_miss("priority", keep, 0.0, keep2=keep2)
    x, idx, w = _inputs(routers, 0, 6)
    res = _mask(0)
    w_full, need = ref_drop(idx, w, res, keep)
    low = np.array([[w_full[t, j] == 0 and _rank(w, t, j) >= keep2 for j in range(K)]
                    for t in range(idx.shape[0])])
    w4 = np.where((w_full == 0) & ~low, w, 0).astype(np.float32)
    w2 = np.where(low, w, 0).astype(np.float32)
    ref = _moe(fullbuf, 0, x, idx, w_full) + _moe(lowbuf, 0, x, idx, w4) + \
        _moe(int2buf, 0, x, idx, w2)
    out, used = _run(lay, 0, x, idx, w)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    c = lay.counters()
    assert c["lowbit"] == int((w_full == 0).sum()) and c["lowbit2"] == int(low.sum())
    assert cache.stats()["misses"] == len(need)
    assert set(np.flatnonzero(used)) == set(idx.ravel().tolist())
    if (keep, keep2) in [(1, 2), (0, 2)]:
        assert 0 < c["lowbit2"] < c["lowbit"]  # both low-bit levels served something
    if keep2 < K:
        with pytest.raises(Exception, match="low-bit copy 1 is in use"):
            lay.set_lowbit(None, level=1)
    with pytest.raises(ValueError, match="miss_keep2"):
        lay.set_miss("priority", keep, 0.0, keep2=K + 1)
    lay.set_miss("fetch", 2, 0.0)
    with pytest.raises(Exception, match="remove low-bit copy 1 before copy 0"):
        lay.set_lowbit(None, level=0)
    lay.set_lowbit(None, level=1)
    lay.set_lowbit(None)
    cache.close()


@pytest.mark.parametrize("mode", ["drop", "priority"])
def test_draft_tokens_with_rank_modes(stores, int2buf, mode):
    """Draft tokens under drop and three-level priority: the kept ranks come from the real
    tokens only; a draft pair is at full precision when its expert is resident or fetched for
    a real token, else from low-bit copy 0 (never copy 1, never a load)."""
    full, fullbuf, lowbuf = stores
    routers = _routers()
    cache, lay = _make(full, routers, RES, capacity=12)
    lay.set_lowbit(*lowbuf)
    lay.set_lowbit(*int2buf, level=1)
    lay.set_miss(mode, 1, 0.0, keep2=2 if mode == "priority" else K)
    x, idx, w = _inputs(routers, 0, 8)
    draft = np.array([0, 1, 1, 0, 1, 0, 1, 1], bool)
    res = _mask(0)
    real = ~draft
    w_real_full, need = ref_drop(idx[real], w[real], res, 1)
    served = res[idx] | np.isin(idx, list(need))  # full precision, any token
    w_full = np.where(served, w, 0).astype(np.float32)
    w4 = np.zeros_like(w)
    w2 = np.zeros_like(w)
    for t in range(8):
        for j in range(K):
            if served[t, j]:
                continue
            if draft[t]:
                w4[t, j] = w[t, j]
            elif mode == "priority":
                (w4 if _rank(w, t, j) < 2 else w2)[t, j] = w[t, j]
    ref = _moe(fullbuf, 0, x, idx, w_full) + _moe(lowbuf, 0, x, idx, w4) + \
        _moe(int2buf, 0, x, idx, w2)
    out = np.empty_like(x)
    used = np.zeros(E, np.uint8)
    lay.forward(0, x, idx, w, out, used, None, True, draft.astype(np.uint8))
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    c = lay.counters()
    assert c["lowbit"] == int((w4 != 0).sum() + (w2 != 0).sum())
    assert c["lowbit2"] == int((w2 != 0).sum())
    assert c["draft_kept"] == int((~served & draft[:, None]).sum()) > 0
    assert c["dropped"] == (int((~served & real[:, None]).sum()) if mode == "drop" else 0)
    assert cache.stats()["misses"] == len(need)
    lay.set_miss("fetch", 2, 0.0)
    cache.close()


@pytest.mark.parametrize("lowbit", [False, True])
def test_draft_tokens_never_fetch(stores, lowbit):
    """Draft tokens (the MTP masks): a missing expert of a draft token is not loaded for it --
    full precision only when resident or fetched for a real token, else the int4 copy (when
    there is one) or nothing; real tokens are served as usual."""
    full, fullbuf, lowbuf = stores
    routers = _routers()
    cache, lay = _make(full, routers, RES, capacity=12)
    if lowbit:
        lay.set_lowbit(*lowbuf)
    x, idx, w = _inputs(routers, 0, 8)
    draft = np.array([0, 1, 1, 0, 1, 0, 1, 1], np.uint8)
    res = _mask(0)
    fetched = {int(e) for t in range(8) if not draft[t] for e in idx[t]}  # fetch mode: all
    served = res[idx] | np.isin(idx, list(fetched))   # pairs at full precision
    w_full = np.where(served, w, 0).astype(np.float32)
    ref = _moe(fullbuf, 0, x, idx, w_full)
    if lowbit:
        ref = ref + _moe(lowbuf, 0, x, idx, w - w_full)
    out = np.empty_like(x)
    used = np.zeros(E, np.uint8)
    lay.forward(0, x, idx, w, out, used, None, True, draft)
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)
    c = lay.counters()
    kept = int((~served).sum())
    assert kept > 0 and c["draft_kept"] == kept
    assert c["lowbit"] == (kept if lowbit else 0) and c["dropped"] == (0 if lowbit else kept)
    assert cache.stats()["misses"] == len([e for e in fetched if not res[e]])
    with pytest.raises(ValueError, match="shape"):
        lay.forward(0, x, idx, w, out, used, None, True, draft[:3])
    cache.close()


def test_cache_aware_routing_matches_reference(stores):
    full, fullbuf, _ = stores
    routers = _routers()
    cache, lay = _make(full, routers, RES)
    lam = 0.3
    lay.set_miss("fetch", 2, lam)
    hist = [0.0, 0]
    moved_all = 0
    for seed in (2, 3):  # Delta_avg carries over between calls; the fetches change the cache
        res = np.zeros(E, bool)
        res[[e for p, e in cache.resident() if p == 0]] = True
        x, idx, w = _inputs(routers, 0, 6, seed=seed)
        z = _logits(routers, 0, x)
        idx_ref, w_ref, moved = ref_route(idx, w, z, res, lam, hist)
        moved_all += moved
        out, used = _run(lay, 0, x, idx, w)
        np.testing.assert_allclose(out, _moe(fullbuf, 0, x, idx_ref, w_ref), rtol=1e-4,
                                   atol=1e-5)
        assert set(np.flatnonzero(used)) == set(idx_ref.ravel().tolist())
    assert moved_all > 0 and lay.counters()["rerouted"] == moved_all
    # a stronger boost moves more, and lambda 0 moves nothing
    lay.set_miss("fetch", 2, 0.0)
    lay.counters(reset=True)
    _run(lay, 0, *_inputs(routers, 0, 6, seed=2))
    assert lay.counters()["rerouted"] == 0
    cache.close()


def test_routing_then_drop(stores):
    """Routing first, then the miss policy on what routing left uncached (Algorithm 1)."""
    full, fullbuf, _ = stores
    routers = _routers()
    cache, lay = _make(full, routers, RES, capacity=12)
    lay.set_miss("drop", 1, 0.2)
    x, idx, w = _inputs(routers, 0, 6, seed=4)
    res = _mask(0)
    idx_r, w_r, _ = ref_route(idx, w, _logits(routers, 0, x), res, 0.2, [0.0, 0])
    w_ref, _ = ref_drop(idx_r, w_r, res, 1)
    out, _ = _run(lay, 0, x, idx, w)
    np.testing.assert_allclose(out, _moe(fullbuf, 0, x, idx_r, w_ref), rtol=1e-4, atol=1e-5)
    cache.close()


def test_bad_settings(stores):
    full, _, _ = stores
    cache, lay = _make(full, _routers(), [])
    with pytest.raises(ValueError, match="miss mode"):
        lay.set_miss("skip", 2, 0.0)
    with pytest.raises(ValueError, match="miss_keep"):
        lay.set_miss("drop", K + 1, 0.0)
    with pytest.raises(ValueError, match="route_lambda"):
        lay.set_miss("fetch", 2, -0.1)
    with pytest.raises(ValueError, match="route_lambda"):
        lay.set_miss("fetch", 2, float("nan"))
    cache.close()


# ---- the link throttle ------------------------------------------------------------------------

def test_throttle_bounds_read_time(stores):
    full = stores[0]
    bb = int(full.block_bytes)
    cache = ExpertCache(full, 8, "lru", top_k=K)
    with pytest.raises(ValueError, match="throttle"):
        cache.native.set_throttle(-1.0, 0.0)
    bw, lat = bb / 0.02, 0.005  # one block: 20 ms on the link + 5 ms latency
    cache.native.set_throttle(bw, lat)
    for n in (1, 3):
        t0 = time.perf_counter()
        for e in range(n):
            cache.acquire(1, 8 + e + (n == 3))
            cache.release(1, 8 + e + (n == 3))
        dt = time.perf_counter() - t0
        assert dt >= n * (lat + bb / bw) * 0.999, (n, dt)
    st = cache.stats()["stall_s"]
    assert st >= 4 * (lat + bb / bw) * 0.999
    # prefetch reads share the link: three prefetches take at least three link times
    t0 = time.perf_counter()
    cache.prefetch([(0, 1, 1.0), (0, 2, 1.0), (0, 4, 1.0)])
    cache.wait_idle()
    assert time.perf_counter() - t0 >= 3 * (lat + bb / bw) * 0.999
    cache.native.set_throttle(0.0, 0.0)  # off: a read is quick again
    t0 = time.perf_counter()
    cache.acquire(1, 0)
    cache.release(1, 0)
    assert time.perf_counter() - t0 < lat + bb / bw
    cache.close()


# ---- the Engine's options ---------------------------------------------------------------------

def _tiny():
    import torch

    from specmoe.models import testing
    torch.manual_seed(0)
    m = testing.tiny_model("mixtral", experts=8, top_k=2, layers=3)
    return m.eval()


def test_engine_rejects_bad_options():
    from specmoe.runtime import engine as hf
    m = _tiny()
    for kw, exc, word in [({"miss": "skip"}, ValueError, "miss"),
                          ({"miss": 1}, TypeError, "miss"),
                          ({"miss": "drop", "miss_keep": -1}, ValueError, "miss_keep"),
                          ({"miss": "drop", "miss_keep": 1.0}, TypeError, "miss_keep"),
                          ({"route_lambda": -1.0}, ValueError, "route_lambda"),
                          ({"throttle": (1.0,)}, TypeError, "throttle"),
                          ({"throttle": (-1.0, 0.0)}, ValueError, "throttle")]:
        with pytest.raises(exc, match=word):
            hf.offload(m, **kw)
    assert not isinstance(m.model.layers[0].mlp.experts, SpecmoeExperts)  # untouched


def test_engine_low_bit_levels():
    """miss_levels: SpecMD's int4 -> int2 cascade through the Engine, the copies built on demand,
    shared with the self-draft and freed when no longer used; bad levels are refused."""
    import copy

    import torch

    from specmoe.runtime import engine as hf
    from specmoe.models import testing
    torch.manual_seed(0)
    m = testing.tiny_model("mixtral", experts=8, top_k=2, layers=3, inter=128).eval()
    ref_model = copy.deepcopy(m)
    ids = torch.randint(3, 128, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = ref_model(ids).logits
    for kw, exc, word in [({"miss_levels": "int2:int4"}, ValueError, "fewer bits"),
                          ({"miss_levels": "fp4"}, ValueError, "miss_levels"),
                          ({"miss_levels": 4}, TypeError, "miss_levels"),
                          ({"miss_levels": "int4", "miss_keep2": 1}, ValueError, "has one"),
                          ({"miss_levels": "int4:int2", "miss_keep": 2, "miss_keep2": 1},
                           ValueError, "miss_keep2")]:
        with pytest.raises(exc, match=word):
            hf.offload(m, **kw)
    # rank 0 of a missing pair from int4, rank 1 from int2 (keep2 = 0 + (2 - 0) // 2 = 1)
    eng = hf.offload(m, cache=12, prefetch=False, policy="least_stale", miss="priority",
                     miss_keep=0, miss_levels="int4:int2")
    assert (eng.miss_levels, eng.miss_keep2) == (("int4", "int2"), 1)
    err = {}

    def run(name):
        eng.reset_stats()
        with torch.no_grad():
            out = m(ids).logits
        err[name] = (out - ref).abs().mean().item()
        return eng.stats()

    s = run("int4:int2")
    assert eng.lowbit_copies == ("int4", "int2")
    assert s["miss_levels"] == "int4:int2" and s["miss_keep2"] == 1
    assert s["lowbit"] == s["missing"] > 0 and 0 < s["lowbit2"] < s["lowbit"]
    assert s["misses"] == 0
    eng.set_miss("lowest_bit", miss_levels="int4")
    s = run("int4")
    assert eng.lowbit_copies == ("int4",) and s["lowbit2"] == 0  # the int2 copy is freed
    eng.set_miss(miss_levels="int2")
    s = run("int2")
    assert eng.lowbit_copies == ("int2",) and s["lowbit"] == s["missing"] > 0
    # the higher-ranked half at int4 lands between the two single levels
    assert err["int4"] < err["int4:int2"] < err["int2"], err
    eng.enable_self_draft("int2")  # shares the miss level's copy
    assert eng.lowbit_copies == ("int2",) and eng.draft_dtype == "int2"
    eng.set_miss("fetch")
    assert eng.lowbit_copies == ("int2",)  # still the self-draft's
    run("fetch")
    assert err["fetch"] < 1e-4
    eng.close()
    assert eng.lowbit_copies == ()


def test_engine_int2_level_needs_multiples_of_64():
    """A model whose expert shapes int2 cannot group (inter 96) refuses the level with the
    reason and keeps its settings and output."""
    import torch

    from specmoe.runtime import engine as hf
    m = _tiny()  # hidden 64, inter 96
    ids = torch.randint(3, 128, (1, 8), generator=torch.Generator().manual_seed(3))
    for kw in ({"dtype": "int2"}, {"miss": "lowest_bit", "miss_levels": "int2"}):
        with pytest.raises(ValueError, match="int2 needs H and I multiples of 64"):
            hf.offload(m, **kw)  # refused before the model is touched
    assert not isinstance(m.model.layers[0].mlp.experts, SpecmoeExperts)
    eng = hf.offload(m, cache=12, prefetch=False, miss="lowest_bit")
    with torch.no_grad():
        before = m(ids).logits
    with pytest.raises(ValueError, match="int2 needs H and I multiples of 64"):
        eng.set_miss(miss_levels="int2")
    assert eng.miss_levels == ("int4",) and eng.lowbit_copies == ("int4",)
    with torch.no_grad():
        torch.testing.assert_close(m(ids).logits, before)
    eng.close()


def test_engine_modes_against_plain_decoding():
    import copy

    import torch

    from specmoe.runtime import engine as hf
    m = _tiny()
    ref_model = copy.deepcopy(m)
    ids = torch.randint(3, 128, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = ref_model(ids).logits
    eng = hf.offload(m, cache=12, prefetch=False, policy="least_stale")  # 12 of 24 experts
    out = {}
    for mode, keep in [("fetch", 2), ("drop", 2), ("drop", 1), ("drop", 0),
                       ("substitute", 2), ("lowest_bit", 2), ("priority", 1)]:
        eng.set_miss(mode, keep)
        eng.reset_stats()
        with torch.no_grad():
            out[mode, keep] = m(ids).logits
        s = eng.stats()
        if mode == "fetch" or (mode == "drop" and keep == 2):
            # nothing skipped: the exact output
            torch.testing.assert_close(out[mode, keep], ref, rtol=1e-4, atol=1e-4)
            assert s["dropped"] == 0 and s["misses"] > 0
        elif mode == "drop":
            assert s["dropped"] > 0 and s["missing"] >= s["dropped"]
        elif mode == "substitute":
            assert s["substituted"] > 0
        elif mode == "priority":  # rank 0 fetched, rank 1 from int4
            assert 0 < s["lowbit"] < s["missing"] and s["misses"] > 0
        else:
            assert s["lowbit"] == s["missing"] > 0 and s["misses"] == 0
            assert eng.lowbit_copies == ("int4",)  # built on demand
            assert eng.draft_dtype is None  # without turning the self-draft on
        if (mode, keep) in [("drop", 0), ("lowest_bit", 2)]:
            assert s["misses"] == 0  # nothing fetched on demand
        if (mode, keep) in [("drop", 0), ("substitute", 2), ("lowest_bit", 2)]:
            assert not torch.allclose(out[mode, keep], ref, atol=1e-4)
    # int4 stands in for the missing experts: much closer to the exact output than dropping
    err = {k: (v - ref).abs().mean().item() for k, v in out.items()}
    assert err["lowest_bit", 2] < err["drop", 0]
    # fetch-priority degrades only the low-rank misses: closer still
    assert err["priority", 1] < err["lowest_bit", 2]
    # cache-aware routing moves pairs to resident experts and so fetches less (one-token
    # passes, as in decoding: a prefill's union of experts is the whole layer anyway)
    misses = {}
    for lam in (0.0, 0.5):
        eng.set_miss("fetch", 2, lam)
        eng.reset_stats()
        with torch.no_grad():
            for t in range(ids.shape[1]):
                m(ids[:, t:t + 1])
        misses[lam] = eng.stats()["misses"]
    base = misses[0.0]
    s = eng.stats()
    assert s["rerouted"] > 0 and s["misses"] < base
    eng.close()


def test_engine_throttle_slows_loads():
    import torch

    from specmoe.runtime import engine as hf
    m = _tiny()
    ids = torch.randint(3, 128, (1, 4), generator=torch.Generator().manual_seed(2))
    eng = hf.offload(m, cache=4, prefetch=False, throttle=(0.0, 2000.0))  # 2 ms per read
    with torch.no_grad():
        m(ids)
    s = eng.stats()
    assert s["misses"] > 0 and s["stall_s"] >= s["misses"] * 2e-3 * 0.999
    eng.set_miss(throttle=None)
    eng.close()


# ---- the simulator ------------------------------------------------------------------------------

def ref_sim_misses(experts, logits, E, nslots, mode, keep, ratio, load_s, expert_s, keep2=None,
                   ratio2=1.0):
    """Demand-only LRU replay with SpecMD's miss rules (csrc/sim.h smoe_sim_miss), written from
    that description: counts and times (keep2: priority's ranks from a second copy)."""
    from collections import OrderedDict
    lru: OrderedDict[int, None] = OrderedDict()
    c = dict(hits=0, misses=0, missing=0, dropped=0, substituted=0, lowbit=0, lowbit2=0)
    stall = compute = 0.0

    def demand(key):
        nonlocal stall
        if key in lru:
            lru.move_to_end(key)
            c["hits"] += 1
            return
        c["misses"] += 1
        if len(lru) >= nslots:
            lru.popitem(last=False)
        lru[key] = None
        stall += load_s

    T, L, K = experts.shape
    for t in range(T):
        for l in range(L):
            row = [int(e) for e in experts[t, l]]
            lg = logits[t, l] if logits is not None else None
            mark = set(row)
            full = low = low2 = 0
            for i, e in enumerate(row):
                key = l * E + e
                if mode != "fetch" and key not in lru:
                    c["missing"] += 1
                    r = i if lg is None else sum(
                        1 for q in range(K) if lg[row[q]] > lg[e] or (lg[row[q]] == lg[e] and q < i))
                    if mode == "lowest_bit" or (mode == "priority" and r >= keep):
                        c["lowbit"] += 1
                        if mode == "priority" and keep2 is not None and r >= keep2:
                            c["lowbit2"] += 1
                            low2 += 1
                        else:
                            low += 1
                        continue
                    if mode == "priority":
                        pass  # a high rank: fetched below
                    elif mode == "drop":
                        if r >= keep:
                            c["dropped"] += 1
                            continue
                    else:
                        cands = [x for x in range(E) if x not in mark and l * E + x in lru]
                        if cands:
                            best = min(cands, key=lambda x: (abs(lg[x] - lg[e]) if lg is not None
                                                             else 0.0, x))
                            mark.add(best)
                            c["substituted"] += 1
                            key = l * E + best
                demand(key)
                full += 1
            compute += full * expert_s + low * expert_s * ratio + low2 * expert_s * ratio2
    return c, stall, compute


@pytest.mark.parametrize("mode,keep", [("fetch", 2), ("drop", 0), ("drop", 1), ("drop", 2),
                                       ("substitute", 2), ("lowest_bit", 2), ("priority", 0),
                                       ("priority", 1), ("priority", 2)])
@pytest.mark.parametrize("with_logits", [False, True])
def test_simulator_miss_modes_match_reference(mode, keep, with_logits):
    rng = np.random.default_rng(7)
    T, Ls, Es, Ks = 60, 4, 10, 3
    logits = rng.standard_normal((T, Ls, Es)).astype(np.float32)
    experts = np.argsort(-logits, axis=2)[:, :, :Ks].astype(np.int16)
    experts = np.ascontiguousarray(experts[:, :, ::-1])  # recorded order is not the rank order
    lg = logits if with_logits else None
    hw = dict(expert_bytes=1e6, fast_bw=1e9, link_bw=1e8, link_latency_s=1e-4)
    r = _C.simulate(experts, Es, "lru", 12, logits=lg, **hw, miss=
                    ["fetch", "drop", "substitute", "lowest_bit", "priority"].index(mode),
                    miss_keep=keep,
                    lowbit_ratio=0.3)
    c, stall, compute = ref_sim_misses(experts, lg, Es, 12, mode, keep, 0.3,
                                       1e-4 + 1e6 / 1e8, 1e6 / 1e9)
    for k, v in c.items():
        assert r[k] == v, (k, r[k], v)
    assert r["stall_s"] == pytest.approx(stall) and r["compute_s"] == pytest.approx(compute)
    if mode != "fetch":
        assert r["missing"] > 0


@pytest.mark.parametrize("keep,keep2", [(0, 1), (1, 2), (0, 0), (1, 3)])
def test_simulator_priority_three_levels_match_reference(keep, keep2):
    """fetch-priority with an int2 level: ranks keep..keep2-1 cost lowbit_ratio, ranks keep2..
    lowbit2_ratio (keep2 = top_k: the two-level mode)."""
    rng = np.random.default_rng(8)
    T, Ls, Es, Ks = 60, 4, 10, 3
    logits = rng.standard_normal((T, Ls, Es)).astype(np.float32)
    experts = np.ascontiguousarray(np.argsort(-logits, axis=2)[:, :, :Ks][:, :, ::-1])
    experts = experts.astype(np.int16)
    hw = dict(expert_bytes=1e6, fast_bw=1e9, link_bw=1e8, link_latency_s=1e-4)
    r = _C.simulate(experts, Es, "lru", 12, logits=logits, **hw, miss=4, miss_keep=keep,
                    lowbit_ratio=0.3, miss_keep2=keep2, lowbit2_ratio=0.2)
    c, stall, compute = ref_sim_misses(experts, logits, Es, 12, "priority", keep, 0.3,
                                       1e-4 + 1e6 / 1e8, 1e6 / 1e9, keep2=keep2, ratio2=0.2)
    for k, v in c.items():
        assert r[k] == v, (k, r[k], v)
    assert r["stall_s"] == pytest.approx(stall) and r["compute_s"] == pytest.approx(compute)
    if keep2 < Ks:
        assert r["lowbit2"] > 0
    else:
        assert r["lowbit2"] == 0
    with pytest.raises(ValueError, match="keep2"):
        _C.simulate(experts, Es, "lru", 12, logits=logits, **hw, miss=4, miss_keep=2,
                    miss_keep2=1, lowbit2_ratio=0.2)


def test_simulate_api_and_cli_take_miss(tmp_path):
    import json
    import subprocess
    import sys

    from specmoe.sim.replay import simulate
    from specmoe.sim.traces import Trace
    rng = np.random.default_rng(3)
    ex = np.stack([rng.permutation(10)[:3] for _ in range(40 * 4)]).reshape(40, 4, 3)
    tr = Trace(experts=ex.astype(np.int16), num_experts=10)
    base = simulate(tr, "lru", 12, miss="fetch")
    low = simulate(tr, "lru", 12, miss="lowest_bit")
    # no demand load ever fills the cache (only a prefetcher would): all from the int4 copy
    assert low.misses == 0 and low.extra["lowbit"] == ex.size and base.misses > 0
    assert low.stall_s == 0 and low.total_s < base.total_s
    with pytest.raises(ValueError, match="miss"):
        simulate(tr, "lru", 12, miss="skip")
    with pytest.raises(ValueError, match="miss_keep"):
        simulate(tr, "lru", 12, miss="drop", miss_keep=-1)
    # a keep above top_k fetches every rank: the same as fetch
    assert simulate(tr, "lru", 12, miss="drop", miss_keep=9).misses == base.misses
    with pytest.raises(ValueError, match="verify_tokens"):
        simulate(tr, "lru", 12, miss="drop", verify_tokens=2)
    # an int2 band below rank 1: cheaper compute than the two-level mode, same loads
    two = simulate(tr, "lru", 12, miss="priority", miss_keep=1)
    three = simulate(tr, "lru", 12, miss="priority", miss_keep=1, miss_keep2=2)
    assert three.misses == two.misses and 0 < three.extra["lowbit2"] < three.extra["lowbit"]
    assert three.compute_s < two.compute_s and two.extra["lowbit2"] == 0
    with pytest.raises(ValueError, match="miss_keep2"):
        simulate(tr, "lru", 12, miss="priority", miss_keep=2, miss_keep2=1)
    path = tmp_path / "t.npz"
    tr.save(path)
    out = subprocess.run([sys.executable, "-m", "specmoe", "simulate", "--trace", str(path),
                          "--policies", "lru", "--capacity", "12", "--miss", "drop",
                          "--miss-keep", "1", "--json"], capture_output=True, text=True,
                         check=True)
    res = json.loads(out.stdout)
    assert res["miss"] == "drop" and res["results"][0]["dropped"] > 0
    out = subprocess.run([sys.executable, "-m", "specmoe", "simulate", "--trace", str(path),
                          "--policies", "lru", "--capacity", "12", "--miss", "priority",
                          "--miss-keep", "0", "--miss-keep2", "1", "--json"],
                         capture_output=True, text=True, check=True)
    assert json.loads(out.stdout)["results"][0]["lowbit2"] > 0


def test_expert_cache_set_throttle(stores):
    full = stores[0]
    bb = int(full.block_bytes)
    cache = ExpertCache(full, 8, "lru", top_k=K)
    with pytest.raises(TypeError, match="throttle"):
        cache.set_throttle(5.0)
    cache.set_throttle((bb / 0.01 / 1e9, 1000.0))  # 10 ms per block + 1 ms
    t0 = time.perf_counter()
    cache.acquire(0, 0)
    cache.release(0, 0)
    assert time.perf_counter() - t0 >= 0.011 * 0.999
    cache.set_throttle(None)
    cache.close()


def test_from_pretrained_checks_miss_options_first(tmp_path):
    import specmoe
    for kw, exc in [({"miss": "skip"}, ValueError), ({"route_lambda": -1.0}, ValueError),
                    ({"throttle": "fast"}, TypeError)]:
        with pytest.raises(exc, match=next(iter(kw))):
            specmoe.from_pretrained(tmp_path / "no-such-checkpoint", **kw)

"""_C.Layers (csrc/layer.h), the per-layer path of an offloaded model, against the numpy
reference of the Python code it replaced: next-layer prediction (top-m and mass modes, with and
without a correction bias, or scores from a Python predictor), the prediction counters, and the
layer output against _C.moe_forward."""
from __future__ import annotations

import math

import numpy as np
import pytest

from specmoe import _C
from specmoe.storage import quant
from specmoe.runtime.cache import ExpertCache
from specmoe.runtime.kernels import FFNSpec
from specmoe.storage.store import write_store

L, E, H, I, K = 3, 16, 64, 32, 2


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    rng = np.random.default_rng(0)
    path = tmp_path_factory.mktemp("layers") / "s.smoe"
    layers = []
    for _ in range(L):
        per = [quant.expert_tensors(rng.standard_normal((I, H), dtype=np.float32) * 0.1,
                                    rng.standard_normal((I, H), dtype=np.float32) * 0.1,
                                    rng.standard_normal((H, I), dtype=np.float32) * 0.1, "f32")
               for _ in range(E)]
        layers.append({n: np.stack([p[n] for p in per]) for n in per[0]})
    st = write_store(path, layers, top_k=K, progress=False)
    yield st
    st.close()


def _routers(rng, corr=False):
    return [(rng.standard_normal((E, H), dtype=np.float32),
             rng.standard_normal(E, dtype=np.float32) * 0.1,
             rng.standard_normal(E, dtype=np.float32) * 0.05 if corr else None)
            for _ in range(L)]


def _make(store, routers, sigmoid=False, capacity=E * L):
    cache = ExpertCache(store, capacity, "lru", top_k=K)
    desc = FFNSpec.from_store_schema(store.tensors, int(store.block_bytes)).desc()
    return cache, _C.Layers(cache, None, desc, routers, K, sigmoid=sigmoid)


def ref_scores(router, x, sigmoid):
    w, b, corr = router
    lg = x.astype(np.float64) @ w.T.astype(np.float64) + b
    if corr is None:
        return lg
    if sigmoid:
        return 1 / (1 + np.exp(-lg)) + corr
    p = np.exp(lg - lg.max(1, keepdims=True))
    return p / p.sum(1, keepdims=True) + corr


def ref_predict(sc, overfetch, mass):
    """The Python path that _C.Layers replaced (specmoe/runtime/engine.py before the C layer object)."""
    T = sc.shape[0]
    pred = np.zeros(E, bool)
    if mass is None:
        m = min(E, max(K, math.ceil(K * overfetch)))
        for t in range(T):
            pred[np.argsort(-sc[t], kind="stable")[:m]] = True
    else:
        for t in range(T):
            p = np.exp(sc[t] - sc[t].max())
            p /= p.sum()
            order = np.argsort(-p, kind="stable")
            before = 0.0
            for r, e in enumerate(order):
                if r >= K and before >= mass:
                    break
                pred[e] = True
                before += p[e]
    return pred


def _run(layers, x, next_idx, scores=None):
    """forward at layer 0 (predicts layer 1), then at layer 1 routing next_idx; counters."""
    T = x.shape[0]
    rng = np.random.default_rng(1)
    used = np.zeros(E, np.uint8)
    out = np.empty_like(x)
    idx0 = np.stack([rng.choice(E, K, replace=False) for _ in range(T)]).astype(np.int64)
    w = np.full((T, K), 0.5, np.float32)
    layers.counters(reset=True)
    layers.forward(0, x, idx0, w, out, used, scores)
    n1 = next_idx.shape[0]
    x1 = rng.standard_normal((n1, x.shape[1]), dtype=np.float32)
    layers.forward(1, x1, next_idx, np.full((n1, K), 0.5, np.float32), np.empty_like(x1), used)
    return layers.counters(), used.copy()


@pytest.mark.parametrize("corr,sigmoid", [(False, False), (True, True), (True, False)])
@pytest.mark.parametrize("overfetch,mass", [(1.0, None), (1.5, None), (3.2, None), (1, 0.5),
                                            (1, 0.9)])
def test_prediction_and_counters_match_reference(store, corr, sigmoid, overfetch, mass):
    rng = np.random.default_rng(7)
    routers = _routers(rng, corr)
    cache, layers = _make(store, routers, sigmoid)
    try:
        layers.configure(True, float(overfetch), 0.0 if mass is None else mass, False)
        for trial in range(12):
            T = int(rng.integers(1, 6))
            x = rng.standard_normal((T, H), dtype=np.float32)
            pred = ref_predict(ref_scores(routers[1], x, sigmoid), overfetch, mass)
            # a random routing of layer 1: counters say how much of it was predicted
            nxt = np.stack([rng.choice(E, K, replace=False)
                            for _ in range(int(rng.integers(1, 5)))]).astype(np.int64)
            c, used = _run(layers, x, nxt)
            act = np.zeros(E, bool)
            act[nxt.ravel()] = True
            assert (used.astype(bool) == act).all()
            assert c["predicted"] == pred.sum(), (trial, c, pred.sum())
            assert c["actual"] == act.sum()
            assert c["true_positive"] == (pred & act).sum(), (trial, c)
            assert c["passes"] == 1 and c["tokens"] == T
    finally:
        cache.close()


def test_python_scores_replace_the_router(store):
    rng = np.random.default_rng(3)
    cache, layers = _make(store, _routers(rng))
    try:
        layers.configure(True, 1.0, 0.0, False)
        x = rng.standard_normal((2, H), dtype=np.float32)
        scores = np.full((2, E), -1.0, np.float32)
        scores[0, [3, 9]] = 5.0
        scores[1, [9, 12]] = 4.0
        c, _ = _run(layers, x, np.array([[3, 12], [9, 0]], np.int64), scores)
        assert c["predicted"] == 3 and c["true_positive"] == 3 and c["actual"] == 4
        # prefetch off: no prediction, no counters
        layers.configure(False, 1.0, 0.0, False)
        c, _ = _run(layers, x, np.array([[3, 12]], np.int64), scores)
        assert c["predicted"] == 0 and c["actual"] == 0
    finally:
        cache.close()


def test_output_equals_moe_forward_and_prefetch_fills_the_cache(store):
    rng = np.random.default_rng(5)
    routers = _routers(rng)
    cache, layers = _make(store, routers)
    ref_cache = ExpertCache(store, E * L, "lru", top_k=K, prefetch=False)
    desc = FFNSpec.from_store_schema(store.tensors, int(store.block_bytes)).desc()
    try:
        x = rng.standard_normal((4, H), dtype=np.float32)
        idx = np.stack([rng.choice(E, K, replace=False) for _ in range(4)]).astype(np.int64)
        w = rng.random((4, K), dtype=np.float32)
        out, ref = np.empty_like(x), np.empty_like(x)
        used, used_ref = np.zeros(E, np.uint8), np.zeros(E, np.uint8)
        layers.forward(0, x, idx, w, out, used)
        _C.moe_forward(ref_cache._c, None, desc, int(store.block_bytes), 0, E, x, idx, w, ref,
                       used_ref)
        np.testing.assert_array_equal(out, ref)
        np.testing.assert_array_equal(used, used_ref)
        cache.wait_idle()
        want = ref_predict(ref_scores(routers[1], x, False), 1.5, None)
        assert {e for (l, e) in cache.resident() if l == 1} == set(np.flatnonzero(want))
    finally:
        cache.close()
        ref_cache.close()


def test_bad_input_is_refused_before_anything_is_queued(store):
    rng = np.random.default_rng(9)
    cache, layers = _make(store, _routers(rng))
    try:
        x = rng.standard_normal((1, H), dtype=np.float32)
        out, used, w = np.empty_like(x), np.zeros(E, np.uint8), np.ones((1, K), np.float32)
        with pytest.raises(ValueError, match="outside"):
            layers.forward(0, x, np.array([[1, E]], np.int64), w, out, used)
        assert layers.counters()["passes"] == 0 and cache.queued() == 0
        with pytest.raises(ValueError, match="pos"):
            layers.forward(L, x, np.array([[1, 2]], np.int64), w, out, used)
        with pytest.raises(ValueError, match="shape mismatch"):
            layers.forward(0, x, np.array([[1, 2, 3]], np.int64), w, out, used)
        with pytest.raises(ValueError, match="float32"):
            layers.forward(0, x.astype(np.float64), np.array([[1, 2]], np.int64), w, out, used)
        with pytest.raises(ValueError, match="overfetch"):
            layers.configure(True, 0.5, 0.0, False)
        with pytest.raises(ValueError, match="routers"):
            _C.Layers(cache, None, FFNSpec.from_store_schema(
                store.tensors, int(store.block_bytes)).desc(), _routers(rng)[:2], K)
    finally:
        cache.close()
    with pytest.raises(Exception, match="closed"):
        layers.forward(0, x, np.array([[1, 2]], np.int64), w, out, used)


@pytest.mark.parametrize("corr,sigmoid", [(False, False), (True, True), (True, False)])
@pytest.mark.parametrize("overfetch,mass", [(1.0, None), (1.5, None), (3.2, None), (1, 0.5),
                                            (1, 0.9)])
def test_predict_next_is_the_layers_rule(store, corr, sigmoid, overfetch, mass):
    """_C.predict_next (what the GPU tier calls on its router logits) is the C layers' own
    prediction rule (csrc/route.h): the same experts as the reference and as _C.Layers on the
    same input, each with its best score (mass: probability) as the priority."""
    rng = np.random.default_rng(11)
    routers = _routers(rng, corr)
    w, b, c = routers[1]
    cache, layers = _make(store, routers, sigmoid)
    try:
        layers.configure(True, float(overfetch), 0.0 if mass is None else mass, False)
        for trial in range(8):
            T = int(rng.integers(1, 6))
            x = rng.standard_normal((T, H), dtype=np.float32)
            logits = (x @ w.T + b).astype(np.float32)
            ids, prio = _C.predict_next(logits, K, float(overfetch), mass or 0.0, sigmoid, c)
            sc = ref_scores(routers[1], x, sigmoid)
            pred = ref_predict(sc, overfetch, mass)
            assert ids.tolist() == np.flatnonzero(pred).tolist(), trial
            if mass is None:  # the priority: the best score any token chose the expert with
                best = [max(sc[t, e] for t in range(T)
                            if e in np.argsort(-sc[t], kind="stable")[:max(K, math.ceil(
                                K * overfetch))]) for e in ids]
                np.testing.assert_allclose(prio, best, rtol=1e-4, atol=1e-5)
            nxt = np.stack([rng.choice(E, K, replace=False) for _ in range(2)]).astype(np.int64)
            cnt, _ = _run(layers, x, nxt)
            assert cnt["predicted"] == ids.size
    finally:
        cache.close()


def test_predict_next_bad_input():
    lg = np.zeros((2, E), np.float32)
    with pytest.raises(ValueError, match=r"overfetch .*\(got 0\.5, 0\)"):  # values formatted
        _C.predict_next(lg, K, 0.5)
    with pytest.raises(ValueError, match="mass"):
        _C.predict_next(lg, K, 1.0, 1.5)
    with pytest.raises(ValueError, match="k <= E"):
        _C.predict_next(lg, E + 1, 1.0)
    with pytest.raises(ValueError, match="corr"):
        _C.predict_next(lg, K, 1.0, 0.0, False, np.zeros(E + 1, np.float32))
    with pytest.raises(ValueError, match="logits"):
        _C.predict_next(lg.astype(np.float64), K, 1.0)
    before = lg.copy()
    _C.predict_next(lg, K, 1.5, 0.0, True, np.ones(E, np.float32))
    assert (lg == before).all()  # the caller's logits are not written


@pytest.mark.parametrize("sigmoid", [False, True])
def test_route_scores_is_the_score_function(sigmoid):
    """_C.route_scores (csrc/route.h, the one copy of the rule; trace recording's logits use
    it) against numpy: with a correction bias, sigmoid or softmax of the logits plus the bias;
    without one, the logits unchanged; bad shapes are refused."""
    rng = np.random.default_rng(5)
    lg = rng.standard_normal((3, 16)).astype(np.float32)
    corr = rng.standard_normal(16).astype(np.float32)
    s = lg.copy()
    _C.route_scores(s, sigmoid, corr)
    if sigmoid:
        want = 1.0 / (1.0 + np.exp(-lg.astype(np.float64)))
    else:
        z = np.exp(lg.astype(np.float64) - lg.max(1, keepdims=True))
        want = z / z.sum(1, keepdims=True)
    np.testing.assert_allclose(s, want + corr, rtol=1e-5, atol=1e-6)
    s = lg.copy()
    _C.route_scores(s, sigmoid, None)
    np.testing.assert_array_equal(s, lg)
    with pytest.raises(ValueError, match="corr"):
        _C.route_scores(lg.copy(), sigmoid, corr[:5])

"""Misuse of the public API (issue 15, item 4 without the generate/engine thread cases): a
Python eviction policy that raises or answers nonsense in a live cache and under
model.generate, a 1-slot cache, spec.accept with NaN rows or mismatched shapes.  Each has a
documented outcome (a named error, or correct results) and leaves the cache usable and
uncorrupted.  docs/reliability.md lists them."""
from __future__ import annotations

import numpy as np
import pytest

import specmoe
import specmoe.speculation.verify
from specmoe.runtime.cache import ExpertCache
from specmoe.runtime.policies import PythonPolicy
from specmoe.storage.store import write_store


@pytest.fixture
def store(tmp_path):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((3, 6, 16)).astype(np.float32)
    st = write_store(tmp_path / "s.smoe", [{"w": w[l]} for l in range(3)], progress=False)
    yield st, w
    st.close()


class Switch(PythonPolicy):
    """LRU-ish (first candidate) until told to misbehave."""

    def __init__(self) -> None:
        self.mode = "ok"

    def victim(self, candidates):
        if self.mode == "raise":
            raise RuntimeError("policy bug")
        if self.mode != "ok":
            return self.mode
        return candidates[0]


def _check_all(cache, w):
    """Every expert served with the right bytes, and no pin left behind."""
    for l in range(w.shape[0]):
        for e in range(w.shape[1]):
            with cache.expert(l, e) as t:
                np.testing.assert_array_equal(t["w"], w[l, e])


@pytest.mark.parametrize("bad", ["raise", 99, -1, "x", None, 1.5, 2**70])
def test_live_cache_bad_python_policy(store, bad):
    st, w = store
    pol = Switch()
    c = ExpertCache(st, 2, pol, top_k=1, prefetch=False)
    for e in (0, 1):
        with c.expert(0, e):
            pass
    res = c.resident()
    pol.mode = bad
    with pytest.raises(specmoe.PolicyError, match="policy bug" if bad == "raise" else "not one of|too large"):
        with c.expert(0, 2):
            pass
    assert c.resident() == res  # nothing evicted or half-loaded by the failed miss
    pol.mode = "ok"
    _check_all(c, w)  # usable afterwards: every slot can be given up again
    c.close()


def test_prefetch_with_raising_policy(store):
    st, w = store
    pol = Switch()
    c = ExpertCache(st, 2, pol, top_k=1, prefetch=True)
    for e in (0, 1):
        with c.expert(0, e):
            pass
    c.begin_pass()  # the slots used in the last pass become evictable for prefetch
    pol.mode = "raise"
    c.prefetch([(1, 0, 1.0), (1, 1, 0.5)])
    c.wait_idle()
    with pytest.raises(specmoe.PolicyError, match="policy bug"):
        c.check_prefetch_error()
    assert c.stats()["prefetch_dropped"] >= 1
    pol.mode = "ok"
    c.check_prefetch_error()  # taken once
    _check_all(c, w)
    c.close()


def test_one_slot_cache(store):
    st, w = store
    c = ExpertCache(st, 1, "lru", top_k=1, prefetch=True)
    for _ in range(2):
        _check_all(c, w)
    c.prefetch([(2, 5, 1.0)])
    c.wait_idle()
    _check_all(c, w)
    s = c.stats()
    assert s["hits"] + s["misses"] == 3 * w.shape[0] * w.shape[1] and c.capacity == 1
    c.close()
    with pytest.raises(ValueError, match="fewer than top_k = 2"):
        ExpertCache(st, 1, "lru", top_k=2)


@pytest.fixture(scope="module")
def tiny():
    torch = pytest.importorskip("torch")
    from specmoe.models.testing import tiny_model

    return torch, tiny_model


def test_generate_with_bad_python_policy(tiny):
    torch, tiny_model = tiny
    m = tiny_model("mixtral")
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    ref = m.generate(ids, max_new_tokens=6, do_sample=False)
    pol = Switch()
    eng = specmoe.offload(m, cache=0.25, policy=pol, dtype="f32")
    try:
        for bad in ("raise", 12345):
            pol.mode = bad
            with pytest.raises(specmoe.PolicyError):
                m.generate(ids, max_new_tokens=6, do_sample=False)
            pol.mode = "ok"
            assert torch.equal(m.generate(ids, max_new_tokens=6, do_sample=False), ref)
    finally:
        eng.close()


def test_generate_one_slot_cache(tiny):
    torch, tiny_model = tiny
    m = tiny_model("mixtral", top_k=1)
    ids = torch.tensor([[1, 5, 9, 3, 7]])
    ref = m.generate(ids, max_new_tokens=6, do_sample=False)
    eng = specmoe.offload(m, cache=1, dtype="f32")
    try:
        assert eng._cache.capacity == 1
        assert torch.equal(m.generate(ids, max_new_tokens=6, do_sample=False), ref)
    finally:
        eng.close()
    m2 = tiny_model("mixtral")  # top-2: one slot cannot hold one token's experts
    with pytest.raises(ValueError, match="cache"):
        specmoe.offload(m2, cache=1, dtype="f32")


# ---------------------------------------------------------------------------------------------
# spec.accept
# ---------------------------------------------------------------------------------------------

def _probs(rng, k, v):
    p = rng.random((k, v)).astype(np.float32)
    return np.ascontiguousarray(p / p.sum(1, keepdims=True), dtype=np.float32)


@pytest.mark.parametrize("where", ["p", "q"])
def test_accept_nan_checked(where):
    rng = np.random.default_rng(0)
    p, q = _probs(rng, 3, 10), _probs(rng, 2, 10)
    (p if where == "p" else q)[1, 4] = np.nan
    u = rng.random((3, 2))
    with pytest.raises(ValueError, match=f"{where}\\[1, 4\\] = nan"):
        specmoe.speculation.verify.accept(p, [1, 2], q, u)


@pytest.mark.parametrize("sampling", [False, True])
def test_accept_nan_unchecked_is_bounded(sampling):
    """check=False skips the value scan (documented: unspecified answer or ValueError), but
    the answer is still in range: never a crash or an out-of-range token."""
    rng = np.random.default_rng(1)
    for trial in range(50):
        p = _probs(rng, 4, 16)
        q = _probs(rng, 3, 16) if sampling else None
        p[rng.integers(0, 4), rng.integers(0, 16)] = rng.choice([np.nan, np.inf, -np.inf, -1.0])
        if trial % 2:
            p[:] = np.nan
        u = rng.random((4, 2)) if sampling else None
        draft = rng.integers(0, 16, 3)
        try:
            n, tok = specmoe.speculation.verify.accept(p, draft, q, u, check=False)
        except ValueError:
            continue
        assert 0 <= n <= 3 and 0 <= tok < 16


@pytest.mark.parametrize("case", ["p_rows", "q_rows", "q_vocab", "u_shape", "draft_2d",
                                  "p_1d", "draft_range"])
def test_accept_mismatched_shapes(case):
    rng = np.random.default_rng(2)
    p, q, u, draft = _probs(rng, 3, 10), _probs(rng, 2, 10), rng.random((3, 2)), np.array([1, 2])
    if case == "p_rows":
        p = _probs(rng, 2, 10)
    elif case == "q_rows":
        q = _probs(rng, 3, 10)
    elif case == "q_vocab":
        q = _probs(rng, 2, 11)
    elif case == "u_shape":
        u = rng.random((2, 2))
    elif case == "draft_2d":
        draft = np.array([[1, 2]])
    elif case == "p_1d":
        p = np.ascontiguousarray(p[0])
    elif case == "draft_range":
        draft = np.array([1, 10])
    with pytest.raises(ValueError):
        specmoe.speculation.verify.accept(p, draft, q, u)

"""Lookahead-aware eviction (ExpertCache.protect, csrc/slots.c): for any policy, protected
experts are evicted only when no unprotected evictable slot remains.  Checked victim by victim
against the plain-Python reference policies run on the unprotected candidates, then on all of
them when there are none."""
from __future__ import annotations

import numpy as np
import pytest

from specmoe.runtime.cache import ExpertCache
from specmoe.storage.store import ExpertStore, write_store
from tests import ref_policies as ref

NL, NE = 3, 6


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    rng = np.random.default_rng(0)
    layers = [{"w": rng.standard_normal((NE, 8, 32)).astype(np.float32)} for _ in range(NL)]
    path = tmp_path_factory.mktemp("protect") / "experts.smoe"
    write_store(path, layers, top_k=1, progress=False).close()
    return path


REFS = {"lru": ref.RefLRU, "fifo": ref.RefFIFO, "mru": ref.RefMRU, "lfu": ref.RefLFU,
        "least_stale": lambda: ref.RefLeastStale(NL, NE, "layer")}


class Model:
    """Slots filled lowest free first; the victim is the policy's among the slots holding
    unprotected keys, or among all slots when every one holds a protected key."""

    def __init__(self, n: int, pol: ref.RefPolicy) -> None:
        self.slots: list[int | None] = [None] * n
        self.pol = pol
        self.protected: set[int] = set()
        self.protected_evictions = 0

    def access(self, key: int) -> None:
        if key in self.slots:
            self.pol.on_access(self.slots.index(key), key)
            return
        if None in self.slots:
            s = self.slots.index(None)
        else:
            cands = [i for i, k in enumerate(self.slots) if k not in self.protected]
            s = self.pol.victim(cands or list(range(len(self.slots))))
            old = self.slots[s]
            self.protected_evictions += old in self.protected
            self.pol.on_evict(s, old)
        self.slots[s] = key
        self.pol.on_insert(s, key, False)


@pytest.mark.parametrize("name", sorted(REFS))
@pytest.mark.parametrize("seed", [0, 1])
def test_protected_keys_go_last(store_path, name, seed):
    rng = np.random.default_rng(seed)
    n = 5
    st = ExpertStore(store_path)
    cache = ExpertCache(st, n, name, top_k=1, prefetch=False)
    model = Model(n, REFS[name]())
    try:
        for step in range(300):
            if step % 7 == 0:
                cache.begin_pass()
                model.pol.on_pass(step // 7 + 1)
            if step % 23 == 0:  # a new lookahead buffer: 0..n+1 keys (more than the slots too)
                keys = rng.choice(NL * NE, size=int(rng.integers(0, n + 2)), replace=False)
                cache.protect(keys // NE, keys % NE)
                model.protected = set(int(k) for k in keys)
            key = int(rng.integers(0, NL * NE)) if rng.random() < 0.7 else \
                int(rng.choice(sorted(model.protected) or [0]))
            with cache.expert(key // NE, key % NE):
                pass
            model.access(key)
            got = [l * NE + e for l, e in cache.resident()]
            want = [k for k in model.slots if k is not None]
            assert got == want, (step, got, want)
        assert cache.stats()["protected_evictions"] == model.protected_evictions
        if name == "lru":
            assert model.protected_evictions > 0  # the fallback was exercised
        cache.protect()                            # cleared: plain policy from here on
        model.protected = set()
        for _ in range(50):
            key = int(rng.integers(0, NL * NE))
            with cache.expert(key // NE, key % NE):
                pass
            model.access(key)
        assert [l * NE + e for l, e in cache.resident()] == [k for k in model.slots
                                                             if k is not None]
    finally:
        cache.close()
        st.close()


def test_protect_bad_input(store_path):
    st = ExpertStore(store_path)
    cache = ExpertCache(st, 3, "lru", top_k=1, prefetch=False)
    try:
        with pytest.raises(ValueError, match="out of range"):
            cache.protect([NL], [0])
        with pytest.raises(ValueError, match="out of range"):
            cache.protect([0], [-1])
        with pytest.raises(ValueError, match="integers"):
            cache.protect([0.5], [1])
        with pytest.raises(ValueError, match="differ in length"):
            cache.protect([0, 1], [1])
        cache.protect([0, 0], [1, 1])              # duplicates are one key
        cache.protect()
    finally:
        cache.close()
        st.close()

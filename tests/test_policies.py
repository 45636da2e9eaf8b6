"""Eviction policies (csrc/policy/*.c) against the plain-Python references in ref_policies.py:
same hits and the same victims, access by access, through _C.replay (the cache's demand-only
semantics from csrc/policy/policy.h)."""
from __future__ import annotations

import gc
import os
from pathlib import Path

import numpy as np
import pytest

import specmoe
from specmoe import _C
from specmoe.runtime.policies import (FIFO, LFU, LRU, MRU, POLICY_NAMES, Belady, LeastStale,
                                      PythonPolicy, Random, make_policy, replay)

from .conftest import SHARED
from .ref_policies import RefLRU, make_ref, ref_replay

# (name, C kwargs, ref kwargs) for every built-in policy variant except Belady.
VARIANTS = [
    ("lru", {}, {}),
    ("lfu", {}, {}),
    ("fifo", {}, {}),
    ("mru", {}, {}),
    ("random", {"seed": 0}, {"seed": 0}),
    ("random", {"seed": 12345}, {"seed": 12345}),
    ("least_stale", {"order": "layer"}, {"order": "layer"}),
    ("least_stale", {"order": "lru"}, {"order": "lru"}),
    ("least_stale", {"order": "fifo"}, {"order": "fifo"}),
    ("lhu", {}, {}),
    ("fld", {}, {}),
    ("score", {}, {}),
    ("spac_ema", {}, {}),
    ("spac", {}, {}),
]
VARIANT_IDS = [n + "".join(f"-{v}" for v in kw.values()) for n, kw, _ in VARIANTS]


def run_both(name, ckw, rkw, keys, nslots, L, E, pass_starts=None, mask_seed=0):
    keys = np.asarray(keys, np.int32)
    if name == "belady":
        ckw = {"future": keys}
        rkw = {"future": keys.tolist()}
    pol = _C.Policy(name, nslots, L, E, **ckw)
    hits, vic = _C.replay(pol, keys, pass_starts, mask_seed=mask_seed)
    assert pol.in_use
    rh, rv = ref_replay(make_ref(name, L, E, **rkw), keys.tolist(), nslots, pass_starts, mask_seed)
    return hits, vic, np.array(rh, np.uint8), np.array(rv, np.int32)


def assert_same(name, hits, vic, rh, rv):
    if not np.array_equal(vic, rv):
        i = int(np.argmax(vic != rv))
        pytest.fail(f"{name}: first differing victim at access {i}: C {vic[i]} ref {rv[i]}")
    assert np.array_equal(hits, rh), f"{name}: hits differ"


def random_keys(rng, n, L, E, skew=True):
    if skew:  # a few hot keys, like expert routing
        p = rng.dirichlet(np.full(L * E, 0.3))
        return rng.choice(L * E, size=n, p=p).astype(np.int32)
    return rng.integers(0, L * E, size=n, dtype=np.int32)


# -- agreement with the references -----------------------------------------------------------

@pytest.mark.parametrize("name,ckw,rkw", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("nslots", [1, 3, 8, 17])
@pytest.mark.parametrize("passes", [None, 6, "random"])
def test_random_sequences(name, ckw, rkw, nslots, passes):
    rng = np.random.default_rng(nslots * 7 + len(name))
    L, E = 4, 6
    keys = random_keys(rng, 1000, L, E, skew=nslots % 2 == 1)
    ps = np.sort(rng.choice(len(keys), 150, replace=False)) if passes == "random" else passes
    h, v, rh, rv = run_both(name, ckw, rkw, keys, nslots, L, E, ps)
    assert_same(name, h, v, rh, rv)
    assert (v >= 0).sum() == max(0, (h == 0).sum() - nslots) or nslots > L * E


@pytest.mark.parametrize("name,ckw,rkw", VARIANTS + [("belady", {}, {})],
                         ids=VARIANT_IDS + ["belady"])
@pytest.mark.parametrize("mask_seed", [1, 99])
def test_random_evictable_mask(name, ckw, rkw, mask_seed):
    """victim() must respect evictable(); with nothing evictable the access bypasses."""
    rng = np.random.default_rng(mask_seed)
    L, E = 3, 8
    keys = random_keys(rng, 2000, L, E)
    for nslots in (1, 2, 5):
        h, v, rh, rv = run_both(name, ckw, rkw, keys, nslots, L, E, pass_starts=5,
                                mask_seed=mask_seed)
        assert_same(name, h, v, rh, rv)


@pytest.mark.parametrize("name,ckw,rkw", VARIANTS + [("belady", {}, {})],
                         ids=VARIANT_IDS + ["belady"])
def test_looping_sequences(name, ckw, rkw):
    L, E = 2, 10
    for loop, nslots in ((12, 8), (20, 19), (7, 7), (5, 9)):
        keys = np.tile(np.arange(loop, dtype=np.int32), 30)
        h, v, rh, rv = run_both(name, ckw, rkw, keys, nslots, L, E, pass_starts=loop)
        assert_same(name, h, v, rh, rv)
        if loop <= nslots:  # everything fits: only the first round misses
            assert h.sum() == len(keys) - loop


def test_loop_known_results():
    """Textbook facts, independent of any reference: a loop one longer than the cache never
    hits under LRU and FIFO, and Belady misses once per (nslots) accesses after warm-up."""
    keys = np.tile(np.arange(9, dtype=np.int32), 40)
    for p in ("lru", "fifo"):
        h, _ = replay(p, keys, 8, num_layers=1, num_experts=9)
        assert h.sum() == 0
    h, _ = replay("mru", keys, 8, num_layers=1, num_experts=9)
    assert h.sum() > 0.8 * len(keys)
    h, _ = replay("belady", keys, 8, num_layers=1, num_experts=9)
    assert h.sum() > 0.8 * len(keys)


def test_belady_future_that_deviates():
    """Live accesses missing from the future (or extra ones) follow the documented jump rule."""
    rng = np.random.default_rng(5)
    L, E = 2, 8
    keys = random_keys(rng, 1200, L, E)
    future = np.delete(keys, rng.choice(len(keys), 100, replace=False))
    future = np.concatenate([future[:300], random_keys(rng, 50, L, E), future[300:]])
    for nslots in (2, 5):
        pol = _C.Policy("belady", nslots, L, E, future=future)
        h, v = _C.replay(pol, keys)
        rh, rv = ref_replay(make_ref("belady", L, E, future=future.tolist()), keys.tolist(), nslots)
        assert_same("belady", h, v, np.array(rh, np.uint8), np.array(rv, np.int32))


# -- optimality ------------------------------------------------------------------------------

def all_specs(keys):
    return [LRU(), LFU(), FIFO(), MRU(), Random(0), Random(7), LeastStale("layer"),
            LeastStale("lru"), LeastStale("fifo")]


@pytest.mark.parametrize("seed", range(6))
def test_belady_is_optimal_on_random_sequences(seed):
    rng = np.random.default_rng(seed)
    L, E = 3, 7
    keys = random_keys(rng, 3000, L, E, skew=seed % 2 == 0)
    for nslots in (1, 4, 10):
        best = replay(Belady(keys), keys, nslots, num_layers=L, num_experts=E)[0].sum()
        for spec in all_specs(keys):
            got = replay(spec, keys, nslots, num_layers=L, num_experts=E, pass_starts=L * 2)[0].sum()
            assert best >= got, f"{spec} beat Belady at nslots={nslots}: {got} > {best}"


def brute_force_optimum(keys, nslots):
    """Fewest misses of any eviction choice, by exhaustive search over cache states."""
    states = {frozenset(): 0}  # state -> hits so far (best)
    for k in keys:
        nxt = {}
        for st, hits in states.items():
            if k in st:
                cands = [(st, hits + 1)]
            elif len(st) < nslots:
                cands = [(st | {k}, hits)]
            else:
                cands = [((st - {x}) | {k}, hits) for x in st]
            for s2, h2 in cands:
                if nxt.get(s2, -1) < h2:
                    nxt[s2] = h2
        states = nxt
    return max(states.values())


@pytest.mark.parametrize("seed", range(8))
def test_belady_matches_exhaustive_optimum(seed):
    rng = np.random.default_rng(100 + seed)
    keys = rng.integers(0, 6, size=40, dtype=np.int32)
    for nslots in (2, 3):
        h, _ = replay("belady", keys, nslots, num_layers=1, num_experts=6)
        assert h.sum() == brute_force_optimum(keys.tolist(), nslots)


# -- real traces ----------------------------------------------------------------------------

def capacities(trace):
    n = trace.num_layers * trace.num_experts
    return [max(1, round(f * n)) for f in (0.05, 0.10, 0.25)]


@pytest.mark.parametrize("name,ckw,rkw", VARIANTS + [("belady", {}, {})],
                         ids=VARIANT_IDS + ["belady"])
def test_real_trace_subset(puffin_subset, name, ckw, rkw):
    """The carried subset: the first 60 tokens at 5/10/25% capacity, a pass per token (the
    reference scans slots in Python, so the whole subset would be slow)."""
    tr = puffin_subset.slice(0, 60)
    keys = tr.keys()
    for nslots in capacities(tr):
        h, v, rh, rv = run_both(name, ckw, rkw, keys, nslots, tr.num_layers, tr.num_experts,
                                pass_starts=tr.num_layers * tr.top_k)
        assert_same(name, h, v, rh, rv)


@pytest.mark.parametrize("name", ["lru", "fifo", "mru"])
def test_real_trace_subset_whole(puffin_subset, name):
    """List-based policies whose references are O(1) per access: the whole subset."""
    tr = puffin_subset
    keys = tr.keys()
    nslots = capacities(tr)[1]
    h, v, rh, rv = run_both(name, {}, {}, keys, nslots, tr.num_layers, tr.num_experts,
                            pass_starts=tr.num_layers * tr.top_k)
    assert_same(name, h, v, rh, rv)


def test_real_trace_subset_belady_bound(puffin_subset):
    tr = puffin_subset.slice(0, 500)
    for nslots in capacities(tr):
        best = replay(Belady(tr), tr, nslots)[0].mean()
        for spec in all_specs(None):
            assert best >= replay(spec, tr, nslots)[0].mean(), spec


@pytest.fixture(scope="module")
def full_trace():
    """The full shared set: ../shared/traces beside the checkout, or $SPECMOE_FULL_TRACES."""
    path = Path(os.environ.get("SPECMOE_FULL_TRACES", SHARED))
    if not path.is_dir():
        pytest.skip(f"full shared traces not present ({path})")
    return specmoe.load_puffin(path)


@pytest.mark.slow
def test_full_traces(full_trace):
    """The full shared set (3.1M accesses): LRU against its reference at 10%, and Belady
    above every policy at 5% and 10% (the 25% replays are the slowest and add little)."""
    tr = full_trace
    keys = tr.keys()
    nslots = capacities(tr)[1]
    h, v, rh, rv = run_both("lru", {}, {}, keys, nslots, tr.num_layers, tr.num_experts,
                            pass_starts=tr.num_layers * tr.top_k)
    assert_same("lru", h, v, rh, rv)
    for nslots in capacities(tr)[:2]:
        best = replay(Belady(tr), tr, nslots)[0].mean()
        for spec in [LRU(), LFU(), FIFO(), MRU(), Random(0), LeastStale()]:
            assert best >= replay(spec, tr, nslots)[0].mean(), spec


# -- the Python bridge --------------------------------------------------------------------------

class PyLRU(PythonPolicy):
    def __init__(self):
        self.ref = RefLRU()
        self.events = 0

    def on_insert(self, slot, key, prefetch):
        assert prefetch is False
        self.events += 1
        self.ref.on_insert(slot, key, prefetch)

    def on_access(self, slot, key):
        self.events += 1
        self.ref.on_access(slot, key)

    def on_evict(self, slot, key):
        self.ref.on_evict(slot, key)

    def victim(self, candidates):
        assert candidates == sorted(candidates)
        return self.ref.victim(candidates)


@pytest.mark.parametrize("mask_seed", [0, 3])
def test_python_lru_matches_c_lru(mask_seed):
    rng = np.random.default_rng(9)
    keys = random_keys(rng, 3000, 4, 8)
    for nslots in (1, 6, 20):
        py = PyLRU()
        h1, v1 = replay(py, keys, nslots, num_layers=4, num_experts=8, mask_seed=mask_seed)
        h2, v2 = replay(LRU(), keys, nslots, num_layers=4, num_experts=8, mask_seed=mask_seed)
        assert np.array_equal(h1, h2) and np.array_equal(v1, v2)
        if not mask_seed:  # every access is one on_insert or on_access
            assert py.events == len(keys)


def test_python_policy_on_real_trace(puffin_subset):
    tr = puffin_subset.slice(0, 40)
    h1, v1 = replay(PyLRU(), tr, 100)
    h2, v2 = replay("lru", tr, 100)
    assert np.array_equal(h1, h2) and np.array_equal(v1, v2)


def test_python_policy_sees_passes():
    seen = []

    class P(PythonPolicy):
        def on_pass(self, pass_id):
            seen.append(pass_id)

        def victim(self, candidates):
            return candidates[-1]

    keys = np.arange(20, dtype=np.int32) % 7
    replay(P(), keys, 3, num_layers=1, num_experts=7, pass_starts=np.array([0, 5, 6, 19]))
    assert seen == [1, 2, 3, 4]


def test_duck_typed_python_policy():
    class Minimal:  # no base class, only victim
        def victim(self, candidates):
            return candidates[0]

    h, v = replay(Minimal(), np.array([0, 1, 2, 0], np.int32), 2, num_layers=1, num_experts=3)
    assert h.tolist() == [0, 0, 0, 0] and v.tolist() == [-1, -1, 0, 2]


@pytest.mark.parametrize("where", ["on_insert", "on_access", "on_evict", "on_pass", "victim"])
def test_raising_python_policy(where):
    class Boom(PythonPolicy):
        def victim(self, candidates):
            if where == "victim":
                raise KeyError("no idea")
            return candidates[0]

    def boom(*a):
        raise RuntimeError(f"broken {where}")

    pol = Boom()
    if where != "victim":
        setattr(pol, where, boom)
    keys = np.array([0, 1, 0, 2, 3, 1] * 3, np.int32)
    with pytest.raises(specmoe.PolicyError, match=where):
        replay(pol, keys, 2, num_layers=1, num_experts=4, pass_starts=3)
    # nothing left behind: the interpreter is fine and a new replay works
    assert _C.replay(_C.Policy("lru", 2, 1, 4), keys)[0].dtype == np.uint8


@pytest.mark.parametrize("answer", [7, -1, "0", None, 1.0])
def test_python_victim_not_a_candidate(answer):
    class Bad(PythonPolicy):
        def victim(self, candidates):
            return answer

    with pytest.raises(specmoe.PolicyError, match="not one of"):
        replay(Bad(), np.array([0, 1, 2], np.int32), 2, num_layers=1, num_experts=3)


def test_python_victim_must_exist():
    class NoVictim:
        def on_access(self, slot, key):
            pass

    with pytest.raises(TypeError, match="victim"):
        _C.Policy("python", 2, 1, 3, pyobj=NoVictim())
    with pytest.raises(TypeError):
        make_policy(object(), 2, 1, 3)
    h = PythonPolicy()
    with pytest.raises(specmoe.PolicyError, match="NotImplementedError"):
        replay(h, np.array([0, 1, 2], np.int32), 2, num_layers=1, num_experts=3)


def test_python_policy_released():
    """The bridge holds a reference to the Python object only while the policy lives."""
    import weakref

    p = PyLRU()
    r = weakref.ref(p)
    replay(p, np.array([0, 1, 2], np.int32), 2, num_layers=1, num_experts=3)
    c = _C.Policy("python", 2, 1, 3, pyobj=p)
    del p
    assert r() is not None
    del c
    gc.collect()
    assert r() is None


# -- the API and bad input ----------------------------------------------------------------------

def test_make_policy_forms():
    for spec in [LRU(), "lfu", "LEAST_STALE", LeastStale("fifo"), Random(3), Belady([0, 1, 2]),
                 PyLRU()]:
        p = make_policy(spec, 4, 1, 3)
        assert isinstance(p, _C.Policy) and p.nslots == 4 and not p.in_use
    p = _C.Policy("mru", 4, 2, 3)
    assert make_policy(p, 4, 2, 3) is p
    with pytest.raises(ValueError, match="built for"):
        make_policy(p, 5, 2, 3)
    assert set(POLICY_NAMES) == {"lru", "lfu", "fifo", "mru", "random", "least_stale", "belady",
                                "spac", "spac_ema", "lhu", "fld", "score", "nextuse"}
    assert make_policy(Belady(specmoe.Trace(np.zeros((2, 1, 1)), 3)), 1, 1, 3).name == "belady"


def test_policy_is_taken_once():
    p = _C.Policy("lru", 2, 1, 3)
    _C.replay(p, np.array([0, 1], np.int32))
    assert p.in_use and "in use" in repr(p)
    with pytest.raises(specmoe.PolicyError, match="in use"):
        _C.replay(p, np.array([0, 1], np.int32))
    with pytest.raises(specmoe.PolicyError, match="in use"):
        make_policy(p, 2, 1, 3)


def test_bad_input():
    with pytest.raises(ValueError, match="lru, lfu, fifo, mru, random, least_stale, belady"):
        make_policy("nope", 4, 1, 3)
    with pytest.raises(ValueError, match="least_stale"):
        _C.Policy("nope", 4, 1, 3)
    with pytest.raises(ValueError, match="nslots"):
        make_policy("lru", 0, 1, 3)
    with pytest.raises(ValueError, match="num_layers"):
        _C.Policy("lru", 1, 0, 3)
    with pytest.raises(ValueError, match="num_experts"):
        _C.Policy("lru", 1, 1, -2)
    with pytest.raises(ValueError, match="int32"):
        _C.Policy("lru", 1, 1 << 16, 1 << 16)
    with pytest.raises(TypeError):
        _C.Policy("lru", 1.5, 1, 3)
    with pytest.raises(ValueError, match="future"):
        make_policy("belady", 4, 1, 3)
    with pytest.raises(ValueError, match="future"):
        _C.Policy("belady", 4, 1, 3)
    with pytest.raises(ValueError, match="future"):
        _C.Policy("belady", 4, 1, 3, future=np.array([], np.int32))
    with pytest.raises(ValueError, match="key 3 at position 1"):
        _C.Policy("belady", 4, 1, 3, future=[0, 3])
    with pytest.raises(ValueError, match="key -1"):
        make_policy(Belady(np.array([-1])), 4, 1, 3)
    with pytest.raises(TypeError):
        _C.Policy("belady", 4, 1, 3, future=np.array([0.5]))
    with pytest.raises(ValueError, match="1-D"):
        _C.Policy("belady", 4, 1, 3, future=np.zeros((2, 2), np.int32))
    with pytest.raises(ValueError, match="belady only"):
        _C.Policy("lru", 4, 1, 3, future=[0])
    with pytest.raises(ValueError, match="pyobj"):
        _C.Policy("python", 4, 1, 3)
    with pytest.raises(ValueError, match="python policy only"):
        _C.Policy("lru", 4, 1, 3, pyobj=PyLRU())
    with pytest.raises(ValueError, match="order"):
        _C.Policy("least_stale", 4, 1, 3, order="newest")
    with pytest.raises(ValueError, match="order"):
        _C.Policy("least_stale", 4, 1, 3, order=3)
    with pytest.raises(ValueError, match="order"):
        LeastStale("newest")
    with pytest.raises(ValueError, match="seed"):
        _C.Policy("random", 4, 1, 3, seed=-1)


def test_replay_bad_input():
    mk = lambda: _C.Policy("lru", 2, 2, 3)  # noqa: E731
    with pytest.raises(ValueError, match="key 6 at position 2"):
        _C.replay(mk(), [0, 1, 6])
    with pytest.raises(ValueError, match="1-D"):
        _C.replay(mk(), np.zeros((2, 2), np.int32))
    with pytest.raises(ValueError, match="increase"):
        _C.replay(mk(), [0, 1, 2], np.array([0, 2, 2]))
    with pytest.raises(ValueError, match="negative"):
        _C.replay(mk(), [0, 1, 2], np.array([-1, 2]))
    with pytest.raises(ValueError, match="pass"):
        _C.replay(mk(), [0, 1, 2], 0)
    with pytest.raises(TypeError, match="Policy"):
        _C.replay("lru", [0, 1])
    with pytest.raises(ValueError, match="num_layers"):
        replay("lru", np.array([0, 1]), 2)
    p = mk()
    with pytest.raises(ValueError):
        _C.replay(p, [0, 9])
    assert not p.in_use  # rejected input does not consume the policy
    h, v = _C.replay(p, np.array([], np.int32))
    assert h.shape == (0,) and v.shape == (0,)


def test_random_is_deterministic():
    keys = random_keys(np.random.default_rng(1), 2000, 2, 10)
    a = replay(Random(5), keys, 4, num_layers=2, num_experts=10)[1]
    b = replay(Random(5), keys, 4, num_layers=2, num_experts=10)[1]
    c = replay(Random(6), keys, 4, num_layers=2, num_experts=10)[1]
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_least_stale_prefers_stale():
    """Hand-made: slots touched in the current pass survive while a stale one exists."""
    L, E = 2, 4
    # pass 1: keys 0,1,2 ; pass 2: 2, then 5 (miss, cache full of 0,1,2): victim must be stale
    keys = np.array([0, 1, 2, 2, 5], np.int32)
    for order in ("layer", "lru", "fifo"):
        h, v = replay(LeastStale(order), keys, 3, num_layers=L, num_experts=E,
                      pass_starts=np.array([0, 3]))
        assert v[4] in (0, 1)
    # the layer order: current layer 1 (key 5); stale keys 0,1 are layer 0: d = 0-1+2 = 1 each,
    # tie -> oldest touch: key 0
    h, v = replay(LeastStale("layer"), keys, 3, num_layers=L, num_experts=E,
                  pass_starts=np.array([0, 3]))
    assert v[4] == 0


def test_least_stale_keeps_current_layer_stale_experts():
    """Hand-made regression for the collision-miss defect (docs/simulator.md): pass 1 uses
    keys 0, 1 (layer 0) and 4, 5 (layer 1), filling 4 slots; pass 2 hits 0, then misses on 2
    (layer 0, so the current layer is 0).  Every other slot is stale; the stale expert of the
    current layer (key 1) may still be routed to by this layer and must go last, so key 4
    (layer 1) is evicted, and the layer's next access, key 1, hits.  Evicting key 1 (the old
    rule: the current layer is the furthest) turned that access into a collision miss."""
    keys = np.array([0, 1, 4, 5, 0, 2, 1], np.int32)
    h, v = replay(LeastStale("layer"), keys, 4, num_layers=2, num_experts=4,
                  pass_starts=np.array([0, 4]))
    assert v.tolist() == [-1, -1, -1, -1, -1, 4, -1]
    assert h.tolist() == [0, 0, 0, 0, 1, 0, 1]


def test_python_policies_in_threads():
    """Replays release the GIL and the bridge re-takes it per event: several threads running
    Python and C policies at once give the same answers as one at a time."""
    import threading

    keys = random_keys(np.random.default_rng(4), 4000, 4, 8)
    want = replay(LRU(), keys, 7, num_layers=4, num_experts=8, mask_seed=11)
    got, errors = [], []

    def work(i):
        try:
            spec = PyLRU() if i % 2 == 0 else LRU()
            got.append(replay(spec, keys, 7, num_layers=4, num_experts=8, mask_seed=11))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(got) == 6
    for h, v in got:
        assert np.array_equal(h, want[0]) and np.array_equal(v, want[1])

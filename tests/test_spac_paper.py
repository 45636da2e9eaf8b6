"""MoE-SpAc as published ("spac", csrc/policy/spac.c: Algorithm 1, tau_t, multi-level eviction
queues) and SpecMD's eviction baselines ("lhu", "fld", "score") against the plain-Python
references in tests/ref_policies.py (written from the papers): identical hits and victims on
random verification streams and on the real DeepSeek-V2-Lite trace subset, identical
utilities through the live ExpertCache, identical simulator counters (tests/sim_reference.py),
plus hand-worked steps of Algorithm 1 that do not go through any reference."""
from __future__ import annotations

import numpy as np
import pytest

from specmoe import _C
from specmoe.runtime.cache import ExpertCache
from specmoe.runtime.policies import FLD, LHU, Score, SpAc, make_policy, replay
from specmoe.sim.replay import simulate
from specmoe.storage.store import ExpertStore, write_store

from .ref_policies import RefFLD, RefLHU, RefScore, RefSpAc, ref_replay
from .sim_reference import FromCandidates, ref_simulate
from .test_spac import HW, _random_trace, verify_stream


def _assert_same(got, ref, what=""):
    h, v = got
    rh, rv = ref
    rv = np.array(rv, np.int32)
    if not np.array_equal(v, rv):
        i = int(np.argmax(v != rv))
        pytest.fail(f"{what}: first differing victim at access {i}: C {v[i]} ref {rv[i]}")
    assert np.array_equal(h, np.array(rh, np.uint8)), what


# -- Algorithm 1 by hand --------------------------------------------------------------------------

def test_algorithm1_steps_by_hand():
    """One layer of 3 experts, K = 4, gamma = 8 (theta = 4).  Worked from §3.2:
    step 1 f=(5,1,0): d=(5,1,0): expert 0 up (5 >= 4), theta_up0 = (36+5)//10 = 4; expert 1
    stays, theta_up1 = (36+1)//10 = 3.  step 2 f=(5,4,0): d1 = 3 >= 3: up; theta_up1 = 3.
    step 3 f=(0,0,0): d0 = -5: -d >= 4: down to 0, theta_dn0 = (36+5)//10 = 4; d1 = -4 >= 4:
    down to 0.  step 4 f=(4,0,0): d0 = 4 >= 4: up to 1."""
    ref = RefSpAc(1, 3, 4, 8, nslots=2)
    with ExpertCache(_store1(), 2, SpAc(levels=4, gamma=8), top_k=1, prefetch=False) as cache:
        want = [[1, 0, 0], [1, 1, 0], [0, 0, 0], [1, 0, 0]]
        for f, w in zip([(5, 1, 0), (5, 4, 0), (0, 0, 0), (4, 0, 0)], want):
            cache.observe_counts([0, 0, 0], [0, 1, 2], list(f))
            ref.on_counts([0, 1, 2], list(f))
            assert cache.utility([0, 0, 0], [0, 1, 2]).tolist() == w
            assert ref.util == w


def test_algorithm1_inertia_and_saturation():
    """A steady frequency does not move the utility (d = 0); a rise of theta or more per step
    climbs one level per step and stops at K; gamma <= 1 gives boundaries of 1 (spac.c)."""
    with ExpertCache(_store1(), 2, SpAc(levels=3, gamma=4), top_k=1, prefetch=False) as cache:
        for _ in range(5):  # f steady at 0: nothing moves, dormant experts stay 0
            cache.observe_counts([0], [0], [0])
        assert cache.utility([0, 0, 0], [0, 1, 2]).tolist() == [0, 0, 0]
        u = []
        for f in (2, 4, 6, 8, 10):  # d = 2 >= theta (2; then (18+2)//10 = 2): one level a step
            cache.observe_counts([0], [1], [f])
            u.append(int(cache.utility([0], [1])[0]))
        assert u == [1, 2, 3, 3, 3]
        cache.observe_counts([0], [1], [10])  # steady: stays
        assert cache.utility([0], [1])[0] == 3
    with ExpertCache(_store1(), 2, SpAc(levels=2, gamma=0), top_k=1, prefetch=False) as cache:
        cache.observe_counts([0], [2], [0])  # theta 1, not 0: a dormant expert does not climb
        assert cache.utility([0], [2])[0] == 0
        cache.observe_counts([0], [2], [1])  # one token per pass: 0 -> 1 is a rise of 1
        assert cache.utility([0], [2])[0] == 1


_STORE = {}


def _store1():
    """A tiny one-layer store (3 experts) shared by the hand-worked tests."""
    if "s" not in _STORE:
        import tempfile
        d = tempfile.TemporaryDirectory(prefix="spac_paper")  # removed at exit, held below
        rng = np.random.default_rng(0)
        write_store(f"{d.name}/e.smoe", [{"w": rng.standard_normal((3, 2, 16)).astype(np.float32)}],
                    top_k=1, progress=False).close()
        _STORE["dir"], _STORE["s"] = d, f"{d.name}/e.smoe"
    return ExpertStore(_STORE["s"])


def test_eviction_queues_fifo_within_level():
    """Victim = head of the lowest level; inside a level the first to enter it (insert or a
    level change), not the least recently used; tau = smallest level whose hot set fits."""
    E = 4
    p = _C.Policy("spac", 3, 1, E, levels=2, gamma=2)  # theta 1
    # keys 0, 1, 2 fill slots 0, 1, 2; then 0 is accessed again; counts raise key 1 to level 1
    keys = np.array([0, 1, 2, 0, 3, 0], np.int32)
    counts = (np.array([1], np.int32), np.array([1], np.int64), np.array([0, 0, 1], np.int64))
    h, v = _C.replay(p, keys, np.array([0, 4], np.int64), counts=counts)
    # access 4 (key 3) misses: level 0 holds keys 0 and 2 (key 0 entered first, its access does
    # not reorder): evict key 0; then key 0 misses and evicts key 2 (key 1 is on level 1)
    assert v.tolist() == [-1, -1, -1, -1, 0, 2]
    ref = RefSpAc(1, E, 2, 2, nslots=3)
    _assert_same((h, v), ref_replay(ref, keys.tolist(), 3, [0, 4], counts=counts), "fifo")
    assert ref.threshold() == 1  # one hot key fits 3 slots


def test_threshold_and_prefetch_admission_in_simulator():
    """tau rises when the hot set outgrows the cache; the simulator drops prefetches of cold
    experts (utility < tau) and matches the reference with the same rule."""
    ref = RefSpAc(1, 8, 2, 2, nslots=2)
    ref.on_counts(list(range(8)), [1, 1, 1, 0, 0, 0, 0, 0])  # 3 keys on level 1: 3 > 2 slots
    assert ref.threshold() == 2
    ref.on_counts(list(range(8)), [2, 0, 0, 0, 0, 0, 0, 0])
    assert [ref.utility(k) for k in range(3)] == [2, 0, 0] and ref.threshold() == 1
    from specmoe.sim.replay import Predictor

    rng = np.random.default_rng(4)
    L, E, k = 4, 12, 2
    ex = _random_trace(rng, 60, L, E, k)
    for nslots in (8, 16):
        for pred in (dict(kind="oracle", depth=2), dict(kind="history", topk=4)):
            got = _C.simulate(ex, E, "spac", nslots, levels=3, gamma=2,
                              **Predictor(**pred).c_args(), **HW)
            want = ref_simulate(ex, E, nslots, FromCandidates(RefSpAc(L, E, 3, 2, nslots)), HW,
                                pred)
            for key, val in want.items():
                if isinstance(val, float):
                    assert got[key] == pytest.approx(val, rel=1e-9, abs=1e-12), key
                else:
                    assert got[key] == val, (key, nslots, pred)
            assert got["prefetch_dropped"] > 0


@pytest.mark.parametrize("kw", [{"gate": False}, {"tau": 2}, {"up": 3, "dn": 1},
                                {"tau": 1, "gate": False}])
def test_ablations_in_simulator_match_reference(kw):
    """MoE-SpAc's ablations (§4.4) with prefetch: the C simulator with each variant equals the
    reference simulator with the reference policy's same variant; without the gate nothing is
    dropped for being cold, and each variant changes the run (so none is a no-op).  (The
    plain-counts estimator equals Algorithm 1 at one token a pass, f being 0 or 1, and
    prefetch replays one token a pass: test_replay_matches_reference covers it.)"""
    from specmoe.sim.replay import Predictor

    rng = np.random.default_rng(5)
    L, E, k, nslots = 4, 12, 2, 9
    ex = _random_trace(rng, 80, L, E, k)
    pred = dict(kind="history", topk=4)

    def run(kws):
        got = _C.simulate(ex, E, _C.Policy("spac", nslots, L, E, levels=3, gamma=2, **kws),
                          nslots, **Predictor(**pred).c_args(), **HW)
        want = ref_simulate(ex, E, nslots, FromCandidates(REFS["spac"](
            L, E, nslots, dict(kws, levels=3, gamma=2))), HW, pred)
        for key, val in want.items():
            if isinstance(val, float):
                assert got[key] == pytest.approx(val, rel=1e-9, abs=1e-12), (key, kws)
            else:
                assert got[key] == val, (key, kws)
        return got

    base, abl = run({}), run(kw)
    assert base["prefetch_dropped"] > 0
    if kw.get("gate") is False:
        assert abl["prefetch_dropped"] == 0
    assert (abl["hits"], abl["prefetch_dropped"], abl["evictions"]) != \
        (base["hits"], base["prefetch_dropped"], base["evictions"])


def test_ablation_specs_by_string_and_object():
    """"spac:up=3,dn=1" and friends name the same policy as SpAc(up=3, dn=1): equal results
    through simulate(); bad ablation options are refused by name."""
    from specmoe.sim.replay import parse_policy, Predictor
    from specmoe.sim.traces import Trace

    rng = np.random.default_rng(6)
    tr = Trace(experts=_random_trace(rng, 40, 3, 10, 2), num_experts=10)
    for spec, obj in (("spac:up=3,dn=1", SpAc(up=3, dn=1)), ("spac:tau=2", SpAc(tau=2)),
                      ("spac:estimator=counts", SpAc(estimator="counts")),
                      ("spac:gate=0,levels=3", SpAc(levels=3, gate=False))):
        a = simulate(tr, spec, 6, prefetch=Predictor("history", topk=3))
        b = simulate(tr, obj, 6, prefetch=Predictor("history", topk=3))
        assert (a.hits, a.prefetch_issued, a.prefetch_dropped, a.total_s) == \
            (b.hits, b.prefetch_issued, b.prefetch_dropped, b.total_s), spec
        assert a.policy == spec
    assert parse_policy("spac:gate=1")[1] == {"gate": True}
    for bad, match in (("spac:up=3", "both up and dn"), ("spac:tau=5", "tau must be"),
                       ("spac:estimator=ema", "bad policy option"), ("lru:tau=2", "takes")):
        with pytest.raises(ValueError, match=match):
            simulate(tr, bad, 6)
    with pytest.raises(ValueError, match="spac only"):
        _C.Policy("lru", 4, 3, 10, gate=False)
    with pytest.raises(ValueError, match="tau must be in 1..levels"):
        _C.Policy("spac", 4, 3, 10, levels=2, tau=3)


# -- random streams and the real trace ------------------------------------------------------------

REFS = {
    "spac": lambda L, E, ns, kw: RefSpAc(L, E, kw.get("levels", 4), kw.get("gamma", 8), ns,
                                         up=kw.get("up"), dn=kw.get("dn"), tau=kw.get("tau"),
                                         counts=kw.get("counts", False),
                                         gate=kw.get("gate", True)),
    "lhu": lambda L, E, ns, kw: RefLHU(),
    "fld": lambda L, E, ns, kw: RefFLD(L, E),
    "score": lambda L, E, ns, kw: RefScore(),
}


@pytest.mark.parametrize("name,kw", [("spac", {"levels": 1, "gamma": 0}),
                                     ("spac", {"levels": 4, "gamma": 3}),
                                     ("spac", {"levels": 7, "gamma": 8}),
                                     ("spac", {"levels": 4, "gamma": 8, "up": 3, "dn": 1}),
                                     ("spac", {"levels": 4, "gamma": 3, "tau": 2}),
                                     ("spac", {"levels": 5, "gamma": 3, "counts": True}),
                                     ("lhu", {}), ("fld", {}), ("score", {})])
@pytest.mark.parametrize("nslots", [1, pytest.param(5, marks=pytest.mark.slow), 23])
@pytest.mark.parametrize("mask_seed", [0, 7])
def test_replay_matches_reference(name, kw, nslots, mask_seed):
    rng = np.random.default_rng(nslots + mask_seed + len(name))
    L, E, k = 4, 8, 2
    keys, starts, counts = verify_stream(rng, 200, L, E, k, gmax=6)
    got = _C.replay(_C.Policy(name, nslots, L, E, **kw), keys, starts, mask_seed=mask_seed,
                    counts=counts)
    ref = ref_replay(REFS[name](L, E, nslots, kw), keys.tolist(), nslots, starts.tolist(),
                     mask_seed, counts=counts)
    _assert_same(got, ref, f"{name} {kw}")
    assert (got[0] == 0).sum() > nslots


def _trace_counts(tr, g):
    """Keys, pass starts and per-pass counts of verification groups of g tokens (the replay form
    of what csrc/sim.c does with verify_tokens = g)."""
    L, E = tr.num_layers, tr.num_experts
    keys, starts, ck, cv, offs = [], [], [], [], [0]
    for t0 in range(0, tr.num_tokens, g):
        block = tr.experts[t0:t0 + g]
        starts.append(len(keys))
        cnt: dict[int, int] = {}
        for l in range(L):
            seen = dict.fromkeys(l * E + int(e) for row in block for e in row[l])
            keys.extend(seen)
            for row in block:
                for e in row[l]:
                    cnt[l * E + int(e)] = cnt.get(l * E + int(e), 0) + 1
        ck.extend(cnt)
        cv.extend(cnt.values())
        offs.append(len(ck))
    return (np.array(keys, np.int32), np.array(starts, np.int64),
            (np.array(ck, np.int32), np.array(cv, np.int64), np.array(offs, np.int64)))


@pytest.mark.parametrize("g", [1, 4])
@pytest.mark.parametrize("name", ["spac", "lhu", "fld", "score"])
def test_real_trace_matches_reference(puffin_subset, name, g):
    tr = puffin_subset.slice(0, 60)
    L, E = tr.num_layers, tr.num_experts
    nslots = L * E // 10
    keys, starts, counts = _trace_counts(tr, g)
    kw = {"levels": 4, "gamma": g - 1} if name == "spac" else {}
    got = _C.replay(_C.Policy(name, nslots, L, E, **kw), keys, starts, counts=counts)
    ref = ref_replay(REFS[name](L, E, nslots, kw), keys.tolist(), nslots, starts.tolist(),
                     counts=counts)
    _assert_same(got, ref, f"{name} g={g}")
    # the simulator's verification groups are the same replay (demand only)
    r = simulate(tr, name, nslots, verify_tokens=g)
    assert r.hits == int(got[0].sum()) and r.accesses == len(keys)


@pytest.mark.parametrize("g", [1, 3])
@pytest.mark.parametrize("name", ["spac", "lhu", "fld", "score"])
def test_sim_groups_match_reference(name, g):
    rng = np.random.default_rng(g)
    L, E, k, nslots = 3, 12, 2, 7
    ex = _random_trace(rng, 61, L, E, k)
    kw = {"levels": 3, "gamma": 2} if name == "spac" else {}
    got = _C.simulate(ex, E, name, nslots, verify_tokens=g, **kw, **HW)
    ref = ref_simulate(ex, E, nslots, FromCandidates(REFS[name](L, E, nslots, kw)), HW,
                       verify_tokens=g)
    for key, val in ref.items():
        if isinstance(val, float):
            assert got[key] == pytest.approx(val, rel=1e-9, abs=1e-12), key
        else:
            assert got[key] == val, key


# -- the specs, the cache, bad input --------------------------------------------------------------

def test_specs_and_cache():
    assert make_policy(SpAc(levels=3, gamma=5), 4, 2, 3).name == "spac"
    for spec, name in ((LHU(), "lhu"), (FLD(), "fld"), (Score(), "score")):
        assert make_policy(spec, 4, 2, 3).name == name
    rng = np.random.default_rng(2)
    keys, starts, counts = verify_stream(rng, 60, 2, 3, 1, gmax=3)
    a = replay(SpAc(levels=2, gamma=4), keys, 3, num_layers=2, num_experts=3, pass_starts=starts,
               counts=counts)
    b = replay("spac", keys, 3, num_layers=2, num_experts=3, pass_starts=starts, counts=counts)
    ref = ref_replay(RefSpAc(2, 3, 2, 4, 3), keys.tolist(), 3, starts.tolist(), counts=counts)
    _assert_same(a, ref, "spec")
    refb = ref_replay(RefSpAc(2, 3, 4, 8, 3), keys.tolist(), 3, starts.tolist(), counts=counts)
    _assert_same(b, refb, "default gamma 8, K 4")
    # the live cache: utilities after each observation equal the reference's
    with ExpertCache(_store1(), 2, SpAc(levels=3, gamma=3), top_k=1, prefetch=False) as cache:
        r = RefSpAc(1, 3, 3, 3, 2)
        for _ in range(40):
            c = rng.integers(0, 5, size=3)
            cache.observe_counts([0, 0, 0], [0, 1, 2], c)
            r.on_counts([0, 1, 2], c.tolist())
            assert cache.utility([0, 0, 0], [0, 1, 2]).tolist() == r.util


def test_bad_input():
    for bad in (-1, 65537):
        with pytest.raises(ValueError, match="gamma"):
            _C.Policy("spac", 4, 2, 3, gamma=bad)
        with pytest.raises(ValueError, match="gamma"):
            SpAc(gamma=bad)
    with pytest.raises(TypeError, match="gamma"):
        _C.Policy("spac", 4, 2, 3, gamma="8")
    with pytest.raises(ValueError, match="levels"):
        SpAc(levels=0)
    with pytest.raises(ValueError, match="gamma"):
        _C.simulate(np.zeros((2, 1, 1), np.int16), 3, "spac", 2, gamma=-2, **HW)
    from specmoe.sim.replay import parse_policy

    assert parse_policy("spac:levels=3,gamma=7") == ("spac", {"levels": 3, "gamma": 7})
    with pytest.raises(ValueError, match="gamma"):
        parse_policy("spac:gamma=x")


def test_ablation_benchmark_reports_every_variant(tmp_path):
    """benchmarks/spac_ablation.py --quick on the test traces: both tables, every variant with
    its vs_spac against spac in the same setting, and the gate's row dropping nothing."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, str(root / "benchmarks" / "spac_ablation.py"),
                          "--quick", "--json", "--trace", str(root / "tests" / "data" / "puffin"),
                          "--save", str(tmp_path / "a.json")],
                         capture_output=True, text=True, timeout=300, check=True)
    d = json.loads(out.stdout)
    assert json.loads((tmp_path / "a.json").read_text())["passes"] == d["passes"]
    assert {r["variant"] for r in d["passes"]} == {
        "spac", "w/o SpecUE (K=1)", "w/o AdaBC (theta 3/1)", "no estimator (counts)",
        "w/o SG-Evictor (lru)"}
    assert {r["variant"] for r in d["prefetch"]} == {
        "spac", "separate scores (no tau gate)", "w/o HetWB (tau=2)", "w/o SG-Prefetcher",
        "w/o SG-Evictor (lru)"}
    by = {r["variant"]: r for r in d["prefetch"]}
    assert by["spac"]["vs_spac"] == 1.0 and by["spac"]["prefetch_dropped"] > 0
    assert by["separate scores (no tau gate)"]["prefetch_dropped"] == 0
    assert by["w/o SG-Prefetcher"]["prefetch_issued"] == 0
    for r in d["passes"] + d["prefetch"]:
        assert r["vs_spac"] == pytest.approx(r["est_tpot_ms"] / next(
            s["est_tpot_ms"] for s in d["passes" if r in d["passes"] else "prefetch"]
            if s["variant"] == "spac"), abs=1e-3)
    assert d["summary"]["passes"]["spac"]["settings"] == 1

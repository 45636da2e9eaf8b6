"""Smoke test of ``benchmarks/predictors.py`` (issue 42) on the carried trace subset: it runs,
prints one JSON object with both prediction tables (with and without the token prior) and
simulator rows carrying the fields the issue asks for, the token prior's ablation beside
each learned row.  Speed figures are not checked (simulated and wall times only).  Runs
under ``make test-bench`` (SPECMOE_TEST_BENCH=1)."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import HERE, SUBSET

pytestmark = pytest.mark.skipif(not os.environ.get("SPECMOE_TEST_BENCH"),
                                reason="benchmark smoke tests: make test-bench")


def test_predictors_quick_on_the_subset():
    out = subprocess.run([sys.executable, str(HERE.parent / "benchmarks" / "predictors.py"),
                          "--json", "--trace", str(SUBSET), "--split", "all", "--quick",
                          "--sample", "0.05"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    d = json.loads(out.stdout)
    assert d["prediction"]["token_prior"] and d["prediction"]["tokens_with_prior"] > 0.5
    assert not d["prediction_without_token_prior"]["token_prior"]
    for key in ("machine", "offline_bound", "admission_summary"):
        assert key in d
    rows = d["sim"]
    for r in rows:
        for f in ("policy", "predictor", "capacity", "hardware", "hit_rate", "est_tpot_ms",
                  "vs_offline_bound", "untimed_hit_rate", "token_prior"):
            assert f in r, (f, r)
    learned = [(r["policy"], r["admission"], r["token_prior"]) for r in rows
               if r["predictor"] == "learned" and r["policy"] != "nextuse+prior"]
    assert {tp for _, _, tp in learned} == {True, False}
    assert any(r["policy"] == "belady" and r["vs_offline_bound"] == 1.0 for r in rows)
    untimed = {(r["policy"], r["predictor"], r["token_prior"]): r["hit_rate"]
               for r in d["untimed"]}
    # with a link that takes no time the oracle's prefetch makes every access a hit under LRU
    assert untimed[("lru", "oracle:depth=1", False)] == 1.0
    assert untimed[("nextuse", "learned:topk=12", True)] > untimed[("nextuse", "none", False)]


def _predictors_module():
    """benchmarks/predictors.py as a module (it imports benchmarks/hostinfo.py)."""
    import importlib.util
    if str(HERE.parent / "benchmarks") not in sys.path:
        sys.path.insert(0, str(HERE.parent / "benchmarks"))
    spec = importlib.util.spec_from_file_location(
        "predictors_bench", HERE.parent / "benchmarks" / "predictors.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_horizon_oracle_values_by_hand():
    """HorizonOracle against values worked out by hand on a 2-layer, 4-expert, top-1 trace:
    tokens route (layer 0, layer 1) to (0, 1), (2, 3), (0, 3), (1, 3).  In token 0's pass,
    after layer 0 asked for expert 0 (rates are all 0 in the first pass):
    key 0 = (0, 0) was touched, so its next run is token 1's (dl = 2): unused there, used at
    token 2; key 2 = (0, 2) is in the running layer and not asked for (dl = 0): unused at
    token 0, used at token 1; key 5 = (1, 1) runs next (dl = 1) and is used there; key 7 =
    (1, 3) runs next (dl = 1), unused there, used at token 1."""
    import numpy as np
    from specmoe.sim.traces import Trace

    P = _predictors_module()
    ex = np.array([[[0], [1]], [[2], [3]], [[0], [3]], [[1], [3]]], np.int16)
    tr = Trace(experts=ex, num_experts=4)

    def state(H: int):
        o = P.HorizonOracle(tr, H)
        o.on_pass(1)
        for slot, key in enumerate((0, 2, 5, 7)):
            o.on_insert(slot, key, True)  # prefetched: no use
        o.on_access(0, 0)                 # layer 0 asks for expert 0
        return o

    c, L = 1.0, 2
    keys = np.array([0, 2, 5, 7])
    assert np.allclose(state(0).values(keys), 0.0)
    assert np.allclose(state(1).values(keys), [0.0, 0.0, 1 / (1 + c), 0.0])
    assert np.allclose(state(2).values(keys), [1 / (2 + L + c), 1 / (0 + L + c), 1 / (1 + c),
                                               1 / (1 + L + c)])
    # H = 1 sees none of the later uses: the first of the tie goes, whichever slot it is
    assert state(1).victim([0, 1, 2, 3]) == 0
    assert state(1).victim([3, 1, 0, 2]) == 3
    # H = 2: key 0's use is the farthest
    assert state(2).victim([3, 1, 0, 2]) == 0
    assert state(2).victim([1, 3]) == 3
    assert state(2).victim([2, 1]) == 1
    # after layer 1 asked for expert 1 every key's next run is token 1's (layer 0's keys at
    # dl = 1, layer 1's at 2, except key 7: layer 1 running, not asked for, dl = 0, token 0)
    # where only key 2 is used; current_only knows token 0 alone, so none of them
    later = state(1)
    later.on_access(2, 5)
    assert np.allclose(later.values(keys), [0.0, 1 / (1 + c), 0.0, 0.0])
    cur = P.HorizonOracle(tr, 1, current_only=True)
    cur.on_pass(1)
    for slot, key in enumerate((0, 2, 5, 7)):
        cur.on_insert(slot, key, True)
    cur.on_access(0, 0)
    assert np.allclose(cur.values(keys), [0.0, 0.0, 1 / (1 + c), 0.0])  # key 5: this token
    cur.on_access(2, 5)
    assert np.allclose(cur.values(keys), 0.0)
    with pytest.raises(ValueError):
        P.HorizonOracle(tr, 2, current_only=True)


def test_horizon_rows_on_the_subset():
    out = subprocess.run([sys.executable, str(HERE.parent / "benchmarks" / "predictors.py"),
                          "--json", "--trace", str(SUBSET), "--split", "all", "--quick",
                          "--sample", "0.02", "--horizon", "0,current,2"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = json.loads(out.stdout)["horizon"]
    assert [r["policy"] for r in rows] == ["horizon_oracle:0", "horizon_oracle:current",
                                           "horizon_oracle:2"]
    for r in rows:
        for f in ("predictor", "capacity", "hardware", "hit_rate", "est_tpot_ms",
                  "vs_offline_bound"):
            assert f in r, (f, r)
    # two tokens of exact routing keep more of what is needed than the use rate alone
    assert rows[2]["hit_rate"] > rows[0]["hit_rate"]
    bad = subprocess.run([sys.executable, str(HERE.parent / "benchmarks" / "predictors.py"),
                          "--horizon", "1,x"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "--horizon" in bad.stderr

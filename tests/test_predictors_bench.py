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

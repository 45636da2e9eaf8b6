"""benchmarks/speculation.py --quick --json: a smoke run of the speculative-decoding benchmark.

Checks the structure of its one JSON object (every row present with its fields, finite positive
ratios) and that every speculative row's greedy output equals plain decoding's.  No timing
assertions: speed is what the benchmark reports, not what a test checks."""
from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys

import pytest

from tests.conftest import HERE, skip_unless_free_disk

# A benchmark script's smoke run (half a minute of make test's 15): `make test-bench`, which
# .ci/run calls, runs it
pytestmark = pytest.mark.skipif(not os.environ.get("SPECMOE_TEST_BENCH"),
                                reason="benchmark smoke runs: make test-bench runs them")

ROOT = HERE.parent
SCRIPT = ROOT / "benchmarks" / "speculation.py"

WORKLOADS = ("code", "prose", "mix")
DRAFTERS = ("ngram", "draft", "self")
SPEC_ROWS = [("static", 1), ("static", 2), ("static", 3), ("heuristic", None),
             ("cascade", None), ("speq", None)]
FIELDS = ("workload", "drafter", "controller", "k", "tok_per_s_vs_nospec", "etr",
          "experts_loaded_per_token", "tok_per_s", "acceptance", "k_mean", "outputs_equal")


def _zoo_ready() -> bool:
    try:
        from specmoe import zoo
    except ImportError:
        return False
    return zoo.available("tiny-moe") and zoo.available("tiny-draft")


@pytest.fixture(scope="module")
def result() -> dict:
    if not _zoo_ready():
        pytest.skip("zoo weights not in the package")
    p = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    lines = [ln for ln in p.stdout.splitlines() if ln.strip()]
    assert len(lines) == 1, f"expected one JSON line on stdout, got {len(lines)}"
    return json.loads(lines[0])


def _finite_pos(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def test_every_row_present_once(result):
    got = [(r["workload"], r["drafter"], r["controller"], r["k"]) for r in result["rows"]]
    want = [(w, None, "nospec", None) for w in WORKLOADS] + [
        (w, d, c, k) for w in WORKLOADS for d in DRAFTERS for c, k in SPEC_ROWS]
    assert sorted(got, key=repr) == sorted(want, key=repr)


def test_row_fields(result):
    for r in result["rows"]:
        missing = [f for f in FIELDS if f not in r]
        assert not missing, (r, missing)
        assert _finite_pos(r["tok_per_s_vs_nospec"]), r
        assert _finite_pos(r["tok_per_s"]), r
        assert _finite_pos(r["ratio_median_per_request"]), r
        assert len(r["ratio_per_repeat"]) == result["config"]["repeats"]
        assert _finite_pos(r["etr"]) and r["etr"] >= 1.0, r
        assert isinstance(r["experts_loaded_per_token"], (int, float))
        assert r["experts_loaded_per_token"] >= 0
        ts = r["time_split"]
        assert _finite_pos(ts["nospec_step_ms"]) and ts["outside_iterations_s_per_request"] > 0
        if r["controller"] == "nospec":
            assert r["tok_per_s_vs_nospec"] == 1.0 and r["etr"] == 1.0 and r["k_mean"] == 0
            assert r["acceptance"] is None
            assert ts["plain_step_vs_nospec"] == 1.0 and ts["spec_iterations_per_request"] == 0
            assert ts["spec_loss_steps_per_request"] == 0
        else:
            assert r["k_mean"] >= 0
            assert r["acceptance"] is None or 0.0 <= r["acceptance"] <= 1.0
            # with accepted drafts the iteration yields more than one token on average
            assert r["etr"] <= 1.0 + r["k_mean"] + 1e-9, r
            # speculative iterations were counted exactly when drafts were verified
            assert (ts["spec_iterations_per_request"] > 0) == (r["k_mean"] > 0), r
        if r["controller"] == "static":
            assert r["k"] in (1, 2, 3)
        else:
            assert r["k"] is None
        if r["drafter"] == "self":
            for f in ("lookahead_precision", "lookahead_recall"):
                assert f in r and (r[f] is None or 0.0 <= r[f] <= 1.0), r
            fid = r["routing_fidelity"]
            if r["k_mean"]:  # drafts were verified: every pair is in one class
                assert set(fid) == {"hard", "soft", "mismatch"}, r
                assert abs(sum(fid.values()) - 1.0) < 0.01, fid


def test_greedy_outputs_equal_plain_decoding(result):
    bad = [(r["workload"], r["drafter"], r["controller"], r["k"]) for r in result["rows"]
           if r["outputs_equal"] is not True]
    assert not bad


def test_static_k_verifies_at_most_k(result):
    for r in result["rows"]:
        if r["controller"] == "static":
            assert r["k_mean"] <= r["k"] + 1e-9, r
            if r["drafter"] in ("draft", "self"):  # model drafters always propose k tokens
                # (the last iteration of a request may be shortened by max_new_tokens)
                assert r["k_mean"] > 0, r


def test_targets(result):
    t = result["targets"]
    for d in DRAFTERS:
        w = t["cascade_worst_vs_nospec"][d]
        assert w["workload"] in WORKLOADS and _finite_pos(w["ratio"])
        assert w["met"] == (w["ratio"] >= 0.95)
        worst = min(r["tok_per_s_vs_nospec"] for r in result["rows"]
                    if r["drafter"] == d and r["controller"] == "cascade")
        assert w["ratio"] == worst
        m = t["cascade_vs_best_static_on_mix"][d]
        assert m["best_static_k"] in (1, 2, 3) and _finite_pos(m["ratio"])
        assert m["met"] == (m["ratio"] >= 1.0)
        statics = {r["k"]: r["tok_per_s_vs_nospec"] for r in result["rows"]
                   if r["workload"] == "mix" and r["drafter"] == d and r["controller"] == "static"}
        assert m["static_vs_nospec"] == max(statics.values())


def test_config_and_tau(result):
    c = result["config"]
    assert c["quick"] is True and c["cache"] == 0.25
    assert len(c["prompts"]["mix"]) == c["requests"]
    for w in WORKLOADS:
        assert all(64 <= n <= 128 for n in c["prompt_tokens"][w])
    tau = result["tau"]
    assert tau is not None and tau["1"] == 1.0
    assert all(_finite_pos(v) for v in tau.values())


def test_batch_table_smoke():
    """--batch: one row per (batch size, drafter, controller) plus nospec, per-position
    acceptance, tau per batch size, and greedy outputs equal to plain batched decoding."""
    if not _zoo_ready():
        pytest.skip("zoo weights not in the package")
    from specmoe import zoo
    drafters = ["ngram"]
    if (zoo.root() / "tiny-moe-mtp" / "mtp_adapter.safetensors").is_file():
        drafters.append("mtp")  # the shipped MTP adapter (training/mtp.py)
    p = subprocess.run([sys.executable, str(SCRIPT), "--batch", "1,2", "--new-tokens", "4",
                        "--repeats", "1", "--drafters", ",".join(drafters), "--json"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads([ln for ln in p.stdout.splitlines() if ln.strip()][-1])
    assert res["batch_sizes"] == [1, 2] and sorted(res["tau_by_batch"]) == ["1", "2"]
    got = sorted(((r["batch"], r["drafter"], r["controller"]) for r in res["rows"]), key=repr)
    want = sorted([(b, None, "nospec") for b in (1, 2)] + [
        (b, d, c) for b in (1, 2) for d in drafters for c in ("static", "cascade", "speq")],
        key=repr)
    assert got == want
    for r in res["rows"]:
        assert r["outputs_equal"] is True
        assert _finite_pos(r["tok_per_s"]) and _finite_pos(r["tok_per_s_vs_nospec"])
        assert isinstance(r["acceptance_per_position"], list)
        assert 0 <= r["spec_off_steps"] <= 1


def test_offload_benchmark_smoke():
    """benchmarks/speculation_offload.py --quick --ablation: one link setting, every row once
    (MoE-SpeQ's ablation rows and the controllers without the slowdown budget included), the
    throttle derived from the setting's ratio and the zoo model's own measurements, and every
    speculative row's greedy output equal to plain decoding's."""
    if not _zoo_ready():
        pytest.skip("zoo weights not in the package")
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "speculation_offload.py"),
                        "--quick", "--json", "--ablation"], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads([ln for ln in p.stdout.splitlines() if ln.strip()][-1])
    (st,) = res["settings"]
    assert st["name"] == "pcie4-gpu@25%" and _finite_pos(st["ratio"])
    f, z = st["figures"], st["zoo"]
    # R = link time of a token's misses over its compute time, from the stated figures
    assert st["ratio"] == pytest.approx(f["link_ms_per_token"] / f["compute_ms_per_token"],
                                        rel=1e-2)
    assert _finite_pos(z["throttle_gbps"]) and _finite_pos(z["plain_step_ms"])
    assert z["throttle_gbps"] * 1e9 == pytest.approx(
        z["expert_bytes_per_token"] / (st["ratio"] * z["plain_step_ms"] / 1e3), rel=2e-2)
    rows = {(r["drafter"], r["controller"], r["k"], r["lookahead"], r["protect_lookahead"])
            for r in res["rows"]}
    assert (None, "nospec", None, True, True) in rows
    assert ("self", "cascade", None, False, True) in rows
    # MoE-SpeQ's ablation: static K, no lookahead prefetch, no lookahead-aware eviction
    assert {("self", "static", 3, True, True), ("self", "speq", None, False, True),
            ("self", "speq", None, True, False)} <= rows
    # both controllers without the slowdown budget
    assert {("ngram", "cascade-nobudget", None, True, True),
            ("mtp", "cascade-nobudget", None, True, True),
            ("self", "cascade-nobudget", None, False, True),
            ("self", "speq-nobudget", None, True, True)} <= rows
    assert len(rows) == len(res["rows"]) == 20
    for r in res["rows"]:
        assert r["setting"] == st["name"] and r["outputs_equal"] is True, r
        assert _finite_pos(r["tok_per_s_vs_plain"]) and len(r["ratio_per_repeat"]) == 1
    assert res["config"]["host"]["cpu"]


def test_cascade_ablation_rows():
    """--controllers with Cascade's ablation (Fig. 18's steps): each row present per workload,
    greedy output equal to plain decoding's, the Cascade-only targets skipped cleanly."""
    if not _zoo_ready():
        pytest.skip("zoo weights not in the package")
    names = ["static3", "cascade-disable", "cascade-backoff", "cascade-k3", "cascade-nobudget"]
    p = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--json", "--drafters", "ngram",
                        "--controllers", ",".join(names)], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout)
    assert res["config"]["controllers"] == names
    got = {(r["workload"], r["controller"], r["k"]) for r in res["rows"] if r["drafter"]}
    want = {(w, c, k) for w in WORKLOADS for c, k in
            [("static", 3), ("cascade-disable", None), ("cascade-backoff", None),
             ("cascade-k3", None), ("cascade-nobudget", None)]}
    assert got == want
    assert all(r["outputs_equal"] is True for r in res["rows"])
    assert res["targets"]["cascade_worst_vs_nospec"] == {}   # no plain "cascade" row
    bad = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--controllers", "fastest"],
                         cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "--controllers" in bad.stderr


# speculation_big.py --quick writes a 1.5 GB bf16 checkpoint, its int4 store (0.4 GB) and, for
# the self-draft, its int8 store (0.8 GB): the two tests share one work folder, so the
# checkpoint is written once, and the folder goes at the module's end whatever the outcome.
BIG_QUICK_DISK = 3 << 30


@pytest.fixture(scope="module")
def big_workdir(tmp_path_factory):
    folder = tmp_path_factory.mktemp("speculation-big")
    skip_unless_free_disk(folder, BIG_QUICK_DISK, "the quick checkpoint and its two stores")
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def test_big_checkpoint_benchmark_smoke(big_workdir):
    """benchmarks/speculation_big.py --quick: the 2-layer DeepSeek-V2-Lite-shaped checkpoint,
    plain against the controlled-acceptance drafter (static K and Cascade), every output equal
    to plain decoding's and the figures the issue asks for present."""
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "speculation_big.py"),
                        "--quick", "--json", "--no-cgroup", "--workdir", str(big_workdir)],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads([ln for ln in p.stdout.splitlines() if ln.strip()][-1])
    rows = {(r["alpha"], r["controller"], r["k"]) for r in res["rows"]}
    assert rows == {(None, "nospec", None), (0.7, "static", 2), (0.7, "cascade", None)}
    for r in res["rows"]:
        assert r["outputs_equal"] is True and _finite_pos(r["tok_per_s"]), r
    static = [r for r in res["rows"] if r["controller"] == "static"][0]
    assert 0 < static["acceptance"] < 1  # alpha 0.7 over 8 tokens: some right, some wrong
    c = res["config"]
    assert c["delta"] == 0.1 and "assumed" in c["delta_source"] and c["host"]["cpu"]
    assert set(res["targets"]) >= {"best_at_alpha_0.7", "cascade_worst_vs_plain"}


def test_big_checkpoint_self_draft_smoke(big_workdir):
    """speculation_big.py --quick --drafter self: the int4 self-draft of the int8 store, every
    output equal to plain decoding's, the draft copy counted in the budget."""
    p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "speculation_big.py"),
                        "--quick", "--drafter", "self", "--json", "--no-cgroup", "--workdir",
                        str(big_workdir)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads([ln for ln in p.stdout.splitlines() if ln.strip()][-1])
    assert {(r["drafter"], r["controller"], r["k"]) for r in res["rows"]} == {
        (None, "nospec", None), ("self (int4)", "static", 2), ("self (int4)", "cascade", None)}
    for r in res["rows"]:
        assert r["outputs_equal"] is True and r["alpha"] is None and _finite_pos(r["tok_per_s"])
    c = res["config"]
    assert c["dtype"] == "int8" and c["drafter"] == "self" and "delta" not in c
    assert c["draft_copy_bytes"] > 0 and c["budget_bytes"] > c["draft_copy_bytes"]

"""Engine setters called from one thread while another generates (issue 43, items 2 and 3).

Each case runs in a subprocess (tests/thread_worker.py) under a timeout: the failure guarded
against is a hang that nothing in the process can end.  Both dense modes: ``"auto"`` runs each
decoder layer (and whole decode steps) as one C call, ``"torch"`` the MoE blocks alone."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # make test-slow (Makefile)

pytest.importorskip("torch")
pytest.importorskip("transformers")

HERE = Path(__file__).resolve().parent
SETTERS = ["set_prefetch", "set_policy", "set_parallel_misses", "set_miss", "stats"]


def _run(tmp_path: Path, dense: str, setters: list[str], timeout: float) -> list[dict]:
    env = dict(os.environ, SPECMOE_CACHE=str(tmp_path / "cache"), OMP_NUM_THREADS="1")
    try:
        p = subprocess.run([sys.executable, str(HERE / "thread_worker.py"), dense,
                            ",".join(setters)], capture_output=True, text=True,
                           timeout=timeout, env=env)
    except subprocess.TimeoutExpired as exc:
        done = [json.loads(line)["setter"] for line in (exc.stdout or b"").decode().splitlines()
                if line.startswith("{")]
        pytest.fail(f"hung (killed after {timeout:.0f} s); finished: {done}, hung in the "
                    f"next of {setters}")
    assert p.returncode == 0, p.stderr[-3000:]
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert [r["setter"] for r in rows] == setters, p.stdout
    return rows


@pytest.mark.parametrize("dense", ["auto", "torch"])
def test_setters_during_generate_with_python_policy(tmp_path, dense):
    """A Python eviction policy (its callbacks take the GIL inside the slots' mutex), one
    thread generating, another calling each setter every millisecond: no deadlock (before the
    fix, set_prefetch/set_policy/set_parallel_misses hung in 4 of 4 configurations), no error,
    and the tokens generated before the setter thread started (these setters change which
    experts are resident or when they load, never the values computed)."""
    rows = _run(tmp_path, dense, SETTERS, timeout=240)
    for r in rows:
        assert r["error"] is None, r
        assert r["calls"] > 0, r
        assert r["wrong"] == 0, r


# the C decode step's path (dense="auto"), where the bug was; the torch path's set_cache is
# the per-layer path the setters test above also drives
@pytest.mark.parametrize("dense", ["auto"])
def test_set_cache_during_generate(tmp_path, dense):
    """set_cache(8) / set_cache("25%") in a loop without pause while another thread generates:
    the default (C decode step) path gave `CacheError: the expert cache is closed` on every
    generate (its decode plan and chain items kept the old cache's layers); now the reference
    tokens, and the generating thread is not starved by the loop."""
    rows = _run(tmp_path, dense, ["set_cache"], timeout=240)
    assert rows[0]["error"] is None, rows[0]
    assert rows[0]["wrong"] == 0 and rows[0]["calls"] > 0, rows[0]

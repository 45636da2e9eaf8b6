"""Bounded fuzz runs in `make test` (issue 15): the libFuzzer target on csrc/store.c for a
fixed number of executions from the seed corpus, and the Python loader fuzzers (store header,
Trace.load, load_puffin) for a fixed number of seeded mutations each.  Any finding fails.
The long runs are `make fuzz` (see tests/fuzz/Makefile and docs/reliability.md)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

FUZZ = Path(__file__).resolve().parent / "fuzz"
sys.path.insert(0, str(FUZZ))


def _clang() -> str | None:
    return shutil.which("clang") or shutil.which("clang-14")


@pytest.mark.skipif(_clang() is None, reason="clang with libFuzzer not installed "
                    "(apt-get install clang libclang-rt-14-dev); the Python fuzzers still run")
def test_store_libfuzzer_smoke(tmp_path):
    subprocess.run(["make", "-s", "-C", str(FUZZ), "bin/store_fuzz"], check=True,
                   capture_output=True)
    subprocess.run([sys.executable, str(FUZZ / "gen_corpus.py"), str(tmp_path / "seeds")],
                   check=True)
    work, art = tmp_path / "work", tmp_path / "art"
    work.mkdir()
    art.mkdir()
    p = subprocess.run([str(FUZZ / "bin" / "store_fuzz"), "-runs=50000", "-max_len=20512",
                        "-max_total_time=15", "-seed=15", f"-artifact_prefix={art}/",
                        str(work), str(tmp_path / "seeds")],
                       capture_output=True, text=True, timeout=120,
                       env=dict(os.environ, ASAN_OPTIONS="halt_on_error=1:detect_leaks=1"))
    assert p.returncode == 0 and not list(art.iterdir()), p.stderr[-4000:]
    assert "Done" in p.stderr


@pytest.mark.parametrize("target,runs", [("store", 800), ("npz", 800), ("csv", 1500)])
def test_python_loader_fuzz_smoke(target, runs, tmp_path):
    from fuzz_inputs import fuzz

    res = fuzz(target, runs, seed=15, out=str(tmp_path), time_limit=30, verbose=False)
    assert res["findings"] == [], res["findings"][:5]
    assert res["runs"] >= min(runs, 300)

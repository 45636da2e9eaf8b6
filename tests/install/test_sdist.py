"""A user's install, outside the development environment (issue 40, item 1): the sdist is
built from this checkout, installed into a fresh virtual environment from the wheels
``make setup`` downloaded (tests/install/wheelhouse.py; no index is read), and the README's
commands run there from a folder outside the checkout.

First the core alone (no torch): ``import specmoe``, ``specmoe --version``, the simulator on a
routing trace, and ``specmoe run`` failing with the line that names the ``hf`` extra; then
the ``hf`` extra on top, and ``specmoe run`` on the zoo model the package carries.

It compiles the extension from scratch and installs torch (about three minutes on two cores),
so ``make test`` leaves it out and ``make test-install`` (run by .ci/run) runs it:
SPECMOE_TEST_INSTALL=1 enables it."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from tests.conftest import skip_unless_free_disk

ROOT = Path(__file__).resolve().parents[2]
WHEELS = Path(os.environ.get("SPECMOE_WHEELHOUSE", ROOT / ".venv" / "wheelhouse"))

pytestmark = pytest.mark.skipif(
    os.environ.get("SPECMOE_TEST_INSTALL") != "1",
    reason="installs the sdist into a fresh venv (minutes): make test-install runs it")


def _run(cmd: list[str], cwd: Path, env: dict[str, str], ok: bool = True,
         timeout: float = 900) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    if ok and p.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} exited {p.returncode}\n--- stdout\n"
                             f"{p.stdout[-4000:]}\n--- stderr\n{p.stderr[-4000:]}")
    return p


def test_sdist_installs_and_runs_in_a_fresh_venv(tmp_path: Path) -> None:
    if not WHEELS.is_dir() or not any(WHEELS.glob("numpy-*.whl")):
        pytest.fail(f"no wheelhouse at {WHEELS}: make setup downloads it "
                    "(python tests/install/wheelhouse.py DEST)")
    # the venv holds torch (0.75 GB) and the core's wheels: about 1.1 GB in all
    skip_unless_free_disk(tmp_path, 3 << 29, "a fresh venv with torch")
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "VIRTUAL_ENV", "PYTHONHOME")}
    env["SPECMOE_CACHE"] = str(tmp_path / "cache")
    env["PIP_NO_INDEX"] = "1"  # offline: only the wheelhouse
    env["PIP_FIND_LINKS"] = str(WHEELS)
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"

    # the sdist, from a copy of the tracked and unignored files (no build outputs in it)
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir", str(dist),
          str(ROOT)], ROOT, env)
    sdist = next(dist.glob("specmoe-*.tar.gz"))
    with tarfile.open(sdist) as tf:
        names = tf.getnames()
    assert not [n for n in names if n.endswith((".so", ".o", ".smoe")) or "/.venv/" in n]
    assert any(n.endswith("csrc/kernels/kernels.h") for n in names)  # headers travel

    base = getattr(sys, "_base_executable", sys.executable)
    venv = tmp_path / "venv"
    _run([base, "-m", "venv", str(venv)], tmp_path, env)
    py, cli = venv / "bin" / "python", venv / "bin" / "specmoe"
    work = tmp_path / "work"  # outside the checkout: nothing imports from it
    work.mkdir()
    _run([str(py), "-m", "pip", "install", "--quiet", str(sdist)], work, env)

    # the core, no torch
    v = _run([str(cli), "--version"], work, env).stdout.split()
    from specmoe.version import __version__
    assert v == ["specmoe", __version__]
    probe = ("import sys, specmoe, specmoe._C; print(specmoe.__file__); "
             "print('torch' in sys.modules)")
    out = _run([str(py), "-c", probe], work, env).stdout.split()
    assert out[0].startswith(str(venv)) and out[1] == "False"
    trace = work / "trace"
    trace.mkdir()
    shutil.copy(ROOT / "tests" / "data" / "puffin" / "prompt_107_data.csv.gz", trace)
    sim = _run([str(cli), "simulate", "--trace", str(trace), "--policies", "lru,least_stale",
                "--capacity", "25%", "--json"], work, env)
    res = json.loads(sim.stdout)["results"]
    assert [r["policy"] for r in res] == ["lru", "least_stale"]
    assert all(0.0 < r["hit_rate"] < 1.0 for r in res)
    model = Path(out[0]).parent / "zoo" / "tiny-moe"  # the zoo model the package carries
    assert (model / "model.safetensors").is_file()
    run = ["run", str(model), "--prompt", "def parse(line):", "--cache", "25%",
           "--max-new-tokens", "8"]
    p = _run([str(cli), *run], work, env, ok=False)
    assert p.returncode == 1 and "specmoe[hf]" in p.stderr, p.stderr

    # the hf extra on top (pip finds the installed specmoe satisfies itself)
    env_hf = dict(env, PIP_FIND_LINKS=f"{WHEELS} {dist}")
    _run([str(py), "-m", "pip", "install", "--quiet", "specmoe[hf]"], work, env_hf)
    p = _run([str(cli), *run], work, env)
    assert "[specmoe] " in p.stderr + p.stdout and "tok/s" in p.stderr + p.stdout

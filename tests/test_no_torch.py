"""specmoe without the 'hf' extra (torch, transformers, safetensors, accelerate): what a plain
``pip install specmoe`` gives.  Each case runs in a fresh interpreter where importing any of
those packages fails, as on a machine that never installed them (issue 40: ``import specmoe``
used to fail there, through the drafters' torch import)."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

BLOCK = textwrap.dedent("""
    import importlib.abc, sys
    class _NoHF(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("torch", "transformers", "safetensors", "accelerate"):
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
    sys.meta_path.insert(0, _NoHF())
""")


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK + textwrap.dedent(code)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


def test_import_store_cache_kernels_and_simulator_without_torch(tmp_path):
    p = _run(f"""
        import numpy as np
        import specmoe
        from specmoe.storage import quant
        rng = np.random.default_rng(0)
        H, I, L, E = 32, 64, 2, 4
        layers = []
        for _ in range(L):
            per = [quant.expert_tensors(rng.standard_normal((I, H), dtype=np.float32),
                                        rng.standard_normal((I, H), dtype=np.float32),
                                        rng.standard_normal((H, I), dtype=np.float32), "f32")
                   for _ in range(E)]
            layers.append({{n: np.stack([q[n] for q in per]) for n in per[0]}})
        st = specmoe.write_store({str(tmp_path / "s.smoe")!r}, layers, top_k=2, progress=False)
        c = specmoe.ExpertCache(st, 3, specmoe.LRU(), top_k=2)
        c.acquire(0, 1); c.release(0, 1)
        assert c.stats()["misses"] == 1
        c.close(); st.close()
        assert specmoe.NgramDrafter().propose([1, 2, 3, 1, 2], 2) == [3, 1]
        assert "torch" not in sys.modules
        print("ok")
    """)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stderr[-2000:]


def test_cli_simulate_without_torch():
    trace = str(ROOT / "tests" / "data" / "puffin")  # the shipped subset of the real traces
    p = _run(f"""
        from specmoe.cli import main
        rc = main(["simulate", "--trace", {trace!r}, "--tokens", "3", "--policies", "lru",
                   "--capacity", "10%"])
        assert rc == 0, rc
        assert "torch" not in sys.modules
        print("ok")
    """)
    assert p.returncode == 0 and p.stdout.strip().endswith("ok"), p.stderr[-2000:]


@pytest.mark.parametrize("name", ["offload", "from_pretrained", "generate", "MtpDrafter"])
def test_torch_features_name_the_extra(name):
    p = _run(f"""
        import specmoe
        try:
            specmoe.{name}
        except ModuleNotFoundError as e:
            print("ERR", e)
    """)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "ERR specmoe." + name + " needs" in p.stdout and "specmoe[hf]" in p.stdout, p.stdout


def test_version_from_one_place():
    """``specmoe --version`` reads specmoe/version.py, the one place the version is written:
    pyproject.toml takes it from there (setuptools' dynamic attr)."""
    import specmoe
    p = _run("""
        from specmoe.cli import main
        try:
            main(["--version"])
        except SystemExit as e:
            print("exit", e.code)
    """)
    assert p.returncode == 0, p.stderr[-2000:]
    assert f"specmoe {specmoe.__version__}" in p.stdout and "exit 0" in p.stdout
    text = (ROOT / "pyproject.toml").read_text()
    project = text.split("[project]")[1].split("\n[")[0]
    assert 'dynamic = ["version"]' in project and "\nversion =" not in project
    assert 'version = {attr = "specmoe.version.__version__"}' in text


def test_cli_run_without_torch_names_the_extra():
    """The packaging test (tests/install) found `specmoe run` ending with a bare
    "No module named 'torch'" in a venv without the extra."""
    zoo = str(ROOT / "specmoe" / "zoo" / "tiny-moe")
    p = _run(f"""
        from specmoe.cli import main
        main(["run", {zoo!r}, "--prompt", "hi", "--max-new-tokens", "2"])
    """)
    assert p.returncode == 1, p.stderr[-2000:]
    assert "specmoe run needs torch" in p.stderr and "specmoe[hf]" in p.stderr, p.stderr

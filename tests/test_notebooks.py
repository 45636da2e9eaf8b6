"""Notebooks under notebooks/ execute top to bottom (nbclient), as `make test-slow` runs them.

notebooks/policy_playground.ipynb is executed by tests/test_sim.py; this file holds the others.
"""
from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow  # make test-slow (Makefile)

from tests.conftest import HERE

ROOT = HERE.parent


def _execute(name: str):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    nb = nbformat.read(ROOT / "notebooks" / name, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(ROOT)}})
    client.execute()
    outputs = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])]
    errors = [o for o in outputs if o.get("output_type") == "error"]
    assert not errors, [(o["ename"], o["evalue"]) for o in errors]
    return nb, outputs


def _zoo_ready() -> bool:
    try:
        from specmoe import zoo
    except ImportError:
        return False
    return zoo.available("tiny-moe") and zoo.available("tiny-draft")


NOTEBOOKS = ("speculation.ipynb", "gamma_tolerance.ipynb")


@pytest.fixture(scope="module")
def executed():
    """Both notebooks executed side by side, each in its own kernel process (most of their
    time is the kernels' start and work, so two cores run them in about the time of the
    longer): {name: (notebook, outputs) or the exception it raised}."""
    from concurrent.futures import ThreadPoolExecutor

    pytest.importorskip("nbformat")
    pytest.importorskip("nbclient")
    with ThreadPoolExecutor(len(NOTEBOOKS)) as pool:
        futures = {n: pool.submit(_execute, n) for n in NOTEBOOKS}
    results = {}
    for n, f in futures.items():
        exc = f.exception()
        results[n] = exc if exc is not None else f.result()
    return results


def _outputs(executed, name):
    r = executed[name]
    if isinstance(r, BaseException):
        raise r
    return r


@pytest.mark.skipif(not _zoo_ready(), reason="zoo weights not in the package")
def test_speculation_notebook_runs(executed):
    """notebooks/speculation.ipynb runs one request under Cascade and plots its telemetry,
    then the SpeQ governor's amortization roofline."""
    nb, outputs = _outputs(executed, "speculation.ipynb")
    text = "".join(o.get("text", "") for o in outputs)
    assert "cascade:" in text and "tokens/iteration" in text
    assert "iterations per phase:" in text and "back-off stretches" in text
    assert "governor picks k=" in text and "compute roof" in text
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) == 3  # K/utility (n-gram drafter, draft model), the SpeQ roofline


@pytest.mark.skipif(not _zoo_ready(), reason="zoo weights not in the package")
def test_gamma_tolerance_notebook_runs(executed):
    """notebooks/gamma_tolerance.ipynb measures tau(g, B) for three batch sizes, plots tau
    against gamma and prints the success condition per batch size."""
    nb, outputs = _outputs(executed, "gamma_tolerance.ipynb")
    text = "".join(o.get("text", "") for o in outputs)
    assert "tau(g, B)" in text
    assert all(f"B={b:2d}:" in text for b in (1, 4, 16))
    assert "pays:" in text
    images = [o for o in outputs if "image/png" in o.get("data", {})]
    assert len(images) == 1

"""Shared fixtures.  Real routing traces come from ../shared/traces when present (the full
set), else from the small subset carried in tests/data/puffin (see its README)."""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Iterator

import pytest

HERE = Path(__file__).resolve().parent


MiB = 1 << 20


def skip_unless_free_disk(folder: Path, nbytes: int, what: str) -> None:
    """Skip the calling test, naming the shortfall, when the file system under ``folder`` has
    less than ``nbytes`` free for ``what`` (CI machines have been seen with 1.5 GB free)."""
    free = shutil.disk_usage(folder).free
    if free < nbytes:
        pytest.skip(f"needs {nbytes / MiB:.0f} MiB of free disk under {folder} for {what}, "
                    f"{free / MiB:.0f} MiB free")


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the server tests bind to it)."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
SUBSET = HERE / "data" / "puffin"
SHARED = HERE.parent.parent / "shared" / "traces" / "deepseek-v2-lite-puffin"


@pytest.fixture(scope="session")
def puffin_dir() -> Path:
    """Directory of puffin trace files: the shared full set if reachable, else the subset."""
    return SHARED if SHARED.is_dir() else SUBSET


@pytest.fixture(scope="session")
def puffin_subset():
    """The carried subset as a Trace (always available, small)."""
    from specmoe.sim.traces import load_puffin

    return load_puffin(SUBSET)


@contextlib.contextmanager
def specmoe_cache_and_one_thread(cache_dir: Path) -> Iterator[None]:
    """Inside the block: stores under ``cache_dir`` ($SPECMOE_CACHE) and one torch thread (a
    module fixture's zoo server); both restored after."""
    import torch
    old, threads = os.environ.get("SPECMOE_CACHE"), torch.get_num_threads()
    os.environ["SPECMOE_CACHE"] = str(cache_dir)
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
        if old is None:
            os.environ.pop("SPECMOE_CACHE", None)
        else:
            os.environ["SPECMOE_CACHE"] = old


@pytest.fixture
def one_torch_thread():
    """One torch intra-op thread for the test (tiny models run faster and steadier so on the
    shared 2-core machines); the previous count is restored."""
    torch = pytest.importorskip("torch")
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def c_compiler() -> str:
    """The C compiler that tests build their C helpers with ($CC, else cc, gcc or clang); the
    test is skipped where there is none."""
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        pytest.skip("no C compiler")
    return cc


class IdText:
    """A tokenizer for random-weight models in the server's tests: a token's text is its id."""

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


def served_greedy(sch, prompts, max_tokens):
    """Serve every prompt through the scheduler ``sch``, admitted in one round, each to
    ``max_tokens`` greedy tokens: [generated ids]."""
    from specmoe.serve.scheduler import GenParams, serve_all
    reqs = serve_all(sch, prompts, GenParams(max_tokens=max_tokens, temperature=0),
                     timeout=120)
    assert all(r.finished == "length" for r in reqs), [(r.finished, r.error) for r in reqs]
    return [r.generated for r in reqs]


def greedy_alone(model, prompts, n):
    """Each prompt's ``n`` greedy tokens from ``model.generate`` alone (no padding): the
    reference a served request must equal."""
    import torch
    refs = []
    for ids in prompts:
        x = torch.tensor([ids])
        out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                             max_new_tokens=n, pad_token_id=0)
        refs.append(out[0, len(ids):].tolist())
    return refs

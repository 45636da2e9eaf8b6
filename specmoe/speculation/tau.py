"""tau(g): the target forward's cost over g tokens relative to one, per batch size (the
gamma-tolerance paper, section 3.1), measured once and kept by its one owner, a
:class:`TauTables` (the engine's ``tau``, or this module's per-model table for a model that
no engine serves)."""
from __future__ import annotations

import weakref
from typing import Any, Dict, Mapping, Sequence

import torch
from torch import nn

from .controllers import measure_tau
from .decoding import cache_kwargs, crop_kv, input_device, new_kv
from ..runtime.tau_tables import TauTables
from ..runtime.experts import find_engine

__all__ = ["TauTables", "batch_bucket", "measure_tau_grid", "target_tau", "tau_for_batch"]


def tables_of(model: nn.Module, engine: Any) -> TauTables:
    """The tau tables of ``model``: its engine's, else this module's per-model ones."""
    if engine is not None:
        return engine.tau
    t = _TAU.get(model)
    if t is None:
        t = _TAU[model] = TauTables()
    return t


# model -> its tau tables, for models without an engine
_TAU: "weakref.WeakKeyDictionary[nn.Module, TauTables]" = \
    weakref.WeakKeyDictionary()


def measure_tau_grid(model: nn.Module, prompt: Sequence[int],
                     batch_sizes: Sequence[int] = (1, 4, 16), g_max: int = 9,
                     engine: Any = None, repeats: int = 5,
                     progress: bool = False) -> Dict[int, Dict[int, float]]:
    """tau(g, B) over g = 1..g_max and the given batch sizes: {B: {g: tau}}, each row by
    :func:`target_tau` (the offloaded forward as it runs, expert loads included; kept on the
    engine, so :func:`generate` at those batch sizes reuses them).  tau falls with B (the
    gamma-tolerance paper, Fig. 1 left): which K can pay depends on the batch."""
    if engine is None:
        engine = find_engine(model)
    bs = sorted({int(b) for b in batch_sizes})
    if not bs or bs[0] < 1:
        raise ValueError(f"batch_sizes must be ints >= 1, got {list(batch_sizes)}")
    if isinstance(g_max, bool) or not isinstance(g_max, int) or g_max < 1:
        raise ValueError(f"g_max must be an int >= 1, got {g_max!r}")
    if not len(prompt):
        raise ValueError("measure_tau_grid: empty prompt")
    it: Any = bs
    if progress:
        from tqdm.auto import tqdm
        it = tqdm(bs, desc="tau(g, B)", unit="batch")
    return {b: target_tau(model, prompt, g_max, engine, repeats, batch=b) for b in it}


def target_tau(model: nn.Module, prompt: Sequence[int], g_max: int, engine: Any = None,
               repeats: int = 5, batch: int = 1, progress: bool = False) -> Dict[int, float]:
    """tau(g) = T(1)/T(g) of the target forward over g = 1..g_max tokens per sequence at batch
    size ``batch`` (T(g): one forward of [batch, g] tokens), measured once per model and batch
    size (kept on its engine, or in a per-model table) on a scratch KV cache prefilled with
    the end of ``prompt`` (each row a different rotation of it, so the rows route to different
    experts), T(g) the fastest of ``repeats`` interleaved calls.  Expert loads count: this is
    the forward as it runs, cache misses included (gamma-tolerance paper, section 3.1)."""
    batch = int(batch)
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    table = tables_of(model, engine).table(batch)
    if table and max(table) >= g_max:
        return {g: t for g, t in table.items() if g <= g_max}
    kv = new_kv(model)
    base = list(prompt)[-64:]
    rows = [base[(b * 5) % len(base):] + base[:(b * 5) % len(base)] for b in range(batch)]
    with torch.no_grad():
        model(input_ids=torch.tensor(rows, dtype=torch.long, device=input_device(model)),
              use_cache=True, **cache_kwargs(model, kv))
    n = kv.get_seq_length()
    calls = [0]

    def fwd(g: int) -> None:
        # a different window of the prompt each call, so cache misses happen as in decoding
        calls[0] += 1
        toks = [[base[(calls[0] * 7 + b * 3 + i) % len(base)] for i in range(g)]
                for b in range(batch)]
        with torch.no_grad():
            model(input_ids=torch.tensor(toks, dtype=torch.long, device=input_device(model)),
                  use_cache=True, **cache_kwargs(model, kv))
        crop_kv(kv, n)

    table.clear()  # measured up to g = 9 at least: K up to 8 needs no second measurement
    # the fastest of the repeats: tau bounds the best case, and on shared cores other
    # processes only ever slow a forward down (a median can prune every K on a busy machine)
    table.update(measure_tau(fwd, range(1, max(g_max, 9) + 1), repeats=repeats, warmup=1,
                             stat="min", progress=progress))
    return {g: t for g, t in table.items() if g <= g_max}


def batch_bucket(batch: int) -> int:
    """The power of two at or above ``batch``: the batch sizes tau is measured at when it is
    measured as batches come ("auto" in :func:`specmoe.generate`'s batch path, the server's
    controllers)."""
    return 1 << max(0, (int(batch) - 1).bit_length())


def tau_for_batch(tables: Mapping[int, Mapping[int, float]], batch: int) -> Mapping[int, float]:
    """The tau table measured at the smallest batch size >= ``batch`` (tau falls with the
    batch size, so this errs on the side of pruning), else the largest measured."""
    bs = sorted(tables)
    for b in bs:
        if b >= batch:
            return tables[b]
    return tables[bs[-1]]

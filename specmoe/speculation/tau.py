"""tau(g): the target forward's cost over g tokens relative to one, per batch size (the
gamma-tolerance paper, section 3.1), measured once and kept by its one owner, a
:class:`TauTables` (the engine's ``tau``, or this module's per-model table for a model that
no engine serves)."""
from __future__ import annotations

import contextlib

import math
import weakref
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Sequence

import torch
from torch import nn

from .controllers import measure_times, ttft_k_max
from .decoding import (cache_kwargs, crop_kv, input_device, last_logits_kwargs, new_kv,
                       unrecorded)
from ..models.decode_step import decode_step_of
from ..runtime.tau_tables import TauTables
from ..runtime.experts import find_engine

__all__ = ["TauTables", "TtftProfile", "batch_bucket", "forward_times", "measure_tau_grid",
           "profile_ttft", "target_tau", "tau_for_batch"]


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


def forward_times(model: nn.Module, prompt: Sequence[int], gs: Sequence[int],
                  repeats: int = 5, batch: int = 1, progress: bool = False) -> Dict[int, float]:
    """T(g): seconds of one target forward over g tokens per sequence at batch size
    ``batch`` for each g in ``gs``, the fastest of ``repeats`` interleaved calls, on a scratch
    KV cache prefilled with the end of ``prompt`` (each row a different rotation of it, so the
    rows route to different experts; each call a different window of it, so cache misses
    happen as in decoding).  Expert loads count: this is the forward as it runs.  T(1) at
    batch 1 is the plain greedy step as decoding takes it: the decode plan's one C call
    (:meth:`~specmoe.models.decode_step.DecodeStep.greedy_next`) where a plan serves it, so
    the base a draft's cost is weighed against is the fastest plain step (gamma-tolerance,
    section 3.1, Eq. 1: T(1) is the target's plain step; Cascade, section 4: the cost is
    against the iteration without speculation); a sampled plain step, which needs the
    forward's logits, costs a little more, so its tau is on the cautious side."""
    batch = int(batch)
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    if not len(prompt):
        raise ValueError("forward_times: empty prompt")
    kv = new_kv(model, rollback=True, window=max(gs))
    base = list(prompt)[-64:]
    rows = [base[(b * 5) % len(base):] + base[:(b * 5) % len(base)] for b in range(batch)]
    with unrecorded(kv), torch.no_grad():  # (never cut back)
        model(input_ids=torch.tensor(rows, dtype=torch.long, device=input_device(model)),
              use_cache=True, **cache_kwargs(model, kv), **last_logits_kwargs(model))
    n = [int(kv.get_seq_length())]
    calls = [0]
    fast = decode_step_of(model) if batch == 1 else None

    def fwd(g: int) -> None:
        calls[0] += 1
        toks = [[base[(calls[0] * 7 + b * 3 + i) % len(base)] for i in range(g)]
                for b in range(batch)]
        # one token is a step without drafts, which decoding never cuts back and runs
        # unrecorded (a hybrid's one-call recurrent steps): timed so, and kept
        with unrecorded(kv) if g == 1 else contextlib.nullcontext(), torch.no_grad():
            if g > 1 or fast is None or fast.greedy_next(toks[0][0], kv) is None:
                model(input_ids=torch.tensor(toks, dtype=torch.long,
                                             device=input_device(model)),
                      use_cache=True, **cache_kwargs(model, kv))
        if g == 1:
            n[0] = int(kv.get_seq_length())
        crop_kv(kv, n[0])

    # the fastest of the repeats: tau bounds the best case, and on shared cores other
    # processes only ever slow a forward down (a median can prune every K on a busy machine)
    if fast is None or 1 not in gs:
        return measure_times(fwd, gs, repeats=repeats, warmup=1, stat="min",
                             progress=progress)
    # the plan's step timed in a run of its own: a forward of g > 1 tokens in between changes
    # the cache's views, and the next plain step rebuilds the plan (about 0.9 ms on the zoo
    # model, twice its step), which consecutive plain steps, as decoding takes them, do not
    longer = [g for g in gs if g > 1]
    times = measure_times(fwd, longer, repeats=repeats, warmup=1, stat="min",
                          progress=progress) if longer else {}
    times.update(measure_times(fwd, [1], repeats=repeats, warmup=1, stat="min"))
    return {g: times[g] for g in sorted(times)}


def target_tau(model: nn.Module, prompt: Sequence[int], g_max: int, engine: Any = None,
               repeats: int = 5, batch: int = 1, progress: bool = False) -> Dict[int, float]:
    """tau(g) = T(1)/T(g) of the target forward over g = 1..g_max tokens per sequence at batch
    size ``batch`` (T(g): one forward of [batch, g] tokens, :func:`forward_times`), measured
    once per model and batch size (kept on its engine, or in a per-model table).  Expert
    loads count: this is the forward as it runs, cache misses included (gamma-tolerance
    paper, section 3.1)."""
    batch = int(batch)
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    table = tables_of(model, engine).table(batch)
    if table and max(table) >= g_max:
        return {g: t for g, t in table.items() if g <= g_max}
    # measured up to g = 9 at least: K up to 8 needs no second measurement
    times = forward_times(model, prompt, range(1, max(g_max, 9) + 1), repeats, batch, progress)
    table.clear()
    table.update({g: times[1] / t for g, t in times.items()})
    return {g: t for g, t in table.items() if g <= g_max}


@dataclass(frozen=True)
class TtftProfile:
    """What :func:`profile_ttft` measured, in seconds, and the draft length it allows:
    ``t_prefill`` one prefill of the prompt; ``t_draft[k]`` drafting k tokens after it (the
    drafter's catch-up on the prompt included, as in a request's first cycle); ``t_verify[g]``
    one verification forward over g tokens; ``k_max`` the largest k whose first cycle ends
    within ``budget_s`` (:func:`~specmoe.speculation.controllers.ttft_k_max`)."""

    budget_s: float
    k_max: int
    t_prefill: float
    t_draft: Dict[int, float]
    t_verify: Dict[int, float]


def profile_ttft(model: nn.Module, prompt: Sequence[int], budget_s: float, drafter: Any = None,
                 k_max: int = 8, repeats: int = 3, progress: bool = False) -> TtftProfile:
    """MoE-SpeQ's offline SLO-based bounding (Sec. 3.2.3), profiled on this model and
    machine: the largest draft length whose first token arrives within ``budget_s`` seconds
    of a request of ``prompt`` (prefill, drafting k tokens, verifying k + 1, each the fastest
    of ``repeats``), to pass as a controller's ``k_max`` (``specmoe serve --ttft-budget``
    does at load).  ``drafter``: anything with ``reset()`` and ``propose(history, k)`` (None:
    drafting taken as free).  ValueError when even plain decoding
    misses the budget."""
    if isinstance(budget_s, bool) or not isinstance(budget_s, (int, float)) or \
            not math.isfinite(budget_s) or budget_s <= 0:
        raise ValueError(f"budget_s must be a finite number of seconds > 0, got {budget_s!r}")
    if isinstance(k_max, bool) or not isinstance(k_max, int) or k_max < 1:
        raise ValueError(f"k_max must be an int >= 1, got {k_max!r}")
    if not len(prompt):
        raise ValueError("profile_ttft: empty prompt")
    ids = torch.tensor([list(prompt)], dtype=torch.long, device=input_device(model))

    def prefill(_: int) -> None:  # (as generate and the server run it: lm_head on one row)
        with torch.no_grad():
            model(input_ids=ids, use_cache=True, **cache_kwargs(model, new_kv(model)),
                  **last_logits_kwargs(model))

    t_prefill = measure_times(prefill, [1], repeats=repeats, warmup=1, stat="min")[1]
    t_verify = forward_times(model, prompt, range(1, k_max + 2), repeats, progress=progress)
    t_draft: Dict[int, float] = {k: 0.0 for k in range(1, k_max + 1)}
    if drafter is not None:
        def draft(k: int) -> None:
            drafter.reset()
            drafter.propose(list(prompt), k)

        t_draft = measure_times(draft, range(1, k_max + 1), repeats=repeats, warmup=1,
                                stat="min")
        drafter.reset()
    k = ttft_k_max(float(budget_s), t_prefill, t_draft, t_verify, k_max=k_max)
    return TtftProfile(float(budget_s), k, t_prefill, t_draft, t_verify)


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

"""Continuous batching on a gated-DeltaNet hybrid: the decode steps of B requests in one batched
forward (each row its own recurrent state) against the same requests stepped one forward each,
on Qwen3.5-MoE's (or Qwen3-Next's) per-layer shapes, the GGUF file of
``benchmarks/hybrid_peers.py``.

    python benchmarks/hybrid_serve.py --json [--rounds 3] [--threads 2] [--clients 1,4,8]
    python benchmarks/hybrid_serve.py --quick --json      # small shapes, 1 round: a smoke test
    python benchmarks/hybrid_serve.py --json --drafter self --controller static:3   # speculation

In one process, through the server's worker (``specmoe.serve.scheduler.Scheduler``, no HTTP:
what is measured is the worker's rounds).  The model is loaded once with every expert resident
(``cache=1.0``), so the rows compare compute, not the slow tier.  Per round, per client count
B, the two modes in alternating order:

* ``batched``: ``Scheduler(batch_decode=True)``: B requests submitted together, their prompts
  prefilled alone (a hybrid's prompts are never batched), then every round one batched
  forward of all running requests (:class:`specmoe.speculation.batch.BatchKV`, "stateful");
* ``alone``: ``Scheduler(batch_decode=False)``: the same requests, one forward per request
  per round (what the server did for hybrids before);
* ``grouped`` (with ``--batch-prefill``): ``batched`` with the server's ``--batch-prefill``,
  under which a hybrid's prompts of one length (these all are) share one prefill forward, not
  bit for bit their prefills alone (``grouped_same_tokens_runs`` says whether the tokens
  still matched); ``grouped_vs_batched_out_runs`` and ``..._first_tokens_s_runs`` per round.

``--servers kept`` (the default) keeps one worker per mode and client count for the whole
process, warmed by one short run, as a running server serves request after request (a
controller learns across requests: Cascade's trials, its budget); ``--servers fresh`` starts a
new worker per run, so every run is a fresh server's first requests (results files whose
config has no ``servers`` were made so).  Each request: a prompt of ``--prompt`` random
token ids (different per request), ``--max-tokens`` greedy tokens.  Per run: ``out_tok_s``
(every generated token / wall time from the submit to the last request's end, prefills
included), ``decode_tok_s`` (the tokens after each request's first / the time from the last
first token to the end: the phase where all B decode),
``first_tokens_s`` (from the submit to the last request's first token: the prompts' time),
``batched_steps``, ``batched_prefills`` (forwards that prefilled several prompts).
``--cache`` below 1 serves from the store (a prompt forward shared by several requests loads
each expert once).  ``vs_alone_runs``: batched / alone ``decode_tok_s`` per round;
``scaling_runs``: batched ``decode_tok_s`` at B / at one client, per round.  ``same_tokens``:
whether the two modes gave every request the same tokens (the batch gives each row the bits of
its step alone).  The peer for serving, llama.cpp's ``llama-server --parallel N``, is in
``benchmarks/serve.py --models hybrid`` (both servers over HTTP on this same GGUF file); it is
not run here, and the results say so.  The results name the host (CPU model, ISA, threads).

``--drafter ngram|self`` (with ``--controller``, default ``static:3``): speculative decoding
in both modes, and a third, ``plain``, batched without a drafter, in the rotation:

* ``batched``: the batch verifies every row's drafts in one forward, its recurrent rows
  recording their states over the verification and each cut back to its own accepted drafts
  (:class:`BatchKV`'s window);
* ``alone``: each request verifies its drafts in a forward of its own (what the server did
  for hybrids with a drafter before);
* ``plain``: batched decode steps without drafts (does speculation pay here at all?).

Then ``vs_alone_runs`` is batched / alone and ``vs_plain_runs`` batched / plain
``decode_tok_s`` per round; ``acceptance`` and ``k_mean`` per mode; ``same_tokens`` compares
all three modes' tokens (greedy: speculation gives plain decoding's tokens).  The prompts
then repeat a short random phrase, so that an n-gram drafter has something to propose.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import hostinfo  # noqa: E402
from hybrid_peers import ARCHS, common_args, gguf_path, run_worker, write_file  # noqa: E402

HYBRIDS = ("qwen35moe", "qwen3next")


def log(*a: Any) -> None:
    print("[hybrid_serve]", *a, file=sys.stderr, flush=True)


class _IdText:
    """The worker decodes new tokens to match stop strings: ids as text will do here."""

    def decode(self, ids: Any, skip_special_tokens: bool = True) -> str:
        return " ".join(map(str, ids))


def make_scheduler(model: Any, batch: int, prefill: int, batched: bool,
                   drafter: str | None = None, controller: str | None = None,
                   batch_prefill: bool = False) -> Any:
    """A server's worker for ``batch`` requests at a time, prompts of up to ``prefill``
    tokens in one chunk (``drafter``: speculative decoding with ``controller``)."""
    from specmoe.serve.scheduler import Scheduler
    spec = dict(drafter=drafter, controller=controller, warm_tau=False) if drafter else {}
    sch = Scheduler(model, _IdText(), max_batch=max(batch, 1), prefill_chunk=prefill,
                    batch_decode=batched, batch_prefill=batched and batch_prefill, **spec)
    if batched and sch.batch_off_reason is not None:
        sch.close()
        raise RuntimeError(f"decode steps not batched: {sch.batch_off_reason}")
    return sch


def _counters(sch: Any) -> dict[str, int]:
    c = {"batched_steps": sch.batched_steps, "batched_prefills": sch.batched_prefills}
    if sch.spec is not None:
        st = sch.spec.stats()
        c.update(batched_verifications=sch.batched_verifications, proposed=st["proposed"],
                 accepted=st["accepted"], steps_with_drafts=st["steps_with_drafts"])
    return c


def run_once(sch: Any, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    """Serve ``prompts`` at once through the worker ``sch``; the run's figures (its counters:
    what this run added) and tokens."""
    from specmoe.serve.scheduler import GenParams, serve_all
    first: dict[int, float] = {}

    def on_event(i: int, ev: Any) -> None:
        if ev[0] == "text" and i not in first:
            first[i] = time.perf_counter()
    before = _counters(sch)
    t0 = time.perf_counter()
    # queued together: every request admitted in the worker's first round
    reqs = serve_all(sch, prompts, GenParams(max_tokens=max_tokens, temperature=0),
                     timeout=1800, on_event=on_event)
    t1 = time.perf_counter()
    bad = [(r.finished, r.error) for r in reqs if r.finished != "length"]
    if bad:
        raise RuntimeError(f"requests ended badly: {bad}")
    n = sum(len(r.generated) for r in reqs)
    t_first = max(first.values())
    out: dict[str, Any] = {k: v - before[k] for k, v in _counters(sch).items()}
    if "proposed" in out:
        out["acceptance"] = out["accepted"] / out["proposed"] if out["proposed"] else None
    out.update({"out_tok_s": n / (t1 - t0),
                "decode_tok_s": (n - len(reqs)) / (t1 - t_first),
                "first_tokens_s": t_first - t0,
                "tokens": [list(r.generated) for r in reqs]})
    return out


def worker(path: str, threads: int, clients: list[int], rounds: int, prompt: int,
           max_tokens: int, cache: float, drafter: str | None = None,
           controller: str | None = None, servers: str = "kept",
           grouped: bool = False) -> None:
    """One process: the model loaded once, ``rounds`` rounds of every (clients, mode); one
    JSON line on stdout."""
    import numpy as np
    import torch

    import specmoe
    from big_model import load_every_expert
    from specmoe.runtime import kernels
    torch.set_num_threads(threads)
    kernels.set_num_threads(threads)
    model = specmoe.from_pretrained(path, cache=cache, progress=False, prefetch=False)
    model.generation_config.eos_token_id = None
    eng = specmoe.engine_of(model)
    if cache >= 1.0:
        load_every_expert(eng)
    rng = np.random.default_rng(0)
    vocab = model.config.vocab_size
    if drafter:  # a short random phrase repeated (an n-gram drafter then proposes)
        prompts = [(rng.integers(3, vocab, 6).tolist() * prompt)[:prompt]
                   for _ in range(max(clients))]
    else:
        prompts = [rng.integers(3, vocab, prompt).tolist() for _ in range(max(clients))]
    names: tuple[str, ...] = ("batched", "alone", "plain") if drafter else ("batched", "alone")
    if grouped:  # batched decode, prompts of one length prefilled together (batch_prefill)
        names += ("grouped",)

    workers: dict[tuple[str, int], Any] = {}

    def run(mode: str, ps: list[list[int]], n: int) -> dict[str, Any]:
        key = (mode, len(ps))
        sch = workers.get(key) if servers == "kept" else None
        if sch is None:
            sch = make_scheduler(model, len(ps), prompt, mode != "alone",
                                 drafter if mode != "plain" else None, controller,
                                 batch_prefill=mode == "grouped")
        try:
            with torch.inference_mode():
                return run_once(sch, ps, n)
        finally:
            if servers == "kept":
                workers[key] = sch
            else:
                sch.close()
    for mode in names:  # warm-up (plans, threads; with a drafter, tau "auto" measured at
        # each batch size's bucket, once a process, as a server's warm_tau does before serving)
        for B in (clients if drafter or servers == "kept" else [2]):
            run(mode, prompts[:B], 4)
    keys = ("out_tok_s", "decode_tok_s", "first_tokens_s", "batched_steps", "batched_prefills")
    if drafter:
        keys += ("batched_verifications", "acceptance", "proposed", "steps_with_drafts")
    out: dict[str, Any] = {}
    for r in range(rounds):
        for B in clients:
            k = (r + clients.index(B)) % len(names)  # each mode first in turn
            modes = names[k:] + names[:k]
            got = {}
            for mode in modes:
                got[mode] = run(mode, prompts[:B], max_tokens)
                log(f"round {r} B={B} {mode}: decode {got[mode]['decode_tok_s']:.1f} tok/s")
            row = out.setdefault(str(B), {})
            for mode in modes:
                for key in keys:
                    v = got[mode].get(key)
                    row.setdefault(f"{mode}_{key}_runs", []).append(
                        round(v, 3) if isinstance(v, float) else v)
            row.setdefault("same_tokens_runs", []).append(
                all(got[m]["tokens"] == got["batched"]["tokens"] for m in names
                    if m != "grouped"))
            if grouped:  # (not exact: a batched recurrent prefill rounds by its shape)
                row.setdefault("grouped_same_tokens_runs", []).append(
                    got["grouped"]["tokens"] == got["batched"]["tokens"])
    for sch in workers.values():
        sch.close()
    eng.close()
    print(json.dumps(out))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_args(ap, rounds=3)
    ap.add_argument("--arch", choices=HYBRIDS, default="qwen35moe")
    ap.add_argument("--clients", default="1,4,8")
    ap.add_argument("--prompt", type=int, default=32, help="prompt tokens per request")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--drafter", choices=("ngram", "self"),
                    help="speculative decoding in both modes, and a plain batched mode")
    ap.add_argument("--controller", default="static:3",
                    help="with --drafter: the server's --controller (default static:3)")
    ap.add_argument("--cache", type=float, default=1.0,
                    help="share of the experts the cache holds (1: every expert resident, "
                         "loaded before timing; below 1 the experts come from the store, "
                         "where a prefill forward shared by several prompts loads each once)")
    ap.add_argument("--servers", choices=("kept", "fresh"), default="kept",
                    help="kept: one worker per (mode, clients) for the whole process, as a "
                         "running server (its controllers learn across requests); fresh: a new "
                         "worker per run (every run a server's first requests)")
    ap.add_argument("--batch-prefill", action="store_true",
                    help="a third mode, 'grouped': batched decode with the server's "
                         "--batch-prefill (prompts of one length prefilled in one forward; "
                         "not exact on a hybrid)")
    a = ap.parse_args()
    if not 0.0 < a.cache <= 1.0:
        ap.error(f"--cache must be in (0, 1], got {a.cache}")
    threads = int(a.threads.split(",")[-1])  # one thread count: the largest given
    clients = sorted({int(c) for c in a.clients.split(",")})
    if a.quick:
        a.experts, a.rounds, clients, a.max_tokens = 8, 1, [1, 3], 6
    if a._worker:
        worker(a._worker, threads, clients, a.rounds, a.prompt, a.max_tokens, a.cache,
               a.drafter, a.controller if a.drafter else None, a.servers, a.batch_prefill)
        return
    path = gguf_path(a)  # (hybrid_peers.py's files)
    made = write_file(path, a.layers, a.experts, a.quick, a.arch)
    got = run_worker(__file__, path, ["--threads", str(threads), "--clients",
                                      ",".join(map(str, clients)), "--rounds", str(a.rounds),
                                      "--prompt", str(a.prompt), "--max-tokens",
                                      str(a.max_tokens), "--cache", str(a.cache),
                                      "--servers", a.servers]
                     + (["--quick"] if a.quick else [])
                     + (["--batch-prefill"] if a.batch_prefill else [])
                     + (["--drafter", a.drafter, "--controller", a.controller]
                        if a.drafter else []))
    rows: list[dict[str, Any]] = []
    if "error" in got:
        rows.append({"name": "specmoe", **got})
    else:
        one = got.get("1", {}).get("batched_decode_tok_s_runs")
        for B in clients:
            w = got[str(B)]
            b, s = w["batched_decode_tok_s_runs"], w["alone_decode_tok_s_runs"]
            row = {"name": "specmoe", "clients": B, "threads": threads,
                   "batched_decode_tok_s": round(statistics.median(b), 3),
                   "alone_decode_tok_s": round(statistics.median(s), 3),
                   "vs_alone_runs": [round(x / y, 3) for x, y in zip(b, s)],
                   **w}
            if a.drafter:
                p = w["plain_decode_tok_s_runs"]
                row["plain_decode_tok_s"] = round(statistics.median(p), 3)
                row["vs_plain_runs"] = [round(x / y, 3) for x, y in zip(b, p)]
            if a.batch_prefill:  # grouped / batched: the whole run, and the prompts' time
                row["grouped_vs_batched_out_runs"] = [
                    round(x / y, 3) for x, y in zip(w["grouped_out_tok_s_runs"],
                                                    w["batched_out_tok_s_runs"])]
                row["grouped_vs_batched_first_tokens_s_runs"] = [
                    round(x / y, 3) for x, y in zip(w["grouped_first_tokens_s_runs"],
                                                    w["batched_first_tokens_s_runs"])]
            if one:
                row["scaling_runs"] = [round(x / y, 3) for x, y in zip(b, one)]
            rows.append(row)
    res = {"config": {"model": f"{a.arch} ({ARCHS[a.arch]} per-layer shapes)",
                      "layers": a.layers, "experts": a.experts, "quick": a.quick,
                      "prompt_tokens": a.prompt, "max_tokens": a.max_tokens,
                      "cache": a.cache, "drafter": a.drafter,
                      "controller": a.controller if a.drafter else None,
                      "clients": clients, "rounds": a.rounds, "servers": a.servers,
                      "batch_prefill": a.batch_prefill,
                      "file": made,
                      "machine": hostinfo.host(threads)},
           "peers": {"llama-server": "not run here: benchmarks/serve.py --models hybrid "
                                     "serves this GGUF file with both servers"},
           "rows": rows}
    hostinfo.emit(res, a.save, a.json)


if __name__ == "__main__":
    main()

"""Speculative decoding on the zoo pair with offloaded experts: does speculation pay, and does
each controller find out when it does not?

    python benchmarks/speculation.py [--json] [--quick] [--drafters ngram,draft[,self]]
    python benchmarks/speculation.py --batch 1,4,16 [--new-tokens N] [--repeats R] [--json]

(``--batch``: the batched table instead, see :func:`run_batches`.)

Setup: ``tiny-moe`` (target) with its routed experts offloaded by :func:`specmoe.offload`
(store file, ``--cache`` 25% of the experts in the cache, LRU, next-layer prefetch on,
``--dtype`` f32 like ``python -m specmoe demo``: the zoo's bf16 weights convert to f32
exactly, so the offloaded model is the trained model bit for bit; bf16 measured the same within
this machine's noise) and ``tiny-draft`` as the draft model.  One torch intra-op thread: on the
shared 2-core machines two threads made single requests 2-20x slower and wildly variable
(OpenMP threads spinning against other processes), one thread is both faster and steadier, and
the cache's prefetch worker keeps the other core.

Workloads (``--requests`` prompts each, ``--new-tokens`` greedy tokens per request, EOS
ignored so every row does the same work):

* ``code``: Python standard-library files of the interpreter running the script that fall in
  the zoo corpus's held-out split (``training/corpus.py``: SHA-256 of the relative path), so the
  target never trained on them.  Machine-generated files (codec tables, token lists, pydoc's
  topic dump: "generated" in their first lines) are left out: they are tables, not code.
* ``prose``: the docstrings (longer than 80 characters) of the same held-out files, joined as
  ``corpus.docstring_domain`` joins them.  The zoo's prose domain came from Debian's
  ``python3.11-doc``, which a fresh clone cannot count on having offline (``corpus.py``
  downloads it); the docstrings ship with Python itself, are technical English like that
  documentation, and belong to held-out files, so they too are unseen text.
* ``mix``: a 50/50 mix of requests, alternating code and prose (the first half of each list).

A prompt is a window of whole lines of a document, 64-128 tokens, starting at a line that opens
a ``def``/``class`` (code) or a paragraph (prose); documents and windows are drawn with a fixed
seed (``--seed``).

Rows per workload: ``nospec`` (plain decoding through the same loop), and for each drafter
(``ngram``: prompt lookup in C; ``draft``: tiny-draft; ``self``: the target with int4 experts
resident, with draft-driven lookahead prefetch once the draft is done; ``self-overlap``: the
same with each draft step's experts queued as soon as it routes them, MoE-SpeQ's overlapped
pipeline; ``mtp``: multi-token prediction with gated LoRA on the target itself, the
gamma-tolerance paper's drafter, adapter from ``--mtp-adapter``, K <= its k, adaptive
controllers capped at k; ``--throttle GBPS,LATENCY_US`` makes every expert load emulate a slower link, where
the overlap should matter) the controllers ``static`` K=1,2,3,
``heuristic``, ``cascade`` and ``speq``.  Static rows really run K (no gamma-tolerance
pruning); adaptive rows get tau(g) = T(1)/T(g) of the target, measured once at the start
(``specmoe.speculation.tau.target_tau``, reported as ``tau``; the mtp rows get tau(g(k+1)), the
cost of g anchors with their masks, :meth:`specmoe.speculation.mtp.MtpDrafter.tau`).

Method (the machines are shared and noisy, so every comparison is paired in time):

* a warm-up request (untimed) with every drafter first;
* every row gets a fresh controller (and drafter) per repeat that keeps learning across that
  row's requests, like a server's;
* request-major rounds: for request j of workload w, every row of w (nospec included) runs
  request j back to back, the rows' order rotated and its direction alternated from round to
  round, so a slow spell of the machine hits all rows of a round alike instead of one row;
* before every request of every row the engine's cache is rebuilt empty
  (``Engine.set_cache``) and its statistics reset, so each starts from the same cold state
  whatever ran before (16 loads to fill it, the same for every row);
* a row's ``tok_per_s_vs_nospec`` is the median over the repeats of (row tok/s / nospec tok/s
  of the same workload in the same repeat), ``ratio_per_repeat`` lists them, and
  ``ratio_median_per_request`` is the median over every (repeat, request) of the row's tok/s on
  that request over nospec's on it in the same round (less sensitive to one slow spell, but a
  typical request rather than throughput over the whole row); ``tok_per_s`` is
  the median tok/s; tok/s = new tokens / wall time of ``generate`` summed over the requests
  (prefill included, the same for every row); ``etr``, ``acceptance``, ``k_mean`` and
  ``experts_loaded_per_token`` (experts read from the store while decoding) pool all repeats;
  self rows add the draft-driven lookahead's ``lookahead_precision`` / ``lookahead_recall``
  and ``routing_fidelity`` (MoE-SpeQ Fig. 6: the shares of (verified input, layer) pairs
  whose draft top-k equals the target's in order -- hard --, as a set -- soft --, or not);
* ``outputs_equal``: every request's tokens equal nospec's in every repeat (greedy decoding
  must not change the output); a false value is a bug, reported not hidden.

Defaults (4 requests x 64 tokens x 3 repeats, all three drafters: 57 rows, 684 requests) take
about 5.5 minutes on the shared 2-core machine when it is quiet and about 9 when other jobs
keep its load average near 4 (96 tokens took 12.6 minutes there); ``--drafters ngram,draft``
drops the 18 self rows.

``targets``: per drafter, Cascade's worst workload ratio vs nospec (target >= 0.95) and, on the
mix, Cascade's ratio over the best static K's (target >= 1.0).

``--json`` prints ONE JSON object; the tqdm bar goes to stderr.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import re
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "training"))

import hostinfo  # noqa: E402  (before torch: its OpenMP wait policy)

import torch  # noqa: E402

import specmoe  # noqa: E402
from specmoe.speculation import controllers as spec
from specmoe import zoo  # noqa: E402
from specmoe.speculation.drafters import DraftModel, NgramDrafter, SelfDraft  # noqa: E402
from specmoe.speculation.mtp import MtpAdapter, MtpDrafter  # noqa: E402
from specmoe.speculation.generation import generate  # noqa: E402
from specmoe.speculation.tau import target_tau  # noqa: E402

import corpus  # noqa: E402  (training/corpus.py: the held-out split rule and stdlib walk)

WORKLOADS = ("code", "prose", "mix")
DRAFTERS = ("ngram", "draft", "self", "self-overlap", "mtp")
CONTROLLERS: Tuple[Tuple[str, Optional[int]], ...] = (
    ("static", 1), ("static", 2), ("static", 3), ("heuristic", None), ("cascade", None),
    ("speq", None))
# Cascade's ablation (the Cascade paper, Sec. 7, Fig. 18: its optimizations enabled one by one
# on top of static K = k_start = 3): "cascade-disable" tests K = 3 alone and turns speculation
# off for a constant S iterations when it does not pay (trials=1: no hill climbing;
# backoff_max=set_len: no doubling); "cascade-backoff" adds the doubling back-off;
# "cascade-k3" adds hill climbing (the whole controller from k_start = 3; "cascade" is the
# same from specmoe's default centre, 2).  All of them keep specmoe's slowdown budget
# (csrc/spec/controller.h); "cascade-nobudget" and "speq-nobudget" are the whole controllers
# without it.
ABLATIONS: Tuple[Tuple[str, Optional[int]], ...] = (
    ("cascade-disable", None), ("cascade-backoff", None), ("cascade-k3", None),
    ("cascade-nobudget", None), ("speq-nobudget", None))
CONTROLLER_NAMES = {f"{c}{k if k is not None else ''}": (c, k)
                    for c, k in CONTROLLERS + ABLATIONS}
K_MAX = 8  # the adaptive controllers' largest K (their default)
SHARE_KV = [True]  # --self-kv: the self-draft on the target's KV cache (set in main)
MTP: List[Any] = [None]  # --mtp-adapter: the loaded MtpAdapter (set in main)


# ---------------------------------------------------------------------------------------------
# prompts


def _generated(text: str) -> bool:
    return re.search(r"generated", text[:600], re.IGNORECASE) is not None


def heldout_documents() -> Dict[str, List[Tuple[str, str]]]:
    """{"code": [(rel, source)], "prose": [(rel, docstrings)]} of the held-out stdlib files."""
    root = corpus.stdlib_dir()
    code: List[Tuple[str, str]] = []
    prose: List[Tuple[str, str]] = []
    for p in corpus.stdlib_files(root):
        rel = str(p.relative_to(root))
        if not corpus.is_heldout(rel):
            continue
        text = corpus.read_source(p)
        if not text or not text.strip() or _generated(text):
            continue
        code.append((rel, text))
        docs = corpus.docstrings(text)
        if docs:
            prose.append((rel, docs))
    return {"code": code, "prose": prose}


def _starts(lines: List[str], domain: str) -> List[int]:
    if domain == "code":
        return [i for i, ln in enumerate(lines) if re.match(r"\s*(async\s+def|def|class)\s", ln)]
    return [i for i, ln in enumerate(lines)
            if ln.strip() and (i == 0 or not lines[i - 1].strip())]


def make_prompts(tok: Any, docs: List[Tuple[str, str]], domain: str, n: int, seed: int,
                 lo: int = 64, hi: int = 128) -> List[Tuple[str, List[int]]]:
    """n prompts (source name, token ids) of lo..hi tokens cut at line boundaries, from n
    different documents drawn with ``seed``."""
    rng = random.Random(f"{seed}:{domain}")
    order = list(range(len(docs)))
    rng.shuffle(order)
    out: List[Tuple[str, List[int]]] = []
    for di in order:
        rel, text = docs[di]
        lines = text.split("\n")
        starts = _starts(lines, domain)
        rng.shuffle(starts)
        for s in starts[:8]:
            best: Optional[List[int]] = None
            for e in range(s + 1, len(lines) + 1):
                ids = tok("\n".join(lines[s:e]) + "\n").input_ids
                if len(ids) > hi:
                    break
                if len(ids) >= lo:
                    best = ids
            if best is not None:
                out.append((f"{rel}:{s + 1}", best))
                break
        if len(out) == n:
            return out
    raise RuntimeError(f"only {len(out)} {domain} prompts of {lo}-{hi} tokens found in "
                       f"{len(docs)} held-out documents, {n} wanted")


# ---------------------------------------------------------------------------------------------
# rows


def make_drafter(name: Optional[str], eng: Any, draft_model: Any) -> Any:
    """The drafter of a row (None: plain decoding).  ``self-overlap`` queues each draft
    step's experts as soon as it routes them; the self-drafts use the target's KV cache
    unless ``--self-kv own``."""
    if name is None:
        return None
    if name == "ngram":
        return NgramDrafter()
    if name == "draft":
        return DraftModel(draft_model)
    if name == "mtp":
        # the adapter's gated LoRA wraps the target's attention projections only while an mtp
        # row runs (mtp_installed), so that the other rows time the unmodified model
        dr = MtpDrafter(eng.model, MTP[0])
        MTP[0].uninstall()
        return dr
    return SelfDraft(eng, "int4", overlap=name == "self-overlap", share_kv=SHARE_KV[0])


def make_controller(name: str, k: Optional[int], drafter: Any = None) -> spec.Controller:
    """A fresh controller; the adaptive ones go up to K_MAX, or the MTP adapter's k (the most
    it drafts)."""
    k_max = drafter.k if isinstance(drafter, MtpDrafter) else K_MAX
    if name == "static":
        assert k is not None
        return spec.StaticK(k)
    if name == "heuristic":
        return spec.Heuristic(initial=min(5, k_max), k_max=k_max)
    if name == "cascade":
        return spec.Cascade(k_max=k_max)
    if name == "cascade-disable":
        return spec.Cascade(k_max=k_max, initial=min(3, k_max), trials=1, backoff_max=16)
    if name == "cascade-backoff":
        return spec.Cascade(k_max=k_max, initial=min(3, k_max), trials=1)
    if name == "cascade-k3":
        return spec.Cascade(k_max=k_max, initial=min(3, k_max))
    if name == "cascade-nobudget":
        return spec.Cascade(k_max=k_max, budget=None)
    if name == "speq":
        return spec.SpeqGovernor(k_max=k_max)
    if name == "speq-nobudget":
        return spec.SpeqGovernor(k_max=k_max, budget=None)
    raise ValueError(name)


def tau_g_max(drafters: List[str]) -> int:
    """How far tau(g) is measured: K_MAX + 1 tokens, or (k + 1)^2 for the MTP rows (k + 1
    anchors, each with k masks)."""
    g = K_MAX + 1
    if "mtp" in drafters and MTP[0] is not None:
        g = max(g, (MTP[0].cfg.k + 1) ** 2)
    return g


def row_tau_table(tau: Optional[Dict[int, float]], drafter: Any) -> Optional[Dict[int, float]]:
    """The tau table a row's controller gets: the target's tau(g) for g <= K_MAX + 1, or for
    the MTP drafter tau'(g) = tau(g(k+1)) (MtpDrafter.tau: its verifications carry masks)."""
    if tau is None:
        return None
    if isinstance(drafter, MtpDrafter):
        return drafter.tau(tau, drafter.k + 1)
    return {g: t for g, t in tau.items() if g <= K_MAX + 1}


@contextmanager
def mtp_installed(drafter: Any) -> Iterator[None]:
    """The MTP adapter on the target for the duration of one run of an mtp row."""
    if not isinstance(drafter, MtpDrafter):
        yield
        return
    drafter.adapter.install(drafter.model)
    try:
        yield
    finally:
        drafter.adapter.uninstall()


class Row:
    """One row's state across a repeat: its drafter and controller persist over its requests
    (like a server's), its totals add up, its outputs are kept for the equality check."""

    def __init__(self, spec_row: Dict[str, Any], eng: Any, draft_model: Any) -> None:
        self.row = spec_row
        self.drafter: Any = None
        self.ctl: Optional[spec.Controller] = None
        self.drafter = make_drafter(spec_row["drafter"], eng, draft_model)
        if self.drafter is not None:
            self.ctl = make_controller(spec_row["controller"], spec_row["k"], self.drafter)
        self.tot: Dict[str, Any] = {"tokens": 0, "time_s": 0.0, "iterations": 0, "proposed": 0,
                                    "accepted": 0, "experts_loaded": 0, "la_predicted": 0,
                                    "la_true_positive": 0, "la_actual": 0,
                                    "fidelity": {"hard": 0, "soft": 0, "mismatch": 0},
                                    # where the time went (time_split below): plain (K=0)
                                    # iterations, speculative ones and what they emitted
                                    "plain_n": 0, "plain_s": 0.0, "spec_n": 0, "spec_s": 0.0,
                                    "spec_emitted": 0}
        self.outputs: List[List[int]] = []
        self.per_request: List[float] = []  # tok/s of each request

    def run(self, model: Any, eng: Any, ids: List[int], a: argparse.Namespace,
            tau: Optional[Dict[int, float]]) -> None:
        eng.set_cache(a.cache)  # every request of every row starts from the same empty cache
        eng.reset_stats()
        row_tau = row_tau_table(tau, self.drafter) if self.row["controller"] != "static" \
            else None
        with mtp_installed(self.drafter):
            o = generate(model, torch.tensor([ids]), self.drafter, self.ctl,
                         max_new_tokens=a.new_tokens, do_sample=False, eos_token_id=None,
                         tau=row_tau, engine=eng)
        s, t = o.stats, self.tot
        t["tokens"] += s["new_tokens"]
        t["time_s"] += s["time_s"]
        t["iterations"] += s["iterations"]
        t["proposed"] += s["proposed"]
        t["accepted"] += s["accepted"]
        t["experts_loaded"] += s["experts_loaded"]
        if "lookahead_predicted" in s:  # pooled over requests: precision = hits / predicted
            t["la_predicted"] += s["lookahead_predicted"]
            t["la_true_positive"] += s["lookahead_hits"]
            t["la_actual"] += s["lookahead_used"]
        for c, n in (eng.stats().get("routing_fidelity_pairs") or {}).items():
            t["fidelity"][c] += n  # (stats were reset before the request)
        for it in o.iterations:
            if it["k"] > 0:
                t["spec_n"] += 1
                t["spec_s"] += it["t_iter"]
                t["spec_emitted"] += it["emitted"]
            else:
                t["plain_n"] += 1
                t["plain_s"] += it["t_iter"]
        self.outputs.append(o.sequences[0, len(ids):].tolist())
        self.per_request.append(s["new_tokens"] / s["time_s"])


def _median(xs: List[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def _r(x: Any, nd: int = 4) -> Any:
    return None if x is None else (round(float(x), nd) if math.isfinite(float(x)) else None)


def tot(rows: List[Row], key: str) -> Any:
    """The sum of one running total over a row's repeats."""
    return sum(x.tot[key] for x in rows)


def time_split(rr: List[Row], nospec: List[Row]) -> Dict[str, Any]:
    """Where a row's time went against plain decoding's, pooled over its repeats (issue 39:
    which cost of speculating a controller does not see).

    ``plain_step_vs_nospec``: the mean K=0 iteration of this row over nospec's mean iteration
    (above 1: plain steps slowed by what speculating did, which the controller takes as its
    base).  ``spec_loss_steps_per_request``: what the speculative iterations cost beyond the
    plain steps their tokens would have taken, in nospec steps (the drafter's catch-up over
    the prompt lands in the first).  ``outside_iterations_s_per_request`` against nospec's:
    the rest of a request (prefill, set-up)."""
    reqs = max(1, sum(len(x.per_request) for x in rr))
    n_reqs = max(1, sum(len(x.per_request) for x in nospec))
    step = tot(nospec, "plain_s") / max(1.0, tot(nospec, "plain_n"))
    n_plain = tot(rr, "plain_n")
    plain = tot(rr, "plain_s") / n_plain if n_plain else None
    loss = (tot(rr, "spec_s") - tot(rr, "spec_emitted") * step) / step if step > 0 else None

    def outside(rows: List[Row], n: int) -> float:
        return (tot(rows, "time_s") - tot(rows, "plain_s") - tot(rows, "spec_s")) / n
    return {"nospec_step_ms": _r(1e3 * step, 3),
            "plain_step_vs_nospec": _r(plain / step) if plain is not None and step > 0 else None,
            "spec_iterations_per_request": _r(tot(rr, "spec_n") / reqs, 2),
            "spec_loss_steps_per_request": _r(loss / reqs, 2) if loss is not None else None,
            "outside_iterations_s_per_request": _r(outside(rr, reqs)),
            "nospec_outside_iterations_s_per_request": _r(outside(nospec, n_reqs))}


BATCH_CONTROLLERS: Tuple[Tuple[str, Optional[int]], ...] = (
    ("static", 2), ("cascade", None), ("speq", None))


def run_batches(a: argparse.Namespace, model: Any, tok: Any, draft_model: Any, eng: Any,
                drafters: List[str], prompts: Dict[str, List[Tuple[str, List[int]]]],
                warm: List[int]) -> Dict[str, Any]:
    """``--batch``: per batch size B, B requests (code and prose alternating) decoded together
    (left-padded, :func:`specmoe.generate` with an attention mask): plain batched decoding
    (``nospec``, the same loop without a drafter) and each drafter under StaticK(2), Cascade
    and the speq governor, all with tau(g, B) measured at the batch sizes in use (the static
    row runs K as given) and the success condition on.  Rows report the whole batch's tok/s,
    its ratio over nospec at the same B (median over repeats, rows rotated per repeat),
    acceptance per draft position, experts loaded per token, K=0 steps (speculation switched
    off) and whether each sequence's output equals nospec's."""
    from specmoe.speculation.tau import measure_tau_grid
    sizes = sorted({int(b) for b in a.batch.split(",") if b.strip()})
    pool = [p for pair in zip(prompts["code"], prompts["prose"]) for p in pair]
    tau_grid = measure_tau_grid(model, warm, sizes, g_max=tau_g_max(drafters), engine=eng,
                                repeats=2 if a.quick else 5)
    tau_grid = {b: dict(t) for b, t in tau_grid.items()}  # set_cache below clears the engine's
    rows: List[Dict[str, Any]] = []
    for b in sizes:
        rows.append({"batch": b, "drafter": None, "controller": "nospec", "k": None})
        for d in drafters:
            for c, k in BATCH_CONTROLLERS:
                rows.append({"batch": b, "drafter": d, "controller": c, "k": k})
    res: Dict[int, List[Dict[str, Any]]] = {i: [] for i in range(len(rows))}
    from tqdm import tqdm
    bar = tqdm(total=len(rows) * a.repeats, desc="speculation --batch", unit="run",
               file=sys.stderr)
    for rep in range(a.repeats):
        for b in sizes:
            idx = [i for i, r in enumerate(rows) if r["batch"] == b]
            sh = rep % len(idx)
            idx = idx[sh:] + idx[:sh]
            if rep % 2:
                idx.reverse()
            batch = [pool[(j + rep * b) % len(pool)][1] for j in range(b)]
            L = max(map(len, batch))
            ids = torch.tensor([[0] * (L - len(x)) + x for x in batch])
            mask = torch.tensor([[0] * (L - len(x)) + [1] * len(x) for x in batch])
            for i in idx:
                r = rows[i]
                eng.set_cache(a.cache)
                eng.reset_stats()
                eng.tau.update({bb: dict(t) for bb, t in tau_grid.items()})
                dr: Any = make_drafter(r["drafter"], eng, draft_model)
                ctl = make_controller(r["controller"], r["k"], dr) if dr is not None else None
                tau_arg: Any = None if r["controller"] == "static" else {
                    bb: row_tau_table(t, dr) for bb, t in tau_grid.items()}
                with mtp_installed(dr):
                    o = generate(model, ids, dr, ctl, attention_mask=mask,
                                 max_new_tokens=a.new_tokens, eos_token_id=None, tau=tau_arg,
                                 engine=eng)
                st = o.stats
                res[i].append({"tok_per_s": st["new_tokens"] / st["time_s"],
                               "out": o.sequences[:, L:].tolist(), "stats": st,
                               "its": o.iterations})
                bar.update(1)
    bar.close()
    out_rows = []
    from specmoe.speculation.batch import per_position_acceptance
    for i, r in enumerate(rows):
        base = next(j for j, x in enumerate(rows) if x["batch"] == r["batch"]
                    and x["controller"] == "nospec")
        ratios = [x["tok_per_s"] / y["tok_per_s"] for x, y in zip(res[i], res[base])]
        its = [it for x in res[i] for it in x["its"]]
        pairs = [(k, acc) for it in its for k, acc in zip(it.get("k_rows", [it["k"]]),
                                                         it.get("accepted_rows",
                                                                [it["accepted"]]))]
        toks = sum(x["stats"]["new_tokens"] for x in res[i])
        prop = sum(k for k, _ in pairs)
        row = dict(r)
        row.update({
            "tok_per_s": _r(_median([x["tok_per_s"] for x in res[i]]), 2),
            "tok_per_s_vs_nospec": _r(_median(ratios)),
            "ratio_per_repeat": [_r(x, 3) for x in ratios],
            "acceptance": _r(sum(acc for _, acc in pairs) / prop) if prop else None,
            "acceptance_per_position": [_r(x, 3) for x in per_position_acceptance(pairs)],
            "k_mean": _r(sum(it["k"] for it in its) / len(its)) if its else None,
            "spec_off_steps": _r(sum(1 for it in its if it["k"] == 0) / len(its)) if its else None,
            "experts_loaded_per_token": _r(sum(x["stats"]["experts_loaded"] for x in res[i])
                                           / toks) if toks else None,
            "outputs_equal": all(x["out"] == y["out"] for x, y in zip(res[i], res[base])),
        })
        out_rows.append(row)
    return {"batch_sizes": sizes,
            "tau_by_batch": {str(b): {str(g): round(v, 4) for g, v in t.items()}
                             for b, t in tau_grid.items()},
            "rows": out_rows}


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: 2 requests of 8 tokens per workload, 1 repeat")
    ap.add_argument("--drafters", default="ngram,draft,self",
                    help=f"comma-separated subset of {','.join(DRAFTERS)} (self: int4 "
                         f"self-draft with lookahead prefetch)")
    ap.add_argument("--requests", type=int, default=4, help="requests per workload (even)")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--cache", type=float, default=0.25, help="cache fraction of all experts")
    ap.add_argument("--dtype", default="f32", help="store dtype of the offloaded experts")
    ap.add_argument("--self-kv", choices=("shared", "own"), default="shared",
                    help="the self-draft rows draft on the target's KV cache (MoE-SpeQ) or on "
                         "a cache of their own")
    ap.add_argument("--protect", choices=("on", "off"), default="on",
                    help="lookahead-aware eviction of the self-draft rows (Engine."
                         "protect_lookahead)")
    ap.add_argument("--throttle", default=None, metavar="GBPS,LATENCY_US",
                    help="emulate a slower link for every expert load (specmoe.runtime.misses)")
    ap.add_argument("--mtp-adapter", type=Path, default=None,
                    help="the mtp rows' adapter folder (default: the zoo's tiny-moe-mtp, "
                         "written by training/mtp.py)")
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    ap.add_argument("--tau", choices=("auto", "off"), default="auto",
                    help="gamma-tolerance pruning for the adaptive controllers")
    ap.add_argument("--seed", type=int, default=0, help="choice of documents and windows")
    ap.add_argument("--draft-layers", choices=("c", "torch"), default="c",
                    help="the draft model's decode steps: specmoe's C layers (as "
                         "DraftModel.from_pretrained gives them) or transformers' torch forward")
    ap.add_argument("--controllers", default=",".join(
                        f"{c}{k if k is not None else ''}" for c, k in CONTROLLERS),
                    help="comma-separated rows per drafter, from "
                         f"{','.join(CONTROLLER_NAMES)} (cascade-*: Cascade's ablation, "
                         "Fig. 18)")
    ap.add_argument("--batch", default=None,
                    help="comma-separated batch sizes (e.g. 1,4,16): run the batched table "
                         "instead of the batch-1 one (see run_batches)")
    a = ap.parse_args(argv)
    if a.quick:
        a.requests, a.new_tokens, a.repeats = 2, 8, 1
    drafters = [d.strip() for d in a.drafters.split(",") if d.strip()]
    ctl_names = [c.strip() for c in a.controllers.split(",") if c.strip()]
    bad_c = [c for c in ctl_names if c not in CONTROLLER_NAMES]
    if bad_c or not ctl_names:
        ap.error(f"--controllers: unknown {bad_c}; choose from {list(CONTROLLER_NAMES)}")
    controllers = [CONTROLLER_NAMES[c] for c in ctl_names]
    bad = [d for d in drafters if d not in DRAFTERS]
    if bad or not drafters:
        ap.error(f"--drafters: unknown {bad}; choose from {DRAFTERS}")
    if a.requests < 2 or a.requests % 2:
        ap.error("--requests must be even and >= 2 (the mix alternates code and prose)")
    if a.new_tokens < 2 or a.repeats < 1:
        ap.error("--new-tokens must be >= 2 and --repeats >= 1")
    from tqdm import tqdm

    torch.set_num_threads(a.threads)
    torch.manual_seed(0)
    load0 = os.getloadavg()[0]
    t_all = time.perf_counter()

    model, tok = zoo.load("tiny-moe", experts_implementation="eager")
    draft_model, _ = zoo.load("tiny-draft")
    model.eval()
    draft_model.eval()
    if a.draft_layers == "c":  # its decode steps through specmoe's C layers, in place, once
        DraftModel(draft_model, c_layers=True)
    docs = heldout_documents()
    n_prompts = a.requests + 1
    if a.batch:
        try:
            bmax = max(int(b) for b in a.batch.split(",") if b.strip())
        except ValueError:
            ap.error(f"--batch: comma-separated ints, got {a.batch!r}")
        if bmax < 1:
            ap.error("--batch sizes must be >= 1")
        n_prompts = max(n_prompts, (bmax + 1) // 2 + 1)
    prompts = {d: make_prompts(tok, docs[d], d, n_prompts, a.seed) for d in ("code", "prose")}
    warm = prompts["code"].pop()  # the extra prompt is the warm-up
    prompts["prose"].pop()
    half = a.requests // 2
    mix = [p for pair in zip(prompts["code"][:half], prompts["prose"][:half]) for p in pair]
    work = {"code": prompts["code"], "prose": prompts["prose"], "mix": mix}

    throttle = None
    if a.throttle:
        gbps, lat = (float(x) for x in a.throttle.split(","))
        throttle = (gbps, lat)
    eng = specmoe.offload(model, cache=a.cache, dtype=a.dtype, throttle=throttle)
    eng.protect_lookahead = a.protect == "on"
    if "mtp" in drafters:
        path = a.mtp_adapter or zoo.root() / "tiny-moe-mtp"
        if not (path / "mtp_adapter.safetensors").is_file():
            ap.error(f"--drafters mtp: no adapter in {path} (train one with training/mtp.py)")
        MTP[0] = MtpAdapter.load(path)
    SHARE_KV[0] = a.self_kv == "shared"
    try:
        if "self" in drafters or "self-overlap" in drafters:
            eng.enable_self_draft("int4")
        # warm-up: every drafter once, untimed
        for d in [None] + drafters:
            dr = make_drafter(d, eng, draft_model)
            with mtp_installed(dr):
                generate(model, torch.tensor([warm[1]]), dr, spec.StaticK(2) if dr else None,
                         max_new_tokens=min(a.new_tokens, 24), eos_token_id=None, tau=None,
                         engine=eng)
        if a.batch:
            bres = run_batches(a, model, tok, draft_model, eng, drafters, prompts, warm[1])
            result_b = {"benchmark": "speculation_batch",
                        "config": {"target": "tiny-moe", "draft": "tiny-draft",
                                   "cache": a.cache, "dtype": a.dtype, "threads": a.threads,
                                   "new_tokens": a.new_tokens, "repeats": a.repeats,
                                   "drafters": drafters, "k_max_adaptive": K_MAX,
                                   "machine": f"{platform.machine()}, {os.cpu_count()} cpus",
                                   "host": hostinfo.host(a.threads),
                                   "loadavg_start": round(load0, 2),
                                   "loadavg_end": round(os.getloadavg()[0], 2),
                                   "wall_s": round(time.perf_counter() - t_all, 1)},
                        **bres}
            if a.json:
                print(json.dumps(result_b))
            else:
                print(f"{'B':>3} {'drafter':7} {'controller':10} {'vs nospec':>9} {'tok/s':>8} "
                      f"{'k_mean':>6} {'off':>5} {'loads/tok':>9} equal  acceptance/position")
                for x in bres["rows"]:
                    print(f"{x['batch']:>3} {str(x['drafter']):7} {x['controller']:10} "
                          f"{x['tok_per_s_vs_nospec']:>9.3f} {x['tok_per_s']:>8.1f} "
                          f"{x['k_mean']:>6.2f} {x['spec_off_steps']:>5.2f} "
                          f"{x['experts_loaded_per_token']:>9.2f} {x['outputs_equal']!s:5} "
                          f"{x['acceptance_per_position']}")
            return 0
        tau: Optional[Dict[int, float]] = None
        if a.tau == "auto":
            tau = target_tau(model, warm[1], tau_g_max(drafters), eng,
                             repeats=2 if a.quick else 7)

        rows: List[Dict[str, Any]] = []
        for w in WORKLOADS:
            rows.append({"workload": w, "drafter": None, "controller": "nospec", "k": None})
            for d in drafters:
                for c, k in controllers:
                    rows.append({"workload": w, "drafter": d, "controller": c, "k": k})
        per = len(rows) // len(WORKLOADS)
        res: List[List[Row]] = [[] for _ in rows]  # [row][repeat]
        bar = tqdm(total=len(rows) * a.repeats * a.requests, desc="speculation", unit="req",
                   file=sys.stderr)
        n_round = 0
        for rep in range(a.repeats):
            state = [Row(r, eng, draft_model) for r in rows]
            for j in range(a.requests):
                for wi in range(len(WORKLOADS)):
                    w = WORKLOADS[(wi + rep + j) % len(WORKLOADS)]
                    idx = [i for i, r in enumerate(rows) if r["workload"] == w]
                    sh = n_round % per  # rotate (and alternate the direction of) the order
                    idx = idx[sh:] + idx[:sh]
                    if n_round % 2:
                        idx.reverse()
                    n_round += 1
                    for i in idx:
                        r = rows[i]
                        bar.set_postfix_str(f"{w} {r['drafter'] or ''} {r['controller']}"
                                            f"{'' if r['k'] is None else r['k']}")
                        state[i].run(model, eng, work[w][j][1], a, tau)
                        bar.update(1)
            for i, st in enumerate(state):
                res[i].append(st)
        bar.close()
    finally:
        eng.close()

    nospec = {rows[i]["workload"]: res[i] for i in range(len(rows))
              if rows[i]["controller"] == "nospec"}
    out_rows = []
    for r, rr in zip(rows, res):
        ratios, tps = [], []
        for rep, x in enumerate(rr):
            v = x.tot["tokens"] / x.tot["time_s"]
            n = nospec[r["workload"]][rep].tot
            tps.append(v)
            ratios.append(v / (n["tokens"] / n["time_s"]))

        paired = [v / nv for x, nx in zip(rr, nospec[r["workload"]])
                  for v, nv in zip(x.per_request, nx.per_request)]
        toks, its, prop = tot(rr, "tokens"), tot(rr, "iterations"), tot(rr, "proposed")
        equal = all(x.outputs == nx.outputs for x, nx in zip(rr, nospec[r["workload"]]))
        row = dict(r)
        row.update({
            "tok_per_s_vs_nospec": _r(_median(ratios)),
            "etr": _r(toks / its) if its else None,
            "experts_loaded_per_token": _r(tot(rr, "experts_loaded") / toks) if toks else None,
            "tok_per_s": _r(_median(tps), 2),
            "acceptance": _r(tot(rr, "accepted") / prop) if prop else None,
            "k_mean": _r(prop / its) if its else None,
            "outputs_equal": bool(equal),
            "ratio_per_repeat": [_r(x, 3) for x in ratios],
            "ratio_median_per_request": _r(_median(paired)),
        })
        row["time_split"] = time_split(rr, nospec[r["workload"]])
        if r["drafter"] in ("self", "self-overlap"):
            pr, tp, ac = tot(rr, "la_predicted"), tot(rr, "la_true_positive"), tot(rr, "la_actual")
            row["lookahead_precision"] = _r(tp / pr) if pr else None
            row["lookahead_recall"] = _r(tp / ac) if ac else None
            fid = {c: sum(x.tot["fidelity"][c] for x in rr) for c in ("hard", "soft",
                                                                       "mismatch")}
            nf = sum(fid.values())
            row["routing_fidelity"] = {c: _r(n / nf) for c, n in fid.items()} if nf else None
        out_rows.append(row)

    def find(w: str, d: Optional[str], c: str, k: Optional[int] = None) -> Dict[str, Any]:
        return next(x for x in out_rows if x["workload"] == w and x["drafter"] == d
                    and x["controller"] == c and x["k"] == k)

    targets: Dict[str, Any] = {"cascade_worst_vs_nospec": {}, "cascade_vs_best_static_on_mix": {}}
    have = set(controllers)
    for d in (drafters if ("cascade", None) in have else []):
        per_w = {w: find(w, d, "cascade")["tok_per_s_vs_nospec"] for w in WORKLOADS}
        worst = min(per_w, key=lambda w: per_w[w])
        targets["cascade_worst_vs_nospec"][d] = {
            "workload": worst, "ratio": per_w[worst], "target": 0.95,
            "met": bool(per_w[worst] >= 0.95),
            "ratio_median_per_request": find(worst, d, "cascade")["ratio_median_per_request"]}
        st = {k: find("mix", d, "static", k)["tok_per_s_vs_nospec"] for k in (1, 2, 3)
              if ("static", k) in have}
        if not st:
            continue
        kbest = max(st, key=lambda k: st[k])
        casc = find("mix", d, "cascade")["tok_per_s_vs_nospec"]
        ratio = casc / st[kbest]
        targets["cascade_vs_best_static_on_mix"][d] = {
            "best_static_k": kbest, "cascade_vs_nospec": casc, "static_vs_nospec": st[kbest],
            "ratio": _r(ratio), "target": 1.0, "met": bool(ratio >= 1.0)}

    result = {
        "benchmark": "speculation",
        "config": {
            "target": "tiny-moe", "draft": "tiny-draft", "cache": a.cache, "dtype": a.dtype,
            "policy": "lru", "prefetch": True, "threads": a.threads, "requests": a.requests,
            "new_tokens": a.new_tokens, "repeats": a.repeats, "quick": a.quick,
            "drafters": drafters, "controllers": ctl_names, "k_max_adaptive": K_MAX,
            "seed": a.seed, "draft_layers": a.draft_layers,
            "throttle": a.throttle, "protect_lookahead": a.protect == "on",
            "self_kv": a.self_kv,
            "prompts": {w: [name for name, _ in work[w]] for w in WORKLOADS},
            "prompt_tokens": {w: [len(ids) for _, ids in work[w]] for w in WORKLOADS},
            "machine": f"{platform.machine()}, {os.cpu_count()} cpus",
            "host": hostinfo.host(a.threads),
            "loadavg_start": round(load0, 2), "loadavg_end": round(os.getloadavg()[0], 2),
            "wall_s": round(time.perf_counter() - t_all, 1),
        },
        "tau": None if tau is None else {str(g): round(v, 4) for g, v in tau.items()},
        "rows": out_rows,
        "targets": targets,
    }
    if a.json:
        print(json.dumps(result))
    else:
        print(f"{'workload':8} {'drafter':7} {'controller':10} {'k':>2} {'vs nospec':>9} "
              f"{'tok/s':>8} {'etr':>5} {'acc':>5} {'k_mean':>6} {'loads/tok':>9} equal")
        for x in out_rows:
            print(f"{x['workload']:8} {str(x['drafter']):7} {x['controller']:10} "
                  f"{'' if x['k'] is None else x['k']:>2} {x['tok_per_s_vs_nospec']:>9.3f} "
                  f"{x['tok_per_s']:>8.1f} {x['etr']:>5.2f} "
                  f"{'' if x['acceptance'] is None else round(x['acceptance'], 2):>5} "
                  f"{x['k_mean']:>6.2f} {x['experts_loaded_per_token']:>9.2f} "
                  f"{x['outputs_equal']}")
        print(json.dumps(targets, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

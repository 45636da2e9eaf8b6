"""The server's scheduler: one worker thread owns the model and steps every admitted request.

torch modules, transformers' caches and specmoe's Engine are not safe to drive from several
threads at once, so exactly one thread -- the worker started by :meth:`Scheduler.start` --
calls the model.  Requests reach it through a bounded queue (:meth:`Scheduler.submit` raises
:class:`QueueFull` when ``max_queue`` requests already wait, :class:`Draining` once
:meth:`Scheduler.drain` was called); the worker admits waiting requests into the running set
(at most ``max_batch``) at the start of every round, and a round advances every running
request by one step:

* **decode**: every request whose prompt is all cached feeds its pending token and picks the
  next one.  Two or more such requests decode together in **one batched forward**
  (continuous batching): their KV caches are rows of one
  :class:`specmoe.speculation.batch.BatchKV` (holes where a row is shorter, each row's own
  position ids, so no padding waste in what the model computes for a row), so every MoE layer
  runs the batch's tokens in one call of the Engine and one expert load serves every row
  routed to it.  A request joins the batch at its first decode step after its prefill (its
  own cache copied in once) and leaves it when it finishes, is cancelled or fails
  (``batch_select_indices``), without waiting for the others; a request decoding alone runs
  on its own cache (the one-call decode step of batch 1);
* **prefill**: a prompt feeds its next ``prefill_chunk`` tokens into its own
  ``DynamicCache`` at batch 1 each round, the forward ``model.generate`` runs for it (so the
  others keep decoding between a long prompt's chunks); prompts of one length admitted since
  the last round and fitting one chunk are prefilled together, up to 16 in one forward
  without pads, each on the implementations of its prefill alone
  (:func:`specmoe.models.layers.sequences`), so one expert load serves them all.  With
  ``batch_prefill`` (off by default: it costs exactness, below) prompts of different lengths
  are grouped too, a few at a time, in one forward of a left-padded BatchKV (grouped by
  length so that the padding, which the MoE layers route like any token, stays within a
  quarter of the real tokens).  Each request's cache is then copied out of the batch.  The
  step that feeds a prompt's last token also picks the first new token.
* **pacing** (off unless ``prefill_ratio`` is set, e.g. 2): while requests decode, a round's
  prefill work is held to about ``prefill_ratio`` decode steps' time, so that new arrivals
  do not stall the running requests' next tokens: the requests waiting for their prompt are
  taken in arrival
  order, each with its next chunk, while the chunks' estimated time (the measured seconds per
  prompt token, a moving average) stays within ``prefill_ratio`` times the measured decode
  step; at least one chunk runs every round, so no prompt waits forever.  The others keep
  their place for the next round.  With nothing decoding every waiting prompt is prefilled at
  once (in batched forwards where the grouping above allows).  Chunk boundaries never
  depend on the pacing (a prompt is always fed ``prefill_chunk`` tokens at a time), only
  which round feeds them.

* **speculation** (off unless ``drafter`` is set, :mod:`specmoe.serve.speculate`): a decode
  step first drafts up to K tokens per request (K from the controller of the batch's size,
  less what each request's ``max_tokens`` leaves; with the MTP drafter, the drafts its last
  step's masks made, the verification forward carrying the masks of the next step), then
  verifies every row's pending token
  and drafts in the same one batched forward (rows of different lengths: the shorter ones'
  tail is holes), or in one forward of a request decoding alone; each request accepts with
  its own sampling law and generator, its cache keeps the pending token and the accepted
  drafts (the rest become holes, or are cropped off its own cache), and every accepted
  token is emitted in order, so a request may advance several tokens per round.  A step
  with K = 0 is the plain decode step above.

A request leaves the running set as soon as it finishes (EOS, a stop string, ``max_tokens``),
is cancelled (client gone: freed at the worker's next look at it, within one round) or fails.
An exception inside the model while a request steps alone fails that request alone (its cache
is dropped; the others' are untouched).  An exception in a batched forward cannot be pinned on
one request: a batched prefill's requests each prefill alone instead; a batched decode's batch
is dissolved into per-request caches (:meth:`BatchKV.row` reads each row's
real positions through the mask, so whatever the failed forward had appended is left behind),
every request retries its step alone (where a fault is its own and fails only it); either
way the next ``_BATCH_PAUSE`` rounds do not batch.  Models whose cache
cannot hold holes (sliding-window layers, MiniMax's cache of its own) are never batched: their
requests are interleaved step by step, one forward each, as before.

Models with recurrent layers (linear attention, Mamba, short convolutions: Qwen3-Next,
Qwen3.5-MoE, Jamba, Kimi-Linear, GraniteMoeHybrid, Ling, LFM2, on transformers 5.25's cache
layers) batch their plain decode steps: each row's recurrent state is row b of its layer's
state tensors (:class:`BatchKV`, "stateful"), and the attention layers hold holes as above.
Their prompts are prefilled alone (a batched linear-attention or Mamba prefill runs torch's
chunked paths, which round a row by the batch's shape); with ``batch_prefill`` prompts of one
length share a prefill forward (never padded: a recurrent state cannot skip a pad), close to
but not bit for bit their prefills alone.  With a drafter (not MTP) the batch's
recurrent layers record their states over a verification's tokens (:class:`BatchKV`'s
window), so rows verify drafts of different lengths together and each is cut back to its own
accepted ones; steps without drafts run unrecorded.  Where a memory plan did not set aside
the states ``max_batch`` rows record, every request verifies on its own cache instead.  A
fault in a batched decode step of such a model fails every row of it (500): a state keeps no
positions, so the part of the step it may hold cannot be taken back out.

Exactness: a prefill step is the model's own forward on that request's cache, as
``model.generate`` calls it (the whole prompt, or a chunk of it, with ``logits_to_keep=1``);
a request decoding alone runs exactly ``model.generate``'s decode step.  A batched decode step
is the same model on B rows (masked holes get attention weight 0; every other layer works
per token), its rows run as sequences of their own (:meth:`BatchKV.forward`): where a row's
matrix products run in C (the experts always, the dense layers of a bf16 model or with
``dense=``, up to 16 tokens a row) it gets the bits of its step alone whatever the batch's
size, the C kernels being batch invariant (docs/speculation.md, "How exact").  Products left
in torch (an f32 model's dense layers) may round by shape in the last bits (``dense="f32"``
puts them in C).  A prefill of prompts of one length gives each the bits of its prefill
alone on the same terms (its products in C, or in torch's GEMMs, which gave every row its
bits at any row count above 16 in our measurements; a GGUF file's blocks in C keep the
one-token order at any token count, csrc/kernels/ffn_blocks.c INVARIANT_T).  A batched
prefill of other lengths (``batch_prefill``) is not exact: the group is left-padded, a
padded prompt's torch attention runs beside a mask its prefill alone does not have, and the
group's length may put it on the other side of specmoe's switches between C (decode sizes)
and torch (projections past 16 rows, norms past 64, the fused attention past 16 tokens a
row) than the prompt alone, whose roundings differ; a greedy path can then leave
``model.generate``'s (seen on a random 1024-wide bf16 Mixtral: a 14-token prompt beside a
20-token one).  A longer prompt prefilled in chunks may round differently too
(``model.generate`` feeds it whole).  Sampling draws from a ``torch.Generator`` of the
request's own (``seed``), so a seeded request gives the same tokens whatever else runs (up
to such rounding).  With a drafter, greedy output is still the target's own (a draft is
kept only where it equals the target's argmax), and sampled output follows the request's
sampling law exactly (the speculative-sampling rule); but how many uniforms a step draws
depends on K, which the controller of the batch's size picks, so a seeded request's tokens
may then depend on its company.
"""
from __future__ import annotations

import collections
import contextlib
import itertools
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

import torch
from torch import nn

from ..models.decode_step import decode_step_of
from ..models.dense import generation_session
from ..runtime.experts import find_engine
from ..speculation.batch import BatchKV, is_state_layer, row_layer_kind
from ..speculation.decoding import (cache_kwargs, crop_kv, input_device, new_kv,
                                    records_recurrent_states, recurrent_layer_types,
                                    require_recording_planned, unrecorded)
from ..speculation.sampling import Sampling
from ..speculation.verify import accept_logits, greedy_tokens
from .detok import IncrementalText
from .speculate import Speculation, synthetic_history

_log = logging.getLogger("specmoe.serve")

__all__ = ["Draining", "GenParams", "QueueFull", "Request", "Scheduler", "serve_all"]

# how often (seconds) the worker refreshes its copy of the Engine's statistics for /metrics
_STATS_EVERY = 0.5
# rounds without batched decoding after a batched forward raised
_BATCH_PAUSE = 16


class QueueFull(Exception):
    """``max_queue`` requests are already waiting (HTTP 429)."""


class Draining(Exception):
    """The scheduler no longer admits requests (shutting down; HTTP 503)."""


@dataclass
class GenParams:
    """How one request generates: ``temperature`` 0 is greedy; ``top_k`` None/0 and ``top_p``
    None/1 keep every token; ``stop`` strings end the text before them; ``eos`` token ids end
    it after them (not part of the text); ``seed`` None draws a fresh seed."""

    max_tokens: int
    temperature: float = 1.0
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    seed: Optional[int] = None
    stop: List[str] = field(default_factory=list)
    eos: frozenset = frozenset()


_ids = itertools.count(1)


class Request:
    """One request inside the scheduler.  ``sink(event)`` receives, from the worker thread:
    ``("text", delta, n_tokens)`` as text becomes final, then exactly one of
    ``("done", finish_reason, usage)`` (``"stop"`` or ``"length"``) and
    ``("error", status, message)``.  A cancelled request gets no further event."""

    def __init__(self, prompt: List[int], params: GenParams,
                 sink: Callable[[tuple], None]) -> None:
        if not prompt:
            raise ValueError("empty prompt")
        self.id = next(_ids)
        self.prompt = list(prompt)
        self.params = params
        self.sink = sink
        self.cancelled = False
        self.finished: Optional[str] = None   # finish reason, "cancelled" or "error"
        self.error: Optional[str] = None
        self.generated: List[int] = []
        self.steps = 0                         # forwards run for this request
        self.kv: Any = None                    # its own cache (None while a row of the batch)
        self.in_batch = False                  # a row of the scheduler's BatchKV
        self.fed = 0                           # prompt tokens in the KV cache
        self.text = ""                         # text sent so far
        self.detok: Optional[IncrementalText] = None   # the text of generated (worker's)
        self.t_submit = time.perf_counter()
        self.t_last: Optional[float] = None    # time of the last new token
        self.gen: Optional[torch.Generator] = None
        self.sampling: Optional[Sampling] = None
        self.drafting = False                  # the scheduler speculates (usage says so)
        self.ngram: Any = None                 # its own n-gram index (drafter "ngram")
        self.draft: Any = None                 # its own DraftModel and its cache ("model")
        self.mtp_next: List[int] = []          # drafts its last step's MTP masks made
        self.began_alone = False               # its controller state began (decoding alone)
        self.proposed = 0                      # draft tokens verified for it
        self.accepted = 0                      # ... of which accepted

    @property
    def usage(self) -> Dict[str, Any]:
        n, m = len(self.prompt), len(self.generated)
        out: Dict[str, Any] = {"prompt_tokens": n, "completion_tokens": m,
                               "total_tokens": n + m}
        if self.drafting:  # OpenAI's names for draft tokens a verification kept or dropped
            out["completion_tokens_details"] = {
                "accepted_prediction_tokens": self.accepted,
                "rejected_prediction_tokens": self.proposed - self.accepted}
        return out


class Scheduler:
    """The worker thread and its queue (module docstring).

    ``model``: a transformers causal LM (offloaded by specmoe or not); ``tokenizer`` decodes
    the new tokens into text (stop strings are matched on that text).  ``metrics``: an object
    with the :class:`specmoe.serve.metrics.Metrics` methods, or None.  ``batch_decode``:
    decode the running requests in one batched forward (False: one forward per request, the
    way to compare; models that cannot be batched fall back to it, :attr:`batch_off_reason`
    says why).  ``batch_prefill``: prefill prompts of different lengths that arrive together
    in batched forwards too (one expert load serves them all), at the cost of bit-exactness
    (module docstring); off, only prompts of one length share a prefill forward.  A model with
    recurrent layers (:attr:`stateful`) prefills every prompt alone unless ``batch_prefill``,
    and then only prompts of one length together (a state cannot hold a pad), not
    bit-exactly."""

    def __init__(self, model: nn.Module, tokenizer: Any, *, max_batch: int = 16,
                 max_queue: int = 256, prefill_chunk: int = 256, metrics: Any = None,
                 batch_decode: bool = True, prefill_ratio: Optional[float] = None,
                 drafter: Any = None, controller: Any = None,
                 tau: Optional[str] = "auto", mtp_adapter: Any = None,
                 warm_tau: bool = True, batch_prefill: bool = False,
                 ttft_budget: Optional[float] = None) -> None:
        for name, v in (("max_batch", max_batch), ("max_queue", max_queue),
                        ("prefill_chunk", prefill_chunk)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if prefill_ratio is not None and (isinstance(prefill_ratio, bool) or not isinstance(
                prefill_ratio, (int, float)) or not prefill_ratio >= 0):
            raise ValueError(f"prefill_ratio must be a number >= 0 (0 or None: no pacing), "
                             f"got {prefill_ratio!r}")
        # 0 / None: every waiting prompt prefilled each round, whatever the decoders wait
        self.prefill_ratio = float(prefill_ratio) if prefill_ratio else None
        self.model = model
        self.tokenizer = tokenizer
        self.max_batch = max_batch
        self.max_queue = max_queue
        self.prefill_chunk = prefill_chunk
        self.metrics = metrics
        self.engine = find_engine(model)
        self.device = input_device(model)
        # speculative decoding (None: plain decoding; specmoe.serve.speculate)
        self.spec: Optional[Speculation] = None
        if drafter is not None and drafter != "none":
            head = model.get_output_embeddings()
            vocab = int(getattr(head, "out_features", None) or head.weight.shape[0])
            self.spec = Speculation(model, self.engine, drafter, controller, tau, vocab,
                                    mtp_adapter, ttft_budget)
            if self.spec.ttft is not None:
                p = self.spec.ttft
                _log.info("specmoe serve: a TTFT budget of %.3f s allows %d draft tokens "
                          "(prefill %.4f s, verifying %d tokens %.4f s)", p.budget_s, p.k_max,
                          p.t_prefill, p.k_max + 1, p.t_verify[p.k_max + 1])
        elif controller is not None or mtp_adapter is not None or ttft_budget is not None:
            raise ValueError("a controller, an MTP adapter or a TTFT budget needs a drafter "
                             "(drafter=None decodes plainly)")
        for name, flag in (("warm_tau", warm_tau), ("batch_prefill", batch_prefill)):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
        self.batch_prefill = batch_prefill
        # the worker measures tau at every batch-size bucket before its first round
        self.warm_tau = warm_tau
        self.tau_warm_s: Optional[float] = None
        self._cond = threading.Condition()
        self._waiting: collections.deque[Request] = collections.deque()   # [_cond]
        self.running: List[Request] = []       # the worker's own
        self._draining = False                 # [_cond]
        self._stop = False                     # [_cond]
        self._thread: Optional[threading.Thread] = None
        self.engine_stats: Dict[str, Any] = {}
        self._stats_t = 0.0
        self.rounds = 0
        self.peak_running = 0                  # the most requests stepped in one round
        # the decode batch (the worker's own): one BatchKV, the request in each of its rows
        self.batch_off_reason: Optional[str] = (None if batch_decode else "batch_decode=False")
        if self.batch_off_reason is None:
            self.batch_off_reason = _unbatchable(
                model, speculating=self.spec is not None,
                mtp=self.spec is not None and self.spec.mtp is not None)
            # (batchable with recurrent layers: _unbatchable found them in the cache's states)
            if self.batch_off_reason is None and self.spec is not None \
                    and recurrent_layer_types(model.config):
                try:  # max_batch rows record their states at once: did the plan hold them?
                    require_recording_planned(model, self.engine, self.spec.window - 1,
                                              "a batch's verification", rows=max_batch)
                except ValueError as exc:
                    self.batch_off_reason = str(exc)
            if self.batch_off_reason is not None:
                _log.info("specmoe serve: decode steps are not batched: %s",
                          self.batch_off_reason)
        # recurrent layers: decode steps batch (a state per row), prefills only with
        # batch_prefill -- the torch paths of a linear-attention or Mamba prefill round a row
        # by the batch's shape -- and then of one length (no pads: a state cannot skip one)
        self.stateful = bool(recurrent_layer_types(model.config))
        if self.stateful and batch_prefill:
            _log.info("specmoe serve: batch_prefill on a model with recurrent layers: prompts "
                      "of one length are prefilled together (not bit-exact), others alone")
        self._bkv: Optional[BatchKV] = None
        self._rows: List[Request] = []
        self._pause = 0                        # rounds left without batching (after a fault)
        self.batched_steps = 0                 # batched decode forwards run
        self.batched_verifications = 0         # of which verified drafts of some row
        self.peak_batch = 0                    # the most rows in one of them
        self.batched_prefills = 0              # prefill forwards of several whole prompts
        # pacing (the worker's own): moving averages of a decode round's seconds and of the
        # prefill's seconds per prompt token; prompts whose chunk waited a round for pacing
        self._decode_s: Optional[float] = None
        self._prompt_tok_s: Optional[float] = None
        self.prefills_paced = 0
        self.fatal: Optional[BaseException] = None   # what killed the worker, if anything

    # -- the server's side (any thread) ----------------------------------------------------

    def start(self) -> None:
        with self._cond:
            if self._thread is not None:
                return
            self._thread = threading.Thread(target=self._run, name="specmoe-serve-worker",
                                            daemon=True)
            self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def warming(self) -> bool:
        """Whether the worker has yet to finish measuring tau at the batch sizes it will see
        (``warm_tau``; requests queue meanwhile)."""
        return (self.spec is not None and self.warm_tau and self.tau_warm_s is None
                and self.fatal is None)

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def submit(self, req: Request, *more: Request) -> None:
        """Queue ``req`` (the worker admits it at its next round).  QueueFull, Draining.

        Several requests are queued together, all or none: the worker sees them in the same
        round (a benchmark's burst of clients arriving at once)."""
        self.start()
        reqs = (req,) + more
        with self._cond:
            if self._draining or self._stop:
                raise Draining("the server is shutting down")
            if self.fatal is not None:
                raise Draining(f"the worker stopped: {self.fatal}")
            if len(self._waiting) + len(reqs) > self.max_queue:
                raise QueueFull(f"{len(self._waiting)} requests are already waiting "
                                f"(--max-queue {self.max_queue})")
            self._waiting.extend(reqs)
            self._gauges()
            self._cond.notify_all()

    def cancel(self, req: Request) -> None:
        """Drop ``req``: out of the queue now if it still waits, else out of the running set
        at the worker's next look at it (its KV cache freed then).  No event follows."""
        with self._cond:
            req.cancelled = True
            try:
                self._waiting.remove(req)
                req.finished = req.finished or "cancelled"
            except ValueError:
                pass
            self._gauges()
            self._cond.notify_all()

    def drain(self) -> None:
        """Stop admitting requests (submit raises Draining); those queued or running go on."""
        with self._cond:
            self._draining = True
            self._cond.notify_all()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the worker: requests still queued or running get an error event (503), the
        thread is joined (up to ``timeout`` seconds for the step in flight)."""
        with self._cond:
            self._draining = True
            self._stop = True
            self._cond.notify_all()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout)
        if self.spec is not None and not self.alive:
            self.spec.close()  # an MTP adapter it installed comes off the model

    # -- the worker ------------------------------------------------------------------------

    def _gauges(self) -> None:
        if self.metrics is not None:
            self.metrics.set_queue(len(self._waiting), len(self.running))

    def _run(self) -> None:
        # a generation session (specmoe.models.dense.DecodeThreads): torch stays on one thread
        # between decode steps, as inside model.generate
        ctx = generation_session(self.model)
        try:
            with ctx, torch.no_grad():
                if self.spec is not None and self.warm_tau:
                    self._warm_tau()
                self._refresh_stats(force=True)
                while self._round():
                    pass
        except BaseException as exc:  # pragma: no cover - a bug in the loop itself
            self.fatal = exc
            _log.exception("specmoe serve: the worker stopped")
        finally:
            with self._cond:
                left = list(self._waiting) + self.running
                self._waiting.clear()
                self.running = []
                self._gauges()
            for r in left:
                if not r.cancelled and r.finished is None:
                    self._fail(r, 503, "the server is shutting down" if self.fatal is None
                               else f"the worker stopped: {self.fatal}")

    def _warm_tau(self) -> None:
        """tau(g, B) of every batch-size bucket up to max_batch, measured before the first
        request is served (a synthetic history of token ids; the measurement is of the
        forward's time, not of what it reads)."""
        assert self.spec is not None
        t0 = time.perf_counter()
        buckets = self.spec.warm(self.max_batch, synthetic_history(self.spec.vocab))
        self.tau_warm_s = time.perf_counter() - t0
        _log.info("specmoe serve: tau measured at batch sizes %s in %.1f s",
                  ", ".join(map(str, buckets)), self.tau_warm_s)

    def _round(self) -> bool:
        """Admit, then one step of every running request; False when the worker must stop."""
        with self._cond:
            while not self._stop and not self._waiting and not self.running:
                self._cond.wait(timeout=_STATS_EVERY)
                if not self._waiting and not self.running:
                    self._refresh_stats()
            if self._stop:
                return False
            while self._waiting and len(self.running) < self.max_batch:
                self.running.append(self._waiting.popleft())
            self.peak_running = max(self.peak_running, len(self.running))
            self._gauges()
        decoding = [r for r in self.running if r.fed >= len(r.prompt)]
        for req in self.running:
            if req.cancelled:
                req.finished = req.finished or "cancelled"
        live = [r for r in decoding if not r.cancelled]
        t0 = time.perf_counter()
        self._decode(live)
        if live:
            self._decode_s = _ema(self._decode_s, time.perf_counter() - t0)
        self._prefill(self._paced([r for r in self.running if not r.cancelled
                                   and r.finished is None and r.fed < len(r.prompt)],
                                  decoding=bool(live)))
        done = [r for r in self.running if r.finished is not None or r.cancelled]
        if done:
            for r in done:
                r.kv = None  # the KV cache's memory goes now, not when the handler lets go
                r.draft = None  # and the draft model's cache
                if r.finished is None:
                    r.finished = "cancelled"
            self._leave_batch(done)
            with self._cond:
                self.running = [r for r in self.running if r not in done]
                self._gauges()
        self.rounds += 1
        self._refresh_stats()
        return True

    def _guarded(self, step: Callable[[Request], None], req: Request) -> None:
        """``step(req)``; an exception fails that request (500), the others go on."""
        try:
            step(req)
        except Exception as exc:  # that request fails; its cache goes; the others go on
            _log.warning("specmoe serve: request %d failed: %s: %s", req.id,
                         type(exc).__name__, exc)
            self._fail(req, 500, f"{type(exc).__name__}: {exc}")

    def _decode(self, reqs: List[Request]) -> None:
        """One decode step of every request in ``reqs`` (each has its pending token): in one
        batched forward when there are two or more and batching is on, else one by one."""
        self._leave_batch([r for r in self._rows if r not in reqs])  # cancelled meanwhile
        if self._pause:
            self._pause -= 1
        batch = (len(reqs) >= 2 and self.batch_off_reason is None and not self._pause)
        if not batch:
            self._decode_alone(reqs)
            return
        try:
            if self._bkv is None:  # (a hybrid's recurrent rows record a verification's states)
                self._bkv = BatchKV(self.model, 0,
                                    window=self.spec.window if self.spec is not None else 0)
            for req in reqs:
                if not req.in_batch:
                    self._bkv.join(req.kv)
                    req.kv, req.in_batch = None, True
                    self._rows.append(req)
        except Exception as exc:  # a cache BatchKV cannot hold: never batch again
            self.batch_off_reason = f"{type(exc).__name__}: {exc}"
            _log.warning("specmoe serve: decode steps are no longer batched: %s",
                         self.batch_off_reason)
            self._decode_alone(reqs)
            return
        rows = self._rows
        assert len(rows) == len(reqs), (len(rows), len(reqs))
        spec = self.spec
        drafts: List[List[int]] = [[] for _ in rows]
        t0, loads0, t_draft, masks = time.perf_counter(), (0, 0.0), 0.0, None
        try:
            if spec is not None:
                loads0 = spec.loads()
                ctl = spec.controller(len(rows), lambda: max(
                    (r.prompt + r.generated for r in rows), key=len))
                ks = spec.ks(ctl.next_k(), rows)
                drafts = spec.draft_batch(self._bkv, rows, ks)
                t_draft = time.perf_counter() - t0
                anchors = [[r.generated[-1]] + d for r, d in zip(rows, drafts)]
                # a step without drafts is never cut back: recurrent rows record nothing
                with unrecorded(self._bkv.kv) if not any(drafts) else contextlib.nullcontext():
                    logits, masks = spec.forward_batch(self._bkv, anchors, max(ks))
            else:
                logits = self._bkv.forward([[r.generated[-1]] for r in rows])
        except Exception as exc:  # not pinned on anyone
            if self._bkv.stateful:
                self._fail_batch(rows, exc)
                return
            # every request retries alone
            _log.warning("specmoe serve: a batched decode step of %d requests failed (%s: "
                         "%s); each retries alone", len(rows), type(exc).__name__, exc)
            for i, r in enumerate(rows):  # whatever a draft forward appended goes
                self._bkv.keep(i, len(r.prompt) + len(r.generated) - 1)
            self._pause = _BATCH_PAUSE
            self._decode_alone(reqs)
            return
        self.batched_steps += 1
        self.batched_verifications += any(drafts)
        self.peak_batch = max(self.peak_batch, len(rows))
        if self.metrics is not None:
            self.metrics.decode_batch(len(rows))
        acc = [0] * len(rows)
        # the greedy rows without drafts take their token from one argmax over the batch
        # (one call instead of one per row: the same first maximum of each row)
        greedy = (greedy_tokens(logits[:, 0])
                  if any(not d and r.sampling is None for r, d in zip(rows, drafts)) else None)
        for i, req in enumerate(list(rows)):
            req.steps += 1

            def verify(r: Request, i: int = i) -> None:
                if greedy is not None and not drafts[i] and r.sampling is None:
                    self._emit(r, greedy[i])
                else:
                    acc[i] = self._verify(r, logits[i, :len(drafts[i]) + 1], drafts[i], i)
                if spec is not None and spec.mtp is not None:
                    spec.advance(r, None if masks is None else masks[i], acc[i])
            self._guarded(verify, req)
        if spec is not None:
            if any(drafts):  # the rejected drafts' columns may be holes in every row now
                self._bkv.trim()
            spec.observe(ctl, [len(d) for d in drafts], acc, t0, t_draft, loads0, max(ks))

    def _fail_batch(self, rows: List[Request], exc: Exception) -> None:
        """A batched decode step of a model with recurrent layers failed: the rows' states may
        hold part of it, and a state keeps no positions to take a token back out of, so no
        row can retry; each fails (500) and the batch goes.  The next ``_BATCH_PAUSE``
        rounds do not batch; requests admitted later start on caches of their own."""
        _log.warning("specmoe serve: a batched decode step of %d requests failed (%s: %s); "
                     "their recurrent states cannot be rolled back, so each fails",
                     len(rows), type(exc).__name__, exc)
        self._bkv, self._rows = None, []
        self._pause = _BATCH_PAUSE
        for r in rows:
            r.in_batch = False
            self._fail(r, 500, f"{type(exc).__name__}: {exc} (in a batched decode step; "
                       "the recurrent states of its rows cannot be rolled back)")

    def _decode_alone(self, reqs: List[Request]) -> None:
        """A decode step of each request on its own cache (the batch, if any, dissolved)."""
        if self._rows:
            self._dissolve()
        for req in reqs:
            self._guarded(self._step, req)

    def _paced(self, reqs: List[Request], decoding: bool) -> List[Request]:
        """The requests of ``reqs`` (waiting for their prompt, in arrival order) whose next
        chunk this round prefills: all of them when nothing decodes or nothing is measured
        yet, else the first ones whose chunks' estimated time stays within
        ``prefill_ratio`` decode rounds (at least one; module docstring, pacing)."""
        if (not decoding or self.prefill_ratio is None or self._decode_s is None
                or self._prompt_tok_s is None):
            return reqs
        allow = self.prefill_ratio * self._decode_s / max(self._prompt_tok_s, 1e-9)
        pick = _pace(reqs, allow, self.prefill_chunk)
        self.prefills_paced += len(reqs) - len(pick)
        return pick

    def _prefill(self, reqs: List[Request]) -> None:
        """One prefill step of every request in ``reqs``: requests whose whole prompt fits in
        one chunk and that have not started go through batched forwards of a few of them, of
        one length (:func:`_equal_groups`), or of any (:func:`_prefill_groups`, with
        ``batch_prefill``); the others feed their next chunk alone.  Its seconds per prompt
        token feed the pacing's average."""
        if not reqs:
            return
        fed0 = sum(r.fed for r in reqs)
        t0 = time.perf_counter()
        self._prefill_all(reqs)
        n = sum(r.fed for r in reqs) - fed0
        if n > 0:
            self._prompt_tok_s = _ema(self._prompt_tok_s, (time.perf_counter() - t0) / n)

    def _prefill_all(self, reqs: List[Request]) -> None:
        alone = list(reqs)
        if self.batch_off_reason is None and not self._pause \
                and (self.batch_prefill or not self.stateful):
            fresh = [r for r in reqs if r.fed == 0 and len(r.prompt) <= self.prefill_chunk]
            groups = _equal_groups(fresh) if self.stateful or not self.batch_prefill \
                else _prefill_groups(fresh)
            for group in groups:
                try:
                    self._prefill_batched(group)
                except Exception as exc:  # not pinned on anyone: each prefills alone
                    _log.warning("specmoe serve: a batched prefill of %d requests failed "
                                 "(%s: %s); each retries alone", len(group),
                                 type(exc).__name__, exc)
                    self._pause = _BATCH_PAUSE
                    break
                alone = [r for r in alone if r not in group]
        for req in alone:
            if req.finished is None:
                self._guarded(self._step, req)

    def _prefill_batched(self, group: List[Request]) -> None:
        """The whole prompts of ``group`` in one forward of a BatchKV (left-padded: the pads
        are holes), each request's cache then copied out of it (:meth:`BatchKV.row`) and its
        first token picked; the requests join the decode batch at their next step."""
        for req in group:
            self._start(req)
        n = max(len(r.prompt) for r in group)
        ids = torch.zeros((len(group), n), dtype=torch.long)
        mask = torch.zeros((len(group), n), dtype=torch.long)
        for b, req in enumerate(group):
            ids[b, n - len(req.prompt):] = torch.tensor(req.prompt, dtype=torch.long)
            mask[b, n - len(req.prompt):] = 1
        bkv = BatchKV(self.model, len(group))
        logits = bkv.prefill(ids, mask, last_logits=True)
        assert logits is not None
        caches = [bkv.row(b) for b in range(len(group))]  # all of them before any is changed
        for req, kv in zip(group, caches):
            req.kv = kv
            req.fed = len(req.prompt)
            req.steps += 1
            if self.metrics is not None:
                self.metrics.prompt_tokens(len(req.prompt))
        self.batched_prefills += 1
        for b, req in enumerate(group):
            self._guarded(lambda r: self._pick(r, logits[b]), req)

    def _leave_batch(self, gone: List[Request]) -> None:
        """The rows of ``gone`` leave the decode batch (the others keep theirs, in order)."""
        if not any(r.in_batch for r in gone):
            return
        keep = [i for i, r in enumerate(self._rows) if r not in gone]
        for r in gone:
            r.in_batch = False
        if not keep:
            self._bkv, self._rows = None, []
            return
        assert self._bkv is not None
        self._bkv.select(keep)
        self._rows = [self._rows[i] for i in keep]

    def _dissolve(self) -> None:
        """Every row of the decode batch back to a cache of its own (:meth:`BatchKV.row`)."""
        bkv, rows = self._bkv, self._rows
        self._bkv, self._rows = None, []
        for i, req in enumerate(rows):
            req.in_batch = False
            if bkv is not None and req.finished is None and not req.cancelled:
                req.kv = bkv.row(i)

    def _refresh_stats(self, force: bool = False) -> None:
        now = time.perf_counter()
        if self.engine is None or (not force and now - self._stats_t < _STATS_EVERY):
            return
        self._stats_t = now
        try:
            self.engine_stats = dict(self.engine.stats())
        except Exception:  # a closed engine: keep the last figures
            pass

    def _forward(self, req: Request, ids: List[int], rows: int = 0) -> torch.Tensor:
        """Logits [V] after feeding ``ids`` to the request's cache (the last position's);
        ``rows`` > 0: the last ``rows`` positions' [rows, V]."""
        kv = req.kv
        S = int(kv.get_seq_length())
        x = torch.tensor([ids], dtype=torch.long, device=self.device)
        mask = torch.ones((1, S + len(ids)), dtype=torch.long, device=self.device)
        out = self.model(input_ids=x, attention_mask=mask, use_cache=True,
                         logits_to_keep=max(rows, 1), **cache_kwargs(self.model, kv))
        req.steps += 1
        return out.logits[0, -rows:].cpu() if rows else out.logits[0, -1].cpu()

    def _start(self, req: Request) -> None:
        """A request's sampling state (its own generator, seeded), at its first step."""
        if req.gen is not None:
            return
        p = req.params
        req.drafting = self.spec is not None
        req.gen = torch.Generator()
        if p.seed is None:
            req.gen.seed()
        else:
            req.gen.manual_seed(int(p.seed))
        if p.temperature > 0:
            top_k = p.top_k if p.top_k else None
            top_p = p.top_p if p.top_p is not None and p.top_p < 1 else None
            req.sampling = Sampling(float(p.temperature), top_k, top_p)

    def _step(self, req: Request) -> None:
        """One step of ``req`` alone on its own cache: its next prompt chunk, or a decode."""
        self._start(req)
        if req.kv is None:
            req.kv = new_kv(self.model, rollback=self.spec is not None,
                            window=self.spec.window if self.spec is not None else 0)
        if req.fed < len(req.prompt):
            chunk = req.prompt[req.fed:req.fed + self.prefill_chunk]
            with unrecorded(req.kv):  # (never cut back: a hybrid's states not recorded)
                logits = self._forward(req, chunk)
            req.fed += len(chunk)
            if self.metrics is not None:
                self.metrics.prompt_tokens(len(chunk))
            if req.fed < len(req.prompt):
                return
        elif self.spec is not None:
            self._speculate_alone(req)
            return
        else:
            tok = self._greedy_next(req)
            if tok is not None:
                self._emit(req, tok)
                return
            logits = self._forward(req, [req.generated[-1]])
        self._pick(req, logits)

    def _greedy_next(self, req: Request) -> Optional[int]:
        """A plain greedy decode step of ``req`` on its own cache in one C call, its logits
        left in C (:meth:`specmoe.models.decode_step.DecodeStep.greedy_next`, the step
        :func:`specmoe.generate` takes): the next token, not yet emitted.  None, with nothing
        run, for a sampled request or where no decode plan serves the step (the model's
        forward then)."""
        fast = decode_step_of(self.model)
        if req.sampling is not None or fast is None:
            return None
        tok = fast.greedy_next(req.generated[-1], req.kv)
        if tok is None:
            return None
        req.steps += 1
        return int(tok)

    def _speculate_alone(self, req: Request) -> None:
        """A decode step of ``req`` on its own cache with drafts: draft, verify them in one
        forward, keep the accepted ones (the rest cropped off its cache)."""
        spec = self.spec
        assert spec is not None
        t0, loads0 = time.perf_counter(), spec.loads()
        ctl = spec.controller(1, lambda: req.prompt + req.generated,
                              begin=not req.began_alone)
        req.began_alone = True
        k = spec.ks(ctl.next_k(), [req])[0]
        drafts = spec.draft_alone(req, k)
        t_draft = time.perf_counter() - t0
        anchors = [req.generated[-1]] + drafts
        masks, tok = None, None
        if spec.mtp is not None and spec.masks(k):  # the verification also drafts
            logits, masks = spec.forward_alone(req, anchors, k)
        else:
            # (a step without drafts is not cut back: a hybrid's recurrent layers record
            # nothing then and take their one-call steps; a greedy one takes the one C call
            # where a plan serves it, so the plain time the controller weighs drafting
            # against is that step's)
            with unrecorded(req.kv) if not drafts else contextlib.nullcontext():
                tok = None if drafts else self._greedy_next(req)
                if tok is None:
                    logits = self._forward(req, anchors, rows=len(drafts) + 1)
        if tok is not None:  # as _verify without drafts
            crop_kv(req.kv, int(req.kv.get_seq_length()))
            self._emit(req, tok)
            n = 0
        else:
            n = self._verify(req, logits, drafts, None)
        if spec.mtp is not None:
            spec.advance(req, masks, n)
        spec.observe(ctl, [len(drafts)], [n], t0, t_draft, loads0, k)

    def _verify(self, req: Request, logits: torch.Tensor, drafts: List[int],
                row: Optional[int]) -> int:
        """``req``'s next tokens from its verification ``logits`` [len(drafts) + 1, V] (the
        pending token's and each draft's position): without drafts :meth:`_pick`; else the
        acceptance rule, the cache (``row`` of the batch, or the request's own when None)
        cut back to the pending token and the accepted drafts, and every new token emitted
        until the request finishes.  Returns the drafts accepted."""
        if not drafts:
            if row is None:  # a cache recording its past (sliding windows) trimmed back
                crop_kv(req.kv, int(req.kv.get_seq_length()))
            self._pick(req, logits[0])
            return 0
        # the drafts are proposed greedily: q one-hot (None)
        n, nxt = (int(x) for x in accept_logits(logits, drafts, req.sampling, req.gen))
        keep = len(req.prompt) + len(req.generated) + n
        if row is None:
            crop_kv(req.kv, keep)
        else:
            assert self._bkv is not None
            self._bkv.keep(row, keep)
        req.proposed += len(drafts)
        req.accepted += n
        if self.metrics is not None:
            self.metrics.drafts(len(drafts), n)
        for t in drafts[:n] + [nxt]:
            self._emit(req, t)
            if req.finished is not None:
                break
        return n

    def _pick(self, req: Request, logits: torch.Tensor) -> None:
        """The next token from the last position's ``logits`` [V]: argmax, or drawn from the
        request's sampling law with its own generator; then emitted."""
        if req.sampling is None:
            tok = greedy_tokens(logits)[0]
        else:
            probs = req.sampling.probs(logits.unsqueeze(0))
            tok = int(torch.multinomial(probs, 1, generator=req.gen)[0, 0])
        self._emit(req, tok)

    def _emit(self, req: Request, tok: int) -> None:
        now = time.perf_counter()
        if self.metrics is not None:
            if req.t_last is None:
                self.metrics.first_token(now - req.t_submit)
            else:
                self.metrics.next_token(now - req.t_last)
            self.metrics.generation_tokens(1)
        req.t_last = now
        req.generated.append(tok)
        p = req.params
        if req.detok is None:
            req.detok = IncrementalText(self.tokenizer)
        if tok in p.eos:  # the text ends before it
            self._finish(req, "stop", req.detok.text, None)
            return
        text = req.detok.add(tok)
        cut = _find_stop(text, p.stop, len(req.text))
        if cut is not None:
            self._finish(req, "stop", text, cut)
        elif len(req.generated) >= p.max_tokens:
            self._finish(req, "length", text, None)
        else:
            # hold back what a stop string may still claim, and an unfinished UTF-8 sequence
            safe = len(text) - max((len(s) for s in p.stop), default=1) + 1
            while safe > len(req.text) and text[safe - 1] == "\ufffd":
                safe -= 1
            if safe > len(req.text) and text.startswith(req.text):
                req.sink(("text", text[len(req.text):safe], 1))
                req.text = text[:safe]
            else:
                req.sink(("text", "", 1))

    def _finish(self, req: Request, reason: str, text: str, cut: Optional[int]) -> None:
        if cut is not None:
            text = text[:cut]
        if len(text) > len(req.text) and text.startswith(req.text):
            req.sink(("text", text[len(req.text):], 0))
            req.text = text
        req.finished = reason
        req.sink(("done", reason, req.usage))

    def _fail(self, req: Request, status: int, message: str) -> None:
        req.finished = "error"
        req.error = message
        req.kv = None
        req.draft = None
        req.sink(("error", status, message))


def serve_all(sch: Scheduler, prompts: List[List[int]], params: GenParams, *,
              timeout: Optional[float] = None, stagger: float = 0.0,
              on_event: Optional[Callable[[int, tuple], None]] = None) -> List[Request]:
    """Serve one request per prompt (token ids) through ``sch`` and block until each has
    finished: the requests, in the order of ``prompts`` (``finished``, ``generated``,
    ``error``, ``usage`` on each).

    The requests are submitted in one call, so the worker admits them in one round (clients
    arriving together), or ``stagger`` seconds apart (later ones join a running batch).
    ``on_event(i, event)`` sees request i's events as they come, on the worker's thread
    (``Request``'s events).  A request that ends in error is returned like the others.
    TimeoutError if they have not all finished ``timeout`` seconds after the last submission:
    the unfinished ones are cancelled first.  QueueFull or Draining as ``Scheduler.submit``
    (those submitted before are cancelled)."""
    if not prompts:
        return []
    done = threading.Event()
    reqs: List[Request] = []
    n = len(prompts)

    def sink(i: int, ev: tuple) -> None:
        if on_event is not None:
            on_event(i, ev)
        if ev[0] in ("done", "error") and len(reqs) == n and all(r.finished for r in reqs):
            done.set()
    made = [Request(p, params, lambda ev, i=i: sink(i, ev)) for i, p in enumerate(prompts)]
    try:
        if stagger > 0:
            for k, r in enumerate(made):
                if k:
                    time.sleep(stagger)
                sch.submit(r)
                reqs.append(r)
        else:
            sch.submit(*made)
            reqs.extend(made)
    except (QueueFull, Draining):
        for r in reqs:
            sch.cancel(r)
        raise
    if len(reqs) == n and all(r.finished for r in reqs):
        done.set()  # (every one finished before the list was complete)
    if not done.wait(timeout):
        late = [r for r in reqs if not r.finished]
        for r in late:
            sch.cancel(r)
        raise TimeoutError(f"{len(late)} of {n} requests had not finished after {timeout} s")
    return reqs


def _ema(avg: Optional[float], x: float, a: float = 0.3) -> float:
    """The moving average ``avg`` after sample ``x`` (the sample itself when there is none)."""
    return x if avg is None else (1 - a) * avg + a * x


def _pace(reqs: List[Request], allow: float, chunk: int) -> List[Request]:
    """The first requests of ``reqs`` whose next chunks (``chunk`` prompt tokens at most each)
    add up to at most ``allow`` tokens; at least the first one."""
    pick: List[Request] = []
    used = 0
    for r in reqs:
        n = min(len(r.prompt) - r.fed, chunk)
        if pick and used + n > allow:
            break
        pick.append(r)
        used += n
    return pick


def _prefill_groups(reqs: List[Request], waste: float = 0.25,
                    most: int = 16) -> List[List[Request]]:
    """``reqs`` (whole prompts) in groups of 2 to ``most`` to prefill together, by length,
    longest first: a group's left padding (holes, but routed through the MoE layers like any
    token) stays within ``waste`` of its real tokens.  Requests left alone are not listed."""
    groups: List[List[Request]] = []
    cur: List[Request] = []
    for r in sorted(reqs, key=lambda q: -len(q.prompt)):
        if cur:
            n, real = len(cur[0].prompt), sum(len(q.prompt) for q in cur) + len(r.prompt)
            if len(cur) < most and n * (len(cur) + 1) - real <= waste * real:
                cur.append(r)
                continue
            if len(cur) >= 2:
                groups.append(cur)
        cur = [r]
    if len(cur) >= 2:
        groups.append(cur)
    return groups


def _equal_groups(reqs: List[Request], most: int = 16) -> List[List[Request]]:
    """``reqs`` (whole prompts) in groups of 2 to ``most`` prompts of one length, in arrival
    order within a length: what a batched prefill runs without pads, each prompt on the paths
    of its prefill alone (BatchKV.prefill).  Requests left alone are not listed."""
    by_len: Dict[int, List[Request]] = {}
    for r in reqs:
        by_len.setdefault(len(r.prompt), []).append(r)
    groups: List[List[Request]] = []
    for same in by_len.values():
        for i in range(0, len(same), most):
            if len(same[i:i + most]) >= 2:
                groups.append(same[i:i + most])
    return groups


def _unbatchable(model: nn.Module, speculating: bool = False,
                 mtp: bool = False) -> Optional[str]:
    """Why ``model``'s decode steps cannot run as rows of one BatchKV (None: they can): its
    cache must be made of transformers' plain full-attention layers, where a hole is a
    masked position like any other, and of its recurrent layers (transformers 5.25's
    ``LinearAttentionLayer``: a state per row, :class:`BatchKV`'s "stateful" form), which
    verify drafts (``speculating``) only where they record their states per token
    (:func:`records_recurrent_states`; not the MTP drafter's masks, which no record takes
    back out) -- else rows that keep different numbers of drafts would leave holes in their
    states (the layer kinds: :func:`row_layer_kind`)."""
    recurrent = recurrent_layer_types(model.config)
    try:
        kv = new_kv(model)
    except Exception as exc:  # noqa: BLE001 (the reason is reported)
        return f"its cache cannot be built ({type(exc).__name__}: {exc})"
    layers = list(getattr(kv, "layers", None) or [])
    if not layers:
        if recurrent:  # MiniMax: a cache class of its own
            return (f"its {', '.join(recurrent)} layers keep a state per sequence in a cache "
                    f"of its own ({type(kv).__name__})")
        return "its cache has no per-layer storage"
    states = [lay for lay in layers if is_state_layer(lay)]
    odd = sorted({type(lay).__name__ for lay in layers if row_layer_kind(lay) is None})
    if odd:
        return (f"its cache has {', '.join(odd)} layers, which cannot hold a masked hole "
                "(a sliding window would count it against the window)")
    if recurrent and not states:
        return (f"its {', '.join(recurrent)} layers keep a state per sequence, which this "
                "transformers version's cache cannot hold per row (5.25 on can)")
    if states and speculating and (mtp or not records_recurrent_states(model)):
        return (f"its {', '.join(recurrent)} layers keep a state per sequence, into which "
                "a batch's drafts of different lengths would leave holes"
                + (" (the MTP masks')" if mtp else " (this model's layers record no states "
                   "per token)") + ": each request verifies its drafts on its own cache")
    return None


def _find_stop(text: str, stops: List[str], sent: int) -> Optional[int]:
    """Where the earliest stop string starts in ``text`` (None: nowhere); only matches that
    end after the ``sent`` characters already sent can be new."""
    best: Optional[int] = None
    for s in stops:
        i = text.find(s, max(0, sent - len(s) + 1))
        if i >= 0 and (best is None or i < best):
            best = i
    return best

"""Speculative decoding inside the server's scheduler: which drafter, how many drafts (K), and
what each step taught the controller.

One :class:`Speculation` per :class:`specmoe.serve.scheduler.Scheduler` (the worker's own; no
lock).  The scheduler asks it, at every decode step, for the drafts of each request, runs
the one verification forward itself (the batch's :class:`BatchKV` rows, or a request's own
cache when it decodes alone), applies the acceptance rule with each request's own sampling
law and generator, and reports the step back (:meth:`Speculation.observe`).

Drafters (``drafter=``): ``"ngram"`` (prompt lookup in C; every request gets its own index,
:meth:`NgramDrafter.clone`), ``"self"`` (MoE-SpeQ's self-draft: the target with its routed
experts in an int4 copy, drafting on the target's own cache, the batch's BatchKV rows at
batch > 1 through :class:`BatchDraftModel` with ``shared``; its routing of the drafts is
prefetched before the verification, ``Engine.lookahead``) or ``"mtp"`` (multi-token
prediction with gated LoRA, :mod:`specmoe.speculation.mtp`, the adapter given as
``mtp_adapter``: the verification forward carries k masks after every anchor, so it verifies
this step's drafts and proposes the next ones at once; each request keeps the drafts its
last step's masks made, :attr:`Request.mtp_next`, and the batch's forward is
:meth:`BatchKV.forward_mtp`, each row its own anchors).  Drafts are proposed greedily (an
n-gram's are deterministic anyway); a sampled request verifies them with the
speculative-sampling rule, q one-hot at the draft, so its tokens follow its sampling law
exactly.  A :class:`DraftModel` (a small LM of the target's tokenizer, ``--drafter model
--draft-model DIR``) drafts for each request on a KV cache of the request's own
(:attr:`Request.draft`, a copy of the drafter sharing its module, freed with the request)
while it decodes alone; the rows of a batch draft together, in one :class:`BatchDraftModel`
of their own (one draft forward per draft token for all rows), which follows rows that leave
(``select``) and takes a joining request's own draft cache as a new row
(:meth:`BatchDraftModel.join`; a request that never drafted alone prefills its history alone
first), so the other rows feed nothing again; the last request of a batch that decodes alone
on takes its row back (:meth:`BatchDraftModel.row`).  A draft model with recurrent layers
gets a new batch state at a join instead (its rows feed their histories in one forward with
holes).  Either cache is rolled back to the prefix it shares with the history before each
draft, so what the draft proposes never rests on which request a row was before.

K (``controller=``): one controller per decode batch-size bucket (1, 2, 4, 8, ... the power of
two at or above the batch size), so each learns the plain-step time and the utility of K at
its own batch size (the gamma-tolerance paper, section 3.1: tau and hence the K that pays
fall with the batch) without being reset every time a request comes or goes.  Every row of a
step gets the same K, less what its ``max_tokens`` leaves (the target always adds a token of
its own).  With ``tau="auto"`` an adaptive controller is pruned by tau(g, B) measured at its
bucket (:func:`specmoe.speculation.tau.target_tau`, kept on the Engine): by the scheduler
for every bucket up to ``max_batch`` before it serves (``warm``), or at a bucket's first use
with ``warm_tau=False`` (a one-off pause of the worker per bucket), and by the success condition
(section 3.1, eq. 1), as in :func:`specmoe.generate`; a static K runs as given.  A request
decoding alone starts its own Cascade/SpeQ state (``begin_request``) at its first step on
the batch-1 controller; a batch's controller keeps the batch's state, whose rows change
step by step (its ETR is the mean over the rows: ``observe(rows_k=, rows_accepted=)``).
"""
from __future__ import annotations

import copy
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple, Union

import torch

from ..speculation.batch import BatchDraftModel, BatchKV, observe_batch_step
from ..speculation.controllers import Controller, StaticK, controller_factory
from ..speculation.drafters import (DRAFTERS, DraftModel, NgramDrafter, SelfDraft, named_drafter,
                                    propose)
from ..speculation.decoding import crop_kv, require_recording_planned, require_speculable
from ..speculation.mtp import MtpDrafter, next_drafts, priming
from ..speculation.tau import TtftProfile, batch_bucket, profile_ttft, target_tau

__all__ = ["DRAFTERS", "Speculation", "controller_factory", "synthetic_history"]

def _check_draft_vocab(drafter: DraftModel, model: Any) -> None:
    """ValueError where the draft model's vocabulary is not the target's size (its token ids
    would mean other tokens, or fall outside the target's)."""
    dv = getattr(getattr(drafter.model, "config", None), "vocab_size", None)
    tv = getattr(getattr(model, "config", None), "vocab_size", None)
    if dv is not None and tv is not None and int(dv) != int(tv):
        raise ValueError(f"the draft model's vocabulary has {dv} tokens, the target's {tv}: "
                         "a draft model must share the target's tokenizer")


def synthetic_history(vocab: int, n: int = 64) -> List[int]:
    """``n`` token ids spread over the vocabulary: what tau and the TTFT bound are measured on
    before the first request (the measurement is of the forwards' time, not of what they
    read)."""
    v = max(3, int(vocab))
    return [(7 * i + 11) % (v - 2) + 1 for i in range(n)]


class Speculation:
    """The scheduler's drafter and controllers (module docstring).

    ``drafter``: ``"ngram"``, ``"self"``, ``"mtp"`` (with ``mtp_adapter``: an
    :class:`MtpAdapter` or its folder), an :class:`NgramDrafter` (its settings are cloned
    per request), a :class:`SelfDraft` of ``model``'s Engine or an :class:`MtpDrafter` on
    ``model``.  ``engine``: the model's Engine or None (``"self"`` needs one).  ``tau``:
    ``"auto"`` or None (no pruning).  ``ttft_budget``: seconds; the controllers' largest K
    is then the largest draft length whose first cycle (prefill of a 64-token prompt,
    drafting, verifying) fits it, profiled here, at load (MoE-SpeQ Sec. 3.2.3,
    :func:`specmoe.speculation.tau.profile_ttft`; :attr:`ttft` keeps the profile).  The
    n-gram and self drafters' drafting is timed (a self-draft with a prefill of its own,
    which errs on the safe side); the MTP heads' is taken as free."""

    def __init__(self, model: Any, engine: Any, drafter: Any,
                 controller: Union[str, Callable[[], Controller], None] = None,
                 tau: Optional[str] = "auto", vocab: int = 0, mtp_adapter: Any = None,
                 ttft_budget: Optional[float] = None) -> None:
        if tau not in ("auto", None):
            raise ValueError(f"tau must be 'auto' or None, got {tau!r}")
        if ttft_budget is not None and (isinstance(ttft_budget, bool) or not isinstance(
                ttft_budget, (int, float)) or not 0 < ttft_budget < float("inf")):
            raise ValueError(f"ttft_budget must be seconds > 0 or None, got {ttft_budget!r}")
        # a linear-attention / Mamba hybrid: served (never batched, each request on its own
        # cache that records its states over the last window tokens), but not with MTP
        require_speculable(model, "speculative decoding (a drafter)",
                           "serve it without one (--drafter none)",
                           windowed=not (drafter == "mtp" or isinstance(drafter, MtpDrafter)))
        self._installed: Optional[MtpDrafter] = None   # made here: uninstalled at close()
        if isinstance(drafter, str):
            drafter = named_drafter(drafter, model, engine, mtp_adapter)
            if isinstance(drafter, MtpDrafter):
                self._installed = drafter
        elif mtp_adapter is not None:
            raise ValueError("mtp_adapter goes with drafter='mtp'")
        if isinstance(drafter, MtpDrafter):
            if drafter.model is not model:
                raise ValueError("the MtpDrafter was made for another model")
        elif isinstance(drafter, SelfDraft):
            if not drafter.share_kv:
                raise ValueError("serve drafts a SelfDraft on the target's cache: give one "
                                 "with share_kv=True")
        elif isinstance(drafter, DraftModel):
            _check_draft_vocab(drafter, model)
        elif not isinstance(drafter, NgramDrafter):
            raise TypeError(f"drafter must be 'ngram', 'self', 'mtp', an NgramDrafter, a "
                            f"DraftModel, a SelfDraft or an MtpDrafter, got "
                            f"{type(drafter).__name__}")
        self.model, self.engine, self.drafter = model, engine, drafter
        self.mtp: Optional[MtpDrafter] = drafter if isinstance(drafter, MtpDrafter) else None
        self.ttft: Optional[TtftProfile] = None
        try:
            self.make_controller = controller_factory(
                controller, None if self.mtp is None else self.mtp.k)
            probe = self.make_controller()
            if not isinstance(probe, Controller):
                raise TypeError(f"the controller factory returned {type(probe).__name__}, "
                                "not a specmoe.speculation.controllers.Controller")
            if ttft_budget is not None:
                self.ttft = profile_ttft(model, synthetic_history(vocab), float(ttft_budget),
                                         None if self.mtp is not None else drafter,
                                         k_max=max(1, probe.k_max))
                if self.ttft.k_max < 1:
                    raise ValueError(
                        f"a TTFT budget of {ttft_budget} s leaves no room for a draft token "
                        f"on this machine (prefill {self.ttft.t_prefill:.4f} s, drafting one "
                        f"{self.ttft.t_draft[1]:.4f} s, verifying two "
                        f"{self.ttft.t_verify[2]:.4f} s): raise it, or serve without a "
                        "drafter")
                self.make_controller = controller_factory(controller, self.ttft.k_max)
                self.make_controller()  # a static K above the bound: refused here
        except BaseException:
            self.close()  # refused: the model as it was given
            raise
        self.tau = tau
        self.vocab = int(vocab)
        # the most positions a verification forward holds, and so the window a request's cache
        # records a hybrid's recurrent states over (specmoe.speculation.decoding.new_kv)
        self.window = max(1, self.make_controller().k_max) + 1
        try:  # one verification records at a time: what the memory plan set aside for it
            require_recording_planned(model, engine, self.window - 1,
                                      "speculative decoding (a drafter)")
        except ValueError:
            self.close()
            raise
        self.controllers: Dict[int, Controller] = {}   # batch-size bucket -> its controller
        self._rows_draft: Optional[BatchDraftModel] = None   # a DraftModel's batch drafting
        self._rows_ids: List[int] = []                 # ... id() of its rows' requests
        self.proposed = 0                              # draft tokens verified, all requests
        self.accepted = 0
        self.steps = 0                                 # verification forwards with a draft

    @property
    def name(self) -> str:
        return ("self" if isinstance(self.drafter, SelfDraft)
                else "model" if isinstance(self.drafter, DraftModel)
                else "mtp" if self.mtp is not None else "ngram")

    def controller(self, batch: int, history: Callable[[], Sequence[int]],
                   begin: bool = False) -> Controller:
        """The controller of ``batch``'s bucket (made, and its tau measured on ``history()``,
        on first use); ``begin``: a request starts decoding alone (its own Cascade/SpeQ
        state: ``begin_request``)."""
        b = batch_bucket(batch)
        ctl = self.controllers.get(b)
        if ctl is None:
            ctl = self.make_controller()
            prune = self.tau is not None and not isinstance(ctl, StaticK)
            ctl.set_success(prune)
            ctl.set_batch(b)
            if prune and self.mtp is not None:  # g anchors and their g k masks (MtpDrafter.tau)
                g = ctl.k_max + 1
                ctl.set_tau(self.mtp.tau(target_tau(self.model, list(history()),
                                                    self.mtp.tau_tokens(g), self.engine,
                                                    batch=b), g))
            elif prune:
                ctl.set_tau(target_tau(self.model, list(history()), ctl.k_max + 1,
                                       self.engine, batch=b))
            self.controllers[b] = ctl
        if begin:
            ctl.begin_request()
        return ctl

    def warm(self, max_batch: int, history: Sequence[int]) -> List[int]:
        """Make every batch-size bucket's controller up to ``max_batch`` now, measuring its tau
        on ``history`` where pruning is on, instead of at the bucket's first use (a pause of
        every running request then); returns the buckets.  tau tables are kept per model and
        batch size on the Engine, so a second server on the same model measures nothing.
        Nothing to measure (a static K, ``tau=None``): nothing made, ``[]``."""
        if self.tau is None or isinstance(self.make_controller(), StaticK):
            return []
        buckets = sorted({batch_bucket(b) for b in range(1, int(max_batch) + 1)})
        for b in buckets:
            self.controller(b, lambda: history)
        return buckets

    def ks(self, k: int, reqs: Sequence[Any]) -> List[int]:
        """Per request: K less what its ``max_tokens`` leaves after this step's own token."""
        return [max(0, min(k, r.params.max_tokens - len(r.generated) - 1)) for r in reqs]

    def _ngram(self, req: Any) -> NgramDrafter:
        if req.ngram is None:
            req.ngram = self.drafter.clone()
        return req.ngram

    def _draft_model(self, req: Any) -> DraftModel:
        """``req``'s own copy of the draft model: the module shared, the KV cache its own (its
        row of the batch's draft state where it was one, as it decodes alone on)."""
        if req.draft is None:
            req.draft = copy.copy(self.drafter)
            req.draft.reset()
            bd = self._rows_draft
            if bd is not None and bd.joinable and id(req) in self._rows_ids:
                req.draft.take_over(*bd.row(self._rows_ids.index(id(req))))
        return req.draft

    def draft_alone(self, req: Any, k: int) -> List[int]:
        """``k`` drafts (or fewer) for ``req`` decoding on its own cache ``req.kv``."""
        if k <= 0:
            return []
        if self.mtp is not None:  # what the request's last step's masks proposed
            return list(req.mtp_next[:k])
        hist = req.prompt + req.generated
        if isinstance(self.drafter, SelfDraft):
            self.drafter.bind_kv(req.kv)   # drafts on the request's cache, cropped back after
            try:
                d = propose(self.drafter, hist, k, None, None, self.vocab,
                            prefetch=self.engine is not None)
            finally:
                self.drafter.bind_kv(None)
            if d.routing and self.engine is not None:
                self.engine.lookahead(d.routing, d.token_routing, d.token_confidence)
            return d.tokens
        if isinstance(self.drafter, DraftModel):
            return propose(self._draft_model(req), hist, k, None, None, self.vocab).tokens
        return propose(self._ngram(req), hist, k, None, None, self.vocab).tokens

    def draft_batch(self, bkv: BatchKV, reqs: Sequence[Any], ks: List[int]
                    ) -> List[List[int]]:
        """Drafts of every row of ``bkv`` (``reqs`` in row order), ``ks[i]`` at most each."""
        if max(ks, default=0) <= 0:
            return [[] for _ in reqs]
        if isinstance(self.drafter, SelfDraft):
            hists = [r.prompt + r.generated for r in reqs]
            drafts, _, routing = BatchDraftModel(self.drafter, len(reqs), shared=bkv).draft(
                hists, ks, None, None)
            if routing and self.engine is not None:
                self.engine.lookahead(routing)
            return drafts
        if isinstance(self.drafter, DraftModel):
            hists = [r.prompt + r.generated for r in reqs]
            return self._batch_draft(reqs).draft(hists, ks, None, None)[0]
        return [self.draft_alone(r, k) for r, k in zip(reqs, ks)]

    def _batch_draft(self, reqs: Sequence[Any]) -> BatchDraftModel:
        """The draft model's batch state for ``reqs`` (in row order): the last step's, the
        rows that left selected out and each request that joined brought in with the draft
        cache it drafted on alone (module docstring); made anew, every row feeding its
        history, where the state cannot take rows (recurrent layers) or a joining request
        has no cache to bring (a one-token prompt)."""
        ids = [id(r) for r in reqs]
        bd = self._rows_draft
        if bd is None:
            bd, self._rows_ids = BatchDraftModel(self.drafter, 0), []
        where = {k: i for i, k in enumerate(self._rows_ids)}
        # (a row that drafted alone since it left holds a fresher cache: it joins anew)
        new = [r for r in reqs if id(r) not in where or (bd.joinable and r.draft is not None)]
        if new and not bd.joinable:
            bd = BatchDraftModel(self.drafter, len(reqs))
        elif new or ids != self._rows_ids:
            caches = [self._draft_model(r).hand_over(r.prompt + r.generated) for r in new]
            if any(c is None for c in caches):
                bd = BatchDraftModel(self.drafter, len(reqs))
            else:
                fresh = {id(r) for r in new}
                kept = [k for k in ids if k not in fresh]
                bd.select([where[k] for k in kept])
                for r, (kv, seen) in zip(new, caches):
                    bd.join(kv, seen)
                    r.draft = None  # its cache is the batch's row now
                order = kept + [id(r) for r in new]
                if order != ids:  # rows in the order of reqs
                    at = {k: i for i, k in enumerate(order)}
                    bd.select([at[k] for k in ids])
        self._rows_draft, self._rows_ids = bd, ids
        return bd

    # -- MTP: the verification forward that also drafts -----------------------------------

    def masks(self, k: int) -> int:
        """The masks per anchor of a step that may verify up to ``k`` drafts (the largest
        row's K after its ``max_tokens``): the adapter's k (the next step's drafts), none when
        k = 0 (as :func:`specmoe.generate`)."""
        assert self.mtp is not None
        return self.mtp.k if k > 0 else 0

    def forward_batch(self, bkv: BatchKV, anchors: List[List[int]], k: int
                      ) -> Tuple[Any, Any]:
        """The batch's verification forward of every row's ``anchors`` (its pending token and
        drafts; ``k`` the largest row's K this step): (logits [B, m, V], the MTP masks' logits
        [B, A, masks, V] or None)."""
        if self.mtp is None or not self.masks(k):  # a plain step: the target's forward
            return bkv.forward(anchors), None
        return bkv.forward_mtp(anchors, self.masks(k), self.mtp.adapter, self.mtp.fetch_masks)

    def forward_alone(self, req: Any, anchors: List[int], k: int) -> Tuple[Any, Any]:
        """The MTP verification forward of one request on its own cache ``req.kv``: (anchor
        logits [A, V], mask logits [A, masks, V]); the masks' KV entries are cropped."""
        assert self.mtp is not None
        past = int(req.kv.get_seq_length())
        with torch.no_grad():
            lg, ml = self.mtp.adapter.forward_mtp(self.model, torch.tensor([anchors]),
                                                  self.masks(k), past=past, kv=req.kv,
                                                  fetch_masks=self.mtp.fetch_masks)
        crop_kv(req.kv, past + len(anchors))
        req.steps += 1
        return lg[0].cpu(), ml[0].cpu()

    def advance(self, req: Any, masks: Any, n_acc: int) -> None:
        """``req``'s next drafts after a step that accepted ``n_acc`` drafts: the greedy
        tokens of the masks after anchor ``n_acc`` (``masks`` [A, m, V]; none without masks)."""
        if masks is None or masks.shape[1] == 0:
            req.mtp_next = []
        else:
            req.mtp_next = next_drafts(masks[n_acc])[0]

    def observe(self, ctl: Controller, kd: List[int], acc: List[int], t0: float,
                t_draft: float, loads0: Tuple[int, float], k: int) -> None:
        """One step's outcome to ``ctl``: drafts verified (``kd``) and accepted (``acc``) per
        row, the step's seconds since ``t0`` (``t_draft`` of them drafting), the Engine's
        loads since ``loads0``; ``k``: the largest row's K planned."""
        if priming(self.drafter, max(kd), k):  # an MTP step with no drafts yet: not observed
            return
        t_iter = max(time.perf_counter() - t0, 1e-9)
        l1, s1 = self.loads()
        n_load, t_io = l1 - loads0[0], max(0.0, min(s1 - loads0[1], t_iter))
        if len(kd) > 1:
            observe_batch_step(ctl, kd, acc, t_iter, n_load, t_draft, t_io)
        else:
            t_draft = min(t_draft, t_iter)
            ctl.observe(kd[0], acc[0], t_iter, n_load, t_draft=t_draft,
                        t_io=min(t_io, t_iter - t_draft))
        if max(kd):
            self.steps += 1
        self.proposed += sum(kd)
        self.accepted += sum(acc)

    def close(self) -> None:
        """Take the MTP adapter this object installed (``drafter="mtp"``) off the model; a
        drafter given as an object stays as it was."""
        if self._installed is not None:
            self._installed.adapter.uninstall()
            self._installed = None
        self._rows_draft, self._rows_ids = None, []

    def loads(self) -> Tuple[int, float]:
        return self.engine.loads() if self.engine is not None else (0, 0.0)

    def stats(self) -> Dict[str, Any]:
        """Drafts proposed and accepted so far, and each bucket's K now."""
        return {"drafter": self.name, "proposed": self.proposed, "accepted": self.accepted,
                "acceptance": self.accepted / self.proposed if self.proposed else None,
                "steps_with_drafts": self.steps,
                "k_now": {b: c.next_k() for b, c in sorted(self.controllers.items())}}



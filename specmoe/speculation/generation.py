"""Speculative decoding for (offloaded) MoE models: :func:`generate`.

One decoding iteration: the controller picks K; the drafter proposes up to K tokens; the target
runs ONE forward over the pending token and the K drafts (K+1 positions); the acceptance rule
(:func:`specmoe.speculation.verify.accept`, in C) keeps the longest accepted prefix and adds one token of the
target's own (greedy: exact match with the target's argmax, so the output equals plain greedy
decoding; sampling: the standard rejection rule, so the output follows the target's
distribution); the target's KV cache is cropped back to the accepted prefix; the controller
learns from what the iteration cost and yielded.  K = 0 is a plain decoding step.

The drafters (n-gram lookup, a draft model, MoE-SpeQ's self-draft) are in
:mod:`specmoe.speculation.drafters`, the controllers that choose K in :mod:`specmoe.speculation.controllers`.

With an :class:`specmoe.runtime.engine.Engine` (offloaded model) the statistics also count the experts
loaded per iteration, and with the ``spac`` policy the cache learns expert utilities from each
verification's activation counts.  Batches of sequences (left-padded, with an attention mask)
run through :mod:`specmoe.speculation.batch`.
"""
from __future__ import annotations

import contextlib
import time
from typing import Any, Dict, List, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from .controllers import Controller, StaticK
from .decoding import (GenerateOutput, crop_kv, forward_tokens, new_kv,
                       require_recording_planned, require_speculable, unrecorded)
from ..models.decode_step import decode_step_of
from ..models.dense import decode_session
from .drafters import DraftModel, NgramDrafter, SelfDraft, propose
from ..runtime.experts import find_engine
from .batch import check_left_padded, run_batch
from .mtp import MtpDrafter, priming
from .sampling import Sampling
from .tau import target_tau, tau_for_batch
from .verify import accept_logits

__all__ = ["generate"]


# ---------------------------------------------------------------------------------------------
# the loop


@decode_session
def generate(model: nn.Module, input_ids: Union[torch.Tensor, Sequence[int]],
             drafter: Any = None, controller: Optional[Controller] = None,
             max_new_tokens: int = 32, do_sample: bool = False, *,
             temperature: float = 1.0, top_k: Optional[int] = None,
             top_p: Optional[float] = None, eos_token_id: Union[int, Sequence[int], None] = -1,
             seed: Optional[int] = None, tau: Union[str, Mapping[int, Any], None] = "auto",
             engine: Any = None, lookahead: bool = True, progress: bool = False,
             attention_mask: Optional[torch.Tensor] = None, success: bool = True,
             pad_token_id: Optional[int] = None, streamer: Any = None) -> GenerateOutput:
    """Generate up to ``max_new_tokens`` tokens with speculative decoding.

    Args:
        model: a transformers causal LM, offloaded by :func:`specmoe.offload` or not.
        input_ids: the prompt, [n] or [B, n] token ids; B > 1 prompts of different lengths
            are left-padded with ``attention_mask`` marking the real tokens, as for
            transformers' batched ``generate`` (the batch path: :mod:`specmoe.speculation.batch`).
        drafter: :class:`specmoe.speculation.drafters.NgramDrafter`, :class:`DraftModel`, :class:`SelfDraft`,
            :class:`specmoe.speculation.mtp.MtpDrafter` (multi-token prediction with gated LoRA: drafts
            and verification in one forward; K <= the adapter's k),
            or any object with ``propose(history, k) -> list[int]``.  None: plain decoding.
        controller: chooses K per iteration (:mod:`specmoe.speculation.controllers`: StaticK, Heuristic, Cascade,
            SpeqGovernor).  Default with a drafter: ``Cascade()``.  It keeps learning across
            calls; its ``telemetry()`` holds every iteration.
        max_new_tokens: tokens to generate (>= 1); fewer when an EOS token is emitted.
        do_sample: sample (rejection rule, output distributed as the target's) instead of
            greedy (output equal to plain greedy decoding).
        temperature, top_k, top_p: the sampling distribution (see :class:`Sampling`).
        eos_token_id: stop after emitting one of these; -1 (default) takes the model's
            ``generation_config.eos_token_id``; None never stops early.
        seed: seeds the sampling generator (draws of the drafter and of the acceptance rule).
        tau: gamma-tolerance pruning: "auto" measures tau(g) = T(1)/T(g) of the target once
            per model (:func:`target_tau`) and gives it to an adaptive controller, which then
            never picks a K whose best case (K+1)*tau(K+1) <= 1 (a StaticK keeps its K); with
            the MTP drafter tau(g) is that of g anchors plus their masks
            (:meth:`specmoe.speculation.mtp.MtpDrafter.tau`); a mapping {g: tau} is given to any
            controller as it is; None switches pruning off.
        engine: the model's Engine (found automatically when the model is offloaded).
        lookahead: with a drafter that reports routing (SelfDraft), prefetch its predicted
            experts: each draft step's as soon as it routes (overlapping the rest of the
            draft), then the whole lookahead buffer, reordered, before each verification.
        progress: show a tqdm bar over the new tokens.
        attention_mask: [B, n] of 0/1, left padding only (None: every token is real).
        success: with tau pruning on, also prune K by the gamma-tolerance paper's success
            condition S(K) > 1 (section 3.1, eq. 1) with the acceptance and drafter cost the
            controller measures (:meth:`specmoe.speculation.controllers.Controller.set_success`).
        pad_token_id: fills a batch's rows after their EOS (default: the model's
            ``generation_config.pad_token_id``, else the first EOS id, else 0), as
            transformers does.
        streamer: as transformers' ``generate(streamer=)`` takes it (``TextStreamer``,
            ``TextIteratorStreamer`` or any object with ``put`` and ``end``): ``put`` gets the
            prompt's ids, then each iteration's new tokens as they are accepted, ``end`` is
            called once at the end.  Batch size 1 only.

    With B > 1: each sequence has its own drafts, accepted prefix and EOS; one K per batch
    step; tau is measured per batch size in use (``tau`` may also map batch sizes to tau
    tables); ``sequences`` is [B, n + longest new] with finished rows padded; ``stats`` add
    ``batch``, ``new_tokens_per_row`` and ``acceptance_per_position``; iterations add
    ``batch``, ``k_rows`` and ``accepted_rows`` (``accepted`` and ``emitted`` are batch sums).

    Returns:
        :class:`GenerateOutput` (``.sequences``, ``.stats``, ``.iterations``).

    Raises:
        ValueError: empty prompt, a mask that is not left padding, bad lengths or sampling
            settings, a controller without a drafter, a drafter proposing ids outside the
            vocabulary.
    """
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
            or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    ids = torch.as_tensor(input_ids)
    if ids.dtype.is_floating_point or ids.dtype == torch.bool:
        raise TypeError(f"input_ids must hold integer token ids, got {ids.dtype}")
    batch_ids: Optional[torch.Tensor] = None
    batch_mask: Optional[torch.Tensor] = None
    if ids.dim() == 2 and ids.numel():
        mask = torch.ones_like(ids) if attention_mask is None \
            else torch.as_tensor(attention_mask)
        if tuple(mask.shape) != tuple(ids.shape):
            raise ValueError(f"attention_mask has shape {tuple(mask.shape)}, input_ids "
                             f"{tuple(ids.shape)}")
        if mask.dtype.is_floating_point:
            raise TypeError(f"attention_mask must hold integers 0/1, got {mask.dtype}")
        check_left_padded(ids, mask)
        if ids.shape[0] == 1:
            ids = ids[0][mask[0] == 1]  # batch size 1: the single-sequence loop
        else:
            batch_ids, batch_mask = ids.to(torch.long), mask.to(torch.long)
            ids = ids[mask == 1]  # for the checks below
    elif attention_mask is not None and ids.dim() == 1:
        raise ValueError("attention_mask needs [B, n] input_ids")
    if batch_ids is None and (ids.dim() != 1 or ids.numel() == 0):
        raise ValueError(f"input_ids must be a non-empty [B, n] or [n] tensor, got shape "
                         f"{tuple(torch.as_tensor(input_ids).shape)}")
    head = model.get_output_embeddings()   # an nn.Linear, or specmoe.models.layers.CLinear (no weight)
    vocab = int(getattr(head, "out_features", None) or head.weight.shape[0])
    prompt = [int(t) for t in ids.tolist()]
    if min(prompt) < 0 or max(prompt) >= vocab:
        raise ValueError(f"input_ids must lie in [0, {vocab})")
    if batch_ids is not None and (int(batch_ids.min()) < 0 or int(batch_ids.max()) >= vocab):
        raise ValueError(f"input_ids (padding included) must lie in [0, {vocab})")
    if controller is not None and drafter is None:
        raise ValueError("a controller needs a drafter (drafter=None decodes plainly)")
    if controller is not None and not isinstance(controller, Controller):
        raise TypeError(f"controller must be a specmoe.speculation.controllers Controller, got "
                        f"{type(controller).__name__}")
    if drafter is not None and not (isinstance(drafter, (DraftModel, NgramDrafter))
                                    or callable(getattr(drafter, "propose", None))):
        raise TypeError(f"drafter {type(drafter).__name__} has no propose(history, k)")
    mtp = drafter if isinstance(drafter, MtpDrafter) else None
    if mtp is not None and controller is not None and controller.k_max > mtp.k:
        raise ValueError(f"the MTP adapter drafts at most k={mtp.k} tokens, the controller's "
                         f"k_max is {controller.k_max}: pass e.g. Cascade(k_max={mtp.k})")
    if drafter is not None and controller is None:
        from .controllers import Cascade
        controller = Cascade(k_max=mtp.k) if mtp is not None else Cascade()
    sampling = Sampling(temperature, top_k, top_p) if do_sample else None
    if eos_token_id == -1:
        eos_token_id = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    eos = set() if eos_token_id is None else (
        {int(eos_token_id)} if isinstance(eos_token_id, int) else {int(t) for t in eos_token_id})
    gen = torch.Generator().manual_seed(int(seed)) if seed is not None else torch.Generator()
    if seed is None:
        gen.seed()
    if engine is None:
        engine = find_engine(model)
    if isinstance(tau, str) and tau != "auto":
        raise ValueError(f"tau must be 'auto', a mapping or None, got {tau!r}")
    if not isinstance(success, bool):
        raise TypeError(f"success must be a bool, got {type(success).__name__}")
    # Linear-attention and Mamba hybrids: without MTP, on a cache that records their states
    # over the last k_max + 1 tokens of each forward (transformers 5.25 on, new_kv's window,
    # a BatchKV's window for a batch), so each verification is cut back to its accepted
    # drafts; MTP's masks are not cut back within such a window
    require_speculable(model, "specmoe.generate",
                       "use model.generate() (offloading works as usual)",
                       windowed=mtp is None)
    if controller is not None:
        require_recording_planned(model, engine, controller.k_max, "specmoe.generate",
                                  rows=1 if batch_ids is None else int(batch_ids.shape[0]))
    prune = controller is not None and tau is not None and not (
        isinstance(tau, str) and isinstance(controller, StaticK))
    if controller is not None:
        # the success condition rides on the tau pruning (a StaticK under "auto" runs as given)
        controller.set_success(bool(success and prune))
    if streamer is not None and not (callable(getattr(streamer, "put", None))
                                     and callable(getattr(streamer, "end", None))):
        raise TypeError(f"streamer {type(streamer).__name__} has no put(ids) and end()")
    if batch_ids is not None:
        if streamer is not None:
            raise ValueError("a streamer takes one sequence: batch size 1 only (as "
                             "transformers' generate)")
        if pad_token_id is None:
            pad_token_id = getattr(getattr(model, "generation_config", None), "pad_token_id",
                                   None)
        if pad_token_id is None:
            pad_token_id = min(eos) if eos else 0
        return run_batch(model, batch_ids, batch_mask, drafter, controller, max_new_tokens,
                         sampling, eos, gen, tau if prune else None, engine, lookahead,
                         progress, int(pad_token_id), vocab)
    if controller is not None:
        controller.set_batch(1)
    if prune:
        assert controller is not None and tau is not None
        # "auto" prunes the K an adaptive controller may choose; a static K is what the caller
        # asked for and runs as given (pass a tau mapping to prune it anyway)
        if not isinstance(tau, str) and tau and all(isinstance(v, Mapping)
                                                    for v in tau.values()):
            tau = tau_for_batch({int(b): v for b, v in tau.items()}, 1)
        g_max = controller.k_max + 1
        if isinstance(tau, str) and mtp is not None:  # drafts and masks ride the verification
            controller.set_tau(mtp.tau(target_tau(model, prompt, mtp.tau_tokens(g_max), engine),
                                       g_max))
        else:
            controller.set_tau(target_tau(model, prompt, g_max, engine)
                               if isinstance(tau, str) else tau)
    if controller is not None and hasattr(controller, "begin_request"):
        controller.begin_request()  # Cascade's state is per request (controller.h)

    t_start = time.perf_counter()
    # (a verification forward is at most k_max + 1 tokens, and is cut back by at most k_max)
    kv = new_kv(model, rollback=True,
                window=(controller.k_max if controller is not None else 0) + 1)
    if len(prompt) > 1:
        # the last prompt token is the first pending one; the rest is never cut back, so a
        # hybrid's recurrent layers record none of it (no state copied per prompt token)
        with unrecorded(kv):  # (its logits are not read: lm_head on one row)
            forward_tokens(model, prompt[:-1], kv, last=True)
        crop_kv(kv, len(prompt) - 1)  # (sliding-window layers trimmed to their window)
    bound = isinstance(drafter, SelfDraft) and drafter.share_kv
    if bound:
        drafter.bind_kv(kv)  # MoE-SpeQ: the self-draft writes on the target's cache
    # A draft model is not prefilled here: its first draft of the request catches up over the
    # prompt inside that iteration's drafting time (a cost of speculating, which the controller
    # then sees), so a request the controller keeps plain never pays for the draft's prompt
    # (tiny-draft: ~13 ms per 120-token prompt, 2 % of a 64-token request on the zoo pair).
    if mtp is not None:
        mtp.reset()  # drafts of an earlier request never carry over
    seq = list(prompt)
    # specmoe.models.decode_step's forward, whose plan decodes a plain greedy step in one C call
    fast = decode_step_of(model)
    its: List[Dict[str, Any]] = []
    loaded0, stall0 = engine.loads() if engine is not None else (0, 0.0)
    la_keys = ("lookahead_predicted", "lookahead_used", "lookahead_hits")
    es0 = engine.stats() if engine is not None else {}
    la0 = {n: es0[n] for n in la_keys} if engine is not None else {}
    fid0 = dict(es0.get("routing_fidelity_pairs") or {})
    bar = None
    if progress:
        from tqdm.auto import tqdm
        bar = tqdm(total=max_new_tokens, desc="generate", unit="tok")
    if streamer is not None:
        streamer.put(torch.tensor([prompt]))  # (TextStreamer(skip_prompt=True) skips it)
    done = False
    try:
        while not done and len(seq) - len(prompt) < max_new_tokens:
            left = max_new_tokens - (len(seq) - len(prompt))
            k_plan = controller.next_k() if controller is not None else 0
            k = min(k_plan, left - 1)  # the target always adds one token of its own
            t0 = time.perf_counter()
            l0, s0 = engine.loads() if engine is not None else (0, 0.0)
            d = propose(drafter, seq, k, sampling, gen, vocab,
                       prefetch=lookahead and engine is not None)
            t_draft = time.perf_counter() - t0
            kd = len(d.tokens)
            if lookahead and d.routing and engine is not None:
                engine.lookahead(d.routing, d.token_routing, d.token_confidence)
            nxt = None
            plain = mtp is None or k <= 0  # (an MTP step made plain by the controller or the
            # tokens left: no masks, so the target's own forward; the next has no drafts)
            # (a step without drafts is never cut back: a hybrid's recurrent layers do not
            # record it, and take their one-call steps)
            with unrecorded(kv) if kd == 0 and plain else contextlib.nullcontext():
                if fast is not None and kd == 0 and sampling is None and plain:
                    # a plain greedy step in one C call, its logits left in C (None: the
                    # forward)
                    nxt = fast.greedy_next(seq[-1], kv)
                if nxt is not None:
                    n_acc = 0
                elif not plain:
                    # one forward verifies the drafts and (masks after each anchor) drafts the
                    # next step's tokens
                    logits = mtp.verify(kv, len(seq) - 1, [seq[-1]] + d.tokens, mtp.k)
                else:
                    logits = forward_tokens(model, [seq[-1]] + d.tokens, kv)  # [kd + 1, V]
            if nxt is None:
                # greedy: rows of logits, only their argmax matters (no per-token softmax)
                n_acc, nxt = accept_logits(logits, d.tokens, sampling, gen, d.probs)
            crop_kv(kv, len(seq) + n_acc)  # keep the pending token and the accepted drafts
            new = d.tokens[:n_acc] + [int(nxt)]
            for j, t in enumerate(new):
                if t in eos:
                    new = new[:j + 1]
                    done = True
                    break
            seq.extend(new)
            if mtp is not None and not done:
                mtp.advance(seq, n_acc, sampling, gen)
            t_end = time.perf_counter()
            t_iter = t_end - t0
            l1, s1 = engine.loads() if engine is not None else (0, 0.0)
            n_load, t_io = l1 - l0, max(0.0, min(s1 - s0, t_iter))
            primed = priming(drafter, kd, k)  # an MTP step with no drafts yet: not observed
            if controller is not None and not primed:  # (SpeQ learns its I/O cost here)
                controller.observe(kd, n_acc, t_iter, n_load, t_draft=min(t_draft, t_iter),
                                   t_io=t_io)
            its.append({"k_planned": int(k_plan), "k": kd, "accepted": int(n_acc),
                        "emitted": len(new), "t_iter": t_iter, "t_end": t_end, "t_draft": t_draft,
                        "experts_loaded": n_load, "priming": primed})
            if bar is not None:
                bar.update(len(new))
            if streamer is not None:
                streamer.put(torch.tensor(new))
    finally:
        if bar is not None:
            bar.close()
        if streamer is not None:
            streamer.end()
        if bound:
            drafter.bind_kv(None)
    elapsed = time.perf_counter() - t_start
    new_tokens = len(seq) - len(prompt)
    proposed = sum(i["k"] for i in its)
    accepted = sum(i["accepted"] for i in its)
    stats: Dict[str, Any] = {
        "new_tokens": new_tokens, "iterations": len(its), "time_s": elapsed,
        "tok_per_s": new_tokens / elapsed if elapsed > 0 else float("nan"),
        "proposed": proposed, "accepted": accepted,
        "acceptance": accepted / proposed if proposed else None,
        "etr": new_tokens / len(its) if its else None,
        "k_mean": proposed / len(its) if its else None,
    }
    if engine is not None:
        l1, s1 = engine.loads()
        es = engine.stats()
        pr, used, hits = (es[n] - la0[n] for n in la_keys)
        fid = {c: n - fid0.get(c, 0) for c, n in (es.get("routing_fidelity_pairs") or {}).items()}
        nf = sum(fid.values())
        stats.update({"experts_loaded": l1 - loaded0,
                      "experts_loaded_per_token": (l1 - loaded0) / max(1, new_tokens),
                      "stall_s": s1 - stall0,
                      "lookahead_predicted": pr, "lookahead_used": used, "lookahead_hits": hits,
                      "lookahead_precision": hits / pr if pr else None,
                      "lookahead_recall": hits / used if used else None,
                      # MoE-SpeQ Fig. 6: the self-draft's top-k against the target's, per
                      # (verified input, layer) -- hard / soft / mismatch shares
                      "routing_fidelity": {c: n / nf for c, n in fid.items()} if nf
                      else None})
    return GenerateOutput(torch.tensor([seq], dtype=torch.long), stats, its)

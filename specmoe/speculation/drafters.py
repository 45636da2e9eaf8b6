"""Drafters for speculative decoding: what proposes the K tokens one verification checks.

Anything with ``propose(history, k)`` returning token ids works (the :class:`Drafter`
protocol); the model drafters also return their distributions and routing through
``draft(...)``:

* :class:`NgramDrafter` -- prompt lookup in C (deterministic proposals);
* :class:`DraftModel` -- a small causal LM sharing the target's tokenizer (e.g. the zoo's
  ``tiny-draft``), with its own KV cache rolled back to the accepted prefix;
* :class:`SelfDraft` -- MoE-SpeQ's drafter: the target itself with every routed expert resident
  in a low-bit copy (int4 by default); its routing of the draft tokens is the expert lookahead
  buffer that is prefetched before verification (``Engine.lookahead``).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
from torch import nn

from .mtp import MtpDrafter
from .ngram import Drafter, NgramDrafter  # noqa: F401  (re-exported: drafters in one place)
from .decoding import Draft, crop_kv, forward_tokens, new_kv
from .sampling import Sampling

__all__ = ["DRAFTERS", "Drafter", "NgramDrafter", "DraftModel", "SelfDraft", "named_drafter",
           "propose"]

#: The drafter names ``specmoe run --drafter`` and ``specmoe serve --drafter`` take ("none":
#: plain decoding).
DRAFTERS = ("none", "ngram", "self", "mtp")


class DraftModel:
    """A small causal LM that drafts for the target (same tokenizer and vocabulary).

    It keeps its own KV cache of the history it has seen; each :meth:`draft` call crops it to the
    common prefix with the current history (the rejected drafts go) and feeds the new tokens in
    one forward before drafting token by token.  Greedy (``sampling=None``) drafts the argmax;
    otherwise it samples from ``sampling.probs`` and returns those distributions.

    ``c_layers``: run the draft's decode steps through specmoe's C layers
    (:func:`specmoe.models.dense.convert_dense` on ``model``, in place, at its own precision:
    f32 or bf16 weights kept bit for bit), so a drafted token is one C call where the model's
    form has one (a Llama-form draft: ``specmoe.models.arch.DECODE_STEP_MODELS``).  A small
    draft is bound by transformers' per-token Python, not by its weights: the zoo's tiny-draft
    (2 layers, hidden 128) drafted 3 tokens in 5.8 ms through torch and 1.35 ms so (Intel
    Xeon, 2 threads), where the zoo target's whole plain step takes about 0.5 ms.
    :meth:`from_pretrained` sets it; other dtypes stay in torch."""

    def __init__(self, model: nn.Module, *, c_layers: bool = False) -> None:
        if not isinstance(model, nn.Module) or not hasattr(model, "config"):
            raise TypeError("DraftModel needs a transformers causal LM")
        if c_layers:
            from ..models.dense import convert_dense
            dt = next(model.parameters()).dtype
            fmt = {torch.float32: "f32", torch.bfloat16: "bf16"}.get(dt)
            if fmt is not None and next(model.parameters()).device.type == "cpu":
                convert_dense(model, fmt)
        self.model = model
        self._kv: Any = None
        self._seen: List[int] = []  # tokens whose keys/values are in self._kv

    @classmethod
    def from_pretrained(cls, path: Any, dtype: torch.dtype = torch.float32, *,
                        c_layers: bool = True) -> "DraftModel":
        """The draft LM of the transformers checkpoint folder ``path`` (``dtype``, eval mode),
        its decode steps through specmoe's C layers unless ``c_layers`` is False (the class
        docstring).  ValueError where it does not load as a causal LM."""
        from transformers import AutoModelForCausalLM
        try:
            lm = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()
        except (OSError, ValueError, KeyError) as exc:
            raise ValueError(f"draft model {path}: does not load as a causal LM ({exc})") \
                from None
        return cls(lm, c_layers=c_layers)

    def reset(self) -> None:
        """Forget the cached history (the next draft starts from scratch)."""
        self._kv, self._seen = None, []

    def propose(self, history: Sequence[int], k: int) -> List[int]:
        """Greedy draft of k tokens after ``history`` (the :class:`Drafter` protocol)."""
        return self.draft(history, k).tokens

    def prefill(self, history: Sequence[int]) -> None:
        """Run the draft over ``history`` (all but its last token) ahead of the first draft,
        as the target's prefill does.  Optional: :meth:`draft` catches up over whatever it
        has not seen.  :func:`generate` does not call it, so that the prompt's cost lands in
        the first speculative iteration, where the controller counts it, and a request that
        never speculates never pays it."""
        h = [int(t) for t in history]
        if len(h) < 2:
            return
        n = self._sync(h)
        if n < len(h) - 1:
            self._run(h[n:-1], last=True)
        self._seen = h[:-1]

    def hand_over(self, history: Sequence[int]) -> Optional[Tuple[Any, List[int]]]:
        """This drafter's KV cache and the tokens it holds (a prefix of ``history``'s, or
        ``history`` but its last token prefilled first where it holds nothing), handed over:
        this drafter starts from scratch after.  What :meth:`BatchDraftModel.join` takes when
        a request that drafted alone joins a batch.  None where ``history`` has fewer than 2
        tokens and nothing is cached."""
        h = [int(t) for t in history]
        if self._kv is None or not self._seen:
            self.prefill(h)
        if self._kv is None or not self._seen:
            return None
        out = (self._kv, list(self._seen))
        self.reset()
        return out

    def take_over(self, kv: Any, seen: Sequence[int]) -> None:
        """Draft on from cache ``kv`` holding the tokens ``seen`` (what
        :meth:`BatchDraftModel.row` gives back where a batch's last request decodes alone on)."""
        if int(kv.get_seq_length()) != len(seen):
            raise ValueError(f"DraftModel.take_over: the cache holds "
                             f"{int(kv.get_seq_length())} positions, seen {len(seen)} tokens")
        self._kv, self._seen = kv, [int(t) for t in seen]

    def _run(self, ids: Sequence[int], last: bool = False) -> torch.Tensor:
        return forward_tokens(self.model, ids, self._kv, last)

    def _sync(self, h: List[int]) -> int:
        """Crop the cache to the longest prefix it shares with history ``h`` (never the last
        token of h, which must be fed to get the next distribution); returns that length."""
        n = 0
        lim = min(len(self._seen), len(h) - 1)
        while n < lim and self._seen[n] == h[n]:
            n += 1
        if self._kv is None or n == 0:
            self._kv, n = new_kv(self.model, rollback=True), 0
        else:
            crop_kv(self._kv, n)
        return n

    def draft(self, history: Sequence[int], k: int, sampling: Optional[Sampling] = None,
              generator: Optional[torch.Generator] = None) -> Draft:
        """Draft k tokens after ``history`` (a non-empty list of token ids)."""
        h = [int(t) for t in history]
        if not h:
            raise ValueError("draft: empty history")
        if k <= 0:
            return Draft([], None, None)
        n = self._sync(h)
        logits = self._run(h[n:], last=True)  # (the catch-up over what it has not seen)
        toks: List[int] = []
        rows: List[torch.Tensor] = []
        for i in range(k):
            if sampling is None:
                t = int(torch.argmax(logits[-1]))
            else:
                p = sampling.probs(logits[-1:])
                t = int(torch.multinomial(p[0], 1, generator=generator))
                rows.append(p[0])
            toks.append(t)
            if i + 1 < k:
                logits = self._run([t])
        # the last draft token was not fed: the cache holds history + toks[:-1]
        self._seen = h + toks[:-1]
        tr = self._token_routing()
        return Draft(toks, torch.stack(rows) if rows else None, self._routing(len(h) - n, k),
                     tr[0] if tr else None, tr[1] if tr else None)

    def _routing(self, fed_first: int, k: int) -> Optional[Dict[int, np.ndarray]]:
        return None

    def _token_routing(self) -> Optional[Tuple[Dict[int, np.ndarray], Dict[int, np.ndarray]]]:
        return None


class SelfDraft(DraftModel):
    """MoE-SpeQ's drafter: the offloaded target itself, its routed experts resident in a
    ``dtype`` copy (:meth:`specmoe.runtime.engine.Engine.enable_self_draft`), attention and routers shared.

    Drafting k tokens routes the verification's first k inputs (the pending token and the
    first k-1 drafts; the last draft is never fed to the draft): those per-layer activation
    counts are :attr:`Draft.routing`, the expert lookahead buffer :func:`generate` prefetches
    before verifying.

    ``share_kv`` (default True): :func:`specmoe.generate` binds the target's own KV cache
    (:meth:`bind_kv`); a draft then feeds only the pending token and its drafts on top of the
    verified prefix the target already cached, in full precision, and crops its positions
    off again before returning, so verification overwrites them (MoE-SpeQ Sec. 3.4: no
    second KV cache, and the draft sees the target's context).  Batches do the same on the
    target's batched cache (:class:`specmoe.speculation.batch.BatchDraftModel`).  Unbound
    (direct calls, ``share_kv=False``) it keeps a cache of its own like :class:`DraftModel`.

    ``overlap=True``: with ``draft(..., prefetch=True)`` (what :func:`specmoe.generate` does
    when its ``lookahead`` is on) each draft step's experts are queued to the prefetch worker
    as soon as that step routes them, layer by layer, so the loads overlap the rest of the
    draft (MoE-SpeQ Sec. 3, the draft-guided pipeline; see
    :meth:`specmoe.runtime.engine.Engine.drafting`).  Off by default: on the zoo model with an emulated
    2 GB/s link it ran at 0.92-0.97x the sequential lookahead's tok/s (medians over 18 rows,
    three runs, 25 % and 50 % cache) and loaded 6-16 % more experts: drafting the tiny model
    takes a few milliseconds, so there is little to overlap, and early loads get evicted by
    later ones when the lookahead buffer is as large as the cache
    (benchmarks/results/speculation_overlap.json, ``self-overlap`` rows)."""

    def __init__(self, engine: Any, dtype: str = "int4", *, overlap: bool = False,
                 share_kv: bool = True) -> None:
        if not callable(getattr(engine, "enable_self_draft", None)):
            raise TypeError("SelfDraft needs the specmoe Engine of an offloaded model "
                            "(specmoe.offload(...))")
        super().__init__(engine.model)
        self.engine = engine
        engine.enable_self_draft(dtype)
        self._rec: List[Any] = []
        self.overlap = bool(overlap)  # queue each draft step's experts as it routes
        self.share_kv = bool(share_kv)  # draft on the target's KV cache (generate binds it)
        self._shared: Any = None  # the target's cache while bound (bind_kv)
        self._n0 = 0  # its length when the current draft began
        self._prefetch = False

    def reset(self) -> None:
        super().reset()
        self._rec = []

    def bind_kv(self, kv: Any) -> None:
        """Draft on ``kv``, the target's KV cache, which must hold every token of the history
        but the last at each :meth:`draft` (what :func:`specmoe.generate` keeps); None: back
        to the drafter's own cache.  No-op unless ``share_kv``."""
        if not self.share_kv:
            return
        self._shared = kv
        self._kv, self._seen = None, []

    def prefill(self, history: Sequence[int]) -> None:
        if self._shared is None:  # bound: the target's prefill is the draft's
            super().prefill(history)

    def _sync(self, h: List[int]) -> int:
        if self._shared is None:
            return super()._sync(h)
        n = int(self._shared.get_seq_length())
        if n != len(h) - 1:
            raise RuntimeError(f"SelfDraft: the bound KV cache holds {n} positions, the "
                               f"history {len(h)} tokens (expected {len(h) - 1})")
        self._kv, self._n0 = self._shared, n
        return n

    def _run(self, ids: Sequence[int], last: bool = False) -> torch.Tensor:
        with self.engine.drafting(prefetch=self._prefetch) as rec:
            out = forward_tokens(self.model, ids, self._kv, last)
        self._rec.append(rec)
        return out

    def draft(self, history: Sequence[int], k: int, sampling: Optional[Sampling] = None,
              generator: Optional[torch.Generator] = None, *, prefetch: bool = False) -> Draft:
        self._rec = []
        self._prefetch = bool(prefetch) and self.overlap
        try:
            return super().draft(history, k, sampling, generator)
        finally:
            self._prefetch = False
            if self._shared is not None:  # the draft's positions go; verification rewrites
                crop_kv(self._shared, self._n0)
                self._kv, self._seen = None, []

    def _routing(self, fed_first: int, k: int) -> Optional[Dict[int, np.ndarray]]:
        E = self.engine.num_experts
        counts: Dict[int, np.ndarray] = {}
        for i, rec in enumerate(self._rec):
            for pos, idx, _ in rec:
                rows = idx[-1:] if i == 0 else idx  # first forward: only the pending token
                c = counts.setdefault(pos, np.zeros(E, np.int64))
                np.add.at(c, rows.ravel(), 1)
        return counts

    def _token_routing(self) -> Optional[Tuple[Dict[int, np.ndarray], Dict[int, np.ndarray]]]:
        # the verification's inputs in order: the pending token (the first forward's last
        # row), then one draft per later forward; their ids and router weights (the ELB's
        # confidence)
        ids: Dict[int, List[np.ndarray]] = {}
        wts: Dict[int, List[np.ndarray]] = {}
        for i, rec in enumerate(self._rec):
            for pos, idx, w in rec:
                ids.setdefault(pos, []).append(idx[-1:] if i == 0 else idx)
                wts.setdefault(pos, []).append(w[-1:] if i == 0 else w)
        return ({pos: np.concatenate(r, 0) for pos, r in ids.items()},
                {pos: np.concatenate(r, 0) for pos, r in wts.items()})


def named_drafter(name: str, model: nn.Module, engine: Any = None,
                  mtp_adapter: Any = None) -> Any:
    """The drafter ``name`` (of :data:`DRAFTERS`, not ``"none"``) for ``model``: an
    :class:`NgramDrafter`, a :class:`SelfDraft` of its Engine ``engine`` (the experts in int4,
    drafting on the target's cache), or an :class:`MtpDrafter` installing ``mtp_adapter`` (an
    MtpAdapter or its folder) on ``model`` (its ``adapter.uninstall()`` takes it off).
    ValueError for another name or a missing engine or adapter."""
    if mtp_adapter is not None and name != "mtp":
        raise ValueError("mtp_adapter goes with drafter='mtp'")
    if name == "mtp":
        if mtp_adapter is None:
            raise ValueError("drafter 'mtp' needs its adapter: mtp_adapter= (--mtp-adapter "
                             "DIR), an MtpAdapter or the folder training/mtp.py writes")
        return MtpDrafter(model, mtp_adapter)
    if name == "ngram":
        return NgramDrafter()
    if name == "self":
        if engine is None or not callable(getattr(engine, "enable_self_draft", None)):
            raise ValueError("drafter 'self' drafts with the model's own experts in int4: "
                             "it needs a model offloaded by specmoe (an Engine)")
        return SelfDraft(engine)
    raise ValueError(f"unknown drafter {name!r}: one of {', '.join(DRAFTERS[1:])}")


def propose(drafter: Any, history: List[int], k: int, sampling: Optional[Sampling],
           gen: Optional[torch.Generator], vocab: int, prefetch: bool = False) -> Draft:
    if k <= 0:
        return Draft([])
    if isinstance(drafter, SelfDraft):
        d = drafter.draft(history, k, sampling, gen, prefetch=prefetch)
    elif isinstance(drafter, (DraftModel, MtpDrafter)):
        d = drafter.draft(history, k, sampling, gen)
    else:
        d = Draft([int(t) for t in drafter.propose(history, k)])
    if len(d.tokens) > k:
        raise ValueError(f"drafter {type(drafter).__name__} proposed {len(d.tokens)} tokens, "
                         f"more than the {k} asked for")
    bad = [t for t in d.tokens if not (0 <= t < vocab)]
    if bad:
        raise ValueError(f"drafter {type(drafter).__name__} proposed token ids {bad} outside "
                         f"the vocabulary [0, {vocab})")
    if d.probs is not None and tuple(d.probs.shape) != (len(d.tokens), vocab):
        raise ValueError(f"drafter {type(drafter).__name__} returned probs of shape "
                         f"{tuple(d.probs.shape)}, expected ({len(d.tokens)}, {vocab})")
    return d

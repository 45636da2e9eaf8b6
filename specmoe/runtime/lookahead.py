"""MoE-SpeQ's expert lookahead buffer (Sec. 3.3): the experts a draft expects the next
verification pass to use, per MoE layer, and how well that prediction did.

One :class:`LookaheadBuffer` belongs to an :class:`specmoe.runtime.engine.Engine`, which fills it from
the draft's routing (:meth:`Engine.lookahead`), queues its experts to the prefetch worker,
protects them from eviction until their layer has run (lookahead-aware eviction) and tells it
when each layer of the pass is done.  The buffer itself touches no cache: it holds the masks
and the counters, so it can be tested and reasoned about on its own.

Routing fidelity (MoE-SpeQ Sec. 2.5, Fig. 6): when the draft also gives its top-k per token
(``tokens`` of :meth:`LookaheadBuffer.set`: the rows of the verification's first tokens, in
the router's order of importance), each (token, layer) of the pass is classed against the
target's own top-k as it routes: a **hard** match (the same experts in the same order), a
**soft** match (the same set in another order) or a **mismatch** (at least one expert
differs).  The paper measured 44.1 % / 46.8 % / 9.1 % for an int4 draft of Qwen-MoE.

Confidence (MoE-SpeQ Sec. 3.3.1): each ELB entry is (token, layer, expert, confidence_score),
the score from the draft's gating network.  With ``confidence`` (the router weights of the
``tokens`` rows) the buffer keeps, per layer and expert, the sum of its entries' scores, and
:func:`lookahead_queue` orders a layer's experts by it (after a utility-space policy's
utility), so the experts the draft is surest of load first; :meth:`LookaheadBuffer.entries`
gives the entries themselves.  The queue skips experts already resident or loading
(``csrc/slots.c``: the ELB is checked against the cache before anything is queued).
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

__all__ = ["LookaheadBuffer", "draft_step_priorities", "lookahead_queue", "routing_fidelity"]


class LookaheadBuffer:
    """Predicted experts of one forward pass: MoE layer position -> bool mask [E].

    ``set(counts)`` replaces the buffer (validated first: a bad call leaves it unchanged);
    ``layer_done(pos, used)`` ends layer ``pos`` of the pass, counting the prediction against
    the experts the layer used; the pass's last layer ends the whole buffer.  ``predicted``,
    ``actual`` and ``true_positive`` accumulate over passes until :meth:`reset_stats`.
    """

    def __init__(self, num_layers: int, num_experts: int) -> None:
        self.num_layers = int(num_layers)
        self.num_experts = int(num_experts)
        self.masks: dict[int, np.ndarray] = {}
        self.rows: dict[int, np.ndarray] = {}   # pos -> the draft's top-k per token [n, k]
        self.scores: dict[int, np.ndarray] = {}  # pos -> the rows' confidence [n, k]
        self.predicted = self.actual = self.true_positive = 0
        self.fidelity = np.zeros(3, np.int64)   # (token, layer) pairs: hard, soft, mismatch

    @property
    def active(self) -> bool:
        """Whether a pass's prediction is pending."""
        return bool(self.masks)

    def set(self, counts: Mapping[int, Any], tokens: Mapping[int, Any] | None = None,
            confidence: Mapping[int, Any] | None = None) -> dict[int, np.ndarray]:
        """Replace the buffer with ``counts[pos]`` [E] > 0 (how many tokens the draft routes to
        each expert of MoE layer ``pos``); returns the counts as float64 arrays by position.
        ``tokens[pos]``: the draft's top-k expert ids [n, k] of the pass's first n tokens, in
        the router's order (routing fidelity, module docstring); ``confidence[pos]``: their
        scores [n, k] (the draft router's weights; finite, >= 0), for a position that has
        token rows.  ValueError on a position outside the model, a wrong shape or a bad score;
        the buffer is unchanged then."""
        L, E = self.num_layers, self.num_experts
        rows: dict[int, np.ndarray] = {}
        for pos, r in (tokens or {}).items():
            a = np.asarray(r)
            if isinstance(pos, bool) or not isinstance(pos, (int, np.integer)) \
                    or not (0 <= pos < L) or a.ndim != 2 or a.dtype.kind not in "iu":
                raise ValueError(f"lookahead: token rows of position {pos!r} must be integer "
                                 f"ids [n, k] for 0 <= position < {L}, got {a.dtype} "
                                 f"{a.shape}")
            if a.size and (a.min() < 0 or a.max() >= E):
                raise ValueError(f"lookahead: token rows of position {pos} hold an expert id "
                                 f"outside 0..{E - 1}")
            rows[int(pos)] = a.astype(np.int64)
        scores: dict[int, np.ndarray] = {}
        for pos, c in (confidence or {}).items():
            a = np.asarray(c)
            if pos not in rows or a.shape != rows[pos].shape or a.dtype.kind not in "iuf" \
                    or not np.isfinite(a).all() or (a < 0).any():
                raise ValueError(f"lookahead: confidence of position {pos!r} must be finite "
                                 f"scores >= 0 shaped as that position's token rows "
                                 f"{rows[pos].shape if pos in rows else '(none given)'}, got "
                                 f"{a.dtype} {a.shape}")
            scores[int(pos)] = a.astype(np.float64)
        arrays: dict[int, np.ndarray] = {}
        for pos, c in counts.items():
            a = np.asarray(c)
            if isinstance(pos, bool) or not isinstance(pos, (int, np.integer)) \
                    or not (0 <= pos < L) or a.shape != (E,):
                raise ValueError(f"lookahead: position {pos!r} with counts of shape {a.shape}; "
                                 f"expected 0 <= position < {L} and shape ({E},)")
            if a.dtype.kind not in "iubf" or (a.dtype.kind == "f" and np.isnan(a).any()):
                raise ValueError(f"lookahead: counts of layer {pos} must be numbers, got "
                                 f"{a.dtype} {'with NaN' if a.dtype.kind == 'f' else ''}")
            arrays[int(pos)] = a.astype(np.float64)
        self.masks = {pos: a > 0 for pos, a in arrays.items()}
        self.rows = rows
        self.scores = scores
        return arrays

    def confidence(self) -> dict[int, np.ndarray]:
        """Per pending layer with scores, each expert's summed confidence [E] (float64)."""
        out = {}
        for pos, sc in self.scores.items():
            if pos in self.masks:
                c = np.zeros(self.num_experts)
                np.add.at(c, self.rows[pos].ravel(), sc.ravel())
                out[pos] = c
        return out

    def entries(self) -> np.ndarray:
        """The buffer's entries for the layers still to run, MoE-SpeQ's ELB (Sec. 3.3.1): a
        structured array of (token, layer, expert, confidence), token the row of the pass
        (0: the pending token), layer the MoE layer position, confidence NaN where the
        draft gave none; earlier layers first, each layer's rows in order."""
        dt = np.dtype([("token", np.int64), ("layer", np.int64), ("expert", np.int64),
                       ("confidence", np.float64)])
        parts = []
        for pos in sorted(p for p in self.rows if p in self.masks):
            r = self.rows[pos]
            e = np.zeros(r.size, dt)
            e["token"] = np.repeat(np.arange(r.shape[0]), r.shape[1])
            e["layer"] = pos
            e["expert"] = r.ravel()
            e["confidence"] = self.scores[pos].ravel() if pos in self.scores else np.nan
            parts.append(e)
        return np.concatenate(parts) if parts else np.zeros(0, dt)

    def layer_done(self, pos: int, used: np.ndarray, idx: Any = None) -> None:
        """Layer ``pos`` of the pass ran and used the experts flagged in ``used`` [E];
        ``idx``: the target's top-k ids per token [T, k] (counts the routing fidelity of the
        draft's token rows for this layer, if any)."""
        mask = self.masks.pop(pos, None)
        rows = self.rows.pop(pos, None)
        self.scores.pop(pos, None)
        if pos == self.num_layers - 1:
            self.masks.clear()  # a lookahead is for one pass
            self.rows.clear()
            self.scores.clear()
        if mask is not None:
            act = np.asarray(used).astype(bool)
            self.predicted += int(mask.sum())
            self.actual += int(act.sum())
            self.true_positive += int((mask & act).sum())
        if rows is not None and idx is not None:
            self.fidelity += routing_fidelity(rows, np.asarray(idx))

    def pending(self) -> tuple[np.ndarray, np.ndarray]:
        """(layers, experts) of the predictions for layers still to run, int64."""
        lay = [np.full(int(m.sum()), p, np.int64) for p, m in self.masks.items()]
        exp = [np.flatnonzero(m).astype(np.int64) for m in self.masks.values()]
        if not lay:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        return np.concatenate(lay), np.concatenate(exp)

    def reset_stats(self) -> None:
        self.predicted = self.actual = self.true_positive = 0
        self.fidelity[:] = 0

    def stats(self) -> dict[str, Any]:
        """Precision and recall of the predictions against what the passes used, and the
        routing fidelity: (token, layer) pairs by class, and their shares."""
        n = int(self.fidelity.sum())
        h, s, m = (int(x) for x in self.fidelity)
        return {
            "routing_fidelity": ({"hard": h / n, "soft": s / n, "mismatch": m / n}
                                 if n else None),
            "routing_fidelity_pairs": {"hard": h, "soft": s, "mismatch": m},
            "lookahead_precision": (self.true_positive / self.predicted
                                    if self.predicted else None),
            "lookahead_recall": self.true_positive / self.actual if self.actual else None,
            "lookahead_predicted": self.predicted,
            "lookahead_used": self.actual,
            "lookahead_hits": self.true_positive,
        }


def routing_fidelity(draft: np.ndarray, target: np.ndarray) -> np.ndarray:
    """(hard, soft, mismatch) counts of the draft's top-k rows ``draft`` [n, k] against the
    target's ``target`` [>= n, k] (its first n rows: the same tokens), MoE-SpeQ Fig. 6: the
    same ids in the same order; the same set in another order; any other."""
    d = np.asarray(draft)
    n = min(d.shape[0], target.shape[0])
    if n == 0:
        return np.zeros(3, np.int64)
    d, t = d[:n], np.asarray(target)[:n]
    if d.shape[1] != t.shape[1]:
        raise ValueError(f"routing_fidelity: the draft's top-{d.shape[1]} against the "
                         f"target's top-{t.shape[1]}")
    hard = (d == t).all(1)
    same = (np.sort(d, 1) == np.sort(t, 1)).all(1)
    h, s = int(hard.sum()), int((same & ~hard).sum())
    return np.array([h, s, n - h - s], np.int64)


def lookahead_queue(arrays: Mapping[int, np.ndarray], num_layers: int, utility: Any = None,
                    confidence: Mapping[int, np.ndarray] | None = None
                    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The prefetch queue of a lookahead (both engines' ``lookahead``): every expected expert
    as (layers, experts, priorities), earlier layers first; within a layer, when ``utility``
    (``f(layers, experts) -> int array``, a utility-space policy's) is given, by utility and
    then count, higher first; with ``confidence[pos]`` (the layer's summed ELB scores [E],
    :meth:`LookaheadBuffer.confidence`) by utility, if any, then confidence.  Priorities
    squash the within-layer order into (0, 1) above the layer's rank ``num_layers - pos``."""
    lay, exp, pri = [], [], []
    for pos, c in arrays.items():
        ids = np.flatnonzero(c > 0)
        pr = np.zeros(len(ids), np.float64)
        sc = (confidence or {}).get(pos)
        tie = c if sc is None else sc  # what breaks the utility's ties, or orders alone
        if utility is not None:  # integer utility first
            pr = np.asarray(utility(np.full(len(ids), pos), ids), np.float64) + \
                tie[ids] / (tie.max() + 1.0)
        elif sc is not None:
            pr = sc[ids] / (sc.max() + 1.0)
        lay.append(np.full(len(ids), pos, np.int64))
        exp.append(ids.astype(np.int64))
        pri.append((num_layers - pos) + 0.5 + np.arctan(pr) / np.pi)
    if not lay:
        return np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, np.float32)
    return np.concatenate(lay), np.concatenate(exp), np.concatenate(pri).astype(np.float32)


def draft_step_priorities(pos: int, confidence: np.ndarray, num_layers: int) -> np.ndarray:
    """Priorities of the experts one draft step routes its newest token to at MoE layer
    ``pos`` (MoE-SpeQ's draft-guided pipeline, Sec. 3): earlier layers first, as
    :func:`lookahead_queue` orders them, the router weight as confidence within the layer."""
    c = np.asarray(confidence, np.float64)
    return ((num_layers - pos) + 0.5 + np.arctan(c) / np.pi).astype(np.float32)

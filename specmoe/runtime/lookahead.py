"""MoE-SpeQ's expert lookahead buffer (Sec. 3.3): the experts a draft expects the next
verification pass to use, per MoE layer, and how well that prediction did.

One :class:`LookaheadBuffer` belongs to an :class:`specmoe.runtime.engine.Engine`, which fills it from
the draft's routing (:meth:`Engine.lookahead`), queues its experts to the prefetch worker,
protects them from eviction until their layer has run (lookahead-aware eviction) and tells it
when each layer of the pass is done.  The buffer itself touches no cache: it holds the masks
and the counters, so it can be tested and reasoned about on its own.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

__all__ = ["LookaheadBuffer", "draft_step_priorities", "lookahead_queue"]


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
        self.predicted = self.actual = self.true_positive = 0

    @property
    def active(self) -> bool:
        """Whether a pass's prediction is pending."""
        return bool(self.masks)

    def set(self, counts: Mapping[int, Any]) -> dict[int, np.ndarray]:
        """Replace the buffer with ``counts[pos]`` [E] > 0 (how many tokens the draft routes to
        each expert of MoE layer ``pos``); returns the counts as float64 arrays by position.
        ValueError on a position outside the model or a wrong shape."""
        L, E = self.num_layers, self.num_experts
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
        return arrays

    def layer_done(self, pos: int, used: np.ndarray) -> None:
        """Layer ``pos`` of the pass ran and used the experts flagged in ``used`` [E]."""
        mask = self.masks.pop(pos, None)
        if pos == self.num_layers - 1:
            self.masks.clear()  # a lookahead is for one pass
        if mask is not None:
            act = np.asarray(used).astype(bool)
            self.predicted += int(mask.sum())
            self.actual += int(act.sum())
            self.true_positive += int((mask & act).sum())

    def pending(self) -> tuple[np.ndarray, np.ndarray]:
        """(layers, experts) of the predictions for layers still to run, int64."""
        lay = [np.full(int(m.sum()), p, np.int64) for p, m in self.masks.items()]
        exp = [np.flatnonzero(m).astype(np.int64) for m in self.masks.values()]
        if not lay:
            return np.zeros(0, np.int64), np.zeros(0, np.int64)
        return np.concatenate(lay), np.concatenate(exp)

    def reset_stats(self) -> None:
        self.predicted = self.actual = self.true_positive = 0

    def stats(self) -> dict[str, Any]:
        """Precision and recall of the predictions against what the passes used."""
        return {
            "lookahead_precision": (self.true_positive / self.predicted
                                    if self.predicted else None),
            "lookahead_recall": self.true_positive / self.actual if self.actual else None,
            "lookahead_predicted": self.predicted,
            "lookahead_used": self.actual,
            "lookahead_hits": self.true_positive,
        }


def lookahead_queue(arrays: Mapping[int, np.ndarray], num_layers: int,
                    utility: Any = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The prefetch queue of a lookahead (both engines' ``lookahead``): every expected expert
    as (layers, experts, priorities), earlier layers first; within a layer, when ``utility``
    (``f(layers, experts) -> int array``, a utility-space policy's) is given, by utility and
    then count, higher first.  Priorities squash the within-layer order into (0, 1) above the
    layer's rank ``num_layers - pos``."""
    lay, exp, pri = [], [], []
    for pos, c in arrays.items():
        ids = np.flatnonzero(c > 0)
        pr = np.zeros(len(ids), np.float64)
        if utility is not None:  # integer utility first, the count breaks ties
            pr = np.asarray(utility(np.full(len(ids), pos), ids), np.float64) + \
                c[ids] / (c.max() + 1.0)
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

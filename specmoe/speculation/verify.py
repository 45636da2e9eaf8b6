"""The per-iteration acceptance rule of speculative decoding (greedy or speculative sampling),
in C (``csrc/spec/verify.c``)."""
from __future__ import annotations

from typing import Any, Optional, Sequence, Union

import numpy as np

from .. import _C

__all__ = ["accept", "accept_logits", "greedy_tokens"]


def accept(p: np.ndarray, draft: Union[Sequence[int], np.ndarray],
           q: Optional[np.ndarray] = None,
           u: Optional[np.ndarray] = None, *, check: bool = True) -> tuple[int, int]:
    """How many of the K draft tokens one verification accepts, and the next token.

    The iteration emits ``draft[:n]`` followed by ``next_token`` (n + 1 tokens).

    Greedy (``u is None``): draft i is accepted, in order, while it equals ``argmax(p[i])``
    (ties to the lowest id); ``next_token = argmax(p[n])``.  ``q`` is ignored.  Only each
    row's argmax matters, so a greedy caller may pass rows of logits with ``check=False``
    (what :func:`specmoe.generate` does: no softmax per token, ties decided on the logits).

    Sampling (``u`` given): the speculative-sampling rule (Leviathan et al. 2023, Chen et al.
    2023), under which every emitted token follows the target distribution exactly, whatever
    the draft distribution.  Draft ``d = draft[i]`` is accepted iff
    ``u[i, 0] < p[i, d] / q[i, d]`` (q = 0 < p: accepted; p = q = 0: rejected).  At the first
    rejection the next token is drawn from the residual ``max(0, p[i] - q[i])`` renormalised
    (from ``p[i]`` if that is all zero through rounding); if all K are accepted, the bonus
    token is drawn from ``p[K]``.  Draws use ``u[row, 1]`` and the inverse CDF: the smallest
    id whose cumulative weight (summed in float64) exceeds ``u * total``; an id of probability
    0 is never drawn.  ``u[K, 0]`` is unused.

    Args:
        p: float32 C-contiguous ``[K+1, V]``, the target's probabilities; row i is the
            distribution of the token after position i of the verified input.  Rows must be
            non-negative, finite, and sum to 1 within 1e-3.
        draft: the K draft ids in ``[0, V)`` (any integer sequence/array; K may be 0).
        q: float32 C-contiguous ``[K, V]``, the draft's probabilities the drafts were
            sampled from, or None for deterministic proposals (n-gram lookup, greedy drafter):
            then ``q[i]`` is one-hot at ``draft[i]``.
        u: float64 C-contiguous ``[K+1, 2]`` uniforms in ``[0, 1)`` from the caller's seeded
            generator (e.g. ``rng.random((K + 1, 2))``), or None for greedy decoding.
        check: scan every entry of p and q (finite, >= 0, rows summing to 1).  False skips
            that O((2K+1)V) scan, for a loop that computes its rows with softmax itself;
            shapes, dtypes, draft ids and u are still checked, so bad values cannot crash,
            but they give an unspecified answer (or ValueError) instead of a named error.

    Returns:
        ``(n_accepted, next_token)``.

    Raises:
        TypeError: an array of the wrong type or dtype (no silent conversion of p, q, u), or
            non-integer draft ids.
        ValueError: wrong shapes or layout, a non-probability row (NaN, inf, negative, bad
            sum), a draft id out of range, or u outside ``[0, 1)``.
    """
    return _C.spec_accept(p, draft, q, u, check=check)


def accept_logits(logits: Any, draft: Sequence[int], sampling: Any = None,
                  generator: Any = None, q: Any = None) -> tuple[int, int]:
    """:func:`accept` on one verification's target ``logits`` [K+1, V] (a torch tensor), as
    every decoding loop calls it: greedy (``sampling`` None) on the rows of logits as they are;
    else on ``sampling.probs(logits)`` with the 2(K+1) uniforms drawn from ``generator``, and
    ``q`` the draft's distributions [K, V] (a torch tensor) or None for deterministic drafts."""
    import torch
    if sampling is None:
        p, u, qq = logits.float().contiguous().numpy(), None, None
    else:
        p = sampling.probs(logits).numpy()
        u = torch.rand((len(draft) + 1, 2), generator=generator, dtype=torch.float64).numpy()
        qq = None if q is None else q.float().contiguous().numpy()
    return accept(p, np.asarray(draft, np.int64), qq, u, check=u is not None)


def greedy_tokens(logits: Any) -> list[int]:
    """The argmax of each row of ``logits`` ([V] or [B, V], a torch tensor), ties to the lowest
    id as :func:`accept` reads them.  Through NumPy for float32/float64 on the CPU: torch's
    argmax costs 17 us on one row of 8192 and 65 us on four, NumPy's 2-5 us (Intel Xeon,
    2 threads), which a decode step of a small model pays every token."""
    import torch
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.float64):
        return np.asarray(logits.detach().numpy().argmax(-1)).reshape(-1).tolist()
    return logits.argmax(-1).reshape(-1).tolist()

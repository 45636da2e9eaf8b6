"""Prompt-lookup drafting (:class:`NgramDrafter`, in C) and the :class:`Drafter` protocol the
generate loops take.  Needs numpy only: ``import specmoe`` works without torch (the model
drafters, which need torch, are in :mod:`specmoe.speculation.drafters`)."""
from __future__ import annotations

from typing import Iterable, Optional, Protocol, Sequence, Union

import numpy as np

from .. import _C
from .controllers.base import check_int

__all__ = ["Drafter", "NgramDrafter"]


class Drafter(Protocol):
    """What a drafter offers the generate loop."""

    def propose(self, history: Optional[Sequence[int]], k: int) -> list[int]: ...
    def append(self, tokens: Iterable[int]) -> None: ...
    def reset(self) -> None: ...


def _tokens(x: Union[Iterable[int], np.ndarray]) -> np.ndarray:
    """Token ids as an integer array; floats and other dtypes are refused (TypeError)."""
    if not isinstance(x, (np.ndarray, Sequence)):
        x = list(x)
    a = np.asarray(x)
    if a.size == 0:
        return a.astype(np.int64)
    if a.dtype.kind not in "iu":
        raise TypeError(f"token ids must be integers, got dtype {a.dtype}")
    return a


class NgramDrafter:
    """Prompt-lookup drafter in C: the tokens that followed the most recent earlier occurrence
    of the history's last n tokens (n = max_n down to min_n), continued periodically when the
    match runs into the end of the history (definition in csrc/spec/ngram.h).

    The index is incremental: appending a token costs O(max_n), a proposal O(max_n + k).
    """

    def __init__(self, max_n: int = 3, min_n: int = 1) -> None:
        self._g = _C.NgramDrafter(check_int("max_n", max_n, 1), check_int("min_n", min_n, 1))
        self._n = (int(max_n), int(min_n))

    def clone(self) -> "NgramDrafter":
        """A new drafter with the same settings and an empty history (one per sequence of a
        batch: :func:`specmoe.generate` gives every sequence its own index)."""
        return NgramDrafter(*self._n)

    @property
    def length(self) -> int:
        """Tokens in the drafter's history."""
        return int(self._g.length)

    def propose(self, history: Optional[Union[Sequence[int], np.ndarray]], k: int) -> list[int]:
        """Propose k draft tokens, or none when no n-gram of the history's end recurs.

        Args:
            history: the full token history (ids >= 0).  The drafter compares it with the one
                it holds (a memcmp), appends the new tail, and rebuilds its index only if the
                history diverged.  None keeps the held history (after :meth:`append`).
            k: number of tokens wanted (>= 0).

        Raises:
            ValueError: negative k, bad token ids, or an empty history.
        """
        k = check_int("k", k, 0)
        return list(self._g.propose(None if history is None else _tokens(history), k))

    def append(self, tokens: Union[Iterable[int], np.ndarray]) -> None:
        """Extend the held history by tokens (ids >= 0)."""
        self._g.append(_tokens(tokens))

    def reset(self) -> None:
        """Forget the history."""
        self._g.reset()

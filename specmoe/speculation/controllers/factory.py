"""Controllers by name: what ``specmoe run --controller`` and ``specmoe serve --controller``
take (``cascade``, ``speq``, ``heuristic``, ``static:K``), or a callable."""
from __future__ import annotations

from typing import Callable, Optional, Union

from .base import Controller
from .cascade import Cascade
from .heuristic import Heuristic
from .speq import SpeqGovernor
from .static import StaticK

__all__ = ["controller_factory"]


def controller_factory(spec: Union[str, Callable[[], Controller], None],
                       k_max: Optional[int] = None) -> Callable[[], Controller]:
    """A callable making a fresh controller: ``None``/``"cascade"`` (the default),
    ``"speq"``, ``"heuristic"``, ``"static:K"`` (a fixed K >= 0), or a callable returning a
    :class:`specmoe.speculation.controllers.Controller`.  ``k_max``: the most drafts the
    drafter can give (the MTP adapter's k), the named controllers' largest K (a static K
    above it: ValueError).  ValueError for another name."""
    if spec is None or spec == "cascade":
        return Cascade if k_max is None else (lambda: Cascade(k_max=k_max))
    if callable(spec) and not isinstance(spec, str):
        return spec
    if spec == "speq":
        return SpeqGovernor if k_max is None else (lambda: SpeqGovernor(k_max=k_max))
    if spec == "heuristic":
        return Heuristic if k_max is None else (
            lambda: Heuristic(min(5, k_max), k_max=k_max))
    if isinstance(spec, str) and spec.startswith("static:"):
        try:
            k = int(spec.split(":", 1)[1])
        except ValueError:
            k = -1
        if k < 0:
            raise ValueError(f"controller {spec!r}: static:K needs an integer K >= 0")
        if k_max is not None and k > k_max:
            raise ValueError(f"controller {spec!r}: at most {k_max} draft tokens a step (the "
                             "MTP adapter's k, or what the TTFT budget allows)")
        return lambda: StaticK(k)
    raise ValueError(f"unknown controller {spec!r}: cascade, speq, heuristic, static:K or a "
                     "callable returning a specmoe.speculation.controllers.Controller")

"""The tau tables an engine owns (:class:`TauTables`): tau(g), the target forward's cost over g
tokens relative to one, per batch size (the gamma-tolerance paper, section 3.1).  Filled by
:mod:`specmoe.speculation.tau`; kept here, below both the engines and the speculation code."""
from __future__ import annotations

from typing import Dict

__all__ = ["TauTables"]


class TauTables(Dict[int, Dict[int, float]]):
    """tau(g) tables of one model, one per batch size: ``{batch: {g: tau}}`` (a dict).  An
    engine owns one (``engine.tau``) and clears it when its cache changes, since tau counts
    expert loads; :func:`specmoe.speculation.tau.target_tau` fills it, a caller may also
    store a table measured elsewhere (``engine.tau[4] = {...}``)."""

    def table(self, batch: int) -> Dict[int, float]:
        """The table at ``batch`` (empty until :func:`target_tau` measures it)."""
        return self.setdefault(int(batch), {})

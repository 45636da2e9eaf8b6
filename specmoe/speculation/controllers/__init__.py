"""Speculative-decoding control: how many draft tokens K to verify per iteration.

In an MoE, verifying K draft tokens touches the union of their experts, so speculation that
pays on a dense model can slow an MoE down.  The controllers here decide K from what each
iteration actually cost and yielded; all of them run in C (``csrc/spec/``, where the exact
state machines and every open choice are documented in ``controller.h``):

* :class:`StaticK` -- a fixed K.
* :class:`Heuristic` -- transformers' "heuristic" schedule (+2 after a fully accepted draft,
  -1 otherwise), the peer.
* :class:`Cascade` -- utility U = ETR / (t_iter_spec / t_iter_base) measured in test phases
  of up to M trials, then a set phase at the best K; K=0 with doubling back-off when U < 1.
* :class:`SpeqGovernor` -- MoE-SpeQ's k* = argmax E[N(k)] / T_cycle(k) with per-position
  acceptance EMAs and the caller's expected I/O cost of missing experts per k.

Every controller has ``next_k()``, ``observe(k, accepted, t_iter, experts_loaded=0)``,
``telemetry()`` and ``set_tau(tau)`` (gamma-tolerance pruning: K is allowed only when
(K+1) * tau(K+1) > 1, tau from :func:`measure_tau`).

One file per controller (``static.py``, ``heuristic.py``, ``cascade.py``, ``speq.py``); the
base class, :func:`speedup` and :func:`measure_tau` are in ``base.py``; the controllers by
name (:func:`controller_factory`) in ``factory.py``.  Drafters are in
:mod:`specmoe.speculation.drafters`, the acceptance rule in :mod:`specmoe.speculation.verify`, the loop in
:mod:`specmoe.speculation.generation`.
"""
from .base import PHASES, Controller, TauLike, measure_tau, measure_times, speedup
from .cascade import Cascade
from .factory import controller_factory
from .heuristic import Heuristic
from .speq import SpeqGovernor, ttft_k_max
from .static import StaticK

__all__ = ["PHASES", "Controller", "StaticK", "Heuristic", "Cascade", "SpeqGovernor",
           "TauLike", "controller_factory", "measure_tau", "measure_times", "speedup",
           "ttft_k_max"]

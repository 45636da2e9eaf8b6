"""specmoe: run Mixture-of-Experts models whose experts do not fit in fast memory.

Routed experts live in a slow tier (:class:`ExpertStore`, one safetensors-compatible file), a
bounded set of them in fast memory (:class:`ExpertCache`) under a pluggable eviction policy,
with a prefetch worker thread loading the experts predicted next.  The per-token paths run in
the C extension ``specmoe._C``; this package is the thin, typed Python surface over it.
"""
from __future__ import annotations

import os as _os
import sys as _sys

# torch's OpenMP workers spin-wait after every parallel region (libgomp's default policy) and
# so hold the cores that specmoe's kernel pool runs on next: measured on DeepSeek-V2-Lite
# shapes, int4, 2 threads, 27 tok/s spinning vs 30.5 passive; a 32-token prompt of a
# Qwen3.5-MoE GGUF file (benchmarks/hybrid_prefill.py's), 2 threads, AMD EPYC Zen 4, one-off:
# 115 ms a forward passive, 148-170 ms spinning.  libgomp reads the policy when torch is
# imported, so this default applies only when specmoe is imported first and the user has not
# chosen a policy; imported after torch with no policy chosen, specmoe says so once.
# (Processes started from here inherit the variable: a program on libgomp that is not torch,
# such as llama.cpp, then sleeps between its own regions; benchmarks/hostinfo.peer_env.)
if "torch" not in _sys.modules:
    _os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
elif "OMP_WAIT_POLICY" not in _os.environ:
    import warnings as _warnings

    _warnings.warn("specmoe was imported after torch with no OMP_WAIT_POLICY set: torch's "
                   "OpenMP workers will spin between their regions on the cores specmoe's "
                   "kernels need (a 32-token prompt 1.3-1.5x slower at 2 threads, measured).  "
                   "Import "
                   "specmoe before torch, or set OMP_WAIT_POLICY=PASSIVE in the environment; "
                   "set it to ACTIVE to keep the spinning and silence this.",
                   RuntimeWarning, stacklevel=2)

from ._moved import MOVED as _MOVED, MovedModuleError, install as _install_moved
from ._moved import moved_error as _moved_error

_install_moved()  # ``import specmoe.hf`` and the like name their new module

from ._C import CacheError, PolicyError, SpecmoeError, StoreError
from .storage.store import ExpertStore, StorePathError, write_store  # slow tier
from .storage.conversion import CheckpointError  # a checkpoint that cannot be converted
from .sim.traces import Trace, TraceError, load_puffin, load_trace
from .runtime.cache import ExpertCache, parse_capacity
from .runtime.policies import (FIFO, LFU, LRU, MRU, Belady, LeastStale, PolicySpec,
                               PythonPolicy, Random, make_policy)
from .runtime.policies import FLD, LHU, Score, SpAc, SpAcEMA
from .runtime import kernels  # expert FFN kernels (specmoe.kernels stays a public name)
from .storage import quant  # weight formats (specmoe.quant likewise)
from .speculation.controllers import (Cascade, Heuristic, SpeqGovernor, StaticK,  # speculation
                                      measure_tau, speedup)
from .speculation.ngram import NgramDrafter
from .sim.hardware import Hardware, ModelCost  # simulator time model
from .sim.replay import Predictor, SimResult, simulate  # trace-driven simulator
from .sim.sweep import sweep  # simulator sweeps

from .version import __version__  # noqa: E402  (the one place it is written)


# speculative decoding on transformers models (torch): public name -> its module
_SPECULATIVE = {"generate": "generation", "DraftModel": "drafters", "SelfDraft": "drafters",
                "Sampling": "sampling", "GenerateOutput": "decoding",
                "measure_tau_grid": "tau"}


_HF_EXTRA = ("torch", "transformers", "safetensors", "accelerate")


def __getattr__(name: str):  # HF integration loaded on first use (it imports torch)
    try:
        return _lazy(name)
    except ModuleNotFoundError as e:
        if (e.name or "").split(".")[0] not in _HF_EXTRA:
            raise
        raise ModuleNotFoundError(
            f"specmoe.{name} needs {e.name}, which is not installed: it runs transformers "
            "models, install the 'hf' extra (pip install 'specmoe[hf]').  The store, cache, "
            "kernels and simulator work without it.", name=e.name) from e


def _lazy(name: str):
    if name in ("offload", "Engine", "engine_of", "UnsupportedModelError"):
        from .runtime import engine
        return getattr(engine, name)
    if name in ("from_pretrained", "convert"):  # checkpoints larger than memory
        from .models import pretrained
        return getattr(pretrained, name)
    if name in ("MtpDrafter", "MtpAdapter"):  # multi-token prediction with gated LoRA
        from .speculation import mtp
        return getattr(mtp, name)
    if name in _SPECULATIVE:
        import importlib
        return getattr(importlib.import_module(f".speculation.{_SPECULATIVE[name]}", __name__),
                       name)
    if name in _MOVED:  # a module of the pre-0.2 flat layout
        raise _moved_error(name)
    raise AttributeError(f"module 'specmoe' has no attribute {name!r}")


__all__ = [
    "SpecmoeError",
    "MovedModuleError",
    "StoreError",
    "StorePathError",
    "CheckpointError",
    "CacheError",
    "PolicyError",
    "ExpertStore",
    "write_store",
    "Trace",
    "TraceError",
    "load_puffin",
    "load_trace",
    "ExpertCache",
    "parse_capacity",
    "PolicySpec",
    "LRU",
    "LFU",
    "FIFO",
    "MRU",
    "Random",
    "LeastStale",
    "Belady",
    "SpAc",
    "SpAcEMA",
    "LHU",
    "FLD",
    "Score",
    "PythonPolicy",
    "make_policy",
    "StaticK",
    "Heuristic",
    "Cascade",
    "SpeqGovernor",
    "NgramDrafter",
    "measure_tau",
    "speedup",
    "Hardware",
    "ModelCost",
    "Predictor",
    "SimResult",
    "simulate",
    "sweep",
    "offload",
    "from_pretrained",
    "convert",
    "engine_of",
    "Engine",
    "generate",
    "DraftModel",
    "SelfDraft",
    "MtpDrafter",
    "MtpAdapter",
    "Sampling",
    "GenerateOutput",
    "measure_tau_grid",
]

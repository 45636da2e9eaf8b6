"""Module names of the flat layout before 0.2 and where their code lives now.

``import specmoe.hf`` (or ``from specmoe import hf``) raises :class:`MovedModuleError`
naming the new module, rather than a bare "No module named": the public names of
``specmoe`` itself (``specmoe.offload``, ``specmoe.generate``, ``specmoe.kernels``, ...) keep
working unchanged.
"""
from __future__ import annotations

import sys
from importlib.abc import MetaPathFinder
from typing import Any

__all__ = ["MOVED", "MovedModuleError", "install"]

MOVED = {
    "arch": "specmoe.models.arch",
    "attention": "specmoe.models.attention",
    "cache": "specmoe.runtime.cache",
    "controllers": "specmoe.speculation.controllers",
    "conversion": "specmoe.storage.conversion",
    "cuda": "specmoe.runtime.cuda",
    "decode_step": "specmoe.models.decode_step",
    "dense": "specmoe.models.dense",
    "drafters": "specmoe.speculation.drafters",
    "expert_copy": "specmoe.runtime.expert_copy",
    "generation": "specmoe.speculation.generation",
    "generation_batch": "specmoe.speculation.batch",
    "gpu_engine": "specmoe.runtime.gpu_engine",
    "hardware": "specmoe.sim.hardware",
    "hf": "specmoe.runtime.engine",
    "kvcache": "specmoe.runtime.kvcache",
    "lookahead": "specmoe.runtime.lookahead",
    "misses": "specmoe.runtime.misses",
    "mla": "specmoe.models.mla",
    "mtp": "specmoe.speculation.mtp",
    "policies": "specmoe.runtime.policies",
    "pretrained": "specmoe.models.pretrained",
    "recording": "specmoe.runtime.recording",
    "sampling": "specmoe.speculation.sampling",
    "spec": "specmoe.speculation (controllers, drafters, verify)",
    "speculative": "specmoe.speculation (generation, drafters)",
    "store": "specmoe.storage.store",
    "sweep": "specmoe.sim.sweep",
    "testing": "specmoe.models.testing",
    "traces": "specmoe.sim.traces",
    "verify": "specmoe.speculation.verify",
}
# kernels and quant stay attributes of specmoe (public); only their import path moved
MOVED_PATHS = {**MOVED, "kernels": "specmoe.runtime.kernels", "quant": "specmoe.storage.quant"}


class MovedModuleError(ModuleNotFoundError):
    """A module of the pre-0.2 flat layout was imported; the message names its new home."""


def moved_error(old: str) -> MovedModuleError:
    """The error for the old module ``specmoe.<old>`` (or a submodule of it)."""
    top = old.split(".")[0]
    return MovedModuleError(f"specmoe.{old} moved to {MOVED_PATHS[top]} "
                            "(the package is laid out by concern since 0.2: "
                            "docs/architecture.md)", name=f"specmoe.{old}")


class _MovedFinder(MetaPathFinder):
    """Raises :class:`MovedModuleError` for ``specmoe.<old>`` and its submodules."""

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> None:
        pkg, _, rest = fullname.partition(".")
        if pkg == "specmoe" and rest.split(".")[0] in MOVED_PATHS:
            raise moved_error(rest)
        return None


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once)."""
    if not any(isinstance(f, _MovedFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _MovedFinder())

"""Type stubs for the specmoe._C extension.  One section per area."""
from __future__ import annotations

import os
from typing import Any

import numpy as np

class SpecmoeError(RuntimeError): ...
class StoreError(SpecmoeError): ...
class CacheError(SpecmoeError): ...
class PolicyError(SpecmoeError): ...

# --- store ---
def crc32c(data: Any, crc: int = 0) -> int:
    """CRC32C (Castagnoli) of a contiguous buffer, continuing from `crc`."""
def _crc32c_portable(data: Any, crc: int = 0) -> int:
    """CRC32C through the table path only (tests)."""

class Store:
    """Low-level reader of fixed-size expert blocks; see specmoe.ExpertStore."""
    def __init__(self, path: str | os.PathLike[str], data_offset: int, block_bytes: int,
                 num_layers: int, num_experts: int, crc: Any = None, direct: bool = False,
                 verify: bool = True) -> None: ...
    def read(self, layer: int, expert: int, out: Any = None) -> np.ndarray: ...
    def close(self) -> None: ...
    @property
    def path(self) -> str: ...
    @property
    def num_layers(self) -> int: ...
    @property
    def num_experts(self) -> int: ...
    @property
    def block_bytes(self) -> int: ...
    @property
    def data_offset(self) -> int: ...
    @property
    def direct(self) -> bool: ...
    @property
    def verify(self) -> bool: ...
    @property
    def bytes_read(self) -> int: ...
    @property
    def closed(self) -> bool: ...
# --- end store ---

# --- sim ---
def simulate(experts: np.ndarray, num_experts: int, policy: Any, nslots: int, *,
             logits: np.ndarray | None = None, predictor: int = 0, depth: int = 1, topk: int = 0,
             percentile: float = 0.0, history: int = 16, cooc_weight: float = 0.8,
             expert_bytes: float, fast_bw: float, link_bw: float, link_latency_s: float,
             layer_fixed_s: float = 0.0, token_fixed_s: float = 0.0, seed: int = 0,
             order: int = 0) -> dict[str, float]:
    """Replay a routing trace through the simulated cache; see specmoe.sim.simulate."""

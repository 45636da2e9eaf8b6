"""Expert FFN kernels (C, ``specmoe._C.KernelContext``) from Python.

One call applies one routed expert to the tokens routed to it, reading its weights once::

    out[rows[t]] += scale[t] * down(act(gate(x[rows[t]]), up(x[rows[t]])))

Weights are in the canonical layout of :mod:`specmoe.storage.quant` (f32, bf16, int8, int4, int2,
or GGUF's Q8_0 / Q4_K / Q6_K / Q4_0 / Q5_K / IQ4_XS / Q4_1 /
Q2_K / Q3_K blocks as a GGUF file holds them) in a
byte block (a store block or :func:`pack_block`); :class:`FFNSpec` says where each tensor is.
The context owns a persistent thread pool and the ISA choice (AVX-512, AVX2, scalar, detected
at run time; ``SPECMOE_ISA=avx2`` or :func:`set_isa` forces a lower one).
"""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import _C
from ..storage.ggml_blocks import BLOCKS

__all__ = [
    "ACTIVATIONS",
    "FFNSpec",
    "GGUF_BLOCKS",
    "down_dtype_codes",
    "dtype_code",
    "pack_block",
    "ffn",
    "context",
    "set_isa",
    "isa",
    "set_num_threads",
    "num_threads",
]

ACTIVATIONS = ("silu", "gptoss")
_DT_CODE = {"f32": 0, "bf16": 1, "int8": 2, "int4": 3, "int2": 4,
            "q8_0": 5, "q4_k": 6, "q6_k": 7, "q4_0": 8, "q5_k": 9, "iq4_xs": 10,
            "q4_1": 11, "q2_k": 12, "q3_k": 13, "mxfp4": 14}
# GGUF block formats kept as a GGUF file holds them (csrc/kernels/ffn_blocks.c): dtype ->
# (columns, bytes) per block.  A store holds such a matrix as U8 [rows, cols / columns, bytes],
# which the last dimension names; the scales are inside the blocks.
GGUF_BLOCKS = BLOCKS
_BLOCK_OF_BYTES = {b: name for name, (_, b) in GGUF_BLOCKS.items()}
_ACT_CODE = {"silu": 0, "gptoss": 1}
# store schema dtype (either spelling) of the weight matrices -> kernel dtype; packed U8 is int4,
# or int2 when its scales are [rows, groups, 2] (scale, offset) pairs
_SCHEMA_WDT = {"f32": "f32", "float32": "f32", "bf16": "bf16", "bfloat16": "bf16",
               "i8": "int8", "int8": "int8", "u8": "int4", "uint8": "int4"}
_PACK = {"int4": 2, "int2": 4}  # values per byte of the packed formats
_NAMES = ("gate", "up", "down", "gate.scale", "up.scale", "down.scale",
          "gate.bias", "up.bias", "down.bias")
_ALIGN = 64


@dataclass(frozen=True)
class FFNSpec:
    """Shapes, dtype, activation and tensor byte offsets of one expert block.

    ``offsets`` maps canonical names (``gate``, ``up``, ``down``, ``<name>.scale``,
    ``<name>.bias``) to byte offsets inside the block; ``block_bytes`` bounds them."""

    H: int
    I: int
    dtype: str
    offsets: Mapping[str, int]
    block_bytes: int
    activation: str = "silu"
    alpha: float = 1.702
    limit: float = 7.0
    group: int = 128
    precise: bool = False
    down_dtype: str | None = None  # the down matrix's dtype where it differs (GGUF blocks)
    _desc: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.dtype not in _DT_CODE:
            raise ValueError(f"unknown expert dtype {self.dtype!r}; expected one of "
                             f"{tuple(_DT_CODE)}")
        if self.down_dtype is not None and self.down_dtype != self.dtype and not (
                self.dtype in GGUF_BLOCKS and self.down_dtype in GGUF_BLOCKS):
            raise ValueError(f"down_dtype {self.down_dtype!r} differs from dtype "
                             f"{self.dtype!r}: only the GGUF block formats "
                             f"{tuple(GGUF_BLOCKS)} may mix")
        if self.activation not in _ACT_CODE:
            raise ValueError(f"unknown activation {self.activation!r}; expected one of "
                             f"{ACTIVATIONS}")
        for k in self.offsets:
            if k not in _NAMES:
                raise ValueError(f"unknown expert tensor {k!r}")
        d: dict[str, Any] = {"H": self.H, "I": self.I, "dtype": _DT_CODE[self.dtype],
                             "act": _ACT_CODE[self.activation], "alpha": float(self.alpha),
                             "limit": float(self.limit), "group": int(self.group),
                             "precise": int(bool(self.precise)),
                             "down_dtype": _DT_CODE[self.down_dtype or self.dtype]}
        for k in _NAMES:
            d[k.replace(".", "_")] = self.offsets.get(k)
        self._desc.update(d)

    def desc(self) -> dict[str, Any]:
        """The descriptor dict ``_C.KernelContext.ffn_forward`` takes (offsets; None = absent)."""
        return self._desc

    @property
    def weight_bytes(self) -> int:
        """Bytes of the three weight matrices plus scales (what one call streams)."""
        if self.dtype in GGUF_BLOCKS:
            def mat(dt: str, rows: int, cols: int) -> int:
                c, b = GGUF_BLOCKS[dt]
                return rows * (cols // c) * b
            return (2 * mat(self.dtype, self.I, self.H)
                    + mat(self.down_dtype or self.dtype, self.H, self.I))
        per = {"f32": 4.0, "bf16": 2.0, "int8": 1.0, "int4": 0.5, "int2": 0.25}[self.dtype]
        n = 3 * self.H * self.I
        extra = 0
        if self.dtype == "int8":
            extra = 4 * (2 * self.I + self.H)
        elif self.dtype == "int4":
            extra = 4 * (3 * self.H * self.I // self.group)
        elif self.dtype == "int2":
            extra = 8 * (3 * self.H * self.I // self.group)
        return int(n * per) + extra

    @classmethod
    def from_store_schema(cls, entries: Sequence[Mapping[str, Any]], block_bytes: int | None = None,
                          activation: str = "silu", alpha: float = 1.702,
                          limit: float = 7.0, precise: bool = False) -> FFNSpec:
        """Spec from a store's per-block schema (``[{"name", "dtype", "shape", "offset",
        "nbytes"}]``, names as in :func:`specmoe.storage.quant.expert_tensors`; ``__pad__*`` entries
        are ignored).  ``block_bytes`` defaults to the end of the last tensor."""
        by: dict[str, Mapping[str, Any]] = {}
        for e in entries:
            name = e["name"]
            if name.startswith("__"):
                continue
            if name not in _NAMES:
                raise ValueError(f"store schema: tensor {name!r} is not an expert FFN tensor "
                                 f"(expected {', '.join(_NAMES)})")
            by[name] = e
        for req in ("gate", "up", "down"):
            if req not in by:
                raise ValueError(f"store schema: missing tensor {req!r}")
        wdt = {n: str(by[n]["dtype"]).lower() for n in ("gate", "up", "down")}
        if any(len(by[n]["shape"]) == 3 for n in ("gate", "up", "down")):
            return _block_schema(by, block_bytes, activation=activation, alpha=alpha,
                                 limit=limit, precise=precise)
        if len(set(wdt.values())) != 1 or wdt["gate"] not in _SCHEMA_WDT:
            raise ValueError(f"store schema: gate/up/down dtypes {wdt} must be equal and one of "
                             f"F32, BF16, I8, U8 (int4 or int2)")
        dtype = _SCHEMA_WDT[wdt["gate"]]
        if dtype == "int4" and "gate.scale" in by and len(by["gate.scale"]["shape"]) == 3:
            dtype = "int2"
        gs = [int(s) for s in by["gate"]["shape"]]
        if len(gs) != 2:
            raise ValueError(f"store schema: gate must be 2-D, got shape {gs}")
        pack = _PACK.get(dtype, 1)
        I = gs[0]
        H = gs[1] * pack
        cols = {"gate": H, "up": H, "down": I}
        rows = {"gate": I, "up": I, "down": H}
        group = 128
        for n in ("gate", "up", "down"):
            want = [rows[n], cols[n] // pack]
            if [int(s) for s in by[n]["shape"]] != want:
                raise ValueError(f"store schema: {n} has shape {list(by[n]['shape'])}, expected "
                                 f"{want}")
        quant = dtype in ("int8", "int4", "int2")
        for n in ("gate", "up", "down"):
            sn = n + ".scale"
            if quant and sn not in by:
                raise ValueError(f"store schema: {dtype} needs tensor {sn!r}")
            if not quant and sn in by:
                raise ValueError(f"store schema: {sn!r} given for unquantized dtype {dtype}")
            if quant:
                e = by[sn]
                if str(e["dtype"]).lower() not in ("f32", "float32"):
                    raise ValueError(f"store schema: {sn} must be F32, got {e['dtype']}")
                shp = [int(s) for s in e["shape"]]
                if dtype == "int8":
                    if shp != [rows[n]]:
                        raise ValueError(f"store schema: {sn} has shape {shp}, expected "
                                         f"{[rows[n]]}")
                else:
                    tail = [2] if dtype == "int2" else []
                    if (len(shp) != 2 + len(tail) or shp[0] != rows[n] or shp[1] <= 0
                            or cols[n] % shp[1] or shp[2:] != tail):
                        raise ValueError(f"store schema: {sn} has shape {shp}, expected "
                                         f"{[rows[n], f'{cols[n]}/group'] + tail}")
                    g = cols[n] // shp[1]
                    if n == "gate":
                        group = g
                    elif g != group:
                        raise ValueError(f"store schema: {sn} implies group {g}, gate uses "
                                         f"{group}")
            bn = n + ".bias"
            if bn in by:
                e = by[bn]
                if str(e["dtype"]).lower() not in ("f32", "float32"):
                    raise ValueError(f"store schema: {bn} must be F32, got {e['dtype']}")
                if [int(s) for s in e["shape"]] != [rows[n]]:
                    raise ValueError(f"store schema: {bn} has shape {list(e['shape'])}, "
                                     f"expected {[rows[n]]}")
        offsets = {n: int(e["offset"]) for n, e in by.items()}
        end = max(int(e["offset"]) + int(e["nbytes"]) for e in by.values())
        return cls(H=H, I=I, dtype=dtype, offsets=offsets,
                   block_bytes=int(block_bytes) if block_bytes is not None else end,
                   activation=activation, alpha=alpha, limit=limit, group=group,
                   precise=precise)


def _block_schema(by: Mapping[str, Mapping[str, Any]], block_bytes: int | None, *,
                  activation: str, alpha: float, limit: float, precise: bool) -> FFNSpec:
    """FFNSpec.from_store_schema for GGUF block weights: U8 [rows, blocks, block bytes]."""
    kinds: dict[str, str] = {}
    for n in ("gate", "up", "down"):
        e = by[n]
        shp = [int(s) for s in e["shape"]]
        if str(e["dtype"]).lower() not in ("u8", "uint8") or len(shp) != 3 \
                or shp[2] not in _BLOCK_OF_BYTES:
            raise ValueError(f"store schema: {n} is {e['dtype']} {shp}; GGUF block weights are "
                             f"U8 [rows, blocks, bytes] with bytes one of "
                             f"{sorted(_BLOCK_OF_BYTES)} ({', '.join(GGUF_BLOCKS)}), and all "
                             f"three matrices must be block weights")
        kinds[n] = _BLOCK_OF_BYTES[shp[2]]
        if n + ".scale" in by:
            raise ValueError(f"store schema: {n}.scale given for GGUF block weights (their "
                             f"scales are inside the blocks)")
    if kinds["gate"] != kinds["up"]:
        raise ValueError(f"store schema: gate is {kinds['gate']} but up is {kinds['up']}")
    g = by["gate"]["shape"]
    I, H = int(g[0]), int(g[1]) * GGUF_BLOCKS[kinds["gate"]][0]
    for n, rows, cols in (("gate", I, H), ("up", I, H), ("down", H, I)):
        c, b = GGUF_BLOCKS[kinds[n]]
        want = [rows, cols // c, b]
        if cols % c or [int(s) for s in by[n]["shape"]] != want:
            raise ValueError(f"store schema: {n} has shape {list(by[n]['shape'])}, expected "
                             f"{want} ({kinds[n]} blocks of {c} columns)")
    for n, rows in (("gate", I), ("up", I), ("down", H)):
        bn = n + ".bias"
        if bn in by:
            e = by[bn]
            if str(e["dtype"]).lower() not in ("f32", "float32") \
                    or [int(s) for s in e["shape"]] != [rows]:
                raise ValueError(f"store schema: {bn} must be F32 [{rows}], got {e['dtype']} "
                                 f"{list(e['shape'])}")
    offsets = {n: int(e["offset"]) for n, e in by.items()}
    end = max(int(e["offset"]) + int(e["nbytes"]) for e in by.values())
    return FFNSpec(H=H, I=I, dtype=kinds["gate"], offsets=offsets,
                   block_bytes=int(block_bytes) if block_bytes is not None else end,
                   activation=activation, alpha=alpha, limit=limit, precise=precise,
                   down_dtype=kinds["down"] if kinds["down"] != kinds["gate"] else None)


def dtype_code(name: str) -> int:
    """The C kernels' code (``smoe_wdtype``) of weight format ``name``: ``f32``, ``bf16``,
    ``int8``, ``int4``, ``int2`` or a GGUF block kind (:data:`GGUF_BLOCKS`)."""
    try:
        return _DT_CODE[name]
    except KeyError:
        raise ValueError(f"unknown weight format {name!r}: one of {', '.join(_DT_CODE)}") \
            from None


def down_dtype_codes(kinds: Sequence[str] | None, num_layers: int) -> list[int] | None:
    """``_C.Layers.set_down_dtypes``'s codes for a GGUF block store's per-layer down formats
    (its header's ``gguf_down_kinds``), or None when the store has none."""
    if kinds is None:
        return None
    if len(kinds) != num_layers or any(k not in GGUF_BLOCKS for k in kinds):
        raise ValueError(f"store: gguf_down_kinds {list(kinds)!r} must name one of "
                         f"{tuple(GGUF_BLOCKS)} for each of the {num_layers} MoE layers")
    return [_DT_CODE[k] for k in kinds]


_NP_SCHEMA = {np.dtype(np.float32): "F32", np.dtype(np.uint16): "BF16",
              np.dtype(np.int8): "I8", np.dtype(np.uint8): "U8"}


def pack_block(tensors: Mapping[str, np.ndarray]) -> tuple[np.ndarray, list[dict[str, Any]]]:
    """Lay canonical expert tensors out in one uint8 block, each at a 64-byte aligned offset,
    in dict order.  Returns (block, schema entries like a store's)."""
    entries: list[dict[str, Any]] = []
    arrays = []
    off = 0
    for name, a in tensors.items():
        a = np.ascontiguousarray(a)
        if a.dtype not in _NP_SCHEMA:
            raise ValueError(f"tensor {name!r}: unsupported dtype {a.dtype}")
        off = -(-off // _ALIGN) * _ALIGN
        entries.append({"name": name, "dtype": _NP_SCHEMA[a.dtype], "shape": list(a.shape),
                        "offset": off, "nbytes": int(a.nbytes)})
        arrays.append((off, a))
        off += a.nbytes
    block = np.zeros(max(off, 1), dtype=np.uint8)
    for o, a in arrays:
        block[o:o + a.nbytes] = a.reshape(-1).view(np.uint8)
    return block, entries


def tensor_array(t: Any, convert: bool = False) -> np.ndarray | None:
    """A contiguous CPU torch tensor as the numpy array the C kernels take, sharing its memory:
    float32 as it is, bfloat16 as its int16 bit patterns; another dtype becomes a float32 copy
    when ``convert``, else None (the caller takes another path)."""
    import torch
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy()
    if t.dtype == torch.float32:
        return t.numpy()
    return t.float().numpy() if convert else None


_CTX: _C.KernelContext | None = None


def context() -> _C.KernelContext:
    """The process-wide default kernel context (created on first use, all cores)."""
    global _CTX
    if _CTX is None:
        _CTX = _C.KernelContext(0)
    return _CTX


def set_isa(name: str) -> None:
    """Use ``"avx512"``, ``"avx2"``, ``"scalar"`` or ``"auto"`` (best supported) in the default
    context; ValueError if this CPU lacks it."""
    context().set_isa(name)


def isa() -> str:
    """ISA the default context uses."""
    return context().isa


def set_num_threads(n: int) -> None:
    """Threads of the default context per call (0: all cores)."""
    context().set_threads(int(n))


def num_threads() -> int:
    return context().threads


def ffn(tensors_or_block: Mapping[str, np.ndarray] | np.ndarray, x: np.ndarray,
        dtype: str | None = None, activation: str = "silu", *, spec: FFNSpec | None = None,
        rows: np.ndarray | Sequence[int] | None = None,
        scale: np.ndarray | Sequence[float] | None = None, out: np.ndarray | None = None,
        alpha: float = 1.702, limit: float = 7.0, precise: bool = False,
        ctx: _C.KernelContext | None = None) -> np.ndarray:
    """Run one expert FFN through the C kernel.

    ``tensors_or_block`` is a canonical tensor dict (:func:`specmoe.storage.quant.expert_tensors`;
    ``dtype`` optional, checked if given) or a uint8 block with its ``spec``.  ``x`` is f32
    [N, H] (or [H]).  Returns ``out`` ([N, H] f32, zeros if not given) after
    ``out[rows[t]] += scale[t] * FFN(x[rows[t]])`` (rows default: all of x).
    ``precise=True`` forces exact f32 math on the widened weights (the default fast path
    rounds activations for bf16/int dot products; bounds in csrc/kernels/kernels.h).
    """
    if isinstance(tensors_or_block, Mapping):
        block, entries = pack_block(tensors_or_block)
        spec = FFNSpec.from_store_schema(entries, block_bytes=block.nbytes,
                                         activation=activation, alpha=alpha, limit=limit,
                                         precise=precise)
        if dtype is not None and dtype != spec.dtype:
            raise ValueError(f"dtype {dtype!r} given but the tensors are {spec.dtype}")
    else:
        if spec is None:
            raise ValueError("a raw block needs spec=FFNSpec(...)")
        block = np.asarray(tensors_or_block)
        if block.dtype != np.uint8 or block.ndim != 1:
            raise ValueError(f"block must be a 1-D uint8 array, got {block.dtype} {block.shape}")
    xa = np.asarray(x)
    if xa.dtype != np.float32:
        raise ValueError(f"x must be float32, got {xa.dtype}")
    one = xa.ndim == 1
    x2 = np.ascontiguousarray(xa.reshape(1, -1) if one else xa)
    if x2.ndim != 2 or x2.shape[1] != spec.H:
        raise ValueError(f"x has shape {xa.shape}, expected [N, {spec.H}] (hidden size H)")
    if out is None:
        out2 = np.zeros_like(x2)
    else:
        out2 = out.reshape(1, -1) if (one and out.ndim == 1) else out
    r = None if rows is None else np.ascontiguousarray(np.asarray(rows, dtype=np.int64))
    if r is not None:
        if r.ndim != 1:
            raise ValueError("rows must be 1-D")
        if r.size and (r.min() < 0 or r.max() >= x2.shape[0]):
            raise ValueError(f"rows must index x's {x2.shape[0]} rows")
        r = r.astype(np.int32)
    s = None if scale is None else np.ascontiguousarray(np.asarray(scale, dtype=np.float32))
    (ctx or context()).ffn_forward(spec.desc(), block, x2, out2, r, s)
    return out2.reshape(-1) if (one and out is None) else out if out is not None else out2


def weight_bytes_per_token(spec: FFNSpec) -> int:
    """Bytes one call streams (weights + scales), independent of the token count."""
    return spec.weight_bytes


del math

"""Weight formats of the expert kernels: bf16 conversion, int8, int4 and int2 quantization, and the
canonical expert tensor dict the store writer stores.

Canonical expert (see ``csrc/kernels/kernels.h``): ``gate`` [I, H], ``up`` [I, H], ``down``
[H, I], row-major, one row per output element; optional f32 biases ``gate.bias`` [I],
``up.bias`` [I], ``down.bias`` [H].  Per dtype:

* ``"f32"``: float32 weights.
* ``"bf16"``: uint16 bfloat16 bit patterns (round to nearest even).  Declare them to
  :func:`specmoe.storage.store.write_store` with ``dtypes=store_dtypes(tensors)``.
* ``"int8"``: int8 weights in [-127, 127] and ``<name>.scale`` f32 [rows]; w = q * scale[row].
* ``"int4"``: packed uint8 [rows, cols/2] and ``<name>.scale`` f32 [rows, cols/group]; a value
  u in [1, 15] per nibble, column 2j in the low nibble of byte j, 2j+1 in the high nibble;
  w = (u - 8) * scale[row, col // group].  ``group`` is a multiple of 32 dividing H and I.
* ``"int2"``: packed uint8 [rows, cols/4] and ``<name>.scale`` f32 [rows, cols/group, 2]
  holding (scale s, offset m) per group; w = u * s + m with u in [0, 3] (asymmetric, HQQ-style:
  SpecMD's int2 fallback level).  Planar packing per 64 columns: byte j of a block's 16 bytes
  holds columns 16i + j of the block in bits 2i..2i+1.  ``group`` is a multiple of 64 dividing
  H and I (64 by default: 3 bits per weight with the f32 pair).
"""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

__all__ = [
    "DTYPES",
    "f32_to_bf16",
    "bf16_to_f32",
    "quantize_int8",
    "dequantize_int8",
    "quantize_int4",
    "dequantize_int4",
    "quantize_int2",
    "dequantize_int2",
    "pick_group",
    "expert_tensors",
    "dequantize_expert",
    "store_dtypes",
]

DTYPES = ("f32", "bf16", "int8", "int4", "int2")


def f32_to_bf16(a: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest, ties to even; NaN stays NaN."""
    a = np.ascontiguousarray(a, dtype=np.float32)
    b = a.view(np.uint32)
    rounded = (b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    nan = np.isnan(a)
    out = rounded.astype(np.uint16)
    if nan.any():
        out[nan] = ((b[nan] >> np.uint32(16)) | np.uint32(0x0040)).astype(np.uint16)
    return out


def bf16_to_f32(a: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32 (exact)."""
    a = np.ascontiguousarray(a, dtype=np.uint16)
    return (a.astype(np.uint32) << np.uint32(16)).view(np.float32)


def _matrix(w: np.ndarray, name: str) -> np.ndarray:
    w = np.asarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"{name} must be a 2-D matrix, got shape {w.shape}")
    if not np.isfinite(w).all():
        raise ValueError(f"{name} has non-finite values")
    return np.ascontiguousarray(w)


def quantize_int8(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 per output row: returns (q int8 [rows, cols], scale f32 [rows]) with
    w ~= q * scale[:, None], scale = max|row| / 127 (0 for an all-zero row)."""
    w = _matrix(w, "w")
    amax = np.abs(w).max(axis=1)
    scale = (amax / 127.0).astype(np.float32)
    safe = np.where(scale > 0, scale, 1.0).astype(np.float32)
    q = np.clip(np.rint(w / safe[:, None]), -127, 127).astype(np.int8)
    return q, scale


def dequantize_int8(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Inverse of :func:`quantize_int8` (float32)."""
    return q.astype(np.float32) * np.asarray(scale, dtype=np.float32)[:, None]


def _grouped(w: np.ndarray, group: int, name: str, mult: int) -> np.ndarray:
    """``w`` as an f32 matrix whose columns split into groups of ``group`` (a positive multiple
    of ``mult``), or ValueError naming the format."""
    w = _matrix(w, "w")
    if group <= 0 or group % mult:
        raise ValueError(f"{name} group size must be a positive multiple of {mult}, got {group}")
    if w.shape[1] % group:
        raise ValueError(f"{name}: {w.shape[1]} columns are not a multiple of the group size "
                         f"{group}")
    return w


def quantize_int4(w: np.ndarray, group: int = 128) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int4 in groups of ``group`` columns: returns (packed uint8 [rows, cols/2],
    scale f32 [rows, cols/group]), scale = max|group| / 7, nibble u = q + 8 with q in [-7, 7];
    column 2j in the low nibble of byte j."""
    w = _grouped(w, group, "int4", 32)
    rows, cols = w.shape
    g = w.reshape(rows, cols // group, group)
    scale = (np.abs(g).max(axis=2) / 7.0).astype(np.float32)
    safe = np.where(scale > 0, scale, 1.0).astype(np.float32)
    q = np.clip(np.rint(g / safe[:, :, None]), -7, 7).astype(np.int16).reshape(rows, cols)
    u = (q + 8).astype(np.uint8)
    packed = (u[:, 0::2] | (u[:, 1::2] << np.uint8(4))).astype(np.uint8)
    return np.ascontiguousarray(packed), scale


def dequantize_int4(packed: np.ndarray, scale: np.ndarray, group: int | None = None) -> np.ndarray:
    """Inverse of :func:`quantize_int4` (float32 [rows, 2*packed cols])."""
    packed = np.asarray(packed, dtype=np.uint8)
    scale = np.asarray(scale, dtype=np.float32)
    rows, half = packed.shape
    cols = 2 * half
    if group is None:
        group = cols // scale.shape[1]
    q = np.empty((rows, cols), dtype=np.float32)
    q[:, 0::2] = (packed & 15).astype(np.float32) - 8
    q[:, 1::2] = (packed >> 4).astype(np.float32) - 8
    return (q.reshape(rows, cols // group, group) * scale[:, :, None]).reshape(rows, cols)


def quantize_int2(w: np.ndarray, group: int = 64,
                  iters: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """Asymmetric int2 in groups of ``group`` columns: returns (packed uint8 [rows, cols/4],
    scale f32 [rows, cols/group, 2] = (s, m)), w ~ u * s + m with u in [0, 3].

    Starts from the group's range (m = min, s = (max - min) / 3), then ``iters`` rounds of
    alternating least squares, as HQQ refines its zero point and scale: round u for the
    current (s, m), then refit (s, m) to minimise the group's squared error for those u.
    Each round can only lower the error (both steps are exact minimisers of their part)."""
    w = _grouped(w, group, "int2", 64)
    rows, cols = w.shape
    g = w.reshape(rows, cols // group, group).astype(np.float64)
    lo, hi = g.min(axis=2), g.max(axis=2)
    s, m = (hi - lo) / 3.0, lo

    def assign(s: np.ndarray, m: np.ndarray) -> np.ndarray:
        safe = np.where(s > 0, s, 1.0)
        u = np.rint((g - m[:, :, None]) / safe[:, :, None])
        return np.where(s[:, :, None] > 0, np.clip(u, 0, 3), 0.0)

    def err(u: np.ndarray, s: np.ndarray, m: np.ndarray) -> np.ndarray:
        return ((u * s[:, :, None] + m[:, :, None] - g) ** 2).sum(axis=2)

    u = assign(s, m)
    for _ in range(iters):
        mu, mw = u.mean(axis=2), g.mean(axis=2)
        var = ((u - mu[:, :, None]) ** 2).mean(axis=2)
        cov = ((u - mu[:, :, None]) * (g - mw[:, :, None])).mean(axis=2)
        s2 = np.where(var > 0, cov / np.where(var > 0, var, 1.0), 0.0)
        m2 = mw - s2 * mu
        better = err(u, s2, m2) < err(u, s, m)  # the refit is optimal; keep ties stable
        s, m = np.where(better, s2, s), np.where(better, m2, m)
        u2 = assign(s, m)
        better = err(u2, s, m) < err(u, s, m)
        u = np.where(better[:, :, None], u2, u)
    scale = np.stack([s, m], axis=2).astype(np.float32)
    # recompute u against the f32 (s, m) the kernels will use
    u = assign(scale[:, :, 0].astype(np.float64), scale[:, :, 1].astype(np.float64))
    u = u.astype(np.uint8).reshape(rows, cols // 64, 4, 16)  # [.., block, i, j]: column 16i + j
    packed = (u[:, :, 0] | (u[:, :, 1] << np.uint8(2)) | (u[:, :, 2] << np.uint8(4))
              | (u[:, :, 3] << np.uint8(6))).reshape(rows, cols // 4)
    return np.ascontiguousarray(packed.astype(np.uint8)), np.ascontiguousarray(scale)


def dequantize_int2(packed: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """Inverse of :func:`quantize_int2` (float32 [rows, 4*packed cols])."""
    packed = np.asarray(packed, dtype=np.uint8)
    scale = np.asarray(scale, dtype=np.float32)
    rows, quarter = packed.shape
    cols = 4 * quarter
    if scale.ndim != 3 or scale.shape[0] != rows or scale.shape[2] != 2 or cols % scale.shape[1]:
        raise ValueError(f"int2 scale must be [rows, cols/group, 2]; got {scale.shape} for "
                         f"{rows} x {cols}")
    group = cols // scale.shape[1]
    b = packed.reshape(rows, cols // 64, 1, 16)
    u = ((b >> (2 * np.arange(4, dtype=np.uint8))[None, None, :, None]) & 3)
    u = u.reshape(rows, cols // group, group).astype(np.float32)
    return (u * scale[:, :, None, 0] + scale[:, :, None, 1]).reshape(rows, cols)


def pick_group(H: int, I: int, dtype: str = "int4") -> int:
    """Largest group size dividing both H and I: among 128, 64, 32 for int4; for int2 64 (its
    default: 3 bits per weight) or else 128.  ValueError if none."""
    cands = (64, 128) if dtype == "int2" else (128, 64, 32)
    for g in cands:
        if H % g == 0 and I % g == 0:
            return g
    need = 64 if dtype == "int2" else 32
    raise ValueError(f"{dtype} needs H and I multiples of {need}; got H={H}, I={I}")


def expert_tensors(gate: np.ndarray, up: np.ndarray, down: np.ndarray, dtype: str,
                   biases: Mapping[str, np.ndarray] | None = None,
                   group: int | None = None) -> dict[str, np.ndarray]:
    """Canonical tensors of one expert in ``dtype`` (``f32``, ``bf16``, ``int8``, ``int4``,
    ``int2``).

    ``gate``/``up`` are [I, H] and ``down`` [H, I] (output rows).  ``biases`` maps any of
    ``gate``/``up``/``down`` to an f32 vector.  Keys of the result, in this order: ``gate``,
    ``up``, ``down``, then ``gate.scale``, ``up.scale``, ``down.scale`` (int8/int4), then the
    given ``<name>.bias``.  ``group`` (int4/int2 only) defaults to :func:`pick_group`.
    """
    if dtype not in DTYPES:
        raise ValueError(f"unknown expert dtype {dtype!r}; expected one of {DTYPES}")
    mats = {"gate": _matrix(gate, "gate"), "up": _matrix(up, "up"), "down": _matrix(down, "down")}
    I, H = mats["gate"].shape
    if mats["up"].shape != (I, H):
        raise ValueError(f"up has shape {mats['up'].shape}, expected {(I, H)} like gate")
    if mats["down"].shape != (H, I):
        raise ValueError(f"down has shape {mats['down'].shape}, expected {(H, I)}")
    out: dict[str, np.ndarray] = {}
    scales: dict[str, np.ndarray] = {}
    if dtype in ("int4", "int2"):
        if group is None:
            group = pick_group(H, I, dtype)
        for n, m in (("gate", H), ("up", H), ("down", I)):
            if m % group:
                raise ValueError(f"{dtype}: {n} has {m} input columns, not a multiple of the "
                                 f"group size {group}")
    elif group is not None:
        raise ValueError("group is only meaningful for int4 and int2")
    for name, w in mats.items():
        if dtype == "f32":
            out[name] = w
        elif dtype == "bf16":
            out[name] = f32_to_bf16(w)
        elif dtype == "int8":
            out[name], scales[name + ".scale"] = quantize_int8(w)
        elif dtype == "int4":
            out[name], scales[name + ".scale"] = quantize_int4(w, group)  # type: ignore[arg-type]
        else:
            out[name], scales[name + ".scale"] = quantize_int2(w, group)  # type: ignore[arg-type]
    out.update(scales)
    want = {"gate": I, "up": I, "down": H}
    for name, b in (biases or {}).items():
        if name not in want:
            raise ValueError(f"unknown bias {name!r}; expected gate, up or down")
        if b is None:
            continue
        b = np.ascontiguousarray(np.asarray(b, dtype=np.float32))
        if b.shape != (want[name],):
            raise ValueError(f"{name} bias has shape {b.shape}, expected ({want[name]},)")
        out[name + ".bias"] = b
    return out


def dequantize_expert(tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """f32 ``gate``, ``up``, ``down`` (and biases) of a canonical tensor dict, for references."""
    res: dict[str, np.ndarray] = {}
    for name in ("gate", "up", "down"):
        w = np.asarray(tensors[name])
        s = tensors.get(name + ".scale")
        if w.dtype == np.float32:
            res[name] = w
        elif w.dtype == np.uint16:
            res[name] = bf16_to_f32(w)
        elif w.dtype == np.int8:
            res[name] = dequantize_int8(w, s)  # type: ignore[arg-type]
        elif w.dtype == np.uint8 and w.ndim == 3:  # GGUF blocks kept as a file holds them
            from .ggml_blocks import dequantize
            res[name] = dequantize(w)
        elif w.dtype == np.uint8 and np.ndim(s) == 3:  # int2: (scale, offset) per group
            res[name] = dequantize_int2(w, s)  # type: ignore[arg-type]
        elif w.dtype == np.uint8:
            res[name] = dequantize_int4(w, s)  # type: ignore[arg-type]
        else:
            raise ValueError(f"{name}: unsupported array dtype {w.dtype}")
        if name + ".bias" in tensors:
            res[name + ".bias"] = np.asarray(tensors[name + ".bias"], dtype=np.float32)
    return res


def store_dtypes(tensors: Mapping[str, np.ndarray]) -> dict[str, str]:
    """The ``dtypes=`` declarations :func:`specmoe.storage.store.write_store` needs for these tensors
    (bf16 bit patterns held in uint16 arrays)."""
    return {k: "bf16" for k, v in tensors.items() if np.asarray(v).dtype == np.uint16}

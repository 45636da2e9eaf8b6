"""GGUF (ggml) block formats that a store keeps as a GGUF file holds them: Q8_0, Q4_K, Q6_K,
Q4_0, Q5_K, IQ4_XS, Q4_1 (also what asymmetric GPTQ / AWQ int4 is repacked onto,
:func:`q4_1_from_groups`), Q2_K, Q3_K, MXFP4 (GPT-OSS's expert format).

A matrix of such blocks is held as uint8 ``[rows, cols / block_cols, block_bytes]`` (34, 144,
210, 18, 176, 136, 20, 84, 110 or 17 bytes per block: the last dimension names the format,
:data:`BLOCKS`), exactly the bytes of the file's row; the C kernels
(``csrc/kernels/ffn_blocks.c``) read them as they are.

* :func:`dequantize` widens such a matrix to f32 through the ``gguf`` package (the reference
  the kernels are tested against).
* :func:`widen_to_q8_0` turns Q5_0 blocks (and Q4_0 ones) into Q8_0 blocks **without loss**
  (the same f16 scale, the same integer values: w = d * (q - 16) or d * (q - 8) is d * q' with
  q' in [-16, 15]): there is no Q5_0 kernel, and llama.cpp's fallback for K-quants on rows
  that are not a multiple of 256 columns (e.g. DeepSeek-V2-Lite's 1408) writes Q5_0.
* :func:`quantize_q4_k`, :func:`quantize_q5_k`, :func:`quantize_q6_k`, :func:`quantize_iq4_xs`,
  :func:`quantize_q4_1`, :func:`quantize_q2_k`, :func:`quantize_q3_k` and :func:`quantize_q8_0`
  (and :func:`quantize_q4_0` and :func:`quantize_mxfp4`, the ``gguf`` package's;
  :data:`QUANTIZERS` by kind) write valid
  blocks from f32 weights (simple per-sub-block rounding, not llama.cpp's
  search), for tests and tiny files; the ``gguf`` package's writer has no K-quant or IQ
  quantizer.
"""
from __future__ import annotations

import numpy as np

__all__ = ["BLOCKS", "TYPE_OF_GGML", "block_kind", "dequantize", "widen_to_q8_0",
           "quantize_q8_0", "quantize_q4_k", "quantize_q5_k", "quantize_q6_k",
           "quantize_iq4_xs", "quantize_q4_1", "q4_1_from_groups", "quantize_q2_k",
           "quantize_q3_k", "quantize_q4_0", "quantize_mxfp4", "mxfp4_from_hf", "QUANTIZERS"]

# kind -> (columns, bytes) per block
BLOCKS = {"q8_0": (32, 34), "q4_k": (256, 144), "q6_k": (256, 210), "q4_0": (32, 18),
          "q5_k": (256, 176), "iq4_xs": (256, 136), "q4_1": (32, 20),
          "q2_k": (256, 84), "q3_k": (256, 110), "mxfp4": (32, 17)}
# GGUF tensor type name -> the kept kind it maps onto without loss
TYPE_OF_GGML = {"Q8_0": "q8_0", "Q4_K": "q4_k", "Q6_K": "q6_k", "Q4_0": "q4_0", "Q5_K": "q5_k",
                "IQ4_XS": "iq4_xs", "Q5_0": "q8_0", "Q4_1": "q4_1",
                "Q2_K": "q2_k", "Q3_K": "q3_k", "MXFP4": "mxfp4"}
_KIND_OF_BYTES = {b: k for k, (_, b) in BLOCKS.items()}
_GGML_NAME = {"q8_0": "Q8_0", "q4_k": "Q4_K", "q6_k": "Q6_K", "q4_0": "Q4_0", "q5_k": "Q5_K",
              "iq4_xs": "IQ4_XS", "q4_1": "Q4_1", "q2_k": "Q2_K", "q3_k": "Q3_K",
              "mxfp4": "MXFP4"}


def block_kind(a: np.ndarray) -> str:
    """The kind (a key of :data:`BLOCKS`: ``q8_0``, ``q4_k``, ``q6_k``, ...) of a uint8
    [rows, blocks, bytes] matrix."""
    if a.dtype != np.uint8 or a.ndim != 3 or a.shape[2] not in _KIND_OF_BYTES:
        raise ValueError(f"not a GGUF block matrix: {a.dtype} {a.shape} (uint8 [rows, blocks, "
                         f"bytes] with bytes one of {sorted(_KIND_OF_BYTES)})")
    return _KIND_OF_BYTES[a.shape[2]]


def dequantize(a: np.ndarray) -> np.ndarray:
    """f32 [rows, cols] of a block matrix, as the ``gguf`` package dequantizes it."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize as gg

    kind = block_kind(a)
    rows = a.shape[0]
    out = gg(np.ascontiguousarray(a).reshape(rows, -1), GGMLQuantizationType[_GGML_NAME[kind]])
    return np.ascontiguousarray(out, dtype=np.float32)


def widen_to_q8_0(raw: np.ndarray, ggml_type: str) -> np.ndarray:
    """Rows of a GGUF tensor of type ``ggml_type`` (uint8 [rows, row bytes], as the gguf reader
    gives them) as Q8_0 blocks [rows, cols/32, 34], without loss: Q8_0 as it is, Q4_0 and
    Q5_0 with their f16 scale and their values moved into int8."""
    raw = np.ascontiguousarray(raw, dtype=np.uint8)
    rows = raw.shape[0]
    if ggml_type == "Q8_0":
        return raw.reshape(rows, -1, 34)
    if ggml_type == "Q4_0":
        b = raw.reshape(rows, -1, 18)
        qs = b[:, :, 2:].astype(np.int16)
        q = np.concatenate([(qs & 0x0F) - 8, (qs >> 4) - 8], axis=2)
    elif ggml_type == "Q5_0":
        b = raw.reshape(rows, -1, 22)
        qh = b[:, :, 2:6].copy().view("<u4")[:, :, 0].astype(np.int64)
        qs = b[:, :, 6:].astype(np.int16)
        j = np.arange(16)
        hi0 = ((qh[:, :, None] >> j) & 1).astype(np.int16) << 4
        hi1 = ((qh[:, :, None] >> (j + 16)) & 1).astype(np.int16) << 4
        q = np.concatenate([((qs & 0x0F) | hi0) - 16, ((qs >> 4) | hi1) - 16], axis=2)
    else:
        raise ValueError(f"{ggml_type} blocks do not widen to Q8_0 without loss")
    out = np.empty(b.shape[:2] + (34,), np.uint8)
    out[:, :, :2] = b[:, :, :2]
    out[:, :, 2:] = q.astype(np.int8).view(np.uint8)
    return out


def _f16_bytes(v: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(v.astype(np.float16)).view(np.uint8).reshape(v.shape + (2,))


def _rows(w: np.ndarray, cols_per_block: int) -> np.ndarray:
    w = np.ascontiguousarray(w, dtype=np.float32)
    if w.ndim != 2 or w.shape[1] % cols_per_block:
        raise ValueError(f"weights {w.shape}: need 2-D with columns a multiple of "
                         f"{cols_per_block}")
    if not np.isfinite(w).all():
        raise ValueError("weights hold NaN or infinity")
    return w


def quantize_q8_0(w: np.ndarray) -> np.ndarray:
    """[rows, cols] f32 -> Q8_0 blocks [rows, cols/32, 34] (d = max|x| / 127, as ggml)."""
    w = _rows(w, 32)
    x = w.reshape(w.shape[0], -1, 32)
    d = (np.abs(x).max(axis=2) / 127.0).astype(np.float16).astype(np.float32)
    inv = np.where(d > 0, 1.0 / np.where(d > 0, d, 1.0), 0.0)
    q = np.clip(np.rint(x * inv[:, :, None]), -127, 127).astype(np.int8)
    out = np.empty(x.shape[:2] + (34,), np.uint8)
    out[:, :, :2] = _f16_bytes(d)
    out[:, :, 2:] = q.view(np.uint8)
    return out


def quantize_q4_1(w: np.ndarray) -> np.ndarray:
    """[rows, cols] f32 -> Q4_1 blocks [rows, cols/32, 20] (d = (max - min) / 15, m = min, as
    ggml's reference quantizer)."""
    w = _rows(w, 32)
    x = w.reshape(w.shape[0], -1, 32)
    lo, hi = x.min(axis=2), x.max(axis=2)
    d = ((hi - lo) / 15.0).astype(np.float16).astype(np.float32)
    m = lo.astype(np.float16).astype(np.float32)
    inv = np.where(d > 0, 1.0 / np.where(d > 0, d, 1.0), 0.0)
    q = np.clip(np.rint((x - m[:, :, None]) * inv[:, :, None]), 0, 15).astype(np.uint8)
    return _q4_1_blocks(d, m, q)


def _q4_1_blocks(d: np.ndarray, m: np.ndarray, q: np.ndarray) -> np.ndarray:
    """Q4_1 blocks [rows, nb, 20] from scales d and offsets m [rows, nb] (rounded to f16) and
    values q uint8 [rows, nb, 32] in [0, 15] (columns 0..15 in the low nibbles)."""
    out = np.empty(q.shape[:2] + (20,), np.uint8)
    out[:, :, 0:2] = _f16_bytes(d)
    out[:, :, 2:4] = _f16_bytes(m)
    out[:, :, 4:] = q[:, :, :16] | (q[:, :, 16:] << 4)
    return out


def q4_1_from_groups(q: np.ndarray, zero: np.ndarray, scale: np.ndarray,
                     group: int) -> np.ndarray:
    """Asymmetric 4-bit groups (GPTQ / AWQ: w[o, k] = scale[o, k // group] * (q[o, k] -
    zero[o, k // group])) as Q4_1 blocks [rows, cols/32, 20], **repacked, not re-quantized**:
    every 32 columns of a group keep its values q, d = scale and m = -zero * scale.  d is
    exact where the scale is an f16 (GPTQ's and AWQ's are); m is rounded to f16 (relative
    error <= 2^-11 of the offset).  ``q`` uint8 [rows, cols] in [0, 15], ``zero`` and
    ``scale`` [rows, cols / group]; ``group`` a multiple of 32."""
    q = np.ascontiguousarray(q, dtype=np.uint8)
    rows, cols = q.shape
    if group % 32 or cols % group or zero.shape != (rows, cols // group) \
            or scale.shape != zero.shape:
        raise ValueError(f"q4_1_from_groups: q {q.shape}, zero {zero.shape}, scale "
                         f"{scale.shape}, group {group}: need groups a multiple of 32 that "
                         f"divide the columns, and one zero and scale per group")
    if int(q.max(initial=0)) > 15:
        raise ValueError("q4_1_from_groups: values above 15 are not 4-bit")
    rep = group // 32
    s = np.repeat(np.asarray(scale, np.float32), rep, axis=1)
    z = np.repeat(np.asarray(zero, np.float32), rep, axis=1)
    return _q4_1_blocks(s, -z * s, q.reshape(rows, -1, 32))


def quantize_q4_k(w: np.ndarray) -> np.ndarray:
    """[rows, cols] f32 -> Q4_K super-blocks [rows, cols/256, 144]: per 32 columns a 6-bit
    scale and min under the block's f16 d and dmin, w ~ d * sc * q - dmin * m, q in [0, 15]."""
    return _quantize_k(w, 4)


def quantize_q5_k(w: np.ndarray) -> np.ndarray:
    """[rows, cols] f32 -> Q5_K super-blocks [rows, cols/256, 176]: Q4_K's scales, mins and
    nibbles, then the fifth bits (``qh[l]`` bit j: column l of sub-block j), q in [0, 31]."""
    return _quantize_k(w, 5)


def _scale_min_quant(x: np.ndarray, top: int, smax: int
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The K-quants' rounding with mins (Q2_K, Q4_K, Q5_K) of ``x`` [R, B, sub-blocks,
    columns]: per sub-block a scale and a min in [0, smax] under the super-block's f16 d and
    dmin, values q in [0, top], w ~ d * sc * q - dmin * m.  Returns (d, dmin, sc, m, q)."""
    lo = np.minimum(x.min(axis=3), 0.0)
    scale = (x.max(axis=3) - lo) / top            # per sub-block, >= 0
    mn = -lo                                      # >= 0
    d = (scale.max(axis=2) / smax).astype(np.float16).astype(np.float32)
    dmin = (mn.max(axis=2) / smax).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(scale / np.where(d > 0, d, 1.0)[:, :, None]), 0, smax).astype(np.uint8)
    m = np.clip(np.rint(mn / np.where(dmin > 0, dmin, 1.0)[:, :, None]), 0, smax
                ).astype(np.uint8)
    step = d[:, :, None] * sc
    off = dmin[:, :, None] * m
    q = np.rint((x + off[..., None]) / np.where(step > 0, step, 1.0)[..., None])
    q = np.clip(np.where(step[..., None] > 0, q, 0), 0, top).astype(np.uint8)
    return d, dmin, sc, m, q


def _quantize_k(w: np.ndarray, bits: int) -> np.ndarray:
    w = _rows(w, 256)
    x = w.reshape(w.shape[0], -1, 8, 32)
    d, dmin, sc, m, q = _scale_min_quant(x, (1 << bits) - 1, 63)
    qo = 16 if bits == 4 else 48                  # Q5_K: qh[32] between the scales and qs
    out = np.zeros(x.shape[:2] + (qo + 128,), np.uint8)
    out[:, :, 0:2] = _f16_bytes(d)
    out[:, :, 2:4] = _f16_bytes(dmin)
    s = out[:, :, 4:16]
    for j in range(4):  # the inverse of ggml's get_scale_min_k4
        s[:, :, j] = (sc[:, :, j] & 63) | ((sc[:, :, j + 4] >> 4) << 6)
        s[:, :, j + 4] = (m[:, :, j] & 63) | ((m[:, :, j + 4] >> 4) << 6)
        s[:, :, j + 8] = (sc[:, :, j + 4] & 0xF) | ((m[:, :, j + 4] & 0xF) << 4)
    qv = q.reshape(q.shape[0], q.shape[1], 4, 2, 32)  # chunk c: sub-blocks 2c (low), 2c+1 (high)
    out[:, :, qo:] = ((qv[:, :, :, 0, :] & 0xF) | ((qv[:, :, :, 1, :] & 0xF) << 4)).reshape(
        q.shape[0], q.shape[1], 128)
    if bits == 5:
        hb = (q >> 4).astype(np.uint8)            # [rows, blocks, 8 sub-blocks, 32 columns]
        out[:, :, 16:48] = np.bitwise_or.reduce(hb << np.arange(8, dtype=np.uint8)[:, None],
                                                axis=2)
    return out


def _pack_2bit(q: np.ndarray) -> np.ndarray:
    """Values [R, B, 256] in [0, 3] as ggml's 64 bytes of a Q2_K / Q3_K super-block: column
    128h + 32j + l at bits 2j of byte 32h + l."""
    R, B = q.shape[:2]
    v = q.reshape(R, B, 2, 4, 32).astype(np.uint8)
    out = np.zeros((R, B, 2, 32), np.uint8)
    for j in range(4):
        out |= (v[:, :, :, j, :] & 3) << (2 * j)
    return out.reshape(R, B, 64)


def quantize_q2_k(w: np.ndarray) -> np.ndarray:
    """[rows, cols] f32 -> Q2_K super-blocks [rows, cols/256, 84]: per 16 columns a 4-bit
    scale and a 4-bit min under the block's f16 d and dmin, w ~ d * sc * q - dmin * m with
    q in [0, 3] (scales[16], then qs[64], d, dmin)."""
    w = _rows(w, 256)
    R, B = w.shape[0], w.shape[1] // 256
    d, dmin, sc, m, q = _scale_min_quant(w.reshape(R, B, 16, 16), 3, 15)
    out = np.zeros((R, B, 84), np.uint8)
    out[:, :, 0:16] = sc | (m << 4)
    out[:, :, 16:80] = _pack_2bit(q.reshape(R, B, 256))
    out[:, :, 80:82] = _f16_bytes(d)
    out[:, :, 82:84] = _f16_bytes(dmin)
    return out


def quantize_q3_k(w: np.ndarray) -> np.ndarray:
    """[rows, cols] f32 -> Q3_K super-blocks [rows, cols/256, 110]: per 16 columns a signed
    6-bit scale under the block's f16 d, w ~ d * sc * q with q in [-4, 3] (hmask[32]: the
    third bit, set for q >= 0; qs[64]: the low two bits of q + 4; scales[12]; d)."""
    w = _rows(w, 256)
    R, B = w.shape[0], w.shape[1] // 256
    x = w.reshape(R, B, 16, 16)
    # the value of largest magnitude maps onto -4 (the signed scale takes its sign)
    big = np.take_along_axis(x, np.abs(x).argmax(axis=3)[..., None], axis=3)[..., 0]
    scale = -big / 4.0
    d = (np.abs(scale).max(axis=2) / 31.0).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(scale / np.where(d > 0, d, 1.0)[:, :, None]), -32, 31).astype(np.int64)
    step = d[:, :, None] * sc
    q = np.rint(x / np.where(step != 0, step, 1.0)[..., None])
    q = np.clip(np.where(step[..., None] != 0, q, 0), -4, 3).astype(np.int64)
    u = (q + 4).reshape(R, B, 256)                        # [0, 7]
    out = np.zeros((R, B, 110), np.uint8)
    hb = (u >> 2).reshape(R, B, 8, 32).astype(np.uint8)   # column 32k + l: bit k of hmask[l]
    out[:, :, 0:32] = np.bitwise_or.reduce(hb << np.arange(8, dtype=np.uint8)[:, None], axis=2)
    out[:, :, 32:96] = _pack_2bit((u & 3).astype(np.uint8))
    s6 = (sc + 32).astype(np.uint8)                       # [0, 63]
    for i in range(16):
        if i < 8:
            out[:, :, 96 + i] |= s6[:, :, i] & 0xF
        else:
            out[:, :, 96 + i - 8] |= (s6[:, :, i] & 0xF) << 4
        out[:, :, 104 + i % 4] |= ((s6[:, :, i] >> 4) & 3) << (2 * (i // 4))
    out[:, :, 108:110] = _f16_bytes(d)
    return out


#: ggml's kvalues_iq4nl: the 16 values an IQ4_XS nibble stands for
IQ4NL_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89,
                         113], np.float32)


def quantize_iq4_xs(w: np.ndarray) -> np.ndarray:
    """[rows, cols] f32 -> IQ4_XS super-blocks [rows, cols/256, 136]: per 32 columns a 6-bit
    scale ls under the block's f16 d, w ~ d * (ls - 32) * kv[q], q the nearest of the 16
    non-linear values (:data:`IQ4NL_VALUES`)."""
    w = _rows(w, 256)
    R, B = w.shape[0], w.shape[1] // 256
    x = w.reshape(R, B, 8, 32)
    scale = np.abs(x).max(axis=3) / 127.0                 # per sub-block, >= 0
    d = (scale.max(axis=2) / 31.0).astype(np.float16).astype(np.float32)
    ls = np.clip(np.rint(scale / np.where(d > 0, d, 1.0)[:, :, None]), 0, 31).astype(np.int64)
    dl = d[:, :, None] * ls                                # the sub-block's step
    y = x / np.where(dl > 0, dl, 1.0)[..., None]
    q = np.abs(y[..., None] - IQ4NL_VALUES).argmin(axis=-1).astype(np.uint8)
    q = np.where(dl[..., None] > 0, q, 8).astype(np.uint8)  # kv[8] = 1: near zero
    out = np.zeros((R, B, 136), np.uint8)
    out[:, :, 0:2] = _f16_bytes(d)
    lsb = (ls + 32).astype(np.uint16)                      # stored as ls + 32 in 6 bits
    h = np.zeros((R, B), np.uint16)
    for j in range(8):
        h |= ((lsb[:, :, j] >> 4) & 3) << (2 * j)
    out[:, :, 2:4] = h.astype("<u2").view(np.uint8).reshape(R, B, 2)
    for j in range(4):
        out[:, :, 4 + j] = ((lsb[:, :, 2 * j] & 0xF) | ((lsb[:, :, 2 * j + 1] & 0xF) << 4)
                            ).astype(np.uint8)
    qv = q.reshape(R, B, 8, 2, 16)                         # columns 0..15 low, 16..31 high
    out[:, :, 8:] = (qv[:, :, :, 0, :] | (qv[:, :, :, 1, :] << 4)).reshape(R, B, 128)
    return out


def quantize_q6_k(w: np.ndarray) -> np.ndarray:
    """[rows, cols] f32 -> Q6_K super-blocks [rows, cols/256, 210]: per 16 columns an int8
    scale under the block's f16 d, w ~ d * sc * (q - 32), q in [0, 63]."""
    w = _rows(w, 256)
    R, B = w.shape[0], w.shape[1] // 256
    x = w.reshape(R, B, 16, 16)
    scale = np.abs(x).max(axis=3) / 31.0
    d = (scale.max(axis=2) / 127.0).astype(np.float16).astype(np.float32)
    sc = np.clip(np.rint(scale / np.where(d > 0, d, 1.0)[:, :, None]), 0, 127).astype(np.int8)
    step = d[:, :, None] * sc
    q = np.rint(x / np.where(step > 0, step, 1.0)[..., None]) + 32
    q = np.clip(np.where(step[..., None] > 0, q, 32), 0, 63).astype(np.uint8).reshape(R, B, 256)
    out = np.zeros((R, B, 210), np.uint8)
    for h in range(2):
        v = q[:, :, 128 * h:128 * h + 128].reshape(R, B, 4, 32)  # values 32k + l of the half
        out[:, :, 64 * h:64 * h + 32] = (v[:, :, 0] & 0xF) | ((v[:, :, 2] & 0xF) << 4)
        out[:, :, 64 * h + 32:64 * h + 64] = (v[:, :, 1] & 0xF) | ((v[:, :, 3] & 0xF) << 4)
        out[:, :, 128 + 32 * h:160 + 32 * h] = ((v[:, :, 0] >> 4) | ((v[:, :, 1] >> 4) << 2)
                                                | ((v[:, :, 2] >> 4) << 4)
                                                | ((v[:, :, 3] >> 4) << 6))
    out[:, :, 192:208] = sc.view(np.uint8)
    out[:, :, 208:210] = _f16_bytes(d)
    return out


def quantize_q4_0(w: np.ndarray) -> np.ndarray:
    """[rows, cols] f32 -> Q4_0 blocks [rows, cols/32, 18] (the ``gguf`` package's quantizer)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    w = _rows(w, 32)
    return quantize(w, GGMLQuantizationType.Q4_0).reshape(w.shape[0], -1, 18)


def quantize_mxfp4(w: np.ndarray) -> np.ndarray:
    """[rows, cols] f32 -> MXFP4 blocks [rows, cols/32, 17] (the ``gguf`` package's quantizer:
    a power-of-two scale per 32 columns, each value the nearest doubled E2M1 one)."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    w = _rows(w, 32)
    return quantize(w, GGMLQuantizationType.MXFP4).reshape(w.shape[0], -1, 17)


def mxfp4_from_hf(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """GPT-OSS's MXFP4 as its safetensors hold it (transformers' layout: ``_blocks`` uint8
    [rows, groups, 16], columns 2j and 2j + 1 of a group in the low and high nibble of byte j;
    ``_scales`` uint8 [rows, groups], E8M0 with w = FP4 value * 2^(scale - 127)) as MXFP4 blocks
    [rows, groups, 17], **repacked, not re-quantized**: the exponent byte as it is (ggml's
    2^(e - 128) times the doubled FP4 values is the same number), the nibbles in ggml's order
    (columns 0..15 in the low nibbles of bytes 0..15, columns 16..31 in the high ones); the
    FP4 codes index the same table in both.  What llama.cpp's converter does for GPT-OSS."""
    b = np.ascontiguousarray(blocks, dtype=np.uint8)
    sc = np.ascontiguousarray(scales, dtype=np.uint8)
    if b.shape[-1] != 16 or b.shape[:-1] != sc.shape:
        raise ValueError(f"mxfp4_from_hf: blocks {b.shape} and scales {sc.shape} are not "
                         "[rows, groups, 16] and [rows, groups]")
    cols = np.empty(b.shape[:-1] + (32,), np.uint8)
    cols[..., 0::2], cols[..., 1::2] = b & 0x0F, b >> 4
    qs = cols[..., :16] | (cols[..., 16:] << 4)
    return np.concatenate([sc[..., None], qs], axis=-1)


#: kind (a key of :data:`BLOCKS`) -> the quantizer writing that format's blocks
QUANTIZERS = {"q8_0": quantize_q8_0, "q4_k": quantize_q4_k, "q6_k": quantize_q6_k,
              "q4_0": quantize_q4_0, "q5_k": quantize_q5_k, "iq4_xs": quantize_iq4_xs,
              "q4_1": quantize_q4_1, "q2_k": quantize_q2_k, "q3_k": quantize_q3_k,
              "mxfp4": quantize_mxfp4}

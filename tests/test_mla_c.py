"""specmoe._C.MLADecode (csrc/kernels/mla.c): absorbed multi-head latent attention in C, checked
against a float64 numpy reference of the *expanded* form (DeepSeek-V2 Sec. 2.1.2, Eq. 9-11:
per-head keys W^UK c_j and values W^UV c_j built for every cached position), so the absorption
itself is under test, not only the arithmetic."""
from __future__ import annotations

import numpy as np
import pytest

from specmoe import _C
from specmoe.models.mla import int4_values
from specmoe.storage.quant import dequantize_int4, dequantize_int8, quantize_int4, quantize_int8

from .attn_helpers import ISAS, causal, mask_of

H, DN, DR, DV, R = 4, 16, 8, 12, 40  # R not a multiple of 16: the dot products' tails run
# (DV = 12 < 8 + 8: the blocks of 8 output rows and the single-row tail both run)
SCALE = 0.19


def _bf16(a: np.ndarray) -> np.ndarray:
    """float32 -> bf16 bits (round to nearest even), as torch converts."""
    u = np.ascontiguousarray(a, dtype=np.float32).view(np.uint32).astype(np.uint64)
    u = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    return u.astype(np.uint16)


def _f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def _reference(q_nope, q_pe, ckv, kpe, w_uk, w_uv, bias):
    """The expanded form in float64: out [B, T, H*DV]."""
    B, _, T, _ = q_nope.shape
    S = ckv.shape[1]
    out = np.zeros((B, T, H * DV))
    for b in range(B):
        c = ckv[b].astype(np.float64)
        for h in range(H):
            k_nope = c @ w_uk[h].astype(np.float64).T          # [S, DN]  = W^UK_h c_j
            v = c @ w_uv[h].astype(np.float64).T               # [S, DV]  = W^UV_h c_j
            s = (q_nope[b, h].astype(np.float64) @ k_nope.T
                 + q_pe[b, h].astype(np.float64) @ kpe[b].astype(np.float64).T) * SCALE
            if bias is not None:
                s = s + bias[0 if bias.shape[0] == 1 else b]
            with np.errstate(invalid="ignore"):
                p = np.exp(s - s.max(axis=1, keepdims=True))
                p = p / p.sum(axis=1, keepdims=True)
            out[b, :, h * DV:(h + 1) * DV] = np.nan_to_num(p) @ v
    return out


def _inputs(rng, B, T, S, r=R):
    return (rng.standard_normal((B, H, T, DN), dtype=np.float32),
            rng.standard_normal((B, H, T, DR), dtype=np.float32),
            rng.standard_normal((B, S, r), dtype=np.float32),
            rng.standard_normal((B, S, DR), dtype=np.float32),
            (rng.standard_normal((H, DN, r), dtype=np.float32) * 0.3),
            (rng.standard_normal((H, DV, r), dtype=np.float32) * 0.3))


def _quantized(w: np.ndarray, fmt: str, group: int = 32):
    """[H, rows, R4] weights in specmoe.storage.quant's int8/int4 formats per row: (q, scale) as the
    kernel takes them, and the dequantized float32 the reference uses."""
    h, rows, cols = w.shape
    flat = w.reshape(h * rows, cols)
    if fmt == "int8":
        q, s = quantize_int8(flat)
        deq = dequantize_int8(q, s)
        return q.reshape(h, rows, cols), s.reshape(h, rows), deq.reshape(w.shape)
    q, s = quantize_int4(flat, group)
    deq = dequantize_int4(q, s, group)
    return (int4_values(q.reshape(h, rows, cols // 2)), s.reshape(h, rows, cols // group),
            deq.reshape(w.shape))


def test_int4_values():
    """One value a column: nibble u of column c (low for even c) minus 8."""
    rng = np.random.default_rng(4)
    u = rng.integers(0, 16, size=(3, 64), dtype=np.uint8)
    canon = (u[:, 0::2] | (u[:, 1::2] << 4)).astype(np.uint8)      # specmoe.storage.quant's packing
    np.testing.assert_array_equal(int4_values(canon), u.astype(np.int16) - 8)
    assert int4_values(canon).dtype == np.int8


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("B,T,S", [(1, 1, 1), (1, 1, 37), (2, 3, 20), (3, 1, 65)])
@pytest.mark.parametrize("mask", ["none", "shared", "per_row"])
@pytest.mark.parametrize("bf16", [False, True])
def test_matches_expanded_reference(isa, B, T, S, mask, bf16):
    rng = np.random.default_rng(B * 1000 + T * 100 + S)
    qn, qp, ckv, kpe, w_uk, w_uv = _inputs(rng, B, T, S)
    bias = mask_of(mask, T, S, B)
    if bf16:  # weights and cache in bf16: the reference sees the same rounded values
        w_uk, w_uv, ckv, kpe = (_bf16(a) for a in (w_uk, w_uv, ckv, kpe))
        ref = _reference(qn, qp, _f32(ckv), _f32(kpe), _f32(w_uk), _f32(w_uv), bias)
    else:
        ref = _reference(qn, qp, ckv, kpe, w_uk, w_uv, bias)
    ctx = _C.KernelContext(2)
    ctx.set_isa(isa)
    att = _C.MLADecode(ctx, w_uk, w_uv, DR, SCALE)
    out = np.full((B, T, H * DV), np.nan, dtype=np.float32)
    att.forward(qn, qp, ckv, kpe, bias, out)
    np.testing.assert_allclose(out, ref, rtol=2e-4, atol=2e-5)


R4 = 96  # int4 groups of 32 need a kv_lora_rank divisible by 32


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("fmt,group", [("int8", 0), ("int4", 32), ("int4", 96)])
@pytest.mark.parametrize("B,T,S", [(1, 1, 5), (2, 3, 19)])
def test_quantized_weights_match_dequantized_reference(isa, fmt, group, B, T, S):
    """int8 (a scale per row) and int4 (a scale per group of columns) absorbed weights, as
    specmoe.storage.quant stores kv_b_proj's rows: the kernel against the expanded reference on the
    dequantized weights."""
    rng = np.random.default_rng(11 + B + T)
    qn, qp, ckv, kpe, w_uk, w_uv = _inputs(rng, B, T, S, R4)
    uk, uks, uk_f = _quantized(w_uk, fmt, group)
    uv, uvs, uv_f = _quantized(w_uv, fmt, group)
    bias = causal(T, S)
    ref = _reference(qn, qp, ckv, kpe, uk_f, uv_f, bias)
    ctx = _C.KernelContext(2)
    ctx.set_isa(isa)
    att = _C.MLADecode(ctx, uk, uv, DR, SCALE, uks, uvs)
    assert att.shape["dtype"] == fmt and att.shape["kv_lora_rank"] == R4
    assert att.shape["group"] == (group if fmt == "int4" else 0)
    out = np.full((B, T, H * DV), np.nan, dtype=np.float32)
    att.forward(qn, qp, ckv, kpe, bias, out)
    np.testing.assert_allclose(out, ref, rtol=2e-4, atol=2e-5)
    # and the quantization error is what it should be next to the float weights
    exact = _reference(qn, qp, ckv, kpe, w_uk, w_uv, bias)
    rel = np.linalg.norm(out - exact) / np.linalg.norm(exact)
    assert 0 < rel < (0.02 if fmt == "int8" else 0.25), rel


def test_quantized_weights_bad_input():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((H, DN, R4), dtype=np.float32)
    v = rng.standard_normal((H, DV, R4), dtype=np.float32)
    ctx = _C.KernelContext(1)
    uk8, uks8, _ = _quantized(w, "int8")
    uv8, uvs8, _ = _quantized(v, "int8")
    uk4, uks4, _ = _quantized(w, "int4", 32)
    uv4, uvs4, _ = _quantized(v, "int4", 32)
    with pytest.raises(ValueError, match="uk_scale"):
        _C.MLADecode(ctx, uk8, uv8, DR, SCALE)                  # scales missing
    with pytest.raises(ValueError, match="uv_scale"):
        _C.MLADecode(ctx, uk8, uv8, DR, SCALE, uks8, uvs8[:, :-1].copy())
    with pytest.raises(ValueError, match="int8/int4 weights only"):
        _C.MLADecode(ctx, w, v, DR, SCALE, uks8, uvs8)
    with pytest.raises(ValueError, match="same number of groups"):
        _C.MLADecode(ctx, uk4, uv4, DR, SCALE, uks4, uvs4[:, :, :1].copy())
    with pytest.raises(ValueError, match="multiple of 32"):      # 96 / 6 = 16 columns a group
        _C.MLADecode(ctx, uk4, uv4, DR, SCALE, np.ones((H, DN, 6), np.float32),
                     np.ones((H, DV, 6), np.float32))
    with pytest.raises(ValueError, match="uv_scale"):            # int8 and int4 mixed
        _C.MLADecode(ctx, uk8, uv4, DR, SCALE, uks8, uvs4)
    bad = uk4.copy()
    bad[1, 2, 3] = 8
    with pytest.raises(ValueError, match="not an int4 value"):
        _C.MLADecode(ctx, bad, uv4, DR, SCALE, uks4, uvs4)


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("r", [R, 45])
def test_bits_do_not_depend_on_threads_or_isa(bf16, r):
    """f32 and bf16 weights and cache: AVX2 and AVX-512 have loops of their own for them
    (mla_avx2.c, mla_avx512.c), which must give the plain loops' bits (R = 40: masked tails;
    r = 45: AVX2's 16-, 8- and 1-column passes all run; DV = 12; S = 50: a partial block of
    positions; left padding: -inf positions skipped)."""
    rng = np.random.default_rng(7)
    qn, qp, ckv, kpe, w_uk, w_uv = _inputs(rng, 2, 2, 50, r)
    if bf16:
        w_uk, w_uv, ckv, kpe = (_bf16(a) for a in (w_uk, w_uv, ckv, kpe))
    bias = mask_of("per_row", 2, 50, 2)
    outs = []
    for isa in ISAS:
        for n in (1, 2, 3):
            ctx = _C.KernelContext(n)
            ctx.set_isa(isa)
            out = np.empty((2, 2, H * DV), dtype=np.float32)
            _C.MLADecode(ctx, w_uk, w_uv, DR, SCALE).forward(qn, qp, ckv, kpe, bias, out)
            outs.append(out)
    assert np.isfinite(outs[0]).all() and np.abs(outs[0]).max() > 0
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])


@pytest.mark.parametrize("fmt,group,r", [("int8", 0, R), ("int8", 0, 45), ("int4", 32, R4),
                                         ("int4", 96, R4)])
def test_quantized_bits_do_not_depend_on_threads_or_isa(fmt, group, r):
    """The int8/int4 weight loops have AVX2 and AVX-512 forms of their own (mla_avx2.c,
    mla_avx512.c): they must give the plain loops' bits (R = 40: the int8 rows' masked tails;
    r = 45: AVX2's single-column tail too; DV = 12: AVX-512's block of 8 output rows and 4
    single ones, AVX2's three blocks of 4)."""
    rng = np.random.default_rng(17)
    qn, qp, ckv, kpe, w_uk, w_uv = _inputs(rng, 2, 3, 21, r)
    uk, uks, _ = _quantized(w_uk, fmt, group)
    uv, uvs, _ = _quantized(w_uv, fmt, group)
    bias = causal(3, 21)
    outs = []
    for isa in ISAS:
        for n in (1, 2):
            ctx = _C.KernelContext(n)
            ctx.set_isa(isa)
            out = np.empty((2, 3, H * DV), dtype=np.float32)
            _C.MLADecode(ctx, uk, uv, DR, SCALE, uks, uvs).forward(qn, qp, ckv, kpe, bias, out)
            outs.append(out)
    assert np.isfinite(outs[0]).all() and np.abs(outs[0]).max() > 0
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])


def test_fully_masked_row_is_uniform_or_zero():
    """A query row whose every key carries transformers' most-negative-float mask gets torch's
    uniform weights (the mean of the values); an all -inf row gets zeros, not NaN."""
    rng = np.random.default_rng(3)
    qn, qp, ckv, kpe, w_uk, w_uv = _inputs(rng, 1, 1, 9)
    att = _C.MLADecode(_C.KernelContext(1), w_uk, w_uv, DR, SCALE)
    out = np.empty((1, 1, H * DV), dtype=np.float32)
    att.forward(qn, qp, ckv, kpe, np.full((1, 1, 9), np.finfo(np.float32).min, np.float32), out)
    mean_v = np.concatenate([(ckv[0] @ w_uv[h].T).mean(axis=0) for h in range(H)])
    np.testing.assert_allclose(out[0, 0], mean_v, rtol=1e-4, atol=1e-5)
    att.forward(qn, qp, ckv, kpe, np.full((1, 1, 9), -np.inf, np.float32), out)
    np.testing.assert_array_equal(out, 0.0)


def test_scratch_grows_with_tokens_and_threads():
    rng = np.random.default_rng(5)
    ctx = _C.KernelContext(1)
    qn, qp, ckv, kpe, w_uk, w_uv = _inputs(rng, 1, 1, 10)
    att = _C.MLADecode(ctx, w_uk, w_uv, DR, SCALE)
    out = np.empty((1, 1, H * DV), dtype=np.float32)
    att.forward(qn, qp, ckv, kpe, None, out)
    ctx.set_threads(3)
    qn, qp, ckv, kpe, _, _ = _inputs(rng, 2, 5, 10)
    out = np.empty((2, 5, H * DV), dtype=np.float32)
    bias = causal(5, 10)
    att.forward(qn, qp, ckv, kpe, bias, out)
    np.testing.assert_allclose(out, _reference(qn, qp, ckv, kpe, w_uk, w_uv, bias),
                               rtol=2e-4, atol=2e-5)
    assert att.shape == {"heads": H, "qk_nope_head_dim": DN, "qk_rope_head_dim": DR,
                         "v_head_dim": DV, "kv_lora_rank": R, "dtype": "f32", "uv_dtype": "f32",
                         "group": 0}


def test_bad_input_raises_and_leaves_out_alone():
    rng = np.random.default_rng(9)
    qn, qp, ckv, kpe, w_uk, w_uv = _inputs(rng, 1, 2, 6)
    ctx = _C.KernelContext(1)
    with pytest.raises(ValueError, match="share dtype, H and r"):
        _C.MLADecode(ctx, w_uk, w_uv[:, :, :-1].copy(), DR, SCALE)
    with pytest.raises(ValueError, match="float32, bf16"):
        _C.MLADecode(ctx, w_uk.astype(np.float64), w_uv, DR, SCALE)
    with pytest.raises(ValueError, match="scale"):
        _C.MLADecode(ctx, w_uk, w_uv, DR, -1.0)
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        _C.MLADecode(ctx, w_uk, w_uv, 0, SCALE)
    with pytest.raises(TypeError):
        _C.MLADecode("ctx", w_uk, w_uv, DR, SCALE)
    att = _C.MLADecode(ctx, w_uk, w_uv, DR, SCALE)
    out = np.full((1, 2, H * DV), 7.0, dtype=np.float32)
    bad = [
        ((qn[:, :, :, :-1].copy(), qp, ckv, kpe, None, out), "q_nope"),
        ((qn, qp[:, :1].copy(), ckv, kpe, None, out), "q_pe"),
        ((qn, qp, ckv[:, :, :-1].copy(), kpe, None, out), "ckv"),
        ((qn, qp, ckv, kpe[:, :-1].copy(), None, out), "kpe"),
        ((qn, qp, ckv, kpe, np.zeros((1, 2, 5), np.float32), out), "bias"),
        ((qn, qp, ckv, kpe, np.zeros((2, 2, 6), np.float32), out), "rows"),
        ((qn, qp, ckv, kpe, None, np.zeros((1, 2, H * DV - 1), np.float32)), "out"),
        ((qn, qp, ckv[:, :, ::2], kpe, None, out), "ckv"),
        ((qn.astype(np.float64), qp, ckv, kpe, None, out), "q_nope"),
    ]
    for args, what in bad:
        with pytest.raises((ValueError, TypeError), match=what):
            att.forward(*args)
    np.testing.assert_array_equal(out, 7.0)
    with pytest.raises(TypeError, match="6 arguments"):
        att.forward(qn, qp, ckv, kpe, None)

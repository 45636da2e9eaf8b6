"""specmoe._C.MLADecode (csrc/kernels/mla.c): absorbed multi-head latent attention in C, checked
against a float64 numpy reference of the *expanded* form (DeepSeek-V2 Sec. 2.1.2, Eq. 9-11:
per-head keys W^UK c_j and values W^UV c_j built for every cached position), so the absorption
itself is under test, not only the arithmetic."""
from __future__ import annotations

import numpy as np
import pytest

from specmoe import _C

H, DN, DR, DV, R = 4, 16, 8, 12, 40  # R not a multiple of 16: the dot products' tails run
SCALE = 0.19
ISAS = [i for i in ("scalar", "avx2", "avx512")
        if ["scalar", "avx2", "avx512"].index(i)
        <= ["scalar", "avx2", "avx512"].index(_C.KernelContext(1).isa_max)]


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


def _inputs(rng, B, T, S):
    return (rng.standard_normal((B, H, T, DN), dtype=np.float32),
            rng.standard_normal((B, H, T, DR), dtype=np.float32),
            rng.standard_normal((B, S, R), dtype=np.float32),
            rng.standard_normal((B, S, DR), dtype=np.float32),
            (rng.standard_normal((H, DN, R), dtype=np.float32) * 0.3),
            (rng.standard_normal((H, DV, R), dtype=np.float32) * 0.3))


def _causal(T, S, rows=1, neg=np.finfo(np.float32).min):
    i = np.arange(T)[:, None] + (S - T)
    j = np.arange(S)[None, :]
    return np.broadcast_to(np.where(j > i, neg, 0.0).astype(np.float32), (rows, T, S)).copy()


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("B,T,S", [(1, 1, 1), (1, 1, 37), (2, 3, 20), (3, 1, 65)])
@pytest.mark.parametrize("mask", ["none", "shared", "per_row"])
@pytest.mark.parametrize("bf16", [False, True])
def test_matches_expanded_reference(isa, B, T, S, mask, bf16):
    rng = np.random.default_rng(B * 1000 + T * 100 + S)
    qn, qp, ckv, kpe, w_uk, w_uv = _inputs(rng, B, T, S)
    bias = None
    if mask == "shared":
        bias = _causal(T, S)
    elif mask == "per_row":  # left padding: row b's first b positions masked (-inf here)
        bias = _causal(T, S, B)
        for b in range(B):
            bias[b, :, :min(b, S - 1)] = -np.inf
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


def test_bits_do_not_depend_on_threads_or_isa():
    rng = np.random.default_rng(7)
    qn, qp, ckv, kpe, w_uk, w_uv = _inputs(rng, 2, 2, 50)
    bias = _causal(2, 50)
    outs = []
    for isa in ISAS:
        for n in (1, 2, 3):
            ctx = _C.KernelContext(n)
            ctx.set_isa(isa)
            out = np.empty((2, 2, H * DV), dtype=np.float32)
            _C.MLADecode(ctx, w_uk, w_uv, DR, SCALE).forward(qn, qp, ckv, kpe, bias, out)
            outs.append(out)
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
    bias = _causal(5, 10)
    att.forward(qn, qp, ckv, kpe, bias, out)
    np.testing.assert_allclose(out, _reference(qn, qp, ckv, kpe, w_uk, w_uv, bias),
                               rtol=2e-4, atol=2e-5)
    assert att.shape == {"heads": H, "qk_nope_head_dim": DN, "qk_rope_head_dim": DR,
                         "v_head_dim": DV, "kv_lora_rank": R}


def test_bad_input_raises_and_leaves_out_alone():
    rng = np.random.default_rng(9)
    qn, qp, ckv, kpe, w_uk, w_uv = _inputs(rng, 1, 2, 6)
    ctx = _C.KernelContext(1)
    with pytest.raises(ValueError, match="share dtype, H and r"):
        _C.MLADecode(ctx, w_uk, w_uv[:, :, :-1].copy(), DR, SCALE)
    with pytest.raises(ValueError, match="float32 or bf16"):
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

"""specmoe._C.MLADecode on a GGUF file's own blocks (``blocks=``): llama.cpp's converter splits
DeepSeek's kv_b_proj into attn_k_b [H, r, d_nope] (each head's W^UK transposed) and attn_v_b
[H, d_v, r], and the absorbed form's two per-head products are exactly those matrices against
one vector (q_nope, and the attention's latent output), so the kernel reads them as the file
holds them with the block kernels' rows.  Checked against the float64 expanded reference of
test_mla_c.py on the dequantized blocks (the exact form, scalar ISA) and against a numpy model
of the fast forms' arithmetic (each product's input rounded to int8 per block, as
smoe_blocks_prepare does)."""
from __future__ import annotations

import numpy as np
import pytest

from specmoe import _C
from specmoe.runtime.kernels import GGUF_BLOCKS, dtype_code
from specmoe.storage import ggml_blocks as gb

from .attn_helpers import ISAS, causal, mask_of
from .test_gguf_blocks import q8_rounded

H, DN, DR, DV, R, SCALE = 3, 64, 8, 40, 256, 0.17


def _inputs(rng, B, T, S):
    return (rng.standard_normal((B, H, T, DN), dtype=np.float32),
            rng.standard_normal((B, H, T, DR), dtype=np.float32),
            rng.standard_normal((B, S, R), dtype=np.float32) * 0.5,
            rng.standard_normal((B, S, DR), dtype=np.float32),
            rng.standard_normal((H, DN, R), dtype=np.float32) * 0.05,
            rng.standard_normal((H, DV, R), dtype=np.float32) * 0.05)


def _blocks(w_uk, w_uv, kk, vk):
    """The two tensors as llama.cpp's converter writes them, quantized: attn_k_b uint8 [H, R,
    row bytes] of kk, attn_v_b [H, DV, row bytes] of vk; and their dequantized W^UK [H, DN, R],
    W^UV [H, DV, R]."""
    kb = gb.QUANTIZERS[kk](np.ascontiguousarray(w_uk.transpose(0, 2, 1)).reshape(H * R, DN))
    vb = gb.QUANTIZERS[vk](w_uv.reshape(H * DV, R))
    uk_f = gb.dequantize(kb).reshape(H, R, DN).transpose(0, 2, 1)
    uv_f = gb.dequantize(vb).reshape(H, DV, R)
    return kb.reshape(H, R, -1), vb.reshape(H, DV, -1), uk_f, uv_f


def _absorbed(q_nope, q_pe, ckv, kpe, uk, uv, bias, round_k=None, round_v=None):
    """The absorbed form in float64 (out [B, T, H * DV]); round_k / round_v: the fast forms'
    rounding of q_nope before W^UK and of the normalised latent output before W^UV (int8
    per that many columns)."""
    B, _, T, _ = q_nope.shape
    out = np.zeros((B, T, H * DV))
    for b in range(B):
        c = ckv[b].astype(np.float64)
        for h in range(H):
            qn = q_nope[b, h]
            if round_k:
                qn = q8_rounded(qn, round_k)
            q_lat = qn.astype(np.float64) @ uk[h].astype(np.float64)             # [T, R]
            s = (q_lat @ c.T + q_pe[b, h].astype(np.float64) @ kpe[b].T) * SCALE
            if bias is not None:
                s = s + bias[0 if bias.shape[0] == 1 else b]
            p = np.exp(s - s.max(axis=1, keepdims=True))
            o = (p / p.sum(axis=1, keepdims=True)) @ c                             # [T, R]
            if round_v:
                o = q8_rounded(o.astype(np.float32), round_v)
            out[b, :, h * DV:(h + 1) * DV] = o.astype(np.float64) @ uv[h].T.astype(np.float64)
    return out


def _rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# attn_k_b's DN = 64 columns: the 32-column formats; attn_v_b's R = 256: any, K-quants too
PAIRS = [("q8_0", "q8_0"), ("q4_0", "q4_0"), ("q4_0", "q4_k"), ("q4_1", "q6_k"),
         ("mxfp4", "q5_k"), ("q8_0", "iq4_xs")]


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("kk,vk", PAIRS)
@pytest.mark.parametrize("B,T,S,mask", [(1, 1, 9, "none"), (2, 3, 21, "per_row")])
def test_blocks_match_the_dequantized_reference(isa, kk, vk, B, T, S, mask):
    rng = np.random.default_rng(len(kk) * 100 + len(vk) * 10 + B + T)
    qn, qp, ckv, kpe, w_uk, w_uv = _inputs(rng, B, T, S)
    kb, vb, uk_f, uv_f = _blocks(w_uk, w_uv, kk, vk)
    bias = mask_of(mask, T, S, B)
    ctx = _C.KernelContext(2)
    ctx.set_isa(isa)
    att = _C.MLADecode(ctx, kb, vb, DR, SCALE, blocks=(dtype_code(kk), dtype_code(vk)))
    shape = att.shape
    assert (shape["dtype"], shape["uv_dtype"], shape["qk_nope_head_dim"], shape["v_head_dim"],
            shape["kv_lora_rank"], shape["heads"]) == (kk, vk, DN, DV, R, H)
    out = np.full((B, T, H * DV), np.nan, dtype=np.float32)
    att.forward(qn, qp, ckv, kpe, bias, out)
    exact = _absorbed(qn, qp, ckv, kpe, uk_f, uv_f, bias)
    if isa == "scalar":  # the exact form: f32 on the widened blocks
        assert _rel(out, exact) < 2e-5, _rel(out, exact)
        return
    model = _absorbed(qn, qp, ckv, kpe, uk_f, uv_f, bias, GGUF_BLOCKS[kk][0], GGUF_BLOCKS[vk][0])
    # the int8 rounding of the two inputs costs ~1e-2 of the output; the model of it agrees
    # to f32 (a value on a rounding boundary may round the other way)
    assert _rel(out, model) < 2e-4, (_rel(out, model), _rel(out, exact))
    assert _rel(out, exact) < 5e-2


@pytest.mark.parametrize("isa", ISAS)
def test_blocks_bits_do_not_depend_on_threads_or_batch(isa):
    """Each head's products are one-vector rows on one thread: the same bits for any thread
    count, and a batch row's output is what that row alone gives."""
    rng = np.random.default_rng(5)
    qn, qp, ckv, kpe, w_uk, w_uv = _inputs(rng, 2, 2, 17)
    kb, vb, _, _ = _blocks(w_uk, w_uv, "q4_0", "q4_k")
    bias = causal(2, 17)
    outs = []
    for n in (1, 2, 3):
        ctx = _C.KernelContext(n)
        ctx.set_isa(isa)
        att = _C.MLADecode(ctx, kb, vb, DR, SCALE, blocks=(dtype_code("q4_0"),
                                                           dtype_code("q4_k")))
        out = np.empty((2, 2, H * DV), dtype=np.float32)
        att.forward(qn, qp, ckv, kpe, bias, out)
        outs.append(out)
        one = np.empty((1, 2, H * DV), dtype=np.float32)
        att.forward(qn[1:].copy(), qp[1:].copy(), ckv[1:].copy(), kpe[1:].copy(), bias, one)
        np.testing.assert_array_equal(one[0], out[1])
    assert np.isfinite(outs[0]).all() and np.abs(outs[0]).max() > 0
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])


def test_blocks_bad_input_is_refused_by_name():
    rng = np.random.default_rng(3)
    _, _, _, _, w_uk, w_uv = _inputs(rng, 1, 1, 1)
    kb, vb, _, _ = _blocks(w_uk, w_uv, "q8_0", "q4_k")
    ctx = _C.KernelContext(1)
    q8, q4k = dtype_code("q8_0"), dtype_code("q4_k")
    with pytest.raises(ValueError, match="no scales"):
        _C.MLADecode(ctx, kb, vb, DR, SCALE, np.ones((H, R), np.float32),
                     np.ones((H, DV), np.float32), blocks=(q8, q4k))
    with pytest.raises(TypeError, match="blocks must be"):
        _C.MLADecode(ctx, kb, vb, DR, SCALE, blocks=q8)
    with pytest.raises(ValueError, match="two GGUF block dtypes"):  # f32 is no block format
        _C.MLADecode(ctx, kb, vb, DR, SCALE, blocks=(dtype_code("f32"), q4k))
    with pytest.raises(ValueError, match="r columns"):  # w_uv's rows must be r = 256 wide
        _C.MLADecode(ctx, kb, np.ascontiguousarray(vb[:, :, :72]), DR, SCALE,
                     blocks=(q8, dtype_code("q4_0")))
    with pytest.raises(ValueError, match="whole blocks"):  # 100 bytes: no whole Q8_0 blocks
        _C.MLADecode(ctx, np.zeros((H, R, 100), np.uint8), vb, DR, SCALE, blocks=(q8, q4k))
    with pytest.raises(ValueError, match="w_uk"):
        _C.MLADecode(ctx, kb.astype(np.int8), vb, DR, SCALE, blocks=(q8, q4k))

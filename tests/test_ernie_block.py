"""ERNIE-4.5's attention in the C decoder block (specmoe.models.attention.fuse_attention,
_C.AttnBlock with ``rope="pairs"``): the rotary turns each head's pairs (x[2i], x[2i+1]) in
place in f32 and rounds once (transformers' Ernie4_5_Moe apply_rotary_pos_emb), the
Llama-form norms folded into the block's calls, every layer one AttnBlock.layer call: the MoE
block routed in C, or the dense first layer's MLP (set_mlp).  Checked through the Engine: f32
tokens and logits against the unmodified transformers model; bf16 logits bit for bit against
the same conversion with torch running everything between the C kernels; the pairs form
against a numpy rotary; a rope form the block does not have refused by name."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from specmoe import _C
from specmoe.models.layers import CLinear, chain_step, dense_mlp
from specmoe.runtime import engine as hf

from .test_attn_block import _tiny, _unfused
from .test_gptoss_block import _Calls, _generate, same_generation


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_ernie_decodes_through_the_block(dt):
    """A 20-token prompt and 11 decode steps: every attention module fused and every decoder
    layer's norms folded; every layer's step one layer call, the MoE layers' with the block
    routed in C, the dense first layer's with its MLP in the block (set_mlp); f32 as
    transformers, bf16 as the torch glue around the same kernels, bit for bit."""
    base = _tiny("ernie4_5_moe", dtype=dt, experts=16, top_k=4)
    ref, a, b = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    fmt = "f32" if dt == torch.float32 else "bf16"
    ea = hf.offload(a, dtype=fmt, dense=fmt, cache=1.0)
    eb = hf.offload(b, dtype=fmt, dense=fmt, cache=1.0)
    try:
        moe = len(ea.routed_in_c)
        dense = len(a.model.layers) - moe
        assert moe >= 1 and dense >= 1
        calls: dict[str, int] = {}
        for layer in a.model.layers:
            assert getattr(chain_step(layer), "norms", None) is not None
            assert (dense_mlp(layer) is None) == hasattr(layer.mlp, "experts")
            layer.self_attn._specmoe_block = _Calls(layer.self_attn._specmoe_block, calls)
        _unfused(b)
        ids = torch.randint(3, 100, (1, 20), generator=torch.Generator().manual_seed(1))
        got = _generate(a, ids, 12)
        assert calls == {"layer": 11 * (moe + dense)}, calls
        same_generation(got, ref, b, ids, 12, dt)
    finally:
        ea.close()
        eb.close()


def _block(rope: str, R: int = 0):
    m = _tiny("ernie4_5_moe")
    ctx = _C.KernelContext(1)
    attn = m.model.layers[0].self_attn
    projs = [CLinear(getattr(attn, p), "f32", ctx) for p in ("q_proj", "k_proj", "v_proj",
                                                             "o_proj")]
    cfg = attn.config
    H, Hkv, D = cfg.num_attention_heads, cfg.num_key_value_heads, attn.head_dim
    blk = _C.AttnBlock(ctx, *(p._c for p in projs), H, Hkv, D, rope=rope, rotary_dim=R)
    return blk, projs, (H, Hkv, D, cfg.hidden_size)


@pytest.mark.parametrize("R", [0, 4])
def test_pairs_rotary_against_numpy(R):
    """pre's q and k with the pairs form: each head's first R values in pairs, pair i turned
    by cos[i], sin[i] (the tables' first R / 2 values; the rest of them unread), the values
    past R as the projections give them."""
    blk, projs, (H, Hkv, D, hid) = _block("pairs", R)
    R = R or D
    rng = np.random.default_rng(3)
    T = 3
    x = rng.standard_normal((T, hid)).astype(np.float32)
    cos = rng.uniform(-1, 1, (T, R)).astype(np.float32)
    sin = rng.uniform(-1, 1, (T, R)).astype(np.float32)
    q = np.zeros((1, H, T, D), np.float32)
    k = np.zeros((1, Hkv, T, D), np.float32)
    v = np.zeros((1, Hkv, T, D), np.float32)
    blk.pre(x, cos, sin, q, k, v)
    cn, sn = cos.copy(), sin.copy()
    cn[:, R // 2:] = np.nan  # the second halves are not read
    sn[:, R // 2:] = np.nan
    q2 = np.zeros_like(q)
    blk.pre(x, cn, sn, q2, np.zeros_like(k), np.zeros_like(v))
    assert np.array_equal(q, q2)

    def want(lin, heads):
        y = lin(torch.from_numpy(x)).double().numpy().reshape(T, heads, D)
        out = y.copy()
        c, s = cos[:, None, :R // 2].astype(np.float64), sin[:, None, :R // 2]
        a, b = y[..., 0:R:2], y[..., 1:R:2]
        out[..., 0:R:2] = a * c - b * s
        out[..., 1:R:2] = a * s + b * c
        return out.transpose(1, 0, 2)

    with torch.no_grad():
        np.testing.assert_allclose(q[0], want(projs[0], H), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(k[0], want(projs[1], Hkv), rtol=1e-5, atol=1e-5)
    half, _, _ = _block("half", R if R < D else 0)
    qh = np.zeros_like(q)
    half.pre(x, cos, sin, qh, np.zeros_like(k), np.zeros_like(v))
    assert not np.allclose(qh, q)  # (the other form, other values)


def test_unknown_rope_form_is_refused():
    with pytest.raises(ValueError, match="rope must be 'half' or 'pairs', got 'complex'"):
        _block("complex")


def test_dense_layer_call_needs_a_fitting_mlp():
    """layer(None, ...) runs the block's MLP and refuses by name when none is set; set_mlp
    refuses an MLP that does not chain hidden -> I -> hidden, or that is not three Linear."""
    blk, projs, (H, Hkv, D, hid) = _block("pairs")
    ctx = _C.KernelContext(1)
    torch.manual_seed(0)

    def lin(k, n):
        return CLinear(torch.nn.Linear(k, n, bias=False), "f32", ctx)._c

    T, cap = 1, 8
    args = (None, -1, 0, np.zeros((T, hid), np.float32), np.ones((T, D), np.float32),
            np.zeros((T, D), np.float32), np.zeros((1, Hkv, cap, D), np.float32),
            np.zeros((1, Hkv, cap, D), np.float32), 0, None, 0.5,
            np.ones(hid, np.float32), 1e-6, np.ones(hid, np.float32), 1e-6)
    out = np.full((T, hid), 7.0, np.float32)
    with pytest.raises(ValueError, match=r"none is set \(set_mlp\)"):
        blk.layer(*args, out)
    assert (out == 7.0).all()
    with pytest.raises(ValueError, match="AttnBlock.set_mlp: the MLP's"):
        blk.set_mlp((lin(hid, 24), lin(hid, 24), lin(24, hid + 2)))
    with pytest.raises(TypeError, match="set_mlp: mlp"):
        blk.set_mlp((lin(hid, 24), lin(hid, 24)))
    blk.set_mlp((lin(hid, 24), lin(hid, 24), lin(24, hid)))
    blk.layer(*args, out)
    assert np.isfinite(out).all() and not (out == 7.0).any()
    blk.set_mlp(None)
    with pytest.raises(ValueError, match=r"none is set \(set_mlp\)"):
        blk.layer(*args, out)

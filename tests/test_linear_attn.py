"""Recurrent layers of hybrid models on the CPU (specmoe.models.linear_attn): the C kernel of the
gated delta rule (csrc/kernels/gdelta.c) against a plain reference of its arithmetic and
against transformers' own recurrent rule; an offloaded Qwen3-Next / Qwen3.5 decoding through
it with the unmodified model's logits, the unmodified model untouched; the bf16 short
convolutions held in f32."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specmoe import _C
from specmoe.models import linear_attn
from specmoe.models.testing import tiny_model
from specmoe.runtime.engine import offload
from specmoe.models.layers import chain_step
from specmoe.speculation.decoding import cache_kwargs


def _reference(q, k, v, g, beta, state, l2norm):
    """The rule in plain loops (float64): per sequence, value head (key head h // (Hv // Hk))
    and token in order."""
    B, T, Hk, dk = q.shape
    Hv, dv = v.shape[2:]
    S = state.astype(np.float64).copy()
    out = np.zeros((B, T, Hv, dv))
    for b in range(B):
        for h in range(Hv):
            hk = h // (Hv // Hk)
            for t in range(T):
                qq, kk = q[b, t, hk].astype(np.float64), k[b, t, hk].astype(np.float64)
                if l2norm:
                    qq = qq / np.sqrt((qq * qq).sum() + 1e-6)
                    kk = kk / np.sqrt((kk * kk).sum() + 1e-6)
                qq = qq / np.sqrt(dk)
                e = np.exp(g[b, t, h])
                u = beta[b, t, h] * (v[b, t, h] - e * (S[b, h].T @ kk))
                S[b, h] = e * S[b, h] + np.outer(kk, u)
                out[b, t, h] = S[b, h].T @ qq
    return out, S


def _problem(B=2, T=3, Hk=2, Hv=4, dk=16, dv=8, seed=0):
    rng = np.random.default_rng(seed)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    return (f(B, T, Hk, dk), f(B, T, Hk, dk), f(B, T, Hv, dv),
            -rng.random((B, T, Hv)).astype(np.float32), rng.random((B, T, Hv)).astype(np.float32),
            f(B, Hv, dk, dv))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("l2norm", [True, False])
@pytest.mark.parametrize("shape", [(2, 3, 2, 4, 16, 8), (1, 1, 16, 32, 128, 128),
                                   (3, 2, 3, 3, 5, 7)])
def test_kernel_equals_a_plain_reference(threads, l2norm, shape):
    q, k, v, g, beta, s0 = _problem(*shape)
    want, want_s = _reference(q, k, v, g, beta, s0, l2norm)
    state, out = s0.copy(), np.full(v.shape, np.nan, np.float32)
    _C.KernelContext(threads).gated_delta(q, k, v, g, beta, state, out, l2norm)
    np.testing.assert_allclose(out, want, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(state, want_s, rtol=2e-4, atol=2e-4)


def test_kernel_equals_transformers_recurrent_rule():
    from transformers.models.qwen3_next import modeling_qwen3_next as mq
    original = getattr(mq.torch_recurrent_gated_delta_rule, "_specmoe_original",
                       mq.torch_recurrent_gated_delta_rule)
    q, k, v, g, beta, s0 = map(torch.from_numpy, _problem())
    for l2 in (True, False):
        want, want_s = original(q, k, v, g=g, beta=beta, initial_state=s0.clone(),
                                output_final_state=True, use_qk_l2norm_in_kernel=l2)
        got, got_s = linear_attn._c_step(_C.KernelContext(1), q, k, v, g, beta, s0.clone(),
                                         True, l2)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_s, want_s, atol=1e-5, rtol=1e-5)


def test_bad_shapes_are_refused_by_name():
    q, k, v, g, beta, s0 = _problem()
    ctx = _C.KernelContext(1)
    out = np.zeros(v.shape, np.float32)
    with pytest.raises(ValueError, match="gated_delta: shapes must be"):
        ctx.gated_delta(q, k, v, g, beta, s0[:, :2].copy(), out, True)
    with pytest.raises(ValueError, match="state must have dtype"):
        ctx.gated_delta(q, k, v, g, beta, s0.astype(np.float64), out, True)
    with pytest.raises(ValueError, match="not a multiple of key heads"):
        q3 = np.zeros((2, 3, 3, 16), np.float32)
        ctx.gated_delta(q3, q3, v, g, beta, s0, out, True)


class _Count:
    def __init__(self, monkeypatch):
        self.n = 0
        real = linear_attn._c_step

        def counting(*a, **kw):
            self.n += 1
            return real(*a, **kw)
        monkeypatch.setattr(linear_attn, "_c_step", counting)


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_moe_text"])
def test_offloaded_model_decodes_through_the_kernel_with_the_unmodified_logits(arch,
                                                                               monkeypatch):
    calls = _Count(monkeypatch)
    ref, m = tiny_model(arch), tiny_model(arch)
    eng = offload(m, dtype="f32", cache=1.0)
    calls.n = 0  # (offload's own check of the kernel against the modeling module's rule)
    try:
        assert eng.recurrent["c_gated_delta"] == ["model.layers.0.linear_attn",
                                                  "model.layers.2.linear_attn"]
        ids = torch.tensor([[1, 5, 9, 33, 7, 64, 3]])
        kw = dict(max_new_tokens=8, do_sample=False, output_scores=True,
                  return_dict_in_generate=True, pad_token_id=0)
        with torch.no_grad():
            want = ref.generate(ids, **kw)
            assert calls.n == 0  # the unmodified model keeps transformers' code
            got = m.generate(ids, **kw)
        # both linear-attention layers' prompt (transformers' chunked form) and every decode step
        assert calls.n == 2 * (1 + 7)
        assert torch.equal(got.sequences, want.sequences)
        for a, b in zip(got.scores, want.scores):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    finally:
        eng.close()


@pytest.mark.parametrize("arch", ["qwen3_next", "granitemoehybrid", "lfm2_moe", "jamba",
                                  "kimi_linear"])
def test_bf16_short_convolutions_run_in_f32(arch):
    ref, m = tiny_model(arch, dtype=torch.bfloat16), tiny_model(arch, dtype=torch.bfloat16)
    eng = offload(m, dtype="bf16", cache=1.0)
    try:
        convs = eng.recurrent["f32_convs"]
        assert convs and all(m.get_submodule(n).weight.dtype == torch.float32 for n in convs)
        ids = torch.tensor([[1, 5, 9, 33, 7, 64, 3]])
        kw = dict(max_new_tokens=6, do_sample=False, output_scores=True,
                  return_dict_in_generate=True, pad_token_id=0)
        with torch.no_grad():
            want, got = ref.generate(ids, **kw), m.generate(ids, **kw)
        # the same model up to bf16 rounding (the product is now formed in f32)
        for a, b in zip(got.scores[:1], want.scores[:1]):
            torch.testing.assert_close(a.float(), b.float(), atol=0.1, rtol=0.05)
    finally:
        eng.close()


# ---- the fused gated DeltaNet module (specmoe._C.GdnBlock, fuse_gated_deltanet) ----

GDN = ["qwen3_5_moe_text", "qwen3_next"]  # Qwen3.5's projections, and Qwen3-Next's interleaved


def _fused(dtype, arch="qwen3_5_moe_text"):
    """A tiny Qwen3.5-MoE (or Qwen3-Next) model offloaded with its dense layers in specmoe's
    kernels (so its gated DeltaNet modules are fused), and its engine."""
    m = tiny_model(arch, dtype=dtype)
    sd = "bf16" if dtype == torch.bfloat16 else "f32"
    return m, offload(m, dtype=sd, cache=1.0, dense=sd)


def _prefilled(m, rows, dtype):
    """A cache after a 6-token prefill of `rows` random prompts through m, layer 0's conv
    window and recurrent state in it, and a random next input x [rows, 1, hidden]."""
    g = torch.Generator().manual_seed(rows)
    ids = torch.randint(3, m.config.vocab_size, (rows, 6), generator=g)
    with torch.no_grad():
        cache = m(ids, use_cache=True).past_key_values
    x = torch.randn(rows, 1, m.config.hidden_size, generator=g).to(dtype)
    return cache, cache.get_conv_state(0), cache.get_recurrent_state(0), x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("arch", GDN)
def test_fused_step_equals_the_module_forward(arch, dtype, rows):
    """One cached decode token of `rows` sequences: the block's output, conv window and
    recurrent state against transformers' own forward of the same module (the same CLinear
    projections) on the same states; bf16: the model's roundings reproduced step by step."""
    m, eng = _fused(dtype, arch)
    try:
        mod = m.model.layers[0].linear_attn
        assert mod._specmoe_gdn is not None
        cache, conv, rec, x = _prefilled(m, rows, dtype)
        c0, r0 = conv.clone(), rec.clone()
        with torch.no_grad():
            got = mod(x, cache=cache)
            got_conv, got_rec = conv.clone(), rec.clone()
            conv.copy_(c0)
            rec.copy_(r0)
            want = type(mod).forward(mod, x, cache=cache)
        assert not torch.equal(got_conv, c0) and not torch.equal(got_rec, r0)
        assert torch.equal(got_conv, conv)  # the window shifted by the new q|k|v column
        scale = float(want.abs().max())
        torch.testing.assert_close(got_rec, rec, rtol=1e-5, atol=1e-6 * float(rec.abs().max()))
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * scale)
        else:  # the rule's f32 sums in another order can move a rounding by one bf16 step
            assert (got == want).float().mean() > 0.95
            torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=1e-3 * scale)
    finally:
        eng.close()


class _Counting:
    """A GdnBlock stand-in that counts its step calls (n) and layer calls (layers)."""

    def __init__(self, blk):
        self.blk, self.n, self.layers = blk, 0, 0

    def step(self, *a):
        self.n += 1
        return self.blk.step(*a)

    def layer(self, *a):
        self.layers += 1
        return self.blk.layer(*a)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", GDN)
def test_fused_model_decodes_a_batch_as_the_unfused_one(arch, dtype, monkeypatch):
    """generate of two rows: every decode step of both linear-attention layers through the
    block (their whole decoder layer in one call: the MoE blocks route in C), tokens and
    logits as the same offload without the fusion."""
    from specmoe.models import dense
    m, eng = _fused(dtype, arch)
    mods = [m.get_submodule(n) for n in eng.dense.fused if n.endswith("linear_attn")]
    assert len(mods) == 2
    for mod in mods:
        mod._specmoe_gdn = _Counting(mod._specmoe_gdn)
    monkeypatch.setattr(dense, "fuse_gated_deltanet", lambda model, ctx: [])
    ref, ref_eng = _fused(dtype, arch)
    assert not any(n.endswith("linear_attn") for n in ref_eng.dense.fused)
    try:
        ids = torch.tensor([[1, 5, 9, 33, 7, 64, 3], [4, 8, 15, 16, 23, 42, 2]])
        kw = dict(max_new_tokens=6, do_sample=False, output_scores=True,
                  return_dict_in_generate=True, pad_token_id=0)
        with torch.no_grad():
            want, got = ref.generate(ids, **kw), m.generate(ids, **kw)
        # (the prefill is the module's own forward)
        assert [(mod._specmoe_gdn.n, mod._specmoe_gdn.layers) for mod in mods] == [(0, 5)] * 2
        assert torch.equal(got.sequences, want.sequences)
        for a, b in zip(got.scores, want.scores):
            torch.testing.assert_close(a.float(), b.float(), atol=1e-4, rtol=1e-4)
    finally:
        eng.close()
        ref_eng.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("arch", GDN)
def test_one_call_layer_equals_the_module_by_module_path(arch, dtype, rows):
    """_C.GdnBlock.layer (input norm, the module, residual add, post-attention norm, the MoE
    block routed in C, residual add) against the same decoder layer run module by module
    (transformers' layer forward over the CRMSNorms, the fused module's step and the routed
    MoE block): the same output and states, bit for bit."""
    m, eng = _fused(dtype, arch)
    try:
        layer = m.model.layers[0]
        assert chain_step(layer) is not None and eng.routed_in_c
        cache, conv, rec, x = _prefilled(m, rows, dtype)
        c0, r0 = conv.clone(), rec.clone()
        blk = layer.linear_attn._specmoe_gdn = _Counting(layer.linear_attn._specmoe_gdn)
        with torch.no_grad():
            got = layer(x, attention_mask=None, cache=cache)
            assert (blk.layers, blk.n) == (1, 0)
            got_conv, got_rec = conv.clone(), rec.clone()
            conv.copy_(c0)
            rec.copy_(r0)
            want = type(layer).forward(layer, x, position_embeddings=None, attention_mask=None,
                                       cache=cache)
            assert (blk.layers, blk.n) == (1, 1)
        assert torch.equal(got, want) and torch.equal(got_conv, conv)
        assert torch.equal(got_rec, rec) and not torch.equal(got_rec, r0)
    finally:
        eng.close()


def test_gdn_block_refuses_bad_shapes_by_name():
    m, eng = _fused(torch.float32)
    try:
        mod = m.model.layers[0].linear_attn
        blk, (C, Hv, dk, dv, _) = mod._specmoe_gdn, mod._specmoe_gdn_shape
        ctx = eng._kctx
        f32 = lambda n: np.zeros(n, np.float32)  # noqa: E731
        ins = tuple(p._c for p in (mod.in_proj_qkv, mod.in_proj_z, mod.in_proj_b,
                                   mod.in_proj_a))
        out_c = mod.out_proj._c
        parts = dict(conv_weight=np.zeros((C, 4), np.float32), decay=f32(Hv), dt_bias=f32(Hv),
                     norm_weight=f32(dv), k_heads=2, v_heads=Hv, k_dim=dk, v_dim=dv)
        with pytest.raises(ValueError, match="the input projections give"):
            _C.GdnBlock(ctx, (ins[0], ins[0], ins[2], ins[3]), out_c, **parts)
        with pytest.raises(ValueError, match="expected hidden=128 inputs"):  # (hidden from out)
            _C.GdnBlock(ctx, ins, ins[0], **parts)
        with pytest.raises(TypeError, match="inputs must be a tuple"):
            _C.GdnBlock(ctx, ins * 2, out_c, **parts)
        with pytest.raises(ValueError, match="decay"):
            _C.GdnBlock(ctx, ins, out_c, **dict(parts, decay=f32(Hv + 1)))
        with pytest.raises(ValueError, match="out of range"):
            _C.GdnBlock(ctx, ins, out_c, **dict(  # (v_heads not a multiple)
                parts, k_heads=3, conv_weight=np.zeros((6 * dk + Hv * dv, 4), np.float32)))
        ny = C + Hv * dv + 2 * Hv
        with pytest.raises(ValueError, match="not a permutation"):
            _C.GdnBlock(ctx, ins, out_c, **parts, order=np.zeros(ny, np.int32))
        with pytest.raises(ValueError, match="order"):
            _C.GdnBlock(ctx, ins, out_c, **parts, order=np.arange(ny - 1, dtype=np.int32))
        hidden = m.config.hidden_size
        x, out = np.zeros((2, hidden), np.float32), np.zeros((2, hidden), np.float32)
        conv, st = np.zeros((2, C, 4), np.float32), np.zeros((2, Hv, dk, dv), np.float32)
        with pytest.raises(ValueError, match=r"conv \[rows, channels, kernel\]"):
            blk.step(x, conv[:, :, :3].copy(), st, out)
        with pytest.raises(ValueError, match=r"state \[rows, v_heads, k_dim, v_dim\]"):
            blk.step(x, conv, st[:1].copy(), out)
        with pytest.raises(ValueError, match="max_rows"):
            blk.step(np.zeros((65, hidden), np.float32), conv, st, out)
        with pytest.raises(ValueError, match="must not alias"):
            blk.step(x, conv, st, st.reshape(-1)[:2 * hidden].reshape(2, hidden))
        w = np.ones(hidden, np.float32)
        larg = (eng._layers, 0, 0, x, conv, st, w, 1e-6, w, 1e-6, True)
        with pytest.raises(TypeError, match="layer"):
            blk.layer(*larg)
        with pytest.raises(ValueError, match="pos 9 outside"):
            blk.layer(eng._layers, 9, *larg[2:], out)
        with pytest.raises(ValueError, match="same dtype"):
            blk.layer(*larg, np.zeros((2, hidden), np.uint16))
        with pytest.raises(ValueError, match="ln has"):
            blk.layer(*larg[:6], w[1:].copy(), *larg[7:], out)
        before = conv.copy(), st.copy()
        blk.step(x, conv, st, out)  # a zero input and state: nothing but the window moves
        assert np.array_equal(conv, before[0]) and not np.any(out)
    finally:
        eng.close()


@pytest.mark.parametrize("arch", ["qwen3_5_moe_text", "qwen3_next"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zero_centred_rms_norms_run_in_c_as_torch_does(arch, dtype):
    """Qwen3-Next's and Qwen3.5's RMSNorms ((1 + w) in f32, one rounding) replaced by CRMSNorm:
    every one of them, none left in torch at a decode step; outputs as the module's own (bf16:
    bit for bit; f32: to rounding), with weights away from zero."""
    from specmoe.models.arch import ZERO_CENTRED_RMSNORMS
    from specmoe.models.layers import CRMSNorm, norm_weight
    m = tiny_model(arch, dtype=dtype)
    def left() -> list[str]:  # the zero-centred norms not (yet) inside a CRMSNorm
        return [n for n, mod in m.named_modules() if type(mod).__name__ in ZERO_CENTRED_RMSNORMS
                and not isinstance(m.get_submodule(n.rpartition(".")[0]), CRMSNorm)]
    n_norms = len(left())
    eng = offload(m, dtype="bf16" if dtype == torch.bfloat16 else "f32", cache=1.0,
                  dense="bf16" if dtype == torch.bfloat16 else "f32")
    try:
        norms = [mod for mod in m.modules() if isinstance(mod, CRMSNorm)]
        assert len(norms) == n_norms > 0 and left() == []
        assert all(mod.zero_centred and norm_weight(mod) is None for mod in norms)
        g = torch.Generator().manual_seed(0)
        for mod in norms:
            with torch.no_grad():
                mod.inner.weight.copy_(torch.randn(mod.inner.weight.shape, generator=g) * 0.3)
                mod._w[:] = (1.0 + mod.inner.weight.float()).numpy()
                x = (torch.randn(3, 2, mod._w.shape[0], generator=g) * 3).to(dtype)
                got, want = mod(x), mod.inner(x)
            if dtype == torch.bfloat16:
                assert torch.equal(got, want)
            else:
                torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-6)
    finally:
        eng.close()


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_moe_text"])
def test_a_prompt_past_one_chunk_takes_the_kernel_with_transformers_chunked_result(arch,
                                                                                  monkeypatch):
    """transformers runs a prompt's gated delta rule in its chunked form (64-token chunks); the
    offloaded model's layers run it through the per-token kernel instead: two prompts of 150
    tokens (three chunks, the last one short) in one batch give the unmodified model's logits
    at every position, and the state the next decode step reads gives its next logits too."""
    calls = _Count(monkeypatch)
    ref, m = tiny_model(arch), tiny_model(arch)
    eng = offload(m, dtype="f32", cache=1.0)
    calls.n = 0
    try:
        g = torch.Generator().manual_seed(3)
        ids = torch.randint(1, 100, (2, 150), generator=g)
        with torch.no_grad():
            want = ref(input_ids=ids, use_cache=True)
            got = m(input_ids=ids, use_cache=True)
            assert calls.n == 2  # the prompt: one kernel call per linear-attention layer
            torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=1e-4)
            nxt = want.logits[:, -1].argmax(-1, keepdim=True)
            w2 = ref(input_ids=nxt, use_cache=True, **cache_kwargs(ref, want.past_key_values))
            g2 = m(input_ids=nxt, use_cache=True, **cache_kwargs(m, got.past_key_values))
        torch.testing.assert_close(g2.logits, w2.logits, atol=1e-4, rtol=1e-4)
    finally:
        eng.close()

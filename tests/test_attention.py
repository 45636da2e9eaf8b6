"""The models' own attention at decode sizes in C (specmoe._C.AttnDecode, specmoe.models.attention):
the kernel against a float64 numpy softmax reference (multi-head, grouped-query, multi-query;
masks; bf16 caches; strided caches), and on tiny models against transformers' own sdpa / eager
attention -- decode steps and verification chunks on a cache, left-padded batches -- with the
fall-back to transformers for prefill."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from specmoe import _C
from specmoe.models.attention import ATTENTION_MAX_TOKENS, use_c_attention
from specmoe.storage.quant import bf16_to_f32, f32_to_bf16
from specmoe.models.testing import tiny_model
from specmoe.speculation.decoding import cache_kwargs

from .attn_helpers import ISAS, causal, mask_of

D = 24  # not a multiple of 16: the dot products' tails run


def _reference(q, k, v, bias, scale, sinks=None):
    """out [B, T, H, D] in float64 (sinks [H]: GPT-OSS's, as transformers' eager attention:
    a column of the head's sink logit in the softmax, dropped before the values)."""
    B, H, T, _ = q.shape
    Hkv = k.shape[1]
    out = np.zeros((B, T, H, q.shape[3]))
    for b in range(B):
        for h in range(H):
            g = h // (H // Hkv)
            s = q[b, h].astype(np.float64) @ k[b, g].astype(np.float64).T * scale
            if bias is not None:
                s = s + bias[0 if bias.shape[0] == 1 else b]
            if sinks is not None:
                s = np.concatenate([s, np.full((T, 1), float(sinks[h]))], axis=1)
            with np.errstate(invalid="ignore"):
                p = np.exp(s - s.max(axis=1, keepdims=True))
                p = p / p.sum(axis=1, keepdims=True)
            if sinks is not None:
                p = p[:, :-1]
            out[b, :, h] = np.nan_to_num(p) @ v[b, g].astype(np.float64)
    return out


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("H,Hkv", [(4, 4), (6, 2), (4, 1)])
@pytest.mark.parametrize("B,T,S", [(1, 1, 1), (1, 1, 37), (2, 3, 20)])
@pytest.mark.parametrize("mask", ["none", "shared", "per_row"])
@pytest.mark.parametrize("bf16", [False, True])
def test_matches_reference(isa, H, Hkv, B, T, S, mask, bf16):
    rng = np.random.default_rng(H * 100 + Hkv * 10 + B + T + S)
    q = rng.standard_normal((B, H, T, D), dtype=np.float32)
    k = rng.standard_normal((B, Hkv, S, D), dtype=np.float32)
    v = rng.standard_normal((B, Hkv, S, D), dtype=np.float32)
    bias = mask_of(mask, T, S, B)
    if bf16:
        k, v = f32_to_bf16(k), f32_to_bf16(v)
        ref = _reference(q, bf16_to_f32(k).reshape(k.shape), bf16_to_f32(v).reshape(v.shape),
                         bias, 0.3)
    else:
        ref = _reference(q, k, v, bias, 0.3)
    ctx = _C.KernelContext(2)
    ctx.set_isa(isa)
    out = np.full((B, T, H, D), np.nan, dtype=np.float32)
    _C.AttnDecode(ctx).forward(q, k, v, bias, out, 0.3)
    np.testing.assert_allclose(out, ref, rtol=2e-4, atol=2e-5)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("mask", ["none", "per_row"])
def test_attention_sinks_match_reference(isa, mask):
    """GPT-OSS's sinks: one logit per head in the softmax's denominator; a row whose every
    position is masked gets zeros (the sink takes the whole weight), as torch gives."""
    B, H, Hkv, T, S = 2, 6, 2, 3, 21
    rng = np.random.default_rng(7)
    q = rng.standard_normal((B, H, T, D), dtype=np.float32)
    k = rng.standard_normal((B, Hkv, S, D), dtype=np.float32)
    v = rng.standard_normal((B, Hkv, S, D), dtype=np.float32)
    sinks = (3 * rng.standard_normal(H)).astype(np.float32)
    bias = mask_of(mask, T, S, B)
    if bias is not None:
        bias[1, 2, :] = -np.inf  # one query row fully masked
    ctx = _C.KernelContext(2)
    ctx.set_isa(isa)
    out = np.full((B, T, H, D), np.nan, dtype=np.float32)
    _C.AttnDecode(ctx).forward(q, k, v, bias, out, 0.3, sinks)
    np.testing.assert_allclose(out, _reference(q, k, v, bias, 0.3, sinks), rtol=2e-4,
                               atol=2e-5)
    if bias is not None:
        assert not out[1, 2].any()
    plain = np.empty_like(out)
    _C.AttnDecode(ctx).forward(q, k, v, bias, plain, 0.3, None)  # None: no sinks
    np.testing.assert_allclose(plain, _reference(q, k, v, bias, 0.3), rtol=2e-4, atol=2e-5)
    for bad, what in ((sinks[:4], "sinks has 4 entries"),
                      (np.array([np.inf] * H, np.float32), "finite")):
        with pytest.raises(ValueError, match=what):
            _C.AttnDecode(ctx).forward(q, k, v, bias, out, 0.3, bad)


@pytest.mark.parametrize("bf16", [False, True])
@pytest.mark.parametrize("B,H,Hkv", [(2, 6, 3), (1, 6, 1)])
def test_strided_cache_and_thread_independent_bits(bf16, B, H, Hkv):
    """A cache buffer longer than the positions in use (each head's [S, D] block dense, heads
    and rows strided) reads as its first S positions; the bits do not depend on the thread
    count or the ISA (bf16 caches: AVX2 and AVX-512 have loops of their own for them,
    mla_avx2.c and mla_avx512.c; the left-padding mask's -inf positions are skipped there
    too), nor on how the query heads of a key/value head are grouped into items (one
    key/value head and 1-4 threads: items of 6, 3, 2 and 2 heads)."""
    rng = np.random.default_rng(5)
    T, S, Smax = 2, 29, 40
    q = rng.standard_normal((B, H, T, D), dtype=np.float32)
    kb = rng.standard_normal((B, Hkv, Smax, D), dtype=np.float32)
    vb = rng.standard_normal((B, Hkv, Smax, D), dtype=np.float32)
    if bf16:
        kb, vb = f32_to_bf16(kb), f32_to_bf16(vb)
    k, v = kb[:, :, :S], vb[:, :, :S]
    assert not k.flags.c_contiguous or B * Hkv == 1  # (one block: strides without effect)
    bias = mask_of("per_row", T, S, B)
    if bf16:
        ref = _reference(q, bf16_to_f32(k).reshape(k.shape), bf16_to_f32(v).reshape(v.shape),
                         bias, 0.2)
    else:
        ref = _reference(q, k, v, bias, 0.2)
    outs = []
    for isa in ISAS:
        for n in (1, 2, 3, 4):
            ctx = _C.KernelContext(n)
            ctx.set_isa(isa)
            out = np.empty((B, T, H, D), np.float32)
            _C.AttnDecode(ctx).forward(q, k, v, bias, out, 0.2)
            outs.append(out)
    np.testing.assert_allclose(outs[0], ref, rtol=2e-4, atol=2e-5)
    for o in outs[1:]:
        np.testing.assert_array_equal(o, outs[0])


def test_bad_input_raises_and_leaves_out_alone():
    rng = np.random.default_rng(9)
    q = rng.standard_normal((1, 4, 2, D), dtype=np.float32)
    k = rng.standard_normal((1, 2, 6, D), dtype=np.float32)
    att = _C.AttnDecode(_C.KernelContext(1))
    out = np.full((1, 2, 4, D), 7.0, np.float32)
    bad = [
        ((q, k, k[:, :, :, :-1].copy(), None, out, 0.1), "v"),
        ((q, k, f32_to_bf16(k), None, out, 0.1), "same dtype"),
        ((q, k[:, :, :, ::2], k[:, :, :, ::2], None, out, 0.1), "dense"),
        ((q, np.zeros((1, 3, 6, D), np.float32), np.zeros((1, 3, 6, D), np.float32), None, out,
          0.1), "multiple of kv_heads"),
        ((q, k, k, np.zeros((1, 2, 5), np.float32), out, 0.1), "bias"),
        ((q, k, k, np.zeros((3, 2, 6), np.float32), out, 0.1), "rows"),
        ((q, k, k, None, np.zeros((1, 2, 4, D - 1), np.float32), 0.1), "out"),
        ((q, k, k, None, out, -1.0), "scale"),
        ((q.astype(np.float64), k, k, None, out, 0.1), "q"),
    ]
    for args, what in bad:
        with pytest.raises((ValueError, TypeError), match=what):
            att.forward(*args)
    np.testing.assert_array_equal(out, 7.0)
    with pytest.raises(TypeError, match="6 or 7 arguments"):
        att.forward(q, k, k, None, out)


ARCHS = ["mixtral", "olmoe", "qwen3_moe"]


def _pair(arch, impl="sdpa"):
    ref = tiny_model(arch, overrides={"sliding_window": 8} if arch == "gpt_oss" else None)
    ref.set_attn_implementation(impl)
    m = copy.deepcopy(ref)
    return ref, m


def _count_calls(m):
    """Count the C kernel's calls on every attention module of m."""
    calls = []
    for mod in m.modules():
        kern = getattr(mod, "_specmoe_attn", None)
        if kern is not None and not hasattr(mod, "_counted"):
            class Counting:
                def __init__(self, k):
                    self.k = k

                def forward(self, *a):
                    calls.append(a[0].shape[2])
                    return self.k.forward(*a)
            mod._specmoe_attn = Counting(kern)
            mod._counted = True
    return calls


@pytest.mark.parametrize("arch,impl", [(a, i) for a in ARCHS for i in ("sdpa", "eager")]
                         + [("gpt_oss", "eager")])
def test_decode_and_verify_chunks_match_transformers(arch, impl):
    """... and GPT-OSS (attention sinks; a sliding window of 8 on every other layer, which the
    cached positions outgrow)."""
    ref, m = _pair(arch, impl)
    assert use_c_attention(m) == f"specmoe_{impl}"
    assert use_c_attention(m) == f"specmoe_{impl}"              # idempotent
    calls = _count_calls(m)
    ids = torch.randint(3, 100, (1, ATTENTION_MAX_TOKENS + 14),
                        generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = ref(ids).logits
        kv = DynamicCache(config=m.config)
        first = ATTENTION_MAX_TOKENS + 4                         # prefill: transformers
        parts = [m(ids[:, :first], **cache_kwargs(m, kv), use_cache=True).logits]
        assert calls == []
        pos = first
        for T in (1, 4, 1, 3, 1):
            parts.append(m(ids[:, pos:pos + T], **cache_kwargs(m, kv), use_cache=True).logits)
            pos += T
        got = torch.cat(parts, 1)
    assert calls == [T for T in (1, 4, 1, 3, 1) for _ in range(m.config.num_hidden_layers)]
    torch.testing.assert_close(got, full[:, :pos], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe"])
def test_left_padded_batch_generate_equal(arch):
    ref, m = _pair(arch)
    use_c_attention(m)
    calls = _count_calls(m)
    a = torch.tensor([[0, 0, 0, 5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17]])
    am = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [1] * 8])
    kw = dict(attention_mask=am, max_new_tokens=8, do_sample=False, pad_token_id=0,
              output_logits=True, return_dict_in_generate=True)
    r, g = ref.generate(a, **kw), m.generate(a, **kw)
    assert calls                                                 # the decode steps ran in C
    assert torch.equal(r.sequences, g.sequences)
    for x, y in zip(r.logits, g.logits):
        assert torch.isfinite(y).all()
        torch.testing.assert_close(y, x, atol=2e-5, rtol=1e-4)


def test_bf16_model_close_to_transformers():
    """In bf16 the kernel computes in f32 and rounds once: against the f32 model, its decode
    logits are no further than transformers' own bf16 attention's."""
    m32 = tiny_model("mixtral")
    mb = copy.deepcopy(m32).to(torch.bfloat16)
    mc = copy.deepcopy(mb)
    use_c_attention(mc)
    ids = torch.randint(3, 100, (1, 20), generator=torch.Generator().manual_seed(3))
    outs = []
    with torch.no_grad():
        for mod in (m32, mb, mc):
            kv = DynamicCache(config=mod.config)
            mod(ids[:, :-1], **cache_kwargs(mod, kv), use_cache=True)
            outs.append(mod(ids[:, -1:], **cache_kwargs(mod, kv), use_cache=True).logits.float())
    e_tf = (outs[1] - outs[0]).norm().item()
    e_c = (outs[2] - outs[0]).norm().item()
    assert e_c <= 1.5 * e_tf + 1e-6, (e_c, e_tf)


def test_left_alone_when_it_cannot_apply():
    m = tiny_model("mixtral")
    m.config._attn_implementation = "flex_attention"
    assert use_c_attention(m) is None
    assert m.config._attn_implementation == "flex_attention"
    assert not any(hasattr(mod, "_specmoe_attn") for mod in m.modules())


def test_offload_with_dense_uses_it():
    from specmoe.runtime import engine as hf
    ref = tiny_model("mixtral")
    m = tiny_model("mixtral")
    eng = hf.offload(m, dtype="f32", dense="f32")
    try:
        assert eng.dense.attention == "specmoe_sdpa"
        assert "attention specmoe_sdpa" in str(eng.dense)
        prompt = torch.tensor([[1, 5, 9, 14, 3, 27, 8, 60]])
        assert torch.equal(ref.generate(prompt, max_new_tokens=12, do_sample=False),
                           m.generate(prompt, max_new_tokens=12, do_sample=False))
    finally:
        eng.close()

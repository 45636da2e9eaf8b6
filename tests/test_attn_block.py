"""A decoder layer's whole attention module at decode sizes in C (specmoe._C.AttnBlock,
specmoe.models.attention.fuse_attention): on tiny models of each fusable form (OLMoE's q/k norm over
all heads, Qwen3's per head, Qwen2-MoE's projection biases, Mixtral's plain form), decode steps
and verification chunks on a cache against the unmodified transformers model (f32) and, for bf16
models, bit for bit against the same model with torch doing the norms, rotary and casts between
the same C projections; the fall-back to the module's own forward; bad input."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from transformers import DynamicCache

from specmoe import _C
from specmoe.models.attention import ATTENTION_MAX_TOKENS, fuse_attention
from specmoe.models.dense import convert_dense
from specmoe.models.layers import CLinear, chain_step
from specmoe.runtime.kvcache import BufferedLayer
from specmoe.models.testing import tiny_model

from .attn_helpers import layer_outputs

ARCHS = ["olmoe", "qwen3_moe", "qwen2_moe", "mixtral", "glm4_moe", "glm4_moe+qk_norm", "gpt_oss",
         "ernie4_5_moe"]


def _tiny(arch: str, **kw):
    """tiny_model of ``arch``; "glm4_moe+qk_norm": GLM-4.5 with its optional per-head q/k norms
    (plain glm4_moe has none; both with q/k/v biases and half of each head rotary); gpt_oss
    (q/k/v/o biases, sinks, sliding-window layers of 64 positions, the f32-scaled norms, the
    half-table rotary) with random norm weights and sinks: at 1 the f32-scaled norm is the
    Llama one, and sinks of 0 hide a sink read for another head's; ernie4_5_moe (the rotary
    on each head's pairs, a dense first layer) with random norm weights too."""
    if arch == "glm4_moe+qk_norm":
        return tiny_model("glm4_moe", overrides={"use_qk_norm": True}, **kw)
    m = tiny_model(arch, **kw)
    if arch in ("gpt_oss", "ernie4_5_moe"):
        g = torch.Generator().manual_seed(4)
        with torch.no_grad():
            for layer in m.model.layers:
                for n in (layer.input_layernorm, layer.post_attention_layernorm):
                    n.weight.copy_(1 + 0.3 * torch.randn(n.weight.shape, generator=g))
                s = getattr(layer.self_attn, "sinks", None)
                if s is not None:
                    s.copy_(torch.randn(s.shape, generator=g))
    return m
STEPS = (1, 4, 1, 3, 1)


class _Counting:
    """Stands in for a module's AttnBlock and records the token count of each pre call, and
    of each layer call (a dense layer's, its MLP in the block: set_mlp)."""

    def __init__(self, blk, calls):
        self.blk, self.calls = blk, calls

    def pre(self, x, *a):
        self.calls.append(x.shape[0])
        return self.blk.pre(x, *a)

    def post(self, *a):
        return self.blk.post(*a)

    def layer(self, *a):
        self.calls.append(a[3].shape[0])
        return self.blk.layer(*a)


def _fused(model, fmt):
    rep = convert_dense(model, fmt)
    calls: list[int] = []
    for mod in model.modules():
        if getattr(mod, "_specmoe_block", None) is not None:
            mod._specmoe_block = _Counting(mod._specmoe_block, calls)
    return rep, calls


def _unfused(model):
    """The same conversion with the fusion undone: torch runs norms, rotary, residual adds and
    casts around the same C projections and C attention kernel."""
    for mod in model.modules():
        if getattr(mod, "_specmoe_block", None) is not None \
                or getattr(chain_step(mod), "norms", None) is not None:
            del mod.forward
    return model


def _decode(model, ids, first):
    kv = DynamicCache(config=model.config)
    with torch.no_grad():
        parts = [model(ids[:, :first], cache=kv, use_cache=True).logits]
        pos = first
        for T in STEPS:
            parts.append(model(ids[:, pos:pos + T], cache=kv, use_cache=True).logits)
            pos += T
    return torch.cat(parts, 1), pos


@pytest.mark.parametrize("arch", ARCHS)
def test_f32_decode_matches_transformers(arch):
    ref = _tiny(arch)
    m = copy.deepcopy(ref)
    rep, calls = _fused(m, "f32")
    L = m.config.num_hidden_layers
    assert len(rep.fused) == L and f"({L} fused)" in str(rep)
    assert all(getattr(chain_step(layer), "norms", None) is not None
               for layer in m.model.layers)
    assert fuse_attention(m) == rep.fused                       # idempotent
    ids = torch.randint(3, 100, (1, ATTENTION_MAX_TOKENS + 14),
                        generator=torch.Generator().manual_seed(1))
    first = ATTENTION_MAX_TOKENS + 4                            # prefill: the module's own
    got, pos = _decode(m, ids, first)
    assert calls == [T for T in STEPS for _ in range(L)]
    with torch.no_grad():
        full = ref(ids[:, :pos]).logits
    torch.testing.assert_close(got, full, atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("arch,fmt", [(a, "bf16") for a in ARCHS]
                         + [("olmoe", "int4"), ("qwen2_moe", "int8")])
def test_bf16_decode_bit_identical_to_torch_glue(arch, fmt):
    """A bf16 model's roundings (input norm, projection outputs, q/k norms, rotary products and
    sum, attention output, residual add, post-attention norm) are reproduced step by step: the
    decoder layers' outputs equal, bit for bit, those of the same model with torch doing
    everything between the C kernels.  int8/int4 projections run as one q|k|v matrix in the
    fused path: its rows are the three's."""
    base = _tiny(arch, dtype=torch.bfloat16)
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    _, calls = _fused(a, fmt)
    convert_dense(b, fmt)
    _unfused(b)
    outs = layer_outputs(a=a, b=b)
    ids = torch.randint(3, 100, (1, 30), generator=torch.Generator().manual_seed(2))
    la, _ = _decode(a, ids, 10)
    lb, _ = _decode(b, ids, 10)
    assert len(calls) == (1 + len(STEPS)) * a.config.num_hidden_layers  # prefill of 10 too
    assert len(outs["a"]) == len(outs["b"]) > 0
    for x, y in zip(outs["a"], outs["b"]):
        assert x.dtype == torch.bfloat16 and torch.equal(x, y)
    assert torch.equal(la, lb)


@pytest.mark.parametrize("arch", ["mixtral", "olmoe"])
def test_left_padded_batch_in_c_and_long_prefill_falls_back(arch):
    """A left-padded batch of 2 rows runs through the block (at most ATTENTION_MAX_TOKENS a
    row and BLOCK_MAX_TOKENS in all: the 16-token prefill and every decode step, the padding
    masked) with the tokens of the unmodified model; a prompt longer than that takes the
    module's own forward, its decode steps the block."""
    ref = tiny_model(arch)
    m = copy.deepcopy(ref)
    _, calls = _fused(m, "f32")
    L = m.config.num_hidden_layers
    a = torch.tensor([[0, 0, 0, 5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17]])
    am = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [1] * 8])
    kw = dict(attention_mask=am, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(ref.generate(a, **kw), m.generate(a, **kw))
    assert calls == [16] * L + [2] * (5 * L)                    # batch 2 in C, x [rows * T]
    calls.clear()
    long = torch.randint(3, 100, (1, ATTENTION_MAX_TOKENS + 1),
                         generator=torch.Generator().manual_seed(4))
    kw = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(ref.generate(long, **kw), m.generate(long, **kw))
    assert calls == [1] * (4 * L)                               # 4 decode steps in C
    calls.clear()
    three = torch.randint(3, 100, (3, 6), generator=torch.Generator().manual_seed(5))
    assert torch.equal(ref.generate(three, **kw), m.generate(three, **kw))
    assert calls == [18] * L + [3] * (4 * L)  # 18 prompt tokens, 6 a row: in C (<= 64 in all)
    calls.clear()
    five = torch.randint(3, 100, (5, 16), generator=torch.Generator().manual_seed(6))
    assert torch.equal(ref.generate(five, **kw), m.generate(five, **kw))
    assert calls == [5] * (4 * L)       # 80 prompt tokens: the module's own; decode steps in C


def test_not_fused_without_c_projections_or_with_clipping():
    m = tiny_model("olmoe")
    assert fuse_attention(m) == []                              # torch projections
    m.config.clip_qkv = 4.0
    rep = convert_dense(m, "f32")
    assert rep.fused == [] and rep.converted
    assert not any(hasattr(mod, "_specmoe_block") for mod in m.modules())


def _block_parts(H=4, Hkv=2, D=8, hidden=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    lin = [torch.nn.Linear(i, o, bias=False) for i, o in
           ((hidden, H * D), (hidden, Hkv * D), (hidden, Hkv * D), (H * D, hidden))]
    for li in lin:
        li.weight.data = torch.randn(li.weight.shape, generator=g) * 0.1
    return [CLinear(li, "f32")._c for li in lin]


def test_bad_input_raises_and_leaves_outputs_alone():
    ctx = _C.KernelContext(1)
    q, k, v, o = _block_parts()
    with pytest.raises(TypeError, match="Linear"):
        _C.AttnBlock(ctx, q, k, v, "o", 4, 2, 8)
    with pytest.raises(ValueError, match="the k projection"):
        _C.AttnBlock(ctx, q, q, v, o, 4, 2, 8)
    with pytest.raises(ValueError, match="norm must be"):
        _C.AttnBlock(ctx, q, k, v, o, 4, 2, 8, norm="layer")
    with pytest.raises(ValueError, match="q_norm has 8 weights, expected 32"):
        _C.AttnBlock(ctx, q, k, v, o, 4, 2, 8, norm="full", q_norm=np.ones(8, np.float32),
                     k_norm=np.ones(16, np.float32))
    with pytest.raises(ValueError, match="multiple of kv_heads"):
        _C.AttnBlock(ctx, q, k, v, o, 4, 3, 8)
    blk = _C.AttnBlock(ctx, q, k, v, o, 4, 2, 8, max_tokens=4)
    x = np.ones((2, 32), np.float32)
    cs = np.ones((2, 8), np.float32)
    qo = np.full((1, 4, 2, 8), 7.0, np.float32)
    ko = np.full((1, 2, 2, 8), 7.0, np.float32)
    vo = ko.copy()
    bad = [((np.ones((5, 32), np.float32), np.ones((5, 8), np.float32),
             np.ones((5, 8), np.float32), qo, ko, vo), "5 tokens"),
           ((x, cs[:, :6].copy(), cs, qo, ko, vo), "cos"),
           ((x, cs, cs, qo[:, :3].copy(), ko, vo), "q"),
           ((x, cs, cs, qo, ko, vo[:, :, :1].copy()), "v"),
           ((x.astype(np.float64), cs, cs, qo, ko, vo), "x")]
    for args, what in bad:
        with pytest.raises(ValueError, match=what):
            blk.pre(*args)
    for arr in (qo, ko, vo):
        np.testing.assert_array_equal(arr, 7.0)
    blk.pre(x, cs, np.zeros((2, 8), np.float32), qo, ko, vo)
    out = np.full((2, 32), 7.0, np.float32)
    with pytest.raises(ValueError, match="out"):
        blk.post(qo, ko, vo, None, 0.3, np.zeros((2, 31), np.float32))
    with pytest.raises(ValueError, match="same dtype"):
        blk.post(qo, ko, vo.astype(np.float32).view(np.uint16)[..., :8].copy(), None, 0.3, out)
    np.testing.assert_array_equal(out, 7.0)
    with pytest.raises(TypeError, match="6 or 10 arguments"):
        blk.post(qo, ko, vo, None, 0.3)
    with pytest.raises(TypeError, match="6 or 8 arguments"):
        blk.pre(x, cs, cs, qo, ko, vo, np.ones(32, np.float32))
    ln = np.ones(32, np.float32)
    with pytest.raises(ValueError, match="ln has 31 weights"):
        blk.pre(x, cs, cs, qo, ko, vo, np.ones(31, np.float32), 1e-6)
    with pytest.raises(ValueError, match="ln_eps must be in .0, 1., got -1"):
        blk.pre(x, cs, cs, qo, ko, vo, ln, -1.0)
    normed = np.full((2, 32), 7.0, np.float32)
    with pytest.raises(ValueError, match="same dtype"):
        blk.post(qo, ko, vo, None, 0.3, out, x.view(np.uint16)[:, :32].copy(), ln, 1e-6, normed)
    with pytest.raises(ValueError, match="alias"):
        blk.post(qo, ko, vo, None, 0.3, out, x, ln, 1e-6, out)
    with pytest.raises(ValueError, match="resid"):
        blk.post(qo, ko, vo, None, 0.3, out, x[:1].copy(), ln, 1e-6, normed)
    np.testing.assert_array_equal(out, 7.0)
    np.testing.assert_array_equal(normed, 7.0)


def _head_norm_block(H, Hkv, D, hid, seed, rng, max_tokens=16):
    """An AttnBlock with per-head q/k RMSNorms (weights drawn from rng): (block, its four
    projections' C objects, q_norm, k_norm)."""
    parts = _block_parts(H, Hkv, D, hid, seed=seed)
    qn = rng.uniform(0.5, 1.5, D).astype(np.float32)
    kn = rng.uniform(0.5, 1.5, D).astype(np.float32)
    blk = _C.AttnBlock(_C.KernelContext(2), *parts, H, Hkv, D, norm="head", q_norm=qn,
                       k_norm=kn, eps=1e-6, max_tokens=max_tokens)
    return blk, parts, qn, kn


def test_block_against_numpy_reference():
    """pre + post for 2 tokens on a 3-position cache against float64 numpy: the input RMSNorm,
    projections, the per-head RMSNorm, rotate-half rotary, softmax attention with a causal
    bias, o_proj, the residual add and the post-attention RMSNorm."""
    H, Hkv, D, hid = 4, 2, 8, 32
    rng = np.random.default_rng(0)
    blk, parts, qn, kn = _head_norm_block(H, Hkv, D, hid, 5, rng)
    T, S0 = 2, 3
    x = rng.standard_normal((T, hid)).astype(np.float32)
    ang = rng.uniform(0, 6, (T, D // 2))
    cos = np.cos(np.concatenate([ang, ang], 1)).astype(np.float32)
    sin = np.sin(np.concatenate([ang, ang], 1)).astype(np.float32)
    q = np.zeros((1, H, T, D), np.float32)
    k = np.zeros((1, Hkv, T, D), np.float32)
    v = np.zeros((1, Hkv, T, D), np.float32)
    ln1 = rng.uniform(0.5, 1.5, hid).astype(np.float32)
    ln2 = rng.uniform(0.5, 1.5, hid).astype(np.float32)
    blk.pre(x, cos, sin, q, k, v, ln1, 1e-5)                    # with the input layernorm
    Wq, Wk, Wv, Wo = (_weights(p) for p in parts)

    def rms(y, w, eps):
        y = y.astype(np.float64)
        return y / np.sqrt((y ** 2).mean(-1, keepdims=True) + eps) * w

    xn = rms(x, ln1, 1e-5)

    def norm_rope(y, heads, w):
        y = y.reshape(T, heads, D).astype(np.float64)
        y = y / np.sqrt((y ** 2).mean(-1, keepdims=True) + 1e-6) * w
        rh = np.concatenate([-y[..., D // 2:], y[..., :D // 2]], -1)
        return (y * cos[:, None] + rh * sin[:, None]).transpose(1, 0, 2)

    rq = norm_rope(xn @ Wq.T, H, qn)
    rk = norm_rope(xn @ Wk.T, Hkv, kn)
    rv = (xn @ Wv.T).reshape(T, Hkv, D).transpose(1, 0, 2)
    np.testing.assert_allclose(q[0], rq, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(k[0], rk, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(v[0], rv, rtol=1e-5, atol=1e-5)
    old = rng.standard_normal((1, Hkv, S0, D)).astype(np.float32)
    K = np.concatenate([old, k], 2)
    V = np.concatenate([old[..., ::-1].copy(), v], 2)
    S = S0 + T
    bias = np.zeros((1, T, S), np.float32)
    bias[0, 0, S - 1] = np.finfo(np.float32).min                # token 0 does not see token 1
    out = np.zeros((T, hid), np.float32)
    normed = np.zeros((T, hid), np.float32)
    blk.post(q, K, V, bias, 0.35, out, x, ln2, 1e-5, normed)   # residual + post norm
    att = np.zeros((T, H, D))
    for h in range(H):
        g = h // (H // Hkv)
        s = q[0, h].astype(np.float64) @ K[0, g].T * 0.35 + bias[0]
        p = np.exp(s - s.max(1, keepdims=True))
        att[:, h] = (p / p.sum(1, keepdims=True)) @ V[0, g]
    want = x + att.reshape(T, H * D) @ Wo.T
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(normed, rms(want, ln2, 1e-5), rtol=1e-4, atol=1e-5)
    plain = np.zeros((T, hid), np.float32)
    blk.post(q, K, V, bias, 0.35, plain)                        # the attention module alone
    np.testing.assert_allclose(plain, want - x, rtol=1e-4, atol=1e-5)


def _weights(lin_c):
    """The f32 weight matrix a CLinear's C object reads (N, K)."""
    N, K = lin_c.shape
    eye = np.eye(K, dtype=np.float32)
    out = np.zeros((K, N), np.float32)
    lin_c.forward(eye, out)
    return out.T.astype(np.float64)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
def test_joint_qkv_rows_are_the_three_projections(fmt):
    """The q|k|v Linear the block runs for int8/int4 projections: its output is the three
    projections' outputs side by side, and the three CLinears rebuilt over its block give
    the same bits as before."""
    from specmoe.models.layers import fuse_qkv
    ctx = _C.KernelContext(1)
    g = torch.Generator().manual_seed(7)
    lins = []
    for n, bias in ((64, True), (32, False), (32, True)):
        li = torch.nn.Linear(128, n, bias=bias)
        li.weight.data = torch.randn(li.weight.shape, generator=g)
        if bias:
            li.bias.data = torch.randn(n, generator=g)
        lins.append(CLinear(li, fmt, ctx))
    x = torch.randn(3, 128, generator=g)
    before = [c(x) for c in lins]
    qkv = fuse_qkv(lins, ctx)
    assert qkv is not None and qkv.shape == (128, 128)
    assert lins[0]._block is lins[2]._block                      # one joint block
    for c, want in zip(lins, before):
        assert torch.equal(c(x), want)
    out = np.zeros((3, 128), np.float32)
    qkv.forward(x.numpy(), out)
    np.testing.assert_array_equal(out, torch.cat(before, 1).numpy())
    assert fuse_qkv([CLinear(torch.nn.Linear(128, 8), "bf16", ctx)] * 3, ctx) is None


def _decode_with_crop(mdl, ids, prefill, upto, crop, chunk, end=None):
    """A DynamicCache generation of ids: a prefill of `prefill` tokens, one-token steps up to
    position `upto`, a crop of `crop` positions, a chunk of `chunk` tokens from there, then
    one-token steps up to `end` (default: all of ids).  Returns (cache, logits)."""
    kv = DynamicCache(config=mdl.config)
    out = []
    end = ids.shape[1] if end is None else end
    with torch.no_grad():
        out.append(mdl(ids[:, :prefill], cache=kv, use_cache=True).logits)
        for t in range(prefill, upto):
            out.append(mdl(ids[:, t:t + 1], cache=kv, use_cache=True).logits)
        kv.crop(-crop)
        c0 = upto - crop
        out.append(mdl(ids[:, c0:c0 + chunk], cache=kv, use_cache=True).logits)
        for t in range(c0 + chunk, end):
            out.append(mdl(ids[:, t:t + 1], cache=kv, use_cache=True).logits)
    return kv, torch.cat(out, 1)


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_kv_buffers_read_as_transformers_cache(monkeypatch, dt):
    """The fused path keeps a DynamicCache layer's keys/values as prefix views of buffers with
    spare room: after decode steps that outgrow them (spare room forced down to 2 positions),
    a crop (speculative decoding's rollback) and more steps, the cache holds exactly what the
    unfused model's cache holds, and the logits agree."""
    from specmoe.runtime import memplan
    monkeypatch.setattr(memplan, "KV_SPARE", 2)
    base = tiny_model("qwen3_moe", dtype=dt)
    fmt = "f32" if dt == torch.float32 else "bf16"
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    convert_dense(a, fmt)
    convert_dense(b, fmt)
    _unfused(b)
    ids = torch.randint(3, 100, (1, 40), generator=torch.Generator().manual_seed(6))
    caches, logits = [], []
    for mdl in (a, b):
        kv, lg = _decode_with_crop(mdl, ids, 6, 30, 5, 4)     # roll back 5 positions
        caches.append(kv)
        logits.append(lg)
    assert any(isinstance(lay, BufferedLayer) and lay.buffers is not None
               for lay in caches[0].layers)
    for la, lb in zip(caches[0].layers, caches[1].layers):
        assert la.keys.shape == lb.keys.shape == (1, 2, 40, 16)
        if dt == torch.bfloat16:                                # f32: the norms' sum order
            assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)
        torch.testing.assert_close(la.keys, lb.keys, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(la.values, lb.values, atol=1e-6, rtol=1e-6)
    if dt == torch.bfloat16:
        assert torch.equal(logits[0], logits[1])
    else:
        torch.testing.assert_close(logits[0], logits[1], atol=1e-5, rtol=1e-5)


def test_mla_latent_cache_through_kv_buffers(monkeypatch):
    """MLA (DeepSeek-V2) appends its latent and rotary key (different widths) through the
    same buffers: after decode steps, a crop and a 2-token chunk, the cache holds what
    transformers' own DynamicLayer.update gives the same model, and so do the logits."""
    import specmoe.models.mla as mla
    m = tiny_model("deepseek_v2")
    rep = convert_dense(m, "f32")
    assert rep.mla
    for layer in m.model.layers:   # the absorbed attention's kv_append, not the one-call
        del layer.forward          # layers (tests/test_mla_block.py) that write the buffers
    ids = torch.randint(3, 100, (1, 30), generator=torch.Generator().manual_seed(8))

    got, lg = _decode_with_crop(m, ids, 5, 27, 3, 2, end=26)
    monkeypatch.setattr(mla, "kv_append",
                        lambda cache, idx, k, v, kw: cache.update(k, v, idx))
    want, lw = _decode_with_crop(m, ids, 5, 27, 3, 2, end=26)
    buffered = [la for la in got.layers
                if isinstance(la, BufferedLayer) and la.buffers is not None]
    assert len(buffered) == m.config.num_hidden_layers
    for la, lb in zip(got.layers, want.layers):
        assert la.keys.shape == lb.keys.shape == (1, 1, 26, 32)
        assert la.values.shape == lb.values.shape == (1, 1, 26, 8)
        assert torch.equal(la.keys, lb.keys) and torch.equal(la.values, lb.values)
    assert torch.equal(lg, lw)


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["deepseek_v2", "gpt_oss"])  # Llama-form, f32-scaled
def test_crmsnorm_against_the_module_it_replaces(dt, arch):
    """CRMSNorm (the final norm, MLA's latent norm, unfused layers' norms): a bf16 model's
    RMSNorm bit for bit, f32 to rounding; training, long inputs and other dtypes go to the
    original module; convert_norms is idempotent and leaves other norm forms alone.
    GPT-OSS's norm scales in f32 and rounds once (the Llama form rounds, then scales)."""
    from specmoe.models.attention import convert_norms
    from specmoe.models.layers import CRMSNorm
    m = tiny_model(arch, dtype=dt)
    norm = m.model.norm
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(norm.weight.shape, generator=g) + 0.5)
    c = CRMSNorm(norm)
    for T in (1, 5, 64):
        x = (torch.randn(1, T, norm.weight.shape[0], generator=g) * 3).to(dt)
        with torch.no_grad():
            want, got = norm(x), c(x)
        assert got.dtype == want.dtype and got.shape == want.shape
        if dt == torch.bfloat16:
            assert torch.equal(got, want)
        else:
            torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    calls = []
    norm.register_forward_hook(lambda mod, a, o: calls.append(a[0].shape))
    with torch.no_grad():
        c(torch.randn(1, 65, norm.weight.shape[0]).to(dt))          # prefill: torch's
        c(torch.randn(1, 1, norm.weight.shape[0], dtype=torch.float64))
    assert len(calls) == 2
    names = convert_norms(m)
    assert "model.norm" in names and convert_norms(m) == []
    assert all(isinstance(m.get_submodule(n), CRMSNorm) for n in names)
    with pytest.raises(TypeError, match="Llama-form"):
        CRMSNorm(torch.nn.LayerNorm(8))


@pytest.mark.parametrize("B, T", [(3, 2), (8, 7)], ids=["3x2", "8x7-grows"])
def test_block_rows_equal_each_row_alone(B, T):
    """pre + post of a batch of B rows of T tokens (serve's decode batch and its verification
    steps: each row its own positions' rotary, its own cache and mask, holes included) equal
    each row through the block alone.  8 x 7 = 56 tokens: the block's buffers, made for 16,
    grow at its first call (max_tokens 64) and the rows alone then run in the larger ones."""
    H, Hkv, D, hid = 4, 2, 8, 32
    rng = np.random.default_rng(1)
    blk, _, _, _ = _head_norm_block(H, Hkv, D, hid, 7, rng, max_tokens=64)
    S0 = 4
    x = rng.standard_normal((B * T, hid)).astype(np.float32)
    ang = rng.uniform(0, 6, (B * T, D // 2))
    cos = np.cos(np.concatenate([ang, ang], 1)).astype(np.float32)
    sin = np.sin(np.concatenate([ang, ang], 1)).astype(np.float32)
    ln1 = rng.uniform(0.5, 1.5, hid).astype(np.float32)
    ln2 = rng.uniform(0.5, 1.5, hid).astype(np.float32)
    q = np.zeros((B, H, T, D), np.float32)
    k = np.zeros((B, Hkv, T, D), np.float32)
    v = np.zeros((B, Hkv, T, D), np.float32)
    blk.pre(x, cos, sin, q, k, v, ln1, 1e-5)
    old = rng.standard_normal((B, Hkv, S0, D)).astype(np.float32)
    K = np.concatenate([old, k], 2)
    V = np.concatenate([old[..., ::-1].copy(), v], 2)
    S = S0 + T
    bias = np.zeros((B, T, S), np.float32)
    bias[:, 0, S - 1] = np.finfo(np.float32).min   # causal inside the new tokens
    bias[1, :, 0] = np.finfo(np.float32).min       # row 1: a hole where a shorter row pads
    out = np.zeros((B * T, hid), np.float32)
    normed = np.zeros((B * T, hid), np.float32)
    blk.post(q, K, V, bias, 0.35, out, x, ln2, 1e-5, normed)
    for r in range(B):
        rows = slice(r * T, (r + 1) * T)
        q1 = np.zeros((1, H, T, D), np.float32)
        k1 = np.zeros((1, Hkv, T, D), np.float32)
        v1 = np.zeros((1, Hkv, T, D), np.float32)
        blk.pre(x[rows].copy(), cos[rows].copy(), sin[rows].copy(), q1, k1, v1, ln1, 1e-5)
        np.testing.assert_allclose(q[r], q1[0], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(k[r], k1[0], rtol=1e-6, atol=1e-6)
        np.testing.assert_allclose(v[r], v1[0], rtol=1e-6, atol=1e-6)
        o1 = np.zeros((T, hid), np.float32)
        n1 = np.zeros((T, hid), np.float32)
        blk.post(q[r:r + 1].copy(), K[r:r + 1].copy(), V[r:r + 1].copy(), bias[r:r + 1].copy(),
                 0.35, o1, x[rows].copy(), ln2, 1e-5, n1)
        np.testing.assert_allclose(out[rows], o1, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(normed[rows], n1, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="rows"):   # x's tokens are not rows * T
        blk.pre(x[:5].copy(), cos[:5].copy(), sin[:5].copy(), q, k, v)
    with pytest.raises(ValueError, match="bias has 2 rows"):
        blk.post(q, K, V, bias[:2].copy(), 0.35, out)
    with pytest.raises(ValueError, match="max_tokens"):  # more than the block's 64
        x2 = np.zeros((65, hid), np.float32)
        c2 = np.zeros((65, D), np.float32)
        blk.pre(x2, c2, c2, np.zeros((1, H, 65, D), np.float32),
                np.zeros((1, Hkv, 65, D), np.float32), np.zeros((1, Hkv, 65, D), np.float32))

"""A DeepSeek-V2/V3 decoder layer at decode sizes in one C call (specmoe._C.MLABlock,
specmoe.models.mla.fuse_mla): bf16 layers bit for bit against the same model decoding through the
absorbed attention with torch doing the norms, rotary, casts and residual adds between the same
C kernels (decode steps, verification chunks, a crop; DeepSeek-V2's complex rotary with and
without q compression, DeepSeek-V3's interleaved and rotate-half ones; bf16, int8 and int4
projections); f32 against the unmodified transformers model; an offloaded model's
MoE layers in one call with its routing and experts, greedy tokens unchanged; the fall-backs;
bad input.

The tiny configs use a rotary dimension of 16: at 8 (tiny_config's) transformers' complex
product runs its scalar loop, which this CPU build of torch compiles with fused multiply-adds,
while real models' dimensions (64) take its vector loop -- plain products and one add, as the C
rotary (csrc/kernels/block.c) -- so an f32 comparison at 8 would differ by an ulp for a reason
that is torch's, not ours.  (As in DeepSeek-V2, kv heads = heads: transformers' DeepSeek-V2
attention fails at a rotary dimension of 16 with fewer kv heads.)"""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from specmoe import _C
from specmoe.runtime import engine as hf
from specmoe.models.dense import convert_dense
from specmoe.models.mla import absorb_mla, fuse_mla
from specmoe.models.layers import chain_step, dense_mlp
from specmoe.models.testing import tiny_config

from .attn_helpers import layer_outputs

STEPS = (1, 4, 1, 3, 1)


# the forms of the block: (architecture, q_lora_rank, DeepSeek-V3's rope_interleave)
FORMS = {"v2": ("deepseek_v2", None, None), "v2-qlora": ("deepseek_v2", 32, None),
         "v3-interleave": ("deepseek_v3", 32, True), "v3-half": ("deepseek_v3", None, False)}


def _model(dt=torch.float32, q_lora=None, seed=3, layers=3, form=None):
    arch, interleave = "deepseek_v2", None
    if form is not None:
        arch, q_lora, interleave = FORMS[form]
    cfg = tiny_config(arch, layers=layers)
    over = {"q_lora_rank": q_lora}
    if arch == "deepseek_v2":   # as DeepSeek-V2's: kv heads = heads
        over.update(qk_rope_head_dim=16, num_key_value_heads=cfg.num_attention_heads)
    else:                       # DeepSeek-V3's rotary forms have no complex product
        over.update(rope_interleave=interleave)
    cfg = type(cfg)(**{**cfg.to_dict(), **over})
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(cfg, experts_implementation="eager",
                                            dtype=dt).eval()


class _Counting:
    """Stands in for a layer's MLABlock and records each call's kind and token count."""

    def __init__(self, blk, calls):
        self.blk, self.calls = blk, calls

    def attn(self, x, *a):
        self.calls.append(("attn", x.shape[0]))
        return self.blk.attn(x, *a)

    def layer(self, layers, pos, flags, x, *a):
        self.calls.append(("layer", x.shape[0]))
        return self.blk.layer(layers, pos, flags, x, *a)


def _count(model):
    calls: list[tuple[str, int]] = []
    for layer in model.model.layers:
        ref = layer._specmoe_mlab
        layer._specmoe_mlab = ref._replace(block=_Counting(ref.block, calls))
    return calls


def _kinds(model):
    """The MLABlock method each layer's decode step calls: "layer" for a dense layer (its MLP in
    the call, set_mlp) or a MoE block routed in C, else "attn" (the MLP in torch after it)."""
    return ["layer" if dense_mlp(layer) is not None else "attn"
            for layer in model.model.layers]


def _unfused(model):
    """The same model with the one-call layers undone: the absorbed attention
    (specmoe.models.mla._absorbed_forward) with torch between the same C kernels."""
    for layer in model.model.layers:
        if "forward" in vars(layer):
            del layer.forward
    return model


def _steps(model, ids, first, crop=0):
    """Prefill `first` tokens, then STEPS chunks (after a crop of `crop` positions when
    given); returns the cache and the logits of every call."""
    kv = DynamicCache(config=model.config)
    out = []
    with torch.no_grad():
        out.append(model(ids[:, :first], cache=kv, use_cache=True).logits)
        pos = first
        for i, T in enumerate(STEPS):
            if crop and i == 2:
                kv.crop(-crop)
                pos -= crop
            out.append(model(ids[:, pos:pos + T], cache=kv, use_cache=True).logits)
            pos += T
    return kv, torch.cat(out, 1)


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("fmt", ["bf16", "int8", "int4"])
def test_bf16_layers_bit_identical_to_the_absorbed_path(fmt, form):
    base = _model(torch.bfloat16, form=form)
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    rep = convert_dense(a, fmt)
    convert_dense(b, fmt)
    _unfused(b)
    L = a.config.num_hidden_layers
    assert rep.fused == [f"model.layers.{i}.self_attn" for i in range(L)]
    assert f"({L} fused)" in str(rep)
    assert fuse_mla(a) == rep.fused                              # idempotent
    calls = _count(a)
    outs = layer_outputs(a=a, b=b)
    ids = torch.randint(3, 100, (1, 30), generator=torch.Generator().manual_seed(2))
    ka, la = _steps(a, ids, 10, crop=2)
    kb, lb = _steps(b, ids, 10, crop=2)
    # the prefill finds no cache layer to write into: the layer's own forward; then C (the
    # dense first layer's MLP inside its call: bit for bit the CLinears' path, below)
    assert _kinds(a) == ["layer"] + ["attn"] * (L - 1)
    assert calls == [(k, T) for T in STEPS for k in _kinds(a)]
    assert len(outs["a"]) == len(outs["b"]) == (1 + len(STEPS)) * L
    for x, y in zip(outs["a"], outs["b"]):
        assert x.dtype == torch.bfloat16 and torch.equal(x, y)
    assert torch.equal(la, lb)
    for p, q in zip(ka.layers, kb.layers):                       # latent and rotary key
        assert torch.equal(p.keys, q.keys) and torch.equal(p.values, q.values)


@pytest.mark.parametrize("form", list(FORMS))
def test_f32_decode_matches_transformers(form):
    ref = _model(torch.float32, form=form)
    m = copy.deepcopy(ref)
    convert_dense(m, "f32")
    calls = _count(m)
    ids = torch.randint(3, 100, (1, 30), generator=torch.Generator().manual_seed(1))
    kv, got = _steps(m, ids, 20)
    assert calls == [(k, T) for T in STEPS for k in _kinds(m)]
    with torch.no_grad():
        full = ref(ids[:, :20 + sum(STEPS)]).logits
    torch.testing.assert_close(got, full, atol=2e-5, rtol=1e-4)
    dr = ref.config.qk_rope_head_dim                                  # transformers' layout
    assert kv.layers[0].keys.shape == (1, 1, 20 + sum(STEPS), 32)
    assert kv.layers[0].values.shape == (1, 1, 20 + sum(STEPS), dr)


@pytest.mark.parametrize("form", ["v2", "v3-interleave"])
@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_offloaded_moe_layers_are_one_call(dt, form):
    """With the Engine routing in C (DeepSeek-V2's greedy router, DeepSeek-V3's group-limited
    sigmoid one), each MoE layer's decode step is MLABlock.layer (the MoE block inside the
    call), and so is the dense first layer's (its MLP inside the call).  Greedy tokens equal
    the unmodified model's (f32) and the unfused offloaded model's (bf16: layer outputs bit for
    bit)."""
    fmt = "f32" if dt == torch.float32 else "bf16"
    ref = _model(dt, layers=4, form=form)
    a, b = copy.deepcopy(ref), copy.deepcopy(ref)
    ea = hf.offload(a, dtype=fmt, dense=fmt, cache=1.0)
    eb = hf.offload(b, dtype=fmt, dense=fmt, cache=1.0)
    try:
        moe = "layer"
        assert ea.routed_in_c == [0, 1, 2]
        _unfused(b)
        calls = _count(a)
        prompt = torch.randint(3, 100, (1, 12), generator=torch.Generator().manual_seed(5))
        kw = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
        got = a.generate(prompt, **kw)
        assert calls == [("layer", 1), (moe, 1), (moe, 1), (moe, 1)] * 7
        assert torch.equal(got, b.generate(prompt, **kw))
        if dt == torch.float32:
            assert torch.equal(got, ref.generate(prompt, **kw))
    finally:
        ea.close()
        eb.close()


def test_fallbacks_use_the_layers_own_forward():
    """A prefill into an empty cache and one longer than max_tokens take the layer's own
    forward (a left-padded batch of two: its prefill; its decode steps are one call of both
    rows per layer, with the reference's tokens); a model whose projections are torch's is not
    fused, nor a layer whose absorbed attention runs in torch."""
    ref = _model()
    m = copy.deepcopy(ref)
    convert_dense(m, "f32")
    calls = _count(m)
    a = torch.tensor([[0, 0, 0, 5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17]])
    am = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [1] * 8])
    kw = dict(attention_mask=am, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert torch.equal(ref.generate(a, **kw), m.generate(a, **kw))
    assert calls == [(k, 2) for k in _kinds(m)] * 3
    calls.clear()
    long = torch.randint(3, 100, (1, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        kv = DynamicCache(config=m.config)
        m(long[:, :20], cache=kv, use_cache=True)
        assert calls == []
        m(long[:, 20:37], cache=kv, use_cache=True)                # 17 tokens: above 16
        assert calls == []
        m(long[:, 37:38], cache=kv, use_cache=True)
    assert calls == [(k, 1) for k in _kinds(m)]
    assert fuse_mla(_model()) == []                               # projections in torch
    t = _model()
    convert_dense(t, "f32")
    tcalls = _count(t)
    absorb_mla(t, kernel="torch")       # the absorbed attention in torch: no one-call layers
    _, got = _steps(t, long, 20)
    assert tcalls == []
    with torch.no_grad():
        full = ref(long[:, :20 + sum(STEPS)]).logits
    torch.testing.assert_close(got, full, atol=2e-5, rtol=1e-4)


def _block_args(m, S=3, T=1, cap=8, dt=np.float32):
    layer = m.model.layers[0]
    attn = layer.self_attn
    blk = layer._specmoe_mlab.block
    hid, r, dr = m.config.hidden_size, attn.kv_lora_rank, attn.qk_rope_head_dim
    rng = np.random.default_rng(0)
    x = rng.standard_normal((T, hid)).astype(np.float32)
    f = np.ascontiguousarray(torch.view_as_real(torch.polar(
        torch.ones(T, dr // 2), torch.randn(T, dr // 2))).numpy())
    cbuf = rng.standard_normal((1, 1, cap, r)).astype(dt)
    kbuf = rng.standard_normal((1, 1, cap, dr)).astype(dt)
    ln1, e1, ln2, e2 = chain_step(layer).norms
    out = np.zeros((T, hid), np.float32)
    normed = np.zeros((T, hid), np.float32)
    return blk, [x, f, cbuf, kbuf, S, None, ln1, e1, ln2, e2, out, normed]


def test_bad_input_raises_and_leaves_the_cache_alone():
    m = _model()
    convert_dense(m, "f32")
    blk, args = _block_args(m)
    blk.attn(*args)                                              # the good call runs
    assert np.isfinite(args[10]).all() and np.abs(args[10]).sum() > 0

    def bad(i, value, match, exc=ValueError):
        blk2, a = _block_args(m)
        c0, k0 = a[2].copy(), a[3].copy()
        a[i] = value(a) if callable(value) else value
        with pytest.raises(exc, match=match):
            blk2.attn(*a)
        if i not in (2, 3):                                      # nothing written
            assert np.array_equal(a[2], c0) and np.array_equal(a[3], k0)

    bad(4, 8, "do not fit")                                      # S + T > capacity 8
    bad(4, -1, "do not fit")
    bad(0, lambda a: np.zeros((1, 7), np.float32), "dimension 1")
    bad(0, lambda a: np.zeros((65, a[0].shape[1]), np.float32), "tokens")  # the block's 64
    bad(2, lambda a: np.concatenate([a[2]] * 2), "in each row")  # 2 cache rows, 1 token
    bad(1, lambda a: a[1][:, :-1], "freqs")
    bad(1, lambda a: a[1].astype(np.float64), "freqs")
    bad(3, lambda a: a[3].astype(np.uint16), "same dtype")
    bad(2, lambda a: a[2][..., :-1].copy(), "cbuf")
    bad(5, lambda a: np.zeros((1, 1, 9), np.float32), "bias")
    bad(6, lambda a: a[6][:-1].copy(), "ln")
    bad(7, -1.0, "ln_eps")
    bad(10, lambda a: a[0], "alias")
    bad(11, lambda a: a[10], "alias")
    bad(10, lambda a: np.zeros(a[10].shape, np.float64), "out")
    with pytest.raises(TypeError, match="12 arguments"):
        blk.attn(*args[:-1])
    with pytest.raises(TypeError, match="14 arguments"):
        blk.layer(*args)
    # construction: shapes and companions are checked
    layer = m.model.layers[0]
    at = layer.self_attn
    mla = layer._specmoe_mlab.kernel
    ctx = layer._specmoe_mlab_parts.ctx
    q, kva, o = (p._c for p in layer._specmoe_mlab_parts.projs)
    kvn = np.ones(at.kv_lora_rank, np.float32)
    with pytest.raises(ValueError, match="the q projection"):
        _C.MLABlock(ctx, mla, kva, kva, o, kvn, 1e-6)
    with pytest.raises(ValueError, match="kv_norm"):
        _C.MLABlock(ctx, mla, q, kva, o, kvn[:-1], 1e-6)
    with pytest.raises(ValueError, match="q_a and q_a_norm"):
        _C.MLABlock(ctx, mla, q, kva, o, kvn, 1e-6, q_a_norm=kvn)
    with pytest.raises(TypeError, match="MLADecode"):
        _C.MLABlock(ctx, q, q, kva, o, kvn, 1e-6)
    with pytest.raises(ValueError, match="max_tokens"):
        _C.MLABlock(ctx, mla, q, kva, o, kvn, 1e-6, max_tokens=0)
    with pytest.raises(ValueError, match="rope must be"):
        _C.MLABlock(ctx, mla, q, kva, o, kvn, 1e-6, rope="yarn")
    half = _C.MLABlock(ctx, mla, q, kva, o, kvn, 1e-6, rope="half")  # freqs [B T, 2, rope_dim]
    with pytest.raises(ValueError, match=r"freqs \[B T, 2, rope_dim\]"):
        half.attn(*args)


def test_block_against_numpy_reference():
    """One f32 call against the layer computed in numpy from the module's own weights (the
    latent form, expanded: scores q_nope . (W_UK c) + q_pe . k_pe), at S = 3 cached positions
    and T = 2 new ones with a causal bias."""
    m = _model()
    convert_dense(m, "f32")
    layer = m.model.layers[0]
    at = layer.self_attn
    H, dn, dr, dv, r = (at.num_heads, at.qk_nope_head_dim, at.qk_rope_head_dim, at.v_head_dim,
                        at.kv_lora_rank)
    S, T = 3, 2
    blk, a = _block_args(m, S=S, T=T)
    bias = np.zeros((1, T, S + T), np.float32)
    bias[0, 0, S + 1] = np.finfo(np.float32).min
    a[5] = bias
    x, f, cbuf, kbuf = a[0].copy(), a[1], a[2].copy(), a[3].copy()
    blk.attn(*a)
    ref = _model()                                      # the same weights, torch modules
    rat = ref.model.layers[0].self_attn
    W = lambda name: getattr(rat, name).weight.detach().double().numpy()  # noqa: E731

    def rms(v, w, eps):
        return w * v / np.sqrt((v * v).mean(-1, keepdims=True) + eps)

    def rot(v, fr):                                     # v [..., dr], fr [dr/2, 2]
        z = v[..., 0::2] + 1j * v[..., 1::2]
        z = z * (fr[:, 0] + 1j * fr[:, 1])
        out = np.empty_like(v)
        out[..., 0::2], out[..., 1::2] = z.real, z.imag
        return out
    ln1, e1, ln2, e2 = chain_step(layer).norms
    h = rms(x.astype(np.float64), ln1, e1)
    q = (h @ W('q_proj').T).reshape(T, H, dn + dr)
    ckv = h @ W('kv_a_proj_with_mqa').T
    c = rms(ckv[:, :r], at.kv_a_layernorm.weight.detach().double().numpy(),
            at.kv_a_layernorm.variance_epsilon)
    kp = np.stack([rot(ckv[t, r:], f[t]) for t in range(T)])
    qp = np.stack([rot(q[t, :, dn:], f[t]) for t in range(T)])
    np.testing.assert_allclose(a[2][0, 0, S:S + T], c, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(a[3][0, 0, S:S + T], kp, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(a[2][0, 0, :S], cbuf[0, 0, :S])    # old positions kept
    np.testing.assert_array_equal(a[2][0, 0, S + T:], cbuf[0, 0, S + T:])
    C = np.concatenate([cbuf[0, 0, :S], c]).astype(np.float64)
    K = np.concatenate([kbuf[0, 0, :S], kp]).astype(np.float64)
    wkv = W('kv_b_proj').reshape(H, dn + dv, r)
    kn = np.einsum("hdr,sr->hsd", wkv[:, :dn], C)           # expanded keys
    vv = np.einsum("hdr,sr->hsd", wkv[:, dn:], C)           # expanded values
    sc = (np.einsum("thd,hsd->ths", q[:, :, :dn], kn) + np.einsum("thd,sd->ths", qp, K))
    sc = sc * at.scaling + bias[0][:, None, :]
    p = np.exp(sc - sc.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    o = np.einsum("ths,hsd->thd", p, vv).reshape(T, H * dv) @ W('o_proj').T
    hsum = x + o
    np.testing.assert_allclose(a[10], hsum, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(a[11], rms(hsum, ln2, e2), rtol=1e-4, atol=1e-5)


def test_dense_mlp_in_the_block_checks_its_input():
    """MLABlock.set_mlp takes a (gate, up, down) tuple of _C.Linear chaining hidden -> I ->
    hidden, or None; layer(None, ...) without an MLP raises before anything runs (the KV cache
    untouched), and with it back the step equals the unfused layers'."""
    a, b = _model(), _model()  # the same seed: the same weights
    convert_dense(a, "f32")
    convert_dense(b, "f32")
    _unfused(b)
    layer = a.model.layers[0]
    blk = layer._specmoe_mlab.block
    gate, up, down = dense_mlp(layer)[0]
    with pytest.raises(TypeError, match="tuple of _C.Linear"):
        blk.set_mlp(gate)
    with pytest.raises(ValueError, match="do not chain"):
        blk.set_mlp((down, up, gate))
    with pytest.raises(TypeError):
        blk.set_mlp((gate, up, "down"))
    ids = torch.randint(3, 100, (1, 21), generator=torch.Generator().manual_seed(7))
    ka, kb = DynamicCache(config=a.config), DynamicCache(config=b.config)
    with torch.no_grad():
        a(ids[:, :20], cache=ka, use_cache=True)
        b(ids[:, :20], cache=kb, use_cache=True)
        blk.set_mlp(None)
        with pytest.raises(ValueError, match="none is set"):
            a(ids[:, 20:], cache=ka, use_cache=True)
        assert ka.get_seq_length() == 20
        blk.set_mlp((gate, up, down))
        la = a(ids[:, 20:], cache=ka, use_cache=True).logits
        lb = b(ids[:, 20:], cache=kb, use_cache=True).logits
    torch.testing.assert_close(la, lb, atol=1e-5, rtol=1e-5)

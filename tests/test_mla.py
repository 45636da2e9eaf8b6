"""MLA decoded in the absorbed form (specmoe.models.mla): against transformers' own expanded-latent
attention on tiny DeepSeek-V2/V3 models -- decode steps, multi-token verification chunks on a
cache, left-padded batches under both attention back ends --, the fall-backs to the module's
own forward, and the dense conversion that turns it on."""
import copy

import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

from specmoe.runtime import engine as hf
from specmoe.models.dense import convert_dense
from specmoe.models.layers import CLinear
from specmoe.models.mla import MLA_MAX_TOKENS, absorb_mla, is_mla_attention
from specmoe.models.testing import tiny_config, tiny_model
from specmoe.speculation.decoding import cache_kwargs

ARCHS = ["deepseek_v2", "deepseek_v3", "glm4_moe_lite"]


def _pair(arch, kv_heads=None):
    torch.manual_seed(3)
    cfg = tiny_config(arch)
    if kv_heads:
        cfg.num_key_value_heads = kv_heads
    ref = AutoModelForCausalLM.from_config(cfg).eval()
    m = copy.deepcopy(ref)
    return ref, m


def _only(kernel, monkeypatch):
    """Make the other implementation of the absorbed attention fail if it is called."""
    import specmoe.models.mla as mla

    def boom(*a, **k):
        raise AssertionError(f"the {kernel!r} path was asked for")
    monkeypatch.setattr(mla, "_attend_torch" if kernel == "c" else "_attend_c", boom)


@pytest.mark.parametrize("kernel", ["c", "torch"])
@pytest.mark.parametrize("arch", ARCHS)
def test_decode_and_verify_chunks_match_expanded(arch, kernel, monkeypatch):
    ref, m = _pair(arch)
    _only(kernel, monkeypatch)
    names = absorb_mla(m, kernel=kernel)
    assert names == [n for n, mod in ref.named_modules() if is_mla_attention(mod)]
    assert len(names) == ref.config.num_hidden_layers
    ids = torch.randint(3, 128, (1, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = ref(ids).logits                   # one expanded prefill of everything
        kv = DynamicCache(config=m.config)
        # a prefill longer than MLA_MAX_TOKENS (the module's own path), then decode steps and
        # verification-sized chunks on the shared cache (the absorbed path)
        first = MLA_MAX_TOKENS + 2
        parts = [m(ids[:, :first], **cache_kwargs(m, kv), use_cache=True).logits]
        pos = first
        for T in (1, 4, 1, 3, 2):
            parts.append(m(ids[:, pos:pos + T], **cache_kwargs(m, kv), use_cache=True).logits)
            pos += T
        got = torch.cat(parts, 1)
    torch.testing.assert_close(got, full[:, :pos], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("kernel", ["c", "torch"])
@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_left_padded_batch_matches(arch, impl, kernel, monkeypatch):
    # transformers' own MLA needs as many KV heads as heads for batched masks
    ref, m = _pair(arch, kv_heads=tiny_config(arch).num_attention_heads)
    _only(kernel, monkeypatch)
    absorb_mla(m, kernel=kernel)
    for mod in (ref, m):
        mod.config._attn_implementation = impl
    a = torch.tensor([[0, 0, 0, 5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17]])
    am = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [1] * 8])
    kw = dict(attention_mask=am, max_new_tokens=8, do_sample=False, pad_token_id=0,
              output_logits=True, return_dict_in_generate=True)
    r, g = ref.generate(a, **kw), m.generate(a, **kw)
    assert torch.equal(r.sequences, g.sequences)
    for x, y in zip(r.logits, g.logits):
        assert torch.isfinite(y).all()
        torch.testing.assert_close(y, x, atol=2e-5, rtol=1e-4)


def test_fallbacks_use_the_module_forward():
    ref, m = _pair("deepseek_v2")
    absorb_mla(m, max_tokens=4)
    attn = m.model.layers[0].self_attn
    calls = []
    orig = attn._specmoe_mla.orig_forward
    attn._specmoe_mla.orig_forward = lambda *a, **k: (calls.append(1), orig(*a, **k))[1]
    ids = torch.randint(3, 128, (1, 6))
    with torch.no_grad():
        m(ids)                                   # 6 tokens > max_tokens: own forward
    assert len(calls) == 1
    m.train()
    m(ids[:, :2])                                # training mode: own forward
    assert len(calls) == 2


def test_idempotent_and_bad_input():
    ref, m = _pair("deepseek_v3")
    a = absorb_mla(m)
    assert absorb_mla(m) == a
    ids = torch.randint(3, 128, (1, 5))
    with torch.no_grad():
        torch.testing.assert_close(m(ids).logits, ref(ids).logits, atol=2e-5, rtol=1e-4)
    for bad in (0, -1, 2.5, True, "4"):
        with pytest.raises(ValueError, match="max_tokens"):
            absorb_mla(m, max_tokens=bad)
    with pytest.raises(ValueError, match="kernel"):
        absorb_mla(m, kernel="cuda")
    attn0 = m.model.layers[0].self_attn
    assert attn0._specmoe_mla.weights.kernel is not None  # the C kernel object
    absorb_mla(m, kernel="torch")                          # a second call changes the setting
    assert attn0._specmoe_mla.weights.kernel is None
    with torch.no_grad():
        torch.testing.assert_close(m(ids).logits, ref(ids).logits, atol=2e-5, rtol=1e-4)
    assert absorb_mla(tiny_model("mixtral")) == []
    # an int8 kv_b_proj cannot be absorbed: said at install time, not at the first token
    m2 = copy.deepcopy(ref)
    attn = m2.model.layers[-1].self_attn
    attn.kv_b_proj = CLinear(attn.kv_b_proj, "int8")
    with pytest.raises(ValueError, match="kv_b_proj"):
        absorb_mla(m2)
    # nothing was changed on the way (the bad module is the last one)
    assert not any(hasattr(mod, "_specmoe_mla") for mod in m2.modules())
    with pytest.raises(ValueError, match="weights"):
        absorb_mla(m, weights="int3")
    # absorbed at int8, then kv_b_proj converted: other settings can no longer be applied
    m3 = copy.deepcopy(ref)
    absorb_mla(m3, weights="int8")
    for layer in m3.model.layers:
        layer.self_attn.kv_b_proj = CLinear(layer.self_attn.kv_b_proj, "int8")
    with torch.no_grad():
        before = m3(ids).logits
    assert absorb_mla(m3, weights="int8") == a             # the same settings: fine
    with pytest.raises(ValueError, match="cannot be rebuilt"):
        absorb_mla(m3, weights="int4")
    assert all(mod._specmoe_mla.fmt == "int8" for mod in m3.modules() if is_mla_attention(mod))
    absorb_mla(m3, kernel="torch")          # None: as kv_b_proj is, i.e. the int8 weights
    attn3 = m3.model.layers[0].self_attn
    assert attn3._specmoe_mla.weights.fmt == "int8" and attn3._specmoe_mla.weights.kernel is None
    with torch.no_grad():
        torch.testing.assert_close(m3(ids).logits, before, atol=1e-4, rtol=1e-3)
    absorb_mla(m3)                          # back on the C kernel, from the int8 weights
    assert attn3._specmoe_mla.weights.kernel.shape["dtype"] == "int8"


@pytest.mark.parametrize("dense", ["f32", "int8", "int4"])
def test_offload_with_dense_absorbs(dense):
    ref = tiny_model("deepseek_v2")
    m = tiny_model("deepseek_v2")
    prompt = torch.tensor([[1, 5, 9, 14, 3, 27, 8, 60]])
    eng = hf.offload(m, dtype="f32", dense=dense)
    try:
        assert len(eng.dense.mla) == m.config.num_hidden_layers
        kvb = {f"{n}.kv_b_proj" for n in eng.dense.mla}
        assert kvb <= set(eng.dense.converted)            # prefill reads it at `dense` too
        attn = m.model.layers[0].self_attn
        assert attn._specmoe_mla.weights.kernel.shape["dtype"] == dense
        if dense == "f32":
            assert torch.equal(ref.generate(prompt, max_new_tokens=12, do_sample=False),
                               m.generate(prompt, max_new_tokens=12, do_sample=False))
        else:
            # the absorbed weights are kv_b_proj's rows quantized as CLinear quantized them:
            # a decode step (absorbed, C) agrees with the expanded prefill of the same
            # sequence (transformers' attention through the converted kv_b_proj)
            ids = torch.randint(3, 128, (1, MLA_MAX_TOKENS + 4),
                                generator=torch.Generator().manual_seed(2))
            with torch.no_grad():
                full = m(ids).logits[:, -1]
                kv = DynamicCache(config=m.config)
                m(ids[:, :-1], **cache_kwargs(m, kv), use_cache=True)
                step = m(ids[:, -1:], **cache_kwargs(m, kv), use_cache=True).logits[:, -1]
                fl = ref(ids).logits[:, -1]
            err = ((step - full).norm() / full.norm()).item()
            q_err = ((full - fl).norm() / fl.norm()).item()   # the quantization's own error
            assert err < 0.1 * q_err + 1e-4, (err, q_err)
            # the torch path reads the same quantized values (dequantized)
            absorb_mla(m, kernel="torch")
            with torch.no_grad():
                kv = DynamicCache(config=m.config)
                m(ids[:, :-1], **cache_kwargs(m, kv), use_cache=True)
                step_t = m(ids[:, -1:], **cache_kwargs(m, kv), use_cache=True).logits[:, -1]
            torch.testing.assert_close(step_t, step, atol=1e-4, rtol=1e-3)
        assert "MLA" in str(eng.dense)
    finally:
        eng.close()
    # dense="torch" leaves attention as transformers has it
    m3 = tiny_model("deepseek_v2")
    eng = hf.offload(m3, dtype="f32", dense="torch")
    try:
        assert eng.dense.mla == []
        assert not hasattr(m3.model.layers[0].self_attn, "_specmoe_mla")
    finally:
        eng.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_bf16_rounding_no_worse_than_transformers(arch):
    """In bf16 both forms round; against the f32 model, the absorbed form's attention
    outputs are as close as transformers' own bf16 attention (per layer, several models)."""
    ratios = []
    for seed in range(4):
        m32 = tiny_model(arch, seed=seed)
        mb = copy.deepcopy(m32).to(torch.bfloat16)
        ma = copy.deepcopy(mb)
        absorb_mla(ma)
        outs = {}
        for tag, mod in (("f32", m32), ("bf16", mb), ("abs", ma)):
            for i, layer in enumerate(mod.model.layers):
                def keep(_m, _a, out, key=(tag, i)):
                    outs.setdefault(key, out[0].float())
                layer.self_attn.register_forward_hook(keep)
        ids = torch.randint(3, 128, (1, 12), generator=torch.Generator().manual_seed(seed))
        with torch.no_grad():
            for mod in (m32, mb, ma):
                mod(ids)
        # the first layer sees the same input in all three: its error is the attention's own
        ref = outs[("f32", 0)]
        # (L2: the max error is the last bf16 rounding of the output, the same for both)
        e_tf = (outs[("bf16", 0)] - ref).norm().item()
        e_abs = (outs[("abs", 0)] - ref).norm().item()
        ratios.append(e_abs / e_tf)
    ratios.sort()
    assert ratios[len(ratios) // 2] <= 1.5, ratios

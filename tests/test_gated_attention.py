"""Qwen3-Next's and Qwen3.5's gated full attention in C (``_C.AttnBlock`` with ``gate``,
``rotary_dim`` and ``zero_centred``; specmoe.models.attention.fuse_attention): the whole decoder
layer of a decode step in one call against transformers' own layer forward over the same
weights (bit for bit in bf16), an offloaded model's generate against the unmodified model, and
bad arguments refused by name."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specmoe import _C
from specmoe.models import attention
from specmoe.models.layers import CLinear
from specmoe.models.layers import decode_route
from specmoe.models.testing import tiny_model
from specmoe.runtime.engine import offload
from specmoe.runtime.kernels import context
from specmoe.runtime.kvcache import kv_buffers

ARCHS = ["qwen3_5_moe_text", "qwen3_next"]


def _model(arch, dtype=torch.float32):
    """A tiny model of ``arch`` whose RMSNorm weights are random (a zero-centred norm's zeros
    would hide which form of the norm runs)."""
    m = tiny_model(arch, dtype=dtype)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, mod in m.named_modules():
            if name.endswith("norm") and isinstance(getattr(mod, "weight", None), torch.Tensor):
                mod.weight.add_((0.3 * torch.randn(mod.weight.shape, generator=g)).to(dtype))
    return m


def _fused(arch, dtype, cache=1.0):
    """A tiny model of ``arch`` (:func:`_model`) offloaded with its dense layers in specmoe's
    kernels (so its attention modules are fused), and its engine."""
    m = _model(arch, dtype)
    sd = "bf16" if dtype == torch.bfloat16 else "f32"
    return m, offload(m, dtype=sd, cache=cache, dense=sd)


class _Counting:
    """An AttnBlock stand-in that counts its layer calls."""

    def __init__(self, blk):
        self.blk, self.layers = blk, 0

    def layer(self, *a):
        self.layers += 1
        return self.blk.layer(*a)


def _prefill(m, rows, seed):
    """(cache after a 6-token prefill of `rows` random prompts, the position embeddings of
    position 6, a random next input x [rows, 1, hidden] in the model's dtype)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, m.config.vocab_size, (rows, 6), generator=g)
    with torch.no_grad():
        cache = m(ids, use_cache=True).past_key_values
        x = torch.randn(rows, 1, m.config.hidden_size, generator=g).to(m.dtype)
        pos = torch.full((rows, 1), 6, dtype=torch.long)
        if m.config.model_type == "qwen3_5_moe_text":  # (text positions on all three axes)
            pos = pos[None].expand(3, rows, 1)
        pe = m.model.rotary_emb(x, pos)
    return cache, pe, x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("arch", ARCHS)
def test_one_call_layer_equals_the_layers_own_forward(arch, dtype, rows):
    """One cached decode token of `rows` sequences through a full-attention decoder layer:
    the one C call (input norm, projections with the per-head gate, zero-centred q/k norms,
    partial rotary, the new k and v into the cache, attention, the gate, o_proj, residual add,
    post-attention norm, the MoE block routed in C, residual add) against transformers' own
    layer and attention forwards over the same projections, norms and MoE block: the same new
    cache entries, and the same output, bit for bit in bf16 (every rounding of the model's
    reproduced)."""
    m, eng = _fused(arch, dtype)
    try:
        idx = m.config.layer_types.index("full_attention")
        layer = m.model.layers[idx]
        attn = layer.self_attn
        assert attn._specmoe_block_form.gated and attn._specmoe_block_form.zero_centred
        assert attn._specmoe_block_form.rot == attn.head_dim // 4 < attn.head_dim  # partial
        blk = attn._specmoe_block = _Counting(attn._specmoe_block)
        outs, keys = [], []
        for one_call in (True, False):
            cache, pe, x = _prefill(m, rows, seed=rows)
            with torch.no_grad():
                if one_call:
                    out = layer(x, position_embeddings=pe, attention_mask=None, cache=cache)
                else:
                    out = type(layer).forward(layer, x, position_embeddings=pe,
                                              attention_mask=None, cache=cache)
            outs.append(out)
            keys.append((cache.layers[idx].keys.clone(), cache.layers[idx].values.clone()))
            assert blk.layers == 1  # the second pass took transformers' forwards
        assert keys[0][0].shape[2] == 7
        if dtype == torch.bfloat16:
            assert torch.equal(outs[0], outs[1])
        else:  # (f32: torch's vectorised sigmoid and ours may differ by an ulp, unrounded)
            torch.testing.assert_close(outs[0], outs[1], rtol=1e-6, atol=1e-7)
        assert torch.equal(keys[0][0], keys[1][0]) and torch.equal(keys[0][1], keys[1][1])
    finally:
        eng.close()


@pytest.mark.parametrize("cache", [1.0, 0.3])
@pytest.mark.parametrize("arch", ARCHS)
def test_offloaded_model_decodes_a_batch_with_the_unmodified_logits(arch, cache):
    """generate of two rows on an offloaded model (f32; every expert resident, or 30 % of
    them with misses and prefetches): every decode step of the full-attention layers is one
    AttnBlock.layer call, and the tokens and per-step logits are the unmodified transformers
    model's."""
    ref = _model(arch)
    m, eng = _fused(arch, torch.float32, cache)
    try:
        idx = [i for i, t in enumerate(m.config.layer_types) if t == "full_attention"]
        blks = []
        for i in idx:
            attn = m.model.layers[i].self_attn
            blks.append(_Counting(attn._specmoe_block))
            attn._specmoe_block = blks[-1]
        ids = torch.tensor([[1, 5, 9, 33, 7, 64, 3], [4, 8, 15, 16, 23, 42, 2]])
        kw = dict(max_new_tokens=6, do_sample=False, output_scores=True,
                  return_dict_in_generate=True, pad_token_id=0)
        with torch.no_grad():
            want, got = ref.generate(ids, **kw), m.generate(ids, **kw)
        assert [b.layers for b in blks] == [5] * len(idx)  # (the prefill is transformers')
        assert cache == 1.0 or eng.stats()["misses"] > 0
        assert torch.equal(got.sequences, want.sequences)
        for a, b in zip(got.scores, want.scores):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    finally:
        eng.close()


def _linears(rows):
    """f32 _C.Linear objects of the given (out, in) sizes."""
    torch.manual_seed(0)
    return [CLinear(torch.nn.Linear(k, n, bias=False), "f32")._c for n, k in rows]


def test_gated_block_refuses_bad_arguments_by_name():
    ctx = context()
    H, Hkv, D, hid = 4, 2, 8, 32
    q, k, v, o = _linears([(2 * H * D, hid), (Hkv * D, hid), (Hkv * D, hid), (hid, H * D)])
    norms = dict(norm="head", q_norm=np.ones(D, np.float32), k_norm=np.ones(D, np.float32))
    blk = _C.AttnBlock(ctx, q, k, v, o, H, Hkv, D, gate=True, rotary_dim=4, zero_centred=True,
                       **norms)
    with pytest.raises(ValueError, match="q projection is 32 -> 32, expected 32 -> 64"):
        _C.AttnBlock(ctx, _linears([(H * D, hid)])[0], k, v, o, H, Hkv, D, gate=True, **norms)
    for bad in (3, 10):
        with pytest.raises(ValueError, match=f"rotary_dim={bad} must be even and at most"):
            _C.AttnBlock(ctx, q, k, v, o, H, Hkv, D, gate=True, rotary_dim=bad, **norms)
    x = np.zeros((1, hid), np.float32)
    cs = np.zeros((1, 4), np.float32)
    qa = np.zeros((1, H, 1, D), np.float32)
    kv = np.zeros((1, Hkv, 1, D), np.float32)
    with pytest.raises(ValueError, match="AttnBlock.pre: a gated block"):
        blk.pre(x, cs, cs, qa, kv, kv)
    with pytest.raises(ValueError, match="AttnBlock.post: a gated block"):
        blk.post(qa, kv, kv, None, 1.0, np.zeros((1, hid), np.float32))


def test_one_call_layer_refuses_rotary_tables_of_the_head_width():
    """The layer call's cos and sin are rotary_dim wide: the full head width is refused by
    name, with the cache untouched."""
    m, eng = _fused("qwen3_5_moe_text", torch.float32)
    try:
        idx = m.config.layer_types.index("full_attention")
        layer = m.model.layers[idx]
        cache, pe, x = _prefill(m, 1, seed=0)
        route = decode_route(layer, x)
        bufs = kv_buffers(cache, idx, 1, rows=True)
        out = torch.empty_like(x)
        args = list(attention._layer_args(layer, x, out, pe, None, bufs, route))
        D = layer.self_attn.head_dim
        for i in (4, 5):
            bad = list(args)
            bad[i] = np.zeros((1, D), np.float32)
            with pytest.raises(ValueError, match="rotary_dim"):
                layer.self_attn._specmoe_block.layer(*bad)
        assert cache.layers[idx].keys.shape[2] == 6
        layer.self_attn._specmoe_block.layer(*args)  # the arguments as the layer forms them
    finally:
        eng.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_one_sequence_decodes_in_one_call_a_step_under_a_small_cache(arch):
    """One sequence, 30 % of the experts cached: every decode step is one _C.DecodePlan call (the gated DeltaNet and the gated attention layers its items, experts
    missed and prefetched inside it), and the tokens and logits are the unmodified model's."""
    ref = _model(arch)
    m, eng = _fused(arch, torch.float32, 0.3)
    try:
        step = m._specmoe_decode_step
        ids = torch.tensor([[1, 5, 9, 33, 7, 64, 3]])
        kw = dict(max_new_tokens=12, do_sample=False, output_scores=True,
                  return_dict_in_generate=True, pad_token_id=0)
        with torch.no_grad():
            want, got = ref.generate(ids, **kw), m.generate(ids, **kw)
        assert step.planned == 11  # every forward after the prefill and eng.stats()["misses"] > 0
        assert torch.equal(got.sequences, want.sequences)
        for a, b in zip(got.scores, want.scores):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    finally:
        eng.close()

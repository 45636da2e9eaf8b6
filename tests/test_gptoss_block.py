"""GPT-OSS's attention in the C decoder block (specmoe.models.attention.fuse_attention,
_C.AttnBlock with ``sinks``): q/k/v/o biases, one sink logit a head in every softmax, the
half-table rotary as the rotate-half form, the f32-scaled RMSNorms folded into the block's
calls, sliding-window layers (64 positions here) on transformers' own sliding cache through
pre + post, full-attention layers as one AttnBlock.layer call with the MoE block routed in C.
Checked through the Engine: f32 tokens and logits against the unmodified transformers model;
bf16 logits bit for bit against the same conversion with torch running everything between
the C kernels; sinks refused by name when they do not fit."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from specmoe import _C
from specmoe.runtime import engine as hf
from specmoe.models.layers import chain_step

from .test_attn_block import _tiny, _unfused


class _Calls:
    """Stands in for a module's AttnBlock and counts its pre / post / layer calls."""

    def __init__(self, blk, calls):
        self.blk, self.calls = blk, calls

    def __getattr__(self, name):
        fn = getattr(self.blk, name)
        if name in ("pre", "post", "layer"):
            def counted(*a):
                self.calls[name] = self.calls.get(name, 0) + 1
                return fn(*a)
            return counted
        return fn


def _generate(m, ids, n):
    kw = dict(max_new_tokens=n, do_sample=False, output_scores=True,
              return_dict_in_generate=True, pad_token_id=0)
    with torch.no_grad():
        return m.generate(ids, **kw)


def same_generation(got, ref, glue, ids, n: int, dt: torch.dtype) -> None:
    """``got`` (a fused model's generation of n tokens after ids) against the reference's:
    in f32 transformers' model ``ref`` (tokens equal, scores to float rounding), in bf16 the
    torch glue around the same kernels ``glue`` (tokens and scores bit for bit)."""
    if dt == torch.float32:
        want = _generate(ref, ids, n)
        assert torch.equal(got.sequences, want.sequences)
        for x, y in zip(got.scores, want.scores):
            torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)
    else:
        want = _generate(glue, ids, n)
        assert torch.equal(got.sequences, want.sequences)
        for x, y in zip(got.scores, want.scores):
            assert torch.equal(x, y)


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_gptoss_decodes_through_the_block(dt):
    """A 70-token prompt and 14 decode steps (past the 64-position window): every attention
    module fused and every decoder layer's norms folded; the full-attention layers' steps one
    layer call each, the sliding ones pre + post; f32 as transformers, bf16 as the torch
    glue around the same kernels, bit for bit."""
    base = _tiny("gpt_oss", dtype=dt, experts=16, top_k=4)
    assert base.config.sliding_window == 64 and "sliding_attention" in base.config.layer_types
    ref, a, b = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    fmt = "f32" if dt == torch.float32 else "bf16"
    ea = hf.offload(a, dtype=fmt, dense=fmt, cache=1.0)
    eb = hf.offload(b, dtype=fmt, dense=fmt, cache=1.0)
    try:
        assert ea.routed_in_c == list(range(len(a.model.layers)))
        calls: dict[str, int] = {}
        for layer in a.model.layers:
            assert getattr(chain_step(layer), "norms", None) is not None
            assert layer.self_attn._specmoe_block_form.half_rope
            layer.self_attn._specmoe_block = _Calls(layer.self_attn._specmoe_block, calls)
        _unfused(b)
        ids = torch.randint(3, 100, (1, 70), generator=torch.Generator().manual_seed(1))
        got = _generate(a, ids, 14)
        kinds = a.config.layer_types
        full, sliding = kinds.count("full_attention"), kinds.count("sliding_attention")
        assert calls == {"layer": 13 * full, "pre": 13 * sliding, "post": 13 * sliding}, calls
        same_generation(got, ref, b, ids, 14, dt)
    finally:
        ea.close()
        eb.close()


def test_sinks_change_the_block_and_bad_sinks_are_refused():
    """The sinks enter every head's softmax (other sinks, other outputs); sinks that do not
    fit the heads, or are not finite, are refused by name."""
    m = _tiny("gpt_oss")
    ctx = _C.KernelContext(1)
    attn = m.model.layers[0].self_attn
    from specmoe.models.layers import CLinear
    projs = [CLinear(getattr(attn, p), "f32", ctx) for p in ("q_proj", "k_proj", "v_proj",
                                                             "o_proj")]
    H, Hkv, D = attn.config.num_attention_heads, attn.config.num_key_value_heads, attn.head_dim
    args = (ctx, *(p._c for p in projs), H, Hkv, D)
    sinks = np.linspace(-1, 2, H).astype(np.float32)
    outs = []
    g = np.random.default_rng(0)
    q = g.standard_normal((1, H, 1, D)).astype(np.float32)
    k = g.standard_normal((1, Hkv, 6, D)).astype(np.float32)
    v = g.standard_normal((1, Hkv, 6, D)).astype(np.float32)
    hid = attn.config.hidden_size
    for s in (None, sinks, sinks + 3):
        blk = _C.AttnBlock(*args, sinks=s)
        out = np.empty((1, hid), np.float32)
        blk.post(q, k, v, None, float(attn.scaling), out)
        outs.append(out)
    assert not np.allclose(outs[0], outs[1]) and not np.allclose(outs[1], outs[2])
    with pytest.raises(ValueError, match="sinks has 3 values, expected heads"):
        _C.AttnBlock(*args, sinks=sinks[:3])
    with pytest.raises(ValueError, match=r"sinks\[1\] is not finite"):
        _C.AttnBlock(*args, sinks=np.where(np.arange(H) == 1, np.inf, 0).astype(np.float32))
    with pytest.raises(ValueError, match="sinks must be a C-contiguous float32"):
        _C.AttnBlock(*args, sinks=sinks.astype(np.float64))

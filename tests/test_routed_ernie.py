"""ERNIE-4.5's MoE blocks routed in C (Engine._install_routing, ROUTED_BLOCKS "ernie";
csrc/layer.c): with the dense layers in C, the f32 router's softmax, the choice by the
probabilities plus the correction bias (Ernie4_5_MoeStatics), the chosen probabilities
renormalised, the experts and the shared experts' MLP in one C call -- against transformers'
own Ernie4_5_MoeTopKRouter on the hidden states the blocks see, the block's own forward over
the same experts, and greedy tokens of the unmodified model."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specmoe import _C
from specmoe.models.testing import tiny_model
from specmoe.runtime import engine as hf

from .test_attn_block import _unfused
from .test_gptoss_block import _Calls
from .test_routed_deepseek import _count_c_calls as _calls
from .test_routed_v3 import _hidden, greedy_like, offloaded_routed_like_own_forward


def _model(dt=torch.float32):
    """A tiny ERNIE-4.5 MoE whose correction biases are large enough to change the choice
    (the softmax probabilities of 16 experts are ~0.06: a bias of 0.05 moves experts in and
    out of the top 4)."""
    m = tiny_model("ernie4_5_moe", dtype=dt, experts=16, top_k=4)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for layer in m.model.layers:
            st = getattr(getattr(layer.mlp, "gate", None), "moe_statics", None)
            if st is not None:
                st.e_score_correction_bias.copy_(
                    0.05 * torch.randn(st.e_score_correction_bias.shape, generator=g))
    return m


def test_ernie_router_in_c_is_transformers_router():
    """The C router's experts and weights against Ernie4_5_MoeTopKRouter's (f32): the same
    sets, and the weights to f32 rounding; the correction bias changes some choices."""
    m = _model()
    eng = hf.offload(m, dtype="f32", dense="f32", cache=1.0)
    try:
        blocks, hs = _hidden(m, n=32)
        assert blocks and eng.routed_in_c == list(range(len(blocks)))
        assert blocks[0]._specmoe_route.flags == _C.ROUTE_RENORM
        k, moved = eng.top_k, 0
        for pos, (block, h) in enumerate(zip(blocks, hs)):
            x = h.reshape(-1, h.shape[-1])
            with torch.no_grad():
                logits, w_t, i_t = block.gate(x)
            T = x.shape[0]
            ix, wt = np.empty((T, k), np.int64), np.empty((T, k), np.float32)
            eng._layers.forward_routed(pos, x.float().numpy(), ix, wt,
                                       np.empty((T, x.shape[1]), np.float32),
                                       np.empty(eng.num_experts, np.uint8), _C.ROUTE_RENORM)
            p = torch.softmax(logits.float(), -1).numpy()
            for t in range(T):
                assert sorted(ix[t]) == sorted(i_t[t].tolist()), (pos, t)
                got = wt[t][np.argsort(ix[t])]
                want = w_t[t].float().numpy()[np.argsort(i_t[t].numpy())]
                np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)
                moved += sorted(ix[t]) != sorted(np.argsort(-p[t])[:k].tolist())
        assert moved > 0  # the bias decided some choices
    finally:
        eng.close()


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_ernie_block_routed_in_c_equals_its_own_forward(dt):
    """The block's C path (router, experts, shared experts in one call) against its own
    forward (torch's router and shared MLP around the same experts)."""
    offloaded_routed_like_own_forward(_model(dt), dt)


def test_ernie_greedy_tokens_equal_the_unmodified_model():
    """Every decode step's MoE blocks routed in C: inside the decoder layer's one call
    (tests/test_ernie_block.py), or, with the attention not fused, as the block's own call."""
    for fused in (True, False):
        ref, m = _model(), _model()
        eng = hf.offload(m, dtype="f32", dense="f32", cache=1.0)
        try:
            if not fused:
                _unfused(m)
            calls, layer_calls = _calls(eng), {}
            for layer in m.model.layers:
                attn = layer.self_attn
                attn._specmoe_block = _Calls(attn._specmoe_block, layer_calls)
            greedy_like(ref, m, torch.tensor([[1, 5, 9, 14, 3, 27, 8, 60]]), 12)
            routed = layer_calls.get("layer", 0) if fused else calls[0]
            assert routed >= 11 * len(eng.layer_ids)
        finally:
            eng.close()

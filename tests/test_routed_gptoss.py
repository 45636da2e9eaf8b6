"""GPT-OSS's MoE blocks routed in C (Engine._install_routing, ROUTED_BLOCKS "gpt_oss";
_C.ROUTE_TOPK_SOFTMAX in csrc/layer.c): with the dense layers in C, the biased router's
logits, the k largest of them and their softmax as the weights, and the experts in one C
call -- against transformers' own GptOssTopKRouter on the hidden states the blocks see, the
block's own forward over the same experts, and greedy tokens of the unmodified model."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specmoe import _C
from specmoe.models.testing import tiny_model
from specmoe.runtime import engine as hf

from .test_gptoss_block import _Calls
from .test_routed_deepseek import _count_c_calls as _calls
from .test_routed_v3 import _hidden, greedy_like, offloaded_routed_like_own_forward


def _model(dt=torch.float32):
    """A tiny GPT-OSS whose routers' biases are large enough to change the choice."""
    m = tiny_model("gpt_oss", dtype=dt, experts=16, top_k=4)
    g = torch.Generator().manual_seed(11)
    with torch.no_grad():
        for layer in m.model.layers:
            layer.mlp.router.bias.copy_(0.5 * torch.randn(16, generator=g))
    return m


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_gptoss_router_in_c_is_transformers_router(dt):
    """The C router's experts and weights against GptOssTopKRouter's: f32, the same experts
    and weights to f32 rounding; bf16 (logits and weights rounded as the model's dtype), the
    same weights bit for bit wherever the sets agree, sets that differ only at a near-tie."""
    m = _model(dt)
    fmt = "f32" if dt == torch.float32 else "bf16"
    eng = hf.offload(m, dtype=fmt, dense=fmt, cache=1.0)
    try:
        blocks, hs = _hidden(m, n=32)
        assert eng.routed_in_c == list(range(len(blocks)))
        flags = _C.ROUTE_TOPK_SOFTMAX | (
            _C.ROUTE_BF16_LOGITS | _C.ROUTE_BF16_WEIGHTS if dt == torch.bfloat16 else 0)
        assert blocks[0]._specmoe_route.flags == flags
        k, tot, bad = eng.top_k, 0, 0
        for pos, (block, h) in enumerate(zip(blocks, hs)):
            x = h.reshape(-1, h.shape[-1])
            with torch.no_grad():
                logits, w_t, i_t = block.router(x)
            T = x.shape[0]
            ix, wt = np.empty((T, k), np.int64), np.empty((T, k), np.float32)
            eng._layers.forward_routed(pos, x.float().numpy(), ix, wt,
                                       np.empty((T, x.shape[1]), np.float32),
                                       np.empty(eng.num_experts, np.uint8), flags)
            for t in range(T):
                tot += 1
                if sorted(ix[t]) != sorted(i_t[t].tolist()):
                    bad += 1
                    z = np.sort(logits[t].float().numpy())[::-1]
                    assert z[k - 1] - z[k] <= 2 * 2.0 ** -7 * abs(z[k - 1]), (pos, t)
                    continue
                got = wt[t][np.argsort(ix[t])]
                want = w_t[t].float().numpy()[np.argsort(i_t[t].numpy())]
                if dt == torch.float32:
                    np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)
                else:
                    np.testing.assert_array_equal(got, want)
        assert bad <= tot // 50
        assert sum(len(set(i.tolist())) for i in ix) > 0
    finally:
        eng.close()


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_gptoss_block_routed_in_c_equals_its_own_forward(dt):
    """The block's C path (router and experts in one call) against its own forward (torch's
    router, the same experts through specmoe): the output, and the tuple the decoder layer
    unpacks (GPT-OSS's block returns (output, router scores))."""
    seen = []

    def out(r):  # (out, router scores): torch's forward first, then the C path's (no scores)
        assert isinstance(r, tuple) and len(r) == 2
        seen.append(r[1])
        return r[0]
    offloaded_routed_like_own_forward(_model(dt), dt, out)
    assert seen[1::2] == [None] * (len(seen) // 2) and seen[0] is not None


def test_gptoss_greedy_tokens_equal_the_unmodified_model():
    ref, m = _model(), _model()
    eng = hf.offload(m, dtype="f32", dense="f32", cache=1.0)
    try:
        calls = _calls(eng)
        fused: dict[str, int] = {}  # the full-attention layers route inside AttnBlock.layer
        for layer in m.model.layers:
            layer.self_attn._specmoe_block = _Calls(layer.self_attn._specmoe_block, fused)
        greedy_like(ref, m, torch.tensor([[1, 5, 9, 14, 3, 27, 8, 60]]), 12)
        # every decode step's MoE blocks routed in C, alone or inside the one-call layer
        assert calls[0] + fused.get("layer", 0) >= 11 * len(m.model.layers)
        assert fused.get("layer", 0) >= 11
    finally:
        eng.close()

"""DeepSeek-V2 MoE blocks routed in C (Engine._install_routing, _C.Layers.set_block): with the
dense layers in C, the block's greedy softmax top-k routing times routed_scaling_factor, the
routed experts and the shared experts' MLP run in one C call.  Checked against the same block
with transformers' router and the shared MLP in torch (the block's own forward over the same
experts), on bad input; greedy tokens against the unmodified model: tests/test_routed.py."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specmoe import _C
from specmoe.runtime import engine as hf
from specmoe.models.testing import tiny_model


def _offload(dt, scale=None):
    m = tiny_model("deepseek_v2", dtype=dt)
    if scale is not None:
        for layer in m.model.layers[1:]:
            layer.mlp.gate.routed_scaling_factor = scale
    fmt = "f32" if dt == torch.float32 else "bf16"
    return m, hf.offload(m, dtype=fmt, dense=fmt, cache=1.0)


def _count_c_calls(eng):
    """Count the block calls that take the one C call (Engine._layer_routed)."""
    calls = [0]
    orig = eng._layer_routed

    def counted(*a, **k):
        calls[0] += 1
        return orig(*a, **k)
    eng._layer_routed = counted
    return calls


def _hidden(m):
    """The hidden states each MoE block sees on a 64-token prompt, the first 8 (decode-sized
    calls: above the shared MLP's CLinear.torch_above tokens the block's own forward runs)."""
    hs = []
    hooks = [layer.mlp.register_forward_pre_hook(
        lambda mod, args: hs.append(args[0].detach().clone())) for layer in m.model.layers[1:]]
    ids = torch.randint(3, 100, (1, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        m(ids)
    for h in hooks:
        h.remove()
    return [h[:, :8].contiguous() for h in hs]


@pytest.mark.parametrize("scale", [None, 1.7])
def test_f32_routing_and_shared_mlp_equal_torch(scale):
    m, eng = _offload(torch.float32, scale)
    try:
        blocks = [layer.mlp for layer in m.model.layers[1:]]
        assert eng.routed_in_c == list(range(len(blocks)))
        assert all(type(b).__name__ == "DeepseekV2Moe" for b in blocks)
        calls = _count_c_calls(eng)
        for pos, (block, h) in enumerate(zip(blocks, _hidden(m))):
            x = h.reshape(-1, h.shape[-1])
            with torch.no_grad():
                _, w_t, i_t = block.gate(x)
                want = block.__class__.forward(block, h)   # torch router + shared MLP
                got = block(h)                             # the one C call
            k = eng.top_k
            ix = np.empty((x.shape[0], k), np.int64)
            wt = np.empty((x.shape[0], k), np.float32)
            out = np.empty(x.shape, np.float32)
            eng._layers.forward_routed(pos, x.numpy(), ix, wt, out,
                                       np.empty(eng.num_experts, np.uint8), 0)
            for t in range(x.shape[0]):
                assert sorted(ix[t]) == sorted(i_t[t].tolist())
                # softmax over 64 logits: C and torch sum the exponentials in other orders
                # (n * eps apart at worst; 2.07e-6 seen on an Intel Xeon, under 2e-6 on AMD)
                np.testing.assert_allclose(np.sort(wt[t]), np.sort(w_t[t].numpy()), rtol=1e-5)
            np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)
            np.testing.assert_array_equal(out.reshape(got.shape), got.numpy())
        assert calls[0] == len(blocks)
    finally:
        eng.close()


def test_bf16_block_matches_torch_roundings():
    """The shared MLP's bf16 roundings (each projection, silu, the product, the sums) as torch
    makes them: the outputs agree except where silu's exp (libm vs torch's vector exp) lands on
    the other side of a bf16 rounding boundary -- rare, and then one bf16 step apart."""
    m, eng = _offload(torch.bfloat16)
    try:
        calls = _count_c_calls(eng)
        for block, h in zip([layer.mlp for layer in m.model.layers[1:]], _hidden(m)):
            with torch.no_grad():
                want = block.__class__.forward(block, h).float()
                got = block(h).float()
            assert got.dtype == want.dtype
            diff = (got - want).abs()
            ulp = want.abs().clamp_min(1e-30) * 2.0 ** -7
            assert (diff <= 2 * ulp + 1e-6).all(), float((diff / ulp).max())
            assert (diff > 0).float().mean() < 0.02
        assert calls[0] == len(m.model.layers) - 1
    finally:
        eng.close()


def test_set_cache_keeps_the_block_settings():
    """set_cache builds a new _C.Layers: the routing scale and shared MLP must follow."""
    m, eng = _offload(torch.float32, 1.7)
    try:
        h = _hidden(m)[0]
        block = m.model.layers[1].mlp
        with torch.no_grad():
            before = block(h)
        eng.set_cache(0.5)
        with torch.no_grad():
            after = block(h)
        torch.testing.assert_close(after, before, rtol=0, atol=0)
    finally:
        eng.close()


def test_set_block_bad_input_leaves_the_layer_alone():
    m, eng = _offload(torch.float32)
    try:
        h = _hidden(m)[0]
        block = m.model.layers[1].mlp
        with torch.no_grad():
            before = block(h)
        sh = block.shared_experts
        g, u, d = sh.gate_proj._c, sh.up_proj._c, sh.down_proj._c
        L = eng._layers
        with pytest.raises(ValueError, match="finite and > 0"):
            L.set_block(0, 0.0, (g, u, d))
        with pytest.raises(ValueError, match="finite and > 0"):
            L.set_block(0, float("nan"), None)
        with pytest.raises(ValueError, match="do not chain"):
            L.set_block(0, 1.0, (g, u, g))                  # down must map I -> hidden
        with pytest.raises(TypeError, match="tuple"):
            L.set_block(0, 1.0, (g, u))
        with pytest.raises(TypeError):
            L.set_block(0, 1.0, (g, u, "down"))
        with pytest.raises(ValueError, match="outside"):
            L.set_block(len(eng.layer_ids), 1.0, None)
        with pytest.raises(ValueError, match="route_flags"):
            L.forward_routed(0, h[0].numpy(), np.empty((h.shape[1], eng.top_k), np.int64),
                             np.empty((h.shape[1], eng.top_k), np.float32),
                             np.empty(h[0].shape, np.float32),
                             np.empty(eng.num_experts, np.uint8), 32)
        with torch.no_grad():
            after = block(h)
        torch.testing.assert_close(after, before, rtol=0, atol=0)
        # and None takes the shared MLP out of the call: the output loses exactly its share
        L.set_block(0, 1.0, None)
        with torch.no_grad():
            routed = block(h)
            shared = sh(h)
        torch.testing.assert_close(routed + shared, before, rtol=1e-5, atol=1e-6)
    finally:
        eng.close()


def test_group_limited_router_stays_in_torch():
    m = tiny_model("deepseek_v2")
    for layer in m.model.layers[1:]:
        layer.mlp.gate.topk_method = "group_limited_greedy"
    eng = hf.offload(m, dtype="f32", dense="f32", cache=1.0)
    try:
        assert eng.routed_in_c == []
        assert _C.ROUTE_BF16_OUT == 8
    finally:
        eng.close()

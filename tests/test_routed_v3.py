"""DeepSeek-V3's MoE blocks routed in C (Engine._install_routing, ROUTED_BLOCKS "deepseek_v3";
csrc/layer.c, csrc/route.c): with the dense layers in C, the sigmoid router, its correction
bias, the group-limited choice (n_group, topk_group), the renormalised and scaled weights, the
routed experts and the shared experts' MLP in one C call -- against the same block's own
forward (transformers' DeepseekV3TopkRouter over the same experts) for DeepSeek-V3, GLM-4.5,
GLM-4.7-Flash and dots1; groups that decide the choice; bad groups refused by name."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specmoe import _C
from specmoe.models.testing import tiny_model
from specmoe.models.layers import dense_mlp
from specmoe.runtime import engine as hf

from .test_routed_deepseek import _count_c_calls as _calls

V3 = ["deepseek_v3", "glm4_moe", "glm4_moe_lite", "dots1"]


def _model(arch, dt=torch.float32, experts=16, top_k=4, n_group=4, topk_group=2,
           norm=True, scale=2.5):
    """A tiny model of ``arch`` with 16 experts in 4 groups of which 2 are kept, a random
    correction bias (large enough to change choices) and a routing scale."""
    m = tiny_model(arch, dtype=dt, experts=experts, top_k=top_k,
                   overrides=dict(n_group=n_group, topk_group=topk_group))
    g = torch.Generator().manual_seed(5)
    for layer in m.model.layers:
        gate = getattr(layer.mlp, "gate", None)
        if gate is None or not hasattr(gate, "e_score_correction_bias"):
            continue
        gate.num_group, gate.topk_group = n_group, topk_group
        gate.norm_topk_prob = norm
        gate.routed_scaling_factor = scale
        gate.e_score_correction_bias.copy_(0.3 * torch.randn(experts, generator=g))
    return m


def _hidden(m, n=8):
    """The hidden states each MoE block sees on a 32-token prompt, the first n tokens."""
    hs = []
    blocks = [layer.mlp for layer in m.model.layers if hasattr(layer.mlp, "experts")]
    hooks = [b.register_forward_pre_hook(lambda mod, args: hs.append(args[0].detach().clone()))
             for b in blocks]
    ids = torch.randint(3, 100, (1, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        m(ids)
    for h in hooks:
        h.remove()
    return blocks, [h[:, :n].contiguous() for h in hs]


def greedy_like(ref, m, ids, n):
    """Greedy tokens of m (converted) and ref (the unmodified model) on ids, n new tokens:
    equal, and every step's logits within 1e-4."""
    kw = dict(max_new_tokens=n, do_sample=False, output_scores=True,
              return_dict_in_generate=True, pad_token_id=0)
    with torch.no_grad():
        want, got = ref.generate(ids, **kw), m.generate(ids, **kw)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.scores, want.scores):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)


def offloaded_routed_like_own_forward(m, dt, out=lambda r: r):
    """``m`` offloaded with its dense layers in C at dt (f32 / bf16), every MoE block routed
    in C, each checked by :func:`routed_like_own_forward` on its own hidden states."""
    blocks, hs = _hidden(m)
    fmt = "f32" if dt == torch.float32 else "bf16"
    eng = hf.offload(m, dtype=fmt, dense=fmt, cache=1.0)
    try:
        assert eng.routed_in_c == list(range(len(blocks)))
        routed_like_own_forward(eng, blocks, hs, dt, out)
    finally:
        eng.close()


def routed_like_own_forward(eng, blocks, hs, dt, out=lambda r: r):
    """Each block's C path (router, experts, shared experts in one call) against its class
    forward on the same input (torch's router and shared MLP around the same experts): f32
    to rounding, bf16 within 2 ulps (silu's exp may land a value on the other side of a bf16
    boundary); every call one C call.  out: the block's output from what it returns."""
    calls = _calls(eng)
    for block, h in zip(blocks, hs):
        with torch.no_grad():
            want = out(type(block).forward(block, h.clone())).float()
            got = out(block(h))
        assert got.dtype == dt and got.shape == h.shape
        if dt == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
        else:
            diff = (got.float() - want).abs()
            ulp = want.abs().clamp_min(1e-30) * 2.0 ** -7
            assert (diff <= 2 * ulp + 1e-6).all(), float((diff / ulp).max())
    assert calls[0] == len(blocks)


@pytest.mark.parametrize("norm,scale", [(True, 2.5), (False, 1.0)])
@pytest.mark.parametrize("arch", V3)
def test_f32_block_routes_as_transformers_does(arch, norm, scale):
    m = _model(arch, norm=norm, scale=scale)
    eng = hf.offload(m, dtype="f32", dense="f32", cache=1.0)
    try:
        assert eng.arch.sigmoid_router and eng.arch.bias_attr  # (V3's router, detected)
        blocks, hs = _hidden(m)
        assert eng.routed_in_c == list(range(len(blocks))) and blocks
        calls = _calls(eng)
        k = eng.top_k
        for pos, (block, h) in enumerate(zip(blocks, hs)):
            x = h.reshape(-1, h.shape[-1])
            with torch.no_grad():
                _, w_t, i_t = block.gate(x)
                want = type(block).forward(block, h)    # transformers' router + torch glue
                got = block(h)                          # the one C call
            ix = np.empty((x.shape[0], k), np.int64)
            wt = np.empty((x.shape[0], k), np.float32)
            out = np.empty(x.shape, np.float32)
            eng._layers.forward_routed(pos, x.numpy(), ix, wt, out,
                                       np.empty(eng.num_experts, np.uint8),
                                       _C.ROUTE_RENORM if norm else 0)
            for t in range(x.shape[0]):
                assert sorted(ix[t]) == sorted(i_t[t].tolist()), (pos, t)
                order = np.argsort(ix[t])
                # (the logits' sums run in another order than torch's GEMV)
                np.testing.assert_allclose(wt[t][order], w_t[t][np.argsort(i_t[t].numpy())],
                                           rtol=1e-5, atol=1e-7)
            np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-6)
        assert calls[0] == len(blocks)
    finally:
        eng.close()


def test_the_groups_decide_the_choice():
    """The group limit changes which experts some tokens get (the plain top-k of the biased
    scores would differ), and C follows transformers there too."""
    m = _model("deepseek_v3")
    eng = hf.offload(m, dtype="f32", dense="f32", cache=1.0)
    try:
        blocks, hs = _hidden(m, n=32)
        differs = 0
        for pos, (block, h) in enumerate(zip(blocks, hs)):
            x = h.reshape(-1, h.shape[-1])
            with torch.no_grad():
                _, _, i_t = block.gate(x)
                s = torch.sigmoid(x @ block.gate.weight.T) + block.gate.e_score_correction_bias
            plain = s.topk(eng.top_k, dim=-1).indices
            differs += sum(sorted(a.tolist()) != sorted(b.tolist()) for a, b in zip(plain, i_t))
            ix = np.empty((x.shape[0], eng.top_k), np.int64)
            eng._layers.forward_routed(pos, x.numpy(), ix,
                                       np.empty((x.shape[0], eng.top_k), np.float32),
                                       np.empty(x.shape, np.float32),
                                       np.empty(eng.num_experts, np.uint8), _C.ROUTE_RENORM)
            assert [sorted(r) for r in ix.tolist()] == [sorted(r) for r in i_t.tolist()]
        assert differs > 0
    finally:
        eng.close()


@pytest.mark.parametrize("arch", ["deepseek_v3", "glm4_moe_lite"])
def test_bf16_block_matches_torch_roundings(arch):
    """bf16 model: the f32 routing, the experts' and shared MLP's bf16 roundings as torch makes
    them (silu's exp may land a value on the other side of a bf16 boundary: rare, one step)."""
    m = _model(arch, dt=torch.bfloat16)
    eng = hf.offload(m, dtype="bf16", dense="bf16", cache=1.0)
    try:
        blocks, hs = _hidden(m)
        calls = _calls(eng)
        for block, h in zip(blocks, hs):
            with torch.no_grad():
                want = type(block).forward(block, h).float()
                got = block(h)
            assert got.dtype == torch.bfloat16
            diff = (got.float() - want).abs()
            ulp = want.abs().clamp_min(1e-30) * 2.0 ** -7
            assert (diff <= 2 * ulp + 1e-6).all(), float((diff / ulp).max())
            assert (diff > 0).float().mean() < 0.02
        assert calls[0] == len(blocks)
    finally:
        eng.close()


def test_bad_groups_are_refused_by_name_and_leave_the_layer_alone():
    m = _model("deepseek_v3")
    eng = hf.offload(m, dtype="f32", dense="f32", cache=1.0)
    try:
        blocks, hs = _hidden(m)
        with torch.no_grad():
            before = blocks[0](hs[0])
        sh = blocks[0].shared_experts
        lin = (sh.gate_proj._c, sh.up_proj._c, sh.down_proj._c)
        for bad in ((3, 1), (4, 5), (4, 0), (0, 1), (16, 1), (8, 1)):
            # 16 experts: 3 groups do not divide them, 16 groups are of one, 8 groups of 2 with
            # one kept leave 2 of the top-4
            with pytest.raises(ValueError, match="groups .* do not fit 16 experts, top-4"):
                eng._layers.set_block(0, 2.5, lin, *bad)
        with torch.no_grad():
            after = blocks[0](hs[0])
        torch.testing.assert_close(after, before, rtol=0, atol=0)
    finally:
        eng.close()


def test_greedy_tokens_equal_the_unmodified_model():
    ref = _model("deepseek_v3")
    m = _model("deepseek_v3")
    eng = hf.offload(m, dtype="f32", dense="f32", cache=1.0)
    try:
        calls = _calls(eng)
        greedy_like(ref, m, torch.tensor([[1, 5, 9, 33, 7, 64, 3]]), 8)
        # the decode steps' MoE blocks ran in C (inside one-call layers: not through
        # _layer_routed, whose count is the blocks called on their own)
        step = m._specmoe_decode_step
        assert step.planned == 7, (step.planned, calls[0])
    finally:
        eng.close()


def _minimax(dt=torch.float32):
    """A tiny MiniMax-M2 with a random correction bias on its MoE blocks."""
    m = tiny_model("minimax_m2", dtype=dt)
    g = torch.Generator().manual_seed(6)
    for layer in m.model.layers:
        b = layer.mlp.e_score_correction_bias
        b.copy_(0.3 * torch.randn(b.shape, generator=g))
    return m


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
def test_minimax_m2_block_routes_as_transformers_does(dt):
    """MiniMax-M2's router (logits in the model's dtype, sigmoid, the block's correction bias
    for the choice, renormalised weights; no groups, scale or shared experts) in C, against
    the block's own forward."""
    offloaded_routed_like_own_forward(_minimax(dt), dt)


def test_minimax_m2_decodes_in_one_call_a_step():
    """MiniMax-M2's attention (q/k norms over all heads, a partial rotary) and MoE block are one
    AttnBlock.layer call per layer, a decode step one DecodePlan call; greedy tokens and logits
    as the unmodified model's."""
    ref, m = _minimax(), _minimax()
    eng = hf.offload(m, dtype="f32", dense="f32", cache=1.0)
    try:
        attn = m.model.layers[0].self_attn
        assert attn._specmoe_block_form.rot < attn.head_dim  # (tiny_model's partial rotary)
        greedy_like(ref, m, torch.tensor([[1, 5, 9, 33, 7, 64, 3]]), 8)
        assert m._specmoe_decode_step.planned == 7
    finally:
        eng.close()


def test_glm4_moe_layers_decode_in_one_call():
    """GLM-4.5's decoder layers (its attention with q/k/v biases and a half-rotary head, the
    V3 router) are one AttnBlock.layer call a decode step, the dense first layer's with its
    MLP in the block (set_mlp); greedy tokens and logits as the unmodified model's."""
    ref, m = _model("glm4_moe"), _model("glm4_moe")
    eng = hf.offload(m, dtype="f32", dense="f32", cache=1.0)
    try:
        calls = [0]

        class Counting:
            def __init__(self, blk):
                self.blk = blk

            def layer(self, *a):
                calls[0] += 1
                return self.blk.layer(*a)

            def pre(self, *a):
                return self.blk.pre(*a)

            def post(self, *a):
                return self.blk.post(*a)
        for layer in m.model.layers:
            layer.self_attn._specmoe_block = Counting(layer.self_attn._specmoe_block)
        ids = torch.tensor([[1, 5, 9, 33, 7, 64, 3]])
        kw = dict(max_new_tokens=6, do_sample=False, output_scores=True,
                  return_dict_in_generate=True, pad_token_id=0)
        with torch.no_grad():
            want, got = ref.generate(ids, **kw), m.generate(ids, **kw)
        dense = [la for la in m.model.layers if dense_mlp(la) is not None]
        assert dense and eng.routed_in_c
        assert calls[0] == 5 * (len(eng.routed_in_c) + len(dense))
        assert torch.equal(got.sequences, want.sequences)
        for a, b in zip(got.scores, want.scores):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    finally:
        eng.close()

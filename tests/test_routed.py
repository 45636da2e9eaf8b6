"""MoE blocks routed in C (Engine._install_routing, _C.Layers.forward_routed): with the dense
layers in C, the OLMoE, Qwen3-MoE and Mixtral blocks compute their softmax top-k routing in the
experts' C call, and Qwen2-MoE's form (Qwen3-Next, Qwen3.5) its gated shared expert too.  Checked against transformers' own router modules on the hidden states the
blocks see (f32: the same experts and weights to f32 rounding; bf16: the same weights bit for
bit wherever the expert sets agree, and sets that disagree only at a near-tie), greedy tokens
against the unmodified model, the paths left to torch, and bad input."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from specmoe import _C
from specmoe.runtime import engine as hf
from specmoe.models.testing import tiny_model

ARCHS = ["olmoe", "qwen3_moe", "mixtral"]
# Qwen2-MoE's form: the same router plus a shared expert scaled by sigmoid(shared_expert_gate x)
SHARED = ["qwen2_moe", "qwen3_next", "qwen3_5_moe_text"]


def _offload(arch, dt, **kw):
    m = tiny_model(arch, dtype=dt)
    fmt = "f32" if dt == torch.float32 else "bf16"
    eng = hf.offload(m, dtype=fmt, dense=kw.pop("dense", fmt), cache=1.0, **kw)
    return m, eng


def _flags(block, dt):
    """The route flags transformers' router of `block` implies (independent of the Engine)."""
    name = type(block).__name__
    f = _C.ROUTE_RENORM if name.startswith(("Mixtral", "Qwen3_5")) \
        or block.gate.norm_topk_prob else 0
    if dt == torch.bfloat16:
        f |= _C.ROUTE_BF16_LOGITS
        if not type(block).__name__.startswith("Mixtral"):
            f |= _C.ROUTE_BF16_WEIGHTS
    return f


def _compare(m, eng, dt):
    """(tokens, set mismatches, worst weight difference where sets agree, near-tie failures)."""
    hs: list[torch.Tensor] = []
    hooks = [layer.mlp.register_forward_pre_hook(
        lambda mod, args: hs.append(args[0].detach().clone())) for layer in m.model.layers]
    ids = torch.randint(3, 100, (1, 200), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        m(ids)
    for h in hooks:
        h.remove()
    tot = bad = near_fail = 0
    wdiff = 0.0
    k = eng.top_k
    for pos, h in enumerate(hs):
        block = m.model.layers[pos].mlp
        x = h.reshape(-1, h.shape[-1])
        with torch.no_grad():
            logits, w_t, i_t = block.gate(x)
            p_t = torch.softmax(logits.float(), -1).numpy()
        T = x.shape[0]
        ix = np.empty((T, k), np.int64)
        wt = np.empty((T, k), np.float32)
        out = np.empty((T, x.shape[1]), np.float32)
        eng._layers.forward_routed(pos, x.float().numpy(), ix, wt, out,
                                   np.empty(eng.num_experts, np.uint8), _flags(block, dt))
        for t in range(T):
            tot += 1
            if sorted(ix[t]) == sorted(i_t[t].tolist()):
                order = np.argsort(ix[t])
                want = w_t[t].float().numpy()[np.argsort(i_t[t].numpy())]
                wdiff = max(wdiff, float(np.abs(wt[t][order] - want).max()))
            else:
                bad += 1
                kth = np.sort(p_t[t])[::-1][k - 1]
                if p_t[t][ix[t]].min() < kth * 0.98:    # more than a bf16 near-tie apart
                    near_fail += 1
    return tot, bad, wdiff, near_fail


@pytest.mark.parametrize("arch", ARCHS + SHARED)
def test_f32_routing_equals_transformers(arch):
    m, eng = _offload(arch, torch.float32)
    try:
        assert eng.routed_in_c == list(range(len(eng.layer_ids)))
        tot, bad, wdiff, _ = _compare(m, eng, torch.float32)
        assert tot == 200 * len(eng.layer_ids) and bad == 0
        assert wdiff < 2e-6
    finally:
        eng.close()


@pytest.mark.parametrize("arch", ARCHS + SHARED)
def test_bf16_routing_equals_transformers_but_near_ties(arch):
    m, eng = _offload(arch, torch.bfloat16)
    try:
        tot, bad, wdiff, near_fail = _compare(m, eng, torch.bfloat16)
        assert bad <= tot // 100 and near_fail == 0
        assert wdiff <= (2e-7 if arch == "mixtral" else 0.0)    # bf16 weights: the same bits
    finally:
        eng.close()


@pytest.mark.parametrize("arch", ARCHS + SHARED + ["deepseek_v2"])  # (test_routed_deepseek.py)
def test_greedy_tokens_equal_unmodified_model(arch):
    ref = tiny_model(arch)
    m, eng = _offload(arch, torch.float32)
    try:
        assert eng.routed_in_c
        p = torch.tensor([[1, 5, 9, 14, 3, 27, 8, 60]])
        kw = dict(max_new_tokens=16, do_sample=False)
        assert torch.equal(ref.generate(p, **kw), m.generate(p, **kw))
    finally:
        eng.close()


def test_paths_left_to_torch():
    m, eng = _offload("olmoe", torch.float32, dense="torch")
    try:
        assert eng.routed_in_c == []                      # routers stay torch's
    finally:
        eng.close()
    m, eng = _offload("qwen2_moe", torch.float32)         # a gate that is not one row
    try:
        assert eng.routed_in_c == list(range(len(eng.layer_ids)))
    finally:
        eng.close()
    m = tiny_model("qwen2_moe")
    for layer in m.model.layers:
        layer.mlp.shared_expert_gate = torch.nn.Linear(m.config.hidden_size, 2, bias=False)
    eng = hf.offload(m, dtype="f32", dense="f32", cache=1.0)
    try:
        assert eng.routed_in_c == []
    finally:
        eng.close()
    m, eng = _offload("olmoe", torch.float32)
    try:
        calls: list[str] = []

        class Spy:
            def __init__(self, blk):
                self.blk = blk

            def __getattr__(self, n):
                f = getattr(self.blk, n)

                def call(*a):
                    calls.append(n)
                    return f(*a)
                return call
        for layer in m.model.layers:
            layer.self_attn._specmoe_block = Spy(layer.self_attn._specmoe_block)
        p = torch.tensor([[1, 5, 9, 14]])
        with eng.trace() as rec:                         # recording: the torch router
            m.generate(p, max_new_tokens=3, do_sample=False)
        assert "layer" not in calls and rec.result().num_tokens > 0
        calls.clear()
        m.generate(p, max_new_tokens=3, do_sample=False)
        # the prefill initialises the cache through pre/post; the 2 decode steps: one call a layer
        assert calls == ["pre", "post"] * 3 + ["layer"] * 6
    finally:
        eng.close()


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ARCHS)
def test_one_call_layer_equals_the_three_call_path(arch, dt):
    """_C.AttnBlock.layer (attention block, KV append, MoE block in one call) computes every
    intermediate as pre, post and forward_routed do: the same logits, bit for bit."""
    base = tiny_model(arch, dtype=dt)
    fmt = "f32" if dt == torch.float32 else "bf16"
    a, b = copy.deepcopy(base), copy.deepcopy(base)
    ea = hf.offload(a, dtype=fmt, dense=fmt, cache=1.0)
    eb = hf.offload(b, dtype=fmt, dense=fmt, cache=1.0)
    try:
        for layer in b.model.layers:
            del layer.mlp._specmoe_route                # b: pre, post, forward_routed
        p = torch.randint(3, 100, (1, 9), generator=torch.Generator().manual_seed(5))
        kw = dict(max_new_tokens=40, do_sample=False, output_logits=True,
                  return_dict_in_generate=True)
        ra, rb = a.generate(p, **kw), b.generate(p, **kw)
        assert torch.equal(ra.sequences, rb.sequences)
        for x, y in zip(ra.logits, rb.logits):
            assert torch.equal(x, y)
    finally:
        ea.close()
        eb.close()


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", SHARED)
def test_gated_shared_expert_block_equals_its_own_forward(arch, dt):
    """A Qwen2-MoE-form block routed in C (router, experts, shared expert, its sigmoid gate and
    the sum in one forward_routed call) against transformers' forward of the same block on the
    same weights: bf16 bit for bit, f32 to rounding."""
    m, eng = _offload(arch, dt)
    try:
        assert eng.routed_in_c == list(range(len(eng.layer_ids)))
        g = torch.Generator().manual_seed(1)
        for pos, i in enumerate(eng.layer_ids):
            block = m.model.layers[i].mlp
            assert len(eng._blocks[pos][1]) == 4  # gate, up, down and the output gate
            x = torch.randn(5, 1, m.config.hidden_size, generator=g).to(dt)
            with torch.no_grad():
                got, want = block(x), type(block).forward(block, x)
            if dt == torch.bfloat16:
                assert torch.equal(got, want)
            else:
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    finally:
        eng.close()


def test_bad_input():
    m, eng = _offload("olmoe", torch.float32)
    try:
        x = np.zeros((2, m.config.hidden_size), np.float32)
        k, E = eng.top_k, eng.num_experts
        args = (0, x, np.empty((2, k), np.int64), np.empty((2, k), np.float32),
                np.empty_like(x), np.empty(E, np.uint8))
        with pytest.raises(ValueError, match="route_flags"):
            eng._layers.forward_routed(*args, 99)
        with pytest.raises(TypeError, match="forward_routed"):
            eng._layers.forward_routed(*args)
        with pytest.raises(ValueError, match="writ"):
            ro = np.empty((2, k), np.int64)
            ro.flags.writeable = False
            eng._layers.forward_routed(0, x, ro, args[3], args[4], args[5], 0)
    finally:
        eng.close()
    # ERNIE-4.5's correction bias on softmax scores (test_routed_ernie.py) cannot be chosen
    # by the logits: GPT-OSS's top-k softmax on such a router is refused, nothing written
    m, eng = _offload("ernie4_5_moe", torch.float32, dense="torch")
    try:
        assert eng.arch.bias_attr and not eng.arch.sigmoid_router
        x = np.zeros((1, m.config.hidden_size), np.float32)
        k, E = eng.top_k, eng.num_experts
        idx = np.full((1, k), -7, np.int64)
        with pytest.raises(ValueError, match="ROUTE_TOPK_SOFTMAX chooses by the logits"):
            eng._layers.forward_routed(0, x, idx, np.empty((1, k), np.float32),
                                       np.empty_like(x), np.empty(E, np.uint8),
                                       _C.ROUTE_TOPK_SOFTMAX)
        assert (idx == -7).all()
    finally:
        eng.close()


@pytest.mark.parametrize("arch", ARCHS)
def test_speculative_generate_through_fused_layers(arch):
    """specmoe.generate on a model with dense layers in C (lm_head a CLinear, which has no
    weight tensor: it used to fail there) and fused decoder layers: verification chunks of
    K + 1 tokens run through the one-call path, rejected drafts crop the KV buffers, and the
    tokens equal the unmodified model's greedy ones."""
    import specmoe
    from specmoe.speculation.controllers.static import StaticK
    from specmoe.speculation.drafters import NgramDrafter
    ref = tiny_model(arch)
    m, eng = _offload(arch, torch.float32)
    try:
        p = torch.tensor([[1, 5, 9, 14, 3, 27, 8, 60, 5, 9, 14, 3, 27, 8]])
        want = ref.generate(p, max_new_tokens=24, do_sample=False)
        for k in (2, 8):
            out = specmoe.generate(m, p, drafter=NgramDrafter(), controller=StaticK(k),
                                   max_new_tokens=24)
            assert torch.equal(out.sequences[:, :want.shape[1]], want)
    finally:
        eng.close()


def test_layer_call_bad_input_leaves_everything_alone():
    m, eng = _offload("olmoe", torch.float32)
    try:
        attn = m.model.layers[0].self_attn
        blk = attn._specmoe_block
        H, Hkv, D, hid, _ = attn._specmoe_block_form[:5]
        x = np.ones((1, hid), np.float32)
        cs = np.ones((1, D), np.float32)
        kb = np.full((1, Hkv, 8, D), 7.0, np.float32)
        vb = kb.copy()
        ln = np.ones(hid, np.float32)
        out = np.full((1, hid), 7.0, np.float32)

        def call(**kw):
            a = dict(layers=eng._layers, pos=0, flags=0, x=x, cos=cs, sin=cs, kb=kb, vb=vb, S=3,
                     bias=None, scale=0.1, ln1=ln, e1=1e-6, ln2=ln, e2=1e-6, out=out)
            a.update(kw)
            return blk.layer(*a.values())
        bad = [(dict(flags=99), ValueError, "route_flags"),
               (dict(layers=object()), TypeError, "Layers"),
               (dict(pos=7), ValueError, "pos 7"),
               (dict(S=8), ValueError, "do not fit"),
               (dict(vb=np.zeros((1, Hkv, 8, D), np.float32).view(np.uint16)[..., :D]
                     .copy()), ValueError, "same dtype"),
               (dict(kb=np.zeros((1, Hkv + 1, 8, D), np.float32)), ValueError, "kbuf"),
               (dict(bias=np.zeros((1, 1, 3), np.float32)), ValueError, "bias"),
               (dict(ln2=np.ones(hid - 1, np.float32)), ValueError, "ln has"),
               (dict(out=x), ValueError, "alias")]
        for kw, exc, what in bad:
            with pytest.raises(exc, match=what):
                call(**kw)
        np.testing.assert_array_equal(kb, 7.0)
        np.testing.assert_array_equal(out, 7.0)
        ta, tm, td = call()                               # and a good call goes through
        assert ta > 0 and tm > 0 and td == 0.0 and np.isfinite(out).all()
        assert (kb[:, :, 3] != 7.0).any() and (kb[:, :, 4:] == 7.0).all()
    finally:
        eng.close()

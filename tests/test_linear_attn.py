"""Recurrent layers of hybrid models on the CPU (specmoe.models.linear_attn): the C kernel of the
gated delta rule (csrc/kernels/gdelta.c) against a plain reference of its arithmetic and
against transformers' own recurrent rule; an offloaded Qwen3-Next / Qwen3.5 decoding through
it with the unmodified model's logits, the unmodified model untouched; the bf16 short
convolutions held in f32."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from specmoe import _C
from specmoe.models import linear_attn
from specmoe.models.testing import tiny_model
from specmoe.runtime.engine import offload


def _reference(q, k, v, g, beta, state, l2norm):
    """The rule in plain loops (float64): per sequence, value head (key head h // (Hv // Hk))
    and token in order."""
    B, T, Hk, dk = q.shape
    Hv, dv = v.shape[2:]
    S = state.astype(np.float64).copy()
    out = np.zeros((B, T, Hv, dv))
    for b in range(B):
        for h in range(Hv):
            hk = h // (Hv // Hk)
            for t in range(T):
                qq, kk = q[b, t, hk].astype(np.float64), k[b, t, hk].astype(np.float64)
                if l2norm:
                    qq = qq / np.sqrt((qq * qq).sum() + 1e-6)
                    kk = kk / np.sqrt((kk * kk).sum() + 1e-6)
                qq = qq / np.sqrt(dk)
                e = np.exp(g[b, t, h])
                u = beta[b, t, h] * (v[b, t, h] - e * (S[b, h].T @ kk))
                S[b, h] = e * S[b, h] + np.outer(kk, u)
                out[b, t, h] = S[b, h].T @ qq
    return out, S


def _problem(B=2, T=3, Hk=2, Hv=4, dk=16, dv=8, seed=0):
    rng = np.random.default_rng(seed)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    return (f(B, T, Hk, dk), f(B, T, Hk, dk), f(B, T, Hv, dv),
            -rng.random((B, T, Hv)).astype(np.float32), rng.random((B, T, Hv)).astype(np.float32),
            f(B, Hv, dk, dv))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("l2norm", [True, False])
@pytest.mark.parametrize("shape", [(2, 3, 2, 4, 16, 8), (1, 1, 16, 32, 128, 128),
                                   (3, 2, 3, 3, 5, 7)])
def test_kernel_equals_a_plain_reference(threads, l2norm, shape):
    q, k, v, g, beta, s0 = _problem(*shape)
    want, want_s = _reference(q, k, v, g, beta, s0, l2norm)
    state, out = s0.copy(), np.full(v.shape, np.nan, np.float32)
    _C.KernelContext(threads).gated_delta(q, k, v, g, beta, state, out, l2norm)
    np.testing.assert_allclose(out, want, rtol=2e-4, atol=2e-4)
    np.testing.assert_allclose(state, want_s, rtol=2e-4, atol=2e-4)


def test_kernel_equals_transformers_recurrent_rule():
    from transformers.models.qwen3_next import modeling_qwen3_next as mq
    original = getattr(mq.torch_recurrent_gated_delta_rule, "_specmoe_original",
                       mq.torch_recurrent_gated_delta_rule)
    q, k, v, g, beta, s0 = map(torch.from_numpy, _problem())
    for l2 in (True, False):
        want, want_s = original(q, k, v, g=g, beta=beta, initial_state=s0.clone(),
                                output_final_state=True, use_qk_l2norm_in_kernel=l2)
        got, got_s = linear_attn._c_step(_C.KernelContext(1), q, k, v, g, beta, s0.clone(),
                                         True, l2)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got_s, want_s, atol=1e-5, rtol=1e-5)


def test_bad_shapes_are_refused_by_name():
    q, k, v, g, beta, s0 = _problem()
    ctx = _C.KernelContext(1)
    out = np.zeros(v.shape, np.float32)
    with pytest.raises(ValueError, match="gated_delta: shapes must be"):
        ctx.gated_delta(q, k, v, g, beta, s0[:, :2].copy(), out, True)
    with pytest.raises(ValueError, match="state must have dtype"):
        ctx.gated_delta(q, k, v, g, beta, s0.astype(np.float64), out, True)
    with pytest.raises(ValueError, match="not a multiple of key heads"):
        q3 = np.zeros((2, 3, 3, 16), np.float32)
        ctx.gated_delta(q3, q3, v, g, beta, s0, out, True)


class _Count:
    def __init__(self, monkeypatch):
        self.n = 0
        real = linear_attn._c_step

        def counting(*a, **kw):
            self.n += 1
            return real(*a, **kw)
        monkeypatch.setattr(linear_attn, "_c_step", counting)


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_moe_text"])
def test_offloaded_model_decodes_through_the_kernel_with_the_unmodified_logits(arch,
                                                                               monkeypatch):
    calls = _Count(monkeypatch)
    ref, m = tiny_model(arch), tiny_model(arch)
    eng = offload(m, dtype="f32", cache=1.0)
    calls.n = 0  # (offload's own check of the kernel against the modeling module's rule)
    try:
        assert eng.recurrent["c_gated_delta"] == ["model.layers.0.linear_attn",
                                                  "model.layers.2.linear_attn"]
        ids = torch.tensor([[1, 5, 9, 33, 7, 64, 3]])
        kw = dict(max_new_tokens=8, do_sample=False, output_scores=True,
                  return_dict_in_generate=True, pad_token_id=0)
        with torch.no_grad():
            want = ref.generate(ids, **kw)
            assert calls.n == 0  # the unmodified model keeps transformers' code
            got = m.generate(ids, **kw)
        # every decode step of both linear-attention layers (the prefill is chunked)
        assert calls.n == 2 * 7
        assert torch.equal(got.sequences, want.sequences)
        for a, b in zip(got.scores, want.scores):
            torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    finally:
        eng.close()


@pytest.mark.parametrize("arch", ["qwen3_next", "granitemoehybrid", "lfm2_moe", "jamba",
                                  "kimi_linear"])
def test_bf16_short_convolutions_run_in_f32(arch):
    ref, m = tiny_model(arch, dtype=torch.bfloat16), tiny_model(arch, dtype=torch.bfloat16)
    eng = offload(m, dtype="bf16", cache=1.0)
    try:
        convs = eng.recurrent["f32_convs"]
        assert convs and all(m.get_submodule(n).weight.dtype == torch.float32 for n in convs)
        ids = torch.tensor([[1, 5, 9, 33, 7, 64, 3]])
        kw = dict(max_new_tokens=6, do_sample=False, output_scores=True,
                  return_dict_in_generate=True, pad_token_id=0)
        with torch.no_grad():
            want, got = ref.generate(ids, **kw), m.generate(ids, **kw)
        # the same model up to bf16 rounding (the product is now formed in f32)
        for a, b in zip(got.scores[:1], want.scores[:1]):
            torch.testing.assert_close(a.float(), b.float(), atol=0.1, rtol=0.05)
    finally:
        eng.close()

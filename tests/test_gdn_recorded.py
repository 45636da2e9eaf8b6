"""A speculative verification through a gated DeltaNet layer in one C call (``GdnBlock.steps``):
on a cache that records its past (transformers >= 5.25, ``new_kv(rollback=True)``) the T tokens
of a verification run as transformers' module runs them there -- every token a recurrent step,
the conv window grown by the T inputs, the state after each token recorded -- and a crop back
to any of them restores what the module's own forward would have left.  References:
transformers' forward of the same module on a copy of the same cache, and the block's own
in-place form (hist None) for the states."""
from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from specmoe.models.testing import tiny_model
from specmoe.runtime.engine import offload
from specmoe.speculation.decoding import cache_kwargs, crop_kv, new_kv, records_recurrent_states

GDN = ["qwen3_5_moe_text", "qwen3_next"]  # Qwen3.5's four projections, Qwen3-Next's interleaved
WINDOW = 6  # recurrent states a forward keeps (new_kv's window)


class _CountingSteps:
    """A GdnBlock stand-in that counts its steps calls."""

    def __init__(self, blk):
        self.blk, self.n = blk, 0

    def step(self, *a):
        return self.blk.step(*a)

    def layer(self, *a):
        return self.blk.layer(*a)

    def steps(self, *a):
        self.n += 1
        return self.blk.steps(*a)


def _recording(arch, dtype):
    """A tiny offloaded model (dense layers in specmoe's kernels, so its gated DeltaNet modules
    are fused), its engine and a recording cache after an 8-token prompt, cut back to it."""
    m = tiny_model(arch, dtype=dtype)
    sd = "bf16" if dtype == torch.bfloat16 else "f32"
    eng = offload(m, dtype=sd, cache=1.0, dense=sd)
    if not records_recurrent_states(m):
        eng.close()
        pytest.skip("transformers < 5.25 records no recurrent states")
    kv = new_kv(m, rollback=True, window=WINDOW)
    ids = torch.randint(3, 100, (1, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        m(input_ids=ids, use_cache=True, **cache_kwargs(m, kv))
    crop_kv(kv, 8)
    return m, eng, kv


@pytest.mark.parametrize("T", [1, 3, WINDOW])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", GDN)
def test_recorded_tokens_equal_the_module_forward(arch, dtype, T, monkeypatch):
    m, eng, kv = _recording(arch, dtype)
    try:
        mod = m.model.layers[0].linear_attn
        counting = _CountingSteps(mod._specmoe_gdn)
        monkeypatch.setattr(mod, "_specmoe_gdn", counting)
        x = torch.randn(1, T, m.config.hidden_size,
                        generator=torch.Generator().manual_seed(T)).to(dtype)
        mine, ref = copy.deepcopy(kv), copy.deepcopy(kv)
        with torch.no_grad():
            got = mod(x, cache=mine)
            want = type(mod).forward(mod, x, cache=ref)
        assert counting.n == 1  # one C call, not the module's forward
        a, b = mine.layers[0], ref.layers[0]
        assert int(mine.get_seq_length()) == int(ref.get_seq_length()) == 8 + T
        # the window grown by the T projected inputs, as the module's
        assert a.conv_states[0].shape == b.conv_states[0].shape
        assert torch.equal(a.conv_states[0], b.conv_states[0])
        ha, hb = a.recurrent_states_history[0], b.recurrent_states_history[0]
        assert len(ha) == len(hb) == T
        states_a = ha[1:] + [a.recurrent_states[0]]
        states_b = hb[1:] + [b.recurrent_states[0]]
        assert torch.equal(ha[0], hb[0])  # the state before the verification, untouched
        for sa, sb in zip(states_a, states_b):
            torch.testing.assert_close(sa, sb, rtol=1e-5, atol=1e-6 * float(sb.abs().max()))
        scale = float(want.abs().max())
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * scale)
        else:  # the rule's f32 sums in another order can move a rounding by one bf16 step
            assert (got == want).float().mean() > 0.95
            torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=1e-3 * scale)
        # cut back to any number of the T tokens: the state and window the module's would be
        # (layer 0's own crop: the other layers of these caches ran nothing)
        for keep in range(T + 1):
            la, lb = copy.deepcopy(a), copy.deepcopy(b)
            la.crop(keep - T)
            lb.crop(keep - T)
            assert torch.equal(la.conv_states[0], lb.conv_states[0])
            torch.testing.assert_close(la.recurrent_states[0], lb.recurrent_states[0],
                                       rtol=1e-5, atol=1e-6)
            assert int(la.get_seq_length()) == 8 + keep
    finally:
        eng.close()


def test_more_tokens_than_the_window_take_the_module_forward(monkeypatch):
    """A forward of more tokens than the states the cache keeps (a prompt on a recording cache)
    is the module's: transformers runs its first tokens in the chunked form there."""
    m, eng, kv = _recording("qwen3_5_moe_text", torch.float32)
    try:
        mod = m.model.layers[0].linear_attn
        counting = _CountingSteps(mod._specmoe_gdn)
        monkeypatch.setattr(mod, "_specmoe_gdn", counting)
        x = torch.randn(1, WINDOW + 1, m.config.hidden_size)
        with torch.no_grad():
            mod(x, cache=kv)
        assert counting.n == 0
    finally:
        eng.close()


@pytest.mark.parametrize("arch", GDN)
def test_steps_without_hist_update_the_state_in_place(arch):
    """hist None: the same arithmetic, the state updated in place to the last token's, the
    window's last columns and the outputs as with hist."""
    m, eng, _ = _recording(arch, torch.float32)
    try:
        mod = m.model.layers[0].linear_attn
        blk, (C, Hv, dk, dv, _) = mod._specmoe_gdn, mod._specmoe_gdn_shape
        T, K, hidden = 4, int(mod.conv1d.kernel_size[0]), m.config.hidden_size
        rng = np.random.default_rng(1)
        x = rng.standard_normal((T, hidden)).astype(np.float32)
        win = rng.standard_normal((C, K - 1 + T)).astype(np.float32)
        st = (rng.standard_normal((Hv, dk, dv)) * 0.1).astype(np.float32)
        hist = np.empty((T, Hv, dk, dv), np.float32)
        w1, o1, s0 = win.copy(), np.empty((T, hidden), np.float32), st.copy()
        blk.steps(x, w1, st, hist, o1)
        assert np.array_equal(st, s0)  # read only with hist
        w2, o2 = win.copy(), np.empty((T, hidden), np.float32)
        blk.steps(x, w2, st, None, o2)
        assert np.array_equal(st, hist[-1]) and not np.array_equal(st, s0)
        assert np.array_equal(o1, o2) and np.array_equal(w1, w2)
        assert np.array_equal(w1[:, :K - 1], win[:, :K - 1])  # the window so far kept
    finally:
        eng.close()


def test_steps_refuse_bad_input_by_name():
    m, eng, _ = _recording("qwen3_5_moe_text", torch.float32)
    try:
        mod = m.model.layers[0].linear_attn
        blk, (C, Hv, dk, dv, _) = mod._specmoe_gdn, mod._specmoe_gdn_shape
        T, K, hidden = 3, int(mod.conv1d.kernel_size[0]), m.config.hidden_size
        x, out = np.zeros((T, hidden), np.float32), np.zeros((T, hidden), np.float32)
        win = np.zeros((C, K - 1 + T), np.float32)
        st, hist = np.zeros((Hv, dk, dv), np.float32), np.zeros((T, Hv, dk, dv), np.float32)
        with pytest.raises(ValueError, match="columns, expected >= tokens"):
            blk.steps(x, win[:, 1:].copy(), st, hist, out)
        with pytest.raises(ValueError, match="max_rows"):
            blk.steps(np.zeros((65, hidden), np.float32), np.zeros((C, 70), np.float32), st,
                      None, np.zeros((65, hidden), np.float32))
        with pytest.raises(ValueError, match=r"hist \[tokens, v_heads, k_dim, v_dim\]"):
            blk.steps(x, win, st, hist[:2].copy(), out)
        with pytest.raises(ValueError, match=r"state \[v_heads, k_dim, v_dim\]"):
            blk.steps(x, win, st[:1].copy(), hist, out)
        with pytest.raises(ValueError, match="must not alias"):
            blk.steps(x, win, st, hist, x)
        with pytest.raises(TypeError, match="steps"):
            blk.steps(x, win, st, hist)
        before = win.copy(), st.copy(), hist.copy()
        blk.steps(x, win, st, hist, out)  # zeros in: nothing but the new columns (zero) moves
        assert np.array_equal(win, before[0]) and np.array_equal(st, before[1])
        assert not np.any(out) and not np.any(hist)
    finally:
        eng.close()


def test_the_recorded_path_serves_a_speculative_generation(monkeypatch):
    """specmoe.generate with drafts on Qwen3.5-MoE: its verifications go through steps (the
    token equality with greedy decoding is tests/test_hybrid_speculation.py's)."""
    import specmoe
    from specmoe.speculation.controllers import StaticK
    m, eng, _ = _recording("qwen3_5_moe_text", torch.float32)
    try:
        mods = [mod for mod in m.modules() if getattr(mod, "_specmoe_gdn", None) is not None]
        counters = [_CountingSteps(mod._specmoe_gdn) for mod in mods]
        for mod, c in zip(mods, counters):
            monkeypatch.setattr(mod, "_specmoe_gdn", c)
        ids = torch.randint(3, 100, (12,), generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            want = m.generate(ids[None], max_new_tokens=12, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0]

        class Oracle:  # the right continuation, so every verification is 4 tokens
            def propose(self, history, k):
                return want[len(history):len(history) + k].tolist()
        out = specmoe.generate(m, ids, max_new_tokens=12, drafter=Oracle(),
                               controller=StaticK(3), eos_token_id=None, tau=None)
        assert torch.equal(out.sequences[0], want)
        assert all(c.n > 0 for c in counters)
    finally:
        eng.close()


def test_a_draft_step_on_a_recording_cache_leaves_the_next_plain_steps_their_plan():
    """A one-token step while the cache records (a self-draft's step on the target's cache)
    cannot be a decode plan's; the plain steps after its cut take a plan again at once, not
    _PLAN_RETRY_STEPS later (the server's one-client Cascade lost half its plans to this)."""
    from specmoe.speculation.decoding import unrecorded
    m, eng, kv = _recording("qwen3_5_moe_text", torch.float32)
    try:
        ds = getattr(m, "_specmoe_decode_step", None)
        if ds is None:
            pytest.skip("no one-call decode step on this model")

        def step(tok):
            S = int(kv.get_seq_length())
            with torch.no_grad():
                m(input_ids=torch.tensor([[tok]]), attention_mask=torch.ones(
                    (1, S + 1), dtype=torch.long), use_cache=True, **cache_kwargs(m, kv))
        for t in (5, 6, 7):
            with unrecorded(kv):
                step(t)
        assert ds.planned >= 1
        step(8)                                  # recorded: the drafting step
        crop_kv(kv, int(kv.get_seq_length()) - 1)
        before = ds.planned
        for t in (9, 10, 11, 12):
            with unrecorded(kv):
                step(t)
        assert ds.planned - before == 4
    finally:
        eng.close()

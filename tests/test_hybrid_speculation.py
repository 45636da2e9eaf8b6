"""Speculative decoding on linear-attention and Mamba hybrids (Qwen3-Next, Qwen3.5-MoE, Jamba,
Kimi-Linear): from transformers 5.25 a cache recording its past keeps the recurrent states of
the last tokens of each forward (specmoe.speculation.decoding.new_kv's window), so a
verification is cut back to its accepted drafts.  Reference: transformers' own greedy decoding
of the same offloaded model, token for token, with drafts accepted and rejected at every depth;
the models and paths that cannot be cut back are refused by name."""
from __future__ import annotations

import random

import pytest
import torch

import specmoe
from specmoe.models.testing import tiny_model
from specmoe.speculation.controllers import StaticK
from specmoe.speculation.decoding import records_recurrent_states
from specmoe.speculation.drafters import SelfDraft

# one gated-DeltaNet model of each form (Qwen3-Next's interleaved projections, Qwen3.5's four),
# Mamba (Jamba), Kimi-Linear's delta attention
ARCHS = ["qwen3_next", "qwen3_5_moe_text", "jamba", "kimi_linear"]


class _Erring:
    """Proposes the reference continuation ``ref`` with each token wrong with probability 0.3:
    drafts accepted in part, so each verification is cut back by 0..k positions; nothing at
    the first call and every third (steps without drafts: the recurrent layers record nothing
    then, and take their one-call steps)."""

    def __init__(self, ref: list[int], vocab: int):
        self.ref, self.vocab, self.rng = ref, vocab, random.Random(0)
        self.calls = 0

    def propose(self, history, k):
        self.calls += 1
        if self.calls % 3 == 1:
            return []
        i = len(history)
        out = []
        for j in range(k):
            t = self.ref[i + j] if i + j < len(self.ref) else 1
            out.append(t if self.rng.random() > 0.3 else (t + 1) % self.vocab)
        return out


def _greedy(model, ids, n):
    with torch.no_grad():
        return model.generate(ids[None], max_new_tokens=n, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0]


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ARCHS)
def test_speculation_on_a_hybrid_equals_greedy(arch, dt):
    model = tiny_model(arch, dtype=dt)
    fmt = "f32" if dt == torch.float32 else "bf16"
    eng = specmoe.offload(model, dtype=fmt, dense=fmt, cache=1.0, prefetch=False)
    try:
        ids = torch.randint(3, 100, (20,), generator=torch.Generator().manual_seed(3))
        want = _greedy(model, ids, 40)
        drafter = _Erring(want.tolist(), model.config.vocab_size)
        if not records_recurrent_states(model):  # transformers < 5.25
            with pytest.raises(ValueError, match="cannot be rolled back"):
                specmoe.generate(model, ids, drafter=drafter, controller=StaticK(5))
            return
        step = getattr(model, "_specmoe_decode_step", None)  # (gated DeltaNet: one C call)
        p0 = step.planned if step is not None else 0
        out = specmoe.generate(model, ids, max_new_tokens=40, drafter=drafter,
                               controller=StaticK(5), eos_token_id=None, tau=None)
        assert torch.equal(out.sequences[0], want)
        # the steps without drafts ran unrecorded, each one _C.DecodePlan call
        assert step is None or step.planned > p0
        st = out.stats
        assert 0 < st["accepted"] < st["proposed"]  # drafts kept and drafts cut back
        ks = [it["k"] for it in out.iterations]
        assert ks[0] == 0 and 0 in ks[1:]  # steps without drafts, the first one too
    finally:
        eng.close()


def test_self_draft_on_a_hybrid_equals_greedy():
    """MoE-SpeQ's self-draft writes its drafts on the target's own cache and cuts them back
    before the verification: the recorded states put the recurrent layers back too."""
    model = tiny_model("qwen3_5_moe_text")
    eng = specmoe.offload(model, cache=1.0, prefetch=False)
    try:
        if not records_recurrent_states(model):
            pytest.skip("transformers < 5.25 records no recurrent states")
        ids = torch.randint(3, 100, (20,), generator=torch.Generator().manual_seed(4))
        want = _greedy(model, ids, 24)
        out = specmoe.generate(model, ids, max_new_tokens=24, drafter=SelfDraft(eng),
                               controller=StaticK(3), eos_token_id=None, tau=None)
        assert torch.equal(out.sequences[0], want)
        assert out.stats["proposed"] > 0
    finally:
        eng.close()


def test_what_cannot_be_cut_back_is_refused_by_name():
    """MiniMax's own cache records no recurrent state, alone or in a batch: refused, naming
    the layers, before anything runs.  (A batch of a model whose layers record their states
    is cut back row by row: tests/test_batch_recurrent.py.)"""
    mm = tiny_model("minimax")
    for ids in (torch.tensor([5, 6, 7]), torch.tensor([[5, 6, 7], [8, 9, 10]])):
        with pytest.raises(ValueError, match="minimax's linear_attention layers .* cannot be "
                                             "rolled back"):
            specmoe.generate(mm, ids, drafter=_Erring([], 10), controller=StaticK(2))

"""benchmarks/speculation_big.py's ControlledDrafter: a drafter of known acceptance (issue 39,
item 2), checked against its definition and through specmoe.generate on the zoo model, where
greedy verification must reject its wrong tokens and accept its right ones."""
from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from speculation_big import ControlledDrafter  # noqa: E402

from specmoe import zoo  # noqa: E402
from specmoe.speculation.controllers import StaticK  # noqa: E402
from specmoe.speculation.generation import generate  # noqa: E402


def test_alpha_one_and_zero_are_exact():
    ref = [5, 6, 7, 8, 9]
    prompt = [1, 2, 3]
    right = ControlledDrafter(len(prompt), ref, 1.0, 0.0, vocab=10)
    assert right.propose(prompt, 3) == [5, 6, 7]
    assert right.propose(prompt + [5, 6], 4) == [7, 8, 9]  # stops at the reference's end
    assert right.propose(prompt + ref, 2) == []
    wrong = ControlledDrafter(len(prompt), ref, 0.0, 0.0, vocab=10)
    assert wrong.propose(prompt, 5) == [6, 7, 8, 9, 0]  # right + 1, modulo the vocabulary


def test_each_token_right_with_probability_alpha():
    ref = list(range(100))
    d = ControlledDrafter(0, ref, 0.7, 0.0, vocab=1000, seed=3)
    n = right = 0
    for _ in range(400):
        got = d.propose([], 50)
        right += sum(g == r for g, r in zip(got, ref))
        n += len(got)
    assert n == 20000 and abs(right / n - 0.7) < 0.02  # binomial sd 0.0032


def test_drafting_costs_the_time_asked():
    d = ControlledDrafter(0, [1, 2, 3], 1.0, 0.01, vocab=10)
    t0 = time.perf_counter()
    assert len(d.propose([], 3)) == 3
    assert time.perf_counter() - t0 >= 0.03


def test_bad_arguments():
    with pytest.raises(ValueError, match="alpha"):
        ControlledDrafter(0, [1], 1.5, 0.0, vocab=10)
    with pytest.raises(ValueError, match="draft_s"):
        ControlledDrafter(0, [1], 0.5, -1.0, vocab=10)


def test_through_generate_acceptance_is_alpha_and_output_unchanged():
    """K = 1: each iteration's one draft is accepted iff it is right, so accepted / proposed
    estimates alpha; the output equals plain greedy decoding's whatever the drafts."""
    model, _ = zoo.load("tiny-moe")
    prompt = [1, 17, 33, 71, 5, 9, 12, 40]
    plain = generate(model, torch.tensor([prompt]), None, None, max_new_tokens=96,
                     eos_token_id=None).sequences[0, len(prompt):].tolist()
    for alpha in (0.0, 0.5, 1.0):
        d = ControlledDrafter(len(prompt), plain, alpha, 0.0, model.config.vocab_size, seed=1)
        o = generate(model, torch.tensor([prompt]), d, StaticK(1), max_new_tokens=96,
                     eos_token_id=None)
        assert o.sequences[0, len(prompt):].tolist() == plain
        its = [i for i in o.iterations if i["k"] == 1]
        rate = sum(i["accepted"] for i in its) / len(its)
        if alpha in (0.0, 1.0):
            assert rate == alpha
        else:
            assert 0.3 < rate < 0.7, rate


def test_follow_trace_routes_each_position_the_same_under_speculation(puffin_subset):
    """speculation_big --routing replay: every decode pass is routed by the trace's rows at its
    KV position, so the plain steps that redo a position after a rejected draft see the rows
    the verification saw, and the speculative output equals plain decoding under the same
    replay.  (A replay that only consumed rows in order would shift after the first rejection.)
    The replay must also drive the routing: another stretch of the trace, or none, gives a
    step other logits."""
    import specmoe
    from specmoe.models.testing import tiny_model
    from speculation_big import follow_trace

    from specmoe.speculation.decoding import cache_kwargs, new_kv

    model = tiny_model("deepseek_v2", layers=27, experts=64, top_k=6, hidden=32, inter=16,
                       overrides={"num_key_value_heads": 4})
    eng = specmoe.offload(model, cache=64, policy="lru", prefetch=False, dtype="f32",
                          dense="f32")
    try:
        ex = np.asarray(puffin_subset.experts)
        prompt, n = [5, 9, 17], 16
        undo = follow_trace(model, eng, ex[:40])
        plain = generate(model, torch.tensor([prompt]), None, None, max_new_tokens=n,
                         eos_token_id=None).sequences[0, len(prompt):].tolist()
        d = ControlledDrafter(len(prompt), plain, 0.5, 0.0, model.config.vocab_size, seed=2)
        o = generate(model, torch.tensor([prompt]), d, StaticK(3), max_new_tokens=n,
                     eos_token_id=None)
        acc = sum(i["accepted"] for i in o.iterations)
        assert 0 < acc < sum(i["k"] for i in o.iterations)  # drafts both kept and rejected
        assert o.sequences[0, len(prompt):].tolist() == plain
        undo()
        # the replay drives the routing: a step's logits differ under another stretch of it
        steps = []
        for rows in (ex[:40], ex[100:140], None):
            off = follow_trace(model, eng, rows) if rows is not None else (lambda: None)
            with torch.no_grad():
                kv = cache_kwargs(model, new_kv(model))
                steps.append(model(input_ids=torch.tensor([prompt]), **kv).logits[0, -1])
            off()
        assert not torch.equal(steps[0], steps[1]) and not torch.equal(steps[0], steps[2])
    finally:
        eng.close()

"""Step 5 with parallel_misses (csrc/layer.h): a layer's misses load on the prefetch worker
while its resident experts compute.  Against the blocking path: the same greedy tokens and
logits to f32 rounding, the overlap counted, no deadlock when the layer's experts fill the
cache, with or without next-layer prefetch."""
from __future__ import annotations

import threading

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import specmoe  # noqa: E402
from specmoe import zoo  # noqa: E402

PROMPT = "def parse(line):\n    fields = line.split(',')\n    return"


def _run(cache, prefetch=True, parallel=True, throttle=None, n=12):
    model, tok = zoo.load("tiny-moe", experts_implementation="eager")
    eng = specmoe.offload(model, cache=cache, dtype="f32", prefetch=prefetch,
                          throttle=throttle)
    try:
        eng.set_parallel_misses(parallel)
        ids = tok(PROMPT, return_tensors="pt").input_ids
        with torch.no_grad():
            logits = model(ids).logits[0]
        out = model.generate(ids, do_sample=False, max_new_tokens=n, min_new_tokens=n)
        return logits, out[0].tolist(), eng.stats()
    finally:
        eng.close()


def test_same_tokens_and_logits_to_rounding():
    lo_off, toks_off, st_off = _run(0.25, parallel=False)
    lo_on, toks_on, st_on = _run(0.25, parallel=True)
    assert toks_on == toks_off
    torch.testing.assert_close(lo_on, lo_off, rtol=1e-5, atol=1e-5)
    assert st_off["overlapped"] == 0 and st_off["parallel_misses"] is False
    assert st_on["overlapped"] > 0 and st_on["parallel_misses"] is True


def test_behind_a_slow_link():
    """With every load taking >= 0.2 ms the worker is still loading when the layer needs a
    miss: acquire waits for the load in flight; outputs unchanged."""
    _, toks_off, _ = _run(0.25, parallel=False, throttle=(0.5, 200.0), n=6)
    _, toks_on, st = _run(0.25, parallel=True, throttle=(0.5, 200.0), n=6)
    assert toks_on == toks_off and st["overlapped"] > 0


def test_smallest_cache_does_not_deadlock():
    """top_k slots (2): pinning the residents leaves the worker no slot; the misses then load
    on demand as before.  Run in a thread so a deadlock fails instead of hanging."""
    res = {}

    def go():
        res["on"] = _run(2, parallel=True, n=6)

    th = threading.Thread(target=go, daemon=True)
    th.start()
    th.join(120)
    assert not th.is_alive(), "parallel misses deadlocked with a 2-slot cache"
    _, toks_off, _ = _run(2, parallel=False, n=6)
    assert res["on"][1] == toks_off


def test_with_next_layer_prefetch_off():
    """The overlap needs the cache's worker, not the next-layer predictor."""
    lo_off, toks_off, st_off = _run(0.25, prefetch=False, parallel=False, n=4)
    lo_on, toks_on, st = _run(0.25, prefetch=False, parallel=True, n=4)
    assert st["overlapped"] > 0 and st_off["prefetch_issued"] == 0
    assert toks_on == toks_off
    torch.testing.assert_close(lo_on, lo_off, rtol=1e-5, atol=1e-5)


def test_bad_input():
    model, _ = zoo.load("tiny-moe", experts_implementation="eager")
    eng = specmoe.offload(model, cache=0.25, dtype="f32")
    try:
        with pytest.raises(TypeError, match="a bool"):
            eng.set_parallel_misses("yes")
        assert eng.parallel_misses is True  # the default
    finally:
        eng.close()


@pytest.mark.parametrize("parallel", [True, False])
def test_outputs_do_not_depend_on_residency(parallel):
    """A token's experts are summed in ascending id whatever order they were computed in
    (parallel misses: from per-pair rows, csrc/moe.h fixed_sum): a cold small cache (many
    misses, resident experts computed first) and a larger one give bit-identical logits.
    Top-4, so that the order of the sum matters (a + b == b + a, but not for three terms).
    (A cache holding every expert takes the plain path.)"""
    from specmoe.models.testing import tiny_model
    out = []
    for cache in (0.25, 0.75):
        model = tiny_model("mixtral", seed=4, vocab=96, layers=3, hidden=64, inter=64,
                           experts=8, top_k=4)
        eng = specmoe.offload(model, cache=cache, dtype="f32")
        try:
            eng.set_parallel_misses(parallel)
            with torch.no_grad():
                los = [model(torch.arange(1, 25).reshape(1, -1)).logits[0]]
                los += [model(torch.tensor([[t, t + 1]])).logits[0] for t in range(25, 41)]
            out.append((torch.cat(los), eng.stats()["overlapped"]))
        finally:
            eng.close()
    assert torch.equal(out[0][0], out[1][0])
    if parallel:
        assert out[0][1] > 0 and out[1][1] > 0  # both overlapped, with different residency

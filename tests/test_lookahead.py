"""specmoe.runtime.lookahead.LookaheadBuffer: MoE-SpeQ's expert lookahead buffer on its own -- masks,
the per-layer end of a pass, precision/recall counters against a direct count, and bad input
that leaves the buffer as it was."""
import numpy as np
import pytest

from specmoe.runtime.lookahead import LookaheadBuffer

L, E = 4, 8


def test_passes_and_counters_match_a_direct_count():
    rng = np.random.default_rng(0)
    buf = LookaheadBuffer(L, E)
    pred = act = tp = 0
    for _ in range(20):
        counts = {p: rng.integers(0, 3, E) for p in range(L) if rng.random() < 0.8}
        buf.set(counts)
        assert buf.active == bool(counts)
        for p in range(L):
            used = rng.random(E) < 0.3
            if p in counts:
                m = counts[p] > 0
                pred += int(m.sum())
                act += int(used.sum())
                tp += int((m & used).sum())
            lay, exp = buf.pending()
            assert sorted(set(lay.tolist())) == [q for q in sorted(counts)
                                                 if q >= p and (counts[q] > 0).any()]
            buf.layer_done(p, used.astype(np.uint8))
        assert not buf.active                        # the last layer ends the pass
    s = buf.stats()
    assert (s["lookahead_predicted"], s["lookahead_used"], s["lookahead_hits"]) == (pred, act, tp)
    assert s["lookahead_precision"] == pytest.approx(tp / pred)
    assert s["lookahead_recall"] == pytest.approx(tp / act)
    buf.reset_stats()
    assert buf.stats()["lookahead_precision"] is None


def test_bad_input_leaves_the_buffer_unchanged():
    buf = LookaheadBuffer(L, E)
    good = {0: np.eye(E, dtype=np.int64)[1], 2: np.eye(E, dtype=np.int64)[3]}
    buf.set(good)
    before = {p: m.copy() for p, m in buf.masks.items()}
    for bad in ({0: np.ones(E), L: np.ones(E)}, {1: np.ones(E + 1)}, {-1: np.ones(E)},
                {True: np.ones(E)}, {0: np.array(["a"] * E)}, {0: np.full(E, np.nan)}):
        with pytest.raises(ValueError, match="lookahead"):
            buf.set(bad)
        assert buf.masks.keys() == before.keys()
        assert all(np.array_equal(buf.masks[p], before[p]) for p in before)
    lay, exp = buf.pending()
    assert lay.tolist() == [0, 2] and exp.tolist() == [1, 3]

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


def _classify(d, t):
    """The plain reference of MoE-SpeQ Fig. 6's classes for one token."""
    if list(d) == list(t):
        return 0
    return 1 if sorted(d) == sorted(t) else 2


def test_routing_fidelity_classes_match_a_plain_count():
    from specmoe.runtime.lookahead import routing_fidelity
    d = np.array([[1, 2], [1, 2], [1, 2], [3, 4]])
    t = np.array([[1, 2], [2, 1], [1, 5], [4, 3], [0, 1]])   # one row more: not compared
    assert routing_fidelity(d, t).tolist() == [1, 2, 1]
    with pytest.raises(ValueError, match="top-2"):
        routing_fidelity(d, np.zeros((4, 3), np.int64))
    rng = np.random.default_rng(1)
    buf = LookaheadBuffer(L, E)
    want = np.zeros(3, np.int64)
    for _ in range(30):
        n = int(rng.integers(1, 4))
        rows = {p: np.stack([rng.permutation(E)[:2] for _ in range(n)]) for p in range(L)
                if rng.random() < 0.7}
        buf.set({p: np.bincount(r.ravel(), minlength=E) for p, r in rows.items()}, rows)
        for p in range(L):
            # the target agrees with the draft on some tokens, permutes or changes others
            t = np.stack([rng.permutation(E)[:2] for _ in range(n + 1)])
            for j in range(n):
                if p in rows and rng.random() < 0.6:
                    t[j] = rows[p][j][::-1] if rng.random() < 0.5 else rows[p][j]
                if p in rows:
                    want[_classify(rows[p][j], t[j])] += 1
            buf.layer_done(p, np.zeros(E, np.uint8), t)
    s = buf.stats()
    assert [s["routing_fidelity_pairs"][c] for c in ("hard", "soft", "mismatch")] == \
        want.tolist()
    assert sum(s["routing_fidelity"].values()) == pytest.approx(1.0)
    assert s["routing_fidelity"]["hard"] == pytest.approx(want[0] / want.sum())
    buf.reset_stats()
    assert buf.stats()["routing_fidelity"] is None


def test_bad_token_rows_leave_the_buffer_unchanged():
    buf = LookaheadBuffer(L, E)
    buf.set({0: np.ones(E)}, {0: np.array([[1, 2]])})
    for bad in ({L: np.array([[1, 2]])}, {0: np.array([1, 2])}, {0: np.array([[0.5, 1.0]])}):
        with pytest.raises(ValueError, match="token rows"):
            buf.set({1: np.ones(E)}, bad)
        assert list(buf.masks) == [0] and list(buf.rows) == [0]


def test_confidence_orders_a_layer_and_the_entries_are_the_elb():
    """MoE-SpeQ Sec. 3.3.1: the ELB's entries (token, layer, expert, confidence); a layer's
    experts queue by their summed confidence (a plain sum here), earlier layers first, the
    count's order (none without a utility) kept when no confidence is given."""
    from specmoe.runtime.lookahead import lookahead_queue

    buf = LookaheadBuffer(L, E)
    tokens = {1: np.array([[3, 5], [5, 2]]), 0: np.array([[7, 1]])}
    conf = {1: np.array([[0.9, 0.1], [0.3, 0.7]]), 0: np.array([[0.6, 0.4]])}
    counts = {p: np.bincount(t.ravel(), minlength=E) for p, t in tokens.items()}
    arrays = buf.set(counts, tokens, conf)
    want = {1: {3: 0.9, 5: 0.4, 2: 0.7}, 0: {7: 0.6, 1: 0.4}}
    got = buf.confidence()
    for p, w in want.items():
        ref = np.zeros(E)
        for e, v in w.items():
            ref[e] = v
        assert np.allclose(got[p], ref)
    ent = buf.entries()
    assert [tuple(r) for r in ent[["token", "layer", "expert"]].tolist()] == \
        [(0, 0, 7), (0, 0, 1), (0, 1, 3), (0, 1, 5), (1, 1, 5), (1, 1, 2)]
    assert np.allclose(ent["confidence"], [0.6, 0.4, 0.9, 0.1, 0.3, 0.7])
    lay, exp, pri = lookahead_queue(arrays, L, confidence=got)
    order = [(int(a), int(b)) for a, b, _ in sorted(zip(lay, exp, pri), key=lambda r: -r[2])]
    assert order == [(0, 7), (0, 1), (1, 3), (1, 2), (1, 5)]
    # a utility first, the confidence breaking its ties
    util = lambda ls, es: np.where(es == 5, 2, 1)  # noqa: E731
    lay, exp, pri = lookahead_queue(arrays, L, util, got)
    order = [(int(a), int(b)) for a, b, _ in sorted(zip(lay, exp, pri), key=lambda r: -r[2])]
    assert order[2:] == [(1, 5), (1, 3), (1, 2)]
    buf.layer_done(0, np.zeros(E, np.uint8))
    assert buf.entries()["layer"].tolist() == [1] * 4 and list(buf.confidence()) == [1]
    buf.set(counts, tokens)                      # no confidence: NaN entries, nothing summed
    assert np.isnan(buf.entries()["confidence"]).all() and buf.confidence() == {}


def test_bad_confidence_is_refused_and_changes_nothing():
    buf = LookaheadBuffer(L, E)
    tokens = {0: np.array([[1, 2]])}
    buf.set({0: np.eye(E, dtype=np.int64)[1]}, tokens, {0: np.array([[0.5, 0.5]])})
    for bad_tok, bad_conf in (
            (tokens, {1: np.array([[0.5, 0.5]])}),        # a position without token rows
            (tokens, {0: np.array([[0.5]])}),             # not the rows' shape
            (tokens, {0: np.array([[np.nan, 0.5]])}),
            (tokens, {0: np.array([[-0.1, 0.5]])}),
            ({0: np.array([[1, E]])}, None)):             # an expert id outside the layer
        with pytest.raises(ValueError, match="lookahead"):
            buf.set({0: np.eye(E, dtype=np.int64)[2]}, bad_tok, bad_conf)
        assert np.flatnonzero(buf.masks[0]).tolist() == [1]
        assert np.allclose(buf.confidence()[0][[1, 2]], [0.5, 0.5])

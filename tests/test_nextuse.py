"""The learned next-use eviction policy (issue 42, csrc/policy/nextuse.h): the C policy against
its plain-Python reference (tests/ref_policies.py RefNextUse) victim by victim, its predicted
probabilities against the reference's and against the numpy features the trainer uses
(specmoe.sim.nextuse.Walker), the packaged model, and the errors a wrong model gets."""
from __future__ import annotations

import numpy as np
import pytest

from specmoe import _C
from specmoe.runtime.policies import NextUse, make_policy
from specmoe.sim.nextuse import DEFAULT_PATH, NextUseModel, Walker, default_model, split_requests
from specmoe.sim.replay import simulate

from .ref_policies import RefNextUse, ref_replay
from .test_policies import assert_same, random_keys


def _model(rng, L, E, cross=True, c=1.0, beta=1.0) -> NextUseModel:
    """cross: True one table (format 1), False none, "deep" three tables and a bias (format
    3)."""
    deep = cross == "deep"
    return NextUseModel(rng.normal(0, 1.5, 6), rng.normal(0, 1.5, 5), c=c, beta=beta,
                        cross=rng.normal(0, 1.0, (3, L, E, E) if deep else (L, E, E))
                        if cross else None,
                        cross_bias=rng.normal(0, 1.0, (L, E)) if deep else None)


def _both(model, keys, nslots, L, E, passes, mask_seed=0):
    flat = model.flat()
    pol = _C.Policy("nextuse", nslots, L, E, model=flat)
    hits, vic, q = _C.replay(pol, np.asarray(keys, np.int32), passes, mask_seed=mask_seed,
                             next_use=True)
    ref = RefNextUse(L, E, flat)
    rh, rv = ref_replay(ref, list(map(int, keys)), nslots, passes, mask_seed)
    return hits, vic, q, np.array(rh, np.uint8), np.array(rv, np.int32), ref


@pytest.mark.parametrize("nslots", [1, 3, 8, 17])
@pytest.mark.parametrize("passes", [None, 6, "layered"])
@pytest.mark.parametrize("cross", [True, False, "deep"])
def test_random_sequences_match_the_reference(nslots, passes, cross):
    """Random keys (layers out of order within a pass, or no passes at all: the gap floor),
    and layer-ordered passes like a decoder's; evictable masks on odd sizes; models with no
    cross table, one, and three with a bias."""
    rng = np.random.default_rng(nslots * 31 + (passes == 6) * 7 + (cross is True) +
                                2 * (cross == "deep"))
    L, E = 4, 6
    model = _model(rng, L, E, cross, c=float(rng.uniform(0.5, 3)), beta=float(rng.uniform(0, 2)))
    if passes == "layered":  # 2 experts per layer per pass, layers in order
        n = 150
        keys = np.array([l * E + e for _ in range(n) for l in range(L)
                         for e in rng.choice(E, 2, replace=False)], np.int32)
        passes = 2 * L
    else:
        keys = random_keys(rng, 1000, L, E, skew=nslots % 2 == 1)
    hits, vic, q, rh, rv, ref = _both(model, keys, nslots, L, E, passes,
                                      mask_seed=nslots if nslots % 2 else 0)
    assert_same("nextuse", hits, vic, rh, rv)
    want = np.array([ref.q(k)[0] for k in range(L * E)])
    np.testing.assert_allclose(q, want, rtol=1e-12, atol=0)


def test_the_real_trace_subset_with_the_packaged_model(puffin_subset):
    """DeepSeek-V2-Lite routing (the carried subset) with the packaged model, one pass per
    token: the same victims as the reference, and every key's q equal to the reference's and
    to the trainer's numpy features at the end."""
    tr = puffin_subset.slice(0, 24)  # 3,744 accesses: thousands of evictions at 166 slots
    L, E, K = tr.num_layers, tr.num_experts, tr.top_k
    model = default_model(L, E)
    assert model.shape == (L, E)
    keys = tr.keys()
    hits, vic, q, rh, rv, ref = _both(model, keys, 166, L, E, L * K)
    assert_same("nextuse", hits, vic, rh, rv)
    assert 0 < hits.mean() < 1
    np.testing.assert_allclose(q, [ref.q(k)[0] for k in range(L * E)], rtol=1e-12, atol=0)
    w = Walker(L, E, model)
    for t in range(tr.num_tokens):
        w.begin_pass()
        for lay in range(L):
            w.touch_layer(lay, tr.experts[t, lay])
    np.testing.assert_allclose(w.features()["q"], q, rtol=1e-10, atol=0)


def test_walker_features_mid_layer_match_the_reference(puffin_subset):
    """The trainer samples before a layer runs (lc = the layer before); there the fresh
    cross feature applies to the next layer's keys."""
    tr = puffin_subset.slice(0, 40)
    L, E = tr.num_layers, tr.num_experts
    model = default_model(L, E)
    w, ref = Walker(L, E, model), RefNextUse(L, E, model.flat())
    checked = 0
    for t in range(tr.num_tokens):
        w.begin_pass()
        ref.on_pass(t + 1)
        for lay in range(L):
            if (t * L + lay) % 97 == 0:
                f = w.features()
                want = [ref.q(k) for k in range(L * E)]
                np.testing.assert_allclose(f["q"], [a for a, _ in want], rtol=1e-10, atol=0)
                np.testing.assert_array_equal(f["dl"], [b for _, b in want])
                checked += int(f["fresh"].any())
            w.touch_layer(lay, tr.experts[t, lay])
            for e in tr.experts[t, lay]:
                ref._touch(lay * E + int(e))
    assert checked > 0  # some points had a fresh cross feature


def test_utility_is_the_value_the_prefetch_rule_compares(tmp_path):
    """The live cache's utility under nextuse (what policy.h's prefetch rule compares: a
    prefetch may evict only a slot worth no more than the key it brings; tests/test_cache.py
    runs that rule against a plain model) equals the reference's value, key by key, after the
    same demand accesses."""
    import specmoe
    from specmoe.storage.store import write_store

    rng = np.random.default_rng(5)
    L, E, nslots = 3, 5, 6
    model = _model(rng, L, E)
    keys = [int(k) for k in random_keys(rng, 300, L, E)]
    ref = RefNextUse(L, E, model.flat())
    ref_replay(ref, keys, nslots, 4)
    store = write_store(tmp_path / "u.smoe", [{"w": np.full((E, 8), l, np.uint8)}
                                              for l in range(L)], top_k=2, progress=False)
    try:
        with specmoe.ExpertCache(store, nslots, NextUse(model=model), prefetch=False) as cache:
            for i, k in enumerate(keys):
                if i % 4 == 0:
                    cache.begin_pass()
                cache.acquire(k // E, k % E)
                cache.release(k // E, k % E)
            got = cache.utility(np.arange(L * E) // E, np.arange(L * E) % E)
    finally:
        store.close()
    want = [ref.utility(k) for k in range(L * E)]
    np.testing.assert_array_equal(got, want)
    assert len(set(want)) > 1


def test_packaged_model_and_fallbacks(tmp_path):
    m = NextUseModel.load(DEFAULT_PATH)
    assert m.shape == (26, 64) and "trained_on" in m.info and "validation" in m.info
    # the token prior of the training prompts' pieces, and its weights
    assert m.tokens is not None and m.tokens.shape == (26, 64) and len(m.tokens.pieces) > 1000
    assert m.flat()[0] == 3 and m.temporal().tokens is None
    assert m.depth == 4 and m.cross_bias is not None  # the cross tables of four layers back
    assert default_model(4, 8).cross is None  # another shape: the temporal part
    np.testing.assert_array_equal(default_model(4, 8).w_stale, m.w_stale)
    # by name: the packaged model where it fits, the temporal one elsewhere
    assert make_policy("nextuse", 10, 26, 64).name == "nextuse"
    assert make_policy("nextuse", 3, 4, 8).name == "nextuse"
    p = tmp_path / "m.npz"
    _model(np.random.default_rng(0), 3, 4).save(p)
    assert NextUse(model=p).resolve(3, 4).shape == (3, 4)
    deep = _model(np.random.default_rng(0), 3, 4, cross="deep")
    deep.save(tmp_path / "d.npz")  # the tables kept in f16, the format kept
    back = NextUseModel.load(tmp_path / "d.npz")
    assert back.depth == 3 and back.flat()[0] == 3
    np.testing.assert_allclose(back.flat(), deep.flat(), rtol=1e-3, atol=1e-3)
    assert make_policy(NextUse(model=str(p)), 5, 3, 4).name == "nextuse"


def test_bad_models_are_refused_by_name():
    rng = np.random.default_rng(1)
    m = _model(rng, 3, 4)
    with pytest.raises(ValueError, match="trained for another model"):
        _C.Policy("nextuse", 4, 5, 4, model=m.flat())
    with pytest.raises(ValueError, match="trained for another model"):
        make_policy(NextUse(model=m), 4, 3, 5)
    with pytest.raises(ValueError, match="format-1 to -3 array"):
        _C.Policy("nextuse", 4, 3, 4, model=np.zeros(17))
    deep = _model(rng, 3, 4, cross="deep").flat()
    assert deep[0] == 3 and deep[16] == 3
    _C.Policy("nextuse", 4, 3, 4, model=deep)
    with pytest.raises(ValueError, match="trained for another model"):
        _C.Policy("nextuse", 4, 3, 4, model=deep[:-1])
    for depth in (9, 1.5, -1):
        bad = deep.copy()
        bad[16] = depth
        with pytest.raises(ValueError, match="whole number in 0..8"):
            _C.Policy("nextuse", 4, 3, 4, model=bad)
    with pytest.raises(ValueError, match="depth <= 8"):
        NextUseModel(np.zeros(6), np.zeros(5), cross=np.zeros((9, 3, 4, 4)))
    with pytest.raises(ValueError, match="cross_bias"):
        NextUseModel(np.zeros(6), np.zeros(5), cross=np.zeros((3, 4, 4)),
                     cross_bias=np.zeros((3, 5)))
    bad = m.flat()
    bad[3] = np.nan
    with pytest.raises(ValueError, match="not finite"):
        _C.Policy("nextuse", 4, 3, 4, model=bad)
    with pytest.raises(ValueError, match="model= applies to nextuse only"):
        _C.Policy("lru", 4, 3, 4, model=m.flat())
    with pytest.raises(ValueError, match="needs a nextuse policy"):
        _C.replay(_C.Policy("lru", 4, 3, 4), np.arange(5, dtype=np.int32), next_use=True)
    with pytest.raises(ValueError, match="beta"):
        NextUseModel(np.zeros(6), np.zeros(5), beta=-1.0)
    with pytest.raises(TypeError, match="NextUseModel, a path or None"):
        NextUse(model=3).resolve(3, 4)
    with pytest.raises(ValueError, match="not a next-use model"):
        NextUseModel.load(__file__)


def test_simulator_runs_it_by_name_with_the_packaged_model(puffin_subset):
    """simulate(..., "nextuse") uses the packaged model (not the C built-in's temporal weights
    alone): the same hit rate as the explicit spec, and above least_stale's on real routing."""
    tr = puffin_subset
    by_name = simulate(tr, "nextuse", "10%")
    spec = simulate(tr, NextUse(), "10%")
    temporal = simulate(tr, NextUse(model=default_model(26, 64).temporal()), "10%")
    assert by_name.hit_rate == spec.hit_rate
    assert by_name.hit_rate != temporal.hit_rate
    assert by_name.hit_rate > simulate(tr, "least_stale", "10%").hit_rate


def test_split_is_by_name_and_stable():
    names = [f"prompt_{i}_data.csv.gz" for i in range(50)]
    tr, va = split_requests(names)
    assert sorted(tr + va) == list(range(50)) and 0 < len(va) < 25
    tr2, va2 = split_requests(names[::-1])
    assert sorted(names[::-1][i] for i in va2) == sorted(names[i] for i in va)


def test_learned_prefetch_predictor_ranks_by_the_models_q(puffin_subset):
    """The simulator's ``learned`` predictor (csrc/sim.c, SMOE_PRED_LEARNED) predicts, after
    each layer, the top-k experts of the next layer by the model's q as the trainer's numpy
    features compute it at that point: the same count of true predictions, exactly (no token
    prior here; with one: test_learned_predictor_with_the_token_prior_ranks_as_the_trainer)."""
    tr = puffin_subset.slice(0, 50)
    T, L, K = tr.experts.shape
    E = tr.num_experts
    model = default_model(L, E)
    w = Walker(L, E, model)
    hits = points = 0
    for t in range(T):
        w.begin_pass()
        for lay in range(L):
            w.touch_layer(lay, tr.experts[t, lay])
            tt, ll = (t, lay + 1) if lay + 1 < L else (t + 1, 0)
            if tt >= T:
                continue
            q = w.features()["q"][ll * E:(ll + 1) * E].astype(np.float32)  # the sim's scores
            top = np.argsort(-q, kind="stable")[:K]
            hits += len(set(top.tolist()) & set(tr.experts[tt, ll].tolist()))
            points += 1
    r = simulate(tr, "lru", "10%", prefetch="learned", hardware="laptop", token_prior=False)
    assert r.extra is not None
    assert round(r.predictor_precision * points * K) == hits
    assert abs(r.predictor_precision - hits / (points * K)) < 1e-12
    with pytest.raises(ValueError, match="trained for another model"):
        _C.simulate(tr.experts, E, "lru", 10, predictor=4, model=_model(
            np.random.default_rng(0), 3, 4).flat(), expert_bytes=1.0, fast_bw=1.0, link_bw=1.0,
            link_latency_s=0.0)


# -- the token prior (issue 42 item 1: what the token's id tells before its layers run) -------

def _tok_model(rng, L, E) -> NextUseModel:
    m = _model(rng, L, E)
    return NextUseModel(m.w_fresh, m.w_stale, c=m.c, beta=m.beta, cross=m.cross,
                        w_tok_fresh=rng.normal(0, 1.5, 2), w_tok_stale=rng.normal(0, 1.5, 2))


@pytest.mark.parametrize("nslots", [3, 8])
def test_token_prior_victims_and_q_match_the_reference(nslots):
    """Layered passes, each given a random prior (or none) after on_pass: the C policy's
    victims and final q equal the reference's; the same run without the prior differs, so
    the prior is used."""
    rng = np.random.default_rng(40 + nslots)
    L, E, n = 4, 6, 120
    model = _tok_model(rng, L, E)
    keys = np.array([l * E + e for _ in range(n) for l in range(L)
                     for e in rng.choice(E, 2, replace=False)], np.int32)
    table = rng.normal(0, 2, (5, L * E)).astype(np.float32)
    rows = rng.integers(-1, 5, n).astype(np.int32)  # -1: an unknown token
    pol = _C.Policy("nextuse", nslots, L, E, model=model.flat())
    hits, vic, q = _C.replay(pol, keys, 2 * L, next_use=True, prior_table=table, prior_rows=rows)
    ref = RefNextUse(L, E, model.flat())
    priors = [None if r < 0 else table[r].tolist() for r in rows]
    rh, rv = ref_replay(ref, list(map(int, keys)), nslots, 2 * L, priors=priors)
    assert_same("nextuse+prior", hits, vic, np.array(rh, np.uint8), np.array(rv, np.int32))
    np.testing.assert_allclose(q, [ref.q(k)[0] for k in range(L * E)], rtol=1e-12, atol=0)
    plain = _C.replay(_C.Policy("nextuse", nslots, L, E, model=model.flat()), keys, 2 * L)
    assert not np.array_equal(plain[1], vic)
    # a format-1 model (NextUse's default for eviction) ignores the prior
    v1 = _C.replay(_C.Policy("nextuse", nslots, L, E, model=model.flat(token_weights=False)),
                   keys, 2 * L, prior_table=table, prior_rows=rows)
    v1_plain = _C.replay(_C.Policy("nextuse", nslots, L, E,
                                   model=model.flat(token_weights=False)), keys, 2 * L)
    np.testing.assert_array_equal(v1[1], v1_plain[1])


def test_walker_with_a_prior_matches_the_reference():
    """The trainer's numpy features with a prior set (mid-layer points) give the reference's
    q: the token weights apply to the keys of the pass's own token only."""
    rng = np.random.default_rng(7)
    L, E = 5, 8
    model = _tok_model(rng, L, E)
    w, ref = Walker(L, E, model), RefNextUse(L, E, model.flat())
    for t in range(30):
        w.begin_pass()
        ref.on_pass(t + 1)
        prior = None if t % 4 == 3 else rng.normal(0, 2, L * E)
        w.set_prior(prior)
        ref.on_prior(prior)
        for lay in range(L):
            if (t * L + lay) % 7 == 0:
                f = w.features()
                np.testing.assert_allclose(f["q"], [ref.q(k)[0] for k in range(L * E)],
                                           rtol=1e-10, atol=0)
            ex = rng.choice(E, 2, replace=False)
            w.touch_layer(lay, ex)
            for e in ex:
                ref._touch(lay * E + int(e))


def test_token_prior_table_is_the_smoothed_log_ratio(tmp_path):
    """TokenPrior.count and table() against the formula in plain Python on a small trace;
    unknown pieces get row -1; a model with the prior and token weights saves and loads."""
    from specmoe.sim.nextuse import TokenPrior

    rng = np.random.default_rng(3)
    T, L, K, E = 40, 3, 2, 5
    ex = np.stack([[rng.choice(E, K, replace=False) for _ in range(L)] for _ in range(T)])
    toks = [str(x) for x in rng.choice(["a", "b", "c"], T)]
    tp = TokenPrior.count(toks, ex, E)
    assert tp.pieces == ["a", "b", "c"]
    tab = tp.table()
    for i, piece in enumerate(tp.pieces):
        ts = [t for t in range(T) if toks[t] == piece]
        for l in range(L):
            for e in range(E):
                c = sum(e in ex[t, l] for t in ts)
                m = max(sum(e in ex[t, l] for t in range(T)) / T, 1e-4)
                want = np.log((c + m) / (len(ts) + 1.0)) - np.log(m)
                assert abs(tab[i, l * E + e] - want) < 1e-5
    np.testing.assert_array_equal(tp.rows(["b", "zz", "a"]), [1, -1, 0])
    model = NextUseModel(np.ones(6), np.ones(5), cross=np.zeros((L, E, E)),
                         w_tok_fresh=[0.5, 1.0], w_tok_stale=[-0.5, 2.0], tokens=tp)
    model.save(tmp_path / "m.npz")
    back = NextUseModel.load(tmp_path / "m.npz")
    np.testing.assert_array_equal(back.flat(), model.flat())
    np.testing.assert_array_equal(back.tokens.table(), tab)
    assert back.flat()[0] == 2 and back.flat(token_weights=False)[0] == 1
    with pytest.raises(ValueError, match="do not fit"):
        TokenPrior(["a"], np.zeros((2, L, E)), [1, 1], tp.marginal)
    with pytest.raises(ValueError, match="go together"):
        NextUseModel(np.ones(6), np.ones(5), w_tok_fresh=[0.0, 1.0])


def test_learned_predictor_with_the_token_prior_ranks_as_the_trainer(puffin_subset):
    """With a model that has a token prior, the simulator's learned predictor gets each
    token's prior at its pass (simulate(token_prior=True)): its true predictions equal the
    trainer's numpy features given the same prior, exactly; without the prior it predicts
    differently."""
    from specmoe.sim import nextuse as nu
    from specmoe.sim.nextuse import TokenPrior

    tr = puffin_subset.slice(0, 60)
    T, L, K = tr.experts.shape
    E = tr.num_experts
    base = default_model(L, E)
    tp = TokenPrior.count(tr.tokens[:30], tr.experts[:30], E)  # pieces of the first half
    model = NextUseModel(base.w_fresh, base.w_stale, base.alpha_s, base.alpha_l, base.c,
                         base.beta, base.cross, w_tok_fresh=[0.1, 0.8],
                         w_tok_stale=[0.0, 0.6], tokens=tp)
    table, rows = tp.table(), tp.rows(tr.tokens)
    assert (rows >= 0).any() and (rows < 0).any()
    w = Walker(L, E, model)
    hits = points = 0
    for t in range(T):
        w.begin_pass()
        if rows[t] >= 0:
            w.set_prior(table[rows[t]])
        for lay in range(L):
            w.touch_layer(lay, tr.experts[t, lay])
            tt, ll = (t, lay + 1) if lay + 1 < L else (t + 1, 0)
            if tt >= T:
                continue
            q = w.features()["q"][ll * E:(ll + 1) * E].astype(np.float32)
            top = np.argsort(-q, kind="stable")[:K]
            hits += len(set(top.tolist()) & set(tr.experts[tt, ll].tolist()))
            points += 1
    old = nu.default_model
    nu.default_model = lambda nl, ne: model  # the simulator's learned predictor's model
    try:
        r = simulate(tr, "lru", "10%", prefetch="learned", hardware="laptop")
        r0 = simulate(tr, "lru", "10%", prefetch="learned", hardware="laptop",
                      token_prior=False)
    finally:
        nu.default_model = old
    assert round(r.predictor_precision * points * K) == hits
    assert r0.predictor_precision != r.predictor_precision


def test_bad_priors_are_refused_by_name():
    L, E = 3, 4
    ex = np.zeros((5, L, 2), np.int16)
    ex[:, :, 1] = 1
    kw = dict(expert_bytes=1.0, fast_bw=1.0, link_bw=1.0, link_latency_s=0.0)
    table = np.zeros((2, L * E), np.float32)
    with pytest.raises(ValueError, match="outside the table's 2 rows"):
        _C.simulate(ex, E, "lru", 4, prior_table=table,
                    prior_rows=np.array([0, 1, 2, -1, 0], np.int32), **kw)
    with pytest.raises(ValueError, match="go together"):
        _C.simulate(ex, E, "lru", 4, prior_table=table, **kw)
    with pytest.raises(ValueError, match="prior_table must be"):
        _C.simulate(ex, E, "lru", 4, prior_table=np.zeros((2, 5), np.float32),
                    prior_rows=np.zeros(5, np.int32), **kw)
    with pytest.raises(ValueError, match="outside the table's"):
        _C.replay(_C.Policy("nextuse", 2, L, E), np.arange(6, dtype=np.int32), 3,
                  prior_table=table, prior_rows=np.array([0, 5], np.int32))
    with pytest.raises(ValueError, match="a row per pass"):
        _C.replay(_C.Policy("nextuse", 2, L, E), np.arange(6, dtype=np.int32), 3,
                  prior_table=table, prior_rows=np.array([0], np.int32))


def _trainer():
    """training/nextuse.py as a module (the training scripts are not a package)."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / "training" / "nextuse.py"
    spec = importlib.util.spec_from_file_location("_train_nextuse", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_cross_tables_learn_routing_from_two_layers_back():
    """The trainer's cross tables (fit_cross) on routing where layer l's experts are a fixed
    function of layer l - 2's, the same token's, and nothing else: one table back ranks at
    chance, two find it; and the policy's reading of the tables (Walker.cross_feature, the
    same arithmetic as nextuse.h) gives the trainer's own scores token by token."""
    tn = _trainer()
    rng = np.random.default_rng(3)
    T, L, E, K = 2000, 4, 8, 2
    ex = np.zeros((T, L, K), np.int64)
    for l in (0, 1):
        ex[:, l] = np.array([rng.choice(E, K, replace=False) for _ in range(T)])
    perm = [rng.permutation(E), rng.permutation(E)]
    ex[:, 2], ex[:, 3] = perm[0][ex[:, 0]], perm[1][ex[:, 1]]
    u = np.zeros((T, L, E), np.float32)
    u[np.arange(T)[:, None, None], np.arange(L)[None, :, None], ex] = 1.0
    prior = np.zeros_like(u)
    rec = {d: tn.topk_recall(u, prior, *tn.fit_cross(u, prior, d, iters=200), K) for d in (1, 2)}
    # layer 1 is random (chance K / E = 0.25) under both; layers 2 and 3 only with two tables
    assert rec[1] < 0.35 and rec[2] > 0.7, rec
    bias, tables = tn.fit_cross(u, prior, 2, iters=20)
    model = NextUseModel(np.zeros(6), np.zeros(5), cross=tables, cross_bias=bias)
    X = tn._cross_inputs(u, 2)
    w = Walker(L, E, model)
    for t in range(5):
        w.begin_pass()
        for lay in range(L):
            if lay >= 1:
                want = bias[lay] + X[lay - 1, t] @ np.concatenate([tables[0, lay],
                                                                   tables[1, lay]])
                np.testing.assert_allclose(w.cross_feature(lay), want, rtol=1e-5, atol=1e-6)
            w.touch_layer(lay, ex[t, lay])

"""Routing replay in the live engine (issue 41 item 2): a recorded trace's experts replace the
router's choice, so the cache, prefetch worker, store reads and kernels see a real model's
access pattern.  Checked at DeepSeek-V2-Lite's routing shape (26 MoE layers x 64 experts,
top-6) on the carried puffin subset, with tiny hidden sizes:

* the simulator replaying the same trace demand-only at the same slot count counts the same
  hits, misses and collision misses as the live engine (the one slot table, csrc/slots.h);
* the outputs equal transformers' model whose router is forced to the trace's experts with
  its own softmax weights (the independent reference of the replay's weights);
* the oracle predictor is exact; the learned predictor beats the router on random weights;
* bad input is a named error that consumes nothing.
"""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import specmoe  # noqa: E402
from specmoe import simulate  # noqa: E402

# 1 dense + 26 MoE layers; kv heads = heads as DeepSeek-V2's own config (transformers' MLA
# attention needs it)
SHAPE = dict(layers=27, experts=64, top_k=6, hidden=32, inter=16,
             overrides={"num_key_value_heads": 4})


@pytest.fixture(scope="module")
def trace(puffin_subset):
    return puffin_subset.slice(0, 30)


@pytest.fixture(scope="module")
def engine():
    from specmoe.models.testing import tiny_model

    model = tiny_model("deepseek_v2", **SHAPE)
    eng = specmoe.offload(model, cache=64, policy="lru", prefetch=False, dtype="f32",
                          dense="f32")
    # the layer's misses on the worker while its residents compute (step 5) reorder the
    # accesses by timing; the simulator replays the plain order (ascending id, one at a time)
    eng.set_parallel_misses(False)
    assert eng.routed_in_c == list(range(26))
    yield eng
    eng.close()


def run(eng, n: int):
    """n forward passes of one token each (a 1-token prompt, n new tokens)."""
    out = eng.model.generate(torch.tensor([[5]]), max_new_tokens=n, min_new_tokens=n,
                             do_sample=False, return_dict_in_generate=True, output_logits=True)
    return out


@pytest.mark.parametrize("policy", ["lru", "least_stale", "nextuse", "lfu"])
def test_live_replay_counts_what_the_simulator_counts(engine, trace, policy):
    for slots in (6, 400, 900):
        engine.set_cache(slots, policy=policy)
        engine.replay_routing(trace)
        run(engine, trace.num_tokens)
        assert engine.replay_position == (trace.num_tokens, trace.num_tokens)
        st = engine.stats()
        assert st["passes"] == trace.num_tokens
        r = simulate(trace.sorted_rows(), policy, slots)
        live = (st["hits"], st["misses"], st["collision_misses"])
        assert live == (r.hits, r.misses, r.collision_misses), (policy, slots)
        assert st["hits"] + st["misses"] == trace.num_accesses
    engine.replay_routing(None)


def test_replay_outputs_equal_transformers_forced_to_the_trace(engine, trace):
    """The reference: the same tiny model in transformers, each MoE gate returning the trace's
    experts of its (token, layer) with softmax(router logits) at them times the routed scaling
    factor (DeepSeek-V2's greedy router without renormalisation)."""
    from specmoe.models.testing import tiny_model

    ref = tiny_model("deepseek_v2", **SHAPE)
    n = 12
    ex = torch.as_tensor(trace.experts[:n].astype(np.int64))
    moe = [layer.mlp for layer in ref.model.layers[1:]]
    for pos, block in enumerate(moe):
        gate, calls = block.gate, [0]

        def forced(hidden, gate=gate, pos=pos, calls=calls):
            h = hidden.reshape(-1, gate.hidden_dim)
            logits = torch.nn.functional.linear(h.float(), gate.weight.float())
            p = logits.softmax(dim=-1)
            T = h.shape[0]
            idx = ex[calls[0]:calls[0] + T, pos]
            calls[0] += T
            return logits, p.gather(1, idx) * gate.routed_scaling_factor, idx

        gate.forward = forced
    with torch.no_grad():
        want = ref.generate(torch.tensor([[5]]), max_new_tokens=n, min_new_tokens=n,
                            do_sample=False, return_dict_in_generate=True, output_logits=True)
    engine.set_cache(400, policy="lru")
    engine.replay_routing(trace.experts[:n])
    got = run(engine, n)
    engine.replay_routing(None)
    assert torch.equal(got.sequences, want.sequences)
    for a, b in zip(got.logits, want.logits):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    # and the replay changes the routing: the model's own router chooses other experts
    engine.set_cache(400, policy="lru")
    own = run(engine, n)
    assert not all(torch.allclose(a, b, atol=1e-5) for a, b in zip(own.logits, want.logits))


def test_oracle_and_learned_predictors(engine, puffin_subset):
    tr = puffin_subset.slice(0, 60)
    prec = {}
    for pred in ("router", "learned", "oracle"):
        engine.set_cache(400, policy="lru")
        engine.replay_routing(tr)
        engine.set_prefetch(True, overfetch=1.0, predictor=pred)
        assert engine.predictor == pred
        run(engine, tr.num_tokens)
        st = engine.stats()
        prec[pred] = st["prefetch_precision"]
        if pred == "oracle":  # the trace's own next layer: every prediction used, every use
            assert st["prefetch_precision"] == st["prefetch_recall"] == 1.0
        engine.set_prefetch(False, predictor="router")
    # random routers predict at chance (6 of 64); the learned model from the routing seen
    assert prec["router"] < 0.2 < 0.45 < prec["learned"] < 1.0, prec
    engine.replay_routing(None)


def walker_true_positives(model, tr, table, rows) -> int:
    """What the live learned predictor should get right with overfetch 1: after each layer of
    each one-token pass, the top-k of the next layer (same pass) by the trainer's numpy q,
    token t given table[rows[t]] as its prior (none where rows[t] < 0), against the trace."""
    from specmoe.sim.nextuse import Walker

    T, L, K = tr.experts.shape
    E = tr.num_experts
    w, hits = Walker(L, E, model), 0
    for t in range(T):
        w.begin_pass()
        if rows[t] >= 0:
            w.set_prior(table[rows[t]])
        for lay in range(L):
            w.touch_layer(lay, tr.experts[t, lay])
            if lay + 1 < L:
                q = w.features()["q"][(lay + 1) * E:(lay + 2) * E].astype(np.float32)
                top = np.argsort(-q, kind="stable")[:K]
                hits += len(set(top.tolist()) & set(tr.experts[t, lay + 1].tolist()))
    return hits


def test_learned_predictor_gets_the_replayed_tokens_priors(engine, puffin_subset):
    """Replaying a trace with token pieces, each one-token pass gives the learned predictor
    its token's prior (the packaged model's token prior; csrc/layer.h
    smoe_layers_set_priors): the live predictions' true positives equal the trainer's
    numpy features given the same priors, top-k by q of the next layer within each pass; a
    trace without pieces predicts as the model without priors does, and differently."""
    from specmoe.sim.nextuse import default_model

    tr = puffin_subset.slice(0, 40)
    T, L, K = tr.experts.shape
    E = tr.num_experts
    model = default_model(L, E)
    assert model.tokens is not None
    table, rows = model.tokens.table(), model.tokens.rows(tr.tokens)
    assert (rows >= 0).sum() > T // 2

    got = {}
    for name, arg in (("pieces", tr), ("no pieces", tr.experts)):
        engine.set_cache(400, policy="lru")
        engine.replay_routing(arg)
        engine.set_prefetch(True, overfetch=1.0, predictor="learned")
        engine.layers.counters(reset=True)
        run(engine, T)
        c = engine.layers.counters()
        assert c["predicted"] == T * (L - 1) * K
        got[name] = c["true_positive"]
        engine.set_prefetch(False, predictor="router")
    engine.replay_routing(None)
    assert got == {"pieces": walker_true_positives(model, tr, table, rows),
                   "no pieces": walker_true_positives(model, tr, table, np.full(T, -1))}
    assert got["pieces"] != got["no pieces"]


def test_learned_predictor_gets_the_input_tokens_priors(engine, puffin_subset):
    """Outside a replay's own pieces, Engine.set_token_pieces maps token ids to pieces and each
    one-token forward gives the learned predictor its input token's prior (the embedding's
    pre-hook): replaying a trace's experts alone, the live true positives equal the trainer's
    numpy features given the priors of the ids the model was fed; None turns it off."""
    from specmoe.sim.nextuse import default_model

    tr = puffin_subset.slice(0, 30)
    T, L, K = tr.experts.shape
    E = tr.num_experts
    model = default_model(L, E)
    table = model.tokens.table()
    V = engine.model.config.vocab_size
    pieces = [model.tokens.pieces[i % 50] if i % 3 else f"<unknown {i}>" for i in range(V)]
    engine.set_cache(400, policy="lru")
    engine.replay_routing(tr.experts)  # no pieces: the priors come from the input ids
    assert engine.set_token_pieces(pieces)
    engine.set_prefetch(True, overfetch=1.0, predictor="learned")
    engine.layers.counters(reset=True)
    out = run(engine, T)
    got = engine.layers.counters()["true_positive"]
    engine.set_prefetch(False, predictor="router")
    assert not engine.set_token_pieces(None)
    engine.replay_routing(None)
    fed = out.sequences[0, :T].tolist()  # pass t's input: the prompt's token, then generated
    rows = model.tokens.rows([pieces[i] for i in fed])
    assert (rows >= 0).any() and (rows < 0).any()
    assert got == walker_true_positives(model, tr, table, rows)
    assert engine._prior_hook is None


def test_replay_bad_input_is_named_and_consumes_nothing(engine, trace):
    from specmoe import CacheError

    engine.set_cache(64, policy="lru")
    with pytest.raises(ValueError, match=r"this model \[tokens, 26, 6\]"):
        engine.replay_routing(trace.experts[:, :20])
    bad = trace.experts[:4].copy()
    bad[2, 5, 1] = 64
    with pytest.raises(ValueError, match=r"ids must be in 0\.\.63"):
        engine.replay_routing(bad)
    bad[2, 5, 1] = bad[2, 5, 0]
    with pytest.raises(ValueError, match="token 2, layer position 5 routes to expert .* twice"):
        engine.replay_routing(bad)
    assert engine.replay_position == (0, 0)  # nothing was set
    with pytest.raises(ValueError, match="replay_routing.* first"):
        engine.set_prefetch(True, predictor="oracle")
    with pytest.raises(ValueError, match="predictor must be one of"):
        engine.set_prefetch(True, predictor="psychic")
    engine.replay_routing(trace.experts[:3])
    engine.set_prefetch(True, predictor="oracle")
    with pytest.raises(ValueError, match="oracle predictor is set"):
        engine.replay_routing(None)
    engine.set_prefetch(False, predictor="router")
    run(engine, 3)
    assert engine.replay_position == (3, 3)
    passes = engine.stats()["passes"]
    with pytest.raises(CacheError, match="used up"):
        run(engine, 1)
    assert engine.stats()["passes"] == passes and engine.replay_position == (3, 3)
    # a call that routes in Python cannot follow a replay: named, not silently unreplayed
    engine.replay_routing(trace.experts[:3])
    with engine.trace():
        with pytest.raises(RuntimeError, match="routed in Python"):
            run(engine, 1)
    engine.replay_routing(None)
    assert engine.replay_position == (0, 0)


def test_replay_survives_a_cache_rebuild(engine, trace):
    engine.set_cache(64, policy="lru")
    engine.replay_routing(trace)
    run(engine, 5)
    engine.set_cache(400, policy="least_stale")  # the position carries over
    assert engine.replay_position == (5, trace.num_tokens)
    run(engine, trace.num_tokens - 5)
    assert engine.replay_position == (trace.num_tokens, trace.num_tokens)
    engine.replay_routing(None)


def test_from_pretrained_route_replay(tmp_path, trace):
    from specmoe.models.testing import save_checkpoint, tiny_model

    ckpt = save_checkpoint(tiny_model("deepseek_v2", **SHAPE), tmp_path / "ckpt")
    with pytest.raises(ValueError, match="route='replay' needs trace="):
        specmoe.from_pretrained(ckpt, route="replay", store=tmp_path / "s.smoe")
    with pytest.raises(ValueError, match="route='psychic'"):
        specmoe.from_pretrained(ckpt, route="psychic", store=tmp_path / "s.smoe")
    with pytest.warns(UserWarning, match="runs without the token prior"):  # no tokenizer
        model = specmoe.from_pretrained(ckpt, dtype="f32", dense="f32", cache=100,
                                        route="replay", trace=trace, prefetch="learned",
                                        store=tmp_path / "s.smoe", progress=False)
    eng = specmoe.engine_of(model)
    try:
        assert eng.predictor == "learned" and eng.replay_position == (0, trace.num_tokens)
        model.generate(torch.tensor([[5]]), max_new_tokens=4, min_new_tokens=4, do_sample=False)
        assert eng.replay_position == (4, trace.num_tokens)
    finally:
        eng.close()


def test_from_pretrained_learned_maps_the_tokenizer_to_the_token_prior(tmp_path):
    """prefetch='learned' on a model of the packaged table's shape: the checkpoint's tokenizer
    maps ids to pieces (Engine.set_token_pieces); ids whose piece the table lacks get none."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    from specmoe.models.testing import save_checkpoint, tiny_model
    from specmoe.sim.nextuse import default_model

    ckpt = save_checkpoint(tiny_model("deepseek_v2", **SHAPE), tmp_path / "ckpt")
    known = default_model(26, 64).tokens.pieces[:40]
    vocab = {p: i for i, p in enumerate(["[UNK]"] + known + ["not-a-deepseek-piece"])}
    PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="[UNK]")),
                            unk_token="[UNK]").save_pretrained(ckpt)
    model = specmoe.from_pretrained(ckpt, dtype="f32", dense="f32", cache=100,
                                    prefetch="learned", store=tmp_path / "s.smoe", progress=False)
    eng = specmoe.engine_of(model)
    try:
        rows = eng._token_rows
        assert rows is not None and len(rows) == len(vocab) and eng._prior_hook is not None
        assert rows[0] == -1 and rows[-1] == -1 and (rows[1:41] >= 0).all()
        model.generate(torch.tensor([[5]]), max_new_tokens=4, min_new_tokens=4, do_sample=False)
        assert eng.stats()["prefetch_precision"] is not None
    finally:
        eng.close()
    assert eng._prior_hook is None  # the model's embedding no longer calls the closed engine


def test_set_token_pieces_needs_the_tables_shape():
    """The packaged token prior is DeepSeek-V2-Lite's (26 x 64): another shape gets none and
    no embedding hook."""
    from specmoe.models.testing import tiny_model

    eng = specmoe.offload(tiny_model("deepseek_v2"), cache=8, prefetch=False, dtype="f32",
                          dense="f32")
    try:
        assert not eng.set_token_pieces(["Ġthe"] * eng.model.config.vocab_size)
        assert eng._token_rows is None and eng._prior_hook is None
    finally:
        eng.close()

"""specmoe.models.decode_step: one-token forwards of an offloaded model whose decoder layers are one C
call each skip transformers' model-level Python, and run those layers in one
``_C.layer_chain`` call, or the whole step in one ``_C.DecodePlan.step``.  Reference: the same
model with the step switched off (its own forward, transformers' mask and output code) or its
layers called one by one: logits, caches and generated tokens bit for bit, on every
architecture of DECODE_STEP_MODELS, also while plans are rebuilt and set aside; the calls that
must go to the model's own forward do; models it cannot serve are left alone; a bad chain or
plan step raises before any layer runs."""
from __future__ import annotations

import copy
import gc
import inspect

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, DynamicCache

import specmoe
from specmoe import _C
from specmoe.runtime import engine as hf
from specmoe.models.arch import DECODE_STEP_MODELS
from specmoe.models.decode_step import DecodeStep, install_decode_step
from specmoe.speculation.decoding import records_recurrent_states
from specmoe.runtime.kvcache import kv_advance
from specmoe.models.testing import tiny_config, tiny_model
from specmoe.models.layers import chain_step

ARCHS = ["olmoe", "qwen3_moe", "qwen2_moe", "mixtral", "deepseek_v2", "deepseek_v3",
         "glm4_moe_lite", "qwen3_5_moe_text", "qwen3_next", "minimax_m2", "glm4_moe",
         "ernie4_5_moe"]
# hybrids: gated-DeltaNet layers (their step one GdnBlock.layer call, a recurrent state in the
# cache) between gated full-attention ones
HYBRID = ("qwen3_5_moe_text", "qwen3_next")


def _same_cache(kv, kv_ref) -> None:
    """Every layer of two caches equal: keys and values, or a linear-attention layer's conv
    window and recurrent state."""
    assert kv.get_seq_length() == kv_ref.get_seq_length()
    for a, b in zip(kv.layers, kv_ref.layers, strict=True):
        if hasattr(a, "keys"):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        else:
            assert torch.equal(a.conv_states[0], b.conv_states[0])
            assert torch.equal(a.recurrent_states[0], b.recurrent_states[0])


def _tiny(arch: str, dt: torch.dtype, **over) -> torch.nn.Module:
    if not arch.startswith("deepseek") and not over:
        return tiny_model(arch, dtype=dt)
    cfg = tiny_config(arch)
    if arch == "deepseek_v2":  # transformers' V2 attention needs kv heads = heads here
        over = dict(over, qk_rope_head_dim=16, num_key_value_heads=cfg.num_attention_heads)
    cfg = type(cfg)(**{**cfg.to_dict(), **over})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(cfg, experts_implementation="eager",
                                            dtype=dt).eval()


def _offloaded(arch: str, dt: torch.dtype, **over):
    model = _tiny(arch, dt, **over)
    fmt = "f32" if dt == torch.float32 else "bf16"
    eng = hf.offload(model, dtype=fmt, dense=fmt, cache=1.0, prefetch=False)
    return model, eng


def _gen(model, ids, n=10, **kw):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                              do_sample=False, eos_token_id=None, pad_token_id=0, **kw)


@pytest.mark.parametrize("dt", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ARCHS)
def test_step_equals_the_models_own_forward(arch, dt):
    model, eng = _offloaded(arch, dt)
    try:
        step = model._specmoe_decode_step
        assert type(model).__name__ in DECODE_STEP_MODELS and isinstance(step, DecodeStep)
        ids = torch.randint(0, model.config.vocab_size, (1, 6),
                            generator=torch.Generator().manual_seed(1))
        # logits and cache of each step, from the same cache, step on and off
        kv = DynamicCache(config=model.config)
        with torch.no_grad():
            out = model(input_ids=ids, cache=kv, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
            for _ in range(5):
                kv_off = copy.deepcopy(kv)  # (its KV buffers then re-made: kv_buffers)
                n0 = step.steps
                on = model(input_ids=tok, cache=kv, use_cache=True)
                assert step.steps == n0 + 1
                step.enabled = False
                try:
                    off = model(input_ids=tok, cache=kv_off, use_cache=True)
                finally:
                    step.enabled = True
                assert type(on) is type(off)
                assert torch.equal(on.logits, off.logits)
                assert on.logits.dtype == off.logits.dtype and on.logits.shape == (1, 1, off.logits.shape[-1])
                _same_cache(kv, kv_off)
                tok = on.logits[:, -1:].argmax(-1)
        # layers that route their MoE block in C go through layer_chain (Qwen2-MoE's gated
        # shared expert and DeepSeek-V3's group-limited sigmoid router included), and so do
        # the dense first layers of DeepSeek, GLM-4.5 and ERNIE-4.5 (their MLP in the
        # MLABlock's / AttnBlock's call): every layer is one call, so a step is one
        # _C.DecodePlan call
        assert step.planned == 5
        assert step.chained == 5 * model.config.num_hidden_layers
        # whole generations: transformers' loop and specmoe's (which refuses the hybrids where
        # their state cannot be rolled back: before transformers 5.25)
        hybrid = arch in HYBRID and not records_recurrent_states(model)
        n0 = step.steps
        got = _gen(model, ids)
        sg = None if hybrid else specmoe.generate(model, ids[0], max_new_tokens=10,
                                                  eos_token_id=None)
        # every forward after the prefills (specmoe.generate prefills all but the last prompt
        # token)
        assert step.steps == n0 + 9 + (0 if hybrid else 10)
        step.enabled = False
        try:
            ref = _gen(model, ids)
            sg_ref = None if hybrid else specmoe.generate(model, ids[0], max_new_tokens=10,
                                                          eos_token_id=None)
        finally:
            step.enabled = True
        assert torch.equal(got, ref)
        assert hybrid or torch.equal(sg.sequences, sg_ref.sequences)
        step.planning = False  # the per-layer path: layer_chain
        try:
            p0 = step.planned
            assert torch.equal(_gen(model, ids), got) and step.planned == p0
            assert hybrid or torch.equal(specmoe.generate(model, ids[0], max_new_tokens=10,
                                                          eos_token_id=None).sequences,
                                         sg.sequences)
        finally:
            step.planning = True
        step.chaining = False  # every layer through its forward, one call each
        try:
            c0, p0 = step.chained, step.planned
            assert torch.equal(_gen(model, ids), got) and step.chained == c0
            assert step.planned == p0
        finally:
            step.chaining = True
    finally:
        eng.close()


def _chain_items(layers, cache, h, pe):
    """The layer_chain items of ``layers`` for one step (h [1, 1, hidden] input)."""
    items, outs = [], []
    for lyr in layers:
        out = torch.empty_like(h)
        it = chain_step(lyr).call(lyr, h, out, pe, cache)
        if it is None:
            return items, outs
        items.append(it)
        outs.append(out)
        h = out
    return items, outs


@pytest.mark.parametrize("arch", ["olmoe", "deepseek_v2"])
def test_layer_chain_equals_layer_calls_and_checks_first(arch):
    model, eng = _offloaded(arch, torch.bfloat16)
    try:
        base = model.model
        ids = torch.randint(0, model.config.vocab_size, (1, 5),
                            generator=torch.Generator().manual_seed(4))
        kv = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=ids, cache=kv, use_cache=True)
            S = kv.get_seq_length()
            first = 0  # (DeepSeek-V2's dense first layer is an item too: its MLP in the call)
            h0 = base.embed_tokens(torch.tensor([[9]]))
            pos = torch.tensor([[S]])
            pe = base.rotary_emb(h0, pos)
            for lyr in base.layers[:first]:
                h0 = lyr(h0, position_embeddings=pe, attention_mask=None, position_ids=pos,
                         cache=kv, use_cache=True)
        kv_ref = copy.deepcopy(kv)
        items, outs = _chain_items(base.layers[first:], kv, h0, pe)
        assert len(items) == len(base.layers) - first >= 2
        before = [(it[2][3].copy(), it[2][4].copy()) for it in items]
        calls = tuple((it[0], it[1]) for it in items)
        # a bad item anywhere: nothing runs (the first layer's buffers stay as they were)
        bad_args = list(calls[1][1])
        bad_args[1] = 10 ** 6  # a layer position the Layers object does not have
        bads = [(calls[0], (calls[1][0], tuple(bad_args))),   # the second call's position
                (calls[0], (object(), ())),                    # not a block
                (calls[0], (calls[1][0], calls[1][1][:-1])),   # an argument short
                calls + ((calls[0][0],),)]                     # not (block, args)
        for bad in bads:
            with pytest.raises((TypeError, ValueError)):
                _C.layer_chain(bad)
            for it, (k0, v0) in zip(items, before):
                assert np.array_equal(it[2][3], k0) and np.array_equal(it[2][4], v0)
        with pytest.raises(TypeError):
            _C.layer_chain([calls[0]])
        with pytest.raises(ValueError):
            _C.layer_chain(calls[:1] * 129)
        assert _C.layer_chain(()) == (0.0, 0.0, 0.0)
        ta, tm, td = _C.layer_chain(calls)
        assert ta > 0 and tm > 0 and (td > 0) == (arch == "deepseek_v2")
        # the reference: each layer's own call on the copy of the cache
        h = h0
        with torch.no_grad():
            for lyr in base.layers[first:]:
                h = lyr(h, position_embeddings=pe, attention_mask=None, position_ids=pos,
                        cache=kv_ref, use_cache=True)
        assert torch.equal(outs[-1], h)
        for it in items:
            kv_advance(it[2], 1)
        for a, b in zip(kv.layers, kv_ref.layers):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    finally:
        eng.close()


def test_calls_it_cannot_serve_go_to_the_models_forward():
    model, eng = _offloaded("olmoe", torch.bfloat16)
    try:
        step = model._specmoe_decode_step
        V = model.config.vocab_size
        ids = torch.randint(0, V, (1, 5), generator=torch.Generator().manual_seed(2))
        with torch.no_grad():
            kv = DynamicCache(config=model.config)
            model(input_ids=ids, cache=kv, use_cache=True)
        tok = torch.tensor([[7]])

        def call(**kw):
            c = copy.deepcopy(kv)
            f0, s0 = step.fallbacks, step.steps
            with torch.no_grad():
                out = model(cache=c, use_cache=True, **kw)
            step.enabled = False
            try:
                with torch.no_grad():
                    ref = model(cache=copy.deepcopy(kv), use_cache=True, **kw)
            finally:
                step.enabled = True
            return out, ref, (step.fallbacks - f0, step.steps - s0)

        S = kv.get_seq_length()
        cases = {
            "two tokens": dict(input_ids=torch.tensor([[7, 8]])),
            "padding": dict(input_ids=tok, attention_mask=torch.tensor([[0] + [1] * S])),
            "other position": dict(input_ids=tok, position_ids=torch.tensor([[S + 3]])),
            "hidden states": dict(input_ids=tok, output_hidden_states=True),
            "embeddings": dict(inputs_embeds=model.model.embed_tokens(tok)),
            "logits to keep": dict(input_ids=tok, logits_to_keep=torch.tensor([0])),
        }
        for name, kw in cases.items():
            out, ref, (fell, took) = call(**kw)
            assert (fell, took) == (1, 0), name
            assert torch.equal(out.logits, ref.logits), name
        # the plain call is taken: mask of ones, its position, logits_to_keep 1
        out, ref, (fell, took) = call(input_ids=tok, attention_mask=torch.ones(1, S + 1,
                                                                               dtype=torch.long),
                                      position_ids=torch.tensor([[S]]), logits_to_keep=1)
        assert (fell, took) == (0, 1) and torch.equal(out.logits, ref.logits)
        # gradients on, a hook on the inner model, training mode
        with torch.enable_grad():
            f0 = step.fallbacks
            model(input_ids=tok, cache=copy.deepcopy(kv), use_cache=True)
            assert step.fallbacks == f0 + 1
        seen = []
        h = model.model.register_forward_hook(lambda m, a, o: seen.append(1))
        try:
            out, ref, (fell, took) = call(input_ids=tok)
            assert (fell, took) == (1, 0) and seen and torch.equal(out.logits, ref.logits)
        finally:
            h.remove()
        # a batch of two
        with torch.no_grad():
            kv2 = DynamicCache(config=model.config)
            model(input_ids=ids.repeat(2, 1), cache=kv2, use_cache=True)
            f0 = step.fallbacks
            model(input_ids=tok.repeat(2, 1), cache=kv2, use_cache=True)
            assert step.fallbacks == f0 + 1
        # hooks on the causal LM itself still run (they wrap the step)
        seen.clear()
        h = model.register_forward_hook(lambda m, a, o: seen.append(1))
        try:
            out, ref, (fell, took) = call(input_ids=tok)
            assert (fell, took) == (0, 1) and len(seen) == 2
        finally:
            h.remove()
    finally:
        eng.close()


def _prefilled(model, seed):
    """A 5-token random prompt, a cache after it through the model, a copy of that cache, and
    the greedy next token."""
    ids = torch.randint(0, model.config.vocab_size, (1, 5),
                        generator=torch.Generator().manual_seed(seed))
    kv = DynamicCache(config=model.config)
    with torch.no_grad():
        tok = model(input_ids=ids, cache=kv, use_cache=True).logits[:, -1:].argmax(-1)
    return ids, kv, copy.deepcopy(kv), tok


def _step_both(model, kv, kv_ref, tok):
    """One step of tok on kv through the DecodeStep and on kv_ref through the model's own
    forward: equal logits and caches asserted; the next greedy token."""
    step = model._specmoe_decode_step
    with torch.no_grad():
        on = model(input_ids=tok, cache=kv, use_cache=True)
        step.enabled = False
        try:
            off = model(input_ids=tok, cache=kv_ref, use_cache=True)
        finally:
            step.enabled = True
    assert torch.equal(on.logits, off.logits)
    _same_cache(kv, kv_ref)
    return on.logits[:, -1:].argmax(-1)


def _two_steps(model, n):
    """A prompt of n tokens prefilled, then two steps checked by :func:`_step_both`: (the
    DecodeStep, its cache, the reference cache, the next token)."""
    _, kv, kv_ref, tok = _prefilled(model, n)
    for _ in range(2):
        tok = _step_both(model, kv, kv_ref, tok)
    return model._specmoe_decode_step, kv, kv_ref, tok


@pytest.mark.parametrize("arch", HYBRID)
def test_a_hybrid_plan_follows_the_recurrent_states(arch):
    """A plan writes the linear-attention layers' conv windows and recurrent states in place:
    when the cache holds other tensors for them (as reorder_cache makes), the plan is rebuilt
    on those, the old ones left alone; and while the cache records its past for a rollback, no
    plan serves."""
    model, eng = _offloaded(arch, torch.float32)
    try:
        step, kv, kv_ref, tok = _two_steps(model, 3)
        assert step.planned == 2
        plan = step._plan
        lin = [lay for lay in kv.layers if not hasattr(lay, "keys")]
        old = [(lay.conv_states[0], lay.recurrent_states[0]) for lay in lin]
        kept = [(c.clone(), r.clone()) for c, r in old]
        for lay in lin:  # (as reorder_cache does, the KV layers left as they are)
            lay.conv_states[0] = lay.conv_states[0].clone()
            lay.recurrent_states[0] = lay.recurrent_states[0].clone()
        for _ in range(2):
            tok = _step_both(model, kv, kv_ref, tok)
        assert step.planned == 4 and step._plan is not plan  # rebuilt on the new tensors
        for (c, r), (c0, r0) in zip(old, kept):
            assert torch.equal(c, c0) and torch.equal(r, r0)
        # a cache recording its past (speculative rollback): the layers' own forwards
        for lay in kv.layers:
            lay.activate_past_recording() if not hasattr(lay, "keys") else None
        p0, n0 = step.planned, step.steps
        with torch.no_grad():
            model(input_ids=tok, cache=kv, use_cache=True)
        assert step.planned == p0 and step.steps == n0 + 1
    finally:
        eng.close()


@pytest.mark.parametrize("arch", ["olmoe", "deepseek_v2"])
def test_a_plan_follows_the_cache_and_the_model(arch, monkeypatch):
    """A plan is rebuilt when its rotary tables or KV buffers run out, when the Engine's
    cache is rebuilt; kept when the cache is cropped; set aside while a layer has a hook (that
    step runs the hook); and every step's logits and cache are the model's own."""
    from specmoe.models import decode_step
    from specmoe.runtime import memplan
    monkeypatch.setattr(decode_step, "_PLAN_MIN_POSITIONS", 8)   # tables run out at S = 8
    monkeypatch.setattr(memplan, "KV_SPARE", 4)                  # and KV buffers often
    model, eng = _offloaded(arch, torch.float32)
    try:
        step = model._specmoe_decode_step
        ids, kv, kv_ref, tok = _prefilled(model, 4)
        plans = []
        p0 = step.planned
        for _ in range(24):
            tok = _step_both(model, kv, kv_ref, tok)
            if not plans or plans[-1] is not step._plan:
                plans.append(step._plan)
        assert step.planned - p0 == 24
        assert len(plans) >= 3  # tables of 8, then 2 (S + 1) positions; KV buffers regrown
        kv.crop(-3)
        kv_ref.crop(-3)
        before = step._plan
        tok = _step_both(model, kv, kv_ref, tok)
        assert step._plan is before and step.planned - p0 == 25
        # a hook on a layer: the per-layer path runs it; plans again some steps later
        seen = []
        h = model.model.layers[1].register_forward_hook(lambda m, a, o: seen.append(1))
        try:
            tok = _step_both(model, kv, kv_ref, tok)
        finally:
            h.remove()
        assert seen and step._plan is None and step.planned - p0 == 25
        for _ in range(decode_step._PLAN_RETRY_STEPS + 1):
            tok = _step_both(model, kv, kv_ref, tok)
        assert step._plan is not None and step.planned > p0 + 25
        # a rebuilt Engine cache: a new _C.Layers under the plan
        before = step._plan
        eng.set_cache(1.0)
        tok = _step_both(model, kv, kv_ref, tok)
        assert step._plan is not before and step._plan.eng_layers is eng._layers
        # greedy_next (specmoe.generate's plain greedy step): the argmax of the model's own
        # logits, the same cache after it
        for _ in range(3):
            p0 = step.planned
            nxt = step.greedy_next(int(tok), kv)
            assert step.planned == p0 + 1
            with torch.no_grad():
                step.enabled = False
                try:
                    off = model(input_ids=tok, cache=kv_ref, use_cache=True)
                finally:
                    step.enabled = True
            assert nxt == int(off.logits[0, -1].float().argmax())
            for a, b in zip(kv.layers, kv_ref.layers):
                assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
            tok = torch.tensor([[nxt]])
        # a hook on the model: greedy_next declines (nothing run), the forward runs the hook
        seen = []
        h = model.register_forward_hook(lambda m, a, o: seen.append(1))
        try:
            S = kv.get_seq_length()
            assert step.greedy_next(int(tok), kv) is None and kv.get_seq_length() == S
            got = specmoe.generate(model, ids[0], max_new_tokens=4, eos_token_id=None)
            assert len(seen) == 5  # the prefill and four one-token steps
        finally:
            h.remove()
        step.enabled = False
        try:
            ref = specmoe.generate(model, ids[0], max_new_tokens=4, eos_token_id=None)
        finally:
            step.enabled = True
        assert torch.equal(got.sequences, ref.sequences)
        # a one-token prompt: the first step fills the empty cache through the model's path,
        # every later one is planned
        p0 = step.planned
        one = specmoe.generate(model, ids[0, :1], max_new_tokens=6, eos_token_id=None)
        assert step.planned - p0 == 5
        step.enabled = False
        try:
            ref = specmoe.generate(model, ids[0, :1], max_new_tokens=6, eos_token_id=None)
        finally:
            step.enabled = True
        assert torch.equal(one.sequences, ref.sequences)
        # the plan goes with its cache: a finished generation's KV buffers are not held
        specmoe.generate(model, ids[0], max_new_tokens=4, eos_token_id=None)
        gc.collect()
        assert step._plan is None
        plan = step._plan_for(kv, kv.get_seq_length())
        assert plan is not None and plan.cache() is kv
        del kv
        gc.collect()
        assert step._plan is None
    finally:
        eng.close()


@pytest.mark.parametrize("arch", ["olmoe", "deepseek_v2"])
def test_a_plan_outlives_speculations_rollback_and_verification(arch):
    """A crop and a forward of several tokens write the same KV buffers: the plan built
    before serves the next step (speculative decoding's verification and rollback cost no
    rebuild), with the model's own logits; keys/values assigned from outside (as
    reorder_cache does) are new tensors, and the plan is rebuilt on them."""
    model, eng = _offloaded(arch, torch.float32)
    try:
        step, kv, kv_ref, tok = _two_steps(model, 4)
        plan = step._plan
        assert plan is not None
        for _ in range(3):
            more = torch.cat([tok, torch.tensor([[5, 7]])], 1)  # a verification of 3 tokens
            with torch.no_grad():
                a = model(input_ids=more, cache=kv, use_cache=True).logits
                step.enabled = False
                try:
                    b = model(input_ids=more, cache=kv_ref, use_cache=True).logits
                finally:
                    step.enabled = True
            assert torch.equal(a, b)
            kv.crop(-1)  # one draft token rejected
            kv_ref.crop(-1)
            p0 = step.planned
            tok = _step_both(model, kv, kv_ref, a[:, 1:2].argmax(-1))
            assert step._plan is plan and step.planned == p0 + 1
        for lay in kv.layers:  # other tensors, the same positions
            lay.keys, lay.values = lay.keys.clone(), lay.values.clone()
        p0 = step.planned
        for _ in range(2):
            tok = _step_both(model, kv, kv_ref, tok)
        assert step._plan is not plan and step.planned == p0 + 2
    finally:
        eng.close()


def test_a_decode_plan_checks_its_arguments_before_it_runs():
    model, eng = _offloaded("olmoe", torch.float32)
    try:
        step = model._specmoe_decode_step
        V = model.config.vocab_size
        kv = DynamicCache(config=model.config)
        with torch.no_grad():
            model(input_ids=torch.tensor([[1, 2, 3]]), cache=kv, use_cache=True)
            model(input_ids=torch.tensor([[4]]), cache=kv, use_cache=True)
        plan = step._plan
        assert plan is not None and plan.cache() is kv
        S = kv.get_seq_length()
        kt = [v[0].buffers[0].clone() for v in plan.views]
        logits = np.zeros((1, V), np.float32)
        bad = [((V, S, logits), ValueError, "token"), ((-1, S, logits), ValueError, "token"),
               ((0, -1, logits), ValueError, "S=-1"),
               ((0, 10 ** 6, logits), ValueError, "rotary table|capacity"),
               ((0, S, np.zeros((1, V + 1), np.float32)), ValueError, "logits"),
               ((0, S, np.zeros((1, V), np.float64)), ValueError, "logits"),
               ((0, S, None), TypeError, "numpy array"),
               ((0, S), TypeError, "3 or 4 arguments")]
        for args, exc, msg in bad:
            with pytest.raises(exc, match=msg):
                plan.c.step(*args)
        assert not logits.any()  # nothing ran: no logits, no KV position written
        for v, k0 in zip(plan.views, kt):  # (bytes: past S the buffers hold any bits)
            assert v[0].buffers[0].numpy().tobytes() == k0.numpy().tobytes()
        # the constructor: layer_chain's items, pairs of one row's worth, no attention bias
        x0 = plan.x0.view(1, -1).numpy()
        with pytest.raises(TypeError):
            _C.DecodePlan([])
        with pytest.raises(ValueError, match="1..128"):
            _C.DecodePlan(())
        items, _ = _chain_items(list(model.model.layers), kv,
                                torch.zeros(1, 1, x0.shape[1]),
                                model.model.rotary_emb(plan.x0, torch.tensor([[S]])))
        calls = tuple((it[0], it[1]) for it in items)
        alone = _C.DecodePlan(calls)  # layers alone
        with pytest.raises(ValueError, match="argmax needs a head"):
            alone.step(0, S, None, True)
        with pytest.raises(ValueError, match="None without a head"):
            alone.step(0, S, logits)
        with pytest.raises(ValueError, match="one of its rows"):
            _C.DecodePlan(calls, ((np.zeros((4, 8), np.float32), np.zeros(7, np.float32)),))
        with pytest.raises(ValueError, match="one of its rows"):
            _C.DecodePlan(calls, embed=(np.zeros((V, x0.shape[1]), np.float32),
                                        np.zeros((1, x0.shape[1]), np.float64)))
        with pytest.raises(TypeError, match="Linear"):
            _C.DecodePlan(calls, head=(object(), x0))
        a = list(calls[0][1])
        a[9] = np.zeros((1, 1, S + 1), np.float32)  # an attention bias
        with pytest.raises(ValueError, match="attention bias"):
            _C.DecodePlan(((calls[0][0], tuple(a)),) + calls[1:])
    finally:
        eng.close()


def test_past_the_sliding_window_the_models_mask_is_used():
    model, eng = _offloaded("mixtral", torch.float32, sliding_window=8)
    try:
        step = model._specmoe_decode_step
        ids = torch.randint(0, model.config.vocab_size, (1, 5),
                            generator=torch.Generator().manual_seed(3))
        f0, s0 = step.fallbacks, step.steps
        got = _gen(model, ids, n=9)
        # positions 5..7 fit the window of 8 (S + 1 <= 8), the steps from S = 8 on do not
        assert step.steps - s0 == 3 and step.fallbacks - f0 == 1 + 5
        step.enabled = False
        try:
            ref = _gen(model, ids, n=9)
        finally:
            step.enabled = True
        assert torch.equal(got, ref)
    finally:
        eng.close()


def test_not_installed_where_it_cannot_serve():
    # layers not one C call each (dense layers in torch): no step
    model = tiny_model("olmoe", dtype=torch.bfloat16)
    eng = hf.offload(model, dtype="bf16", dense="torch", cache=1.0, prefetch=False)
    try:
        assert getattr(model, "_specmoe_decode_step", None) is None
        assert "forward" not in vars(model)
    finally:
        eng.close()
    # an architecture outside the list; a forward someone else replaced
    other = tiny_model("gpt_oss")
    assert install_decode_step(other) is False and "forward" not in vars(other)
    m = tiny_model("olmoe")
    m.model.forward = m.model.forward
    assert install_decode_step(m) is False and "forward" not in vars(m)
    m = tiny_model("olmoe")
    assert install_decode_step(m) is True and install_decode_step(m) is True
    assert isinstance(vars(m)["forward"], DecodeStep)
    assert vars(m)["forward"].original.__func__ is type(m).forward


def test_generate_sees_the_models_signature_and_keeps_one_prompt_row():
    """model.generate reads the forward's signature: with the step installed it must still pass
    logits_to_keep=1 to the prompt's forward, so lm_head runs on one row, as without the step
    (a [prompt, vocab] product otherwise), and still reject a keyword the model does not take."""
    model, eng = _offloaded("deepseek_v2", torch.float32)
    try:
        assert isinstance(model.forward, DecodeStep)
        assert "logits_to_keep" in inspect.signature(model.forward).parameters
        assert model._supports_logits_to_keep()
        rows = []
        hook = model.lm_head.register_forward_hook(
            lambda m, i, o: rows.append(i[0].numel() // i[0].shape[-1]))
        try:
            ids = torch.randint(0, model.config.vocab_size, (1, 12),
                                generator=torch.Generator().manual_seed(4))
            _gen(model, ids, n=3)
        finally:
            hook.remove()
        assert rows and rows[0] == 1, rows  # the prompt's forward: its last row only
        with pytest.raises(ValueError, match="no_such_kwarg"):
            _gen(model, ids, n=2, no_such_kwarg=1)
    finally:
        eng.close()

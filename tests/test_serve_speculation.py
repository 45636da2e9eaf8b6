"""Speculative decoding inside the server's scheduler (specmoe.serve.speculate): every
request's greedy tokens equal model.generate's for it alone, with drafts verified in the
batch's one forward or on a request's own cache; the cache keeps only the accepted drafts;
faults and bad arguments."""
from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import specmoe  # noqa: E402
from specmoe.serve.scheduler import GenParams, Scheduler, serve_all  # noqa: E402
from specmoe.serve.speculate import Speculation, controller_factory  # noqa: E402
from specmoe.speculation.controllers import Cascade, StaticK  # noqa: E402
from specmoe.speculation.decoding import records_recurrent_states  # noqa: E402
from tests.conftest import IdText, greedy_alone, specmoe_cache_and_one_thread  # noqa: E402

ZOO = Path(__file__).resolve().parent.parent / "specmoe" / "zoo" / "tiny-moe"
MTP = ZOO.parent / "tiny-moe-mtp"   # the shipped MTP adapter of tiny-moe
DRAFT = ZOO.parent / "tiny-draft"   # the shipped draft model of tiny-moe
pytestmark = pytest.mark.skipif(not (ZOO / "model.safetensors").is_file(),
                                reason="the zoo model is not packaged")

# prompts whose continuations repeat (the n-gram drafter finds drafts) and one that does not
TEXTS = ["def parse(line):\n    return line\n\n\ndef parse(line):",
         "import os\nimport sys\nimport os\nimport",
         "The quick brown fox jumps over the lazy dog and the",
         "for i in range(10):\n    print(i)\nfor i in range(10):\n"]
N = 24


@pytest.fixture(scope="module")
def zoo(tmp_path_factory):
    with specmoe_cache_and_one_thread(tmp_path_factory.mktemp("specmoe-cache")):
        yield from _zoo()


def _zoo():
    from transformers import AutoTokenizer
    model = specmoe.from_pretrained(str(ZOO), cache="25%")
    tok = AutoTokenizer.from_pretrained(str(ZOO))
    prompts = [tok(t).input_ids for t in TEXTS]
    refs = []
    for ids in prompts:
        x = torch.tensor([ids])
        out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                             max_new_tokens=N, pad_token_id=tok.eos_token_id)
        refs.append(out[0, len(ids):].tolist())
    yield {"model": model, "tok": tok, "prompts": prompts, "refs": refs}
    specmoe.engine_of(model).close()


def _run(sch, prompts, max_tokens=N, stagger=0.0, **params):
    """Submit every prompt (together, or ``stagger`` seconds apart, so that later ones join
    a running batch) and wait until each finishes: the requests."""
    p = dict(max_tokens=max_tokens, temperature=0)
    p.update(params)
    reqs = serve_all(sch, prompts, GenParams(**p), timeout=120, stagger=stagger)
    assert all(r.finished == "length" for r in reqs), [(r.finished, r.error) for r in reqs]
    t0 = time.time()
    while sch.running:  # the round that emitted the last token ends (its step observed)
        assert time.time() - t0 < 10, "the scheduler did not go idle"
        time.sleep(0.005)
    return reqs


def _slow(model, s=0.004):
    """Every forward takes >= s seconds: requests submitted apart overlap on any host."""
    return model.model.layers[0].register_forward_pre_hook(lambda m, a: time.sleep(s))


def _run_joining(sch, zoo):
    """Every prompt, 0.01 s apart, each forward slowed (so later ones join a running batch):
    the requests, each checked to get model.generate's tokens alone."""
    hook = _slow(zoo["model"])
    try:
        reqs = _run(sch, zoo["prompts"], stagger=0.01)
    finally:
        hook.remove()
    for r, ref in zip(reqs, zoo["refs"]):
        assert r.generated == ref
    return reqs


@pytest.mark.parametrize("batch_decode", [True, False])
def test_ngram_drafts_keep_greedy_tokens_exact(zoo, batch_decode):
    """A fixed K = 3 (every step drafts): requests decoding together in one batched forward
    (or each on its own cache) get exactly model.generate's tokens alone, and drafts were
    proposed and accepted on the way."""
    sch = Scheduler(zoo["model"], zoo["tok"], max_batch=4, prefill_chunk=8,
                    batch_decode=batch_decode, drafter="ngram", controller="static:3")
    try:
        reqs = _run_joining(sch, zoo)
        for r in reqs:
            assert r.usage["completion_tokens_details"] == {
                "accepted_prediction_tokens": r.accepted,
                "rejected_prediction_tokens": r.proposed - r.accepted}
        st = sch.spec.stats()
        assert st["proposed"] > 0 and 0 < st["accepted"] <= st["proposed"], st
        assert sum(r.accepted for r in reqs) == st["accepted"]
        # fewer forwards than tokens: accepted drafts saved steps
        assert sum(r.steps for r in reqs) < sum(len(r.generated) + 1 for r in reqs)
        if batch_decode:
            assert sch.batched_steps > 0 and sch.peak_batch >= 2
            assert set(sch.spec.controllers) >= {2} or set(sch.spec.controllers) >= {4}
        else:
            assert sch.batched_steps == 0 and set(sch.spec.controllers) == {1}
    finally:
        sch.close()


def test_self_draft_keeps_greedy_tokens_exact(zoo):
    """MoE-SpeQ's int4 self-draft drafting on the target's cache (the batch's rows, or a
    request's own): the tokens are the target's, the drafts mostly accepted."""
    sch = Scheduler(zoo["model"], zoo["tok"], max_batch=4, prefill_chunk=8,
                    drafter="self", controller="static:2")
    try:
        reqs = _run(sch, zoo["prompts"][:3])           # a batch of 3
        reqs += _run(sch, zoo["prompts"][3:])          # one alone
        for r, ref in zip(reqs, zoo["refs"]):
            assert r.generated == ref
        st = sch.spec.stats()
        assert st["steps_with_drafts"] > 0 and st["accepted"] > st["proposed"] // 2, st
        assert sch.batched_steps > 0
    finally:
        sch.close()


@pytest.mark.parametrize("batch_decode,c_layers", [(True, False), (False, False),
                                                   (True, True), (False, True)])
def test_a_draft_model_drafts_on_a_cache_per_request(zoo, batch_decode, c_layers, monkeypatch):
    """A separate draft model (the zoo's tiny-draft, K = 3), requests joining a running
    batch: the tokens are model.generate's alone; a request decoding alone drafts on a
    draft cache of its own, the rows of a batch in one batched draft state that follows them;
    every draft, rolled back to its history, equals (but for float rounding at a near tie)
    what a fresh draft model proposes from that history alone; a finished request's draft
    cache is let go, and the drafter given stays untouched.  A request joining the batch
    brings its draft cache along (BatchDraftModel.join): no batched draft forward feeds a
    row's history again, only what the row verified since its last draft.  ``c_layers``:
    the draft's steps through specmoe's C layers, a drafted token alone one planned C call,
    its drafts those of the draft in torch (but for rounding at a near tie)."""
    from specmoe.models.decode_step import decode_step_of
    from specmoe.speculation.drafters import DraftModel
    from specmoe.zoo import load
    draft, _ = load("tiny-draft")
    given = DraftModel(draft, c_layers=c_layers)
    assert (decode_step_of(draft) is not None) == c_layers
    sch = Scheduler(zoo["model"], zoo["tok"], max_batch=4, prefill_chunk=8,
                    batch_decode=batch_decode, drafter=given, controller="static:3")
    seen, caches, batched = [], {}, []
    alone, rows = sch.spec.draft_alone, sch.spec.draft_batch

    def record(req, k):
        out = alone(req, k)
        seen.append((list(req.prompt + req.generated), k, out))
        caches.setdefault(id(req), set()).add(id(req.draft))
        return out

    def record_rows(bkv, reqs, ks):
        out = rows(bkv, reqs, ks)
        seen.extend((list(r.prompt + r.generated), k, o) for r, k, o in zip(reqs, ks, out))
        batched.append(len(reqs))
        return out
    monkeypatch.setattr(sch.spec, "draft_alone", record)
    monkeypatch.setattr(sch.spec, "draft_batch", record_rows)
    fed = []  # (rows, tokens a row) of every draft forward

    def width(m, args, kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        fed.append(tuple(ids.shape))
    hook = draft.register_forward_pre_hook(width, with_kwargs=True)
    try:
        reqs = _run_joining(sch, zoo)
        for r in reqs:
            assert r.draft is None  # let go when it finished
        st = sch.spec.stats()
        assert st["drafter"] == "model" and 0 < st["accepted"] <= st["proposed"], st
        assert sum(r.steps for r in reqs) < sum(len(r.generated) + 1 for r in reqs)
        if batch_decode:
            assert sch.batched_steps > 0 and sch.peak_batch >= 2 and max(batched) >= 2
            # a batched forward feeds each row the tokens of its last step or two (K + 1
            # each), never a history: every prompt is longer than that
            assert min(len(p) for p in zoo["prompts"]) > 2 * 4
            assert max(n for b, n in fed if b >= 2) <= 2 * 4, fed
        else:
            assert not batched and len(caches) == len(reqs)
            # one draft cache per request drafting alone, kept over its steps
            assert all(len(c) == 1 for c in caches.values())
            assert len({next(iter(c)) for c in caches.values()}) == len(caches)
    finally:
        hook.remove()
        sch.close()
    assert given._kv is None and given._seen == []
    if c_layers and not batch_decode:
        assert decode_step_of(draft).planned > 0
    fresh = DraftModel(load("tiny-draft")[0])  # (in torch)
    same = 0
    for hist, k, out in seen:
        fresh.reset()
        same += fresh.propose(hist, k) == out
    assert seen and same >= 0.9 * len(seen), (same, len(seen))


@pytest.mark.parametrize("batch_decode", [True, False])
def test_mtp_drafts_keep_greedy_tokens_exact(zoo, batch_decode):
    """The MTP drafter (the shipped adapter, K = 3): each verification forward carries the
    masks that propose the next step's drafts, row by row in the batch's forward or on a
    request's own cache; the tokens are model.generate's alone, drafts were accepted, and
    steps were saved."""
    from specmoe.speculation.mtp import GatedLoRA
    sch = Scheduler(zoo["model"], zoo["tok"], max_batch=4, prefill_chunk=8,
                    batch_decode=batch_decode, drafter="mtp", controller="static:3",
                    mtp_adapter=MTP)
    try:
        reqs = _run(sch, zoo["prompts"], stagger=0.01)
        for r, ref in zip(reqs, zoo["refs"]):
            assert r.generated == ref
        st = sch.spec.stats()
        assert st["drafter"] == "mtp" and 0 < st["accepted"] < st["proposed"], st
        assert sum(r.accepted for r in reqs) == st["accepted"]
        assert sum(r.steps for r in reqs) < sum(len(r.generated) + 1 for r in reqs)
        assert (sch.batched_steps > 0) == batch_decode
    finally:
        sch.close()
    # the adapter the scheduler installed came off with it
    assert not any(isinstance(m, GatedLoRA) for m in zoo["model"].modules())
    assert getattr(zoo["model"], "_specmoe_mtp", None) is None


def test_sampling_verifies_drafts_with_the_requests_law(zoo):
    """Sampled requests go through the speculative-sampling rule (drafts one-hot); with
    top_k=1 their law is the argmax, so the tokens must be the greedy ones: the rule, the
    cache rollback and every request's generator are exercised, the result is exact."""
    sch = Scheduler(zoo["model"], zoo["tok"], max_batch=4, prefill_chunk=8,
                    drafter="ngram", controller="static:4")
    try:
        reqs = _run(sch, zoo["prompts"], temperature=0.8, top_k=1, seed=3)
        for r, ref in zip(reqs, zoo["refs"]):
            assert r.sampling is not None and r.generated == ref
        assert sch.spec.accepted > 0
    finally:
        sch.close()


def test_cascade_runs_per_batch_bucket_and_stays_exact(zoo):
    """The default controller (Cascade with tau and the success condition): one per batch-
    size bucket, tau measured at that batch; the tokens stay exact whatever K it picks."""
    sch = Scheduler(zoo["model"], zoo["tok"], max_batch=4, prefill_chunk=8, drafter="ngram")
    try:
        reqs = _run(sch, zoo["prompts"], max_tokens=N)
        for r, ref in zip(reqs, zoo["refs"]):
            assert r.generated == ref
        assert all(isinstance(c, Cascade) for c in sch.spec.controllers.values())
        assert 4 in sch.spec.controllers
        eng = specmoe.engine_of(zoo["model"])
        assert eng.tau.table(4), "tau(g, 4) was not measured"
        assert len(sch.spec.controllers[4].telemetry()["k"]) > 0
    finally:
        sch.close()


def test_tau_is_measured_at_every_bucket_before_serving(zoo, monkeypatch):
    """warm_tau (the default): the worker measures tau at every batch-size bucket up to
    max_batch before its first round, so no request waits for a measurement; warm_tau=False
    leaves each to its bucket's first use (the controller appears only then)."""
    import specmoe.serve.speculate as sp
    calls = []
    real = sp.target_tau

    def counting(model, prompt, g_max, engine=None, **kw):
        calls.append(kw.get("batch"))
        return real(model, prompt, g_max, engine, **kw)
    monkeypatch.setattr(sp, "target_tau", counting)
    sch = Scheduler(zoo["model"], zoo["tok"], max_batch=5, prefill_chunk=8, drafter="ngram")
    try:
        sch.start()
        for _ in range(600):
            if sch.tau_warm_s is not None:
                break
            time.sleep(0.05)
        assert sorted(sch.spec.controllers) == [1, 2, 4, 8] and calls == [1, 2, 4, 8]
        assert sch.tau_warm_s is not None and sch.tau_warm_s >= 0
        reqs = _run(sch, zoo["prompts"][:2], max_tokens=N)
        assert [r.generated for r in reqs] == zoo["refs"][:2]
        assert calls == [1, 2, 4, 8]  # nothing measured while serving
    finally:
        sch.close()
    calls.clear()
    sch = Scheduler(zoo["model"], zoo["tok"], max_batch=5, prefill_chunk=8, drafter="ngram",
                    warm_tau=False)
    try:
        reqs = _run(sch, zoo["prompts"][:1], max_tokens=N)
        assert sch.tau_warm_s is None and sorted(sch.spec.controllers) == [1]
    finally:
        sch.close()
    with pytest.raises(TypeError, match="warm_tau"):
        Scheduler(zoo["model"], zoo["tok"], drafter="ngram", warm_tau="yes")


def test_health_says_loading_while_tau_is_measured(zoo, monkeypatch):
    """GET /health answers 503 {"status": "loading"} while the worker measures tau (as
    llama-server does while it loads), then 200; a request sent meanwhile waits and is
    served."""
    from starlette.testclient import TestClient
    import specmoe.serve.speculate as sp
    from specmoe.serve import app
    gate = threading.Event()
    real = sp.Speculation.warm

    def slow(self, *a, **k):
        gate.wait(30)
        return real(self, *a, **k)
    monkeypatch.setattr(sp.Speculation, "warm", slow)
    asgi = app(zoo["model"], zoo["tok"], model_name="zoo", max_batch=2, drafter="ngram")
    try:
        with TestClient(asgi) as c:
            r = c.get("/health")
            assert r.status_code == 503 and r.json()["status"] == "loading"
            box = {}
            th = threading.Thread(target=lambda: box.setdefault("r", c.post(
                "/v1/completions", json={"model": "zoo", "prompt": zoo["prompts"][0],
                                         "max_tokens": N, "temperature": 0})))
            th.start()
            time.sleep(0.2)
            assert "r" not in box          # queued behind the measurement
            gate.set()
            th.join(60)
            assert box["r"].status_code == 200
            assert box["r"].json()["choices"][0]["text"] == zoo["tok"].decode(zoo["refs"][0])
            assert c.get("/health").json()["status"] == "ok"
    finally:
        gate.set()


def test_a_fault_in_a_batched_verification_is_retried_alone(zoo):
    """A batched verification forward (several rows, several tokens each) that raises is
    pinned on no request: the rows go back to caches of their own holding only their
    verified tokens, and every request still gets model.generate's tokens."""
    model = zoo["model"]
    fired = []

    def fault(module, args, kwargs):
        hs = args[0] if args else kwargs["hidden_states"]
        if hs.shape[0] >= 2 and hs.shape[1] >= 2 and not fired and sch.batched_steps:
            fired.append(tuple(hs.shape))
            raise RuntimeError("injected fault in a batched verification")

    sch = Scheduler(model, zoo["tok"], max_batch=4, prefill_chunk=64, drafter="ngram",
                    controller="static:3")
    hook = model.model.layers[-1].register_forward_pre_hook(fault, with_kwargs=True)
    try:
        reqs = _run(sch, zoo["prompts"])
    finally:
        hook.remove()
        sch.close()
    assert fired, "no batched verification ran"
    for r, ref in zip(reqs, zoo["refs"]):
        assert r.generated == ref


def test_bad_arguments_are_named(zoo):
    m, tok = zoo["model"], zoo["tok"]
    with pytest.raises(ValueError, match="unknown drafter"):
        Scheduler(m, tok, drafter="medusa")
    with pytest.raises(ValueError, match="needs a drafter"):
        Scheduler(m, tok, controller="cascade")
    with pytest.raises(ValueError, match="static:K"):
        controller_factory("static:x")
    with pytest.raises(ValueError, match="unknown controller"):
        controller_factory("fastest")
    with pytest.raises(TypeError, match="not a"):
        Speculation(m, None, "ngram", controller=lambda: 3)
    with pytest.raises(ValueError, match="tau"):
        Speculation(m, None, "ngram", tau="sometimes")
    with pytest.raises(ValueError, match="offloaded"):
        Speculation(m, None, "self")
    from transformers import LlamaConfig, LlamaForCausalLM

    from specmoe.speculation.drafters import DraftModel
    small = LlamaForCausalLM(LlamaConfig(vocab_size=m.config.vocab_size + 7, hidden_size=32,
                                         intermediate_size=64, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2))
    with pytest.raises(ValueError, match="the draft model's vocabulary has"):
        Scheduler(m, tok, drafter=DraftModel(small))
    assert isinstance(controller_factory("static:0")(), StaticK)
    with pytest.raises(ValueError, match="needs its adapter"):
        Scheduler(m, tok, drafter="mtp")
    with pytest.raises(ValueError, match="goes with drafter='mtp'"):
        Speculation(m, None, "ngram", mtp_adapter=MTP)
    with pytest.raises(ValueError, match="needs a drafter"):
        Scheduler(m, tok, mtp_adapter=MTP)
    with pytest.raises(ValueError, match="at most 3"):  # the shipped adapter's k
        Scheduler(m, tok, drafter="mtp", controller="static:4", mtp_adapter=MTP)
    assert getattr(m, "_specmoe_mtp", None) is None   # the refused one came off again
    assert controller_factory("cascade", 3)().k_max == 3


def test_a_sliding_window_model_is_served_with_drafts_and_a_recurrent_one_refused():
    """GPT-OSS (sliding-window layers) serves with n-gram drafts past its window, each
    request's tokens model.generate's alone (tau is measured on 64 tokens, past the tiny
    config's 64-position window: the worker died there before its cache recorded its past);
    MiniMax (linear attention in a cache of its own, whose state no crop puts back) is refused
    by name, and so is Qwen3-Next where transformers records no recurrent states (< 5.25)."""
    from specmoe.models.testing import tiny_model
    model = tiny_model("gpt_oss", vocab=64)
    model.generation_config.eos_token_id = None
    eng = specmoe.offload(model, cache=0.5)
    try:
        _served_as_alone(model, [[5, 9, 11, 5, 9, 11, 5, 9, 30, 31] * 7, [7, 8, 9, 10] * 17],
                         "ngram", 128)
    finally:
        eng.close()
    with pytest.raises(ValueError, match="minimax's linear_attention layers .* cannot be "
                                         "rolled back.*--drafter none"):
        Scheduler(tiny_model("minimax"), None, drafter="ngram")
    q = tiny_model("qwen3_next")
    if not records_recurrent_states(q):
        with pytest.raises(ValueError, match="qwen3_next's linear_attention layers .* cannot "
                                             "be rolled back.*--drafter none"):
            Scheduler(q, None, drafter="ngram")


def _gated_deltanet():
    """A tiny Qwen3.5-MoE offloaded in f32 and its engine (skipped where transformers records
    no recurrent states)."""
    from specmoe.models.testing import tiny_model
    model = tiny_model("qwen3_5_moe_text", vocab=64)
    if not records_recurrent_states(model):
        pytest.skip("transformers < 5.25 records no recurrent states")
    model.generation_config.eos_token_id = None
    return model, specmoe.offload(model, dtype="f32", dense="f32", cache=0.5)


@pytest.mark.parametrize("drafter", ["ngram", "self"])
def test_a_gated_deltanet_hybrid_is_served_with_drafts(drafter):
    """Qwen3.5-MoE (gated DeltaNet): prompts prefilled alone, unrecorded, in chunks; decode
    steps batched, the batch's linear-attention rows recording their states over a
    verification's window (transformers 5.25) and each cut back to its own accepted drafts:
    every request's tokens are model.generate's alone."""
    model, eng = _gated_deltanet()
    try:
        sch = _served_as_alone(model, [[5, 9, 11, 5, 9, 11, 5, 9, 30, 31] * 3,
                                       [7, 8, 9, 10] * 5, [3, 4, 3, 4, 60, 3, 4, 3]],
                               drafter, 8)
        assert sch.batch_off_reason is None and sch.batched_steps > 0
        assert sch.batched_verifications > 0  # drafts verified in one batched forward
    finally:
        eng.close()


def test_a_hybrid_verifies_alone_where_the_plan_holds_one_verification():
    """The memory plan set aside the states one verification records, not those of
    max_batch rows: decode steps are not batched (the reason names the plan), and each
    request verifies on its own cache with model.generate's tokens."""
    import types
    model, eng = _gated_deltanet()
    try:
        eng.memory_plan = types.SimpleNamespace(record_tokens=4, budget_bytes=2 << 30)
        _served_as_alone(model, [[5, 9, 11, 5, 9, 11] * 2, [7, 8, 9, 10] * 3], "ngram", 8,
                         reason="3 drafts in each of 4 rows")
    finally:
        eng.close()


def _served_as_alone(model, prompts, drafter, chunk, reason=None):
    """Serve ``prompts`` (12 tokens each) with ``drafter`` and a static K of 3: each request's
    tokens model.generate's alone, drafts proposed; ``reason``: why decode steps are not
    batched."""
    refs = greedy_alone(model, prompts, 12)
    sch = Scheduler(model, IdText(), max_batch=4, prefill_chunk=chunk, drafter=drafter,
                    controller="static:3")
    try:
        if reason is not None:
            assert reason in sch.batch_off_reason and sch.batched_steps == 0
        reqs = _run(sch, prompts, max_tokens=12)
        assert [r.generated for r in reqs] == refs
        assert sch.spec.stats()["proposed"] > 0
        if reason is not None:
            assert sch.batched_steps == 0
    finally:
        sch.close()
    return sch


def test_cli_serves_a_draft_model(zoo, capsys, monkeypatch):
    """``specmoe serve --drafter model --draft-model DIR``: the app's scheduler drafts with
    that model (loaded once, float32), the banner names the drafter; the server is not
    started (``specmoe.serve.run`` replaced)."""
    import specmoe.serve as serve_pkg
    from specmoe.cli import main
    from specmoe.speculation.drafters import DraftModel
    got = {}

    def fake_run(asgi, host, port, **kw):
        sp = asgi.state.server.scheduler.spec
        got.update(name=sp.name, drafter=sp.drafter)
    monkeypatch.setattr(serve_pkg, "run", fake_run)
    assert main(["serve", str(ZOO), "--drafter", "model", "--draft-model", str(DRAFT),
                 "--controller", "static:3", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert got["name"] == "model" and isinstance(got["drafter"], DraftModel), got
    assert next(got["drafter"].model.parameters()).dtype == torch.float32
    assert "drafter model with static:3" in out, out


def test_cli_checks_the_controller_before_loading(capsys):
    from specmoe.cli import main
    for argv, name in ((["--drafter", "ngram", "--controller", "quick"], "--controller 'quick'"),
                       (["--controller", "static:-1"], "--controller 'static:-1'")):
        with pytest.raises(SystemExit) as exc:
            main(["serve", str(ZOO) + "-missing"] + argv)  # refused before the path is read
        err = capsys.readouterr().err
        assert exc.value.code == 1 and name in err and "Traceback" not in err, err
    for argv, name in ((["--drafter", "mtp"], "needs --mtp-adapter"),
                       (["--mtp-adapter", str(MTP)], "goes with --drafter mtp"),
                       (["--drafter", "mtp", "--mtp-adapter", str(ZOO)], "not an MTP adapter"),
                       (["--drafter", "model"], "needs --draft-model"),
                       (["--draft-model", str(DRAFT)], "goes with --drafter model"),
                       (["--drafter", "model", "--draft-model", str(MTP)], "no config.json")):
        with pytest.raises(SystemExit) as exc:
            main(["serve", str(ZOO) + "-missing"] + argv)  # refused before the path is read
        err = capsys.readouterr().err
        assert exc.value.code == 1 and name in err and "Traceback" not in err, err
    with pytest.raises(SystemExit) as exc:
        main(["serve", str(ZOO), "--drafter", "medusa"])
    assert exc.value.code == 2  # argparse: not a choice


@pytest.mark.parametrize("drafter", ["ngram", "mtp", "model"])
def test_served_with_a_drafter_through_the_openai_client(zoo, drafter):
    """``app(..., drafter="ngram")`` (or ``"mtp"`` with the shipped adapter, or the zoo's
    draft model) over HTTP:
    streamed and not, the official client gets model.generate's text; usage reports the
    drafts (OpenAI's accepted/rejected prediction tokens) and /metrics counts them."""
    openai = pytest.importorskip("openai")
    uvicorn = pytest.importorskip("uvicorn")
    httpx = pytest.importorskip("httpx")
    from specmoe.serve import app
    from tests.conftest import free_port
    tok = zoo["tok"]
    if drafter == "model":
        from specmoe.speculation.drafters import DraftModel
        from specmoe.zoo import load
        drafter = DraftModel(load("tiny-draft")[0])
    asgi = app(zoo["model"], tok, model_name="tiny", drafter=drafter, controller="static:3",
               mtp_adapter=MTP if drafter == "mtp" else None)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(asgi, host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="on"))
    th = threading.Thread(target=server.run, daemon=True)
    th.start()
    try:
        t0 = time.time()
        while not server.started:
            assert th.is_alive() and time.time() - t0 < 30, "the server did not start"
            time.sleep(0.02)
        base = f"http://127.0.0.1:{port}"
        c = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=60)
        want = tok.decode(zoo["refs"][0], skip_special_tokens=True)
        r = c.completions.create(model="tiny", prompt=TEXTS[0], max_tokens=N, temperature=0)
        assert r.choices[0].text == want
        d = r.usage.completion_tokens_details
        assert d.accepted_prediction_tokens > 0 and d.rejected_prediction_tokens >= 0
        chunks = c.completions.create(model="tiny", prompt=TEXTS[0], max_tokens=N,
                                      temperature=0, stream=True,
                                      stream_options={"include_usage": True})
        parts, usage = [], None
        for ch in chunks:
            parts += [x.text for x in ch.choices]
            usage = ch.usage or usage
        assert "".join(parts) == want
        assert usage.completion_tokens == N
        text = httpx.get(base + "/metrics").text
        acc = [float(line.split()[-1]) for line in text.splitlines()
               if line.startswith('specmoe_draft_tokens_total{outcome="accepted"}')]
        assert acc and acc[0] >= 2 * d.accepted_prediction_tokens, text[-2000:]
    finally:
        server.should_exit = True
        th.join(30)
    assert getattr(zoo["model"], "_specmoe_mtp", None) is None  # shut down: adapter off


def test_a_ttft_budget_bounds_the_drafts_at_load(zoo, monkeypatch):
    """ttft_budget: the largest K is profiled when the server is made (MoE-SpeQ's SLO
    bound) and every controller the scheduler makes stays within it; the bound is what
    ttft_k_max gives for the measured parts; a static K above it, a budget that leaves no
    draft token and a budget without a drafter are refused by name."""
    from specmoe.serve import speculate
    from specmoe.speculation.controllers import ttft_k_max
    from specmoe.speculation.tau import TtftProfile

    m, tok = zoo["model"], zoo["tok"]
    k_max = Cascade().k_max
    sch = Scheduler(m, tok, drafter="ngram", ttft_budget=60.0, warm_tau=False)
    try:
        p = sch.spec.ttft
        assert p is not None and p.budget_s == 60.0 and p.k_max == k_max
        assert set(p.t_verify) == set(range(1, k_max + 2)) and p.t_prefill > 0
        assert p.k_max == ttft_k_max(60.0, p.t_prefill, p.t_draft, p.t_verify, k_max=k_max)
    finally:
        sch.close()
    with pytest.raises(ValueError, match="even k = 0 misses the TTFT budget"):
        Scheduler(m, tok, drafter="ngram", ttft_budget=1e-6)
    # the bound's plumbing, with the profile fixed: K up to what it allows, and no further
    seen = []

    def fixed(model, history, budget_s, drafter, k_max):
        seen.append((len(history), budget_s, type(drafter).__name__, k_max))
        return TtftProfile(budget_s, bound, 0.01, {k: 0.0 for k in range(1, k_max + 1)},
                           {g: 0.01 for g in range(1, k_max + 2)})

    monkeypatch.setattr(speculate, "profile_ttft", fixed)
    bound = 2
    for ctl in ("cascade", "speq", "heuristic"):
        spec = Speculation(m, None, "ngram", controller=ctl, ttft_budget=0.5)
        assert spec.make_controller().k_max == 2 and spec.ttft.k_max == 2
        spec.close()
    assert seen[0] == (64, 0.5, "NgramDrafter", k_max)
    with pytest.raises(ValueError, match="at most 2 draft tokens"):
        Speculation(m, None, "ngram", controller="static:3", ttft_budget=0.5)
    bound = 0
    with pytest.raises(ValueError, match="leaves no room for a draft token"):
        Speculation(m, None, "ngram", ttft_budget=0.5)
    with pytest.raises(ValueError, match="needs a drafter"):
        Scheduler(m, tok, ttft_budget=1.0)
    with pytest.raises(ValueError, match="ttft_budget"):
        Speculation(m, None, "ngram", ttft_budget=0)


def test_cli_checks_the_ttft_budget_before_loading(capsys):
    from specmoe.cli import main
    for argv, name in ((["--ttft-budget", "0.5"], "--ttft-budget bounds the drafts per step"),
                       (["--drafter", "ngram", "--ttft-budget", "0"], "more than 0 seconds"),
                       (["--drafter", "ngram", "--ttft-budget", "x"], "expected a number")):
        with pytest.raises(SystemExit) as exc:
            main(["serve", str(ZOO) + "-missing"] + argv)  # refused before the path is read
        err = capsys.readouterr().err
        assert exc.value.code in (1, 2) and name in err and "Traceback" not in err, err


@pytest.mark.parametrize("drafter", [None, "ngram"])
def test_a_greedy_request_alone_decodes_in_one_c_call(zoo, drafter, monkeypatch):
    """A greedy request decoding alone (plain, or with speculation whose controller keeps
    K = 0) takes the decode plan's one C call with the logits left in C, as specmoe.generate
    does: the model's forward runs only for its prompt, the tokens are model.generate's; a
    sampled request keeps the forward (its logits are drawn from)."""
    kw = dict(drafter=drafter, controller="static:0") if drafter else {}
    sch = Scheduler(zoo["model"], zoo["tok"], max_batch=1, prefill_chunk=64, **kw)
    forwards, fast = [], []
    fwd, nxt = sch._forward, sch._greedy_next
    monkeypatch.setattr(sch, "_forward", lambda req, ids, rows=0: (
        forwards.append(len(ids)), fwd(req, ids, rows))[1])
    monkeypatch.setattr(sch, "_greedy_next", lambda req: (
        lambda t: (fast.append(t), t)[1])(nxt(req)))
    try:
        reqs = _run(sch, zoo["prompts"][:2])
        for r, ref in zip(reqs, zoo["refs"]):
            assert r.generated == ref
        # each request: one forward of its prompt, then N - 1 steps in C
        assert forwards == [len(p) for p in zoo["prompts"][:2]], forwards
        assert len(fast) == 2 * (N - 1) and None not in fast
        if drafter:
            assert sch.spec.stats()["proposed"] == 0
        forwards.clear()
        fast.clear()
        _run(sch, zoo["prompts"][:1], temperature=0.8, seed=1)
        assert len(forwards) == N and all(t is None for t in fast)
    finally:
        sch.close()


def test_draft_model_caches_follow_requests_into_and_out_of_a_batch(zoo):
    """The server's draft-model state across joins: a request that drafted alone joins the
    batch with its own draft cache, takes its row back when it decodes alone again, and joins
    once more with that fresher cache, so no batched draft forward feeds what a row's cache
    has already seen; every draft equals a fresh draft model's from the same history."""
    from types import SimpleNamespace
    from specmoe.speculation.drafters import DraftModel
    from specmoe.zoo import load
    draft, _ = load("tiny-draft")
    sch = Scheduler(zoo["model"], zoo["tok"], max_batch=4, drafter=DraftModel(draft),
                    controller="static:3")
    spec = sch.spec
    a, b = (SimpleNamespace(prompt=list(p), generated=[p[-1]], draft=None)
            for p in zoo["prompts"][:2])
    widths = []
    hook = draft.register_forward_pre_hook(
        lambda m, args, kw: widths.append(tuple(kw.get("input_ids", args[0] if args else
                                                       None).shape)), with_kwargs=True)

    def fresh(r, k=3):
        return DraftModel(draft).propose(r.prompt + r.generated, k)
    try:
        assert spec.draft_alone(a, 3) == fresh(a) and a.draft is not None
        a.generated += [5, 6]
        widths.clear()
        assert spec.draft_batch(None, [a, b], [3, 3]) == [fresh(a), fresh(b)]
        assert a.draft is None and b.draft is None      # their caches are rows now
        assert max(n for r, n in widths if r == 2) <= 2, widths
        a.generated += [7]
        assert spec.draft_alone(a, 3) == fresh(a)       # on its row, taken back
        a.generated += [8, 9, 10, 11, 12, 13]
        assert spec.draft_alone(a, 3) == fresh(a)
        widths.clear()
        assert spec.draft_batch(None, [b, a], [3, 3]) == [fresh(b), fresh(a)]
        # a's row is its fresh alone cache (a stale row would feed 7 tokens)
        assert max(n for r, n in widths if r == 2) <= 2, widths
    finally:
        hook.remove()
        sch.close()


def test_tau_times_the_plain_step_as_decoding_takes_it(zoo, monkeypatch):
    """forward_times' T(1) at batch 1 is the decode plan's one C call (greedy_next, as a
    plain greedy step runs), timed in a run of its own (a forward of more tokens in between
    would make every timed step rebuild the plan); at batch 2 it stays the forward."""
    from specmoe.models.decode_step import decode_step_of
    from specmoe.speculation.tau import forward_times
    model = zoo["model"]
    fast = decode_step_of(model)
    calls, order = [], []
    real_next, real_fwd = fast.greedy_next, fast.__call__

    def greedy_next(tok, kv):
        r = real_next(tok, kv)
        calls.append(r)
        order.append(1)
        return r
    monkeypatch.setattr(fast, "greedy_next", greedy_next)
    monkeypatch.setattr(type(fast), "__call__", lambda self, *a, **kw: (
        order.append(int(kw["input_ids"].shape[1])), real_fwd(*a, **kw))[1])
    prompt = zoo["prompts"][0] * 3
    t = forward_times(model, prompt, [1, 2, 3], repeats=3)
    assert sorted(t) == [1, 2, 3] and all(v > 0 for v in t.values())
    assert len(calls) == 1 + 3 and None not in calls     # warm-up + repeats, all in C
    first = order.index(1)
    assert set(order[first:]) == {1} and set(order[1:first]) == {2, 3}, order
    calls.clear()
    forward_times(model, prompt, [1, 2], repeats=2, batch=2)
    assert calls == []

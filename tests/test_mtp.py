"""Multi-token prediction with gated LoRA (specmoe.speculation.mtp): the input layout against cacheless
forwards of the explicit sequences, the gate's exactness on real tokens, greedy equality and the
sampling distribution through specmoe.generate, adapter files and their errors, the training
script's smoke run, and the shipped adapter."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import specmoe  # noqa: E402
import specmoe.runtime.engine  # noqa: E402,F401  (SUPPORTED)
from specmoe.speculation import mtp
from specmoe import zoo  # noqa: E402
from specmoe.speculation.controllers import Cascade, StaticK  # noqa: E402
from specmoe.speculation.decoding import forward_tokens, new_kv  # noqa: E402
from specmoe.models.testing import tiny_model  # noqa: E402

from .test_generate import chi2_critical, chi2_stat  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tiny models (conftest.py)


def _randomise(ad: mtp.MtpAdapter, seed: int, scale: float = 0.05) -> None:
    """A trained-looking adapter: B != 0 and distinct mask embeddings."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in ad._lora_modules.values():
            m.lora_b.copy_(torch.randn(m.lora_b.shape, generator=g) * scale)
        ad.mask_emb.add_(torch.randn(ad.mask_emb.shape, generator=g) * 0.5)


@pytest.fixture(scope="module")
def moe():
    model, tok = zoo.load("tiny-moe")
    ad = mtp.MtpAdapter.for_model(model, k=3, rank=8, seed=3)
    _randomise(ad, 4)
    return model, tok, ad


# ------------------------------------------------------------------------------ layout


def test_layout_positions_and_visibility():
    pos, bias = mtp.mtp_layout(3, 2, past=5)
    assert pos.tolist() == [5, 6, 7, 6, 7, 7, 8, 8, 9]
    see = (bias[0, 0] == 0).int()
    assert see.shape == (9, 14)
    assert bool(see[:, :5].all())                       # everyone sees the context
    assert see[:3, 5:8].tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]   # anchors: causal
    assert int(see[:3, 8:].sum()) == 0                  # anchors never see masks
    # mask 2 of anchor 1 (row 3 + 1*2 + 1 = 6): anchors 0..1, its group's masks 1..2
    assert see[6, 5:].tolist() == [1, 1, 0, 0, 0, 1, 1, 0, 0]
    assert see[3, 5:].tolist() == [1, 0, 0, 1, 0, 0, 0, 0, 0]


def test_mtp_forward_matches_explicit_sequences(moe):
    """Each mask group's logits equal a cacheless forward of context + anchors[:i+1] + its masks
    with plain causal attention (the layout the paper interleaves); anchors equal a plain
    forward of the anchors."""
    model, _, ad = moe
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 8000, (12,), generator=g).tolist()
    prompt, anchors = ids[:8], ids[8:]
    kv = new_kv(model)
    forward_tokens(model, prompt, kv)
    with torch.no_grad():
        lg, ml = ad.forward_mtp(model, torch.tensor([anchors]), 3, past=8, kv=kv)
    assert kv.get_seq_length() == 8 + 4 + 12
    kv2 = new_kv(model)
    forward_tokens(model, prompt, kv2)
    ref = forward_tokens(model, anchors, kv2)
    torch.testing.assert_close(lg[0], ref, rtol=0, atol=5e-5)
    emb = model.get_input_embeddings()
    for i in range(4):
        seq = prompt + anchors[:i + 1]
        n = len(seq)
        x = torch.cat([emb(torch.tensor([seq])), ad.mask_emb[:3].unsqueeze(0)], 1)
        ad.gate.index = torch.arange(n, n + 3)
        try:
            with torch.no_grad():
                want = model(inputs_embeds=x).logits[0, n:]
        finally:
            ad.gate.index = None
        torch.testing.assert_close(ml[0, i], want, rtol=0, atol=5e-5)


# ------------------------------------------------------------------------------ the gate


def test_gated_lora_leaves_real_rows_bit_identical(moe):
    """Inside one MTP forward every adapted projection's real-token rows are exactly its base
    layer's output; the masks' rows are not."""
    model, _, ad = moe
    seen = []

    def hook(mod, inp, out):
        x = inp[0]
        base = mod.base(x)
        idx = ad.gate.index
        real = torch.ones(x.shape[-2], dtype=torch.bool)
        real[idx] = False
        seen.append((torch.equal(out[..., real, :], base[..., real, :]),
                     bool((out[..., ~real, :] != base[..., ~real, :]).any())))

    hs = [m.register_forward_hook(hook) for m in ad._lora_modules.values()]
    try:
        with torch.no_grad():
            ad.forward_mtp(model, torch.tensor([[5, 6, 7, 8]]), 3)
    finally:
        for h in hs:
            h.remove()
    assert len(seen) == len(ad._lora_modules) == 16
    assert all(eq for eq, _ in seen)
    assert all(changed for _, changed in seen)


def test_dense_model_anchor_logits_bit_identical_with_adapter_on():
    """Whole model: with a dense MLP (no expert grouping across positions) the anchors' logits
    are bit-identical whether the adapter's LoRA path is trained or zero.  (In an MoE layer the
    masks share expert groups with the anchors, so there they agree to float rounding, as any
    verification forward of K+1 tokens does with a 1-token one.)"""
    draft, _ = zoo.load("tiny-draft")
    ad = mtp.MtpAdapter.for_model(draft, k=3, rank=4)
    x = torch.tensor([[11, 22, 33, 44, 55]])
    with torch.no_grad():
        off, m_off = ad.forward_mtp(draft, x, 3)
        _randomise(ad, 9)
        on, m_on = ad.forward_mtp(draft, x, 3)
    assert torch.equal(on, off)
    assert (m_on - m_off).abs().max() > 1e-3


def test_no_gate_means_the_base_model():
    model = tiny_model("mixtral", seed=2, vocab=64, layers=2, hidden=32, inter=32, experts=4)
    x = torch.tensor([[1, 2, 3, 4, 5, 6]])
    with torch.no_grad():
        before = model(x).logits
        ad = mtp.MtpAdapter.for_model(model, k=2, rank=4)
        _randomise(ad, 1)
        after = model(x).logits
        ad.uninstall()
        again = model(x).logits
    assert torch.equal(before, after) and torch.equal(before, again)
    assert not any(isinstance(m, mtp.GatedLoRA) for m in model.modules())


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "olmoe"])
def test_masks_through_fused_attention_blocks_apply_the_adapter(arch, tmp_path):
    """specmoe's C attention blocks (convert_dense fuses them) are built from the base
    projections: an MTP forward's masks must go around them to the module's own forward, whose
    wrapped projections apply the LoRA.  Against the transformers model (f32) with the same
    adapter, at sizes the blocks take (2 and 4 anchors, 3 masks each: 8 and 16 tokens), after
    a context in the cache."""
    import copy

    from specmoe.models.dense import convert_dense
    ref = tiny_model(arch)
    fused = copy.deepcopy(ref)
    rep = convert_dense(fused, "f32")
    assert rep.fused, f"no attention block fused in the {arch} model: nothing tested"
    ad = mtp.MtpAdapter.for_model(ref, k=3, rank=4, seed=2)
    _randomise(ad, 3, scale=0.5)
    ad.save(tmp_path / "ad")
    ad2 = mtp.MtpAdapter.load(tmp_path / "ad", fused)
    ctx = torch.tensor([[3, 17, 9, 4, 22, 8]])
    for A in (2, 4):
        anchors = torch.tensor([[5, 11, 2, 30][:A]])
        out = []
        for model, a in ((ref, ad), (fused, ad2)):
            kv = new_kv(model)
            with torch.no_grad():
                forward_tokens(model, ctx[0].tolist(), kv)
                out.append(a.forward_mtp(model, anchors, 3, past=ctx.shape[1], kv=kv))
        (lg_r, ml_r), (lg_f, ml_f) = out
        torch.testing.assert_close(lg_f, lg_r, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(ml_f, ml_r, atol=1e-4, rtol=1e-4)


# ------------------------------------------------------------------------------ generate


@pytest.mark.parametrize("where", ["torch", "offloaded"])
def test_greedy_output_equals_plain_greedy(where):
    model, tok = zoo.load("tiny-moe", experts_implementation="eager")
    eng = specmoe.offload(model, cache=0.25, dtype="f32") if where == "offloaded" else None
    try:
        ad = mtp.MtpAdapter.for_model(model, k=3, rank=8, seed=5)
        _randomise(ad, 6, scale=0.02)
        ids = tok("import os\nimport sys\n\ndef main(argv):\n    for name in argv:\n",
                  return_tensors="pt").input_ids
        ref = model.generate(ids, do_sample=False, max_new_tokens=20, min_new_tokens=20)
        dr = mtp.MtpDrafter(model, ad)
        for ctl in (StaticK(3), StaticK(1), Cascade(k_max=3, trial_len=2, set_len=4,
                                                    base_len=2)):
            out = specmoe.generate(model, ids, drafter=dr, controller=ctl, max_new_tokens=20,
                                   eos_token_id=None)
            assert out.sequences[0].tolist() == ref[0].tolist(), type(ctl).__name__
            assert out.stats["new_tokens"] == 20
        out = specmoe.generate(model, ids, drafter=dr, controller=StaticK(3), max_new_tokens=20,
                               eos_token_id=None)
        assert out.stats["proposed"] > 0
        assert out.iterations[0]["k"] == 0   # no masks have run before the first step
        assert all(it["k"] > 0 for it in out.iterations[1:-1])
        if eng is not None:
            assert out.stats["experts_loaded"] > 0
    finally:
        if eng is not None:
            eng.close()


def test_priming_steps_are_not_observed(moe):
    """A step that planned drafts with none to verify (the first, and the first after a plain
    step) only primes the MTP drafter: its masks make the next drafts.  The controller does not
    see it (it is neither a plain step's time nor a trial of its K); every other step it sees,
    at batch 1 and in a batch."""
    model, tok, ad = moe
    ids = tok("import os\nimport sys\n", return_tensors="pt").input_ids
    dr = mtp.MtpDrafter(model, ad)
    for batch in (1, 2):
        ctl = StaticK(2, telemetry_cap=64)
        x = ids.repeat(batch, 1)
        out = specmoe.generate(model, x, attention_mask=torch.ones_like(x), drafter=dr,
                               controller=ctl, max_new_tokens=12, eos_token_id=None, tau=None)
        its = out.iterations
        assert its[0]["priming"] and its[0]["k"] == 0
        assert not any(it["priming"] for it in its[1:])
        assert len(ctl.telemetry()["k"]) == len(its) - 1, batch


V_SMALL = 5
T_SAMPLE = 1.3


@pytest.fixture(scope="module")
def small_mtp():
    target = tiny_model("mixtral", seed=0, vocab=V_SMALL, layers=2, hidden=32, inter=32,
                        experts=4)
    ad = mtp.MtpAdapter.for_model(target, k=2, rank=4, seed=1)
    _randomise(ad, 2, scale=0.5)
    return target, mtp.MtpDrafter(target, ad)


def exact_joint3(target, prompt):
    """p(t1, t2, t3 | prompt) of the target at T_SAMPLE by cacheless forwards."""
    V = V_SMALL

    def probs(seq):
        with torch.no_grad():
            lg = target(torch.tensor([seq])).logits[0, -1].float()
        return torch.softmax(lg / T_SAMPLE, -1).numpy().astype(np.float64)

    joint = np.zeros((V, V, V))
    p1 = probs(prompt)
    for a in range(V):
        p2 = probs(prompt + [a])
        for b in range(V):
            joint[a, b] = p1[a] * p2[b] * probs(prompt + [a, b])
    return joint


@pytest.mark.slow  # 16 s of sampling runs: make test-slow (greedy equality stays in make test)
def test_sampling_follows_target_distribution(small_mtp):
    """Three sampled tokens: the first from a plain step (no drafts yet), the last two from
    one verification of the masks' sampled draft; their joint law must be the target's."""
    target, dr = small_mtp
    V, T = V_SMALL, T_SAMPLE
    prompt = [3, 1, 4, 1, 3]
    joint = exact_joint3(target, prompt)
    n = 1000  # (1500 until make test neared its 15 minutes; cells under 5 are pooled)
    counts = np.zeros((V, V, V))
    accepted = proposed = 0
    for s in range(n):
        out = specmoe.generate(target, prompt, dr, StaticK(2), max_new_tokens=3, do_sample=True,
                               temperature=T, seed=s, tau=None, eos_token_id=None)
        a, b, c = out.sequences[0, len(prompt):].tolist()
        counts[a, b, c] += 1
        accepted += out.stats["accepted"]
        proposed += out.stats["proposed"]
    assert 0 < accepted < proposed
    stat, df = chi2_stat(counts.ravel(), n * joint.ravel())
    assert stat < chi2_critical(df), (stat, df)


def test_batched_sampling_follows_target_distribution(small_mtp):
    """The batch path: 2n rows of two prompts of different lengths (left-padded) in one
    batch; each prompt's three tokens must follow its exact joint."""
    target, dr = small_mtp
    V = V_SMALL
    prompts = [[3, 1, 4, 1, 3], [2, 0, 3]]
    n = 1200
    L = max(map(len, prompts))
    ids = torch.tensor([[0] * (L - len(p)) + p for p in prompts] * n)
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts] * n)
    out = specmoe.generate(target, ids, dr, StaticK(2), attention_mask=mask, max_new_tokens=3,
                           do_sample=True, temperature=T_SAMPLE, seed=5, tau=None,
                           eos_token_id=None)
    assert 0 < out.stats["accepted"] < out.stats["proposed"]
    got = out.sequences[:, L:].numpy()
    for j, p in enumerate(prompts):
        counts = np.zeros((V, V, V))
        for a, b, c in got[j::2]:
            counts[a, b, c] += 1
        stat, df = chi2_stat(counts.ravel(), n * exact_joint3(target, p).ravel())
        assert stat < chi2_critical(df), (j, stat, df)


# ------------------------------------------------------------------------------ files, errors


def test_save_load_round_trip(tmp_path, moe):
    model, _, ad = moe
    ad.save(tmp_path / "a")
    x = torch.tensor([[7, 8, 9]])
    with torch.no_grad():
        want = ad.forward_mtp(model, x, 3)[1]
    ad.uninstall()
    try:
        ad2 = mtp.MtpAdapter.load(tmp_path / "a", model)
        with torch.no_grad():
            got = ad2.forward_mtp(model, x, 3)[1]
        assert torch.equal(got, want)
        assert json.loads((tmp_path / "a" / mtp.CONFIG_FILE).read_text())["k"] == 3
        ad2.uninstall()
    finally:
        ad.install(model)


def test_bad_input(tmp_path, moe):
    model, tok, ad = moe
    with pytest.raises(FileNotFoundError, match="mtp_config.json"):
        mtp.MtpAdapter.load(tmp_path)
    ad.save(tmp_path / "ok")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / mtp.CONFIG_FILE).write_text((tmp_path / "ok" / mtp.CONFIG_FILE).read_text())
    (bad / mtp.ADAPTER_FILE).write_bytes(b"\x00" * 40)
    with pytest.raises(ValueError, match="cannot read"):
        mtp.MtpAdapter.load(bad)
    (bad / mtp.CONFIG_FILE).write_text("{\"k\": 0}")
    with pytest.raises(ValueError, match="k must be"):
        mtp.MtpAdapter.load(bad)
    draft, _ = zoo.load("tiny-draft")
    with pytest.raises(ValueError, match="trained for"):
        mtp.MtpAdapter.load(tmp_path / "ok", draft)
    assert not any(isinstance(m, mtp.GatedLoRA) for m in draft.modules())
    with pytest.raises(ValueError, match="installed on another model"):
        ad.install(zoo.load("tiny-moe")[0])
    with pytest.raises(ValueError, match="n_masks"):
        ad.forward_mtp(model, torch.tensor([[1, 2]]), 4)
    dr = mtp.MtpDrafter(model, ad)
    ids = torch.tensor([5, 6, 7])
    with pytest.raises(ValueError, match="k_max"):
        specmoe.generate(model, ids, drafter=dr, controller=StaticK(4), max_new_tokens=4)
    with pytest.raises(TypeError):
        mtp.MtpDrafter("not a model", ad)


# ------------------------------------------------------------------------------ training


@pytest.mark.slow  # make test-slow (Makefile)
def test_training_smoke(tmp_path):
    out = tmp_path / "mtp"
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    r = subprocess.run([sys.executable, str(REPO / "training" / "mtp.py"), "--smoke", "--out",
                        str(out), "--threads", "1"], cwd=REPO, env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for f in (mtp.CONFIG_FILE, mtp.ADAPTER_FILE, "MODEL_CARD.md", "metrics.json", "loss.png"):
        assert (out / f).is_file(), f
    m = json.loads((out / "metrics.json").read_text())
    assert m["steps_done"] == 3 and len(m["history"]["loss"]) == 3
    assert all(math.isfinite(v) for v in m["history"]["loss"])
    for r_ in m["acceptance"].values():
        assert r_["output_equals_plain_greedy"] is True
    model, _ = zoo.load("tiny-moe")
    mtp.MtpAdapter.load(out, model)


SHIPPED = zoo.root() / "tiny-moe-mtp"


@pytest.mark.skipif(not (SHIPPED / mtp.ADAPTER_FILE).is_file(),
                    reason="no shipped MTP adapter (training/mtp.py writes it)")
def test_shipped_adapter_card_matches_its_metrics():
    m = json.loads((SHIPPED / "metrics.json").read_text())
    card = (SHIPPED / "MODEL_CARD.md").read_text()
    for r in m["acceptance"].values():
        assert r["output_equals_plain_greedy"] is True
        assert f"{r['acceptance_rate']:.1%}" in card
        assert f"{r['tokens_per_target_forward']:.2f}" in card
    model, tok = zoo.load("tiny-moe")
    dr = mtp.MtpDrafter(model, SHIPPED)
    ids = tok("def read(path):\n    with open(path) as f:\n        return f.",
              return_tensors="pt").input_ids
    out = specmoe.generate(model, ids, drafter=dr, controller=StaticK(dr.k), max_new_tokens=24,
                           eos_token_id=None)
    plain = specmoe.generate(model, ids, max_new_tokens=24, eos_token_id=None)
    assert out.sequences.tolist() == plain.sequences.tolist()
    assert out.stats["accepted"] > 0


def test_tau_counts_the_masks(moe):
    """gamma-tolerance with MTP: verifying g anchors runs g(k+1) positions."""
    model, _, ad = moe
    dr = mtp.MtpDrafter(model, ad)
    table = {g: 1.0 / g for g in range(1, 17)}
    assert dr.tau_tokens(4) == 16
    assert dr.tau(table, 4) == {1: 1.0, 2: 1 / 8, 3: 1 / 12, 4: 1 / 16}
    with pytest.raises(ValueError, match="stops at g = 16"):
        dr.tau(table, 5)



def test_generate_prunes_with_the_mtp_tau(moe, monkeypatch):
    """tau="auto" asks for (k_max+1)(k+1) tokens and hands the remapped table to the
    controller: with T(g) ~ sqrt(g) every K pays for a plain drafter ((K+1)/sqrt(K+1) > 1) and
    none for MTP ((K+1)/sqrt(4(K+1)) <= 1 for K <= 3)."""
    from specmoe.speculation import generation
    model, _, ad = moe
    asked = []

    def fake_tau(model_, prompt, g_max, engine=None, *a, **kw):
        asked.append(g_max)
        return {g: g ** -0.5 for g in range(1, g_max + 1)}

    monkeypatch.setattr(generation, "target_tau", fake_tau)
    ids = torch.tensor([5, 6, 7, 8, 9, 10])
    ctl = Cascade(k_max=3)
    specmoe.generate(model, ids, drafter=mtp.MtpDrafter(model, ad), controller=ctl,
                     max_new_tokens=4, eos_token_id=None, success=False)
    assert asked == [16] and ctl.allowed == [0]
    ctl2 = Cascade(k_max=3)
    specmoe.generate(model, ids, drafter=specmoe.NgramDrafter(), controller=ctl2,
                     max_new_tokens=4, eos_token_id=None, success=False)
    assert asked == [16, 4] and ctl2.allowed == [0, 1, 2, 3]


@pytest.mark.parametrize("arch", sorted(specmoe.runtime.engine.SUPPORTED))
def test_every_architecture_greedy_equal(arch):
    """The adapter installs on every supported MoE architecture's attention projections, and
    greedy MTP speculation on the offloaded tiny model equals transformers' greedy decoding
    (linear attention and Mamba layers: no rollback; sparse-attention indexers: refused, see
    test_generate)."""
    from specmoe.speculation.decoding import unrollable_layer_types
    model = tiny_model(arch, vocab=64)
    if unrollable_layer_types(model.config):
        pytest.skip("linear attention / Mamba cannot be rolled back (generate refuses them)")
    if getattr(model.config, "index_topk", None) is not None:
        pytest.skip("sparse-attention indexer: generate refuses it (test_generate)")
    eng = specmoe.offload(model, cache=0.5)
    try:
        ad = mtp.MtpAdapter.for_model(model, k=2, rank=4, seed=1)
        _randomise(ad, 2)
        # q, k, v and o of every attention layer (LFM2: q, k, v of its one attention layer
        # of three, whose output projection is out_proj; its short convolutions have none);
        # MLA: q (or q_a and q_b), kv_a and o
        attn = [lay for lay in model.model.layers if hasattr(lay, "self_attn")]
        mla = hasattr(attn[0].self_attn, "kv_a_proj_with_mqa")
        per = 3 if arch == "lfm2_moe" or (mla and model.config.q_lora_rank is None) else 4
        assert len(ad._lora_modules) == per * len(attn) > 0
        ids = torch.tensor([[5, 9, 11, 5, 9, 11, 5, 9, 30, 31, 5, 9]])
        # the end-of-sequence token an ordinary one on both sides (min_new_tokens would forbid
        # it in the reference: a model whose greedy pick is EOS would then differ)
        eos, model.generation_config.eos_token_id = model.generation_config.eos_token_id, None
        try:
            ref = model.generate(ids, do_sample=False, max_new_tokens=12)
        finally:
            model.generation_config.eos_token_id = eos
        out = specmoe.generate(model, ids, mtp.MtpDrafter(model, ad), StaticK(2),
                               max_new_tokens=12, eos_token_id=None, tau=None)
        assert out.sequences[0].tolist() == ref[0].tolist()
        assert out.stats["proposed"] > 0
    finally:
        eng.close()


def test_masks_load_no_experts_by_default():
    """Offloaded: the masks are draft tokens (Engine.draft_tokens), so MTP loads fewer experts
    than with fetch_masks=True; the output is plain greedy's either way."""
    model, tok = zoo.load("tiny-moe", experts_implementation="eager")
    eng = specmoe.offload(model, cache=0.25, dtype="f32")
    try:
        ad = mtp.MtpAdapter.load(zoo.root() / "tiny-moe-mtp", model) if (
            zoo.root() / "tiny-moe-mtp" / mtp.ADAPTER_FILE).is_file() else \
            mtp.MtpAdapter.for_model(model, k=3, rank=8, seed=5)
        ids = tok("def parse(line):\n    fields = line.split(',')\n", return_tensors="pt").input_ids
        plain = specmoe.generate(model, ids, max_new_tokens=16, eos_token_id=None)
        loads = {}
        for fetch in (True, False):
            eng.set_cache(0.25)
            dr = mtp.MtpDrafter(model, ad, fetch_masks=fetch)
            eng.reset_stats()
            out = specmoe.generate(model, ids, drafter=dr, controller=StaticK(3),
                                   max_new_tokens=16, eos_token_id=None, tau=None)
            assert out.sequences.tolist() == plain.sequences.tolist()
            loads[fetch] = out.stats["experts_loaded"]
            assert (eng.stats()["draft_kept"] > 0) == (not fetch)
        assert loads[False] < loads[True]
        with pytest.raises(TypeError, match="fetch_masks"):
            mtp.MtpDrafter(model, ad, fetch_masks="no")
    finally:
        eng.close()


def test_engine_draft_tokens_errors():
    model = tiny_model("mixtral", seed=3, vocab=64, layers=2, hidden=32, inter=32, experts=4)
    eng = specmoe.offload(model, cache=0.5)
    try:
        with eng.draft_tokens([0, 1, 1]):
            with pytest.raises(RuntimeError, match="already inside"):
                with eng.draft_tokens([1]):
                    pass
            with pytest.raises(ValueError, match="3 flags"):
                with torch.no_grad():
                    model(torch.tensor([[1, 2, 3, 4, 5]]))
        with torch.no_grad():  # the block's end restores plain layer calls
            model(torch.tensor([[1, 2, 3, 4, 5]]))
    finally:
        eng.close()


def test_offloaded_moe_anchor_logits_bit_identical_with_adapter_on():
    """On an offloaded MoE the masks are draft tokens whose pairs run in expert calls of their
    own (csrc/layer.h), so the real tokens' logits are bit-identical whether the adapter's LoRA
    path is trained or zero -- the issue's exactness test at the whole-model level.  (With
    fetch_masks=True masks share expert groups with the anchors: equal to rounding only.)"""
    model, _ = zoo.load("tiny-moe", experts_implementation="eager")
    eng = specmoe.offload(model, cache=0.25, dtype="f32")
    try:
        ad = mtp.MtpAdapter.for_model(model, k=3, rank=8, seed=1)
        ids = torch.randint(1, 8000, (12,), generator=torch.Generator().manual_seed(0)).tolist()
        res = []
        for scale in (0.05, 0.0):
            g = torch.Generator().manual_seed(3)
            with torch.no_grad():
                for m in ad._lora_modules.values():
                    m.lora_b.copy_(torch.randn(m.lora_b.shape, generator=g) * scale)
            eng.set_cache(0.25)
            kv = new_kv(model)
            forward_tokens(model, ids[:8], kv)
            with torch.no_grad():
                res.append(ad.forward_mtp(model, torch.tensor([ids[8:]]), 3, past=8, kv=kv,
                                          fetch_masks=False))
        assert torch.equal(res[0][0], res[1][0])
        assert (res[0][1] - res[1][1]).abs().max() > 1e-2
    finally:
        eng.close()

"""specmoe.generate on batches: B left-padded sequences advancing by different amounts.

References: transformers' own batched greedy ``model.generate`` (per-sequence outputs must be
identical), the exact target distribution computed by full forwards (sampled outputs must follow
it, chi-square test per prompt), and single-sequence forwards without a cache (the holed batch
KV cache must give the same logits).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch

torch.set_num_threads(1)

import specmoe  # noqa: E402
from specmoe import zoo  # noqa: E402
from specmoe.models.testing import tiny_model  # noqa: E402
from specmoe.speculation.controllers import Cascade, Heuristic, SpeqGovernor, StaticK  # noqa: E402
from specmoe.speculation.drafters import DraftModel, NgramDrafter, SelfDraft  # noqa: E402
from specmoe.speculation.generation import generate  # noqa: E402
from specmoe.speculation.tau import measure_tau_grid  # noqa: E402
from specmoe.speculation.batch import BatchKV, per_position_acceptance  # noqa: E402
from specmoe.speculation.decoding import cache_kwargs, new_kv  # noqa: E402
from specmoe.speculation.mtp import MtpAdapter, MtpDrafter  # noqa: E402

from tests.test_generate import RandomDrafter, chi2_critical, chi2_stat, exact_joint  # noqa: E402

TEXTS = ["import os\nimport sys\n\n\ndef main(argv):\n    for name in argv:\n",
         "def f(x):\n    return x",
         "The quick brown fox jumps over the lazy dog and the",
         "for i in range(10):\n    print(i)\n    if i"]


@pytest.fixture(scope="module")
def batch_pair():
    model, tok = zoo.load("tiny-moe", experts_implementation="eager")
    draft, _ = zoo.load("tiny-draft")
    eng = specmoe.offload(model, cache=0.25, dtype="f32")
    tok.padding_side = "left"
    enc = tok(TEXTS, return_tensors="pt", padding=True)
    assert len(set(enc.attention_mask.sum(1).tolist())) == len(TEXTS)  # lengths all differ
    yield model, draft, eng, enc.input_ids, enc.attention_mask
    eng.close()


def hf_batch_greedy(model, ids, mask, n, **kw):
    out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n, **kw)
    return out


N_NEW = 20


# the MTP case runs the longest (24 s): make test-slow
@pytest.mark.parametrize("drafter_name", ["ngram", "draft", "self", "random",
                                          pytest.param("mtp", marks=pytest.mark.slow)])
def test_batched_greedy_equals_transformers_batched_greedy(batch_pair, drafter_name):
    model, draft, eng, ids, mask = batch_pair
    ref = hf_batch_greedy(model, ids, mask, N_NEW, min_new_tokens=N_NEW)[:, ids.shape[1]:]
    adapter = None
    if drafter_name == "mtp":  # an untrained-but-nonzero adapter: few drafts accepted
        adapter = MtpAdapter.for_model(model, k=5, rank=4, seed=2)
        with torch.no_grad():
            for m in adapter.trainable()[1:]:
                m.add_(torch.randn(m.shape, generator=torch.Generator().manual_seed(3)) * 0.01)
    make = {"ngram": NgramDrafter, "draft": lambda: DraftModel(draft),
            "self": lambda: SelfDraft(eng),
            "random": lambda: RandomDrafter(model.config.vocab_size),
            "mtp": lambda: MtpDrafter(model, adapter)}[drafter_name]
    try:
        _batched_greedy_rows(model, ids, mask, ref, make, drafter_name)
    finally:
        if adapter is not None:
            adapter.uninstall()


def test_the_batched_prompt_forward_runs_lm_head_on_one_column(batch_pair):
    """A batch's prompt forward reads no logits: lm_head runs on its last column alone
    (B rows, logits_to_keep=1), not on every padded position; the tokens stay transformers'."""
    model, draft, eng, ids, mask = batch_pair
    rows = []
    hook = model.lm_head.register_forward_hook(
        lambda m, i, o: rows.append(i[0].numel() // i[0].shape[-1]))
    try:
        out = generate(model, ids, NgramDrafter(), StaticK(2), attention_mask=mask,
                       max_new_tokens=4, eos_token_id=None)
    finally:
        hook.remove()
    ref = hf_batch_greedy(model, ids, mask, 4, min_new_tokens=4)
    assert torch.equal(out.sequences[:, :ref.shape[1]], ref)
    B = ids.shape[0]
    assert ids.shape[1] > 2 and rows[0] == B, rows  # the prompt: one column of B rows
    assert max(rows[1:]) <= B * 3  # steps: the pending token and <= 2 drafts a row


def _batched_greedy_rows(model, ids, mask, ref, make, drafter_name):
    ctls = {"static3": StaticK(3), "cascade": Cascade(k_max=4, trial_len=2, set_len=4,
                                                      base_len=2),
            "heuristic": Heuristic(initial=2, k_max=5), "speq": SpeqGovernor(k_max=4)}
    for name, ctl in ctls.items():
        out = generate(model, ids, make(), ctl, attention_mask=mask, max_new_tokens=N_NEW,
                       eos_token_id=None)
        assert torch.equal(out.sequences[:, :ids.shape[1]], ids)
        got = out.sequences[:, ids.shape[1]:]
        assert torch.equal(got, ref), f"{drafter_name}/{name}"
        st = out.stats
        assert st["new_tokens"] == N_NEW * len(TEXTS) == sum(i["emitted"]
                                                             for i in out.iterations)
        for it in out.iterations:
            assert it["batch"] == len(it["k_rows"]) == len(it["accepted_rows"])
            assert it["k"] == max(it["k_rows"]) <= max(it["k_planned"], 0)
            assert all(0 <= a <= k for a, k in zip(it["accepted_rows"], it["k_rows"]))
        if drafter_name == "mtp":  # drafts come from the masks of the step before
            assert out.iterations[0]["k"] == 0
            if name == "static3":  # (adaptive controllers may prune every K on timing)
                assert st["proposed"] > 0
        if drafter_name == "self" and name == "static3":
            # sequences advanced by different amounts in one step at least once
            assert any(len(set(i["accepted_rows"])) > 1 for i in out.iterations)
        tel = ctl.telemetry()  # every step but an MTP drafter's priming ones (no drafts yet)
        seen = [i["k"] for i in out.iterations if not i["priming"]]
        assert tel["k"].tolist()[-len(seen):] == seen
        for i in out.iterations:  # priming: an MTP step that planned drafts and had none
            assert i["priming"] == (drafter_name == "mtp" and i["k"] == 0
                                    and i["k_planned"] > 0 and i is not out.iterations[-1])


def test_plain_batched_decoding_and_uneven_max_new(batch_pair):
    model, _, eng, ids, mask = batch_pair
    ref = hf_batch_greedy(model, ids, mask, 9, min_new_tokens=9)[:, ids.shape[1]:]
    out = generate(model, ids, attention_mask=mask, max_new_tokens=9, eos_token_id=None)
    assert torch.equal(out.sequences[:, ids.shape[1]:], ref)
    assert out.stats["iterations"] == 9 and out.stats["proposed"] == 0
    assert out.stats["experts_loaded"] >= 0
    # batch size 1 given as [1, n] with padding takes the single-sequence path
    one = generate(model, ids[1:2], attention_mask=mask[1:2], max_new_tokens=4,
                   eos_token_id=None)
    assert one.sequences[0, int(mask[1].sum()):].tolist() == ref[1, :4].tolist()


def test_per_sequence_eos(batch_pair):
    model, draft, eng, ids, mask = batch_pair
    ref = hf_batch_greedy(model, ids, mask, 16, min_new_tokens=16)[:, ids.shape[1]:]
    stop = int(ref[2, 3])  # row 2 stops after 4 tokens; others stop wherever stop appears
    pad = 7
    hf = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=16,
                        eos_token_id=[stop], pad_token_id=pad)
    for d in (DraftModel(draft), NgramDrafter()):
        out = generate(model, ids, d, StaticK(3), attention_mask=mask, max_new_tokens=16,
                       eos_token_id=[stop], pad_token_id=pad)
        assert torch.equal(out.sequences, hf)
        lens = out.stats["new_tokens_per_row"]
        assert lens[2] == 4 and max(lens) <= 16
        # finished rows leave the batch
        assert out.iterations[-1]["batch"] < len(TEXTS) or min(lens) == max(lens)


class TakeTurnsDrafter:
    """Per row, alternately the true greedy continuation (all K accepted) and random tokens
    (all rejected), rows out of phase: every step leaves holes in some rows but not others."""

    def __init__(self, prompts, ref, vocab):
        self.prompts, self.ref = prompts, ref
        self.calls = [0] * len(prompts)
        self.rng = np.random.default_rng(5)
        self.vocab = vocab

    def propose(self, history, k):
        b = next(i for i, p in enumerate(self.prompts) if history[:len(p)] == p)
        self.calls[b] += 1
        if (self.calls[b] + b) % 2:
            done = len(history) - len(self.prompts[b])
            return self.ref[b][done:done + k]
        return self.rng.integers(0, self.vocab, size=k).tolist()


def test_holes_are_compacted_and_output_unchanged(batch_pair):
    """Rows accept different amounts in turn, so holes pile up in different columns of each
    row and the cache is compacted (rows gathered right-aligned); the output stays equal."""
    model, _, eng, ids, mask = batch_pair
    n = 60
    ref = hf_batch_greedy(model, ids, mask, n, min_new_tokens=n)[:, ids.shape[1]:]
    prompts = [ids[b][mask[b] == 1].tolist() for b in range(len(TEXTS))]
    d = TakeTurnsDrafter(prompts, ref.tolist(), model.config.vocab_size)
    out = generate(model, ids, d, StaticK(6, k_max=6), attention_mask=mask, max_new_tokens=n,
                   eos_token_id=None, tau=None)
    assert out.stats["kv_compactions"] >= 1
    assert torch.equal(out.sequences[:, ids.shape[1]:], ref)


def test_batch_kv_matches_cacheless_forward():
    """BatchKV with holes (keep), uneven appends, compaction and row selection gives each row
    the logits of a plain forward over its real tokens alone."""
    torch.manual_seed(0)
    model = tiny_model("mixtral", seed=3, vocab=50, layers=2, hidden=32, inter=32, experts=4)
    rng = np.random.default_rng(0)
    rows = [rng.integers(0, 50, size=n).tolist() for n in (3, 7, 5)]
    L = max(map(len, rows))
    ids = torch.tensor([[0] * (L - len(r)) + r for r in rows])
    mask = torch.tensor([[0] * (L - len(r)) + [1] * len(r) for r in rows])
    st = BatchKV(model, 3)
    st.prefill(ids, mask)
    seqs = [list(r) for r in rows]

    def ref_last(seq):
        with torch.no_grad():
            return model(torch.tensor([seq])).logits[0]

    for step in range(12):
        new = [rng.integers(0, 50, size=int(rng.integers(1, 4))).tolist() for _ in seqs]
        lg = st.forward(new)
        for b, (s, t) in enumerate(zip(seqs, new)):
            want = ref_last(s + t)[-len(t):]
            torch.testing.assert_close(lg[b, :len(t)], want, rtol=1e-4, atol=1e-4)
            keep = int(rng.integers(1, len(t) + 1))  # reject the rest: holes
            st.keep(b, len(s) + keep)
            seqs[b] = s + t[:keep]
        st.trim()
        if step == 5:
            st.compact()
        if step == 8:
            st.select([2, 0])
            seqs = [seqs[2], seqs[0]]
        assert st.npos == [len(s) for s in seqs]
        assert st.mask.sum(1).tolist() == [len(s) for s in seqs]
    assert st.compactions >= 1


class _LayerRows:
    """Stands in for a module's AttnBlock and records the rows (kbuf's batch) of each one-call
    layer."""

    def __init__(self, blk, rows):
        self.blk, self.rows = blk, rows

    def __getattr__(self, name):
        return getattr(self.blk, name)

    def layer(self, *a):
        self.rows.append(a[6].shape[0])
        return self.blk.layer(*a)


@pytest.mark.parametrize("arch,dense", [("mixtral", "auto"), ("deepseek_v2", "auto"),
                                        ("qwen3_moe", "auto"), ("mixtral", "f32"),
                                        ("qwen3_moe", "f32")])
def test_batch_kv_join_and_row(arch, dense):
    """Sequences prefilled and decoded alone (an offloaded model: specmoe's own batch-1 decode
    step and buffered cache), joined into a running BatchKV one at a time, shorter and longer
    than its rows: every batched step gives each row the logits of a plain forward over its
    tokens alone; a row copied out (row) decodes alone as if it had never been batched.  With
    the dense layers in C (f32) the batched steps are one C call per layer for every row."""
    model = tiny_model(arch, seed=5, vocab=60, layers=2)
    if arch == "deepseek_v2":
        # transformers' MLA expands keys for every head; at batch > 1 its sdpa path needs
        # num_key_value_heads == num_attention_heads, as DeepSeek-V2(-Lite)'s own config has
        from transformers import AutoModelForCausalLM
        cfg = model.config
        cfg.num_key_value_heads = cfg.num_attention_heads
        torch.manual_seed(5)
        model = AutoModelForCausalLM.from_config(cfg, experts_implementation="eager").eval()
    eng = specmoe.offload(model, cache=1.0, dtype="f32", dense=dense)
    rows: list = []
    for mod in model.modules():
        if getattr(mod, "_specmoe_block", None) is not None:
            mod._specmoe_block = _LayerRows(mod._specmoe_block, rows)
    try:
        rng = np.random.default_rng(1)

        def ref_last(seq):
            with torch.no_grad():
                return model(torch.tensor([seq]), use_cache=False).logits[0, -1]

        def alone(seq, kv):
            """Feed seq's tokens beyond kv's length at batch 1; the last logits."""
            S = kv.get_seq_length()
            x = torch.tensor([seq[S:]])
            with torch.no_grad():
                out = model(input_ids=x, attention_mask=torch.ones((1, len(seq)),
                                                                   dtype=torch.long),
                            use_cache=True, logits_to_keep=1, **cache_kwargs(model, kv))
            return out.logits[0, -1]

        st = BatchKV(model, 0)
        seqs = []
        for n_prompt, n_alone in ((9, 2), (3, 0), (20, 4)):
            seq = rng.integers(3, 60, size=n_prompt).tolist()
            kv = new_kv(model)
            alone(seq, kv)
            for _ in range(n_alone):
                seq = seq + [int(rng.integers(3, 60))]
                torch.testing.assert_close(alone(seq, kv), ref_last(seq), rtol=1e-4, atol=1e-4)
            st.join(kv)
            seqs.append(seq)
            assert st.npos == [len(s) for s in seqs]
            for _ in range(3):
                new = [int(rng.integers(3, 60)) for _ in seqs]
                lg = st.forward([[t] for t in new])
                seqs = [s + [t] for s, t in zip(seqs, new)]
                for b, s in enumerate(seqs):
                    torch.testing.assert_close(lg[b, 0], ref_last(s), rtol=1e-4, atol=1e-4)
        assert st.mask.sum(1).tolist() == [len(s) for s in seqs]
        assert st.mask[1, 0] == 0  # the short row sits behind holes
        kv = st.row(1)
        assert kv.get_seq_length() == len(seqs[1])
        s = seqs[1] + [7]
        torch.testing.assert_close(alone(s, kv), ref_last(s), rtol=1e-4, atol=1e-4)
        st.select([0, 2])
        new = [11, 12]
        lg = st.forward([[t] for t in new])
        for b, s in enumerate((seqs[0] + [11], seqs[2] + [12])):
            torch.testing.assert_close(lg[b, 0], ref_last(s), rtol=1e-4, atol=1e-4)
        with pytest.raises(ValueError, match="layers"):
            bad = new_kv(model)
            bad.layers = bad.layers[:1]
            st.join(bad)
        if dense == "f32":
            assert 1 in rows and 3 in rows and 2 in rows, sorted(set(rows))
    finally:
        eng.close()


def test_per_position_acceptance_reference():
    pairs = [(3, 3), (3, 1), (2, 0), (0, 0), (1, 1)]
    # position 1: verified in rows with k>=1 -> 4, accepted in (3,3),(3,1),(1,1) -> 3/4
    # position 2: reached where k>=2 and a>=1 -> (3,3),(3,1) -> accepted (3,3) -> 1/2
    # position 3: k>=3 and a>=2 -> (3,3) -> 1/1
    assert per_position_acceptance(pairs) == [0.75, 0.5, 1.0]
    assert per_position_acceptance([(0, 0)]) == []


# ---------------------------------------------------------------------------------------------
# sampling follows the target distribution, per sequence of a batch


@pytest.fixture(scope="module")
def small_pair():
    V = 5
    target = tiny_model("mixtral", seed=0, vocab=V, layers=2, hidden=32, inter=32, experts=4)
    draft = tiny_model("mixtral", seed=7, vocab=V, layers=1, hidden=32, inter=32, experts=4)
    with torch.no_grad():
        draft.lm_head.weight.mul_(6.0)
    eng = specmoe.offload(target, cache=0.5, dtype="f32", prefetch=False)
    yield target, draft, eng, V
    eng.close()


@pytest.mark.parametrize("drafter_kind", ["draft", "ngram"])
def test_batched_sampling_follows_target_distribution(small_pair, drafter_kind):
    """One batch of 2n rows, two prompts of different lengths (left-padded); rows are
    independent draws, so each prompt's (t1, t2) counts must follow its exact joint."""
    target, draft, eng, V = small_pair
    prompts = [[3, 1, 4, 1, 3, 1], [2, 0, 3, 1]]
    T = 1.3
    n = 1200
    L = max(map(len, prompts))
    ids = torch.tensor([[0] * (L - len(p)) + p for p in prompts] * n)
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts] * n)
    d = DraftModel(draft) if drafter_kind == "draft" else NgramDrafter()
    out = generate(target, ids, d, StaticK(1), attention_mask=mask, max_new_tokens=2,
                   do_sample=True, temperature=T, seed=11, tau=None, eos_token_id=None)
    st = out.stats
    assert 0 < st["accepted"] < st["proposed"]  # accept and reject/resample paths both ran
    gen_ = out.sequences[:, L:].numpy()
    for j, p in enumerate(prompts):
        joint, p1 = exact_joint(target, p, V, T)
        counts = np.zeros((V, V))
        for a, b in gen_[j::2]:
            counts[a, b] += 1
        stat, df = chi2_stat(counts.ravel(), n * joint.ravel())
        assert stat < chi2_critical(df), (j, stat, df)
    # power: emitting the proposal itself would be caught by the same test on the first token
    _, p1 = exact_joint(target, prompts[0], V, T)
    if drafter_kind == "draft":
        with torch.no_grad():
            q1 = torch.softmax(draft(torch.tensor([prompts[0]])).logits[0, -1] / T, -1).numpy()
    else:
        q1 = np.eye(V)[4]
    assert n * float(((q1 - p1) ** 2 / p1).sum()) > 3 * chi2_critical(V - 1)


def test_batched_sampling_is_reproducible(batch_pair):
    model, draft, eng, ids, mask = batch_pair
    a = generate(model, ids, DraftModel(draft), StaticK(2), attention_mask=mask,
                 max_new_tokens=8, do_sample=True, seed=3, top_k=20)
    b = generate(model, ids, DraftModel(draft), StaticK(2), attention_mask=mask,
                 max_new_tokens=8, do_sample=True, seed=3, top_k=20)
    assert torch.equal(a.sequences, b.sequences)


# ---------------------------------------------------------------------------------------------
# tau per batch size


def test_tau_grid_and_per_batch_pruning(batch_pair):
    model, _, eng, ids, mask = batch_pair
    eng.tau.clear()
    prompt = ids[0][mask[0] == 1].tolist()
    grid = measure_tau_grid(model, prompt, batch_sizes=(1, 2), g_max=4, repeats=2)
    assert sorted(grid) == [1, 2]
    for b, t in grid.items():
        assert sorted(t) == list(range(1, 5)) and t[1] == pytest.approx(1.0)
        assert all(v > 0 for v in t.values())
        assert eng.tau[b] is not None
    # a tau table per batch size: at batch 4 (next power of two: 4) K must stay 0 where
    # the batch-4 table forbids every K, while batch 1's table allows them
    eng.tau[4] = {g: 1.0 / g for g in range(1, 10)}
    ctl = Cascade(k_max=3)
    out = generate(model, ids, NgramDrafter(), ctl, attention_mask=mask, max_new_tokens=6,
                   eos_token_id=None)
    assert all(i["k"] == 0 for i in out.iterations) and ctl.allowed == [0]
    # a mapping {batch size: tau table} is used at the batch sizes in use
    tables = {1: {g: 1.0 for g in range(1, 10)}, 4: {g: 1.0 / g for g in range(1, 10)}}
    ctl = StaticK(2)
    generate(model, ids, NgramDrafter(), ctl, attention_mask=mask, max_new_tokens=3,
             eos_token_id=None, tau=tables, success=False)
    assert ctl.allowed == [0]
    ctl = StaticK(2)
    generate(model, ids[:1], NgramDrafter(), ctl, attention_mask=mask[:1], max_new_tokens=3,
             eos_token_id=None, tau=tables, success=False)
    assert ctl.allowed == [0, 1, 2]
    eng.tau.clear()


def test_batch_bad_input(batch_pair):
    model, _, eng, ids, mask = batch_pair
    right = mask.flip(1)
    with pytest.raises(ValueError, match="left-padded"):
        generate(model, ids, attention_mask=right)
    with pytest.raises(ValueError, match="attention_mask has shape"):
        generate(model, ids, attention_mask=mask[:, 1:])
    with pytest.raises(ValueError, match="0 and 1"):
        generate(model, ids, attention_mask=mask * 2)
    with pytest.raises(TypeError, match="attention_mask"):
        generate(model, ids, attention_mask=mask.float())
    with pytest.raises(ValueError, match="attention_mask needs"):
        generate(model, ids[0], attention_mask=mask[0])


@pytest.mark.parametrize("share_kv", [True, False])
def test_batched_self_draft_on_the_target_cache(batch_pair, share_kv):
    """SelfDraft(share_kv=True) drafts on the target's own batched cache (its positions become
    holes and are cropped again: no second cache, no draft prefill of the prompts); with
    share_kv=False it keeps a cache of its own.  Both give transformers' batched greedy, and
    the shared one feeds the drafter far fewer tokens."""
    model, _, eng, ids, mask = batch_pair
    ref = hf_batch_greedy(model, ids, mask, N_NEW, min_new_tokens=N_NEW)[:, ids.shape[1]:]
    fed = []
    h = model.register_forward_pre_hook(
        lambda mod, args, kw: fed.append(kw["input_ids"].numel()) if eng._drafting is not None
        else None, with_kwargs=True)
    try:
        out = generate(model, ids, SelfDraft(eng, share_kv=share_kv), StaticK(2),
                       attention_mask=mask, max_new_tokens=N_NEW, eos_token_id=None, tau=None)
    finally:
        h.remove()
    assert torch.equal(out.sequences[:, ids.shape[1]:], ref)
    drafted = sum(fed)
    if share_kv:  # one token per row per draft step
        assert drafted <= len(TEXTS) * 2 * len(out.iterations)
    else:  # the first draft feeds every prompt
        assert drafted > int(mask.sum())

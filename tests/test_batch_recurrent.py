"""BatchKV with recurrent layers (linear attention, Mamba, short convolutions): each row's state
is row b of its layer's state tensors, so plain decode steps of several sequences run as one
batched forward (what ``specmoe serve`` does for hybrids), and what would leave a hole in a
state is refused by name with nothing changed."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import specmoe  # noqa: E402
from tests.conftest import greedy_alone  # noqa: E402
from specmoe.models.testing import tiny_model  # noqa: E402
from specmoe.speculation.batch import BatchKV, is_state_layer, row_layer_kind  # noqa: E402
from specmoe.speculation.decoding import cache_kwargs, new_kv, records_window  # noqa: E402


def _hybrid(arch, dtype=torch.float32):
    model = tiny_model(arch, vocab=128, dtype=dtype)
    if not any(is_state_layer(lay) for lay in new_kv(model).layers):
        pytest.skip("this transformers version's cache holds no recurrent layer per row")
    model.generation_config.eos_token_id = None
    fused = dict(dtype="f32", dense="f32") if dtype == torch.float32 else {}
    return model, specmoe.offload(model, cache=0.5, **fused)


def _prefill_alone(model, ids):
    """A cache of its own holding ``ids``, and the greedy next token."""
    kv = new_kv(model)
    x = torch.tensor([ids])
    with torch.no_grad():
        out = model(input_ids=x, attention_mask=torch.ones_like(x), use_cache=True,
                    **cache_kwargs(model, kv))
    return kv, int(out.logits[0, -1].argmax())


def _step_alone(model, kv, tok):
    S = int(kv.get_seq_length())
    x = torch.tensor([[tok]])
    with torch.no_grad():
        out = model(input_ids=x, attention_mask=torch.ones((1, S + 1), dtype=torch.long),
                    use_cache=True, **cache_kwargs(model, kv))
    return int(out.logits[0, -1].argmax())


def _prompts(seed=4, lens=(14, 9, 20)):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 128, (n,), generator=g).tolist() for n in lens]


@pytest.mark.parametrize("arch,dtype", [("qwen3_next", torch.float32),
                                        ("qwen3_next", torch.bfloat16),
                                        ("jamba", torch.float32),
                                        ("granitemoehybrid", torch.float32)])
def test_join_select_and_row_keep_every_sequence_as_alone(arch, dtype):
    """Two sequences of different lengths join an empty batch, a third joins later, the first
    leaves (select), the second goes on alone from its row (row): every token is
    model.generate's greedy token alone, and each row's token count is its own."""
    model, eng = _hybrid(arch, dtype)
    try:
        prompts = _prompts()
        N = 9
        refs = greedy_alone(model, prompts, N)
        bkv = BatchKV(model, 0)
        assert bkv.stateful
        gen = []
        for p in prompts[:2]:
            kv, t = _prefill_alone(model, p)
            bkv.join(kv)
            gen.append([t])
        ids = [0, 1]                       # the prompt of each row
        for step in range(N - 1):
            if step == 2:                  # a third sequence joins the running batch
                kv, t = _prefill_alone(model, prompts[2])
                bkv.join(kv)
                gen.append([t])
                ids.append(2)
            if step == 4:                  # the first leaves
                bkv.select([1, 2])
                ids = [1, 2]
            lg = bkv.forward([[gen[i][-1]] for i in ids])
            for b, i in enumerate(ids):
                gen[i].append(int(lg[b, 0].argmax()))
            assert bkv.npos == [len(prompts[i]) + len(gen[i]) - 1 for i in ids]
            # the recurrent layers count the batch's columns, as its attention layers hold
            counts = {int(lay.cumulative_length_linear) for lay in bkv.kv.layers
                      if is_state_layer(lay)}
            assert counts == {bkv.length}
        # row 0 (sequence 1) goes on alone from a cache of its own
        kv = bkv.row(0)
        assert int(kv.get_seq_length()) == bkv.npos[0]
        seq = gen[1]
        while len(seq) < N:
            seq.append(_step_alone(model, kv, seq[-1]))
        for i in range(3):
            assert gen[i] == refs[i][:len(gen[i])], i
        assert len(gen[0]) == 5 and len(gen[1]) == N and len(gen[2]) == N - 2
    finally:
        eng.close()


def test_what_would_leave_a_hole_in_a_state_is_refused_with_nothing_changed():
    model, eng = _hybrid("qwen3_next")
    try:
        prompts = _prompts(lens=(10, 6))
        refs = greedy_alone(model, prompts, 4)
        bkv = BatchKV(model, 0)
        gen = []
        for p in prompts:
            kv, t = _prefill_alone(model, p)
            bkv.join(kv)
            gen.append([t])
        mask, npos = bkv.mask.clone(), list(bkv.npos)
        with pytest.raises(ValueError, match="same number of tokens"):
            bkv.forward([[gen[0][-1], 5], [gen[1][-1]]])
        with pytest.raises(ValueError, match="keep no positions"):
            bkv.keep(0, npos[0] - 1)
        with pytest.raises(ValueError, match="without pads into an empty cache"):
            bkv.prefill(torch.tensor([[5, 6], [7, 8]]), torch.ones((2, 2), dtype=torch.long))
        with pytest.raises(ValueError, match="masks' positions"):
            bkv.forward_mtp([[1], [2]], 1, None)
        recording = new_kv(model, rollback=True, window=3)
        x = torch.tensor([prompts[0]])
        with torch.no_grad():
            model(input_ids=x, attention_mask=torch.ones_like(x), use_cache=True,
                  **cache_kwargs(model, recording))
        with pytest.raises(ValueError, match="recording its past"):
            bkv.join(recording)
        assert torch.equal(bkv.mask, mask) and bkv.npos == npos and bkv.batch == 2
        # nothing was changed: the batch still decodes every row as alone
        for _ in range(3):
            lg = bkv.forward([[s[-1]] for s in gen])
            for b, s in enumerate(gen):
                s.append(int(lg[b, 0].argmax()))
        assert gen == refs
        # a prefill of prompts of one length, without pads, into an empty batch is taken
        fresh = BatchKV(model, 2)
        fresh.prefill(torch.tensor([prompts[0][:6], prompts[1]]),
                      torch.ones((2, 6), dtype=torch.long))
        assert fresh.npos == [6, 6]
        with pytest.raises(ValueError, match="without pads into an empty cache"):
            BatchKV(model, 2).prefill(torch.tensor([[0, 5], [6, 7]]),
                                      torch.tensor([[0, 1], [1, 1]]))
    finally:
        eng.close()


def test_row_layer_kind_names_what_a_batch_row_can_live_in():
    """The one rule the scheduler's "can this model batch" and BatchKV.join both read: plain
    full-attention layers hold positions, recurrent layers holding only states hold states,
    and a sliding window or a layer holding keys and states at once holds neither."""
    cu = pytest.importorskip("transformers.cache_utils")
    if not hasattr(cu, "LinearAttentionLayer"):
        pytest.skip("this transformers version has no recurrent cache layers")
    assert row_layer_kind(cu.DynamicLayer()) == "positions"
    assert row_layer_kind(cu.LinearAttentionLayer()) == "states"
    assert row_layer_kind(cu.DynamicSlidingWindowLayer(sliding_window=4)) is None
    assert row_layer_kind(cu.LinearAttentionAndFullAttentionLayer()) is None
    assert row_layer_kind(object()) is None


class _OracleDrafter:
    """Drafts from each prompt's reference continuation, with a length drawn per call (0 to k)
    and one token in three wrong: rows of one batch step feed different numbers of tokens and
    keep different numbers of them, every cut back from 0 to all of a row's drafts occurs."""

    def __init__(self, prompts, refs, seed=0):
        self.ref = {tuple(p): r for p, r in zip(prompts, refs)}
        self.rng = torch.Generator().manual_seed(seed)

    def propose(self, history, k):
        for p, r in self.ref.items():
            if tuple(history[:len(p)]) == p:
                j = len(history) - len(p)
                break
        else:
            raise AssertionError("a history of no prompt")
        n = int(torch.randint(0, k + 1, (1,), generator=self.rng))
        out = list(r[j:j + n])
        for i in range(len(out)):
            if int(torch.randint(0, 3, (1,), generator=self.rng)) == 0:
                out[i] = (out[i] + 1) % 128
        return out


@pytest.mark.parametrize("arch,dtype,drafter", [("qwen3_next", torch.float32, "oracle"),
                                                ("qwen3_next", torch.bfloat16, "oracle"),
                                                ("qwen3_next", torch.float32, "self"),
                                                ("jamba", torch.float32, "oracle"),
                                                ("granitemoehybrid", torch.float32, "oracle")])
def test_batched_speculation_cuts_each_recurrent_row_back_to_its_own_drafts(arch, dtype,
                                                                             drafter):
    """specmoe.generate on a batch of prompts of different lengths with drafts of different
    lengths per row, partly wrong: each row's tokens are model.generate's greedy tokens for
    its prompt alone (the recurrent states of a row are put back to its own last accepted
    token; SelfDraft drafts on the target's own batch cache and is taken back out of it)."""
    from specmoe.speculation.controllers import StaticK
    from specmoe.speculation.drafters import SelfDraft
    model, eng = _hybrid(arch, dtype)
    try:
        prompts = _prompts(seed=7, lens=(12, 5, 17))
        N = 14
        refs = greedy_alone(model, prompts, N)
        d = _OracleDrafter(prompts, refs) if drafter == "oracle" else SelfDraft(eng, share_kv=True)
        B, n = len(prompts), max(len(p) for p in prompts)
        ids = torch.zeros((B, n), dtype=torch.long)
        mask = torch.zeros((B, n), dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, n - len(p):] = torch.tensor(p)
            mask[b, n - len(p):] = 1
        out = specmoe.generate(model, ids, d, StaticK(3), attention_mask=mask, max_new_tokens=N,
                               tau=None, eos_token_id=None)
        assert out.sequences[:, n:].tolist() == refs
        rows = [(k, a) for it in out.iterations for k, a in zip(it["k_rows"],
                                                                it["accepted_rows"])]
        if drafter == "oracle":  # what the test is for: rows cut back by different counts
            assert {k for k, _ in rows} >= {0, 1, 2, 3}
            assert any(0 < a < k for k, a in rows) and any(a == k > 0 for k, a in rows)
            assert any(a == 0 < k for k, a in rows)
    finally:
        eng.close()


def _states(kv, b=0):
    """Every recurrent layer's (conv window, recurrent state) of row ``b``."""
    out = []
    for lay in kv.layers:
        if is_state_layer(lay):
            for i in range(lay.number_of_states):
                c = lay.conv_states[i] if lay.is_conv_states_initialized[i] else None
                r = lay.recurrent_states[i] if lay.is_recurrent_states_initialized[i] else None
                out.append((None if c is None else c[b], None if r is None else r[b]))
    return out


@pytest.mark.parametrize("arch", ["qwen3_next", "jamba", "granitemoehybrid"])
def test_keep_puts_each_recurrent_row_back_to_the_state_of_its_kept_tokens(arch):
    """Rows feed 4, 2 and 3 tokens in one recorded forward and keep 2, 2 and 1 of them: after
    trim each row's conv window and recurrent state are those of its prompt and kept tokens
    fed alone, and its next step's logits are that sequence's; keeping more than the records
    hold is refused by name."""
    model, eng = _hybrid(arch)
    try:
        prompts = _prompts(seed=9, lens=(11, 7, 15))
        bkv = BatchKV(model, 0, window=4)
        for p in prompts:
            kv, _ = _prefill_alone(model, p)
            bkv.join(kv)
        fed = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
        kept = [2, 2, 1]
        base = list(bkv.npos)
        bkv.forward(fed)
        with pytest.raises(ValueError, match="keep no positions"):
            bkv.keep(0, base[0] - 1)        # a prompt token: recorded by no one
        for b, k in enumerate(kept):
            bkv.keep(b, base[b] + k)
        bkv.trim()
        lg = bkv.forward([[40], [41], [42]])
        bkv.trim()                          # (the step recorded its token: windows cut to size)
        for b, p in enumerate(prompts):
            alone, _ = _prefill_alone(model, p + fed[b][:kept[b]])
            x = torch.tensor([[40 + b]])
            with torch.no_grad():
                out = model(input_ids=x, attention_mask=torch.ones((1, int(
                    alone.get_seq_length()) + 1), dtype=torch.long), use_cache=True,
                    **cache_kwargs(model, alone))
            torch.testing.assert_close(lg[b, 0], out.logits[0, -1], atol=1e-4, rtol=1e-4)
            for (c, r), (c1, r1) in zip(_states(bkv.kv, b), _states(alone)):
                if c is not None:
                    torch.testing.assert_close(c, c1, atol=1e-5, rtol=1e-5)
                if r is not None:
                    torch.testing.assert_close(r, r1, atol=1e-5, rtol=1e-5)
        assert bkv.npos == [base[b] + kept[b] + 1 for b in range(3)]
        npos = list(bkv.npos)
        bkv.forward([[1, 2, 3]] * 3)          # 3 of the window's 4 tokens, then 2 more: refused
        with pytest.raises(ValueError, match="record 4 between two settlings"):
            bkv.forward([[4, 5]] * 3)
        assert bkv.npos == [p + 3 for p in npos]
    finally:
        eng.close()


@pytest.mark.parametrize("arch", ["qwen3_5_moe_text", "jamba"])
def test_a_draft_model_with_recurrent_layers_drafts_every_row_as_alone(arch):
    """BatchDraftModel on a draft model with recurrent layers (its own BatchKV, recording a
    window): rows of different lengths, one of a single token (no prefill: catch-up forwards
    from an empty state), histories that take some drafts and then grow by more tokens than
    one drafting forward may feed (catch-up forwards, a dummy token for a row with nothing to
    catch up): each row's drafts are the draft model's greedy tokens for its history alone.
    A history without a new token, and more drafts than the window holds, are refused."""
    from specmoe.speculation.batch import BatchDraftModel
    from specmoe.speculation.drafters import DraftModel
    model, eng = _hybrid(arch)
    try:
        if not records_window(new_kv(model)):
            pytest.skip("this transformers version's recurrent layers record no states")
        bd = BatchDraftModel(DraftModel(model), 3, window=4)  # a forward: 4 tokens a row at most
        hists = _prompts(seed=7, lens=(1, 9, 14))
        g = torch.Generator().manual_seed(8)
        grow = [(1, 2, 1), (7, 1, 3), (1, 3, 9), (2, 2, 2)]  # tokens each row takes next
        for rnd in range(len(grow) + 1):
            drafts, _, _ = bd.draft(hists, [3, 3, 2], None, None)
            assert drafts == [r[:k] for r, k in zip(greedy_alone(model, hists, 3), (3, 3, 2))]
            if rnd == len(grow):
                break
            for b, n in enumerate(grow[rnd]):  # the accepted drafts, then other tokens
                took = drafts[b][:min(n, 1 + rnd % 2)]
                rest = torch.randint(3, 128, (n - len(took),), generator=g).tolist()
                hists[b] = hists[b] + took + rest
        bd.select([2, 0])  # a row leaves; the others draft on
        hists = [hists[2] + [5, 6], hists[0] + [7]]
        drafts, _, _ = bd.draft(hists, [3, 3], None, None)
        assert drafts == greedy_alone(model, hists, 3)
        # prompts of one length: one prefill of the empty state, then the drafting forward
        same = _prompts(seed=11, lens=(6, 6))
        assert BatchDraftModel(DraftModel(model), 2, window=4).draft(
            same, [3, 3], None, None)[0] == greedy_alone(model, same, 3)
        with pytest.raises(ValueError, match="no token past what the last call fed"):
            bd.draft(hists, [3, 3], None, None)
        with pytest.raises(ValueError, match="do not fit a window"):
            bd.draft([h + [9] for h in hists], [6, 6], None, None)
    finally:
        eng.close()


def test_batched_generate_with_a_hybrid_draft_model_equals_greedy_alone():
    """specmoe.generate on a batch of prompts of different lengths of a hybrid, drafted by a
    hybrid draft model (the target's weights, slightly perturbed: drafts accepted in part):
    every sequence is the target's greedy continuation alone."""
    from specmoe.speculation.controllers import StaticK
    from specmoe.speculation.drafters import DraftModel
    model, eng = _hybrid("qwen3_5_moe_text")
    try:
        if not records_window(new_kv(model)):
            pytest.skip("this transformers version's recurrent layers record no states")
        draft = tiny_model("qwen3_5_moe_text", vocab=128)
        with torch.no_grad():
            g = torch.Generator().manual_seed(9)
            for p in draft.parameters():
                p.add_(0.003 * torch.randn(p.shape, generator=g))
        prompts = _prompts(seed=5, lens=(20, 13, 17))
        n = max(len(p) for p in prompts)
        ids = torch.zeros((3, n), dtype=torch.long)
        mask = torch.zeros((3, n), dtype=torch.long)
        for b, p in enumerate(prompts):
            ids[b, n - len(p):], mask[b, n - len(p):] = torch.tensor(p), 1
        out = specmoe.generate(model, ids, attention_mask=mask, max_new_tokens=24,
                               drafter=DraftModel(draft), controller=StaticK(4),
                               eos_token_id=None, tau=None)
        assert out.sequences[:, n:].tolist() == greedy_alone(model, prompts, 24)
        assert 0 < out.stats["accepted"] < out.stats["proposed"]
    finally:
        eng.close()

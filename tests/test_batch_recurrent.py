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
from specmoe.speculation.decoding import cache_kwargs, new_kv  # noqa: E402


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

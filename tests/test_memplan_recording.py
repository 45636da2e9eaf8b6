"""The memory plan counts what speculative decoding records on a linear-attention hybrid: a
verification of T tokens holds, until its crop, each linear layer's state after every token
and the state from before, and its conv window grown by T columns
(specmoe.runtime.memplan.recording_layout).  References: the bytes the cache's tensors really
hold during and after a verification, with the C path (GdnBlock.steps) and transformers' own;
specmoe.generate refuses speculation the plan did not set aside."""
from __future__ import annotations

import types

import pytest

torch = pytest.importorskip("torch")

import specmoe  # noqa: E402
from specmoe.models.testing import tiny_model  # noqa: E402
from specmoe.runtime import memplan  # noqa: E402
from specmoe.runtime.memplan import MachineRates, ModelSizes, plan_memory  # noqa: E402
from specmoe.speculation.controllers import StaticK  # noqa: E402
from specmoe.speculation.decoding import (cache_kwargs, crop_kv, new_kv,  # noqa: E402
                                          records_recurrent_states, unrecorded)

GiB = 1 << 30


def _held(kv) -> int:
    """Bytes of the storages behind the linear-attention layers' conv windows, states and
    recorded states (a view counts its whole storage, once)."""
    seen, total = set(), 0
    for lay in kv.layers:
        if not hasattr(lay, "recurrent_states"):
            continue
        parts = list(lay.conv_states.values()) + list(lay.recurrent_states.values())
        for h in (getattr(lay, "recurrent_states_history", None) or {}).values():
            parts += list(h)
        for t in parts:
            if isinstance(t, torch.Tensor):
                st = t.untyped_storage()
                if st.data_ptr() not in seen:
                    seen.add(st.data_ptr())
                    total += st.nbytes()
    return total


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5_moe_text"])
def test_recording_layout_is_what_a_verification_holds(arch, dtype, fused):
    m = tiny_model(arch, dtype=dtype)
    if not records_recurrent_states(m):
        pytest.skip("transformers < 5.25 records no recurrent states")
    eng = None
    if fused:  # dense layers in specmoe's kernels: the verification runs GdnBlock.steps
        sd = "bf16" if dtype == torch.bfloat16 else "f32"
        eng = specmoe.offload(m, dtype=sd, dense=sd, cache=1.0, prefetch=False)
    try:
        per, state = memplan.recording_layout(m.config, dtype.itemsize)
        assert per > 0 and state > 0
        T = 5
        kv = new_kv(m, rollback=True, window=T)
        with torch.no_grad(), unrecorded(kv):
            m(input_ids=torch.arange(3, 11)[None], use_cache=True, **cache_kwargs(m, kv))
        crop_kv(kv, 8)
        rest = _held(kv)
        assert rest == memplan.kv_layout(m.config, dtype.itemsize)[2]
        for _ in range(2):  # a second verification after the first one's crop holds as much
            with torch.no_grad():
                m(input_ids=torch.arange(20, 20 + T)[None], use_cache=True,
                  **cache_kwargs(m, kv))
            during = _held(kv) - rest
            planned = T * per + state
            if fused:
                assert during == planned
            else:  # transformers' path keeps one state fewer (no buffer of its own)
                assert planned - state <= during <= planned
            crop_kv(kv, 10)  # two of the five kept
            assert _held(kv) == rest  # the verification's other states freed
    finally:
        if eng is not None:
            eng.close()


SIZES = ModelSizes(dense_params=400_000_000, other_params=100_000_000, param_bytes=2.0,
                   num_layers=12, num_experts=64, top_k=6, block_bytes=4_595_712,
                   kv_bytes_per_token=20_000, model_dtype="bf16", kv_state_bytes=50_000_000,
                   record_bytes_per_token=40_000_000, record_state_bytes=36_000_000)
RATES = MachineRates(dense_rate={"bf16": 10e9, "int8": 8e9}, expert_s=140e-6, load_s=4e-3)


def test_plan_sets_the_recorded_states_aside():
    budget = 3 * GiB
    p0 = plan_memory(SIZES, budget, RATES)
    p = plan_memory(SIZES, budget, RATES, record_tokens=9)
    want = 9 * 40_000_000 + 36_000_000
    assert SIZES.record_bytes(9) == want and SIZES.record_bytes(0) == 0
    assert p.record_bytes == want and p.record_tokens == 9
    assert p.kv_bytes == p0.kv_bytes + want
    slots = SIZES.block_bytes
    assert p.cache_slots == p0.cache_slots - -(-want // slots) or \
        p.cache_slots == p0.cache_slots - want // slots
    used = p.reserve_bytes + p.kv_bytes + p.other_bytes + p.dense_bytes + p.cache_bytes
    assert used <= budget
    assert "recorded over 9 tokens for speculation" in str(p) and "recorded" not in str(p0)
    # a model without recurrent layers records nothing: the same plan
    flat = ModelSizes(**{**SIZES.__dict__, "record_bytes_per_token": 0, "record_state_bytes": 0})
    assert plan_memory(flat, budget, RATES, record_tokens=9).cache_slots == \
        plan_memory(flat, budget, RATES).cache_slots
    with pytest.raises(ValueError, match="record_tokens"):
        plan_memory(SIZES, budget, RATES, record_tokens=-1)


def test_generate_refuses_speculation_the_plan_did_not_set_aside():
    m = tiny_model("qwen3_5_moe_text")
    eng = specmoe.offload(m, cache=1.0, prefetch=False)
    try:
        if not records_recurrent_states(m):
            pytest.skip("transformers < 5.25 records no recurrent states")

        class Nothing:
            def propose(self, history, k):
                return []
        eng.memory_plan = types.SimpleNamespace(record_tokens=4, budget_bytes=2 * GiB)
        with pytest.raises(ValueError, match=r"a verification of 5 drafts on this model "
                                             r"records .* MiB .* planned for 3 drafts.*k_max=5"):
            specmoe.generate(m, torch.tensor([5, 6, 7]), drafter=Nothing(),
                             controller=StaticK(5), max_new_tokens=2, eos_token_id=None)
        out = specmoe.generate(m, torch.tensor([5, 6, 7]), drafter=Nothing(),
                               controller=StaticK(3), max_new_tokens=2, eos_token_id=None)
        assert out.sequences.shape[-1] == 5
        # a batch's rows record theirs at once: 2 rows of 3 drafts need 8 states, 2 of 1 four
        two = torch.tensor([[5, 6, 7], [8, 9, 10]])
        with pytest.raises(ValueError, match=r"3 drafts in each of 2 rows .* k_max=7\), or "
                                             r"pass a controller with k_max <= 1"):
            specmoe.generate(m, two, drafter=Nothing(), controller=StaticK(3),
                             max_new_tokens=2, eos_token_id=None)
        out = specmoe.generate(m, two, drafter=Nothing(), controller=StaticK(1),
                               max_new_tokens=2, eos_token_id=None)
        assert out.sequences.shape == (2, 5)
        eng.memory_plan = None  # no plan: nothing to check
        specmoe.generate(m, torch.tensor([5, 6, 7]), drafter=Nothing(), controller=StaticK(5),
                         max_new_tokens=2, eos_token_id=None)
    finally:
        eng.close()
    # a model that records no recurrent state speculates under any plan
    o = tiny_model("olmoe")
    eng = specmoe.offload(o, cache=1.0, prefetch=False)
    try:
        eng.memory_plan = types.SimpleNamespace(record_tokens=0, budget_bytes=2 * GiB)
        specmoe.generate(o, torch.tensor([5, 6, 7]), drafter=Nothing(), controller=StaticK(5),
                         max_new_tokens=2, eos_token_id=None)
    finally:
        eng.close()


def test_from_pretrained_plans_for_k_max(tmp_path, monkeypatch):
    from specmoe.models.testing import save_checkpoint

    monkeypatch.setattr(memplan, "anon_bytes", lambda: 0)
    with pytest.raises(ValueError, match="k_max must be an int >= 0"):
        specmoe.from_pretrained(tmp_path / "nowhere", k_max=-1)
    m = tiny_model("qwen3_next", dtype=torch.bfloat16)
    ckpt = save_checkpoint(m, tmp_path / "ckpt")
    model = specmoe.from_pretrained(ckpt, dtype="int4", memory=600 << 20, k_max=3,
                                    store=tmp_path / "s.smoe", progress=False)
    eng = specmoe.engine_of(model)
    try:
        p = eng.memory_plan
        per, state = memplan.recording_layout(m.config, 2)
        assert p.record_tokens == 4 and p.record_bytes == 4 * per + state
    finally:
        eng.close()

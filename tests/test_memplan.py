"""Memory planning (issue 41 item 0, specmoe/runtime/memplan.py): the budget's split between
the dense layers' format and the expert cache, checked against the rule recomputed here in
plain Python, the budget's sources, and from_pretrained(memory=...) end to end."""
from __future__ import annotations

import contextlib
import math

import numpy as np
import pytest

from specmoe.runtime import memplan
from specmoe.runtime.memplan import MachineRates, ModelSizes, plan_memory

GiB = 1 << 30
SIZES = ModelSizes(dense_params=1_000_000_000, other_params=300_000_000, param_bytes=2.0,
                   num_layers=26, num_experts=64, top_k=6, block_bytes=4_595_712,
                   kv_bytes_per_token=100_000, model_dtype="bf16", mla_params=20_000_000,
                   kv_windows=((50_000, 128), (50_000, 128)), kv_state_bytes=3_000_000)


def reference(sizes, budget, rates, opts, max_tokens=2048, reserve=512 << 20, predictor=0):
    """The module docstring's rule, written again: t(d) for every format that fits, the least,
    and the more exact format within 3 % of it (``predictor`` bytes set aside beside the
    reserve)."""
    per = {"bf16": 2.0, "int8": 1.0 + 4.0 / 2048, "int4": 0.5 + 4.0 / 128, "f32": 4.0}
    curve = dict(memplan.HIT_CURVE)
    xs = sorted(curve)
    S = sizes.num_layers * sizes.num_experts
    out = {}
    for d in opts:
        # gguf: the file's blocks, which never load at the model's dtype
        # (and the absorbed MLA copy of kv_b_proj in the same format, or the file's blocks)
        mla = (sizes.gguf_mla_bytes if sizes.gguf_mla_bytes is not None
               else sizes.mla_params * sizes.param_bytes) if d == "gguf" else math.ceil(
            (sizes.dense_params + sizes.mla_params) * per[d]) - math.ceil(
            sizes.dense_params * per[d])
        db = (sizes.gguf_dense_bytes if d == "gguf"
              else math.ceil(sizes.dense_params * per[d])) + mla
        fixed = reserve + int(sizes.other_params * sizes.param_bytes) + predictor
        # the KV buffers' spare room: a quarter, at least 256 positions (kvcache.room)
        kv = sizes.kv_bytes_per_token * (max_tokens + max(256, max_tokens // 4)) \
            + sum(b * min(w, max_tokens) for b, w in sizes.kv_windows) + sizes.kv_state_bytes
        room = budget - fixed - kv - db
        slots = min(S, room // sizes.block_bytes) if room > 0 else 0
        loads = fixed + (db if d == "gguf" else sizes.dense_params * sizes.param_bytes)
        if slots < sizes.top_k or loads > budget:
            continue
        f = slots / S
        i = max(j for j in range(len(xs)) if xs[j] <= f)
        h = 1.0 if slots >= S else curve[xs[i]] if i == len(xs) - 1 else \
            curve[xs[i]] + (curve[xs[i + 1]] - curve[xs[i]]) * (f - xs[i]) / (xs[i + 1] - xs[i])
        out[d] = (slots, db / rates.dense_rate[d] + sizes.num_layers * sizes.top_k
                  * (rates.expert_s + (1 - h) * rates.load_s))
    best = min(t for _, t in out.values())
    rank = {"gguf": -1, "f32": 0, "bf16": 1, "int8": 2, "int4": 3}
    pick = min((d for d, (_, t) in out.items() if t <= best * 1.03), key=lambda d: rank[d])
    return pick, out[pick][0], out[pick][1]


@pytest.mark.parametrize("budget_gib", [3.5, 4.5, 6.0, 12.0])
@pytest.mark.parametrize("int8_rate", [5e9, 12e9])
def test_plan_follows_the_rule(budget_gib, int8_rate):
    rates = MachineRates(dense_rate={"bf16": 10e9, "int8": int8_rate}, expert_s=140e-6,
                         load_s=4e-3)
    budget = int(budget_gib * GiB)
    p = plan_memory(SIZES, budget, rates)
    d, slots, t = reference(SIZES, budget, rates, ["bf16", "int8"])
    assert (p.dense, p.cache_slots) == (d, slots)
    assert p.est_tpot_s == pytest.approx(t, rel=1e-12)
    assert p.cache_bytes == slots * SIZES.block_bytes
    used = p.reserve_bytes + p.kv_bytes + p.other_bytes + p.dense_bytes + p.cache_bytes
    assert used <= budget  # never planned over the budget
    assert "memory plan for a budget of" in str(p) and f"dense layers {d}" in str(p)


@pytest.mark.parametrize("budget_gib", [2.5, 4.5, 6.0, 12.0])
@pytest.mark.parametrize("gguf_rate", [6e9, 12e9])
def test_a_gguf_files_own_blocks_are_planned_by_the_same_rule(budget_gib, gguf_rate):
    """dense="gguf" as a plan: the file's dense bytes (smaller than bf16, never loaded at the
    model's dtype, so a budget too small to load bf16 can still fit it), the rate of its
    blocks' kernel, and the first pick of a near tie (they are the weights the file holds)."""
    import dataclasses

    sizes = dataclasses.replace(SIZES, gguf_dense_bytes=600_000_000, gguf_kind="q4_0",
                                gguf_mla_bytes=6_000_000)
    rates = MachineRates(dense_rate={"bf16": 10e9, "int8": 10e9, "gguf": gguf_rate},
                         expert_s=140e-6, load_s=4e-3)
    budget = int(budget_gib * GiB)
    p = plan_memory(sizes, budget, rates, dense_options=["bf16", "int8", "gguf"])
    d, slots, t = reference(sizes, budget, rates, ["bf16", "int8", "gguf"])
    assert (p.dense, p.cache_slots) == (d, slots)
    assert p.est_tpot_s == pytest.approx(t, rel=1e-12)
    if budget_gib == 2.5:  # bf16 cannot even load there; int8 loads through bf16 too
        assert d == "gguf" and not any(c["fits"] for c in p.candidates if c["dense"] != "gguf")
    with pytest.raises(ValueError, match="carry no GGUF dense bytes"):
        plan_memory(SIZES, budget, rates, dense_options=["gguf"])


def test_learned_predictor_table_is_set_aside():
    """prefetch="learned" holds the token prior's table (float32 [pieces, 26 * 64], 25 MB for
    DeepSeek-V2-Lite): the plan sets it aside beside the reserve, so the cache gets that much
    less, and prints it."""
    from specmoe.sim.nextuse import default_model, prior_table_bytes

    tp = default_model(26, 64).tokens
    want = 0 if tp._table is not None else len(tp.pieces) * 26 * 64 * 4
    assert prior_table_bytes(26, 64) == want and (want == 0 or 20e6 < want < 40e6)
    assert prior_table_bytes(48, 128) == 0  # no prior for another shape
    rates = MachineRates(dense_rate={"bf16": 10e9, "int8": 8e9}, expert_s=140e-6, load_s=4e-3)
    table = 25_436_160
    for budget in (int(4.5 * GiB), int(6 * GiB)):
        p0 = plan_memory(SIZES, budget, rates)
        p = plan_memory(SIZES, budget, rates, predictor=table)
        d, slots, _ = reference(SIZES, budget, rates, ["bf16", "int8"], predictor=table)
        assert (p.dense, p.cache_slots) == (d, slots) and p.cache_slots < p0.cache_slots
        assert p.predictor_bytes == table and p.other_bytes == p0.other_bytes
        used = p.reserve_bytes + p.kv_bytes + p.other_bytes + p.predictor_bytes \
            + p.dense_bytes + p.cache_bytes
        assert used <= budget
        assert "learned predictor 0.02 GiB" in str(p) and "learned predictor" not in str(p0)
    with pytest.raises(ValueError, match="predictor bytes"):
        plan_memory(SIZES, 6 * GiB, rates, predictor=-1)


def test_more_memory_never_plans_slower():
    rates = MachineRates(dense_rate={"bf16": 10e9, "int8": 8e9}, expert_s=140e-6, load_s=4e-3)
    ts = [plan_memory(SIZES, int(b * GiB), rates).est_tpot_s for b in np.arange(3.5, 12, 0.25)]
    assert all(b <= a * 1.0301 for a, b in zip(ts, ts[1:]))  # the exactness margin aside


def test_exact_format_wins_a_near_tie():
    """With the whole model cached by both, int8 dense layers (half the bytes) read at 5.1 GB/s
    against bf16's 10 GB/s make a token 1.6 % faster: bf16 (exact) is kept; at 5.6 GB/s, 9.5 %
    faster: int8."""
    for int8_rate, want in ((5.1e9, "bf16"), (5.6e9, "int8")):
        rates = MachineRates(dense_rate={"bf16": 10e9, "int8": int8_rate},
                             expert_s=140e-6, load_s=4e-3)
        p = plan_memory(SIZES, 64 * GiB, rates)
        assert p.cache_slots == 26 * 64 and p.est_hit_rate == 1.0
        assert p.dense == want


def test_budget_too_small_names_the_least_that_fits():
    rates = MachineRates(dense_rate={"bf16": 10e9, "int8": 8e9}, expert_s=1e-4, load_s=4e-3)
    with pytest.raises(ValueError, match=r"too small for this model: the smallest plan \(dense "
                                         r"int8, 6 experts cached\) needs (\d+\.\d+) GiB") as e:
        plan_memory(SIZES, 2 * GiB, rates)
    need = float(e.value.args[0].split("needs ")[1].split(" GiB")[0])
    p = plan_memory(SIZES, int((need + 0.01) * GiB), rates)  # that much is enough
    assert p.dense == "int8" and p.cache_slots >= 6
    with pytest.raises(ValueError, match="no measured rate for dense format 'int4'"):
        plan_memory(SIZES, 8 * GiB, rates, dense_options=["int4"])
    with pytest.raises(ValueError, match="positive"):
        plan_memory(SIZES, 0, rates)


def test_memory_budget_sources(monkeypatch):
    assert memplan.memory_budget("8GiB") == (8 * GiB, "given")
    assert memplan.memory_budget("16GB") == (16 * 10**9, "given")
    assert memplan.memory_budget(123456789) == (123456789, "given")
    for bad in ("lots", "25%", "0.5", -5):
        with pytest.raises(ValueError, match="memory"):
            memplan.memory_budget(bad)
    monkeypatch.setattr(memplan, "memory_limit", lambda: 5 * GiB)
    assert memplan.memory_budget("auto") == (5 * GiB, "the memory this process may still use")
    monkeypatch.setattr(memplan, "memory_limit", lambda: 1 << 62)
    with pytest.raises(ValueError, match="memory='auto': no MemAvailable"):
        memplan.memory_budget("auto")


def test_model_sizes_counts_what_the_dense_kernels_convert():
    pytest.importorskip("torch")
    from specmoe.models.testing import tiny_model

    m = tiny_model("deepseek_v2", layers=3, experts=8, top_k=2, hidden=64, inter=32,
                   overrides={"num_key_value_heads": 4})
    s = memplan.model_sizes(m, num_layers=2, num_experts=8, top_k=2, block_bytes=1000)
    sd = m.state_dict()
    routed = sum(v.numel() for k, v in sd.items() if ".mlp.experts." in k)
    # every 2-D weight but the embedding, the routers (mlp.gate) and the routed experts
    dense = sum(v.numel() for k, v in sd.items() if v.ndim == 2 and ".mlp.experts." not in k
                and "embed_tokens" not in k and not k.endswith("mlp.gate.weight"))
    assert s.dense_params == dense
    assert s.other_params == sum(v.numel() for v in sd.values()) - dense - routed
    c = m.config
    # transformers caches MLA's latent and rotary key, one "head" a layer (f32 model)
    assert s.kv_bytes_per_token == 3 * (c.kv_lora_rank + c.qk_rope_head_dim) * 4
    assert (s.kv_windows, s.kv_state_bytes) == ((), 0)
    # kv_b_proj once more: the absorbed decode form's copy (specmoe.models.mla)
    assert s.mla_params == sum(v.numel() for k, v in sd.items() if "kv_b_proj.weight" in k) > 0
    assert s.dense_format_bytes("bf16") == memplan.dense_bytes(dense + s.mla_params, "bf16")
    assert (s.param_bytes, s.model_dtype) == (4.0, "f32")


def _cache_bytes(cache):
    """Bytes of every tensor one sequence's cache holds: keys / values (a specmoe
    BufferedLayer's whole buffers, spare room included), linear-attention states."""
    torch = pytest.importorskip("torch")
    seen, total = set(), 0
    for lay in cache.layers:
        parts = [getattr(lay, "_kbuf", None), getattr(lay, "_vbuf", None)]
        if parts[0] is None:
            parts = [getattr(lay, "keys", None), getattr(lay, "values", None)]
        for d in ("conv_states", "recurrent_states"):
            parts += list((getattr(lay, d, None) or {}).values())
        for t in parts:
            if isinstance(t, torch.Tensor) and t.numel() and id(t) not in seen:
                seen.add(id(t))
                total += t.numel() * t.element_size()
    return total


@pytest.mark.parametrize("arch", ["olmoe", "deepseek_v2", "gpt_oss", "qwen3_next"])
def test_kv_layout_is_what_transformers_cache_holds(arch):
    """The plan's KV bytes against transformers' own DynamicCache after a prompt and a decode
    step of n positions: attention layers (OLMoE), MLA's latent (DeepSeek-V2), sliding-window
    layers at their window (GPT-OSS's window of 64 here, n below and above it), the linear-
    attention layers' fixed states (Qwen3-Next)."""
    torch = pytest.importorskip("torch")
    from transformers import DynamicCache

    from specmoe.models.testing import tiny_model

    m = tiny_model(arch, layers=4, experts=8, top_k=2, hidden=64, inter=32,
                   dtype=torch.bfloat16)
    per, windows, state = memplan.kv_layout(m.config, 2)
    assert bool(windows) == (arch == "gpt_oss") and bool(state) == (arch == "qwen3_next")
    for n in (6, 90):
        cache = DynamicCache(config=m.config)
        with torch.no_grad():
            m(torch.randint(0, 100, (1, n - 1)), cache=cache, use_cache=True)
            m(torch.randint(0, 100, (1, 1)), cache=cache, use_cache=True)
        held = _cache_bytes(cache)
        planned = per * n + sum(b * min(n, w) for b, w in windows) + state
        # (a sliding layer keeps window - 1 positions, and holds the window while it updates)
        assert held <= planned <= held + sum(b for b, _ in windows), (n, held, planned)


@contextlib.contextmanager
def _converted_mla(tmp_path):
    """(ModelSizes, model) of a tiny bf16 DeepSeek-V2 (MLA) loaded with its dense layers in C,
    so decoding takes the absorbed path; the Engine closed on exit."""
    torch = pytest.importorskip("torch")
    import specmoe
    from specmoe.models.testing import save_checkpoint, tiny_model

    m = tiny_model("deepseek_v2", layers=3, experts=8, top_k=2, hidden=64, inter=32,
                   dtype=torch.bfloat16)
    s = memplan.model_sizes(m, num_layers=2, num_experts=8, top_k=2, block_bytes=1)
    model = specmoe.from_pretrained(save_checkpoint(m, tmp_path / "c"), dtype="bf16",
                                    cache=1.0, dense="bf16", store=tmp_path / "s.smoe",
                                    progress=False)
    try:
        yield s, model
    finally:
        specmoe.engine_of(model).close()


def test_kv_bytes_bounds_the_buffered_cache(tmp_path):
    """What specmoe's decode holds (the absorbed MLA path appending into BufferedLayers with
    spare room): at most ModelSizes.kv_bytes of those positions, and at least their bytes."""
    torch = pytest.importorskip("torch")
    from transformers import DynamicCache

    with _converted_mla(tmp_path) as (s, model):
        cache = DynamicCache(config=model.config)
        out = model.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=12, do_sample=False,
                             cache=cache)
        n = out.shape[1] - 1  # (the last token is not in the cache yet)
        assert any(type(lay).__name__ == "BufferedLayer" for lay in cache.layers)
        held = _cache_bytes(cache)
        assert s.kv_bytes_per_token * n <= held <= s.kv_bytes(n), (held, s.kv_bytes(n))
    assert s.kv_bytes(n) == s.kv_bytes_per_token * (n + memplan.KV_SPARE)
    assert memplan.kv_capacity(4000) == 5000


def test_absorbed_mla_weights_are_planned(tmp_path):
    """The absorbed MLA weights the converted model holds are the plan's mla bytes: bf16
    copies of kv_b_proj (dense="bf16"); a GGUF file's attn_k_b / attn_v_b blocks as the
    file holds them (dense="gguf", heads of 32 nope columns: whole Q4_0 blocks)."""
    torch = pytest.importorskip("torch")
    import gguf

    from specmoe.models.testing import save_gguf, tiny_model
    from specmoe.storage.gguf import GgufCheckpoint

    with _converted_mla(tmp_path) as (s, model):
        model.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=2, do_sample=False)
        held = [mod._specmoe_mla.weights for mod in model.modules()
                if getattr(getattr(mod, "_specmoe_mla", None), "weights", None) is not None]
        assert len(held) == 3
        got = sum(t.numel() * t.element_size() for a in held for t in (a._uk, a._uv))
        assert got == int(s.mla_params * 2) > 0

    v3 = tiny_model("deepseek_v3", layers=3, experts=8, top_k=2, hidden=64, inter=32,
                    overrides={"qk_nope_head_dim": 32})
    path, _ = save_gguf(v3, tmp_path / "d.gguf", qtype="Q4_0")
    ck = GgufCheckpoint.open(path)
    by_name = {t.name: t for t in gguf.GGUFReader(str(path)).tensors}
    for i in range(3):
        key = f"model.layers.{i}.self_attn.kv_b_proj.weight"
        k_b, kk, v_b, vk = ck.mla_blocks(key)
        assert (kk, vk) == ("q4_0", "q4_0")
        file_bytes = sum(int(by_name[f"blk.{i}.attn_{x}_b.weight"].n_bytes) for x in "kv")
        assert ck.mla_nbytes(key) == k_b.nbytes + v_b.nbytes == file_bytes


def test_from_pretrained_plans_to_the_budget(tmp_path, capsys, monkeypatch):
    torch = pytest.importorskip("torch")
    import specmoe
    from specmoe.models.testing import save_checkpoint, tiny_model
    from specmoe.runtime import memplan

    # the reserve for a given budget is what the process holds + WORK_MARGIN, at least 512 MiB:
    # a process holding little plans with the floor
    monkeypatch.setattr(memplan, "anon_bytes", lambda: 0)

    m = tiny_model("deepseek_v2", layers=3, experts=8, top_k=2, hidden=64, inter=32,
                   dtype=torch.bfloat16, overrides={"num_key_value_heads": 4})
    ckpt = save_checkpoint(m, tmp_path / "ckpt")
    store = tmp_path / "s.smoe"
    budget = 600 << 20  # the 512 MiB reserve, the KV room, the small model and some experts
    model = specmoe.from_pretrained(ckpt, dtype="int4", memory=budget, store=store)
    eng = specmoe.engine_of(model)
    try:
        p = eng.memory_plan
        assert p is not None and p.budget_bytes == budget
        assert "memory plan for a budget of" in capsys.readouterr().err
        assert eng._cache.capacity == p.cache_slots
        assert eng.dense.dtype == p.dense
        out = model.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=3, do_sample=False)
        assert out.shape == (1, 6)
        bb = eng._cache.slot_bytes
    finally:
        eng.close()
    # a budget with room for 10 of the 16 experts beside bf16 dense layers
    c = next(c for c in p.candidates if c["dense"] == "bf16")
    tight = p.reserve_bytes + p.kv_bytes + p.other_bytes + c["dense_bytes"] + 10 * bb
    model = specmoe.from_pretrained(ckpt, dtype="int4", memory=tight, dense="bf16", store=store,
                                    progress=False)
    eng = specmoe.engine_of(model)
    try:
        assert eng.memory_plan.cache_slots == 10 and eng._cache.capacity == 10
    finally:
        eng.close()
    with pytest.raises(ValueError, match=r"cache=16 \(16 experts\) does not fit memory="):
        specmoe.from_pretrained(ckpt, dtype="int4", memory=tight, dense="bf16", cache=16,
                                store=store, progress=False)
    # a process that already holds 1 GiB keeps it out of the budget: the reserve grows by what
    # it holds above the floor, and the same budget no longer fits
    monkeypatch.setattr(memplan, "anon_bytes", lambda: 1 << 30)
    assert memplan.process_reserve() == (1 << 30) + memplan.WORK_MARGIN
    with pytest.raises(ValueError, match="too small for this model"):
        specmoe.from_pretrained(ckpt, dtype="int4", memory=tight, dense="bf16", store=store,
                                progress=False)
    monkeypatch.setattr(memplan, "anon_bytes", lambda: None)  # unknown: the floor
    assert memplan.process_reserve() == memplan.RESERVE
    with pytest.raises(ValueError, match=r"memory= plans host memory"):
        specmoe.from_pretrained(ckpt, memory="1GiB", device="cuda")
    with pytest.raises(ValueError, match=r"memory='lots'"):
        specmoe.from_pretrained(ckpt, memory="lots", store=store)

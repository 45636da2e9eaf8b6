"""specmoe.runtime.engine against the unmodified transformers models (eager experts) as the reference."""
from __future__ import annotations

import copy
import os
import math
import warnings

import numpy as np
import pytest
import torch

from specmoe.runtime import engine as hf
from specmoe.models import testing

warnings.filterwarnings("ignore")
torch.set_num_threads(1)  # the C path is single-threaded; keep the reference comparable
ARCHS = sorted(hf.SUPPORTED)
PROMPT = torch.tensor([[5, 17, 33, 64, 9, 100, 7, 41]])


def _pair(arch, dtype=torch.float32, **kw):
    m = testing.tiny_model(arch, dtype=dtype, **kw)
    return m, copy.deepcopy(m)


def _expert_numel(model):
    return sum(p.numel() for e in hf.iter_experts_modules(model) for p in e.parameters())


@pytest.mark.parametrize("arch", ARCHS)
def test_f32_matches_unmodified(arch):
    m, ref = _pair(arch)
    n_all = sum(p.numel() for p in ref.parameters())
    n_exp = _expert_numel(ref)
    assert n_exp > n_all / 2  # the experts dominate the model: the check below means something
    eng = hf.offload(m, dtype="f32", cache=0.25)
    try:
        # expert parameters are gone from the offloaded model
        assert sum(p.numel() for p in m.parameters()) == n_all - n_exp
        with torch.no_grad():
            lr, lo = ref(PROMPT).logits, m(PROMPT).logits
        torch.testing.assert_close(lo, lr, atol=1e-5, rtol=1e-5)
        g_ref = ref.generate(PROMPT, max_new_tokens=16, do_sample=False)
        g_off = m.generate(PROMPT, max_new_tokens=16, do_sample=False)
        assert torch.equal(g_ref, g_off)
        assert len(set(g_ref[0, PROMPT.shape[1]:].tolist())) > 2  # not a degenerate repeat
    finally:
        eng.close()


@pytest.mark.parametrize("arch", ["mixtral", "gpt_oss", "deepseek_v3"])
def test_bf16_store_close_to_bf16_model(arch):
    m, ref = _pair(arch, dtype=torch.bfloat16)
    # the store's effect alone: dense layers in C (another rounding, which can flip a tiny
    # model's near-tied routing) are tested against references in test_dense / test_mla
    eng = hf.offload(m, dtype="bf16", dense="torch")
    try:
        with torch.no_grad():
            lr, lo = ref(PROMPT).logits.float(), m(PROMPT).logits.float()
        # bf16 keeps 8 mantissa bits; the C path accumulates in f32, torch rounds between ops
        err = (lr - lo).abs().max().item()
        assert err <= 0.05 * lr.abs().max().item(), err
        # and it is much closer to the bf16 model than an f32 model is (the error is rounding)
        assert lo.argmax(-1).eq(lr.argmax(-1)).float().mean().item() >= 0.85
    finally:
        eng.close()


@pytest.mark.parametrize("arch", ["qwen2_moe", "gpt_oss"])
def test_batch_of_two_with_padding(arch):
    m, ref = _pair(arch)
    eng = hf.offload(m)
    try:
        ids = torch.tensor([[0, 0, 0, 5, 17, 33, 64, 9], [11, 12, 13, 14, 15, 16, 17, 18]])
        mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1], [1] * 8])
        kw = dict(attention_mask=mask, max_new_tokens=10, do_sample=False, pad_token_id=0)
        assert torch.equal(ref.generate(ids, **kw), m.generate(ids, **kw))
    finally:
        eng.close()


def _ref_prefetch_counts(ref, arch, overfetch, mass=None):
    """Independent count of next-layer-router prediction hits with forward hooks on the
    unmodified model: for each MoE layer l+1, predicted = union over tokens of the top-m
    experts of layer l+1's router applied to layer l's router input; actual = union of
    the routed experts at l+1."""
    a = hf.SUPPORTED[arch]
    ids = hf.moe_layers(ref)
    mlps = [ref.model.layers[i].mlp for i in ids]
    routers = [getattr(mm, a.router_attr) for mm in mlps]
    k = ref.config.num_experts_per_tok
    E = mlps[0].experts.gate_up_proj.shape[0]
    m_pred = min(E, max(k, math.ceil(k * overfetch)))
    seen = {}

    def hook(pos):
        def f(mod, args, kwargs):
            x, idx = args[0], args[1]
            seen[pos] = (x, idx)
        return f

    hs = [mm.experts.register_forward_pre_hook(hook(p), with_kwargs=True) for p, mm in enumerate(mlps)]
    tp = pred = act = 0
    with torch.no_grad():
        for t in range(3, PROMPT.shape[1] + 1):
            seen.clear()
            ref(PROMPT[:, :t])
            for p in range(len(mlps) - 1):
                x = seen[p][0]
                r = routers[p + 1]
                lg = x @ r.weight.T
                if getattr(r, "bias", None) is not None:
                    lg = lg + r.bias
                if a.sigmoid_router:
                    lg = lg.sigmoid() + r.e_score_correction_bias
                if mass is None:
                    P = set(torch.topk(lg, m_pred, -1).indices.reshape(-1).tolist())
                else:  # smallest prefix (>= k) of the experts by probability reaching `mass`
                    P = set()
                    for row in torch.softmax(lg, -1).tolist():
                        order = sorted(range(E), key=lambda e: -row[e])
                        acc = 0.0
                        for r, e in enumerate(order):
                            if r >= k and acc >= mass:
                                break
                            P.add(e)
                            acc += row[e]
                A = set(seen[p + 1][1].reshape(-1).tolist())
                tp, pred, act = tp + len(P & A), pred + len(P), act + len(A)
    for h in hs:
        h.remove()
    return tp / pred, tp / act


@pytest.mark.parametrize("arch", ["mixtral", "deepseek_v3"])
def test_prefetch_precision_recall(arch):
    m, ref = _pair(arch)
    eng = hf.offload(m, prefetch=True, overfetch=2.0)
    try:
        with torch.no_grad():
            for t in range(3, PROMPT.shape[1] + 1):
                m(PROMPT[:, :t])
        s = eng.stats()
        p, r = _ref_prefetch_counts(ref, arch, 2.0)
        assert s["prefetch_precision"] == pytest.approx(p)
        assert s["prefetch_recall"] == pytest.approx(r)
        eng.set_prefetch(True, mass=0.6)
        eng.reset_stats()
        with torch.no_grad():
            for t in range(3, PROMPT.shape[1] + 1):
                m(PROMPT[:, :t])
        p2, r2 = _ref_prefetch_counts(ref, arch, 2.0, mass=0.6)
        print(f"{arch}: overfetch 2: precision {p:.2f} recall {r:.2f}; mass 0.6: {p2:.2f} {r2:.2f}")
        assert eng.stats()["prefetch_precision"] == pytest.approx(p2)
        assert eng.stats()["prefetch_recall"] == pytest.approx(r2)
        with pytest.raises(ValueError, match="mass"):
            eng.set_prefetch(True, mass=1.5)
        eng.set_prefetch(False)
        eng.reset_stats()
        with torch.no_grad():
            m(PROMPT)
        assert eng.stats()["prefetch_precision"] is None
    finally:
        eng.close()


def test_prefetch_admission_engine():
    """Engine.set_prefetch(admission=True): the cache's admission rule decides which predicted
    experts load (refusals counted), outputs are those without it, and the setting (with its
    byte budget, byte_budget=) survives a cache rebuild."""
    m, ref = _pair("olmoe")
    eng = hf.offload(m, prefetch=True, cache=0.5)
    try:
        with torch.no_grad():
            want = m(PROMPT).logits
        with pytest.raises(TypeError, match="admission must be a bool"):
            eng.set_prefetch(True, admission="yes")
        eng.set_prefetch(True, admission=True)
        assert eng.stats()["admission"] is True and eng._cache.admission()["on"] is True
        eng.reset_stats()
        with torch.no_grad():
            for t in range(3, PROMPT.shape[1] + 1):
                m(PROMPT[:, :t])
            got = m(PROMPT).logits
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        s = eng.stats()
        assert s["prefetch_refused"] + s["prefetch_issued"] + s["prefetch_dropped"] > 0
        eng.set_cache(0.25)
        assert eng._cache.admission()["on"] is True
        assert eng._cache.admission()["byte_budget"] is True and eng.stats()["byte_budget"]
        with pytest.raises(TypeError, match="byte_budget must be a bool"):
            eng.set_prefetch(True, byte_budget="no")
        eng.set_prefetch(True, byte_budget=False)   # the time terms alone; admission kept
        eng.set_cache(0.5)
        a = eng._cache.admission()
        assert a["on"] is True and a["byte_budget"] is False
        assert eng.stats()["byte_budget"] is False
        eng.set_prefetch(True, admission=False)
        assert eng._cache.admission()["on"] is False and eng.stats()["admission"] is False
        assert eng._cache.admission()["byte_budget"] is False
    finally:
        eng.close()


def test_trace_records_routing():
    m, ref = _pair("olmoe")
    eng = hf.offload(m)
    routed = []
    mlps = [ref.model.layers[i].mlp for i in hf.moe_layers(ref)]
    hs = [mm.experts.register_forward_pre_hook(lambda mod, a, p=p: routed.append((p, a[1], a[2])))
          for p, mm in enumerate(mlps)]
    try:
        with eng.trace(logits=True) as rec:
            m.generate(PROMPT, max_new_tokens=4, do_sample=False)
        tr = rec.result()
        ref.generate(PROMPT, max_new_tokens=4, do_sample=False)
        L = len(mlps)
        n = PROMPT.shape[1] + 3  # prefill tokens + 3 decode passes (the 4th token needs none)
        assert tr.experts.shape == (n, L, 2)
        assert tr.logits.shape == (n, L, 8)
        exp = np.concatenate([np.stack([routed[i + p][1].numpy() for p in range(L)], 1)
                              for i in range(0, len(routed), L)])
        wts = np.concatenate([np.stack([routed[i + p][2].numpy() for p in range(L)], 1)
                              for i in range(0, len(routed), L)])
        np.testing.assert_array_equal(tr.experts, exp)
        np.testing.assert_allclose(tr.weights, wts, rtol=1e-5)  # hidden states agree to ~1e-7
        # logits give back the routed experts
        top = np.sort(np.argsort(-tr.logits, -1)[..., :2], -1)
        np.testing.assert_array_equal(top, np.sort(exp, -1))
        assert tr.request_starts.tolist() == [0]
    finally:
        eng.close()
        for h in hs:
            h.remove()


def test_unsupported_model_lists_supported():
    import transformers as tf
    cfg = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)
    model = tf.AutoModelForCausalLM.from_config(cfg)
    with pytest.raises(hf.UnsupportedModelError, match="mixtral"):
        hf.offload(model)


def test_bad_arguments():
    m = testing.tiny_model("mixtral")
    with pytest.raises(ValueError, match="dtype"):
        hf.offload(m, dtype="f16")
    with pytest.raises(ValueError, match="cache"):
        hf.offload(m, cache=0)
    eng = hf.offload(m)
    with pytest.raises(ValueError, match="already offloaded"):
        hf.extract_experts(m.model.layers[0].mlp.experts)
    with pytest.raises(ValueError, match="overfetch"):
        eng.set_prefetch(True, overfetch=0.5)
    # a string is no switch ("no" would read as True), nor a predictor or a mass
    with pytest.raises(TypeError, match="on must be a bool"):
        eng.set_prefetch("no")
    with pytest.raises(ValueError, match="mass"):
        eng.set_prefetch(True, mass="0.5")
    with pytest.raises(ValueError, match="predictor must be one of"):
        eng.set_prefetch(True, predictor="routr")
    with pytest.raises(ValueError, match="replay_routing"):  # the oracle needs a replay
        eng.set_prefetch(True, predictor="oracle")
    with pytest.raises(TypeError, match="predictor must be callable"):
        eng.set_prefetch(True, predictor=5)
    assert eng.prefetch and eng.mass is None and eng._predictor is None  # nothing changed
    eng.set_prefetch(0)
    assert not eng.prefetch
    eng.close()
    with pytest.raises(ValueError, match="prefetch='off': choose True, False or a predictor"):
        hf.offload(testing.tiny_model("mixtral"), prefetch="off")
    with pytest.raises(TypeError, match="prefetch must be a bool or a predictor"):
        hf.offload(testing.tiny_model("mixtral"), prefetch=2)
    with pytest.raises(RuntimeError, match="closed"):
        m(PROMPT)


def _resident(store):
    """Every block of a store in one buffer, store order (a source for _C.moe_forward)."""
    nl, ne, bb = store.num_layers, store.num_experts, store.block_bytes
    buf = np.empty(nl * ne * bb, np.uint8)
    for l in range(nl):
        for e in range(ne):
            store.read_block(l, e, buf[(l * ne + e) * bb:(l * ne + e + 1) * bb])
    return buf


def test_moe_forward_rejects_bad_input():
    from specmoe import _C
    m = testing.tiny_model("mixtral")
    eng = hf.offload(m)
    x = np.zeros((2, 64), np.float32)
    out = np.zeros((2, 64), np.float32)
    w = np.ones((2, 2), np.float32)
    z = np.array([[0, 1], [1, 2]])
    try:
        src, d, bb = _resident(eng._store), eng._desc, eng._block_bytes
        x = np.zeros((2, 64), np.float32)
        out = np.zeros((2, 64), np.float32)
        w = np.ones((2, 2), np.float32)
        z = np.array([[0, 1], [1, 2]])

        def call(*a, **kw):
            args = dict(source=src, kctx=None, desc=d, block_bytes=bb, layer=0, num_experts=8,
                        x=x, idx=z, w=w, out=out)
            args.update(kw)
            return _C.moe_forward(**args)

        call()  # valid
        with pytest.raises(ValueError, match="expert 8"):
            call(idx=np.array([[0, 8], [1, 2]]))
        with pytest.raises(ValueError, match="expert -1"):
            call(idx=np.array([[0, -1], [1, 2]]))
        with pytest.raises(ValueError, match="more than once"):
            call(idx=np.array([[3, 3], [1, 2]]))
        with pytest.raises(ValueError, match="shape"):
            call(idx=np.zeros((3, 2), np.int64))
        with pytest.raises(ValueError, match="float32"):
            call(x=x.astype(np.float64))
        ro = out.copy()
        ro.flags.writeable = False
        with pytest.raises(ValueError, match="writable"):
            call(out=ro)
        with pytest.raises(ValueError, match="past the end"):
            call(layer=7)
        with pytest.raises(ValueError):
            call(block_bytes=64)  # tensors outside the block
        with pytest.raises(ValueError):
            call(desc=dict(d, dtype=99))  # no such weight dtype
        with pytest.raises(TypeError):
            call(desc=list(d.items()))
        with pytest.raises(TypeError):
            call(kctx=object())
        with pytest.raises(TypeError):
            call(source=object())
        with pytest.raises(ValueError, match="does not match"):
            call(source=eng._cache._c, layer=5)
    finally:
        cache_obj = eng._cache._c
        eng.close()
    from specmoe import CacheError
    with pytest.raises(CacheError, match="closed"):
        _C.moe_forward(cache_obj, None, d, bb, 0, 8, x, z, w, out)


def test_expert_memory_is_freed():
    """Resident memory falls by about the experts' bytes minus the cache's."""
    import gc

    def rss():
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * 4096

    m = testing.tiny_model("mixtral", hidden=256, inter=512, layers=4, experts=32)
    exp = sum(p.numel() * p.element_size() for e in hf.iter_experts_modules(m)
              for p in e.parameters())
    gc.collect()
    r0 = rss()
    eng = hf.offload(m, cache=0.25)
    try:
        with torch.no_grad():
            m(PROMPT)
        gc.collect()
        r1 = rss()
        cache_bytes = eng.stats().get("cache_bytes")
        if cache_bytes is None:
            pytest.skip("this build has no expert cache: all blocks stay resident")
        assert cache_bytes <= 0.26 * exp
        assert r0 - r1 >= 0.5 * (exp - cache_bytes), (exp, cache_bytes, r0, r1)
    finally:
        eng.close()


@pytest.mark.parametrize("gptoss", [False, True])
def test_moe_forward_against_numpy(tmp_path, gptoss):
    """The C layer on random routing vs a plain numpy MoE (SiLU, or GPT-OSS with biases)."""
    from specmoe import _C
    from specmoe.runtime.kernels import FFNSpec
    from specmoe.storage.store import write_store
    rng = np.random.default_rng(0)
    E, I, H, T, k = 4, 64, 32, 7, 2
    names = ["gate", "up", "down"] + (["gate.bias", "up.bias", "down.bias"] if gptoss else [])
    shapes = {"gate": (E, I, H), "up": (E, I, H), "down": (E, H, I), "gate.bias": (E, I),
              "up.bias": (E, I), "down.bias": (E, H)}
    d = {n: (rng.normal(size=shapes[n]) * 0.3).astype(np.float32) for n in names}
    st = write_store(tmp_path / "s.smoe", [d], progress=False)
    act = "gptoss" if gptoss else "silu"
    spec = FFNSpec.from_store_schema(st.tensors, st.block_bytes, activation=act, alpha=1.702,
                                     limit=1.5)
    buf = _resident(st)
    x = rng.normal(size=(T, H)).astype(np.float32)
    idx = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int64)
    w = rng.random((T, k)).astype(np.float32)
    out = np.empty((T, H), np.float32)
    used = np.zeros(E, np.uint8)
    _C.moe_forward(buf, None, spec.desc(), st.block_bytes, 0, E, x, idx, w, out, used)
    ref = np.zeros((T, H))
    for t in range(T):
        for j in range(k):
            e = idx[t, j]
            g = d["gate"][e] @ x[t] + (d["gate.bias"][e] if gptoss else 0)
            u = d["up"][e] @ x[t] + (d["up.bias"][e] if gptoss else 0)
            if gptoss:
                g = np.minimum(g, 1.5)
                u = np.clip(u, -1.5, 1.5)
                h = (u + 1) * g / (1 + np.exp(-1.702 * g))
            else:
                h = g / (1 + np.exp(-g)) * u
            ref[t] += w[t, j] * (d["down"][e] @ h + (d["down.bias"][e] if gptoss else 0))
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(used, np.isin(np.arange(E), idx).astype(np.uint8))
    st.close()


def _nll(model, ids):
    with torch.no_grad():
        lg = model(ids).logits[0, :-1].float()
    return torch.nn.functional.cross_entropy(lg, ids[0, 1:]).item()


@pytest.mark.parametrize("dtype", ["int8", "int4", "int2"])
def test_quantized_store_perplexity(dtype):
    """int8/int4 experts change the model's perplexity on a fixed text only a little (int2, the
    fallback level of SpecMD's cascade, by more).  The text is the f32 model's own greedy
    continuation, so its perplexity is low and a broken quantized path shows up as a large
    jump."""
    m, ref = _pair("qwen3_moe", hidden=128, inter=128)
    text = ref.generate(PROMPT, max_new_tokens=40, do_sample=False)
    p_ref = math.exp(_nll(ref, text))
    eng = hf.offload(m, dtype=dtype)
    try:
        p_q = math.exp(_nll(m, text))
        with torch.no_grad():
            lq, lr = m(text).logits.flatten(), ref(text).logits.flatten()
    finally:
        eng.close()
    corr = torch.corrcoef(torch.stack([lq, lr]))[0, 1].item()
    print(f"perplexity f32 {p_ref:.4f} -> {dtype} {p_q:.4f} ({(p_q / p_ref - 1) * 100:+.2f}%), "
          f"logit correlation {corr:.5f}")
    assert math.isfinite(p_q)
    assert abs(p_q / p_ref - 1) < {"int8": 0.02, "int4": 0.15, "int2": 0.3}[dtype]
    # logits track the f32 model's (a wrong dequantization decorrelates them)
    assert corr > {"int8": 0.999, "int4": 0.98, "int2": 0.97}[dtype]


def test_cache_sees_one_access_per_layer_expert_and_pass():
    """hits + misses = distinct experts per (pass, layer), counted from the reference model's
    routing; with a cache of every expert and no prefetch, misses = distinct (layer, expert)."""
    m, ref = _pair("phimoe")
    mlps = [ref.model.layers[i].mlp for i in hf.moe_layers(ref)]
    routed = []
    hs = [mm.experts.register_forward_pre_hook(lambda mod, a, p=p: routed.append((p, a[1])))
          for p, mm in enumerate(mlps)]
    eng = hf.offload(m, cache=1.0, prefetch=False)
    try:
        eng.reset_stats()
        m.generate(PROMPT, max_new_tokens=6, do_sample=False)
        ref.generate(PROMPT, max_new_tokens=6, do_sample=False)
        s = eng.stats()
        accesses = sum(len(set(idx.reshape(-1).tolist())) for _, idx in routed)
        distinct = len({(p, e) for p, idx in routed for e in idx.reshape(-1).tolist()})
        assert s["hits"] + s["misses"] == accesses
        assert s["misses"] == distinct
        assert s["passes"] == 6
        eng.set_policy("lfu")  # a new empty cache under another policy still gives the same tokens
        assert eng.stats()["policy"] == "lfu"
        assert torch.equal(m.generate(PROMPT, max_new_tokens=6, do_sample=False),
                           ref.generate(PROMPT, max_new_tokens=6, do_sample=False))
        with pytest.raises(ValueError, match="policy"):
            eng.set_policy("no-such-policy")
        assert eng.stats()["policy"] == "lfu"  # the working cache is kept
        m(PROMPT)
    finally:
        eng.close()
        for h in hs:
            h.remove()


def test_store_path_kept_and_temp_removed(tmp_path):
    m = testing.tiny_model("mixtral")
    p = tmp_path / "experts.smoe"
    eng = hf.offload(m, store=p)
    eng.close()
    assert p.exists()  # a store the caller named is kept
    m2 = testing.tiny_model("mixtral")
    eng2 = hf.offload(m2)
    tmp = eng2._store_path
    assert tmp and os.path.exists(tmp)
    eng2.close()
    assert not os.path.exists(tmp)  # the temporary store is deleted by close()


def test_temporary_store_goes_with_an_engine_never_closed(tmp_path):
    """offload()'s temporary store (the model's experts, often GBs) is deleted when its engine
    is collected unclosed, and when a script exits without closing it."""
    import gc
    import subprocess
    import sys
    m = testing.tiny_model("mixtral")
    eng = hf.offload(m)
    tmp = eng._store_path
    assert tmp and os.path.exists(tmp)
    del eng, m
    gc.collect()
    assert not os.path.exists(tmp)
    script = ("import sys; from specmoe.models import testing; "
              "from specmoe.runtime import engine as hf\n"
              "eng = hf.offload(testing.tiny_model('mixtral'))\n"
              "print(eng._store_path); sys.stdout.flush()\n")
    env = dict(os.environ, TMPDIR=str(tmp_path))
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    path = out.stdout.strip().splitlines()[-1]
    assert path.startswith(str(tmp_path)) and not os.path.exists(path)
    assert not list(tmp_path.glob("specmoe-*"))


def test_set_policy_keeps_contents_and_any_spac_policy_learns():
    """Engine.set_policy swaps the policy without emptying the cache; a SpAc object (not only
    the string "spac") receives the per-pass activation counts."""
    import specmoe
    m = testing.tiny_model("mixtral")
    # gamma=2: boundaries of 1, so one activation (0 -> 1 token) already moves a utility up
    eng = hf.offload(m, cache=0.5, policy=specmoe.SpAc(levels=4, gamma=2))
    try:
        with torch.no_grad():
            m.generate(PROMPT, max_new_tokens=6, do_sample=False)
        L, E = len(eng.layer_ids), eng.num_experts
        layers = np.repeat(np.arange(L), E)
        experts = np.tile(np.arange(E), L)
        assert eng._cache.utility(layers, experts).max() > 0  # counts were fed
        before = sorted(eng._cache.resident())
        assert len(before) == eng._cache.capacity
        eng.set_policy("lfu")
        assert eng._cache.policy == "lfu" and eng.policy == "lfu"
        assert sorted(eng._cache.resident()) == before
        eng.set_cache("25%")  # a new capacity rebuilds (and empties) the cache
        assert eng._cache.capacity == L * E // 4 and eng._cache.resident() == []
    finally:
        eng.close()


def test_threads_share_one_offloaded_model():
    """Two threads generating on one offloaded model get the single-thread tokens; set_policy
    and set_cache from a third thread meanwhile change nothing in the output (f32 store:
    the cache decides speed, not values)."""
    import threading
    m, ref = _pair("mixtral")
    want = ref.generate(PROMPT, max_new_tokens=24, do_sample=False)
    eng = hf.offload(m, cache=0.25)
    got, errors = [], []

    def run():
        try:
            with torch.no_grad():
                for _ in range(3):
                    got.append(m.generate(PROMPT, max_new_tokens=24, do_sample=False))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    def churn():
        try:
            for i in range(6):
                eng.set_policy(["lfu", "lru", "least_stale"][i % 3])
                eng.set_cache([0.25, 0.5][i % 2])
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    ts = [threading.Thread(target=run), threading.Thread(target=run),
          threading.Thread(target=churn)]
    try:
        for t in ts:
            t.start()
        for t in ts:
            t.join(120)
        assert not any(t.is_alive() for t in ts), "a thread hung"
        assert not errors, errors
        assert len(got) == 6 and all(torch.equal(g, want) for g in got)
    finally:
        eng.close()


def test_close_while_another_thread_generates():
    """close() waits for the layer call in flight; the generating thread then gets a
    RuntimeError naming the closed engine (no crash, no hang)."""
    import threading
    import time
    m = testing.tiny_model("mixtral")
    eng = hf.offload(m, cache=0.25)
    errors = []

    def run():
        try:
            with torch.no_grad():
                m.generate(PROMPT, max_new_tokens=2000, min_new_tokens=2000, do_sample=False)
        except RuntimeError as exc:
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    time.sleep(0.5)
    eng.close()
    t.join(60)
    assert not t.is_alive()
    assert len(errors) == 1 and "closed" in str(errors[0])
    eng.close()  # idempotent

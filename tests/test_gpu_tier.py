"""The GPU tier's engine on every machine: ``device="emulate"`` runs GpuEngine's own code (its
layer path, the GPU cache's slot table with the slots in host memory, the prediction, the
policies, the recorder, the SpAc balancer) with the CPU kernels in place of the CUDA ones, and
``device="cuda"`` runs the same tests where a GPU is lent (issue 36, item 3).  Each test compares
with the unmodified model or with the CPU Engine on the same input."""
from __future__ import annotations

import copy

import numpy as np
import pytest

torch = pytest.importorskip("torch")
cuda = pytest.importorskip("specmoe.runtime.cuda")

from specmoe.models import testing  # noqa: E402
from specmoe.runtime import engine as hf  # noqa: E402
from specmoe.runtime.gpu_engine import GpuEngine  # noqa: E402

try:
    cuda.extension()
    _EXT_WHY = ""
except cuda.CudaUnavailable as e:  # specmoe._cuda not built on this machine
    _EXT_WHY = str(e)
pytestmark = pytest.mark.skipif(bool(_EXT_WHY), reason=f"specmoe._cuda unavailable: {_EXT_WHY}")

_GPU_WHY = cuda.unusable_reason()
DEVICES = ["emulate", pytest.param("cuda", marks=pytest.mark.skipif(
    bool(_GPU_WHY), reason=f"{_GPU_WHY} (GPU tests run on a GPU machine, see docs/gpu.md)"))]
PROMPT = [5, 17, 33, 64, 9, 100, 7, 41]


def _dev(device: str) -> str:
    """Where the model's inputs live for ``device``."""
    return "cuda" if device == "cuda" else "cpu"


def _greedy_both(model, ref, device: str, n: int):
    """Greedy ids of ``model`` (offloaded) and of ``ref`` (unmodified) on PROMPT, n new tokens."""
    x = torch.tensor([PROMPT], device=_dev(device))
    with torch.no_grad():
        got = model.generate(x, max_new_tokens=n, do_sample=False)
        want = ref.to(_dev(device)).generate(x, max_new_tokens=n, do_sample=False)
    return got.tolist(), want.tolist()


def _tiny(arch: str = "qwen3_moe"):
    m = testing.tiny_model(arch, dtype=torch.float32)
    return m, copy.deepcopy(m)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "deepseek_v3", "gpt_oss"])
def test_greedy_equal_to_the_unmodified_model(device, arch):
    m, ref = _tiny(arch)
    eng = hf.offload(m, device=device, dtype="f32", cache=0.25)
    try:
        assert isinstance(eng, GpuEngine) and eng.emulated == (device == "emulate")
        got, want = _greedy_both(m, ref, device, 6)
        assert got == want
        st = eng.stats()
        assert st["misses"] > 0 and st["passes"] >= 6
    finally:
        eng.close()


@pytest.mark.parametrize("device", DEVICES)
def test_both_tiers_predict_the_same_experts(device):
    """One prediction rule (csrc/route.c, _C.predict_next on the GPU tier): the CPU Engine and
    the GPU tier on the same model and prompt predict the same experts, overfetch and mass, and
    with the learned predictor (the C layers' nextuse learner, fed the same routing)."""
    got = {}
    for dev in ("cpu", device):
        for mode in ({"overfetch": 2.0}, {"mass": 0.8}, {"predictor": "learned"}):
            m, _ = _tiny()
            eng = hf.offload(m, dtype="f32", cache=0.25, prefetch=True, device=dev)
            try:
                eng.set_prefetch(True, **mode)
                eng.reset_stats()
                with torch.no_grad():
                    m(torch.tensor([PROMPT], device=_dev(dev)))
                st = eng.stats()
                got[dev, tuple(mode)] = (st["prefetch_precision"], st["prefetch_recall"])
            finally:
                eng.close()
    assert got["cpu", ("predictor",)][0] is not None
    for mode in (("overfetch",), ("mass",), ("predictor",)):  # the CPU's router GEMV sums in
        # another order
        assert got["cpu", mode] == pytest.approx(got[device, mode], abs=1e-9 if
                                                 device == "emulate" else 0.05), (mode, got)
    with pytest.raises(ValueError, match="mass"):
        m, _ = _tiny()
        eng = hf.offload(m, dtype="f32", cache=0.25, device=device)
        try:
            eng.set_prefetch(True, mass=1.5)
        finally:
            eng.close()


@pytest.mark.parametrize("device", DEVICES)
def test_both_tiers_give_the_learned_predictor_the_token_prior(device):
    """The token prior (issue 42; Engine.set_token_pieces, the input embedding's pre-hook and
    csrc/layer.h smoe_layers_set_next_prior) on both tiers: a DeepSeek-V2-Lite-shaped model (26
    MoE layers x 64 experts, the packaged table's shape) decoding one token a pass predicts
    the same experts on the CPU and the GPU tier, and otherwise without the prior."""
    from specmoe.sim.nextuse import default_model

    pieces_of = default_model(26, 64).tokens.pieces
    got = {}
    for dev in ("cpu", device):
        for prior in (True, False):
            m = testing.tiny_model("deepseek_v2", layers=27, experts=64, top_k=6, hidden=32,
                                   inter=16, overrides={"num_key_value_heads": 4},
                                   dtype=torch.float32)
            eng = hf.offload(m, dtype="f32", cache=0.25, prefetch=True, device=dev)
            try:
                V = m.config.vocab_size
                assert eng.set_token_pieces([pieces_of[i % len(pieces_of)] for i in range(V)]
                                            if prior else None) == prior
                eng.set_prefetch(True, overfetch=1.0, predictor="learned")
                eng.reset_stats()
                with torch.no_grad():
                    m.generate(torch.tensor([PROMPT], device=_dev(dev)), max_new_tokens=6,
                               min_new_tokens=6, do_sample=False)
                c = eng.layers.counters()
                got[dev, prior] = (c["predicted"], c["true_positive"])
            finally:
                eng.close()
    assert got["cpu", True] == got[device, True] and got["cpu", False] == got[device, False]
    assert got["cpu", True] != got["cpu", False], got


@pytest.mark.parametrize("device", DEVICES)
def test_prefetch_admission_on_the_gpu_tier(device):
    """The GPU cache's slot table runs the same admission rule (csrc/admit.h): switched by
    set_prefetch(admission=), refusals counted, tokens unchanged."""
    m, _ = _tiny()
    eng = hf.offload(m, dtype="f32", cache=0.25, prefetch=True, device=device)
    try:
        x = torch.tensor([PROMPT], device=_dev(device))
        with torch.no_grad():
            want = m(x).logits
        eng.set_prefetch(True, admission=True)
        assert eng.admission is True
        eng.reset_stats()
        with torch.no_grad():
            for t in range(2, len(PROMPT) + 1):
                m(x[:, :t])
            got = m(x).logits
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        st = eng.stats()
        assert "prefetch_refused" in st
        assert st["prefetch_refused"] + st["prefetch_issued"] + st["prefetch_dropped"] > 0
        with pytest.raises(TypeError, match="admission"):
            eng.set_prefetch(True, admission=1)
    finally:
        eng.close()


@pytest.mark.parametrize("device", DEVICES)
def test_trace_recording_as_on_the_cpu(device):
    traces = {}
    for dev in ("cpu", device):
        m, _ = _tiny()
        eng = hf.offload(m, dtype="f32", cache=0.5, device=dev)
        try:
            with eng.trace(logits=True) as t, torch.no_grad():
                m(torch.tensor([PROMPT], device=_dev(dev)))
            traces[dev] = t.result()
        finally:
            eng.close()
    a, b = traces["cpu"], traces[device]
    assert a.experts.shape == b.experts.shape == (len(PROMPT), 3, 2)
    assert (a.experts == b.experts).mean() >= 0.98
    np.testing.assert_allclose(a.logits, b.logits, rtol=1e-3, atol=1e-3)
    assert "GpuEngine" in b.source


class _PyLRU:
    def __init__(self):
        self.t, self.last, self.events = 0, {}, []

    def on_insert(self, slot, key, prefetch):
        self.t += 1
        self.last[slot] = self.t
        self.events.append("insert")

    def on_access(self, slot, key):
        self.t += 1
        self.last[slot] = self.t

    def victim(self, candidates):
        self.events.append("victim")
        return min(candidates, key=lambda s: self.last.get(s, 0))


@pytest.mark.parametrize("device", DEVICES)
def test_python_policy(device):
    m, ref = _tiny()
    pol = _PyLRU()
    eng = hf.offload(m, device=device, dtype="f32", cache=0.25, policy=pol)
    try:
        x = torch.tensor([PROMPT], device=_dev(device))
        with torch.no_grad():
            torch.testing.assert_close(m(x).logits, ref.to(_dev(device))(x).logits,
                                       rtol=1e-4, atol=1e-4)
        assert "insert" in pol.events and "victim" in pol.events
    finally:
        eng.close()


@pytest.mark.parametrize("device", DEVICES)
def test_balancer_moves_cold_misses_to_the_cpu_kernels_same_outputs(device):
    """The hybrid tier (issue 37; MoE-SpAc's balancer, §3.3) with a profile that makes the CPU
    cheap: in the layer's one C call, misses run on the CPU kernels from the host copy
    instead of being copied, and the outputs stay the model's."""
    m, ref = _tiny()
    prof = cuda.BalanceProfile(t_io=1.0, t_gpu=1.0, t_cpu=1e-3)
    eng = hf.offload(m, device=device, dtype="f32", cache=0.25, balance=prof, prefetch=False)
    try:
        eng.set_balance(prof, admit=False)  # residency then follows the copies alone
        x = torch.tensor([PROMPT], device=_dev(device))
        with torch.no_grad():
            torch.testing.assert_close(m(x).logits, ref.to(_dev(device))(x).logits,
                                       rtol=1e-4, atol=1e-4)
        st = eng.stats()
        assert st["cpu_experts"] > 0 and st["hybrid_copied"] == 0, st
        assert st["misses"] == 0 and st["hybrid_admitted"] == 0, st  # nothing was copied
        assert st["hybrid_cpu_pairs"] >= st["cpu_experts"]
    finally:
        eng.close()


def _hybrid_layer_engine(device: str, prefetch: bool):
    """The tiny model offloaded to the hybrid tier with costs under which a 24-token layer call
    both copies and leaves experts to the CPU, and admits some of those (Eq. 9 and 10):
    (model, engine, profile)."""
    m, _ = _tiny()
    prof = cuda.BalanceProfile(t_io=2e-4, t_gpu=5e-5, t_cpu=4e-5)
    eng = hf.offload(m, device=device, dtype="f32", cache=0.25, balance=prof, prefetch=prefetch)
    return m, eng, prof


@pytest.mark.parametrize("device", DEVICES)
def test_hybrid_split_is_eq9_per_layer(device):
    """Each layer call's split equals a brute-force reading of MoE-SpAc's Eq. 9 over that
    layer's missing experts (token counts, most first) and its experts on the fast tier, and
    its admissions the Eq. 10 budget: a prefill (many tokens per expert) through one MoE
    layer, with the layer's slot states read before the call, and the layer's output equal to
    every expert computed by the CPU kernels."""
    from specmoe.runtime import kernels
    from tests.test_cuda import _eq9_best
    m, eng, prof = _hybrid_layer_engine(device, prefetch=False)
    try:
        rng = np.random.default_rng(3)
        T, H, k, E = 24, eng.spec.H, eng.top_k, eng.num_experts
        x = (rng.standard_normal((T, H)) * 0.5).astype(np.float32)
        splits = []
        for call in range(4):
            pos = call % len(eng.layer_ids)
            idx = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int64)
            w = rng.random((T, k)).astype(np.float32)
            eng._cache.wait_idle()  # the last call's admissions are in (or refused)
            states = eng._cache.layer_states(pos)
            cnt = np.bincount(idx.ravel(), minlength=E)
            need = np.flatnonzero(cnt)
            miss = sorted((e for e in need if states[e] == 0), key=lambda e: (-cnt[e], e))
            on_fast = sum(1 for e in need if states[e] != 0)
            counts = [int(cnt[e]) for e in miss]
            want_cut = _eq9_best(counts, on_fast, prof)  # test_cuda's brute force of Eq. 9
            # Eq. 10: admissions (hottest CPU experts first) fill the window max(T_cpu, T_gpu)
            # left after the cut's copies
            t_cpu = prof.t_cpu * float(sum(counts[want_cut:]))
            t_gpu = prof.t_io * want_cut + prof.t_gpu * (float(on_fast) + want_cut)
            spare = max(t_cpu, t_gpu) - prof.t_io * want_cut
            pays = sum(1 for c in counts[want_cut:] if prof.t_cpu * c > prof.t_gpu)
            want_admit = min(pays, int(np.floor(spare / prof.t_io)) if spare > 0 else 0)
            before = eng.layers.counters()
            xt = torch.from_numpy(x).to(_dev(device))
            out = eng.layer_forward(pos, xt, torch.from_numpy(idx).to(_dev(device)),
                                    torch.from_numpy(w).to(_dev(device))).float().cpu().numpy()
            after = eng.layers.counters()
            cut = after["hybrid_copied"] - before["hybrid_copied"]
            ncpu = after["hybrid_cpu_experts"] - before["hybrid_cpu_experts"]
            admitted = after["hybrid_admitted"] - before["hybrid_admitted"]
            assert (cut, ncpu, admitted) == (want_cut, len(miss) - want_cut, want_admit), \
                (call, counts)
            splits.append((cut, ncpu, admitted))
            # the layer's output: every expert's share by the CPU kernels (float64 sum)
            ref = np.zeros((T, H), np.float64)
            store = eng._store
            for e in need:
                rows = np.flatnonzero((idx == e).any(1))
                sc = np.array([w[r][list(idx[r]).index(e)] for r in rows], np.float32)
                y = np.zeros((T, H), np.float32)
                kernels.ffn(store.read_block(pos, int(e)), x, spec=eng.spec, rows=rows.astype(np.int32),
                            scale=sc, out=y)
                ref += y
            tol = 1e-4 if device == "emulate" else 2e-3
            np.testing.assert_allclose(out, ref, rtol=tol, atol=tol)
        assert any(c > 0 for c, _, _ in splits) and any(n > 0 for _, n, _ in splits), splits
        assert any(0 < a < n for _, n, a in splits), splits  # the budget binds somewhere
    finally:
        eng.close()


@pytest.mark.parametrize("device", DEVICES)
def test_hybrid_admissions_queue_behind_the_next_layers_predictions(device):
    """A layer call queues the next layer's predicted experts at its start and its Eq. 10
    admissions at its end; the worker must take the predictions first (the next layer needs
    them within the token, an admission serves this layer's next token) and the admissions
    hottest first.  Read from the queue with the worker paused, after single layer calls."""
    m, eng, _ = _hybrid_layer_engine(device, prefetch=True)
    try:
        rng = np.random.default_rng(5)
        T, H, k, E = 24, eng.spec.H, eng.top_k, eng.num_experts
        eng._cache.pause_worker(True)
        seen = 0
        for call in range(4):
            pos = call % (len(eng.layer_ids) - 1)  # a layer with a next one to predict
            idx = np.stack([rng.choice(E, k, replace=False) for _ in range(T)]).astype(np.int64)
            w = rng.random((T, k)).astype(np.float32)
            x = torch.from_numpy((rng.standard_normal((T, H)) * 0.5).astype(np.float32))
            before = eng.layers.counters()["hybrid_admitted"]
            eng.layer_forward(pos, x.to(_dev(device)), torch.from_numpy(idx).to(_dev(device)),
                              torch.from_numpy(w).to(_dev(device)))
            admitted = eng.layers.counters()["hybrid_admitted"] - before
            q = eng._cache.queued()
            layer_of = [key // E for key, _ in q]
            pred = [i for i, l in enumerate(layer_of) if l == pos + 1]
            adm = [i for i, l in enumerate(layer_of) if l == pos]
            assert len(adm) == admitted and set(layer_of) <= {pos, pos + 1}, (call, q)
            if pred and adm:
                seen += 1
                assert max(pred) < min(adm), (call, q)  # every prediction before any admission
            cnt = np.bincount(idx.ravel(), minlength=E)
            hot = [int(cnt[key % E]) for key, _ in q if key // E == pos]
            assert hot == sorted(hot, reverse=True), (call, q)  # hottest admission first
        assert seen > 0  # some call queued both kinds
    finally:
        eng.close()


@pytest.mark.parametrize("device", DEVICES)
def test_hybrid_admission_fills_the_cache_greedy_unchanged(device):
    """The GPU cache fills from what the CPU computed (admit: the CPU's experts go to the
    cache's worker, and the policy admits them), not by copies on the layer's path; greedy
    tokens stay the unmodified model's while residency changes under the split."""
    m, ref = _tiny()
    # as measured on the H200 (bf16): one token-expert on the CPU costs more than on the GPU,
    # so an expert the CPU computed pays to copy, and the layer's time leaves the link room
    # for it (Eq. 10)
    prof = cuda.BalanceProfile(t_io=1e-4, t_gpu=2e-4, t_cpu=3e-4)
    eng = hf.offload(m, device=device, dtype="f32", cache=0.25, policy="lru", balance=prof,
                     prefetch=False)
    try:
        got, want = _greedy_both(m, ref, device, 8)
        assert got == want
        eng._cache.wait_idle()
        st = eng.stats()
        assert st["hybrid_admitted"] > 0 and st["prefetch_issued"] > 0, st
        assert st["hits"] > 0, st  # admitted experts served later layers' calls
    finally:
        eng.close()


def test_hybrid_lookahead_queues_what_pays():
    """The draft's lookahead on the hybrid tier (issue 37 item 3): of a layer's expected
    experts not on the GPU, only the hottest whose copy pays (t_cpu * count > t_gpu) and
    fits Eq. 10's window (the layer's GPU time + the draft's time per layer, over t_io) are
    copied; the rest are left to the CPU (counted in lookahead_gated)."""
    m, _ = _tiny()
    prof = cuda.BalanceProfile(t_io=1e-4, t_gpu=1e-4, t_cpu=6e-5)
    eng = hf.offload(m, device="emulate", dtype="f32", cache=0.5, balance=prof, prefetch=True)
    try:
        E = eng.num_experts
        c = np.zeros(E)
        c[[1, 2, 3, 4, 5]] = [4, 3, 3, 2, 1]  # pays: 4, 3, 3, 2 tokens (6e-5 * 1 < 1e-4)
        eng._draft_s = 2e-4 * len(eng.layer_ids)  # the draft's time: 2e-4 per layer
        # window = 5 experts * 1e-4 + 2e-4 = 7e-4: seven copies would fit, four pay
        eng.lookahead({0: c})
        eng._cache.wait_idle()
        assert set(np.flatnonzero(eng._cache.layer_states(0))) == {1, 2, 3, 4}
        assert eng.stats()["lookahead_gated"] == 1 and eng._draft_s == 0.0
        c2 = np.zeros(E)
        c2[[0, 6, 7]] = [3, 2, 2]  # all pay; window = 3e-4 + 0 (no draft time): three fit,
        eng.lookahead({1: c2})     # but t_io = 1e-4 -> floor(3e-4 / 1e-4) may be 2 or 3
        eng._cache.wait_idle()
        got = set(np.flatnonzero(eng._cache.layer_states(1)))
        assert got >= {0, 6} and got <= {0, 6, 7}  # the hottest first
    finally:
        eng.close()


@pytest.mark.parametrize("device", DEVICES)
def test_hybrid_with_miss_rules_and_draft_tokens(device):
    """The split composes with SpecMD's miss rules and the MTP drafter's draft tokens (both
    refused with the balancer while it was a Python path)."""
    import specmoe
    from specmoe.speculation import mtp
    from specmoe.speculation.generation import StaticK
    m, ref = _tiny("qwen3_moe")
    prof = cuda.BalanceProfile(t_io=1.0, t_gpu=1.0, t_cpu=1e-3)
    eng = hf.offload(m, device=device, dtype="f32", cache=0.25, balance=prof, miss="drop",
                     miss_keep=1)
    try:
        x = torch.tensor([PROMPT], device=_dev(device))
        with torch.no_grad():
            m(x)
        st = eng.stats()
        assert st["dropped"] > 0 or st["cpu_experts"] > 0, st
        eng.set_miss("fetch")
        ad = mtp.MtpAdapter.for_model(m, k=2, rank=4, seed=1)
        ad.to(_dev(device))
        out = specmoe.generate(m, x, mtp.MtpDrafter(m, ad, fetch_masks=False), StaticK(2),
                               max_new_tokens=6, eos_token_id=None, tau=None)
        with torch.no_grad():
            want = ref.to(_dev(device)).generate(x, max_new_tokens=6, do_sample=False)
        assert out.sequences.tolist() == want.cpu().tolist()
        assert eng.stats()["cpu_experts"] > 0
    finally:
        eng.close()


@pytest.mark.parametrize("device", DEVICES)
def test_hybrid_on_a_store_larger_than_memory(tmp_path, monkeypatch, device):
    """Three tiers (issue 37): when the store does not fit in memory (the engine's mode
    "auto" picks "staged": no pinned copy of it), the CPU's experts are computed from the
    store file mapped into memory -- the page cache is the RAM tier between the disk and the
    GPU.  Greedy tokens stay the model's; a block damaged on disk is a named StoreError from
    that path, not a wrong output."""
    import specmoe
    from specmoe.runtime import engine_base
    monkeypatch.setenv("SPECMOE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(engine_base, "memory_limit", lambda: 0)  # nothing fits in memory
    m, ref = _tiny()
    spare = copy.deepcopy(m)
    folder = testing.save_checkpoint(m, tmp_path / "ckpt")
    prof = cuda.BalanceProfile(t_io=1.0, t_gpu=1.0, t_cpu=1e-3)  # the CPU takes every miss
    model = specmoe.from_pretrained(folder, device=device, dtype="f32", gpu_cache="25%",
                                    balance=prof, prefetch=False)
    eng = specmoe.engine_of(model)
    try:
        eng.set_balance(prof, admit=False)  # nothing copied: every miss through the mapping
        assert eng.stats()["mode"] == "staged"
        got, want = _greedy_both(model, ref, device, 5)
        assert got == want
        st = eng.stats()
        assert st["cpu_experts"] > 0 and st["misses"] == 0, st
        store = eng._store
        path, off, bb, ne = store.path, store.data_offset, store.block_bytes, store.num_experts
    finally:
        eng.close()
    # damage every block of MoE layer 1 on disk (from_pretrained would see it and convert
    # again, so an engine is opened on the damaged file itself): a block's CRC is checked on
    # its first use through the mapping, and the damage is refused there
    with open(path, "r+b") as f:
        for e in range(ne):
            f.seek(off + (ne + e) * bb + 64)
            b = f.read(1)
            f.seek(-1, 1)
            f.write(bytes([b[0] ^ 0xFF]))
    eng = GpuEngine(spare, path, device=device, cache=0.25, balance=prof, prefetch=False)
    try:
        eng.set_balance(prof, admit=False)
        from specmoe import StoreError
        with pytest.raises(StoreError, match="checksum mismatch.*hybrid tier's mapping"):
            with torch.no_grad():
                spare(torch.tensor([PROMPT], device=_dev(device)))
    finally:
        eng.close()


def test_hybrid_refusals():
    """Bad settings of the split get named errors and change nothing."""
    m, _ = _tiny()
    eng = hf.offload(m, device="emulate", dtype="f32", cache=0.25)
    try:
        with pytest.raises(ValueError, match="finite"):
            eng.layers.set_hybrid(True, -1.0, 0.0, 0.0)
        assert eng.balance is None
        with pytest.raises(TypeError, match="BalanceProfile"):
            eng.set_balance("fast")
    finally:
        eng.close()
    from specmoe import _C
    with pytest.raises(ValueError, match="descending"):
        _C.balance_cut([1, 2], 0, 1e-3, 1e-3, 1e-3)
    with pytest.raises(ValueError, match="finite and >= 0, got t_io=nan"):
        _C.balance_cut([2, 1], 0, float("nan"), 1e-3, 1e-3)
    cpu = hf.offload(_tiny()[0], dtype="f32", cache=0.25)
    try:  # the CPU tier has no host copy to split against
        with pytest.raises(Exception, match="no host path"):
            cpu.layers.set_hybrid(True, 1e-3, 1e-3, 1e-3)
    finally:
        cpu.close()


@pytest.mark.parametrize("device", DEVICES)
def test_speculative_generate_with_ngram_drafts_equals_greedy(device):
    import specmoe
    m, ref = _tiny()
    eng = hf.offload(m, device=device, dtype="f32", cache=0.5)
    try:
        x = torch.tensor([PROMPT * 2], device=_dev(device))
        out = specmoe.generate(m, x, max_new_tokens=8, drafter=specmoe.NgramDrafter(),
                               lookahead=False)
        with torch.no_grad():
            want = ref.to(_dev(device)).generate(x, max_new_tokens=8, do_sample=False)
        assert out.sequences.tolist() == want.tolist()
        assert out.stats["experts_loaded"] > 0
    finally:
        eng.close()


def test_emulate_refusals():
    m, _ = _tiny()
    with pytest.raises(ValueError, match="BalanceProfile"):
        hf.offload(m, device="emulate", balance=True)
    with pytest.raises(ValueError, match="emulate"):
        hf.offload(m, device="tpu")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("overlap", [False, True])
def test_self_draft_and_lookahead(device, overlap):
    """MoE-SpeQ on the GPU tier: SelfDraft (an int4 copy of every expert resident on the
    device) drafts, the draft's routing is the lookahead buffer queued and shielded before
    verification; greedy output equals plain decoding, the lookahead's precision is counted,
    and with overlap the draft's own steps queue prefetches."""
    import specmoe
    from specmoe.speculation.drafters import SelfDraft
    m, ref = _tiny()
    eng = hf.offload(m, device=device, dtype="f32", cache=0.25)
    try:
        x = torch.tensor([PROMPT], device=_dev(device))
        drafter = SelfDraft(eng, "int4", overlap=overlap)
        assert eng.draft_dtype == "int4"
        out = specmoe.generate(m, x, max_new_tokens=10, drafter=drafter, lookahead=True)
        with torch.no_grad():
            want = ref.to(_dev(device)).generate(x, max_new_tokens=10, do_sample=False)
        assert out.sequences.tolist() == want.tolist()
        st = eng.stats()
        assert st["lookahead_predicted"] > 0 and st["lookahead_precision"] is not None
        assert (st["draft_prefetch_queued"] > 0) == overlap
    finally:
        eng.close()


@pytest.mark.parametrize("device", DEVICES)
def test_lookahead_counts_the_next_pass(device):
    """engine.lookahead(counts): a bad call is refused; the expected experts are counted
    against the layers the next pass runs (3 predicted: two in layer 0, one in layer 2)."""
    m, _ = _tiny()
    eng = hf.offload(m, device=device, dtype="f32", cache=0.5, prefetch=False)
    try:
        E = eng.num_experts
        with pytest.raises(ValueError, match="lookahead"):
            eng.lookahead({7: np.ones(E)})
        counts = {0: np.eye(E)[1] + np.eye(E)[3], 2: np.eye(E)[5]}
        eng.lookahead(counts)
        with torch.no_grad():
            m(torch.tensor([PROMPT[:1]], device=_dev(device)))
        st = eng.stats()
        assert st["lookahead_predicted"] == 3 and st["lookahead_used"] > 0
    finally:
        eng.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("hybrid", [False, True], ids=["copies", "gpu_cache"])
def test_from_pretrained_on_the_gpu_tier(tmp_path, monkeypatch, device, hybrid):
    """from_pretrained(device=...), and the hybrid tier's one word (issue 37):
    ``gpu_cache=`` sizes the GPU cache and turns the CPU/GPU split on (its costs measured on a
    GPU; the emulation is given them)."""
    import specmoe
    monkeypatch.setenv("SPECMOE_CACHE", str(tmp_path / "cache"))
    m, ref = _tiny()
    folder = testing.save_checkpoint(m, tmp_path / "ckpt")
    if hybrid:
        kw = {"gpu_cache": "25%"}
        if device == "emulate":
            kw["balance"] = cuda.BalanceProfile(t_io=1e-3, t_gpu=1e-5, t_cpu=1e-5)
        with pytest.raises(ValueError, match="device='cuda'"):
            specmoe.from_pretrained(folder, gpu_cache="25%")
    else:
        kw = {"cache": 0.25}
    model = specmoe.from_pretrained(folder, device=device, dtype="f32", **kw)
    eng = specmoe.engine_of(model)
    try:
        assert isinstance(eng, GpuEngine) and (eng.balance is not None) == hybrid
        got, want = _greedy_both(model, ref, device, 5)
        assert got == want
        assert (eng.stats()["cpu_experts"] > 0) == hybrid
    finally:
        eng.close()


@pytest.mark.parametrize("device", DEVICES)
def test_mtp_drafting_with_draft_tokens(device):
    """The MTP drafter's mask tokens are draft tokens on the GPU tier as on the CPU
    (engine.draft_tokens): greedy output equals plain greedy; the masks load fewer experts
    than with fetch_masks=True (draft_kept counts the pairs served without a load)."""
    import specmoe
    from specmoe.speculation import mtp
    from specmoe.speculation.controllers import StaticK
    from tests.test_mtp import _randomise
    model = testing.tiny_model("qwen3_moe", vocab=64, dtype=torch.float32)
    ref = copy.deepcopy(model)
    eng = hf.offload(model, device=device, dtype="f32", cache=0.25)
    try:
        ad = mtp.MtpAdapter.for_model(model, k=2, rank=4, seed=1)
        _randomise(ad, 2)
        ad.to(_dev(device))
        ids = torch.tensor([[5, 9, 11, 5, 9, 11, 5, 9, 30, 31, 5, 9]], device=_dev(device))
        with torch.no_grad():
            want = ref.to(_dev(device)).generate(ids, max_new_tokens=10, do_sample=False)
        loads = {}
        for fetch in (True, False):
            eng.reset_stats()
            out = specmoe.generate(model, ids, mtp.MtpDrafter(model, ad, fetch_masks=fetch),
                                   StaticK(2), max_new_tokens=10, eos_token_id=None, tau=None)
            assert out.sequences.tolist() == want.tolist(), fetch
            assert out.stats["proposed"] > 0
            loads[fetch] = out.stats["experts_loaded"]
            assert (eng.stats()["draft_kept"] > 0) == (not fetch)
        assert loads[False] <= loads[True]
        with eng.draft_tokens([0, 1, 1]):
            with pytest.raises(RuntimeError, match="already inside"):
                with eng.draft_tokens([1]):
                    pass
            with pytest.raises(ValueError, match="3 flags"):
                with torch.no_grad():
                    model(torch.tensor([[1, 2, 3, 4, 5]], device=_dev(device)))
    finally:
        eng.close()


@pytest.mark.parametrize("device", DEVICES)
def test_a_layer_is_one_c_call(device, monkeypatch):
    """Issue 36 item 2: a GPU MoE layer is one ``_C.Layers.forward_on`` call (csrc/layer.c over
    cuda/gtier.c, through ``cuda.layer_call``): one call per MoE layer per forward, and the
    layer counters come from C."""
    calls: list[int] = []
    real = cuda.layer_call

    def counting(layers, pos, *a, **k):
        calls.append(pos)
        return real(layers, pos, *a, **k)
    monkeypatch.setattr(cuda, "layer_call", counting)
    m, ref = _tiny("deepseek_v3")
    eng = hf.offload(m, device=device, dtype="f32", cache=0.25)
    try:
        x = torch.tensor([PROMPT], device=_dev(device))
        with torch.no_grad():
            torch.testing.assert_close(m(x).logits, ref.to(_dev(device))(x).logits,
                                       rtol=1e-4, atol=1e-4)
        c = eng.layers.counters()
        assert c["passes"] == 1 and c["tokens"] == len(PROMPT)
        assert calls == list(range(len(eng.layer_ids)))
        assert eng.stats()["gpu_experts"] > 0
    finally:
        eng.close()
    assert eng.layers is None


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", ["int4", "f32", "lowest_bit"])
def test_grouped_launches_equal_one_call_per_expert(device, case, monkeypatch):
    """Issue 36 item 2: a layer's experts of few tokens run as one launch group (tier.h
    ``experts``; cuda/ffn.cu smoe_gpu_ffn_forward_group: gate/up, down, combine) instead of one
    kernel call per expert.  The logits equal those of the per-expert calls
    (``SPECMOE_GPU_GROUPED=0``): bit for bit where both take the dequantizing kernels (the
    emulation, int4 and the resident int4 copy of SpecMD's lowest_bit on a GPU), within f32
    rounding where the per-expert call of an f32 expert is cuBLAS's.  (Which experts are
    resident does not change an expert's result, except under lowest_bit.)  A 40-token prompt
    gives experts of more than SMOE_TIER_GROUP_T tokens (alone) beside groups, and a cache of
    a quarter of the experts bounds a group by its slots."""
    long_prompt = [(7 * i + 3) % 120 + 1 for i in range(40)]
    dtype = "f32" if case == "f32" else "int4"
    # lowest_bit without the worker: every miss served by the int4 copy (no fetch finishing
    # in the background to make the next call's hits depend on timing)
    miss = (dict(miss="lowest_bit", miss_levels="int4", prefetch=False)
            if case == "lowest_bit" else {})
    if case == "lowest_bit":
        dtype = "f32"
    logits, grouped = {}, {}
    for flag in ("0", "1"):
        monkeypatch.setenv("SPECMOE_GPU_GROUPED", flag)
        m, _ = _tiny("qwen3_moe")
        eng = hf.offload(m, device=device, dtype=dtype, cache=0.25, **miss)
        try:
            grouped[flag] = eng._tier.grouped
            out = []
            with torch.no_grad():
                for ids in (PROMPT, long_prompt, PROMPT[:1]):
                    out.append(m(torch.tensor([ids], device=_dev(device))).logits.cpu())
            logits[flag] = out
            assert eng.stats()["gpu_experts"] > 0
        finally:
            eng.close()
    assert grouped == {"0": False, "1": True}
    exact = device == "emulate" or case != "f32"
    for a, b in zip(logits["1"], logits["0"]):
        torch.testing.assert_close(a, b, rtol=0 if exact else 1e-4, atol=0 if exact else 1e-4)


MISS_CASES = [dict(miss="drop", miss_keep=1), dict(miss="substitute"),
              dict(miss="lowest_bit", miss_levels="int4"),
              dict(miss="priority", miss_keep=1, miss_levels="int8:int4", miss_keep2=1),
              dict(route_lambda=0.5)]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", MISS_CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in
                                                                      c.items()))
def test_specmd_miss_rules_as_on_the_cpu(device, case):
    """SpecMD's miss rules and cache-aware routing run on the GPU tier by the CPU's C code
    (csrc/layer.c step 4 over the GPU cache): on the same model, prompt and cache (prefetch
    off, so residency follows the demand accesses alone) both tiers make the same decisions --
    equal counters -- and the same outputs."""
    got = {}
    for dev in ("cpu", device):
        m, _ = _tiny("deepseek_v3")
        eng = hf.offload(m, device=dev, dtype="f32", cache=0.25, prefetch=False,
                         dense="torch", **case)
        try:
            x = torch.tensor([PROMPT], device=_dev(dev))
            with torch.no_grad():
                logits = m(x).logits.float().cpu()
                step = m(x[:, :1]).logits.float().cpu()  # a decode-sized call too
            st = eng.stats()
            got[dev] = (logits, step, {k: st[k] for k in ("missing", "dropped", "substituted",
                                                          "lowbit", "lowbit2", "rerouted")})
        finally:
            eng.close()
    (la, sa, ca), (lb, sb, cb) = got["cpu"], got[device]
    assert ca == cb
    assert ca["missing"] > 0
    key = {"drop": "dropped", "substitute": "substituted", "lowest_bit": "lowbit",
           "priority": "lowbit2"}.get(case.get("miss"), "rerouted")
    assert ca[key] > 0, ca
    tol = 1e-5 if device == "emulate" else 2e-3
    torch.testing.assert_close(lb, la, rtol=tol, atol=tol)
    torch.testing.assert_close(sb, sa, rtol=tol, atol=tol)


def test_gpu_refusals_name_the_reason():
    m, _ = _tiny()
    with pytest.raises(ValueError, match="int2"):
        hf.offload(m, device="emulate", miss="lowest_bit", miss_levels="int2")
    with pytest.raises(ValueError, match="throttle"):
        hf.offload(m, device="emulate", throttle=(-1.0, 0.0))
    eng = hf.offload(m, device="emulate", dtype="f32", cache=0.25)
    try:
        with pytest.raises(ValueError, match="int2"):
            eng.set_miss("priority", miss_levels="int4:int2")
        assert eng.miss == "fetch"  # nothing changed
        eng.set_miss("drop", miss_keep=1)
        assert eng.stats()["miss"] == "drop"
    finally:
        eng.close()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("drafter", ["self", "ngram"])
def test_batched_speculation_equals_batched_greedy(device, drafter):
    """Batched speculative decoding (specmoe.speculation.batch: B left-padded rows advancing
    by different amounts) on the GPU tier: every row's tokens equal transformers' own batched
    greedy decoding of the unmodified model."""
    import specmoe
    from specmoe import zoo
    from specmoe.speculation.controllers import StaticK
    from specmoe.speculation.drafters import NgramDrafter, SelfDraft
    texts = ["def f(x):\n    return x", "The quick brown fox jumps over the lazy dog and the",
             "for i in range(10):\n    print(i)\n    if i"]
    model, tok = zoo.load("tiny-moe", experts_implementation="eager")
    ref_model = copy.deepcopy(model).to(_dev(device))
    tok.padding_side = "left"
    enc = tok(texts, return_tensors="pt", padding=True)
    ids, mask = enc.input_ids.to(_dev(device)), enc.attention_mask.to(_dev(device))
    n = 12
    with torch.no_grad():
        want = ref_model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=n,
                                  min_new_tokens=n)[:, ids.shape[1]:]
    eng = specmoe.offload(model, device=device, cache=0.25, dtype="f32")
    try:
        d = SelfDraft(eng) if drafter == "self" else NgramDrafter()
        out = specmoe.generate(model, ids, d, StaticK(3), attention_mask=mask,
                               max_new_tokens=n, eos_token_id=None)
        assert torch.equal(out.sequences[:, ids.shape[1]:].cpu(), want.cpu())
        assert out.stats["proposed"] > 0
        assert out.iterations[0]["batch"] == len(texts)  # (finished rows leave the batch)
    finally:
        eng.close()


def test_layers_refuse_calls_of_the_other_tier():
    """_C.Layers over a CPU cache and over a device tier refuse each other's calls with a
    named error, and a device tier's draft forward needs a draft copy."""
    from specmoe import _C
    m, _ = _tiny()
    cpu = hf.offload(m, dtype="f32", cache=0.25)
    try:
        E, k = cpu.num_experts, cpu.top_k
        x = np.zeros((1, m.config.hidden_size), np.float32)
        idx, w = np.zeros((1, k), np.int64), np.zeros((1, k), np.float32)
        idx[0] = np.arange(k)
        used = np.zeros(E, np.uint8)
        with pytest.raises(ValueError, match="device tier"):
            cpu.layers.forward_on(0, x, idx, w, used, x.ctypes.data, x.ctypes.data, 0)
        with pytest.raises(TypeError, match="device tier"):
            c = cpu.lowbit_copy("int4")
            cpu.layers.set_lowbit(c.buf.ctypes.data, c.desc, c.block_bytes, size=c.buf.nbytes)
    finally:
        cpu.close()
    m, _ = _tiny()
    gpu = hf.offload(m, device="emulate", dtype="f32", cache=0.25)
    try:
        out = np.zeros_like(x)
        with pytest.raises(ValueError, match="forward_on"):
            gpu.layers.forward(0, x, idx, w, out, used)
        with pytest.raises(_C.CacheError, match="draft copy"):
            gpu.layers.forward_draft(0, idx, w, used, x.ctypes.data, out.ctypes.data, 0)
        gpu.layers.forward_on(0, x, idx, w, used, x.ctypes.data, out.ctypes.data, 0)
        assert used[:k].all() and not used[k:].any()
    finally:
        gpu.close()


@pytest.mark.parametrize("device", DEVICES)
def test_link_throttle_slows_the_gpu_cache_loads(device):
    """SpecMD A.4's link emulation (csrc/link.h, the CPU cache's rule) on the GPU cache: with
    a 20 ms latency per load, a forward's demand misses take at least that long each (stall
    time >= misses * 20 ms, prefetch off), outputs unchanged; off again, stalls are short."""
    import time
    m, ref = _tiny()
    eng = hf.offload(m, device=device, dtype="f32", cache=0.25, prefetch=False,
                     throttle=(1000.0, 20000.0))
    try:
        x = torch.tensor([PROMPT], device=_dev(device))
        eng.reset_stats()
        t0 = time.perf_counter()
        with torch.no_grad():
            torch.testing.assert_close(m(x).logits, ref.to(_dev(device))(x).logits,
                                       rtol=1e-4, atol=1e-4)
        wall = time.perf_counter() - t0
        st = eng.stats()
        assert st["misses"] > 0 and wall >= 0.02 * st["misses"] * 0.99, (wall, st["misses"])
        eng.set_miss(throttle=None)
        assert eng.throttle is None
    finally:
        eng.close()


@pytest.mark.parametrize("device", ["cpu"] + DEVICES)
def test_prediction_settings_live_in_the_c_layers(device):
    """prefetch, overfetch and mass have one owner, the C layers: the engine reads them back
    from there (Layers.config()), a setter changes them there, and they survive a rebuilt
    cache (CPU) and close()."""
    m, _ = _tiny()
    eng = hf.offload(m, device=device, dtype="f32", cache=0.25, prefetch=False, overfetch=2.0)
    try:
        c = eng.layers.config()
        assert (c["prefetch"], c["overfetch"], c["mass"]) == (False, 2.0, 0.0)
        assert (eng.prefetch, eng.overfetch, eng.mass) == (False, 2.0, None)
        eng.set_prefetch(True, mass=0.7)
        c = eng.layers.config()
        assert (c["prefetch"], c["overfetch"], c["mass"]) == (True, 2.0, pytest.approx(0.7))
        assert eng.mass == pytest.approx(0.7) and eng.prefetch
        eng.layers.configure(False, 1.25, 0.0, c["feed_counts"])  # the C side is the owner
        assert (eng.prefetch, eng.overfetch, eng.mass) == (False, 1.25, None)
        if device == "cpu":
            eng.set_cache(0.5)  # new C layers: the settings carry over
            assert (eng.prefetch, eng.overfetch) == (False, 1.25)
        eng.set_policy("lfu")
        assert (eng.prefetch, eng.overfetch) == (False, 1.25)
    finally:
        eng.close()
    assert (eng.prefetch, eng.overfetch, eng.mass) == (False, 1.25, None)


@pytest.mark.parametrize("device", ["cpu"] + DEVICES)
def test_miss_settings_live_in_the_c_layers(device, monkeypatch):
    """miss, miss_keep, route_lambda and miss_keep2 have one owner too, the C layers: the
    engine reads them back from Layers.config(), set_miss changes them there (a set_miss that
    fails half-way leaves them, the levels and the throttle as they were), and they survive a
    rebuilt cache (CPU), a policy switch and close()."""
    m, _ = _tiny()
    eng = hf.offload(m, device=device, dtype="f32", cache=0.25, prefetch=False, miss="drop",
                     miss_keep=1, route_lambda=0.25)
    k = eng.top_k
    assert k >= 2

    def both():
        c = eng.layers.config()
        mine = (eng.miss, eng.miss_keep, eng.route_lambda, eng.miss_keep2)
        assert (c["miss"], c["miss_keep"], c["route_lambda"], c["miss_keep2"]) == mine
        return mine
    try:
        assert both() == ("drop", 1, 0.25, k)
        eng.set_miss("priority", miss_keep=0, miss_levels="int8:int4")
        assert both() == ("priority", 0, 0.25, k // 2)   # keep2: the lower half of the ranks
        assert eng.lowbit_copies == ("int8", "int4")
        eng.layers.set_miss("substitute", 1, 0.5)        # the C side is the owner
        assert both() == ("substitute", 1, 0.5, k)
        eng.set_miss(route_lambda=0.0)   # miss_keep2 "auto": the default for the two levels
        half = 1 + (k - 1) // 2
        assert both() == ("substitute", 1, 0.0, half)
        # a failure after the C layers were set to "fetch" (set_lowbit of the new copy):
        # everything back as it was
        calls = []
        real = eng.copy_buffer

        def fail_once(c):
            calls.append(c.dtype)
            if len(calls) == 1:
                raise MemoryError("no room for the copy")
            return real(c)
        monkeypatch.setattr(eng, "copy_buffer", fail_once)
        with pytest.raises(MemoryError):
            eng.set_miss("lowest_bit", miss_levels="int4", throttle=(100.0, 1.0))
        assert calls and both() == ("substitute", 1, 0.0, half)
        assert eng.miss_levels == ("int8", "int4") and eng.throttle is None
        monkeypatch.undo()
        eng.set_miss("priority", miss_keep=1, miss_keep2=1)
        assert both() == ("priority", 1, 0.0, 1)
        if device == "cpu":
            old = eng.layers
            eng.set_cache(0.5)  # new C layers: the settings carry over
            assert eng.layers is not old and both() == ("priority", 1, 0.0, 1)
        eng.set_policy("lfu")
        assert both() == ("priority", 1, 0.0, 1)
    finally:
        eng.close()
    assert eng.layers is None
    assert (eng.miss, eng.miss_keep, eng.route_lambda, eng.miss_keep2) == ("priority", 1, 0.0, 1)

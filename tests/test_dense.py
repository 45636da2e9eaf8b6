"""Dense linear layers through the C kernels (specmoe.models.dense, issue 16): the kernel against a
numpy reference on the dequantized weights, the torch path on the same bytes, offload with
dense layers converted (greedy tokens equal to the unmodified model), and bad input."""
import math

import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache

from specmoe import _C
from specmoe.runtime import engine as hf
from specmoe.models.dense import convert_dense, resolve_dense
from specmoe.models import layers
from specmoe.models.layers import DENSE_DTYPES, CLinear, linear_widened, torch_bf16_gemm_fast
from specmoe.runtime.kernels import context
from specmoe.storage.quant import (bf16_to_f32, dequantize_int4, dequantize_int8, f32_to_bf16,
                                   quantize_int4, quantize_int8)
from specmoe.models.arch import SUPPORTED
from specmoe.models.testing import tiny_model

PROMPT = torch.tensor([[1, 5, 9, 14, 3, 27, 8, 60]])


def _ref_weight(w: np.ndarray, dtype: str) -> np.ndarray:
    """The weights the kernel should compute with, made by specmoe.storage.quant (not by the packer)."""
    if dtype == "f32":
        return w
    if dtype == "bf16":
        return bf16_to_f32(f32_to_bf16(w)).reshape(w.shape)
    if dtype == "int8":
        return dequantize_int8(*quantize_int8(w))
    g = next(g for g in (128, 64, 32) if w.shape[1] % g == 0)
    return dequantize_int4(*quantize_int4(w, g))


# the AVX-512 fast paths round x once per call (kernels.h "Accuracy"); int4 by the most
TOL = {"f32": 1e-5, "bf16": 1e-2, "int8": 1e-3, "int4": 3e-2}


@pytest.mark.parametrize("dtype", DENSE_DTYPES)
@pytest.mark.parametrize("N,K", [(96, 64), (200, 256), (384, 384), (136, 320)])
@pytest.mark.parametrize("bias", [False, True])
def test_clinear_matches_numpy(dtype, N, K, bias):
    torch.manual_seed(N + K)
    lin = nn.Linear(K, N, bias=bias)
    w = lin.weight.detach().numpy()
    wr = _ref_weight(w, dtype)
    c = CLinear(lin, dtype, torch_above=None)
    # 1 and 5 tokens (decode), 70 (more than one internal chunk of 64)
    for T in (1, 5, 70):
        x = torch.randn(T, K)
        ref = x.numpy().astype(np.float64) @ wr.T.astype(np.float64)
        if bias:
            ref += lin.bias.detach().numpy()
        y = c(x).numpy()
        err = np.linalg.norm(y - ref) / np.linalg.norm(ref)
        assert err < TOL[dtype], (T, err)
        # rows are independent: the first row alone gives the same answer
        y1 = c(x[:1]).numpy()
        np.testing.assert_allclose(y1[0], y[0], rtol=1e-5, atol=1e-5)


def _huge_kb_at(addr: int) -> int:
    """AnonHugePages (kB) of the mapping holding address addr (/proc/self/smaps)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and not head.endswith(":"):
            lo, hi = (int(v, 16) for v in head.split("-"))
            inside = lo <= addr < hi
        elif inside and line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return 0


def _kernel_collapse_error() -> str | None:
    """None when the kernel can put a fresh, written 2 MB region on a huge page right now
    (MADV_COLLAPSE), else why not (no free huge page at this moment, or no MADV_COLLAPSE):
    tells a machine whose memory is fragmented from a Linear that did not ask."""
    import ctypes
    import mmap
    huge, n = 2 << 20, 4 << 20
    m = mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # (not shmem)
    buf = (ctypes.c_char * n).from_buffer(m)
    try:
        m.write(b"\1" * n)
        a = (ctypes.addressof(buf) + huge - 1) & ~(huge - 1)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
        if libc.madvise(ctypes.c_void_p(a), huge, 25) == 0:  # MADV_COLLAPSE
            return None
        return os.strerror(ctypes.get_errno())
    finally:
        del buf
        m.close()


@pytest.mark.skipif(not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled") or
                    "[never]" in open("/sys/kernel/mm/transparent_hugepage/enabled").read(),
                    reason="needs Linux transparent huge pages (not 'never')")
def test_linear_weights_move_to_huge_pages():
    """A _C.Linear asks for its (already written) weights on 2 MB pages (smoe_advise_huge:
    MADV_HUGEPAGE + MADV_COLLAPSE): the mapping holding its block gains huge pages (fails
    with SPECMOE_HUGEPAGES=0) and the values are unchanged."""
    from numpy._core import multiarray
    lin = nn.Linear(4096, 2048, bias=False)
    # numpy itself asks for huge pages on large arrays: not for this 8 MB block, so that
    # only the Linear's own request can put it there
    was = multiarray._set_madvise_hugepage(False)
    try:
        c = CLinear(lin, "int8", torch_above=None)
    finally:
        multiarray._set_madvise_hugepage(was)
    if _huge_kb_at(c._block.ctypes.data + c._block.nbytes // 2) < 2048:
        why = _kernel_collapse_error()  # the machine, or the Linear?
        if why is not None:
            pytest.skip(f"the kernel cannot collapse a region to huge pages now ({why})")
        pytest.fail("the Linear's weights are not on huge pages, though the kernel can "
                    "collapse a region right now")
    x = torch.randn(1, 4096)
    ref = x.numpy().astype(np.float64) @ _ref_weight(lin.weight.detach().numpy(), "int8").T
    err = np.linalg.norm(c(x).numpy() - ref) / np.linalg.norm(ref)
    assert err < TOL["int8"]


def test_leading_dims_and_output_dtype():
    lin = nn.Linear(64, 32).to(torch.bfloat16)
    c = CLinear(lin, "bf16")
    x = torch.randn(2, 3, 64).to(torch.bfloat16)
    y = c(x)
    assert y.shape == (2, 3, 32) and y.dtype == torch.bfloat16
    ref = F.linear(x.float(), lin.weight.float(), lin.bias.float())
    torch.testing.assert_close(y.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", DENSE_DTYPES)
def test_bf16_io_same_bits_as_f32_io_and_torch_casts(dtype):
    """The binding takes bf16 x and out directly (widening x, rounding out to nearest even):
    the same bits as f32 in / out with torch's casts around the call, over several internal
    chunks of 64 tokens, a NaN row and values past bf16's range included."""
    torch.manual_seed(1)
    lin = nn.Linear(64, 40, bias=True)
    c = CLinear(lin, dtype, torch_above=None)
    for T in (1, 3, 130):
        x = (torch.randn(T, 64) * 3).to(torch.bfloat16)
        x[0, 5] = float("nan")                        # row 0: NaN everywhere
        if T > 1:
            x[1] = x[1] * 1e37                        # row 1: near / past the float range
        ref = torch.empty(T, 40)
        c._c.forward(x.float().numpy(), ref.numpy())
        y32 = torch.empty(T, 40)
        c._c.forward(x.view(torch.int16).numpy(), y32.numpy())     # bf16 in, f32 out
        assert torch.equal(y32.view(torch.int32), ref.view(torch.int32))
        y16 = torch.empty(T, 40, dtype=torch.bfloat16)
        c._c.forward(x.view(torch.int16).numpy(), y16.view(torch.int16).numpy())
        assert torch.isnan(y16[0]).all()
        r16 = ref.to(torch.bfloat16)                  # the same bits, NaN payloads aside
        nan = torch.isnan(r16)
        assert torch.equal(torch.isnan(y16), nan)
        assert torch.equal(y16.view(torch.int16)[~nan], r16.view(torch.int16)[~nan])
    with pytest.raises(ValueError, match="writable"):
        ro = np.zeros((1, 40), np.float32)
        ro.flags.writeable = False
        c._c.forward(np.zeros((1, 64), np.float32), ro)
    with pytest.raises(ValueError, match="bf16"):
        c._c.forward(np.zeros((1, 64), np.float16), np.zeros((1, 40), np.float32))


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_long_inputs_use_torch_on_the_same_bytes(dtype):
    tdt = torch.float32 if dtype == "f32" else torch.bfloat16
    lin = nn.Linear(64, 48).to(tdt)
    c = CLinear(lin, dtype, torch_above=4)
    # the kernels read the model's own weight tensor: shared, not copied
    assert c.weight_view.data_ptr() == lin.weight.data_ptr()
    assert torch.equal(c.weight_view, lin.weight.detach())
    x = torch.randn(1, 9, 64).to(tdt)
    if dtype == "f32" or torch_bf16_gemm_fast():
        torch.testing.assert_close(c(x), F.linear(x, lin.weight, lin.bias), atol=0, rtol=0)
    else:  # torch's bf16 GEMM is its slow fallback here: the same weight, widened to f32
        torch.testing.assert_close(c(x), linear_widened(x, lin.weight, lin.bias),
                                   atol=0, rtol=0)
    # and the C path agrees with it on a decode-sized input
    torch.testing.assert_close(c(x[:, :2]).float(), F.linear(x[:, :2], lin.weight,
                                                             lin.bias).float(),
                               atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("xdt", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bias", [False, True])
def test_linear_widened_is_the_f32_product_of_the_bf16_weight(xdt, bias):
    """Against float64 numpy on the same bytes, with more output rows than one widened chunk
    (so the chunks' seams are covered) and a ragged last chunk: within one rounding of the
    output dtype, and the bf16 output equal to the f32 output rounded once."""
    torch.manual_seed(0)
    N, K = 3 * 64 + 5, 256
    w = (torch.randn(N, K) * 0.05).to(torch.bfloat16)
    b = torch.randn(N) if bias else None
    x = torch.randn(2, 7, K).to(xdt)
    old = layers._WIDEN_CHUNK_BYTES, layers._WIDEN_MIN_ROWS
    layers._WIDEN_CHUNK_BYTES, layers._WIDEN_MIN_ROWS = 64 * 4 * K, 1  # 64 rows a chunk
    try:
        y = linear_widened(x, w, b)
        y32 = linear_widened(x.float(), w, b)
    finally:
        layers._WIDEN_CHUNK_BYTES, layers._WIDEN_MIN_ROWS = old
    assert y.shape == (2, 7, N) and y.dtype == xdt and y.is_contiguous()
    ref = x.double().numpy() @ w.double().numpy().T
    if bias:
        ref = ref + b.double().numpy()
    np.testing.assert_allclose(y32.double().numpy(), ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(y, y32.to(xdt))
    with pytest.raises(ValueError, match="features"):
        linear_widened(torch.zeros(3, K + 1), w)


def test_long_bf16_inputs_take_the_widened_product_where_torch_bf16_is_slow(monkeypatch):
    """The dispatch: above torch_above, a bf16 CLinear calls linear_widened exactly when
    torch_bf16_gemm_fast() says no, and torch's bf16 GEMM otherwise; at decode sizes neither."""
    lin = nn.Linear(64, 48).to(torch.bfloat16)
    c = CLinear(lin, "bf16", torch_above=4)
    calls = []
    real = layers.linear_widened
    monkeypatch.setattr(layers, "linear_widened",
                        lambda *a, **k: calls.append(a[0].shape) or real(*a, **k))
    x = torch.randn(1, 9, 64).to(torch.bfloat16)
    for fast in (False, True):
        monkeypatch.setattr(layers, "torch_bf16_gemm_fast", lambda: fast)
        calls.clear()
        y = c(x)
        assert len(calls) == (0 if fast else 1)
        assert y.shape == (1, 9, 48) and y.dtype == torch.bfloat16
        calls.clear()
        c(x[:, :3])
        assert calls == []


@pytest.mark.parametrize("dense", ["bf16", "auto"])
def test_offload_bf16_dense_greedy_equal(dense):
    """bf16 model: dense layers in C with the weights kept bit for bit; the f32 accumulation
    only reorders sums, so greedy tokens equal the unmodified model's."""
    ref = tiny_model("qwen2_moe", dtype=torch.bfloat16, hidden=128, inter=128)
    m = tiny_model("qwen2_moe", dtype=torch.bfloat16, hidden=128, inter=128)
    eng = hf.offload(m, dtype="bf16", dense=dense)
    try:
        conv = eng.dense.converted
        # attention projections, the shared expert and lm_head; never the routers
        assert "lm_head" in conv
        assert any(n.endswith("self_attn.q_proj") for n in conv)
        assert any("shared_expert." in n for n in conv)
        assert not any(n.endswith("mlp.gate") for n in conv)  # the routers stay in torch
        for r in eng._routers:
            assert not isinstance(r, CLinear)
        assert isinstance(m.lm_head, CLinear)
        g_ref = ref.generate(PROMPT, max_new_tokens=12, do_sample=False)
        g_off = m.generate(PROMPT, max_new_tokens=12, do_sample=False)
        assert torch.equal(g_ref, g_off)
    finally:
        eng.close()


def test_replacements_keep_the_models_eval_mode():
    """Every module offload puts in (CLinear, CRMSNorm, the experts' placeholder) takes the mode
    of the module it replaces: an eval-mode model needs no second eval() for its decode steps
    to take the C paths (a CRMSNorm left in training mode ran torch's norm at every step)."""
    from specmoe.models.layers import CRMSNorm
    m = tiny_model("deepseek_v2", dtype=torch.bfloat16)
    eng = hf.offload(m, dtype="bf16", dense="bf16")
    try:
        assert not m.training
        assert [n for n, mod in m.named_modules() if mod.training] == []
        norms = [mod for mod in m.modules() if isinstance(mod, CRMSNorm)]
        assert norms
        calls = []
        for mod in norms:
            mod.inner.register_forward_hook(lambda mod, a, o: calls.append(a[0].shape))
        kv = DynamicCache(config=m.config)
        with torch.no_grad():
            m(PROMPT[:, :-1], cache=kv, use_cache=True)
            calls.clear()
            m(PROMPT[:, -1:], cache=kv, use_cache=True)          # one decode step: all C
        assert calls == []
        m.train()
        assert all(mod.training for mod in norms)
    finally:
        eng.close()


def test_offload_f32_dense_greedy_equal():
    ref = tiny_model("mixtral")
    m = tiny_model("mixtral")
    eng = hf.offload(m, dtype="f32", dense="f32")
    try:
        assert len(eng.dense.converted) == 3 * 4 + 1  # q, k, v, o per layer + lm_head
        with torch.no_grad():
            torch.testing.assert_close(m(PROMPT).logits, ref(PROMPT).logits, atol=1e-4,
                                       rtol=1e-4)
        assert torch.equal(ref.generate(PROMPT, max_new_tokens=12, do_sample=False),
                           m.generate(PROMPT, max_new_tokens=12, do_sample=False))
    finally:
        eng.close()


@pytest.mark.parametrize("arch", sorted(SUPPORTED))
def test_every_architecture_f32_dense_greedy_equal(arch):
    """Every supported architecture generates with its dense layers in C, greedy tokens equal
    to the unmodified model's.  A layer the model reads by attribute instead of calling
    (Jamba's Mamba mixer multiplies by ``dt_proj.weight``) stays in torch, named in the
    report."""
    ids = torch.tensor([[5, 9, 11, 5, 9, 11, 5, 9, 30, 31, 5, 9]])
    ref = tiny_model(arch, vocab=128)
    m = tiny_model(arch, vocab=128)
    eng = hf.offload(m, dtype="f32", dense="f32", cache=1.0)
    try:
        assert eng.dense.converted
        with torch.no_grad():
            assert torch.equal(ref.generate(ids, max_new_tokens=8, do_sample=False),
                               m.generate(ids, max_new_tokens=8, do_sample=False))
        mamba = [n for n in eng.dense.skipped if n.endswith(".dt_proj")]
        assert len(mamba) == (sum(t == "mamba" for t in m.config.layers_block_type)
                              if arch == "jamba" else 0)
    finally:
        eng.close()


def _nll(model, ids):
    with torch.no_grad():
        lg = model(ids).logits[0, :-1].float()
    return F.cross_entropy(lg, ids[0, 1:]).item()


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_quantized_dense_perplexity(dtype):
    """int8/int4 dense weights move perplexity on the model's own greedy text a little; a
    wrong quantization path would decorrelate the logits."""
    ref = tiny_model("qwen3_moe", hidden=128, inter=128)
    m = tiny_model("qwen3_moe", hidden=128, inter=128)
    text = ref.generate(PROMPT, max_new_tokens=40, do_sample=False)
    eng = hf.offload(m, dtype="f32", dense=dtype)
    try:
        assert isinstance(m.lm_head, CLinear) and m.lm_head.dtype == dtype
        p_ref, p_q = math.exp(_nll(ref, text)), math.exp(_nll(m, text))
        with torch.no_grad():
            lq, lr = m(text).logits.flatten(), ref(text).logits.flatten()
    finally:
        eng.close()
    corr = torch.corrcoef(torch.stack([lq, lr]))[0, 1].item()
    assert abs(p_q / p_ref - 1) < (0.03 if dtype == "int8" else 0.3), (p_ref, p_q)
    # every weight of the model at int4 (groups of 128 = whole rows at hidden 128) moves the
    # logits more than int4 experts alone do (0.98 in test_hf); measured 0.964 here
    assert corr > (0.999 if dtype == "int8" else 0.93), corr


@pytest.mark.parametrize("dtype", ["f32", "bf16"])
def test_weights_in_a_file_mapping_are_read_from_a_copy(dtype, tmp_path):
    """A checkpoint's mmap (as safetensors loads it) is read slower than memory of the layer's
    own: such an f32/bf16 weight is copied, equal; one in ordinary memory stays shared."""
    from specmoe.models.layers import _file_mapped
    tdt = torch.float32 if dtype == "f32" else torch.bfloat16
    src = torch.randn(48, 64).to(tdt)
    f = tmp_path / "w.bin"
    src.view(torch.uint8).numpy().tofile(f)
    mapped = torch.from_numpy(np.memmap(f, dtype=np.uint8, mode="r+")).view(tdt).view(48, 64)
    lin = nn.Linear(64, 48).to(tdt)
    with torch.no_grad():
        lin.weight = nn.Parameter(mapped, requires_grad=False)
    assert _file_mapped(lin.weight) and not _file_mapped(src)
    c = CLinear(lin, dtype)
    assert c.weight_view.data_ptr() != lin.weight.data_ptr()
    assert not _file_mapped(c.weight_view) and torch.equal(c.weight_view, src)
    x = torch.randn(1, 2, 64).to(tdt)
    ref = F.linear(x, src, lin.bias)
    torch.testing.assert_close(c(x).float(), ref.float(), atol=2e-2 if dtype == "bf16" else 1e-5,
                               rtol=2e-2 if dtype == "bf16" else 1e-5)
    kept = CLinear(lin, dtype, copy_mapped=False)  # (a tied table keeps its one copy)
    assert kept.weight_view.data_ptr() == lin.weight.data_ptr()


def test_tied_lm_head_shares_the_embedding_bytes():
    from transformers import AutoModelForCausalLM

    from specmoe.models.testing import tiny_config
    cfg = tiny_config("mixtral")
    cfg.tie_word_embeddings = True
    torch.manual_seed(0)
    m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    assert m.lm_head.weight is m.get_input_embeddings().weight
    before = m.lm_head.weight.detach().clone()
    with torch.no_grad():
        ref = m(PROMPT).logits.float()
    rep = convert_dense(m, "bf16")
    emb = m.get_input_embeddings()
    assert "lm_head" in rep.converted
    assert emb.weight.data_ptr() == m.lm_head.weight_view.data_ptr()  # one copy of the table
    assert torch.equal(emb.weight.detach(), before)
    with torch.no_grad():
        out = m(PROMPT).logits.float()
    assert out.argmax(-1).eq(ref.argmax(-1)).all()


def test_int4_skips_layers_it_cannot_hold():
    lin_ok, lin_odd = nn.Linear(64, 16), nn.Linear(40, 16)
    model = nn.Sequential(lin_ok, lin_odd)
    rep = convert_dense(model, "int4")
    assert rep.converted == ["0"] and "1" in rep.skipped and "multiple of 32" in rep.skipped["1"]
    assert isinstance(model[0], CLinear) and isinstance(model[1], nn.Linear)


def test_resolve_rule():
    assert resolve_dense("auto", torch.float32) is None       # torch's f32 GEMV is at the limit
    assert resolve_dense("torch", torch.bfloat16) is None
    assert resolve_dense(None, torch.bfloat16) is None
    assert resolve_dense("int8", torch.float32) == "int8"
    if context().isa != "scalar":
        assert resolve_dense("auto", torch.bfloat16) == "bf16"


def test_bad_input():
    with pytest.raises(ValueError, match="dense must be"):
        resolve_dense("int3", torch.float32)
    m = tiny_model("mixtral")
    n_before = sum(p.numel() for p in m.parameters())
    with pytest.raises(ValueError, match="dense must be"):
        hf.offload(m, dense="fp8")
    assert sum(p.numel() for p in m.parameters()) == n_before  # nothing was touched
    with pytest.raises(ValueError, match="dtype must be one of"):
        CLinear(nn.Linear(32, 8), "fp16")
    with pytest.raises(TypeError, match="nn.Linear"):
        CLinear(nn.Conv1d(4, 4, 1), "f32")  # type: ignore[arg-type]
    c = CLinear(nn.Linear(32, 8), "f32")
    with pytest.raises(ValueError, match="input has 16 features"):
        c(torch.randn(2, 16))
    # the binding checks shapes, dtypes and the descriptor against the block
    block = np.zeros(32 * 8 * 4, np.uint8)
    desc = {"N": 8, "K": 32, "dtype": 0, "weight": 0}
    lin = _C.Linear(context(), desc, block)
    with pytest.raises(ValueError, match="x must be"):
        lin.forward(np.zeros((2, 31), np.float32), np.zeros((2, 8), np.float32))
    with pytest.raises(ValueError, match="float32"):
        lin.forward(np.zeros((2, 32), np.float64), np.zeros((2, 8), np.float32))
    with pytest.raises(ValueError, match="does not fit"):
        _C.Linear(context(), dict(desc, weight=64), block)
    with pytest.raises(ValueError, match="weight.scale"):
        _C.Linear(context(), dict(desc, dtype=2), block)
    with pytest.raises(ValueError, match="bias has 7 entries"):
        _C.Linear(context(), desc, block, np.zeros(7, np.float32))
    with pytest.raises(ValueError, match="missing K"):
        _C.Linear(context(), {"N": 8, "dtype": 0, "weight": 0}, block)
    with pytest.raises(ValueError, match="group"):
        _C.Linear(context(), {"N": 8, "K": 40, "dtype": 3, "weight": 0, "weight_scale": 0},
                  np.zeros(4096, np.uint8))



def test_openmp_wait_policy_default():
    """Imported before torch, specmoe makes torch's OpenMP workers sleep instead of spinning
    between regions (they would hold the kernels' cores); a user's own choice is kept;
    imported after torch with no choice made, it leaves the environment alone and says so
    once, with the remedy."""
    import os
    import subprocess
    import sys
    code = "import specmoe, torch, os; print(os.environ.get('OMP_WAIT_POLICY'))"
    env = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout.split()[-1]
    assert out == "PASSIVE"
    code2 = "import specmoe, os; print(os.environ.get('OMP_WAIT_POLICY'))"  # (no torch: faster)
    out = subprocess.run([sys.executable, "-c", code2], env=dict(env, OMP_WAIT_POLICY="ACTIVE"),
                         capture_output=True, text=True, check=True).stdout.split()[-1]
    assert out == "ACTIVE"
    code = "import torch, specmoe, os; print(os.environ.get('OMP_WAIT_POLICY'))"
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                       check=True)
    assert r.stdout.split()[-1] == "None"  # too late to matter: left alone
    assert r.stderr.count("RuntimeWarning: specmoe was imported after torch") == 1, r.stderr
    assert "OMP_WAIT_POLICY=PASSIVE" in r.stderr
    r = subprocess.run([sys.executable, "-c", code], env=dict(env, OMP_WAIT_POLICY="ACTIVE"),
                       capture_output=True, text=True, check=True)
    assert r.stdout.split()[-1] == "ACTIVE" and "RuntimeWarning" not in r.stderr, r.stderr


def test_generate_holds_one_thread_between_decode_steps():
    """Inside model.generate / specmoe.generate torch stays on one thread from one decode
    forward to the next (the sampling between them included), a long forward gets the user's
    count back, and the count is back after the call, also when it raises."""
    from transformers import LogitsProcessor, LogitsProcessorList

    from specmoe import generate
    m = tiny_model("mixtral")
    eng = hf.offload(m, dtype="f32", dense="f32")
    fwd, between = [], []
    h = m.model.layers[0].register_forward_pre_hook(
        lambda *_: fwd.append(torch.get_num_threads()))

    class Probe(LogitsProcessor):
        def __call__(self, input_ids, scores):
            between.append(torch.get_num_threads())
            return scores

    prompt = torch.randint(3, 100, (1, 20))          # 20 tokens > 16: a long prefill
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        m.generate(prompt, max_new_tokens=4, do_sample=False,
                   logits_processor=LogitsProcessorList([Probe()]))
        assert fwd == [2, 1, 1, 1]                   # the prefill keeps 2, decode steps 1
        assert between == [2, 1, 1, 1]               # after the prefill 2; held from then on
        assert torch.get_num_threads() == 2
        hooks = m._specmoe_decode_threads
        with hooks.session():                        # a long forward inside: the count is back
            with torch.no_grad():
                m(torch.randint(3, 100, (1, 1)))
                assert torch.get_num_threads() == 1
                fwd.clear()
                m(torch.randint(3, 100, (1, 20)))
            assert fwd == [2]
        with pytest.raises(Exception):               # out-of-vocabulary id raises inside
            m.generate(torch.full((1, 1), 10_000), max_new_tokens=2, do_sample=False)
        assert torch.get_num_threads() == 2
        fwd.clear()
        out = generate(m, prompt[0].tolist(), max_new_tokens=3)
        assert len(out.sequences[0]) == 23 and fwd[0] == 2 and set(fwd[1:]) == {1}
        assert torch.get_num_threads() == 2
    finally:
        h.remove()
        torch.set_num_threads(before)
        eng.close()


def test_decode_forwards_run_torch_single_threaded():
    """With dense layers in C, forwards of at most torch_above tokens run torch on one
    thread; longer ones keep the user's count, which is restored afterwards, also when the
    forward raises."""
    m = tiny_model("mixtral")
    eng = hf.offload(m, dtype="f32", dense="f32")
    seen = []
    h = m.model.layers[0].register_forward_pre_hook(
        lambda *_: seen.append(torch.get_num_threads()))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert eng.dense.decode_torch_threads == 1
        with torch.no_grad():
            m(torch.randint(3, 100, (1, 20)))      # 20 tokens > 16: prefill keeps 2
            m(torch.randint(3, 100, (1, 1)))       # decode: 1
            m(torch.randint(3, 100, (2, 8)))       # batch of 2 x 8 = 16 tokens: decode
        assert seen == [2, 1, 1]
        assert torch.get_num_threads() == 2
        with pytest.raises(Exception):
            m(torch.full((1, 1), 10_000))          # out-of-vocabulary id raises inside
        assert torch.get_num_threads() == 2
        seen.clear()
        hooks = m._specmoe_decode_threads          # concurrent decode forwards: restored once
        hooks.pre(m, (torch.zeros(1, 1, dtype=torch.long),), {})
        hooks.pre(m, (torch.zeros(1, 1, dtype=torch.long),), {})
        assert torch.get_num_threads() == 1
        hooks.post(m, (), {}, None)
        assert torch.get_num_threads() == 1
        hooks.post(m, (), {}, None)
        assert torch.get_num_threads() == 2
    finally:
        h.remove()
        torch.set_num_threads(before)
        eng.close()
    # torch dense layers: nothing installed
    m2 = tiny_model("mixtral")
    eng = hf.offload(m2, dtype="f32", dense="torch")
    try:
        assert eng.dense.decode_torch_threads is None
        assert getattr(m2, "_specmoe_decode_threads", None) is None
    finally:
        eng.close()


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_pack_in_row_chunks_equals_the_whole_matrix(monkeypatch, dtype):
    """_pack quantizes a large matrix a few rows at a time (its load peak); the block is the
    one quantizing the whole matrix at once gives, byte for byte, for any chunk size."""
    from specmoe.models import layers

    w = torch.randn(37, 256, generator=torch.Generator().manual_seed(3)) * 0.05
    whole, desc, _ = layers._pack(w, dtype)
    for rows in (1, 5, 36):
        monkeypatch.setattr(layers, "_PACK_CHUNK_BYTES", 4 * 256 * rows)
        got, d2, _ = layers._pack(w, dtype)
        assert d2 == desc and np.array_equal(got, whole), rows
    q, sc = quantize_int8(w.numpy()) if dtype == "int8" else quantize_int4(w.numpy(), 128)
    assert np.array_equal(whole[:q.nbytes], q.reshape(-1).view(np.uint8))
    off = desc["weight_scale"]
    assert np.array_equal(whole[off:off + sc.nbytes], sc.reshape(-1).view(np.uint8))

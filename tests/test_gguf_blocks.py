"""GGUF block weights kept as a file holds them (Q8_0, Q4_K, Q6_K; csrc/kernels/ffn_blocks.c).

Every kernel is checked against the ``gguf`` package's dequantization of the same bytes followed
by an f32 (float64) FFN in numpy: the exact path to float rounding, the fast int8-input path to
the rounding of its int8 input."""
from __future__ import annotations

import zlib

import numpy as np
import pytest

pytest.importorskip("gguf")

from specmoe import _C  # noqa: E402
from specmoe.runtime import kernels  # noqa: E402
from specmoe.storage import ggml_blocks as gb  # noqa: E402

from .test_kernels import ref_ffn  # noqa: E402

from .test_kernels import _isa, ctx  # noqa: E402,F401  (the module's context fixture)

QUANT = gb.QUANTIZERS


def _expert(rng, H, I, kind, down_kind=None, bias=False):
    g, u, d = (rng.standard_normal(s).astype(np.float32) * 0.05
               for s in ((I, H), (I, H), (H, I)))
    t = {"gate": QUANT[kind](g), "up": QUANT[kind](u), "down": QUANT[down_kind or kind](d)}
    if bias:
        t["gate.bias"] = rng.standard_normal(I).astype(np.float32) * 0.3
        t["up.bias"] = rng.standard_normal(I).astype(np.float32) * 0.3
        t["down.bias"] = rng.standard_normal(H).astype(np.float32) * 0.1
    ref = {n: gb.dequantize(t[n]) for n in ("gate", "up", "down")}
    ref.update({n: v for n, v in t.items() if n.endswith(".bias")})
    return t, ref


def q8_rounded(x, m):
    """The fast path's input rounding in numpy: per m columns (32 before a Q8_0 matrix, 256
    before a K-quant one) s = max|x| / 127, q = rint(x * (1 / s)) (ties to even), clamped to
    [-127, 127]; returns q * s."""
    b = x.astype(np.float32).reshape(x.shape[0], -1, m)
    s = (np.abs(b).max(axis=2, keepdims=True) / np.float32(127)).astype(np.float32)
    inv = np.where(s > 0, np.float32(1) / np.where(s > 0, s, 1), 0).astype(np.float32)
    q = np.clip(np.rint(b * inv), -127, 127)
    return (q * s).reshape(x.shape)


def _model_fast(ref, x, kind, down):
    """The fast path's arithmetic: int8 x, f32 weights, int8 activation."""
    from .test_kernels import ref_act

    m = {k: cols for k, (cols, _) in gb.BLOCKS.items()}  # input rounding per block width
    xq = q8_rounded(x, m[kind]).astype(np.float64)
    g = xq @ ref["gate"].T.astype(np.float64) + ref.get("gate.bias", 0.0)
    u = xq @ ref["up"].T.astype(np.float64) + ref.get("up.bias", 0.0)
    a = q8_rounded(ref_act(g, u, "silu").astype(np.float32), m[down or kind]).astype(np.float64)
    return a @ ref["down"].T.astype(np.float64) + ref.get("down.bias", 0.0)


def _rel(a, b):
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def test_quantizers_write_blocks_the_gguf_package_reads_back_closely():
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 512)).astype(np.float32)
    for kind, q in QUANT.items():
        b = q(w)
        assert gb.block_kind(b) == kind and b.shape == (8, 512 // gb.BLOCKS[kind][0],
                                                        gb.BLOCKS[kind][1])
        err = _rel(gb.dequantize(b), w)
        assert err < {"q8_0": 0.01, "q4_k": 0.12, "q6_k": 0.03, "q4_0": 0.12,
                      "q5_k": 0.06, "iq4_xs": 0.12, "q4_1": 0.1, "q2_k": 0.4,
                      "q3_k": 0.2, "mxfp4": 0.15}[kind], (kind, err)


def test_q4_1_quantizer_is_read_back_by_the_gguf_package_as_its_own():
    """The Q4_1 writer's bytes mean what ggml's do: its own round trip (d * q + m on the same
    fields) equals the gguf package's dequantization of them."""
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize, quantize

    rng = np.random.default_rng(5)
    w = rng.standard_normal((4, 96)).astype(np.float32)
    b = gb.quantize_q4_1(w)
    d = b[:, :, 0:2].copy().view(np.float16).astype(np.float32)
    m = b[:, :, 2:4].copy().view(np.float16).astype(np.float32)
    q = np.concatenate([b[:, :, 4:] & 15, b[:, :, 4:] >> 4], axis=2).astype(np.float32)
    np.testing.assert_array_equal(gb.dequantize(b), (q * d + m).reshape(4, 96))
    theirs = quantize(w, T.Q4_1).reshape(4, -1, 20)  # ggml's own quantizer, same format
    assert gb.block_kind(theirs) == "q4_1"
    assert _rel(dequantize(theirs.reshape(4, -1), T.Q4_1), w) < 0.1


@pytest.mark.parametrize("group", [32, 128])
def test_asymmetric_groups_repack_onto_q4_1_without_requantizing(group):
    rng = np.random.default_rng(group)
    rows, cols = 6, 256
    q = rng.integers(0, 16, (rows, cols)).astype(np.uint8)
    z = rng.integers(0, 16, (rows, cols // group)).astype(np.float32)
    s = (rng.random((rows, cols // group)) * 0.02 + 1e-3).astype(np.float16).astype(np.float32)
    want = (q.astype(np.float64) - np.repeat(z, group, 1)) * np.repeat(s, group, 1)
    b = gb.q4_1_from_groups(q, z, s, group)
    assert b.shape == (rows, cols // 32, 20)
    np.testing.assert_array_equal(np.concatenate([b[:, :, 4:] & 15, b[:, :, 4:] >> 4],
                                                 axis=2).reshape(rows, cols), q)  # values kept
    np.testing.assert_array_equal(b[:, :, :2].copy().view(np.float16)[..., 0].astype(np.float32),
                                  np.repeat(s, group // 32, 1))  # the f16 scale exactly
    got = gb.dequantize(b)  # only m = -z * s is rounded (to f16)
    assert np.abs(got - want).max() <= 2.0 ** -11 * np.abs(np.repeat(z * s, group, 1)).max()
    with pytest.raises(ValueError, match="multiple of 32"):
        gb.q4_1_from_groups(q, z[:, :1].repeat(cols // 48, 1), s[:, :1].repeat(cols // 48, 1),
                            48)
    with pytest.raises(ValueError, match="above 15"):
        gb.q4_1_from_groups(q + 16, z, s, group)


def test_q4_0_and_q5_0_widen_to_q8_0_without_loss():
    from gguf import GGMLQuantizationType as T
    from gguf.quants import dequantize, quantize

    rng = np.random.default_rng(1)
    w = rng.standard_normal((6, 128)).astype(np.float32)
    for t in ("Q4_0", "Q5_0", "Q8_0"):
        raw = quantize(w, T[t])
        np.testing.assert_array_equal(gb.dequantize(gb.widen_to_q8_0(raw, t)),
                                      dequantize(raw, T[t]))
    with pytest.raises(ValueError, match="Q4_K"):
        gb.widen_to_q8_0(np.zeros((1, 144), np.uint8), "Q4_K")


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("kind,down", [("q8_0", None), ("q4_k", None), ("q6_k", None),
                                       ("q4_0", None), ("q5_k", None), ("q4_k", "q8_0"),
                                       ("q4_k", "q6_k"), ("q4_k", "q4_0"), ("q5_k", "q6_k"),
                                       ("q6_k", "q5_k"), ("iq4_xs", None), ("iq4_xs", "q6_k"),
                                       ("q4_1", None), ("q4_k", "q4_1"), ("q4_1", "q8_0"),
                                       ("q2_k", None), ("q3_k", None), ("q2_k", "q3_k"),
                                       ("q3_k", "q6_k"), ("q2_k", "q4_0"), ("mxfp4", None),
                                       ("mxfp4", "q8_0"), ("q4_k", "mxfp4")])
# 22 tokens: AVX-512 VNNI passes of 16 and 6.  (The fast model below holds to float rounding
# unless an activation sits on an int8 rounding tie, where f32 and f64 may round it apart:
# 19 and 21 tokens draw such ties for iq4_xs, on every ISA; these draws do not.)
@pytest.mark.parametrize("T", [1, 5, 9, 22])
@pytest.mark.parametrize("precise", [True, False])
def test_ffn_equals_the_gguf_dequantization_then_f32(ctx, isa, kind, down, T, precise):
    _isa(ctx, isa)
    rng = np.random.default_rng(zlib.crc32(f"{kind}/{down}/{T}".encode()))  # not hash(): salted
    small = ("q8_0", "q4_0", "q4_1", "mxfp4")  # blocks of 32 columns
    H = 96 * 4 if kind in small else 512
    I = 96 if (down or kind) in small else 256
    t, ref = _expert(rng, H, I, kind, down, bias=T == 5)  # 9 tokens: tiles of 4, 4 and 1
    x = rng.standard_normal((T, H)).astype(np.float32)
    got = kernels.ffn(t, x, precise=precise, ctx=ctx)
    want = ref_ffn(ref, x, "silu")
    exact = precise or isa == "scalar"
    if exact:
        assert _rel(got, want) < 2e-6, _rel(got, want)
    else:  # the rounding of the int8 input alone (one scale per 256 columns before a K-quant
        # matrix: 1-3 % of the output on random data); its model matches to float rounding
        assert _rel(got, want) < 5e-2, _rel(got, want)
        model = _model_fast(ref, x, kind, down)
        assert _rel(got, model) < 1e-5, _rel(got, model)


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
@pytest.mark.parametrize("kind", ["q4_0", "q8_0", "q4_k", "q6_k", "mxfp4"])
@pytest.mark.parametrize("H,I", [(32 * 13, 32 * 6), (32 * 4, 32 * 7), (32 * 8, 32 * 3)])
def test_one_token_rows_of_any_block_count(ctx, isa, kind, H, I):
    """Q4_0 / Q8_0 / Q4_K / Q6_K at one token with block counts that leave blocks past the
    AVX-512 VNNI form's groups (four Q4_0 blocks, two Q8_0; the AVX2 step finishes them; Q4_K
    and Q6_K: 1-13 super-blocks, 8 times the columns), odd down chunks included: the fast
    model to float rounding on both forms."""
    _isa(ctx, isa)
    if kind in ("q4_k", "q6_k"):
        H, I = 8 * H, 8 * I
    rng = np.random.default_rng(H * 1000 + I + (kind == "q8_0"))
    t, ref = _expert(rng, H, I, kind)
    for x in (rng.standard_normal((1, H)).astype(np.float32),
              100 * rng.standard_normal((1, H)).astype(np.float32)):
        got = kernels.ffn(t, x, ctx=ctx)
        with np.errstate(over="ignore"):  # exp(-g) of a large negative g: SiLU's limit, 0
            assert _rel(got, _model_fast(ref, x, kind, None)) < 1e-5
            assert _rel(got, ref_ffn(ref, x, "silu")) < 5e-2


PAIR_ORDER_KINDS = ["q4_0", "mxfp4", "iq4_xs", "q4_1"]


@pytest.mark.parametrize("kind", PAIR_ORDER_KINDS)
@pytest.mark.parametrize("T", [16, 17, 33])
def test_pair_order_rows_on_both_sides_of_sixteen_tokens(ctx, kind, T):
    """At any token count the AVX2 rows of Q4_0 / MXFP4 / Q4_1 / IQ4_XS read the input in
    pair order, two tokens a pass (Q4_0, MXFP4, Q4_1: eight blocks a step, then the rest, an
    odd last block in column order), past INVARIANT_T (17, 33 tokens) too: each the fast
    model to float rounding, with odd block counts (13 and 7; IQ4_XS 3 and 1 super-blocks)."""
    _isa(ctx, "avx2")
    rng = np.random.default_rng(T + 100 * PAIR_ORDER_KINDS.index(kind))
    H, I = (256 * 3, 256) if kind == "iq4_xs" else (32 * 13, 32 * 7)
    t, ref = _expert(rng, H, I, kind)
    x = rng.standard_normal((T, H)).astype(np.float32)
    x[T // 2] *= 50.0  # a token of another scale
    got = kernels.ffn(t, x, ctx=ctx)
    with np.errstate(over="ignore"):
        assert _rel(got, _model_fast(ref, x, kind, None)) < 1e-5


@pytest.mark.parametrize("isa", ["avx2", "avx512"])
@pytest.mark.parametrize("exps,xlog2", [((0, 1, 2, 3), 124), ((250, 251, 253, 254), -120)])
@pytest.mark.parametrize("T", [1, 5])
def test_mxfp4_scales_at_both_ends_of_the_e8m0_range(ctx, isa, exps, xlog2, T):
    """MXFP4 scales 2^(e - 128) for e in 0-3 (f32 subnormals: ggml's e8m0 rule, which the
    gguf package's dequantization flushes to 0) and 250-254, against inputs scaled the other
    way so the products are ordinary numbers: the fast model to float rounding, on the AVX2
    form and on the VNNI rows (which build the scales in vector lanes)."""
    _isa(ctx, isa)
    rng = np.random.default_rng(T + exps[0])
    H, I = 32 * 9, 32 * 3
    t, ref = _expert(rng, H, I, "mxfp4", "q8_0")
    shift = 100 if exps[0] < 128 else -100  # the reference: exponents the package reads
    for name in ("gate", "up"):
        w = t[name].copy()
        w[..., 0] = rng.choice(np.array(exps, np.uint8), size=w.shape[:-1])
        t[name] = w
        moved = w.copy()
        moved[..., 0] = (w[..., 0].astype(np.int32) + shift).astype(np.uint8)
        ref[name] = gb.dequantize(moved).astype(np.float64) * 2.0 ** -shift
    x = (rng.standard_normal((T, H)) * 2.0 ** xlog2).astype(np.float32)
    got = kernels.ffn(t, x, ctx=ctx)
    assert np.isfinite(got).all() and np.abs(got).max() > 0
    with np.errstate(over="ignore"):  # exp(-g) of a large negative g: SiLU's limit, 0
        assert _rel(got, _model_fast(ref, x, "mxfp4", "q8_0")) < 1e-5


@pytest.mark.parametrize("isa", ["scalar", "avx2", "avx512"])
@pytest.mark.parametrize("kind", sorted(gb.BLOCKS))
def test_linear_layers_on_gguf_blocks(ctx, isa, kind):
    """A dense layer on a GGUF block matrix (dense="gguf"): the exact form equals the gguf
    package's dequantization then an f32 product; the fast form (int8 input per block
    width) equals its numpy model; tokens 1, 7, 16, 17 and 70 (past one 64-token chunk), a
    bias, every ISA the machine has."""
    _isa(ctx, isa)
    cols = gb.BLOCKS[kind][0]
    rng = np.random.default_rng(zlib.crc32(f"linear/{kind}".encode()))
    N, K = 72, cols * (13 if cols == 32 else 3)
    blocks = QUANT[kind]((rng.standard_normal((N, K)) * 0.05).astype(np.float32))
    w = gb.dequantize(blocks).astype(np.float64)
    bias = (rng.standard_normal(N) * 0.1).astype(np.float32)
    raw = np.ascontiguousarray(blocks).reshape(-1)
    for precise in (1, 0):
        lin = _C.Linear(ctx, {"N": N, "K": K, "dtype": kernels.dtype_code(kind), "weight": 0,
                              "precise": precise}, raw, bias)
        for T in (1, 7, 16, 17, 70):
            x = rng.standard_normal((T, K)).astype(np.float32)
            out = np.full((T, N), np.nan, np.float32)
            lin.forward(x, out)
            want = x.astype(np.float64) @ w.T + bias
            if precise or isa == "scalar":
                assert _rel(out, want) < 2e-6, (precise, T, _rel(out, want))
            else:
                model = q8_rounded(x, cols).astype(np.float64) @ w.T + bias
                assert _rel(out, model) < 1e-5, (T, _rel(out, model))
                assert _rel(out, want) < 5e-2


def test_linear_block_descriptors_are_refused_by_name(ctx):
    blocks = QUANT["q4_k"](np.zeros((4, 512), np.float32))
    raw = np.ascontiguousarray(blocks).reshape(-1)
    d = {"N": 4, "K": 512, "dtype": kernels.dtype_code("q4_k"), "weight": 0}
    _C.Linear(ctx, d, raw, None)
    with pytest.raises(ValueError, match="GGUF blocks of 256 columns: linear K=480"):
        _C.Linear(ctx, dict(d, K=480), raw, None)
    with pytest.raises(ValueError, match="weight"):
        _C.Linear(ctx, dict(d, N=5), raw, None)  # one row more than the block holds
    with pytest.raises(ValueError, match="scales are inside the blocks"):
        _C.Linear(ctx, dict(d, weight_scale=0), raw, None)
    with pytest.raises(ValueError, match="int2 weights are for expert FFNs only"):
        _C.Linear(ctx, dict(d, dtype=kernels.dtype_code("int2")), raw, None)


def test_spec_from_store_schema_reads_the_kinds_from_the_block_bytes():
    rng = np.random.default_rng(2)
    t, _ = _expert(rng, 256, 256, "q4_k", "q6_k")
    block, entries = kernels.pack_block(t)
    spec = kernels.FFNSpec.from_store_schema(entries, block.nbytes)
    assert (spec.H, spec.I, spec.dtype, spec.down_dtype) == (256, 256, "q4_k", "q6_k")
    assert spec.weight_bytes == 2 * 256 * 144 + 256 * 210
    t2 = dict(t, up=gb.quantize_q8_0(np.zeros((256, 256), np.float32)))
    with pytest.raises(ValueError, match="gate is q4_k but up is q8_0"):
        kernels.FFNSpec.from_store_schema(kernels.pack_block(t2)[1])


def test_bad_block_descriptors_are_refused_by_name(ctx):
    rng = np.random.default_rng(3)
    t, _ = _expert(rng, 256, 256, "q4_k")
    block, entries = kernels.pack_block(t)
    spec = kernels.FFNSpec.from_store_schema(entries, block.nbytes)
    x = np.zeros((1, 256), np.float32)
    bad = dict(spec.desc(), I=300)  # not a multiple of 256
    with pytest.raises(ValueError, match="not a multiple"):
        ctx.ffn_forward(bad, block, x, np.zeros_like(x), None, None)
    bad = dict(spec.desc(), down_dtype=3)  # int4 under a block dtype
    with pytest.raises(ValueError, match="down_dtype"):
        ctx.ffn_forward(bad, block, x, np.zeros_like(x), None, None)
    bad = dict(spec.desc(), gate_scale=0)
    with pytest.raises(ValueError, match="inside the blocks"):
        ctx.ffn_forward(bad, block, x, np.zeros_like(x), None, None)
    with pytest.raises(ValueError, match="only the GGUF block formats"):
        kernels.FFNSpec(H=256, I=256, dtype="int4", offsets={}, block_bytes=1,
                        down_dtype="q8_0")


def test_nan_input_gives_nan_output_on_the_fast_path(ctx):
    ctx.set_isa("auto")
    rng = np.random.default_rng(4)
    t, _ = _expert(rng, 256, 256, "q4_k")
    x = rng.standard_normal((2, 256)).astype(np.float32)
    x[1, 7] = np.nan
    y = kernels.ffn(t, x, ctx=ctx)
    assert np.isfinite(y[0]).all() and np.isnan(y[1]).all()


# ---------- GGUF files kept as they are (store dtype "gguf") ----------

import torch  # noqa: E402

import specmoe  # noqa: E402
from specmoe.models.testing import save_gguf, tiny_model  # noqa: E402


@pytest.fixture()
def _cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECMOE_CACHE", str(tmp_path / "cache"))


def _q4_k_m_like(layer: int, role: str) -> str:
    """A Q4_K_M-like mix: gate/up Q4_K; down Q5_0 and Q8_0 on alternate layers (what
    llama-quantize writes for down rows that are not a multiple of 256 columns)."""
    return "Q4_K" if role != "down" else ("Q5_0" if layer % 2 else "Q8_0")


def _logits(model, ids):
    with torch.no_grad():
        return model(ids).logits[0].float()


def _greedy(model, ids, n=8):
    with torch.no_grad():
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                              do_sample=False, pad_token_id=0)[0, ids.shape[1]:].tolist()


def _exact_and_fast(model, ids, want_logits, want_tokens):
    """``model``'s logits on the exact kernel path (the scalar ISA) equal ``want_logits`` to
    float rounding and its greedy tokens are ``want_tokens``; on the fast path (the best ISA,
    the int8-input arithmetic) the logits stay close, not equal."""
    rels = {}
    try:
        for isa in ("scalar", _C.KernelContext(1).isa_max):
            kernels.set_isa(isa)  # the engine's kernels run on the default context
            got = _logits(model, ids)
            rels[isa] = float((got - want_logits).norm() / want_logits.norm())
            if isa == "scalar":
                assert _greedy(model, ids) == want_tokens
    finally:
        kernels.set_isa("auto")
    assert rels["scalar"] < 1e-5, rels
    if len(rels) > 1:
        fast = [v for k, v in rels.items() if k != "scalar"][0]
        assert 1e-6 < fast < 3e-2, rels


def _q4_k_m_256(layer: int, role: str) -> str:
    """Q4_K_M where every row is a multiple of 256 columns (Qwen3-30B-A3B): gate/up Q4_K, down
    Q6_K on some layers (llama-quantize's use_more_bits) and Q4_K on the others."""
    return "Q6_K" if role == "down" and layer % 2 == 0 else "Q4_K"


@pytest.mark.parametrize("arch,inter,expert_qtype,down", [
    ("olmoe", 96, _q4_k_m_like, "q8_0"),
    ("qwen3_moe", 256, _q4_k_m_256, "q4_k/q6_k by layer"),
    ("qwen3_moe", 256, lambda layer, role: "Q4_K" if role != "down" else "Q6_K", "q6_k"),
    ("qwen3_moe", 256, lambda layer, role: "Q5_K" if role != "down" else "Q6_K", "q6_k"),  # Q5_K_M
    ("qwen3_moe", 256, "IQ4_XS", "iq4_xs"),
    ("mixtral", 96, "Q8_0", "q8_0"),
    ("mixtral", 96, "Q4_0", "q4_0"),
    ("olmoe", 96, "MXFP4", "mxfp4"),
    ("qwen3_moe", 96, "Q4_1", "q4_1"),
    ("qwen3_moe", 256, lambda layer, role: "Q3_K" if role != "down" else "Q4_K", "q4_k"),  # Q3_K_M
    ("qwen3_moe", 256, "Q2_K", "q2_k")])
def test_a_gguf_file_is_kept_block_for_block_and_runs_as_the_weights_it_holds(
        _cache_dir, tmp_path, capfd, arch, inter, expert_qtype, down):
    """dtype='auto' keeps the file's expert blocks (Q5_0 widened to Q8_0; down formats that
    change by layer kept per layer); every stored expert dequantizes to exactly what the gguf
    package reads from the file; the model's logits on the exact kernel path equal the
    transformers model holding the weights the file holds, and its greedy tokens too; the
    fast path stays close."""
    import gguf
    from gguf.quants import dequantize

    from specmoe.storage import quant
    from specmoe.storage.store import ExpertStore

    path, held = save_gguf(tiny_model(arch, hidden=256, inter=inter), tmp_path / "k.gguf",
                           expert_qtype=expert_qtype)
    store = specmoe.convert(path, progress=False)
    err = capfd.readouterr().err
    assert "the store keeps their blocks as they are (dtype='auto' -> 'gguf'" in err, err
    assert f"down {down}" in err, err
    rd = gguf.GGUFReader(str(path))
    by_name = {t.name: t for t in rd.tensors}
    st = ExpertStore(store)
    try:
        assert st.extra["dtype"] == "gguf"
        for layer in range(st.num_layers):
            t = st.read_expert(layer, 3)
            got = quant.dequantize_expert(t)
            for name in ("gate", "up", "down"):
                raw = by_name[f"blk.{layer}.ffn_{name}_exps.weight"]
                assert gb.block_kind(t[name]) == gb.TYPE_OF_GGML[raw.tensor_type.name]
                want = dequantize(np.asarray(raw.data[3]), raw.tensor_type)
                np.testing.assert_array_equal(got[name], want)
                if raw.tensor_type.name in ("Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "Q8_0", "Q4_1",
                                                "Q2_K", "Q3_K", "MXFP4"):
                    np.testing.assert_array_equal(t[name].reshape(-1),
                                                  np.asarray(raw.data[3]).reshape(-1))
    finally:
        st.close()

    ref = tiny_model(arch, hidden=256, inter=inter)
    missing, unexpected = ref.load_state_dict(held, strict=False)
    assert not unexpected and all("rotary" in k for k in missing)
    ids = torch.tensor([[1, 5, 9, 33, 7, 64, 3, 17]])
    want_logits, want_tokens = _logits(ref, ids), _greedy(ref, ids)
    model = specmoe.from_pretrained(path, cache=0.5, progress=False, dense="torch",
                                    torch_dtype=torch.float32)
    try:
        _exact_and_fast(model, ids, want_logits, want_tokens)
    finally:
        specmoe.engine_of(model).close()


def test_files_that_cannot_be_kept_say_why(_cache_dir, tmp_path, capfd):
    """gate/up changing format by layer, or a type the kernels do not read: auto converts
    (saying why), dtype='gguf' refuses by name; a safetensors folder has no blocks to keep."""
    from specmoe.models.testing import save_checkpoint

    path, _ = save_gguf(tiny_model("qwen3_moe", hidden=256, inter=256), tmp_path / "m.gguf",
                        expert_qtype=lambda layer, role: "Q6_K" if role != "down" and layer
                        else "Q4_K")
    specmoe.convert(path, progress=False)
    err = capfd.readouterr().err
    assert "not kept as they are: its gate/up experts are Q4_K/Q6_K" in err, err
    with pytest.raises(ValueError, match="cannot be kept as it is: its gate/up experts are"):
        specmoe.convert(path, dtype="gguf", progress=False)
    p51, _ = save_gguf(tiny_model("mixtral"), tmp_path / "q51.gguf", qtype="Q5_1")
    with pytest.raises(ValueError, match="Q5_1, which the kernels do not read as they are"):
        specmoe.convert(p51, dtype="gguf", progress=False)
    folder = save_checkpoint(tiny_model("mixtral"), tmp_path / "st")
    with pytest.raises(ValueError, match="is none of them"):
        specmoe.convert(folder, dtype="gguf", progress=False)


def test_per_layer_down_formats_are_checked():
    assert kernels.down_dtype_codes(None, 3) is None
    assert kernels.down_dtype_codes(["q4_k", "q6_k"], 2) == [6, 7]
    with pytest.raises(ValueError, match="for each of the 3 MoE layers"):
        kernels.down_dtype_codes(["q4_k", "q6_k"], 3)
    with pytest.raises(ValueError, match="must name one of"):
        kernels.down_dtype_codes(["q4_k", "int4"], 2)


def test_serve_a_q4_k_m_file(_cache_dir, tmp_path):
    """specmoe.serve.app on a GGUF file: tokenizer and config from the metadata, the K-quant
    blocks kept (down Q4_K / Q6_K by layer), and a completion equal to the served model's own
    greedy generation."""
    pytest.importorskip("starlette")
    from starlette.testclient import TestClient
    from transformers import AutoTokenizer

    from specmoe import zoo
    from specmoe.serve import app

    tok = AutoTokenizer.from_pretrained(zoo.path("tiny-moe"))
    model = tiny_model("mixtral", hidden=256, inter=256, vocab=tok.vocab_size)
    path, _ = save_gguf(model, tmp_path / "serve-q4km.gguf", tokenizer=tok,
                        expert_qtype=_q4_k_m_256)
    asgi = app(path, dtype="auto", cache="50%", max_batch=2)
    srv = asgi.state.server
    assert srv.model_name == "serve-q4km.gguf"
    assert specmoe.engine_of(srv.model).dtype == "gguf"
    with TestClient(asgi) as client:  # the app owns its engine: closed when the app stops
        r = client.post("/v1/completions", json={"model": srv.model_name, "max_tokens": 6,
                                                 "prompt": "def parse(line):",
                                                 "temperature": 0})
        assert r.status_code == 200, r.text
        got = r.json()["choices"][0]["text"]
        ids = srv.tokenizer("def parse(line):").input_ids
        want = _greedy(srv.model, torch.tensor([ids]), n=6)
    assert len(want) == 6 and got == srv.tokenizer.decode(want, skip_special_tokens=True)


@pytest.mark.parametrize("arch,qtype,kinds,tiny", [
    ("mixtral", "Q4_0", {"q4_0"}, 256),       # llama: q/k rows permuted in the file
    ("qwen3_moe", "Q4_K", {"q4_k"}, 256),     # hidden 256: K-quant super-blocks everywhere
    ("deepseek_v2", "Q8_0", {"q8_0"}, None),  # MLA; kv_b_proj joined from two tensors
    # sigmoid-routed deepseek2 (DeepSeek-V3); heads of 32 nope columns: attn_k_b in blocks too
    ("deepseek_v3", "Q4_0", {"q4_0"}, {"qk_nope_head_dim": 32}),
    ("glm4_moe", "Q8_0", {"q8_0"}, None),     # q/k/v biases beside the blocks
    ("qwen3_next", "Q8_0", {"q8_0"}, None),   # in_proj_qkvz joined from two tensors' blocks
    # Qwen3.5: the value heads' rows and (in whole blocks: heads of 32) out_proj's columns put
    # back in transformers' order
    ("qwen3_5_moe_text", "Q8_0", {"q8_0"}, {"linear_value_head_dim": 32}),
    ("olmoe", "Q5_0", {"q8_0"}, 256)])        # Q5_0 widened to Q8_0 without loss
def test_dense_gguf_runs_the_files_own_blocks(_cache_dir, tmp_path, monkeypatch, arch, qtype,
                                              kinds, tiny):
    """dense="gguf": every dense layer the file holds in a kept block format runs on those
    blocks (each one dequantizes to exactly the weights the file holds, a llama q/k's rows
    in the model's order); the rest keep the model's format; logits on the exact kernel path
    equal the transformers model holding the file's weights, greedy tokens too; the fast
    path stays close."""
    import gguf

    from specmoe.models.layers import CLinear

    # tiny: the hidden size, or config overrides
    kw = {"overrides": tiny} if isinstance(tiny, dict) else {"hidden": tiny} if tiny else {}
    path, held = save_gguf(tiny_model(arch, **kw), tmp_path / "d.gguf", qtype=qtype)
    ref = tiny_model(arch, **kw)
    missing, unexpected = ref.load_state_dict(held, strict=False)
    assert not unexpected and all("rotary" in k for k in missing)
    ids = torch.tensor([[1, 5, 9, 33, 7, 64, 3, 17]])
    want_logits, want_tokens = _logits(ref, ids), _greedy(ref, ids)
    from specmoe.storage.gguf import GgufCheckpoint
    dequantized = []  # the keys loaded through the dequantizing path
    real = GgufCheckpoint.tensor
    monkeypatch.setattr(GgufCheckpoint, "tensor",
                        lambda self, key, dtype=None: dequantized.append(key) or real(
                            self, key, dtype))
    model = specmoe.from_pretrained(path, cache=0.5, progress=False, dense="gguf",
                                    torch_dtype=torch.float32)
    try:
        rep = specmoe.engine_of(model).dense
        assert rep.dtype == "gguf" and set(rep.formats) - {"f32"} == kinds, rep.formats
        # the blocks went to the Engine's convert_dense as a GgufDense; no copy of the
        # mapping stays on the model (the CLinears hold what they read)
        assert not [k for k in vars(model) if "blocks" in k], sorted(vars(model))
        rd = gguf.GGUFReader(str(path))
        by_name = {t.name: t for t in rd.tensors}
        lins = {n: m for n, m in model.named_modules() if isinstance(m, CLinear)}
        on_blocks = {n: m for n, m in lins.items() if m.dtype in gb.BLOCKS}
        assert len(on_blocks) >= 4 * 2, sorted(lins)  # the attention of both layers at least
        if arch in ("qwen3_next", "qwen3_5_moe_text"):  # the reordered projections too
            assert {"model.layers.0.linear_attn.in_proj_qkvz" if arch == "qwen3_next" else
                    "model.layers.0.linear_attn.in_proj_qkv",
                    "model.layers.0.linear_attn.out_proj"} <= set(on_blocks), sorted(on_blocks)
        for name, m in on_blocks.items():  # (q/k/v may read one joint block: fuse_qkv)
            cols, bb = gb.BLOCKS[m.dtype]
            w0, n = m._desc["weight"], m.out_features * (m.in_features // cols) * bb
            got = gb.dequantize(m._block[w0:w0 + n].reshape(m.out_features, -1, bb))
            np.testing.assert_array_equal(got, held[name + ".weight"].numpy())
            assert name + ".weight" not in dequantized  # never held as a float copy
        assert any(k.endswith("norm.weight") for k in dequantized)  # the rest was
        mla = [m for m in model.modules()
               if getattr(getattr(m, "_specmoe_mla", None), "weights", None) is not None]
        if arch == "deepseek_v3":  # the absorbed products on attn_k_b / attn_v_b's blocks
            assert len(mla) == model.config.num_hidden_layers
            for att in mla:
                ab, i = att._specmoe_mla.weights, att.layer_idx
                assert ab.fmt == "gguf"
                assert (ab.kernel.shape["dtype"], ab.kernel.shape["uv_dtype"]) == ("q4_0",) * 2
                raw = np.asarray(by_name[f"blk.{i}.attn_k_b.weight"].data).reshape(-1)
                np.testing.assert_array_equal(att._specmoe_mla.blocks[0].reshape(-1), raw)
                dn, w_uk, w_uv = att.qk_nope_head_dim, *ab.torch_weights()
                w = held[f"model.layers.{i}.self_attn.kv_b_proj.weight"].view(
                    att.num_heads, dn + att.v_head_dim, att.kv_lora_rank)
                np.testing.assert_array_equal(w_uk.numpy(), w[:, :dn].numpy())
                np.testing.assert_array_equal(w_uv.numpy(), w[:, dn:].numpy())
        elif arch == "deepseek_v2":  # 8 nope columns: attn_k_b is F32, kv_b_proj absorbed
            assert mla and all(m._specmoe_mla.weights.fmt is None for m in mla)
        if qtype != "Q5_0":  # the file's own bytes, not a copy of other bits
            o = lins["model.layers.1.self_attn.o_proj"]
            raw = np.asarray(by_name["blk.1.attn_output.weight"].data).reshape(-1)
            np.testing.assert_array_equal(o._block[o._desc["weight"]:][:raw.size], raw)
        _exact_and_fast(model, ids, want_logits, want_tokens)
    finally:
        specmoe.engine_of(model).close()


def test_dense_gguf_is_refused_where_it_cannot_hold(_cache_dir, tmp_path):
    from specmoe.models.dense import convert_dense
    from specmoe.models.layers import CLinear
    from specmoe.models.testing import save_checkpoint

    folder = save_checkpoint(tiny_model("mixtral"), tmp_path / "st")
    with pytest.raises(ValueError, match="dense='gguf' keeps a GGUF file's dense blocks"):
        specmoe.from_pretrained(folder, progress=False, dense="gguf")
    with pytest.raises(ValueError, match="load the model from a GGUF file"):
        convert_dense(tiny_model("mixtral"), "gguf")
    lin = torch.nn.Linear(64, 8)
    with pytest.raises(ValueError, match="needs blocks="):
        CLinear(lin, "q4_0")
    with pytest.raises(ValueError, match="blocks= is for the GGUF block kinds only"):
        CLinear(lin, "int8", blocks=np.zeros((8, 2, 18), np.uint8))
    with pytest.raises(ValueError, match=r"must be uint8 \(8, 2, 18\).*got uint8 \(8, 2, 34\)"):
        CLinear(lin, "q4_0", blocks=np.zeros((8, 2, 34), np.uint8))


def test_a_memory_plan_weighs_the_files_own_dense_blocks(_cache_dir, tmp_path, monkeypatch):
    """memory= on a GGUF file: "gguf" is among the dense formats planned, its bytes are the
    bytes the converted layers then hold, and where it plans fastest (fewest bytes at equal
    rates here) the model runs its dense layers on the file's blocks."""
    from specmoe.runtime import memplan

    monkeypatch.setattr(memplan, "anon_bytes", lambda: 0)  # the reserve's floor
    monkeypatch.setattr(memplan, "measure_rates", lambda sizes, edt, formats, **kw:
                        memplan.MachineRates({d: 10e9 for d in formats}, 1e-4, 1e-3))
    path, _ = save_gguf(tiny_model("qwen3_moe", hidden=256, dtype=torch.bfloat16),
                        tmp_path / "p.gguf", qtype="Q4_0")
    model = specmoe.from_pretrained(path, memory=700 << 20, progress=False)
    eng = specmoe.engine_of(model)
    try:
        p = eng.memory_plan
        by = {c["dense"]: c for c in p.candidates}
        assert set(by) == {"bf16", "int8", "gguf"}, by
        assert by["gguf"]["dense_bytes"] < by["int8"]["dense_bytes"] < by["bf16"]["dense_bytes"]
        assert p.dense == "gguf" and eng.dense.dtype == "gguf"
        assert eng.dense.formats.get("q4_0", 0) >= 8, eng.dense.formats
        assert p.dense_bytes == eng.dense.bytes_after  # planned = held
        out = model.generate(torch.tensor([[3, 4, 5]]), max_new_tokens=3, do_sample=False)
        assert out.shape == (1, 6)
    finally:
        eng.close()


def test_dense_auto_takes_a_gguf_files_own_blocks(_cache_dir, tmp_path):
    """dense="auto" on a GGUF file whose model loads in bf16 runs the dense layers on the
    file's blocks (what "auto" keeps exactly); an f32 model stays in torch, as "auto" leaves
    f32 models, and dense="bf16" still dequantizes."""
    path, _ = save_gguf(tiny_model("qwen3_moe", hidden=256), tmp_path / "a.gguf", qtype="Q4_0")
    for kw, want in (({}, "gguf"), ({"torch_dtype": torch.float32}, None),
                     ({"dense": "bf16"}, "bf16")):
        model = specmoe.from_pretrained(path, cache=0.5, progress=False, **kw)
        eng = specmoe.engine_of(model)
        try:
            assert eng.dense.dtype == want, (kw, str(eng.dense))
            if want == "gguf":
                assert eng.dense.formats.get("q4_0", 0) >= 8, eng.dense.formats
        finally:
            eng.close()


def test_serving_a_gguf_file_prefills_prompts_of_one_length_together(_cache_dir, tmp_path):
    """A GGUF file's blocks in C keep the one-token order at any token count (48-token
    prompts: past the 16 tokens a matrix where the AVX2 form used tiles of another order,
    which gave a prompt other last bits beside three others on a Zen 1 EPYC), so the server
    prefills prompts of one length in one forward, each request still getting
    model.generate's greedy tokens alone."""
    from specmoe.serve.scheduler import Scheduler
    from tests.conftest import IdText, served_greedy

    path, _ = save_gguf(tiny_model("mixtral", hidden=256, inter=256, vocab=128),
                        tmp_path / "p.gguf", expert_qtype="Q4_0")
    model = specmoe.from_pretrained(path, dtype="auto", cache=1.0, progress=False)
    model.generation_config.eos_token_id = None
    try:
        g = torch.Generator().manual_seed(5)
        prompts = [torch.randint(3, 128, (48,), generator=g).tolist() for _ in range(4)]
        refs = [_greedy(model, torch.tensor([p]), n=6) for p in prompts]
        sch = Scheduler(model, IdText(), max_batch=8, prefill_chunk=64)
        try:
            got = served_greedy(sch, prompts, 6)
        finally:
            sch.close()
        assert sch.batched_prefills == 1
        assert got == refs
    finally:
        specmoe.engine_of(model).close()

"""Expert FFN kernels against independent numpy / torch / transformers references.

Grouped like an operator test suite: weight formats (quant), one FFN operator parametrized
over dtype x activation x ISA x token count x shape, routing (rows/scale accumulation),
store-schema descriptors, and bad input."""
from __future__ import annotations

import functools
import os
import subprocess
import sys
import zlib

import numpy as np
import pytest
import torch

from specmoe import _C
from specmoe.runtime import kernels
from specmoe.storage import quant

ISAS = ["scalar", "avx2", "avx512"]
_ORDER = {n: i for i, n in enumerate(ISAS)}
_BEST = _C.KernelContext(1).isa_max


@pytest.fixture(scope="module")
def ctx():
    return _C.KernelContext(2)


def _isa(ctx, name):
    if _ORDER[name] > _ORDER[_BEST]:
        pytest.skip(f"CPU lacks {name}")
    ctx.set_isa(name)


# ---------- references (plain numpy, float64) ----------

def ref_act(g, u, activation, alpha=1.702, limit=7.0):
    if activation == "silu":
        return g / (1.0 + np.exp(-g)) * u
    g = np.minimum(g, limit)
    u = np.clip(u, -limit, limit)
    return (u + 1.0) * g / (1.0 + np.exp(-alpha * g))


def ref_ffn(w, x, activation):
    w = {k: np.asarray(v, dtype=np.float64) for k, v in w.items()}
    x = x.astype(np.float64)
    g = x @ w["gate"].T + w.get("gate.bias", 0.0)
    u = x @ w["up"].T + w.get("up.bias", 0.0)
    return ref_act(g, u, activation) @ w["down"].T + w.get("down.bias", 0.0)


def make_expert(rng, H, I, std=0.05, bias=False):
    g = (rng.standard_normal((I, H)) * std).astype(np.float32)
    u = (rng.standard_normal((I, H)) * std).astype(np.float32)
    d = (rng.standard_normal((H, I)) * std).astype(np.float32)
    b = None
    if bias:
        b = {"gate": (rng.standard_normal(I) * 0.5).astype(np.float32),
             "up": (rng.standard_normal(I) * 0.5).astype(np.float32),
             "down": (rng.standard_normal(H) * 0.1).astype(np.float32)}
    return g, u, d, b


# ---------- weight formats ----------

def test_bf16_round_to_nearest_even_matches_torch():
    rng = np.random.default_rng(1)
    a = np.concatenate([rng.standard_normal(10000).astype(np.float32) * 10,
                        np.array([0.0, -0.0, 1.0, np.inf, -np.inf, 3.0e38, 1e-40], np.float32)])
    # exact ties: mantissa low half = 0x8000 with even and odd upper parts
    ties = (np.array([0x3F808000, 0x3F818000, 0xBF808000], np.uint32)).view(np.float32)
    a = np.concatenate([a, ties])
    want = torch.from_numpy(a).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    np.testing.assert_array_equal(quant.f32_to_bf16(a), want)
    back = quant.bf16_to_f32(want)
    np.testing.assert_array_equal(back, torch.from_numpy(a).to(torch.bfloat16).float().numpy())
    assert np.isnan(quant.bf16_to_f32(quant.f32_to_bf16(np.array([np.nan], np.float32))))[0]


def test_int8_roundtrip_and_zero_row():
    rng = np.random.default_rng(2)
    w = rng.standard_normal((7, 33)).astype(np.float32)
    w[3] = 0.0
    q, s = quant.quantize_int8(w)
    assert q.dtype == np.int8 and s.dtype == np.float32 and s.shape == (7,)
    assert np.abs(q).max() <= 127
    np.testing.assert_allclose(s, np.abs(w).max(axis=1) / 127, rtol=1e-6)
    err = np.abs(quant.dequantize_int8(q, s) - w)
    assert (err <= s[:, None] / 2 + 1e-7).all()
    assert (q[3] == 0).all()


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_pack_order_and_roundtrip(group):
    rng = np.random.default_rng(3)
    w = rng.standard_normal((5, 2 * group)).astype(np.float32)
    p, s = quant.quantize_int4(w, group)
    assert p.shape == (5, group) and p.dtype == np.uint8 and s.shape == (5, 2)
    # independent unpack: low nibble holds the even column
    q = np.empty((5, 2 * group), np.int64)
    for r in range(5):
        for j in range(group):
            q[r, 2 * j] = (int(p[r, j]) & 15) - 8
            q[r, 2 * j + 1] = (int(p[r, j]) >> 4) - 8
    assert q.min() >= -7 and q.max() <= 7
    scale_full = np.repeat(s, group, axis=1)
    np.testing.assert_allclose(q * scale_full, quant.dequantize_int4(p, s), rtol=0, atol=1e-6)
    assert (np.abs(q * scale_full - w) <= scale_full / 2 + 1e-6).all()


def test_int4_group_errors():
    w = np.ones((2, 96), np.float32)
    with pytest.raises(ValueError, match="multiple of the group size 64"):
        quant.quantize_int4(w, 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        quant.quantize_int4(w, 48)
    g, u, d, _ = make_expert(np.random.default_rng(0), 96, 64)
    with pytest.raises(ValueError, match="not a multiple of the group size 64"):
        quant.expert_tensors(g, u, d, "int4", group=64)
    assert quant.pick_group(2880, 2880) == 64
    with pytest.raises(ValueError, match="multiples of 32"):
        quant.pick_group(40, 64)


@pytest.mark.parametrize("group", [64, 128])
def test_int2_pack_order_and_roundtrip(group):
    """Planar packing (byte j of a 64-column block: columns 16i + j in bits 2i..2i+1), unpacked
    bit by bit here, and the (scale, offset) dequantization w = u * s + m."""
    rng = np.random.default_rng(5)
    w = rng.standard_normal((3, 2 * group)).astype(np.float32)
    p, s = quant.quantize_int2(w, group)
    assert p.shape == (3, group // 2) and p.dtype == np.uint8 and s.shape == (3, 2, 2)
    u = np.empty((3, 2 * group), np.int64)
    for r in range(3):
        for c in range(2 * group):
            byte = int(p[r, (c // 64) * 16 + c % 16])
            u[r, c] = (byte >> (2 * ((c % 64) // 16))) & 3
    sc = np.repeat(s[:, :, 0], group, axis=1)
    off = np.repeat(s[:, :, 1], group, axis=1)
    np.testing.assert_allclose(u * sc + off, quant.dequantize_int2(p, s), rtol=0, atol=1e-6)
    # each weight is at its nearest level of the group's grid {m, m+s, m+2s, m+3s}
    levels = off[:, :, None] + sc[:, :, None] * np.arange(4)[None, None, :]
    nearest = np.abs(levels - w[:, :, None]).min(axis=2)
    assert np.allclose(np.abs(u * sc + off - w), nearest, atol=1e-5)


def test_int2_least_squares_beats_range_and_keeps_constant_groups():
    rng = np.random.default_rng(6)
    w = rng.standard_normal((16, 256)).astype(np.float32)
    err = [np.linalg.norm(quant.dequantize_int2(*quant.quantize_int2(w, 64, iters=i)) - w)
           for i in (0, 1, 4)]
    assert err[1] <= err[0] and err[2] <= err[1] and err[2] < 0.8 * err[0], err
    # Gaussian weights: within 5 % of the optimal 4-level quantizer's error (Lloyd-Max,
    # distortion 0.1175 per unit variance -> relative error 0.343)
    assert err[2] / np.linalg.norm(w) < 1.05 * 0.343
    const = np.full((2, 64), -0.25, np.float32)
    np.testing.assert_array_equal(quant.dequantize_int2(*quant.quantize_int2(const)), const)


def test_int2_group_errors():
    w = np.ones((2, 192), np.float32)
    with pytest.raises(ValueError, match="multiple of 64"):
        quant.quantize_int2(w, 32)
    with pytest.raises(ValueError, match="multiple of the group size 128"):
        quant.quantize_int2(w, 128)
    assert quant.pick_group(192, 128, "int2") == 64 and quant.pick_group(384, 640, "int2") == 64
    with pytest.raises(ValueError, match="int2 needs H and I multiples of 64"):
        quant.pick_group(96, 64, "int2")
    with pytest.raises(ValueError, match="scale must be"):
        quant.dequantize_int2(np.zeros((2, 16), np.uint8), np.zeros((2, 1), np.float32))


def test_expert_tensors_names_and_store_dtypes():
    g, u, d, b = make_expert(np.random.default_rng(4), 64, 32, bias=True)
    t = quant.expert_tensors(g, u, d, "int4", biases=b)
    assert list(t) == ["gate", "up", "down", "gate.scale", "up.scale", "down.scale",
                       "gate.bias", "up.bias", "down.bias"]
    assert t["gate"].shape == (32, 32) and t["down"].shape == (64, 16)
    assert t["gate.scale"].shape == (32, 2) and t["down.scale"].shape == (64, 1)
    tb = quant.expert_tensors(g, u, d, "bf16")
    assert quant.store_dtypes(tb) == {"gate": "bf16", "up": "bf16", "down": "bf16"}
    with pytest.raises(ValueError, match="unknown expert dtype"):
        quant.expert_tensors(g, u, d, "fp8")
    with pytest.raises(ValueError, match="down has shape"):
        quant.expert_tensors(g, u, d.T, "f32")


# ---------- the FFN operator ----------

SHAPES = [(37, 19), (64, 96), (2048, 1024)]  # (H, I); int4 uses the nearest multiple-of-32
TOKENS = [1, 3, 8]


def _shape_for(dtype, H, I):
    if dtype in ("int4", "int2"):
        m = 32 if dtype == "int4" else 64
        return max(m, H // m * m), max(m, I // m * m)
    return H, I


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("T", TOKENS)
@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("activation", ["silu", "gptoss"])
@pytest.mark.parametrize("dtype", quant.DTYPES)
def test_ffn_matches_reference(ctx, dtype, activation, isa, T, shape):
    _isa(ctx, isa)
    H, I = _shape_for(dtype, *shape)
    t, x, ref, full = _ffn_case(dtype, activation, T, H, I)
    y = kernels.ffn(t, x, dtype, activation, precise=True, ctx=ctx)
    tol = 2e-5 * np.sqrt(max(H, I)) * max(1.0, np.abs(ref).max())
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=tol)
    # quantization error against the original f32 expert, per format
    rel = np.linalg.norm(y - full) / max(np.linalg.norm(full), 1e-6)
    assert rel < {"f32": 1e-4, "bf16": 3e-2, "int8": 5e-2, "int4": 0.4, "int2": 1.0}[dtype], rel


@functools.lru_cache(maxsize=None)
def _ffn_case(dtype, activation, T, H, I, seed=0):
    """test_ffn_matches_reference's expert, input and references, the same for every ISA
    (computed once a session: the float64 references of the 2048 x 1024 shapes and the int2
    quantization took most of the test's time, three times over): (stored tensors, x [T, H],
    the float64 reference on the stored weights, the reference on the f32 weights)."""
    rng = np.random.default_rng(zlib.crc32(f"{dtype}{activation}{T}{H}{seed}".encode()))
    big = activation == "gptoss"  # large weights so gptoss clamps are exercised
    g, u, d, b = make_expert(rng, H, I, std=(1.0 / np.sqrt(H)) * (8 if big else 1), bias=big)
    t = quant.expert_tensors(g, u, d, dtype, biases=b)
    x = rng.standard_normal((T, H)).astype(np.float32)
    w = quant.dequantize_expert(t)
    ref = ref_ffn(w, x, activation)
    if big:
        gg = x.astype(np.float64) @ w["gate"].T.astype(np.float64) + w["gate.bias"]
        assert (np.abs(gg) > 7.0).any(), "the gptoss clamps were not exercised"
    full = ref_ffn({"gate": g, "up": u, "down": d, **({} if b is None else
                   {k + ".bias": v for k, v in b.items()})}, x, activation)
    for a in (*t.values(), x, ref, full):  # shared between the ISAs' cases: read only
        if isinstance(a, np.ndarray):
            a.flags.writeable = False
    return t, x, ref, full


# The default (fast) path rounds activations: bf16 -> bf16 x (vdpbf16ps), int8 -> int16 x
# (vpdpwssd; AVX2: vpmaddwd), int4 -> int8 x per 128 columns (vpdpbusd; AVX2: vpmaddubsw);
# bounds documented in ffn_fast.c, the arithmetic modelled in tests/test_lowbit_kernels.py.
FAST_TOL = {"bf16": 1e-2, "int8": 1e-3, "int4": 3e-2}
_FEAT = _C.KernelContext(1).features
FAST_ISAS = ["avx2", "avx512"]


def _fast_runs(dtype: str, isa: str) -> bool:
    """Whether the fast path serves `dtype` on `isa` here: AVX-512 with its extensions, else
    the AVX2 forms for int8/int4 (bf16 has none on AVX2)."""
    if isa == "avx512" and _FEAT.get("avx512_bf16" if dtype == "bf16" else "avx512_vnni", False):
        return True
    return dtype in ("int8", "int4")


@pytest.mark.parametrize("shape", [(128, 256), (384, 128), (2048, 1024), (320, 192)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("T", [1, 2, 8, 11])
@pytest.mark.parametrize("activation", ["silu", "gptoss"])
@pytest.mark.parametrize("dtype", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("isa", FAST_ISAS)
def test_fast_path_within_documented_error(ctx, isa, dtype, activation, T, shape):
    """320 x 192: multiples of 64 but not of 128 (as GPT-OSS's 2880): the fast path for every
    dtype (int4 in groups of 64, its last activation block 64 columns: dot_i4_g64)."""
    _isa(ctx, isa)
    H, I = shape
    rng = np.random.default_rng(zlib.crc32(f"fast{dtype}{activation}{T}{H}".encode()))
    big = activation == "gptoss"
    g, u, d, b = make_expert(rng, H, I, std=(1.0 / np.sqrt(H)) * (8 if big else 1), bias=big)
    t = quant.expert_tensors(g, u, d, dtype, biases=b)
    x = rng.standard_normal((T, H)).astype(np.float32)
    rows = rng.integers(0, T, size=T + 2)
    sc = rng.uniform(0.2, 1.0, size=T + 2).astype(np.float32)
    y = kernels.ffn(t, x, dtype, activation, rows=rows, scale=sc, ctx=ctx)
    ref = np.zeros((T, H))
    np.add.at(ref, rows, sc[:, None].astype(np.float64) *
              ref_ffn(quant.dequantize_expert(t), x[rows], activation))
    rel = np.linalg.norm(y - ref) / np.linalg.norm(ref)
    assert rel < FAST_TOL[dtype], rel
    yp = kernels.ffn(t, x, dtype, activation, rows=rows, scale=sc, precise=True, ctx=ctx)
    relp = np.linalg.norm(yp - ref) / np.linalg.norm(ref)
    assert relp < 1e-5, relp
    fast = _fast_runs(dtype, isa)
    if fast:  # the fast path really ran: it rounds, so it differs from precise
        assert not np.array_equal(y, yp)
    else:
        np.testing.assert_array_equal(y, yp)


@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("dtype", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("isa", FAST_ISAS)
def test_fast_path_nan_input_gives_nan_output(ctx, isa, dtype, T):
    """A NaN in a token's input makes that token's whole output NaN, as in the f32 math, and
    leaves the other tokens alone: the int8/int4 activation scales are taken from max|x|, which
    dropped a NaN (the int8 output came out finite)."""
    _isa(ctx, isa)
    rng = np.random.default_rng(5 + T)
    H, I = 256, 384
    g, u, d, _ = make_expert(rng, H, I, std=1.0 / np.sqrt(H))
    t = quant.expert_tensors(g, u, d, dtype)
    x = rng.standard_normal((T, H)).astype(np.float32)
    x[T - 1, 7] = np.nan
    y = kernels.ffn(t, x, dtype, "silu", ctx=ctx)
    assert np.isnan(y[T - 1]).all()
    assert np.isfinite(y[:T - 1]).all()


@pytest.mark.parametrize("shape", [(128, 256), (2048, 1024), (2304, 4608), (384, 9344),
                                   (2880, 2880), (256, 10944)], ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("dtype", ["bf16", "int8", "int4"])
@pytest.mark.parametrize("isa", FAST_ISAS)
def test_fast_path_one_token_equals_its_row_of_two(ctx, isa, dtype, shape):
    """One token reads short rows one at a time (bf16: up to 16 KB, sixteen rows' sums at once;
    int4 down rows of 2048-16384 columns) and long ones (int8 beyond 8 KB; bf16's 18 KB down
    rows of 384 x 9344) two or four at a time (ffn_fast.c), two tokens read rows in pairs: the
    same arithmetic per row and token, so the one-token output is bit for bit the first row of
    the two-token one -- and within the documented error of the reference.  9344 = 73 x 128:
    row counts that leave a partial chunk of 16; 2880 x 2880 (GPT-OSS): multiples of 64, the
    fast path for bf16/int8; 10944 (DeepSeek-V2-Lite's dense down): int4 in groups of 64 read
    one row at a time.  AVX2 (ffn_fast_avx2.c): down rows of up to 8192 columns one at a time,
    longer ones in fours, with the same accumulator pairs per row and token as two tokens'
    row pairs."""
    _isa(ctx, isa)
    H, I = shape
    rng = np.random.default_rng(zlib.crc32(f"one{dtype}{H}".encode()))
    g, u, d, _ = make_expert(rng, H, I, std=1.0 / np.sqrt(H))
    t = quant.expert_tensors(g, u, d, dtype)
    x = rng.standard_normal((2, H)).astype(np.float32)
    y1 = kernels.ffn(t, x[:1], dtype, "silu", ctx=ctx)
    y2 = kernels.ffn(t, x, dtype, "silu", ctx=ctx)
    np.testing.assert_array_equal(y1[0], y2[0])
    ref = ref_ffn(quant.dequantize_expert(t), x[:1], "silu")
    assert np.linalg.norm(y1 - ref) / np.linalg.norm(ref) < FAST_TOL[dtype]



@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("isa", FAST_ISAS)
def test_fast_path_int4_group_256(ctx, isa, T):
    _isa(ctx, isa)
    rng = np.random.default_rng(11 + T)
    H, I = 512, 2304  # I/128 = 18 blocks: one full and one partial chunk of 16
    g, u, d, _ = make_expert(rng, H, I, std=1.0 / np.sqrt(H))
    t = quant.expert_tensors(g, u, d, "int4", group=256)
    x = rng.standard_normal((T, H)).astype(np.float32)
    ref = ref_ffn(quant.dequantize_expert(t), x, "silu")
    y = kernels.ffn(t, x, ctx=ctx)
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < FAST_TOL["int4"]


@pytest.mark.parametrize("activation", ["silu", "gptoss"])
@pytest.mark.parametrize("isa", FAST_ISAS)
def test_fast_path_vector_activation_is_accurate(ctx, isa, activation):
    """The fast path's activation runs a vector exp (ffn_fast.c exp16) instead of libm's expf.
    int8's own rounding is ~1e-4, so a bound of 3e-4 over gate values spanning +-120 (exp
    overflow/underflow clamps, the gptoss limits) would catch an exp off by more than ~1e-4.
    AVX2: ffn_fast_avx2.c exp8, the same polynomial."""
    _isa(ctx, isa)
    if not _fast_runs("int8", isa):
        pytest.skip("no AVX512_VNNI: the AVX-512 int8 fast path does not run here")
    rng = np.random.default_rng(21)
    H, I = 256, 384
    g, u, d, _ = make_expert(rng, H, I, std=1.0 / np.sqrt(H))
    g *= np.linspace(0.05, 120.0, I, dtype=np.float32)[:, None]  # rows from tiny to huge gates
    t = quant.expert_tensors(g, u, d, "int8")
    x = rng.standard_normal((2, H)).astype(np.float32)
    y = kernels.ffn(t, x, "int8", activation, ctx=ctx)
    ref = ref_ffn(quant.dequantize_expert(t), x, activation)
    assert np.isfinite(y).all()
    assert np.linalg.norm(y - ref) / np.linalg.norm(ref) < 3e-4


@pytest.mark.parametrize("isa", FAST_ISAS)
def test_fast_path_falls_back_when_shape_or_group_unsupported(ctx, isa):
    _isa(ctx, isa)
    rng = np.random.default_rng(7)
    # H or I not a multiple of 64, int4 group 96: exact path, same bits as precise; int4 group
    # 32 (GGUF's Q4_0 kept) has a fast path (the AVX2 form, on either ISA)
    for dtype, H, I, group, fast in [("bf16", 96, 128, None, False),
                                     ("int8", 128, 160, None, False),
                                     ("int4", 192, 192, 96, False), ("int4", 128, 128, 32, True)]:
        g, u, d, _ = make_expert(rng, H, I)
        t = quant.expert_tensors(g, u, d, dtype, **({"group": group} if group else {}))
        x = rng.standard_normal((3, H)).astype(np.float32)
        y, yp = kernels.ffn(t, x, ctx=ctx), kernels.ffn(t, x, precise=True, ctx=ctx)
        assert (not np.array_equal(y, yp)) == fast, (dtype, group)


def test_precise_flag_in_desc_and_spec(ctx):
    rng = np.random.default_rng(3)
    g, u, d, _ = make_expert(rng, 256, 128)
    t = quant.expert_tensors(g, u, d, "int4")
    block, entries = kernels.pack_block(t)
    spec = kernels.FFNSpec.from_store_schema(entries, precise=True)
    assert spec.desc()["precise"] == 1
    assert kernels.FFNSpec.from_store_schema(entries).desc()["precise"] == 0
    x = rng.standard_normal((2, 256)).astype(np.float32)
    out = np.zeros_like(x)
    ctx.set_isa("auto")
    ctx.ffn_forward(spec.desc(), block, x, out)
    np.testing.assert_allclose(out, ref_ffn(quant.dequantize_expert(t), x, "silu"), rtol=1e-4,
                               atol=1e-5)


@pytest.mark.parametrize("isa", ISAS)
def test_silu_against_torch(ctx, isa):
    _isa(ctx, isa)
    rng = np.random.default_rng(7)
    H, I = 96, 64
    g, u, d, _ = make_expert(rng, H, I, std=0.2)
    x = rng.standard_normal((5, H)).astype(np.float32)
    y = kernels.ffn(quant.expert_tensors(g, u, d, "f32"), x, ctx=ctx)
    xt = torch.from_numpy(x).double()
    gt, ut, dt = (torch.from_numpy(a).double() for a in (g, u, d))
    want = (torch.nn.functional.silu(xt @ gt.T) * (xt @ ut.T)) @ dt.T
    np.testing.assert_allclose(y, want.numpy(), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("isa", ISAS)
def test_gptoss_against_transformers_experts(ctx, isa):
    """The GPTOSS activation against transformers' own GptOssExperts (interleaved gate_up,
    [H, 2I] layout, biases), converted to the canonical layout the store writer uses."""
    _isa(ctx, isa)
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    H, I, E = 64, 32, 2
    cfg = GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E,
                       num_experts_per_tok=1)
    ex = GptOssExperts(cfg).double()
    torch.manual_seed(0)
    with torch.no_grad():
        for p in ex.parameters():
            p.normal_(0, 0.4)
    gu = ex.gate_up_proj[0].detach().numpy()      # [H, 2I], gate = even cols, up = odd cols
    gub = ex.gate_up_proj_bias[0].detach().numpy()
    dn = ex.down_proj[0].detach().numpy()        # [I, H]
    dnb = ex.down_proj_bias[0].detach().numpy()
    t = quant.expert_tensors(gu[:, 0::2].T, gu[:, 1::2].T, dn.T, "f32",
                             biases={"gate": gub[0::2], "up": gub[1::2], "down": dnb})
    rng = np.random.default_rng(8)
    x = rng.standard_normal((4, H)).astype(np.float32)
    idx = torch.zeros((4, 1), dtype=torch.long)
    wts = torch.ones((4, 1), dtype=torch.float64)
    with torch.no_grad():
        want = ex(torch.from_numpy(x).double(), idx, wts).numpy()
    y = kernels.ffn(t, x, "f32", "gptoss", alpha=cfg.swiglu_alpha, limit=cfg.swiglu_limit,
                    ctx=ctx)
    np.testing.assert_allclose(y, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("isa", ISAS)
@pytest.mark.parametrize("dtype", quant.DTYPES)
def test_rows_scale_accumulate_many_tokens(ctx, isa, dtype):
    """Prefill grouping: 19 tokens (more than one tile) picked by rows, weighted, accumulated
    into an out that already holds values; untouched rows stay as they were."""
    _isa(ctx, isa)
    rng = np.random.default_rng(9)
    H, I = _shape_for(dtype, 128, 96)
    g, u, d, _ = make_expert(rng, H, I, std=0.1)
    t = quant.expert_tensors(g, u, d, dtype)
    x = rng.standard_normal((30, H)).astype(np.float32)
    rows = rng.permutation(30)[:19].astype(np.int32)
    scale = rng.uniform(0.1, 1.0, 19).astype(np.float32)
    out0 = rng.standard_normal((30, H)).astype(np.float32)
    out = out0.copy()
    kernels.ffn(t, x, rows=rows, scale=scale, out=out, ctx=ctx)
    want = out0.astype(np.float64)
    want[rows] += scale[:, None] * ref_ffn(quant.dequantize_expert(t), x[rows], "silu")
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_thread_counts_agree_with_reference(threads):
    c = _C.KernelContext(threads)
    assert c.threads == threads
    rng = np.random.default_rng(10)
    g, u, d, _ = make_expert(rng, 256, 160, std=0.1)
    t = quant.expert_tensors(g, u, d, "bf16")
    x = rng.standard_normal((3, 256)).astype(np.float32)
    y = kernels.ffn(t, x, ctx=c)
    np.testing.assert_allclose(y, ref_ffn(quant.dequantize_expert(t), x, "silu"), rtol=1e-4,
                               atol=1e-4)


def test_split_check(tmp_path, c_compiler):
    """The pool's chunk split (smoe_split: a contiguous range of chunks per thread, then steals
    from the other ranges' backs) takes every chunk exactly once and a thread's own chunks in
    order, in turns and with racing threads: tests/c/split_check.c, built here."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    exe = tmp_path / "split_check"
    subprocess.run([c_compiler, "-std=c11", "-D_GNU_SOURCE", "-O1", "-Wall", "-Wextra", "-Werror",
                    "-pthread", "-I", os.path.join(root, "csrc"), "-o", str(exe),
                    os.path.join(root, "tests", "c", "split_check.c"),
                    os.path.join(root, "csrc", "kernels", "pool.c"),
                    os.path.join(root, "csrc", "common.c")], check=True)
    p = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stdout + p.stderr


def test_default_context_controls():
    kernels.set_isa("scalar")
    try:
        assert kernels.isa() == "scalar"
        kernels.set_isa("auto")
        assert kernels.isa() == _BEST
        n = kernels.num_threads()
        kernels.set_num_threads(1)
        assert kernels.num_threads() == 1
        kernels.set_num_threads(n)
    finally:
        kernels.set_isa("auto")
    with pytest.raises(ValueError, match="unknown ISA"):
        kernels.set_isa("sse9")


def _context_under_env(var, value, attr):
    """A fresh process's KernelContext(1).<attr> with var=value set: its value as printed, or
    'VE <message>' when the context refuses the setting."""
    code = (f"from specmoe import _C\ntry:\n print(_C.KernelContext(1).{attr})\n"
            "except ValueError as e:\n print('VE', e)")
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, **{var: value}),
                       capture_output=True, text=True, check=True)
    return r.stdout.strip()


def test_env_forces_lower_isa():
    assert _context_under_env("SPECMOE_ISA", "scalar", "isa") == "scalar"
    out = _context_under_env("SPECMOE_ISA", "bogus", "isa")
    assert out.startswith("VE") and "SPECMOE_ISA" in out


@pytest.mark.parametrize("dtype", ["bf16", "int8"])
@pytest.mark.parametrize("shape", [(2048, 1024), (1408, 2816)], ids=lambda s: f"{s[0]}x{s[1]}")
def test_stream_prefetch_never_changes_results(shape, dtype):
    """The one-token bf16/int8 row loops' software prefetch (KernelContext.stream_prefetch,
    default 4096 bytes on Intel CPUs, 0 elsewhere) moves data only: expert calls and linear
    layers give the same bits at every distance."""
    import torch
    from torch import nn

    from specmoe.models.layers import CLinear

    c = _C.KernelContext(1)
    _isa(c, "avx512")
    H, I = shape
    rng = np.random.default_rng(H + I)
    g, u, d, _ = make_expert(rng, H, I, std=1.0 / np.sqrt(H))
    t = quant.expert_tensors(g, u, d, dtype)
    x = rng.standard_normal((1, H)).astype(np.float32)
    lin = nn.Linear(H, I, bias=False)
    xt = torch.from_numpy(x)
    got = {}
    for pf in (0, 64, 4096, 1 << 20):
        c.stream_prefetch = pf
        assert c.stream_prefetch == pf
        with torch.no_grad():
            got[pf] = (kernels.ffn(t, x, dtype, "silu", ctx=c),
                       CLinear(lin, dtype, ctx=c, torch_above=None)(xt).numpy())
    for pf in (64, 4096, 1 << 20):
        np.testing.assert_array_equal(got[pf][0], got[0][0])
        np.testing.assert_array_equal(got[pf][1], got[0][1])
    for bad, err in ((-1, ValueError), ((1 << 20) + 1, ValueError), (True, TypeError),
                     ("4096", TypeError)):
        with pytest.raises(err, match="stream_prefetch"):
            c.stream_prefetch = bad
    assert c.stream_prefetch == 1 << 20  # unchanged by the refusals


def test_env_sets_stream_prefetch():
    assert _context_under_env("SPECMOE_STREAM_PREFETCH", "8192", "stream_prefetch") == "8192"
    for bad in ("-5", "4k", str((1 << 20) + 1)):
        out = _context_under_env("SPECMOE_STREAM_PREFETCH", bad, "stream_prefetch")
        assert out.startswith("VE") and "SPECMOE_STREAM_PREFETCH" in out, bad


def test_read_bw_positive(ctx):
    assert ctx.read_bw(np.ones(1 << 16, np.uint8), 2) > 0
    with pytest.raises(ValueError):
        ctx.read_bw(np.ones(0, np.uint8), 1)


# ---------- store schema descriptors ----------

def test_from_store_schema_with_padding_and_uppercase(ctx):
    rng = np.random.default_rng(11)
    g, u, d, b = make_expert(rng, 64, 64, std=0.1, bias=True)
    t = quant.expert_tensors(g, u, d, "int8", biases=b)
    block, entries = kernels.pack_block(t)
    # a store-like schema: padding tensors and the writer's upper-case dtypes
    entries = [dict(e, dtype=e["dtype"].upper()) for e in entries]
    entries.insert(1, {"name": "__pad__.0", "dtype": "U8", "shape": [8], "offset": 0,
                       "nbytes": 8})
    nb = -(-block.size // 4096) * 4096
    big = np.zeros(nb, np.uint8)
    big[:block.size] = block
    spec = kernels.FFNSpec.from_store_schema(entries, block_bytes=nb)
    assert (spec.H, spec.I, spec.dtype) == (64, 64, "int8")
    x = rng.standard_normal((2, 64)).astype(np.float32)
    y = kernels.ffn(big, x, spec=spec, ctx=ctx)
    np.testing.assert_allclose(y, ref_ffn(quant.dequantize_expert(t), x, "silu"), rtol=1e-4,
                               atol=1e-4)


def test_from_store_schema_int4_group():
    g, u, d, _ = make_expert(np.random.default_rng(12), 192, 64)
    _, entries = kernels.pack_block(quant.expert_tensors(g, u, d, "int4"))
    spec = kernels.FFNSpec.from_store_schema(entries)
    assert (spec.H, spec.I, spec.group) == (192, 64, 64)


def test_from_store_schema_int2():
    """Packed U8 with [rows, groups, 2] scales is int2 (int4's scales are 2-D)."""
    g, u, d, _ = make_expert(np.random.default_rng(12), 192, 128)
    t = quant.expert_tensors(g, u, d, "int2")
    _, entries = kernels.pack_block(t)
    spec = kernels.FFNSpec.from_store_schema(entries)
    assert (spec.dtype, spec.H, spec.I, spec.group) == ("int2", 192, 128, 64)
    assert spec.weight_bytes == sum(v.nbytes for v in t.values())
    bad = [dict(e, shape=[128, 3, 3]) if e["name"] == "gate.scale" else e for e in entries]
    with pytest.raises(ValueError, match="gate.scale has shape"):
        kernels.FFNSpec.from_store_schema(bad)


def test_int2_rejected_for_linear_layers(ctx):
    w = np.zeros((64, 64), np.float32)
    p, s = quant.quantize_int2(w)
    block, entries = kernels.pack_block({"w": p, "s": s})
    desc = {"N": 64, "K": 64, "dtype": 4, "group": 64, "weight": 0,
            "weight_scale": entries[1]["offset"]}
    with pytest.raises(ValueError, match="int2 weights are for expert FFNs only"):
        _C.Linear(ctx, desc, block)


def test_from_store_schema_errors():
    g, u, d, _ = make_expert(np.random.default_rng(13), 64, 32)
    _, e8 = kernels.pack_block(quant.expert_tensors(g, u, d, "int8"))
    with pytest.raises(ValueError, match="missing tensor 'down'"):
        kernels.FFNSpec.from_store_schema([e for e in e8 if e["name"] != "down"])
    with pytest.raises(ValueError, match="needs tensor 'up.scale'"):
        kernels.FFNSpec.from_store_schema([e for e in e8 if e["name"] != "up.scale"])
    with pytest.raises(ValueError, match="not an expert FFN tensor"):
        kernels.FFNSpec.from_store_schema(e8 + [{"name": "router", "dtype": "F32", "shape": [1],
                                                 "offset": 0, "nbytes": 4}])
    bad = [dict(e, shape=[33, 64]) if e["name"] == "up" else e for e in e8]
    with pytest.raises(ValueError, match="up has shape"):
        kernels.FFNSpec.from_store_schema(bad)
    mixed = [dict(e, dtype="BF16") if e["name"] == "down" else e for e in e8]
    with pytest.raises(ValueError, match="dtypes"):
        kernels.FFNSpec.from_store_schema(mixed)
    with pytest.raises(ValueError, match="unknown activation"):
        kernels.FFNSpec.from_store_schema(e8, activation="gelu")


# ---------- bad input ----------

@pytest.fixture(scope="module")
def small():
    g, u, d, _ = make_expert(np.random.default_rng(14), 64, 32)
    t = quant.expert_tensors(g, u, d, "f32")
    block, entries = kernels.pack_block(t)
    return t, block, kernels.FFNSpec.from_store_schema(entries, block_bytes=block.size)


def test_bad_x(ctx, small):
    t, block, spec = small
    with pytest.raises(ValueError, match="float32"):
        kernels.ffn(t, np.zeros((2, 64)), ctx=ctx)
    with pytest.raises(ValueError, match="hidden size"):
        kernels.ffn(t, np.zeros((2, 63), np.float32), ctx=ctx)
    with pytest.raises(ValueError, match="x must have dtype"):
        ctx.ffn_forward(spec.desc(), block, np.zeros((2, 64)), np.zeros((2, 64), np.float32))
    with pytest.raises(ValueError, match="C-contiguous"):
        ctx.ffn_forward(spec.desc(), block, np.zeros((64, 2), np.float32).T,
                        np.zeros((2, 64), np.float32))
    with pytest.raises(ValueError, match="hidden size is 64"):
        ctx.ffn_forward(spec.desc(), block, np.zeros((2, 64), np.float32),
                        np.zeros((2, 32), np.float32))


def test_bad_rows_scale_out(ctx, small):
    _, block, spec = small
    x = np.zeros((4, 64), np.float32)
    out = np.zeros((4, 64), np.float32)
    with pytest.raises(ValueError, match=r"rows\[1\] = 4 is outside"):
        ctx.ffn_forward(spec.desc(), block, x, out, np.array([0, 4], np.int32))
    with pytest.raises(ValueError, match="rows must have dtype"):
        ctx.ffn_forward(spec.desc(), block, x, out, np.array([0, 1], np.int64))
    with pytest.raises(ValueError, match="scale has 3 entries for 2 tokens"):
        ctx.ffn_forward(spec.desc(), block, x, out, np.array([0, 1], np.int32),
                        np.ones(3, np.float32))
    with pytest.raises(ValueError, match="fewer than x"):
        ctx.ffn_forward(spec.desc(), block, x, np.zeros((3, 64), np.float32))
    ro = np.zeros((4, 64), np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match="writeable"):
        ctx.ffn_forward(spec.desc(), block, x, ro)


def test_bad_descriptor(ctx, small):
    _, block, spec = small
    x = np.zeros((1, 64), np.float32)
    out = np.zeros((1, 64), np.float32)
    with pytest.raises(ValueError, match="'down'.*does not fit"):
        ctx.ffn_forward(spec.desc(), block[: spec.offsets["down"] + 10], x, out)
    from specmoe.runtime.kernels import _DT_CODE
    d = dict(spec.desc(), dtype=max(_DT_CODE.values()) + 1)  # one past the last format
    with pytest.raises(ValueError, match="unknown expert weight dtype"):
        ctx.ffn_forward(d, block, x, out)
    d = dict(spec.desc(), up=None)
    with pytest.raises(ValueError, match="missing up"):
        ctx.ffn_forward(d, block, x, out)
    d = dict(spec.desc(), gate=2)
    with pytest.raises(ValueError, match="'gate' at offset 2 is not 4-byte aligned"):
        ctx.ffn_forward(d, block, x, out)
    d = dict(spec.desc(), dtype=3, group=64, gate_scale=0, up_scale=0, down_scale=0)
    with pytest.raises(ValueError, match="intermediate size I=32 is not a multiple of the group"):
        ctx.ffn_forward(d, block, x, out)
    d = dict(spec.desc(), gate_scale=0)
    with pytest.raises(ValueError, match="unquantized"):
        ctx.ffn_forward(d, block, x, out)
    with pytest.raises(TypeError, match="dict"):
        ctx.ffn_forward([1], block, x, out)
    with pytest.raises(ValueError, match="block must have dtype"):
        ctx.ffn_forward(spec.desc(), block.view(np.int8), x, out)
    with pytest.raises(ValueError, match="raw block needs spec"):
        kernels.ffn(block, x)


def test_bad_context_args():
    with pytest.raises(ValueError, match="threads must be"):
        _C.KernelContext(-1)
    c = _C.KernelContext(1)
    with pytest.raises(ValueError, match="threads must be"):
        c.set_threads(5000)
    with pytest.raises(TypeError):
        c.set_isa(3)

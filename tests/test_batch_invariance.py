"""Batch invariance: a token's output does not depend on the tokens that share its call.

Speculative decoding verifies K drafts in one forward of K + 1 tokens, and the server runs
many requests' tokens in one step; both promise the tokens one-token decoding would give.  With
greedy decoding that promise holds only if every token's logits are bit for bit those of a
one-token step: a difference of one unit in the last place can flip a near-tie of the argmax
(random-weight checkpoints tie outright at times, bf16 logits often).  So every C kernel sums a
(row, token) dot product in the same order at every token count (csrc/kernels/ffn_fast.c NTMAX,
ffn_avx512.c / ffn_avx2.c DENSE_DOT, ffn_avx2.c WIDE_DOT, ffn_fast_avx2.c dot_i4), and these
tests hold them to it: each kernel, each linear layer, and whole models' logits.  The decode attention kernels
(mha.c, mla.c) add one case of their own: the rows of a batched step have holes (other rows
are longer, drafts were rejected), and a row must still get the bits of its step alone.

GGUF block formats kept as a file holds them are invariant at any token count
(ffn_blocks.c INVARIANT_T, tile_min_tokens), prefill sizes included.  Not covered, with
the reason: models whose torch-side f32 matrix products (a router or a shared-expert gate
left in torch) are not invariant in torch itself.
"""
from __future__ import annotations

import copy
import functools
import zlib

import numpy as np
import pytest
import torch
from torch import nn

from specmoe import _C
from specmoe.models.layers import CLinear
from specmoe.models.testing import tiny_model
from specmoe.runtime import engine as hf
from specmoe.runtime import kernels
from specmoe.speculation.decoding import cache_kwargs
from specmoe.storage import ggml_blocks as gb
from specmoe.storage import quant

from .attn_helpers import ISAS as ATTN_ISAS
from .test_kernels import _isa, ctx  # noqa: F401  (the module's context fixture)

ISAS = ["scalar", "avx2", "avx512"]
# (hidden, expert FFN): 8 / 6 int4 blocks a row, enough for two accumulator sets to differ from
# one; 9472 columns: down rows past 8192 (the one-token fours) and a trailing 64-column half block
SHAPES = [(1024, 768), (256, 9472)]
KINDS = {"f32": ("f32", None), "bf16": ("bf16", None), "int8": ("int8", None),
         "int4": ("int4", None), "int4-g64": ("int4", 64), "int4-g32": ("int4", 32)}
T_MAX = 9  # tiles of 4 and 8 tokens and their remainders


def _expert(kind: str, H: int, I: int):
    """A random expert of ``kind`` and shape, and a generator for its inputs, both the same on
    every call: the weights are quantized once a session (about 9 s for every kind and shape,
    six times over without the cache: three ISAs, two precisions)."""
    t, state = _quantized_expert(kind, H, I)
    rng = np.random.default_rng()
    rng.bit_generator.state = state
    return t, rng


@functools.lru_cache(maxsize=None)
def _quantized_expert(kind: str, H: int, I: int):
    rng = np.random.default_rng(zlib.crc32(f"{kind}/{H}/{I}".encode()))
    g, u, d = (rng.standard_normal(s).astype(np.float32) / np.sqrt(s[1])
               for s in ((I, H), (I, H), (H, I)))
    if kind in gb.QUANTIZERS:  # a GGUF block format (both shapes are multiples of 256)
        q = gb.QUANTIZERS[kind]
        t = {"gate": q(g), "up": q(u), "down": q(d)}
    else:
        dtype, group = KINDS[kind]
        t = quant.expert_tensors(g, u, d, dtype, group=group)
    for a in t.values():  # shared between tests: read only
        if isinstance(a, np.ndarray):
            a.flags.writeable = False
    return t, rng.bit_generator.state


# the scalar rows at the wide shape (the slowest third of this test) run in make test-slow
@pytest.mark.parametrize("precise", [False, True], ids=["fast", "precise"])
@pytest.mark.parametrize("kind", list(KINDS) + list(gb.BLOCKS))
@pytest.mark.parametrize("isa,shape", [
    pytest.param(isa, s, id=f"{isa}-{s[0]}x{s[1]}",
                 marks=pytest.mark.slow if isa == "scalar" and s == SHAPES[1] else ())
    for isa in ISAS for s in SHAPES])
def test_expert_rows_equal_one_token_calls(ctx, isa, kind, shape, precise):
    """Each token of a 2-9 token call equals that token alone, bit for bit."""
    _isa(ctx, isa)
    H, I = shape
    t, rng = _expert(kind, H, I)
    x = rng.standard_normal((T_MAX, H)).astype(np.float32)
    x[1] *= 30.0  # a token of another scale beside the others
    alone = np.stack([kernels.ffn(t, x[i:i + 1], precise=precise, ctx=ctx)[0]
                      for i in range(T_MAX)])
    for T in range(2, T_MAX + 1):
        got = kernels.ffn(t, x[:T], precise=precise, ctx=ctx)
        differ = [i for i in range(T) if not np.array_equal(got[i], alone[i])]
        assert not differ, f"{T} tokens: tokens {differ} differ from their one-token calls"


@pytest.mark.parametrize("kind", list(gb.BLOCKS))
@pytest.mark.parametrize("isa", ["avx2", "avx512"])
def test_block_rows_of_prefill_sizes_equal_one_token_calls(ctx, isa, kind):
    """The GGUF block rows keep the one-token order at any token count: each token of a
    37-token call (past INVARIANT_T, a prefill's tokens at one expert: the AVX2 form's tiles
    where they keep that order, else the one-token rows; the AVX-512 VNNI rows 16 tokens a
    pass, 16, 16 and 5) is its one-token call's, bit for bit.  Before, the AVX2 tiles summed
    in an order of their own past 16 tokens, and a GGUF model's prompts of one length could
    not share a prefill exactly."""
    _isa(ctx, isa)
    H, I = SHAPES[0]
    t, rng = _expert(kind, H, I)
    x = rng.standard_normal((37, H)).astype(np.float32)
    x[20] *= 30.0
    got = kernels.ffn(t, x, ctx=ctx)
    differ = [i for i in range(37)
              if not np.array_equal(got[i], kernels.ffn(t, x[i:i + 1], ctx=ctx)[0])]
    assert not differ, f"tokens {differ} differ from their one-token calls"


@pytest.mark.parametrize("N,K", [(300, 2048), (64, 10944)])
@pytest.mark.parametrize("kind", ["f32", "bf16", "int8", "int4", "int4-g32"])
@pytest.mark.parametrize("isa", ISAS)
def test_linear_rows_equal_one_token_calls(ctx, isa, kind, N, K):
    """A dense layer in C (attention projections, shared experts, lm_head): the same."""
    _isa(ctx, isa)
    torch.manual_seed(N + K)
    dtype, group = KINDS[kind]
    lin = CLinear(nn.Linear(K, N, bias=False), dtype, ctx=ctx, torch_above=None, group=group)
    x = torch.randn(T_MAX, K)
    with torch.inference_mode():
        alone = torch.cat([lin(x[i:i + 1]) for i in range(T_MAX)])
        for T in range(2, T_MAX + 1):
            got = lin(x[:T])
            differ = [i for i in range(T) if not torch.equal(got[i], alone[i])]
            assert not differ, f"{T} tokens: tokens {differ} differ from their one-token calls"


@pytest.mark.parametrize("dt,fmt", [(torch.bfloat16, "int4"), (torch.float32, "f32")],
                         ids=["bf16-int4", "f32"])
@pytest.mark.parametrize("arch", ["olmoe", "deepseek_v2", "qwen3_moe"])
def test_model_logits_of_a_verification_forward_equal_one_token_steps(arch, dt, fmt):
    """A K-token forward after a prompt (what verifying K - 1 drafts runs) gives every token
    the logits of one-token steps, bit for bit: experts and dense layers in C (dense in the
    model's own precision), the fused attention blocks (MLA for DeepSeek-V2), torch between.
    1024 hidden columns: eight int4 blocks a row."""
    over = {"num_key_value_heads": 4} if arch == "deepseek_v2" else None
    model = tiny_model(arch, dtype=dt, hidden=1024, inter=768, layers=2, vocab=512,
                       overrides=over)
    hf.offload(model, dtype=fmt, dense="bf16" if dt == torch.bfloat16 else "f32", cache=1.0,
               prefetch=False)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, 512, (1, 12), generator=g)
    nxt = torch.randint(3, 512, (1, 6), generator=g)
    with torch.inference_mode():
        past = model(prompt, use_cache=True).past_key_values
        kv, alone = copy.deepcopy(past), []
        for i in range(nxt.shape[1]):
            out = model(nxt[:, i:i + 1], **cache_kwargs(model, kv), use_cache=True)
            alone.append(out.logits[0, -1])
            kv = out.past_key_values
        for T in range(2, nxt.shape[1] + 1):
            got = model(nxt[:, :T], **cache_kwargs(model, copy.deepcopy(past)),
                        use_cache=True).logits[0]
            differ = [i for i in range(T) if not torch.equal(got[i], alone[i])]
            assert not differ, f"{T} tokens: tokens {differ} differ from one-token steps"


# -- holes: a batched step's rows of other lengths (speculation/batch.py) --------------------

_HOLES = {0: [], 1: list(range(5)), 2: [0, 1, 2, 11, 12]}  # row: its masked cache positions


def _holed(T: int, S: int, hole: float) -> np.ndarray:
    """The batch's additive mask [3, T, S]: causal over each row's last T positions (its new
    tokens), and each row's holes (``_HOLES``: none, left padding, left padding and two
    rejected drafts) masked for every query with ``hole`` (transformers' most negative float,
    or -inf)."""
    i = np.arange(T)[:, None] + (S - T)
    base = np.where(np.arange(S)[None, :] > i, np.finfo(np.float32).min, 0.0)
    bias = np.repeat(base[None].astype(np.float32), len(_HOLES), 0)
    for b, cols in _HOLES.items():
        bias[b, :, cols] = hole
    return bias


def _alone_mask(T: int, n: int) -> np.ndarray | None:
    """The mask of a row's step alone: none at one query, else causal."""
    if T == 1:
        return None
    i = np.arange(T)[:, None] + (n - T)
    return np.where(np.arange(n)[None, :] > i, np.finfo(np.float32).min,
                    0.0).astype(np.float32)[None]


@pytest.mark.parametrize("isa", ATTN_ISAS)
@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("bf16", [False, True], ids=["f32", "bf16"])
@pytest.mark.parametrize("hole", [np.finfo(np.float32).min, -np.inf], ids=["min", "inf"])
def test_attention_rows_with_holes_equal_the_row_alone(isa, T, bf16, hole):
    """The decode attention (``_C.AttnDecode``) of a batch whose rows have holes gives each row
    the bits of its step alone on its own positions: the running softmax's blocks are made of
    the row's real positions (csrc/kernels/attn_impl.h, next_block), so a hole does not shift
    them.  Before, left padding moved every later position to another block and a bf16 logit
    came out one unit off, which flipped a greedy tie in serving."""
    B, H, Hkv, D, S = 3, 6, 2, 40, 29       # S: several blocks of 8 positions
    rng = np.random.default_rng(T * 10 + bf16)
    q = rng.standard_normal((B, H, T, D), dtype=np.float32)
    k = rng.standard_normal((B, Hkv, S, D), dtype=np.float32)
    v = rng.standard_normal((B, Hkv, S, D), dtype=np.float32)
    if bf16:
        k, v = quant.f32_to_bf16(k).reshape(k.shape), quant.f32_to_bf16(v).reshape(v.shape)
    kc = _C.KernelContext(2)
    kc.set_isa(isa)
    att = _C.AttnDecode(kc)
    out = np.empty((B, T, H, D), np.float32)
    att.forward(q, k, v, _holed(T, S, hole), out, 0.3)
    for b, cols in _HOLES.items():
        real = [p for p in range(S) if p not in cols]
        one = np.empty((1, T, H, D), np.float32)
        att.forward(np.ascontiguousarray(q[b:b + 1]),
                    np.ascontiguousarray(k[b:b + 1, :, real]),
                    np.ascontiguousarray(v[b:b + 1, :, real]), _alone_mask(T, len(real)),
                    one, 0.3)
        np.testing.assert_array_equal(out[b], one[0], err_msg=f"row {b} (holes {cols})")


@pytest.mark.parametrize("isa", ATTN_ISAS)
@pytest.mark.parametrize("T", [1, 3])
@pytest.mark.parametrize("bf16", [False, True], ids=["f32", "bf16"])
def test_mla_rows_with_holes_equal_the_row_alone(isa, T, bf16):
    """The same for DeepSeek's absorbed MLA kernel (``_C.MLADecode``): cached latents and rope
    keys in blocks of the row's real positions."""
    B, H, DN, DR, DV, R, S = 3, 4, 16, 8, 12, 40, 29
    rng = np.random.default_rng(T * 10 + bf16 + 1)
    qn = rng.standard_normal((B, H, T, DN), dtype=np.float32)
    qp = rng.standard_normal((B, H, T, DR), dtype=np.float32)
    ckv = rng.standard_normal((B, S, R), dtype=np.float32)
    kpe = rng.standard_normal((B, S, DR), dtype=np.float32)
    w_uk = rng.standard_normal((H, DN, R), dtype=np.float32) * 0.3
    w_uv = rng.standard_normal((H, DV, R), dtype=np.float32) * 0.3
    if bf16:
        ckv = quant.f32_to_bf16(ckv).reshape(ckv.shape)
        kpe = quant.f32_to_bf16(kpe).reshape(kpe.shape)
    kc = _C.KernelContext(2)
    kc.set_isa(isa)
    att = _C.MLADecode(kc, w_uk, w_uv, DR, 0.19)
    out = np.empty((B, T, H * DV), np.float32)
    att.forward(qn, qp, ckv, kpe, _holed(T, S, np.finfo(np.float32).min), out)
    for b, cols in _HOLES.items():
        real = [p for p in range(S) if p not in cols]
        one = np.empty((1, T, H * DV), np.float32)
        att.forward(np.ascontiguousarray(qn[b:b + 1]), np.ascontiguousarray(qp[b:b + 1]),
                    np.ascontiguousarray(ckv[b:b + 1, real]),
                    np.ascontiguousarray(kpe[b:b + 1, real]), _alone_mask(T, len(real)), one)
        np.testing.assert_array_equal(out[b], one[0], err_msg=f"row {b} (holes {cols})")


def _wide_bf16(arch: str):
    """A random bf16 model of ``arch`` with 1024 hidden columns and 3 layers, offloaded with
    every expert resident and its dense layers in C: (model, Engine)."""
    over = {"num_key_value_heads": 4} if arch == "deepseek_v2" else None
    model = tiny_model(arch, dtype=torch.bfloat16, hidden=1024, inter=512, layers=3,
                       overrides=over)
    return model, hf.offload(model, cache=1.0, prefetch=False)


def test_per_sequence_gives_each_sequence_its_own_call():
    """per_sequence runs a row-wise function one sequence at a time inside sequences(n), so a
    sequence gets the bits of its call alone even from a function whose result depends on the
    rows beside it (as MKL's GEMMs on an Intel Xeon with AMX do; AMD hosts' do not): here
    one that adds its input's row count.  A batch-first input's sequences keep their
    dimensions ([1, L, H], as a forward alone passes them: a block's forward unpacks three).
    Inside, the function's own switches count its part as one sequence (a shared expert's
    CLinears went to C on 10 of its 20 rows).  Outside a block, or where n does not divide
    the rows, the function sees the whole input."""
    from specmoe.models.layers import per_sequence, sequence_rows, sequences
    seen = []

    def by_rows(v):  # also what a nested switch (CLinear's torch_above) counts
        seen.append((tuple(v.shape), sequence_rows(v.numel() // v.shape[-1])))
        return v[..., :3] + v.numel() // v.shape[-1]
    x = torch.arange(2 * 6 * 4, dtype=torch.float32).reshape(2, 6, 4)
    alone = torch.stack([by_rows(x[b:b + 1])[0] for b in range(2)])
    seen.clear()
    with sequences(2):
        got = per_sequence(by_rows, x)
    assert seen == [((1, 6, 4), 6), ((1, 6, 4), 6)] and got.shape == (2, 6, 3)
    assert torch.equal(got, alone)
    seen.clear()
    with sequences(2):
        flat = per_sequence(by_rows, x.reshape(12, 4))  # [n * L, H]: the same rows
    assert seen == [((6, 4), 6), ((6, 4), 6)] and torch.equal(flat, alone.reshape(12, 3))
    seen.clear()
    with sequences(5):  # 12 rows do not split into 5 sequences
        per_sequence(by_rows, x)
    per_sequence(by_rows, x)
    assert seen == [((2, 6, 4), 12), ((2, 6, 4), 12)]

    def flat(v):  # a product that flattens its rows: they stay flat
        return v.reshape(-1, v.shape[-1])[:, :2] + v.numel() // v.shape[-1]
    with sequences(2):
        got = per_sequence(flat, x)
    assert torch.equal(got, torch.cat([flat(x[b:b + 1]) for b in range(2)]))

    def router(v):  # a router's (logits, weights, aux loss), rows flattened
        flat = v.reshape(-1, v.shape[-1])
        return flat + flat.shape[0], flat[:, :2] * flat.shape[0], None
    with sequences(2):
        logits, weights, aux = per_sequence(router, x)
    assert aux is None and logits.shape == (12, 4) and weights.shape == (12, 2)
    assert torch.equal(logits, torch.cat([router(x[b:b + 1])[0] for b in range(2)]))
    assert torch.equal(weights, torch.cat([router(x[b:b + 1])[1] for b in range(2)]))


def test_split_sequences_splits_a_module_once():
    """split_sequences makes a module's forward run per sequence inside sequences(n), and a
    second call (a model offloaded again) does not wrap it twice."""
    from specmoe.models.layers import sequences, split_sequences
    calls = []
    lin = nn.Linear(4, 3)
    lin.register_forward_pre_hook(lambda m, a: calls.append(a[0].shape))
    inner = lin.forward
    lin.forward = lambda v: (calls.append(tuple(v.shape)), inner(v))[1]
    assert split_sequences(split_sequences(lin)) is lin
    x = torch.randn(3, 5, 4)
    with sequences(3):
        y = lin(x)
    assert calls == [(3, 5, 4), (1, 5, 4), (1, 5, 4), (1, 5, 4)]  # the hook, then each part
    assert y.shape == (3, 5, 3) and torch.allclose(y, inner(x))


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "deepseek_v2"])
def test_prefill_of_prompts_of_one_length_equals_each_alone(arch):
    """A batched prefill of prompts of one length (the server's default grouping) gives every
    prompt the logits and KV cache of its prefill alone, bit for bit: BatchKV.prefill runs it
    as sequences of one length (specmoe.models.layers.sequences), so each takes its own
    prefill's paths -- 8 tokens in C, 20 and 40 in torch's attention and GEMMs; without that
    the norms of 3 x 40 rows and Qwen3's k-norms of 2 x 20 tokens switched to torch while the
    prompt alone ran them in C.  bf16, 1024 hidden columns, dense layers in C."""
    model, eng = _wide_bf16(arch)
    try:
        _prefill_each_alone(model, ((8, 4), (20, 2), (40, 3)))
    finally:
        eng.close()


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "deepseek_v2", "phimoe", "glm4_moe",
                                  "qwen2_moe"])
def test_f32_prefill_with_dense_in_c_equals_each_alone(arch):
    """The same for an f32 model with its dense layers in C (``dense="f32"``), where the
    bits of f32 products show: above 16 tokens DeepSeek-V2's block runs its own forward, whose
    router's f32 GEMM in torch runs one prompt at a time (split_sequences) while its experts
    take one call for the batch; MKL on an Intel Xeon with AMX gave 2 x 20 rows of that GEMM
    other bits than 20 alone.  PhiMoE's and GLM-4-MoE's blocks route in torch at every size
    (they have no C routing form): their routers split the same way (without, 4 x 8 tokens
    left the bits there).  Qwen2-MoE's block also takes the sigmoid of its shared expert's
    gate in torch, which rounds by the tensor's length (vector body, scalar tail): that runs
    one prompt at a time too (split_shared_gate)."""
    model = tiny_model(arch, hidden=1024, inter=512, layers=3,
                       overrides={"num_key_value_heads": 4} if arch == "deepseek_v2" else None)
    eng = hf.offload(model, cache=1.0, prefetch=False, dense="f32")
    try:
        _prefill_each_alone(model, ((8, 4), (20, 2), (40, 3)))
    finally:
        eng.close()


def _prefill_each_alone(model, cases):
    """For each (L, B) of ``cases``: B random prompts of L tokens prefilled as one batch
    (BatchKV.prefill) give each prompt the last logits and KV cache of its prefill alone."""
    from specmoe.speculation.batch import BatchKV
    from specmoe.speculation.decoding import new_kv
    g = torch.Generator().manual_seed(5)
    for L, B in cases:
        prompts = torch.randint(3, model.config.vocab_size, (B, L), generator=g)
        bkv = BatchKV(model, B)
        logits = bkv.prefill(prompts, torch.ones_like(prompts), last_logits=True)
        for b in range(B):
            kv = new_kv(model)
            with torch.inference_mode():
                alone = model(input_ids=prompts[b:b + 1], use_cache=True,
                              attention_mask=torch.ones((1, L), dtype=torch.long),
                              logits_to_keep=1, **cache_kwargs(model, kv)).logits[0, -1]
            assert torch.equal(logits[b], alone), f"{B} x {L} tokens: row {b}'s logits"
            for i, (a, c) in enumerate(zip(bkv.row(b).layers, kv.layers)):
                assert torch.equal(a.keys, c.keys) and torch.equal(a.values, c.values), \
                    f"{B} x {L} tokens: row {b}'s cache at layer {i}"


@pytest.mark.parametrize("arch", ["mixtral", "qwen3_moe", "deepseek_v2"])
def test_batched_decode_steps_of_many_tokens_equal_each_row_alone(arch):
    """A batched decode or verification step (BatchKV.forward: the server's continuous batch,
    generate's speculative batch) gives every row the logits of its step alone, bit for bit,
    rows of different token counts (holes) included: at 21 tokens in all (past the projections'
    16-row switch to torch's GEMM) and at 70 (past the fused attention block's 64).  Each row
    runs as a sequence of its own (specmoe.models.layers.sequences); without that, Qwen3-MoE
    and DeepSeek-V2 rows left their bits at 21 tokens and every architecture at 70.  bf16,
    1024 hidden columns, dense layers in C."""
    from specmoe.speculation.batch import BatchKV
    model, eng = _wide_bf16(arch)
    try:
        g = torch.Generator().manual_seed(7)
        L = 8
        for B, m in ((6, 4), (20, 4)):
            prompts = torch.randint(3, model.config.vocab_size, (B, L), generator=g)
            rows = torch.randint(3, model.config.vocab_size, (B, m), generator=g).tolist()
            rows = [r[:m - b % 2] for b, r in enumerate(rows)]  # odd rows one token short
            bkv = BatchKV(model, B)
            bkv.prefill(prompts, torch.ones_like(prompts))
            _each_row_alone(model, prompts, rows, bkv.forward(rows))
    finally:
        eng.close()


@pytest.mark.parametrize("arch", ["qwen2_moe", "phimoe"])
def test_f32_batched_decode_steps_with_routing_in_torch_equal_each_row_alone(arch):
    """The same for f32 models whose blocks route in torch (no C routing form), dense layers in
    C: each row's router, and Qwen2-MoE's sigmoid gate of its shared expert, run one row at a
    time (split_sequences, split_shared_gate); without them a row of 6 left its bits here."""
    from specmoe.speculation.batch import BatchKV
    model = tiny_model(arch, hidden=1024, inter=512, layers=3)
    eng = hf.offload(model, cache=1.0, prefetch=False, dense="f32")
    try:
        g = torch.Generator().manual_seed(7)
        prompts = torch.randint(3, model.config.vocab_size, (6, 8), generator=g)
        rows = torch.randint(3, model.config.vocab_size, (6, 4), generator=g).tolist()
        rows = [r[:4 - b % 2] for b, r in enumerate(rows)]
        bkv = BatchKV(model, 6)
        bkv.prefill(prompts, torch.ones_like(prompts))
        _each_row_alone(model, prompts, rows, bkv.forward(rows))
    finally:
        eng.close()


def _each_row_alone(model, prompts, rows, logits):
    """Each row's step alone (its prompt prefilled, then its tokens) has the batched step's
    logits ``logits`` [B, m, V] of that row, bit for bit."""
    from specmoe.speculation.batch import BatchKV
    B, L = prompts.shape
    for b in range(B):
        one = BatchKV(model, 1)
        one.prefill(prompts[b:b + 1], torch.ones((1, L), dtype=torch.long))
        alone = one.forward([rows[b]])
        n = len(rows[b])
        assert torch.equal(logits[b, :n], alone[0, :n]), \
            f"{B} rows, {sum(map(len, rows))} tokens: row {b}'s logits"


def test_batched_f32_mla_rows_equal_each_row_alone():
    """f32 DeepSeek-V2 with its dense layers in C: a batched decode or verification step runs
    each layer as one MLABlock call over its rows (at most 64 tokens a call, whole rows), so
    every row gets the logits of its step alone, bit for bit, holes included.  Before, B > 1
    took the absorbed attention module by module, whose torch norms and products round by
    shape in f32: every row 1-2e-6 off.  The calls are counted: 6 x 1 and 6 x 4 tokens in one
    call a layer, 20 rows of 4 in two.  (A tiny f32 DeepSeek-V3's attention is exact the same
    way, but its MoE block routes in torch, whose gate rounds by shape: 6e-8.)"""
    from specmoe.speculation.batch import BatchKV
    model = tiny_model("deepseek_v2", dtype=torch.float32, hidden=512, inter=256, layers=2,
                       overrides={"num_key_value_heads": 4})
    eng = hf.offload(model, cache=1.0, prefetch=False, dense="f32")
    calls = []
    for layer in model.model.layers:
        ref = layer._specmoe_mlab
        layer._specmoe_mlab = ref._replace(block=_RowCounting(ref.block, calls))
    try:
        g = torch.Generator().manual_seed(7)
        L = 8
        for B, m, per_layer in ((6, 1, [6]), (6, 4, [24]), (20, 4, [64, 16])):
            prompts = torch.randint(3, model.config.vocab_size, (B, L), generator=g)
            rows = torch.randint(3, model.config.vocab_size, (B, m), generator=g).tolist()
            rows = [r[:max(m - b % 2, 1)] for b, r in enumerate(rows)]  # holes
            bkv = BatchKV(model, B)
            bkv.prefill(prompts, torch.ones_like(prompts))
            calls.clear()
            logits = bkv.forward(rows)
            assert calls == per_layer * len(model.model.layers)
            _each_row_alone(model, prompts, rows, logits)
    finally:
        eng.close()


class _RowCounting:
    """Stands in for a layer's MLABlock and records each call's tokens (every row's)."""

    def __init__(self, blk, calls):
        self.blk, self.calls = blk, calls

    def attn(self, x, *a):
        self.calls.append(x.shape[0])
        return self.blk.attn(x, *a)

    def layer(self, layers, pos, flags, x, *a):
        self.calls.append(x.shape[0])
        return self.blk.layer(layers, pos, flags, x, *a)

"""Batch invariance: a token's output does not depend on the tokens that share its call.

Speculative decoding verifies K drafts in one forward of K + 1 tokens, and the server runs
many requests' tokens in one step; both promise the tokens one-token decoding would give.  With
greedy decoding that promise holds only if every token's logits are bit for bit those of a
one-token step: a difference of one unit in the last place can flip a near-tie of the argmax
(random-weight checkpoints tie outright at times, bf16 logits often).  So every C kernel sums a
(row, token) dot product in the same order at every token count (csrc/kernels/ffn_fast.c NTMAX,
ffn_avx512.c / ffn_avx2.c DENSE_DOT, ffn_fast_avx2.c dot_i4), and these tests hold them to it:
each kernel, each linear layer, and whole models' logits.

GGUF block formats kept as a file holds them are invariant up to 16 tokens a call (decode
sizes: ffn_blocks.c INVARIANT_T runs each token through the one-token rows; prefill chunks
above take the multi-token tiles).  Not covered, with the reason: models whose torch-side f32
matrix products (a router or a shared-expert gate left in torch) are not invariant in torch
itself.
"""
from __future__ import annotations

import copy
import zlib

import numpy as np
import pytest
import torch
from torch import nn

from specmoe.models.layers import CLinear
from specmoe.models.testing import tiny_model
from specmoe.runtime import engine as hf
from specmoe.runtime import kernels
from specmoe.storage import ggml_blocks as gb
from specmoe.storage import quant

from .test_kernels import _isa, ctx  # noqa: F401  (the module's context fixture)

ISAS = ["scalar", "avx2", "avx512"]
# (hidden, expert FFN): 8 / 6 int4 blocks a row, enough for two accumulator sets to differ from
# one; 9472 columns: down rows past 8192 (the one-token fours) and a trailing 64-column half block
SHAPES = [(1024, 768), (256, 9472)]
KINDS = {"f32": ("f32", None), "bf16": ("bf16", None), "int8": ("int8", None),
         "int4": ("int4", None), "int4-g64": ("int4", 64), "int4-g32": ("int4", 32)}
T_MAX = 9  # tiles of 4 and 8 tokens and their remainders


def _expert(kind: str, H: int, I: int):
    rng = np.random.default_rng(zlib.crc32(f"{kind}/{H}/{I}".encode()))
    g, u, d = (rng.standard_normal(s).astype(np.float32) / np.sqrt(s[1])
               for s in ((I, H), (I, H), (H, I)))
    if kind in gb.QUANTIZERS:  # a GGUF block format (both shapes are multiples of 256)
        q = gb.QUANTIZERS[kind]
        return {"gate": q(g), "up": q(u), "down": q(d)}, rng
    dtype, group = KINDS[kind]
    return quant.expert_tensors(g, u, d, dtype, group=group), rng


@pytest.mark.parametrize("precise", [False, True], ids=["fast", "precise"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("kind", list(KINDS) + list(gb.BLOCKS))
@pytest.mark.parametrize("isa", ISAS)
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
            out = model(nxt[:, i:i + 1], past_key_values=kv, use_cache=True)
            alone.append(out.logits[0, -1])
            kv = out.past_key_values
        for T in range(2, nxt.shape[1] + 1):
            got = model(nxt[:, :T], past_key_values=copy.deepcopy(past),
                        use_cache=True).logits[0]
            differ = [i for i in range(T) if not torch.equal(got[i], alone[i])]
            assert not differ, f"{T} tokens: tokens {differ} differ from one-token steps"

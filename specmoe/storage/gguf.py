"""GGUF files (llama.cpp's format) as checkpoints: the model's config and tensor names from the
file's metadata, its tensors read one at a time (experts one expert at a time) with the
``gguf`` package's reader and dequantization.

:class:`GgufCheckpoint` answers what :class:`specmoe.storage.conversion.Checkpoint` answers
for a safetensors folder (``keys``, ``dtypes``, ``tensor``, ``slice``, ``nbytes``,
``fingerprint``, ``close``), under the names transformers' model of the architecture uses, so
:func:`specmoe.from_pretrained` builds, loads and converts a GGUF file through the same plan as
a safetensors folder.  Each layer's stacked experts (``blk.N.ffn_{gate,up}_exps``,
``ffn_down_exps``) appear as the fused ``mlp.experts.gate_up_proj`` [E, 2I, H] and
``mlp.experts.down_proj`` [E, H, I] of transformers 5; ``slice(key, e)`` reads and dequantizes
only expert ``e``'s bytes.

What is converted: the llama.cpp architectures in :data:`ARCHITECTURES` (``llama`` with
experts, i.e. Mixtral; ``qwen2moe``; ``qwen3moe``; ``olmoe``; ``deepseek2``, its
``attn_k_b``/``attn_v_b`` joined back into ``kv_b_proj``: with softmax routing DeepSeek-V2 and
V2-Lite, with sigmoid routing and its correction bias ``exp_probs_b`` DeepSeek-V3 / R1, Kimi-K2
and GLM-4.7-Flash, read as transformers' ``deepseek_v3``; ``glm4moe`` (GLM-4.5 to 4.7;
multi-token-prediction blocks after the main layers left out); ``minimax-m2``; ``dots1``;
``gpt-oss``, its experts presented in transformers' GPT-OSS layout, gate and up interleaved,
with their biases: :meth:`GgufCheckpoint._assemble`).  Tensor types: whatever the
``gguf`` package dequantizes (F32, F16, BF16, Q4_0 ... Q8_0, the K-quants, the IQ types,
MXFP4).  The routed experts are kept as the file holds them where the kernels read the
format: Q8_0 / Q4_K / Q5_K / Q6_K / Q4_0 / IQ4_XS / Q4_1 / Q2_K / Q3_K / MXFP4 (with Q5_0
widened to Q8_0 without loss, e.g. a Q4_K_M file's fallback layers) in the ``"gguf"`` store dtype, or Q4_0 everywhere in int4 with
groups of 32 (``dtype="int4"``) (:meth:`GgufCheckpoint.block_kinds`,
:mod:`specmoe.storage.ggml_blocks`).
Other files' experts are dequantized to f32 and written in the store dtype
(:func:`natural_dtype` picks the nearest one to the file's expert type).

Facts used from llama.cpp's converter (``convert_hf_to_gguf.py``): GGUF shapes are the numpy
shapes reversed (``ne``); the ``llama`` architecture stores ``q_proj``/``k_proj`` with the rows
of each head permuted for its rotary layout (undone here, :func:`_unpermute`); ``qwen2moe``,
``qwen3moe`` and ``olmoe`` store them as they are.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["ARCHITECTURES", "PERMUTED_QK", "GgufCheckpoint", "GgufError", "gguf_name", "is_gguf",
           "natural_dtype"]


class GgufError(ValueError):
    """A GGUF file that cannot be converted: not GGUF, an architecture or tensor type specmoe
    does not read, metadata or tensors missing.  The message names the file."""


# llama.cpp architecture -> transformers model_type (checked against the expert count)
ARCHITECTURES: dict[str, str] = {
    "llama": "mixtral",  # llama.cpp writes Mixtral as llama with expert_count > 0
    "qwen2moe": "qwen2_moe",
    "qwen3moe": "qwen3_moe",
    "olmoe": "olmoe",
    "deepseek2": "deepseek_v2",  # DeepSeek-V2 / V2-Lite (softmax routing); with sigmoid
    # routing (expert_gating_func 2) the same architecture is DeepSeek-V3 / R1, Kimi-K2 or
    # GLM-4.7-Flash: transformers' deepseek_v3 (_DEEPSEEK2_SIGMOID)
    "gpt-oss": "gpt_oss",
    "glm4moe": "glm4_moe",  # GLM-4.5 / 4.5-Air / 4.6 / 4.7
    "minimax-m2": "minimax_m2",  # MiniMax-M2 / M2.1
    "dots1": "dots1",  # dots.llm1
    "qwen3next": "qwen3_next",  # Qwen3-Next-80B-A3B
    "qwen35moe": "qwen3_5_moe_text",  # Qwen3.5 / 3.6 MoE (the text model)
    "ernie4_5-moe": "ernie4_5_moe",  # ERNIE-4.5-21B-A3B / 300B-A47B
    "granitemoe": "granitemoe",  # Granite 3.x MoE; with a shared expert (Granite 4.0's
    # dense-attention models) transformers' granitemoeshared (_GRANITE_SHARED)
    "granitehybrid": "granitemoehybrid",  # Granite 4.0 H (Mamba-2 and attention layers)
    "afmoe": "afmoe",  # Arcee's Trinity (Nano, Mini, Large)
    "lfm2moe": "lfm2_moe",  # Liquid's LFM2-8B-A1B / LFM2-24B-A2B
}
# llama.cpp's expert_gating_func: 1 softmax, 2 sigmoid (3, DeepSeek-V4's sqrt-softplus, is not
# read); a deepseek2 file with sigmoid routing is transformers' deepseek_v3 (GLM-4.7-Flash's
# glm4_moe_lite has DeepSeek-V3's forward line for line, specmoe.models.arch.MLA_ATTENTION)
_DEEPSEEK2_SIGMOID = "deepseek_v3"
_GRANITE_SHARED = "granitemoeshared"



def gguf_arch(model_type: str) -> str:
    """The llama.cpp architecture of transformers ``model_type`` (the inverse of
    :data:`ARCHITECTURES`); KeyError for a type llama.cpp does not write as one of them."""
    if model_type == _DEEPSEEK2_SIGMOID:
        return "deepseek2"
    if model_type == _GRANITE_SHARED:
        return "granitemoe"
    return {v: k for k, v in ARCHITECTURES.items()}[model_type]


# the rotary rows of q/k are permuted by llama.cpp's converter for these architectures (its
# LlamaModel and the converters derived from it: Granite's)
PERMUTED_QK = frozenset({"llama", "granitemoe", "granitehybrid"})

# GGUF tensor name (after "blk.N.") -> the transformers parameter (after "model.layers.N.")
_LAYER_NAMES: dict[str, str] = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
    "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
}
# DeepSeek's MoE block, as several architectures keep it: dense leading layers, shared experts
# (under "shared_experts"), sigmoid routing's correction bias on the router
_DEEPSEEK_MLP: dict[str, str] = {
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
}
# the gated DeltaNet (linear attention) layers of Qwen3-Next and Qwen3.5, as llama.cpp's
# Qwen3NextModel names them; several are stored transformed (_GATED_DELTA_LAYOUT)
_GATED_DELTA: dict[str, str] = {
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ssm_a": "linear_attn.A_log",
    "ssm_dt.bias": "linear_attn.dt_bias",
    "ssm_conv1d.weight": "linear_attn.conv1d.weight",
    "ssm_norm.weight": "linear_attn.norm.weight",
    "ssm_out.weight": "linear_attn.out_proj.weight",
}
# tensors llama.cpp's converters split in two, joined back on reading (the GGUF names, then
# the transformers name; rows of the first, then of the second, unless _layout says more):
# Qwen3-Next's in_proj_qkvz (attn_qkv + attn_gate: _join_qkvz), Granite's shared expert
# input_linear (gate rows, then up)
_GRANITE_SHARED_JOIN = (("ffn_gate_shexp.weight", "ffn_up_shexp.weight"),
                        "shared_mlp.input_linear.weight")
_JOINED: dict[str, tuple[tuple[str, str], str]] = {
    "qwen3next": (("attn_qkv.weight", "attn_gate.weight"), "linear_attn.in_proj_qkvz.weight"),
    "granitemoe": _GRANITE_SHARED_JOIN,
    "granitehybrid": _GRANITE_SHARED_JOIN,
}
# the MoE block's module (transformers' name) where it is not "mlp"
_MOE_BLOCK = {"granitemoe": "block_sparse_moe", "granitehybrid": "block_sparse_moe",
              "lfm2moe": "feed_forward"}
_GRANITE_MOE = {"ffn_gate_inp.weight": "block_sparse_moe.router.weight",
                "ffn_down_shexp.weight": "shared_mlp.output_linear.weight"}
# per architecture, where it differs from _LAYER_NAMES
_ARCH_LAYER_NAMES: dict[str, dict[str, str]] = {
    # llama.cpp's Ernie4_5MoeModel: dense leading layers, shared experts, and the correction
    # bias its softmax router adds for the choice (not the weights) of the experts
    "ernie4_5-moe": {**_DEEPSEEK_MLP,
                     "exp_probs_b.bias": "mlp.gate.moe_statics.e_score_correction_bias"},
    "granitemoe": _GRANITE_MOE,
    # llama.cpp's LFM2MoeModel: short gated-convolution layers beside the attention ones
    # (its kernel squeezed, _MAMBA2_LAYOUT), the MLP as w1 / w3 / w2, sigmoid routing with the
    # block's correction bias
    "lfm2moe": {"attn_norm.weight": "operator_norm.weight",
                "ffn_norm.weight": "ffn_norm.weight",
                "attn_output.weight": "self_attn.out_proj.weight",
                "attn_q_norm.weight": "self_attn.q_layernorm.weight",
                "attn_k_norm.weight": "self_attn.k_layernorm.weight",
                "shortconv.conv.weight": "conv.conv.weight",
                "shortconv.conv.bias": "conv.conv.bias",
                "shortconv.in_proj.weight": "conv.in_proj.weight",
                "shortconv.out_proj.weight": "conv.out_proj.weight",
                "ffn_gate.weight": "feed_forward.w1.weight",
                "ffn_up.weight": "feed_forward.w3.weight",
                "ffn_down.weight": "feed_forward.w2.weight",
                "ffn_gate_inp.weight": "feed_forward.gate.weight",
                "exp_probs_b.bias": "feed_forward.expert_bias"},
    # llama.cpp's AfmoeModel: four norms per layer, the attention's output gate, DeepSeek's
    # MoE block with the sigmoid router's correction bias on the block
    "afmoe": {**_DEEPSEEK_MLP,
              "post_attention_norm.weight": "post_attention_layernorm.weight",
              "ffn_norm.weight": "pre_mlp_layernorm.weight",
              "post_ffw_norm.weight": "post_mlp_layernorm.weight",
              "attn_gate.weight": "self_attn.gate_proj.weight",
              "ffn_gate_inp.weight": "mlp.router.gate.weight",
              "exp_probs_b.bias": "mlp.expert_bias"},
    # llama.cpp's GraniteHybridModel: Granite's MoE block and Mamba-2 layers (_MAMBA2_LAYOUT)
    "granitehybrid": {**_GRANITE_MOE,
                      "ssm_a": "mamba.A_log",
                      "ssm_d": "mamba.D",
                      "ssm_conv1d.weight": "mamba.conv1d.weight",
                      "ssm_conv1d.bias": "mamba.conv1d.bias",
                      "ssm_dt.bias": "mamba.dt_bias",
                      "ssm_in.weight": "mamba.in_proj.weight",
                      "ssm_norm.weight": "mamba.norm.weight",
                      "ssm_out.weight": "mamba.out_proj.weight"},
    "qwen3next": {**_GATED_DELTA, "ssm_ba.weight": "linear_attn.in_proj_ba.weight"},
    "qwen35moe": {**_GATED_DELTA,
                  "attn_qkv.weight": "linear_attn.in_proj_qkv.weight",
                  "attn_gate.weight": "linear_attn.in_proj_z.weight",
                  "ssm_alpha.weight": "linear_attn.in_proj_a.weight",
                  "ssm_beta.weight": "linear_attn.in_proj_b.weight"},
    "deepseek2": {
        **_DEEPSEEK_MLP,
        "attn_q_a.weight": "self_attn.q_a_proj.weight",
        "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
        "attn_q_b.weight": "self_attn.q_b_proj.weight",
        "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
        "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
        "attn_kv_b.weight": "self_attn.kv_b_proj.weight",  # files from before the split
    },
    # llama.cpp's Glm4MoeModel: the pre-MLP norm as post_attention_norm
    "glm4moe": {**_DEEPSEEK_MLP, "post_attention_norm.weight": "post_attention_layernorm.weight"},
    "dots1": _DEEPSEEK_MLP,
    # llama.cpp's MiniMaxM2Model: the correction bias on the MoE block itself
    "minimax-m2": {
        "exp_probs_b.bias": "mlp.e_score_correction_bias",
    },
    # llama.cpp's GptOssModel: the post-attention norm under its own name, the attention sinks
    # as a ".weight", the router (with its bias) as ffn_gate_inp
    "gpt-oss": {
        "post_attention_norm.weight": "post_attention_layernorm.weight",
        "attn_output.bias": "self_attn.o_proj.bias",
        "attn_sinks.weight": "self_attn.sinks",
        "ffn_gate_inp.weight": "mlp.router.weight",
        "ffn_gate_inp.bias": "mlp.router.bias",
    },
}
# llama.cpp's converter splits DeepSeek's kv_b_proj [heads * (nope + v), kv_lora] into
# attn_k_b [heads, kv_lora, nope] (each head's k part transposed) and attn_v_b [heads, v,
# kv_lora]; they are joined back (_join_kv_b)
_KV_B_SPLIT = ("attn_k_b.weight", "attn_v_b.weight")

_TOP_NAMES = {"token_embd.weight": "model.embed_tokens.weight",
              "output_norm.weight": "model.norm.weight",
              "output.weight": "lm_head.weight"}
# LFM2's last norm (transformers' embedding_norm, applied after the last layer)
_ARCH_TOP_NAMES = {"lfm2moe": {"token_embd_norm.weight": "model.embedding_norm.weight"}}
_EXPERT_NAMES = ("ffn_gate_exps.weight", "ffn_up_exps.weight", "ffn_down_exps.weight")
# newer converters may write gate and up as one stacked tensor (gate rows, then up rows)
_GATE_UP_FUSED = "ffn_gate_up_exps.weight"
# GPT-OSS's expert biases (converter: gate_up_proj_bias split into its even / odd entries)
_EXPERT_BIAS_NAMES = ("ffn_gate_exps.bias", "ffn_up_exps.bias", "ffn_down_exps.bias")
_GATE_UP_BIAS_FUSED = "ffn_gate_up_exps.bias"
_BLK = re.compile(r"^blk\.(\d+)\.(.+)$")

# GGUF expert type -> the nearest store dtype (dtype="auto")
_NEAREST = {"F32": "f32", "F16": "bf16", "BF16": "bf16", "Q8_0": "int8", "Q8_1": "int8",
            "Q6_K": "int8", "Q8_K": "int8"}


def gguf_name(name: str, arch: str) -> str | None:
    """The GGUF name of transformers tensor ``name`` in llama.cpp architecture ``arch`` (the
    inverse of the reader's map; None for the experts and for names it has no entry for)."""
    top = {v: k for k, v in dict(_TOP_NAMES, **_ARCH_TOP_NAMES.get(arch, {})).items()}
    if name in top:
        return top[name]
    layer = {v: k for k, v in dict(_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(arch, {})).items()}
    parts = name.split(".", 3)  # model, layers, N, rest
    if len(parts) == 4 and parts[:2] == ["model", "layers"] and parts[3] in layer:
        return f"blk.{parts[2]}.{layer[parts[3]]}"
    return None


def is_gguf(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` names a GGUF file (a regular file starting with the GGUF magic)."""
    p = Path(path).expanduser()
    if not p.is_file():
        return False
    try:
        with open(p, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:
        return False


def natural_dtype(qtype_name: str) -> str:
    """The store dtype nearest to GGUF type ``qtype_name``: f32 for F32, bf16 for F16/BF16,
    int8 for 8- and 6-bit types, int4 for everything at 5 bits or fewer."""
    return _NEAREST.get(qtype_name, "int4")


def _unpermute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rotary permutation of a q/k projection [n_head * d, H]: the converter
    reorders each head's rows from (half, pair) to (pair, half) order."""
    rows = w.shape[0]
    return (w.reshape(n_head, rows // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2)
            .reshape(w.shape))


def _join_kv_b(k_b: np.ndarray, v_b: np.ndarray) -> np.ndarray:
    """DeepSeek's kv_b_proj [heads * (nope + v), kv_lora] from llama.cpp's attn_k_b [heads,
    kv_lora, nope] and attn_v_b [heads, v, kv_lora]: per head the k rows, then the v rows."""
    heads, rank = k_b.shape[0], k_b.shape[1]
    kv = np.concatenate([k_b.transpose(0, 2, 1), v_b], axis=1)
    return np.ascontiguousarray(kv.reshape(-1, rank))


def _untile_v_heads(a: np.ndarray, axis: int, nk: int, r: int, d: int) -> np.ndarray:
    """Undo the order llama.cpp's Qwen3.5 converter gives the value heads along ``axis``
    (``nk * r`` heads of ``d`` entries, ``r`` per key head): it writes them tiled (head 0 of
    every key group, then head 1, ...: ggml's broadcast order), transformers holds them
    grouped by key head."""
    a = np.moveaxis(a, axis, 0)
    s = a.shape
    a = a.reshape((r, nk, d) + s[1:]).swapaxes(0, 1).reshape(s)
    return np.ascontiguousarray(np.moveaxis(a, 0, axis))


def _join_qkvz(qkv: np.ndarray, z: np.ndarray, nk: int, dk: int) -> np.ndarray:
    """Qwen3-Next's in_proj_qkvz [nk * (2 dk + 2 r dv), H] from llama.cpp's attn_qkv (every
    head's q rows, then every head's k, then v) and attn_gate (z): per key head its q, k, v
    and z rows, as transformers holds them."""
    H = qkv.shape[1]
    q, k, v = np.split(qkv, [nk * dk, 2 * nk * dk])
    parts = [x.reshape(nk, -1, H) for x in (q, k, v, z)]
    return np.ascontiguousarray(np.concatenate(parts, axis=1).reshape(-1, H))


# transformers key (its end) of a Qwen3-Next / Qwen3.5 tensor -> how llama.cpp's converter
# changed it (GgufCheckpoint._gated_delta undoes it): the RMSNorms that scale by (1 + w) hold
# w + 1; A_log is held as A = -exp(A_log); the conv kernel [C, 1, K] squeezed; Qwen3-Next's
# in_proj_qkvz split; Qwen3.5's value heads tiled (rows, columns, single entries per head)
_GATED_DELTA_LAYOUT: dict[str, str] = {
    "input_layernorm.weight": "plus_one",
    "post_attention_layernorm.weight": "plus_one",
    "self_attn.q_norm.weight": "plus_one",
    "self_attn.k_norm.weight": "plus_one",
    "linear_attn.A_log": "a_log",
    "linear_attn.dt_bias": "v_heads",
    "linear_attn.in_proj_a.weight": "v_heads",
    "linear_attn.in_proj_b.weight": "v_heads",
    "linear_attn.conv1d.weight": "conv1d",
    "linear_attn.in_proj_qkvz.weight": "qkvz",
    "linear_attn.in_proj_qkv.weight": "qkv_v_rows",
    "linear_attn.in_proj_z.weight": "v_rows",
    "linear_attn.out_proj.weight": "v_cols",
}
_GATED_DELTA_HOW = frozenset(_GATED_DELTA_LAYOUT.values())
# the Mamba-2 tensors llama.cpp's Mamba2Model changes: A_log held as A = -exp(A_log) [heads,
# 1], D as [heads, 1], the conv kernel [C, 1, K] squeezed, the gated norm's weight as [groups,
# inner / groups]
_MAMBA2_LAYOUT = {"mamba.A_log": "mamba_a_log", "mamba.D": "mamba_flat",
                  "mamba.norm.weight": "mamba_flat", "mamba.conv1d.weight": "mamba_conv1d",
                  "conv.conv.weight": "mamba_conv1d"}  # (and LFM2's squeezed conv kernel)


@dataclass
class GgufCheckpoint:
    """A GGUF file opened for conversion (the reader memory-maps it; nothing is read until a
    tensor is asked for).  ``folder`` is the file's path (the checkpoint's location);
    ``keys`` maps each transformers name to the file, ``dtypes`` to its GGUF type name."""

    folder: Path
    arch: str
    model_type: str
    meta: dict[str, Any]
    keys: dict[str, Path]
    dtypes: dict[str, str]
    _tensors: dict[str, Any] = field(default_factory=dict, repr=False)  # GGUF name -> tensor
    _sources: dict[str, Any] = field(default_factory=dict, repr=False)  # hf key -> GGUF names
    # hf key -> how its GGUF sources make the transformers tensor when that is not the sources
    # stacked row-wise (GPT-OSS's transposed, interleaved experts: _assemble)
    _layout: dict[str, str] = field(default_factory=dict, repr=False)
    _reader: Any = field(default=None, repr=False)  # owns the file map the tensors view

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> "GgufCheckpoint":
        p = Path(path).expanduser()
        if not p.is_file():
            raise FileNotFoundError(f"{p}: no such GGUF file")
        try:
            from gguf import GGUFReader
        except ImportError:
            raise ModuleNotFoundError(f"{p}: reading GGUF files needs the gguf package "
                                      "(pip install gguf, or 'specmoe[hf]')") from None
        try:
            reader = GGUFReader(str(p))
        except Exception as exc:  # ValueError (magic, version), IndexError on truncation
            raise GgufError(f"{p}: not a readable GGUF file ({type(exc).__name__}: {exc})") \
                from None
        meta: dict[str, Any] = {}
        for name, fld in reader.fields.items():
            if name.startswith("tokenizer.ggml.") and name not in (
                    "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id",
                    "tokenizer.ggml.padding_token_id", "tokenizer.ggml.model"):
                continue  # the vocabulary: read by the tokenizer, not needed here
            try:
                meta[name] = fld.contents()
            except Exception:  # a field the reader cannot decode: not one we use
                continue
        arch = meta.get("general.architecture")
        if arch not in ARCHITECTURES:
            known = ", ".join(sorted(ARCHITECTURES))
            raise GgufError(f"{p}: architecture {arch!r} is not read by specmoe "
                            f"(GGUF architectures read: {known})")
        model_type = ARCHITECTURES[arch]
        if arch == "deepseek2":
            gating = int(meta.get(f"{arch}.expert_gating_func", 1) or 1)
            if gating not in (1, 2):
                raise GgufError(f"{p}: a deepseek2 file with expert_gating_func {gating} "
                                "(1 softmax: DeepSeek-V2; 2 sigmoid: DeepSeek-V3, R1, "
                                "Kimi-K2, GLM-4.7-Flash; others are not read)")
            if gating == 2:
                model_type = _DEEPSEEK2_SIGMOID
        if arch == "granitemoe" and any(t.name.endswith(".ffn_up_shexp.weight")
                                        for t in reader.tensors):
            model_type = _GRANITE_SHARED
        if int(meta.get(f"{arch}.expert_count", 0) or 0) <= 0:
            raise GgufError(f"{p}: architecture {arch!r} without experts "
                            f"({arch}.expert_count missing or 0): not a mixture-of-experts "
                            "model")
        ck = cls(p, arch, model_type, meta, {}, {}, _reader=reader)
        ck._tensors = {t.name: t for t in reader.tensors}
        ck._map_names()
        return ck

    # -- names -------------------------------------------------------------------------------

    def _main_blocks(self) -> int:
        """The decoder layers of the model: the file's blocks less its multi-token-prediction
        blocks (``nextn_predict_layers``: GLM-4.5's and GLM-4.7-Flash's converters append
        them after the main layers; specmoe does not read them)."""
        n = int(self._m("block_count", need=True))
        return n - int(self._m("nextn_predict_layers", 0) or 0)

    def _map_names(self) -> None:
        layers: dict[int, set[str]] = {}
        names = dict(_LAYER_NAMES, **_ARCH_LAYER_NAMES.get(self.arch, {}))
        kv_b: dict[int, set[str]] = {}
        pairs, joined = _JOINED.get(self.arch, ((), ""))
        split: dict[int, set[str]] = {}
        main = self._main_blocks()
        top = dict(_TOP_NAMES, **_ARCH_TOP_NAMES.get(self.arch, {}))
        for name, t in self._tensors.items():
            if name in top:
                self._add(top[name], [name])
                continue
            m = _BLK.match(name)
            if m is None:
                self._add(name, [name])  # unknown: reported as unused by the plan
                continue
            i, rest = int(m.group(1)), m.group(2)
            if i >= main:  # a multi-token-prediction block: not part of the model read
                continue
            if rest in _EXPERT_NAMES or rest in (_GATE_UP_FUSED, _GATE_UP_BIAS_FUSED) \
                    or rest in _EXPERT_BIAS_NAMES:
                layers.setdefault(i, set()).add(rest)
            elif rest in _KV_B_SPLIT and self.arch == "deepseek2":
                kv_b.setdefault(i, set()).add(rest)
            elif rest in pairs:
                split.setdefault(i, set()).add(rest)
            elif rest in names:
                self._add(f"model.layers.{i}.{names[rest]}", [name])
            else:
                self._add(f"model.layers.{i}.{rest}", [name])
        for i, got in sorted(split.items()):
            if got != set(pairs):
                raise GgufError(f"{self.folder}: block {i} has {sorted(got)} without its pair "
                                f"({', '.join(pairs)})")
            self._add(f"model.layers.{i}.{joined}", [f"blk.{i}.{n}" for n in pairs])
        if self.arch in ("granitehybrid", "lfm2moe"):
            for key in self._sources:
                if key.startswith("model.layers."):
                    how = _MAMBA2_LAYOUT.get(key.split(".", 3)[3])
                    if how is not None:
                        self._layout[key] = how
        if self.arch in ("qwen3next", "qwen35moe"):
            for key in self._sources:
                if key == "model.norm.weight":
                    self._layout[key] = "plus_one"
                elif key.startswith("model.layers."):
                    how = _GATED_DELTA_LAYOUT.get(key.split(".", 3)[3])
                    if how is not None:
                        self._layout[key] = how
        for i, got in sorted(kv_b.items()):
            if got != set(_KV_B_SPLIT):
                raise GgufError(f"{self.folder}: block {i} has {sorted(got)} without its pair "
                                f"({', '.join(_KV_B_SPLIT)})")
            self._add(f"model.layers.{i}.self_attn.kv_b_proj.weight",
                      [f"blk.{i}.{n}" for n in _KV_B_SPLIT])
        oss = self.arch == "gpt-oss"
        for i, got in sorted(layers.items()):
            gate_up = ([_GATE_UP_FUSED] if _GATE_UP_FUSED in got
                       else ["ffn_gate_exps.weight", "ffn_up_exps.weight"])
            need = set(gate_up) | {"ffn_down_exps.weight"}
            if oss:  # GPT-OSS's experts have biases
                need |= ({_GATE_UP_BIAS_FUSED} if _GATE_UP_BIAS_FUSED in got
                         else {"ffn_gate_exps.bias", "ffn_up_exps.bias"}) | {"ffn_down_exps.bias"}
            missing = need - got
            if missing:
                raise GgufError(f"{self.folder}: block {i} lacks expert tensors "
                                f"{', '.join(f'blk.{i}.{n}' for n in sorted(missing))}")
            pre = f"model.layers.{i}.{_MOE_BLOCK.get(self.arch, 'mlp')}.experts."
            blk = f"blk.{i}."
            self._add(pre + "gate_up_proj", [blk + n for n in gate_up])
            self._add(pre + "down_proj", [blk + "ffn_down_exps.weight"])
            if oss:  # transformers' GptOssExperts: [E, H, 2I] with gate / up interleaved
                bias = ([_GATE_UP_BIAS_FUSED] if _GATE_UP_BIAS_FUSED in got
                        else ["ffn_gate_exps.bias", "ffn_up_exps.bias"])
                self._add(pre + "gate_up_proj_bias", [blk + n for n in bias])
                self._add(pre + "down_proj_bias", [blk + "ffn_down_exps.bias"])
                self._layout.update({pre + "gate_up_proj": "oss_gate_up",
                                     pre + "gate_up_proj_bias": "oss_gate_up_bias",
                                     pre + "down_proj": "oss_down"})

    def _add(self, key: str, names: list[str]) -> None:
        self.keys[key] = self.folder
        self._sources[key] = names
        types = {self._tensors[n].tensor_type.name for n in names}
        self.dtypes[key] = "/".join(sorted(types))

    def _expert_types(self, role: str) -> set[str]:
        """GGUF types of the routed expert tensors of ``role`` (gate_up_proj: gate and up,
        down_proj) over every layer."""
        return {self._tensors[n].tensor_type.name for key, names in self._sources.items()
                if key.endswith(".mlp.experts." + role) for n in names}

    def block_kinds(self) -> tuple[dict[str, Any] | None, str]:
        """How a ``"gguf"`` store keeps this file's experts: ``({"gate_up": kind, "down": kind,
        "down_layers": {layer: kind} or None}, "")`` with kinds of
        :data:`specmoe.storage.ggml_blocks.BLOCKS`, or ``(None, why not)``.  Each layer's types
        map onto a kind: Q8_0, Q4_K, Q5_K, Q6_K, Q4_0, IQ4_XS, Q4_1, Q2_K, Q3_K or MXFP4 as they
        are, Q5_0 as Q8_0
        (widened without loss).  Gate and up must be one kind in every layer (they are one row of the kernel);
        down may change from layer to layer (Q4_K_M: Q4_K, Q6_K on some layers): ``down`` is
        then the kind with the longest rows, which the store's down tensor is sized for, and
        ``down_layers`` each layer's own."""
        from .ggml_blocks import BLOCKS, TYPE_OF_GGML

        per: dict[str, dict[int, set[str]]] = {"gate": {}, "up": {}, "down": {}}
        for key, names in self._sources.items():
            m = re.match(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)$", key)
            if m is None:
                continue
            roles = ("gate", "up") if m.group(2) == "gate_up_proj" else ("down",)
            if len(names) == 1:  # gate and up stacked in one tensor
                names = names * len(roles)
            for role, n in zip(roles, names):
                per[role].setdefault(int(m.group(1)), set()).add(
                    self._tensors[n].tensor_type.name)
        if not per["down"]:
            return None, "the file has no routed expert tensors"
        kinds: dict[str, dict[int, str]] = {}
        for role, layers in per.items():
            bad = sorted({t for ts in layers.values() for t in ts if t not in TYPE_OF_GGML})
            if bad:
                return None, (f"its {role} experts are {'/'.join(bad)}, which the kernels do "
                              f"not read as they are (they read Q8_0, Q4_K, Q5_K, Q6_K, Q4_0, "
                              f"IQ4_XS, Q4_1, Q2_K, Q3_K, MXFP4; Q5_0 as Q8_0)")
            kinds[role] = {i: TYPE_OF_GGML[next(iter(ts))] for i, ts in layers.items()}
        gate = set(kinds["gate"].values())
        if len(gate) > 1 or kinds["gate"] != kinds["up"]:
            types = sorted({t for r in ("gate", "up") for ts in per[r].values() for t in ts})
            return None, (f"its gate/up experts are {'/'.join(types)}: one block format in "
                          f"every layer is read as it is, this file changes it")
        down = kinds["down"]
        widest = max(set(down.values()), key=lambda k: BLOCKS[k][1] / BLOCKS[k][0])
        return {"gate_up": gate.pop(), "down": widest,
                "down_layers": dict(sorted(down.items())) if len(set(down.values())) > 1
                else None}, ""

    def _expert_raw(self, name: str, index: int) -> np.ndarray:
        """Expert ``index``'s rows of stacked GGUF tensor ``name`` as the file holds them
        (uint8 [rows, row bytes]; only that expert's bytes are read)."""
        try:
            return np.asarray(self._tensors[name].data[index])
        except (ValueError, IndexError, OSError) as exc:
            raise GgufError(f"{self.folder}: cannot read tensor {name}: {exc}") from None

    def expert_blocks(self, key: str, index: int) -> np.ndarray:
        """Expert ``index`` of the stacked tensor(s) behind ``key`` (gate_up_proj: gate rows
        then up rows) as block rows uint8 [rows, blocks, block bytes] of its kept kind
        (:meth:`block_kinds`), read as the file holds them (Q4_0 / Q5_0 widened to Q8_0)."""
        from .ggml_blocks import BLOCKS, TYPE_OF_GGML, widen_to_q8_0

        parts = []
        for n in self._sources[key]:
            t = self._tensors[n]
            tn = t.tensor_type.name
            kind = TYPE_OF_GGML.get(tn)
            if kind is None:
                raise GgufError(f"{self.folder}: tensor {n} is {tn}, not a kept block type")
            raw = self._expert_raw(n, index)
            rows = raw.shape[0]
            if kind == "q8_0":  # Q8_0 as it is, Q5_0 widened
                parts.append(widen_to_q8_0(raw.reshape(rows, -1), tn))
            else:
                parts.append(np.ascontiguousarray(raw).reshape(rows, -1, BLOCKS[kind][1]))
        return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)

    def dense_kind(self, key: str) -> tuple[str, int] | None:
        """(kind, bytes) that :meth:`dense_blocks` would give for ``key``, read from the
        tensor table only (no data): the memory plan's dense bytes for ``dense="gguf"``."""
        from .ggml_blocks import BLOCKS, TYPE_OF_GGML

        names = self._sources.get(key)
        if not names:
            return None
        ts = [self._tensors[n] for n in names]
        kinds = {TYPE_OF_GGML.get(t.tensor_type.name) for t in ts}
        if len(kinds) != 1 or None in kinds or any(len(t.data.shape) != 2 for t in ts) \
                or len({int(t.shape[0]) for t in ts}) != 1:
            return None
        kind = kinds.pop()
        if self._block_order(key, kind) is None:
            return None
        cols, nbytes = BLOCKS[kind]
        return kind, sum(int(t.shape[1]) * int(t.shape[0]) // cols * nbytes for t in ts)

    def _block_order(self, key: str, kind: str) -> tuple[Any, Any] | None:
        """How the file's blocks of dense weight ``key`` make the transformers matrix when only
        the order of its rows or of whole blocks of columns changed: (the row order over its
        sources' rows stacked, the column-block order), each None where nothing moves; None
        when the blocks cannot be kept (values changed, several sources joined otherwise than
        by rows, a column order that splits a block).  Qwen3-Next's in_proj_qkvz and Qwen3.5's
        tiled value heads keep their blocks this way (:data:`_GATED_DELTA_LAYOUT`)."""
        from .ggml_blocks import BLOCKS

        how, names = self._layout.get(key), self._sources[key]
        if how is None:
            return None, None  # (the sources' rows stacked, as _assemble joins them)
        if how in ("qkv_v_rows", "v_rows", "v_heads", "qkvz"):
            rows = [int(self._tensors[n].shape[1]) for n in names]
            idx = np.split(np.arange(sum(rows))[:, None], np.cumsum(rows)[:-1])
            return self._gated_delta(key, how, idx)[:, 0], None
        if how == "v_cols":
            bc = BLOCKS[kind][0]
            cols = int(self._tensors[names[0]].shape[0])
            order = self._gated_delta(key, how, [np.arange(cols)[None, :]])[0]
            starts = order[::bc]
            if cols % bc or np.any(starts % bc) or np.any(
                    order.reshape(-1, bc) != starts[:, None] + np.arange(bc)):
                return None
            return None, starts // bc
        return None

    def dense_blocks(self, key: str) -> tuple[np.ndarray, str] | None:
        """Dense weight ``key`` (a 2-D ``nn.Linear`` weight: attention, shared or dense MLP,
        lm_head) as the file holds it, for ``dense="gguf"``: (uint8 [rows, blocks, block
        bytes], kind), its rows (and whole blocks of columns) in the transformers order
        (``llama``'s q/k rows unpermuted, Qwen3-Next's and Qwen3.5's reordered projections put
        back: :meth:`_block_order`; the values are the file's) and Q5_0 widened to Q8_0 without
        loss; None when the file holds it in a type the block kernels do not read (F32, F16,
        BF16, Q5_1, the other IQ types) or the model's tensor is assembled from the file's
        otherwise (DeepSeek's ``kv_b_proj``, Qwen3.5's out_proj in K-quants).  A copy in memory
        of its own, not a view of the file's map."""

        got = self.dense_kind(key)
        if got is None:
            return None
        kind, names = got[0], self._sources[key]
        parts = [self._raw_blocks(name, kind) for name in names]
        blocks = parts[0] if len(parts) == 1 else np.concatenate(parts)
        rows_order, col_blocks = self._block_order(key, kind)
        if rows_order is not None:
            blocks = blocks[rows_order]
        if col_blocks is not None:
            blocks = blocks[:, col_blocks]
        return np.ascontiguousarray(self._fix(key, blocks)), kind

    def _raw_blocks(self, name: str, kind: str) -> np.ndarray:
        """Tensor ``name``'s blocks as uint8 [rows, blocks a row, block bytes] (every dimension
        but the first ggml one counted as rows), a copy; ``kind`` "q8_0" widens Q5_0 (4096
        rows at a time)."""
        from .ggml_blocks import BLOCKS, widen_to_q8_0

        t = self._tensors[name]
        try:
            raw = np.asarray(t.data)
            raw = raw.reshape(-1, raw.shape[-1])
            rows = raw.shape[0]
            if kind == "q8_0":  # Q8_0 as it is (a copy), Q5_0 widened
                blocks = np.empty((rows, int(t.shape[0]) // 32, 34), np.uint8)
                for r0 in range(0, rows, 4096):
                    part = raw[r0:r0 + 4096]
                    blocks[r0:r0 + part.shape[0]] = widen_to_q8_0(part, t.tensor_type.name)
                return blocks
            return np.array(raw.reshape(rows, -1, BLOCKS[kind][1]))
        except (ValueError, IndexError, OSError) as exc:
            raise GgufError(f"{self.folder}: cannot read tensor {name}: {exc}") from None

    def mla_blocks(self, key: str) -> tuple[np.ndarray, str, np.ndarray, str] | None:
        """DeepSeek's absorbed MLA weights as the file holds them, for ``dense="gguf"``: the
        ``attn_k_b`` (uint8 [heads, kv_lora_rank, bytes a row]: each head's W^UK transposed,
        rows of qk_nope_head_dim columns) and ``attn_v_b`` (uint8 [heads, v_head_dim, bytes a
        row]) that llama.cpp's converter splits ``kv_b_proj`` (``key``) into, with their
        kinds (Q5_0 widened to Q8_0 without loss), as ``specmoe._C.MLADecode(...,
        blocks=...)`` reads them.  None for a file with the joined ``attn_kv_b`` (older
        converters) or a type the block kernels do not read."""
        split = self._mla_split(key)
        if split is None:
            return None
        names, kinds = split
        ts = [self._tensors[n] for n in names]
        heads = int(ts[0].shape[2])
        k_b, v_b = (self._raw_blocks(n, k) for n, k in zip(names, kinds))
        return (k_b.reshape(heads, int(ts[0].shape[1]), -1), kinds[0],
                v_b.reshape(heads, int(ts[1].shape[1]), -1), kinds[1])

    def mla_nbytes(self, key: str) -> int | None:
        """The bytes :meth:`mla_blocks` would give for ``key``, read from the tensor table only
        (no data): the memory plan's absorbed MLA weights with ``dense="gguf"``."""
        from .ggml_blocks import BLOCKS

        split = self._mla_split(key)
        if split is None:
            return None
        total = 0
        for n, kind in zip(*split):
            t = self._tensors[n]
            cols, nbytes = BLOCKS[kind]
            total += int(np.prod([int(d) for d in t.shape])) // cols * nbytes
        return total

    def _mla_split(self, key: str) -> tuple[list[str], list[str]] | None:
        """The attn_k_b / attn_v_b names and block kinds (Q5_0 as the Q8_0 it widens to) of
        MLA weight ``key``, or None (see :meth:`mla_blocks`)."""
        from .ggml_blocks import TYPE_OF_GGML

        names = self._sources.get(key)
        if not key.endswith("kv_b_proj.weight") or not names or len(names) != 2 \
                or not names[0].endswith(_KV_B_SPLIT[0]):
            return None
        ts = [self._tensors[n] for n in names]
        kinds = [TYPE_OF_GGML.get(t.tensor_type.name) for t in ts]
        if None in kinds or any(len(t.shape) != 3 for t in ts):
            return None
        return list(names), kinds

    def kept_blocks(self, dtype: str) -> str | None:
        """The GGUF types whose blocks a store in ``dtype`` holds bit for bit, or None: for
        ``"gguf"``, the file's expert types (e.g. ``"Q4_K/Q8_0"``, :meth:`block_kinds`); for
        int4, Q4_0 in groups of 32 (scale d, nibbles u, w = (u - 8) * d are both formats'
        definition), when every routed expert tensor of the file is Q4_0."""
        if dtype == "gguf":
            kinds, _ = self.block_kinds()
            if kinds is None:
                return None
            return "/".join(sorted(self._expert_types("gate_up_proj")
                                   | self._expert_types("down_proj")))
        if dtype != "int4":
            return None
        types = self._expert_types("gate_up_proj") | self._expert_types("down_proj")
        return "Q4_0" if types == {"Q4_0"} else None

    def kept_group(self) -> int:
        """The int4 group size of a store that keeps this file's blocks (Q4_0's 32)."""
        return 32

    def expert_int4(self, key: str, index: int) -> tuple[np.ndarray, np.ndarray]:
        """Expert ``index`` of Q4_0 tensor ``key`` (gate_up_proj: gate then up) in specmoe's
        int4 layout with groups of 32, without dequantizing: (packed uint8 [rows, cols/2],
        scales f32 [rows, cols/32]).  A Q4_0 block is 18 bytes, an f16 scale d and 16 bytes
        whose low nibbles are the block's values 0..15 and high nibbles 16..31; specmoe packs
        columns 2j and 2j+1 in the low and high nibble of byte j."""
        packs, scales = [], []
        for n in self._sources[key]:
            t = self._tensors[n]
            if t.tensor_type.name != "Q4_0":
                raise GgufError(f"{self.folder}: tensor {n} is {t.tensor_type.name}, not Q4_0")
            raw = self._expert_raw(n, index)
            rows = raw.shape[0]
            blocks = raw.reshape(rows, -1, 18)
            d = blocks[:, :, :2].copy().view(np.float16)[:, :, 0].astype(np.float32)
            qs = blocks[:, :, 2:]
            u = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(rows, -1)  # columns
            packs.append((u[:, 0::2] | (u[:, 1::2] << 4)).astype(np.uint8))
            scales.append(d)
        if len(packs) == 1:
            return packs[0], scales[0]
        return np.concatenate(packs, axis=0), np.concatenate(scales, axis=0)

    def expert_type(self) -> str:
        """The GGUF type of the first layer's routed experts (e.g. ``Q4_K``)."""
        for key, names in self._sources.items():
            if key.endswith("experts.gate_up_proj"):
                return self._tensors[names[0]].tensor_type.name
        raise GgufError(f"{self.folder}: no routed expert tensors (blk.N.ffn_gate_exps)")

    # -- config ------------------------------------------------------------------------------

    def _m(self, key: str, default: Any = None, *, need: bool = False) -> Any:
        full = f"{self.arch}.{key}"
        if full in self.meta:
            v = self.meta[full]
            return v[0] if isinstance(v, list) and len(v) == 1 else v
        if need:
            raise GgufError(f"{self.folder}: metadata {full} is missing")
        return default

    def config(self) -> dict[str, Any]:
        """The transformers config (as a dict with ``model_type``) of this file's model, from
        its metadata with the key names llama.cpp's converter writes."""
        H = int(self._m("embedding_length", need=True))
        heads = int(self._m("attention.head_count", need=True))
        kv = self._kv_heads(heads)
        E = int(self._m("expert_count", need=True))
        emb = self._tensors.get("token_embd.weight")
        vocab = self._m("vocab_size") or (int(emb.shape[1]) if emb is not None else None)
        if vocab is None:
            raise GgufError(f"{self.folder}: neither {self.arch}.vocab_size nor "
                            "token_embd.weight gives the vocabulary size")
        cfg: dict[str, Any] = {
            "model_type": self.model_type,
            "vocab_size": int(vocab),
            "hidden_size": H,
            "num_hidden_layers": self._main_blocks(),
            "num_attention_heads": heads,
            "num_key_value_heads": kv,
            "num_experts_per_tok": int(self._m("expert_used_count", need=True)),
            "rms_norm_eps": float(self._m("attention.layer_norm_rms_epsilon", 1e-6)),
            "max_position_embeddings": int(self._m("context_length", 4096)),
            "rope_parameters": {"rope_type": "default",
                                "rope_theta": float(self._m("rope.freq_base", 10000.0))},
            "tie_word_embeddings": "output.weight" not in self._tensors,
            # the non-expert weights in memory: f32 from an F32 file, else bf16 (a Q4_K_M
            # file's dense weights in f32 would take 7x their size in the file)
            "dtype": "float32" if emb is None or emb.tensor_type.name == "F32" else "bfloat16",
        }
        key_len = self._m("attention.key_length")
        if key_len is not None and self.arch != "deepseek2":
            cfg["head_dim"] = int(key_len)
        for src, dst in (("bos_token_id", "bos_token_id"), ("eos_token_id", "eos_token_id"),
                         ("padding_token_id", "pad_token_id")):
            v = self.meta.get(f"tokenizer.ggml.{src}")
            if v is not None:
                cfg[dst] = int(v[0] if isinstance(v, list) else v)
        ff = self._m("feed_forward_length")
        eff = self._m("expert_feed_forward_length")
        if self.arch == "deepseek2":
            cfg.update(self._deepseek2(heads, E, ff, eff))
        elif self.model_type == "mixtral":
            cfg["num_local_experts"] = E
            cfg["intermediate_size"] = int(eff or ff)
        elif self.model_type == "olmoe":
            cfg["num_experts"] = E
            cfg["intermediate_size"] = int(eff or ff)
            cfg["norm_topk_prob"] = bool(self._m("expert_weights_norm", False))
        elif self.model_type == "gpt_oss":
            cfg.update(self._gpt_oss(E, ff, eff, cfg["num_hidden_layers"]))
        elif self.model_type == "glm4_moe":
            cfg.update(self._glm4moe(E, ff, eff, cfg.get("head_dim")))
        elif self.model_type == "dots1":  # DeepSeek-V3's MoE block, q/k norms, every layer
            # full attention (dots.llm1's max_window_layers spans them all)
            cfg.update(self._deepseek_moe(E, ff, eff))
            cfg["layer_types"] = ["full_attention"] * cfg["num_hidden_layers"]
        elif self.model_type == "minimax_m2":
            # sigmoid routing with the block's correction bias (fixed in transformers'
            # model, no keys); the rotary embedding on the first rope.dimension_count of each
            # head's dimensions, as in GLM-4.5
            cfg["num_local_experts"] = E
            cfg["intermediate_size"] = int(eff or ff)
            cfg["rope_parameters"] = self._partial_rope(cfg.get("head_dim"))
        elif self.model_type == "ernie4_5_moe":
            cfg.update(self._ernie(E, ff, eff, cfg["num_hidden_layers"]))
        elif self.model_type in ("granitemoe", _GRANITE_SHARED):
            cfg.update(self._granite(E, ff, eff))
        elif self.model_type == "lfm2_moe":
            cfg.update(self._lfm2(E, ff, eff, cfg["num_hidden_layers"]))
        elif self.model_type == "afmoe":
            cfg.update(self._afmoe(E, ff, eff, cfg["num_hidden_layers"]))
        elif self.model_type == "granitemoehybrid":
            cfg.update(self._granite(E, ff, eff), **self._mamba2(H, cfg["num_hidden_layers"]))
        elif self.model_type in ("qwen3_next", "qwen3_5_moe_text"):
            cfg.update(self._qwen3next(E, ff, eff, cfg["num_hidden_layers"],
                                       cfg.get("head_dim")))
        else:  # qwen2_moe, qwen3_moe
            cfg["num_experts"] = E
            cfg["moe_intermediate_size"] = int(eff or ff)
            if ff is not None:
                cfg["intermediate_size"] = int(ff)
            cfg["decoder_sparse_step"] = 1
            cfg["mlp_only_layers"] = []
            norm = self._m("expert_weights_norm")
            if norm is not None:
                cfg["norm_topk_prob"] = bool(norm)
            elif self.model_type == "qwen2_moe":
                cfg["norm_topk_prob"] = False
            shared = self._m("expert_shared_feed_forward_length")
            if self.model_type == "qwen2_moe":
                cfg["shared_expert_intermediate_size"] = int(shared or 0)
        return cfg

    def _deepseek2(self, heads: int, E: int, ff: Any, eff: Any) -> dict[str, Any]:
        """DeepSeek-V2's / V3's MLA and routing settings.  The file says head_count_kv 1
        (llama.cpp runs MLA as MQA); transformers' model has as many k/v heads as q heads.
        V3 (sigmoid routing): group-limited top-k over sigmoid scores plus each layer's
        correction bias (``exp_probs_b``), the rotary embedding on interleaved pairs as
        llama.cpp's deepseek2 applies it to the unpermuted weights (transformers'
        ``rope_interleave``)."""
        rope = int(self._m("rope.dimension_count", need=True))
        kl = self._m("attention.key_length_mla") or self._m("attention.key_length", need=True)
        vl = self._m("attention.value_length_mla") or self._m("attention.value_length",
                                                                 need=True)
        groups = int(self._m("expert_group_count", 1) or 1)
        out: dict[str, Any] = {
            "num_key_value_heads": heads,
            "n_routed_experts": E,
            "n_shared_experts": int(self._m("expert_shared_count", 0) or 0),
            "moe_intermediate_size": int(eff or ff),
            "intermediate_size": int(ff or eff),
            "first_k_dense_replace": int(self._m("leading_dense_block_count", 0) or 0),
            "moe_layer_freq": 1,
            "kv_lora_rank": int(self._m("attention.kv_lora_rank", need=True)),
            "q_lora_rank": int(self._m("attention.q_lora_rank", 0) or 0) or None,
            "qk_rope_head_dim": rope,
            "qk_nope_head_dim": int(kl) - rope,
            "v_head_dim": int(vl),
            "head_dim": rope,
            "routed_scaling_factor": float(self._m("expert_weights_scale", 1.0) or 1.0),
            "norm_topk_prob": bool(self._m("expert_weights_norm", False)),
            "n_group": groups,
            "topk_group": int(self._m("expert_group_used_count", groups) or groups),
        }
        if self.model_type == _DEEPSEEK2_SIGMOID:
            out["rope_interleave"] = True
        else:
            out["topk_method"] = "greedy" if groups <= 1 else "group_limited_greedy"
        if self._m("rope.scaling.type") == "yarn":
            # DeepSeek-V2's YaRN: the file keeps factor, the original context and
            # 0.1 * mscale_all_dim (llama.cpp's log multiplier); mscale is taken equal to it
            # (as in DeepSeek-V2 and V2-Lite's configs), beta_fast/slow at their defaults
            ms = float(self._m("rope.scaling.yarn_log_multiplier", 0.0) or 0.0) / 0.1
            out["rope_parameters"] = {
                "rope_type": "yarn", "rope_theta": float(self._m("rope.freq_base", 10000.0)),
                "factor": float(self._m("rope.scaling.factor", 1.0)),
                "original_max_position_embeddings": int(self._m(
                    "rope.scaling.original_context_length", 4096)),
                "mscale": ms, "mscale_all_dim": ms, "beta_fast": 32.0, "beta_slow": 1.0}
        return out

    def _deepseek_moe(self, E: int, ff: Any, eff: Any) -> dict[str, Any]:
        """DeepSeek-V3's MoE block as llama.cpp's converters write it for the architectures
        that keep it (GLM-4.5, dots.llm1): sigmoid scores in expert groups plus the router's
        correction bias, scaling and normalisation, dense leading layers, shared experts."""
        groups = int(self._m("expert_group_count", 1) or 1)
        return {
            "n_routed_experts": E,
            "moe_intermediate_size": int(eff or ff),
            "intermediate_size": int(ff or eff),
            "n_shared_experts": int(self._m("expert_shared_count", 0) or 0),
            "first_k_dense_replace": int(self._m("leading_dense_block_count", 0) or 0),
            "n_group": groups,
            "topk_group": int(self._m("expert_group_used_count", groups) or groups),
            "routed_scaling_factor": float(self._m("expert_weights_scale", 1.0) or 1.0),
            "norm_topk_prob": bool(self._m("expert_weights_norm", False)),
        }

    def _glm4moe(self, E: int, ff: Any, eff: Any, head_dim: Any) -> dict[str, Any]:
        """GLM-4.5's settings: DeepSeek-V3's MoE block (_deepseek_moe); the rotary embedding
        on the first ``rope.dimension_count`` of each head's dimensions (transformers'
        ``partial_rotary_factor``); q/k/v biases and q/k norms where the file has them."""
        return {**self._deepseek_moe(E, ff, eff),
                "attention_bias": "blk.0.attn_q.bias" in self._tensors,
                "use_qk_norm": "blk.0.attn_q_norm.weight" in self._tensors,
                "num_nextn_predict_layers": 0,  # (its MTP blocks are not read: _map_names)
                "rope_parameters": self._partial_rope(head_dim)}

    def _kv_heads(self, heads: int) -> int:
        """The k/v heads of the attention layers: ``attention.head_count_kv``, which a hybrid
        model's file gives per layer (0 on its recurrent layers)."""
        kv = self._m("attention.head_count_kv", heads)
        if isinstance(kv, list):
            kv = max(int(x) for x in kv) or heads
        return int(kv)

    def _kv_per_layer(self, L: int, recurrent: str) -> list[Any]:
        """``attention.head_count_kv`` of a hybrid model's file: one count per layer, 0 on
        its ``recurrent`` layers (the layer kinds are read from it)."""
        kv = self.meta.get(f"{self.arch}.attention.head_count_kv")
        if not isinstance(kv, list) or len(kv) < L:
            raise GgufError(f"{self.folder}: {self.arch}.attention.head_count_kv is not a list "
                            f"per layer (0 on the {recurrent} layers)")
        return kv

    def _a_log(self, key: str, a: np.ndarray) -> np.ndarray:
        """A_log from the A = -exp(A_log) llama.cpp's converters store (Mamba-2, gated
        DeltaNet); a value >= 0 or NaN has none and is refused naming the file and tensor."""
        if not np.all(a < 0):
            raise GgufError(f"{self.folder}: {key} is stored as A = -exp(A_log), which is "
                            "negative; this file holds values >= 0 or NaN")
        return np.log(-a)

    def _ernie(self, E: int, ff: Any, eff: Any, L: int) -> dict[str, Any]:
        """ERNIE-4.5's MoE settings as llama.cpp reads them: MoE on the layers from
        ``leading_dense_block_count`` on, every ``interleave_moe_layer_step``-th (to the last:
        the file has no end index), shared experts of ``expert_shared_count`` times the
        expert size, softmax routing whose choice adds the correction bias, the top-k weights
        normalised."""
        first = int(self._m("leading_dense_block_count", 0) or 0)
        return {"moe_num_experts": E, "moe_k": int(self._m("expert_used_count", need=True)),
                "moe_intermediate_size": int(eff or ff), "intermediate_size": int(ff or eff),
                "moe_num_shared_experts": int(self._m("expert_shared_count", 0) or 0),
                "moe_layer_start_index": first, "moe_layer_end_index": L - 1,
                "moe_layer_interval": int(self._m("interleave_moe_layer_step", 1) or 1),
                "use_bias": "blk.0.attn_q.bias" in self._tensors}

    def _granite(self, E: int, ff: Any, eff: Any) -> dict[str, Any]:
        """Granite's MoE settings: its four multipliers (llama.cpp's attention, embedding,
        residual and logit scales: the attention's softmax scale, the embedding's factor,
        each residual branch's factor and the divisor of the logits), a shared expert where
        the file has one (granitemoeshared)."""
        out: dict[str, Any] = {
            "num_local_experts": E, "intermediate_size": int(eff or ff),
            "attention_multiplier": float(self._m("attention.scale", 1.0)),
            "embedding_multiplier": float(self._m("embedding_scale", 1.0)),
            "residual_multiplier": float(self._m("residual_scale", 1.0)),
            "logits_scaling": float(self._m("logit_scale", 1.0)),
            "attention_bias": "blk.0.attn_q.bias" in self._tensors}
        if self.model_type in (_GRANITE_SHARED, "granitemoehybrid"):
            out["shared_intermediate_size"] = int(
                self._m("expert_shared_feed_forward_length", 0) or
                self._tensors["blk.0.ffn_up_shexp.weight"].shape[1])
        return out

    def _lfm2(self, E: int, ff: Any, eff: Any, L: int) -> dict[str, Any]:
        """LFM2-MoE's settings as llama.cpp reads them: the convolution layers are those with
        no k/v heads (``attention.head_count_kv`` per layer), the conv's cache length, dense
        leading layers, sigmoid routing with the block's correction bias, the top-k weights
        normalised (always, in llama.cpp) and scaled by ``expert_weights_scale``."""
        kv = self._kv_per_layer(L, "convolution")
        return {"num_experts": E, "moe_intermediate_size": int(eff or ff),
                "intermediate_size": int(ff or eff),
                "num_dense_layers": int(self._m("leading_dense_block_count", 0) or 0),
                "layer_types": ["full_attention" if int(x) else "conv" for x in kv[:L]],
                "conv_L_cache": int(self._m("shortconv.l_cache", need=True)),
                "conv_bias": "blk.0.shortconv.conv.bias" in self._tensors,
                "norm_eps": float(self._m("attention.layer_norm_rms_epsilon", 1e-5)),
                "norm_topk_prob": True,
                "routed_scaling_factor": float(self._m("expert_weights_scale", 1.0) or 1.0),
                "use_expert_bias": any(n.endswith(".exp_probs_b.bias") for n in self._tensors)}

    def _afmoe(self, E: int, ff: Any, eff: Any, L: int) -> dict[str, Any]:
        """Trinity's settings as llama.cpp's afmoe reads them: sliding-window layers by
        ``attention.sliding_window_pattern`` (3 of every 4 where the file has none), the
        rotary embedding on those layers only, at ``rope.freq_base_swa`` where given; the
        embeddings scaled by sqrt(hidden) (muP: llama.cpp always applies it); sigmoid routing
        with the block's correction bias, top-k weights normalised (transformers' model has
        no other form: a file that says they are not is refused) and scaled."""
        if self._m("expert_weights_norm") is False:
            raise GgufError(f"{self.folder}: an afmoe file with expert_weights_norm false "
                            "(transformers' Trinity always normalises its top-k weights)")
        pat = self.meta.get(f"{self.arch}.attention.sliding_window_pattern", 4)
        if isinstance(pat, list) and len(pat) >= L:
            swa = [bool(x) for x in pat[:L]]
        else:
            n = int(pat[0] if isinstance(pat, list) else pat)
            swa = [(i + 1) % n != 0 for i in range(L)]
        base = self._m("rope.freq_base_swa") or self._m("rope.freq_base", 10000.0)
        return {"num_experts": E, "moe_intermediate_size": int(eff or ff),
                "intermediate_size": int(ff or eff),
                "num_shared_experts": int(self._m("expert_shared_count", 0) or 0),
                "num_dense_layers": int(self._m("leading_dense_block_count", 0) or 0),
                "route_scale": float(self._m("expert_weights_scale", 1.0) or 1.0),
                "sliding_window": int(self._m("attention.sliding_window", 0) or 0) or None,
                "layer_types": ["sliding_attention" if x else "full_attention" for x in swa],
                "mup_enabled": True,
                "rope_parameters": {"rope_type": "default", "rope_theta": float(base)}}

    def _mamba2(self, H: int, L: int) -> dict[str, Any]:
        """Granite 4.0 H's Mamba-2 layers as llama.cpp's GraniteHybridModel writes them: the
        recurrent layers are those with no k/v heads, heads as ``ssm.time_step_rank``; the
        attention layers without a rotary embedding unless ``rope.scaling.finetuned`` says
        the model uses one (Granite 4.0 H: NoPE)."""
        kv = self._kv_per_layer(L, "Mamba")
        heads = int(self._m("ssm.time_step_rank", need=True))
        inner = int(self._m("ssm.inner_size", need=True))
        return {"layer_types": ["full_attention" if int(x) else "linear_attention"
                                for x in kv[:L]],
                "mamba_n_heads": heads, "mamba_d_head": inner // heads,
                "mamba_n_groups": int(self._m("ssm.group_count", 1) or 1),
                "mamba_d_state": int(self._m("ssm.state_size", need=True)),
                "mamba_d_conv": int(self._m("ssm.conv_kernel", need=True)),
                "mamba_expand": inner // H,
                "mamba_conv_bias": "blk.0.ssm_conv1d.bias" in self._tensors,
                "mamba_proj_bias": "blk.0.ssm_in.bias" in self._tensors,
                "position_embedding_type": "rope" if self._m("rope.scaling.finetuned")
                else None}

    def _qwen3next(self, E: int, ff: Any, eff: Any, L: int, head_dim: Any) -> dict[str, Any]:
        """Qwen3-Next's and Qwen3.5's settings: gated DeltaNet layers (llama.cpp's ``ssm.*``
        keys: key heads as the group count, value heads as the time-step rank, the key head
        size as the state size) where ``attention.recurrent_layers`` marks them (else every
        ``full_attention_interval``-th layer is full attention), gated full attention with
        q/k norms and the rotary embedding on the first ``rope.dimension_count`` dimensions of
        each head, a shared expert behind its gate; llama.cpp always normalises the top-k
        weights of both (no key)."""
        nv = int(self._m("ssm.time_step_rank", need=True))
        rec = self.meta.get(f"{self.arch}.attention.recurrent_layers")
        if isinstance(rec, list) and len(rec) >= L:
            linear = [bool(x) for x in rec[:L]]
        else:
            n = int(self._m("full_attention_interval", 4) or 4)
            linear = [(i + 1) % n != 0 for i in range(L)]
        out: dict[str, Any] = {
            "num_experts": E,
            "moe_intermediate_size": int(eff or ff),
            "shared_expert_intermediate_size": int(
                self._m("expert_shared_feed_forward_length", 0) or 0),
            "norm_topk_prob": True,
            "linear_conv_kernel_dim": int(self._m("ssm.conv_kernel", need=True)),
            "linear_key_head_dim": int(self._m("ssm.state_size", need=True)),
            "linear_num_key_heads": int(self._m("ssm.group_count", need=True)),
            "linear_num_value_heads": nv,
            "linear_value_head_dim": int(self._m("ssm.inner_size", need=True)) // nv,
            "layer_types": ["linear_attention" if x else "full_attention" for x in linear],
            "rope_parameters": self._partial_rope(head_dim),
        }
        if self.model_type == "qwen3_next":
            out.update(decoder_sparse_step=1, mlp_only_layers=[])
            if ff is not None:
                out["intermediate_size"] = int(ff)
        sections = self.meta.get(f"{self.arch}.rope.dimension_sections")
        if isinstance(sections, list) and len(sections) >= 3:  # Qwen3.5's interleaved
            # multimodal rope: on text (one position per token on every axis) the plain one
            out["rope_parameters"].update(mrope_section=[int(x) for x in sections[:3]],
                                          mrope_interleaved=True)
        return out

    def _partial_rope(self, head_dim: Any) -> dict[str, Any]:
        """The default rotary parameters on the first ``rope.dimension_count`` dimensions of
        each head (``partial_rotary_factor``, 1.0 for all of them: always said, as GLM-4.5's
        config class defaults to half)."""
        out: dict[str, Any] = {"rope_type": "default",
                               "rope_theta": float(self._m("rope.freq_base", 10000.0))}
        rope = self._m("rope.dimension_count")
        if rope is not None and head_dim:
            out["partial_rotary_factor"] = int(rope) / int(head_dim)
        return out

    def _gpt_oss(self, E: int, ff: Any, eff: Any, L: int) -> dict[str, Any]:
        """GPT-OSS's settings as llama.cpp reads them (``llama_model_openai_moe``): sliding
        window attention on the layers its pattern marks (every other layer from the first,
        pattern 2, unless the file says otherwise), YaRN rope scaling with GPT-OSS's
        ``truncate: false``; the clamped SwiGLU's alpha 1.702 and limit 7 are constants there
        (no key), as they are transformers' defaults."""
        out: dict[str, Any] = {"num_local_experts": E, "intermediate_size": int(eff or ff)}
        sw = self._m("attention.sliding_window")
        if sw:
            pat = self.meta.get(f"{self.arch}.attention.sliding_window_pattern", 2)
            if isinstance(pat, list) and len(pat) == L:
                swa = [bool(p) for p in pat]
            else:
                n = int(pat[0] if isinstance(pat, list) else pat)
                swa = [n == 0 or i % n < n - 1 for i in range(L)]
            out["sliding_window"] = int(sw)
            out["layer_types"] = ["sliding_attention" if x else "full_attention" for x in swa]
        else:
            out["layer_types"] = ["full_attention"] * L
        if self._m("rope.scaling.type") == "yarn":
            out["rope_parameters"] = {
                "rope_type": "yarn", "rope_theta": float(self._m("rope.freq_base", 10000.0)),
                "factor": float(self._m("rope.scaling.factor", 1.0)),
                "original_max_position_embeddings": int(self._m(
                    "rope.scaling.original_context_length", 4096)),
                "beta_fast": float(self._m("rope.scaling.yarn_beta_fast", 32.0)),
                "beta_slow": float(self._m("rope.scaling.yarn_beta_slow", 1.0)),
                "truncate": False}
        return out

    # -- tensors -----------------------------------------------------------------------------

    def _dequant(self, name: str, index: int | slice | None = None) -> np.ndarray:
        from gguf import GGMLQuantizationType
        from gguf.quants import dequantize

        t = self._tensors[name]
        data = t.data if index is None else t.data[index]
        try:
            out = dequantize(np.asarray(data), GGMLQuantizationType(t.tensor_type))
        except NotImplementedError as exc:
            raise GgufError(f"{self.folder}: tensor {name} has type {t.tensor_type.name}, "
                            f"which the gguf package does not dequantize ({exc})") from None
        except (ValueError, IndexError, OSError) as exc:  # a truncated file, a bad shape
            raise GgufError(f"{self.folder}: cannot read tensor {name}: {exc}") from None
        out = np.ascontiguousarray(out, dtype=np.float32)
        return out if out.flags.writeable else out.copy()  # F32 comes as a view of the map

    def _fix(self, key: str, a: np.ndarray) -> np.ndarray:
        """Undo the converter's permutation of q/k rows (``llama`` only)."""
        if key.endswith("shared_expert_gate.weight") and a.ndim == 1:
            a = a.reshape(1, -1)  # llama.cpp holds this [1, H] router as a vector
        if self.arch in PERMUTED_QK and key.endswith(("q_proj.weight", "k_proj.weight")):
            heads = int(self._m("attention.head_count"))
            n = heads if key.endswith("q_proj.weight") else self._kv_heads(heads)
            a = _unpermute(a, n)
        return a

    def tensor(self, key: str, dtype: Any = None) -> Any:
        """The whole tensor ``key`` as a float32 torch tensor (dequantized), or in torch
        ``dtype``: then a single 2-D tensor is dequantized 4096 rows at a time into it (a
        102400-row embedding never exists in f32 whole)."""
        import torch

        names = self._sources[key]
        t = self._tensors[names[0]]
        if (dtype is not None and dtype != torch.float32 and len(names) == 1
                and len(t.data.shape) == 2 and key not in self._layout
                and not key.endswith(("q_proj.weight", "k_proj.weight"))):
            rows = int(t.data.shape[0])
            out = None
            for r0 in range(0, rows, 4096):
                part = torch.from_numpy(self._dequant(names[0], slice(r0, r0 + 4096)))
                if out is None:
                    out = torch.empty((rows, part.shape[1]), dtype=dtype)
                out[r0:r0 + part.shape[0]] = part
            return out
        parts = [self._dequant(n) for n in names]
        if key.endswith("kv_b_proj.weight") and len(parts) == 2:
            a = _join_kv_b(*parts)
        else:
            a = self._assemble(key, parts)
        return torch.from_numpy(self._fix(key, a))

    def slice(self, key: str, index: int) -> Any:
        """``tensor(key)[index]`` for a stacked expert tensor, reading only that expert."""
        import torch

        return torch.from_numpy(self._assemble(
            key, [self._dequant(n, index) for n in self._sources[key]]))

    def _assemble(self, key: str, parts: list[np.ndarray]) -> np.ndarray:
        """The transformers tensor ``key`` (or one expert's slice of it) from its GGUF sources'
        arrays: stacked row-wise (gate rows, then up rows), or in GPT-OSS's layout, whose
        experts transformers holds as gate_up [H, 2I] with gate and up interleaved (even
        columns gate, odd up), its bias [2I] interleaved likewise, and down [I, H]."""
        how = self._layout.get(key)
        if how in _GATED_DELTA_HOW:
            return self._gated_delta(key, how, parts)
        if how in ("mamba_a_log", "mamba_flat", "mamba_conv1d"):
            a = parts[0]
            if how == "mamba_conv1d":
                return np.ascontiguousarray(a.reshape(a.shape[0], 1, -1))
            a = a.reshape(-1)
            return np.ascontiguousarray(self._a_log(key, a) if how == "mamba_a_log" else a)
        if how == "oss_down":
            return np.ascontiguousarray(np.swapaxes(parts[0], -1, -2))
        axis = -1 if how == "oss_gate_up_bias" else -2
        a = parts[0] if len(parts) == 1 else np.concatenate(parts, axis=axis)
        if how is None:
            return a
        half = a.shape[axis] // 2
        if how == "oss_gate_up_bias":
            g, u = a[..., :half], a[..., half:]
            return np.ascontiguousarray(np.stack([g, u], axis=-1).reshape(a.shape))
        g, u = a[..., :half, :], a[..., half:, :]
        inter = np.stack([g, u], axis=-2).reshape(a.shape)  # rows gate0, up0, gate1, ...
        return np.ascontiguousarray(np.swapaxes(inter, -1, -2))

    def _gated_delta(self, key: str, how: str, parts: list[np.ndarray]) -> np.ndarray:
        """Undo what llama.cpp's Qwen3-Next / Qwen3.5 converter did to tensor ``key``
        (:data:`_GATED_DELTA_LAYOUT`; the value-head order only in a ``qwen35moe`` file with
        more value heads than key heads, as the converter reorders only there)."""
        a = parts[0]
        if how == "plus_one":
            return a - np.float32(1.0)
        nk = int(self._m("ssm.group_count", need=True))
        nv = int(self._m("ssm.time_step_rank", need=True))
        dk = int(self._m("ssm.state_size", need=True))
        dv = int(self._m("ssm.inner_size", need=True)) // nv
        if how == "qkvz":
            return _join_qkvz(a, parts[1], nk, dk)
        if how == "a_log":
            a = self._a_log(key, a)
        tiled = self.arch == "qwen35moe" and nv != nk
        if how == "conv1d":
            a = a.reshape(a.shape[0], -1)  # [C, K]
            if tiled:  # the value channels follow the q and k channels
                qk = 2 * nk * dk
                a = np.concatenate([a[:qk], _untile_v_heads(a[qk:], 0, nk, nv // nk, dv)])
            return np.ascontiguousarray(a[:, None, :])
        if not tiled:
            return a
        r = nv // nk
        if how == "v_heads" or how == "a_log":
            return _untile_v_heads(a, 0, nk, r, 1)
        if how == "v_rows":
            return _untile_v_heads(a, 0, nk, r, dv)
        if how == "qkv_v_rows":
            qk = 2 * nk * dk
            return np.concatenate([a[:qk], _untile_v_heads(a[qk:], 0, nk, r, dv)])
        if how == "v_cols":
            return _untile_v_heads(a, 1, nk, r, dv)
        raise AssertionError(how)

    def companions(self) -> set[str]:
        """Keys that are data of another key (none in a GGUF file)."""
        return set()

    def nbytes(self, key: str) -> int:
        """Bytes of tensor ``key`` in the file."""
        return sum(int(self._tensors[n].n_bytes) for n in self._sources[key])

    def fingerprint(self) -> dict[str, Any]:
        """The file's name, size and modification time, and a digest of its metadata and
        tensor table (what decides the store's bytes)."""
        st = self.folder.stat()
        table = [[t.name, t.tensor_type.name, [int(x) for x in t.shape], int(t.data_offset)]
                 for t in self._tensors.values()]
        meta = {k: v for k, v in self.meta.items() if isinstance(v, (int, float, str, bool))}
        digest = hashlib.sha256(json.dumps([table, meta], sort_keys=True,
                                           default=str).encode()).hexdigest()
        files = [[self.folder.name, st.st_size, st.st_mtime_ns, digest]]
        whole = hashlib.sha256(json.dumps([files, digest]).encode()).hexdigest()
        return {"digest": whole, "files": files, "config": digest}

    def close(self) -> None:
        """Nothing to release per layer (the reader's map stays until the checkpoint goes)."""

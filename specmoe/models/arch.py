"""Which transformers MoE models specmoe can serve, and where their routed experts are.

transformers 5.x gives most MoE architectures one routed-experts module with fused parameters
(``gate_up_proj [E, 2I, H]``, ``down_proj [E, H, I]``) that the MoE block calls as
``experts(hidden[T,H], top_k_index[T,k], top_k_weights[T,k])`` after all model-specific
routing.  specmoe finds that module from the model's *structure* (:func:`describe`): in each
decoder layer, the MoE block is the child (``mlp``, ``block_sparse_moe``, ``feed_forward``,
``moe``) holding an ``experts`` module with those two parameters, and its router is the sibling
(``gate``/``router``) whose weight is ``[E, H]``.  A small table (:data:`_DEVIATIONS`) covers the
models that deviate from the common form: GPT-OSS (transposed, interleaved, biased experts with
a clamped SwiGLU) and the sigmoid routers of the DeepSeek-V3 family (the prefetch predictor
imitates them, and with the dense layers in C their MoE blocks route in C:
``ROUTED_BLOCKS``).

Canonical expert layout (one dict per MoE layer, or per expert without the leading E axis):
``gate [E,I,H]``, ``up [E,I,H]``, ``down [E,H,I]`` and, for GPT-OSS, ``gate.bias [E,I]``,
``up.bias [E,I]``, ``down.bias [E,H]`` (the names of csrc/kernels/kernels.h and
:func:`specmoe.storage.quant.expert_tensors`).

Checkpoints on disk keep the original per-expert names (``experts.{e}.w1/w2/w3`` for Mixtral and
PhiMoE, ``experts.{e}.gate_proj/up_proj/down_proj`` for the Qwen, OLMoE and DeepSeek families),
or transformers 5's fused names: :func:`expert_key` classifies a (renamed) checkpoint key.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Iterator

import numpy as np
import torch
from torch import nn

from ..runtime.experts import SpecmoeExperts  # an offloaded layer keeps its place

__all__ = [
    "SUPPORTED",
    "UNSUPPORTED",
    "ArchInfo",
    "UnsupportedModelError",
    "describe",
    "decoder",
    "getpath",
    "moe_layers",
    "expert_module",
    "extract_expert",
    "extract_experts",
    "iter_experts_modules",
    "expert_key",
    "GATE_NAMES",
    "UP_NAMES",
    "DOWN_NAMES",
    "DECODE_STEP_MODELS",
    "FUSABLE_ATTENTION",
    "GATED_ATTENTION",
    "SINK_ATTENTION",
    "PAIRS_ROPE_ATTENTION",
    "FUSABLE_LAYERS",
    "FUSABLE_MLA_LAYERS",
    "FUSABLE_GATED_DELTANET",
    "FUSABLE_GDN_LAYERS",
    "MLA_ATTENTION",
    "LLAMA_RMSNORMS",
    "ZERO_CENTRED_RMSNORMS",
    "F32_SCALED_RMSNORMS",
    "ROUTED_BLOCKS",
]


class UnsupportedModelError(ValueError):
    """The model is not one of the MoE architectures specmoe can offload."""


@dataclass(frozen=True)
class ArchInfo:
    """How one architecture's routed experts are laid out.

    block_attr: attribute of a decoder layer holding its MoE block; router_attr: (dotted) path
    from the MoE block to the module whose ``weight [E, H]`` (and ``bias``) gives the router
    logits; bias_attr: path from the block to a per-expert correction bias added to the scores
    when choosing experts (DeepSeek-V3 family), if any; sigmoid_router: the scores are
    ``sigmoid(logits)`` before that bias (the prefetch predictor imitates both); gptoss:
    transposed, interleaved, biased experts with a clamped SwiGLU; activation: the kernels'
    activation name."""

    model_type: str
    block_attr: str = "mlp"
    router_attr: str = "gate"
    gptoss: bool = False
    sigmoid_router: bool = False
    activation: str = "silu"
    bias_attr: str | None = None


# Deviations from the common form, by config.model_type.  Everything else is read from the
# module structure by describe().
_DEVIATIONS: dict[str, dict] = {
    "gpt_oss": dict(router_attr="router", gptoss=True, activation="gptoss"),
    "phimoe": dict(router_attr="router"),
}

# Architectures tested tiny from their config (tests/test_hf.py, tests/test_pretrained.py):
# greedy tokens with an f32 store equal the unmodified model.  Filled by describe() for any
# other model whose structure fits; these are the ones we have checked.
SUPPORTED: dict[str, ArchInfo] = {
    mt: ArchInfo(mt, **_DEVIATIONS.get(mt, {}))
    for mt in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "phimoe", "deepseek_v2",
               "deepseek_v3", "gpt_oss", "glm4_moe", "ernie4_5_moe", "hunyuan_v1_moe", "dots1",
               "granitemoe", "qwen3_next", "qwen3_5_moe_text", "minimax", "flex_olmo",
               "lfm2_moe", "jamba",
               # transformers 5.24's further types whose structure fits, tested the same way
               "afmoe", "axk2", "bailing_hybrid", "beam", "cohere2_moe", "deepseek_v32",
               "exaone_moe", "flint", "glm4_moe_lite", "glm_moe_dsa", "granitemoe_swa",
               "granitemoehybrid", "granitemoeshared", "hy_v3", "kimi_linear", "kolibri1",
               "laguna", "lara_mini", "mellum", "mimo_v2_flash", "minimax_m2", "sarvam_mla",
               "sarvam_moe", "solar_open")
}
SUPPORTED["deepseek_v3"] = replace(SUPPORTED["deepseek_v3"], sigmoid_router=True,
                                   bias_attr="gate.e_score_correction_bias")

# Architectures tried and not supported, with the reason (docs/usage.md lists them).
UNSUPPORTED: dict[str, str] = {
    "llama4_text": "its experts module takes only the hidden states and runs every expert "
                   "densely, and the routing weight scales each expert's input, not its output "
                   "(FFN_e(w*x)); the kernels have no input-scaling mode yet",
    "llama4": "see llama4_text (and the vision tower is not an MoE)",
    "dbrx": "its experts live in transformer.blocks[i].ffn as w1/v1/w2 [E*I, H] and receive "
            "3-D hidden states; not adapted yet",
    "deepseek_v4": "its SwiGLU clamps gate and up (swiglu_limit) before the activation; the "
                   "kernels have no clamped-SiLU mode",
    "hy_v4": "clamped SwiGLU (swiglu_limit), as deepseek_v4",
    "glm5_next": "clamped SwiGLU (swiglu_limit), as deepseek_v4",
    "minimax_m3_vl": "GPT-OSS-style clamped activation without interleaving or biases",
    "inkling2_text": "soft-capped gate and up projections",
    "nemotron_h": "experts without a gate (ReLU squared on up only)",
    "longcat_flash": "identity ('zero') experts among the routed experts",
    "jetmoe": "no fused experts module (ParallelExperts with its own call)",
    "gemma4_text": "GELU experts directly on the decoder layer",
}

_BLOCK_ATTRS = ("mlp", "block_sparse_moe", "feed_forward", "moe")
# where routers keep their [E, H] weight, relative to the MoE block
_ROUTER_ATTRS = ("gate", "router", "gate.wg", "router.gate")
# where correction biases (added to the scores to choose experts) live
_BIAS_ATTRS = ("gate.e_score_correction_bias", "router.e_score_correction_bias",
               "expert_bias", "gate.moe_statics.e_score_correction_bias",
               "e_score_correction_bias")  # (the last: MiniMax-M2's and EXAONE's, on the block)
_SOFTMAX_BIASED = ("ernie4_5_moe",)  # correction bias on softmax scores, not sigmoid


def getpath(obj: object, path: str) -> object:
    """``obj.a.b`` for path ``"a.b"`` (None where an attribute is missing)."""
    for part in path.split("."):
        obj = getattr(obj, part, None)
        if obj is None:
            return None
    return obj


def decoder(model: nn.Module) -> nn.Module:
    """The module holding ``.layers`` (``model.model`` for a ...ForCausalLM)."""
    inner = getattr(model, "model", model)
    if not hasattr(inner, "layers"):
        raise UnsupportedModelError(f"{type(model).__name__} has no .model.layers")
    return inner


def _is_fused_experts(m: nn.Module | None) -> bool:
    if m is None:
        return False
    if isinstance(m, SpecmoeExperts):
        return True
    return isinstance(getattr(m, "gate_up_proj", None), torch.Tensor) and \
        isinstance(getattr(m, "down_proj", None), torch.Tensor)


def _block_of(layer: nn.Module, attrs: tuple[str, ...]) -> tuple[str, nn.Module] | None:
    for a in attrs:
        blk = getattr(layer, a, None)
        if isinstance(blk, nn.Module) and _is_fused_experts(getattr(blk, "experts", None)):
            return a, blk
    return None


def describe(model: nn.Module) -> tuple[ArchInfo, list[int]]:
    """(layout of the routed experts, indices of the decoder layers that have them).

    Raises UnsupportedModelError saying why when the model does not fit: no decoder layers, no
    fused experts module, no router, or an activation the kernels do not have."""
    cfg = getattr(model, "config", None)
    mt = getattr(cfg, "model_type", None)
    if mt in UNSUPPORTED:
        raise UnsupportedModelError(f"model_type {mt!r} is not supported: {UNSUPPORTED[mt]}")
    try:
        layers = decoder(model).layers
    except UnsupportedModelError as exc:
        raise UnsupportedModelError(f"{exc}; {_supported_line()}") from None
    dev = _DEVIATIONS.get(mt, {})
    attrs = (dev["block_attr"],) if "block_attr" in dev else _BLOCK_ATTRS
    found = [(i, _block_of(layer, attrs)) for i, layer in enumerate(layers)]
    ids = [i for i, b in found if b is not None]
    if not ids:
        raise UnsupportedModelError(
            f"model_type {mt!r}: no decoder layer has a fused routed-experts module "
            f"(an `experts` child with gate_up_proj and down_proj in one of "
            f"{', '.join(attrs)}); {_supported_line()}")
    block_attr, blk = found[ids[0]][1]  # type: ignore[misc]

    def weight2d(path: str) -> bool:
        w = getpath(blk, path + ".weight")
        return isinstance(w, torch.Tensor) and w.dim() == 2

    router_attr = dev.get("router_attr") or next((a for a in _ROUTER_ATTRS if weight2d(a)), None)
    if router_attr is None or not weight2d(router_attr):
        raise UnsupportedModelError(f"model_type {mt!r}: the MoE block has no router with a "
                                    f"[E, H] weight (looked for {', '.join(_ROUTER_ATTRS)})")
    bias_attr = next((a for a in _BIAS_ATTRS if isinstance(getpath(blk, a), torch.Tensor)),
                     None)
    info = ArchInfo(mt or type(model).__name__, block_attr=block_attr, router_attr=router_attr,
                    gptoss=dev.get("gptoss", False),
                    sigmoid_router=bias_attr is not None and mt not in _SOFTMAX_BIASED,
                    activation=dev.get("activation", "silu"), bias_attr=bias_attr)
    if not info.gptoss:
        act = getattr(cfg, "hidden_act", None) or "silu"  # lfm2_moe hard-codes silu
        if act not in ("silu", "swish"):
            raise UnsupportedModelError(f"model_type {mt!r}: hidden_act {act!r} is not "
                                        "supported by the expert kernels (silu only)")
    return info, ids


def _supported_line() -> str:
    return "tested MoE architectures: " + ", ".join(sorted(SUPPORTED))


def moe_layers(model: nn.Module) -> list[int]:
    """Decoder layer indices whose MoE block has routed experts (dense layers, e.g.
    DeepSeek's first ``first_k_dense_replace``, are skipped)."""
    return describe(model)[1]


def moe_block(model: nn.Module, info: ArchInfo, layer: int) -> nn.Module:
    return getattr(decoder(model).layers[layer], info.block_attr)


def expert_module(model: nn.Module, info: ArchInfo, layer: int) -> nn.Module:
    return moe_block(model, info, layer).experts


def iter_experts_modules(model: nn.Module) -> Iterator[nn.Module]:
    """The routed-experts module of every MoE layer, in layer order."""
    info, ids = describe(model)
    for i in ids:
        yield expert_module(model, info, i)


# ---------------------------------------------------------------------------------------------
# canonical f32 arrays


def _np(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float32).cpu().contiguous().numpy()


def canonical(gate_up: torch.Tensor, down: torch.Tensor, gptoss: bool,
              gate_up_bias: torch.Tensor | None = None,
              down_bias: torch.Tensor | None = None) -> dict[str, np.ndarray]:
    """One expert's fused tensors as canonical f32 arrays.

    Common form: ``gate_up [2I, H]`` (first half gate, second half up), ``down [H, I]``.
    GPT-OSS: ``gate_up [H, 2I]`` with gate and up interleaved (even columns gate, odd up),
    ``down [I, H]``, biases ``[2I]`` (interleaved) and ``[H]``."""
    if gptoss:
        gu_t = gate_up.transpose(0, 1)
        out = {"gate": _np(gu_t[0::2]), "up": _np(gu_t[1::2]), "down": _np(down.transpose(0, 1))}
        if gate_up_bias is not None:
            out["gate.bias"] = _np(gate_up_bias[0::2])
            out["up.bias"] = _np(gate_up_bias[1::2])
        if down_bias is not None:
            out["down.bias"] = _np(down_bias)
        return out
    I = gate_up.shape[0] // 2
    return {"gate": _np(gate_up[:I]), "up": _np(gate_up[I:]), "down": _np(down)}


def extract_expert(experts: nn.Module, e: int, gptoss: bool) -> dict[str, np.ndarray]:
    """Expert ``e`` of a transformers experts module as canonical f32 arrays."""
    return canonical(experts.gate_up_proj[e].detach(), experts.down_proj[e].detach(), gptoss,
                     getattr(experts, "gate_up_proj_bias", None)[e] if gptoss else None,
                     getattr(experts, "down_proj_bias", None)[e] if gptoss else None)


def extract_experts(experts: nn.Module, gptoss: bool = False) -> dict[str, np.ndarray]:
    """One MoE layer's routed experts as canonical float32 arrays [E, ...]."""
    if isinstance(experts, SpecmoeExperts):
        raise ValueError("these experts are already offloaded")
    per = [extract_expert(experts, e, gptoss) for e in range(experts.gate_up_proj.shape[0])]
    return {n: np.stack([p[n] for p in per]) for n in per[0]}


# ---------------------------------------------------------------------------------------------
# checkpoint keys

# per-expert tensor names of the original checkpoints: Mixtral/PhiMoE w1/w3/w2, the Qwen,
# OLMoE and DeepSeek families gate_proj/up_proj/down_proj
# Decoder pieces specmoe runs whole in C at decode sizes (specmoe.models.attention, Engine routing).
# Attention classes whose forward is, at decode: q/k/v projections; q and k RMSNorm (none; over
# all heads: OLMoE; per head: Qwen3, GLM-4.5 when use_qk_norm); the rotate-half rotary
# embedding with the decoder's (cos, sin), on the first partial_rotary_factor of each head
# (GLM-4.5: half); the cache update; attention over the cache (sdpa/eager: the mask says what
# is seen); o_proj.  Value: the q/k norm form (a module without q_norm: none).
FUSABLE_ATTENTION = {"OlmoeAttention": "full", "Qwen3MoeAttention": "head",
                     "Qwen2MoeAttention": "none", "MixtralAttention": "none",
                     "Qwen3NextAttention": "head", "Qwen3_5MoeAttention": "head",
                     "Glm4MoeAttention": "head", "MiniMaxM2Attention": "full",
                     "GptOssAttention": "none", "Ernie4_5_MoeAttention": "none",
                     "LlamaAttention": "none"}
# those of them whose q_proj gives, per head, head_dim query rows then head_dim gate rows, and
# whose output is attention * sigmoid(gate) before o_proj, with zero-centred q/k norms and a
# partial rotary (rope_parameters' partial_rotary_factor): Qwen3-Next's and Qwen3.5's full
# attention layers.  Their block runs only as the whole decoder layer's one call
GATED_ATTENTION = ("Qwen3NextAttention", "Qwen3_5MoeAttention")
# those of them with GPT-OSS's form: q/k/v/o biases, attention sinks (``sinks``, one logit a
# head), a rotary over the halves of each head with cos / sin half a head wide
# (``_apply_rotary_emb``), sliding-window layers (the cache keeps the window; the mask says
# the rest), and decoder layers whose norms are F32_SCALED_RMSNORMS
SINK_ATTENTION = ("GptOssAttention",)
# those of them whose rotary turns the pairs (x[2i], x[2i+1]) of each head in place by the
# angle of cos / sin's i-th value, in f32, rounded once (ERNIE-4.5's apply_rotary_pos_emb:
# cos and sin's first halves repeated pairwise, rotate_half over the pairs): the block's
# "pairs" rotary
PAIRS_ROPE_ATTENTION = ("Ernie4_5_MoeAttention",)
# decoder layers of those forms whose forward is: h + attn(input_layernorm(h)), then that plus
# mlp(post_attention_layernorm(that)) -- the input norm, the first residual add and the
# post-attention norm then go into the attention block's calls
FUSABLE_LAYERS = ("OlmoeDecoderLayer", "Qwen3MoeDecoderLayer", "Qwen2MoeDecoderLayer",
                  "MixtralDecoderLayer", "Qwen3NextDecoderLayer", "Qwen3_5MoeDecoderLayer",
                  "Glm4MoeDecoderLayer", "MiniMaxM2DecoderLayer", "GptOssDecoderLayer",
                  "Ernie4_5_MoeDecoderLayer", "LlamaDecoderLayer")
# gated DeltaNet modules whose forward at one cached token is Qwen3.5's (separate q|k|v, z, b
# and a projections, a SiLU short convolution, the gated delta rule with l2-normalised q and
# k, a gated RMSNorm) or Qwen3-Next's (the same on q, k, v, z interleaved per key head in one
# projection, b and a in another): specmoe.models.linear_attn.fuse_gated_deltanet runs it in
# one C call
FUSABLE_GATED_DELTANET = ("Qwen3_5MoeGatedDeltaNet", "Qwen3_5GatedDeltaNet",
                          "Qwen3NextGatedDeltaNet")
# their MoE decoder layers (h + linear_attn(input_layernorm(h)), then that plus
# mlp(post_attention_layernorm(that))), a decode step of which is one C call when the MoE block
# routes in C: specmoe.models.linear_attn
FUSABLE_GDN_LAYERS = ("Qwen3_5MoeDecoderLayer", "Qwen3NextDecoderLayer")
# DeepSeek-V2/V3 decoder layers (the same residual form) whose MLA attention, absorbed, runs
# with them in one C call (specmoe.models.mla.fuse_mla): transformers' DeepseekV2/V3Attention caching
# the latent, with DeepSeek-V2's complex rotary or DeepSeek-V3's rotate-half / interleaved one
FUSABLE_MLA_LAYERS = ("DeepseekV2DecoderLayer", "DeepseekV3DecoderLayer",
                      "Glm4MoeLiteDecoderLayer")  # (GLM-4.7-Flash: DeepSeek-V3's forward)
# MLA attention modules whose forward is DeepSeek-V2's or V3's (GLM-4.7-Flash's is V3's, line
# for line), which specmoe.models.mla decodes in the absorbed form.  Not: the sparse-attention
# variants (DeepSeek-V3.2, GLM-5, A.X K2: an indexer picks the keys each query sees, which
# the absorbed form would not), Ling's and A.X's gated outputs, Kimi-Linear's MLA without
# rotary embedding: their own forward runs.
MLA_ATTENTION = ("DeepseekV2Attention", "DeepseekV3Attention", "Glm4MoeLiteAttention")
# causal LMs whose forward, for one token of one sequence, is embed_tokens, rotary_emb over the
# position, the decoder layers [:num_hidden_layers] with the causal mask (the hybrids' linear
# attention layers with the recurrent one, None without padding), norm, lm_head (no embedding
# scale, logit scale or soft-cap): specmoe.models.decode_step runs that sequence itself
DECODE_STEP_MODELS = ("OlmoeForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM",
                      "MixtralForCausalLM", "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM",
                      "Glm4MoeLiteForCausalLM", "Qwen3NextForCausalLM",
                      "Qwen3_5MoeForCausalLM", "MiniMaxM2ForCausalLM",
                      "Ernie4_5_MoeForCausalLM", "Glm4MoeForCausalLM", "LlamaForCausalLM")
# RMSNorm classes of the Llama family's form, ``weight * (x * rsqrt(mean(x^2) + eps)).to(dtype)``
# (Gemma's ``1 + weight`` and other variants are not in it)
LLAMA_RMSNORMS = ("OlmoeRMSNorm", "Qwen3MoeRMSNorm", "Qwen2MoeRMSNorm",
                  "MixtralRMSNorm", "DeepseekV2RMSNorm", "DeepseekV3RMSNorm",
                  "Glm4MoeLiteRMSNorm", "Glm4MoeRMSNorm", "MiniMaxM2RMSNorm",
                  "Ernie4_5_MoeRMSNorm", "LlamaRMSNorm")
# RMSNorms of the zero-centred form: (x * rsqrt(mean(x^2) + eps)) * (1 + w) in f32, rounded to
# the model's dtype once (Qwen3-Next, Qwen3.5; transformers' comment: "(x * w).to(float16)"),
# their epsilon in ``eps``: specmoe.models.layers.CRMSNorm runs them too
ZERO_CENTRED_RMSNORMS = ("Qwen3NextRMSNorm", "Qwen3_5MoeRMSNorm", "Qwen3_5RMSNorm")
# RMSNorms that scale by their weight in f32 and round to the model's dtype once,
# ``(w * (x * rsqrt(mean(x^2) + eps))).to(dtype)`` (GPT-OSS; T5's form): the C kernels'
# zero-centred form with the weights as they are, eps in ``variance_epsilon``
F32_SCALED_RMSNORMS = ("GptOssRMSNorm",)
# MoE blocks whose forward is router + experts (+ shared experts) with a softmax top-k router:
# OLMoE and Qwen3-MoE (renormalised when norm_topk_prob, weights cast back to the model's
# dtype), Mixtral (always renormalised, f32 weights) and DeepSeek-V2 (f32 router, greedy top-k
# times routed_scaling_factor, plus the shared experts' MLP); or DeepSeek-V3's sigmoid router.  With the dense layers in C their
# decode steps route in C too (Engine._install_routing).
ROUTED_BLOCKS = {"OlmoeSparseMoeBlock": "qwen", "Qwen3MoeSparseMoeBlock": "qwen",
                 "MixtralSparseMoeBlock": "mixtral", "DeepseekV2Moe": "deepseek",
                 # the softmax top-k router of Qwen3-MoE's form plus a shared expert scaled by
                 # sigmoid(shared_expert_gate x), added to the experts' output (Qwen2-MoE,
                 # Qwen3-Next; Qwen3.5's router renormalises whatever norm_topk_prob says)
                 "Qwen2MoeSparseMoeBlock": "qwen_shared",
                 "Qwen3NextSparseMoeBlock": "qwen_shared",
                 "Qwen3_5MoeSparseMoeBlock": "qwen_shared_renorm",
                 # DeepSeek-V3's sigmoid router with a correction bias and expert groups
                 # (transformers' DeepseekV3TopkRouter, line for line in GLM-4.5's, GLM-4.7-
                 # Flash's and dots1's), its shared experts added
                 "DeepseekV3MoE": "deepseek_v3", "Glm4MoeMoE": "deepseek_v3",
                 "Glm4MoeLiteMoE": "deepseek_v3", "Dots1MoE": "deepseek_v3",
                 # the same choice without groups, shared experts or scale, its logits in the
                 # model's dtype and the bias on the block (MiniMax-M2)
                 "MiniMaxM2SparseMoeBlock": "minimax_m2",
                 # GPT-OSS: the k largest logits of a biased router, their softmax as the
                 # weights (transformers' GptOssTopKRouter); the block returns (out, scores)
                 "GptOssMLP": "gpt_oss",
                 # ERNIE-4.5: softmax over f32 logits, the choice by the probabilities plus a
                 # correction bias (Ernie4_5_MoeStatics), renormalised, its shared experts
                 "Ernie4_5_MoeSparseMoeBlock": "ernie"}

GATE_NAMES = ("w1", "gate_proj")
UP_NAMES = ("w3", "up_proj")
DOWN_NAMES = ("w2", "down_proj")
_PER_EXPERT = {**{n: "gate" for n in GATE_NAMES}, **{n: "up" for n in UP_NAMES},
               **{n: "down" for n in DOWN_NAMES}}
_PER_EXPERT_RE = re.compile(r"^(\d+)\.([A-Za-z0-9_]+)\.weight$")
_FUSED = ("gate_up_proj", "down_proj", "gate_up_proj_bias", "down_proj_bias",
          "gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales")


def expert_key(rest: str) -> tuple[int | None, str] | None:
    """Classify the part of a checkpoint key after ``...<block>.experts.``.

    Returns ``(expert, canonical_name)`` for a per-expert tensor (``"3.w1.weight"`` ->
    ``(3, "gate")``), ``(None, fused_name)`` for a fused tensor over all experts
    (``"gate_up_proj"``, ``"down_proj"``, their ``_bias`` and GPT-OSS's MXFP4 ``_blocks`` /
    ``_scales``), else None."""
    m = _PER_EXPERT_RE.match(rest)
    if m and m.group(2) in _PER_EXPERT:
        return int(m.group(1)), _PER_EXPERT[m.group(2)]
    if rest in _FUSED:
        return None, rest
    return None

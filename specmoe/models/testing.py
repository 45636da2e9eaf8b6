"""Tiny offline MoE models for tests, the demo and benchmarks, and checkpoint writers.

:func:`tiny_model` builds a randomly initialised model of any tested architecture from a small
config (no download) with routers far from uniform; :func:`save_checkpoint` writes it as a
checkpoint folder in either on-disk expert layout, so :func:`specmoe.from_pretrained` can be
tested against the unmodified model.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .arch import SUPPORTED, UnsupportedModelError, describe, getpath, moe_block

__all__ = ["tiny_config", "tiny_model", "save_checkpoint", "save_gguf", "save_fp8_checkpoint",
           "save_gptq_checkpoint", "save_awq_checkpoint"]


def tiny_config(arch: str, *, hidden: int = 64, inter: int = 96, layers: int = 3,
                experts: int = 8, top_k: int = 2, vocab: int = 128):
    """A small config of architecture ``arch`` (a key of SUPPORTED) that builds offline."""
    import transformers as tf
    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    hd = hidden // 4
    # MLA expands the latent into keys and values for every head (the DeepSeek configs' key
    # heads equal their query heads; with fewer, transformers' multi-token forward over a
    # cache fails on a shape mismatch)
    mla_common = dict(common, num_key_value_heads=4)
    if arch == "mixtral":
        return tf.MixtralConfig(intermediate_size=inter, num_local_experts=experts,
                                num_experts_per_tok=top_k, **common)
    if arch == "qwen2_moe":
        return tf.Qwen2MoeConfig(intermediate_size=2 * inter, moe_intermediate_size=inter,
                                 shared_expert_intermediate_size=inter, num_experts=experts,
                                 num_experts_per_tok=top_k, **common)
    if arch == "qwen3_moe":
        return tf.Qwen3MoeConfig(intermediate_size=2 * inter, moe_intermediate_size=inter,
                                 num_experts=experts, num_experts_per_tok=top_k, head_dim=hd,
                                 **common)
    if arch == "olmoe":
        return tf.OlmoeConfig(intermediate_size=inter, num_experts=experts,
                              num_experts_per_tok=top_k, **common)
    if arch == "phimoe":
        return tf.PhimoeConfig(intermediate_size=inter, num_local_experts=experts,
                               num_experts_per_tok=top_k, **common)
    if arch == "deepseek_v3":
        return tf.DeepseekV3Config(intermediate_size=2 * inter, moe_intermediate_size=inter,
                                   n_routed_experts=experts, num_experts_per_tok=top_k,
                                   n_shared_experts=1, first_k_dense_replace=1, n_group=2,
                                   topk_group=2, q_lora_rank=None, kv_lora_rank=32,
                                   qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=hd,
                                   **mla_common)
    if arch == "deepseek_v2":  # DeepSeek-V2-Lite's form: MLA without q compression, softmax
        return tf.DeepseekV2Config(intermediate_size=2 * inter, moe_intermediate_size=inter,
                                   n_routed_experts=experts, num_experts_per_tok=top_k,
                                   n_shared_experts=2, first_k_dense_replace=1,
                                   topk_method="greedy", n_group=1, topk_group=1,
                                   q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=8,
                                   qk_nope_head_dim=8, v_head_dim=hd, **mla_common)
    if arch == "gpt_oss":
        return tf.GptOssConfig(intermediate_size=inter, num_local_experts=experts,
                               num_experts_per_tok=top_k, head_dim=hd, sliding_window=64,
                               **common)
    L = layers
    alt = lambda *kinds: (list(kinds) * L)[:L]  # noqa: E731
    dense_first = ["dense"] + ["sparse"] * (L - 1)
    # multi-head latent attention (as DeepSeek-V3's, every head its own keys) and the sparse
    # attention indexer of DeepSeek-V3.2 / GLM-5 (it looks at all 16 positions of a short
    # prompt, so attention is dense in these tests)
    mla = dict(num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=32, qk_rope_head_dim=8,
               qk_nope_head_dim=8, v_head_dim=hd)
    indexer = dict(index_n_heads=2, index_head_dim=16, index_topk=16)
    granite_scales = dict(attention_multiplier=0.2, embedding_multiplier=2.0,
                          residual_multiplier=0.5, logits_scaling=4.0)
    more = {
        "glm4_moe": dict(intermediate_size=2 * inter, moe_intermediate_size=inter,
                         n_routed_experts=experts, num_experts_per_tok=top_k, n_shared_experts=1,
                         first_k_dense_replace=1, n_group=2, topk_group=2, head_dim=hd,
                         num_nextn_predict_layers=0, attention_bias=True),  # (GLM-4.5's q/k/v
        # biases)
        "ernie4_5_moe": dict(intermediate_size=2 * inter, moe_intermediate_size=inter,
                             moe_num_experts=experts, moe_k=top_k, moe_num_shared_experts=1,
                             moe_layer_start_index=1, moe_layer_end_index=L - 1,
                             moe_layer_interval=1),
        "hunyuan_v1_moe": dict(intermediate_size=inter, num_experts=experts, moe_topk=top_k,
                               head_dim=hd),
        "dots1": dict(intermediate_size=2 * inter, moe_intermediate_size=inter,
                      n_routed_experts=experts, num_experts_per_tok=top_k, n_shared_experts=1,
                      first_k_dense_replace=1, n_group=1, topk_group=1, max_window_layers=L,
                      layer_types=["full_attention"] * L),
        # (Granite's four multipliers away from 1, as the released models have them, so
        # that a lost one shows; Granite 4.0's shared expert)
        "granitemoe": dict(intermediate_size=inter, num_local_experts=experts,
                           num_experts_per_tok=top_k, **granite_scales),
        "qwen3_next": dict(intermediate_size=2 * inter, moe_intermediate_size=inter,
                           shared_expert_intermediate_size=inter, num_experts=experts,
                           num_experts_per_tok=top_k, head_dim=hd, linear_key_head_dim=16,
                           linear_value_head_dim=16, linear_num_key_heads=2,
                           linear_num_value_heads=4,
                           layer_types=alt("linear_attention", "full_attention")),
        "qwen3_5_moe_text": dict(moe_intermediate_size=inter,
                                 shared_expert_intermediate_size=inter, num_experts=experts,
                                 num_experts_per_tok=top_k, head_dim=hd, linear_key_head_dim=16,
                                 linear_value_head_dim=16, linear_num_key_heads=2,
                                 linear_num_value_heads=4,
                                 layer_types=alt("linear_attention", "full_attention"),
                                 # (multimodal rope sections that fit the 2 rotary pairs of a
                                 # head: llama.cpp asserts they do; Qwen3.5's are 11, 11, 10)
                                 rope_parameters=dict(rope_type="default", rope_theta=10000.0,
                                                      partial_rotary_factor=0.25,
                                                      mrope_section=[1, 1, 0],
                                                      mrope_interleaved=True)),
        "minimax": dict(intermediate_size=inter, num_local_experts=experts,
                        num_experts_per_tok=top_k, head_dim=hd, block_size=16,
                        layer_types=alt("linear_attention", "full_attention")),
        "flex_olmo": dict(intermediate_size=inter, num_experts=experts,
                          num_experts_per_tok=top_k),
        "lfm2_moe": dict(intermediate_size=2 * inter, moe_intermediate_size=inter,
                         num_experts=experts, num_experts_per_tok=top_k, num_dense_layers=1,
                         layer_types=alt("conv", "full_attention")),
        "jamba": dict(intermediate_size=inter, num_experts=experts, num_experts_per_tok=top_k,
                      expert_layer_period=2, expert_layer_offset=1, attn_layer_period=2,
                      attn_layer_offset=0, mamba_d_state=8, mamba_d_conv=4, mamba_expand=2,
                      mamba_dt_rank=8, use_mamba_kernels=False),
        # transformers 5.24's further MoE types (their first layer dense where the model has
        # dense layers, every kind of attention layer it has at least once)
        "afmoe": dict(intermediate_size=2 * inter, moe_intermediate_size=inter,
                      num_experts=experts, num_experts_per_tok=top_k, num_shared_experts=1,
                      head_dim=hd, sliding_window=64, mup_enabled=True,  # (as released)
                      layer_types=alt("sliding_attention", "full_attention")),
        "bailing_hybrid": dict(**mla, intermediate_size=2 * inter, moe_intermediate_size=inter,
                               num_experts=experts, num_experts_per_tok=top_k, n_group=1,
                               topk_group=1, num_shared_experts=1, first_k_dense_replace=1,
                               num_nextn_predict_layers=0, mlp_layer_types=dense_first,
                               linear_head_dim=16,
                               layer_types=alt("linear_attention", "full_attention")),
        "beam": dict(intermediate_size=2 * inter, moe_intermediate_size=inter,
                     num_experts=experts, num_experts_per_tok=top_k, n_group=1, topk_group=1,
                     head_dim=hd, sliding_window=64, mlp_layer_types=dense_first,
                     layer_types=alt("sliding_attention", "full_attention")),
        "cohere2_moe": dict(intermediate_size=2 * inter, num_experts=experts,
                            num_experts_per_tok=top_k, num_shared_experts=1, head_dim=hd,
                            sliding_window=64,
                            layer_types=alt("sliding_attention", "full_attention")),
        "deepseek_v32": dict(**mla, **indexer, intermediate_size=2 * inter,
                             moe_intermediate_size=inter, n_routed_experts=experts,
                             num_experts_per_tok=top_k, n_group=1, topk_group=1,
                             n_shared_experts=1, first_k_dense_replace=1,
                             mlp_layer_types=dense_first),
        "exaone_moe": dict(intermediate_size=2 * inter, moe_intermediate_size=inter,
                           num_experts=experts, num_experts_per_tok=top_k, n_group=1,
                           topk_group=1, num_shared_experts=1, first_k_dense_replace=1,
                           sliding_window=64, mlp_layer_types=dense_first,
                           layer_types=alt("sliding_attention", "full_attention")),
        "flint": dict(intermediate_size=inter, moe_intermediate_size=inter,
                      shared_expert_intermediate_size=inter, num_experts=experts,
                      num_experts_per_tok=top_k, head_dim=hd, sliding_window=64,
                      layer_types=alt("full_attention", "sliding_attention")),
        "glm4_moe_lite": dict(**mla, intermediate_size=2 * inter, moe_intermediate_size=inter,
                              n_routed_experts=experts, num_experts_per_tok=top_k, n_group=1,
                              topk_group=1, n_shared_experts=1, mlp_layer_types=dense_first),
        "glm_moe_dsa": dict(**mla, **indexer, intermediate_size=2 * inter,
                            moe_intermediate_size=inter, n_routed_experts=experts,
                            num_experts_per_tok=top_k, n_group=1, topk_group=1,
                            n_shared_experts=1, first_k_dense_replace=1,
                            mlp_layer_types=dense_first),
        "granitemoe_swa": dict(intermediate_size=inter, num_local_experts=experts,
                               num_experts_per_tok=top_k, sliding_window=64,
                               layer_types=alt("full_attention", "sliding_attention")),
        "granitemoehybrid": dict(intermediate_size=inter, num_local_experts=experts,
                                 num_experts_per_tok=top_k, shared_intermediate_size=inter,
                                 mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16,
                                 layer_types=alt("mamba", "attention"), **granite_scales),
        "granitemoeshared": dict(intermediate_size=inter, num_local_experts=experts,
                                 num_experts_per_tok=top_k, shared_intermediate_size=inter,
                                 **granite_scales),
        "hy_v3": dict(intermediate_size=2 * inter, moe_intermediate_size=inter,
                      num_experts=experts, num_experts_per_tok=top_k, num_shared_experts=1,
                      head_dim=hd, mlp_layer_types=dense_first),
        "kimi_linear": dict(**mla, intermediate_size=2 * inter, moe_intermediate_size=inter,
                            num_experts=experts, num_experts_per_tok=top_k, n_group=1,
                            topk_group=1, num_shared_experts=1, mlp_layer_types=dense_first,
                            linear_head_dim=16, linear_num_heads=4,
                            layer_types=alt("linear_attention", "full_attention")),
        "kolibri1": dict(moe_intermediate_size=inter, shared_expert_intermediate_size=inter,
                         num_experts=experts, num_experts_per_tok=top_k, head_dim=hd,
                         sliding_window=64,
                         layer_types=alt("sliding_attention", "full_attention")),
        "laguna": dict(intermediate_size=2 * inter, moe_intermediate_size=inter,
                       shared_expert_intermediate_size=inter, num_experts=experts,
                       num_experts_per_tok=top_k, head_dim=hd, mlp_layer_types=dense_first,
                       num_attention_heads_per_layer=[4] * L),
        "lara_mini": dict(moe_intermediate_size=inter, shared_expert_intermediate_size=inter,
                          num_experts=experts, num_experts_per_tok=top_k, head_dim=hd,
                          sliding_window=64, linear_key_head_dim=16, linear_value_head_dim=16,
                          linear_num_key_heads=2, linear_num_value_heads=4,
                          layer_types=alt("linear_attention", "sliding_attention",
                                          "full_attention")),
        "mellum": dict(intermediate_size=2 * inter, moe_intermediate_size=inter,
                       num_experts=experts, num_experts_per_tok=top_k, head_dim=hd,
                       num_nextn_predict_layers=0),
        "mimo_v2_flash": dict(intermediate_size=2 * inter, moe_intermediate_size=inter,
                              n_routed_experts=experts, num_experts_per_tok=top_k, n_group=1,
                              topk_group=1, head_dim=hd, v_head_dim=hd, sliding_window=64,
                              mlp_layer_types=dense_first,
                              layer_types=alt("full_attention", "sliding_attention")),
        "minimax_m2": dict(intermediate_size=inter, num_local_experts=experts,
                           num_experts_per_tok=top_k, head_dim=hd,
                           rope_parameters={"rope_type": "default", "rope_theta": 5e6,
                                            "partial_rotary_factor": 0.5}),  # (as released)
        "sarvam_mla": dict(**mla, intermediate_size=2 * inter, moe_intermediate_size=inter,
                           num_experts=experts, num_experts_per_tok=top_k, n_group=1,
                           topk_group=1, num_shared_experts=1, first_k_dense_replace=1,
                           num_nextn_predict_layers=0),
        "sarvam_moe": dict(intermediate_size=2 * inter, moe_intermediate_size=inter,
                           num_experts=experts, num_experts_per_tok=top_k, n_group=1,
                           topk_group=1, num_shared_experts=1, first_k_dense_replace=1,
                           head_dim=hd, num_nextn_predict_layers=0),
        "solar_open": dict(moe_intermediate_size=inter, n_routed_experts=experts,
                           num_experts_per_tok=top_k, n_group=1, topk_group=1,
                           n_shared_experts=1, head_dim=hd),
        "axk2": dict(**mla, **indexer, intermediate_size=2 * inter, moe_intermediate_size=inter,
                     n_routed_experts=experts, num_experts_per_tok=top_k, n_group=1,
                     topk_group=1, n_shared_experts=1, mlp_layer_types=dense_first),
    }
    if arch in more:
        from transformers import CONFIG_MAPPING
        return CONFIG_MAPPING[arch](**{**common, **more[arch]})
    raise UnsupportedModelError(f"no tiny config for {arch!r}; supported: {sorted(SUPPORTED)}")


def tiny_model(arch: str, seed: int = 0, dtype: torch.dtype = torch.float32,
               router_std: float = 1.0, overrides: dict | None = None, **kw) -> nn.Module:
    """A randomly initialised eval-mode model from :func:`tiny_config`, eager experts, with its
    routers re-initialised at ``router_std`` so routing is far from uniform.  overrides: config
    attributes set after tiny_config (e.g. ``num_key_value_heads``)."""
    import logging

    from transformers import AutoModelForCausalLM
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(seed)
    cfg = tiny_config(arch, **kw)
    for name, value in (overrides or {}).items():
        setattr(cfg, name, value)
    model = AutoModelForCausalLM.from_config(cfg, experts_implementation="eager", dtype=dtype)
    info, ids = describe(model)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for i in ids:
            mlp = moe_block(model, info, i)
            r = getpath(mlp, info.router_attr)
            r.weight.copy_(torch.randn(r.weight.shape, generator=g) * router_std
                           / math.sqrt(r.weight.shape[1]) * 4)
            if getattr(r, "bias", None) is not None:
                r.bias.copy_(torch.randn(r.bias.shape, generator=g) * 0.5)
            corr = getpath(mlp, info.bias_attr) if info.bias_attr else None
            if isinstance(corr, torch.Tensor):  # (DeepSeek-V3's correction bias: zero at
                # initialisation, where a reader that lost it would go unnoticed)
                corr.copy_(torch.randn(corr.shape, generator=g) * 0.1)
            ex = mlp.experts
            for name, p in ex.named_parameters():
                if "bias" in name:
                    p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model.eval()


def save_checkpoint(model: nn.Module, folder: str | Path, *, layout: str = "per_expert",
                    max_shard_size: str | int = "5GB", tokenizer=None) -> Path:
    """Write ``model`` as a checkpoint folder (config.json, safetensors shards).

    layout ``"per_expert"``: transformers' own ``save_pretrained``, which writes the experts
    the way the original checkpoints store them (one tensor per expert and projection);
    ``"fused"``: the model's state dict as it is in memory (transformers 5's fused
    ``gate_up_proj``/``down_proj``), one shard.  ``tokenizer``: saved beside it if given."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if layout == "per_expert":
        model.save_pretrained(folder, max_shard_size=max_shard_size)
    elif layout == "fused":
        from safetensors.torch import save_file
        model.config.save_pretrained(folder)
        sd = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
        if getattr(model.config, "tie_word_embeddings", False):
            sd.pop("lm_head.weight", None)
        save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})
    else:
        raise ValueError(f"layout must be 'per_expert' or 'fused', got {layout!r}")
    if tokenizer is not None:
        tokenizer.save_pretrained(folder)
    return folder


def gguf_metadata(w: Any, cfg: Any) -> None:
    """Write transformers config ``cfg``'s architecture keys into GGUF writer ``w`` (created
    for the llama.cpp architecture of ``cfg.model_type``), as llama.cpp's converter names
    them.  Shared by :func:`save_gguf` and the benchmarks that stream a GGUF file."""
    import gguf

    from ..storage.gguf import gguf_arch
    arch = gguf_arch(cfg.model_type)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_head_count(cfg.num_attention_heads)
    if arch in ("granitehybrid", "lfm2moe"):  # per layer, 0 on the Mamba / conv layers
        w.add_head_count_kv([cfg.num_key_value_heads if t == "full_attention" else 0
                             for t in cfg.layer_types])
    else:
        w.add_head_count_kv(1 if arch == "deepseek2" else cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(getattr(cfg, "rms_norm_eps", None) or cfg.norm_eps)  # (LFM2's
    # name)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_vocab_size(cfg.vocab_size)
    E = (getattr(cfg, "num_local_experts", None) or getattr(cfg, "n_routed_experts", None)
         or cfg.num_experts)
    w.add_expert_count(E)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if arch == "deepseek2":  # the keys llama.cpp's DeepseekV2Model writes
        rope, nope, v = cfg.qk_rope_head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_leading_dense_block_count(cfg.first_k_dense_replace)
        w.add_expert_shared_count(cfg.n_shared_experts)
        w.add_expert_weights_scale(float(cfg.routed_scaling_factor))
        if cfg.norm_topk_prob:
            w.add_expert_weights_norm(True)
        if cfg.model_type == "deepseek_v3":  # sigmoid routing in expert groups
            w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
            w.add_expert_group_count(cfg.n_group)
            w.add_expert_group_used_count(cfg.topk_group)
        w.add_q_lora_rank(cfg.q_lora_rank or 0)
        w.add_kv_lora_rank(cfg.kv_lora_rank)
        w.add_key_length(cfg.kv_lora_rank + rope)
        w.add_value_length(cfg.kv_lora_rank)
        w.add_key_length_mla(nope + rope)
        w.add_value_length_mla(v)
        w.add_rope_dimension_count(rope)
    elif cfg.model_type in ("glm4_moe", "dots1"):  # llama.cpp's Glm4MoeModel / Dots1Model
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_shared_count(cfg.n_shared_experts)
        w.add_leading_dense_block_count(cfg.first_k_dense_replace)
        w.add_expert_group_count(cfg.n_group)
        w.add_expert_group_used_count(cfg.topk_group)
        w.add_expert_weights_scale(float(cfg.routed_scaling_factor))
        w.add_expert_weights_norm(bool(cfg.norm_topk_prob))
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)  # (dots.llm1's config
        # says scoring_func "sigmoid"; llama.cpp's dots1 needs the key)
        if cfg.model_type == "glm4_moe":
            w.add_rope_dimension_count(int(
                cfg.head_dim * cfg.rope_parameters.get("partial_rotary_factor", 1.0)))
    elif cfg.model_type == "minimax_m2":  # the keys llama.cpp's MiniMaxM2Model writes
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_expert_feed_forward_length(cfg.intermediate_size)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_rope_dimension_count(int(cfg.head_dim
                                       * cfg.rope_parameters.get("partial_rotary_factor", 1.0)))
    elif cfg.model_type == "ernie4_5_moe":  # the keys llama.cpp's Ernie4_5MoeModel writes
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_interleave_moe_layer_step(cfg.moe_layer_interval)
        w.add_leading_dense_block_count(cfg.moe_layer_start_index)
        w.add_expert_shared_count(cfg.moe_num_shared_experts)
        w.add_expert_shared_feed_forward_length(cfg.moe_intermediate_size
                                                * cfg.moe_num_shared_experts)
    elif cfg.model_type in ("granitemoe", "granitemoeshared", "granitemoehybrid"):
        # llama.cpp's GraniteMoeModel (and GraniteHybridModel: its Mamba-2 keys, NoPE)
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
        w.add_attention_scale(cfg.attention_multiplier)
        w.add_embedding_scale(cfg.embedding_multiplier)
        w.add_residual_scale(cfg.residual_multiplier)
        w.add_logit_scale(cfg.logits_scaling)
        if getattr(cfg, "shared_intermediate_size", 0):
            w.add_expert_shared_feed_forward_length(cfg.shared_intermediate_size)
        if cfg.model_type == "granitemoehybrid":
            w.add_ssm_conv_kernel(cfg.mamba_d_conv)
            w.add_ssm_state_size(cfg.mamba_d_state)
            w.add_ssm_group_count(cfg.mamba_n_groups)
            w.add_ssm_inner_size(cfg.mamba_expand * cfg.hidden_size)
            w.add_ssm_time_step_rank(cfg.mamba_n_heads)
            w.add_rope_scaling_finetuned(cfg.position_embedding_type == "rope")
    elif cfg.model_type == "lfm2_moe":  # the keys llama.cpp's LFM2MoeModel writes
        if not cfg.tie_word_embeddings:
            raise ValueError("save_gguf: llama.cpp's lfm2moe has no output matrix of its own "
                             "(tie_word_embeddings)")
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_leading_dense_block_count(cfg.num_dense_layers)
        w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
        w.add_shortconv_l_cache(cfg.conv_L_cache)
    elif cfg.model_type == "afmoe":  # the keys llama.cpp's AfmoeModel writes
        if not cfg.mup_enabled:
            raise ValueError("save_gguf: llama.cpp's afmoe always scales the embeddings "
                             "(muP); a model with mup_enabled False has no GGUF form")
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_rope_dimension_count(cfg.head_dim)
        w.add_expert_shared_count(cfg.num_shared_experts)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_leading_dense_block_count(cfg.num_dense_layers)
        w.add_expert_weights_norm(True)
        w.add_expert_weights_scale(float(cfg.route_scale))
        w.add_sliding_window(cfg.sliding_window)
        # (the converter leaves the pattern to llama.cpp's default, 3 of every 4 layers;
        # written here so that any pattern is read back)
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg.layer_types])
    elif cfg.model_type in ("qwen3_next", "qwen3_5_moe_text"):  # llama.cpp's Qwen3NextModel
        if cfg.model_type == "qwen3_next":
            w.add_feed_forward_length(cfg.intermediate_size)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
        nv = cfg.linear_num_value_heads
        w.add_ssm_conv_kernel(cfg.linear_conv_kernel_dim)
        w.add_ssm_state_size(cfg.linear_key_head_dim)
        w.add_ssm_group_count(cfg.linear_num_key_heads)
        w.add_ssm_time_step_rank(nv)
        w.add_ssm_inner_size(cfg.linear_value_head_dim * nv)
        w.add_array(f"{arch}.attention.recurrent_layers",
                    [t == "linear_attention" for t in cfg.layer_types])
        w.add_full_attention_interval(getattr(cfg, "full_attention_interval", 4))
        w.add_rope_dimension_count(int(cfg.head_dim
                                       * cfg.rope_parameters.get("partial_rotary_factor", 1.0)))
        if cfg.model_type == "qwen3_5_moe_text":  # (the converter's default sections)
            w.add_rope_dimension_sections(
                list(cfg.rope_parameters.get("mrope_section", [11, 11, 10])) + [0])
    elif cfg.model_type in ("qwen2_moe", "qwen3_moe"):
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
        w.add_expert_weights_norm(bool(cfg.norm_topk_prob))
    elif cfg.model_type == "gpt_oss":  # the keys llama.cpp's GptOssModel writes
        w.add_feed_forward_length(cfg.intermediate_size)
        w.add_expert_feed_forward_length(cfg.intermediate_size)
        w.add_sliding_window(cfg.sliding_window)
        rp = cfg.rope_parameters
        if rp.get("rope_type") == "yarn":
            w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
            w.add_rope_scaling_factor(float(rp["factor"]))
            w.add_rope_scaling_orig_ctx_len(int(rp.get("original_max_position_embeddings",
                                                       4096)))
    else:
        w.add_feed_forward_length(cfg.intermediate_size)
    if cfg.model_type == "qwen2_moe":
        w.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    hd = getattr(cfg, "head_dim", None)
    if hd and arch != "deepseek2":
        w.add_key_length(hd)
        w.add_value_length(hd)
    for tid, fn in ((cfg.bos_token_id, w.add_bos_token_id),
                    (cfg.eos_token_id, w.add_eos_token_id),
                    (cfg.pad_token_id, w.add_pad_token_id)):
        if isinstance(tid, int):
            fn(tid)


# the RMSNorms of Qwen3-Next and Qwen3.5 that scale by (1 + w): llama.cpp's converter writes
# w + 1 (the gated DeltaNet's own norm, which scales by w, is written as it is)
_PLUS_ONE_NORMS = ("input_layernorm.weight", "post_attention_layernorm.weight",
                   "self_attn.q_norm.weight", "self_attn.k_norm.weight", "model.norm.weight")


def _tile_perm(nk: int, r: int, d: int) -> Any:
    """The order llama.cpp's Qwen3.5 converter writes ``nk * r`` value heads of ``d`` entries
    in: entry j of the file is entry ``perm[j]`` of transformers' (grouped by key head ->
    tiled: head 0 of every group, then head 1, ...)."""
    import numpy as np
    return np.arange(nk * r * d).reshape(nk, r, d).transpose(1, 0, 2).reshape(-1)


def _gated_delta_gguf(put: Any, blk: str, part: str, a: Any, cfg: Any, arch: str) -> Any:
    """Write transformers tensor ``linear_attn.<part>`` of a Qwen3-Next / Qwen3.5 layer as
    llama.cpp's converter does (``put(gguf_name, array) -> what the file holds, dequantized``)
    and return what the file holds in transformers' form."""
    import numpy as np
    nk, nv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
    dk, dv, r = cfg.linear_key_head_dim, cfg.linear_value_head_dim, nv // nk
    tiled = arch == "qwen35moe" and nk != nv  # (the converter reorders only there)
    pv = _tile_perm(nk, r, dv) if tiled else np.arange(nv * dv)
    p1 = _tile_perm(nk, r, 1) if tiled else np.arange(nv)
    qkv = np.concatenate([np.arange(2 * nk * dk), 2 * nk * dk + pv])  # v rows after q, k
    pre = f"blk.{blk}."

    def rows(name: str, x: Any, perm: Any) -> Any:
        return put(pre + name, x[perm])[np.argsort(perm)]

    if part == "A_log":  # held as A = -exp(A_log)
        return np.log(-put(pre + "ssm_a", -np.exp(a[p1])))[np.argsort(p1)]
    if part == "dt_bias":
        return rows("ssm_dt.bias", a, p1)
    if part == "conv1d.weight":  # [C, 1, K] squeezed
        return rows("ssm_conv1d.weight", a[:, 0, :], qkv)[:, None, :]
    if part == "norm.weight":
        return put(pre + "ssm_norm.weight", a)
    if part == "out_proj.weight":  # the value heads are its columns
        return put(pre + "ssm_out.weight", a[:, pv])[:, np.argsort(pv)]
    if part == "in_proj_ba.weight":
        return put(pre + "ssm_ba.weight", a)
    if part in ("in_proj_a.weight", "in_proj_b.weight"):
        return rows("ssm_alpha.weight" if part == "in_proj_a.weight" else "ssm_beta.weight",
                    a, p1)
    if part == "in_proj_z.weight":
        return rows("attn_gate.weight", a, pv)
    if part == "in_proj_qkv.weight":
        return rows("attn_qkv.weight", a, qkv)
    if part == "in_proj_qkvz.weight":  # per key head q, k, v, z rows -> attn_qkv (all q,
        # all k, all v) and attn_gate (z)
        H = a.shape[1]
        g = a.reshape(nk, -1, H)
        cut = np.cumsum([dk, dk, r * dv])
        q, k, v, z = np.split(g, cut, axis=1)
        sq = put(pre + "attn_qkv.weight",
                 np.concatenate([x.reshape(-1, H) for x in (q, k, v)]))
        sz = put(pre + "attn_gate.weight", z.reshape(-1, H))
        q2, k2, v2 = np.split(sq, [nk * dk, 2 * nk * dk])
        return np.concatenate([q2.reshape(nk, dk, H), k2.reshape(nk, dk, H),
                               v2.reshape(nk, r * dv, H), sz.reshape(nk, r * dv, H)],
                              axis=1).reshape(a.shape)
    raise ValueError(f"save_gguf: no GGUF name for linear_attn.{part}")


def gguf_tokenizer(w: Any, tokenizer: Any, n_vocab: int | None = None) -> None:
    """Write byte-level BPE fast ``tokenizer`` into GGUF writer ``w`` as llama.cpp's ``gpt2``
    tokenizer model (tokens, types, merges).  ``n_vocab`` larger than the tokenizer pads the
    list with ``[PAD<id>]`` tokens of type UNUSED, as llama.cpp's converter pads a vocabulary
    smaller than the embedding."""
    import json

    import gguf
    tj = json.loads(tokenizer.backend_tokenizer.to_str())
    vocab = tj["model"]["vocab"]
    for a in tj.get("added_tokens", []):
        vocab.setdefault(a["content"], a["id"])
    n = max(len(vocab), n_vocab or 0, max(vocab.values()) + 1)
    tokens = [f"[PAD{i}]" for i in range(n)]
    real = set(vocab.values())
    for t, i in vocab.items():
        tokens[i] = t
    special = {a["id"] for a in tj.get("added_tokens", []) if a.get("special")}
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL if i in special else
                       gguf.TokenType.NORMAL if i in real else gguf.TokenType.UNUSED
                       for i in range(n)])
    w.add_token_merges([m if isinstance(m, str) else " ".join(m)
                        for m in tj["model"]["merges"]])
    if getattr(tokenizer, "chat_template", None):  # as llama.cpp's converter carries it
        w.add_chat_template(tokenizer.chat_template)


def save_gguf(model: nn.Module, path: str | Path, *, qtype: str = "F32",
              tokenizer=None, expert_qtype: Any = None,
              fuse_gate_up: bool = False) -> tuple[Path, dict[str, torch.Tensor]]:
    """Write ``model`` (mixtral, qwen2_moe, qwen3_moe, olmoe, deepseek_v2, deepseek_v3,
    glm4_moe, minimax_m2, dots1, gpt_oss, qwen3_next, qwen3_5_moe_text, ernie4_5_moe,
    granitemoe, granitemoeshared, granitemoehybrid, afmoe or lfm2_moe) as a GGUF file the
    way llama.cpp's converter does (architecture names and metadata keys, stacked experts
    ``blk.N.ffn_{gate,up,down}_exps``, the ``llama`` architecture's permuted q/k rows,
    Qwen3-Next's and Qwen3.5's transformed norms and linear-attention tensors), its
    2-D weights in GGUF type ``qtype`` (``F32``, ``F16``, ``Q8_0``, ``Q4_0``, ... any type the
    ``gguf`` package quantizes; routers, norms and biases stay F32, as llama-quantize keeps
    them).  ``tokenizer``: a byte-level BPE fast tokenizer written into the metadata as
    llama.cpp's ``gpt2`` tokenizer model (tokens, types, merges).  Returns the path and the
    state dict as the file holds it (each quantized tensor dequantized by the ``gguf``
    package): the reference the same weights give.  ``qtype`` may also be ``Q2_K``, ``Q3_K``,
    ``Q4_K``, ``Q5_K``, ``Q6_K`` or ``IQ4_XS`` (written by
    :mod:`specmoe.storage.ggml_blocks`' quantizers; the ``gguf`` package has none); a matrix whose columns are not a multiple of 256 then falls back to Q8_0, as
    llama-quantize falls back.  ``expert_qtype``: the routed experts' type instead of
    ``qtype``, a name or ``f(layer, "gate" | "up" | "down") -> name`` (a Q4_K_M-like mix).
    ``fuse_gate_up``: gate and up as one stacked ``ffn_gate_up_exps`` tensor (gate rows, then
    up rows; its bias likewise), as newer converters may write them."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize, quantize

    from ..storage.gguf import PERMUTED_QK, gguf_arch, gguf_name

    cfg = model.config
    arch = gguf_arch(cfg.model_type)
    qt = gguf.GGMLQuantizationType[qtype]
    path = Path(path)
    w = gguf.GGUFWriter(str(path), arch)
    gguf_metadata(w, cfg)

    def roundtrip(a: np.ndarray, quantized: bool,
                  t: Any) -> tuple[np.ndarray, np.ndarray]:
        """(what the file stores, what it dequantizes to) for f32 array ``a`` in type t."""
        a = np.ascontiguousarray(a, dtype=np.float32)
        if not quantized:
            return a, a
        if t.name in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"):
            from ..storage import ggml_blocks
            fn = ggml_blocks.QUANTIZERS[t.name.lower()]
            q = fn(a.reshape(-1, a.shape[-1])).reshape(a.shape[:-1] + (-1,))
        else:
            q = quantize(a, t)
        return q, dequantize(q, t).reshape(a.shape).astype(np.float32)

    def put(gname: str, a: np.ndarray, tname: str | None = None) -> np.ndarray:
        t = gguf.GGMLQuantizationType[tname] if tname else qt
        if t.name in ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS") and a.shape[-1] % 256:
            t = gguf.GGMLQuantizationType.Q8_0  # llama-quantize's fallback for such rows
        # llama-quantize keeps 1-D tensors and the router (ffn_gate_inp) in F32, and the
        # converter every tensor whose name does not end in .weight (ERNIE-4.5's [1, E]
        # exp_probs_b.bias: quantized, llama.cpp's add refuses it); rows not a whole number
        # of blocks stay F32 too, as llama-quantize falls back
        quantized = not (a.ndim == 1 or "ffn_gate_inp" in gname or a.shape[-1] % 32
                         or not gname.endswith(".weight")
                         or t == gguf.GGMLQuantizationType.F32)
        stored, back = roundtrip(a, quantized, t)
        if quantized:
            w.add_tensor(gname, stored, raw_dtype=t)
        else:
            w.add_tensor(gname, stored)
        return back

    def etype(layer: str, role: str) -> str | None:
        if expert_qtype is None or isinstance(expert_qtype, str):
            return expert_qtype
        return expert_qtype(int(layer), role)

    if tokenizer is not None:
        gguf_tokenizer(w, tokenizer)

    held: dict[str, torch.Tensor] = {}
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    if getattr(cfg, "tie_word_embeddings", False):
        sd.pop("lm_head.weight", None)
    for name, a in sd.items():
        blk = name.split(".")[2] if name.startswith("model.layers.") else None
        if arch == "gpt-oss" and ".mlp.experts." in name:
            # transformers' [E, H, 2I] (gate / up interleaved), [E, 2I], [E, I, H], [E, H]
            # -> llama.cpp's ffn_{gate,up}_exps [E, I, H] and biases [E, I], ffn_down_exps
            # [E, H, I] (its GptOssModel's split); biases stay F32
            pre = f"blk.{blk}."
            back = np.empty_like(a)
            if name.endswith("gate_up_proj"):
                g, u = a[:, :, 0::2].transpose(0, 2, 1), a[:, :, 1::2].transpose(0, 2, 1)
                if fuse_gate_up:
                    g, u = np.split(put(pre + "ffn_gate_up_exps.weight",
                                        np.concatenate([g, u], axis=1), etype(blk, "gate")),
                                    2, axis=1)
                else:
                    g = put(pre + "ffn_gate_exps.weight", g, etype(blk, "gate"))
                    u = put(pre + "ffn_up_exps.weight", u, etype(blk, "up"))
                back[:, :, 0::2], back[:, :, 1::2] = g.transpose(0, 2, 1), u.transpose(0, 2, 1)
            elif name.endswith("gate_up_proj_bias"):
                if fuse_gate_up:
                    back[:, 0::2], back[:, 1::2] = np.split(put(
                        pre + "ffn_gate_up_exps.bias",
                        np.concatenate([a[:, 0::2], a[:, 1::2]], axis=1), "F32"), 2, axis=1)
                else:
                    back[:, 0::2] = put(pre + "ffn_gate_exps.bias", a[:, 0::2], "F32")
                    back[:, 1::2] = put(pre + "ffn_up_exps.bias", a[:, 1::2], "F32")
            elif name.endswith("down_proj"):
                back = put(pre + "ffn_down_exps.weight", a.transpose(0, 2, 1),
                           etype(blk, "down")).transpose(0, 2, 1)
            else:  # down_proj_bias
                back = put(pre + "ffn_down_exps.bias", a, "F32")
            held[name] = torch.from_numpy(np.ascontiguousarray(back))
        elif name.endswith(".experts.gate_up_proj") and fuse_gate_up:
            held[name] = torch.from_numpy(put(f"blk.{blk}.ffn_gate_up_exps.weight", a,
                                              etype(blk, "gate")))
        elif name.endswith(".experts.gate_up_proj"):
            I = a.shape[1] // 2
            held[name] = torch.from_numpy(np.concatenate(
                [put(f"blk.{blk}.ffn_gate_exps.weight", a[:, :I], etype(blk, "gate")),
                 put(f"blk.{blk}.ffn_up_exps.weight", a[:, I:], etype(blk, "up"))], axis=1))
        elif name.endswith(".experts.down_proj"):
            held[name] = torch.from_numpy(put(f"blk.{blk}.ffn_down_exps.weight", a,
                                              etype(blk, "down")))
        elif arch == "deepseek2" and name.endswith("kv_b_proj.weight"):
            h, nope, v = cfg.num_attention_heads, cfg.qk_nope_head_dim, cfg.v_head_dim
            kv = a.reshape(h, nope + v, a.shape[1])
            kb = put(f"blk.{blk}.attn_k_b.weight", kv[:, :nope].transpose(0, 2, 1))
            vb = put(f"blk.{blk}.attn_v_b.weight", kv[:, nope:])
            held[name] = torch.from_numpy(
                np.concatenate([kb.transpose(0, 2, 1), vb], axis=1).reshape(a.shape).copy())
        elif arch == "lfm2moe" and name.endswith(".conv.conv.weight"):  # [C, 1, K] squeezed
            held[name] = torch.from_numpy(np.ascontiguousarray(
                put(gguf_name(name, arch), a[:, 0, :])[:, None, :]))
        elif arch == "granitehybrid" and name.endswith((".mamba.A_log", ".mamba.D",
                                                         ".mamba.conv1d.weight",
                                                         ".mamba.norm.weight")):
            pre, part = f"blk.{blk}.", name.split(".mamba.", 1)[1]
            if part == "A_log":  # held as A = -exp(A_log), [heads, 1]
                back = np.log(-put(pre + "ssm_a", -np.exp(a)[:, None])).reshape(-1)
            elif part == "D":
                back = put(pre + "ssm_d", a[:, None]).reshape(-1)
            elif part == "conv1d.weight":  # [C, 1, K] squeezed
                back = put(pre + "ssm_conv1d.weight", a[:, 0, :])[:, None, :]
            else:  # the gated norm per group (a norm: F32, as llama-quantize keeps it)
                back = put(pre + "ssm_norm.weight", a.reshape(cfg.mamba_n_groups, -1),
                           "F32").reshape(-1)
            held[name] = torch.from_numpy(np.ascontiguousarray(back))
        elif arch in ("granitemoe", "granitehybrid") and name.endswith(
                "shared_mlp.input_linear.weight"):
            I = a.shape[0] // 2  # Granite's shared expert: gate rows, then up rows
            held[name] = torch.from_numpy(np.concatenate(
                [put(f"blk.{blk}.ffn_gate_shexp.weight", a[:I]),
                 put(f"blk.{blk}.ffn_up_shexp.weight", a[I:])]))
        elif arch in ("qwen3next", "qwen35moe") and ".linear_attn." in name:
            held[name] = torch.from_numpy(np.ascontiguousarray(_gated_delta_gguf(
                put, blk, name.split(".linear_attn.", 1)[1], a, cfg, arch)))
        elif arch in ("qwen3next", "qwen35moe") and name.endswith(_PLUS_ONE_NORMS):
            held[name] = torch.from_numpy(put(gguf_name(name, arch), a + 1) - 1)
        elif (g := gguf_name(name, arch)) is None:
            raise ValueError(f"save_gguf: no GGUF name for {name}")
        elif arch in PERMUTED_QK and name.endswith(("q_proj.weight", "k_proj.weight")):
            n = cfg.num_attention_heads if "q_proj" in name else cfg.num_key_value_heads
            r, c = a.shape
            # llama.cpp's converter: each head's rows from (pair, half) to (half, pair) order
            back = put(g, a.reshape(n, 2, r // n // 2, c).swapaxes(1, 2).reshape(r, c))
            held[name] = torch.from_numpy(
                back.reshape(n, r // n // 2, 2, c).swapaxes(1, 2).reshape(r, c).copy())
        else:
            held[name] = torch.from_numpy(put(g, a))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path, held


def save_fp8_checkpoint(model: nn.Module, folder: str | Path, *, block: int = 128,
                        ) -> tuple[Path, dict[str, torch.Tensor]]:
    """Write ``model`` as an FP8 checkpoint folder in the layout of DeepSeek-V3's and Qwen3's
    FP8 releases: every linear weight but the embedding, the output matrix and the routers in
    ``float8_e4m3fn`` with an f32 ``weight_scale_inv`` per ``block`` x ``block`` tile (w =
    e4m3 * scale, scale = the tile's max |w| / 448), the experts one tensor per expert and
    projection, ``quantization_config`` {quant_method: fp8, weight_block_size} in config.json.
    Returns the folder and the state dict (transformers' names) of the weights the file holds,
    dequantized: the reference."""
    import json

    folder = Path(folder)
    save_checkpoint(model, folder, layout="per_expert")
    shards = sorted(folder.glob("*.safetensors"))

    def fp8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        r, c = w.shape
        nr, nc = -(-r // block), -(-c // block)
        pad = torch.zeros(nr * block, nc * block)
        pad[:r, :c] = w.float()
        tiles = pad.reshape(nr, block, nc, block)
        s = tiles.abs().amax(dim=(1, 3)) / 448.0
        s = torch.where(s > 0, s, torch.ones_like(s))
        q = (tiles / s[:, None, :, None]).reshape(nr * block, nc * block)[:r, :c]
        q = q.to(torch.float8_e4m3fn)
        full = s.repeat_interleave(block, 0)[:r].repeat_interleave(block, 1)[:, :c]
        return q, s.float(), q.float() * full

    def put(k: str, v: torch.Tensor) -> dict[str, torch.Tensor]:
        q, s, _ = fp8(v)
        return {k: q, k[:-len("weight")] + "weight_scale_inv": s}

    _rewrite_linear_weights(shards, put)
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3",
                                  "activation_scheme": "dynamic",
                                  "weight_block_size": [block, block]}
    cfg_path.write_text(json.dumps(cfg, indent=2))
    # the reference: the model's own state dict with each quantized weight as the file holds it
    held: dict[str, torch.Tensor] = {}
    for k, v in model.state_dict().items():
        if k.endswith("mlp.experts.gate_up_proj") or k.endswith("mlp.experts.down_proj"):
            held[k] = torch.stack([fp8(v[e])[2] for e in range(v.shape[0])])
        elif _quantized_linear(k, v):
            held[k] = fp8(v)[2]
    return folder, held


def _quantized_linear(k: str, v: torch.Tensor) -> bool:
    """The weights FP8/GPTQ releases quantize: 2-D linear weights but the embedding, the
    output matrix, the routers and the norms."""
    return (v.ndim == 2 and k.endswith(".weight") and "embed_tokens" not in k
            and not k.startswith("lm_head") and not k.endswith((".gate.weight", "_gate.weight"))
            and "norm" not in k)  # (routers: mlp.gate, Mixtral's block_sparse_moe.gate)


def _rewrite_linear_weights(shards: list[Path], put: Any) -> None:
    """Rewrite each safetensors shard with every quantized linear weight ``k``
    (:func:`_quantized_linear`) replaced by the tensors ``put(k, weight)`` returns."""
    from safetensors.torch import load_file, save_file

    for sh in shards:
        out: dict[str, torch.Tensor] = {}
        for k, v in load_file(str(sh)).items():
            if _quantized_linear(k, v):
                out.update(put(k, v))
            else:
                out[k] = v
        save_file(out, str(sh), metadata={"format": "pt"})


def save_gptq_checkpoint(model: nn.Module, folder: str | Path, *, group: int = 32,
                         act_order: bool = False, sym: bool = True, seed: int = 0,
                         ) -> tuple[Path, dict[str, torch.Tensor]]:
    """Write ``model`` as a 4-bit GPTQ checkpoint in AutoGPTQ's ``gptq`` format
    (round-to-nearest, not GPTQ's error feedback: the layout is what is tested): per linear
    weight [out, in] ``qweight`` int32 [in/8, out] (value j of eight at bits 4j), ``qzeros``
    int32 [groups, out/8] holding zero - 1 (symmetric: 7), ``scales`` f16 [groups, out],
    ``g_idx`` [in] (``act_order``: the columns' groups follow a random permutation, as
    desc_act makes them).  ``sym=False``: per group min/max, zero points in [0, 15].
    Returns the folder and the dequantized weights (transformers' names): the reference."""
    gen = torch.Generator().manual_seed(seed)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)

    def gptq(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        out_f, in_f = w.shape
        order = torch.randperm(in_f, generator=gen) if act_order else torch.arange(in_f)
        g_idx = torch.empty(in_f, dtype=torch.int32)
        g_idx[order] = (torch.arange(in_f) // group).to(torch.int32)
        # zero >= 1: the gptq format stores zero - 1 in four bits
        q, zero, scales = _int4_groups(w.float().t(), g_idx.long(), in_f // group, sym, zmin=1)
        deq = ((q - zero[g_idx.long()]).float() * scales.float()[g_idx.long()]).t().contiguous()
        qweight = (q.reshape(in_f // 8, 8, out_f) << shifts[:, None]).sum(1, dtype=torch.int32)
        zm1 = (zero - 1).reshape(zero.shape[0], out_f // 8, 8)  # the gptq format's zero - 1
        qzeros = (zm1 << shifts).sum(-1, dtype=torch.int32)
        return {"qweight": qweight, "qzeros": qzeros, "scales": scales, "g_idx": g_idx}, deq

    return _save_packed_int4(model, folder, gptq, {
        "quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": act_order,
        "sym": sym, "checkpoint_format": "gptq"})


def save_awq_checkpoint(model: nn.Module, folder: str | Path, *, group: int = 32,
                        ) -> tuple[Path, dict[str, torch.Tensor]]:
    """Write ``model`` as a 4-bit AWQ checkpoint in AutoAWQ's ``gemm`` layout (round-to-nearest
    per group with min/max zero points, not AWQ's activation-aware scaling: the layout is
    what is tested): per linear weight [out, in] ``qweight`` int32 [in, out/8] and ``qzeros``
    int32 [in/group, out/8] (eight values along the output, bits 4i holding column
    (0, 2, 4, 6, 1, 3, 5, 7)[i] of the eight), ``scales`` f16 [in/group, out].  Returns the
    folder and the dequantized weights (transformers' names): the reference."""
    order = (0, 2, 4, 6, 1, 3, 5, 7)
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)

    def pack_out(t: torch.Tensor) -> torch.Tensor:  # [rows, out] in [0, 15] -> [rows, out/8]
        v = t.reshape(t.shape[0], -1, 8)[:, :, list(order)]
        return (v << shifts).sum(-1, dtype=torch.int32)

    def awq(w: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
        out_f, in_f = w.shape
        g = torch.arange(in_f) // group
        q, zero, scales = _int4_groups(w.float().t(), g, in_f // group, False)
        deq = ((q - zero[g]).float() * scales.float()[g]).t().contiguous()
        return {"qweight": pack_out(q), "qzeros": pack_out(zero), "scales": scales}, deq

    return _save_packed_int4(model, folder, awq, {
        "quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
        "version": "gemm"})


def _int4_groups(wt: torch.Tensor, g: torch.Tensor, ng: int, sym: bool, zmin: int = 0,
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest 4-bit groups of ``wt`` [in, out] (input column k in group g[k]):
    (q int32 [in, out] in [0, 15], zero int32 [ng, out], scales f16 [ng, out]); symmetric:
    zero 8 and scale max|w| / 7, else zero in [zmin, 15] and scale from the group's min and
    max."""
    out_f = wt.shape[1]
    idx = g[:, None].expand(-1, out_f)
    if sym:
        amax = torch.zeros(ng, out_f).scatter_reduce_(0, idx, wt.abs(), "amax")
        scales = (amax / 7).clamp_min(1e-8).to(torch.float16)
        zero = torch.full((ng, out_f), 8, dtype=torch.int32)
    else:
        lo = torch.zeros(ng, out_f).scatter_reduce_(0, idx, wt, "amin").clamp_max(0)
        hi = torch.zeros(ng, out_f).scatter_reduce_(0, idx, wt, "amax").clamp_min(0)
        scales = ((hi - lo) / 15).clamp_min(1e-8).to(torch.float16)
        zero = torch.round(-lo / scales.float()).clamp(zmin, 15).to(torch.int32)
    q = (torch.round(wt / scales.float()[g]) + zero[g]).clamp(0, 15).to(torch.int32)
    return q, zero, scales


def _save_packed_int4(model: nn.Module, folder: str | Path, quantize: Any,
                      qcfg: dict[str, Any]) -> tuple[Path, dict[str, torch.Tensor]]:
    """``model`` saved per expert with every quantized linear weight replaced by the tensors
    ``quantize(weight) -> (parts, dequantized)`` gives and ``qcfg`` as config.json's
    quantization_config; returns the folder and the dequantized state dict (transformers'
    names, per-expert weights regrouped into the fused ones)."""
    import json

    folder = Path(folder)
    save_checkpoint(model, folder, layout="per_expert")
    ref: dict[str, torch.Tensor] = {}

    def put(k: str, v: torch.Tensor) -> dict[str, torch.Tensor]:
        parts, ref[k] = quantize(v)
        return {f"{k[:-len('.weight')]}.{n}": t for n, t in parts.items()}

    _rewrite_linear_weights(sorted(folder.glob("*.safetensors")), put)
    cfg_path = folder / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["quantization_config"] = qcfg
    cfg_path.write_text(json.dumps(cfg, indent=2))
    held: dict[str, torch.Tensor] = {}
    for k, v in model.state_dict().items():
        if k.endswith("mlp.experts.gate_up_proj") or k.endswith("mlp.experts.down_proj"):
            base = k.rsplit(".", 1)[0]
            E = v.shape[0]
            if k.endswith("gate_up_proj"):
                held[k] = torch.stack([torch.cat([ref[_expert_key(base, e, "gate", ref)],
                                                  ref[_expert_key(base, e, "up", ref)]])
                                       for e in range(E)])
            else:
                held[k] = torch.stack([ref[_expert_key(base, e, "down", ref)]
                                       for e in range(E)])
        elif k in ref:
            held[k] = ref[k]
    return folder, held


def _expert_key(base: str, e: int, what: str, ref: dict[str, torch.Tensor]) -> str:
    """The checkpoint key of expert ``e``'s ``what`` (gate, up, down) under module ``base``
    in a per-expert checkpoint (``w1``/``w3``/``w2`` or ``gate_proj``/``up_proj``/
    ``down_proj``; Mixtral's ``block_sparse_moe`` in place of ``mlp``)."""
    names = {"gate": ("gate_proj", "w1"), "up": ("up_proj", "w3"), "down": ("down_proj", "w2")}
    for b in (base, base.replace(".mlp.", ".block_sparse_moe.")):
        for n in names[what]:
            k = f"{b}.{e}.{n}.weight"
            if k in ref:
                return k
    raise KeyError(f"no checkpoint key for expert {e} {what} under {base}")

"""Tiny offline MoE models for tests, the demo and benchmarks, and checkpoint writers.

:func:`tiny_model` builds a randomly initialised model of any tested architecture from a small
config (no download) with routers far from uniform; :func:`save_checkpoint` writes it as a
checkpoint folder in either on-disk expert layout, so :func:`specmoe.from_pretrained` can be
tested against the unmodified model.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
from torch import nn

from .arch import SUPPORTED, UnsupportedModelError, describe, getpath, moe_block

__all__ = ["tiny_config", "tiny_model", "save_checkpoint"]


def tiny_config(arch: str, *, hidden: int = 64, inter: int = 96, layers: int = 3,
                experts: int = 8, top_k: int = 2, vocab: int = 128):
    """A small config of architecture ``arch`` (a key of SUPPORTED) that builds offline."""
    import transformers as tf
    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    hd = hidden // 4
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
                                   **common)
    if arch == "deepseek_v2":  # DeepSeek-V2-Lite's form: MLA without q compression, softmax
        return tf.DeepseekV2Config(intermediate_size=2 * inter, moe_intermediate_size=inter,
                                   n_routed_experts=experts, num_experts_per_tok=top_k,
                                   n_shared_experts=2, first_k_dense_replace=1,
                                   topk_method="greedy", n_group=1, topk_group=1,
                                   q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=8,
                                   qk_nope_head_dim=8, v_head_dim=hd, **common)
    if arch == "gpt_oss":
        return tf.GptOssConfig(intermediate_size=inter, num_local_experts=experts,
                               num_experts_per_tok=top_k, head_dim=hd, sliding_window=64,
                               **common)
    L = layers
    alt = lambda *kinds: (list(kinds) * L)[:L]  # noqa: E731
    more = {
        "glm4_moe": dict(intermediate_size=2 * inter, moe_intermediate_size=inter,
                         n_routed_experts=experts, num_experts_per_tok=top_k, n_shared_experts=1,
                         first_k_dense_replace=1, n_group=2, topk_group=2, head_dim=hd,
                         num_nextn_predict_layers=0),
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
        "granitemoe": dict(intermediate_size=inter, num_local_experts=experts,
                           num_experts_per_tok=top_k),
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
                                 layer_types=alt("linear_attention", "full_attention")),
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
    }
    if arch in more:
        from transformers import CONFIG_MAPPING
        return CONFIG_MAPPING[arch](**{**common, **more[arch]})
    raise UnsupportedModelError(f"no tiny config for {arch!r}; supported: {sorted(SUPPORTED)}")


def tiny_model(arch: str, seed: int = 0, dtype: torch.dtype = torch.float32,
               router_std: float = 1.0, **kw) -> nn.Module:
    """A randomly initialised eval-mode model from :func:`tiny_config`, eager experts, with its
    routers re-initialised at ``router_std`` so routing is far from uniform."""
    import logging

    from transformers import AutoModelForCausalLM
    logging.getLogger("transformers").setLevel(logging.ERROR)
    torch.manual_seed(seed)
    cfg = tiny_config(arch, **kw)
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

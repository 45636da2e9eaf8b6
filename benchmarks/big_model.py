"""Headline benchmark: a DeepSeek-V2-Lite-shaped checkpoint larger than its memory budget.

    python benchmarks/big_model.py [--layers 12] [--threads 2] [--repeats 1] [--json]
    python benchmarks/big_model.py --quick --json       # 2 layers, vocab 16384: a smoke test
    python benchmarks/big_model.py --layers 27 --source gguf        # DeepSeek-V2-Lite, full depth
    python benchmarks/big_model.py --model qwen3-30b-a3b --source gguf --budget 8GiB

Models (``--model``).  ``dsv2lite`` (default; below) and ``qwen3-30b-a3b``: Qwen3-30B-A3B's
shapes (48 layers, all MoE: 128 experts of FFN 768, top-8 softmax renormalised, hidden 2048,
32 query / 4 KV heads of 128 with q/k norms, vocab 151936; 29.0e9 routed-expert parameters,
1.5e9 others).

Source (``--source``).  ``checkpoint`` (default) writes the bf16 safetensors checkpoint below
and makes llama.cpp's files from it with llama.cpp's own converter and ``llama-quantize``.
``gguf`` writes no bf16 copy: the random model goes straight into one GGUF file per bit width
(``write_gguf``: Q4_0 and/or Q8_0, every matrix in that type, blocks of uniform random integers
with a random-signed scale giving std 0.02, routers and norms F32; the tokenizer and
architecture keys as llama.cpp's converter writes them), and every row reads that file:
``llama.cpp-Q4_0`` and ``specmoe-gguf-Q4_0`` as it is, ``specmoe-int4`` after
``specmoe.convert(file, dtype="int4")`` (the Q4_0 blocks as int4 groups of 32).  At full depth
that is 8.9 GB (Q4_0) / 16.7 GB (Q8_0) for DeepSeek-V2-Lite and 17 GB (Q4_0) for Qwen3-30B-A3B
instead of a 31 GB / 61 GB bf16 checkpoint; ``accelerate`` and the Q4_K_M rows need the
checkpoint and say so.  ``config.written`` lists what was written or reused, its size and time;
each specmoe row carries its store's conversion time and peak RSS.  ``--budget 8GiB`` gives
every row one fixed budget instead of the rule (the specmoe cache then being the budget less
the bf16 non-expert weights and the reserve).

Checkpoint.  A random-weight checkpoint in the original DeepSeek-V2-Lite layout and shapes is
written once under ``--workdir`` (default ``~/.cache/specmoe/bench``) and reused while its
``.complete`` marker holds the same config hash: ``config.json`` with ``model_type
deepseek_v2`` (hidden 2048, 16 MLA heads, kv_lora_rank 512, no q compression, 64 routed experts
of FFN 1408, 2 shared experts, top-6 softmax greedy, vocab 102400), tensors named as on the Hub
(``model.layers.{i}.mlp.experts.{e}.{gate,up,down}_proj.weight``, ``...mlp.shared_experts...``,
``...mlp.gate.weight``), bf16, streamed straight into safetensors shards (~2 GiB, with an
index), one tensor at a time, so the model is never materialised.  ``--layers N`` keeps the
real first layer: layer 0 is the dense FFN (intermediate 10944, ``first_k_dense_replace=1``)
and layers 1..N-1 are MoE; at the default 12 that is 11 MoE layers, 6.1e9 routed-expert
parameters (12.2 GB bf16).  Weights are N(0, 0.02), norms 1.  Each router row ``e`` is scaled
by ``exp(skew * z_e)``, ``z_e ~ N(0,1)`` drawn per layer (``--router-skew``, default 1.0):
experts with larger logit variance win the top-6 more often: on the ``--quick`` checkpoint's
MoE layer, over 512 random prompt tokens, the 16 most used experts (25 %) took 76 % of the
selections (entropy 3.34 nats, uniform 4.16), and greedy decoding does not fall into a loop
(consecutive tokens share 2.6 of their 6 experts).  The tokenizer is specmoe's ``tiny-moe`` byte-level BPE (8192 real
tokens, GPT-2 pre-tokenizer); the embedding and output matrices keep all 102400 rows (ids past
8192 are padding tokens to both transformers and llama.cpp, whose converter pads the vocab as
``[PAD<id>]``).  The prompt is 64 tokens that re-tokenize to themselves in both tokenizers.

Budget.  Every row runs under one memory budget for its precision::

    non-expert bytes (bf16, as in the checkpoint) + 25 % of the routed-expert bytes at the
    row's precision + 512 MiB

with int4 counted at 4.5 bits/weight and int8 at 8.5 (llama.cpp's Q4_0 / Q8_0 block sizes,
also >= specmoe's formats) and bf16 at 16.  It is enforced with a cgroup-v1 memory controller
(``memory.limit_in_bytes``; page cache is charged to the cgroup, so mmap and readahead count):
each row gets a fresh cgroup ``specmoe-bench-<row>`` under this process's own memory cgroup;
the child writes its pid into ``tasks`` before it execs, so everything it loads is capped.
Before each row the page cache is dropped (``sync; echo 3 > /proc/sys/vm/drop_caches``), so
every row starts cold.  Needs root; ``--no-cgroup`` runs uncapped (rows say so).

Rows (same checkpoint, same prompt, same threads: ``torch.set_num_threads`` / llama.cpp ``-t``):

* ``specmoe-int4`` / ``specmoe-int8``: ``specmoe.from_pretrained(ckpt, dtype=..., cache=<25 %
  of the expert bytes at that precision, i.e. the budget minus non-expert weights minus the
  512 MiB reserve>, policy="least_stale", prefetch=True, store=<workdir>)``.  The store is
  converted before the row, uncapped and untimed (``specmoe.convert``).
* ``llama.cpp-Q4_0`` / ``llama.cpp-Q8_0``: the checkpoint converted with llama.cpp's own
  ``convert_hf_to_gguf.py`` (bf16 GGUF; the converter merges the per-expert tensors itself),
  then ``llama-quantize`` to Q4_0 / Q8_0; run by ``llama-completion`` with mmap (the default),
  ``--temp 0`` (greedy), ``--ignore-eos``, ``--no-warmup`` (its warm-up runs every expert once,
  which under the cap would only evict the warm pages), ``-n 33``, and ``--no-repack`` under a
  cap: by default llama.cpp repacks Q4_0/Q8_0 weights at load into an interleaved copy in
  anonymous memory (the whole model), which the budget cannot hold (the first 12-layer run
  was OOM-killed at the cap that way); without repacking the weights stay in the mmap'd file.  llama.cpp is built from the
  llama-cpp-python source distribution on PyPI, which vendors llama.cpp (``--peers``, default
  ``$SPECMOE_PEERS`` or ``~/.cache/specmoe/peers``; built there with cmake if its binaries are
  missing: ``-DGGML_NATIVE=ON``, CPU only, Release).  The converter's pre-tokenizer check only
  knows published tokenizers, so it runs with that check answering ``gpt-2`` (the tiny-moe
  tokenizer is GPT-2's byte-level regex); nothing in the llama.cpp tree is modified.
* ``specmoe-gguf-Q4_0`` / ``specmoe-gguf-Q8_0`` / ``specmoe-gguf-Q4_K_M``: specmoe reading
  **the same GGUF file** as the llama.cpp row of that type (``specmoe.from_pretrained(file,
  dtype="auto", ...)``, cache and store as above): the Q4_0, Q8_0 and Q4_K_M experts are kept
  bit for bit in the ``"gguf"`` store (Q4_K_M: gate/up Q4_K; down Q5_0 / Q8_0 by layer, the
  Q5_0 layers widened to Q8_0 without loss: there is no Q5_0 kernel); the non-expert weights
  are dequantized to bf16.  Compared with the
  llama.cpp row of the same file (``vs_llama_cpp``); ``llama.cpp-Q4_K_M`` is
  ``llama-quantize``'s Q4_K_M of the bf16 GGUF.
* ``specmoe+gguf-Q4_0`` / ``-Q8_0`` / ``-Q4_K_M``: the same with ``dense="gguf"``: the dense
  layers too run on the file's own blocks (never dequantized), so every matrix is read in
  the bits llama.cpp reads; with ``--plan`` the budget is planned around them.
* ``accelerate``: ``AutoModelForCausalLM.from_pretrained(ckpt, device_map="auto",
  max_memory={"cpu": budget - 768 MiB - 1.5 bf16 expert layers}, offload_folder=...,
  dtype=bfloat16)`` (disk offload; the 1.5 layers leave room for transformers fusing one layer's
  64 per-expert tensors into one array while loading, which happens under the cap too),
  ``--accel-tokens`` decode tokens only (default 4): it reads every offloaded weight per token.
  At ``--quick`` sizes that load transient alone (a 1.1 GB fused layer) exceeds the budget, so
  the row reports the OOM kill there.

Timing.  Each row first runs one untimed warm-up generation (a different 64-token prompt, same
lengths) in the same cgroup, then the timed one: a 64-token prompt, then 33 greedy tokens,
i.e. 32 decode forward passes after the prefill pass.  ``tok_per_s`` = 32 / the time of those
32 decode passes (transformers rows: timestamps taken by a logits processor, which is called
after every forward pass; llama.cpp: its ``eval time`` over 32 runs).  For llama.cpp the
warm-up is a separate ``llama-completion`` process in the same cgroup (the page cache, which is
llama.cpp's expert cache, stays charged to the cgroup between the two), the timed process
starts with ``--no-warmup``.  ``disk_read_bytes_per_token`` = ``read_bytes`` of the process
(``/proc/<pid>/io``: block-device reads it caused, page faults on mmap included, O_DIRECT
included, every thread) during decoding / decode tokens; for llama.cpp the decode phase starts
when the first generated token reaches its stdout (a split accurate to about one token).
``peak_rss_bytes`` is the timed process's ``VmHWM`` (``ru_maxrss``; for llama.cpp it includes
the mmapped file pages it touched), ``cgroup_peak_bytes`` the cgroup's
``memory.max_usage_in_bytes`` (page cache included), reset before the timed process.

``--repeats R`` runs every row once per round, rounds interleaved (the row order rotates by
one each round); ``vs_llama_cpp`` (int4 vs
Q4_0, int8 vs Q8_0) and ``vs_accelerate`` are computed within a round and reported as medians,
as are ``tok_per_s`` and the other figures.  A row that cannot run carries ``error`` with the
reason (never silently missing).  ``--json`` prints one JSON object ``{"config", "budget_bytes",
"rows", "targets"}``; progress goes to stderr.  Targets: specmoe int4 >= 2x llama.cpp Q4_0,
int8 >= 2x Q8_0, both >= 20x accelerate.
"""
from __future__ import annotations

import argparse
import glob
import hashlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hostinfo  # noqa: E402

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
if str(REPO) not in sys.path:  # specmoe from this checkout, for the GGUF writer's helpers
    sys.path.insert(1, str(REPO))
MiB = 1 << 20
WRITER_VERSION = 1
PROMPT_TOKENS = 64
DECODE_TOKENS = 32          # decode forward passes timed (33 tokens generated)
RESERVE = 512 * MiB         # the budget's fixed part
# bits per expert weight behind each row's budget; q4_k_m: llama-quantize's Q4_K_M of this
# checkpoint (gate/up Q4_K at 4.5; down, whose 1408 columns are not a multiple of 256, in its
# fallbacks Q5_0 at 5.5 / Q8_0 at 8.5 by layer)
BITS = {"int4": 4.5, "int8": 8.5, "bf16": 16.0, "q4_k_m": 5.5}
LLAMA_TYPES = {"int4": "Q4_0", "int8": "Q8_0", "q4_k_m": "Q4_K_M"}


def log(*a: Any) -> None:
    print("[big_model]", *a, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# checkpoint


# the keys every random model's config.json shares (token 0 is BOS, EOS and padding)
_COMMON: dict[str, Any] = {
    "attention_bias": False, "attention_dropout": 0.0, "initializer_range": 0.02,
    "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0,
    "use_cache": True, "torch_dtype": "bfloat16"}


def _dsv2lite_config(layers: int, vocab: int) -> dict[str, Any]:
    """DeepSeek-V2-Lite's config.json with ``layers`` layers (first one dense) and ``vocab``."""
    return {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "vocab_size": vocab,
        "hidden_size": 2048,
        "intermediate_size": 10944,
        "moe_intermediate_size": 1408,
        "num_hidden_layers": layers,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "n_routed_experts": 64,
        "n_shared_experts": 2,
        "num_experts_per_tok": 6,
        "first_k_dense_replace": 1,
        "moe_layer_freq": 1,
        "kv_lora_rank": 512,
        "q_lora_rank": None,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "topk_method": "greedy",
        "n_group": 1,
        "topk_group": 1,
        "routed_scaling_factor": 1.0,
        "norm_topk_prob": False,
        "scoring_func": "softmax",
        "aux_loss_alpha": 0.001,
        "seq_aux": True,
        "hidden_act": "silu",
        "max_position_embeddings": 4096,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        **_COMMON,
    }


def _qwen3_config(layers: int, vocab: int) -> dict[str, Any]:
    """Qwen3-30B-A3B's config.json (48 layers, every one MoE: 128 experts of FFN 768, top-8,
    GQA 32/4 heads of 128 with q/k norms) with ``layers`` layers and ``vocab``."""
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": vocab,
        "hidden_size": 2048,
        "intermediate_size": 6144,
        "moe_intermediate_size": 768,
        "num_hidden_layers": layers,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "hidden_act": "silu",
        "max_position_embeddings": 40960,
        "rms_norm_eps": 1e-6,
        "rope_theta": 1000000.0,
        **_COMMON,
    }


# --model: (config maker, default layers, default vocab, --source gguf's token embedding std:
# None = the weights' 0.02; at Qwen3's 48 layers greedy decoding of the random model fell into
# a one-token loop at 0.02 (expert hit rate 0.996 at a 28 % cache), and 4 makes each token's
# routing its own: 33 distinct tokens in 33 at 12 layers, where 1.0 still cycled)
MODELS = {"dsv2lite": (_dsv2lite_config, 12, 102400, None),
          "qwen3-30b-a3b": (_qwen3_config, 48, 151936, 4.0)}


def make_config(layers: int, vocab: int, model: str = "dsv2lite") -> dict[str, Any]:
    """The ``config.json`` of ``model`` (a key of :data:`MODELS`) at ``layers`` and ``vocab``."""
    return MODELS[model][0](layers, vocab)


def n_experts(cfg: dict[str, Any]) -> int:
    return cfg.get("n_routed_experts") or cfg["num_experts"]


def tensor_specs(cfg: dict[str, Any]) -> list[tuple[str, tuple[int, ...], str]]:
    """(name, shape, kind) in file order; kind: ``w`` normal weight, ``norm`` ones, ``router``,
    ``expert`` (a routed-expert weight).  DeepSeek-V2 here, Qwen3-MoE and OLMoE in
    :func:`gqa_moe_specs`."""
    if cfg["model_type"] in ("qwen3_moe", "olmoe"):
        return gqa_moe_specs(cfg)
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    nh, dn, dr, dv = (cfg["num_attention_heads"], cfg["qk_nope_head_dim"],
                      cfg["qk_rope_head_dim"], cfg["v_head_dim"])
    kvr, fe, fd = cfg["kv_lora_rank"], cfg["moe_intermediate_size"], cfg["intermediate_size"]
    fs = fe * cfg["n_shared_experts"]
    out: list[tuple[str, tuple[int, ...], str]] = [("model.embed_tokens.weight", (v, h), "w")]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,), "norm"),
                (p + "self_attn.q_proj.weight", (nh * (dn + dr), h), "w"),
                (p + "self_attn.kv_a_proj_with_mqa.weight", (kvr + dr, h), "w"),
                (p + "self_attn.kv_a_layernorm.weight", (kvr,), "norm"),
                (p + "self_attn.kv_b_proj.weight", (nh * (dn + dv), kvr), "w"),
                (p + "self_attn.o_proj.weight", (h, nh * dv), "w"),
                (p + "post_attention_layernorm.weight", (h,), "norm")]
        if i < cfg["first_k_dense_replace"]:
            out += [(p + "mlp.gate_proj.weight", (fd, h), "w"),
                    (p + "mlp.up_proj.weight", (fd, h), "w"),
                    (p + "mlp.down_proj.weight", (h, fd), "w")]
            continue
        out.append((p + "mlp.gate.weight", (cfg["n_routed_experts"], h), "router"))
        for e in range(cfg["n_routed_experts"]):
            q = f"{p}mlp.experts.{e}."
            out += [(q + "gate_proj.weight", (fe, h), "expert"),
                    (q + "up_proj.weight", (fe, h), "expert"),
                    (q + "down_proj.weight", (h, fe), "expert")]
        out += [(p + "mlp.shared_experts.gate_proj.weight", (fs, h), "w"),
                (p + "mlp.shared_experts.up_proj.weight", (fs, h), "w"),
                (p + "mlp.shared_experts.down_proj.weight", (h, fs), "w")]
    out += [("model.norm.weight", (h,), "norm"), ("lm_head.weight", (v, h), "w")]
    return out


def gqa_moe_specs(cfg: dict[str, Any]) -> list[tuple[str, tuple[int, ...], str]]:
    """The tensors of a GQA-attention model whose every layer is MoE with q/k norms, in Hub
    naming: Qwen3-MoE (``head_dim`` given, norms per head, experts of
    ``moe_intermediate_size``) and OLMoE (head = hidden / heads, norms over all heads, experts
    of ``intermediate_size``)."""
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    nq, nkv, E = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["num_experts"]
    qwen = cfg["model_type"] == "qwen3_moe"
    hd = cfg["head_dim"] if qwen else h // nq
    fe = cfg["moe_intermediate_size"] if qwen else cfg["intermediate_size"]
    qn, kn = (hd, hd) if qwen else (nq * hd, nkv * hd)
    out: list[tuple[str, tuple[int, ...], str]] = [("model.embed_tokens.weight", (v, h), "w")]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out += [(p + "input_layernorm.weight", (h,), "norm"),
                (p + "self_attn.q_proj.weight", (nq * hd, h), "w"),
                (p + "self_attn.k_proj.weight", (nkv * hd, h), "w"),
                (p + "self_attn.v_proj.weight", (nkv * hd, h), "w"),
                (p + "self_attn.o_proj.weight", (h, nq * hd), "w"),
                (p + "self_attn.q_norm.weight", (qn,), "norm"),
                (p + "self_attn.k_norm.weight", (kn,), "norm"),
                (p + "post_attention_layernorm.weight", (h,), "norm"),
                (p + "mlp.gate.weight", (E, h), "router")]
        for e in range(E):
            q = f"{p}mlp.experts.{e}."
            out += [(q + "gate_proj.weight", (fe, h), "expert"),
                    (q + "up_proj.weight", (fe, h), "expert"),
                    (q + "down_proj.weight", (h, fe), "expert")]
    out += [("model.norm.weight", (h,), "norm"), ("lm_head.weight", (v, h), "w")]
    return out


def param_counts(cfg: dict[str, Any]) -> dict[str, int]:
    n_exp = n_other = 0
    for _, shape, kind in tensor_specs(cfg):
        n = int(np.prod(shape))
        if kind == "expert":
            n_exp += n
        else:
            n_other += n
    return {"expert_params": n_exp, "non_expert_params": n_other}


def budgets(cfg: dict[str, Any]) -> dict[str, dict[str, int]]:
    pc = param_counts(cfg)
    out = {}
    for prec, bits in BITS.items():
        expert_bytes = int(pc["expert_params"] * bits / 8)
        out[prec] = {"non_expert_bytes": 2 * pc["non_expert_params"],
                     "expert_bytes": expert_bytes,
                     "cache_bytes": expert_bytes // 4,
                     "budget_bytes": 2 * pc["non_expert_params"] + expert_bytes // 4 + RESERVE}
    return out


def accel_max_memory(cfg: dict[str, Any], budget: int) -> int:
    """accelerate's ``max_memory["cpu"]``: the budget less 768 MiB (Python, torch, KV cache)
    and 1.5 MoE layers of bf16 experts -- transformers fuses a layer's per-expert tensors into
    one array while loading (measured: 1.1 GB of anonymous memory above the model for a 1.1 GB
    layer), and that transient must fit under the cap too.  At least 64 MiB."""
    layer = 2 * 3 * n_experts(cfg) * cfg["hidden_size"] * cfg["moe_intermediate_size"]
    return max(64 * MiB, budget - 768 * MiB - int(1.5 * layer))


def config_hash(cfg: dict[str, Any], seed: int, skew: float) -> str:
    blob = json.dumps({"cfg": cfg, "seed": seed, "skew": skew, "v": WRITER_VERSION},
                      sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _tokenizer_source() -> Path:
    return REPO / "specmoe" / "zoo" / "tiny-moe"


def write_checkpoint(folder: Path, cfg: dict[str, Any], seed: int, skew: float,
                     shard_bytes: int = 2 << 30) -> None:
    """Stream the random checkpoint into ``folder`` (bf16 safetensors shards + index), unless a
    complete one with the same hash is there."""
    import torch
    chash = config_hash(cfg, seed, skew)
    marker = folder / ".complete"
    if marker.is_file() and json.loads(marker.read_text()).get("hash") == chash:
        log(f"checkpoint {folder} present (hash {chash})")
        return
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    specs = tensor_specs(cfg)
    shards: list[list[tuple[str, tuple[int, ...], str]]] = [[]]
    size = 0
    for s in specs:
        nb = 2 * int(np.prod(s[1]))
        if shards[-1] and size + nb > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(s)
        size += nb
    total = sum(2 * int(np.prod(s[1])) for s in specs)
    log(f"writing checkpoint {folder}: {len(specs)} tensors, {total / 1e9:.2f} GB bf16 in "
        f"{len(shards)} shards")
    gen = torch.Generator().manual_seed(seed)
    skew_gen = np.random.default_rng(seed + 1)
    std = cfg["initializer_range"]
    weight_map: dict[str, str] = {}
    t0 = time.time()
    done = 0
    for k, shard in enumerate(shards):
        fname = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
        header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
        off = 0
        for name, shape, _ in shard:
            nb = 2 * int(np.prod(shape))
            header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + nb]}
            off += nb
            weight_map[name] = fname
        hb = json.dumps(header, separators=(",", ":")).encode()
        hb += b" " * (-len(hb) % 8)
        tmp = folder / (fname + ".tmp")
        with open(tmp, "wb") as f:
            f.write(len(hb).to_bytes(8, "little"))
            f.write(hb)
            for name, shape, kind in shard:
                n = int(np.prod(shape))
                if kind == "norm":
                    t = torch.ones(n, dtype=torch.bfloat16)
                    f.write(t.view(torch.int16).numpy().tobytes())
                elif kind == "router":
                    rows = torch.randn(shape, generator=gen) * std
                    scale = torch.from_numpy(np.exp(skew * skew_gen.standard_normal(shape[0]))
                                             .astype(np.float32))
                    t = (rows * scale[:, None]).to(torch.bfloat16)
                    f.write(t.view(torch.int16).numpy().tobytes())
                else:
                    step = 1 << 24
                    for a in range(0, n, step):
                        t = torch.randn(min(step, n - a), generator=gen).mul_(std)
                        f.write(t.to(torch.bfloat16).view(torch.int16).numpy().tobytes())
                done += 2 * n
            f.flush()
            os.fsync(f.fileno())
        tmp.rename(folder / fname)
        log(f"  shard {k + 1}/{len(shards)} written ({done / 1e9:.1f}/{total / 1e9:.1f} GB, "
            f"{time.time() - t0:.0f} s)")
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}, indent=1))
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0, "do_sample": False}, indent=1))
    write_tokenizer(folder)
    marker.write_text(json.dumps({"hash": chash, "bytes": total}))
    log(f"checkpoint written in {time.time() - t0:.0f} s")


def write_tokenizer(folder: Path) -> None:
    """The tiny-moe tokenizer's files in ``folder`` (no BOS/EOS added)."""
    folder.mkdir(parents=True, exist_ok=True)
    src = _tokenizer_source()
    shutil.copy(src / "tokenizer.json", folder / "tokenizer.json")
    tc = json.loads((src / "tokenizer_config.json").read_text())
    tc.update({"add_bos_token": False, "add_eos_token": False, "model_max_length": 4096})
    (folder / "tokenizer_config.json").write_text(json.dumps(tc, indent=1))


# Q4_0 / Q8_0 blocks: (bytes per block of 32 weights, std of the block's integer values when
# they are uniform: 0..15 less 8, and -128..127)
_BLOCK = {"Q4_0": (18, ((16 ** 2 - 1) / 12) ** 0.5), "Q8_0": (34, ((256 ** 2 - 1) / 12) ** 0.5)}


def gguf_specs(cfg: dict[str, Any]) -> list[tuple[str, tuple[int, ...], str]]:
    """:func:`tensor_specs` under llama.cpp's GGUF names, in file order: a layer's per-expert
    weights stacked into ``blk.N.ffn_{gate,up,down}_exps`` [experts, rows, cols], DeepSeek's
    ``kv_b_proj`` split into ``attn_k_b`` [heads, kv_lora, nope] and ``attn_v_b`` [heads, v,
    kv_lora] (as llama.cpp's converter writes them)."""
    from specmoe.storage.gguf import gguf_arch, gguf_name
    arch = gguf_arch(cfg["model_type"])
    E = n_experts(cfg)
    out: list[tuple[str, tuple[int, ...], str]] = []
    for name, shape, kind in tensor_specs(cfg):
        parts = name.split(".")
        if kind == "expert":
            if parts[5] == "0":  # model.layers.N.mlp.experts.E.<proj>.weight
                role = parts[6].split("_")[0]
                out.append((f"blk.{parts[2]}.ffn_{role}_exps.weight", (E, *shape), kind))
            continue
        if arch == "deepseek2" and name.endswith("kv_b_proj.weight"):
            nh, dn, dv = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
            kvr = cfg["kv_lora_rank"]
            out += [(f"blk.{parts[2]}.attn_k_b.weight", (nh, kvr, dn), kind),
                    (f"blk.{parts[2]}.attn_v_b.weight", (nh, dv, kvr), kind)]
            continue
        g = gguf_name(name, arch)
        if g is None:
            raise RuntimeError(f"no GGUF name for {name}")
        out.append((g, shape, kind))
    return out


def random_bf16(rng: np.random.Generator, shape: tuple[int, ...]) -> np.ndarray:
    """Random BF16 values as uint8 [..., cols * 2] (a GGUF BF16 tensor's bytes): sign and
    mantissa random, the exponent 2^-7 or 2^-6 by one random bit (std about 0.019), made from
    random bytes (drawing billions of normals would take minutes)."""
    n = int(np.prod(shape))
    r = np.frombuffer(rng.bytes(2 * n), np.uint16)
    a = ((r & 0x807F) | ((120 + ((r >> 7) & 1)) << 7)).astype(np.uint16)
    return a.view(np.uint8).reshape(*shape[:-1], shape[-1] * 2)


def random_router(rng: np.random.Generator, shape: tuple[int, ...], std: float,
                  skew: float) -> np.ndarray:
    """A router weight [E, H] f32 of std ``std`` whose expert rows are scaled by
    ``exp(skew * z_e)``, z_e ~ N(0, 1) (the skew of :func:`write_checkpoint`)."""
    z = rng.standard_normal(shape[0])
    return (rng.standard_normal(shape) * std * np.exp(skew * z)[:, None]).astype(np.float32)


def load_every_expert(eng: Any) -> None:
    """Load every (layer, expert) of engine ``eng`` into its cache (a cache of the whole
    model) and wait: the rows that time decoding with every expert resident."""
    L, E = len(eng.layer_ids), eng.num_experts
    eng._cache.prefetch((np.repeat(np.arange(L), E), np.tile(np.arange(E), L),
                         np.zeros(L * E, np.float32)))
    eng._cache.wait_idle()
    resident = len(eng._cache.resident())
    if resident != L * E:
        raise RuntimeError(f"only {resident} of {L * E} experts resident after warming")


def stream_gguf(w: Any, tmp: Path, path: Path, marker_text: str,
                specs: list[tuple[str, tuple[int, ...], str]],
                info: Callable[[tuple[int, ...], str], tuple[tuple[int, ...], int, Any]],
                fill: Callable[[str, tuple[int, ...], str], np.ndarray]) -> None:
    """Finish GGUF writer ``w`` (its metadata added, writing to ``tmp``) tensor by tensor:
    ``info(shape, kind)`` gives each tensor's (stored shape, bytes, GGML type or None for F32),
    ``fill(name, shape, kind)`` its data, made one tensor at a time (nothing else is held);
    then ``tmp`` becomes ``path`` and ``path.complete`` gets ``marker_text``."""
    total = 0
    for name, shape, kind in specs:
        bshape, nbytes, raw = info(shape, kind)
        dt = np.dtype(np.float32) if raw is None else np.dtype(np.uint8)
        w.add_tensor_info(name, bshape, dt, nbytes, raw_dtype=raw)
        total += nbytes
    log(f"writing GGUF {path}: {len(specs)} tensors, {total / 1e9:.2f} GB")
    w.write_header_to_file(path=str(tmp))
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    t0 = time.time()
    done = 0
    for name, shape, kind in specs:
        a = fill(name, shape, kind)
        w.write_tensor_data(a)
        done += a.nbytes
        if kind in ("expert", "mxfp4"):
            log(f"  {name} ({done / 1e9:.1f}/{total / 1e9:.1f} GB, {time.time() - t0:.0f} s)")
    w.close()
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    tmp.rename(path)
    Path(str(path) + ".complete").write_text(marker_text)
    log(f"GGUF written in {time.time() - t0:.0f} s ({path.stat().st_size / 1e9:.2f} GB)")


def write_gguf(path: Path, cfg: dict[str, Any], seed: int, skew: float, qtype: str,
               embed_std: float | None = None) -> None:
    """Stream the random model straight into a GGUF file of type ``qtype`` (Q4_0, Q8_0 or
    BF16), tensor by tensor, unless a complete one of the same hash is there.

    Every 2-D/3-D weight is ``qtype`` blocks drawn at random: uniform integer values and a
    per-block scale ``d = ±0.02 / std(values) * U(0.75, 1.25)`` (std about 0.02, the
    checkpoint's N(0, 0.02); the sign random); norms are F32 ones; routers are F32 N(0, 0.02)
    rows scaled by ``exp(skew * z_e)`` as in :func:`write_checkpoint`.  Unlike llama-quantize,
    which keeps ``output.weight`` in Q6_K, every matrix is ``qtype``: both sides read exactly
    these bytes.  BF16 matrices are random bit patterns of magnitude 2^-7..2^-5 and either
    sign (std about 0.019), made from random bytes: drawing billions of normals would take
    minutes.
    ``embed_std``: the token embeddings' std instead of 0.02 (:data:`MODELS`)."""
    import gguf
    from transformers import AutoConfig, AutoTokenizer
    from specmoe.models.testing import gguf_metadata, gguf_tokenizer
    from specmoe.storage.gguf import gguf_arch

    chash = config_hash(cfg, seed, skew) + "-" + qtype + (f"-e{embed_std:g}" if embed_std else "")
    marker = Path(str(path) + ".complete")
    if path.is_file() and marker.is_file() and marker.read_text() == chash:
        log(f"GGUF {path} present (hash {chash})")
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)
    qt = gguf.GGMLQuantizationType[qtype]
    bf16 = qtype == "BF16"
    block_bytes, vstd = (2, 1.0) if bf16 else _BLOCK[qtype]
    per_block = 1 if bf16 else 32
    arch = gguf_arch(cfg["model_type"])
    hf = AutoConfig.for_model(**cfg)
    tmp = Path(str(path) + ".tmp")
    w = gguf.GGUFWriter(str(tmp), arch)
    w.add_name(f"specmoe-bench random {cfg['model_type']} L{cfg['num_hidden_layers']}")
    gguf_metadata(w, hf)
    w.add_file_type({"Q4_0": gguf.LlamaFileType.MOSTLY_Q4_0,
                     "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
                     "BF16": gguf.LlamaFileType.MOSTLY_BF16}[qtype])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    gguf_tokenizer(w, AutoTokenizer.from_pretrained(str(_tokenizer_source())), cfg["vocab_size"])
    specs = gguf_specs(cfg)

    def quantized(shape: tuple[int, ...], kind: str) -> bool:
        return kind in ("w", "expert") and len(shape) >= 2 and shape[-1] % 32 == 0

    def info(shape: tuple[int, ...], kind: str) -> tuple[tuple[int, ...], int, Any]:
        n = int(np.prod(shape))
        if quantized(shape, kind):
            return ((*shape[:-1], shape[-1] // per_block * block_bytes),
                    n // per_block * block_bytes, qt)
        return shape, 4 * n, None

    rng = np.random.default_rng(seed)
    std = cfg["initializer_range"]

    def fill(name: str, shape: tuple[int, ...], kind: str) -> np.ndarray:
        n = int(np.prod(shape))
        if kind == "norm":
            a = np.ones(shape, np.float32)
        elif kind == "router":
            a = random_router(rng, shape, std, skew)
        elif not quantized(shape, kind):
            a = (rng.standard_normal(shape) * std).astype(np.float32)
        elif bf16 and not (embed_std and name == "token_embd.weight"):
            a = random_bf16(rng, shape)
        elif bf16:
            f = (rng.standard_normal(shape) * embed_std).astype(np.float32)
            a = (f.view(np.uint32) >> 16).astype(np.uint16).view(np.uint8)
            a = a.reshape(*shape[:-1], shape[-1] * 2)
        else:
            s = embed_std if (embed_std and name == "token_embd.weight") else std
            nb = n // 32
            a = np.frombuffer(rng.bytes(nb * block_bytes), np.uint8).reshape(nb, block_bytes)
            # a random sign: Q4_0's values (0..15 less 8) average -0.5, which would give
            # every matrix a common mean and the model one favourite token
            d = (s / vstd) * rng.uniform(0.75, 1.25, nb) * rng.choice((-1.0, 1.0), nb)
            a = a.copy()
            a[:, :2] = d.astype(np.float16).view(np.uint8).reshape(nb, 2)
            a = a.reshape(*shape[:-1], shape[-1] // 32 * block_bytes)
        return a

    stream_gguf(w, tmp, path, chash, specs, info, fill)


def make_prompts(folder: Path, n: int, seed: int) -> list[list[int]]:
    """Two prompts (timed, warm-up) of ``n`` whole-word tokens whose text re-tokenizes to the
    same ids (so llama.cpp, fed the text, sees the same tokens)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(folder))
    words = sorted(i for t, i in tok.get_vocab().items()
                   if t.startswith("\u0120") and t[1:].isascii() and t[1:].isalpha()
                   and len(t) >= 4)
    rng = np.random.default_rng(seed)
    out = []
    while len(out) < 2:
        ids = [int(x) for x in rng.choice(words, size=n)]
        if tok.encode(tok.decode(ids), add_special_tokens=False) == ids:
            out.append(ids)
    return out


# --------------------------------------------------------------------------------------------
# cgroup, page cache, process measurement


def drop_caches() -> bool:
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError as e:
        log(f"cannot drop the page cache ({e}); this row does not start cold")
        return False


class Cgroup:
    """A cgroup-v1 memory cgroup under this process's own, with a hard limit."""

    ROOT = Path("/sys/fs/cgroup/memory")

    def __init__(self, name: str, limit: int):
        own = "/"
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            parts = line.split(":", 2)
            if len(parts) == 3 and "memory" in parts[1].split(","):
                own = parts[2]
        base = self.ROOT / own.lstrip("/")
        if not (base / "memory.limit_in_bytes").is_file():
            raise RuntimeError(f"no cgroup-v1 memory controller at {base}")
        self.path = base / f"specmoe-bench-{name}"
        if self.path.exists():
            self.path.rmdir()
        self.path.mkdir()
        self._w("memory.limit_in_bytes", str(limit))
        self.limit = int(self._r("memory.limit_in_bytes"))

    def _w(self, f: str, v: str) -> None:
        with open(self.path / f, "w") as fh:
            fh.write(v)

    def _r(self, f: str) -> str:
        return (self.path / f).read_text()

    @property
    def tasks(self) -> str:
        return str(self.path / "tasks")

    def reset_peak(self) -> None:
        self._w("memory.max_usage_in_bytes", "0")

    def peak(self) -> int:
        return int(self._r("memory.max_usage_in_bytes"))

    def oom_kills(self) -> int:
        m = re.search(r"oom_kill (\d+)", self._r("memory.oom_control"))
        return int(m.group(1)) if m else 0

    def close(self) -> None:
        try:
            self._w("memory.force_empty", "0")
        except OSError:
            pass
        for _ in range(50):
            try:
                self.path.rmdir()
                return
            except OSError:
                time.sleep(0.1)


def _read_bytes(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def run_process(argv: list[str], cg: Cgroup | None, timeout: float, env: dict[str, str] | None = None,
                on_first_stdout: bool = False) -> dict[str, Any]:
    """Run ``argv`` (in ``cg`` from before exec); return rc, stdout, stderr, wall, rusage figures
    and, with ``on_first_stdout``, the child's read_bytes when its first stdout byte came.
    ``env`` None: :func:`hostinfo.peer_env` (llama.cpp's tools get libgomp's default wait
    policy; a specmoe worker sets its own when it imports hostinfo or specmoe first)."""
    if env is None:
        env = hostinfo.peer_env()
    tasks = cg.tasks if cg is not None else None

    def enter() -> None:
        if tasks is not None:
            with open(tasks, "w") as f:
                f.write(str(os.getpid()))

    t0 = time.perf_counter()
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                         preexec_fn=enter, start_new_session=True)
    out: dict[str, Any] = {"first_stdout_read_bytes": None}
    bufs: dict[str, bytearray] = {"stdout": bytearray(), "stderr": bytearray()}

    def pump(name: str, stream: Any) -> None:
        first = True
        while True:
            b = stream.read1(65536) if hasattr(stream, "read1") else stream.read(65536)
            if not b:
                break
            if first and name == "stdout" and on_first_stdout:
                out["first_stdout_read_bytes"] = _read_bytes(p.pid)
                out["first_stdout_t"] = time.perf_counter() - t0
            first = False
            bufs[name] += b

    th = [threading.Thread(target=pump, args=(n, s), daemon=True)
          for n, s in (("stdout", p.stdout), ("stderr", p.stderr))]
    for t in th:
        t.start()
    def kill() -> None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except OSError:
            pass

    timer = threading.Timer(timeout, kill)
    timer.start()
    try:
        _, status, ru = os.wait4(p.pid, 0)
    finally:
        timer.cancel()
    p.returncode = os.waitstatus_to_exitcode(status)
    for t in th:
        t.join(5)
    for s in (p.stdout, p.stderr):
        if s is not None:
            s.close()
    out.update(rc=p.returncode, wall_s=time.perf_counter() - t0,
               stdout=bufs["stdout"].decode(errors="replace"),
               stderr=bufs["stderr"].decode(errors="replace"),
               maxrss_bytes=ru.ru_maxrss * 1024, read_bytes=ru.ru_inblock * 512,
               timed_out=p.returncode == -signal.SIGKILL and time.perf_counter() - t0 >= timeout)
    return out


def _fail_reason(r: dict[str, Any], cg: Cgroup | None, what: str) -> str:
    if r.get("timed_out"):
        return f"{what}: timed out after {r['wall_s']:.0f} s"
    if cg is not None and r["rc"] == -signal.SIGKILL and cg.oom_kills():
        return (f"{what}: killed by the OOM killer at the memory cap "
                f"({cg.limit / MiB:.0f} MiB)")
    tail = (r["stderr"].strip().splitlines() or ["(no output)"])[-3:]
    return f"{what}: exit {r['rc']}: " + " | ".join(s.strip()[:300] for s in tail)


# --------------------------------------------------------------------------------------------
# python rows (specmoe, accelerate): run as ``big_model.py --_worker spec.json``


def worker(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    import torch
    torch.set_num_threads(spec["threads"])
    from transformers import LogitsProcessor, LogitsProcessorList

    class Stamp(LogitsProcessor):
        """Called after every forward pass: time and read_bytes at each."""

        def __init__(self) -> None:
            self.t: list[float] = []
            self.io: list[int] = []

        def __call__(self, input_ids: Any, scores: Any) -> Any:
            self.t.append(time.perf_counter())
            self.io.append(_read_bytes(os.getpid()) or 0)
            return scores

    res: dict[str, Any] = {}
    phase = Path(spec["result"] + ".phase")

    def enter(what: str) -> None:  # the parent names the phase a failure happened in
        phase.write_text(what)

    enter("loading the model")
    t0 = time.perf_counter()
    eng = None
    if spec["kind"] == "specmoe":
        import specmoe
        specmoe.runtime.kernels.set_num_threads(spec["threads"])  # the expert kernels' threads
        planned = spec.get("memory") is not None  # --plan: the budget planned by specmoe
        model = specmoe.from_pretrained(spec["ckpt"], cache=None if planned else spec["cache"],
                                        memory=spec.get("memory"), dtype=spec["dtype"],
                                        policy="least_stale", prefetch=True, store=spec["store"],
                                        dense=spec.get("dense", "auto"), progress=False)
        eng = specmoe.engine_of(model)
        if planned:
            res["memory_plan"] = eng.memory_plan.to_dict()
    else:
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(
            spec["ckpt"], device_map="auto", max_memory={"cpu": spec["max_memory"]},
            offload_folder=spec["offload_folder"], dtype=torch.bfloat16)
        res["device_map_disk"] = sum(1 for v in (getattr(model, "hf_device_map", None) or {})
                                     .values() if v == "disk")
    model.eval()
    res["load_s"] = time.perf_counter() - t0
    n = spec["decode_tokens"]

    def gen(ids: list[int]) -> Stamp:
        st = Stamp()
        x = torch.tensor([ids])
        with torch.inference_mode():
            model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n + 1,
                           min_new_tokens=n + 1, do_sample=False,
                           logits_processor=LogitsProcessorList([st]), pad_token_id=0)
        return st

    enter("the warm-up generation")
    t1 = time.perf_counter()
    gen(spec["warm_ids"])
    res["warmup_s"] = time.perf_counter() - t1
    if eng is not None:
        eng.reset_stats()
    enter("the timed generation")
    io0 = _read_bytes(os.getpid()) or 0
    t2 = time.perf_counter()
    st = gen(spec["prompt_ids"])
    if len(st.t) != n + 1:
        raise RuntimeError(f"expected {n + 1} forward passes, saw {len(st.t)}")
    res["prefill_s"] = st.t[0] - t2
    res["decode_s"] = st.t[-1] - st.t[0]
    res["decode_tokens"] = n
    res["tok_per_s"] = n / res["decode_s"]
    res["decode_read_bytes"] = st.io[-1] - st.io[0]
    res["prefill_read_bytes"] = st.io[0] - io0
    if eng is not None:
        s = eng.stats()
        res["engine"] = {k: s.get(k) for k in ("hits", "misses", "hit_rate", "stall_s",
                                                "bytes_read", "capacity", "cache_bytes",
                                                "prefetch_precision", "prefetch_recall")}
        eng.close()
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            res["vmhwm_bytes"] = int(line.split()[1]) * 1024
    Path(spec["result"]).write_text(json.dumps(res))


def run_python_row(row: dict[str, Any], spec: dict[str, Any], cg: Cgroup | None,
                   work: Path, timeout: float) -> dict[str, Any]:
    spec_path = work / f"spec-{row['name']}.json"
    result = work / f"result-{row['name']}.json"
    phase = Path(str(result) + ".phase")
    result.unlink(missing_ok=True)
    phase.unlink(missing_ok=True)
    spec["result"] = str(result)
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, OMP_NUM_THREADS=str(spec["threads"]),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    if cg is not None:
        cg.reset_peak()
    r = run_process([sys.executable, str(Path(__file__).resolve()), "--_worker", str(spec_path)],
                    cg, timeout, env=env)
    if r["rc"] != 0 or not result.is_file():
        where = phase.read_text() if phase.is_file() else "start-up"
        return {"error": _fail_reason(r, cg, f"{row['name']} (during {where})")}
    res = json.loads(result.read_text())
    out = {"tok_per_s": res["tok_per_s"], "peak_rss_bytes": r["maxrss_bytes"],
           "disk_read_bytes_per_token": res["decode_read_bytes"] / res["decode_tokens"],
           "decode_tokens": res["decode_tokens"], "decode_s": res["decode_s"],
           "prefill_s": res["prefill_s"], "load_s": res["load_s"], "warmup_s": res["warmup_s"],
           "read_bytes_total": r["read_bytes"], "prefill_read_bytes": res["prefill_read_bytes"]}
    if cg is not None:
        out["cgroup_peak_bytes"] = cg.peak()
    for k in ("engine", "device_map_disk", "memory_plan"):
        if k in res:
            out[k] = res[k]
    return out


# --------------------------------------------------------------------------------------------
# llama.cpp


class LlamaCpp:
    """llama.cpp from the llama-cpp-python sdist: source, build, converter, binaries."""

    # CMake options per ISA: "native" (-march=native: AVX-512 where the CPU has it) or "avx2"
    # (AVX-512 off, for the AVX2 figures on any x86 host; issue 44)
    ISA_FLAGS = {"native": ["-DGGML_NATIVE=ON"],
                 "avx2": ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON",
                          "-DGGML_F16C=ON", "-DGGML_BMI2=ON", "-DGGML_AVX_VNNI=OFF",
                          "-DGGML_AVX512=OFF", "-DGGML_AVX512_VBMI=OFF",
                          "-DGGML_AVX512_VNNI=OFF", "-DGGML_AVX512_BF16=OFF"],
                 # AVX-512 with VNNI / BF16 / VBMI but no AMX: on the Intel Xeon (under KVM)
                 # of 2026-12-01 the native build's AMX path crashed (SIGSEGV) at every load
                 # that repacks the weights; this build repacks them with AVX-512 instead
                 "avx512": ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON",
                            "-DGGML_FMA=ON", "-DGGML_F16C=ON", "-DGGML_BMI2=ON",
                            "-DGGML_AVX512=ON", "-DGGML_AVX512_VBMI=ON",
                            "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX512_BF16=ON",
                            "-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]}

    def __init__(self, peers: Path, build: bool, threads: int, isa: str = "native",
                 server: bool = False):
        """``server``: llama-server is needed too (serve.py): built with the others, or alone
        into a build that lacks it."""
        if isa not in self.ISA_FLAGS:
            raise ValueError(f"llama.cpp isa must be one of {list(self.ISA_FLAGS)}, got {isa!r}")
        self.peers = peers
        self.isa = isa
        self.server = server
        self.error: str | None = None
        self.build_dir = peers / ("llama.cpp-build" if isa == "native" else f"llama.cpp-build-{isa}")
        self.bin = self.build_dir / "bin"
        srcs = sorted(glob.glob(str(peers / "llama_cpp_python-*" / "vendor" / "llama.cpp")))
        self.src = Path(srcs[-1]) if srcs else None
        try:
            if not self._have_bins() or self.src is None:
                if not build:
                    raise RuntimeError(f"llama.cpp binaries not found under {self.bin} "
                                       "(--build-peers builds them)")
                self._build(threads)
        except Exception as e:  # noqa: BLE001 -- the rows carry the reason
            self.error = f"llama.cpp unavailable: {e}"

    def _targets(self) -> list[str]:
        return ["llama-completion", "llama-quantize", "llama-bench"] + (
            ["llama-server"] if self.server else [])

    def _have_bins(self) -> bool:
        need = ["llama-completion", "llama-quantize"] + (["llama-server"] if self.server else [])
        return all((self.bin / b).is_file() for b in need)

    def _build(self, threads: int) -> None:
        dl = self.peers / "dl"
        dl.mkdir(parents=True, exist_ok=True)
        if self.src is None:
            log("downloading the llama-cpp-python source distribution from PyPI")
            subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps",
                            "--no-binary", "llama-cpp-python", "--only-binary",
                            "scikit-build-core,cmake,ninja,pathspec,packaging", "-d", str(dl),
                            "llama-cpp-python"], check=True, stdout=sys.stderr)
            tars = sorted(dl.glob("llama_cpp_python-*.tar.gz"))
            if not tars:
                raise RuntimeError("pip download produced no llama_cpp_python sdist")
            subprocess.run(["tar", "xzf", str(tars[-1]), "-C", str(self.peers)], check=True)
            srcs = sorted(glob.glob(str(self.peers / "llama_cpp_python-*" / "vendor" /
                                        "llama.cpp")))
            self.src = Path(srcs[-1])
        if shutil.which("cmake") is None:
            raise RuntimeError("cmake not found (apt-get install cmake build-essential)")
        b = self.build_dir
        log(f"building llama.cpp ({self.isa}) in {b} (several minutes)")
        subprocess.run(["cmake", "-S", str(self.src), "-B", str(b), "-DCMAKE_BUILD_TYPE=Release",
                        *self.ISA_FLAGS[self.isa], "-DLLAMA_CURL=OFF", "-DLLAMA_OPENSSL=OFF",
                        "-DLLAMA_BUILD_TESTS=OFF",
                        f"-DLLAMA_BUILD_SERVER={'ON' if self.server else 'OFF'}",
                        "-DBUILD_SHARED_LIBS=OFF"], check=True, stdout=sys.stderr)
        subprocess.run(["cmake", "--build", str(b), "--config", "Release", f"-j{threads}",
                        "--target", *self._targets()], check=True, stdout=sys.stderr)
        if not self._have_bins():
            raise RuntimeError(f"build finished without binaries in {self.bin}")

    # Modules convert_hf_to_gguf.py imports that specmoe's own requirements do not bring
    # (llama.cpp's requirements-convert_legacy_llama.txt): sentencepiece is imported by the
    # Llama / Mixtral vocabulary path even for a tokenizer.json-only checkpoint (the zoo's
    # tiny-moe), before it falls back to that file.
    CONVERTER_MODULES = {"sentencepiece": "sentencepiece"}

    def _converter_deps(self) -> str | None:
        """Install the converter's missing modules into this interpreter (the benchmarks set
        themselves up, as ``make bench`` does); the reason as a string where that fails."""
        import importlib.util
        need = [pkg for mod, pkg in self.CONVERTER_MODULES.items()
                if importlib.util.find_spec(mod) is None]
        if not need:
            return None
        log(f"installing llama.cpp's converter requirements: {' '.join(need)}")
        r = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", *need],
                           capture_output=True, text=True)
        if r.returncode != 0:
            return (f"convert_hf_to_gguf.py needs {' '.join(need)}, and pip could not install "
                    "it: " + " | ".join(r.stderr.strip().splitlines()[-3:]))
        importlib.invalidate_caches()
        return None

    def convert(self, ckpt: Path, out_dir: Path, types: list[str], chash: str,
                keep_bf16: bool) -> dict[str, Path | str]:
        """GGUF files per llama.cpp type (``Q4_0``...) or the reason they could not be made."""
        out_dir.mkdir(parents=True, exist_ok=True)
        marker = out_dir / ".source"
        if not (marker.is_file() and marker.read_text() == chash):
            for f in out_dir.glob("*.gguf"):
                f.unlink()
            marker.write_text(chash)
        res: dict[str, Path | str] = {}
        want = [t for t in types if not (out_dir / f"model-{t}.gguf").is_file()]
        bf16 = out_dir / "model-bf16.gguf"
        if want and not bf16.is_file():
            missing = self._converter_deps()
            if missing:
                return {t: missing for t in types}
            log("converting the checkpoint to GGUF bf16 with llama.cpp's convert_hf_to_gguf.py")
            code = (
                "import sys, types, runpy\n"
                f"sys.path[:0] = [{str(self.src)!r}, {str(self.src / 'gguf-py')!r}]\n"
                "try:\n    import requests\n"
                "except ImportError:\n    sys.modules['requests'] = types.ModuleType('requests')\n"
                "import conversion.base as b\n"
                "orig = b.TextModel.get_vocab_base_pre\n"
                "def pre(self, tok):\n"
                "    try:\n        return orig(self, tok)\n"
                "    except NotImplementedError:\n        return 'gpt-2'\n"
                "b.TextModel.get_vocab_base_pre = pre\n"
                "import conversion.deepseek as d\n"
                "orig_sp = d.DeepseekV2Model.set_gguf_parameters\n"
                "def sp(self):\n"
                "    orig_sp(self)\n"
                "    if self.hparams.get('q_lora_rank') is None:\n"
                "        self.gguf_writer.add_q_lora_rank(0)\n"
                "d.DeepseekV2Model.set_gguf_parameters = sp\n"
                f"sys.argv = ['convert_hf_to_gguf.py', {str(ckpt)!r}, '--outtype', 'bf16', "
                f"'--outfile', {str(bf16) + '.tmp'!r}]\n"
                f"runpy.run_path({str(self.src / 'convert_hf_to_gguf.py')!r}, run_name='__main__')\n")
            t0 = time.time()
            r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
            if r.returncode != 0:
                tail = " | ".join(r.stderr.strip().splitlines()[-3:])
                return {t: f"convert_hf_to_gguf.py failed: {tail}" for t in types}
            Path(str(bf16) + ".tmp").rename(bf16)
            log(f"  bf16 GGUF written in {time.time() - t0:.0f} s")
        for t in types:
            out = out_dir / f"model-{t}.gguf"
            if not out.is_file():
                log(f"llama-quantize -> {t}")
                r = subprocess.run([str(self.bin / "llama-quantize"), str(bf16), str(out) + ".tmp",
                                    t, str(os.cpu_count() or 1)], capture_output=True, text=True)
                if r.returncode != 0:
                    res[t] = "llama-quantize failed: " + " | ".join(
                        r.stderr.strip().splitlines()[-3:])
                    continue
                Path(str(out) + ".tmp").rename(out)
            res[t] = out
        if not keep_bf16 and bf16.is_file() and all(isinstance(v, Path) for v in res.values()):
            bf16.unlink()
        return res

    def run_row(self, gguf: Path, prompt: str, warm: str, threads: int, cg: Cgroup | None,
                work: Path, timeout: float, ctx: int = 256) -> dict[str, Any]:
        """One llama-completion run of ``prompt`` after a warm-up run of ``warm`` (each a
        process), ``ctx`` positions of context."""
        pf, wf = work / "prompt.txt", work / "warm.txt"
        pf.write_text(prompt)
        wf.write_text(warm)

        def argv(f: Path) -> list[str]:
            return [str(self.bin / "llama-completion"), "-m", str(gguf), "-f", str(f),
                    "-n", str(DECODE_TOKENS + 1), "-t", str(threads), "-tb", str(threads),
                    "-c", str(ctx), "--temp", "0", "--seed", "0", "--ignore-eos", "-no-cnv",
                    "--no-display-prompt", "--no-warmup"] + \
                (["--no-repack"] if cg is not None else [])  # see the module docstring

        w = run_process(argv(wf), cg, timeout)
        if w["rc"] != 0:
            return {"error": _fail_reason(w, cg, "llama-completion (warm-up)")}
        if cg is not None:
            cg.reset_peak()
        r = run_process(argv(pf), cg, timeout, on_first_stdout=True)
        if r["rc"] != 0:
            return {"error": _fail_reason(r, cg, "llama-completion")}
        m = re.search(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens", r["stderr"])
        e = re.search(r"\beval time =\s*([\d.]+) ms /\s*(\d+) runs", r["stderr"])
        if not e or not m:
            return {"error": "llama-completion printed no timings: " +
                    " | ".join(r["stderr"].strip().splitlines()[-3:])}
        runs, ms = int(e.group(2)), float(e.group(1))
        first = r["first_stdout_read_bytes"]
        out = {"tok_per_s": runs / (ms / 1000), "peak_rss_bytes": r["maxrss_bytes"],
               "disk_read_bytes_per_token": ((r["read_bytes"] - first) / runs
                                             if first is not None else None),
               "decode_tokens": runs, "decode_s": ms / 1000,
               "prefill_s": float(m.group(1)) / 1000, "prompt_tokens_seen": int(m.group(2)),
               "load_s": r.get("first_stdout_t"),  # process start to first token
               "warmup_s": w["wall_s"], "read_bytes_total": r["read_bytes"],
               "gguf_bytes": gguf.stat().st_size}
        if cg is not None:
            out["cgroup_peak_bytes"] = cg.peak()
        if runs != DECODE_TOKENS:
            out["note"] = f"llama.cpp reported {runs} decode runs (expected {DECODE_TOKENS})"
        return out


# --------------------------------------------------------------------------------------------
# main


def convert_store(ckpt: Path, dtype: str, out: Path, timeout: float) -> str | None:
    """Build the specmoe store (uncapped, untimed); None or the reason it failed."""
    return convert_store_info(ckpt, dtype, out, timeout).get("error")


def convert_store_info(ckpt: Path, dtype: str, out: Path, timeout: float) -> dict[str, Any]:
    """Build the specmoe store (uncapped, untimed): ``{"error": reason}`` or its conversion
    time, the converting process's peak RSS and the store's size (a store already converted
    from the same source is reused by ``specmoe.convert``: its time is then the check's)."""
    code = ("import sys, specmoe\n"
            f"specmoe.convert({str(ckpt)!r}, dtype={dtype!r}, out={str(out)!r}, progress=False)\n"
            "print([l for l in open('/proc/self/status') if l.startswith('VmHWM:')][0])\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    t0 = time.time()
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=timeout)
    if r.returncode != 0:
        return {"error": "specmoe.convert failed: " +
                " | ".join(r.stderr.strip().splitlines()[-3:])}
    dt = time.time() - t0
    m = re.search(r"VmHWM:\s*(\d+) kB", r.stdout)
    log(f"specmoe store {out.name} ready ({dt:.0f} s)")
    return {"convert_s": dt, "convert_peak_rss_bytes": int(m.group(1)) * 1024 if m else None,
            "store_bytes": out.stat().st_size if out.is_file() else None}


def parse_bytes(size: str) -> int:
    """Bytes of a size such as ``8GiB`` (specmoe's own reading of ``memory=``)."""
    from specmoe.runtime.memplan import memory_budget
    return memory_budget(size)[0]


def _median(xs: list[float | None]) -> float | None:
    v = [x for x in xs if x is not None]
    return statistics.median(v) if v else None


def add_peer_arguments(ap: argparse.ArgumentParser) -> None:
    """The options every benchmark against llama.cpp shares (--workdir, --peers,
    --no-build-peers, --llama-isa), one definition."""
    ap.add_argument("--workdir", default=os.path.expanduser("~/.cache/specmoe/bench"),
                    help="checkpoints, stores and GGUF files (reused between runs)")
    ap.add_argument("--peers", default=os.environ.get(
        "SPECMOE_PEERS", os.path.expanduser("~/.cache/specmoe/peers")),
        help="llama.cpp sdist, build and binaries (built here if missing)")
    ap.add_argument("--no-build-peers", action="store_true",
                    help="do not download/build llama.cpp if missing (its rows then say so)")
    ap.add_argument("--llama-isa", choices=sorted(LlamaCpp.ISA_FLAGS), default="native",
                    help="llama.cpp build: native (-march=native), avx2 (AVX-512 off) or "
                         "avx512 (AVX-512 with VNNI/BF16/VBMI, AMX off)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    ap.add_argument("--model", choices=sorted(MODELS), default="dsv2lite",
                    help="the shapes: DeepSeek-V2-Lite or Qwen3-30B-A3B")
    ap.add_argument("--layers", type=int, default=None,
                    help="layers (default 12 for dsv2lite, whose first is dense; 48 for qwen3)")
    ap.add_argument("--vocab", type=int, default=None,
                    help="vocabulary rows (default the model's: 102400 / 151936)")
    ap.add_argument("--source", choices=("checkpoint", "gguf"), default="checkpoint",
                    help="checkpoint: bf16 safetensors, llama.cpp's files made by its converter "
                         "and llama-quantize; gguf: the random model written straight into "
                         "the Q4_0 / Q8_0 GGUF files that every row reads (no bf16 copy on disk)")
    ap.add_argument("--embed-std", type=float, default=None,
                    help="--source gguf: the token embeddings' std (default: the model's, "
                         "see MODELS)")
    ap.add_argument("--budget", default=None,
                    help="one fixed memory budget for every row (e.g. 8GiB) instead of the "
                         "rule; specmoe's cache is the budget less the bf16 non-expert bytes "
                         "and the 512 MiB reserve")
    ap.add_argument("--quick", action="store_true",
                    help="smoke test: 2 layers, vocab 16384, 2 accelerate tokens")
    add_peer_arguments(ap)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--accel-tokens", type=int, default=4)
    ap.add_argument("--router-skew", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--rows", default="specmoe-int4,llama.cpp-Q4_0,specmoe-int8,llama.cpp-Q8_0,"
                    "accelerate", help="comma-separated subset, in run order")
    ap.add_argument("--row-timeout", type=float, default=3600.0)
    ap.add_argument("--no-cgroup", action="store_true", help="run uncapped (not a valid result)")
    ap.add_argument("--keep-gguf-bf16", action="store_true")
    ap.add_argument("--plan", action="store_true",
                    help="specmoe rows plan their budget: from_pretrained(memory=<the row's "
                         "budget>) picks the dense layers' format and the cache size, instead "
                         "of bf16 dense layers and the rule's 25 %% cache")
    ap.add_argument("--_worker", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._worker:
        worker(a._worker)
        return
    if a.quick:
        a.layers, a.vocab = 2, 16384
        a.accel_tokens = min(a.accel_tokens, 2)
    a.layers = a.layers or MODELS[a.model][1]
    a.vocab = a.vocab or MODELS[a.model][2]
    if a.layers < 2:
        ap.error("--layers must be >= 2 (layer 0 is dense)")

    cfg = make_config(a.layers, a.vocab, a.model)
    chash = config_hash(cfg, a.seed, a.router_skew)
    root = Path(a.workdir).expanduser() / f"{a.model}-L{a.layers}-V{a.vocab}-{chash}"
    ckpt = root / "ckpt"
    work = root / "run"
    work.mkdir(parents=True, exist_ok=True)
    written: dict[str, dict[str, Any]] = {}  # what this run wrote or reused on disk
    if a.source == "checkpoint":
        t0 = time.time()
        write_checkpoint(ckpt, cfg, a.seed, a.router_skew)
        written[str(ckpt)] = {"bytes": sum(f.stat().st_size for f in ckpt.iterdir()),
                              "s": time.time() - t0}
        tokdir = ckpt
    else:
        tokdir = root / "tokenizer"
        write_tokenizer(tokdir)
    prompt_ids, warm_ids = make_prompts(tokdir, PROMPT_TOKENS, a.seed)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(tokdir))
    prompt_txt, warm_txt = tok.decode(prompt_ids), tok.decode(warm_ids)

    bud = budgets(cfg)
    if a.budget:
        fixed = parse_bytes(a.budget)
        for b in bud.values():
            b["budget_bytes"] = fixed
            b["cache_bytes"] = fixed - b["non_expert_bytes"] - RESERVE
            if b["cache_bytes"] <= 0:
                ap.error(f"--budget {a.budget} is below the bf16 non-expert weights and the "
                         "reserve")
    pc = param_counts(cfg)
    for prec, b in bud.items():
        log(f"budget {prec}: {b['budget_bytes'] / MiB:.0f} MiB = non-expert "
            f"{b['non_expert_bytes'] / MiB:.0f} MiB + cache {b['cache_bytes'] / MiB:.0f} MiB "
            f"({100 * b['cache_bytes'] / b['expert_bytes']:.0f} % of the experts' "
            f"{b['expert_bytes'] / MiB:.0f} MiB) + 512 MiB")

    names = [n.strip() for n in a.rows.split(",") if n.strip()]
    rows_def: list[dict[str, Any]] = []
    for n in names:
        if n.startswith(("specmoe-gguf-", "specmoe+gguf-")):  # the llama.cpp row's own file
            t = n.split("gguf-", 1)[1]
            prec = {v: k for k, v in LLAMA_TYPES.items()}.get(t)
            if prec is None:
                ap.error(f"unknown GGUF type in {n} (Q4_0, Q8_0, Q4_K_M)")
            rows_def.append({"name": n, "kind": "specmoe", "precision": prec, "type": t,
                             "dense": "gguf" if n.startswith("specmoe+") else "auto"})
        elif n.startswith("specmoe-"):
            rows_def.append({"name": n, "kind": "specmoe", "precision": n.split("-", 1)[1]})
        elif n.startswith("llama.cpp-"):
            t = n.split("-", 1)[1]
            prec = {v: k for k, v in LLAMA_TYPES.items()}.get(t)
            if prec is None:
                ap.error(f"unknown llama.cpp type in {n} (Q4_0, Q8_0, Q4_K_M)")
            rows_def.append({"name": n, "kind": "llama.cpp", "precision": prec, "type": t})
        elif n == "accelerate":
            rows_def.append({"name": n, "kind": "accelerate", "precision": "bf16"})
        else:
            ap.error(f"unknown row {n}")

    # ---- preparation: uncapped, untimed
    prep_err: dict[str, str] = {}
    stores: dict[str, Path] = {}
    sources: dict[str, Path] = {}  # what each specmoe row loads: the checkpoint or a GGUF
    store_info: dict[str, dict[str, Any]] = {}
    gguf: dict[str, Path | str] = {}
    lc: LlamaCpp | None = None
    if any(r["kind"] == "llama.cpp" for r in rows_def) or (
            a.source == "checkpoint" and any("type" in r for r in rows_def)):
        lc = LlamaCpp(Path(a.peers).expanduser(), not a.no_build_peers, a.threads, a.llama_isa)
    if a.source == "gguf":  # every row reads the GGUF file of its bits
        for r in rows_def:
            if r["kind"] == "accelerate" or r["precision"] not in ("int4", "int8") or \
                    r.get("type", "Q4_0") not in ("Q4_0", "Q8_0"):
                prep_err[r["name"]] = ("--source gguf writes Q4_0 / Q8_0 files only; this row "
                                       "needs the safetensors checkpoint (--source checkpoint)")
            else:
                r.setdefault("file", LLAMA_TYPES[r["precision"]])
        for t in sorted({r["file"] for r in rows_def if "file" in r}):
            f = root / "gguf-direct" / f"model-{t}.gguf"
            t0 = time.time()
            write_gguf(f, cfg, a.seed, a.router_skew, t,
                       embed_std=a.embed_std if a.embed_std is not None else MODELS[a.model][3])
            gguf[t] = f
            written[str(f)] = {"bytes": f.stat().st_size, "s": time.time() - t0}
        if lc is not None and lc.error:
            for r in rows_def:
                if r["kind"] == "llama.cpp":
                    prep_err[r["name"]] = lc.error
    elif any("type" in r for r in rows_def):  # llama.cpp rows and specmoe's same-file rows
        assert lc is not None
        if lc.error:
            for r in rows_def:
                if "type" in r:
                    prep_err[r["name"]] = lc.error
        else:
            gguf = lc.convert(ckpt, root / "gguf",
                              sorted({r["type"] for r in rows_def if "type" in r}), chash,
                              a.keep_gguf_bf16)
            for r in rows_def:
                if "type" in r and not isinstance(gguf.get(r["type"]), Path):
                    prep_err[r["name"]] = str(gguf.get(r["type"]))
            for t, f in gguf.items():
                if isinstance(f, Path):
                    written[str(f)] = {"bytes": f.stat().st_size}
    for r in rows_def:
        if r["kind"] == "specmoe" and r["name"] not in prep_err:
            if "type" in r:
                src, dt, p = gguf[r["type"]], "auto", root / f"store-gguf-{r['type']}.smoe"
            elif a.source == "gguf":  # specmoe's own format, converted from the file's blocks
                src, dt = gguf[r["file"]], r["precision"]
                p = root / f"store-{r['precision']}-from-{r['file']}.smoe"
            else:
                src, dt, p = ckpt, r["precision"], root / f"store-{r['precision']}.smoe"
            info = convert_store_info(src, dt, p, a.row_timeout)  # type: ignore[arg-type]
            if "error" in info:
                prep_err[r["name"]] = info["error"]
            else:
                store_info[r["name"]] = info
                written[str(p)] = {"bytes": info["store_bytes"], "s": info["convert_s"],
                                   "peak_rss_bytes": info["convert_peak_rss_bytes"]}
            stores[r["name"]], sources[r["name"]] = p, src  # type: ignore[assignment]
    for k, v in written.items():
        log(f"on disk: {k}: {(v.get('bytes') or 0) / 1e9:.2f} GB"
            + (f", {v['s']:.0f} s" if "s" in v else ""))

    # ---- rows, rounds interleaved
    runs: dict[str, list[dict[str, Any]]] = {r["name"]: [] for r in rows_def}
    for rep in range(a.repeats):
        k = rep % len(rows_def)  # rotate the order each round
        for r in rows_def[k:] + rows_def[:k]:
            name = r["name"]
            if name in prep_err:
                runs[name].append({"error": prep_err[name]})
                continue
            b = bud[r["precision"]]
            log(f"round {rep + 1}/{a.repeats}: {name} (cap {b['budget_bytes'] / MiB:.0f} MiB)")
            cg = None
            res: dict[str, Any]
            try:
                if not a.no_cgroup:
                    cg = Cgroup(name, b["budget_bytes"])
                cold = drop_caches()
                if r["kind"] == "llama.cpp":
                    assert lc is not None
                    res = lc.run_row(gguf[r["type"]], prompt_txt, warm_txt, a.threads, cg,  # type: ignore[arg-type]
                                     work, a.row_timeout)
                elif r["kind"] == "specmoe":
                    spec = {"kind": "specmoe", "ckpt": str(sources[name]),
                            "dtype": "auto" if "type" in r else r["precision"],
                            "cache": str(b["cache_bytes"]), "store": str(stores[name]),
                            "memory": b["budget_bytes"] if a.plan else None,
                            "dense": r.get("dense", "auto"),
                            "threads": a.threads, "prompt_ids": prompt_ids, "warm_ids": warm_ids,
                            "decode_tokens": DECODE_TOKENS}
                    res = run_python_row(r, spec, cg, work, a.row_timeout)
                else:
                    off = root / "offload"
                    shutil.rmtree(off, ignore_errors=True)
                    spec = {"kind": "accelerate", "ckpt": str(ckpt), "threads": a.threads,
                            "max_memory": accel_max_memory(cfg, b["budget_bytes"]),
                            "offload_folder": str(off), "prompt_ids": prompt_ids,
                            "warm_ids": warm_ids, "decode_tokens": a.accel_tokens}
                    res = run_python_row(r, spec, cg, work, a.row_timeout)
                    shutil.rmtree(off, ignore_errors=True)
                res["cold_start"] = cold
                res["capped"] = cg is not None
            except Exception as e:  # noqa: BLE001 -- recorded in the row
                res = {"error": f"{type(e).__name__}: {e}"}
            finally:
                if cg is not None:
                    cg.close()
            if "error" in res:
                log(f"  error: {res['error']}")
            else:
                log(f"  {name}: {res['tok_per_s']:.3f} tok/s, peak RSS "
                    f"{res['peak_rss_bytes'] / MiB:.0f} MiB, "
                    f"{(res['disk_read_bytes_per_token'] or 0) / MiB:.1f} MiB read/token")
            runs[name].append(res)

    # ---- ratios within rounds, medians
    peer_of = {r["name"]: f"llama.cpp-{r.get('type') or LLAMA_TYPES[r['precision']]}"
               for r in rows_def if r["precision"] in LLAMA_TYPES and r["kind"] == "specmoe"}

    def ratio(rep: int, name: str, other: str | None) -> float | None:
        if other is None or other not in runs:
            return None
        x, y = runs[name][rep].get("tok_per_s"), runs[other][rep].get("tok_per_s")
        return x / y if x and y else None

    rows_out = []
    for r in rows_def:
        name = r["name"]
        ok = [x for x in runs[name] if "error" not in x]
        row: dict[str, Any] = {"name": name, "precision": r["precision"],
                               "budget_bytes": bud[r["precision"]]["budget_bytes"]}
        if not ok:
            row.update(tok_per_s=None, peak_rss_bytes=None, disk_read_bytes_per_token=None,
                       vs_llama_cpp=None, vs_accelerate=None, error=runs[name][0]["error"])
            rows_out.append(row)
            continue
        row["tok_per_s"] = _median([x["tok_per_s"] for x in ok])
        row["peak_rss_bytes"] = _median([x["peak_rss_bytes"] for x in ok])
        row["disk_read_bytes_per_token"] = _median([x["disk_read_bytes_per_token"] for x in ok])
        row["vs_llama_cpp"] = _median([ratio(i, name, peer_of.get(name))
                                       for i in range(a.repeats)])
        row["vs_accelerate"] = _median([ratio(i, name, "accelerate") for i in range(a.repeats)])
        row["tok_per_s_runs"] = [x.get("tok_per_s") for x in runs[name]]
        if name in peer_of:
            row["vs_llama_cpp_runs"] = [ratio(i, name, peer_of[name]) for i in range(a.repeats)]
        for k in ("cgroup_peak_bytes", "decode_s", "prefill_s", "load_s", "warmup_s",
                  "read_bytes_total", "prefill_read_bytes", "decode_tokens",
                  "prompt_tokens_seen", "gguf_bytes"):
            v = [x.get(k) for x in ok if x.get(k) is not None]
            if v:
                row[k] = _median(v)
        for k in ("engine", "device_map_disk", "note", "capped", "cold_start", "memory_plan"):
            if k in ok[-1]:
                row[k] = ok[-1][k]
        if name in store_info:
            row.update(store_info[name])
        errs = [x["error"] for x in runs[name] if "error" in x]
        if errs:
            row["errors"] = errs
        rows_out.append(row)

    by = {r["name"]: r for r in rows_out}

    def target(name: str, key: str, goal: float) -> dict[str, Any]:
        v = by.get(name, {}).get(key)
        return {"value": v, "target": goal, "met": (v >= goal) if v is not None else None}

    targets = {
        "specmoe-int4 vs llama.cpp-Q4_0": target("specmoe-int4", "vs_llama_cpp", 2.0),
        "specmoe-int8 vs llama.cpp-Q8_0": target("specmoe-int8", "vs_llama_cpp", 2.0),
        "specmoe-int4 vs accelerate": target("specmoe-int4", "vs_accelerate", 20.0),
        "specmoe-int8 vs accelerate": target("specmoe-int8", "vs_accelerate", 20.0),
        "specmoe-gguf-Q4_0 vs llama.cpp-Q4_0 (same file)": target("specmoe-gguf-Q4_0",
                                                                   "vs_llama_cpp", 2.0),
        "specmoe-gguf-Q8_0 vs llama.cpp-Q8_0 (same file)": target("specmoe-gguf-Q8_0",
                                                                   "vs_llama_cpp", 2.0),
        "specmoe-gguf-Q4_K_M vs llama.cpp-Q4_K_M (same file)": target(
            "specmoe-gguf-Q4_K_M", "vs_llama_cpp", 2.0),
    }
    # only the targets whose two rows ran ("specmoe-int4 vs accelerate" without accelerate's)
    targets = {k: v for k, v in targets.items()
               if all(side.split(" ")[0] in by for side in k.split(" vs "))}
    result = {
        "config": {"model": {"dsv2lite": "DeepSeek-V2-Lite", "qwen3-30b-a3b": "Qwen3-30B-A3B"}[
                       a.model] + " layout, random weights",
                   "model_key": a.model, "source": a.source,
                   "embed_std": (a.embed_std if a.embed_std is not None else MODELS[a.model][3])
                   if a.source == "gguf" else None,
                   "weights": ("bf16 safetensors" if a.source == "checkpoint" else
                               "GGUF Q4_0 / Q8_0 blocks written directly (see write_gguf)"),
                   "layers": a.layers,
                   "moe_layers": a.layers - cfg.get("first_k_dense_replace", 0),
                   "vocab": a.vocab, "experts": n_experts(cfg),
                   "top_k": cfg["num_experts_per_tok"], "budget": a.budget or "rule",
                   "specmoe_memory": "planned (memory=budget)" if a.plan else
                   "bf16 dense layers, cache = budget - non-expert - reserve",
                   "written": written,
                   "expert_params": pc["expert_params"],
                   "non_expert_params": pc["non_expert_params"], "threads": a.threads,
                   "prompt_tokens": PROMPT_TOKENS, "decode_tokens": DECODE_TOKENS,
                   "accel_tokens": a.accel_tokens, "repeats": a.repeats,
                   "router_skew": a.router_skew,
                   "checkpoint": str(ckpt) if a.source == "checkpoint" else None,
                   "cgroup": not a.no_cgroup, "reserve_bytes": RESERVE,
                   "bits_per_weight": BITS, "llama_cpp_isa": a.llama_isa},
        "host": hostinfo.host(a.threads),
        "budget_bytes": {r["name"]: bud[r["precision"]]["budget_bytes"] for r in rows_def},
        "rows": rows_out,
        "targets": targets,
    }
    if a.json:
        print(json.dumps(result))
    else:
        for r in rows_out:
            if r.get("error"):
                print(f"{r['name']:<16} {r['precision']:<5} ERROR {r['error']}")
            else:
                print(f"{r['name']:<16} {r['precision']:<5} {r['tok_per_s']:8.3f} tok/s  "
                      f"peak RSS {r['peak_rss_bytes'] / MiB:7.0f} MiB  "
                      f"read {(r['disk_read_bytes_per_token'] or 0) / MiB:7.1f} MiB/token  "
                      f"vs llama.cpp {r['vs_llama_cpp']}  vs accelerate {r['vs_accelerate']}")
        for k, v in targets.items():
            print(f"target {k}: {v}")


if __name__ == "__main__":
    main()

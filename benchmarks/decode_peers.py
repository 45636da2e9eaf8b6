"""Decode speed with every expert resident: specmoe vs llama.cpp vs unmodified transformers,
at real MoE shapes, plus where a specmoe decode step spends its time.

    python benchmarks/decode_peers.py --json [--repeats 3] [--threads 1,2] [--models olmoe,dsv2lite]
    python benchmarks/decode_peers.py --quick --json     # tiny shapes, 1 round: a smoke test

Models.  Random-weight checkpoints at real MoE shapes, written as checkpoint folders (bf16
safetensors, tensor names as on the Hub, the zoo ``tiny-moe`` tokenizer, 64-token prompts that
re-tokenize to themselves) by :func:`big_model.write_checkpoint` and converted to GGUF by
llama.cpp's own converter (:class:`big_model.LlamaCpp`; pre-tokenizer answered ``gpt-2``,
``q_lora_rank`` 0 for DeepSeek-V2), under ``--workdir`` (default ``~/.cache/specmoe/bench``;
never committed):

* ``olmoe``: ``model_type olmoe`` as OLMoE-1B-7B: hidden 2048, 16 heads (q/k norms), 64
  experts of FFN 1024, top-8 softmax, vocab 50304; ``--olmoe-layers`` (default 4) MoE layers.
* ``dsv2lite``: ``model_type deepseek_v2`` as DeepSeek-V2-Lite (:func:`big_model.make_config`:
  MLA with kv_lora_rank 512, 64 routed experts of FFN 1408 + 2 shared, top-6, vocab 102400);
  ``--dsv2-layers`` (default 4): the dense first layer (FFN 10944) + 3 MoE layers.

Weights N(0, 0.02), norms 1, router rows scaled by exp(z), z ~ N(0, 1) (big_model's
``--router-skew`` 1), so routing is skewed as in trained models rather than uniform.

Rows (one checkpoint, one prompt, every row with all experts in memory):

* ``torch-f32`` / ``torch-bf16``: unmodified transformers,
  ``AutoModelForCausalLM.from_pretrained(ckpt, experts_implementation="eager", dtype=...)``.
* ``specmoe-f32`` / ``-bf16`` / ``-int8`` / ``-int4``: ``specmoe.from_pretrained(ckpt,
  cache=1.0, dtype=..., policy="lru", prefetch=False, torch_dtype=<float32 for f32, bfloat16
  otherwise>, store=<workdir>)``; the store is converted before the rounds (untimed) and every
  expert is loaded into the cache before timing (``prefetch`` of all (layer, expert) pairs, then
  ``wait_idle``); the row reports the cache hit rate of the timed run (1.0 expected).
* ``llama.cpp-F32`` / ``-BF16`` / ``-Q8_0`` / ``-Q4_0``: ``convert_hf_to_gguf.py --outtype
  bf16`` (that file is the BF16 row), ``llama-quantize`` to F32 / Q8_0 / Q4_0 (its defaults: for
  Q8_0 / Q4_0 the output matrix gets its own type, e.g. Q6_K, norms stay F32); run by
  ``llama-completion`` with mmap, greedy, ``-t``/``-tb`` = threads, ``-c 256``, after a separate
  warm-up process on another prompt (:meth:`big_model.LlamaCpp.run_row`).

* ``specmoe+dense-gguf-Q4_0``: specmoe reading **the same GGUF file** as the ``llama.cpp-Q4_0``
  row (``specmoe.from_pretrained(file, dtype="auto", dense="int4")``): the Q4_0 experts kept
  bit for bit (int4 in groups of 32), the dense weights dequantized from Q4_0 and run by the C
  int4 kernels (groups of 128).  Same file, same expert bits as llama.cpp.
* ``specmoe+gguf-Q4_0`` / ``-Q8_0``: specmoe reading the same GGUF file as ``llama.cpp-Q4_0``
  / ``-Q8_0`` with ``dense="gguf"``: the experts and every dense layer the file holds in a
  block format (its Q6_K output matrix included) run on the file's own blocks, the bits
  llama.cpp reads; only what the file holds otherwise (F32 norms, DeepSeek's kv_b_proj joined
  from two tensors) stays in bf16.  Same file, same bits, both sides.
* ``specmoe+dense-f32`` / ``-bf16`` / ``-int8`` / ``-int4``: the same, with ``dense=<p>``: every
  dense linear layer except the routers (attention projections, shared experts, the dense FFN,
  lm_head) runs through specmoe's C kernels at the row's precision (:mod:`specmoe.models.dense`).
  These are the rows at equal precision of all weights with llama.cpp's.

In the ``specmoe-<p>`` rows precision is NOT equal in the same sense on both sides: specmoe
quantizes only the routed experts (attention, router, shared experts, dense FFN, embeddings
and lm_head stay in torch at ``torch_dtype``: bf16 for the int8/int4 rows, ``dense="torch"``),
while llama.cpp quantizes every weight matrix.
At these shapes the non-expert weights are a large part of the bytes read per token (DeepSeek-
V2-Lite: lm_head 210 M, dense FFN 67 M, attention ~ 20 M per layer, vs 6 x 8.6 M expert weights
per MoE layer), so at int8/int4 llama.cpp reads fewer bytes per token; the ``specmoe+dense``
rows close that gap (issue 16).

Timing.  Each (model, row) runs in its own subprocess per round (peak RSS = that process's
``VmHWM``; for llama.cpp ``ru_maxrss`` of the timed process, which counts the mmapped GGUF pages
it touched).  Inside it every thread count of ``--threads`` is measured in turn (order alternates
per round): ``torch.set_num_threads`` + ``specmoe.runtime.kernels.set_num_threads`` (llama.cpp: ``-t
-tb``); a warm-up generation (another 64-token prompt, ``--warm-tokens`` tokens), then the timed
one: the 64-token prompt (``--prompt-tokens`` sets another length for both, e.g. to measure
decode against a long cache), then 33 greedy tokens with no end-of-sequence stop (the model's
``generation_config.eos_token_id`` set to None, as llama.cpp's ``--ignore-eos``; until
2026-11-25 ``min_new_tokens``, whose per-step vocabulary scan cost the python rows ~0.5 ms a
step), i.e. 32 decode forward passes; ``tok_per_s`` =
32 / their time (a logits processor timestamps every forward pass; llama.cpp: its ``eval time``
over 32 runs).  specmoe rows (``loop``: ``specmoe.generate``) then decode the same prompt with
specmoe's own loop, :func:`specmoe.generate` without a drafter (prefill of the prompt but its
last token, then 33 one-token steps; the time between the ends of the first and the last of
its steps, ``iterations[i]["t_end"]``), which is their ``tok_per_s``; the ``model.generate``
figure stays beside it as ``tok_per_s_model_generate`` (from 2026-11-26; earlier results'
specmoe rows are ``model.generate``).  The per-step breakdown below runs ``model.generate``.  Rounds are interleaved: every round runs every row once, the row order rotated
by one each round; ``vs_llama_cpp`` (specmoe f32:F32, bf16:BF16, int8:Q8_0, int4:Q4_0) and
``vs_torch`` (specmoe-f32 and llama.cpp-F32 vs torch-f32, every other row vs torch-bf16, the
checkpoint dtype) are
ratios within a round, reported as medians over rounds, like ``tok_per_s``.

Per-step breakdown (specmoe and torch rows).  After the timed generation, one more generation of
the same prompt runs instrumented: forward hooks time each layer's ``self_attn``, each layer's
``mlp`` and its ``experts`` module, and ``lm_head``; for specmoe the Engine's C per-layer object
(``specmoe.engine_of(model)._layers``) is wrapped by a proxy whose ``forward`` is timed (the
pattern of ``benchmarks/layer_overhead.py``), which is the time inside the expert kernels and
the C cache path; in the ``specmoe+dense`` rows every ``CLinear``'s ``_C.Linear`` is wrapped
the same way (``dense_c_ms_per_step``).  Over the 32 decode steps (between the logits-processor timestamps):
``attention``, ``experts`` (the C call; torch rows: the eager experts module), ``experts_glue``
(specmoe's Python around the C call: casts, buffers), ``router_shared_dense`` (the rest of the
MLP block: router, top-k, shared experts, layer 0's dense FFN), ``lm_head``, ``other`` (the step
minus all that: embeddings, norms, residuals, decoder-layer and ``generate`` Python, logits
processing), each as ms per step and share of the step.  ``outside_experts_share`` =
1 - C time / step time is the framework overhead around the expert kernels (it includes the
attention and lm_head matmuls, which torch runs in the ``specmoe-<p>`` rows);
``outside_c_kernels_share`` = 1 - (expert C + dense C + attention C) / step, for the
``specmoe+dense`` rows where those matmuls are in C too (attention C: the C attention kernels,
MLA's absorbed one included, which earlier runs counted as outside); ``glue_share`` = (experts_glue + other) /
step is the part that is neither expert kernels nor a torch matmul.  The hooks cost a few
microseconds per module call; the instrumented run's tok/s is reported beside the plain one.
Rows whose decoder layers run as one C call each (``specmoe+dense``: specmoe.models.attention's fused
layers at OLMoE shapes, specmoe.models.mla's at DeepSeek-V2 shapes; ``breakdown_kind`` says so):
``attention`` and ``experts`` are the C time of that call's two parts (it reports them; with
the routing and shared experts at DeepSeek shapes; consecutive such layers run in one
``_C.layer_chain`` call of specmoe.models.decode_step, or in its one ``_C.DecodePlan.step`` a token
(from 2026-11-26), which report the same split summed), ``lm_head`` the module's time (the
hooks that time it keep ``lm_head`` out of the plan in this run: the plan then runs the
embedding, the layers and the final norm, and the module the head),
``dense_mlp_in_the_call`` a dense layer's MLP inside its call (DeepSeek-V2's dense first
layer, ``MLABlock.set_mlp``), ``mlp_outside_the_call`` the MLPs a layer calls from Python after
its attention call (a MoE block routed in Python), and ``other`` everything else -- embeddings, the final
norm, the Python around each layer call, the KV-cache bookkeeping, ``generate``;
``glue_share`` = other / step and ``outside_c_kernels_share`` = 1 - (all C time) / step.  Rows
whose MoE blocks are routed in C but whose layers are not fused: ``experts`` is that one call's
time -- the routing, the experts and the shared experts' MLP (C time in
``outside_c_kernels_share``).

Thread scaling.  Once per round, before its rows, the DRAM read ceiling is measured at each
thread count (``KernelContext.read_bw`` over a 1 GiB buffer, three reads per count, alternating,
median): ``config.models[m].read_ceiling_gbps`` {threads: median over rounds} and
``read_ceiling_scaling`` (the most threads over 1, median of per-round ratios).  Every row with
more than one thread count carries ``thread_scaling``: its tok/s at that count over its tok/s at
1 thread, median of per-round ratios.  A decode step that streams its weights at the read
ceiling cannot scale past ``read_ceiling_scaling``: on the development VM two threads read,
most of the time, only ~1.15-1.2x what one reads (29 vs 33-35 GB/s; for stretches of seconds to
minutes ~55 GB/s: docs/performance.md, "Two threads on this VM"), so a row near the ceiling at
1 thread scales ~1.2x while one below it (more compute per byte) has room to scale further.

Targets: specmoe+dense >= 1.0x llama.cpp at every equal precision and thread count; specmoe >= 1.5x
unmodified torch; at DeepSeek-V2-Lite shapes the share of a specmoe decode step outside the
expert kernels <= 25 % (and, for information, the glue-only share).

``--json`` prints one JSON object ``{"config", "rows", "targets"}``; progress goes to stderr.
A row that cannot run carries ``error`` with the reason.  Disk: a model's files (checkpoint,
four stores, four GGUF) take ~30-35 GB at the default shapes; ``--cleanup`` deletes a model's
stores and GGUF files once its rounds are done.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
import big_model as bm  # noqa: E402  (checkpoint writer, prompts, llama.cpp, process runner)
import hostinfo  # noqa: E402

MiB = 1 << 20
SPECMOE_PRECS = ("f32", "bf16", "int8", "int4")
LLAMA_OF = {"f32": "F32", "bf16": "BF16", "int8": "Q8_0", "int4": "Q4_0"}
TORCH_OF = {"f32": "f32", "bf16": "bf16", "int8": "bf16", "int4": "bf16"}  # torch_dtype
DECODE_TOKENS = bm.DECODE_TOKENS  # llama.cpp rows (run_row) decode this many
PROMPT_TOKENS = bm.PROMPT_TOKENS


def log(*a: Any) -> None:
    print("[decode_peers]", *a, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------
# models


def olmoe_config(layers: int, vocab: int = 50304, quick: bool = False) -> dict[str, Any]:
    """OLMoE-1B-7B's config.json with ``layers`` MoE layers (``quick``: tiny dims)."""
    c = {
        "architectures": ["OlmoeForCausalLM"], "model_type": "olmoe", "vocab_size": vocab,
        "hidden_size": 2048, "intermediate_size": 1024, "num_hidden_layers": layers,
        "num_attention_heads": 16, "num_key_value_heads": 16, "num_experts": 64,
        "num_experts_per_tok": 8, "norm_topk_prob": False, "hidden_act": "silu",
        "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "attention_bias": False, "attention_dropout": 0.0, "clip_qkv": None,
        "router_aux_loss_coef": 0.01, "output_router_logits": False,
        "initializer_range": 0.02, "tie_word_embeddings": False, "bos_token_id": 0,
        "eos_token_id": 0, "pad_token_id": 0, "use_cache": True, "torch_dtype": "bfloat16"}
    if quick:
        c.update(hidden_size=256, intermediate_size=128, num_attention_heads=4,
                 num_key_value_heads=4, num_experts=16, num_experts_per_tok=4)
    return c


def dsv2_config(layers: int, vocab: int = 102400, quick: bool = False) -> dict[str, Any]:
    c = bm.make_config(layers, vocab)
    if quick:
        c.update(hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
                 num_attention_heads=4, num_key_value_heads=4, n_routed_experts=16,
                 kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)
    return c


def model_summary(cfg: dict[str, Any]) -> dict[str, Any]:
    pc = bm.param_counts(cfg)
    if cfg["model_type"] == "olmoe":
        moe, k, E, f = (cfg["num_hidden_layers"], cfg["num_experts_per_tok"],
                        cfg["num_experts"], cfg["intermediate_size"])
        dense = 0
    else:
        dense = cfg["first_k_dense_replace"]
        moe, k, E, f = (cfg["num_hidden_layers"] - dense, cfg["num_experts_per_tok"],
                        cfg["n_routed_experts"], cfg["moe_intermediate_size"])
    active = moe * k * 3 * cfg["hidden_size"] * f
    return {"model_type": cfg["model_type"], "layers": cfg["num_hidden_layers"],
            "dense_layers": dense, "moe_layers": moe, "hidden": cfg["hidden_size"],
            "experts": E, "top_k": k, "expert_ffn": f, "vocab": cfg["vocab_size"],
            "heads": cfg["num_attention_heads"], **pc,
            "active_expert_params_per_token": active,
            "non_expert_share_of_active_params": round(
                pc["non_expert_params"] / (pc["non_expert_params"] + active), 3)}


# --------------------------------------------------------------------------------------------
# python rows (torch, specmoe): ``decode_peers.py --_worker spec.json``


class _ChainTimer:
    """specmoe.models.decode_step's _C.layer_chain, or its _C.DecodePlan.step, with the attention /
    MoE / dense-MLP split it returns added into acc, as _BlockTimer.layer does for one layer
    (a plan's fourth figure, its final norm and head, is left to the lm_head hook and
    "other")."""

    def __init__(self, inner: Any, acc: dict[str, float]) -> None:
        self.inner, self.acc = inner, acc

    def __call__(self, *args: Any) -> Any:
        r = self.inner(*args)
        self.acc["attn"] += r[0]
        self.acc["moe"] += r[1]
        self.acc["mlp"] += r[2]
        return r


class _BlockTimer:
    """An attention module's _C.AttnBlock or a layer's _C.MLABlock with its calls timed:
    pre/post/attn into acc["attn"]; a fused decoder layer's call reports its own attention /
    MoE split."""

    def __init__(self, inner: Any, acc: dict[str, float]) -> None:
        self.inner, self.acc = inner, acc

    def pre(self, *a: Any) -> Any:
        t0 = time.perf_counter()
        r = self.inner.pre(*a)
        self.acc["attn"] += time.perf_counter() - t0
        return r

    def post(self, *a: Any) -> Any:
        t0 = time.perf_counter()
        r = self.inner.post(*a)
        self.acc["attn"] += time.perf_counter() - t0
        return r

    def attn(self, *a: Any) -> Any:  # an MLABlock's attention half (a dense-MLP layer)
        t0 = time.perf_counter()
        r = self.inner.attn(*a)
        self.acc["attn"] += time.perf_counter() - t0
        return r

    def layer(self, *a: Any) -> Any:
        r = self.inner.layer(*a)
        self.acc["attn"] += r[0]
        self.acc["moe"] += r[1]
        self.acc["mlp"] += r[2]
        return r


class _Acc:
    """Cumulative seconds per category, timed by forward hooks."""

    def __init__(self) -> None:
        self.t: dict[str, float] = {}
        self._t0: dict[int, float] = {}
        self.handles: list[Any] = []

    def hook(self, module: Any, cat: str) -> None:
        def pre(m: Any, args: Any) -> None:
            self._t0[id(m)] = time.perf_counter()

        def post(m: Any, args: Any, out: Any) -> None:
            self.t[cat] = self.t.get(cat, 0.0) + time.perf_counter() - self._t0.pop(id(m))

        self.handles += [module.register_forward_pre_hook(pre),
                         module.register_forward_hook(post)]

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def worker(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    if spec["kind"] == "specmoe":
        import specmoe  # before torch, as users should (OMP_WAIT_POLICY)
    import torch
    from transformers import LogitsProcessor, LogitsProcessorList
    phase = Path(spec["result"] + ".phase")

    def enter(what: str) -> None:
        phase.write_text(what)

    dt = {"f32": torch.float32, "bf16": torch.bfloat16}[spec["torch_dtype"]]
    enter("loading the model")
    t0 = time.perf_counter()
    eng = None
    kernels = None
    if spec["kind"] == "specmoe":
        from specmoe.runtime import kernels
        model = specmoe.from_pretrained(spec["ckpt"], cache=1.0, dtype=spec["dtype"],
                                        policy="lru", prefetch=False, store=spec["store"],
                                        torch_dtype=dt, progress=False, dense=spec["dense"])
        eng = specmoe.engine_of(model)
        enter("loading every expert into the cache")
        bm.load_every_expert(eng)
    else:
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(spec["ckpt"], dtype=dt,
                                                     experts_implementation="eager")
    model.eval()
    # no end-of-sequence stop, as llama.cpp's --ignore-eos: every row decodes n + 1 tokens.
    # (min_new_tokens would do it too, but its logits processor scans the whole vocabulary
    # with torch.isin at every step, ~0.5 ms a step here, a cost llama.cpp's rows do not pay.)
    model.generation_config.eos_token_id = None
    res: dict[str, Any] = {"load_s": time.perf_counter() - t0, "threads": {}}

    class Stamp(LogitsProcessor):
        def __init__(self, acc: _Acc | None = None, c: dict[str, float] | None = None,
                     dc: dict[str, float] | None = None, ab: dict[str, float] | None = None,
                     mc: dict[str, float] | None = None):
            self.t: list[float] = []
            self.snap: list[dict[str, float]] = []
            self.acc, self.c, self.dc, self.ab, self.mc = acc, c, dc, ab, mc

        def __call__(self, input_ids: Any, scores: Any) -> Any:
            self.t.append(time.perf_counter())
            if self.acc is not None:
                s = dict(self.acc.t)
                if self.c is not None:
                    s["experts_c"] = self.c["t"]
                    s["routed_c"] = self.c["routed"]["t"]
                if self.dc is not None:
                    s["dense_c"] = self.dc["t"]
                if self.ab is not None:
                    s["attn_c"], s["moe_c"] = self.ab["attn"], self.ab["moe"]
                    s["mlp_c"] = self.ab["mlp"]
                if self.mc is not None:
                    s["attn_c"] = s.get("attn_c", 0.0) + self.mc["t"]
                self.snap.append(s)
            return scores

    def gen(ids: list[int], n: int, st: Stamp) -> Stamp:
        x = torch.tensor([ids])
        with torch.inference_mode():
            model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n + 1,
                           do_sample=False, logits_processor=LogitsProcessorList([st]),
                           pad_token_id=0)
        if len(st.t) != n + 1:
            raise RuntimeError(f"expected {n + 1} forward passes, saw {len(st.t)}")
        return st

    def gen_specmoe(ids: list[int], n: int) -> float:
        """Seconds of n decode steps of specmoe.generate (no drafter: one token a step),
        between the ends of its first and last steps, as the Stamp times model.generate."""
        out = specmoe.generate(model, ids, max_new_tokens=n + 1, eos_token_id=None)
        its = out.iterations
        if len(its) != n + 1 or any(i["k"] for i in its):
            raise RuntimeError(f"expected {n + 1} one-token steps, saw {len(its)}")
        return its[-1]["t_end"] - its[0]["t_end"]

    n = spec["decode_tokens"]
    layers = model.model.layers
    for th in spec["threads"]:
        torch.set_num_threads(th)
        if kernels is not None:
            kernels.set_num_threads(th)
        enter(f"the warm-up generation ({th} threads)")
        gen(spec["warm_ids"], spec["warm_tokens"], Stamp())
        if eng is not None:
            eng.reset_stats()
        enter(f"the timed generation ({th} threads)")
        st = gen(spec["prompt_ids"], n, Stamp())
        r: dict[str, Any] = {"tok_per_s": n / (st.t[-1] - st.t[0]),
                             "decode_s": st.t[-1] - st.t[0]}
        if eng is not None:
            # specmoe's own loop (plain greedy decoding): the row's figure; transformers'
            # generate loop, timed just before, is reported beside it
            r["tok_per_s_model_generate"] = r["tok_per_s"]
            enter(f"the timed specmoe.generate ({th} threads)")
            gen_specmoe(spec["warm_ids"], spec["warm_tokens"])
            d = gen_specmoe(spec["prompt_ids"], n)
            r["tok_per_s"], r["decode_s"] = n / d, d
            r["loop"] = "specmoe.generate"
        if eng is not None:
            s = eng.stats()
            r["hit_rate"] = s.get("hit_rate")
            r["misses"] = s.get("misses")
        # ---- instrumented generation: where a decode step goes
        enter(f"the instrumented generation ({th} threads)")
        acc = _Acc()
        for lyr in layers:
            acc.hook(lyr.self_attn, "attention")
            acc.hook(lyr.mlp, "mlp")
            if hasattr(lyr.mlp, "experts"):
                acc.hook(lyr.mlp.experts, "experts_module")
        acc.hook(model.lm_head, "lm_head")
        c = dc = ab = None
        from layer_overhead import _Proxy, _timed
        from specmoe.models.layers import CLinear, chain_step
        clin = [m for m in model.modules() if isinstance(m, CLinear)]
        # decoder layers fused into one C call each (specmoe.models.attention): that call hands the
        # Engine's C layer object to C, so it is not proxied; the call reports its own split
        fused = any(getattr(chain_step(lyr), "norms", None) is not None
                    for lyr in layers)
        blocks = [lyr.self_attn for lyr in layers
                  if getattr(lyr.self_attn, "_specmoe_block", None) is not None]
        mlabs = [lyr for lyr in layers if getattr(lyr, "_specmoe_mlab", None) is not None]
        fused_mla = list(mlabs)
        if eng is not None and not fused:
            c = {"t": 0.0, "n": 0, "routed": {"t": 0.0, "n": 0}}
            eng._layers = _Proxy(eng._layers, c)
            # MoE blocks routed in C (hf.Engine._install_routing): routing, experts and a
            # DeepSeek block's shared MLP in one forward_routed call, timed on its own
            eng._layers.forward_routed = _timed(eng._layers.inner.forward_routed, c["routed"])
        # a decode step runs consecutive one-call layers in one _C.layer_chain call
        # (specmoe.models.decode_step), which reports their attention / MoE split as the layer calls
        # do: it is timed instead of those layers' blocks (a wrapped block is not chained)
        from specmoe.models.decode_step import decode_step_of
        dstep = decode_step_of(model)
        chained = dstep is not None and dstep.chaining
        if chained:
            def routed(lyr: Any) -> bool:
                return getattr(lyr.mlp, "_specmoe_route", None) is not None
            blocks = [lyr.self_attn for lyr in layers
                      if any(lyr.self_attn is a for a in blocks) and not routed(lyr)]
            mlabs = [lyr for lyr in mlabs if not routed(lyr)]
        if blocks or mlabs or chained:
            ab = {"attn": 0.0, "moe": 0.0, "mlp": 0.0}
            for a in blocks:
                a._specmoe_block = _BlockTimer(a._specmoe_block, ab)
            for lyr in mlabs:  # an MlaBlockRef: its block timed
                lyr._specmoe_mlab = lyr._specmoe_mlab._replace(
                    block=_BlockTimer(lyr._specmoe_mlab.block, ab))
            if chained:
                dstep.chain = _ChainTimer(dstep.chain, ab)
                dstep.plan_step = _ChainTimer(dstep.plan_step, ab)
        # MLA's absorbed attention in C (specmoe.models.mla), where a layer is not one call: its C
        # time counts as attention C (a fused layer's MLABlock holds the kernel itself)
        mlas = [m._specmoe_mla.weights for m in model.modules()
                if getattr(getattr(getattr(m, "_specmoe_mla", None), "weights", None), "kernel",
                           None) is not None
                and not any(lyr.self_attn is m for lyr in fused_mla)]
        # and so does the models' own attention kernel where a module calls it (not fused)
        attns = [m for m in model.modules() if getattr(m, "_specmoe_attn", None) is not None]
        mc = {"t": 0.0, "n": 0} if mlas or attns else None
        for w in mlas:
            w.kernel = _Proxy(w.kernel, mc)
        for m in attns:
            m._specmoe_attn = _Proxy(m._specmoe_attn, mc)
        if clin:  # the dense layers' C calls (attention projections, shared/dense MLP, lm_head)
            dc = {"t": 0.0, "n": 0}
            for m in clin:
                m._c = _Proxy(m._c, dc)
        try:
            sti = gen(spec["prompt_ids"], n, Stamp(acc, c, dc, ab, mc))
        finally:
            acc.remove()
            if eng is not None and c is not None:
                eng._layers = eng._layers.inner
            for m in clin:
                m._c = m._c.inner
            for a in blocks:
                a._specmoe_block = a._specmoe_block.inner
            for lyr in mlabs:
                lyr._specmoe_mlab = lyr._specmoe_mlab._replace(block=lyr._specmoe_mlab.block.inner)
            if chained:
                dstep.chain = dstep.chain.inner
                dstep.plan_step = dstep.plan_step.inner
            for w in mlas:
                w.kernel = w.kernel.inner
            for m in attns:
                m._specmoe_attn = m._specmoe_attn.inner
        step = (sti.t[-1] - sti.t[0]) / n

        def per_step(k: str) -> float:
            return (sti.snap[-1].get(k, 0.0) - sti.snap[0].get(k, 0.0)) / n

        attn, mlp, exm, lm = (per_step("attention"), per_step("mlp"),
                              per_step("experts_module"), per_step("lm_head"))
        if eng is not None and fused:
            # one C call per decoder layer: attention and experts are the C time of its two
            # parts (with the fused attention's pre/post calls of a prefill-free step: none);
            # everything else -- embeddings, the final norm, the Python around each layer
            # call, KV bookkeeping, lm_head's glue, generate -- is "other"
            attn_c, exc = per_step("attn_c"), per_step("moe_c") + per_step("experts_c")
            mlp_c = per_step("mlp_c")
            parts = {"attention": attn_c, "experts": exc, "lm_head": lm,
                     "other": step - attn_c - exc - mlp_c - mlp - lm}
            if mlp_c:  # a dense layer's MLP inside its call (DeepSeek's dense first layer)
                parts["dense_mlp_in_the_call"] = mlp_c
            if mlp:  # MLPs called from Python after the attention's call (a block routed in
                # Python; before the dense layers' calls took theirs): their module time
                parts["mlp_outside_the_call"] = mlp
            r["breakdown_kind"] = "fused layers: attention and experts are C time"
            r["outside_experts_share"] = 1 - exc / step
            r["glue_share"] = parts["other"] / step
            dense_c = per_step("dense_c")
            r["dense_c_ms_per_step"] = dense_c * 1e3
            r["outside_c_kernels_share"] = 1 - (exc + attn_c + mlp_c + dense_c) / step
        elif eng is not None:
            # routed blocks (rtc): their one C call holds the routing, the experts and, for
            # DeepSeek, the shared MLP -- counted as experts here, as C time below
            exc, rtc = per_step("experts_c"), per_step("routed_c")
            attn_c = per_step("attn_c")
            parts = {"attention": attn, "experts": exc + rtc, "experts_glue": exm - exc,
                     "router_shared_dense": mlp - exm - rtc, "lm_head": lm,
                     "other": step - attn - mlp - lm}
            if rtc:
                r["breakdown_kind"] = ("MoE blocks routed in C: experts include their "
                                       "routing and shared MLP")
            r["outside_experts_share"] = 1 - (exc + rtc) / step
            r["glue_share"] = (parts["experts_glue"] + parts["other"]) / step
            if dc is not None:
                dense_c = per_step("dense_c")
                r["dense_c_ms_per_step"] = dense_c * 1e3
                r["outside_c_kernels_share"] = 1 - (exc + rtc + dense_c + attn_c) / step
        else:
            parts = {"attention": attn, "experts": exm, "router_shared_dense": mlp - exm,
                     "lm_head": lm, "other": step - attn - mlp - lm}
            r["outside_experts_share"] = 1 - exm / step
            r["glue_share"] = parts["other"] / step
        r["breakdown"] = {k: {"ms_per_step": v * 1e3, "share": v / step}
                          for k, v in parts.items()}
        r["step_ms_instrumented"] = step * 1e3
        r["tok_per_s_instrumented"] = 1 / step
        res["threads"][str(th)] = r
    if eng is not None:
        eng.close()
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            res["vmhwm_bytes"] = int(line.split()[1]) * 1024
    Path(spec["result"]).write_text(json.dumps(res))


def run_python(name: str, spec: dict[str, Any], work: Path, timeout: float) -> dict[str, Any]:
    """One python row in its own process; {threads: result} or {"error": ...}."""
    spec_path, result = work / f"spec-{name}.json", work / f"result-{name}.json"
    phase = Path(str(result) + ".phase")
    result.unlink(missing_ok=True)
    phase.unlink(missing_ok=True)
    spec["result"] = str(result)
    spec_path.write_text(json.dumps(spec))
    env = dict(os.environ, OMP_NUM_THREADS=str(max(spec["threads"])),
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    r = bm.run_process([sys.executable, str(Path(__file__).resolve()), "--_worker",
                        str(spec_path)], None, timeout, env=env)
    if r["rc"] != 0 or not result.is_file():
        where = phase.read_text() if phase.is_file() else "start-up"
        return {"error": bm._fail_reason(r, None, f"{name} (during {where})")}
    res = json.loads(result.read_text())
    out = {}
    for th, x in res["threads"].items():
        x.update(peak_rss_bytes=res.get("vmhwm_bytes", r["maxrss_bytes"]), load_s=res["load_s"])
        out[int(th)] = x
    return out


# --------------------------------------------------------------------------------------------
# main


def targets_of(rows_out: list[dict[str, Any]]) -> dict[str, Any]:
    """The issue's targets over the rows: met or not, with the worst figure."""
    sm = [r for r in rows_out if r["kind"] == "specmoe"]

    def summary(vals: list[tuple[str, float | None]], goal: float, higher: bool = True
                ) -> dict[str, Any]:
        got = [v for _, v in vals if v is not None]
        worst = (min(got) if higher else max(got)) if got else None
        return {"value": worst, "target": goal,
                "met": (all((v >= goal) if higher else (v <= goal) for v in got)
                        if got and len(got) == len(vals) else None),
                "per_row": {k: (round(v, 3) if v is not None else None) for k, v in vals}}

    def key(r: dict[str, Any]) -> str:
        return f"{r['model']} {r['name']} t{r['threads']}"

    dsv = [r for r in sm if r["model"] == "dsv2lite"]
    eq = [r for r in sm if r.get("dense") == r["precision"]]  # all weights at the precision
    ex = [r for r in sm if r.get("dense") != r["precision"]]
    return {
        "specmoe >= 1.0x llama.cpp at equal precision of all weights (specmoe+dense rows; "
        "every model, precision, threads; value = worst)":
            summary([(key(r), r.get("vs_llama_cpp")) for r in eq], 1.0),
        "for information: experts-only rows (dense layers in torch) vs llama.cpp "
        "(value = worst)": summary([(key(r), r.get("vs_llama_cpp")) for r in ex], 1.0),
        "specmoe >= 1.5x unmodified torch (value = worst)":
            summary([(key(r), r.get("vs_torch")) for r in sm], 1.5),
        "dsv2lite: share of a specmoe decode step outside the expert kernels <= 0.25 "
        "(value = worst)": summary([(key(r), r.get("outside_experts_share")) for r in dsv],
                                    0.25, higher=False),
        "dsv2lite, specmoe+dense rows: share of a decode step outside specmoe's C kernels "
        "(experts and dense layers) <= 0.25 (value = worst)":
            summary([(key(r), r.get("outside_c_kernels_share")) for r in dsv
                     if r.get("outside_c_kernels_share") is not None], 0.25, higher=False),
        "dsv2lite, for information: glue-only share (expert-call glue + other, excluding "
        "attention, lm_head, router/shared/dense matmuls) <= 0.25 (value = worst)":
            summary([(key(r), r.get("glue_share")) for r in dsv], 0.25, higher=False),
    }


def read_ceiling(threads: list[int], quick: bool = False, reps: int = 3) -> dict[int, float]:
    """The DRAM read ceiling, GB/s, at each thread count: ``KernelContext.read_bw`` over a
    1 GiB buffer (far beyond the last-level cache), ``reps`` reads per count, the counts
    alternating, median (``quick``: 256 MiB, which the last-level cache may partly serve).
    The buffer is touched once before timing and freed on return."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from specmoe import _C
    buf = np.ones((256 << 20) if quick else (1 << 30), np.uint8)
    ctxs = {t: _C.KernelContext(t) for t in threads}
    ctxs[threads[0]].read_bw(buf, 1)
    got: dict[int, list[float]] = {t: [] for t in threads}
    for _ in range(reps):
        for t in threads:
            got[t].append(ctxs[t].read_bw(buf, 1) / 1e9)
    del buf
    return {t: statistics.median(v) for t, v in got.items()}


def _median(xs: list[Any]) -> float | None:
    v = [x for x in xs if x is not None]
    return statistics.median(v) if v else None


def prepare(model: str, cfg: dict[str, Any], a: argparse.Namespace, rows: list[dict[str, Any]],
            lc: bm.LlamaCpp | None) -> dict[str, Any]:
    """Checkpoint, prompts, specmoe stores, GGUF files of one model; errors per row."""
    chash = bm.config_hash(cfg, a.seed, a.router_skew)
    root = Path(a.workdir).expanduser() / (f"{model}-L{cfg['num_hidden_layers']}-"
                                           f"V{cfg['vocab_size']}-{chash}")
    ckpt, work = root / "ckpt", root / "run"
    work.mkdir(parents=True, exist_ok=True)
    bm.write_checkpoint(ckpt, cfg, a.seed, a.router_skew)
    prompt_ids, warm_ids = bm.make_prompts(ckpt, a.prompt_tokens, a.seed)
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(ckpt))
    prep: dict[str, Any] = {"root": root, "ckpt": ckpt, "work": work, "prompt_ids": prompt_ids,
                            "warm_ids": warm_ids, "prompt_txt": tok.decode(prompt_ids),
                            "warm_txt": tok.decode(warm_ids), "err": {}, "store": {},
                            "gguf": {}}
    for r in rows:
        if r["kind"] == "specmoe" and "gguf" not in r:
            p = root / f"store-{r['precision']}.smoe"
            errs = prep.setdefault("store_err", {})  # one conversion per precision
            if r["precision"] not in errs and not p.is_file():
                errs[r["precision"]] = bm.convert_store(ckpt, r["precision"], p, a.row_timeout)
            if errs.get(r["precision"]):
                prep["err"][r["name"]] = errs[r["precision"]]
            prep["store"][r["name"]] = p
    ll = [r for r in rows if r["kind"] == "llama.cpp" or "gguf" in r]
    if ll:
        if lc is None or lc.error:
            for r in ll:
                prep["err"][r["name"]] = lc.error if lc else "llama.cpp unavailable"
        else:
            # the converter's bf16 GGUF is the BF16 row; the others are quantized from it
            # (convert writes it only when some type is missing: ask for BF16 if alone)
            types = sorted({r.get("type") or r["gguf"] for r in ll} - {"BF16"}) or ["BF16"]
            got = lc.convert(ckpt, root / "gguf", types, chash, keep_bf16=True)
            bf16 = root / "gguf" / "model-bf16.gguf"
            if "BF16" not in got:
                got["BF16"] = bf16 if bf16.is_file() else "the bf16 GGUF was not written"
            for r in ll:
                g = got.get(r.get("type") or r["gguf"])
                if not isinstance(g, Path):
                    prep["err"][r["name"]] = str(g)
                    continue
                prep["gguf"][r["name"]] = g
                if "gguf" in r:  # specmoe's store of that very file
                    p = root / f"store-gguf-{r['gguf']}.smoe"
                    err = None if p.is_file() else bm.convert_store(g, "auto", p,
                                                                     a.row_timeout)
                    if err:
                        prep["err"][r["name"]] = err
                    prep["store"][r["name"]] = p
    return prep


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    ap.add_argument("--quick", action="store_true",
                    help="tiny shapes (hidden 256, 16 experts, 2 layers), 1 round, 4 warm tokens")
    ap.add_argument("--models", default="olmoe,dsv2lite")
    ap.add_argument("--olmoe-layers", type=int, default=4)
    ap.add_argument("--dsv2-layers", type=int, default=4, help="the first one is dense")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompt-tokens", type=int, default=PROMPT_TOKENS,
                    help="tokens of the timed and the warm-up prompts: the cached positions "
                    "every decode step attends to")
    ap.add_argument("--warm-tokens", type=int, default=8,
                    help="tokens of the warm-up generation (python rows)")
    ap.add_argument("--rows", default="torch-f32,torch-bf16,specmoe-f32,specmoe-bf16,"
                    "specmoe-int8,specmoe-int4,specmoe+dense-f32,specmoe+dense-bf16,"
                    "specmoe+dense-int8,specmoe+dense-int4,llama.cpp-F32,llama.cpp-BF16,"
                    "llama.cpp-Q8_0,llama.cpp-Q4_0",
                    help="comma-separated subset, in first-round order")
    bm.add_peer_arguments(ap)
    ap.add_argument("--router-skew", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--row-timeout", type=float, default=1800.0)
    ap.add_argument("--cleanup", action="store_true",
                    help="delete a model's stores and GGUF files after its rounds")
    ap.add_argument("--save", help="also write the JSON object to this file (after each model)")
    ap.add_argument("--_worker", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._worker:
        worker(a._worker)
        return
    if a.quick:
        a.olmoe_layers, a.dsv2_layers, a.repeats = 2, 2, 1
        a.warm_tokens = min(a.warm_tokens, 4)
    threads = [int(t) for t in a.threads.split(",") if t.strip()]
    models = [m.strip() for m in a.models.split(",") if m.strip()]
    for m in models:
        if m not in ("olmoe", "dsv2lite"):
            ap.error(f"unknown model {m} (olmoe, dsv2lite)")
    if a.dsv2_layers < 2:
        ap.error("--dsv2-layers must be >= 2 (layer 0 is dense)")
    if not 1 <= a.prompt_tokens <= 32768:
        ap.error("--prompt-tokens must be in 1..32768")

    rows_def: list[dict[str, Any]] = []
    for n in (x.strip() for x in a.rows.split(",") if x.strip()):
        kind, _, p = n.partition("-")
        if kind == "torch" and p in ("f32", "bf16"):
            rows_def.append({"name": n, "kind": "torch", "precision": p, "torch_dtype": p})
        elif kind == "specmoe" and p in SPECMOE_PRECS:
            rows_def.append({"name": n, "kind": "specmoe", "precision": p,
                             "torch_dtype": TORCH_OF[p], "dense": "torch"})
        elif kind == "specmoe+dense" and p == "gguf-Q4_0":  # llama.cpp-Q4_0's own file
            rows_def.append({"name": n, "kind": "specmoe", "precision": "int4",
                             "torch_dtype": "bf16", "dense": "int4", "gguf": "Q4_0"})
        elif kind == "specmoe+gguf" and p in ("Q4_0", "Q8_0"):  # every weight as the file's
            rows_def.append({"name": n, "kind": "specmoe",
                             "precision": "int4" if p == "Q4_0" else "int8",
                             "torch_dtype": "bf16", "dense": "gguf", "gguf": p})
        elif kind == "specmoe+dense" and p in SPECMOE_PRECS:
            rows_def.append({"name": n, "kind": "specmoe", "precision": p,
                             "torch_dtype": TORCH_OF[p], "dense": p})
        elif kind == "llama.cpp" and p in LLAMA_OF.values():
            rows_def.append({"name": n, "kind": "llama.cpp", "type": p,
                             "precision": {v: k for k, v in LLAMA_OF.items()}[p]})
        else:
            ap.error(f"unknown row {n}")

    lc = None
    # llama.cpp's context: the prompt, the decoded tokens and some room, in whole 256s
    llama_ctx = max(256, -(-(a.prompt_tokens + DECODE_TOKENS + 16) // 256) * 256)
    # llama.cpp's rows run its binaries; the specmoe rows of a GGUF file need its converter
    if any(r["kind"] == "llama.cpp" or "gguf" in r for r in rows_def):
        lc = bm.LlamaCpp(Path(a.peers).expanduser(), not a.no_build_peers, max(threads),
                         a.llama_isa)

    t_start = time.time()
    config: dict[str, Any] = {
        "method": "random-weight checkpoints at real MoE shapes, all experts resident; "
                  "interleaved rounds (row order rotated per round), medians; ratios within "
                  "a round",
        "precision_note": "specmoe-<p> rows quantize only the routed experts (attention, "
                          "router, shared experts, dense FFN, embeddings and lm_head stay in "
                          "torch at torch_dtype: bf16 for int8/int4, f32 for f32); "
                          "specmoe+dense-<p> rows also run every dense linear layer except the "
                          "routers through specmoe's C kernels at <p> (specmoe.models.dense); "
                          "llama.cpp (llama-quantize defaults) quantizes every weight matrix "
                          "(its output matrix gets its own type, e.g. Q6_K for Q4_0).",
        "threads": threads, "repeats": a.repeats, "prompt_tokens": a.prompt_tokens,
        "decode_tokens": DECODE_TOKENS, "warm_tokens": a.warm_tokens, "quick": a.quick,
        "router_skew": a.router_skew, "seed": a.seed,
        "specmoe": {"cache": 1.0, "policy": "lru", "prefetch": False, "warmed": True,
                    "torch_dtype": TORCH_OF},
        "torch": "transformers AutoModelForCausalLM.from_pretrained(experts_implementation="
                 "'eager')",
        "host": hostinfo.host(threads),
        "llama_cpp": {"bin": str(lc.bin) if lc else None, "isa": a.llama_isa, "mmap": True,
                      "ctx": llama_ctx,
                      "warmup": "a separate llama-completion process on another prompt"},
        "pairing": {"vs_llama_cpp": LLAMA_OF,
                    "vs_torch": {**{f"specmoe-{p}": f"torch-{TORCH_OF[p]}" for p in SPECMOE_PRECS},
                                 **{f"llama.cpp-{LLAMA_OF[p]}": f"torch-{TORCH_OF[p]}"
                                    for p in SPECMOE_PRECS}}},
        "models": {}, "loadavg_start": os.getloadavg(),
    }
    rows_out: list[dict[str, Any]] = []
    for model in models:
        cfg = (olmoe_config(a.olmoe_layers, 16384 if a.quick else 50304, a.quick)
               if model == "olmoe" else
               dsv2_config(a.dsv2_layers, 16384 if a.quick else 102400, a.quick))
        config["models"][model] = model_summary(cfg)
        t0 = time.time()
        prep = prepare(model, cfg, a, rows_def, lc)
        config["models"][model]["checkpoint"] = str(prep["ckpt"])
        config["models"][model]["setup_s"] = round(time.time() - t0, 1)
        # runs[name][threads] = list over rounds of result dicts
        runs: dict[str, dict[int, list[dict[str, Any]]]] = {
            r["name"]: {t: [] for t in threads} for r in rows_def}
        round_s = []
        ceilings: list[dict[int, float]] = []
        for rep in range(a.repeats):
            tr0 = time.time()
            ceilings.append(read_ceiling(threads, a.quick))
            log(f"{model} round {rep + 1}/{a.repeats}: DRAM read ceiling "
                + ", ".join(f"{t} threads {g:.1f} GB/s" for t, g in ceilings[-1].items()))
            k = rep % len(rows_def)
            ths = threads if rep % 2 == 0 else threads[::-1]
            for r in rows_def[k:] + rows_def[:k]:
                name = r["name"]
                if name in prep["err"]:
                    for t in threads:
                        runs[name][t].append({"error": prep["err"][name]})
                    continue
                log(f"{model} round {rep + 1}/{a.repeats}: {name} (threads {ths})")
                try:
                    if r["kind"] == "llama.cpp":
                        assert lc is not None
                        res: dict[Any, Any] = {}
                        for t in ths:
                            res[t] = lc.run_row(prep["gguf"][name], prep["prompt_txt"],
                                                prep["warm_txt"], t, None, prep["work"],
                                                a.row_timeout, ctx=llama_ctx)
                    else:
                        spec = {"kind": r["kind"], "dense": r.get("dense"),
                                "ckpt": str(prep["gguf"][name] if "gguf" in r
                                            else prep["ckpt"]),
                                "dtype": "auto" if "gguf" in r else r["precision"],
                                "torch_dtype": r["torch_dtype"],
                                "store": str(prep["store"].get(name, "")), "threads": ths,
                                "prompt_ids": prep["prompt_ids"], "warm_ids": prep["warm_ids"],
                                "decode_tokens": DECODE_TOKENS, "warm_tokens": a.warm_tokens}
                        res = run_python(f"{model}-{name}", spec, prep["work"], a.row_timeout)
                        if "error" in res:
                            res = {t: {"error": res["error"]} for t in threads}
                except Exception as e:  # noqa: BLE001 -- recorded in the row
                    res = {t: {"error": f"{type(e).__name__}: {e}"} for t in threads}
                for t in threads:
                    x = res.get(t, {"error": "no result"})
                    runs[name][t].append(x)
                    if "error" in x:
                        log(f"  {t} threads: error: {x['error']}")
                    else:
                        extra = (f", outside experts {x['outside_experts_share']:.0%}"
                                 if "outside_experts_share" in x else "")
                        log(f"  {t} threads: {x['tok_per_s']:.2f} tok/s, peak RSS "
                            f"{x['peak_rss_bytes'] / MiB:.0f} MiB{extra}")
            round_s.append(round(time.time() - tr0, 1))
        config["models"][model]["round_s"] = round_s
        tmax = max(threads)
        config["models"][model]["read_ceiling_gbps"] = {
            t: round(_median([c[t] for c in ceilings]) or 0.0, 2) for t in threads}
        if tmax > 1 and 1 in threads:
            config["models"][model]["read_ceiling_scaling"] = _median(
                [c[tmax] / c[1] for c in ceilings])

        def ratio(rep: int, t: int, name: str, other: str | None) -> float | None:
            if other is None or other not in runs:
                return None
            x, y = runs[name][t][rep].get("tok_per_s"), runs[other][t][rep].get("tok_per_s")
            return x / y if x and y else None

        for r in rows_def:
            name = r["name"]
            peer = f"llama.cpp-{LLAMA_OF[r['precision']]}" if r["kind"] == "specmoe" else None
            tpeer = (name if r["kind"] == "torch" else
                     f"torch-{TORCH_OF[r['precision']]}")  # llama.cpp too, for information
            for t in threads:
                rr = runs[name][t]
                ok = [x for x in rr if "error" not in x]
                row: dict[str, Any] = {"model": model, "name": name, "kind": r["kind"],
                                       "precision": r["precision"], "threads": t}
                if r["kind"] == "llama.cpp":
                    row["gguf_type"] = r["type"]
                else:
                    row["torch_dtype"] = r["torch_dtype"]
                if r["kind"] == "specmoe":
                    row["dense"] = r["dense"]
                    if "gguf" in r:
                        row["same_file_as"] = f"llama.cpp-{r['gguf']}"
                if not ok:
                    row.update(tok_per_s=None, vs_llama_cpp=None, vs_torch=None,
                               peak_rss_bytes=None, error=rr[0]["error"] if rr else "not run")
                    rows_out.append(row)
                    continue
                row["tok_per_s"] = _median([x["tok_per_s"] for x in ok])
                row["tok_per_s_runs"] = [x.get("tok_per_s") for x in rr]
                per_round = [ratio(i, t, name, peer) for i in range(len(rr))] if peer else None
                row["vs_llama_cpp"] = _median(per_round) if per_round else None
                # the ratio of each interleaved round, in round order (None: a side failed)
                row["vs_llama_cpp_runs"] = ([None if v is None else round(v, 4)
                                             for v in per_round] if per_round else None)
                row["vs_torch"] = _median([ratio(i, t, name, tpeer)
                                           for i in range(len(rr))]) if tpeer else None
                row["peak_rss_bytes"] = _median([x.get("peak_rss_bytes") for x in ok])
                for key in ("load_s", "hit_rate", "outside_experts_share", "glue_share",
                            "outside_c_kernels_share", "dense_c_ms_per_step",
                            "step_ms_instrumented", "tok_per_s_instrumented",
                            "tok_per_s_model_generate", "gguf_bytes",
                            "prompt_tokens_seen", "decode_tokens"):
                    v = _median([x.get(key) for x in ok])
                    if v is not None:
                        row[key] = v
                if "loop" in ok[0]:
                    row["loop"] = ok[0]["loop"]
                if "breakdown_kind" in ok[0]:
                    row["breakdown_kind"] = ok[0]["breakdown_kind"]
                if "breakdown" in ok[0]:
                    row["breakdown"] = {
                        c: {f: _median([x["breakdown"][c][f] for x in ok])
                            for f in ("ms_per_step", "share")}
                        for c in ok[0]["breakdown"]}
                if r["kind"] == "llama.cpp":
                    notes = [x["note"] for x in ok if "note" in x]
                    if notes:
                        row["note"] = notes[0]
                if t == tmax and tmax > 1 and 1 in threads:
                    row["thread_scaling"] = _median([
                        x.get("tok_per_s") / y.get("tok_per_s")
                        if x.get("tok_per_s") and y.get("tok_per_s") else None
                        for x, y in zip(runs[name][t], runs[name][1])])
                errs = [x["error"] for x in rr if "error" in x]
                if errs:
                    row["errors"] = errs
                rows_out.append(row)
        if a.cleanup:
            for p in list(prep["store"].values()) + [prep["root"] / "gguf"]:
                if p.is_dir():
                    shutil.rmtree(p, ignore_errors=True)
                elif p.is_file():
                    p.unlink()
            log(f"{model}: stores and GGUF files deleted (--cleanup)")
        if a.save:  # what is done so far, in case a later model fails or is cut off
            Path(a.save).write_text(json.dumps(
                {"config": config, "rows": rows_out, "targets": targets_of(rows_out),
                 "partial": True}, indent=1) + "\n")

    config["wall_s"] = round(time.time() - t_start, 1)
    config["loadavg_end"] = os.getloadavg()
    targets = targets_of(rows_out)
    result = {"config": config, "rows": rows_out, "targets": targets}
    if a.save:
        Path(a.save).write_text(json.dumps(result, indent=1) + "\n")
    if a.json:
        print(json.dumps(result))
    else:
        for r in rows_out:
            if r.get("error"):
                print(f"{r['model']:<9} {r['name']:<15} t{r['threads']} ERROR {r['error']}")
                continue
            vl, vt = r.get("vs_llama_cpp"), r.get("vs_torch")
            print(f"{r['model']:<9} {r['name']:<15} t{r['threads']} {r['tok_per_s']:8.2f} tok/s"
                  f"  vs llama.cpp {vl if vl is None else round(vl, 2)}"
                  f"  vs torch {vt if vt is None else round(vt, 2)}"
                  f"  peak RSS {r['peak_rss_bytes'] / MiB:6.0f} MiB"
                  + (f"  outside experts {r['outside_experts_share']:.0%}"
                     if "outside_experts_share" in r else "")
                  + (f"  scaling {r['thread_scaling']:.2f}x"
                     if r.get("thread_scaling") is not None else ""))
        for m, c in config["models"].items():
            if "read_ceiling_gbps" in c:
                print(f"{m:<9} DRAM read ceiling (GB/s by threads) {c['read_ceiling_gbps']}"
                      + (f", scaling {c['read_ceiling_scaling']:.2f}x"
                         if c.get("read_ceiling_scaling") else ""))
        for k, v in targets.items():
            print(f"target {k}: value {v['value']} met {v['met']}")


if __name__ == "__main__":
    main()

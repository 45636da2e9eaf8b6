"""Decode tokens/s with offloaded experts on DeepSeek-V2-Lite expert shapes.

Model: a transformers DeepSeek-V3-architecture model with DeepSeek-V2-Lite's routed-expert shapes
(hidden 2048, expert FFN 1408, 64 experts, top-6, 2 shared experts), ``--layers`` MoE layers
(8 by default), a minimal attention, random bf16 weights.  Routing is replayed from the real
DeepSeek-V2-Lite trace (``../shared/traces/deepseek-v2-lite-puffin``, or the test subset): each
MoE layer's router is replaced by one that returns the recorded top-6 of the current token for
that layer (uniform weights), so the expert access pattern is the real one.

Rows (same model, same tokens):
* ``torch``: unmodified, every expert in RAM, transformers' eager experts.
* ``specmoe``: experts in a store file read with O_DIRECT; cache 100%, 25%, 10% of the experts;
  LRU and the best other policy available; without and with prefetch.  The prefetch predictor
  here cannot be the next layer's router (routing is replayed), so it is the previous token's
  experts at the next layer (temporal locality), which uses no future information.
* ``accelerate``: accelerate's ``disk_offload`` of the same model (the peer).

Method.  This machine is shared and drifts, so one short run per row means little (single
10-token runs varied up to 2x).  All three models stay alive for the whole run (torch's experts
are the original modules, swapped back in for torch rows; the specmoe cache is freed between
rows), and the rows are measured in ``--repeats`` rounds: every round runs every row once, and
the order is rotated by ``n_rows / repeats`` positions each round, so drift and load bursts spread
over all rows instead of landing on a few.  Every specmoe run starts from a new cold cache
(100%: preloaded untimed, kept between the two adjacent 100% rows) and decodes ``--warm``
untimed tokens, then ``--tokens`` timed ones; torch runs the same tokens; accelerate times
``--accel-tokens`` (it reads every weight per token: nothing to warm).  ``tok_per_s`` is the
median over rounds and ``tok_per_s_runs`` the rounds in order; ``vs_torch`` / ``vs_accelerate``
are computed within each round (against that round's torch / accelerate run) and reported as
the median over rounds, with ``_min`` / ``_max`` giving their spread.  Cache statistics are
medians over rounds.  The defaults (3 rounds, 4 + 10 tokens, one thread) took 7.5 minutes on
the shared 2-core VM at load 2 and 13 at load 3: 1.5-2.5 minutes of setup (the store and
accelerate's folder, 9 GB each, are written), then 2-4.5 minutes a round, a large part of it
disk reads (accelerate reads 9 GB per token; the 100% rows preload 9 GB untimed);
``--repeats 2`` saves one round.
Memory: torch's resident experts plus at most one specmoe cache (at 100%: twice the routed
experts, about 18 GB at 8 layers).  accelerate's folder is written at setup, minutes before its
first run, so it is read cold from disk like specmoe's store (the single-pass version ran it
right after writing its folder: 0.055 tok/s then, 0.009-0.03 in these rounds).  Even medians of whole runs still moved up to 2x
between two runs on this machine (torch's own speed did): read a ratio with its min/max.

``--json`` prints one JSON object: {"config": ..., "rows": [{name, cache_frac, policy, prefetch,
tok_per_s, tok_per_s_runs, vs_torch, vs_torch_min, vs_torch_max, vs_accelerate,
vs_accelerate_min, vs_accelerate_max, ...}]}.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
import warnings
from pathlib import Path

import hostinfo  # noqa: E402,F401  (before torch: its OpenMP wait policy)

import numpy as np
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specmoe.runtime import engine as hf  # noqa: E402
from specmoe.sim.traces import load_puffin  # noqa: E402

HIDDEN, FFN, EXPERTS, TOPK = 2048, 1408, 64, 6
TRACES = [Path(__file__).resolve().parents[1] / ".." / "shared" / "traces" / "deepseek-v2-lite-puffin",
          Path("/work/shared/traces/deepseek-v2-lite-puffin"),
          Path(__file__).resolve().parents[1] / "tests" / "data" / "puffin"]


class Replay:
    """Shared cursor into the trace: token ``t``; ``experts[t, layer]`` are the routed ids."""

    def __init__(self, experts: np.ndarray):
        self.experts = torch.from_numpy(experts.astype(np.int64))
        self.t = 0


class ReplayRouter(nn.Module):
    """Stands in for DeepseekV3TopkRouter: returns the recorded experts of the current token."""

    def __init__(self, replay: Replay, layer: int):
        super().__init__()
        self.replay, self.layer = replay, layer
        self.weight = nn.Parameter(torch.zeros(EXPERTS, HIDDEN), requires_grad=False)
        self.register_buffer("e_score_correction_bias", torch.zeros(EXPERTS))

    def forward(self, hidden_states):
        T = hidden_states.reshape(-1, HIDDEN).shape[0]
        idx = self.replay.experts[self.replay.t:self.replay.t + T, self.layer]
        w = torch.full(idx.shape, 1.0 / TOPK, dtype=torch.float32)
        return torch.zeros(T, EXPERTS), w, idx


def build(layers: int, replay: Replay, seed: int = 0, weights: bool = True) -> nn.Module:
    """The benchmark model; ``weights=False`` leaves the parameters on the meta device (buffers
    real), for accelerate to load from its offload folder."""
    import transformers as tf
    cfg = tf.DeepseekV3Config(
        vocab_size=256, hidden_size=HIDDEN, intermediate_size=FFN * 2, moe_intermediate_size=FFN,
        num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2,
        n_routed_experts=EXPERTS, num_experts_per_tok=TOPK, n_shared_experts=2,
        first_k_dense_replace=0, n_group=1, topk_group=1, q_lora_rank=None, kv_lora_rank=32,
        qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=32, max_position_embeddings=4096,
        tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(cfg, experts_implementation="eager",
                                                    dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(seed)
    pool = (torch.randn(1 << 23, generator=g) * 0.02).to(torch.bfloat16)
    rng = np.random.default_rng(seed)

    def fill(shape):
        n = int(np.prod(shape))
        out = torch.empty(n, dtype=torch.bfloat16)
        pos = 0
        while pos < n:  # tiles of the random pool at random offsets: cheap, not degenerate
            off = int(rng.integers(0, pool.numel() // 2))
            m = min(n - pos, pool.numel() - off)
            out[pos:pos + m] = pool[off:off + m]
            pos += m
        return out.view(shape)

    for name, mod in list(model.named_modules()):
        for pname, p in list(mod.named_parameters(recurse=False) if weights else []):
            t = torch.ones(p.shape, dtype=p.dtype) if "norm" in pname or "norm" in name.split(".")[-1] \
                else fill(p.shape)
            setattr(mod, pname, nn.Parameter(t, requires_grad=False))
        for bname, b in list(mod.named_buffers(recurse=False)):
            mod.register_buffer(bname, torch.zeros(b.shape, dtype=b.dtype) if b.is_meta else b)
    model.model.rotary_emb = type(model.model.rotary_emb)(cfg)
    for i, layer in enumerate(model.model.layers):
        layer.mlp.gate = ReplayRouter(replay, i)
    return model.eval()


def decode(model: nn.Module, replay: Replay, tokens: int, warm: int = 2) -> float:
    """Feed `warm + tokens` tokens one at a time (KV cache on); tokens/s over the last `tokens`."""
    from transformers import DynamicCache
    cache = DynamicCache()
    ids = torch.tensor([[5]])
    t0 = None
    with torch.no_grad():
        for i in range(warm + tokens):
            if i == warm:
                t0 = time.perf_counter()
            replay.t = i
            out = model(input_ids=ids, past_key_values=cache, use_cache=True)
            ids = out.logits[:, -1:].argmax(-1)
    return tokens / (time.perf_counter() - t0)


def _median(xs: list[float]) -> float | None:
    return float(np.median(xs)) if xs else None


def _release_cache(eng) -> None:
    """Free the engine's cache slots (the next ``set_cache`` opens a new one).  Between specmoe
    rows this keeps at most one cache in memory next to torch's resident experts."""
    if eng._cache is not None:
        eng._cache.close()
        eng._cache = None
        eng._source = None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=10, help="timed tokens per run")
    ap.add_argument("--accel-tokens", type=int, default=1, help="timed tokens per accelerate run")
    ap.add_argument("--warm", type=int, default=4,
                    help="untimed tokens before each run (the cache is rebuilt cold per run)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="rounds; each round runs every row once, in a rotated order")
    ap.add_argument("--fracs", default="1.0,0.25,0.1")
    ap.add_argument("--threads", type=int, default=1,
                    help="threads for torch and the specmoe kernels alike (1: shared machines)")
    ap.add_argument("--dir", default=None, help="where the store and accelerate's files go")
    a = ap.parse_args(argv)
    if a.repeats < 1 or a.tokens < 1 or a.accel_tokens < 1 or a.warm < 0:
        ap.error("--repeats, --tokens, --accel-tokens must be >= 1 and --warm >= 0")
    warnings.filterwarnings("ignore")
    import logging
    logging.getLogger("transformers").setLevel(logging.ERROR)
    # the same thread count for torch, accelerate and specmoe's kernels
    torch.set_num_threads(a.threads)
    from specmoe.runtime import kernels
    kernels.set_num_threads(a.threads)
    load_start = os.getloadavg()
    t_start = time.perf_counter()
    log = (lambda *x: print(f"[{time.perf_counter() - t_start:6.0f}s]", *x, file=sys.stderr,
                            flush=True))

    src = next(p for p in TRACES if p.is_dir())
    tr = load_puffin(src)
    need = a.warm + max(a.tokens, a.accel_tokens) + 2
    ex = tr.experts[:, :a.layers]  # the first `layers` MoE layers of the recorded model
    start = int(tr.request_starts[np.argmax(np.diff(np.r_[tr.request_starts, tr.num_tokens]))])
    ex = ex[start:start + need]  # one long request, replayed in text order
    replay = Replay(ex)
    work = Path(a.dir or tempfile.mkdtemp(prefix="specmoe-decode-"))
    work.mkdir(parents=True, exist_ok=True)

    # Three models stay alive through all rounds so that rows can interleave:
    # accelerate's (weights in its offload folder), torch's (every expert in RAM) and specmoe's
    # (the same model object with its experts modules swapped for the engine's).
    # accelerate's folder is written from the torch model's state dict (the same weights, one
    # copy in RAM); its model is built on the meta device and disk_offload loads from the folder.
    from accelerate import disk_offload
    from accelerate.utils import offload_state_dict
    log("building the model and accelerate's offload folder...")
    model = build(a.layers, replay)
    acc_dir = str(work / "accelerate")
    offload_state_dict(acc_dir, model.state_dict())
    acc_model = build(a.layers, replay, weights=False)
    disk_offload(acc_model, acc_dir, execution_device=torch.device("cpu"))
    gc.collect()

    log("writing the specmoe store...")
    layers = model.model.layers
    torch_experts = [layer.mlp.experts for layer in layers]
    fracs = [float(f) for f in a.fracs.split(",")]
    store = work / "experts.smoe"
    # offload only swaps each layer's experts module; the originals (kept above) keep their
    # weights, so torch rows run the unmodified eager experts of the same model
    eng = hf.offload(model, store=store, cache=min(fracs), dtype="bf16", prefetch=False,
                     direct=True)
    spec_experts = [layer.mlp.experts for layer in layers]
    _release_cache(eng)
    gc.collect()

    def use(experts):
        for layer, e in zip(layers, experts):
            layer.mlp.experts = e

    def prev_token_predictor(pos, hidden):
        t = replay.t
        sc = torch.zeros(hidden.shape[0], EXPERTS)
        if t > 0:
            sc[:, replay.experts[t - 1, pos]] = 1.0
        return sc

    avail = hf.available_policies()
    # second policy: SpecMD's Least-Stale where built, else any other built-in
    policies = ["lru"] + (["least_stale"] if "least_stale" in avail else
                          [p for p in avail if p != "lru"][:1])
    rows = [dict(name="torch", cache_frac=None, policy=None, prefetch=None)]
    for frac in fracs:
        for pol in policies if frac < 1 else ["lru"]:
            for pf in (False, True):
                rows.append(dict(name="specmoe", cache_frac=frac, policy=pol, prefetch=pf))
    rows.append(dict(name="accelerate", cache_frac=None, policy=None, prefetch=None))
    for r in rows:
        r["runs"] = []   # tok/s per round, in round order
        r["stats"] = []  # specmoe cache statistics per round

    full_resident = False  # the open cache holds every expert (kept between adjacent 100% rows)

    def run_specmoe(r, keep_full: bool) -> float:
        nonlocal full_resident
        frac, pol, pf = r["cache_frac"], r["policy"], r["prefetch"]
        use(spec_experts)
        if not (frac >= 1.0 and full_resident):
            _release_cache(eng)  # never two caches at once
            full_resident = False
            eng.set_cache(frac, policy=pol)
        eng.set_prefetch(pf, overfetch=1.0, predictor=prev_token_predictor)
        if frac >= 1.0 and not full_resident:  # everything resident before timing, like torch
            eng._cache.prefetch((np.repeat(np.arange(a.layers), EXPERTS),
                                 np.tile(np.arange(EXPERTS), a.layers),
                                 np.zeros(a.layers * EXPERTS, np.float32)))
            eng._cache.wait_idle()
            full_resident = True
        eng.reset_stats()
        gc.collect()
        tps = decode(model, replay, a.tokens, warm=a.warm)
        s = eng.stats()
        r["stats"].append(dict(hit_rate=s.get("hit_rate"), stall_s=s.get("stall_s"),
                               prefetch_precision=s["prefetch_precision"],
                               prefetch_recall=s["prefetch_recall"]))
        if not (keep_full and full_resident):
            _release_cache(eng)  # torch and accelerate rows run without a cache in memory
            full_resident = False
        return tps

    def run_row(r, next_row) -> float:
        if r["name"] == "torch":
            use(torch_experts)
            gc.collect()
            return decode(model, replay, a.tokens, warm=a.warm)
        if r["name"] == "accelerate":
            gc.collect()
            # nothing to warm: it reads every weight per token
            return decode(acc_model, replay, a.accel_tokens, warm=0)
        keep = (next_row is not None and next_row["name"] == "specmoe"
                and next_row["cache_frac"] >= 1.0)
        return run_specmoe(r, keep)

    setup_s = time.perf_counter() - t_start
    round_s = []
    n = len(rows)
    for rnd in range(a.repeats):
        t_round = time.perf_counter()
        # rotate the order each round so every row meets every phase of the machine's load
        off = (rnd * n) // a.repeats
        order = rows[off:] + rows[:off]
        for k, r in enumerate(order):
            tps = run_row(r, order[k + 1] if k + 1 < n else None)
            r["runs"].append(tps)
            hit = r["stats"][-1]["hit_rate"] if r["stats"] else None
            log(f"round {rnd + 1}/{a.repeats} {r['name']} cache={r['cache_frac']} "
                f"{r['policy']} prefetch={r['prefetch']}: {tps:.3f} tok/s"
                + (f" hit={hit:.3f}" if hit is not None else ""))
        round_s.append(round(time.perf_counter() - t_round, 1))
    eng.close()

    torch_runs, acc_runs = rows[0]["runs"], rows[-1]["runs"]
    out_rows = []
    for r in rows:
        runs = r.pop("runs")
        stats = r.pop("stats")
        o = dict(r)
        o["tok_per_s"] = _median(runs)
        o["tok_per_s_runs"] = runs
        if stats:
            for key in ("hit_rate", "stall_s", "prefetch_precision", "prefetch_recall"):
                vals = [s[key] for s in stats if s[key] is not None]
                o[key] = _median(vals)
        # ratios within each round (the same round's torch / accelerate run), then the median
        # and the spread over rounds
        for key, base in (("vs_torch", torch_runs), ("vs_accelerate", acc_runs)):
            per = [x / b for x, b in zip(runs, base)]
            o[key] = _median(per)
            o[key + "_min"] = min(per)
            o[key + "_max"] = max(per)
        out_rows.append(o)
    res = dict(config=dict(hidden=HIDDEN, ffn=FFN, experts=EXPERTS, top_k=TOPK,
                           moe_layers=a.layers, tokens=a.tokens, accel_tokens=a.accel_tokens,
                           warm=a.warm, repeats=a.repeats, order="interleaved, rotated per round",
                           store_dtype="bf16", trace=str(src), threads=a.threads,
                           loadavg_start=[round(x, 2) for x in load_start],
                           loadavg_end=[round(x, 2) for x in os.getloadavg()],
                           setup_s=round(setup_s, 1), round_s=round_s,
                           wall_s=round(time.perf_counter() - t_start, 1)),
               rows=out_rows)
    if a.json:
        print(json.dumps(res))
    else:
        for r in out_rows:
            print(f"{r['name']:11s} {str(r['cache_frac']):5s} {str(r['policy']):12s} "
                  f"{str(r['prefetch']):6s} {r['tok_per_s']:8.3f} tok/s  "
                  f"x{r['vs_torch']:.2f} [{r['vs_torch_min']:.2f}-{r['vs_torch_max']:.2f}] torch  "
                  f"x{r['vs_accelerate']:.1f} [{r['vs_accelerate_min']:.1f}-"
                  f"{r['vs_accelerate_max']:.1f}] accelerate")
    del model, acc_model
    if not a.dir:
        import shutil
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

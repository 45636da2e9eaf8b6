"""Real routing through the live engine at full depth (issue 41, items 2-3).

    python benchmarks/replay.py --json [--trace DIR] [--caches 5,10,25] [--tokens 2000]
                                [--warmup 64] [--rounds 2] [--threads 2] [--rows ...]
    python benchmarks/replay.py --quick --json     # a small checkpoint of the same routing shape
    python benchmarks/replay.py --gguf --json      # the full depth from big_model.py's Q4_0 GGUF

Checkpoint.  The full DeepSeek-V2-Lite layout of ``big_model.py`` (``--layers 27``: the dense
first layer and 26 MoE layers of 64 experts, top-6, hidden 2048, expert FFN 1408, vocab
102400; random bf16 weights, written once under ``--workdir`` and shared with ``big_model.py
--layers 27``), converted once to specmoe's int4 store (``store-int4.smoe``).  The output
records what was written, how big, and how long writing and converting took.  ``--gguf``
reads instead the Q4_0 GGUF that ``big_model.py --layers 27 --rows specmoe-gguf-Q4_0`` wrote
of the same checkpoint and its store of the file's own blocks (8.9 + 8.1 GB, where the bf16
files take 31 GB); the dense weights are dequantized to bf16 as they are read.

Routing.  A fixed subset of the DeepSeek-V2-Lite-Chat routing traces (``--trace``, default
``../shared/traces/deepseek-v2-lite-puffin``): the prompts in file-name order, concatenated,
``--warmup`` + ``--tokens`` tokens (``--split val``: only the learned model's validation
prompts, 39 prompts and 2,019 tokens of the shared traces).  Every token is one forward pass (a 1-token prompt, then
greedy decoding) whose MoE layers route to the trace's experts
(``Engine.replay_routing``), with the router's softmax weights at them, so the cache, its
worker, the store's O_DIRECT reads and the int4 kernels see DeepSeek-V2-Lite's real access
pattern.  Predictors that read hidden states (the router) mean nothing with random weights
and are not run; ``learned`` (the nextuse model fed the routing as it runs) and the offline
``oracle`` (the trace's next layer) are.

Rows.  For each cache size (``--caches``, % of the 1664 routed experts), one process under a
cgroup-v1 memory limit of non-expert bytes (bf16) + the cache's bytes + 512 MiB (page cache
charged: the store cannot hide in it; ``--planned``: the same budget given to
``from_pretrained(memory=)``, which plans the dense layers' format and the cache size) runs
every row of ``--rows`` (``policy[+predictor][+admit][+noprior]``: the learned predictor
gets each replayed token's prior from the trace's token pieces unless ``+noprior``;
``belady`` is Belady's rule over the replayed tokens' true future, ``belady+oracle`` with the
trace's next layer prefetched; the offline bound is the faster of the two in the round), the
rows interleaved round by round (``--rounds``).  A row: ``Engine.set_cache`` (empty cache,
fresh statistics), the replay restarted, ``--warmup`` untimed passes, then ``--tokens`` timed
passes: tok/s, hit rate, collision misses, stall share (the cache's stall time over the
timed wall time), bytes read from disk per token (``/proc/self/io`` read_bytes: the O_DIRECT
reads), prefetch precision; ``vs_offline_bound`` = tok/s over the offline bound's in the same
round.  ``parallel_misses`` is off (each layer's experts in ascending id, the order the
simulator and Belady's future follow; ``--parallel-misses`` turns it on).

Simulator.  Beside each row the simulator's estimate of the same replay (``specmoe.simulate``
on the same tokens, each row's experts in ascending id, same policy, slots and predictor),
timed by a profile measured in the same process before the rows, on synthetic routing (no
row's trace): the expert compute from the int4 kernel on a block of the store (batch 1, the
run's threads); the fixed time of a pass from the live engine replaying a trace whose every
access hits (6 fixed experts per layer) less its expert compute, split between the 26 MoE
layers and the token as DeepSeek-V2-Lite's resident bytes are (``ModelCost.measured``: 74 %
per layer, attention and shared experts; 26 % per token, the dense first layer and the LM
head; until 2026-12-01 it was all charged per token, which left a prefetch copy only the
experts' compute of a layer to land in); one expert's load (the
``link_bw``, latency 0) from the live engine replaying a trace whose every access misses (a
cache of 6 slots, each token 6 new experts per layer), less the all-hit pass, per access.
(``specmoe.sim.calibration.calibrate``'s isolated ExpertStore reads measured 0.65-0.9 GB/s on
the host of the first run, where the engine's own demand loads ran at about 2 GB/s, so the
load time is taken from the engine.)  Each row carries ``sim_tok_s``, ``sim_hit_rate`` and ``sim_error`` (sim tok/s / live
tok/s - 1).

``--resim FILE``: no live run; the simulator's columns of a results file this script wrote
recomputed with today's time model from the calibration the file holds (same trace, split
and tokens), printed beside the file's own (``--out``: also written).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hostinfo  # noqa: E402
from big_model import (MiB, REPO, RESERVE, Cgroup, _fail_reason, _read_bytes,  # noqa: E402
                       config_hash, convert_store, drop_caches, make_config, param_counts,
                       run_process, write_checkpoint)

DEFAULT_ROWS = ("lru,least_stale,spac_ema,lhu,nextuse,nextuse+learned,least_stale+learned,"
                "belady,belady+oracle")


def log(*a: Any) -> None:
    print("[replay]", *a, file=sys.stderr, flush=True)


def quick_config() -> dict[str, Any]:
    """The routing shape of DeepSeek-V2-Lite (27 layers, 64 experts, top-6) at small widths."""
    cfg = make_config(27, 16384)
    cfg.update(hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
               num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=64,
               qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)
    return cfg


def parse_row(name: str) -> dict[str, Any]:
    """``policy[+predictor][+admit][+noprior]``: ``+admit`` turns on the prefetch admission
    rule (``Engine.set_prefetch(admission=True)``, csrc/admit.h); ``+noprior`` replays the
    trace's experts without its token pieces, so no pass gets its token's prior (issue 42's
    token prior, which the learned predictor uses by default)."""
    policy, *flags = name.split("+")
    pred = flags.pop(0) if flags and flags[0] in ("learned", "oracle") else ""
    if any(f not in ("admit", "noprior") for f in flags) or len(set(flags)) != len(flags) or \
            ("admit" in flags and not pred) or not policy:
        raise SystemExit(f"--rows: {name!r}: policy[+predictor][+admit][+noprior], the "
                         f"predictor learned or oracle (the router reads hidden states, "
                         f"meaningless with random weights); +admit needs a predictor")
    return {"name": name, "policy": policy, "predictor": pred or None,
            "admission": "admit" in flags, "token_prior": "noprior" not in flags}


def load_tokens(trace_dir: Path, n: int, split: str = "all"):
    """The first n tokens of the traces in prompt-number order (whole prompts, the last cut),
    and how many prompts they span; ``split`` "val" / "train": only the prompts of that side
    of the learned model's split (specmoe.sim.nextuse.split_requests: validation = crc32 of
    the file name % 5 == 0), so the learned predictor runs on prompts it was not fitted on."""
    from specmoe.sim.nextuse import split_requests
    from specmoe.sim.traces import Trace, _prompt_number, load_puffin

    if split != "all":
        paths = sorted([f for f in Path(trace_dir).iterdir()
                        if f.name.endswith((".csv", ".csv.gz"))], key=_prompt_number)
        train, val = split_requests([f.name for f in paths])
        parts, have = [], 0
        for i in val if split == "val" else train:
            if have >= n:
                break
            parts.append(load_puffin(paths[i]))
            have += parts[-1].num_tokens
        if have < n:
            raise SystemExit(f"{trace_dir}: {have} tokens in the {split} prompts, {n} asked for")
        return Trace.concat(parts).slice(0, n), len(parts)
    files = len([f for f in Path(trace_dir).iterdir() if f.name.endswith((".csv", ".csv.gz"))])
    limit = 1
    while True:  # the fewest prompts that hold n tokens (not all 200 files for 80 tokens)
        full = load_puffin(trace_dir, limit=min(limit, files))
        if full.num_tokens >= n or limit >= files:
            break
        limit *= 2
    if full.num_tokens < n:
        raise SystemExit(f"{trace_dir}: {full.num_tokens} tokens in the traces, {n} asked for")
    return full.slice(0, n), int(np.sum(full.request_starts < n))


# --------------------------------------------------------------------------------------------
# the worker: one process per cache size, every row inside it


def worker(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    import torch
    torch.set_num_threads(spec["threads"])
    import specmoe
    from specmoe.runtime import kernels
    from specmoe.runtime import policies as P
    from specmoe.sim.traces import Trace
    from transformers import LogitsProcessor, LogitsProcessorList

    kernels.set_num_threads(spec["threads"])
    trace = Trace.load(spec["trace"])
    W, N = spec["warmup"], spec["tokens"]
    out: dict[str, Any] = {"rows": []}
    t0 = time.perf_counter()
    planned = spec.get("memory") is not None
    model = specmoe.from_pretrained(spec["ckpt"], cache=None if planned else spec["slots"],
                                    dtype=spec.get("dtype", "int4"), policy="lru", prefetch=False,
                                    store=spec["store"], progress=False,
                                    memory=spec.get("memory"))
    eng = specmoe.engine_of(model)
    slots = int(eng._cache.capacity)
    out["slots"], out["dense"] = slots, eng.dense.dtype
    if planned:
        out["plan"] = eng.memory_plan.to_dict()
    eng.set_parallel_misses(spec["parallel_misses"])
    out["load_s"] = time.perf_counter() - t0

    class Stamp(LogitsProcessor):
        """After every forward pass: the time, and at pass W-1 the statistics restart."""

        def __init__(self, reset_at: int) -> None:
            self.t: list[float] = []
            self.io: list[int] = []
            self.reset_at = reset_at

        def __call__(self, input_ids: Any, scores: Any) -> Any:
            if len(self.t) == self.reset_at:
                eng.reset_stats()
            self.t.append(time.perf_counter())
            self.io.append(_read_bytes(os.getpid()) or 0)
            return scores

    def passes(n: int, reset_at: int = -1) -> Stamp:
        st = Stamp(reset_at)
        with torch.no_grad():
            model.generate(torch.tensor([[5]]), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, logits_processor=LogitsProcessorList([st]))
        return st

    # -- calibration: the expert kernel, and the fixed time of a pass whose accesses all hit
    st = specmoe.ExpertStore(spec["store"])
    try:
        block = st.read_block(0, 0)
        fspec = kernels.FFNSpec.from_store_schema(st.tensors, int(st.block_bytes))
        x = np.random.default_rng(0).standard_normal((1, int(fspec.H)), dtype=np.float32)
        kernels.ffn(block, x, spec=fspec)
        best = float("inf")
        for _ in range(30):
            a = time.perf_counter()
            kernels.ffn(block, x, spec=fspec)
            best = min(best, time.perf_counter() - a)
        block_bytes = int(st.block_bytes)
    finally:
        st.close()
    L, k, E = trace.num_layers, trace.top_k, trace.num_experts
    hot = np.tile(np.arange(k, dtype=np.int16), (16, L, 1))  # 6 fixed experts per layer
    eng.set_cache(slots, policy="lru")
    eng.replay_routing(hot)
    s = passes(16)
    hit_pass = statistics.median(np.diff(s.t[4:]))
    # every access a miss: top_k slots, each token's experts the next k ids at every layer
    cold = np.stack([np.tile((np.arange(k) + t * k) % E, (L, 1)) for t in range(12)])
    eng.set_cache(k, policy="lru")
    eng.replay_routing(cold.astype(np.int16))
    s = passes(12)
    miss_pass = statistics.median(np.diff(s.t[2:]))
    assert eng.stats()["hits"] == 0, "the all-miss calibration hit"
    eng.replay_routing(None)
    out["calibration"] = {"expert_s": best, "block_bytes": block_bytes,
                          "all_hit_pass_s": hit_pass, "all_miss_pass_s": miss_pass,
                          "token_fixed_s": max(0.0, hit_pass - L * k * best),
                          "load_s": max(1e-6, (miss_pass - hit_pass) / (L * k))}
    print(json.dumps({"calibration": out["calibration"]}), file=sys.stderr, flush=True)

    for rnd in range(spec["rounds"]):
        for row in spec["rows"]:
            pol: Any = row["policy"]
            if pol == "belady":  # the live access sequence: each row's experts in ascending id
                pol = P.Belady(trace.sorted_rows())
            eng.set_cache(slots, policy=pol)
            # with the token pieces each pass gets its token's prior (the learned predictor's)
            eng.replay_routing(trace if row.get("token_prior", True) else trace.experts)
            pred = row["predictor"]
            eng.set_prefetch(pred is not None, overfetch=1.0, predictor=pred or "router",
                             admission=row.get("admission", False))
            drop_caches()
            s = passes(W + N, reset_at=W - 1)
            wall = s.t[-1] - s.t[W - 1]
            stats = eng.stats()
            eng.set_prefetch(False, predictor="router", admission=False)
            eng.replay_routing(None)
            r = {"name": row["name"], "round": rnd, "policy": row["policy"],
                 "predictor": pred or "none", "admission": row.get("admission", False),
                 "token_prior": row.get("token_prior", True) and pred == "learned",
                 "prefetch_refused": stats.get("prefetch_refused", 0),
                 "prefetch_issued": stats.get("prefetch_issued", 0),
                 "tokens": N, "tok_s": N / wall,
                 "hits": stats["hits"], "misses": stats["misses"],
                 "hit_rate": stats["hit_rate"], "collision_misses": stats["collision_misses"],
                 "stall_s": stats.get("stall_s", 0.0),
                 "stall_share": stats.get("stall_s", 0.0) / wall,
                 "read_bytes_per_token": (s.io[-1] - s.io[W - 1]) / N,
                 "prefetch_precision": stats["prefetch_precision"],
                 "passes": stats["passes"]}
            out["rows"].append(r)
            print(json.dumps(r), file=sys.stderr, flush=True)
            Path(spec["result"]).write_text(json.dumps(out))
    eng.close()
    Path(spec["result"]).write_text(json.dumps(out))


# --------------------------------------------------------------------------------------------
# the parent


def sim_cost(trace, cal: dict[str, Any]) -> Any:
    """The simulator's model cost from a calibration (the worker's ``calibration``): the
    store's block as the expert, and the all-hit pass's fixed time (its key says per token;
    it is the whole pass's) placed per layer and per token as the trace's model's resident
    bytes are (``ModelCost.measured``)."""
    from specmoe.sim.hardware import ModelCost
    fast_bw = cal["block_bytes"] / cal["expert_s"]
    return ModelCost.for_trace(trace).measured(
        expert_bytes=cal["block_bytes"], fixed_s=cal["token_fixed_s"], fast_bw=fast_bw,
        num_layers=trace.num_layers)


def resim(path: Path, trace_dir: "Path | None") -> dict[str, Any]:
    """--resim: the simulator's columns of a results file recomputed from its calibrations."""
    from specmoe.sim.hardware import Hardware
    from specmoe.sim.traces import shared_trace_dir

    d = json.loads(Path(path).read_text())
    if not (isinstance(d, dict) and d.get("benchmark") == "replay" and "caches" in d):
        raise SystemExit(f"--resim {path}: not a results file of benchmarks/replay.py")
    cfg = d["config"]
    tdir = trace_dir or Path(cfg.get("trace") or shared_trace_dir())
    if not tdir.is_dir():
        tdir = shared_trace_dir()
    W, N = cfg["warmup"], cfg["tokens"]
    trace, _ = load_tokens(tdir, W + N, cfg.get("split") or "all")
    rows_out = []
    for c in d["caches"]:
        cal, prof = c.get("calibration"), c.get("sim_profile")
        if not cal or not prof:
            continue
        # an entry's rows: those it names (a file merged from two runs names each run's),
        # else every row of its cache size that no other entry names
        names = c.get("rows")
        claimed = {n for o in d["caches"] if o is not c and o.get("cache_pct") == c["cache_pct"]
                   for n in o.get("rows") or ()}
        rows = [dict(r) for r in d["rows"] if r.get("cache_pct") == c["cache_pct"]
                and (r["name"] in names if names is not None else r["name"] not in claimed)]
        nan = float("nan")  # a row the file has no estimate for
        before = [(r.get("sim_tok_s", nan), r.get("sim_hit_rate", nan), r.get("sim_error", nan))
                  for r in rows]
        sim_estimates(rows, trace, c["slots"], W, N, Hardware.from_dict(prof),
                      sim_cost(trace, cal))
        for r, (t0, h0, e0) in zip(rows, before):
            rows_out.append({"cache_pct": c["cache_pct"], "name": r["name"],
                             "round": r.get("round"), "tok_s": r["tok_s"],
                             "hit_rate": r["hit_rate"], "sim_tok_s_before": t0,
                             "sim_hit_rate_before": h0, "sim_error_before": e0,
                             "sim_tok_s": r["sim_tok_s"], "sim_hit_rate": r["sim_hit_rate"],
                             "sim_error": r["sim_error"]})
    return {"file": Path(path).name, "host": d.get("host"), "trace": str(tdir),
            "split": cfg.get("split") or "all", "warmup": W, "tokens": N, "rows": rows_out}


def resim_summary(files: list[dict[str, Any]]) -> dict[str, Any]:
    """--resim's rows by kind (prefetching: a predictor; demand: none): the simulator's
    error against the live tok/s and its hit rate's shortfall, before and after."""
    out: dict[str, Any] = {}
    for kind in ("demand", "prefetch"):
        rows = [r for f in files for r in f["rows"]
                if (parse_row(r["name"])["predictor"] is not None) == (kind == "prefetch")
                and r["sim_error_before"] == r["sim_error_before"]]  # not NaN
        if not rows:
            continue
        n = len(rows)
        out[kind] = {"rows": n}
        for tag, key in (("before", "_before"), ("after", "")):
            err = [r["sim_error" + key] for r in rows]
            out[kind][tag] = {
                "mean_abs_error": sum(abs(e) for e in err) / n,
                "mean_error": sum(err) / n,
                "within_10pct": sum(abs(e) <= 0.10 for e in err),
                "mean_hit_rate_shortfall": sum(r["hit_rate"] - r["sim_hit_rate" + key]
                                               for r in rows) / n}
    return out


def sim_estimates(rows: list[dict[str, Any]], trace, slots: int, W: int, N: int,
                  hw: Any, cost: Any) -> None:
    """The simulator's figures for each row's timed tokens: the run over W + N tokens less the
    run over the W warm-up tokens (the cache state at W is the same in both)."""
    from specmoe import simulate
    from specmoe.runtime import policies as P

    tr = trace.sorted_rows()
    memo: dict[tuple[str, str, bool, bool], tuple[float, float]] = {}
    for r in rows:
        key = (r["policy"], r["predictor"], r.get("admission", False),
               r.get("token_prior", False))
        if key not in memo:
            res = []
            for n in (W, W + N):
                part = tr.slice(0, n)
                pol = P.Belady(part) if r["policy"] == "belady" else r["policy"]
                pf = None if r["predictor"] == "none" else r["predictor"]
                res.append(simulate(part, pol, slots, prefetch=pf, hardware=hw, model=cost,
                                    admission=bool(pf and r.get("admission", False)),
                                    token_prior=r.get("token_prior", False)))
            a, b = res
            acc = (b.hits + b.misses) - (a.hits + a.misses)
            memo[key] = (N / (b.total_s - a.total_s), (b.hits - a.hits) / acc)
        r["sim_tok_s"], r["sim_hit_rate"] = memo[key]
        r["sim_error"] = r["sim_tok_s"] / r["tok_s"] - 1.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    ap.add_argument("--trace", default=None, help="a folder of traces in the shared layout")
    ap.add_argument("--split", choices=("all", "val", "train"), default="all",
                    help="val: only the prompts the learned model was not trained on (its "
                         "split by file name); all: every prompt in order")
    ap.add_argument("--caches", default="5,10,25", help="cache sizes, %% of the routed experts")
    ap.add_argument("--tokens", type=int, default=2000, help="timed tokens per row")
    ap.add_argument("--warmup", type=int, default=64, help="untimed tokens before them")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default=DEFAULT_ROWS)
    ap.add_argument("--parallel-misses", action="store_true")
    ap.add_argument("--planned", action="store_true",
                    help="each cache size's budget planned by from_pretrained(memory=budget) "
                         "(dense format and cache size: specmoe.runtime.memplan) instead of "
                         "bf16 dense layers and that share of the experts")
    ap.add_argument("--quick", action="store_true", help="small widths, same routing shape")
    ap.add_argument("--reserve-mib", type=float, default=None,
                    help="memory above the bf16 non-expert bytes and the cache in the cgroup "
                         "(default 512; the --gguf load needs about 1.5 GiB: the dequantized "
                         "dense weights' transient copies and the mapped file's pages)")
    ap.add_argument("--gguf", action="store_true",
                    help="read big_model.py's Q4_0 GGUF of the full-depth checkpoint and its "
                         "kept-blocks store instead of the bf16 checkpoint and the int4 store "
                         "(a third of the disk: no 31 GB bf16 files)")
    ap.add_argument("--workdir", default=os.path.expanduser("~/.cache/specmoe/bench"))
    ap.add_argument("--no-cgroup", action="store_true", help="run uncapped (not a valid result)")
    ap.add_argument("--row-timeout", type=float, default=6 * 3600.0)
    ap.add_argument("--out", default=None, help="also write the JSON here")
    ap.add_argument("--resim", nargs="+", metavar="FILE", default=None,
                    help="no live run: recompute the simulator's columns of these results "
                         "files from their calibrations with today's time model")
    ap.add_argument("--_worker", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.resim:
        files = [resim(Path(f), Path(a.trace) if a.trace else None) for f in a.resim]
        import subprocess
        head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                              capture_output=True, text=True).stdout.strip() or None
        out = {"benchmark": "replay --resim", "time_model_at": head,
               "what": "each row's sim_* before: as the file recorded them; after: "
                       "recomputed from the file's own calibration with the time model at "
                       "time_model_at (no live run)",
               "summary": resim_summary(files), "files": files}
        text = json.dumps(out, indent=1)
        print(text if a.json else "\n".join(
            f"{f['file']} {r['cache_pct']:g}% {r['name']} r{r['round']}: live {r['tok_s']:.2f} "
            f"tok/s; sim {r['sim_tok_s_before']:.2f} -> {r['sim_tok_s']:.2f} "
            f"({r['sim_error_before']:+.3f} -> {r['sim_error']:+.3f}); hit live "
            f"{r['hit_rate']:.3f}, sim {r['sim_hit_rate_before']:.3f} -> "
            f"{r['sim_hit_rate']:.3f}" for f in out["files"] for r in f["rows"]))
        if a.out:
            Path(a.out).write_text(text + "\n")
        return
    if a._worker:
        worker(a._worker)
        return
    if a.warmup < 1 or a.tokens < 1:
        ap.error("--warmup and --tokens must be >= 1")
    from specmoe.sim.calibration import calibrate
    from specmoe.sim.hardware import with_
    from specmoe.sim.traces import shared_trace_dir

    rows = [parse_row(n.strip()) for n in a.rows.split(",") if n.strip()]
    reserve = RESERVE if a.reserve_mib is None else int(a.reserve_mib * MiB)
    caches = [float(c) for c in a.caches.split(",") if c.strip()]
    cfg = quick_config() if a.quick else make_config(27, 102400)
    seed, skew = 0, 1.0
    chash = config_hash(cfg, seed, skew)
    root = Path(a.workdir).expanduser() / (f"dsv2lite-L27-V{cfg['vocab_size']}-{chash}")
    ckpt, store = root / "ckpt", root / "store-int4.smoe"
    work = root / "run"
    work.mkdir(parents=True, exist_ok=True)
    made: dict[str, Any] = {}
    dtype = "int4"
    if a.gguf:  # big_model.py's Q4_0 GGUF of the same checkpoint and its kept-blocks store
        ckpt, store = root / "gguf-direct" / "model-Q4_0.gguf", root / "store-gguf-Q4_0.smoe"
        dtype = "auto"
        if not (ckpt.is_file() and store.is_file()):
            raise SystemExit(f"--gguf needs {ckpt} and {store}: run benchmarks/big_model.py "
                             f"--layers 27 --rows specmoe-gguf-Q4_0 first")
        made["checkpoint_bytes"] = ckpt.stat().st_size
    t0 = time.time()
    fresh = not a.gguf and not (ckpt / ".complete").is_file()
    if not a.gguf:
        write_checkpoint(ckpt, cfg, seed, skew)
        made["checkpoint_bytes"] = sum(f.stat().st_size for f in ckpt.iterdir())
    made["checkpoint_write_s"] = time.time() - t0 if fresh else None
    if not store.is_file():
        t0 = time.time()
        err = convert_store(ckpt, "int4", store, a.row_timeout)
        if err:
            raise SystemExit(err)
        made["convert_s"] = time.time() - t0
    else:
        made["convert_s"] = None  # converted by an earlier run
    made["store_bytes"] = store.stat().st_size
    made["paths"] = {"checkpoint": str(ckpt), "store": str(store)}
    log(f"checkpoint {made['checkpoint_bytes'] / 1e9:.1f} GB, {'Q4_0 blocks' if a.gguf else 'int4'}"
        f" store {made['store_bytes'] / 1e9:.2f} GB")

    tdir = Path(a.trace) if a.trace else shared_trace_dir()
    trace, nprompts = load_tokens(tdir, a.warmup + a.tokens, a.split)
    tfile = work / "replay-trace.npz"
    trace.save(tfile)
    pc = param_counts(cfg)
    E_total = trace.num_layers * trace.num_experts
    non_expert = 2 * pc["non_expert_params"]

    import specmoe
    with specmoe.ExpertStore(store) as st:
        block_bytes = int(st.block_bytes)
    link = calibrate(block_bytes=block_bytes, blocks=8, directory=str(work), refresh=True)

    results: list[dict[str, Any]] = []
    per_cache: list[dict[str, Any]] = []
    for c in caches:
        slots = max(trace.top_k, int(round(E_total * c / 100.0)))
        budget = non_expert + slots * block_bytes + reserve
        spec = {"ckpt": str(ckpt), "store": str(store), "dtype": dtype, "slots": slots,
                "rows": rows,
                "rounds": a.rounds, "warmup": a.warmup, "tokens": a.tokens,
                "threads": a.threads, "trace": str(tfile),
                "parallel_misses": a.parallel_misses,
                "memory": budget if a.planned else None,
                "result": str(work / f"replay-{c:g}{'-planned' if a.planned else ''}.json")}
        sp = work / f"replay-{c:g}.spec.json"
        sp.write_text(json.dumps(spec))
        Path(spec["result"]).unlink(missing_ok=True)
        cg = None if a.no_cgroup else Cgroup(f"replay-{c:g}", budget)
        log(f"cache {c:g}% = {slots} slots, budget {budget / MiB:.0f} MiB: {len(rows)} rows x "
            f"{a.rounds} rounds x {a.warmup}+{a.tokens} tokens")
        drop_caches()
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
        r = run_process([sys.executable, __file__, "--_worker", str(sp)], cg, a.row_timeout,
                        env=env)
        sys.stderr.write(r["stderr"][-4000:])
        res = json.loads(Path(spec["result"]).read_text()) if Path(spec["result"]).is_file() \
            else {"rows": []}
        slots = res.get("slots", slots)  # planned: what the plan gave the cache
        entry = {"cache_pct": c, "slots": slots, "budget_bytes": budget,
                 "dense": res.get("dense"), "plan": res.get("plan"),
                 "peak_bytes": cg.peak() if cg else None, "load_s": res.get("load_s"),
                 "calibration": res.get("calibration")}
        if r["rc"] != 0:
            entry["failed"] = _fail_reason(r, cg, f"cache {c:g}%")
            log(entry["failed"])
        if cg is not None:
            cg.close()
        got = res["rows"]
        for row in got:
            row["cache_pct"], row["slots"] = c, slots
        if res.get("calibration"):
            cal = res["calibration"]
            fast_bw = block_bytes / cal["expert_s"]
            hw = with_(link, name=f"calibrated-{c:g}", fast_bw=fast_bw, kernel_overhead_s=0.0,
                       link_bw=block_bytes / cal["load_s"], link_latency_s=0.0,
                       description="this run's live engine: the expert kernel on one block, a "
                                   "load = (all-miss pass - all-hit pass) / (L k), the fixed "
                                   "time = all-hit pass - L k kernel calls, placed per layer "
                                   "and per token as the model's resident bytes are "
                                   "(sim_cost)")
            cost = sim_cost(trace, cal)
            sim_estimates(got, trace, slots, a.warmup, a.tokens, hw, cost)
            entry["sim_profile"] = hw.to_dict()
            entry["sim_cost"] = dataclasses.asdict(cost)
        for rnd in range(a.rounds):  # the bound: the fastest offline row of the round
            off = [x["tok_s"] for x in got if x["round"] == rnd and x["policy"] == "belady"]
            for x in got:
                if x["round"] == rnd:
                    x["vs_offline_bound"] = x["tok_s"] / max(off) if off else None
        results.extend(got)
        per_cache.append(entry)

    summary = []
    for c in caches:
        for row in rows:
            rs = [x for x in results if x["cache_pct"] == c and x["name"] == row["name"]]
            if not rs:
                summary.append({"cache_pct": c, "name": row["name"], "missing": True})
                continue
            med = lambda k: statistics.median(x[k] for x in rs if x.get(k) is not None) \
                if any(x.get(k) is not None for x in rs) else None  # noqa: E731
            summary.append({"cache_pct": c, "name": row["name"], "tok_s": med("tok_s"),
                            "tok_s_runs": [x["tok_s"] for x in rs],
                            "hit_rate": med("hit_rate"), "stall_share": med("stall_share"),
                            "read_mib_per_token": med("read_bytes_per_token") / MiB,
                            "vs_offline_bound": med("vs_offline_bound"),
                            "vs_offline_bound_runs": [x.get("vs_offline_bound") for x in rs],
                            "sim_tok_s": med("sim_tok_s"), "sim_error": med("sim_error"),
                            "sim_hit_rate": med("sim_hit_rate")})
    out = {"benchmark": "replay", "host": hostinfo.host(a.threads),
           "config": {"model": "DeepSeek-V2-Lite layout, random weights, "
                      + ("Q4_0 GGUF, its blocks kept in the store" if a.gguf else
                         "bf16 checkpoint, int4 store")
                      + (" (quick: small widths)" if a.quick else ""),
                      "layers": cfg["num_hidden_layers"], "moe_layers": trace.num_layers,
                      "experts": trace.num_experts, "top_k": trace.top_k,
                      "hidden": cfg["hidden_size"], "vocab": cfg["vocab_size"],
                      "trace": str(tdir), "split": a.split, "trace_prompts": nprompts,
                      "warmup": a.warmup,
                      "tokens": a.tokens, "rounds": a.rounds, "threads": a.threads,
                      "cgroup": not a.no_cgroup, "parallel_misses": a.parallel_misses,
                      "planned": a.planned,
                      "reserve_bytes": reserve, "non_expert_bytes": non_expert,
                      "expert_params": pc["expert_params"]},
           "written": made, "caches": per_cache, "summary": summary, "rows": results}
    text = json.dumps(out, indent=1)
    if a.out:
        Path(a.out).write_text(text + "\n")
    if a.json:
        print(text)
    else:
        for s in summary:
            print(json.dumps(s))


if __name__ == "__main__":
    main()

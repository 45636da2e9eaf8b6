"""Serving under load: ``specmoe serve`` (continuous batching) against itself without batching
and against llama.cpp's ``llama-server --parallel N``, with 1 / 4 / 16 / 64 concurrent clients.

Usage::

    python benchmarks/serve.py --json                       # the zoo model, every server
    python benchmarks/serve.py --models big --clients 1,4,16 --json

Models:

* ``zoo``: specmoe's ``tiny-moe`` (Mixtral-shaped, 4 layers, 16 experts), uncapped;
* ``big``: the DeepSeek-V2-Lite-shaped checkpoint of ``big_model.py`` (``--layers``, default
  12; written there if missing) under that script's int4 memory budget (non-expert bytes +
  25 % of the experts at 4.5 bits + 512 MiB), enforced on each server process by a cgroup-v1
  memory controller (page cache charged), page cache dropped before each server starts.
* ``hybrid``: a gated-DeltaNet hybrid, ``hybrid_peers.py``'s Qwen3.5-MoE file (Qwen3.5-35B-A3B's
  per-layer shapes, 4 layers, 32 experts, one Q4_0 GGUF written there if missing), uncapped:
  specmoe serves the file itself (``--dtype auto``: its Q4_0 blocks kept, ``--cache 100%``),
  llama-server the same file; the prompts are the zoo tokenizer's, which the file carries.

Servers, each a real process on a loopback port, started for every row and stopped after it
(so every row starts the same way, and llama-server gets its ``--parallel`` = the clients):

* ``specmoe``: ``python -m specmoe serve CKPT --dtype int4 --cache 25% --policy least_stale
  --max-batch 64`` (the big model: the cache the budget leaves, as in big_model.py), decode
  steps of the running requests in one batched forward;
* ``specmoe-unbatched``: the same with ``--no-batch-decode`` (one forward per request and
  step: what continuous batching buys);
* ``specmoe-batch-prefill``: the same with ``--batch-prefill`` (prompts of any lengths that
  arrive together prefilled in batched forwards, one expert load for all of them, at the cost
  of bit-exactness; ``specmoe`` groups only prompts of one length): what exactness costs, as
  ``vs_batch_prefill`` on the ``specmoe`` row.  With the default prompts, all of 64 tokens,
  both group alike: ``--prompt-spread`` gives them different lengths;
* ``specmoe-paced``: the same with ``--prefill-ratio 2`` (while requests decode, a round's
  prompt chunks held to about two decode rounds' time: what the pacing buys in the
  inter-token latency's tail, and what it costs in throughput);
* ``specmoe-ngram``: ``specmoe`` with speculative decoding, ``--drafter ngram --controller
  cascade`` (``--controller``): what drafts verified in the batch's forward buy or cost, as
  ``vs_plain`` (out_tok_s over ``specmoe``'s in the same round), with ``drafts_per_token``
  and ``draft_acceptance`` from ``/metrics``;
* ``specmoe-self`` (not run by default): the same with ``--drafter self`` (MoE-SpeQ's int4
  self-draft).  Mind that on an int4 store the draft's experts are the target's own bits,
  so its acceptance is the ceiling, not what a bf16 target would see;
* ``specmoe-mtp`` (not run by default): the same with ``--drafter mtp`` and the zoo's shipped
  adapter (``specmoe/zoo/tiny-moe-mtp``; the big checkpoint has none: its row says so);
* ``specmoe-model`` (not run by default): the same with ``--drafter model`` and the zoo's
  draft LM (``specmoe/zoo/tiny-draft``, a KV cache per request; zoo only, as for MTP);
* ``llama-server``: llama.cpp's server (built from the llama-cpp-python sdist, as
  big_model.py builds llama.cpp; ``--peers``) on the same checkpoint converted by llama.cpp's
  own converter and quantized to Q4_0 (the same bits per expert weight as specmoe's int4 within
  half a bit), ``--parallel N``, ``-c N * --slot-ctx`` (default 256 positions per slot), ``-t``/``-tb``
  threads, ``--no-repack`` under the cap (big_model.py: repacking copies the whole model into
  anonymous memory).  A server that cannot run is a row with ``error`` saying why.

Load: ``N`` clients, each sending ``--requests`` streamed completions one after the other
(closed loop: a new request arrives whenever one finishes, while the others decode), greedy,
``max_tokens`` ``--max-tokens``, ``ignore_eos``, prompts of 64 whole-word tokens (64 +-
``--prompt-spread``) that re-tokenize to themselves (big_model.make_prompts), different per
request.  One untimed request per client (8 tokens, all clients at once) warms each server
first.  Per row:
``out_tok_s`` (completion tokens of every request / wall time from the first send to the last answer), ``req_s``, ``ttft_p50/p99`` (send to first
streamed chunk), ``itl_p50/p99`` (gaps between consecutive streamed chunks, every request
pooled: both servers stream one chunk per token, with empty text for a token that has none --
the big checkpoint's random weights mostly pick ids past the tokenizer's 8192 real tokens), ``decode_tok_s_per_request`` (median over
requests of (tokens - 1) / (last chunk - first chunk)), errors; specmoe rows add the expert
cache's ``hit_rate``, ``bytes_read_per_token`` (slow-tier bytes / completion tokens) and
``mean_decode_batch`` (rows per decode forward) from ``/metrics`` deltas.

``--rounds R``: every (clients, server) row once per round, server order rotated each round;
ratios (``vs_unbatched``, ``vs_llama_server``, ``scaling`` = out_tok_s / the same server's
1-client out_tok_s) are taken within a round and reported per round and as medians.  The JSON
records the host (CPU model, ISA, threads).  Targets (issue 38): on the big checkpoint,
specmoe's out_tok_s at 16 clients >= 4x one client and >= 1.5x llama-server at 16 clients;
p99 inter-token latency <= 3x p50.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import big_model as bm  # noqa: E402  (checkpoint, budget, cgroup, llama.cpp build/convert)
import hostinfo  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
ZOO = REPO / "specmoe" / "zoo" / "tiny-moe"
ZOO_MTP = REPO / "specmoe" / "zoo" / "tiny-moe-mtp"   # tiny-moe's MTP adapter
ZOO_DRAFT = REPO / "specmoe" / "zoo" / "tiny-draft"    # tiny-moe's draft LM
MiB = 1 << 20
PROMPT_TOKENS = 64
SERVERS = ("specmoe", "specmoe-unbatched", "specmoe-batch-prefill", "specmoe-paced",
           "specmoe-ngram", "specmoe-self", "specmoe-mtp", "specmoe-model", "llama-server")
SPEC_SERVERS = ("specmoe-ngram", "specmoe-self", "specmoe-mtp",   # serve with a --drafter
                "specmoe-model")
DEFAULT_SERVERS = ("specmoe", "specmoe-unbatched", "specmoe-batch-prefill", "specmoe-paced",
                   "specmoe-ngram", "llama-server")
MODEL = "bench"       # the model id the servers are asked for (llama-server takes any)


def log(*a: Any) -> None:
    print("[serve-bench]", *a, file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def pct(xs: List[float], q: float) -> Optional[float]:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


# -- models ------------------------------------------------------------------------------------

def prompts_for(folder: Path, n: int, spread: int = 0) -> List[str]:
    """``n`` prompt texts of PROMPT_TOKENS whole-word tokens each (two per seed), or with
    ``spread`` of PROMPT_TOKENS - spread .. PROMPT_TOKENS + spread tokens, drawn per prompt
    (one per seed): lengths that differ, as real traffic's do, so that prompts arriving
    together are not all of one length (which the exact default prefills together)."""
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(str(folder))
    out: List[str] = []
    seed = 100
    rng = np.random.default_rng(7)
    while len(out) < n:
        if spread:
            m = PROMPT_TOKENS + int(rng.integers(-spread, spread + 1))
            out.append(tok.decode(bm.make_prompts(folder, m, seed)[0]))
        else:
            out += [tok.decode(p) for p in bm.make_prompts(folder, PROMPT_TOKENS, seed)]
        seed += 1
    return out[:n]


def setup_model(name: str, a: argparse.Namespace) -> Dict[str, Any]:
    """Checkpoint, GGUF (or the reason there is none), store, budget and cache of ``name``."""
    if name == "hybrid":
        return setup_hybrid(a)
    if name == "zoo":
        root = Path(a.workdir).expanduser() / "zoo-tiny-moe"
        ckpt, budget, cache, chash = ZOO, None, "25%", "zoo"
    else:
        cfg = bm.make_config(a.layers, 102400)
        chash = bm.config_hash(cfg, 0, 1.0)
        root = Path(a.workdir).expanduser() / f"dsv2lite-L{a.layers}-V102400-{chash}"
        ckpt = root / "ckpt"
        bm.write_checkpoint(ckpt, cfg, 0, 1.0)
        b = bm.budgets(cfg)["int4"]
        budget, cache = b["budget_bytes"], f"{b['cache_bytes'] // MiB}MiB"
    root.mkdir(parents=True, exist_ok=True)
    store = root / "store-int4.smoe"
    err = bm.convert_store(ckpt, "int4", store, 3600)
    m: Dict[str, Any] = {"name": name, "ckpt": ckpt, "root": root, "store": store,
                         "store_error": err, "budget": budget, "cache": cache}
    if "llama-server" in a.servers:
        lc, err = llama_server(a)
        if err:
            m["gguf"] = err
        else:
            m["gguf"] = lc.convert(ckpt, root / "gguf", ["Q4_0"], chash, False)["Q4_0"]
            m["llama_server"] = lc.bin / "llama-server"
    m["prompts"] = prompts_for(ckpt, a.requests * max(a.clients) + 1, a.prompt_spread)
    return m


def llama_server(a: argparse.Namespace) -> tuple:
    """(llama.cpp's build, None), or (that build, why its llama-server cannot run)."""
    lc = bm.LlamaCpp(Path(a.peers).expanduser(), not a.no_build_peers, a.threads, a.llama_isa,
                     server=True)
    if lc.error:
        return lc, lc.error
    if not (lc.bin / "llama-server").is_file():
        return lc, (f"llama-server not built under {lc.bin} (cmake -DLLAMA_BUILD_SERVER=ON "
                    "--target llama-server in that build)")
    return lc, None


def setup_hybrid(a: argparse.Namespace) -> Dict[str, Any]:
    """The ``hybrid`` model: one GGUF file both servers read (module docstring)."""
    import hybrid_peers as hp
    experts, tail = (8, "-quick") if a.hybrid_quick else (32, "")
    path = (Path(a.workdir).expanduser() / "hybrid_peers"
            / f"qwen35moe-L4-E{experts}{tail}-Q4_0.gguf")  # (hybrid_peers.gguf_path's names)
    hp.write_file(path, 4, experts, quick=a.hybrid_quick)
    root = path.parent / "serve-qwen35moe"
    root.mkdir(parents=True, exist_ok=True)
    m: Dict[str, Any] = {"name": "hybrid", "ckpt": path, "root": root, "store": None,
                         "store_error": None, "budget": None, "cache": "100%"}
    if "llama-server" in a.servers:
        lc, err = llama_server(a)
        m["gguf"] = err or path
        if not err:
            m["llama_server"] = lc.bin / "llama-server"
    m["prompts"] = prompts_for(ZOO, a.requests * max(a.clients) + 1, a.prompt_spread)
    return m


# -- servers -----------------------------------------------------------------------------------

class Proc:
    """A server process (in a cgroup when given) and its port."""

    def __init__(self, argv: List[str], port: int, cg: Optional["bm.Cgroup"], log_path: Path):
        self.port = port
        self.base = f"http://127.0.0.1:{port}"
        self.log = open(log_path, "wb")
        tasks = cg.tasks if cg is not None else None

        def enter() -> None:
            if tasks is not None:
                with open(tasks, "w") as f:
                    f.write(str(os.getpid()))
        # (both servers: specmoe's CLI sets its own wait policy, llama-server keeps libgomp's)
        self.p = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT,
                                  env=hostinfo.peer_env(), preexec_fn=enter,
                                  start_new_session=True)

    def ready(self, timeout: float) -> Optional[str]:
        """None once /health answers 200; else why not."""
        import httpx
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.p.poll() is not None:
                return f"the server exited with {self.p.returncode} before it was ready"
            try:
                if httpx.get(self.base + "/health", timeout=2).status_code == 200:
                    return None
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        return f"not ready after {timeout:.0f} s"

    def stop(self) -> None:
        if self.p.poll() is None:
            os.killpg(self.p.pid, signal.SIGTERM)
            try:
                self.p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait(10)
        self.log.close()


def server_argv(kind: str, m: Dict[str, Any], clients: int, port: int,
                a: argparse.Namespace) -> List[str]:
    if kind == "llama-server":
        return [str(m["llama_server"]), "-m", str(m["gguf"]), "--host", "127.0.0.1",
                "--port", str(port), "-t", str(a.threads), "-tb", str(a.threads),
                "--parallel", str(clients), "-c", str(a.slot_ctx * clients), "--no-warmup",
                "--log-disable"] + (["--no-repack"] if m["budget"] is not None else [])
    store = ["--dtype", "int4", "--store", str(m["store"])] if m["store"] is not None else []
    argv = [sys.executable, "-m", "specmoe", "serve", str(m["ckpt"]), *store,
            "--cache", str(m["cache"]), "--policy", "least_stale",
            "--port", str(port), "--max-batch", str(max(64, clients)), "--max-queue", "4096",
            "--threads", str(a.threads), "--log-level", "warning", "--model-name", MODEL]
    if kind == "specmoe-unbatched":
        argv.append("--no-batch-decode")
    if kind == "specmoe-paced":
        argv += ["--prefill-ratio", "2"]
    if kind == "specmoe-batch-prefill":
        argv.append("--batch-prefill")
    if kind in SPEC_SERVERS:
        argv += ["--drafter", kind.split("-")[1], "--controller", a.controller]
    if kind == "specmoe-mtp":
        argv += ["--mtp-adapter", str(ZOO_MTP)]
    if kind == "specmoe-model":
        argv += ["--draft-model", str(ZOO_DRAFT)]
    return argv


# -- load --------------------------------------------------------------------------------------

async def one_request(client: Any, base: str, model: str, prompt: str,
                      max_tokens: int) -> Dict[str, Any]:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
            "stream": True, "ignore_eos": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    times: List[float] = []
    usage = None
    async with client.stream("POST", base + "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            text = (await resp.aread()).decode(errors="replace")
            return {"error": f"HTTP {resp.status_code}: {text[:200]}"}
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                return {"error": str(ev["error"])[:200]}
            if ev.get("usage"):
                usage = ev["usage"]
            for ch in ev.get("choices") or []:
                # a token's chunk (its text may be empty: held back, or a token without text)
                if ch.get("finish_reason") is None or ch.get("text"):
                    times.append(time.perf_counter())
    n = int(usage["completion_tokens"]) if usage else len(times)
    return {"t0": t0, "times": times, "tokens": n}


async def load(base: str, model: str, prompts: List[str], clients: int, requests: int,
               max_tokens: int, timeout: float, stagger: int = 0) -> Dict[str, Any]:
    """``clients`` closed-loop clients, ``requests`` streamed requests each; client c asks
    for ``max_tokens + stagger * c`` tokens."""
    import httpx
    results: List[Dict[str, Any]] = []

    async def client_loop(c: int, http: Any) -> None:
        for j in range(requests):
            p = prompts[(c * requests + j) % len(prompts)]
            try:
                results.append(await one_request(http, base, model, p,
                                                 max_tokens + stagger * c))
            except Exception as e:  # noqa: BLE001 (counted and reported)
                results.append({"error": f"{type(e).__name__}: {e}"})

    # a connection per request, for every server: with kept-alive connections reused,
    # llama-server dropped one of 32 requests in two rows ("Server disconnected without
    # sending a response", 2026-12-06, Zen 4; none in four rows since); a new loopback
    # connection costs well under a millisecond
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=0)
    t0 = time.perf_counter()
    async with httpx.AsyncClient(timeout=timeout, limits=limits) as http:
        await asyncio.gather(*(client_loop(c, http) for c in range(clients)))
    wall = time.perf_counter() - t0
    ok = [r for r in results if "error" not in r]
    toks = sum(r["tokens"] for r in ok)
    ttft = [r["times"][0] - r["t0"] for r in ok if r["times"]]
    gaps = [b - a for r in ok for a, b in zip(r["times"], r["times"][1:])]
    per_req = [(len(r["times"]) - 1) / (r["times"][-1] - r["times"][0]) for r in ok
               if len(r["times"]) > 1 and r["times"][-1] > r["times"][0]]
    errs = [r["error"] for r in results if "error" in r]
    return {"requests": len(results), "errors": len(errs), "first_error": errs[0] if errs else None,
            "completion_tokens": toks, "wall_s": wall, "out_tok_s": toks / wall if wall else None,
            "req_s": len(ok) / wall if wall else None,
            "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99),
            "itl_p50_s": pct(gaps, 50), "itl_p99_s": pct(gaps, 99),
            "decode_tok_s_per_request": statistics.median(per_req) if per_req else None}


def scrape(base: str) -> Dict[str, float]:
    import httpx
    text = httpx.get(base + "/metrics", timeout=10).text
    out: Dict[str, float] = {}
    for name in ("specmoe_expert_cache_hits_total", "specmoe_expert_cache_misses_total",
                 "specmoe_expert_bytes_read_total", "specmoe_decode_batch_size_sum",
                 "specmoe_decode_batch_size_count"):
        mm = re.search(rf"^{name} (\S+)$", text, re.M)
        out[name] = float(mm.group(1)) if mm else 0.0
    for outcome in ("accepted", "rejected"):
        mm = re.search(rf'^specmoe_draft_tokens_total{{outcome="{outcome}"}} (\S+)$', text, re.M)
        out[f"drafts_{outcome}"] = float(mm.group(1)) if mm else 0.0
    return out


def run_row(kind: str, m: Dict[str, Any], clients: int, a: argparse.Namespace,
            logdir: Path) -> Dict[str, Any]:
    if kind == "llama-server" and not isinstance(m.get("gguf"), Path):
        return {"error": str(m.get("gguf"))}
    if kind != "llama-server" and m["store_error"]:
        return {"error": m["store_error"]}
    if kind == "specmoe-mtp" and m["name"] != "zoo":
        return {"error": "no MTP adapter is trained for this checkpoint (the zoo's is "
                         "tiny-moe's)"}
    if kind == "specmoe-model" and m["name"] != "zoo":
        return {"error": "no draft model of this checkpoint's tokenizer is shipped (the zoo's "
                         "tiny-draft is tiny-moe's)"}
    cg = None
    proc = None
    try:
        if m["budget"] is not None and not a.no_cgroup:
            cg = bm.Cgroup(f"serve-{kind}", m["budget"])
            bm.drop_caches()
        port = free_port()
        proc = Proc(server_argv(kind, m, clients, port, a), port, cg,
                    logdir / f"{m['name']}-{kind}-{clients}.log")
        err = proc.ready(a.row_timeout)
        if err:
            tail = Path(proc.log.name).read_text(errors="replace").strip().splitlines()[-3:]
            return {"error": f"{kind}: {err}: {' | '.join(tail)}"}
        name = MODEL
        t0 = time.perf_counter()
        # as many clients as the row's, so that a speculating server has measured tau at the
        # batch sizes the row reaches (a one-off pause per batch-size bucket) before timing;
        # its requests end one at a time (2 tokens apart), so the batch passes through every
        # bucket down to 1, as the timed run's does when its last requests finish
        warm = asyncio.run(load(proc.base, name, m["prompts"][-clients:], clients, 1, 8,
                                a.row_timeout, stagger=2 if kind in SPEC_SERVERS else 0))
        if warm["errors"]:
            return {"error": f"warm-up request failed: {warm['first_error']}"}
        log(f"  warm-up {time.perf_counter() - t0:.1f} s")
        time.sleep(1.0)  # the worker refreshes the Engine figures /metrics shows every 0.5 s
        before = scrape(proc.base) if kind != "llama-server" else None
        res = asyncio.run(load(proc.base, name, m["prompts"], clients, a.requests,
                               a.max_tokens, a.row_timeout))
        if before is not None:
            time.sleep(1.0)
            after = scrape(proc.base)
            d = {k: after[k] - before[k] for k in after}
            acc = d["specmoe_expert_cache_hits_total"] + d["specmoe_expert_cache_misses_total"]
            res["hit_rate"] = d["specmoe_expert_cache_hits_total"] / acc if acc else None
            res["bytes_read_per_token"] = (d["specmoe_expert_bytes_read_total"]
                                           / res["completion_tokens"]
                                           if res["completion_tokens"] else None)
            n = d["specmoe_decode_batch_size_count"]
            res["mean_decode_batch"] = d["specmoe_decode_batch_size_sum"] / n if n else 1.0
            prop = d["drafts_accepted"] + d["drafts_rejected"]
            if prop or kind in SPEC_SERVERS:
                res["drafts_per_token"] = prop / max(1, res["completion_tokens"])
                res["draft_acceptance"] = d["drafts_accepted"] / prop if prop else None
        if cg is not None:
            res["cgroup_peak_bytes"] = cg.peak()
            res["oom_kills"] = cg.oom_kills()
        res["capped"] = cg is not None
        return res
    except Exception as e:  # noqa: BLE001 (the row carries it)
        return {"error": f"{type(e).__name__}: {e}"}
    finally:
        if proc is not None:
            proc.stop()
        if cg is not None:
            cg.close()


def summarize(runs: Dict[str, Dict[int, List[Dict[str, Any]]]], servers: List[str],
              clients: List[int], rounds: int) -> List[Dict[str, Any]]:
    def tps(s: str, c: int, r: int) -> Optional[float]:
        x = runs[s][c][r] if r < len(runs[s][c]) else {}
        return x.get("out_tok_s")

    def ratio(x: Optional[float], y: Optional[float]) -> Optional[float]:
        return x / y if x and y else None

    out = []
    for s in servers:
        for c in clients:
            ok = [x for x in runs[s][c] if "error" not in x]
            row: Dict[str, Any] = {"server": s, "clients": c}
            if not ok:
                row["error"] = runs[s][c][0]["error"] if runs[s][c] else "not run"
                out.append(row)
                continue
            for k in ("out_tok_s", "req_s", "ttft_p50_s", "ttft_p99_s", "itl_p50_s",
                      "itl_p99_s", "decode_tok_s_per_request", "hit_rate",
                      "bytes_read_per_token", "mean_decode_batch", "cgroup_peak_bytes",
                      "drafts_per_token", "draft_acceptance"):
                vals = [x[k] for x in ok if x.get(k) is not None]
                if vals:
                    row[k] = statistics.median(vals)
            row["errors"] = sum(x.get("errors", 0) for x in ok)
            row["completion_tokens"] = [x.get("completion_tokens") for x in ok]
            per = {"scaling": [ratio(tps(s, c, r), tps(s, 1, r)) for r in range(rounds)]}
            if s == "specmoe":
                per["vs_unbatched"] = [ratio(tps(s, c, r), tps("specmoe-unbatched", c, r))
                                       for r in range(rounds)] if "specmoe-unbatched" in runs \
                    else []
                per["vs_llama_server"] = [ratio(tps(s, c, r), tps("llama-server", c, r))
                                          for r in range(rounds)] if "llama-server" in runs \
                    else []
                per["vs_paced"] = [ratio(tps(s, c, r), tps("specmoe-paced", c, r))
                                   for r in range(rounds)] if "specmoe-paced" in runs else []
                per["vs_batch_prefill"] = [
                    ratio(tps(s, c, r), tps("specmoe-batch-prefill", c, r))
                    for r in range(rounds)] if "specmoe-batch-prefill" in runs else []
            if s in SPEC_SERVERS and "specmoe" in runs:
                per["vs_plain"] = [ratio(tps(s, c, r), tps("specmoe", c, r))
                                   for r in range(rounds)]
            for k, v in per.items():
                row[k + "_per_round"] = v
                vv = [x for x in v if x is not None]
                row[k] = statistics.median(vv) if vv else None
            if row.get("itl_p50_s") and row.get("itl_p99_s"):
                row["itl_p99_over_p50"] = row["itl_p99_s"] / row["itl_p50_s"]
            out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    ap.add_argument("--save", help="also write the JSON object to this file (after each model)")
    ap.add_argument("--models", default="zoo", help="comma-separated: zoo, big, hybrid")
    ap.add_argument("--clients", default="1,4,16,64")
    ap.add_argument("--servers", default=",".join(DEFAULT_SERVERS),
                    help=f"comma-separated, from {', '.join(SERVERS)}")
    ap.add_argument("--controller", default="cascade",
                    help="specmoe-ngram/-self/-mtp/-model: serve's --controller (default "
                         "cascade)")
    ap.add_argument("--requests", type=int, default=2, help="requests per client")
    ap.add_argument("--max-tokens", type=int, default=32)
    ap.add_argument("--prompt-spread", type=int, default=0,
                    help=f"prompts of {PROMPT_TOKENS} +- this many tokens, drawn per prompt "
                         f"(default 0: all {PROMPT_TOKENS}, which the exact default prefills "
                         "together when they arrive together)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--slot-ctx", type=int, default=256,
                    help="llama-server context positions per parallel slot (-c N * this)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--layers", type=int, default=12, help="big: layers of the checkpoint")
    bm.add_peer_arguments(ap)
    ap.add_argument("--no-cgroup", action="store_true", help="big: run uncapped")
    ap.add_argument("--hybrid-quick", action="store_true",
                    help="hybrid: hybrid_peers.py's quick shapes (an eighth of every width, 8 "
                         "experts): a smoke test")
    ap.add_argument("--row-timeout", type=float, default=900.0)
    a = ap.parse_args()
    a.clients = sorted({int(x) for x in a.clients.split(",") if x.strip()})
    a.servers = [s.strip() for s in a.servers.split(",") if s.strip()]
    bad = [s for s in a.servers if s not in SERVERS]
    if bad or not a.clients or min(a.clients) < 1:
        ap.error(f"--servers from {SERVERS}; --clients positive integers")
    if 1 not in a.clients:
        a.clients = [1] + a.clients  # the scaling ratios need the 1-client row
    result: Dict[str, Any] = {"host": hostinfo.host(a.threads), "args": {
        k: (v if not isinstance(v, Path) else str(v)) for k, v in vars(a).items()}, "models": {}}
    for name in [x.strip() for x in a.models.split(",") if x.strip()]:
        m = setup_model(name, a)
        logdir = m["root"] / "serve-logs"
        logdir.mkdir(exist_ok=True)
        runs: Dict[str, Dict[int, List[Dict[str, Any]]]] = {
            s: {c: [] for c in a.clients} for s in a.servers}
        for r in range(a.rounds):
            for c in a.clients:
                k = (r + a.clients.index(c)) % len(a.servers)
                for s in a.servers[k:] + a.servers[:k]:
                    log(f"{name} round {r + 1}/{a.rounds}: {s}, {c} clients")
                    res = run_row(s, m, c, a, logdir)
                    if "error" in res:
                        log(f"  error: {res['error']}")
                    else:
                        log(f"  {res['out_tok_s'] or 0:.1f} tok/s, TTFT p50 "
                            f"{res['ttft_p50_s'] or 0:.3f} s, ITL p50/p99 "
                            f"{res['itl_p50_s'] or 0:.4f}/{res['itl_p99_s'] or 0:.4f} s, "
                            f"errors {res['errors']}")
                    runs[s][c].append(res)
        result["models"][name] = {
            "checkpoint": str(m["ckpt"]), "budget_bytes": m["budget"],
            "cache_bytes": m["cache"], "gguf": str(m.get("gguf")),
            "rows": summarize(runs, a.servers, a.clients, a.rounds), "raw": runs}
        if a.save:  # a long run's finished models survive a later failure
            Path(a.save).write_text(json.dumps(result, indent=1, default=str) + "\n")
    text = json.dumps(result, indent=1, default=str)
    if a.json:
        print(text)
    else:
        for name, mr in result["models"].items():
            for row in mr["rows"]:
                log(name, json.dumps({k: v for k, v in row.items()
                                      if not k.endswith("_per_round")}, default=str))


if __name__ == "__main__":
    main()

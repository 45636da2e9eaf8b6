"""The hybrid GPU tier against copying every miss (issue 37): a GPU that does not hold the
model's experts.  A random-weight DeepSeek-V2-Lite-shaped checkpoint (``benchmarks/big_model.py``'s
writer: bf16, ``--layers`` layers, the first dense, routers skewed so some experts are hot),
greedy decode of ``--tokens`` tokens after a ``--prompt``-token prompt.

Rows (per store dtype in ``--dtypes``):

* ``unmodified on the GPU (upper bound)``: transformers' model with every weight on the GPU,
  measured first and alone, then freed (it fits an H200; the rows below are then capped);
* ``specmoe copy-every-miss <dtype>``: ``from_pretrained(ckpt, device="cuda", cache=F)``:
  a GPU cache of F of the experts, every miss copied over PCIe from the pinned host copy;
* ``specmoe hybrid <dtype>``: ``from_pretrained(ckpt, device="cuda", gpu_cache=F)``: the same
  cache, and each layer's missing experts split between copies and the CPU kernels on the
  host copy by MoE-SpAc's Eq. 9 with costs measured at load, the CPU's experts offered to the
  cache's policy for admission (csrc/layer.h ``smoe_layers_set_hybrid``);
* ``specmoe hybrid-no-admit <dtype>``: the same split, the CPU's experts not offered for
  admission (``set_balance(profile, admit=False)``): the GPU cache then fills from the split's
  copies alone.  On the H100 (2026-12-05) the int4 hybrid copied as many bytes per token as
  copy-every-miss and ran at 0.86x of it; this row says whether the admissions are the cost;
* ``llama.cpp <type> -ngl 99 --n-cpu-moe N (CUDA)``: llama-bench (``--llama-bench``, built
  with CUDA) on a GGUF of the same shapes written by ``big_model.write_gguf`` (BF16 for the
  bf16 rows, Q4_0 for int4; random weights of the same statistics, not the same values:
  llama.cpp's speed does not depend on them), every layer on the GPU except the routed
  experts of the first N layers, which its CPU backend computes from host memory.  N takes
  the two values whose share of experts on the GPU brackets ``--gpu-cache`` (llama.cpp's
  granularity is a whole layer), so one row uses less VRAM than specmoe's hybrid and one
  more.  Prefill is its pp``--prompt`` test, decode its tg``--tokens`` test at depth
  ``--prompt`` (after a prompt's worth of context, as the specmoe rows), ``--rounds``
  repetitions after its own warm-up run, run after the specmoe rows' rounds while their
  engines are idle.  Its VRAM is the device's free memory before it less the least seen
  while it ran (sampled every 20 ms), its CUDA context included.  ``vs_llama_cpp``: specmoe
  hybrid tok/s over each such row, and ``equal_vram`` the row with the most experts on the
  GPU that is not above specmoe's GPU cache.

The GPU memory the experts may take is the GPU cache's slab, its own ``cudaMalloc`` of
``--gpu-cache`` of the experts; ``--torch-cap auto`` also caps torch's per-process memory
fraction after the upper bound (``torch_memory_fraction``), which failed on the H200 (the
option's help says how), so it is off by default.  The specmoe rows are timed in interleaved rounds (order alternating) after
``--warm-rounds`` untimed ones.  Each round measures the prefill (one forward of the prompt,
synchronised) and the decode (seconds per token between the first and the last generated
token).  Then one accounting run per row (counters reset, decode only) gives the hit rate,
PCIe bytes per token (the cache's bytes copied to the device over the tokens), the CPU share
of expert work (experts computed on the CPU over all experts computed) and the experts the
hybrid split copied.  Per row: ``vram_bytes`` (GPU memory taken by loading the row,
``torch.cuda.mem_get_info`` before and after, plus torch's peak above that while it ran),
``host_rss_bytes`` (the process's resident set after loading it: the pinned host copy of
the store is most of it).  ``vs_copy_every_miss`` is hybrid tok/s over copy-every-miss tok/s,
per round and their median; ``tokens_equal``: greedy tokens equal to the upper bound's (bf16
stores sum experts in another order, so a near-tie may flip a token).

llama.cpp with CUDA is the issue's peer.  The lent GPU machine has no network and its CUDA
build takes longer than a session's device time, so llama-bench is built elsewhere (docs/gpu.md
says how) and carried; without ``--llama-bench`` the row says why it did not run
(``error``).

The results file is written after the specmoe rounds and after each llama.cpp row too (with
``partial`` naming the stage reached), so a run stopped by a caller's timeout keeps what it
measured.

Without a usable GPU it prints ``{"skipped": reason}`` and exits 0; ``--device emulate`` runs
the same rows through the GPU tier's host emulation (with a fixed balance profile in place of
the measured one) as a dry run of the script, not a benchmark.
"""
from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import hostinfo  # noqa: E402  (before torch: OMP_WAIT_POLICY)
from gpu_generate import _error, timed_generate  # noqa: E402

LLAMA_CPP_WHY = ("not run: no llama-bench built with CUDA was given (--llama-bench or "
                 "SPECMOE_LLAMA_BENCH; the lent machine has no network and its CUDA build "
                 "takes longer than a session's device time: docs/gpu.md says how to carry one)")
# llama.cpp's types for specmoe's store dtypes (same bits per weight, about)
LLAMA_TYPES = {"bf16": "BF16", "int4": "Q4_0"}


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def n_cpu_moe_bracket(layers: int, first_dense: int, gpu_fraction: float) -> list[int]:
    """The two values of llama.cpp's ``--n-cpu-moe N`` (the routed experts of layers 0..N-1
    stay on the CPU) whose share of the experts on the GPU, ``(layers - N) / moe_layers``,
    brackets ``gpu_fraction``: the largest share at or below it, then the next larger."""
    moe = layers - first_dense
    hi = max(first_dense, min(layers, math.ceil(layers - gpu_fraction * moe - 1e-9)))
    return [hi] + ([hi - 1] if hi - 1 >= first_dense else [])


def cuda_lib_dirs() -> list[str]:
    """Folders of the pip wheels' CUDA libraries (libcublas.so.*: llama-bench links cuBLAS
    dynamically) on this interpreter's path."""
    out = []
    for entry in sys.path:
        for d in sorted(Path(entry or ".").glob("nvidia/*/lib")) + \
                sorted(Path(entry or ".").glob("nvidia/cublas/lib")):
            if any(d.glob("libcublas.so*")) and str(d) not in out:
                out.append(str(d))
    return out


def run_llama_bench(binary: str, gguf: Path, n_cpu_moe: int, prompt: int, tokens: int,
                    rounds: int, threads: int, free_bytes: Callable[[], int]) -> dict[str, Any]:
    """One llama-bench process: pp``prompt`` at depth 0 and tg``tokens`` at depth ``prompt``;
    tok/s per repetition, and the GPU memory it took (free memory sampled while it ran)."""
    import subprocess
    import threading
    argv = [binary, "-m", str(gguf), "-ngl", "99", "--n-cpu-moe", str(n_cpu_moe),
            "-p", str(prompt), "-n", str(tokens), "-d", f"0,{prompt}", "-r", str(rounds),
            "-t", str(threads), "-fa", "off", "-o", "json"]
    env = hostinfo.peer_env()
    # its own folder first: gpu_carry.sh packs the OpenMP runtime beside it
    env["LD_LIBRARY_PATH"] = ":".join([str(Path(binary).resolve().parent)] + cuda_lib_dirs()
                                      + [env.get("LD_LIBRARY_PATH", "")])
    f0 = free_bytes()
    low = [f0]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.02):
            low[0] = min(low[0], free_bytes())
    th = threading.Thread(target=sample, daemon=True)
    th.start()
    t = time.perf_counter()
    try:
        r = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    finally:
        done.set()
        th.join()
    row: dict[str, Any] = {"argv": " ".join(argv[1:]), "wall_s": time.perf_counter() - t,
                           "vram_bytes": f0 - low[0]}
    if r.returncode != 0:
        row["error"] = f"llama-bench exited {r.returncode}: {r.stderr.strip()[-600:]}"
        return row
    tests = json.loads(r.stdout)
    for x in tests:
        if x.get("n_prompt") == prompt and x.get("n_gen") == 0 and x.get("n_depth", 0) == 0:
            row["prefill_tok_s"] = x["avg_ts"]
        if x.get("n_gen") == tokens and x.get("n_prompt") == 0 and x.get("n_depth") == prompt:
            row["tok_s_rounds"] = list(x["samples_ts"])
            row["tok_s"] = statistics.median(x["samples_ts"])
            row["llama_cpp_build"] = f"{x.get('build_commit')} ({x.get('build_number')})"
            row["backends"] = x.get("backends")
    if "tok_s" not in row:
        row["error"] = f"no tg{tokens}@d{prompt} test in llama-bench's output"
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8, help="decoder layers (the first dense)")
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens")
    ap.add_argument("--tokens", type=int, default=32, help="generated tokens per run")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warm-rounds", type=int, default=1)
    ap.add_argument("--gpu-cache", type=float, default=0.10,
                    help="the GPU cache as a fraction of all experts (default 0.10)")
    ap.add_argument("--dtypes", default="bf16", help="store dtypes, comma-separated (bf16, int4)")
    ap.add_argument("--policy", default="lru")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--workdir", default=os.path.expanduser("~/.cache/specmoe/bench"))
    ap.add_argument("--out", default=None, help="results file (default on a GPU: "
                    "benchmarks/results/gpu_hybrid_<gpu>.json)")
    ap.add_argument("--torch-cap", choices=["auto", "none"], default="none",
                    help="auto: cap torch's memory fraction after the upper bound (dense "
                         "weights x2 + 4 GiB; on the H200 the specmoe rows then failed to "
                         "load, torch's allocator holding 5 GiB it could not serve a 2 MiB "
                         "block from); none (default): the GPU cache's size is the cap")
    ap.add_argument("--llama-bench", default=os.environ.get("SPECMOE_LLAMA_BENCH"),
                    help="llama-bench built with CUDA, for llama.cpp's --n-cpu-moe rows "
                         "(default $SPECMOE_LLAMA_BENCH; without it the row says why not)")
    ap.add_argument("--llama-n-cpu-moe", default="auto",
                    help="llama.cpp's --n-cpu-moe values, comma-separated, or auto: the two "
                         "whose share of experts on the GPU brackets --gpu-cache")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    import torch

    import big_model
    import specmoe
    from specmoe.runtime import cuda
    from specmoe.runtime import kernels

    dev = a.device
    emulate = dev == "emulate"
    tdev = "cpu" if emulate else dev
    why = "" if emulate else cuda.unusable_reason()
    if why:
        res = {"skipped": f"no usable GPU: {why}"}
        print(json.dumps(res) if a.json else res["skipped"])
        return
    from transformers import AutoModelForCausalLM

    threads = os.cpu_count() or 1
    kernels.set_num_threads(threads)  # the hybrid tier's CPU share runs on these
    t0 = time.perf_counter()
    cfgd = big_model.make_config(a.layers, a.vocab)
    ckpt = Path(a.workdir) / f"gpu-dsv2lite-L{a.layers}-V{a.vocab}" / "ckpt"
    big_model.write_checkpoint(ckpt, cfgd, seed=0, skew=1.0)
    gpu_name = "emulated" if emulate else torch.cuda.get_device_name(0)
    res: dict[str, Any] = {
        "model": "deepseek_v2 (DeepSeek-V2-Lite shapes, random weights, skewed routers)",
        "layers": a.layers, "vocab": a.vocab, "prompt_tokens": a.prompt, "tokens": a.tokens,
        "rounds": a.rounds, "warm_rounds": a.warm_rounds, "gpu_cache_fraction": a.gpu_cache,
        "policy": a.policy, "device": gpu_name, "host": hostinfo.host(threads),
        "checkpoint_s": time.perf_counter() - t0}
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(100, min(8000, a.vocab), (1, a.prompt), generator=gen).to(tdev)
    out = a.out
    if out is None and not emulate:
        tag = "".join(ch for ch in gpu_name.lower().split()[-1] if ch.isalnum())
        out = str(HERE / "results" / f"gpu_hybrid_{tag}.json")

    def sync() -> None:
        if not emulate:
            torch.cuda.synchronize()

    def prefill_s(model: Any) -> float:
        sync()
        t = time.perf_counter()
        with torch.no_grad():
            model(ids)
        sync()
        return time.perf_counter() - t

    def free_bytes() -> int:
        return 0 if emulate else int(torch.cuda.mem_get_info()[0])

    rows: dict[str, dict[str, Any]] = {}

    def save(stage: str) -> None:
        """The results so far into the results file, marked ``partial`` with the stage
        reached: a run its caller's timeout stops keeps what it measured."""
        if out:
            Path(out).write_text(json.dumps(dict(res, rows=list(rows.values()), partial=stage,
                                                 elapsed_s=time.perf_counter() - t0),
                                            indent=1) + "\n")
    # the upper bound: alone, first, then freed
    up = "unmodified on the GPU (upper bound)"
    rows[up] = {"label": up}
    ref_tokens = None
    try:
        f0 = free_bytes()
        m = AutoModelForCausalLM.from_pretrained(ckpt, device_map=tdev,
                                                 dtype=torch.bfloat16).eval()
        rows[up]["vram_bytes"] = f0 - free_bytes()
        for _ in range(max(1, a.warm_rounds)):  # untimed, as the specmoe rows' first rounds
            prefill_s(m)
            timed_generate(torch, m, ids, a.tokens)
        dec, pre = [], []
        for _ in range(a.rounds):
            pre.append(prefill_s(m))
            s, ref_tokens = timed_generate(torch, m, ids, a.tokens)
            dec.append(s)
        rows[up].update(tok_s=1 / statistics.median(dec), tok_s_rounds=[1 / x for x in dec],
                        prefill_tok_s=a.prompt / statistics.median(pre))
        dense_bytes = sum(p.numel() * p.element_size() for n, p in m.named_parameters()
                          if ".experts." not in n)
        del m
    except Exception as e:  # noqa: BLE001 -- the row says why
        rows[up].update(_error("failed", e))
        dense_bytes = 2 << 30
    gc.collect()  # transformers' modules hold reference cycles: free the upper bound now
    if not emulate:
        torch.cuda.empty_cache()
    if not emulate and a.torch_cap == "auto":
        total = torch.cuda.get_device_properties(0).total_memory
        frac = min(1.0, (dense_bytes * 2 + (4 << 30)) / total)
        torch.cuda.set_per_process_memory_fraction(frac)
        res["torch_memory_fraction"] = frac
    res["dense_bytes"] = dense_bytes

    runs: dict[str, Callable[[], tuple[float, float, list[int]]]] = {}
    engines: dict[str, Any] = {}
    dtypes = [d for d in a.dtypes.split(",") if d]
    for dt in dtypes:
        for kind in ("copy-every-miss", "hybrid", "hybrid-no-admit"):
            label = f"specmoe {kind} {dt}"
            row = rows[label] = {"label": label, "dtype": dt, "kind": kind}
            try:
                if not emulate:
                    torch.cuda.reset_peak_memory_stats()
                f0, r0 = free_bytes(), _rss()
                t = time.perf_counter()
                kw: dict[str, Any] = {"cache": a.gpu_cache}
                if kind != "copy-every-miss":
                    kw = {"gpu_cache": a.gpu_cache}
                    if emulate:  # no GPU to measure: a fixed profile (a dry run)
                        kw["balance"] = cuda.BalanceProfile(t_io=3e-4, t_gpu=6e-5, t_cpu=2e-4)
                model = specmoe.from_pretrained(
                    ckpt, device=dev, dtype=dt, policy=a.policy, prefetch=True,
                    progress=False, store=str(ckpt.parent / f"store-{dt}.smoe"),
                    torch_dtype=torch.bfloat16, **kw)
                row["load_s"] = time.perf_counter() - t
                row["vram_bytes"] = f0 - free_bytes()
                row["host_rss_bytes"] = _rss()
                row["host_rss_load_delta_bytes"] = _rss() - r0
                eng = engines[label] = specmoe.engine_of(model)
                if kind == "hybrid-no-admit":
                    eng.set_balance(eng.balance, admit=False)
                st = eng.stats()
                row["cache_bytes"] = st.get("cache_bytes")
                row["balance_profile"] = st.get("balance")
                timed_generate(torch, model, ids, 4)  # warm-up

                def run(model: Any = model) -> tuple[float, float, list[int]]:
                    p = prefill_s(model)
                    s, tk = timed_generate(torch, model, ids, a.tokens)
                    return p, s, tk
                runs[label] = run
            except Exception as e:  # noqa: BLE001 -- the row says why
                row.update(_error("load or warm-up failed", e))

    times: dict[str, list[tuple[float, float]]] = {k: [] for k in runs}
    toks: dict[str, list[int]] = {}
    for r in range(a.warm_rounds + a.rounds):
        order = list(runs) if r % 2 == 0 else list(runs)[::-1]
        for k in order:
            try:
                p, s, tk = runs[k]()
                if r >= a.warm_rounds:
                    times[k].append((p, s))
                toks[k] = tk
            except Exception as e:  # noqa: BLE001
                rows[k].update(_error(f"round {r} failed", e))
                runs = {q: v for q, v in runs.items() if q != k}
    for k, v in times.items():
        if not v:
            continue
        rows[k]["tok_s"] = 1.0 / statistics.median(s for _, s in v)
        rows[k]["tok_s_rounds"] = [1.0 / s for _, s in v]
        rows[k]["prefill_tok_s"] = a.prompt / statistics.median(p for p, _ in v)
        rows[k]["tokens_equal"] = None if ref_tokens is None else toks.get(k) == ref_tokens
    save("specmoe rounds")
    # llama.cpp's rows: after the specmoe rounds, their engines idle (separate processes)
    llama_labels: list[str] = []
    if not a.llama_bench:  # (--device emulate with a CPU build of llama-bench: a dry run)
        rows["llama.cpp"] = {"label": "llama.cpp -ngl 99 --n-cpu-moe N (CUDA)",
                             "peer": "llama.cpp", "error": LLAMA_CPP_WHY}
    else:
        first = int(cfgd.get("first_k_dense_replace", 0))
        ns = (n_cpu_moe_bracket(a.layers, first, a.gpu_cache) if a.llama_n_cpu_moe == "auto"
              else [int(x) for x in a.llama_n_cpu_moe.split(",")])
        for dt in dtypes:
            qt = LLAMA_TYPES.get(dt)
            if qt is None:
                continue
            gguf_path = ckpt.parent / f"model-{qt}.gguf"
            try:
                t = time.perf_counter()
                big_model.write_gguf(gguf_path, cfgd, seed=0, skew=1.0, qtype=qt)
                gguf_s = time.perf_counter() - t
            except Exception as e:  # noqa: BLE001 -- the rows say why
                gguf_s, gguf_err = None, _error(f"writing the {qt} GGUF failed", e)
            else:
                gguf_err = None
            for n in ns:
                label = f"llama.cpp {qt} -ngl 99 --n-cpu-moe {n} (CUDA)"
                llama_labels.append(label)
                row = rows[label] = {
                    "label": label, "peer": "llama.cpp", "dtype": dt, "type": qt,
                    "n_cpu_moe": n, "gguf_s": gguf_s,
                    "gpu_expert_fraction": (a.layers - max(n, first)) / (a.layers - first)}
                if gguf_err:
                    row.update(gguf_err)
                    continue
                try:
                    row.update(run_llama_bench(a.llama_bench, gguf_path, n, a.prompt,
                                               a.tokens, a.rounds, threads, free_bytes))
                except Exception as e:  # noqa: BLE001
                    row.update(_error("llama-bench failed", e))
                save(label)
    for label, eng in engines.items():  # accounting: one decode-only run, counters reset
        row = rows[label]
        try:
            if label in runs:
                def counted(n: int) -> dict[str, Any]:
                    eng.reset_stats()
                    timed_generate(torch, eng.model, ids, n)
                    return eng.stats()
                # the decode alone: counters of n tokens minus those of the prefill and 1 token
                one, full = counted(2), counted(a.tokens + 1)
                st = {k: full[k] - one.get(k, 0) for k in full
                      if isinstance(full[k], (int, float)) and not isinstance(full[k], bool)}
                n = max(1, st.get("tokens", 0))
                ce, ge = st.get("cpu_experts", 0), st.get("gpu_experts", 0)
                hits, misses = st.get("hits", 0), st.get("misses", 0)
                row.update({
                    "accounting_tokens": st.get("tokens"),
                    "hit_rate": hits / (hits + misses) if hits + misses else None,
                    "pcie_bytes_per_token": st.get("bytes_read", 0) / n,
                    "cpu_share_of_experts": ce / (ce + ge) if ce + ge else None,
                    "cpu_experts": ce, "gpu_experts": ge,
                    "hybrid_copied": st.get("hybrid_copied"),
                    "hybrid_admitted": st.get("hybrid_admitted"),
                    "stall_s": st.get("stall_s")})
            if not emulate:
                row["vram_bytes"] = row.get("vram_bytes", 0) + max(
                    0, torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated())
        except Exception as e:  # noqa: BLE001
            row.update(_error("accounting failed", e))
        finally:
            eng.close()
    res["rows"] = list(rows.values())
    for dt in dtypes:
        c = rows.get(f"specmoe copy-every-miss {dt}", {})
        for kind in ("hybrid", "hybrid-no-admit"):
            h = rows.get(f"specmoe {kind} {dt}", {})
            hr, cr = h.get("tok_s_rounds"), c.get("tok_s_rounds")
            if hr and cr and len(hr) == len(cr):
                per = [x / y for x, y in zip(hr, cr)]
                h["vs_copy_every_miss"] = statistics.median(per)
                h["vs_copy_every_miss_rounds"] = per
            if h.get("tok_s") and rows[up].get("tok_s"):
                h["vs_unmodified"] = h["tok_s"] / rows[up]["tok_s"]
    res["targets"] = {"vs_llama_cpp": 1.5, "vs_copy_every_miss_at_10pct": 2.0}
    # specmoe hybrid tok/s over each llama.cpp row of the same bits; "equal_vram": the
    # llama.cpp row with the most experts on the GPU, not more than specmoe's GPU cache holds
    # (by share of the experts: its measured VRAM includes its process's CUDA context,
    # specmoe's does not, the context being made before the rows load)
    vs: dict[str, Any] = {}
    for dt in dtypes:
        h = rows.get(f"specmoe hybrid {dt}", {})
        peers = [rows[k] for k in llama_labels if rows[k].get("dtype") == dt]
        if not h.get("tok_s") or not peers:
            continue
        per = {r["label"]: h["tok_s"] / r["tok_s"] for r in peers if r.get("tok_s")}
        for r in peers:
            if r.get("tok_s"):
                r["specmoe_hybrid_over_this"] = h["tok_s"] / r["tok_s"]
        under = [r for r in peers
                 if r.get("tok_s") and r["gpu_expert_fraction"] <= a.gpu_cache + 1e-9]
        eq = max(under, key=lambda r: r["gpu_expert_fraction"], default=None)
        vs[dt] = {"per_row": per,
                  "equal_vram": None if eq is None else {"row": eq["label"],
                                                         "ratio": per[eq["label"]]}}
    res["vs_llama_cpp"] = vs or None
    if not vs:
        res["vs_llama_cpp_why"] = next((rows[k].get("error") for k in rows
                                        if rows[k].get("peer") == "llama.cpp"
                                        and rows[k].get("error")), LLAMA_CPP_WHY)
    res["elapsed_s"] = time.perf_counter() - t0
    if out:
        Path(out).write_text(json.dumps(res, indent=1) + "\n")
    if a.json:
        print(json.dumps(res))
    else:
        for row in res["rows"]:
            print(f"{row['label']:44s} {row.get('tok_s', float('nan')):8.2f} tok/s  "
                  f"{row.get('vs_copy_every_miss', '')} {row.get('error', '')}")


if __name__ == "__main__":
    main()

"""GPT-OSS on the CPU: specmoe and llama.cpp reading the same GGUF file, decode speed with every
expert resident.

    python benchmarks/gptoss_peers.py --json [--layers 4] [--threads 1,2] [--rounds 2]
    python benchmarks/gptoss_peers.py --quick --json      # tiny shapes, 1 round: a smoke test

The file.  A random model at GPT-OSS-20B's shapes (hidden 2880, 64 query / 8 key-value heads
of 64, 32 experts of FFN 2880, top-4, vocab 201088, sliding window 128 on every other layer,
YaRN) with ``--layers`` decoder layers, streamed straight into one GGUF file the way llama.cpp's
converter writes GPT-OSS (``gpt-oss`` architecture, gate / up split, F32 expert biases, attention
sinks): the routed experts **MXFP4**, as GPT-OSS's GGUF files hold them, every other matrix BF16,
norms / biases / routers F32.  Written once under ``--workdir`` (default
``~/.cache/specmoe/bench``; never committed).  Values: MXFP4 codes uniform with E8M0 exponents
119-121 (std about 0.02), BF16 matrices random bit patterns of magnitude 2^-7..2^-5 (as
``big_model.write_gguf``), routers N(0, 0.02) rows scaled by exp(z) (skewed routing).

Rows, the same file on both sides:

* ``llama.cpp-MXFP4``: ``llama-bench -m <file> -p 0 -n <tokens> -r 1 -t T`` (its CPU build from
  the llama-cpp-python source distribution, ``big_model.LlamaCpp``), tg tok/s.
* ``specmoe-gguf-MXFP4``: ``specmoe.from_pretrained(<file>, cache=1.0, dtype="auto",
  policy="lru", prefetch=False, dense=<--dense>)`` in its own process: the MXFP4 experts kept
  as the file holds them (the C kernels read the blocks), every expert loaded before timing;
  a greedy generation of ``tokens`` + 1 tokens after a 16-token prompt, minus the one-token
  run (prefill excluded), tok/s of the decode steps.

``--ab N``: in the specmoe worker, after each thread count's row, N interleaved repeats of the
same decode with specmoe's one-call paths off (the class forwards: torch glue around the same
C projections, attention kernel, norms and experts; the router in torch) and on (the attention
block with its norms folded, a full-attention layer and its MoE block in one call, the MoE
block routed in C): the same process and loaded model, so the ratio is the paths' alone.

Each round runs every (row, thread count) once, the order alternating by round; the per-round
ratio specmoe / llama.cpp is reported (the host is shared: a ratio within a round is the
figure, not the medians).  The results file records the CPU model, its ISA (``specmoe_isa``;
``SPECMOE_ISA=avx2`` forces the AVX2 path), the thread counts and llama.cpp's build and ISA
(``--llama-isa avx2``: its build with every AVX-512 option off)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
import big_model as bm  # noqa: E402
import hostinfo  # noqa: E402

WRITER_VERSION = 1


def log(*a: Any) -> None:
    print("[gptoss_peers]", *a, file=sys.stderr, flush=True)


def gptoss_config(layers: int, quick: bool = False) -> dict[str, Any]:
    """GPT-OSS-20B's config.json with ``layers`` decoder layers (``quick``: tiny dims)."""
    c = {"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
         "vocab_size": 201088, "hidden_size": 2880, "intermediate_size": 2880,
         "num_hidden_layers": layers, "num_attention_heads": 64, "num_key_value_heads": 8,
         "head_dim": 64, "num_local_experts": 32, "num_experts_per_tok": 4,
         "sliding_window": 128, "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
         "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0,
                             "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                             "original_max_position_embeddings": 4096},
         "layer_types": ["sliding_attention" if i % 2 == 0 else "full_attention"
                         for i in range(layers)],
         "attention_bias": True, "swiglu_limit": 7.0, "tie_word_embeddings": False,
         "initializer_range": 0.02, "bos_token_id": 0, "eos_token_id": 0, "pad_token_id": 0}
    if quick:
        c.update(vocab_size=8192, hidden_size=256, intermediate_size=256,
                 num_attention_heads=4, num_key_value_heads=2, num_local_experts=8)
    return c


def tensor_specs(cfg: dict[str, Any]) -> list[tuple[str, tuple[int, ...], str]]:
    """(GGUF name, shape, kind) in file order, as llama.cpp's GptOssModel names them; kinds:
    bf16 (a matrix), mxfp4 (stacked experts), norm, router, bias, sink."""
    H, V, E = cfg["hidden_size"], cfg["vocab_size"], cfg["num_local_experts"]
    I, hd = cfg["intermediate_size"], cfg["head_dim"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    out: list[tuple[str, tuple[int, ...], str]] = [("token_embd.weight", (V, H), "bf16")]
    for i in range(cfg["num_hidden_layers"]):
        b = f"blk.{i}."
        out += [(b + "attn_norm.weight", (H,), "norm"),
                (b + "attn_q.weight", (q, H), "bf16"), (b + "attn_q.bias", (q,), "bias"),
                (b + "attn_k.weight", (kv, H), "bf16"), (b + "attn_k.bias", (kv,), "bias"),
                (b + "attn_v.weight", (kv, H), "bf16"), (b + "attn_v.bias", (kv,), "bias"),
                (b + "attn_output.weight", (H, q), "bf16"), (b + "attn_output.bias", (H,), "bias"),
                (b + "attn_sinks.weight", (cfg["num_attention_heads"],), "sink"),
                (b + "post_attention_norm.weight", (H,), "norm"),
                (b + "ffn_gate_inp.weight", (E, H), "router"),
                (b + "ffn_gate_inp.bias", (E,), "bias"),
                (b + "ffn_gate_exps.weight", (E, I, H), "mxfp4"),
                (b + "ffn_gate_exps.bias", (E, I), "bias"),
                (b + "ffn_up_exps.weight", (E, I, H), "mxfp4"),
                (b + "ffn_up_exps.bias", (E, I), "bias"),
                (b + "ffn_down_exps.weight", (E, H, I), "mxfp4"),
                (b + "ffn_down_exps.bias", (E, H), "bias")]
    out += [("output_norm.weight", (H,), "norm"), ("output.weight", (V, H), "bf16")]
    return out


def write_gguf(path: Path, cfg: dict[str, Any], seed: int = 0, skew: float = 1.0) -> None:
    """Stream the random model into ``path`` unless a complete one of the same hash is there."""
    import hashlib

    import gguf
    from transformers import AutoConfig, AutoTokenizer

    from specmoe.models.testing import gguf_metadata, gguf_tokenizer
    chash = hashlib.sha256(json.dumps([cfg, seed, skew, WRITER_VERSION], sort_keys=True)
                           .encode()).hexdigest()[:16]
    marker = Path(str(path) + ".complete")
    if path.is_file() and marker.is_file() and marker.read_text() == chash:
        log(f"GGUF {path} present (hash {chash})")
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    marker.unlink(missing_ok=True)
    hf_cfg = {k: v for k, v in cfg.items() if k != "architectures"}
    tmp = Path(str(path) + ".tmp")
    w = gguf.GGUFWriter(str(tmp), "gpt-oss")
    w.add_name(f"specmoe-bench random gpt-oss L{cfg['num_hidden_layers']}")
    gguf_metadata(w, AutoConfig.for_model(**hf_cfg))
    w.add_file_type(gguf.LlamaFileType.MOSTLY_MXFP4_MOE)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    gguf_tokenizer(w, AutoTokenizer.from_pretrained(str(bm._tokenizer_source())),
                   cfg["vocab_size"])
    specs = tensor_specs(cfg)
    mx, b16 = gguf.GGMLQuantizationType.MXFP4, gguf.GGMLQuantizationType.BF16

    def info(shape: tuple[int, ...], kind: str) -> tuple[tuple[int, ...], int, Any]:
        n = int(np.prod(shape))
        if kind == "mxfp4":
            return (*shape[:-1], shape[-1] // 32 * 17), n // 32 * 17, mx
        if kind == "bf16":
            return (*shape[:-1], shape[-1] * 2), 2 * n, b16
        return shape, 4 * n, None

    rng = np.random.default_rng(seed)
    std = cfg["initializer_range"]

    def fill(name: str, shape: tuple[int, ...], kind: str) -> np.ndarray:
        n = int(np.prod(shape))
        if kind == "norm":
            return np.ones(shape, np.float32)
        if kind in ("bias", "sink"):
            return (rng.standard_normal(shape) * std).astype(np.float32)
        if kind == "router":
            return bm.random_router(rng, shape, std, skew)
        if kind == "bf16":
            return bm.random_bf16(rng, shape)
        # MXFP4: random codes, exponents 119..121 (2^(e - 128) times the doubled E2M1
        # values, whose root mean square is 5.85: std about 0.02)
        nb = n // 32
        a = np.frombuffer(rng.bytes(nb * 17), np.uint8).reshape(nb, 17).copy()
        a[:, 0] = rng.integers(119, 122, nb, dtype=np.uint8)
        return a.reshape(*shape[:-1], shape[-1] // 32 * 17)

    bm.stream_gguf(w, tmp, path, chash, specs, info, fill)


# --------------------------------------------------------------------------------------------
# rows


def specmoe_worker(spec_path: str) -> None:
    """One specmoe row in this process: load, make every expert resident, time the decode at
    each thread count of the spec; prints one JSON line."""
    spec = json.loads(Path(spec_path).read_text())
    import specmoe  # before torch, as users should
    import torch

    from specmoe.runtime import kernels
    t0 = time.perf_counter()
    model = specmoe.from_pretrained(spec["gguf"], cache=1.0, dtype="auto", progress=False,
                                    policy="lru", prefetch=False, dense=spec["dense"],
                                    torch_dtype=torch.bfloat16, store=spec["store"])
    load_s = time.perf_counter() - t0
    eng = specmoe.engine_of(model)
    out: dict[str, Any] = {"load_s": load_s, "store_dtype": eng.dtype, "rows": {}}
    try:
        bm.load_every_expert(eng)  # every expert resident before timing
        # no end-of-sequence stop, as llama-bench: min_new_tokens instead would scan the
        # whole vocabulary at every step (decode_peers.py measured ~0.5 ms a step)
        model.generation_config.eos_token_id = None
        rng = np.random.default_rng(1)
        prompt = torch.tensor([rng.integers(100, 8000, 16).tolist()])

        def gen(n: int) -> float:
            t = time.perf_counter()
            with torch.no_grad():
                model.generate(prompt, attention_mask=torch.ones_like(prompt),
                               max_new_tokens=n, do_sample=False, pad_token_id=0)
            return time.perf_counter() - t

        fused = one_call_forwards(model)
        out["one_call_modules"] = len(fused)
        for th in spec["threads"]:
            torch.set_num_threads(th)
            kernels.set_num_threads(th)
            gen(spec["tokens"] + 1)  # warm-up
            c0 = eng.stats()
            full, one = gen(spec["tokens"] + 1), gen(1)
            c1 = eng.stats()
            hits, misses = c1["hits"] - c0["hits"], c1["misses"] - c0["misses"]
            row = {"tok_s": spec["tokens"] / max(full - one, 1e-9),
                   "hit_rate": hits / max(hits + misses, 1)}
            for _ in range(spec.get("ab_repeats", 0)):  # --ab: the one-call paths on / off
                for on in (False, True):
                    set_forwards(fused, on)
                    gen(2)  # (a warm-up step after the switch)
                    t = spec["tokens"] / max(gen(spec["tokens"] + 1) - gen(1), 1e-9)
                    row.setdefault("one_call_tok_s_runs" if on else "torch_glue_tok_s_runs",
                                   []).append(round(t, 3))
            if "one_call_tok_s_runs" in row:
                row["one_call_vs_torch_glue_runs"] = [
                    round(a / b, 3) for a, b in zip(row["one_call_tok_s_runs"],
                                                    row["torch_glue_tok_s_runs"])]
            out["rows"][str(th)] = row
    finally:
        eng.close()
    print(json.dumps(out))


def one_call_forwards(model: Any) -> list[tuple[Any, Any]]:
    """(module, its instance forward) of every module whose forward specmoe replaced to run
    it in C in one piece: fused attention modules (AttnBlock) and decoder layers, MoE blocks
    routed in C.  Without them (:func:`set_forwards` off) the same model runs its class
    forwards: torch glue around the same C projections, attention kernel, norms and experts,
    and the router in torch."""
    marks = ("_specmoe_block", "_specmoe_chain", "_specmoe_route")
    return [(m, m.__dict__["forward"]) for m in model.modules()
            if "forward" in m.__dict__ and any(hasattr(m, k) for k in marks)]


def set_forwards(saved: list[tuple[Any, Any]], on: bool) -> None:
    for m, f in saved:
        if on:
            m.forward = f
        else:
            m.__dict__.pop("forward", None)


def run_specmoe(gguf_path: Path, store: Path, threads: list[int], tokens: int, dense: str,
                work: Path, ab: int = 0) -> dict[str, Any]:
    spec = work / "gptoss_spec.json"
    spec.write_text(json.dumps({"gguf": str(gguf_path), "store": str(store), "threads": threads,
                                "tokens": tokens, "dense": dense, "ab_repeats": ab}))
    r = bm.run_process([sys.executable, str(Path(__file__).resolve()), "--_worker", str(spec)],
                       None, 3600)
    if r["rc"] != 0:
        return {"error": bm._fail_reason(r, None, "specmoe worker")}
    return json.loads(r["stdout"].strip().splitlines()[-1])


def run_llama(lc: Any, gguf_path: Path, th: int, tokens: int) -> dict[str, Any]:
    argv = [str(lc.bin / "llama-bench"), "-m", str(gguf_path), "-p", "0", "-n", str(tokens),
            "-r", "1", "-t", str(th), "-o", "json"]
    r = bm.run_process(argv, None, 3600)
    if r["rc"] != 0:
        return {"error": bm._fail_reason(r, None, "llama-bench")}
    for x in json.loads(r["stdout"]):
        if x.get("n_gen") == tokens:
            return {"tok_s": float(x["avg_ts"]),
                    "build": f"{x.get('build_commit')} ({x.get('build_number')})"}
    return {"error": "no tg test in llama-bench's output"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=32, help="decode tokens timed")
    ap.add_argument("--dense", default="bf16",
                    help="specmoe's dense layers: bf16 (its C kernels, the file's precision) "
                         "or torch")
    bm.add_peer_arguments(ap)  # --llama-isa avx2: pair with SPECMOE_ISA=avx2
    ap.add_argument("--ab", type=int, default=0, metavar="N",
                    help="also time specmoe's one-call paths against the same model's torch "
                         "glue, N interleaved repeats in the worker (one_call_tok_s_runs, "
                         "torch_glue_tok_s_runs)")
    ap.add_argument("--quick", action="store_true", help="tiny shapes, 1 round (smoke test)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--save", default=None, help="also write the JSON object to this file")
    ap.add_argument("--_worker", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._worker:
        specmoe_worker(a._worker)
        return
    threads = [int(t) for t in a.threads.split(",")]
    rounds = 1 if a.quick else a.rounds
    tokens = 8 if a.quick else a.tokens
    cfg = gptoss_config(a.layers if not a.quick else 2, quick=a.quick)
    work = Path(a.workdir).expanduser() / ("gptoss-quick" if a.quick else f"gptoss-L{a.layers}")
    work.mkdir(parents=True, exist_ok=True)
    path = work / "model-MXFP4.gguf"
    write_gguf(path, cfg)
    store = work / "store-gguf.smoe"
    lc = None
    why = None
    lc = bm.LlamaCpp(Path(a.peers).expanduser(), not a.no_build_peers, max(threads),
                     isa=a.llama_isa)
    if lc.error:  # no build and none allowed, or the build failed: the rows say why
        why, lc = lc.error, None
        log(why)
    res: dict[str, dict[str, list[Any]]] = {"specmoe-gguf-MXFP4": {}, "llama.cpp-MXFP4": {}}
    extra: dict[str, Any] = {}
    for rnd in range(rounds):
        order = ["specmoe", "llama"] if rnd % 2 == 0 else ["llama", "specmoe"]
        for who in order:
            if who == "specmoe":
                r = run_specmoe(path, store, threads if rnd % 2 == 0 else threads[::-1],
                                tokens, a.dense, work, a.ab)
                if "one_call_modules" in r:
                    extra["specmoe_one_call_modules"] = r["one_call_modules"]
                extra["specmoe_load_s"] = r.get("load_s")
                extra["specmoe_store_dtype"] = r.get("store_dtype")
                for th in threads:
                    row = r.get("rows", {}).get(str(th), {"error": r.get("error")})
                    res["specmoe-gguf-MXFP4"].setdefault(str(th), []).append(row)
                log(f"round {rnd + 1} specmoe:", json.dumps(r)[:300])
            else:
                for th in (threads if rnd % 2 == 0 else threads[::-1]):
                    row = run_llama(lc, path, th, tokens) if lc else {"error": why}
                    res["llama.cpp-MXFP4"].setdefault(str(th), []).append(row)
                    log(f"round {rnd + 1} llama.cpp t={th}:", json.dumps(row)[:200])
    rows = []
    for name, per in res.items():
        for th, runs in per.items():
            tps = [x.get("tok_s") for x in runs]
            row: dict[str, Any] = {"name": name, "threads": int(th),
                                   "tok_per_s_runs": [round(t, 3) if t else None for t in tps],
                                   "tok_per_s": (round(statistics.median(t for t in tps if t), 3)
                                                 if any(tps) else None)}
            errs = [x["error"] for x in runs if x.get("error")]
            if errs:
                row["error"] = errs[0]
            if name.startswith("specmoe"):
                peer = [x.get("tok_s") for x in res["llama.cpp-MXFP4"].get(th, [])]
                row["vs_llama_cpp_runs"] = [round(s / p, 3) if s and p else None
                                            for s, p in zip(tps, peer)]
                row["hit_rate"] = runs[-1].get("hit_rate")
                for k in ("one_call_tok_s_runs", "torch_glue_tok_s_runs",
                          "one_call_vs_torch_glue_runs"):
                    if any(k in x for x in runs):
                        row[k] = [v for x in runs for v in x.get(k, [])]
            else:
                row["llama_cpp_build"] = next((x.get("build") for x in runs if x.get("build")),
                                              None)
            rows.append(row)
    out = {"config": {"model": "GPT-OSS-20B shapes, random weights", "layers":
                      cfg["num_hidden_layers"], "file": str(path),
                      "file_bytes": path.stat().st_size, "experts": "MXFP4",
                      "dense": "BF16 in the file; specmoe dense=" + a.dense,
                      "tokens": tokens, "rounds": rounds, "quick": a.quick,
                      "llama_cpp_isa": a.llama_isa},
           "host": hostinfo.host(threads), **extra, "rows": rows}
    text = json.dumps(out, indent=1)
    if a.save:
        Path(a.save).write_text(text)
    if a.json:
        print(text)
    else:
        for r in rows:
            print(f"{r['name']:22s} t={r['threads']} tok/s {r['tok_per_s']} "
                  f"{r.get('vs_llama_cpp_runs', '')} {r.get('error', '')}")


if __name__ == "__main__":
    main()

"""Command line: ``python -m specmoe <command>`` (also installed as ``specmoe``)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

def _shared_traces() -> Path:
    """../shared/traces/deepseek-v2-lite-puffin next to the checkout or the working directory."""
    rel = Path("shared") / "traces" / "deepseek-v2-lite-puffin"
    for base in (Path(__file__).resolve().parent.parent.parent, Path.cwd().parent,
                 Path.cwd().parent.parent):
        if (base / rel).is_dir():
            return base / rel
    return Path("..") / rel


_SHARED_TRACES = _shared_traces()


def _split(s: str) -> list[str]:
    return [p.strip() for p in s.split(",") if p.strip()]


def _capacity(s: str) -> "int | str":
    return int(s) if s.isdigit() else s


def _at_least(lo: int):
    """argparse type: an int >= lo, refused at parse time with argparse's usage message (not
    as a traceback after the model has loaded)."""
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        return v
    return parse


def _add_trace_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", default=None,
                   help="a specmoe .npz trace, or a puffin CSV file or directory (default: "
                        "../shared/traces/deepseek-v2-lite-puffin when present)")
    p.add_argument("--tokens", type=_at_least(1), default=None,
                   help="replay only the first N tokens of the trace")
    p.add_argument("--policies", default="lru,lfu,least_stale,belady",
                   help="comma-separated policy specs (e.g. lru,least_stale:order=lru,belady)")
    p.add_argument("--capacity", default="5%,10%,25%",
                   help="comma-separated capacities: slots (40), percentages (10%%), bytes (2GB)")
    p.add_argument("--verify-tokens", type=_at_least(1), default=1,
                   help="tokens per forward pass (a speculative verification of K drafts + 1; "
                        "the union of their experts per layer; demand only); default 1")


def _load(args) -> "object":
    from .traces import load_trace

    path = args.trace or (_SHARED_TRACES if _SHARED_TRACES.exists() else None)
    if path is None:
        raise SystemExit("specmoe: no --trace given and ../shared/traces is not present")
    tr = load_trace(path, progress=not getattr(args, "json", False)) \
        if Path(path).is_dir() else load_trace(path)
    if args.tokens is not None:
        tr = tr.slice(0, min(args.tokens, tr.num_tokens))
    return tr


def _hardware(names: str, command: str) -> list:
    """The profiles named by ``--hardware`` (comma-separated), resolved once, before any
    trace work: a bad name or profile file ends the command with its reason."""
    from .cuda import CudaUnavailable  # (the module only: the extension loads on first use)
    from .hardware import get_hardware

    try:
        return [get_hardware(h) for h in _split(names)]
    except (ValueError, CudaUnavailable) as exc:
        raise SystemExit(f"specmoe {command}: {exc}") from None


def _cmd_simulate(args) -> int:
    from .sim import simulate

    hw = _hardware(args.hardware, "simulate")
    if len(hw) != 1:
        raise SystemExit("specmoe simulate: --hardware takes one profile (sweep takes several)")
    tr = _load(args)
    results = []
    for pol in _split(args.policies):
        for cap in _split(args.capacity):
            results.append(simulate(tr, pol, _capacity(cap), args.prefetch, hw[0],
                                    verify_tokens=args.verify_tokens, miss=args.miss,
                                    miss_keep=args.miss_keep, miss_keep2=args.miss_keep2))
    acc = sum(r.accesses for r in results)
    el = sum(r.elapsed_s for r in results)
    out = {
        "trace": {"source": str(args.trace or _SHARED_TRACES), "tokens": tr.num_tokens,
                  "requests": tr.num_requests, "layers": tr.num_layers,
                  "experts": tr.num_experts, "top_k": tr.top_k},
        "hardware": args.hardware, "hardware_profile": hw[0].to_dict(),
        "prefetch": args.prefetch or "none",
        "verify_tokens": args.verify_tokens, "miss": args.miss,
        "results": [r.to_dict() for r in results],
        "accesses_per_s": acc / el if el > 0 else 0.0,
    }
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"{tr!r}  hardware={args.hardware}  prefetch={args.prefetch or 'none'}  "
          f"miss={args.miss}")
    hdr = f"{'policy':<22}{'slots':>6}{'hit':>8}{'collis':>8}{'stall_s':>10}{'tpot_ms':>9}" \
          f"{'ttft_ms':>9}{'Macc/s':>8}"
    print(hdr)
    for r in results:
        print(f"{r.policy:<22}{r.capacity_slots:>6}{r.hit_rate:>8.4f}{r.collision_misses:>8}"
              f"{r.stall_s:>10.2f}{r.est_tpot_ms:>9.2f}{r.ttft_ms:>9.1f}"
              f"{r.accesses_per_s / 1e6:>8.1f}")
    print(f"overall {out['accesses_per_s'] / 1e6:.1f} M accesses/s")
    return 0


def _cmd_sweep(args) -> int:
    from .sweep import sweep, write_results

    hw = _hardware(args.hardware, "sweep")
    tr = _load(args)
    rows = sweep(tr, _split(args.policies), [_capacity(c) for c in _split(args.capacity)],
                 hardware=hw, predictors=args.prefetch or ["none"],
                 processes=args.processes, progress=not args.json,
                 verify_tokens=args.verify_tokens)
    paths = write_results(rows, args.out, plots=not args.no_plots)
    if args.json:
        print(json.dumps({"results": rows, "files": {k: str(v) for k, v in paths.items()}}))
    else:
        for k, v in paths.items():
            print(f"{k}: {v}")
    return 0


def _peak_rss() -> int:
    """Peak resident memory of this process in bytes (VmHWM)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _cmd_convert(args) -> int:
    from .pretrained import convert

    try:
        path = convert(args.checkpoint, dtype=args.dtype, out=args.output, force=args.force,
                       progress=not args.quiet)
    except (FileNotFoundError, ValueError) as exc:
        raise SystemExit(f"specmoe convert: {exc}") from None
    print(path)
    return 0


def _cmd_run(args) -> int:
    import time

    import torch

    from .hf import engine_of
    from .pretrained import from_pretrained

    if args.threads is not None:
        from . import kernels
        torch.set_num_threads(args.threads)
        kernels.set_num_threads(args.threads)
    try:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(args.checkpoint, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"specmoe run: {args.checkpoint} has no usable tokenizer ({exc})") \
            from None
    try:
        model = from_pretrained(args.checkpoint, cache=_capacity(args.cache), dtype=args.dtype,
                                policy=args.policy, prefetch=not args.no_prefetch,
                                store=args.store, dense=args.dense)
    except (FileNotFoundError, ValueError) as exc:
        raise SystemExit(f"specmoe run: {exc}") from None
    eng = engine_of(model)
    ids = tok(args.prompt, return_tensors="pt").input_ids
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=args.max_new_tokens, do_sample=False,
                             pad_token_id=tok.pad_token_id if tok.pad_token_id is not None
                             else tok.eos_token_id)
    dt = time.perf_counter() - t0
    new = out.shape[1] - ids.shape[1]
    print(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True))
    s = eng.stats()
    hr = s.get("hit_rate")
    print(f"[specmoe] {new} tokens in {dt:.2f} s ({new / dt if dt > 0 else 0:.2f} tok/s, prompt "
          f"{ids.shape[1]} tokens included) | cache {s['capacity']} experts "
          f"({s['cache_bytes'] / 2**20:.0f} MiB, {args.dtype}, {eng.policy}) | {eng.dense} | "
          f"hit rate "
          f"{'n/a' if hr is None else f'{hr:.3f}'} | stall {s.get('stall_s', 0.0):.2f} s | "
          f"peak memory {_peak_rss() / 2**20:.0f} MiB", file=sys.stderr if args.quiet else
          sys.stdout)
    eng.close()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="specmoe", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("demo", help="run the main job on an embedded default")

    p = sub.add_parser("simulate", help="replay a routing trace through the cache simulator")
    _add_trace_args(p)
    p.add_argument("--prefetch", default=None,
                   help="predictor spec: none, oracle[:depth=N], router, history[:topk=N,"
                        "percentile=Q,history=N,cooc_weight=W]")
    p.add_argument("--hardware", default="a100-pcie4",
                   help="a100-pcie4, rtx4090, laptop, h200, calibrate (this CPU), "
                        "calibrate-gpu (this GPU tier) or a profile .json file "
                        "(Hardware.save)")
    p.add_argument("--miss", default="fetch",
                   choices=["fetch", "drop", "substitute", "lowest_bit", "priority"],
                   help="SpecMD miss handling (see specmoe.sim.simulate)")
    p.add_argument("--miss-keep", type=int, default=2,
                   help="drop, priority: ranks below this are always fetched (default 2)")
    p.add_argument("--miss-keep2", type=int, default=None,
                   help="priority: ranks from this on come from a second, int2 copy (SpecMD's "
                        "int4 -> int2 cascade; default: none)")
    p.add_argument("--json", action="store_true", help="print one JSON object")

    p = sub.add_parser("sweep", help="simulate policies x capacities x hardware x predictors")
    _add_trace_args(p)
    p.add_argument("--prefetch", action="append", default=None,
                   help="a predictor spec; repeat the flag for several (default: none)")
    p.add_argument("--hardware", default="a100-pcie4", help="comma-separated profiles")
    p.add_argument("--processes", type=_at_least(1), default=None, help="worker processes")
    p.add_argument("--out", default="sweep_out", help="output directory")
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--json", action="store_true", help="print one JSON object")

    p = sub.add_parser("convert", help="convert a checkpoint's routed experts to a store")
    p.add_argument("checkpoint", help="a local HuggingFace checkpoint folder")
    p.add_argument("--dtype", default="bf16", choices=["f32", "bf16", "int8", "int4"])
    p.add_argument("-o", "--output", default=None,
                   help="store file (default: one per checkpoint and dtype under "
                        "$SPECMOE_CACHE or ~/.cache/specmoe)")
    p.add_argument("--force", action="store_true", help="rewrite an up-to-date store")
    p.add_argument("--quiet", action="store_true", help="no progress bar")

    p = sub.add_parser("run", help="generate text with a checkpoint's experts offloaded")
    p.add_argument("checkpoint", help="a local HuggingFace checkpoint folder")
    p.add_argument("--prompt", required=True)
    p.add_argument("--cache", default="25%",
                   help="expert cache: a fraction (25%%), slots (40) or bytes (6GiB)")
    p.add_argument("--max-new-tokens", type=_at_least(1), default=64)
    p.add_argument("--dtype", default="bf16", choices=["f32", "bf16", "int8", "int4"])
    p.add_argument("--policy", default="least_stale")
    p.add_argument("--no-prefetch", action="store_true")
    p.add_argument("--store", default=None, help="store file (default: see convert)")
    p.add_argument("--threads", type=_at_least(1), default=None,
                   help="threads of torch and of specmoe's kernels (default: torch's)")
    p.add_argument("--dense", default="auto",
                   choices=["auto", "torch", "f32", "bf16", "int8", "int4"],
                   help="attention, shared/dense MLP and lm_head through specmoe's C kernels "
                        "(auto: bf16 weights kept exactly; int8/int4 quantize them)")
    p.add_argument("--quiet", action="store_true", help="statistics line to stderr")

    args = parser.parse_args(argv)
    if args.command == "convert":
        return _cmd_convert(args)
    if args.command == "run":
        return _cmd_run(args)
    if args.command == "demo":
        from .demo import main as demo_main

        return demo_main()
    if args.command == "simulate":
        return _cmd_simulate(args)
    if args.command == "sweep":
        return _cmd_sweep(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())

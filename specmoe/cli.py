"""Command line: ``python -m specmoe <command>`` (also installed as ``specmoe``).

A failure ends with one line, ``specmoe: error: ...`` naming the file, field or option at
fault, and exit status 1 (``--debug``, before or after the command: the traceback instead); an
interrupt exits 130; a usage error is argparse's (exit 2)."""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from .sim.traces import shared_trace_dir

# The kernel pool's largest thread count (csrc/kernels/pool.c, csrc/bindings/py_kernels.c).
MAX_THREADS = 1024


# what the 'hf' extra installs (pyproject.toml): a command that imports one of them names it
_HF_EXTRA = ("torch", "transformers", "safetensors", "accelerate", "gguf")


class CliError(Exception):
    """A command-line failure: its message, one line naming the file, field or option at
    fault, is printed as ``specmoe: error: <message>``."""


_SHARED_TRACES = shared_trace_dir()


def _split(s: str) -> list[str]:
    return [p.strip() for p in s.split(",") if p.strip()]


def _capacity(s: str) -> "int | float | str":
    """A capacity given as text, as the value the API's ``cache=`` / ``capacity=`` takes for
    the same text: digits are slots (``"40"`` -> 40), a plain number a fraction of all experts
    (``"0.5"`` -> 0.5, which must be in (0, 1]), anything else a percentage (``"25%"``) or a
    size (``"6GiB"``); checked by :func:`specmoe.runtime.cache.check_capacity` (ValueError)."""
    from .runtime.cache import check_capacity

    t = s.strip()
    v: "int | float | str"
    if re.fullmatch(r"[0-9]+", t):
        v = int(t)
    else:
        try:
            v = float(t)
        except ValueError:
            v = t
    check_capacity(v)
    return v


def _option(name: str, value: str, parse: Callable[[str], Any]) -> Any:
    """``parse(value)``, its ValueError/TypeError turned into a CliError naming the option."""
    try:
        return parse(value)
    except (ValueError, TypeError) as exc:
        msg = str(exc)
        raise CliError(f"{name}: {msg}" if value and value in msg else
                       f"{name} {value!r}: {msg}") from None


def _options(name: str, text: str, parse: Callable[[str], Any]) -> list:
    """A comma-separated option, each item parsed with :func:`_option`; an empty list is an
    error (it used to run nothing and exit 0)."""
    items = _split(text)
    if not items:
        raise CliError(f"{name} {text!r}: empty list; give at least one value")
    return [_option(name, x, parse) for x in items]


def _sim_policy(spec: str) -> str:
    """A simulator policy spec, checked (name and options) before any trace is read."""
    from . import _C
    from .sim.replay import parse_policy

    name, _ = parse_policy(spec)
    names = [n.strip() for n in _C.POLICY_NAMES.split(",")]
    if name not in names:
        raise ValueError(f"unknown policy {name!r}; valid names: {', '.join(names)}")
    return spec


def _at_least(lo: int, hi: "int | None" = None):
    """argparse type: an int >= lo (and <= hi), refused at parse time with argparse's usage
    message (not as a traceback after the model has loaded)."""
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {s!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {v}")
        if hi is not None and v > hi:
            raise argparse.ArgumentTypeError(f"must be <= {hi}, got {v}")
        return v
    return parse


def _non_negative(s: str) -> float:
    """argparse type: a finite number >= 0, refused at parse time."""
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
    if not 0 <= v < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {s}")
    return v


def _probability(s: str) -> float:
    """argparse type: a number in (0, 1] (--top-p), refused at parse time."""
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {s!r}") from None
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {s}")
    return v


def _positive_seconds(s: str) -> float:
    """argparse type: a finite number of seconds > 0, refused at parse time."""
    v = _non_negative(s)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, got {s}")
    return v


def _add_trace_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--trace", default=None,
                   help="a specmoe .npz trace, or a puffin CSV file or directory (default: "
                        "../shared/traces/deepseek-v2-lite-puffin when present)")
    p.add_argument("--tokens", type=_at_least(1), default=None,
                   help="replay only the first N tokens of the trace")
    p.add_argument("--policies", default="lru,lfu,least_stale,belady",
                   help="comma-separated policy specs (e.g. lru,least_stale:order=lru,belady)")
    p.add_argument("--capacity", default="5%,10%,25%",
                   help="comma-separated capacities: slots (40), fractions (0.1), "
                        "percentages (10%%), bytes (2GB)")
    p.add_argument("--verify-tokens", type=_at_least(1, 65536), default=1,
                   help="tokens per forward pass (a speculative verification of K drafts + 1; "
                        "the union of their experts per layer; demand only); default 1")


def _load(args) -> "object":
    from .sim.traces import load_trace

    path = args.trace or (_SHARED_TRACES if _SHARED_TRACES.exists() else None)
    if path is None:
        raise CliError(f"--trace: none given and the default {_SHARED_TRACES} is not present")
    tr = load_trace(path, progress=not getattr(args, "json", False)) \
        if Path(path).is_dir() else load_trace(path)
    if args.tokens is not None:
        tr = tr.slice(0, min(args.tokens, tr.num_tokens))
    return tr


def _hardware(names: str) -> list:
    """The profiles named by ``--hardware`` (comma-separated), resolved once, before any
    trace work: a bad name or profile file ends the command with its reason."""
    from .runtime.cuda import CudaUnavailable  # (the module only: the extension loads on first use)
    from .sim.calibration import get_hardware

    try:
        return _options("--hardware", names, get_hardware)
    except CudaUnavailable as exc:
        raise CliError(f"--hardware {names!r}: {exc}") from None


def _one_token_options(args, predictors: list) -> None:
    """Prefetch predictors are defined per token: refused with --verify-tokens above 1."""
    if args.verify_tokens > 1 and any(p.kind != "none" for p in predictors):
        raise CliError(f"--prefetch needs --verify-tokens 1 (a pass of {args.verify_tokens} "
                       f"tokens replays demand only)")


def _cmd_simulate(args) -> int:
    from .sim.replay import Predictor, simulate

    # every option is checked before the trace is read (it may be 200 files)
    hw = _hardware(args.hardware)
    if len(hw) != 1:
        raise CliError("--hardware: simulate takes one profile (sweep takes several)")
    policies = _options("--policies", args.policies, _sim_policy)
    caps = _options("--capacity", args.capacity, _capacity)
    pred = _option("--prefetch", args.prefetch or "none", Predictor.parse)
    _one_token_options(args, [pred])
    if args.miss != "fetch" and args.verify_tokens > 1:
        raise CliError(f"--miss {args.miss} replays one token per pass: it needs "
                       f"--verify-tokens 1, got {args.verify_tokens}")
    if args.hybrid and (args.miss != "fetch" or args.verify_tokens > 1):
        raise CliError("--hybrid replays one token per pass with --miss fetch")
    if args.hybrid and not hw[0].cpu_bw > 0:
        raise CliError(f"--hybrid needs the host CPU's expert rate: profile {hw[0].name!r} has "
                       f"no cpu_bw (use --hardware h200, calibrate-gpu, or a profile with it)")
    tr = _load(args)
    results = []
    for pol in policies:
        for cap in caps:
            results.append(simulate(tr, pol, cap, args.prefetch, hw[0],
                                    verify_tokens=args.verify_tokens, miss=args.miss,
                                    miss_keep=args.miss_keep, miss_keep2=args.miss_keep2,
                                    hybrid=args.hybrid))
    acc = sum(r.accesses for r in results)
    el = sum(r.elapsed_s for r in results)
    out = {
        "trace": {"source": str(args.trace or _SHARED_TRACES), "tokens": tr.num_tokens,
                  "requests": tr.num_requests, "layers": tr.num_layers,
                  "experts": tr.num_experts, "top_k": tr.top_k},
        "hardware": args.hardware, "hardware_profile": hw[0].to_dict(),
        "prefetch": args.prefetch or "none",
        "verify_tokens": args.verify_tokens, "miss": args.miss, "hybrid": args.hybrid,
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
    from .sim.replay import Predictor
    from .sim.sweep import sweep, write_results

    hw = _hardware(args.hardware)
    policies = _options("--policies", args.policies, _sim_policy)
    caps = _options("--capacity", args.capacity, _capacity)
    _one_token_options(args, [_option("--prefetch", spec, Predictor.parse)
                              for spec in args.prefetch or []])
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise CliError(f"--out {args.out}: not a directory")
    tr = _load(args)
    rows = sweep(tr, policies, caps, hardware=hw, predictors=args.prefetch or ["none"],
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


def _checkpoint(args: argparse.Namespace, store: "str | None") -> None:
    """The checkpoint folder and the store's location checked before anything loads (torch
    included): the library's own checks, as from_pretrained and convert make them
    (a missing path used to be blamed on the tokenizer, a bad store path found only after a
    whole conversion)."""
    from .storage.conversion import check_store_location, default_store_path, open_checkpoint

    ck = open_checkpoint(args.checkpoint)  # config.json and every shard's header, or GGUF's
    ck.close()
    dtype = args.dtype
    if dtype == "auto":
        from .storage.conversion import store_dtype
        dtype = store_dtype(ck, dtype, quiet=True)  # from_pretrained says it
    check_store_location(default_store_path(ck.folder, dtype) if store is None else store,
                         checkpoint=ck.folder)


def _cmd_convert(args) -> int:
    from .models.pretrained import convert

    _checkpoint(args, args.output)
    path = convert(args.checkpoint, dtype=args.dtype, out=args.output, force=args.force,
                   progress=not args.quiet)
    print(path)
    return 0


def _policy_option(spec: str) -> Any:
    """``--policy``: the simulator's spec of a live eviction policy, checked (a CliError
    naming the option otherwise)."""
    from .sim.replay import live_policy

    def parse(text: str) -> Any:
        from .runtime.policies import check_policy

        pol = live_policy(text)
        check_policy(pol)
        return pol

    return _option("--policy", spec, parse)


def _cmd_run(args) -> int:
    # every argument is checked before the model (and torch) loads
    prompt = _prompt_text(args)
    cache = None if args.cache is None and args.memory is not None else \
        _option("--cache", "25%" if args.cache is None else args.cache, _capacity)
    if args.memory is not None:
        from .runtime.memplan import memory_budget
        _option("--memory", args.memory, memory_budget)
    gpu_cache = None if args.gpu_cache is None else \
        _option("--gpu-cache", args.gpu_cache, _capacity)
    policy = _policy_option(args.policy)
    drafter, controller, mtp_adapter, draft_dir = _speculation_options(args)
    sampling = _sampling_options(args)
    dev = args.device
    if dev != "cpu" and not (dev == "cuda" or dev.startswith("cuda:") and dev[5:].isdigit()):
        raise CliError(f"--device {dev!r}: cpu, cuda or cuda:N")
    if gpu_cache is not None and dev == "cpu":
        raise CliError("--gpu-cache: the hybrid tier needs --device cuda")
    if dev != "cpu":
        from .runtime.cuda import unusable_reason
        why = unusable_reason()
        if why:
            raise CliError(f"--device {dev}: {why}")
        if args.dense not in ("auto", "torch"):
            raise CliError(f"--dense {args.dense}: with --device {dev} the model's own layers "
                           "run on the GPU (--dense auto or torch)")
    _checkpoint(args, args.store)

    import torch

    from .runtime.experts import engine_of
    from .models.pretrained import from_pretrained, load_tokenizer

    if args.threads is not None:
        from .runtime import kernels
        torch.set_num_threads(args.threads)
        kernels.set_num_threads(args.threads)
    try:
        tok = load_tokenizer(args.checkpoint)  # a GGUF file's is in its metadata
    except (OSError, ValueError) as exc:
        raise CliError(f"{args.checkpoint}: no usable tokenizer ({exc})") from None
    conv = [{"role": "system", "content": args.system}] if args.system else []
    if args.interactive:  # the chat template checked before the model loads
        _chat_ids(tok, conv + [{"role": "user", "content": prompt or "hello"}], args)
    elif args.chat:
        ids = _chat_ids(tok, conv + [{"role": "user", "content": prompt}], args)
    else:
        ids = _prompt_ids(tok, prompt, args)
    # with --memory and --drafter the plan sets aside what the controller's verifications record
    k_max = 0
    if drafter is not None and args.memory is not None:
        from .speculation.controllers import controller_factory
        k_max = int(controller_factory(controller)().k_max)
    model = from_pretrained(args.checkpoint, cache=cache, dtype=args.dtype, policy=policy,
                            prefetch=False if args.no_prefetch else args.predictor,
                            store=args.store, dense=args.dense, memory=args.memory,
                            device=dev, gpu_cache=gpu_cache, k_max=k_max)
    eng = engine_of(model)
    stream = args.interactive or (sys.stdout.isatty() if args.stream is None else args.stream)
    streamer = None
    if stream:
        from transformers import TextStreamer
        streamer = TextStreamer(tok, skip_prompt=True, skip_special_tokens=True)

    try:
        if draft_dir is not None:  # the draft model's own load, after the target's
            drafter = _load_draft_model(draft_dir, model)
        session = _RunSession(model, eng, tok, args, streamer, drafter, controller,
                              mtp_adapter, sampling, gpu_cache)
        if args.interactive:
            return _chat_loop(tok, conv, prompt, args, session)
        new, dt, spec = session.turn(ids)
        if streamer is None:  # (streamed: already printed, its newline included)
            print(tok.decode(new, skip_special_tokens=True))
        print(session.stats_line(len(new), dt, ids.shape[1], spec),
              file=sys.stderr if args.quiet else sys.stdout)
    finally:
        eng.close()
    return 0


class _RunSession:
    """run's generations on one loaded model: a single prompt, or the turns of --interactive.

    With --interactive and plain decoding the conversation's KV cache is kept between turns
    and cut back to the prefix the next turn's ids share with it, so a turn reads only its new
    message (recurrent layers cannot be cut back: those models re-read the conversation)."""

    def __init__(self, model: Any, eng: Any, tok: Any, args: argparse.Namespace,
                 streamer: Any, drafter: Any, controller: Optional[str],
                 mtp_adapter: Optional[str], sampling: Optional[dict], gpu_cache: Any):
        from .speculation.decoding import unrollable_layer_types
        self.model, self.eng, self.tok, self.args = model, eng, tok, args
        self.streamer, self.sampling, self.gpu_cache = streamer, sampling, gpu_cache
        self.drafter, self.controller, self.mtp_adapter = drafter, controller, mtp_adapter
        self.keep_kv = bool(args.interactive and drafter is None
                            and not unrollable_layer_types(model.config))
        self.kv: Any = None       # the kept cache (keep_kv only) ...
        self.kv_ids: list = []    # ... and the token ids it holds
        self.reused = 0           # tokens of the last turn's ids read from the kept cache

    def cached(self, ids: Any) -> Any:
        """The kept cache cut back to what ``ids`` shares with it (at least one token of
        ``ids`` left to read), or a new one."""
        from .speculation.decoding import crop_kv, new_kv
        new, old = ids[0].tolist(), self.kv_ids
        n = 0
        while n < min(len(old), len(new) - 1) and old[n] == new[n]:
            n += 1
        if self.kv is None or n == 0:
            self.reused = 0
            return new_kv(self.model, rollback=True)
        crop_kv(self.kv, n)
        self.reused = n
        return self.kv

    def turn(self, ids: Any) -> tuple[Any, float, str]:
        """One generation from ids: (new token ids, seconds, speculation's statistics)."""
        import time

        import torch

        from .speculation.decoding import cache_kwargs
        model, tok, args, sampling = self.model, self.tok, self.args, self.sampling
        ids = ids.to(model.device)
        t0 = time.perf_counter()
        if self.drafter is not None:
            # timed from the prefill on (tau's measurement, once per model, before it)
            out, spec, t_gen = _speculate(model, self.eng, ids, self.drafter, self.controller,
                                          self.mtp_adapter, args.max_new_tokens, sampling,
                                          self.streamer)
            return out[0, ids.shape[1]:], t_gen, spec
        if sampling and sampling["seed"] is not None:
            torch.manual_seed(sampling["seed"])
        kv = self.cached(ids) if self.keep_kv else None
        with torch.no_grad():
            # top_k 0 / top_p 1: no truncation (transformers' generation_config defaults
            # would otherwise add its top_k=50)
            out = model.generate(ids, attention_mask=torch.ones_like(ids),
                                 max_new_tokens=args.max_new_tokens,
                                 pad_token_id=tok.pad_token_id
                                 if tok.pad_token_id is not None else tok.eos_token_id,
                                 streamer=self.streamer,
                                 **(cache_kwargs(model, kv) if kv is not None else {}),
                                 **({"do_sample": True,
                                     "temperature": sampling["temperature"],
                                     "top_k": sampling["top_k"] or 0,
                                     "top_p": sampling["top_p"] or 1.0}
                                    if sampling else {"do_sample": False}))
        if kv is not None:  # it holds every token but the last one sampled
            held = out[0, :-1].tolist()
            ok = int(kv.get_seq_length()) == len(held)
            self.kv, self.kv_ids = (kv, held) if ok else (None, [])
        return out[0, ids.shape[1]:], time.perf_counter() - t0, ""

    def stats_line(self, new: int, dt: float, n_prompt: int, spec: str) -> str:
        """The statistics printed after a generation of ``new`` tokens in ``dt`` seconds."""
        args, eng = self.args, self.eng
        s = eng.stats()
        hr = s.get("hit_rate")
        kept = f", {self.reused} of them kept from the last turn" if self.keep_kv else ""
        return (f"[specmoe] {new} tokens in {dt:.2f} s ({new / dt if dt > 0 else 0:.2f} tok/s, "
                f"prompt {n_prompt} tokens included{kept}) | cache {s['capacity']} experts "
                f"({s['cache_bytes'] / 2**20:.0f} MiB, {getattr(eng, 'dtype', args.dtype)}, "
                f"{args.policy}) | "
                f"{getattr(eng, 'dense', 'dense on ' + args.device)} | "
                + (f"CPU experts {s.get('cpu_experts', 0)} | "
                   if self.gpu_cache is not None else "")
                + "hit rate "
                f"{'n/a' if hr is None else f'{hr:.3f}'} | stall {s.get('stall_s', 0.0):.2f} s | "
                f"peak memory {_peak_rss() / 2**20:.0f} MiB{spec}")


def _chat_loop(tok: Any, conv: list, first: Optional[str], args,
               session: _RunSession) -> int:
    """run --interactive: a conversation on the terminal.  Each line read is a user's message
    (the first one --prompt's, if given); the whole conversation so far goes through the chat
    template and the answer is streamed, then kept in the conversation.  An empty line is
    skipped; end of input (Ctrl-D) or /exit ends it.  Statistics per answer go to stderr."""
    tty = sys.stdin.isatty()
    while True:
        if first is not None:
            msg, first = first, None
            if not tty:
                print(f"> {msg}", flush=True)
        elif tty:
            try:
                msg = input("> ")
            except EOFError:
                print()
                return 0
        else:
            line = sys.stdin.readline()
            if line == "":
                return 0
            msg = line.rstrip("\n")
            print(f"> {msg}" if msg.strip() else ">", flush=True)  # the transcript's side
        if msg.strip() == "/exit":
            return 0
        if not msg.strip():
            continue
        conv.append({"role": "user", "content": msg})
        ids = _chat_ids(tok, conv, args)
        new, dt, spec = session.turn(ids)
        conv.append({"role": "assistant", "content": tok.decode(new, skip_special_tokens=True)})
        print(session.stats_line(len(new), dt, ids.shape[1], spec), file=sys.stderr, flush=True)


def _prompt_text(args) -> Optional[str]:
    """run's prompt: --prompt TEXT or --prompt-file FILE ("-": standard input), one of them,
    not empty (with --interactive: --prompt, the first message, or none)."""
    if args.interactive:
        if args.prompt_file is not None:
            raise CliError("--prompt-file: --interactive reads its messages from standard "
                           "input (--prompt gives the first)")
        if args.prompt == "":
            raise CliError("--prompt is empty")
        return args.prompt
    if (args.prompt is None) == (args.prompt_file is None):
        raise CliError("give the prompt as --prompt TEXT or --prompt-file FILE (one of them)")
    if args.system is not None and not args.chat:
        raise CliError("--system goes with --chat or --interactive")
    if args.prompt_file is not None:
        try:
            if args.prompt_file == "-":
                text = sys.stdin.read()
            else:
                with open(args.prompt_file, encoding="utf-8") as f:
                    text = f.read()
        except (OSError, UnicodeDecodeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise CliError(f"--prompt-file {args.prompt_file}: cannot read it ({why})") \
                from None
        if text == "":
            raise CliError(f"--prompt-file {args.prompt_file} is empty")
        return text
    if args.prompt == "":
        raise CliError("--prompt is empty")
    return args.prompt


def _prompt_ids(tok: Any, prompt: str, args) -> Any:
    """The prompt's token ids [1, n], the text as it is."""
    what = "--prompt-file" if args.prompt_file is not None else "--prompt"
    ids = tok(prompt, return_tensors="pt").input_ids
    if ids.shape[1] == 0:
        raise CliError(f"{what}: the tokenizer makes no tokens of {prompt[:80]!r}")
    return ids


def _chat_ids(tok: Any, conv: list, args) -> Any:
    """A conversation's token ids [1, n] in the tokenizer's chat template, ready for the
    assistant's answer (as the server's /v1/chat/completions builds them)."""
    flag = "--interactive" if args.interactive else "--chat"
    if not getattr(tok, "chat_template", None):
        raise CliError(f"{flag}: the tokenizer of {args.checkpoint} has no chat template "
                       "(run without it gives the model the prompt as it is)")
    try:
        text = tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    except Exception as exc:  # the template's own errors (jinja raise_exception, ...)
        raise CliError(f"{flag}: the chat template refused the conversation ({exc})") from None
    return tok(text, add_special_tokens=False, return_tensors="pt").input_ids


def _sampling_options(args) -> Optional[dict]:
    """run's --temperature, --top-p, --top-k and --seed: None for greedy decoding (temperature
    0, the default), else the sampling's parameters; a truncation or a seed without a
    temperature is refused (it would change nothing)."""
    if args.temperature > 0:
        return {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
                "seed": args.seed}
    for name, v in (("--top-p", args.top_p), ("--top-k", args.top_k), ("--seed", args.seed)):
        if v is not None:
            raise CliError(f"{name} samples: give --temperature above 0 with it (decoding is "
                           "greedy by default)")
    return None


def _speculate(model: Any, eng: Any, ids: Any, drafter: Any, controller: str,
               mtp_adapter: Optional[str], max_new_tokens: int,
               sampling: Optional[dict] = None, streamer: Any = None) -> tuple[Any, str, float]:
    """run --drafter: speculative decoding (:func:`specmoe.speculation.generation.generate`),
    greedy (tokens equal to plain greedy decoding's) or, with ``sampling``, sampled (tokens
    distributed as the target model's): the sequences, the statistics' text and the seconds
    from the prefill on.  ``drafter``: a name of :data:`DRAFTERS` or a loaded
    :class:`DraftModel` (``--drafter model``)."""
    from .speculation.controllers import controller_factory
    from .speculation.drafters import named_drafter
    from .speculation.generation import generate
    from .speculation.mtp import MtpDrafter

    if isinstance(drafter, str):
        d = named_drafter(drafter, model, eng, mtp_adapter)
    else:
        d, drafter = drafter, "model"
    try:
        ctl = controller_factory(controller, d.k if isinstance(d, MtpDrafter) else None)()
        res = generate(model, ids, d, ctl, max_new_tokens=max_new_tokens, streamer=streamer,
                       **({"do_sample": True, "temperature": sampling["temperature"],
                           "top_k": sampling["top_k"], "top_p": sampling["top_p"],
                           "seed": sampling["seed"]} if sampling else {}))
    finally:
        if isinstance(d, MtpDrafter):
            d.adapter.uninstall()
    st = res.stats
    steps = f", {st['etr']:.2f} tokens a step, K {st['k_mean']:.2f} on average" \
        if st.get("etr") is not None else ""
    return res.sequences, (f" | drafter {drafter} with {controller}: {st['accepted']} of "
                           f"{st['proposed']} drafts accepted{steps}"), float(st["time_s"])


def _speculation_arguments(p: argparse.ArgumentParser) -> None:
    """run's and serve's --drafter, --mtp-adapter and --controller."""
    p.add_argument("--drafter", default="none",
                   choices=["none", "ngram", "self", "mtp", "model"],
                   help="speculative decoding: ngram (prompt lookup), self (the model's "
                        "own experts in int4, MoE-SpeQ), mtp (multi-token prediction, "
                        "with --mtp-adapter) or model (a small LM of the same tokenizer, "
                        "with --draft-model); none decodes plainly (default)")
    p.add_argument("--draft-model", default=None, metavar="DIR",
                   help="with --drafter model: the draft LM's folder (a transformers "
                        "checkpoint, its vocabulary the target's), loaded in float32")
    p.add_argument("--mtp-adapter", default=None, metavar="DIR",
                   help="with --drafter mtp: the gated-LoRA adapter's folder "
                        "(mtp_config.json and mtp_adapter.safetensors, as training/mtp.py "
                        "writes it)")
    p.add_argument("--controller", default="cascade",
                   help="with --drafter: drafts per step, cascade (default: by measured "
                        "utility, off where it slows decoding down), speq, heuristic or "
                        "static:K")


def _speculation_options(args) -> tuple[Optional[str], Optional[str], Optional[str],
                                        Optional[str]]:
    """(drafter, controller, MTP adapter folder, draft model folder) of run's or serve's
    arguments, checked before the model loads; all None without --drafter."""
    if not re.fullmatch(r"cascade|speq|heuristic|static:\d+", args.controller):
        raise CliError(f"--controller {args.controller!r}: cascade, speq, heuristic or "
                       "static:K (K an integer >= 0)")
    drafter = None if args.drafter == "none" else args.drafter
    return (drafter, args.controller if drafter is not None else None,
            _mtp_adapter_option(args), _draft_model_option(args))


def _drafter_folder(args, flag: str, drafter: str, marker: str, needs: str,
                    what: str) -> Optional[str]:
    """The folder option ``flag`` of ``--drafter drafter``, checked before the model loads:
    only with that drafter, which needs it (``needs``: what to give); a folder holding
    ``marker`` (else: not ``what``)."""
    path = getattr(args, flag[2:].replace("-", "_"))
    if path is None:
        if args.drafter == drafter:
            raise CliError(f"--drafter {drafter} needs {flag} DIR ({needs})")
        return None
    if args.drafter != drafter:
        raise CliError(f"{flag} goes with --drafter {drafter}")
    if not (Path(path) / marker).is_file():
        raise CliError(f"{flag} {path}: no {marker} there (not {what})")
    return str(path)


def _draft_model_option(args) -> Optional[str]:
    """--draft-model: a transformers checkpoint folder, only with --drafter model."""
    return _drafter_folder(args, "--draft-model", "model", "config.json",
                           "a small causal LM of the target's tokenizer, e.g. "
                           "specmoe/zoo/tiny-draft", "a transformers checkpoint folder")


def _load_draft_model(path: str, model: Any = None) -> Any:
    """The :class:`DraftModel` of the checkpoint at ``path`` (float32, eval), checked against
    the target ``model``'s vocabulary (None: the server's Speculation checks it at start);
    CliError where it does not load or does not fit."""
    from .speculation.drafters import DraftModel
    try:
        d = DraftModel.from_pretrained(path)
    except ValueError as exc:
        raise CliError(f"--draft-model: {exc}") from None
    dv = d.model.config.vocab_size
    tv = dv if model is None else model.config.vocab_size
    if dv != tv:
        raise CliError(f"--draft-model {path}: its vocabulary has {dv} tokens, the target's "
                       f"{tv} (a draft model must share the target's tokenizer)")
    return d


def _mtp_adapter_option(args) -> Optional[str]:
    """--mtp-adapter: an adapter's folder, only with --drafter mtp."""
    from .speculation.mtp import CONFIG_FILE
    return _drafter_folder(args, "--mtp-adapter", "mtp", CONFIG_FILE,
                           "the gated-LoRA adapter training/mtp.py writes",
                           "an MTP adapter folder")


def _listen_check(host: str, port: int) -> None:
    """The address ``serve`` will listen on, bound once and released before the model loads
    (a port in use used to be found after a minute of loading)."""
    import socket

    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
    except socket.gaierror as exc:
        raise CliError(f"--host {host!r}: {exc.strerror or exc}") from None
    fam, kind, proto, _, addr = infos[0]
    with socket.socket(fam, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(addr)
        except OSError as exc:
            raise CliError(f"--port {port}: cannot listen on {host}:{port} "
                           f"({exc.strerror or exc})") from None


def _serve_ray(args, cache: Any, drafter: Any, controller: Any, mtp_adapter: Any,
               draft_dir: Optional[str]) -> int:
    """specmoe serve --ray: --replicas replicas of the app behind Ray Serve's proxy on
    --host:--port, on a local Ray instance or the cluster at $RAY_ADDRESS; SIGTERM or Ctrl-C
    shuts Serve down."""
    import signal
    import threading

    import ray
    from ray import serve

    from .serve.ray import deployment

    replicas = args.replicas or 1
    ray.init(address=os.environ.get("RAY_ADDRESS") or None, include_dashboard=False,
             logging_level="warning", configure_logging=True)
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    try:
        serve.start(http_options={"host": args.host, "port": args.port})
        serve.run(deployment(args.checkpoint, replicas=replicas,
                             num_cpus=float(args.threads or 1), threads=args.threads,
                             model_name=args.model_name,
                             api_key=args.api_key, max_batch=args.max_batch,
                             max_queue=args.max_queue, prefill_chunk=args.prefill_chunk,
                             prefill_ratio=args.prefill_ratio, cache=cache, dtype=args.dtype,
                             policy=args.policy,
                             prefetch=not args.no_prefetch, store=args.store, dense=args.dense,
                             batch_decode=not args.no_batch_decode,
                             drafter=drafter if draft_dir is None else None,
                             draft_model=draft_dir,
                             controller=controller, mtp_adapter=mtp_adapter,
                             warm_tau=not args.no_tau_warmup,
                             batch_prefill=args.batch_prefill,
                             ttft_budget=args.ttft_budget),
                  blocking=False)
        print(f"[specmoe] serving {args.checkpoint!r} from {replicas} Ray Serve replica(s) on "
              f"http://{args.host}:{args.port}/v1", flush=True)
        stop.wait()
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0


def _cmd_serve(args) -> int:
    # every argument is checked before the model (and torch) loads
    missing = []
    for mod, pkg in (("starlette", "starlette"), ("uvicorn", "uvicorn"),
                     ("prometheus_client", "prometheus-client")):
        try:
            __import__(mod)
        except ModuleNotFoundError:
            missing.append(pkg)
    if missing:
        raise CliError(f"specmoe serve needs {', '.join(missing)}: install the serve extra "
                       "(pip install 'specmoe[serve]')")
    cache = _option("--cache", args.cache, _capacity)
    if args.api_key is not None and not args.api_key.strip():
        raise CliError("--api-key is empty")
    if args.model_name is not None and not args.model_name.strip():
        raise CliError("--model-name is empty")
    if not (args.shutdown_timeout >= 0):
        raise CliError(f"--shutdown-timeout must be >= 0, got {args.shutdown_timeout}")
    policy = _policy_option(args.policy)
    drafter, controller, mtp_adapter, draft_dir = _speculation_options(args)
    if args.ttft_budget is not None and drafter is None:
        raise CliError("--ttft-budget bounds the drafts per step: it needs --drafter")
    _checkpoint(args, args.store)
    if args.replicas is not None and not args.ray:
        raise CliError("--replicas needs --ray")
    if args.ray:
        try:
            import ray  # noqa: F401
            from ray import serve as _ray_serve  # noqa: F401
        except ImportError:
            raise CliError("specmoe serve --ray needs Ray Serve: install the ray extra "
                           "(pip install 'specmoe[ray]')") from None
    _listen_check(args.host, args.port)
    if args.ray:
        return _serve_ray(args, cache, drafter, controller, mtp_adapter, draft_dir)

    import torch

    from .serve import app, run

    if args.threads is not None:
        from .runtime import kernels
        torch.set_num_threads(args.threads)
        kernels.set_num_threads(args.threads)
    from .models.pretrained import load_tokenizer
    try:
        tok = load_tokenizer(args.checkpoint)
    except (OSError, ValueError) as exc:
        raise CliError(f"{args.checkpoint}: no usable tokenizer ({exc})") from None
    draft = None if draft_dir is None else _load_draft_model(draft_dir)
    asgi = app(args.checkpoint, tok, model_name=args.model_name, api_key=args.api_key,
               max_batch=args.max_batch, max_queue=args.max_queue,
               prefill_chunk=args.prefill_chunk, prefill_ratio=args.prefill_ratio,
               cache=cache, dtype=args.dtype,
               policy=policy, prefetch=not args.no_prefetch, store=args.store,
               dense=args.dense, batch_decode=not args.no_batch_decode,
               drafter=drafter if draft is None else draft,
               controller=controller, mtp_adapter=mtp_adapter,
               warm_tau=not args.no_tau_warmup, batch_prefill=args.batch_prefill,
               ttft_budget=args.ttft_budget)
    srv = asgi.state.server
    print(f"[specmoe] serving {srv.model_name!r} on http://{args.host}:{args.port}/v1 "
          f"(context {srv.context_length} tokens, max batch {args.max_batch}"
          f"{'' if srv.scheduler.batch_off_reason is None else ' decoded one by one'}"
          f"{'' if drafter is None else f', drafter {drafter} with {controller}'}, queue "
          f"{args.max_queue}{', API key required' if args.api_key else ''})", flush=True)
    try:
        run(asgi, args.host, args.port, shutdown_timeout=args.shutdown_timeout,
            log_level=args.log_level)
    finally:
        srv.close()  # (the app's shutdown did it already, unless uvicorn never started)
    return 0


def _describe(exc: BaseException, args: argparse.Namespace) -> str:
    """The one-line message of ``exc`` for ``specmoe: error: ...``: specmoe's own errors,
    ValueError and TypeError as they are (they name the file, field or option); OSError with
    its file; anything else (a JSON error, which names no file) with its type's name."""
    from ._C import SpecmoeError

    checkpoint = getattr(args, "checkpoint", None)
    if isinstance(exc, CliError):
        msg = str(exc)
    elif isinstance(exc, json.JSONDecodeError):  # (its message names no file)
        where = checkpoint or getattr(args, "trace", None) or "input"
        msg = f"{where}: invalid JSON ({exc})"
    elif isinstance(exc, OSError):
        if exc.filename is not None:
            msg = f"{exc.filename}: {exc.strerror or exc}"
            if exc.filename2 is not None:
                msg += f" (-> {exc.filename2})"
        else:
            msg = str(exc) or type(exc).__name__
    elif isinstance(exc, (SpecmoeError, ValueError, TypeError)):  # TraceError is a ValueError
        msg = str(exc) or type(exc).__name__
    elif isinstance(exc, ModuleNotFoundError) and (exc.name or "").split(".")[0] in _HF_EXTRA:
        msg = (f"specmoe {getattr(args, 'command', '')} needs {exc.name}, which is not "
               "installed: install the 'hf' extra (pip install 'specmoe[hf]')")
    else:
        msg = f"{type(exc).__name__}: {exc}"
    return " ".join(msg.split()) or type(exc).__name__


def build_parser() -> argparse.ArgumentParser:
    """The command line's parser: every command and option (``main`` parses with it)."""
    parser = argparse.ArgumentParser(
        prog="specmoe", description=__doc__.replace("``", "'"),
        epilog="'specmoe <command> --help' lists a command's options.")
    debug_help = "on an error, show its traceback instead of the one-line message"
    parser.add_argument("--debug", action="store_true", help=debug_help)
    from .version import __version__
    parser.add_argument("--version", action="version", version=f"specmoe {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, **kw) -> argparse.ArgumentParser:
        p = sub.add_parser(name, **kw)
        # also after the command; SUPPRESS: absent here, the global flag's value stands
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help=debug_help)
        return p

    command("demo", help="run the main job on an embedded default")

    p = command("simulate", help="replay a routing trace through the cache simulator")
    _add_trace_args(p)
    p.add_argument("--prefetch", default=None,
                   help="predictor spec: none, oracle[:depth=N], router, history[:topk=N,"
                        "percentile=Q,history=N,cooc_weight=W], learned[:depth=N]")
    p.add_argument("--hardware", default="a100-pcie4",
                   help="a100-pcie4, rtx4090, laptop, h200, calibrate (this CPU), "
                        "calibrate-gpu (this GPU tier) or a profile .json file "
                        "(Hardware.save)")
    p.add_argument("--miss", default="fetch",
                   choices=["fetch", "drop", "substitute", "lowest_bit", "priority"],
                   help="SpecMD miss handling (see specmoe.sim.replay.simulate)")
    p.add_argument("--miss-keep", type=_at_least(0), default=2,
                   help="drop, priority: ranks below this are always fetched (default 2)")
    p.add_argument("--miss-keep2", type=_at_least(0), default=None,
                   help="priority: ranks from this on come from a second, int2 copy (SpecMD's "
                        "int4 -> int2 cascade; default: none)")
    p.add_argument("--hybrid", action="store_true",
                   help="the hybrid GPU tier: each layer's missing experts split between copies "
                        "and the host CPU (MoE-SpAc Eq. 9); needs a profile with cpu_bw (h200)")
    p.add_argument("--json", action="store_true", help="print one JSON object")

    p = command("sweep", help="simulate policies x capacities x hardware x predictors")
    _add_trace_args(p)
    p.add_argument("--prefetch", action="append", default=None,
                   help="a predictor spec; repeat the flag for several (default: none)")
    p.add_argument("--hardware", default="a100-pcie4", help="comma-separated profiles")
    p.add_argument("--processes", type=_at_least(1), default=None, help="worker processes")
    p.add_argument("--out", default="sweep_out", help="output directory")
    p.add_argument("--no-plots", action="store_true",
                   help="results.csv and results.json only, no hit_rate.png / stall.png")
    p.add_argument("--json", action="store_true", help="print one JSON object")

    p = command("convert", help="convert a checkpoint's routed experts to a store")
    p.add_argument("checkpoint", help="a local HuggingFace checkpoint folder or a GGUF file")
    p.add_argument("--dtype", default="auto",
                   choices=["auto", "f32", "bf16", "int8", "int4", "gguf"],
                   help="store dtype of the experts (auto: bf16, or for a GGUF file its "
                        "blocks kept as they are where the kernels read them, else the nearest "
                        "dtype; gguf: a GGUF file's Q2_K-Q6_K/Q8_0/Q4_0/Q4_1/IQ4_XS/MXFP4 blocks "
                        "as they are, or an AWQ / asymmetric GPTQ folder's groups as Q4_1)")
    p.add_argument("-o", "--output", default=None,
                   help="store file (default: one per checkpoint and dtype under "
                        "$SPECMOE_CACHE or ~/.cache/specmoe)")
    p.add_argument("--force", action="store_true", help="rewrite an up-to-date store")
    p.add_argument("--quiet", action="store_true", help="no progress bar")

    p = command("run", help="generate text with a checkpoint's experts offloaded")
    p.add_argument("checkpoint", help="a local HuggingFace checkpoint folder or a GGUF file")
    p.add_argument("--prompt", default=None, help="the text to continue")
    p.add_argument("--prompt-file", default=None, metavar="FILE",
                   help="read the prompt from FILE instead (-: standard input)")
    p.add_argument("--chat", action="store_true",
                   help="the prompt is a user's message: put it in the tokenizer's chat "
                        "template, ready for the assistant's answer")
    p.add_argument("--system", default=None, metavar="TEXT",
                   help="with --chat or --interactive: a system message before the user's")
    p.add_argument("-i", "--interactive", action="store_true",
                   help="a conversation: each line of standard input is a user's message, "
                        "answered in the chat template with the conversation so far and "
                        "streamed (Ctrl-D or /exit ends it)")
    p.add_argument("--cache", default=None,
                   help="expert cache, as the API's cache=: slots (40), a fraction of all "
                        "experts (0.25), a percentage (25%%) or bytes (6GiB); default 25%%, "
                        "or what --memory plans")
    p.add_argument("--memory", default=None, metavar="SIZE",
                   help="a memory budget (8GiB, or auto: what this process may still use, "
                        "MemAvailable or the memory cgroup's headroom) that the dense layers' format and the expert "
                        "cache are planned to; the plan is printed (docs/usage.md)")
    p.add_argument("--max-new-tokens", type=_at_least(1), default=64,
                   help="tokens to generate (default 64; fewer when the model ends its text)")
    p.add_argument("--temperature", type=_non_negative, default=0.0,
                   help="0 (default): greedy decoding, the same text every run; above 0: "
                        "sample from the logits divided by it (as transformers' and the "
                        "OpenAI API's temperature)")
    p.add_argument("--top-p", type=_probability, default=None,
                   help="with --temperature: sample from the smallest set of tokens whose "
                        "probability reaches P (nucleus sampling; default 1: every token)")
    p.add_argument("--top-k", type=_at_least(1), default=None,
                   help="with --temperature: sample from the K most likely tokens (default: "
                        "every token)")
    p.add_argument("--seed", type=_at_least(0, 2**63 - 1), default=None,
                   help="with --temperature: the sampling's seed, for the same text again "
                        "(with --drafter, under a fixed K: --controller static:K)")
    p.add_argument("--dtype", default="auto",
                   choices=["auto", "f32", "bf16", "int8", "int4", "gguf"],
                   help="store dtype of the experts (auto: bf16, or for a GGUF file its "
                        "blocks kept as they are where the kernels read them, else the nearest "
                        "dtype; gguf: a GGUF file's Q2_K-Q6_K/Q8_0/Q4_0/Q4_1/IQ4_XS/MXFP4 blocks "
                        "as they are, or an AWQ / asymmetric GPTQ folder's groups as Q4_1)")
    p.add_argument("--policy", default="least_stale",
                   help="eviction policy spec, as simulate's --policies takes (e.g. lru, "
                        "random:seed=3, least_stale:order=lru, spac:levels=3)")
    p.add_argument("--no-prefetch", action="store_true",
                   help="no prefetch worker: every expert loads when a layer asks for it")
    p.add_argument("--predictor", default="router", choices=["router", "learned"],
                   help="what predicts the next layer's experts for prefetch: the next "
                        "router on this layer's input (default), or the learned next-use "
                        "model fed the routing seen so far (docs/usage.md)")
    p.add_argument("--store", default=None, help="store file (default: see convert)")
    p.add_argument("--threads", type=_at_least(1, MAX_THREADS), default=None,
                   help="threads of torch and of specmoe's kernels (default: torch's; at most "
                        f"{MAX_THREADS})")
    p.add_argument("--dense", default="auto",
                   choices=["auto", "torch", "f32", "bf16", "int8", "int4", "gguf"],
                   help="attention, shared/dense MLP and lm_head through specmoe's C kernels "
                        "(auto: bf16 weights kept exactly, a GGUF file's own blocks; "
                        "int8/int4 quantize them; gguf: a GGUF file's own blocks, the bits "
                        "llama.cpp reads)")
    p.add_argument("--device", default="cpu",
                   help="cpu (default), or cuda / cuda:N: the GPU tier (experts cached in GPU "
                        "memory, the rest of the model on that GPU; --dense auto or torch)")
    p.add_argument("--gpu-cache", default=None, metavar="SIZE",
                   help="with --device cuda: the hybrid tier, a GPU cache of SIZE (as "
                        "--cache) and every other expert computed by the CPU kernels where "
                        "it lives or copied, as costs measured at load decide")
    p.add_argument("--quiet", action="store_true", help="statistics line to stderr")
    p.add_argument("--stream", action=argparse.BooleanOptionalAction, default=None,
                   help="print the text as it is generated (default: when standard output "
                        "is a terminal)")
    _speculation_arguments(p)

    p = command("serve", help="serve a checkpoint with an OpenAI-compatible HTTP API")
    p.add_argument("checkpoint", help="a local HuggingFace checkpoint folder or GGUF file")
    p.add_argument("--cache", default="25%",
                   help="expert cache, as run's --cache (default 25%%)")
    p.add_argument("--dtype", default="auto",
                   choices=["auto", "f32", "bf16", "int8", "int4", "gguf"],
                   help="store dtype of the experts, as run's --dtype (default auto)")
    p.add_argument("--host", default="127.0.0.1",
                   help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=_at_least(1, 65535), default=8000,
                   help="TCP port to listen on (default 8000)")
    p.add_argument("--max-batch", type=_at_least(1), default=16,
                   help="requests running at once; their decode steps run as one batched "
                        "forward (default 16)")
    p.add_argument("--no-batch-decode", action="store_true",
                   help="one forward per running request instead of one batched forward "
                        "(for comparison)")
    p.add_argument("--max-queue", type=_at_least(1), default=256,
                   help="requests waiting beyond --max-batch before 429 (default 256)")
    p.add_argument("--prefill-chunk", type=_at_least(1), default=256,
                   help="prompt tokens per step of a request being prefilled (default 256)")
    p.add_argument("--batch-prefill", action="store_true",
                   help="prefill prompts of different lengths that arrive together in "
                        "batched forwards too (one expert load serves them all); their tokens "
                        "may then differ from the prompt served alone (default: only prompts "
                        "of one length share a forward, exact; linear-attention and Mamba "
                        "hybrids prefill every prompt alone by default, and with this flag "
                        "prompts of one length together, not exactly)")
    p.add_argument("--prefill-ratio", type=_non_negative, default=0.0,
                   help="pace prompts: while requests decode, a round's prompt chunks take at "
                        "most about this many decode steps' time (e.g. 2; default 0: every "
                        "waiting prompt at once)")
    _speculation_arguments(p)
    p.add_argument("--ttft-budget", type=_positive_seconds, default=None, metavar="SECONDS",
                   help="with --drafter: the most a request's first speculative cycle may "
                        "take; the controller's largest K is profiled at load to fit it "
                        "(MoE-SpeQ's SLO bound; default: no bound)")
    p.add_argument("--no-tau-warmup", action="store_true",
                   help="with --drafter: measure tau at a batch size when it first occurs "
                        "(a pause of the running requests) instead of at every batch size "
                        "up to --max-batch before serving (default)")
    p.add_argument("--api-key", default=os.environ.get("SPECMOE_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on /v1 (default: "
                        "$SPECMOE_API_KEY, else none)")
    p.add_argument("--model-name", default=None,
                   help="the model id clients send (default: the checkpoint's name)")
    p.add_argument("--shutdown-timeout", type=float, default=30.0,
                   help="SIGTERM: seconds the requests in flight may take to finish before "
                        "they are cancelled (default 30)")
    p.add_argument("--policy", default="least_stale", help="eviction policy spec, as run's")
    p.add_argument("--no-prefetch", action="store_true",
                   help="no prefetch worker: every expert loads when a layer asks for it")
    p.add_argument("--store", default=None, help="store file (default: see convert)")
    p.add_argument("--threads", type=_at_least(1, MAX_THREADS), default=None,
                   help="threads of torch and of specmoe's kernels (default: torch's)")
    p.add_argument("--dense", default="auto",
                   choices=["auto", "torch", "f32", "bf16", "int8", "int4", "gguf"],
                   help="dense layers through specmoe's C kernels, as run's --dense")
    p.add_argument("--log-level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn's log level (default info: one line per request)")
    p.add_argument("--ray", action="store_true",
                   help="serve from Ray Serve replicas (a local Ray instance, or the cluster "
                        "at $RAY_ADDRESS; the ray extra)")
    p.add_argument("--replicas", type=_at_least(1), default=None,
                   help="with --ray: replicas of the server, each loading the checkpoint "
                        "(default 1)")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)  # usage errors: argparse's message, exit 2
    try:
        return _dispatch(args)
    except KeyboardInterrupt:
        if args.debug:
            raise
        print("specmoe: interrupted", file=sys.stderr)
        raise SystemExit(130) from None
    except SystemExit as exc:  # a message string from below: the same one-line form
        if args.debug or not isinstance(exc.code, str):
            raise
        msg = " ".join(exc.code.split())
        print(msg if msg.startswith("specmoe: error:") else f"specmoe: error: {msg}",
              file=sys.stderr)
        raise SystemExit(1) from None
    except Exception as exc:
        if args.debug:
            raise
        print(f"specmoe: error: {_describe(exc, args)}", file=sys.stderr)
        raise SystemExit(1) from None


def _dispatch(args: argparse.Namespace) -> int:
    if args.command == "convert":
        return _cmd_convert(args)
    if args.command == "run":
        return _cmd_run(args)
    if args.command == "serve":
        return _cmd_serve(args)
    if args.command == "demo":
        from .demo import main as demo_main

        return demo_main([])
    if args.command == "simulate":
        return _cmd_simulate(args)
    if args.command == "sweep":
        return _cmd_sweep(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())

"""Prefill (prompt processing) speed with every expert resident: specmoe against llama.cpp on
the same GGUF file, in interleaved rounds.

What a user waits for before the first token (TTFT) is the prompt's forward.  At prefill sizes
each routed expert sees many tokens (a 512-token prompt gives each of OLMoE's 64 experts ~64),
so the expert kernels run as small matrix products, bound by their arithmetic, not by reads.

Models: the shapes of ``decode_peers.py`` (``olmoe``: OLMoE-1B-7B, ``dsv2lite``:
DeepSeek-V2-Lite, ``--layers`` decoder layers, random weights), written once under
``--workdir`` with llama.cpp's converter and ``llama-quantize`` (``--types``: Q4_0, Q8_0).
Rows per model, type and prompt length: ``specmoe`` (``from_pretrained`` of the GGUF file, its
expert blocks kept as they are, the dense layers at the same precision: ``dense="int4"`` for
Q4_0, ``"int8"`` for Q8_0; every expert loaded into the cache first) and ``llama.cpp``
(``llama-completion`` on the same file, ``-n 1``, its ``prompt eval time``).

Timing.  Each round runs specmoe once (a process: load, one warm-up forward of another prompt
of each length, then each length's timed forward, ``model(ids, logits_to_keep=1)``) and
llama.cpp once per length (a process each; its own prompt evaluation time, load excluded),
the order of the two alternating by round.  Prompts are whole-word tokens whose text
re-tokenizes to the same ids (``big_model.make_prompts``), so both read the same tokens
(llama.cpp adds its BOS: ``llama_prompt_tokens`` says how many it saw).  ``tok_per_s`` =
prompt tokens / seconds; ``vs_llama_cpp_runs`` the ratio in each round, ``vs_llama_cpp`` their
median.

llama.cpp runs with ``--no-repack`` unless ``--llama-repack``: on the Intel Xeon with AMX
these sessions ran on (under KVM), the native build (``-march=native``) crashed (SIGSEGV) at
every load that repacks the weights, in its AMX path.  There ``--llama-isa avx512
--llama-repack`` (AVX-512 with VNNI, no AMX, repacking) is the stronger peer.  A row that
cannot run carries ``error`` with the reason, as every peer here does.

``--json`` prints one JSON object ``{"config", "host", "rows"}``; progress goes to stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import big_model as bm  # noqa: E402  (checkpoint writer, prompts, llama.cpp, process runner)
import decode_peers as dp  # noqa: E402  (the model shapes and their files)
import hostinfo  # noqa: E402

DENSE_OF = {"Q4_0": "int4", "Q8_0": "int8"}


def log(*a: Any) -> None:
    print("[prefill]", *a, file=sys.stderr, flush=True)


def worker(spec_path: str) -> None:
    """One specmoe round: load, warm up, time each prompt's forward; writes {T: seconds}."""
    spec = json.loads(Path(spec_path).read_text())
    import specmoe  # before torch, as users should (OMP_WAIT_POLICY)
    import torch

    from specmoe.runtime import kernels
    torch.set_num_threads(spec["threads"])
    kernels.set_num_threads(spec["threads"])
    model = specmoe.from_pretrained(spec["gguf"], cache=1.0, dtype="auto", policy="lru",
                                    prefetch=False, store=spec["store"],
                                    torch_dtype=torch.bfloat16, progress=False,
                                    dense=spec["dense"])
    eng = specmoe.engine_of(model)
    bm.load_every_expert(eng)
    out: dict[str, float] = {}
    with torch.inference_mode():
        for T, (timed, warm) in spec["prompts"].items():
            model(torch.tensor([warm]), logits_to_keep=1)
            t0 = time.perf_counter()
            model(torch.tensor([timed]), logits_to_keep=1)
            out[T] = time.perf_counter() - t0
    eng.close()
    Path(spec["result"]).write_text(json.dumps(out))


def run_specmoe(gguf: Path, store: Path, dense: str, prompts: dict[int, list[list[int]]],
                threads: int, timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        spec = {"gguf": str(gguf), "store": str(store), "dense": dense, "threads": threads,
                "prompts": {str(T): p for T, p in prompts.items()},
                "result": str(Path(d) / "result.json")}
        sp = Path(d) / "spec.json"
        sp.write_text(json.dumps(spec))
        r = bm.run_process([sys.executable, __file__, "--_worker", str(sp)], None, timeout)
        if r["rc"] != 0:
            return {"error": f"specmoe worker exit {r['rc']}: " +
                    " | ".join(r["stderr"].strip().splitlines()[-3:])}
        return {"seconds": {int(k): v for k, v in json.loads(Path(spec["result"]).read_text())
                            .items()}}


def run_llama(lc: bm.LlamaCpp, gguf: Path, text: str, T: int, threads: int, repack: bool,
              timeout: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as d:
        f = Path(d) / "prompt.txt"
        f.write_text(text)
        argv = [str(lc.bin / "llama-completion"), "-m", str(gguf), "-f", str(f), "-n", "1",
                "-t", str(threads), "-tb", str(threads), "-c", str(T + 64), "-b", "2048",
                "--temp", "0", "--seed", "0", "--ignore-eos", "-no-cnv", "--no-display-prompt",
                "--no-warmup"] + ([] if repack else ["--no-repack"])
        r = bm.run_process(argv, None, timeout)
    if r["rc"] != 0:
        sig = f" (signal {-r['rc']})" if r["rc"] < 0 else ""
        return {"error": f"llama-completion exit {r['rc']}{sig}: " +
                " | ".join(r["stderr"].strip().splitlines()[-2:])}
    m = re.search(r"prompt eval time =\s*([\d.]+) ms /\s*(\d+) tokens", r["stderr"])
    if not m:
        return {"error": "llama-completion printed no prompt timing"}
    return {"seconds": float(m.group(1)) / 1000, "tokens": int(m.group(2))}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    ap.add_argument("--models", default="olmoe,dsv2lite")
    ap.add_argument("--layers", type=int, default=4, help="decoder layers (dsv2lite: the "
                    "first is dense)")
    ap.add_argument("--types", default="Q4_0", help="GGUF types, comma-separated (Q4_0, Q8_0)")
    ap.add_argument("--prompt-tokens", default="64,512")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--llama-repack", action="store_true",
                    help="let llama.cpp repack its weights at load (module docstring)")
    bm.add_peer_arguments(ap)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--row-timeout", type=float, default=1800.0)
    ap.add_argument("--save", help="also write the JSON object to this file")
    ap.add_argument("--_worker", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a._worker:
        worker(a._worker)
        return
    types = [t.strip() for t in a.types.split(",") if t.strip()]
    for t in types:
        if t not in DENSE_OF:
            ap.error(f"--types: {t} (one of {', '.join(DENSE_OF)})")
    lengths = [int(x) for x in a.prompt_tokens.split(",") if x.strip()]
    if not lengths or min(lengths) < 1 or max(lengths) > 8192:
        ap.error("--prompt-tokens: lengths in 1..8192")
    if a.rounds < 1 or a.threads < 1 or a.layers < 2:
        ap.error("--rounds and --threads >= 1, --layers >= 2")
    lc = bm.LlamaCpp(Path(a.peers).expanduser(), build=not a.no_build_peers, threads=a.threads,
                     isa=a.llama_isa)
    prep_args = argparse.Namespace(workdir=a.workdir, seed=a.seed, router_skew=1.0,
                                   row_timeout=a.row_timeout)
    rows: list[dict[str, Any]] = []
    for model in (m.strip() for m in a.models.split(",") if m.strip()):
        if model not in ("olmoe", "dsv2lite"):
            ap.error(f"unknown model {model} (olmoe, dsv2lite)")
        cfg = dp.olmoe_config(a.layers) if model == "olmoe" else dp.dsv2_config(a.layers)
        defs = []
        for t in types:
            defs += [{"name": f"specmoe+dense-gguf-{t}", "kind": "specmoe", "precision":
                      DENSE_OF[t], "torch_dtype": "bf16", "dense": DENSE_OF[t], "gguf": t},
                     {"name": f"llama.cpp-{t}", "kind": "llama.cpp", "type": t,
                      "precision": DENSE_OF[t]}]
        prep_args.prompt_tokens = max(lengths)
        prep = dp.prepare(model, cfg, prep_args, defs, lc)
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(str(prep["ckpt"]))
        prompts = {T: bm.make_prompts(prep["ckpt"], T, a.seed + T) for T in lengths}
        for t in types:
            sname, lname = f"specmoe+dense-gguf-{t}", f"llama.cpp-{t}"
            err = prep["err"].get(sname) or prep["err"].get(lname)
            got: dict[int, dict[str, list[Any]]] = {T: {"s": [], "l": []} for T in lengths}
            errors: dict[str, str] = {}
            for r in range(a.rounds):
                if err:
                    errors["files"] = err
                    break
                order = ["specmoe", "llama.cpp"] if r % 2 == 0 else ["llama.cpp", "specmoe"]
                for side in order:
                    if side == "specmoe":
                        res = run_specmoe(prep["gguf"][sname], prep["store"][sname],
                                          DENSE_OF[t], prompts, a.threads, a.row_timeout)
                        if "error" in res:
                            errors["specmoe"] = res["error"]
                        for T in lengths:
                            got[T]["s"].append(res.get("seconds", {}).get(T))
                    else:
                        for T in lengths:
                            res = run_llama(lc, prep["gguf"][lname], tok.decode(prompts[T][0]),
                                            T, a.threads, a.llama_repack, a.row_timeout)
                            if "error" in res:
                                errors["llama.cpp"] = res["error"]
                            got[T]["l"].append(res)
                log(f"{model} {t} round {r + 1}/{a.rounds} done")
            for T in lengths:
                s = [T / x if x else None for x in got[T]["s"]]
                ll = [x["tokens"] / x["seconds"] if "seconds" in x else None
                      for x in got[T]["l"]]
                ratio = [x / y if x and y else None for x, y in zip(s, ll)]
                ok = [x for x in ratio if x is not None]
                rows.append({
                    "model": model, "layers": a.layers, "type": t, "prompt_tokens": T,
                    "llama_prompt_tokens": next((x["tokens"] for x in got[T]["l"]
                                                 if "tokens" in x), None),
                    "specmoe_tok_per_s_runs": s, "llama_cpp_tok_per_s_runs": ll,
                    "vs_llama_cpp_runs": ratio,
                    "vs_llama_cpp": statistics.median(ok) if ok else None,
                    "errors": errors or None})
                log(rows[-1])
    out = {"config": {"models": a.models, "layers": a.layers, "types": types,
                      "prompt_tokens": lengths, "threads": a.threads, "rounds": a.rounds,
                      "llama_repack": a.llama_repack, "llama_isa": a.llama_isa},
           "host": hostinfo.host(a.threads), "rows": rows}
    text = json.dumps(out, indent=1)
    if a.save:
        Path(a.save).write_text(text)
    if a.json:
        print(text)


if __name__ == "__main__":
    main()

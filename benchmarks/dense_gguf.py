"""A GGUF file's dense layers in each format specmoe runs them in, one process, every expert
resident: bf16 (dequantized), the file's own blocks (``dense="gguf"``, the default for a GGUF
file loaded in bf16) and int4 groups of 128 (re-quantized).

    python benchmarks/dense_gguf.py FILE.gguf [--threads 1,2] [--rounds 2] [--json] [--save F]

Each (round, format) loads the file with ``from_pretrained(cache=1.0, dense=<format>,
policy="lru", prefetch=False)``, warms every expert it routes to with an 8-token generation,
then times greedy decoding of 48 tokens after a 64-token prompt (the prompt's own time, one
1-token generation, subtracted).  The order of the formats is reversed every other round;
ratios are within a round.  For llama.cpp on the same file see decode_peers.py's
``specmoe+gguf-<type>`` rows.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import hostinfo  # noqa: E402

FORMATS = ("bf16", "gguf", "int4")
PROMPT, DECODE = 64, 48


def run(path: str, threads: int, rounds: int) -> dict:
    import torch

    import specmoe
    from specmoe.runtime import kernels

    kernels.set_num_threads(threads)
    torch.set_num_threads(threads)
    ids = None  # the prompt: fixed random ids below min(1000, the vocabulary)
    res: dict[str, list[float]] = {d: [] for d in FORMATS}
    dense_bytes: dict[str, int] = {}
    for rnd in range(rounds):
        for dense in (FORMATS if rnd % 2 == 0 else FORMATS[::-1]):
            model = specmoe.from_pretrained(path, cache=1.0, dense=dense, progress=False,
                                            policy="lru", prefetch=False)
            eng = specmoe.engine_of(model)
            if ids is None:
                ids = torch.randint(5, min(1000, int(model.config.vocab_size)), (1, PROMPT),
                                    generator=torch.Generator().manual_seed(0))
            try:
                with torch.no_grad():
                    model.generate(ids, max_new_tokens=8, do_sample=False)
                    t0 = time.perf_counter()
                    model.generate(ids, max_new_tokens=1, do_sample=False)
                    pre = time.perf_counter() - t0
                    t0 = time.perf_counter()
                    model.generate(ids, max_new_tokens=DECODE + 1, do_sample=False)
                    t = time.perf_counter() - t0
                res[dense].append(DECODE / (t - pre))
                dense_bytes[dense] = int(eng.dense.bytes_after)
                print(f"[dense_gguf] threads {threads} round {rnd + 1}: {dense} "
                      f"{res[dense][-1]:.2f} tok/s ({eng.dense})", file=sys.stderr, flush=True)
            finally:
                eng.close()
    return {"threads": threads, "tok_per_s_runs": res, "dense_bytes": dense_bytes,
            "gguf_vs_bf16_runs": [round(g / b, 3) for g, b in zip(res["gguf"], res["bf16"])],
            "gguf_vs_int4_runs": [round(g / b, 3) for g, b in zip(res["gguf"], res["int4"])]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf", help="a GGUF file (e.g. decode_peers.py's model-Q4_0.gguf)")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--save", help="also write the JSON object to this file")
    a = ap.parse_args()
    if not Path(a.gguf).is_file():
        ap.error(f"{a.gguf}: no such file")
    threads = [int(t) for t in a.threads.split(",") if t.strip()]
    out = {"benchmark": "dense_gguf", "file": str(a.gguf), "host": hostinfo.host(threads),
           "method": __doc__.split("\n\n")[1].replace("\n", " "),
           "runs": [run(a.gguf, t, a.rounds) for t in threads]}
    text = json.dumps(out, indent=1)
    if a.save:
        Path(a.save).write_text(text + "\n")
    if a.json:
        print(text)
    else:
        for r in out["runs"]:
            print(f"threads {r['threads']}: gguf / bf16 {r['gguf_vs_bf16_runs']}, "
                  f"gguf / int4 {r['gguf_vs_int4_runs']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

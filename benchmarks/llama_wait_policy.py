"""How much llama.cpp's speed depends on the OpenMP wait policy it inherits.

llama.cpp runs its threads on libgomp (``GGML_OPENMP``), as torch does.  ``import specmoe``
sets ``OMP_WAIT_POLICY=PASSIVE`` for torch (specmoe/__init__.py), and until 2026-12-06 some
benchmark harnesses handed that environment on to the llama.cpp processes they started: an
audit hook on ``subprocess.Popen`` showed it for ``decode_peers.py`` (whose config has called
``hostinfo.host()``, which imports specmoe, before the rounds since 2026-11-28) and for
``serve.py``'s ``llama-server``; not for ``hybrid_peers.py``, ``gptoss_peers.py`` or
``big_model.py`` (its ``--quick`` run).  Now every
peer runs in ``hostinfo.peer_env()``, without it.  This script measures what the inherited
policy cost llama.cpp, to say how far the older results files' ratios are off:

    python benchmarks/llama_wait_policy.py --json FILE.gguf [FILE.gguf ...] \\
        [--threads 1,2] [--rounds 3] [--tokens 32] [--prompt 0]

Per file and thread count, ``llama-bench`` (``-r 1``) alternates between libgomp's default
policy and PASSIVE, which goes first alternating by round; each round's ``passive_over_default``
is the ratio of the two tok/s.  ``--prompt N`` times a prompt of N tokens instead of decode.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import hostinfo  # noqa: E402


def bench_once(bench: Path, gguf: Path, threads: int, tokens: int, prompt: int,
               policy: str | None) -> float | str:
    """One ``llama-bench`` run's tok/s under ``policy`` (None: libgomp's default), or why
    it failed."""
    env = hostinfo.peer_env(**({"OMP_WAIT_POLICY": policy} if policy else {}))
    argv = [str(bench), "-m", str(gguf), "-t", str(threads), "-r", "1", "-o", "json",
            "-p", str(prompt), "-n", "0" if prompt else str(tokens)]
    r = subprocess.run(argv, capture_output=True, text=True, env=env, timeout=1800)
    if r.returncode != 0:
        return "llama-bench failed: " + " | ".join(r.stderr.strip().splitlines()[-3:])
    try:
        return round(float(json.loads(r.stdout)[-1]["avg_ts"]), 3)
    except (ValueError, KeyError, IndexError) as exc:
        return f"llama-bench printed no result ({exc})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("files", nargs="+", type=Path, help="GGUF files")
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=32, help="decoded tokens a run")
    ap.add_argument("--prompt", type=int, default=0, help="time a prompt of N tokens instead")
    ap.add_argument("--bench", type=Path, default=Path(os.environ.get(
        "SPECMOE_PEERS", "~/.cache/specmoe/peers")).expanduser()
        / "llama.cpp-build" / "bin" / "llama-bench")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--save", help="also write the JSON object to this file")
    a = ap.parse_args()
    threads = [int(t) for t in a.threads.split(",")]
    if not a.bench.exists():
        ap.error(f"{a.bench} not found: build llama.cpp first (benchmarks/big_model.py's "
                 "LlamaCpp, or --bench PATH)")
    rows = []
    for f in a.files:
        for t in threads:
            row: dict[str, Any] = {"file": str(f), "threads": t, "default": [], "passive": [],
                                   "passive_over_default": []}
            for k in range(a.rounds):
                order = [None, "PASSIVE"] if k % 2 == 0 else ["PASSIVE", None]
                got = {p: bench_once(a.bench, f, t, a.tokens, a.prompt, p) for p in order}
                d, p = got[None], got["PASSIVE"]
                row["default"].append(d)
                row["passive"].append(p)
                row["passive_over_default"].append(
                    round(p / d, 3) if isinstance(d, float) and isinstance(p, float) else None)
                print(f"[llama_wait_policy] {f} t={t} round {k + 1}: default {d}, "
                      f"passive {p}", file=sys.stderr, flush=True)
            rows.append(row)
    out = {"benchmark": "llama_wait_policy", "bench": str(a.bench),
           "what": f"{'prompt ' + str(a.prompt) if a.prompt else 'decode ' + str(a.tokens)} "
                   "tokens a run, tok/s",
           "host": hostinfo.host(threads), "rows": rows}
    hostinfo.emit(out, a.save, a.json)


if __name__ == "__main__":
    main()

"""Per-step cost of prompt-lookup drafting: specmoe's incremental C index versus transformers'
PromptLookupCandidateGenerator (the peer, which rescans the whole history every step).

    python benchmarks/spec_ngram.py [--lengths 1024,8192,32768] [--steps 200] [--k 5] [--json]

One step = the history grows by one token, then K draft tokens are proposed.  The floor is a
bare call into the extension (reading NgramDrafter.length), the least a step can cost from
Python.  Reported: microseconds per step and the ratio peer / specmoe.  --json prints one
JSON object.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from specmoe.speculation.drafters import NgramDrafter  # noqa: E402


def tokens(n: int, seed: int = 0) -> np.ndarray:
    """Text-like ids: random words from a 2000-id vocabulary with copied spans (as in code or
    retrieval prompts, where prompt lookup pays)."""
    rng = np.random.default_rng(seed)
    out: list[int] = []
    while len(out) < n:
        if len(out) > 64 and rng.random() < 0.3:
            s = int(rng.integers(0, len(out) - 32))
            out += out[s:s + int(rng.integers(4, 32))]
        else:
            out += rng.integers(0, 2000, size=int(rng.integers(1, 16))).tolist()
    return np.asarray(out[:n], dtype=np.int64)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", default="1024,8192,32768")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--k", type=int, default=5)
    ap.add_argument("--max-n", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()
    try:
        import torch
        from transformers.generation.candidate_generator import PromptLookupCandidateGenerator
    except ImportError:  # pragma: no cover - peer optional
        torch = None
    out = {"k": a.k, "max_n": a.max_n, "steps": a.steps, "lengths": {}}
    for L in (int(x) for x in a.lengths.split(",")):
        seq = tokens(L + a.steps)
        d = NgramDrafter(max_n=a.max_n, min_n=1)
        d.append(seq[:L])
        t0 = time.perf_counter()
        hits = 0
        for i in range(a.steps):
            d.append(seq[L + i:L + i + 1])
            hits += bool(d.propose(None, a.k))
        ours = (time.perf_counter() - t0) / a.steps
        t0 = time.perf_counter()
        for _ in range(a.steps):
            _ = d.length
        floor = (time.perf_counter() - t0) / a.steps
        row = {"specmoe_us": ours * 1e6, "floor_us": floor * 1e6, "proposals": hits}
        if torch is not None:
            ids = torch.from_numpy(seq).unsqueeze(0)
            gen = PromptLookupCandidateGenerator(num_output_tokens=a.k,
                                                 max_matching_ngram_size=a.max_n,
                                                 max_length=10 ** 9)
            t0 = time.perf_counter()
            for i in range(a.steps):
                gen.get_candidates(ids[:, :L + i + 1])
            peer = (time.perf_counter() - t0) / a.steps
            row["transformers_us"] = peer * 1e6
            row["peer_over_specmoe"] = peer / ours
        out["lengths"][L] = row
    if a.json:
        print(json.dumps(out))
    else:
        for L, r in out["lengths"].items():
            print(f"L={L:6d}  specmoe {r['specmoe_us']:8.2f} us/step  floor {r['floor_us']:.2f} us"
                  + (f"  transformers {r['transformers_us']:9.1f} us  ratio {r['peer_over_specmoe']:.0f}x"
                     if "transformers_us" in r else ""))


if __name__ == "__main__":
    main()

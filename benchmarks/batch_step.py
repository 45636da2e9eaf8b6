"""A batched decode or verification step of an MLA model (DeepSeek-V2): each decoder layer as
one ``_C.MLABlock`` call over every row (B rows of T tokens) against the way B > 1 ran before
(the absorbed attention module by module: transformers' layer forward, torch between the C
kernels), on the same model in the same run.

The step is ``BatchKV.forward`` (the server's continuous batch, generate's speculative batch)
on a random bf16 DeepSeek-V2-shaped model (2048 hidden columns, 2 layers, every expert
resident in the cache, dense layers in C), after a 32-token prefill of each row.  "before" is
the same build with the block limited to one row (``specmoe.models.mla._mla_decodable``
patched), which is exactly the code path batched MLA steps took before the block took rows.
Each round times both, alternated, 8 steps each (median of the last 6); the JSON gives the
per-round times and before / after ratios (> 1: the block is faster).

    python benchmarks/batch_step.py --json [--rows 4,16] [--tokens 1,4] [--rounds 5]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import hostinfo  # noqa: E402  (before torch: its OpenMP wait policy)

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import specmoe.models.mla as mla  # noqa: E402
from specmoe.models.testing import tiny_model  # noqa: E402
from specmoe.runtime import engine  # noqa: E402
from specmoe.speculation.batch import BatchKV  # noqa: E402


def _one_row_only(fn):
    """The block's check as it was before it took rows: one row per call."""
    def check(layer, x, pe, mask):
        return x.shape[0] == 1 and fn(layer, x, pe, mask)
    return check


def step_ms(model, prompts: torch.Tensor, rows: list, steps: int = 8) -> float:
    """Median time of a BatchKV.forward step of ``rows`` after prefilling ``prompts`` (ms)."""
    bkv = BatchKV(model, prompts.shape[0])
    bkv.prefill(prompts, torch.ones_like(prompts))
    ts = []
    for _ in range(steps):
        t0 = time.perf_counter()
        bkv.forward(rows)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts[2:]) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="4,16")
    ap.add_argument("--tokens", default="1,4", help="tokens per row and step")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="0: every core")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--save", type=Path)
    a = ap.parse_args()
    threads = a.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    model = tiny_model("deepseek_v2", dtype=torch.bfloat16, hidden=2048, inter=1408, layers=2,
                       overrides={"num_key_value_heads": 4})
    eng = engine.offload(model, cache=1.0, prefetch=False)
    after = mla._mla_decodable
    before = _one_row_only(after)
    g = torch.Generator().manual_seed(1)
    out: dict = {"host": hostinfo.host(threads), "threads": threads, "rounds": a.rounds,
                 "model": "random bf16 DeepSeek-V2 layout, 2048 hidden, 2 layers, every expert "
                          "resident", "rows": []}
    try:
        for B in (int(x) for x in a.rows.split(",")):
            for T in (int(x) for x in a.tokens.split(",")):
                prompts = torch.randint(3, model.config.vocab_size, (B, 32), generator=g)
                rows = torch.randint(3, model.config.vocab_size, (B, T), generator=g).tolist()
                t = {"before": [], "after": []}
                for _ in range(a.rounds):
                    for name, fn in (("after", after), ("before", before)):
                        mla._mla_decodable = fn
                        t[name].append(round(step_ms(model, prompts, rows), 2))
                mla._mla_decodable = after
                r = {"rows": B, "tokens_per_row": T, "after_ms": t["after"],
                     "before_ms": t["before"],
                     "before_over_after": [round(b / x, 3) for b, x in zip(t["before"],
                                                                             t["after"])]}
                out["rows"].append(r)
                if not a.json:
                    print(f"{B:3d} rows x {T} tokens: after {t['after']} ms, before "
                          f"{t['before']} ms, before / after {r['before_over_after']}",
                          flush=True)
    finally:
        mla._mla_decodable = after
        eng.close()
    if a.save:
        a.save.write_text(json.dumps(out, indent=1) + "\n")
    if a.json:
        print(json.dumps(out))


if __name__ == "__main__":
    main()

"""One dense linear layer: specmoe's C kernels (specmoe.models.layers.CLinear) vs torch's nn.Linear, by
weight format and token count, and the kernels' read rate against the measured ceiling.

    python benchmarks/dense_linear.py --json [--shapes 2048x2048,50304x2048] [--tokens 1,4,16,32,64]

For each shape N x K (out x in), format (bf16, f32 against torch at the same dtype; int8, int4
against torch bf16, what a bf16 model runs) and token count T: ``--repeats`` interleaved rounds
(torch, then C, then the other way round), each the median time of ``--calls`` calls; rows give
the medians over rounds, ``c_vs_torch`` = torch time / C time (> 1: C faster), and
``c_read_gbps`` / ``ceiling_gbps``: weight bytes per call / C time against
``KernelContext.read_bw`` on a buffer of the same size with the same threads (measured in the
same round).  This is the rule behind ``dense="auto"`` (specmoe.models.dense.resolve_dense) and the
``TORCH_ABOVE`` crossover.  bf16 rows also time ``widened``: the same bf16 weight through
torch's f32 GEMM a widened chunk at a time (specmoe.models.layers.linear_widened, what a bf16
CLinear runs above ``TORCH_ABOVE`` where ``torch_bf16_gemm_fast()`` is false, as
``torch_bf16_fast`` in the config says), interleaved with the other two; ``widened_vs_torch``
and ``widened_vs_c`` are its per-round ratios' medians (> 1: widened faster).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

import hostinfo  # noqa: E402  (before torch: its OpenMP wait policy)

import numpy as np
import torch
from torch import nn

from specmoe.runtime import kernels
from specmoe.models.layers import CLinear, linear_widened, torch_bf16_gemm_fast

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

TORCH_DT = {"f32": torch.float32, "bf16": torch.bfloat16, "int8": torch.bfloat16,
            "int4": torch.bfloat16}


def timed(f: Any, calls: int) -> float:
    f()
    ts = []
    for _ in range(calls):
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--shapes", default="2048x2048,50304x2048")
    ap.add_argument("--dtypes", default="bf16,f32,int8,int4")
    ap.add_argument("--tokens", default="1,4,16,32,64")
    ap.add_argument("--threads", type=int, default=0, help="torch and kernel threads (0: keep)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--calls", type=int, default=15)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
        kernels.set_num_threads(a.threads)
    ctx = kernels.context()
    rows = []
    torch.manual_seed(0)
    for shape in a.shapes.split(","):
        N, K = (int(v) for v in shape.split("x"))
        for dt in a.dtypes.split(","):
            lin = nn.Linear(K, N, bias=False).to(TORCH_DT[dt]).eval()
            c = CLinear(lin, dt, torch_above=None)
            buf = np.ones(c.nbytes, np.uint8)
            for T in (int(t) for t in a.tokens.split(",")):
                x = torch.randn(1, T, K).to(TORCH_DT[dt])
                times: dict[str, list[float]] = {"torch": [], "c": []}
                fns = [("torch", lambda: lin(x)), ("c", lambda: c(x))]
                if dt == "bf16":
                    times["widened"] = []
                    fns.append(("widened", lambda: linear_widened(x, lin.weight)))
                ceil = []
                for r in range(a.repeats):
                    with torch.inference_mode():
                        k = r % len(fns)  # each contender first in turn
                        order = fns[k:] + fns[:k]
                        for name, f in (order if r % 2 == 0 else order[::-1]):
                            times[name].append(timed(f, a.calls))
                    ceil.append(ctx.read_bw(buf, 3))
                tt, tc = times["torch"], times["c"]
                row = {"N": N, "K": K, "dtype": dt, "tokens": T,
                       "torch_dtype": str(TORCH_DT[dt]).replace("torch.", ""),
                       "torch_ms": statistics.median(tt) * 1e3,
                       "c_ms": statistics.median(tc) * 1e3,
                       "c_vs_torch": statistics.median(x / y for x, y in zip(tt, tc)),
                       "weight_bytes": c.nbytes,
                       "c_read_gbps": c.nbytes / statistics.median(tc) / 1e9,
                       "ceiling_gbps": statistics.median(ceil) / 1e9}
                row["c_read_vs_ceiling"] = row["c_read_gbps"] / row["ceiling_gbps"]
                extra = ""
                if "widened" in times:
                    tw = times["widened"]
                    row["widened_ms"] = statistics.median(tw) * 1e3
                    row["widened_vs_torch"] = statistics.median(x / y for x, y in zip(tt, tw))
                    row["widened_vs_c"] = statistics.median(x / y for x, y in zip(tc, tw))
                    extra = (f", widened {row['widened_ms']:.3f} ms "
                             f"({row['widened_vs_torch']:.2f}x torch)")
                rows.append(row)
                print(f"[dense_linear] {N}x{K} {dt} T={T}: torch {row['torch_ms']:.3f} ms, "
                      f"C {row['c_ms']:.3f} ms ({row['c_vs_torch']:.2f}x), "
                      f"{row['c_read_gbps']:.1f} GB/s of {row['ceiling_gbps']:.1f}{extra}",
                      file=sys.stderr, flush=True)
    res = {"host": hostinfo.host(kernels.num_threads()),
           "config": {"threads": kernels.num_threads(), "torch_threads": torch.get_num_threads(),
                      "isa": kernels.isa(), "repeats": a.repeats, "calls": a.calls,
                      "torch_bf16_fast": torch_bf16_gemm_fast()},
           "rows": rows}
    if a.json:
        print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()

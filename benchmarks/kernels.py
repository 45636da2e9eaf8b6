"""Expert FFN kernel throughput against the memory-read ceiling and torch, in one run.

For each weight dtype (f32, bf16, int8, int4) x tokens (1, 8) x expert shape (OLMoE 2048x1024,
Mixtral 4096x14336) it times one expert (gate, up, SiLU, down) through specmoe's C kernel and
reports
  gbps             weight (+scale) bytes streamed per second by the kernel,
  frac_of_read_bw  that rate over a vectorized, multithreaded plain read of the same block
                   (``KernelContext.read_bw``, same threads, same ISA, same run),
  vs_torch         torch's time / ours for the same expert in the same weight format, with
                   torch.set_num_threads equal to our threads:
                     f32  -> F.linear on f32 weights, f32 activations,
                     bf16 -> F.linear on bf16 weights, bf16 activations (torch's native path),
                     int8 -> torch._weight_int8pack_mm (torch's weight-only int8 CPU kernel,
                             per-row f32 scales) on f32 activations,
                     int4 -> torch._weight_int4pack_mm_for_cpu (torch's weight-only int4 CPU
                             kernel, same groups and scales, zero points 0) on f32 activations;
                     the SiLU/gating in between is plain torch in each case.
Ceiling and kernel calls are interleaved (frac is the median of per-pair ratios) because
this machine is shared and its load drifts.  Timings are medians over a few calls (the Mixtral expert is 176M parameters: few iterations).
``--json`` prints one JSON object ``{"machine": {...}, "rows": [...]}``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from specmoe import _C, kernels, quant  # noqa: E402

SHAPES = {"olmoe": (2048, 1024), "mixtral": (4096, 14336)}


def _median_time(fn, iters: int) -> float:
    fn()
    ts = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def _torch_expert(dtype: str, t: dict[str, np.ndarray], H: int, I: int, group: int):
    """A callable running the same expert in torch for x (torch tensor)."""
    if dtype == "f32":
        g, u, d = (torch.from_numpy(t[n]) for n in ("gate", "up", "down"))
        return (lambda x: F.linear(F.silu(F.linear(x, g)) * F.linear(x, u), d)), torch.float32
    if dtype == "bf16":
        g, u, d = (torch.from_numpy(t[n].view(np.int16)).view(torch.bfloat16)
                   for n in ("gate", "up", "down"))
        return (lambda x: F.linear(F.silu(F.linear(x, g)) * F.linear(x, u), d)), torch.bfloat16
    if dtype == "int8":
        w = {n: torch.from_numpy(t[n]) for n in ("gate", "up", "down")}
        s = {n: torch.from_numpy(t[n + ".scale"]) for n in ("gate", "up", "down")}

        def run8(x):
            a = F.silu(torch._weight_int8pack_mm(x, w["gate"], s["gate"]))
            a = a * torch._weight_int8pack_mm(x, w["up"], s["up"])
            return torch._weight_int8pack_mm(a, w["down"], s["down"])
        return run8, torch.float32
    # int4: unpack our nibbles to [n, k] int32 values 0..15 and let torch pack them its way
    packs, sz = {}, {}
    for n in ("gate", "up", "down"):
        p = t[n]
        vals = np.empty((p.shape[0], p.shape[1] * 2), np.int32)
        vals[:, 0::2] = p & 15
        vals[:, 1::2] = p >> 4
        packs[n] = torch._convert_weight_to_int4pack_for_cpu(torch.from_numpy(vals), 2)
        del vals
        sc = torch.from_numpy(t[n + ".scale"]).T.contiguous()  # [k/group, n]
        sz[n] = torch.stack([sc, torch.zeros_like(sc)], -1).contiguous()

    def run4(x):
        a = F.silu(torch._weight_int4pack_mm_for_cpu(x, packs["gate"], group, sz["gate"]))
        a = a * torch._weight_int4pack_mm_for_cpu(x, packs["up"], group, sz["up"])
        return torch._weight_int4pack_mm_for_cpu(a, packs["down"], group, sz["down"])
    return run4, torch.float32


def bench(shapes: list[str], dtypes: list[str], tokens: list[int], threads: int,
          quick: bool) -> dict:
    ctx = _C.KernelContext(threads)
    torch.set_num_threads(ctx.threads)
    rows = []
    rng = np.random.default_rng(0)
    for sname in shapes:
        H, I = SHAPES[sname]
        big = H * I > 20_000_000
        iters = 3 if big else (10 if quick else 30)
        std = 1.0 / np.sqrt(H)
        g = (rng.standard_normal((I, H), dtype=np.float32) * std)
        u = (rng.standard_normal((I, H), dtype=np.float32) * std)
        d = (rng.standard_normal((H, I), dtype=np.float32) * std)
        for dtype in dtypes:
            t = quant.expert_tensors(g, u, d, dtype)
            block, entries = kernels.pack_block(t)
            spec = kernels.FFNSpec.from_store_schema(entries, block_bytes=block.size)
            desc = spec.desc()
            nbytes = spec.weight_bytes
            tfn, tdt = _torch_expert(dtype, t, H, I, spec.group)
            for T in tokens:
                x = rng.standard_normal((T, H), dtype=np.float32)
                out = np.zeros_like(x)
                ctx.ffn_forward(desc, block, x, out)
                # interleave ceiling and kernel so both see the same machine load (shared box)
                reads, times = [], []
                for _ in range(iters):
                    reads.append(ctx.read_bw(block, 1))
                    t0 = time.perf_counter()
                    ctx.ffn_forward(desc, block, x, out)
                    times.append(time.perf_counter() - t0)
                ours = statistics.median(times)
                read_bps = statistics.median(reads)
                frac = statistics.median(nbytes / tk / rb for tk, rb in zip(times, reads))
                xt = torch.from_numpy(x).to(tdt)
                with torch.inference_mode():
                    theirs = _median_time(lambda: tfn(xt), iters)
                gbps = nbytes / ours / 1e9
                rows.append({
                    "dtype": dtype, "shape": f"{sname} H={H} I={I}", "tokens": T,
                    "gbps": round(gbps, 2), "read_gbps": round(read_bps / 1e9, 2),
                    "frac_of_read_bw": round(frac, 3),
                    "ms": round(ours * 1e3, 3), "torch_ms": round(theirs * 1e3, 3),
                    "vs_torch": round(theirs / ours, 2),
                })
                print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
            del t, block, tfn
    return {"machine": {"isa": ctx.isa, "threads": ctx.threads, "features": ctx.features,
                        "torch": torch.__version__},
            "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--shapes", default="olmoe,mixtral")
    ap.add_argument("--dtypes", default="f32,bf16,int8,int4")
    ap.add_argument("--tokens", default="1,8")
    ap.add_argument("--threads", type=int, default=0, help="0: all cores")
    ap.add_argument("--quick", action="store_true", help="fewer iterations")
    a = ap.parse_args()
    res = bench(a.shapes.split(","), a.dtypes.split(","), [int(v) for v in a.tokens.split(",")],
                a.threads, a.quick)
    if a.json:
        print(json.dumps(res))
    else:
        print(f"{'dtype':5} {'shape':28} {'T':>2} {'GB/s':>7} {'read':>7} {'frac':>5} "
              f"{'ms':>8} {'torch':>8} {'x':>5}")
        for r in res["rows"]:
            print(f"{r['dtype']:5} {r['shape']:28} {r['tokens']:2d} {r['gbps']:7.2f} "
                  f"{r['read_gbps']:7.2f} {r['frac_of_read_bw']:5.2f} {r['ms']:8.3f} "
                  f"{r['torch_ms']:8.3f} {r['vs_torch']:5.2f}")


if __name__ == "__main__":
    main()

"""Expert FFN kernel throughput against the DRAM read ceiling and torch, in one run.

For each weight dtype (f32, bf16, int8, int4) x tokens (1, 8) x expert shape (OLMoE 2048x1024,
DeepSeek-V2-Lite 2048x1408, Mixtral 4096x14336) it times one expert (gate, up, SiLU, down) through specmoe's C kernel and
reports
  gbps             weight (+scale) bytes streamed per second by the kernel,
  read_gbps        the ceiling: a vectorized, multithreaded plain read (``KernelContext.read_bw``,
                   same threads, same ISA) of an expert block of the same size,
  frac_of_read_bw  gbps / read_gbps,
  frac_paired_median  the median over the rotation of each kernel sample's rate divided by the
                   ceiling sample taken just before it: steadier than the ratio of two bests on
                   a host whose read rate moves 2x between single samples (one lucky read
                   sample sets read_gbps for the whole row),
  vs_torch         torch's time / ours for the same expert in the same weight format, with
                   torch.set_num_threads equal to our threads:
                     f32  -> F.linear on f32 weights, f32 activations,
                     bf16 -> F.linear on bf16 weights, bf16 activations (torch's native path),
                     int8 -> torch._weight_int8pack_mm (torch's weight-only int8 CPU kernel,
                             per-row f32 scales) on f32 activations,
                     int4 -> torch._weight_int4pack_mm_for_cpu (torch's weight-only int4 CPU
                             kernel, same groups and scales, zero points 0) on f32 activations;
                     the SiLU/gating in between is plain torch in each case.
  mode             "fast" (default kernel path) or "precise" (desc precise=1, exact f32 math).

Methodology (why and how everything is measured from DRAM): in real decoding each expert block
is read once per token out of a slab far larger than the last-level cache, so an expert that
happens to fit in the LLC (an OLMoE expert is 12 MB in bf16, the LLC here is 32 MB) must not be
timed from cache.  The script therefore makes N copies of each expert block, N = ceil(max(4 x
LLC, 1 GiB) / block bytes) (at least 2; the 1 GiB floor because on the development VM, which
reports a 32 MiB L3, a 135 MB rotation still read at ~75 GB/s on one core while rotations of
768 MB and more settle at the DRAM rate, ~29 GB/s), and rotates over them: ceiling read of copy i, kernel on copy i+1,
ceiling read of copy i+2, ... , so the block being touched was last touched >= 3 x LLC bytes
earlier and comes from DRAM for both the kernel and the read loop, with the same buffers in
the same run, alternating.  One ceiling sample reads m consecutive copies (m = kernel time /
read time of one block from a first probe, 1..16; reported as read_span) so that a ceiling
sample and a kernel sample last about as long: on a shared machine a 50 us read has far
better odds of running undisturbed than a 300 us kernel call, and best-of-N would otherwise
favour the ceiling.  The copies differ in one bit per 4 KiB page (no page-level dedup
by the VM host) and are all touched once before timing (no first-touch faults timed).  Each figure is best-of-N over the rotation (the least disturbed
sample on a shared machine); frac is best kernel rate / best read rate.  torch gets the same
treatment: N copies of its weights, rotated, best-of-N.  The LLC size comes from sysfs
(fallback 32 MiB).  torch calls rotate over their own copies, at most one call per copy.  ``--json`` prints one JSON object ``{"machine": {...}, "rows": [...]}``;
the machine part has the thread count, the LLC size and the copies used per shape.
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

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from specmoe import _C  # noqa: E402
from specmoe.runtime import kernels  # noqa: E402
from specmoe.storage import ggml_blocks, quant  # noqa: E402

SHAPES = {"olmoe": (2048, 1024), "dsv2lite": (2048, 1408), "mixtral": (4096, 14336),
          "gptoss": (2880, 2880)}  # (GPT-OSS-20B's experts, without their biases)
# Rotation footprint floor (see the module docstring): on the development VM a 135 MB rotation
# of 3 MB blocks still read at ~75 GB/s on one core, rotations >= 768 MB settle at ~29 GB/s.
MIN_ROTATION = 1 << 30


def _llc_bytes() -> int:
    """Last-level cache size from sysfs (largest cache level of cpu0), fallback 32 MiB."""
    best = 0
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for ent in os.listdir(base):
            if not ent.startswith("index"):
                continue
            with open(os.path.join(base, ent, "size")) as f:
                v = f.read().strip()
            mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(v[-1:], 1)
            best = max(best, int(v.rstrip("KMG")) * mult)
    except (OSError, ValueError):
        pass
    return best or 32 << 20


def _distinct_copy(block: np.ndarray, k: int) -> np.ndarray:
    """A copy of block whose every 4 KiB page differs from the other copies' (the low bit of one
    byte per page flipped: a weight or scale changes by one unit in its last place), so no
    page-level deduplication by the VM host can fold the copies into one physical page and
    serve them from cache.  Timing does not depend on the values."""
    c = block.copy()
    c[(k * 67) % 4096::4096] ^= 1
    return c


def _best_time(fns, rounds: int) -> float:
    """Best wall time of fns[k % len(fns)]() over `rounds` calls (rotating over copies)."""
    best = float("inf")
    for k in range(rounds):
        t0 = time.perf_counter()
        fns[k % len(fns)]()
        best = min(best, time.perf_counter() - t0)
    return best


# GGUF block formats kept as a file holds them (ggml_blocks.BLOCKS; q4_1 is also what AWQ /
# asymmetric GPTQ experts are repacked onto): the expert's matrices in that format, except a
# down projection whose I columns are not a multiple of 256, which llama.cpp's quantizer writes
# as Q8_0 (its fallback for K-quants on such rows, e.g. DeepSeek-V2-Lite's 1408).
BLOCK_DTYPES = tuple(ggml_blocks.BLOCKS)
NO_TORCH = "torch has no kernel for GGUF blocks (llama.cpp is the peer: decode_peers.py)"


def _block_expert(kind: str, g, u, d) -> dict[str, np.ndarray]:
    q = ggml_blocks.QUANTIZERS
    dk = kind if d.shape[1] % ggml_blocks.BLOCKS[kind][0] == 0 else "q8_0"
    return {"gate": q[kind](g), "up": q[kind](u), "down": q[dk](d)}


def _torch_expert(dtype: str, t: dict[str, np.ndarray], H: int, I: int, group: int,
                  memo: dict | None = None):
    """A callable running the same expert in torch for x (torch tensor), on its own copy of the
    weights (so rotating over several of them reads from DRAM like the kernel does); None for
    the GGUF block formats (NO_TORCH)."""
    if dtype in BLOCK_DTYPES:
        return None, torch.float32
    if dtype == "f32":
        # .clone(): every call makes its own copy (the rotation needs distinct buffers)
        g, u, d = (torch.from_numpy(t[n]).clone() for n in ("gate", "up", "down"))
        return (lambda x: F.linear(F.silu(F.linear(x, g)) * F.linear(x, u), d)), torch.float32
    if dtype == "bf16":
        g, u, d = (torch.from_numpy(t[n].view(np.int16)).clone().view(torch.bfloat16)
                   for n in ("gate", "up", "down"))
        return (lambda x: F.linear(F.silu(F.linear(x, g)) * F.linear(x, u), d)), torch.bfloat16
    if dtype == "int8":
        w = {n: torch.from_numpy(t[n]).clone() for n in ("gate", "up", "down")}
        s = {n: torch.from_numpy(t[n + ".scale"]).clone() for n in ("gate", "up", "down")}

        def run8(x):
            a = F.silu(torch._weight_int8pack_mm(x, w["gate"], s["gate"]))
            a = a * torch._weight_int8pack_mm(x, w["up"], s["up"])
            return torch._weight_int8pack_mm(a, w["down"], s["down"])
        return run8, torch.float32
    # int4: unpack our nibbles to [n, k] int32 values 0..15 and let torch pack them its way
    packs, sz = {}, {}
    if memo is not None and "packs" in memo:  # further copies: clone the packed tensors
        packs = {n: v.clone() for n, v in memo["packs"].items()}
        sz = {n: v.clone() for n, v in memo["sz"].items()}
    for n in ("gate", "up", "down"):
        if n in packs:
            continue
        p = t[n]
        vals = np.empty((p.shape[0], p.shape[1] * 2), np.int32)
        vals[:, 0::2] = p & 15
        vals[:, 1::2] = p >> 4
        packs[n] = torch._convert_weight_to_int4pack_for_cpu(torch.from_numpy(vals), 2)
        del vals
        sc = torch.from_numpy(t[n + ".scale"]).T.contiguous()  # [k/group, n]
        sz[n] = torch.stack([sc, torch.zeros_like(sc)], -1).contiguous()

    if memo is not None:
        memo.setdefault("packs", packs)
        memo.setdefault("sz", sz)

    def run4(x):
        a = F.silu(torch._weight_int4pack_mm_for_cpu(x, packs["gate"], group, sz["gate"]))
        a = a * torch._weight_int4pack_mm_for_cpu(x, packs["up"], group, sz["up"])
        return torch._weight_int4pack_mm_for_cpu(a, packs["down"], group, sz["down"])
    return run4, torch.float32


def bench(shapes: list[str], dtypes: list[str], tokens: list[int], threads: int,
          quick: bool, modes: list[str]) -> dict:
    ctx = _C.KernelContext(threads)
    torch.set_num_threads(ctx.threads)
    llc = _llc_bytes()
    rows, copies_used = [], {}
    rng = np.random.default_rng(0)
    for sname in shapes:
        H, I = SHAPES[sname]
        big = H * I > 20_000_000
        std = 1.0 / np.sqrt(H)
        g = (rng.standard_normal((I, H), dtype=np.float32) * std)
        u = (rng.standard_normal((I, H), dtype=np.float32) * std)
        d = (rng.standard_normal((H, I), dtype=np.float32) * std)
        for dtype in dtypes:
            # int4g32: int4 in groups of 32, the layout GGUF's Q4_0 blocks are kept in
            base, group = ("int4", 32) if dtype == "int4g32" else (dtype, None)
            t = (_block_expert(dtype, g, u, d) if dtype in BLOCK_DTYPES
                 else quant.expert_tensors(g, u, d, base, group=group))
            block, entries = kernels.pack_block(t)
            ncopy = max(2, -(-max(4 * llc, MIN_ROTATION) // block.nbytes))
            copies_used[f"{sname}/{dtype}"] = ncopy
            blocks = [block] + [_distinct_copy(block, k) for k in range(1, ncopy)]
            for b in blocks:  # warm-up pass: every copy touched once before timing
                ctx.read_bw(b, 1)
            spec = kernels.FFNSpec.from_store_schema(entries, block_bytes=block.size)
            nbytes = spec.weight_bytes
            tfns = []
            memo: dict = {}
            for _ in range(ncopy):
                tfn, tdt = _torch_expert(base, t, H, I, spec.group, memo)
                tfns.append(tfn)
            # enough rotations for best-of-N: every copy several times, but few Mixtral calls
            rounds = max(2 * ncopy, 6 if big else (20 if quick else 40))
            for mode in modes:
                if mode == "precise" and dtype == "f32":
                    continue  # f32 has one path
                desc = dict(spec.desc(), precise=1 if mode == "precise" else 0)
                for T in tokens:
                    x = rng.standard_normal((T, H), dtype=np.float32)
                    out = np.zeros_like(x)
                    ctx.ffn_forward(desc, blocks[0], x, out)
                    # a ceiling sample spans about as long as a kernel call: m consecutive
                    # copies read back to back (see the module docstring)
                    t0 = time.perf_counter()
                    ctx.ffn_forward(desc, blocks[1 % ncopy], x, out)
                    tk0 = time.perf_counter() - t0
                    tr0 = block.nbytes / ctx.read_bw(blocks[2 % ncopy], 1)
                    m = int(min(16, max(1, round(tk0 / tr0)), max(1, ncopy - 2)))
                    best_read, best_k, pos = 0.0, float("inf"), 3
                    paired = []  # each kernel sample's rate over the read sample before it
                    for k in range(rounds):
                        secs = 0.0
                        for _ in range(m):
                            secs += block.nbytes / ctx.read_bw(blocks[pos % ncopy], 1)
                            pos += 1
                        read_rate = m * block.nbytes / secs
                        best_read = max(best_read, read_rate)
                        blk = blocks[pos % ncopy]
                        pos += 1
                        t0 = time.perf_counter()
                        ctx.ffn_forward(desc, blk, x, out)
                        tk = time.perf_counter() - t0
                        best_k = min(best_k, tk)
                        paired.append(nbytes / tk / read_rate)
                    theirs = float("nan")
                    if tfns[0] is None:
                        pass
                    elif mode == modes[0]:
                        xt = torch.from_numpy(x).to(tdt)
                        with torch.inference_mode():
                            tfns[0](xt)
                            # never more calls than copies: each call on a copy untouched
                            # since setup (the least recently used ones first)
                            theirs = _best_time([lambda f=f: f(xt) for f in tfns],
                                                2 if big else min(ncopy, 40))
                    else:
                        theirs = next(r["torch_ms"] for r in rows if r["dtype"] == dtype and
                                      r["tokens"] == T and r["shape"].startswith(sname)) / 1e3
                    gbps = nbytes / best_k / 1e9
                    rows.append({
                        "dtype": dtype, "shape": f"{sname} H={H} I={I}", "tokens": T,
                        **({"down_dtype": spec.down_dtype or spec.dtype, "torch_note": NO_TORCH}
                           if dtype in BLOCK_DTYPES else {}),
                        "mode": mode, "gbps": round(gbps, 2), "read_span": m,
                        "read_gbps": round(best_read / 1e9, 2),
                        "frac_of_read_bw": round(gbps * 1e9 / best_read, 3),
                        "frac_paired_median": round(statistics.median(paired), 3),
                        "ms": round(best_k * 1e3, 3),
                        "torch_ms": None if theirs != theirs else round(theirs * 1e3, 3),
                        "vs_torch": None if theirs != theirs else round(theirs / best_k, 2),
                    })
                    print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
            del t, block, blocks, tfns
    return {"machine": {**hostinfo.host(ctx.threads),
                        "isa": ctx.isa, "threads": ctx.threads, "features": ctx.features,
                        "torch": torch.__version__, "llc_bytes": llc,
                        "copies": copies_used},
            "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--shapes", default="olmoe,dsv2lite,mixtral",
                    help=f"comma list of {', '.join(SHAPES)}")
    ap.add_argument("--dtypes", default="f32,bf16,int8,int4",
                    help="comma-separated; also int4g32 (int4 in groups of 32: GGUF Q4_0 kept) "
                         "and the GGUF blocks kept as they are: q8_0, q4_k, q6_k, q4_0, q5_k, "
                         "iq4_xs (a down projection whose columns are not a multiple of 256 is "
                         "q8_0, as llama.cpp writes it)")
    ap.add_argument("--tokens", default="1,8")
    ap.add_argument("--threads", type=int, default=0, help="0: all cores")
    ap.add_argument("--quick", action="store_true", help="fewer iterations")
    ap.add_argument("--modes", default="fast",
                    help="comma list of fast,precise (precise: desc precise=1, f32 math)")
    ap.add_argument("--save", help="also write the JSON object to this file")
    a = ap.parse_args()
    res = bench(a.shapes.split(","), a.dtypes.split(","), [int(v) for v in a.tokens.split(",")],
                a.threads, a.quick, a.modes.split(","))
    if a.save:
        Path(a.save).write_text(json.dumps(res, indent=1) + "\n")
    if a.json:
        print(json.dumps(res))
    else:
        print(f"threads {res['machine']['threads']}, LLC {res['machine']['llc_bytes']} bytes")
        print(f"{'dtype':5} {'shape':28} {'T':>2} {'GB/s':>7} {'read':>7} {'frac':>5} "
              f"{'ms':>8} {'torch':>8} {'x':>5}")
        for r in res["rows"]:
            tm = "-" if r["torch_ms"] is None else f"{r['torch_ms']:.3f}"
            vs = "-" if r["vs_torch"] is None else f"{r['vs_torch']:.2f}"
            print(f"{r['dtype'] + ('' if r['mode'] == 'fast' else '*'):5} {r['shape']:28} {r['tokens']:2d} {r['gbps']:7.2f} "
                  f"{r['read_gbps']:7.2f} {r['frac_of_read_bw']:5.2f} {r['ms']:8.3f} "
                  f"{tm:>8} {vs:>5}")


if __name__ == "__main__":
    main()

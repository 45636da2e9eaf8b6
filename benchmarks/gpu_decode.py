"""Decode through the GPU tier (issue 12 item 6): bf16 experts at Qwen3-30B-A3B (default) or
Mixtral-8x7B shapes, all experts in host memory (pinned copy of a store), a GPU cache at
10%, 25% and 50% of them, tokens decoded one at a time through every MoE layer's routed
experts (the non-expert part of the model is not run: this measures the expert path alone).

Rows: specmoe without prefetch, specmoe with prefetch of the next layer's experts (an ORACLE
predictor: the routing is pre-drawn, so this is the prefetch upper bound, not a real
predictor), and all experts resident on the GPU (the upper bound).  Also measured in the same
run: pinned host-to-device copy bandwidth (the ceiling of loads).  Not yet here: the
accelerate device_map peer and the MoE-SpAc balancer rows (see docs/gpu.md).

``--json`` prints one JSON object.  Without a usable GPU it prints {"skipped": reason} and
exits 0.  Nothing in this script has run on a GPU in the session that wrote it.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

SHAPES = {  # H, I, experts, top_k, layers of the real model
    "qwen3-30b-a3b": (2048, 768, 128, 8, 48),
    "mixtral-8x7b": (4096, 14336, 8, 2, 32),
}


def pinned_h2d_gbps(torch, nbytes: int = 256 << 20, iters: int = 10) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(iters):
        dst.copy_(src, non_blocking=True)
    b.record()
    torch.cuda.synchronize()
    return nbytes * iters / (a.elapsed_time(b) / 1e3) / 1e9


def make_store(path: str, H: int, I: int, E: int, L: int, seed: int = 0) -> None:
    from specmoe import quant
    from specmoe.store import write_store

    rng = np.random.default_rng(seed)

    def layers():
        for _ in range(L):
            g = (rng.standard_normal((E, I, H), dtype=np.float32) * 0.02)
            u = (rng.standard_normal((E, I, H), dtype=np.float32) * 0.02)
            d = (rng.standard_normal((E, H, I), dtype=np.float32) * 0.02)
            yield {"gate": quant.f32_to_bf16(g), "up": quant.f32_to_bf16(u),
                   "down": quant.f32_to_bf16(d)}

    write_store(path, layers(), num_layers=L, top_k=1, progress=False,
                dtypes={"gate": "bf16", "up": "bf16", "down": "bf16"}).close()


def routing(rng, tokens: int, L: int, E: int, k: int, skew: float = 1.2) -> np.ndarray:
    """[tokens, L, k] expert ids, Zipf-like popularity per layer (some locality)."""
    p = 1.0 / np.arange(1, E + 1) ** skew
    p /= p.sum()
    out = np.empty((tokens, L, k), dtype=np.int64)
    perms = [rng.permutation(E) for _ in range(L)]
    for t in range(tokens):
        for l in range(L):
            out[t, l] = perms[l][rng.choice(E, k, replace=False, p=p)]
    return out


def decode(torch, cuda, cache, spec, ids, H: int, prefetch: bool) -> dict:
    T, L, k = ids.shape
    x = torch.randn(1, H, device="cuda") * 0.1
    w = torch.full((1, k), 1.0 / k, device="cuda")
    ids_dev = torch.from_numpy(ids).cuda()
    E = cache.store.num_experts
    torch.cuda.synchronize()
    cache.reset_stats()
    t0 = time.perf_counter()
    for t in range(T):
        cache.begin_pass()
        for l in range(L):
            if prefetch and l + 1 < L:
                cache.prefetch([(l + 1) * E + int(e) for e in ids[t, l + 1]], replace=True)
            elif prefetch and t + 1 < T:
                cache.prefetch([int(e) for e in ids[t + 1, 0]], replace=True)
            x = cuda.moe_forward(cache, spec, l, x, ids_dev[t, l].view(1, k), w)
            x = x / (x.norm() + 1e-6)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    st = cache.stats()
    return {"tok_s": T / wall, "wall_s": wall, "hits": st["hits"], "misses": st["misses"],
            "hit_rate": st["hits"] / max(1, st["hits"] + st["misses"]),
            "prefetch_issued": st["prefetch_issued"], "inflight_hits": st["inflight_hits"],
            "stall_s": st["stall_s"], "bytes_copied": st["bytes_read"],
            "copy_gbps_over_wall": st["bytes_read"] / wall / 1e9}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    ap.add_argument("--layers", type=int, default=4, help="MoE layers (the real model's: "
                    "48 Qwen3 / 32 Mixtral; host memory and disk bound this)")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--fractions", default="0.1,0.25,0.5")
    ap.add_argument("--store", default=None, help="reuse/keep the store file here")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args()

    try:
        import torch
    except ImportError:
        torch = None
    from specmoe import cuda

    ok, why = (False, "torch is not installed") if torch is None else cuda.available()
    if ok and not torch.cuda.is_available():
        ok, why = False, "torch has no CUDA device (a CPU-only torch build?)"
    if not ok:
        res = {"skipped": f"no usable GPU: {why}"}
        print(json.dumps(res) if a.json else res["skipped"])
        return

    from specmoe import kernels
    from specmoe.store import ExpertStore

    H, I, E, k, _ = SHAPES[a.shape]
    L = a.layers
    path = a.store or os.path.join(tempfile.mkdtemp(prefix="gpu_decode_"), "experts.smoe")
    if not os.path.exists(path):
        make_store(path, H, I, E, L)
    res: dict = {"shape": a.shape, "H": H, "I": I, "experts": E, "top_k": k, "layers": L,
                 "tokens": a.tokens, "device": cuda.available()[1],
                 "pinned_h2d_gbps": pinned_h2d_gbps(torch), "rows": []}
    ids = routing(np.random.default_rng(1), a.tokens, L, E, k)
    with ExpertStore(path) as st:
        spec = kernels.FFNSpec.from_store_schema(st.tensors, block_bytes=st.block_bytes)
        res["expert_mib"] = st.block_bytes / 2**20
        fracs = [float(f) for f in a.fractions.split(",")] + [1.0]
        for f in fracs:
            with cuda.GpuExpertCache(st, f, "lru", device=0, mode="host", top_k=k) as cache:
                for pf in ([False] if f == 1.0 else [False, True]):
                    decode(torch, cuda, cache, spec, ids[:2], H, pf)  # warm-up
                    row = {"cache_fraction": f, "prefetch": pf,
                           "label": "all resident (upper bound)" if f == 1.0 else
                           f"specmoe {int(f * 100)}%" + (" + oracle prefetch" if pf else "")}
                    row.update(decode(torch, cuda, cache, spec, ids, H, pf))
                    row["copy_fraction_of_pinned_bw"] = (row["copy_gbps_over_wall"]
                                                         / res["pinned_h2d_gbps"])
                    res["rows"].append(row)
    if a.json:
        print(json.dumps(res))
    else:
        for r in res["rows"]:
            print(f"{r['label']:40s} {r['tok_s']:8.2f} tok/s  hit {r['hit_rate']:.2f}  "
                  f"{r['copy_gbps_over_wall']:.1f} GB/s")


if __name__ == "__main__":
    main()

"""Expert cache: hit-path speed, read bandwidth against the raw device, and prefetch overlap.

Builds a store of --layers x --experts blocks of --block-kib KiB (default 8 x 32 x 1 MiB =
256 MiB) in --dir (default /var/tmp: disk-backed, so O_DIRECT measures the device, not the page
cache), then reports in one JSON object (--json):

* ``hit_lookups_per_s``: acquire+release pairs per second on resident experts, one thread, in
  one C loop (``_C.Cache.bench_hits``) -- the per-expert cost of a hit in the C decode path.
* ``raw_read_gbps``: sequential reads of every block with ``os.preadv`` on an O_DIRECT
  descriptor into one page-aligned buffer: the ceiling.
* ``store_read_gbps``: the same blocks, same order, through ``ExpertStore.read_block``
  (O_DIRECT, no CRC check, like the raw reads); ``store_read_vs_raw`` = store / raw.
* ``cache_miss_read_gbps``: the same blocks through ``ExpertCache.acquire``/``release`` on a
  cache where every access misses (loads run in the calling thread); ``cache_read_vs_raw``.
  Raw and store passes alternate, best of --repeat each, so drift hits both alike.
* ``prefetch_hidden_frac``: share of expert load time hidden behind compute by prefetching.
  A decode loop of --tokens tokens visits every layer; each layer acquires --top-k random
  experts (fixed per token and layer: the same routing in both runs), "computes" for
  ``compute_ms_per_layer`` (a sleep, equal to the mean per-layer load time measured in the
  run without prefetch, i.e. compute and I/O balanced), and releases them.  Run A has no
  prefetch; run B, before computing layer l, asks the worker for the experts of layer l+1
  (of the next token's layer 0 at the last layer): an oracle predictor, so this measures the
  mechanism, not a predictor.  Stall = seconds demand accesses blocked on loads
  (``stats()["stall_s"]``).  ``prefetch_hidden_frac = 1 - stall_B / stall_A``.  The cache
  holds (layers + 1) * top_k slots so that the prefetcher always has a slot not used in the
  current pass to load into.

    python benchmarks/cache.py [--json] [--dir /var/tmp] [--block-kib 1024] [--repeat 3]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from specmoe.runtime.cache import ExpertCache  # noqa: E402
from specmoe.storage.store import ExpertStore, aligned_empty, write_store  # noqa: E402


def _write(path: str, nl: int, ne: int, block_kib: int, progress: bool) -> None:
    n = block_kib * 1024 // 4

    def layer(i: int) -> dict[str, np.ndarray]:
        w = np.empty((ne, n), np.float32)
        w[:] = np.arange(ne, dtype=np.float32)[:, None] + 1000.0 * i
        return {"w": w}

    write_store(path, layer, num_layers=nl, top_k=None, progress=progress).close()


def _raw_pass(path: str, offsets: list[int], nbytes: int) -> float:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    buf = aligned_empty(nbytes)  # the same kind of 4096-aligned buffer the store pass uses
    try:
        t0 = time.perf_counter()
        for off in offsets:
            if os.preadv(fd, [buf], off) != nbytes:
                raise OSError(f"short read at {off}")
        return time.perf_counter() - t0
    finally:
        os.close(fd)


def _store_pass(store: ExpertStore, keys: list[tuple[int, int]]) -> float:
    buf = aligned_empty(store.block_bytes)
    t0 = time.perf_counter()
    for l, e in keys:
        store.read_block(l, e, out=buf)
    return time.perf_counter() - t0


def _cache_pass(store: ExpertStore, keys: list[tuple[int, int]]) -> float:
    with ExpertCache(store, 1, top_k=1, prefetch=False) as cache:
        t0 = time.perf_counter()
        for l, e in keys:
            cache.acquire(l, e)
            cache.release(l, e)
        dt = time.perf_counter() - t0
        assert cache.stats()["misses"] == len(keys)
    return dt


def _decode(store: ExpertStore, routing: np.ndarray, compute_s: float, prefetch: bool) -> dict:
    tokens, nl, k = routing.shape
    with ExpertCache(store, (nl + 1) * k, "lru", top_k=k, prefetch=prefetch) as cache:
        t0 = time.perf_counter()
        for t in range(tokens):
            cache.begin_pass()
            for l in range(nl):
                ex = [int(e) for e in routing[t, l]]
                for e in ex:
                    cache.acquire(l, e)
                if prefetch:
                    nt, nxt = (t, l + 1) if l + 1 < nl else (t + 1, 0)
                    if nt < tokens:
                        cache.prefetch([(nxt, int(e), 1.0) for e in routing[nt, nxt]],
                                       replace=True)
                if compute_s > 0:
                    time.sleep(compute_s)
                for e in ex:
                    cache.release(l, e)
        st = cache.stats()
        st["wall_s"] = time.perf_counter() - t0
    return st


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--dir", default="/var/tmp", help="directory for the test file (disk)")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--block-kib", type=int, default=1024)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--hit-seconds", type=float, default=0.5)
    args = ap.parse_args()
    nl, ne = args.layers, args.experts
    out: dict = {"layers": nl, "experts": ne}
    d = tempfile.mkdtemp(prefix="specmoe_bench_cache_", dir=args.dir)
    try:
        path = os.path.join(d, "bench.smoe")
        _write(path, nl, ne, args.block_kib, progress=not args.json)
        store = ExpertStore(path, direct=True, verify=False)
        out["block_bytes"] = bb = store.block_bytes
        out["file_bytes"] = store.nbytes
        out["o_direct"] = bool(store.direct)
        keys = [(l, e) for l in range(nl) for e in range(ne)]
        offsets = [store.data_offset + (l * ne + e) * bb for l, e in keys]
        total = len(keys) * bb

        # --- hit path ------------------------------------------------------------------
        hot = keys[: min(64, len(keys))]
        with ExpertCache(store, len(hot), top_k=1, prefetch=False) as cache:
            for l, e in hot:
                cache.acquire(l, e)
                cache.release(l, e)
            iters = 1000
            while True:  # calibrate to about --hit-seconds
                dt = cache.bench_hits(hot, iters)
                if dt > args.hit_seconds / 4 or iters > 10**8:
                    break
                iters *= 4
            dt = min(dt, cache.bench_hits(hot, iters))
            out["hit_lookups_per_s"] = iters * len(hot) / dt
            out["hit_ns_per_acquire_release"] = dt / (iters * len(hot)) * 1e9

        # --- read bandwidth --------------------------------------------------------------
        raw_t, store_t, cache_t = [], [], []
        for _ in range(args.repeat):
            raw_t.append(_raw_pass(path, offsets, bb))
            store_t.append(_store_pass(store, keys))
            cache_t.append(_cache_pass(store, keys))
        out["raw_read_gbps"] = total / min(raw_t) / 1e9
        out["store_read_gbps"] = total / min(store_t) / 1e9
        out["cache_miss_read_gbps"] = total / min(cache_t) / 1e9
        out["store_read_vs_raw"] = out["store_read_gbps"] / out["raw_read_gbps"]
        out["cache_read_vs_raw"] = out["cache_miss_read_gbps"] / out["raw_read_gbps"]

        # --- prefetch overlap ------------------------------------------------------------
        rng = np.random.default_rng(0)
        routing = np.stack([np.stack([rng.choice(ne, args.top_k, replace=False)
                                      for _ in range(nl)]) for _ in range(args.tokens)])
        a = _decode(store, routing, 0.0, prefetch=False)  # calibrates the compute time
        compute_s = a["stall_s"] / (args.tokens * nl)
        a = _decode(store, routing, compute_s, prefetch=False)
        b = _decode(store, routing, compute_s, prefetch=True)
        out["compute_ms_per_layer"] = compute_s * 1e3
        out["stall_without_prefetch_s"] = a["stall_s"]
        out["stall_with_prefetch_s"] = b["stall_s"]
        out["decode_wall_without_prefetch_s"] = a["wall_s"]
        out["decode_wall_with_prefetch_s"] = b["wall_s"]
        out["prefetch_hidden_frac"] = 1.0 - b["stall_s"] / a["stall_s"] if a["stall_s"] else 0.0
        out["prefetch_stats"] = {k: b[k] for k in ("hits", "misses", "prefetch_issued",
                                                   "prefetch_used", "prefetch_late",
                                                   "prefetch_wasted", "prefetch_dropped")}
        store.close()
    finally:
        shutil.rmtree(d, ignore_errors=True)
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:32s} {v}")


if __name__ == "__main__":
    main()

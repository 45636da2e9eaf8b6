"""How close do expert-store reads come to raw reads of the same bytes?

Builds a store of about --mb MiB in --dir, then times, best of --repeat passes over all blocks:
  * ExpertStore.read_block (buffered; with and without CRC32C verification) against a plain
    os.preadv of the same byte ranges into the same aligned buffer (the ceiling: page cache);
  * the O_DIRECT path against os.preadv on an O_DIRECT descriptor (the ceiling: the device),
    where the filesystem supports O_DIRECT;
  * _C.crc32c against a numpy memory copy of the same buffer (memory bandwidth).
Ratios (ours / ceiling, in time) are what to compare across machines; absolute GB/s drift.

    python benchmarks/store.py [--mb 128] [--dir /tmp] [--repeat 3] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import specmoe  # noqa: E402
from specmoe import _C  # noqa: E402
from specmoe.storage.store import aligned_empty  # noqa: E402


def best(fn, repeat: int) -> float:
    t = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        t = min(t, time.perf_counter() - t0)
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=128)
    ap.add_argument("--dir", default=None)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    nl, ne = 4, 16
    per_block = max(1, args.mb * 2**20 // (nl * ne))
    inter = per_block // (3 * 2 * 64)  # three bf16 matrices of 64 x inter per expert
    rng = np.random.default_rng(0)
    layers = [{n: rng.integers(0, 2**16, (ne, 64, inter), dtype=np.uint16)
               for n in ("gate", "up", "down")} for _ in range(nl)]
    dtypes = {"gate": "bf16", "up": "bf16", "down": "bf16"}
    out: dict = {"num_layers": nl, "num_experts": ne}
    with tempfile.TemporaryDirectory(dir=args.dir) as d:
        path = os.path.join(d, "bench.smoe")
        t0 = time.perf_counter()
        specmoe.write_store(path, layers, dtypes=dtypes, progress=not args.json).close()
        out["write_s"] = time.perf_counter() - t0
        del layers
        keys = [(l, e) for l in range(nl) for e in range(ne)]

        def ours(store):
            buf = aligned_empty(store.block_bytes)
            return lambda: [store.read_block(l, e, out=buf) for l, e in keys]

        def raw(fd, store):
            buf = aligned_empty(store.block_bytes)

            def run():
                for l, e in keys:
                    off = store.data_offset + (l * ne + e) * store.block_bytes
                    os.preadv(fd, [buf], off)
            return run

        s = specmoe.ExpertStore(path)
        s_nv = specmoe.ExpertStore(path, verify=False)
        total = len(keys) * s.block_bytes
        out["block_bytes"] = s.block_bytes
        out["total_bytes"] = total
        fd = os.open(path, os.O_RDONLY)
        ours(s_nv)()  # warm the page cache
        t_raw = best(raw(fd, s), args.repeat)
        t_nv = best(ours(s_nv), args.repeat)
        t_v = best(ours(s), args.repeat)
        os.close(fd)
        out["buffered"] = {"raw_gbps": total / t_raw / 1e9, "ours_noverify_gbps": total / t_nv / 1e9,
                           "ours_verify_gbps": total / t_v / 1e9,
                           "ratio_noverify": t_nv / t_raw, "ratio_verify": t_v / t_raw}

        sd = specmoe.ExpertStore(path, direct=True, verify=False)
        if sd.direct:
            fdd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            t_rawd = best(raw(fdd, sd), args.repeat)
            t_d = best(ours(sd), args.repeat)
            os.close(fdd)
            out["direct"] = {"raw_gbps": total / t_rawd / 1e9, "ours_gbps": total / t_d / 1e9,
                             "ratio": t_d / t_rawd}
        else:
            out["direct"] = None  # filesystem refuses O_DIRECT
        for st in (s, s_nv, sd):
            st.close()

    buf = np.random.default_rng(1).integers(0, 256, 64 * 2**20, dtype=np.uint8)
    dst = np.empty_like(buf)
    t_copy = best(lambda: np.copyto(dst, buf), args.repeat)
    t_crc = best(lambda: _C.crc32c(buf), args.repeat)
    out["crc32c"] = {"gbps": buf.nbytes / t_crc / 1e9, "memcpy_gbps": buf.nbytes / t_copy / 1e9,
                     "ratio_to_memcpy": t_crc / t_copy}
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:>12}: {v}")


if __name__ == "__main__":
    main()

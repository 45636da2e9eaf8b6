"""Write the seed corpus of tests/fuzz/store_fuzz.c (deterministic; see store_fuzz.c for the
32-byte parameter record).  Usage: python gen_corpus.py DIR"""
from __future__ import annotations

import os
import random
import struct
import sys


def record(mode: int, do_units: int, bb_units: int, nl: int, ne: int, raw: tuple = (0, 0, 0, 0),
           bad_seed: int = 0) -> bytes:
    # byte 0 mode; 1 data_offset/4096; 2 block_bytes/4096; 3 unaligned extra; 4 nl-1; 5 ne-1
    small = bytes([mode, do_units, bb_units, 0, nl - 1, ne - 1])
    rec = bytearray(32)
    rec[0:6] = small
    if mode & 1:
        rec[4:12] = struct.pack("<Q", raw[0])
        rec[12:20] = struct.pack("<Q", raw[1])
        rec[20:24] = struct.pack("<I", raw[2])
        rec[24:28] = struct.pack("<I", raw[3])
    rec[28:32] = struct.pack("<I", bad_seed)
    return bytes(rec)


def main(out: str) -> None:
    os.makedirs(out, exist_ok=True)
    rnd = random.Random(15)
    body = lambda n: bytes(rnd.getrandbits(8) for _ in range(n))  # noqa: E731
    seeds = {
        # 2 layers x 2 experts of 4096-byte blocks after a 4096-byte header, all checksums true
        "seed-valid-verify": record(2 | 4, 1, 1, 2, 2) + body(4096 + 4 * 4096),
        "seed-valid-noverify": record(0, 1, 1, 2, 2) + body(4096 + 4 * 4096),
        "seed-bad-crc": record(2, 1, 1, 2, 2, bad_seed=0xDEADBEEF) + body(4096 + 4 * 4096),
        "seed-truncated": record(2 | 4, 1, 1, 2, 2) + body(4096 + 3 * 4096 - 100),
        # 12 KiB blocks: the CRC's 3-way SSE4.2 path
        "seed-big-blocks": record(2 | 4 | 8, 0, 3, 1, 1) + body(12288 + 100),
        # raw 64-bit numbers: a valid store, and ones that overflow the size computation
        "seed-raw-valid": record(1 | 2 | 4, 0, 0, 1, 1, raw=(4096, 4096, 2, 2)) + body(5 * 4096),
        "seed-raw-overflow": record(1 | 2, 0, 0, 1, 1, raw=(2**63, 2**62, 2**31, 4)) + body(4096),
        "seed-raw-unaligned": record(1, 0, 0, 1, 1, raw=(4095, 4097, 1, 1)) + body(3 * 4096),
    }
    for name, data in seeds.items():
        with open(os.path.join(out, name), "wb") as f:
            f.write(data)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__),
                                                              "corpus", "store"))

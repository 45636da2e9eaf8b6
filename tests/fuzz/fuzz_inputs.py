"""Fuzz the Python loaders of untrusted files (issue 15): the store header parser
(``ExpertStore`` -> ``_parse_header``/``_validate``, then block reads), ``Trace.load`` (.npz)
and ``load_puffin`` (CSV and CSV.gz).

Engine: a seeded mutation loop (deterministic for a given ``--seed``): structure-aware
mutations (a number, hex checksum or string in the JSON header replaced by a hostile value,
deep nesting, arrays of hostile dtypes and values, CSV fields with out-of-range / float / NaN
ids, over-long fields) plus byte-level ones (flips, truncation, splices) on top.  With
``--engine atheris`` (``pip install atheris``) the same targets run under Atheris' coverage
guidance instead, the input bytes being the file.

Oracle: the only exception a loader may raise for bad bytes is its named error
(``StoreError``, ``TraceError``); on success the result must be sound (expert ids in range,
equal to the values written when no byte was mutated: no wraparound, truncation or NaN cast).
Anything else is a *finding*: printed with a reproducer file under ``--out`` and counted; the
exit status is 1 when there was any.

    python tests/fuzz/fuzz_inputs.py --runs 20000 all
    python tests/fuzz/fuzz_inputs.py --engine atheris store -- -runs=100000
"""
from __future__ import annotations

import argparse
import gzip
import io
import json
import os
import random
import sys
import tempfile
import time
import traceback
import warnings

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))

import specmoe  # noqa: E402
from specmoe.storage.store import ExpertStore, StoreError, write_store  # noqa: E402
from specmoe.sim.traces import Trace, TraceError, load_puffin  # noqa: E402

HOSTILE = [b"-1", b"-0000001", b"0", b"1e999", b"NaN", b"-Infinity", b"70000", b"1.7", b"true",
           b"null", b"[]", b"{}", b'"x"', b"9" * 30, b"9" * 5000, b"0x000001", b" 0000001",
           b"4294967296", b"18446744073709551616", b"-9223372036854775809", b"[" * 5000,
           b'"\\ud800"', b"1_0"]


class Finding(Exception):
    pass


def _mutate_bytes(rnd: random.Random, b: bytes, n: int = 4) -> bytes:
    b = bytearray(b)
    for _ in range(rnd.randint(1, n)):
        op = rnd.randrange(5)
        if not b:
            b += bytes([rnd.randrange(256)])
            continue
        i = rnd.randrange(len(b))
        if op == 0:
            b[i] ^= 1 << rnd.randrange(8)
        elif op == 1:
            b[i] = rnd.choice([0, 0xFF, 0x7F, 0x80, ord("["), ord('"'), ord("-")])
        elif op == 2:
            del b[i:i + rnd.randint(1, 64)]
        elif op == 3:
            b[i:i] = rnd.choice(HOSTILE)
        else:
            del b[rnd.randrange(len(b)):]  # truncate
    return bytes(b)


# ---------------------------------------------------------------------------------------------
# store header
# ---------------------------------------------------------------------------------------------

def _seed_store(tmp: str) -> bytes:
    rng = np.random.default_rng(0)
    layers = [{"w": rng.standard_normal((2, 8, 4)).astype(np.float32),
               "s": rng.integers(0, 255, (2, 8), dtype=np.uint8)} for _ in range(2)]
    p = os.path.join(tmp, "seed.smoe")
    write_store(p, layers, model="fuzz", top_k=1, progress=False).close()
    with open(p, "rb") as f:
        return f.read()


def _mutate_store(rnd: random.Random, seed: bytes) -> bytes:
    n = int.from_bytes(seed[:8], "little")
    hdr, data = seed[8:8 + n], seed[8 + n:]
    text = hdr.rstrip(b" ")
    for _ in range(rnd.randint(1, 3)):
        k = rnd.randrange(6)
        if k <= 2:  # replace a number / 8-hex checksum / quoted token with a hostile value
            import re
            pat = [rb"-?[0-9]+", rb"[0-9a-f]{8}", rb'\\?"[A-Za-z_]+\\?"'][k]
            ms = list(re.finditer(pat, text))
            if ms:
                m = rnd.choice(ms)
                text = text[:m.start()] + rnd.choice(HOSTILE) + text[m.end():]
        elif k == 3:
            i = rnd.randrange(len(text))
            d = rnd.choice([10, 100, 2000, 50000])
            text = text[:i] + b"[" * d + b"0" + b"]" * d + text[i:]
        elif k == 4:
            text = _mutate_bytes(rnd, text, 2)
        else:
            data = _mutate_bytes(rnd, data, 2)
    if len(text) <= n:
        hdr = text + b" " * (n - len(text))  # keep the data section where it was
        prefix = seed[:8]
    else:
        hdr = text
        prefix = len(text).to_bytes(8, "little")
    if rnd.random() < 0.05:
        prefix = _mutate_bytes(rnd, prefix, 1)[:8].ljust(8, b"\0")
    return prefix + hdr + data


def run_store(data: bytes, path: str) -> None:
    with open(path, "wb") as f:
        f.write(data)
    try:
        st = ExpertStore(path)
    except StoreError:
        return
    try:
        for l in range(st.num_layers):
            for e in range(st.num_experts):
                try:
                    st.read_expert(l, e)
                except StoreError:
                    pass
    finally:
        st.close()


# ---------------------------------------------------------------------------------------------
# trace .npz
# ---------------------------------------------------------------------------------------------

def _hostile_ids(rnd: random.Random, shape: tuple) -> np.ndarray:
    kind = rnd.choice(["ok", "int8", "int32", "int64", "uint16", "f32", "f64", "bool", "str"])
    base = np.asarray([rnd.randrange(8) for _ in range(int(np.prod(shape)))]).reshape(shape)
    if kind == "ok":
        a = base.astype(np.int16)
    elif kind in ("int8", "int32", "int64", "uint16"):
        a = base.astype(kind)
    elif kind in ("f32", "f64"):
        a = base.astype(np.float32 if kind == "f32" else np.float64)
    elif kind == "bool":
        return (base % 2).astype(bool)
    else:
        return base.astype(str)
    if a.size and rnd.random() < 0.6:
        v = rnd.choice([-1, 8, 70000, 2**31, 2**40, 1.7, float("nan"), float("inf"), 65535, 32768])
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                a.flat[rnd.randrange(a.size)] = v
        except (OverflowError, ValueError):
            pass
    return a


def _gen_npz(rnd: random.Random) -> tuple[bytes, np.ndarray | None]:
    n, nl, k = rnd.randint(0, 4), rnd.randint(1, 3), rnd.randint(1, 2)
    ex = _hostile_ids(rnd, (n, nl, k))
    meta: object = {"format": "specmoe-trace", "version": 1, "num_experts": 8, "model": "m",
                    "source": "s"}
    r = rnd.random()
    if r < 0.1:
        meta = rnd.choice([[], "x", 3, None])
    elif r < 0.3:
        key = rnd.choice(["format", "version", "num_experts", "model", "source"])
        if rnd.random() < 0.5:
            del meta[key]  # type: ignore[union-attr]
        else:
            meta[key] = rnd.choice([None, -1, 0, 2**70, 1.5, "8", [], True, 40000])  # type: ignore[index]
    arrays = {"experts": ex, "request_starts": np.zeros(1, np.int64),
              "layer_ids": np.arange(nl, dtype=np.int32),
              "meta": np.array(json.dumps(meta) if rnd.random() > 0.05 else "[" * 3000)}
    for key in ("request_starts", "layer_ids", "meta"):
        if rnd.random() < 0.05:
            del arrays[key]
        elif rnd.random() < 0.05:
            arrays[key] = rnd.choice([np.array([1.5, np.nan]), np.array(["a"]), np.zeros((2, 2)),
                                      np.array(2**40)])
    if rnd.random() < 0.2:
        arrays["weights"] = rnd.choice([np.ones(ex.shape), np.ones((1,)), np.array(["w"])])
    if rnd.random() < 0.1:
        arrays["tokens"] = rnd.choice([np.array(["a"] * n), np.arange(n), np.zeros((n, 2))])
    buf = io.BytesIO()
    (np.savez_compressed if rnd.random() < 0.5 else np.savez)(buf, **arrays)
    return buf.getvalue(), ex


def run_npz(data: bytes, path: str, written: np.ndarray | None = None) -> None:
    with open(path, "wb") as f:
        f.write(data)
    try:
        t = Trace.load(path)
    except TraceError:
        return
    ex = t.experts
    if ex.dtype != np.int16 or (ex.size and (ex.min() < 0 or ex.max() >= t.num_experts)):
        raise Finding(f"loaded trace has ids outside 0..{t.num_experts - 1}")
    if written is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            same = (written.shape == ex.shape and written.dtype.kind in "iuf"
                    and np.array_equal(written.astype(np.float64), ex.astype(np.float64)))
        if not same:
            raise Finding(f"loaded ids differ from the ids written ({written.dtype}): silent "
                          f"conversion")


# ---------------------------------------------------------------------------------------------
# puffin CSV
# ---------------------------------------------------------------------------------------------

def _gen_csv(rnd: random.Random) -> tuple[bytes, bool]:
    rows = ["Layer ID,Batch Number,Token,Activated Expert IDs"]
    nl, n, k = rnd.randint(1, 3), rnd.randint(1, 3), rnd.randint(1, 3)
    for l in range(nl):
        for t in range(n):
            ids = [str(rnd.randrange(64)) for _ in range(k)]
            rows.append(f'{l + 1},0,tok{t},"[{", ".join(ids)}]"')
    text = "\n".join(rows) + "\n"
    r = rnd.random()
    if r < 0.5:
        import re
        ms = list(re.finditer(r"[0-9]+", text))
        m = rnd.choice(ms)
        v = rnd.choice(["-1", "64", "70000", "1.7", "NaN", "9" * 5000, "\u0663", "1_0", "+3",
                        " 7 ", "x" * 140000, "", '"'])
        text = text[:m.start()] + v + text[m.end():]
    raw = text.encode("utf-8")
    if rnd.random() < 0.2:
        raw = _mutate_bytes(rnd, raw, 3)
    gz = rnd.random() < 0.4
    if gz:
        raw = gzip.compress(raw)
        if rnd.random() < 0.5:
            raw = _mutate_bytes(rnd, raw, 2)
    return raw, gz


def run_csv(data: bytes, path: str) -> None:
    with open(path, "wb") as f:
        f.write(data)
    try:
        t = load_puffin(path, num_experts=64)
    except TraceError:
        return
    if t.experts.size and (t.experts.min() < 0 or t.experts.max() >= 64):
        raise Finding("puffin trace with ids outside 0..63")


# ---------------------------------------------------------------------------------------------
# driver
# ---------------------------------------------------------------------------------------------

def fuzz(target: str, runs: int, seed: int, out: str, time_limit: float | None = None,
         verbose: bool = True) -> dict:
    """Run ``target`` for ``runs`` inputs (or until ``time_limit`` seconds); return stats."""
    rnd = random.Random(seed)
    tmpd = tempfile.mkdtemp(prefix="smoe-fuzz-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    findings = []
    t0 = time.perf_counter()
    store_seed = _seed_store(tmpd) if target == "store" else b""
    done = 0
    try:
        for i in range(runs):
            if time_limit is not None and time.perf_counter() - t0 > time_limit:
                break
            written = None
            if target == "store":
                data = _mutate_store(rnd, store_seed)
                path = os.path.join(tmpd, "in.smoe")
            elif target == "npz":
                data, written = _gen_npz(rnd)
                if rnd.random() < 0.3:
                    data, written = _mutate_bytes(rnd, data, 3), None
                path = os.path.join(tmpd, "in.npz")
            else:
                data, gz = _gen_csv(rnd)
                path = os.path.join(tmpd, "in.csv.gz" if gz else "in.csv")
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("error", ResourceWarning)  # an unclosed file is a finding
                    warnings.simplefilter("error", RuntimeWarning)   # e.g. numpy's NaN cast
                    if target == "store":
                        run_store(data, path)
                    elif target == "npz":
                        run_npz(data, path, written)
                    else:
                        run_csv(data, path)
            except Exception as e:  # noqa: BLE001 - anything but the named error is a finding
                rep = os.path.join(out, f"{target}-finding-{len(findings)}{os.path.splitext(path)[1]}")
                os.makedirs(out, exist_ok=True)
                with open(rep, "wb") as f:
                    f.write(data)
                findings.append(f"{type(e).__name__}: {str(e)[:200]} (reproducer {rep})")
                if verbose:
                    print(f"[{target}] FINDING at run {i}: {findings[-1]}", file=sys.stderr)
                    traceback.print_exc(limit=3)
            done += 1
    finally:
        for f in os.listdir(tmpd):
            os.unlink(os.path.join(tmpd, f))
        os.rmdir(tmpd)
    dt = time.perf_counter() - t0
    res = {"target": target, "runs": done, "seconds": round(dt, 2),
           "exec_per_s": round(done / dt, 1) if dt else 0.0, "findings": findings}
    if verbose:
        print(json.dumps(res))
    return res


def _atheris(target: str, argv: list[str]) -> None:
    import atheris  # noqa: F401 - optional

    tmpd = tempfile.mkdtemp(prefix="smoe-atheris-")
    path = os.path.join(tmpd, {"store": "in.smoe", "npz": "in.npz", "csv": "in.csv"}[target])
    fn = {"store": run_store, "npz": run_npz, "csv": run_csv}[target]

    def one(data: bytes) -> None:
        fn(data, path)

    atheris.instrument_all()
    atheris.Setup([sys.argv[0], *argv], one)
    atheris.Fuzz()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("target", choices=["store", "npz", "csv", "all"])
    ap.add_argument("--runs", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=15)
    ap.add_argument("--time-limit", type=float, default=None)
    ap.add_argument("--engine", choices=["mutate", "atheris"], default="mutate")
    ap.add_argument("--out", default=os.path.join(HERE, "bin", "findings"))
    ap.add_argument("rest", nargs="*", help="after --: arguments for Atheris/libFuzzer")
    a = ap.parse_args()
    if a.engine == "atheris":
        _atheris("store" if a.target == "all" else a.target, a.rest)
        return 0
    targets = ["store", "npz", "csv"] if a.target == "all" else [a.target]
    bad = 0
    for t in targets:
        bad += len(fuzz(t, a.runs, a.seed, a.out, a.time_limit)["findings"])
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

"""Bad input to the loaders and the API (issue 15): one reproducer per defect found by hand and
by the fuzzers (tests/fuzz/), each checking that the named error (StoreError, TraceError,
ValueError naming the parameter) is raised and nothing is silently converted.  The table in
docs/reliability.md lists every case with the test that checks it."""
from __future__ import annotations

import gzip
import json
import os
import warnings

import numpy as np
import pytest

import specmoe
from specmoe.sim.replay import Predictor, parse_policy, simulate
from specmoe.storage.store import ExpertStore, StoreError, write_store
from specmoe.sim.traces import Trace, TraceError, load_puffin, load_trace


# ---------------------------------------------------------------------------------------------
# store header
# ---------------------------------------------------------------------------------------------

@pytest.fixture
def store_bytes(tmp_path):
    rng = np.random.default_rng(0)
    layers = [{"w": rng.standard_normal((2, 8, 4)).astype(np.float32)} for _ in range(2)]
    p = tmp_path / "ok.smoe"
    write_store(p, layers, progress=False).close()
    return p.read_bytes()


def _with_header(data: bytes, fn) -> bytes:
    """Apply fn to the header text, keeping its length (space padded) so only it changes."""
    n = int.from_bytes(data[:8], "little")
    hdr = fn(data[8:8 + n].rstrip(b" "))
    assert len(hdr) <= n
    return data[:8] + hdr + b" " * (n - len(hdr)) + data[8 + n:]


@pytest.mark.parametrize("bad", ["-0000001", "-1", " 0000001", "0x000001", "0000_001", "ffffffff1"])
def test_store_crc_field_not_hex8(tmp_path, store_bytes, bad):
    """A checksum of -1 raised OverflowError (int("-1", 16) into a uint32 array)."""
    meta_crc = json.loads(json.loads(store_bytes[8:8 + int.from_bytes(store_bytes[:8], "little")]
                                     )["__metadata__"]["specmoe"])["crc32c"][0][0]
    p = tmp_path / "bad.smoe"
    p.write_bytes(_with_header(store_bytes, lambda h: h.replace(meta_crc.encode(), bad.encode(), 1)))
    with pytest.raises(StoreError, match=r"crc32c entry .* layer 0, expert 0"):
        ExpertStore(p)


@pytest.mark.parametrize("depth", [100, 100_000])
def test_store_header_deep_nesting(tmp_path, depth):
    """A deeply nested header raised RecursionError; nesting is bounded before parsing."""
    body = b'{"__metadata__":{"specmoe":"x"},"a":' + b"[" * depth + b"]" * depth + b"}"
    n = 4096 - 8
    p = tmp_path / "deep.smoe"
    p.write_bytes(len(body.ljust(n)).to_bytes(8, "little") + body.ljust(n) + b"\0" * 4096)
    with pytest.raises(StoreError, match="nests deeper"):
        ExpertStore(p)


def test_store_metadata_deep_nesting(tmp_path, store_bytes):
    """The specmoe metadata is JSON inside a JSON string: bounded the same way."""
    deep = "[" * 5000 + "]" * 5000
    hdr = {"__metadata__": {"specmoe": deep}}
    body = json.dumps(hdr).encode()
    p = tmp_path / "deep2.smoe"
    p.write_bytes(len(body).to_bytes(8, "little") + body)
    with pytest.raises(StoreError, match="specmoe metadata nests deeper"):
        ExpertStore(p)


def test_store_header_brackets_in_strings_do_not_count(tmp_path):
    """The depth bound ignores brackets inside strings (model names, extra fields)."""
    rng = np.random.default_rng(1)
    p = tmp_path / "s.smoe"
    write_store(p, [{"w": rng.standard_normal((2, 4)).astype(np.float32)}],
                model="[" * 200 + '{"' + "]", extra={"note": "{" * 300}, progress=False).close()
    with ExpertStore(p) as st:
        assert st.model.startswith("[[[") and st.extra["note"] == "{" * 300


@pytest.mark.parametrize("mutate", ["huge_int", "lone_surrogate", "not_utf8"])
def test_store_header_values(tmp_path, store_bytes, mutate):
    def fn(h: bytes) -> bytes:
        if mutate == "huge_int":  # past int()'s 4300-digit limit: ValueError inside json
            return h.replace(b'"__metadata__"', b'"x":' + b"9" * 5000 + b',"__metadata__"', 1)
        if mutate == "lone_surrogate":
            return h.replace(b'\\"model\\":\\"', b'\\"model\\":\\"\\\\ud800', 1)
        return h.replace(b'"__metadata__"', b'"\xff\xfe":1,"__metadata__"', 1)

    data = store_bytes
    n = int.from_bytes(data[:8], "little")
    hdr = fn(data[8:8 + n].rstrip(b" "))
    p = tmp_path / "v.smoe"
    p.write_bytes(len(hdr).to_bytes(8, "little") + hdr)
    with pytest.raises(StoreError):
        ExpertStore(p)


# ---------------------------------------------------------------------------------------------
# traces: Trace, Trace.load (.npz)
# ---------------------------------------------------------------------------------------------

def _npz(path, **arrays):
    meta = {"format": "specmoe-trace", "version": 1, "num_experts": 8, "model": "", "source": ""}
    meta.update(arrays.pop("meta_update", {}))
    base = {"experts": np.zeros((2, 1, 1), np.int16), "request_starts": np.zeros(1, np.int64),
            "layer_ids": np.zeros(1, np.int32), "meta": np.array(json.dumps(meta))}
    base.update(arrays)
    for k in [k for k, v in base.items() if v is None]:
        del base[k]
    np.savez(path, **base)
    return path


@pytest.mark.parametrize("ids,match", [
    (np.array([[[70000]]], np.int32), "expert id 70000"),         # wrapped to 4464 before
    (np.array([[[-1]]], np.int64), "expert id -1"),
    (np.array([[[1.7]]]), "non-integer value 1.7"),               # truncated to 1 before
    (np.array([[[np.nan]]]), "non-finite"),                        # cast with a warning before
    (np.array([[[np.inf]]], np.float32), "non-finite"),
    (np.array([[[8]]], np.uint16), "expert id 8"),                # past num_experts
    (np.array([[[True]]]), "expected integers"),
])
def test_trace_ids_checked_before_narrowing(tmp_path, ids, match):
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # numpy's "invalid value in cast" must not happen
        with pytest.raises(TraceError, match=match):
            Trace(experts=ids, num_experts=8)
        p = _npz(tmp_path / "t.npz", experts=ids)
        with pytest.raises(TraceError, match=f"t.npz: .*{match}"):
            Trace.load(p)


def test_trace_whole_float_ids_accepted():
    t = Trace(experts=np.array([[[1.0, 7.0]]]), num_experts=8)
    assert t.experts.dtype == np.int16 and t.experts.tolist() == [[[1, 7]]]


@pytest.mark.parametrize("ne", [0, -3, 40000, 1.5, "8", True, None])
def test_trace_num_experts_checked(ne):
    with pytest.raises(TraceError, match="num_experts"):
        Trace(experts=np.zeros((1, 1, 1), np.int16), num_experts=ne)


@pytest.mark.parametrize("case", ["empty", "truncated", "garbage", "npy", "bad_deflate",
                                  "encrypted_flag", "directory", "missing"])
def test_trace_load_bad_bytes(tmp_path, case):
    """EOFError, BadZipFile, zlib.error, TypeError (.npy) and OSError escaped before."""
    good = tmp_path / "good.npz"
    Trace(experts=np.tile(np.array([1, 2], np.int16), (50, 2, 1)), num_experts=8).save(good)
    raw = good.read_bytes()
    p = tmp_path / "bad.npz"
    if case == "empty":
        p.write_bytes(b"")
    elif case == "truncated":
        p.write_bytes(raw[:len(raw) // 2])
    elif case == "garbage":
        p.write_bytes(os.urandom(300))
    elif case == "npy":
        with open(p, "wb") as f:
            np.save(f, np.zeros(3))
    elif case == "bad_deflate":  # valid zip directory, corrupt compressed member data
        b = bytearray(raw)
        i = b.index(b"experts.npy") + 40
        b[i:i + 20] = b"\xff" * 20
        p.write_bytes(bytes(b))
    elif case == "encrypted_flag":  # found by fuzz_inputs.py: RuntimeError from zipfile
        b = bytearray(raw)
        i = b.index(b"PK\x03\x04")
        b[i + 6] |= 1  # general-purpose flag bit 0: encrypted
        j = b.index(b"PK\x01\x02")
        b[j + 8] |= 1
        p.write_bytes(bytes(b))
    elif case == "directory":
        p.mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)  # the file must be closed on error
        with pytest.raises(TraceError, match="bad.npz"):
            Trace.load(p)


@pytest.mark.parametrize("case,match", [
    ("no_meta", "no meta"),
    ("meta_not_json", "damaged trace metadata"),
    ("meta_not_object", "not a JSON object"),
    ("meta_deep", "damaged trace metadata"),
    ("meta_array", "'meta' must be one JSON string"),
    ("no_num_experts", "num_experts"),
    ("num_experts_str", "num_experts"),
    ("no_request_starts", "request_starts"),
    ("no_layer_ids", "layer_ids"),
    ("layer_ids_float", "layer_ids: non-integer"),
    ("request_starts_0d", "request_starts"),
    ("tokens_int", "'tokens' must be strings"),
    ("model_int", "'model' and 'source'"),
    ("weights_str", "weights: expected numbers"),
])
def test_trace_load_bad_fields(tmp_path, case, match):
    """KeyError/AttributeError/ValueError/IndexError escaped for missing or malformed fields."""
    kw: dict = {}
    if case == "no_meta":
        kw["meta"] = None
    elif case == "meta_not_json":
        kw["meta"] = np.array("{not json")
    elif case == "meta_not_object":
        kw["meta"] = np.array("[1, 2]")
    elif case == "meta_deep":
        kw["meta"] = np.array("[" * 100_000)
    elif case == "meta_array":
        kw["meta"] = np.zeros(3)
    elif case == "no_num_experts":
        kw["meta"] = np.array(json.dumps({"format": "specmoe-trace", "version": 1}))
    elif case == "num_experts_str":
        kw["meta_update"] = {"num_experts": "8"}
    elif case == "no_request_starts":
        kw["request_starts"] = None
    elif case == "no_layer_ids":
        kw["layer_ids"] = None
    elif case == "layer_ids_float":
        kw["layer_ids"] = np.array([0.5])
    elif case == "request_starts_0d":
        kw["request_starts"] = np.array(5)
    elif case == "tokens_int":
        kw["tokens"] = np.arange(2)
    elif case == "model_int":
        kw["meta_update"] = {"model": 3}
    elif case == "weights_str":
        kw["weights"] = np.array([[["a"]], [["b"]]])
    p = _npz(tmp_path / "f.npz", **kw)
    with pytest.raises(TraceError, match=match):
        Trace.load(p)


# ---------------------------------------------------------------------------------------------
# traces: load_puffin (CSV / CSV.gz)
# ---------------------------------------------------------------------------------------------

HEADER = "Layer ID,Batch Number,Token,Activated Expert IDs\n"


def _csv(tmp_path, body: str, gz: bool = False, name: str = "prompt_1_data.csv"):
    raw = (HEADER + body).encode()
    p = tmp_path / (name + (".gz" if gz else ""))
    p.write_bytes(gzip.compress(raw) if gz else raw)
    return p


@pytest.mark.parametrize("ids,match", [
    ("70000, 1", "expert id 70000"),       # OverflowError (numpy int16) before
    ("64, 1", "expert id 64"),             # past num_experts
    ("9" * 5000 + ", 1", "expert id 9999"),  # int()'s digit limit: ValueError before
    ("1.7, 1", "bad expert list"),
    ("NaN, 1", "bad expert list"),
    ("-1, 1", "bad expert list"),
    ("\u0663, 1", "bad expert list"),       # a non-ASCII digit int() would accept
])
def test_puffin_bad_ids(tmp_path, ids, match):
    p = _csv(tmp_path, f'1,0,a,"[{ids}]"\n')
    with pytest.raises(TraceError, match=f"prompt_1_data.csv:2: {match}"):
        load_puffin(p)


@pytest.mark.parametrize("layer", ["-1", "1.5", "x", "99999999999", "+1", "1_0"])
def test_puffin_bad_layer(tmp_path, layer):
    p = _csv(tmp_path, f'{layer},0,a,"[1, 2]"\n')
    with pytest.raises(TraceError, match="bad layer id"):
        load_puffin(p)


def test_puffin_long_field(tmp_path):
    """csv.Error (field larger than field limit) escaped before."""
    p = _csv(tmp_path, '1,0,"' + "x" * 200_000 + '","[1, 2]"\n')
    with pytest.raises(TraceError, match="cannot read .*Error"):
        load_puffin(p)


@pytest.mark.parametrize("case", ["corrupt_deflate", "truncated", "not_gzip", "bad_utf8"])
def test_puffin_bad_gzip(tmp_path, case):
    """zlib.error for a corrupt deflate stream escaped before."""
    p = _csv(tmp_path, "".join(f'1,0,t{i},"[{i % 60}, 1]"\n' for i in range(400)), gz=True)
    raw = bytearray(p.read_bytes())
    if case == "corrupt_deflate":
        raw[20:60] = b"\x00" * 40
    elif case == "truncated":
        raw = raw[:len(raw) // 2]
    elif case == "not_gzip":
        raw = bytearray(b"plain text, not gzip")
    else:
        raw = bytearray(gzip.compress(HEADER.encode() + b'1,0,\xff\xfe,"[1, 2]"\n'))
    p.write_bytes(bytes(raw))
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResourceWarning)
        with pytest.raises(TraceError, match="prompt_1_data.csv.gz"):
            load_puffin(p)


@pytest.mark.parametrize("limit", [-1, 0, 1.5, True, "2"])
def test_puffin_limit_checked(tmp_path, limit):
    p = _csv(tmp_path, '1,0,a,"[1, 2]"\n')
    with pytest.raises(ValueError, match="limit"):
        load_puffin(p, limit=limit)


@pytest.mark.parametrize("ne", [0, -1, 40000, 2.0])
def test_puffin_num_experts_checked(tmp_path, ne):
    p = _csv(tmp_path, '1,0,a,"[1, 2]"\n')
    with pytest.raises(ValueError, match="num_experts"):
        load_puffin(p, num_experts=ne)


def test_puffin_good_file_still_loads(tmp_path):
    p = _csv(tmp_path, '1,0,a,"[1, 63]"\n2,0,a,"[0, 5]"\n', gz=True)
    t = load_trace(p)
    assert t.experts.tolist() == [[[1, 63], [0, 5]]] and t.layer_ids.tolist() == [1, 2]


# ---------------------------------------------------------------------------------------------
# parameter strings and API arguments
# ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def small_trace():
    rng = np.random.default_rng(0)
    # two distinct experts per (token, layer) row, as a router picks them
    ids = np.stack([rng.permutation(8)[:2] for _ in range(40)]).reshape(20, 2, 2)
    return Trace(experts=ids, num_experts=8)


@pytest.mark.parametrize("spec,match", [
    ("history:topk=0", "topk must be >= 1"),
    ("history:topk=-1", "topk must be >= 1"),
    ("oracle:depth=0", "depth"),
    ("history:history=0", "history"),
    ("router:percentile=1.5", "percentile"),
    ("history:cooc_weight=nan", "cooc_weight"),
    ("history:cooc_weight=-0.1", "cooc_weight"),
    ("history:topk=x", "bad value"),
])
def test_predictor_spec_validated(small_trace, spec, match):
    with pytest.raises(ValueError, match=match):
        simulate(small_trace, "lru", "50%", prefetch=spec)


@pytest.mark.parametrize("spec", ["random:seed=-1", "random:seed=x", "random:seed=1.5",
                                  "random:seed=18446744073709551616", "spac:levels=\u00b2"])
def test_policy_spec_validated(small_trace, spec):
    """random:seed=-1 was wrapped to 2**64-1 silently by the C binding."""
    with pytest.raises(ValueError, match="seed|levels"):
        simulate(small_trace, spec, "50%")


def test_good_specs_still_work(small_trace):
    assert parse_policy("random:seed=18446744073709551615") == ("random", {"seed": 2**64 - 1})
    assert Predictor.parse("history:topk=3,history=4").topk == 3
    assert Predictor().topk == 0  # the default still means the trace's top-k
    r = simulate(small_trace, "random:seed=3", "50%", prefetch="history:topk=1")
    assert r.accesses == small_trace.num_accesses


@pytest.mark.parametrize("cap", ["1e400MiB", "1e400%", float("nan"), "\u00b2"])
def test_capacity_validated(cap):
    with pytest.raises(ValueError, match="capacity"):
        specmoe.parse_capacity(cap, total_experts=8, slot_bytes=4096)

"""Expert store (slow tier): format, round trip, safetensors compatibility, errors.

References used here are independent of the code under test: a plain-Python CRC32C, the
`safetensors` package as a second reader, and the header parsed by hand with `json`.
"""
from __future__ import annotations

import json
import os
import struct
import threading

import numpy as np
import pytest

import specmoe
from specmoe import ExpertStore, StoreError, _C, write_store
from specmoe.storage.store import aligned_empty

safetensors = pytest.importorskip("safetensors")
from safetensors import safe_open  # noqa: E402
from safetensors.numpy import save_file  # noqa: E402

try:
    import torch
except ImportError:  # torch is optional for the store
    torch = None


# ---- independent references ---------------------------------------------------------------

def _crc_table() -> list[int]:
    table = []
    for i in range(256):
        c = i
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc_table()


def crc32c_ref(data: bytes, crc: int = 0) -> int:
    crc ^= 0xFFFFFFFF
    for b in data:
        crc = _TABLE[(crc ^ b) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def raw_header(path) -> tuple[int, dict]:
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        return n, json.loads(f.read(n))


def rewrite_header(path, mutate) -> None:
    """Apply mutate(header_dict) and write the header back in place (same length, padded)."""
    n, h = raw_header(path)
    mutate(h)
    new = json.dumps(h, separators=(",", ":")).encode()
    assert len(new) <= n
    with open(path, "r+b") as f:
        f.seek(8)
        f.write(new + b" " * (n - len(new)))


def rewrite_meta(path, mutate) -> None:
    def m(h):
        meta = json.loads(h["__metadata__"]["specmoe"])
        mutate(meta)
        h["__metadata__"]["specmoe"] = json.dumps(meta, separators=(",", ":"))
    rewrite_header(path, m)


# ---- fixtures -----------------------------------------------------------------------------

NL, NE = 3, 5


def make_layers(seed: int = 0, nl: int = NL, ne: int = NE) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    layers = []
    for _ in range(nl):
        layers.append({
            "gate_up_proj": rng.standard_normal((ne, 6, 33)).astype(np.float32),
            "down_proj": rng.standard_normal((ne, 33, 3)).astype(np.float16),
            "w_bf16": rng.integers(0, 2**16, (ne, 7, 9), dtype=np.uint16),
            "q4": rng.integers(0, 256, (ne, 1000), dtype=np.uint8),
            "scales": rng.standard_normal((ne, 13)).astype(np.float32),
            "i8": rng.integers(-128, 128, (ne, 2, 2, 3), dtype=np.int8),
        })
    return layers


@pytest.fixture
def layers():
    return make_layers()


@pytest.fixture
def store_path(tmp_path, layers):
    p = tmp_path / "experts.smoe"
    write_store(p, layers, model="tiny", top_k=2, dtypes={"w_bf16": "bf16"},
                extra={"architecture": "test", "quant": {"q4": "int4"}}, progress=False).close()
    return p


# ---- crc32c ------------------------------------------------------------------------------

def test_crc32c_known_vector():
    assert _C.crc32c(b"123456789") == 0xE3069283
    assert crc32c_ref(b"123456789") == 0xE3069283
    assert _C.crc32c(b"") == 0


def test_crc32c_matches_reference_all_lengths_and_alignments():
    rng = np.random.default_rng(1)
    buf = rng.integers(0, 256, 300, dtype=np.uint8).tobytes()
    for start in range(0, 9):
        for length in list(range(0, 40)) + [63, 64, 65, 255, 291 - start]:
            chunk = buf[start:start + length]
            want = crc32c_ref(chunk)
            assert _C.crc32c(memoryview(buf)[start:start + length]) == want
            assert _C._crc32c_portable(chunk) == want


def test_crc32c_interleaved_path_boundaries():
    # The hardware path runs three streams over 3 x 4096-byte stripes and merges them.
    rng = np.random.default_rng(3)
    buf = rng.integers(0, 256, 3 * 8192 + 64, dtype=np.uint8).tobytes()
    for start, length in [(0, 12287), (0, 12288), (3, 12289), (5, 12300), (1, 24576 + 7),
                          (0, len(buf))]:
        chunk = buf[start:start + length]
        assert _C.crc32c(chunk) == crc32c_ref(chunk), (start, length)


def test_crc32c_chaining_and_large_buffer():
    rng = np.random.default_rng(2)
    big = rng.integers(0, 256, 3 << 20, dtype=np.uint8)  # > 1 MiB: GIL-released path
    a, b = big[:12345].tobytes(), big[12345:40000].tobytes()
    assert _C.crc32c(b, _C.crc32c(a)) == crc32c_ref(a + b)
    assert _C.crc32c(big) == _C._crc32c_portable(big)
    assert _C.crc32c(big[:5000]) == crc32c_ref(big[:5000].tobytes())


def test_crc32c_bad_arguments():
    with pytest.raises(ValueError):
        _C.crc32c(b"x", -1)
    with pytest.raises(ValueError):
        _C.crc32c(b"x", 1 << 32)
    with pytest.raises(TypeError):
        _C.crc32c("text")


# ---- round trip and format ----------------------------------------------------------------

def test_round_trip_all_dtypes(store_path, layers):
    with ExpertStore(store_path) as s:
        assert (s.num_layers, s.num_experts, s.top_k, s.model) == (NL, NE, 2, "tiny")
        assert s.extra == {"architecture": "test", "quant": {"q4": "int4"}}
        assert s.nbytes == os.path.getsize(store_path)
        assert {t["name"]: t["dtype"] for t in s.tensors} == {
            "gate_up_proj": "F32", "down_proj": "F16", "w_bf16": "BF16", "q4": "U8",
            "scales": "F32", "i8": "I8"}
        for l in range(NL):
            for e in range(NE):
                got = s.read_expert(l, e)
                assert set(got) == set(layers[l])
                for name, arr in layers[l].items():
                    assert got[name].dtype == arr.dtype, name
                    np.testing.assert_array_equal(got[name], arr[e])
        assert s.bytes_read == NL * NE * s.block_bytes


def test_safetensors_package_reads_every_tensor(store_path, layers):
    with safe_open(str(store_path), framework="np") as f:
        keys = [k for k in f.keys() if not k.startswith("__pad__")]
        assert sorted(keys) == sorted(f"layers.{l}.experts.{e}.{n}" for l in range(NL)
                                      for e in range(NE) for n in layers[0])
        assert "specmoe" in f.metadata()
        for l in range(NL):
            for e in range(NE):
                for name, arr in layers[l].items():
                    if name == "w_bf16":
                        continue  # numpy has no bfloat16; checked through torch below
                    np.testing.assert_array_equal(f.get_tensor(f"layers.{l}.experts.{e}.{name}"),
                                                  arr[e])
    if torch is not None:
        from safetensors.torch import load_file

        d = load_file(str(store_path))
        for l in range(NL):
            for e in range(NE):
                t = d[f"layers.{l}.experts.{e}.w_bf16"]
                assert t.dtype == torch.bfloat16
                np.testing.assert_array_equal(t.view(torch.int16).numpy().view(np.uint16),
                                              layers[l]["w_bf16"][e])


def test_block_alignment_from_raw_header(store_path):
    n, h = raw_header(store_path)
    size = os.path.getsize(store_path)
    start = 8 + n
    assert start % 4096 == 0
    meta = json.loads(h.pop("__metadata__")["specmoe"])
    assert meta["format"] == "specmoe-store" and meta["version"] == 1
    bb = meta["block_bytes"]
    assert bb % 4096 == 0 and meta["data_offset"] == start
    # Tensors tile the data section exactly (what safetensors demands).
    spans = sorted(tuple(v["data_offsets"]) for v in h.values())
    assert spans[0][0] == 0 and spans[-1][1] == size - start
    for (a0, a1), (b0, b1) in zip(spans, spans[1:]):
        assert a1 == b0
    # Every block starts on a 4096 boundary, tensors at 64-byte offsets inside it.
    for l in range(NL):
        for e in range(NE):
            base = (l * NE + e) * bb
            offs = [v["data_offsets"] for k, v in h.items()
                    if k.startswith(f"layers.{l}.experts.{e}.")]
            assert min(o[0] for o in offs) == base
            assert max(o[1] for o in offs) <= base + bb
            assert (start + base) % 4096 == 0
            assert all((o[0] - base) % 64 == 0 for o in offs)
    # Checksums in the header match the block bytes (independent CRC).
    with open(store_path, "rb") as f:
        f.seek(start + (2 * NE + 4) * bb)
        assert int(meta["crc32c"][2][4], 16) == crc32c_ref(f.read(bb))


def test_direct_and_buffered_give_identical_bytes(store_path):
    with ExpertStore(store_path, direct=False) as a, ExpertStore(store_path, direct=True) as b:
        assert a.direct is False
        with open(store_path, "rb") as f:
            raw = f.read()
        for l in range(NL):
            for e in range(NE):
                x = a.read_block(l, e)
                y = b.read_block(l, e, out=aligned_empty(b.block_bytes))
                assert x.ctypes.data % 4096 == 0 and y.ctypes.data % 4096 == 0
                off = a.data_offset + (l * NE + e) * a.block_bytes
                assert x.tobytes() == y.tobytes() == raw[off:off + a.block_bytes]
        # A misaligned destination takes the buffered path and still reads correctly.
        big = aligned_empty(b.block_bytes + 8)
        mis = big[8:]
        b.read_block(1, 2, out=mis)
        np.testing.assert_array_equal(mis, a.read_block(1, 2))


def test_concurrent_reads(store_path, layers):
    s = ExpertStore(store_path, direct=True)
    errors = []

    def work(tid):
        try:
            for i in range(30):
                l, e = (i + tid) % NL, (i * 7 + tid) % NE
                np.testing.assert_array_equal(s.read_expert(l, e)["q4"], layers[l]["q4"][e])
        except Exception as exc:  # reported below
            errors.append(exc)

    ts = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors
    s.close()


def test_inputs_callable_iterator_torch(tmp_path, layers):
    p1, p2 = tmp_path / "a.smoe", tmp_path / "b.smoe"
    s1 = write_store(p1, lambda i: layers[i], num_layers=NL, dtypes={"w_bf16": "bf16"},
                     progress=False)
    s2 = write_store(p2, iter(layers), num_layers=NL, dtypes={"w_bf16": "bf16"}, progress=False)
    for l in range(NL):
        for e in range(NE):
            assert s1.read_block(l, e).tobytes() == s2.read_block(l, e).tobytes()
    with pytest.raises(ValueError, match="num_layers"):
        write_store(tmp_path / "c.smoe", iter(layers), progress=False)
    with pytest.raises(ValueError, match="num_layers"):
        write_store(tmp_path / "c.smoe", iter(layers), num_layers=NL + 1, progress=False,
                    dtypes={"w_bf16": "bf16"})
    assert sorted(os.listdir(tmp_path)) == ["a.smoe", "b.smoe"]
    if torch is not None:
        tl = [{"w": torch.randn(2, 3, 4, dtype=torch.bfloat16), "f": torch.randn(2, 5)}
              for _ in range(2)]
        s3 = write_store(tmp_path / "t.smoe", tl, progress=False)
        got = s3.read_expert(1, 1)
        assert torch.equal(torch.from_numpy(got["w"].view(np.int16)).view(torch.bfloat16),
                           tl[1]["w"][1])
        assert torch.equal(torch.from_numpy(got["f"].copy()), tl[1]["f"][1])


def test_writer_rejects_bad_layers(tmp_path, layers):
    p = tmp_path / "x.smoe"
    with pytest.raises(ValueError, match="not supported"):
        write_store(p, [{"w": np.zeros((2, 3))}], progress=False)  # float64
    with pytest.raises(ValueError, match="bf16"):
        write_store(p, [{"w": np.zeros((2, 3), np.float32)}], dtypes={"w": "bf16"},
                    progress=False)
    bad = make_layers()
    bad[1]["q4"] = bad[1]["q4"][:, :999]
    with pytest.raises(ValueError, match="layer 1"):
        write_store(p, bad, dtypes={"w_bf16": "bf16"}, progress=False)
    with pytest.raises(ValueError, match="experts"):
        write_store(p, [{"a": np.zeros((2, 3), np.float32), "b": np.zeros((3, 3), np.float32)}],
                    progress=False)
    with pytest.raises(ValueError, match="JSON"):
        write_store(p, layers, extra={"x": object()}, progress=False)
    assert os.listdir(tmp_path) == []


def test_file_mode_follows_umask(store_path):
    old = os.umask(0o022)
    os.umask(old)
    assert os.stat(store_path).st_mode & 0o777 == 0o666 & ~old


def test_crash_mid_write_leaves_old_file_intact(store_path, layers):
    before = store_path.read_bytes()

    def failing():
        yield layers[0]
        yield layers[1]
        raise RuntimeError("disk on fire")

    with pytest.raises(RuntimeError, match="disk on fire"):
        write_store(store_path, failing(), num_layers=NL, dtypes={"w_bf16": "bf16"},
                    progress=False)
    assert os.listdir(store_path.parent) == [store_path.name]
    assert store_path.read_bytes() == before
    ExpertStore(store_path).read_expert(2, 4)  # still opens and verifies


# ---- reading errors -----------------------------------------------------------------------

def test_missing_file(tmp_path):
    p = tmp_path / "nope.smoe"
    with pytest.raises(StoreError, match="nope.smoe"):
        ExpertStore(p)


@pytest.mark.parametrize("keep", [0, 5, 100, "data"])
def test_truncated_file(store_path, keep):
    data = store_path.read_bytes()
    n = len(data) - 1 if keep == "data" else keep
    store_path.write_bytes(data[:n])
    with pytest.raises(StoreError, match=str(store_path.name)):
        ExpertStore(store_path)


def test_truncated_after_open_names_block(store_path):
    s = ExpertStore(store_path)
    os.truncate(store_path, s.data_offset + 3 * s.block_bytes + 10)
    with pytest.raises(StoreError, match=r"truncated.*layer 2, expert 0"):
        s.read_block(2, 0)
    s.read_block(0, 1)  # blocks before the cut still read


def test_header_length_out_of_range(store_path):
    with open(store_path, "r+b") as f:
        f.write(struct.pack("<Q", 1 << 60))
    with pytest.raises(StoreError, match=r"experts.smoe.*header length"):
        ExpertStore(store_path)


def test_bad_json_header(store_path):
    with open(store_path, "r+b") as f:
        f.seek(8)
        f.write(b"{not json at all")
    with pytest.raises(StoreError, match=r"experts.smoe.*not valid JSON"):
        ExpertStore(store_path)


def test_foreign_safetensors_file(tmp_path):
    p = tmp_path / "plain.safetensors"
    save_file({"a": np.zeros((3, 4), np.float32)}, str(p))
    with pytest.raises(StoreError, match=r"plain.safetensors.*not a specmoe store"):
        ExpertStore(p)
    save_file({"a": np.zeros(3, np.float32)}, str(p), metadata={"other": "x"})
    with pytest.raises(StoreError, match="not a specmoe store"):
        ExpertStore(p)


def test_wrong_version(store_path):
    rewrite_meta(store_path, lambda m: m.update(version=99))
    with pytest.raises(StoreError, match=r"experts.smoe.*version 99"):
        ExpertStore(store_path)


@pytest.mark.parametrize("mutate, what", [
    (lambda m: m["tensors"][1].update(offset=m["tensors"][1]["offset"] + 8), "offset"),
    (lambda m: m["tensors"][0].update(nbytes=12), "nbytes"),
    (lambda m: m["tensors"][0].update(dtype="F64"), "dtype"),
    (lambda m: m.update(block_bytes=m["block_bytes"] + 4096), "block_bytes|truncated"),
    (lambda m: m.update(block_bytes=100), "block_bytes"),
    (lambda m: m.update(data_offset=0), "data_offset"),
    (lambda m: m.update(num_experts=NE - 1), "crc32c|disagrees"),
    (lambda m: m["crc32c"][1].pop(), "crc32c"),
    (lambda m: m["crc32c"][1].__setitem__(2, "zz"), "layer 1, expert 2"),
    (lambda m: m.update(tensors=[]), "schema"),
])
def test_inconsistent_schema(store_path, mutate, what):
    rewrite_meta(store_path, mutate)
    with pytest.raises(StoreError, match=rf"experts.smoe.*({what})"):
        ExpertStore(store_path)


def test_safetensors_entry_disagrees(store_path):
    def m(h):
        h["layers.1.experts.3.scales"]["data_offsets"][0] += 4
    rewrite_header(store_path, m)
    with pytest.raises(StoreError, match=r"layer 1, expert 3"):
        ExpertStore(store_path)


def test_flipped_byte_fails_checksum_and_verify_false_skips(store_path, layers):
    s0 = ExpertStore(store_path)
    off = s0.data_offset + (1 * NE + 3) * s0.block_bytes + 100
    s0.close()
    with open(store_path, "r+b") as f:
        f.seek(off)
        b = f.read(1)
        f.seek(off)
        f.write(bytes([b[0] ^ 0x10]))
    for direct in (False, True):
        with ExpertStore(store_path, direct=direct) as s:
            with pytest.raises(StoreError,
                               match=rf"experts.smoe.*checksum.*layer 1, expert 3.*offset {off - 100}"):
                s.read_block(1, 3)
            s.read_block(1, 2)  # neighbours are fine
    with ExpertStore(store_path, verify=False) as s:
        got = s.read_block(1, 3)
        assert got[100] == b[0] ^ 0x10
        assert s.verify is False


def test_index_errors_and_closed(store_path):
    s = ExpertStore(store_path)
    with pytest.raises(IndexError, match=f"layer {NL}"):
        s.read_block(NL, 0)
    with pytest.raises(IndexError, match="expert -1"):
        s.read_block(0, -1)
    with pytest.raises(ValueError, match="bytes"):
        s.read_block(0, 0, out=np.empty(10, np.uint8))
    with pytest.raises(ValueError):
        s.tensors_of(np.empty(10, np.uint8))
    s.close()
    s.close()  # idempotent
    assert s.closed
    with pytest.raises(StoreError, match="closed"):
        s.read_block(0, 0)


def test_low_level_store_validates_arguments(store_path):
    s = ExpertStore(store_path, verify=False)
    with pytest.raises(ValueError, match="crc"):
        _C.Store(store_path, s.data_offset, s.block_bytes, NL, NE, verify=True)
    with pytest.raises(ValueError, match="crc"):
        _C.Store(store_path, s.data_offset, s.block_bytes, NL, NE, b"\0" * 3)
    with pytest.raises(ValueError):
        _C.Store(store_path, s.data_offset, 1000, NL, NE, verify=False)
    with pytest.raises(ValueError):
        _C.Store(store_path, s.data_offset, s.block_bytes, 0, NE, verify=False)
    with pytest.raises(OverflowError):
        _C.Store(store_path, -4096, s.block_bytes, NL, NE, verify=False)
    with pytest.raises(StoreError, match="truncated"):
        _C.Store(store_path, s.data_offset, s.block_bytes, NL + 1, NE, verify=False)
    never_opened = _C.Store.__new__(_C.Store)
    assert never_opened.closed
    with pytest.raises(StoreError, match="closed"):
        never_opened.read(0, 0)
    assert isinstance(s, _C.Store) and specmoe.ExpertStore is ExpertStore


def _dir_refusing_o_direct():
    """A writable directory whose filesystem refuses O_DIRECT (ramfs, older tmpfs), if any.
    SPECMOE_TEST_NODIRECT_DIR names one explicitly (e.g. a ramfs mount)."""
    cands = [os.environ.get("SPECMOE_TEST_NODIRECT_DIR"), "/dev/shm"]
    for d in cands:
        if not d or not os.path.isdir(d) or not os.access(d, os.W_OK):
            continue
        probe = os.path.join(d, f".specmoe-probe-{os.getpid()}")
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)
        try:
            fd = os.open(probe, os.O_RDONLY | os.O_DIRECT)
        except OSError:
            return d
        else:
            os.close(fd)
        finally:
            os.unlink(probe)
    return None


def test_direct_falls_back_where_refused(layers):
    d = _dir_refusing_o_direct()
    if d is None:
        pytest.skip("no filesystem here refuses O_DIRECT (set SPECMOE_TEST_NODIRECT_DIR)")
    p = os.path.join(d, f"specmoe-test-{os.getpid()}.smoe")
    try:
        write_store(p, layers, dtypes={"w_bf16": "bf16"}, progress=False).close()
        with ExpertStore(p, direct=True) as s:
            assert s.direct is False
            for name, arr in layers[2].items():
                np.testing.assert_array_equal(s.read_expert(2, 1)[name], arr[1])
    finally:
        if os.path.exists(p):
            os.unlink(p)

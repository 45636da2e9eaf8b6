"""The slow tier: routed experts of every MoE layer in one safetensors-compatible file.

File format (``specmoe-store`` version 1)
----------------------------------------
A valid safetensors file, so any safetensors reader can open it::

    [u64 little-endian N][N bytes of JSON header, space padded][data section]

* The data section starts at ``data_offset = 8 + N``, a multiple of 4096.
* Each (layer, expert) *block* holds all tensors of that expert (weights and any quantization
  scales), is contiguous, and occupies ``block_bytes`` (a multiple of 4096) at
  ``data_offset + (layer * num_experts + expert) * block_bytes``.
* Inside a block, tensors start at 64-byte aligned offsets, in schema order.  Safetensors needs
  the tensors to tile the data section with no holes, so every gap (inside a block and at the
  end of each block) is covered by a ``U8`` padding tensor named ``__pad__.<n>``.
* Tensor names are ``layers.{l}.experts.{e}.{name}``; dtypes are F32, F16, BF16, I8, U8.
* ``__metadata__["specmoe"]`` is one JSON string (safetensors metadata values are strings)::

      {"format": "specmoe-store", "version": 1, "model": str, "num_layers": int,
       "num_experts": int, "top_k": int | null, "block_bytes": int, "data_offset": int,
       "tensors": [{"name", "dtype", "shape", "offset", "nbytes"}, ...],   # per block
       "crc32c": [["%08x" per expert] per layer],   # CRC32C of each whole padded block
       "extra": {...}}                               # free-form (architecture, quantization...)

Reading goes through the C extension (:class:`specmoe._C.Store`): ``pread`` of whole blocks,
optionally with ``O_DIRECT`` into 4096-aligned buffers, and a CRC32C check of each block read.
"""
from __future__ import annotations

import json
import math
import os
import re
import signal
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import numpy as np

from .. import _C
from .._C import StoreError

__all__ = ["ExpertStore", "write_store", "aligned_empty", "StoreError", "StorePathError",
           "check_store_target", "is_store_file", "remove_stale_temporaries", "FORMAT",
           "VERSION"]

FORMAT = "specmoe-store"
VERSION = 1
ALIGN = 4096  # block and data-section alignment (SMOE_ALIGN in csrc/common.h)
TENSOR_ALIGN = 64  # alignment of each tensor inside a block
MAX_HEADER = 100_000_000  # safetensors' own limit on the JSON header

# safetensors dtype name -> (numpy dtype used to hold it, accepted spellings)
_DTYPES: dict[str, np.dtype] = {
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"),  # numpy has no bfloat16: raw 16-bit patterns
    "I8": np.dtype("i1"),
    "U8": np.dtype("u1"),
}
_ALIASES = {
    "f32": "F32", "float32": "F32", "f16": "F16", "float16": "F16", "bf16": "BF16",
    "bfloat16": "BF16", "i8": "I8", "int8": "I8", "u8": "U8", "uint8": "U8",
}
_NATIVE = {np.dtype("float32"): "F32", np.dtype("float16"): "F16", np.dtype("int8"): "I8",
           np.dtype("uint8"): "U8"}


class StorePathError(_C.SpecmoeError, ValueError):
    """A store may not be written at this path: it names a file that is not a specmoe store
    (a checkpoint shard, a text file...), a directory, a location inside the checkpoint being
    converted, or a directory that cannot hold the store.  Raised before anything is written."""


def _round_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def aligned_empty(nbytes: int, alignment: int = ALIGN) -> np.ndarray:
    """A new uninitialised 1-D uint8 array of ``nbytes`` whose data is ``alignment``-aligned."""
    if nbytes < 0 or alignment <= 0:
        raise ValueError(f"nbytes {nbytes} must be >= 0 and alignment {alignment} > 0")
    raw = np.empty(nbytes + alignment, dtype=np.uint8)
    start = (-raw.ctypes.data) % alignment
    return raw[start:start + nbytes]


# --------------------------------------------------------------------------------------------
# writing
# --------------------------------------------------------------------------------------------

def _to_numpy(name: str, value: Any, declared: str | None) -> tuple[np.ndarray, str]:
    """Convert one layer tensor to a little-endian C-contiguous numpy array and its dtype name."""
    want = None
    if declared is not None:
        want = _ALIASES.get(str(declared).lower(), str(declared).upper())
        if want not in _DTYPES:
            raise ValueError(f"tensor {name!r}: unknown dtype {declared!r} "
                             f"(use one of f32, f16, bf16, i8, u8)")
    mod = type(value).__module__
    if mod.startswith("torch"):
        import torch  # only reached when a torch tensor was passed, so torch is importable

        t = value.detach().cpu().contiguous()
        if t.dtype == torch.bfloat16:
            if want not in (None, "BF16"):
                raise ValueError(f"tensor {name!r}: torch.bfloat16 given but dtype {want} declared")
            return t.view(torch.int16).numpy().view(np.uint16), "BF16"
        value = t.numpy()
    arr = np.asarray(value)
    if arr.dtype.byteorder == ">" or (arr.dtype.byteorder == "=" and not np.little_endian):
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    if want == "BF16":
        if arr.dtype not in (np.dtype("uint16"), np.dtype("int16")):
            raise ValueError(f"tensor {name!r}: declared bf16 needs uint16/int16 bit patterns "
                             f"(or a torch.bfloat16 tensor), got {arr.dtype}")
        arr = arr.view(np.uint16)
        got = "BF16"
    else:
        got = _NATIVE.get(np.dtype(arr.dtype.newbyteorder("=")))
        if got is None:
            raise ValueError(f"tensor {name!r}: dtype {arr.dtype} is not supported "
                             f"(f32, f16, i8, u8, or uint16 declared bf16 via dtypes=)")
        if want is not None and want != got:
            raise ValueError(f"tensor {name!r}: array dtype {arr.dtype} does not match declared "
                             f"dtype {declared!r}")
    return np.ascontiguousarray(arr), got


def _layer_source(layers: Any, num_layers: int | None) -> tuple[Iterable[Mapping[str, Any]], int]:
    if callable(layers) and not isinstance(layers, (Sequence, Mapping)) and not hasattr(
            layers, "__next__"):
        if num_layers is None:
            raise ValueError("a callable `layers` needs num_layers=")
        return (layers(i) for i in range(num_layers)), int(num_layers)
    if isinstance(layers, Mapping):
        raise TypeError("`layers` must be a sequence of per-layer dicts (one per MoE layer), "
                        "not a single dict")
    n = None
    if hasattr(layers, "__len__"):
        n = len(layers)
        if num_layers is not None and int(num_layers) != n:
            raise ValueError(f"num_layers={num_layers} but `layers` has {n} entries")
    elif num_layers is not None:
        n = int(num_layers)
    else:
        raise ValueError("an iterator `layers` needs num_layers= (the header is sized up front)")
    return iter(layers), n


def _schema_of(layer0: dict[str, tuple[np.ndarray, str]]) -> tuple[list[dict[str, Any]], int, int]:
    """Per-block schema from the first layer: tensor offsets, block_bytes, num_experts."""
    if not layer0:
        raise ValueError("layer 0 has no tensors")
    num_experts = None
    tensors = []
    off = 0
    for name, (arr, dt) in layer0.items():
        if not isinstance(name, str) or not name or name.startswith("__") or "\"" in name:
            raise ValueError(f"bad tensor name {name!r}")
        if arr.ndim < 1:
            raise ValueError(f"tensor {name!r}: needs a leading experts dimension, got a scalar")
        if num_experts is None:
            num_experts = int(arr.shape[0])
        elif arr.shape[0] != num_experts:
            raise ValueError(f"tensor {name!r}: {arr.shape[0]} experts, but other tensors have "
                             f"{num_experts}")
        shape = [int(d) for d in arr.shape[1:]]
        nbytes = int(math.prod(shape)) * _DTYPES[dt].itemsize
        off = _round_up(off, TENSOR_ALIGN)
        tensors.append({"name": name, "dtype": dt, "shape": shape, "offset": off, "nbytes": nbytes})
        off += nbytes
    if not num_experts:
        raise ValueError("num_experts must be > 0 (leading dimension of every tensor)")
    return tensors, max(ALIGN, _round_up(off, ALIGN)), num_experts


def _header_entries(tensors: list[dict[str, Any]], num_layers: int, num_experts: int,
                    block_bytes: int) -> list[tuple[str, dict[str, Any]]]:
    """Safetensors tensor entries for the whole data section, in offset order, gaps padded."""
    # Entries of one block relative to its start, padding included; reused for every block.
    local: list[tuple[str | None, str, list[int], int, int]] = []
    pos = 0
    for t in tensors:
        if t["offset"] > pos:
            local.append((None, "U8", [t["offset"] - pos], pos, t["offset"]))
        if t["nbytes"] > 0:  # zero-size tensors are recorded only in the schema
            local.append((t["name"], t["dtype"], t["shape"], t["offset"], t["offset"] + t["nbytes"]))
        pos = t["offset"] + t["nbytes"]
    if block_bytes > pos:
        local.append((None, "U8", [block_bytes - pos], pos, block_bytes))
    out = []
    npad = 0
    for l in range(num_layers):
        for e in range(num_experts):
            base = (l * num_experts + e) * block_bytes
            for name, dt, shape, b, en in local:
                if name is None:
                    key = f"__pad__.{npad}"
                    npad += 1
                else:
                    key = f"layers.{l}.experts.{e}.{name}"
                out.append((key, {"dtype": dt, "shape": shape, "data_offsets": [base + b, base + en]}))
    return out


def _encode_header(meta: dict[str, Any], entries: list[tuple[str, dict[str, Any]]]) -> bytes:
    parts = ['{"__metadata__":', json.dumps({"specmoe": json.dumps(meta, separators=(",", ":"))})]
    for key, ent in entries:
        parts.append(",")
        parts.append(json.dumps(key))
        parts.append(":")
        parts.append(json.dumps(ent, separators=(",", ":")))
    parts.append("}")
    return "".join(parts).encode("utf-8")


# --------------------------------------------------------------------------------------------
# where a store may be written

# The first bytes of the JSON header write_store writes: the specmoe record comes first in
# __metadata__ and starts with the format name.  Matched on the first bytes only, so a store
# truncated anywhere after its first few hundred bytes still counts as one (and is rebuilt).
_STORE_PREFIX = re.compile(
    rb'\s*\{\s*"__metadata__"\s*:\s*\{\s*"specmoe"\s*:\s*"\{\s*\\"format\\"\s*:\s*'
    rb'\\"specmoe-store\\"')


def is_store_file(path: str | os.PathLike[str]) -> bool:
    """Whether ``path`` is a regular file that starts with a specmoe store header (the
    safetensors header whose ``__metadata__`` holds the specmoe record): a store, possibly
    truncated or damaged past its header's first bytes.  False for anything else, a missing or
    unreadable file included."""
    try:
        with open(path, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return False
            head = f.read(8)
            if len(head) != 8:
                return False
            n = int.from_bytes(head, "little")
            if n < 2 or n > MAX_HEADER:
                return False
            raw = f.read(min(n, 1 << 16))
    except OSError:
        return False
    if _STORE_PREFIX.match(raw):
        return True
    if len(raw) < n:  # a header too long for the prefix window and not ours by its start
        return False
    try:  # another writer's key order: parse the (small) header
        md = json.loads(raw.decode("utf-8")).get("__metadata__", {})
        return json.loads(md["specmoe"]).get("format") == FORMAT
    except (ValueError, TypeError, KeyError, AttributeError, RecursionError):
        return False


def check_store_target(path: str | os.PathLike[str], *,
                       checkpoint: str | os.PathLike[str] | None = None) -> str:
    """Raise :class:`StorePathError` unless a store may be written at ``path``; return the path.

    Only a missing file, an empty file (a ``mkstemp`` placeholder: nothing to lose) or a file
    that starts with a specmoe store header (:func:`is_store_file`; a truncated or damaged store
    is rebuilt) may be replaced: never a checkpoint shard, a text file or anything else a typo
    can name.  An empty path, a directory, a dangling symbolic link or a special file is
    refused; so is any path inside ``checkpoint`` (the folder being converted, symbolic links
    resolved, at any depth).  Nothing is written or created."""
    if isinstance(path, bytes):
        path = os.fsdecode(path)
    p = os.fspath(path)
    if not isinstance(p, str) or not p.strip():
        raise StorePathError(f"the store path is empty ({path!r}): name a file, e.g. "
                             "experts.smoe")
    if checkpoint is not None:
        ck = os.path.realpath(os.fspath(checkpoint))
        real = os.path.realpath(p)
        if real == ck or real.startswith(ck.rstrip(os.sep) + os.sep):
            raise StorePathError(f"refusing to write the store to {p}: it is inside the "
                                 f"checkpoint folder {ck} (write it elsewhere, e.g. the default "
                                 "under $SPECMOE_CACHE)")
    if p.endswith(os.sep) or os.path.isdir(p):
        raise StorePathError(f"refusing to write the store to {p}: it is a directory "
                             "(name a file in it, e.g. experts.smoe)")
    if not os.path.lexists(p):
        return p
    try:
        st = os.stat(p)
    except FileNotFoundError:
        raise StorePathError(f"refusing to overwrite {p}: it is a dangling symbolic "
                             "link") from None
    except OSError as exc:
        raise StorePathError(f"refusing to overwrite {p}: cannot inspect it "
                             f"({exc.strerror or exc})") from None
    if not stat.S_ISREG(st.st_mode):
        raise StorePathError(f"refusing to overwrite {p}: it is not a regular file")
    if st.st_size and not is_store_file(p):
        raise StorePathError(f"refusing to overwrite {p}: it is not a specmoe store "
                             "(only a store, or no file, is replaced; remove it yourself or "
                             "choose another path)")
    return p


# Temporaries: write_store writes ".<name>.<8 random chars>.tmp" (tempfile.mkstemp) in the
# store's directory and holds an exclusive flock on it from creation until it is renamed or
# removed.  A process killed by SIGKILL (or a crash, power loss) cannot remove its temporary,
# which can be as large as the store; the next writer into the same directory removes the
# temporaries it can lock.  flock and not a pid file: the kernel drops a dead process's flock at
# once, while a recorded pid can be reused by an unrelated live process (the temporary would be
# kept forever) and says nothing true on another host (shared directories over NFS are out of
# scope here: flock there is at best local to each client).
_TMP_TAIL = r"\.[a-z0-9_]{8}\.tmp"
_YOUNG_EMPTY_S = 60.0  # an empty, unlocked temporary this young may be a writer in its first
# microseconds (between mkstemp and flock): left for a later run to remove


def _lock_exclusive(fd: int) -> bool:
    """Try a non-blocking exclusive flock on ``fd``; False when another open file holds it (or
    the filesystem has no flock)."""
    try:
        import fcntl
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except (ImportError, OSError):
        return False


def remove_stale_temporaries(directory: str | os.PathLike[str], name: str | None = None,
                             *, suffix: str = "") -> list[str]:
    """Remove the temporaries that killed store writers left in ``directory``: those of store
    ``name`` (``.<name>.XXXXXXXX.tmp``), or with ``name`` None every store temporary whose store
    name ends in ``suffix``.  A temporary whose writer is alive is locked (flock) and kept; so is
    a file that does not look like one of write_store's (its first 8 bytes are the zero
    placeholder, or a whole store header).  Returns the paths removed; never raises for a file
    it cannot inspect or remove."""
    d = os.fspath(directory)
    if name is not None:
        pat = re.compile(r"\." + re.escape(name) + _TMP_TAIL + r"\Z")
    else:
        pat = re.compile(r"\..+" + re.escape(suffix) + _TMP_TAIL + r"\Z")
    removed: list[str] = []
    try:
        names = os.listdir(d)
    except OSError:
        return removed
    for n in names:
        if not pat.match(n):
            continue
        p = os.path.join(d, n)
        try:
            fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or not _lock_exclusive(fd):
                continue  # a live writer's (or not a file)
            st = os.fstat(fd)  # its size now that no writer can be extending it
            if st.st_size == 0:
                if time.time() - st.st_mtime < _YOUNG_EMPTY_S:
                    continue
            else:
                head = os.pread(fd, 8, 0)
                if head != b"\0" * 8 and not is_store_file(p):
                    continue  # not one of ours
            try:
                cur = os.stat(p, follow_symlinks=False)
            except OSError:
                continue
            if (cur.st_dev, cur.st_ino) != (st.st_dev, st.st_ino):
                continue  # renamed/replaced meanwhile
            os.unlink(p)
            removed.append(p)
        except OSError:
            continue
        finally:
            os.close(fd)
    return removed


class _Terminated(BaseException):
    """SIGTERM/SIGHUP arrived while a store was being written (a BaseException, so no
    ``except Exception`` in a layer source swallows it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signum} while writing a store")
        self.signum = signum


class _RemoveOnSignal:
    """While a store is written in the main thread, SIGTERM and SIGHUP (whose default action
    ends the process at once, leaving the temporary file behind) raise :class:`_Terminated`
    instead, so write_store's cleanup removes the temporary; on the way out the previous
    handlers are restored and the signal is sent again, so the process still ends with the
    signal's conventional status.  Signals set to be ignored, or handled by the program, are
    left alone (the program's handler decides), and so is every other thread."""

    SIGNALS = tuple(getattr(signal, n) for n in ("SIGTERM", "SIGHUP") if hasattr(signal, n))

    def __init__(self) -> None:
        self.old: dict[int, Any] = {}
        self.fired: int | None = None

    def _handler(self, signum: int, frame: Any) -> None:
        if self.fired is None:  # a second signal during the cleanup must not interrupt it
            self.fired = signum
            raise _Terminated(signum)

    def __enter__(self) -> "_RemoveOnSignal":
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                try:
                    if signal.getsignal(sig) is signal.SIG_DFL:
                        self.old[sig] = signal.signal(sig, self._handler)
                except (ValueError, OSError):  # not the main interpreter, ...
                    pass
        return self

    def __exit__(self, et: Any, ev: Any, tb: Any) -> None:
        for sig, h in self.old.items():
            signal.signal(sig, h)
        self.old.clear()
        if self.fired is not None:
            os.kill(os.getpid(), self.fired)  # default action: the process ends here
            raise SystemExit(128 + self.fired)  # (only if the signal is blocked)


def write_store(path: str | os.PathLike[str], layers: Any, *, model: str = "",
                top_k: int | None = None, dtypes: Mapping[str, str] | None = None,
                extra: Mapping[str, Any] | None = None, num_layers: int | None = None,
                progress: bool = True) -> "ExpertStore":
    """Write the routed experts of a model to a specmoe store at ``path`` and open it.

    ``layers`` is one entry per MoE layer: a dict ``name -> array [num_experts, ...]`` (numpy,
    anything ``np.asarray`` accepts, or torch tensors).  It may be a sequence, an iterator or
    generator (then pass ``num_layers=``), or a callable ``layers(i) -> dict`` (with
    ``num_layers=``), so a large model never has to be in memory at once.  Every layer must
    have the same tensor names, dtypes and per-expert shapes as the first.

    ``dtypes`` declares per tensor name a dtype the array cannot express itself: ``"bf16"`` for
    uint16 bit patterns (torch.bfloat16 tensors are recognised without it).  Packed int4 is
    stored as given (u8) with its scales as separate tensors.  ``extra`` is a free-form
    JSON-serialisable dict kept in the header (architecture, activation, quantization...).

    Crash-safe: the file is written to a temporary name in the same directory, fsynced and
    renamed over ``path``; on any failure the temporary file is removed and an existing file
    at ``path`` is left untouched.  SIGTERM or SIGHUP while writing (main thread, default
    handlers) removes it too and then ends the process as the signal would have; the
    temporaries of writers killed outright (SIGKILL) are removed by the next write of the same
    store (:func:`remove_stale_temporaries`).

    Only a missing file, an empty file or a specmoe store (even a damaged one) at ``path`` is
    replaced: anything else raises :class:`StorePathError` before anything is written
    (:func:`check_store_target`).
    """
    path = check_store_target(path)
    extra_d = dict(extra or {})
    try:
        json.dumps(extra_d)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"extra must be JSON-serialisable: {exc}") from None
    if top_k is not None and (not isinstance(top_k, int) or top_k <= 0):
        raise ValueError(f"top_k must be a positive int or None, got {top_k!r}")
    dtypes = dict(dtypes or {})
    source, nl = _layer_source(layers, num_layers)
    if nl <= 0:
        raise ValueError("no layers to write")

    def convert(i: int, layer: Any) -> dict[str, tuple[np.ndarray, str]]:
        if not isinstance(layer, Mapping):
            raise TypeError(f"layer {i}: expected a dict name -> array, got {type(layer).__name__}")
        unknown = set(dtypes) - set(layer)
        if unknown and i == 0:
            raise ValueError(f"dtypes names tensors not in layer 0: {sorted(unknown)}")
        return {k: _to_numpy(f"layers.{i}.{k}", v, dtypes.get(k)) for k, v in layer.items()}

    directory = os.path.dirname(os.path.abspath(path))
    remove_stale_temporaries(directory, os.path.basename(path))
    with _RemoveOnSignal():
        _write_file(path, directory, source, nl, convert, model, top_k, extra_d, progress)
    dfd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return ExpertStore(path)


def _write_file(path: str, directory: str, source: Iterable[Any], nl: int,
                convert: Callable[[int, Any], dict[str, tuple[np.ndarray, str]]], model: str,
                top_k: int | None, extra_d: dict[str, Any], progress: bool) -> None:
    """write_store's body: the temporary file, written, locked, fsynced and renamed to ``path``
    (removed on any failure)."""
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=directory, prefix="." + os.path.basename(path) + ".",
                                   suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            # held until the file is renamed or removed: tells remove_stale_temporaries that
            # this temporary's writer is alive (the kernel drops it when the process dies)
            _lock_exclusive(f.fileno())
            os.fchmod(f.fileno(), 0o666 & ~_umask())  # mkstemp creates 0600: the usual mode
            it = iter(source)
            try:
                first = next(it)
            except StopIteration:
                raise ValueError("`layers` yielded no layers") from None
            layer = convert(0, first)
            tensors, block_bytes, ne = _schema_of(layer)
            entries = _header_entries(tensors, nl, ne, block_bytes)
            meta: dict[str, Any] = {
                "format": FORMAT, "version": VERSION, "model": str(model), "num_layers": nl,
                "num_experts": ne, "top_k": top_k, "block_bytes": block_bytes, "data_offset": 0,
                "tensors": tensors, "crc32c": [["0" * 8] * ne for _ in range(nl)],
                "extra": extra_d,
            }
            # data_offset appears in the header it follows: iterate to a fixed point (the
            # checksums are fixed-width hex, so filling them in later keeps the length).
            data_offset = ALIGN
            while True:
                meta["data_offset"] = data_offset
                hlen = len(_encode_header(meta, entries))
                need = _round_up(8 + hlen, ALIGN)
                if need <= data_offset:
                    break
                data_offset = need
            if data_offset - 8 > MAX_HEADER:
                raise ValueError(f"header of {data_offset - 8} bytes exceeds the safetensors limit")
            f.write(b"\0" * data_offset)  # placeholder header, rewritten at the end

            crcs: list[list[str]] = []
            bar = None
            if progress:
                from tqdm.auto import tqdm

                bar = tqdm(total=nl, desc=f"write {os.path.basename(path)}", unit="layer")
            try:
                i = 0
                while True:
                    if i > 0:
                        try:
                            raw = next(it)
                        except StopIteration:
                            break
                        if i >= nl:
                            raise ValueError(f"`layers` yielded more than num_layers={nl} layers")
                        layer = convert(i, raw)
                    start = f.tell()
                    crcs.append(_write_layer(f, i, layer, tensors, ne, block_bytes))
                    _drop_written(f, start)
                    if bar is not None:
                        bar.update(1)
                    i += 1
                if i != nl:
                    raise ValueError(f"`layers` yielded {i} layers, num_layers={nl}")
            finally:
                if bar is not None:
                    bar.close()
            meta["crc32c"] = crcs
            header = _encode_header(meta, entries)
            if len(header) > data_offset - 8:  # cannot happen: checksums are fixed width
                raise RuntimeError("store header grew while filling in checksums")
            header += b" " * (data_offset - 8 - len(header))
            f.seek(0)
            f.write(len(header).to_bytes(8, "little"))
            f.write(header)
            f.flush()
            os.fsync(f.fileno())
            os.replace(tmp, path)  # still open, so still locked, until it has its final name
    except BaseException as exc:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        if isinstance(exc, OSError) and exc.filename is None and exc.errno:
            # ENOSPC, EIO, EDQUOT...: same type and errno, with the store's name in it
            raise OSError(exc.errno, f"writing store: {exc.strerror}", path) from exc
        raise


def _drop_written(f: Any, start: int) -> None:
    """Write one layer's bytes out and drop them from the page cache: a store larger than
    memory is written with page cache bounded by one layer (dirty pages count against a
    memory cgroup's limit, and the data is not read back soon)."""
    f.flush()
    os.fdatasync(f.fileno())
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(f.fileno(), start, f.tell() - start, os.POSIX_FADV_DONTNEED)


def _umask() -> int:
    """The process umask, read without changing it (Linux /proc), else the common 022."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    return 0o022


def _write_layer(f: Any, i: int, layer: dict[str, tuple[np.ndarray, str]],
                 tensors: list[dict[str, Any]], ne: int, block_bytes: int) -> list[str]:
    """Write one layer's blocks at the file's current position; return their CRC32C (hex)."""
    names = [t["name"] for t in tensors]
    if sorted(layer) != sorted(names):
        raise ValueError(f"layer {i}: tensors {sorted(layer)} differ from layer 0's {sorted(names)}")
    checked = []
    for t in tensors:
        arr, dt = layer[t["name"]]
        want = (ne, *t["shape"])
        if dt != t["dtype"] or tuple(arr.shape) != want:
            raise ValueError(f"layer {i} tensor {t['name']!r}: {dt} {tuple(arr.shape)}, layer 0 "
                             f"has {t['dtype']} {want}")
        checked.append((t["offset"], t["nbytes"], arr.reshape(ne, -1).view(np.uint8)))
    # One block at a time (a layer of a large model can be gigabytes); padding stays zero.
    buf = np.zeros(block_bytes, dtype=np.uint8)
    crcs = []
    for e in range(ne):
        for off, nb, flat in checked:
            if nb:
                buf[off:off + nb] = flat[e]
        crcs.append("%08x" % _C.crc32c(buf))
        f.write(memoryview(buf))
    return crcs


# --------------------------------------------------------------------------------------------
# reading
# --------------------------------------------------------------------------------------------

MAX_JSON_DEPTH = 64  # the store header nests 5 deep; anything deeper is not ours
_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_HEX8 = re.compile(r"[0-9a-fA-F]{8}")


def _json_depth(raw: bytes) -> int:
    """Deepest ``[``/``{`` nesting of JSON text ``raw``, brackets inside strings ignored; one
    C-speed regex pass and a numpy cumulative sum, so a 100 MB header costs milliseconds."""
    bare = _JSON_STRING.sub(b"", raw)
    b = np.frombuffer(bare, dtype=np.uint8)
    step = (np.isin(b, (ord("["), ord("{"))).astype(np.int32)
            - np.isin(b, (ord("]"), ord("}"))).astype(np.int32))
    return int(np.cumsum(step).max()) if step.size else 0


def _load_json(path: str, what: str, raw: bytes) -> Any:
    """json.loads of attacker-controlled bytes, bounded: the size is bounded by the caller
    (MAX_HEADER), the nesting here (MAX_JSON_DEPTH) before parsing, so the parser can neither
    recurse past the interpreter's limit nor raise anything but StoreError."""
    if _json_depth(raw) > MAX_JSON_DEPTH:
        raise StoreError(f"{path}: {what} nests deeper than {MAX_JSON_DEPTH} levels")
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise StoreError(f"{path}: {what} is not valid JSON: {exc}") from None


def _parse_header(path: str) -> tuple[dict[str, Any], dict[str, Any], int]:
    """Read and validate the header; return (specmoe metadata, safetensors entries, file size)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 8:
                raise StoreError(f"{path}: truncated: {size} bytes, not even a header length")
            n = int.from_bytes(f.read(8), "little")
            if n < 2 or n > MAX_HEADER or n > size - 8:
                raise StoreError(f"{path}: header length {n} out of range (file has {size} bytes)")
            raw = f.read(n)
    except FileNotFoundError:
        raise StoreError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise StoreError(f"{path}: is a directory") from None
    except PermissionError as exc:
        raise StoreError(f"{path}: cannot open: {exc.strerror}") from None
    except OSError as exc:  # EIO, ELOOP, ENAMETOOLONG, ...: still this store's error
        raise StoreError(f"{path}: cannot read header: {exc.strerror or exc}") from None
    if len(raw) != n:
        raise StoreError(f"{path}: truncated: header of {n} bytes, read {len(raw)}")
    header = _load_json(path, "header", raw)
    if not isinstance(header, dict):
        raise StoreError(f"{path}: header is not a JSON object")
    md = header.get("__metadata__")
    if not isinstance(md, dict) or "specmoe" not in md:
        raise StoreError(f"{path}: not a specmoe store (safetensors file without specmoe metadata)")
    meta = (_load_json(path, "specmoe metadata", md["specmoe"].encode("utf-8", "surrogatepass"))
            if isinstance(md["specmoe"], str) else None)
    if not isinstance(meta, dict):
        raise StoreError(f"{path}: specmoe metadata is not a JSON object")
    if meta.get("format") != FORMAT:
        raise StoreError(f"{path}: not a specmoe store (format {meta.get('format')!r})")
    if meta.get("version") != VERSION:
        raise StoreError(f"{path}: unsupported specmoe store version {meta.get('version')!r} "
                         f"(this reader supports {VERSION})")
    _validate(path, meta, header, n, size)
    return meta, header, size


def _validate(path: str, meta: dict[str, Any], header: dict[str, Any], n: int, size: int) -> None:
    def bad(msg: str) -> StoreError:
        return StoreError(f"{path}: inconsistent store header: {msg}")

    def pos_int(key: str, allow_zero: bool = False) -> int:
        v = meta.get(key)
        if not isinstance(v, int) or isinstance(v, bool) or v < (0 if allow_zero else 1):
            raise bad(f"{key} = {v!r}")
        return v

    nl, ne, bb, do = (pos_int("num_layers"), pos_int("num_experts"), pos_int("block_bytes"),
                      pos_int("data_offset"))
    top_k = meta.get("top_k")
    if top_k is not None and (not isinstance(top_k, int) or isinstance(top_k, bool) or top_k <= 0):
        raise bad(f"top_k = {top_k!r}")
    if do != 8 + n:
        raise bad(f"data_offset {do} but the data section starts at {8 + n}")
    if do % ALIGN or bb % ALIGN:
        raise bad(f"data_offset {do} / block_bytes {bb} not multiples of {ALIGN}")
    if not isinstance(meta.get("extra", {}), dict):
        raise bad("extra is not an object")
    tensors = meta.get("tensors")
    if not isinstance(tensors, list) or not tensors:
        raise bad("empty or missing tensor schema")
    end = 0
    seen = set()
    for t in tensors:
        if not isinstance(t, dict):
            raise bad(f"schema entry {t!r}")
        name, dt, shape, off, nb = (t.get("name"), t.get("dtype"), t.get("shape"),
                                    t.get("offset"), t.get("nbytes"))
        if not isinstance(name, str) or not name or name in seen:
            raise bad(f"tensor name {name!r}")
        seen.add(name)
        if dt not in _DTYPES:
            raise bad(f"tensor {name!r}: dtype {dt!r}")
        if (not isinstance(shape, list)
                or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)):
            raise bad(f"tensor {name!r}: shape {shape!r}")
        if not isinstance(off, int) or not isinstance(nb, int) or off < end or off % TENSOR_ALIGN:
            raise bad(f"tensor {name!r}: offset {off!r} (previous tensor ends at {end}; "
                      f"offsets must be increasing and {TENSOR_ALIGN}-aligned)")
        if nb != math.prod(shape) * _DTYPES[dt].itemsize:
            raise bad(f"tensor {name!r}: nbytes {nb} does not match {dt} {shape}")
        end = off + nb
        if end > bb:
            raise bad(f"tensor {name!r} ends at {end}, past block_bytes {bb}")
    crc = meta.get("crc32c")
    if (not isinstance(crc, list) or len(crc) != nl
            or not all(isinstance(r, list) and len(r) == ne for r in crc)):
        raise bad(f"crc32c is not a {nl} x {ne} table")
    need = do + nl * ne * bb
    if size < need:
        raise StoreError(f"{path}: truncated: {size} bytes, but {nl} layers x {ne} experts x "
                         f"{bb}-byte blocks from offset {do} need {need}")
    # The safetensors view of the file must agree with the schema, block by block.
    for l in range(nl):
        for e in range(ne):
            base = (l * ne + e) * bb
            for t in tensors:
                if t["nbytes"] == 0:
                    continue
                key = f"layers.{l}.experts.{e}.{t['name']}"
                ent = header.get(key)
                want = [base + t["offset"], base + t["offset"] + t["nbytes"]]
                if (not isinstance(ent, dict) or ent.get("dtype") != t["dtype"]
                        or ent.get("shape") != t["shape"] or ent.get("data_offsets") != want):
                    raise bad(f"safetensors entry {key!r} = {ent!r} disagrees with the schema "
                              f"(layer {l}, expert {e}, data offset {want[0]})")


def _block_kind_of(nbytes: int) -> str:
    from .ggml_blocks import BLOCKS
    return next(k for k, (_, b) in BLOCKS.items() if b == nbytes)


class ExpertStore(_C.Store):
    """A specmoe store file opened for reading (the slow tier).

    ``ExpertStore(path, direct=False, verify=True)`` parses and validates the header and opens
    the file; ``direct=True`` asks for O_DIRECT reads (falls back to buffered reads where the
    filesystem refuses them; see :attr:`direct`), ``verify=True`` checks each block's CRC32C on
    every read.  Any problem with the file raises :class:`specmoe.StoreError` naming it.
    """

    def __init__(self, path: str | os.PathLike[str], *, direct: bool = False,
                 verify: bool = True) -> None:
        path = os.fspath(path)
        meta, _, size = _parse_header(path)
        nl, ne = meta["num_layers"], meta["num_experts"]
        crc = np.empty(nl * ne, dtype=np.uint32)
        for l, row in enumerate(meta["crc32c"]):
            for e, h in enumerate(row):
                # exactly 8 hex digits: int(h, 16) alone would take "-0000001" (OverflowError
                # in the uint32 array), " 1", "0x1" or "1_2"
                if not isinstance(h, str) or not _HEX8.fullmatch(h):
                    raise StoreError(f"{path}: inconsistent store header: crc32c entry "
                                     f"{h!r} for layer {l}, expert {e} is not 8 hex digits")
                crc[l * ne + e] = int(h, 16)
        self._meta = meta
        self._size = size
        self._tensors = [dict(t) for t in meta["tensors"]]
        super().__init__(path, meta["data_offset"], meta["block_bytes"], nl, ne, crc,
                         direct=direct, verify=verify)

    # -- header facts ---------------------------------------------------------------------
    @property
    def top_k(self) -> int | None:
        """Experts routed per token, if the writer recorded it."""
        return self._meta.get("top_k")

    @property
    def model(self) -> str:
        """Model name recorded by the writer."""
        return str(self._meta.get("model", ""))

    @property
    def tensors(self) -> list[dict[str, Any]]:
        """Per-block schema: dicts with name, dtype, shape, offset (in the block), nbytes."""
        return [dict(t, shape=list(t["shape"])) for t in self._tensors]

    @property
    def metadata(self) -> dict[str, Any]:
        """The whole specmoe metadata record from the header (a copy)."""
        return json.loads(json.dumps(self._meta))

    @property
    def extra(self) -> dict[str, Any]:
        """The writer's free-form ``extra`` dict (architecture, quantization, ...)."""
        return json.loads(json.dumps(self._meta.get("extra", {})))

    @property
    def nbytes(self) -> int:
        """Size of the store file in bytes."""
        return self._size

    @property
    def expert_nbytes(self) -> int:
        """Bytes of tensor data in one block (block_bytes minus alignment padding)."""
        return sum(t["nbytes"] for t in self._tensors)

    # -- reading ---------------------------------------------------------------------------
    def read_block(self, layer: int, expert: int, out: np.ndarray | None = None) -> np.ndarray:
        """Read block (layer, expert) as a uint8 array of ``block_bytes`` (GIL released).

        ``out`` (optional) is a writable contiguous buffer of exactly ``block_bytes``; use
        :func:`aligned_empty` so O_DIRECT can be used.  A checksum mismatch raises StoreError
        naming the file, layer, expert and offset.
        """
        return self.read(layer, expert, out)

    def read_all(self) -> np.ndarray:
        """Every block in store order in one SMOE_ALIGN-aligned uint8 buffer (block (layer, e)
        at ``(layer * num_experts + e) * block_bytes``): the layout of a resident expert
        source (``_C.moe_forward`` on a buffer, ``_C.Layers.set_lowbit``)."""
        L, E, bb = int(self.num_layers), int(self.num_experts), int(self.block_bytes)
        buf = aligned_empty(L * E * bb)
        for i in range(L * E):
            self.read_block(i // E, i % E, out=buf[i * bb:(i + 1) * bb])
        return buf

    def tensors_of(self, block: np.ndarray, layer: int | None = None) -> dict[str, np.ndarray]:
        """Views of the tensors inside a block buffer (bf16 as uint16 bit patterns).  With
        ``layer``, a GGUF block store's down matrix in that layer's own format (header extra
        ``gguf_down_kinds``: its rows packed from the tensor's start, the tensor sized for the
        largest format)."""
        b = np.asarray(block)
        if b.dtype != np.uint8 or b.ndim != 1 or b.shape[0] != self.block_bytes:
            raise ValueError(f"expected a 1-D uint8 block of {self.block_bytes} bytes, got "
                             f"{b.dtype} {b.shape}")
        out = {}
        for t in self._tensors:
            o = t["offset"]
            out[t["name"]] = b[o:o + t["nbytes"]].view(_DTYPES[t["dtype"]]).reshape(t["shape"])
        kinds = self.extra.get("gguf_down_kinds") if layer is not None else None
        if kinds is not None and "down" in out:
            from .ggml_blocks import BLOCKS
            cols, bb = BLOCKS[kinds[layer]]  # this layer's columns and bytes per block
            d = out["down"]
            n_cols = d.shape[1] * BLOCKS[_block_kind_of(d.shape[2])][0]
            out["down"] = d.reshape(-1)[:d.shape[0] * (n_cols // cols) * bb].reshape(
                d.shape[0], n_cols // cols, bb)
        return out

    def read_expert(self, layer: int, expert: int) -> dict[str, np.ndarray]:
        """Read one expert's tensors (fresh arrays; bf16 as uint16 bit patterns; a GGUF block
        store's down matrix in the layer's own format, :meth:`tensors_of`)."""
        return self.tensors_of(self.read_block(layer, expert), layer)

    def __enter__(self) -> "ExpertStore":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self.closed else ("direct" if self.direct else "buffered")
        return (f"ExpertStore({self.path!r}, {self.num_layers} layers x {self.num_experts} "
                f"experts, block {self.block_bytes} B, {state})")

"""Expert-routing traces: the record of which experts each token used in each MoE layer.

A :class:`Trace` holds one or more requests, token by token in text order:

``experts``        int16 ``[N, L, k]``: routed expert ids of token n in MoE layer l (router order;
                   the k ids of one (token, layer) row are distinct)
``weights``        float32 ``[N, L, k]`` routing weights, or ``None`` when unknown
``logits``         float32 ``[N, L, E]`` router logits, or ``None`` when not recorded
``request_starts`` int64 ``[R]``: index of the first token of each request (``[0, ...]``)
``layer_ids``      int32 ``[L]``: the model's layer number of each MoE layer (e.g. 1..26)
``num_experts``    routed experts per layer, E
``tokens``         the token strings, or ``None``
``model``          free text naming the model

On disk a trace is one ``.npz`` file (``Trace.save`` / ``Trace.load``) holding those arrays
under the same names, plus ``meta``: a JSON string with ``format`` ("specmoe-trace"),
``version`` (1), ``num_experts``, ``model`` and ``source``.  Absent optional arrays are absent
from the file.

Replay order (the simulator, the cache agreement tests and the benchmarks use it): token by
token in text order, each token through all MoE layers in order, each layer's experts in the
recorded order; every token is one forward pass.  :meth:`Trace.keys` gives that sequence as
expert keys ``layer_position * num_experts + expert``.

:func:`load_puffin` imports the CSV layout of the DeepSeek-V2-Lite routing traces shipped in
``../shared/traces/`` (header ``Layer ID,Batch Number,Token,Activated Expert IDs``, one row per
(layer, token), rows grouped by layer, gzip-compressed).
"""
from __future__ import annotations

import csv
import gzip
import io
import json
import os
import re
import zipfile
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

__all__ = ["Trace", "TraceError", "load_puffin", "load_trace", "shared_trace_dir"]

FORMAT = "specmoe-trace"
VERSION = 1


class TraceError(ValueError):
    """A trace file or trace data is malformed; the message names the file and the row."""


MAX_EXPERTS = 32768  # expert ids are stored as int16: 0..32767


def _int_array(name: str, value: object) -> np.ndarray:
    """``value`` as an integer array, checked before any cast: bools, non-numbers, and floats
    that are not whole finite numbers (1.7, NaN, inf) raise TraceError naming ``name``."""
    try:
        a = np.asarray(value)
    except (ValueError, TypeError, OverflowError) as e:
        raise TraceError(f"{name}: not an array of integers ({e})") from None
    if a.dtype.kind in "iu":
        return a
    if a.dtype.kind == "f":
        if a.size and not np.all(np.isfinite(a)):
            raise TraceError(f"{name}: non-finite value {a[~np.isfinite(a)].flat[0]} (ids "
                             f"must be integers)")
        if a.size and not np.all(a == np.floor(a)):
            raise TraceError(f"{name}: non-integer value {a[a != np.floor(a)].flat[0]} (ids "
                             f"must be integers)")
        if a.size and np.abs(a).max() >= 2.0 ** 62:
            raise TraceError(f"{name}: value {np.abs(a).max()} out of range")
        return a.astype(np.int64)
    if a.dtype.kind == "O" and a.size == 0:
        return a.astype(np.int64)
    raise TraceError(f"{name}: expected integers, got dtype {a.dtype}")


def _float_array(name: str, value: object) -> np.ndarray:
    """``value`` as float32; non-numeric dtypes raise TraceError naming ``name``."""
    try:
        a = np.asarray(value)
    except (ValueError, TypeError, OverflowError) as e:
        raise TraceError(f"{name}: not a numeric array ({e})") from None
    if a.dtype.kind not in "iuf":
        raise TraceError(f"{name}: expected numbers, got dtype {a.dtype}")
    return np.asarray(a, dtype=np.float32)


@dataclass
class Trace:
    experts: np.ndarray
    num_experts: int
    request_starts: np.ndarray = field(default_factory=lambda: np.zeros(1, np.int64))
    layer_ids: np.ndarray | None = None
    weights: np.ndarray | None = None
    logits: np.ndarray | None = None
    tokens: list[str] | None = None
    model: str = ""
    source: str = ""

    def __post_init__(self) -> None:
        # Every check runs on the values as given, before any narrowing cast: an id of 70000,
        # 1.7 or NaN is an error, never a wrapped, truncated or NaN-cast int16.
        ne = self.num_experts
        if isinstance(ne, (bool, np.bool_)) or not isinstance(ne, (int, np.integer)):
            raise TraceError(f"num_experts must be an int, got {ne!r}")
        self.num_experts = int(ne)
        if not 1 <= self.num_experts <= MAX_EXPERTS:
            raise TraceError(f"num_experts must be in 1..{MAX_EXPERTS} (ids are int16), got "
                             f"{self.num_experts}")
        ex = _int_array("experts", self.experts)
        if ex.ndim != 3:
            raise TraceError(f"experts must be [tokens, layers, k], got shape {ex.shape}")
        n, nl, k = ex.shape
        if ex.size and (ex.min() < 0 or ex.max() >= self.num_experts):
            bad = np.argwhere((ex < 0) | (ex >= self.num_experts))[0]
            raise TraceError(
                f"expert id {int(ex[tuple(bad)])} at token {bad[0]}, layer position "
                f"{bad[1]} is outside 0..{self.num_experts - 1}")
        self.experts = np.ascontiguousarray(ex, dtype=np.int16)  # range checked: exact
        if self.layer_ids is None:
            self.layer_ids = np.arange(nl, dtype=np.int32)
        li = _int_array("layer_ids", self.layer_ids)
        if li.size and (li.min() < 0 or li.max() > np.iinfo(np.int32).max):
            raise TraceError(f"layer_ids must be in 0..{np.iinfo(np.int32).max}, got "
                             f"{int(li.min())}..{int(li.max())}")
        self.layer_ids = li.astype(np.int32)
        if self.layer_ids.shape != (nl,):
            raise TraceError(f"layer_ids has shape {self.layer_ids.shape}, expected ({nl},)")
        self.request_starts = _int_array("request_starts", self.request_starts).astype(np.int64)
        rs = self.request_starts
        if n and (rs.ndim != 1 or len(rs) == 0 or rs[0] != 0 or np.any(np.diff(rs) <= 0)
                  or rs[-1] >= n):
            raise TraceError(f"request_starts must be 1-D, start at 0 and increase strictly "
                             f"below {n}: {rs.reshape(-1)[:8]}")
        if self.weights is not None:
            self.weights = _float_array("weights", self.weights)
            if self.weights.shape != self.experts.shape:
                raise TraceError(f"weights shape {self.weights.shape} != experts shape {self.experts.shape}")
        if self.logits is not None:
            self.logits = _float_array("logits", self.logits)
            if self.logits.shape != (n, nl, self.num_experts):
                raise TraceError(f"logits shape {self.logits.shape} != {(n, nl, self.num_experts)}")
        if self.tokens is not None and len(self.tokens) != n:
            raise TraceError(f"{len(self.tokens)} token strings for {n} tokens")
        _check_distinct(self.experts, self.layer_ids)

    # -- shape -------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return int(self.experts.shape[0])

    @property
    def num_layers(self) -> int:
        """Number of MoE layers (layer positions 0..num_layers-1)."""
        return int(self.experts.shape[1])

    @property
    def top_k(self) -> int:
        return int(self.experts.shape[2])

    @property
    def num_requests(self) -> int:
        return int(len(self.request_starts)) if self.num_tokens else 0

    @property
    def num_accesses(self) -> int:
        return int(self.experts.size)

    def __len__(self) -> int:
        return self.num_tokens

    def __repr__(self) -> str:
        return (f"Trace(model={self.model!r}, tokens={self.num_tokens}, requests={self.num_requests}, "
                f"layers={self.num_layers}, experts={self.num_experts}, top_k={self.top_k})")

    # -- views -------------------------------------------------------------------------------
    def keys(self) -> np.ndarray:
        """The demand access sequence in replay order as int32 keys ``layer_pos*E + expert``."""
        pos = np.arange(self.num_layers, dtype=np.int32)[None, :, None] * self.num_experts
        return np.ascontiguousarray((self.experts.astype(np.int32) + pos).reshape(-1))

    def request(self, i: int) -> "Trace":
        """Request i as a trace of its own."""
        starts = list(self.request_starts) + [self.num_tokens]
        if not 0 <= i < self.num_requests:
            raise IndexError(f"request {i} out of range 0..{self.num_requests - 1}")
        return self.slice(int(starts[i]), int(starts[i + 1]))

    def slice(self, start: int, stop: int) -> "Trace":
        """Tokens start..stop-1 (request boundaries inside the range are kept)."""
        rs = self.request_starts[(self.request_starts >= start) & (self.request_starts < stop)] - start
        if len(rs) == 0 or rs[0] != 0:
            rs = np.concatenate([[0], rs]).astype(np.int64)
        sl = slice(start, stop)
        return Trace(
            experts=self.experts[sl], num_experts=self.num_experts, request_starts=rs,
            layer_ids=self.layer_ids, weights=None if self.weights is None else self.weights[sl],
            logits=None if self.logits is None else self.logits[sl],
            tokens=None if self.tokens is None else self.tokens[sl], model=self.model,
            source=self.source)

    def sorted_rows(self) -> "Trace":
        """The same trace with each (token, layer) row's experts in ascending id (weights
        permuted with them): the order in which the live engine visits a layer's experts
        (csrc/moe.h), so a demand-only simulation of it sees the live cache's access sequence
        (Engine.replay_routing).  The recorded order's ranks are lost."""
        order = np.argsort(self.experts, axis=2, kind="stable")
        return Trace(
            experts=np.take_along_axis(self.experts, order, 2), num_experts=self.num_experts,
            request_starts=self.request_starts, layer_ids=self.layer_ids,
            weights=None if self.weights is None else np.take_along_axis(self.weights, order, 2),
            logits=self.logits, tokens=self.tokens, model=self.model, source=self.source)

    @staticmethod
    def concat(traces: Sequence["Trace"]) -> "Trace":
        """Join traces of the same model shape one after another, each keeping its requests."""
        if not traces:
            raise TraceError("concat of no traces")
        t0 = traces[0]
        for t in traces[1:]:
            if (t.num_layers, t.top_k, t.num_experts) != (t0.num_layers, t0.top_k, t0.num_experts):
                raise TraceError("concat: traces differ in layers, top_k or num_experts")
        starts, off = [], 0
        for t in traces:
            starts.extend(int(s) + off for s in t.request_starts)
            off += t.num_tokens

        def cat(name: str) -> np.ndarray | None:
            parts = [getattr(t, name) for t in traces]
            return None if any(p is None for p in parts) else np.concatenate(parts)

        toks = None if any(t.tokens is None for t in traces) else [s for t in traces for s in t.tokens]
        return Trace(experts=np.concatenate([t.experts for t in traces]), num_experts=t0.num_experts,
                     request_starts=np.asarray(starts, np.int64), layer_ids=t0.layer_ids,
                     weights=cat("weights"), logits=cat("logits"), tokens=toks, model=t0.model,
                     source=t0.source)

    # -- files -------------------------------------------------------------------------------
    def save(self, path: str | os.PathLike) -> None:
        """Write the trace as one ``.npz`` file (see the module docstring for the layout)."""
        meta = {"format": FORMAT, "version": VERSION, "num_experts": self.num_experts,
                "model": self.model, "source": self.source}
        arrays: dict[str, np.ndarray] = {
            "experts": self.experts, "request_starts": self.request_starts,
            "layer_ids": self.layer_ids, "meta": np.array(json.dumps(meta))}
        if self.weights is not None:
            arrays["weights"] = self.weights
        if self.logits is not None:
            arrays["logits"] = self.logits
        if self.tokens is not None:
            arrays["tokens"] = np.array(self.tokens, dtype=object).astype(str)
        path = os.fspath(path)
        tmp = path + ".tmp.npz"
        try:
            np.savez_compressed(tmp, **arrays)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)

    @staticmethod
    def load(path: str | os.PathLike) -> "Trace":
        """Read a trace written by :meth:`save`.

        Any problem with the file (unreadable, not a zip, truncated, corrupt compressed data,
        a missing or malformed array or metadata field, expert ids out of range or repeated
        within a (token, layer) row) raises
        :class:`TraceError` naming the file and the field; no other exception escapes for bad
        bytes.  The file is closed on every path."""
        path = os.fspath(path)
        try:
            f = open(path, "rb")
        except OSError as e:
            raise TraceError(f"{path}: cannot open ({e.strerror or e})") from None
        with f:
            try:
                z = np.load(f, allow_pickle=False)
            except _NPZ_ERRORS as e:
                raise TraceError(f"{path}: not a readable .npz trace ({type(e).__name__}: "
                                 f"{e})") from None
            if not isinstance(z, np.lib.npyio.NpzFile):
                raise TraceError(f"{path}: not a .npz archive (a single .npy array)")
            with z:
                return Trace._from_npz(path, z)

    @staticmethod
    def _from_npz(path: str, z: "np.lib.npyio.NpzFile") -> "Trace":
        names = set(z.files)
        if "meta" not in names or "experts" not in names:
            raise TraceError(f"{path}: not a specmoe trace (no meta/experts arrays)")

        def get(key: str) -> np.ndarray | None:
            if key not in names:
                return None
            try:
                return z[key]
            except _NPZ_ERRORS as e:
                raise TraceError(f"{path}: field {key!r} is damaged ({type(e).__name__}: "
                                 f"{e})") from None

        m = get("meta")
        if m is None or m.dtype.kind not in "US" or m.size != 1:
            raise TraceError(f"{path}: field 'meta' must be one JSON string, got "
                             f"{'nothing' if m is None else f'{m.dtype} {m.shape}'}")
        try:
            meta = json.loads(str(m.reshape(()).item()))
        except (ValueError, RecursionError) as e:
            raise TraceError(f"{path}: damaged trace metadata ({e})") from None
        if not isinstance(meta, dict):
            raise TraceError(f"{path}: field 'meta' is not a JSON object")
        if meta.get("format") != FORMAT or meta.get("version") != VERSION:
            raise TraceError(f"{path}: format {meta.get('format')!r} version "
                             f"{meta.get('version')!r}, expected {FORMAT!r} version {VERSION}")
        ne = meta.get("num_experts")
        if isinstance(ne, bool) or not isinstance(ne, int):
            raise TraceError(f"{path}: meta field 'num_experts' must be an int, got {ne!r}")
        model, source = meta.get("model", ""), meta.get("source", path)
        if not isinstance(model, str) or not isinstance(source, str):
            raise TraceError(f"{path}: meta fields 'model' and 'source' must be strings")
        toks = get("tokens")
        if toks is not None and toks.dtype.kind not in "US":
            raise TraceError(f"{path}: field 'tokens' must be strings, got {toks.dtype}")
        if toks is not None and toks.ndim != 1:
            raise TraceError(f"{path}: field 'tokens' must be 1-D, got shape {toks.shape}")
        rs, li = get("request_starts"), get("layer_ids")
        for key, val in (("request_starts", rs), ("layer_ids", li)):
            if val is None:
                raise TraceError(f"{path}: not a specmoe trace (no {key!r} array)")
        try:
            return Trace(experts=get("experts"), num_experts=ne, request_starts=rs, layer_ids=li, weights=get("weights"), logits=get("logits"),
                         tokens=None if toks is None else [str(s) for s in toks],
                         model=model, source=source)
        except TraceError as e:
            raise TraceError(f"{path}: {e}") from None


def _check_distinct(ex: np.ndarray, layer_ids: np.ndarray) -> None:
    """A token routes to k *distinct* experts per layer: an id repeated within one (token,
    layer) row (``[8, 8, 8, 8, 8, 8]``) is a malformed trace, not k accesses (replayed, it
    would count k-1 free hits and inflate the hit rate).  TraceError names the first such
    position and id."""
    if ex.ndim != 3 or ex.shape[2] < 2 or ex.size == 0:
        return
    s = np.sort(ex, axis=2)
    dup = s[:, :, 1:] == s[:, :, :-1]
    if not dup.any():
        return
    t, l, j = (int(i) for i in np.argwhere(dup)[0])
    raise TraceError(f"token {t}, layer position {l} (layer {int(layer_ids[l])}): expert id "
                     f"{int(s[t, l, j])} appears more than once in {ex[t, l].tolist()} (a token "
                     f"routes to {ex.shape[2]} distinct experts per layer)")


# What numpy's npz reader raises for damaged bytes (zip structure, zlib stream, .npy header;
# RuntimeError: zipfile's "encrypted, password required" when a flag bit is flipped).
_NPZ_ERRORS = (OSError, EOFError, ValueError, KeyError, TypeError, AttributeError, RuntimeError,
               OverflowError, MemoryError, zipfile.BadZipFile, zlib.error, NotImplementedError,
               RecursionError, SyntaxError, UnicodeDecodeError)


_LIST = re.compile(r"^\[\s*([0-9]+(?:\s*,\s*[0-9]+)*)\s*\]$", re.ASCII)
_LAYER = re.compile(r"^\s*([0-9]{1,9})\s*$", re.ASCII)


def _puffin_file(path: Path, num_experts: int) -> Trace:
    """One puffin CSV (or .csv.gz) file as a one-request Trace.  Every id is range-checked as
    text-parsed Python int against ``num_experts`` before the int16 array is built; every
    failure (I/O, gzip/zlib, encoding, CSV syntax, a bad row) is a TraceError naming the file
    and line."""
    opener = gzip.open if path.suffix == ".gz" else open
    by_layer: dict[int, list[list[int]]] = {}
    toks: dict[int, list[str]] = {}
    try:
        with opener(path, "rt", encoding="utf-8", newline="") as f:
            rows = csv.reader(f)
            header = next(rows, None)
            if header is None or [h.strip() for h in header] != [
                    "Layer ID", "Batch Number", "Token", "Activated Expert IDs"]:
                raise TraceError(f"{path}: unexpected header {header!r}"[:300])
            for row in rows:
                lineno = rows.line_num
                if len(row) != 4:
                    raise TraceError(f"{path}:{lineno}: expected 4 fields, got {len(row)}")
                m = _LIST.match(row[3].strip())
                if not m:
                    raise TraceError(f"{path}:{lineno}: bad expert list {row[3][:80]!r}")
                lm = _LAYER.match(row[0])
                if not lm:
                    raise TraceError(f"{path}:{lineno}: bad layer id {row[0][:80]!r}")
                layer = int(lm.group(1))
                ids = []
                for x in m.group(1).split(","):
                    x = x.strip()
                    # compare as text first: a 5000-digit id must not reach int()'s limit
                    if len(x) > 6 or int(x) >= num_experts:
                        raise TraceError(f"{path}:{lineno}: expert id {x[:20]} outside "
                                         f"0..{num_experts - 1}")
                    ids.append(int(x))
                if len(set(ids)) != len(ids):
                    d = next(i for i in ids if ids.count(i) > 1)
                    raise TraceError(f"{path}:{lineno}: expert id {d} appears more than once "
                                     f"in the row of token "
                                     f"{len(by_layer.get(layer, ()))}, layer {layer} "
                                     f"({row[3].strip()[:80]}); a token routes to distinct "
                                     f"experts")
                by_layer.setdefault(layer, []).append(ids)
                toks.setdefault(layer, []).append(row[2])
    except (OSError, EOFError, UnicodeDecodeError, csv.Error, zlib.error) as e:
        # gzip.BadGzipFile is an OSError; zlib.error comes from a corrupt deflate stream.
        raise TraceError(f"{path}: cannot read ({type(e).__name__}: {e})") from None
    if not by_layer:
        raise TraceError(f"{path}: no rows")
    layers = sorted(by_layer)
    n = len(by_layer[layers[0]])
    k = len(by_layer[layers[0]][0])
    for l in layers:
        if len(by_layer[l]) != n:
            raise TraceError(f"{path}: layer {l} has {len(by_layer[l])} tokens, layer {layers[0]} has {n}")
        if any(len(e) != k for e in by_layer[l]):
            raise TraceError(f"{path}: layer {l} has a row with other than {k} experts")
    experts = np.array([by_layer[l] for l in layers], dtype=np.int64).transpose(1, 0, 2)
    try:
        return Trace(experts=experts, num_experts=num_experts, layer_ids=np.array(layers),
                     tokens=toks[layers[0]], model="DeepSeek-V2-Lite-Chat", source=str(path))
    except TraceError as e:
        raise TraceError(f"{path}: {e}") from None


def _prompt_number(p: Path) -> tuple[int, str]:
    m = re.search(r"(\d+)", p.name)
    return (int(m.group(1)) if m else -1, p.name)


def load_puffin(path: str | os.PathLike, *, limit: int | None = None, num_experts: int = 64,
                progress: bool = False) -> Trace:
    """Import the DeepSeek-V2-Lite "puffin" routing traces (one CSV or CSV.gz per prompt).

    ``path`` is one file or a directory of ``*.csv``/``*.csv.gz`` files; files are read in
    prompt-number order and each becomes one request.  ``limit`` caps the number of files
    (None or >= 1; anything else is ValueError, as is ``num_experts`` outside 1..32768).  A
    malformed file raises :class:`TraceError` naming the file and line.
    """
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"limit must be None or an int >= 1, got {limit!r}")
    if (isinstance(num_experts, bool) or not isinstance(num_experts, int)
            or not 1 <= num_experts <= MAX_EXPERTS):
        raise ValueError(f"num_experts must be an int in 1..{MAX_EXPERTS}, got {num_experts!r}")
    p = Path(path)
    if p.is_dir():
        files = sorted([f for f in p.iterdir() if f.name.endswith((".csv", ".csv.gz"))],
                       key=_prompt_number)
        if not files:
            raise TraceError(f"{p}: no .csv or .csv.gz trace files")
    elif p.exists():
        files = [p]
    else:
        raise TraceError(f"{p}: no such file or directory")
    if limit is not None:
        files = files[:limit]
    it: Iterable[Path] = files
    if progress:
        from tqdm.auto import tqdm

        it = tqdm(files, desc="import traces", unit="file")
    return Trace.concat([_puffin_file(f, num_experts) for f in it])


def load_trace(path: str | os.PathLike, **kw) -> Trace:
    """Load a trace from a specmoe ``.npz`` file, or import a puffin CSV file/directory."""
    p = Path(path)
    if p.is_file() and p.suffix == ".npz":
        return Trace.load(p)
    return load_puffin(p, **kw)


def shared_trace_dir() -> Path:
    """The real DeepSeek-V2-Lite routing traces, ``shared/traces/deepseek-v2-lite-puffin``,
    found beside the checkout or above the working directory (the command line's and the
    benchmarks' default); the path beside the working directory when none exists (check
    ``.is_dir()``)."""
    rel = Path("shared") / "traces" / "deepseek-v2-lite-puffin"
    for base in (Path(__file__).resolve().parents[3], Path.cwd().parent,
                 Path.cwd().parent.parent):
        if (base / rel).is_dir():
            return base / rel
    return Path("..") / rel

"""Expert-routing traces: the record of which experts each token used in each MoE layer.

A :class:`Trace` holds one or more requests, token by token in text order:

``experts``        int16 ``[N, L, k]``: routed expert ids of token n in MoE layer l (router order)
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Sequence

import numpy as np

__all__ = ["Trace", "TraceError", "load_puffin", "load_trace"]

FORMAT = "specmoe-trace"
VERSION = 1


class TraceError(ValueError):
    """A trace file or trace data is malformed; the message names the file and the row."""


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
        self.experts = np.ascontiguousarray(self.experts, dtype=np.int16)
        if self.experts.ndim != 3:
            raise TraceError(f"experts must be [tokens, layers, k], got shape {self.experts.shape}")
        n, nl, k = self.experts.shape
        self.num_experts = int(self.num_experts)
        if self.num_experts <= 0:
            raise TraceError(f"num_experts must be positive, got {self.num_experts}")
        if n and (self.experts.min() < 0 or self.experts.max() >= self.num_experts):
            bad = np.argwhere((self.experts < 0) | (self.experts >= self.num_experts))[0]
            raise TraceError(
                f"expert id {int(self.experts[tuple(bad)])} at token {bad[0]}, layer position "
                f"{bad[1]} is outside 0..{self.num_experts - 1}")
        if self.layer_ids is None:
            self.layer_ids = np.arange(nl, dtype=np.int32)
        self.layer_ids = np.asarray(self.layer_ids, dtype=np.int32)
        if self.layer_ids.shape != (nl,):
            raise TraceError(f"layer_ids has shape {self.layer_ids.shape}, expected ({nl},)")
        self.request_starts = np.asarray(self.request_starts, dtype=np.int64)
        rs = self.request_starts
        if n and (rs.ndim != 1 or len(rs) == 0 or rs[0] != 0 or np.any(np.diff(rs) <= 0)
                  or rs[-1] >= n):
            raise TraceError(f"request_starts must start at 0 and increase strictly below {n}: {rs[:8]}")
        if self.weights is not None:
            self.weights = np.asarray(self.weights, dtype=np.float32)
            if self.weights.shape != self.experts.shape:
                raise TraceError(f"weights shape {self.weights.shape} != experts shape {self.experts.shape}")
        if self.logits is not None:
            self.logits = np.asarray(self.logits, dtype=np.float32)
            if self.logits.shape != (n, nl, self.num_experts):
                raise TraceError(f"logits shape {self.logits.shape} != {(n, nl, self.num_experts)}")
        if self.tokens is not None and len(self.tokens) != n:
            raise TraceError(f"{len(self.tokens)} token strings for {n} tokens")

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
        """Read a trace written by :meth:`save`."""
        path = os.fspath(path)
        try:
            z = np.load(path, allow_pickle=False)
        except (OSError, ValueError) as e:
            raise TraceError(f"{path}: not a readable .npz trace ({e})") from None
        with z:
            if "meta" not in z or "experts" not in z:
                raise TraceError(f"{path}: not a specmoe trace (no meta/experts arrays)")
            try:
                meta = json.loads(str(z["meta"]))
            except ValueError as e:
                raise TraceError(f"{path}: damaged trace metadata ({e})") from None
            if meta.get("format") != FORMAT or meta.get("version") != VERSION:
                raise TraceError(f"{path}: format {meta.get('format')!r} version "
                                 f"{meta.get('version')!r}, expected {FORMAT!r} version {VERSION}")
            get = lambda k: z[k] if k in z else None  # noqa: E731
            toks = get("tokens")
            return Trace(experts=z["experts"], num_experts=int(meta["num_experts"]),
                         request_starts=z["request_starts"], layer_ids=z["layer_ids"],
                         weights=get("weights"), logits=get("logits"),
                         tokens=None if toks is None else [str(s) for s in toks],
                         model=meta.get("model", ""), source=meta.get("source", path))


_LIST = re.compile(r"^\[\s*(\d+(?:\s*,\s*\d+)*)\s*\]$")


def _puffin_file(path: Path, num_experts: int) -> Trace:
    opener = gzip.open if path.suffix == ".gz" else open
    by_layer: dict[int, list[list[int]]] = {}
    toks: dict[int, list[str]] = {}
    try:
        with opener(path, "rt", encoding="utf-8", newline="") as f:
            rows = csv.reader(f)
            header = next(rows, None)
            if header is None or [h.strip() for h in header] != [
                    "Layer ID", "Batch Number", "Token", "Activated Expert IDs"]:
                raise TraceError(f"{path}: unexpected header {header!r}")
            for lineno, row in enumerate(rows, start=2):
                if len(row) != 4:
                    raise TraceError(f"{path}:{lineno}: expected 4 fields, got {len(row)}")
                m = _LIST.match(row[3].strip())
                if not m:
                    raise TraceError(f"{path}:{lineno}: bad expert list {row[3]!r}")
                try:
                    layer = int(row[0])
                except ValueError:
                    raise TraceError(f"{path}:{lineno}: bad layer id {row[0]!r}") from None
                by_layer.setdefault(layer, []).append([int(x) for x in m.group(1).split(",")])
                toks.setdefault(layer, []).append(row[2])
    except (OSError, EOFError, UnicodeDecodeError, gzip.BadGzipFile) as e:
        raise TraceError(f"{path}: cannot read ({e})") from None
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
    experts = np.array([by_layer[l] for l in layers], dtype=np.int16).transpose(1, 0, 2)
    return Trace(experts=experts, num_experts=num_experts, layer_ids=np.array(layers, np.int32),
                 tokens=toks[layers[0]], model="DeepSeek-V2-Lite-Chat", source=str(path))


def _prompt_number(p: Path) -> tuple[int, str]:
    m = re.search(r"(\d+)", p.name)
    return (int(m.group(1)) if m else -1, p.name)


def load_puffin(path: str | os.PathLike, *, limit: int | None = None, num_experts: int = 64,
                progress: bool = False) -> Trace:
    """Import the DeepSeek-V2-Lite "puffin" routing traces (one CSV or CSV.gz per prompt).

    ``path`` is one file or a directory of ``*.csv``/``*.csv.gz`` files; files are read in
    prompt-number order and each becomes one request.  ``limit`` caps the number of files.
    """
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

"""Routed experts -> a specmoe store: from a model in memory, or streamed from a checkpoint.

One conversion path serves :func:`specmoe.offload` (a model already loaded by transformers) and
:func:`specmoe.from_pretrained` / ``specmoe convert`` (a checkpoint folder on disk): both hand
:func:`write_experts` a function that returns the canonical f32 arrays of one expert, and it
converts them one expert at a time to the store dtype and writes the store layer by layer
(peak memory: one layer in the store dtype plus one expert in f32).

Checkpoints are read with the safetensors library's own reader (``safe_open``): one expert's
tensors at a time, never a whole layer.  Both on-disk layouts are read: per-expert tensors as
the original checkpoints store them, and transformers 5's fused ``gate_up_proj``/``down_proj``
(GPT-OSS's MXFP4 ``_blocks``/``_scales`` are dequantized on the way).

Persistent stores.  A store converted from a checkpoint records in its header a fingerprint of
the checkpoint (every shard's name, size, modification time and a SHA-256 of its safetensors
header, and of config.json) and the conversion settings (:func:`store_settings`).  :func:`open_or_convert`
reuses a store whose record matches and rebuilds, saying why, one that is missing, stale (the
checkpoint changed), foreign (not converted from this checkpoint, or with other settings),
truncated or damaged.  Opening reads the header, checks the file size and the checksums of the
first and last block of every layer: milliseconds, whatever the size.  Every block the cache
reads later is checked against its CRC32C too, so damage elsewhere raises
:class:`specmoe.StoreError` naming the block instead of computing with it.
"""
from __future__ import annotations

import hashlib
import json
import os
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

__all__ = ["Checkpoint", "CONVERT_VERSION", "default_store_path", "open_or_convert",
           "store_settings", "write_experts"]

CONVERT_VERSION = 1  # bump when the conversion of the same checkpoint would give other bytes
_HEADER_MAX = 100_000_000  # safetensors' own limit on a shard's JSON header


def _log(msg: str) -> None:
    print(f"specmoe: {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# checkpoint folders


@dataclass
class Checkpoint:
    """A local HuggingFace checkpoint folder: config.json and safetensors shards (with or
    without ``model.safetensors.index.json``).  ``keys`` maps every tensor name to its shard."""

    folder: Path
    shards: list[Path]
    keys: dict[str, Path]
    _handles: dict[Path, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> "Checkpoint":
        folder = Path(path).expanduser()
        if not folder.is_dir():
            raise FileNotFoundError(f"{folder}: not a checkpoint folder (expected a directory "
                                    "with config.json and *.safetensors shards)")
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"{folder}: no config.json")
        index = folder / "model.safetensors.index.json"
        if index.is_file():
            try:
                wm = json.loads(index.read_text())["weight_map"]
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(f"{index}: not a safetensors index ({exc})") from None
            names = sorted(set(wm.values()))
            shards = [folder / n for n in names]
            missing = [str(s.name) for s in shards if not s.is_file()]
            if missing:
                raise FileNotFoundError(f"{folder}: shards named in the index are missing: "
                                        f"{', '.join(missing[:5])}")
        else:
            shards = sorted(folder.glob("*.safetensors"))
            if not shards:
                raise FileNotFoundError(f"{folder}: no *.safetensors shards (specmoe reads "
                                        "safetensors checkpoints only)")
        keys: dict[str, Path] = {}
        for s in shards:
            for k in _shard_header(s):
                if k != "__metadata__":
                    keys[k] = s
        return cls(folder, shards, keys)

    def handle(self, shard: Path) -> Any:
        """An open ``safe_open`` reader of ``shard`` (kept until :meth:`close`)."""
        h = self._handles.get(shard)
        if h is None:
            from safetensors import safe_open
            h = safe_open(str(shard), framework="pt")
            self._handles[shard] = h
        return h

    def tensor(self, key: str) -> Any:
        """The whole tensor ``key`` (a torch tensor, read from its shard)."""
        return self.handle(self.keys[key]).get_tensor(key)

    def slice(self, key: str, index: int) -> Any:
        """``tensor(key)[index]`` without reading the rest of the tensor."""
        return self.handle(self.keys[key]).get_slice(key)[index]

    def fingerprint(self) -> dict[str, Any]:
        """Names, sizes, modification times and header digests of the shards and the digest
        of config.json.  A shard rewritten with new values but the same shapes keeps its size
        and header; its modification time is what tells (a ``touch`` also does: the store is
        then rebuilt without need, the safe side)."""
        files = []
        for s in self.shards:
            with open(s, "rb") as f:
                head = f.read(8)
                n = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
                digest = hashlib.sha256(head + f.read(min(n, _HEADER_MAX))).hexdigest()
            stat = s.stat()
            files.append([s.name, stat.st_size, stat.st_mtime_ns, digest])
        cfg = hashlib.sha256((self.folder / "config.json").read_bytes()).hexdigest()
        whole = hashlib.sha256(json.dumps([files, cfg]).encode()).hexdigest()
        return {"digest": whole, "files": files, "config": cfg}

    def close(self) -> None:
        self._handles.clear()


def _shard_header(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) != 8:
                raise ValueError("shorter than 8 bytes")
            n = struct.unpack("<Q", head)[0]
            if n > _HEADER_MAX or n > path.stat().st_size - 8:
                raise ValueError(f"header length {n} is out of range")
            h = json.loads(f.read(n))
            if not isinstance(h, dict):
                raise ValueError("header is not a JSON object")
            return h
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a safetensors file ({exc})") from None


# ---------------------------------------------------------------------------------------------
# writing experts


def write_experts(path: str, expert_f32: Callable[[int, int], dict[str, np.ndarray]], *,
                  num_layers: int, num_experts: int, dtype: str, model: str, top_k: int,
                  extra: dict[str, Any], progress: bool = True,
                  expert_bytes: int | None = None,
                  after_layer: Callable[[int], None] | None = None) -> None:
    """Write a store at ``path`` from ``expert_f32(position, expert)``, the canonical f32
    arrays of one expert (biases included), converted one expert at a time to ``dtype``.

    progress: a tqdm bar over the experts (bytes of the source read, rate, ETA);
    ``expert_bytes`` sizes it.  ``after_layer(position)`` runs once a layer is converted (offload
    uses it to free the model's expert parameters layer by layer)."""
    from .quant import expert_tensors, store_dtypes
    from .store import write_store

    bar = None
    if progress:
        from tqdm.auto import tqdm
        total = expert_bytes * num_layers * num_experts if expert_bytes else None
        bar = tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024,
                   desc=f"convert to {dtype}", file=sys.stderr, dynamic_ncols=True)
    done = [0]

    def layer(pos: int) -> dict[str, np.ndarray]:
        out: dict[str, np.ndarray] = {}
        for e in range(num_experts):
            d = expert_f32(pos, e)
            biases = {n: d[n + ".bias"] for n in ("gate", "up", "down") if n + ".bias" in d}
            t = expert_tensors(d["gate"], d["up"], d["down"], dtype, biases=biases or None)
            if not out:
                out = {n: np.empty((num_experts,) + a.shape, a.dtype) for n, a in t.items()}
            for n, a in t.items():
                out[n][e] = a
            done[0] += 1
            if bar is not None:
                bar.update(expert_bytes or 0)
                bar.set_postfix_str(f"{done[0]}/{num_layers * num_experts} experts",
                                    refresh=False)
        if after_layer is not None:
            after_layer(pos)
        return out

    try:
        first = layer(0)
        write_store(path, lambda p: first if p == 0 else layer(p), num_layers=num_layers,
                    model=model, top_k=top_k, dtypes=store_dtypes(first), extra=extra,
                    progress=False).close()
    finally:
        if bar is not None:
            bar.close()


def store_settings(config: Any, arch: Any, layer_ids: Iterable[int], dtype: str) -> dict[str, Any]:
    """What, besides the checkpoint's tensors, decides a store's bytes and how the kernels run
    it; kept in the store header's ``extra`` (the Engine reads activation, alpha and limit from
    there)."""
    gptoss = bool(arch.gptoss)
    return {"convert_version": CONVERT_VERSION, "dtype": dtype, "layer_ids": list(layer_ids),
            "architecture": arch.model_type, "activation": arch.activation,
            "alpha": float(getattr(config, "swiglu_alpha", 1.702)) if gptoss else 1.702,
            "limit": float(getattr(config, "swiglu_limit", 7.0)) if gptoss else 7.0}


# ---------------------------------------------------------------------------------------------
# persistent stores


def cache_dir() -> Path:
    """``$SPECMOE_CACHE`` if set, else ``~/.cache/specmoe``."""
    env = os.environ.get("SPECMOE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "specmoe"


def default_store_path(folder: str | os.PathLike[str], dtype: str) -> Path:
    """Where the store of checkpoint ``folder`` in ``dtype`` lives by default: one file per
    (checkpoint location, dtype) in :func:`cache_dir`; its header says what it was made from."""
    f = Path(folder).expanduser().resolve()
    tag = hashlib.sha256(str(f).encode()).hexdigest()[:12]
    return cache_dir() / f"{f.name}-{tag}-{dtype}.smoe"


def check_store(path: Path, fingerprint: dict[str, Any],
                settings: dict[str, Any]) -> str | None:
    """None when the store at ``path`` was converted from this checkpoint with these settings
    and passes the open-time checks; else why it cannot be used."""
    from .store import ExpertStore, StoreError

    if not path.exists():
        return "no store yet"
    try:
        st = ExpertStore(path, verify=True)
    except StoreError as exc:
        return f"the store is truncated or damaged ({exc})"
    try:
        src = st.extra.get("source")
        if not isinstance(src, dict) or "fingerprint" not in src:
            return "the file is not a store converted from a checkpoint (foreign)"
        old = src["fingerprint"]
        if old.get("digest") != fingerprint["digest"]:
            return "the checkpoint changed since the store was written (stale): " + \
                _what_changed(old, fingerprint)
        stored = {k: st.extra.get(k) for k in settings}
        if stored != settings:
            diff = {k: (stored[k], v) for k, v in settings.items() if stored[k] != v}
            return f"the store was converted with other settings (stored, wanted): {diff}"
        # cheap spot check of the data: the first and last block of every layer
        for layer in range(st.num_layers):
            for e in {0, st.num_experts - 1}:
                st.read_block(layer, e)
    except StoreError as exc:
        return f"the store is damaged ({exc})"
    except (TypeError, AttributeError, KeyError) as exc:
        return f"the store's source record is malformed ({exc!r})"
    finally:
        st.close()
    return None


def _what_changed(old: dict[str, Any], new: dict[str, Any]) -> str:
    if old.get("config") != new.get("config"):
        return "config.json differs"
    o = {f[0]: f[1:] for f in old.get("files", [])}
    n = {f[0]: f[1:] for f in new.get("files", [])}
    for name in sorted(set(o) | set(n)):
        if name not in o:
            return f"new shard {name}"
        if name not in n:
            return f"shard {name} is gone"
        if o[name] != n[name]:
            return f"shard {name} differs"
    return "fingerprint differs"


def open_or_convert(store: Path, fingerprint: dict[str, Any], settings: dict[str, Any],
                    convert: Callable[[Path, dict[str, Any]], None], *,
                    force: bool = False, verbose: bool = True) -> bool:
    """Make sure ``store`` holds the experts described by (fingerprint, settings): reuse it
    when it does, else call ``convert(path, extra)`` to (re)write it, ``extra`` being the
    header record to write (the settings and the source fingerprint).  Returns True when it
    converted."""
    why = "rebuild requested" if force else check_store(store, fingerprint, settings)
    if why is None:
        return False
    if verbose:
        _log(f"converting the experts to {store} ({why})")
    store.parent.mkdir(parents=True, exist_ok=True)
    convert(store, dict(settings, source={"fingerprint": fingerprint}))
    return True

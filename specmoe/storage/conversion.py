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

import functools
import hashlib
import json
import os
import struct
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from .._C import SpecmoeError

__all__ = ["Checkpoint", "CheckpointError", "CONVERT_VERSION", "default_store_path",
           "open_checkpoint", "store_dtype", "StoredExpert", "open_or_convert",
           "store_settings", "write_experts", "check_store_location", "expert_block_bytes"]

CONVERT_VERSION = 1  # bump when the conversion of the same checkpoint would give other bytes
_HEADER_MAX = 100_000_000  # safetensors' own limit on a shard's JSON header

# safetensors dtypes that hold integers: where a float weight belongs (an expert projection, a
# dense float parameter) one of these is refused rather than reinterpreted or cast
INT_DTYPES = frozenset({"BOOL", "U8", "I8", "U16", "I16", "U32", "I32", "U64", "I64"})


class CheckpointError(SpecmoeError, ValueError):
    """A checkpoint folder cannot be used as it is: a shard truncated, inconsistent or unreadable,
    config.json not JSON, a tensor of the wrong dtype, a weight with NaN or inf.  The message
    names the file (and the tensor, layer and expert where one is at fault)."""


def _log(msg: str) -> None:
    print(f"specmoe: {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# checkpoint folders

# AWQ (AutoAWQ's gemm layout) packs eight output columns per int32 with bits 4i holding column
# AWQ_ORDER[i] = (0, 2, 4, 6, 1, 3, 5, 7)[i]; column j of the eight sits at bits 4 * this[j].
_AWQ_REVERSE_ORDER = (0, 4, 1, 5, 2, 6, 3, 7)


@dataclass
class Checkpoint:
    """A local HuggingFace checkpoint folder: config.json and safetensors shards (with or
    without ``model.safetensors.index.json``).  ``keys`` maps every tensor name to its shard."""

    folder: Path
    shards: list[Path]
    keys: dict[str, Path]
    _handles: dict[Path, Any] = field(default_factory=dict, repr=False)
    dtypes: dict[str, str] = field(default_factory=dict, repr=False)  # key -> safetensors dtype
    # FP8 checkpoints (config.json quantization_config quant_method "fp8", DeepSeek-V3/R1 and
    # the Qwen3 FP8 releases): e4m3 weights with an f32 ``weight_scale_inv`` per block
    fp8_block: tuple[int, int] | None = None
    scale_of: dict[str, str] = field(default_factory=dict, repr=False)  # weight -> its scales
    # GPTQ int4 checkpoints (quant_method "gptq", bits 4): "<prefix>.weight" is read from
    # <prefix>.qweight / .qzeros / .scales / .g_idx (a weight the shards do not hold)
    gptq: dict[str, Any] = field(default_factory=dict, repr=False)  # settings
    gptq_of: dict[str, str] = field(default_factory=dict, repr=False)  # weight -> prefix

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> "Checkpoint":
        folder = Path(path).expanduser()
        if not folder.is_dir():
            raise FileNotFoundError(f"{folder}: not a checkpoint folder (expected a directory "
                                    "with config.json and *.safetensors shards)")
        if not (folder / "config.json").is_file():
            raise FileNotFoundError(f"{folder / 'config.json'}: missing (not a HuggingFace "
                                    "checkpoint folder)")
        qcfg = _check_config(folder / "config.json").get("quantization_config")
        qcfg = qcfg if isinstance(qcfg, dict) else {}
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
        dtypes: dict[str, str] = {}
        for s in shards:
            for k, ent in _shard_header(s).items():
                if k != "__metadata__":
                    keys[k] = s
                    dtypes[k] = str(ent.get("dtype"))
        ck = cls(folder, shards, keys, dtypes=dtypes)
        ck._read_fp8(folder / "config.json", qcfg)
        ck._read_gptq(folder / "config.json", qcfg)
        return ck

    def _read_gptq(self, config: Path, q: dict[str, Any]) -> None:
        """Packed 4-bit weights, GPTQ or AWQ.  For each ``<prefix>.qweight`` the weight
        ``<prefix>.weight`` [out, in] = scales[g[k], o] * (q[k, o] - zero[g[k], o]), read from:

        * GPTQ (AutoGPTQ / GPTQModel / optimum): ``qweight`` int32 [in/8, out] (eight 4-bit
          values per int32 along the input, value j at bits 4j), ``qzeros`` int32
          [groups, out/8] (likewise along the output; stored as zero - 1 in the original
          ``gptq`` format, as they are in ``gptq_v2``), ``scales`` f16 [groups, out] and
          ``g_idx`` [in] (each input column's group; act-order permutes it).
        * AWQ (AutoAWQ's ``gemm`` version, the one transformers and vLLM read): ``qweight``
          int32 [in, out/8] and ``qzeros`` int32 [groups, out/8], eight values along the
          output per int32 in AWQ's order (bits 4i hold column AWQ_ORDER[i] of the eight),
          zeros as they are; ``scales`` f16 [groups, out]; groups in column order.

        ``q``: config.json's quantization_config."""
        packed = [k for k in self.keys if k.endswith(".qweight")]
        method = q.get("quant_method")
        if method not in ("gptq", "awq"):
            if packed:
                raise CheckpointError(f"{self.keys[packed[0]]}: tensor {packed[0]} is a packed "
                                      f"quantized weight but config.json's quantization_config "
                                      f"says {method!r}; GPTQ and AWQ int4 and FP8 are read")
            return
        name = method.upper()
        if q.get("bits", q.get("w_bit")) != 4:
            raise CheckpointError(f"{config}: {name} with bits="
                                  f"{q.get('bits', q.get('w_bit'))!r}: only 4-bit {name} is read")
        group = int(q.get("group_size", q.get("q_group_size", 128)))
        if method == "awq":
            version = str(q.get("version", "gemm")).lower()
            if version != "gemm":
                raise CheckpointError(f"{config}: AWQ version {q.get('version')!r}: only the "
                                      "'gemm' layout (AutoAWQ's default, what transformers "
                                      "and vLLM read) is read")
            if not q.get("zero_point", True):
                raise CheckpointError(f"{config}: AWQ with zero_point=false is not read (its "
                                      "layout is not published)")
            self.gptq = {"method": "awq", "group_size": group, "v1": False, "sym": False,
                         "desc_act": False}
        else:
            fmt = q.get("checkpoint_format", "gptq")
            self.gptq = {"method": "gptq", "group_size": group, "v1": fmt != "gptq_v2",
                         "sym": bool(q.get("sym", True)), "desc_act": bool(q.get("desc_act"))}
        for k in packed:
            prefix = k[:-len(".qweight")]
            need = [prefix + n for n in (".qzeros", ".scales")]
            missing = [n for n in need if n not in self.keys]
            if missing:
                raise CheckpointError(f"{self.keys[k]}: {name} weight {k} lacks {missing[0]}")
            w = prefix + ".weight"
            self.keys[w] = self.keys[k]
            self.dtypes[w] = f"{name}-int4"
            self.gptq_of[w] = prefix

    @functools.cached_property
    def mxfp4(self) -> bool:
        """Whether the routed experts are GPT-OSS's MXFP4 ``_blocks`` / ``_scales`` (the keys
        are read once, at open: computed on first use, then kept)."""
        return any(k.endswith("mlp.experts.gate_up_proj_blocks") for k in self.keys)

    def mxfp4_blocks(self, blocks_key: str, scales_key: str, index: int) -> Any:
        """Expert ``index`` of a GPT-OSS MXFP4 tensor as MXFP4 blocks uint8 [out, in/32, 17],
        repacked, not re-quantized (:func:`specmoe.storage.ggml_blocks.mxfp4_from_hf`)."""
        from .ggml_blocks import mxfp4_from_hf

        return mxfp4_from_hf(self.slice(blocks_key, index).numpy(),
                             self.slice(scales_key, index).numpy())

    def kept_blocks(self, dtype: str) -> str | None:
        """``"GPTQ"`` / ``"AWQ"`` / ``"MXFP4"`` when a store in ``dtype`` can take this
        checkpoint's experts without re-quantizing, else None:

        * int4: symmetric 4-bit GPTQ (every zero point 8, so w = (q - 8) * scale, specmoe's
          int4) without act-order, in groups of 32, 64 or a multiple of 128 (the groups the
          int4 kernels run fast);
        * ``"gguf"``: asymmetric 4-bit groups (AWQ, GPTQ with sym=false) in column order, in
          groups of a multiple of 32 (or one per row), as Q4_1 blocks
          (:func:`specmoe.storage.ggml_blocks.q4_1_from_groups`); GPT-OSS's MXFP4 experts as
          MXFP4 blocks (:func:`specmoe.storage.ggml_blocks.mxfp4_from_hf`)."""
        if dtype == "gguf" and self.mxfp4:
            return "MXFP4"
        if not self.gptq_of:
            return None
        g = self.gptq.get("group_size", 0)
        name = self.gptq["method"].upper()
        if dtype == "int4":
            ok = (self.gptq["sym"] and not self.gptq["desc_act"]
                  and (g in (32, 64) or (g > 0 and g % 128 == 0)))
            return name if ok else None
        if dtype == "gguf":
            return name if self.block_kinds()[0] is not None else None
        return None

    def block_kinds(self) -> tuple[dict[str, Any] | None, str]:
        """How a ``"gguf"`` store keeps this checkpoint's experts (the interface of
        :meth:`specmoe.storage.gguf.GgufCheckpoint.block_kinds`): Q4_1 for asymmetric 4-bit
        GPTQ / AWQ in column order and groups of a multiple of 32, MXFP4 for GPT-OSS's MXFP4
        experts, or ``(None, why not)``."""
        if self.mxfp4:
            return {"gate_up": "mxfp4", "down": "mxfp4", "down_layers": None}, ""
        if not self.gptq_of:
            return None, "its experts are not packed 4-bit (GPTQ / AWQ) weights"
        name, g = self.gptq["method"].upper(), self.gptq["group_size"]
        if self.gptq["desc_act"]:
            return None, f"its {name} groups follow act-order, not the columns"
        if self.gptq["sym"]:
            return None, (f"its {name} weights are symmetric: the int4 store keeps them "
                          "(dtype='int4')")
        if g > 0 and g % 32:
            return None, f"its {name} groups of {g} columns are not whole Q4_1 blocks of 32"
        return {"gate_up": "q4_1", "down": "q4_1", "down_layers": None}, ""

    def kept_group(self) -> int:
        """The int4 group size of a store that keeps this checkpoint's blocks."""
        return int(self.gptq["group_size"])

    def expert_int4(self, key: str, index: int | None = None) -> tuple[Any, Any]:
        """GPTQ weight ``key`` in specmoe's int4 layout without dequantizing: (packed uint8
        [out, in/2], columns 2j and 2j+1 in the low and high nibble of byte j; scales f32
        [out, in/group]).  CheckpointError if a zero point is not 8 or the groups are not in
        column order."""
        import numpy as np

        prefix = self.gptq_of[key]
        q, z, sc, g = self._gptq_parts(key, index)
        where = f"{self.keys[prefix + '.qweight']}: GPTQ weight {key}"
        if not bool((z == 8).all()):
            raise CheckpointError(f"{where}: zero points other than 8 although the config says "
                                  "sym; convert with dtype='int8' or 'bf16' to dequantize it")
        self._check_column_order(key, g)
        u = q.t().contiguous().numpy().astype(np.uint8)  # [out, in]
        return (u[:, 0::2] | (u[:, 1::2] << 4)).astype(np.uint8), \
            np.ascontiguousarray(sc.t().numpy(), dtype=np.float32)

    def expert_blocks(self, key: str, index: int | None = None) -> Any:
        """Asymmetric 4-bit weight ``key`` (GPTQ / AWQ; expert ``index`` of a stacked one) as
        Q4_1 blocks uint8 [out, in/32, 20], repacked, not re-quantized
        (:func:`specmoe.storage.ggml_blocks.q4_1_from_groups`)."""
        import numpy as np

        from .ggml_blocks import q4_1_from_groups

        q, z, sc, g = self._gptq_parts(key, index)
        self._check_column_order(key, g)
        n_in = q.shape[-2]
        group = n_in // sc.shape[-2]
        return q4_1_from_groups(q.t().numpy().astype(np.uint8), z.t().numpy().astype(np.float32),
                                sc.t().numpy(), group)

    def _check_column_order(self, key: str, g: Any) -> None:
        import torch

        gs = self.gptq["group_size"]
        n_in = int(g.shape[-1])
        if not bool((g == torch.arange(n_in) // (gs if gs > 0 else n_in)).all()):
            raise CheckpointError(f"{self.keys[self.gptq_of[key] + '.qweight']}: "
                                  f"{self.gptq['method'].upper()} weight {key}: g_idx is not in "
                                  "column order (act-order)")

    def _gptq_parts(self, w: str, index: int | None = None) -> tuple[Any, Any, Any, Any]:
        """Packed 4-bit weight ``w`` (expert ``index`` of a stacked one) unpacked: the 4-bit
        values q [in, out], the zero points [groups, out], the f32 scales [groups, out] and
        each input column's group [in] (g_idx, or column order when the file has none)."""
        import torch

        prefix = self.gptq_of[w]

        def get(name: str) -> Any:
            key = prefix + name
            h = self.handle(self.keys[key])
            return h.get_tensor(key) if index is None else h.get_slice(key)[index]

        qw, qz, sc = get(".qweight"), get(".qzeros"), get(".scales").float()
        shifts = torch.arange(0, 32, 4, dtype=torch.int32)
        if self.gptq["method"] == "awq":  # eight values along the output, in AWQ's order
            pos = shifts[list(_AWQ_REVERSE_ORDER)]  # the bits of output column j of eight

            def along_out(t: Any) -> Any:
                v = (t.unsqueeze(-1) >> pos) & 15  # [..., rows, out/8, 8]
                return v.reshape(*t.shape[:-1], t.shape[-1] * 8)

            q, z = along_out(qw), along_out(qz)
        else:
            q = ((qw.unsqueeze(-2) >> shifts[:, None]) & 15)  # [in/8, 8, out]
            q = q.reshape(*qw.shape[:-2], qw.shape[-2] * 8, qw.shape[-1])  # [in, out]
            z = ((qz.unsqueeze(-1) >> shifts) & 15).reshape(*qz.shape[:-1], qz.shape[-1] * 8)
            if self.gptq["v1"]:
                z = z + 1
        n_in = q.shape[-2]
        if prefix + ".g_idx" in self.keys:
            g = get(".g_idx").long()
        else:
            gs = self.gptq["group_size"]
            g = torch.arange(n_in) // (gs if gs > 0 else n_in)
        if sc.shape[-2] <= int(g.max()) or z.shape[-1] != sc.shape[-1] or \
                sc.shape[-1] != q.shape[-1] or z.shape[-2] != sc.shape[-2]:
            raise CheckpointError(f"{self.keys[prefix + '.qweight']}: "
                                  f"{self.gptq['method'].upper()} tensors of {prefix} "
                                  f"do not fit: qweight {tuple(qw.shape)}, qzeros "
                                  f"{tuple(qz.shape)}, scales {tuple(sc.shape)}")
        return q, z, sc, g

    def _gptq(self, w: str, index: int | None = None) -> Any:
        """The f32 weight ``w`` of a GPTQ layer (expert ``index`` of a stacked one)."""
        q, z, sc, g = self._gptq_parts(w, index)
        w_t = (q.float() - z[..., g, :].float()) * sc[..., g, :]  # [in, out]
        return w_t.transpose(-1, -2).contiguous()

    def _read_fp8(self, config: Path, q: dict[str, Any]) -> None:
        """FP8 block quantization: each F8_E4M3 ``*.weight`` with a ``*.weight_scale_inv``
        beside it is read as e4m3 times the scale of its block (the scales are not model
        tensors, :meth:`tensor` applies them).  ``q``: config.json's quantization_config."""
        f8 = [k for k, d in self.dtypes.items() if d.startswith("F8_")]
        if not f8:
            return
        if q.get("quant_method") != "fp8":
            raise CheckpointError(f"{self.keys[f8[0]]}: tensor {f8[0]} is {self.dtypes[f8[0]]} "
                                  "but config.json has no fp8 quantization_config (its scales "
                                  "are unknown)")
        bs = q.get("weight_block_size") or [128, 128]
        if not (isinstance(bs, list) and len(bs) == 2 and all(isinstance(b, int) and b > 0
                                                               for b in bs)):
            raise CheckpointError(f"{config}: quantization_config.weight_block_size {bs!r} is "
                                  "not two positive integers")
        self.fp8_block = (bs[0], bs[1])
        for k in f8:
            sk = k[:-len("weight")] + "weight_scale_inv" if k.endswith("weight") else None
            if sk is None or sk not in self.keys:
                raise CheckpointError(f"{self.keys[k]}: FP8 tensor {k} has no {sk or 'scale'} "
                                      "beside it")
            self.scale_of[k] = sk

    def companions(self) -> set[str]:
        """Keys that are not model tensors but data of another key (FP8 block scales, GPTQ's
        packed tensors)."""
        parts = {p + n for p in self.gptq_of.values()
                 for n in (".qweight", ".qzeros", ".scales", ".g_idx")}
        return set(self.scale_of.values()) | parts

    def _fp8(self, key: str, w: Any, s: Any) -> Any:
        """e4m3 ``w`` [..., rows, cols] times its block scales ``s`` [..., rows/b0, cols/b1]
        (rounded up), in f32."""
        b0, b1 = self.fp8_block  # type: ignore[misc]
        r, c = w.shape[-2], w.shape[-1]
        if tuple(s.shape[-2:]) != (-(-r // b0), -(-c // b1)):
            raise CheckpointError(f"{self.keys[key]}: {self.scale_of[key]} has shape "
                                  f"{tuple(s.shape)}, {key} {tuple(w.shape)} in blocks of "
                                  f"{b0}x{b1} needs {(-(-r // b0), -(-c // b1))}")
        full = s.float().repeat_interleave(b0, dim=-2)[..., :r, :]
        full = full.repeat_interleave(b1, dim=-1)[..., :c]
        return w.float() * full

    def handle(self, shard: Path) -> Any:
        """An open ``safe_open`` reader of ``shard`` (kept until :meth:`close`)."""
        h = self._handles.get(shard)
        if h is None:
            from safetensors import safe_open
            try:
                h = safe_open(str(shard), framework="pt")
            except Exception as exc:  # SafetensorError (no file name in it), OSError
                raise CheckpointError(f"{shard}: cannot read this safetensors shard: "
                                      f"{exc}") from exc
            self._handles[shard] = h
        return h

    def tensor(self, key: str, dtype: Any = None) -> Any:
        """The whole tensor ``key`` (a torch tensor, read from its shard; a float one cast to
        ``dtype`` when given)."""
        shard = self.keys[key]
        if key in self.gptq_of:
            t = self._gptq(key)
            return t.to(dtype) if dtype is not None else t
        h = self.handle(shard)
        try:
            t = h.get_tensor(key)
            if key in self.scale_of:
                sk = self.scale_of[key]
                t = self._fp8(key, t, self.handle(self.keys[sk]).get_tensor(sk))
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"{shard}: cannot read tensor {key}: {exc}") from exc
        return t.to(dtype) if dtype is not None and t.is_floating_point() else t

    def slice(self, key: str, index: int) -> Any:
        """``tensor(key)[index]`` without reading the rest of the tensor."""
        shard = self.keys[key]
        if key in self.gptq_of:
            return self._gptq(key, index)
        h = self.handle(shard)
        try:
            t = h.get_slice(key)[index]
            if key in self.scale_of:
                sk = self.scale_of[key]
                t = self._fp8(key, t, self.handle(self.keys[sk]).get_slice(sk)[index])
            return t
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"{shard}: cannot read tensor {key}[{index}]: {exc}") from exc

    def nbytes(self, key: str) -> int:
        """Bytes of tensor ``key`` in its shard."""
        if key in self.gptq_of:
            return sum(self.nbytes(self.gptq_of[key] + n) for n in (".qweight", ".scales"))
        h = self.handle(self.keys[key]).get_slice(key)
        size = {"F32": 4, "BF16": 2, "F16": 2, "U8": 1, "I8": 1, "F8_E4M3": 1}.get(
            h.get_dtype(), 4)
        return int(np.prod(h.get_shape())) * size

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


def open_checkpoint(path: str | os.PathLike[str]) -> Any:
    """The checkpoint at ``path``: a :class:`Checkpoint` for a safetensors folder, a
    :class:`specmoe.storage.gguf.GgufCheckpoint` for a GGUF file (``*.gguf``)."""
    from .gguf import GgufCheckpoint, is_gguf

    p = Path(path).expanduser()
    if p.suffix.lower() == ".gguf" or is_gguf(p):
        return GgufCheckpoint.open(p)
    return Checkpoint.open(p)


def store_dtype(ckpt: Any, dtype: str, *, quiet: bool = False) -> str:
    """The store dtype ``dtype`` means for checkpoint ``ckpt``: itself, or for ``"auto"`` bf16
    (a safetensors folder), int4 (a symmetric GPTQ folder), ``"gguf"`` with Q4_1 blocks (an
    AWQ or asymmetric GPTQ folder, :meth:`Checkpoint.block_kinds`) or MXFP4 blocks (GPT-OSS's
    MXFP4 experts) or for a GGUF file its blocks kept as they are where the kernels read them
    (``"gguf"`` for Q8_0 / Q2_K-Q6_K / Q4_0 / Q4_1 / IQ4_XS / MXFP4,
    :meth:`specmoe.storage.gguf.GgufCheckpoint.block_kinds`), else the dtype nearest to its
    experts' type (:func:`specmoe.storage.gguf.natural_dtype`), said in one line.
    ``"gguf"`` asked of anything else is a ValueError saying why.  ``quiet``: the same answer
    without the line (a check made before the call that says it, as the command line's)."""
    say = (lambda msg: None) if quiet else _log
    from .quant import DTYPES
    from .gguf import GgufCheckpoint, natural_dtype
    if dtype == "gguf":
        if not isinstance(ckpt, GgufCheckpoint) and not ckpt.gptq_of and not ckpt.mxfp4:
            raise ValueError(f"dtype='gguf' keeps a GGUF file's expert blocks (or an "
                             "asymmetric GPTQ / AWQ checkpoint's as Q4_1, GPT-OSS's MXFP4 as "
                             f"they are); {ckpt.folder} is none of them")
        kinds, why = ckpt.block_kinds()
        if kinds is None:
            raise ValueError(f"dtype='gguf': {ckpt.folder} cannot be kept as it is: {why}; "
                             f"use dtype='auto' (re-quantized) or int8/int4")
        return dtype
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"dtype {dtype!r} not supported; choose one of "
                             f"{('auto',) + DTYPES + ('gguf',)}")
        return dtype
    if isinstance(ckpt, Checkpoint):
        if ckpt.mxfp4:
            say(f"{ckpt.folder}: GPT-OSS MXFP4 experts: the store keeps them as MXFP4 blocks "
                "of 32, repacked, not re-quantized (dtype='auto' -> 'gguf')")
            return "gguf"
        if ckpt.gptq_of:  # 4-bit GPTQ / AWQ: kept where they map as they are
            name = ckpt.gptq["method"].upper()
            if ckpt.kept_blocks("gguf"):
                g = ckpt.kept_group()
                say(f"{ckpt.folder}: {name} 4-bit experts (asymmetric, "
                    f"{f'groups of {g}' if g > 0 else 'one group per row'}): the store keeps "
                    "them as Q4_1 blocks of 32, "
                    "repacked, not re-quantized (values and scales as they are, the offset "
                    "-zero * scale rounded to f16) (dtype='auto' -> 'gguf')")
                return "gguf"
            how = (f"in groups of {ckpt.kept_group()}, repacked, not re-quantized"
                   if ckpt.kept_blocks("int4") else
                   "re-quantized (its act-order groups do not map onto it as they are)"
                   if ckpt.gptq["desc_act"] else
                   f"re-quantized (its groups of {ckpt.kept_group()} do not map onto it as "
                   "they are)")
            say(f"{ckpt.folder}: {name} 4-bit experts: the store holds them as int4, {how} "
                "(dtype='auto')")
            return "int4"
        return "bf16"
    qt = ckpt.expert_type()
    kinds, why = ckpt.block_kinds()
    if kinds is not None:
        down = ("/".join(sorted(set(kinds["down_layers"].values()))) + " by layer"
                if kinds["down_layers"] else kinds["down"])
        wide = ("; Q5_0 widened to Q8_0 without loss"
                if "Q5_0" in ckpt.kept_blocks("gguf").split("/") else "")
        say(f"{ckpt.folder}: experts are {ckpt.kept_blocks('gguf')}: the store keeps their "
            f"blocks as they are (dtype='auto' -> 'gguf': gate/up {kinds['gate_up']}, down "
            f"{down}{wide})")
        return "gguf"
    dt = natural_dtype(qt)
    how = "" if qt == "F32" else f"; dequantized and converted, not kept as they are: {why}"
    say(f"{ckpt.folder}: experts are {qt}: the store holds them as {dt} (dtype='auto'{how})")
    return dt


def _check_config(path: Path) -> dict[str, Any]:
    """config.json, which must be a JSON object: the error names the file and where the JSON
    breaks (transformers' own message names neither)."""
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"{path}: cannot read: {exc.strerror or exc}") from exc
    try:
        cfg = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{path}: not UTF-8 text (byte {exc.start})") from None
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON: {exc.msg} at line {exc.lineno} "
                              f"column {exc.colno} (char {exc.pos})") from None
    except RecursionError:
        raise CheckpointError(f"{path}: not valid JSON: nested too deep") from None
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{path}: not a JSON object (a {type(cfg).__name__})")
    return cfg


def _shard_header(path: Path) -> dict[str, Any]:
    """The JSON header of safetensors shard ``path``, checked against the file's size (a
    truncated shard is named here, before any conversion, not by the reader's error later)."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(8)
            if len(head) != 8:
                raise ValueError("shorter than 8 bytes")
            n = struct.unpack("<Q", head)[0]
            if n > _HEADER_MAX or n > size - 8:
                raise ValueError(f"header length {n} is out of range")
            h = json.loads(f.read(n))
            if not isinstance(h, dict):
                raise ValueError("header is not a JSON object")
    except (OSError, ValueError, RecursionError) as exc:
        raise CheckpointError(f"{path}: not a safetensors file ({exc})") from None
    end = 0
    for k, ent in h.items():
        if k == "__metadata__":
            continue
        off = ent.get("data_offsets") if isinstance(ent, dict) else None
        if (not isinstance(off, list) or len(off) != 2
                or not all(isinstance(o, int) and not isinstance(o, bool) for o in off)
                or not 0 <= off[0] <= off[1] or not isinstance(ent.get("dtype"), str)):
            raise CheckpointError(f"{path}: inconsistent safetensors header: tensor {k} has "
                                  f"entry {ent!r}")
        end = max(end, off[1])
    data = size - 8 - n
    if end > data:
        raise CheckpointError(f"{path}: truncated: its header places tensor data up to byte "
                              f"{8 + n + end}, the file has {size} bytes")
    if end < data:
        raise CheckpointError(f"{path}: inconsistent: {data - end} bytes after the last "
                              "tensor (a safetensors shard's tensors cover its data exactly)")
    return h


# ---------------------------------------------------------------------------------------------
# writing experts


def write_experts(path: str, expert_f32: Callable[[int, int], dict[str, np.ndarray]], *,
                  num_layers: int, num_experts: int, dtype: str, model: str, top_k: int,
                  extra: dict[str, Any], progress: bool = True,
                  expert_bytes: int | None = None,
                  after_layer: Callable[[int], None] | None = None) -> None:
    """Write a store at ``path`` from ``expert_f32(position, expert)``, the canonical f32
    arrays of one expert (biases included), converted one expert at a time to ``dtype`` (or a
    :class:`StoredExpert`, written as it is).

    progress: a tqdm bar over the experts (bytes of the source read, rate, ETA);
    ``expert_bytes`` sizes it.  ``after_layer(position)`` runs once a layer is converted (offload
    uses it to free the model's expert parameters layer by layer)."""
    from .quant import expert_tensors, store_dtypes
    from .store import check_store_target, write_store

    # before the first expert is read (offload frees each layer once converted): only no
    # file, an empty file or a specmoe store at ``path`` may be replaced
    check_store_target(path)
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
            if isinstance(d, StoredExpert):  # kept as the checkpoint holds it
                t: dict[str, np.ndarray] = d
            else:
                biases = {n: d[n + ".bias"] for n in ("gate", "up", "down") if n + ".bias" in d}
                try:
                    t = expert_tensors(d["gate"], d["up"], d["down"], dtype,
                                       biases=biases or None)
                except ValueError as exc:  # e.g. non-finite values: say which expert
                    raise ValueError(f"MoE layer {pos} expert {e}: {exc}") from exc
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


def _dir_label(directory: Path) -> str:
    try:
        same = directory.expanduser().absolute() == cache_dir().absolute()
    except OSError:
        same = False
    env = os.environ.get("SPECMOE_CACHE")
    return (f"{directory} ($SPECMOE_CACHE)" if same and env else
            f"{directory} (the store cache, ~/.cache/specmoe)" if same else str(directory))


def check_store_location(path: str | os.PathLike[str], *,
                         checkpoint: str | os.PathLike[str] | None = None) -> Path:
    """Check, before any conversion work and without writing anything, that a store may be
    written at ``path``: :func:`specmoe.storage.store.check_store_target` (only no file, an empty file
    or a specmoe store is replaced; never a directory, an empty path or a path inside
    ``checkpoint``), and its directory is a directory this process can write (or can be
    created).  Raises :class:`specmoe.storage.store.StorePathError` naming the path or directory."""
    from .store import StorePathError, check_store_target

    raw = os.fspath(path) if not isinstance(path, bytes) else os.fsdecode(path)
    if not isinstance(raw, str) or not raw.strip():
        check_store_target(raw)  # raises, naming the empty path
    p = Path(raw).expanduser()
    check_store_target(str(p) + (os.sep if raw.endswith(os.sep) else ""), checkpoint=checkpoint)
    d = p.parent
    probe = d
    while not probe.exists() and not probe.is_symlink() and probe != probe.parent:
        probe = probe.parent  # the nearest existing ancestor: where mkdir would start
    if not probe.is_dir():
        where = ("it is not a directory" if probe == d else
                 f"{probe} is not a directory, so it cannot be created")
        raise StorePathError(f"cannot write the store {p}: the store directory "
                             f"{_dir_label(d)}: {where}")
    if not os.access(probe, os.W_OK | os.X_OK):
        where = "is not writable" if probe == d else f"cannot be created ({probe} is not writable)"
        raise StorePathError(f"cannot write the store {p}: the store directory "
                             f"{_dir_label(d)} {where}")
    return p


class StoredExpert(dict):
    """One expert's tensors already in the store dtype (what :func:`expert_tensors` would
    give: ``gate``, ``up``, ``down``, then their ``.scale``): a reader of
    :func:`write_experts` returns one where the checkpoint's blocks are kept as they are
    (GGUF's Q4_0 as int4 in groups of 32), and they are written unchanged."""


def expert_block_bytes(I: int, H: int, dtype: str, *, biases: bool = False,
                       group: int | None = None, kinds: dict[str, str] | None = None) -> int:
    """Bytes of one store block (one cache slot) of an expert with ``gate``/``up`` [I, H] and
    ``down`` [H, I] in ``dtype``, from the shapes alone (the layout :func:`write_experts`
    writes), so a cache size can be checked before converting.  ``group``: int4/int2's group
    size (default :func:`specmoe.storage.quant.pick_group`'s); ``kinds``: for ``"gguf"``, the
    block kinds of gate/up and down (``GgufCheckpoint.block_kinds``)."""
    from .quant import pick_group
    from .store import ALIGN, TENSOR_ALIGN

    rows = {"gate": (I, H), "up": (I, H), "down": (H, I)}
    sizes: list[int] = []
    if dtype in ("f32", "bf16"):
        sizes = [r * c * (4 if dtype == "f32" else 2) for r, c in rows.values()]
    elif dtype == "int8":
        sizes = [r * c for r, c in rows.values()] + [r * 4 for r, _ in rows.values()]
    elif dtype == "gguf":
        from .ggml_blocks import BLOCKS
        if not kinds:
            raise ValueError("dtype 'gguf' needs the block kinds of gate/up and down")
        (gc, gb), (dc, db) = BLOCKS[kinds["gate_up"]], BLOCKS[kinds["down"]]
        sizes = [I * (H // gc) * gb, I * (H // gc) * gb, H * (I // dc) * db]
    elif dtype in ("int4", "int2"):
        g = group or pick_group(H, I, dtype)
        per, pair = (2, 1) if dtype == "int4" else (4, 2)
        sizes = ([r * (c // per) for r, c in rows.values()]
                 + [r * (c // g) * pair * 4 for r, c in rows.values()])
    else:
        raise ValueError(f"unknown expert dtype {dtype!r}")
    if biases:
        sizes += [I * 4, I * 4, H * 4]
    off = 0
    for n in sizes:
        off = -(-off // TENSOR_ALIGN) * TENSOR_ALIGN + n
    return max(ALIGN, -(-off // ALIGN) * ALIGN)


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
                    force: bool = False, verbose: bool = True,
                    checkpoint: str | os.PathLike[str] | None = None) -> bool:
    """Make sure ``store`` holds the experts described by (fingerprint, settings): reuse it
    when it does, else call ``convert(path, extra)`` to (re)write it, ``extra`` being the
    header record to write (the settings and the source fingerprint).  Returns True when it
    converted.

    First, whatever the store's state: :func:`check_store_location` (only no file, an empty
    file or a specmoe store is ever replaced, never a file inside ``checkpoint``, the folder
    converted from), so a wrong path fails before any work with nothing changed on disk."""
    from .store import StorePathError, remove_stale_temporaries

    store = check_store_location(store, checkpoint=checkpoint)
    why = "rebuild requested" if force else check_store(store, fingerprint, settings)
    if why is None:
        return False
    try:
        store.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise StorePathError(f"cannot create the store directory {_dir_label(store.parent)}: "
                             f"{exc.strerror or exc}") from exc
    if store.parent.absolute() == cache_dir().absolute():
        # the cache is specmoe's own directory: the temporaries of every store there that a
        # killed conversion left behind go too (write_store removes those of this store)
        remove_stale_temporaries(store.parent, suffix=".smoe")
    if verbose:
        _log(f"converting the experts to {store} ({why})")
    convert(store, dict(settings, source={"fingerprint": fingerprint}))
    return True

"""Load a HuggingFace MoE checkpoint that does not fit in memory: :func:`from_pretrained`.

The model is built on the meta device (accelerate's ``init_empty_weights``: parameters take no
memory, buffers are real); every tensor that is not a routed expert is loaded from the shards
into it; the routed experts are streamed from the shards, one expert at a time, into a
persistent specmoe store (converted once, reused by later calls: :mod:`specmoe.storage.conversion`), and
served through the Engine's cache.  Peak memory while converting: the non-expert weights, one
layer of experts in the store dtype and one expert in f32; while generating: the non-expert
weights, the cache and the KV cache.

Checkpoint keys are mapped to the model's names with transformers' own renaming rules (e.g.
Mixtral's ``block_sparse_moe`` -> ``mlp``), so the non-expert weights land where
``AutoModelForCausalLM.from_pretrained`` would put them; transformers' expert-fusing
converters are not used (they build whole layers in memory): the experts are read per expert by
:func:`_expert_reader`.
"""
from __future__ import annotations

import dataclasses
import os
import re
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
import torch
from torch import nn

from .arch import ArchInfo, canonical, describe, expert_key, expert_module
from ..storage.conversion import (INT_DTYPES, Checkpoint, CheckpointError, check_store_location,
                                  default_store_path, expert_block_bytes, open_checkpoint,
                                  open_or_convert, store_dtype, store_settings, write_experts)

__all__ = ["from_pretrained", "convert", "load_tokenizer"]

_EXPERTS_RE = re.compile(r"^(.*\.experts\.)(.+)$")


@dataclass
class _Plan:
    """Where every tensor of the checkpoint goes."""

    ckpt: Checkpoint  # or a GgufCheckpoint (specmoe.storage.gguf): the same questions answered
    model: nn.Module  # the skeleton (meta parameters)
    info: ArchInfo
    layer_ids: list[int]
    num_experts: int
    shapes: tuple[int, int]  # (I, H) of one expert
    dense: dict[str, str] = field(default_factory=dict)  # model name -> checkpoint key
    # model name -> (checkpoint keys, how they make it): dense weights the checkpoint holds in
    # other pieces (transformers' dense WeightConverters: Concatenate, Split; _dense_converters)
    joined: dict[str, tuple[tuple[str, ...], Callable[[list[torch.Tensor]], torch.Tensor]]] = \
        field(default_factory=dict)
    # per MoE position: {(expert, canonical name) or (None, fused name): checkpoint key}
    experts: list[dict[tuple[int | None, str], str]] = field(default_factory=list)
    unused: list[str] = field(default_factory=list)
    store: Path | None = None  # the store file, its location checked (_prepare)
    dtype: str = "bf16"  # the store dtype (_prepare: "auto" resolved)
    kept: str | None = None  # the blocks the store keeps as they are ("Q4_0", "GPTQ")
    blocks: dict[str, Any] | None = None  # a "gguf" store's kinds (GgufCheckpoint.block_kinds)


def _torch_dtype(spec: Any, config: Any) -> torch.dtype:
    if spec is None or spec == "auto":
        spec = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if spec is None:
        return torch.float32
    if isinstance(spec, torch.dtype):
        return spec
    dt = getattr(torch, str(spec).replace("torch.", ""), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"torch_dtype {spec!r} is not a torch dtype")
    return dt


def _skeleton(ckpt: Any, torch_dtype: Any, hf_kwargs: dict[str, Any]) -> nn.Module:
    """The model with every parameter on the meta device (no memory), eager experts; its
    config from the folder's config.json, or from a GGUF file's metadata."""
    import logging

    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM
    logging.getLogger("transformers").setLevel(logging.ERROR)
    attn = hf_kwargs.pop("attn_implementation", None)
    if isinstance(ckpt, Checkpoint):
        config = AutoConfig.from_pretrained(ckpt.folder, local_files_only=True, **hf_kwargs)
    else:
        cfg = dict(ckpt.config(), **hf_kwargs)
        config = AutoConfig.for_model(cfg.pop("model_type"), **cfg)
    dt = _torch_dtype(torch_dtype, config)
    kw: dict[str, Any] = {"experts_implementation": "eager", "dtype": dt}
    if attn is not None:
        kw["attn_implementation"] = attn
    with init_empty_weights(include_buffers=False):
        model = AutoModelForCausalLM.from_config(config, **kw)
    return model


def _plan(ckpt: Checkpoint, model: nn.Module) -> _Plan:
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightRenaming, rename_source_key

    info, ids = describe(model)
    ex0 = expert_module(model, info, ids[0])
    gu = ex0.gate_up_proj
    E = int(gu.shape[0])
    if info.gptoss:
        I, H = int(gu.shape[2]) // 2, int(gu.shape[1])
    else:
        I, H = int(gu.shape[1]) // 2, int(gu.shape[2])
    plan = _Plan(ckpt, model, info, ids, E, (I, H), experts=[{} for _ in ids])
    names = {m: n for n, m in model.named_modules()}
    prefix_pos = {names[expert_module(model, info, i)] + ".": pos for pos, i in enumerate(ids)}
    mapping = get_model_conversion_mapping(model)
    renamings = [t for t in mapping if isinstance(t, WeightRenaming)]
    meta_sd = model.state_dict()
    prefix = getattr(model, "base_model_prefix", None)
    skip = ckpt.companions()
    pieces = _dense_converters(mapping)
    for key in ckpt.keys:
        if key in skip:  # FP8 block scales: read with their weight
            continue
        if _join_piece(plan, key, pieces, renamings, prefix, meta_sd):
            continue
        # a checkpoint written from the model's own state dict is named as the model is
        # (transformers' renamings are not idempotent: Laguna's "mlp.shared_expert." pattern
        # would turn a "shared_experts." name into "shared_experts..")
        target = key if key in meta_sd else \
            rename_source_key(key, renamings, [], prefix, meta_sd)[0]
        m = _EXPERTS_RE.match(target)
        if m and m.group(1) in prefix_pos:
            what = expert_key(m.group(2))
            if what is not None:
                plan.experts[prefix_pos[m.group(1)]][what] = key
                continue
        if target in meta_sd:
            plan.dense[target] = key
        else:
            plan.unused.append(key)
    for pos, got in enumerate(plan.experts):
        _check_experts(plan, pos, got)
    _check_joined(plan, pieces)
    _check_dtypes(plan, meta_sd)
    _check_complete(plan, prefix_pos, meta_sd)
    return plan


def _check_complete(plan: _Plan, expert_prefixes: dict[str, int],
                    meta_sd: dict[str, torch.Tensor]) -> None:
    """Every parameter of the model that is not a routed expert's, and every buffer the model
    saves with its weights (DeepSeek-V3's routing correction bias), has a checkpoint tensor
    (tied ones count once), checked before any conversion: a checkpoint that lacks one fails
    at once, naming it, not after its experts were converted (_load_dense checks the
    parameters again), and a buffer is not left at its initial value unnoticed."""
    have = set(plan.dense) | set(plan.joined)
    plan.model.tie_weights()  # (on the meta skeleton: an output layer tied to the embedding
    # is then one parameter, as _load_dense counts it)
    model = plan.model
    saved = set(meta_sd)  # parameters and persistent buffers
    names = [n for n, _ in model.named_parameters()] + \
        [n for n, _ in model.named_buffers() if n in saved]
    left = [n for n in names
            if n not in have and not any(n.startswith(p) for p in expert_prefixes)]
    if left:
        raise CheckpointError(f"{plan.ckpt.folder}: the checkpoint lacks {len(left)} tensors "
                              f"the model needs: {', '.join(left[:6])}"
                              f"{' ...' if len(left) > 6 else ''}")


def _dense_converters(mapping: list[Any]) -> list[Any]:
    """The model's dense WeightConverters that the loader applies itself: one Concatenate of
    several checkpoint tensors into one weight (Kimi-Linear's and Ling's q/k/v short
    convolutions) or one Split of a checkpoint tensor into several (a fused query_key_value
    or in_proj).  The expert converters are the store's business; other dense operations are
    left alone, and the tensors they would make show as missing, by name."""
    from transformers.core_model_loading import Concatenate, Split, WeightConverter
    out = []
    for c in mapping:
        if not isinstance(c, WeightConverter) or len(c.operations) != 1 \
                or any("experts" in p for p in c.source_patterns):
            continue
        op = c.operations[0]
        if (isinstance(op, Concatenate) and len(c.target_patterns) == 1) or \
                (isinstance(op, Split) and len(c.source_patterns) == 1):
            out.append(c)
    return out


def _join_piece(plan: _Plan, key: str, converters: list, renamings: list, prefix: Any,
                meta_sd: dict[str, torch.Tensor]) -> bool:
    """Record checkpoint ``key`` as a piece of a dense weight when one of ``converters``
    (_dense_converters) takes it, after transformers' renamings, as transformers' loader
    names it: True; False for any other key."""
    from transformers.core_model_loading import Concatenate, rename_source_key
    if not converters or key in meta_sd:
        return False
    name, src = rename_source_key(key, renamings, converters, prefix, meta_sd)
    conv = next((c for c in converters if src in c.source_patterns), None) if src else None
    if conv is None:
        return False
    op, first = conv.operations[0], conv.target_patterns[0]
    names = [name.replace(first, t, 1) for t in conv.target_patterns]
    if not all(n in meta_sd for n in names):
        return False
    if isinstance(op, Concatenate):  # the pieces in the converter's order of sources
        keys, _ = plan.joined.get(name, ((None,) * len(conv.source_patterns), None))
        keys = tuple(key if i == conv.source_patterns.index(src) else k
                     for i, k in enumerate(keys))
        plan.joined[name] = (keys, lambda ts, d=op.dim: torch.cat(ts, dim=d))
    else:  # Split: each target's share of the one tensor, sized like its parameter
        sizes = [int(meta_sd[n].shape[op.dim]) for n in names]
        for j, n in enumerate(names):
            plan.joined[n] = ((key,), lambda ts, d=op.dim, z=sizes, j=j:
                              torch.split(ts[0], z, dim=d)[j].contiguous())
    return True


def _check_joined(plan: _Plan, pieces: list) -> None:
    """A dense weight made of checkpoint pieces needs every piece: one missing is an error
    naming it (the others are then not loaded)."""
    for target, (keys, _) in plan.joined.items():
        for i, k in enumerate(keys):
            if k is None:
                conv = next(c for c in pieces if c.target_patterns[0] in target)
                raise CheckpointError(f"{plan.ckpt.folder}: the checkpoint lacks the "
                                      f"{conv.source_patterns[i]!r} piece of the model's "
                                      f"{target}")


def _check_dtypes(plan: _Plan, meta_sd: dict[str, torch.Tensor]) -> None:
    """An integer tensor where a float weight belongs is refused before any conversion: an
    expert projection would be converted as if its integers were weights, a dense float
    parameter would be assigned integers (garbage tokens).  GPT-OSS's MXFP4 ``_blocks`` /
    ``_scales`` (uint8 by design) are the quantized layout that is dequantized on the way."""
    ckpt = plan.ckpt

    def refuse(key: str, what: str) -> CheckpointError:
        return CheckpointError(f"{ckpt.keys[key]}: tensor {key} has dtype {ckpt.dtypes[key]}, "
                               f"an integer type, but {what} is a float weight (quantized "
                               "checkpoints other than GPT-OSS's MXFP4 experts are not read)")

    for pos, got in enumerate(plan.experts):
        for (e, name), key in got.items():
            if e is None and name.endswith(("_blocks", "_scales")):
                continue
            if ckpt.dtypes.get(key) in INT_DTYPES:
                who = (f"expert {e}'s {name}" if e is not None else f"the fused {name}")
                raise refuse(key, f"{who} (decoder layer {plan.layer_ids[pos]})")
    dense = list(plan.dense.items()) + \
        [(t, k) for t, (keys, _) in plan.joined.items() for k in keys]
    for target, key in dense:
        want = meta_sd.get(target)
        if (want is not None and want.is_floating_point()
                and ckpt.dtypes.get(key) in INT_DTYPES):
            raise refuse(key, f"the model's {target} ({str(want.dtype).replace('torch.', '')})")


def _check_experts(plan: _Plan, pos: int, got: dict[tuple[int | None, str], str]) -> None:
    layer = plan.layer_ids[pos]
    fused = {n for (e, n) in got if e is None}
    if fused:
        need = {"gate_up_proj", "down_proj"}
        if {"gate_up_proj_blocks", "down_proj_blocks"} <= fused:
            need = {"gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks",
                    "down_proj_scales"}
        if plan.info.gptoss:
            need |= {"gate_up_proj_bias", "down_proj_bias"}
        missing = need - fused
    else:
        missing = {f"experts.{e}.{n}" for e in range(plan.num_experts)
                   for n in ("gate", "up", "down") if (e, n) not in got}
    if missing:
        raise ValueError(f"{plan.ckpt.folder}: decoder layer {layer} lacks expert tensors: "
                         f"{', '.join(sorted(missing)[:6])}"
                         f"{' ...' if len(missing) > 6 else ''}")


def _np32(t: torch.Tensor) -> np.ndarray:
    return t.detach().to(torch.float32).contiguous().numpy()


def _expert_reader(plan: _Plan) -> Callable[[int, int], dict[str, np.ndarray]]:
    """``f(position, expert)`` -> that expert's canonical f32 arrays, read from the shards
    (only that expert's bytes: per-expert tensors whole, fused tensors sliced)."""
    ckpt, gptoss = plan.ckpt, plan.info.gptoss
    I, H = plan.shapes

    def read(pos: int, e: int) -> dict[str, np.ndarray]:
        keys = plan.experts[pos]
        if plan.kept:  # GGUF Q4_0 / GPTQ int4 blocks as they are, not dequantized
            return _kept_expert(plan, pos, e)
        if (e, "gate") in keys:
            out = {n: _np32(ckpt.tensor(keys[(e, n)])) for n in ("gate", "up", "down")}
        elif (None, "gate_up_proj_blocks") in keys:  # GPT-OSS MXFP4
            from transformers.integrations.mxfp4 import convert_moe_packed_tensors

            def mx(name: str) -> torch.Tensor:
                blocks = ckpt.slice(keys[(None, name + "_blocks")], slice(e, e + 1))
                scales = ckpt.slice(keys[(None, name + "_scales")], slice(e, e + 1))
                return convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)[0]

            out = canonical(mx("gate_up_proj"), mx("down_proj"), gptoss,
                            ckpt.slice(keys[(None, "gate_up_proj_bias")], e),
                            ckpt.slice(keys[(None, "down_proj_bias")], e))
        else:
            out = canonical(ckpt.slice(keys[(None, "gate_up_proj")], e),
                            ckpt.slice(keys[(None, "down_proj")], e), gptoss,
                            ckpt.slice(keys[(None, "gate_up_proj_bias")], e) if gptoss else None,
                            ckpt.slice(keys[(None, "down_proj_bias")], e) if gptoss else None)
        want = {"gate": (I, H), "up": (I, H), "down": (H, I)}
        for n, shp in want.items():
            if out[n].shape != shp:
                raise ValueError(f"{ckpt.folder}: decoder layer {plan.layer_ids[pos]} expert "
                                 f"{e}: {n} has shape {out[n].shape}, the config says {shp}")
        for n, a in out.items():
            if not np.isfinite(a).all():
                key = _source_key(keys, e, n)
                bad = a[~np.isfinite(a)]
                raise CheckpointError(
                    f"{ckpt.keys[key]}: tensor {key} (decoder layer {plan.layer_ids[pos]}, "
                    f"expert {e}, {n}): {bad.size} non-finite values (first: {bad.flat[0]}); "
                    "the checkpoint is damaged or was saved from a diverged run")
        return out

    return read


def _kept_expert(plan: _Plan, pos: int, e: int) -> dict[str, np.ndarray]:
    """Expert ``e`` of MoE position ``pos`` in the store's layout, from the checkpoint's
    blocks as they are: a GGUF file's Q8_0 / Q2_K-Q6_K / Q4_0 / Q4_1 / IQ4_XS / MXFP4 blocks,
    an asymmetric GPTQ / AWQ checkpoint's groups as Q4_1 or GPT-OSS's MXFP4 experts repacked
    (store dtype ``"gguf"``), or in int4 a
    GGUF file's Q4_0 (fused per layer) or a symmetric GPTQ checkpoint's int4 (per expert)
    (``expert_blocks`` / ``expert_int4`` of :class:`specmoe.storage.gguf.GgufCheckpoint` and
    :class:`specmoe.storage.conversion.Checkpoint`)."""
    from ..storage.conversion import StoredExpert
    keys, (I, H) = plan.experts[pos], plan.shapes
    ck = plan.ckpt
    if plan.dtype == "gguf":
        from ..storage.ggml_blocks import BLOCKS, block_kind
        if (e, "gate") in keys:  # per-expert tensors (GPTQ / AWQ as Q4_1)
            gu = np.concatenate([ck.expert_blocks(keys[(e, "gate")]),
                                 ck.expert_blocks(keys[(e, "up")])])
            dn = ck.expert_blocks(keys[(e, "down")])
        elif (None, "gate_up_proj_blocks") in keys:  # GPT-OSS's MXFP4, repacked
            def mx(name: str) -> np.ndarray:
                return ck.mxfp4_blocks(keys[(None, name + "_blocks")],
                                       keys[(None, name + "_scales")], e)
            gu = mx("gate_up_proj")  # rows gate and up interleaved: gate rows, then up rows
            gu = np.concatenate([gu[0::2], gu[1::2]])
            dn = mx("down_proj")
        else:
            gu = ck.expert_blocks(keys[(None, "gate_up_proj")], e)
            dn = ck.expert_blocks(keys[(None, "down_proj")], e)
        gk, dk = block_kind(gu), block_kind(dn)
        if (gu.shape != (2 * I, H // BLOCKS[gk][0], BLOCKS[gk][1])
                or dn.shape != (H, I // BLOCKS[dk][0], BLOCKS[dk][1])):
            raise ValueError(f"{ck.folder}: decoder layer {plan.layer_ids[pos]} expert {e}: "
                             f"block shapes {gu.shape}/{dn.shape} do not fit the config's "
                             f"I={I}, H={H}")
        widest = plan.blocks["down"] if plan.blocks else dk
        if dk != widest:  # this layer's rows packed from the start of the widest-sized tensor
            c, b = BLOCKS[widest]
            flat = np.zeros(H * (I // c) * b, np.uint8)
            flat[:dn.size] = dn.reshape(-1)
            dn = flat.reshape(H, I // c, b)
        return StoredExpert({"gate": gu[:I], "up": gu[I:], "down": dn,
                             **_kept_biases(plan, pos, e)})
    if (e, "gate") in keys:
        (g, gs), (u, us) = ck.expert_int4(keys[(e, "gate")]), ck.expert_int4(keys[(e, "up")])
        gu, gus = np.concatenate([g, u]), np.concatenate([gs, us])
        dn, dns = ck.expert_int4(keys[(e, "down")])
    else:
        gu, gus = ck.expert_int4(keys[(None, "gate_up_proj")], e)
        dn, dns = ck.expert_int4(keys[(None, "down_proj")], e)
    if gu.shape != (2 * I, H // 2) or dn.shape != (H, I // 2):
        raise ValueError(f"{plan.ckpt.folder}: decoder layer {plan.layer_ids[pos]} expert {e}: "
                         f"shapes {gu.shape}/{dn.shape} do not fit the config's I={I}, H={H}")
    for what, sc in (("gate/up", gus), ("down", dns)):
        if not np.isfinite(sc).all():
            raise CheckpointError(f"{plan.ckpt.folder}: decoder layer {plan.layer_ids[pos]} "
                                  f"expert {e}: {what} has non-finite {plan.kept} scales; the "
                                  "checkpoint is damaged")
    return StoredExpert({"gate": gu[:I], "up": gu[I:], "down": dn, "gate.scale": gus[:I],
                         "up.scale": gus[I:], "down.scale": dns, **_kept_biases(plan, pos, e)})


def _kept_biases(plan: _Plan, pos: int, e: int) -> dict[str, np.ndarray]:
    """GPT-OSS's expert biases beside its kept blocks (f32, as every store holds biases):
    the fused gate_up_proj_bias [2I] interleaved (even entries gate, odd up) and
    down_proj_bias [H]; nothing for the other architectures."""
    if not plan.info.gptoss:
        return {}
    keys, ck = plan.experts[pos], plan.ckpt
    gub = _np32(ck.slice(keys[(None, "gate_up_proj_bias")], e))
    return {"gate.bias": np.ascontiguousarray(gub[0::2]),
            "up.bias": np.ascontiguousarray(gub[1::2]),
            "down.bias": _np32(ck.slice(keys[(None, "down_proj_bias")], e))}


def _source_key(keys: dict[tuple[int | None, str], str], e: int, n: str) -> str:
    """The checkpoint key canonical array ``n`` (gate, up, down, gate.bias, ...) of expert
    ``e`` was read from."""
    if (e, n) in keys:
        return keys[(e, n)]
    base = "down_proj" if n.startswith("down") else "gate_up_proj"
    for cand in ((base + "_bias",) if n.endswith(".bias") else ()) + (base, base + "_blocks"):
        if (None, cand) in keys:
            return keys[(None, cand)]
    return next(iter(keys.values()))


def _expert_nbytes(plan: _Plan) -> int:
    """Bytes of one expert in the checkpoint (for the progress bar)."""
    keys = plan.experts[0]
    total = 0
    for (e, _), k in keys.items():
        if e in (None, 0):
            total += plan.ckpt.nbytes(k) // (plan.num_experts if e is None else 1)
    return total


def _store_path(folder: Path, dtype: str, store: Any) -> Path:
    """The store file for checkpoint ``folder`` (``store=``, else the default one under the
    cache directory), checked before any work: never an existing file that is not a store, a
    directory, an empty path or a path inside the checkpoint (:func:`check_store_location`)."""
    return check_store_location(default_store_path(folder, dtype) if store is None else store,
                                checkpoint=folder)


def _block_bytes(plan: _Plan, dtype: str) -> int:
    I, H = plan.shapes
    return expert_block_bytes(I, H, dtype, biases=plan.info.gptoss,
                              group=plan.ckpt.kept_group() if plan.kept and dtype != "gguf"
                              else None,
                              kinds=plan.blocks if dtype == "gguf" else None)


def _plan_memory(plan: _Plan, dtype: str, budget: int, source: str, cache: Any,
                 dense: Any, prefetch: Any = None, k_max: int = 0) -> Any:
    """from_pretrained's memory plan (specmoe.runtime.memplan) for the skeleton: the dense
    formats to weigh (the model's exact one and int8, or the one ``dense`` names), the
    cache planned unless ``cache`` is given (then it is checked against the budget); with
    ``prefetch="learned"`` the predictor's token-prior table set aside too, with ``k_max``
    the recurrent states a verification of k_max drafts records."""
    from ..runtime import memplan
    I, H = plan.shapes
    sizes = memplan.model_sizes(plan.model, num_layers=len(plan.layer_ids),
                                num_experts=plan.num_experts,
                                top_k=int(plan.model.config.num_experts_per_tok),
                                block_bytes=_block_bytes(plan, dtype))
    gguf = False  # a GGUF file holding dense layers in blocks: those are a format too
    if hasattr(plan.ckpt, "dense_kind"):
        sizes = dataclasses.replace(sizes, **_gguf_dense_sizes(plan, sizes.param_bytes))
        gguf = sizes.gguf_kind is not None
    opts = None
    if isinstance(dense, str) and dense not in ("auto", "torch"):
        opts = [dense]
    elif dense in (None, False, "torch"):
        opts = [sizes.model_dtype]
    opts = opts or [sizes.model_dtype, "int8"] + (["gguf"] if gguf else [])
    where = plan.store.parent  # _prepare checked the store's location
    where.mkdir(parents=True, exist_ok=True)
    rates = memplan.measure_rates(sizes, dtype, hidden=H, inter=I, formats=opts,
                                  directory=str(where))
    # a given budget holds the whole process; "auto"'s headroom leaves out what it holds
    reserve = memplan.process_reserve() if source == "given" else memplan.RESERVE
    pbytes = 0
    if prefetch == "learned":
        from ..sim.nextuse import prior_table_bytes
        pbytes = prior_table_bytes(sizes.num_layers, sizes.num_experts)
    mp = memplan.plan_memory(sizes, budget, rates, dense_options=opts, reserve=reserve,
                             source=source, predictor=pbytes,
                             record_tokens=k_max + 1 if k_max else 0)
    if cache is not None:  # the user's cache, inside the budget or refused
        from ..runtime.cache import parse_capacity
        total = sizes.num_layers * sizes.num_experts
        slots = parse_capacity(cache, total_experts=total, slot_bytes=sizes.block_bytes)
        if slots > mp.cache_slots:
            raise ValueError(f"cache={cache!r} ({slots} experts) does not fit memory="
                             f"{budget / 2**30:.2f} GiB with dense {mp.dense}: at most "
                             f"{mp.cache_slots} experts")
    return mp


def _check_cache_fits(plan: _Plan, cache: Any, dtype: str) -> None:
    """``cache=`` against the model (from its config, before converting): at least one expert
    of ``dtype`` and at least top_k slots (one token pins its top_k experts at once)."""
    from ..runtime.cache import parse_capacity
    bb = _block_bytes(plan, dtype)
    total = plan.num_experts * len(plan.layer_ids)
    k = int(plan.model.config.num_experts_per_tok)
    try:
        slots = parse_capacity(cache, total_experts=total, slot_bytes=bb)
    except ValueError as exc:
        raise ValueError(f"cache={cache!r}: {exc} ({dtype} experts of this model)") from None
    if slots < k:
        raise ValueError(f"cache={cache!r} gives {slots} slot{'s' * (slots != 1)} of {bb} bytes "
                         f"({dtype} experts), fewer than the model's top_k = {k}: each token "
                         f"needs its {k} experts in the cache at once (at least {k} slots, "
                         f"{k * bb} bytes; the model has {total} experts)")


def _ensure_store(plan: _Plan, folder: Path, dtype: str, path: Path | None, force: bool,
                  progress: bool) -> Path:
    if path is None:
        path = _store_path(folder, dtype, None)
    cfg = plan.model.config
    settings = store_settings(cfg, plan.info, plan.layer_ids, dtype)
    if plan.kept:
        settings["kept_blocks"] = plan.kept  # a store re-quantized from them is not this one
    if plan.blocks and plan.blocks.get("down_layers"):  # per-layer down formats (Q4_K_M)
        settings["gguf_down_kinds"] = [plan.blocks["down_layers"][i] for i in plan.layer_ids]

    def convert_to(p: Path, extra: dict[str, Any]) -> None:
        write_experts(str(p), _expert_reader(plan), num_layers=len(plan.layer_ids),
                      num_experts=plan.num_experts, dtype=dtype, model=plan.info.model_type,
                      top_k=int(cfg.num_experts_per_tok), extra=extra, progress=progress,
                      expert_bytes=_expert_nbytes(plan),
                      # unmap the shards after each layer: their pages read so far leave this
                      # process's resident set (they stay in the page cache, reclaimable)
                      after_layer=lambda pos: plan.ckpt.close())

    open_or_convert(path, plan.ckpt.fingerprint(), settings, convert_to, force=force,
                    checkpoint=folder)
    return path


def _prepare(path: Any, dtype: str, torch_dtype: Any,
             hf_kwargs: dict[str, Any], store: Any = None) -> _Plan:
    """The plan of checkpoint ``path`` (a path, or a checkpoint already opened), with its
    store's path (``store``, None: the default one), every check that needs no conversion
    done: the shards' headers, config.json, the store's location, the tensors' names and
    dtypes.  ``plan.dtype`` is the store dtype (:func:`store_dtype`)."""
    ckpt = open_checkpoint(path) if isinstance(path, (str, os.PathLike)) else path
    dtype = store_dtype(ckpt, dtype)
    spath = _store_path(ckpt.folder, dtype, store)
    model = _skeleton(ckpt, torch_dtype, hf_kwargs)
    plan = _plan(ckpt, model)
    plan.store = spath
    plan.dtype = dtype
    plan.kept = ckpt.kept_blocks(dtype)
    plan.blocks = ckpt.block_kinds()[0] if dtype == "gguf" else None
    return plan


def convert(path: str | os.PathLike[str], *, dtype: str = "auto",
            out: str | os.PathLike[str] | None = None, force: bool = False,
            progress: bool = True) -> Path:
    """Convert the routed experts of checkpoint folder (or GGUF file) ``path`` to a specmoe
    store in ``dtype`` (``f32``, ``bf16``, ``int8``, ``int4``; ``"auto"``: bf16, int4 for a
    GPTQ checkpoint, or for a GGUF file the nearest to its expert type,
    :func:`specmoe.storage.conversion.store_dtype`) and return the store's path.

    out: the store file (default: :func:`specmoe.storage.conversion.default_store_path`, under
    ``$SPECMOE_CACHE`` or ``~/.cache/specmoe``).  An up-to-date store there is kept as it is
    (``force=True`` rewrites it); a stale, foreign or damaged one is rebuilt, saying why.  Any
    other file there is never replaced: a file that is not a specmoe store, a directory, an
    empty path or a path inside the checkpoint folder raise
    :class:`specmoe.storage.store.StorePathError` (a ValueError) before any work.  A checkpoint that
    cannot be converted (a truncated shard, config.json not JSON, an integer tensor where a
    float weight belongs, NaN/inf in an expert) raises
    :class:`specmoe.storage.conversion.CheckpointError` (a ValueError) naming the file and tensor."""
    plan = _prepare(path, dtype, None, {}, out)
    try:
        return _ensure_store(plan, plan.ckpt.folder, plan.dtype, plan.store, force, progress)
    finally:
        plan.ckpt.close()


def load_tokenizer(path: str | os.PathLike[str]) -> Any:
    """The tokenizer of checkpoint ``path``: a folder's tokenizer files, or a GGUF file's
    vocabulary (transformers' GGUF tokenizer reader), offline."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast
    p = Path(path).expanduser()
    if p.is_file():
        try:
            return AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name,
                                                 local_files_only=True)
        except (TypeError, ValueError, KeyError):
            # AutoTokenizer first parses the whole model config from the metadata to choose a
            # class, and transformers' gpt-oss branch of that parsing fails on every gpt-oss
            # file with YaRN keys (it converts a field's length part, an array, with float());
            # the fast tokenizer built from the vocabulary alone reads none of it
            return PreTrainedTokenizerFast.from_pretrained(p.parent, gguf_file=p.name,
                                                           local_files_only=True)
    return AutoTokenizer.from_pretrained(p, local_files_only=True)


def _load_dense(plan: _Plan, skip: "set[str] | frozenset[str]" = frozenset()) -> None:
    """Load every non-expert tensor of the checkpoint into the skeleton, in the skeleton's
    dtypes, then tie weights; a parameter left on the meta device is an error, except the
    targets in ``skip`` (dense="gguf": weights the C layers read as the file's blocks)."""
    from .arch import moe_block
    from ..runtime.experts import SpecmoeExperts
    model = plan.model
    for pos, i in enumerate(plan.layer_ids):  # drop the meta expert parameters first
        moe_block(model, plan.info, i).experts = SpecmoeExperts(None, pos, plan.num_experts,
                                                                plan.shapes[1])
    sources = [(t, (k,), None) for t, k in plan.dense.items()] + \
        [(t, keys, make) for t, (keys, make) in plan.joined.items()]
    for target, keys, make in sources:
        if target in skip:
            continue
        mod_name, _, attr = target.rpartition(".")
        mod = model.get_submodule(mod_name)
        old = getattr(mod, attr)
        want = old.dtype if old.is_floating_point() else None
        ts = [plan.ckpt.tensor(k, dtype=want) for k in keys]
        t = ts[0] if make is None else make(ts)
        key = " + ".join(keys)
        if tuple(t.shape) != tuple(old.shape):
            raise ValueError(f"{plan.ckpt.folder}: {key} has shape {tuple(t.shape)}, the model "
                             f"expects {tuple(old.shape)} for {target}")
        if t.is_floating_point():
            t = t.to(old.dtype)
        if attr in mod._parameters:
            mod._parameters[attr] = nn.Parameter(t, requires_grad=False)
        else:
            mod._buffers[attr] = t
    model.tie_weights()
    left = [n for n, p in model.named_parameters() if p.is_meta and n not in skip]
    if left:
        raise ValueError(f"{plan.ckpt.folder}: the checkpoint lacks {len(left)} tensors the "
                         f"model needs: {', '.join(left[:6])}{' ...' if len(left) > 6 else ''}")


def _dense_linears(plan: _Plan) -> list[tuple[str, str, nn.Linear]]:
    """(module name, checkpoint key, module) of every dense ``nn.Linear`` weight the
    checkpoint loads, routers left out (the Engine never converts them)."""
    from .arch import getpath, moe_block
    routers = {id(getpath(moe_block(plan.model, plan.info, i), plan.info.router_attr))
               for i in plan.layer_ids}
    out = []
    for target, key in plan.dense.items():
        mod_name, _, attr = target.rpartition(".")
        mod = plan.model.get_submodule(mod_name) if mod_name else plan.model
        if attr == "weight" and isinstance(mod, nn.Linear) and id(mod) not in routers:
            out.append((mod_name, key, mod))
    return out


def _fits(kind: str, mod: nn.Linear, rows: int, nbytes: int) -> bool:
    """Whether blocks of ``kind`` (``rows`` rows, ``nbytes`` in all) are ``mod``'s weight."""
    from ..runtime.kernels import GGUF_BLOCKS
    cols, bb = GGUF_BLOCKS[kind]
    return rows == mod.out_features and nbytes == rows * (mod.in_features // cols) * bb \
        and mod.in_features % cols == 0


def _dense_blocks(plan: _Plan) -> dict[str, tuple[Any, str]]:
    """dense="gguf": the GGUF blocks of each dense ``nn.Linear`` the file holds in a block
    format the kernels read, by the module's qualified name
    (:meth:`specmoe.storage.gguf.GgufCheckpoint.dense_blocks`), for convert_dense."""
    out = {}
    for mod_name, key, mod in _dense_linears(plan):
        got = plan.ckpt.dense_blocks(key)
        if got is not None and _fits(got[1], mod, got[0].shape[0], got[0].nbytes):
            out[mod_name] = got
    return out


def _mla_blocks(plan: _Plan) -> dict[str, tuple[Any, ...]]:
    """dense="gguf": each MLA attention's attn_k_b / attn_v_b blocks, by the attention
    module's qualified name (:meth:`specmoe.storage.gguf.GgufCheckpoint.mla_blocks`), for
    absorb_mla; empty for other files and for files with the joined attn_kv_b."""
    if not hasattr(plan.ckpt, "mla_blocks"):
        return {}
    out = {}
    for target, key in plan.dense.items():
        if target.endswith(".kv_b_proj.weight"):
            got = plan.ckpt.mla_blocks(key)
            if got is not None:
                out[target[:-len(".kv_b_proj.weight")]] = got
    return out


def _auto_gguf(plan: _Plan) -> bool:
    """dense="auto" on a GGUF file: its own blocks where "auto" would put the dense layers in
    C (a bf16 model on an AVX2 / AVX-512 CPU) and the file holds some of them in a kept
    block kind.  They are the weights the file holds (bf16 rounds them once more) in fewer
    bytes: 4-layer DeepSeek-V2-Lite Q4_0, 269 MiB against 732; under a 12-layer model's
    memory budget 1.6x the tok/s of bf16 dense layers (docs/performance.md)."""
    from .dense import resolve_dense
    if not hasattr(plan.ckpt, "dense_kind"):
        return False
    params = next(iter(plan.model.parameters()), None)
    if params is None or resolve_dense("auto", params.dtype) is None:
        return False
    return any(plan.ckpt.dense_kind(key) is not None for _, key, _ in _dense_linears(plan))


def _gguf_dense_sizes(plan: _Plan, param_bytes: float) -> dict[str, Any]:
    """The memory plan's ``gguf_dense_bytes``, ``gguf_kind`` and ``gguf_mla_bytes``
    (ModelSizes) of a GGUF file, from its tensor table: the layers :func:`_dense_blocks` would
    hold as blocks at their blocks' bytes, the other convertible layers at the model's dtype;
    the absorbed MLA weights as the file's attn_k_b / attn_v_b blocks (:func:`_mla_blocks`),
    else at the model's dtype."""
    total, by_kind, mla = 0, {}, 0
    for name, key, mod in _dense_linears(plan):
        if name.endswith(".kv_b_proj"):
            got_mla = plan.ckpt.mla_nbytes(key) if hasattr(plan.ckpt, "mla_nbytes") else None
            mla += got_mla if got_mla is not None else int(mod.weight.numel() * param_bytes)
        got = plan.ckpt.dense_kind(key)
        if got is not None and _fits(got[0], mod, mod.out_features, got[1]):
            total += got[1]
            by_kind[got[0]] = by_kind.get(got[0], 0) + got[1]
        else:
            total += int(mod.weight.numel() * param_bytes)
    kind = max(by_kind, key=by_kind.get) if by_kind else None
    return {"gguf_dense_bytes": int(total), "gguf_kind": kind, "gguf_mla_bytes": int(mla)}


def _token_pieces(eng: Any, path: str | os.PathLike[str]) -> None:
    """The learned predictor's token prior for a model the packaged table is for (issue 42):
    the checkpoint's tokenizer maps ids to pieces (Engine.set_token_pieces).  A checkpoint
    without a usable tokenizer runs without the prior, with a warning."""
    if eng.token_prior is None:
        return
    try:
        tok = load_tokenizer(path)
    except Exception as exc:  # noqa: BLE001 - any tokenizer failure only loses the prior
        import warnings

        warnings.warn(f"{path}: no usable tokenizer ({type(exc).__name__}: {exc}); the learned "
                      f"predictor runs without the token prior", stacklevel=3)
        return
    eng.set_token_pieces(tok)


def from_pretrained(path: str | os.PathLike[str], *, cache: int | float | str | None = None,
                    dtype: str = "auto", policy: Any = "least_stale", prefetch: bool | str = True,
                    store: str | os.PathLike[str] | None = None, direct: bool | None = None,
                    progress: bool = True, force_convert: bool = False,
                    torch_dtype: Any = "auto", dense: str | bool | None = "auto",
                    miss: str = "fetch", miss_keep: int = 2,
                    route_lambda: float = 0.0, throttle: tuple[float, float] | None = None,
                    miss_levels: str | Sequence[str] = "int4", miss_keep2: int | None = None,
                    device: Any = "cpu", balance: Any = False,
                    gpu_cache: int | float | str | None = None,
                    route: str = "model", trace: Any = None,
                    memory: int | str | None = None, k_max: int = 0,
                    **hf_kwargs: Any) -> nn.Module:
    """The transformers model of checkpoint folder ``path`` with its routed experts served by
    specmoe; ``model.generate()`` works unchanged, :func:`specmoe.engine_of` gives the Engine
    (stats, policy, trace, close).

    path: a local HuggingFace checkpoint folder (config.json, safetensors shards with or
    without an index, tokenizer files), or a GGUF file (llama.cpp's format; config from its
    metadata, :mod:`specmoe.storage.gguf`).  cache: the expert cache as slots, a fraction
    (``0.25``, ``"25%"``) or a byte size (``"6GiB"``); None: 25 %, or what ``memory`` plans.
    memory: a memory budget (``"8GiB"``, bytes, or ``"auto"``: what this process may still
    use, MemAvailable or the memory cgroup's headroom when lower) that the dense layers' format and the expert cache are planned to
    (:mod:`specmoe.runtime.memplan`: the split of least estimated time per token, printed with
    ``progress``; ``engine.memory_plan`` keeps it); an explicit ``cache`` or ``dense`` other
    than ``"auto"`` is kept and the rest planned around it.  CPU tier only.  k_max: with
    ``memory``, the most drafts a verification of :func:`specmoe.generate` will carry (the
    controller's ``k_max``); a linear-attention hybrid's cache then records its states over
    k_max + 1 tokens of each forward, which the plan sets aside (0: no speculation planned;
    ``specmoe.generate`` refuses a larger k_max on such a model under the plan).  dtype: the store's
    expert format
    (``f32``, ``bf16``, ``int8`` per row, ``int4`` in groups, ``int2`` in groups with scale and
    offset; ``"auto"``: bf16, int4 for a GPTQ checkpoint, for a GGUF file the nearest to its
    experts' type; GGUF Q4_0 and symmetric GPTQ experts are kept as they are in int4).  policy: eviction policy name or
    object (:func:`specmoe.runtime.engine.available_policies`).  prefetch: the next layer's router
    predicts the experts to load while this layer computes (True, ``"router"``), or the learned
    next-use model does (``"learned"``: learnt from the routing seen so far, no hidden state;
    ``"oracle"``: a replay's true next layer), False: demand loads only.  store: the store file (default
    one per checkpoint and dtype under ``$SPECMOE_CACHE`` or ``~/.cache/specmoe``), converted on
    the first call and reused after; ``force_convert=True`` rewrites it; only a specmoe store or
    no file is ever replaced there (:func:`convert`).  direct: O_DIRECT
    reads (None: when the store exceeds half the memory this process may use).  progress: a
    progress bar while converting.  torch_dtype: dtype of the non-expert weights ("auto": the
    checkpoint's).  dense: the other linear layers (attention, shared/dense MLPs, lm_head)
    through specmoe's C kernels: ``"auto"`` (bf16 weights kept exactly; a GGUF file's own
    blocks where it holds them, see ``"gguf"``), ``"torch"``,
    ``"f32"``/``"bf16"``/``"int8"``/``"int4"``, or for a GGUF file ``"gguf"``: its blocks as
    the file holds them (Q4_0, Q8_0, Q4_K, Q6_K, ...: the bits llama.cpp reads; layers in
    other types keep the model's format) (:mod:`specmoe.models.dense`).  miss, miss_keep,
    route_lambda, throttle, miss_levels, miss_keep2: SpecMD's miss handling (``"fetch"``,
    ``"drop"``, ``"substitute"``, ``"lowest_bit"``, ``"priority"``), cache-aware routing, link
    emulation and the low-bit fallback levels (``"int4"``, ``"int4:int2"``;
    :mod:`specmoe.runtime.misses`).  device: ``"cpu"``, or ``"cuda"``/``"cuda:N"`` for the GPU tier
    (experts cached in GPU memory behind a pinned host copy of the store, the other weights
    on that GPU: :class:`specmoe.runtime.gpu_engine.GpuEngine`; ``dense`` "auto"/"torch" and
    ``dense`` "auto"/"torch" only, ``direct`` unused; ``balance=True``: the hybrid tier,
    MoE-SpAc's CPU/GPU workload balancer, :mod:`specmoe.runtime.gpu_engine`).  gpu_cache: the
    hybrid tier in one word (issue 37): a GPU cache of this size (as ``cache``) and every
    other expert computed by the CPU kernels where it lives in host memory or copied, as
    the balancer's measured costs decide (``balance=True`` unless a profile is given; needs
    a CUDA ``device``).  route: ``"model"`` (the router), or ``"replay"`` with ``trace`` (a
    :class:`specmoe.Trace` of this model's routing shape): every token routes to the trace's
    experts instead, for benchmarks and research on real access patterns with stand-in
    weights (:meth:`specmoe.Engine.replay_routing`; CPU tier, dense layers in C).
    hf_kwargs: ``attn_implementation`` and config overrides, as for transformers."""
    from ..runtime import misses
    from .dense import GgufDense, resolve_dense
    from ..runtime.gpu_engine import resolve_device
    from ..runtime.engine import Engine, check_early, check_prefetch_arg
    # bad values fail before any conversion ("auto" is resolved once the checkpoint is open)
    early = "bf16" if dtype == "auto" else dtype
    if gpu_cache is not None:  # the hybrid tier: the GPU cache's size, the balancer on
        if device in (None, "cpu") or (isinstance(device, str) and device.startswith("cpu")):
            raise ValueError("gpu_cache: the hybrid tier needs device='cuda' (or 'cuda:N'); "
                             "on the CPU the expert cache is cache=")
        cache = gpu_cache
        if balance is False or balance is None:
            balance = True
    if memory is not None and not (device in (None, "cpu") or (
            isinstance(device, str) and device.startswith("cpu"))):
        raise ValueError("memory= plans host memory for the CPU tier; on a GPU size the caches "
                         "with cache= / gpu_cache=")
    if isinstance(k_max, bool) or not isinstance(k_max, int) or k_max < 0:
        raise ValueError(f"k_max must be an int >= 0 (the drafts a verification carries), got "
                         f"{k_max!r}")
    if memory is not None:
        from ..runtime.memplan import memory_budget
        budget, budget_source = memory_budget(memory)  # a bad value fails before any work
    if cache is None and memory is None:
        cache = 0.25
    check_early(early, cache if cache is not None else 0.25, policy, prefetch)
    if route not in ("model", "replay"):
        raise ValueError(f"route={route!r}: choose 'model' or 'replay' (with trace=)")
    if (route == "replay") != (trace is not None):
        raise ValueError("route='replay' needs trace= (a specmoe.Trace), and trace= needs "
                         "route='replay'")
    if route == "replay" and not (device in (None, "cpu") or (isinstance(device, str) and
                                                                device.startswith("cpu"))):
        raise ValueError("route='replay' runs on the CPU tier (device='cpu')")
    gpu_opts = dict(policy=policy, dense=dense, miss=miss, route_lambda=route_lambda,
                    throttle=throttle, balance=balance)
    gpu = resolve_device(device, dtype=early, **gpu_opts)
    resolve_dense(dense, torch.float32)  # bad values fail before any work
    misses.check_throttle(throttle)  # bad settings fail before any conversion (miss_keep is
    misses.check_miss(miss, 0, route_lambda, 0)  # checked against top_k by the Engine)
    misses.check_levels(miss_levels, None, 0, 2)  # (miss_keep2 too)
    ckpt = open_checkpoint(path)
    if dense == "gguf" and not hasattr(ckpt, "dense_blocks"):  # not a GgufCheckpoint
        ckpt.close()
        raise ValueError(f"{ckpt.folder}: dense='gguf' keeps a GGUF file's dense blocks; this "
                         "checkpoint is not a GGUF file (dense='auto', 'int8' or 'int4')")
    dtype = store_dtype(ckpt, dtype)
    if gpu is not None and dtype != early:
        from ..runtime.gpu_engine import check_gpu_options
        check_gpu_options(dtype=dtype, **gpu_opts)
    plan = _prepare(ckpt, dtype, torch_dtype, dict(hf_kwargs), store)
    mplan = None
    if memory is not None:
        mplan = _plan_memory(plan, dtype, budget, budget_source, cache, dense, prefetch,
                             k_max)
        if progress:
            print(f"[specmoe] {mplan}", file=sys.stderr, flush=True)
        if cache is None:
            cache = mplan.cache_slots
        if dense == "auto" and mplan.dense != mplan.candidates[0]["dense"]:
            dense = mplan.dense  # the model's own exact format is what "auto" keeps
    elif dense == "auto" and gpu is None and _auto_gguf(plan):
        dense = "gguf"
    _check_cache_fits(plan, cache, dtype)  # from the config: before converting
    try:
        spath = _ensure_store(plan, plan.ckpt.folder, dtype, plan.store, force_convert,
                              progress)
        if plan.unused:
            warnings.warn(f"{plan.ckpt.folder}: {len(plan.unused)} checkpoint tensors are not "
                          f"used by the model (e.g. {plan.unused[0]})", stacklevel=2)
        held = _dense_blocks(plan) if dense == "gguf" else {}
        # the layers held as blocks are not dequantized (their weights stay on the meta
        # device until convert_dense replaces them): no bf16 copy of them is ever made
        _load_dense(plan, skip={f"{n}.weight" for n in held})
        # handed to the Engine, whose convert_dense runs the layers on them
        gguf_dense = GgufDense(held, _mla_blocks(plan)) if dense == "gguf" else None
    finally:
        plan.ckpt.close()
    model = plan.model
    gen = plan.ckpt.folder / "generation_config.json"
    if isinstance(plan.ckpt, Checkpoint) and gen.is_file():
        from transformers import GenerationConfig
        model.generation_config = GenerationConfig.from_pretrained(plan.ckpt.folder)
    model.eval()
    if gpu is not None:
        from ..runtime.gpu_engine import GpuEngine
        geng = GpuEngine(model, spath, device=gpu, cache=cache, policy=policy,
                         prefetch=prefetch, verify=True, balance=balance, miss=miss,
                         miss_keep=miss_keep, route_lambda=route_lambda, miss_levels=miss_levels,
                         miss_keep2=miss_keep2, throttle=throttle)
        if prefetch == "learned":
            _token_pieces(geng, path)
        return model
    predictor = check_prefetch_arg(prefetch)
    eng = Engine(model, spath, cache=cache, policy=policy,
                 prefetch=prefetch if predictor != "oracle" else False, direct=direct,
                 verify=True, dense=dense, miss=miss, miss_keep=miss_keep,
                 route_lambda=route_lambda, throttle=throttle, miss_levels=miss_levels,
                 miss_keep2=miss_keep2, gguf_dense=gguf_dense)
    eng.memory_plan = mplan
    if predictor == "learned":
        _token_pieces(eng, path)
    if trace is not None:
        try:
            eng.replay_routing(trace)
            if predictor == "oracle":
                eng.set_prefetch(True, predictor="oracle")
        except BaseException:
            eng.close()
            raise
    return model

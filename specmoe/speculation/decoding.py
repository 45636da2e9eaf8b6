"""Model calls shared by the drafters, MTP and the generation loops: the draft a drafter returns
(:class:`Draft`), the result of :func:`specmoe.generate` (:class:`GenerateOutput`), and the
transformers-cache plumbing (:func:`cache_kwargs`, :func:`new_kv`, :func:`crop_kv`,
:func:`forward_tokens`).  It imports no other part of the speculation code, so every part can
import it."""
from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass, field
from typing import Any, Dict, Iterator, List, Optional, Sequence

import numpy as np
import torch
from torch import nn

from ..runtime.kvcache import recording_state_layers

__all__ = ["Draft", "GenerateOutput", "cache_kwargs", "crop_kv", "forward_tokens",
           "input_device", "last_logits_kwargs", "new_kv", "nothing_recorded",
           "recording_state_layers", "recurrent_layer_types", "records_recurrent_states",
           "records_window", "require_recording_planned", "require_speculable", "unrecorded",
           "unrollable_layer_types"]


@dataclass
class Draft:
    """What a drafter proposes for one iteration.

    tokens: the draft token ids (may be fewer than asked, or none).
    probs: float32 [len(tokens), V] distributions the tokens were sampled from, or None for a
        deterministic proposal (n-gram lookup, greedy drafting).
    routing: for a drafter that runs the target's routers (:class:`SelfDraft`): MoE layer
        position -> activation counts [E] over the verification inputs the draft routed.
    token_routing: the same drafter's top-k expert ids per verification input it routed,
        MoE layer position -> [n, k] in the router's order (the routing fidelity's rows,
        :meth:`specmoe.runtime.engine.Engine.lookahead`).
    token_confidence: their router weights, position -> float32 [n, k] (the expert lookahead
        buffer's confidence scores, MoE-SpeQ Sec. 3.3.1).
    """

    tokens: List[int]
    probs: Optional[torch.Tensor] = None
    routing: Optional[Dict[int, np.ndarray]] = None
    token_routing: Optional[Dict[int, np.ndarray]] = None
    token_confidence: Optional[Dict[int, np.ndarray]] = None


@functools.lru_cache(maxsize=None)
def _forward_params(fwd: Any) -> frozenset:
    """The parameter names of a model class's forward function (read once per class)."""
    return frozenset(inspect.signature(fwd).parameters)


def cache_kwargs(model: nn.Module, kv: Any) -> Dict[str, Any]:
    """The keyword that hands ``kv`` to ``model``'s forward: ``cache`` from transformers 5.24
    (``past_key_values`` is deprecated there, to go in 5.40), ``past_key_values`` before."""
    return {"cache" if "cache" in _forward_params(type(model).forward)
            else "past_key_values": kv}


def last_logits_kwargs(model: nn.Module) -> Dict[str, Any]:
    """``logits_to_keep=1`` where ``model``'s forward takes it (transformers' causal LMs):
    lm_head then runs on the last position alone.  For a forward whose other rows nobody
    reads (a prompt), which would otherwise pay a [positions, vocab] product and its copy."""
    return {"logits_to_keep": 1} if "logits_to_keep" in _forward_params(type(model).forward) \
        else {}


def input_device(model: nn.Module) -> torch.device:
    """Where ``model`` takes its input ids (its input embeddings' device: a model on the GPU
    tier takes them on the GPU)."""
    emb = model.get_input_embeddings()
    w = getattr(emb, "weight", None)
    return w.device if isinstance(w, torch.Tensor) else torch.device("cpu")


def forward_tokens(model: nn.Module, ids: Sequence[int], kv: Any,
                   last: bool = False) -> torch.Tensor:
    """Logits [n, V] of ``ids`` after the cache ``kv``, on the CPU (the decoding loop reads
    them as numpy).  ``last``: only the last position's, [1, V], computed on that row alone
    where the model allows (:func:`last_logits_kwargs`)."""
    x = torch.tensor([list(ids)], dtype=torch.long, device=input_device(model))
    with torch.no_grad():
        out = model(input_ids=x, use_cache=True, **cache_kwargs(model, kv),
                    **(last_logits_kwargs(model) if last else {}))
    return out.logits[0, -1:].cpu() if last else out.logits[0].cpu()


def recurrent_layer_types(config: Any) -> List[str]:
    """The layer kinds of ``config`` whose cache holds a recurrent state (linear attention,
    Mamba, short convolutions) rather than per-position keys and values: such a cache cannot
    be cropped back to an accepted prefix."""
    kinds = list(getattr(config, "layer_types", None) or [])
    try:
        kinds += list(getattr(config, "layers_block_type", None) or [])
    except (AttributeError, TypeError, ValueError):
        pass
    return sorted({str(k) for k in kinds
                   if any(r in str(k) for r in ("linear", "conv", "mamba"))})


def unrollable_layer_types(config: Any) -> List[str]:
    """The layer kinds of ``config`` (of :func:`recurrent_layer_types`) whose state no crop
    puts back: linear attention and Mamba fold every position into one state.  A short
    convolution (LFM2's ``conv`` layers) keeps only its last positions, which a cache
    recording its past (``new_kv(rollback=True)``) cuts back like keys and values."""
    return [k for k in recurrent_layer_types(config) if "conv" not in k]


def records_recurrent_states(model: nn.Module) -> bool:
    """Whether a cache of ``model`` made by ``new_kv(model, rollback=True, window=n)`` keeps
    the states of its linear-attention and Mamba layers (:func:`unrollable_layer_types`) after
    each of the last n tokens, so that cutting it back by up to n positions puts them back:
    transformers 5.25 on (the cache layers' ``activate_past_recording`` takes
    ``recurrent_states_to_keep``), for a modeling module whose layers compute those
    intermediate states (it calls ``get_recurrent_states_to_keep``: Qwen3-Next, Qwen3.5,
    Jamba, Kimi-Linear, Ling, GraniteMoeHybrid, ...).  True for a model without such layers."""
    if not unrollable_layer_types(model.config):
        return True
    cls = type(model)
    if cls not in _RECORDS:
        import sys
        mod = sys.modules.get(cls.__module__)
        try:
            src = inspect.getsource(mod) if mod is not None else ""
        except (OSError, TypeError):
            src = ""
        ok = "get_recurrent_states_to_keep" in src
        if ok:
            try:
                ok = records_window(new_kv(model))
            except Exception:  # noqa: BLE001 (a cache that cannot be built records nothing)
                ok = False
        _RECORDS[cls] = ok
    return _RECORDS[cls]
_RECORDS: Dict[type, bool] = {}  # model class -> records_recurrent_states


def require_speculable(model: nn.Module, who: str, instead: str,
                       windowed: bool = False) -> None:
    """ValueError naming ``who`` (speculative decoding: it verifies drafts in one multi-token
    forward and cuts the cache back to the accepted ones) and what to do ``instead`` when
    ``model`` cannot give plain decoding's tokens that way: layers whose state no crop puts
    back (:func:`unrollable_layer_types`; ``windowed``: the caller cuts back only within the
    window of a cache from ``new_kv(rollback=True, window=...)``, and layers whose states such
    a cache records, :func:`records_recurrent_states`, are accepted), or a sparse-attention
    indexer (DeepSeek-V3.2, GLM-5, A.X K2), whose keys transformers selects differently depending on how the tokens
    are split into forwards once the context passes ``index_topk`` (measured on transformers
    5.24 with index_topk 16 and 20 cached positions: DeepSeek-V3.2's four-token forward
    apart from four one-token steps by 0.045 in the logits; GLM-5's and A.X K2's prefill
    apart from one-token steps by 0.003 and 0.0004)."""
    cfg = model.config
    rec = unrollable_layer_types(cfg)
    if rec and not (windowed and records_recurrent_states(model)):
        why = (" (transformers >= 5.25 records those states for the models whose modeling "
               "code supports it; not for this one here)") if windowed else ""
        raise ValueError(f"{who} rolls the cache back to the accepted prefix, and "
                         f"{cfg.model_type}'s {'/'.join(rec)} layers keep a recurrent "
                         f"state that cannot be rolled back{why}; {instead}")
    topk = getattr(cfg, "index_topk", None)
    if topk is not None:
        raise ValueError(f"{who} verifies drafts in one multi-token forward, and "
                         f"{cfg.model_type}'s sparse-attention indexer (index_topk {topk}) "
                         "selects other keys in transformers depending on how the tokens "
                         f"are split into forwards, past {topk} positions; {instead}")


def require_recording_planned(model: nn.Module, engine: Any, k_max: int, caller: str,
                              rows: int = 1) -> None:
    """Under a memory plan (``from_pretrained(memory=...)``, ``engine.memory_plan``), refuse
    speculation whose verifications would record more recurrent states than the plan set
    aside: on a linear-attention hybrid each verification of ``k_max`` drafts holds the
    states of k_max + 1 tokens until its crop (:func:`specmoe.runtime.memplan.
    recording_layout`: about 725 MiB at Qwen3-Next-80B's shapes and k_max 8), and a batch's
    ``rows`` times that.  Nothing to check without a plan, without drafts, or on a model that
    records no recurrent state."""
    plan = getattr(engine, "memory_plan", None)
    rows = max(1, int(rows))
    if plan is None or k_max <= 0 or plan.record_tokens >= rows * (k_max + 1) \
            or not records_recurrent_states(model):
        return
    from ..runtime.memplan import recording_layout
    per, state = recording_layout(model.config, next(model.parameters()).dtype.itemsize)
    if per == 0:
        return
    need = rows * ((k_max + 1) * per + state)
    planned = max(plan.record_tokens - 1, 0)
    each = f" in each of {rows} rows" if rows > 1 else ""
    fit = (plan.record_tokens // rows) - 1  # the most drafts a row the plan holds
    raise ValueError(f"{caller}: a verification of {k_max} drafts{each} on this model records "
                     f"{need / 2**20:.0f} MiB of recurrent states until it is cut back, "
                     f"which the memory plan of {plan.budget_bytes / 2**30:.2f} GiB did not set "
                     f"aside (it planned for {planned} drafts in all): load the model with "
                     f"from_pretrained(..., memory=..., k_max={rows * (k_max + 1) - 1}), or "
                     + (f"pass a controller with k_max <= {fit}" if fit > 0
                        else "decode without a drafter"))


def new_kv(model: nn.Module, rollback: bool = False, window: int = 0) -> Any:
    """An empty KV cache for ``model``: the cache class its modeling module defines, where it
    defines one and its forward accepts no other (MiniMax's ``MiniMaxCache``), else
    transformers' ``DynamicCache`` for its config.  ``rollback``: the cache will be cut back
    to accepted prefixes (:func:`crop_kv`); its sliding-window layers then keep the positions
    past their window until the next crop (transformers' past recording), without which a
    crop once the window is full raises (GPT-OSS past 128 tokens).  ``window`` > 0 with
    ``rollback``: the most positions one crop will remove; linear-attention and Mamba layers
    that can (:func:`records_recurrent_states`) keep their states after each of the last
    ``window`` tokens of a forward for it (a copy of the state per token until the crop)."""
    from transformers import DynamicCache
    own = _own_cache(type(model))
    kv = own() if own is not None else DynamicCache(config=model.config)
    if rollback and hasattr(kv, "activate_past_recording"):
        if window > 0 and records_window(kv):
            kv.activate_past_recording(recurrent_states_to_keep=int(window))
        else:
            kv.activate_past_recording()
    return kv


def records_window(kv: Any) -> bool:
    """Whether every layer of ``kv`` that keeps a recurrent state can record a window of them
    (its ``activate_past_recording`` takes ``recurrent_states_to_keep``)."""
    rec = [lay for lay in getattr(kv, "layers", None) or () if hasattr(lay, "recurrent_states")]
    return bool(rec) and all(_layer_takes_window(type(lay)) for lay in rec)


@functools.lru_cache(maxsize=None)
def _layer_takes_window(cls: type) -> bool:
    """Whether cache layer class ``cls``'s ``activate_past_recording`` takes
    ``recurrent_states_to_keep`` (read once per class: every request makes a cache)."""
    return "recurrent_states_to_keep" in inspect.signature(cls.activate_past_recording).parameters


def _own_cache(cls: type) -> Optional[type]:
    """The one ``DynamicCache`` subclass defined in ``cls``'s modeling module, or None."""
    if cls not in _OWN_CACHE:
        import sys

        from transformers import DynamicCache
        mod = sys.modules.get(cls.__module__)
        found = [c for c in vars(mod).values()
                 if isinstance(c, type) and issubclass(c, DynamicCache) and c is not DynamicCache
                 and c.__module__ == cls.__module__] if mod is not None else []
        _OWN_CACHE[cls] = found[0] if len(found) == 1 else None
    return _OWN_CACHE[cls]
_OWN_CACHE: Dict[type, Optional[type]] = {}  # model class -> its modeling module's cache class


@contextlib.contextmanager
def unrecorded(kv: Any) -> Iterator[None]:
    """Within: the linear-attention and Mamba layers of ``kv`` record no states (a forward
    that will not be cut back: a step without drafts), so their one-call decode steps run
    (specmoe.models.linear_attn: they give way while a layer records) and no state is copied;
    recording is back on after, before the crop that follows.  Measured at Qwen3.5-35B-A3B's
    per-layer shapes (benchmarks/hybrid_spec.py): a one-token forward on a recording cache
    cost 1.5-2.5x a plain step.  Sliding-window layers keep recording: a crop past their window
    needs it."""
    layers = recording_state_layers(kv)
    for lay in layers:
        lay.record_past = False
    try:
        yield
    finally:
        for lay in layers:
            lay.record_past = True


def crop_kv(kv: Any, keep: int) -> None:
    """Drop KV entries beyond the first ``keep`` positions (transformers 5 crops by a negative
    count of positions to remove).  A cache recording its past (``new_kv(rollback=True)``) is
    cropped even at ``keep`` = its length: that trims its sliding-window layers back to their
    window, and a recurrent layer's recorded states and grown conv window (one whose last
    step ran :func:`unrecorded` is left alone); cut-back conv windows are made contiguous."""
    n = int(kv.get_seq_length())
    if keep < n:
        kv.crop(keep - n)
    else:
        # keep = n: each recording layer trimmed back, but a linear-attention or Mamba layer
        # whose last step ran unrecorded (:func:`unrecorded`) is left as it is -- its crop(0)
        # would only put a new view of the same window in its place, and a decode plan holds
        # while its state tensors stay the same objects
        # (specmoe.models.linear_attn.gdn_chain_state)
        for lay in getattr(kv, "layers", ()):
            if getattr(lay, "record_past", False) and not nothing_recorded(lay):
                lay.crop(0)
    # a cut-back conv window is a view into the recorded columns: made contiguous again, as
    # the one-call recurrent steps take only contiguous windows; a restored recurrent state
    # that is one of the states GdnBlock.steps wrote side by side is copied out, so the other
    # states of that verification are freed (the memory plan counts one verification's)
    for lay in getattr(kv, "layers", ()):
        if not hasattr(lay, "recurrent_states"):
            continue
        for name in ("conv_states", "recurrent_states"):
            got = getattr(lay, name, None)
            if not isinstance(got, (dict, list)):
                continue
            for i in (got.keys() if isinstance(got, dict) else range(len(got))):
                c = got[i]
                if not isinstance(c, torch.Tensor):
                    continue
                if not c.is_contiguous():
                    got[i] = c.contiguous()
                elif name == "recurrent_states" and \
                        c.untyped_storage().nbytes() > c.numel() * c.element_size():
                    got[i] = c.clone()


def nothing_recorded(lay: Any) -> bool:
    """Whether a recording linear-attention layer has nothing recorded since its last crop:
    no recurrent state in its history and its conv windows at the kernel's size (False for
    any other layer, or where those attributes are not transformers 5.25's)."""
    hist = getattr(lay, "recurrent_states_history", None)
    convs = getattr(lay, "conv_states", None)
    sizes = getattr(lay, "conv_kernel_size", None)
    if not (hasattr(lay, "recurrent_states") and isinstance(hist, dict)
            and isinstance(sizes, dict) and isinstance(convs, (list, dict))):
        return False
    if any(len(h) for h in hist.values()):
        return False
    for i, k in sizes.items():
        c = convs.get(i) if isinstance(convs, dict) else (convs[i] if i < len(convs) else None)
        if isinstance(c, torch.Tensor) and (k is None or c.shape[-1] != k):
            return False
    return True


@dataclass
class GenerateOutput:
    """Result of :func:`generate`.

    sequences: [1, prompt + new] token ids (like ``model.generate``).
    stats: ``new_tokens``, ``iterations``, ``time_s``, ``tok_per_s``, ``proposed``, ``accepted``,
        ``acceptance`` (accepted / proposed), ``etr`` (tokens per iteration), ``k_mean``,
        ``experts_loaded`` and ``experts_loaded_per_token`` (offloaded models),
        ``stall_s``, ``lookahead_precision`` / ``lookahead_recall`` (draft-driven prefetch) and
        their counts ``lookahead_predicted`` (experts predicted, summed over layers and
        passes), ``lookahead_used`` (experts the verifications used) and ``lookahead_hits``.
    iterations: one dict per iteration: ``k_planned``, ``k`` (drafts verified), ``accepted``,
        ``emitted``, ``t_iter``, ``t_end`` (its ``time.perf_counter()`` at the end: the time
        between two ends spans every step in between), ``t_draft``, ``experts_loaded``.
    """

    sequences: torch.Tensor
    stats: Dict[str, Any] = field(default_factory=dict)
    iterations: List[Dict[str, Any]] = field(default_factory=list)

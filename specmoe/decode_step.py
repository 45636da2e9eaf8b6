"""A one-token decode forward without transformers' model-level Python around the layers.

Once a decoder layer's decode step is one C call (:mod:`specmoe.attention`,
:mod:`specmoe.mla`) and ``lm_head`` is a :class:`specmoe.dense.CLinear`, most of what is left of
a step's time outside C is the model's own forward around the layers: the output-capturing and
config-merging decorators, ``create_causal_mask``, the output dataclasses, ``ModuleList``
slicing.  py-spy on OLMoE shapes (int4, 1 thread, ``model.generate``): 20% of a step outside
specmoe's C, of which ~5.7 points in the two model forwards around the layers.

For the calls where it changes nothing, :class:`DecodeStep` replaces the causal LM's forward
(an instance attribute, so ``model(...)``'s hooks still run: specmoe's
:class:`specmoe.dense.DecodeThreads` among them) with the plain sequence of those models::

    h = embed_tokens(ids); pe = rotary_emb(h, position_ids)
    for layer in layers: h = layer(h, position_embeddings=pe, attention_mask=None, ...)
    logits = lm_head(norm(h))

and the layers whose step is one C call (``layer._specmoe_chain``: specmoe.attention's and
specmoe.mla's one-call layers, their MoE block routed in C) run together in one
``_C.layer_chain`` call, the GIL released once, each layer's output one of two buffers of the
step and the next one's input.  After a layer's weights have streamed through the CPU caches,
every return to the interpreter is cold: py-spy at OLMoE shapes, bf16, 2 threads, a step's
time outside C fell from ~15 % (one call per layer) to ~9 % (one chain) of the samples.

The step serves every model in :data:`specmoe.arch.DECODE_STEP_MODELS` (their forwards were
read for it), one token of one sequence on a ``DynamicCache``, no padding, no gradients,
nothing asked for beyond the logits.  With one query every cached position is seen, so the attention mask
is None -- except past a sliding window, which such a call leaves to the model's forward.
Anything else (prefill, verification chunks, batches, hooks on the inner model, extra
outputs) goes to the model's own forward.  The logits are those of the model's forward: the
same modules run on the same inputs, and the one-call layers already read a None mask and a
full mask of one row alike.
"""
from __future__ import annotations

import contextlib

from typing import Any

import torch
from torch import nn
from transformers.cache_utils import DynamicCache

from . import _C
from .arch import DECODE_STEP_MODELS
from .kvcache import kv_advance

__all__ = ["DecodeStep", "install_decode_step"]

# keyword arguments of a causal LM's forward a decode step may carry, with the values that
# change nothing here (None: not given)
_BENIGN = {"return_dict": (None, True), "output_attentions": (None, False),
           "output_hidden_states": (None, False), "output_router_logits": (None, False),
           "logits_to_keep": (None, 0, 1)}


class DecodeStep:
    """The causal LM's forward while installed (:func:`install_decode_step`).

    ``enabled``: False sends every call to the model's own forward.  ``steps`` and
    ``fallbacks`` count the calls taken here and, while enabled, the calls handed on;
    ``chained`` the layer steps run through ``_C.layer_chain``; ``chaining`` False runs every
    layer through its forward."""

    def __init__(self, model: nn.Module, original: Any):
        self.model = model
        self.original = original
        self.enabled = True
        self.steps = 0
        self.fallbacks = 0
        self.chaining = True
        self.chained = 0          # layer steps run through _C.layer_chain
        self.chain = _C.layer_chain  # (a benchmark may time it through a wrapper)
        cfg = model.config
        self._window = getattr(cfg, "sliding_window", None) or None
        if getattr(cfg, "use_sliding_window", True) is False:
            self._window = None
        self._n_layers = int(cfg.num_hidden_layers)
        self._router_logits = bool(getattr(cfg, "output_router_logits", False))
        # the model's output class and its cache field, read off its first own forward
        self._out: tuple[type, str] | None = None

    def _learn(self, out: Any, cache: Any) -> None:
        """The output class and cache field name of the model's forward (``out``, given
        ``cache``), so a step returns what the model does."""
        if self._out is not None or cache is None or not hasattr(out, "keys"):
            return
        for name in out.keys():
            if out[name] is cache:
                self._out = (type(out), name)
                return

    def _cache(self, kwargs: dict[str, Any]) -> Any:
        c = kwargs.get("cache")
        return kwargs.get("past_key_values") if c is None else c

    def _plain(self, args: tuple, kwargs: dict[str, Any]) -> tuple[torch.Tensor, Any, int] | None:
        """(input_ids [1, 1], cache, cached positions S) when this call is a plain one-token
        step of one sequence, else None."""
        if self._out is None or len(args) > 1 or self.model.training \
                or torch.is_grad_enabled():
            return None
        ids = args[0] if args else kwargs.get("input_ids")
        if not isinstance(ids, torch.Tensor) or ids.shape != (1, 1) \
                or ids.device.type != "cpu" or ids.dtype != torch.long:
            return None
        for k, v in kwargs.items():
            if k in ("input_ids", "attention_mask", "position_ids", "cache", "past_key_values",
                     "use_cache", "cache_position"):
                continue
            ok = _BENIGN.get(k)
            if ok is None or not any(v is o or (type(v) is int and v == o) for o in ok):
                return None
        if kwargs.get("output_router_logits") is None and self._router_logits:
            return None
        if kwargs.get("use_cache") is False:
            return None
        cache = self._cache(kwargs)
        if type(cache) is not DynamicCache:
            return None
        S = cache.get_seq_length()
        if self._window is not None and S + 1 > self._window:
            return None
        mask = kwargs.get("attention_mask")
        if mask is not None and (not isinstance(mask, torch.Tensor) or mask.dim() != 2
                                 or mask.shape != (1, S + 1) or not bool(mask.all())):
            return None
        for name in ("position_ids", "cache_position"):
            p = kwargs.get(name)
            if p is not None and (not isinstance(p, torch.Tensor) or p.numel() != 1
                                  or int(p.reshape(())) != S):
                return None
        base = self.model.model
        if base._forward_hooks or base._forward_pre_hooks \
                or torch.nn.modules.module._global_forward_hooks \
                or torch.nn.modules.module._global_forward_pre_hooks \
                or len(base.layers) < self._n_layers:
            return None
        return ids, cache, S

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.enabled:
            return self.original(*args, **kwargs)
        plain = self._plain(args, kwargs)
        if plain is None:
            self.fallbacks += 1
            out = self.original(*args, **kwargs)
            self._learn(out, self._cache(kwargs))
            return out
        ids, cache, S = plain
        model = self.model
        base = model.model
        h = base.embed_tokens(ids)
        pos = torch.tensor([[S]])
        pe = base.rotary_emb(h, pos)
        layers = base.layers
        # runs of one-call layers go to C together (_C.layer_chain), each layer's output in
        # one of two buffers of this step, the next layer's input; any other layer (hooks on
        # it, a block routed in Python, the dense first layer) takes its forward
        bufs = (torch.empty_like(h), torch.empty_like(h))
        run: list[tuple] = []
        for i in range(self._n_layers):
            lyr = layers[i]
            chain = getattr(lyr, "_specmoe_chain", None)
            if chain is not None and self.chaining \
                    and not (lyr._forward_hooks or lyr._forward_pre_hooks):
                out = bufs[0] if h.data_ptr() != bufs[0].data_ptr() else bufs[1]
                item = chain(lyr, h, out, pe, cache)
                if item is not None:
                    run.append(item)
                    h = out
                    continue
            self._run_chain(run)
            h = lyr(h, position_embeddings=pe, attention_mask=None, position_ids=pos,
                    cache=cache, use_cache=True)
        self._run_chain(run)
        logits = model.lm_head(base.norm(h))
        self.steps += 1
        cls, field = self._out  # type: ignore[misc]
        return cls(logits=logits, **{field: cache})

    def _run_chain(self, run: list[tuple]) -> None:
        """The layers of ``run`` (items of the layers' ``_specmoe_chain``: block, arguments,
        KV buffers, Engine) in one C call, then their caches advanced; ``run`` emptied."""
        if not run:
            return
        # the Engine of the chain's MoE layers holds close() off while they run (a chain of
        # dense layers alone has none)
        eng = next((it[3] for it in run if it[3] is not None), None)
        with eng._layer_call_slot() if eng is not None else contextlib.nullcontext():
            self.chain(tuple((it[0], it[1]) for it in run))
        for it in run:
            kv_advance(it[2], 1)
        self.chained += len(run)
        run.clear()


def install_decode_step(model: nn.Module) -> bool:
    """Give ``model`` (a causal LM of :data:`specmoe.arch.DECODE_STEP_MODELS`) the
    :class:`DecodeStep` forward; False, unchanged, for other models.  Idempotent; the step is
    ``model._specmoe_decode_step``."""
    if getattr(model, "_specmoe_decode_step", None) is not None:
        return True
    if type(model).__name__ not in DECODE_STEP_MODELS:
        return False
    base = getattr(model, "model", None)
    if base is None or "forward" in vars(base) or "forward" in vars(model):
        return False  # someone else's forward already
    if not all(hasattr(base, a) for a in ("embed_tokens", "rotary_emb", "layers", "norm")):
        return False
    kinds = set(getattr(model.config, "layer_types", None) or ["full_attention"])
    if not kinds <= {"full_attention", "sliding_attention"}:
        return False
    step = DecodeStep(model, model.forward)
    model.forward = step
    model._specmoe_decode_step = step
    return True

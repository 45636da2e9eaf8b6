"""A one-token decode forward without transformers' model-level Python around the layers.

Once a decoder layer's decode step is one C call (:mod:`specmoe.models.attention`,
:mod:`specmoe.models.mla`) and ``lm_head`` is a :class:`specmoe.models.layers.CLinear`, most of what is left of
a step's time outside C is the model's own forward around the layers: the output-capturing and
config-merging decorators, ``create_causal_mask``, the output dataclasses, ``ModuleList``
slicing.  py-spy on OLMoE shapes (int4, 1 thread, ``model.generate``): 20% of a step outside
specmoe's C, of which ~5.7 points in the two model forwards around the layers.

For the calls where it changes nothing, :class:`DecodeStep` replaces the causal LM's forward
(an instance attribute, so ``model(...)``'s hooks still run: specmoe's
:class:`specmoe.models.dense.DecodeThreads` among them) with the plain sequence of those models::

    h = embed_tokens(ids); pe = rotary_emb(h, position_ids)
    for layer in layers: h = layer(h, position_embeddings=pe, attention_mask=None, ...)
    logits = lm_head(norm(h))

and the layers whose step is one C call (``chain_step(layer)``: specmoe.models.attention's and
specmoe.models.mla's one-call layers, their MoE block routed in C) run together in one
``_C.layer_chain`` call, the GIL released once, each layer's output one of two buffers of the
step and the next one's input.  After a layer's weights have streamed through the CPU caches,
every return to the interpreter is cold: py-spy at OLMoE shapes, bf16, 2 threads, a step's
time outside C fell from ~15 % (one call per layer) to ~9 % (one chain) of the samples.  Where
every layer is such a layer, the whole step -- embedding row, rotary row, layers, final norm,
``lm_head`` -- is one ``_C.DecodePlan.step`` (:class:`DecodeStep`'s plans), and
:func:`specmoe.generate`'s plain greedy steps call it without the forward around it
(:meth:`DecodeStep.greedy_next`).

The step serves every model in :data:`specmoe.models.arch.DECODE_STEP_MODELS` (their forwards were
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
import inspect
import logging
import weakref

from typing import Any

import torch
from torch import nn
from transformers.cache_utils import DynamicCache

from .. import _C
from .arch import DECODE_STEP_MODELS
from .layers import CRMSNorm, chain_step
from ..runtime.kernels import tensor_array
from ..runtime.kvcache import kv_advance, kv_views, recording_state_layers

_log = logging.getLogger(__name__)

# rotary embeddings whose tables depend on the position only (a "dynamic" or "longrope"
# rotary rescales its frequencies with the length of the call: no table of its own)
_TABLE_ROPES = ("default", "linear", "llama3", "yarn")
# a plan's rotary tables cover at least this many positions, and twice the cached length
_PLAN_MIN_POSITIONS = 512
# steps a plain step waits before trying again to build a plan after a build declined
_PLAN_RETRY_STEPS = 16

__all__ = ["DecodeStep", "install_decode_step"]

# keyword arguments of a causal LM's forward a decode step may carry, with the values that
# change nothing here (None: not given)
_BENIGN = {"return_dict": (None, True), "output_attentions": (None, False),
           "output_hidden_states": (None, False), "output_router_logits": (None, False),
           "logits_to_keep": (None, 0, 1)}


class _Plan:
    """What a :class:`DecodeStep` keeps of its ``_C.DecodePlan`` between steps: the plan, the
    objects its validity is checked against at each step (:meth:`DecodeStep._plan_valid`),
    and the buffers it reads and writes."""

    __slots__ = ("c", "cache", "limit", "views", "states", "counted", "layers", "mods", "engine",
                 "eng_layers", "x0", "last", "normed", "vocab", "logits_dtype", "scratch",
                 "__weakref__")

    def __init__(self, **kw: Any) -> None:
        for k, v in kw.items():
            setattr(self, k, v)


class DecodeStep:
    """The causal LM's forward while installed (:func:`install_decode_step`).

    ``enabled``: False sends every call to the model's own forward.  ``steps`` and
    ``fallbacks`` count the calls taken here and, while enabled, the calls handed on;
    ``chained`` the layer steps run through ``_C.layer_chain`` or a plan; ``chaining`` False
    runs every layer through its forward.

    Plans.  When every layer of the model is a one-call layer, the step is one
    ``_C.DecodePlan.step`` call (``planned`` counts them): the embedding row, the rotary
    table's row, all the layers, the final norm and ``lm_head`` with the GIL released once;
    Python is left the KV cache's views and the output object.  A plan is built at a plain
    step for the generation's cache (:meth:`_make_plan`): three hidden-state buffers, the
    layers' chain items over them, the rotary arrays the items read as tables over every
    position up to twice the cached length (built by the model's own ``rotary_emb``, so a row
    is what the step would compute: checked on the build step's row, bit for bit), the
    embedding matrix.  Each later step checks that nothing it rests on changed (the cache
    object, each layer's KV buffers and length (a crop or a forward of several tokens keeps
    them; an assignment or a regrowth does not), the capacity of the KV buffers
    and tables, hooks, the Engine's layers object and routing) and otherwise rebuilds it, or
    takes the per-layer path above.  ``planning`` False never builds one.  py-spy and timers
    at OLMoE shapes (int4, 2 threads): outside the C calls a step spent ~0.3 ms in the
    embedding, the rotary table, the chain items and the final norm."""

    def __init__(self, model: nn.Module, original: Any, own_hooks: Any = None):
        self.model = model
        self.original = original
        # inspect.signature(model.forward) is the original's, not (*args, **kwargs):
        # transformers' generate reads it to pass logits_to_keep=1 to a prompt's forward
        # (without it lm_head ran over every prompt position: a [L, vocab] product and its
        # logits, 1024 x 102400 at DeepSeek-V2-Lite shapes) and to check the kwargs it is given
        self.__signature__ = inspect.signature(original)
        self.enabled = True
        # the forward hooks the plan may run beside (specmoe.models.dense's DecodeThreads,
        # which convert_dense installs and hands over); any other hook on the model sends
        # the step to the model's own forward
        self.own_hooks: Any = own_hooks
        self.steps = 0
        self.fallbacks = 0
        self.chaining = True
        self.chained = 0          # layer steps run through _C.layer_chain
        self.chain = _C.layer_chain  # (a benchmark may time it through a wrapper)
        self.planning = True
        self.planned = 0          # steps run as one _C.DecodePlan.step
        self.plan_step = _C.DecodePlan.step  # (a benchmark may time it through a wrapper)
        self._plan: _Plan | None = None
        self._plan_retry = 0      # steps (self.steps) before another build is tried
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
        S = int(cache.get_seq_length())
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
        plan = self._plan_for(cache, S)
        if plan is not None:
            out = self._run_plan(plan, int(ids[0, 0]), cache, S)
            if out is not None:
                return out
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
        counted: list[nn.Module] = []  # the run's layers that count their steps in the cache
        for i in range(self._n_layers):
            lyr = layers[i]
            chain = chain_step(lyr)
            if chain is not None and self.chaining \
                    and not (lyr._forward_hooks or lyr._forward_pre_hooks):
                out = bufs[0] if h.data_ptr() != bufs[0].data_ptr() else bufs[1]
                item = chain.call(lyr, h, out, pe, cache)
                if item is not None:
                    run.append(item)
                    if chain.count is not None:
                        counted.append(lyr)
                    h = out
                    continue
            self._run_chain(run, counted, cache)
            h = lyr(h, position_embeddings=pe, attention_mask=None, position_ids=pos,
                    cache=cache, use_cache=True)
        self._run_chain(run, counted, cache)
        logits = model.lm_head(base.norm(h))
        self.steps += 1
        cls, field = self._out  # type: ignore[misc]
        return cls(logits=logits, **{field: cache})

    def greedy_next(self, token: int, cache: Any) -> int | None:
        """The greedy next token after ``token`` at the end of ``cache`` (the lowest id of the
        largest logit, as :func:`specmoe.speculation.verify.accept` reads the model's logits), decoded
        through the step's plan: what :func:`specmoe.generate` calls for a plain greedy step
        instead of the model's forward, the logits staying in C.  None, with nothing run,
        when no plan serves this step or the call must be the model's own: switched off,
        training, another cache, hooks on the model other than specmoe's
        :class:`specmoe.models.dense.DecodeThreads`, past a sliding window, no ``lm_head`` in the
        plan."""
        model = self.model
        if not (self.enabled and self.planning) or model.training \
                or type(cache) is not DynamicCache:
            return None
        own = self.own_hooks  # specmoe.models.dense's DecodeThreads
        for hooks in (model._forward_pre_hooks, model._forward_hooks):
            for h in hooks.values():
                if own is None or getattr(h, "__self__", None) is not own:
                    return None
        base = model.model
        if base._forward_hooks or base._forward_pre_hooks \
                or torch.nn.modules.module._global_forward_hooks \
                or torch.nn.modules.module._global_forward_pre_hooks:
            return None
        S = int(cache.get_seq_length())
        if self._window is not None and S + 1 > self._window:
            return None
        plan = self._plan_for(cache, S)
        if plan is None or plan.vocab is None:
            return None
        return self._plan_call(plan, token, S, True)[1]

    def _plan_for(self, cache: Any, S: int) -> _Plan | None:
        """The plan for a step on ``cache`` at S cached positions: the one kept while it is
        valid, else a new one (not more often than every ``_PLAN_RETRY_STEPS`` steps after a
        build declined); None when planning is off or no plan serves."""
        if not self.planning or S == 0:  # (an empty cache: its layers get their buffers at
            return None                  # the first step, through the model's own path)
        plan = self._plan
        if plan is None or not self._plan_valid(plan, cache, S):
            plan = self._plan = None
            # (a cache recording a layer's states for a rollback -- a draft step on a
            # speculation's cache -- takes no plan now, and is no reason to wait
            # _PLAN_RETRY_STEPS: the next plain step builds one)
            if self.steps >= self._plan_retry and not recording_state_layers(cache):
                plan = self._plan = self._make_plan(cache, S)
                if plan is None:
                    self._plan_retry = self.steps + _PLAN_RETRY_STEPS
        return plan

    def _make_plan(self, cache: Any, S: int) -> _Plan | None:
        """A plan for steps on ``cache`` from S cached positions on (the class docstring), or
        None when this model or this moment has none: a layer that is not a one-call layer
        now, hooks, a rotary embedding without a table, an embedding torch does not index
        plainly, or rotary tables that differ from the per-step rows."""
        model = self.model
        base = model.model
        if not self.chaining or len(base.layers) < self._n_layers:
            return None
        layers = [base.layers[i] for i in range(self._n_layers)]
        emb = base.embed_tokens
        rot = base.rotary_emb
        if any(chain_step(lyr) is None
               or lyr._forward_hooks or lyr._forward_pre_hooks for lyr in layers) \
                or type(emb) is not nn.Embedding or emb._forward_hooks \
                or emb._forward_pre_hooks or getattr(rot, "rope_type", None) \
                not in _TABLE_ROPES or rot._forward_hooks or rot._forward_pre_hooks:
            return None
        w = emb.weight.detach()
        if w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16) \
                or not w.is_contiguous():
            return None
        hidden = w.shape[1]
        x0 = torch.empty(1, 1, hidden, dtype=w.dtype)
        bufs = (torch.empty_like(x0), torch.empty_like(x0))
        P = max(_PLAN_MIN_POSITIONS, 2 * (S + 1))
        with torch.no_grad():
            pe = rot(x0, torch.tensor([[S]]))
            table = rot(x0, torch.arange(P).unsqueeze(0))
        items, h = [], x0
        for i, lyr in enumerate(layers):
            out = bufs[i % 2]
            item = chain_step(lyr).call(lyr, h, out, pe, cache)
            if item is None:
                return None
            items.append(item)
            h = out
        # a recurrent layer's item writes its cache state in place: the plan holds while the
        # state is the same tensors (specmoe.models.linear_attn.gdn_chain_state)
        states = [(lyr, cs.state(lyr, cache)) for lyr in layers
                  if (cs := chain_step(lyr)).state is not None]
        if any(st is None for _, st in states):
            return None
        engines = {id(it[3]): it[3] for it in items if it[3] is not None}
        if len(engines) > 1:
            return None
        eng = next(iter(engines.values()), None)
        # the Engine's layers the items captured (set_cache in another thread may swap them
        # while the items are built): all one object, which the slot's check compares with
        captured = {id(it[1][0]): it[1][0] for it in items if it[1][0] is not None}
        if len(captured) > 1:
            return None
        eng_layers = next(iter(captured.values()), None)
        rows, seen = [], set()
        for lyr, it in zip(layers, items):
            for idx, tab in chain_step(lyr).rope(lyr, table, P):
                dst = it[1][idx]
                if id(dst) in seen:
                    continue
                seen.add(id(dst))
                if tab.shape[0] != P or tab[S].tobytes() != dst.tobytes():
                    _log.debug("decode plan declined: rotary table row %d differs from the "
                               "step's", S)
                    return None
                rows.append((tab, dst))
        norm, head = None, None
        normed = torch.empty_like(x0)
        fn = base.norm
        if type(fn) is CRMSNorm \
                and not (fn.training or fn._forward_hooks or fn._forward_pre_hooks) \
                and fn.weight.dtype == w.dtype and fn.c_weight.shape == (hidden,):
            norm = (tensor_array(h.view(1, hidden)), fn.c_weight, fn.variance_epsilon,
                    tensor_array(normed.view(1, hidden)), fn.c_bf16(w.dtype))
        lm = model.lm_head
        lc = getattr(lm, "_c", None)
        odt = getattr(lm, "out_dtype", None)
        if norm is not None and type(lc) is _C.Linear \
                and not (lm.training or lm._forward_hooks or lm._forward_pre_hooks) \
                and odt in (torch.float32, torch.bfloat16) and lm.in_features == hidden \
                and (lm.torch_above is None or lm.torch_above >= 1):
            head = (lc, tensor_array(normed.view(1, hidden)))
        try:
            c = _C.DecodePlan(tuple((it[0], it[1]) for it in items), tuple(rows),
                              (tensor_array(w), tensor_array(x0.view(1, hidden))), norm, head)
        except (TypeError, ValueError) as e:
            _log.debug("decode plan declined: %s", e)
            return None
        kv = [(it[2][0], it[2][1], it[2][2]) for it in items if it[2] is not None]
        plan = _Plan(c=c, cache=weakref.ref(cache),
                     limit=min([P] + [k.shape[2] for _, k, _ in kv]),
                     views=[(lay, kb, vb) for lay, kb, vb in kv], states=states,
                     counted=[lyr for lyr in layers if chain_step(lyr).count is not None],
                     layers=layers, mods=(emb, rot, fn, lm), engine=eng,
                     eng_layers=eng_layers, x0=x0, last=h,
                     normed=None if norm is None else normed,
                     vocab=None if head is None else int(lm.out_features),
                     logits_dtype=odt, scratch=None if head is None else tensor_array(
                         torch.empty(1, int(lm.out_features), dtype=odt)))
        # the plan references the cache's KV buffers: it goes when the cache does (a finished
        # generation's memory is not held by the model)
        weakref.finalize(cache, _forget_plan, weakref.ref(self), weakref.ref(plan))
        return plan

    def _plan_valid(self, plan: _Plan, cache: Any, S: int) -> bool:
        """Whether ``plan`` still serves a step on ``cache`` at S cached positions: the same
        cache with each layer's keys/values S positions of the plan's buffers, room for one more
        position, no hooks since, the same modules, the Engine's layers and routing as
        built."""
        if plan.cache() is not cache or S + 1 > plan.limit or not self.chaining:
            return False
        # each layer's keys/values still views of the buffers the plan writes, S positions
        # long: a crop (speculation's rollback) and a forward of several tokens (its
        # verification) append into the same buffers and keep the plan; an assignment from
        # outside drops them (BufferedLayer's setter), a regrowth makes new ones: rebuilt.
        # (It compared the views themselves: every verification rebuilt the plan, ~0.9 ms
        # on the zoo model, longer than the plain step it serves.)
        for lay, kb, vb in plan.views:
            if lay._kbuf is not kb or lay._vbuf is not vb or lay._keys.shape[2] != S:
                return False
        for lyr, st in plan.states:
            now = chain_step(lyr).state(lyr, cache)
            if now is None or any(a is not b for a, b in zip(now, st)):
                return False
        for lyr in plan.layers:
            if lyr._forward_hooks or lyr._forward_pre_hooks:
                return False
        base = self.model.model
        emb, rot, fn, lm = plan.mods
        if base.embed_tokens is not emb or base.rotary_emb is not rot or base.norm is not fn \
                or self.model.lm_head is not lm:
            return False
        for m in plan.mods:
            if m._forward_hooks or m._forward_pre_hooks:
                return False
        eng = plan.engine
        return eng is None or (eng.layers is plan.eng_layers
                               and eng.routable(plan.x0, plan.x0.dtype, fused=True))

    def _plan_call(self, plan: _Plan, token: int, S: int, argmax: bool
                   ) -> tuple[torch.Tensor | None, int | None]:
        """``plan``'s C step for ``token`` at S cached positions, then each layer's KV views
        advanced by its new position; (logits [1, 1, vocab], or None without a head in the
        plan or with ``argmax``; the greedy next token, or -1 without ``argmax``).  (None,
        None), with nothing run and the plan dropped, when the Engine's layers changed since
        the plan was built (a ``set_cache`` in another thread after the validity check)."""
        logits, out = None, None
        if argmax:      # logits nobody sees: the plan's own buffer
            out = plan.scratch
        elif plan.vocab is not None:
            logits = torch.empty(1, 1, plan.vocab, dtype=plan.logits_dtype)
            out = tensor_array(logits.view(1, plan.vocab))
        eng = plan.engine
        with eng.layer_call_slot() if eng is not None else contextlib.nullcontext():
            # checked inside the slot: Engine.set_cache swaps the layers (and closes the old
            # cache) only while no layer call is in flight, so from here on they stay
            if eng is not None and eng.layers is not plan.eng_layers:
                self._plan = None
                return None, None
            r = self.plan_step(plan.c, token, S, out, argmax)
        cache = plan.cache()
        for lyr in plan.counted:
            chain_step(lyr).count(lyr, cache)
        n = S + 1
        for lay, _, _ in plan.views:
            kv_views(lay, n)
        self.steps += 1
        self.planned += 1
        self.chained += len(plan.layers)
        return logits, r[4]

    def _run_plan(self, plan: _Plan, token: int, cache: Any, S: int) -> Any:
        """One step through ``plan`` (:meth:`_plan_call`), the model's output object around
        its logits; None, with nothing run, when the plan went stale (take another path)."""
        logits, r = self._plan_call(plan, token, S, False)
        if r is None:
            return None
        if logits is None:
            base = self.model.model
            h = plan.last if plan.normed is None else plan.normed
            if plan.normed is None:
                h = base.norm(h)
            logits = self.model.lm_head(h)
        cls, field = self._out  # type: ignore[misc]
        return cls(logits=logits, **{field: cache})

    def _run_chain(self, run: list[tuple], counted: list[nn.Module], cache: Any) -> None:
        """The layers of ``run`` (items of the layers' ``chain_step(layer).call``: block, arguments,
        KV buffers, Engine) in one C call, then their caches advanced (KV views; the token
        counts in ``cache`` of the ``counted`` layers, recurrent ones); both lists emptied."""
        if not run:
            return
        # the Engine of the chain's MoE layers holds close() off while they run (a chain of
        # dense layers alone has none)
        eng = next((it[3] for it in run if it[3] is not None), None)
        with eng.layer_call_slot() if eng is not None else contextlib.nullcontext():
            # the items were built outside the slot: a set_cache in another thread since then
            # swapped the Engine's layers (argument 0 of an item's call), stable from here on
            cur = None if eng is None else eng.layers
            self.chain(tuple((it[0], it[1] if it[1][0] is None or it[1][0] is cur
                              else (cur, *it[1][1:])) for it in run))
        for it in run:
            if it[2] is not None:  # (a recurrent layer's item: no positions)
                kv_advance(it[2], 1)
        for lyr in counted:
            chain_step(lyr).count(lyr, cache)
        self.chained += len(run)
        run.clear()
        counted.clear()


def _forget_plan(step_ref: Any, plan_ref: Any) -> None:
    """A plan's cache is gone: its DecodeStep drops the plan (and the buffers it holds)."""
    step, plan = step_ref(), plan_ref()
    if step is not None and plan is not None and step._plan is plan:
        step._plan = None


def decode_step_of(model: nn.Module) -> DecodeStep | None:
    """The :class:`DecodeStep` :func:`install_decode_step` gave ``model``, or None."""
    return getattr(model, "_specmoe_decode_step", None)


def install_decode_step(model: nn.Module, own_hooks: Any = None) -> bool:
    """Give ``model`` (a causal LM of :data:`specmoe.models.arch.DECODE_STEP_MODELS`) the
    :class:`DecodeStep` forward; False, unchanged, for other models.  Idempotent; the step is
    :func:`decode_step_of` the model.  ``own_hooks``: the object whose bound methods are the
    model's forward hooks the step may run beside (:class:`specmoe.models.dense.DecodeThreads`)."""
    step = decode_step_of(model)
    if step is not None:
        if own_hooks is not None:
            step.own_hooks = own_hooks
        return True
    if type(model).__name__ not in DECODE_STEP_MODELS:
        return False
    base = getattr(model, "model", None)
    if base is None or "forward" in vars(base) or "forward" in vars(model):
        return False  # someone else's forward already
    if not all(hasattr(base, a) for a in ("embed_tokens", "rotary_emb", "layers", "norm")):
        return False
    kinds = set(getattr(model.config, "layer_types", None) or ["full_attention"])
    if not kinds <= {"full_attention", "sliding_attention", "linear_attention"}:
        return False
    step = DecodeStep(model, model.forward, own_hooks)
    model.forward = step
    model._specmoe_decode_step = step
    return True

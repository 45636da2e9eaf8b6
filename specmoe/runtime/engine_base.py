"""What the CPU :class:`specmoe.runtime.engine.Engine` and the GPU tier's
:class:`specmoe.runtime.gpu_engine.GpuEngine` share (:class:`EngineCommon`)."""
from __future__ import annotations

import contextlib
import os
import time
import weakref
from typing import Any, Iterator, Sequence

import numpy as np
from torch import nn

from . import misses
from .expert_copy import ExpertCopy
from .memplan import memory_limit  # noqa: F401  (the engines' O_DIRECT and host-mode choice)

__all__ = ["EngineCommon", "PREDICTORS", "check_prefetch", "check_prefetch_arg"]

#: The C predictors of the next layer's experts (csrc/layer.h smoe_layers_set_predictor):
#: ``"router"`` (the next router on this layer's input), ``"learned"`` (the nextuse model's
#: probability of use, fed the routing as it runs: specmoe.sim.nextuse) and ``"oracle"`` (a
#: routing replay's true next layer: the offline bound's prefetch).
PREDICTORS: tuple[str, ...] = ("router", "learned", "oracle")


def check_prefetch_arg(prefetch: Any) -> str | None:
    """``prefetch`` as offload/from_pretrained/Engine take it: a bool (True: the router
    predictor) or a predictor name of :data:`PREDICTORS`.  Returns the predictor, None for
    off."""
    if isinstance(prefetch, str):
        if prefetch not in PREDICTORS:
            raise ValueError(f"prefetch={prefetch!r}: choose True, False or a predictor of "
                             f"{PREDICTORS}")
        return prefetch
    if not isinstance(prefetch, (bool, np.bool_)) and (
            not isinstance(prefetch, (int, np.integer)) or prefetch not in (0, 1)):
        raise TypeError(f"prefetch must be a bool or a predictor of {PREDICTORS}, got "
                        f"{prefetch!r}")
    return "router" if prefetch else None


def check_prefetch(overfetch: float | None, mass: float | None | str) -> None:
    """The prediction settings both engines' ``set_prefetch`` take: overfetch >= 1 (or None:
    unchanged); mass in (0, 1], None (the overfetch rule) or "keep"."""
    if isinstance(mass, str) and mass != "keep":
        raise ValueError(f"mass must be a number in (0, 1], None or 'keep', got {mass!r}")
    if not isinstance(mass, str) and mass is not None and not (0 < mass <= 1):
        raise ValueError(f"mass must be in (0, 1], got {mass}")
    if overfetch is not None and not overfetch >= 1:
        raise ValueError(f"overfetch must be >= 1, got {overfetch}")


def _remove_file(path: str) -> None:
    """Delete path if it is still there (a temporary store's last step)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class EngineCommon:
    """What the CPU :class:`Engine` and the GPU tier's
    :class:`specmoe.runtime.gpu_engine.GpuEngine` share: both keep ``model`` and a cache ``_cache``
    (``stats()``, ``slot_bytes``; None once closed) over a store file (``_store``, deleted on
    close when ``_own_store``)."""

    model: nn.Module | None
    admission: bool = False  # prefetch admission (set_prefetch), a setting of the cache that
    # the engine keeps so a rebuilt cache gets it back; likewise its byte budget
    byte_budget: bool = True
    _cache: Any
    _store: Any
    _store_path: str | None
    _own_store: bool
    _store_remover: weakref.finalize | None = None

    def _adopt_store(self, path: str | os.PathLike, own: bool) -> None:
        """Use the store file at path; own: it is a temporary one (offload made it), deleted
        by close() or, for an engine dropped or left open, when it is collected or the
        interpreter exits (weakref.finalize), so no run leaves a store the size of the
        model's experts behind in the temporary folder."""
        self._store_path = os.fspath(path)
        self._own_store = own
        self._store_remover = weakref.finalize(self, _remove_file, self._store_path) \
            if own else None

    def _close_storage(self) -> None:
        """Close the cache and the store; delete the store file when it was a temporary one."""
        if self._cache is not None:
            self._cache.close()
            self._cache = None
        if self._store is not None:
            self._store.close()
            self._store = None
        if self._store_remover is not None:
            self._store_remover()  # runs once; detached from collection and exit afterwards
            self._store_remover = None
            self._own_store = False

    # set by the engines: the trace recorder in use (trace()), the routers the predictor reads,
    # the self-draft's copy and the draft forwards' routing (drafting())
    recorder: Any
    _draft: Any
    _drafting: list | None
    _draft_prefetch: bool
    _draft_s: float  # draft forwards' seconds since the hybrid tier's last lookahead (drafting)
    _draft_flags: Any
    model_type: str
    _routers: list
    _router_bias: list
    arch: Any

    def _router_copies(self) -> list[tuple[Any, Any, Any]]:
        """Each MoE layer's router as host f32 arrays (weight [E,H], bias, correction bias):
        the C layers' copy, from which they predict the next layer's experts (and route,
        where the C path routes) on either tier."""
        import torch

        def f32(t: Any) -> Any:
            return None if t is None else \
                np.ascontiguousarray(t.detach().to(torch.float32).cpu()
                                     .reshape(t.shape[0], -1).squeeze(-1).numpy())
        out = []
        for r, corr in zip(self._routers, self._router_bias):
            out.append((f32(r.weight), f32(getattr(r, "bias", None)),
                        None if corr is None else f32(corr.reshape(-1))))
        return out

    # The next-layer prediction's settings (prefetch, overfetch, mass) have one owner: the C
    # layers (smoe_layers; Layers.config() reads them back, Layers.configure() sets them).
    # _prediction holds them only while no C layers exist (before the first is built, across
    # a rebuild, after close); _configure_layers pushes it into a new one.
    _prediction: dict[str, Any]
    _replay: Any = None  # a routing replay's trace (Engine.replay_routing; CPU tier only)
    _replay_tokens: Any = None  # its token pieces, when the trace has them
    _token_rows: Any = None  # set_token_pieces: token id -> row of the token prior's table
    _prior_hook: Any = None  # the input embedding's pre-hook that tells the C layers the row
    #: the specmoe.runtime.memplan.MemoryPlan from_pretrained(memory=...) followed, else None
    memory_plan: Any = None

    def _prediction_settings(self) -> dict[str, Any]:
        lay = self.layers
        return lay.config() if lay is not None else self._prediction

    @property
    def prefetch(self) -> bool:
        """Next-layer prediction and prefetch on (read from the C layers)."""
        return bool(self._prediction_settings()["prefetch"])

    @property
    def overfetch(self) -> float:
        """Experts predicted per token = ceil(top_k * overfetch) (read from the C layers)."""
        return float(self._prediction_settings()["overfetch"])

    @property
    def mass(self) -> float | None:
        """The prediction's mass rule (None: the overfetch count; read from the C layers)."""
        m = float(self._prediction_settings()["mass"])
        return m if m > 0.0 else None

    @property
    def predictor(self) -> Any:
        """The next-layer predictor of prefetch: a name of :data:`PREDICTORS` (the C layers'
        setting) or the Python callable set by :meth:`set_prefetch`."""
        if getattr(self, "_predictor", None) is not None:
            return getattr(self, "_predictor")
        return str(self._prediction_settings().get("predictor", "router"))

    def _push_predictor(self, name: str) -> None:
        """The C predictor ``name`` where the settings live (the C layers, else _prediction)."""
        if name == "oracle" and self._replay is None:
            raise ValueError("predictor='oracle' predicts from a routing replay's trace: call "
                             "replay_routing(trace) first")
        lay = self.layers
        if lay is None:
            self._prediction["predictor"] = name
            return
        model = None
        if name == "learned":
            from ..sim.nextuse import default_model
            model = default_model(len(self.layer_ids), self.num_experts).flat()
        lay.set_predictor(name, model=model)
        self._push_priors(lay)

    @property
    def token_prior(self) -> Any:
        """The packaged next-use model's :class:`~specmoe.sim.nextuse.TokenPrior` when it is
        for this model's shape (26 MoE layers x 64 experts: DeepSeek-V2-Lite), else None: what
        :meth:`set_token_pieces` and a replay of a trace with token pieces give the learned
        predictor."""
        from ..sim.nextuse import default_model

        tp = default_model(len(self.layer_ids), self.num_experts).tokens
        return tp if tp is not None and tp.shape == (len(self.layer_ids),
                                                       self.num_experts) else None

    def _push_priors(self, lay: Any) -> None:
        """The token prior into C layers ``lay`` (``csrc/layer.h`` ``smoe_layers_set_priors``):
        the table when a replay has token pieces or :meth:`set_token_pieces` mapped the
        vocabulary, with the replayed tokens' rows; else none."""
        toks = self._replay_tokens if self._replay is not None else None
        tp = self.token_prior if toks is not None or self._token_rows is not None else None
        if tp is None:
            lay.set_priors(None)
        else:
            lay.set_priors(tp.table(), rows=None if toks is None else tp.rows(toks))

    def set_token_pieces(self, pieces: Any) -> bool:
        """Tell the ``learned`` prefetch predictor what each token says before its layers run
        (issue 42's token prior, ``specmoe.sim.nextuse.TokenPrior``): ``pieces`` maps token ids
        to the tokenizer's pieces -- a tokenizer (``convert_ids_to_tokens``) or a sequence
        (``pieces[id]``); None turns it off.  Then every forward pass of one token gives the C
        layers its token's row of the packaged model's table (a pre-hook on the input
        embedding), as the simulator gives each replayed token its piece's.  Returns whether a
        prior applies: False for a model whose shape the packaged table is not for (it is
        DeepSeek-V2-Lite's, 26 MoE layers x 64 experts) or a vocabulary none of whose pieces
        it knows.  ``from_pretrained(prefetch="learned")`` calls it with the checkpoint's
        tokenizer."""
        rows = None
        if pieces is not None:
            if hasattr(pieces, "convert_ids_to_tokens"):
                n = len(pieces)
                pieces = pieces.convert_ids_to_tokens(list(range(n)))
            pieces = ["" if p is None else str(p) for p in pieces]
            tp = self.token_prior
            rows = None if tp is None else tp.rows(pieces)
            if rows is not None and not (rows >= 0).any():
                rows = None
        self._token_rows = rows
        hook = self._prior_hook
        if rows is None and hook is not None:
            hook.remove()
            self._prior_hook = None
        elif rows is not None and hook is None:
            emb = self.model.get_input_embeddings()
            self._prior_hook = emb.register_forward_pre_hook(self._before_embedding)
        lay = self.layers
        if lay is not None:
            self._push_priors(lay)
        return rows is not None

    def _drop_prior_hook(self) -> None:
        """At close: the model's embedding no longer calls into this engine."""
        if self._prior_hook is not None:
            self._prior_hook.remove()
            self._prior_hook = None
        self._token_rows = None

    def _before_embedding(self, module: Any, args: tuple) -> None:
        """The input embedding's pre-hook (set_token_pieces): the next pass's token row."""
        rows, lay = self._token_rows, self.layers
        if rows is None or lay is None or not args:
            return
        ids = args[0]
        row = -1
        if getattr(ids, "numel", lambda: 0)() == 1:
            i = int(ids.reshape(-1)[0])
            row = int(rows[i]) if 0 <= i < len(rows) else -1
        lay.set_next_prior(row)

    def _set_prediction(self, prefetch: bool | None = None, overfetch: float | None = None,
                        mass: float | None | str = "keep") -> None:
        """Change the prediction settings where they live (the C layers, which forget the
        predictions made with the old ones), after check_prefetch."""
        cur = dict(self._prediction_settings())
        if prefetch is not None:
            cur["prefetch"] = bool(prefetch)
        if overfetch is not None:
            cur["overfetch"] = float(overfetch)
        if not isinstance(mass, str):
            cur["mass"] = 0.0 if mass is None else float(mass)
        lay = self.layers
        if lay is None:
            self._prediction = cur
        else:
            lay.configure(cur["prefetch"], cur["overfetch"], cur["mass"],
                          bool(cur.get("feed_counts", False)))

    def _keep_settings(self) -> None:
        """Before the C layers are replaced or dropped: their settings (prediction, miss) into
        _prediction and _miss, which _configure_layers pushes into the next ones."""
        if self.layers is not None:
            self._prediction = self.layers.config()
            self._miss = self._miss_settings()

    # SpecMD's miss handling (specmoe.runtime.misses): miss, miss_keep, route_lambda and
    # miss_keep2 have one owner too, the C layers (Layers.set_miss sets them, Layers.config()
    # reads them back); _miss holds them only while no C layers exist, as _prediction does,
    # and misses.apply pushes it into new ones.  The low-bit levels (miss_levels) name the
    # resident copies the engine builds and owns in Python (_copies, built once per format and
    # shared with the self-draft; the C layers only borrow their memory), so they stay a
    # Python attribute, as does the link throttle (a setting of the cache, set by
    # misses.apply).
    _miss: dict[str, Any]
    miss_levels: tuple[str, ...]
    throttle: Any
    _copies: dict[str, ExpertCopy]
    _closed: bool
    _ffn_args: dict[str, Any]
    top_k: int
    layers: Any

    def _miss_settings(self) -> dict[str, Any]:
        """{miss, miss_keep, route_lambda, miss_keep2}: the C layers', else _miss."""
        lay = self.layers
        if lay is None:
            return dict(self._miss)
        c = lay.config()
        return {k: c[k] for k in misses.MISS_SETTINGS}

    @property
    def miss(self) -> str:
        """SpecMD's miss mode (:data:`specmoe.runtime.misses.MISS_MODES`; read from the C
        layers)."""
        return str(self._miss_settings()["miss"])

    @property
    def miss_keep(self) -> int:
        """The top routing ranks drop and priority always fetch (read from the C layers)."""
        return int(self._miss_settings()["miss_keep"])

    @property
    def route_lambda(self) -> float:
        """Cache-aware routing's strength, 0: off (read from the C layers)."""
        return float(self._miss_settings()["route_lambda"])

    @property
    def miss_keep2(self) -> int:
        """priority: ranks miss_keep..miss_keep2-1 from the first low-bit level, the rest from
        the second (read from the C layers)."""
        return int(self._miss_settings()["miss_keep2"])

    def set_miss(self, miss: str | None = None, miss_keep: int | None = None,
                 route_lambda: float | None = None,
                 throttle: tuple[float, float] | None | str = "keep",
                 miss_levels: str | Sequence[str] | None = None,
                 miss_keep2: int | None | str = "auto") -> None:
        """Change SpecMD's miss handling, cache-aware routing, link throttle or low-bit levels
        (None / "keep": unchanged; miss_keep2 "auto": the default for the levels, see
        :mod:`specmoe.runtime.misses`)."""
        cur = self._miss_settings()
        m, k, lam = misses.check_miss(cur["miss"] if miss is None else miss,
                                      cur["miss_keep"] if miss_keep is None else miss_keep,
                                      cur["route_lambda"] if route_lambda is None
                                      else route_lambda, self.top_k)
        if isinstance(miss_keep2, str) and miss_keep2 != "auto":
            raise ValueError(f"miss_keep2 must be an int, None or 'auto', got {miss_keep2!r}")
        levels, keep2 = misses.check_levels(
            self.miss_levels if miss_levels is None else miss_levels,
            None if miss_keep2 == "auto" else miss_keep2, k, self.top_k)
        if not isinstance(throttle, str):
            misses.check_throttle(throttle)
        old_levels, old_throttle = self.miss_levels, self.throttle
        self.miss_levels = levels
        if not isinstance(throttle, str):
            self.throttle = throttle
        new = {"miss": m, "miss_keep": k, "route_lambda": lam, "miss_keep2": keep2}
        if self.layers is None:
            self._miss = new
            return
        try:
            misses.apply(self, new)  # builds any new copy before it changes the C layers
        except BaseException:
            self.miss_levels, self.throttle = old_levels, old_throttle
            misses.apply(self, cur)  # the C layers back to the old settings, not half-changed
            raise

    def lowbit_copy(self, dtype: str) -> ExpertCopy:
        """The resident ``dtype`` copy of every routed expert, built on first use."""
        if self._closed or self._store is None:
            raise RuntimeError(f"this specmoe {type(self).__name__} is closed")
        if dtype not in self._copies:
            self._copies[dtype] = ExpertCopy(self._store, dtype, self._ffn_args,
                                             self.model_type, self.top_k)
        return self._copies[dtype]

    def prune_copies(self, in_use: set[str]) -> None:
        """Free the copies neither the C layers (``in_use``) nor the self-draft use."""
        keep = in_use | ({self._draft.dtype} if self._draft is not None else set())
        self._copies = {k: v for k, v in self._copies.items() if k in keep}

    @property
    def lowbit_copies(self) -> tuple[str, ...]:
        """Formats of the resident low-bit copies of every expert (self-draft, miss levels)."""
        return tuple(self._copies)

    def copy_buffer(self, copy: ExpertCopy) -> Any:
        """What the C layers' ``set_lowbit`` takes for ``copy`` on this engine's tier: the host
        buffer itself on the CPU (a GPU tier overrides it with the copy's device address)."""
        return copy.buf

    def trace(self, logits: bool = False) -> Any:
        """``with engine.trace() as t: model.generate(...)``; then ``t.result()`` is a
        :class:`specmoe.sim.traces.Trace` (save with ``.save(path)`` as .npz).  The same on
        both tiers: every MoE layer call hands its routing to the recorder."""
        from .recording import TraceRecording
        return TraceRecording(self, logits)

    def router_scores(self, pos: int, x: Any) -> Any:
        """Layer ``pos``'s router scores on ``x`` [T, H] (a host float32 tensor): the logits,
        or with a correction bias the model's score function plus it -- applied by
        ``_C.route_scores``, csrc/route.h's one copy of the rule."""
        import torch

        from .. import _C
        r = self._routers[pos]
        w = r.weight
        lg = torch.nn.functional.linear(x.to(w.dtype), w, getattr(r, "bias", None))
        scores = np.ascontiguousarray(lg.detach().float().cpu().numpy())
        bias = self._router_bias[pos]
        if bias is not None:
            corr = np.ascontiguousarray(bias.detach().float().reshape(-1).cpu().numpy())
            _C.route_scores(scores, bool(self.arch.sigmoid_router), corr)
        return torch.from_numpy(scores)

    def record_layer(self, pos: int, hidden: Any, idx: Any, w: Any) -> None:
        """Hand layer ``pos``'s routing to the trace recorder, if one is on (trace())."""
        rec = self.recorder
        if rec is not None:
            lg = self.router_scores(pos, hidden.detach()) if rec.logits else None
            rec.layer(pos, idx, w, lg)

    @contextlib.contextmanager
    def drafting(self, prefetch: bool = False) -> Iterator[list[tuple[int, Any, Any]]]:
        """Within the block, the model's MoE layers run on the resident self-draft copy
        (:meth:`enable_self_draft`), touch no expert of the cache, and append
        ``(moe_layer_position, top_k_index[T, k], top_k_weight[T, k])`` of every layer call
        to the yielded list.
        ``prefetch``: also queue, layer by layer as the draft routes it, the experts of the
        newest token to the cache's prefetch worker (when the engine prefetches), so their
        loads overlap the rest of the draft; ``stats()["draft_prefetch_queued"]`` counts
        them."""
        if self._draft is None:
            raise RuntimeError("drafting() needs enable_self_draft() first")
        if self._drafting is not None:
            raise RuntimeError("drafting() does not nest")
        rec: list[tuple[int, Any, Any]] = []
        self._drafting = rec
        self._draft_prefetch = bool(prefetch)
        t0 = time.perf_counter()
        try:
            yield rec
        finally:
            self._drafting = None
            self._draft_prefetch = False
            # the draft's time since the last lookahead: MoE-SpAc Eq. 10's gamma * T_draft,
            # the window the hybrid tier's lookahead copies may hide in (GpuEngine.lookahead)
            self._draft_s = getattr(self, "_draft_s", 0.0) + time.perf_counter() - t0

    @contextlib.contextmanager
    def draft_tokens(self, flags: Any) -> Iterator[None]:
        """Within the block, the MoE layers treat the flagged tokens as draft tokens (one flag
        per token of each forward, in the flattened [batch, sequence] order the layers see):
        their missing experts are never loaded -- computed from the resident low-bit copy when
        there is one (:meth:`enable_self_draft`), else skipped -- unless resident or loaded for
        a real token anyway, and they take no part in next-layer prediction or the policy's
        counts (csrc/layer.h's rule; the GPU tier applies the same in
        ``GpuEngine._split_draft_pairs``).  The MTP drafter's mask tokens run this way.  One forward at a
        time; ``stats()["draft_kept"]`` counts the pairs served without a load."""
        f = np.ascontiguousarray(np.asarray(flags).reshape(-1).astype(bool), dtype=np.uint8)
        if self._draft_flags is not None:
            raise RuntimeError("draft_tokens: already inside a draft_tokens block")
        self._draft_flags = f
        try:
            yield
        finally:
            self._draft_flags = None

    @property
    def cache(self) -> Any:
        """The expert cache (an :class:`specmoe.ExpertCache`, or the GPU tier's
        :class:`specmoe.runtime.cuda.GpuExpertCache`); None once closed."""
        return self._cache

    def loads(self) -> tuple[int, float]:
        """(experts loaded from the store, seconds stalled on loads) since the last reset."""
        if self._cache is None:
            return 0, 0.0
        c = self._cache.stats()
        return int(c.get("bytes_read", 0)) // max(1, self._cache.slot_bytes), float(
            c.get("stall_s", 0.0))

    def generate(self, input_ids: Any, **kw: Any) -> Any:
        """:func:`specmoe.generate` on this engine's model (same arguments)."""
        from ..speculation.generation import generate
        return generate(self.model, input_ids, engine=self, **kw)

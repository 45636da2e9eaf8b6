"""transformers' KV cache without the whole-cache copy per step.

A ``DynamicCache`` layer appends by ``torch.cat`` of its whole cache with the new positions:
every decode step copies every layer's cache (O(S) per layer and token).  A
:class:`BufferedLayer` is a ``DynamicLayer`` that owns buffers with spare room and appends a
batch-1 step by copying only its own positions.  specmoe's attention paths
(specmoe.models.attention, specmoe.models.mla) append through :func:`kv_append`, and the one-call
decoder layer writes the new positions itself into the buffers :func:`kv_buffers` hands out;
both turn the plain DynamicLayers of a plain DynamicCache (model.generate's own) into
BufferedLayers in place the first time they meet them.
"""
from __future__ import annotations

import copy
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from .kernels import tensor_array
from .memplan import kv_capacity

__all__ = ["BufferedLayer", "kv_advance", "kv_append", "kv_buffers", "kv_views",
           "recording_state_layers"]


# a BufferedLayer's own attributes: the cache and its buffers (everything else is DynamicLayer's)
_OWNED = ("_keys", "_values", "_kbuf", "_vbuf", "_ka", "_va")


def _kv4(k: Any, v: Any) -> bool:
    """Keys k and values v [B, heads, positions, D] (values may have another D, as MLA's
    latent and rotary key do): what a BufferedLayer buffers (B rows: a decode batch's cache,
    specmoe.speculation.batch.BatchKV)."""
    return (isinstance(k, torch.Tensor) and isinstance(v, torch.Tensor) and k.dim() == 4
            and v.dim() == 4 and v.shape[:3] == k.shape[:3])


def _alike(a: Any, b: torch.Tensor) -> bool:
    """Whether positions shaped as b [1, heads, *, D] (dtype, device) go into a."""
    return (a is not None and a.dim() == 4 and a.shape[:2] == b.shape[:2]
            and a.shape[3] == b.shape[3] and a.dtype == b.dtype and a.device == b.device)


class BufferedLayer(DynamicLayer):
    """A ``DynamicLayer`` that owns its KV buffers: ``keys``/``values`` [B, heads, S, D] are the
    first S positions of buffers [B, heads, capacity, D] with spare room, so an append copies
    only its own positions (B rows: one sequence, or a decode batch's BatchKV).  (A plain
    DynamicLayer concatenates its whole cache with the new positions at every step: O(S)
    copying per layer and token, ~0.13 ms a layer at S ~ 100 on an OLMoE-shaped model, growing
    with S.)

    The layer is the buffers' one owner, and its own methods keep keys/values views of them:
    :meth:`update` at the buffers' batch size (writing the new positions; when the room runs
    out, new buffers a quarter larger, at least ``memplan.KV_SPARE`` positions of spare room, the
    cache copied in),
    :meth:`crop` (a shorter view), :meth:`set_length` (the one-call layers, which write into
    the buffers themselves: :func:`kv_buffers`).  Anything else that assigns ``keys`` or
    ``values`` -- transformers' own reorder_cache, batch_repeat_interleave,
    batch_select_indices, reset or offload to another device, an update at another batch size,
    specmoe.speculation.batch's compaction -- goes through their setter, which drops the
    buffers: the layer then holds what was assigned, as a plain DynamicLayer would, until the
    next append buffers it again.  So nothing has to compare pointers to find out whether the
    views are still the buffers': the setter is told.  A deep copy gets buffers of its own; a
    shallow copy and a pickled layer hold the cached positions unbuffered: never buffers shared
    with another layer, whose appends would write the same positions.

    The buffers hold up to a quarter (at least ``memplan.KV_SPARE`` positions) more memory than the
    cache itself."""

    _keys: torch.Tensor | None = None    # what keys/values read: views of the buffers, or
    _values: torch.Tensor | None = None  # whatever was assigned since the buffers were dropped
    _kbuf: torch.Tensor | None = None    # the buffers [1, heads, capacity, D], or None
    _vbuf: torch.Tensor | None = None
    _ka: Any = None  # their numpy views (the C kernels' arguments: tensor_array), or None (not
    _va: Any = None  # on the CPU, or a dtype the kernels do not take)

    @property  # type: ignore[override]
    def keys(self) -> torch.Tensor | None:
        return self._keys

    @keys.setter
    def keys(self, t: torch.Tensor | None) -> None:
        if t is not self._keys:  # (offload to the device it is on assigns the same tensor)
            self._drop()
            self._keys = t

    @property  # type: ignore[override]
    def values(self) -> torch.Tensor | None:
        return self._values

    @values.setter
    def values(self, t: torch.Tensor | None) -> None:
        if t is not self._values:
            self._drop()
            self._values = t

    @classmethod
    def adopt(cls, lay: DynamicLayer) -> "BufferedLayer":
        """``lay``, a plain DynamicLayer, made a BufferedLayer in place (the cache it holds
        stays as it is; the next append buffers it): how model.generate's own DynamicCache,
        built of plain layers, comes to append without the copy."""
        d = lay.__dict__
        keys, values = d.pop("keys", None), d.pop("values", None)
        lay.__class__ = cls
        assert isinstance(lay, cls)
        lay._keys, lay._values = keys, values
        return lay

    @property
    def buffers(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The buffers keys/values are views of (keys', values'), or None while there are none
        (read-only: only the layer's own methods make and drop them)."""
        kb, vb = self._kbuf, self._vbuf
        return None if kb is None or vb is None else (kb, vb)

    def _drop(self) -> None:
        self._kbuf = self._vbuf = self._ka = self._va = None

    def _own(self, kt: torch.Tensor, vt: torch.Tensor, n: int) -> None:
        """kt, vt become the layer's buffers, holding n cached positions."""
        cpu = kt.device.type == "cpu"
        self._kbuf, self._vbuf = kt, vt
        self._ka = tensor_array(kt) if cpu else None
        self._va = tensor_array(vt) if cpu else None
        self.set_length(n)

    def set_length(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """keys/values become the first n positions of the buffers (which must exist); returns
        them (``narrow``: one op, where ``kt[:, :, :n]`` parses three slices)."""
        kb, vb = self._kbuf, self._vbuf
        assert kb is not None and vb is not None
        self._keys = k = kb.narrow(2, 0, n)
        self._values = v = vb.narrow(2, 0, n)
        return k, v

    def room(self, T: int, k: torch.Tensor | None = None,
             v: torch.Tensor | None = None) -> int | None:
        """S, the cached positions, once the buffers have room for T more (new buffers made,
        the cache copied in, when there are none or too little room).  k, v: the new
        positions, which must fit the cache (shape but for the positions, dtype, device); by
        default the cache's own.  None, nothing changed, when the layer is not buffered so:
        nothing 4-D cached yet and no k, v, or k, v that do not fit (another batch size, heads,
        D, dtype or device)."""
        keys, values, kb, vb = self._keys, self._values, self._kbuf, self._vbuf
        if k is None:
            k, v = (kb, vb) if kb is not None else (keys, values)
        if not _kv4(k, v):
            return None
        assert k is not None and v is not None
        S = 0 if keys is None or keys.numel() == 0 else keys.shape[2]
        if kb is not None:
            if not (_alike(kb, k) and _alike(vb, v)):
                return None
            if S + T <= kb.shape[2]:
                return S
        elif S and not (_alike(keys, k) and _alike(values, v)):
            return None
        cap = kv_capacity(S + T)  # (the memory plan counts the same room)
        kt = torch.empty(*k.shape[:2], cap, k.shape[3], dtype=k.dtype, device=k.device)
        vt = torch.empty(*v.shape[:2], cap, v.shape[3], dtype=v.dtype, device=v.device)
        if S:
            kt[:, :, :S].copy_(keys)
            vt[:, :, :S].copy_(values)
        self._own(kt, vt, S)
        return S

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any,
               **kwargs: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """DynamicLayer.update: the new positions are copied into the buffers (only a regrowth
        copies the cache); new positions that do not fit them (another batch size, ...) take
        DynamicLayer's concatenation, whose assignment drops the buffers."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        T = key_states.shape[-2]
        S = self.room(T, key_states, value_states)
        if S is None:
            return super().update(key_states, value_states, *args, **kwargs)
        assert self._kbuf is not None and self._vbuf is not None
        self._kbuf[:, :, S:S + T].copy_(key_states)
        self._vbuf[:, :, S:S + T].copy_(value_states)
        return self.set_length(S + T)

    def crop(self, tokens_to_remove: int) -> None:
        """DynamicLayer.crop: a buffered layer keeps its buffers, its keys/values a shorter
        view of them (the next append writes over the removed positions)."""
        if self._kbuf is None or tokens_to_remove >= 0:  # (> 0 raises, as DynamicLayer's does)
            super().crop(tokens_to_remove)
            return
        self.set_length(max(self.get_seq_length() + tokens_to_remove, 0))

    def __deepcopy__(self, memo: dict) -> "BufferedLayer":
        """A copy with buffers of its own (of the same capacity, the cached positions copied
        in) and their numpy views; every other attribute deep-copied."""
        new = memo[id(self)] = object.__new__(type(self))
        for name, val in self.__dict__.items():
            if name not in _OWNED:
                new.__dict__[name] = copy.deepcopy(val, memo)
        kb, vb, keys, values = self._kbuf, self._vbuf, self._keys, self._values
        if kb is None or vb is None or keys is None or values is None:
            new._keys, new._values = copy.deepcopy(keys, memo), copy.deepcopy(values, memo)
            return new
        S = keys.shape[2]
        kt, vt = torch.empty_like(kb), torch.empty_like(vb)
        kt[:, :, :S].copy_(keys)
        vt[:, :, :S].copy_(values)
        new._own(kt, vt, S)
        return new

    def __getstate__(self) -> dict:
        """Pickling and ``copy.copy``: the cache's positions, unbuffered (a copy sharing the
        buffers would take both layers' appends)."""
        state = {k: v for k, v in self.__dict__.items() if k not in _OWNED}
        keys, values = self._keys, self._values
        if self._kbuf is not None and keys is not None and values is not None:
            keys, values = keys.clone(), values.clone()  # not the whole buffers
        state["_keys"], state["_values"] = keys, values
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)


def _buffered(cache: Any, idx: int) -> BufferedLayer | None:
    """Layer ``idx`` of a plain DynamicCache as a BufferedLayer (a plain DynamicLayer converted
    in place, the first time); None for any other cache (offloading ones too) or layer type, or
    a layer the cache has not made yet."""
    if type(cache) is not DynamicCache or cache.offloading:
        return None
    layers = cache.layers
    if idx >= len(layers):
        return None
    lay = layers[idx]
    if type(lay) is BufferedLayer:
        return lay
    if type(lay) is DynamicLayer:
        return BufferedLayer.adopt(lay)
    return None


def kv_append(cache: Any, idx: int, k: torch.Tensor, v: torch.Tensor,
              kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cache update of layer ``idx`` with T new positions; returns the layer's
    whole keys and values.  A plain DynamicCache's layer becomes a :class:`BufferedLayer`
    first, whose update copies only the new positions.  Other caches and layer
    types take their own ``update``."""
    _buffered(cache, idx)
    return cache.update(k, v, idx, kwargs=kwargs)


def kv_advance(bufs: tuple, T: int) -> None:
    """The layer of ``bufs`` (:func:`kv_buffers`) holds T more positions, written into its
    buffers: its keys/values become the buffers' first S + T positions."""
    bufs[0].set_length(bufs[5] + T)


def kv_views(lay: BufferedLayer, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A BufferedLayer's keys/values become the first n positions of its buffers; returns
    them."""
    return lay.set_length(n)


def kv_buffers(cache: Any, idx: int, T: int, rows: bool = False) -> tuple | None:
    """The KV buffers of layer ``idx`` of a plain DynamicCache of batch 1 (``rows``: of any
    batch size, for a caller that writes every row: the GQA one-call layer), with room for T
    more positions, for a caller that writes them itself (then :func:`kv_advance`): (layer, a
    :class:`BufferedLayer`; keys buffer, values buffer [B, heads, capacity, D] (values may have
    another D, as MLA's latent and rotary key do); their numpy views; S cached positions), the
    layer's keys/values being the buffers' first S positions.  None for any other cache, or a
    layer holding nothing yet (the caller takes ``cache.update``, which initialises it)."""
    lay = _buffered(cache, idx)
    if lay is None or not lay.is_initialized or lay.keys is None or lay.keys.dim() != 4 \
            or (lay.keys.shape[0] != 1 and not rows):
        return None
    S = lay.room(T)
    if S is None:
        return None
    return (lay, lay._kbuf, lay._vbuf, lay._ka, lay._va, S)


def recording_state_layers(cache: Any) -> list:
    """The linear-attention and Mamba layers of ``cache`` that record their states now
    (transformers 5.25's past recording: ``specmoe.speculation.decoding.new_kv(rollback=True)``,
    outside its ``unrecorded``).  The one rule for "this cache records states", read by the
    speculation side (what to switch off, what a batch settles) and by the decode plans (a
    recording layer's one-call step cannot be a plan's item)."""
    return [lay for lay in getattr(cache, "layers", None) or ()
            if hasattr(lay, "recurrent_states") and getattr(lay, "record_past", False)]

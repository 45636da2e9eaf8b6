"""transformers' KV cache without the whole-cache copy per step.

A ``DynamicCache`` layer appends by ``torch.cat`` of its whole cache with the new positions:
every decode step copies every layer's cache (O(S) per layer and token).  At decode sizes
specmoe's attention paths (specmoe.models.attention, specmoe.models.mla) append through :func:`kv_append`
instead, and the one-call decoder layer writes the new positions itself into the buffers
:func:`kv_buffers` hands out.
"""
from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from .kernels import tensor_array

__all__ = ["kv_advance", "kv_append", "kv_buffers", "kv_views"]

_KV_SPARE = 256  # positions of spare room at least, when a layer is (re)buffered


def kv_append(cache: Any, idx: int, k: torch.Tensor, v: torch.Tensor,
              kwargs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' cache update of layer ``idx`` with T new positions; returns the layer's
    whole keys and values.  A plain ``DynamicCache`` layer concatenates its whole cache with the
    new positions at every step (``torch.cat``: O(S) copying per layer and token, ~0.13 ms a
    layer at S ~ 100 on an OLMoE-shaped model, growing with S); here its keys/values become
    prefix views of buffers with spare room (:func:`kv_buffers`), so a step copies only its
    own positions.  The layer stays a DynamicLayer: every other operation (crop, reset,
    reorder, its own update in a prefill) works on the views or replaces them, and the next
    append notices and re-buffers.  Other caches and layer types take their own ``update``."""
    T = k.shape[2]
    bufs = kv_buffers(cache, idx, T) if k.shape[0] == 1 else None
    if (bufs is None or bufs[1].dtype != k.dtype or bufs[2].dtype != v.dtype
            or bufs[1].shape[:2] != k.shape[:2] or bufs[1].shape[3] != k.shape[3]
            or bufs[2].shape[:2] != v.shape[:2] or bufs[2].shape[3] != v.shape[3]):
        return cache.update(k, v, idx, kwargs=kwargs)
    lay, kt, vt, _, _, S = bufs
    kt[:, :, S:S + T].copy_(k)
    vt[:, :, S:S + T].copy_(v)
    kv_advance(bufs, T)
    return lay.keys, lay.values


def kv_advance(bufs: tuple, T: int) -> None:
    """The layer of ``bufs`` (:func:`kv_buffers`) holds T more positions, written into its
    buffers: its keys/values become the buffers' first S + T positions."""
    lay, kt, vt, _, _, S = bufs
    kv_views(lay, kt, vt, S + T)


def kv_views(lay: Any, kt: torch.Tensor, vt: torch.Tensor, n: int
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """A DynamicCache layer's keys/values become the first n positions of its buffers kt, vt
    [1, heads, capacity, D]; returns them (``narrow``: one op, where ``kt[:, :, :n]`` parses
    three slices)."""
    lay.keys = k = kt.narrow(2, 0, n)
    lay.values = v = vt.narrow(2, 0, n)
    return k, v


def kv_buffers(cache: Any, idx: int, T: int) -> tuple | None:
    """The KV buffers of a plain DynamicCache layer of batch 1 with room for T more positions:
    (layer, keys buffer, values buffer [1, heads, capacity, D] (values may have another D, as
    MLA's latent and rotary key do), their numpy views, S cached
    positions), the layer's keys/values being the buffers' first S positions -- made so
    (copied into new buffers with a quarter more room, at least ``_KV_SPARE`` positions) when
    they are not.  The buffers hold up to that much more memory than the cache itself.  None
    for any other cache or a layer holding nothing yet (the caller takes ``cache.update``,
    which initialises it)."""
    layers = getattr(cache, "layers", None)
    if (type(cache) is not DynamicCache or getattr(cache, "offloading", False)
            or layers is None or idx >= len(layers) or type(layers[idx]) is not DynamicLayer):
        return None
    lay = layers[idx]
    if not lay.is_initialized:
        return None
    buf = getattr(lay, "_specmoe_kv", None)
    keys, values = lay.keys, lay.values
    S = 0 if keys is None or keys.numel() == 0 else keys.shape[2]
    if (buf is None or S + T > buf[0].shape[2]
            # a deep copy of the cache copies the numpy views apart from their tensors
            or buf[2].ctypes.data != buf[0].data_ptr()
            or buf[3].ctypes.data != buf[1].data_ptr()
            or (S and not (keys.data_ptr() == buf[0].data_ptr()
                           and values.data_ptr() == buf[1].data_ptr()
                           and keys.stride() == buf[0].stride()
                           and values.stride() == buf[1].stride()
                           and keys.dtype == buf[0].dtype))):
        return _rebuffer(lay, keys, values, S, T)
    return (lay, *buf, S)


def _rebuffer(lay: Any, keys: torch.Tensor | None, values: torch.Tensor | None, S: int,
              T: int) -> tuple | None:
    """New KV buffers for a DynamicLayer holding S positions, with room for T more."""
    if keys is None or keys.dim() != 4 or keys.shape[0] != 1:
        return None
    if values is None or values.dim() != 4 or values.shape[:2] != keys.shape[:2]:
        return None
    cap = S + T + max(_KV_SPARE, (S + T) // 4)
    kt = torch.empty(*keys.shape[:2], cap, keys.shape[3], dtype=keys.dtype)
    vt = torch.empty(*values.shape[:2], cap, values.shape[3], dtype=values.dtype)
    if S:
        kt[:, :, :S].copy_(keys)
        vt[:, :, :S].copy_(values)
    lay._specmoe_kv = (kt, vt, tensor_array(kt), tensor_array(vt))
    return (lay, *lay._specmoe_kv, S)

"""specmoe.runtime.kvcache: a DynamicCache layer that owns its KV buffers (BufferedLayer).

Reference: transformers' unmodified DynamicCache of plain DynamicLayers, given the same
operations (its update concatenates with torch.cat, its crop/reorder/batch operations slice
and index), compared bit for bit after every operation.
"""
from __future__ import annotations

import copy
import pickle

import pytest
import torch
from transformers.cache_utils import DynamicCache, DynamicLayer, DynamicSlidingWindowLayer

from specmoe.runtime import kvcache, memplan
from specmoe.runtime.kvcache import BufferedLayer, kv_advance, kv_append, kv_buffers

# (heads, key width, value width): attention's keys and values; MLA's latent and rotary key
SHAPES = [(2, 8, 8), (1, 16, 4)]


def _states(gen, B, T, shape, dtype):
    H, Dk, Dv = shape
    return (torch.randn(B, H, T, Dk, generator=gen).to(dtype),
            torch.randn(B, H, T, Dv, generator=gen).to(dtype))


def _check(got, want):
    """Every layer of ``got`` holds what the plain cache ``want`` holds; a buffered layer's
    keys/values are the first S positions of its buffers."""
    assert len(got.layers) == len(want.layers)
    assert got.get_seq_length() == want.get_seq_length()
    for a, b in zip(got.layers, want.layers):
        assert type(b) is DynamicLayer
        assert a.is_initialized == b.is_initialized
        if b.keys is None:
            assert a.keys is None and a.values is None
            continue
        assert a.keys.shape == b.keys.shape and a.values.shape == b.values.shape
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
        bufs = a.buffers if isinstance(a, BufferedLayer) else None
        if bufs is not None:
            assert a.keys.shape[2] <= bufs[0].shape[2]
            assert a.keys.stride() == bufs[0].stride() and a.values.stride() == bufs[1].stride()
            if a.keys.shape[2]:   # (an empty view's data_ptr is 0)
                assert a.keys.data_ptr() == bufs[0].data_ptr()
                assert a.values.data_ptr() == bufs[1].data_ptr()


def _pair(gen, shape, dtype, layers=2, prefill=5):
    """A cache appended through kv_append and a plain DynamicCache, after the same prefill."""
    got, want = DynamicCache(), DynamicCache()
    for i in range(layers):
        k, v = _states(gen, 1, prefill, shape, dtype)
        kv_append(got, i, k, v, {})   # (an index the cache has no layer for: its own update)
        want.update(k, v, i)
    return got, want


def _append(gen, got, want, T, shape, dtype, B=1):
    for i in range(len(want.layers)):
        k, v = _states(gen, B, T, shape, dtype)
        ka, va = kv_append(got, i, k, v, {})
        kb, vb = want.update(k, v, i)
        assert torch.equal(ka, kb) and torch.equal(va, vb)
    _check(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES)
def test_buffered_cache_follows_transformers_operations(monkeypatch, shape, dtype):
    """Appends (steps and chunks, outgrowing the buffers' spare room, forced down to 3
    positions), crops (one beyond the cache's length), reorder_cache, batch_repeat_interleave
    with steps at batch 2 (buffered at that size), batch_select_indices back to batch 1, reset
    and a new prefill: after
    each, the keys/values are a plain DynamicCache's, bit for bit."""
    monkeypatch.setattr(memplan, "KV_SPARE", 3)
    gen = torch.Generator().manual_seed(1)
    got, want = _pair(gen, shape, dtype)
    _check(got, want)
    for T in (1, 1, 3, 1, 4, 1, 1, 1, 2):
        _append(gen, got, want, T, shape, dtype)
    assert all(type(la) is BufferedLayer and la.buffers is not None for la in got.layers)
    for n in (4, 1):
        got.crop(-n)
        want.crop(-n)
        _check(got, want)
        assert all(la.buffers is not None for la in got.layers)  # a crop keeps them
        _append(gen, got, want, 2, shape, dtype)
    got.reorder_cache(torch.tensor([0]))
    want.reorder_cache(torch.tensor([0]))
    _check(got, want)
    _append(gen, got, want, 1, shape, dtype)
    got.batch_repeat_interleave(2)
    want.batch_repeat_interleave(2)
    _check(got, want)
    assert all(la.buffers is None for la in got.layers)  # the assignment dropped them
    for _ in range(3):
        _append(gen, got, want, 1, shape, dtype, B=2)   # buffered at batch 2 too (BatchKV)
    assert all(la.buffers is not None and la.buffers[0].shape[0] == 2 for la in got.layers)
    assert kvcache.kv_buffers(got, 0, 1) is None      # the one-call layers take batch 1 only
    got.batch_select_indices(torch.tensor([1]))
    want.batch_select_indices(torch.tensor([1]))
    _check(got, want)
    _append(gen, got, want, 1, shape, dtype)
    assert all(la.buffers is not None for la in got.layers)  # batch 1 again: buffered again
    got.crop(-1000)                                           # more than the cache holds
    want.crop(-1000)
    _check(got, want)
    _append(gen, got, want, 2, shape, dtype)
    got.reset()
    want.reset()
    _check(got, want)
    assert all(la.buffers is None for la in got.layers)
    _append(gen, got, want, 6, shape, dtype)
    _append(gen, got, want, 1, shape, dtype)


@pytest.mark.parametrize("how", ["deepcopy", "copy", "pickle"])
def test_copies_own_their_buffers(how):
    """A copied cache continues apart from the original: each, cropped and appended to with
    different positions, holds what a plain cache copied the same way holds; a deep copy's
    buffers and their numpy views (what kv_buffers hands the C kernels) are its own, a shallow
    copy's or an unpickled layer's are made at its first append."""
    shape, dtype = SHAPES[0], torch.float32
    gen = torch.Generator().manual_seed(2)
    got, want = _pair(gen, shape, dtype)
    _append(gen, got, want, 1, shape, dtype)
    if how == "deepcopy":
        got2, want2 = copy.deepcopy(got), copy.deepcopy(want)
    elif how == "copy":   # a shallow copy of the cache shares its layers: copy them too
        got2, want2 = copy.copy(got), copy.copy(want)
        got2.layers = [copy.copy(la) for la in got.layers]
        want2.layers = [copy.copy(la) for la in want.layers]
    else:
        got2, want2 = pickle.loads(pickle.dumps(got)), pickle.loads(pickle.dumps(want))
    _check(got2, want2)
    for la, lb in zip(got.layers, got2.layers):
        assert type(lb) is BufferedLayer
        if how == "deepcopy":    # buffers of its own; a shallow copy or a pickle: none
            assert lb.buffers[0].data_ptr() != la.buffers[0].data_ptr()
            assert lb.buffers[0].shape == la.buffers[0].shape
        else:
            assert lb.buffers is None
    for g, w in ((got, want), (got2, want2), (got, want)):
        g.crop(-1)
        w.crop(-1)
        _append(gen, g, w, 2, shape, dtype)
    _check(got2, want2)
    bufs = kv_buffers(got2, 0, 1)
    kt, vt, ka, va = bufs[1:5]
    assert ka.ctypes.data == kt.data_ptr() and va.ctypes.data == vt.data_ptr()
    assert kt.data_ptr() == got2.layers[0].buffers[0].data_ptr()
    k, v = _states(gen, 1, 1, shape, dtype)
    S = bufs[5]
    ka[:, :, S] = k[:, :, 0].numpy()   # as the C kernels write: through the numpy views
    va[:, :, S] = v[:, :, 0].numpy()
    kv_advance(bufs, 1)
    want2.update(k, v, 0)
    _check(got2, want2)
    _check(got, want)


def test_replaced_keys_are_buffered_again():
    """Keys or values assigned by anything but the layer itself (here the way transformers'
    batch operations and specmoe.speculation.batch's compaction assign them) drop the buffers:
    the layer holds what was assigned, and the next append, through kv_append or the one-call
    layers' kv_buffers, buffers it again with the right contents."""
    shape, dtype = SHAPES[1], torch.bfloat16
    gen = torch.Generator().manual_seed(3)
    got, want = _pair(gen, shape, dtype, layers=1)
    _append(gen, got, want, 1, shape, dtype)
    lay = got.layers[0]
    old = lay.buffers
    new_k = want.layers[0].keys.flip(2).contiguous()     # only the keys replaced
    lay.keys = new_k
    want.layers[0].keys = new_k.clone()
    assert lay.buffers is None and lay.keys is new_k
    _check(got, want)
    _append(gen, got, want, 1, shape, dtype)
    assert lay.buffers is not None and lay.buffers[0].data_ptr() != old[0].data_ptr()
    lay.values = lay.values.clone()                        # only the values
    assert lay.buffers is None
    bufs = kv_buffers(got, 0, 2)                            # the one-call layers' path
    assert bufs is not None and bufs[0] is lay and lay.buffers is not None
    _check(got, want)
    k, v = _states(gen, 1, 2, shape, dtype)
    bufs[1][:, :, bufs[5]:bufs[5] + 2] = k
    bufs[2][:, :, bufs[5]:bufs[5] + 2] = v
    kv_advance(bufs, 2)
    want.update(k, v, 0)
    _check(got, want)
    lay.offload()   # to the device it is on: the same tensors, nothing replaced
    lay.prefetch()
    assert lay.buffers is not None


def test_appends_within_capacity_copy_only_their_positions():
    """At batch 1 an append writes its positions into the buffers: their storage stays the
    same across appends within the capacity (no whole-cache copy), through kv_append and
    through kv_buffers + kv_advance alike, and the keys/values stay views of it."""
    shape, dtype = SHAPES[0], torch.float32
    gen = torch.Generator().manual_seed(4)
    got, want = _pair(gen, shape, dtype, layers=1)
    lay = got.layers[0]
    _append(gen, got, want, 1, shape, dtype)
    kb, vb = lay.buffers
    cap = kb.shape[2]
    assert cap >= memplan.KV_SPARE
    ptrs = (kb.data_ptr(), vb.data_ptr())
    while got.get_seq_length() + 2 <= cap:
        _append(gen, got, want, 1, shape, dtype)
        bufs = kv_buffers(got, 0, 1)
        assert bufs[1] is kb and bufs[2] is vb
        k, v = _states(gen, 1, 1, shape, dtype)
        kb[:, :, bufs[5]] = k[:, :, 0]
        vb[:, :, bufs[5]] = v[:, :, 0]
        kv_advance(bufs, 1)
        want.update(k, v, 0)
        assert lay.buffers[0] is kb and (kb.data_ptr(), vb.data_ptr()) == ptrs
        assert lay.keys.data_ptr() == ptrs[0] and lay.values.data_ptr() == ptrs[1]
    _check(got, want)
    _append(gen, got, want, 4, shape, dtype)    # past the capacity: new, larger buffers
    assert lay.buffers[0].shape[2] > cap and lay.buffers[0].data_ptr() != ptrs[0]


def test_plain_layers_converted_in_place_other_caches_left_alone():
    """kv_append / kv_buffers turn a plain DynamicCache's DynamicLayer (model.generate's own
    cache) into a BufferedLayer in place, the same object; an uninitialised layer is buffered
    by its first append.  A layer of another type (a sliding window) keeps its class and its
    own update."""
    gen = torch.Generator().manual_seed(5)
    shape, dtype = SHAPES[0], torch.float32
    cache = DynamicCache()
    ref = DynamicCache()
    k, v = _states(gen, 1, 3, shape, dtype)
    cache.update(k, v, 0)
    ref.update(k, v, 0)
    lay = cache.layers[0]
    assert type(lay) is DynamicLayer
    assert kv_buffers(cache, 1, 1) is None            # no such layer yet
    bufs = kv_buffers(cache, 0, 1)
    assert cache.layers[0] is lay and type(lay) is BufferedLayer and bufs[0] is lay
    assert bufs[5] == 3 and lay.buffers is not None
    _check(cache, ref)
    fresh = DynamicCache()
    fresh.layers.append(DynamicLayer())               # uninitialised
    assert kv_buffers(fresh, 0, 1) is None and type(fresh.layers[0]) is BufferedLayer
    k, v = _states(gen, 1, 2, shape, dtype)
    kv_append(fresh, 0, k, v, {})
    assert fresh.layers[0].buffers is not None
    assert torch.equal(fresh.layers[0].keys, k) and torch.equal(fresh.layers[0].values, v)
    sw = DynamicCache()
    sw.layers.append(DynamicSlidingWindowLayer(sliding_window=4))
    for _ in range(3):
        k, v = _states(gen, 1, 2, shape, dtype)
        kv_append(sw, 0, k, v, {})
    assert type(sw.layers[0]) is DynamicSlidingWindowLayer and kv_buffers(sw, 0, 1) is None
    assert sw.layers[0].keys.shape[2] == 3                # its own window rule

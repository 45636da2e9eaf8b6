"""Policies whose victim() walks an ordered structure instead of scanning every slot (LFU,
Least-Stale in its three orders, SpAc) against the plain-Python references in ref_policies.py
with many slots (2000) and random evictable masks: the same hits and victims, access by access.
With this many slots the orders are deep (many count buckets, long per-layer lists, tall heaps),
so a refused best slot sends the search far from the top.  Extreme refusal rates and odd event
orders (repeated or decreasing pass ids, re-inserts) are covered by tests/c/policy_check.c."""
from __future__ import annotations

import numpy as np
import pytest

from specmoe import _C

from .ref_policies import make_ref, ref_replay
from .test_spac import verify_stream

NSLOTS = 2000


def stream(seed, L, E, n):
    """Skewed keys over L*E > NSLOTS experts, a pass every L*6 accesses on average."""
    rng = np.random.default_rng(seed)
    p = rng.dirichlet(np.full(L * E, 1.0))
    keys = rng.choice(L * E, size=n, p=p).astype(np.int32)
    starts = np.sort(rng.choice(np.arange(1, n), size=n // (L * 6), replace=False))
    return keys, np.concatenate([[0], starts]).astype(np.int64)


def check(name, ckw, rkw, keys, starts, L, E, mask_seed, counts=None):
    pol = _C.Policy(name, NSLOTS, L, E, **ckw)
    h, v = _C.replay(pol, keys, starts, mask_seed=mask_seed, counts=counts)
    rh, rv = ref_replay(make_ref(name, L, E, **rkw), keys.tolist(), NSLOTS, starts.tolist(),
                        mask_seed, counts=counts)
    rv = np.array(rv, np.int32)
    if not np.array_equal(v, rv):
        i = int(np.argmax(v != rv))
        pytest.fail(f"{name} {ckw}: first differing victim at access {i}: C {v[i]} ref {rv[i]}")
    assert np.array_equal(h, np.array(rh, np.uint8))
    assert (v >= 0).sum() > 500  # the stream really evicts, many times


@pytest.mark.parametrize("name,kw", [("lfu", {}), ("least_stale", {"order": "layer"}),
                                     ("least_stale", {"order": "lru"}),
                                     ("least_stale", {"order": "fifo"}), ("lhu", {}),
                                     ("fld", {})],
                         ids=["lfu", "ls-layer", "ls-lru", "ls-fifo", "lhu", "fld"])
@pytest.mark.parametrize("mask_seed", [pytest.param(0, marks=pytest.mark.slow), 5])
def test_many_slots(name, kw, mask_seed):
    L, E = 16, 256
    keys, starts = stream(len(name) + mask_seed, L, E, 9000)
    check(name, kw, kw, keys, starts, L, E, mask_seed)


@pytest.mark.parametrize("mask_seed", [pytest.param(0, marks=pytest.mark.slow), 3])
def test_many_slots_spac(mask_seed):
    rng = np.random.default_rng(11 + mask_seed)
    L, E = 16, 256
    keys, starts, counts = verify_stream(rng, 16, L, E, 8, gmax=6)  # (25 passes until make
    # test neared its 15 minutes; 16 passes of 2000 slots still fill and refuse deep orders)
    for name in ("spac", "spac_ema", "score"):
        kw = {"levels": 4} if name.startswith("spac") else {}
        check(name, kw, kw, keys, starts, L, E, mask_seed, counts)

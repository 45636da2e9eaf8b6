"""Plain-Python reference eviction policies and replay, written from the contract in
csrc/policy/policy.h and csrc/policy/replay.h (not from the C code) so the tests can check the
C policies victim by victim.

Every reference policy has the event methods of the C vtable and answers victim(candidates),
where candidates are the evictable resident slots in increasing slot order, so each one can
also be run through the Python bridge (the "python" policy) unchanged.
"""
from __future__ import annotations

import bisect
import math
from collections import OrderedDict
from typing import Sequence

MASK64 = (1 << 64) - 1


def splitmix64(state: int) -> tuple[int, int]:
    """One splitmix64 step: returns (new_state, output)."""
    state = (state + 0x9E3779B97F4A7C15) & MASK64
    z = state
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & MASK64
    return state, z ^ (z >> 31)


class RefPolicy:
    def on_insert(self, slot: int, key: int, prefetch: bool) -> None:
        pass

    def on_access(self, slot: int, key: int) -> None:
        pass

    def on_evict(self, slot: int, key: int) -> None:
        pass

    def on_pass(self, pass_id: int) -> None:
        pass

    def victim(self, candidates: list[int]) -> int:
        raise NotImplementedError


class RefLRU(RefPolicy):
    """Order of last touch (access or insert); evict the oldest candidate."""

    def __init__(self) -> None:
        self.order: OrderedDict[int, None] = OrderedDict()

    def on_insert(self, slot, key, prefetch):
        self.order[slot] = None
        self.order.move_to_end(slot)

    def on_access(self, slot, key):
        self.order.move_to_end(slot)

    def on_evict(self, slot, key):
        del self.order[slot]

    def victim(self, candidates):
        if len(candidates) == len(self.order):  # all evictable: skip building the set
            return next(iter(self.order))
        ok = set(candidates)
        return next(s for s in self.order if s in ok)


class RefFIFO(RefLRU):
    """Order of insertion only."""

    def on_access(self, slot, key):
        pass


class RefMRU(RefLRU):
    """Evict the most recently touched candidate."""

    def victim(self, candidates):
        if len(candidates) == len(self.order):
            return next(reversed(self.order))
        ok = set(candidates)
        return next(s for s in reversed(self.order) if s in ok)


class RefLFU(RefPolicy):
    """Count since insert (demand insert 1, prefetch 0, +1 per access); min count, then the
    oldest touch."""

    def __init__(self) -> None:
        self.count: dict[int, int] = {}
        self.last: dict[int, int] = {}
        self.t = 0

    def _touch(self, slot):
        self.t += 1
        self.last[slot] = self.t

    def on_insert(self, slot, key, prefetch):
        self.count[slot] = 0 if prefetch else 1
        self._touch(slot)

    def on_access(self, slot, key):
        self.count[slot] += 1
        self._touch(slot)

    def on_evict(self, slot, key):
        del self.count[slot]
        del self.last[slot]

    def victim(self, candidates):
        return min(candidates, key=lambda s: (self.count[s], self.last[s]))


class RefRandom(RefPolicy):
    """candidates[r % len(candidates)] with r the next splitmix64 output (state = seed)."""

    def __init__(self, seed: int = 0) -> None:
        self.state = seed & MASK64

    def victim(self, candidates):
        self.state, r = splitmix64(self.state)
        return candidates[r % len(candidates)]


class RefLeastStale(RefPolicy):
    """Stale (not touched since the last on_pass) first; inside each group by `order`."""

    def __init__(self, num_layers: int, num_experts: int, order: str = "layer") -> None:
        assert order in ("layer", "lru", "fifo")
        self.L, self.E, self.order = num_layers, num_experts, order
        self.key: dict[int, int] = {}
        self.pass_of: dict[int, int] = {}
        self.touched: dict[int, int] = {}
        self.inserted: dict[int, int] = {}
        self.t = 0
        self.pass_id = 0
        self.cur = 0

    def on_insert(self, slot, key, prefetch):
        self.t += 1
        self.key[slot] = key
        self.pass_of[slot] = self.pass_id
        self.touched[slot] = self.inserted[slot] = self.t
        if not prefetch:
            self.cur = key // self.E

    def on_access(self, slot, key):
        self.t += 1
        self.pass_of[slot] = self.pass_id
        self.touched[slot] = self.t
        self.cur = key // self.E

    def on_evict(self, slot, key):
        for d in (self.key, self.pass_of, self.touched, self.inserted):
            del d[slot]

    def on_pass(self, pass_id):
        self.pass_id = pass_id

    def _rank(self, s):
        fresh = self.pass_of[s] == self.pass_id  # False (stale) sorts first
        if self.order == "layer":
            j = self.key[s] // self.E
            dist = j - self.cur if j > self.cur else j - self.cur + self.L
            if not fresh and j == self.cur:
                dist = 0  # a stale expert of the current layer may still be routed to: last
            return (fresh, -dist, self.touched[s])
        if self.order == "lru":
            return (fresh, self.touched[s])
        return (fresh, self.inserted[s])

    def victim(self, candidates):
        return min(candidates, key=self._rank)


class RefBelady(RefPolicy):
    """Furthest next use (never = infinity), ties lowest slot.  A demand access of key k
    consumes k's first occurrence at or after the cursor (cursor = that position + 1)."""

    def __init__(self, future: Sequence[int]) -> None:
        self.occ: dict[int, list[int]] = {}
        for i, k in enumerate(future):
            self.occ.setdefault(int(k), []).append(i)
        self.n = len(future)
        self.cursor = 0
        self.key: dict[int, int] = {}

    def _next(self, key):
        lst = self.occ.get(key, [])
        i = bisect.bisect_left(lst, self.cursor)
        return lst[i] if i < len(lst) else self.n

    def _demand(self, key):
        q = self._next(key)
        if q < self.n:
            self.cursor = q + 1

    def on_insert(self, slot, key, prefetch):
        self.key[slot] = key
        if not prefetch:
            self._demand(key)

    def on_access(self, slot, key):
        self._demand(key)

    def on_evict(self, slot, key):
        del self.key[slot]

    def victim(self, candidates):
        best, best_q = None, -1
        for s in candidates:  # slot order: strict > keeps the lowest slot on ties
            q = self._next(self.key[s])
            if q > best_q:
                best, best_q = s, q
        return best


class RefSpAcEMA(RefPolicy):
    """The EMA utility estimator ("spac_ema"), from the rules at the top of csrc/policy/spac_ema.c: per key a
    fixed-point score s (units 1/65536 token) updated for every expert of each observed layer
    as s = (9 s + 65536 min(c, K)) // 10; per layer, Z = sorted non-zero scores (n of them),
    theta_j = Z[(j-1) n // K] (j = 1..K), utility = 0 if s == 0 else #{j: s >= theta_j};
    victim = min (utility, last touch)."""

    ONE = 65536

    def __init__(self, num_layers: int, num_experts: int, levels: int = 4) -> None:
        self.L, self.E, self.K = num_layers, num_experts, levels
        self.score = [0] * (num_layers * num_experts)
        self.util = [0] * (num_layers * num_experts)
        self.key_of: dict[int, int] = {}
        self.last: dict[int, int] = {}
        self.t = 0

    def on_insert(self, slot, key, prefetch):
        self.key_of[slot] = key
        self.t += 1
        self.last[slot] = self.t

    def on_access(self, slot, key):
        self.t += 1
        self.last[slot] = self.t

    def on_evict(self, slot, key):
        del self.key_of[slot]
        del self.last[slot]

    def on_counts(self, keys, counts):
        given: dict[int, int] = {}
        for k, c in zip(keys, counts):
            given[int(k)] = min(int(c), self.K)  # last one wins
        for layer in sorted({k // self.E for k in given}):
            ks = range(layer * self.E, (layer + 1) * self.E)
            for k in ks:
                self.score[k] = (9 * self.score[k] + self.ONE * given.get(k, 0)) // 10
            z = sorted(self.score[k] for k in ks if self.score[k])
            theta = [z[(j - 1) * len(z) // self.K] for j in range(1, self.K + 1)] if z else []
            for k in ks:
                s = self.score[k]
                self.util[k] = sum(1 for th in theta if s >= th) if s else 0

    def utility(self, key: int) -> int:
        return self.util[key]

    def victim(self, candidates):
        return min(candidates, key=lambda s: (self.util[self.key_of[s]], self.last[s]))


class RefSpAc(RefPolicy):
    """MoE-SpAc as published, written from the paper (§3.2 Algorithm 1, §3.3 Eq. 11-12, §3.4):
    per key utility s (0..K), last frequency f_prev, boundaries up/dn (initial max(1, gamma//2)).
    One step per observed layer and expert:  d = f - f_prev;  s += 1 (capped at K) if d >= up,
    else s -= 1 (floored at 0) if -d >= dn;  up = (9 up + d) // 10 if d > 0;
    dn = (9 dn - d) // 10 if d < 0 (lambda = 0.1, exact).  tau = smallest t in 1..K with
    #{keys: s >= t} <= nslots, else K.  Eviction: lowest level first, FIFO by entry into the
    level (insert, or a level change; changed keys enter in increasing key order).
    The ablations of §4.4: up/dn fixed boundaries (never recalibrated), tau a static threshold,
    counts=True the utility min(K, f) (no steps, no boundaries), gate=False threshold() 0."""

    def __init__(self, num_layers: int, num_experts: int, levels: int = 4,
                 gamma: int = 8, nslots: int = 1, up: int | None = None,
                 dn: int | None = None, tau: int | None = None, counts: bool = False,
                 gate: bool = True) -> None:
        self.L, self.E, self.K = num_layers, num_experts, levels
        n = num_layers * num_experts
        th = max(1, gamma // 2)
        self.util = [0] * n
        self.fprev = [0] * n
        self.fixed = up is not None
        self.up = [up if self.fixed else th] * n
        self.dn = [dn if self.fixed else th] * n
        self.nslots = nslots
        self.static_tau, self.counts, self.gate = tau, counts, gate
        self.tau = tau or 1
        self.key_of: dict[int, int] = {}
        self.entry: dict[int, int] = {}
        self.t = 0

    def _enter(self, slot):
        self.t += 1
        self.entry[slot] = self.t

    def on_insert(self, slot, key, prefetch):
        self.key_of[slot] = key
        self._enter(slot)

    def on_evict(self, slot, key):
        del self.key_of[slot]
        del self.entry[slot]

    def on_counts(self, keys, counts):
        f_now: dict[int, int] = {}
        for k, c in zip(keys, counts):
            if 0 <= int(k) < self.L * self.E:
                f_now[int(k)] = int(c)  # last one wins
        slot_of = {k: s for s, k in self.key_of.items()}
        for layer in sorted({k // self.E for k in f_now}):
            for k in range(layer * self.E, (layer + 1) * self.E):
                f = f_now.get(k, 0)
                d = f - self.fprev[k]
                self.fprev[k] = f
                s = self.util[k]
                if self.counts:
                    s = min(self.K, f)
                elif d >= self.up[k]:
                    s = min(self.K, s + 1)
                elif -d >= self.dn[k]:
                    s = max(0, s - 1)
                if self.fixed or self.counts:
                    pass
                elif d > 0:
                    self.up[k] = (9 * self.up[k] + d) // 10
                elif d < 0:
                    self.dn[k] = (9 * self.dn[k] - d) // 10
                if s != self.util[k]:
                    self.util[k] = s
                    if k in slot_of:
                        self._enter(slot_of[k])
        self.tau = self.static_tau or next(
            (t for t in range(1, self.K + 1)
             if sum(1 for u in self.util if u >= t) <= self.nslots), self.K)

    def utility(self, key: int) -> int:
        return self.util[key]

    def threshold(self) -> int:
        return self.tau if self.gate else 0

    def victim(self, candidates):
        return min(candidates, key=lambda s: (self.util[self.key_of[s]], self.entry[s]))


class RefLHU(RefPolicy):
    """SpecMD App. B LHU: per key the number of demand uses over the whole run (accesses and
    demand inserts; prefetch inserts do not count; kept across evictions); victim = fewest uses,
    ties least recently touched."""

    def __init__(self) -> None:
        self.uses: dict[int, int] = {}
        self.key_of: dict[int, int] = {}
        self.last: dict[int, int] = {}
        self.t = 0

    def _touch(self, slot, use):
        k = self.key_of[slot]
        if use:
            self.uses[k] = self.uses.get(k, 0) + 1
        self.t += 1
        self.last[slot] = self.t

    def on_insert(self, slot, key, prefetch):
        self.key_of[slot] = key
        self._touch(slot, not prefetch)

    def on_access(self, slot, key):
        self._touch(slot, True)

    def on_evict(self, slot, key):
        del self.key_of[slot]
        del self.last[slot]

    def victim(self, candidates):
        return min(candidates, key=lambda s: (self.uses.get(self.key_of[s], 0), self.last[s]))


class RefFLD(RefPolicy):
    """SpecMD App. B FLD: victim = largest |layer(key) - cur| (cur = layer of the latest demand
    access or demand insert), ties least recently touched."""

    def __init__(self, num_layers: int, num_experts: int) -> None:
        self.L, self.E = num_layers, num_experts
        self.cur = 0
        self.key_of: dict[int, int] = {}
        self.last: dict[int, int] = {}
        self.t = 0

    def _layer(self, key):
        return 0 if key < 0 else min(key // self.E, self.L - 1)

    def on_insert(self, slot, key, prefetch):
        self.key_of[slot] = key
        self.t += 1
        self.last[slot] = self.t
        if not prefetch and 0 <= key < self.L * self.E:
            self.cur = key // self.E

    def on_access(self, slot, key):
        self.t += 1
        self.last[slot] = self.t
        if 0 <= key < self.L * self.E:
            self.cur = key // self.E

    def on_evict(self, slot, key):
        del self.key_of[slot]
        del self.last[slot]

    def victim(self, candidates):
        return min(candidates,
                   key=lambda s: (-abs(self._layer(self.key_of[s]) - self.cur), self.last[s]))


class RefScore(RefPolicy):
    """SpecMD App. B score-based: per key the sum of all activation counts fed (a key listed
    twice in one call: the last count), kept across evictions; victim = lowest sum, ties least
    recently touched."""

    def __init__(self) -> None:
        self.score: dict[int, int] = {}
        self.key_of: dict[int, int] = {}
        self.last: dict[int, int] = {}
        self.t = 0

    def on_insert(self, slot, key, prefetch):
        self.key_of[slot] = key
        self.t += 1
        self.last[slot] = self.t

    def on_access(self, slot, key):
        self.t += 1
        self.last[slot] = self.t

    def on_evict(self, slot, key):
        del self.key_of[slot]
        del self.last[slot]

    def on_counts(self, keys, counts):
        given = {int(k): int(c) for k, c in zip(keys, counts)}
        for k, c in given.items():
            self.score[k] = self.score.get(k, 0) + c

    def victim(self, candidates):
        return min(candidates, key=lambda s: (self.score.get(self.key_of[s], 0), self.last[s]))


class RefNextUse(RefPolicy):
    """Learned next-use eviction, from csrc/policy/nextuse.h: per key the internal pass of its
    last demand touch (0 never; passes counted from 1 and +1 at each on_pass) and two
    averages of "used in a pass", folded in at on_pass; lc the layer of the latest demand
    touch in the pass (-1 none).  Victim: least q / (dl + c) + beta * el / (dl + L + c),
    ties lowest slot.  ``model`` is the flat array (NextUseModel.flat(), format 1, 2 or 3:
    token weights added where the pass's prior is set, on_prior; format 3: D cross tables and
    a bias)."""

    def __init__(self, num_layers: int, num_experts: int, model: Sequence[float]) -> None:
        m = [float(v) for v in model]
        assert m[0] in (1.0, 2.0, 3.0)
        head = 17 if m[0] == 1.0 else 21
        self.L, self.E = num_layers, num_experts
        self.wf, self.ws = m[1:7], m[7:12]
        self.a_s, self.a_l, self.c, self.beta = m[12], m[13], m[14], m[15]
        self.wtf, self.wts = (m[17:19], m[19:21]) if head == 21 else ([0.0, 0.0], [0.0, 0.0])
        self.prior = None
        n = num_layers * num_experts
        self.depth = int(m[16]) if m[0] == 3.0 else int(m[16] != 0.0)
        self.bias = m[head:head + n] if m[0] == 3.0 and self.depth else [0.0] * n
        tables = m[head + n:] if m[0] == 3.0 and self.depth else m[head:]
        assert len(tables) == self.depth * n * num_experts
        self.cross = [tables[d * n * num_experts:(d + 1) * n * num_experts]
                      for d in range(self.depth)]
        self.used = [0] * n
        self.es = [0.0] * n
        self.el = [0.0] * n
        self.key_of: dict[int, int] = {}
        self.P = 1
        self.lc = -1

    def _touch(self, key):
        self.used[key] = self.P
        self.lc = key // self.E

    def on_insert(self, slot, key, prefetch):
        self.key_of[slot] = key
        if not prefetch:
            self._touch(key)

    def on_access(self, slot, key):
        self._touch(key)

    def on_evict(self, slot, key):
        del self.key_of[slot]

    def on_pass(self, pass_id):
        for k in range(self.L * self.E):
            u = 1.0 if self.used[k] == self.P else 0.0
            self.es[k] += self.a_s * (u - self.es[k])
            self.el[k] += self.a_l * (u - self.el[k])
        self.P += 1
        self.lc = -1
        self.prior = None

    def on_prior(self, prior):
        self.prior = None if prior is None else [float(v) for v in prior]

    def _cross_mean(self, l):
        """bias[l][e] plus, for d = 1 .. min(D, l), the mean cross_d[l][a][e] over the experts
        a of layer l - d touched in this pass (list of E); None when layer l - 1 has none."""
        if not self.depth or l < 1 or l >= self.L:
            return None
        E = self.E
        out = None
        for d in range(1, min(self.depth, l) + 1):
            prev = [a for a in range(E) if self.used[(l - d) * E + a] == self.P]
            if not prev:
                if d == 1:
                    return None
                continue
            if out is None:
                out = [self.bias[l * E + e] for e in range(E)]
            acc = [0.0] * E
            for a in prev:
                base = (l * E + a) * E
                for e in range(E):
                    acc[e] += self.cross[d - 1][base + e]
            out = [o + v / len(prev) for o, v in zip(out, acc)]
        return out

    def q(self, key):
        """(q, dl) of key in the current state."""
        E, L, P, lc = self.E, self.L, self.P, self.lc
        l, e = key // E, key % E
        up = self.used[key]
        inpass = l > lc or (l == lc and up != P)
        dl = (0.0 if l == lc else float(l - lc)) if inpass else float(l - lc + L)
        ref = P if inpass else P + 1
        last = 1.0 if up > 0 and up == (P - 1 if inpass else P) else 0.0
        gap = math.log(256 if up == 0 else min(max(ref - up, 1), 256))
        xm = self._cross_mean(l) if inpass and l in (lc, lc + 1) else None
        if xm is not None:
            w = self.wf
            z = w[0] + w[1] * last + w[2] * self.es[key] + w[3] * self.el[key] + w[4] * gap \
                + w[5] * xm[e]
        else:
            w = self.ws
            z = w[0] + w[1] * last + w[2] * self.es[key] + w[3] * self.el[key] + w[4] * gap
        if inpass and self.prior is not None:
            wt = self.wtf if xm is not None else self.wts
            z += wt[0] + wt[1] * self.prior[key]
        return 1.0 / (1.0 + math.exp(-z)), dl

    def value(self, key):
        q, dl = self.q(key)
        return q / (dl + self.c) + self.beta * self.el[key] / (dl + self.L + self.c)

    def utility(self, key):
        """The value as the integer the shared prefetch rule compares (1e8 per unit)."""
        return min(math.floor(self.value(key) * 1e8 + 0.5), 2**31 - 1)

    def victim(self, candidates):
        best, best_v = -1, 0.0
        for s in candidates:
            v = self.value(self.key_of[s])
            if best < 0 or v < best_v:
                best, best_v = s, v
        return best


def ref_replay(policy: RefPolicy, keys: Sequence[int], nslots: int,
               pass_starts: Sequence[int] | int | None = None,
               mask_seed: int = 0, counts=None, priors=None) -> tuple[list[int], list[int]]:
    """Demand-only replay with the cache's semantics (replay.h): returns (hits, victim keys).
    ``counts=(keys, counts, offsets)``: fed with policy.on_counts right after on_pass(j+1);
    ``priors``: a list per pass of the prior (list of floats) or None, fed with
    policy.on_prior after that."""
    keys = [int(k) for k in keys]
    if isinstance(pass_starts, int):
        pass_starts = list(range(0, len(keys), pass_starts))
    starts = {int(p): j + 1 for j, p in enumerate([] if pass_starts is None else pass_starts)}
    where: dict[int, int] = {}  # key -> slot
    holds: dict[int, int] = {}  # slot -> key
    rng = mask_seed
    every = list(range(nslots))
    hits, victims = [], []
    for i, k in enumerate(keys):
        if i in starts:
            policy.on_pass(starts[i])
            if counts is not None:
                j = starts[i] - 1
                a, b = int(counts[2][j]), int(counts[2][j + 1])
                if hasattr(policy, "on_counts"):  # policies without it ignore counts
                    policy.on_counts(list(counts[0][a:b]), list(counts[1][a:b]))
            if priors is not None and hasattr(policy, "on_prior"):
                policy.on_prior(priors[starts[i] - 1])
        if k in where:
            hits.append(1)
            victims.append(-1)
            policy.on_access(where[k], k)
            continue
        hits.append(0)
        if len(holds) < nslots:
            s = len(holds)  # slots fill lowest first and are never freed
            victims.append(-1)
        else:
            cands = every
            if mask_seed:
                cands = []
                for t in range(nslots):
                    rng, r = splitmix64(rng)
                    if (r & 3) != 0:
                        cands.append(t)
            if not cands:
                victims.append(-1)  # bypass
                continue
            s = policy.victim(cands)
            assert s in cands
            old = holds.pop(s)
            del where[old]
            policy.on_evict(s, old)
            victims.append(old)
        holds[s] = k
        where[k] = s
        policy.on_insert(s, k, False)
    return hits, victims


def make_ref(name: str, num_layers: int, num_experts: int, *, seed: int = 0,
             order: str = "layer", future: Sequence[int] | None = None,
             levels: int = 4, gamma: int = 8, nslots: int = 1,
             model: Sequence[float] | None = None) -> RefPolicy:
    if name == "lru":
        return RefLRU()
    if name == "fifo":
        return RefFIFO()
    if name == "mru":
        return RefMRU()
    if name == "lfu":
        return RefLFU()
    if name == "random":
        return RefRandom(seed)
    if name == "least_stale":
        return RefLeastStale(num_layers, num_experts, order)
    if name == "belady":
        assert future is not None
        return RefBelady(future)
    if name == "spac":
        return RefSpAc(num_layers, num_experts, levels, gamma, nslots)
    if name == "spac_ema":
        return RefSpAcEMA(num_layers, num_experts, levels)
    if name == "lhu":
        return RefLHU()
    if name == "fld":
        return RefFLD(num_layers, num_experts)
    if name == "score":
        return RefScore()
    if name == "nextuse":
        assert model is not None
        return RefNextUse(num_layers, num_experts, model)
    raise ValueError(name)

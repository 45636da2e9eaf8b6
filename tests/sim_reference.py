"""A plain-Python reference of the simulator, written from the description in csrc/sim.h and
specmoe/sim/hardware.py (not from sim.c): cache events per policy.h, copy-engine prefetch model,
predictors, time model.  Slow; for short traces only."""
from __future__ import annotations

import math
from collections import OrderedDict

import numpy as np


class RefLRU:
    """Reference LRU over slots: victim = least recently inserted/accessed evictable slot."""

    name = "lru"

    def __init__(self):
        self.order: OrderedDict[int, int] = OrderedDict()

    def on_insert(self, slot, key, prefetch):
        self.order[slot] = key
        self.order.move_to_end(slot)

    def on_access(self, slot, key):
        self.order.move_to_end(slot)

    def on_evict(self, slot, key):
        del self.order[slot]

    def on_pass(self, pass_id):
        pass

    def victim(self, ok):
        for s in self.order:
            if ok(s):
                return s
        return -1


class RefBelady:
    """Offline optimum over the demand sequence: evict the resident key used furthest ahead."""

    name = "belady"

    def __init__(self, future):
        self.future = list(future)
        self.pos = 0  # demand accesses seen (hits and demand inserts)
        self.slots: dict[int, int] = {}
        self.next_use: dict[int, list[int]] = {}
        for i, k in enumerate(self.future):
            self.next_use.setdefault(k, []).append(i)

    def _next(self, key):
        uses = self.next_use.get(key, [])
        import bisect

        j = bisect.bisect_left(uses, self.pos)
        return uses[j] if j < len(uses) else math.inf

    def on_insert(self, slot, key, prefetch):
        self.slots[slot] = key
        if not prefetch:
            self.pos += 1

    def on_access(self, slot, key):
        self.pos += 1

    def on_evict(self, slot, key):
        del self.slots[slot]

    def on_pass(self, pass_id):
        pass

    def regret(self, key):
        """csrc/policy/belady.c's admission regret: 0 when no resident key is used later."""
        mine = self._next(key)
        return 1.0 if any(self._next(k) > mine for k in self.slots.values()) else 0.0

    def victim(self, ok):
        best, far = -1, -1.0
        for s in sorted(self.slots):
            if not ok(s):
                continue
            n = self._next(self.slots[s])
            if n > far:
                best, far = s, n
        return best


class RefAdmit:
    """Prefetch admission by expected benefit, written from the description in csrc/admit.h:
    the estimates (EMAs with weight 1/16, the first observation taken as is) and the rule
    p * saved > (1 - p) * contention * busy * load_s + regret * fetch_s, saved = clamp(demand_s -
    max(0, start + load_s - need), 0, demand_s)."""

    ALPHA = 0.0625
    EXTRA = 0.08        # the byte budget: added loads per needed load
    BUDGET_PASSES = 8   # a demand load of a key a prefetch evicted this recently is added

    def __init__(self, num_layers, contention=0.0):
        self.contention = contention
        self.L = num_layers
        self.load_s, self.step_s, self.busy = 0.0, -1.0, 1.0
        self.demand_s = self.fetch_s = -1.0
        self.pass_start, self.pass_load, self.pass_stall = -1.0, 0.0, 0.0
        self.regrets = self.evictions = 0.0
        self.needed = self.extra = 0.0  # the byte budget's counts

    def _ema(self, old, x, first):
        return x if first else old + self.ALPHA * (x - old)

    def load(self, dur):
        self.load_s = self._ema(self.load_s, dur, self.load_s <= 0.0)
        self.pass_load += dur

    def fetch(self, stall, demand):
        self.pass_stall += stall
        self.fetch_s = self._ema(self.fetch_s, stall, self.fetch_s < 0.0)
        if demand:
            self.demand_s = self._ema(self.demand_s, stall, self.demand_s < 0.0)

    def pass_(self, now):
        if self.pass_start >= 0.0 and now > self.pass_start:
            dt = now - self.pass_start
            free = max(dt - self.pass_stall, 0.0)
            b = min(self.pass_load / dt, 1.0)
            first = self.step_s < 0.0
            self.step_s = self._ema(self.step_s, free / self.L, first)
            self.busy = self._ema(self.busy, b, first)
        self.pass_start = now
        self.pass_load = self.pass_stall = 0.0

    def evicted(self):
        self.evictions += 1.0
        if self.evictions > 4096.0:
            self.evictions *= 0.5
            self.regrets *= 0.5

    def count(self, extra):
        """A load that was needed (extra False) or one prefetching added (True)."""
        if extra:
            self.extra += 1.0
            return
        self.needed += 1.0
        if self.needed > 4096.0:
            self.needed *= 0.5
            self.extra *= 0.5

    def measured_regret(self):
        return 0.5 if self.evictions < 64.0 else min(self.regrets / self.evictions, 1.0)

    def decide(self, p, issued, steps, start, regret):
        if self.needed >= 64.0 and self.extra > self.EXTRA * self.needed:
            return False  # the byte budget is spent
        if self.load_s <= 0.0 or self.step_s < 0.0:
            return True
        p = min(max(p, 0.0), 1.0)
        demand = self.load_s if self.demand_s < 0.0 else self.demand_s
        late = start + self.load_s - (issued + steps * self.step_s)
        saved = max(demand - late if late > 0.0 else demand, 0.0)
        fetch = self.fetch_s if self.fetch_s >= 0.0 else demand
        cost = (1.0 - p) * self.contention * self.busy * self.load_s + regret * fetch
        return p * saved > cost


class FromCandidates:
    """Run a tests/ref_policies.py policy (victim(candidates)) here (victim(ok)): candidates
    are the resident slots accepted by ok, in slot order; on_counts is passed through."""

    def __init__(self, policy):
        self.p = policy
        self.resident: set[int] = set()
        self.name = type(policy).__name__
        if hasattr(policy, "utility"):
            self.utility = policy.utility
        if hasattr(policy, "threshold"):
            self.threshold = policy.threshold

    def on_insert(self, slot, key, prefetch):
        self.resident.add(slot)
        self.p.on_insert(slot, key, bool(prefetch))

    def on_access(self, slot, key):
        self.p.on_access(slot, key)

    def on_evict(self, slot, key):
        self.resident.discard(slot)
        self.p.on_evict(slot, key)

    def on_pass(self, pass_id):
        self.p.on_pass(pass_id)

    def on_counts(self, keys, counts):
        if hasattr(self.p, "on_counts"):
            self.p.on_counts(keys, counts)

    def victim(self, ok):
        cands = [s for s in sorted(self.resident) if ok(s)]
        return self.p.victim(cands) if cands else -1


def _select(scores, k, topk, percentile):
    E = len(scores)
    scores = np.asarray(scores, np.float32)
    thr = -np.inf
    cap = topk or k
    if percentile > 0:
        need = int(math.floor(percentile * (E - 1))) + 1
        thr = np.sort(scores)[need - 1]
        cap = topk or E
    cand = [e for e in range(E) if scores[e] > 0 and scores[e] >= thr]
    cand.sort(key=lambda e: (-scores[e], e))
    return cand[:cap]


def ref_balance_cut(counts, on_fast, t_io, t_gpu, t_cpu):
    """MoE-SpAc Eq. 9 over the cuts n of descending counts (csrc/route.h): argmin_n
    |t_cpu * sum(counts[n:]) - (t_io * n + t_gpu * (on_fast + n))|, the smaller n on a tie."""
    best, arg = None, 0
    for n in range(len(counts) + 1):
        d = abs(t_cpu * sum(counts[n:]) - (t_io * n + t_gpu * (on_fast + n)))
        if best is None or d < best:
            best, arg = d, n
    return arg


def ref_balance_admit(counts, t_io, t_gpu, t_cpu, window):
    """Eq. 10 (csrc/route.h): of the CPU's experts (counts descending), the first whose copy
    pays (t_cpu * count > t_gpu), at most floor(window / t_io) of them."""
    if window <= 0:
        return 0
    cap = len(counts) if t_io == 0 else int(window // t_io)
    n = 0
    while n < len(counts) and n < cap and t_cpu * counts[n] > t_gpu:
        n += 1
    return n


def ref_simulate(experts, E, nslots, policy, hw, pred=None, logits=None, verify_tokens=1,
                 protect=False, admission=False, cpu_expert_s=None):
    """Returns the counters and times of smoe_sim_result for the given run.  verify_tokens
    g > 1 (demand only): each pass covers g consecutive tokens; the policy first gets
    on_counts (if it has one) with, per layer, the number of the pass's tokens using each
    expert; then per layer the union of their experts in first-appearance order; time per
    pass token_fixed_s, per layer layer_fixed_s + distinct experts * expert_s.  protect (demand
    only, any g): the lookahead shield -- at a pass's start the keys its tokens route to in
    every layer are protected, after each layer the set is the keys of the layers still to
    run; a victim is sought among unprotected slots first, then among all (csrc/slots.h).
    admission: a prefetch copy is loaded only when RefAdmit's rule accepts it when it would
    start (its probability: the predictor's score, 1 for the oracle; its victim's regret: the
    policy's ``regret(key)`` when it has one, else the measured rate of evictions whose key
    was demanded again within 2 passes); every load, stall and pass feeds the estimates.
    cpu_expert_s (one token per pass): the hybrid GPU tier -- per layer the token's experts
    not in a slot (an in-flight one counts as in a slot), by id, are cut by Eq. 9; the first
    `cut` demanded, the rest computed on the CPU (cpu_expert_s each, from the layer's start,
    the layer ending at the later of the device's part and the CPU's); with a predictor the
    first Eq. 10 of the CPU's experts are queued (probability 1, one step) after the layer's
    predictions."""
    N, L, K = experts.shape
    pred = dict(pred or {})
    kind = pred.get("kind", "none")
    depth = 1 if kind == "router" else pred.get("depth", 1)
    topk = pred.get("topk", 0)
    pct = pred.get("percentile", 0.0)
    H = pred.get("history", 16)
    w = pred.get("cooc_weight", 0.8)
    load_s = hw["link_latency_s"] + hw["expert_bytes"] / hw["link_bw"]
    expert_s = hw["expert_bytes"] / hw["fast_bw"]
    c = dict(accesses=0, hits=0, misses=0, collision_misses=0, evictions=0, prefetch_issued=0,
             prefetch_used=0, prefetch_late=0, prefetch_wasted=0, prefetch_dropped=0,
             predicted=0, predicted_true=0, next_true=0, stall_s=0.0, compute_s=0.0,
             protected_evictions=0, prefetch_refused=0, missing=0, hybrid_copied=0,
             hybrid_cpu=0, hybrid_admitted=0, hybrid_cpu_wait_s=0.0)
    adm = RefAdmit(L) if admission else None
    protected: set[int] = set()
    slot_key = [-1] * nslots
    slot_pass = [0] * nslots
    slot_pf = [False] * nslots
    where: dict[int, int] = {}
    evicted = {}
    pf_victim: dict[int, bool] = {}
    st = dict(now=0.0, pass_=0, inflight=-1, ready=0.0, ce_free=0.0, issue=0.0)
    queue: list[int] = []
    freq = np.zeros((L, E), np.int64)
    cooc = np.zeros((L, E, E), np.int64)
    cnt = np.zeros((L, E), np.int64)
    seen = [0]

    def give_slot(key, prefetch, req=None):
        # admission: a request that cannot pay even without a victim is refused before any
        # victim search (and then never counted as dropped)
        if req is not None and not adm.decide(req[1], st["issue"], req[2], req[3], 0.0):
            c["prefetch_refused"] += 1
            return -3
        free = [s for s in range(nslots) if slot_key[s] == -1]
        if free:
            s = free[0]
        else:
            def ok(s):
                if s == st["inflight"]:
                    return False
                if prefetch and hasattr(policy, "utility") and \
                        policy.utility(slot_key[s]) > policy.utility(key):
                    return False  # no prefetch over a higher utility (utility-space policies)
                return not (prefetch and slot_pass[s] == st["pass_"])
            s = -1
            if protected:  # the shield: unprotected slots first
                s = policy.victim(lambda s: ok(s) and slot_key[s] not in protected)
            if s < 0:
                s = policy.victim(ok)
            if s < 0:
                return -1
            old = slot_key[s]
            if req is not None:
                regret = policy.regret(old) if hasattr(policy, "regret") else \
                    adm.measured_regret()
                if not adm.decide(req[1], st["issue"], req[2], req[3], regret):
                    c["prefetch_refused"] += 1
                    return -3
            if adm:
                adm.evicted()
            c["protected_evictions"] += old in protected
            del where[old]
            evicted[old] = st["pass_"]
            pf_victim[old] = bool(prefetch)
            c["evictions"] += 1
            if slot_pf[s]:
                c["prefetch_wasted"] += 1
                if adm:
                    adm.count(True)
            policy.on_evict(s, old)
        if adm and not prefetch:  # a demand load of a key a prefetch displaced: added
            adm.count(pf_victim.get(key, False) and
                      st["pass_"] - evicted[key] < RefAdmit.BUDGET_PASSES)
        slot_key[s] = key
        where[key] = s
        slot_pf[s] = bool(prefetch)
        if not prefetch:
            slot_pass[s] = st["pass_"]
        policy.on_insert(s, key, int(prefetch))
        return s

    def run_engine(now):
        while True:
            if st["inflight"] >= 0:
                if st["ready"] > now:
                    return
                st["ce_free"] = st["ready"]
                st["inflight"] = -1
            if not queue:
                return
            start = max(st["ce_free"], st["issue"])
            if start > now:
                return
            key, prob, steps = queue.pop(0)
            if key in where:
                continue
            if hasattr(policy, "threshold") and policy.utility(key) < policy.threshold():
                c["prefetch_dropped"] += 1  # spac: only hot experts are prefetched (sim.h)
                continue
            s = give_slot(key, True, (key, prob, steps, start) if adm else None)
            if s == -3:
                continue
            if s < 0:
                c["prefetch_dropped"] += 1
                continue
            if adm:
                adm.load(load_s)
            c["prefetch_issued"] += 1
            st["inflight"] = s
            st["ready"] = start + load_s
            st["ce_free"] = st["ready"]

    def finish_inflight():
        if adm:
            adm.fetch(st["ready"] - st["now"], False)
        c["stall_s"] += st["ready"] - st["now"]
        st["now"] = st["ready"]
        st["ce_free"] = st["ready"]
        st["inflight"] = -1

    def demand(key):
        c["accesses"] += 1
        if key in where:
            s = where[key]
            if s == st["inflight"]:
                c["misses"] += 1
                c["prefetch_late"] += 1
                finish_inflight()
            else:
                c["hits"] += 1
                if adm and slot_pf[s]:
                    adm.fetch(0.0, False)
            if slot_pf[s]:
                c["prefetch_used"] += 1
                slot_pf[s] = False
                if adm:
                    adm.count(False)
            slot_pass[s] = st["pass_"]
            policy.on_access(s, key)
            return
        c["misses"] += 1
        if evicted.get(key) == st["pass_"]:
            c["collision_misses"] += 1
        if adm and key in evicted and st["pass_"] - evicted[key] < 2:
            adm.regrets += 1.0
        s = give_slot(key, False)
        if s < 0 and st["inflight"] >= 0:
            finish_inflight()
            s = give_slot(key, False)
        assert s >= 0
        if st["inflight"] >= 0:
            st["ready"] += load_s
            st["ce_free"] = st["ready"]
        c["stall_s"] += load_s
        if adm:
            adm.load(load_s)
            adm.fetch(load_s, True)
        st["now"] += load_s

    def position(t, l, j):
        p = l + j
        return t + p // L, p % L

    def predict(t, l):
        queue.clear()
        st["issue"] = st["now"]
        queued = set()
        for j in range(1, depth + 1):
            tt, ll = position(t, l, j)
            if tt >= N:
                break
            truth = [int(x) for x in experts[tt, ll]]
            if kind == "oracle":
                sel, score = truth, {e: 1.0 for e in truth}
            elif kind == "router":
                if tt != t:
                    break
                z = logits[tt, ll].astype(np.float64)
                p = np.exp(z - z.max())
                prob = (p / p.sum()).astype(np.float32)
                sel, score = _select(prob, K, topk, pct), prob
            else:
                win = min(seen[0], H)
                sc = (np.float32((1 - w) * freq[ll] / win) if win else
                      np.zeros(E, np.float32)).astype(np.float32)
                if j == 1 and w > 0:
                    for a in experts[t, l]:
                        if cnt[l, a]:
                            sc = (sc + (w / (cnt[l, a] * K) * cooc[l, a]).astype(np.float32)
                                  ).astype(np.float32)
                sel, score = _select(sc, K, topk, pct), sc
            if j == 1:
                c["predicted"] += len(sel)
                c["next_true"] += K
                c["predicted_true"] += len(set(sel) & set(truth))
            for e in sel:
                key = ll * E + e
                if key not in queued and key not in where:
                    queued.add(key)
                    queue.append((key, min(float(np.float32(score[e])), 1.0), j))

    def protect_rest(toks, l0):
        protected.clear()
        protected.update(l * E + int(e) for l in range(l0, L) for t in toks for e in experts[t, l])

    if verify_tokens > 1 or protect:
        assert kind == "none"
        for p, t0 in enumerate(range(0, N, verify_tokens)):
            toks = range(t0, min(t0 + verify_tokens, N))
            st["pass_"] = p + 1
            policy.on_pass(p + 1)
            if hasattr(policy, "on_counts"):
                cnt: dict[int, int] = {}
                for l in range(L):
                    for t in toks:
                        for e in set(int(x) for x in experts[t, l]):
                            cnt[l * E + e] = cnt.get(l * E + e, 0) + 1
                policy.on_counts(list(cnt), list(cnt.values()))
            if protect:
                protect_rest(toks, 0)
            st["now"] += hw["token_fixed_s"]
            c["compute_s"] += hw["token_fixed_s"]
            for l in range(L):
                st["now"] += hw["layer_fixed_s"]
                union = list(dict.fromkeys(l * E + int(e) for t in toks for e in experts[t, l]))
                for key in union:
                    demand(key)
                st["now"] += len(union) * expert_s
                c["compute_s"] += hw["layer_fixed_s"] + len(union) * expert_s
                if protect:
                    protect_rest(toks, l + 1)
        c["total_s"] = st["now"]
        return c

    for t in range(N):
        if kind != "none":
            run_engine(st["now"])
        st["pass_"] = t + 1
        policy.on_pass(t + 1)
        if adm:
            adm.pass_(st["now"])
        if hasattr(policy, "on_counts"):  # one-token pass: count 1 per expert of each layer
            ks = list(dict.fromkeys(l * E + int(e) for l in range(L) for e in experts[t, l]))
            policy.on_counts(ks, [1] * len(ks))
        st["now"] += hw["token_fixed_s"]
        c["compute_s"] += hw["token_fixed_s"]
        for l in range(L):
            st["now"] += hw["layer_fixed_s"]
            l0 = st["now"]
            on_cpu, admit = [], []
            if cpu_expert_s is not None:
                if kind != "none":
                    run_engine(st["now"])
                missing = sorted(int(e) for e in experts[t, l] if l * E + int(e) not in where)
                on_fast = K - len(missing)
                cut = ref_balance_cut([1] * len(missing), on_fast, load_s, expert_s,
                                      cpu_expert_s)
                on_cpu = missing[cut:]
                tc = cpu_expert_s * len(on_cpu)
                tg = load_s * cut + expert_s * (on_fast + cut)
                admit = on_cpu[:ref_balance_admit([1] * len(on_cpu), load_s, expert_s,
                                                  cpu_expert_s, max(tc, tg) - load_s * cut)]
                c["missing"] += len(missing)
                c["hybrid_copied"] += cut
                c["hybrid_cpu"] += len(on_cpu)
            for e in experts[t, l]:
                if int(e) in on_cpu:
                    continue
                if kind != "none":
                    run_engine(st["now"])
                demand(l * E + int(e))
            if kind == "history":
                pt, pl = (t, l - 1) if l > 0 else (t - 1, L - 1)
                if pt >= 0:
                    for a in experts[pt, pl]:
                        cnt[pl, a] += 1
                        for b in experts[t, l]:
                            cooc[pl, a, b] += 1
            if kind != "none":
                predict(t, l)
                queued = {q[0] for q in queue}
                for e in admit:  # appended after the predictions (replace = 0)
                    key = l * E + e
                    if key not in queued and key not in where:
                        queue.append((key, 1.0, 1))
                c["hybrid_admitted"] += len(admit)
            n_dev = K - len(on_cpu)
            st["now"] += n_dev * expert_s
            if on_cpu and l0 + cpu_expert_s * len(on_cpu) > st["now"]:
                c["hybrid_cpu_wait_s"] += l0 + cpu_expert_s * len(on_cpu) - st["now"]
                st["now"] = l0 + cpu_expert_s * len(on_cpu)
            c["compute_s"] += hw["layer_fixed_s"] + n_dev * expert_s
        if kind == "history":
            for l in range(L):
                for e in experts[t, l]:
                    freq[l, e] += 1
                if t >= H:
                    for e in experts[t - H, l]:
                        freq[l, e] -= 1
            seen[0] += 1
    c["total_s"] = st["now"]
    return c

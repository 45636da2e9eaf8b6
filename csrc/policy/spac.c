/* spac: MoE-SpAc's Speculative Utility Estimator and utility-guided eviction as published
 * (Li, Lin, Ge, Ye, 2026, arXiv:2603.09983; the copy in ../shared/papers/moe-spac.txt).
 * The plain-Python reference is tests/ref_policies.py RefSpAc; the older estimator written from
 * the abstract (an EMA with quantile levels) lives on as "spac_ema" (policy/spac_ema.c).
 *
 * Estimator: Algorithm 1 (§3.2), per expert key i, one step t per on_counts call:
 *   f_{i,t}   the activation frequency of the verification pass (the count given; §2.3: the
 *             number of the pass's tokens routed to the expert, in 0..γ+1; not clamped);
 *   Δ_{i,t} = f_{i,t} - f_{i,t-1}   (line 7; f_{i,0} = 0)
 *   s_{i,t+1} = min(K, s+1)  if Δ >= θ↑_{i,t}                        (line 9-10, Eq. 6)
 *               max(0, s-1)  else if -Δ >= θ↓_{i,t}                   (line 11-12)
 *               s            otherwise                                (line 14)
 *   θ↑ <- ⌊(1-λ)θ↑ + λΔ⌋ if Δ > 0;  θ↓ <- ⌊(1-λ)θ↓ + λ|Δ|⌋ if Δ < 0   (lines 17-25)
 *   with λ = 0.1 (§4.1), computed exactly in integers as ⌊(9θ + |Δ|) / 10⌋ (no floating
 *   point, so the Python reference agrees bit for bit).  Initial s = 0 (line 2) and
 *   θ↑ = θ↓ = ⌊γ/2⌋ (line 3), where γ is the draft length: params->theta0 carries ⌊γ/2⌋
 *   (0 means the paper's γ = 8, §4.1, so 4).  K = params->levels (0 means the paper's K = 4).
 *   Deviation: a boundary of 0 (γ <= 1: plain decoding or one draft token) is raised to 1.  With
 *   θ↑ = 0 the test Δ >= θ↑ holds for Δ = 0, so every expert whose frequency did not change,
 *   dormant ones (0 -> 0) included, would climb one level per step up to K; the update rule
 *   never makes a boundary of 1 or more fall to 0 (⌊(9θ + |Δ|)/10⌋ >= 1 for θ, |Δ| >= 1), so the
 *   clamp only touches the initial value.
 * Observation (same contract as policy.h's on_counts): the layers of the listed keys are
 * observed; every expert of an observed layer takes one step (absent ones with f = 0, as
 * Algorithm 1 loops over all N experts); layers not listed take no step.  A key listed twice:
 * the last count wins.  Keys out of range are ignored.
 *
 * Threshold τ_t (§3.3, Eq. 9-12, Appendix C.2): the hot experts are those with s >= τ.  The
 * paper picks τ in 1..K to balance CPU and GPU execution (Eq. 9) under an I/O budget (Eq. 10)
 * and a memory budget (Eq. 11).  specmoe computes every expert on one device after loading it
 * (no CPU execution of cold experts, so no T_cpu/T_gpu balance) and the policy sees no timings,
 * so only Eq. 11 and 12 remain: with n(τ) the number of hot experts not resident and VRAM_left
 * the slots left once the evictor has removed the cold residents (nslots - hot residents),
 * W n(τ) <= VRAM_left is exactly "#{i : s_i >= τ} <= nslots".  τ_t is the smallest feasible τ
 * (the largest hot set that fits, i.e. the fewest cold misses), and K when none is (the
 * paper's fallback, Appendix C.2).  It is recomputed after every on_counts over all keys (one
 * cache shared by all layers, where the paper solves per layer) and read through the
 * threshold op; the simulator's prefetcher processes only requests with s >= τ (§3.4 "the
 * prefetcher only processes queues with levels s >= τ"), see sim.c.
 *
 * Eviction (§3.4 Utility-Guided Eviction): resident experts are indexed by their current
 * utility; the evictor removes those with s < τ first, lowest utility first.  Within one
 * utility level the order is FIFO by entry into the level (the multi-level queues of §3.4 are
 * FIFO per level; an ordered index with equal keys kept in insertion order gives the same):
 * a slot enters a level's queue when it is inserted (demand or prefetch) or when on_counts moves
 * its key to another level; an access does not reorder it.  Keys moved by one on_counts call
 * enter their new queues in increasing key order.  victim() is the head of the lowest
 * non-empty level that evictable() accepts: since every cold level lies below every hot one,
 * this is "cold first" for any τ.  Not taken from Appendix D: the implementation note that
 * sets a used expert's tag to 0 right after its computation (so it is recycled first); with
 * it, eviction would no longer follow the utility and §3.4's description (which this follows)
 * would not hold.  Experts in use are "frozen" there; here the cache's pins do that (a pinned
 * slot is not evictable).
 *
 * Ablations (§4.4 Table 4, and the plain-counts estimator), chosen at init by the params'
 * spac_* fields, for benchmarks/spac_ablation.py: fixed boundaries (spac_up / spac_dn: lines
 * 17-25 skipped, θ↑ and θ↓ constant; the paper's "w/o AdaBC" uses 3 and 1); a static τ
 * (spac_tau: "w/o HetWB", τ = 2); utility = min(K, f) of the latest pass (spac_counts: no
 * estimator, the frequency as the level); the prefetcher not gated by τ (spac_nogate: the
 * threshold op returns 0, so prefetch follows the predictor's ranking while eviction follows
 * the utility: separate prefetch and eviction scores).  The paper's "w/o SpecUE" (binary
 * utility, K = 1) is levels = 1.
 *
 * Memory: per key s, f_{t-1}, θ↑, θ↓, the pending count and the resident slot; per layer an
 * observed flag; per slot its key and an indexed heap keyed (level, entry clock) (slotheap.h);
 * per level the number of keys on it (for τ).  All sized at init; nothing allocates later.
 * Costs: insert/evict O(log nslots); access O(1); on_counts O(n + observed layers * E +
 * moved resident slots * log nslots + K); victim O(1 + refused slots) (slotheap.h). */
#include <stdlib.h>

#include "policy.h"
#include "slotheap.h"

#define SPAC_DEFAULT_LEVELS 4 /* K = 4 (§4.1) */
#define SPAC_DEFAULT_THETA0 4 /* ⌊γ/2⌋ with γ = 8 (§4.1) */

typedef struct spac_state {
    uint32_t levels;   /* K */
    uint32_t tau;      /* τ_t, 1..K */
    uint32_t tau_fixed; /* ablations (see the header): a static τ (0: Eq. 11-12) */
    uint8_t fixed_th;  /* boundaries constant (no lines 17-25) */
    uint8_t counts;    /* utility = min(K, f) */
    uint8_t nogate;    /* threshold op 0 */
    uint8_t *util;     /* [nkeys] s, 0..K */
    uint32_t *fprev;   /* [nkeys] f_{t-1} */
    uint32_t *th_up;   /* [nkeys] θ↑ (>= 1) */
    uint32_t *th_dn;   /* [nkeys] θ↓ (>= 1) */
    uint32_t *pending; /* [nkeys] f of the current on_counts call */
    int32_t *key_slot; /* [nkeys] resident slot of the key, -1 when none */
    uint64_t *nlevel;  /* [K + 1] keys on each level */
    uint8_t *observed; /* [num_layers] scratch of the current on_counts call */
    int32_t *slot_key; /* [nslots] */
    uint8_t *resident; /* [nslots] */
    uint64_t clock;    /* entry order into the level queues */
    smoe_slotheap heap; /* resident slots keyed (level, entry clock) */
} spac_state;

static void spac_free(smoe_policy *p) {
    spac_state *st = p->state;
    if (!st) return;
    free(st->util);
    free(st->fprev);
    free(st->th_up);
    free(st->th_dn);
    free(st->pending);
    free(st->key_slot);
    free(st->nlevel);
    free(st->observed);
    free(st->slot_key);
    free(st->resident);
    smoe_slotheap_free(&st->heap);
    free(st);
    p->state = NULL;
}

static int spac_init(smoe_policy *p, const smoe_policy_params *params, smoe_err *err) {
    int32_t levels = params->levels ? params->levels : SPAC_DEFAULT_LEVELS;
    if (levels < 1 || levels > 255)
        return smoe_err_set(err, SMOE_EINVAL, "spac: levels must be in 1..255 (0 = default %d), "
                            "got %d", SPAC_DEFAULT_LEVELS, (int)params->levels);
    if (params->theta0 < 0)
        return smoe_err_set(err, SMOE_EINVAL, "spac: theta0 must be >= 0 (0 = default %d), got %d",
                            SPAC_DEFAULT_THETA0, (int)params->theta0);
    const uint32_t theta0 = params->theta0 ? (uint32_t)params->theta0 : SPAC_DEFAULT_THETA0;
    if (params->spac_up < 0 || params->spac_dn < 0 || (params->spac_up > 0) != (params->spac_dn > 0))
        return smoe_err_set(err, SMOE_EINVAL, "spac: fixed boundaries need both up and dn >= 1 "
                            "(or neither), got up=%d dn=%d", (int)params->spac_up,
                            (int)params->spac_dn);
    if (params->spac_tau < 0 || params->spac_tau > levels)
        return smoe_err_set(err, SMOE_EINVAL, "spac: a static tau must be in 1..levels (%d), or "
                            "0 for Eq. 11-12's, got %d", (int)levels, (int)params->spac_tau);
    const size_t nkeys = (size_t)params->num_layers * params->num_experts;
    spac_state *st = calloc(1, sizeof *st);
    p->state = st;
    if (st) {
        st->levels = (uint32_t)levels;
        st->tau_fixed = (uint32_t)params->spac_tau;
        st->fixed_th = params->spac_up > 0;
        st->counts = params->spac_counts != 0;
        st->nogate = params->spac_nogate != 0;
        st->util = calloc(nkeys, 1);
        st->fprev = calloc(nkeys, sizeof *st->fprev);
        st->th_up = malloc(nkeys * sizeof *st->th_up);
        st->th_dn = malloc(nkeys * sizeof *st->th_dn);
        st->pending = calloc(nkeys, sizeof *st->pending);
        st->key_slot = malloc(nkeys * sizeof *st->key_slot);
        st->nlevel = calloc((size_t)levels + 1, sizeof *st->nlevel);
        st->observed = calloc(params->num_layers, 1);
        st->slot_key = calloc(params->nslots, sizeof *st->slot_key);
        st->resident = calloc(params->nslots, 1);
    }
    if (!st || !st->util || !st->fprev || !st->th_up || !st->th_dn || !st->pending ||
        !st->key_slot || !st->nlevel || !st->observed || !st->slot_key || !st->resident ||
        smoe_slotheap_init(&st->heap, params->nslots) < 0) {
        spac_free(p);
        return smoe_err_set(err, SMOE_ENOMEM, "spac: out of memory for %zu keys", nkeys);
    }
    for (size_t k = 0; k < nkeys; k++) {
        st->th_up[k] = st->fixed_th ? (uint32_t)params->spac_up : theta0;
        st->th_dn[k] = st->fixed_th ? (uint32_t)params->spac_dn : theta0;
        st->key_slot[k] = -1;
    }
    st->nlevel[0] = nkeys;
    st->tau = st->tau_fixed ? st->tau_fixed : 1; /* every key on level 0: n(1) = 0 fits */
    return 0;
}

static int spac_key_ok(const smoe_policy *p, int32_t k) {
    return k >= 0 && (uint64_t)k < (uint64_t)p->num_layers * p->num_experts;
}

/* (Re-)enter slot s at the tail of its key's level queue. */
static void spac_enqueue(smoe_policy *p, spac_state *st, uint32_t s) {
    const int32_t k = st->slot_key[s];
    smoe_slotheap_set(&st->heap, s, spac_key_ok(p, k) ? st->util[k] : 0, ++st->clock);
}

static void spac_drop(smoe_policy *p, spac_state *st, uint32_t s) {
    const int32_t k = st->slot_key[s];
    if (spac_key_ok(p, k) && st->key_slot[k] == (int32_t)s) st->key_slot[k] = -1;
    smoe_slotheap_remove(&st->heap, s);
    st->resident[s] = 0;
}

static void spac_insert(smoe_policy *p, uint32_t slot, int32_t key, int prefetch) {
    spac_state *st = p->state;
    (void)prefetch;
    if (slot >= p->nslots) return;
    if (st->resident[slot]) spac_drop(p, st, slot);
    st->slot_key[slot] = key;
    st->resident[slot] = 1;
    if (spac_key_ok(p, key)) st->key_slot[key] = (int32_t)slot;
    spac_enqueue(p, st, slot);
}

static void spac_access(smoe_policy *p, uint32_t slot, int32_t key) {
    (void)p;
    (void)slot;
    (void)key; /* FIFO inside a level: an access does not reorder (see the header) */
}

static void spac_evict(smoe_policy *p, uint32_t slot, int32_t key) {
    spac_state *st = p->state;
    (void)key;
    if (slot >= p->nslots || !st->resident[slot]) return;
    spac_drop(p, st, slot);
}

/* τ_t: the smallest τ in 1..K with #{keys on levels >= τ} <= nslots, else K (see header). */
static void spac_threshold_update(smoe_policy *p, spac_state *st) {
    if (st->tau_fixed) return; /* ablation: a static τ */
    uint64_t hot = 0;
    for (uint32_t v = 1; v <= st->levels; v++) hot += st->nlevel[v];
    uint32_t tau = 1;
    while (tau < st->levels && hot > p->nslots) hot -= st->nlevel[tau++];
    st->tau = tau;
}

/* Algorithm 1, lines 5-26, for every expert of layer l (f from st->pending, then cleared). */
static void spac_layer(smoe_policy *p, spac_state *st, uint32_t l) {
    const uint32_t E = p->num_experts, K = st->levels;
    for (uint32_t e = 0; e < E; e++) {
        const size_t k = (size_t)l * E + e;
        const uint32_t f = st->pending[k];
        st->pending[k] = 0;
        const int64_t d = (int64_t)f - (int64_t)st->fprev[k]; /* Δ, line 7 */
        st->fprev[k] = f;
        const uint32_t s = st->util[k];
        uint32_t ns = s;
        if (st->counts) ns = f < K ? f : K;                                 /* ablation */
        else if (d >= (int64_t)st->th_up[k]) ns = s < K ? s + 1 : K;      /* lines 9-10 */
        else if (-d >= (int64_t)st->th_dn[k]) ns = s > 0 ? s - 1 : 0; /* lines 11-12 */
        if (!st->fixed_th && !st->counts) { /* lines 17-25 (skipped by the ablations) */
            if (d > 0)
                st->th_up[k] = (uint32_t)((9 * (uint64_t)st->th_up[k] + (uint64_t)d) / 10);
            else if (d < 0)
                st->th_dn[k] = (uint32_t)((9 * (uint64_t)st->th_dn[k] + (uint64_t)-d) / 10);
        }
        if (ns != s) {
            st->util[k] = (uint8_t)ns;
            st->nlevel[s]--;
            st->nlevel[ns]++;
            if (st->key_slot[k] >= 0) spac_enqueue(p, st, (uint32_t)st->key_slot[k]);
        }
    }
}

static void spac_counts(smoe_policy *p, const int32_t *keys, const uint32_t *counts,
                        uint32_t n) {
    spac_state *st = p->state;
    for (uint32_t i = 0; i < n; i++) {
        if (!spac_key_ok(p, keys[i])) continue;
        st->pending[keys[i]] = counts[i];
        st->observed[(uint32_t)keys[i] / p->num_experts] = 1;
    }
    for (uint32_t l = 0; l < p->num_layers; l++)
        if (st->observed[l]) {
            spac_layer(p, st, l);
            st->observed[l] = 0;
        }
    spac_threshold_update(p, st);
}

static int32_t spac_utility(const smoe_policy *p, int32_t key) {
    const spac_state *st = p->state;
    return spac_key_ok(p, key) ? st->util[key] : -1;
}

static int32_t spac_threshold(const smoe_policy *p) {
    const spac_state *st = p->state;
    return st->nogate ? 0 : (int32_t)st->tau; /* ablation: every key passes the gate */
}

static int32_t spac_victim(smoe_policy *p, smoe_evictable_fn ok, void *ctx) {
    spac_state *st = p->state;
    return smoe_slotheap_find(&st->heap, ok, ctx);
}

const smoe_policy_ops smoe_policy_spac = {
    .name = "spac",
    .init = spac_init,
    .free = spac_free,
    .on_insert = spac_insert,
    .on_access = spac_access,
    .on_evict = spac_evict,
    .on_pass = NULL,
    .victim = spac_victim,
    .on_counts = spac_counts,
    .utility = spac_utility,
    .threshold = spac_threshold,
};

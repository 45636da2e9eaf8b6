/* spac_ema: our first utility-space policy after MoE-SpAc (Li, Lin, Ge, Ye, 2026,
 * arXiv:2603.09983), written from the paper's abstract only.  It was called "spac" until the
 * paper's own estimator (Algorithm 1, csrc/policy/spac.c) took that name; it is kept because it
 * wins on the real traces at some capacities and pass lengths (docs/simulator.md).
 *
 * The paper's Speculative Utility Estimator gives every expert an integer utility derived from
 * how many of a verification pass's speculated tokens activate it, and its execution engine
 * decides prefetch order and eviction in that one utility space.  Only the paper's abstract
 * was available when this was written, so the estimator below is our own concrete reading of
 * it; every choice is listed here and mirrored by the plain-Python reference
 * (tests/ref_policies.py RefSpAcEMA).
 *
 *  1. Levels.  K = params->levels (1..255; 0 means the default 4).  Utility is an integer in
 *     0..K.  K is fixed per policy while the draft length may vary per iteration, so a count
 *     is clamped to K before use: a pass of K_draft+1 > K tokens cannot push an expert above
 *     the top level, and a shorter pass simply produces smaller counts.
 *  2. Score.  Per key an exponential moving average of the clamped counts with forgetting
 *     factor beta = 0.1:  s <- (1 - beta) s + beta c.  It is kept in fixed point (units of
 *     1/65536 token) and computed in integers, s <- floor((9 s + 65536 c) / 10), so the C
 *     policy and the Python reference agree bit for bit (no floating point anywhere).  With
 *     floor rounding a score left alone decays to exactly 0 (about 100 passes after a count of
 *     1).
 *  3. Observation.  on_counts(keys, counts, n) carries one pass's counts.  The layers of the
 *     listed keys are "observed": every expert of an observed layer is updated (an absent one
 *     with c = 0, so it decays); layers not listed are untouched, so a caller may feed one
 *     layer at a time or all layers at once with the same result.  A key listed twice: the last
 *     count wins; keys out of range are ignored.
 *  4. Adaptive thresholds, per layer.  After a layer's scores are updated its K thresholds are
 *     re-derived from the current score distribution of that layer: with Z the ascending list
 *     of the layer's n non-zero scores, theta_j = Z[floor((j - 1) n / K)] for j = 1..K
 *     (equal-frequency bins of the non-zero scores).  The utility of an expert is 0 if its
 *     score is 0, else the number of j with s >= theta_j (so 1..K; equal scores share a
 *     level).  Thresholds are per layer because every layer sees the same number of
 *     activations per token (top-k), so layer-relative levels are comparable across layers, and
 *     re-ranking one layer costs O(E log E) instead of all L*E keys.  Utilities change only in
 *     on_counts; before any counts every key has utility 0.
 *  5. Victim: the resident evictable slot whose key has the lowest utility; ties go to the
 *     least recently touched slot (touch = access or insert of either kind, a logical clock
 *     advanced by each on_insert/on_access, so no ties remain).  With no counts ever fed the
 *     policy is therefore exactly LRU.
 *  6. Prefetch order is not decided inside the policy: the caller orders prefetch requests by
 *     utility (ExpertCache.utility -> ExpertCache.prefetch priorities), and the cache's worker
 *     evicts through victim(), so both sides use the same utilities.  Admission in the same
 *     space: the cache (and the simulator) let a prefetch evict only a slot whose utility is
 *     <= the prefetched key's utility (any policy with a utility op); a demand miss may evict
 *     any unpinned slot.  "<=" rather than "<" keeps prefetching alive before any counts
 *     (all utilities 0) and between experts of one level.
 *  7. A policy swap (smoe_cache_set_policy) starts a fresh spac_ema with all scores 0.
 *
 * Memory: fixed arrays allocated at init (scores and utilities per key, pending counts per key,
 * one layer of scratch, per-slot state, an indexed heap of the resident slots keyed by
 * (utility, last touch), per-layer lists of the resident slots); on_counts and victim allocate
 * nothing.  An access or insert re-keys one slot, O(log nslots); on_counts re-keys the resident
 * slots of each observed layer, O(n + observed layers * (E log E + resident slots of the layer
 * * log nslots)); victim() walks the heap from the top past refused slots (slotheap.h):
 * O(1 + refused slots), O(nslots) when almost nothing is evictable. */
#include <stdlib.h>

#include "policy.h"
#include "slotheap.h"

#define SPAC_ONE 65536u /* fixed-point unit of a score: one token */
#define SPAC_DEFAULT_LEVELS 4

typedef struct spac_state {
    uint32_t levels;
    uint64_t *score;   /* [nkeys] fixed-point EMA of clamped counts */
    uint8_t *util;     /* [nkeys] 0..levels */
    uint32_t *pending; /* [nkeys] clamped count of the current on_counts call */
    uint8_t *observed; /* [num_layers] scratch of the current on_counts call */
    uint64_t *sorted;  /* [num_experts] scratch: a layer's non-zero scores */
    int32_t *slot_key; /* [nslots] */
    uint8_t *resident; /* [nslots] */
    uint64_t *touched; /* [nslots] clock of the last access/insert */
    uint64_t clock;
    smoe_slotheap heap;  /* resident slots keyed by (utility of the key, touched) */
    int32_t *lhead;      /* [num_layers] resident slots whose key is in the layer */
    int32_t *lprev, *lnext; /* [nslots] links of those lists */
} spac_state;

static void spac_free(smoe_policy *p) {
    spac_state *st = p->state;
    if (!st) return;
    free(st->score);
    free(st->util);
    free(st->pending);
    free(st->observed);
    free(st->sorted);
    free(st->slot_key);
    free(st->resident);
    free(st->touched);
    smoe_slotheap_free(&st->heap);
    free(st->lhead);
    free(st->lprev);
    free(st->lnext);
    free(st);
    p->state = NULL;
}

static int spac_init(smoe_policy *p, const smoe_policy_params *params, smoe_err *err) {
    int32_t levels = params->levels ? params->levels : SPAC_DEFAULT_LEVELS;
    if (levels < 1 || levels > 255)
        return smoe_err_set(err, SMOE_EINVAL, "spac_ema: levels must be in 1..255 (0 = default %d), "
                            "got %d", SPAC_DEFAULT_LEVELS, (int)params->levels);
    const size_t nkeys = (size_t)params->num_layers * params->num_experts;
    spac_state *st = calloc(1, sizeof *st);
    p->state = st;
    if (st) {
        st->levels = (uint32_t)levels;
        st->score = calloc(nkeys, sizeof *st->score);
        st->util = calloc(nkeys, 1);
        st->pending = calloc(nkeys, sizeof *st->pending);
        st->observed = calloc(params->num_layers, 1);
        st->sorted = calloc(params->num_experts, sizeof *st->sorted);
        st->slot_key = calloc(params->nslots, sizeof *st->slot_key);
        st->resident = calloc(params->nslots, 1);
        st->touched = calloc(params->nslots, sizeof *st->touched);
        st->lhead = malloc((params->num_layers ? params->num_layers : 1) * sizeof *st->lhead);
        st->lprev = malloc((params->nslots ? params->nslots : 1) * sizeof *st->lprev);
        st->lnext = malloc((params->nslots ? params->nslots : 1) * sizeof *st->lnext);
    }
    if (!st || !st->score || !st->util || !st->pending || !st->observed || !st->sorted ||
        !st->slot_key || !st->resident || !st->touched || !st->lhead || !st->lprev ||
        !st->lnext || smoe_slotheap_init(&st->heap, params->nslots) < 0) {
        spac_free(p);
        return smoe_err_set(err, SMOE_ENOMEM, "spac_ema: out of memory for %zu keys", nkeys);
    }
    for (uint32_t l = 0; l < params->num_layers; l++) st->lhead[l] = -1;
    return 0;
}

static int spac_key_ok(const smoe_policy *p, int32_t k) {
    return k >= 0 && (uint64_t)k < (uint64_t)p->num_layers * p->num_experts;
}

/* Utility of a slot's key (0 for a key out of range, as victim() has always counted it). */
static uint32_t spac_slot_util(const smoe_policy *p, const spac_state *st, uint32_t s) {
    return spac_key_ok(p, st->slot_key[s]) ? st->util[st->slot_key[s]] : 0;
}

static void spac_rekey(smoe_policy *p, spac_state *st, uint32_t s) {
    smoe_slotheap_set(&st->heap, s, spac_slot_util(p, st, s), st->touched[s]);
}

/* A resident slot joins / leaves the list of its key's layer (keys out of range: none). */
static void spac_layer_link(smoe_policy *p, spac_state *st, uint32_t s) {
    if (!spac_key_ok(p, st->slot_key[s])) return;
    uint32_t l = (uint32_t)st->slot_key[s] / p->num_experts;
    st->lprev[s] = -1;
    st->lnext[s] = st->lhead[l];
    if (st->lhead[l] >= 0) st->lprev[st->lhead[l]] = (int32_t)s;
    st->lhead[l] = (int32_t)s;
}

static void spac_layer_unlink(smoe_policy *p, spac_state *st, uint32_t s) {
    if (!spac_key_ok(p, st->slot_key[s])) return;
    uint32_t l = (uint32_t)st->slot_key[s] / p->num_experts;
    if (st->lprev[s] >= 0) st->lnext[st->lprev[s]] = st->lnext[s]; else st->lhead[l] = st->lnext[s];
    if (st->lnext[s] >= 0) st->lprev[st->lnext[s]] = st->lprev[s];
}

static void spac_insert(smoe_policy *p, uint32_t slot, int32_t key, int prefetch) {
    spac_state *st = p->state;
    (void)prefetch;
    if (slot >= p->nslots) return;
    if (st->resident[slot]) spac_layer_unlink(p, st, slot);
    st->slot_key[slot] = key;
    st->resident[slot] = 1;
    st->touched[slot] = ++st->clock;
    spac_layer_link(p, st, slot);
    spac_rekey(p, st, slot);
}

static void spac_access(smoe_policy *p, uint32_t slot, int32_t key) {
    spac_state *st = p->state;
    (void)key;
    if (slot >= p->nslots) return;
    st->touched[slot] = ++st->clock;
    if (st->resident[slot]) spac_rekey(p, st, slot);
}

static void spac_evict(smoe_policy *p, uint32_t slot, int32_t key) {
    spac_state *st = p->state;
    (void)key;
    if (slot >= p->nslots || !st->resident[slot]) return;
    spac_layer_unlink(p, st, slot);
    smoe_slotheap_remove(&st->heap, slot);
    st->resident[slot] = 0;
}

static int cmp_u64(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

/* Update layer l's scores from st->pending (then cleared) and re-derive its utilities. */
static void spac_layer(smoe_policy *p, spac_state *st, uint32_t l) {
    const uint32_t E = p->num_experts, K = st->levels;
    uint64_t *sc = st->score + (size_t)l * E;
    uint32_t *pend = st->pending + (size_t)l * E;
    uint8_t *ut = st->util + (size_t)l * E;
    uint32_t n = 0;
    for (uint32_t e = 0; e < E; e++) {
        sc[e] = (9 * sc[e] + (uint64_t)SPAC_ONE * pend[e]) / 10;
        pend[e] = 0;
        if (sc[e]) st->sorted[n++] = sc[e];
    }
    qsort(st->sorted, n, sizeof *st->sorted, cmp_u64);
    for (uint32_t e = 0; e < E; e++) {
        uint32_t u = 0;
        if (sc[e])
            for (uint32_t j = 1; j <= K; j++)
                if (sc[e] >= st->sorted[((uint64_t)(j - 1) * n) / K]) u++;
        ut[e] = (uint8_t)u;
    }
}

static void spac_counts(smoe_policy *p, const int32_t *keys, const uint32_t *counts,
                        uint32_t n) {
    spac_state *st = p->state;
    const uint64_t nkeys = (uint64_t)p->num_layers * p->num_experts;
    for (uint32_t i = 0; i < n; i++) {
        if (keys[i] < 0 || (uint64_t)keys[i] >= nkeys) continue;
        st->pending[keys[i]] = counts[i] < st->levels ? counts[i] : st->levels;
        st->observed[(uint32_t)keys[i] / p->num_experts] = 1;
    }
    for (uint32_t l = 0; l < p->num_layers; l++)
        if (st->observed[l]) {
            spac_layer(p, st, l);
            st->observed[l] = 0;
            for (int32_t s = st->lhead[l]; s >= 0; s = st->lnext[s])
                spac_rekey(p, st, (uint32_t)s);
        }
}

static int32_t spac_utility(const smoe_policy *p, int32_t key) {
    const spac_state *st = p->state;
    if (key < 0 || (uint64_t)key >= (uint64_t)p->num_layers * p->num_experts) return -1;
    return st->util[key];
}

static int32_t spac_victim(smoe_policy *p, smoe_evictable_fn ok, void *ctx) {
    spac_state *st = p->state;
    return smoe_slotheap_find(&st->heap, ok, ctx);
}

const smoe_policy_ops smoe_policy_spac_ema = {
    .name = "spac_ema",
    .init = spac_init,
    .free = spac_free,
    .on_insert = spac_insert,
    .on_access = spac_access,
    .on_evict = spac_evict,
    .on_pass = NULL,
    .victim = spac_victim,
    .on_counts = spac_counts,
    .utility = spac_utility,
};

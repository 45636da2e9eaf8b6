/* Score-based eviction (SpecMD's baseline "SB", Appendix B, after Zhu et al. 2025): "evicts
 * experts with the lowest historical gate scores ... maintains a running history of gate scores
 * for each expert"; SpecMD §2: "removing experts with the lowest accumulated activation scores".
 *
 *   - per expert key an accumulated score over the whole run (it survives eviction), fed by
 *     on_counts: each call adds, for every listed key, its count (a key listed twice: the last
 *     count wins, policy.h).  The live loop and the simulator feed the activation counts of
 *     each pass (how many of the pass's tokens route to the expert), so a token adds 1 where
 *     the paper adds its gate weight: the real traces record expert ids only (no router
 *     weights) and the policy interface carries integer counts.  With one token per pass the
 *     score is the number of tokens that activated the expert so far;
 *   - victim: the resident evictable slot whose key has the lowest score; ties: least recently
 *     touched (a logical clock advanced by every on_insert and on_access).  Before any counts
 *     it is LRU.
 *
 * Structure: per key the score and its resident slot; an indexed heap of the resident slots
 * keyed (score, last touch) (slotheap.h).  on_counts re-keys the resident slots of the listed
 * keys: O(n log nslots); other events O(log nslots); victim O(1 + refused).  Sized at init. */
#include <stdlib.h>

#include "policy.h"
#include "slotheap.h"

typedef struct score_state {
    uint64_t *score;    /* [nkeys] accumulated activation counts */
    uint32_t *pending;  /* [nkeys] count of the current on_counts call */
    uint8_t *listed;    /* [nkeys] key listed in the current on_counts call */
    int32_t *key_slot;  /* [nkeys] resident slot, -1 when none */
    int32_t *slot_key;  /* [nslots] */
    uint8_t *resident;  /* [nslots] */
    uint64_t *touched;  /* [nslots] clock of the last touch */
    uint64_t clock;
    smoe_slotheap heap; /* resident slots keyed (score, last touch) */
} score_state;

static void score_free(smoe_policy *p) {
    score_state *st = p->state;
    if (!st) return;
    free(st->score);
    free(st->pending);
    free(st->listed);
    free(st->key_slot);
    free(st->slot_key);
    free(st->resident);
    free(st->touched);
    smoe_slotheap_free(&st->heap);
    free(st);
    p->state = NULL;
}

static int score_init(smoe_policy *p, const smoe_policy_params *params, smoe_err *err) {
    const size_t nkeys = (size_t)params->num_layers * params->num_experts;
    score_state *st = calloc(1, sizeof *st);
    p->state = st;
    if (st) {
        st->score = calloc(nkeys, sizeof *st->score);
        st->pending = calloc(nkeys, sizeof *st->pending);
        st->listed = calloc(nkeys, 1);
        st->key_slot = malloc(nkeys * sizeof *st->key_slot);
        st->slot_key = calloc(params->nslots, sizeof *st->slot_key);
        st->resident = calloc(params->nslots, 1);
        st->touched = calloc(params->nslots, sizeof *st->touched);
    }
    if (!st || !st->score || !st->pending || !st->listed || !st->key_slot || !st->slot_key ||
        !st->resident || !st->touched || smoe_slotheap_init(&st->heap, params->nslots) < 0) {
        score_free(p);
        return smoe_err_set(err, SMOE_ENOMEM, "score: out of memory for %zu keys", nkeys);
    }
    for (size_t k = 0; k < nkeys; k++) st->key_slot[k] = -1;
    return 0;
}

static int score_key_ok(const smoe_policy *p, int32_t k) {
    return k >= 0 && (uint64_t)k < (uint64_t)p->num_layers * p->num_experts;
}

static void score_rekey(smoe_policy *p, score_state *st, uint32_t s) {
    const int32_t k = st->slot_key[s];
    smoe_slotheap_set(&st->heap, s, score_key_ok(p, k) ? st->score[k] : 0, st->touched[s]);
}

static void score_drop(smoe_policy *p, score_state *st, uint32_t s) {
    const int32_t k = st->slot_key[s];
    if (score_key_ok(p, k) && st->key_slot[k] == (int32_t)s) st->key_slot[k] = -1;
    smoe_slotheap_remove(&st->heap, s);
    st->resident[s] = 0;
}

static void score_insert(smoe_policy *p, uint32_t slot, int32_t key, int prefetch) {
    score_state *st = p->state;
    (void)prefetch;
    if (slot >= p->nslots) return;
    if (st->resident[slot]) score_drop(p, st, slot);
    st->slot_key[slot] = key;
    st->resident[slot] = 1;
    if (score_key_ok(p, key)) st->key_slot[key] = (int32_t)slot;
    st->touched[slot] = ++st->clock;
    score_rekey(p, st, slot);
}

static void score_access(smoe_policy *p, uint32_t slot, int32_t key) {
    score_state *st = p->state;
    (void)key;
    if (slot >= p->nslots || !st->resident[slot]) return;
    st->touched[slot] = ++st->clock;
    score_rekey(p, st, slot);
}

static void score_evict(smoe_policy *p, uint32_t slot, int32_t key) {
    score_state *st = p->state;
    (void)key;
    if (slot >= p->nslots || !st->resident[slot]) return;
    score_drop(p, st, slot);
}

static void score_counts(smoe_policy *p, const int32_t *keys, const uint32_t *counts,
                         uint32_t n) {
    score_state *st = p->state;
    for (uint32_t i = 0; i < n; i++)
        if (score_key_ok(p, keys[i])) {
            st->pending[keys[i]] = counts[i];
            st->listed[keys[i]] = 1;
        }
    for (uint32_t i = 0; i < n; i++) {
        const int32_t k = keys[i];
        if (!score_key_ok(p, k) || !st->listed[k]) continue; /* the first listing adds */
        st->listed[k] = 0;
        st->score[k] += st->pending[k];
        st->pending[k] = 0;
        if (st->key_slot[k] >= 0) score_rekey(p, st, (uint32_t)st->key_slot[k]);
    }
}

static int32_t score_victim(smoe_policy *p, smoe_evictable_fn ok, void *ctx) {
    score_state *st = p->state;
    return smoe_slotheap_find(&st->heap, ok, ctx);
}

const smoe_policy_ops smoe_policy_score = {
    .name = "score",
    .init = score_init,
    .free = score_free,
    .on_insert = score_insert,
    .on_access = score_access,
    .on_evict = score_evict,
    .on_pass = NULL,
    .victim = score_victim,
    .on_counts = score_counts,
};

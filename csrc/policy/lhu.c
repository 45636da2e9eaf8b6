/* LHU, Least High-precision Used (SpecMD's baseline, Appendix B, after HOBBIT, Tang et al. 2024):
 * "tracks high-precision expert usage frequency, prioritizing retention of frequently-accessed
 * high-precision experts"; SpecMD §2 calls it "a variant of LFU", and its LFU (Appendix B) counts
 * "over the entire inference history".  So:
 *
 *   - per expert key a count of its high-precision uses over the whole run: every demand access
 *     and every demand insert (an insert by demand is an access, policy.h) adds 1; a prefetch
 *     insert adds nothing (nobody used the expert yet); the count survives eviction (unlike
 *     policy/lfu.c, whose counts are forgotten on eviction);
 *   - victim: the resident evictable slot whose key has the fewest uses; ties: least recently
 *     touched (a logical clock advanced by every on_insert and on_access, so no ties remain).
 *
 * What "high precision" means here: specmoe's cache holds one precision per run (the expert
 * store's dtype), so every use of a cached expert is a use at the cache's (high) precision and
 * the count is the plain use count.  A low-precision fallback (SpecMD §3.1.2 fetch cascade,
 * HOBBIT's int4/int2 replacements) does not pass through the cache or this interface; when it
 * does, those uses must not be counted (the point of LHU), and a resident low-precision copy
 * should go before any high-precision one.
 *
 * Structure: an indexed heap of the resident slots keyed (uses of the key, last touch)
 * (slotheap.h); per key the use count.  Every event O(log nslots); victim O(1 + refused).
 * Everything is sized at init. */
#include <stdlib.h>

#include "policy.h"
#include "slotheap.h"

typedef struct lhu_state {
    uint64_t *uses;    /* [nkeys] high-precision uses over the whole run */
    int32_t *slot_key; /* [nslots] */
    uint8_t *resident; /* [nslots] */
    uint64_t clock;
    smoe_slotheap heap; /* resident slots keyed (uses, last touch) */
} lhu_state;

static void lhu_free(smoe_policy *p) {
    lhu_state *st = p->state;
    if (!st) return;
    free(st->uses);
    free(st->slot_key);
    free(st->resident);
    smoe_slotheap_free(&st->heap);
    free(st);
    p->state = NULL;
}

static int lhu_init(smoe_policy *p, const smoe_policy_params *params, smoe_err *err) {
    const size_t nkeys = (size_t)params->num_layers * params->num_experts;
    lhu_state *st = calloc(1, sizeof *st);
    p->state = st;
    if (st) {
        st->uses = calloc(nkeys, sizeof *st->uses);
        st->slot_key = calloc(params->nslots, sizeof *st->slot_key);
        st->resident = calloc(params->nslots, 1);
    }
    if (!st || !st->uses || !st->slot_key || !st->resident ||
        smoe_slotheap_init(&st->heap, params->nslots) < 0) {
        lhu_free(p);
        return smoe_err_set(err, SMOE_ENOMEM, "lhu: out of memory for %zu keys", nkeys);
    }
    return 0;
}

static uint64_t lhu_uses(const smoe_policy *p, const lhu_state *st, int32_t key) {
    return key >= 0 && (uint64_t)key < (uint64_t)p->num_layers * p->num_experts ? st->uses[key]
                                                                                 : 0;
}

/* A touch of slot s: count a use of its key when `use`, then re-key it. */
static void lhu_touch(smoe_policy *p, lhu_state *st, uint32_t s, int use) {
    const int32_t k = st->slot_key[s];
    if (use && k >= 0 && (uint64_t)k < (uint64_t)p->num_layers * p->num_experts) st->uses[k]++;
    smoe_slotheap_set(&st->heap, s, lhu_uses(p, st, k), ++st->clock);
}

static void lhu_insert(smoe_policy *p, uint32_t slot, int32_t key, int prefetch) {
    lhu_state *st = p->state;
    if (slot >= p->nslots) return;
    st->slot_key[slot] = key;
    st->resident[slot] = 1;
    lhu_touch(p, st, slot, !prefetch);
}

static void lhu_access(smoe_policy *p, uint32_t slot, int32_t key) {
    lhu_state *st = p->state;
    (void)key;
    if (slot >= p->nslots || !st->resident[slot]) return;
    lhu_touch(p, st, slot, 1);
}

static void lhu_evict(smoe_policy *p, uint32_t slot, int32_t key) {
    lhu_state *st = p->state;
    (void)key;
    if (slot >= p->nslots || !st->resident[slot]) return;
    smoe_slotheap_remove(&st->heap, slot);
    st->resident[slot] = 0;
}

static int32_t lhu_victim(smoe_policy *p, smoe_evictable_fn ok, void *ctx) {
    lhu_state *st = p->state;
    return smoe_slotheap_find(&st->heap, ok, ctx);
}

const smoe_policy_ops smoe_policy_lhu = {
    .name = "lhu",
    .init = lhu_init,
    .free = lhu_free,
    .on_insert = lhu_insert,
    .on_access = lhu_access,
    .on_evict = lhu_evict,
    .on_pass = NULL,
    .victim = lhu_victim,
};

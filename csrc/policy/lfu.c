/* LFU: evict the resident slot with the fewest accesses since it was inserted; ties go to the
 * least recently touched slot.
 *
 * Counts are in-cache: they start when a key is inserted and are forgotten when it is evicted
 * (no history across evictions).  A demand insert counts 1 (it is an access, policy.h); a
 * prefetch insert counts 0, so a prefetched expert nobody used is the first to go.  Each access
 * adds 1.  Recency for the tie-break: the logical time of the last access or insert of either
 * kind (a counter advanced by every on_insert and on_access), so ties are never left.
 *
 * victim() scans the slots, O(nslots): fine for expert caches (hundreds of slots), and it
 * skips slots the caller cannot evict without any bookkeeping. */
#include <stdlib.h>

#include "policy.h"

typedef struct lfu_state {
    uint64_t *count;   /* accesses since insert, per slot */
    uint64_t *touched; /* logical time of last access/insert, per slot */
    uint8_t *resident;
    uint64_t clock;
} lfu_state;

static void lfu_free(smoe_policy *p) {
    lfu_state *st = p->state;
    if (!st) return;
    free(st->count);
    free(st->touched);
    free(st->resident);
    free(st);
}

static int lfu_init(smoe_policy *p, const smoe_policy_params *params, smoe_err *err) {
    lfu_state *st = calloc(1, sizeof *st);
    p->state = st;
    if (st) {
        st->count = calloc(params->nslots, sizeof *st->count);
        st->touched = calloc(params->nslots, sizeof *st->touched);
        st->resident = calloc(params->nslots, 1);
    }
    if (!st || !st->count || !st->touched || !st->resident) {
        lfu_free(p);
        p->state = NULL;
        return smoe_err_set(err, SMOE_ENOMEM, "lfu: out of memory");
    }
    return 0;
}

static void lfu_insert(smoe_policy *p, uint32_t slot, int32_t key, int prefetch) {
    lfu_state *st = p->state;
    (void)key;
    if (slot >= p->nslots) return;
    st->count[slot] = prefetch ? 0 : 1;
    st->touched[slot] = ++st->clock;
    st->resident[slot] = 1;
}

static void lfu_access(smoe_policy *p, uint32_t slot, int32_t key) {
    lfu_state *st = p->state;
    (void)key;
    if (slot >= p->nslots) return;
    st->count[slot]++;
    st->touched[slot] = ++st->clock;
}

static void lfu_evict(smoe_policy *p, uint32_t slot, int32_t key) {
    lfu_state *st = p->state;
    (void)key;
    if (slot >= p->nslots) return;
    st->resident[slot] = 0;
    st->count[slot] = 0;
}

static int32_t lfu_victim(smoe_policy *p, smoe_evictable_fn ok, void *ctx) {
    lfu_state *st = p->state;
    int32_t best = -1;
    for (uint32_t s = 0; s < p->nslots; s++) {
        if (!st->resident[s] || (ok && !ok(ctx, s))) continue;
        if (best < 0 || st->count[s] < st->count[best] ||
            (st->count[s] == st->count[best] && st->touched[s] < st->touched[best]))
            best = (int32_t)s;
    }
    return best;
}

const smoe_policy_ops smoe_policy_lfu = {
    .name = "lfu",
    .init = lfu_init,
    .free = lfu_free,
    .on_insert = lfu_insert,
    .on_access = lfu_access,
    .on_evict = lfu_evict,
    .on_pass = NULL,
    .victim = lfu_victim,
};

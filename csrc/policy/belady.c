/* Belady / OPT: evict the resident slot whose key is next used furthest in the future; a key
 * never used again counts as infinitely far.  Ties (several keys never used again): the lowest
 * slot index.  Offline: it needs the future demand access sequence (params->future, copied).
 *
 * Bookkeeping, O(1) amortised per event:
 *   next_occ[i]  position of the next occurrence of future[i] after i (len = never);
 *   upcoming[k]  a position of key k's next occurrence, possibly stale (behind the cursor) and
 *                then advanced lazily along next_occ when read;
 *   cursor       demand accesses consumed so far.
 * A demand access (on_access, or on_insert with prefetch = 0) of key k consumes k's next
 * occurrence p at or after the cursor: cursor = p + 1.  When the live sequence follows the
 * future exactly p == cursor always; if it deviates (skipped accesses), the cursor jumps to
 * k's next occurrence, and a key absent from the rest of the future moves nothing.
 * A prefetch insert consumes nothing: its next use is simply its next occurrence at or after
 * the cursor.  victim() scans the slots, O(nslots). */
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

#include "policy.h"

typedef struct belady_state {
    uint64_t len;       /* future length; also "never" */
    uint64_t *next_occ; /* [len] */
    uint64_t *upcoming; /* [num_layers*num_experts] */
    int32_t *key_of;    /* [nslots], -1 when not resident */
    uint64_t cursor;
    uint64_t nkeys;
} belady_state;

static void belady_free(smoe_policy *p) {
    belady_state *st = p->state;
    if (!st) return;
    free(st->next_occ);
    free(st->upcoming);
    free(st->key_of);
    free(st);
}

static int belady_init(smoe_policy *p, const smoe_policy_params *params, smoe_err *err) {
    if (!params->future || params->future_len == 0)
        return smoe_err_set(err, SMOE_EINVAL, "belady: needs the future demand access sequence "
                            "(future=, a non-empty key array)");
    const uint64_t nkeys = (uint64_t)params->num_layers * params->num_experts;
    const uint64_t n = params->future_len;
    for (uint64_t i = 0; i < n; i++)
        if (params->future[i] < 0 || (uint64_t)params->future[i] >= nkeys)
            return smoe_err_set(err, SMOE_EINVAL, "belady: future key %" PRId32 " at position %"
                                PRIu64 " is outside 0..%" PRIu64 " (num_layers*num_experts-1)",
                                params->future[i], i, nkeys - 1);
    belady_state *st = calloc(1, sizeof *st);
    p->state = st;
    if (st) {
        st->next_occ = malloc(n * sizeof *st->next_occ);
        st->upcoming = malloc(nkeys * sizeof *st->upcoming);
        st->key_of = malloc(params->nslots * sizeof *st->key_of);
    }
    if (!st || !st->next_occ || !st->upcoming || !st->key_of) {
        belady_free(p);
        p->state = NULL;
        return smoe_err_set(err, SMOE_ENOMEM, "belady: out of memory for a future of %" PRIu64
                            " accesses", n);
    }
    st->len = n;
    st->nkeys = nkeys;
    for (uint64_t k = 0; k < nkeys; k++) st->upcoming[k] = n;
    for (uint64_t i = n; i-- > 0;) {
        const int32_t k = params->future[i];
        st->next_occ[i] = st->upcoming[k];
        st->upcoming[k] = i;
    }
    for (uint32_t s = 0; s < params->nslots; s++) st->key_of[s] = -1;
    return 0;
}

/* Next occurrence of key at or after the cursor (len when none). */
static uint64_t belady_next(belady_state *st, int32_t key) {
    if (key < 0 || (uint64_t)key >= st->nkeys) return st->len;
    uint64_t q = st->upcoming[key];
    while (q < st->cursor) q = st->next_occ[q];
    st->upcoming[key] = q;
    return q;
}

static void belady_demand(belady_state *st, int32_t key) {
    uint64_t q = belady_next(st, key);
    if (q < st->len) {
        st->cursor = q + 1;
        st->upcoming[key] = st->next_occ[q];
    }
}

static void belady_insert(smoe_policy *p, uint32_t slot, int32_t key, int prefetch) {
    belady_state *st = p->state;
    if (slot >= p->nslots) return;
    st->key_of[slot] = key;
    if (!prefetch) belady_demand(st, key);
}

static void belady_access(smoe_policy *p, uint32_t slot, int32_t key) {
    (void)slot;
    belady_demand(p->state, key);
}

static void belady_evict(smoe_policy *p, uint32_t slot, int32_t key) {
    belady_state *st = p->state;
    (void)key;
    if (slot < p->nslots) st->key_of[slot] = -1;
}

static int32_t belady_victim(smoe_policy *p, smoe_evictable_fn ok, void *ctx) {
    belady_state *st = p->state;
    int32_t best = -1;
    uint64_t best_next = 0;
    for (uint32_t s = 0; s < p->nslots; s++) {
        if (st->key_of[s] < 0 || (ok && !ok(ctx, s))) continue;
        uint64_t q = belady_next(st, st->key_of[s]);
        if (best < 0 || q > best_next) {
            best = (int32_t)s;
            best_next = q;
            if (q == st->len) break; /* never used again, and lowest index among those */
        }
    }
    return best;
}

/* The admission rule's regret of evicting resident `key` (policy.h): 0 when no resident key is
 * used later than it (demand-only Belady would evict it, or one used no sooner, at its next
 * miss anyway), else 1 (its eviction brings its next use's miss forward of a key that would
 * have gone instead).  O(nslots). */
static double belady_regret(const smoe_policy *cp, int32_t key) {
    belady_state *st = cp->state;
    const uint64_t mine = belady_next(st, key);
    for (uint32_t s = 0; s < cp->nslots; s++)
        if (st->key_of[s] >= 0 && belady_next(st, st->key_of[s]) > mine) return 1.0;
    return 0.0;
}

const smoe_policy_ops smoe_policy_belady = {
    .name = "belady",
    .init = belady_init,
    .free = belady_free,
    .on_insert = belady_insert,
    .on_access = belady_access,
    .on_evict = belady_evict,
    .on_pass = NULL,
    .victim = belady_victim,
    .regret = belady_regret,
};

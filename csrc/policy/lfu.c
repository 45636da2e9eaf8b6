/* LFU: evict the resident slot with the fewest accesses since it was inserted; ties go to the
 * least recently touched slot.
 *
 * Counts are in-cache: they start when a key is inserted and are forgotten when it is evicted
 * (no history across evictions).  A demand insert counts 1 (it is an access, policy.h); a
 * prefetch insert counts 0, so a prefetched expert nobody used is the first to go.  Each access
 * adds 1.  Recency for the tie-break: the logical time of the last access or insert of either
 * kind (a counter advanced by every on_insert and on_access), so ties are never left.
 *
 * Structure (the classic O(1) LFU): a list of count buckets in increasing count, each a list of
 * its slots in increasing recency.  A touch always makes a slot the most recent one, so it is
 * appended at the tail of its (new) bucket and every bucket stays sorted by recency without
 * comparisons.  Every event is O(1); victim() walks buckets and slots in eviction order and
 * stops at the first slot evictable() accepts: O(1 + refused slots).  Bucket nodes come from a
 * pool of nslots + 1 sized at init (at most nslots buckets are non-empty). */
#include <stdlib.h>

#include "policy.h"

typedef struct lfu_bucket {
    uint64_t count;     /* accesses since insert of every slot in this bucket */
    int32_t head, tail; /* slots, least recently touched at head */
    int32_t prev, next; /* buckets in increasing count; next also links the free pool */
} lfu_bucket;

typedef struct lfu_state {
    int32_t *prev, *next; /* [nslots] slot links inside its bucket */
    int32_t *bucket;      /* [nslots] bucket of a resident slot, -1 when not resident */
    lfu_bucket *b;        /* [nslots + 1] bucket pool */
    int32_t first;        /* bucket of the smallest count, -1 when empty */
    int32_t pool;         /* free bucket nodes */
} lfu_state;

static void lfu_free(smoe_policy *p) {
    lfu_state *st = p->state;
    if (!st) return;
    free(st->prev);
    free(st->next);
    free(st->bucket);
    free(st->b);
    free(st);
    p->state = NULL;
}

static int lfu_init(smoe_policy *p, const smoe_policy_params *params, smoe_err *err) {
    const size_t n = params->nslots;
    lfu_state *st = calloc(1, sizeof *st);
    p->state = st;
    if (st) {
        st->prev = malloc((n ? n : 1) * sizeof *st->prev);
        st->next = malloc((n ? n : 1) * sizeof *st->next);
        st->bucket = malloc((n ? n : 1) * sizeof *st->bucket);
        st->b = malloc((n + 1) * sizeof *st->b);
    }
    if (!st || !st->prev || !st->next || !st->bucket || !st->b) {
        lfu_free(p);
        return smoe_err_set(err, SMOE_ENOMEM, "lfu: out of memory for %zu slots", n);
    }
    for (size_t s = 0; s < n; s++) st->bucket[s] = -1;
    for (size_t i = 0; i <= n; i++) st->b[i].next = i < n ? (int32_t)(i + 1) : -1;
    st->pool = 0;
    st->first = -1;
    return 0;
}

/* A new empty bucket of `count` linked right after bucket `after` (-1: at the front). */
static int32_t lfu_bucket_new(lfu_state *st, uint64_t count, int32_t after) {
    int32_t i = st->pool;
    lfu_bucket *b = &st->b[i];
    st->pool = b->next;
    b->count = count;
    b->head = b->tail = -1;
    b->prev = after;
    b->next = after >= 0 ? st->b[after].next : st->first;
    if (b->next >= 0) st->b[b->next].prev = i;
    if (after >= 0) st->b[after].next = i; else st->first = i;
    return i;
}

/* Take a resident slot out of its bucket; an emptied bucket goes back to the pool. */
static void lfu_unlink(lfu_state *st, uint32_t s) {
    int32_t bi = st->bucket[s];
    lfu_bucket *b = &st->b[bi];
    int32_t pv = st->prev[s], nx = st->next[s];
    if (pv >= 0) st->next[pv] = nx; else b->head = nx;
    if (nx >= 0) st->prev[nx] = pv; else b->tail = pv;
    st->bucket[s] = -1;
    if (b->head < 0) {
        if (b->prev >= 0) st->b[b->prev].next = b->next; else st->first = b->next;
        if (b->next >= 0) st->b[b->next].prev = b->prev;
        b->next = st->pool;
        st->pool = bi;
    }
}

/* Make s the most recently touched slot of bucket bi. */
static void lfu_append(lfu_state *st, uint32_t s, int32_t bi) {
    lfu_bucket *b = &st->b[bi];
    st->prev[s] = b->tail;
    st->next[s] = -1;
    if (b->tail >= 0) st->next[b->tail] = (int32_t)s; else b->head = (int32_t)s;
    b->tail = (int32_t)s;
    st->bucket[s] = bi;
}

static void lfu_insert(smoe_policy *p, uint32_t slot, int32_t key, int prefetch) {
    lfu_state *st = p->state;
    (void)key;
    if (slot >= p->nslots) return;
    if (st->bucket[slot] >= 0) lfu_unlink(st, slot); /* re-insert: counts start over */
    const uint64_t c = prefetch ? 0 : 1;
    int32_t after = -1, b = st->first;
    while (b >= 0 && st->b[b].count < c) {
        after = b;
        b = st->b[b].next;
    }
    if (b < 0 || st->b[b].count != c) b = lfu_bucket_new(st, c, after);
    lfu_append(st, slot, b);
}

static void lfu_access(smoe_policy *p, uint32_t slot, int32_t key) {
    lfu_state *st = p->state;
    (void)key;
    if (slot >= p->nslots || st->bucket[slot] < 0) return;
    const int32_t b = st->bucket[slot];
    const uint64_t c = st->b[b].count + 1;
    int32_t nb = st->b[b].next;
    if (nb < 0 || st->b[nb].count != c) {
        if (st->b[b].head == st->b[b].tail) { /* alone in its bucket: the bucket moves up */
            st->b[b].count = c;
            return;
        }
        nb = lfu_bucket_new(st, c, b);
    }
    lfu_unlink(st, slot);
    lfu_append(st, slot, nb);
}

static void lfu_evict(smoe_policy *p, uint32_t slot, int32_t key) {
    lfu_state *st = p->state;
    (void)key;
    if (slot < p->nslots && st->bucket[slot] >= 0) lfu_unlink(st, slot);
}

static int32_t lfu_victim(smoe_policy *p, smoe_evictable_fn ok, void *ctx) {
    lfu_state *st = p->state;
    for (int32_t b = st->first; b >= 0; b = st->b[b].next)
        for (int32_t s = st->b[b].head; s >= 0; s = st->next[s])
            if (!ok || ok(ctx, (uint32_t)s)) return s;
    return -1;
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

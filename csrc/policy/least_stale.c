/* Least-Stale (after SpecMD): experts not touched in the current forward pass are stale and
 * are evicted first; an expert touched in the current pass goes only when no stale slot is
 * evictable.  A touch is an access or an insert (demand or prefetch: a prefetched expert was
 * fetched for this pass).  The current pass starts at each on_pass; before the first on_pass
 * everything touched so far belongs to pass 0, the current one.
 *
 * Order inside each of the two queues (params->order):
 *   SMOE_LS_ORDER_LAYER  furthest next use by layer position first.  With L layers, cur the
 *                        layer of the most recent demand access (0 before any) and j the layer
 *                        of a slot's key, the distance to j's next use in a layer-by-layer
 *                        pass is d(j) = j - cur if j > cur, else j - cur + L (so cur's own
 *                        experts are the furthest, L); evict max d, ties: oldest touch.
 *                        Except in the stale group, where cur's own experts come last
 *                        (d = 0): the current layer is still being executed and a stale expert
 *                        of it (used by an earlier pass, not yet by this one) is what the
 *                        layer's remaining accesses are most likely to ask for next (SpecMD
 *                        §4.2: only experts *left* of the execution point are done for the
 *                        pass; a not-yet-accessed expert of the current layer is not left).
 *                        Evicting them first was a defect: on the real traces at 10 % it made
 *                        97.5 % of Least-Stale's collision misses (110,873 of 113,685, each
 *                        re-missed within 5 accesses of its eviction); see docs/simulator.md.
 *   SMOE_LS_ORDER_LRU    oldest touch first.
 *   SMOE_LS_ORDER_FIFO   oldest insert first.
 * "Oldest" compares a logical clock advanced by every on_insert and on_access, so no ties
 * remain.
 *
 * Measured by demand-only replay (one pass per token) of all 200 DeepSeek-V2-Lite puffin
 * traces (3.1M accesses over 26 layers x 64 experts = 1664 keys; benchmarks/policy_hit_rates.py),
 * hit rate at a cache of 5% / 10% / 25% of the experts:
 *   LAYER  0.133 / 0.263 / 0.458   (0.121 / 0.234 / 0.440 before the stale-current-layer fix)
 *   LRU    0.000 / 0.262 / 0.439   (the same as plain LRU: with one pass per token the stale
 *                                   slots are exactly the least recently used ones)
 *   FIFO   0.000 / 0.197 / 0.402
 * LAYER is best of the three at every size (at 5% everything else but MRU/Random hits never).
 * LAYER is the default (SMOE_LS_ORDER_LAYER = 0).
 *
 * Structure.  A slot is fresh when its last touch was in the current pass (slot pass == current
 * pass id), else stale.  Order LAYER keeps, per group (stale, fresh) and per layer, a list of
 * slots in increasing touch time; order LRU the same with one list per group.  A touch makes a
 * slot fresh and the most recent, so it is appended at the tail of its fresh list (O(1)).
 * victim() walks the stale lists, then the fresh ones, layers in decreasing distance
 * (cur, cur-1, .., 0, L-1, .., cur+1, found through a bitmap of non-empty lists; in the stale
 * group cur-1, .., 0, L-1, .., cur+1, cur), and returns
 * the first slot evictable() accepts: O(L/64 + refused slots).  At on_pass with a new pass id
 * (larger than any before: the normal case) every slot turns stale; each layer's fresh list
 * was touched after all of its stale list, so it is appended to it in O(1) per non-empty
 * layer (a merge by touch time when that does not hold).  Order FIFO keys slots by insert
 * time, which a touch does not change, so a touched slot is not the newest of the fresh group:
 * there one list holds every resident slot in insert order, and a second, the stale list, is
 * a copy of its links made at on_pass (every slot is stale then) from which a touch unlinks a
 * slot (O(1)).  victim() walks the stale list, then the insert-order list for fresh slots:
 * O(1 + refused slots) while a stale slot is evictable; O(nslots) when none is (every stale
 * slot refused).  on_pass costs one O(nslots) copy of two int32 arrays.  An on_pass back to an
 * id seen before (never in the cache or the simulator) rebuilds every group from the per-slot
 * pass ids: O(nslots + L).  Everything is sized at init. */
#include <stdlib.h>
#include <string.h>

#include "policy.h"

typedef struct ls_slot {
    int32_t key;
    uint8_t resident;
    uint32_t bucket;   /* layer of the key (LAYER order), else 0 */
    int32_t prev, next; /* links inside the slot's list (LAYER/LRU orders) */
    uint64_t pass;     /* pass of the last touch */
    uint64_t touched;  /* clock of the last touch */
    uint64_t inserted; /* clock of the insert */
} ls_slot;

typedef struct ls_list {
    int32_t head, tail; /* least recently touched at head */
} ls_list;

typedef struct ls_state {
    ls_slot *slot;
    uint64_t clock;
    uint64_t pass;     /* current pass id */
    uint64_t max_pass; /* largest pass id seen (0 before any on_pass) */
    uint32_t cur;      /* layer of the most recent demand access */
    int32_t order;
    uint32_t nbuckets; /* num_layers for LAYER, 1 for LRU */
    uint32_t nwords;   /* words of one bitmap */
    ls_list *list[2];  /* [group][bucket]: 0 stale, 1 fresh */
    uint64_t *busy[2]; /* [group] bitmap of non-empty lists */
    int32_t *scratch;  /* [nslots] one bucket's slots during a merge */
    /* FIFO order: every resident slot in insert order (ins*), and the stale ones (stale*). */
    int32_t *ins_prev, *ins_next, *stale_prev, *stale_next; /* [nslots] */
    int32_t ins_head, ins_tail, stale_head, stale_tail;
} ls_state;

static void ls_free(smoe_policy *p) {
    ls_state *st = p->state;
    if (!st) return;
    free(st->slot);
    for (int g = 0; g < 2; g++) {
        free(st->list[g]);
        free(st->busy[g]);
    }
    free(st->ins_prev);
    free(st->ins_next);
    free(st->stale_prev);
    free(st->stale_next);
    free(st->scratch);
    free(st);
    p->state = NULL;
}

static int ls_init(smoe_policy *p, const smoe_policy_params *params, smoe_err *err) {
    if (params->order != SMOE_LS_ORDER_LAYER && params->order != SMOE_LS_ORDER_LRU &&
        params->order != SMOE_LS_ORDER_FIFO)
        return smoe_err_set(err, SMOE_EINVAL, "least_stale: order %d is not one of 0 (layer), "
                            "1 (lru), 2 (fifo)", (int)params->order);
    const size_t n = params->nslots ? params->nslots : 1;
    ls_state *st = calloc(1, sizeof *st);
    p->state = st;
    if (!st) return smoe_err_set(err, SMOE_ENOMEM, "least_stale: out of memory");
    st->order = params->order;
    st->nbuckets = (params->order == SMOE_LS_ORDER_LAYER && params->num_layers > 0)
                       ? params->num_layers : 1;
    st->nwords = (st->nbuckets + 63) / 64;
    st->slot = calloc(n, sizeof *st->slot);
    st->scratch = malloc(n * sizeof *st->scratch);
    int bad = !st->slot || !st->scratch;
    for (int g = 0; g < 2; g++) {
        st->list[g] = malloc(st->nbuckets * sizeof *st->list[g]);
        st->busy[g] = calloc(st->nwords, sizeof *st->busy[g]);
        bad |= !st->list[g] || !st->busy[g];
    }
    if (params->order == SMOE_LS_ORDER_FIFO) {
        st->ins_prev = malloc(n * sizeof *st->ins_prev);
        st->ins_next = malloc(n * sizeof *st->ins_next);
        st->stale_prev = malloc(n * sizeof *st->stale_prev);
        st->stale_next = malloc(n * sizeof *st->stale_next);
        bad |= !st->ins_prev || !st->ins_next || !st->stale_prev || !st->stale_next;
    }
    st->ins_head = st->ins_tail = st->stale_head = st->stale_tail = -1;
    if (bad) {
        ls_free(p);
        return smoe_err_set(err, SMOE_ENOMEM, "least_stale: out of memory for %u slots",
                            (unsigned)params->nslots);
    }
    for (int g = 0; g < 2; g++)
        for (uint32_t b = 0; b < st->nbuckets; b++) st->list[g][b].head = st->list[g][b].tail = -1;
    return 0;
}

/* Layer of a key as the distance rule sees it (see ls_dist in the header's terms). */
static uint32_t ls_layer(const smoe_policy *p, int32_t key) {
    uint32_t j = key >= 0 ? (uint32_t)key / p->num_experts : 0;
    if (j >= p->num_layers) j = p->num_layers - 1;
    return j;
}

static int ls_fresh(const ls_state *st, uint32_t s) { return st->slot[s].pass == st->pass; }

static void ls_list_append(ls_state *st, int g, uint32_t s) {
    ls_slot *e = &st->slot[s];
    ls_list *l = &st->list[g][e->bucket];
    e->prev = l->tail;
    e->next = -1;
    if (l->tail >= 0) st->slot[l->tail].next = (int32_t)s;
    else {
        l->head = (int32_t)s;
        st->busy[g][e->bucket >> 6] |= (uint64_t)1 << (e->bucket & 63);
    }
    l->tail = (int32_t)s;
}

static void ls_list_remove(ls_state *st, int g, uint32_t s) {
    ls_slot *e = &st->slot[s];
    ls_list *l = &st->list[g][e->bucket];
    if (e->prev >= 0) st->slot[e->prev].next = e->next; else l->head = e->next;
    if (e->next >= 0) st->slot[e->next].prev = e->prev; else l->tail = e->prev;
    if (l->head < 0) st->busy[g][e->bucket >> 6] &= ~((uint64_t)1 << (e->bucket & 63));
}

static void ls_unlink(int32_t *prev, int32_t *next, int32_t *head, int32_t *tail, uint32_t s) {
    if (prev[s] >= 0) next[prev[s]] = next[s]; else *head = next[s];
    if (next[s] >= 0) prev[next[s]] = prev[s]; else *tail = prev[s];
}

static void ls_append(int32_t *prev, int32_t *next, int32_t *head, int32_t *tail, uint32_t s) {
    prev[s] = *tail;
    next[s] = -1;
    if (*tail >= 0) next[*tail] = (int32_t)s; else *head = (int32_t)s;
    *tail = (int32_t)s;
}

/* Take a resident slot out of the structures (before its pass changes). */
static void ls_detach(ls_state *st, uint32_t s) {
    const int g = ls_fresh(st, s);
    if (st->order != SMOE_LS_ORDER_FIFO) {
        ls_list_remove(st, g, s);
        return;
    }
    if (!g) ls_unlink(st->stale_prev, st->stale_next, &st->stale_head, &st->stale_tail, s);
    ls_unlink(st->ins_prev, st->ins_next, &st->ins_head, &st->ins_tail, s);
}

static void ls_demand(smoe_policy *p, ls_state *st, int32_t key) {
    if (key >= 0) {
        uint32_t layer = (uint32_t)key / p->num_experts;
        if (layer < p->num_layers) st->cur = layer;
    }
}

static void ls_insert(smoe_policy *p, uint32_t slot, int32_t key, int prefetch) {
    ls_state *st = p->state;
    if (slot >= p->nslots) return;
    ls_slot *e = &st->slot[slot];
    if (e->resident) ls_detach(st, slot);
    e->key = key;
    e->resident = 1;
    e->bucket = st->order == SMOE_LS_ORDER_LAYER ? ls_layer(p, key) : 0;
    e->pass = st->pass;
    e->touched = e->inserted = ++st->clock;
    if (st->order == SMOE_LS_ORDER_FIFO) /* the newest insert, and fresh: not in the stale list */
        ls_append(st->ins_prev, st->ins_next, &st->ins_head, &st->ins_tail, slot);
    else
        ls_list_append(st, 1, slot);
    if (!prefetch) ls_demand(p, st, key);
}

static void ls_access(smoe_policy *p, uint32_t slot, int32_t key) {
    ls_state *st = p->state;
    if (slot >= p->nslots) return;
    ls_slot *e = &st->slot[slot];
    if (e->resident && st->order != SMOE_LS_ORDER_FIFO) { /* the newest touch of its layer */
        ls_list_remove(st, ls_fresh(st, slot), slot);
        e->pass = st->pass;
        e->touched = ++st->clock;
        ls_list_append(st, 1, slot);
    } else { /* FIFO: a stale slot leaves the stale list; the insert order does not change */
        if (e->resident && !ls_fresh(st, slot))
            ls_unlink(st->stale_prev, st->stale_next, &st->stale_head, &st->stale_tail, slot);
        e->pass = st->pass;
        e->touched = ++st->clock;
    }
    ls_demand(p, st, key);
}

static void ls_evict(smoe_policy *p, uint32_t slot, int32_t key) {
    ls_state *st = p->state;
    (void)key;
    if (slot >= p->nslots || !st->slot[slot].resident) return;
    ls_detach(st, slot);
    st->slot[slot].resident = 0;
}

/* Re-sort bucket b of both groups after the current pass id changed: merge the two lists
 * (each in increasing touch time) and deal the slots out by the new group of each. */
static void ls_rebucket(ls_state *st, uint32_t b) {
    int32_t x = st->list[0][b].head, y = st->list[1][b].head;
    uint32_t n = 0;
    while (x >= 0 || y >= 0) {
        if (y < 0 || (x >= 0 && st->slot[x].touched < st->slot[y].touched)) {
            st->scratch[n++] = x;
            x = st->slot[x].next;
        } else {
            st->scratch[n++] = y;
            y = st->slot[y].next;
        }
    }
    for (int g = 0; g < 2; g++) {
        st->list[g][b].head = st->list[g][b].tail = -1;
        st->busy[g][b >> 6] &= ~((uint64_t)1 << (b & 63));
    }
    for (uint32_t i = 0; i < n; i++) ls_list_append(st, ls_fresh(st, (uint32_t)st->scratch[i]),
                                                    (uint32_t)st->scratch[i]);
}

static void ls_pass(smoe_policy *p, uint64_t pass_id) {
    ls_state *st = p->state;
    if (pass_id == st->pass) return;
    const int all_stale = pass_id > st->max_pass; /* no slot was touched in pass pass_id */
    st->pass = pass_id;
    if (pass_id > st->max_pass) st->max_pass = pass_id;
    if (st->order == SMOE_LS_ORDER_FIFO) {
        if (all_stale) { /* the stale list is the insert-order list (links of non-residents
                            are never followed) */
            memcpy(st->stale_prev, st->ins_prev, p->nslots * sizeof *st->stale_prev);
            memcpy(st->stale_next, st->ins_next, p->nslots * sizeof *st->stale_next);
            st->stale_head = st->ins_head;
            st->stale_tail = st->ins_tail;
        } else {
            st->stale_head = st->stale_tail = -1;
            for (int32_t s = st->ins_head; s >= 0; s = st->ins_next[s])
                if (!ls_fresh(st, (uint32_t)s))
                    ls_append(st->stale_prev, st->stale_next, &st->stale_head, &st->stale_tail,
                              (uint32_t)s);
        }
        return;
    }
    for (uint32_t w = 0; w < st->nwords; w++) {
        /* all_stale: only buckets with fresh slots change; else every non-empty bucket. */
        uint64_t bits = all_stale ? st->busy[1][w] : (st->busy[0][w] | st->busy[1][w]);
        while (bits) {
            uint32_t b = w * 64 + (uint32_t)__builtin_ctzll(bits);
            bits &= bits - 1;
            ls_list *old = &st->list[0][b], *young = &st->list[1][b];
            if (all_stale && (old->tail < 0 ||
                              st->slot[old->tail].touched < st->slot[young->head].touched)) {
                /* Append the (former) fresh list to the stale one. */
                if (old->tail >= 0) {
                    st->slot[old->tail].next = young->head;
                    st->slot[young->head].prev = old->tail;
                } else {
                    old->head = young->head;
                    st->busy[0][w] |= (uint64_t)1 << (b & 63);
                }
                old->tail = young->tail;
                young->head = young->tail = -1;
                st->busy[1][w] &= ~((uint64_t)1 << (b & 63));
            } else {
                ls_rebucket(st, b);
            }
        }
    }
}

/* Highest set bit of bitmap bm at an index <= i, or -1. */
static int64_t ls_bit_at_or_below(const uint64_t *bm, int64_t i) {
    if (i < 0) return -1;
    int64_t w = i >> 6;
    uint64_t m = bm[w] & ((((uint64_t)2) << (i & 63)) - 1); /* bits 0..i%64 (all at 63) */
    for (;;) {
        if (m) return w * 64 + 63 - __builtin_clzll(m);
        if (--w < 0) return -1;
        m = bm[w];
    }
}

static int32_t ls_list_find(const ls_state *st, const ls_list *l, smoe_evictable_fn ok,
                            void *ctx) {
    for (int32_t s = l->head; s >= 0; s = st->slot[s].next)
        if (!ok || ok(ctx, (uint32_t)s)) return s;
    return -1;
}

static int32_t ls_victim(smoe_policy *p, smoe_evictable_fn ok, void *ctx) {
    ls_state *st = p->state;
    if (st->order == SMOE_LS_ORDER_FIFO) {
        for (int32_t s = st->stale_head; s >= 0; s = st->stale_next[s])
            if (!ok || ok(ctx, (uint32_t)s)) return s;
        for (int32_t s = st->ins_head; s >= 0; s = st->ins_next[s]) /* fresh, by insert */
            if (ls_fresh(st, (uint32_t)s) && (!ok || ok(ctx, (uint32_t)s))) return s;
        return -1;
    }
    for (int g = 0; g < 2; g++) {
        int32_t v;
        /* Layers by decreasing distance: cur, cur-1, .., 0, then L-1, .., cur+1; in the stale
         * group cur comes last instead (see the header: its stale experts may still be routed
         * to by the accesses left in the current layer). */
        const int64_t cur = st->nbuckets > 1 ? st->cur : 0;
        const int cur_last = g == 0 && st->nbuckets > 1;
        for (int64_t b = ls_bit_at_or_below(st->busy[g], cur - cur_last); b >= 0;
             b = ls_bit_at_or_below(st->busy[g], b - 1))
            if ((v = ls_list_find(st, &st->list[g][b], ok, ctx)) >= 0) return v;
        for (int64_t b = ls_bit_at_or_below(st->busy[g], (int64_t)st->nbuckets - 1); b > cur;
             b = ls_bit_at_or_below(st->busy[g], b - 1))
            if ((v = ls_list_find(st, &st->list[g][b], ok, ctx)) >= 0) return v;
        if (cur_last && (v = ls_list_find(st, &st->list[g][cur], ok, ctx)) >= 0) return v;
    }
    return -1;
}

const smoe_policy_ops smoe_policy_least_stale = {
    .name = "least_stale",
    .init = ls_init,
    .free = ls_free,
    .on_insert = ls_insert,
    .on_access = ls_access,
    .on_evict = ls_evict,
    .on_pass = ls_pass,
    .victim = ls_victim,
};

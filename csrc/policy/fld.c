/* FLD, Farthest Layer Distance (SpecMD's baseline, Appendix B, after HOBBIT, Tang et al. 2024):
 * "computes the distance between each cached expert's layer and the current inference layer,
 * evicting experts from the farthest layers first"; SpecMD §3.1.3 files it with the spatial
 * policies (no notion of time) and §4.1 notes that such policies evict experts of layers still
 * to come in the pass.  So:
 *
 *   - the current layer cur is the layer of the most recent demand access (access or demand
 *     insert; 0 before any), as in Least-Stale (policy/least_stale.c); a prefetch insert does
 *     not move it;
 *   - the distance of a slot is |j - cur| with j the layer of its key (a key out of range
 *     counts as layer 0 if negative, else L-1): the plain layer distance, not the distance to
 *     the next use in pass order (that one is Least-Stale's "layer" order);
 *   - victim: the largest distance; ties (the same layer, or the two layers cur-d and cur+d):
 *     least recently touched (a logical clock advanced by every on_insert and on_access).
 *
 * Structure: per layer a list of its resident slots in increasing touch time (a touch moves a
 * slot to the tail: O(1)).  victim() walks d from the largest possible distance down to 0 and
 * compares the first evictable slot of layers cur-d and cur+d: O(L + refused slots).  Sized at
 * init; nothing allocates later. */
#include <stdlib.h>

#include "policy.h"

typedef struct fld_state {
    int32_t *slot_key;    /* [nslots] */
    uint32_t *layer;      /* [nslots] layer of the slot's key (clamped) */
    uint8_t *resident;    /* [nslots] */
    uint64_t *touched;    /* [nslots] clock of the last touch */
    int32_t *prev, *next; /* [nslots] links inside the layer's list */
    int32_t *head, *tail; /* [num_layers] oldest touch at head */
    uint32_t cur;
    uint64_t clock;
} fld_state;

static void fld_free(smoe_policy *p) {
    fld_state *st = p->state;
    if (!st) return;
    free(st->slot_key);
    free(st->layer);
    free(st->resident);
    free(st->touched);
    free(st->prev);
    free(st->next);
    free(st->head);
    free(st->tail);
    free(st);
    p->state = NULL;
}

static int fld_init(smoe_policy *p, const smoe_policy_params *params, smoe_err *err) {
    const size_t n = params->nslots, L = params->num_layers;
    fld_state *st = calloc(1, sizeof *st);
    p->state = st;
    if (st) {
        st->slot_key = calloc(n, sizeof *st->slot_key);
        st->layer = calloc(n, sizeof *st->layer);
        st->resident = calloc(n, 1);
        st->touched = calloc(n, sizeof *st->touched);
        st->prev = malloc(n * sizeof *st->prev);
        st->next = malloc(n * sizeof *st->next);
        st->head = malloc(L * sizeof *st->head);
        st->tail = malloc(L * sizeof *st->tail);
    }
    if (!st || !st->slot_key || !st->layer || !st->resident || !st->touched || !st->prev ||
        !st->next || !st->head || !st->tail) {
        fld_free(p);
        return smoe_err_set(err, SMOE_ENOMEM, "fld: out of memory for %zu slots", n);
    }
    for (size_t l = 0; l < L; l++) st->head[l] = st->tail[l] = -1;
    return 0;
}

static uint32_t fld_layer_of(const smoe_policy *p, int32_t key) {
    if (key < 0) return 0;
    uint32_t j = (uint32_t)key / p->num_experts;
    return j < p->num_layers ? j : p->num_layers - 1;
}

static void fld_unlink(fld_state *st, uint32_t s) {
    const uint32_t l = st->layer[s];
    if (st->prev[s] >= 0) st->next[st->prev[s]] = st->next[s]; else st->head[l] = st->next[s];
    if (st->next[s] >= 0) st->prev[st->next[s]] = st->prev[s]; else st->tail[l] = st->prev[s];
}

static void fld_append(fld_state *st, uint32_t s) {
    const uint32_t l = st->layer[s];
    st->prev[s] = st->tail[l];
    st->next[s] = -1;
    if (st->tail[l] >= 0) st->next[st->tail[l]] = (int32_t)s; else st->head[l] = (int32_t)s;
    st->tail[l] = (int32_t)s;
}

static void fld_demand(smoe_policy *p, fld_state *st, int32_t key) {
    if (key >= 0 && (uint64_t)key < (uint64_t)p->num_layers * p->num_experts)
        st->cur = (uint32_t)key / p->num_experts;
}

static void fld_insert(smoe_policy *p, uint32_t slot, int32_t key, int prefetch) {
    fld_state *st = p->state;
    if (slot >= p->nslots) return;
    if (st->resident[slot]) fld_unlink(st, slot);
    st->slot_key[slot] = key;
    st->layer[slot] = fld_layer_of(p, key);
    st->resident[slot] = 1;
    st->touched[slot] = ++st->clock;
    fld_append(st, slot);
    if (!prefetch) fld_demand(p, st, key);
}

static void fld_access(smoe_policy *p, uint32_t slot, int32_t key) {
    fld_state *st = p->state;
    if (slot >= p->nslots) return;
    if (st->resident[slot]) {
        fld_unlink(st, slot);
        st->touched[slot] = ++st->clock;
        fld_append(st, slot);
    }
    fld_demand(p, st, key);
}

static void fld_evict(smoe_policy *p, uint32_t slot, int32_t key) {
    fld_state *st = p->state;
    (void)key;
    if (slot >= p->nslots || !st->resident[slot]) return;
    fld_unlink(st, slot);
    st->resident[slot] = 0;
}

static int32_t fld_first(const fld_state *st, uint32_t l, smoe_evictable_fn ok, void *ctx) {
    for (int32_t s = st->head[l]; s >= 0; s = st->next[s])
        if (!ok || ok(ctx, (uint32_t)s)) return s;
    return -1;
}

static int32_t fld_victim(smoe_policy *p, smoe_evictable_fn ok, void *ctx) {
    fld_state *st = p->state;
    const int64_t cur = st->cur, L = p->num_layers;
    const int64_t dmax = cur > L - 1 - cur ? cur : L - 1 - cur;
    for (int64_t d = dmax; d >= 0; d--) {
        int32_t a = cur - d >= 0 ? fld_first(st, (uint32_t)(cur - d), ok, ctx) : -1;
        int32_t b = d > 0 && cur + d < L ? fld_first(st, (uint32_t)(cur + d), ok, ctx) : -1;
        if (a >= 0 && b >= 0) return st->touched[a] < st->touched[b] ? a : b;
        if (a >= 0) return a;
        if (b >= 0) return b;
    }
    return -1;
}

const smoe_policy_ops smoe_policy_fld = {
    .name = "fld",
    .init = fld_init,
    .free = fld_free,
    .on_insert = fld_insert,
    .on_access = fld_access,
    .on_evict = fld_evict,
    .on_pass = NULL,
    .victim = fld_victim,
};

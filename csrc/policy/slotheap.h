/* Indexed binary min-heap over slot indices 0..n-1 (shared by Least-Stale FIFO order and SpAc).
 *
 * Each slot in the heap carries two keys compared lexicographically (k1, then k2); callers keep
 * keys distinct among the slots in one heap (k2 is a logical clock), so the order is total and
 * the minimum is unique.  push/remove/update are O(log n).  find() returns the smallest slot
 * that `ok` accepts: a depth-first walk of the heap tree that descends below a slot only when
 * `ok` refused it and prunes subtrees that cannot beat the best accepted slot found so far, so
 * it costs O(1 + refused slots) calls of `ok`; O(n) only when nearly everything is refused.
 * Everything is sized at init; nothing allocates afterwards. */
#ifndef SMOE_SLOTHEAP_H
#define SMOE_SLOTHEAP_H

#include <stdlib.h>

#include "policy.h"

typedef struct smoe_slotheap {
    uint32_t *node;    /* [n] heap array of slots; node[0] is the minimum */
    int32_t *pos;      /* [n] slot -> index in node, -1 when the slot is not in the heap */
    uint64_t *k1, *k2; /* [n] per slot keys (meaningful while in the heap) */
    uint32_t *stack;   /* [n] scratch of find() */
    uint32_t size, n;
} smoe_slotheap;

static inline void smoe_slotheap_free(smoe_slotheap *h) {
    free(h->node);
    free(h->pos);
    free(h->k1);
    free(h->k2);
    free(h->stack);
    h->node = NULL;
    h->pos = NULL;
    h->k1 = h->k2 = NULL;
    h->stack = NULL;
}

static inline int smoe_slotheap_init(smoe_slotheap *h, uint32_t n) {
    size_t m = n ? n : 1;
    h->node = malloc(m * sizeof *h->node);
    h->pos = malloc(m * sizeof *h->pos);
    h->k1 = calloc(m, sizeof *h->k1);
    h->k2 = calloc(m, sizeof *h->k2);
    h->stack = malloc(m * sizeof *h->stack);
    h->size = 0;
    h->n = n;
    if (!h->node || !h->pos || !h->k1 || !h->k2 || !h->stack) {
        smoe_slotheap_free(h);
        return -1;
    }
    for (uint32_t s = 0; s < n; s++) h->pos[s] = -1;
    return 0;
}

static inline int smoe_slotheap_less(const smoe_slotheap *h, uint32_t a, uint32_t b) {
    return h->k1[a] < h->k1[b] || (h->k1[a] == h->k1[b] && h->k2[a] < h->k2[b]);
}

static inline void smoe_slotheap_place(smoe_slotheap *h, uint32_t i, uint32_t s) {
    h->node[i] = s;
    h->pos[s] = (int32_t)i;
}

static inline void smoe_slotheap_up(smoe_slotheap *h, uint32_t i) {
    uint32_t s = h->node[i];
    while (i > 0) {
        uint32_t parent = (i - 1) / 2;
        if (!smoe_slotheap_less(h, s, h->node[parent])) break;
        smoe_slotheap_place(h, i, h->node[parent]);
        i = parent;
    }
    smoe_slotheap_place(h, i, s);
}

static inline void smoe_slotheap_down(smoe_slotheap *h, uint32_t i) {
    uint32_t s = h->node[i];
    for (;;) {
        uint32_t c = 2 * i + 1;
        if (c >= h->size) break;
        if (c + 1 < h->size && smoe_slotheap_less(h, h->node[c + 1], h->node[c])) c++;
        if (!smoe_slotheap_less(h, h->node[c], s)) break;
        smoe_slotheap_place(h, i, h->node[c]);
        i = c;
    }
    smoe_slotheap_place(h, i, s);
}

static inline int smoe_slotheap_has(const smoe_slotheap *h, uint32_t s) {
    return s < h->n && h->pos[s] >= 0;
}

/* Insert slot s with keys (k1, k2), or re-key it when it is already in the heap. */
static inline void smoe_slotheap_set(smoe_slotheap *h, uint32_t s, uint64_t k1, uint64_t k2) {
    if (s >= h->n) return;
    h->k1[s] = k1;
    h->k2[s] = k2;
    if (h->pos[s] < 0) {
        smoe_slotheap_place(h, h->size++, s);
        smoe_slotheap_up(h, h->size - 1);
    } else {
        uint32_t i = (uint32_t)h->pos[s];
        smoe_slotheap_up(h, i);
        if ((uint32_t)h->pos[s] == i) smoe_slotheap_down(h, i);
    }
}

static inline void smoe_slotheap_remove(smoe_slotheap *h, uint32_t s) {
    if (!smoe_slotheap_has(h, s)) return;
    uint32_t i = (uint32_t)h->pos[s];
    h->pos[s] = -1;
    uint32_t last = h->node[--h->size];
    if (i == h->size) return; /* s was the last node */
    smoe_slotheap_place(h, i, last);
    smoe_slotheap_up(h, i);
    if ((uint32_t)h->pos[last] == i) smoe_slotheap_down(h, i);
}

static inline void smoe_slotheap_clear(smoe_slotheap *h) {
    for (uint32_t i = 0; i < h->size; i++) h->pos[h->node[i]] = -1;
    h->size = 0;
}

/* The smallest slot in the heap that ok accepts (ok == NULL accepts all), or -1. */
static inline int32_t smoe_slotheap_find(smoe_slotheap *h, smoe_evictable_fn ok, void *ctx) {
    if (h->size == 0) return -1;
    if (!ok) return (int32_t)h->node[0];
    int32_t best = -1;
    uint32_t top = 0;
    h->stack[top++] = 0;
    while (top) {
        uint32_t i = h->stack[--top];
        uint32_t s = h->node[i];
        /* Every slot below i is larger than s: no need to look when s cannot beat best. */
        if (best >= 0 && !smoe_slotheap_less(h, s, (uint32_t)best)) continue;
        if (ok(ctx, s)) {
            best = (int32_t)s;
            continue;
        }
        /* Each refused node replaces itself by at most two children: the stack never holds
         * more than size entries. */
        uint32_t c = 2 * i + 1;
        if (c + 1 < h->size) h->stack[top++] = c + 1;
        if (c < h->size) h->stack[top++] = c;
    }
    return best;
}

#endif

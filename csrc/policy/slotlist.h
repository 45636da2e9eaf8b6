/* Intrusive doubly linked list over slot indices 0..n-1 (shared by LRU, MRU, FIFO).
 * All operations O(1) except the finds, which walk until `ok` accepts a slot. */
#ifndef SMOE_SLOTLIST_H
#define SMOE_SLOTLIST_H

#include <stdlib.h>

#include "policy.h"

typedef struct smoe_slotlist {
    int32_t *prev, *next; /* -1 terminated; both owned */
    uint8_t *in;          /* owned; 1 while the slot is in the list */
    int32_t head, tail;   /* head = most recently pushed */
    uint32_t n;
} smoe_slotlist;

static inline int smoe_slotlist_init(smoe_slotlist *l, uint32_t n) {
    l->prev = malloc(n * sizeof *l->prev);
    l->next = malloc(n * sizeof *l->next);
    l->in = calloc(n, 1);
    l->head = l->tail = -1;
    l->n = n;
    if (!l->prev || !l->next || !l->in) {
        free(l->prev);
        free(l->next);
        free(l->in);
        return -1;
    }
    return 0;
}

static inline void smoe_slotlist_free(smoe_slotlist *l) {
    free(l->prev);
    free(l->next);
    free(l->in);
}

static inline void smoe_slotlist_remove(smoe_slotlist *l, uint32_t s) {
    if (s >= l->n || !l->in[s]) return;
    int32_t p = l->prev[s], n = l->next[s];
    if (p >= 0) l->next[p] = n; else l->head = n;
    if (n >= 0) l->prev[n] = p; else l->tail = p;
    l->in[s] = 0;
}

static inline void smoe_slotlist_push_head(smoe_slotlist *l, uint32_t s) {
    if (s >= l->n) return;
    if (l->in[s]) smoe_slotlist_remove(l, s);
    l->prev[s] = -1;
    l->next[s] = l->head;
    if (l->head >= 0) l->prev[l->head] = (int32_t)s; else l->tail = (int32_t)s;
    l->head = (int32_t)s;
    l->in[s] = 1;
}

static inline void smoe_slotlist_move_head(smoe_slotlist *l, uint32_t s) {
    if (l->head == (int32_t)s) return;
    smoe_slotlist_push_head(l, s);
}

static inline int32_t smoe_slotlist_find_from_tail(const smoe_slotlist *l, smoe_evictable_fn ok,
                                                   void *ctx) {
    for (int32_t s = l->tail; s >= 0; s = l->prev[s])
        if (!ok || ok(ctx, (uint32_t)s)) return s;
    return -1;
}

static inline int32_t smoe_slotlist_find_from_head(const smoe_slotlist *l, smoe_evictable_fn ok,
                                                   void *ctx) {
    for (int32_t s = l->head; s >= 0; s = l->next[s])
        if (!ok || ok(ctx, (uint32_t)s)) return s;
    return -1;
}

#endif

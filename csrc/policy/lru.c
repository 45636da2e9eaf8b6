/* LRU: evict the least recently used resident slot.  An intrusive doubly linked list over
 * slot indices, most recent at head; every event is O(1), victim walks from the tail past
 * slots the caller cannot evict (pinned ones in the live cache: few). */
#include <stdlib.h>

#include "policy.h"
#include "slotlist.h"

static int lru_init(smoe_policy *p, const smoe_policy_params *params, smoe_err *err) {
    smoe_slotlist *l = malloc(sizeof *l);
    if (!l || smoe_slotlist_init(l, params->nslots) < 0) {
        free(l);
        return smoe_err_set(err, SMOE_ENOMEM, "lru: out of memory");
    }
    p->state = l;
    return 0;
}

static void lru_free(smoe_policy *p) {
    smoe_slotlist_free(p->state);
    free(p->state);
}

static void lru_insert(smoe_policy *p, uint32_t slot, int32_t key, int prefetch) {
    (void)key;
    (void)prefetch;
    smoe_slotlist_push_head(p->state, slot);
}

static void lru_access(smoe_policy *p, uint32_t slot, int32_t key) {
    (void)key;
    smoe_slotlist_move_head(p->state, slot);
}

static void lru_evict(smoe_policy *p, uint32_t slot, int32_t key) {
    (void)key;
    smoe_slotlist_remove(p->state, slot);
}

static int32_t lru_victim(smoe_policy *p, smoe_evictable_fn ok, void *ctx) {
    return smoe_slotlist_find_from_tail(p->state, ok, ctx);
}

const smoe_policy_ops smoe_policy_lru = {
    .name = "lru",
    .init = lru_init,
    .free = lru_free,
    .on_insert = lru_insert,
    .on_access = lru_access,
    .on_evict = lru_evict,
    .on_pass = NULL,
    .victim = lru_victim,
};

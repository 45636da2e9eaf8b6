/* FIFO: evict the resident slot inserted longest ago (demand and prefetch inserts alike);
 * accesses do not change the order.  Same intrusive list as LRU, pushed only on insert;
 * victim walks from the oldest insert past slots the caller cannot evict. */
#include <stdlib.h>

#include "policy.h"
#include "slotlist.h"

static int fifo_init(smoe_policy *p, const smoe_policy_params *params, smoe_err *err) {
    smoe_slotlist *l = malloc(sizeof *l);
    if (!l || smoe_slotlist_init(l, params->nslots) < 0) {
        free(l);
        return smoe_err_set(err, SMOE_ENOMEM, "fifo: out of memory");
    }
    p->state = l;
    return 0;
}

static void fifo_free(smoe_policy *p) {
    smoe_slotlist_free(p->state);
    free(p->state);
}

static void fifo_insert(smoe_policy *p, uint32_t slot, int32_t key, int prefetch) {
    (void)key;
    (void)prefetch;
    smoe_slotlist_push_head(p->state, slot);
}

static void fifo_access(smoe_policy *p, uint32_t slot, int32_t key) {
    (void)p;
    (void)slot;
    (void)key;
}

static void fifo_evict(smoe_policy *p, uint32_t slot, int32_t key) {
    (void)key;
    smoe_slotlist_remove(p->state, slot);
}

static int32_t fifo_victim(smoe_policy *p, smoe_evictable_fn ok, void *ctx) {
    return smoe_slotlist_find_from_tail(p->state, ok, ctx);
}

const smoe_policy_ops smoe_policy_fifo = {
    .name = "fifo",
    .init = fifo_init,
    .free = fifo_free,
    .on_insert = fifo_insert,
    .on_access = fifo_access,
    .on_evict = fifo_evict,
    .on_pass = NULL,
    .victim = fifo_victim,
};

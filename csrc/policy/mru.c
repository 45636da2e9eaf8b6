/* MRU: evict the most recently touched resident slot, where a touch is an access or an insert
 * (demand or prefetch).  Good for loops longer than the cache, which defeat LRU.  Same
 * intrusive list as LRU; victim walks from the most recent touch past slots the caller cannot
 * evict. */
#include <stdlib.h>

#include "policy.h"
#include "slotlist.h"

static int mru_init(smoe_policy *p, const smoe_policy_params *params, smoe_err *err) {
    smoe_slotlist *l = malloc(sizeof *l);
    if (!l || smoe_slotlist_init(l, params->nslots) < 0) {
        free(l);
        return smoe_err_set(err, SMOE_ENOMEM, "mru: out of memory");
    }
    p->state = l;
    return 0;
}

static void mru_free(smoe_policy *p) {
    smoe_slotlist_free(p->state);
    free(p->state);
}

static void mru_insert(smoe_policy *p, uint32_t slot, int32_t key, int prefetch) {
    (void)key;
    (void)prefetch;
    smoe_slotlist_push_head(p->state, slot);
}

static void mru_access(smoe_policy *p, uint32_t slot, int32_t key) {
    (void)key;
    smoe_slotlist_move_head(p->state, slot);
}

static void mru_evict(smoe_policy *p, uint32_t slot, int32_t key) {
    (void)key;
    smoe_slotlist_remove(p->state, slot);
}

static int32_t mru_victim(smoe_policy *p, smoe_evictable_fn ok, void *ctx) {
    return smoe_slotlist_find_from_head(p->state, ok, ctx);
}

const smoe_policy_ops smoe_policy_mru = {
    .name = "mru",
    .init = mru_init,
    .free = mru_free,
    .on_insert = mru_insert,
    .on_access = mru_access,
    .on_evict = mru_evict,
    .on_pass = NULL,
    .victim = mru_victim,
};

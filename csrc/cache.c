/* Fast tier in host memory: the slab and the store read; all bookkeeping is the slot table's
 * (slots.c).  Locking and behaviour: cache.h and slots.h. */
#include "cache.h"
#include "tier.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static uint8_t *slot_data(const smoe_cache *c, uint32_t s) {
    return c->slab + (uint64_t)s * c->tab.slot_bytes;
}

/* ops.load: read key's block from the store into slot s (mu released, slot LOADING), no
 * earlier than the emulated link allows. */
static int cache_load(void *owner, uint32_t s, int32_t key, smoe_err *err) {
    smoe_cache *c = owner;
    uint32_t ne = c->tab.num_experts;
    double until = smoe_link_reserve(&c->link, c->tab.slot_bytes);
    int rc = smoe_store_read(c->store, (uint32_t)key / ne, (uint32_t)key % ne, slot_data(c, s),
                             err);
    smoe_link_wait(until);
    return rc;
}

static const smoe_slots_ops cache_ops = {.load = cache_load};

int smoe_cache_init(smoe_cache *c, smoe_store *store, uint32_t nslots, uint32_t min_slots,
                    smoe_policy *policy, int prefetch_worker, smoe_err *err) {
    memset(c, 0, sizeof *c);
    if (!store || !policy)
        return smoe_err_set(err, SMOE_EINVAL, "cache: store and policy are required");
    if (store->block_bytes == 0 || store->block_bytes % SMOE_ALIGN)
        return smoe_err_set(err, SMOE_EINVAL,
                            "cache: store block size %llu is not a positive multiple of %u",
                            (unsigned long long)store->block_bytes, SMOE_ALIGN);
    int rc = smoe_link_init(&c->link, err);
    if (rc) return rc;
    rc = smoe_slots_init(&c->tab, "cache", store->num_layers, store->num_experts,
                             store->block_bytes, nslots, min_slots, policy, &cache_ops, c, err);
    if (rc < 0) {
        smoe_link_free(&c->link);
        return rc;
    }
    c->store = store;
    void *slab = NULL;
    if (posix_memalign(&slab, SMOE_ALIGN, (size_t)nslots * store->block_bytes) != 0) {
        c->tab.policy = NULL; /* stays with the caller on failure */
        smoe_cache_free(c);
        return smoe_err_set(err, SMOE_ENOMEM, "cache: cannot allocate %u slots of %llu bytes",
                            nslots, (unsigned long long)store->block_bytes);
    }
    c->slab = slab;
    /* slots fault in as the store fills them: huge pages then (no collapse: that would commit
     * the whole slab now) */
    smoe_advise_huge(slab, (size_t)nslots * store->block_bytes, 0);
    if (prefetch_worker && (rc = smoe_slots_start_worker(&c->tab, err)) < 0) {
        c->tab.policy = NULL;
        smoe_cache_free(c);
        return rc;
    }
    return 0;
}

void smoe_cache_free(smoe_cache *c) {
    smoe_slots_free(&c->tab); /* stops the worker first: no load writes the slab after this */
    free(c->slab);
    smoe_link_free(&c->link);
    memset(c, 0, sizeof *c);
}

int smoe_cache_acquire(smoe_cache *c, uint32_t layer, uint32_t expert, const uint8_t **data,
                       smoe_err *err) {
    uint32_t s = 0;
    int rc = smoe_slots_acquire(&c->tab, layer, expert, NULL, &s, err);
    if (rc == 0) *data = slot_data(c, s);
    return rc;
}

int smoe_cache_release(smoe_cache *c, uint32_t layer, uint32_t expert, smoe_err *err) {
    return smoe_slots_release(&c->tab, layer, expert, NULL, err);
}

int smoe_cache_set_throttle(smoe_cache *c, double bytes_per_s, double latency_s, smoe_err *err) {
    return smoe_link_set(&c->link, bytes_per_s, latency_s, err);
}

int smoe_cache_resident_mask(smoe_cache *c, uint32_t layer, uint8_t *mask, smoe_err *err) {
    return smoe_slots_resident_mask(&c->tab, layer, mask, err);
}

smoe_tier smoe_tier_host(smoe_cache *c) {
    return (smoe_tier){&c->tab, c, NULL, NULL};
}

/* Fast tier in host memory: a fixed slab of SMOE_ALIGN-aligned slots holding expert blocks
 * read from a store.  The bookkeeping (slot states, key map, pins, policy events, statistics,
 * the prefetch queue and its worker, victim rules) is the shared slot table of slots.h, whose
 * header states the locking rules and the exact behaviour; this cache supplies only the load
 * (a store read into the slot's bytes, in the thread that needs it, mu released) and the
 * address of a pinned slot.  A demand miss blocks the caller for the read.
 *
 * Locking: the table's mutex `tab.mu` guards everything in `tab` marked [mu]; slab bytes of a
 * slot are written only by the thread that moved it to LOADING (without mu) and read only
 * while the slot is pinned and READY.  `store`, `slab` and `tab`'s shape are set by init and
 * read-only afterwards (store reads take no lock of ours).
 *
 * Queue, policy, statistics and introspection are the table's functions on &c->tab:
 * smoe_slots_begin_pass, _prefetch, _cancel, _wait_idle, _pause_worker, _queue_len,
 * _take_worker_error, _set_policy, _resident, _counts, _utility, _get_stats, _reset_stats,
 * _stop_worker (slots.h).
 */
#ifndef SMOE_CACHE_H
#define SMOE_CACHE_H

#include "common.h"
#include "link.h"
#include "policy/policy.h"
#include "slots.h"
#include "store.h"

typedef struct smoe_cache {
    smoe_slots tab;    /* the bookkeeping; tab.slot_bytes == store->block_bytes */
    smoe_store *store; /* borrowed; must outlive the cache */
    uint8_t *slab;     /* owned; tab.nslots * tab.slot_bytes, SMOE_ALIGN-aligned */

    smoe_link link; /* the emulated link of every store read, demand or prefetch (link.h,
                     * SpecMD A.4); its own lock: the loads run without tab.mu */
} smoe_cache;

/* Create a cache of `nslots` slots over `store` with `policy` (ownership of policy passes to
 * the cache on success).  `min_slots` (e.g. the model's top-k) is checked: fewer slots ->
 * SMOE_EINVAL with a clear message.  Starts the prefetch worker when `prefetch_worker`. */
int smoe_cache_init(smoe_cache *c, smoe_store *store, uint32_t nslots, uint32_t min_slots,
                    smoe_policy *policy, int prefetch_worker, smoe_err *err);

/* Stop the worker (cancelling queued requests), wait for in-flight loads, free everything.
 * No other thread may be inside a cache call. */
void smoe_cache_free(smoe_cache *c);

/* Pin expert (layer, expert) and return its block in *data.  Hit: pin.  Loading: wait.
 * Miss: take a free or evictable slot (policy victim), load it from the store in the calling
 * thread with mu released, pin.  Blocks: call without the GIL.  When no slot is evictable
 * (all pinned or loading) waits for one.  Store errors come back as SMOE_EIO/SMOE_ECORRUPT
 * and leave the slot empty; policy failures as SMOE_EPOLICY. */
int smoe_cache_acquire(smoe_cache *c, uint32_t layer, uint32_t expert, const uint8_t **data,
                       smoe_err *err);

/* Drop one pin.  Releasing an expert that is not pinned is SMOE_ESTATE. */
int smoe_cache_release(smoe_cache *c, uint32_t layer, uint32_t expert, smoe_err *err);

/* Emulate a slower link (SpecMD A.4): from now on every store read of the cache takes at
 * least latency_s + block_bytes / bytes_per_s, reads sharing one emulated link (a read that
 * starts while another occupies it waits for it).  bytes_per_s = 0 and latency_s = 0 turn it
 * off; negative or non-finite values are SMOE_EINVAL. */
int smoe_cache_set_throttle(smoe_cache *c, double bytes_per_s, double latency_s, smoe_err *err);

/* smoe_slots_resident_mask of the cache's table (the per-layer path's snapshot). */
int smoe_cache_resident_mask(smoe_cache *c, uint32_t layer, uint8_t *mask, smoe_err *err);

#endif

/* Fast tier: a fixed slab of SMOE_ALIGN-aligned slots holding expert blocks read from a store,
 * a key -> slot map, pinning, blocking loads, statistics, and the prefetch worker thread.
 *
 * Locking: one mutex `mu` per cache guards every field marked [mu] below, including the
 * prefetch queue and each slot's state.  Block bytes in a slot are written only by the thread
 * that moved it to LOADING (without holding mu) and read only while the slot is pinned and
 * READY.  `cv` is broadcast whenever a slot leaves LOADING or a pin drops to zero; `work_cv`
 * wakes the prefetch worker.  The policy is called only with mu held.  Store reads happen
 * with mu released.  Lock order: mu only (store and policy take no locks of their own;
 * the Python bridge policy takes the GIL inside mu, so no thread may hold the GIL while
 * waiting for mu: Python entry points release the GIL before calling into the cache).
 *
 * Exact behaviour (what a simulator must mirror to get the same counts; policy events as in
 * policy/policy.h):
 *  - acquire, READY: hit; pins++; on_access; prefetched slot -> prefetch_used, flag cleared.
 *  - acquire, LOADING: miss (+ prefetch_late when it is a prefetch load, + collision_misses
 *    when evicted_pass[key] == pass_id); wait; then as a READY access but not counted again
 *    (on_access, prefetch_used).  If that load failed, the waiter returns its error.
 *  - acquire, absent: miss (+ collision check); lowest-numbered EMPTY slot, else victim()
 *    among READY unpinned slots -> on_evict (evictions++, evicted_pass[key] = pass_id,
 *    prefetch_wasted if still prefetched); on_insert(s, key, 0); load.  No candidate: wait
 *    for a release or a finished load, then start over (without counting again).  Load
 *    failure: on_evict(s, key), slot EMPTY, error returned; not an eviction.
 *  - tick: +1 on each demand access (hit, miss, late) and each prefetch insert; the slot
 *    touched records the new value in last_tick; set_policy replays slots by last_tick.
 *  - prefetch(): keys resident or loading are skipped at request time; a queued key is
 *    superseded (new priority, new seq).  The worker pops the highest (priority, -seq),
 *    skips it if it became resident/loading, else takes the lowest EMPTY slot, else victim()
 *    among READY unpinned slots with last_pass != pass_id and, when the policy has a utility
 *    (spac), utility(slot's key) <= utility(requested key) (else prefetch_dropped++);
 *    on_insert(s, key, 1), prefetch_issued++.
 *  - a demand access that cannot find a slot waits forever if every slot stays pinned: size
 *    the cache for (threads x top_k) pins at least.
 */
#ifndef SMOE_CACHE_H
#define SMOE_CACHE_H

#include <pthread.h>

#include "common.h"
#include "policy/policy.h"
#include "store.h"

enum { SMOE_SLOT_EMPTY = 0, SMOE_SLOT_LOADING = 1, SMOE_SLOT_READY = 2 };

typedef struct smoe_slot {
    int32_t key;        /* [mu] expert key, -1 when empty */
    uint8_t state;      /* [mu] SMOE_SLOT_* */
    uint8_t prefetched; /* [mu] loaded by prefetch and not yet used by a demand access */
    uint8_t load_failed;/* [mu] the load into this slot failed; waiters report the error */
    int32_t pins;       /* [mu] number of acquires not yet released */
    uint64_t last_pass; /* [mu] pass id of the last demand access (0: never) */
    uint64_t last_tick; /* [mu] tick value at the last demand access or insert (see tick) */
    uint32_t load_seq;  /* [mu] incremented each time a load into this slot starts */
    uint32_t failed_seq;/* [mu] load_seq of the last load that failed (0: none) */
} smoe_slot;

typedef struct smoe_cache_stats {
    uint64_t hits;             /* demand accesses that found the expert READY */
    uint64_t misses;           /* demand accesses that did not */
    uint64_t collision_misses; /* misses on an expert evicted earlier in the same pass */
    uint64_t prefetch_issued;  /* prefetch loads started */
    uint64_t prefetch_used;    /* prefetched experts later used by demand (incl. late) */
    uint64_t prefetch_late;    /* demand found a prefetch still loading (a miss; waited) */
    uint64_t prefetch_wasted;  /* prefetched experts evicted before any demand use */
    uint64_t prefetch_dropped; /* prefetch requests dropped: no evictable slot */
    uint64_t prefetch_failed;  /* prefetch loads that failed (store error; see worker_err) */
    uint64_t evictions;
    uint64_t bytes_read;       /* bytes this cache read from the store */
    double stall_s;            /* seconds callers blocked in acquire waiting for a load */
} smoe_cache_stats;

typedef struct smoe_prefetch_req {
    int32_t key;
    float priority; /* higher first; ties in request order */
    uint64_t seq;   /* request order */
} smoe_prefetch_req;

typedef struct smoe_cache {
    pthread_mutex_t mu;
    pthread_cond_t cv;      /* slot left LOADING, or a pin dropped to 0 */
    pthread_cond_t work_cv; /* prefetch queue changed or shutdown */
    pthread_cond_t idle_cv; /* prefetch queue empty and worker not loading */

    smoe_store *store;     /* borrowed; must outlive the cache */
    uint32_t num_layers, num_experts;
    uint32_t nslots;
    uint64_t slot_bytes;   /* == store->block_bytes */
    uint8_t *slab;         /* owned; nslots * slot_bytes, SMOE_ALIGN-aligned */
    smoe_slot *slots;      /* owned; [mu] */
    int32_t *map;          /* owned; [mu] key -> slot or -1; num_layers*num_experts */
    uint64_t *evicted_pass;/* owned; [mu] per key: pass id when last evicted (collisions) */
    smoe_policy *policy;   /* owned; [mu] */
    smoe_cache_stats stats;/* [mu] */
    uint64_t pass_id;      /* [mu] current forward pass, starts at 1 */
    uint64_t tick;         /* [mu] incremented on every demand access (hit, miss, late) and
                              every prefetch insert; the slot touched gets the new value */
    smoe_err *slot_err;    /* owned; [mu] per slot: the error of its last failed load */
    uint32_t waiters;      /* [mu] threads waiting on cv (release broadcasts only if > 0) */
    int32_t *qpos;         /* owned; [mu] per key: index in queue, or -1 when not queued */
    int32_t pf_key;        /* [mu] key the prefetch worker is finding a slot for */

    /* prefetch worker */
    pthread_t worker;
    int worker_started;    /* set once by init */
    int shutdown;          /* [mu] */
    int worker_busy;       /* [mu] worker is loading a block (or about to look at the queue) */
    int worker_paused;     /* [mu] worker takes no new requests (smoe_cache_pause_worker) */
    smoe_prefetch_req *queue; /* owned; [mu] binary max-heap on (priority, -seq) */
    uint32_t queue_len, queue_cap; /* [mu] */
    uint64_t queue_seq;    /* [mu] */
    smoe_err worker_err;   /* [mu] first load error in the worker (reported by stats/wait) */

    /* link emulation (SpecMD Appendix A.4, "hardware emulation"): every store read of this
     * cache, demand or prefetch, occupies one emulated link for latency + bytes / bandwidth;
     * reads queue on it in the order they start, and a read returns no earlier than its end
     * on the link.  0/0: off (reads take what the storage takes). */
    double throttle_bw;    /* [mu] bytes per second, 0: no bandwidth limit */
    double throttle_lat_s; /* [mu] seconds added to every read */
    double link_free_s;    /* [mu] smoe_now() time at which the emulated link becomes free */
} smoe_cache;

/* Create a cache of `nslots` slots over `store` with `policy` (ownership of policy passes to
 * the cache on success).  `min_slots` (e.g. the model's top-k) is checked: fewer slots ->
 * SMOE_EINVAL with a clear message.  Starts the prefetch worker when `prefetch_worker`. */
int smoe_cache_init(smoe_cache *c, smoe_store *store, uint32_t nslots, uint32_t min_slots,
                    smoe_policy *policy, int prefetch_worker, smoe_err *err);

/* Stop the worker (cancelling queued requests), wait for in-flight loads, free everything.
 * No other thread may be inside a cache call. */
void smoe_cache_free(smoe_cache *c);

/* Stop and join the prefetch worker (queued requests cancelled, an in-flight load finished).
 * Idempotent; the cache stays usable for demand accesses; later prefetch calls fail with
 * SMOE_ESTATE. */
void smoe_cache_stop_worker(smoe_cache *c);

/* Pin expert (layer, expert) and return its block in *data.  Hit: pin.  Loading: wait.
 * Miss: take a free or evictable slot (policy victim), load it from the store in the calling
 * thread with mu released, pin.  Blocks: call without the GIL.  When no slot is evictable
 * (all pinned or loading) waits for one.  Store errors come back as SMOE_EIO/SMOE_ECORRUPT
 * and leave the slot empty; policy failures as SMOE_EPOLICY. */
int smoe_cache_acquire(smoe_cache *c, uint32_t layer, uint32_t expert, const uint8_t **data,
                       smoe_err *err);

/* Drop one pin.  Releasing an expert that is not pinned is SMOE_ESTATE. */
int smoe_cache_release(smoe_cache *c, uint32_t layer, uint32_t expert, smoe_err *err);

/* Start forward pass pass_id+1: notifies the policy (on_pass). */
void smoe_cache_begin_pass(smoe_cache *c);

/* Queue prefetch requests.  A request for a key already queued updates its priority
 * (supersedes); a key resident or loading is skipped.  replace != 0 cancels all queued
 * requests first.  The worker loads into free slots or evictable ones, never evicting a
 * pinned expert or one accessed in the current pass. */
int smoe_cache_prefetch(smoe_cache *c, const int32_t *keys, const float *priorities, uint32_t n,
                        int replace, smoe_err *err);

/* Remove queued requests for key (-1: all).  Loads already in flight complete. */
void smoe_cache_cancel(smoe_cache *c, int32_t key);

/* Block until the queue is empty and the worker idle (tests and benchmarks). */
void smoe_cache_wait_idle(smoe_cache *c);

/* Pause (paused != 0) or resume the worker: while paused it starts no new load (a load in
 * flight completes) and requests stay queued; wait_idle then waits only for the in-flight
 * load.  Lets tests and callers batch requests, cancel or reprioritise them deterministically. */
void smoe_cache_pause_worker(smoe_cache *c, int paused);

/* Number of queued prefetch requests. */
uint32_t smoe_cache_queue_len(smoe_cache *c);

/* If a prefetch load failed since the last call, copy the first such error into err, forget
 * it and return its code; 0 otherwise. */
int smoe_cache_take_worker_error(smoe_cache *c, smoe_err *err);

/* Replace the policy keeping the cache contents (ownership of p passes to the cache, also on
 * failure).  The new policy gets on_insert(s, key, 0) for every resident slot (READY or
 * LOADING), oldest last_tick first.  p must have been built for this cache's nslots,
 * num_layers and num_experts (SMOE_EINVAL otherwise). */
int smoe_cache_set_policy(smoe_cache *c, smoe_policy *p, smoe_err *err);

/* Emulate a slower link (SpecMD A.4): from now on every store read of the cache takes at
 * least latency_s + block_bytes / bytes_per_s, reads sharing one emulated link (a read that
 * starts while another occupies it waits for it).  bytes_per_s = 0 and latency_s = 0 turn it
 * off; negative or non-finite values are SMOE_EINVAL. */
int smoe_cache_set_throttle(smoe_cache *c, double bytes_per_s, double latency_s, smoe_err *err);

/* mask[e] = 1 when expert (layer, e) is READY in the cache now, else 0 (absent or still
 * loading), for e in 0..num_experts-1, under one hold of mu (a snapshot: the prefetch worker
 * may evict or finish loading right after).  SMOE_EINVAL for a layer out of range. */
int smoe_cache_resident_mask(smoe_cache *c, uint32_t layer, uint8_t *mask, smoe_err *err);

/* Keys of the READY slots, in slot order, into keys (room for nslots); returns the count. */
uint32_t smoe_cache_resident(smoe_cache *c, int32_t *keys);

/* Activation counts of one verification pass for the policy (policy.h on_counts: counts[i]
 * tokens of the pass activate keys[i]; the layers of the listed keys are observed).  Takes mu;
 * a no-op for a policy without on_counts.  Keys out of range: SMOE_EINVAL (nothing fed). */
int smoe_cache_counts(smoe_cache *c, const int32_t *keys, const uint32_t *counts, uint32_t n,
                      smoe_err *err);

/* The policy's current utility of each key into out[0..n-1] (under mu).  SMOE_EPOLICY when
 * the policy has no utility; SMOE_EINVAL for a key out of range. */
int smoe_cache_utility(smoe_cache *c, const int32_t *keys, int32_t *out, uint32_t n,
                       smoe_err *err);

void smoe_cache_get_stats(smoe_cache *c, smoe_cache_stats *out);
void smoe_cache_reset_stats(smoe_cache *c);

#endif

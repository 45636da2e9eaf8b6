/* Slot bookkeeping of a fast tier, shared by the CPU cache (csrc/cache.c) and the GPU cache
 * (cuda/gcache.c): the slot table, the key -> slot map, pins, the policy events, the
 * statistics, the prefetch queue and its worker thread, and the victim rules for demand and
 * prefetch.  One routine per rule: a cache built on this table keeps only where the bytes go
 * (smoe_slots_ops.load: host memory + store read, or device slab + async copy) and who waits
 * on them (ops.pinned / ops.released: nothing on the CPU, stream events on the GPU).
 *
 * Locking: one mutex `mu` per table guards every field marked [mu] below, including the
 * prefetch queue and each slot's state.  Block bytes in a slot are written only by the thread
 * that moved it to LOADING (ops.load, called without mu) and read only while the slot is
 * pinned and READY.  `cv` is broadcast whenever a slot leaves LOADING or a pin drops to zero;
 * `work_cv` wakes the prefetch worker; `idle_cv` tells wait_idle the worker went idle.  The
 * policy and ops.pinned / ops.released are called only with mu held (they must not block:
 * the GPU cache makes only non-blocking CUDA calls there); ops.load and ops.worker_begin are
 * called with mu released.  Lock order: mu, then whatever a backend takes inside ops.load
 * with mu released (the GPU cache's stage_mu is never held together with mu).  The Python
 * bridge policy takes the GIL inside mu, so no thread may hold the GIL while waiting for mu:
 * Python entry points release the GIL before calling in.
 *
 * Exact behaviour (the simulator, csrc/sim.c, runs these very rules through the entry points
 * below smoe_slots_begin_pass; policy events as in policy/policy.h):
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
 *    with admission on (smoe_slots_set_admission), the request must then pass admit.h's rule
 *    against that victim (else prefetch_refused++, nothing evicted); on_insert(s, key, 1),
 *    prefetch_issued++.  Every load (demand or prefetch) is timed for the rule's estimates,
 *    and counted for its byte budget: a demand load as needed, or as added when its key's
 *    last eviction made room for a prefetch (pf_victim) fewer than SMOE_ADMIT_BUDGET_PASSES
 *    passes ago; a prefetched slot's first use as needed, its eviction unused as added.
 *  - a demand access that cannot find a slot waits forever if every slot stays pinned: size
 *    the cache for (threads x top_k) pins at least.
 */
#ifndef SMOE_SLOTS_H
#define SMOE_SLOTS_H

#include <pthread.h>

#include "admit.h"
#include "common.h"
#include "policy/policy.h"

enum { SMOE_SLOT_EMPTY = 0, SMOE_SLOT_LOADING = 1, SMOE_SLOT_READY = 2 };

typedef struct smoe_slot {
    int32_t key;        /* [mu] expert key, -1 when empty */
    uint8_t state;      /* [mu] SMOE_SLOT_* */
    uint8_t prefetched; /* [mu] loaded by prefetch and not yet used by a demand access */
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
    uint64_t prefetch_late;    /* demand accesses that found a prefetch still loading (each a
                                * miss that waited; several can wait on one load) */
    uint64_t prefetch_wasted;  /* prefetched experts evicted before any demand use */
    uint64_t prefetch_dropped; /* prefetch requests dropped: no evictable slot */
    uint64_t prefetch_refused; /* prefetch requests refused by the admission rule (admit.h) */
    uint64_t prefetch_failed;  /* prefetch loads that failed (store error; see worker_err) */
    uint64_t evictions;
    uint64_t protected_evictions; /* evictions of a protected key (lookahead buffer), taken
                                     only when no unprotected slot could go */
    uint64_t bytes_read;       /* bytes loaded into slots (one block per successful load) */
    double stall_s;            /* seconds callers blocked in acquire waiting for a load */
} smoe_cache_stats;

typedef struct smoe_prefetch_req {
    int32_t key;
    float priority; /* higher first; ties in request order */
    float prob;     /* the predictor's probability that the key is used (admit.h); NaN:
                       unknown, the admission rule lets it through */
    uint32_t steps; /* layer steps ahead of the request's issue where the key is needed */
    uint64_t seq;   /* request order */
    double issued;  /* time of the request, on the table owner's clock */
} smoe_prefetch_req;

/* What a cache built on the table does itself.  `owner` is the table's owner pointer. */
typedef struct smoe_slots_ops {
    /* Required.  Bring key's block into slot s, which the caller has marked LOADING; called
     * with mu released, by a demand acquire in its own thread or by the prefetch worker.
     * Returns 0 or a negative SMOE_E* code with err filled. */
    int (*load)(void *owner, uint32_t s, int32_t key, smoe_err *err);
    /* Optional, mu held.  A demand acquire by `stream` has just pinned READY slot s; `hit`
     * is non-zero when the access was counted as a hit (not after a miss or a wait).  A
     * failure (negative code, err filled) makes the acquire drop the pin and return it. */
    int (*pinned)(void *owner, uint32_t s, void *stream, int hit, smoe_err *err);
    /* Optional, mu held.  Slot s is being released by `stream`; the pin drops afterwards
     * whatever this returns (a negative code is returned by release). */
    int (*released)(void *owner, uint32_t s, void *stream, smoe_err *err);
    /* Optional.  Run first in the prefetch worker thread (mu not held). */
    void (*worker_begin)(void *owner);
} smoe_slots_ops;

typedef struct smoe_slots {
    pthread_mutex_t mu;
    pthread_cond_t cv;      /* slot left LOADING, or a pin dropped to 0 */
    pthread_cond_t work_cv; /* prefetch queue changed or shutdown */
    pthread_cond_t idle_cv; /* prefetch queue empty and worker not loading */

    /* set by init, read-only afterwards */
    const char *what;            /* "cache", "GPU cache": names the cache in messages */
    const smoe_slots_ops *ops;
    void *owner;                 /* passed to ops */
    uint32_t num_layers, num_experts;
    uint32_t nslots;
    uint64_t slot_bytes;         /* bytes of one block (statistics) */

    smoe_slot *slots;      /* owned; [mu] */
    uint32_t nempty;       /* [mu] slots in state EMPTY (lowest_free scans only when > 0) */
    int32_t *map;          /* owned; [mu] key -> slot or -1; num_layers*num_experts */
    uint64_t *evicted_pass;/* owned; [mu] per key: pass id when last evicted (collisions) */
    uint8_t *pf_victim;    /* owned; [mu] per key: 1 when its last eviction made room for a
                              prefetch (admit.h's byte budget) */
    uint8_t *protect;      /* owned; [mu] per key: 1 = in the lookahead buffer, evicted last
                              (smoe_slots_set_protected) */
    uint32_t nprotected;   /* [mu] keys marked in protect */
    int shield;            /* [mu] set while a victim search must skip protected keys */
    smoe_policy *policy;   /* owned; [mu] */
    smoe_cache_stats stats;/* [mu] */
    uint64_t pass_id;      /* [mu] current forward pass, starts at 1 */
    uint64_t tick;         /* [mu] incremented on every demand access (hit, miss, late) and
                              every prefetch insert; the slot touched gets the new value */
    smoe_err *slot_err;    /* owned; [mu] per slot: the error of its last failed load */
    uint32_t waiters;      /* [mu] threads waiting on cv (release broadcasts only if > 0) */
    int32_t *qpos;         /* owned; [mu] per key: index in queue, or -1 when not queued */
    int32_t pf_key;        /* [mu] key smoe_slots_claim is finding a slot for (the prefetch
                              admission rule reads it) */
    smoe_admit admit;      /* [mu] prefetch admission by expected benefit (admit.h): its
                              switch, its measured estimates and its refusals */

    /* prefetch worker */
    pthread_t worker;
    int worker_started;    /* [mu] set by start_worker before other threads use the table,
                              cleared by stop_worker */
    int shutdown;          /* [mu] */
    int worker_busy;       /* [mu] worker is loading a block (or about to look at the queue) */
    int worker_paused;     /* [mu] worker takes no new requests (smoe_slots_pause_worker) */
    int worker_loading;    /* [mu] the worker's ops.load is running (admit.h: a demand load
                              beside it measures the link's contention) */
    smoe_prefetch_req *queue; /* owned; [mu] binary max-heap on (priority, -seq) */
    uint32_t queue_len, queue_cap; /* [mu] */
    uint64_t queue_seq;    /* [mu] */
    smoe_err worker_err;   /* [mu] first load error in the worker (reported by stats/wait) */
} smoe_slots;

/* Check the shape (nslots >= max(1, min_slots), keys fit in int32, nslots * slot_bytes fits
 * in memory, policy built for nslots x num_layers x num_experts), allocate the table and init
 * its mutex and condition variables.  `what` (a string literal) names the cache in messages.
 * On success the table owns `policy`; on failure nothing is allocated and the caller keeps
 * it.  Starts no thread (smoe_slots_start_worker). */
int smoe_slots_init(smoe_slots *t, const char *what, uint32_t num_layers, uint32_t num_experts,
                    uint64_t slot_bytes, uint32_t nslots, uint32_t min_slots,
                    smoe_policy *policy, const smoe_slots_ops *ops, void *owner, smoe_err *err);

/* Start the prefetch worker (once, after the owner is ready for ops.load). */
int smoe_slots_start_worker(smoe_slots *t, smoe_err *err);

/* Stop and join the prefetch worker (queued requests cancelled, an in-flight load finished).
 * Idempotent; demand accesses still work; later prefetch calls fail with SMOE_ESTATE. */
void smoe_slots_stop_worker(smoe_slots *t);

/* Stop the worker, destroy the policy (unless t->policy was set to NULL), free the table and
 * zero it.  A zeroed table is a no-op.  No other thread may be inside a call. */
void smoe_slots_free(smoe_slots *t);

/* key = layer * num_experts + expert, or SMOE_EINVAL naming the pair when out of range. */
int smoe_slots_key(const smoe_slots *t, uint32_t layer, uint32_t expert, int32_t *key,
                   smoe_err *err);

/* Pin expert (layer, expert) for `stream` (passed to ops; NULL on the CPU) and return its
 * slot in *slot.  Hit: pin.  Loading: wait.  Miss: take a free or evictable slot, ops.load it
 * in the calling thread with mu released, pin.  Blocks: call without the GIL.  Load errors
 * come back as the load's code and leave the slot empty; policy failures as SMOE_EPOLICY. */
int smoe_slots_acquire(smoe_slots *t, uint32_t layer, uint32_t expert, void *stream,
                       uint32_t *slot, smoe_err *err);

/* Drop one pin (after ops.released).  Releasing an expert that is not pinned: SMOE_ESTATE. */
int smoe_slots_release(smoe_slots *t, uint32_t layer, uint32_t expert, void *stream,
                       smoe_err *err);

/* Start forward pass pass_id+1: notifies the policy (on_pass). */
void smoe_slots_begin_pass(smoe_slots *t);
/* The same, then the pass's token prior for the policy (on_prior; NULL: none known). */
void smoe_slots_begin_pass_prior(smoe_slots *t, const float *prior);

/* ---- the rules alone, for a caller that drives the table itself --------------------------
 * The steps acquire and the prefetch worker take, without the mutex, waiting or ops.load:
 * the live paths call them with mu held; the simulator (csrc/sim.c), the table's only thread
 * (no worker, no loads: it keeps a virtual clock of its own), calls them directly, so the
 * simulated cache is this table and its rules (slot choice, victims, the lookahead shield,
 * policy events, evictions, collisions) are written once.  None of them waits or loads. */

/* Give `key` (absent from the table) a slot and mark it LOADING with the policy told
 * (on_insert): the lowest EMPTY slot, else the policy's victim among the READY unpinned slots
 * (protected keys last, smoe_slots_set_protected), evicted; a prefetch (prefetch != 0) also
 * passes the admission rule of policy.h (not used in this pass; a utility policy: not above
 * key's).  Returns the slot, or -1: none may go (*rc = 0), or the policy failed (*rc < 0,
 * err filled).  Counts nothing but the eviction; the caller counts its miss or issue. */
int32_t smoe_slots_claim(smoe_slots *t, int32_t key, int prefetch, int *rc, smoe_err *err);

/* A prefetch copy of r->key (absent) may start at `now` (the owner's clock): the slot of
 * smoe_slots_claim(prefetch = 1), if the admission rule (admit.h, when t->admit.on) accepts
 * the request against that slot's victim; the victim is evicted only then.  Returns the slot
 * (LOADING), -1 when no slot may go (prefetch_dropped++), -3 when the rule refused it
 * (prefetch_refused++, nothing evicted), -2 on a policy failure (*rc < 0, err filled). */
int32_t smoe_slots_claim_prefetch(smoe_slots *t, const smoe_prefetch_req *r, double now,
                                  int *rc, smoe_err *err);

/* A demand access of key missed (the caller counts the miss): collision_misses and the
 * admission rule's measured regret when key was evicted lately. */
void smoe_slots_missed(smoe_slots *t, int32_t key);

/* The load into LOADING slot s finished: READY (bytes_read counted). */
void smoe_slots_loaded(smoe_slots *t, uint32_t s);

/* Drop one pin of slot s (release's step; a demand claim starts with its acquirer's pin). */
void smoe_slots_unpin(smoe_slots *t, uint32_t s);

/* A demand access to READY slot s (a hit, or a late access after its load): on_access, the
 * slot's last pass and tick, prefetch_used when a prefetch brought it.  Pins nothing. */
void smoe_slots_touch(smoe_slots *t, uint32_t s);

/* Set the pass id (> the previous one) and tell the policy (on_pass): begin_pass for a caller
 * that numbers its passes itself. */
void smoe_slots_set_pass(smoe_slots *t, uint64_t pass_id);

/* The current pass's token prior for the policy (policy.h on_prior; NULL: unknown), after
 * smoe_slots_set_pass and before the pass's first access; same locking as set_pass. */
void smoe_slots_set_prior(smoe_slots *t, const float *prior);

/* Queue prefetch requests.  A request for a key already queued updates its priority
 * (supersedes); a key resident or loading is skipped.  replace != 0 cancels all queued
 * requests first.  The worker loads into free slots or evictable ones, never evicting a
 * pinned expert or one accessed in the current pass. */
int smoe_slots_prefetch(smoe_slots *t, const int32_t *keys, const float *priorities,
                        uint32_t n, int replace, smoe_err *err);

/* smoe_slots_prefetch with, for the admission rule (admit.h), each request's probability of
 * use probs[i] (NULL: unknown) and the layer steps ahead where its key is needed (one value
 * for the call: the engine predicts one layer ahead).  probs[i] must be NaN (unknown) or in
 * [0, 1]. */
int smoe_slots_prefetch_p(smoe_slots *t, const int32_t *keys, const float *priorities,
                          const float *probs, uint32_t steps, uint32_t n, int replace,
                          smoe_err *err);

/* Prefetch admission on or off (admit.h; off by default: the victim rules alone), with its
 * byte budget (byte_budget != 0, the default) or the time terms alone.  Takes mu.  Turning it
 * on keeps what has been measured. */
void smoe_slots_set_admission(smoe_slots *t, int on, int byte_budget);

/* Remove queued requests for key (-1: all).  Loads already in flight complete. */
void smoe_slots_cancel(smoe_slots *t, int32_t key);

/* Block until the queue is empty and the worker idle (tests and benchmarks). */
void smoe_slots_wait_idle(smoe_slots *t);

/* Pause (paused != 0) or resume the worker: while paused it starts no new load (a load in
 * flight completes) and requests stay queued; wait_idle then waits only for the in-flight
 * load.  Lets tests and callers batch requests, cancel or reprioritise them deterministically. */
void smoe_slots_pause_worker(smoe_slots *t, int paused);

/* Number of queued prefetch requests. */
uint32_t smoe_slots_queue_len(smoe_slots *t);

/* If a prefetch load failed since the last call, copy the first such error into err, forget
 * it and return its code; 0 otherwise. */
int smoe_slots_take_worker_error(smoe_slots *t, smoe_err *err);

/* Replace the policy keeping the contents (ownership of p passes to the table, also on
 * failure).  The new policy gets on_insert(s, key, 0) for every resident slot (READY or
 * LOADING), oldest last_tick first.  p must have been built for this table's nslots,
 * num_layers and num_experts (SMOE_EINVAL otherwise). */
int smoe_slots_set_policy(smoe_slots *t, smoe_policy *p, smoe_err *err);

/* Keys of the READY slots, in slot order, into keys (room for nslots); returns the count. */
uint32_t smoe_slots_resident(smoe_slots *t, int32_t *keys);

/* The queued prefetch requests' keys and priorities, in the worker's order (highest priority
 * first, then request order), into keys / prios (room for num_layers * num_experts, the
 * queue's bound); returns the count.  A snapshot under mu, for tests and diagnostics. */
uint32_t smoe_slots_queued(smoe_slots *t, int32_t *keys, float *prios);

/* states[e] = the SMOE_SLOT_* state of expert (layer, e)'s slot now (SMOE_SLOT_EMPTY when it
 * has none), for e in 0..num_experts-1, under one hold of mu (a snapshot: the prefetch worker
 * may evict or finish loading right after).  SMOE_EINVAL for a layer out of range. */
int smoe_slots_layer_states(smoe_slots *t, uint32_t layer, uint8_t *states, smoe_err *err);

/* mask[e] = 1 when expert (layer, e) is READY now, else 0 (absent or still loading): the
 * states above reduced to READY or not. */
int smoe_slots_resident_mask(smoe_slots *t, uint32_t layer, uint8_t *mask, smoe_err *err);

/* Activation counts of one verification pass for the policy (policy.h on_counts: counts[i]
 * tokens of the pass activate keys[i]; the layers of the listed keys are observed).  Takes mu;
 * a no-op for a policy without on_counts.  Keys out of range: SMOE_EINVAL (nothing fed). */
int smoe_slots_counts(smoe_slots *t, const int32_t *keys, const uint32_t *counts, uint32_t n,
                      smoe_err *err);

/* The policy's current utility of each key into out[0..n-1] (under mu).  SMOE_EPOLICY when
 * the policy has no utility; SMOE_EINVAL for a key out of range. */
int smoe_slots_utility(smoe_slots *t, const int32_t *keys, int32_t *out, uint32_t n,
                       smoe_err *err);

/* Lookahead-aware eviction (MoE-SpeQ Sec. 3, the expert lookahead buffer; any policy): the n
 * keys become the protected set (replacing the previous one; n = 0 clears it).  A victim is
 * then first sought among the evictable slots holding unprotected keys, and only when the
 * policy finds none there among all evictable slots (counted in protected_evictions).
 * SMOE_EINVAL on a key out of range (the set is unchanged).  Takes mu. */
int smoe_slots_set_protected(smoe_slots *t, const int32_t *keys, uint32_t n, smoe_err *err);

void smoe_slots_get_stats(smoe_slots *t, smoe_cache_stats *out);

/* A snapshot of the admission rule's switch, estimates and refusals (admit.h), under mu. */
void smoe_slots_get_admission(smoe_slots *t, smoe_admit *out);
void smoe_slots_reset_stats(smoe_slots *t);

#endif

/* GPU fast tier (issue 12 item 2): expert blocks cached in GPU memory, the slow tier in host
 * memory (a pinned copy of the whole store, or the store file read into a few pinned staging
 * buffers), loads copied by cudaMemcpyAsync on the cache's own copy stream.
 *
 * Bookkeeping is that of the CPU cache (csrc/cache.h): the same slot states, key map, pins,
 * policy events (the same csrc/policy objects), statistics, prefetch queue (max-heap on
 * (priority, -seq), supersede, replace) and the same victim rules for demand and prefetch.
 * What differs is where the bytes go and who waits:
 *  - slots live in ONE device allocation of nslots * block_bytes made at init;
 *  - a load enqueues the host-to-device copy on the copy stream and records the slot's
 *    `ready` event after it; the slot is READY for the bookkeeping as soon as the copy is
 *    enqueued (in staged mode, after the store read into the staging buffer);
 *  - acquire(stream) makes `stream` wait on the slot's ready event (cudaStreamWaitEvent): the
 *    compute stream waits on the GPU, never on the host;
 *  - release(stream) records the slot's `free` event on `stream`; a later copy into that slot
 *    first makes the copy stream wait on it, so a slot is never overwritten while a kernel
 *    enqueued before the release still reads it.  All users of one cache should enqueue their
 *    work on one compute stream (the free event keeps only the latest release).
 *  - stall_s counts host time blocked in acquire (staged store reads, slot waits); time the
 *    GPU waits on a copy is not seen by the host: `inflight_hits` counts hits whose copy had
 *    not completed yet (cudaEventQuery) as a proxy.
 *
 * device < 0 selects HOST EMULATION: the slab, staging and host copy are plain host memory,
 * copies are memcpy, events are no-ops.  It exists so that the bookkeeping above (identical
 * code) is tested on machines without a GPU; the CUDA calls are exercised only on a GPU.
 *
 * Locking: `mu` guards every field marked [mu] (as in cache.h); `stage_mu` guards the staging
 * buffers' busy flags and is never held together with mu.  CUDA calls made under mu are
 * non-blocking ones (event record, stream wait, async copy enqueue, event query).
 */
#ifndef SMOE_GCACHE_H
#define SMOE_GCACHE_H

#include <pthread.h>

#include "common.h"
#include "policy/policy.h"
#include "store.h"

enum { SMOE_GC_HOSTCOPY = 0, SMOE_GC_STAGED = 1 };

typedef struct smoe_gslot {
    int32_t key;         /* [mu] -1 when empty */
    uint8_t state;       /* [mu] SMOE_SLOT_* values of cache.h (0 empty, 1 loading, 2 ready) */
    uint8_t prefetched;  /* [mu] */
    int32_t pins;        /* [mu] */
    uint64_t last_pass;  /* [mu] */
    uint64_t last_tick;  /* [mu] */
    uint32_t load_seq;   /* [mu] */
    uint32_t failed_seq; /* [mu] */
} smoe_gslot;

typedef struct smoe_gcache_stats {
    uint64_t hits, misses, collision_misses;
    uint64_t prefetch_issued, prefetch_used, prefetch_late, prefetch_wasted, prefetch_dropped,
        prefetch_failed;
    uint64_t evictions;
    uint64_t bytes_read;    /* bytes copied to the device (one block per load) */
    uint64_t inflight_hits; /* hits whose copy was still in flight at acquire */
    double stall_s;
} smoe_gcache_stats;

typedef struct smoe_gstage {
    uint8_t *host; /* pinned, block_bytes */
    void *done;    /* cudaEvent_t: the last copy out of this buffer */
    int busy;      /* [stage_mu] */
} smoe_gstage;

typedef struct smoe_gprefetch_req {
    int32_t key;
    float priority;
    uint64_t seq;
} smoe_gprefetch_req;

typedef struct smoe_gcache {
    pthread_mutex_t mu;
    pthread_cond_t cv, work_cv, idle_cv;
    pthread_mutex_t stage_mu;
    pthread_cond_t stage_cv;

    smoe_store *store; /* borrowed */
    int device;        /* CUDA device, or -1: host emulation */
    int mode;          /* SMOE_GC_* */
    uint32_t num_layers, num_experts, nslots;
    uint64_t slot_bytes;
    uint8_t *slab;       /* owned: device memory (host memory in emulation) */
    uint8_t *host_copy;  /* owned, HOSTCOPY mode: pinned copy of every block */
    smoe_gstage *stages; /* owned, STAGED mode */
    uint32_t nstages;
    void *copy_stream;   /* owned cudaStream_t (non-blocking) */
    void **ready_ev;     /* owned, per slot cudaEvent_t */
    void **free_ev;      /* owned, per slot cudaEvent_t */

    smoe_gslot *slots;      /* [mu] */
    smoe_err *slot_err;     /* [mu] */
    int32_t *map;           /* [mu] key -> slot */
    uint64_t *evicted_pass; /* [mu] */
    smoe_policy *policy;    /* [mu] owned */
    smoe_gcache_stats stats;/* [mu] */
    uint64_t pass_id, tick; /* [mu] */
    uint32_t waiters;       /* [mu] */
    int32_t *qpos;          /* [mu] */
    int32_t pf_key;         /* [mu] */

    pthread_t worker;
    int worker_started, shutdown, worker_busy, worker_paused; /* [mu] except worker_started */
    smoe_gprefetch_req *queue; /* [mu] */
    uint32_t queue_len, queue_cap;
    uint64_t queue_seq;
    smoe_err worker_err; /* [mu] */
} smoe_gcache;

/* Create the cache: one device allocation of nslots blocks, per-slot events, the copy stream,
 * and (HOSTCOPY) the pinned copy of the whole store read now, or (STAGED) nstages pinned
 * staging buffers.  Ownership of policy passes to the cache on success. */
int smoe_gcache_init(smoe_gcache *c, smoe_store *store, int device, uint32_t nslots,
                     uint32_t min_slots, smoe_policy *policy, int mode, uint32_t nstages,
                     int prefetch_worker, smoe_err *err);
void smoe_gcache_free(smoe_gcache *c);

/* Pin (layer, expert) and return its device address; `stream` (cudaStream_t) is made to wait
 * on the slot's copy.  Blocks the host only on a staged store read or when every slot is
 * pinned.  Call without the GIL. */
int smoe_gcache_acquire(smoe_gcache *c, uint32_t layer, uint32_t expert, void *stream,
                        const uint8_t **data, smoe_err *err);
/* Record the slot's free event on `stream`, then drop one pin. */
int smoe_gcache_release(smoe_gcache *c, uint32_t layer, uint32_t expert, void *stream,
                        smoe_err *err);
void smoe_gcache_begin_pass(smoe_gcache *c);
int smoe_gcache_prefetch(smoe_gcache *c, const int32_t *keys, const float *priorities,
                         uint32_t n, int replace, smoe_err *err);
void smoe_gcache_cancel(smoe_gcache *c, int32_t key);
/* Queue empty and worker idle, then the copy stream drained. */
int smoe_gcache_wait_idle(smoe_gcache *c, smoe_err *err);
void smoe_gcache_pause_worker(smoe_gcache *c, int paused);
int smoe_gcache_take_worker_error(smoe_gcache *c, smoe_err *err);
int smoe_gcache_set_policy(smoe_gcache *c, smoe_policy *p, smoe_err *err);
int smoe_gcache_counts(smoe_gcache *c, const int32_t *keys, const uint32_t *counts, uint32_t n,
                       smoe_err *err);
uint32_t smoe_gcache_resident(smoe_gcache *c, int32_t *keys);
void smoe_gcache_get_stats(smoe_gcache *c, smoe_gcache_stats *out);
void smoe_gcache_reset_stats(smoe_gcache *c);

#endif

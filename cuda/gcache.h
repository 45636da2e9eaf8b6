/* GPU fast tier (issue 12 item 2): expert blocks cached in GPU memory, the slow tier in host
 * memory (a pinned copy of the whole store, or the store file read into a few pinned staging
 * buffers), loads copied by cudaMemcpyAsync on the cache's own copy stream.
 *
 * Bookkeeping is the CPU cache's, by the same code: the slot table of csrc/slots.h (slot
 * states, key map, pins, policy events with the same csrc/policy objects, statistics, the
 * prefetch queue and worker, the victim rules for demand and prefetch).  This file supplies
 * only the table's ops (slots.h smoe_slots_ops): the load, and what happens when a slot is
 * pinned or released.  The table's functions (smoe_slots_begin_pass, _prefetch, _cancel,
 * _pause_worker, _take_worker_error, _set_policy, _counts, _utility, _resident, ...) are
 * called on &c->tab directly.
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
 * copies are memcpy, events are no-ops.  It exists so that the bookkeeping above (the same
 * code as the CPU cache's) is tested with these ops on machines without a GPU; the CUDA calls
 * are exercised only on a GPU.
 *
 * Locking: `tab.mu` guards every field of the table marked [mu] (slots.h) and
 * `inflight_hits`; ops.pinned / ops.released run under tab.mu and make only non-blocking CUDA
 * calls (event record, stream wait, event query).  `stage_mu` guards the staging buffers' busy
 * flags; it is taken only inside ops.load, with tab.mu released, so the two are never held
 * together.  Everything else is set by init and read-only until free.
 */
#ifndef SMOE_GCACHE_H
#define SMOE_GCACHE_H

#include "common.h"
#include "link.h"
#include "policy/policy.h"
#include "slots.h"
#include "store.h"

enum { SMOE_GC_HOSTCOPY = 0, SMOE_GC_STAGED = 1 };

typedef struct smoe_gcache_stats {
    smoe_cache_stats c;     /* the table's counters (bytes_read: bytes copied to the device) */
    uint64_t inflight_hits; /* hits whose copy was still in flight at acquire */
} smoe_gcache_stats;

typedef struct smoe_gstage {
    uint8_t *host; /* pinned, block_bytes */
    void *done;    /* cudaEvent_t: the last copy out of this buffer */
    int busy;      /* [stage_mu] */
} smoe_gstage;

typedef struct smoe_gcache {
    smoe_slots tab;    /* the bookkeeping; tab.slot_bytes == store->block_bytes */
    pthread_mutex_t stage_mu;
    pthread_cond_t stage_cv; /* a staging buffer became free */

    smoe_store *store; /* borrowed */
    int device;        /* CUDA device, or -1: host emulation */
    int mode;          /* SMOE_GC_* */
    uint8_t *slab;       /* owned: device memory (host memory in emulation) */
    uint8_t *host_copy;  /* owned, HOSTCOPY mode: pinned copy of every block */
    smoe_gstage *stages; /* owned, STAGED mode */
    uint32_t nstages;
    void *copy_stream;   /* owned cudaStream_t (non-blocking) */
    void **ready_ev;     /* owned, per slot cudaEvent_t */
    void **free_ev;      /* owned, per slot cudaEvent_t */
    uint64_t inflight_hits; /* [tab.mu] see smoe_gcache_stats */
    smoe_link link;         /* the emulated link of every load (link.h; its own lock) */
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
/* Queue empty and worker idle, then the copy stream drained. */
int smoe_gcache_wait_idle(smoe_gcache *c, smoe_err *err);
void smoe_gcache_get_stats(smoe_gcache *c, smoe_gcache_stats *out);
/* Emulate a slower link (SpecMD A.4, as the CPU cache's smoe_cache_set_throttle): every load,
 * demand or prefetch, returns no earlier than latency_s + block_bytes / bytes_per_s after the
 * link is free; 0/0 off. */
int smoe_gcache_set_throttle(smoe_gcache *c, double bytes_per_s, double latency_s,
                             smoe_err *err);
void smoe_gcache_reset_stats(smoe_gcache *c);

#endif

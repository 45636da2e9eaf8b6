/* GPU fast tier: the slot table of csrc/slots.c (the CPU cache's bookkeeping, same code) with
 * slots in device memory and loads as cudaMemcpyAsync on a copy stream, ordered by per-slot
 * events (gcache.h).  This file holds only the table's ops and the device resources. */
#include "gcache.h"

#include <cuda_runtime_api.h>
#include <stdlib.h>
#include <string.h>

/* ---- device operations (host emulation when c->device < 0) -------------------------------- */

static int cu_fail(smoe_err *err, cudaError_t e, const char *what) {
    return smoe_err_set(err, SMOE_EDEVICE, "GPU cache: %s failed: %s (%s)", what,
                        cudaGetErrorName(e), cudaGetErrorString(e));
}

static int emu(const smoe_gcache *c) { return c->device < 0; }

/* Enqueue the copy of one block into slot s: the copy stream first waits for the slot's last
 * user (free event), then copies, then records the slot's ready event. */
static int dev_copy_to_slot(smoe_gcache *c, uint32_t s, const uint8_t *src, smoe_err *err) {
    uint8_t *dst = c->slab + (uint64_t)s * c->tab.slot_bytes;
    if (emu(c)) {
        memcpy(dst, src, c->tab.slot_bytes);
        return 0;
    }
    cudaStream_t st = (cudaStream_t)c->copy_stream;
    cudaError_t e = cudaStreamWaitEvent(st, (cudaEvent_t)c->free_ev[s], 0);
    if (e == cudaSuccess)
        e = cudaMemcpyAsync(dst, src, c->tab.slot_bytes, cudaMemcpyHostToDevice, st);
    if (e == cudaSuccess) e = cudaEventRecord((cudaEvent_t)c->ready_ev[s], st);
    return e == cudaSuccess ? 0 : cu_fail(err, e, "enqueueing a host-to-device copy");
}

/* ---- the table's ops (slots.h) -------------------------------------------------------------- */

/* ops.load (tab.mu NOT held): enqueue the copy of key's block into slot s; in STAGED mode the
 * store read into a staging buffer happens here, in the calling thread. */
static int gcache_load_now(smoe_gcache *c, uint32_t s, int32_t key, smoe_err *err) {
    const uint32_t ne = c->tab.num_experts;
    uint32_t layer = (uint32_t)key / ne, expert = (uint32_t)key % ne;
    if (c->mode == SMOE_GC_HOSTCOPY)
        return dev_copy_to_slot(c, s, c->host_copy + (uint64_t)key * c->tab.slot_bytes, err);
    /* STAGED: a free staging buffer, its previous copy finished, store read, async copy */
    pthread_mutex_lock(&c->stage_mu);
    smoe_gstage *st = NULL;
    for (;;) {
        for (uint32_t i = 0; i < c->nstages && !st; i++)
            if (!c->stages[i].busy) st = &c->stages[i];
        if (st) break;
        pthread_cond_wait(&c->stage_cv, &c->stage_mu);
    }
    st->busy = 1;
    pthread_mutex_unlock(&c->stage_mu);
    int rc = 0;
    if (!emu(c)) {
        cudaError_t e = cudaEventSynchronize((cudaEvent_t)st->done);
        if (e != cudaSuccess) rc = cu_fail(err, e, "waiting for a staging buffer's copy");
    }
    if (rc == 0) rc = smoe_store_read(c->store, layer, expert, st->host, err);
    if (rc == 0) rc = dev_copy_to_slot(c, s, st->host, err);
    if (rc == 0 && !emu(c)) {
        cudaError_t e = cudaEventRecord((cudaEvent_t)st->done, (cudaStream_t)c->copy_stream);
        if (e != cudaSuccess) rc = cu_fail(err, e, "recording a staging buffer's event");
    }
    pthread_mutex_lock(&c->stage_mu);
    st->busy = 0;
    pthread_cond_signal(&c->stage_cv);
    pthread_mutex_unlock(&c->stage_mu);
    return rc;
}

/* ops.load: gcache_load_now, returning no earlier than the emulated link allows (link.h: a
 * throttle makes the demand thread or the worker wait as a slower link would). */
static int gcache_load(void *owner, uint32_t s, int32_t key, smoe_err *err) {
    smoe_gcache *c = owner;
    double until = smoe_link_reserve(&c->link, c->tab.slot_bytes);
    int rc = gcache_load_now(c, s, key, err);
    smoe_link_wait(until);
    return rc;
}

int smoe_gcache_set_throttle(smoe_gcache *c, double bytes_per_s, double latency_s,
                             smoe_err *err) {
    return smoe_link_set(&c->link, bytes_per_s, latency_s, err);
}

/* ops.pinned (tab.mu held): make `stream` wait for slot s's copy; count a hit whose copy is
 * still in flight. */
static int gcache_pinned(void *owner, uint32_t s, void *stream, int hit, smoe_err *err) {
    smoe_gcache *c = owner;
    if (emu(c)) return 0;
    cudaEvent_t ev = (cudaEvent_t)c->ready_ev[s];
    if (hit && cudaEventQuery(ev) == cudaErrorNotReady) c->inflight_hits++;
    cudaError_t e = cudaStreamWaitEvent((cudaStream_t)stream, ev, 0);
    return e == cudaSuccess ? 0 : cu_fail(err, e, "cudaStreamWaitEvent on a slot's copy");
}

/* ops.released (tab.mu held): record slot s's free event on `stream`; the next copy into the
 * slot waits for it. */
static int gcache_released(void *owner, uint32_t s, void *stream, smoe_err *err) {
    smoe_gcache *c = owner;
    if (emu(c)) return 0;
    cudaError_t e = cudaEventRecord((cudaEvent_t)c->free_ev[s], (cudaStream_t)stream);
    return e == cudaSuccess ? 0 : cu_fail(err, e, "recording a slot's free event");
}

/* ops.worker_begin: the runtime's current device is per thread. */
static void gcache_worker_begin(void *owner) {
    smoe_gcache *c = owner;
    if (!emu(c)) cudaSetDevice(c->device);
}

static const smoe_slots_ops gcache_ops = {.load = gcache_load,
                                          .pinned = gcache_pinned,
                                          .released = gcache_released,
                                          .worker_begin = gcache_worker_begin};

/* ---- lifetime -------------------------------------------------------------------------------- */

static void host_free(const smoe_gcache *c, void *p) {
    if (!p) return;
    if (emu(c))
        free(p);
    else
        cudaFreeHost(p);
}

static int host_alloc(const smoe_gcache *c, void **p, size_t bytes, smoe_err *err) {
    *p = NULL;
    if (emu(c)) {
        if (posix_memalign(p, SMOE_ALIGN, bytes) != 0) *p = NULL;
        if (!*p)
            return smoe_err_set(err, SMOE_ENOMEM, "GPU cache: cannot allocate %zu host bytes",
                                bytes);
        return 0;
    }
    cudaError_t e = cudaHostAlloc(p, bytes, cudaHostAllocDefault);
    if (e != cudaSuccess) {
        *p = NULL;
        return smoe_err_set(err, SMOE_ENOMEM, "GPU cache: cannot allocate %zu bytes of pinned "
                            "host memory: %s", bytes, cudaGetErrorString(e));
    }
    return 0;
}

/* Free what init_device and init allocated beside the table (whatever part of it exists). */
static void free_device(smoe_gcache *c) {
    if (c->slab) {
        if (emu(c))
            free(c->slab);
        else
            cudaFree(c->slab);
    }
    host_free(c, c->host_copy);
    if (c->stages) {
        for (uint32_t i = 0; i < c->nstages; i++) {
            host_free(c, c->stages[i].host);
            if (c->stages[i].done) cudaEventDestroy((cudaEvent_t)c->stages[i].done);
        }
        free(c->stages);
    }
    for (uint32_t s = 0; s < c->tab.nslots; s++) {
        if (c->ready_ev && c->ready_ev[s]) cudaEventDestroy((cudaEvent_t)c->ready_ev[s]);
        if (c->free_ev && c->free_ev[s]) cudaEventDestroy((cudaEvent_t)c->free_ev[s]);
    }
    free(c->ready_ev);
    free(c->free_ev);
    if (c->copy_stream) cudaStreamDestroy((cudaStream_t)c->copy_stream);
}

static int init_device(smoe_gcache *c, smoe_err *err) {
    size_t slab_bytes = (size_t)c->tab.nslots * c->tab.slot_bytes;
    if (emu(c)) {
        void *p = NULL;
        if (posix_memalign(&p, SMOE_ALIGN, slab_bytes) != 0) p = NULL;
        c->slab = p;
        return p ? 0 : smoe_err_set(err, SMOE_ENOMEM, "GPU cache (emulated): cannot allocate "
                                    "%zu bytes", slab_bytes);
    }
    cudaError_t e = cudaSetDevice(c->device);
    if (e != cudaSuccess) return cu_fail(err, e, "cudaSetDevice");
    void *p = NULL;
    e = cudaMalloc(&p, slab_bytes);
    if (e != cudaSuccess)
        return smoe_err_set(err, SMOE_ENOMEM, "GPU cache: cannot allocate %u slots of %llu "
                            "bytes (%zu bytes) on device %d: %s", c->tab.nslots,
                            (unsigned long long)c->tab.slot_bytes, slab_bytes, c->device,
                            cudaGetErrorString(e));
    c->slab = p;
    cudaStream_t st;
    e = cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
    if (e != cudaSuccess) return cu_fail(err, e, "creating the copy stream");
    c->copy_stream = st;
    c->ready_ev = calloc(c->tab.nslots, sizeof *c->ready_ev);
    c->free_ev = calloc(c->tab.nslots, sizeof *c->free_ev);
    if (!c->ready_ev || !c->free_ev)
        return smoe_err_set(err, SMOE_ENOMEM, "GPU cache: out of memory for events");
    for (uint32_t s = 0; s < c->tab.nslots; s++) {
        cudaEvent_t a, b;
        if ((e = cudaEventCreateWithFlags(&a, cudaEventDisableTiming)) != cudaSuccess)
            return cu_fail(err, e, "cudaEventCreate");
        c->ready_ev[s] = a;
        if ((e = cudaEventCreateWithFlags(&b, cudaEventDisableTiming)) != cudaSuccess)
            return cu_fail(err, e, "cudaEventCreate");
        c->free_ev[s] = b;
    }
    return 0;
}

int smoe_gcache_init(smoe_gcache *c, smoe_store *store, int device, uint32_t nslots,
                     uint32_t min_slots, smoe_policy *policy, int mode, uint32_t nstages,
                     int prefetch_worker, smoe_err *err) {
    memset(c, 0, sizeof *c);
    if (!store || !policy)
        return smoe_err_set(err, SMOE_EINVAL, "GPU cache: store and policy are required");
    if (mode != SMOE_GC_HOSTCOPY && mode != SMOE_GC_STAGED)
        return smoe_err_set(err, SMOE_EINVAL, "GPU cache: unknown slow-tier mode %d", mode);
    if (mode == SMOE_GC_STAGED && (nstages == 0 || nstages > 64))
        return smoe_err_set(err, SMOE_EINVAL, "GPU cache: staging buffers %u must be in 1..64",
                            nstages);
    int rc = smoe_slots_init(&c->tab, "GPU cache", store->num_layers, store->num_experts,
                             store->block_bytes, nslots, min_slots, policy, &gcache_ops, c, err);
    if (rc < 0) return rc;
    pthread_mutex_init(&c->stage_mu, NULL);
    smoe_link_init(&c->link, err); /* (a mutex: fails only where stage_mu's would) */
    pthread_cond_init(&c->stage_cv, NULL);
    c->store = store;
    c->device = device;
    c->mode = mode;
    const uint64_t nkeys = (uint64_t)store->num_layers * store->num_experts;
    rc = init_device(c, err);
    if (rc == 0 && mode == SMOE_GC_HOSTCOPY) {
        void *p = NULL;
        rc = host_alloc(c, &p, (size_t)(nkeys * store->block_bytes), err);
        c->host_copy = p;
        for (uint64_t k = 0; rc == 0 && k < nkeys; k++)
            rc = smoe_store_read(store, (uint32_t)(k / store->num_experts),
                                 (uint32_t)(k % store->num_experts),
                                 c->host_copy + k * store->block_bytes, err);
    }
    if (rc == 0 && mode == SMOE_GC_STAGED) {
        c->stages = calloc(nstages, sizeof *c->stages);
        if (!c->stages) rc = smoe_err_set(err, SMOE_ENOMEM, "GPU cache: out of memory");
        else c->nstages = nstages;
        for (uint32_t i = 0; rc == 0 && i < nstages; i++) {
            void *p = NULL;
            rc = host_alloc(c, &p, (size_t)store->block_bytes, err);
            c->stages[i].host = p;
            if (rc == 0 && !emu(c)) {
                cudaEvent_t ev;
                cudaError_t e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
                if (e != cudaSuccess) rc = cu_fail(err, e, "cudaEventCreate");
                else c->stages[i].done = ev;
            }
        }
    }
    if (rc == 0 && prefetch_worker) rc = smoe_slots_start_worker(&c->tab, err);
    if (rc < 0) {
        c->tab.policy = NULL; /* stays with the caller on failure */
        smoe_gcache_free(c);
        return rc;
    }
    return 0;
}

void smoe_gcache_free(smoe_gcache *c) {
    if (!c->tab.slots) return;
    smoe_slots_stop_worker(&c->tab); /* no load in flight from here on */
    if (!emu(c) && c->copy_stream) cudaStreamSynchronize((cudaStream_t)c->copy_stream);
    free_device(c);
    pthread_mutex_destroy(&c->stage_mu);
    pthread_cond_destroy(&c->stage_cv);
    smoe_link_free(&c->link);
    smoe_slots_free(&c->tab);
    memset(c, 0, sizeof *c);
}

/* ---- demand path ---------------------------------------------------------------------------- */

int smoe_gcache_acquire(smoe_gcache *c, uint32_t layer, uint32_t expert, void *stream,
                        const uint8_t **data, smoe_err *err) {
    if (!emu(c)) cudaSetDevice(c->device);
    uint32_t s = 0;
    int rc = smoe_slots_acquire(&c->tab, layer, expert, stream, &s, err);
    if (rc == 0) *data = c->slab + (uint64_t)s * c->tab.slot_bytes;
    return rc;
}

int smoe_gcache_release(smoe_gcache *c, uint32_t layer, uint32_t expert, void *stream,
                        smoe_err *err) {
    return smoe_slots_release(&c->tab, layer, expert, stream, err);
}

int smoe_gcache_wait_idle(smoe_gcache *c, smoe_err *err) {
    smoe_slots_wait_idle(&c->tab);
    if (emu(c)) return 0;
    cudaError_t e = cudaStreamSynchronize((cudaStream_t)c->copy_stream);
    return e == cudaSuccess ? 0 : cu_fail(err, e, "synchronizing the copy stream");
}

void smoe_gcache_get_stats(smoe_gcache *c, smoe_gcache_stats *out) {
    pthread_mutex_lock(&c->tab.mu);
    out->c = c->tab.stats;
    out->inflight_hits = c->inflight_hits;
    pthread_mutex_unlock(&c->tab.mu);
}

void smoe_gcache_reset_stats(smoe_gcache *c) {
    pthread_mutex_lock(&c->tab.mu);
    memset(&c->tab.stats, 0, sizeof c->tab.stats);
    c->inflight_hits = 0;
    pthread_mutex_unlock(&c->tab.mu);
}

/* GPU fast tier: the bookkeeping of csrc/cache.c (same states, policy events, statistics and
 * prefetch rules; see cache.h for the exact behaviour) with slots in device memory and loads
 * as cudaMemcpyAsync on a copy stream, ordered by per-slot events (gcache.h). */
#include "gcache.h"

#include <cuda_runtime_api.h>
#include <stdlib.h>
#include <string.h>

#include "cache.h" /* SMOE_SLOT_* */

/* ---- device operations (host emulation when c->device < 0) -------------------------------- */

static int cu_fail(smoe_err *err, cudaError_t e, const char *what) {
    return smoe_err_set(err, SMOE_ESTATE, "GPU cache: %s failed: %s (%s)", what,
                        cudaGetErrorName(e), cudaGetErrorString(e));
}

static int emu(const smoe_gcache *c) { return c->device < 0; }

/* Enqueue the copy of one block into slot s: the copy stream first waits for the slot's last
 * user (free event), then copies, then records the slot's ready event. */
static int dev_copy_to_slot(smoe_gcache *c, uint32_t s, const uint8_t *src, smoe_err *err) {
    uint8_t *dst = c->slab + (uint64_t)s * c->slot_bytes;
    if (emu(c)) {
        memcpy(dst, src, c->slot_bytes);
        return 0;
    }
    cudaStream_t st = (cudaStream_t)c->copy_stream;
    cudaError_t e = cudaStreamWaitEvent(st, (cudaEvent_t)c->free_ev[s], 0);
    if (e == cudaSuccess)
        e = cudaMemcpyAsync(dst, src, c->slot_bytes, cudaMemcpyHostToDevice, st);
    if (e == cudaSuccess) e = cudaEventRecord((cudaEvent_t)c->ready_ev[s], st);
    return e == cudaSuccess ? 0 : cu_fail(err, e, "enqueueing a host-to-device copy");
}

/* ---- helpers under mu (as cache.c) --------------------------------------------------------- */

static int policy_failed(smoe_gcache *c, smoe_err *err) {
    if (c->policy->failure.code == 0) return 0;
    smoe_err_set(err, SMOE_EPOLICY, "policy %s: %s", c->policy->ops->name,
                 c->policy->failure.msg);
    smoe_err_clear(&c->policy->failure);
    return SMOE_EPOLICY;
}

static int evictable_demand(void *ctx, uint32_t s) {
    const smoe_gcache *c = ctx;
    return s < c->nslots && c->slots[s].state == SMOE_SLOT_READY && c->slots[s].pins == 0;
}

static int evictable_prefetch(void *ctx, uint32_t s) {
    const smoe_gcache *c = ctx;
    if (!evictable_demand(ctx, s) || c->slots[s].last_pass == c->pass_id) return 0;
    if (c->policy->ops->utility &&
        smoe_policy_utility(c->policy, c->slots[s].key) > smoe_policy_utility(c->policy, c->pf_key))
        return 0;
    return 1;
}

static int32_t lowest_free(const smoe_gcache *c) {
    for (uint32_t s = 0; s < c->nslots; s++)
        if (c->slots[s].state == SMOE_SLOT_EMPTY) return (int32_t)s;
    return -1;
}

static void evict(smoe_gcache *c, uint32_t s) {
    smoe_gslot *sl = &c->slots[s];
    int32_t key = sl->key;
    smoe_policy_evict(c->policy, s, key);
    c->map[key] = -1;
    c->evicted_pass[key] = c->pass_id;
    c->stats.evictions++;
    if (sl->prefetched) c->stats.prefetch_wasted++;
    sl->key = -1;
    sl->state = SMOE_SLOT_EMPTY;
    sl->prefetched = 0;
}

static int32_t take_slot(smoe_gcache *c, smoe_evictable_fn ok, int *rc, smoe_err *err) {
    *rc = 0;
    int32_t s = lowest_free(c);
    if (s >= 0) return s;
    s = smoe_policy_victim(c->policy, ok, c);
    if ((*rc = policy_failed(c, err)) < 0) return -1;
    if (s < 0) return -1;
    if ((uint32_t)s >= c->nslots || !ok(c, (uint32_t)s)) {
        *rc = smoe_err_set(err, SMOE_EPOLICY, "policy %s returned slot %d, which is not an "
                           "evictable slot of this %u-slot GPU cache", c->policy->ops->name,
                           (int)s, c->nslots);
        return -1;
    }
    evict(c, (uint32_t)s);
    return s;
}

static void load_begin(smoe_gcache *c, uint32_t s, int32_t key, int prefetch) {
    smoe_gslot *sl = &c->slots[s];
    smoe_policy_insert(c->policy, s, key, prefetch);
    sl->key = key;
    sl->state = SMOE_SLOT_LOADING;
    sl->prefetched = (uint8_t)(prefetch != 0);
    sl->pins = prefetch ? 0 : 1;
    sl->last_pass = prefetch ? 0 : c->pass_id;
    sl->last_tick = ++c->tick;
    sl->load_seq++;
    if (sl->load_seq == 0) sl->load_seq = 1;
    c->map[key] = (int32_t)s;
}

static void load_done(smoe_gcache *c, uint32_t s, int rc, const smoe_err *lerr) {
    smoe_gslot *sl = &c->slots[s];
    if (rc == 0) {
        sl->state = SMOE_SLOT_READY;
        c->stats.bytes_read += c->slot_bytes;
    } else {
        int32_t key = sl->key;
        smoe_policy_evict(c->policy, s, key);
        c->map[key] = -1;
        sl->key = -1;
        sl->state = SMOE_SLOT_EMPTY;
        sl->prefetched = 0;
        sl->pins = 0;
        sl->failed_seq = sl->load_seq;
        c->slot_err[s] = *lerr;
        if (lerr->code == 0)
            smoe_err_set(&c->slot_err[s], rc, "loading expert (layer %u, expert %u) into the "
                         "GPU cache failed (code %d)", (uint32_t)key / c->num_experts,
                         (uint32_t)key % c->num_experts, rc);
    }
    if (c->waiters) pthread_cond_broadcast(&c->cv);
}

/* ---- the load itself (mu NOT held) ---------------------------------------------------------- */

static int load_block(smoe_gcache *c, uint32_t s, int32_t key, smoe_err *err) {
    uint32_t layer = (uint32_t)key / c->num_experts, expert = (uint32_t)key % c->num_experts;
    if (c->mode == SMOE_GC_HOSTCOPY)
        return dev_copy_to_slot(c, s, c->host_copy + (uint64_t)key * c->slot_bytes, err);
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

static int key_of(const smoe_gcache *c, uint32_t layer, uint32_t expert, int32_t *key,
                  smoe_err *err) {
    if (layer >= c->num_layers || expert >= c->num_experts)
        return smoe_err_set(err, SMOE_EINVAL, "expert (layer %u, expert %u) out of range: the "
                            "store has %u layers of %u experts", layer, expert, c->num_layers,
                            c->num_experts);
    *key = smoe_key(layer, expert, c->num_experts);
    return 0;
}

/* ---- prefetch queue (as cache.c) ------------------------------------------------------------ */

static int req_before(const smoe_gprefetch_req *a, const smoe_gprefetch_req *b) {
    if (a->priority != b->priority) return a->priority > b->priority;
    return a->seq < b->seq;
}

static void heap_set(smoe_gcache *c, uint32_t i, smoe_gprefetch_req r) {
    c->queue[i] = r;
    c->qpos[r.key] = (int32_t)i;
}

static void heap_up(smoe_gcache *c, uint32_t i) {
    smoe_gprefetch_req r = c->queue[i];
    while (i > 0) {
        uint32_t p = (i - 1) / 2;
        if (!req_before(&r, &c->queue[p])) break;
        heap_set(c, i, c->queue[p]);
        i = p;
    }
    heap_set(c, i, r);
}

static void heap_down(smoe_gcache *c, uint32_t i) {
    smoe_gprefetch_req r = c->queue[i];
    for (;;) {
        uint32_t l = 2 * i + 1, best = i;
        const smoe_gprefetch_req *bv = &r;
        if (l < c->queue_len && req_before(&c->queue[l], bv)) best = l, bv = &c->queue[l];
        if (l + 1 < c->queue_len && req_before(&c->queue[l + 1], bv)) best = l + 1;
        if (best == i) break;
        heap_set(c, i, c->queue[best]);
        i = best;
    }
    heap_set(c, i, r);
}

static void heap_remove_at(smoe_gcache *c, uint32_t i) {
    c->qpos[c->queue[i].key] = -1;
    c->queue_len--;
    if (i == c->queue_len) return;
    int32_t moved = c->queue[c->queue_len].key;
    heap_set(c, i, c->queue[c->queue_len]);
    heap_up(c, i);
    heap_down(c, (uint32_t)c->qpos[moved]);
}

static void heap_clear(smoe_gcache *c) {
    for (uint32_t i = 0; i < c->queue_len; i++) c->qpos[c->queue[i].key] = -1;
    c->queue_len = 0;
}

static void *worker_main(void *arg) {
    smoe_gcache *c = arg;
    if (!emu(c)) cudaSetDevice(c->device); /* the runtime's current device is per thread */
    pthread_mutex_lock(&c->mu);
    for (;;) {
        if (c->shutdown) break;
        if (c->queue_len == 0 || c->worker_paused) {
            c->worker_busy = 0;
            pthread_cond_broadcast(&c->idle_cv);
            pthread_cond_wait(&c->work_cv, &c->mu);
            continue;
        }
        c->worker_busy = 1;
        smoe_gprefetch_req r = c->queue[0];
        heap_remove_at(c, 0);
        if (c->map[r.key] >= 0) continue;
        smoe_err perr;
        int prc;
        c->pf_key = r.key;
        int32_t s = take_slot(c, evictable_prefetch, &prc, &perr);
        if (prc < 0) {
            if (c->worker_err.code == 0) c->worker_err = perr;
            c->stats.prefetch_dropped++;
            continue;
        }
        if (s < 0) {
            c->stats.prefetch_dropped++;
            continue;
        }
        load_begin(c, (uint32_t)s, r.key, 1);
        c->stats.prefetch_issued++;
        pthread_mutex_unlock(&c->mu);
        smoe_err lerr;
        smoe_err_clear(&lerr);
        int rc = load_block(c, (uint32_t)s, r.key, &lerr);
        pthread_mutex_lock(&c->mu);
        if (rc < 0) {
            c->stats.prefetch_failed++;
            if (c->worker_err.code == 0) c->worker_err = lerr;
        }
        load_done(c, (uint32_t)s, rc, &lerr);
        if (policy_failed(c, &perr) < 0 && c->worker_err.code == 0) c->worker_err = perr;
    }
    heap_clear(c);
    c->worker_busy = 0;
    pthread_cond_broadcast(&c->idle_cv);
    pthread_mutex_unlock(&c->mu);
    return NULL;
}

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

static void free_all(smoe_gcache *c) {
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
    for (uint32_t s = 0; s < c->nslots; s++) {
        if (c->ready_ev && c->ready_ev[s]) cudaEventDestroy((cudaEvent_t)c->ready_ev[s]);
        if (c->free_ev && c->free_ev[s]) cudaEventDestroy((cudaEvent_t)c->free_ev[s]);
    }
    free(c->ready_ev);
    free(c->free_ev);
    if (c->copy_stream) cudaStreamDestroy((cudaStream_t)c->copy_stream);
    free(c->slots);
    free(c->slot_err);
    free(c->map);
    free(c->qpos);
    free(c->evicted_pass);
    free(c->queue);
    memset(c, 0, sizeof *c);
}

static int init_device(smoe_gcache *c, smoe_err *err) {
    size_t slab_bytes = (size_t)c->nslots * c->slot_bytes;
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
                            "bytes (%zu bytes) on device %d: %s", c->nslots,
                            (unsigned long long)c->slot_bytes, slab_bytes, c->device,
                            cudaGetErrorString(e));
    c->slab = p;
    cudaStream_t st;
    e = cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking);
    if (e != cudaSuccess) return cu_fail(err, e, "creating the copy stream");
    c->copy_stream = st;
    c->ready_ev = calloc(c->nslots, sizeof *c->ready_ev);
    c->free_ev = calloc(c->nslots, sizeof *c->free_ev);
    if (!c->ready_ev || !c->free_ev)
        return smoe_err_set(err, SMOE_ENOMEM, "GPU cache: out of memory for events");
    for (uint32_t s = 0; s < c->nslots; s++) {
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
    if (nslots == 0)
        return smoe_err_set(err, SMOE_EINVAL, "GPU cache capacity must be at least 1 slot");
    if (nslots < min_slots)
        return smoe_err_set(err, SMOE_EINVAL, "GPU cache capacity of %u slots is smaller than "
                            "top_k = %u: one token needs %u experts pinned at once", nslots,
                            min_slots, min_slots);
    if (mode != SMOE_GC_HOSTCOPY && mode != SMOE_GC_STAGED)
        return smoe_err_set(err, SMOE_EINVAL, "GPU cache: unknown slow-tier mode %d", mode);
    if (mode == SMOE_GC_STAGED && (nstages == 0 || nstages > 64))
        return smoe_err_set(err, SMOE_EINVAL, "GPU cache: staging buffers %u must be in 1..64",
                            nstages);
    uint64_t nkeys = (uint64_t)store->num_layers * store->num_experts;
    if (nkeys == 0 || nkeys > INT32_MAX)
        return smoe_err_set(err, SMOE_EINVAL, "GPU cache: store has %u layers x %u experts",
                            store->num_layers, store->num_experts);
    if (policy->nslots != nslots || policy->num_layers != store->num_layers ||
        policy->num_experts != store->num_experts)
        return smoe_err_set(err, SMOE_EINVAL, "policy %s was built for %u slots, %u layers, %u "
                            "experts; the GPU cache has %u slots, %u layers, %u experts",
                            policy->ops->name, policy->nslots, policy->num_layers,
                            policy->num_experts, nslots, store->num_layers, store->num_experts);
    uint64_t slab = (uint64_t)nslots * store->block_bytes;
    if (store->block_bytes == 0 || slab / store->block_bytes != nslots || slab > SIZE_MAX)
        return smoe_err_set(err, SMOE_EINVAL, "GPU cache: %u slots of %llu bytes overflow",
                            nslots, (unsigned long long)store->block_bytes);
    c->store = store;
    c->device = device;
    c->mode = mode;
    c->num_layers = store->num_layers;
    c->num_experts = store->num_experts;
    c->nslots = nslots;
    c->slot_bytes = store->block_bytes;
    c->slots = calloc(nslots, sizeof *c->slots);
    c->slot_err = calloc(nslots, sizeof *c->slot_err);
    c->map = malloc(nkeys * sizeof *c->map);
    c->qpos = malloc(nkeys * sizeof *c->qpos);
    c->evicted_pass = calloc(nkeys, sizeof *c->evicted_pass);
    c->queue_cap = 64;
    c->queue = malloc(c->queue_cap * sizeof *c->queue);
    int rc = 0;
    if (!c->slots || !c->slot_err || !c->map || !c->qpos || !c->evicted_pass || !c->queue)
        rc = smoe_err_set(err, SMOE_ENOMEM, "GPU cache: out of memory for %u slots", nslots);
    if (rc == 0) rc = init_device(c, err);
    if (rc == 0 && mode == SMOE_GC_HOSTCOPY) {
        void *p = NULL;
        rc = host_alloc(c, &p, (size_t)(nkeys * c->slot_bytes), err);
        c->host_copy = p;
        for (uint64_t k = 0; rc == 0 && k < nkeys; k++)
            rc = smoe_store_read(store, (uint32_t)(k / c->num_experts),
                                 (uint32_t)(k % c->num_experts),
                                 c->host_copy + k * c->slot_bytes, err);
    }
    if (rc == 0 && mode == SMOE_GC_STAGED) {
        c->stages = calloc(nstages, sizeof *c->stages);
        if (!c->stages) rc = smoe_err_set(err, SMOE_ENOMEM, "GPU cache: out of memory");
        else c->nstages = nstages;
        for (uint32_t i = 0; rc == 0 && i < nstages; i++) {
            void *p = NULL;
            rc = host_alloc(c, &p, (size_t)c->slot_bytes, err);
            c->stages[i].host = p;
            if (rc == 0 && !emu(c)) {
                cudaEvent_t ev;
                cudaError_t e = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming);
                if (e != cudaSuccess) rc = cu_fail(err, e, "cudaEventCreate");
                else c->stages[i].done = ev;
            }
        }
    }
    if (rc < 0) {
        free_all(c);
        return rc;
    }
    for (uint64_t k = 0; k < nkeys; k++) c->map[k] = c->qpos[k] = -1;
    for (uint32_t s = 0; s < nslots; s++) c->slots[s].key = -1;
    c->pass_id = 1;
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    pthread_cond_init(&c->work_cv, NULL);
    pthread_cond_init(&c->idle_cv, NULL);
    pthread_mutex_init(&c->stage_mu, NULL);
    pthread_cond_init(&c->stage_cv, NULL);
    c->policy = policy;
    if (prefetch_worker) {
        int prc = pthread_create(&c->worker, NULL, worker_main, c);
        if (prc != 0) {
            c->policy = NULL;
            smoe_gcache_free(c);
            return smoe_err_set(err, SMOE_ENOMEM, "GPU cache: cannot start the prefetch "
                                "thread: %s", strerror(prc));
        }
        c->worker_started = 1;
    }
    return 0;
}

static void stop_worker(smoe_gcache *c) {
    pthread_mutex_lock(&c->mu);
    int started = c->worker_started;
    c->worker_started = 0;
    c->shutdown = 1;
    heap_clear(c);
    pthread_cond_broadcast(&c->work_cv);
    pthread_mutex_unlock(&c->mu);
    if (started) pthread_join(c->worker, NULL);
}

void smoe_gcache_free(smoe_gcache *c) {
    if (!c->slots) return;
    stop_worker(c);
    if (!emu(c) && c->copy_stream) cudaStreamSynchronize((cudaStream_t)c->copy_stream);
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->cv);
    pthread_cond_destroy(&c->work_cv);
    pthread_cond_destroy(&c->idle_cv);
    pthread_mutex_destroy(&c->stage_mu);
    pthread_cond_destroy(&c->stage_cv);
    if (c->policy) smoe_policy_destroy(c->policy);
    free_all(c);
}

/* ---- demand path ---------------------------------------------------------------------------- */

static void wait_cv(smoe_gcache *c) {
    c->waiters++;
    pthread_cond_wait(&c->cv, &c->mu);
    c->waiters--;
}

/* Make `stream` wait for slot s's copy; count a hit whose copy is still in flight. */
static int stream_wait_slot(smoe_gcache *c, uint32_t s, void *stream, int count, smoe_err *err) {
    if (emu(c)) return 0;
    cudaEvent_t ev = (cudaEvent_t)c->ready_ev[s];
    if (count && cudaEventQuery(ev) == cudaErrorNotReady) c->stats.inflight_hits++;
    cudaError_t e = cudaStreamWaitEvent((cudaStream_t)stream, ev, 0);
    return e == cudaSuccess ? 0 : cu_fail(err, e, "cudaStreamWaitEvent on a slot's copy");
}

int smoe_gcache_acquire(smoe_gcache *c, uint32_t layer, uint32_t expert, void *stream,
                        const uint8_t **data, smoe_err *err) {
    int32_t key = 0;
    int rc = key_of(c, layer, expert, &key, err);
    if (rc < 0) return rc;
    if (!emu(c)) cudaSetDevice(c->device);
    pthread_mutex_lock(&c->mu);
    int counted = 0;
    double t0 = 0.0;
    for (;;) {
        int32_t s = c->map[key];
        if (s >= 0 && c->slots[s].state == SMOE_SLOT_READY) {
            smoe_gslot *sl = &c->slots[s];
            sl->pins++;
            smoe_policy_access(c->policy, (uint32_t)s, key);
            if (!counted) c->stats.hits++;
            sl->last_pass = c->pass_id;
            sl->last_tick = ++c->tick;
            if (sl->prefetched) {
                sl->prefetched = 0;
                c->stats.prefetch_used++;
            }
            if (counted) c->stats.stall_s += smoe_now() - t0;
            rc = policy_failed(c, err);
            if (rc == 0) rc = stream_wait_slot(c, (uint32_t)s, stream, !counted, err);
            if (rc < 0) {
                sl->pins--;
                if (sl->pins == 0 && c->waiters) pthread_cond_broadcast(&c->cv);
            } else {
                *data = c->slab + (uint64_t)s * c->slot_bytes;
            }
            pthread_mutex_unlock(&c->mu);
            return rc;
        }
        if (!counted) {
            counted = 1;
            c->stats.misses++;
            if (c->evicted_pass[key] == c->pass_id) c->stats.collision_misses++;
            if (s >= 0 && c->slots[s].prefetched) c->stats.prefetch_late++;
            t0 = smoe_now();
        }
        if (s >= 0) {
            smoe_gslot *sl = &c->slots[s];
            uint32_t seq = sl->load_seq;
            while (sl->state == SMOE_SLOT_LOADING && sl->load_seq == seq) wait_cv(c);
            if (sl->failed_seq == seq) {
                if (err) *err = c->slot_err[s];
                const int frc = c->slot_err[s].code < 0 ? c->slot_err[s].code : SMOE_EIO;
                c->stats.stall_s += smoe_now() - t0;
                pthread_mutex_unlock(&c->mu);
                return frc;
            }
            continue;
        }
        s = take_slot(c, evictable_demand, &rc, err);
        if (rc < 0) {
            c->stats.stall_s += smoe_now() - t0;
            pthread_mutex_unlock(&c->mu);
            return rc;
        }
        if (s < 0) {
            wait_cv(c);
            continue;
        }
        load_begin(c, (uint32_t)s, key, 0);
        pthread_mutex_unlock(&c->mu);
        smoe_err lerr;
        smoe_err_clear(&lerr);
        rc = load_block(c, (uint32_t)s, key, &lerr);
        pthread_mutex_lock(&c->mu);
        load_done(c, (uint32_t)s, rc, &lerr);
        c->stats.stall_s += smoe_now() - t0;
        if (rc < 0) {
            if (err) *err = lerr;
        } else {
            rc = policy_failed(c, err);
            if (rc == 0) rc = stream_wait_slot(c, (uint32_t)s, stream, 0, err);
            if (rc < 0) {
                c->slots[s].pins--;
                if (c->waiters) pthread_cond_broadcast(&c->cv);
            } else {
                *data = c->slab + (uint64_t)s * c->slot_bytes;
            }
        }
        pthread_mutex_unlock(&c->mu);
        return rc;
    }
}

int smoe_gcache_release(smoe_gcache *c, uint32_t layer, uint32_t expert, void *stream,
                        smoe_err *err) {
    int32_t key = 0;
    int rc = key_of(c, layer, expert, &key, err);
    if (rc < 0) return rc;
    pthread_mutex_lock(&c->mu);
    int32_t s = c->map[key];
    if (s < 0 || c->slots[s].state != SMOE_SLOT_READY || c->slots[s].pins <= 0) {
        pthread_mutex_unlock(&c->mu);
        return smoe_err_set(err, SMOE_ESTATE, "release of expert (layer %u, expert %u), which "
                            "is not pinned in the GPU cache", layer, expert);
    }
    if (!emu(c)) {
        cudaError_t e = cudaEventRecord((cudaEvent_t)c->free_ev[s], (cudaStream_t)stream);
        if (e != cudaSuccess) rc = cu_fail(err, e, "recording a slot's free event");
    }
    if (--c->slots[s].pins == 0 && c->waiters) pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    return rc;
}

void smoe_gcache_begin_pass(smoe_gcache *c) {
    pthread_mutex_lock(&c->mu);
    c->pass_id++;
    smoe_policy_pass(c->policy, c->pass_id);
    pthread_mutex_unlock(&c->mu);
}

/* ---- prefetch API --------------------------------------------------------------------------- */

int smoe_gcache_prefetch(smoe_gcache *c, const int32_t *keys, const float *priorities,
                         uint32_t n, int replace, smoe_err *err) {
    int32_t nkeys = (int32_t)(c->num_layers * c->num_experts);
    for (uint32_t i = 0; i < n; i++) {
        if (keys[i] < 0 || keys[i] >= nkeys)
            return smoe_err_set(err, SMOE_EINVAL, "prefetch request %u: key %d out of range "
                                "(%u layers x %u experts)", i, (int)keys[i], c->num_layers,
                                c->num_experts);
        if (priorities[i] != priorities[i])
            return smoe_err_set(err, SMOE_EINVAL, "prefetch request %u: priority is NaN", i);
    }
    pthread_mutex_lock(&c->mu);
    if (c->shutdown || !c->worker_started) {
        pthread_mutex_unlock(&c->mu);
        return smoe_err_set(err, SMOE_ESTATE, "prefetch: the GPU cache has no running "
                            "prefetch worker (created with prefetch disabled, or closed)");
    }
    if (replace) heap_clear(c);
    if (c->queue_len + (uint64_t)n > c->queue_cap) {
        uint64_t cap = c->queue_cap;
        while (cap < c->queue_len + (uint64_t)n) cap *= 2;
        if (cap > (uint64_t)nkeys) cap = (uint64_t)nkeys;
        if (cap < c->queue_cap) cap = c->queue_cap;
        smoe_gprefetch_req *q = realloc(c->queue, cap * sizeof *q);
        if (!q) {
            pthread_mutex_unlock(&c->mu);
            return smoe_err_set(err, SMOE_ENOMEM, "prefetch: out of memory for the queue");
        }
        c->queue = q;
        c->queue_cap = (uint32_t)cap;
    }
    for (uint32_t i = 0; i < n; i++) {
        int32_t k = keys[i];
        if (c->map[k] >= 0) continue;
        smoe_gprefetch_req r = {.key = k, .priority = priorities[i], .seq = ++c->queue_seq};
        int32_t at = c->qpos[k];
        if (at >= 0) {
            c->queue[at] = r;
            heap_up(c, (uint32_t)at);
            heap_down(c, (uint32_t)c->qpos[k]);
        } else {
            uint32_t i2 = c->queue_len++;
            heap_set(c, i2, r);
            heap_up(c, i2);
        }
    }
    if (c->queue_len) {
        c->worker_busy = 1;
        pthread_cond_signal(&c->work_cv);
    }
    pthread_mutex_unlock(&c->mu);
    return 0;
}

void smoe_gcache_cancel(smoe_gcache *c, int32_t key) {
    pthread_mutex_lock(&c->mu);
    if (key < 0)
        heap_clear(c);
    else if ((uint64_t)key < (uint64_t)c->num_layers * c->num_experts && c->qpos[key] >= 0)
        heap_remove_at(c, (uint32_t)c->qpos[key]);
    pthread_mutex_unlock(&c->mu);
}

int smoe_gcache_wait_idle(smoe_gcache *c, smoe_err *err) {
    pthread_mutex_lock(&c->mu);
    while (c->worker_started && !c->shutdown &&
           ((c->queue_len > 0 && !c->worker_paused) || c->worker_busy))
        pthread_cond_wait(&c->idle_cv, &c->mu);
    pthread_mutex_unlock(&c->mu);
    if (emu(c)) return 0;
    cudaError_t e = cudaStreamSynchronize((cudaStream_t)c->copy_stream);
    return e == cudaSuccess ? 0 : cu_fail(err, e, "synchronizing the copy stream");
}

void smoe_gcache_pause_worker(smoe_gcache *c, int paused) {
    pthread_mutex_lock(&c->mu);
    c->worker_paused = paused != 0;
    if (!c->worker_paused && c->queue_len && c->worker_started && !c->shutdown) {
        c->worker_busy = 1;
        pthread_cond_signal(&c->work_cv);
    }
    pthread_mutex_unlock(&c->mu);
}

int smoe_gcache_take_worker_error(smoe_gcache *c, smoe_err *err) {
    pthread_mutex_lock(&c->mu);
    int rc = c->worker_err.code;
    if (rc < 0 && err) *err = c->worker_err;
    smoe_err_clear(&c->worker_err);
    pthread_mutex_unlock(&c->mu);
    return rc;
}

/* ---- policy swap, counts, introspection ----------------------------------------------------- */

int smoe_gcache_set_policy(smoe_gcache *c, smoe_policy *p, smoe_err *err) {
    if (p->nslots != c->nslots || p->num_layers != c->num_layers ||
        p->num_experts != c->num_experts) {
        int rc = smoe_err_set(err, SMOE_EINVAL, "policy %s was built for %u slots, %u layers, "
                              "%u experts; the GPU cache has %u slots, %u layers, %u experts",
                              p->ops->name, p->nslots, p->num_layers, p->num_experts,
                              c->nslots, c->num_layers, c->num_experts);
        smoe_policy_destroy(p);
        return rc;
    }
    uint32_t *order = malloc((size_t)c->nslots * sizeof *order);
    if (!order) {
        smoe_policy_destroy(p);
        return smoe_err_set(err, SMOE_ENOMEM, "set_policy: out of memory");
    }
    pthread_mutex_lock(&c->mu);
    uint32_t n = 0;
    for (uint32_t s = 0; s < c->nslots; s++)
        if (c->slots[s].state != SMOE_SLOT_EMPTY) order[n++] = s;
    for (uint32_t i = 1; i < n; i++) {
        uint32_t v = order[i], j = i;
        while (j > 0 && c->slots[order[j - 1]].last_tick > c->slots[v].last_tick) {
            order[j] = order[j - 1];
            j--;
        }
        order[j] = v;
    }
    for (uint32_t i = 0; i < n; i++) smoe_policy_insert(p, order[i], c->slots[order[i]].key, 0);
    smoe_policy *old = c->policy;
    c->policy = p;
    int rc = policy_failed(c, err);
    pthread_mutex_unlock(&c->mu);
    free(order);
    smoe_policy_destroy(old);
    return rc;
}

int smoe_gcache_counts(smoe_gcache *c, const int32_t *keys, const uint32_t *counts, uint32_t n,
                       smoe_err *err) {
    const int32_t nkeys = (int32_t)(c->num_layers * c->num_experts);
    for (uint32_t i = 0; i < n; i++)
        if (keys[i] < 0 || keys[i] >= nkeys)
            return smoe_err_set(err, SMOE_EINVAL, "counts entry %u: key %d out of range (%u "
                                "layers x %u experts)", i, (int)keys[i], c->num_layers,
                                c->num_experts);
    pthread_mutex_lock(&c->mu);
    smoe_policy_counts(c->policy, keys, counts, n);
    int rc = policy_failed(c, err);
    pthread_mutex_unlock(&c->mu);
    return rc;
}

uint32_t smoe_gcache_resident(smoe_gcache *c, int32_t *keys) {
    pthread_mutex_lock(&c->mu);
    uint32_t n = 0;
    for (uint32_t s = 0; s < c->nslots; s++)
        if (c->slots[s].state == SMOE_SLOT_READY) keys[n++] = c->slots[s].key;
    pthread_mutex_unlock(&c->mu);
    return n;
}

void smoe_gcache_get_stats(smoe_gcache *c, smoe_gcache_stats *out) {
    pthread_mutex_lock(&c->mu);
    *out = c->stats;
    pthread_mutex_unlock(&c->mu);
}

void smoe_gcache_reset_stats(smoe_gcache *c) {
    pthread_mutex_lock(&c->mu);
    memset(&c->stats, 0, sizeof c->stats);
    pthread_mutex_unlock(&c->mu);
}

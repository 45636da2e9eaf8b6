/* Fast tier: slots, key map, pinning, blocking loads, statistics, and the prefetch worker.
 * The locking rules and the meaning of every field are in cache.h; the policy event contract
 * the code below follows is in policy/policy.h. */
#include "cache.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ---- small helpers (all with mu held) ---------------------------------------------------- */

static int policy_failed(smoe_cache *c, smoe_err *err) {
    if (c->policy->failure.code == 0) return 0;
    smoe_err_set(err, SMOE_EPOLICY, "policy %s: %s", c->policy->ops->name,
                 c->policy->failure.msg);
    smoe_err_clear(&c->policy->failure);
    return SMOE_EPOLICY;
}

static int evictable_demand(void *ctx, uint32_t s) {
    const smoe_cache *c = ctx;
    return s < c->nslots && c->slots[s].state == SMOE_SLOT_READY && c->slots[s].pins == 0;
}

/* The prefetcher never evicts an expert used in the current pass, nor, under a policy with a
 * utility (spac), one whose utility exceeds that of the expert being prefetched (prefetch and
 * eviction decided in one utility space). */
static int evictable_prefetch(void *ctx, uint32_t s) {
    const smoe_cache *c = ctx;
    if (!evictable_demand(ctx, s) || c->slots[s].last_pass == c->pass_id) return 0;
    if (c->policy->ops->utility &&
        smoe_policy_utility(c->policy, c->slots[s].key) > smoe_policy_utility(c->policy, c->pf_key))
        return 0;
    return 1;
}

static int32_t lowest_free(const smoe_cache *c) {
    for (uint32_t s = 0; s < c->nslots; s++)
        if (c->slots[s].state == SMOE_SLOT_EMPTY) return (int32_t)s;
    return -1;
}

static void evict(smoe_cache *c, uint32_t s) {
    smoe_slot *sl = &c->slots[s];
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

/* Choose a slot for a new block: the lowest-numbered free one, else the policy's victim among
 * the slots `ok` accepts (evicted here).  Returns the slot, or -1 when there is none; a
 * policy failure sets *rc to SMOE_EPOLICY (and fills err). */
static int32_t take_slot(smoe_cache *c, smoe_evictable_fn ok, int *rc, smoe_err *err) {
    *rc = 0;
    int32_t s = lowest_free(c);
    if (s >= 0) return s;
    s = smoe_policy_victim(c->policy, ok, c);
    if ((*rc = policy_failed(c, err)) < 0) return -1;
    if (s < 0) return -1;
    if ((uint32_t)s >= c->nslots || !ok(c, (uint32_t)s)) {
        *rc = smoe_err_set(err, SMOE_EPOLICY,
                           "policy %s returned slot %d, which is not an evictable slot of "
                           "this %u-slot cache", c->policy->ops->name, (int)s, c->nslots);
        return -1;
    }
    evict(c, (uint32_t)s);
    return s;
}

/* Mark slot s LOADING with key; the caller then reads with mu released and calls
 * load_done. */
static void load_begin(smoe_cache *c, uint32_t s, int32_t key, int prefetch) {
    smoe_slot *sl = &c->slots[s];
    smoe_policy_insert(c->policy, s, key, prefetch);
    sl->key = key;
    sl->state = SMOE_SLOT_LOADING;
    sl->prefetched = (uint8_t)(prefetch != 0);
    sl->load_failed = 0;
    sl->pins = prefetch ? 0 : 1;
    sl->last_pass = prefetch ? 0 : c->pass_id;
    sl->last_tick = ++c->tick;
    sl->load_seq++;
    if (sl->load_seq == 0) sl->load_seq = 1;
    c->map[key] = (int32_t)s;
}

static void load_done(smoe_cache *c, uint32_t s, int rc, const smoe_err *lerr) {
    smoe_slot *sl = &c->slots[s];
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
        sl->load_failed = 1;
        sl->failed_seq = sl->load_seq;
        c->slot_err[s] = *lerr;
        if (lerr->code == 0)
            smoe_err_set(&c->slot_err[s], rc, "loading expert (layer %u, expert %u) failed "
                         "(code %d)", (uint32_t)key / c->num_experts,
                         (uint32_t)key % c->num_experts, rc);
    }
    if (c->waiters) pthread_cond_broadcast(&c->cv);
}

/* Link emulation (cache.h, SpecMD A.4).  With mu held, before a store read starts: reserve the
 * emulated link for one block and return the time the read may return (0: no throttle). */
static double link_reserve(smoe_cache *c) {
    if (c->throttle_bw <= 0.0 && c->throttle_lat_s <= 0.0) return 0.0;
    double now = smoe_now();
    double start = c->link_free_s > now ? c->link_free_s : now;
    double dur = c->throttle_lat_s;
    if (c->throttle_bw > 0.0) dur += (double)c->slot_bytes / c->throttle_bw;
    c->link_free_s = start + dur;
    return c->link_free_s;
}

/* Without mu: sleep until smoe_now() >= until (no-op for 0). */
static void link_wait(double until) {
    if (until <= 0.0) return;
    for (;;) {
        double left = until - smoe_now();
        if (left <= 0.0) return;
        struct timespec ts;
        ts.tv_sec = (time_t)left;
        ts.tv_nsec = (long)((left - (double)ts.tv_sec) * 1e9);
        if (ts.tv_nsec >= 1000000000L) ts.tv_nsec = 999999999L;
        nanosleep(&ts, NULL);
    }
}

static uint8_t *slot_data(const smoe_cache *c, uint32_t s) {
    return c->slab + (uint64_t)s * c->slot_bytes;
}

static int key_of(const smoe_cache *c, uint32_t layer, uint32_t expert, int32_t *key,
                  smoe_err *err) {
    if (layer >= c->num_layers || expert >= c->num_experts)
        return smoe_err_set(err, SMOE_EINVAL,
                            "expert (layer %u, expert %u) out of range: the store has %u "
                            "layers of %u experts", layer, expert, c->num_layers,
                            c->num_experts);
    *key = smoe_key(layer, expert, c->num_experts);
    return 0;
}

/* ---- prefetch queue: binary max-heap on (priority, -seq) with a key -> index map --------- */

static int req_before(const smoe_prefetch_req *a, const smoe_prefetch_req *b) {
    if (a->priority != b->priority) return a->priority > b->priority;
    return a->seq < b->seq;
}

static void heap_set(smoe_cache *c, uint32_t i, smoe_prefetch_req r) {
    c->queue[i] = r;
    c->qpos[r.key] = (int32_t)i;
}

static void heap_up(smoe_cache *c, uint32_t i) {
    smoe_prefetch_req r = c->queue[i];
    while (i > 0) {
        uint32_t p = (i - 1) / 2;
        if (!req_before(&r, &c->queue[p])) break;
        heap_set(c, i, c->queue[p]);
        i = p;
    }
    heap_set(c, i, r);
}

static void heap_down(smoe_cache *c, uint32_t i) {
    smoe_prefetch_req r = c->queue[i];
    for (;;) {
        uint32_t l = 2 * i + 1, best = i;
        const smoe_prefetch_req *bv = &r;
        if (l < c->queue_len && req_before(&c->queue[l], bv)) best = l, bv = &c->queue[l];
        if (l + 1 < c->queue_len && req_before(&c->queue[l + 1], bv)) best = l + 1;
        if (best == i) break;
        heap_set(c, i, c->queue[best]);
        i = best;
    }
    heap_set(c, i, r);
}

static void heap_remove_at(smoe_cache *c, uint32_t i) {
    c->qpos[c->queue[i].key] = -1;
    c->queue_len--;
    if (i == c->queue_len) return;
    int32_t moved = c->queue[c->queue_len].key;
    heap_set(c, i, c->queue[c->queue_len]);
    heap_up(c, i);
    heap_down(c, (uint32_t)c->qpos[moved]);
}

static void heap_clear(smoe_cache *c) {
    for (uint32_t i = 0; i < c->queue_len; i++) c->qpos[c->queue[i].key] = -1;
    c->queue_len = 0;
}

/* ---- worker ------------------------------------------------------------------------------ */

static void *worker_main(void *arg) {
    smoe_cache *c = arg;
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
        smoe_prefetch_req r = c->queue[0];
        heap_remove_at(c, 0);
        if (c->map[r.key] >= 0) continue; /* became resident or loading meanwhile */
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
        uint32_t layer = (uint32_t)r.key / c->num_experts, expert = (uint32_t)r.key % c->num_experts;
        uint8_t *dst = slot_data(c, (uint32_t)s);
        double until = link_reserve(c);
        pthread_mutex_unlock(&c->mu);
        smoe_err lerr;
        smoe_err_clear(&lerr);
        int rc = smoe_store_read(c->store, layer, expert, dst, &lerr);
        link_wait(until);
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

/* ---- lifetime ---------------------------------------------------------------------------- */

/* Free the arrays the cache owns and zero it (init failure and smoe_cache_free). */
static void free_arrays(smoe_cache *c) {
    free(c->slab);
    free(c->slots);
    free(c->slot_err);
    free(c->map);
    free(c->qpos);
    free(c->evicted_pass);
    free(c->queue);
    memset(c, 0, sizeof *c);
}

int smoe_cache_init(smoe_cache *c, smoe_store *store, uint32_t nslots, uint32_t min_slots,
                    smoe_policy *policy, int prefetch_worker, smoe_err *err) {
    memset(c, 0, sizeof *c);
    if (!store || !policy)
        return smoe_err_set(err, SMOE_EINVAL, "cache: store and policy are required");
    if (nslots == 0)
        return smoe_err_set(err, SMOE_EINVAL, "cache capacity must be at least 1 slot");
    if (nslots < min_slots)
        return smoe_err_set(err, SMOE_EINVAL,
                            "cache capacity of %u slots is smaller than top_k = %u: one token "
                            "needs %u experts pinned at once", nslots, min_slots, min_slots);
    uint64_t nkeys = (uint64_t)store->num_layers * store->num_experts;
    if (nkeys == 0 || nkeys > INT32_MAX)
        return smoe_err_set(err, SMOE_EINVAL, "cache: store has %u layers x %u experts",
                            store->num_layers, store->num_experts);
    if (store->block_bytes == 0 || store->block_bytes % SMOE_ALIGN)
        return smoe_err_set(err, SMOE_EINVAL,
                            "cache: store block size %llu is not a positive multiple of %u",
                            (unsigned long long)store->block_bytes, SMOE_ALIGN);
    if (policy->nslots != nslots || policy->num_layers != store->num_layers ||
        policy->num_experts != store->num_experts)
        return smoe_err_set(err, SMOE_EINVAL,
                            "policy %s was built for %u slots, %u layers, %u experts; the "
                            "cache has %u slots, %u layers, %u experts", policy->ops->name,
                            policy->nslots, policy->num_layers, policy->num_experts, nslots,
                            store->num_layers, store->num_experts);
    c->store = store;
    c->num_layers = store->num_layers;
    c->num_experts = store->num_experts;
    c->nslots = nslots;
    c->slot_bytes = store->block_bytes;
    uint64_t slab_bytes = (uint64_t)nslots * c->slot_bytes;
    if (slab_bytes / c->slot_bytes != nslots || slab_bytes > SIZE_MAX)
        return smoe_err_set(err, SMOE_EINVAL, "cache: %u slots of %llu bytes overflow", nslots,
                            (unsigned long long)c->slot_bytes);
    void *slab = NULL;
    if (posix_memalign(&slab, SMOE_ALIGN, (size_t)slab_bytes) != 0) slab = NULL;
    c->slab = slab;
    c->slots = calloc(nslots, sizeof *c->slots);
    c->slot_err = calloc(nslots, sizeof *c->slot_err);
    c->map = malloc(nkeys * sizeof *c->map);
    c->qpos = malloc(nkeys * sizeof *c->qpos);
    c->evicted_pass = calloc(nkeys, sizeof *c->evicted_pass);
    c->queue_cap = 64;
    c->queue = malloc(c->queue_cap * sizeof *c->queue);
    if (!c->slab || !c->slots || !c->slot_err || !c->map || !c->qpos || !c->evicted_pass ||
        !c->queue) {
        free_arrays(c);
        return smoe_err_set(err, SMOE_ENOMEM, "cache: cannot allocate %u slots of %llu bytes",
                            nslots, (unsigned long long)store->block_bytes);
    }
    for (uint64_t k = 0; k < nkeys; k++) c->map[k] = c->qpos[k] = -1;
    for (uint32_t s = 0; s < nslots; s++) c->slots[s].key = -1;
    c->pass_id = 1;
    pthread_mutex_init(&c->mu, NULL);
    pthread_cond_init(&c->cv, NULL);
    pthread_cond_init(&c->work_cv, NULL);
    pthread_cond_init(&c->idle_cv, NULL);
    c->policy = policy;
    if (prefetch_worker) {
        int rc = pthread_create(&c->worker, NULL, worker_main, c);
        if (rc != 0) {
            c->policy = NULL; /* stays with the caller on failure */
            smoe_cache_free(c);
            return smoe_err_set(err, SMOE_ENOMEM, "cache: cannot start the prefetch thread: %s",
                                strerror(rc));
        }
        c->worker_started = 1;
    }
    return 0;
}

void smoe_cache_stop_worker(smoe_cache *c) {
    pthread_mutex_lock(&c->mu);
    int started = c->worker_started;
    c->worker_started = 0;
    c->shutdown = 1;
    heap_clear(c);
    pthread_cond_broadcast(&c->work_cv);
    pthread_mutex_unlock(&c->mu);
    if (started) pthread_join(c->worker, NULL);
}

void smoe_cache_free(smoe_cache *c) {
    if (!c->slots) return;
    smoe_cache_stop_worker(c);
    pthread_mutex_destroy(&c->mu);
    pthread_cond_destroy(&c->cv);
    pthread_cond_destroy(&c->work_cv);
    pthread_cond_destroy(&c->idle_cv);
    smoe_policy_destroy(c->policy);
    free_arrays(c);
}

/* ---- demand path ------------------------------------------------------------------------- */

static void wait_cv(smoe_cache *c) {
    c->waiters++;
    pthread_cond_wait(&c->cv, &c->mu);
    c->waiters--;
}

int smoe_cache_acquire(smoe_cache *c, uint32_t layer, uint32_t expert, const uint8_t **data,
                       smoe_err *err) {
    int32_t key = 0;
    int rc = key_of(c, layer, expert, &key, err);
    if (rc < 0) return rc;
    pthread_mutex_lock(&c->mu);
    int counted = 0; /* this access has been counted as a miss */
    double t0 = 0.0;
    for (;;) {
        int32_t s = c->map[key];
        if (s >= 0 && c->slots[s].state == SMOE_SLOT_READY) {
            smoe_slot *sl = &c->slots[s];
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
            if (rc < 0) {
                sl->pins--;
                if (sl->pins == 0 && c->waiters) pthread_cond_broadcast(&c->cv);
            } else {
                *data = slot_data(c, (uint32_t)s);
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
        if (s >= 0) { /* LOADING by another thread or the worker: wait for that load */
            smoe_slot *sl = &c->slots[s];
            uint32_t seq = sl->load_seq;
            while (sl->state == SMOE_SLOT_LOADING && sl->load_seq == seq) wait_cv(c);
            if (sl->failed_seq == seq) {
                if (err) *err = c->slot_err[s];
                const int frc = c->slot_err[s].code < 0 ? c->slot_err[s].code : SMOE_EIO;
                c->stats.stall_s += smoe_now() - t0;
                pthread_mutex_unlock(&c->mu);
                return frc; /* read under mu: a new load of the slot may rewrite slot_err */
            }
            continue; /* READY now (hit path pins it) or reused: look again */
        }
        s = take_slot(c, evictable_demand, &rc, err);
        if (rc < 0) {
            c->stats.stall_s += smoe_now() - t0;
            pthread_mutex_unlock(&c->mu);
            return rc;
        }
        if (s < 0) { /* everything pinned or loading: wait for a release or a load */
            wait_cv(c);
            continue;
        }
        load_begin(c, (uint32_t)s, key, 0);
        uint8_t *dst = slot_data(c, (uint32_t)s);
        double until = link_reserve(c);
        pthread_mutex_unlock(&c->mu);
        smoe_err lerr;
        smoe_err_clear(&lerr);
        rc = smoe_store_read(c->store, layer, expert, dst, &lerr);
        link_wait(until);
        pthread_mutex_lock(&c->mu);
        load_done(c, (uint32_t)s, rc, &lerr);
        c->stats.stall_s += smoe_now() - t0;
        if (rc < 0) {
            if (err) *err = lerr;
        } else {
            rc = policy_failed(c, err);
            if (rc < 0) {
                c->slots[s].pins--;
                if (c->waiters) pthread_cond_broadcast(&c->cv);
            } else {
                *data = dst;
            }
        }
        pthread_mutex_unlock(&c->mu);
        return rc;
    }
}

int smoe_cache_release(smoe_cache *c, uint32_t layer, uint32_t expert, smoe_err *err) {
    int32_t key = 0;
    int rc = key_of(c, layer, expert, &key, err);
    if (rc < 0) return rc;
    pthread_mutex_lock(&c->mu);
    int32_t s = c->map[key];
    if (s < 0 || c->slots[s].state != SMOE_SLOT_READY || c->slots[s].pins <= 0) {
        pthread_mutex_unlock(&c->mu);
        return smoe_err_set(err, SMOE_ESTATE,
                            "release of expert (layer %u, expert %u), which is not pinned",
                            layer, expert);
    }
    if (--c->slots[s].pins == 0 && c->waiters) pthread_cond_broadcast(&c->cv);
    pthread_mutex_unlock(&c->mu);
    return 0;
}

void smoe_cache_begin_pass(smoe_cache *c) {
    pthread_mutex_lock(&c->mu);
    c->pass_id++;
    smoe_policy_pass(c->policy, c->pass_id);
    pthread_mutex_unlock(&c->mu);
}

/* ---- prefetch API ------------------------------------------------------------------------ */

int smoe_cache_prefetch(smoe_cache *c, const int32_t *keys, const float *priorities, uint32_t n,
                        int replace, smoe_err *err) {
    int32_t nkeys = (int32_t)(c->num_layers * c->num_experts);
    for (uint32_t i = 0; i < n; i++) {
        if (keys[i] < 0 || keys[i] >= nkeys)
            return smoe_err_set(err, SMOE_EINVAL,
                                "prefetch request %u: key %d out of range (%u layers x %u "
                                "experts)", i, (int)keys[i], c->num_layers, c->num_experts);
        if (priorities[i] != priorities[i])
            return smoe_err_set(err, SMOE_EINVAL, "prefetch request %u: priority is NaN", i);
    }
    pthread_mutex_lock(&c->mu);
    if (c->shutdown || !c->worker_started) {
        pthread_mutex_unlock(&c->mu);
        return smoe_err_set(err, SMOE_ESTATE, "prefetch: the cache has no running prefetch "
                            "worker (created with prefetch disabled, or closed)");
    }
    if (replace) heap_clear(c);
    if (c->queue_len + (uint64_t)n > c->queue_cap) {
        uint64_t cap = c->queue_cap;
        while (cap < c->queue_len + (uint64_t)n) cap *= 2;
        if (cap > (uint64_t)nkeys) cap = (uint64_t)nkeys; /* a key is queued at most once */
        if (cap < c->queue_cap) cap = c->queue_cap;
        smoe_prefetch_req *q = realloc(c->queue, cap * sizeof *q);
        if (!q) {
            pthread_mutex_unlock(&c->mu);
            return smoe_err_set(err, SMOE_ENOMEM, "prefetch: out of memory for the queue");
        }
        c->queue = q;
        c->queue_cap = (uint32_t)cap;
    }
    for (uint32_t i = 0; i < n; i++) {
        int32_t k = keys[i];
        if (c->map[k] >= 0) continue; /* resident or loading */
        smoe_prefetch_req r = {.key = k, .priority = priorities[i], .seq = ++c->queue_seq};
        int32_t at = c->qpos[k];
        if (at >= 0) { /* supersede: new priority, new place in request order */
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
        c->worker_busy = 1; /* wait_idle must not return before the worker saw the queue */
        pthread_cond_signal(&c->work_cv);
    }
    pthread_mutex_unlock(&c->mu);
    return 0;
}

void smoe_cache_cancel(smoe_cache *c, int32_t key) {
    pthread_mutex_lock(&c->mu);
    if (key < 0) {
        heap_clear(c);
    } else if ((uint64_t)key < (uint64_t)c->num_layers * c->num_experts && c->qpos[key] >= 0) {
        heap_remove_at(c, (uint32_t)c->qpos[key]);
    }
    pthread_mutex_unlock(&c->mu);
}

void smoe_cache_wait_idle(smoe_cache *c) {
    pthread_mutex_lock(&c->mu);
    while (c->worker_started && !c->shutdown &&
           ((c->queue_len > 0 && !c->worker_paused) || c->worker_busy))
        pthread_cond_wait(&c->idle_cv, &c->mu);
    pthread_mutex_unlock(&c->mu);
}

void smoe_cache_pause_worker(smoe_cache *c, int paused) {
    pthread_mutex_lock(&c->mu);
    c->worker_paused = paused != 0;
    if (!c->worker_paused && c->queue_len && c->worker_started && !c->shutdown) {
        c->worker_busy = 1;
        pthread_cond_signal(&c->work_cv);
    }
    pthread_mutex_unlock(&c->mu);
}

uint32_t smoe_cache_queue_len(smoe_cache *c) {
    pthread_mutex_lock(&c->mu);
    uint32_t n = c->queue_len;
    pthread_mutex_unlock(&c->mu);
    return n;
}

int smoe_cache_take_worker_error(smoe_cache *c, smoe_err *err) {
    pthread_mutex_lock(&c->mu);
    int rc = c->worker_err.code;
    if (rc < 0 && err) *err = c->worker_err;
    smoe_err_clear(&c->worker_err);
    pthread_mutex_unlock(&c->mu);
    return rc;
}

/* ---- policy swap, introspection, stats --------------------------------------------------- */

int smoe_cache_set_policy(smoe_cache *c, smoe_policy *p, smoe_err *err) {
    if (p->nslots != c->nslots || p->num_layers != c->num_layers ||
        p->num_experts != c->num_experts) {
        int rc = smoe_err_set(err, SMOE_EINVAL,
                              "policy %s was built for %u slots, %u layers, %u experts; the "
                              "cache has %u slots, %u layers, %u experts", p->ops->name,
                              p->nslots, p->num_layers, p->num_experts, c->nslots,
                              c->num_layers, c->num_experts);
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
    /* insertion sort by last_tick (ticks are unique, so the order is total) */
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

int smoe_cache_set_throttle(smoe_cache *c, double bytes_per_s, double latency_s, smoe_err *err) {
    if (!isfinite(bytes_per_s) || !isfinite(latency_s) || bytes_per_s < 0.0 || latency_s < 0.0)
        return smoe_err_set(err, SMOE_EINVAL,
                            "throttle: bandwidth and latency must be finite and >= 0 (got %g "
                            "bytes/s, %g s)", bytes_per_s, latency_s);
    pthread_mutex_lock(&c->mu);
    c->throttle_bw = bytes_per_s;
    c->throttle_lat_s = latency_s;
    c->link_free_s = 0.0;
    pthread_mutex_unlock(&c->mu);
    return SMOE_OK;
}

int smoe_cache_resident_mask(smoe_cache *c, uint32_t layer, uint8_t *mask, smoe_err *err) {
    if (layer >= c->num_layers)
        return smoe_err_set(err, SMOE_EINVAL, "resident mask: layer %u of %u", layer,
                            c->num_layers);
    const uint32_t E = c->num_experts;
    pthread_mutex_lock(&c->mu);
    const int32_t *m = c->map + (size_t)layer * E;
    for (uint32_t e = 0; e < E; e++)
        mask[e] = (uint8_t)(m[e] >= 0 && c->slots[m[e]].state == SMOE_SLOT_READY);
    pthread_mutex_unlock(&c->mu);
    return SMOE_OK;
}

uint32_t smoe_cache_resident(smoe_cache *c, int32_t *keys) {
    pthread_mutex_lock(&c->mu);
    uint32_t n = 0;
    for (uint32_t s = 0; s < c->nslots; s++)
        if (c->slots[s].state == SMOE_SLOT_READY) keys[n++] = c->slots[s].key;
    pthread_mutex_unlock(&c->mu);
    return n;
}

void smoe_cache_get_stats(smoe_cache *c, smoe_cache_stats *out) {
    pthread_mutex_lock(&c->mu);
    *out = c->stats;
    pthread_mutex_unlock(&c->mu);
}

void smoe_cache_reset_stats(smoe_cache *c) {
    pthread_mutex_lock(&c->mu);
    memset(&c->stats, 0, sizeof c->stats);
    pthread_mutex_unlock(&c->mu);
}

/* ---- activation counts and utility (policies with on_counts / utility, e.g. spac) -------- */

int smoe_cache_counts(smoe_cache *c, const int32_t *keys, const uint32_t *counts, uint32_t n,
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

int smoe_cache_utility(smoe_cache *c, const int32_t *keys, int32_t *out, uint32_t n,
                       smoe_err *err) {
    const int32_t nkeys = (int32_t)(c->num_layers * c->num_experts);
    for (uint32_t i = 0; i < n; i++)
        if (keys[i] < 0 || keys[i] >= nkeys)
            return smoe_err_set(err, SMOE_EINVAL, "utility entry %u: key %d out of range (%u "
                                "layers x %u experts)", i, (int)keys[i], c->num_layers,
                                c->num_experts);
    pthread_mutex_lock(&c->mu);
    int rc = 0;
    if (!c->policy->ops->utility) {
        rc = smoe_err_set(err, SMOE_EPOLICY, "policy %s has no utility (only utility-space "
                          "policies such as spac have one)", c->policy->ops->name);
    } else {
        for (uint32_t i = 0; i < n; i++) out[i] = smoe_policy_utility(c->policy, keys[i]);
        rc = policy_failed(c, err);
    }
    pthread_mutex_unlock(&c->mu);
    return rc;
}

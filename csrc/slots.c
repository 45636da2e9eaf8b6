/* Slot bookkeeping shared by the CPU and GPU caches.  The locking rules, the meaning of every
 * field and the exact behaviour are in slots.h; the policy event contract the code below
 * follows is in policy/policy.h. */
#include "slots.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* ---- small helpers (all with mu held) ---------------------------------------------------- */

static int policy_failed(smoe_slots *t, smoe_err *err) {
    if (t->policy->failure.code == 0) return 0;
    smoe_err_set(err, SMOE_EPOLICY, "policy %s: %s", t->policy->ops->name,
                 t->policy->failure.msg);
    smoe_err_clear(&t->policy->failure);
    return SMOE_EPOLICY;
}

static int evictable_demand(void *ctx, uint32_t s) {
    const smoe_slots *t = ctx;
    return s < t->nslots && t->slots[s].state == SMOE_SLOT_READY && t->slots[s].pins == 0 &&
           !(t->shield && t->protect[t->slots[s].key]);
}

/* A demand-evictable slot that the prefetch admission rule (policy.h) lets go for pf_key. */
static int evictable_prefetch(void *ctx, uint32_t s) {
    const smoe_slots *t = ctx;
    return evictable_demand(ctx, s) &&
           smoe_policy_prefetch_may_evict(t->policy, t->slots[s].last_pass, t->pass_id,
                                          t->slots[s].key, t->pf_key);
}

static int32_t lowest_free(const smoe_slots *t) {
    if (t->nempty == 0) return -1; /* the steady state of a full cache: no scan */
    for (uint32_t s = 0; s < t->nslots; s++)
        if (t->slots[s].state == SMOE_SLOT_EMPTY) return (int32_t)s;
    return -1;
}

/* Evict the resident key of slot s, for a prefetch copy (for_prefetch) or a demand load. */
static void evict(smoe_slots *t, uint32_t s, int for_prefetch) {
    smoe_slot *sl = &t->slots[s];
    int32_t key = sl->key;
    smoe_policy_evict(t->policy, s, key);
    t->map[key] = -1;
    t->evicted_pass[key] = t->pass_id;
    t->pf_victim[key] = (uint8_t)(for_prefetch != 0);
    t->stats.evictions++;
    smoe_admit_evicted(&t->admit);
    if (t->protect[key]) t->stats.protected_evictions++;
    if (sl->prefetched) {
        t->stats.prefetch_wasted++;
        smoe_admit_count(&t->admit, 1); /* a copy prefetching added */
    }
    sl->key = -1;
    sl->state = SMOE_SLOT_EMPTY;
    sl->prefetched = 0;
    t->nempty++;
}

/* Find a slot for a new block without taking it: the lowest-numbered free one (*victim = 0),
 * else the policy's victim among the slots `ok` accepts (*victim = 1, still resident).
 * Returns the slot, or -1 when there is none; a policy failure sets *rc to SMOE_EPOLICY (and
 * fills err). */
static int32_t find_slot(smoe_slots *t, smoe_evictable_fn ok, int *victim, int *rc,
                         smoe_err *err) {
    int32_t s = lowest_free(t);
    *rc = 0;
    *victim = 0;
    if (s >= 0) return s;
    /* lookahead-aware: protected keys go last (smoe_slots_set_protected) */
    t->shield = t->nprotected > 0;
    *rc = smoe_policy_checked_victim(t->policy, ok, t, &s, err);
    if (*rc == 0 && s < 0 && t->shield) {
        t->shield = 0;
        *rc = smoe_policy_checked_victim(t->policy, ok, t, &s, err);
    }
    t->shield = 0;
    if (*rc < 0 || s < 0) return -1;
    *victim = 1;
    return s;
}

/* find_slot, the victim evicted. */
static int32_t take_slot(smoe_slots *t, smoe_evictable_fn ok, int for_prefetch, int *rc,
                         smoe_err *err) {
    int victim;
    int32_t s = find_slot(t, ok, &victim, rc, err);
    if (s >= 0 && victim) evict(t, (uint32_t)s, for_prefetch);
    return s;
}

/* Mark slot s LOADING with key; the caller then calls ops.load with mu released and
 * load_done. */
static void load_begin(smoe_slots *t, uint32_t s, int32_t key, int prefetch) {
    smoe_slot *sl = &t->slots[s];
    if (!prefetch) { /* the byte budget: a demand load of a key a prefetch displaced is extra */
        const uint64_t ev = t->evicted_pass[key];
        smoe_admit_count(&t->admit, t->pf_victim[key] && ev &&
                                        t->pass_id - ev < SMOE_ADMIT_BUDGET_PASSES);
    }
    smoe_policy_insert(t->policy, s, key, prefetch);
    t->nempty--; /* (take_slot gives only EMPTY slots: free or just evicted) */
    sl->key = key;
    sl->state = SMOE_SLOT_LOADING;
    sl->prefetched = (uint8_t)(prefetch != 0);
    sl->pins = prefetch ? 0 : 1;
    sl->last_pass = prefetch ? 0 : t->pass_id;
    sl->last_tick = ++t->tick;
    sl->load_seq++;
    if (sl->load_seq == 0) sl->load_seq = 1;
    t->map[key] = (int32_t)s;
}

int32_t smoe_slots_claim(smoe_slots *t, int32_t key, int prefetch, int *rc, smoe_err *err) {
    t->pf_key = key; /* (read by evictable_prefetch) */
    int32_t s = take_slot(t, prefetch ? evictable_prefetch : evictable_demand, prefetch, rc,
                          err);
    if (s >= 0) load_begin(t, (uint32_t)s, key, prefetch);
    return s;
}

/* A prefetch request the admission rule turned away (counted twice: in the resettable
 * statistics and in the rule's own lifetime count). */
static int32_t refuse(smoe_slots *t) {
    t->stats.prefetch_refused++;
    t->admit.refused++;
    return -3;
}

int32_t smoe_slots_claim_prefetch(smoe_slots *t, const smoe_prefetch_req *r, double now,
                                  int *rc, smoe_err *err) {
    if (!t->admit.on) {
        int32_t s = smoe_slots_claim(t, r->key, 1, rc, err);
        if (s < 0) {
            t->stats.prefetch_dropped++;
            return *rc < 0 ? -2 : -1;
        }
        return s;
    }
    /* a request that cannot pay even with a free slot is refused before any victim search
     * (the search scans the slots with the mutex held) */
    if (!smoe_admit_decide(&t->admit, r->prob, r->issued, r->steps, now, 0.0)) {
        *rc = 0;
        return refuse(t);
    }
    t->pf_key = r->key; /* (read by evictable_prefetch) */
    int victim;
    int32_t s = find_slot(t, evictable_prefetch, &victim, rc, err);
    if (s < 0) {
        t->stats.prefetch_dropped++;
        return *rc < 0 ? -2 : -1;
    }
    double regret = 0.0;
    if (victim) {
        regret = smoe_policy_regret(t->policy, t->slots[s].key);
        if (regret < 0.0) regret = smoe_admit_measured_regret(&t->admit);
    }
    if (victim && !smoe_admit_decide(&t->admit, r->prob, r->issued, r->steps, now, regret))
        return refuse(t);
    if (victim) evict(t, (uint32_t)s, 1);
    load_begin(t, (uint32_t)s, r->key, 1);
    return s;
}

void smoe_slots_missed(smoe_slots *t, int32_t key) {
    const uint64_t ev = t->evicted_pass[key];
    if (ev == t->pass_id) t->stats.collision_misses++;
    if (ev && t->pass_id - ev < SMOE_ADMIT_REGRET_PASSES) smoe_admit_regretted(&t->admit);
}

void smoe_slots_touch(smoe_slots *t, uint32_t s) {
    smoe_slot *sl = &t->slots[s];
    smoe_policy_access(t->policy, s, sl->key);
    sl->last_pass = t->pass_id;
    sl->last_tick = ++t->tick;
    if (sl->prefetched) {
        sl->prefetched = 0;
        t->stats.prefetch_used++;
        smoe_admit_count(&t->admit, 0); /* a needed load, brought by a prefetch */
    }
}

void smoe_slots_set_pass(smoe_slots *t, uint64_t pass_id) {
    t->pass_id = pass_id;
    smoe_policy_pass(t->policy, pass_id);
}

void smoe_slots_set_prior(smoe_slots *t, const float *prior) {
    smoe_policy_prior(t->policy, prior);
}

static void load_done(smoe_slots *t, uint32_t s, int rc, const smoe_err *lerr) {
    smoe_slot *sl = &t->slots[s];
    if (rc == 0) {
        sl->state = SMOE_SLOT_READY;
        t->stats.bytes_read += t->slot_bytes;
    } else {
        int32_t key = sl->key;
        smoe_policy_evict(t->policy, s, key);
        t->map[key] = -1;
        sl->key = -1;
        sl->state = SMOE_SLOT_EMPTY;
        t->nempty++;
        sl->prefetched = 0;
        sl->pins = 0;
        sl->failed_seq = sl->load_seq;
        t->slot_err[s] = *lerr;
        if (lerr->code == 0)
            smoe_err_set(&t->slot_err[s], rc, "loading expert (layer %u, expert %u) into the "
                         "%s failed (code %d)", (uint32_t)key / t->num_experts,
                         (uint32_t)key % t->num_experts, t->what, rc);
    }
    if (t->waiters) pthread_cond_broadcast(&t->cv);
}

void smoe_slots_loaded(smoe_slots *t, uint32_t s) {
    smoe_err none;
    smoe_err_clear(&none);
    load_done(t, s, 0, &none);
}

void smoe_slots_unpin(smoe_slots *t, uint32_t s) {
    if (--t->slots[s].pins == 0 && t->waiters) pthread_cond_broadcast(&t->cv);
}

int smoe_slots_key(const smoe_slots *t, uint32_t layer, uint32_t expert, int32_t *key,
                   smoe_err *err) {
    if (layer >= t->num_layers || expert >= t->num_experts)
        return smoe_err_set(err, SMOE_EINVAL,
                            "expert (layer %u, expert %u) out of range: the store has %u "
                            "layers of %u experts", layer, expert, t->num_layers,
                            t->num_experts);
    *key = smoe_key(layer, expert, t->num_experts);
    return 0;
}

/* Entry i of a caller's key list: SMOE_EINVAL naming it (what, i) when out of range. */
static int check_key(const smoe_slots *t, const char *what, uint32_t i, int32_t key,
                     smoe_err *err) {
    if (key >= 0 && (uint64_t)key < (uint64_t)t->num_layers * t->num_experts) return 0;
    return smoe_err_set(err, SMOE_EINVAL, "%s %u: key %d out of range (%u layers x %u "
                        "experts)", what, i, (int)key, t->num_layers, t->num_experts);
}

/* ---- prefetch queue: binary max-heap on (priority, -seq) with a key -> index map --------- */

static int req_before(const smoe_prefetch_req *a, const smoe_prefetch_req *b) {
    if (a->priority != b->priority) return a->priority > b->priority;
    return a->seq < b->seq;
}

static void heap_set(smoe_slots *t, uint32_t i, smoe_prefetch_req r) {
    t->queue[i] = r;
    t->qpos[r.key] = (int32_t)i;
}

static void heap_up(smoe_slots *t, uint32_t i) {
    smoe_prefetch_req r = t->queue[i];
    while (i > 0) {
        uint32_t p = (i - 1) / 2;
        if (!req_before(&r, &t->queue[p])) break;
        heap_set(t, i, t->queue[p]);
        i = p;
    }
    heap_set(t, i, r);
}

static void heap_down(smoe_slots *t, uint32_t i) {
    smoe_prefetch_req r = t->queue[i];
    for (;;) {
        uint32_t l = 2 * i + 1, best = i;
        const smoe_prefetch_req *bv = &r;
        if (l < t->queue_len && req_before(&t->queue[l], bv)) best = l, bv = &t->queue[l];
        if (l + 1 < t->queue_len && req_before(&t->queue[l + 1], bv)) best = l + 1;
        if (best == i) break;
        heap_set(t, i, t->queue[best]);
        i = best;
    }
    heap_set(t, i, r);
}

static void heap_remove_at(smoe_slots *t, uint32_t i) {
    t->qpos[t->queue[i].key] = -1;
    t->queue_len--;
    if (i == t->queue_len) return;
    int32_t moved = t->queue[t->queue_len].key;
    heap_set(t, i, t->queue[t->queue_len]);
    heap_up(t, i);
    heap_down(t, (uint32_t)t->qpos[moved]);
}

static void heap_clear(smoe_slots *t) {
    for (uint32_t i = 0; i < t->queue_len; i++) t->qpos[t->queue[i].key] = -1;
    t->queue_len = 0;
}

/* ---- worker ------------------------------------------------------------------------------ */

static void *worker_main(void *arg) {
    smoe_slots *t = arg;
    if (t->ops->worker_begin) t->ops->worker_begin(t->owner);
    pthread_mutex_lock(&t->mu);
    for (;;) {
        if (t->shutdown) break;
        if (t->queue_len == 0 || t->worker_paused) {
            t->worker_busy = 0;
            pthread_cond_broadcast(&t->idle_cv);
            pthread_cond_wait(&t->work_cv, &t->mu);
            continue;
        }
        t->worker_busy = 1;
        smoe_prefetch_req r = t->queue[0];
        heap_remove_at(t, 0);
        if (t->map[r.key] >= 0) continue; /* became resident or loading meanwhile */
        smoe_err perr;
        int prc;
        const double start = smoe_now();
        int32_t s = smoe_slots_claim_prefetch(t, &r, start, &prc, &perr);
        if (prc < 0 && t->worker_err.code == 0) t->worker_err = perr;
        if (s < 0) { /* dropped or refused (counted): let waiting demand accesses in first */
            pthread_mutex_unlock(&t->mu);
            pthread_mutex_lock(&t->mu);
            continue;
        }
        t->stats.prefetch_issued++;
        t->worker_loading = 1;
        pthread_mutex_unlock(&t->mu);
        smoe_err lerr;
        smoe_err_clear(&lerr);
        int rc = t->ops->load(t->owner, (uint32_t)s, r.key, &lerr);
        pthread_mutex_lock(&t->mu);
        t->worker_loading = 0;
        smoe_admit_load(&t->admit, smoe_now() - start);
        if (rc < 0) {
            t->stats.prefetch_failed++;
            if (t->worker_err.code == 0) t->worker_err = lerr;
        }
        load_done(t, (uint32_t)s, rc, &lerr);
        if (policy_failed(t, &perr) < 0 && t->worker_err.code == 0) t->worker_err = perr;
    }
    heap_clear(t);
    t->worker_busy = 0;
    pthread_cond_broadcast(&t->idle_cv);
    pthread_mutex_unlock(&t->mu);
    return NULL;
}

/* ---- lifetime ---------------------------------------------------------------------------- */

static void free_arrays(smoe_slots *t) {
    free(t->slots);
    free(t->slot_err);
    free(t->map);
    free(t->qpos);
    free(t->evicted_pass);
    free(t->pf_victim);
    free(t->protect);
    free(t->queue);
    memset(t, 0, sizeof *t);
}

int smoe_slots_init(smoe_slots *t, const char *what, uint32_t num_layers, uint32_t num_experts,
                    uint64_t slot_bytes, uint32_t nslots, uint32_t min_slots,
                    smoe_policy *policy, const smoe_slots_ops *ops, void *owner, smoe_err *err) {
    memset(t, 0, sizeof *t);
    if (nslots == 0)
        return smoe_err_set(err, SMOE_EINVAL, "%s capacity must be at least 1 slot", what);
    if (nslots < min_slots)
        return smoe_err_set(err, SMOE_EINVAL,
                            "%s capacity of %u slots is smaller than top_k = %u: one token "
                            "needs %u experts pinned at once", what, nslots, min_slots,
                            min_slots);
    uint64_t nkeys = (uint64_t)num_layers * num_experts;
    if (nkeys == 0 || nkeys > INT32_MAX)
        return smoe_err_set(err, SMOE_EINVAL, "%s: store has %u layers x %u experts", what,
                            num_layers, num_experts);
    if (policy->nslots != nslots || policy->num_layers != num_layers ||
        policy->num_experts != num_experts)
        return smoe_err_set(err, SMOE_EINVAL,
                            "policy %s was built for %u slots, %u layers, %u experts; the "
                            "%s has %u slots, %u layers, %u experts", policy->ops->name,
                            policy->nslots, policy->num_layers, policy->num_experts, what,
                            nslots, num_layers, num_experts);
    uint64_t slab_bytes = (uint64_t)nslots * slot_bytes;
    if (slot_bytes == 0 || slab_bytes / slot_bytes != nslots || slab_bytes > SIZE_MAX)
        return smoe_err_set(err, SMOE_EINVAL, "%s: %u slots of %llu bytes overflow", what,
                            nslots, (unsigned long long)slot_bytes);
    t->what = what;
    t->ops = ops;
    t->owner = owner;
    t->num_layers = num_layers;
    t->num_experts = num_experts;
    t->nslots = nslots;
    t->slot_bytes = slot_bytes;
    t->slots = calloc(nslots, sizeof *t->slots);
    t->slot_err = calloc(nslots, sizeof *t->slot_err);
    t->map = malloc(nkeys * sizeof *t->map);
    t->qpos = malloc(nkeys * sizeof *t->qpos);
    t->evicted_pass = calloc(nkeys, sizeof *t->evicted_pass);
    t->pf_victim = calloc(nkeys, 1);
    t->protect = calloc(nkeys, 1);
    t->queue_cap = 64;
    t->queue = malloc(t->queue_cap * sizeof *t->queue);
    if (!t->slots || !t->slot_err || !t->map || !t->qpos || !t->evicted_pass || !t->pf_victim ||
        !t->protect || !t->queue) {
        free_arrays(t);
        return smoe_err_set(err, SMOE_ENOMEM, "%s: out of memory for %u slots", what, nslots);
    }
    for (uint64_t k = 0; k < nkeys; k++) t->map[k] = t->qpos[k] = -1;
    for (uint32_t s = 0; s < nslots; s++) t->slots[s].key = -1;
    t->nempty = nslots;
    t->pass_id = 1;
    smoe_admit_init(&t->admit, num_layers);
    pthread_mutex_init(&t->mu, NULL);
    pthread_cond_init(&t->cv, NULL);
    pthread_cond_init(&t->work_cv, NULL);
    pthread_cond_init(&t->idle_cv, NULL);
    t->policy = policy;
    return 0;
}

int smoe_slots_start_worker(smoe_slots *t, smoe_err *err) {
    int rc = pthread_create(&t->worker, NULL, worker_main, t);
    if (rc != 0)
        return smoe_err_set(err, SMOE_ENOMEM, "%s: cannot start the prefetch thread: %s",
                            t->what, strerror(rc));
    t->worker_started = 1;
    return 0;
}

void smoe_slots_stop_worker(smoe_slots *t) {
    pthread_mutex_lock(&t->mu);
    int started = t->worker_started;
    t->worker_started = 0;
    t->shutdown = 1;
    heap_clear(t);
    pthread_cond_broadcast(&t->work_cv);
    pthread_mutex_unlock(&t->mu);
    if (started) pthread_join(t->worker, NULL);
}

void smoe_slots_free(smoe_slots *t) {
    if (!t->slots) return;
    smoe_slots_stop_worker(t);
    pthread_mutex_destroy(&t->mu);
    pthread_cond_destroy(&t->cv);
    pthread_cond_destroy(&t->work_cv);
    pthread_cond_destroy(&t->idle_cv);
    if (t->policy) smoe_policy_destroy(t->policy);
    free_arrays(t);
}

/* ---- demand path ------------------------------------------------------------------------- */

static void wait_cv(smoe_slots *t) {
    t->waiters++;
    pthread_cond_wait(&t->cv, &t->mu);
    t->waiters--;
}

/* With mu held, slot s READY and pinned by this access: policy failure, then ops.pinned; on
 * failure the pin is dropped again. */
static int pinned(smoe_slots *t, uint32_t s, void *stream, int hit, smoe_err *err) {
    int rc = policy_failed(t, err);
    if (rc == 0 && t->ops->pinned) rc = t->ops->pinned(t->owner, s, stream, hit, err);
    if (rc < 0) smoe_slots_unpin(t, s);
    return rc;
}

int smoe_slots_acquire(smoe_slots *t, uint32_t layer, uint32_t expert, void *stream,
                       uint32_t *slot, smoe_err *err) {
    int32_t key = 0;
    int rc = smoe_slots_key(t, layer, expert, &key, err);
    if (rc < 0) return rc;
    pthread_mutex_lock(&t->mu);
    int counted = 0; /* this access has been counted as a miss */
    double t0 = 0.0;
    for (;;) {
        int32_t s = t->map[key];
        if (s >= 0 && t->slots[s].state == SMOE_SLOT_READY) {
            const int prefetched = t->slots[s].prefetched;
            t->slots[s].pins++;
            smoe_slots_touch(t, (uint32_t)s);
            if (!counted) {
                t->stats.hits++;
                if (prefetched) smoe_admit_fetch(&t->admit, 0.0, 0); /* in time */
            } else {
                const double w = smoe_now() - t0; /* waited for another thread's load */
                t->stats.stall_s += w;
                smoe_admit_fetch(&t->admit, w, 0);
            }
            rc = pinned(t, (uint32_t)s, stream, !counted, err);
            if (rc == 0) *slot = (uint32_t)s;
            pthread_mutex_unlock(&t->mu);
            return rc;
        }
        if (!counted) {
            counted = 1;
            t->stats.misses++;
            smoe_slots_missed(t, key);
            if (s >= 0 && t->slots[s].prefetched) t->stats.prefetch_late++;
            t0 = smoe_now();
        }
        if (s >= 0) { /* LOADING by another thread or the worker: wait for that load */
            smoe_slot *sl = &t->slots[s];
            uint32_t seq = sl->load_seq;
            while (sl->state == SMOE_SLOT_LOADING && sl->load_seq == seq) wait_cv(t);
            if (sl->failed_seq == seq) {
                if (err) *err = t->slot_err[s];
                const int frc = t->slot_err[s].code < 0 ? t->slot_err[s].code : SMOE_EIO;
                t->stats.stall_s += smoe_now() - t0;
                pthread_mutex_unlock(&t->mu);
                return frc; /* read under mu: a new load of the slot may rewrite slot_err */
            }
            continue; /* READY now (hit path pins it) or reused: look again */
        }
        s = smoe_slots_claim(t, key, 0, &rc, err);
        if (rc < 0) {
            t->stats.stall_s += smoe_now() - t0;
            pthread_mutex_unlock(&t->mu);
            return rc;
        }
        if (s < 0) { /* everything pinned or loading: wait for a release or a load */
            wait_cv(t);
            continue;
        }
        const int overlap = t->worker_loading; /* a prefetch copy shares the link */
        pthread_mutex_unlock(&t->mu);
        smoe_err lerr;
        smoe_err_clear(&lerr);
        const double l0 = smoe_now();
        rc = t->ops->load(t->owner, (uint32_t)s, key, &lerr);
        const double l1 = smoe_now();
        pthread_mutex_lock(&t->mu);
        load_done(t, (uint32_t)s, rc, &lerr);
        smoe_admit_load(&t->admit, l1 - l0);
        smoe_admit_demand_load(&t->admit, l1 - l0, overlap || t->worker_loading);
        smoe_admit_fetch(&t->admit, l1 - t0, 1);
        t->stats.stall_s += l1 - t0;
        if (rc < 0) {
            if (err) *err = lerr;
        } else {
            rc = pinned(t, (uint32_t)s, stream, 0, err);
            if (rc == 0) *slot = (uint32_t)s;
        }
        pthread_mutex_unlock(&t->mu);
        return rc;
    }
}

int smoe_slots_release(smoe_slots *t, uint32_t layer, uint32_t expert, void *stream,
                       smoe_err *err) {
    int32_t key = 0;
    int rc = smoe_slots_key(t, layer, expert, &key, err);
    if (rc < 0) return rc;
    pthread_mutex_lock(&t->mu);
    int32_t s = t->map[key];
    if (s < 0 || t->slots[s].state != SMOE_SLOT_READY || t->slots[s].pins <= 0) {
        pthread_mutex_unlock(&t->mu);
        return smoe_err_set(err, SMOE_ESTATE, "release of expert (layer %u, expert %u), which "
                            "is not pinned in the %s", layer, expert, t->what);
    }
    if (t->ops->released) rc = t->ops->released(t->owner, (uint32_t)s, stream, err);
    smoe_slots_unpin(t, (uint32_t)s);
    pthread_mutex_unlock(&t->mu);
    return rc;
}

void smoe_slots_begin_pass(smoe_slots *t) { smoe_slots_begin_pass_prior(t, NULL); }

void smoe_slots_begin_pass_prior(smoe_slots *t, const float *prior) {
    pthread_mutex_lock(&t->mu);
    smoe_slots_set_pass(t, t->pass_id + 1);
    if (prior) smoe_slots_set_prior(t, prior);
    smoe_admit_pass(&t->admit, smoe_now());
    pthread_mutex_unlock(&t->mu);
}

void smoe_slots_set_admission(smoe_slots *t, int on, int byte_budget) {
    pthread_mutex_lock(&t->mu);
    t->admit.on = on != 0;
    t->admit.budget = byte_budget ? SMOE_ADMIT_EXTRA : 0.0;
    pthread_mutex_unlock(&t->mu);
}

/* ---- prefetch API ------------------------------------------------------------------------ */

int smoe_slots_prefetch(smoe_slots *t, const int32_t *keys, const float *priorities,
                        uint32_t n, int replace, smoe_err *err) {
    return smoe_slots_prefetch_p(t, keys, priorities, NULL, 1, n, replace, err);
}

int smoe_slots_prefetch_p(smoe_slots *t, const int32_t *keys, const float *priorities,
                          const float *probs, uint32_t steps, uint32_t n, int replace,
                          smoe_err *err) {
    for (uint32_t i = 0; i < n; i++) {
        int rc = check_key(t, "prefetch request", i, keys[i], err);
        if (rc < 0) return rc;
        if (priorities[i] != priorities[i])
            return smoe_err_set(err, SMOE_EINVAL, "prefetch request %u: priority is NaN", i);
        if (probs && !(probs[i] != probs[i]) && !(probs[i] >= 0.0f && probs[i] <= 1.0f))
            return smoe_err_set(err, SMOE_EINVAL, "prefetch request %u: probability %g is "
                                "not in [0, 1]", i, (double)probs[i]);
    }
    const double issued = smoe_now();
    const uint64_t nkeys = (uint64_t)t->num_layers * t->num_experts;
    pthread_mutex_lock(&t->mu);
    if (t->shutdown || !t->worker_started) {
        pthread_mutex_unlock(&t->mu);
        return smoe_err_set(err, SMOE_ESTATE, "prefetch: the %s has no running prefetch "
                            "worker (created with prefetch disabled, or closed)", t->what);
    }
    if (replace) heap_clear(t);
    if (t->queue_len + (uint64_t)n > t->queue_cap) {
        uint64_t cap = t->queue_cap;
        while (cap < t->queue_len + (uint64_t)n) cap *= 2;
        if (cap > nkeys) cap = nkeys; /* a key is queued at most once */
        if (cap < t->queue_cap) cap = t->queue_cap;
        smoe_prefetch_req *q = realloc(t->queue, cap * sizeof *q);
        if (!q) {
            pthread_mutex_unlock(&t->mu);
            return smoe_err_set(err, SMOE_ENOMEM, "prefetch: out of memory for the queue");
        }
        t->queue = q;
        t->queue_cap = (uint32_t)cap;
    }
    for (uint32_t i = 0; i < n; i++) {
        int32_t k = keys[i];
        if (t->map[k] >= 0) continue; /* resident or loading */
        smoe_prefetch_req r = {.key = k, .priority = priorities[i],
                               .prob = probs ? probs[i] : NAN, .steps = steps,
                               .seq = ++t->queue_seq, .issued = issued};
        int32_t at = t->qpos[k];
        if (at >= 0) { /* supersede: new priority, new place in request order */
            t->queue[at] = r;
            heap_up(t, (uint32_t)at);
            heap_down(t, (uint32_t)t->qpos[k]);
        } else {
            uint32_t i2 = t->queue_len++;
            heap_set(t, i2, r);
            heap_up(t, i2);
        }
    }
    if (t->queue_len) {
        t->worker_busy = 1; /* wait_idle must not return before the worker saw the queue */
        pthread_cond_signal(&t->work_cv);
    }
    pthread_mutex_unlock(&t->mu);
    return 0;
}

void smoe_slots_cancel(smoe_slots *t, int32_t key) {
    pthread_mutex_lock(&t->mu);
    if (key < 0) {
        heap_clear(t);
    } else if ((uint64_t)key < (uint64_t)t->num_layers * t->num_experts && t->qpos[key] >= 0) {
        heap_remove_at(t, (uint32_t)t->qpos[key]);
    }
    pthread_mutex_unlock(&t->mu);
}

void smoe_slots_wait_idle(smoe_slots *t) {
    pthread_mutex_lock(&t->mu);
    while (t->worker_started && !t->shutdown &&
           ((t->queue_len > 0 && !t->worker_paused) || t->worker_busy))
        pthread_cond_wait(&t->idle_cv, &t->mu);
    pthread_mutex_unlock(&t->mu);
}

void smoe_slots_pause_worker(smoe_slots *t, int paused) {
    pthread_mutex_lock(&t->mu);
    t->worker_paused = paused != 0;
    if (!t->worker_paused && t->queue_len && t->worker_started && !t->shutdown) {
        t->worker_busy = 1;
        pthread_cond_signal(&t->work_cv);
    }
    pthread_mutex_unlock(&t->mu);
}

uint32_t smoe_slots_queue_len(smoe_slots *t) {
    pthread_mutex_lock(&t->mu);
    uint32_t n = t->queue_len;
    pthread_mutex_unlock(&t->mu);
    return n;
}

int smoe_slots_take_worker_error(smoe_slots *t, smoe_err *err) {
    pthread_mutex_lock(&t->mu);
    int rc = t->worker_err.code;
    if (rc < 0 && err) *err = t->worker_err;
    smoe_err_clear(&t->worker_err);
    pthread_mutex_unlock(&t->mu);
    return rc;
}

/* ---- policy swap, introspection, stats --------------------------------------------------- */

int smoe_slots_set_policy(smoe_slots *t, smoe_policy *p, smoe_err *err) {
    if (p->nslots != t->nslots || p->num_layers != t->num_layers ||
        p->num_experts != t->num_experts) {
        int rc = smoe_err_set(err, SMOE_EINVAL,
                              "policy %s was built for %u slots, %u layers, %u experts; the "
                              "%s has %u slots, %u layers, %u experts", p->ops->name,
                              p->nslots, p->num_layers, p->num_experts, t->what, t->nslots,
                              t->num_layers, t->num_experts);
        smoe_policy_destroy(p);
        return rc;
    }
    uint32_t *order = malloc((size_t)t->nslots * sizeof *order);
    if (!order) {
        smoe_policy_destroy(p);
        return smoe_err_set(err, SMOE_ENOMEM, "set_policy: out of memory");
    }
    pthread_mutex_lock(&t->mu);
    uint32_t n = 0;
    for (uint32_t s = 0; s < t->nslots; s++)
        if (t->slots[s].state != SMOE_SLOT_EMPTY) order[n++] = s;
    /* insertion sort by last_tick (ticks are unique, so the order is total) */
    for (uint32_t i = 1; i < n; i++) {
        uint32_t v = order[i], j = i;
        while (j > 0 && t->slots[order[j - 1]].last_tick > t->slots[v].last_tick) {
            order[j] = order[j - 1];
            j--;
        }
        order[j] = v;
    }
    for (uint32_t i = 0; i < n; i++) smoe_policy_insert(p, order[i], t->slots[order[i]].key, 0);
    smoe_policy *old = t->policy;
    t->policy = p;
    int rc = policy_failed(t, err);
    pthread_mutex_unlock(&t->mu);
    free(order);
    smoe_policy_destroy(old);
    return rc;
}

uint32_t smoe_slots_resident(smoe_slots *t, int32_t *keys) {
    pthread_mutex_lock(&t->mu);
    uint32_t n = 0;
    for (uint32_t s = 0; s < t->nslots; s++)
        if (t->slots[s].state == SMOE_SLOT_READY) keys[n++] = t->slots[s].key;
    pthread_mutex_unlock(&t->mu);
    return n;
}

uint32_t smoe_slots_queued(smoe_slots *t, int32_t *keys, float *prios) {
    pthread_mutex_lock(&t->mu);
    const uint32_t n = t->queue_len;
    /* the heap's entries in its array order, then an insertion sort by req_before on the
     * (key, priority, seq) triples; seq lives in the heap entry, read through qpos */
    for (uint32_t i = 0; i < n; i++) {
        const smoe_prefetch_req *r = &t->queue[i];
        uint32_t j = i;
        while (j > 0 && req_before(r, &t->queue[t->qpos[keys[j - 1]]])) {
            keys[j] = keys[j - 1], prios[j] = prios[j - 1];
            j--;
        }
        keys[j] = r->key, prios[j] = r->priority;
    }
    pthread_mutex_unlock(&t->mu);
    return n;
}

int smoe_slots_layer_states(smoe_slots *t, uint32_t layer, uint8_t *states, smoe_err *err) {
    if (layer >= t->num_layers)
        return smoe_err_set(err, SMOE_EINVAL, "layer states: layer %u of %u", layer,
                            t->num_layers);
    const uint32_t E = t->num_experts;
    pthread_mutex_lock(&t->mu);
    const int32_t *m = t->map + (size_t)layer * E;
    for (uint32_t e = 0; e < E; e++)
        states[e] = m[e] >= 0 ? t->slots[m[e]].state : (uint8_t)SMOE_SLOT_EMPTY;
    pthread_mutex_unlock(&t->mu);
    return SMOE_OK;
}

int smoe_slots_resident_mask(smoe_slots *t, uint32_t layer, uint8_t *mask, smoe_err *err) {
    int rc = smoe_slots_layer_states(t, layer, mask, err);
    if (rc < 0) return rc;
    for (uint32_t e = 0; e < t->num_experts; e++) mask[e] = mask[e] == SMOE_SLOT_READY;
    return SMOE_OK;
}

int smoe_slots_set_protected(smoe_slots *t, const int32_t *keys, uint32_t n, smoe_err *err) {
    const uint64_t nkeys = (uint64_t)t->num_layers * t->num_experts;
    for (uint32_t i = 0; i < n; i++)
        if (keys[i] < 0 || (uint64_t)keys[i] >= nkeys)
            return smoe_err_set(err, SMOE_EINVAL, "protect: key %d of %llu", (int)keys[i],
                                (unsigned long long)nkeys);
    pthread_mutex_lock(&t->mu);
    memset(t->protect, 0, nkeys);
    t->nprotected = 0;
    for (uint32_t i = 0; i < n; i++) {
        t->nprotected += !t->protect[keys[i]];
        t->protect[keys[i]] = 1;
    }
    pthread_mutex_unlock(&t->mu);
    return SMOE_OK;
}

void smoe_slots_get_stats(smoe_slots *t, smoe_cache_stats *out) {
    pthread_mutex_lock(&t->mu);
    *out = t->stats;
    pthread_mutex_unlock(&t->mu);
}

void smoe_slots_get_admission(smoe_slots *t, smoe_admit *out) {
    pthread_mutex_lock(&t->mu);
    *out = t->admit;
    pthread_mutex_unlock(&t->mu);
}

void smoe_slots_reset_stats(smoe_slots *t) {
    pthread_mutex_lock(&t->mu);
    memset(&t->stats, 0, sizeof t->stats);
    pthread_mutex_unlock(&t->mu);
}

/* ---- activation counts and utility (policies with on_counts / utility, e.g. spac) -------- */

int smoe_slots_counts(smoe_slots *t, const int32_t *keys, const uint32_t *counts, uint32_t n,
                      smoe_err *err) {
    int rc = 0;
    for (uint32_t i = 0; i < n && rc == 0; i++) rc = check_key(t, "counts entry", i, keys[i], err);
    if (rc < 0) return rc;
    pthread_mutex_lock(&t->mu);
    smoe_policy_counts(t->policy, keys, counts, n);
    rc = policy_failed(t, err);
    pthread_mutex_unlock(&t->mu);
    return rc;
}

int smoe_slots_utility(smoe_slots *t, const int32_t *keys, int32_t *out, uint32_t n,
                       smoe_err *err) {
    int rc = 0;
    for (uint32_t i = 0; i < n && rc == 0; i++) rc = check_key(t, "utility entry", i, keys[i], err);
    if (rc < 0) return rc;
    pthread_mutex_lock(&t->mu);
    if (!t->policy->ops->utility) {
        rc = smoe_err_set(err, SMOE_EPOLICY, "policy %s has no utility (only utility-space "
                          "policies such as spac have one)", t->policy->ops->name);
    } else {
        for (uint32_t i = 0; i < n; i++) out[i] = smoe_policy_utility(t->policy, keys[i]);
        rc = policy_failed(t, err);
    }
    pthread_mutex_unlock(&t->mu);
    return rc;
}

/* Kernel context and its persistent thread pool.
 *
 * Locking: `call_mu` serializes whole calls (smoe_kpool_lock) so two callers never interleave
 * phases.  `mu` guards gen, fn, arg, open, active and shutdown; workers sleep on work_cv until
 * gen changes, the caller sleeps on done_cv until active reaches 0.
 *
 * Join protocol: a run is `open` from its start until the caller's own fn returns.  A worker
 * joins (active++) only while the run is open; a worker that wakes after the caller closed it
 * skips that run.  The caller then waits only for the workers that joined.  Work inside fn is
 * claimed dynamically (atomic chunk counters, ffn.c), so when a worker is descheduled or wakes
 * late -- common on a shared 2-core machine -- the caller does the work instead of waiting a
 * scheduler time slice (that wait measured ~120-200 us per call under load).
 *
 * Spin-then-wait: a condition-variable wake-up costs ~7 us per phase on the development machine
 * (two phases per call: ~15 us on a 60 us OLMoE int4 decode call), so before sleeping a worker
 * polls gen, and the caller polls active, for SMOE_POOL_SPIN pause iterations (~20-40 us).
 * gen and active are always accessed with __atomic builtins (also under mu) so the polls are
 * race-free; a worker that sees gen change still takes mu to read fn/arg and to join. */
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <unistd.h>

#include "kimpl.h"

#ifndef SMOE_POOL_SPIN
#define SMOE_POOL_SPIN 2000
#endif

static inline void cpu_relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

struct smoe_kpool {
    pthread_mutex_t call_mu;
    pthread_mutex_t mu;
    pthread_cond_t work_cv, done_cv;
    uint64_t gen;       /* [mu] incremented per run */
    smoe_kpool_fn fn;   /* [mu] */
    void *arg;          /* [mu] */
    int open;           /* [mu] the current run still accepts workers */
    uint32_t active;    /* [mu] workers inside fn of the current run */
    int shutdown;       /* [mu] */
    uint32_t nworkers;  /* threads besides the caller; fixed after new */
    uint32_t started;   /* workers actually started */
    pthread_t *threads; /* owned */
};

typedef struct worker_arg {
    smoe_kpool *p;
    uint32_t k;
} worker_arg;

static void *worker_main(void *varg) {
    worker_arg wa = *(worker_arg *)varg;
    free(varg);
    smoe_kpool *p = wa.p;
    uint64_t seen = 0; /* gen is 0 until the first run, which may precede this line */
    pthread_mutex_lock(&p->mu);
    for (;;) {
        if (!p->shutdown && __atomic_load_n(&p->gen, __ATOMIC_ACQUIRE) == seen) {
            pthread_mutex_unlock(&p->mu);
            for (int i = 0; i < SMOE_POOL_SPIN; i++) {
                if (__atomic_load_n(&p->gen, __ATOMIC_ACQUIRE) != seen) break;
                cpu_relax();
            }
            pthread_mutex_lock(&p->mu);
        }
        while (!p->shutdown && __atomic_load_n(&p->gen, __ATOMIC_ACQUIRE) == seen)
            pthread_cond_wait(&p->work_cv, &p->mu);
        if (p->shutdown) break;
        seen = __atomic_load_n(&p->gen, __ATOMIC_ACQUIRE);
        if (!p->open) continue; /* late: the caller already finished this run */
        __atomic_add_fetch(&p->active, 1, __ATOMIC_ACQ_REL);
        smoe_kpool_fn fn = p->fn;
        void *arg = p->arg;
        uint32_t n = p->nworkers + 1;
        pthread_mutex_unlock(&p->mu);
        fn(arg, wa.k, n);
        pthread_mutex_lock(&p->mu);
        if (__atomic_sub_fetch(&p->active, 1, __ATOMIC_ACQ_REL) == 0)
            pthread_cond_signal(&p->done_cv);
    }
    pthread_mutex_unlock(&p->mu);
    return NULL;
}

void smoe_kpool_delete(smoe_kpool *p) {
    if (!p) return;
    pthread_mutex_lock(&p->mu);
    p->shutdown = 1;
    pthread_cond_broadcast(&p->work_cv);
    pthread_mutex_unlock(&p->mu);
    for (uint32_t i = 0; i < p->started; i++) pthread_join(p->threads[i], NULL);
    pthread_cond_destroy(&p->work_cv);
    pthread_cond_destroy(&p->done_cv);
    pthread_mutex_destroy(&p->mu);
    pthread_mutex_destroy(&p->call_mu);
    free(p->threads);
    free(p);
}

int smoe_kpool_new(smoe_kpool **out, uint32_t nthreads, smoe_err *err) {
    *out = NULL;
    smoe_kpool *p = calloc(1, sizeof *p);
    if (!p) return smoe_err_set(err, SMOE_ENOMEM, "kernel pool: out of memory");
    p->nworkers = nthreads > 1 ? nthreads - 1 : 0;
    p->threads = calloc(p->nworkers ? p->nworkers : 1, sizeof *p->threads);
    if (!p->threads) {
        free(p);
        return smoe_err_set(err, SMOE_ENOMEM, "kernel pool: out of memory");
    }
    pthread_mutex_init(&p->call_mu, NULL);
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->work_cv, NULL);
    pthread_cond_init(&p->done_cv, NULL);
    for (uint32_t i = 0; i < p->nworkers; i++) {
        worker_arg *wa = malloc(sizeof *wa);
        if (!wa) {
            p->nworkers = p->started;
            smoe_kpool_delete(p);
            return smoe_err_set(err, SMOE_ENOMEM, "kernel pool: out of memory");
        }
        wa->p = p;
        wa->k = i + 1;
        int rc = pthread_create(&p->threads[i], NULL, worker_main, wa);
        if (rc != 0) {
            free(wa);
            p->nworkers = p->started;
            smoe_kpool_delete(p);
            return smoe_err_set(err, SMOE_ENOMEM, "kernel pool: cannot start thread %u: %s",
                                i + 1, strerror(rc));
        }
        p->started++;
    }
    *out = p;
    return SMOE_OK;
}

void smoe_kpool_run(smoe_kpool *p, smoe_kpool_fn fn, void *arg) {
    if (!p || p->nworkers == 0) {
        fn(arg, 0, 1);
        return;
    }
    pthread_mutex_lock(&p->mu);
    p->fn = fn;
    p->arg = arg;
    p->open = 1;
    __atomic_add_fetch(&p->gen, 1, __ATOMIC_ACQ_REL);
    pthread_cond_broadcast(&p->work_cv);
    pthread_mutex_unlock(&p->mu);
    fn(arg, 0, p->nworkers + 1);
    pthread_mutex_lock(&p->mu);
    p->open = 0; /* no worker joins from here on; wait for those inside fn */
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < SMOE_POOL_SPIN; i++) {
        if (__atomic_load_n(&p->active, __ATOMIC_ACQUIRE) == 0) break;
        cpu_relax();
    }
    pthread_mutex_lock(&p->mu);
    while (__atomic_load_n(&p->active, __ATOMIC_ACQUIRE) > 0)
        pthread_cond_wait(&p->done_cv, &p->mu);
    pthread_mutex_unlock(&p->mu);
}

uint32_t smoe_kpool_threads(const smoe_kpool *p) { return p ? p->nworkers + 1 : 1; }

void smoe_split_init(smoe_split *s, uint32_t n, uint32_t threads) {
    uint32_t R = threads < 1 ? 1 : threads > SMOE_SPLIT_RANGES ? SMOE_SPLIT_RANGES : threads;
    s->ranges = R;
    for (uint32_t r = 0; r < R; r++) {
        uint64_t a = (uint64_t)n * r / R, b = (uint64_t)n * (r + 1) / R;
        __atomic_store_n(&s->r[r].fb, a | b << 32, __ATOMIC_RELAXED);
    }
}

int smoe_split_next(smoe_split *s, uint32_t k, uint32_t *c) {
    const uint32_t R = s->ranges;
    for (uint32_t i = 0; i < R; i++) {
        uint64_t *fb = &s->r[(k + i) % R].fb;
        uint64_t v = __atomic_load_n(fb, __ATOMIC_RELAXED);
        for (;;) {
            uint32_t f = (uint32_t)v, b = (uint32_t)(v >> 32);
            if (f >= b) break;
            /* own range (i == 0): the front; another's: the back */
            uint32_t take = i == 0 ? f : b - 1;
            uint64_t nv = i == 0 ? (uint64_t)(f + 1) | (uint64_t)b << 32
                                 : (uint64_t)f | (uint64_t)(b - 1) << 32;
            if (__atomic_compare_exchange_n(fb, &v, nv, 0, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
                *c = take;
                return 1;
            }
        }
    }
    return 0;
}

void smoe_kpool_lock(smoe_kpool *p) {
    if (p) pthread_mutex_lock(&p->call_mu);
}

void smoe_kpool_unlock(smoe_kpool *p) {
    if (p) pthread_mutex_unlock(&p->call_mu);
}

/* ---- context ---- */

const char *smoe_isa_name(int32_t isa) {
    switch (isa) {
    case SMOE_ISA_SCALAR: return "scalar";
    case SMOE_ISA_AVX2: return "avx2";
    case SMOE_ISA_AVX512: return "avx512";
    default: return "unknown";
    }
}

static void detect(smoe_kctx *c) {
    c->isa_max = SMOE_ISA_SCALAR;
    c->has_bf16 = c->has_vnni = 0;
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
        __builtin_cpu_supports("f16c"))
        c->isa_max = SMOE_ISA_AVX2;
    if (c->isa_max == SMOE_ISA_AVX2 && __builtin_cpu_supports("avx512f") &&
        __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
        __builtin_cpu_supports("avx512dq"))
        c->isa_max = SMOE_ISA_AVX512;
    c->has_vnni = __builtin_cpu_supports("avx512vnni");
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 10
    c->has_bf16 = __builtin_cpu_supports("avx512bf16");
#endif
    /* Measured on one CPU of each kind (ffn_fast.c, rows16_bf16): software prefetch lifts an
     * Intel Xeon's one-stream bf16 and int8 row loops from 0.68-0.78 to 0.92-0.98 of its read
     * loop, and slowed the AMD EPYC hosts' one-stream reads. */
    c->stream_pf = __builtin_cpu_is("intel") ? 4096u : 0u;
#endif
}

int smoe_kctx_init(smoe_kctx *c, uint32_t nthreads, smoe_err *err) {
    memset(c, 0, sizeof *c);
    detect(c);
    c->isa = c->isa_max;
    const char *env = getenv("SPECMOE_ISA");
    if (env && *env && strcasecmp(env, "auto") != 0) {
        int32_t want = -1;
        for (int32_t i = SMOE_ISA_SCALAR; i <= SMOE_ISA_AVX512; i++)
            if (strcasecmp(env, smoe_isa_name(i)) == 0) want = i;
        if (want < 0)
            return smoe_err_set(err, SMOE_EINVAL,
                                "SPECMOE_ISA=%s: expected scalar, avx2, avx512 or auto", env);
        if (want < c->isa) c->isa = want;
    }
    env = getenv("SPECMOE_STREAM_PREFETCH");
    if (env && *env) {
        char *end = NULL;
        unsigned long v = strtoul(env, &end, 10);
        if (*end != '\0' || env[0] == '-' || v > SMOE_STREAM_PF_MAX)
            return smoe_err_set(err, SMOE_EINVAL,
                                "SPECMOE_STREAM_PREFETCH=%s: expected bytes from 0 to %u", env,
                                SMOE_STREAM_PF_MAX);
        c->stream_pf = (uint32_t)v;
    }
    return smoe_kctx_set_threads(c, nthreads, err);
}

int smoe_kctx_set_threads(smoe_kctx *c, uint32_t nthreads, smoe_err *err) {
    if (nthreads == 0) {
        long n = sysconf(_SC_NPROCESSORS_ONLN);
        nthreads = n > 0 ? (uint32_t)n : 1u;
    }
    if (nthreads > 1024)
        return smoe_err_set(err, SMOE_EINVAL, "kernel threads: %u is more than 1024", nthreads);
    smoe_kpool *np = NULL;
    if (nthreads > 1) {
        int rc = smoe_kpool_new(&np, nthreads, err);
        if (rc) return rc;
    }
    smoe_kpool_delete(c->pool);
    c->pool = np;
    c->nthreads = nthreads;
    return SMOE_OK;
}

int smoe_kctx_set_isa(smoe_kctx *c, int32_t isa, smoe_err *err) {
    if (isa < 0) {
        c->isa = c->isa_max;
        return SMOE_OK;
    }
    if (isa > SMOE_ISA_AVX512)
        return smoe_err_set(err, SMOE_EINVAL, "unknown ISA %d", isa);
    if (isa > c->isa_max)
        return smoe_err_set(err, SMOE_EINVAL, "ISA %s is not supported by this CPU (best: %s)",
                            smoe_isa_name(isa), smoe_isa_name(c->isa_max));
    c->isa = isa;
    return SMOE_OK;
}

void smoe_kctx_free(smoe_kctx *c) {
    if (!c) return;
    smoe_kpool_delete(c->pool);
    c->pool = NULL;
}

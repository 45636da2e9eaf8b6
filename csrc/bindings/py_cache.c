/* Python binding of the fast tier: the _C.Cache type (see specmoe/runtime/cache.py for the public
 * ExpertCache wrapper).
 *
 * Every call into the cache takes its mutex, and a Python-bridge policy may take the GIL while
 * that mutex is held (the prefetch worker does so); so every entry point below releases the
 * GIL before calling into cache.c, however short the call.
 *
 * Lifetime: the Cache holds a strong reference to its _C.Store; arrays returned by acquire()
 * view the slab and hold a reference to the Cache, so the slab is freed only at deallocation,
 * never by close().  close() stops the prefetch worker and makes further calls raise
 * CacheError; it refuses while another thread is inside a call on the same object.
 */
#include <stdio.h>
#include <string.h>

#include "cache.h"
#include "py_cache.h"
#include "py_numpy.h"
#include "py_policy.h"
#include "py_store.h"

typedef struct {
    PyObject_HEAD
    smoe_cache cache;
    PyObject *store_obj; /* strong reference to the _C.Store the cache reads from */
    int initialized;     /* cache.c state is valid (freed at dealloc) */
    int closed;          /* close() was called: every method raises CacheError */
    int busy;            /* calls in progress with the GIL released (guarded by the GIL) */
} CacheObject;

static PyTypeObject Cache_Type;

/* Make a policy from a name or take it from a _C.Policy object. */
static smoe_policy *policy_from(PyObject *spec, uint32_t nslots, uint32_t nl, uint32_t ne) {
    if (PyUnicode_Check(spec)) {
        const char *name = PyUnicode_AsUTF8(spec);
        if (!name) return NULL;
        const smoe_policy_params pp = {.nslots = nslots, .num_layers = nl, .num_experts = ne};
        smoe_policy *p = NULL;
        smoe_err err;
        smoe_err_clear(&err);
        if (smoe_policy_create_named(&p, name, &pp, &err) < 0) {
            smoe_py_raise(&err);
            return NULL;
        }
        return p;
    }
    return smoe_py_policy_take(spec, nslots, nl, ne);
}

static int check_open(CacheObject *self) {
    if (!self->initialized || self->closed) {
        PyErr_SetString(smoe_py_CacheError, "the expert cache is closed");
        return -1;
    }
    return 0;
}

/* The store must still be open whenever we start a call that may read from it. */
static int check_store(CacheObject *self) {
    if (check_open(self) < 0) return -1;
    return smoe_py_store_get(self->store_obj) ? 0 : -1;
}

/* The _C.Cache behind obj: obj itself or its `native` attribute (new reference). */
static PyObject *cache_object(PyObject *obj) {
    if (PyObject_TypeCheck(obj, &Cache_Type)) {
        Py_INCREF(obj);
        return obj;
    }
    PyObject *n = PyObject_GetAttrString(obj, "native");
    if (n && PyObject_TypeCheck(n, &Cache_Type)) return n;
    Py_XDECREF(n);
    PyErr_Clear();
    PyErr_Format(PyExc_TypeError, "expected a specmoe ExpertCache or _C.Cache, got %.100s",
                 Py_TYPE(obj)->tp_name);
    return NULL;
}

smoe_cache *smoe_py_cache_begin(PyObject *obj) {
    CacheObject *c = (CacheObject *)cache_object(obj);
    if (!c) return NULL;
    if (check_open(c) < 0) {
        Py_DECREF(c);
        return NULL;
    }
    c->busy++;
    Py_DECREF(c); /* obj (held by the caller) keeps c alive */
    return &c->cache;
}

void smoe_py_cache_end(PyObject *obj) {
    CacheObject *c = (CacheObject *)cache_object(obj);
    if (!c) {
        PyErr_Clear();
        return;
    }
    if (c->busy > 0) c->busy--;
    Py_DECREF(c);
}

static int Cache_init(CacheObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"store", "nslots", "policy", "min_slots", "prefetch", NULL};
    PyObject *store_obj, *policy_obj;
    long long nslots, min_slots = 1;
    int prefetch = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OLO|$Lp:Cache", kwlist, &store_obj, &nslots,
                                     &policy_obj, &min_slots, &prefetch))
        return -1;
    if (self->initialized) {
        PyErr_SetString(smoe_py_CacheError, "Cache.__init__ called twice");
        return -1;
    }
    smoe_store *st = smoe_py_store_get(store_obj);
    if (!st) return -1;
    if (nslots <= 0 || nslots > (long long)INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "nslots must be a positive slot count, got %lld", nslots);
        return -1;
    }
    if (min_slots < 0 || min_slots > (long long)INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "min_slots must be >= 0, got %lld", min_slots);
        return -1;
    }
    if (nslots < min_slots) {
        PyErr_Format(PyExc_ValueError,
                     "cache capacity of %lld slots is smaller than top_k = %lld: one token "
                     "needs %lld experts pinned at once", nslots, min_slots, min_slots);
        return -1;
    }
    smoe_policy *p = policy_from(policy_obj, (uint32_t)nslots, st->num_layers, st->num_experts);
    if (!p) return -1;
    smoe_err err;
    smoe_err_clear(&err);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = smoe_cache_init(&self->cache, st, (uint32_t)nslots, (uint32_t)min_slots, p, prefetch,
                         &err);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        smoe_policy_destroy(p);
        smoe_py_raise(&err);
        return -1;
    }
    Py_INCREF(store_obj);
    self->store_obj = store_obj;
    self->initialized = 1;
    return 0;
}

static void Cache_dealloc(CacheObject *self) {
    if (self->initialized) {
        Py_BEGIN_ALLOW_THREADS
        smoe_cache_free(&self->cache);
        Py_END_ALLOW_THREADS
        self->initialized = 0;
    }
    Py_CLEAR(self->store_obj);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int parse_expert(PyObject *args, const char *fmt, uint32_t *layer, uint32_t *expert) {
    long long l, e;
    if (!PyArg_ParseTuple(args, fmt, &l, &e)) return -1;
    if (l < 0 || e < 0 || l > (long long)UINT32_MAX || e > (long long)UINT32_MAX) {
        PyErr_Format(PyExc_ValueError, "expert (layer %lld, expert %lld) out of range", l, e);
        return -1;
    }
    *layer = (uint32_t)l;
    *expert = (uint32_t)e;
    return 0;
}

static PyObject *Cache_acquire(CacheObject *self, PyObject *args) {
    uint32_t layer, expert;
    if (parse_expert(args, "LL:acquire", &layer, &expert) < 0 || check_store(self) < 0)
        return NULL;
    const uint8_t *data = NULL;
    smoe_err err;
    smoe_err_clear(&err);
    int rc;
    self->busy++;
    Py_BEGIN_ALLOW_THREADS
    rc = smoe_cache_acquire(&self->cache, layer, expert, &data, &err);
    Py_END_ALLOW_THREADS
    self->busy--;
    if (rc < 0) return smoe_py_raise(&err);
    npy_intp dims[1] = {(npy_intp)self->cache.tab.slot_bytes};
    PyObject *arr = PyArray_New(&PyArray_Type, 1, dims, NPY_UINT8, NULL, (void *)data, 0,
                                NPY_ARRAY_C_CONTIGUOUS | NPY_ARRAY_ALIGNED, NULL);
    if (!arr) goto undo;
    Py_INCREF(self);
    if (PyArray_SetBaseObject((PyArrayObject *)arr, (PyObject *)self) < 0) {
        Py_DECREF(arr);
        goto undo;
    }
    return arr;
undo:
    Py_BEGIN_ALLOW_THREADS
    smoe_cache_release(&self->cache, layer, expert, &err);
    Py_END_ALLOW_THREADS
    return NULL;
}

static PyObject *Cache_release(CacheObject *self, PyObject *args) {
    uint32_t layer, expert;
    if (parse_expert(args, "LL:release", &layer, &expert) < 0 || check_open(self) < 0)
        return NULL;
    smoe_err err;
    smoe_err_clear(&err);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = smoe_cache_release(&self->cache, layer, expert, &err);
    Py_END_ALLOW_THREADS
    if (rc < 0) return smoe_py_raise(&err);
    Py_RETURN_NONE;
}

static PyObject *Cache_begin_pass(CacheObject *self, PyObject *Py_UNUSED(ignored)) {
    if (check_open(self) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS
    smoe_slots_begin_pass(&self->cache.tab);
    Py_END_ALLOW_THREADS
    return PyLong_FromUnsignedLongLong(self->cache.tab.pass_id);
}

static PyObject *Cache_prefetch(CacheObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"keys", "priorities", "replace", "probs", "steps", NULL};
    PyObject *ko, *po, *qo = Py_None;
    int replace = 0;
    unsigned int steps = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|p$OI:prefetch", kwlist, &ko, &po, &replace,
                                     &qo, &steps))
        return NULL;
    if (check_store(self) < 0) return NULL;
    PyArrayObject *k = (PyArrayObject *)PyArray_FROMANY(ko, NPY_INT32, 1, 1,
                                                        NPY_ARRAY_IN_ARRAY | NPY_ARRAY_FORCECAST);
    if (!k) return NULL;
    PyArrayObject *p = (PyArrayObject *)PyArray_FROMANY(po, NPY_FLOAT32, 1, 1,
                                                        NPY_ARRAY_IN_ARRAY | NPY_ARRAY_FORCECAST);
    if (!p) {
        Py_DECREF(k);
        return NULL;
    }
    npy_intp n = PyArray_DIM(k, 0);
    PyArrayObject *q = NULL;
    if (qo != Py_None) {
        q = (PyArrayObject *)PyArray_FROMANY(qo, NPY_FLOAT32, 1, 1,
                                             NPY_ARRAY_IN_ARRAY | NPY_ARRAY_FORCECAST);
        if (!q) {
            Py_DECREF(k);
            Py_DECREF(p);
            return NULL;
        }
    }
    if (PyArray_DIM(p, 0) != n || (q && PyArray_DIM(q, 0) != n) || n > (npy_intp)UINT32_MAX) {
        PyErr_Format(PyExc_ValueError, "prefetch: %zd keys but %zd priorities and %zd probs",
                     (Py_ssize_t)n, (Py_ssize_t)PyArray_DIM(p, 0),
                     q ? (Py_ssize_t)PyArray_DIM(q, 0) : (Py_ssize_t)n);
        Py_DECREF(k);
        Py_DECREF(p);
        Py_XDECREF(q);
        return NULL;
    }
    smoe_err err;
    smoe_err_clear(&err);
    int rc;
    const int32_t *kd = PyArray_DATA(k);
    const float *pd = PyArray_DATA(p);
    const float *qd = q ? PyArray_DATA(q) : NULL;
    Py_BEGIN_ALLOW_THREADS
    rc = smoe_slots_prefetch_p(&self->cache.tab, kd, pd, qd, steps, (uint32_t)n, replace, &err);
    Py_END_ALLOW_THREADS
    Py_DECREF(k);
    Py_DECREF(p);
    Py_XDECREF(q);
    if (rc < 0) return smoe_py_raise(&err);
    Py_RETURN_NONE;
}

static PyObject *Cache_cancel(CacheObject *self, PyObject *args) {
    long long key = -1;
    if (!PyArg_ParseTuple(args, "|L:cancel", &key) || check_open(self) < 0) return NULL;
    uint64_t nkeys = (uint64_t)self->cache.tab.num_layers * self->cache.tab.num_experts;
    if (key < -1 || (key >= 0 && (uint64_t)key >= nkeys)) {
        PyErr_Format(PyExc_ValueError, "cancel: key %lld out of range [0, %llu) (or -1 for all)",
                     key, (unsigned long long)nkeys);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    smoe_slots_cancel(&self->cache.tab, (int32_t)key);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *Cache_wait_idle(CacheObject *self, PyObject *Py_UNUSED(ignored)) {
    if (check_open(self) < 0) return NULL;
    self->busy++;
    Py_BEGIN_ALLOW_THREADS
    smoe_slots_wait_idle(&self->cache.tab);
    Py_END_ALLOW_THREADS
    self->busy--;
    Py_RETURN_NONE;
}

static PyObject *Cache_pause_prefetch(CacheObject *self, PyObject *arg) {
    if (check_open(self) < 0) return NULL;
    int paused = PyObject_IsTrue(arg);
    if (paused < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS
    smoe_slots_pause_worker(&self->cache.tab, paused);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *Cache_queue_len(CacheObject *self, PyObject *Py_UNUSED(ignored)) {
    if (check_open(self) < 0) return NULL;
    uint32_t n;
    Py_BEGIN_ALLOW_THREADS
    n = smoe_slots_queue_len(&self->cache.tab);
    Py_END_ALLOW_THREADS
    return PyLong_FromUnsignedLong(n);
}

static PyObject *Cache_take_prefetch_error(CacheObject *self, PyObject *Py_UNUSED(ignored)) {
    if (check_open(self) < 0) return NULL;
    smoe_err err;
    smoe_err_clear(&err);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = smoe_slots_take_worker_error(&self->cache.tab, &err);
    Py_END_ALLOW_THREADS
    if (rc < 0) return smoe_py_raise(&err);
    Py_RETURN_NONE;
}

static PyObject *Cache_set_policy(CacheObject *self, PyObject *arg) {
    if (check_open(self) < 0) return NULL;
    smoe_policy *p = policy_from(arg, self->cache.tab.nslots, self->cache.tab.num_layers,
                                 self->cache.tab.num_experts);
    if (!p) return NULL;
    smoe_err err;
    smoe_err_clear(&err);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = smoe_slots_set_policy(&self->cache.tab, p, &err);
    Py_END_ALLOW_THREADS
    if (rc < 0) return smoe_py_raise(&err);
    Py_RETURN_NONE;
}

/* ko as the cache's keys: a new contiguous int32 array of at most UINT32_MAX keys, each in
 * 0..num_layers*num_experts-1 (`what` names the call in errors), its length in *n.  The
 * cache must be open.  NULL with an exception set. */
static PyArrayObject *cache_keys(CacheObject *self, PyObject *ko, const char *what,
                                 npy_intp *n) {
    if (check_open(self) < 0) return NULL;
    const uint64_t nkeys = (uint64_t)self->cache.tab.num_layers * self->cache.tab.num_experts;
    char name[48];
    snprintf(name, sizeof name, "%s keys", what);
    PyArrayObject *k = smoe_py_index_array(ko, nkeys, name, "key");
    if (!k) return NULL;
    *n = PyArray_DIM(k, 0);
    if (*n > (npy_intp)UINT32_MAX) {
        PyErr_Format(PyExc_ValueError, "%s: too many keys", what);
        Py_DECREF(k);
        return NULL;
    }
    return k;
}

static PyObject *Cache_observe_counts(CacheObject *self, PyObject *args) {
    PyObject *ko, *co;
    if (!PyArg_ParseTuple(args, "OO:observe_counts", &ko, &co)) return NULL;
    if (check_open(self) < 0) return NULL;
    const uint64_t nkeys = (uint64_t)self->cache.tab.num_layers * self->cache.tab.num_experts;
    PyArrayObject *k = smoe_py_index_array(ko, nkeys, "observe_counts keys", "key");
    if (!k) return NULL;
    PyArrayObject *c = smoe_py_index_array(co, (uint64_t)1 << 31, "observe_counts counts",
                                           "count");
    if (!c) {
        Py_DECREF(k);
        return NULL;
    }
    npy_intp n = PyArray_DIM(k, 0);
    if (PyArray_DIM(c, 0) != n || n > (npy_intp)UINT32_MAX) {
        PyErr_Format(PyExc_ValueError, "observe_counts: %zd keys but %zd counts", (Py_ssize_t)n,
                     (Py_ssize_t)PyArray_DIM(c, 0));
        Py_DECREF(k);
        Py_DECREF(c);
        return NULL;
    }
    smoe_err err;
    smoe_err_clear(&err);
    int rc;
    const int32_t *kd = PyArray_DATA(k);
    const uint32_t *cd = PyArray_DATA(c); /* non-negative int32 values: same bits as uint32 */
    Py_BEGIN_ALLOW_THREADS
    rc = smoe_slots_counts(&self->cache.tab, kd, cd, (uint32_t)n, &err);
    Py_END_ALLOW_THREADS
    Py_DECREF(k);
    Py_DECREF(c);
    if (rc < 0) return smoe_py_raise(&err);
    Py_RETURN_NONE;
}

static PyObject *Cache_utility(CacheObject *self, PyObject *ko) {
    npy_intp n;
    PyArrayObject *k = cache_keys(self, ko, "utility", &n);
    if (!k) return NULL;
    PyArrayObject *out = (PyArrayObject *)PyArray_SimpleNew(1, &n, NPY_INT32);
    if (!out) {
        Py_DECREF(k);
        return NULL;
    }
    smoe_err err;
    smoe_err_clear(&err);
    int rc;
    const int32_t *kd = PyArray_DATA(k);
    int32_t *od = PyArray_DATA(out);
    Py_BEGIN_ALLOW_THREADS
    rc = smoe_slots_utility(&self->cache.tab, kd, od, (uint32_t)n, &err);
    Py_END_ALLOW_THREADS
    Py_DECREF(k);
    if (rc < 0) {
        Py_DECREF(out);
        return smoe_py_raise(&err);
    }
    return (PyObject *)out;
}

static PyObject *Cache_protect(CacheObject *self, PyObject *ko) {
    npy_intp n;
    PyArrayObject *k = cache_keys(self, ko, "protect", &n);
    if (!k) return NULL;
    smoe_err err;
    smoe_err_clear(&err);
    int rc;
    const int32_t *kd = PyArray_DATA(k);
    Py_BEGIN_ALLOW_THREADS
    rc = smoe_slots_set_protected(&self->cache.tab, kd, (uint32_t)n, &err);
    Py_END_ALLOW_THREADS
    Py_DECREF(k);
    if (rc < 0) return smoe_py_raise(&err);
    Py_RETURN_NONE;
}

static PyObject *Cache_resident(CacheObject *self, PyObject *Py_UNUSED(ignored)) {
    if (check_open(self) < 0) return NULL;
    npy_intp dims[1] = {(npy_intp)self->cache.tab.nslots};
    PyArrayObject *a = (PyArrayObject *)PyArray_SimpleNew(1, dims, NPY_INT32);
    if (!a) return NULL;
    int32_t *keys = PyArray_DATA(a);
    uint32_t n;
    Py_BEGIN_ALLOW_THREADS
    n = smoe_slots_resident(&self->cache.tab, keys);
    Py_END_ALLOW_THREADS
    PyObject *out = PySequence_GetSlice((PyObject *)a, 0, (Py_ssize_t)n);
    Py_DECREF(a);
    return out;
}

static int put_u64(PyObject *d, const char *k, uint64_t v) {
    PyObject *o = PyLong_FromUnsignedLongLong(v);
    if (!o) return -1;
    int rc = PyDict_SetItemString(d, k, o);
    Py_DECREF(o);
    return rc;
}

static int put_f64(PyObject *d, const char *k, double v) {
    PyObject *o = PyFloat_FromDouble(v);
    if (!o) return -1;
    int rc = PyDict_SetItemString(d, k, o);
    Py_DECREF(o);
    return rc;
}

static PyObject *Cache_stats(CacheObject *self, PyObject *Py_UNUSED(ignored)) {
    if (check_open(self) < 0) return NULL;
    smoe_cache_stats s;
    Py_BEGIN_ALLOW_THREADS
    smoe_slots_get_stats(&self->cache.tab, &s);
    Py_END_ALLOW_THREADS
    PyObject *d = PyDict_New();
    if (!d) return NULL;
    uint64_t acc = s.hits + s.misses;
    if (put_u64(d, "hits", s.hits) < 0 || put_u64(d, "misses", s.misses) < 0 ||
        put_f64(d, "hit_rate", acc ? (double)s.hits / (double)acc : 0.0) < 0 ||
        put_u64(d, "collision_misses", s.collision_misses) < 0 ||
        put_u64(d, "prefetch_issued", s.prefetch_issued) < 0 ||
        put_u64(d, "prefetch_used", s.prefetch_used) < 0 ||
        put_u64(d, "prefetch_late", s.prefetch_late) < 0 ||
        put_u64(d, "prefetch_wasted", s.prefetch_wasted) < 0 ||
        put_u64(d, "prefetch_dropped", s.prefetch_dropped) < 0 ||
        put_u64(d, "prefetch_refused", s.prefetch_refused) < 0 ||
        put_u64(d, "prefetch_failed", s.prefetch_failed) < 0 ||
        put_u64(d, "evictions", s.evictions) < 0 || put_u64(d, "bytes_read", s.bytes_read) < 0 ||
        put_u64(d, "protected_evictions", s.protected_evictions) < 0 ||
        put_f64(d, "stall_s", s.stall_s) < 0) {
        Py_DECREF(d);
        return NULL;
    }
    return d;
}

static PyObject *Cache_set_admission(CacheObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"on", "byte_budget", NULL};
    int on = 0, budget = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "p|p:set_admission", kwlist, &on, &budget) ||
        check_open(self) < 0)
        return NULL;
    Py_BEGIN_ALLOW_THREADS
    smoe_slots_set_admission(&self->cache.tab, on, budget);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *Cache_admission(CacheObject *self, PyObject *Py_UNUSED(ignored)) {
    if (check_open(self) < 0) return NULL;
    smoe_admit a;
    Py_BEGIN_ALLOW_THREADS
    smoe_slots_get_admission(&self->cache.tab, &a);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("{s:O,s:d,s:d,s:d,s:d,s:d,s:d,s:d,s:O,s:d,s:d,s:O,s:K}", "on",
                         a.on ? Py_True : Py_False, "load_s", a.load_s, "step_s", a.step_s,
                         "busy", a.busy, "contention", a.contention, "demand_s", a.demand_s,
                         "fetch_s", a.fetch_s, "measured_regret",
                         smoe_admit_measured_regret(&a), "byte_budget",
                         a.budget > 0.0 ? Py_True : Py_False, "needed_loads", a.needed,
                         "added_loads", a.extra, "over_budget",
                         smoe_admit_over_budget(&a) ? Py_True : Py_False, "refused",
                         (unsigned long long)a.refused);
}

static PyObject *Cache_reset_stats(CacheObject *self, PyObject *Py_UNUSED(ignored)) {
    if (check_open(self) < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS
    smoe_slots_reset_stats(&self->cache.tab);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *Cache_set_throttle(CacheObject *self, PyObject *args) {
    double bw, lat;
    if (!PyArg_ParseTuple(args, "dd:set_throttle", &bw, &lat) || check_open(self) < 0)
        return NULL;
    smoe_err e;
    smoe_err_clear(&e);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = smoe_cache_set_throttle(&self->cache, bw, lat, &e);
    Py_END_ALLOW_THREADS
    if (rc) return smoe_py_raise(&e);
    Py_RETURN_NONE;
}

/* acquire+release of each key in `keys`, `iters` times, in one C loop without the GIL;
 * returns the elapsed seconds.  Benchmarks the hit path (keys should be resident). */
static PyObject *Cache_bench_hits(CacheObject *self, PyObject *args) {
    PyObject *ko;
    long long iters;
    if (!PyArg_ParseTuple(args, "OL:bench_hits", &ko, &iters) || check_store(self) < 0)
        return NULL;
    if (iters < 0) {
        PyErr_SetString(PyExc_ValueError, "bench_hits: iters must be >= 0");
        return NULL;
    }
    PyArrayObject *k = (PyArrayObject *)PyArray_FROMANY(ko, NPY_INT32, 1, 1,
                                                        NPY_ARRAY_IN_ARRAY | NPY_ARRAY_FORCECAST);
    if (!k) return NULL;
    npy_intp n = PyArray_DIM(k, 0);
    const int32_t *kd = PyArray_DATA(k);
    uint32_t ne = self->cache.tab.num_experts;
    uint64_t nkeys = (uint64_t)self->cache.tab.num_layers * ne;
    for (npy_intp i = 0; i < n; i++)
        if (kd[i] < 0 || (uint64_t)kd[i] >= nkeys) {
            PyErr_Format(PyExc_ValueError, "bench_hits: key %d out of range", (int)kd[i]);
            Py_DECREF(k);
            return NULL;
        }
    smoe_err err;
    smoe_err_clear(&err);
    int rc = 0;
    double t0, t1;
    self->busy++;
    Py_BEGIN_ALLOW_THREADS
    t0 = smoe_now();
    for (long long it = 0; it < iters && rc == 0; it++)
        for (npy_intp i = 0; i < n; i++) {
            const uint8_t *data;
            uint32_t l = (uint32_t)kd[i] / ne, e = (uint32_t)kd[i] % ne;
            if ((rc = smoe_cache_acquire(&self->cache, l, e, &data, &err)) < 0) break;
            if ((rc = smoe_cache_release(&self->cache, l, e, &err)) < 0) break;
        }
    t1 = smoe_now();
    Py_END_ALLOW_THREADS
    self->busy--;
    Py_DECREF(k);
    if (rc < 0) return smoe_py_raise(&err);
    return PyFloat_FromDouble(t1 - t0);
}

static PyObject *Cache_close(CacheObject *self, PyObject *Py_UNUSED(ignored)) {
    if (!self->initialized || self->closed) Py_RETURN_NONE;
    if (self->busy) {
        PyErr_SetString(smoe_py_CacheError,
                        "close(): another thread is inside a call on this cache");
        return NULL;
    }
    self->closed = 1;
    Py_BEGIN_ALLOW_THREADS
    smoe_slots_stop_worker(&self->cache.tab);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *Cache_get_nslots(CacheObject *self, void *c) {
    (void)c;
    return PyLong_FromUnsignedLong(self->cache.tab.nslots);
}
static PyObject *Cache_get_slot_bytes(CacheObject *self, void *c) {
    (void)c;
    return PyLong_FromUnsignedLongLong(self->cache.tab.slot_bytes);
}
static PyObject *Cache_get_num_layers(CacheObject *self, void *c) {
    (void)c;
    return PyLong_FromUnsignedLong(self->cache.tab.num_layers);
}
static PyObject *Cache_get_num_experts(CacheObject *self, void *c) {
    (void)c;
    return PyLong_FromUnsignedLong(self->cache.tab.num_experts);
}
static PyObject *Cache_get_closed(CacheObject *self, void *c) {
    (void)c;
    return PyBool_FromLong(!self->initialized || self->closed);
}
static PyObject *Cache_get_store(CacheObject *self, void *c) {
    (void)c;
    if (!self->store_obj) Py_RETURN_NONE;
    Py_INCREF(self->store_obj);
    return self->store_obj;
}
static PyObject *Cache_get_policy_name(CacheObject *self, void *c) {
    (void)c;
    if (check_open(self) < 0) return NULL;
    const char *name;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->cache.tab.mu);
    name = self->cache.tab.policy->ops->name;
    pthread_mutex_unlock(&self->cache.tab.mu);
    Py_END_ALLOW_THREADS
    return PyUnicode_FromString(name);
}
static PyObject *Cache_get_pass_id(CacheObject *self, void *c) {
    (void)c;
    if (check_open(self) < 0) return NULL;
    uint64_t id;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->cache.tab.mu);
    id = self->cache.tab.pass_id;
    pthread_mutex_unlock(&self->cache.tab.mu);
    Py_END_ALLOW_THREADS
    return PyLong_FromUnsignedLongLong(id);
}

static PyGetSetDef Cache_getset[] = {
    {"nslots", (getter)Cache_get_nslots, NULL, "Number of slots.", NULL},
    {"slot_bytes", (getter)Cache_get_slot_bytes, NULL, "Bytes per slot (the store's block size).", NULL},
    {"num_layers", (getter)Cache_get_num_layers, NULL, "Layers in the store.", NULL},
    {"num_experts", (getter)Cache_get_num_experts, NULL, "Experts per layer in the store.", NULL},
    {"closed", (getter)Cache_get_closed, NULL, "Whether close() was called.", NULL},
    {"store", (getter)Cache_get_store, NULL, "The _C.Store read from.", NULL},
    {"policy_name", (getter)Cache_get_policy_name, NULL, "Name of the current eviction policy.", NULL},
    {"pass_id", (getter)Cache_get_pass_id, NULL, "Current forward pass id (starts at 1).", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef Cache_methods[] = {
    {"acquire", (PyCFunction)Cache_acquire, METH_VARARGS,
     "acquire(layer, expert) -> read-only uint8 array of the pinned block (loads on a miss)."},
    {"release", (PyCFunction)Cache_release, METH_VARARGS, "release(layer, expert): drop one pin."},
    {"begin_pass", (PyCFunction)Cache_begin_pass, METH_NOARGS,
     "begin_pass() -> new pass id: starts a forward pass (policy on_pass)."},
    {"prefetch", (PyCFunction)(void (*)(void))Cache_prefetch, METH_VARARGS | METH_KEYWORDS,
     "prefetch(keys, priorities, replace=False, *, probs=None, steps=1): queue prefetch "
     "requests (key = layer*num_experts+expert, higher priority first; probs: each one's "
     "probability of use for the admission rule, steps: layer steps ahead it is needed)."},
    {"cancel", (PyCFunction)Cache_cancel, METH_VARARGS,
     "cancel(key=-1): drop the queued request for key, or all with -1."},
    {"wait_idle", (PyCFunction)Cache_wait_idle, METH_NOARGS,
     "wait_idle(): block until the prefetch queue is empty and the worker idle."},
    {"pause_prefetch", (PyCFunction)Cache_pause_prefetch, METH_O,
     "pause_prefetch(paused): stop (True) or resume (False) starting new prefetch loads."},
    {"queue_len", (PyCFunction)Cache_queue_len, METH_NOARGS,
     "queue_len() -> number of queued prefetch requests."},
    {"take_prefetch_error", (PyCFunction)Cache_take_prefetch_error, METH_NOARGS,
     "take_prefetch_error(): raise (and forget) the first prefetch load error since the last "
     "call, if any."},
    {"set_policy", (PyCFunction)Cache_set_policy, METH_O,
     "set_policy(policy): swap the eviction policy, keeping the contents."},
    {"resident", (PyCFunction)Cache_resident, METH_NOARGS,
     "resident() -> int32 array of the keys of READY slots, in slot order."},
    {"observe_counts", (PyCFunction)Cache_observe_counts, METH_VARARGS,
     "observe_counts(keys, counts): activation counts of one verification pass for the policy "
     "(counts[i] tokens activate keys[i]; the keys' layers are observed; no-op for a policy "
     "without counts)."},
    {"protect", (PyCFunction)Cache_protect, METH_O,
     "protect(keys): the keys evicted last, after every unprotected evictable slot (the "
     "lookahead buffer; replaces the previous set; an empty array clears it)."},
    {"utility", (PyCFunction)Cache_utility, METH_O,
     "utility(keys) -> int32 array: the policy's utility per key (PolicyError if it has none)."},
    {"stats", (PyCFunction)Cache_stats, METH_NOARGS, "stats() -> dict of counters."},
    {"reset_stats", (PyCFunction)Cache_reset_stats, METH_NOARGS, "reset_stats(): zero the counters."},
    {"set_admission", (PyCFunction)(void (*)(void))Cache_set_admission,
     METH_VARARGS | METH_KEYWORDS,
     "set_admission(on, byte_budget=True): prefetch admission by expected benefit "
     "(csrc/admit.h) on or off, with its byte budget or the time terms alone."},
    {"admission", (PyCFunction)Cache_admission, METH_NOARGS,
     "admission() -> dict: the admission rule's switch, its measured estimates (load_s, "
     "step_s, busy, measured_regret), its byte budget's counts and its refusals."},
    {"set_throttle", (PyCFunction)Cache_set_throttle, METH_VARARGS,
     "set_throttle(bytes_per_s, latency_s): emulate a slower link for every store read "
     "(SpecMD A.4; 0, 0: off)."},
    {"bench_hits", (PyCFunction)Cache_bench_hits, METH_VARARGS,
     "bench_hits(keys, iters) -> seconds for iters rounds of acquire+release over keys in C."},
    {"close", (PyCFunction)Cache_close, METH_NOARGS,
     "close(): stop the prefetch worker; later calls raise CacheError."},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject Cache_Type = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "specmoe._C.Cache",
    .tp_basicsize = sizeof(CacheObject),
    .tp_dealloc = (destructor)Cache_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = "Cache(store, nslots, policy, *, min_slots=1, prefetch=True): the fast tier "
              "(see specmoe.ExpertCache).",
    .tp_methods = Cache_methods,
    .tp_getset = Cache_getset,
    .tp_init = (initproc)Cache_init,
    .tp_new = PyType_GenericNew,
};

int smoe_py_cache_init(PyObject *m) {
    if (PyModule_AddType(m, &Cache_Type) < 0) return -1;
    return 0;
}

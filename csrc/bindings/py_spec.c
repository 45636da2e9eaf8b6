/* Python binding for the speculation area: _C.SpecController (static, heuristic, cascade,
 * speq; see spec/controller.h) and _C.NgramDrafter (spec/ngram.h).  Every argument is checked
 * here or in the C layer; bad input raises ValueError/TypeError, never aborts. */
#include "py_numpy.h"
#include "spec/controller.h"
#include "spec/ngram.h"
#include "spec/verify.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

/* A long long that must fit in int32: ValueError otherwise (what names the argument). */
static int to_i32(long long v, const char *what, int32_t *out) {
    if (v < INT32_MIN || v > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "%s=%lld is out of range", what, v);
        return -1;
    }
    *out = (int32_t)v;
    return 0;
}

/* A 1-D contiguous float64 copy of a sequence/array; NULL with an exception set. */
static PyArrayObject *f64_vector(PyObject *obj, const char *what) {
    PyArrayObject *a = (PyArrayObject *)PyArray_FROM_OTF(obj, NPY_FLOAT64, NPY_ARRAY_IN_ARRAY);
    if (!a) return NULL;
    if (PyArray_NDIM(a) != 1) {
        PyErr_Format(PyExc_ValueError, "%s must be 1-D, got %d dimensions", what,
                     PyArray_NDIM(a));
        Py_DECREF(a);
        return NULL;
    }
    return a;
}

/* ------------------------------------------------------------------------------------------ */
/* _C.SpecController */

typedef struct {
    PyObject_HEAD
    smoe_spec_ctl *c;
} SpecControllerObject;

static void SpecController_dealloc(SpecControllerObject *self) {
    smoe_spec_ctl_destroy(self->c);
    self->c = NULL;
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int SpecController_init(SpecControllerObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"name",         "k_max",    "k",           "initial",
                             "trials",       "trial_len", "set_len",    "backoff_max",
                             "base_len",     "base_refresh", "alpha",   "p_init",
                             "telemetry_cap", "probe", "trial_pool", "converge", "t_first",
                             "budget", NULL};
    const char *name;
    long long v[9] = {0};
    double alpha = 0.0, p_init = 0.0, converge = 0.0, t_first = 0.0, budget = 0.0;
    long long cap = 0, probe = 0, pool = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "s|$LLLLLLLLLddLLLddd:SpecController", kwlist,
                                     &name, &v[0], &v[1], &v[2], &v[3], &v[4], &v[5], &v[6],
                                     &v[7], &v[8], &alpha, &p_init, &cap, &probe, &pool,
                                     &converge, &t_first, &budget))
        return -1;
    const smoe_spec_ctl_ops *ops = smoe_spec_ctl_find(name);
    if (!ops) {
        PyErr_Format(PyExc_ValueError,
                     "unknown speculation controller %R (known: static, heuristic, cascade, speq)",
                     PyTuple_GET_ITEM(args, 0));
        return -1;
    }
    smoe_spec_params p;
    memset(&p, 0, sizeof p);
    int32_t *fields[9] = {&p.k_max,   &p.k,           &p.initial,  &p.trials,      &p.trial_len,
                          &p.set_len, &p.backoff_max, &p.base_len, &p.base_refresh};
    for (int i = 0; i < 9; i++)
        if (to_i32(v[i], kwlist[i + 1], fields[i]) < 0) return -1;
    if (cap < 0 || cap > UINT32_MAX) {
        PyErr_Format(PyExc_ValueError, "telemetry_cap=%lld is out of range", cap);
        return -1;
    }
    p.telemetry_cap = (uint32_t)cap;
    if (to_i32(probe, "probe", &p.probe) < 0) return -1;
    if (to_i32(pool, "trial_pool", &p.trial_pool) < 0) return -1;
    if (isnan(alpha) || isnan(p_init)) {
        PyErr_SetString(PyExc_ValueError, "alpha and p_init must not be NaN");
        return -1;
    }
    p.alpha = alpha;
    p.p_init = p_init;
    if (isnan(converge)) {
        PyErr_SetString(PyExc_ValueError, "converge must not be NaN");
        return -1;
    }
    p.converge = converge;
    if (isnan(t_first)) {
        PyErr_SetString(PyExc_ValueError, "t_first must not be NaN");
        return -1;
    }
    p.t_first = t_first;
    if (isnan(budget)) {
        PyErr_SetString(PyExc_ValueError, "budget must not be NaN");
        return -1;
    }
    p.budget = budget;
    smoe_err err;
    smoe_err_clear(&err);
    smoe_spec_ctl *c = NULL;
    if (smoe_spec_ctl_create(&c, ops, &p, &err) < 0) {
        smoe_py_raise(&err);
        return -1;
    }
    smoe_spec_ctl_destroy(self->c);
    self->c = c;
    return 0;
}

#define CTL_CHECK(self)                                                             \
    do {                                                                            \
        if (!(self)->c) {                                                           \
            PyErr_SetString(PyExc_ValueError, "SpecController was not initialised"); \
            return NULL;                                                            \
        }                                                                           \
    } while (0)

static PyObject *SpecController_next_k(SpecControllerObject *self, PyObject *unused) {
    (void)unused;
    CTL_CHECK(self);
    return PyLong_FromLong(smoe_spec_ctl_next_k(self->c));
}

/* A 1-D C-contiguous int32 ndarray (the Python layer converts and checks); NULL + TypeError. */
static int i32_rows(PyObject *obj, const char *what, npy_intp *n) {
    if (!PyArray_Check(obj) || PyArray_TYPE((PyArrayObject *)obj) != NPY_INT32 ||
        PyArray_NDIM((PyArrayObject *)obj) != 1 ||
        !PyArray_IS_C_CONTIGUOUS((PyArrayObject *)obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be a 1-D C-contiguous int32 array", what);
        return -1;
    }
    *n = PyArray_DIM((PyArrayObject *)obj, 0);
    return 0;
}

static PyObject *SpecController_observe(SpecControllerObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"k",      "accepted", "t_iter",        "experts_loaded",
                             "t_draft", "t_io",    "rows_k",        "rows_accepted", NULL};
    long long k, acc, loaded = 0;
    double t_iter, t_draft = 0.0, t_io = 0.0;
    PyObject *rk = Py_None, *ra = Py_None;
    CTL_CHECK(self);
    if (!PyArg_ParseTupleAndKeywords(args, kw, "LLd|LddOO:observe", kwlist, &k, &acc, &t_iter,
                                     &loaded, &t_draft, &t_io, &rk, &ra))
        return NULL;
    smoe_spec_obs o;
    memset(&o, 0, sizeof o);
    if (to_i32(k, "k", &o.k) < 0 || to_i32(acc, "accepted", &o.accepted) < 0) return NULL;
    o.t_iter = t_iter;
    o.experts_loaded = loaded;
    o.t_draft = t_draft;
    o.t_io = t_io;
    if ((rk == Py_None) != (ra == Py_None)) {
        PyErr_SetString(PyExc_ValueError, "observe: give both rows_k and rows_accepted or neither");
        return NULL;
    }
    if (rk != Py_None) {
        npy_intp n1, n2;
        if (i32_rows(rk, "rows_k", &n1) < 0 || i32_rows(ra, "rows_accepted", &n2) < 0)
            return NULL;
        if (n1 != n2 || n1 < 1 || n1 > INT32_MAX) {
            PyErr_Format(PyExc_ValueError,
                         "observe: rows_k and rows_accepted must have the same length >= 1, "
                         "got %lld and %lld", (long long)n1, (long long)n2);
            return NULL;
        }
        o.nrows = (int32_t)n1;
        o.row_k = PyArray_DATA((PyArrayObject *)rk);
        o.row_acc = PyArray_DATA((PyArrayObject *)ra);
    }
    smoe_err err;
    smoe_err_clear(&err);
    if (smoe_spec_ctl_observe(self->c, &o, &err) < 0) return smoe_py_raise(&err);
    Py_RETURN_NONE;
}

static PyObject *SpecController_set_success(SpecControllerObject *self, PyObject *args,
                                            PyObject *kw) {
    static char *kwlist[] = {"on", "min_obs", "probe", NULL};
    int on = 1;
    long long min_obs = 4, probe = 64;
    CTL_CHECK(self);
    if (!PyArg_ParseTupleAndKeywords(args, kw, "p|LL:set_success", kwlist, &on, &min_obs,
                                     &probe))
        return NULL;
    int32_t m, p;
    if (to_i32(min_obs, "min_obs", &m) < 0 || to_i32(probe, "probe", &p) < 0) return NULL;
    smoe_err err;
    smoe_err_clear(&err);
    if (smoe_spec_ctl_set_success(self->c, on, m, p, &err) < 0) return smoe_py_raise(&err);
    Py_RETURN_NONE;
}

static PyObject *SpecController_set_batch(SpecControllerObject *self, PyObject *arg) {
    CTL_CHECK(self);
    long long b = PyLong_AsLongLong(arg);
    if (b == -1 && PyErr_Occurred()) return NULL;
    int32_t b32;
    if (to_i32(b, "batch", &b32) < 0) return NULL;
    smoe_err err;
    smoe_err_clear(&err);
    if (smoe_spec_ctl_set_batch(self->c, b32, &err) < 0) return smoe_py_raise(&err);
    Py_RETURN_NONE;
}

/* success_model() -> (lambda[0..k_max], speedup[0..k_max], delta, has_delta, batch) */
static PyObject *SpecController_success_model(SpecControllerObject *self, PyObject *unused) {
    (void)unused;
    CTL_CHECK(self);
    int32_t km = self->c->params.k_max;
    PyObject *lam = PyList_New(km + 1), *sp = PyList_New(km + 1);
    if (!lam || !sp) {
        Py_XDECREF(lam);
        Py_XDECREF(sp);
        return NULL;
    }
    for (int32_t k = 0; k <= km; k++) {
        PyObject *a = PyFloat_FromDouble(smoe_spec_ctl_lambda(self->c, k));
        PyObject *b = PyFloat_FromDouble(smoe_spec_ctl_speedup(self->c, k));
        if (!a || !b) {
            Py_XDECREF(a);
            Py_XDECREF(b);
            Py_DECREF(lam);
            Py_DECREF(sp);
            return NULL;
        }
        PyList_SET_ITEM(lam, k, a);
        PyList_SET_ITEM(sp, k, b);
    }
    return Py_BuildValue("(NNdii)", lam, sp, self->c->has_delta ? self->c->delta : 0.0,
                         (int)self->c->has_delta, (int)self->c->batch);
}

static PyObject *SpecController_set_tau(SpecControllerObject *self, PyObject *arg) {
    CTL_CHECK(self);
    PyArrayObject *a = f64_vector(arg, "tau");
    if (!a) return NULL;
    npy_intp n = PyArray_DIM(a, 0);
    smoe_err err;
    smoe_err_clear(&err);
    int rc = n > SMOE_SPEC_TAU_MAX
                 ? smoe_err_set(&err, SMOE_EINVAL, "tau: at most %d entries, got %lld",
                                SMOE_SPEC_TAU_MAX, (long long)n)
                 : smoe_spec_ctl_set_tau(self->c, PyArray_DATA(a), (int32_t)n, &err);
    Py_DECREF(a);
    if (rc < 0) return smoe_py_raise(&err);
    Py_RETURN_NONE;
}

static PyObject *SpecController_set_io_cost(SpecControllerObject *self, PyObject *arg) {
    CTL_CHECK(self);
    PyArrayObject *a = f64_vector(arg, "io_cost");
    if (!a) return NULL;
    npy_intp n = PyArray_DIM(a, 0);
    smoe_err err;
    smoe_err_clear(&err);
    int rc = n > SMOE_SPEC_KMAX + 1
                 ? smoe_err_set(&err, SMOE_EINVAL, "io_cost: at most k_max+1 entries, got %lld",
                                (long long)n)
                 : smoe_spec_ctl_set_io_cost(self->c, PyArray_DATA(a), (int32_t)n, &err);
    Py_DECREF(a);
    if (rc < 0) return smoe_py_raise(&err);
    Py_RETURN_NONE;
}

static PyObject *SpecController_telemetry(SpecControllerObject *self, PyObject *unused) {
    (void)unused;
    CTL_CHECK(self);
    smoe_spec_ctl *c = self->c;
    npy_intp n = (npy_intp)(c->n_obs < c->ring_cap ? c->n_obs : c->ring_cap);
    smoe_spec_rec *recs = malloc((size_t)(n ? n : 1) * sizeof *recs);
    if (!recs) return PyErr_NoMemory();
    smoe_spec_ctl_telemetry(c, recs);
    static const char *names[] = {"iter",  "k",         "accepted",      "t_iter",
                                  "utility", "phase",   "k_planned",     "experts_loaded"};
    static const int types[] = {NPY_UINT64, NPY_INT32, NPY_INT32, NPY_FLOAT64,
                                NPY_FLOAT64, NPY_INT32, NPY_INT32, NPY_INT64};
    PyObject *d = PyDict_New();
    if (!d) goto fail;
    for (int f = 0; f < 8; f++) {
        PyArrayObject *a = (PyArrayObject *)PyArray_SimpleNew(1, &n, types[f]);
        if (!a) goto fail;
        char *dst = PyArray_DATA(a);
        for (npy_intp i = 0; i < n; i++) {
            const smoe_spec_rec *r = &recs[i];
            switch (f) {
            case 0: ((uint64_t *)dst)[i] = r->iter; break;
            case 1: ((int32_t *)dst)[i] = r->k; break;
            case 2: ((int32_t *)dst)[i] = r->accepted; break;
            case 3: ((double *)dst)[i] = r->t_iter; break;
            case 4: ((double *)dst)[i] = r->utility; break;
            case 5: ((int32_t *)dst)[i] = r->phase; break;
            case 6: ((int32_t *)dst)[i] = r->k_planned; break;
            default: ((int64_t *)dst)[i] = r->experts_loaded; break;
            }
        }
        int rc = PyDict_SetItemString(d, names[f], (PyObject *)a);
        Py_DECREF(a);
        if (rc < 0) goto fail;
    }
    free(recs);
    return d;
fail:
    free(recs);
    Py_XDECREF(d);
    return NULL;
}

static PyObject *SpecController_speq_model(SpecControllerObject *self, PyObject *arg) {
    CTL_CHECK(self);
    long k = PyLong_AsLong(arg);
    if (k == -1 && PyErr_Occurred()) return NULL;
    if (self->c->ops != &smoe_spec_speq) {
        PyErr_SetString(PyExc_ValueError, "speq_model: only the speq controller has this model");
        return NULL;
    }
    if (k < 0 || k > self->c->params.k_max) {
        PyErr_Format(PyExc_ValueError, "speq_model: k must be in 0..k_max=%d, got %ld",
                     (int)self->c->params.k_max, k);
        return NULL;
    }
    return Py_BuildValue("(dd)", smoe_spec_speq_expected_tokens(self->c, (int32_t)k),
                         smoe_spec_speq_cycle_time(self->c, (int32_t)k));
}

static PyObject *SpecController_speq_parts(SpecControllerObject *self, PyObject *arg) {
    CTL_CHECK(self);
    long k = PyLong_AsLong(arg);
    if (k == -1 && PyErr_Occurred()) return NULL;
    double p[4];
    if (k < 0 || k > self->c->params.k_max ||
        smoe_spec_speq_cycle_parts(self->c, (int32_t)k, p) != 0) {
        PyErr_Format(PyExc_ValueError, "speq_parts: the speq controller only, k in 0..k_max=%d, "
                     "got %ld", (int)self->c->params.k_max, k);
        return NULL;
    }
    return Py_BuildValue("(dddd)", p[0], p[1], p[2], p[3]);
}

static PyObject *SpecController_get_name(SpecControllerObject *self, void *closure) {
    (void)closure;
    CTL_CHECK(self);
    return PyUnicode_FromString(self->c->ops->name);
}
static PyObject *SpecController_get_k_max(SpecControllerObject *self, void *closure) {
    (void)closure;
    CTL_CHECK(self);
    return PyLong_FromLong(self->c->params.k_max);
}
static PyObject *SpecController_get_phase(SpecControllerObject *self, void *closure) {
    (void)closure;
    CTL_CHECK(self);
    return PyLong_FromLong(self->c->ops->phase(self->c));
}
static PyObject *SpecController_get_base(SpecControllerObject *self, void *closure) {
    (void)closure;
    CTL_CHECK(self);
    return PyFloat_FromDouble(smoe_spec_ctl_base(self->c));
}
static PyObject *SpecController_get_n_obs(SpecControllerObject *self, void *closure) {
    (void)closure;
    CTL_CHECK(self);
    return PyLong_FromUnsignedLongLong(self->c->n_obs);
}
static PyObject *SpecController_get_spent(SpecControllerObject *self, void *closure) {
    (void)closure;
    CTL_CHECK(self);
    return Py_BuildValue("(dd)", self->c->spec_loss, self->c->t_total);
}
static PyObject *SpecController_get_allowed(SpecControllerObject *self, void *closure) {
    (void)closure;
    CTL_CHECK(self);
    PyObject *l = PyList_New(0);
    if (!l) return NULL;
    for (int32_t k = 0; k <= self->c->params.k_max; k++) {
        if (!self->c->allowed[k]) continue;
        PyObject *v = PyLong_FromLong(k);
        if (!v || PyList_Append(l, v) < 0) {
            Py_XDECREF(v);
            Py_DECREF(l);
            return NULL;
        }
        Py_DECREF(v);
    }
    return l;
}

static PyObject *SpecController_begin_request(SpecControllerObject *self,
                                              PyObject *Py_UNUSED(ignored)) {
    if (!self->c) {
        PyErr_SetString(PyExc_RuntimeError, "SpecController is not initialised");
        return NULL;
    }
    smoe_spec_ctl_begin_request(self->c);
    Py_RETURN_NONE;
}

static PyMethodDef SpecController_methods[] = {
    {"begin_request", (PyCFunction)SpecController_begin_request, METH_NOARGS,
     "begin_request(): a new request starts (cascade drops its per-request state)."},
    {"next_k", (PyCFunction)SpecController_next_k, METH_NOARGS,
     "next_k() -> int: K for the next iteration (0 = no speculation); does not change state."},
    {"observe", (PyCFunction)(void (*)(void))SpecController_observe, METH_VARARGS | METH_KEYWORDS,
     "observe(k, accepted, t_iter, experts_loaded=0, t_draft=0.0, t_io=0.0, rows_k=None, "
     "rows_accepted=None): learn from one iteration (rows: a batch step)."},
    {"set_success", (PyCFunction)(void (*)(void))SpecController_set_success,
     METH_VARARGS | METH_KEYWORDS,
     "set_success(on, min_obs=4, probe=64): success-condition pruning S(K) > 1 (controller.h)."},
    {"set_batch", (PyCFunction)SpecController_set_batch, METH_O,
     "set_batch(b): batch size of the next steps; a change re-measures the plain step."},
    {"success_model", (PyCFunction)SpecController_success_model, METH_NOARGS,
     "success_model() -> (lambda list, speedup list, delta, has_delta, batch)."},
    {"set_tau", (PyCFunction)SpecController_set_tau, METH_O,
     "set_tau(tau): tau[i] = tau(i+1) = T(1)/T(i+1); K allowed iff (K+1)*tau(K+1) > 1."},
    {"set_io_cost", (PyCFunction)SpecController_set_io_cost, METH_O,
     "set_io_cost(cost): cost[k] = expected seconds of loading missing experts when verifying "
     "k drafts (speq)."},
    {"telemetry", (PyCFunction)SpecController_telemetry, METH_NOARGS,
     "telemetry() -> dict of numpy arrays (iter, k, accepted, t_iter, utility, phase, "
     "k_planned, experts_loaded), oldest first."},
    {"speq_model", (PyCFunction)SpecController_speq_model, METH_O,
     "speq_model(k) -> (E[N(k)], T_cycle(k)) of the speq governor's current model."},
    {"speq_parts", (PyCFunction)SpecController_speq_parts, METH_O,
     "speq_parts(k) -> (draft, first fetch, verify, io) seconds: T_cycle(k)'s terms."},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef SpecController_getset[] = {
    {"name", (getter)SpecController_get_name, NULL, "controller name", NULL},
    {"k_max", (getter)SpecController_get_k_max, NULL, "largest K", NULL},
    {"phase", (getter)SpecController_get_phase, NULL, "current phase (0 none, 1 base, 2 test, "
                                                      "3 set, 4 backoff)", NULL},
    {"base", (getter)SpecController_get_base, NULL,
     "mean t_iter of the last base_len K=0 iterations (NaN when none)", NULL},
    {"n_obs", (getter)SpecController_get_n_obs, NULL, "iterations observed", NULL},
    {"spent", (getter)SpecController_get_spent, NULL,
     "(L, T): seconds speculation cost against plain steps, seconds observed (the slowdown "
     "budget, controller.h)", NULL},
    {"allowed", (getter)SpecController_get_allowed, NULL, "K values allowed by tau pruning",
     NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyTypeObject SpecController_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "specmoe._C.SpecController",
    .tp_basicsize = sizeof(SpecControllerObject),
    .tp_dealloc = (destructor)SpecController_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "SpecController(name, *, k_max=8, k=0, initial=0, trials=4, trial_len=4, "
              "set_len=16, backoff_max=1024, base_len=4, base_refresh=100, alpha=0.2, "
              "p_init=0.6, telemetry_cap=65536, probe=16, trial_pool=12, converge=0.1, "
              "t_first=0, budget=0.05): a speculation controller (0 = default).",
    .tp_methods = SpecController_methods,
    .tp_getset = SpecController_getset,
    .tp_init = (initproc)SpecController_init,
    .tp_new = PyType_GenericNew,
};

/* ------------------------------------------------------------------------------------------ */
/* _C.NgramDrafter */

/* busy is set (GIL held) while a call runs with the GIL released, so a second thread using
 * the same drafter meanwhile gets an error instead of a data race. */
typedef struct {
    PyObject_HEAD
    smoe_ngram g;
    int ready;
    int busy;
} NgramObject;

static void Ngram_dealloc(NgramObject *self) {
    if (self->ready) smoe_ngram_free(&self->g);
    self->ready = 0;
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int Ngram_init(NgramObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"max_n", "min_n", NULL};
    long long max_n = 3, min_n = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|LL:NgramDrafter", kwlist, &max_n, &min_n))
        return -1;
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "NgramDrafter is in use by another thread");
        return -1;
    }
    int32_t a, b;
    if (to_i32(max_n, "max_n", &a) < 0 || to_i32(min_n, "min_n", &b) < 0) return -1;
    smoe_ngram g;
    smoe_err err;
    smoe_err_clear(&err);
    if (smoe_ngram_init(&g, a, b, &err) < 0) {
        smoe_py_raise(&err);
        return -1;
    }
    if (self->ready) smoe_ngram_free(&self->g);
    self->g = g;
    self->ready = 1;
    return 0;
}

#define NG_CHECK(self)                                                                  \
    do {                                                                                \
        if (!(self)->ready) {                                                           \
            PyErr_SetString(PyExc_ValueError, "NgramDrafter was not initialised");       \
            return NULL;                                                                \
        }                                                                               \
        if ((self)->busy) {                                                             \
            PyErr_SetString(PyExc_RuntimeError,                                         \
                            "NgramDrafter is in use by another thread (not thread-safe)"); \
            return NULL;                                                                \
        }                                                                               \
    } while (0)

static PyObject *Ngram_append(NgramObject *self, PyObject *arg) {
    NG_CHECK(self);
    PyArrayObject *a = smoe_py_index_array(arg, (uint64_t)INT32_MAX + 1, "tokens", "token id");
    if (!a) return NULL;
    smoe_err err;
    smoe_err_clear(&err);
    int rc;
    npy_intp n = PyArray_DIM(a, 0);
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS
    rc = smoe_ngram_append(&self->g, PyArray_DATA(a), (int64_t)n, &err);
    Py_END_ALLOW_THREADS
    self->busy = 0;
    Py_DECREF(a);
    if (rc < 0) return smoe_py_raise(&err);
    Py_RETURN_NONE;
}

static PyObject *Ngram_reset(NgramObject *self, PyObject *unused) {
    (void)unused;
    NG_CHECK(self);
    smoe_ngram_reset(&self->g);
    Py_RETURN_NONE;
}

/* Make the drafter's history equal to hist: keep the common prefix, truncate the rest
 * (rebuilding the index), append the new tail. */
static int ngram_sync(smoe_ngram *g, const int32_t *h, int64_t n, smoe_err *err) {
    int64_t m = g->len < n ? g->len : n;
    int64_t same = 0;
    if (m > 0 && memcmp(g->hist, h, (size_t)m * sizeof *h) == 0) {
        same = m;
    } else {
        while (same < m && g->hist[same] == h[same]) same++;
    }
    if (same < g->len) {
        int rc = smoe_ngram_truncate(g, same, err);
        if (rc) return rc;
    }
    return smoe_ngram_append(g, h + same, n - same, err);
}

static PyObject *Ngram_propose(NgramObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"history", "k", NULL};
    PyObject *hist;
    long long k;
    NG_CHECK(self);
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OL:propose", kwlist, &hist, &k)) return NULL;
    if (k < 0 || k > (1 << 20)) {
        PyErr_Format(PyExc_ValueError, "propose: k must be in 0..%d, got %lld", 1 << 20, k);
        return NULL;
    }
    smoe_err err;
    smoe_err_clear(&err);
    if (hist != Py_None) {
        PyArrayObject *a = smoe_py_index_array(hist, (uint64_t)INT32_MAX + 1, "history",
                                                 "token id");
        if (!a) return NULL;
        int rc;
        npy_intp n = PyArray_DIM(a, 0);
        self->busy = 1;
        Py_BEGIN_ALLOW_THREADS
        rc = ngram_sync(&self->g, PyArray_DATA(a), (int64_t)n, &err);
        Py_END_ALLOW_THREADS
        self->busy = 0;
        Py_DECREF(a);
        if (rc < 0) return smoe_py_raise(&err);
    }
    if (self->g.len == 0) {
        PyErr_SetString(PyExc_ValueError, "propose: the history is empty");
        return NULL;
    }
    int32_t *out = malloc((size_t)(k ? k : 1) * sizeof *out);
    if (!out) return PyErr_NoMemory();
    int32_t n_out = 0, n_match = 0;
    if (smoe_ngram_propose(&self->g, (int32_t)k, out, &n_out, &n_match, &err) < 0) {
        free(out);
        return smoe_py_raise(&err);
    }
    PyObject *l = PyList_New(n_out);
    if (!l) {
        free(out);
        return NULL;
    }
    for (int32_t i = 0; i < n_out; i++) {
        PyObject *v = PyLong_FromLong(out[i]);
        if (!v) {
            free(out);
            Py_DECREF(l);
            return NULL;
        }
        PyList_SET_ITEM(l, i, v);
    }
    free(out);
    return l;
}

static PyObject *Ngram_get_len(NgramObject *self, void *closure) {
    (void)closure;
    NG_CHECK(self);
    return PyLong_FromLongLong(self->g.len);
}
static PyObject *Ngram_get_max_n(NgramObject *self, void *closure) {
    (void)closure;
    NG_CHECK(self);
    return PyLong_FromLong(self->g.max_n);
}
static PyObject *Ngram_get_min_n(NgramObject *self, void *closure) {
    (void)closure;
    NG_CHECK(self);
    return PyLong_FromLong(self->g.min_n);
}

static PyMethodDef Ngram_methods[] = {
    {"append", (PyCFunction)Ngram_append, METH_O, "append(tokens): extend the history."},
    {"reset", (PyCFunction)Ngram_reset, METH_NOARGS, "reset(): forget the history."},
    {"propose", (PyCFunction)(void (*)(void))Ngram_propose, METH_VARARGS | METH_KEYWORDS,
     "propose(history, k) -> list[int]: sync the history (None keeps it), then propose k "
     "tokens or none."},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef Ngram_getset[] = {
    {"length", (getter)Ngram_get_len, NULL, "tokens in the history", NULL},
    {"max_n", (getter)Ngram_get_max_n, NULL, "longest n-gram matched", NULL},
    {"min_n", (getter)Ngram_get_min_n, NULL, "shortest n-gram matched", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyTypeObject Ngram_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "specmoe._C.NgramDrafter",
    .tp_basicsize = sizeof(NgramObject),
    .tp_dealloc = (destructor)Ngram_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "NgramDrafter(max_n=3, min_n=1): prompt-lookup drafter (see spec/ngram.h).",
    .tp_methods = Ngram_methods,
    .tp_getset = Ngram_getset,
    .tp_init = (initproc)Ngram_init,
    .tp_new = PyType_GenericNew,
};

/* ------------------------------------------------------------------------------------------ */
/* _C.spec_accept */

/* Decisions (see also spec/verify.h):
 * - p and q must be numpy arrays of exactly float32 (native byte order), u of exactly float64,
 *   2-D, C-contiguous and aligned: TypeError for the wrong type/dtype, ValueError for the
 *   wrong shape/layout.  No silent conversion of the large arrays, so no hidden copy per token.
 * - draft is small (K ids), so any integer sequence or array is accepted and converted to
 *   int64 (a list from NgramDrafter.propose works); floats and bools raise TypeError, an
 *   empty sequence of any dtype means K = 0.
 * - Every value is checked (smoe_spec_accept_check) before the rule runs, so bad input raises
 *   ValueError instead of answering garbage; in greedy mode a q given is checked too.
 *   check=False skips only the O((2K+1)V) scan of the entries of p and q (for a loop that
 *   makes its rows with softmax itself); shapes, dtypes, draft ids and u are always checked,
 *   which is what memory safety needs (see spec/verify.h).
 * - The GIL is released only when the arrays hold at least SPEC_NOGIL_MIN elements: below
 *   that the work takes about a microsecond and giving the GIL away could cost more (another
 *   thread may keep it for a whole switch interval). */
#define SPEC_NOGIL_MIN (1 << 16)

/* obj as a 2-D C-contiguous aligned native array of exactly `type`, borrowed (no new ref). */
static PyArrayObject *exact_matrix(PyObject *obj, int type, const char *name, const char *tname) {
    if (!PyArray_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "spec_accept: %s must be a numpy.ndarray of %s, got %s",
                     name, tname, Py_TYPE(obj)->tp_name);
        return NULL;
    }
    PyArrayObject *a = (PyArrayObject *)obj;
    if (PyArray_TYPE(a) != type || !PyArray_ISNOTSWAPPED(a)) {
        PyErr_Format(PyExc_TypeError, "spec_accept: %s must have dtype %s (native byte order), "
                     "got %R", name, tname, (PyObject *)PyArray_DESCR(a));
        return NULL;
    }
    if (PyArray_NDIM(a) != 2) {
        PyErr_Format(PyExc_ValueError, "spec_accept: %s must be 2-D, got %d dimensions", name,
                     PyArray_NDIM(a));
        return NULL;
    }
    if (!PyArray_IS_C_CONTIGUOUS(a) || !PyArray_ISALIGNED(a)) {
        PyErr_Format(PyExc_ValueError, "spec_accept: %s must be C-contiguous and aligned "
                     "(use numpy.ascontiguousarray)", name);
        return NULL;
    }
    return a;
}

/* draft as a new 1-D contiguous int64 array (values are range-checked later). */
static PyArrayObject *draft_array(PyObject *obj) {
    PyArrayObject *a = (PyArrayObject *)PyArray_FROM_O(obj);
    if (!a) return NULL;
    if (PyArray_NDIM(a) != 1) {
        PyErr_Format(PyExc_ValueError, "spec_accept: draft must be 1-D, got %d dimensions",
                     PyArray_NDIM(a));
        Py_DECREF(a);
        return NULL;
    }
    if (PyArray_SIZE(a) > 0 && !PyArray_ISINTEGER(a)) {
        PyErr_Format(PyExc_TypeError, "spec_accept: draft must hold integer token ids, got "
                     "dtype %R", (PyObject *)PyArray_DESCR(a));
        Py_DECREF(a);
        return NULL;
    }
    /* FORCECAST: uint64 ids >= 2^63 wrap negative and are refused by the range check. */
    PyArrayObject *b = (PyArrayObject *)PyArray_FROM_OTF((PyObject *)a, NPY_INT64,
                                                         NPY_ARRAY_IN_ARRAY | NPY_ARRAY_FORCECAST);
    Py_DECREF(a);
    return b;
}

static PyObject *py_spec_accept(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"p", "draft", "q", "u", "check", NULL};
    PyObject *po, *dobj, *qo = Py_None, *uo = Py_None;
    int check = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|OO$p:spec_accept", kwlist, &po, &dobj, &qo,
                                     &uo, &check))
        return NULL;
    PyArrayObject *p = exact_matrix(po, NPY_FLOAT32, "p", "float32");
    if (!p) return NULL;
    PyArrayObject *q = NULL, *u = NULL;
    if (qo != Py_None && !(q = exact_matrix(qo, NPY_FLOAT32, "q", "float32"))) return NULL;
    if (uo != Py_None && !(u = exact_matrix(uo, NPY_FLOAT64, "u", "float64"))) return NULL;
    PyArrayObject *d = draft_array(dobj);
    if (!d) return NULL;
    npy_intp k = PyArray_DIM(d, 0), v = PyArray_DIM(p, 1);
    const char *shape_err = NULL;
    if (k >= INT32_MAX)
        shape_err = "draft is too long";
    else if (PyArray_DIM(p, 0) != k + 1)
        shape_err = "p must have K+1 rows (K = len(draft))";
    else if (v < 1)
        shape_err = "p must have at least one column (the vocabulary is empty)";
    else if (q && (PyArray_DIM(q, 0) != k || PyArray_DIM(q, 1) != v))
        shape_err = "q must have shape [K, V] (K = len(draft), V = p.shape[1])";
    else if (u && (PyArray_DIM(u, 0) != k + 1 || PyArray_DIM(u, 1) != 2))
        shape_err = "u must have shape [K+1, 2] (K = len(draft))";
    if (shape_err) {
        char qs[64] = "None", us[64] = "None";
        if (q) snprintf(qs, sizeof qs, "(%zd, %zd)", (Py_ssize_t)PyArray_DIM(q, 0),
                        (Py_ssize_t)PyArray_DIM(q, 1));
        if (u) snprintf(us, sizeof us, "(%zd, %zd)", (Py_ssize_t)PyArray_DIM(u, 0),
                        (Py_ssize_t)PyArray_DIM(u, 1));
        PyErr_Format(PyExc_ValueError,
                     "spec_accept: %s; got p (%zd, %zd), len(draft) %zd, q %s, u %s", shape_err,
                     (Py_ssize_t)PyArray_DIM(p, 0), (Py_ssize_t)v, (Py_ssize_t)k, qs, us);
        Py_DECREF(d);
        return NULL;
    }
    const float *pp = PyArray_DATA(p), *qp = q ? PyArray_DATA(q) : NULL;
    const double *up = u ? PyArray_DATA(u) : NULL;
    const int64_t *dp = PyArray_DATA(d);
    int32_t n = 0;
    int64_t next = -1;
    int rc;
    smoe_err err;
    smoe_err_clear(&err);
    if ((double)(2 * k + 1) * (double)v >= SPEC_NOGIL_MIN) {
        Py_BEGIN_ALLOW_THREADS
        rc = smoe_spec_accept_check(pp, dp, qp, up, (int32_t)k, (int64_t)v, check, &err);
        if (rc == 0) rc = smoe_spec_accept(pp, dp, qp, up, (int32_t)k, (int64_t)v, &n, &next, &err);
        Py_END_ALLOW_THREADS
    } else {
        rc = smoe_spec_accept_check(pp, dp, qp, up, (int32_t)k, (int64_t)v, check, &err);
        if (rc == 0) rc = smoe_spec_accept(pp, dp, qp, up, (int32_t)k, (int64_t)v, &n, &next, &err);
    }
    Py_DECREF(d);
    if (rc < 0) return smoe_py_raise(&err);
    return Py_BuildValue("(iL)", (int)n, (long long)next);
}

static PyMethodDef spec_functions[] = {
    {"spec_accept", (PyCFunction)(void (*)(void))py_spec_accept, METH_VARARGS | METH_KEYWORDS,
     "spec_accept(p, draft, q=None, u=None, *, check=True) -> (n_accepted, next_token): the "
     "speculative decoding acceptance rule (greedy when u is None); see csrc/spec/verify.h."},
    {NULL, NULL, 0, NULL}};

int smoe_py_spec_init(PyObject *m) {
    PyTypeObject *types[] = {&SpecController_Type, &Ngram_Type};
    for (size_t i = 0; i < sizeof types / sizeof *types; i++) /* named by their tp_name */
        if (PyModule_AddType(m, types[i]) < 0) return -1;
    return PyModule_AddFunctions(m, spec_functions);
}

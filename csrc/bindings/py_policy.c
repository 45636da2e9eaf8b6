/* Python binding for the policy area: the _C.Policy type (which can wrap the Python bridge
 * policy of bindings/py_bridge.c), _C.replay, and
 * smoe_py_policy_take (py_policy.h) through which the cache and the simulator take a policy. */
#include "py_numpy.h"
#include "py_policy.h"
#include "py_bridge.h"
#include "policy/nextuse.h"
#include "policy/replay.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------------------------------------ */
/* _C.Policy */

typedef struct {
    PyObject_HEAD
    smoe_policy *p;  /* owned until taken; NULL after */
    int taken;
    char name[32];
    uint32_t nslots, num_layers, num_experts;
} PolicyObject;

static PyTypeObject Policy_Type;

static void Policy_dealloc(PolicyObject *self) {
    smoe_policy_destroy(self->p);
    self->p = NULL;
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* An int in lo..hi (inclusive) from a Python integer; -1 with an exception otherwise. */
static int parse_range(PyObject *o, const char *what, long long lo, unsigned long long hi,
                       unsigned long long *out) {
    if (!PyIndex_Check(o) || PyBool_Check(o)) {
        PyErr_Format(PyExc_TypeError, "%s must be an int, got %s", what, Py_TYPE(o)->tp_name);
        return -1;
    }
    PyObject *i = PyNumber_Index(o);
    if (!i) return -1;
    int bad = 0;
    unsigned long long u = 0;
    int ovf = 0;
    long long sv = PyLong_AsLongLongAndOverflow(i, &ovf);
    if (sv == -1 && PyErr_Occurred()) PyErr_Clear(); /* not reached for an exact int */
    if (ovf < 0 || (ovf == 0 && sv < 0)) { /* negative */
        long long v = PyLong_AsLongLong(i);
        if (v == -1 && PyErr_Occurred()) {
            PyErr_Clear();
            bad = 1;
        } else if (v < lo) {
            bad = 1;
        } else {
            u = (unsigned long long)v; /* only reached when lo < 0: callers pass lo >= 0 */
        }
    } else {
        u = PyLong_AsUnsignedLongLong(i);
        if (u == (unsigned long long)-1 && PyErr_Occurred()) {
            PyErr_Clear();
            bad = 1;
        } else if (u > hi || (lo > 0 && u < (unsigned long long)lo)) {
            bad = 1;
        }
    }
    Py_DECREF(i);
    if (bad) {
        PyErr_Format(PyExc_ValueError, "%s must be in %lld..%llu, got %R", what, lo, hi, o);
        return -1;
    }
    *out = u;
    return 0;
}

static int parse_order(PyObject *o, int32_t *out) {
    if (PyUnicode_Check(o)) {
        const char *s = PyUnicode_AsUTF8(o);
        if (!s) return -1;
        if (strcmp(s, "layer") == 0) *out = SMOE_LS_ORDER_LAYER;
        else if (strcmp(s, "lru") == 0) *out = SMOE_LS_ORDER_LRU;
        else if (strcmp(s, "fifo") == 0) *out = SMOE_LS_ORDER_FIFO;
        else {
            PyErr_Format(PyExc_ValueError, "order must be 'layer', 'lru' or 'fifo', got %R", o);
            return -1;
        }
        return 0;
    }
    unsigned long long v;
    if (parse_range(o, "order", 0, 2, &v) < 0) return -1;
    *out = (int32_t)v;
    return 0;
}

static int Policy_init(PolicyObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"name", "nslots", "num_layers", "num_experts", "seed", "order",
                             "future", "pyobj", "levels", "gamma", "model", "up", "dn", "tau",
                             "counts", "gate", NULL};
    const char *name;
    PyObject *o_nslots, *o_nl, *o_ne, *o_seed = NULL, *o_order = NULL, *o_future = Py_None,
                                           *o_pyobj = Py_None, *o_levels = NULL,
                                           *o_gamma = NULL, *o_model = Py_None;
    /* spac's ablations (policy.h): up/dn fixed boundaries, tau a static threshold, counts the
     * plain-counts utility, gate=False the prefetcher not gated by tau */
    PyObject *o_up = Py_None, *o_dn = Py_None, *o_tau = Py_None;
    int counts = 0, gate = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "sOOO|$OOOOOOOOOOpp:Policy", kwlist, &name,
                                     &o_nslots, &o_nl, &o_ne, &o_seed, &o_order, &o_future,
                                     &o_pyobj, &o_levels, &o_gamma, &o_model, &o_up, &o_dn,
                                     &o_tau, &counts, &gate))
        return -1;
    if (self->p || self->taken) {
        PyErr_SetString(PyExc_TypeError, "Policy objects cannot be re-initialised");
        return -1;
    }
    unsigned long long nslots, nl, ne, seed = 0, levels = 0, gamma = 8;
    if (o_levels && o_levels != Py_None &&
        parse_range(o_levels, "levels (0 = default)", 0, 255, &levels) < 0)
        return -1;
    if (o_gamma && o_gamma != Py_None &&
        parse_range(o_gamma, "gamma (draft length)", 0, 65536, &gamma) < 0)
        return -1;
    if (parse_range(o_nslots, "nslots", 1, UINT32_MAX, &nslots) < 0 ||
        parse_range(o_nl, "num_layers", 1, UINT32_MAX, &nl) < 0 ||
        parse_range(o_ne, "num_experts", 1, UINT32_MAX, &ne) < 0 ||
        (o_seed && o_seed != Py_None && parse_range(o_seed, "seed", 0, UINT64_MAX, &seed) < 0))
        return -1;
    if (nl * ne > (unsigned long long)INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "num_layers*num_experts = %llu does not fit an int32 key",
                     nl * ne);
        return -1;
    }
    smoe_policy_params params = {.nslots = (uint32_t)nslots, .num_layers = (uint32_t)nl,
                                 .num_experts = (uint32_t)ne, .seed = seed,
                                 .order = SMOE_LS_ORDER_LAYER, .levels = (int32_t)levels,
                                 /* spac: θ0 = ⌊γ/2⌋, at least 1 (see policy/spac.c) */
                                 .theta0 = gamma < 2 ? 1 : (int32_t)(gamma / 2)};
    unsigned long long up = 0, dn = 0, tau = 0;
    if ((o_up != Py_None && parse_range(o_up, "up (a fixed boundary)", 1, 65536, &up) < 0) ||
        (o_dn != Py_None && parse_range(o_dn, "dn (a fixed boundary)", 1, 65536, &dn) < 0) ||
        (o_tau != Py_None && parse_range(o_tau, "tau (a static threshold)", 1, 255, &tau) < 0))
        return -1;
    if ((up || dn || tau || counts || !gate) && strcmp(name, "spac") != 0) {
        PyErr_Format(PyExc_ValueError, "up=, dn=, tau=, counts= and gate= apply to spac only, "
                     "not %s", name);
        return -1;
    }
    params.spac_up = (int32_t)up;
    params.spac_dn = (int32_t)dn;
    params.spac_tau = (int32_t)tau;
    params.spac_counts = counts;
    params.spac_nogate = !gate;
    int is_py = strcmp(name, "python") == 0;
    const smoe_policy_ops *ops = is_py ? NULL : smoe_policy_find(name);
    if (!is_py && !ops) {
        PyErr_Format(PyExc_ValueError, "unknown policy '%s'; valid names: %s, python", name,
                     smoe_policy_names());
        return -1;
    }
    /* seed=, order=, levels= and gamma= are validated always and ignored by the policies that do not use them
     * (so generic callers may pass them); future= and pyobj= must match the policy. */
    if (o_order && o_order != Py_None && parse_order(o_order, &params.order) < 0) return -1;
    if (o_pyobj != Py_None && !is_py) {
        PyErr_Format(PyExc_ValueError, "pyobj= applies to the python policy only, not %s", name);
        return -1;
    }
    if (o_future != Py_None && strcmp(name, "belady") != 0) {
        PyErr_Format(PyExc_ValueError, "future= applies to belady only, not %s", name);
        return -1;
    }
    if (o_model != Py_None && strcmp(name, "nextuse") != 0) {
        PyErr_Format(PyExc_ValueError, "model= applies to nextuse only, not %s", name);
        return -1;
    }
    smoe_policy *p = NULL;
    if (is_py) {
        if (o_pyobj == Py_None) {
            PyErr_SetString(PyExc_ValueError, "the python policy needs pyobj= (an object with a "
                            "victim(candidates) method)");
            return -1;
        }
        p = smoe_py_bridge_create(o_pyobj, &params);
        if (!p) return -1;
    } else {
        PyArrayObject *fut = NULL, *mod = NULL;
        if (o_future != Py_None) {
            fut = smoe_py_index_array(o_future, nl * ne, "future", "key");
            if (!fut) return -1;
            params.future = PyArray_DATA(fut);
            params.future_len = (uint64_t)PyArray_DIM(fut, 0);
        }
        if (o_model != Py_None) {
            mod = (PyArrayObject *)PyArray_FROM_OTF(o_model, NPY_FLOAT64, NPY_ARRAY_IN_ARRAY);
            if (!mod || PyArray_NDIM(mod) != 1) {
                if (mod) PyErr_SetString(PyExc_ValueError, "model= must be a 1-D float array "
                                         "(NextUseModel.flat())");
                Py_XDECREF(mod);
                Py_XDECREF(fut);
                return -1;
            }
            params.model = PyArray_DATA(mod);
            params.model_len = (uint64_t)PyArray_DIM(mod, 0);
        }
        smoe_err err = {0};
        int rc;
        Py_BEGIN_ALLOW_THREADS
        rc = smoe_policy_create(&p, ops, &params, &err);
        Py_END_ALLOW_THREADS
        Py_XDECREF(fut);
        Py_XDECREF(mod);
        if (rc < 0) {
            smoe_py_raise(&err);
            return -1;
        }
    }
    self->p = p;
    snprintf(self->name, sizeof self->name, "%s", p->ops->name);
    self->nslots = (uint32_t)nslots;
    self->num_layers = (uint32_t)nl;
    self->num_experts = (uint32_t)ne;
    return 0;
}

static PyObject *Policy_repr(PolicyObject *self) {
    return PyUnicode_FromFormat("<specmoe._C.Policy %s nslots=%u layers=%u experts=%u%s>",
                                self->name[0] ? self->name : "?", (unsigned)self->nslots,
                                (unsigned)self->num_layers, (unsigned)self->num_experts,
                                self->taken ? " (in use)" : "");
}

static PyObject *Policy_get_name(PolicyObject *self, void *c) {
    (void)c;
    return PyUnicode_FromString(self->name);
}
static PyObject *Policy_get_nslots(PolicyObject *self, void *c) {
    (void)c;
    return PyLong_FromUnsignedLong(self->nslots);
}
static PyObject *Policy_get_num_layers(PolicyObject *self, void *c) {
    (void)c;
    return PyLong_FromUnsignedLong(self->num_layers);
}
static PyObject *Policy_get_num_experts(PolicyObject *self, void *c) {
    (void)c;
    return PyLong_FromUnsignedLong(self->num_experts);
}
static PyObject *Policy_get_in_use(PolicyObject *self, void *c) {
    (void)c;
    return PyBool_FromLong(self->taken);
}

static PyGetSetDef Policy_getset[] = {
    {"name", (getter)Policy_get_name, NULL, "Policy name (lru, lfu, ..., python).", NULL},
    {"nslots", (getter)Policy_get_nslots, NULL, "Number of cache slots it was built for.", NULL},
    {"num_layers", (getter)Policy_get_num_layers, NULL, "MoE layers it was built for.", NULL},
    {"num_experts", (getter)Policy_get_num_experts, NULL, "Experts per layer.", NULL},
    {"in_use", (getter)Policy_get_in_use, NULL,
     "True once a cache, simulator or replay has taken the policy (it cannot be taken twice).",
     NULL},
    {NULL, NULL, NULL, NULL, NULL}};

PyDoc_STRVAR(Policy_doc,
"Policy(name, nslots, num_layers, num_experts, *, seed=0, order='layer', future=None, pyobj=None,\n"
"       levels=0, gamma=8, model=None, up=None, dn=None, tau=None, counts=False, gate=True)\n"
"\n"
"An eviction policy in C for a cache of nslots slots over num_layers*num_experts expert keys.\n"
"name: lru, lfu, fifo, mru, random (seed=), least_stale (order='layer'|'lru'|'fifo' or 0..2),\n"
"belady (future= the demand key sequence), spac (MoE-SpAc Algorithm 1: levels= K, 1..255,\n"
"0 = 4; gamma= draft length, initial boundaries floor(gamma/2); the ablations of MoE-SpAc\n"
"§4.4: up=/dn= fixed boundaries, tau= a static threshold, counts=True the pass's count as the\n"
"utility, gate=False prefetch not gated by tau; see csrc/policy/spac.c),\n"
"spac_ema (levels=; the EMA estimator, csrc/policy/spac_ema.c), lhu, fld, score (SpecMD's\n"
"baselines, csrc/policy/{lhu,fld,score}.c), nextuse (model= a learned next-use model,\n"
"NextUseModel.flat(); None: built-in temporal weights; csrc/policy/nextuse.h), or python\n"
"(pyobj= an object with\n"
"victim(candidates) and optional on_insert/on_access/on_evict/on_pass/on_counts(keys,\n"
"counts)/utility(key); the slow path).  A Policy is consumed by\n"
"the first cache, simulator or replay that takes it; taking it again raises PolicyError.");

static PyTypeObject Policy_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "specmoe._C.Policy",
    .tp_basicsize = sizeof(PolicyObject),
    .tp_dealloc = (destructor)Policy_dealloc,
    .tp_repr = (reprfunc)Policy_repr,
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = Policy_doc,
    .tp_getset = Policy_getset,
    .tp_init = (initproc)Policy_init,
    .tp_new = PyType_GenericNew,
};

smoe_policy *smoe_py_policy_take(PyObject *obj, uint32_t nslots, uint32_t num_layers,
                                 uint32_t num_experts) {
    if (!PyObject_TypeCheck(obj, &Policy_Type)) {
        PyErr_Format(PyExc_TypeError, "expected a specmoe._C.Policy (see specmoe.make_policy), "
                     "got %s", Py_TYPE(obj)->tp_name);
        return NULL;
    }
    PolicyObject *po = (PolicyObject *)obj;
    if (po->taken) {
        PyErr_Format(smoe_py_PolicyError, "policy %s already in use (a Policy serves one cache, "
                     "simulator or replay; make a new one)", po->name);
        return NULL;
    }
    if (!po->p) {
        PyErr_SetString(PyExc_ValueError, "policy was not initialised");
        return NULL;
    }
    if (po->nslots != nslots || po->num_layers != num_layers || po->num_experts != num_experts) {
        PyErr_Format(PyExc_ValueError, "policy %s was built for nslots=%u, num_layers=%u, "
                     "num_experts=%u but is used with nslots=%u, num_layers=%u, num_experts=%u",
                     po->name, (unsigned)po->nslots, (unsigned)po->num_layers,
                     (unsigned)po->num_experts, (unsigned)nslots, (unsigned)num_layers,
                     (unsigned)num_experts);
        return NULL;
    }
    smoe_policy *p = po->p;
    po->p = NULL;
    po->taken = 1;
    return p;
}

/* ------------------------------------------------------------------------------------------ */
/* _C.replay */

static PyObject *py_replay(PyObject *mod, PyObject *args, PyObject *kw) {
    (void)mod;
    static char *kwlist[] = {"policy", "keys", "pass_starts", "mask_seed", "counts", "next_use",
                             "prior_table", "prior_rows", NULL};
    PyObject *o_pol, *o_keys, *o_ps = Py_None, *o_mask = NULL, *o_counts = Py_None;
    PyObject *o_ptab = Py_None, *o_prows = Py_None;
    int next_use = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO|O$OOpOO:replay", kwlist, &o_pol, &o_keys,
                                     &o_ps, &o_mask, &o_counts, &next_use, &o_ptab, &o_prows))
        return NULL;
    if (!PyObject_TypeCheck(o_pol, &Policy_Type)) {
        PyErr_Format(PyExc_TypeError, "replay: policy must be a specmoe._C.Policy, got %s",
                     Py_TYPE(o_pol)->tp_name);
        return NULL;
    }
    PolicyObject *po = (PolicyObject *)o_pol;
    unsigned long long mask_seed = 0;
    if (o_mask && parse_range(o_mask, "mask_seed", 0, UINT64_MAX, &mask_seed) < 0) return NULL;
    PyArrayObject *keys = smoe_py_index_array(
        o_keys, (uint64_t)po->num_layers * po->num_experts, "keys", "key");
    if (!keys) return NULL;
    const npy_intp n = PyArray_DIM(keys, 0);
    PyArrayObject *ps = NULL, *hits = NULL, *vic = NULL, *ck = NULL, *cv = NULL, *co = NULL,
                  *qa = NULL, *ptab = NULL, *prows = NULL;
    smoe_replay_opts opts = {NULL, 0, mask_seed, NULL, NULL, NULL, NULL, NULL, 0};
    if (o_ps != Py_None) {
        if (!PyArray_Check(o_ps) && PyIndex_Check(o_ps) && !PyBool_Check(o_ps)) {
            unsigned long long len;
            if (parse_range(o_ps, "pass_starts (a pass length)", 1, UINT64_MAX, &len) < 0)
                goto fail;
            npy_intp np_ = n ? (npy_intp)((n + (npy_intp)len - 1) / (npy_intp)len) : 0;
            ps = (PyArrayObject *)PyArray_SimpleNew(1, &np_, NPY_UINT64);
            if (!ps) goto fail;
            uint64_t *d = PyArray_DATA(ps);
            for (npy_intp j = 0; j < np_; j++) d[j] = (uint64_t)j * len;
        } else {
            PyArrayObject *a = (PyArrayObject *)PyArray_FROM_OTF(o_ps, NPY_INT64,
                                                                 NPY_ARRAY_IN_ARRAY);
            if (!a) goto fail;
            if (PyArray_NDIM(a) != 1) {
                PyErr_SetString(PyExc_ValueError, "pass_starts must be an int (pass length) or a "
                                "1-D array of access indices");
                Py_DECREF(a);
                goto fail;
            }
            const int64_t *src = PyArray_DATA(a);
            for (npy_intp j = 0; j < PyArray_DIM(a, 0); j++)
                if (src[j] < 0) {
                    PyErr_Format(PyExc_ValueError, "pass_starts[%zd] = %lld is negative",
                                 (Py_ssize_t)j, (long long)src[j]);
                    Py_DECREF(a);
                    goto fail;
                }
            ps = (PyArrayObject *)PyArray_Cast(a, NPY_UINT64);
            Py_DECREF(a);
            if (!ps) goto fail;
        }
        opts.pass_starts = PyArray_DATA(ps);
        opts.npass = (uint64_t)PyArray_DIM(ps, 0);
    }
    if (o_counts != Py_None) {
        PyObject *o_ck, *o_cv, *o_co;
        if (!PyTuple_Check(o_counts) || PyTuple_GET_SIZE(o_counts) != 3) {
            PyErr_SetString(PyExc_TypeError, "replay: counts must be a tuple (keys, counts, "
                            "offsets)");
            goto fail;
        }
        o_ck = PyTuple_GET_ITEM(o_counts, 0);
        o_cv = PyTuple_GET_ITEM(o_counts, 1);
        o_co = PyTuple_GET_ITEM(o_counts, 2);
        if (!ps) {
            PyErr_SetString(PyExc_ValueError, "replay: counts need pass_starts (they are fed at "
                            "each pass start)");
            goto fail;
        }
        ck = smoe_py_index_array(o_ck, (uint64_t)po->num_layers * po->num_experts,
                                 "counts keys", "key");
        if (!ck) goto fail;
        cv = smoe_py_index_array(o_cv, (uint64_t)1 << 31, "counts", "count");
        if (!cv) goto fail;
        PyArrayObject *a = (PyArrayObject *)PyArray_FROM_OTF(o_co, NPY_INT64, NPY_ARRAY_IN_ARRAY);
        if (!a) goto fail;
        const int64_t *src = PyArray_DATA(a);
        const npy_intp m = PyArray_NDIM(a) == 1 ? PyArray_DIM(a, 0) : -1;
        int bad = PyArray_DIM(ck, 0) != PyArray_DIM(cv, 0) ||
                  m != (npy_intp)opts.npass + 1 || src[0] != 0 ||
                  src[m - 1] != (int64_t)PyArray_DIM(ck, 0);
        for (npy_intp j = 1; !bad && j < m; j++) bad = src[j] < src[j - 1];
        if (bad) {
            PyErr_Format(PyExc_ValueError, "replay: counts must be (keys, counts, offsets) with "
                         "keys and counts of equal length n and offsets a non-decreasing 1-D "
                         "array of npass + 1 = %llu entries from 0 to n",
                         (unsigned long long)opts.npass + 1);
            Py_DECREF(a);
            goto fail;
        }
        co = (PyArrayObject *)PyArray_Cast(a, NPY_UINT64);
        Py_DECREF(a);
        if (!co) goto fail;
        opts.count_offsets = PyArray_DATA(co);
        opts.count_keys = PyArray_DATA(ck);
        opts.count_vals = PyArray_DATA(cv);
    }
    if ((o_ptab == Py_None) != (o_prows == Py_None) || (o_ptab != Py_None && !ps)) {
        PyErr_SetString(PyExc_ValueError, "replay: prior_table and prior_rows go together, "
                        "with pass_starts (a row per pass)");
        goto fail;
    }
    if (o_ptab != Py_None) {
        ptab = (PyArrayObject *)PyArray_FROMANY(o_ptab, NPY_FLOAT32, 2, 2, NPY_ARRAY_IN_ARRAY);
        if (!ptab) goto fail;
        prows = (PyArrayObject *)PyArray_FROMANY(o_prows, NPY_INT32, 1, 1, NPY_ARRAY_IN_ARRAY);
        if (!prows) goto fail;
        if (PyArray_DIM(ptab, 1) != (npy_intp)po->num_layers * po->num_experts ||
            (uint64_t)PyArray_DIM(prows, 0) != opts.npass) {
            PyErr_Format(PyExc_ValueError, "replay: prior_table must be [n, %lld] and "
                         "prior_rows [%llu] (a row per pass)",
                         (long long)po->num_layers * po->num_experts,
                         (unsigned long long)opts.npass);
            goto fail;
        }
        opts.prior_table = PyArray_DATA(ptab);
        opts.prior_rows = PyArray_DATA(prows);
        opts.prior_n = (uint64_t)PyArray_DIM(ptab, 0);
    }
    if (next_use && strcmp(po->name, "nextuse") != 0) {
        PyErr_Format(PyExc_ValueError, "replay: next_use=True needs a nextuse policy, not %s",
                     po->name);
        goto fail;
    }
    hits = (PyArrayObject *)PyArray_SimpleNew(1, &n, NPY_UINT8);
    vic = (PyArrayObject *)PyArray_SimpleNew(1, &n, NPY_INT32);
    if (!hits || !vic) goto fail;
    if (next_use) {
        npy_intp nk = (npy_intp)po->num_layers * po->num_experts;
        qa = (PyArrayObject *)PyArray_SimpleNew(1, &nk, NPY_FLOAT64);
        if (!qa) goto fail;
    }
    smoe_policy *p = smoe_py_policy_take(o_pol, po->nslots, po->num_layers, po->num_experts);
    if (!p) goto fail;
    smoe_err err = {0};
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = smoe_policy_replay(p, PyArray_DATA(keys), (uint64_t)n, &opts, PyArray_DATA(hits),
                            PyArray_DATA(vic), &err);
    if (rc == 0 && qa) rc = smoe_nextuse_predict(p, PyArray_DATA(qa), &err);
    Py_END_ALLOW_THREADS
    smoe_policy_destroy(p);
    if (rc < 0) {
        smoe_py_raise(&err);
        goto fail;
    }
    Py_DECREF(keys);
    Py_XDECREF(ps);
    Py_XDECREF(ck);
    Py_XDECREF(cv);
    Py_XDECREF(co);
    Py_XDECREF(ptab);
    Py_XDECREF(prows);
    if (qa) return Py_BuildValue("(NNN)", hits, vic, qa);
    return Py_BuildValue("(NN)", hits, vic);
fail:
    Py_XDECREF(keys);
    Py_XDECREF(ps);
    Py_XDECREF(ck);
    Py_XDECREF(cv);
    Py_XDECREF(co);
    Py_XDECREF(hits);
    Py_XDECREF(vic);
    Py_XDECREF(qa);
    Py_XDECREF(ptab);
    Py_XDECREF(prows);
    return NULL;
}

PyDoc_STRVAR(py_replay_doc,
"replay(policy, keys, pass_starts=None, *, mask_seed=0, counts=None, next_use=False)\n"
"    -> (hits, victims[, q])\n"
"\n"
"Replay a demand-only sequence of expert keys through a fresh policy with the cache's\n"
"semantics (free slots lowest first, then victim; no pins): hits uint8[n] (1 = hit) and\n"
"victims int32[n] (the key evicted by access i, or -1).  pass_starts: None, an int pass\n"
"length (passes start at 0, len, 2*len, ...) or sorted access indices at which on_pass(1),\n"
"on_pass(2), ... are called.  mask_seed != 0 makes about 1 in 4 slots unevictable at each\n"
"victim call (splitmix64 draws, see csrc/policy/replay.h); with no candidate the access\n"
"bypasses the cache.  counts=(keys, counts, offsets): activation counts fed to the policy\n"
"(on_counts) right after each on_pass(j+1): entries offsets[j]:offsets[j+1] (offsets has\n"
"npass + 1 entries; needs pass_starts).  next_use=True (a nextuse policy): also q float64\n"
"[num_layers*num_experts], each key's predicted probability of use at its layer's next run\n"
"in the final state (csrc/policy/nextuse.h).  The policy is consumed (in_use afterwards).");

static PyMethodDef policy_methods[] = {
    {"replay", (PyCFunction)(void (*)(void))py_replay, METH_VARARGS | METH_KEYWORDS,
     py_replay_doc},
    {NULL, NULL, 0, NULL}};

int smoe_py_policy_init(PyObject *m) {
    if (PyModule_AddType(m, &Policy_Type) < 0) return -1;
    if (PyModule_AddFunctions(m, policy_methods) < 0) return -1;
    PyObject *names = PyUnicode_FromString(smoe_policy_names());
    if (!names || PyModule_AddObject(m, "POLICY_NAMES", names) < 0) {
        Py_XDECREF(names);
        return -1;
    }
    return 0;
}

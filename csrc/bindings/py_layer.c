/* Python binding of the per-layer path (layer.h): _C.Layers.
 *
 *   Layers(cache, kctx, desc, routers, top_k, sigmoid=False)
 *     cache: a _C.Cache or specmoe.ExpertCache (kept referenced; close() of it is refused
 *     while a forward call runs, and a later forward on a closed cache raises CacheError),
 *     or a device tier's capsule (py_tier.h: specmoe._cuda.Tier.capsule, the GPU cache or
 *     its host emulation; same guarantees);
 *     kctx: a _C.KernelContext or None; desc: the expert FFN descriptor dict;
 *     routers: one (w [E,H], b [E] or None, corr [E] or None) float32 tuple per MoE layer.
 *   forward(pos, x, idx, w, out, used, scores=None, replace=True, draft=None)
 *                                            METH_FASTCALL, GIL released
 *   forward_on(pos, x, idx, w, used, xd, out, stream, scores=None, replace=True, draft=None)
 *                                            a device tier: xd, out addresses in its memory
 *   configure(prefetch, overfetch, mass, feed_counts)
 *   config() -> dict                         what configure and set_miss set
 *   counters(reset=False) -> dict
 *   set_miss(miss, keep, route_lambda, keep2=top_k)  miss: "fetch", "drop", "substitute",
 *                                            "lowest_bit", "priority"
 *   set_parallel(on)                         misses load while resident experts compute
 *   set_hybrid(on, t_io=0, t_gpu=0, t_cpu=0, admit=True)  the hybrid tier's split (a device
 *                                            tier with a host copy)
 *   set_lowbit(buf, desc, block_bytes, level=0) / set_lowbit(None, level=0)
 *                                            resident low-bit copy 0 or 1
 *   set_block(pos, route_scale=1.0, shared=None, n_group=1, topk_group=1)  forward_routed's
 *                                            scale, groups and shared FFN of layer pos
 */
#include <string.h>

#include "py_common.h"
/* kernels.h before numpy: <complex.h> (pulled in by numpy) defines the macro I */
#include "layer.h"
#include "py_cache.h"
#include "py_layer.h"
#include "py_kernels.h"
#include "py_numpy.h"
#include "py_tier.h"

typedef struct {
    PyObject_HEAD
    smoe_layers g;
    int initialized;
    PyObject *cache_obj; /* strong: a _C.Cache (or its wrapper), or a device tier's capsule */
    PyObject *kctx_obj;  /* strong, or NULL */
    Py_buffer lowbit[3]; /* low-bit copy i's buffer (2: the draft copy's) while has_lowbit[i]
                          * (g borrows it) */
    int has_lowbit[3];
    PyObject *shared;    /* strong, or NULL: list [L] of each layer's shared-FFN Linear tuple
                          * or None (g borrows their weights; set_block) */
} LayersObject;

static const char *const predictor_names[] = {"router", "learned", "oracle"}; /* SMOE_LPRED_* */
static const char *const miss_names[] = {"fetch", "drop", "substitute", "lowest_bit",
                                         "priority"};

/* The tier of a Layers' cache argument, marked in use: a device tier's capsule (py_tier.h) or
 * a CPU cache (smoe_py_cache_begin).  0, or -1 with an exception.  End with tier_end. */
static int tier_begin(PyObject *obj, smoe_tier *out) {
    if (PyCapsule_CheckExact(obj)) {
        smoe_py_tier *t = PyCapsule_GetPointer(obj, SMOE_PY_TIER_CAPSULE);
        if (!t || t->begin(t->owner) < 0) return -1;
        *out = t->tier;
        return 0;
    }
    smoe_cache *c = smoe_py_cache_begin(obj);
    if (!c) return -1;
    *out = smoe_tier_host(c);
    return 0;
}

static void tier_end(PyObject *obj) {
    if (PyCapsule_CheckExact(obj)) {
        smoe_py_tier *t = PyCapsule_GetPointer(obj, SMOE_PY_TIER_CAPSULE);
        if (t) t->end(t->owner);
        return;
    }
    smoe_py_cache_end(obj);
}

static void Layers_dealloc(LayersObject *self) {
    if (self->initialized) smoe_layers_free(&self->g);
    for (int i = 0; i < 3; i++)
        if (self->has_lowbit[i]) PyBuffer_Release(&self->lowbit[i]);
    Py_XDECREF(self->cache_obj);
    Py_XDECREF(self->kctx_obj);
    Py_XDECREF(self->shared);
    Py_TYPE(self)->tp_free((PyObject *)self);
}


static int Layers_init(LayersObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"cache", "kctx", "desc", "routers", "top_k", "sigmoid", NULL};
    PyObject *cache_obj, *kctx_obj, *desc, *routers;
    unsigned int top_k;
    int sigmoid = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO!OI|p:Layers", kwlist, &cache_obj, &kctx_obj,
                                     &PyDict_Type, &desc, &routers, &top_k, &sigmoid))
        return -1;
    if (self->initialized) {
        PyErr_SetString(PyExc_RuntimeError, "Layers is already initialized");
        return -1;
    }
    smoe_kctx *kc = NULL;
    if (kctx_obj != Py_None && !(kc = smoe_py_kctx(kctx_obj))) return -1;
    smoe_tier tier;
    if (tier_begin(cache_obj, &tier) < 0) return -1;
    const smoe_slots *tab = tier.tab;
    smoe_ffn_desc d;
    int rc = -1;
    const float **w = NULL, **b = NULL, **corr = NULL;
    PyObject *seq = PySequence_Fast(routers, "routers must be a sequence of (w, b, corr)");
    if (!seq) goto out;
    if (smoe_py_ffn_desc_parse(desc, tab->slot_bytes, &d) < 0) goto out;
    Py_ssize_t L = PySequence_Fast_GET_SIZE(seq);
    uint32_t E = tab->num_experts, H = d.H;
    if ((uint32_t)L != tab->num_layers) {
        PyErr_Format(PyExc_ValueError, "routers: %zd layers, the cache has %u", L,
                     tab->num_layers);
        goto out;
    }
    w = calloc((size_t)L, sizeof *w), b = calloc((size_t)L, sizeof *b);
    corr = calloc((size_t)L, sizeof *corr);
    if (!w || !b || !corr) {
        PyErr_NoMemory();
        goto out;
    }
    for (Py_ssize_t l = 0; l < L; l++) {
        PyObject *t = PySequence_Fast_GET_ITEM(seq, l);
        if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) != 3) {
            PyErr_Format(PyExc_TypeError, "routers[%zd] must be a tuple (w, b, corr)", l);
            goto out;
        }
        PyArrayObject *a = smoe_py_want_array(PyTuple_GET_ITEM(t, 0), "router weight", NPY_FLOAT32, 2, 0);
        if (!a) goto out;
        if (PyArray_DIM(a, 0) != (npy_intp)E || PyArray_DIM(a, 1) != (npy_intp)H) {
            PyErr_Format(PyExc_ValueError, "routers[%zd] weight is %ldx%ld, expected %ux%u", l,
                         (long)PyArray_DIM(a, 0), (long)PyArray_DIM(a, 1), E, H);
            goto out;
        }
        w[l] = PyArray_DATA(a);
        for (int j = 1; j <= 2; j++) {
            PyObject *v = PyTuple_GET_ITEM(t, j);
            if (v == Py_None) continue;
            PyArrayObject *bv = smoe_py_want_array(v, j == 1 ? "router bias" : "correction bias", NPY_FLOAT32,
                                    1, 0);
            if (!bv) goto out;
            if (PyArray_DIM(bv, 0) != (npy_intp)E) {
                PyErr_Format(PyExc_ValueError, "routers[%zd] %s has %ld entries, expected %u",
                             l, j == 1 ? "bias" : "correction bias", (long)PyArray_DIM(bv, 0),
                             E);
                goto out;
            }
            (j == 1 ? b : corr)[l] = PyArray_DATA(bv);
        }
    }
    smoe_err e;
    smoe_err_clear(&e);
    if (smoe_layers_init(&self->g, &tier, kc, &d, (uint32_t)L, E, H, top_k, w, b, corr, sigmoid,
                         &e)) {
        smoe_py_raise(&e);
        goto out;
    }
    self->initialized = 1;
    Py_INCREF(cache_obj);
    self->cache_obj = cache_obj;
    if (kctx_obj != Py_None) {
        Py_INCREF(kctx_obj);
        self->kctx_obj = kctx_obj;
    }
    rc = 0;
out:
    free(w);
    free(b);
    free(corr);
    Py_XDECREF(seq);
    PyObject *et, *ev, *tb; /* ending the use may look up attributes: keep the error */
    PyErr_Fetch(&et, &ev, &tb);
    tier_end(cache_obj);
    PyErr_Restore(et, ev, tb);
    return rc;
}

static int check_init(LayersObject *self) {
    if (!self->initialized) {
        PyErr_SetString(PyExc_RuntimeError, "Layers is not initialized");
        return -1;
    }
    return 0;
}

PyDoc_STRVAR(forward_doc,
             "forward(pos, x, idx, w, out, used, scores=None, replace=True, draft=None)\n\n"
             "One MoE layer with the GIL released (csrc/layer.h): next-layer prediction and "
             "prefetch, policy counts, the experts through the cache, prediction counters.  x, "
             "out: float32 [T,H]; idx: int64 [T,k]; w: float32 [T,k]; used: uint8 [E]; scores: "
             "None or float32 [T,E] of layer pos+1 from a Python predictor; draft: None or "
             "uint8 [T], draft tokens whose missing experts are never fetched.");

/* forward (routed = 0) and forward_routed (routed = 1): the same arguments but the 7th,
 * scores=None or route_flags; forward_routed's idx and w are written. */
static PyObject *layers_call(LayersObject *self, PyObject *const *args, Py_ssize_t n,
                             int routed) {
    if (check_init(self) < 0) return NULL;
    if (n < (routed ? 7 : 6) || n > 9) {
        PyErr_SetString(PyExc_TypeError,
                        routed ? "forward_routed(pos, x, idx, w, out, used, route_flags, "
                                 "replace=True, draft=None)"
                               : "forward(pos, x, idx, w, out, used, scores=None, "
                                 "replace=True, draft=None)");
        return NULL;
    }
    smoe_layers *g = &self->g;
    long pos = PyLong_AsLong(args[0]);
    if (pos == -1 && PyErr_Occurred()) return NULL;
    if (pos < 0 || pos >= (long)g->L) {
        PyErr_Format(PyExc_ValueError, "pos %ld outside 0..%u", pos, g->L - 1);
        return NULL;
    }
    PyArrayObject *x, *idx, *w, *out, *used, *sc = NULL;
    if (!(x = smoe_py_want_array(args[1], "x", NPY_FLOAT32, 2, 0)) ||
        !(idx = smoe_py_want_array(args[2], "idx", NPY_INT64, 2, routed)) ||
        !(w = smoe_py_want_array(args[3], "w", NPY_FLOAT32, 2, routed)) ||
        !(out = smoe_py_want_array(args[4], "out", NPY_FLOAT32, 2, 1)) ||
        !(used = smoe_py_want_array(args[5], "used", NPY_UINT8, 1, 1)))
        return NULL;
    int flags = 0;
    if (routed) {
        if (smoe_py_route_flags(args[6], &flags)) return NULL;
    } else if (n > 6 && args[6] != Py_None &&
               !(sc = smoe_py_want_array(args[6], "scores", NPY_FLOAT32, 2, 0))) {
        return NULL;
    }
    int replace = 1;
    if (n > 7 && (replace = PyObject_IsTrue(args[7])) < 0) return NULL;
    PyArrayObject *dr = NULL;
    if (n > 8 && args[8] != Py_None &&
        !(dr = smoe_py_want_array(args[8], "draft", NPY_UINT8, 1, 0)))
        return NULL;
    npy_intp T = PyArray_DIM(x, 0);
    if (PyArray_DIM(x, 1) != (npy_intp)g->H || PyArray_DIM(idx, 0) != T ||
        PyArray_DIM(idx, 1) != (npy_intp)g->k || PyArray_DIM(w, 0) != T ||
        PyArray_DIM(w, 1) != (npy_intp)g->k || PyArray_DIM(out, 0) != T ||
        PyArray_DIM(out, 1) != (npy_intp)g->H || PyArray_DIM(used, 0) != (npy_intp)g->E ||
        (sc && (PyArray_DIM(sc, 0) != T || PyArray_DIM(sc, 1) != (npy_intp)g->E)) ||
        (dr && PyArray_DIM(dr, 0) != T) ||
        T > UINT32_MAX) {
        PyErr_Format(PyExc_ValueError,
                     "shape mismatch: x %ldx%ld, idx %ldx%ld, w %ldx%ld, out %ldx%ld, used %ld "
                     "(hidden %u, top_k %u, experts %u)",
                     (long)T, (long)PyArray_DIM(x, 1), (long)PyArray_DIM(idx, 0),
                     (long)PyArray_DIM(idx, 1), (long)PyArray_DIM(w, 0), (long)PyArray_DIM(w, 1),
                     (long)PyArray_DIM(out, 0), (long)PyArray_DIM(out, 1),
                     (long)PyArray_DIM(used, 0), g->H, g->k, g->E);
        return NULL;
    }
    if (out == x) {
        PyErr_SetString(PyExc_ValueError, "out must not be x");
        return NULL;
    }
    if (g->tier.ops) {
        PyErr_SetString(PyExc_ValueError, "this Layers runs on a device tier: call forward_on "
                        "with the device's x and out");
        return NULL;
    }
    smoe_tier tier;
    if (tier_begin(self->cache_obj, &tier) < 0) return NULL;
    smoe_err e;
    smoe_err_clear(&e);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    if (routed)
        rc = smoe_layers_forward_routed(g, (uint32_t)pos, PyArray_DATA(x), (uint32_t)T, flags, PyArray_DATA(idx), PyArray_DATA(w),
                                        PyArray_DATA(out), PyArray_DATA(used), replace,
                                        dr ? PyArray_DATA(dr) : NULL, &e);
    else
        rc = smoe_layers_forward(g, (uint32_t)pos, PyArray_DATA(x), (uint32_t)T,
                                 PyArray_DATA(idx), PyArray_DATA(w), PyArray_DATA(out),
                                 PyArray_DATA(used), sc ? PyArray_DATA(sc) : NULL, replace,
                                 dr ? PyArray_DATA(dr) : NULL, &e);
    Py_END_ALLOW_THREADS
    tier_end(self->cache_obj);
    if (rc) return smoe_py_raise(&e);
    Py_RETURN_NONE;
}

/* An address argument (a Python int: a device pointer, or a host one in the emulation). */
static int want_addr(PyObject *o, const char *what, void **out) {
    unsigned long long a = PyLong_AsUnsignedLongLong(o);
    if (a == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Format(PyExc_TypeError, "%s must be an address (int)", what);
        return -1;
    }
    if (!a) {
        PyErr_Format(PyExc_ValueError, "%s is a null address", what);
        return -1;
    }
    *out = (void *)(uintptr_t)a;
    return 0;
}

PyDoc_STRVAR(forward_on_doc,
             "forward_on(pos, x, idx, w, used, xd, out, stream, scores=None, replace=True, "
             "draft=None)\n\n"
             "forward on a device tier (csrc/layer.h smoe_layers_forward_on): x float32 [T,H], "
             "idx int64 [T,k], w float32 [T,k] and used uint8 [E] on the host; xd and out the "
             "addresses of x's rows and of the float32 [T,H] output in the tier's memory; "
             "stream the compute stream (int cudaStream_t, 0 in the emulation), on which the "
             "experts' work is enqueued.  With the GIL released.");

/* The start of forward_on and forward_draft: initialised, n in [nmin, nmax] (else TypeError
 * with usage), a device tier, args[0] a layer position into *pos.  0, or -1 with an error. */
static int device_call_begin(LayersObject *self, PyObject *const *args, Py_ssize_t n,
                             Py_ssize_t nmin, Py_ssize_t nmax, const char *usage, long *pos) {
    if (check_init(self) < 0) return -1;
    if (n < nmin || n > nmax) {
        PyErr_SetString(PyExc_TypeError, usage);
        return -1;
    }
    if (!self->g.tier.ops) {
        PyErr_Format(PyExc_ValueError, "%s runs on a device tier; this Layers is over a CPU "
                     "cache (forward; the CPU Engine drafts through its ExpertCopy)", usage);
        return -1;
    }
    *pos = PyLong_AsLong(args[0]);
    if (*pos == -1 && PyErr_Occurred()) return -1;
    if (*pos < 0 || *pos >= (long)self->g.L) {
        PyErr_Format(PyExc_ValueError, "pos %ld outside 0..%u", *pos, self->g.L - 1);
        return -1;
    }
    return 0;
}

static PyObject *Layers_forward_on(LayersObject *self, PyObject *const *args, Py_ssize_t n) {
    smoe_layers *g = &self->g;
    long pos;
    if (device_call_begin(self, args, n, 8, 11, "forward_on(pos, x, idx, w, used, xd, out, "
                          "stream, scores=None, replace=True, draft=None)", &pos) < 0)
        return NULL;
    PyArrayObject *x, *idx, *w, *used, *sc = NULL, *dr = NULL;
    void *xd, *out;
    if (!(x = smoe_py_want_array(args[1], "x", NPY_FLOAT32, 2, 0)) ||
        !(idx = smoe_py_want_array(args[2], "idx", NPY_INT64, 2, 0)) ||
        !(w = smoe_py_want_array(args[3], "w", NPY_FLOAT32, 2, 0)) ||
        !(used = smoe_py_want_array(args[4], "used", NPY_UINT8, 1, 1)) ||
        want_addr(args[5], "xd", &xd) < 0 || want_addr(args[6], "out", &out) < 0)
        return NULL;
    unsigned long long stream = PyLong_AsUnsignedLongLong(args[7]);
    if (stream == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    if (n > 8 && args[8] != Py_None &&
        !(sc = smoe_py_want_array(args[8], "scores", NPY_FLOAT32, 2, 0)))
        return NULL;
    int replace = 1;
    if (n > 9 && (replace = PyObject_IsTrue(args[9])) < 0) return NULL;
    if (n > 10 && args[10] != Py_None &&
        !(dr = smoe_py_want_array(args[10], "draft", NPY_UINT8, 1, 0)))
        return NULL;
    npy_intp T = PyArray_DIM(x, 0);
    if (PyArray_DIM(x, 1) != (npy_intp)g->H || PyArray_DIM(idx, 0) != T ||
        PyArray_DIM(idx, 1) != (npy_intp)g->k || PyArray_DIM(w, 0) != T ||
        PyArray_DIM(w, 1) != (npy_intp)g->k || PyArray_DIM(used, 0) != (npy_intp)g->E ||
        (sc && (PyArray_DIM(sc, 0) != T || PyArray_DIM(sc, 1) != (npy_intp)g->E)) ||
        (dr && PyArray_DIM(dr, 0) != T) || T > UINT32_MAX) {
        PyErr_Format(PyExc_ValueError, "shape mismatch: x %ldx%ld, idx %ldx%ld, w %ldx%ld, "
                     "used %ld (hidden %u, top_k %u, experts %u)", (long)T,
                     (long)PyArray_DIM(x, 1), (long)PyArray_DIM(idx, 0),
                     (long)PyArray_DIM(idx, 1), (long)PyArray_DIM(w, 0),
                     (long)PyArray_DIM(w, 1), (long)PyArray_DIM(used, 0), g->H, g->k, g->E);
        return NULL;
    }
    smoe_tier tier;
    if (tier_begin(self->cache_obj, &tier) < 0) return NULL;
    smoe_err e;
    smoe_err_clear(&e);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = smoe_layers_forward_on(g, (uint32_t)pos, PyArray_DATA(x), xd, (uint32_t)T,
                                PyArray_DATA(idx), PyArray_DATA(w), out, PyArray_DATA(used),
                                sc ? PyArray_DATA(sc) : NULL, replace,
                                dr ? PyArray_DATA(dr) : NULL, (void *)(uintptr_t)stream, &e);
    Py_END_ALLOW_THREADS
    tier_end(self->cache_obj);
    if (rc) return smoe_py_raise(&e);
    Py_RETURN_NONE;
}

static PyObject *Layers_forward(LayersObject *self, PyObject *const *args, Py_ssize_t n) {
    return layers_call(self, args, n, 0);
}

PyDoc_STRVAR(forward_routed_doc,
             "forward_routed(pos, x, idx, w, out, used, route_flags, replace=True, draft=None)\n\n"
             "forward with this layer's routing computed in C first (csrc/layer.h, "
             "smoe_layers_forward_routed): the softmax top-k router, or a sigmoid router's "
             "choice with its correction bias and groups (DeepSeek-V3's), from the layer's router "
             "copy; idx int64 [T,k] and w float32 [T,k] receive it (written); route_flags: "
             "ROUTE_RENORM | ROUTE_BF16_LOGITS | ROUTE_BF16_WEIGHTS | ROUTE_BF16_OUT | "
             "ROUTE_TOPK_SOFTMAX (GPT-OSS: the softmax of the k chosen logits); then the "
             "layer's shared FFN (set_block), if any, added to out.");

static PyObject *Layers_forward_routed(LayersObject *self, PyObject *const *args,
                                       Py_ssize_t n) {
    return layers_call(self, args, n, 1);
}

int smoe_py_mlp_parts(PyObject *t, smoe_shared_ffn *f, const char *what) {
    memset(f, 0, sizeof *f);
    if (t == Py_None) return 0;
    if (!PyTuple_Check(t) || PyTuple_GET_SIZE(t) < 3 || PyTuple_GET_SIZE(t) > 4) {
        PyErr_Format(PyExc_TypeError, "%s must be None or a (gate, up, down[, output_gate]) "
                     "tuple of _C.Linear", what);
        return -1;
    }
    for (int i = 0; i < PyTuple_GET_SIZE(t); i++)
        if (smoe_py_linear_parts(PyTuple_GET_ITEM(t, i), &f->d[i], &f->block[i], &f->bias[i]))
            return -1;
    return 0;
}

static PyObject *Layers_set_block(LayersObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"pos", "route_scale", "shared", "n_group", "topk_group", NULL};
    unsigned int pos, n_group = 1, topk_group = 1;
    float scale = 1.0f;
    PyObject *sh = Py_None;
    if (check_init(self) < 0 || /* (the groups: checked in C) */
        !PyArg_ParseTupleAndKeywords(args, kw, "I|fOII:set_block", kwlist, &pos, &scale, &sh,
                                     &n_group, &topk_group))
        return NULL;
    if (pos >= self->g.L) {
        PyErr_Format(PyExc_ValueError, "pos %u outside 0..%u", pos, self->g.L - 1);
        return NULL;
    }
    smoe_shared_ffn f;
    if (smoe_py_mlp_parts(sh, &f, "shared") < 0) return NULL;
    if (!self->shared) {
        if (!(self->shared = PyList_New(self->g.L))) return NULL;
        for (uint32_t l = 0; l < self->g.L; l++) {
            Py_INCREF(Py_None);
            PyList_SET_ITEM(self->shared, l, Py_None);
        }
    }
    smoe_err e;
    smoe_err_clear(&e);
    int rc;
    Py_BEGIN_ALLOW_THREADS /* waits for a forward in flight */
    rc = smoe_layers_set_block(&self->g, pos, scale, n_group, topk_group, &f, &e);
    Py_END_ALLOW_THREADS
    if (rc) return smoe_py_raise(&e);
    Py_INCREF(sh); /* the old tuple is released only now: g no longer borrows from it */
    if (PyList_SetItem(self->shared, pos, sh) < 0) return NULL;
    Py_RETURN_NONE;
}

static PyObject *Layers_configure(LayersObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"prefetch", "overfetch", "mass", "feed_counts", NULL};
    int prefetch, feed;
    double overfetch, mass;
    if (check_init(self) < 0 ||
        !PyArg_ParseTupleAndKeywords(args, kw, "pddp:configure", kwlist, &prefetch, &overfetch,
                                     &mass, &feed))
        return NULL;
    smoe_err e;
    smoe_err_clear(&e);
    int rc;
    Py_BEGIN_ALLOW_THREADS /* waits for a forward in flight (lock order: py_common.h) */
    rc = smoe_layers_configure(&self->g, prefetch, overfetch, mass, feed, &e);
    Py_END_ALLOW_THREADS
    if (rc) return smoe_py_raise(&e);
    Py_RETURN_NONE;
}

static PyObject *Layers_config(LayersObject *self, PyObject *noargs) {
    (void)noargs;
    if (check_init(self) < 0) return NULL;
    int prefetch, feed, miss, pred;
    double overfetch, mass, lam;
    uint32_t keep, keep2;
    Py_BEGIN_ALLOW_THREADS /* waits for a forward in flight (lock order: py_common.h) */
    smoe_layers_get_config(&self->g, &prefetch, &overfetch, &mass, &feed, &miss, &keep, &keep2,
                           &lam, &pred);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("{s:O,s:d,s:d,s:O,s:s,s:I,s:I,s:d,s:s}", "prefetch",
                         prefetch ? Py_True : Py_False, "overfetch", overfetch, "mass", mass,
                         "feed_counts", feed ? Py_True : Py_False, "miss", miss_names[miss],
                         "miss_keep", (unsigned int)keep, "miss_keep2", (unsigned int)keep2,
                         "route_lambda", lam, "predictor", predictor_names[pred]);
}

static PyObject *Layers_set_parallel(LayersObject *self, PyObject *arg) {
    int on = PyObject_IsTrue(arg);
    if (check_init(self) < 0 || on < 0) return NULL;
    Py_BEGIN_ALLOW_THREADS /* waits for a forward in flight (lock order: py_common.h) */
    smoe_layers_set_parallel(&self->g, on);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *Layers_set_down_dtypes(LayersObject *self, PyObject *arg) {
    if (check_init(self) < 0) return NULL;
    int32_t *dts = NULL;
    if (arg != Py_None) {
        PyObject *seq = PySequence_Fast(arg, "set_down_dtypes: a sequence of dtype codes or None");
        if (!seq) return NULL;
        Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
        if ((uint64_t)n != self->g.L) {
            Py_DECREF(seq);
            return PyErr_Format(PyExc_ValueError, "set_down_dtypes: %zd codes for %u layers", n,
                                self->g.L);
        }
        dts = PyMem_Malloc(sizeof *dts * (size_t)(n ? n : 1));
        if (!dts) {
            Py_DECREF(seq);
            return PyErr_NoMemory();
        }
        for (Py_ssize_t i = 0; i < n; i++) {
            long v = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, i));
            if ((v == -1 && PyErr_Occurred()) || v < 0 || v > 100) {
                PyMem_Free(dts);
                Py_DECREF(seq);
                if (!PyErr_Occurred())
                    PyErr_Format(PyExc_ValueError, "set_down_dtypes: code %ld out of range", v);
                return NULL;
            }
            dts[i] = (int32_t)v;
        }
        Py_DECREF(seq);
    }
    smoe_err e;
    int rc;
    Py_BEGIN_ALLOW_THREADS /* waits for a forward in flight (lock order: py_common.h) */
    rc = smoe_layers_set_down_dtypes(&self->g, dts, &e);
    Py_END_ALLOW_THREADS
    PyMem_Free(dts);
    if (rc) return smoe_py_raise(&e);
    Py_RETURN_NONE;
}

static PyObject *Layers_set_hybrid(LayersObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"on", "t_io", "t_gpu", "t_cpu", "admit", NULL};
    int on, admit = 1;
    double t_io = 0.0, t_gpu = 0.0, t_cpu = 0.0;
    if (check_init(self) < 0 ||
        !PyArg_ParseTupleAndKeywords(args, kw, "p|dddp:set_hybrid", kwlist, &on, &t_io, &t_gpu,
                                     &t_cpu, &admit))
        return NULL;
    smoe_err e;
    int rc;
    Py_BEGIN_ALLOW_THREADS /* waits for a forward in flight (lock order: py_common.h) */
    rc = smoe_layers_set_hybrid(&self->g, on, t_io, t_gpu, t_cpu, admit, &e);
    Py_END_ALLOW_THREADS
    if (rc) return smoe_py_raise(&e);
    Py_RETURN_NONE;
}

static PyObject *Layers_set_miss(LayersObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"miss", "keep", "route_lambda", "keep2", NULL};
    const char *name;
    unsigned int keep, keep2 = UINT32_MAX;
    double lam;
    if (check_init(self) < 0 ||
        !PyArg_ParseTupleAndKeywords(args, kw, "sId|I:set_miss", kwlist, &name, &keep, &lam,
                                     &keep2))
        return NULL;
    if (keep2 == UINT32_MAX) keep2 = self->g.k;
    int mode = -1;
    for (int i = 0; i < (int)(sizeof miss_names / sizeof *miss_names); i++)
        if (!strcmp(name, miss_names[i])) mode = i;
    if (mode < 0) {
        PyErr_Format(PyExc_ValueError,
                     "miss='%s' is not a miss mode: choose fetch, drop, substitute, lowest_bit "
                     "or priority",
                     name);
        return NULL;
    }
    smoe_err e;
    smoe_err_clear(&e);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = smoe_layers_set_miss(&self->g, mode, keep, keep2, lam, &e);
    Py_END_ALLOW_THREADS
    if (rc) return smoe_py_raise(&e);
    Py_RETURN_NONE;
}

static PyObject *Layers_set_predictor(LayersObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"predictor", "model", NULL};
    const char *name;
    PyObject *model_o = Py_None;
    if (check_init(self) < 0 ||
        !PyArg_ParseTupleAndKeywords(args, kw, "s|O:set_predictor", kwlist, &name, &model_o))
        return NULL;
    int kind = -1;
    for (int i = 0; i < (int)(sizeof predictor_names / sizeof *predictor_names); i++)
        if (!strcmp(name, predictor_names[i])) kind = i;
    if (kind < 0)
        return PyErr_Format(PyExc_ValueError, "predictor='%s' is not a predictor: choose router, "
                            "learned or oracle", name);
    PyArrayObject *mod = NULL;
    if (model_o != Py_None) { /* the learned predictor's model (NextUseModel.flat()) */
        mod = (PyArrayObject *)PyArray_FROM_OTF(model_o, NPY_FLOAT64, NPY_ARRAY_IN_ARRAY);
        if (!mod) return NULL;
        if (PyArray_NDIM(mod) != 1) {
            Py_DECREF(mod);
            return PyErr_Format(PyExc_ValueError, "set_predictor: model must be a 1-D float "
                                "array (NextUseModel.flat())");
        }
    }
    smoe_err e;
    smoe_err_clear(&e);
    int rc;
    const double *m = mod ? PyArray_DATA(mod) : NULL;
    uint64_t mlen = mod ? (uint64_t)PyArray_DIM(mod, 0) : 0;
    Py_BEGIN_ALLOW_THREADS /* waits for a forward in flight (lock order: py_common.h) */
    rc = smoe_layers_set_predictor(&self->g, kind, m, mlen, &e);
    Py_END_ALLOW_THREADS
    Py_XDECREF(mod);
    if (rc) return smoe_py_raise(&e);
    Py_RETURN_NONE;
}

static PyObject *Layers_set_replay(LayersObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"experts", "start", NULL};
    PyObject *arg;
    unsigned long long start = 0;
    if (check_init(self) < 0 ||
        !PyArg_ParseTupleAndKeywords(args, kw, "O|K:set_replay", kwlist, &arg, &start))
        return NULL;
    PyArrayObject *ex = NULL;
    if (arg != Py_None) {
        ex = (PyArrayObject *)PyArray_FROMANY(arg, NPY_INT16, 3, 3,
                                              NPY_ARRAY_IN_ARRAY | NPY_ARRAY_FORCECAST);
        if (!ex) return NULL;
        if ((uint64_t)PyArray_DIM(ex, 1) != self->g.L ||
            (uint64_t)PyArray_DIM(ex, 2) != self->g.k) {
            PyErr_Format(PyExc_ValueError, "set_replay: experts has shape [%zd, %zd, %zd], the "
                         "model routes [tokens, %u, %u]", (Py_ssize_t)PyArray_DIM(ex, 0),
                         (Py_ssize_t)PyArray_DIM(ex, 1), (Py_ssize_t)PyArray_DIM(ex, 2),
                         self->g.L, self->g.k);
            Py_DECREF(ex);
            return NULL;
        }
    }
    smoe_err e;
    smoe_err_clear(&e);
    int rc;
    const int16_t *d = ex ? PyArray_DATA(ex) : NULL;
    uint64_t n = ex ? (uint64_t)PyArray_DIM(ex, 0) : 0;
    Py_BEGIN_ALLOW_THREADS /* waits for a forward in flight (lock order: py_common.h) */
    rc = smoe_layers_set_replay(&self->g, d, n, start, &e);
    Py_END_ALLOW_THREADS
    Py_XDECREF(ex);
    if (rc) return smoe_py_raise(&e);
    Py_RETURN_NONE;
}

static PyObject *Layers_set_priors(LayersObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"table", "rows", NULL};
    PyObject *t_o, *r_o = Py_None;
    if (check_init(self) < 0 ||
        !PyArg_ParseTupleAndKeywords(args, kw, "O|O:set_priors", kwlist, &t_o, &r_o))
        return NULL;
    PyArrayObject *tab = NULL, *rows = NULL;
    if (t_o != Py_None) {
        tab = (PyArrayObject *)PyArray_FROMANY(t_o, NPY_FLOAT32, 2, 2, NPY_ARRAY_IN_ARRAY);
        if (!tab) return NULL;
        if ((uint64_t)PyArray_DIM(tab, 1) != (uint64_t)self->g.L * self->g.E) {
            PyErr_Format(PyExc_ValueError, "set_priors: the table has %zd columns, the model "
                         "%u layers x %u experts", (Py_ssize_t)PyArray_DIM(tab, 1), self->g.L,
                         self->g.E);
            Py_DECREF(tab);
            return NULL;
        }
        if (r_o != Py_None &&
            !(rows = (PyArrayObject *)PyArray_FROMANY(r_o, NPY_INT32, 1, 1,
                                                      NPY_ARRAY_IN_ARRAY))) {
            Py_DECREF(tab);
            return NULL;
        }
    }
    smoe_err e;
    smoe_err_clear(&e);
    int rc;
    const float *td = tab ? PyArray_DATA(tab) : NULL;
    const int32_t *rd = rows ? PyArray_DATA(rows) : NULL;
    const uint64_t n = tab ? (uint64_t)PyArray_DIM(tab, 0) : 0;
    const uint64_t nr = rows ? (uint64_t)PyArray_DIM(rows, 0) : 0;
    Py_BEGIN_ALLOW_THREADS /* waits for a forward in flight (lock order: py_common.h) */
    rc = smoe_layers_set_priors(&self->g, td, n, rd, nr, &e);
    Py_END_ALLOW_THREADS
    Py_XDECREF(tab);
    Py_XDECREF(rows);
    if (rc) return smoe_py_raise(&e);
    Py_RETURN_NONE;
}

static PyObject *Layers_set_next_prior(LayersObject *self, PyObject *arg) {
    if (check_init(self) < 0) return NULL;
    long row = PyLong_AsLong(arg);
    if (row == -1 && PyErr_Occurred()) return NULL;
    if (row < -1 || row > INT32_MAX) row = row < 0 ? -1 : INT32_MAX;
    smoe_err e;
    smoe_err_clear(&e);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = smoe_layers_set_next_prior(&self->g, (int32_t)row, &e);
    Py_END_ALLOW_THREADS
    if (rc) return smoe_py_raise(&e);
    Py_RETURN_NONE;
}

static PyObject *Layers_replay_position(LayersObject *self, PyObject *noargs) {
    (void)noargs;
    if (check_init(self) < 0) return NULL;
    uint64_t used, n;
    Py_BEGIN_ALLOW_THREADS
    smoe_layers_replay_position(&self->g, &used, &n);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("(KK)", (unsigned long long)used, (unsigned long long)n);
}

/* What set_lowbit and set_draft share: slot i of self->lowbit (0, 1: the low-bit copies, 2:
 * the draft copy) set from buf -- None (removed), a buffer (g borrows it: held in the slot),
 * or on a device tier an address of `size` bytes in its memory (the caller keeps it) -- through
 * set(g, level, base, size, bb, desc), which validates and takes g's mutex. */
typedef int (*copy_setter)(smoe_layers *g, uint32_t level, const uint8_t *base, uint64_t size,
                           uint64_t bb, const smoe_ffn_desc *d, smoe_err *e);

static PyObject *set_copy(LayersObject *self, int slot, uint32_t level, copy_setter set,
                          PyObject *buf, PyObject *desc, unsigned long long bb,
                          unsigned long long size) {
    smoe_err e;
    smoe_err_clear(&e);
    int rc;
    Py_buffer view;
    const uint8_t *base = NULL;
    int have_view = 0;
    smoe_ffn_desc d;
    memset(&d, 0, sizeof d);
    if (buf != Py_None) {
        if (!PyDict_Check(desc) || bb == 0) {
            PyErr_SetString(PyExc_TypeError, "(buf, desc, block_bytes): desc a dict, "
                            "block_bytes > 0");
            return NULL;
        }
        if (smoe_py_ffn_desc_parse(desc, bb, &d) < 0) return NULL;
        if (PyLong_Check(buf)) { /* a device tier's copy in its memory */
            void *p;
            if (!self->g.tier.ops) {
                PyErr_SetString(PyExc_TypeError, "an address is for a device tier; give the "
                                "CPU tier a buffer");
                return NULL;
            }
            if (want_addr(buf, "buf", &p) < 0) return NULL;
            base = p;
        } else {
            if (PyObject_GetBuffer(buf, &view, PyBUF_SIMPLE) < 0) return NULL;
            have_view = 1;
            base = view.buf;
            size = (unsigned long long)view.len;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    rc = set(&self->g, level, base, size, bb, &d, &e);
    Py_END_ALLOW_THREADS
    if (rc) {
        if (have_view) PyBuffer_Release(&view);
        return smoe_py_raise(&e);
    }
    if (self->has_lowbit[slot]) /* no longer borrowed by g */
        PyBuffer_Release(&self->lowbit[slot]);
    self->has_lowbit[slot] = have_view;
    if (have_view) self->lowbit[slot] = view;
    Py_RETURN_NONE;
}

static PyObject *Layers_set_lowbit(LayersObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"buf", "desc", "block_bytes", "level", "size", NULL};
    PyObject *buf, *desc = Py_None;
    unsigned long long bb = 0, size = 0;
    unsigned int level = 0;
    if (check_init(self) < 0 ||
        !PyArg_ParseTupleAndKeywords(args, kw, "O|OKIK:set_lowbit", kwlist, &buf, &desc, &bb,
                                     &level, &size))
        return NULL;
    if (level > 1) {
        PyErr_Format(PyExc_ValueError, "set_lowbit: level %u (0 or 1)", level);
        return NULL;
    }
    return set_copy(self, (int)level, level, smoe_layers_set_lowbit, buf, desc, bb, size);
}

static int set_draft(smoe_layers *g, uint32_t level, const uint8_t *base, uint64_t size,
                     uint64_t bb, const smoe_ffn_desc *d, smoe_err *e) {
    (void)level;
    return smoe_layers_set_draft(g, base, size, bb, d, e);
}

static PyObject *Layers_set_draft(LayersObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"buf", "desc", "block_bytes", "size", NULL};
    PyObject *buf, *desc = Py_None;
    unsigned long long bb = 0, size = 0;
    if (check_init(self) < 0 ||
        !PyArg_ParseTupleAndKeywords(args, kw, "O|OKK:set_draft", kwlist, &buf, &desc, &bb,
                                     &size))
        return NULL;
    return set_copy(self, 2, 0, set_draft, buf, desc, bb, size);
}

static PyObject *Layers_forward_draft(LayersObject *self, PyObject *const *args, Py_ssize_t n) {
    smoe_layers *g = &self->g;
    long pos;
    if (device_call_begin(self, args, n, 7, 7, "forward_draft(pos, idx, w, used, xd, out, "
                          "stream)", &pos) < 0)
        return NULL;
    PyArrayObject *idx, *w, *used;
    void *xd, *out;
    if (!(idx = smoe_py_want_array(args[1], "idx", NPY_INT64, 2, 0)) ||
        !(w = smoe_py_want_array(args[2], "w", NPY_FLOAT32, 2, 0)) ||
        !(used = smoe_py_want_array(args[3], "used", NPY_UINT8, 1, 1)) ||
        want_addr(args[4], "xd", &xd) < 0 || want_addr(args[5], "out", &out) < 0)
        return NULL;
    unsigned long long stream = PyLong_AsUnsignedLongLong(args[6]);
    if (stream == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
    npy_intp T = PyArray_DIM(idx, 0);
    if (PyArray_DIM(idx, 1) != (npy_intp)g->k || PyArray_DIM(w, 0) != T ||
        PyArray_DIM(w, 1) != (npy_intp)g->k || PyArray_DIM(used, 0) != (npy_intp)g->E ||
        T > UINT32_MAX) {
        PyErr_Format(PyExc_ValueError, "shape mismatch: idx %ldx%ld, w %ldx%ld, used %ld "
                     "(top_k %u, experts %u)", (long)T, (long)PyArray_DIM(idx, 1),
                     (long)PyArray_DIM(w, 0), (long)PyArray_DIM(w, 1),
                     (long)PyArray_DIM(used, 0), g->k, g->E);
        return NULL;
    }
    smoe_tier tier;
    if (tier_begin(self->cache_obj, &tier) < 0) return NULL;
    smoe_err e;
    smoe_err_clear(&e);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = smoe_layers_forward_draft(g, (uint32_t)pos, xd, (uint32_t)T, PyArray_DATA(idx),
                                   PyArray_DATA(w), out, PyArray_DATA(used),
                                   (void *)(uintptr_t)stream, &e);
    Py_END_ALLOW_THREADS
    tier_end(self->cache_obj);
    if (rc) return smoe_py_raise(&e);
    Py_RETURN_NONE;
}

static PyObject *Layers_counters(LayersObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"reset", NULL};
    int reset = 0;
    if (check_init(self) < 0 ||
        !PyArg_ParseTupleAndKeywords(args, kw, "|p:counters", kwlist, &reset))
        return NULL;
    smoe_layer_counters c;
    Py_BEGIN_ALLOW_THREADS
    smoe_layers_counters(&self->g, &c, reset);
    Py_END_ALLOW_THREADS
    return Py_BuildValue("{s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K}",
                         "tokens",
                         (unsigned long long)c.tokens, "passes", (unsigned long long)c.passes,
                         "predicted", (unsigned long long)c.predicted, "true_positive",
                         (unsigned long long)c.true_positive, "actual",
                         (unsigned long long)c.actual, "rerouted",
                         (unsigned long long)c.rerouted, "missing", (unsigned long long)c.missing,
                         "dropped", (unsigned long long)c.dropped, "substituted",
                         (unsigned long long)c.substituted, "lowbit",
                         (unsigned long long)c.lowbit, "lowbit2", (unsigned long long)c.lowbit2,
                         "overlapped",
                         (unsigned long long)c.overlapped, "draft_kept",
                         (unsigned long long)c.draft_kept, "hybrid_cpu_experts",
                         (unsigned long long)c.hybrid_cpu_experts, "hybrid_cpu_pairs",
                         (unsigned long long)c.hybrid_cpu_pairs, "hybrid_copied",
                         (unsigned long long)c.hybrid_copied, "hybrid_admitted",
                         (unsigned long long)c.hybrid_admitted);
}

static PyMethodDef Layers_methods[] = {
    {"forward", (PyCFunction)(void (*)(void))Layers_forward, METH_FASTCALL, forward_doc},
    {"forward_routed", (PyCFunction)(void (*)(void))Layers_forward_routed, METH_FASTCALL,
     forward_routed_doc},
    {"forward_on", (PyCFunction)(void (*)(void))Layers_forward_on, METH_FASTCALL,
     forward_on_doc},
    {"set_block", (PyCFunction)(void (*)(void))Layers_set_block, METH_VARARGS | METH_KEYWORDS,
     "set_block(pos, route_scale=1.0, shared=None, n_group=1, topk_group=1): layer pos's "
     "routing-weight factor (routed_scaling_factor), group-limited choice (DeepSeek-V3's) and "
     "shared FFN, None or a (gate, up, down[, output_gate]) tuple of _C.Linear whose down(silu("
     "gate x) * up x), times sigmoid(output_gate x) when given (Qwen2-MoE's shared_expert_gate),"
     " is added to the experts' output (ROUTE_BF16_OUT: a bf16 model's roundings); csrc/layer.h."},
    {"configure", (PyCFunction)(void (*)(void))Layers_configure, METH_VARARGS | METH_KEYWORDS,
     "configure(prefetch, overfetch, mass, feed_counts): prediction settings (mass 0: top-m "
     "mode); forgets pending predictions."},
    {"set_miss", (PyCFunction)(void (*)(void))Layers_set_miss, METH_VARARGS | METH_KEYWORDS,
     "set_miss(miss, keep, route_lambda, keep2=top_k): SpecMD miss handling (fetch, drop, "
     "substitute, lowest_bit, priority), the top ranks drop and priority always fetch, "
     "cache-aware routing strength (0: off); priority computes ranks keep..keep2-1 from "
     "low-bit copy 0 and the rest from copy 1; see csrc/layer.h."},
    {"set_predictor", (PyCFunction)(void (*)(void))Layers_set_predictor,
     METH_VARARGS | METH_KEYWORDS,
     "set_predictor(predictor, model=None): what ranks the next layer's experts for prefetch\n"
     "when no scores are passed: 'router' (the next router on this layer's input), 'learned'\n"
     "(the nextuse model's q; model = NextUseModel.flat(), None: built-in temporal weights) or\n"
     "'oracle' (a replay's next-layer experts); csrc/layer.h smoe_layers_set_predictor."},
    {"set_replay", (PyCFunction)(void (*)(void))Layers_set_replay, METH_VARARGS | METH_KEYWORDS,
     "set_replay(experts or None, start=0): forward_routed takes each token's experts from\n"
     "int16 [tokens, layers, top_k] (a Trace's experts), weights from the router's\n"
     "probabilities; the next pass starts at trace token start (csrc/layer.h\n"
     "smoe_layers_set_replay)."},
    {"set_priors", (PyCFunction)(void (*)(void))Layers_set_priors, METH_VARARGS | METH_KEYWORDS,
     "set_priors(table float32 [n, L*E] or None, rows=None or int32 [replay tokens]): token\n"
     "priors for one-token passes, given to the cache's policy and the learned predictor: a\n"
     "replayed token's row, else the row set_next_prior gave (csrc/layer.h smoe_layers_set_priors)."},
    {"set_next_prior", (PyCFunction)Layers_set_next_prior, METH_O,
     "set_next_prior(row): the table row of the next pass's token (-1: none), consumed when the\n"
     "pass starts."},
    {"replay_position", (PyCFunction)Layers_replay_position, METH_NOARGS,
     "replay_position() -> (tokens replayed, tokens in the trace); (0, 0) without a replay."},
    {"config", (PyCFunction)Layers_config, METH_NOARGS,
     "config() -> dict of the settings configure() set (prefetch, overfetch, mass, "
     "feed_counts) and set_miss() set (miss, miss_keep, miss_keep2, route_lambda): the engines "
     "read them back from here."},
    {"set_down_dtypes", (PyCFunction)Layers_set_down_dtypes, METH_O,
     "set_down_dtypes(codes or None): each layer's down-matrix format (FFNSpec dtype codes; a\n"
     "GGUF block store whose layers differ, e.g. Q4_K_M's Q4_K and Q6_K), validated against\n"
     "the slot size (csrc/layer.h smoe_layers_set_down_dtypes)."},
    {"set_parallel", (PyCFunction)Layers_set_parallel, METH_O,
     "set_parallel(on): a layer's misses load on the prefetch worker while its resident "
     "experts compute (layer.h, step 5)."},
    {"set_hybrid", (PyCFunction)(void (*)(void))Layers_set_hybrid, METH_VARARGS | METH_KEYWORDS,
     "set_hybrid(on, t_io=0.0, t_gpu=0.0, t_cpu=0.0, admit=True): the hybrid tier (issue 37,\n"
     "csrc/layer.h smoe_layers_set_hybrid): a layer's missing experts split between copies\n"
     "and the CPU kernels on the tier's host copy by MoE-SpAc's Eq. 9 over these costs\n"
     "(seconds: one copy, one device expert call, one CPU token-expert product); admit:\n"
     "the CPU's experts are queued to the cache's worker, whose policy admits them or not."},
    {"set_lowbit", (PyCFunction)(void (*)(void))Layers_set_lowbit, METH_VARARGS | METH_KEYWORDS,
     "set_lowbit(buf, desc, block_bytes, level=0, size=0) or set_lowbit(None, level=0): "
     "resident low-bit copy 0 (miss='lowest_bit', draft tokens, priority's first fallback) or 1 "
     "(priority's second) of every expert, in store order; on a device tier buf may be the "
     "copy's address in the tier's memory (size: its bytes; the caller keeps it alive)."},
    {"set_draft", (PyCFunction)(void (*)(void))Layers_set_draft, METH_VARARGS | METH_KEYWORDS,
     "set_draft(buf, desc, block_bytes, size=0) or set_draft(None): the self-draft's resident "
     "copy of every expert for forward_draft (a buffer, or on a device tier an address in its "
     "memory)."},
    {"forward_draft", (PyCFunction)(void (*)(void))Layers_forward_draft, METH_FASTCALL,
     "forward_draft(pos, idx, w, used, xd, out, stream): a draft forward's MoE layer on a "
     "device tier, from the draft copy (csrc/layer.h smoe_layers_forward_draft); xd, out "
     "addresses in the tier's memory."},
    {"counters", (PyCFunction)(void (*)(void))Layers_counters, METH_VARARGS | METH_KEYWORDS,
     "counters(reset=False) -> dict of tokens, passes, predicted, true_positive, actual."},
    {NULL, NULL, 0, NULL}};

static PyTypeObject LayersType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "specmoe._C.Layers",
    .tp_basicsize = sizeof(LayersObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Layers(cache, kctx, desc, routers, top_k, sigmoid=False): the per-layer path of "
              "an offloaded model in one C call (csrc/layer.h).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Layers_init,
    .tp_dealloc = (destructor)Layers_dealloc,
    .tp_methods = Layers_methods,
};

int smoe_py_route_flags(PyObject *o, int *flags) {
    long f = PyLong_AsLong(o);
    if (f == -1 && PyErr_Occurred()) return -1;
    if (f < 0 || f > SMOE_ROUTE_ALL) {
        PyErr_Format(PyExc_ValueError, "route_flags %ld: not a combination of ROUTE_*", f);
        return -1;
    }
    *flags = (int)f;
    return 0;
}

smoe_layers *smoe_py_layers_begin(PyObject *obj) {
    if (!PyObject_TypeCheck(obj, &LayersType) || !((LayersObject *)obj)->initialized) {
        PyErr_Format(PyExc_TypeError, "expected an initialised specmoe._C.Layers, got %s",
                     Py_TYPE(obj)->tp_name);
        return NULL;
    }
    LayersObject *l = (LayersObject *)obj;
    if (l->g.tier.ops) {
        PyErr_SetString(PyExc_TypeError, "the C decoder runs the CPU tier's Layers only");
        return NULL;
    }
    smoe_tier tier;
    if (tier_begin(l->cache_obj, &tier) < 0) return NULL;
    return &l->g;
}

void smoe_py_layers_end(PyObject *obj) { tier_end(((LayersObject *)obj)->cache_obj); }

int smoe_py_layer_init(PyObject *m) {
    if (PyModule_AddType(m, &LayersType) < 0) return -1;
    if (PyModule_AddIntConstant(m, "ROUTE_RENORM", SMOE_ROUTE_RENORM) < 0 ||
        PyModule_AddIntConstant(m, "ROUTE_BF16_LOGITS", SMOE_ROUTE_BF16_LOGITS) < 0 ||
        PyModule_AddIntConstant(m, "ROUTE_BF16_WEIGHTS", SMOE_ROUTE_BF16_WEIGHTS) < 0 ||
        PyModule_AddIntConstant(m, "ROUTE_BF16_OUT", SMOE_ROUTE_BF16_OUT) < 0 ||
        PyModule_AddIntConstant(m, "ROUTE_TOPK_SOFTMAX", SMOE_ROUTE_TOPK_SOFTMAX) < 0)
        return -1;
    return 0;
}

/* Python binding of the C MoE layer (moe.h): _C.moe_forward.
 *
 * The expert source is either a buffer holding every block of the store in order
 * (resident: block (layer, expert) at (layer * num_experts + expert) * block_bytes) or, once
 * the cache binding provides it, a _C cache object.  The call releases the GIL for the whole
 * layer. */
#include "py_common.h"
#include "py_numpy.h"

#include "cache.h"
#include "moe.h"
#include "py_cache.h"

typedef struct resident_src {
    const uint8_t *base;
    uint64_t size, block_bytes;
    uint32_t num_experts;
} resident_src;

static int resident_acquire(void *ctx, uint32_t layer, uint32_t expert, const uint8_t **data,
                            smoe_err *err) {
    resident_src *r = ctx;
    uint64_t off = ((uint64_t)layer * r->num_experts + expert) * r->block_bytes;
    if (off + r->block_bytes > r->size)
        return smoe_err_set(err, SMOE_EINVAL,
                            "moe: layer %u expert %u lies past the end of the %llu-byte resident "
                            "buffer",
                            layer, expert, (unsigned long long)r->size);
    *data = r->base + off;
    return SMOE_OK;
}

static int resident_release(void *ctx, uint32_t layer, uint32_t expert, smoe_err *err) {
    (void)ctx, (void)layer, (void)expert, (void)err;
    return SMOE_OK;
}

static int cache_acquire(void *ctx, uint32_t layer, uint32_t expert, const uint8_t **data,
                         smoe_err *err) {
    return smoe_cache_acquire(ctx, layer, expert, data, err);
}

static int cache_release(void *ctx, uint32_t layer, uint32_t expert, smoe_err *err) {
    return smoe_cache_release(ctx, layer, expert, err);
}

static int parse_layout(PyObject *t, smoe_moe_layout *lo) {
    long long off[6];
    unsigned long long bb;
    if (!PyArg_ParseTuple(t, "IIiiffKLLLLLL;layout must be (hidden, inter, dtype, act, alpha, "
                             "limit, block_bytes, off_gate, off_up, off_down, off_bgate, off_bup, "
                             "off_bdown)",
                          &lo->hidden, &lo->inter, &lo->dtype, &lo->act, &lo->alpha, &lo->limit,
                          &bb, &off[0], &off[1], &off[2], &off[3], &off[4], &off[5]))
        return -1;
    lo->block_bytes = bb;
    uint64_t *dst[6] = {&lo->off_gate, &lo->off_up,  &lo->off_down,
                        &lo->off_bgate, &lo->off_bup, &lo->off_bdown};
    for (int i = 0; i < 6; i++) {
        if (off[i] < -1) {
            PyErr_Format(PyExc_ValueError, "layout offset %lld is negative", off[i]);
            return -1;
        }
        *dst[i] = off[i] < 0 ? SMOE_MOE_NONE : (uint64_t)off[i];
    }
    smoe_err e;
    smoe_err_clear(&e);
    if (smoe_moe_layout_check(lo, &e)) {
        smoe_py_raise(&e);
        return -1;
    }
    return 0;
}

static PyArrayObject *want(PyObject *o, const char *name, int type, int ndim, int writable) {
    if (!PyArray_Check(o)) {
        PyErr_Format(PyExc_TypeError, "%s must be a numpy array", name);
        return NULL;
    }
    PyArrayObject *a = (PyArrayObject *)o;
    if (PyArray_TYPE(a) != type || PyArray_NDIM(a) != ndim || !PyArray_IS_C_CONTIGUOUS(a) ||
        (writable && !PyArray_ISWRITEABLE(a))) {
        PyErr_Format(PyExc_ValueError, "%s must be a C-contiguous %s%s array of %d dims", name,
                     writable ? "writable " : "",
                     type == NPY_FLOAT32 ? "float32" : type == NPY_INT64 ? "int64" : "uint8",
                     ndim);
        return NULL;
    }
    return a;
}

PyDoc_STRVAR(moe_forward_doc,
             "moe_forward(source, layout, layer, num_experts, x, idx, w, out, used=None)\n\n"
             "out[T,H] = sum_k w[t,k] * expert_{idx[t,k]}(x[t]) for one MoE layer, in C with the "
             "GIL released.\nsource: a buffer with every expert block in store order.  layout: "
             "(hidden, inter, dtype 0=f32 1=bf16, act 0=silu 1=gpt-oss, alpha, limit, "
             "block_bytes, off_gate, off_up, off_down, off_bgate, off_bup, off_bdown; -1 = "
             "absent).  x, w, out float32; idx int64; used: uint8[num_experts] set to 1 per "
             "expert used.");

static PyObject *py_moe_forward(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"source", "layout", "layer", "num_experts", "x", "idx", "w",
                             "out", "used", NULL};
    PyObject *source, *layout_t, *xo, *io, *wo, *oo, *uo = Py_None;
    unsigned int layer, E;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OO!IIOOOO|O", kwlist, &source, &PyTuple_Type,
                                     &layout_t, &layer, &E, &xo, &io, &wo, &oo, &uo))
        return NULL;
    smoe_moe_layout lo;
    if (parse_layout(layout_t, &lo) < 0) return NULL;
    if (E == 0) {
        PyErr_SetString(PyExc_ValueError, "num_experts must be positive");
        return NULL;
    }
    PyArrayObject *x = want(xo, "x", NPY_FLOAT32, 2, 0), *idx = NULL, *w = NULL, *out = NULL,
                  *used = NULL;
    if (!x || !(idx = want(io, "idx", NPY_INT64, 2, 0)) || !(w = want(wo, "w", NPY_FLOAT32, 2, 0)) ||
        !(out = want(oo, "out", NPY_FLOAT32, 2, 1)))
        return NULL;
    if (uo != Py_None && !(used = want(uo, "used", NPY_UINT8, 1, 1))) return NULL;
    npy_intp T = PyArray_DIM(x, 0), k = PyArray_DIM(idx, 1);
    if (PyArray_DIM(x, 1) != (npy_intp)lo.hidden || PyArray_DIM(idx, 0) != T ||
        PyArray_DIM(w, 0) != T || PyArray_DIM(w, 1) != k || PyArray_DIM(out, 0) != T ||
        PyArray_DIM(out, 1) != (npy_intp)lo.hidden || T > UINT32_MAX || k > UINT32_MAX) {
        PyErr_Format(PyExc_ValueError,
                     "shape mismatch: x %ldx%ld, idx %ldx%ld, w %ldx%ld, out %ldx%ld (hidden %u)",
                     (long)T, (long)PyArray_DIM(x, 1), (long)PyArray_DIM(idx, 0), (long)k,
                     (long)PyArray_DIM(w, 0), (long)PyArray_DIM(w, 1), (long)PyArray_DIM(out, 0),
                     (long)PyArray_DIM(out, 1), lo.hidden);
        return NULL;
    }
    if (used && PyArray_DIM(used, 0) != (npy_intp)E) {
        PyErr_Format(PyExc_ValueError, "used must have num_experts=%u entries", E);
        return NULL;
    }
    if (out == x) {
        PyErr_SetString(PyExc_ValueError, "out must not be x");
        return NULL;
    }
    Py_buffer view;
    resident_src r;
    smoe_moe_source src;
    smoe_cache *cache = NULL;
    int have_view = 0;
    if (PyObject_CheckBuffer(source)) {
        if (PyObject_GetBuffer(source, &view, PyBUF_SIMPLE) < 0) return NULL;
        have_view = 1;
        r = (resident_src){view.buf, (uint64_t)view.len, lo.block_bytes, E};
        src = (smoe_moe_source){&r, resident_acquire, resident_release};
    } else {
        if (!(cache = smoe_py_cache_begin(source))) return NULL;
        if (cache->slot_bytes != lo.block_bytes || cache->num_experts != E ||
            layer >= cache->num_layers) {
            smoe_py_cache_end(source);
            PyErr_Format(PyExc_ValueError,
                         "cache (%u layers x %u experts, %llu-byte blocks) does not match layer "
                         "%u, num_experts %u, block_bytes %llu",
                         cache->num_layers, cache->num_experts,
                         (unsigned long long)cache->slot_bytes, layer, E,
                         (unsigned long long)lo.block_bytes);
            return NULL;
        }
        src = (smoe_moe_source){cache, cache_acquire, cache_release};
    }
    smoe_err e;
    smoe_err_clear(&e);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = smoe_moe_forward(&lo, &src, layer, E, PyArray_DATA(x), (uint32_t)T, PyArray_DATA(idx),
                          PyArray_DATA(w), (uint32_t)k, PyArray_DATA(out),
                          used ? PyArray_DATA(used) : NULL, &e);
    Py_END_ALLOW_THREADS
    if (have_view) PyBuffer_Release(&view);
    if (cache) smoe_py_cache_end(source);
    if (rc) return smoe_py_raise(&e);
    Py_RETURN_NONE;
}

static PyMethodDef moe_methods[] = {
    {"moe_forward", (PyCFunction)(void (*)(void))py_moe_forward, METH_VARARGS | METH_KEYWORDS,
     moe_forward_doc},
    {NULL, NULL, 0, NULL}};

int smoe_py_moe_init(PyObject *m) { return PyModule_AddFunctions(m, moe_methods); }

/* Python binding of the C MoE layer (moe.h): _C.moe_forward.
 *
 * The expert source is a _C.Cache (or an ExpertCache, through py_cache.h: close() is refused
 * while the call runs), or a buffer holding every block of the store in order (block
 * (layer, expert) at (layer * num_experts + expert) * block_bytes; tests and references).
 * The kernels come from a _C.KernelContext (py_kernels.h) or run single-threaded.  The call
 * releases the GIL for the whole layer. */
#include "py_common.h"
/* kernels.h before numpy: <complex.h> (pulled in by numpy) defines the macro I */
#include "cache.h"
#include "moe.h"
#include "py_kernels.h"
#include "py_cache.h"
#include "py_numpy.h"

PyDoc_STRVAR(moe_forward_doc,
             "moe_forward(source, kctx, desc, block_bytes, layer, num_experts, x, idx, w, out, "
             "used=None)\n\n"
             "out[T,H] = sum_j w[t,j] * expert_{idx[t,j]}(x[t]) for one MoE layer, in C with the "
             "GIL released.\nsource: a _C.Cache, or a buffer holding every expert block in store "
             "order (block (layer, e) at (layer * num_experts + e) * block_bytes).  kctx: a "
             "_C.KernelContext or None (single thread).  desc: the expert FFN descriptor dict "
             "(specmoe.runtime.kernels.FFNSpec.desc()).  x, w, out: float32 [T,H], [T,k], [T,H]; idx: "
             "int64 [T,k]; used: uint8[num_experts], set to 1 per expert used.");

static PyObject *py_moe_forward(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"source", "kctx", "desc", "block_bytes", "layer", "num_experts",
                             "x", "idx", "w", "out", "used", NULL};
    PyObject *source, *kco, *desc, *xo, *io, *wo, *oo, *uo = Py_None;
    unsigned long long block_bytes;
    unsigned int layer, E;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO!KIIOOOO|O", kwlist, &source, &kco,
                                     &PyDict_Type, &desc, &block_bytes, &layer, &E, &xo, &io,
                                     &wo, &oo, &uo))
        return NULL;
    smoe_ffn_desc d;
    if (block_bytes == 0) {
        PyErr_SetString(PyExc_ValueError, "block_bytes must be positive");
        return NULL;
    }
    if (smoe_py_ffn_desc_parse(desc, block_bytes, &d) < 0) return NULL;
    smoe_kctx *kc = NULL;
    if (kco != Py_None && !(kc = smoe_py_kctx(kco))) return NULL;
    if (E == 0) {
        PyErr_SetString(PyExc_ValueError, "num_experts must be positive");
        return NULL;
    }
    PyArrayObject *x = smoe_py_want_array(xo, "x", NPY_FLOAT32, 2, 0), *idx = NULL, *w = NULL, *out = NULL,
                  *used = NULL;
    if (!x || !(idx = smoe_py_want_array(io, "idx", NPY_INT64, 2, 0)) || !(w = smoe_py_want_array(wo, "w", NPY_FLOAT32, 2, 0)) ||
        !(out = smoe_py_want_array(oo, "out", NPY_FLOAT32, 2, 1)))
        return NULL;
    if (uo != Py_None && !(used = smoe_py_want_array(uo, "used", NPY_UINT8, 1, 1))) return NULL;
    npy_intp T = PyArray_DIM(x, 0), k = PyArray_DIM(idx, 1);
    if (PyArray_DIM(x, 1) != (npy_intp)d.H || PyArray_DIM(idx, 0) != T ||
        PyArray_DIM(w, 0) != T || PyArray_DIM(w, 1) != k || PyArray_DIM(out, 0) != T ||
        PyArray_DIM(out, 1) != (npy_intp)d.H || T > UINT32_MAX || k > UINT32_MAX) {
        PyErr_Format(PyExc_ValueError,
                     "shape mismatch: x %ldx%ld, idx %ldx%ld, w %ldx%ld, out %ldx%ld (hidden %u)",
                     (long)T, (long)PyArray_DIM(x, 1), (long)PyArray_DIM(idx, 0), (long)k,
                     (long)PyArray_DIM(w, 0), (long)PyArray_DIM(w, 1), (long)PyArray_DIM(out, 0),
                     (long)PyArray_DIM(out, 1), d.H);
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
    smoe_moe_resident r;
    smoe_moe_source src;
    smoe_cache *cache = NULL;
    int have_view = 0;
    if (PyObject_CheckBuffer(source)) {
        if (PyObject_GetBuffer(source, &view, PyBUF_SIMPLE) < 0) return NULL;
        have_view = 1;
        r = (smoe_moe_resident){view.buf, (uint64_t)view.len, block_bytes, E};
        src = smoe_moe_resident_source(&r);
    } else {
        if (!(cache = smoe_py_cache_begin(source))) return NULL;
        if (cache->tab.slot_bytes != block_bytes || cache->tab.num_experts != E ||
            layer >= cache->tab.num_layers) {
            smoe_py_cache_end(source);
            PyErr_Format(PyExc_ValueError,
                         "cache (%u layers x %u experts, %llu-byte blocks) does not match layer "
                         "%u, num_experts %u, block_bytes %llu",
                         cache->tab.num_layers, cache->tab.num_experts,
                         (unsigned long long)cache->tab.slot_bytes, layer, E,
                         (unsigned long long)block_bytes);
            return NULL;
        }
        src = smoe_moe_cache_source(cache);
    }
    smoe_err e;
    smoe_err_clear(&e);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = smoe_moe_forward(kc, &d, &src, layer, E, PyArray_DATA(x), (uint32_t)T, PyArray_DATA(idx),
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

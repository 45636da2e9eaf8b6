/* Python binding of the kernels area: specmoe._C.KernelContext (thread pool + ISA) with
 * ffn_forward and read_bw.  Every argument is validated here; the C kernels trust it. */
#include <stdlib.h>
#include <string.h>

#include "py_kernels.h"
#include "py_numpy.h"

typedef struct {
    PyObject_HEAD
    smoe_kctx ctx;
    int ready;
} KernelContextObject;

static PyTypeObject KernelContextType;

int smoe_py_f32_or_bf16(PyObject *o, const char *name, int ndim, int writable) {
    if (!PyArray_Check(o)) {
        PyErr_Format(PyExc_TypeError, "%s must be a numpy array", name);
        return -1;
    }
    PyArrayObject *a = (PyArrayObject *)o;
    int t = PyArray_TYPE(a);
    if ((t != NPY_FLOAT32 && t != NPY_UINT16 && t != NPY_INT16) || PyArray_NDIM(a) != ndim ||
        !PyArray_IS_C_CONTIGUOUS(a) || (writable && !PyArray_ISWRITEABLE(a))) {
        PyErr_Format(PyExc_ValueError,
                     "%s must be a C-contiguous%s float32 or bf16 (uint16 bits) array of %d dims",
                     name, writable ? ", writable" : "", ndim);
        return -1;
    }
    return t != NPY_FLOAT32;
}

smoe_kctx *smoe_py_kctx(PyObject *obj) {
    if (!PyObject_TypeCheck(obj, &KernelContextType)) {
        PyErr_Format(PyExc_TypeError, "expected specmoe._C.KernelContext, got %.100s",
                     Py_TYPE(obj)->tp_name);
        return NULL;
    }
    KernelContextObject *k = (KernelContextObject *)obj;
    if (!k->ready) {
        PyErr_SetString(PyExc_ValueError, "KernelContext is not initialised");
        return NULL;
    }
    return &k->ctx;
}

static int kc_init(KernelContextObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"threads", NULL};
    int threads = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "|i:KernelContext", kwlist, &threads)) return -1;
    if (threads < 0) {
        PyErr_Format(PyExc_ValueError, "threads must be >= 0 (0: all cores), got %d", threads);
        return -1;
    }
    if (self->ready) {
        smoe_kctx_free(&self->ctx);
        self->ready = 0;
    }
    smoe_err err;
    smoe_err_clear(&err);
    if (smoe_kctx_init(&self->ctx, (uint32_t)threads, &err) != 0) {
        smoe_py_raise(&err);
        return -1;
    }
    self->ready = 1;
    return 0;
}

static void kc_dealloc(KernelContextObject *self) {
    if (self->ready) {
        Py_BEGIN_ALLOW_THREADS
        smoe_kctx_free(&self->ctx);
        Py_END_ALLOW_THREADS
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int isa_from_name(const char *s) {
    if (strcmp(s, "auto") == 0) return -1;
    for (int i = SMOE_ISA_SCALAR; i <= SMOE_ISA_AVX512; i++)
        if (strcmp(s, smoe_isa_name(i)) == 0) return i;
    return -2;
}

static PyObject *kc_set_isa(KernelContextObject *self, PyObject *arg) {
    smoe_kctx *c = smoe_py_kctx((PyObject *)self);
    if (!c) return NULL;
    if (!PyUnicode_Check(arg)) {
        PyErr_SetString(PyExc_TypeError, "set_isa expects a str: scalar, avx2, avx512 or auto");
        return NULL;
    }
    const char *s = PyUnicode_AsUTF8(arg);
    if (!s) return NULL;
    int isa = isa_from_name(s);
    if (isa == -2) {
        PyErr_Format(PyExc_ValueError, "unknown ISA %R: expected scalar, avx2, avx512 or auto",
                     arg);
        return NULL;
    }
    smoe_err err;
    smoe_err_clear(&err);
    if (smoe_kctx_set_isa(c, isa, &err) != 0) return smoe_py_raise(&err);
    Py_RETURN_NONE;
}

static PyObject *kc_set_threads(KernelContextObject *self, PyObject *arg) {
    smoe_kctx *c = smoe_py_kctx((PyObject *)self);
    if (!c) return NULL;
    long n = PyLong_AsLong(arg);
    if (n == -1 && PyErr_Occurred()) return NULL;
    if (n < 0 || n > 1024) {
        PyErr_Format(PyExc_ValueError, "threads must be in [0, 1024] (0: all cores), got %ld", n);
        return NULL;
    }
    smoe_err err;
    smoe_err_clear(&err);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = smoe_kctx_set_threads(c, (uint32_t)n, &err);
    Py_END_ALLOW_THREADS
    if (rc != 0) return smoe_py_raise(&err);
    Py_RETURN_NONE;
}

static PyObject *kc_get_isa(KernelContextObject *self, void *closure) {
    (void)closure;
    smoe_kctx *c = smoe_py_kctx((PyObject *)self);
    return c ? PyUnicode_FromString(smoe_isa_name(c->isa)) : NULL;
}
static PyObject *kc_get_isa_max(KernelContextObject *self, void *closure) {
    (void)closure;
    smoe_kctx *c = smoe_py_kctx((PyObject *)self);
    return c ? PyUnicode_FromString(smoe_isa_name(c->isa_max)) : NULL;
}
static PyObject *kc_get_threads(KernelContextObject *self, void *closure) {
    (void)closure;
    smoe_kctx *c = smoe_py_kctx((PyObject *)self);
    return c ? PyLong_FromUnsignedLong(c->nthreads) : NULL;
}
static PyObject *kc_get_parallel_calls(KernelContextObject *self, void *closure) {
    (void)closure;
    smoe_kctx *c = smoe_py_kctx((PyObject *)self);
    return c ? PyLong_FromUnsignedLongLong(__atomic_load_n(&c->many_calls, __ATOMIC_RELAXED))
             : NULL;
}
static PyObject *kc_get_stream_pf(KernelContextObject *self, void *closure) {
    (void)closure;
    smoe_kctx *c = smoe_py_kctx((PyObject *)self);
    return c ? PyLong_FromUnsignedLong(__atomic_load_n(&c->stream_pf, __ATOMIC_RELAXED)) : NULL;
}
static int kc_set_stream_pf(KernelContextObject *self, PyObject *v, void *closure) {
    (void)closure;
    smoe_kctx *c = smoe_py_kctx((PyObject *)self);
    if (!c) return -1;
    if (!v || !PyLong_Check(v) || PyBool_Check(v)) {
        PyErr_SetString(PyExc_TypeError, "stream_prefetch must be an int (bytes)");
        return -1;
    }
    long n = PyLong_AsLong(v);
    if (n == -1 && PyErr_Occurred()) return -1;
    if (n < 0 || n > (long)SMOE_STREAM_PF_MAX) {
        PyErr_Format(PyExc_ValueError, "stream_prefetch must be 0 to %u bytes, got %ld",
                     SMOE_STREAM_PF_MAX, n);
        return -1;
    }
    __atomic_store_n(&c->stream_pf, (uint32_t)n, __ATOMIC_RELAXED); /* read once per call */
    return 0;
}
static PyObject *kc_get_features(KernelContextObject *self, void *closure) {
    (void)closure;
    smoe_kctx *c = smoe_py_kctx((PyObject *)self);
    if (!c) return NULL;
    return Py_BuildValue("{s:O,s:O}", "avx512_bf16", c->has_bf16 ? Py_True : Py_False,
                         "avx512_vnni", c->has_vnni ? Py_True : Py_False);
}

/* ---- ffn_forward ---- */

static PyArrayObject *as_array(PyObject *o, int typenum, int ndim, const char *name, int write) {
    if (!PyArray_Check(o)) {
        PyErr_Format(PyExc_ValueError, "%s must be a numpy array", name);
        return NULL;
    }
    PyArrayObject *a = (PyArrayObject *)o;
    if (PyArray_TYPE(a) != typenum) {
        PyArray_Descr *want = PyArray_DescrFromType(typenum);
        PyErr_Format(PyExc_ValueError, "%s must have dtype %S, got %S", name, (PyObject *)want,
                     (PyObject *)PyArray_DESCR(a));
        Py_XDECREF(want);
        return NULL;
    }
    if (PyArray_NDIM(a) != ndim) {
        PyErr_Format(PyExc_ValueError, "%s must be %d-dimensional, got %d dimensions", name, ndim,
                     PyArray_NDIM(a));
        return NULL;
    }
    if (!PyArray_IS_C_CONTIGUOUS(a) || !PyArray_ISALIGNED(a)) {
        PyErr_Format(PyExc_ValueError, "%s must be C-contiguous and aligned", name);
        return NULL;
    }
    if (write && !PyArray_ISWRITEABLE(a)) {
        PyErr_Format(PyExc_ValueError, "%s must be writeable", name);
        return NULL;
    }
    return a;
}

static PyObject *kc_ffn_forward(KernelContextObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"desc", "block", "x", "out", "rows", "scale", NULL};
    PyObject *desc_o, *block_o, *x_o, *out_o, *rows_o = Py_None, *scale_o = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOO|OO:ffn_forward", kwlist, &desc_o, &block_o,
                                     &x_o, &out_o, &rows_o, &scale_o))
        return NULL;
    smoe_kctx *c = smoe_py_kctx((PyObject *)self);
    if (!c) return NULL;
    PyArrayObject *block = as_array(block_o, NPY_UINT8, 1, "block", 0);
    if (!block) return NULL;
    smoe_ffn_desc d;
    if (smoe_py_ffn_desc_parse(desc_o, (uint64_t)PyArray_SIZE(block), &d) < 0) return NULL;
    PyArrayObject *x = as_array(x_o, NPY_FLOAT32, 2, "x", 0);
    if (!x) return NULL;
    PyArrayObject *out = as_array(out_o, NPY_FLOAT32, 2, "out", 1);
    if (!out) return NULL;
    if (PyArray_DIM(x, 1) != (npy_intp)d.H || PyArray_DIM(out, 1) != (npy_intp)d.H) {
        PyErr_Format(PyExc_ValueError,
                     "x has %zd columns and out %zd, the expert's hidden size is %u",
                     (Py_ssize_t)PyArray_DIM(x, 1), (Py_ssize_t)PyArray_DIM(out, 1), d.H);
        return NULL;
    }
    npy_intp nx = PyArray_DIM(x, 0), nout = PyArray_DIM(out, 0);
    npy_intp T = nx;
    const int32_t *rows = NULL;
    if (rows_o != Py_None) {
        PyArrayObject *r = as_array(rows_o, NPY_INT32, 1, "rows", 0);
        if (!r) return NULL;
        T = PyArray_DIM(r, 0);
        rows = (const int32_t *)PyArray_DATA(r);
        for (npy_intp t = 0; t < T; t++)
            if (rows[t] < 0 || rows[t] >= nx || rows[t] >= nout) {
                PyErr_Format(PyExc_ValueError,
                             "rows[%zd] = %d is outside x (%zd rows) or out (%zd rows)",
                             (Py_ssize_t)t, rows[t], (Py_ssize_t)nx, (Py_ssize_t)nout);
                return NULL;
            }
    } else if (nout < nx) {
        PyErr_Format(PyExc_ValueError, "out has %zd rows, fewer than x (%zd)", (Py_ssize_t)nout,
                     (Py_ssize_t)nx);
        return NULL;
    }
    if (T > (npy_intp)UINT32_MAX / 2) {
        PyErr_SetString(PyExc_ValueError, "too many tokens");
        return NULL;
    }
    const float *scale = NULL;
    if (scale_o != Py_None) {
        PyArrayObject *s = as_array(scale_o, NPY_FLOAT32, 1, "scale", 0);
        if (!s) return NULL;
        if (PyArray_DIM(s, 0) != T) {
            PyErr_Format(PyExc_ValueError, "scale has %zd entries for %zd tokens",
                         (Py_ssize_t)PyArray_DIM(s, 0), (Py_ssize_t)T);
            return NULL;
        }
        scale = (const float *)PyArray_DATA(s);
    }
    if (T == 0) Py_RETURN_NONE;
    size_t sb = smoe_ffn_scratch_bytes(&d, (uint32_t)T);
    void *scratch = malloc(sb);
    if (!scratch) return PyErr_NoMemory();
    smoe_err err;
    smoe_err_clear(&err);
    int rc;
    /* The arrays stay referenced by the argument tuple for the whole call. */
    Py_BEGIN_ALLOW_THREADS
    rc = smoe_ffn_forward(c, &d, (const uint8_t *)PyArray_DATA(block),
                          (const float *)PyArray_DATA(x), d.H, rows, scale, (uint32_t)T,
                          (float *)PyArray_DATA(out), d.H, scratch, &err);
    Py_END_ALLOW_THREADS
    free(scratch);
    if (rc != 0) return smoe_py_raise(&err);
    Py_RETURN_NONE;
}

static PyObject *kc_read_bw(KernelContextObject *self, PyObject *args) {
    PyObject *buf_o;
    unsigned int iters;
    if (!PyArg_ParseTuple(args, "OI:read_bw", &buf_o, &iters)) return NULL;
    smoe_kctx *c = smoe_py_kctx((PyObject *)self);
    if (!c) return NULL;
    PyArrayObject *buf = as_array(buf_o, NPY_UINT8, 1, "buffer", 0);
    if (!buf) return NULL;
    if (PyArray_SIZE(buf) == 0 || iters == 0) {
        PyErr_SetString(PyExc_ValueError, "read_bw needs a non-empty buffer and iters >= 1");
        return NULL;
    }
    double bps = 0.0;
    smoe_err err;
    smoe_err_clear(&err);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = smoe_read_bw(c, (const uint8_t *)PyArray_DATA(buf), (size_t)PyArray_SIZE(buf), iters,
                      &bps, &err);
    Py_END_ALLOW_THREADS
    if (rc != 0) return smoe_py_raise(&err);
    return PyFloat_FromDouble(bps);
}

/* gated_delta(q, k, v, g, beta, state, out, l2norm): smoe_gated_delta on numpy arrays (shapes
 * in its comment, kernels.h), without the GIL. */
static PyObject *kc_gated_delta(KernelContextObject *self, PyObject *args) {
    PyObject *q_o, *k_o, *v_o, *g_o, *b_o, *s_o, *o_o;
    int l2norm;
    if (!PyArg_ParseTuple(args, "OOOOOOOp:gated_delta", &q_o, &k_o, &v_o, &g_o, &b_o, &s_o,
                          &o_o, &l2norm))
        return NULL;
    smoe_kctx *c = smoe_py_kctx((PyObject *)self);
    if (!c) return NULL;
    PyArrayObject *q = as_array(q_o, NPY_FLOAT32, 4, "q", 0), *k, *v, *g, *b, *st, *out;
    if (!q || !(k = as_array(k_o, NPY_FLOAT32, 4, "k", 0)) ||
        !(v = as_array(v_o, NPY_FLOAT32, 4, "v", 0)) ||
        !(g = as_array(g_o, NPY_FLOAT32, 3, "g", 0)) ||
        !(b = as_array(b_o, NPY_FLOAT32, 3, "beta", 0)) ||
        !(st = as_array(s_o, NPY_FLOAT32, 4, "state", 1)) ||
        !(out = as_array(o_o, NPY_FLOAT32, 4, "out", 1)))
        return NULL;
    npy_intp *qd = PyArray_DIMS(q), *vd = PyArray_DIMS(v), *sd = PyArray_DIMS(st);
    const npy_intp B = qd[0], T = qd[1], Hk = qd[2], dk = qd[3], Hv = vd[2], dv = vd[3];
    int same = 1;
    for (int i = 0; i < 4; i++) same &= PyArray_DIM(k, i) == qd[i] && PyArray_DIM(out, i) == vd[i];
    same &= vd[0] == B && vd[1] == T && sd[0] == B && sd[1] == Hv && sd[2] == dk && sd[3] == dv;
    for (int i = 0; i < 3; i++)
        same &= PyArray_DIM(g, i) == vd[i] && PyArray_DIM(b, i) == vd[i];
    if (!same || B > UINT32_MAX || T > UINT32_MAX) {
        PyErr_SetString(PyExc_ValueError,
                        "gated_delta: shapes must be q, k [B, T, Hk, dk], v, out [B, T, Hv, dv], "
                        "g, beta [B, T, Hv], state [B, Hv, dk, dv]");
        return NULL;
    }
    if (PyArray_DATA(out) == PyArray_DATA(st)) {
        PyErr_SetString(PyExc_ValueError, "gated_delta: out and state must not alias");
        return NULL;
    }
    smoe_err err;
    smoe_err_clear(&err);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = smoe_gated_delta(c, PyArray_DATA(q), PyArray_DATA(k), PyArray_DATA(v), PyArray_DATA(g),
                          PyArray_DATA(b), PyArray_DATA(st), PyArray_DATA(out), (uint32_t)B,
                          (uint32_t)T, (uint32_t)Hk, (uint32_t)Hv, (uint32_t)dk, (uint32_t)dv,
                          l2norm, &err);
    Py_END_ALLOW_THREADS
    if (rc != 0) return smoe_py_raise(&err);
    Py_RETURN_NONE;
}

static PyObject *kc_scratch_bytes(KernelContextObject *self, PyObject *args) {
    (void)self;
    PyObject *desc_o;
    unsigned int T;
    if (!PyArg_ParseTuple(args, "OI:scratch_bytes", &desc_o, &T)) return NULL;
    smoe_ffn_desc d;
    if (smoe_py_ffn_desc_parse(desc_o, 0, &d) < 0) return NULL;
    return PyLong_FromSize_t(smoe_ffn_scratch_bytes(&d, T));
}

static PyMethodDef kc_methods[] = {
    {"set_isa", (PyCFunction)kc_set_isa, METH_O,
     "set_isa(name): use 'scalar', 'avx2', 'avx512' (if supported) or 'auto' (best)."},
    {"set_threads", (PyCFunction)kc_set_threads, METH_O,
     "set_threads(n): restart the pool with n threads (0: all cores)."},
    {"ffn_forward", (PyCFunction)(void (*)(void))kc_ffn_forward, METH_VARARGS | METH_KEYWORDS,
     "ffn_forward(desc, block, x, out, rows=None, scale=None): out[r] += scale * FFN(x[r])."},
    {"read_bw", (PyCFunction)kc_read_bw, METH_VARARGS,
     "read_bw(buffer, iters) -> bytes/s of a vectorized multithreaded read of buffer."},
    {"gated_delta", (PyCFunction)kc_gated_delta, METH_VARARGS,
     "gated_delta(q, k, v, g, beta, state, out, l2norm): the gated delta rule's recurrent "
     "steps (kernels.h smoe_gated_delta); state updated in place, out written."},
    {"scratch_bytes", (PyCFunction)kc_scratch_bytes, METH_VARARGS,
     "scratch_bytes(desc, tokens) -> scratch bytes one call needs."},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef kc_getset[] = {
    {"isa", (getter)kc_get_isa, NULL, "ISA in use.", NULL},
    {"isa_max", (getter)kc_get_isa_max, NULL, "Best ISA this CPU supports.", NULL},
    {"threads", (getter)kc_get_threads, NULL, "Threads per call (including the caller).", NULL},
    {"features", (getter)kc_get_features, NULL, "CPU extensions detected.", NULL},
    {"stream_prefetch", (getter)kc_get_stream_pf, (setter)kc_set_stream_pf,
     "Bytes ahead that the one-token bf16/int8 row loops prefetch (0: none); default 4096 on "
     "Intel CPUs, 0 elsewhere, or SPECMOE_STREAM_PREFETCH.  Never changes results.", NULL},
    {"parallel_calls", (getter)kc_get_parallel_calls, NULL,
     "MoE layer calls run expert-parallel on this context (a whole expert per thread; "
     "csrc/moe.h).", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyTypeObject KernelContextType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "specmoe._C.KernelContext",
    .tp_basicsize = sizeof(KernelContextObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "KernelContext(threads=0): persistent thread pool and ISA choice for the expert "
              "FFN kernels.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)kc_init,
    .tp_dealloc = (destructor)kc_dealloc,
    .tp_methods = kc_methods,
    .tp_getset = kc_getset,
};

int smoe_py_kernels_init(PyObject *m) {
    if (PyModule_AddType(m, &KernelContextType) < 0) return -1;
    return 0;
}

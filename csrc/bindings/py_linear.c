/* Python binding of the dense linear kernel: specmoe._C.Linear, one object per nn.Linear
 * replaced by specmoe.models.dense.  The descriptor is parsed and checked once at construction; the
 * per-token call (forward, METH_FASTCALL) only checks the two arrays' shapes and runs the
 * kernel without the GIL. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/block.h"
#include "py_kernels.h"
#include "py_numpy.h"

typedef struct {
    PyObject_HEAD
    PyObject *ctx_obj;   /* the KernelContext (strong reference) */
    PyObject *block_obj; /* uint8 array holding the weights (strong reference, never written) */
    PyObject *bias_obj;  /* float32 [N] array or NULL (strong reference, never written) */
    smoe_linear_desc d;
    void *scratch;       /* smoe_linear_scratch_bytes(d, SMOE_LINEAR_TCHUNK); guarded by mu */
    float *io;           /* bf16 inputs/outputs widened: io_cap floats, grown on first use
                            (min(T, SMOE_LINEAR_TCHUNK) * (K + N)); guarded by mu */
    size_t io_cap;
    pthread_mutex_t mu;  /* serializes forward calls on this object (they share scratch, io) */
    int ready;
} LinearObject;

static int dict_u64_opt(PyObject *dict, const char *key, uint64_t *out, int required) {
    return smoe_py_dict_u64(dict, "linear descriptor", key, out, required);
}

static int lin_init(LinearObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"ctx", "desc", "block", "bias", NULL};
    PyObject *ctx_o, *desc_o, *block_o, *bias_o = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOO|O:Linear", kwlist, &ctx_o, &desc_o, &block_o,
                                     &bias_o))
        return -1;
    if (self->ready) {
        PyErr_SetString(PyExc_RuntimeError, "Linear is already initialised");
        return -1;
    }
    if (!smoe_py_kctx(ctx_o)) return -1;
    PyArrayObject *block = smoe_py_want_array(block_o, "block", NPY_UINT8, 1, 0);
    if (!block) return -1;
    if (!PyDict_Check(desc_o)) {
        PyErr_SetString(PyExc_TypeError, "linear descriptor must be a dict (LinearSpec.desc())");
        return -1;
    }
    uint64_t n, k, dt, group, precise;
    smoe_linear_desc d;
    if (dict_u64_opt(desc_o, "N", &n, 1) || dict_u64_opt(desc_o, "K", &k, 1) ||
        dict_u64_opt(desc_o, "dtype", &dt, 1) || dict_u64_opt(desc_o, "group", &group, 0) ||
        dict_u64_opt(desc_o, "precise", &precise, 0) ||
        dict_u64_opt(desc_o, "weight", &d.w, 1) ||
        dict_u64_opt(desc_o, "weight_scale", &d.w_scale, 0))
        return -1;
    if (n > UINT32_MAX || k > UINT32_MAX || dt > 100 ||
        (group != SMOE_NO_TENSOR && group > UINT32_MAX)) {
        PyErr_SetString(PyExc_ValueError, "linear descriptor: field out of range");
        return -1;
    }
    d.N = (uint32_t)n;
    d.K = (uint32_t)k;
    d.dtype = (int32_t)dt;
    d.group = group == SMOE_NO_TENSOR ? 0 : (uint32_t)group;
    d.precise = precise != SMOE_NO_TENSOR && precise != 0;
    smoe_err err;
    smoe_err_clear(&err);
    if (smoe_linear_desc_check(&d, (uint64_t)PyArray_SIZE(block), &err) != 0) {
        smoe_py_raise(&err);
        return -1;
    }
    if (bias_o != Py_None) {
        PyArrayObject *b = smoe_py_want_array(bias_o, "bias", NPY_FLOAT32, 1, 0);
        if (!b) return -1;
        if (PyArray_DIM(b, 0) != (npy_intp)d.N) {
            PyErr_Format(PyExc_ValueError, "bias has %zd entries, the layer has N=%u outputs",
                         (Py_ssize_t)PyArray_DIM(b, 0), d.N);
            return -1;
        }
    }
    self->scratch = malloc(smoe_linear_scratch_bytes(&d, SMOE_LINEAR_TCHUNK));
    if (!self->scratch) {
        PyErr_NoMemory();
        return -1;
    }
    if (pthread_mutex_init(&self->mu, NULL) != 0) {
        free(self->scratch);
        self->scratch = NULL;
        PyErr_SetString(PyExc_RuntimeError, "Linear: pthread_mutex_init failed");
        return -1;
    }
    Py_INCREF(ctx_o);
    Py_INCREF(block_o);
    self->ctx_obj = ctx_o;
    self->block_obj = block_o;
    if (bias_o != Py_None) {
        Py_INCREF(bias_o);
        self->bias_obj = bias_o;
    }
    self->d = d;
    /* the weights stay for the layer's lifetime and are streamed at every call */
    smoe_advise_huge(PyArray_DATA(block), (size_t)PyArray_NBYTES(block), 1);
    self->ready = 1;
    return 0;
}

static void lin_dealloc(LinearObject *self) {
    if (self->ready) {
        pthread_mutex_destroy(&self->mu);
        free(self->scratch);
        free(self->io);
    }
    Py_XDECREF(self->ctx_obj);
    Py_XDECREF(self->block_obj);
    Py_XDECREF(self->bias_obj);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* out [T, N] = x [T, K] W^T + b on c's threads, x and out f32 or bf16 bits (xb, ob); bf16 is
 * widened / rounded here in chunks of SMOE_LINEAR_TCHUNK tokens through self->io.  No GIL
 * needed: takes self->mu; the weights are referenced by self, x and out by the caller. */
static int linear_run(LinearObject *self, smoe_kctx *c, const void *x, int xb, uint32_t T,
                      void *out, int ob, smoe_err *err) {
    const uint32_t K = self->d.K, N = self->d.N;
    const uint8_t *block = (const uint8_t *)PyArray_DATA((PyArrayObject *)self->block_obj);
    const float *bias =
        self->bias_obj ? (const float *)PyArray_DATA((PyArrayObject *)self->bias_obj) : NULL;
    const uint8_t *xp = (const uint8_t *)x;
    uint8_t *op = (uint8_t *)out;
    int rc = SMOE_OK;
    pthread_mutex_lock(&self->mu);
    if (!xb && !ob) {
        rc = smoe_linear_forward(c, &self->d, block, bias, (const float *)xp, K, T, (float *)op,
                                 N, self->scratch, err);
    } else {
        const uint32_t tc = T < SMOE_LINEAR_TCHUNK ? T : SMOE_LINEAR_TCHUNK;
        const size_t need = (size_t)tc * ((xb ? K : 0) + (ob ? N : 0));
        if (need > self->io_cap) {
            float *p = realloc(self->io, need * sizeof(float));
            if (p) {
                self->io = p;
                self->io_cap = need;
            } else {
                rc = smoe_err_set(err, SMOE_ENOMEM, "Linear: %zu bytes of bf16 I/O buffer",
                                  need * sizeof(float));
            }
        }
        float *xf = self->io, *of = self->io + (xb ? (size_t)tc * K : 0);
        for (uint32_t t0 = 0; rc == SMOE_OK && t0 < T; t0 += tc) {
            const uint32_t n = T - t0 < tc ? T - t0 : tc;
            const float *xin = (const float *)xp + (size_t)t0 * K;
            if (xb) {
                const uint16_t *src = (const uint16_t *)xp + (size_t)t0 * K;
                for (size_t i = 0; i < (size_t)n * K; i++) xf[i] = smoe_bf16_f32(src[i]);
                xin = xf;
            }
            float *dst = ob ? of : (float *)op + (size_t)t0 * N;
            rc = smoe_linear_forward(c, &self->d, block, bias, xin, K, n, dst, N, self->scratch,
                                     err);
            if (rc == SMOE_OK && ob) {
                uint16_t *o16 = (uint16_t *)op + (size_t)t0 * N;
                for (size_t i = 0; i < (size_t)n * N; i++) o16[i] = smoe_bf16_rne(of[i]);
            }
        }
    }
    pthread_mutex_unlock(&self->mu);
    return rc;
}

/* forward(x, out): x [T, K], out [T, N], each float32 or bf16 bits (C-contiguous); out = x W^T
 * + b.  bf16 is widened / rounded here (chunks of SMOE_LINEAR_TCHUNK tokens through io), so
 * the caller needs no casts. */
static PyObject *lin_forward(LinearObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (!self->ready) {
        PyErr_SetString(PyExc_ValueError, "Linear is not initialised");
        return NULL;
    }
    if (nargs != 2) {
        PyErr_Format(PyExc_TypeError, "forward(x, out) takes 2 arguments, got %zd", nargs);
        return NULL;
    }
    int xb = smoe_py_f32_or_bf16(args[0], "x", 2, 0);
    if (xb < 0) return NULL;
    int ob = smoe_py_f32_or_bf16(args[1], "out", 2, 1);
    if (ob < 0) return NULL;
    PyArrayObject *x = (PyArrayObject *)args[0], *out = (PyArrayObject *)args[1];
    npy_intp T = PyArray_DIM(x, 0);
    const uint32_t K = self->d.K, N = self->d.N;
    if (PyArray_DIM(x, 1) != (npy_intp)K || PyArray_DIM(out, 1) != (npy_intp)N ||
        PyArray_DIM(out, 0) != T) {
        PyErr_Format(PyExc_ValueError,
                     "Linear(%u -> %u): x must be [T, %u] and out [T, %u]; got x [%zd, %zd], "
                     "out [%zd, %zd]",
                     K, N, K, N, (Py_ssize_t)T, (Py_ssize_t)PyArray_DIM(x, 1),
                     (Py_ssize_t)PyArray_DIM(out, 0), (Py_ssize_t)PyArray_DIM(out, 1));
        return NULL;
    }
    if (T > (npy_intp)UINT32_MAX / 2) {
        PyErr_SetString(PyExc_ValueError, "Linear: too many tokens");
        return NULL;
    }
    if ((const void *)PyArray_DATA(out) == (const void *)PyArray_DATA(x) && T > 0) {
        PyErr_SetString(PyExc_ValueError, "Linear: out must not alias x");
        return NULL;
    }
    smoe_kctx *c = smoe_py_kctx(self->ctx_obj);
    if (!c) return NULL;
    smoe_err err;
    smoe_err_clear(&err);
    int rc;
    /* x, out stay referenced by the caller's frame for the whole call */
    Py_BEGIN_ALLOW_THREADS
    rc = linear_run(self, c, PyArray_DATA(x), xb, (uint32_t)T, PyArray_DATA(out), ob, &err);
    Py_END_ALLOW_THREADS
    if (rc != 0) return smoe_py_raise(&err);
    Py_RETURN_NONE;
}

static PyObject *lin_get_shape(LinearObject *self, void *closure) {
    (void)closure;
    return Py_BuildValue("(II)", self->d.N, self->d.K);
}

static PyMethodDef lin_methods[] = {
    {"forward", (PyCFunction)(void (*)(void))lin_forward, METH_FASTCALL,
     "forward(x, out): out = x @ W.T + bias; x [T, K], out [T, N], each float32 or bf16 "
     "(uint16 bits, rounded to nearest even as torch does), C-contiguous (GIL released)."},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef lin_getset[] = {
    {"shape", (getter)lin_get_shape, NULL, "(N, K): output and input features.", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyTypeObject LinearType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "specmoe._C.Linear",
    .tp_basicsize = sizeof(LinearObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Linear(ctx, desc, block, bias=None): a dense linear layer y = x W^T + b run by "
              "the expert kernels (W f32/bf16/int8/int4 in block at the descriptor's offsets, "
              "bias float32 [N]).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)lin_init,
    .tp_dealloc = (destructor)lin_dealloc,
    .tp_methods = lin_methods,
    .tp_getset = lin_getset,
};

int smoe_py_linear_parts(PyObject *obj, const smoe_linear_desc **d, const uint8_t **block,
                         const float **bias) {
    if (!PyObject_TypeCheck(obj, &LinearType) || !((LinearObject *)obj)->ready) {
        PyErr_Format(PyExc_TypeError, "expected an initialised specmoe._C.Linear, got %s",
                     Py_TYPE(obj)->tp_name);
        return -1;
    }
    LinearObject *l = (LinearObject *)obj;
    *d = &l->d;
    *block = (const uint8_t *)PyArray_DATA((PyArrayObject *)l->block_obj);
    *bias = l->bias_obj ? (const float *)PyArray_DATA((PyArrayObject *)l->bias_obj) : NULL;
    return 0;
}

smoe_kctx *smoe_py_linear_kctx(PyObject *obj) {
    const smoe_linear_desc *d;
    const uint8_t *b;
    const float *bias;
    if (smoe_py_linear_parts(obj, &d, &b, &bias)) return NULL;
    return smoe_py_kctx(((LinearObject *)obj)->ctx_obj);
}

int smoe_py_linear_run(PyObject *obj, smoe_kctx *c, const void *x, int xb, uint32_t T, void *out,
                       int ob, smoe_err *err) {
    return linear_run((LinearObject *)obj, c, x, xb, T, out, ob, err);
}

int smoe_py_linear_init(PyObject *m) {
    if (PyModule_AddType(m, &LinearType) < 0) return -1;
    return 0;
}

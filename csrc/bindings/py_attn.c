/* Python binding of the decode-attention kernels: specmoe._C.MLADecode, one object per MLA
 * attention module decoded in the absorbed form (specmoe.models.mla), and specmoe._C.MLABlock, such
 * a module with its decoder layer's norms, residual adds and MoE block in one call;
 * specmoe._C.AttnDecode (the models' own multi-head attention, specmoe.models.attention);
 * specmoe._C.AttnBlock, a whole Llama-family attention module (projections, q/k norms, rotary,
 * attention, output projection) in two calls around transformers' KV-cache update, or with its
 * decoder layer (norms, residual adds, the MoE block through a _C.Layers) in one
 * (specmoe.models.attention).  Weights are checked and referenced once at construction; the per-token
 * calls (METH_FASTCALL) check the arrays' shapes and run the kernels without the GIL. */
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/attn.h"
#include "kernels/block.h"
#include "py_kernels.h"
#include "py_layer.h"
#include "py_numpy.h"
#include "spec/verify.h"

typedef struct {
    PyObject_HEAD
    PyObject *ctx_obj;  /* the KernelContext (strong reference) */
    PyObject *w_uk_obj; /* [H, dn, r] float32, uint16 (bf16 bits) or int8, or [H, dn, r / 2]
                           uint8 (int4); strong, never written */
    PyObject *w_uv_obj; /* [H, dv, r], same dtype */
    PyObject *uk_scale_obj, *uv_scale_obj; /* int8/int4 scales (float32) or NULL; strong */
    smoe_mla_desc d;
    smoe_mla_weights w;
    void *scratch;      /* scratch_cap bytes; guarded by mu */
    size_t scratch_cap;
    pthread_mutex_t mu; /* serializes forward calls on this object (they share scratch) */
    int ready;
} MLADecodeObject;

/* The weight format of w_uk / w_uv: float32 -> F32, uint16/int16 -> BF16, int8 -> I8 (a scale
 * per row) or I4 (int4 values a byte, a scale per group: told apart by the scales' dims, see
 * mla_init), else -1 with an error naming the argument.  C-contiguous, 3 dims. */
static int weight_dtype(PyObject *o, const char *name) {
    if (!PyArray_Check(o)) {
        PyErr_Format(PyExc_TypeError, "%s must be a numpy array", name);
        return -1;
    }
    PyArrayObject *a = (PyArrayObject *)o;
    int t = PyArray_TYPE(a);
    if (PyArray_NDIM(a) == 3 && PyArray_IS_C_CONTIGUOUS(a)) {
        if (t == NPY_FLOAT32) return SMOE_WDT_F32;
        if (t == NPY_UINT16 || t == NPY_INT16) return SMOE_WDT_BF16;
        if (t == NPY_INT8) return SMOE_WDT_I8;
    }
    PyErr_Format(PyExc_ValueError,
                 "%s must be a C-contiguous 3-dim array: float32, bf16 (uint16 bits) or int8 "
                 "(int8 or int4 values)", name);
    return -1;
}

/* An int8/int4 scale array: float32, C-contiguous, dims [H, rows] (int8) or [H, rows, groups]
 * (int4), the weight's H and rows. */
static int scale_ok(PyObject *o, const char *name, PyArrayObject *w, int wdt) {
    int nd = wdt == SMOE_WDT_I8 ? 2 : 3;
    if (o == Py_None || !PyArray_Check(o) || PyArray_TYPE((PyArrayObject *)o) != NPY_FLOAT32 ||
        PyArray_NDIM((PyArrayObject *)o) != nd ||
        !PyArray_IS_C_CONTIGUOUS((PyArrayObject *)o) ||
        PyArray_DIM((PyArrayObject *)o, 0) != PyArray_DIM(w, 0) ||
        PyArray_DIM((PyArrayObject *)o, 1) != PyArray_DIM(w, 1)) {
        PyErr_Format(PyExc_ValueError,
                     "%s must be a C-contiguous float32 array [heads, rows%s] for %s weights",
                     name, nd == 3 ? ", groups" : "", nd == 3 ? "int4" : "int8");
        return -1;
    }
    return 0;
}

static int mla_init(MLADecodeObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"ctx", "w_uk", "w_uv", "rope_dim", "scale", "uk_scale",
                             "uv_scale", NULL};
    PyObject *ctx_o, *uk_o, *uv_o, *uks_o = Py_None, *uvs_o = Py_None;
    unsigned int dr;
    float scale;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOIf|OO:MLADecode", kwlist, &ctx_o, &uk_o,
                                     &uv_o, &dr, &scale, &uks_o, &uvs_o))
        return -1;
    if (self->ready) {
        PyErr_SetString(PyExc_RuntimeError, "MLADecode is already initialised");
        return -1;
    }
    if (!smoe_py_kctx(ctx_o)) return -1;
    int wk = weight_dtype(uk_o, "w_uk"), wv = weight_dtype(uv_o, "w_uv");
    if (wk < 0 || wv < 0) return -1;
    PyArrayObject *uk = (PyArrayObject *)uk_o, *uv = (PyArrayObject *)uv_o;
    if (wk != wv || PyArray_DIM(uk, 0) != PyArray_DIM(uv, 0) ||
        PyArray_DIM(uk, 2) != PyArray_DIM(uv, 2)) {
        PyErr_SetString(PyExc_ValueError,
                        "w_uk [H, dn, r] and w_uv [H, dv, r] must share dtype, H and r");
        return -1;
    }
    /* int8 weights with [H, rows, groups] scales hold int4 values */
    if (wk == SMOE_WDT_I8 && uks_o != Py_None && PyArray_Check(uks_o) &&
        PyArray_NDIM((PyArrayObject *)uks_o) == 3)
        wk = SMOE_WDT_I4;
    const int quant = wk == SMOE_WDT_I8 || wk == SMOE_WDT_I4;
    if (wk == SMOE_WDT_I4) {
        /* every value must be an int4 one */
        for (int a = 0; a < 2; a++) {
            PyArrayObject *arr = a ? uv : uk;
            const int8_t *v = (const int8_t *)PyArray_DATA(arr);
            for (npy_intp i = 0, n = PyArray_SIZE(arr); i < n; i++)
                if (v[i] < -8 || v[i] > 7) {
                    PyErr_Format(PyExc_ValueError, "%s: value %d at %zd is not an int4 value "
                                 "(-8..7)", a ? "w_uv" : "w_uk", (int)v[i], (Py_ssize_t)i);
                    return -1;
                }
        }
    }
    if (!quant && (uks_o != Py_None || uvs_o != Py_None)) {
        PyErr_SetString(PyExc_ValueError, "uk_scale / uv_scale are for int8/int4 weights only");
        return -1;
    }
    if (quant && (scale_ok(uks_o, "uk_scale", uk, wk) || scale_ok(uvs_o, "uv_scale", uv, wk)))
        return -1;
    smoe_mla_desc d;
    memset(&d, 0, sizeof d);
    npy_intp r = PyArray_DIM(uk, 2);
    npy_intp dims[4] = {PyArray_DIM(uk, 0), PyArray_DIM(uk, 1), PyArray_DIM(uv, 1), r};
    for (int i = 0; i < 4; i++)
        if (dims[i] > 65536) {
            PyErr_SetString(PyExc_ValueError, "MLADecode: a weight dimension exceeds 65536");
            return -1;
        }
    d.H = (uint32_t)dims[0];
    d.dn = (uint32_t)dims[1];
    d.dv = (uint32_t)dims[2];
    d.r = (uint32_t)dims[3];
    d.dr = dr;
    d.wdtype = wk;
    d.scale = scale;
    if (wk == SMOE_WDT_I4) {
        npy_intp g = PyArray_DIM((PyArrayObject *)uks_o, 2);
        if (g != PyArray_DIM((PyArrayObject *)uvs_o, 2) || g < 1 || r % g) {
            PyErr_SetString(PyExc_ValueError,
                            "uk_scale and uv_scale must have the same number of groups, "
                            "dividing kv_lora_rank");
            return -1;
        }
        d.group = (uint32_t)(r / g);
    }
    smoe_err err;
    smoe_err_clear(&err);
    if (smoe_mla_desc_check(&d, &err) != 0) {
        smoe_py_raise(&err);
        return -1;
    }
    if (pthread_mutex_init(&self->mu, NULL) != 0) {
        PyErr_SetString(PyExc_RuntimeError, "MLADecode: pthread_mutex_init failed");
        return -1;
    }
    smoe_advise_huge(PyArray_DATA(uk), (size_t)PyArray_NBYTES(uk), 1); /* as _C.Linear's */
    smoe_advise_huge(PyArray_DATA(uv), (size_t)PyArray_NBYTES(uv), 1);
    Py_INCREF(ctx_o);
    Py_INCREF(uk_o);
    Py_INCREF(uv_o);
    self->ctx_obj = ctx_o;
    self->w_uk_obj = uk_o;
    self->w_uv_obj = uv_o;
    self->w.uk = PyArray_DATA(uk);
    self->w.uv = PyArray_DATA(uv);
    if (quant) {
        Py_INCREF(uks_o);
        Py_INCREF(uvs_o);
        self->uk_scale_obj = uks_o;
        self->uv_scale_obj = uvs_o;
        self->w.uk_scale = (const float *)PyArray_DATA((PyArrayObject *)uks_o);
        self->w.uv_scale = (const float *)PyArray_DATA((PyArrayObject *)uvs_o);
    }
    self->d = d;
    self->ready = 1;
    return 0;
}

static void mla_dealloc(MLADecodeObject *self) {
    if (self->ready) pthread_mutex_destroy(&self->mu);
    free(self->scratch);
    Py_XDECREF(self->ctx_obj);
    Py_XDECREF(self->w_uk_obj);
    Py_XDECREF(self->w_uv_obj);
    Py_XDECREF(self->uk_scale_obj);
    Py_XDECREF(self->uv_scale_obj);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The array's dims must equal want[0..n) (a want of -1 matches any size). */
static int dims_are(PyObject *o, const char *name, const npy_intp *want, int n) {
    PyArrayObject *a = (PyArrayObject *)o;
    for (int i = 0; i < n; i++)
        if (want[i] >= 0 && PyArray_DIM(a, i) != want[i]) {
            PyErr_Format(PyExc_ValueError, "%s: dimension %d is %zd, expected %zd", name, i,
                         (Py_ssize_t)PyArray_DIM(a, i), (Py_ssize_t)want[i]);
            return -1;
        }
    return 0;
}

/* The optional additive bias argument: None -> NULL, 0 rows; else float32 [1 or B, T, S]. */
static int bias_arg(PyObject *o, npy_intp B, npy_intp T, npy_intp S, const float **bias,
                    uint32_t *rows) {
    *bias = NULL;
    *rows = 0;
    if (o == Py_None) return 0;
    PyArrayObject *b = smoe_py_want_array(o, "bias", NPY_FLOAT32, 3, 0);
    if (!b) return -1;
    npy_intp w_b[3] = {-1, T, S};
    if (dims_are(o, "bias [1 or B, T, S]", w_b, 3)) return -1;
    if (PyArray_DIM(b, 0) != 1 && PyArray_DIM(b, 0) != B) {
        PyErr_Format(PyExc_ValueError, "bias has %zd rows, expected 1 or B=%zd",
                     (Py_ssize_t)PyArray_DIM(b, 0), (Py_ssize_t)B);
        return -1;
    }
    *bias = (const float *)PyArray_DATA(b);
    *rows = (uint32_t)PyArray_DIM(b, 0);
    return 0;
}

/* Grow a kernel object's scratch to need bytes (first call, more tokens or more threads than
 * before); called under the object's mutex, without the GIL. */
static int grow_scratch(void **scratch, size_t *cap, size_t need, smoe_err *err) {
    if (need <= *cap) return SMOE_OK;
    void *p = realloc(*scratch, need);
    if (!p) return smoe_err_set(err, SMOE_ENOMEM, "attention: %zu bytes of scratch", need);
    *scratch = p;
    *cap = need;
    return SMOE_OK;
}

/* The start of every method of these objects: the object initialised (ready) and nargs one of
 * n1, n2 (n2 = n1: exactly n1); -1 with the exception set.  usage: the call's form, for the
 * message. */
static int method_start(int ready, const char *type, const char *usage, Py_ssize_t nargs,
                        Py_ssize_t n1, Py_ssize_t n2) {
    if (!ready) {
        PyErr_Format(PyExc_ValueError, "%s is not initialised", type);
        return -1;
    }
    if (nargs == n1 || nargs == n2) return 0;
    if (n1 == n2)
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments, got %zd", usage, n1, nargs);
    else
        PyErr_Format(PyExc_TypeError, "%s takes %zd or %zd arguments, got %zd", usage, n1, n2,
                     nargs);
    return -1;
}

/* forward(q_nope, q_pe, ckv, kpe, bias, out); shapes in the method doc. */
static PyObject *mla_forward(MLADecodeObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (method_start(self->ready, "MLADecode",
                     "forward(q_nope, q_pe, ckv, kpe, bias, out)", nargs, 6, 6))
        return NULL;
    const smoe_mla_desc *d = &self->d;
    PyArrayObject *qn = smoe_py_want_array(args[0], "q_nope", NPY_FLOAT32, 4, 0);
    if (!qn) return NULL;
    PyArrayObject *qp = smoe_py_want_array(args[1], "q_pe", NPY_FLOAT32, 4, 0);
    if (!qp) return NULL;
    int cdt = smoe_py_f32_or_bf16(args[2], "ckv", 3, 0);
    int kdt = smoe_py_f32_or_bf16(args[3], "kpe", 3, 0);
    if (cdt < 0 || kdt < 0) return NULL;
    cdt = cdt ? SMOE_WDT_BF16 : SMOE_WDT_F32;
    kdt = kdt ? SMOE_WDT_BF16 : SMOE_WDT_F32;
    PyArrayObject *out = smoe_py_want_array(args[5], "out", NPY_FLOAT32, 3, 1);
    if (!out) return NULL;
    npy_intp B = PyArray_DIM(qn, 0), T = PyArray_DIM(qn, 2);
    npy_intp S = PyArray_DIM((PyArrayObject *)args[2], 1);
    npy_intp w_qn[4] = {B, d->H, T, d->dn}, w_qp[4] = {B, d->H, T, d->dr};
    npy_intp w_c[3] = {B, S, d->r}, w_k[3] = {B, S, d->dr}, w_o[3] = {B, T, (npy_intp)d->H * d->dv};
    if (dims_are(args[0], "q_nope [B, H, T, qk_nope_head_dim]", w_qn, 4) ||
        dims_are(args[1], "q_pe [B, H, T, qk_rope_head_dim]", w_qp, 4) ||
        dims_are(args[2], "ckv [B, S, kv_lora_rank]", w_c, 3) ||
        dims_are(args[3], "kpe [B, S, qk_rope_head_dim]", w_k, 3) ||
        dims_are(args[5], "out [B, T, heads * v_head_dim]", w_o, 3))
        return NULL;
    if (B < 1 || T < 1 || S < 1 || B > 65536 || T > 65536 || S > (npy_intp)UINT32_MAX / 2) {
        PyErr_Format(PyExc_ValueError, "MLADecode: B=%zd T=%zd S=%zd out of range",
                     (Py_ssize_t)B, (Py_ssize_t)T, (Py_ssize_t)S);
        return NULL;
    }
    const float *bias;
    uint32_t bias_rows;
    if (bias_arg(args[4], B, T, S, &bias, &bias_rows)) return NULL;
    smoe_kctx *c = smoe_py_kctx(self->ctx_obj);
    if (!c) return NULL;
    size_t need = smoe_mla_scratch_bytes(c, d, (uint32_t)T);
    smoe_err err;
    smoe_err_clear(&err);
    int rc = SMOE_OK;
    /* the arrays stay referenced by the caller's frame for the whole call; weights by self */
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->mu);
    rc = grow_scratch(&self->scratch, &self->scratch_cap, need, &err);
    if (rc == SMOE_OK)
        rc = smoe_mla_decode(
            c, d, (uint32_t)B, (uint32_t)T, (uint32_t)S, (const float *)PyArray_DATA(qn),
            (const float *)PyArray_DATA(qp), PyArray_DATA((PyArrayObject *)args[2]), cdt,
            (size_t)S * d->r, PyArray_DATA((PyArrayObject *)args[3]), kdt, (size_t)S * d->dr,
            &self->w, bias, bias_rows,
            (float *)PyArray_DATA(out), self->scratch, self->scratch_cap, &err);
    pthread_mutex_unlock(&self->mu);
    Py_END_ALLOW_THREADS
    if (rc != 0) return smoe_py_raise(&err);
    Py_RETURN_NONE;
}

static PyObject *mla_get_shape(MLADecodeObject *self, void *closure) {
    (void)closure;
    static const char *names[] = {"f32", "bf16", "int8", "int4"};
    return Py_BuildValue("{sIsIsIsIsIsssI}", "heads", self->d.H, "qk_nope_head_dim", self->d.dn,
                         "qk_rope_head_dim", self->d.dr, "v_head_dim", self->d.dv,
                         "kv_lora_rank", self->d.r, "dtype", names[self->d.wdtype], "group",
                         self->d.group);
}

static PyMethodDef mla_methods[] = {
    {"forward", (PyCFunction)(void (*)(void))mla_forward, METH_FASTCALL,
     "forward(q_nope, q_pe, ckv, kpe, bias, out): absorbed MLA attention (csrc/kernels/attn.h)."
     " q_nope float32 [B, H, T, dn]; q_pe float32 [B, H, T, dr] after rotary; ckv [B, S, r] and "
     "kpe [B, S, dr] float32 or uint16 (bf16 bits); bias float32 [1 or B, T, S] additive or "
     "None; out float32 [B, T, H * dv], overwritten.  All C-contiguous; GIL released."},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef mla_getset[] = {
    {"shape", (getter)mla_get_shape, NULL, "The attention's dimensions, as a dict.", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyTypeObject MLADecodeType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "specmoe._C.MLADecode",
    .tp_basicsize = sizeof(MLADecodeObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "MLADecode(ctx, w_uk, w_uv, rope_dim, scale, uk_scale=None, uv_scale=None): "
              "multi-head latent attention in the absorbed form for decode-sized inputs; w_uk "
              "[H, dn, r] and w_uv [H, dv, r] float32, uint16 (bf16 bits) or int8 (scales "
              "float32 [H, rows]) or int4 values in int8 (specmoe.models.mla.int4_values; scales "
              "float32 [H, rows, r / group]); C-contiguous, kept referenced.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)mla_init,
    .tp_dealloc = (destructor)mla_dealloc,
    .tp_methods = mla_methods,
    .tp_getset = mla_getset,
};

/* ---- AttnDecode: the models' own multi-head / grouped-query attention at decode sizes ---- */

typedef struct {
    PyObject_HEAD
    PyObject *ctx_obj;  /* the KernelContext (strong reference) */
    void *scratch;      /* scratch_cap bytes; guarded by mu */
    size_t scratch_cap;
    pthread_mutex_t mu; /* serializes forward calls on this object (they share scratch) */
    int ready;
} AttnDecodeObject;

static int ad_init(AttnDecodeObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"ctx", NULL};
    PyObject *ctx_o;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O:AttnDecode", kwlist, &ctx_o)) return -1;
    if (self->ready) {
        PyErr_SetString(PyExc_RuntimeError, "AttnDecode is already initialised");
        return -1;
    }
    if (!smoe_py_kctx(ctx_o)) return -1;
    if (pthread_mutex_init(&self->mu, NULL) != 0) {
        PyErr_SetString(PyExc_RuntimeError, "AttnDecode: pthread_mutex_init failed");
        return -1;
    }
    Py_INCREF(ctx_o);
    self->ctx_obj = ctx_o;
    self->ready = 1;
    return 0;
}

static void ad_dealloc(AttnDecodeObject *self) {
    if (self->ready) pthread_mutex_destroy(&self->mu);
    free(self->scratch);
    Py_XDECREF(self->ctx_obj);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* k or v [B, Hkv, S, D], f32 or bf16 bits, each [S, D] block dense: the element strides of
 * dims 0 and 1 in *bs, *hs; -1 with an error otherwise. */
static int kv_layout(PyObject *o, const char *name, int *dt, npy_intp *bs, npy_intp *hs) {
    if (!PyArray_Check(o)) {
        PyErr_Format(PyExc_TypeError, "%s must be a numpy array", name);
        return -1;
    }
    PyArrayObject *a = (PyArrayObject *)o;
    int t = PyArray_TYPE(a);
    npy_intp esz = t == NPY_FLOAT32 ? 4 : 2;
    if ((t != NPY_FLOAT32 && t != NPY_UINT16 && t != NPY_INT16) || PyArray_NDIM(a) != 4 ||
        PyArray_STRIDE(a, 3) != esz || PyArray_STRIDE(a, 2) != esz * PyArray_DIM(a, 3) ||
        PyArray_STRIDE(a, 1) % esz || PyArray_STRIDE(a, 0) % esz || PyArray_STRIDE(a, 1) < 0 ||
        PyArray_STRIDE(a, 0) < 0) {
        PyErr_Format(PyExc_ValueError,
                     "%s must be a float32 or bf16 (uint16 bits) array [B, kv_heads, S, D] whose "
                     "[S, D] blocks are dense",
                     name);
        return -1;
    }
    *dt = t == NPY_FLOAT32 ? SMOE_WDT_F32 : SMOE_WDT_BF16;
    *bs = PyArray_STRIDE(a, 0) / esz;
    *hs = PyArray_STRIDE(a, 1) / esz;
    return 0;
}

/* forward(q, k, v, bias, out, scale); shapes in the method doc. */
static PyObject *ad_forward(AttnDecodeObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (method_start(self->ready, "AttnDecode",
                     "forward(q, k, v, bias, out, scale)", nargs, 6, 6))
        return NULL;
    PyArrayObject *q = smoe_py_want_array(args[0], "q", NPY_FLOAT32, 4, 0);
    if (!q) return NULL;
    int kdt, vdt;
    npy_intp kbs, khs, vbs, vhs;
    if (kv_layout(args[1], "k", &kdt, &kbs, &khs) || kv_layout(args[2], "v", &vdt, &vbs, &vhs))
        return NULL;
    PyArrayObject *k = (PyArrayObject *)args[1], *v = (PyArrayObject *)args[2];
    PyArrayObject *out = smoe_py_want_array(args[4], "out", NPY_FLOAT32, 4, 1);
    if (!out) return NULL;
    double scale = PyFloat_AsDouble(args[5]);
    if (scale == -1.0 && PyErr_Occurred()) return NULL;
    npy_intp B = PyArray_DIM(q, 0), H = PyArray_DIM(q, 1), T = PyArray_DIM(q, 2);
    npy_intp D = PyArray_DIM(q, 3), Hkv = PyArray_DIM(k, 1), S = PyArray_DIM(k, 2);
    npy_intp w_k[4] = {B, Hkv, S, D}, w_o[4] = {B, T, H, D};
    if (dims_are(args[1], "k [B, kv_heads, S, D]", w_k, 4) ||
        dims_are(args[2], "v [B, kv_heads, S, D]", w_k, 4) ||
        dims_are(args[4], "out [B, T, heads, D]", w_o, 4))
        return NULL;
    if (kdt != vdt || kbs != vbs || khs != vhs) {
        PyErr_SetString(PyExc_ValueError, "k and v must have the same dtype and layout");
        return NULL;
    }
    if (B < 1 || T < 1 || S < 1 || Hkv < 1 || B > 65536 || T > 65536 || H > 65536 ||
        D > 65536 || S > (npy_intp)UINT32_MAX / 2 || H % Hkv) {
        PyErr_Format(PyExc_ValueError,
                     "AttnDecode: B=%zd T=%zd S=%zd heads=%zd kv_heads=%zd out of range (heads "
                     "must be a multiple of kv_heads)",
                     (Py_ssize_t)B, (Py_ssize_t)T, (Py_ssize_t)S, (Py_ssize_t)H,
                     (Py_ssize_t)Hkv);
        return NULL;
    }
    const float *bias;
    uint32_t bias_rows;
    if (bias_arg(args[3], B, T, S, &bias, &bias_rows)) return NULL;
    smoe_kctx *c = smoe_py_kctx(self->ctx_obj);
    if (!c) return NULL;
    smoe_mha_desc d = {(uint32_t)H, (uint32_t)Hkv, (uint32_t)D, (float)scale};
    size_t need = smoe_mha_scratch_bytes(c, (uint32_t)D, (uint32_t)T);
    smoe_err err;
    smoe_err_clear(&err);
    int rc = SMOE_OK;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->mu);
    rc = grow_scratch(&self->scratch, &self->scratch_cap, need, &err);
    if (rc == SMOE_OK)
        rc = smoe_mha_decode(c, &d, (uint32_t)B, (uint32_t)T, (uint32_t)S,
                             (const float *)PyArray_DATA(q), PyArray_DATA(k), PyArray_DATA(v),
                             kdt, (size_t)kbs, (size_t)khs, bias, bias_rows,
                             (float *)PyArray_DATA(out), self->scratch, self->scratch_cap, &err);
    pthread_mutex_unlock(&self->mu);
    Py_END_ALLOW_THREADS
    if (rc != 0) return smoe_py_raise(&err);
    Py_RETURN_NONE;
}

static PyMethodDef ad_methods[] = {
    {"forward", (PyCFunction)(void (*)(void))ad_forward, METH_FASTCALL,
     "forward(q, k, v, bias, out, scale): attention at decode sizes (csrc/kernels/attn.h). q "
     "float32 [B, H, T, D] C-contiguous; k, v [B, Hkv, S, D] float32 or uint16 (bf16 bits), "
     "same dtype and strides, each [S, D] block dense; bias float32 [1 or B, T, S] additive or "
     "None; out float32 [B, T, H, D], overwritten; GIL released."},
    {NULL, NULL, 0, NULL}};


/* ---- AttnBlock: a decoder layer's whole attention module at decode sizes ---- */

enum { NORM_NONE = 0, NORM_FULL = 1, NORM_HEAD = 2 };

typedef struct {
    PyObject_HEAD
    PyObject *ctx_obj;         /* the KernelContext (strong reference) */
    PyObject *lin_obj[5];      /* q, k, v, o projections and optionally q|k|v in one:
                                  specmoe._C.Linear (strong; [4] may be NULL) */
    PyObject *qn_obj, *kn_obj; /* float32 q_norm / k_norm weights or NULL (strong) */
    const smoe_linear_desc *ld[5]; /* borrowed from lin_obj (immutable) */
    const uint8_t *lb[5];
    const float *lbias[5];
    uint32_t H, Hkv, D, hidden, max_tokens;
    int norm;                  /* NORM_NONE, NORM_FULL (over all heads), NORM_HEAD (per head) */
    float eps;
    int bf16;                  /* round as a bf16 model does (kernels/block.h) */
    float *buf;                /* max_tokens * (hidden + (H + 2 Hkv) * D + H * D) + 2 D floats:
                                  input, q|k|v projections, attention output, one token's cos
                                  and sin; then max_tokens * (H * D + 3 hidden) for the layer
                                  call: q, the residual stream, the normed input of the MoE
                                  block, its output; guarded by mu */
    void *route;               /* the layer call's routing: route_cap tokens of (k int64 ids, k
                                  f32 weights) and E used flags; guarded by mu */
    size_t route_cap;
    void *lscratch;            /* linear scratch for max_tokens (fixed size); guarded by mu */
    void *ascratch;            /* attention scratch (grows with the thread count); guarded by mu */
    size_t ascratch_cap;
    pthread_mutex_t mu;        /* serializes pre/post calls on this object */
    int ready;
} AttnBlockObject;

static int ab_init(AttnBlockObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"ctx", "q", "k", "v", "o", "heads", "kv_heads", "head_dim",
                             "norm", "q_norm", "k_norm", "eps", "bf16", "max_tokens", "qkv",
                             NULL};
    PyObject *ctx_o, *lin[5] = {NULL, NULL, NULL, NULL, Py_None}, *qn_o = Py_None,
             *kn_o = Py_None;
    unsigned int H, Hkv, D, max_tokens = 16;
    const char *norm = "none";
    double eps = 1e-6;
    int bf16 = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOIII|sOOdpIO:AttnBlock", kwlist, &ctx_o,
                                     &lin[0], &lin[1], &lin[2], &lin[3], &H, &Hkv, &D, &norm,
                                     &qn_o, &kn_o, &eps, &bf16, &max_tokens, &lin[4]))
        return -1;
    if (self->ready) {
        PyErr_SetString(PyExc_RuntimeError, "AttnBlock is already initialised");
        return -1;
    }
    if (!smoe_py_kctx(ctx_o)) return -1;
    const int nlin = lin[4] == Py_None ? 4 : 5;
    for (int i = 0; i < nlin; i++)
        if (smoe_py_linear_parts(lin[i], &self->ld[i], &self->lb[i], &self->lbias[i])) return -1;
    int nk = !strcmp(norm, "none") ? NORM_NONE
             : !strcmp(norm, "full") ? NORM_FULL
             : !strcmp(norm, "head") ? NORM_HEAD : -1;
    if (nk < 0) {
        PyErr_Format(PyExc_ValueError, "AttnBlock: norm must be 'none', 'full' or 'head', got '%s'",
                     norm);
        return -1;
    }
    if (H < 1 || Hkv < 1 || H % Hkv || D < 2 || D % 2 || H > 65536 || D > 65536 ||
        (uint64_t)(H + 2 * (uint64_t)Hkv) * D > (1u << 24) || max_tokens < 1 ||
        max_tokens > 4096 || !(eps >= 0.0) || eps > 1.0) {
        PyErr_Format(PyExc_ValueError,
                     "AttnBlock: heads=%u kv_heads=%u head_dim=%u max_tokens=%u eps=%g out of "
                     "range (heads a multiple of kv_heads, head_dim even, (heads + 2 kv_heads) "
                     "* head_dim <= 2^24, max_tokens 1..4096, eps in [0, 1])",
                     H, Hkv, D, max_tokens, eps);
        return -1;
    }
    const uint32_t hidden = self->ld[0]->K;
    const uint32_t want_n[5] = {H * D, Hkv * D, Hkv * D, hidden, (H + 2 * Hkv) * D};
    const uint32_t want_k[5] = {hidden, hidden, hidden, H * D, hidden};
    static const char *names[5] = {"q", "k", "v", "o", "qkv"};
    for (int i = 0; i < nlin; i++)
        if (self->ld[i]->N != want_n[i] || self->ld[i]->K != want_k[i]) {
            PyErr_Format(PyExc_ValueError,
                         "AttnBlock: the %s projection is %u -> %u, expected %u -> %u (heads=%u "
                         "kv_heads=%u head_dim=%u hidden=%u)",
                         names[i], self->ld[i]->K, self->ld[i]->N, want_k[i], want_n[i], H, Hkv,
                         D, hidden);
            return -1;
        }
    PyObject *nw[2] = {qn_o, kn_o};
    const npy_intp nlen[2] = {nk == NORM_HEAD ? (npy_intp)D : (npy_intp)H * D,
                              nk == NORM_HEAD ? (npy_intp)D : (npy_intp)Hkv * D};
    for (int i = 0; i < 2; i++) {
        if (nk == NORM_NONE) {
            if (nw[i] != Py_None) {
                PyErr_SetString(PyExc_ValueError, "AttnBlock: norm='none' takes no norm weights");
                return -1;
            }
            continue;
        }
        PyArrayObject *a = smoe_py_want_array(nw[i], i ? "k_norm" : "q_norm", NPY_FLOAT32, 1, 0);
        if (!a) return -1;
        if (PyArray_DIM(a, 0) != nlen[i]) {
            PyErr_Format(PyExc_ValueError, "AttnBlock: %s has %zd weights, expected %zd",
                         i ? "k_norm" : "q_norm", (Py_ssize_t)PyArray_DIM(a, 0),
                         (Py_ssize_t)nlen[i]);
            return -1;
        }
    }
    size_t ls = 0;
    for (int i = 0; i < nlin; i++) {
        size_t s = smoe_linear_scratch_bytes(self->ld[i], max_tokens);
        if (s > ls) ls = s;
    }
    const size_t per_tok = (size_t)hidden + (size_t)(H + 2 * Hkv) * D + (size_t)H * D;
    self->buf = malloc(((size_t)max_tokens * (per_tok + (size_t)H * D + 3 * (size_t)hidden) +
                        2 * (size_t)D) * sizeof(float));
    self->lscratch = malloc(ls ? ls : 1);
    if (!self->buf || !self->lscratch) {
        free(self->buf);
        free(self->lscratch);
        self->buf = NULL;
        self->lscratch = NULL;
        PyErr_NoMemory();
        return -1;
    }
    if (pthread_mutex_init(&self->mu, NULL) != 0) {
        free(self->buf);
        free(self->lscratch);
        self->buf = NULL;
        self->lscratch = NULL;
        PyErr_SetString(PyExc_RuntimeError, "AttnBlock: pthread_mutex_init failed");
        return -1;
    }
    Py_INCREF(ctx_o);
    self->ctx_obj = ctx_o;
    for (int i = 0; i < nlin; i++) {
        Py_INCREF(lin[i]);
        self->lin_obj[i] = lin[i];
    }
    if (nk != NORM_NONE) {
        Py_INCREF(qn_o);
        Py_INCREF(kn_o);
        self->qn_obj = qn_o;
        self->kn_obj = kn_o;
    }
    self->H = H;
    self->Hkv = Hkv;
    self->D = D;
    self->hidden = hidden;
    self->max_tokens = max_tokens;
    self->norm = nk;
    self->eps = (float)eps;
    self->bf16 = bf16;
    self->ready = 1;
    return 0;
}

static void ab_dealloc(AttnBlockObject *self) {
    if (self->ready) pthread_mutex_destroy(&self->mu);
    free(self->buf);
    free(self->lscratch);
    free(self->ascratch);
    free(self->route);
    Py_XDECREF(self->ctx_obj);
    for (int i = 0; i < 5; i++) Py_XDECREF(self->lin_obj[i]);
    Py_XDECREF(self->qn_obj);
    Py_XDECREF(self->kn_obj);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* n values of src (f32, or bf16 bits when bf16) into dst as f32. */
static void widen(float *dst, const void *src, int bf16, size_t n) {
    if (!bf16) {
        memcpy(dst, src, n * sizeof(float));
        return;
    }
    const uint16_t *h = (const uint16_t *)src;
    for (size_t i = 0; i < n; i++) dst[i] = smoe_bf16_f32(h[i]);
}

/* T tokens' heads, token t's head h at src + t * src_stride + h * D (f32), into dst with token
 * t of head h at dst + h * hs + t * D elements: f32, or bf16 bits when bf16 (the values are
 * bf16 already when the block rounds as a bf16 model, so the conversion is exact then).
 * hs = T * D is transformers' [B = 1, heads, T, D] layout; a KV buffer's head stride is its
 * capacity times D. */
static void to_head_major(void *dst, int bf16, size_t hs, const float *src, size_t src_stride,
                          uint32_t T, uint32_t heads, uint32_t D) {
    for (uint32_t t = 0; t < T; t++)
        for (uint32_t h = 0; h < heads; h++) {
            const float *s = src + (size_t)t * src_stride + (size_t)h * D;
            const size_t o = (size_t)h * hs + (size_t)t * D;
            if (bf16)
                for (uint32_t i = 0; i < D; i++) ((uint16_t *)dst)[o + i] = smoe_bf16_rne(s[i]);
            else
                memcpy((float *)dst + o, s, (size_t)D * sizeof(float));
        }
}

/* An RMSNorm's weights (float32 [n], C-contiguous) and eps (a float >= 0) into *w, *eps; -1
 * with an error otherwise. */
static int norm_arg(PyObject *wo, PyObject *eo, uint32_t n, const float **w, float *eps) {
    PyArrayObject *a = smoe_py_want_array(wo, "ln", NPY_FLOAT32, 1, 0);
    if (!a) return -1;
    if (PyArray_DIM(a, 0) != (npy_intp)n) {
        PyErr_Format(PyExc_ValueError, "ln has %zd weights, expected hidden=%u",
                     (Py_ssize_t)PyArray_DIM(a, 0), n);
        return -1;
    }
    double e = PyFloat_AsDouble(eo);
    if (e == -1.0 && PyErr_Occurred()) return -1;
    if (!(e >= 0.0) || e > 1.0) {
        PyErr_Format(PyExc_ValueError, "ln_eps must be in [0, 1], got %g", e);
        return -1;
    }
    *w = (const float *)PyArray_DATA(a);
    *eps = (float)e;
    return 0;
}

/* x, cos, sin of pre/layer: x [T, hidden], cos and sin [T, head_dim], float32 or bf16 bits;
 * *T from x (1..max_tokens); *xb, *cb, *sb: 1 for bf16.  -1 with an error otherwise. */
static int block_inputs(AttnBlockObject *self, PyObject *x, PyObject *cos, PyObject *sin,
                        npy_intp *T, int *xb, int *cb, int *sb) {
    if ((*xb = smoe_py_f32_or_bf16(x, "x", 2, 0)) < 0 ||
        (*cb = smoe_py_f32_or_bf16(cos, "cos", 2, 0)) < 0 ||
        (*sb = smoe_py_f32_or_bf16(sin, "sin", 2, 0)) < 0)
        return -1;
    *T = PyArray_DIM((PyArrayObject *)x, 0);
    if (*T < 1 || *T > (npy_intp)self->max_tokens) {
        PyErr_Format(PyExc_ValueError, "AttnBlock: %zd tokens, expected 1..%u", (Py_ssize_t)*T,
                     self->max_tokens);
        return -1;
    }
    npy_intp w_x[2] = {*T, self->hidden}, w_cs[2] = {*T, self->D};
    return dims_are(x, "x [T, hidden]", w_x, 2) || dims_are(cos, "cos [T, head_dim]", w_cs, 2) ||
                   dims_are(sin, "sin [T, head_dim]", w_cs, 2)
               ? -1
               : 0;
}

/* The first half of the block, under mu without the GIL: x widened (and RMSNorm-ed with ln
 * when given: the decoder layer's input layernorm), the q/k/v projections into buf's y, the
 * q/k norms, the rotary embedding; q into qp ([H, T, D] f32), k and v into kp, vp (token t of
 * kv head h at + h * kv_hs + t * D elements; bf16 bits when kb / vb). */
static int block_pre(AttnBlockObject *self, smoe_kctx *c, const void *xp, int xb, const void *cp,
                     int cb, const void *sp, int sb, uint32_t nt, const float *ln, float ln_eps,
                     float *qp, void *kp, int kb, void *vp, int vb, size_t kv_hs, smoe_err *err) {
    const uint32_t H = self->H, Hkv = self->Hkv, D = self->D, hid = self->hidden;
    const uint32_t nq = H * D, nkv = Hkv * D, qkv = nq + 2 * nkv;
    const float *qn = self->qn_obj ? (const float *)PyArray_DATA((PyArrayObject *)self->qn_obj)
                                   : NULL;
    const float *kn = self->kn_obj ? (const float *)PyArray_DATA((PyArrayObject *)self->kn_obj)
                                   : NULL;
    float *x = self->buf, *y = self->buf + (size_t)self->max_tokens * hid; /* y [T, q|k|v] */
    const float *xin = (const float *)xp;
    int rc = SMOE_OK;
    if (xb || ln) {
        widen(x, xp, xb, (size_t)nt * hid);
        if (ln) smoe_rmsnorm(x, nt, hid, ln, ln_eps, self->bf16); /* the input layernorm */
        xin = x;
    }
    if (self->lin_obj[4]) /* q|k|v in one call: its output rows are y's */
        rc = smoe_linear_forward(c, self->ld[4], self->lb[4], self->lbias[4], xin, hid, nt, y,
                                 qkv, self->lscratch, err);
    for (int i = 0; i < 3 && rc == SMOE_OK && !self->lin_obj[4]; i++) {
        const uint32_t off = i == 0 ? 0 : i == 1 ? nq : nq + nkv;
        rc = smoe_linear_forward(c, self->ld[i], self->lb[i], self->lbias[i], xin, hid, nt,
                                 y + off, qkv, self->lscratch, err);
    }
    if (rc != SMOE_OK) return rc;
    const int b = self->bf16;
    float *cosf = self->buf + (size_t)self->max_tokens * (hid + qkv + nq), *sinf = cosf + D;
    if (b) smoe_bf16_round(y, (size_t)nt * qkv); /* the projections' bf16 outputs */
    for (uint32_t t = 0; t < nt; t++) {
        float *qt = y + (size_t)t * qkv, *kt = qt + nq;
        if (self->norm == NORM_FULL) {
            smoe_rmsnorm(qt, 1, nq, qn, self->eps, b);
            smoe_rmsnorm(kt, 1, nkv, kn, self->eps, b);
        } else if (self->norm == NORM_HEAD) {
            smoe_rmsnorm(qt, H, D, qn, self->eps, b);
            smoe_rmsnorm(kt, Hkv, D, kn, self->eps, b);
        }
        widen(cosf, (const uint8_t *)cp + (size_t)t * D * (cb ? 2 : 4), cb, D);
        widen(sinf, (const uint8_t *)sp + (size_t)t * D * (sb ? 2 : 4), sb, D);
        smoe_rotary_half(qt, H, D, D, cosf, sinf, b);
        smoe_rotary_half(kt, Hkv, D, D, cosf, sinf, b);
    }
    /* q for the attention kernel (f32, values already bf16 when b); k, v for the cache */
    to_head_major(qp, 0, (size_t)nt * D, y, qkv, nt, H, D);
    to_head_major(kp, kb, kv_hs, y + nq, qkv, nt, Hkv, D);
    to_head_major(vp, vb, kv_hs, y + nq + nkv, qkv, nt, Hkv, D);
    return SMOE_OK;
}

/* The second half, under mu without the GIL: attention of q ([H, T, D]) over S cached
 * positions (k, v as smoe_mha_decode takes them), then the output projection into of
 * ([T, hidden] f32; rounded to bf16 values when the block rounds as a bf16 model). */
static int block_post(AttnBlockObject *self, smoe_kctx *c, const float *q, const void *kp,
                      const void *vp, int kdt, size_t kbs, size_t khs, uint32_t nt, uint32_t S,
                      const float *bias, uint32_t bias_rows, float scale, float *of,
                      smoe_err *err) {
    const uint32_t H = self->H, D = self->D, hid = self->hidden;
    const uint32_t qkv = (H + 2 * self->Hkv) * D;
    smoe_mha_desc d = {H, self->Hkv, D, scale};
    float *att = self->buf + (size_t)self->max_tokens * (hid + qkv); /* [T, H, D] */
    int rc = grow_scratch(&self->ascratch, &self->ascratch_cap, smoe_mha_scratch_bytes(c, D, nt),
                          err);
    if (rc == SMOE_OK)
        rc = smoe_mha_decode(c, &d, 1, nt, S, q, kp, vp, kdt, kbs, khs, bias, bias_rows, att,
                             self->ascratch, self->ascratch_cap, err);
    if (rc != SMOE_OK) return rc;
    if (self->bf16) smoe_bf16_round(att, (size_t)nt * H * D); /* torch's bf16 output */
    rc = smoe_linear_forward(c, self->ld[3], self->lb[3], self->lbias[3], att, (size_t)H * D, nt,
                             of, hid, self->lscratch, err);
    if (rc == SMOE_OK && self->bf16) smoe_bf16_round(of, (size_t)nt * hid);
    return rc;
}

/* of += the residual rp (f32, or bf16 bits when rb), rounded as a bf16 model rounds the sum
 * (bf16 set). */
static void residual_add(int bf16, float *of, const void *rp, int rb, size_t n) {
    for (size_t i = 0; i < n; i++)
        of[i] += rb ? smoe_bf16_f32(((const uint16_t *)rp)[i]) : ((const float *)rp)[i];
    if (bf16) smoe_bf16_round(of, n);
}

/* n values of src into dst: f32, or bf16 bits when ob (src holds bf16 values then). */
static void store(void *dst, int ob, const float *src, size_t n) {
    if (ob)
        for (size_t i = 0; i < n; i++) ((uint16_t *)dst)[i] = smoe_bf16_rne(src[i]);
    else
        memcpy(dst, src, n * sizeof(float));
}

/* The _C.Layers of a layer call (AttnBlock.layer, MLABlock.layer), begun (smoe_py_layers_begin;
 * end with smoe_py_layers_end) when pos is one of its MoE layers and its hidden size is the
 * block's; NULL with an error otherwise. */
static smoe_layers *layer_call_begin(PyObject *layers, long pos, uint32_t hid) {
    smoe_layers *g = smoe_py_layers_begin(layers);
    if (!g) return NULL;
    if (pos < 0 || pos >= (long)g->L || g->H != hid) {
        smoe_py_layers_end(layers);
        PyErr_Format(PyExc_ValueError, "layer: pos %ld outside 0..%u, or the MoE hidden size %u "
                     "is not the block's %u", pos, g->L - 1, g->H, hid);
        return NULL;
    }
    return g;
}

/* A dense decoder layer's MLP for decoder_tail (MLABlock.set_mlp): the SiLU MLP, its buffers
 * and the kernel context it runs on. */
typedef struct {
    smoe_kctx *c;
    const smoe_shared_ffn *f;
    smoe_mlp_bufs *b;
} dense_mlp;

/* The rest of a decoder layer after its attention (AttnBlock.layer, MLABlock.layer), under the
 * block's mutex without the GIL: h (the attention output, f32 [nt, hid]) += the layer input xp
 * (f32, or bf16 bits when xb); nrm = the post-attention RMSNorm of h; the MoE block routed in C
 * on nrm into moe -- or, for a dense layer (g NULL), the MLP `mlp` on nrm; out op = h + moe in
 * the model's dtype (bf16 bits when ob).  bf16: every sum rounded as a bf16 model rounds it.
 * The routing buffers (nt x k expert ids and weights, E used flags) grow in *route; *t1 is set
 * when the MoE block (the MLP) begins. */
static int decoder_tail(int bf16, smoe_layers *g, const dense_mlp *mlp, uint32_t pos, int flags,
                        uint32_t nt, uint32_t hid, float *h, const void *xp, int xb,
                        const float *ln2, float eps2, float *nrm, float *moe, void **route,
                        size_t *route_cap, void *op, int ob, double *t1, smoe_err *err) {
    const size_t n = (size_t)nt * hid;
    residual_add(bf16, h, xp, xb, n); /* h = x + attention */
    memcpy(nrm, h, n * sizeof(float));
    smoe_rmsnorm(nrm, nt, hid, ln2, eps2, bf16); /* the post-attention norm */
    *t1 = smoe_now();
    int rc;
    if (g) {
        const size_t k = g->k;
        const size_t need = (size_t)nt * k * (sizeof(int64_t) + sizeof(float)) + g->E;
        if (need > *route_cap) {
            void *p = realloc(*route, need);
            if (!p)
                return smoe_err_set(err, SMOE_ENOMEM, "layer: %zu bytes of routing buffer", need);
            *route = p;
            *route_cap = need;
        }
        int64_t *idx = *route;
        float *w = (float *)(idx + (size_t)nt * k);
        uint8_t *used = (uint8_t *)(w + (size_t)nt * k);
        rc = smoe_layers_forward_routed(g, pos, nrm, nt, flags, idx, w, moe, used, 1, NULL, err);
    } else {
        memset(moe, 0, n * sizeof(float));
        rc = smoe_silu_mlp_add(mlp->c, mlp->f, nrm, hid, nt, bf16, mlp->b, moe, err);
    }
    if (rc != SMOE_OK) return rc;
    if (bf16) smoe_bf16_round(moe, n); /* the MoE block's output cast to the model's dtype */
    residual_add(bf16, moe, h, 0, n);  /* out = h + moe */
    store(op, ob, moe, n);
    return SMOE_OK;
}

/* pre(x, cos, sin, q, k, v[, ln, ln_eps]): the input RMSNorm (when ln is given), projections,
 * q/k norms and rotary embedding of T tokens. */
static PyObject *ab_pre(AttnBlockObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (method_start(self->ready, "AttnBlock",
                     "pre(x, cos, sin, q, k, v[, ln, ln_eps])", nargs, 6, 8))
        return NULL;
    const uint32_t H = self->H, Hkv = self->Hkv, D = self->D, hid = self->hidden;
    npy_intp T;
    int xb, cb, sb;
    if (block_inputs(self, args[0], args[1], args[2], &T, &xb, &cb, &sb)) return NULL;
    PyArrayObject *qo = smoe_py_want_array(args[3], "q", NPY_FLOAT32, 4, 1);
    if (!qo) return NULL;
    int kb = smoe_py_f32_or_bf16(args[4], "k", 4, 1), vb = smoe_py_f32_or_bf16(args[5], "v", 4, 1);
    if (kb < 0 || vb < 0) return NULL;
    npy_intp w_q[4] = {1, H, T, D}, w_kv[4] = {1, Hkv, T, D};
    if (dims_are(args[3], "q [1, heads, T, head_dim]", w_q, 4) ||
        dims_are(args[4], "k [1, kv_heads, T, head_dim]", w_kv, 4) ||
        dims_are(args[5], "v [1, kv_heads, T, head_dim]", w_kv, 4))
        return NULL;
    const float *ln = NULL;
    float ln_eps = 0.0f;
    if (nargs == 8 && norm_arg(args[6], args[7], hid, &ln, &ln_eps)) return NULL;
    smoe_kctx *c = smoe_py_kctx(self->ctx_obj);
    if (!c) return NULL;
    const void *xp = PyArray_DATA((PyArrayObject *)args[0]);
    const void *cp = PyArray_DATA((PyArrayObject *)args[1]);
    const void *sp = PyArray_DATA((PyArrayObject *)args[2]);
    float *qp = (float *)PyArray_DATA(qo);
    void *kp = PyArray_DATA((PyArrayObject *)args[4]), *vp = PyArray_DATA((PyArrayObject *)args[5]);
    smoe_err err;
    smoe_err_clear(&err);
    int rc;
    /* every array stays referenced by the caller's frame for the whole call */
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->mu);
    rc = block_pre(self, c, xp, xb, cp, cb, sp, sb, (uint32_t)T, ln, ln_eps, qp, kp, kb, vp, vb,
                   (size_t)T * D, &err);
    pthread_mutex_unlock(&self->mu);
    Py_END_ALLOW_THREADS
    if (rc != 0) return smoe_py_raise(&err);
    Py_RETURN_NONE;
}

/* post(q, k, v, bias, scale, out[, resid, ln, ln_eps, normed]): attention over the cache, the
 * output projection, and with resid the residual add and the post-attention RMSNorm. */
static PyObject *ab_post(AttnBlockObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (method_start(self->ready, "AttnBlock",
                     "post(q, k, v, bias, scale, out[, resid, ln, ln_eps, normed])", nargs, 6, 10))
        return NULL;
    const uint32_t H = self->H, Hkv = self->Hkv, D = self->D, hid = self->hidden;
    PyArrayObject *q = smoe_py_want_array(args[0], "q", NPY_FLOAT32, 4, 0);
    if (!q) return NULL;
    int kdt, vdt;
    npy_intp kbs, khs, vbs, vhs;
    if (kv_layout(args[1], "k", &kdt, &kbs, &khs) || kv_layout(args[2], "v", &vdt, &vbs, &vhs))
        return NULL;
    double scale = PyFloat_AsDouble(args[4]);
    if (scale == -1.0 && PyErr_Occurred()) return NULL;
    int ob = smoe_py_f32_or_bf16(args[5], "out", 2, 1);
    if (ob < 0) return NULL;
    npy_intp T = PyArray_DIM(q, 2), S = PyArray_DIM((PyArrayObject *)args[1], 2);
    if (T < 1 || T > (npy_intp)self->max_tokens || S < 1 || S > (npy_intp)UINT32_MAX / 2) {
        PyErr_Format(PyExc_ValueError, "AttnBlock: T=%zd tokens (1..%u), S=%zd positions",
                     (Py_ssize_t)T, self->max_tokens, (Py_ssize_t)S);
        return NULL;
    }
    npy_intp w_q[4] = {1, H, T, D}, w_kv[4] = {1, Hkv, S, D}, w_o[2] = {T, hid};
    if (dims_are(args[0], "q [1, heads, T, head_dim]", w_q, 4) ||
        dims_are(args[1], "k [1, kv_heads, S, head_dim]", w_kv, 4) ||
        dims_are(args[2], "v [1, kv_heads, S, head_dim]", w_kv, 4) ||
        dims_are(args[5], "out [T, hidden]", w_o, 2))
        return NULL;
    if (kdt != vdt || kbs != vbs || khs != vhs) {
        PyErr_SetString(PyExc_ValueError, "k and v must have the same dtype and layout");
        return NULL;
    }
    const float *bias;
    uint32_t bias_rows;
    if (bias_arg(args[3], 1, T, S, &bias, &bias_rows)) return NULL;
    const void *rp = NULL;
    void *np_ = NULL;
    const float *ln = NULL;
    float ln_eps = 0.0f;
    if (nargs == 10) {
        int rb = smoe_py_f32_or_bf16(args[6], "resid", 2, 0);
        int nb = smoe_py_f32_or_bf16(args[9], "normed", 2, 1);
        if (rb < 0 || nb < 0) return NULL;
        if (rb != ob || nb != ob) {
            PyErr_SetString(PyExc_ValueError, "resid, out and normed must have the same dtype");
            return NULL;
        }
        if (dims_are(args[6], "resid [T, hidden]", w_o, 2) ||
            dims_are(args[9], "normed [T, hidden]", w_o, 2) ||
            norm_arg(args[7], args[8], hid, &ln, &ln_eps))
            return NULL;
        rp = PyArray_DATA((PyArrayObject *)args[6]);
        np_ = PyArray_DATA((PyArrayObject *)args[9]);
        if (rp == PyArray_DATA((PyArrayObject *)args[5]) || np_ == rp ||
            np_ == PyArray_DATA((PyArrayObject *)args[5])) {
            PyErr_SetString(PyExc_ValueError, "resid, out and normed must not alias");
            return NULL;
        }
    }
    smoe_kctx *c = smoe_py_kctx(self->ctx_obj);
    if (!c) return NULL;
    const uint32_t nt = (uint32_t)T;
    const size_t n = (size_t)nt * hid;
    void *op = PyArray_DATA((PyArrayObject *)args[5]);
    smoe_err err;
    smoe_err_clear(&err);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->mu);
    float *of = self->buf; /* [T, hidden]: pre's x, free again */
    rc = block_post(self, c, (const float *)PyArray_DATA(q),
                    PyArray_DATA((PyArrayObject *)args[1]), PyArray_DATA((PyArrayObject *)args[2]),
                    kdt, (size_t)kbs, (size_t)khs, nt, (uint32_t)S, bias, bias_rows,
                    (float)scale, of, &err);
    if (rc == SMOE_OK && rp) residual_add(self->bf16, of, rp, ob, n); /* the decoder layer's add */
    if (rc == SMOE_OK) store(op, ob, of, n);
    if (rc == SMOE_OK && rp) { /* then the post-attention RMSNorm of the sum, in place */
        smoe_rmsnorm(of, nt, hid, ln, ln_eps, self->bf16);
        store(np_, ob, of, n);
    }
    pthread_mutex_unlock(&self->mu);
    Py_END_ALLOW_THREADS
    if (rc != 0) return smoe_py_raise(&err);
    Py_RETURN_NONE;
}


/* layer(layers, pos, route_flags, x, cos, sin, kbuf, vbuf, S, bias, scale, ln1, eps1, ln2, eps2,
 * out): one whole decoder layer of T tokens (the method doc). */
/* The checked arguments of AttnBlock.layer (ab_layer_parse), for ab_layer_run. */
typedef struct {
    long pos; /* checked by layer_call_begin */
    uint32_t nt;
    int flags, xb, cb, sb, kb, ob;
    long long S;
    npy_intp cap;
    double scale;
    const float *bias, *ln1, *ln2;
    uint32_t bias_rows;
    float eps1, eps2;
    const void *xp, *cp, *sp;
    uint8_t *kp, *vp;
    void *op;
} ab_layer_args;

/* Check layer()'s 16 arguments (the method doc) into *a; -1 with the exception set.  Takes no
 * lock and begins nothing: layer_call_begin comes after. */
static int ab_layer_parse(AttnBlockObject *self, PyObject *const *args, Py_ssize_t nargs,
                          ab_layer_args *a) {
    if (method_start(self->ready, "AttnBlock",
                     "layer(layers, pos, route_flags, x, cos, sin, kbuf, vbuf, S, bias, scale, "
                     "ln1, eps1, ln2, eps2, out)",
                     nargs, 16, 16))
        return -1;
    const uint32_t Hkv = self->Hkv, D = self->D, hid = self->hidden;
    long pos = PyLong_AsLong(args[1]);
    long long S = PyLong_AsLongLong(args[8]);
    double scale = PyFloat_AsDouble(args[10]);
    if (PyErr_Occurred()) return -1;
    if (smoe_py_route_flags(args[2], &a->flags)) return -1;
    npy_intp T;
    if (block_inputs(self, args[3], args[4], args[5], &T, &a->xb, &a->cb, &a->sb)) return -1;
    a->kb = smoe_py_f32_or_bf16(args[6], "kbuf", 4, 1);
    int vb = smoe_py_f32_or_bf16(args[7], "vbuf", 4, 1);
    if (a->kb < 0 || vb < 0) return -1;
    npy_intp cap = PyArray_DIM((PyArrayObject *)args[6], 2);
    npy_intp w_kv[4] = {1, Hkv, cap, D}, w_o[2] = {T, hid};
    if (dims_are(args[6], "kbuf [1, kv_heads, capacity, head_dim]", w_kv, 4) ||
        dims_are(args[7], "vbuf [1, kv_heads, capacity, head_dim]", w_kv, 4))
        return -1;
    if (a->kb != vb) {
        PyErr_SetString(PyExc_ValueError, "kbuf and vbuf must have the same dtype");
        return -1;
    }
    if (S < 0 || S + T > cap) {
        PyErr_Format(PyExc_ValueError, "layer: S=%lld cached + %zd new positions do not fit a "
                     "capacity of %zd", S, (Py_ssize_t)T, (Py_ssize_t)cap);
        return -1;
    }
    if (bias_arg(args[9], 1, T, (npy_intp)S + T, &a->bias, &a->bias_rows)) return -1;
    if (norm_arg(args[11], args[12], hid, &a->ln1, &a->eps1) ||
        norm_arg(args[13], args[14], hid, &a->ln2, &a->eps2))
        return -1;
    a->ob = smoe_py_f32_or_bf16(args[15], "out", 2, 1);
    if (a->ob < 0 || dims_are(args[15], "out [T, hidden]", w_o, 2)) return -1;
    if (a->ob != a->xb) {
        PyErr_SetString(PyExc_ValueError, "x and out must have the same dtype");
        return -1;
    }
    if (PyArray_DATA((PyArrayObject *)args[15]) == PyArray_DATA((PyArrayObject *)args[3])) {
        PyErr_SetString(PyExc_ValueError, "out must not alias x");
        return -1;
    }
    a->pos = pos;
    a->nt = (uint32_t)T;
    a->S = S;
    a->cap = cap;
    a->scale = scale;
    a->xp = PyArray_DATA((PyArrayObject *)args[3]);
    a->cp = PyArray_DATA((PyArrayObject *)args[4]);
    a->sp = PyArray_DATA((PyArrayObject *)args[5]);
    a->kp = PyArray_DATA((PyArrayObject *)args[6]);
    a->vp = PyArray_DATA((PyArrayObject *)args[7]);
    a->op = PyArray_DATA((PyArrayObject *)args[15]);
    return 0;
}

/* One decoder layer of checked arguments on the MoE layers g, without the GIL, under the
 * block's mutex; *ta and *tm get the time in its attention and MoE parts. */
static int ab_layer_run(AttnBlockObject *self, smoe_kctx *c, smoe_layers *g,
                        const ab_layer_args *a, double *ta, double *tm, smoe_err *err) {
    const uint32_t H = self->H, Hkv = self->Hkv, D = self->D, hid = self->hidden, nt = a->nt;
    const size_t esz = a->kb ? 2 : 4, kv_hs = (size_t)a->cap * D, S = (size_t)a->S;
    pthread_mutex_lock(&self->mu);
    const size_t mt = self->max_tokens;
    float *extra = self->buf + mt * (hid + (size_t)(H + 2 * Hkv) * D + (size_t)H * D) + 2 * D;
    float *q = extra, *h = q + mt * H * D, *nrm = h + mt * hid, *moe = nrm + mt * hid;
    double t0 = smoe_now(), t1 = t0;
    /* input norm, projections, q/k norms, rotary; k, v appended at S */
    int rc = block_pre(self, c, a->xp, a->xb, a->cp, a->cb, a->sp, a->sb, nt, a->ln1, a->eps1, q,
                       a->kp + S * D * esz, a->kb, a->vp + S * D * esz, a->kb, kv_hs, err);
    if (rc == SMOE_OK) /* attention over the S + T positions, output projection */
        rc = block_post(self, c, q, a->kp, a->vp, a->kb ? SMOE_WDT_BF16 : SMOE_WDT_F32,
                        (size_t)Hkv * kv_hs, kv_hs, nt, (uint32_t)(S + nt), a->bias,
                        a->bias_rows, (float)a->scale, h, err);
    if (rc == SMOE_OK)
        rc = decoder_tail(self->bf16, g, NULL, (uint32_t)a->pos, a->flags, nt, hid, h, a->xp,
                          a->xb, a->ln2, a->eps2, nrm, moe, &self->route, &self->route_cap, a->op,
                          a->ob, &t1, err);
    double t2 = smoe_now();
    pthread_mutex_unlock(&self->mu);
    *ta = t1 - t0;
    *tm = t2 - t1;
    return rc;
}

/* AttnBlock.layer and MLABlock.layer, one routine (defined with layer_chain below). */
static PyObject *layer_method(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

static PyMethodDef ab_methods[] = {
    {"pre", (PyCFunction)(void (*)(void))ab_pre, METH_FASTCALL,
     "pre(x, cos, sin, q, k, v[, ln, ln_eps]): the q/k/v projections of x [T, hidden] (first "
     "RMSNorm-ed with the weights ln float32 [hidden] and ln_eps when given: the decoder "
     "layer's input layernorm), the q/k norms and the rotary embedding (cos, sin [T, "
     "head_dim]); writes q float32 [1, heads, T, head_dim] and k, v [1, kv_heads, T, head_dim] "
     "(float32 or bf16 bits, for the KV cache).  x, cos, sin float32 or bf16 bits, "
     "C-contiguous; GIL released."},
    {"post", (PyCFunction)(void (*)(void))ab_post, METH_FASTCALL,
     "post(q, k, v, bias, scale, out): attention of q (pre's) over the cache k, v [1, kv_heads, "
     "S, head_dim] (float32 or bf16 bits, each [S, head_dim] block dense) with the additive "
     "bias float32 [1, T, S] or None, then the output projection into out [T, hidden] (float32 "
     "or bf16 bits).  With resid, ln, ln_eps, normed (the decoder layer's residual stream "
     "[T, hidden], post-attention RMSNorm weights and eps, and its output [T, hidden], all of "
     "out's dtype): out = resid + the projection, normed = RMSNorm(out).  GIL released."},
    {"layer", (PyCFunction)(void (*)(void))layer_method, METH_FASTCALL,
     "layer(layers, pos, route_flags, x, cos, sin, kbuf, vbuf, S, bias, scale, ln1, eps1, ln2, "
     "eps2, out): one decoder layer of T tokens in one call: x [T, hidden] RMSNorm-ed (ln1, "
     "eps1), pre's projections, norms and rotary, the new k, v written into the KV buffers "
     "kbuf, vbuf [1, kv_heads, capacity, head_dim] (float32 or bf16 bits, C-contiguous) at "
     "positions S..S+T-1, attention over positions 0..S+T-1 with the additive bias float32 [1, "
     "T, S+T] or None, the output projection, the residual add, the post-attention RMSNorm "
     "(ln2, eps2), the MoE block of MoE layer pos of the _C.Layers object layers (its "
     "forward_routed with route_flags), the second residual add, into out [T, hidden] (x's "
     "dtype).  Every intermediate as pre, post and forward_routed compute it; GIL released.  "
     "Returns (seconds in the attention block with its norms and first residual add, seconds "
     "in the MoE block and the second add, 0.0 -- MLABlock.layer's dense-MLP seconds), for "
     "benchmarks."},
    {NULL, NULL, 0, NULL}};

static PyTypeObject AttnBlockType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "specmoe._C.AttnBlock",
    .tp_basicsize = sizeof(AttnBlockObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "AttnBlock(ctx, q, k, v, o, heads, kv_heads, head_dim, norm='none', q_norm=None, "
              "k_norm=None, eps=1e-6, bf16=False, max_tokens=16, qkv=None): one decoder "
              "layer's attention "
              "module at decode sizes (specmoe.models.attention.fuse_attention) in two calls around "
              "the KV cache update: pre (projections, q/k RMSNorm over all heads ('full') or "
              "per head ('head'), rotary) and post (attention, output projection).  q, k, v, o "
              "are specmoe._C.Linear objects (qkv, optional: the three projections' rows in one, "
              "used by pre instead of q, k, v); q_norm, k_norm float32 weights; bf16: round "
              "every intermediate as a bf16 model does (csrc/kernels/block.h).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)ab_init,
    .tp_dealloc = (destructor)ab_dealloc,
    .tp_methods = ab_methods,
};

static PyTypeObject AttnDecodeType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "specmoe._C.AttnDecode",
    .tp_basicsize = sizeof(AttnDecodeObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "AttnDecode(ctx): multi-head / grouped-query attention for decode-sized inputs on "
              "ctx's threads (specmoe.models.attention); one object can serve every layer.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)ad_init,
    .tp_dealloc = (destructor)ad_dealloc,
    .tp_methods = ad_methods,
};

/* ---- MLABlock: a DeepSeek-V2 decoder layer's MLA attention module at decode sizes ---- */

/* Linear slots of an MLABlock */
enum { ML_Q = 0, ML_KVA = 1, ML_O = 2, ML_QA = 3, ML_JOINT = 4, ML_N = 5 };
/* Rotary forms: DeepSeek-V2's complex product (freqs [T, rope_dim / 2, 2]), DeepSeek-V3's
 * rotate-half and interleaved forms (freqs [T, 2, rope_dim]: cos, sin) -- kernels/block.h */
enum { ROPE_COMPLEX = 0, ROPE_HALF = 1, ROPE_INTERLEAVE = 2 };

typedef struct {
    PyObject_HEAD
    PyObject *ctx_obj;            /* the KernelContext (strong) */
    PyObject *mla_obj;            /* the MLADecode whose absorbed weights the block reads
                                     (strong; immutable after its construction) */
    PyObject *lin_obj[ML_N];      /* specmoe._C.Linear (strong): q_proj (q_b_proj when q_a is
                                     set), kv_a_proj_with_mqa, o_proj, q_a_proj or NULL, and
                                     (q or q_a) | kv_a in one or NULL */
    PyObject *kvn_obj, *qan_obj;  /* kv_a_layernorm / q_a_layernorm float32 weights (strong;
                                     qan_obj NULL without q_a) */
    const smoe_linear_desc *ld[ML_N]; /* borrowed from lin_obj (immutable) */
    const uint8_t *lb[ML_N];
    const float *lbias[ML_N];
    uint32_t hidden, qa, nq0, max_tokens; /* qa: q_lora_rank (0: none); nq0: the first
                                             projection's width (qa, or H * (dn + dr)) */
    float kv_eps, qa_eps;
    int bf16;                     /* round as a bf16 model does (kernels/block.h) */
    int rope;                     /* ROPE_COMPLEX, ROPE_HALF or ROPE_INTERLEAVE */
    float *buf;                   /* max_tokens * (hidden + nq0 + r + dr + H * (dn + dr) +
                                     H * dn + H * dr + H * dv + 3 hidden) floats: see
                                     mlab_pre_post and mlab_h; guarded by mu */
    void *route;                  /* decoder_tail's routing buffers; guarded by mu */
    size_t route_cap;
    void *lscratch;               /* linear scratch for max_tokens (fixed size); guarded by mu */
    void *ascratch;               /* MLA scratch (grows with the thread count); guarded by mu */
    size_t ascratch_cap;
    PyObject *mlp_obj;            /* set_mlp's (gate, up, down) tuple of _C.Linear (strong) or
                                     NULL; changed under the GIL and mu */
    smoe_shared_ffn mlp;          /* borrowed from mlp_obj (d[0] NULL: none); guarded by mu */
    smoe_mlp_bufs mlp_bufs;       /* the MLP's rows and scratch; guarded by mu */
    pthread_mutex_t mu;           /* serializes calls on this object */
    int ready;
} MLABlockObject;

static int mlab_init(MLABlockObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"ctx", "mla", "q", "kv_a", "o", "kv_norm", "kv_eps", "q_a",
                             "q_a_norm", "q_a_eps", "joint", "bf16", "max_tokens", "rope", NULL};
    PyObject *ctx_o, *mla_o, *kvn_o, *lin[ML_N] = {NULL, NULL, NULL, Py_None, Py_None},
             *qan_o = Py_None;
    double kv_eps, qa_eps = 1e-6;
    int bf16 = 0;
    unsigned int max_tokens = 16;
    const char *rope = "complex";
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOOd|OOdOpIs:MLABlock", kwlist, &ctx_o,
                                     &mla_o, &lin[ML_Q], &lin[ML_KVA], &lin[ML_O], &kvn_o,
                                     &kv_eps, &lin[ML_QA], &qan_o, &qa_eps, &lin[ML_JOINT],
                                     &bf16, &max_tokens, &rope))
        return -1;
    const int rk = !strcmp(rope, "complex") ? ROPE_COMPLEX
                   : !strcmp(rope, "half") ? ROPE_HALF
                   : !strcmp(rope, "interleave") ? ROPE_INTERLEAVE : -1;
    if (rk < 0) {
        PyErr_Format(PyExc_ValueError,
                     "MLABlock: rope must be 'complex', 'half' or 'interleave', got '%s'", rope);
        return -1;
    }
    if (self->ready) {
        PyErr_SetString(PyExc_RuntimeError, "MLABlock is already initialised");
        return -1;
    }
    if (!smoe_py_kctx(ctx_o)) return -1;
    if (!PyObject_TypeCheck(mla_o, &MLADecodeType) || !((MLADecodeObject *)mla_o)->ready) {
        PyErr_SetString(PyExc_TypeError, "MLABlock: mla must be an initialised _C.MLADecode");
        return -1;
    }
    const smoe_mla_desc *d = &((MLADecodeObject *)mla_o)->d;
    for (int i = 0; i < ML_N; i++)
        if (lin[i] != Py_None &&
            smoe_py_linear_parts(lin[i], &self->ld[i], &self->lb[i], &self->lbias[i]))
            return -1;
    const int has_qa = lin[ML_QA] != Py_None;
    if (has_qa != (qan_o != Py_None)) {
        PyErr_SetString(PyExc_ValueError, "MLABlock: q_a and q_a_norm go together");
        return -1;
    }
    if (max_tokens < 1 || max_tokens > 4096 || !(kv_eps >= 0.0) || kv_eps > 1.0 ||
        !(qa_eps >= 0.0) || qa_eps > 1.0 || d->dr % 2 || d->dr > SMOE_ROTARY_MAX) {
        PyErr_Format(PyExc_ValueError, "MLABlock: max_tokens=%u (1..4096), kv_eps=%g, q_a_eps=%g "
                     "(0..1), rope dim %u (even, at most %u) out of range", max_tokens, kv_eps,
                     qa_eps, d->dr, SMOE_ROTARY_MAX);
        return -1;
    }
    const uint32_t hidden = self->ld[ML_KVA]->K, qa = has_qa ? self->ld[ML_QA]->N : 0;
    const uint32_t nq = d->H * (d->dn + d->dr), nq0 = has_qa ? qa : nq, nkv = d->r + d->dr;
    uint32_t want_n[ML_N] = {nq, nkv, hidden, qa, nq0 + nkv};
    uint32_t want_k[ML_N] = {has_qa ? qa : hidden, hidden, d->H * d->dv, hidden, hidden};
    static const char *names[ML_N] = {"q", "kv_a", "o", "q_a", "joint"};
    for (int i = 0; i < ML_N; i++)
        if (lin[i] != Py_None && (self->ld[i]->N != want_n[i] || self->ld[i]->K != want_k[i])) {
            PyErr_Format(PyExc_ValueError,
                         "MLABlock: the %s projection is %u -> %u, expected %u -> %u (heads=%u "
                         "nope=%u rope=%u v=%u kv_lora_rank=%u hidden=%u q_lora_rank=%u)",
                         names[i], self->ld[i]->K, self->ld[i]->N, want_k[i], want_n[i], d->H,
                         d->dn, d->dr, d->dv, d->r, hidden, qa);
            return -1;
        }
    PyArrayObject *kvn = smoe_py_want_array(kvn_o, "kv_norm", NPY_FLOAT32, 1, 0);
    if (!kvn) return -1;
    if (PyArray_DIM(kvn, 0) != (npy_intp)d->r) {
        PyErr_Format(PyExc_ValueError, "MLABlock: kv_norm has %zd weights, expected %u",
                     (Py_ssize_t)PyArray_DIM(kvn, 0), d->r);
        return -1;
    }
    if (has_qa) {
        PyArrayObject *qan = smoe_py_want_array(qan_o, "q_a_norm", NPY_FLOAT32, 1, 0);
        if (!qan) return -1;
        if (PyArray_DIM(qan, 0) != (npy_intp)qa) {
            PyErr_Format(PyExc_ValueError, "MLABlock: q_a_norm has %zd weights, expected %u",
                         (Py_ssize_t)PyArray_DIM(qan, 0), qa);
            return -1;
        }
    }
    size_t ls = 0;
    for (int i = 0; i < ML_N; i++) {
        size_t s = lin[i] == Py_None ? 0 : smoe_linear_scratch_bytes(self->ld[i], max_tokens);
        if (s > ls) ls = s;
    }
    const size_t per_tok = (size_t)hidden + nq0 + nkv + nq + (size_t)d->H * (d->dn + d->dr) +
                           (size_t)d->H * d->dv + 3 * (size_t)hidden;
    self->buf = malloc((size_t)max_tokens * per_tok * sizeof(float));
    self->lscratch = malloc(ls ? ls : 1);
    int mu_ok = self->buf && self->lscratch && pthread_mutex_init(&self->mu, NULL) == 0;
    if (!mu_ok) {
        free(self->buf);
        free(self->lscratch);
        self->buf = NULL;
        self->lscratch = NULL;
        if (!PyErr_Occurred()) PyErr_NoMemory();
        return -1;
    }
    Py_INCREF(ctx_o);
    self->ctx_obj = ctx_o;
    Py_INCREF(mla_o);
    self->mla_obj = mla_o;
    for (int i = 0; i < ML_N; i++)
        if (lin[i] != Py_None) {
            Py_INCREF(lin[i]);
            self->lin_obj[i] = lin[i];
        }
    Py_INCREF(kvn_o);
    self->kvn_obj = kvn_o;
    if (has_qa) {
        Py_INCREF(qan_o);
        self->qan_obj = qan_o;
    }
    self->hidden = hidden;
    self->qa = qa;
    self->nq0 = nq0;
    self->max_tokens = max_tokens;
    self->kv_eps = (float)kv_eps;
    self->qa_eps = (float)qa_eps;
    self->bf16 = bf16;
    self->rope = rk;
    self->ready = 1;
    return 0;
}

static void mlab_dealloc(MLABlockObject *self) {
    if (self->ready) pthread_mutex_destroy(&self->mu);
    free(self->buf);
    free(self->lscratch);
    free(self->ascratch);
    free(self->route);
    smoe_mlp_bufs_free(&self->mlp_bufs);
    Py_XDECREF(self->mlp_obj);
    Py_XDECREF(self->ctx_obj);
    Py_XDECREF(self->mla_obj);
    for (int i = 0; i < ML_N; i++) Py_XDECREF(self->lin_obj[i]);
    Py_XDECREF(self->kvn_obj);
    Py_XDECREF(self->qan_obj);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* One linear slot of the block on nt rows of x (stride ldx) into y (stride ldy). */
static int mlab_linear(MLABlockObject *self, smoe_kctx *c, int i, const float *x, size_t ldx,
                       uint32_t nt, float *y, size_t ldy, smoe_err *err) {
    return smoe_linear_forward(c, self->ld[i], self->lb[i], self->lbias[i], x, ldx, nt, y, ldy,
                               self->lscratch, err);
}

/* The block's rotary form on `heads` vectors of dr values at x + h * stride, token row ft of
 * the freqs argument (complex: dr / 2 (re, im) pairs; half, interleave: dr cos, dr sin). */
static void mlab_rotary(const MLABlockObject *self, float *x, uint32_t heads, size_t stride,
                        uint32_t dr, const float *ft, int b) {
    if (self->rope == ROPE_COMPLEX)
        smoe_rotary_pairs(x, heads, stride, dr, ft, b);
    else if (self->rope == ROPE_HALF)
        smoe_rotary_half(x, heads, stride, dr, ft, ft + dr, b);
    else
        smoe_rotary_interleave(x, heads, stride, dr, ft, ft + dr, b);
}

/* The attention module of nt tokens, under mu without the GIL, as transformers' DeepSeek-V2
 * attention in the absorbed form (specmoe.models.mla._absorbed_forward, the same roundings):
 *   x = widen(xp) (RMSNorm-ed with ln1: the decoder layer's input norm)
 *   y = [q_proj | kv_a_proj](x)                 (q_a_proj instead of q_proj with q_lora)
 *   q = y's q part, or q_b_proj(q_a_layernorm(y's q_a part))
 *   c = kv_a_layernorm(y's latent part), k_pe = y's rotary part
 *   q_pe, k_pe rotated (complex form, freqs fp [nt, dr / 2, 2] f32)
 *   c, k_pe written at positions S.. of the caches cp / kp (f32 or bf16 bits when cb)
 *   o = MLA over S + nt positions (csrc/kernels/mla.c), then o_proj into of [nt, hidden].
 * Buffer layout (floats, mt = max_tokens): x [mt, hidden], y [mt, nq0 + r + dr],
 * qb [mt, H (dn + dr)], q_nope [H, mt, dn], q_pe [H, mt, dr], att [mt, H dv]; then the
 * block's h, nrm, moe [mt, hidden] each (mlab_h). */
static int mlab_pre_post(MLABlockObject *self, smoe_kctx *c, const void *xp, int xb,
                         const float *fp, uint32_t nt, const float *ln1, float eps1, void *cp,
                         void *kp, int cb, uint32_t S, const float *bias, uint32_t bias_rows,
                         float *of, smoe_err *err) {
    const MLADecodeObject *m = (const MLADecodeObject *)self->mla_obj;
    const smoe_mla_desc *d = &m->d;
    const uint32_t H = d->H, dn = d->dn, dr = d->dr, dv = d->dv, r = d->r, hid = self->hidden;
    const uint32_t nq = H * (dn + dr), nq0 = self->nq0, ny = nq0 + r + dr;
    const size_t mt = self->max_tokens;
    const int b = self->bf16;
    float *x = self->buf, *y = x + mt * hid, *qb = y + mt * ny, *qn = qb + mt * nq;
    float *qp = qn + mt * H * dn, *att = qp + mt * H * dr;
    widen(x, xp, xb, (size_t)nt * hid);
    if (ln1) smoe_rmsnorm(x, nt, hid, ln1, eps1, b); /* the input layernorm */
    int rc;
    if (self->lin_obj[ML_JOINT]) {
        rc = mlab_linear(self, c, ML_JOINT, x, hid, nt, y, ny, err);
    } else {
        rc = mlab_linear(self, c, self->qa ? ML_QA : ML_Q, x, hid, nt, y, ny, err);
        if (rc == SMOE_OK) rc = mlab_linear(self, c, ML_KVA, x, hid, nt, y + nq0, ny, err);
    }
    if (rc != SMOE_OK) return rc;
    if (b) smoe_bf16_round(y, (size_t)nt * ny); /* the projections' bf16 outputs */
    const float *q = y;                           /* token t's q at q + t * qs */
    size_t qs = ny;
    if (self->qa) {
        const float *qan = (const float *)PyArray_DATA((PyArrayObject *)self->qan_obj);
        for (uint32_t t = 0; t < nt; t++) smoe_rmsnorm(y + (size_t)t * ny, 1, nq0, qan,
                                                       self->qa_eps, b);
        rc = mlab_linear(self, c, ML_Q, y, ny, nt, qb, nq, err);
        if (rc != SMOE_OK) return rc;
        if (b) smoe_bf16_round(qb, (size_t)nt * nq);
        q = qb;
        qs = nq;
    }
    const float *kvn = (const float *)PyArray_DATA((PyArrayObject *)self->kvn_obj);
    const size_t esz = cb ? 2 : 4;
    for (uint32_t t = 0; t < nt; t++) {
        float *qt = (float *)q + (size_t)t * qs, *ct = y + (size_t)t * ny + nq0, *kt = ct + r;
        const float *ft = fp + (size_t)t * (self->rope == ROPE_COMPLEX ? dr : 2 * dr);
        smoe_rmsnorm(ct, 1, r, kvn, self->kv_eps, b);  /* kv_a_layernorm */
        mlab_rotary(self, qt + dn, H, dn + dr, dr, ft, b); /* each head's q_pe */
        mlab_rotary(self, kt, 1, dr, dr, ft, b);
        store((uint8_t *)cp + ((size_t)S + t) * r * esz, cb, ct, r);
        store((uint8_t *)kp + ((size_t)S + t) * dr * esz, cb, kt, dr);
        for (uint32_t h = 0; h < H; h++) { /* [T, H, dn + dr] -> [H, T, dn], [H, T, dr] */
            memcpy(qn + ((size_t)h * nt + t) * dn, qt + (size_t)h * (dn + dr), dn * 4);
            memcpy(qp + ((size_t)h * nt + t) * dr, qt + (size_t)h * (dn + dr) + dn, dr * 4);
        }
    }
    rc = grow_scratch(&self->ascratch, &self->ascratch_cap, smoe_mla_scratch_bytes(c, d, nt),
                      err);
    const int cdt = cb ? SMOE_WDT_BF16 : SMOE_WDT_F32;
    if (rc == SMOE_OK)
        rc = smoe_mla_decode(c, d, 1, nt, S + nt, qn, qp, cp, cdt, 0, kp, cdt, 0, &m->w, bias,
                             bias_rows, att, self->ascratch, self->ascratch_cap, err);
    if (rc != SMOE_OK) return rc;
    if (b) smoe_bf16_round(att, (size_t)nt * H * dv); /* .to(the model's dtype) */
    rc = mlab_linear(self, c, ML_O, att, (size_t)H * dv, nt, of, hid, err);
    if (rc == SMOE_OK && b) smoe_bf16_round(of, (size_t)nt * hid);
    return rc;
}

/* The layer's h [mt, hidden] in buf, after mlab_pre_post's buffers; nrm and moe follow it. */
static float *mlab_h(const MLABlockObject *self) {
    const smoe_mla_desc *d = &((const MLADecodeObject *)self->mla_obj)->d;
    return self->buf + (size_t)self->max_tokens *
                           (self->hidden + self->nq0 + d->r + d->dr +
                            2 * (size_t)d->H * (d->dn + d->dr) + (size_t)d->H * d->dv);
}

/* The checked arguments common to attn and layer. */
typedef struct {
    uint32_t nt, S, cap; /* cap: the KV buffers' positions */
    int xb, cb;
    const void *xp;
    const float *fp, *bias, *ln1, *ln2;
    uint32_t bias_rows;
    float eps1, eps2;
    void *cp, *kp;
} mlab_args;

/* x, freqs, cbuf, kbuf, S, bias, ln1, eps1, ln2, eps2 at args[0..10): x [T, hidden] f32/bf16;
 * freqs float32 [T, rope_dim / 2, 2]; cbuf [1, 1, capacity, kv_lora_rank] and kbuf
 * [1, 1, capacity, rope_dim], f32 or bf16 bits alike, with room for S + T positions; bias
 * None or float32 [1, T, S + T]; the two RMSNorms' weights and eps. */
static int mlab_parse(MLABlockObject *self, PyObject *const *args, mlab_args *a) {
    const smoe_mla_desc *d = &((MLADecodeObject *)self->mla_obj)->d;
    const uint32_t hid = self->hidden;
    long long S = PyLong_AsLongLong(args[4]);
    if (S == -1 && PyErr_Occurred()) return -1;
    if ((a->xb = smoe_py_f32_or_bf16(args[0], "x", 2, 0)) < 0) return -1;
    npy_intp T = PyArray_DIM((PyArrayObject *)args[0], 0);
    if (T < 1 || T > (npy_intp)self->max_tokens) {
        PyErr_Format(PyExc_ValueError, "MLABlock: %zd tokens, expected 1..%u", (Py_ssize_t)T,
                     self->max_tokens);
        return -1;
    }
    PyArrayObject *f = smoe_py_want_array(args[1], "freqs", NPY_FLOAT32, 3, 0);
    if (!f) return -1;
    int cb = smoe_py_f32_or_bf16(args[2], "cbuf", 4, 1);
    int kb = smoe_py_f32_or_bf16(args[3], "kbuf", 4, 1);
    if (cb < 0 || kb < 0) return -1;
    npy_intp cap = PyArray_DIM((PyArrayObject *)args[2], 2);
    const int cx = self->rope == ROPE_COMPLEX;
    npy_intp w_x[2] = {T, hid}, w_c[4] = {1, 1, cap, d->r}, w_k[4] = {1, 1, cap, d->dr};
    npy_intp w_f[3] = {T, cx ? d->dr / 2 : 2, cx ? 2 : d->dr};
    if (dims_are(args[0], "x [T, hidden]", w_x, 2) ||
        dims_are(args[1], cx ? "freqs [T, rope_dim / 2, 2]" : "freqs [T, 2, rope_dim]", w_f, 3) ||
        dims_are(args[2], "cbuf [1, 1, capacity, kv_lora_rank]", w_c, 4) ||
        dims_are(args[3], "kbuf [1, 1, capacity, rope_dim]", w_k, 4))
        return -1;
    if (cb != kb) {
        PyErr_SetString(PyExc_ValueError, "cbuf and kbuf must have the same dtype");
        return -1;
    }
    if (S < 0 || S + T > cap || S + T > (long long)UINT32_MAX / 2) {
        PyErr_Format(PyExc_ValueError, "MLABlock: S=%lld cached + %zd new positions do not fit "
                     "a capacity of %zd", S, (Py_ssize_t)T, (Py_ssize_t)cap);
        return -1;
    }
    if (bias_arg(args[5], 1, T, (npy_intp)S + T, &a->bias, &a->bias_rows) ||
        norm_arg(args[6], args[7], hid, &a->ln1, &a->eps1) ||
        norm_arg(args[8], args[9], hid, &a->ln2, &a->eps2))
        return -1;
    a->nt = (uint32_t)T;
    a->S = (uint32_t)S;
    a->cap = cap > (npy_intp)UINT32_MAX / 2 ? UINT32_MAX / 2 : (uint32_t)cap;
    a->cb = cb;
    a->xp = PyArray_DATA((PyArrayObject *)args[0]);
    a->fp = (const float *)PyArray_DATA(f);
    a->cp = PyArray_DATA((PyArrayObject *)args[2]);
    a->kp = PyArray_DATA((PyArrayObject *)args[3]);
    return 0;
}

/* An output argument: [T, hidden] in x's dtype, not aliasing x (or other, when given). */
static int mlab_out(MLABlockObject *self, PyObject *o, const char *name, const mlab_args *a,
                    const void *other) {
    npy_intp w_o[2] = {a->nt, self->hidden};
    int ob = smoe_py_f32_or_bf16(o, name, 2, 1);
    if (ob < 0 || dims_are(o, name, w_o, 2)) return -1;
    void *p = PyArray_DATA((PyArrayObject *)o);
    if (ob != a->xb || p == a->xp || p == other) {
        PyErr_Format(PyExc_ValueError, "%s must have x's dtype and alias no other argument",
                     name);
        return -1;
    }
    return 0;
}

/* attn(x, freqs, cbuf, kbuf, S, bias, ln1, eps1, ln2, eps2, out, normed): the attention half
 * of a decoder layer (the method doc). */
static PyObject *mlab_attn(MLABlockObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (method_start(self->ready, "MLABlock",
                     "attn(x, freqs, cbuf, kbuf, S, bias, ln1, eps1, ln2, eps2, out, normed)",
                     nargs, 12, 12))
        return NULL;
    mlab_args a;
    if (mlab_parse(self, args, &a) || mlab_out(self, args[10], "out", &a, NULL) ||
        mlab_out(self, args[11], "normed", &a, PyArray_DATA((PyArrayObject *)args[10])))
        return NULL;
    smoe_kctx *c = smoe_py_kctx(self->ctx_obj);
    if (!c) return NULL;
    void *op = PyArray_DATA((PyArrayObject *)args[10]);
    void *np_ = PyArray_DATA((PyArrayObject *)args[11]);
    const size_t n = (size_t)a.nt * self->hidden;
    smoe_err err;
    smoe_err_clear(&err);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->mu);
    float *h = mlab_h(self);
    rc = mlab_pre_post(self, c, a.xp, a.xb, a.fp, a.nt, a.ln1, a.eps1, a.cp, a.kp, a.cb, a.S,
                       a.bias, a.bias_rows, h, &err);
    if (rc == SMOE_OK) {
        residual_add(self->bf16, h, a.xp, a.xb, n); /* h = x + attention */
        store(op, a.xb, h, n);
        smoe_rmsnorm(h, a.nt, self->hidden, a.ln2, a.eps2, self->bf16);
        store(np_, a.xb, h, n);
    }
    pthread_mutex_unlock(&self->mu);
    Py_END_ALLOW_THREADS
    if (rc != 0) return smoe_py_raise(&err);
    Py_RETURN_NONE;
}

/* The checked arguments of MLABlock.layer (mlab_layer_parse), for mlab_layer_run. */
typedef struct {
    long pos; /* checked by layer_call_begin (unused for a dense layer) */
    int flags;
    int dense; /* layers None: the block's MLP (set_mlp) instead of a MoE block */
    mlab_args a;
    void *op;
} mlab_layer_args;

/* Check layer()'s 14 arguments (the method doc) into *l; -1 with the exception set. */
static int mlab_layer_parse(MLABlockObject *self, PyObject *const *args, Py_ssize_t nargs,
                            mlab_layer_args *l) {
    if (method_start(self->ready, "MLABlock",
                     "layer(layers, pos, route_flags, x, freqs, cbuf, kbuf, S, bias, ln1, eps1, "
                     "ln2, eps2, out)",
                     nargs, 14, 14))
        return -1;
    long pos = PyLong_AsLong(args[1]);
    if (pos == -1 && PyErr_Occurred()) return -1;
    if (smoe_py_route_flags(args[2], &l->flags)) return -1;
    if (mlab_parse(self, args + 3, &l->a) || mlab_out(self, args[13], "out", &l->a, NULL))
        return -1;
    l->pos = pos;
    l->dense = args[0] == Py_None;
    if (l->dense && !self->mlp.d[0]) {
        PyErr_SetString(PyExc_ValueError, "MLABlock.layer: layers None runs the block's dense "
                        "MLP, and none is set (set_mlp)");
        return -1;
    }
    l->op = PyArray_DATA((PyArrayObject *)args[13]);
    return 0;
}

/* set_mlp(mlp): the dense MLP that layer(None, ...) runs after the attention: a (gate, up,
 * down) tuple of _C.Linear chaining hidden -> I -> hidden (the Linear objects are kept), or
 * None (none). */
static PyObject *mlab_set_mlp(MLABlockObject *self, PyObject *arg) {
    if (method_start(self->ready, "MLABlock", "set_mlp(mlp)", 1, 1, 1)) return NULL;
    smoe_shared_ffn f;
    if (smoe_py_mlp_parts(arg, &f, "set_mlp: mlp") < 0) return NULL;
    if (arg != Py_None) {
        smoe_err e;
        smoe_err_clear(&e);
        if (smoe_silu_mlp_check(&f, self->hidden, "MLABlock.set_mlp: the MLP's", &e))
            return smoe_py_raise(&e);
    }
    PyObject *old = self->mlp_obj, *keep = arg == Py_None ? NULL : arg;
    Py_XINCREF(keep);
    Py_BEGIN_ALLOW_THREADS pthread_mutex_lock(&self->mu); /* waits for a layer in flight */
    self->mlp = f;
    pthread_mutex_unlock(&self->mu);
    Py_END_ALLOW_THREADS
    self->mlp_obj = keep;
    Py_XDECREF(old); /* released only now: the block no longer borrows from it */
    Py_RETURN_NONE;
}

/* One decoder layer of checked arguments on the MoE layers g, without the GIL, under the
 * block's mutex; *ta and *tm get the time in its attention and MoE parts. */
static int mlab_layer_run(MLABlockObject *self, smoe_kctx *c, smoe_layers *g,
                          const mlab_layer_args *l, double *ta, double *tm, smoe_err *err) {
    const mlab_args *a = &l->a;
    const uint32_t hid = self->hidden;
    pthread_mutex_lock(&self->mu);
    float *h = mlab_h(self), *nrm = h + self->max_tokens * hid;
    float *moe = nrm + self->max_tokens * hid;
    double t0 = smoe_now(), t1 = t0;
    int rc = mlab_pre_post(self, c, a->xp, a->xb, a->fp, a->nt, a->ln1, a->eps1, a->cp, a->kp,
                           a->cb, a->S, a->bias, a->bias_rows, h, err);
    const dense_mlp mlp = {c, &self->mlp, &self->mlp_bufs};
    if (rc == SMOE_OK && !g && !self->mlp.d[0]) /* set_mlp(None) since the call was checked */
        rc = smoe_err_set(err, SMOE_ESTATE, "MLABlock.layer: the block's MLP was removed");
    if (rc == SMOE_OK)
        rc = decoder_tail(self->bf16, g, &mlp, (uint32_t)l->pos, l->flags, a->nt, hid, h, a->xp,
                          a->xb, a->ln2, a->eps2, nrm, moe, &self->route, &self->route_cap, l->op,
                          a->xb, &t1, err);
    double t2 = smoe_now();
    pthread_mutex_unlock(&self->mu);
    *ta = t1 - t0;
    *tm = t2 - t1;
    return rc;
}

static PyMethodDef mlab_methods[] = {
    {"attn", (PyCFunction)(void (*)(void))mlab_attn, METH_FASTCALL,
     "attn(x, freqs, cbuf, kbuf, S, bias, ln1, eps1, ln2, eps2, out, normed): the attention "
     "half of a DeepSeek-V2 decoder layer for T tokens: input RMSNorm (ln1), the MLA module "
     "(projections, kv_a_layernorm, rotary, the new latent and rotary key written into cbuf / "
     "kbuf at positions S..S+T-1, absorbed attention over S + T positions, o_proj), out = x + "
     "that, normed = the post-attention RMSNorm (ln2) of out.  x, out, normed [T, hidden] f32 "
     "or bf16 bits alike; freqs float32 [T, rope_dim / 2, 2] (rope 'complex': the rotary "
     "frequencies as (re, im)) or [T, 2, rope_dim] ('half', 'interleave': cos, sin); cbuf "
     "[1, 1, capacity, kv_lora_rank], kbuf [1, 1, capacity, rope_dim] f32 "
     "or bf16 bits; bias None or float32 [1, T, S + T] added to the scores; ln1, ln2 float32 "
     "[hidden] with their eps."},
    {"layer", (PyCFunction)(void (*)(void))layer_method, METH_FASTCALL,
     "layer(layers, pos, route_flags, x, freqs, cbuf, kbuf, S, bias, ln1, eps1, ln2, eps2, "
     "out): a whole DeepSeek-V2 MoE decoder layer of T tokens in one call: attn's part, then "
     "the MoE block at position pos of the _C.Layers `layers` (routing, routed and shared "
     "experts, as Layers.forward_routed with route_flags) on the normed sum, and out = the sum "
     "+ the block's output.  layers None: a dense layer, the block's MLP (set_mlp) in place "
     "of the MoE block (pos and route_flags unused).  Returns (seconds in the attention part, "
     "seconds in the MoE block, seconds in the dense MLP)."},
    {"set_mlp", (PyCFunction)mlab_set_mlp, METH_O,
     "set_mlp(mlp): the dense MLP layer(None, ...) runs after the attention, down(silu(gate "
     "x) * up x) rounded as the block's dtype: a (gate, up, down) tuple of _C.Linear chaining "
     "hidden -> I -> hidden (kept by the block), or None."},
    {NULL, NULL, 0, NULL}};

static PyTypeObject MLABlockType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "specmoe._C.MLABlock",
    .tp_basicsize = sizeof(MLABlockObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "MLABlock(ctx, mla, q, kv_a, o, kv_norm, kv_eps, q_a=None, q_a_norm=None, "
              "q_a_eps=1e-6, joint=None, bf16=False, max_tokens=16, rope='complex'): a "
              "DeepSeek-V2/V3 decoder layer's MLA attention module at decode sizes in one call "
              "(rope: 'complex' DeepSeek-V2's, 'half' and 'interleave' DeepSeek-V3's; specmoe.models.mla."
              "fuse_mla).  mla: the module's _C.MLADecode (absorbed weights); q, kv_a, o: "
              "specmoe._C.Linear of q_proj (q_b_proj when q_a is given), kv_a_proj_with_mqa, "
              "o_proj; q_a, q_a_norm, q_a_eps: q_a_proj and q_a_layernorm (q_lora_rank "
              "models); joint: (q or q_a) | kv_a in one Linear, used instead of the two; "
              "kv_norm, kv_eps: kv_a_layernorm's float32 weights and eps; bf16: round every "
              "intermediate as a bf16 model does (csrc/kernels/block.h).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)mlab_init,
    .tp_dealloc = (destructor)mlab_dealloc,
    .tp_methods = mlab_methods,
};


/* out = the RMSNorm (block.h) of one row x of n values, both f32 or bf16 bits (b), through the
 * f32 row buf [n]: rms_norm's rows and DecodePlan's final norm. */
static void rms_norm_row(const void *x, void *out, int b, const float *w, float eps, int bf16,
                         float *buf, uint32_t n) {
    widen(buf, x, b, n);
    smoe_rmsnorm(buf, 1, n, w, eps, bf16);
    store(out, b, buf, n);
}

/* rms_norm(x, w, eps, out, bf16): the RMSNorm of block.h over the rows of x [T, n] into out
 * (float32 or bf16 bits, x's dtype); w float32 [n].  Short inputs: no GIL release. */
static PyObject *py_rms_norm(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    (void)mod;
    if (nargs != 5) {
        PyErr_Format(PyExc_TypeError,
                     "rms_norm(x, w, eps, out, bf16) takes 5 arguments, got %zd", nargs);
        return NULL;
    }
    int xb = smoe_py_f32_or_bf16(args[0], "x", 2, 0);
    int ob = smoe_py_f32_or_bf16(args[3], "out", 2, 1);
    if (xb < 0 || ob < 0) return NULL;
    int bf16 = PyObject_IsTrue(args[4]);
    if (bf16 < 0) return NULL;
    npy_intp T = PyArray_DIM((PyArrayObject *)args[0], 0);
    npy_intp n = PyArray_DIM((PyArrayObject *)args[0], 1);
    npy_intp w_o[2] = {T, n};
    const float *w;
    float eps;
    if (n < 1 || n > (1 << 24) || norm_arg(args[1], args[2], (uint32_t)n, &w, &eps) ||
        dims_are(args[3], "out [T, n]", w_o, 2))
        return NULL;
    if (xb != ob) {
        PyErr_SetString(PyExc_ValueError, "x and out must have the same dtype");
        return NULL;
    }
    const void *xp = PyArray_DATA((PyArrayObject *)args[0]);
    void *op = PyArray_DATA((PyArrayObject *)args[3]);
    float row[4096], *buf = n <= 4096 ? row : malloc((size_t)n * sizeof(float));
    if (!buf) return PyErr_NoMemory();
    for (npy_intp t = 0; t < T; t++)
        rms_norm_row((const uint8_t *)xp + (size_t)t * n * (xb ? 2 : 4),
                     (uint8_t *)op + (size_t)t * n * (ob ? 2 : 4), xb, w, eps, bf16, buf,
                     (uint32_t)n);
    if (buf != row) free(buf);
    Py_RETURN_NONE;
}

/* The most decoder layers one layer_chain call takes (its items live on the stack). */
#define CHAIN_MAX 128

typedef struct {
    int mla;           /* an MLABlock's layer, else an AttnBlock's */
    PyObject *blk;     /* borrowed from the calls tuple */
    PyObject *layers;  /* borrowed: the call's _C.Layers, or NULL (a dense layer) */
    long pos;          /* the MoE layer's position in layers */
    uint32_t hid;      /* the block's hidden size */
    smoe_kctx *c;
    smoe_layers *g;    /* begun layers (chain_item_begin), or NULL */
    union {
        ab_layer_args ab;
        mlab_layer_args ml;
    } u;
} chain_item;

/* Check one layer call -- blk an AttnBlock or MLABlock, av its layer() arguments -- into *c,
 * beginning nothing; -1 with the exception set.  i: the call's index in a chain, for messages
 * (-1: the method itself). */
static int chain_item_parse(PyObject *blk, PyObject *const *av, Py_ssize_t an, Py_ssize_t i,
                            chain_item *c) {
    c->blk = blk;
    c->g = NULL;
    if (PyObject_TypeCheck(blk, &AttnBlockType)) {
        AttnBlockObject *b = (AttnBlockObject *)blk;
        c->mla = 0;
        if (ab_layer_parse(b, av, an, &c->u.ab)) return -1;
        c->c = smoe_py_kctx(b->ctx_obj);
        c->hid = b->hidden;
        c->pos = c->u.ab.pos;
    } else if (PyObject_TypeCheck(blk, &MLABlockType)) {
        MLABlockObject *b = (MLABlockObject *)blk;
        c->mla = 1;
        if (mlab_layer_parse(b, av, an, &c->u.ml)) return -1;
        c->c = smoe_py_kctx(b->ctx_obj);
        c->hid = b->hidden;
        c->pos = c->u.ml.pos;
    } else {
        PyErr_Format(PyExc_TypeError, "layer_chain: call %zd's block is a %s, not an "
                     "AttnBlock or MLABlock", i, Py_TYPE(blk)->tp_name);
        return -1;
    }
    if (!c->c) return -1;
    /* a dense MLABlock layer has no MoE layers to begin */
    c->layers = c->mla && c->u.ml.dense ? NULL : av[0];
    return 0;
}

/* Begin a parsed item's _C.Layers (GIL held); -1 with the exception set. */
static int chain_item_begin(chain_item *c) {
    if (!c->layers) return 0;
    c->g = layer_call_begin(c->layers, c->pos, c->hid);
    return c->g ? 0 : -1;
}

/* End the begun items of it[0..n) (GIL held), keeping an exception that is pending: the ends
 * look the cache up and must not run with one set. */
static void chain_end(chain_item *it, Py_ssize_t n) {
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    for (Py_ssize_t i = 0; i < n; i++)
        if (it[i].g) {
            smoe_py_layers_end(it[i].layers);
            it[i].g = NULL;
        }
    PyErr_Restore(et, ev, tb);
}

/* Run the n begun items in order, no GIL (a failing layer stops the run); adds the seconds in
 * their attention parts, MoE blocks and dense MLPs to t[0..3). */
static int chain_exec(const chain_item *it, Py_ssize_t n, double t[3], smoe_err *err) {
    int rc = SMOE_OK;
    for (Py_ssize_t i = 0; i < n && rc == SMOE_OK; i++) {
        double a1, m1;
        const chain_item *c = &it[i];
        rc = c->mla ? mlab_layer_run((MLABlockObject *)c->blk, c->c, c->g, &c->u.ml, &a1, &m1,
                                     err)
                    : ab_layer_run((AttnBlockObject *)c->blk, c->c, c->g, &c->u.ab, &a1, &m1,
                                   err);
        t[0] += a1;
        t[c->g ? 1 : 2] += m1; /* a dense layer's second part is its MLP */
    }
    return rc;
}

/* Parse and begin calls[0..n) (layer_chain's items) into it; -1 with the exception set and
 * nothing left begun.  begin 0: parse only. */
static int chain_parse(PyObject *calls, chain_item *it, int begin) {
    const Py_ssize_t n = PyTuple_GET_SIZE(calls);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *call = PyTuple_GET_ITEM(calls, i);
        int bad = !PyTuple_Check(call) || PyTuple_GET_SIZE(call) != 2 ||
                  !PyTuple_Check(PyTuple_GET_ITEM(call, 1));
        if (bad)
            PyErr_Format(PyExc_TypeError, "layer_chain: call %zd is not (block, args tuple)", i);
        else {
            PyObject *a = PyTuple_GET_ITEM(call, 1);
            bad = chain_item_parse(PyTuple_GET_ITEM(call, 0), &PyTuple_GET_ITEM(a, 0),
                                   PyTuple_GET_SIZE(a), i, &it[i]) ||
                  (begin && chain_item_begin(&it[i]));
        }
        if (bad) {
            chain_end(it, i);
            return -1;
        }
    }
    return 0;
}

/* Run the n begun items with the GIL released once, end them all; returns (attention seconds,
 * MoE block seconds, dense MLP seconds) summed, or NULL with the error. */
static PyObject *chain_run(chain_item *it, Py_ssize_t n) {
    smoe_err err;
    smoe_err_clear(&err);
    int rc;
    double t[3] = {0, 0, 0};
    Py_BEGIN_ALLOW_THREADS
    rc = chain_exec(it, n, t, &err);
    Py_END_ALLOW_THREADS
    chain_end(it, n);
    if (rc != 0) return smoe_py_raise(&err);
    return Py_BuildValue("(ddd)", t[0], t[1], t[2]);
}

/* layer(...) of AttnBlock (16 arguments) and MLABlock (14): one whole decoder layer (the
 * methods' docs), a chain of one. */
static PyObject *layer_method(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    chain_item c;
    if (chain_item_parse(self, args, nargs, -1, &c) || chain_item_begin(&c)) return NULL;
    return chain_run(&c, 1);
}

/* layer_chain(calls): decoder layers one after another with the GIL released once (see the
 * method doc).  On a decode step whose weights stream through the CPU caches, each return to
 * the interpreter between two layers costs tens of microseconds of cold Python. */
static PyObject *py_layer_chain(PyObject *mod, PyObject *const *args, Py_ssize_t nargs) {
    (void)mod;
    if (nargs != 1 || !PyTuple_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "layer_chain(calls) takes one tuple of (block, args)");
        return NULL;
    }
    PyObject *calls = args[0];
    const Py_ssize_t n = PyTuple_GET_SIZE(calls);
    if (n > CHAIN_MAX) {
        PyErr_Format(PyExc_ValueError, "layer_chain: %zd layers, at most %d", n, CHAIN_MAX);
        return NULL;
    }
    chain_item it[CHAIN_MAX];
    if (chain_parse(calls, it, 1)) return NULL;
    return chain_run(it, n);
}

/* ---- DecodePlan: a whole one-token decode step in one call ----
 * specmoe.models.decode_step builds one per generation (its KV buffers, its layers) and calls step()
 * once per token: the embedding row, the rotary rows of position S, the decoder layers (as
 * layer_chain), the final RMSNorm and lm_head, with the GIL released once.  What step() leaves
 * to Python is the KV cache's views (kv_advance) and the output object. */

/* A per-step row copy: dst = table[r] (r: the token for the embedding, S for a rotary table). */
typedef struct {
    const uint8_t *table;
    npy_intp rows;
    size_t row_bytes;
    uint8_t *dst;
} plan_row;

typedef struct {
    PyObject_HEAD
    PyObject *keep;        /* the constructor's arguments (strong): every array and object the
                              plan points into stays alive and unresized while it lives */
    Py_ssize_t n;          /* layer calls */
    chain_item *it;        /* [n], parsed at construction; S written and layers begun by each
                              step, under the GIL */
    Py_ssize_t nrows;
    plan_row *rows;        /* [nrows] rotary rows, copied from row S */
    plan_row embed;        /* table NULL: none; else row `token` into the first layer's x */
    const void *norm_x;    /* final RMSNorm: NULL none, else x [1, n] -> out, f32/bf16 (nb) */
    void *norm_out;
    const float *norm_w;
    float norm_eps;
    int nb, norm_bf16;
    uint32_t norm_n;
    float *norm_buf;       /* [norm_n] f32 row; used by the step in flight only */
    PyObject *head;        /* the lm_head _C.Linear (borrowed from keep) or NULL */
    const void *head_x;    /* its input [1, K], f32/bf16 (hb) */
    int hb;
    uint32_t head_n;
    float *logit_buf;      /* [head_n] bf16 logits widened for step(argmax=True); used by the
                              step in flight only */
    int busy;              /* a step in flight: set and cleared with the GIL held */
} DecodePlanObject;

/* A (table, dst) pair into *r: table C-contiguous with >= 1 dim, dst C-contiguous, writable,
 * of table's dtype and one row's bytes.  -1 with ValueError naming what. */
static int plan_row_parse(PyObject *table, PyObject *dst, const char *what, plan_row *r) {
    if (!PyArray_Check(table) || !PyArray_Check(dst)) {
        PyErr_Format(PyExc_TypeError, "DecodePlan: %s: table and row must be numpy arrays", what);
        return -1;
    }
    PyArrayObject *t = (PyArrayObject *)table, *d = (PyArrayObject *)dst;
    if (PyArray_NDIM(t) < 1 || PyArray_DIM(t, 0) < 1 || !PyArray_IS_C_CONTIGUOUS(t) ||
        !PyArray_IS_C_CONTIGUOUS(d) || !PyArray_ISWRITEABLE(d) ||
        !PyArray_EquivTypes(PyArray_DESCR(t), PyArray_DESCR(d)) ||
        (size_t)PyArray_NBYTES(d) * (size_t)PyArray_DIM(t, 0) != (size_t)PyArray_NBYTES(t) ||
        PyArray_NBYTES(d) == 0) {
        PyErr_Format(PyExc_ValueError, "DecodePlan: %s: the row must be a writable C-contiguous "
                     "array of the table's dtype holding one of its rows (table C-contiguous, "
                     "rows first)", what);
        return -1;
    }
    r->table = (const uint8_t *)PyArray_DATA(t);
    r->rows = PyArray_DIM(t, 0);
    r->row_bytes = (size_t)PyArray_NBYTES(d);
    r->dst = (uint8_t *)PyArray_DATA(d);
    return 0;
}

static void dp_dealloc(DecodePlanObject *self) {
    free(self->it);
    free(self->rows);
    free(self->norm_buf);
    free(self->logit_buf);
    Py_XDECREF(self->keep);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int dp_init(DecodePlanObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"calls", "rows", "embed", "norm", "head", NULL};
    PyObject *calls, *rows = Py_None, *embed = Py_None, *norm = Py_None, *head = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O!|OOOO:DecodePlan", kwlist, &PyTuple_Type,
                                     &calls, &rows, &embed, &norm, &head))
        return -1;
    if (self->keep) {
        PyErr_SetString(PyExc_RuntimeError, "DecodePlan is already initialised");
        return -1;
    }
    const Py_ssize_t n = PyTuple_GET_SIZE(calls);
    if (n < 1 || n > CHAIN_MAX) {
        PyErr_Format(PyExc_ValueError, "DecodePlan: %zd layer calls, expected 1..%d", n,
                     CHAIN_MAX);
        return -1;
    }
    if (rows != Py_None && !PyTuple_Check(rows)) {
        PyErr_SetString(PyExc_TypeError, "DecodePlan: rows must be a tuple of (table, row)");
        return -1;
    }
    const Py_ssize_t nr = rows == Py_None ? 0 : PyTuple_GET_SIZE(rows);
    chain_item *it = calloc((size_t)n, sizeof(*it));
    plan_row *rv = calloc((size_t)(nr ? nr : 1), sizeof(*rv));
    float *nbuf = NULL, *lbuf = NULL;
    if (!it || !rv) goto nomem;
    if (chain_parse(calls, it, 0)) goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        /* an attention bias spans S + T positions: a plan's calls carry none */
        const float *bias = it[i].mla ? it[i].u.ml.a.bias : it[i].u.ab.bias;
        if (bias) {
            PyErr_Format(PyExc_ValueError, "DecodePlan: call %zd has an attention bias (its "
                         "length depends on S): a plan's calls take None", i);
            goto fail;
        }
    }
    for (Py_ssize_t i = 0; i < nr; i++) {
        PyObject *p = PyTuple_GET_ITEM(rows, i);
        if (!PyTuple_Check(p) || PyTuple_GET_SIZE(p) != 2) {
            PyErr_Format(PyExc_TypeError, "DecodePlan: rows[%zd] is not a (table, row) pair", i);
            goto fail;
        }
        if (plan_row_parse(PyTuple_GET_ITEM(p, 0), PyTuple_GET_ITEM(p, 1), "rows", &rv[i]))
            goto fail;
    }
    plan_row er = {0};
    if (embed != Py_None) {
        if (!PyTuple_Check(embed) || PyTuple_GET_SIZE(embed) != 2) {
            PyErr_SetString(PyExc_TypeError, "DecodePlan: embed must be (table, x) or None");
            goto fail;
        }
        if (plan_row_parse(PyTuple_GET_ITEM(embed, 0), PyTuple_GET_ITEM(embed, 1), "embed",
                           &er))
            goto fail;
    }
    const void *nx = NULL;
    void *no = NULL;
    const float *nw = NULL;
    float neps = 0;
    int nb = 0, nbf = 0;
    uint32_t nn = 0;
    if (norm != Py_None) {
        if (!PyTuple_Check(norm) || PyTuple_GET_SIZE(norm) != 5) {
            PyErr_SetString(PyExc_TypeError, "DecodePlan: norm must be (x, w, eps, out, bf16) "
                            "or None");
            goto fail;
        }
        PyObject *x = PyTuple_GET_ITEM(norm, 0), *o = PyTuple_GET_ITEM(norm, 3);
        int xb = smoe_py_f32_or_bf16(x, "norm x", 2, 0);
        int ob = smoe_py_f32_or_bf16(o, "norm out", 2, 1);
        if (xb < 0 || ob < 0) goto fail;
        npy_intp nd = PyArray_DIM((PyArrayObject *)x, 1), w_o[2] = {1, nd};
        if (xb != ob || PyArray_DIM((PyArrayObject *)x, 0) != 1 || nd < 1 || nd > (1 << 24)) {
            PyErr_SetString(PyExc_ValueError, "DecodePlan: norm x and out must be [1, n] of "
                            "one dtype");
            goto fail;
        }
        if (norm_arg(PyTuple_GET_ITEM(norm, 1), PyTuple_GET_ITEM(norm, 2), (uint32_t)nd, &nw,
                     &neps) ||
            dims_are(o, "norm out [1, n]", w_o, 2))
            goto fail;
        nbf = PyObject_IsTrue(PyTuple_GET_ITEM(norm, 4));
        if (nbf < 0) goto fail;
        nx = PyArray_DATA((PyArrayObject *)x);
        no = PyArray_DATA((PyArrayObject *)o);
        nb = xb;
        nn = (uint32_t)nd;
        if (!(nbuf = malloc((size_t)nn * sizeof(float)))) goto nomem;
    }
    PyObject *hl = NULL;
    const void *hx = NULL;
    int hb = 0;
    uint32_t hn = 0;
    if (head != Py_None) {
        if (!PyTuple_Check(head) || PyTuple_GET_SIZE(head) != 2) {
            PyErr_SetString(PyExc_TypeError, "DecodePlan: head must be (linear, x) or None");
            goto fail;
        }
        const smoe_linear_desc *d;
        const uint8_t *blk;
        const float *bias;
        hl = PyTuple_GET_ITEM(head, 0);
        PyObject *x = PyTuple_GET_ITEM(head, 1);
        if (smoe_py_linear_parts(hl, &d, &blk, &bias) ||
            (hb = smoe_py_f32_or_bf16(x, "head x", 2, 0)) < 0)
            goto fail;
        npy_intp w_x[2] = {1, d->K};
        if (dims_are(x, "head x [1, K]", w_x, 2)) goto fail;
        hx = PyArray_DATA((PyArrayObject *)x);
        hn = d->N;
        if (!(lbuf = malloc((size_t)hn * sizeof(float)))) goto nomem;
    }
    self->keep = Py_BuildValue("(OOOOO)", calls, rows, embed, norm, head);
    if (!self->keep) goto fail;
    self->n = n;
    self->it = it;
    self->nrows = nr;
    self->rows = rv;
    self->embed = er;
    self->norm_x = nx;
    self->norm_out = no;
    self->norm_w = nw;
    self->norm_eps = neps;
    self->nb = nb;
    self->norm_bf16 = nbf;
    self->norm_n = nn;
    self->norm_buf = nbuf;
    self->head = hl;
    self->head_x = hx;
    self->hb = hb;
    self->head_n = hn;
    self->logit_buf = lbuf;
    return 0;
nomem:
    PyErr_NoMemory();
fail:
    free(it);
    free(rv);
    free(nbuf);
    free(lbuf);
    return -1;
}

/* step(token, S, logits[, argmax]): the method doc. */
static PyObject *dp_step(DecodePlanObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (!self->keep) {
        PyErr_SetString(PyExc_ValueError, "DecodePlan is not initialised");
        return NULL;
    }
    if (nargs != 3 && nargs != 4) {
        PyErr_Format(PyExc_TypeError, "step(token, S, logits[, argmax]) takes 3 or 4 "
                     "arguments, got %zd", nargs);
        return NULL;
    }
    long long tok = PyLong_AsLongLong(args[0]), S = PyLong_AsLongLong(args[1]);
    if (PyErr_Occurred()) return NULL;
    const int am = nargs == 4 ? PyObject_IsTrue(args[3]) : 0;
    if (am < 0) return NULL;
    if (am && !self->head) {
        PyErr_SetString(PyExc_ValueError, "DecodePlan.step: argmax needs a head");
        return NULL;
    }
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "DecodePlan.step: a step of this plan is already "
                        "running (one at a time: its buffers are shared)");
        return NULL;
    }
    if (self->embed.table && (tok < 0 || tok >= (long long)self->embed.rows)) {
        PyErr_Format(PyExc_ValueError, "DecodePlan.step: token %lld outside [0, %zd)", tok,
                     (Py_ssize_t)self->embed.rows);
        return NULL;
    }
    if (S < 0) {
        PyErr_Format(PyExc_ValueError, "DecodePlan.step: S=%lld cached positions", S);
        return NULL;
    }
    for (Py_ssize_t i = 0; i < self->nrows; i++)
        if (S >= (long long)self->rows[i].rows) {
            PyErr_Format(PyExc_ValueError, "DecodePlan.step: position %lld outside its rotary "
                         "table of %zd rows", S, (Py_ssize_t)self->rows[i].rows);
            return NULL;
        }
    for (Py_ssize_t i = 0; i < self->n; i++) {
        const chain_item *c = &self->it[i];
        long long cap = c->mla ? (long long)c->u.ml.a.cap : (long long)c->u.ab.cap;
        long long nt = c->mla ? (long long)c->u.ml.a.nt : (long long)c->u.ab.nt;
        if (S + nt > cap) {
            PyErr_Format(PyExc_ValueError, "DecodePlan.step: S=%lld cached + %lld new positions "
                         "do not fit layer call %zd's KV capacity of %lld", S, nt, i, cap);
            return NULL;
        }
    }
    void *lp = NULL;
    int lb = 0;
    smoe_kctx *hc = NULL;
    if (self->head) {
        lb = smoe_py_f32_or_bf16(args[2], "logits", 2, 1);
        if (lb < 0) return NULL;
        npy_intp w_l[2] = {1, self->head_n};
        if (dims_are(args[2], "logits [1, vocab]", w_l, 2)) return NULL;
        lp = PyArray_DATA((PyArrayObject *)args[2]);
        if (lp == self->head_x) {
            PyErr_SetString(PyExc_ValueError, "DecodePlan.step: logits must not alias the "
                            "head's input");
            return NULL;
        }
        if (!(hc = smoe_py_linear_kctx(self->head))) return NULL;
    } else if (args[2] != Py_None) {
        PyErr_SetString(PyExc_ValueError, "DecodePlan.step: logits must be None without a head");
        return NULL;
    }
    self->busy = 1; /* from here to the end: the items are this step's */
    for (Py_ssize_t i = 0; i < self->n; i++) {
        chain_item *c = &self->it[i];
        if (c->mla)
            c->u.ml.a.S = (uint32_t)S;
        else
            c->u.ab.S = S;
        if (chain_item_begin(c)) {
            chain_end(self->it, i);
            self->busy = 0;
            return NULL;
        }
    }
    smoe_err err;
    smoe_err_clear(&err);
    int rc = SMOE_OK;
    double t[4] = {0, 0, 0, 0};
    long long best = -1;
    /* logits stays referenced by the caller's frame for the call */
    Py_BEGIN_ALLOW_THREADS
    const plan_row *e = &self->embed;
    if (e->table) memcpy(e->dst, e->table + (size_t)tok * e->row_bytes, e->row_bytes);
    for (Py_ssize_t i = 0; i < self->nrows; i++) {
        const plan_row *r = &self->rows[i];
        memcpy(r->dst, r->table + (size_t)S * r->row_bytes, r->row_bytes);
    }
    rc = chain_exec(self->it, self->n, t, &err);
    double t0 = smoe_now();
    if (rc == SMOE_OK && self->norm_x)
        rms_norm_row(self->norm_x, self->norm_out, self->nb, self->norm_w, self->norm_eps,
                     self->norm_bf16, self->norm_buf, self->norm_n);
    if (rc == SMOE_OK && self->head)
        rc = smoe_py_linear_run(self->head, hc, self->head_x, self->hb, 1, lp, lb, &err);
    t[3] = smoe_now() - t0;
    if (rc == SMOE_OK && am) { /* the greedy token of the logits as they are (bf16 rounded) */
        const float *row = (const float *)lp;
        if (lb) {
            widen(self->logit_buf, lp, lb, self->head_n);
            row = self->logit_buf;
        }
        best = smoe_spec_argmax(row, self->head_n);
    }
    Py_END_ALLOW_THREADS
    self->busy = 0;
    chain_end(self->it, self->n);
    if (rc != 0) return smoe_py_raise(&err);
    return Py_BuildValue("(ddddL)", t[0], t[1], t[2], t[3], best);
}

static PyMethodDef dp_methods[] = {
    {"step", (PyCFunction)(void (*)(void))dp_step, METH_FASTCALL,
     "step(token, S, logits, argmax=False) -> (attention_s, moe_s, dense_mlp_s, head_s, "
     "next): one decode step of the plan with the GIL released once: the embedding's row "
     "`token` into the first layer's x, every rotary table's row S into its row, the layer "
     "calls at S cached positions (as layer_chain: each writes its new KV position S), the "
     "final norm, and the head into logits [1, vocab] (float32 or bf16 bits; None without a "
     "head).  Checks first (token, S against the tables and every KV capacity): a bad "
     "argument raises before anything runs; a failing layer stops the step and raises.  One "
     "step of a plan at a time.  Returns the seconds in the layers' attention parts, MoE "
     "blocks, dense MLPs, and the norm and head, for benchmarks, and with argmax the greedy "
     "next token (the lowest id of the largest logit, as specmoe.speculation.verify.accept reads the "
     "logits; -1 without argmax)."},
    {NULL, NULL, 0, NULL}};

static PyTypeObject DecodePlanType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "specmoe._C.DecodePlan",
    .tp_basicsize = sizeof(DecodePlanObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "DecodePlan(calls, rows=None, embed=None, norm=None, head=None): a one-token "
              "decode step of a whole model in one call (specmoe.models.decode_step).  calls: "
              "layer_chain's (block, layer() arguments) items, checked once, each with no "
              "attention bias (its S is step()'s); rows: (table, row) pairs, table [P, ...] "
              "C-contiguous and row one of its rows' worth (the rotary arrays the calls read), "
              "copied from row S at each step; embed: (table [vocab, hidden], x) or None, row "
              "`token` copied into x (the first call's input); norm: (x, w, eps, out, bf16) as "
              "rms_norm's over x [1, n], or None; head: (linear, x), a _C.Linear run on x "
              "[1, K] into step()'s logits, or None.  Every array is referenced, not copied: "
              "the plan reads and writes them in place.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)dp_init,
    .tp_dealloc = (destructor)dp_dealloc,
    .tp_methods = dp_methods,
};

static PyMethodDef attn_functions[] = {
    {"layer_chain", (PyCFunction)(void (*)(void))py_layer_chain, METH_FASTCALL,
     "layer_chain(calls) -> (attention_s, moe_s): decoder layers one after another, the GIL "
     "released once.  calls: a tuple of (block, args), block an AttnBlock or MLABlock and "
     "args the tuple of its layer() arguments (one layer's out is typically the next one's "
     "x).  Every call is checked first: a bad one raises before any layer runs.  A layer "
     "failing stops the chain and raises (the layers before it have run: their KV positions "
     "and outputs are written).  Returns the time in the layers' attention parts, MoE blocks "
     "and dense MLPs (MLABlock.layer(None, ...)), summed.  At most 128 layers."},
    {"rms_norm", (PyCFunction)(void (*)(void))py_rms_norm, METH_FASTCALL,
     "rms_norm(x, w, eps, out, bf16): out = w * x * rsqrt(mean(x^2) + eps) per row of x [T, n] "
     "(float32 or bf16 bits; out the same dtype and shape), w float32 [n]; bf16: round as a "
     "bf16 model's RMSNorm does (csrc/kernels/block.h).  For decode-sized inputs."},
    {NULL, NULL, 0, NULL}};

int smoe_py_attn_init(PyObject *m) {
    PyTypeObject *types[] = {&MLADecodeType, &AttnDecodeType, &AttnBlockType, &MLABlockType,
                             &DecodePlanType};
    for (size_t i = 0; i < sizeof types / sizeof *types; i++) /* named by their tp_name */
        if (PyModule_AddType(m, types[i]) < 0) return -1;
    return PyModule_AddFunctions(m, attn_functions);
}

/* Python binding of the decode-attention kernels: specmoe._C.MLADecode, one object per MLA
 * attention module decoded in the absorbed form (specmoe.models.mla); specmoe._C.AttnDecode (the
 * models' own multi-head attention, specmoe.models.attention); specmoe._C.AttnBlock, a whole
 * Llama-family attention module (projections, q/k norms, rotary, attention, output projection)
 * in two calls around transformers' KV-cache update, or with its decoder layer (norms, residual
 * adds, the MoE block through a _C.Layers) in one (specmoe.models.attention).  The block's state
 * and compute are plain C (csrc/decoder.h, csrc/attn_block.c); MLABlock, layer_chain and
 * DecodePlan are in py_decode.c.  Weights are checked and referenced once at construction; the
 * per-token calls (METH_FASTCALL) check the arrays' shapes and run the kernels without the
 * GIL. */
#include <math.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/attn.h"
#include "py_attn.h"
#include "py_kernels.h"
#include "py_layer.h"
#include "py_numpy.h"

typedef struct {
    PyObject_HEAD
    PyObject *ctx_obj;  /* the KernelContext (strong reference) */
    PyObject *w_uk_obj; /* [H, dn, r] float32, uint16 (bf16 bits) or int8 (int8 or int4
                           values); GGUF blocks: uint8 [H, r, bytes a row]; strong, never
                           written */
    PyObject *w_uv_obj; /* [H, dv, r], same dtype; GGUF blocks: uint8 [H, dv, bytes a row] */
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

/* GGUF block weights (blocks=(uk dtype, uv dtype)): uint8 [H, r, row bytes] attn_k_b and
 * [H, dv, row bytes] attn_v_b into d's shapes and dtypes (checked by smoe_mla_desc_check). */
static int block_weights(PyObject *uk_o, PyObject *uv_o, int kdt, int vdt, smoe_mla_desc *d) {
    PyArrayObject *uk = smoe_py_want_array(uk_o, "w_uk", NPY_UINT8, 3, 0);
    PyArrayObject *uv = uk ? smoe_py_want_array(uv_o, "w_uv", NPY_UINT8, 3, 0) : NULL;
    if (!uv) return -1;
    const int ok = smoe_wdt_is_block(kdt) && smoe_wdt_is_block(vdt);
    const npy_intp kb = ok ? smoe_wdt_block_bytes(kdt) : 1, vb = ok ? smoe_wdt_block_bytes(vdt) : 1;
    const npy_intp dn = PyArray_DIM(uk, 2) / kb * (ok ? smoe_wdt_block_cols(kdt) : 0);
    const npy_intp cols = PyArray_DIM(uv, 2) / vb * (ok ? smoe_wdt_block_cols(vdt) : 0);
    if (!ok || PyArray_DIM(uk, 0) != PyArray_DIM(uv, 0) || PyArray_DIM(uk, 2) % kb ||
        PyArray_DIM(uv, 2) % vb || cols != PyArray_DIM(uk, 1) || PyArray_DIM(uk, 0) > 65536 ||
        PyArray_DIM(uk, 1) > 65536 || PyArray_DIM(uv, 1) > 65536 || dn > 65536) {
        PyErr_SetString(PyExc_ValueError, "MLADecode blocks: w_uk [H, r, row bytes] and w_uv "
                        "[H, dv, row bytes] of whole blocks of two GGUF block dtypes, w_uv's "
                        "rows r columns");
        return -1;
    }
    d->H = (uint32_t)PyArray_DIM(uk, 0);
    d->r = (uint32_t)PyArray_DIM(uk, 1);
    d->dn = (uint32_t)dn;
    d->dv = (uint32_t)PyArray_DIM(uv, 1);
    d->wdtype = kdt;
    d->uv_dtype = vdt;
    return 0;
}

/* f32 / bf16 / int8 / int4 weights (with their scales) into d's shapes and dtype. */
static int plain_weights(PyObject *uk_o, PyObject *uv_o, PyObject *uks_o, PyObject *uvs_o,
                         smoe_mla_desc *d) {
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
    npy_intp r = PyArray_DIM(uk, 2);
    npy_intp dims[4] = {PyArray_DIM(uk, 0), PyArray_DIM(uk, 1), PyArray_DIM(uv, 1), r};
    for (int i = 0; i < 4; i++)
        if (dims[i] > 65536) {
            PyErr_SetString(PyExc_ValueError, "MLADecode: a weight dimension exceeds 65536");
            return -1;
        }
    d->H = (uint32_t)dims[0];
    d->dn = (uint32_t)dims[1];
    d->dv = (uint32_t)dims[2];
    d->r = (uint32_t)dims[3];
    d->wdtype = wk;
    if (wk == SMOE_WDT_I4) {
        npy_intp g = PyArray_DIM((PyArrayObject *)uks_o, 2);
        if (g != PyArray_DIM((PyArrayObject *)uvs_o, 2) || g < 1 || r % g) {
            PyErr_SetString(PyExc_ValueError,
                            "uk_scale and uv_scale must have the same number of groups, "
                            "dividing kv_lora_rank");
            return -1;
        }
        d->group = (uint32_t)(r / g);
    }
    return 0;
}

static int mla_init(MLADecodeObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"ctx", "w_uk", "w_uv", "rope_dim", "scale", "uk_scale",
                             "uv_scale", "blocks", NULL};
    PyObject *ctx_o, *uk_o, *uv_o, *uks_o = Py_None, *uvs_o = Py_None, *blk_o = Py_None;
    unsigned int dr;
    float scale;
    int kdt = -1, vdt = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOIf|OOO:MLADecode", kwlist, &ctx_o, &uk_o,
                                     &uv_o, &dr, &scale, &uks_o, &uvs_o, &blk_o))
        return -1;
    if (self->ready) {
        PyErr_SetString(PyExc_RuntimeError, "MLADecode is already initialised");
        return -1;
    }
    if (!smoe_py_kctx(ctx_o)) return -1;
    if (blk_o != Py_None &&
        (!PyTuple_Check(blk_o) || !PyArg_ParseTuple(blk_o, "ii", &kdt, &vdt))) {
        PyErr_Clear();
        PyErr_SetString(PyExc_TypeError, "blocks must be (uk dtype code, uv dtype code)");
        return -1;
    }
    if (blk_o != Py_None && (uks_o != Py_None || uvs_o != Py_None)) {
        PyErr_SetString(PyExc_ValueError, "GGUF block weights take no scales");
        return -1;
    }
    smoe_mla_desc d;
    memset(&d, 0, sizeof d);
    if (blk_o != Py_None ? block_weights(uk_o, uv_o, kdt, vdt, &d)
                         : plain_weights(uk_o, uv_o, uks_o, uvs_o, &d))
        return -1;
    d.dr = dr;
    d.scale = scale;
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
    PyArrayObject *uk = (PyArrayObject *)uk_o, *uv = (PyArrayObject *)uv_o;
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
    if (d.wdtype == SMOE_WDT_I8 || d.wdtype == SMOE_WDT_I4) {
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

/* forward(q_nope, q_pe, ckv, kpe, bias, out); shapes in the method doc. */
static PyObject *mla_forward(MLADecodeObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (smoe_py_method_start(self->ready, "MLADecode",
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
    if (smoe_py_dims_are(args[0], "q_nope [B, H, T, qk_nope_head_dim]", w_qn, 4) ||
        smoe_py_dims_are(args[1], "q_pe [B, H, T, qk_rope_head_dim]", w_qp, 4) ||
        smoe_py_dims_are(args[2], "ckv [B, S, kv_lora_rank]", w_c, 3) ||
        smoe_py_dims_are(args[3], "kpe [B, S, qk_rope_head_dim]", w_k, 3) ||
        smoe_py_dims_are(args[5], "out [B, T, heads * v_head_dim]", w_o, 3))
        return NULL;
    if (B < 1 || T < 1 || S < 1 || B > 65536 || T > 65536 || S > (npy_intp)UINT32_MAX / 2) {
        PyErr_Format(PyExc_ValueError, "MLADecode: B=%zd T=%zd S=%zd out of range",
                     (Py_ssize_t)B, (Py_ssize_t)T, (Py_ssize_t)S);
        return NULL;
    }
    const float *bias;
    uint32_t bias_rows;
    if (smoe_py_bias_arg(args[4], B, T, S, &bias, &bias_rows)) return NULL;
    smoe_kctx *c = smoe_py_kctx(self->ctx_obj);
    if (!c) return NULL;
    size_t need = smoe_mla_scratch_bytes(c, d, (uint32_t)T);
    smoe_err err;
    smoe_err_clear(&err);
    int rc = SMOE_OK;
    /* the arrays stay referenced by the caller's frame for the whole call; weights by self */
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->mu);
    rc = smoe_grow_scratch(&self->scratch, &self->scratch_cap, need, &err);
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
    static const char *names[] = {"f32",  "bf16", "int8", "int4",   "int2", "q8_0", "q4_k", "q6_k",
                                  "q4_0", "q5_k", "iq4_xs", "q4_1", "q2_k", "q3_k", "mxfp4"};
    const int32_t uv = smoe_wdt_is_block(self->d.wdtype) ? self->d.uv_dtype : self->d.wdtype;
    return Py_BuildValue("{sIsIsIsIsIsssssI}", "heads", self->d.H, "qk_nope_head_dim",
                         self->d.dn, "qk_rope_head_dim", self->d.dr, "v_head_dim", self->d.dv,
                         "kv_lora_rank", self->d.r, "dtype", names[self->d.wdtype], "uv_dtype",
                         names[uv], "group", self->d.group);
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
    .tp_doc = "MLADecode(ctx, w_uk, w_uv, rope_dim, scale, uk_scale=None, uv_scale=None, "
              "blocks=None): multi-head latent attention in the absorbed form for decode-sized "
              "inputs; w_uk [H, dn, r] and w_uv [H, dv, r] float32, uint16 (bf16 bits) or int8 "
              "(scales float32 [H, rows]) or int4 values in int8 (specmoe.models.mla.int4_values; "
              "scales float32 [H, rows, r / group]); or blocks=(uk dtype code, uv dtype code): "
              "GGUF attn_k_b uint8 [H, r, row bytes] and attn_v_b [H, dv, row bytes] as the file "
              "holds them; C-contiguous, kept referenced.",
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

/* forward(q, k, v, bias, out, scale[, sinks]); shapes in the method doc. */
static PyObject *ad_forward(AttnDecodeObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (smoe_py_method_start(self->ready, "AttnDecode",
                     "forward(q, k, v, bias, out, scale[, sinks])", nargs, 6, 7))
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
    if (smoe_py_dims_are(args[1], "k [B, kv_heads, S, D]", w_k, 4) ||
        smoe_py_dims_are(args[2], "v [B, kv_heads, S, D]", w_k, 4) ||
        smoe_py_dims_are(args[4], "out [B, T, heads, D]", w_o, 4))
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
    if (smoe_py_bias_arg(args[3], B, T, S, &bias, &bias_rows)) return NULL;
    const float *sinks = NULL;
    if (nargs == 7 && args[6] != Py_None) {
        PyArrayObject *sk = smoe_py_want_array(args[6], "sinks", NPY_FLOAT32, 1, 0);
        if (!sk) return NULL;
        if (PyArray_DIM(sk, 0) != H) {
            PyErr_Format(PyExc_ValueError, "AttnDecode: sinks has %zd entries, not heads=%zd",
                         (Py_ssize_t)PyArray_DIM(sk, 0), (Py_ssize_t)H);
            return NULL;
        }
        sinks = (const float *)PyArray_DATA(sk);
        for (npy_intp h = 0; h < H; h++)
            if (!isfinite(sinks[h])) {
                PyErr_SetString(PyExc_ValueError, "AttnDecode: sinks must be finite");
                return NULL;
            }
    }
    smoe_kctx *c = smoe_py_kctx(self->ctx_obj);
    if (!c) return NULL;
    smoe_mha_desc d = {(uint32_t)H, (uint32_t)Hkv, (uint32_t)D, (float)scale, sinks};
    size_t need = smoe_mha_scratch_bytes(c, (uint32_t)D, (uint32_t)T);
    smoe_err err;
    smoe_err_clear(&err);
    int rc = SMOE_OK;
    Py_BEGIN_ALLOW_THREADS
    pthread_mutex_lock(&self->mu);
    rc = smoe_grow_scratch(&self->scratch, &self->scratch_cap, need, &err);
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
     "forward(q, k, v, bias, out, scale[, sinks]): attention at decode sizes "
     "(csrc/kernels/attn.h). q float32 [B, H, T, D] C-contiguous; k, v [B, Hkv, S, D] float32 "
     "or uint16 (bf16 bits), same dtype and strides, each [S, D] block dense; bias float32 [1 "
     "or B, T, S] additive or None; out float32 [B, T, H, D], overwritten; sinks float32 [H] "
     "(finite; GPT-OSS's attention sinks) or None; GIL released."},
    {NULL, NULL, 0, NULL}};

/* ---- AttnBlock: a decoder layer's whole attention module at decode sizes ---- */

static PyTypeObject AttnBlockType;

typedef struct {
    PyObject_HEAD
    PyObject *ctx_obj;         /* the KernelContext (strong reference) */
    PyObject *lin_obj[5];      /* q, k, v, o projections and optionally q|k|v in one:
                                  specmoe._C.Linear (strong; [4] may be NULL); blk borrows
                                  their descriptors, blocks and biases */
    PyObject *qn_obj, *kn_obj; /* float32 q_norm / k_norm weights or NULL (strong; blk
                                  borrows their data) */
    PyObject *sinks_obj;       /* float32 [heads] attention sinks or NULL (strong; borrowed) */
    PyObject *mlp_obj;         /* set_mlp's (gate, up, down) tuple of _C.Linear (strong) or
                                  NULL, whose parts blk.mlp borrows; changed under the GIL */
    smoe_attn_block blk;       /* the C state (csrc/decoder.h): dims, buffers, its mutex */
    int ready;
} AttnBlockObject;

static int ab_init(AttnBlockObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"ctx", "q", "k", "v", "o", "heads", "kv_heads", "head_dim",
                             "norm", "q_norm", "k_norm", "eps", "bf16", "max_tokens", "qkv",
                             "gate", "rotary_dim", "zero_centred", "sinks", "rope", NULL};
    PyObject *ctx_o, *lin[5] = {NULL, NULL, NULL, NULL, Py_None}, *qn_o = Py_None,
             *kn_o = Py_None, *sk_o = Py_None;
    unsigned int H, Hkv, D, max_tokens = 16, rot = 0;
    const char *norm = "none", *rope = "half";
    double eps = 1e-6;
    int bf16 = 0, gate = 0, zc = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOIII|sOOdpIOpIpOs:AttnBlock", kwlist,
                                     &ctx_o, &lin[0], &lin[1], &lin[2], &lin[3], &H, &Hkv, &D,
                                     &norm, &qn_o, &kn_o, &eps, &bf16, &max_tokens, &lin[4],
                                     &gate, &rot, &zc, &sk_o, &rope))
        return -1;
    if (self->ready) {
        PyErr_SetString(PyExc_RuntimeError, "AttnBlock is already initialised");
        return -1;
    }
    if (!smoe_py_kctx(ctx_o)) return -1;
    smoe_attn_block_cfg cfg;
    memset(&cfg, 0, sizeof cfg);
    const int nlin = lin[4] == Py_None ? 4 : 5;
    for (int i = 0; i < nlin; i++)
        if (smoe_py_linear_parts(lin[i], &cfg.ld[i], &cfg.lb[i], &cfg.lbias[i])) return -1;
    int nk = smoe_qknorm_kind(norm);
    if (nk < 0) {
        PyErr_Format(PyExc_ValueError, "AttnBlock: norm must be 'none', 'full' or 'head', got '%s'",
                     norm);
        return -1;
    }
    cfg.H = H;
    cfg.Hkv = Hkv;
    cfg.D = D;
    cfg.max_tokens = max_tokens;
    cfg.norm = nk;
    cfg.eps = eps;
    cfg.bf16 = bf16;
    cfg.gate = gate;
    cfg.rot = rot;
    cfg.zc = zc;
    if (strcmp(rope, "half") && strcmp(rope, "pairs")) {
        PyErr_Format(PyExc_ValueError, "AttnBlock: rope must be 'half' or 'pairs', got '%s'",
                     rope);
        return -1;
    }
    cfg.pairs = !strcmp(rope, "pairs");
    if (sk_o != Py_None) { /* GPT-OSS's attention sinks: float32 [heads] */
        PyArrayObject *a = smoe_py_want_array(sk_o, "sinks", NPY_FLOAT32, 1, 0);
        if (!a) return -1;
        if (PyArray_DIM(a, 0) != (npy_intp)H) {
            PyErr_Format(PyExc_ValueError, "AttnBlock: sinks has %zd values, expected heads=%u",
                         (Py_ssize_t)PyArray_DIM(a, 0), H);
            return -1;
        }
        cfg.sinks = (const float *)PyArray_DATA(a);
    }
    smoe_err err;
    smoe_err_clear(&err);
    if (smoe_attn_block_check(&cfg, &err)) return smoe_py_block_init_raise(&err);
    PyObject *nw[2] = {qn_o, kn_o};
    const npy_intp nlen[2] = {nk == SMOE_QKNORM_HEAD ? (npy_intp)D : (npy_intp)H * D,
                              nk == SMOE_QKNORM_HEAD ? (npy_intp)D : (npy_intp)Hkv * D};
    const float *nd[2] = {NULL, NULL};
    for (int i = 0; i < 2; i++) {
        if (nk == SMOE_QKNORM_NONE) {
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
        nd[i] = (const float *)PyArray_DATA(a);
    }
    cfg.qn = nd[0];
    cfg.kn = nd[1];
    if (smoe_attn_block_init(&self->blk, &cfg, &err)) return smoe_py_block_init_raise(&err);
    Py_INCREF(ctx_o);
    self->ctx_obj = ctx_o;
    for (int i = 0; i < nlin; i++) {
        Py_INCREF(lin[i]);
        self->lin_obj[i] = lin[i];
    }
    if (cfg.sinks) {
        Py_INCREF(sk_o);
        self->sinks_obj = sk_o;
    }
    if (nk != SMOE_QKNORM_NONE) {
        Py_INCREF(qn_o);
        Py_INCREF(kn_o);
        self->qn_obj = qn_o;
        self->kn_obj = kn_o;
    }
    self->ready = 1;
    return 0;
}

static void ab_dealloc(AttnBlockObject *self) {
    smoe_attn_block_destroy(&self->blk);
    Py_XDECREF(self->ctx_obj);
    for (int i = 0; i < 5; i++) Py_XDECREF(self->lin_obj[i]);
    Py_XDECREF(self->qn_obj);
    Py_XDECREF(self->kn_obj);
    Py_XDECREF(self->sinks_obj);
    Py_XDECREF(self->mlp_obj);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* x, cos, sin of pre/layer: x [T, hidden], cos and sin [T, rotary_dim], float32 or bf16 bits;
 * *T from x (1..max_tokens; pre: every row's tokens, B * T); *xb, *cb, *sb: 1 for bf16.  -1
 * with an error otherwise. */
static int block_inputs(const smoe_attn_block *b, PyObject *x, PyObject *cos, PyObject *sin,
                        npy_intp *T, int *xb, int *cb, int *sb) {
    if ((*xb = smoe_py_f32_or_bf16(x, "x", 2, 0)) < 0 ||
        (*cb = smoe_py_f32_or_bf16(cos, "cos", 2, 0)) < 0 ||
        (*sb = smoe_py_f32_or_bf16(sin, "sin", 2, 0)) < 0)
        return -1;
    *T = PyArray_DIM((PyArrayObject *)x, 0);
    if (*T < 1 || *T > (npy_intp)b->max_tokens) {
        PyErr_Format(PyExc_ValueError, "AttnBlock: %zd tokens, expected 1..%u (max_tokens)",
                     (Py_ssize_t)*T, b->max_tokens);
        return -1;
    }
    npy_intp w_x[2] = {*T, b->hidden}, w_cs[2] = {*T, b->rot};
    return smoe_py_dims_are(x, "x [T, hidden]", w_x, 2) ||
                   smoe_py_dims_are(cos, "cos [T, rotary_dim]", w_cs, 2) ||
                   smoe_py_dims_are(sin, "sin [T, rotary_dim]", w_cs, 2)
               ? -1
               : 0;
}

/* pre(x, cos, sin, q, k, v[, ln, ln_eps]): the input RMSNorm (when ln is given), projections,
 * q/k norms and rotary embedding of B rows of T tokens, B from q (smoe_attn_block_pre). */
static PyObject *ab_pre(AttnBlockObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (smoe_py_method_start(self->ready, "AttnBlock",
                     "pre(x, cos, sin, q, k, v[, ln, ln_eps])", nargs, 6, 8))
        return NULL;
    smoe_attn_block *b = &self->blk;
    const uint32_t H = b->H, Hkv = b->Hkv, D = b->D, hid = b->hidden;
    npy_intp BT;
    int xb, cb, sb;
    if (block_inputs(b, args[0], args[1], args[2], &BT, &xb, &cb, &sb)) return NULL;
    PyArrayObject *qo = smoe_py_want_array(args[3], "q", NPY_FLOAT32, 4, 1);
    if (!qo) return NULL;
    int kb = smoe_py_f32_or_bf16(args[4], "k", 4, 1), vb = smoe_py_f32_or_bf16(args[5], "v", 4, 1);
    if (kb < 0 || vb < 0) return NULL;
    const npy_intp B = PyArray_DIM(qo, 0);
    if (B < 1 || BT % B) {
        PyErr_Format(PyExc_ValueError, "AttnBlock.pre: q has %zd rows, x %zd tokens: x must be "
                     "[rows * T, hidden]", (Py_ssize_t)B, (Py_ssize_t)BT);
        return NULL;
    }
    const npy_intp T = BT / B;
    npy_intp w_q[4] = {B, H, T, D}, w_kv[4] = {B, Hkv, T, D};
    if (smoe_py_dims_are(args[3], "q [rows, heads, T, head_dim]", w_q, 4) ||
        smoe_py_dims_are(args[4], "k [rows, kv_heads, T, head_dim]", w_kv, 4) ||
        smoe_py_dims_are(args[5], "v [rows, kv_heads, T, head_dim]", w_kv, 4))
        return NULL;
    const float *ln = NULL;
    float ln_eps = 0.0f;
    if (nargs == 8 && smoe_py_norm_arg(args[6], args[7], hid, &ln, &ln_eps)) return NULL;
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
    rc = smoe_attn_block_pre(b, c, xp, xb, cp, cb, sp, sb, (uint32_t)B, (uint32_t)T, ln, ln_eps,
                             qp, kp, kb, vp, vb, (size_t)Hkv * T * D, (size_t)T * D, &err);
    Py_END_ALLOW_THREADS
    if (rc != 0) return smoe_py_raise(&err);
    Py_RETURN_NONE;
}

/* post(q, k, v, bias, scale, out[, resid, ln, ln_eps, normed]): attention over the cache, the
 * output projection, and with resid the residual add and the post-attention RMSNorm
 * (smoe_attn_block_post). */
static PyObject *ab_post(AttnBlockObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (smoe_py_method_start(self->ready, "AttnBlock",
                     "post(q, k, v, bias, scale, out[, resid, ln, ln_eps, normed])", nargs, 6, 10))
        return NULL;
    smoe_attn_block *b = &self->blk;
    const uint32_t H = b->H, Hkv = b->Hkv, D = b->D, hid = b->hidden;
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
    npy_intp B = PyArray_DIM(q, 0), T = PyArray_DIM(q, 2);
    npy_intp S = PyArray_DIM((PyArrayObject *)args[1], 2);
    if (B < 1 || T < 1 || B * T > (npy_intp)b->max_tokens || S < 1 ||
        S > (npy_intp)UINT32_MAX / 2) {
        PyErr_Format(PyExc_ValueError, "AttnBlock: %zd rows of T=%zd tokens (1..%u in all), "
                     "S=%zd positions", (Py_ssize_t)B, (Py_ssize_t)T, b->max_tokens,
                     (Py_ssize_t)S);
        return NULL;
    }
    npy_intp w_q[4] = {B, H, T, D}, w_kv[4] = {B, Hkv, S, D}, w_o[2] = {B * T, hid};
    if (smoe_py_dims_are(args[0], "q [rows, heads, T, head_dim]", w_q, 4) ||
        smoe_py_dims_are(args[1], "k [rows, kv_heads, S, head_dim]", w_kv, 4) ||
        smoe_py_dims_are(args[2], "v [rows, kv_heads, S, head_dim]", w_kv, 4) ||
        smoe_py_dims_are(args[5], "out [rows * T, hidden]", w_o, 2))
        return NULL;
    if (kdt != vdt || kbs != vbs || khs != vhs) {
        PyErr_SetString(PyExc_ValueError, "k and v must have the same dtype and layout");
        return NULL;
    }
    const float *bias;
    uint32_t bias_rows;
    if (smoe_py_bias_arg(args[3], (uint32_t)B, T, S, &bias, &bias_rows)) return NULL;
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
        if (smoe_py_dims_are(args[6], "resid [rows * T, hidden]", w_o, 2) ||
            smoe_py_dims_are(args[9], "normed [rows * T, hidden]", w_o, 2) ||
            smoe_py_norm_arg(args[7], args[8], hid, &ln, &ln_eps))
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
    void *op = PyArray_DATA((PyArrayObject *)args[5]);
    smoe_err err;
    smoe_err_clear(&err);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = smoe_attn_block_post(b, c, (const float *)PyArray_DATA(q),
                              PyArray_DATA((PyArrayObject *)args[1]),
                              PyArray_DATA((PyArrayObject *)args[2]), kdt, (size_t)kbs,
                              (size_t)khs, (uint32_t)B, (uint32_t)T, (uint32_t)S, bias,
                              bias_rows,
                              (float)scale, op, ob, rp, ln, ln_eps, np_, &err);
    Py_END_ALLOW_THREADS
    if (rc != 0) return smoe_py_raise(&err);
    Py_RETURN_NONE;
}

int smoe_py_is_attn_block(PyObject *o) { return PyObject_TypeCheck(o, &AttnBlockType); }

/* layer(layers, pos, route_flags, x, cos, sin, kbuf, vbuf, S, bias, scale, ln1, eps1, ln2, eps2,
 * out): check the 16 arguments (the method doc) into *a.  Takes no lock and begins nothing:
 * the layer call (py_decode.c) begins the _C.Layers after. */
int smoe_py_attn_layer_parse(PyObject *blk, PyObject *const *args, Py_ssize_t nargs,
                             smoe_attn_layer_args *a, smoe_attn_block **bp, smoe_kctx **cp) {
    AttnBlockObject *self = (AttnBlockObject *)blk;
    if (smoe_py_method_start(self->ready, "AttnBlock",
                     "layer(layers, pos, route_flags, x, cos, sin, kbuf, vbuf, S, bias, scale, "
                     "ln1, eps1, ln2, eps2, out)",
                     nargs, 16, 16))
        return -1;
    const smoe_attn_block *b = &self->blk;
    const uint32_t Hkv = b->Hkv, D = b->D, hid = b->hidden;
    long pos = PyLong_AsLong(args[1]);
    long long S = PyLong_AsLongLong(args[8]);
    double scale = PyFloat_AsDouble(args[10]);
    if (PyErr_Occurred()) return -1;
    if (smoe_py_route_flags(args[2], &a->flags)) return -1;
    npy_intp BT;
    if (block_inputs(b, args[3], args[4], args[5], &BT, &a->xb, &a->cb, &a->sb)) return -1;
    a->kb = smoe_py_f32_or_bf16(args[6], "kbuf", 4, 1);
    int vb = smoe_py_f32_or_bf16(args[7], "vbuf", 4, 1);
    if (a->kb < 0 || vb < 0) return -1;
    const npy_intp B = PyArray_DIM((PyArrayObject *)args[6], 0);
    if (B < 1 || BT % B) {
        PyErr_Format(PyExc_ValueError, "layer: kbuf has %zd rows, x %zd tokens: x must be "
                     "[rows * T, hidden]", (Py_ssize_t)B, (Py_ssize_t)BT);
        return -1;
    }
    const npy_intp T = BT / B;
    npy_intp cap = PyArray_DIM((PyArrayObject *)args[6], 2);
    npy_intp w_kv[4] = {B, Hkv, cap, D}, w_o[2] = {BT, hid};
    if (smoe_py_dims_are(args[6], "kbuf [rows, kv_heads, capacity, head_dim]", w_kv, 4) ||
        smoe_py_dims_are(args[7], "vbuf [rows, kv_heads, capacity, head_dim]", w_kv, 4))
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
    if (smoe_py_bias_arg(args[9], B, T, (npy_intp)S + T, &a->bias, &a->bias_rows)) return -1;
    if (smoe_py_norm_arg(args[11], args[12], hid, &a->ln1, &a->eps1) ||
        smoe_py_norm_arg(args[13], args[14], hid, &a->ln2, &a->eps2))
        return -1;
    a->ob = smoe_py_f32_or_bf16(args[15], "out", 2, 1);
    if (a->ob < 0 || smoe_py_dims_are(args[15], "out [rows * T, hidden]", w_o, 2)) return -1;
    if (a->ob != a->xb) {
        PyErr_SetString(PyExc_ValueError, "x and out must have the same dtype");
        return -1;
    }
    if (PyArray_DATA((PyArrayObject *)args[15]) == PyArray_DATA((PyArrayObject *)args[3])) {
        PyErr_SetString(PyExc_ValueError, "out must not alias x");
        return -1;
    }
    a->pos = pos;
    a->dense = args[0] == Py_None;
    if (a->dense && !b->mlp.d[0]) {
        PyErr_SetString(PyExc_ValueError, "AttnBlock.layer: layers None runs the block's dense "
                        "MLP, and none is set (set_mlp)");
        return -1;
    }
    a->B = (uint32_t)B;
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
    *bp = &self->blk;
    *cp = smoe_py_kctx(self->ctx_obj);
    return *cp ? 0 : -1;
}

/* set_mlp(mlp): the dense MLP layer(None, ...) runs after the attention (MLABlock's). */
static PyObject *ab_set_mlp(AttnBlockObject *self, PyObject *arg) {
    if (smoe_py_method_start(self->ready, "AttnBlock", "set_mlp(mlp)", 1, 1, 1)) return NULL;
    smoe_shared_ffn f;
    if (smoe_py_set_mlp_arg(arg, self->blk.hidden, "AttnBlock.set_mlp: the MLP's", &f))
        return NULL;
    PyObject *old = self->mlp_obj, *keep = arg == Py_None ? NULL : arg;
    Py_XINCREF(keep);
    Py_BEGIN_ALLOW_THREADS
    smoe_attn_block_set_mlp(&self->blk, &f); /* waits for a call in flight */
    Py_END_ALLOW_THREADS
    self->mlp_obj = keep;
    Py_XDECREF(old); /* released only now: the block no longer borrows from it */
    Py_RETURN_NONE;
}

static PyMethodDef ab_methods[] = {
    {"pre", (PyCFunction)(void (*)(void))ab_pre, METH_FASTCALL,
     "pre(x, cos, sin, q, k, v[, ln, ln_eps]): the q/k/v projections of x [rows * T, hidden] "
     "(rows of T tokens, rows from q: a batch of sequences; first RMSNorm-ed with the weights "
     "ln float32 [hidden] and ln_eps when given: the decoder layer's input layernorm), the q/k "
     "norms and the rotary embedding (cos, sin [rows * T, rotary_dim], each token's own); writes "
     "q float32 [rows, heads, T, head_dim] and k, v [rows, kv_heads, T, head_dim] (float32 or "
     "bf16 bits, for the KV cache).  x, cos, sin float32 or bf16 bits, C-contiguous; rows * T "
     "at most the block's max_tokens; GIL released.  Not for a gated block (ValueError)."},
    {"post", (PyCFunction)(void (*)(void))ab_post, METH_FASTCALL,
     "post(q, k, v, bias, scale, out): attention of q (pre's, [rows, heads, T, head_dim]) over "
     "each row's cache k, v [rows, kv_heads, S, head_dim] (float32 or bf16 bits, each [S, "
     "head_dim] block dense) with the additive bias float32 [1 or rows, T, S] or None, then the "
     "output projection into out [rows * T, hidden] (float32 or bf16 bits).  With resid, ln, "
     "ln_eps, normed (the decoder layer's residual stream [rows * T, hidden], post-attention "
     "RMSNorm weights and eps, and its output [rows * T, hidden], all of out's dtype): out = "
     "resid + the projection, normed = RMSNorm(out).  GIL released.  Not for a gated block "
     "(ValueError)."},
    {"layer", (PyCFunction)(void (*)(void))smoe_py_layer_method, METH_FASTCALL,
     "layer(layers, pos, route_flags, x, cos, sin, kbuf, vbuf, S, bias, scale, ln1, eps1, ln2, "
     "eps2, out): one decoder layer of rows of T tokens in one call (rows from kbuf: one "
     "sequence, or a decode batch): x [rows * T, hidden] RMSNorm-ed (ln1, eps1), pre's "
     "projections, norms and rotary, the new k, v written into the KV buffers kbuf, vbuf "
     "[rows, kv_heads, capacity, head_dim] (float32 or bf16 bits, C-contiguous) at positions "
     "S..S+T-1 of every row, attention over positions 0..S+T-1 with the additive bias float32 "
     "[1 or rows, T, S+T] or None, the output gate (gated), the output projection, the "
     "residual add, the post-attention "
     "RMSNorm (ln2, eps2), the MoE block of MoE layer pos of the _C.Layers object layers (its "
     "forward_routed with route_flags) over every row's tokens, the second residual add, into "
     "out [rows * T, hidden] (x's dtype).  Every intermediate as pre, post and "
     "forward_routed compute it; GIL released.  layers None: a dense layer, the block's MLP "
     "(set_mlp) in place of the MoE block (pos, route_flags unused).  Returns (seconds in the "
     "attention block with its norms and first residual add, seconds in the MoE block and the "
     "second add, seconds in the dense MLP and the second add), for benchmarks."},
    {"set_mlp", (PyCFunction)ab_set_mlp, METH_O,
     "set_mlp(mlp): the dense MLP layer(None, ...) runs after the attention, down(silu(gate "
     "x) * up x) with the roundings of a bf16 model when the block has them: a (gate, up, "
     "down) tuple of _C.Linear chaining hidden -> I -> hidden (kept while set), or None.  "
     "Waits for a call in flight."},
    {NULL, NULL, 0, NULL}};

static PyTypeObject AttnBlockType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "specmoe._C.AttnBlock",
    .tp_basicsize = sizeof(AttnBlockObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "AttnBlock(ctx, q, k, v, o, heads, kv_heads, head_dim, norm='none', q_norm=None, "
              "k_norm=None, eps=1e-6, bf16=False, max_tokens=16, qkv=None, gate=False, "
              "rotary_dim=0, zero_centred=False, sinks=None, rope='half'): one decoder layer's "
              "attention "
              "module at decode sizes (specmoe.models.attention.fuse_attention) in two calls around "
              "the KV cache update: pre (projections, q/k RMSNorm over all heads ('full') or "
              "per head ('head'), rotary) and post (attention, output projection).  q, k, v, o "
              "are specmoe._C.Linear objects (qkv, optional: the three projections' rows in one, "
              "used by pre instead of q, k, v); q_norm, k_norm float32 weights; bf16: round "
              "every intermediate as a bf16 model does (csrc/kernels/block.h).  Qwen3-Next's and "
              "Qwen3.5's gated attention: gate (q's rows per head: head_dim query rows, then "
              "head_dim gate rows; the attention output times sigmoid(gate) before o; layer "
              "only), rotary_dim (the rotary on the first rotary_dim values of a head; 0: all), "
              "zero_centred (the q/k norms and the layer's norms in the zero-centred form, "
              "their weights 1 + the module's).  sinks: GPT-OSS's attention sinks, float32 "
              "[heads] (a logit a head in every softmax's denominator, no value).  rope: "
              "'half' (rotate-half) or 'pairs' (ERNIE-4.5: each head's pairs (x[2i], x[2i+1]) "
              "turned by angle i, cos and sin's first rotary_dim / 2 values).",
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

int smoe_py_mla_parts(PyObject *o, const smoe_mla_desc **d, const smoe_mla_weights **w) {
    if (!PyObject_TypeCheck(o, &MLADecodeType) || !((MLADecodeObject *)o)->ready) return -1;
    *d = &((MLADecodeObject *)o)->d;
    *w = &((MLADecodeObject *)o)->w;
    return 0;
}

int smoe_py_attn_init(PyObject *m) {
    PyTypeObject *types[] = {&MLADecodeType, &AttnDecodeType, &AttnBlockType};
    for (size_t i = 0; i < sizeof types / sizeof *types; i++) /* named by their tp_name */
        if (PyModule_AddType(m, types[i]) < 0) return -1;
    return smoe_py_decode_init(m); /* MLABlock, DecodePlan and the functions */
}

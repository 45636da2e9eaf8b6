/* Python binding of specmoe._C.GdnBlock: a gated DeltaNet module (Qwen3.5's linear attention)
 * for one decode token of a batch of sequences in one call (specmoe.models.linear_attn).  The
 * state and compute are plain C (csrc/decoder.h, csrc/gdn_block.c); the weights are checked
 * and referenced once at construction, the per-token call (METH_FASTCALL) checks the arrays'
 * shapes and runs without the GIL. */
#include <string.h>

#include "py_attn.h"
#include "py_kernels.h"
#include "py_layer.h" /* smoe_py_layers_end, smoe_py_route_flags */

typedef struct {
    PyObject_HEAD
    PyObject *ctx_obj;     /* the KernelContext (strong reference) */
    PyObject *lin_obj[SMOE_GB_N]; /* the input projections (NULL after n_in) and out:
                              specmoe._C.Linear (strong); blk borrows their descriptors, blocks
                              and biases */
    PyObject *arr_obj[6];  /* conv_weight, decay, dt_bias, norm_weight, conv_bias, order (the last
                              two or NULL): float32 / int32 arrays (strong; blk borrows their
                              data, never written) */
    smoe_gdn_block blk;    /* the C state (csrc/decoder.h): dims, buffers, its mutex */
    int ready;
} GdnBlockObject;

/* A float32 C-contiguous array of ndim dims whose dims equal want (-1: any); NULL with
 * ValueError otherwise. */
static PyArrayObject *weights(PyObject *o, const char *name, int ndim, const npy_intp *want) {
    PyArrayObject *a = smoe_py_want_array(o, name, NPY_FLOAT32, ndim, 0);
    if (!a || smoe_py_dims_are(o, name, want, ndim)) return NULL;
    return a;
}

static int gb_init(GdnBlockObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"ctx", "inputs", "out", "conv_weight", "decay", "dt_bias",
                             "norm_weight", "k_heads", "v_heads", "k_dim", "v_dim", "eps",
                             "bf16", "max_rows", "conv_bias", "order", NULL};
    PyObject *ctx_o, *in_o, *out_o, *cw_o, *dec_o, *dtb_o, *nw_o, *cb_o = Py_None;
    PyObject *ord_o = Py_None;
    unsigned int Hk, Hv, dk, dv, max_rows = 64;
    double eps = 1e-6;
    int bf16 = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOOOIIII|dpIOO:GdnBlock", kwlist, &ctx_o,
                                     &in_o, &out_o, &cw_o, &dec_o, &dtb_o, &nw_o, &Hk, &Hv, &dk,
                                     &dv, &eps, &bf16, &max_rows, &cb_o, &ord_o))
        return -1;
    if (self->ready) {
        PyErr_SetString(PyExc_RuntimeError, "GdnBlock is already initialised");
        return -1;
    }
    if (!smoe_py_kctx(ctx_o)) return -1;
    if (!PyTuple_Check(in_o) || PyTuple_GET_SIZE(in_o) < 1 ||
        PyTuple_GET_SIZE(in_o) > SMOE_GB_IN_MAX) {
        PyErr_Format(PyExc_TypeError, "GdnBlock: inputs must be a tuple of 1..%d _C.Linear",
                     SMOE_GB_IN_MAX);
        return -1;
    }
    smoe_gdn_block_cfg cfg;
    memset(&cfg, 0, sizeof cfg);
    PyObject *lin[SMOE_GB_N] = {NULL, NULL, NULL, NULL, out_o};
    cfg.n_in = (uint32_t)PyTuple_GET_SIZE(in_o);
    for (uint32_t i = 0; i < cfg.n_in; i++) lin[i] = PyTuple_GET_ITEM(in_o, i);
    for (int i = 0; i < SMOE_GB_N; i++)
        if (lin[i] && smoe_py_linear_parts(lin[i], &cfg.ld[i], &cfg.lb[i], &cfg.lbias[i]))
            return -1;
    PyArrayObject *ord = NULL;
    if (ord_o != Py_None) {
        const npy_intp w_o[1] = {2 * (npy_intp)Hk * dk + 2 * (npy_intp)Hv * dv + 2 * Hv};
        ord = smoe_py_want_array(ord_o, "order", NPY_INT32, 1, 0);
        if (!ord || smoe_py_dims_are(ord_o, "order [q|k|v|z|b|a values]", w_o, 1)) return -1;
        cfg.order = (const int32_t *)PyArray_DATA(ord);
    }
    /* the dims before the weights' shapes: C and K from conv_weight [C, K] */
    PyArrayObject *cw = smoe_py_want_array(cw_o, "conv_weight", NPY_FLOAT32, 2, 0);
    if (!cw) return -1;
    const npy_intp C = 2 * (npy_intp)Hk * dk + (npy_intp)Hv * dv, K = PyArray_DIM(cw, 1);
    const npy_intp w_cw[2] = {C, -1}, w_h[1] = {Hv}, w_d[1] = {dv}, w_c[1] = {C};
    PyArrayObject *dec, *dtb, *nw, *cb = NULL;
    if (smoe_py_dims_are(cw_o, "conv_weight [channels, kernel]", w_cw, 2) ||
        !(dec = weights(dec_o, "decay [v_heads]", 1, w_h)) ||
        !(dtb = weights(dtb_o, "dt_bias [v_heads]", 1, w_h)) ||
        !(nw = weights(nw_o, "norm_weight [v_dim]", 1, w_d)) ||
        (cb_o != Py_None && !(cb = weights(cb_o, "conv_bias [channels]", 1, w_c))))
        return -1;
    cfg.conv_w = (const float *)PyArray_DATA(cw);
    cfg.conv_b = cb ? (const float *)PyArray_DATA(cb) : NULL;
    cfg.decay = (const float *)PyArray_DATA(dec);
    cfg.dt_bias = (const float *)PyArray_DATA(dtb);
    cfg.norm_w = (const float *)PyArray_DATA(nw);
    cfg.Hk = Hk;
    cfg.Hv = Hv;
    cfg.dk = dk;
    cfg.dv = dv;
    cfg.K = K > 0 && K <= 16 ? (uint32_t)K : 0; /* (0: the check's range error) */
    cfg.max_rows = max_rows;
    cfg.eps = eps;
    cfg.bf16 = bf16;
    smoe_err err;
    smoe_err_clear(&err);
    if (smoe_gdn_block_init(&self->blk, &cfg, &err)) return smoe_py_block_init_raise(&err);
    Py_INCREF(ctx_o);
    self->ctx_obj = ctx_o;
    for (int i = 0; i < SMOE_GB_N; i++) {
        Py_XINCREF(lin[i]);
        self->lin_obj[i] = lin[i];
    }
    PyObject *arrs[6] = {cw_o, dec_o, dtb_o, nw_o, cb ? cb_o : NULL, ord ? ord_o : NULL};
    for (int i = 0; i < 6; i++) {
        Py_XINCREF(arrs[i]);
        self->arr_obj[i] = arrs[i];
    }
    self->ready = 1;
    return 0;
}

static void gb_dealloc(GdnBlockObject *self) {
    smoe_gdn_block_destroy(&self->blk);
    Py_XDECREF(self->ctx_obj);
    for (int i = 0; i < SMOE_GB_N; i++) Py_XDECREF(self->lin_obj[i]);
    for (int i = 0; i < 6; i++) Py_XDECREF(self->arr_obj[i]);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The arrays of step / layer: x [B, hidden] (f32 or bf16), conv [B, C, K] and state
 * [B, Hv, dk, dv] (writable), out [B, hidden] (writable, ob: its dtype); B from x.  -1 with
 * the exception set. */
static int step_arrays(const smoe_gdn_block *b, PyObject *x, PyObject *conv, PyObject *state,
                       PyObject *out, npy_intp *B, int *xb, int *cb, int *ob) {
    *xb = smoe_py_f32_or_bf16(x, "x", 2, 0);
    *cb = *xb < 0 ? -1 : smoe_py_f32_or_bf16(conv, "conv", 3, 1);
    PyArrayObject *st = *cb < 0 ? NULL : smoe_py_want_array(state, "state", NPY_FLOAT32, 4, 1);
    *ob = st ? smoe_py_f32_or_bf16(out, "out", 2, 1) : -1;
    if (*ob < 0) return -1;
    *B = PyArray_DIM((PyArrayObject *)x, 0);
    if (*B < 1 || *B > (npy_intp)b->max_rows) {
        PyErr_Format(PyExc_ValueError, "GdnBlock: %zd rows, expected 1..%u (max_rows)",
                     (Py_ssize_t)*B, b->max_rows);
        return -1;
    }
    const npy_intp w_x[2] = {*B, b->hidden}, w_c[3] = {*B, b->C, b->K};
    const npy_intp w_s[4] = {*B, b->Hv, b->dk, b->dv};
    if (smoe_py_dims_are(x, "x [rows, hidden]", w_x, 2) ||
        smoe_py_dims_are(conv, "conv [rows, channels, kernel]", w_c, 3) ||
        smoe_py_dims_are(state, "state [rows, v_heads, k_dim, v_dim]", w_s, 4) ||
        smoe_py_dims_are(out, "out [rows, hidden]", w_x, 2))
        return -1;
    void *cp = PyArray_DATA((PyArrayObject *)conv), *op = PyArray_DATA((PyArrayObject *)out);
    void *sp = PyArray_DATA(st);
    if (cp == sp || cp == op || op == sp) {
        PyErr_SetString(PyExc_ValueError, "GdnBlock: conv, state and out must not alias");
        return -1;
    }
    return 0;
}

static PyTypeObject GdnBlockType;

int smoe_py_is_gdn_block(PyObject *o) { return PyObject_TypeCheck(o, &GdnBlockType); }

/* layer(layers, pos, route_flags, x, conv, state, ln1, eps1, ln2, eps2, zero_centred, out):
 * check the 12 arguments (the method doc) into *a.  Takes no lock and begins nothing: the
 * layer call (py_decode.c smoe_py_layer_method, a chain item) begins the _C.Layers after. */
int smoe_py_gdn_layer_parse(PyObject *blk, PyObject *const *args, Py_ssize_t nargs,
                            smoe_gdn_layer_args *a, smoe_gdn_block **bp, smoe_kctx **cp) {
    GdnBlockObject *self = (GdnBlockObject *)blk;
    if (smoe_py_method_start(self->ready, "GdnBlock",
                             "layer(layers, pos, route_flags, x, conv, state, ln1, eps1, ln2, "
                             "eps2, zero_centred, out)", nargs, 12, 12))
        return -1;
    const smoe_gdn_block *b = &self->blk;
    memset(a, 0, sizeof *a);
    a->pos = PyLong_AsLong(args[1]);
    a->zc = PyObject_IsTrue(args[10]);
    if ((a->pos == -1 || a->zc < 0) && PyErr_Occurred()) return -1;
    if (smoe_py_route_flags(args[2], &a->flags)) return -1;
    npy_intp B;
    int ob;
    if (step_arrays(b, args[3], args[4], args[5], args[11], &B, &a->xb, &a->cb, &ob)) return -1;
    if (ob != a->xb) {
        PyErr_SetString(PyExc_ValueError, "GdnBlock.layer: x and out must have the same dtype");
        return -1;
    }
    if (PyArray_DATA((PyArrayObject *)args[3]) == PyArray_DATA((PyArrayObject *)args[11])) {
        PyErr_SetString(PyExc_ValueError, "GdnBlock.layer: x and out must not alias");
        return -1;
    }
    if (smoe_py_norm_arg(args[6], args[7], b->hidden, &a->ln1, &a->eps1) ||
        smoe_py_norm_arg(args[8], args[9], b->hidden, &a->ln2, &a->eps2))
        return -1;
    a->B = (uint32_t)B;
    a->xp = PyArray_DATA((PyArrayObject *)args[3]);
    a->conv = PyArray_DATA((PyArrayObject *)args[4]);
    a->state = (float *)PyArray_DATA((PyArrayObject *)args[5]);
    a->op = PyArray_DATA((PyArrayObject *)args[11]);
    *bp = &self->blk;
    *cp = smoe_py_kctx(self->ctx_obj);
    return *cp ? 0 : -1;
}

/* step(x, conv, state, out): smoe_gdn_block_step on B rows, B from x. */
static PyObject *gb_step(GdnBlockObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (smoe_py_method_start(self->ready, "GdnBlock", "step(x, conv, state, out)", nargs, 4, 4))
        return NULL;
    smoe_gdn_block *b = &self->blk;
    npy_intp B;
    int xb, cb, ob;
    if (step_arrays(b, args[0], args[1], args[2], args[3], &B, &xb, &cb, &ob)) return NULL;
    smoe_kctx *c = smoe_py_kctx(self->ctx_obj);
    if (!c) return NULL;
    const void *xp = PyArray_DATA((PyArrayObject *)args[0]);
    void *cp = PyArray_DATA((PyArrayObject *)args[1]), *op = PyArray_DATA((PyArrayObject *)args[3]);
    float *sp = (float *)PyArray_DATA((PyArrayObject *)args[2]);
    smoe_err err;
    smoe_err_clear(&err);
    int rc;
    /* every array stays referenced by the caller's frame for the whole call */
    Py_BEGIN_ALLOW_THREADS
    rc = smoe_gdn_block_step(b, c, xp, xb, (uint32_t)B, cp, cb, sp, op, ob, &err);
    Py_END_ALLOW_THREADS
    if (rc != 0) return smoe_py_raise(&err);
    Py_RETURN_NONE;
}

/* steps(x, conv, state, hist, out): smoe_gdn_block_steps, T tokens from x. */
static PyObject *gb_steps(GdnBlockObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (smoe_py_method_start(self->ready, "GdnBlock", "steps(x, conv, state, hist, out)", nargs,
                             5, 5))
        return NULL;
    smoe_gdn_block *b = &self->blk;
    const int xb = smoe_py_f32_or_bf16(args[0], "x", 2, 0);
    const int cb = xb < 0 ? -1 : smoe_py_f32_or_bf16(args[1], "conv", 2, 1);
    PyArrayObject *st = cb < 0 ? NULL : smoe_py_want_array(args[2], "state", NPY_FLOAT32, 3, 1);
    PyArrayObject *hi = NULL;
    if (st && args[3] != Py_None)
        hi = smoe_py_want_array(args[3], "hist", NPY_FLOAT32, 4, 1);
    const int ob = st && (hi || args[3] == Py_None) ? smoe_py_f32_or_bf16(args[4], "out", 2, 1)
                                                    : -1;
    if (ob < 0) return NULL;
    const npy_intp T = PyArray_DIM((PyArrayObject *)args[0], 0);
    const npy_intp L = PyArray_DIM((PyArrayObject *)args[1], 1);
    if (T < 1 || T > (npy_intp)b->max_rows || L < T + (npy_intp)b->K - 1) {
        PyErr_Format(PyExc_ValueError, "GdnBlock.steps: %zd tokens, expected 1..%u (max_rows), "
                     "and conv of %zd columns, expected >= tokens + kernel - 1 = %zd",
                     (Py_ssize_t)T, b->max_rows, (Py_ssize_t)L,
                     (Py_ssize_t)(T + (npy_intp)b->K - 1));
        return NULL;
    }
    const npy_intp w_x[2] = {T, b->hidden}, w_c[2] = {b->C, L};
    const npy_intp w_s[3] = {b->Hv, b->dk, b->dv}, w_h[4] = {T, b->Hv, b->dk, b->dv};
    if (smoe_py_dims_are(args[0], "x [tokens, hidden]", w_x, 2) ||
        smoe_py_dims_are(args[1], "conv [channels, columns]", w_c, 2) ||
        smoe_py_dims_are(args[2], "state [v_heads, k_dim, v_dim]", w_s, 3) ||
        (hi && smoe_py_dims_are(args[3], "hist [tokens, v_heads, k_dim, v_dim]", w_h, 4)) ||
        smoe_py_dims_are(args[4], "out [tokens, hidden]", w_x, 2))
        return NULL;
    const void *xp = PyArray_DATA((PyArrayObject *)args[0]);
    void *cp = PyArray_DATA((PyArrayObject *)args[1]), *op = PyArray_DATA((PyArrayObject *)args[4]);
    float *sp = (float *)PyArray_DATA(st), *hp = hi ? (float *)PyArray_DATA(hi) : NULL;
    if (cp == sp || cp == op || op == sp || (hp && (hp == sp || hp == cp || hp == op)) ||
        xp == op) {
        PyErr_SetString(PyExc_ValueError, "GdnBlock.steps: x, conv, state, hist and out must "
                        "not alias");
        return NULL;
    }
    smoe_kctx *c = smoe_py_kctx(self->ctx_obj);
    if (!c) return NULL;
    smoe_err err;
    smoe_err_clear(&err);
    int rc;
    /* every array stays referenced by the caller's frame for the whole call */
    Py_BEGIN_ALLOW_THREADS
    rc = smoe_gdn_block_steps(b, c, xp, xb, (uint32_t)T, cp, cb, (uint32_t)L, sp, hp, op, ob,
                              &err);
    Py_END_ALLOW_THREADS
    if (rc != 0) return smoe_py_raise(&err);
    Py_RETURN_NONE;
}

static PyMethodDef gb_methods[] = {
    {"step", (PyCFunction)(void (*)(void))gb_step, METH_FASTCALL,
     "step(x, conv, state, out): one decode token of each of rows sequences: x [rows, hidden] "
     "(float32 or bf16 bits) through the module into out [rows, hidden] (float32 or bf16 "
     "bits), each row's convolution window conv [rows, channels, kernel] (float32 or bf16 "
     "bits) and recurrent state [rows, v_heads, k_dim, v_dim] (float32) updated in place "
     "(csrc/decoder.h smoe_gdn_block_step).  C-contiguous arrays; GIL released."},
    {"steps", (PyCFunction)(void (*)(void))gb_steps, METH_FASTCALL,
     "steps(x, conv, state, hist, out): tokens of one sequence, as the module runs them on a "
     "cache that records its past: x [tokens, hidden] (float32 or bf16 bits) into out "
     "[tokens, hidden]; conv [channels, columns] (float32 or bf16 bits, columns >= tokens + "
     "kernel - 1) the window so far in all but its last tokens columns, which get the tokens' "
     "convolution inputs; the recurrent state [v_heads, k_dim, v_dim] (float32): with hist "
     "None updated in place to the state after the last token, else left as it is and hist, "
     "float32 [tokens, v_heads, k_dim, v_dim], gets the state after each token "
     "(csrc/decoder.h smoe_gdn_block_steps).  C-contiguous arrays; GIL released."},
    {"layer", (PyCFunction)(void (*)(void))smoe_py_layer_method, METH_FASTCALL,
     "layer(layers, pos, route_flags, x, conv, state, ln1, eps1, ln2, eps2, zero_centred, out): "
     "a whole Qwen3.5 decoder layer of one decode token of rows sequences in one call: x "
     "[rows, hidden] normed (ln1 float32 [hidden], eps1; zero_centred: both norms' weights are "
     "1 + the module's, applied in f32 with one rounding, else the Llama form), step's module, "
     "the residual add, the post-attention norm (ln2, eps2), the MoE block of MoE layer pos of "
     "the _C.Layers `layers` (its forward_routed with route_flags), the second residual add, "
     "into out [rows, hidden] (x's dtype, another array).  Returns (seconds in the linear "
     "attention part, seconds in the MoE block, 0.0), as AttnBlock.layer does.  A call of "
     "_C.layer_chain and _C.DecodePlan too.  GIL released."},
    {NULL, NULL, 0, NULL}};

static PyTypeObject GdnBlockType = { /* (declared above) */
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "specmoe._C.GdnBlock",
    .tp_basicsize = sizeof(GdnBlockObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "GdnBlock(ctx, inputs, out, conv_weight, decay, dt_bias, norm_weight, "
              "k_heads, v_heads, k_dim, v_dim, eps=1e-6, bf16=False, max_rows=64, "
              "conv_bias=None, order=None): a gated DeltaNet module (the linear attention of "
              "Qwen3.5 and Qwen3-Next) for one decode token of up to max_rows sequences in one "
              "call (specmoe.models.linear_attn.fuse_gated_deltanet).  inputs: a tuple of 1-4 "
              "specmoe._C.Linear whose outputs side by side are q|k|v, z, b, a in that order "
              "(Qwen3.5's four projections, or one joint matrix) or, with order (int32, a "
              "permutation: y[j] = outputs[order[j]]), in another (Qwen3-Next's in_proj_qkvz "
              "and in_proj_ba); out: the output projection; conv_weight float32 [channels, "
              "kernel] with channels "
              "= 2 k_heads k_dim + v_heads v_dim; decay float32 [v_heads] (-exp(A_log)); "
              "dt_bias float32 [v_heads]; norm_weight float32 [v_dim] (the gated RMSNorm's, eps "
              "its epsilon); bf16: round every intermediate as a bf16 model does "
              "(csrc/kernels/block.h).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)gb_init,
    .tp_dealloc = (destructor)gb_dealloc,
    .tp_methods = gb_methods,
};

int smoe_py_gdn_init(PyObject *m) { return PyModule_AddType(m, &GdnBlockType); }

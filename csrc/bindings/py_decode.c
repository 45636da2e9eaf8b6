/* Python binding of whole decoder layers and decode steps: specmoe._C.MLABlock, a DeepSeek-V2/V3
 * MLA attention module with its decoder layer's norms, residual adds and MoE block (or dense
 * MLP) in one call; specmoe._C.layer_chain, decoder layers (AttnBlock's and MLABlock's) one
 * after another with the GIL released once; specmoe._C.rms_norm; specmoe._C.DecodePlan, a
 * one-token decode step of a whole model in one call.  The state and compute are plain C
 * (csrc/decoder.h: mla_block.c, decoder.c); this file parses and checks the arguments, keeps
 * the Python objects whose memory the C structs borrow, begins the _C.Layers of each layer
 * call and releases the GIL around the C calls. */
#include <stdlib.h>
#include <string.h>

#include "py_attn.h"
#include "py_kernels.h"
#include "py_layer.h"
#include "py_numpy.h"

/* ---- MLABlock: a DeepSeek-V2 decoder layer's MLA attention module at decode sizes ---- */

typedef struct {
    PyObject_HEAD
    PyObject *ctx_obj;            /* the KernelContext (strong) */
    PyObject *mla_obj;            /* the MLADecode whose absorbed weights the block reads
                                     (strong; immutable after its construction; blk borrows
                                     its descriptor and weights) */
    PyObject *lin_obj[SMOE_ML_N]; /* specmoe._C.Linear (strong): q_proj (q_b_proj when q_a is
                                     set), kv_a_proj_with_mqa, o_proj, q_a_proj or NULL, and
                                     (q or q_a) | kv_a in one or NULL; blk borrows their parts */
    PyObject *kvn_obj, *qan_obj;  /* kv_a_layernorm / q_a_layernorm float32 weights (strong;
                                     qan_obj NULL without q_a) */
    PyObject *mlp_obj;            /* set_mlp's (gate, up, down) tuple of _C.Linear (strong) or
                                     NULL, whose parts blk.mlp borrows; changed under the GIL
                                     and blk.mu */
    smoe_mla_block blk;           /* the C state (csrc/decoder.h): dims, buffers, its mutex */
    int ready;
} MLABlockObject;

static int mlab_init(MLABlockObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"ctx", "mla", "q", "kv_a", "o", "kv_norm", "kv_eps", "q_a",
                             "q_a_norm", "q_a_eps", "joint", "bf16", "max_tokens", "rope", NULL};
    PyObject *ctx_o, *mla_o, *kvn_o, *lin[SMOE_ML_N] = {NULL, NULL, NULL, Py_None, Py_None},
             *qan_o = Py_None;
    double kv_eps, qa_eps = 1e-6;
    int bf16 = 0;
    unsigned int max_tokens = 16;
    const char *rope = "complex";
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOOOOOd|OOdOpIs:MLABlock", kwlist, &ctx_o,
                                     &mla_o, &lin[SMOE_ML_Q], &lin[SMOE_ML_KVA], &lin[SMOE_ML_O],
                                     &kvn_o, &kv_eps, &lin[SMOE_ML_QA], &qan_o, &qa_eps,
                                     &lin[SMOE_ML_JOINT], &bf16, &max_tokens, &rope))
        return -1;
    const int rk = smoe_rope_kind(rope);
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
    smoe_mla_block_cfg cfg;
    memset(&cfg, 0, sizeof cfg);
    if (smoe_py_mla_parts(mla_o, &cfg.d, &cfg.w)) {
        PyErr_SetString(PyExc_TypeError, "MLABlock: mla must be an initialised _C.MLADecode");
        return -1;
    }
    const smoe_mla_desc *d = cfg.d;
    for (int i = 0; i < SMOE_ML_N; i++)
        if (lin[i] != Py_None &&
            smoe_py_linear_parts(lin[i], &cfg.ld[i], &cfg.lb[i], &cfg.lbias[i]))
            return -1;
    const int has_qa = lin[SMOE_ML_QA] != Py_None;
    if (has_qa != (qan_o != Py_None)) {
        PyErr_SetString(PyExc_ValueError, "MLABlock: q_a and q_a_norm go together");
        return -1;
    }
    cfg.kv_eps = kv_eps;
    cfg.qa_eps = qa_eps;
    cfg.max_tokens = max_tokens;
    cfg.bf16 = bf16;
    cfg.rope = rk;
    smoe_err err;
    smoe_err_clear(&err);
    if (smoe_mla_block_check(&cfg, &err)) {
        PyErr_SetString(PyExc_ValueError, err.msg);
        return -1;
    }
    const uint32_t qa = has_qa ? cfg.ld[SMOE_ML_QA]->N : 0;
    PyArrayObject *kvn = smoe_py_want_array(kvn_o, "kv_norm", NPY_FLOAT32, 1, 0);
    if (!kvn) return -1;
    if (PyArray_DIM(kvn, 0) != (npy_intp)d->r) {
        PyErr_Format(PyExc_ValueError, "MLABlock: kv_norm has %zd weights, expected %u",
                     (Py_ssize_t)PyArray_DIM(kvn, 0), d->r);
        return -1;
    }
    cfg.kvn = (const float *)PyArray_DATA(kvn);
    if (has_qa) {
        PyArrayObject *qan = smoe_py_want_array(qan_o, "q_a_norm", NPY_FLOAT32, 1, 0);
        if (!qan) return -1;
        if (PyArray_DIM(qan, 0) != (npy_intp)qa) {
            PyErr_Format(PyExc_ValueError, "MLABlock: q_a_norm has %zd weights, expected %u",
                         (Py_ssize_t)PyArray_DIM(qan, 0), qa);
            return -1;
        }
        cfg.qan = (const float *)PyArray_DATA(qan);
    }
    if (smoe_mla_block_init(&self->blk, &cfg, &err)) {
        if (err.code == SMOE_ENOMEM)
            PyErr_NoMemory();
        else
            PyErr_SetString(PyExc_ValueError, err.msg);
        return -1;
    }
    Py_INCREF(ctx_o);
    self->ctx_obj = ctx_o;
    Py_INCREF(mla_o);
    self->mla_obj = mla_o;
    for (int i = 0; i < SMOE_ML_N; i++)
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
    self->ready = 1;
    return 0;
}

static void mlab_dealloc(MLABlockObject *self) {
    smoe_mla_block_destroy(&self->blk);
    Py_XDECREF(self->mlp_obj);
    Py_XDECREF(self->ctx_obj);
    Py_XDECREF(self->mla_obj);
    for (int i = 0; i < SMOE_ML_N; i++) Py_XDECREF(self->lin_obj[i]);
    Py_XDECREF(self->kvn_obj);
    Py_XDECREF(self->qan_obj);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* x, freqs, cbuf, kbuf, S, bias, ln1, eps1, ln2, eps2 at args[0..10): B rows of T tokens,
 * B from the caches: x [B T, hidden] f32/bf16 (row b's tokens at b T ..); freqs float32
 * [B T, rope_dim / 2, 2] or [B T, 2, rope_dim]; cbuf [B, 1, capacity, kv_lora_rank] and
 * kbuf [B, 1, capacity, rope_dim], f32 or bf16 bits alike, with room for S + T positions;
 * bias None or float32 [1 or B, T, S + T]; the two RMSNorms' weights and eps. */
static int mlab_parse(MLABlockObject *self, PyObject *const *args, smoe_mla_args *a) {
    const smoe_mla_desc *d = self->blk.d;
    const uint32_t hid = self->blk.hidden;
    long long S = PyLong_AsLongLong(args[4]);
    if (S == -1 && PyErr_Occurred()) return -1;
    if ((a->xb = smoe_py_f32_or_bf16(args[0], "x", 2, 0)) < 0) return -1;
    int cb = smoe_py_f32_or_bf16(args[2], "cbuf", 4, 1);
    int kb = smoe_py_f32_or_bf16(args[3], "kbuf", 4, 1);
    if (cb < 0 || kb < 0) return -1;
    const npy_intp N = PyArray_DIM((PyArrayObject *)args[0], 0);
    const npy_intp B = PyArray_DIM((PyArrayObject *)args[2], 0);
    if (B < 1 || N < B || N % B || N > (npy_intp)self->blk.max_tokens) {
        PyErr_Format(PyExc_ValueError, "MLABlock: %zd tokens in %zd rows (the caches' first "
                     "dimension), expected the same number of tokens in each row, 1..%u in "
                     "all", (Py_ssize_t)N, (Py_ssize_t)B, self->blk.max_tokens);
        return -1;
    }
    const npy_intp T = N / B;
    PyArrayObject *f = smoe_py_want_array(args[1], "freqs", NPY_FLOAT32, 3, 0);
    if (!f) return -1;
    npy_intp cap = PyArray_DIM((PyArrayObject *)args[2], 2);
    const int cx = self->blk.rope == SMOE_ROPE_COMPLEX;
    npy_intp w_x[2] = {N, hid}, w_c[4] = {B, 1, cap, d->r}, w_k[4] = {B, 1, cap, d->dr};
    npy_intp w_f[3] = {N, cx ? d->dr / 2 : 2, cx ? 2 : d->dr};
    if (smoe_py_dims_are(args[0], "x [B T, hidden]", w_x, 2) ||
        smoe_py_dims_are(args[1], cx ? "freqs [B T, rope_dim / 2, 2]"
                                     : "freqs [B T, 2, rope_dim]", w_f, 3) ||
        smoe_py_dims_are(args[2], "cbuf [B, 1, capacity, kv_lora_rank]", w_c, 4) ||
        smoe_py_dims_are(args[3], "kbuf [B, 1, capacity, rope_dim]", w_k, 4))
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
    if (smoe_py_bias_arg(args[5], B, T, (npy_intp)S + T, &a->bias, &a->bias_rows) ||
        smoe_py_norm_arg(args[6], args[7], hid, &a->ln1, &a->eps1) ||
        smoe_py_norm_arg(args[8], args[9], hid, &a->ln2, &a->eps2))
        return -1;
    a->B = (uint32_t)B;
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

/* An output argument: [B T, hidden] in x's dtype, not aliasing x (or other, when given). */
static int mlab_out(MLABlockObject *self, PyObject *o, const char *name, const smoe_mla_args *a,
                    const void *other) {
    npy_intp w_o[2] = {(npy_intp)a->B * a->nt, self->blk.hidden};
    int ob = smoe_py_f32_or_bf16(o, name, 2, 1);
    if (ob < 0 || smoe_py_dims_are(o, name, w_o, 2)) return -1;
    void *p = PyArray_DATA((PyArrayObject *)o);
    if (ob != a->xb || p == a->xp || p == other) {
        PyErr_Format(PyExc_ValueError, "%s must have x's dtype and alias no other argument",
                     name);
        return -1;
    }
    return 0;
}

/* attn(x, freqs, cbuf, kbuf, S, bias, ln1, eps1, ln2, eps2, out, normed): the attention half
 * of a decoder layer (the method doc; smoe_mla_block_attn). */
static PyObject *mlab_attn(MLABlockObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (smoe_py_method_start(self->ready, "MLABlock",
                     "attn(x, freqs, cbuf, kbuf, S, bias, ln1, eps1, ln2, eps2, out, normed)",
                     nargs, 12, 12))
        return NULL;
    smoe_mla_args a;
    if (mlab_parse(self, args, &a) || mlab_out(self, args[10], "out", &a, NULL) ||
        mlab_out(self, args[11], "normed", &a, PyArray_DATA((PyArrayObject *)args[10])))
        return NULL;
    smoe_kctx *c = smoe_py_kctx(self->ctx_obj);
    if (!c) return NULL;
    void *op = PyArray_DATA((PyArrayObject *)args[10]);
    void *np_ = PyArray_DATA((PyArrayObject *)args[11]);
    smoe_err err;
    smoe_err_clear(&err);
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = smoe_mla_block_attn(&self->blk, c, &a, op, np_, &err);
    Py_END_ALLOW_THREADS
    if (rc != 0) return smoe_py_raise(&err);
    Py_RETURN_NONE;
}

/* Check layer()'s 14 arguments (the method doc) into *l; -1 with the exception set. */
static int mlab_layer_parse(MLABlockObject *self, PyObject *const *args, Py_ssize_t nargs,
                            smoe_mla_layer_args *l) {
    if (smoe_py_method_start(self->ready, "MLABlock",
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
    if (l->dense && !self->blk.mlp.d[0]) {
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
    if (smoe_py_method_start(self->ready, "MLABlock", "set_mlp(mlp)", 1, 1, 1)) return NULL;
    smoe_shared_ffn f;
    if (smoe_py_set_mlp_arg(arg, self->blk.hidden, "MLABlock.set_mlp: the MLP's", &f))
        return NULL;
    PyObject *old = self->mlp_obj, *keep = arg == Py_None ? NULL : arg;
    Py_XINCREF(keep);
    Py_BEGIN_ALLOW_THREADS
    smoe_mla_block_set_mlp(&self->blk, &f); /* waits for a layer in flight */
    Py_END_ALLOW_THREADS
    self->mlp_obj = keep;
    Py_XDECREF(old); /* released only now: the block no longer borrows from it */
    Py_RETURN_NONE;
}

static PyMethodDef mlab_methods[] = {
    {"attn", (PyCFunction)(void (*)(void))mlab_attn, METH_FASTCALL,
     "attn(x, freqs, cbuf, kbuf, S, bias, ln1, eps1, ln2, eps2, out, normed): the attention "
     "half of a DeepSeek-V2 decoder layer for B rows (sequences) of T tokens, B the caches' "
     "first dimension: input RMSNorm (ln1), the MLA module (projections, kv_a_layernorm, "
     "rotary, each row's new latent and rotary key written into its cbuf / kbuf row at "
     "positions S..S+T-1, absorbed attention over its S + T positions, o_proj), out = x + "
     "that, normed = the post-attention RMSNorm (ln2) of out.  x, out, normed [B T, hidden] "
     "f32 or bf16 bits alike (row b's tokens from b T); freqs float32 [B T, rope_dim / 2, 2] "
     "(rope 'complex': each token's rotary frequencies as (re, im)) or [B T, 2, rope_dim] "
     "('half', 'interleave': cos, sin); cbuf [B, 1, capacity, kv_lora_rank], kbuf [B, 1, "
     "capacity, rope_dim] f32 or bf16 bits; bias None or float32 [1 or B, T, S + T] added to "
     "the scores; ln1, ln2 float32 [hidden] with their eps.  B T <= max_tokens; a row's "
     "tokens get the bits of its call alone."},
    {"layer", (PyCFunction)(void (*)(void))smoe_py_layer_method, METH_FASTCALL,
     "layer(layers, pos, route_flags, x, freqs, cbuf, kbuf, S, bias, ln1, eps1, ln2, eps2, "
     "out): a whole DeepSeek-V2 MoE decoder layer of B rows of T tokens in one call: attn's "
     "part, then the MoE block over every row's tokens at position pos of the _C.Layers "
     "`layers` (routing, routed and shared experts, as Layers.forward_routed with "
     "route_flags) on the normed sum, and out = the sum "
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
    if (n < 1 || n > (1 << 24) || smoe_py_norm_arg(args[1], args[2], (uint32_t)n, &w, &eps) ||
        smoe_py_dims_are(args[3], "out [T, n]", w_o, 2))
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
        smoe_rms_norm_row((const uint8_t *)xp + (size_t)t * n * (xb ? 2 : 4),
                          (uint8_t *)op + (size_t)t * n * (ob ? 2 : 4), xb, w, eps, bf16, buf,
                          (uint32_t)n);
    if (buf != row) free(buf);
    Py_RETURN_NONE;
}

/* ---- layer calls and chains: each a smoe_chain_item (csrc/decoder.h) run by C ---- */

/* The most decoder layers one layer_chain call takes (its items live on the stack). */
#define CHAIN_MAX 128

/* The Python side of a smoe_chain_item: the _C.Layers to begin (borrowed from the call's
 * arguments), or NULL for a dense layer, and what smoe_py_layer_call_begin checks of it. */
typedef struct {
    PyObject *layers;
    long pos;     /* the MoE layer's position in layers */
    uint32_t hid; /* the block's hidden size */
} chain_ref;

smoe_layers *smoe_py_layer_call_begin(PyObject *layers, long pos, uint32_t hid) {
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

/* Check one layer call -- blk an AttnBlock, MLABlock or GdnBlock, av its layer() arguments --
 * into *c and *r, beginning nothing; -1 with the exception set.  i: the call's index in a
 * chain, for messages (-1: the method itself). */
static int chain_item_parse(PyObject *blk, PyObject *const *av, Py_ssize_t an, Py_ssize_t i,
                            smoe_chain_item *c, chain_ref *r) {
    c->g = NULL;
    if (smoe_py_is_attn_block(blk)) {
        smoe_attn_block *b;
        c->kind = SMOE_CHAIN_ATTN;
        if (smoe_py_attn_layer_parse(blk, av, an, &c->u.ab, &b, &c->c)) return -1;
        c->blk = b;
        r->hid = b->hidden;
        r->pos = c->u.ab.pos;
    } else if (smoe_py_is_gdn_block(blk)) {
        smoe_gdn_block *b;
        c->kind = SMOE_CHAIN_GDN;
        if (smoe_py_gdn_layer_parse(blk, av, an, &c->u.gd, &b, &c->c)) return -1;
        c->blk = b;
        r->hid = b->hidden;
        r->pos = c->u.gd.pos;
    } else if (PyObject_TypeCheck(blk, &MLABlockType)) {
        MLABlockObject *b = (MLABlockObject *)blk;
        c->kind = SMOE_CHAIN_MLA;
        if (mlab_layer_parse(b, av, an, &c->u.ml)) return -1;
        c->c = smoe_py_kctx(b->ctx_obj);
        if (!c->c) return -1;
        c->blk = &b->blk;
        r->hid = b->blk.hidden;
        r->pos = c->u.ml.pos;
    } else {
        PyErr_Format(PyExc_TypeError, "layer_chain: call %zd's block is a %s, not an "
                     "AttnBlock, MLABlock or GdnBlock", i, Py_TYPE(blk)->tp_name);
        return -1;
    }
    /* a dense layer (MLABlock's or AttnBlock's) has no MoE layers to begin */
    const int dense = (c->kind == SMOE_CHAIN_MLA && c->u.ml.dense) ||
                      (c->kind == SMOE_CHAIN_ATTN && c->u.ab.dense);
    r->layers = dense ? NULL : av[0];
    return 0;
}

/* Begin a parsed item's _C.Layers (GIL held); -1 with the exception set. */
static int chain_item_begin(smoe_chain_item *c, const chain_ref *r) {
    if (!r->layers) return 0;
    c->g = smoe_py_layer_call_begin(r->layers, r->pos, r->hid);
    return c->g ? 0 : -1;
}

/* End the begun items of it[0..n) (GIL held), keeping an exception that is pending: the ends
 * look the cache up and must not run with one set. */
static void chain_end(smoe_chain_item *it, const chain_ref *refs, Py_ssize_t n) {
    PyObject *et, *ev, *tb;
    PyErr_Fetch(&et, &ev, &tb);
    for (Py_ssize_t i = 0; i < n; i++)
        if (it[i].g) {
            smoe_py_layers_end(refs[i].layers);
            it[i].g = NULL;
        }
    PyErr_Restore(et, ev, tb);
}

/* Parse and begin calls[0..n) (layer_chain's items) into it, refs; -1 with the exception set
 * and nothing left begun.  begin 0: parse only. */
static int chain_parse(PyObject *calls, smoe_chain_item *it, chain_ref *refs, int begin) {
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
                                   PyTuple_GET_SIZE(a), i, &it[i], &refs[i]) ||
                  (begin && chain_item_begin(&it[i], &refs[i]));
        }
        if (bad) {
            chain_end(it, refs, i);
            return -1;
        }
    }
    return 0;
}

/* Run the n begun items with the GIL released once (smoe_chain_exec), end them all; returns
 * (attention seconds, MoE block seconds, dense MLP seconds) summed, or NULL with the error. */
static PyObject *chain_run(smoe_chain_item *it, const chain_ref *refs, Py_ssize_t n) {
    smoe_err err;
    smoe_err_clear(&err);
    int rc;
    double t[3] = {0, 0, 0};
    Py_BEGIN_ALLOW_THREADS
    rc = smoe_chain_exec(it, (size_t)n, t, &err);
    Py_END_ALLOW_THREADS
    chain_end(it, refs, n);
    if (rc != 0) return smoe_py_raise(&err);
    return Py_BuildValue("(ddd)", t[0], t[1], t[2]);
}

/* layer(...) of AttnBlock (16 arguments), MLABlock (14) and GdnBlock (12): one whole decoder
 * layer (the methods' docs), a chain of one. */
PyObject *smoe_py_layer_method(PyObject *self, PyObject *const *args, Py_ssize_t nargs) {
    smoe_chain_item c;
    chain_ref r;
    if (chain_item_parse(self, args, nargs, -1, &c, &r) || chain_item_begin(&c, &r)) return NULL;
    return chain_run(&c, &r, 1);
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
    smoe_chain_item it[CHAIN_MAX];
    chain_ref refs[CHAIN_MAX];
    if (chain_parse(calls, it, refs, 1)) return NULL;
    return chain_run(it, refs, n);
}

/* ---- DecodePlan: a whole one-token decode step in one call ----
 * specmoe.models.decode_step builds one per generation (its KV buffers, its layers) and calls step()
 * once per token: the embedding row, the rotary rows of position S, the decoder layers (as
 * layer_chain), the final RMSNorm and lm_head, with the GIL released once
 * (smoe_decode_plan_step).  What step() leaves to Python is the KV cache's views (kv_advance)
 * and the output object. */

typedef struct {
    PyObject_HEAD
    PyObject *keep;        /* the constructor's arguments (strong): every array and object the
                              plan points into stays alive and unresized while it lives */
    chain_ref *refs;       /* [plan.n] (owned), the items' _C.Layers: begun by each step */
    smoe_decode_plan plan; /* the C plan (csrc/decoder.h); its items parsed at construction,
                              their S written by each step */
    PyObject *head;        /* the lm_head _C.Linear (borrowed from keep; the plan's head_arg)
                              or NULL */
    int busy;              /* a step in flight: set and cleared with the GIL held */
} DecodePlanObject;

/* A (table, dst) pair into *r: table C-contiguous with >= 1 dim, dst C-contiguous, writable,
 * of table's dtype and one row's bytes.  -1 with ValueError naming what. */
static int plan_row_parse(PyObject *table, PyObject *dst, const char *what, smoe_plan_row *r) {
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

/* The plan's lm_head: the _C.Linear arg on x (smoe_py_linear_run). */
static int plan_head(void *arg, smoe_kctx *c, const void *x, int xb, uint32_t T, void *out,
                     int ob, smoe_err *err) {
    return smoe_py_linear_run((PyObject *)arg, c, x, xb, T, out, ob, err);
}

static void dp_dealloc(DecodePlanObject *self) {
    smoe_decode_plan_destroy(&self->plan);
    free(self->refs);
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
    smoe_chain_item *it = calloc((size_t)n, sizeof(*it));
    chain_ref *refs = calloc((size_t)n, sizeof(*refs));
    smoe_plan_row *rv = calloc((size_t)(nr ? nr : 1), sizeof(*rv));
    float *nbuf = NULL, *lbuf = NULL;
    if (!it || !refs || !rv) goto nomem;
    if (chain_parse(calls, it, refs, 0)) goto fail;
    for (Py_ssize_t i = 0; i < n; i++) {
        /* an attention bias spans S + T positions: a plan's calls carry none */
        const float *bias = it[i].kind == SMOE_CHAIN_MLA    ? it[i].u.ml.a.bias
                            : it[i].kind == SMOE_CHAIN_ATTN ? it[i].u.ab.bias
                                                            : NULL;
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
    smoe_plan_row er = {0};
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
        if (smoe_py_norm_arg(PyTuple_GET_ITEM(norm, 1), PyTuple_GET_ITEM(norm, 2), (uint32_t)nd, &nw,
                     &neps) ||
            smoe_py_dims_are(o, "norm out [1, n]", w_o, 2))
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
        if (smoe_py_dims_are(x, "head x [1, K]", w_x, 2)) goto fail;
        hx = PyArray_DATA((PyArrayObject *)x);
        hn = d->N;
        if (!(lbuf = malloc((size_t)hn * sizeof(float)))) goto nomem;
    }
    self->keep = Py_BuildValue("(OOOOO)", calls, rows, embed, norm, head);
    if (!self->keep) goto fail;
    self->refs = refs;
    smoe_decode_plan *p = &self->plan;
    p->n = (size_t)n;
    p->it = it;
    p->nrows = (size_t)nr;
    p->rows = rv;
    p->embed = er;
    p->norm_x = nx;
    p->norm_out = no;
    p->norm_w = nw;
    p->norm_eps = neps;
    p->nb = nb;
    p->norm_bf16 = nbf;
    p->norm_n = nn;
    p->norm_buf = nbuf;
    p->head = hl ? plan_head : NULL;
    p->head_arg = hl;
    p->head_x = hx;
    p->hb = hb;
    p->head_n = hn;
    p->logit_buf = lbuf;
    self->head = hl;
    return 0;
nomem:
    PyErr_NoMemory();
fail:
    free(it);
    free(refs);
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
    if (self->plan.embed.table && (tok < 0 || tok >= (long long)self->plan.embed.rows)) {
        PyErr_Format(PyExc_ValueError, "DecodePlan.step: token %lld outside [0, %zd)", tok,
                     (Py_ssize_t)self->plan.embed.rows);
        return NULL;
    }
    if (S < 0) {
        PyErr_Format(PyExc_ValueError, "DecodePlan.step: S=%lld cached positions", S);
        return NULL;
    }
    const smoe_decode_plan *p = &self->plan;
    for (size_t i = 0; i < p->nrows; i++)
        if (S >= (long long)p->rows[i].rows) {
            PyErr_Format(PyExc_ValueError, "DecodePlan.step: position %lld outside its rotary "
                         "table of %zd rows", S, (Py_ssize_t)p->rows[i].rows);
            return NULL;
        }
    for (size_t i = 0; i < p->n; i++) {
        const smoe_chain_item *c = &p->it[i];
        if (c->kind == SMOE_CHAIN_GDN) continue; /* (a recurrent state: no positions) */
        const int ml = c->kind == SMOE_CHAIN_MLA;
        long long cap = ml ? (long long)c->u.ml.a.cap : (long long)c->u.ab.cap;
        long long nt = ml ? (long long)c->u.ml.a.nt : (long long)c->u.ab.nt;
        if (S + nt > cap) {
            PyErr_Format(PyExc_ValueError, "DecodePlan.step: S=%lld cached + %lld new positions "
                         "do not fit layer call %zd's KV capacity of %lld", S, nt, (Py_ssize_t)i, cap);
            return NULL;
        }
    }
    void *lp = NULL;
    int lb = 0;
    smoe_kctx *hc = NULL;
    if (self->head) {
        lb = smoe_py_f32_or_bf16(args[2], "logits", 2, 1);
        if (lb < 0) return NULL;
        npy_intp w_l[2] = {1, p->head_n};
        if (smoe_py_dims_are(args[2], "logits [1, vocab]", w_l, 2)) return NULL;
        lp = PyArray_DATA((PyArrayObject *)args[2]);
        if (lp == p->head_x) {
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
    const Py_ssize_t n = (Py_ssize_t)p->n;
    for (Py_ssize_t i = 0; i < n; i++)
        if (chain_item_begin(&p->it[i], &self->refs[i])) {
            chain_end(p->it, self->refs, i);
            self->busy = 0;
            return NULL;
        }
    smoe_err err;
    smoe_err_clear(&err);
    int rc;
    double t[4] = {0, 0, 0, 0};
    int64_t best = -1;
    /* logits stays referenced by the caller's frame for the call */
    Py_BEGIN_ALLOW_THREADS
    rc = smoe_decode_plan_step(&self->plan, tok, S, hc, lp, lb, am, t, &best, &err);
    Py_END_ALLOW_THREADS
    self->busy = 0;
    chain_end(p->it, self->refs, n);
    if (rc != 0) return smoe_py_raise(&err);
    return Py_BuildValue("(ddddL)", t[0], t[1], t[2], t[3], (long long)best);
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

int smoe_py_decode_init(PyObject *m) {
    PyTypeObject *types[] = {&MLABlockType, &DecodePlanType};
    for (size_t i = 0; i < sizeof types / sizeof *types; i++) /* named by their tp_name */
        if (PyModule_AddType(m, types[i]) < 0) return -1;
    return PyModule_AddFunctions(m, attn_functions);
}

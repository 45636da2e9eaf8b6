/* A DeepSeek-V2/V3 decoder layer's MLA attention module at decode sizes, in the absorbed form
 * (decoder.h), and its whole decoder layer (MoE block or dense MLP).  The state of
 * specmoe._C.MLABlock (csrc/bindings/py_decode.c). */
#include <stdlib.h>
#include <string.h>

#include "decoder_impl.h"
#include "kernels/block.h"

int smoe_rope_kind(const char *name) {
    return !strcmp(name, "complex")      ? SMOE_ROPE_COMPLEX
           : !strcmp(name, "half")       ? SMOE_ROPE_HALF
           : !strcmp(name, "interleave") ? SMOE_ROPE_INTERLEAVE
                                         : -1;
}

int smoe_mla_block_check(const smoe_mla_block_cfg *cfg, smoe_err *err) {
    const smoe_mla_desc *d = cfg->d;
    const uint32_t max_tokens = cfg->max_tokens;
    const double kv_eps = cfg->kv_eps, qa_eps = cfg->qa_eps;
    if (max_tokens < 1 || max_tokens > 4096 || !(kv_eps >= 0.0) || kv_eps > 1.0 ||
        !(qa_eps >= 0.0) || qa_eps > 1.0 || d->dr % 2 || d->dr > SMOE_ROTARY_MAX)
        return smoe_err_set(err, SMOE_EINVAL,
                            "MLABlock: max_tokens=%u (1..4096), kv_eps=%g, q_a_eps=%g (0..1), "
                            "rope dim %u (even, at most %u) out of range",
                            max_tokens, kv_eps, qa_eps, d->dr, SMOE_ROTARY_MAX);
    const int has_qa = cfg->ld[SMOE_ML_QA] != NULL;
    const uint32_t hidden = cfg->ld[SMOE_ML_KVA]->K, qa = has_qa ? cfg->ld[SMOE_ML_QA]->N : 0;
    const uint32_t nq = d->H * (d->dn + d->dr), nq0 = has_qa ? qa : nq, nkv = d->r + d->dr;
    const uint32_t want_n[SMOE_ML_N] = {nq, nkv, hidden, qa, nq0 + nkv};
    const uint32_t want_k[SMOE_ML_N] = {has_qa ? qa : hidden, hidden, d->H * d->dv, hidden,
                                        hidden};
    static const char *names[SMOE_ML_N] = {"q", "kv_a", "o", "q_a", "joint"};
    for (int i = 0; i < SMOE_ML_N; i++) {
        const smoe_linear_desc *l = cfg->ld[i];
        if (l && (l->N != want_n[i] || l->K != want_k[i]))
            return smoe_err_set(err, SMOE_EINVAL,
                                "MLABlock: the %s projection is %u -> %u, expected %u -> %u "
                                "(heads=%u nope=%u rope=%u v=%u kv_lora_rank=%u hidden=%u "
                                "q_lora_rank=%u)",
                                names[i], l->K, l->N, want_k[i], want_n[i], d->H, d->dn, d->dr,
                                d->dv, d->r, hidden, qa);
    }
    return SMOE_OK;
}

/* Floats of buf per token (the layout in mlab_pre_post and mlab_h). */
static size_t mlab_per_token(const smoe_mla_block *b) {
    const smoe_mla_desc *d = b->d;
    return (size_t)b->hidden + b->nq0 + d->r + d->dr + (size_t)d->H * (d->dn + d->dr) +
           (size_t)d->H * (d->dn + d->dr) + (size_t)d->H * d->dv + 3 * (size_t)b->hidden;
}

/* buf and lscratch for at least n tokens (smoe_grow_token_bufs). */
static int mlab_ensure_cap(smoe_mla_block *b, uint32_t n, smoe_err *err) {
    return smoe_grow_token_bufs(&b->buf, &b->lscratch, &b->cap, n, b->max_tokens,
                                mlab_per_token(b), 0, b->ld, SMOE_ML_N, "MLABlock", err);
}

int smoe_mla_block_init(smoe_mla_block *b, const smoe_mla_block_cfg *cfg, smoe_err *err) {
    int rc = smoe_mla_block_check(cfg, err);
    if (rc != SMOE_OK) return rc;
    const smoe_mla_desc *d = cfg->d;
    const uint32_t mt = cfg->max_tokens;
    const int has_qa = cfg->ld[SMOE_ML_QA] != NULL;
    const uint32_t hidden = cfg->ld[SMOE_ML_KVA]->K, qa = has_qa ? cfg->ld[SMOE_ML_QA]->N : 0;
    const uint32_t nq = d->H * (d->dn + d->dr), nq0 = has_qa ? qa : nq;
    b->d = d;
    b->w = cfg->w;
    for (int i = 0; i < SMOE_ML_N; i++) {
        b->ld[i] = cfg->ld[i];
        b->lb[i] = cfg->lb[i];
        b->lbias[i] = cfg->lbias[i];
    }
    b->kvn = cfg->kvn;
    b->qan = has_qa ? cfg->qan : NULL;
    b->hidden = hidden;
    b->qa = qa;
    b->nq0 = nq0;
    b->max_tokens = mt;
    b->kv_eps = (float)cfg->kv_eps;
    b->qa_eps = (float)cfg->qa_eps;
    b->bf16 = cfg->bf16;
    b->rope = cfg->rope;
    b->cap = 0;
    rc = mlab_ensure_cap(b, mt < 16 ? mt : 16, err);
    if (rc != SMOE_OK) return rc;
    if (pthread_mutex_init(&b->mu, NULL) != 0) {
        free(b->buf);
        free(b->lscratch);
        b->buf = NULL;
        b->lscratch = NULL;
        return smoe_err_set(err, SMOE_ENOMEM, "MLABlock: out of memory for its buffers");
    }
    b->ready = 1;
    return SMOE_OK;
}

void smoe_mla_block_destroy(smoe_mla_block *b) {
    if (b->ready) pthread_mutex_destroy(&b->mu);
    b->ready = 0;
    free(b->buf);
    free(b->lscratch);
    free(b->ascratch);
    free(b->route);
    b->buf = NULL;
    b->lscratch = NULL;
    b->ascratch = NULL;
    b->route = NULL;
    b->ascratch_cap = b->route_cap = 0;
    smoe_mlp_bufs_free(&b->mlp_bufs);
}

void smoe_mla_block_set_mlp(smoe_mla_block *b, const smoe_shared_ffn *f) {
    pthread_mutex_lock(&b->mu); /* waits for a layer in flight */
    b->mlp = *f;
    pthread_mutex_unlock(&b->mu);
}

/* One linear slot of the block on nt rows of x (stride ldx) into y (stride ldy). */
static int mlab_linear(smoe_mla_block *self, smoe_kctx *c, int i, const float *x, size_t ldx,
                       uint32_t nt, float *y, size_t ldy, smoe_err *err) {
    return smoe_linear_forward(c, self->ld[i], self->lb[i], self->lbias[i], x, ldx, nt, y, ldy,
                               self->lscratch, err);
}

/* The block's rotary form on `heads` vectors of dr values at x + h * stride, token row ft of
 * the freqs argument (complex: dr / 2 (re, im) pairs; half, interleave: dr cos, dr sin). */
static void mlab_rotary(const smoe_mla_block *self, float *x, uint32_t heads, size_t stride,
                        uint32_t dr, const float *ft, int b) {
    if (self->rope == SMOE_ROPE_COMPLEX)
        smoe_rotary_pairs(x, heads, stride, dr, ft, ft + 1, 2, b);
    else if (self->rope == SMOE_ROPE_HALF)
        smoe_rotary_half(x, heads, stride, dr, ft, ft + dr, b);
    else
        smoe_rotary_interleave(x, heads, stride, dr, ft, ft + dr, b);
}

/* The attention module of a->B rows of a->nt tokens (n = B nt in all), under mu, after
 * mlab_ensure_cap(n), as transformers' DeepSeek-V2 attention in the absorbed form
 * (specmoe.models.mla._absorbed_forward, the same roundings):
 *   x = widen(xp) (RMSNorm-ed with ln1: the decoder layer's input norm)
 *   y = [q_proj | kv_a_proj](x)                 (q_a_proj instead of q_proj with q_lora)
 *   q = y's q part, or q_b_proj(q_a_layernorm(y's q_a part))
 *   c = kv_a_layernorm(y's latent part), k_pe = y's rotary part
 *   q_pe, k_pe rotated (each token at its own position: freqs fp, one row a token)
 *   c, k_pe written at positions S.. of its row's caches cp / kp (f32 or bf16 bits when cb)
 *   o = MLA of each row over its S + nt positions (csrc/kernels/mla.c), then o_proj into
 *   of [n, hidden].
 * The projections run over the n tokens at once; the kernels are batch invariant, so a row's
 * tokens get the bits of its call alone.  Buffer layout (floats, mt = cap): x [mt, hidden],
 * y [mt, nq0 + r + dr], qb [mt, H (dn + dr)], q_nope [B, H, nt, dn], q_pe [B, H, nt, dr]
 * (within mt H dn, mt H dr), att [mt, H dv]; then the block's h, nrm, moe [mt, hidden] each
 * (mlab_h). */
static int mlab_pre_post(smoe_mla_block *self, smoe_kctx *c, const smoe_mla_args *a, float *of,
                         smoe_err *err) {
    const smoe_mla_desc *d = self->d;
    const uint32_t H = d->H, dn = d->dn, dr = d->dr, dv = d->dv, r = d->r, hid = self->hidden;
    const uint32_t nq = H * (dn + dr), nq0 = self->nq0, ny = nq0 + r + dr;
    const uint32_t nt = a->nt, n = a->B * nt, S = a->S;
    const size_t mt = self->cap;
    const int b = self->bf16, cb = a->cb;
    float *x = self->buf, *y = x + mt * hid, *qb = y + mt * ny, *qn = qb + mt * nq;
    float *qp = qn + mt * H * dn, *att = qp + mt * H * dr;
    const void *xp = a->xp;
    const int xb = a->xb;
    const float *fp = a->fp, *ln1 = a->ln1;
    void *cp = a->cp, *kp = a->kp;
    smoe_dec_widen(x, xp, xb, (size_t)n * hid);
    if (ln1) smoe_rmsnorm(x, n, hid, ln1, a->eps1, b); /* the input layernorm */
    int rc;
    if (self->ld[SMOE_ML_JOINT]) {
        rc = mlab_linear(self, c, SMOE_ML_JOINT, x, hid, n, y, ny, err);
    } else {
        rc = mlab_linear(self, c, self->qa ? SMOE_ML_QA : SMOE_ML_Q, x, hid, n, y, ny, err);
        if (rc == SMOE_OK) rc = mlab_linear(self, c, SMOE_ML_KVA, x, hid, n, y + nq0, ny, err);
    }
    if (rc != SMOE_OK) return rc;
    if (b) smoe_bf16_round(y, (size_t)n * ny); /* the projections' bf16 outputs */
    const float *q = y;                          /* token t's q at q + t * qs */
    size_t qs = ny;
    if (self->qa) {
        for (uint32_t t = 0; t < n; t++)
            smoe_rmsnorm(y + (size_t)t * ny, 1, nq0, self->qan, self->qa_eps, b);
        rc = mlab_linear(self, c, SMOE_ML_Q, y, ny, n, qb, nq, err);
        if (rc != SMOE_OK) return rc;
        if (b) smoe_bf16_round(qb, (size_t)n * nq);
        q = qb;
        qs = nq;
    }
    const size_t esz = cb ? 2 : 4;
    for (uint32_t t = 0; t < n; t++) { /* token t: row t / nt, position S + t % nt there */
        const size_t row = t / nt, tt = t % nt, pos = row * a->cap + S + tt;
        float *qt = (float *)q + (size_t)t * qs, *ct = y + (size_t)t * ny + nq0, *kt = ct + r;
        const float *ft = fp + (size_t)t * (self->rope == SMOE_ROPE_COMPLEX ? dr : 2 * dr);
        smoe_rmsnorm(ct, 1, r, self->kvn, self->kv_eps, b); /* kv_a_layernorm */
        mlab_rotary(self, qt + dn, H, dn + dr, dr, ft, b);    /* each head's q_pe */
        mlab_rotary(self, kt, 1, dr, dr, ft, b);
        smoe_dec_store((uint8_t *)cp + pos * r * esz, cb, ct, r);
        smoe_dec_store((uint8_t *)kp + pos * dr * esz, cb, kt, dr);
        for (uint32_t h = 0; h < H; h++) { /* [T, H, dn + dr] -> [B, H, T, dn], [B, H, T, dr] */
            const size_t o = (row * H + h) * nt + tt;
            memcpy(qn + o * dn, qt + (size_t)h * (dn + dr), dn * 4);
            memcpy(qp + o * dr, qt + (size_t)h * (dn + dr) + dn, dr * 4);
        }
    }
    rc = smoe_grow_scratch(&self->ascratch, &self->ascratch_cap,
                           smoe_mla_scratch_bytes(c, d, nt), err);
    const int cdt = cb ? SMOE_WDT_BF16 : SMOE_WDT_F32;
    if (rc == SMOE_OK)
        rc = smoe_mla_decode(c, d, a->B, nt, S + nt, qn, qp, cp, cdt, (size_t)a->cap * r, kp,
                             cdt, (size_t)a->cap * dr, self->w, a->bias, a->bias_rows, att,
                             self->ascratch, self->ascratch_cap, err);
    if (rc != SMOE_OK) return rc;
    if (b) smoe_bf16_round(att, (size_t)n * H * dv); /* .to(the model's dtype) */
    rc = mlab_linear(self, c, SMOE_ML_O, att, (size_t)H * dv, n, of, hid, err);
    if (rc == SMOE_OK && b) smoe_bf16_round(of, (size_t)n * hid);
    return rc;
}

/* The layer's h [cap, hidden] in buf, after mlab_pre_post's buffers; nrm and moe follow it. */
static float *mlab_h(const smoe_mla_block *self) {
    return self->buf + (size_t)self->cap * (mlab_per_token(self) - 3 * (size_t)self->hidden);
}

int smoe_mla_block_attn(smoe_mla_block *self, smoe_kctx *c, const smoe_mla_args *a, void *op,
                        void *np_, smoe_err *err) {
    const uint32_t nt = a->B * a->nt; /* every row's tokens */
    const size_t n = (size_t)nt * self->hidden;
    pthread_mutex_lock(&self->mu);
    int rc = mlab_ensure_cap(self, nt, err);
    float *h = rc == SMOE_OK ? mlab_h(self) : NULL;
    if (rc == SMOE_OK) rc = mlab_pre_post(self, c, a, h, err);
    if (rc == SMOE_OK) {
        smoe_dec_residual_add(self->bf16, h, a->xp, a->xb, n); /* h = x + attention */
        smoe_dec_store(op, a->xb, h, n);
        smoe_rmsnorm(h, nt, self->hidden, a->ln2, a->eps2, self->bf16);
        smoe_dec_store(np_, a->xb, h, n);
    }
    pthread_mutex_unlock(&self->mu);
    return rc;
}

int smoe_mla_block_layer(smoe_mla_block *self, smoe_kctx *c, smoe_layers *g,
                         const smoe_mla_layer_args *l, double *ta, double *tm, smoe_err *err) {
    const smoe_mla_args *a = &l->a;
    const uint32_t hid = self->hidden, nt = a->B * a->nt; /* every row's tokens */
    pthread_mutex_lock(&self->mu);
    double t0 = smoe_now(), t1 = t0;
    int rc = mlab_ensure_cap(self, nt, err);
    float *h = NULL, *nrm = NULL, *moe = NULL;
    if (rc == SMOE_OK) {
        h = mlab_h(self);
        nrm = h + (size_t)self->cap * hid;
        moe = nrm + (size_t)self->cap * hid;
        rc = mlab_pre_post(self, c, a, h, err);
    }
    const smoe_dense_mlp mlp = {c, &self->mlp, &self->mlp_bufs};
    if (rc == SMOE_OK && !g && !self->mlp.d[0]) /* set_mlp(None) since the call was checked */
        rc = smoe_err_set(err, SMOE_ESTATE, "MLABlock.layer: the block's MLP was removed");
    if (rc == SMOE_OK) /* the MoE block (or the dense MLP) over every row's tokens */
        rc = smoe_dec_tail(self->bf16, g, &mlp, (uint32_t)l->pos, l->flags, nt, hid, h, a->xp,
                           a->xb, a->ln2, a->eps2, 0, nrm, moe, &self->route,
                           &self->route_cap, l->op, a->xb, &t1, err);
    double t2 = smoe_now();
    pthread_mutex_unlock(&self->mu);
    *ta = t1 - t0;
    *tm = t2 - t1;
    return rc;
}

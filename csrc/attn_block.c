/* A Llama-family decoder layer's attention module at decode sizes (decoder.h): projections,
 * q/k norms, rotary, attention, output projection, and the whole decoder layer with its MoE
 * block.  The state of specmoe._C.AttnBlock (csrc/bindings/py_attn.c). */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "decoder_impl.h"
#include "kernels/block.h"

int smoe_qknorm_kind(const char *name) {
    return !strcmp(name, "none")   ? SMOE_QKNORM_NONE
           : !strcmp(name, "full") ? SMOE_QKNORM_FULL
           : !strcmp(name, "head") ? SMOE_QKNORM_HEAD
                                   : -1;
}

int smoe_attn_block_check(const smoe_attn_block_cfg *cfg, smoe_err *err) {
    const uint32_t H = cfg->H, Hkv = cfg->Hkv, D = cfg->D, max_tokens = cfg->max_tokens;
    const double eps = cfg->eps;
    if (H < 1 || Hkv < 1 || H % Hkv || D < 2 || D % 2 || H > 65536 || D > 65536 ||
        (uint64_t)(H + 2 * (uint64_t)Hkv) * D > (1u << 24) || max_tokens < 1 ||
        max_tokens > 4096 || !(eps >= 0.0) || eps > 1.0)
        return smoe_err_set(err, SMOE_EINVAL,
                            "AttnBlock: heads=%u kv_heads=%u head_dim=%u max_tokens=%u eps=%g out "
                            "of range (heads a multiple of kv_heads, head_dim even, (heads + 2 "
                            "kv_heads) * head_dim <= 2^24, max_tokens 1..4096, eps in [0, 1])",
                            H, Hkv, D, max_tokens, eps);
    if (cfg->rot % 2 || cfg->rot > D)
        return smoe_err_set(err, SMOE_EINVAL,
                            "AttnBlock: rotary_dim=%u must be even and at most head_dim=%u (0: "
                            "head_dim)", cfg->rot, D);
    for (uint32_t h = 0; cfg->sinks && h < H; h++)
        if (!isfinite(cfg->sinks[h]))
            return smoe_err_set(err, SMOE_EINVAL, "AttnBlock: sinks[%u] is not finite", h);
    const uint32_t hidden = cfg->ld[SMOE_AB_Q]->K, G = cfg->gate ? 2 : 1;
    const uint32_t want_n[SMOE_AB_N] = {G * H * D, Hkv * D, Hkv * D, hidden,
                                        (G * H + 2 * Hkv) * D};
    const uint32_t want_k[SMOE_AB_N] = {hidden, hidden, hidden, H * D, hidden};
    static const char *names[SMOE_AB_N] = {"q", "k", "v", "o", "qkv"};
    for (int i = 0; i < SMOE_AB_N; i++) {
        const smoe_linear_desc *d = cfg->ld[i];
        if (d && (d->N != want_n[i] || d->K != want_k[i]))
            return smoe_err_set(err, SMOE_EINVAL,
                                "AttnBlock: the %s projection is %u -> %u, expected %u -> %u "
                                "(heads=%u kv_heads=%u head_dim=%u hidden=%u)",
                                names[i], d->K, d->N, want_k[i], want_n[i], H, Hkv, D, hidden);
    }
    return SMOE_OK;
}

/* buf and lscratch for at least n tokens (smoe_grow_token_bufs): per token x, q|k|v, the
 * attention output, then q, h, nrm, moe, then (gated) the projections' rows and the gate; two
 * rotary rows of D after them. */
static int ensure_cap(smoe_attn_block *b, uint32_t n, smoe_err *err) {
    const size_t H = b->H, Hkv = b->Hkv, D = b->D, hid = b->hidden;
    const size_t per_tok = hid + (H + 2 * Hkv) * D + H * D + H * D + 3 * hid +
                           (b->gate ? (3 * H + 2 * Hkv) * D : 0);
    return smoe_grow_token_bufs(&b->buf, &b->lscratch, &b->cap, n, b->max_tokens, per_tok,
                                2 * D, b->ld, SMOE_AB_N, "AttnBlock", err);
}

/* The gated block's regions of buf (ensure_cap): the projections' rows [cap, (2 H + 2 Hkv)
 * D] as q_proj gives them, then the gate [cap, H D]. */
static float *gated_rows(const smoe_attn_block *b) {
    const size_t H = b->H, Hkv = b->Hkv, D = b->D, hid = b->hidden;
    return b->buf + b->cap * (hid + (H + 2 * Hkv) * D + 2 * H * D + 3 * hid);
}
static float *gate_of(const smoe_attn_block *b) {
    return gated_rows(b) + (size_t)b->cap * (2 * b->H + 2 * b->Hkv) * b->D;
}

int smoe_attn_block_init(smoe_attn_block *b, const smoe_attn_block_cfg *cfg, smoe_err *err) {
    int rc = smoe_attn_block_check(cfg, err);
    if (rc != SMOE_OK) return rc;
    for (int i = 0; i < SMOE_AB_N; i++) {
        b->ld[i] = cfg->ld[i];
        b->lb[i] = cfg->lb[i];
        b->lbias[i] = cfg->lbias[i];
    }
    b->H = cfg->H;
    b->Hkv = cfg->Hkv;
    b->D = cfg->D;
    b->hidden = cfg->ld[SMOE_AB_Q]->K;
    b->max_tokens = cfg->max_tokens;
    b->gate = cfg->gate != 0; /* (before ensure_cap: the gated regions) */
    b->cap = 0;
    rc = ensure_cap(b, cfg->max_tokens < 16 ? cfg->max_tokens : 16, err);
    if (rc == SMOE_OK && pthread_mutex_init(&b->mu, NULL) != 0)
        rc = smoe_err_set(err, SMOE_ESTATE, "AttnBlock: pthread_mutex_init failed");
    if (rc != SMOE_OK) {
        free(b->buf);
        free(b->lscratch);
        b->buf = NULL;
        b->lscratch = NULL;
        b->cap = 0;
        return rc;
    }
    b->qn = cfg->norm == SMOE_QKNORM_NONE ? NULL : cfg->qn;
    b->kn = cfg->norm == SMOE_QKNORM_NONE ? NULL : cfg->kn;
    b->norm = cfg->norm;
    b->eps = (float)cfg->eps;
    b->bf16 = cfg->bf16;
    b->rot = cfg->rot ? cfg->rot : cfg->D;
    b->zc = cfg->zc != 0;
    b->sinks = cfg->sinks;
    b->pairs = cfg->pairs;
    b->ready = 1;
    return SMOE_OK;
}

void smoe_attn_block_destroy(smoe_attn_block *b) {
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

void smoe_attn_block_set_mlp(smoe_attn_block *b, const smoe_shared_ffn *f) {
    pthread_mutex_lock(&b->mu); /* waits for a call in flight */
    b->mlp = *f;
    pthread_mutex_unlock(&b->mu);
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

/* smoe_attn_block_pre without the lock: B rows of nt tokens each (B * nt tokens in all). */
static int block_pre(smoe_attn_block *self, smoe_kctx *c, const void *xp, int xb, const void *cp,
                     int cb, const void *sp, int sb, uint32_t B, uint32_t nt, const float *ln,
                     float ln_eps, float *qp, void *kp, int kb, void *vp, int vb, size_t kv_bs,
                     size_t kv_hs, smoe_err *err) {
    const uint32_t H = self->H, Hkv = self->Hkv, D = self->D, hid = self->hidden;
    const uint32_t nq = H * D, nkv = Hkv * D, qkv = nq + 2 * nkv, n = B * nt, R = self->rot;
    const uint32_t G = self->gate ? 2 : 1, pw = G * nq + 2 * nkv; /* a projection row */
    const float *qn = self->qn, *kn = self->kn;
    float *x = self->buf, *y = self->buf + (size_t)self->cap * hid; /* y [n, q|k|v] */
    float *p = self->gate ? gated_rows(self) : y; /* the projections' rows [n, pw] */
    const float *xin = (const float *)xp;
    int rc = SMOE_OK;
    if (xb || ln) {
        smoe_dec_widen(x, xp, xb, (size_t)n * hid);
        if (ln) smoe_dec_norm(x, n, hid, ln, ln_eps, self->bf16, self->zc); /* input norm */
        xin = x;
    }
    const int joint = self->ld[SMOE_AB_QKV] != NULL;
    if (joint) /* q|k|v in one call: its output rows are p's */
        rc = smoe_linear_forward(c, self->ld[SMOE_AB_QKV], self->lb[SMOE_AB_QKV],
                                 self->lbias[SMOE_AB_QKV], xin, hid, n, p, pw, self->lscratch,
                                 err);
    for (int i = 0; i < 3 && rc == SMOE_OK && !joint; i++) {
        const uint32_t off = i == 0 ? 0 : i == 1 ? G * nq : G * nq + nkv;
        rc = smoe_linear_forward(c, self->ld[i], self->lb[i], self->lbias[i], xin, hid, n,
                                 p + off, pw, self->lscratch, err);
    }
    if (rc != SMOE_OK) return rc;
    const int b = self->bf16;
    float *cosf = self->buf + (size_t)self->cap * (hid + qkv + nq), *sinf = cosf + D;
    if (b) smoe_bf16_round(p, (size_t)n * pw); /* the projections' bf16 outputs */
    if (self->gate) { /* q_proj's head h: D query rows, then D gate rows; y gets q|k|v */
        float *g = gate_of(self);
        for (uint32_t t = 0; t < n; t++) {
            const float *pt = p + (size_t)t * pw;
            for (uint32_t h = 0; h < H; h++) {
                memcpy(y + (size_t)t * qkv + (size_t)h * D, pt + 2 * (size_t)h * D,
                       D * sizeof(float));
                memcpy(g + (size_t)t * nq + (size_t)h * D, pt + (2 * (size_t)h + 1) * D,
                       D * sizeof(float));
            }
            memcpy(y + (size_t)t * qkv + nq, pt + 2 * (size_t)nq, 2 * (size_t)nkv * sizeof(float));
        }
    }
    for (uint32_t t = 0; t < n; t++) { /* every row's token t % nt: its own position's rotary */
        float *qt = y + (size_t)t * qkv, *kt = qt + nq;
        if (self->norm == SMOE_QKNORM_FULL) {
            smoe_dec_norm(qt, 1, nq, qn, self->eps, b, self->zc);
            smoe_dec_norm(kt, 1, nkv, kn, self->eps, b, self->zc);
        } else if (self->norm == SMOE_QKNORM_HEAD) {
            smoe_dec_norm(qt, H, D, qn, self->eps, b, self->zc);
            smoe_dec_norm(kt, Hkv, D, kn, self->eps, b, self->zc);
        }
        /* the first R values of each head rotate (transformers' partial rotary: cos and sin
           are R wide), the rest pass */
        smoe_dec_widen(cosf, (const uint8_t *)cp + (size_t)t * R * (cb ? 2 : 4), cb, R);
        smoe_dec_widen(sinf, (const uint8_t *)sp + (size_t)t * R * (sb ? 2 : 4), sb, R);
        if (self->pairs) {
            smoe_rotary_pairs(qt, H, D, R, cosf, sinf, 1, b);
            smoe_rotary_pairs(kt, Hkv, D, R, cosf, sinf, 1, b);
        } else {
            smoe_rotary_half(qt, H, D, R, cosf, sinf, b);
            smoe_rotary_half(kt, Hkv, D, R, cosf, sinf, b);
        }
    }
    /* q for the attention kernel (f32, values already bf16 when b; row r at r * H nt D); k, v
     * for the cache (row r at r * kv_bs elements) */
    for (uint32_t r = 0; r < B; r++) {
        const float *yr = y + (size_t)r * nt * qkv;
        to_head_major(qp + (size_t)r * nq * nt, 0, (size_t)nt * D, yr, qkv, nt, H, D);
        to_head_major((uint8_t *)kp + r * kv_bs * (kb ? 2 : 4), kb, kv_hs, yr + nq, qkv, nt,
                      Hkv, D);
        to_head_major((uint8_t *)vp + r * kv_bs * (vb ? 2 : 4), vb, kv_hs, yr + nq + nkv, qkv,
                      nt, Hkv, D);
    }
    return SMOE_OK;
}

/* Attention of q ([B, H, T, D]) over S cached positions per row (k, v as smoe_mha_decode
 * takes them), then the output projection into of ([B * T, hidden] f32; rounded to bf16
 * values when the block rounds as a bf16 model); without the lock. */
static int block_post(smoe_attn_block *self, smoe_kctx *c, const float *q, const void *kp,
                      const void *vp, int kdt, size_t kbs, size_t khs, uint32_t B, uint32_t nt,
                      uint32_t S, const float *bias, uint32_t bias_rows, float scale, float *of,
                      smoe_err *err) {
    const uint32_t H = self->H, D = self->D, hid = self->hidden, n = B * nt;
    const uint32_t qkv = (H + 2 * self->Hkv) * D;
    smoe_mha_desc d = {H, self->Hkv, D, scale, self->sinks};
    float *att = self->buf + (size_t)self->cap * (hid + qkv); /* [B, T, H, D] */
    int rc = smoe_grow_scratch(&self->ascratch, &self->ascratch_cap,
                               smoe_mha_scratch_bytes(c, D, nt), err);
    if (rc == SMOE_OK)
        rc = smoe_mha_decode(c, &d, B, nt, S, q, kp, vp, kdt, kbs, khs, bias, bias_rows, att,
                             self->ascratch, self->ascratch_cap, err);
    if (rc != SMOE_OK) return rc;
    if (self->bf16) smoe_bf16_round(att, (size_t)n * H * D); /* torch's bf16 output */
    if (self->gate) { /* attn * sigmoid(gate): torch's sigmoid, then the product, each rounded
                         to bf16 in a bf16 model */
        const float *g = gate_of(self);
        for (size_t i = 0; i < (size_t)n * H * D; i++) {
            float s = 1.0f / (1.0f + expf(-g[i]));
            if (self->bf16) s = smoe_bf16_round1(s);
            const float v = att[i] * s;
            att[i] = self->bf16 ? smoe_bf16_round1(v) : v;
        }
    }
    rc = smoe_linear_forward(c, self->ld[SMOE_AB_O], self->lb[SMOE_AB_O], self->lbias[SMOE_AB_O],
                             att, (size_t)H * D, n, of, hid, self->lscratch, err);
    if (rc == SMOE_OK && self->bf16) smoe_bf16_round(of, (size_t)n * hid);
    return rc;
}

/* pre and post hand the gate from one call to the next through nothing: a gated block runs
 * whole layers only. */
static int no_gate(const smoe_attn_block *b, const char *what, smoe_err *err) {
    return b->gate ? smoe_err_set(err, SMOE_EINVAL,
                                  "AttnBlock.%s: a gated block (gate=True) runs whole decoder "
                                  "layers only (layer)", what)
                   : SMOE_OK;
}

int smoe_attn_block_pre(smoe_attn_block *b, smoe_kctx *c, const void *xp, int xb,
                        const void *cp, int cb, const void *sp, int sb, uint32_t B, uint32_t nt,
                        const float *ln, float ln_eps, float *qp, void *kp, int kb, void *vp,
                        int vb, size_t kv_bs, size_t kv_hs, smoe_err *err) {
    if (no_gate(b, "pre", err)) return err->code;
    pthread_mutex_lock(&b->mu);
    int rc = ensure_cap(b, B * nt, err);
    if (rc == SMOE_OK)
        rc = block_pre(b, c, xp, xb, cp, cb, sp, sb, B, nt, ln, ln_eps, qp, kp, kb, vp, vb,
                       kv_bs, kv_hs, err);
    pthread_mutex_unlock(&b->mu);
    return rc;
}

int smoe_attn_block_post(smoe_attn_block *b, smoe_kctx *c, const float *q, const void *kp,
                         const void *vp, int kdt, size_t kbs, size_t khs, uint32_t B,
                         uint32_t nt, uint32_t S, const float *bias, uint32_t bias_rows,
                         float scale, void *op, int ob, const void *rp, const float *ln,
                         float ln_eps, void *np_, smoe_err *err) {
    const size_t n = (size_t)B * nt * b->hidden;
    if (no_gate(b, "post", err)) return err->code;
    pthread_mutex_lock(&b->mu);
    int rc = ensure_cap(b, B * nt, err);
    float *of = b->buf; /* [B * T, hidden]: pre's x, free again */
    if (rc == SMOE_OK)
        rc = block_post(b, c, q, kp, vp, kdt, kbs, khs, B, nt, S, bias, bias_rows, scale, of,
                        err);
    if (rc == SMOE_OK && rp) smoe_dec_residual_add(b->bf16, of, rp, ob, n); /* the layer's add */
    if (rc == SMOE_OK) smoe_dec_store(op, ob, of, n);
    if (rc == SMOE_OK && rp) { /* then the post-attention RMSNorm of the sum, in place */
        smoe_dec_norm(of, B * nt, b->hidden, ln, ln_eps, b->bf16, b->zc);
        smoe_dec_store(np_, ob, of, n);
    }
    pthread_mutex_unlock(&b->mu);
    return rc;
}

int smoe_attn_block_layer(smoe_attn_block *self, smoe_kctx *c, smoe_layers *g,
                          const smoe_attn_layer_args *a, double *ta, double *tm, smoe_err *err) {
    const uint32_t H = self->H, Hkv = self->Hkv, D = self->D, hid = self->hidden, nt = a->nt;
    const uint32_t B = a->B, n = B * nt; /* every row's tokens */
    const size_t esz = a->kb ? 2 : 4, kv_hs = (size_t)a->cap * D, S = (size_t)a->S;
    pthread_mutex_lock(&self->mu);
    int rc = ensure_cap(self, n, err);
    const size_t mt = self->cap;
    float *extra = self->buf + mt * (hid + (size_t)(H + 2 * Hkv) * D + (size_t)H * D) + 2 * D;
    float *q = extra, *h = q + mt * H * D, *nrm = h + mt * hid, *moe = nrm + mt * hid;
    double t0 = smoe_now(), t1 = t0;
    /* input norm, projections, q/k norms, rotary; k, v appended at S */
    if (rc == SMOE_OK)
        rc = block_pre(self, c, a->xp, a->xb, a->cp, a->cb, a->sp, a->sb, B, nt, a->ln1,
                       a->eps1, q, a->kp + S * D * esz, a->kb, a->vp + S * D * esz, a->kb,
                       (size_t)Hkv * kv_hs, kv_hs, err);
    if (rc == SMOE_OK) /* attention over the S + T positions of each row, output projection */
        rc = block_post(self, c, q, a->kp, a->vp, a->kb ? SMOE_WDT_BF16 : SMOE_WDT_F32,
                        (size_t)Hkv * kv_hs, kv_hs, B, nt, (uint32_t)(S + nt), a->bias,
                        a->bias_rows, (float)a->scale, h, err);
    const smoe_dense_mlp mlp = {c, &self->mlp, &self->mlp_bufs};
    if (rc == SMOE_OK && !g && !self->mlp.d[0]) /* set_mlp(None) since the call was checked */
        rc = smoe_err_set(err, SMOE_ESTATE, "AttnBlock.layer: the block's MLP was removed");
    if (rc == SMOE_OK) /* the MoE block (or the dense MLP) over every row's tokens */
        rc = smoe_dec_tail(self->bf16, g, &mlp, (uint32_t)a->pos, a->flags, n, hid, h, a->xp,
                           a->xb, a->ln2, a->eps2, self->zc, nrm, moe, &self->route,
                           &self->route_cap, a->op, a->ob, &t1, err);
    double t2 = smoe_now();
    pthread_mutex_unlock(&self->mu);
    *ta = t1 - t0;
    *tm = t2 - t1;
    return rc;
}

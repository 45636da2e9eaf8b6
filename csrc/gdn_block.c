/* A gated DeltaNet module (the linear attention of Qwen3.5's MoE models) for one decode token
 * of each of B sequences: the four input projections, the depthwise short convolution over the
 * cached window, the gate terms, the gated delta rule (smoe_gated_delta), the gated RMSNorm and
 * the output projection, in one call (decoder.h, smoe_gdn_block_step); or for T tokens of one
 * sequence on a cache that records the state after each (a speculative verification,
 * smoe_gdn_block_steps).  The state of specmoe._C.GdnBlock (csrc/bindings/py_gdn.c).
 *
 * transformers runs these steps as some forty torch operations a layer at one token (about 1.4
 * ms of a 3 ms layer on one Zen 2 core at Qwen3.5-35B-A3B's shapes, benchmarks/hybrid_peers.py);
 * here they are plain loops over a few thousand values between the matrix products. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "decoder_impl.h"
#include "kernels/block.h"

int smoe_gdn_block_check(const smoe_gdn_block_cfg *cfg, smoe_err *err) {
    const uint32_t Hk = cfg->Hk, Hv = cfg->Hv, dk = cfg->dk, dv = cfg->dv, K = cfg->K;
    const double eps = cfg->eps;
    if (Hk < 1 || Hv < 1 || Hv % Hk || dk < 1 || dv < 1 || dk > 512 || dv > 512 || Hv > 4096 ||
        K < 2 || K > 16 || cfg->max_rows < 1 || cfg->max_rows > 4096 || !(eps >= 0.0) ||
        eps > 1.0)
        return smoe_err_set(err, SMOE_EINVAL,
                            "GdnBlock: k_heads=%u v_heads=%u k_dim=%u v_dim=%u conv_kernel=%u "
                            "max_rows=%u eps=%g out of range (v_heads a multiple of k_heads, "
                            "head dims 1..512, v_heads <= 4096, conv_kernel 2..16, max_rows "
                            "1..4096, eps in [0, 1])", Hk, Hv, dk, dv, K, cfg->max_rows, eps);
    if (!cfg->conv_w || !cfg->decay || !cfg->dt_bias || !cfg->norm_w || !cfg->ld[SMOE_GB_OUT] ||
        cfg->n_in < 1 || cfg->n_in > SMOE_GB_IN_MAX)
        return smoe_err_set(err, SMOE_EINVAL, "GdnBlock: a weight is missing, or %u input "
                            "projections (1..%d)", cfg->n_in, SMOE_GB_IN_MAX);
    const smoe_linear_desc *od = cfg->ld[SMOE_GB_OUT];
    const uint32_t hidden = od->N, C = 2 * Hk * dk + Hv * dv, NY = C + Hv * dv + 2 * Hv;
    if (od->K != Hv * dv)
        return smoe_err_set(err, SMOE_EINVAL, "GdnBlock: the out projection is %u -> %u, "
                            "expected %u -> %u", od->K, od->N, Hv * dv, hidden);
    uint64_t n = 0;
    for (uint32_t i = 0; i < cfg->n_in; i++) {
        const smoe_linear_desc *d = cfg->ld[i];
        if (!d || d->K != hidden)
            return smoe_err_set(err, SMOE_EINVAL, "GdnBlock: input projection %u is %s%u -> "
                                "%u, expected hidden=%u inputs", i, d ? "" : "missing: ",
                                d ? d->K : 0, d ? d->N : 0, hidden);
        n += d->N;
    }
    if (n != NY)
        return smoe_err_set(err, SMOE_EINVAL,
                            "GdnBlock: the input projections give %llu values, expected %u "
                            "(q|k|v %u, z %u, b %u, a %u: k_heads=%u v_heads=%u k_dim=%u "
                            "v_dim=%u)", (unsigned long long)n, NY, C, Hv * dv, Hv, Hv, Hk, Hv,
                            dk, dv);
    if (cfg->order) { /* a permutation of 0..NY-1 */
        uint8_t *seen = calloc(NY, 1);
        if (!seen) return smoe_err_set(err, SMOE_ENOMEM, "GdnBlock: out of memory");
        uint32_t j = 0;
        for (; j < NY; j++) {
            const int32_t o = cfg->order[j];
            if (o < 0 || (uint32_t)o >= NY || seen[o]) break;
            seen[o] = 1;
        }
        free(seen);
        if (j < NY)
            return smoe_err_set(err, SMOE_EINVAL, "GdnBlock: order is not a permutation of "
                                "0..%u (entry %u)", NY - 1, j);
    }
    return SMOE_OK;
}

/* Floats of buf per row: x, the projections as the inputs give them, y = [qkv | z | b | a], u
 * (convolved q|k|v), g, beta, the rule's output o, the output projection's result; the layer
 * call's normed input and MoE output. */
static size_t per_row(const smoe_gdn_block *b) {
    const size_t C = b->C, V = (size_t)b->Hv * b->dv, Hv = b->Hv;
    return b->hidden + 2 * (C + V + 2 * Hv) + C + 2 * Hv + V + b->hidden + 2 * (size_t)b->hidden;
}

static int ensure_cap(smoe_gdn_block *b, uint32_t n, smoe_err *err) {
    return smoe_grow_token_bufs(&b->buf, &b->lscratch, &b->cap, n, b->max_rows, per_row(b), 0,
                                b->ld, SMOE_GB_N, "GdnBlock", err);
}

int smoe_gdn_block_init(smoe_gdn_block *b, const smoe_gdn_block_cfg *cfg, smoe_err *err) {
    int rc = smoe_gdn_block_check(cfg, err);
    if (rc != SMOE_OK) return rc;
    for (int i = 0; i < SMOE_GB_N; i++) {
        b->ld[i] = cfg->ld[i];
        b->lb[i] = cfg->lb[i];
        b->lbias[i] = cfg->lbias[i];
    }
    b->n_in = cfg->n_in;
    b->order = cfg->order;
    b->conv_w = cfg->conv_w;
    b->conv_b = cfg->conv_b;
    b->decay = cfg->decay;
    b->dt_bias = cfg->dt_bias;
    b->norm_w = cfg->norm_w;
    b->Hk = cfg->Hk;
    b->Hv = cfg->Hv;
    b->dk = cfg->dk;
    b->dv = cfg->dv;
    b->K = cfg->K;
    b->C = 2 * cfg->Hk * cfg->dk + cfg->Hv * cfg->dv;
    b->hidden = cfg->ld[SMOE_GB_OUT]->N;
    b->max_rows = cfg->max_rows;
    b->eps = (float)cfg->eps;
    b->bf16 = cfg->bf16;
    b->cap = 0;
    rc = ensure_cap(b, cfg->max_rows < 16 ? cfg->max_rows : 16, err);
    if (rc == SMOE_OK && pthread_mutex_init(&b->mu, NULL) != 0)
        rc = smoe_err_set(err, SMOE_ESTATE, "GdnBlock: pthread_mutex_init failed");
    if (rc != SMOE_OK) {
        free(b->buf);
        free(b->lscratch);
        b->buf = NULL;
        b->lscratch = NULL;
        b->cap = 0;
        return rc;
    }
    b->ready = 1;
    return SMOE_OK;
}

void smoe_gdn_block_destroy(smoe_gdn_block *b) {
    if (b->ready) pthread_mutex_destroy(&b->mu);
    b->ready = 0;
    free(b->buf);
    free(b->lscratch);
    free(b->route);
    b->buf = NULL;
    b->lscratch = NULL;
    b->route = NULL;
    b->cap = 0;
    b->route_cap = 0;
}

/* torch's silu and softplus (threshold 20) in f32. */
static inline float silu(float x) { return x / (1.0f + expf(-x)); }
static inline float softplus(float x) { return x > 20.0f ? x : log1pf(expf(x)); }
static inline float rnd(int bf16, float x) { return bf16 ? smoe_bf16_round1(x) : x; }

/* One row's window win [C, K] (f32 or bf16 bits): shifted left by one with the new column x
 * [C] (bf16 values already when the block rounds as bf16), and u = silu(the window's dot with
 * the kernel + bias), as transformers' causal_conv1d_update.  Plain loops over the K values of
 * a channel (a libc memmove a channel cost more than the products). */
static void conv_step(const smoe_gdn_block *b, void *win, int cb, const float *x, float *u) {
    const uint32_t C = b->C, K = b->K;
    for (uint32_t c = 0; c < C; c++) {
        const float *k = b->conv_w + (size_t)c * K;
        float acc = b->conv_b ? b->conv_b[c] : 0.0f;
        if (cb) {
            uint16_t *s = (uint16_t *)win + (size_t)c * K;
            for (uint32_t j = 0; j + 1 < K; j++) {
                s[j] = s[j + 1];
                acc += k[j] * smoe_bf16_f32(s[j]);
            }
            s[K - 1] = smoe_bf16_rne(x[c]);
            acc += k[K - 1] * smoe_bf16_f32(s[K - 1]);
        } else {
            float *s = (float *)win + (size_t)c * K;
            for (uint32_t j = 0; j + 1 < K; j++) {
                s[j] = s[j + 1];
                acc += k[j] * s[j];
            }
            s[K - 1] = x[c];
            acc += k[K - 1] * x[c];
        }
        u[c] = rnd(b->bf16, silu(acc));
    }
}

/* The pieces of the module over buf (per_row's layout for cap rows), shared by one token of B
 * sequences (gdn_step) and T tokens of one sequence (gdn_steps). */
typedef struct gdn_bufs {
    float *x, *yr, *y, *u, *g, *beta, *o, *of;
} gdn_bufs;

static gdn_bufs gdn_layout(const smoe_gdn_block *self) {
    const size_t cap = self->cap, C = self->C, V = (size_t)self->Hv * self->dv;
    const size_t NY = C + V + 2 * (size_t)self->Hv;
    gdn_bufs p;
    p.x = self->buf;
    p.yr = p.x + cap * self->hidden;
    p.y = p.yr + cap * NY;
    p.u = p.y + cap * NY;
    p.g = p.u + cap * C;
    p.beta = p.g + cap * self->Hv;
    p.o = p.beta + cap * self->Hv;
    p.of = p.o + cap * V;
    return p;
}

/* y [n, NY] = the input projections of n rows of x (f32, or bf16 bits when xb) in y's order,
 * rounded to bf16 when the block rounds so. */
static int gdn_in(smoe_gdn_block *self, smoe_kctx *c, const gdn_bufs *p, const void *xp, int xb,
                  uint32_t n, smoe_err *err) {
    const uint32_t hid = self->hidden, NY = self->C + self->Hv * self->dv + 2 * self->Hv;
    smoe_dec_widen(p->x, xp, xb, (size_t)n * hid);
    int rc = SMOE_OK;
    float *proj = self->order ? p->yr : p->y; /* the inputs' outputs side by side, rows of NY */
    for (uint32_t i = 0, off = 0; i < self->n_in && rc == SMOE_OK; off += self->ld[i]->N, i++)
        rc = smoe_linear_forward(c, self->ld[i], self->lb[i], self->lbias[i], p->x, hid, n,
                                 proj + off, NY, self->lscratch, err);
    if (rc != SMOE_OK) return rc;
    if (self->order) /* into y's order: [q|k|v | z | b | a] */
        for (uint32_t r = 0; r < n; r++)
            for (uint32_t j = 0; j < NY; j++)
                p->y[(size_t)r * NY + j] = p->yr[(size_t)r * NY + (uint32_t)self->order[j]];
    if (self->bf16) smoe_bf16_round(p->y, (size_t)n * NY); /* the projections' bf16 outputs */
    return SMOE_OK;
}

/* Row r's gate terms from its y: beta = sigmoid(b), g = decay * softplus(a + dt_bias). */
static void gdn_gates(const smoe_gdn_block *self, const gdn_bufs *p, uint32_t r) {
    const uint32_t Hv = self->Hv, C = self->C, V = Hv * self->dv, NY = C + V + 2 * Hv;
    const float *br = p->y + (size_t)r * NY + C + V, *ar = br + Hv;
    for (uint32_t h = 0; h < Hv; h++) {
        p->beta[(size_t)r * Hv + h] = rnd(self->bf16, 1.0f / (1.0f + expf(-br[h])));
        p->g[(size_t)r * Hv + h] = self->decay[h] * softplus(ar[h] + self->dt_bias[h]);
    }
}

/* The rule of row r's q|k|v (u's thirds) on state [Hv, dk, dv]: its output into o's row r. */
static int gdn_rule(smoe_gdn_block *self, smoe_kctx *c, const gdn_bufs *p, uint32_t r,
                    float *state, smoe_err *err) {
    const uint32_t Hk = self->Hk, Hv = self->Hv, dk = self->dk, dv = self->dv;
    const float *ur = p->u + (size_t)r * self->C;
    return smoe_gated_delta(c, ur, ur + (size_t)Hk * dk, ur + (size_t)2 * Hk * dk,
                            p->g + (size_t)r * Hv, p->beta + (size_t)r * Hv, state,
                            p->o + (size_t)r * Hv * dv, 1, 1, Hk, Hv, dk, dv, 1, err);
}

/* n rows of the rule's output o through the gated RMSNorm and the output projection into of. */
static int gdn_out(smoe_gdn_block *self, smoe_kctx *c, const gdn_bufs *p, uint32_t n,
                   smoe_err *err) {
    const uint32_t Hv = self->Hv, C = self->C, V = Hv * self->dv, NY = C + V + 2 * Hv;
    const int bf = self->bf16;
    if (bf) smoe_bf16_round(p->o, (size_t)n * V); /* the rule's output in the model's dtype */
    smoe_rmsnorm(p->o, n * Hv, self->dv, self->norm_w, self->eps, bf);
    for (uint32_t r = 0; r < n; r++) {
        const float *z = p->y + (size_t)r * NY + C;
        float *orow = p->o + (size_t)r * V;
        for (uint32_t i = 0; i < V; i++) orow[i] = rnd(bf, orow[i] * silu(z[i]));
    }
    int rc = smoe_linear_forward(c, self->ld[SMOE_GB_OUT], self->lb[SMOE_GB_OUT],
                                 self->lbias[SMOE_GB_OUT], p->o, V, n, p->of, self->hidden,
                                 self->lscratch, err);
    if (rc == SMOE_OK && bf) smoe_bf16_round(p->of, (size_t)n * self->hidden); /* out_proj's */
    return rc;
}

/* The module for B rows of x (f32, or bf16 bits when xb) without the lock; *res: its output
 * [B, hidden] (f32, bf16 values when the block rounds as bf16) in buf. */
static int gdn_step(smoe_gdn_block *self, smoe_kctx *c, const void *xp, int xb, uint32_t B,
                    void *conv, int cb, float *state, float **res, smoe_err *err) {
    const uint32_t Hv = self->Hv, dk = self->dk, dv = self->dv, C = self->C;
    const uint32_t NY = C + Hv * dv + 2 * Hv;
    const gdn_bufs p = gdn_layout(self);
    int rc = gdn_in(self, c, &p, xp, xb, B, err);
    if (rc != SMOE_OK) return rc;
    for (uint32_t r = 0; r < B; r++) {
        conv_step(self, (uint8_t *)conv + (size_t)r * C * self->K * (cb ? 2 : 4), cb,
                  p.y + (size_t)r * NY, p.u + (size_t)r * C);
        gdn_gates(self, &p, r);
    }
    /* q, k, v of row r are u's thirds: [B, T = 1, heads, dim] with a row stride of C, which
     * smoe_gated_delta reads as contiguous only for B = 1; rows one call each otherwise */
    for (uint32_t r = 0; r < B && rc == SMOE_OK; r++)
        rc = gdn_rule(self, c, &p, r, state + (size_t)r * Hv * dk * dv, err);
    if (rc == SMOE_OK) rc = gdn_out(self, c, &p, B, err);
    *res = p.of;
    return rc;
}

/* Token t's column of a sequence's window conv [C, L] (f32 or bf16 bits): column col := x
 * [C] (bf16 values already when the block rounds as bf16), and u = silu(the dot of the K
 * columns ending there with the kernel + bias), the products in conv_step's order. */
static void conv_col(const smoe_gdn_block *b, void *conv, int cb, uint32_t L, uint32_t col,
                     const float *x, float *u) {
    const uint32_t C = b->C, K = b->K;
    for (uint32_t c = 0; c < C; c++) {
        const float *k = b->conv_w + (size_t)c * K;
        float acc = b->conv_b ? b->conv_b[c] : 0.0f;
        if (cb) {
            uint16_t *s = (uint16_t *)conv + (size_t)c * L + col + 1 - K;
            s[K - 1] = smoe_bf16_rne(x[c]);
            for (uint32_t j = 0; j < K; j++) acc += k[j] * smoe_bf16_f32(s[j]);
        } else {
            float *s = (float *)conv + (size_t)c * L + col + 1 - K;
            s[K - 1] = x[c];
            for (uint32_t j = 0; j < K; j++) acc += k[j] * s[j];
        }
        u[c] = rnd(b->bf16, silu(acc));
    }
}

int smoe_gdn_block_step(smoe_gdn_block *b, smoe_kctx *c, const void *xp, int xb, uint32_t B,
                        void *conv, int cb, float *state, void *outp, int ob, smoe_err *err) {
    if (!b->ready) return smoe_err_set(err, SMOE_ESTATE, "GdnBlock: not initialised");
    if (B < 1 || B > b->max_rows)
        return smoe_err_set(err, SMOE_EINVAL, "GdnBlock: %u rows, expected 1..%u (max_rows)", B,
                            b->max_rows);
    pthread_mutex_lock(&b->mu);
    float *of = NULL;
    int rc = ensure_cap(b, B, err);
    if (rc == SMOE_OK) rc = gdn_step(b, c, xp, xb, B, conv, cb, state, &of, err);
    if (rc == SMOE_OK) smoe_dec_store(outp, ob, of, (size_t)B * b->hidden);
    pthread_mutex_unlock(&b->mu);
    return rc;
}

int smoe_gdn_block_steps(smoe_gdn_block *b, smoe_kctx *c, const void *xp, int xb, uint32_t T,
                         void *conv, int cb, uint32_t L, float *state, float *hist, void *outp,
                         int ob, smoe_err *err) {
    if (!b->ready) return smoe_err_set(err, SMOE_ESTATE, "GdnBlock: not initialised");
    if (T < 1 || T > b->max_rows || L < T + b->K - 1)
        return smoe_err_set(err, SMOE_EINVAL, "GdnBlock.steps: %u tokens, expected 1..%u "
                            "(max_rows), and a window of %u columns, expected >= tokens + "
                            "kernel - 1 = %u", T, b->max_rows, L, T + b->K - 1);
    const uint32_t Hk = b->Hk, dk = b->dk, C = b->C, NY = C + b->Hv * b->dv + 2 * b->Hv;
    pthread_mutex_lock(&b->mu);
    int rc = ensure_cap(b, T, err);
    const gdn_bufs p = gdn_layout(b);
    if (rc == SMOE_OK) rc = gdn_in(b, c, &p, xp, xb, T, err);
    if (rc == SMOE_OK) {
        /* token by token the window's column and the gates, then the rule over the T tokens
         * (gdn_step's, a head's state kept in cache from one token to the next) */
        for (uint32_t t = 0; t < T; t++) {
            conv_col(b, conv, cb, L, L - T + t, p.y + (size_t)t * NY, p.u + (size_t)t * C);
            gdn_gates(b, &p, t);
        }
        rc = smoe_gated_delta_seq(c, p.u, p.u + (size_t)Hk * dk, p.u + (size_t)2 * Hk * dk, C,
                                  C, p.g, p.beta, state, hist, p.o, T, Hk, b->Hv, dk, b->dv,
                                  1, err);
    }
    if (rc == SMOE_OK) rc = gdn_out(b, c, &p, T, err);
    if (rc == SMOE_OK) smoe_dec_store(outp, ob, p.of, (size_t)T * b->hidden);
    pthread_mutex_unlock(&b->mu);
    return rc;
}

int smoe_gdn_block_layer(smoe_gdn_block *b, smoe_kctx *c, smoe_layers *g,
                         const smoe_gdn_layer_args *a, double *ta, double *tm, smoe_err *err) {
    if (!b->ready) return smoe_err_set(err, SMOE_ESTATE, "GdnBlock: not initialised");
    const uint32_t B = a->B, hid = b->hidden;
    if (B < 1 || B > b->max_rows)
        return smoe_err_set(err, SMOE_EINVAL, "GdnBlock: %u rows, expected 1..%u (max_rows)", B,
                            b->max_rows);
    const double t0 = smoe_now();
    double t1 = t0;
    pthread_mutex_lock(&b->mu);
    int rc = ensure_cap(b, B, err);
    float *of = NULL;
    /* the normed input and the MoE output: the last 2 cap hidden floats of buf */
    float *nrm = b->buf + (size_t)b->cap * (per_row(b) - 2 * (size_t)hid);
    float *moe = nrm + (size_t)b->cap * hid;
    if (rc == SMOE_OK) { /* input norm, the module */
        smoe_dec_widen(nrm, a->xp, a->xb, (size_t)B * hid);
        smoe_dec_norm(nrm, B, hid, a->ln1, a->eps1, b->bf16, a->zc);
        rc = gdn_step(b, c, nrm, 0, B, a->conv, a->cb, a->state, &of, err);
    }
    if (rc == SMOE_OK) /* residual add, post-attention norm, the MoE block, residual add */
        rc = smoe_dec_tail(b->bf16, g, NULL, (uint32_t)a->pos, a->flags, B, hid, of, a->xp,
                           a->xb, a->ln2, a->eps2, a->zc, nrm, moe, &b->route, &b->route_cap,
                           a->op, a->xb, &t1, err);
    const double t2 = smoe_now();
    pthread_mutex_unlock(&b->mu);
    *ta = t1 - t0;
    *tm = t2 - t1;
    return rc;
}

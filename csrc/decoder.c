/* Decoder-layer pieces shared by the attention blocks, layer chains and the decode plan
 * (decoder.h). */
#include <stdlib.h>
#include <string.h>

#include "decoder_impl.h"
#include "kernels/block.h"
#include "spec/verify.h"

int smoe_grow_scratch(void **scratch, size_t *cap, size_t need, smoe_err *err) {
    if (need <= *cap) return SMOE_OK;
    void *p = realloc(*scratch, need);
    if (!p) return smoe_err_set(err, SMOE_ENOMEM, "attention: %zu bytes of scratch", need);
    *scratch = p;
    *cap = need;
    return SMOE_OK;
}

int smoe_grow_token_bufs(float **buf, void **lscratch, uint32_t *cap, uint32_t n,
                         uint32_t max_tokens, size_t per_tok, size_t extra,
                         const smoe_linear_desc *const *ld, int nld, const char *what,
                         smoe_err *err) {
    if (n <= *cap && *buf) return SMOE_OK;
    uint32_t c = *cap * 2 > n ? *cap * 2 : n;
    if (c > max_tokens) c = max_tokens;
    size_t ls = 0;
    for (int i = 0; i < nld; i++) {
        size_t s = ld[i] ? smoe_linear_scratch_bytes(ld[i], c) : 0;
        if (s > ls) ls = s;
    }
    float *nb = malloc(((size_t)c * per_tok + extra) * sizeof(float));
    void *nl = malloc(ls ? ls : 1);
    if (!nb || !nl) {
        free(nb);
        free(nl);
        return smoe_err_set(err, SMOE_ENOMEM, "%s: out of memory for buffers of %u tokens",
                            what, c);
    }
    free(*buf);
    free(*lscratch);
    *buf = nb;
    *lscratch = nl;
    *cap = c;
    return SMOE_OK;
}

void smoe_dec_widen(float *dst, const void *src, int bf16, size_t n) {
    if (!bf16) {
        memcpy(dst, src, n * sizeof(float));
        return;
    }
    const uint16_t *h = (const uint16_t *)src;
    for (size_t i = 0; i < n; i++) dst[i] = smoe_bf16_f32(h[i]);
}

void smoe_dec_store(void *dst, int ob, const float *src, size_t n) {
    if (ob)
        for (size_t i = 0; i < n; i++) ((uint16_t *)dst)[i] = smoe_bf16_rne(src[i]);
    else
        memcpy(dst, src, n * sizeof(float));
}

void smoe_dec_residual_add(int bf16, float *of, const void *rp, int rb, size_t n) {
    for (size_t i = 0; i < n; i++)
        of[i] += rb ? smoe_bf16_f32(((const uint16_t *)rp)[i]) : ((const float *)rp)[i];
    if (bf16) smoe_bf16_round(of, n);
}

void smoe_rms_norm_row(const void *x, void *out, int b, const float *w, float eps, int bf16,
                       float *buf, uint32_t n) {
    smoe_dec_widen(buf, x, b, n);
    smoe_rmsnorm(buf, 1, n, w, eps, bf16);
    smoe_dec_store(out, b, buf, n);
}

void smoe_dec_norm(float *x, uint32_t rows, uint32_t n, const float *w, float eps, int bf16,
                   int zc) {
    if (!zc) {
        smoe_rmsnorm(x, rows, n, w, eps, bf16);
        return;
    }
    smoe_rmsnorm(x, rows, n, w, eps, 0); /* x * rsqrt(mean(x^2) + eps) * (1 + w), in f32 */
    if (bf16) smoe_bf16_round(x, (size_t)rows * n);
}

int smoe_dec_tail(int bf16, smoe_layers *g, const smoe_dense_mlp *mlp, uint32_t pos, int flags,
                  uint32_t nt, uint32_t hid, float *h, const void *xp, int xb, const float *ln2,
                  float eps2, int zc2, float *nrm, float *moe, void **route, size_t *route_cap,
                  void *op, int ob, double *t1, smoe_err *err) {
    const size_t n = (size_t)nt * hid;
    smoe_dec_residual_add(bf16, h, xp, xb, n); /* h = x + attention */
    memcpy(nrm, h, n * sizeof(float));
    smoe_dec_norm(nrm, nt, hid, ln2, eps2, bf16, zc2); /* the post-attention norm */
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
    smoe_dec_residual_add(bf16, moe, h, 0, n); /* out = h + moe */
    smoe_dec_store(op, ob, moe, n);
    return SMOE_OK;
}

int smoe_chain_exec(const smoe_chain_item *it, size_t n, double t[3], smoe_err *err) {
    int rc = SMOE_OK;
    for (size_t i = 0; i < n && rc == SMOE_OK; i++) {
        double a1, m1;
        const smoe_chain_item *c = &it[i];
        if (c->kind == SMOE_CHAIN_MLA)
            rc = smoe_mla_block_layer((smoe_mla_block *)c->blk, c->c, c->g, &c->u.ml, &a1, &m1,
                                      err);
        else if (c->kind == SMOE_CHAIN_GDN)
            rc = smoe_gdn_block_layer((smoe_gdn_block *)c->blk, c->c, c->g, &c->u.gd, &a1, &m1,
                                      err);
        else
            rc = smoe_attn_block_layer((smoe_attn_block *)c->blk, c->c, c->g, &c->u.ab, &a1,
                                       &m1, err);
        t[0] += a1;
        t[c->g ? 1 : 2] += m1; /* a dense layer's second part is its MLP */
    }
    return rc;
}

void smoe_decode_plan_destroy(smoe_decode_plan *p) {
    free(p->it);
    free(p->rows);
    free(p->norm_buf);
    free(p->logit_buf);
    p->it = NULL;
    p->rows = NULL;
    p->norm_buf = NULL;
    p->logit_buf = NULL;
}

int smoe_decode_plan_step(smoe_decode_plan *p, int64_t tok, int64_t S, smoe_kctx *head_c,
                          void *lp, int lb, int argmax, double t[4], int64_t *best,
                          smoe_err *err) {
    for (size_t i = 0; i < p->n; i++) {
        smoe_chain_item *c = &p->it[i];
        if (c->kind == SMOE_CHAIN_MLA)
            c->u.ml.a.S = (uint32_t)S;
        else if (c->kind == SMOE_CHAIN_ATTN)
            c->u.ab.S = S;
    }
    t[0] = t[1] = t[2] = t[3] = 0;
    *best = -1;
    const smoe_plan_row *e = &p->embed;
    if (e->table) memcpy(e->dst, e->table + (size_t)tok * e->row_bytes, e->row_bytes);
    for (size_t i = 0; i < p->nrows; i++) {
        const smoe_plan_row *r = &p->rows[i];
        memcpy(r->dst, r->table + (size_t)S * r->row_bytes, r->row_bytes);
    }
    int rc = smoe_chain_exec(p->it, p->n, t, err);
    double t0 = smoe_now();
    if (rc == SMOE_OK && p->norm_x)
        smoe_rms_norm_row(p->norm_x, p->norm_out, p->nb, p->norm_w, p->norm_eps, p->norm_bf16,
                          p->norm_buf, p->norm_n);
    if (rc == SMOE_OK && p->head)
        rc = p->head(p->head_arg, head_c, p->head_x, p->hb, 1, lp, lb, err);
    t[3] = smoe_now() - t0;
    if (rc == SMOE_OK && argmax) { /* the greedy token of the logits as they are (bf16 rounded) */
        const float *row = (const float *)lp;
        if (lb) {
            smoe_dec_widen(p->logit_buf, lp, lb, p->head_n);
            row = p->logit_buf;
        }
        *best = smoe_spec_argmax(row, p->head_n);
    }
    return rc;
}

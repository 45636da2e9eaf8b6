/* The attention block of csrc/decoder.h (smoe_attn_block: projections, q/k RMSNorm, rotary,
 * attention over a KV cache, output projection) against a naive reference written here with
 * plain loops in double precision, on f32 weights at small shapes (H=4, Hkv=2, D=16,
 * hidden=64).  Three configurations: no q/k norms; norms over all heads with the input
 * RMSNorm in pre and the q|k|v projections in one matrix; per-head norms with post's residual
 * add and post-attention RMSNorm.  Each runs a 3-token prefill (with a causal bias) and two
 * one-token steps on a KV cache this test owns; a fourth with a partial rotary (the first 8
 * values of each head) and the zero-centred norms' code path (f32: the same arithmetic).  Any
 * difference above 1e-4 (relative to the values' scale) fails.  A gated block (q_proj with
 * gate rows) initialises and refuses pre and post.  Built without Python and run under
 * ASan+UBSan by `make sanitize`. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "decoder.h"

enum { H = 4, HKV = 2, D = 16, HID = 64, CAP = 8, NQ = H * D, NKV = HKV * D };

static uint32_t rng_state = 12345u;
static float frand(void) { /* uniform in [-1, 1) */
    rng_state = rng_state * 1664525u + 1013904223u;
    return (float)((rng_state >> 8) & 0xFFFF) / 32768.0f - 1.0f;
}
static void fill(float *x, size_t n, float scale) {
    for (size_t i = 0; i < n; i++) x[i] = frand() * scale;
}

/* y [N] = W [N, K] x [K] */
static void ref_matvec(const float *W, const double *x, double *y, int N, int K) {
    for (int n = 0; n < N; n++) {
        double s = 0;
        for (int k = 0; k < K; k++) s += (double)W[(size_t)n * K + k] * x[k];
        y[n] = s;
    }
}

/* x [n] = w * x / sqrt(mean(x^2) + eps) */
static void ref_rmsnorm(double *x, int n, const float *w, double eps) {
    double ss = 0;
    for (int i = 0; i < n; i++) ss += x[i] * x[i];
    const double r = 1.0 / sqrt(ss / n + eps);
    for (int i = 0; i < n; i++) x[i] = x[i] * r * (w ? w[i] : 1.0);
}

/* rotate-half rotary of the first R values of one head (the rest pass) */
static void ref_rotary(double *x, const float *cs, const float *sn, int R) {
    double o[D];
    for (int i = 0; i < R; i++) {
        const double rot = i < R / 2 ? -x[i + R / 2] : x[i - R / 2];
        o[i] = x[i] * cs[i] + rot * sn[i];
    }
    memcpy(x, o, sizeof(double) * R);
}

typedef struct {
    int norm, ln_in, joint, resid, rot, zc; /* rot: rotary width (0: D) */
} variant;

static int max_err(const char *what, const float *got, const double *want, size_t n) {
    double scale = 1e-3, worst = 0;
    for (size_t i = 0; i < n; i++) scale = fabs(want[i]) > scale ? fabs(want[i]) : scale;
    for (size_t i = 0; i < n; i++) {
        double e = fabs((double)got[i] - want[i]) / scale;
        if (e != e) { /* NaN */
            worst = INFINITY;
            break;
        }
        if (e > worst) worst = e;
    }
    if (!(worst <= 1e-4)) {
        printf("FAIL %s: max relative error %g\n", what, worst);
        return 1;
    }
    return 0;
}

static int run_variant(smoe_kctx *ctx, const variant *v) {
    float *Wq = malloc(sizeof(float) * NQ * HID), *Wk = malloc(sizeof(float) * NKV * HID);
    float *Wv = malloc(sizeof(float) * NKV * HID), *Wo = malloc(sizeof(float) * HID * NQ);
    float *Wqkv = malloc(sizeof(float) * (NQ + 2 * NKV) * HID);
    fill(Wq, NQ * HID, 0.2f);
    fill(Wk, NKV * HID, 0.2f);
    fill(Wv, NKV * HID, 0.2f);
    fill(Wo, HID * NQ, 0.2f);
    memcpy(Wqkv, Wq, sizeof(float) * NQ * HID);
    memcpy(Wqkv + NQ * HID, Wk, sizeof(float) * NKV * HID);
    memcpy(Wqkv + (NQ + NKV) * HID, Wv, sizeof(float) * NKV * HID);
    float qn[NQ], kn[NKV], ln1[HID], ln2[HID];
    for (int i = 0; i < NQ; i++) qn[i] = 1.0f + 0.3f * frand();
    for (int i = 0; i < NKV; i++) kn[i] = 1.0f + 0.3f * frand();
    for (int i = 0; i < HID; i++) ln1[i] = 1.0f + 0.3f * frand();
    for (int i = 0; i < HID; i++) ln2[i] = 1.0f + 0.3f * frand();
    const double eps = 1e-6;

    smoe_linear_desc ld[SMOE_AB_N];
    const uint32_t n_of[SMOE_AB_N] = {NQ, NKV, NKV, HID, NQ + 2 * NKV};
    const uint32_t k_of[SMOE_AB_N] = {HID, HID, HID, NQ, HID};
    float *w_of[SMOE_AB_N] = {Wq, Wk, Wv, Wo, Wqkv};
    smoe_attn_block_cfg cfg;
    memset(&cfg, 0, sizeof cfg);
    smoe_err err;
    smoe_err_clear(&err);
    for (int i = 0; i < SMOE_AB_N; i++) {
        memset(&ld[i], 0, sizeof ld[i]);
        ld[i].N = n_of[i];
        ld[i].K = k_of[i];
        ld[i].dtype = SMOE_WDT_F32;
        ld[i].precise = 1;
        ld[i].w = 0;
        ld[i].w_scale = SMOE_NO_TENSOR;
        if (smoe_linear_desc_check(&ld[i], (uint64_t)n_of[i] * k_of[i] * 4, &err)) {
            printf("FAIL linear desc %d: %s\n", i, err.msg);
            return 1;
        }
        if (i == SMOE_AB_QKV && !v->joint) continue;
        cfg.ld[i] = &ld[i];
        cfg.lb[i] = (const uint8_t *)w_of[i];
    }
    cfg.qn = v->norm ? qn : NULL;
    cfg.kn = v->norm ? kn : NULL;
    cfg.H = H;
    cfg.Hkv = HKV;
    cfg.D = D;
    cfg.max_tokens = 4;
    cfg.norm = v->norm;
    cfg.eps = eps;
    cfg.bf16 = 0;
    cfg.rot = (uint32_t)v->rot;
    cfg.zc = v->zc;
    const int R = v->rot ? v->rot : D;

    /* a bad configuration is refused before anything is allocated */
    smoe_attn_block_cfg bad = cfg;
    bad.Hkv = 3;
    smoe_attn_block blk;
    memset(&blk, 0, sizeof blk);
    if (smoe_attn_block_init(&blk, &bad, &err) != SMOE_EINVAL || blk.buf) {
        printf("FAIL: heads=4 kv_heads=3 accepted\n");
        return 1;
    }
    smoe_attn_block_destroy(&blk); /* a zeroed block destroys cleanly */
    if (smoe_attn_block_init(&blk, &cfg, &err)) {
        printf("FAIL init: %s\n", err.msg);
        return 1;
    }

    /* the KV cache [Hkv, CAP, D] (f32) and its reference copy */
    float *kbuf = calloc((size_t)HKV * CAP * D, sizeof(float));
    float *vbuf = calloc((size_t)HKV * CAP * D, sizeof(float));
    double rk[CAP][NKV], rv[CAP][NKV];
    const int steps[3] = {3, 1, 1};
    int S = 0, fails = 0;
    for (int st = 0; st < 3; st++) {
        const int nt = steps[st];
        float x[4 * HID], cs[4 * D], sn[4 * D], q[NQ * 4], out[4 * HID], normed[4 * HID];
        float bias[4 * CAP];
        fill(x, (size_t)nt * HID, 1.0f);
        for (int t = 0; t < nt; t++) /* [nt, R] */
            for (int i = 0; i < R / 2; i++) {
                const double ang = (S + t) / pow(100.0, 2.0 * i / R);
                cs[t * R + i] = cs[t * R + i + R / 2] = (float)cos(ang);
                sn[t * R + i] = sn[t * R + i + R / 2] = (float)sin(ang);
            }
        const int Sn = S + nt; /* positions after this call */
        for (int t = 0; t < nt; t++) /* causal: token t sees positions <= S + t */
            for (int j = 0; j < Sn; j++) bias[t * Sn + j] = j <= S + t ? 0.0f : -INFINITY;
        const size_t kv_hs = (size_t)CAP * D;
        if (smoe_attn_block_pre(&blk, ctx, x, 0, cs, 0, sn, 0, 1, (uint32_t)nt,
                                v->ln_in ? ln1 : NULL, (float)eps, q, kbuf + (size_t)S * D, 0,
                                vbuf + (size_t)S * D, 0, 0, kv_hs, &err) ||
            smoe_attn_block_post(&blk, ctx, q, kbuf, vbuf, SMOE_WDT_F32, (size_t)HKV * kv_hs,
                                 kv_hs, 1, (uint32_t)nt, (uint32_t)Sn, nt > 1 ? bias : NULL, 1,
                                 (float)(1.0 / sqrt(D)), out, 0, v->resid ? x : NULL, ln2,
                                 (float)eps, v->resid ? normed : NULL, &err)) {
            printf("FAIL step %d: %s\n", st, err.msg);
            return 1;
        }

        /* the reference, token by token */
        double want[4 * HID], want_n[4 * HID], want_q[4 * NQ], want_k[4 * NKV];
        for (int t = 0; t < nt; t++) {
            double xin[HID], qv[NQ], kv[NKV], vv[NKV];
            for (int i = 0; i < HID; i++) xin[i] = x[t * HID + i];
            if (v->ln_in) ref_rmsnorm(xin, HID, ln1, eps);
            ref_matvec(Wq, xin, qv, NQ, HID);
            ref_matvec(Wk, xin, kv, NKV, HID);
            ref_matvec(Wv, xin, vv, NKV, HID);
            if (v->norm == SMOE_QKNORM_FULL) {
                ref_rmsnorm(qv, NQ, qn, eps);
                ref_rmsnorm(kv, NKV, kn, eps);
            } else if (v->norm == SMOE_QKNORM_HEAD) {
                for (int h = 0; h < H; h++) ref_rmsnorm(qv + h * D, D, qn, eps);
                for (int h = 0; h < HKV; h++) ref_rmsnorm(kv + h * D, D, kn, eps);
            }
            for (int h = 0; h < H; h++) ref_rotary(qv + h * D, cs + t * R, sn + t * R, R);
            for (int h = 0; h < HKV; h++) ref_rotary(kv + h * D, cs + t * R, sn + t * R, R);
            memcpy(rk[S + t], kv, sizeof kv);
            memcpy(rv[S + t], vv, sizeof vv);
            memcpy(want_q + t * NQ, qv, sizeof qv);
            memcpy(want_k + t * NKV, kv, sizeof kv);
        }
        for (int t = 0; t < nt; t++) {
            double att[NQ];
            for (int h = 0; h < H; h++) {
                const int g = h / (H / HKV);
                const double *qh = want_q + t * NQ + h * D;
                double sc[CAP], mx = -INFINITY, den = 0;
                for (int j = 0; j <= S + t; j++) {
                    double s = 0;
                    for (int i = 0; i < D; i++) s += qh[i] * rk[j][g * D + i];
                    sc[j] = s / sqrt(D);
                    mx = sc[j] > mx ? sc[j] : mx;
                }
                for (int j = 0; j <= S + t; j++) den += (sc[j] = exp(sc[j] - mx));
                for (int i = 0; i < D; i++) {
                    double o = 0;
                    for (int j = 0; j <= S + t; j++) o += sc[j] / den * rv[j][g * D + i];
                    att[h * D + i] = o;
                }
            }
            ref_matvec(Wo, att, want + t * HID, HID, NQ);
            if (v->resid) {
                for (int i = 0; i < HID; i++) want[t * HID + i] += x[t * HID + i];
                memcpy(want_n + t * HID, want + t * HID, sizeof(double) * HID);
                ref_rmsnorm(want_n + t * HID, HID, ln2, eps);
            }
        }
        /* q as pre wrote it: [H, nt, D] */
        double want_qh[4 * NQ];
        for (int t = 0; t < nt; t++)
            for (int h = 0; h < H; h++)
                for (int i = 0; i < D; i++)
                    want_qh[((size_t)h * nt + t) * D + i] = want_q[t * NQ + h * D + i];
        float got_k[4 * NKV];
        double want_kh[4 * NKV];
        for (int t = 0; t < nt; t++)
            for (int h = 0; h < HKV; h++)
                for (int i = 0; i < D; i++) {
                    got_k[(h * nt + t) * D + i] = kbuf[(size_t)h * kv_hs + (size_t)(S + t) * D + i];
                    want_kh[(h * nt + t) * D + i] = want_k[t * NKV + h * D + i];
                }
        fails += max_err("q", q, want_qh, (size_t)nt * NQ);
        fails += max_err("k cache", got_k, want_kh, (size_t)nt * NKV);
        fails += max_err("out", out, want, (size_t)nt * HID);
        if (v->resid) fails += max_err("normed", normed, want_n, (size_t)nt * HID);
        S = Sn;
    }
    smoe_attn_block_destroy(&blk);
    free(kbuf);
    free(vbuf);
    free(Wq);
    free(Wk);
    free(Wv);
    free(Wo);
    free(Wqkv);
    return fails;
}

/* A gated block (q_proj's rows: per head D query rows, D gate rows) initialises with q of
 * 2 H D rows and refuses q of H D rows, pre and post (it runs whole layers only). */
static int check_gated(smoe_kctx *ctx) {
    smoe_linear_desc ld[4];
    const uint32_t n_of[4] = {2 * NQ, NKV, NKV, HID}, k_of[4] = {HID, HID, HID, NQ};
    float *w = calloc((size_t)2 * NQ * HID, sizeof(float));
    smoe_attn_block_cfg cfg;
    memset(&cfg, 0, sizeof cfg);
    smoe_err err;
    smoe_err_clear(&err);
    for (int i = 0; i < 4; i++) {
        memset(&ld[i], 0, sizeof ld[i]);
        ld[i].N = n_of[i];
        ld[i].K = k_of[i];
        ld[i].dtype = SMOE_WDT_F32;
        ld[i].precise = 1;
        ld[i].w_scale = SMOE_NO_TENSOR;
        if (smoe_linear_desc_check(&ld[i], (uint64_t)n_of[i] * k_of[i] * 4, &err)) {
            printf("FAIL gated linear desc %d: %s\n", i, err.msg);
            free(w);
            return 1;
        }
        cfg.ld[i] = &ld[i];
        cfg.lb[i] = (const uint8_t *)w;
    }
    cfg.H = H, cfg.Hkv = HKV, cfg.D = D, cfg.max_tokens = 4, cfg.eps = 1e-6;
    cfg.gate = 1, cfg.rot = 8, cfg.zc = 1;
    smoe_attn_block blk;
    memset(&blk, 0, sizeof blk);
    int fails = 0;
    smoe_attn_block_cfg half = cfg;
    smoe_linear_desc q1 = ld[0];
    q1.N = NQ;
    half.ld[0] = &q1;
    if (smoe_attn_block_init(&blk, &half, &err) != SMOE_EINVAL || blk.buf) {
        printf("FAIL: a gated block with q of H D rows accepted\n");
        fails++;
    }
    if (smoe_attn_block_init(&blk, &cfg, &err)) {
        printf("FAIL gated init: %s\n", err.msg);
        free(w);
        return fails + 1;
    }
    float x[HID] = {0}, cs[8] = {0}, q[NQ], kv[NKV], out[HID];
    if (smoe_attn_block_pre(&blk, ctx, x, 0, cs, 0, cs, 0, 1, 1, NULL, 0.0f, q, kv, 0, kv, 0,
                            0, D, &err) != SMOE_EINVAL ||
        smoe_attn_block_post(&blk, ctx, q, kv, kv, SMOE_WDT_F32, NKV, D, 1, 1, 1, NULL, 1, 1.0f,
                             out, 0, NULL, NULL, 0.0f, NULL, &err) != SMOE_EINVAL) {
        printf("FAIL: a gated block's pre or post ran\n");
        fails++;
    }
    smoe_attn_block_destroy(&blk);
    free(w);
    printf("gated attention block: %s\n", fails ? "FAIL" : "ok");
    return fails;
}

int main(void) {
    smoe_kctx ctx;
    smoe_err err;
    if (smoe_kctx_init(&ctx, 2, &err)) {
        printf("FAIL kctx: %s\n", err.msg);
        return 1;
    }
    const variant vs[4] = {
        {SMOE_QKNORM_NONE, 0, 0, 0, 0, 0},
        {SMOE_QKNORM_FULL, 1, 1, 0, 0, 0},
        {SMOE_QKNORM_HEAD, 0, 0, 1, 0, 0},
        {SMOE_QKNORM_HEAD, 1, 0, 1, 8, 1},
    };
    int fails = 0;
    for (int i = 0; i < 4; i++) {
        int f = run_variant(&ctx, &vs[i]);
        printf("attention block: norm %d, input norm %d, joint qkv %d, residual %d, rotary %d, "
               "zero-centred %d: %s\n", vs[i].norm, vs[i].ln_in, vs[i].joint, vs[i].resid,
               vs[i].rot ? vs[i].rot : D, vs[i].zc, f ? "FAIL" : "ok");
        fails += f;
    }
    fails += check_gated(&ctx);
    smoe_kctx_free(&ctx);
    return fails ? 1 : 0;
}

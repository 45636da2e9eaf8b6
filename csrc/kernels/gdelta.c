/* The gated delta rule in its recurrent (per token) form: the state update of Qwen3-Next's and
 * Qwen3.5's gated DeltaNet layers (Yang et al., "Gated Delta Networks", 2024) as transformers'
 * torch_recurrent_gated_delta_rule computes it, for decode steps.  See kernels.h
 * (smoe_gated_delta) for the arithmetic.
 *
 * Per (sequence, value head) the state is dk x dv floats, row i (a key dimension) contiguous;
 * a token makes two passes over it: S^T k (rows scaled by k[i], summed), then the decayed state
 * plus the rank-one update k u^T, written back, with S^T q summed on the way.  The inner loops
 * run along a row (dv contiguous floats) and are left to the compiler to vectorise.  Heads are
 * independent: a pool run hands (sequence, head) pairs to the threads, each pair taking every
 * token in order. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kimpl.h"

typedef struct {
    const float *q, *k, *v, *g, *beta;
    float *state, *out;
    float *hist;        /* NULL (state in place), or the state after each token (B = 1) */
    size_t sq, sv;      /* floats from one token's q (and k) / v to the next's */
    uint32_t B, T, Hk, Hv, dk, dv;
    int l2norm;
    smoe_split split;
} gd_arg;

/* x[0..n) scaled to unit length: x * rsqrt(sum x^2 + 1e-6), as transformers' l2norm. */
static void l2_normalise(float *x, uint32_t n) {
    float s = 0.0f;
    for (uint32_t i = 0; i < n; i++) s += x[i] * x[i];
    const float r = 1.0f / sqrtf(s + 1e-6f);
    for (uint32_t i = 0; i < n; i++) x[i] *= r;
}

/* Every token of pair p = b * Hv + h. */
static void gd_pair(const gd_arg *a, uint32_t p) {
    const uint32_t b = p / a->Hv, h = p % a->Hv, hk = h / (a->Hv / a->Hk);
    const uint32_t dk = a->dk, dv = a->dv;
    const size_t hs = (size_t)dk * dv; /* a head's state */
    float *S = a->state + (size_t)p * hs;
    float qn[512], kn[512], u[512]; /* dk, dv <= 512 (checked by the caller) */
    const float qs = 1.0f / sqrtf((float)dk);
    for (uint32_t t = 0; t < a->T; t++) {
        const size_t bt = (size_t)b * a->T + t;
        const float *q = a->q + bt * a->sq + (size_t)hk * dk;
        const float *k = a->k + bt * a->sq + (size_t)hk * dk;
        const float *v = a->v + bt * a->sv + (size_t)h * dv;
        /* the state this token reads (Si) and writes (So): S itself, or the token's own
         * copy in hist after the one before */
        const float *Si = S;
        float *So = S;
        if (a->hist) {
            So = a->hist + ((size_t)t * a->Hv + h) * hs;
            Si = t ? So - (size_t)a->Hv * hs : S;
        }
        float *o = a->out + (bt * a->Hv + h) * dv;
        memcpy(qn, q, dk * sizeof(float));
        memcpy(kn, k, dk * sizeof(float));
        if (a->l2norm) {
            l2_normalise(qn, dk);
            l2_normalise(kn, dk);
        }
        for (uint32_t i = 0; i < dk; i++) qn[i] *= qs;
        const float decay = expf(a->g[bt * a->Hv + h]), beta = a->beta[bt * a->Hv + h];
        /* u = beta * (v - decay * S^T k) */
        for (uint32_t j = 0; j < dv; j++) u[j] = 0.0f;
        for (uint32_t i = 0; i < dk; i++) {
            const float ki = kn[i];
            const float *row = Si + (size_t)i * dv;
            for (uint32_t j = 0; j < dv; j++) u[j] += row[j] * ki;
        }
        for (uint32_t j = 0; j < dv; j++) u[j] = beta * (v[j] - decay * u[j]);
        /* S = decay * S + k u^T;  o = S^T q */
        for (uint32_t j = 0; j < dv; j++) o[j] = 0.0f;
        for (uint32_t i = 0; i < dk; i++) {
            const float ki = kn[i], qi = qn[i];
            const float *row = Si + (size_t)i * dv;
            float *wrow = So + (size_t)i * dv;
            for (uint32_t j = 0; j < dv; j++) {
                const float s = decay * row[j] + ki * u[j];
                wrow[j] = s;
                o[j] += s * qi;
            }
        }
    }
}

static void gd_run(void *varg, uint32_t k, uint32_t n) {
    (void)n;
    gd_arg *a = varg;
    uint32_t p;
    while (smoe_split_next(&a->split, k, &p)) gd_pair(a, p);
}

static int gd_call(smoe_kctx *c, const gd_arg *init, smoe_err *err) {
    const gd_arg *i = init;
    if (!i->q || !i->k || !i->v || !i->g || !i->beta || !i->state || !i->out)
        return smoe_err_set(err, SMOE_EINVAL, "smoe_gated_delta: NULL array");
    if (i->Hk == 0 || i->Hv % i->Hk || i->dk == 0 || i->dv == 0 || i->dk > 512 || i->dv > 512)
        return smoe_err_set(err, SMOE_EINVAL,
                            "smoe_gated_delta: value heads %u not a multiple of key heads %u, "
                            "or head sizes %u, %u outside 1..512", i->Hv, i->Hk, i->dk, i->dv);
    if (i->B == 0 || i->T == 0) return SMOE_OK;
    gd_arg *a = aligned_alloc(64, (sizeof(gd_arg) + 63) & ~(size_t)63);
    if (!a) return smoe_err_set(err, SMOE_ENOMEM, "smoe_gated_delta: out of memory");
    *a = *init;
    smoe_kpool *pool = c ? c->pool : NULL;
    smoe_split_init(&a->split, a->B * a->Hv, smoe_kpool_threads(pool));
    if (pool) {
        smoe_kpool_lock(pool);
        smoe_kpool_run(pool, gd_run, a);
        smoe_kpool_unlock(pool);
    } else {
        gd_run(a, 0, 1);
    }
    free(a);
    return SMOE_OK;
}

int smoe_gated_delta(smoe_kctx *c, const float *q, const float *k, const float *v,
                     const float *g, const float *beta, float *state, float *out, uint32_t B,
                     uint32_t T, uint32_t Hk, uint32_t Hv, uint32_t dk, uint32_t dv,
                     int l2norm, smoe_err *err) {
    const gd_arg a = {.q = q, .k = k, .v = v, .g = g, .beta = beta, .state = state, .out = out,
                      .sq = (size_t)Hk * dk, .sv = (size_t)Hv * dv, .B = B, .T = T, .Hk = Hk,
                      .Hv = Hv, .dk = dk, .dv = dv, .l2norm = l2norm};
    return gd_call(c, &a, err);
}

int smoe_gated_delta_seq(smoe_kctx *c, const float *q, const float *k, const float *v,
                         size_t sq, size_t sv, const float *g, const float *beta, float *state,
                         float *hist, float *out, uint32_t T, uint32_t Hk, uint32_t Hv,
                         uint32_t dk, uint32_t dv, int l2norm, smoe_err *err) {
    if (hist == state)
        return smoe_err_set(err, SMOE_EINVAL, "smoe_gated_delta_seq: hist aliases state");
    const gd_arg a = {.q = q, .k = k, .v = v, .g = g, .beta = beta, .state = state, .out = out,
                      .hist = hist, .sq = sq, .sv = sv, .B = 1, .T = T, .Hk = Hk, .Hv = Hv,
                      .dk = dk, .dv = dv, .l2norm = l2norm};
    return gd_call(c, &a, err);
}

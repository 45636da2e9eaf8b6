/* Multi-head latent attention at decode sizes, absorbed form (contract and equations in
 * attn.h).
 *
 * Work item: one (batch row b, head h) pair, all T query tokens together, so W_UK[h] and
 * W_UV[h] are read once per call and each cached latent row c_j once per head (from cache: a
 * row is r * 2 bytes).  Per item:
 *   1. q_lat[t] = sum_d q_nope[t,d] * W_UK[h,d,:]      weight rows streamed, T axpys per row
 *   2. for each position j: s = (q_lat[t] . c_j + q_pe[t] . k_j) * scale + bias[t,j], folded
 *      into a running softmax (max m, sum l) and o_lat[t] += exp(s - m) * c_j
 *   3. out[t, h*dv + e] = W_UV[h,e,:] . (o_lat[t] / l)  weight rows streamed, T dots per row
 *
 * One body, written once (mla_item and its helpers, plain loops the compiler vectorises), is
 * instantiated for three ISAs by inlining it into functions compiled for AVX-512 / AVX2 / the
 * baseline; the kernel context's ISA picks one at run time.  Dot products keep 16 partial sums
 * in a fixed order, so they vectorise without reassociation and give the same bits on every
 * ISA (ISO C mode: no contraction into FMA). */
#include <math.h>
#include <string.h>

#include "attn.h"
#include "kimpl.h"

#define AI static inline __attribute__((always_inline))
#define LANES 16

static size_t round64(size_t n) { return (n + 63) & ~(size_t)63; }

/* bf16 bit pattern -> f32, exact */
AI float bf16_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* y[0..n) += a * w[0..n), w in f32 or bf16 */
AI void axpy_w(float *restrict y, float a, const void *restrict w, int bf16, uint32_t n) {
    if (bf16) {
        const uint16_t *p = (const uint16_t *)w;
        for (uint32_t i = 0; i < n; i++) y[i] += a * bf16_f32(p[i]);
    } else {
        const float *p = (const float *)w;
        for (uint32_t i = 0; i < n; i++) y[i] += a * p[i];
    }
}

/* sum x[i] * w[i], w in f32 or bf16: LANES partial sums, then a fixed pairwise reduction */
AI float dot_w(const float *restrict x, const void *restrict w, int bf16, uint32_t n) {
    float acc[LANES] = {0};
    uint32_t i = 0;
    if (bf16) {
        const uint16_t *p = (const uint16_t *)w;
        for (; i + LANES <= n; i += LANES)
            for (uint32_t k = 0; k < LANES; k++) acc[k] += x[i + k] * bf16_f32(p[i + k]);
        for (; i < n; i++) acc[i % LANES] += x[i] * bf16_f32(p[i]);
    } else {
        const float *p = (const float *)w;
        for (; i + LANES <= n; i += LANES)
            for (uint32_t k = 0; k < LANES; k++) acc[k] += x[i + k] * p[i + k];
        for (; i < n; i++) acc[i % LANES] += x[i] * p[i];
    }
    for (uint32_t w2 = LANES / 2; w2 > 0; w2 /= 2)
        for (uint32_t k = 0; k < w2; k++) acc[k] += acc[k + w2];
    return acc[0];
}

AI void scale_vec(float *restrict y, float a, uint32_t n) {
    for (uint32_t i = 0; i < n; i++) y[i] *= a;
}

typedef struct mla_job {
    const smoe_mla_desc *d;
    uint32_t B, T, S;
    const float *q_nope, *q_pe;
    const uint8_t *ckv, *kpe;
    int ckv_bf16, kpe_bf16;
    size_t ckv_bstride, kpe_bstride; /* elements */
    const uint8_t *w_uk, *w_uv;
    int w_bf16;
    const float *bias;
    uint32_t bias_rows;
    float *out;
    uint8_t *scratch;   /* per thread: scratch_per bytes, nslots threads' worth */
    size_t scratch_per;
    uint32_t nslots;    /* pool threads k >= nslots claim nothing (scratch sized for fewer) */
    uint32_t next;      /* next (b, h) item; atomic */
} mla_job;

AI void mla_item(const mla_job *j, uint32_t item, float *q_lat, float *o_lat, float *m,
                 float *l) {
    const smoe_mla_desc *d = j->d;
    const uint32_t T = j->T, S = j->S, r = d->r, dn = d->dn, dr = d->dr, dv = d->dv;
    const uint32_t b = item / d->H, h = item % d->H;
    const size_t wsz = j->w_bf16 ? 2 : 4, csz = j->ckv_bf16 ? 2 : 4, ksz = j->kpe_bf16 ? 2 : 4;
    const float *qn = j->q_nope + ((size_t)b * d->H + h) * T * dn;
    const float *qp = j->q_pe + ((size_t)b * d->H + h) * T * dr;
    /* 1. q_lat */
    memset(q_lat, 0, (size_t)T * r * 4);
    const uint8_t *wuk = j->w_uk + (size_t)h * dn * r * wsz;
    for (uint32_t dd = 0; dd < dn; dd++) {
        const void *row = wuk + (size_t)dd * r * wsz;
        for (uint32_t t = 0; t < T; t++)
            axpy_w(q_lat + (size_t)t * r, qn[(size_t)t * dn + dd], row, j->w_bf16, r);
    }
    /* 2. scores, running softmax, o_lat */
    memset(o_lat, 0, (size_t)T * r * 4);
    for (uint32_t t = 0; t < T; t++) {
        m[t] = -INFINITY;
        l[t] = 0.0f;
    }
    const uint8_t *cb = j->ckv + (size_t)b * j->ckv_bstride * csz;
    const uint8_t *kb = j->kpe + (size_t)b * j->kpe_bstride * ksz;
    const float *bias = j->bias ? j->bias + (size_t)(j->bias_rows == 1 ? 0 : b) * T * S : NULL;
    for (uint32_t p = 0; p < S; p++) {
        const void *cj = cb + (size_t)p * r * csz;
        const void *kj = kb + (size_t)p * dr * ksz;
        for (uint32_t t = 0; t < T; t++) {
            float s = (dot_w(q_lat + (size_t)t * r, cj, j->ckv_bf16, r) +
                       dot_w(qp + (size_t)t * dr, kj, j->kpe_bf16, dr)) * d->scale;
            if (bias) s += bias[(size_t)t * S + p];
            if (s == -INFINITY) continue;
            float *ol = o_lat + (size_t)t * r;
            if (s > m[t]) { /* new maximum: rescale what was summed so far */
                float corr = m[t] == -INFINITY ? 0.0f : expf(m[t] - s);
                l[t] *= corr;
                scale_vec(ol, corr, r);
                m[t] = s;
            }
            float e = expf(s - m[t]);
            l[t] += e;
            axpy_w(ol, e, cj, j->ckv_bf16, r);
        }
    }
    /* 3. out */
    const uint8_t *wuv = j->w_uv + (size_t)h * dv * r * wsz;
    for (uint32_t t = 0; t < T; t++)
        if (l[t] > 0.0f) scale_vec(o_lat + (size_t)t * r, 1.0f / l[t], r);
    for (uint32_t e = 0; e < dv; e++) {
        const void *row = wuv + (size_t)e * r * wsz;
        for (uint32_t t = 0; t < T; t++)
            j->out[((size_t)b * T + t) * d->H * dv + (size_t)h * dv + e] =
                dot_w(o_lat + (size_t)t * r, row, j->w_bf16, r);
    }
}

/* Claim items until none is left; k indexes this thread's scratch. */
AI void mla_run_body(mla_job *j, uint32_t k) {
    if (k >= j->nslots) return;
    float *q_lat = (float *)(j->scratch + (size_t)k * j->scratch_per);
    float *o_lat = q_lat + (size_t)j->T * j->d->r;
    float *m = o_lat + (size_t)j->T * j->d->r;
    float *l = m + j->T;
    uint32_t n = j->B * j->d->H;
    for (;;) {
        uint32_t it = __atomic_fetch_add(&j->next, 1u, __ATOMIC_RELAXED);
        if (it >= n) break;
        mla_item(j, it, q_lat, o_lat, m, l);
    }
}

static void mla_run_scalar(void *arg, uint32_t k, uint32_t n) {
    (void)n;
    mla_run_body((mla_job *)arg, k);
}

#if defined(__x86_64__) && defined(__GNUC__)
__attribute__((target("avx2,fma,f16c"))) static void mla_run_avx2(void *arg, uint32_t k,
                                                                  uint32_t n) {
    (void)n;
    mla_run_body((mla_job *)arg, k);
}
__attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq"))) static void
mla_run_avx512(void *arg, uint32_t k, uint32_t n) {
    (void)n;
    mla_run_body((mla_job *)arg, k);
}
#define MLA_HAVE_X86 1
#endif

int smoe_mla_desc_check(const smoe_mla_desc *d, smoe_err *err) {
    if (!d) return smoe_err_set(err, SMOE_EINVAL, "MLA descriptor: NULL");
    const uint32_t dims[5] = {d->H, d->dn, d->dr, d->dv, d->r};
    const char *names[5] = {"heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                            "kv_lora_rank"};
    for (int i = 0; i < 5; i++)
        if (dims[i] == 0 || dims[i] > 65536)
            return smoe_err_set(err, SMOE_EINVAL, "MLA: %s = %u out of range (1..65536)",
                                names[i], dims[i]);
    if (d->wdtype != SMOE_WDT_F32 && d->wdtype != SMOE_WDT_BF16)
        return smoe_err_set(err, SMOE_EINVAL, "MLA: weights must be f32 or bf16 (dtype %d)",
                            d->wdtype);
    if (!(d->scale > 0.0f) || !isfinite(d->scale))
        return smoe_err_set(err, SMOE_EINVAL, "MLA: scale must be finite and > 0");
    return SMOE_OK;
}

static size_t per_thread(const smoe_mla_desc *d, uint32_t T) {
    return round64(((size_t)2 * T * d->r + 2 * (size_t)T) * 4);
}

size_t smoe_mla_scratch_bytes(const smoe_kctx *c, const smoe_mla_desc *d, uint32_t T) {
    uint32_t nt = c && c->nthreads ? c->nthreads : 1;
    return 64 + per_thread(d, T ? T : 1) * nt;
}

int smoe_mla_decode(smoe_kctx *c, const smoe_mla_desc *d, uint32_t B, uint32_t T, uint32_t S,
                    const float *q_nope, const float *q_pe, const void *ckv, int32_t ckv_dtype,
                    size_t ckv_bstride, const void *kpe, int32_t kpe_dtype, size_t kpe_bstride,
                    const void *w_uk, const void *w_uv, const float *bias, uint32_t bias_rows,
                    float *out, void *scratch, size_t scratch_bytes, smoe_err *err) {
    int rc = smoe_mla_desc_check(d, err);
    if (rc) return rc;
    if (!q_nope || !q_pe || !ckv || !kpe || !w_uk || !w_uv || !out || !scratch)
        return smoe_err_set(err, SMOE_EINVAL, "smoe_mla_decode: NULL argument");
    if (B == 0 || T == 0 || S == 0)
        return smoe_err_set(err, SMOE_EINVAL, "smoe_mla_decode: B=%u T=%u S=%u must be >= 1", B,
                            T, S);
    if ((ckv_dtype != SMOE_WDT_F32 && ckv_dtype != SMOE_WDT_BF16) ||
        (kpe_dtype != SMOE_WDT_F32 && kpe_dtype != SMOE_WDT_BF16))
        return smoe_err_set(err, SMOE_EINVAL, "smoe_mla_decode: cache must be f32 or bf16");
    if (bias && bias_rows != 1 && bias_rows != B)
        return smoe_err_set(err, SMOE_EINVAL, "smoe_mla_decode: bias has %u rows, not 1 or B=%u",
                            bias_rows, B);
    size_t per = per_thread(d, T);
    if (scratch_bytes < 64 + per)
        return smoe_err_set(err, SMOE_EINVAL, "smoe_mla_decode: %zu bytes of scratch, need %zu",
                            scratch_bytes, 64 + per);
    if ((B > 1 && (ckv_bstride < (size_t)S * d->r || kpe_bstride < (size_t)S * d->dr)))
        return smoe_err_set(err, SMOE_EINVAL, "smoe_mla_decode: batch strides overlap rows");
    size_t slots = (scratch_bytes - 64) / per;
    mla_job job = {.d = d, .B = B, .T = T, .S = S, .q_nope = q_nope, .q_pe = q_pe,
                   .ckv = ckv, .kpe = kpe, .ckv_bf16 = ckv_dtype == SMOE_WDT_BF16,
                   .kpe_bf16 = kpe_dtype == SMOE_WDT_BF16, .ckv_bstride = ckv_bstride,
                   .kpe_bstride = kpe_bstride, .w_uk = w_uk, .w_uv = w_uv,
                   .w_bf16 = d->wdtype == SMOE_WDT_BF16, .bias = bias, .bias_rows = bias_rows,
                   .out = out,
                   .scratch = (uint8_t *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63),
                   .scratch_per = per, .nslots = slots > 1024 ? 1024u : (uint32_t)slots,
                   .next = 0};
    smoe_kpool_fn fn = mla_run_scalar;
#ifdef MLA_HAVE_X86
    int32_t isa = c ? c->isa : SMOE_ISA_SCALAR;
    if (isa >= SMOE_ISA_AVX512)
        fn = mla_run_avx512;
    else if (isa >= SMOE_ISA_AVX2)
        fn = mla_run_avx2;
#endif
    smoe_kpool *pool = c ? c->pool : NULL;
    smoe_kpool_lock(pool);
    smoe_kpool_run(pool, fn, &job);
    smoe_kpool_unlock(pool);
    return SMOE_OK;
}

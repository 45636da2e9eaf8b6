/* Multi-head (grouped-query) attention at decode sizes (contract in attn.h).
 *
 * Work item: one (batch row b, query head h) pair, all T query tokens; per token, the cached
 * positions in blocks of PB: PB scores q . k_j computed together (dot_many), then folded into
 * the running softmax with their value rows (softmax_fold, attn_impl.h, the same rule as the
 * MLA kernel's).  The key and value rows of a block are read once per query head and token;
 * for decode (T = 1) that is the whole cache once per query head, from cache after the first
 * head of a group.  Same per-ISA instantiation as mla.c. */
#include "attn.h"
#include "attn_impl.h"
#include "kimpl.h"

typedef struct mha_job {
    const smoe_mha_desc *d;
    uint32_t B, T, S;
    const float *q;
    const uint8_t *k, *v;
    int kv_bf16;
    int avx512; /* bf16 rows through mla_avx512.c's loops (attn_impl.h) */
    size_t kv_bstride, kv_hstride; /* elements */
    const float *bias;
    uint32_t bias_rows;
    float *out;
    uint8_t *scratch; /* per thread: scratch_per bytes, nslots threads' worth */
    size_t scratch_per;
    uint32_t nslots;
    uint32_t next; /* next (b, h) item; atomic */
} mha_job;

AI void mha_item(const mha_job *j, uint32_t item, float *o, float *m, float *l) {
    const smoe_mha_desc *d = j->d;
    const uint32_t T = j->T, S = j->S, D = d->D;
    const uint32_t b = item / d->H, h = item % d->H, g = h / (d->H / d->Hkv);
    const size_t esz = j->kv_bf16 ? 2 : 4;
    const size_t off = ((size_t)b * j->kv_bstride + (size_t)g * j->kv_hstride) * esz;
    const uint8_t *kb = j->k + off, *vb = j->v + off;
    const float *bias = j->bias ? j->bias + (size_t)(j->bias_rows == 1 ? 0 : b) * T * S : NULL;
    memset(o, 0, (size_t)T * D * 4);
    for (uint32_t t = 0; t < T; t++) {
        m[t] = -INFINITY;
        l[t] = 0.0f;
    }
    for (uint32_t p0 = 0; p0 < S; p0 += PB) {
        const uint32_t np = S - p0 < PB ? S - p0 : PB;
        for (uint32_t t = 0; t < T; t++) {
            const float *qt = j->q + (((size_t)b * d->H + h) * T + t) * D;
            float s[PB];
            dot_many(qt, kb + (size_t)p0 * D * esz, (size_t)D * esz, j->kv_bf16, D, np, s,
                     j->avx512);
            for (uint32_t q = 0; q < np; q++) {
                s[q] *= d->scale;
                if (bias) s[q] += bias[(size_t)t * S + p0 + q];
            }
            softmax_fold(&m[t], &l[t], o + (size_t)t * D, s, np, vb + (size_t)p0 * D * esz,
                         (size_t)D * esz, j->kv_bf16, D, j->avx512);
        }
    }
    for (uint32_t t = 0; t < T; t++) {
        float *dst = j->out + (((size_t)b * T + t) * d->H + h) * D;
        const float inv = l[t] > 0.0f ? 1.0f / l[t] : 0.0f;
        for (uint32_t e = 0; e < D; e++) dst[e] = o[(size_t)t * D + e] * inv;
    }
}

AI void mha_run_body(mha_job *j, uint32_t k) {
    if (k >= j->nslots) return;
    float *o = (float *)(j->scratch + (size_t)k * j->scratch_per);
    float *m = o + (size_t)j->T * j->d->D;
    float *l = m + j->T;
    uint32_t n = j->B * j->d->H;
    for (;;) {
        uint32_t it = __atomic_fetch_add(&j->next, 1u, __ATOMIC_RELAXED);
        if (it >= n) break;
        mha_item(j, it, o, m, l);
    }
}

ATTN_RUNNERS(mha_run, mha_run_body, mha_job)

static size_t per_thread(uint32_t D, uint32_t T) {
    return round64(((size_t)T * D + 2 * (size_t)T) * 4);
}

size_t smoe_mha_scratch_bytes(const smoe_kctx *c, uint32_t D, uint32_t T) {
    uint32_t nt = c && c->nthreads ? c->nthreads : 1;
    return 64 + per_thread(D ? D : 1, T ? T : 1) * nt;
}

int smoe_mha_decode(smoe_kctx *c, const smoe_mha_desc *d, uint32_t B, uint32_t T, uint32_t S,
                    const float *q, const void *k, const void *v, int32_t kv_dtype,
                    size_t kv_bstride, size_t kv_hstride, const float *bias, uint32_t bias_rows,
                    float *out, void *scratch, size_t scratch_bytes, smoe_err *err) {
    if (!d || !q || !k || !v || !out || !scratch)
        return smoe_err_set(err, SMOE_EINVAL, "smoe_mha_decode: NULL argument");
    if (d->H == 0 || d->Hkv == 0 || d->D == 0 || d->H > 65536 || d->D > 65536 ||
        d->H % d->Hkv != 0)
        return smoe_err_set(err, SMOE_EINVAL,
                            "smoe_mha_decode: heads %u, kv heads %u, head dim %u (heads must be "
                            "a multiple of kv heads, all in 1..65536)",
                            d->H, d->Hkv, d->D);
    if (!(d->scale > 0.0f) || !isfinite(d->scale))
        return smoe_err_set(err, SMOE_EINVAL, "smoe_mha_decode: scale must be finite and > 0");
    if (B == 0 || T == 0 || S == 0)
        return smoe_err_set(err, SMOE_EINVAL, "smoe_mha_decode: B=%u T=%u S=%u must be >= 1", B,
                            T, S);
    if (kv_dtype != SMOE_WDT_F32 && kv_dtype != SMOE_WDT_BF16)
        return smoe_err_set(err, SMOE_EINVAL, "smoe_mha_decode: keys/values must be f32 or bf16");
    if (bias && bias_rows != 1 && bias_rows != B)
        return smoe_err_set(err, SMOE_EINVAL, "smoe_mha_decode: bias has %u rows, not 1 or B=%u",
                            bias_rows, B);
    if ((d->Hkv > 1 && kv_hstride < (size_t)S * d->D) ||
        (B > 1 && kv_bstride < (size_t)(d->Hkv - 1) * kv_hstride + (size_t)S * d->D))
        return smoe_err_set(err, SMOE_EINVAL, "smoe_mha_decode: strides overlap rows");
    size_t per = per_thread(d->D, T);
    if (scratch_bytes < 64 + per)
        return smoe_err_set(err, SMOE_EINVAL, "smoe_mha_decode: %zu bytes of scratch, need %zu",
                            scratch_bytes, 64 + per);
    size_t slots = (scratch_bytes - 64) / per;
    mha_job job = {.d = d, .B = B, .T = T, .S = S, .q = q, .k = k, .v = v,
                   .kv_bf16 = kv_dtype == SMOE_WDT_BF16,
                   .avx512 = c && c->isa >= SMOE_ISA_AVX512, .kv_bstride = kv_bstride,
                   .kv_hstride = kv_hstride, .bias = bias, .bias_rows = bias_rows, .out = out,
                   .scratch = (uint8_t *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63),
                   .scratch_per = per, .nslots = slots > 1024 ? 1024u : (uint32_t)slots,
                   .next = 0};
    attn_run(c, ATTN_POOL_FN(c, mha_run), &job);
    return SMOE_OK;
}

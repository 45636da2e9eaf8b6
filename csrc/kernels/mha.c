/* Multi-head (grouped-query) attention at decode sizes (contract in attn.h).
 *
 * Work item: the query heads of one key/value head (all of them, or as many chunks as it
 * takes to give every thread one: group_heads) of one batch row, all T query tokens; per block
 * of PB cached positions, the block's key and value rows are widened to f32 once (when bf16
 * and read by more than one head), then for every head and token the PB scores q . k_j
 * (dot_many) and the fold into the running softmax with the value rows (softmax_fold,
 * attn_impl.h, the same rule as the MLA kernel's).  Before 2026-11-26 an item was one query
 * head, which read its key/value head's rows again for each of the H / Hkv heads sharing
 * them, widening them each time.  A batch row's holes are left out of the blocks
 * (attn_impl.h, next_block), so a row gets the bits of its step alone.  Same per-ISA
 * instantiation as mla.c. */
#include "attn.h"
#include "attn_impl.h"
#include "kimpl.h"

typedef struct mha_job {
    const smoe_mha_desc *d;
    uint32_t B, T, S;
    const float *q;
    const uint8_t *k, *v;
    int kv_bf16;
    int simd;   /* the rows' intrinsics loops (attn_impl.h's attn_simd) */
    size_t kv_bstride, kv_hstride; /* elements */
    const float *bias;
    uint32_t bias_rows;
    float *out;
    uint8_t *scratch; /* per thread: scratch_per bytes, nslots threads' worth */
    size_t scratch_per;
    uint32_t nslots;
    uint32_t G;      /* query heads an item, all of one key/value head (group_heads) */
    uint32_t chunks; /* items per key/value head: ceil(H / Hkv / G) */
    uint32_t next;   /* next (b, key/value head, chunk) item; atomic */
} mha_job;

/* The most query heads an item may take (what smoe_mha_scratch_bytes provides for): their
 * running outputs [G, T, D] in L2 (group_max_of), at most 64. */
static uint32_t group_max(uint32_t D, uint32_t T) {
    return group_max_of((size_t)T * D * 4, 64);
}

/* One item: query heads h0 .. h0 + nh - 1 of batch row b, all of key/value head g (scratch:
 * o [nh, T, D], m, l [nh, T], kf, vf [PB, D]).  A block of PB cached key and value rows,
 * widened to f32 once where block_rows says, serves every head of the item; each head's
 * arithmetic is a one-head item's, in the same order, so the bits do not depend on the
 * grouping (the widening is exact). */
AI void mha_item(const mha_job *j, uint32_t item, float *o, float *m, float *l, float *kf,
                 float *vf) {
    const smoe_mha_desc *d = j->d;
    const uint32_t T = j->T, S = j->S, D = d->D, rep = d->H / d->Hkv;
    const uint32_t b = item / (d->Hkv * j->chunks), rem = item % (d->Hkv * j->chunks);
    const uint32_t g = rem / j->chunks, h0 = g * rep + (rem % j->chunks) * j->G;
    const uint32_t nh = g * rep + rep - h0 < j->G ? g * rep + rep - h0 : j->G;
    const size_t esz = j->kv_bf16 ? 2 : 4;
    const size_t off = ((size_t)b * j->kv_bstride + (size_t)g * j->kv_hstride) * esz;
    const uint8_t *kb = j->k + off, *vb = j->v + off;
    const float *bias = j->bias ? j->bias + (size_t)(j->bias_rows == 1 ? 0 : b) * T * S : NULL;
    memset(o, 0, (size_t)nh * T * D * 4);
    for (uint32_t k = 0; k < nh * T; k++) { /* a sink: a position of weight exp(sink), no value */
        m[k] = d->sinks ? d->sinks[h0 + k / T] : -INFINITY;
        l[k] = d->sinks ? 1.0f : 0.0f;
    }
    const float *holes = hole_row(bias, T, S);
    uint32_t pos[PB];
    for (uint32_t p = 0, np; (np = next_block(holes, T, S, &p, pos)) > 0;) {
        int rbf;
        const size_t rowb = (size_t)D * esz;
        const uint8_t *k0 = block_rows_at(kb, rowb, pos, np, j->kv_bf16, nh, D, kf, &rbf);
        const uint8_t *v0 = block_rows_at(vb, rowb, pos, np, j->kv_bf16, nh, D, vf, &rbf);
        const size_t rst = (size_t)D * (rbf ? 2 : 4);
        for (uint32_t i = 0; i < nh; i++)
            for (uint32_t t = 0; t < T; t++) {
                const size_t k = (size_t)i * T + t;
                const float *qt = j->q + (((size_t)b * d->H + h0 + i) * T + t) * D;
                float s[PB];
                dot_many(qt, k0, rst, rbf, D, np, s, j->simd);
                for (uint32_t q = 0; q < np; q++) {
                    s[q] *= d->scale;
                    if (bias) s[q] += bias[(size_t)t * S + pos[q]];
                }
                softmax_fold(&m[k], &l[k], o + k * D, s, np, v0, rst, rbf, D, j->simd);
            }
    }
    for (uint32_t i = 0; i < nh; i++)
        for (uint32_t t = 0; t < T; t++) {
            const size_t k = (size_t)i * T + t;
            float *dst = j->out + (((size_t)b * T + t) * d->H + h0 + i) * D;
            const float inv = l[k] > 0.0f ? 1.0f / l[k] : 0.0f;
            for (uint32_t e = 0; e < D; e++) dst[e] = o[k * D + e] * inv;
        }
}

/* This thread's scratch (per_thread's layout); claim items until none is left */
AI void mha_run_body(mha_job *j, uint32_t k) {
    if (k >= j->nslots) return;
    const size_t gt = (size_t)j->G * j->T;
    float *o = (float *)(j->scratch + (size_t)k * j->scratch_per);
    float *m = o + gt * j->d->D;
    float *l = m + gt;
    float *kf = l + gt;
    float *vf = kf + (size_t)PB * j->d->D;
    uint32_t n = j->B * j->d->Hkv * j->chunks;
    for (;;) {
        uint32_t it = __atomic_fetch_add(&j->next, 1u, __ATOMIC_RELAXED);
        if (it >= n) break;
        mha_item(j, it, o, m, l, kf, vf);
    }
}

ATTN_RUNNERS(mha_run, mha_run_body, mha_job)

/* o [G, T, D], m, l [G, T], kf, vf [PB, D] */
static size_t per_thread(uint32_t D, uint32_t T, uint32_t G) {
    const size_t gt = (size_t)G * T;
    return round64((gt * D + 2 * gt + (size_t)2 * PB * D) * 4);
}

size_t smoe_mha_scratch_bytes(const smoe_kctx *c, uint32_t D, uint32_t T) {
    uint32_t nt = c && c->nthreads ? c->nthreads : 1;
    D = D ? D : 1;
    T = T ? T : 1;
    return 64 + per_thread(D, T, group_max(D, T)) * nt;
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
    uint32_t G = group_heads(d->H / d->Hkv, B * d->Hkv, c && c->nthreads ? c->nthreads : 1,
                             group_max(d->D, T));
    size_t per = per_thread(d->D, T, G);
    if (scratch_bytes < 64 + per && G > 1) { /* scratch for fewer: one head an item */
        G = 1;
        per = per_thread(d->D, T, 1);
    }
    if (scratch_bytes < 64 + per)
        return smoe_err_set(err, SMOE_EINVAL, "smoe_mha_decode: %zu bytes of scratch, need %zu",
                            scratch_bytes, 64 + per);
    size_t slots = (scratch_bytes - 64) / per;
    mha_job job = {.d = d, .B = B, .T = T, .S = S, .q = q, .k = k, .v = v,
                   .kv_bf16 = kv_dtype == SMOE_WDT_BF16,
                   .simd = attn_simd(c), .kv_bstride = kv_bstride,
                   .kv_hstride = kv_hstride, .bias = bias, .bias_rows = bias_rows, .out = out,
                   .scratch = (uint8_t *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63),
                   .scratch_per = per, .nslots = slots > 1024 ? 1024u : (uint32_t)slots,
                   .G = G, .chunks = (d->H / d->Hkv + G - 1) / G, .next = 0};
    attn_run(c, ATTN_POOL_FN(c, mha_run), &job);
    return SMOE_OK;
}

/* Multi-head latent attention at decode sizes, absorbed form (contract and equations in
 * attn.h).
 *
 * Work item: one batch row b and a group of G heads (group_heads: all of the row's heads, or
 * as many groups as it takes to give every thread one), all T query tokens together, so W_UK[h]
 * and W_UV[h] are read once per call and each cached latent row c_j once per group.  Per item:
 *   1. per head, q_lat[t] = sum_d q_nope[t,d] * W_UK[h,d,:]    weight rows streamed, T axpys
 *      per row
 *   2. for each block of PB positions j (widened to f32 once when bf16 and read by more than
 *      one head), for each head of the group: s = (q_lat[t] . c_j + q_pe[t] . k_j) * scale +
 *      bias[t,j], the block's PB dot products computed together (dot_rows), folded into a
 *      running softmax (max m, sum l, the maximum moved once per block) and
 *      o_lat[t] += exp(s - m) * c_j
 *   3. per head, out[t, h*dv + e] = W_UV[h,e,:] . (o_lat[t] / l)
 *
 * A single dot product of r = 512 with one vector of partial sums is bound by the add latency
 * (32 dependent adds); PB rows at once give PB independent chains and load x once for PB rows
 * (the cached rows, read from cache).  Weight rows, streamed from DRAM, go one at a time
 * instead (f32/bf16, AVX-512): at DeepSeek-V2-Lite shapes (16 heads, r = 512, 4.2 MB of absorbed
 * weights a layer), 1 thread, 4 KB pages, several rows at once (eight for W_UV, four for W_UK:
 * several short streams) read 7-8 GB/s, one at a time 12-15, against 18-23 for a plain read
 * loop over the same memory (benchmarks/c/mla_decode.c, 2026-11-26).  Software prefetch
 * 256 B - 64 KB ahead, tried on either, changed nothing or lost.  With many cached positions
 * the cost is the arithmetic of step 2 (widening included): there an item of all 16 heads,
 * each block widened once for them, took 1.65-1.8 ms at 2048 positions against 3.1 with one
 * head an item (the same loops, 1 thread).
 *
 * One body, written once (mla_item and its helpers, plain loops the compiler vectorises), is
 * instantiated for three ISAs by inlining it into functions compiled for AVX-512 / AVX2 / the
 * baseline; the kernel context's ISA picks one at run time.  Dot products keep 16 partial sums
 * in a fixed order, so they vectorise without reassociation and give the same bits on every
 * ISA (ISO C mode: no contraction into FMA), whatever the grouping of heads.  On AVX-512,
 * int8/int4 weights and the f32/bf16 rows go through mla_avx512.c's intrinsics instead (the
 * same arithmetic; the compiler's code for the plain loops ran at a third (int8) to two
 * thirds (bf16) of the intrinsics' rate); on AVX2 through mla_avx2.c's (see there).
 *
 * GGUF block weights (attn.h): steps 1 and 3 are, per head and token, one matrix of the file
 * against one vector (attn_k_b's r rows of dn columns against q_nope; attn_v_b's dv rows of r
 * columns against o_lat / l), so they go through the block kernels' one-token rows on the
 * item's thread (smoe_blocks_matvec: the input rounded to int8 per block, as llama.cpp's
 * vec_dot does, on the fast ISAs).  Against bf16 absorbed weights (kv_b_proj dequantized,
 * read by step 1's axpy and step 3's dot_many over all dv rows at once, which strides the
 * rows), GLM-4.7-Flash's shapes (20 heads, dn 192, dv 256, r 512; 9.2 MB a layer in bf16,
 * 2.6 in Q4_0), 4 layers, AMD EPYC Zen 2, AVX2, 3 interleaved rounds of model.generate:
 * 1.22-1.24x the decode rate at 1 thread, 1.01-1.21x at 2. */
#include "attn.h"
#include "attn_impl.h"
#include "kimpl.h"

AI void axpy_q(float *restrict y, float a, const int8_t *restrict q, const float *restrict sc,
               int32_t kind, uint32_t n, uint32_t group) {
    if (kind == SMOE_WDT_I8) {
        const float as = a * sc[0];
        for (uint32_t i = 0; i < n; i++) y[i] += as * (float)q[i];
        return;
    }
    for (uint32_t g = 0; g < n / group; g++) {
        const float as = a * sc[g];
        const int8_t *qg = q + (size_t)g * group;
        float *yg = y + (size_t)g * group;
        for (uint32_t i = 0; i < group; i++) yg[i] += as * (float)qg[i];
    }
}

/* res[q] = x . row q for NR (1..PB) int8/int4 rows at w + q * wstride bytes (one value a
 * byte), their scales at sc + q * sstride: NR accumulator chains of LANES lanes in a fixed
 * order (so every ISA gives the same bits).  int8: the row's scale applied after the
 * reduction; int4 (group a multiple of LANES): each product scaled by its group's scale. */
AI void dotq_rows(const float *restrict x, const int8_t *restrict w, size_t wstride,
                  const float *restrict sc, size_t sstride, int32_t kind, uint32_t n,
                  uint32_t group, uint32_t NR, float *restrict res) {
    float acc[PB][LANES];
    for (uint32_t q = 0; q < NR; q++)
        for (uint32_t k = 0; k < LANES; k++) acc[q][k] = 0.0f;
    uint32_t i = 0;
    if (kind == SMOE_WDT_I8) {
        for (; i + LANES <= n; i += LANES)
            for (uint32_t q = 0; q < NR; q++) {
                const int8_t *p = w + q * wstride + i;
                for (uint32_t k = 0; k < LANES; k++) acc[q][k] += x[i + k] * (float)p[k];
            }
        for (; i < n; i++)
            for (uint32_t q = 0; q < NR; q++) acc[q][i % LANES] += x[i] * (float)w[q * wstride + i];
    } else {
        /* per group: the int8 loop's partial sums, then scaled into acc (group is a multiple
         * of LANES) */
        for (uint32_t g = 0; g < n / group; g++) {
            float part[PB][LANES];
            for (uint32_t q = 0; q < NR; q++)
                for (uint32_t k = 0; k < LANES; k++) part[q][k] = 0.0f;
            for (const uint32_t end = i + group; i < end; i += LANES)
                for (uint32_t q = 0; q < NR; q++) {
                    const int8_t *p = w + q * wstride + i;
                    for (uint32_t k = 0; k < LANES; k++) part[q][k] += x[i + k] * (float)p[k];
                }
            for (uint32_t q = 0; q < NR; q++) {
                const float s = sc[q * sstride + g];
                for (uint32_t k = 0; k < LANES; k++) acc[q][k] += s * part[q][k];
            }
        }
    }
    for (uint32_t q = 0; q < NR; q++) {
        for (uint32_t w2 = LANES / 2; w2 > 0; w2 /= 2)
            for (uint32_t k = 0; k < w2; k++) acc[q][k] += acc[q][k + w2];
        res[q] = kind == SMOE_WDT_I8 ? acc[q][0] * sc[q * sstride] : acc[q][0];
    }
}


typedef struct mla_job {
    const smoe_mla_desc *d;
    uint32_t B, T, S;
    const float *q_nope, *q_pe;
    const uint8_t *ckv, *kpe;
    int ckv_bf16, kpe_bf16;
    size_t ckv_bstride, kpe_bstride; /* elements */
    const uint8_t *w_uk, *w_uv;     /* [H, rows, r] in wdtype (int4: a value a byte) */
    const float *uk_scale, *uv_scale; /* int8 [H, rows], int4 [H, rows, r / group]; else NULL */
    int32_t wdtype;
    size_t wsz;         /* bytes a weight value */
    int w_bf16;
    int simd;           /* attn_simd: which intrinsics the rows and weights go through */
    const smoe_ffn_impl *bimpl; /* GGUF block weights: the context's block rows; else NULL */
    size_t uk_rb, uv_rb;        /* GGUF block weights: bytes a row of w_uk / w_uv */
    const float *bias;
    uint32_t bias_rows;
    float *out;
    uint8_t *scratch;   /* per thread: scratch_per bytes, nslots threads' worth */
    size_t scratch_per;
    uint32_t nslots;    /* pool threads k >= nslots claim nothing (scratch sized for fewer) */
    uint32_t G;         /* heads an item (group_heads) */
    uint32_t next;      /* next (b, group of G heads) item; atomic */
} mla_job;

/* The most heads an item may take at T tokens (what smoe_mla_scratch_bytes provides for):
 * their q_lat and o_lat in L2 (group_max_of). */
static uint32_t group_max(const smoe_mla_desc *d, uint32_t T) {
    return group_max_of((size_t)2 * T * d->r * 4, d->H);
}

/* 1. q_lat [T, r] of head h of batch row b: W_UK[h]'s rows in order (one sequential stream),
 * each added into every token's q_lat. */
AI void mla_q_lat(const mla_job *j, uint32_t b, uint32_t h, float *q_lat, void *mv) {
    const smoe_mla_desc *d = j->d;
    const uint32_t T = j->T, r = d->r, dn = d->dn;
    const float *qn = j->q_nope + ((size_t)b * d->H + h) * T * dn;
    if (j->bimpl) { /* attn_k_b's r rows of head h against each token's q_nope */
        for (uint32_t t = 0; t < T; t++)
            smoe_blocks_matvec(j->bimpl, d->wdtype, j->w_uk + (size_t)h * r * j->uk_rb, r, dn,
                               qn + (size_t)t * dn, q_lat + (size_t)t * r, mv);
        return;
    }
    const int quant = j->wdtype == SMOE_WDT_I8 || j->wdtype == SMOE_WDT_I4;
    const size_t wrow = (size_t)r * j->wsz;                           /* bytes a row */
    const size_t srow = j->wdtype == SMOE_WDT_I4 ? r / d->group : 1; /* scales a row */
    const uint32_t qgroup = j->wdtype == SMOE_WDT_I4 ? d->group : 0;
    const uint8_t *wuk = j->w_uk + (size_t)h * dn * wrow;
    memset(q_lat, 0, (size_t)T * r * 4);
    for (uint32_t dd = 0; dd < dn; dd++) {
        const uint8_t *row = wuk + (size_t)dd * wrow;
        const float *rs = quant ? j->uk_scale + ((size_t)h * dn + dd) * srow : NULL;
        for (uint32_t t = 0; t < T; t++) {
            float *y = q_lat + (size_t)t * r;
            const float a = qn[(size_t)t * dn + dd];
#if defined(__x86_64__) && defined(__GNUC__)
            if (quant && j->simd == ATTN_SIMD_AVX512) {
                smoe_mla_axpy_q_avx512(y, a, (const int8_t *)row, rs, qgroup, r);
                continue;
            }
            if (quant && j->simd == ATTN_SIMD_AVX2) {
                smoe_mla_axpy_q_avx2(y, a, (const int8_t *)row, rs, qgroup, r);
                continue;
            }
#endif
            if (quant) {
                axpy_q(y, a, (const int8_t *)row, rs, j->wdtype, r, d->group);
            } else { /* f32/bf16: one row a call, one stream from DRAM */
                const void *one = row;
                axpy_many(y, &a, &one, 1, r, j->w_bf16, j->simd);
            }
        }
    }
}

/* 3. out[b, t, h * dv ..] = W_UV[h] . (o_lat[t] / l[t]) for every token t of head h. */
AI void mla_out(const mla_job *j, uint32_t b, uint32_t h, float *o_lat, const float *l,
                void *mv) {
    const smoe_mla_desc *d = j->d;
    const uint32_t T = j->T, r = d->r, dv = d->dv;
    const int quant = j->wdtype == SMOE_WDT_I8 || j->wdtype == SMOE_WDT_I4;
    const size_t wrow = (size_t)r * j->wsz;
    const size_t srow = j->wdtype == SMOE_WDT_I4 ? r / d->group : 1;
    const uint32_t qgroup = j->wdtype == SMOE_WDT_I4 ? d->group : 0;
    const uint8_t *wuv = j->w_uv + (size_t)h * dv * wrow;
    for (uint32_t t = 0; t < T; t++)
        if (l[t] > 0.0f) scale_vec(o_lat + (size_t)t * r, 1.0f / l[t], r);
    if (j->bimpl) { /* attn_v_b's dv rows of head h, straight into the output */
        for (uint32_t t = 0; t < T; t++)
            smoe_blocks_matvec(j->bimpl, d->uv_dtype, j->w_uv + (size_t)h * dv * j->uv_rb, dv, r,
                               o_lat + (size_t)t * r,
                               j->out + ((size_t)b * T + t) * d->H * dv + (size_t)h * dv, mv);
        return;
    }
    for (uint32_t t = 0; t < T; t++) {
        const float *x = o_lat + (size_t)t * r;
        float *o = j->out + ((size_t)b * T + t) * d->H * dv + (size_t)h * dv;
        if (!quant) { /* intrinsics: one row a call, one stream from DRAM */
            const uint32_t step = j->simd ? 1 : dv;
            for (uint32_t e = 0; e < dv; e += step)
                dot_many(x, wuv + e * wrow, wrow, j->w_bf16, r, step, o + e, j->simd);
            continue;
        }
        const float *us = j->uv_scale + (size_t)h * dv * srow;
#if defined(__x86_64__) && defined(__GNUC__)
        if (j->simd == ATTN_SIMD_AVX512) {
            smoe_mla_dotq_avx512(x, (const int8_t *)wuv, wrow, us, srow, qgroup, r, dv, o);
            continue;
        }
        if (j->simd == ATTN_SIMD_AVX2) {
            smoe_mla_dotq_avx2(x, (const int8_t *)wuv, wrow, us, srow, qgroup, r, dv, o);
            continue;
        }
#endif
        uint32_t e = 0;
        for (; e + PB <= dv; e += PB)
            dotq_rows(x, (const int8_t *)(wuv + e * wrow), wrow, us + e * srow, srow,
                      j->wdtype, r, d->group, PB, o + e);
        for (; e < dv; e++)
            dotq_rows(x, (const int8_t *)(wuv + e * wrow), wrow, us + e * srow, srow,
                      j->wdtype, r, d->group, 1, o + e);
    }
}

/* One item: heads h0 .. h0 + nh - 1 of batch row b (scratch: q_lat, o_lat [nh, T, r], m, l
 * [nh, T], cf [PB, r], kf [PB, dr]; mv: GGUF blocks' smoe_blocks_matvec scratch).
 * 2. scores, running softmax, o_lat: positions in blocks of PB, the running maximum moved
 * once per block.  A block's cached rows, widened to f32 once where block_rows says (cf, kf),
 * serve every head of the item, the scores' dot products and the weighted
 * sum alike.  Every head's arithmetic is a one-head item's, in the same order, so the bits do
 * not depend on the grouping (nor on the widening: exact). */
AI void mla_item(const mla_job *j, uint32_t item, float *q_lat, float *o_lat, float *m,
                 float *l, float *cf, float *kf, void *mv) {
    const smoe_mla_desc *d = j->d;
    const uint32_t T = j->T, S = j->S, r = d->r, dr = d->dr;
    const uint32_t per_row = (d->H + j->G - 1) / j->G;
    const uint32_t b = item / per_row, h0 = (item % per_row) * j->G;
    const uint32_t nh = d->H - h0 < j->G ? d->H - h0 : j->G;
    const size_t csz = j->ckv_bf16 ? 2 : 4, ksz = j->kpe_bf16 ? 2 : 4;
    const size_t TR = (size_t)T * r;
    for (uint32_t g = 0; g < nh; g++) mla_q_lat(j, b, h0 + g, q_lat + g * TR, mv);
    memset(o_lat, 0, nh * TR * 4);
    for (uint32_t k = 0; k < nh * T; k++) {
        m[k] = -INFINITY;
        l[k] = 0.0f;
    }
    const uint8_t *cb = j->ckv + (size_t)b * j->ckv_bstride * csz;
    const uint8_t *kb = j->kpe + (size_t)b * j->kpe_bstride * ksz;
    const float *bias = j->bias ? j->bias + (size_t)(j->bias_rows == 1 ? 0 : b) * T * S : NULL;
    const float *holes = hole_row(bias, T, S); /* blocks without the row's holes (attn_impl.h) */
    uint32_t pos[PB];
    for (uint32_t p = 0, np; (np = next_block(holes, T, S, &p, pos)) > 0;) {
        int cbf, kbf;
        const uint8_t *c0 = block_rows_at(cb, (size_t)r * csz, pos, np, j->ckv_bf16, nh, r, cf,
                                          &cbf);
        const uint8_t *k0 = block_rows_at(kb, (size_t)dr * ksz, pos, np, j->kpe_bf16, nh, dr,
                                          kf, &kbf);
        const size_t cst = (size_t)r * (cbf ? 2 : 4), kst = (size_t)dr * (kbf ? 2 : 4);
        for (uint32_t g = 0; g < nh; g++) {
            const float *qp = j->q_pe + ((size_t)b * d->H + h0 + g) * T * dr;
            for (uint32_t t = 0; t < T; t++) {
                const size_t k = (size_t)g * T + t;
                float s[PB], sr[PB];
                dot_many(q_lat + k * r, c0, cst, cbf, r, np, s, j->simd);
                dot_many(qp + (size_t)t * dr, k0, kst, kbf, dr, np, sr, j->simd);
                for (uint32_t q = 0; q < np; q++) {
                    s[q] = (s[q] + sr[q]) * d->scale;
                    if (bias) s[q] += bias[(size_t)t * S + pos[q]];
                }
                softmax_fold(&m[k], &l[k], o_lat + k * r, s, np, c0, cst, cbf, r, j->simd);
            }
        }
    }
    for (uint32_t g = 0; g < nh; g++)
        mla_out(j, b, h0 + g, o_lat + g * TR, l + (size_t)g * T, mv);
}

/* This thread's scratch (per_thread's layout) */
AI void mla_run_body(mla_job *j, uint32_t k) {
    if (k >= j->nslots) return;
    const size_t gt = (size_t)j->G * j->T;
    float *q_lat = (float *)(j->scratch + (size_t)k * j->scratch_per);
    float *o_lat = q_lat + gt * j->d->r;
    float *m = o_lat + gt * j->d->r;
    float *l = m + gt;
    float *cf = l + gt;
    float *kf = cf + (size_t)PB * j->d->r;
    void *mv = kf + (size_t)PB * j->d->dr;
    uint32_t n = j->B * ((j->d->H + j->G - 1) / j->G);
    for (;;) { /* claim items until none is left */
        uint32_t it = __atomic_fetch_add(&j->next, 1u, __ATOMIC_RELAXED);
        if (it >= n) break;
        mla_item(j, it, q_lat, o_lat, m, l, cf, kf, mv);
    }
}

ATTN_RUNNERS(mla_run, mla_run_body, mla_job)

int smoe_mla_desc_check(const smoe_mla_desc *d, smoe_err *err) {
    if (!d) return smoe_err_set(err, SMOE_EINVAL, "MLA descriptor: NULL");
    const uint32_t dims[5] = {d->H, d->dn, d->dr, d->dv, d->r};
    const char *names[5] = {"heads", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
                            "kv_lora_rank"};
    for (int i = 0; i < 5; i++)
        if (dims[i] == 0 || dims[i] > 65536)
            return smoe_err_set(err, SMOE_EINVAL, "MLA: %s = %u out of range (1..65536)",
                                names[i], dims[i]);
    if (smoe_wdt_is_block(d->wdtype) || smoe_wdt_is_block(d->uv_dtype)) {
        if (!smoe_wdt_is_block(d->wdtype) || !smoe_wdt_is_block(d->uv_dtype))
            return smoe_err_set(err, SMOE_EINVAL,
                                "MLA: GGUF block weights need a block format for both w_uk and "
                                "w_uv (dtypes %d, %d)", d->wdtype, d->uv_dtype);
        if (d->dn % smoe_wdt_block_cols(d->wdtype) || d->r % smoe_wdt_block_cols(d->uv_dtype))
            return smoe_err_set(err, SMOE_EINVAL,
                                "MLA: GGUF blocks of %u / %u columns do not divide "
                                "qk_nope_head_dim %u (attn_k_b's rows) / kv_lora_rank %u "
                                "(attn_v_b's)", smoe_wdt_block_cols(d->wdtype),
                                smoe_wdt_block_cols(d->uv_dtype), d->dn, d->r);
    } else if (d->wdtype != SMOE_WDT_F32 && d->wdtype != SMOE_WDT_BF16 &&
               d->wdtype != SMOE_WDT_I8 && d->wdtype != SMOE_WDT_I4) {
        return smoe_err_set(err, SMOE_EINVAL,
                            "MLA: weights must be f32, bf16, int8, int4 or GGUF blocks (dtype %d)",
                            d->wdtype);
    }
    if (d->wdtype == SMOE_WDT_I4 &&
        (d->group == 0 || d->group % 32 != 0 || d->r % d->group != 0))
        return smoe_err_set(err, SMOE_EINVAL,
                            "MLA: int4 group %u must be a multiple of 32 dividing kv_lora_rank %u",
                            d->group, d->r);
    if (!(d->scale > 0.0f) || !isfinite(d->scale))
        return smoe_err_set(err, SMOE_EINVAL, "MLA: scale must be finite and > 0");
    return SMOE_OK;
}

/* q_lat, o_lat [G, T, r], m, l [G, T], cf [PB, r], kf [PB, dr]; GGUF blocks: the matvec's
 * scratch for the longer of a w_uk row (dn) and a w_uv row (r) */
static size_t per_thread(const smoe_mla_desc *d, uint32_t T, uint32_t G) {
    const size_t gt = (size_t)G * T;
    const size_t mv = smoe_wdt_is_block(d->wdtype)
                          ? smoe_blocks_matvec_scratch(d->dn > d->r ? d->dn : d->r) : 0;
    return round64((2 * gt * d->r + 2 * gt + (size_t)PB * (d->r + d->dr)) * 4 + mv);
}

size_t smoe_mla_scratch_bytes(const smoe_kctx *c, const smoe_mla_desc *d, uint32_t T) {
    uint32_t nt = c && c->nthreads ? c->nthreads : 1;
    T = T ? T : 1;
    return 64 + per_thread(d, T, group_max(d, T)) * nt;
}

int smoe_mla_decode(smoe_kctx *c, const smoe_mla_desc *d, uint32_t B, uint32_t T, uint32_t S,
                    const float *q_nope, const float *q_pe, const void *ckv, int32_t ckv_dtype,
                    size_t ckv_bstride, const void *kpe, int32_t kpe_dtype, size_t kpe_bstride,
                    const smoe_mla_weights *w, const float *bias, uint32_t bias_rows,
                    float *out, void *scratch, size_t scratch_bytes, smoe_err *err) {
    int rc = smoe_mla_desc_check(d, err);
    if (rc) return rc;
    if (!q_nope || !q_pe || !ckv || !kpe || !w || !w->uk || !w->uv || !out || !scratch)
        return smoe_err_set(err, SMOE_EINVAL, "smoe_mla_decode: NULL argument");
    const int quant = d->wdtype == SMOE_WDT_I8 || d->wdtype == SMOE_WDT_I4;
    if (quant != (w->uk_scale != NULL) || quant != (w->uv_scale != NULL))
        return smoe_err_set(err, SMOE_EINVAL,
                            "smoe_mla_decode: int8/int4 weights need scales, float ones none");
    if (B == 0 || T == 0 || S == 0)
        return smoe_err_set(err, SMOE_EINVAL, "smoe_mla_decode: B=%u T=%u S=%u must be >= 1", B,
                            T, S);
    if ((ckv_dtype != SMOE_WDT_F32 && ckv_dtype != SMOE_WDT_BF16) ||
        (kpe_dtype != SMOE_WDT_F32 && kpe_dtype != SMOE_WDT_BF16))
        return smoe_err_set(err, SMOE_EINVAL, "smoe_mla_decode: cache must be f32 or bf16");
    if (bias && bias_rows != 1 && bias_rows != B)
        return smoe_err_set(err, SMOE_EINVAL, "smoe_mla_decode: bias has %u rows, not 1 or B=%u",
                            bias_rows, B);
    uint32_t G = group_heads(d->H, B, c && c->nthreads ? c->nthreads : 1, group_max(d, T));
    size_t per = per_thread(d, T, G);
    if (scratch_bytes < 64 + per && G > 1) { /* scratch for fewer: one head an item */
        G = 1;
        per = per_thread(d, T, 1);
    }
    if (scratch_bytes < 64 + per)
        return smoe_err_set(err, SMOE_EINVAL, "smoe_mla_decode: %zu bytes of scratch, need %zu",
                            scratch_bytes, 64 + per);
    if ((B > 1 && (ckv_bstride < (size_t)S * d->r || kpe_bstride < (size_t)S * d->dr)))
        return smoe_err_set(err, SMOE_EINVAL, "smoe_mla_decode: batch strides overlap rows");
    size_t slots = (scratch_bytes - 64) / per;
    mla_job job = {.d = d, .B = B, .T = T, .S = S, .q_nope = q_nope, .q_pe = q_pe,
                   .ckv = ckv, .kpe = kpe, .ckv_bf16 = ckv_dtype == SMOE_WDT_BF16,
                   .kpe_bf16 = kpe_dtype == SMOE_WDT_BF16, .ckv_bstride = ckv_bstride,
                   .kpe_bstride = kpe_bstride, .w_uk = w->uk, .w_uv = w->uv,
                   .uk_scale = w->uk_scale, .uv_scale = w->uv_scale, .wdtype = d->wdtype,
                   .wsz = d->wdtype == SMOE_WDT_F32 ? 4 : d->wdtype == SMOE_WDT_BF16 ? 2 : 1,
                   .w_bf16 = d->wdtype == SMOE_WDT_BF16, .simd = attn_simd(c),
                   .bias = bias, .bias_rows = bias_rows,
                   .out = out,
                   .scratch = (uint8_t *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63),
                   .scratch_per = per, .nslots = slots > 1024 ? 1024u : (uint32_t)slots,
                   .G = G, .next = 0};
    if (smoe_wdt_is_block(d->wdtype)) {
        job.bimpl = c ? smoe_ffn_impl_blocks(c->isa, c->has_vnni, 0)
                      : smoe_ffn_impl_blocks(SMOE_ISA_SCALAR, 0, 0);
        job.uk_rb = (size_t)(d->dn / smoe_wdt_block_cols(d->wdtype)) *
                    smoe_wdt_block_bytes(d->wdtype);
        job.uv_rb = (size_t)(d->r / smoe_wdt_block_cols(d->uv_dtype)) *
                    smoe_wdt_block_bytes(d->uv_dtype);
        job.wsz = 1;
    }
    attn_run(c, ATTN_POOL_FN(c, mla_run), &job);
    return SMOE_OK;
}

/* Shared inner loops of the decode-attention kernels (mla.c, mha.c): f32 / bf16 dot products
 * and axpys in a fixed lane order, several rows at a time, and the online-softmax fold.  Every
 * function is always_inline, so each kernel instantiates them in its per-ISA runners (target
 * attributes) and the compiler vectorises them for that ISA.  Arithmetic: f32, no contraction
 * into FMA (ISO C mode), so every ISA gives the same bits. */
#ifndef SMOE_ATTN_IMPL_H
#define SMOE_ATTN_IMPL_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "kimpl.h"

#define AI static inline __attribute__((always_inline))
#define LANES 16

static inline size_t round64(size_t n) { return (n + 63) & ~(size_t)63; }

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

/* res[q] = dot_w(x, row q) for the PB rows at w + q * wstride bytes, computed together so
 * that PB independent accumulator chains hide the add latency and each x chunk is loaded once
 * for PB rows.  Each res[q] has exactly dot_w's bits (same lanes, order and reduction). */
#define PB 8
AI void dot_rows(const float *restrict x, const uint8_t *restrict w, size_t wstride, int bf16,
                 uint32_t n, float *restrict res) {
    float acc[PB][LANES];
    for (uint32_t q = 0; q < PB; q++)
        for (uint32_t k = 0; k < LANES; k++) acc[q][k] = 0.0f;
    uint32_t i = 0;
    if (bf16) {
        for (; i + LANES <= n; i += LANES)
            for (uint32_t q = 0; q < PB; q++) {
                const uint16_t *p = (const uint16_t *)(w + q * wstride) + i;
                for (uint32_t k = 0; k < LANES; k++) acc[q][k] += x[i + k] * bf16_f32(p[k]);
            }
        for (; i < n; i++)
            for (uint32_t q = 0; q < PB; q++)
                acc[q][i % LANES] += x[i] * bf16_f32(((const uint16_t *)(w + q * wstride))[i]);
    } else {
        for (; i + LANES <= n; i += LANES)
            for (uint32_t q = 0; q < PB; q++) {
                const float *p = (const float *)(w + q * wstride) + i;
                for (uint32_t k = 0; k < LANES; k++) acc[q][k] += x[i + k] * p[k];
            }
        for (; i < n; i++)
            for (uint32_t q = 0; q < PB; q++)
                acc[q][i % LANES] += x[i] * ((const float *)(w + q * wstride))[i];
    }
    for (uint32_t q = 0; q < PB; q++) {
        for (uint32_t w2 = LANES / 2; w2 > 0; w2 /= 2)
            for (uint32_t k = 0; k < w2; k++) acc[q][k] += acc[q][k + w2];
        res[q] = acc[q][0];
    }
}

/* Which intrinsics the f32 / bf16 row loops below go through: none (the plain loops),
 * mla_avx2.c's or mla_avx512.c's, by the kernel context's ISA.  The same bits either way (the
 * plain loops' code ran well below the intrinsics': see those files). */
enum { ATTN_SIMD_NONE = 0, ATTN_SIMD_AVX2 = 1, ATTN_SIMD_AVX512 = 2 };
static inline int attn_simd(const smoe_kctx *c) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (c && c->isa >= SMOE_ISA_AVX512) return ATTN_SIMD_AVX512;
    if (c && c->isa >= SMOE_ISA_AVX2) return ATTN_SIMD_AVX2;
#else
    (void)c;
#endif
    return ATTN_SIMD_NONE;
}

/* res[q] = dot_w(x, row q) for nrows rows at w + q * wstride: blocks of PB, then single rows,
 * or the simd (attn_simd) loops. */
AI void dot_many(const float *restrict x, const uint8_t *restrict w, size_t wstride, int bf16,
                 uint32_t n, uint32_t nrows, float *restrict res, int simd) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (simd == ATTN_SIMD_AVX512) {
        smoe_attn_dot_avx512(x, w, wstride / (bf16 ? 2 : 4), n, nrows, res, bf16);
        return;
    }
    if (simd == ATTN_SIMD_AVX2) {
        smoe_attn_dot_avx2(x, w, wstride / (bf16 ? 2 : 4), n, nrows, res, bf16);
        return;
    }
#else
    (void)simd;
#endif
    uint32_t q = 0;
    for (; q + PB <= nrows; q += PB)
        dot_rows(x, w + (size_t)q * wstride, wstride, bf16, n, res + q);
    for (; q < nrows; q++) res[q] = dot_w(x, w + (size_t)q * wstride, bf16, n);
}

/* y[0..n) += a * row for an int8 row (value q * sc[0]) or an int4 row (one value q in
 * [-8, 7] a byte, value q * sc[column / group]).  Plain loops the compiler vectorises. */
AI void scale_vec(float *restrict y, float a, uint32_t n) {
    for (uint32_t i = 0; i < n; i++) y[i] *= a;
}

/* A block's cached rows [np, n] as the heads of an item read them (one rule for mla.c and
 * mha.c): bf16 rows that more than one head reads are widened to f32 into buf once for all of
 * them (exact), other rows are read in place -- one head alone reads bf16 rows faster than it
 * widens them and then reads twice the bytes (16 query heads on 16 key/value heads, D = 128,
 * 2048 positions, 1 thread: 1.1 against 2.0 ms).  *rbf: whether the rows returned are bf16. */
AI const uint8_t *block_rows(const uint8_t *rows, int bf16, uint32_t readers, uint32_t np,
                             uint32_t n, float *buf, int *rbf) {
    *rbf = bf16 && readers < 2;
    if (!bf16 || readers < 2) return rows;
    const uint16_t *p = (const uint16_t *)rows;
    for (size_t i = 0; i < (size_t)np * n; i++) buf[i] = bf16_f32(p[i]);
    return (const uint8_t *)buf;
}

/* Batch invariance with holes (one rule for mla.c and mha.c).  A batched step keeps its rows'
 * caches side by side, a shorter row's missing positions masked out (holes: the left padding
 * of a joined row, a verification's rejected drafts; speculation/batch.py).  Masked positions
 * get weight 0 either way, but the running softmax moves its maximum once per block, so the
 * blocks must hold the same positions as the row's step alone would, or the roundings differ
 * (a bf16 logit one unit off, which flipped a greedy tie in serving).  So the blocks are
 * made of the row's positions that are not holes, PB at a time in order: a hole is a
 * position masked for every query of the row (masked: bias below SMOE_ATTN_HOLE,
 * transformers' masks using the most negative float or -inf).  A position some query sees
 * stays (the causal mask of a row's earlier queries, at the end; a sliding window's start,
 * which the earlier queries still see), with weight exactly 0 where it is masked.  Without a
 * bias, or for a row whose every position is masked (torch gives such a row uniform
 * weight), every position counts. */
#define SMOE_ATTN_HOLE (-1e37f)

/* Whether position p of a row's bias [T, S] is masked for every query. */
AI int is_hole(const float *bias, uint32_t T, uint32_t S, uint32_t p) {
    for (uint32_t t = 0; t < T; t++)
        if (!(bias[(size_t)t * S + p] < SMOE_ATTN_HOLE)) return 0;
    return 1;
}

/* The row's bias [T, S] when some of its positions are holes and some are not, else NULL
 * (no bias, no hole, or nothing but holes: every position counts, see above). */
AI const float *hole_row(const float *bias, uint32_t T, uint32_t S) {
    if (!bias) return NULL;
    int holes = 0, real = 0;
    for (uint32_t p = 0; p < S && !(holes && real); p++) {
        if (is_hole(bias, T, S, p))
            holes = 1;
        else
            real = 1;
    }
    return holes && real ? bias : NULL;
}

/* The next block: up to PB positions from *p on that are not holes of `holes` (a row's bias
 * [T, S] from hole_row; NULL: every position) into pos[], *p moved past them; returns how
 * many (0: none left). */
AI uint32_t next_block(const float *holes, uint32_t T, uint32_t S, uint32_t *p,
                       uint32_t *pos) {
    uint32_t np = 0, i = *p;
    for (; i < S && np < PB; i++)
        if (!holes || !is_hole(holes, T, S, i)) pos[np++] = i;
    *p = i;
    return np;
}

/* block_rows for the positions pos[0..np) of rows of `rowbytes` bytes at base: consecutive
 * positions as block_rows reads them; others (a block across a hole) copied into buf first
 * (bf16 rows widened where block_rows widens, else copied as they are), so the rows returned
 * are at a stride of one row either way.  buf holds PB f32 rows of n values. */
AI const uint8_t *block_rows_at(const uint8_t *base, size_t rowbytes, const uint32_t *pos,
                                uint32_t np, int bf16, uint32_t readers, uint32_t n, float *buf,
                                int *rbf) {
    if (pos[np - 1] - pos[0] + 1 == np)
        return block_rows(base + (size_t)pos[0] * rowbytes, bf16, readers, np, n, buf, rbf);
    *rbf = bf16 && readers < 2;
    if (bf16 && readers >= 2) {
        for (uint32_t q = 0; q < np; q++) {
            const uint16_t *src = (const uint16_t *)(base + (size_t)pos[q] * rowbytes);
            for (uint32_t e = 0; e < n; e++) buf[(size_t)q * n + e] = bf16_f32(src[e]);
        }
    } else {
        for (uint32_t q = 0; q < np; q++)
            memcpy((uint8_t *)buf + (size_t)q * rowbytes, base + (size_t)pos[q] * rowbytes,
                   rowbytes);
    }
    return (const uint8_t *)buf;
}

/* Heads an item of an attention kernel takes (one rule for mla.c and mha.c): out of `sets`
 * sets of `heads` heads that read the same cached rows (a batch row's heads, or a key/value
 * head's query heads), all of a set, split into as many chunks as it takes to give each of nt
 * threads an item, at most gmax. */
AI uint32_t group_heads(uint32_t heads, uint32_t sets, uint32_t nt, uint32_t gmax) {
    uint32_t split = (nt + sets - 1) / sets;
    if (split < 1) split = 1;
    uint32_t g = (heads + split - 1) / split;
    return g < gmax ? g : gmax;
}

/* The most heads an item may take when each needs per_head bytes of scratch that stays in L2
 * (256 KB for the item), 1 .. most. */
AI uint32_t group_max_of(size_t per_head, uint32_t most) {
    size_t g = ((size_t)256 << 10) / per_head;
    return g < 1 ? 1u : g > most ? most : (uint32_t)g;
}

/* y[0..n) += a[q] * rows[q] for q = 0 .. nrows - 1 in that order (per column of y the rows in
 * order, so the simd loops give the plain loops' bits); simd: as dot_many's. */
AI void axpy_many(float *restrict y, const float *a, const void *const *rows, uint32_t nrows,
                  uint32_t n, int bf16, int simd) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (simd == ATTN_SIMD_AVX512) {
        smoe_attn_axpy_avx512(y, a, rows, nrows, n, bf16);
        return;
    }
    if (simd == ATTN_SIMD_AVX2) {
        smoe_attn_axpy_avx2(y, a, rows, nrows, n, bf16);
        return;
    }
#else
    (void)simd;
#endif
    for (uint32_t q = 0; q < nrows; q++) axpy_w(y, a[q], rows[q], bf16, n);
}

/* One block of np <= PB positions folded into a query's running softmax (Milakov &
 * Gimelshein 2018): s[q] are the block's final scores (-inf: masked), (m, l) the running
 * maximum and sum, o[0..n) the running weighted sum of rows; row q at rows + q * rstride bytes
 * (f32 or bf16).  The maximum moves once per block; the caller divides o by l at the end.
 * simd: as dot_many's. */
AI void softmax_fold(float *restrict m, float *restrict l, float *restrict o, const float *s,
                     uint32_t np, const uint8_t *restrict rows, size_t rstride, int bf16,
                     uint32_t n, int simd) {
    float bmax = -INFINITY;
    for (uint32_t q = 0; q < np; q++)
        if (s[q] > bmax) bmax = s[q];
    if (bmax == -INFINITY) return; /* every position of the block masked out */
    if (bmax > *m) {               /* new maximum: rescale what was summed so far */
        float corr = *m == -INFINITY ? 0.0f : expf(*m - bmax);
        *l *= corr;
        scale_vec(o, corr, n);
        *m = bmax;
    }
    float e[PB];
    const void *r[PB];
    uint32_t k = 0;
    for (uint32_t q = 0; q < np; q++) {
        if (s[q] == -INFINITY) continue;
        e[k] = expf(s[q] - *m);
        *l += e[k];
        r[k++] = rows + (size_t)q * rstride;
    }
    axpy_many(o, e, r, k, n, bf16, simd);
}

/* The per-ISA pool functions of a kernel: NAME_scalar, NAME_avx2, NAME_avx512 (x86 only),
 * each running BODY((JOB *)arg, thread index) with BODY always_inline, so the body is compiled
 * once per ISA; attn_pool_fn picks one by the context's ISA.  attn_run runs it on c's pool. */
#if defined(__x86_64__) && defined(__GNUC__)
#define ATTN_RUNNERS(NAME, BODY, JOB)                                                          \
    static void NAME##_scalar(void *arg, uint32_t k, uint32_t n) {                             \
        (void)n;                                                                               \
        BODY((JOB *)arg, k);                                                                   \
    }                                                                                          \
    __attribute__((target("avx2,fma,f16c"))) static void NAME##_avx2(void *arg, uint32_t k,    \
                                                                     uint32_t n) {             \
        (void)n;                                                                               \
        BODY((JOB *)arg, k);                                                                   \
    }                                                                                          \
    __attribute__((target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq"))) static void    \
        NAME##_avx512(void *arg, uint32_t k, uint32_t n) {                                     \
        (void)n;                                                                               \
        BODY((JOB *)arg, k);                                                                   \
    }
#define ATTN_POOL_FN(c, NAME)                                                                  \
    ((c) && (c)->isa >= SMOE_ISA_AVX512 ? NAME##_avx512                                        \
     : (c) && (c)->isa >= SMOE_ISA_AVX2 ? NAME##_avx2                                          \
                                        : NAME##_scalar)
#else
#define ATTN_RUNNERS(NAME, BODY, JOB)                                                          \
    static void NAME##_scalar(void *arg, uint32_t k, uint32_t n) {                             \
        (void)n;                                                                               \
        BODY((JOB *)arg, k);                                                                   \
    }
#define ATTN_POOL_FN(c, NAME) ((void)(c), NAME##_scalar)
#endif

/* Run fn(job, thread) on every thread of c's pool (the caller's thread included), holding the
 * pool for the call. */
static inline void attn_run(smoe_kctx *c, smoe_kpool_fn fn, void *job) {
    smoe_kpool *pool = c ? c->pool : NULL;
    smoe_kpool_lock(pool);
    smoe_kpool_run(pool, fn, job);
    smoe_kpool_unlock(pool);
}

#endif

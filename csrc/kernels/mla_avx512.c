/* AVX-512 forms of mla.c's two loops over int8 / int4 absorbed weights (one value a byte):
 * q_lat = W_UK^T q (axpy_q, a row at a time) and the output rows W_UV . o (dotq_rows).
 * Written with intrinsics because the compiler's code for mla.c's plain loops (int8 -> int16
 * -> int32 widening in 256-bit halves, accumulators spilled) ran these at ~5 GB/s of weights,
 * a third of the bf16 weights' rate.  The arithmetic is the plain loops' lane for lane: every
 * column (axpy) or lane (dot) sums in the same order, products and sums rounded separately
 * (no FMA: mla.c is compiled as ISO C, which does not contract), the same pairwise reduction,
 * so every ISA still gives the same bits (test_mla_c.py checks it).  Compiled for the target
 * below and called only when the kernel context runs AVX-512 (mla.c). */
#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")
#include <immintrin.h>

#include "kimpl.h"

#define AI static inline __attribute__((always_inline))

AI __m512 ld_q(const int8_t *p) { /* 16 int8 -> f32, exact */
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)p)));
}
AI __m512 ldm_q(const int8_t *p, __mmask16 m) {
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(m, p)));
}
AI __mmask16 tail_mask(uint32_t n) {
    return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1u);
}

/* y[0..n) += (a * scale) * q for one int8 row (group 0: the row's scale sc[0]) or int4 row
 * (the scale of each column's group, sc[c / group]): mla.c's axpy_q.  A product and its sum
 * are rounded separately, as there.  Row by row, so the weights stream in order (column blocks
 * held in registers across rows, tried first, read the head's rows strided and ran slower from
 * DRAM than this from L1-resident y). */
void smoe_mla_axpy_q_avx512(float *y, float a, const int8_t *q, const float *sc,
                            uint32_t group, uint32_t n) {
    const uint32_t g_n = group ? group : n; /* columns per scale */
    for (uint32_t g0 = 0; g0 < n; g0 += g_n) {
        const __m512 as = _mm512_set1_ps(a * sc[group ? g0 / group : 0]);
        const uint32_t end = g0 + g_n < n ? g0 + g_n : n;
        uint32_t i = g0;
        for (; i + 16 <= end; i += 16)
            _mm512_storeu_ps(y + i, _mm512_add_ps(_mm512_loadu_ps(y + i),
                                                  _mm512_mul_ps(as, ld_q(q + i))));
        if (i < end) {
            const __mmask16 m = tail_mask(end - i);
            _mm512_mask_storeu_ps(y + i, m, _mm512_add_ps(_mm512_maskz_loadu_ps(m, y + i),
                                                          _mm512_mul_ps(as, ldm_q(q + i, m))));
        }
    }
}

/* mla.c's lane reduction: lanes k and k + w2 added for w2 = 8, 4, 2, 1 */
AI float reduce16(__m512 v) { /* the same pairs, in registers */
    __m256 a = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
    b = _mm_add_ps(b, _mm_movehl_ps(b, b));                 /* lanes k and k + 2 */
    b = _mm_add_ss(b, _mm_shuffle_ps(b, b, 1));             /* lanes 0 and 1 */
    return _mm_cvtss_f32(b);
}

/* NR rows (compile-time after inlining) of n columns from w (rows wrow bytes apart): int8
 * (group 0) x . q summed, then times the row's scale; int4: per group the partial sums, then
 * added times the group's scale. */
#define DR 8
AI void dotq_block(const float *x, const int8_t *w, size_t wrow, const float *sc, size_t srow,
                   uint32_t group, uint32_t n, const uint32_t NR, float *res) {
    __m512 acc[DR];
    for (uint32_t q = 0; q < NR; q++) acc[q] = _mm512_setzero_ps();
    if (!group) {
        uint32_t i = 0;
        for (; i + 16 <= n; i += 16) {
            const __m512 xv = _mm512_loadu_ps(x + i);
            for (uint32_t q = 0; q < NR; q++)
                acc[q] = _mm512_add_ps(acc[q], _mm512_mul_ps(xv, ld_q(w + q * wrow + i)));
        }
        if (i < n) {
            const __mmask16 m = tail_mask(n - i);
            const __m512 xv = _mm512_maskz_loadu_ps(m, x + i);
            for (uint32_t q = 0; q < NR; q++)
                acc[q] = _mm512_mask_add_ps(acc[q], m, acc[q],
                                            _mm512_mul_ps(xv, ldm_q(w + q * wrow + i, m)));
        }
        for (uint32_t q = 0; q < NR; q++) res[q] = reduce16(acc[q]) * sc[q * srow];
        return;
    }
    for (uint32_t g = 0; g < n / group; g++) {
        __m512 part[DR];
        for (uint32_t q = 0; q < NR; q++) part[q] = _mm512_setzero_ps();
        for (uint32_t i = g * group; i < (g + 1) * group; i += 16) {
            const __m512 xv = _mm512_loadu_ps(x + i);
            for (uint32_t q = 0; q < NR; q++)
                part[q] = _mm512_add_ps(part[q], _mm512_mul_ps(xv, ld_q(w + q * wrow + i)));
        }
        for (uint32_t q = 0; q < NR; q++)
            acc[q] = _mm512_add_ps(acc[q],
                                   _mm512_mul_ps(_mm512_set1_ps(sc[q * srow + g]), part[q]));
    }
    for (uint32_t q = 0; q < NR; q++) res[q] = reduce16(acc[q]);
}

/* f32 and bf16 rows: the MLA kernel's absorbed weights and cached latent rows, and the MHA
 * kernel's cached keys and values (attn_impl.h's dot_many and softmax_fold; 2026-11-26).  The
 * compiler's code for the plain loops (bf16: a 64-byte load split in halves, each widened,
 * shifted, multiplied and added; the reduction through memory) computed at 20-31 GB/s of
 * weights from L3 and about a third of that from DRAM: a DeepSeek-V2-Lite layer's 4.2 MB of
 * absorbed bf16 weights took 450-490 us at 1 thread, 600 us with 96 cached positions, 3.3 ms
 * with 2048.  Here a bf16 row's 16 values are one widening load (vpmovzxwd from memory) and a
 * shift, the axpy adds up to eight rows into y per load and store of y (the cached rows of a
 * softmax block), and reduce16 stays in registers; with mla.c's streaming of weight rows and
 * its items of several heads (see there): 265-310, 335-370 us and 1.65-1.8 ms
 * (benchmarks/c/mla_decode.c, 1 thread, alternating with the old build).  The arithmetic is
 * the plain loops' lane for lane: per column of y the rows in the same order, each product and
 * sum rounded separately; per lane of a dot product the columns in the same order and the same
 * pairwise reduction, so the bits are those of every other ISA (test_mla_c.py,
 * test_attention.py). */
AI __m512 ld_bf(const uint16_t *p) { /* 16 bf16 -> f32, exact */
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
AI __m512 ldm_bf(const uint16_t *p, __mmask16 m) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
/* 16 values of row p from column i on, f32 or bf16 (bf16: compile-time after inlining) */
AI __m512 ld_row(const void *p, uint32_t i, const int bf16) {
    return bf16 ? ld_bf((const uint16_t *)p + i) : _mm512_loadu_ps((const float *)p + i);
}
AI __m512 ldm_row(const void *p, uint32_t i, __mmask16 m, const int bf16) {
    return bf16 ? ldm_bf((const uint16_t *)p + i, m)
                : _mm512_maskz_loadu_ps(m, (const float *)p + i);
}

/* y += a[q] * rows[q] for NR rows (compile-time after inlining), in order, per 16 columns */
AI void axpy_block(float *y, const float *a, const void *const *r, uint32_t n, const uint32_t NR,
                   const int bf16) {
    __m512 av[8];
    for (uint32_t q = 0; q < NR; q++) av[q] = _mm512_set1_ps(a[q]);
    uint32_t i = 0;
    for (; i + 16 <= n; i += 16) {
        __m512 v = _mm512_loadu_ps(y + i);
        for (uint32_t q = 0; q < NR; q++)
            v = _mm512_add_ps(v, _mm512_mul_ps(av[q], ld_row(r[q], i, bf16)));
        _mm512_storeu_ps(y + i, v);
    }
    if (i < n) {
        const __mmask16 m = tail_mask(n - i);
        __m512 v = _mm512_maskz_loadu_ps(m, y + i);
        for (uint32_t q = 0; q < NR; q++)
            v = _mm512_add_ps(v, _mm512_mul_ps(av[q], ldm_row(r[q], i, m, bf16)));
        _mm512_mask_storeu_ps(y + i, m, v);
    }
}

AI void axpy_rows(float *y, const float *a, const void *const *rows, uint32_t nrows, uint32_t n,
                  const int bf16) {
    uint32_t q = 0;
    for (; q + 8 <= nrows; q += 8) axpy_block(y, a + q, rows + q, n, 8, bf16);
    switch (nrows - q) { /* up to eight rows per pass over y */
    case 7: axpy_block(y, a + q, rows + q, n, 7, bf16); break;
    case 6: axpy_block(y, a + q, rows + q, n, 6, bf16); break;
    case 5: axpy_block(y, a + q, rows + q, n, 5, bf16); break;
    case 4: axpy_block(y, a + q, rows + q, n, 4, bf16); break;
    case 3: axpy_block(y, a + q, rows + q, n, 3, bf16); break;
    case 2: axpy_block(y, a + q, rows + q, n, 2, bf16); break;
    case 1: axpy_block(y, a + q, rows + q, n, 1, bf16); break;
    default: break;
    }
}

void smoe_attn_axpy_avx512(float *y, const float *a, const void *const *rows, uint32_t nrows,
                           uint32_t n, int bf16) {
    if (bf16)
        axpy_rows(y, a, rows, nrows, n, 1);
    else
        axpy_rows(y, a, rows, nrows, n, 0);
}

/* res[q] = x . row q for NR rows (compile-time after inlining) wrow values apart */
AI void dot_block(const float *x, const void *w, size_t wrow, uint32_t n, const uint32_t NR,
                  const int bf16, float *res) {
    const size_t esz = bf16 ? 2 : 4;
    __m512 acc[DR];
    for (uint32_t q = 0; q < NR; q++) acc[q] = _mm512_setzero_ps();
    uint32_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 xv = _mm512_loadu_ps(x + i);
        for (uint32_t q = 0; q < NR; q++)
            acc[q] = _mm512_add_ps(
                acc[q], _mm512_mul_ps(xv, ld_row((const uint8_t *)w + q * wrow * esz, i, bf16)));
    }
    if (i < n) {
        const __mmask16 m = tail_mask(n - i);
        const __m512 xv = _mm512_maskz_loadu_ps(m, x + i);
        for (uint32_t q = 0; q < NR; q++)
            acc[q] = _mm512_mask_add_ps(
                acc[q], m, acc[q],
                _mm512_mul_ps(xv, ldm_row((const uint8_t *)w + q * wrow * esz, i, m, bf16)));
    }
    for (uint32_t q = 0; q < NR; q++) res[q] = reduce16(acc[q]);
}

AI void dot_rows_x(const float *x, const void *w, size_t wrow, uint32_t n, uint32_t nrows,
                   const int bf16, float *res) {
    const size_t esz = bf16 ? 2 : 4;
    uint32_t e = 0;
    for (; e + DR <= nrows; e += DR)
        dot_block(x, (const uint8_t *)w + e * wrow * esz, wrow, n, DR, bf16, res + e);
    for (; e < nrows; e++)
        dot_block(x, (const uint8_t *)w + e * wrow * esz, wrow, n, 1, bf16, res + e);
}

void smoe_attn_dot_avx512(const float *x, const void *w, size_t wrow, uint32_t n, uint32_t nrows,
                          float *res, int bf16) {
    if (bf16)
        dot_rows_x(x, w, wrow, n, nrows, 1, res);
    else
        dot_rows_x(x, w, wrow, n, nrows, 0, res);
}

void smoe_mla_dotq_avx512(const float *x, const int8_t *w, size_t wrow, const float *sc,
                          size_t srow, uint32_t group, uint32_t n, uint32_t nrows, float *res) {
    uint32_t e = 0;
    for (; e + DR <= nrows; e += DR)
        dotq_block(x, w + e * wrow, wrow, sc + e * srow, srow, group, n, DR, res + e);
    for (; e < nrows; e++)
        dotq_block(x, w + e * wrow, wrow, sc + e * srow, srow, group, n, 1, res + e);
}
#endif

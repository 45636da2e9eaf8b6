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
AI float reduce16(__m512 v) {
    float t[16];
    _mm512_storeu_ps(t, v);
    for (uint32_t w2 = 8; w2 > 0; w2 /= 2)
        for (uint32_t k = 0; k < w2; k++) t[k] += t[k + w2];
    return t[0];
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

/* bf16 rows: the MLA kernel's absorbed weights and cached latent rows, and the MHA kernel's cached
 * keys and values (attn_impl.h's dot_many and softmax_fold; 2026-11-26).  The compiler's code for
 * the plain bf16 loops (a 64-byte load split in halves, each widened, shifted, multiplied and
 * added) computed at 20-31 GB/s of weights from L3 and about a third of that from DRAM: a
 * DeepSeek-V2-Lite layer's 4.2 MB of absorbed weights took 450-490 us at 1 thread, 600 us with 96
 * cached positions.  Here a row's 16 values are one widening load (vpmovzxwd from memory) and a
 * shift, and the axpy adds up to four rows into y per load and store of y (the cached rows of a
 * softmax block); mla.c streams the weight rows one at a time through these (see there): 285-340
 * and 410-440 us (benchmarks/c/mla_decode.c, 1 thread, interleaved with the old build).  The
 * arithmetic is the plain loops' lane for lane: per column of y the rows in the same order, each
 * product and sum rounded separately; per lane of a dot product the columns in the same order and
 * the same pairwise reduction (reduce16), so the bits are those of every other ISA (test_mla_c.py,
 * test_attention.py). */
AI __m512 ld_bf(const uint16_t *p) { /* 16 bf16 -> f32, exact */
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)p)), 16));
}
AI __m512 ldm_bf(const uint16_t *p, __mmask16 m) {
    return _mm512_castsi512_ps(
        _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}

void smoe_attn_axpy_bf16_avx512(float *y, const float *a, const uint16_t *const *rows,
                                uint32_t nrows, uint32_t n) {
    for (uint32_t q0 = 0; q0 < nrows; q0 += 4) { /* four rows per pass over y */
        const uint32_t nr = nrows - q0 < 4 ? nrows - q0 : 4;
        __m512 av[4];
        for (uint32_t q = 0; q < nr; q++) av[q] = _mm512_set1_ps(a[q0 + q]);
        const uint16_t *const *r = rows + q0;
        uint32_t i = 0;
        for (; i + 16 <= n; i += 16) {
            __m512 v = _mm512_loadu_ps(y + i);
            for (uint32_t q = 0; q < nr; q++)
                v = _mm512_add_ps(v, _mm512_mul_ps(av[q], ld_bf(r[q] + i)));
            _mm512_storeu_ps(y + i, v);
        }
        if (i < n) {
            const __mmask16 m = tail_mask(n - i);
            __m512 v = _mm512_maskz_loadu_ps(m, y + i);
            for (uint32_t q = 0; q < nr; q++)
                v = _mm512_add_ps(v, _mm512_mul_ps(av[q], ldm_bf(r[q] + i, m)));
            _mm512_mask_storeu_ps(y + i, m, v);
        }
    }
}

AI void dotbf_block(const float *x, const uint16_t *w, size_t wrow, uint32_t n, const uint32_t NR,
                    float *res) {
    __m512 acc[DR];
    for (uint32_t q = 0; q < NR; q++) acc[q] = _mm512_setzero_ps();
    uint32_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m512 xv = _mm512_loadu_ps(x + i);
        for (uint32_t q = 0; q < NR; q++)
            acc[q] = _mm512_add_ps(acc[q], _mm512_mul_ps(xv, ld_bf(w + q * wrow + i)));
    }
    if (i < n) {
        const __mmask16 m = tail_mask(n - i);
        const __m512 xv = _mm512_maskz_loadu_ps(m, x + i);
        for (uint32_t q = 0; q < NR; q++)
            acc[q] = _mm512_mask_add_ps(acc[q], m, acc[q],
                                        _mm512_mul_ps(xv, ldm_bf(w + q * wrow + i, m)));
    }
    for (uint32_t q = 0; q < NR; q++) res[q] = reduce16(acc[q]);
}

void smoe_attn_dot_bf16_avx512(const float *x, const uint16_t *w, size_t wrow, uint32_t n,
                               uint32_t nrows, float *res) {
    uint32_t e = 0;
    for (; e + DR <= nrows; e += DR) dotbf_block(x, w + e * wrow, wrow, n, DR, res + e);
    for (; e < nrows; e++) dotbf_block(x, w + e * wrow, wrow, n, 1, res + e);
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

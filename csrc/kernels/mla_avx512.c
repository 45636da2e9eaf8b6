/* AVX-512 forms of mla.c's two loops over int8 / int4 absorbed weights (one value a byte):
 * q_lat = W_UK^T q (qlat_cols) and the output rows W_UV . o (dotq_rows).  Written with
 * intrinsics because the compiler's code for mla.c's plain loops (int8 -> int16 -> int32
 * widening in 256-bit halves, accumulators spilled) ran these at ~5 GB/s of weights, a third
 * of the bf16 weights' rate.  The arithmetic is the plain loops' lane for lane: every
 * column (qlat) or lane (dot) sums in the same order, products and sums rounded separately
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
AI __mmask16 tail_mask(uint32_t n) { return n >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << n) - 1u); }

/* One block of up to QV vectors of 16 columns from c0 (nc columns, the last vector masked);
 * QV a compile-time constant after inlining. */
#define QV 8
AI void qlat_block(float *y, const float *a, const int8_t *w, size_t wrow, const float *sc,
                   size_t srow, uint32_t group, uint32_t dn, uint32_t c0, uint32_t nc) {
    __m512 acc[QV];
    const uint32_t nv = (nc + 15) / 16;
    const __mmask16 last = tail_mask(nc - (nv - 1) * 16);
    uint32_t gi[QV]; /* each vector's scale index in a row */
    for (uint32_t v = 0; v < QV; v++) {
        acc[v] = _mm512_setzero_ps();
        gi[v] = group ? (c0 + 16 * v) / group : 0;
    }
    for (uint32_t d = 0; d < dn; d++) {
        const int8_t *p = w + d * wrow + c0;
        const float *s = sc + d * srow;
        for (uint32_t v = 0; v < QV; v++) {
            if (v >= nv) break;
            /* int8: the row's scale; int4: the scale of this vector's group (group is a
             * multiple of 32, so a vector never straddles two) */
            const float as = a[d] * s[gi[v]];
            const __mmask16 m = v + 1 == nv ? last : (__mmask16)0xFFFF;
            const __m512 prod = _mm512_mul_ps(_mm512_set1_ps(as), ldm_q(p + 16 * v, m));
            acc[v] = _mm512_mask_add_ps(acc[v], m, acc[v], prod);
        }
    }
    for (uint32_t v = 0; v < nv; v++)
        _mm512_mask_storeu_ps(y + c0 + 16 * v, v + 1 == nv ? last : (__mmask16)0xFFFF, acc[v]);
}

void smoe_mla_qlat_q_avx512(float *y, const float *a, const int8_t *w, size_t wrow,
                            const float *sc, size_t srow, uint32_t group, uint32_t dn,
                            uint32_t r) {
    for (uint32_t c0 = 0; c0 < r; c0 += 16 * QV) {
        const uint32_t nc = r - c0 < 16 * QV ? r - c0 : 16 * QV;
        qlat_block(y, a, w, wrow, sc, srow, group, dn, c0, nc);
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

void smoe_mla_dotq_avx512(const float *x, const int8_t *w, size_t wrow, const float *sc,
                          size_t srow, uint32_t group, uint32_t n, uint32_t nrows, float *res) {
    uint32_t e = 0;
    for (; e + DR <= nrows; e += DR)
        dotq_block(x, w + e * wrow, wrow, sc + e * srow, srow, group, n, DR, res + e);
    for (; e < nrows; e++)
        dotq_block(x, w + e * wrow, wrow, sc + e * srow, srow, group, n, 1, res + e);
}
#endif

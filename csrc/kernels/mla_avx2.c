/* AVX2 forms of attn_impl.h's f32 / bf16 row loops (the absorbed MLA weights and cached
 * latent rows of mla.c, the cached keys and values of mha.c): y += a[q] * rows[q] and
 * res[e] = x . row e; and of mla.c's int8 / int4 weight loops (at the end).  The compiler's
 * code for the plain loops at AVX2 read a DeepSeek-V2-Lite layer's 4.2 MB of bf16 absorbed
 * weights at 0.43 of a plain read loop and took 9 ms at 2048 cached positions
 * (benchmarks/c/mla_decode.c, AMD EPYC Zen 1, 1 thread, 2026-12-05).
 *
 * The arithmetic is the plain loops' lane for lane, as in mla_avx512.c: a dot product's 16
 * partial sums are two 8-lane registers (lanes 0-7 and 8-15), each product and sum rounded
 * separately (no FMA; kernel files are compiled as ISO C, which does not contract), then the
 * same pairwise reduction (lanes k and k + w2 for w2 = 8, 4, 2, 1); an axpy adds the rows
 * into each column in row order.  So every ISA gives the same bits (test_mla_c.py,
 * test_attention.py compare them).  At most four rows a dot block: eight accumulators of the
 * sixteen ymm registers; an axpy pass runs two 8-column chains of dependent adds side by side.
 * Against the plain loops (mla_decode.c, same host, 4 alternated rounds, 2026-12-05): 1.19-1.38x
 * at 96 cached positions and 1.63-1.79x at 2048 on 1 thread (9 ms -> 5 ms), 1.67-1.75x at 2048
 * on 2.  Compiled for AVX2 below and called only when the kernel context runs AVX2 (attn_impl.h's
 * attn_simd). */
#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#include "attn_impl.h" /* bf16_f32, AI */

/* 8 values of row p from column i on, f32 or bf16 (bf16: compile-time after inlining) */
AI __m256 ld8(const void *p, uint32_t i, const int bf16) {
    if (bf16)
        return _mm256_castsi256_ps(_mm256_slli_epi32(
            _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)p + i))),
            16));
    return _mm256_loadu_ps((const float *)p + i);
}
AI float ld1(const void *p, uint32_t i, const int bf16) {
    return bf16 ? bf16_f32(((const uint16_t *)p)[i]) : ((const float *)p)[i];
}

/* y += a[q] * rows[q] for NR rows (compile-time after inlining), in row order per column */
AI void axpy_block(float *y, const float *a, const void *const *r, uint32_t n, const uint32_t NR,
                   const int bf16) {
    __m256 av[8];
    for (uint32_t q = 0; q < NR; q++) av[q] = _mm256_set1_ps(a[q]);
    uint32_t i = 0;
    for (; i + 16 <= n; i += 16) { /* two columns' chains of dependent adds side by side */
        __m256 v0 = _mm256_loadu_ps(y + i), v1 = _mm256_loadu_ps(y + i + 8);
        for (uint32_t q = 0; q < NR; q++) {
            v0 = _mm256_add_ps(v0, _mm256_mul_ps(av[q], ld8(r[q], i, bf16)));
            v1 = _mm256_add_ps(v1, _mm256_mul_ps(av[q], ld8(r[q], i + 8, bf16)));
        }
        _mm256_storeu_ps(y + i, v0);
        _mm256_storeu_ps(y + i + 8, v1);
    }
    for (; i + 8 <= n; i += 8) {
        __m256 v = _mm256_loadu_ps(y + i);
        for (uint32_t q = 0; q < NR; q++)
            v = _mm256_add_ps(v, _mm256_mul_ps(av[q], ld8(r[q], i, bf16)));
        _mm256_storeu_ps(y + i, v);
    }
    for (; i < n; i++) {
        float v = y[i];
        for (uint32_t q = 0; q < NR; q++) v += a[q] * ld1(r[q], i, bf16);
        y[i] = v;
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

void smoe_attn_axpy_avx2(float *y, const float *a, const void *const *rows, uint32_t nrows,
                         uint32_t n, int bf16) {
    if (bf16)
        axpy_rows(y, a, rows, nrows, n, 1);
    else
        axpy_rows(y, a, rows, nrows, n, 0);
}

/* The plain loops' reduction of 16 partial sums held as lanes 0-7 (lo) and 8-15 (hi) */
AI float reduce16(__m256 lo, __m256 hi) {
    __m256 a = _mm256_add_ps(lo, hi);                                   /* k and k + 8 */
    __m128 b = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1)); /* + 4 */
    b = _mm_add_ps(b, _mm_movehl_ps(b, b));                             /* k and k + 2 */
    b = _mm_add_ss(b, _mm_shuffle_ps(b, b, 1));                         /* 0 and 1 */
    return _mm_cvtss_f32(b);
}

/* res[q] = x . row q for NR rows (compile-time after inlining) wrow values apart */
#define DR 4
AI void dot_block(const float *x, const void *w, size_t wrow, uint32_t n, const uint32_t NR,
                  const int bf16, float *res) {
    const size_t rb = wrow * (bf16 ? 2 : 4); /* bytes a row */
    __m256 lo[DR], hi[DR];
    for (uint32_t q = 0; q < NR; q++) lo[q] = hi[q] = _mm256_setzero_ps();
    uint32_t i = 0;
    for (; i + 16 <= n; i += 16) {
        const __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + i + 8);
        for (uint32_t q = 0; q < NR; q++) {
            const void *p = (const uint8_t *)w + q * rb;
            lo[q] = _mm256_add_ps(lo[q], _mm256_mul_ps(x0, ld8(p, i, bf16)));
            hi[q] = _mm256_add_ps(hi[q], _mm256_mul_ps(x1, ld8(p, i + 8, bf16)));
        }
    }
    if (i < n) { /* the tail's columns into their lanes (i % 16), as the plain loops do */
        for (uint32_t q = 0; q < NR; q++) {
            float acc[16];
            _mm256_storeu_ps(acc, lo[q]);
            _mm256_storeu_ps(acc + 8, hi[q]);
            const void *p = (const uint8_t *)w + q * rb;
            for (uint32_t c = i; c < n; c++) acc[c - i] += x[c] * ld1(p, c, bf16);
            lo[q] = _mm256_loadu_ps(acc);
            hi[q] = _mm256_loadu_ps(acc + 8);
        }
    }
    for (uint32_t q = 0; q < NR; q++) res[q] = reduce16(lo[q], hi[q]);
}

AI void dot_rows_x(const float *x, const void *w, size_t wrow, uint32_t n, uint32_t nrows,
                   const int bf16, float *res) {
    const size_t rb = wrow * (bf16 ? 2 : 4);
    uint32_t e = 0;
    for (; e + DR <= nrows; e += DR)
        dot_block(x, (const uint8_t *)w + e * rb, wrow, n, DR, bf16, res + e);
    for (; e < nrows; e++) dot_block(x, (const uint8_t *)w + e * rb, wrow, n, 1, bf16, res + e);
}

void smoe_attn_dot_avx2(const float *x, const void *w, size_t wrow, uint32_t n, uint32_t nrows,
                        float *res, int bf16) {
    if (bf16)
        dot_rows_x(x, w, wrow, n, nrows, 1, res);
    else
        dot_rows_x(x, w, wrow, n, nrows, 0, res);
}

/* int8 / int4 absorbed weights (one value a byte): mla.c's axpy_q and dotq_rows, as
 * mla_avx512.c's smoe_mla_axpy_q_avx512 / smoe_mla_dotq_avx512 (group 0: int8, a scale a row;
 * else int4, a scale a group of columns, group a multiple of 16).  Against the plain loops
 * (mla_decode.c with MLA_WDTYPE, 96 cached positions, 1 thread, 4 alternated rounds, the host
 * above): int4 2.3-3.1x (3.3 ms -> 1.1 ms a layer); int8 0.71-1.76x, no clear change (the
 * compiler's code for its one-scale rows was already as fast). */
AI __m256 ld8_q(const int8_t *p) { /* 8 int8 -> f32, exact */
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)p)));
}

void smoe_mla_axpy_q_avx2(float *y, float a, const int8_t *q, const float *sc, uint32_t group,
                          uint32_t n) {
    const uint32_t g_n = group ? group : n; /* columns per scale */
    for (uint32_t g0 = 0; g0 < n; g0 += g_n) {
        const float as = a * sc[group ? g0 / group : 0];
        const __m256 av = _mm256_set1_ps(as);
        const uint32_t end = g0 + g_n < n ? g0 + g_n : n;
        uint32_t i = g0;
        for (; i + 8 <= end; i += 8)
            _mm256_storeu_ps(y + i, _mm256_add_ps(_mm256_loadu_ps(y + i),
                                                  _mm256_mul_ps(av, ld8_q(q + i))));
        for (; i < end; i++) y[i] += as * (float)q[i];
    }
}

AI void dotq_block(const float *x, const int8_t *w, size_t wrow, const float *sc, size_t srow,
                   uint32_t group, uint32_t n, const uint32_t NR, float *res) {
    __m256 lo[DR], hi[DR];
    for (uint32_t q = 0; q < NR; q++) lo[q] = hi[q] = _mm256_setzero_ps();
    if (!group) {
        uint32_t i = 0;
        for (; i + 16 <= n; i += 16) {
            const __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + i + 8);
            for (uint32_t q = 0; q < NR; q++) {
                lo[q] = _mm256_add_ps(lo[q], _mm256_mul_ps(x0, ld8_q(w + q * wrow + i)));
                hi[q] = _mm256_add_ps(hi[q], _mm256_mul_ps(x1, ld8_q(w + q * wrow + i + 8)));
            }
        }
        for (uint32_t q = 0; q < NR; q++) {
            if (i < n) { /* the tail's columns into their lanes (i % 16) */
                float acc[16];
                _mm256_storeu_ps(acc, lo[q]);
                _mm256_storeu_ps(acc + 8, hi[q]);
                for (uint32_t c = i; c < n; c++) acc[c - i] += x[c] * (float)w[q * wrow + c];
                lo[q] = _mm256_loadu_ps(acc);
                hi[q] = _mm256_loadu_ps(acc + 8);
            }
            res[q] = reduce16(lo[q], hi[q]) * sc[q * srow];
        }
        return;
    }
    for (uint32_t g = 0; g < n / group; g++) {
        __m256 plo[DR], phi[DR];
        for (uint32_t q = 0; q < NR; q++) plo[q] = phi[q] = _mm256_setzero_ps();
        for (uint32_t i = g * group; i < (g + 1) * group; i += 16) {
            const __m256 x0 = _mm256_loadu_ps(x + i), x1 = _mm256_loadu_ps(x + i + 8);
            for (uint32_t q = 0; q < NR; q++) {
                plo[q] = _mm256_add_ps(plo[q], _mm256_mul_ps(x0, ld8_q(w + q * wrow + i)));
                phi[q] = _mm256_add_ps(phi[q], _mm256_mul_ps(x1, ld8_q(w + q * wrow + i + 8)));
            }
        }
        for (uint32_t q = 0; q < NR; q++) {
            const __m256 s = _mm256_set1_ps(sc[q * srow + g]);
            lo[q] = _mm256_add_ps(lo[q], _mm256_mul_ps(s, plo[q]));
            hi[q] = _mm256_add_ps(hi[q], _mm256_mul_ps(s, phi[q]));
        }
    }
    for (uint32_t q = 0; q < NR; q++) res[q] = reduce16(lo[q], hi[q]);
}

void smoe_mla_dotq_avx2(const float *x, const int8_t *w, size_t wrow, const float *sc,
                        size_t srow, uint32_t group, uint32_t n, uint32_t nrows, float *res) {
    uint32_t e = 0;
    for (; e + DR <= nrows; e += DR)
        dotq_block(x, w + e * wrow, wrow, sc + e * srow, srow, group, n, DR, res + e);
    for (; e < nrows; e++)
        dotq_block(x, w + e * wrow, wrow, sc + e * srow, srow, group, n, 1, res + e);
}
#endif

/* AVX2 + FMA expert FFN path (8 floats per vector).  Same structure as ffn_avx512.c: two
 * weight rows against up to 4 tokens per pass (DENSE_DOT), or 6 for f32/bf16/int8 where that
 * many are left (WIDE_DOT), weights widened to f32 in registers. */
#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>
#include <string.h>

#include "kimpl.h"

#define AI static inline __attribute__((always_inline))
#define NTMAX 4

AI __m256 ld_f32(const void *w, size_t k) { return _mm256_loadu_ps((const float *)w + k); }
AI __m256 ld_bf16(const void *w, size_t k) {
    __m128i v = _mm_loadu_si128((const __m128i *)((const uint16_t *)w + k));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(v), 16));
}
AI __m256 ld_i8(const void *w, size_t k) {
    __m128i v = _mm_loadl_epi64((const __m128i *)((const int8_t *)w + k));
    return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v));
}
AI float sc_f32(const void *w, size_t k) { return ((const float *)w)[k]; }
AI float sc_bf16(const void *w, size_t k) {
    uint32_t b = (uint32_t)((const uint16_t *)w)[k] << 16;
    float f;
    memcpy(&f, &b, 4);
    return f;
}
AI float sc_i8(const void *w, size_t k) { return (float)((const int8_t *)w)[k]; }

AI float hsum(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* Weights for the 32 columns at k in x's layout: v[q] <-> x[k+8q .. k+8q+7].  BF16 uses the
 * even/odd layout (smoe_perm_pos): the 16 bf16 at k give even columns -> x[k..k+7] and odd
 * columns -> x[k+16..k+23]; the 16 at k+16 give x[k+8..k+15] and x[k+24..k+31]. */
AI void ld4_f32(const void *w, size_t k, __m256 *v) {
    for (int q = 0; q < 4; q++) v[q] = ld_f32(w, k + 8 * (size_t)q);
}
AI void ld4_i8(const void *w, size_t k, __m256 *v) {
    for (int q = 0; q < 4; q++) v[q] = ld_i8(w, k + 8 * (size_t)q);
}
AI void ld4_bf16(const void *w, size_t k, __m256 *v) {
    const __m256i hm = _mm256_set1_epi32((int)0xFFFF0000u);
    __m256i p = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + k));
    __m256i r = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + k + 16));
    v[0] = _mm256_castsi256_ps(_mm256_slli_epi32(p, 16));
    v[2] = _mm256_castsi256_ps(_mm256_and_si256(p, hm));
    v[1] = _mm256_castsi256_ps(_mm256_slli_epi32(r, 16));
    v[3] = _mm256_castsi256_ps(_mm256_and_si256(r, hm));
}

/* The end of a row pair's dot products over NT tokens: chains a and b summed, the columns past
 * the last 8-column block added one by one from k, r0/r1 written (DENSE_DOT and WIDE_DOT). */
#define DOT_FINISH(SC, NT)                                                                      \
        _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                                  \
            float s0 = hsum(_mm256_add_ps(a0[t], b0[t]));                                       \
            float s1 = hsum(_mm256_add_ps(a1[t], b1[t]));                                       \
            for (uint32_t c = k; c < n; c++) {                                                  \
                s0 += SC(w0, c) * x[t * xs + c];                                                \
                s1 += SC(w1, c) * x[t * xs + c];                                                \
            }                                                                                   \
            r0[t] = s0;                                                                         \
            r1[t] = s1;                                                                         \
        }

/* The 8-column blocks past the last full 32-block, in natural order into chain a (while
 * COND, which may be empty), over NT tokens (DENSE_DOT and WIDE_DOT). */
#define DOT_TAIL8(LD, NT, COND)                                                                 \
        for (; COND k + 8 <= n; k += 8) {                                                       \
            __m256 tw0 = LD(w0, k), tw1 = LD(w1, k);                                            \
            _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                              \
                __m256 tx = _mm256_loadu_ps(x + t * xs + k);                                    \
                a0[t] = _mm256_fmadd_ps(tw0, tx, a0[t]);                                        \
                a1[t] = _mm256_fmadd_ps(tw1, tx, a1[t]);                                        \
            }                                                                                   \
        }

/* Columns past the last full 32-block are in natural order (LD, then scalar SC).  Every (row,
 * token) keeps two accumulator chains (a, b) at every token count, so that a token's sums do
 * not depend on the tokens beside it (batch invariance: a verification or serving batch gives
 * one-token decoding's bits).  At NTMAX = 4 tokens that is 16 accumulators, some spilled: the
 * same rate as one chain at 3+ tokens (Zen 4 forced to AVX2, 1 thread, bf16 / f32 at 4 and 8
 * tokens, OLMoE and DeepSeek-V2-Lite shapes, 2 A/B rounds: within 5 %), where tiles of 2
 * tokens lost a quarter on bf16 (the widening done twice). */
#define DENSE_DOT(NAME, LD4, LD, SC)                                                            \
    AI void NAME(const void *w0, const void *w1, const float *x, size_t xs, uint32_t n,         \
                 const int NT, float *r0, float *r1) {                                          \
        __m256 a0[NTMAX], a1[NTMAX], b0[NTMAX], b1[NTMAX];                                      \
        _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++)                                    \
            a0[t] = a1[t] = b0[t] = b1[t] = _mm256_setzero_ps();                                \
        uint32_t k = 0;                                                                         \
        for (; k + 32 <= n; k += 32) {                                                          \
            __m256 v0[4], v1[4];                                                                \
            LD4(w0, k, v0);                                                                     \
            LD4(w1, k, v1);                                                                     \
            _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                              \
                _Pragma("GCC unroll 4") for (int q = 0; q < 4; q += 2) {                        \
                    __m256 xa = _mm256_loadu_ps(x + t * xs + k + 8 * q);                        \
                    __m256 xb = _mm256_loadu_ps(x + t * xs + k + 8 * q + 8);                    \
                    a0[t] = _mm256_fmadd_ps(v0[q], xa, a0[t]);                                  \
                    a1[t] = _mm256_fmadd_ps(v1[q], xa, a1[t]);                                  \
                    b0[t] = _mm256_fmadd_ps(v0[q + 1], xb, b0[t]);                              \
                    b1[t] = _mm256_fmadd_ps(v1[q + 1], xb, b1[t]);                              \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
        DOT_TAIL8(LD, NT, )                                                                     \
        DOT_FINISH(SC, NT)                                                                      \
    }

DENSE_DOT(dot_f32, ld4_f32, ld_f32, sc_f32)
DENSE_DOT(dot_bf16, ld4_bf16, ld_bf16, sc_bf16)
DENSE_DOT(dot_i8, ld4_i8, ld_i8, sc_i8)

/* One weight vector: v[q] of ld4_* above (the 8 columns matched with x[k+8q .. k+8q+7]). */
AI __m256 ld1_f32(const void *w, size_t k, int q) { return ld_f32(w, k + 8 * (size_t)q); }
AI __m256 ld1_i8(const void *w, size_t k, int q) { return ld_i8(w, k + 8 * (size_t)q); }
AI __m256 ld1_bf16(const void *w, size_t k, int q) {
    __m256i p = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + k + 16 * (q & 1)));
    return _mm256_castsi256_ps(q < 2 ? _mm256_slli_epi32(p, 16)
                                     : _mm256_and_si256(p, _mm256_set1_epi32((int)0xFFFF0000u)));
}

/* DENSE_DOT at NTW = 6 tokens, for prompts and verification batches: the same sums in the same
 * order, computed in two passes.  A (row, token)'s chain a sums the products of v[0] and v[2]
 * (then the 8-column tail), chain b those of v[1] and v[3]; the chains never meet before the
 * final hsum(a + b), so each can run over the whole row on its own.  A pass then holds one
 * chain of 2 rows x 6 tokens, 12 accumulators, beside the row pair's weight vectors and one
 * x vector (GCC 12's bf16 loop still keeps two accumulators and the widening mask on the
 * stack): 24 multiply-adds per 14 vector loads, where DENSE_DOT at 4 tokens does 16 per 12
 * with 16 accumulators, more of them spilled.  Figures: docs/performance.md, bf16 prompt. */
#define NTW 6
#define WIDE_DOT(NAME, LD1, LD, SC)                                                             \
    AI void NAME##_pass(const void *w0, const void *w1, const float *x, size_t xs, uint32_t n,  \
                        int h, __m256 *c0, __m256 *c1) {                                        \
        __m256 a0[NTW], a1[NTW];                                                                \
        _Pragma("GCC unroll 8") for (int t = 0; t < NTW; t++)                                   \
            a0[t] = a1[t] = _mm256_setzero_ps();                                                \
        uint32_t k = 0;                                                                         \
        for (; k + 32 <= n; k += 32) {                                                          \
            _Pragma("GCC unroll 2") for (int q = h; q < 4; q += 2) {                            \
                __m256 v0 = LD1(w0, k, q), v1 = LD1(w1, k, q);                                  \
                _Pragma("GCC unroll 8") for (int t = 0; t < NTW; t++) {                         \
                    __m256 xv = _mm256_loadu_ps(x + t * xs + k + 8 * q);                        \
                    a0[t] = _mm256_fmadd_ps(v0, xv, a0[t]);                                     \
                    a1[t] = _mm256_fmadd_ps(v1, xv, a1[t]);                                     \
                }                                                                               \
            }                                                                                   \
        }                                                                                       \
        DOT_TAIL8(LD, NTW, h == 0 &&)                                                           \
        for (int t = 0; t < NTW; t++) {                                                         \
            c0[t] = a0[t];                                                                      \
            c1[t] = a1[t];                                                                      \
        }                                                                                       \
    }                                                                                           \
    static void NAME(const void *w0, const void *w1, const float *x, size_t xs, uint32_t n,     \
                     float *r0, float *r1) {                                                    \
        __m256 a0[NTW], a1[NTW], b0[NTW], b1[NTW];                                              \
        NAME##_pass(w0, w1, x, xs, n, 0, a0, a1);                                               \
        NAME##_pass(w0, w1, x, xs, n, 1, b0, b1);                                               \
        const uint32_t k = n / 32 * 32 + (n % 32) / 8 * 8; /* the scalar tail's first column */ \
        DOT_FINISH(SC, NTW)                                                                     \
    }

WIDE_DOT(wide_f32, ld1_f32, ld_f32, sc_f32)
WIDE_DOT(wide_bf16, ld1_bf16, ld_bf16, sc_bf16)
WIDE_DOT(wide_i8, ld1_i8, ld_i8, sc_i8)

AI void dot_i4(const uint8_t *w0, const uint8_t *w1, const float *s0, const float *s1,
               const float *x, size_t xs, uint32_t n, uint32_t group, const int NT, float *r0,
               float *r1) {
    const __m256i m15 = _mm256_set1_epi32(15), e8 = _mm256_set1_epi32(8);
    __m256 a0[NTMAX], a1[NTMAX];
    _Pragma("GCC unroll 8")
    for (int t = 0; t < NT; t++) a0[t] = a1[t] = _mm256_setzero_ps();
    uint32_t ng = n / group;
    for (uint32_t g = 0; g < ng; g++) {
        __m256 sv0 = _mm256_set1_ps(s0[g]), sv1 = _mm256_set1_ps(s1[g]);
        for (uint32_t b = g * group; b < (g + 1) * group; b += 32) {
            for (uint32_t hh = 0; hh < 16; hh += 8) {
                const __m128i *p0 = (const __m128i *)(w0 + b / 2 + hh);
                const __m128i *p1 = (const __m128i *)(w1 + b / 2 + hh);
                __m256i l0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p0));
                __m256i l1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p1));
                __m256 w0l = _mm256_mul_ps(
                    sv0, _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(l0, m15), e8)));
                __m256 w0h = _mm256_mul_ps(
                    sv0, _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(l0, 4), e8)));
                __m256 w1l = _mm256_mul_ps(
                    sv1, _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_and_si256(l1, m15), e8)));
                __m256 w1h = _mm256_mul_ps(
                    sv1, _mm256_cvtepi32_ps(_mm256_sub_epi32(_mm256_srli_epi32(l1, 4), e8)));
                _Pragma("GCC unroll 8")
                for (int t = 0; t < NT; t++) {
                    __m256 xl = _mm256_loadu_ps(x + t * xs + b + hh);
                    __m256 xh = _mm256_loadu_ps(x + t * xs + b + 16 + hh);
                    a0[t] = _mm256_fmadd_ps(w0h, xh, _mm256_fmadd_ps(w0l, xl, a0[t]));
                    a1[t] = _mm256_fmadd_ps(w1h, xh, _mm256_fmadd_ps(w1l, xl, a1[t]));
                }
            }
        }
    }
    _Pragma("GCC unroll 8")
    for (int t = 0; t < NT; t++) {
        r0[t] = hsum(a0[t]);
        r1[t] = hsum(a1[t]);
    }
}

/* The tokens of the next pass from `left` still to do: tiles of NTW where the dtype has
 * WIDE_DOT and NTW tokens are left, else up to NTMAX. */
static uint32_t tile_tokens(const smoe_ffn_desc *d, uint32_t left) {
    if (d->dtype != SMOE_WDT_I4 && left >= NTW) return NTW;
    return left < NTMAX ? left : NTMAX;
}

/* Row r of the f32/bf16/int8 matrix at offset off (n columns) of the job's block. */
static inline const void *dense_row(const smoe_ffn_job *j, uint64_t off, uint32_t r,
                                    uint32_t n) {
    const int32_t dt = j->d->dtype;
    size_t esz = dt == SMOE_WDT_F32 ? 4 : dt == SMOE_WDT_BF16 ? 2 : 1;
    return j->block + off + (size_t)r * n * esz;
}

/* int8: nt results of rows ra and rb times their rows' scales. */
static inline void scale_i8(const smoe_ffn_job *j, uint64_t sofa, uint32_t ra, uint64_t sofb,
                            uint32_t rb, uint32_t nt, float *r0, float *r1) {
    float sa = ((const float *)(j->block + sofa))[ra];
    float sb = ((const float *)(j->block + sofb))[rb];
    for (uint32_t t = 0; t < nt; t++) {
        r0[t] *= sa;
        r1[t] *= sb;
    }
}

/* Rows (ra of matrix A, rb of matrix B) against nt <= NTMAX tokens of x (n columns, row
 * stride xs).  Tiles of NTW go to rows2_wide, kept apart so that this one-token code is
 * compiled as it was before WIDE_DOT. */
static void rows2(const smoe_ffn_job *j, uint64_t offa, uint64_t sofa, uint32_t ra,
                  uint64_t offb, uint64_t sofb, uint32_t rb, uint32_t n, const float *x,
                  size_t xs, uint32_t nt, float *r0, float *r1) {
    const smoe_ffn_desc *d = j->d;
    if (d->dtype == SMOE_WDT_I4) {
        uint32_t ng = n / j->group, g = j->group;
        const uint8_t *w0 = j->block + offa + (size_t)ra * (n / 2);
        const uint8_t *w1 = j->block + offb + (size_t)rb * (n / 2);
        const float *s0 = (const float *)(j->block + sofa) + (size_t)ra * ng;
        const float *s1 = (const float *)(j->block + sofb) + (size_t)rb * ng;
        switch (nt) {
        case 1: dot_i4(w0, w1, s0, s1, x, xs, n, g, 1, r0, r1); break;
        case 2: dot_i4(w0, w1, s0, s1, x, xs, n, g, 2, r0, r1); break;
        case 3: dot_i4(w0, w1, s0, s1, x, xs, n, g, 3, r0, r1); break;
        default: dot_i4(w0, w1, s0, s1, x, xs, n, g, 4, r0, r1); break;
        }
        return;
    }
    const void *w0 = dense_row(j, offa, ra, n), *w1 = dense_row(j, offb, rb, n);
#define DISPATCH_NT(FN)                                                                         \
    switch (nt) {                                                                               \
    case 1: FN(w0, w1, x, xs, n, 1, r0, r1); break;                                             \
    case 2: FN(w0, w1, x, xs, n, 2, r0, r1); break;                                             \
    case 3: FN(w0, w1, x, xs, n, 3, r0, r1); break;                                             \
    default: FN(w0, w1, x, xs, n, 4, r0, r1); break;                                            \
    }
    if (d->dtype == SMOE_WDT_F32) {
        DISPATCH_NT(dot_f32)
    } else if (d->dtype == SMOE_WDT_BF16) {
        DISPATCH_NT(dot_bf16)
    } else {
        DISPATCH_NT(dot_i8)
        scale_i8(j, sofa, ra, sofb, rb, nt, r0, r1);
    }
#undef DISPATCH_NT
}

/* rows2 at nt == NTW for f32/bf16/int8 (tile_tokens never gives int4 NTW tokens). */
static void rows2_wide(const smoe_ffn_job *j, uint64_t offa, uint64_t sofa, uint32_t ra,
                       uint64_t offb, uint64_t sofb, uint32_t rb, uint32_t n, const float *x,
                       size_t xs, float *r0, float *r1) {
    const smoe_ffn_desc *d = j->d;
    const void *w0 = dense_row(j, offa, ra, n), *w1 = dense_row(j, offb, rb, n);
    if (d->dtype == SMOE_WDT_F32) {
        wide_f32(w0, w1, x, xs, n, r0, r1);
    } else if (d->dtype == SMOE_WDT_BF16) {
        wide_bf16(w0, w1, x, xs, n, r0, r1);
    } else {
        wide_i8(w0, w1, x, xs, n, r0, r1);
        scale_i8(j, sofa, ra, sofb, rb, NTW, r0, r1);
    }
}

static void avx2_gateup(const smoe_ffn_job *j, uint32_t i0, uint32_t i1) {
    const smoe_ffn_desc *d = j->d;
    float g[NTW], u[NTW];
    for (uint32_t i = i0; i < i1; i++)
        for (uint32_t t0 = 0, nt; t0 < j->T; t0 += nt) {
            nt = tile_tokens(d, j->T - t0);
            const float *x = j->xs + (size_t)t0 * d->H;
            if (nt == NTW)
                rows2_wide(j, d->gate, d->gate_scale, i, d->up, d->up_scale, i, d->H, x, d->H,
                           g, u);
            else
                rows2(j, d->gate, d->gate_scale, i, d->up, d->up_scale, i, d->H, x, d->H, nt,
                      g, u);
            for (uint32_t t = 0; t < nt; t++) smoe_ffn_store_act(j, i, t0 + t, g[t], u[t]);
        }
}

/* Down rows (and linear layers) in pairs (h, h + half) of the chunk [h0, h1): each of the two
 * rows read at once walks its own half of the chunk in memory order, two sequential streams.
 * Adjacent pairs (h, h + 1) step each pointer over every other row, which the hardware
 * prefetcher serves badly: on an AMD EPYC Zen 4 (forced to this path, 1 thread, bf16
 * 2048 x 1024) 10 GB/s against 24-26 GB/s for the halves (a C micro-benchmark of this loop;
 * software prefetch did not help the adjacent pairs). */
static void avx2_down(const smoe_ffn_job *j, uint32_t h0, uint32_t h1) {
    const smoe_ffn_desc *d = j->d;
    float y0[NTW], y1[NTW];
    const uint32_t half = (h1 - h0 + 1) / 2;
    for (uint32_t h = h0; h < h0 + half; h++) {
        uint32_t hb = h + half < h1 ? h + half : h; /* an odd chunk's middle row: alone */
        for (uint32_t t0 = 0, nt; t0 < j->T; t0 += nt) {
            nt = tile_tokens(d, j->T - t0);
            const float *a = j->act + (size_t)t0 * d->I;
            if (nt == NTW)
                rows2_wide(j, d->down, d->down_scale, h, d->down, d->down_scale, hb, d->I, a,
                           d->I, y0, y1);
            else
                rows2(j, d->down, d->down_scale, h, d->down, d->down_scale, hb, d->I, a, d->I,
                      nt, y0, y1);
            for (uint32_t t = 0; t < nt; t++) {
                smoe_ffn_store_out(j, h, t0 + t, y0[t]);
                if (hb != h) smoe_ffn_store_out(j, hb, t0 + t, y1[t]);
            }
        }
    }
}

static uint64_t avx2_read_sum(const uint8_t *p, size_t n) {
    __m256i s0 = _mm256_setzero_si256(), s1 = s0, s2 = s0, s3 = s0;
    size_t i = 0;
    for (; i + 128 <= n; i += 128) {
        s0 = _mm256_add_epi64(s0, _mm256_loadu_si256((const __m256i *)(p + i)));
        s1 = _mm256_add_epi64(s1, _mm256_loadu_si256((const __m256i *)(p + i + 32)));
        s2 = _mm256_add_epi64(s2, _mm256_loadu_si256((const __m256i *)(p + i + 64)));
        s3 = _mm256_add_epi64(s3, _mm256_loadu_si256((const __m256i *)(p + i + 96)));
    }
    __m256i s = _mm256_add_epi64(_mm256_add_epi64(s0, s1), _mm256_add_epi64(s2, s3));
    uint64_t lanes[4];
    _mm256_storeu_si256((__m256i *)lanes, s);
    uint64_t r = lanes[0] + lanes[1] + lanes[2] + lanes[3];
    for (; i < n; i++) r += p[i];
    return r;
}

const smoe_ffn_impl smoe_ffn_impl_avx2 = {avx2_gateup, avx2_down, avx2_read_sum};

#else
#include "kimpl.h"
const smoe_ffn_impl smoe_ffn_impl_avx2 = {0, 0, 0};
#endif

/* Fast AVX2 expert FFN / linear paths with quantized activations (desc.precise == 0), for CPUs
 * with AVX2 but not AVX-512 VNNI (desktop Ryzen and Core parts, older servers, laptops) and for
 * a forced SPECMOE_ISA=avx2.  The arithmetic is ffn_fast.c's int8 and int4 arithmetic; only
 * the instructions and the f32 summation order differ:
 *   I8  x / act quantized to int16 per token (scale max|x| / 32767, round to nearest even);
 *       weight bytes sign-extended to int16; vpmaddwd products summed exactly in int32 lanes,
 *       flushed to f32 every 4096 columns (a lane then holds at most 512 products
 *       |127 * 32767|: 2.13e9 < 2^31); times the row scale and the token scale.
 *   I4  x / act quantized to int8 per 128 columns (scale max|x_block| / 127), laid out as
 *       ffn_fast.c lays it out (per 32 columns, the even ones, partners of the low nibbles,
 *       then the odd ones); the nibbles u in [0, 15] are vpmaddubsw's unsigned operand, so a
 *       pair of products is at most 2 * 15 * 127 = 3810 and the four pairs of one int32 lane
 *       of a 128-column block sum to at most 15240 in int16 (no saturation); vpmaddwd with
 *       ones widens them to int32.  Per block (groups of 64: per 64 columns) the exact integer
 *       sum is converted and multiplied by w_group_scale * x_block_scale, and the -8 offset is
 *       removed with each group's sum of the quantized activations (qg below).
 * This is llama.cpp's Q4_0 x Q8_0 scheme (maddubs/madd on 8-bit activations) with one scale
 * per 128 columns instead of per 32.  The bounds of ffn_fast.c hold (the same quantization);
 * the tests compare these paths with a numpy model of this arithmetic
 * (tests/test_lowbit_kernels.py).
 * The activation between the phases uses exp8, a polynomial exp (~1e-7 relative, as
 * ffn_fast.c's exp16).
 *
 * Scratch (ffn.c): the prepared input q [T, n] (int16 or int8), qs [T, n/128 rounded up] the
 * per-token (I8: [T]) or per-block scales, qg [T, n/group] (I4) each weight group's sum over
 * its 128-column blocks (or its one 64-column half block) of the block scale times the sum of
 * the block's int8 values in the group. */
#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>
#include <math.h>
#include <string.h>

#include "kimpl.h"

#define AI static inline __attribute__((always_inline))
#define NTMAX 4

/* ---- activation preparation ---- */

/* max |x[k]| over n (a multiple of 8) floats; NaN if any x[k] is NaN, so that the scale made
 * from it and every output of the token or block is NaN, as in the f32 math. */
AI float absmax8(const float *x, uint32_t n) {
    const __m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    __m256 m = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
    for (uint32_t k = 0; k < n; k += 8) {
        __m256 v = _mm256_loadu_ps(x + k);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
        m = _mm256_max_ps(m, _mm256_and_ps(v, abs));
    }
    if (_mm256_movemask_ps(nan)) return __builtin_nanf("");
    __m128 s = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
    s = _mm_max_ps(s, _mm_movehl_ps(s, s));
    s = _mm_max_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

/* clamp(rint(x[0..8) * inv), -lim, lim) as int32 lanes (a NaN lane gives -lim, as ffn_fast.c's
 * quant16: the conversion's INT_MIN, clamped) */
AI __m256i quant8(const float *x, __m256 inv, int32_t lim) {
    __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x), inv));
    return _mm256_max_epi32(_mm256_min_epi32(v, _mm256_set1_epi32(lim)), _mm256_set1_epi32(-lim));
}

/* The sum of the 8 int32 lanes of v. */
AI int32_t hsum_epi32(__m256i v) {
    __m128i s4 = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0x4E));
    s4 = _mm_add_epi32(s4, _mm_shuffle_epi32(s4, 0xB1));
    return _mm_cvtsi128_si32(s4);
}

static void prepare_avx2(int32_t dtype, uint32_t group, const float *src, size_t src_stride,
                         const int32_t *rows, uint32_t T, uint32_t n, void *q, float *qs,
                         float *qg) {
    for (uint32_t t = 0; t < T; t++) {
        size_t r = rows ? (size_t)rows[t] : t;
        const float *x = src + r * src_stride;
        if (dtype == SMOE_WDT_I8) { /* o[k] = clamp(rint(x[k] / s), +-32767), s = max|x| / 32767 */
            float m = absmax8(x, n);
            float s = !(m <= 0.0f) ? m / 32767.0f : 1.0f; /* NaN stays NaN */
            __m256 inv = _mm256_set1_ps(1.0f / s);
            int16_t *o = (int16_t *)q + (size_t)t * n;
            for (uint32_t k = 0; k < n; k += 16) {
                /* packs interleaves 128-bit lanes: a0[0..4] a1[0..4] a0[4..8] a1[4..8] */
                __m256i p = _mm256_packs_epi32(quant8(x + k, inv, 32767),
                                               quant8(x + k + 8, inv, 32767));
                _mm256_storeu_si256((__m256i *)(void *)(o + k),
                                    _mm256_permute4x64_epi64(p, 0xD8));
            }
            qs[t] = s;
            continue;
        }
        /* I4: per 128 columns (a trailing 64 when n % 128 == 64), s = max|x_block| / 127,
         * v = clamp(rint(x / s), +-127); within each 32-column group g the even columns go to
         * o[16g..16g+16) and the odd ones to o[len/2+16g..) (len: the block's columns);
         * qg[t][g] += s * (sum of v over the block's columns in weight group g) */
        const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
        const __m256i split = _mm256_setr_epi8(
            0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15,
            0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15);
        const uint32_t nb = (n + 127) / 128, ng = n / group;
        int8_t *o = (int8_t *)q + (size_t)t * n;
        float *g_t = qg + (size_t)t * ng;
        for (uint32_t g = 0; g < ng; g++) g_t[g] = 0.0f;
        for (uint32_t b = 0; b < nb; b++) {
            const float *xb = x + (size_t)b * 128;
            const uint32_t len = n - b * 128 < 128 ? n - b * 128 : 128;
            float m = absmax8(xb, len);
            float s = !(m <= 0.0f) ? m / 127.0f : 1.0f; /* NaN stays NaN */
            __m256 inv = _mm256_set1_ps(1.0f / s);
            int8_t *ob = o + (size_t)b * 128;
            for (uint32_t h = 0; h < len / 64; h++) {
                __m256i sum = _mm256_setzero_si256();
                for (uint32_t g = 2 * h; g < 2 * h + 2; g++) {
                    __m256i v[4];
                    for (int i = 0; i < 4; i++) v[i] = quant8(xb + 32 * g + 8 * i, inv, 127);
                    __m256i sg = _mm256_add_epi32(_mm256_add_epi32(v[0], v[1]),
                                                  _mm256_add_epi32(v[2], v[3]));
                    if (group == 32) /* a weight group per 32 columns: its own sum */
                        g_t[(b * 128 + 32 * g) / 32] += s * (float)hsum_epi32(sg);
                    else
                        sum = _mm256_add_epi32(sum, sg);
                    /* bytes: v0[0..4] v1[0..4] v2[0..4] v3[0..4] v0[4..8] v1[4..8] ... in 4-byte
                     * groups; `order` puts the 32 columns in their natural order, `split` the
                     * even ones of each 16 first, and the 64-bit permute the 16 even columns
                     * into the low half, the 16 odd ones into the high half */
                    __m256i p = _mm256_packs_epi16(_mm256_packs_epi32(v[0], v[1]),
                                                   _mm256_packs_epi32(v[2], v[3]));
                    p = _mm256_shuffle_epi8(_mm256_permutevar8x32_epi32(p, order), split);
                    p = _mm256_permute4x64_epi64(p, 0xD8);
                    _mm_storeu_si128((__m128i *)(void *)(ob + 16 * g), _mm256_castsi256_si128(p));
                    _mm_storeu_si128((__m128i *)(void *)(ob + len / 2 + 16 * g),
                                     _mm256_extracti128_si256(p, 1));
                }
                if (group != 32) g_t[(b * 128 + h * 64) / group] += s * (float)hsum_epi32(sum);
            }
            qs[(size_t)t * nb + b] = s;
        }
    }
}

/* ---- the activation between the phases ---- */

/* e^x on 8 lanes: n = rint(x log2 e), r = x - n ln 2 (two-part ln 2), degree-6 Taylor
 * polynomial of e^r on |r| <= ln2/2 (truncation < 1.3e-7 relative), times 2^n built in the
 * exponent bits; x is clamped to [-87, 88] so that 2^n is a normal float (e^-87 ~ 1.6e-38
 * where the f32 math would go on into denormals: an absolute difference below 2e-38). */
AI __m256 exp8(__m256 x) {
    x = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(-87.0f)), _mm256_set1_ps(88.0f));
    __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145752f), x);
    r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.42860677e-6f), r);
    __m256 p = _mm256_set1_ps(1.0f / 720.0f);
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 120.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 24.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f / 6.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
    __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)),
                                  23);
    return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

/* kernels.h's activation (smoe_ffn_activate's formula, exp8 for expf) on the m <= 16 rows i0..
 * of one token: g, u the gate/up dot products, biases added here; result to dst. */
static void act16(const smoe_ffn_desc *d, const float *gb, const float *ub, uint32_t i0,
                  uint32_t m, const float *g, const float *u, float *dst) {
    float G[16], U[16], A[16];
    for (uint32_t i = 0; i < 16; i++) {
        G[i] = i < m ? g[i] + (gb ? gb[i0 + i] : 0.0f) : 0.0f;
        U[i] = i < m ? u[i] + (ub ? ub[i0 + i] : 0.0f) : 0.0f;
    }
    const __m256 one = _mm256_set1_ps(1.0f);
    for (uint32_t k = 0; k < 16; k += 8) {
        __m256 vg = _mm256_loadu_ps(G + k), vu = _mm256_loadu_ps(U + k), a;
        if (d->act == SMOE_ACT_GPTOSS) {
            __m256 lim = _mm256_set1_ps(d->limit);
            vg = _mm256_min_ps(vg, lim);
            vu = _mm256_max_ps(_mm256_min_ps(vu, lim), _mm256_sub_ps(_mm256_setzero_ps(), lim));
            __m256 e = exp8(_mm256_mul_ps(_mm256_set1_ps(-d->alpha), vg));
            a = _mm256_mul_ps(_mm256_add_ps(vu, one), _mm256_div_ps(vg, _mm256_add_ps(one, e)));
        } else {
            __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), vg));
            a = _mm256_mul_ps(_mm256_div_ps(vg, _mm256_add_ps(one, e)), vu);
        }
        _mm256_storeu_ps(A + k, a);
    }
    memcpy(dst, A, (size_t)m * 4);
}

/* ((v0 + v1) + (v2 + v3)) + ((v4 + v5) + (v6 + v7)): one summation tree for every row of this
 * file, hsum8x8's, so that a one-token row (summed 8 rows at once) is bit for bit its row of a
 * two-token call */
AI float hsum8(__m256 v) {
    __m256 h = _mm256_hadd_ps(v, v);
    h = _mm256_hadd_ps(h, h);
    return _mm_cvtss_f32(_mm_add_ss(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
}

/* hsum8 of 8 vectors at once: lane i of the result is hsum8(v[i]), the same additions. */
AI __m256 hsum8x8(const __m256 *v) {
    __m256 a = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
    __m256 b = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
    /* a: per 128-bit half, the half sums of v0..v3; b likewise of v4..v7 */
    return _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
}

/* lanes [0, m) all ones, as a maskload mask */
AI __m256i lanes_below(uint32_t m) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32((int)m), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

/* a . b over n floats */
AI float dotf(const float *a, const float *b, uint32_t n) {
    __m256 s = _mm256_setzero_ps();
    uint32_t k = 0;
    for (; k + 8 <= n; k += 8)
        s = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), s);
    float r = hsum8(s);
    for (; k < n; k++) r += a[k] * b[k];
    return r;
}

/* ---- dot products: NR weight rows x NT tokens ---- */

/* int8: acc[q][t] = the lanes of w_q . x_t (exact integer products and sums per 4096 columns,
 * f32 across), x int16 [NT][n], n a multiple of 32.  The caller sums the lanes and applies
 * the scales. */
AI void dot_i8(const int8_t *const *w, const int NR, const int16_t *x, uint32_t n, const int NT,
               __m256 (*acc)[NTMAX]) {
    __m256 f[4][NTMAX];
    for (int q = 0; q < NR; q++)
        for (int t = 0; t < NT; t++) f[q][t] = _mm256_setzero_ps();
    for (uint32_t k0 = 0; k0 < n; k0 += 4096) {
        const uint32_t k1 = n - k0 < 4096 ? n : k0 + 4096;
        __m256i a[4][NTMAX];
        for (int q = 0; q < NR; q++)
            for (int t = 0; t < NT; t++) a[q][t] = _mm256_setzero_si256();
        for (uint32_t k = k0; k < k1; k += 32) {
            for (int q = 0; q < NR; q++) {
                __m256i w0 = _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w[q] + k)));
                __m256i w1 =
                    _mm256_cvtepi8_epi16(_mm_loadu_si128((const __m128i *)(w[q] + k + 16)));
                for (int t = 0; t < NT; t++) {
                    const int16_t *xt = x + (size_t)t * n + k;
                    __m256i p0 = _mm256_madd_epi16(w0, _mm256_loadu_si256((const __m256i *)xt));
                    __m256i p1 =
                        _mm256_madd_epi16(w1, _mm256_loadu_si256((const __m256i *)(xt + 16)));
                    a[q][t] = _mm256_add_epi32(a[q][t], _mm256_add_epi32(p0, p1));
                }
            }
        }
        for (int q = 0; q < NR; q++)
            for (int t = 0; t < NT; t++)
                f[q][t] = _mm256_add_ps(f[q][t], _mm256_cvtepi32_ps(a[q][t]));
    }
    for (int q = 0; q < NR; q++)
        for (int t = 0; t < NT; t++) acc[q][t] = f[q][t];
}

/* The int16 products of one 64-column chunk of packed nibbles (32 bytes: columns 2j, 2j+1 in
 * byte j; lo, hi its low and high nibbles, I4_NIBBLES) with its activations: lo's partners at
 * xl, hi's at xh (see prepare_avx2). */
AI __m256i i4_chunk(__m256i lo, __m256i hi, const int8_t *xl, const int8_t *xh) {
    return _mm256_add_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i *)xl)),
                            _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i *)xh)));
}

/* One 64-column chunk (32 bytes at wc) of every row: low and high nibbles. */
#define I4_NIBBLES(wc, LO, HI)                                                                 \
    do {                                                                                       \
        __m256i v_ = _mm256_loadu_si256((const __m256i *)(const void *)(wc));                 \
        LO = _mm256_and_si256(v_, m4);                                                         \
        HI = _mm256_and_si256(_mm256_srli_epi16(v_, 4), m4);                                   \
    } while (0)

/* Full 128-column block b (index bi of the current 8) of every row into accumulators F:
 * both chunks' int16 products summed (<= 15240), widened once, one scale S[q][t][bi]. */
#define I4_BLOCK(b, bi, F)                                                                     \
    for (int q = 0; q < NR; q++) {                                                             \
        __m256i l0, h0, l1, h1;                                                                \
        I4_NIBBLES(w[q] + (size_t)(b) * 64, l0, h0);                                           \
        I4_NIBBLES(w[q] + (size_t)(b) * 64 + 32, l1, h1);                                      \
        for (int t = 0; t < NT; t++) {                                                         \
            const int8_t *xb = x + (size_t)t * n + (size_t)(b) * 128;                          \
            __m256i p = _mm256_add_epi16(i4_chunk(l0, h0, xb, xb + 64),                        \
                                         i4_chunk(l1, h1, xb + 32, xb + 96));                  \
            F[q][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones)),          \
                                      _mm256_broadcast_ss(&S[q][t][bi]), F[q][t]);             \
        }                                                                                      \
    }

/* Four full 128-column blocks b .. b + 3 (indices bi .. bi + 3 of the current 8) of every row
 * into F: each two blocks' int16 products (I4_BLOCK's p, <= 15240 a lane) folded by vphaddw
 * (<= 30480 < 2^15, exact) and widened by one vpmaddwd, the two halves folded by vphaddd to one
 * int32 lane a block, [b b+1 b+2 b+3] in both 128-bit lanes, then one conversion and one fma
 * with the four scales S[q][t][bi ..] in both.  The same exact integer sum a block as
 * I4_BLOCK; per four blocks two vpmaddwd, three conversions, fmas and broadcasts fewer.  (A
 * 256-bit multiply is two micro-ops on Zen 1's one integer-multiply pipe.) */
#define I4_BLOCK4(b, bi, F)                                                                    \
    for (int q = 0; q < NR; q++) {                                                             \
        __m256i a_[NTMAX];                                                                     \
        for (int h_ = 0; h_ < 2; h_++) {                                                       \
            __m256i l0, h0, l1, h1, l2, h2, l3, h3;                                            \
            const uint8_t *wb_ = w[q] + (size_t)((b) + 2 * h_) * 64;                           \
            I4_NIBBLES(wb_, l0, h0);                                                           \
            I4_NIBBLES(wb_ + 32, l1, h1);                                                      \
            I4_NIBBLES(wb_ + 64, l2, h2);                                                      \
            I4_NIBBLES(wb_ + 96, l3, h3);                                                      \
            for (int t = 0; t < NT; t++) {                                                     \
                const int8_t *xb = x + (size_t)t * n + (size_t)((b) + 2 * h_) * 128;           \
                __m256i p0 = _mm256_add_epi16(i4_chunk(l0, h0, xb, xb + 64),                   \
                                              i4_chunk(l1, h1, xb + 32, xb + 96));             \
                __m256i p1 = _mm256_add_epi16(i4_chunk(l2, h2, xb + 128, xb + 192),            \
                                              i4_chunk(l3, h3, xb + 160, xb + 224));           \
                __m256i s_ = _mm256_madd_epi16(_mm256_hadd_epi16(p0, p1), ones);               \
                a_[t] = h_ ? _mm256_hadd_epi32(a_[t], s_) : s_;                                \
            }                                                                                  \
        }                                                                                      \
        for (int t = 0; t < NT; t++)                                                           \
            F[q][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(a_[t]),                               \
                                      _mm256_broadcast_ps((const __m128 *)&S[q][t][bi]),       \
                                      F[q][t]);                                                \
    }

/* Four 64-column chunks c .. c + 3 (c a multiple of 4, two full blocks; indices ci .. ci + 3)
 * of every row into F, groups of 64 or 32: each chunk's int16 products (<= 4 * 15 * 127 =
 * 7620 a lane) folded twice by vphaddw (16 products <= 30480 < 2^15, exact), then one
 * vpmaddwd: groups of 64 [c c+1 c+2 c+3] in both 128-bit lanes, groups of 32 (a group a
 * 128-bit half of a chunk) [g g+2 g+4 g+6 | g+1 g+3 g+5 g+7], g = 2c; then one conversion and
 * one fma with SCALE4(q, t, ci), the matching scales (CHUNK4_S64 / CHUNK4_S32).  The same
 * exact integer sum a group as I4_CHUNK / I4_CHUNK32 with one vpmaddwd, conversion and fma
 * for four chunks instead of one. */
#define I4_CHUNK4_WITH(c, ci, F, SCALE4)                                                       \
    if (NT > 1) {                                                                              \
        I4_CHUNK4_HALVES(c, ci, F, SCALE4);                                                    \
    } else                                                                                     \
    for (int q = 0; q < NR; q++) {                                                             \
        __m256i l0, h0, l1, h1, l2, h2, l3, h3;                                                \
        const uint8_t *wc_ = w[q] + (size_t)(c) * 32;                                          \
        I4_NIBBLES(wc_, l0, h0);                                                               \
        I4_NIBBLES(wc_ + 32, l1, h1);                                                          \
        I4_NIBBLES(wc_ + 64, l2, h2);                                                          \
        I4_NIBBLES(wc_ + 96, l3, h3);                                                          \
        for (int t = 0; t < NT; t++) {                                                         \
            const int8_t *xb = x + (size_t)t * n + (size_t)(c) / 2 * 128;                      \
            __m256i s_ = _mm256_madd_epi16(                                                    \
                _mm256_hadd_epi16(_mm256_hadd_epi16(i4_chunk(l0, h0, xb, xb + 64),             \
                                                    i4_chunk(l1, h1, xb + 32, xb + 96)),       \
                                  _mm256_hadd_epi16(i4_chunk(l2, h2, xb + 128, xb + 192),      \
                                                    i4_chunk(l3, h3, xb + 160, xb + 224))),    \
                ones);                                                                         \
            F[q][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s_), SCALE4(q, t, ci), F[q][t]);      \
        }                                                                                      \
    }
/* I4_CHUNK4_WITH's arithmetic for several tokens with half its nibbles live at a time (chunks
 * c, c + 1 first, their first fold kept a token): the same integer sums and the same fma, so
 * a token's bits do not depend on the tokens beside it. */
#define I4_CHUNK4_HALVES(c, ci, F, SCALE4)                                                     \
    for (int q = 0; q < NR; q++) {                                                             \
        __m256i a_[NTMAX], l0, h0, l1, h1;                                                     \
        const uint8_t *wc_ = w[q] + (size_t)(c) * 32;                                          \
        I4_NIBBLES(wc_, l0, h0);                                                               \
        I4_NIBBLES(wc_ + 32, l1, h1);                                                          \
        for (int t = 0; t < NT; t++) {                                                         \
            const int8_t *xb = x + (size_t)t * n + (size_t)(c) / 2 * 128;                      \
            a_[t] = _mm256_hadd_epi16(i4_chunk(l0, h0, xb, xb + 64),                           \
                                      i4_chunk(l1, h1, xb + 32, xb + 96));                     \
        }                                                                                      \
        I4_NIBBLES(wc_ + 64, l0, h0);                                                          \
        I4_NIBBLES(wc_ + 96, l1, h1);                                                          \
        for (int t = 0; t < NT; t++) {                                                         \
            const int8_t *xb = x + (size_t)t * n + (size_t)(c) / 2 * 128 + 128;                \
            __m256i s_ = _mm256_madd_epi16(                                                    \
                _mm256_hadd_epi16(a_[t], _mm256_hadd_epi16(i4_chunk(l0, h0, xb, xb + 64),      \
                                                           i4_chunk(l1, h1, xb + 32, xb + 96))), \
                ones);                                                                         \
            F[q][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(s_), SCALE4(q, t, ci), F[q][t]);      \
        }                                                                                      \
    }
/* groups of 64: chunks ci .. ci + 3's scales in both halves */
#define CHUNK4_S64(q, t, ci) _mm256_broadcast_ps((const __m128 *)&S[q][t][ci])
/* groups of 32: groups 2ci .. 2ci + 7's scales, even ones low, odd ones high (2ci a multiple
 * of 8: an aligned load) */
#define CHUNK4_S32(q, t, ci)                                                                   \
    _mm256_permutevar8x32_ps(_mm256_load_ps(&S[q][t][2 * (ci)]),                               \
                             _mm256_setr_epi32(0, 2, 4, 6, 1, 3, 5, 7))

/* 64-column chunk c (index ci of the current 8) of every row into F: chunk c is half c & 1 of
 * block c / 2, whose odd columns start xo bytes into it (64, or 32 in a trailing half block).
 * SCALE(q, t, ci): the chunk's scales as 8 lanes (CHUNK_S64 / CHUNK_S32 below). */
#define I4_CHUNK_WITH(c, ci, F, SCALE)                                                         \
    for (int q = 0; q < NR; q++) {                                                             \
        __m256i lo, hi;                                                                        \
        I4_NIBBLES(w[q] + (size_t)(c) * 32, lo, hi);                                           \
        const uint32_t xo = (c) / 2 * 128 + 128 <= n ? 64 : 32;                                \
        for (int t = 0; t < NT; t++) {                                                         \
            const int8_t *xb = x + (size_t)t * n + (size_t)(c) / 2 * 128 + 32 * ((c) & 1);     \
            __m256i p = i4_chunk(lo, hi, xb, xb + xo);                                         \
            F[q][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones)),          \
                                      SCALE(q, t, ci), F[q][t]);                               \
        }                                                                                      \
    }
/* groups of 64: one scale for the chunk */
#define CHUNK_S64(q, t, ci) _mm256_broadcast_ss(&S[q][t][ci])
/* groups of 32: S[q][t][2ci] for the low 128-bit lane (bytes 0..15 of the chunk: columns
 * 0..31) and S[q][t][2ci + 1] for the high one */
#define CHUNK_S32(q, t, ci)                                                                    \
    _mm256_insertf128_ps(_mm256_castps128_ps256(_mm_broadcast_ss(&S[q][t][2 * (ci)])),         \
                         _mm_broadcast_ss(&S[q][t][2 * (ci) + 1]), 1)
#define I4_CHUNK(c, ci, F) I4_CHUNK_WITH(c, ci, F, CHUNK_S64)
#define I4_CHUNK32(c, ci, F) I4_CHUNK_WITH(c, ci, F, CHUNK_S32)

/* int4: acc[q][t] = the lanes of sum over 64-column chunks c of sw_q[g(c)] * xs_t[c/2] *
 * ((u . xq_t)_c - 8 * sum(xq_t)_c), w_q packed [n/2] bytes, ws_q its group scales, x int8
 * [NT][n] (layout of prepare_avx2), xs [NT][nb] block scales, xg [NT][n/group] the groups'
 * scaled sums of xq.  G: the group form.  0, groups of 128 or more: a scale per 128-column
 * block (I4_BLOCK4 four at a time, I4_BLOCK the rest); 64: a scale per chunk (I4_CHUNK; a
 * trailing half block when n % 128 == 64); 32: two scales per chunk (I4_CHUNK32; llama.cpp's
 * Q4_0 blocks kept as they are); chunks four at a time (I4_CHUNK4_WITH) where they fill two
 * blocks.  Per 8 units (blocks, or chunks) the combined scales S = sw * xs are formed in a small
 * array first, and the groups' -8 offsets, sw * -8 * xg, go into the accumulator's lanes with
 * one fma per 8 groups (groups of 128, 64 and 32; larger groups: one dot product at the end).
 * One accumulator per (row, token) at every token count, so that a token's sums do not depend
 * on the tokens beside it (batch invariance: a verification batch or a serving batch gives
 * one-token decoding's bits).  Two sets when they fit (at most four (row, token) pairs) did not
 * pay: one set read at the same rate at 1, 4 and 8 tokens (Zen 4 forced to AVX2, 1 thread, OLMoE
 * / DeepSeek-V2-Lite / Mixtral shapes, 2 A/B rounds; the fma chain's latency is below a unit's
 * unpacking work here). */
/* Bytes ahead of each row's position that dot_i4 prefetches to L1 (every line of the next 8
 * units): at one token and one thread on AMD EPYC (Zen 3) the int4 kernel read 0.74-0.78 of
 * the read ceiling without it and 0.81-0.92 with it (benchmarks/expert_kernels.py, 4 interleaved
 * builds A/B/A/B, OLMoE and DeepSeek-V2-Lite shapes); at two threads no difference within the
 * host's noise.  The hardware prefetcher alone trails a stream that finishes a row every few
 * hundred bytes (ffn_blocks.c found the same for the K-quants).  On a Zen 2 EPYC (1 thread,
 * 3 alternated rounds) 512, 1024, 2048 and 4096 bytes read alike within the host's noise
 * (kernels_epyc_zen2_int4_prefetch_ab.json).  CFLAGS=-DI4_PF=N builds another distance.
 * I4_PFS: bytes ahead in each row's group scales, one line a step of 8 units.  On a Zen 1 EPYC
 * (1 thread, one token, 4 alternated rounds, OLMoE / DeepSeek-V2-Lite shapes) groups of 32
 * (a quarter more bytes in scales) ran 0.93-0.97 of the time without it, groups of 128
 * 0.98-1.02 (no change): the hardware prefetcher served the scale rows late. */
#ifndef I4_PF
#define I4_PF 1024
#endif
#ifndef I4_PFS
#define I4_PFS 256
#endif
AI void dot_i4(const uint8_t *const *w, const float *const *ws, const int NR, const int8_t *x,
               const float *xs, const float *xg, uint32_t n, uint32_t group, const int G,
               const int NT, __m256 (*acc)[NTMAX]) {
    const __m256i ones = _mm256_set1_epi16(1), m4 = _mm256_set1_epi8(0x0F);
    const __m256 m8 = _mm256_set1_ps(-8.0f);
    const uint32_t nb = (n + 127) / 128, ng = n / group, bpg = group / 128;
    const uint32_t nu = G ? n / 64 : nb; /* units: chunks (G 64, 32) or blocks */
    const int unit_groups = G || bpg == 1; /* the offsets per group, in the lanes */
    __m256 f[4][NTMAX];
    float S[4][NTMAX][16] __attribute__((aligned(32)));
    for (int q = 0; q < NR; q++)
        for (int t = 0; t < NT; t++) f[q][t] = _mm256_setzero_ps();
    for (uint32_t u0 = 0; u0 < nu; u0 += 8) {
        const uint32_t m = nu - u0 < 8 ? nu - u0 : 8;
        const __m256i mk = lanes_below(m);
        {
            const uint32_t ub = G ? 32u : 64u; /* weight bytes of one unit */
            for (int q = 0; q < NR; q++)
                for (uint32_t b = 0; b < 8 * ub; b += 64)
                    _mm_prefetch((const char *)(w[q] + (size_t)u0 * ub + I4_PF + b), _MM_HINT_T0);
            /* the group scales of these units: a stream of their own, 1/16 (groups of 128)
             * to 1/4 (groups of 32) of the weights' bytes */
            const uint32_t s0 = G == 32 ? 2 * u0 : G ? u0 : u0 / bpg;
            for (int q = 0; q < NR; q++)
                _mm_prefetch((const char *)(ws[q] + s0) + I4_PFS, _MM_HINT_T0);
        }
        for (int q = 0; q < NR; q++)
            for (int t = 0; t < NT; t++) {
                const float *xt = xs + (size_t)t * nb, *xgt = xg + (size_t)t * ng;
                if (G == 32) { /* 2m groups; group g's block scale is xs[g / 4] */
                    const __m256 xv4 = _mm256_castps128_ps256(_mm_maskload_ps(
                        xt + u0 / 2, _mm256_castsi256_si128(lanes_below((m + 1) / 2))));
                    for (uint32_t h = 0; h < 2; h++) {
                        const uint32_t gm = 2 * m > 8 * h ? 2 * m - 8 * h : 0;
                        const __m256i gk = lanes_below(gm < 8 ? gm : 8);
                        __m256 sw = _mm256_maskload_ps(ws[q] + 2 * u0 + 8 * h, gk);
                        __m256 xv = _mm256_permutevar8x32_ps(
                            xv4, _mm256_setr_epi32(2 * h, 2 * h, 2 * h, 2 * h, 2 * h + 1,
                                                   2 * h + 1, 2 * h + 1, 2 * h + 1));
                        _mm256_store_ps(S[q][t] + 8 * h, _mm256_mul_ps(sw, xv));
                        f[q][t] = _mm256_fmadd_ps(_mm256_mul_ps(sw, m8),
                                                  _mm256_maskload_ps(xgt + 2 * u0 + 8 * h, gk),
                                                  f[q][t]);
                    }
                } else if (unit_groups) {
                    __m256 sw = _mm256_maskload_ps(ws[q] + u0, mk), xv;
                    if (G) /* chunk c's block scale is xs[c / 2]; u0 is a multiple of 8 */
                        xv = _mm256_permutevar8x32_ps(
                            _mm256_castps128_ps256(_mm_maskload_ps(
                                xt + u0 / 2, _mm256_castsi256_si128(lanes_below((m + 1) / 2)))),
                            _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3));
                    else
                        xv = _mm256_maskload_ps(xt + u0, mk);
                    _mm256_store_ps(S[q][t], _mm256_mul_ps(sw, xv));
                    f[q][t] = _mm256_fmadd_ps(_mm256_mul_ps(sw, m8),
                                              _mm256_maskload_ps(xgt + u0, mk), f[q][t]);
                } else {
                    for (uint32_t i = 0; i < m; i++)
                        S[q][t][i] = ws[q][(u0 + i) / bpg] * xt[u0 + i];
                }
            }
        if (G) { /* four chunks a step while they are two full blocks, then one a step */
            uint32_t i = 0;
            for (; i + 4 <= m && (size_t)(u0 + i + 4) * 64 <= n; i += 4) {
                if (G == 32) {
                    I4_CHUNK4_WITH(u0 + i, i, f, CHUNK4_S32);
                } else {
                    I4_CHUNK4_WITH(u0 + i, i, f, CHUNK4_S64);
                }
            }
            for (; i < m; i++) {
                if (G == 32) {
                    I4_CHUNK32(u0 + i, i, f);
                } else {
                    I4_CHUNK(u0 + i, i, f);
                }
            }
        } else {
            uint32_t i = 0;
            for (; i + 4 <= m; i += 4) I4_BLOCK4(u0 + i, i, f);
            for (; i < m; i++) I4_BLOCK(u0 + i, i, f);
        }
    }
    for (int q = 0; q < NR; q++)
        for (int t = 0; t < NT; t++) {
            __m256 v = f[q][t];
            if (!unit_groups) /* the offset of groups spanning several blocks, in lane 0 */
                v = _mm256_add_ps(v, _mm256_setr_ps(-8.0f * dotf(ws[q], xg + (size_t)t * ng, ng),
                                                    0, 0, 0, 0, 0, 0, 0));
            acc[q][t] = v;
        }
}

/* NR rows (matrix offsets off[q], scale offsets soff[q], row indices row[q]) against NT tokens
 * t0.. of the prepared input (j->q, j->qs, j->qsum), n columns: final dot products. */
AI void rowsV(const smoe_ffn_job *j, const uint64_t *off, const uint64_t *soff,
              const uint32_t *row, const int NR, uint32_t n, uint32_t t0, const int NT,
              __m256 (*acc)[NTMAX]) {
    if (j->d->dtype == SMOE_WDT_I8) {
        const int8_t *w[4];
        for (int q = 0; q < NR; q++)
            w[q] = (const int8_t *)(j->block + off[q]) + (size_t)row[q] * n;
        dot_i8(w, NR, (const int16_t *)j->q + (size_t)t0 * n, n, NT, acc);
        return;
    }
    const uint32_t ng = n / j->group, nb = (n + 127) / 128;
    const uint8_t *w[4];
    const float *ws[4];
    for (int q = 0; q < NR; q++) {
        w[q] = j->block + off[q] + (size_t)row[q] * (n / 2);
        ws[q] = (const float *)(j->block + soff[q]) + (size_t)row[q] * ng;
    }
    const int8_t *x = (const int8_t *)j->q + (size_t)t0 * n;
    const float *xs = j->qs + (size_t)t0 * nb, *xg = j->qsum + (size_t)t0 * ng;
    if (j->group == 64)
        dot_i4(w, ws, NR, x, xs, xg, n, 64, 64, NT, acc);
    else if (j->group == 32)
        dot_i4(w, ws, NR, x, xs, xg, n, 32, 32, NT, acc);
    else
        dot_i4(w, ws, NR, x, xs, xg, n, j->group, 0, NT, acc);
}

/* The int8 scale of row `row` of the matrix whose scales are at soff and of token t (1 for
 * int4, whose scales are inside the dot product). */
AI float i8_scale(const smoe_ffn_job *j, uint64_t soff, uint32_t row, uint32_t t) {
    return j->d->dtype == SMOE_WDT_I8 ? ((const float *)(j->block + soff))[row] * j->qs[t] : 1.0f;
}

AI void rowsN(const smoe_ffn_job *j, const uint64_t *off, const uint64_t *soff,
              const uint32_t *row, const int NR, uint32_t n, uint32_t t0, const int NT,
              float (*r)[NTMAX]) {
    __m256 acc[4][NTMAX];
    rowsV(j, off, soff, row, NR, n, t0, NT, acc);
    for (int q = 0; q < NR; q++)
        for (int t = 0; t < NT; t++)
            r[q][t] = hsum8(acc[q][t]) * i8_scale(j, soff[q], row[q], t0 + (uint32_t)t);
}

/* One token: rows row0 .. row0 + m - 1 (m <= 8) of the matrix at off (scales at soff), n
 * columns, one at a time (one sequential stream), their lanes summed 8 rows at once
 * (hsum8x8) instead of after each row; results (scales applied) to res[0..m). */
static void rows8(const smoe_ffn_job *j, uint64_t off, uint64_t soff, uint32_t row0, uint32_t m,
                  uint32_t n, float *res) {
    __m256 v[8], acc[1][NTMAX];
    float out[8];
    for (uint32_t i = 0; i < m; i++) {
        const uint32_t row[1] = {row0 + i};
        rowsV(j, &off, &soff, row, 1, n, 0, 1, acc);
        v[i] = acc[0][0];
    }
    for (uint32_t i = m; i < 8; i++) v[i] = _mm256_setzero_ps();
    _mm256_storeu_ps(out, hsum8x8(v));
    for (uint32_t i = 0; i < m; i++) res[i] = out[i] * i8_scale(j, soff, row0 + i, 0);
}

/* One token: the (gate_i, up_i) row pairs of rows row0 .. row0 + m - 1 (m <= 8), H columns,
 * each pair's lanes summed 8 rows at once; results to g[0..m), u[0..m). */
static void pairs8(const smoe_ffn_job *j, uint32_t row0, uint32_t m, float *g, float *u) {
    const smoe_ffn_desc *d = j->d;
    const uint64_t off[2] = {d->gate, d->up};
    const uint64_t soff[2] = {d->gate_scale, d->up_scale};
    __m256 vg[8], vu[8], acc[2][NTMAX];
    float og[8], ou[8];
    for (uint32_t i = 0; i < m; i++) {
        const uint32_t row[2] = {row0 + i, row0 + i};
        rowsV(j, off, soff, row, 2, d->H, 0, 1, acc);
        vg[i] = acc[0][0];
        vu[i] = acc[1][0];
    }
    for (uint32_t i = m; i < 8; i++) vg[i] = vu[i] = _mm256_setzero_ps();
    _mm256_storeu_ps(og, hsum8x8(vg));
    _mm256_storeu_ps(ou, hsum8x8(vu));
    for (uint32_t i = 0; i < m; i++) {
        g[i] = og[i] * i8_scale(j, d->gate_scale, row0 + i, 0);
        u[i] = ou[i] * i8_scale(j, d->up_scale, row0 + i, 0);
    }
}

/* Four rows against one token (the long down rows of fast2_down), or a pair of rows against
 * nt <= NTMAX tokens (one token's rows of up to 8192 columns go through rows8 / pairs8). */
static void rows_dispatch(const smoe_ffn_job *j, const uint64_t *off, const uint64_t *soff,
                          const uint32_t *row, int NR, uint32_t n, uint32_t t0, uint32_t nt,
                          float (*r)[NTMAX]) {
    if (NR == 4) {
        rowsN(j, off, soff, row, 4, n, t0, 1, r);
        return;
    }
    switch (nt) {
    case 1: rowsN(j, off, soff, row, 2, n, t0, 1, r); break;
    case 2: rowsN(j, off, soff, row, 2, n, t0, 2, r); break;
    case 3: rowsN(j, off, soff, row, 2, n, t0, 3, r); break;
    default: rowsN(j, off, soff, row, 2, n, t0, 4, r); break;
    }
}

/* Phase 1: gate and up rows in pairs (gate_i, up_i) against tiles of NTMAX tokens (see
 * fast2_down for what one token measured), in chunks of 16 rows so that the activation runs on
 * whole vectors; act is in natural order [T, I]. */
static void fast2_gateup(const smoe_ffn_job *j, uint32_t i0, uint32_t i1) {
    const smoe_ffn_desc *d = j->d;
    const float *gb = (const float *)smoe_ffn_ptr(j, d->gate_bias);
    const float *ub = (const float *)smoe_ffn_ptr(j, d->up_bias);
    const uint64_t off[2] = {d->gate, d->up};
    const uint64_t soff[2] = {d->gate_scale, d->up_scale};
    float r[2][NTMAX];
    float g[NTMAX][16], u[NTMAX][16];
    for (uint32_t c0 = i0; c0 < i1; c0 += 16) {
        uint32_t m = i1 - c0 < 16 ? i1 - c0 : 16;
        for (uint32_t t0 = 0; t0 < j->T; t0 += NTMAX) {
            uint32_t nt = j->T - t0 < NTMAX ? j->T - t0 : NTMAX;
            if (j->T == 1) {
                for (uint32_t i = 0; i < m; i += 8)
                    pairs8(j, c0 + i, m - i < 8 ? m - i : 8, g[0] + i, u[0] + i);
                act16(d, gb, ub, c0, m, g[0], u[0], j->act + c0);
                continue;
            }
            for (uint32_t i = 0; i < m; i++) {
                const uint32_t row[2] = {c0 + i, c0 + i};
                rows_dispatch(j, off, soff, row, 2, d->H, t0, nt, r);
                for (uint32_t t = 0; t < nt; t++) {
                    g[t][i] = r[0][t];
                    u[t][i] = r[1][t];
                }
            }
            for (uint32_t t = 0; t < nt; t++)
                act16(d, gb, ub, c0, m, g[t], u[t], j->act + (size_t)(t0 + t) * d->I + c0);
        }
    }
}

/* Phase 2 (and linear layers).  One token reads rows of up to 8192 columns one at a time (one
 * sequential stream, which the AMD EPYC host's hardware prefetcher serves best), longer ones
 * four at a time; more tokens read rows in pairs against tiles of NTMAX tokens.  Measured
 * (2026-11-28, AMD EPYC, AVX2, 1 thread, DRAM, 5 interleaved rounds, best of 40 per round,
 * against the read loop): one row at a time against fours, int4 2048 x 1024 experts 0.85 ->
 * 0.99, 2048 x 1408 0.46 -> 0.80, int8 0.73 -> 0.97 and 0.78 -> 0.93; Mixtral's 14336-column
 * down rows lost with it (0.95 -> 0.89), so they keep the fours.  Gate/up rows in pairs
 * (gate_i, up_i) beat one row at a time (0.70 / 0.45 against 0.85 / 0.46 with fours for down)
 * and fours (gate_i, up_i, gate_i+1, up_i+1: 0.64-0.83 against 0.90-0.96). */
static void fast2_down(const smoe_ffn_job *j, uint32_t h0, uint32_t h1) {
    const smoe_ffn_desc *d = j->d;
    float r[4][NTMAX];
    const uint64_t off[4] = {d->down, d->down, d->down, d->down};
    const uint64_t soff[4] = {d->down_scale, d->down_scale, d->down_scale, d->down_scale};
    uint32_t h = h0;
    if (j->T == 1 && d->I <= 8192)
        for (; h < h1; h += 8) {
            const uint32_t m = h1 - h < 8 ? h1 - h : 8;
            float y[8];
            rows8(j, d->down, d->down_scale, h, m, d->I, y);
            for (uint32_t i = 0; i < m; i++) smoe_ffn_store_out(j, h + i, 0, y[i]);
        }
    if (j->T == 1 && h < h1) { /* (the loop above may leave h past h1) */
        /* four rows a quarter of the chunk apart: each pointer walks its quarter in memory
         * order (four adjacent rows step each pointer over three; ffn_avx2.c's avx2_down) */
        const uint32_t q4 = (h1 - h) / 4;
        for (uint32_t i = 0; i < q4; i++) {
            const uint32_t row[4] = {h + i, h + q4 + i, h + 2 * q4 + i, h + 3 * q4 + i};
            rows_dispatch(j, off, soff, row, 4, d->I, 0, 1, r);
            for (uint32_t q = 0; q < 4; q++) smoe_ffn_store_out(j, row[q], 0, r[q][0]);
        }
        h += 4 * q4; /* the last 0-3 rows in pairs below */
    }
    for (; h < h1; h += 2) {
        uint32_t hb = h + 1 < h1 ? h + 1 : h;
        const uint32_t row[2] = {h, hb};
        for (uint32_t t0 = 0; t0 < j->T; t0 += NTMAX) {
            uint32_t nt = j->T - t0 < NTMAX ? j->T - t0 : NTMAX;
            rows_dispatch(j, off, soff, row, 2, d->I, t0, nt, r);
            for (uint32_t t = 0; t < nt; t++) {
                smoe_ffn_store_out(j, h, t0 + t, r[0][t]);
                if (hb != h) smoe_ffn_store_out(j, hb, t0 + t, r[1][t]);
            }
        }
    }
}

const smoe_ffn_impl smoe_ffn_impl_fast_avx2 = {fast2_gateup, fast2_down, 0};
const int smoe_ffn_fast_avx2_built = 1;

void smoe_fast_prepare_avx2(int32_t dtype, uint32_t group, const float *src, size_t src_stride,
                            const int32_t *rows, uint32_t T, uint32_t n, void *q, float *qs,
                            float *qg) {
    prepare_avx2(dtype, group, src, src_stride, rows, T, n, q, qs, qg);
}

#else
#include "kimpl.h"
void smoe_fast_prepare_avx2(int32_t dtype, uint32_t group, const float *src, size_t src_stride,
                            const int32_t *rows, uint32_t T, uint32_t n, void *q, float *qs,
                            float *qg) {
    (void)dtype, (void)group, (void)src, (void)src_stride, (void)rows, (void)T, (void)n, (void)q,
        (void)qs, (void)qg;
}
const smoe_ffn_impl smoe_ffn_impl_fast_avx2 = {0, 0, 0};
const int smoe_ffn_fast_avx2_built = 0;
#endif

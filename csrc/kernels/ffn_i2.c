/* Int2 expert weights (SMOE_WDT_I2, layout in kernels.h): the exact path on every ISA.
 *
 * SpecMD's fetch-priority cascade (int8 -> int4 -> int2, SpecMD Sec. 3.1.2) computes the
 * lowest-ranked missing experts from a resident int2 copy.  A group of g columns contributes
 *     sum_c (s u_c + m) x_c = s * sum_c u_c x_c + m * sum_c x_c,
 * so each group keeps two running sums (u . x and the sum of x) and applies its scale and
 * offset once.  The planar packing (byte j of a 64-column block holds columns j, 16+j, 32+j,
 * 48+j) turns one 16-byte load into four vectors of 16 consecutive columns with shifts and a
 * mask on AVX-512 (two 8-byte loads per block on AVX2), against activations in their natural
 * order -- no permuted layout of x as BF16/I4 need.
 *
 * One weight row against every token in turn (the row stays in L1 for the later tokens): int2
 * is 16x fewer bytes than f32, so this path is bound by the widening, not by memory, and the
 * copies it serves are the few low-ranked misses of a layer. */
#include <string.h>

#include "kimpl.h"

typedef float (*i2_dot_fn)(const uint8_t *w, const float *sm, const float *x, uint32_t n,
                           uint32_t g);

/* Row w (n/4 bytes) with its (scale, offset) pairs sm [n/g][2] against x [n]. */
static float dot_scalar(const uint8_t *w, const float *sm, const float *x, uint32_t n,
                        uint32_t g) {
    float acc = 0.0f;
    for (uint32_t gi = 0; gi < n / g; gi++) {
        float du = 0.0f, sx = 0.0f;
        for (uint32_t b = gi * g; b < (gi + 1) * g; b += 64) {
            const uint8_t *wb = w + b / 4;
            const float *xb = x + b;
            for (uint32_t j = 0; j < 16; j++) {
                const unsigned v = wb[j];
                du += (float)(v & 3u) * xb[j] + (float)((v >> 2) & 3u) * xb[16 + j] +
                      (float)((v >> 4) & 3u) * xb[32 + j] + (float)(v >> 6) * xb[48 + j];
                sx += xb[j] + xb[16 + j] + xb[32 + j] + xb[48 + j];
            }
        }
        acc += sm[2 * gi] * du + sm[2 * gi + 1] * sx;
    }
    return acc;
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>

__attribute__((target("avx2,fma"))) static float dot_avx2(const uint8_t *w, const float *sm,
                                                           const float *x, uint32_t n,
                                                           uint32_t g) {
    const __m256i m3 = _mm256_set1_epi32(3);
    __m256 acc = _mm256_setzero_ps();
    for (uint32_t gi = 0; gi < n / g; gi++) {
        __m256 du0 = _mm256_setzero_ps(), du1 = _mm256_setzero_ps();
        __m256 sx0 = _mm256_setzero_ps(), sx1 = _mm256_setzero_ps();
        for (uint32_t b = gi * g; b < (gi + 1) * g; b += 64)
            for (uint32_t h = 0; h < 16; h += 8) { /* bytes h..h+7: columns b+16i+h.. */
                __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(w + b / 4 + h)));
                const float *xb = x + b + h;
                __m256 x0 = _mm256_loadu_ps(xb), x1 = _mm256_loadu_ps(xb + 16);
                __m256 x2 = _mm256_loadu_ps(xb + 32), x3 = _mm256_loadu_ps(xb + 48);
                du0 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, m3)), x0, du0);
                du1 = _mm256_fmadd_ps(
                    _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 2), m3)), x1, du1);
                du0 = _mm256_fmadd_ps(
                    _mm256_cvtepi32_ps(_mm256_and_si256(_mm256_srli_epi32(v, 4), m3)), x2, du0);
                du1 = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 6)), x3, du1);
                sx0 = _mm256_add_ps(sx0, _mm256_add_ps(x0, x1));
                sx1 = _mm256_add_ps(sx1, _mm256_add_ps(x2, x3));
            }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(sm[2 * gi]), _mm256_add_ps(du0, du1), acc);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(sm[2 * gi + 1]), _mm256_add_ps(sx0, sx1), acc);
    }
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

__attribute__((target("avx2,fma,avx512f"))) static float dot_avx512(const uint8_t *w,
                                                                     const float *sm,
                                                                     const float *x, uint32_t n,
                                                                     uint32_t g) {
    const __m512i m3 = _mm512_set1_epi32(3);
    __m512 acc = _mm512_setzero_ps();
    for (uint32_t gi = 0; gi < n / g; gi++) {
        __m512 du0 = _mm512_setzero_ps(), du1 = _mm512_setzero_ps();
        __m512 sx0 = _mm512_setzero_ps(), sx1 = _mm512_setzero_ps();
        for (uint32_t b = gi * g; b < (gi + 1) * g; b += 64) {
            __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + b / 4)));
            const float *xb = x + b;
            __m512 x0 = _mm512_loadu_ps(xb), x1 = _mm512_loadu_ps(xb + 16);
            __m512 x2 = _mm512_loadu_ps(xb + 32), x3 = _mm512_loadu_ps(xb + 48);
            du0 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, m3)), x0, du0);
            du1 = _mm512_fmadd_ps(
                _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, 2), m3)), x1, du1);
            du0 = _mm512_fmadd_ps(
                _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(v, 4), m3)), x2, du0);
            du1 = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 6)), x3, du1);
            sx0 = _mm512_add_ps(sx0, _mm512_add_ps(x0, x1));
            sx1 = _mm512_add_ps(sx1, _mm512_add_ps(x2, x3));
        }
        acc = _mm512_fmadd_ps(_mm512_set1_ps(sm[2 * gi]), _mm512_add_ps(du0, du1), acc);
        acc = _mm512_fmadd_ps(_mm512_set1_ps(sm[2 * gi + 1]), _mm512_add_ps(sx0, sx1), acc);
    }
    return _mm512_reduce_add_ps(acc);
}
#endif

/* Phase 1: act rows [i0, i1) for every token; phase 2: out columns [h0, h1). */
static void gateup_with(const smoe_ffn_job *j, uint32_t i0, uint32_t i1, i2_dot_fn dot) {
    const smoe_ffn_desc *d = j->d;
    const uint32_t H = d->H, g = j->group;
    const size_t rb = H / 4, rs = (size_t)(H / g) * 2;
    const uint8_t *gw = j->block + d->gate, *uw = j->block + d->up;
    const float *gs = (const float *)(j->block + d->gate_scale);
    const float *us = (const float *)(j->block + d->up_scale);
    for (uint32_t i = i0; i < i1; i++)
        for (uint32_t t = 0; t < j->T; t++) {
            const float *x = j->xs + (size_t)t * H;
            smoe_ffn_store_act(j, i, t, dot(gw + i * rb, gs + i * rs, x, H, g),
                               dot(uw + i * rb, us + i * rs, x, H, g));
        }
}

static void down_with(const smoe_ffn_job *j, uint32_t h0, uint32_t h1, i2_dot_fn dot) {
    const smoe_ffn_desc *d = j->d;
    const uint32_t I = d->I, g = j->group;
    const size_t rb = I / 4, rs = (size_t)(I / g) * 2;
    const uint8_t *dw = j->block + d->down;
    const float *ds = (const float *)(j->block + d->down_scale);
    for (uint32_t h = h0; h < h1; h++)
        for (uint32_t t = 0; t < j->T; t++)
            smoe_ffn_store_out(j, h, t,
                               dot(dw + h * rb, ds + h * rs, j->act + (size_t)t * I, I, g));
}

static void gateup_scalar(const smoe_ffn_job *j, uint32_t a, uint32_t b) {
    gateup_with(j, a, b, dot_scalar);
}
static void down_scalar(const smoe_ffn_job *j, uint32_t a, uint32_t b) {
    down_with(j, a, b, dot_scalar);
}
static const smoe_ffn_impl impl_scalar = {gateup_scalar, down_scalar, NULL};

#if defined(__x86_64__) && defined(__GNUC__)
static void gateup_avx2(const smoe_ffn_job *j, uint32_t a, uint32_t b) {
    gateup_with(j, a, b, dot_avx2);
}
static void down_avx2(const smoe_ffn_job *j, uint32_t a, uint32_t b) {
    down_with(j, a, b, dot_avx2);
}
static void gateup_avx512(const smoe_ffn_job *j, uint32_t a, uint32_t b) {
    gateup_with(j, a, b, dot_avx512);
}
static void down_avx512(const smoe_ffn_job *j, uint32_t a, uint32_t b) {
    down_with(j, a, b, dot_avx512);
}
static const smoe_ffn_impl impl_avx2 = {gateup_avx2, down_avx2, NULL};
static const smoe_ffn_impl impl_avx512 = {gateup_avx512, down_avx512, NULL};
#endif

const smoe_ffn_impl *smoe_ffn_impl_i2(int32_t isa) {
#if defined(__x86_64__) && defined(__GNUC__)
    if (isa == SMOE_ISA_AVX512) return &impl_avx512;
    if (isa == SMOE_ISA_AVX2) return &impl_avx2;
#else
    (void)isa;
#endif
    return &impl_scalar;
}

/* AVX-512 (F/BW/VL/DQ) expert FFN path.  The whole file is compiled for that target (GCC
 * target pragma = __attribute__((target)) on every function below) and only reached after
 * runtime detection (pool.c), so the extension itself stays baseline x86-64.
 *
 * Shape of the work: each call computes two weight rows (gate_i and up_i, or down_h and
 * down_h+1) against up to 8 tokens at once, so a weight vector loaded from memory feeds
 * 2..16 FMAs and every weight byte is read from DRAM once per call; with 1-2 tokens the loop
 * is unrolled twice (or lo/hi nibbles kept apart for int4) for enough independent FMA chains.
 * With exactly one token (decode) the down projection takes four contiguous rows per pass
 * instead (dot1_*), which halves the activation loads per weight byte.
 * Weights are widened to f32 in registers (bf16: one 64-byte load, shift -> even columns,
 * mask -> odd columns, against activations stored in the matching even/odd order; int8:
 * sign-extend + convert; int4: nibble -> vpermps lookup in a 16-entry table pre-multiplied by
 * the group scale) and accumulated in f32 against f32 activations.  Software prefetch runs
 * SMOE_PF_DIST bytes ahead in each weight stream (256 measured best among 256..4096 on the
 * development machine, within its noise).
 *
 * Not done (next steps): int8/int4 through AVX512_VNNI (vpdpbusd) and bf16 through
 * AVX512_BF16 (vdpbf16ps) with activations quantized/rounded per block; they cut the
 * widening work 2-3x and matter most at 8+ tokens, but change numerics, so they belong
 * behind an explicit option. */
#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq")
#include <immintrin.h>
#include <string.h>

#include "kimpl.h"

#define AI static inline __attribute__((always_inline))
#define NTMAX 8
#ifndef SMOE_PF_DIST
#define SMOE_PF_DIST 256 /* bytes ahead in each weight stream; see the file comment */
#endif
#define PF(p) _mm_prefetch((const char *)(p) + SMOE_PF_DIST, _MM_HINT_T0)

AI __m512 ld_f32(const void *w, size_t k) { return _mm512_loadu_ps((const float *)w + k); }
AI __m512 ld_bf16(const void *w, size_t k) {
    __m256i v = _mm256_loadu_si256((const __m256i *)((const uint16_t *)w + k));
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
AI __m512 ld_i8(const void *w, size_t k) {
    __m128i v = _mm_loadu_si128((const __m128i *)((const int8_t *)w + k));
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v));
}
AI __m512 ldm_f32(const void *w, size_t k, __mmask16 m) {
    return _mm512_maskz_loadu_ps(m, (const float *)w + k);
}
AI __m512 ldm_bf16(const void *w, size_t k, __mmask16 m) {
    __m256i v = _mm256_maskz_loadu_epi16(m, (const uint16_t *)w + k);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(v), 16));
}
AI __m512 ldm_i8(const void *w, size_t k, __mmask16 m) {
    __m128i v = _mm_maskz_loadu_epi8(m, (const int8_t *)w + k);
    return _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(v));
}

/* Weights for the 32 columns at k in x's layout: lo <-> x[k..k+15], hi <-> x[k+16..k+31].
 * BF16 uses the even/odd layout (smoe_perm_pos): one 64-byte load, a shift gives the even
 * columns as f32, a mask the odd ones. */
AI void ld2_f32(const void *w, size_t k, __m512 *lo, __m512 *hi) {
    *lo = ld_f32(w, k);
    *hi = ld_f32(w, k + 16);
}
AI void ld2_i8(const void *w, size_t k, __m512 *lo, __m512 *hi) {
    *lo = ld_i8(w, k);
    *hi = ld_i8(w, k + 16);
}
AI void ld2_bf16(const void *w, size_t k, __m512 *lo, __m512 *hi) {
    __m512i v = _mm512_loadu_si512((const void *)((const uint16_t *)w + k));
    *lo = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16));
    *hi = _mm512_castsi512_ps(_mm512_and_si512(v, _mm512_set1_epi32((int)0xFFFF0000u)));
}

/* r0[t] = w0 . x_t, r1[t] = w1 . x_t for t < NT (x_t = x + t*xs), dense dtypes.  Columns
 * past the last full 32-block are in natural order (LD/LDM).  Every (row, token) keeps two
 * accumulator chains (a, b) at every token count, so that a token's sums do not depend on the
 * tokens beside it (batch invariance: a verification or serving batch gives one-token
 * decoding's bits); at NTMAX = 8 tokens some of the 32 accumulators spill, at the rate one
 * chain had (f32 and bf16 at 4 and 8 tokens, Zen 4, 1 thread, 2 A/B rounds, within noise). */
#define DENSE_DOT(NAME, LD2, LD, LDM, ESZ)                                                      \
    AI void NAME(const void *w0, const void *w1, const float *x, size_t xs, uint32_t n,         \
                 const int NT, float *r0, float *r1) {                                          \
        __m512 a0[NTMAX], a1[NTMAX], b0[NTMAX], b1[NTMAX];                                      \
        _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++)                                    \
            a0[t] = a1[t] = b0[t] = b1[t] = _mm512_setzero_ps();                                \
        uint32_t k = 0;                                                                         \
        for (; k + 32 <= n; k += 32) {                                                          \
            PF((const char *)w0 + k * ESZ);                                                     \
            PF((const char *)w1 + k * ESZ);                                                     \
            if (ESZ == 4) {                                                                     \
                PF((const char *)w0 + k * ESZ + 64);                                            \
                PF((const char *)w1 + k * ESZ + 64);                                            \
            }                                                                                   \
            __m512 w0a, w0b, w1a, w1b;                                                          \
            LD2(w0, k, &w0a, &w0b);                                                             \
            LD2(w1, k, &w1a, &w1b);                                                             \
            _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                              \
                __m512 xa = _mm512_loadu_ps(x + t * xs + k);                                    \
                __m512 xb = _mm512_loadu_ps(x + t * xs + k + 16);                               \
                a0[t] = _mm512_fmadd_ps(w0a, xa, a0[t]);                                        \
                a1[t] = _mm512_fmadd_ps(w1a, xa, a1[t]);                                        \
                b0[t] = _mm512_fmadd_ps(w0b, xb, b0[t]);                                        \
                b1[t] = _mm512_fmadd_ps(w1b, xb, b1[t]);                                        \
            }                                                                                   \
        }                                                                                       \
        for (; k < n; k += 16) {                                                                \
            __mmask16 m = n - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - k)) - 1u);  \
            __m512 w0a = LDM(w0, k, m), w1a = LDM(w1, k, m);                                    \
            _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                              \
                __m512 xa = _mm512_maskz_loadu_ps(m, x + t * xs + k);                           \
                a0[t] = _mm512_fmadd_ps(w0a, xa, a0[t]);                                        \
                a1[t] = _mm512_fmadd_ps(w1a, xa, a1[t]);                                        \
            }                                                                                   \
        }                                                                                       \
        _Pragma("GCC unroll 8") for (int t = 0; t < NT; t++) {                                  \
            r0[t] = _mm512_reduce_add_ps(_mm512_add_ps(a0[t], b0[t]));                          \
            r1[t] = _mm512_reduce_add_ps(_mm512_add_ps(a1[t], b1[t]));                          \
        }                                                                                       \
    }

DENSE_DOT(dot_f32, ld2_f32, ld_f32, ldm_f32, 4)
DENSE_DOT(dot_bf16, ld2_bf16, ld_bf16, ldm_bf16, 2)
DENSE_DOT(dot_i8, ld2_i8, ld_i8, ldm_i8, 1)

/* int4 rows (n/2 bytes each, scales s0/s1 per group), x permuted per 32 columns; two chains
 * per (row, token) at every token count, as DENSE_DOT. */
AI void dot_i4(const uint8_t *w0, const uint8_t *w1, const float *s0, const float *s1,
               const float *x, size_t xs, uint32_t n, uint32_t group, const int NT, float *r0,
               float *r1) {
    const __m512 base = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    __m512 a0[NTMAX], a1[NTMAX], b0[NTMAX], b1[NTMAX];
    _Pragma("GCC unroll 8")
    for (int t = 0; t < NT; t++) a0[t] = a1[t] = b0[t] = b1[t] = _mm512_setzero_ps();
    uint32_t ng = n / group;
    for (uint32_t g = 0; g < ng; g++) {
        __m512 t0 = _mm512_mul_ps(base, _mm512_set1_ps(s0[g]));
        __m512 t1 = _mm512_mul_ps(base, _mm512_set1_ps(s1[g]));
        for (uint32_t b = g * group; b < (g + 1) * group; b += 32) {
            if ((b & 127) == 0) {
                PF(w0 + b / 2);
                PF(w1 + b / 2);
            }
            __m512i l0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w0 + b / 2)));
            __m512i l1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w1 + b / 2)));
            __m512 w0l = _mm512_permutexvar_ps(l0, t0);
            __m512 w0h = _mm512_permutexvar_ps(_mm512_srli_epi32(l0, 4), t0);
            __m512 w1l = _mm512_permutexvar_ps(l1, t1);
            __m512 w1h = _mm512_permutexvar_ps(_mm512_srli_epi32(l1, 4), t1);
            _Pragma("GCC unroll 8")
            for (int t = 0; t < NT; t++) {
                __m512 xl = _mm512_loadu_ps(x + t * xs + b);
                __m512 xh = _mm512_loadu_ps(x + t * xs + b + 16);
                a0[t] = _mm512_fmadd_ps(w0l, xl, a0[t]);
                b0[t] = _mm512_fmadd_ps(w0h, xh, b0[t]);
                a1[t] = _mm512_fmadd_ps(w1l, xl, a1[t]);
                b1[t] = _mm512_fmadd_ps(w1h, xh, b1[t]);
            }
        }
    }
    _Pragma("GCC unroll 8")
    for (int t = 0; t < NT; t++) {
        r0[t] = _mm512_reduce_add_ps(_mm512_add_ps(a0[t], b0[t]));
        r1[t] = _mm512_reduce_add_ps(_mm512_add_ps(a1[t], b1[t]));
    }
}

/* ---- one token, four rows: the decode case of the down projection, whose four rows are
 * contiguous (one stream); the activation loads per weight byte are halved. ---- */
#define DENSE_DOT1x4(NAME, LD2, LDM, ESZ)                                                        \
    AI void NAME(const void *const *w, const float *x, uint32_t n, float *r) {                  \
        __m512 a[4], b[4];                                                                      \
        _Pragma("GCC unroll 4") for (int q = 0; q < 4; q++) a[q] = b[q] = _mm512_setzero_ps(); \
        uint32_t k = 0;                                                                         \
        for (; k + 32 <= n; k += 32) {                                                          \
            __m512 xa = _mm512_loadu_ps(x + k), xb = _mm512_loadu_ps(x + k + 16);               \
            _Pragma("GCC unroll 4") for (int q = 0; q < 4; q++) {                               \
                PF((const char *)w[q] + k * ESZ);                                               \
                if (ESZ == 4) PF((const char *)w[q] + k * ESZ + 64);                            \
                __m512 lo, hi;                                                                  \
                LD2(w[q], k, &lo, &hi);                                                         \
                a[q] = _mm512_fmadd_ps(lo, xa, a[q]);                                           \
                b[q] = _mm512_fmadd_ps(hi, xb, b[q]);                                           \
            }                                                                                   \
        }                                                                                       \
        for (; k < n; k += 16) {                                                                \
            __mmask16 m = n - k >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << (n - k)) - 1u);  \
            __m512 xa = _mm512_maskz_loadu_ps(m, x + k);                                        \
            _Pragma("GCC unroll 4") for (int q = 0; q < 4; q++)                                 \
                a[q] = _mm512_fmadd_ps(LDM(w[q], k, m), xa, a[q]);                              \
        }                                                                                       \
        _Pragma("GCC unroll 4") for (int q = 0; q < 4; q++)                                     \
            r[q] = _mm512_reduce_add_ps(_mm512_add_ps(a[q], b[q]));                             \
    }

DENSE_DOT1x4(dot1_f32, ld2_f32, ldm_f32, 4)
DENSE_DOT1x4(dot1_bf16, ld2_bf16, ldm_bf16, 2)
DENSE_DOT1x4(dot1_i8, ld2_i8, ldm_i8, 1)

static void dot1_i4(const uint8_t *const *w, const float *const *s, const float *x, uint32_t n,
                    uint32_t group, float *r) {
    const __m512 base = _mm512_setr_ps(-8, -7, -6, -5, -4, -3, -2, -1, 0, 1, 2, 3, 4, 5, 6, 7);
    __m512 a[4], b[4], tb[4];
    _Pragma("GCC unroll 4") for (int q = 0; q < 4; q++) a[q] = b[q] = _mm512_setzero_ps();
    uint32_t ng = n / group;
    for (uint32_t g = 0; g < ng; g++) {
        _Pragma("GCC unroll 4") for (int q = 0; q < 4; q++)
            tb[q] = _mm512_mul_ps(base, _mm512_set1_ps(s[q][g]));
        for (uint32_t c = g * group; c < (g + 1) * group; c += 32) {
            __m512 xl = _mm512_loadu_ps(x + c), xh = _mm512_loadu_ps(x + c + 16);
            _Pragma("GCC unroll 4") for (int q = 0; q < 4; q++) {
                if ((c & 127) == 0) PF(w[q] + c / 2);
                __m512i l = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w[q] + c / 2)));
                a[q] = _mm512_fmadd_ps(_mm512_permutexvar_ps(l, tb[q]), xl, a[q]);
                b[q] = _mm512_fmadd_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(l, 4), tb[q]), xh,
                                       b[q]);
            }
        }
    }
    _Pragma("GCC unroll 4") for (int q = 0; q < 4; q++)
        r[q] = _mm512_reduce_add_ps(_mm512_add_ps(a[q], b[q]));
}

/* Four rows given as (matrix offset, scale offset, row) against one token x (n columns). */
static void rows4(const smoe_ffn_job *j, const uint64_t *off, const uint64_t *soff,
                  const uint32_t *row, uint32_t n, const float *x, float *r) {
    const smoe_ffn_desc *d = j->d;
    if (d->dtype == SMOE_WDT_I4) {
        uint32_t ng = n / j->group;
        const uint8_t *w[4];
        const float *s[4];
        for (int q = 0; q < 4; q++) {
            w[q] = j->block + off[q] + (size_t)row[q] * (n / 2);
            s[q] = (const float *)(j->block + soff[q]) + (size_t)row[q] * ng;
        }
        dot1_i4(w, s, x, n, j->group, r);
        return;
    }
    size_t esz = d->dtype == SMOE_WDT_F32 ? 4 : d->dtype == SMOE_WDT_BF16 ? 2 : 1;
    const void *w[4];
    for (int q = 0; q < 4; q++) w[q] = j->block + off[q] + (size_t)row[q] * n * esz;
    if (d->dtype == SMOE_WDT_F32) {
        dot1_f32(w, x, n, r);
    } else if (d->dtype == SMOE_WDT_BF16) {
        dot1_bf16(w, x, n, r);
    } else {
        dot1_i8(w, x, n, r);
        for (int q = 0; q < 4; q++) r[q] *= ((const float *)(j->block + soff[q]))[row[q]];
    }
}

/* Rows (ra of matrix A, rb of matrix B) against nt tokens of x (n columns, row stride xs). */
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
        case 4: dot_i4(w0, w1, s0, s1, x, xs, n, g, 4, r0, r1); break;
        case 5: dot_i4(w0, w1, s0, s1, x, xs, n, g, 5, r0, r1); break;
        case 6: dot_i4(w0, w1, s0, s1, x, xs, n, g, 6, r0, r1); break;
        case 7: dot_i4(w0, w1, s0, s1, x, xs, n, g, 7, r0, r1); break;
        default: dot_i4(w0, w1, s0, s1, x, xs, n, g, 8, r0, r1); break;
        }
        return;
    }
    size_t esz = d->dtype == SMOE_WDT_F32 ? 4 : d->dtype == SMOE_WDT_BF16 ? 2 : 1;
    const void *w0 = j->block + offa + (size_t)ra * n * esz;
    const void *w1 = j->block + offb + (size_t)rb * n * esz;
#define DISPATCH_NT(FN)                                                                         \
    switch (nt) {                                                                               \
    case 1: FN(w0, w1, x, xs, n, 1, r0, r1); break;                                             \
    case 2: FN(w0, w1, x, xs, n, 2, r0, r1); break;                                             \
    case 3: FN(w0, w1, x, xs, n, 3, r0, r1); break;                                             \
    case 4: FN(w0, w1, x, xs, n, 4, r0, r1); break;                                             \
    case 5: FN(w0, w1, x, xs, n, 5, r0, r1); break;                                             \
    case 6: FN(w0, w1, x, xs, n, 6, r0, r1); break;                                             \
    case 7: FN(w0, w1, x, xs, n, 7, r0, r1); break;                                             \
    default: FN(w0, w1, x, xs, n, 8, r0, r1); break;                                            \
    }
    if (d->dtype == SMOE_WDT_F32) {
        DISPATCH_NT(dot_f32)
    } else if (d->dtype == SMOE_WDT_BF16) {
        DISPATCH_NT(dot_bf16)
    } else {
        DISPATCH_NT(dot_i8)
        float sa = ((const float *)(j->block + sofa))[ra];
        float sb = ((const float *)(j->block + sofb))[rb];
        for (uint32_t t = 0; t < nt; t++) {
            r0[t] *= sa;
            r1[t] *= sb;
        }
    }
#undef DISPATCH_NT
}

/* Gate/up rows in pairs (gate_i, up_i) at every token count: two weight streams per thread
 * streamed better than four (gate_i, up_i, gate_i+1, up_i+1) at 1 token (f32, OLMoE shape,
 * 1 thread: 0.78 -> 0.90 of the read ceiling; Mixtral shape unchanged; as in ffn_fast.c). */
static void avx512_gateup(const smoe_ffn_job *j, uint32_t i0, uint32_t i1) {
    const smoe_ffn_desc *d = j->d;
    float g[NTMAX], u[NTMAX];
    for (uint32_t i = i0; i < i1; i++)
        for (uint32_t t0 = 0; t0 < j->T; t0 += NTMAX) {
            uint32_t nt = j->T - t0 < NTMAX ? j->T - t0 : NTMAX;
            rows2(j, d->gate, d->gate_scale, i, d->up, d->up_scale, i, d->H,
                  j->xs + (size_t)t0 * d->H, d->H, nt, g, u);
            for (uint32_t t = 0; t < nt; t++) smoe_ffn_store_act(j, i, t0 + t, g[t], u[t]);
        }
}

static void avx512_down(const smoe_ffn_job *j, uint32_t h0, uint32_t h1) {
    const smoe_ffn_desc *d = j->d;
    float y0[NTMAX], y1[NTMAX];
    uint32_t h = h0;
    if (j->T == 1) {
        const uint64_t off[4] = {d->down, d->down, d->down, d->down};
        const uint64_t soff[4] = {d->down_scale, d->down_scale, d->down_scale, d->down_scale};
        float r[4];
        /* four rows a quarter of the chunk apart: each pointer walks its quarter in memory
         * order (adjacent rows step each pointer over three; ffn_avx2.c's avx2_down) */
        const uint32_t q4 = (h1 - h0) / 4;
        for (uint32_t i = 0; i < q4; i++) {
            const uint32_t row[4] = {h0 + i, h0 + q4 + i, h0 + 2 * q4 + i, h0 + 3 * q4 + i};
            rows4(j, off, soff, row, d->I, j->act, r);
            for (int q = 0; q < 4; q++) smoe_ffn_store_out(j, row[q], 0, r[q]);
        }
        h = h0 + 4 * q4; /* the last 0-3 rows in pairs below */
    }
    for (; h < h1; h += 2) {
        uint32_t hb = h + 1 < h1 ? h + 1 : h;
        for (uint32_t t0 = 0; t0 < j->T; t0 += NTMAX) {
            uint32_t nt = j->T - t0 < NTMAX ? j->T - t0 : NTMAX;
            rows2(j, d->down, d->down_scale, h, d->down, d->down_scale, hb, d->I,
                  j->act + (size_t)t0 * d->I, d->I, nt, y0, y1);
            for (uint32_t t = 0; t < nt; t++) {
                smoe_ffn_store_out(j, h, t0 + t, y0[t]);
                if (hb != h) smoe_ffn_store_out(j, hb, t0 + t, y1[t]);
            }
        }
    }
}

static uint64_t avx512_read_sum(const uint8_t *p, size_t n) {
    __m512i s0 = _mm512_setzero_si512(), s1 = s0, s2 = s0, s3 = s0;
    size_t i = 0;
    for (; i + 256 <= n; i += 256) {
        s0 = _mm512_add_epi64(s0, _mm512_loadu_si512((const void *)(p + i)));
        s1 = _mm512_add_epi64(s1, _mm512_loadu_si512((const void *)(p + i + 64)));
        s2 = _mm512_add_epi64(s2, _mm512_loadu_si512((const void *)(p + i + 128)));
        s3 = _mm512_add_epi64(s3, _mm512_loadu_si512((const void *)(p + i + 192)));
    }
    uint64_t s = (uint64_t)_mm512_reduce_add_epi64(
        _mm512_add_epi64(_mm512_add_epi64(s0, s1), _mm512_add_epi64(s2, s3)));
    for (; i < n; i++) s += p[i];
    return s;
}

const smoe_ffn_impl smoe_ffn_impl_avx512 = {avx512_gateup, avx512_down, avx512_read_sum};

#else
#include "kimpl.h"
const smoe_ffn_impl smoe_ffn_impl_avx512 = {0, 0, 0};
#endif

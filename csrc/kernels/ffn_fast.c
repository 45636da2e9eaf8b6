/* Fast AVX-512 expert FFN paths with rounded activations (desc.precise == 0, the default):
 *   BF16  vdpbf16ps (AVX512_BF16): x / act rounded to bf16 (round-to-nearest-even) once per
 *         call; products of two bf16 are exact in f32, accumulated in f32.
 *   I8    vpdpwssd (AVX512_VNNI): x / act quantized to int16 per token (scale max|x| / 32767,
 *         round to nearest); weight bytes sign-extended to int16; exact integer products,
 *         int32 lanes flushed to f32 every 4096 columns.  (The int8-activation alternative,
 *         vpdpbusd with x + 128 and a 128 * sum(w) correction, does half the instructions at
 *         8 tokens but measured ~2e-2 output error; int16 keeps it at ~1e-4.)
 *   I4    vpdpbusd: the nibbles u in [0, 15] are the u8 operand, x / act quantized to int8 per
 *         block of 128 columns (scale max|x_block| / 127) is the s8 operand, laid out to match
 *         the nibble order; per 128-column block the int32 sum is converted and multiplied by
 *         x_scale * w_group_scale, and the -8 offset is removed with the per-block sum of q.
 * Error bounds (relative to the f32 math on the dequantized weights, see kernels.h): rounding
 * an activation vector to bf16 perturbs each element by at most 2^-9 relative, so a dot product
 * moves by at most 2^-9 * sum |w_k x_k|; int16 per-token quantization (I8) by at most
 * max|x| / 65534 per element; int8 per-block quantization (I4) by at most max|x_block| / 254.
 * Measured FFN-output errors (norm of the difference over norm of the output, Gaussian data,
 * SiLU and GPT-OSS): bf16 ~3e-3, int8 ~1e-4, int4 ~1.6e-2 (against an int4 weight error
 * of ~0.15); the tests check 1e-2, 1e-3 and 3e-2.  The activation between the two phases runs
 * 16 rows at a time with a polynomial exp (exp16, ~1e-7 relative) instead of libm's expf; a
 * test bounds its effect through the int8 path (3e-4 over gate values up to +-120).
 *
 * Used only when the CPU has the feature, H and I are multiples of 64 (I4: of 128; at most
 * 65536) and, for I4, the group is a multiple of 128; otherwise the exact path of ffn_avx512.c
 * runs. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && __GNUC__ >= 10
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,avx512bf16")
#include <immintrin.h>

#include "kimpl.h"

#define AI static inline __attribute__((always_inline))
/* Tokens per tile.  Batch invariance: every (row, token) dot product is summed in the same
 * order whatever the number of tokens in the call, so that verifying K drafts, or a serving
 * batch, gives each token the bits of one-token decoding (tests/test_batch_invariance.py).
 * bf16 and int4 keep their two accumulator sets at every token count, in tiles of at most 4
 * tokens (rows_dispatch); int8's two integer chains are summed before the conversion, so one
 * chain (3+ tokens) gives the same sum. */
#define NTMAX 8
/* Software prefetch per weight stream: to L2 `l2` bytes ahead, to L1 `l1` bytes ahead.
 * bf16 (tiles of 3+ tokens only, see dot_bf16): 4096 / 512 (4096 beat 512 and 16384; T1+T0
 * beat T0-only by ~15-25% on bf16/int8, 1 thread, OLMoE, DRAM).  int8 and int4: 16384 / 1024
 * (2026-11-25, DRAM, interleaved builds, 1 token): OLMoE-shape int8 experts at 1 thread ~16.0
 * -> ~18.3 GB/s; int4 linear rows 50304 x 2048 (an lm_head) 0.50-0.52 -> 0.68 of the read
 * ceiling at 1 thread and 0.71 -> 0.79 at 2; int4 experts 0.89-0.95 -> 0.97-1.07; neutral at
 * Mixtral shape (measured with rows two and four at a time; one token now reads one row at a
 * time, see fast_gateup).  Rows of 1-2 KB in groups of four put 4096 bytes only one group
 * ahead, too close at DRAM latency. */
#ifdef SMOE_FPF_OFF
#define FPF_AT(p, l2, l1) ((void)(p))
#else
#define FPF_AT(p, l2, l1)                                                                      \
    (_mm_prefetch((const char *)(p) + (l2), _MM_HINT_T1),                                      \
     _mm_prefetch((const char *)(p) + (l1), _MM_HINT_T0))
#endif
#define FPF(p) FPF_AT(p, 4096, 512)
#define FPFQ(p) FPF_AT(p, 16384, 1024)

/* ---- activation preparation (O(T * n) vector work, small next to the weights) ----
 * Each branch's comment gives its formula.  max|x| is exact, x * inv is one f32 multiply, the
 * integer conversions round to nearest even (the MXCSR default, as nearbyintf would) and are
 * clamped to the bounds given; the bf16 conversion (vcvtneps2bf16) rounds to nearest even and
 * treats denormal inputs as zero. */

/* max |x[k]| over n (a multiple of 16) floats; NaN if any x[k] is NaN (vmaxps alone would drop
 * it), so that the scale made from it, and every output of the token or block, is NaN as in
 * the f32 math */
AI float absmax16(const float *x, uint32_t n) {
    __m512 m = _mm512_setzero_ps();
    __mmask16 nan = 0;
    for (uint32_t k = 0; k < n; k += 16) {
        __m512 v = _mm512_loadu_ps(x + k);
        nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
        m = _mm512_max_ps(m, _mm512_abs_ps(v));
    }
    return nan ? __builtin_nanf("") : _mm512_reduce_max_ps(m);
}

/* clamp(rint(x[0..16) * inv), -lim, lim) as int32 lanes */
AI __m512i quant16(const float *x, __m512 inv, int32_t lim) {
    __m512i v = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_loadu_ps(x), inv));
    return _mm512_max_epi32(_mm512_min_epi32(v, _mm512_set1_epi32(lim)), _mm512_set1_epi32(-lim));
}

void smoe_fast_prepare(int32_t dtype, const float *src, size_t src_stride, const int32_t *rows,
                       uint32_t T, uint32_t n, void *q, float *qs, float *qsum) {
    for (uint32_t t = 0; t < T; t++) {
        size_t r = rows ? (size_t)rows[t] : t;
        const float *x = src + r * src_stride;
        if (dtype == SMOE_WDT_BF16) { /* o[k] = bf16(x[k]), round to nearest even */
            uint16_t *o = (uint16_t *)q + (size_t)t * n;
            for (uint32_t k = 0; k < n; k += 16)
                _mm256_storeu_si256((__m256i *)(void *)(o + k),
                                    (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(x + k)));
        } else if (dtype == SMOE_WDT_I8) { /* o[k] = clamp(rint(x[k] / s), +-32767),
                                               s = max|x| / 32767 */
            float m = absmax16(x, n);
            float s = !(m <= 0.0f) ? m / 32767.0f : 1.0f; /* NaN stays NaN */
            __m512 inv = _mm512_set1_ps(1.0f / s);
            int16_t *o = (int16_t *)q + (size_t)t * n;
            for (uint32_t k = 0; k < n; k += 16)
                _mm256_storeu_si256((__m256i *)(void *)(o + k),
                                    _mm512_cvtepi32_epi16(quant16(x + k, inv, 32767)));
            qs[t] = s;
        } else { /* I4: per 128 columns (a trailing 64 when n % 128 == 64: see dot_i4_g64),
                    s = max|x_block| / 127, v = clamp(rint(x / s), +-127); within each 32-column
                    group g the even columns go to o[16g..16g+16) and the odd ones to
                    o[len/2+16g..) (len: the block's columns), the partners of the low and high
                    nibbles */
            const __m512i ev = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24,
                                                 26, 28, 30);
            const __m512i od = _mm512_add_epi32(ev, _mm512_set1_epi32(1));
            uint32_t nb = (n + 127) / 128;
            int8_t *o = (int8_t *)q + (size_t)t * n;
            for (uint32_t b = 0; b < nb; b++) {
                const float *xb = x + (size_t)b * 128;
                const uint32_t len = n - b * 128 < 128 ? n - b * 128 : 128;
                float m = absmax16(xb, len);
                float s = !(m <= 0.0f) ? m / 127.0f : 1.0f; /* NaN stays NaN */
                __m512 inv = _mm512_set1_ps(1.0f / s);
                __m512i sum = _mm512_setzero_si512();
                int8_t *ob = o + (size_t)b * 128;
                for (uint32_t g = 0; g < len / 32; g++) {
                    __m512i va = quant16(xb + 32 * g, inv, 127);
                    __m512i vb = quant16(xb + 32 * g + 16, inv, 127);
                    sum = _mm512_add_epi32(sum, _mm512_add_epi32(va, vb));
                    _mm_storeu_si128((__m128i *)(void *)(ob + 16 * g),
                                     _mm512_cvtepi32_epi8(_mm512_permutex2var_epi32(va, ev, vb)));
                    _mm_storeu_si128((__m128i *)(void *)(ob + len / 2 + 16 * g),
                                     _mm512_cvtepi32_epi8(_mm512_permutex2var_epi32(va, od, vb)));
                }
                qs[(size_t)t * nb + b] = s;
                qsum[(size_t)t * nb + b] = s * (float)_mm512_reduce_add_epi32(sum);
            }
        }
    }
}

/* e^x on 16 lanes: n = rint(x log2 e), r = x - n ln 2 (two-part ln 2), degree-6 Taylor
 * polynomial of e^r on |r| <= ln2/2 (truncation < 1.3e-7 relative), times 2^n with scalef
 * (overflow to inf, underflow to 0).  x is clamped first so that r stays finite. */
AI __m512 exp16(__m512 x) {
    x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-104.0f)), _mm512_set1_ps(89.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);
    __m512 p = _mm512_set1_ps(1.0f / 720.0f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
    return _mm512_scalef_ps(p, n);
}

/* The activation of kernels.h (smoe_ffn_activate's formula, with exp16 for expf) on the m <= 16
 * rows i0.. of one token: g, u the gate/up dot products, biases added here; result to dst. */
AI void act16(const smoe_ffn_desc *d, const float *gb, const float *ub, uint32_t i0, uint32_t m,
              const float *g, const float *u, float *dst) {
    __mmask16 mk = (__mmask16)((1u << m) - 1u);
    __m512 vg = _mm512_maskz_loadu_ps(mk, g), vu = _mm512_maskz_loadu_ps(mk, u);
    if (gb) vg = _mm512_add_ps(vg, _mm512_maskz_loadu_ps(mk, gb + i0));
    if (ub) vu = _mm512_add_ps(vu, _mm512_maskz_loadu_ps(mk, ub + i0));
    const __m512 one = _mm512_set1_ps(1.0f);
    __m512 a;
    if (d->act == SMOE_ACT_GPTOSS) {
        __m512 lim = _mm512_set1_ps(d->limit);
        vg = _mm512_min_ps(vg, lim);
        vu = _mm512_max_ps(_mm512_min_ps(vu, lim), _mm512_sub_ps(_mm512_setzero_ps(), lim));
        __m512 e = exp16(_mm512_mul_ps(_mm512_set1_ps(-d->alpha), vg));
        a = _mm512_mul_ps(_mm512_add_ps(vu, one), _mm512_div_ps(vg, _mm512_add_ps(one, e)));
    } else {
        __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), vg));
        a = _mm512_mul_ps(_mm512_div_ps(vg, _mm512_add_ps(one, e)), vu);
    }
    _mm512_mask_storeu_ps(dst, mk, a);
}

/* ---- horizontal sums ----
 * One summation tree for every dot product of this file, so that a row's result does not
 * depend on the path that computed it (a one-token output is bit for bit its row of a
 * two-token call): lanes i and i+8, then i and i+4 of those, then 0+2 and 1+3, then the two. */
AI float hsum16(__m512 v) {
    __m256 s = _mm256_add_ps(_mm512_castps512_ps256(v), _mm512_extractf32x8_ps(v, 1));
    __m128 u = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
    __m128 w = _mm_add_ps(u, _mm_movehl_ps(u, u));
    return _mm_cvtss_f32(_mm_add_ss(w, _mm_movehdup_ps(w)));
}

/* hsum16 of 16 vectors at once: lane i of the result is hsum16(v[i]), the same additions of the
 * same pairs (a transposition between the levels of the tree: 15 vector adds for the 16 rows
 * instead of 4 dependent adds and 4 shuffles each). */
AI __m512 hsum16x16(const __m512 *v) {
    __m512 s[8], u[4], w[2];
    for (int i = 0; i < 8; i++) /* rows 2i | 2i+1: lanes j and j+8 of each */
        s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0x44),
                             _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], 0xEE));
    for (int i = 0; i < 4; i++) /* rows 4i..4i+3, four lanes each: j and j+4 of the above */
        u[i] = _mm512_add_ps(_mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0x88),
                             _mm512_shuffle_f32x4(s[2 * i], s[2 * i + 1], 0xDD));
    for (int i = 0; i < 2; i++) /* per 128-bit lane k: rows 8i+k and 8i+4+k, two lanes each */
        w[i] = _mm512_add_ps(_mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(u[2 * i], u[2 * i + 1], 0xEE));
    /* per 128-bit lane k: rows k, k+4, k+8, k+12 */
    __m512 r = _mm512_add_ps(_mm512_shuffle_ps(w[0], w[1], 0x88),
                             _mm512_shuffle_ps(w[0], w[1], 0xDD));
    const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
    return _mm512_permutexvar_ps(order, r);
}

/* ---- dot products: NR weight rows x NT tokens ---- */

/* bf16: r[q][t] = w_q . x_t, x bf16 [NT][n] (row stride n).  Software prefetch with 3+
 * tokens, and at 1-2 tokens only on short rows (below): on long rows the hardware prefetcher
 * alone streams bf16 faster at 1 token (0.72 -> 0.83 of the read ceiling, Mixtral shape, 1
 * thread; 2026-11-24, interleaved builds), while at 8 tokens dropping it halves the rate
 * (OLMoE 0.56 -> 0.28). */
AI void dot_bf16(const uint16_t *const *w, const int NR, const uint16_t *x, uint32_t n,
                 const int NT, float (*r)[NTMAX]) {
    __m512 a[4][NTMAX], b[4][NTMAX];
    for (int q = 0; q < NR; q++)
        for (int t = 0; t < NT; t++) a[q][t] = b[q][t] = _mm512_setzero_ps();
    uint32_t k = 0;
    /* Several rows of at most 4 KB (a page: the hardware prefetcher starts over on every row)
     * get software prefetch: 50304 x 2048 linear rows four at a time at 1 thread 0.65 ->
     * 0.72-0.77 of the read ceiling; long rows (Mixtral's 8-28 KB) lost with it (1.0 ->
     * 0.82), 2026-11-25.  A single row (NR = 1, the one-token path) is one sequential stream,
     * which the hardware prefetcher alone serves best: a plain read loop at 1 thread got
     * 23.0 GB/s alone and 9.8-14.1 GB/s with software prefetch 512-16384 bytes ahead
     * (2026-11-25). */
    const int pf = NR > 1 && n <= 2048;
    /* two accumulator sets: enough independent chains, and at every token count the same
     * order (batch invariance, see NTMAX) */
    for (; k + 64 <= n; k += 64) {
        for (int q = 0; q < NR; q++) {
            if (NT > 2) { /* 64 bf16 = two cache lines per step */
                FPF(w[q] + k);
                FPF(w[q] + k + 32);
            } else if (pf) {
                FPFQ(w[q] + k);
                FPFQ(w[q] + k + 32);
            }
            __m512i w0 = _mm512_loadu_si512((const void *)(w[q] + k));
            __m512i w1 = _mm512_loadu_si512((const void *)(w[q] + k + 32));
            for (int t = 0; t < NT; t++) {
                __m512i x0 = _mm512_loadu_si512((const void *)(x + (size_t)t * n + k));
                __m512i x1 = _mm512_loadu_si512((const void *)(x + (size_t)t * n + k + 32));
                a[q][t] = _mm512_dpbf16_ps(a[q][t], (__m512bh)w0, (__m512bh)x0);
                b[q][t] = _mm512_dpbf16_ps(b[q][t], (__m512bh)w1, (__m512bh)x1);
            }
        }
    }
    for (; k < n; k += 32) {
        for (int q = 0; q < NR; q++) {
            if (NT > 2) FPF(w[q] + k);
            __m512i w0 = _mm512_loadu_si512((const void *)(w[q] + k));
            for (int t = 0; t < NT; t++) {
                __m512i x0 = _mm512_loadu_si512((const void *)(x + (size_t)t * n + k));
                a[q][t] = _mm512_dpbf16_ps(a[q][t], (__m512bh)w0, (__m512bh)x0);
            }
        }
    }
    for (int q = 0; q < NR; q++)
        for (int t = 0; t < NT; t++) r[q][t] = hsum16(_mm512_add_ps(a[q][t], b[q][t]));
}

/* bf16, one token, m <= 16 consecutive rows w, w + n, ... (n columns, a multiple of 64):
 * res[i] = w_i . x with dot_bf16's two accumulator chains and hsum16's sums, so bit for bit
 * dot_bf16's result for the row, but the horizontal sums are done for all 16 rows at once
 * (hsum16x16) instead of after each row: on rows of 2-3 KB the per-row sums cost ~13 % of a
 * one-stream read (a read loop of 2048 x 1408 bf16 rows, 1 thread: 25.7 GB/s with a sum per
 * row, 29.1 without; 2026-11-25).  One sequential stream.  `pf`: bytes ahead to prefetch to
 * L2 (the context's stream_pf), 0 for none.  Which is best depends on the CPU: on the AMD
 * EPYC hosts the hardware prefetcher alone served a stream best (see dot_bf16); on an Intel
 * Xeon (2026-11-26; a C loop of this one over 64 MB of 2048- and 1408-column rows rotated
 * through 1 GB, best of 6, 1 thread, DRAM) none read 11.7-11.9 GB/s, 256-1024 bytes ahead
 * 11.7-13.7, 2048 14.0-14.8, 4096 14.7-15.6 (T0, T1 or T2 alike), 8192-16384 the same,
 * against 16.0-16.6 for the read loop: 0.73 -> 0.92-0.94 of it. */
AI void rows16_bf16(const uint16_t *w, uint32_t n, const uint16_t *x, uint32_t m, uint32_t pf,
                    float *res) {
    __m512 v[16];
    for (uint32_t i = 0; i < m; i++) {
        const uint16_t *p = w + (size_t)i * n;
        __m512 a = _mm512_setzero_ps(), b = _mm512_setzero_ps();
        for (uint32_t k = 0; k < n; k += 64) {
            if (pf) { /* 64 bf16 = two cache lines per step */
                _mm_prefetch((const char *)(p + k) + pf, _MM_HINT_T1);
                _mm_prefetch((const char *)(p + k) + pf + 64, _MM_HINT_T1);
            }
            a = _mm512_dpbf16_ps(a, (__m512bh)_mm512_loadu_si512((const void *)(p + k)),
                                 (__m512bh)_mm512_loadu_si512((const void *)(x + k)));
            b = _mm512_dpbf16_ps(b, (__m512bh)_mm512_loadu_si512((const void *)(p + k + 32)),
                                 (__m512bh)_mm512_loadu_si512((const void *)(x + k + 32)));
        }
        v[i] = _mm512_add_ps(a, b);
    }
    for (uint32_t i = m; i < 16; i++) v[i] = _mm512_setzero_ps();
    _mm512_mask_storeu_ps(res, (__mmask16)((1u << m) - 1u), hsum16x16(v));
}

/* int8: r[q][t] = w_q . xq_t (integer products, f32 sums), x int16 [NT][n].  Lanes are
 * flushed to f32 every 4096 columns: a lane then holds at most 128 vpdpwssd steps of two
 * products |127 * 32767| each, < 2^31.
 * Four rows (NR = 4: fast_down's fours, always rows h..h+3 of one matrix, so consecutive in
 * memory) prefetch to L2 the same column of the next four rows, 4n bytes on, instead of FPFQ's
 * 16 KB: on rows of 4+ KB that lands inside the sibling row being read now (14 KB rows: 2 KB
 * ahead of row q+1), too close at DRAM latency.  Linear 4096 x 14336 (Mixtral's expert down),
 * 1 token, 1 thread, DRAM, interleaved with the read ceiling (2026-11-26): 19.5-20.8 ->
 * 22.1-23.4 GB/s (0.61-0.65 -> 0.68-0.74 of the ceiling), 2048 x 10944 (DeepSeek-V2-Lite's
 * dense down) 17.3-18.1 -> 21.6-21.8 GB/s; 8n and a sequential sweep of the
 * next group read the same, 2n (half the streams prefetching their sibling) 17-19 GB/s.  The
 * same rule measured neutral for int4 pairs and lost for bf16 fours (which prefetch nothing on
 * long rows, see dot_bf16), so it is int8's alone. */
AI void dot_i8(const int8_t *const *w, const int NR, const int16_t *x, uint32_t n, const int NT,
               float (*r)[NTMAX]) {
    __m512 f[4][NTMAX];
    for (int q = 0; q < NR; q++)
        for (int t = 0; t < NT; t++) f[q][t] = _mm512_setzero_ps();
    for (uint32_t k0 = 0; k0 < n; k0 += 4096) {
        uint32_t k1 = n - k0 < 4096 ? n : k0 + 4096;
        __m512i a[4][NTMAX], b[4][NTMAX];
        for (int q = 0; q < NR; q++)
            for (int t = 0; t < NT; t++) a[q][t] = b[q][t] = _mm512_setzero_si512();
        uint32_t k = k0;
        if (NT <= 2) {
            for (; k + 64 <= k1; k += 64) {
                for (int q = 0; q < NR; q++) {
                    if (NR == 4)
                        FPF_AT(w[q] + k, 4 * (size_t)n, 1024);
                    else
                        FPFQ(w[q] + k);
                    __m512i w0 = _mm512_cvtepi8_epi16(
                        _mm256_loadu_si256((const __m256i *)(const void *)(w[q] + k)));
                    __m512i w1 = _mm512_cvtepi8_epi16(
                        _mm256_loadu_si256((const __m256i *)(const void *)(w[q] + k + 32)));
                    for (int t = 0; t < NT; t++) {
                        const int16_t *xt = x + (size_t)t * n + k;
                        a[q][t] = _mm512_dpwssd_epi32(a[q][t], w0,
                                                      _mm512_loadu_si512((const void *)xt));
                        b[q][t] = _mm512_dpwssd_epi32(b[q][t], w1,
                                                      _mm512_loadu_si512((const void *)(xt + 32)));
                    }
                }
            }
        }
        for (; k < k1; k += 32) {
            for (int q = 0; q < NR; q++) {
                if ((k & 63) == 0) FPFQ(w[q] + k);
                __m512i w0 = _mm512_cvtepi8_epi16(
                    _mm256_loadu_si256((const __m256i *)(const void *)(w[q] + k)));
                for (int t = 0; t < NT; t++)
                    a[q][t] = _mm512_dpwssd_epi32(
                        a[q][t], w0, _mm512_loadu_si512((const void *)(x + (size_t)t * n + k)));
            }
        }
        /* a + b in integers (at most the 128 steps above a lane), so that one chain (3+
         * tokens) and two give the same sum: batch invariance, see NTMAX */
        for (int q = 0; q < NR; q++)
            for (int t = 0; t < NT; t++)
                f[q][t] = _mm512_add_ps(f[q][t],
                                        _mm512_cvtepi32_ps(_mm512_add_epi32(a[q][t], b[q][t])));
    }
    for (int q = 0; q < NR; q++)
        for (int t = 0; t < NT; t++) r[q][t] = hsum16(f[q][t]);
}

/* int8, one token, m <= 16 consecutive rows w, w + n, ... (n columns, a multiple of 32), row
 * scales ws[0..m), token scale xs: res[i] = (w_i . x) * (ws[i] * xs), bit for bit dot_i8's
 * result times rowsN's scale (the same columns in each int32 chain, exact integer sums, the
 * same flushes and hsum16), the horizontal sums deferred to 16 rows at once as rows16_bf16's.
 * One sequential stream; `pf` as rows16_bf16's. */
AI void rows16_i8(const int8_t *w, uint32_t n, const int16_t *x, uint32_t m, const float *ws,
                  float xs, uint32_t pf, float *res) {
    __m512 v[16];
    for (uint32_t i = 0; i < m; i++) {
        const int8_t *p = w + (size_t)i * n;
        __m512 f = _mm512_setzero_ps();
        for (uint32_t k0 = 0; k0 < n; k0 += 4096) {
            uint32_t k1 = n - k0 < 4096 ? n : k0 + 4096, k = k0;
            __m512i a = _mm512_setzero_si512(), b = _mm512_setzero_si512();
            for (; k + 64 <= k1; k += 64) {
                if (pf) _mm_prefetch((const char *)(p + k) + pf, _MM_HINT_T1); /* a line a step */
                __m512i w0 = _mm512_cvtepi8_epi16(
                    _mm256_loadu_si256((const __m256i *)(const void *)(p + k)));
                __m512i w1 = _mm512_cvtepi8_epi16(
                    _mm256_loadu_si256((const __m256i *)(const void *)(p + k + 32)));
                a = _mm512_dpwssd_epi32(a, w0, _mm512_loadu_si512((const void *)(x + k)));
                b = _mm512_dpwssd_epi32(b, w1, _mm512_loadu_si512((const void *)(x + k + 32)));
            }
            for (; k < k1; k += 32) {
                __m512i w0 = _mm512_cvtepi8_epi16(
                    _mm256_loadu_si256((const __m256i *)(const void *)(p + k)));
                a = _mm512_dpwssd_epi32(a, w0, _mm512_loadu_si512((const void *)(x + k)));
            }
            f = _mm512_add_ps(f, _mm512_cvtepi32_ps(_mm512_add_epi32(a, b)));
        }
        v[i] = f;
    }
    for (uint32_t i = m; i < 16; i++) v[i] = _mm512_setzero_ps();
    const __mmask16 mk = (__mmask16)((1u << m) - 1u);
    __m512 sc = _mm512_mul_ps(_mm512_maskz_loadu_ps(mk, ws), _mm512_set1_ps(xs));
    _mm512_mask_storeu_ps(res, mk, _mm512_mul_ps(hsum16x16(v), sc));
}

/* One 128-column block b (index bi within the current 16) of every row into accumulators F. */
#define I4_BLOCK(b, bi, F)                                                                     \
    for (int q = 0; q < NR; q++) {                                                             \
        FPFQ(w[q] + (size_t)(b) * 64);                                                         \
        __m512i v = _mm512_loadu_si512((const void *)(w[q] + (size_t)(b) * 64));              \
        __m512i lo = _mm512_and_si512(v, m4);                                                  \
        __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);                            \
        for (int t = 0; t < NT; t++) {                                                         \
            const int8_t *xb = x + (size_t)t * n + (size_t)(b) * 128;                          \
            __m512i acc = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo,                      \
                                              _mm512_loadu_si512((const void *)xb));           \
            acc = _mm512_dpbusd_epi32(acc, hi, _mm512_loadu_si512((const void *)(xb + 64)));   \
            F[q][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_set1_ps(S[q][t][bi]),    \
                                      F[q][t]);                                                \
        }                                                                                      \
    }

/* int4 in groups of 64 (GPT-OSS's 2880, DeepSeek-V2-Lite's dense 10944): a 128-column block
 * holds two groups.  Byte j of a block packs columns 2j and 2j+1, so the low 8 int32 lanes of
 * its vpdpbusd sums are columns 0-63 and the high 8 columns 64-127: each half is scaled by its
 * own group's scale (times the block's activation scale) in one vector.  The -8 offset is taken
 * per lane in integers, 8 . xq by vpdpbusd beside (u . xq), so the difference is exact.  A
 * trailing half block (n % 128 == 64; its activations prepared as 32 even then 32 odd columns)
 * reads its 32 weight bytes and activations masked, its high lanes zero. */
AI void dot_i4_g64(const uint8_t *const *w, const float *const *ws, const int NR,
                   const int8_t *x, const float *xsc, uint32_t n, const int NT,
                   float (*r)[NTMAX]) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), c8 = _mm512_set1_epi8(8);
    const uint32_t nb = (n + 127) / 128;
    __m512 f[4][NTMAX];
    for (int q = 0; q < NR; q++)
        for (int t = 0; t < NT; t++) f[q][t] = _mm512_setzero_ps();
    for (uint32_t b = 0; b < nb; b++) {
        const int half = n - b * 128 < 128;
        const __mmask64 bm = half ? (__mmask64)0xFFFFFFFFu : ~(__mmask64)0;
        const uint32_t xo = half ? 32 : 64; /* the odd columns' offset in the block */
        for (int q = 0; q < NR; q++) {
            FPFQ(w[q] + (size_t)b * 64);
            __m512i v = _mm512_maskz_loadu_epi8(bm, w[q] + (size_t)b * 64);
            __m512i lo = _mm512_and_si512(v, m4);
            __m512i hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
            const float sa = ws[q][2 * b], sb = half ? 0.0f : ws[q][2 * b + 1];
            for (int t = 0; t < NT; t++) {
                const int8_t *xb = x + (size_t)t * n + (size_t)b * 128;
                __m512i x0 = _mm512_maskz_loadu_epi8(bm, xb);
                __m512i x1 = _mm512_maskz_loadu_epi8(bm, xb + xo);
                __m512i acc = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, x0);
                acc = _mm512_dpbusd_epi32(acc, hi, x1);
                __m512i off = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c8, x0);
                off = _mm512_dpbusd_epi32(off, c8, x1);
                const float xs = xsc[(size_t)t * nb + b];
                __m512 sv = _mm512_mask_blend_ps((__mmask16)0xFF00, _mm512_set1_ps(sa * xs),
                                                 _mm512_set1_ps(sb * xs));
                f[q][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc, off)), sv,
                                          f[q][t]);
            }
        }
    }
    for (int q = 0; q < NR; q++)
        for (int t = 0; t < NT; t++) r[q][t] = hsum16(f[q][t]);
}

/* int4: r[q][t] = sum over 128-column blocks b of sw_q[g(b)] * xsc_t[b] * (u - 8) . xq_t.
 * Per 16 blocks the combined scales S = sw * xsc are formed with one vector multiply and kept
 * in a small array, so the per-block flush is cvt + fma with a broadcast memory operand (no
 * scalar work); the -8 offset term -8 * sum_b sw_b * xc_b (xc = xsc * sum(xq), precomputed per
 * block) is one fma per 16 blocks into the accumulator's lanes, summed with them at the end. */
AI void dot_i4(const uint8_t *const *w, const float *const *ws, const int NR, const int8_t *x,
               const float *xsc, const float *xc, uint32_t n, uint32_t group, const int NT,
               float (*r)[NTMAX]) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const uint32_t nb = n / 128, bpg = group / 128;
    __m512 f[4][NTMAX], f2[4][NTMAX];
    float S[4][NTMAX][16] __attribute__((aligned(64)));
    for (int q = 0; q < NR; q++)
        for (int t = 0; t < NT; t++) f[q][t] = f2[q][t] = _mm512_setzero_ps();
    for (uint32_t b0 = 0; b0 < nb; b0 += 16) {
        uint32_t m = nb - b0 < 16 ? nb - b0 : 16;
        __mmask16 mk = (__mmask16)((1u << m) - 1u);
        for (int q = 0; q < NR; q++) {
            __m512 sw;
            if (bpg == 1) {
                sw = _mm512_maskz_loadu_ps(mk, ws[q] + b0);
            } else {
                float tmp[16] __attribute__((aligned(64)));
                for (uint32_t i = 0; i < 16; i++) tmp[i] = i < m ? ws[q][(b0 + i) / bpg] : 0.0f;
                sw = _mm512_load_ps(tmp);
            }
            __m512 swm8 = _mm512_mul_ps(sw, _mm512_set1_ps(-8.0f));
            for (int t = 0; t < NT; t++) {
                __m512 sv = _mm512_mul_ps(sw, _mm512_maskz_loadu_ps(mk, xsc + (size_t)t * nb + b0));
                _mm512_store_ps(S[q][t], sv);
                /* the -8 offset of these 16 blocks, one lane each, into f's lanes (all lanes
                 * are summed at the end; masked-off lanes load 0) */
                f[q][t] = _mm512_fmadd_ps(swm8, _mm512_maskz_loadu_ps(mk, xc + (size_t)t * nb + b0),
                                          f[q][t]);
            }
        }
        uint32_t bi = 0;
        /* blocks in pairs into two accumulator sets: two fma chains per row, at every token
         * count (see NTMAX) */
        for (; bi + 2 <= m; bi += 2) {
            I4_BLOCK(b0 + bi, bi, f);
            I4_BLOCK(b0 + bi + 1, bi + 1, f2);
        }
        for (; bi < m; bi++) I4_BLOCK(b0 + bi, bi, f);
    }
    for (int q = 0; q < NR; q++)
        for (int t = 0; t < NT; t++) f[q][t] = _mm512_add_ps(f[q][t], f2[q][t]);
    for (int q = 0; q < NR; q++)
        for (int t = 0; t < NT; t++) r[q][t] = hsum16(f[q][t]);
}

/* NR rows (matrix offsets off[q], scale offsets soff[q], row indices row[q]) against NT tokens
 * of the prepared input (j->q etc.), n columns.  Results are final dot products (scales
 * applied). */
AI void rowsN(const smoe_ffn_job *j, const uint64_t *off, const uint64_t *soff,
              const uint32_t *row, const int NR, uint32_t n, uint32_t t0, const int NT,
              float (*r)[NTMAX]) {
    const smoe_ffn_desc *d = j->d;
    if (d->dtype == SMOE_WDT_BF16) {
        const uint16_t *w[4];
        for (int q = 0; q < NR; q++)
            w[q] = (const uint16_t *)(j->block + off[q]) + (size_t)row[q] * n;
        dot_bf16(w, NR, (const uint16_t *)j->q + (size_t)t0 * n, n, NT, r);
    } else if (d->dtype == SMOE_WDT_I8) {
        const int8_t *w[4];
        for (int q = 0; q < NR; q++)
            w[q] = (const int8_t *)(j->block + off[q]) + (size_t)row[q] * n;
        dot_i8(w, NR, (const int16_t *)j->q + (size_t)t0 * n, n, NT, r);
        for (int q = 0; q < NR; q++) {
            float sw = ((const float *)(j->block + soff[q]))[row[q]];
            for (int t = 0; t < NT; t++) r[q][t] *= sw * j->qs[t0 + (uint32_t)t];
        }
    } else {
        uint32_t ng = n / j->group, nb = (n + 127) / 128;
        const uint8_t *w[4];
        const float *ws[4];
        for (int q = 0; q < NR; q++) {
            w[q] = j->block + off[q] + (size_t)row[q] * (n / 2);
            ws[q] = (const float *)(j->block + soff[q]) + (size_t)row[q] * ng;
        }
        if (j->group == 64)
            dot_i4_g64(w, ws, NR, (const int8_t *)j->q + (size_t)t0 * n, j->qs + (size_t)t0 * nb,
                       n, NT, r);
        else
            dot_i4(w, ws, NR, (const int8_t *)j->q + (size_t)t0 * n, j->qs + (size_t)t0 * nb,
               j->qsum + (size_t)t0 * nb, n, j->group, NT, r);
    }
}

/* One token, bf16 or int8: rows row0 .. row0 + m - 1 (m <= 16) of the matrix at `off` (scales at
 * `soff`), n columns, into res[0..m): rowsN's results, the horizontal sums of the 16 at once. */
static void rows16(const smoe_ffn_job *j, uint64_t off, uint64_t soff, uint32_t row0, uint32_t m,
                   uint32_t n, float *res) {
    if (j->d->dtype == SMOE_WDT_BF16)
        rows16_bf16((const uint16_t *)(j->block + off) + (size_t)row0 * n, n,
                    (const uint16_t *)j->q, m, j->stream_pf, res);
    else
        rows16_i8((const int8_t *)(j->block + off) + (size_t)row0 * n, n,
                  (const int16_t *)j->q, m, (const float *)(j->block + soff) + row0, j->qs[0],
                  j->stream_pf, res);
}

static void rows_dispatch(const smoe_ffn_job *j, const uint64_t *off, const uint64_t *soff,
                          const uint32_t *row, int NR, uint32_t n, uint32_t t0, uint32_t nt,
                          float (*r)[NTMAX]) {
    if (nt > 4 && j->d->dtype != SMOE_WDT_I8) {
        /* bf16 / int4 keep two accumulator sets per (row, token) at every token count (see
         * NTMAX): 2 rows x 4 tokens x 2 = 16 of the 32 vector registers; 8 tokens would spill
         * (OLMoE shape, 8 tokens, 1 thread: bf16 0.47 -> 0.33 of the read ceiling) */
        float r2[4][NTMAX];
        rows_dispatch(j, off, soff, row, NR, n, t0, 4, r);
        rows_dispatch(j, off, soff, row, NR, n, t0 + 4, nt - 4, r2);
        for (int q = 0; q < NR; q++)
            for (uint32_t t = 0; t < nt - 4; t++) r[q][4 + t] = r2[q][t];
        return;
    }
    if (NR == 4) {
        rowsN(j, off, soff, row, 4, n, t0, 1, r);
        return;
    }
    if (nt == 1 && NR == 1) {
        rowsN(j, off, soff, row, 1, n, t0, 1, r);
        return;
    }
    switch (nt) {
    case 1: rowsN(j, off, soff, row, 2, n, t0, 1, r); break;
    case 2: rowsN(j, off, soff, row, 2, n, t0, 2, r); break;
    case 3: rowsN(j, off, soff, row, 2, n, t0, 3, r); break;
    case 4: rowsN(j, off, soff, row, 2, n, t0, 4, r); break;
    case 5: rowsN(j, off, soff, row, 2, n, t0, 5, r); break;
    case 6: rowsN(j, off, soff, row, 2, n, t0, 6, r); break;
    case 7: rowsN(j, off, soff, row, 2, n, t0, 7, r); break;
    default: rowsN(j, off, soff, row, 2, n, t0, 8, r); break;
    }
}

/* One token, rows of at most 8192 columns (int4: 2048-16384, see one_row): one weight row at a
 * time, each matrix's rows in order, so that every thread reads one sequential stream (the gate
 * rows of a chunk of 16, then its up rows).  Rows in pairs or fours (two to four streams a
 * thread, software prefetch) measured well below that, 1 token, DRAM, interleaved with the read
 * ceiling (2026-11-25, 1 / 2 threads): linear rows 102400 x 2048 bf16 0.81 -> 1.02 / 0.85 -> 1.01,
 * int8 0.80 -> 0.85 / 0.88 -> 0.98, int4 0.83 -> 0.97 / 1.05 -> 0.96; 2048 x 1408
 * (DeepSeek-V2-Lite's expert down) bf16 0.72 -> 0.80 / 0.79 -> 0.95, int4 0.79 -> 0.91 / 0.63
 * -> 0.79; whole experts, 8 a layer, OLMoE shape bf16 0.81 -> 0.94 / 0.91 -> 1.01, DSV2-Lite
 * shape bf16 0.86 -> 0.98 / 0.87 -> 0.99, int8 / int4 within the noise (0.89-1.11 either
 * way).  Longer rows keep the pairs (gate_i, up_i) and the down projection's fours: at
 * Mixtral shape (8-28 KB bf16 rows) one row at a time lost, bf16 0.95-1.00 -> 0.77, int8
 * 0.69-0.73 -> 0.64 of the ceiling (benchmarks/expert_kernels.py, 1 thread, interleaved builds).
 * bf16 then moved to rows16_bf16 (the horizontal sums deferred to 16 rows at once), which
 * reads rows of up to 16 KB one at a time at the ceiling (C harness, 1 thread, weights on 2 MB
 * pages, 9 interleaved repeats with the read loop, 2026-11-25; before -> after): 2048 x 1408
 * 0.82 -> 1.03, 4096 x 1024 0.86 -> 0.99, 14336 x 4096 (Mixtral's gate/up, in pairs before)
 * 0.66 -> 1.06, 2048 x 7168 0.70 -> 0.90; Mixtral's down rows (28 KB: the activation no longer
 * stays in L1 beside the stream) keep the fours, 0.87 against 0.64 one at a time.  int8
 * likewise (rows16_i8, same harness): 14336 x 4096 0.70-0.74 -> 0.83-0.89, 2048 x 7168 and
 * 1024 x 8192 (fours before) 0.54-0.62 -> 0.80-0.85, 2-KB rows within the noise (int8 at 1
 * thread is near its instruction limit, ~20 GB/s here, with or without software prefetch or
 * more accumulator chains); 4096 x 14336 keeps the fours (0.60-0.63 against 0.45-0.47).
 * int4, whose unpacking makes it closer to compute-bound at 1 thread, lost with one row where
 * it had pairs/fours (OLMoE experts 0.82-0.92 -> 0.72-0.73, Mixtral 0.83-0.91 -> 0.78-0.80),
 * so it reads one row at a time only where its down/linear rows went in pairs (2048+
 * columns: the 102400 x 2048 lm_head above, 0.83 -> 0.97), up to 16384 columns (its int8
 * activation, n bytes, stays in L1 beside the stream): Mixtral's expert down (14336) and
 * DeepSeek-V2-Lite's dense down (10944, groups of 64), which went in pairs, read 0.87-0.91 ->
 * 0.96-1.06 and 0.78-0.88 -> 0.92-0.99 of the read loop (C harness calling fast_down, 1 thread,
 * DRAM, 4 KB pages, best of 24-48, 3 interleaved runs each, 2026-11-26); expert_kernels.py's int4
 * Mixtral expert at 1 token, 4 alternating runs: 25.4 -> 26.9 GB/s (median), 0.82 -> 0.89 of
 * the ceiling.  Shorter rows (OLMoE's 1024, DeepSeek-V2-Lite's 1408) keep the fours: one at a
 * time read them at 0.80-0.88 against 0.92-1.0.
 * Two or more tokens: gate and up rows in pairs (gate_i, up_i), the down projection's rows in
 * pairs, a loaded weight vector feeding every token of the tile.  Rows go in chunks of 16 so
 * that the activation (exp) runs on whole vectors: per chunk, per tile of NTMAX tokens, the
 * chunk's 16 row pairs (at most 256 KB at H = 4096 bf16, re-read from L2 for further tiles),
 * then act16.  act is natural order [T, I] on this path. */
static int one_row(int32_t dtype, uint32_t n, int down) {
    if (dtype == SMOE_WDT_I4) /* see above: only the down/linear rows that went in pairs (so
                               * never gate/up: fast_gateup's one-row path is bf16/int8's) */
        return down && n >= 2048 && n <= 16384;
    /* bf16 and int8 (rows16): the activation (bf16 / int16, 2n bytes) stays in L1 beside the
     * stream up to 16 KB (see above) */
    return n <= 8192;
}

static void fast_gateup(const smoe_ffn_job *j, uint32_t i0, uint32_t i1) {
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
            if (j->T == 1 && one_row(d->dtype, d->H, 0)) { /* bf16 / int8 only (one_row) */
                rows16(j, d->gate, d->gate_scale, c0, m, d->H, g[0]);
                rows16(j, d->up, d->up_scale, c0, m, d->H, u[0]);
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

static void fast_down(const smoe_ffn_job *j, uint32_t h0, uint32_t h1) {
    const smoe_ffn_desc *d = j->d;
    float r[4][NTMAX];
    const uint64_t off[4] = {d->down, d->down, d->down, d->down};
    const uint64_t soff[4] = {d->down_scale, d->down_scale, d->down_scale, d->down_scale};
    uint32_t h = h0;
    if (j->T == 1 && one_row(d->dtype, d->I, 1)) { /* one row at a time (see fast_gateup) */
        if (d->dtype == SMOE_WDT_I4) {
            for (; h < h1; h++) {
                const uint32_t row[1] = {h};
                rows_dispatch(j, off, soff, row, 1, d->I, 0, 1, r);
                smoe_ffn_store_out(j, h, 0, r[0][0]);
            }
            return;
        }
        float y[16];
        for (; h < h1; h += 16) {
            uint32_t m = h1 - h < 16 ? h1 - h : 16;
            rows16(j, d->down, d->down_scale, h, m, d->I, y);
            for (uint32_t i = 0; i < m; i++) smoe_ffn_store_out(j, h + i, 0, y[i]);
        }
        return;
    }
    /* longer rows at 1 token: four rows at a time, except int4 rows of 2048+ columns (beyond
     * one_row's 16384) in pairs (fours measured 0.71-0.77 of the read ceiling, pairs
     * 0.84-0.86, 1 thread, 2026-11-25) */
    if (j->T == 1 && (d->dtype != SMOE_WDT_I4 || d->I < 2048))
        for (; h + 4 <= h1; h += 4) {
            const uint32_t row[4] = {h, h + 1, h + 2, h + 3};
            rows_dispatch(j, off, soff, row, 4, d->I, 0, 1, r);
            for (uint32_t q = 0; q < 4; q++) smoe_ffn_store_out(j, h + q, 0, r[q][0]);
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

const smoe_ffn_impl smoe_ffn_impl_fast = {fast_gateup, fast_down, 0};
const int smoe_ffn_fast_built = 1;

#else
#include "kimpl.h"
void smoe_fast_prepare(int32_t dtype, const float *src, size_t src_stride, const int32_t *rows,
                       uint32_t T, uint32_t n, void *q, float *qs, float *qsum) {
    (void)dtype, (void)src, (void)src_stride, (void)rows, (void)T, (void)n, (void)q, (void)qs,
        (void)qsum;
}
const smoe_ffn_impl smoe_ffn_impl_fast = {0, 0, 0};
const int smoe_ffn_fast_built = 0;
#endif

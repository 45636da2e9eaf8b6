/* Expert FFNs over GGUF block weights kept as the file holds them (SMOE_WDT_Q8_0 / Q4_K / Q6_K /
 * Q4_0 / Q5_K / IQ4_XS / Q4_1 / Q2_K / Q3_K / MXFP4, layouts in kernels.h; ggml's block_q8_0,
 * block_q4_K, block_q6_K, block_q4_0, block_q5_K, block_iq4_xs, block_q4_1, block_q2_K,
 * block_q3_K and block_mxfp4).
 *
 * Two paths, chosen per call by ffn.c:
 *   exact  (desc.precise = 1, or a CPU without AVX2): each block is widened to f32 exactly as
 *          ggml's dequantize_row_* widens it (d * sc as one f32 product, then times q, minus
 *          dmin * m), and dotted in f32 with the f32 input: the result is an f32 matmul on the
 *          dequantized weights, to f32 rounding.
 *   fast   (AVX2, precise = 0): llama.cpp's scheme (its Q8_0 x Q8_0, Q4_K x Q8_K and
 *          Q6_K x Q8_K dot products) -- the input (x in phase 1, the activation in phase 2) is
 *          quantized once per call to int8 with one scale max|x| / 127 per 32 columns for a
 *          Q8_0, Q4_0, Q4_1 or MXFP4 matrix, per 256 for a K-quant one (round to nearest even), and
 *          each block's products are summed exactly in integers with vpmaddubsw / vpmaddwd:
 *            Q8_0  |w| as the unsigned operand, x with w's sign (vpsignb): pairs at most
 *                  2 * 128 * 127 = 32512 < 2^15; times d_w * s_x per 32 columns in f32.
 *            Q4_0  the nibbles unpacked to q - 8 in [-8, 7], then as Q8_0 (llama.cpp's
 *                  Q4_0 x Q8_0).
 *            MXFP4 the nibbles looked up in the doubled E2M1 table (vpshufb) as int8 in
 *                  [-12, 12], then as Q8_0 with d_w = 2^(e - 128), exact in f32 (llama.cpp's
 *                  MXFP4 x Q8_0).
 *            Q4_1  w = d * q + m with q in [0, 15] the unsigned operand (pairs <= 3810):
 *                  d * s_x * sum q x + m * s_x * (the prepared sum of the 32 int8 x)
 *                  (llama.cpp's Q4_1 x Q8_1).
 *            Q4_K  the nibbles q in [0, 15] as the unsigned operand (pairs <= 3810), times
 *                  the sub-block's 6-bit scale in vpmaddwd (<= 480060 a lane per 32
 *                  columns), summed over the 256 columns in int32; times d * s_x once per
 *                  super-block.  The min term dmin * s_x * sum_j m_j * (sum of the int8 x of
 *                  sub-block j) comes from the prepared per-32 sums.
 *            Q5_K  as Q4_K with the fifth bit ORed in (q in [0, 31]: pairs <= 7874, a lane
 *                  <= 992124 per 32 columns, <= 7.9e6 over the super-block) (llama.cpp's
 *                  Q5_K x Q8_K).
 *            IQ4_XS the nibbles looked up in the table kv (vpshufb) as int8 in [-127, 113],
 *                  then as Q8_0 (|w| unsigned, x with w's sign: pairs <= 32258), times the
 *                  sub-block's scale ls - 32 in [-32, 31] in vpmaddwd (<= 2.1e6 a lane),
 *                  summed over the 256 columns in int32; times d * s_x once per super-block
 *                  (llama.cpp's IQ4_XS x Q8_K).
 *            Q2_K  q in [0, 3] unsigned (pairs <= 762), times the 4-bit scale of its 16
 *                  columns in vpmaddwd (<= 22860 a lane per 32 columns), summed over the 256
 *                  columns in int32; times d * s_x once per super-block.  The min term
 *                  dmin * s_x * sum_j m_j * (sum of the int8 x of sub-block j of 16) comes
 *                  from the prepared per-16 sums (llama.cpp's Q2_K x Q8_K).
 *            Q3_K  u = q + 4 * hbit in [0, 7] unsigned (pairs <= 1778), times the signed
 *                  6-bit scale (sc - 32) of its 16 columns in vpmaddwd, summed in int32; the
 *                  offset (w = sc * (u - 4)) is 4 * sum_j sc_j * (sum of x of sub-block j),
 *                  one vpmaddwd of the scales against the prepared per-16 sums, subtracted
 *                  in int32 (llama.cpp's Q3_K x Q8_K).
 *            Q6_K  q in [0, 63] unsigned (pairs <= 16002), minus a second vpmaddubsw of 32
 *                  against x (so (q - 32) x exactly, |pair| <= 8128), times the int8 scale of
 *                  its 16 columns in vpmaddwd, summed over the 256 columns in int32
 *                  (<= 16.6e6); times d * s_x once per super-block.
 *          The rounding is that of the int8 input alone: on random weights the FFN output is
 *          ~1e-2 from the f32 result in norm (small next to 4-6 bit weights' own error), and
 *          within ~3e-7 of a numpy model of this arithmetic (tests/test_gguf_blocks.py).
 *          One pass over a row's blocks serves up to 4 tokens (the unpacked nibbles and
 *          scales reused).
 *   vnni   (AVX512_VNNI, precise = 0): the fast form, with Q4_0, MXFP4, Q8_0 and IQ4_XS
 *          through vpdpbusd and Q4_K, Q5_K and Q6_K through 512-bit vpmaddubsw / vpdpwssd (the
 *          same integer sums; below, before impl_vnni).
 *
 * Scratch (ffn.c's layout): the prepared input q [T, n] int8, its scales qs [T, n/32] (Q8_0,
 * Q4_0, Q4_1) or [T, n/256] (K-quants) and, in qsum's bytes, the int16 sums of every 32 int8
 * values [T, n/32] (of every 16, [T, n/16], before a Q2_K or Q3_K matrix, whose scales are per
 * 16). */
#include <math.h>
#include <string.h>

#include "kimpl.h"

/* Columns per prepared input sum: 16 before the formats with a scale per 16 columns. */
static inline uint32_t smoe_blocks_sum_cols(int32_t dt) {
    return dt == SMOE_WDT_Q2_K || dt == SMOE_WDT_Q3_K ? 16u : 32u;
}

/* IEEE half to float, exact (subnormals, infinities and NaN included). */
static float f16_to_f32(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1Fu, m = h & 0x3FFu, bits;
    if (e == 0x1F) {
        bits = sign | 0x7F800000u | (m << 13);
    } else if (e) {
        bits = sign | ((e + 112u) << 23) | (m << 13);
    } else if (m) { /* subnormal: m * 2^-24 */
        float v = (float)m * 5.9604644775390625e-8f;
        return sign ? -v : v;
    } else {
        bits = sign;
    }
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

static float rd_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return f16_to_f32(h);
}

/* ggml's get_scale_min_k4: the 6-bit scale and min of sub-block j (0..7) of a Q4_K block. */
static inline void q4k_scale_min(const uint8_t *s, uint32_t j, uint8_t *sc, uint8_t *m) {
    if (j < 4) {
        *sc = s[j] & 63u;
        *m = s[j + 4] & 63u;
    } else {
        *sc = (uint8_t)((s[j + 4] & 0xFu) | ((s[j - 4] >> 6) << 4));
        *m = (uint8_t)((s[j + 4] >> 4) | ((s[j] >> 6) << 4));
    }
}

/* The FP4 (E2M1) values doubled, ggml's kvalues_mxfp4; the block's scale is halved to match. */
static const int8_t mxfp4_values[16] = {0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12};

/* ggml_e8m0_to_fp32_half: 2^(e - 128) as an f32 (e < 2: the subnormals 2^-128 and 2^-127). */
static inline float e8m0_half(uint8_t e) {
    const uint32_t bits = e < 2 ? 0x00200000u << e : (uint32_t)(e - 1) << 23;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* ggml's kvalues_iq4nl: the 16 values an IQ4_XS nibble stands for. */
static const int8_t iq4nl_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10,
                                        1,    13,   25,  38,  53,  69,  89,  113};

/* The 6-bit scale of sub-block j (0..7) of an IQ4_XS block b, minus 32. */
static inline int iq4xs_scale(const uint8_t *b, uint32_t j) {
    const uint32_t h = (uint32_t)b[2] | ((uint32_t)b[3] << 8);
    return (int)(((b[4 + j / 2] >> (4 * (j % 2))) & 0xFu) | (((h >> (2 * j)) & 3u) << 4)) - 32;
}

/* Q3_K's twelve scale bytes as its sixteen signed 6-bit scales (sc - 32): the low nibbles of
 * bytes 0..7 (sub-blocks 0..7), their high nibbles (8..15), and the top two bits of sub-block
 * i at bits 2 * (i / 4) of byte 8 + i % 4 (ggml's dequantize_row_q3_K). */
static inline void q3k_scales(const uint8_t *s12, int8_t out[16]) {
    for (uint32_t i = 0; i < 16; i++) {
        const uint32_t lo = i < 8 ? (s12[i] & 0xFu) : (uint32_t)(s12[i - 8] >> 4);
        const uint32_t hi = (s12[8 + i % 4] >> (2 * (i / 4))) & 3u;
        out[i] = (int8_t)((int)(lo | (hi << 4)) - 32);
    }
}

/* One block of `dt` widened to f32 into y (32 or 256 values), as ggml widens it. */
static void widen_block(int32_t dt, const uint8_t *b, float *y) {
    if (dt == SMOE_WDT_Q4_0) {
        const float d = rd_f16(b);
        for (uint32_t l = 0; l < 16; l++) {
            y[l] = d * (float)((int)(b[2 + l] & 0xFu) - 8);
            y[l + 16] = d * (float)((int)(b[2 + l] >> 4) - 8);
        }
    } else if (dt == SMOE_WDT_Q2_K || dt == SMOE_WDT_Q3_K) {
        /* 2-bit values of column 128h + 32j + l at bits 2j of qs[32h + l]; Q3_K: minus 4
         * where bit 4h + j of hmask[l] is clear; one scale per 16 columns */
        const int three = dt == SMOE_WDT_Q3_K;
        const uint8_t *qs = b + (three ? 32 : 16);
        int8_t sc3[16];
        if (three) q3k_scales(b + 96, sc3);
        const float d = rd_f16(b + (three ? 108 : 80)), dmin = three ? 0.0f : rd_f16(b + 82);
        for (uint32_t h = 0; h < 2; h++)
            for (uint32_t j = 0; j < 4; j++)
                for (uint32_t half = 0; half < 2; half++) {
                    const uint32_t sb = 8 * h + 2 * j + half, c0 = 128 * h + 32 * j + 16 * half;
                    const float dl = three ? d * (float)sc3[sb] : d * (float)(b[sb] & 0xFu);
                    const float ml = three ? 0.0f : dmin * (float)(b[sb] >> 4);
                    for (uint32_t l = 16 * half; l < 16 * half + 16; l++) {
                        int q = (qs[32 * h + l] >> (2 * j)) & 3;
                        if (three && !((b[l] >> (4 * h + j)) & 1u)) q -= 4;
                        y[c0 + l - 16 * half] = three ? dl * (float)q : dl * (float)q - ml;
                    }
                }
    } else if (dt == SMOE_WDT_Q4_1) { /* ggml's dequantize_row_q4_1: q * d + m */
        const float d = rd_f16(b), m = rd_f16(b + 2);
        for (uint32_t l = 0; l < 16; l++) {
            y[l] = (float)(b[4 + l] & 0xFu) * d + m;
            y[l + 16] = (float)(b[4 + l] >> 4) * d + m;
        }
    } else if (dt == SMOE_WDT_MXFP4) { /* ggml's dequantize_row_mxfp4 */
        const float d = e8m0_half(b[0]);
        for (uint32_t l = 0; l < 16; l++) {
            y[l] = d * (float)mxfp4_values[b[1 + l] & 0xFu];
            y[l + 16] = d * (float)mxfp4_values[b[1 + l] >> 4];
        }
    } else if (dt == SMOE_WDT_Q8_0) {
        const float d = rd_f16(b);
        const int8_t *q = (const int8_t *)(b + 2);
        for (uint32_t l = 0; l < 32; l++) y[l] = d * (float)q[l];
    } else if (dt == SMOE_WDT_Q4_K || dt == SMOE_WDT_Q5_K) {
        /* Q5_K: qh[l] bit j is the fifth bit of column l of sub-block j */
        const int five = dt == SMOE_WDT_Q5_K;
        const float d = rd_f16(b), dmin = rd_f16(b + 2);
        const uint8_t *q = b + (five ? 48 : 16), *qh = b + 16;
        for (uint32_t j = 0; j < 8; j += 2, q += 32, y += 64) {
            uint8_t sc, m;
            q4k_scale_min(b + 4, j, &sc, &m);
            const float d1 = d * sc, m1 = dmin * m;
            q4k_scale_min(b + 4, j + 1, &sc, &m);
            const float d2 = d * sc, m2 = dmin * m;
            for (uint32_t l = 0; l < 32; l++) {
                const uint32_t h1 = five ? ((qh[l] >> j) & 1u) << 4 : 0u;
                const uint32_t h2 = five ? ((qh[l] >> (j + 1)) & 1u) << 4 : 0u;
                y[l] = d1 * (float)((q[l] & 0xFu) | h1) - m1;
                y[32 + l] = d2 * (float)((q[l] >> 4) | h2) - m2;
            }
        }
    } else if (dt == SMOE_WDT_IQ4_XS) {
        const float d = rd_f16(b);
        const uint8_t *qs = b + 8;
        for (uint32_t j = 0; j < 8; j++, qs += 16, y += 32) {
            const float dl = d * (float)iq4xs_scale(b, j);
            for (uint32_t l = 0; l < 16; l++) {
                y[l] = dl * (float)iq4nl_values[qs[l] & 0xFu];
                y[l + 16] = dl * (float)iq4nl_values[qs[l] >> 4];
            }
        }
    } else { /* Q6_K */
        const uint8_t *ql = b, *qh = b + 128;
        const int8_t *sc = (const int8_t *)(b + 192);
        const float d = rd_f16(b + 208);
        for (uint32_t n = 0; n < 256; n += 128, ql += 64, qh += 32, sc += 8, y += 128)
            for (uint32_t l = 0; l < 32; l++) {
                const uint32_t is = l / 16;
                const int q1 = (int)((ql[l] & 0xFu) | ((qh[l] & 3u) << 4)) - 32;
                const int q2 = (int)((ql[l + 32] & 0xFu) | (((qh[l] >> 2) & 3u) << 4)) - 32;
                const int q3 = (int)((ql[l] >> 4) | (((qh[l] >> 4) & 3u) << 4)) - 32;
                const int q4 = (int)((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3u) << 4)) - 32;
                y[l] = d * (float)sc[is] * (float)q1;
                y[l + 32] = d * (float)sc[is + 2] * (float)q2;
                y[l + 64] = d * (float)sc[is + 4] * (float)q3;
                y[l + 96] = d * (float)sc[is + 6] * (float)q4;
            }
    }
}

/* Row w (n columns of dt blocks) . x in f32 on the widened weights. */
static float dot_exact(int32_t dt, const uint8_t *w, const float *x, uint32_t n) {
    const uint32_t bc = smoe_wdt_block_cols(dt), bb = smoe_wdt_block_bytes(dt);
    float y[256], acc = 0.0f;
    for (uint32_t c = 0; c < n; c += bc, w += bb) {
        widen_block(dt, w, y);
        float s = 0.0f;
        for (uint32_t l = 0; l < bc; l++) s += y[l] * x[c + l];
        acc += s;
    }
    return acc;
}

static size_t row_bytes(int32_t dt, uint32_t cols) {
    return (size_t)(cols / smoe_wdt_block_cols(dt)) * smoe_wdt_block_bytes(dt);
}

static void gateup_exact(const smoe_ffn_job *j, uint32_t i0, uint32_t i1) {
    const smoe_ffn_desc *d = j->d;
    const uint32_t H = d->H;
    const size_t rb = row_bytes(d->dtype, H);
    const uint8_t *gw = j->block + d->gate, *uw = j->block + d->up;
    for (uint32_t i = i0; i < i1; i++)
        for (uint32_t t = 0; t < j->T; t++) {
            const float *x = j->xs + (size_t)t * H;
            smoe_ffn_store_act(j, i, t, dot_exact(d->dtype, gw + i * rb, x, H),
                               dot_exact(d->dtype, uw + i * rb, x, H));
        }
}

static void down_exact(const smoe_ffn_job *j, uint32_t h0, uint32_t h1) {
    const smoe_ffn_desc *d = j->d;
    const int32_t dt = smoe_ffn_down_dtype(d);
    const uint32_t I = d->I;
    const size_t rb = row_bytes(dt, I);
    const uint8_t *dw = j->block + d->down;
    for (uint32_t h = h0; h < h1; h++)
        for (uint32_t t = 0; t < j->T; t++)
            smoe_ffn_store_out(j, h, t, dot_exact(dt, dw + h * rb, j->act + (size_t)t * I, I));
}

static const smoe_ffn_impl impl_exact = {gateup_exact, down_exact, NULL};

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
#include <immintrin.h>

#define AI static inline __attribute__((always_inline))
#define TILE 4 /* tokens per pass over a row's blocks */
/* Bytes ahead of the row position that the one-token loops prefetch to L1: without it a
 * Q4_K row pair read at 11 GB/s from L3 (cache-warm, AMD EPYC Zen 3), with it 14; from DRAM
 * (benchmarks/expert_kernels.py) 0.77 of the read ceiling. */
#define PF_AHEAD 1024

AI float hsum8(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

AI float hsum4(__m128 s) {
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    s = _mm_add_ss(s, _mm_movehdup_ps(s));
    return _mm_cvtss_f32(s);
}

AI float ld_f16(const uint8_t *p) {
    uint16_t h;
    memcpy(&h, p, 2);
    return _cvtsh_ss(h);
}

/* The prepared input of token t of a matrix of `dt` with n columns (layout at prepare_avx2). */
typedef struct xin {
    const int8_t *q;   /* [n] int8 */
    const float *s;    /* Q8_0, Q4_0, Q4_1: [n/32] scales; K-quants: [n/256] */
    const int16_t *bs; /* K-quants, Q4_1, Q4_0, MXFP4: [n/32] sums of the int8 values per 32
                        * columns (Q2_K, Q3_K: [n/16] per 16) */
    uint32_t pairs;    /* q in pair order (pair_order; the rows of Q4_0, MXFP4, Q4_1 and
                        * IQ4_XS) */
} xin;

AI xin xin_of(const smoe_ffn_job *j, int32_t dt, uint32_t t, uint32_t n) {
    xin r;
    const uint32_t ns = smoe_wdt_block_cols(dt) == 32 ? n / 32 : n / 256;
    r.q = (const int8_t *)j->q + (size_t)t * n;
    r.s = j->qs + (size_t)t * ns;
    r.bs = (const int16_t *)j->qsum + (size_t)t * (n / smoe_blocks_sum_cols(dt));
    r.pairs = j->qpairs;
    return r;
}

/* ---- Q8_0, Q4_0 and MXFP4: one scale per 32 columns on both sides ---- */

/* The 32 weights of a Q8_0, Q4_0 or MXFP4 block as int8 lanes in column order (Q4_0 and
 * MXFP4: the low nibbles are columns 0..15, in the low lane, the high nibbles 16..31; Q4_0
 * q - 8, MXFP4 the table's value). */
AI __m256i q32_of(int32_t dt, const uint8_t *w) {
    if (dt == SMOE_WDT_Q8_0) return _mm256_loadu_si256((const __m256i *)(w + 2));
    const __m128i m4 = _mm_set1_epi8(0x0F);
    const __m128i v = _mm_loadu_si128((const __m128i *)(w + (dt == SMOE_WDT_MXFP4 ? 1 : 2)));
    const __m128i lo = _mm_and_si128(v, m4), hi = _mm_and_si128(_mm_srli_epi16(v, 4), m4);
    if (dt == SMOE_WDT_MXFP4) {
        const __m128i kv = _mm_loadu_si128((const __m128i *)(const void *)mxfp4_values);
        return _mm256_set_m128i(_mm_shuffle_epi8(kv, hi), _mm_shuffle_epi8(kv, lo));
    }
    return _mm256_sub_epi8(_mm256_set_m128i(hi, lo), _mm256_set1_epi8(8));
}

/* The scale of a Q8_0 / Q4_0 block (f16) or an MXFP4 one (E8M0, halved). */
AI float b32_scale(int32_t dt, const uint8_t *w) {
    return dt == SMOE_WDT_MXFP4 ? e8m0_half(w[0]) : ld_f16(w);
}

/* The block's 32 products with the prepared input xq, times d_w * s_x, into acc. */
AI __m256 q32_dot(__m256i wq, float d, const int8_t *xq, float xs, __m256 acc) {
    const __m256i xv = _mm256_loadu_si256((const __m256i *)xq);
    const __m256i p = _mm256_madd_epi16(
        _mm256_maddubs_epi16(_mm256_sign_epi8(wq, wq), _mm256_sign_epi8(xv, wq)),
        _mm256_set1_epi16(1));
    return _mm256_fmadd_ps(_mm256_set1_ps(d * xs), _mm256_cvtepi32_ps(p), acc);
}

/* Q8_0 / Q4_0 / MXFP4 rows (blocks of 32 columns, bb bytes) against nt tokens: each token's
 * sums in row1_b32's order (the even blocks into one accumulator, the odd ones into another,
 * added at the end), so that a token gets the bits of its one-token call (batch invariance:
 * Q8_0 serves calls of more than INVARIANT_T tokens through these tiles). */
AI void rows_b32(int32_t dt, const uint8_t *w, const xin *x, uint32_t nt, uint32_t n,
                 float *res) {
    const uint32_t nb = n / 32, bb = smoe_wdt_block_bytes(dt);
    __m256 a0[TILE], a1[TILE]; /* constant indices only: the arrays stay in registers */
    for (uint32_t t = 0; t < nt; t++) a0[t] = a1[t] = _mm256_setzero_ps();
    uint32_t b = 0;
    for (; b + 2 <= nb; b += 2, w += 2 * bb) {
        _mm_prefetch((const char *)(w + PF_AHEAD), _MM_HINT_T0);
        const __m256i w0 = q32_of(dt, w), w1 = q32_of(dt, w + bb);
        const float d0 = b32_scale(dt, w), d1 = b32_scale(dt, w + bb);
        for (uint32_t t = 0; t < nt; t++) {
            a0[t] = q32_dot(w0, d0, x[t].q + 32 * b, x[t].s[b], a0[t]);
            a1[t] = q32_dot(w1, d1, x[t].q + 32 * b + 32, x[t].s[b + 1], a1[t]);
        }
    }
    if (b < nb) {
        const __m256i w0 = q32_of(dt, w);
        const float d0 = b32_scale(dt, w);
        for (uint32_t t = 0; t < nt; t++)
            a0[t] = q32_dot(w0, d0, x[t].q + 32 * b, x[t].s[b], a0[t]);
    }
    for (uint32_t t = 0; t < nt; t++) res[t] = hsum8(_mm256_add_ps(a0[t], a1[t]));
}

/* rows_b32 for one token (Q8_0; Q4_0 and MXFP4 take rows_b4x8 below): two blocks per step
 * into two accumulators (the fma chain, the f16 conversions and the unpacking of one block
 * overlap the other's). */
AI float row1_b32(int32_t dt, const uint8_t *w, const xin *x, uint32_t n) {
    const uint32_t nb = n / 32, bb = smoe_wdt_block_bytes(dt);
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    uint32_t b = 0;
    for (; b + 2 <= nb; b += 2, w += 2 * bb) {
        _mm_prefetch((const char *)(w + PF_AHEAD), _MM_HINT_T0);
        a0 = q32_dot(q32_of(dt, w), b32_scale(dt, w), x->q + 32 * b, x->s[b], a0);
        a1 = q32_dot(q32_of(dt, w + bb), b32_scale(dt, w + bb), x->q + 32 * b + 32,
                     x->s[b + 1], a1);
    }
    if (b < nb) a0 = q32_dot(q32_of(dt, w), b32_scale(dt, w), x->q + 32 * b, x->s[b], a0);
    return hsum8(_mm256_add_ps(a0, a1));
}

/* Q4_0 or MXFP4 (4-bit values, blocks of bb = 18 / 17 bytes) at one token, two blocks per
 * 256-bit step: the two blocks' 16 bytes of nibbles in the two 128-bit lanes, so one and /
 * shift / and (and for MXFP4 one vpshufb per nibble half) serve both; the input's matching
 * columns, [block 0 columns 0-15 | block 1 columns 0-15] and the same for 16-31, are two
 * loads of the prepared int8 x in pair order (pair_order; two vperm2i128 per step before);
 * the lo and hi products' pairs (|w| <= 12: <= 3048 each) summed in int16, one vpmaddwd, one
 * conversion and one FMA with [d0 s0 x 4 | d1 s1 x 4] for the two blocks.  The same integer
 * sums as q32_dot per block (exact), summed in f32 in another order.  Against row1_b32 (one
 * block per step), AMD EPYC Zen 4 forced to this path, 1 thread, 3 interleaved A/B rounds of
 * benchmarks/expert_kernels.py (OLMoE / DeepSeek-V2-Lite expert shapes): MXFP4 0.327 / 0.441 ->
 * 0.284 / 0.383 ms an expert, Q4_0 0.315 / 0.424 -> 0.279 / 0.376 (1.13-1.15x); still bound
 * by the per-block unpacking and scaling.  Now the blocks b .. nb - 1 after rows_b4x8's steps
 * of eight. */
AI float row1_b4x2(int32_t dt, const uint8_t *w, const xin *x, uint32_t b, uint32_t n) {
    const uint32_t nb = n / 32, bb = smoe_wdt_block_bytes(dt), o = bb - 16;
    const __m256i m4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const __m256i kv = _mm256_broadcastsi128_si256(
        _mm_loadu_si128((const __m128i *)(const void *)mxfp4_values));
    const __m256i sel = _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1);
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    w += (size_t)b * bb;
    for (; b + 2 <= nb; b += 2, w += 2 * bb) {
        _mm_prefetch((const char *)(w + PF_AHEAD), _MM_HINT_T0);
        const __m256i v = _mm256_inserti128_si256(
            _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)(w + o))),
            _mm_loadu_si128((const __m128i *)(w + bb + o)), 1);
        __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
        if (dt == SMOE_WDT_MXFP4) {
            lo = _mm256_shuffle_epi8(kv, lo);
            hi = _mm256_shuffle_epi8(kv, hi);
        } else {
            lo = _mm256_sub_epi8(lo, _mm256_set1_epi8(8));
            hi = _mm256_sub_epi8(hi, _mm256_set1_epi8(8));
        }
        /* pair order: [block 0 columns 0-15 | block 1 columns 0-15], then 16-31 */
        const __m256i xl = _mm256_loadu_si256((const __m256i *)(x->q + 32 * b));
        const __m256i xh = _mm256_loadu_si256((const __m256i *)(x->q + 32 * b + 32));
        const __m256i p = _mm256_add_epi16(
            _mm256_maddubs_epi16(_mm256_sign_epi8(lo, lo), _mm256_sign_epi8(xl, lo)),
            _mm256_maddubs_epi16(_mm256_sign_epi8(hi, hi), _mm256_sign_epi8(xh, hi)));
        const __m128 d2 = _mm_mul_ps(_mm_setr_ps(b32_scale(dt, w), b32_scale(dt, w + bb), 0, 0),
                                     _mm_castpd_ps(_mm_load_sd((const double *)(x->s + b))));
        const __m256 sc = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(d2), sel);
        const __m256 f = _mm256_cvtepi32_ps(_mm256_madd_epi16(p, ones));
        if (b & 2)
            a1 = _mm256_fmadd_ps(sc, f, a1);
        else
            a0 = _mm256_fmadd_ps(sc, f, a0);
    }
    if (b < nb) a0 = q32_dot(q32_of(dt, w), b32_scale(dt, w), x->q + 32 * b, x->s[b], a0);
    return hsum8(_mm256_add_ps(a0, a1));
}

/* The doubled E2M1 values (mxfp4_values) plus 12: an MXFP4 nibble's u in [0, 24], w = u - 12. */
static const int8_t mxfp4_values12[16] = {12, 13, 14, 15, 16, 18, 20, 24,
                                          12, 11, 10, 9,  8,  6,  4,  0};

/* The eight f16 at w, w + bb, ..., w + 7 bb (the scales of eight blocks) widened exactly;
 * gathered into two 64-bit integers with scalar loads and shifts (the asm keeps GCC from
 * vectorising them into a dozen shuffles on the vector ports the block rows are short of). */
AI __m256 f16x8(const uint8_t *w, uint32_t bb) {
    uint64_t h[2] = {0, 0};
    for (int i = 0; i < 8; i++) {
        uint16_t v16;
        memcpy(&v16, w + (size_t)i * bb, 2);
        h[i / 4] |= (uint64_t)v16 << (16 * (i % 4));
    }
    __asm__("" : "+r"(h[0]), "+r"(h[1]));
    return _mm256_cvtph_ps(_mm_set_epi64x((long long)h[1], (long long)h[0]));
}

/* The 32 nibbles of a Q4_1 block as uint8 lanes in column order (as q32_of's Q4_0). */
AI __m256i q41_of(const uint8_t *w) {
    const __m128i m4 = _mm_set1_epi8(0x0F);
    const __m128i v = _mm_loadu_si128((const __m128i *)(w + 4));
    return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(v, 4), m4), _mm_and_si128(v, m4));
}

/* Q4_1 blocks b .. nb - 1 of row w at one token on the pair-ordered input (rows_b4x8's last
 * nb % 8 blocks): one block at a time, its 32 input columns gathered back into column order
 * (a last odd block is in column order already, pair_order). */
AI float row1_q4_1_tail(const uint8_t *w, const xin *x, uint32_t b, uint32_t n) {
    const uint32_t nb = n / 32;
    __m256 acc = _mm256_setzero_ps();
    float am = 0.0f;
    for (; b < nb; b++) {
        const uint8_t *wb = w + (size_t)b * 20;
        const __m256i wq = q41_of(wb);
        __m256i xv;
        if ((nb & 1) && b == nb - 1) {
            xv = _mm256_loadu_si256((const __m256i *)(x->q + 32 * b));
        } else {
            const int8_t *p = x->q + 32 * (b & ~1u) + 16 * (b & 1);
            xv = _mm256_set_m128i(_mm_loadu_si128((const __m128i *)(p + 32)),
                                  _mm_loadu_si128((const __m128i *)p));
        }
        const __m256 sum = _mm256_cvtepi32_ps(
            _mm256_madd_epi16(_mm256_maddubs_epi16(wq, xv), _mm256_set1_epi16(1)));
        acc = _mm256_fmadd_ps(_mm256_set1_ps(ld_f16(wb) * x->s[b]), sum, acc);
        am += ld_f16(wb + 2) * x->s[b] * (float)x->bs[b];
    }
    return hsum8(acc) + am;
}

/* Q4_0, MXFP4 or Q4_1 at nt (1 .. B4_TILE) tokens, eight blocks (256 columns) a step, the
 * 4-bit values as vpmaddubsw's unsigned operand: Q4_0's nibbles q as they are (w = q - 8),
 * MXFP4's looked up in mxfp4_values12 (w = u - 12), Q4_1's as they are (w = d q + m: the
 * m * s_x * (the block's input sum) terms in a second accumulator, eight blocks an FMA).
 * Each block's integer sum is sum w x = sum u x - c * (the prepared sum of its 32 int8 x),
 * c = 8 or 12 (Q4_1: sum u x): exact (pairs <= 2 * 24 * 127; a block's low and high nibbles'
 * pairs <= 12192 in int16).  Blocks go in pairs as in row1_b4x2 (their nibbles in the two
 * 128-bit lanes, the input's matching 16 columns loaded as they lie: the prepared input is in
 * pair order, pair_order),
 * the four pairs' int16 lanes (a block's 4 products each) folded in int16 by vphaddw, exact:
 * one fold, 8 products <= 8 * 24 * 127 = 24384; Q4_0 and Q4_1 (u <= 15) a second, 16
 * products <= 16 * 15 * 127 = 30480 < 2^15, then one vpmaddwd widens them to one int32 lane
 * a block (lanes [0 2 4 6 | 1 3 5 7], one permute back to block order; MXFP4: two vpmaddwd
 * after the first fold and a vphaddd); then one offset, one conversion and
 * one FMA with the eight blocks' d_w * s_x, the eight scales (f16, or E8M0 halved) read into
 * one vector.  row1_b4x2 spends per pair four vpsignb, two subtractions (or lookups), a
 * conversion, an FMA and two scalar scale reads; this form about 60 % of its vector
 * instructions.  The same integer sums per block as q32_dot (exact), summed in f32 in another
 * order; a row's last nb % 8 blocks go through row1_b4x2 (Q4_1: row1_q4_1_tail).  Q4_1
 * against row1_q4_1 (two blocks a step, the input in block order), Zen 2 EPYC, 1 thread, 3
 * interleaved A/B rounds: 0.56 -> 0.35 ms an expert (OLMoE), 0.77 -> 0.50 (DeepSeek-V2-Lite).
 * Each step's nibbles (and MXFP4's lookups) and scales are decoded once for the nt tokens of
 * the pass, and each token's sums are its one-token call's (the same exact integer sums per
 * block, then the same f32 FMAs in the same order: batch invariance, INVARIANT_T).  Against
 * one token a pass, DeepSeek-V2-Lite's expert shape, one thread, AMD EPYC Zen 1,
 * benchmarks/expert_kernels.py, interleaved rounds: at 48 tokens a call (3 rounds) Q4_0
 * 0.96-0.98 of the time, Q4_1 0.91-0.93, MXFP4 0.86-0.89; at 8 and 2 tokens 0.88-0.97 in
 * most rounds (docs/performance.md has them all); one token the same code.  Four tokens a
 * pass spill the ymm registers: 1.04-1.11 of two's. */
#define B4_TILE 2
AI void rows_b4x8(int32_t dt, const uint8_t *w, const xin *x, uint32_t nt, uint32_t n,
                  float *res) {
    const uint32_t nb = n / 32, bb = smoe_wdt_block_bytes(dt), o = bb - 16;
    const int mx = dt == SMOE_WDT_MXFP4, q41 = dt == SMOE_WDT_Q4_1;
    const __m256i m4 = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
    const __m256i kv = _mm256_broadcastsi128_si256(
        _mm_loadu_si128((const __m128i *)(const void *)mxfp4_values12));
    const __m256i c = _mm256_set1_epi32(mx ? 12 : 8);
    const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    const uint8_t *w0 = w;
    __m256 acc[B4_TILE], am[B4_TILE]; /* constant indices only: the arrays stay in registers */
    for (uint32_t t = 0; t < nt; t++) acc[t] = am[t] = _mm256_setzero_ps();
    uint32_t b = 0;
    for (; b + 8 <= nb; b += 8, w += 8 * bb) {
        _mm_prefetch((const char *)(w + PF_AHEAD), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + PF_AHEAD + 64), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + PF_AHEAD + 128), _MM_HINT_T0);
        __m256i h[B4_TILE], m[B4_TILE]; /* h: blocks 0-3's pair sums, m: 4-7's, hadd-folded */
        for (int k = 0; k < 4; k++) {
            const uint8_t *wk = w + (size_t)(2 * k) * bb + o;
            const __m256i v = _mm256_inserti128_si256(
                _mm256_castsi128_si256(_mm_loadu_si128((const __m128i *)wk)),
                _mm_loadu_si128((const __m128i *)(wk + bb)), 1);
            __m256i lo = _mm256_and_si256(v, m4);
            __m256i hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            if (mx) {
                lo = _mm256_shuffle_epi8(kv, lo);
                hi = _mm256_shuffle_epi8(kv, hi);
            }
            for (uint32_t t = 0; t < nt; t++) {
                /* pair order: [block 0 columns 0-15 | block 1 columns 0-15], then 16-31 */
                const int8_t *xq = x[t].q + 32 * (b + 2 * k);
                const __m256i xl = _mm256_loadu_si256((const __m256i *)xq);
                const __m256i xh = _mm256_loadu_si256((const __m256i *)(xq + 32));
                /* int16 lanes: a block's four products (<= 4 * 24 * 127 = 12192) */
                const __m256i p =
                    _mm256_add_epi16(_mm256_maddubs_epi16(lo, xl), _mm256_maddubs_epi16(hi, xh));
                if (k == 0 || k == 2) {
                    m[t] = p;
                } else if (k == 1) { /* low lane [b0 x4, b2 x4], high [b1 x4, b3 x4] */
                    h[t] = _mm256_hadd_epi16(m[t], p);
                } else if (mx) { /* a third fold could pass 2^15: widen both halves first */
                    h[t] = _mm256_hadd_epi32(_mm256_madd_epi16(h[t], ones),
                                             _mm256_madd_epi16(_mm256_hadd_epi16(m[t], p), ones));
                } else { /* u <= 15: 16 products <= 30480 in int16, widened once */
                    h[t] = _mm256_madd_epi16(
                        _mm256_hadd_epi16(h[t], _mm256_hadd_epi16(m[t], p)), ones);
                }
            }
        }
        __m256 d;
        if (mx) { /* e8m0_half in lanes: (e - 1) << 23, or 0x00200000 << e for e < 2 */
            uint64_t e = 0;
            for (int i = 0; i < 8; i++) e |= (uint64_t)w[(size_t)i * bb] << (8 * i);
            __asm__("" : "+r"(e)); /* built in integer registers (see f16x8) */
            const __m256i ev = _mm256_cvtepu8_epi32(_mm_cvtsi64_si128((long long)e));
            const __m256i big = _mm256_slli_epi32(_mm256_sub_epi32(ev, _mm256_set1_epi32(1)), 23);
            const __m256i sub = _mm256_sllv_epi32(_mm256_set1_epi32(0x00200000), ev);
            d = _mm256_castsi256_ps(
                _mm256_blendv_epi8(big, sub, _mm256_cmpgt_epi32(_mm256_set1_epi32(2), ev)));
        } else { /* the eight f16 d's */
            d = f16x8(w, bb);
        }
        const __m256 dm = q41 ? f16x8(w + 2, bb) : d; /* Q4_1's eight offsets m */
        for (uint32_t t = 0; t < nt; t++) {
            const __m256i s = _mm256_permutevar8x32_epi32(h[t], order);
            const __m256i xsum =
                _mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i *)(x[t].bs + b)));
            const __m256 xs = _mm256_loadu_ps(x[t].s + b);
            const __m256i sd = q41 ? s : _mm256_sub_epi32(s, _mm256_mullo_epi32(xsum, c));
            acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sd), _mm256_mul_ps(d, xs), acc[t]);
            if (q41) /* the offset term m * s_x * (sum of the block's int8 x) */
                am[t] = _mm256_fmadd_ps(_mm256_mul_ps(dm, xs), _mm256_cvtepi32_ps(xsum), am[t]);
        }
    }
    for (uint32_t t = 0; t < nt; t++) {
        if (q41)
            res[t] = hsum8(acc[t]) + hsum8(am[t]) +
                     (b < nb ? row1_q4_1_tail(w0, x + t, b, n) : 0.0f);
        else
            res[t] = b < nb ? hsum8(acc[t]) + row1_b4x2(dt, w0, x + t, b, n) : hsum8(acc[t]);
    }
}

/* rows_b4x8 over nt tokens, B4_TILE a pass (inlined where dt is a constant, so that each
 * format gets its own loop) */
AI void rows_b4(int32_t dt, const uint8_t *w, const xin *x, uint32_t nt, uint32_t n,
                float *res) {
    for (uint32_t t = 0; t < nt; t += B4_TILE)
        rows_b4x8(dt, w, x + t, nt - t < B4_TILE ? nt - t : B4_TILE, n, res + t);
}

/* ---- Q4_1: a scale and an offset per 32 columns ---- */

/* The block's sum of q * x as 8 int32 lanes in f32 (q unsigned, x the prepared int8). */
AI __m256 q41_sum(__m256i wq, const int8_t *xq) {
    const __m256i xv = _mm256_loadu_si256((const __m256i *)xq);
    return _mm256_cvtepi32_ps(
        _mm256_madd_epi16(_mm256_maddubs_epi16(wq, xv), _mm256_set1_epi16(1)));
}

/* Q4_1 at one token, two blocks per step into two accumulators (as row1_b32), on the
 * input in block order (the AVX-512 VNNI form's calls, whose input is not in pair order; the
 * AVX2 form's take rows_b4x8). */
AI float row1_q4_1(const uint8_t *w, const xin *x, uint32_t n) {
    const uint32_t nb = n / 32;
    __m256 a0 = _mm256_setzero_ps(), a1 = _mm256_setzero_ps();
    float am = 0.0f;
    uint32_t b = 0;
    for (; b + 2 <= nb; b += 2, w += 40) {
        _mm_prefetch((const char *)(w + PF_AHEAD), _MM_HINT_T0);
        const float s0 = x->s[b], s1 = x->s[b + 1];
        a0 = _mm256_fmadd_ps(_mm256_set1_ps(ld_f16(w) * s0), q41_sum(q41_of(w), x->q + 32 * b),
                             a0);
        a1 = _mm256_fmadd_ps(_mm256_set1_ps(ld_f16(w + 20) * s1),
                             q41_sum(q41_of(w + 20), x->q + 32 * b + 32), a1);
        am += ld_f16(w + 2) * s0 * (float)x->bs[b] + ld_f16(w + 22) * s1 * (float)x->bs[b + 1];
    }
    if (b < nb) {
        const float s0 = x->s[b];
        a0 = _mm256_fmadd_ps(_mm256_set1_ps(ld_f16(w) * s0), q41_sum(q41_of(w), x->q + 32 * b),
                             a0);
        am += ld_f16(w + 2) * s0 * (float)x->bs[b];
    }
    return hsum8(_mm256_add_ps(a0, a1)) + am;
}

/* ---- Q4_K: one input scale per 256 columns, integer sums across the 8 sub-blocks ---- */

/* ggml's 12 scale bytes -> u[0..1]: the 8 six-bit scales, u[2..3]: the 8 six-bit mins, one
 * byte each (the unpacking of get_scale_min_k4, four lanes at a time).  The AVX2 rows' form
 * (the vector one below measured no faster there: Zen 5 forced to AVX2, 0.95-1.03x). */
AI void q4k_unpack(const uint8_t *s12, uint32_t u[4]) {
    const uint32_t k1 = 0x3f3f3f3fu, k2 = 0x0f0f0f0fu, k3 = 0x03030303u;
    memcpy(u, s12, 12);
    u[3] = ((u[2] >> 4) & k2) | (((u[1] >> 6) & k3) << 4);
    const uint32_t m03 = u[1] & k1;
    u[1] = (u[2] & k2) | (((u[0] >> 6) & k3) << 4);
    u[2] = m03;
    u[0] &= k1;
}

/* ggml's 12 scale bytes at s12 as words u0..u3 of a vector register: u0, u1 the 8 six-bit
 * scales, u2, u3 the 8 six-bit mins, one byte each (get_scale_min_k4 four lanes at a time:
 * with the bytes as words w0 w1 w2, u0 = w0 & 0x3f.., u1 = (w2 & 0x0f..) | ((w0 >> 6) &
 * 0x03..) << 4, u2 = w1 & 0x3f.., u3 = ((w2 >> 4) & 0x0f..) | ((w1 >> 6) & 0x03..) << 4).  One
 * 16-byte load (the 12 scale bytes and 4 nibble bytes, unused), no round trip through general
 * registers: the AVX-512 VNNI rows' form (at one token 1.10-1.22x faster than q4k_unpack's
 * there, Zen 5). */
AI __m128i q4k_unpack_v(const uint8_t *s12) {
    const __m128i v = _mm_loadu_si128((const __m128i *)s12);        /* w0 w1 w2 .. */
    const __m128i a = _mm_shuffle_epi32(v, _MM_SHUFFLE(2, 1, 2, 0)); /* w0 w2 w1 w2 */
    const __m128i b = _mm_shuffle_epi32(v, _MM_SHUFFLE(1, 1, 0, 0)); /* w0 w0 w1 w1 */
    const __m128i lo = _mm_and_si128(a, _mm_set1_epi32(0x3f3f3f3f)); /* u0, u2 */
    const __m128i hi = _mm_or_si128( /* u1, u3 */
        _mm_and_si128(_mm_srlv_epi32(a, _mm_setr_epi32(0, 0, 0, 4)), _mm_set1_epi32(0x0f0f0f0f)),
        _mm_slli_epi32(_mm_and_si128(_mm_srli_epi32(b, 6), _mm_set1_epi32(0x03030303)), 4));
    return _mm_blend_epi32(lo, hi, 0xA);
}

/* Bit j of every byte of hb at bit 4 (Q5_K's fifth bit of sub-block j, as the value 16). */
AI __m256i q5k_bit(__m256i hb, uint32_t j) {
    return _mm256_and_si256(_mm256_slli_epi16(_mm256_srli_epi16(hb, (int)j), 4),
                            _mm256_set1_epi8(0x10));
}

/* Q4_K (five = 0) or Q5_K (five = 1) rows against nt tokens. */
AI void rows_qk(const uint8_t *w, const xin *x, uint32_t nt, uint32_t n, float *res,
                const int five) {
    const uint32_t nsb = n / 256, bb = five ? 176 : 144, qo = five ? 48 : 16;
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256 acc[TILE];
    __m128 accm[TILE];
    for (uint32_t t = 0; t < nt; t++) {
        acc[t] = _mm256_setzero_ps();
        accm[t] = _mm_setzero_ps();
    }
    for (uint32_t s = 0; s < nsb; s++, w += bb) {
        uint32_t u[4];
        q4k_unpack(w + 4, u);
        const __m256i hb = five ? _mm256_loadu_si256((const __m256i *)(w + 16))
                                : _mm256_setzero_si256();
        const float d = ld_f16(w), dmin = ld_f16(w + 2);
        const __m128i sc16 = _mm_cvtepu8_epi16(_mm_set_epi32(0, 0, (int)u[1], (int)u[0]));
        const __m128i mn16 = _mm_cvtepu8_epi16(_mm_set_epi32(0, 0, (int)u[3], (int)u[2]));
        const __m256i sc256 = _mm256_set_m128i(sc16, sc16);
        __m256i lo[4], hi[4], slo[4], shi[4];
        for (uint32_t c = 0; c < 4; c++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(w + qo + 32 * c));
            lo[c] = _mm256_and_si256(v, m4);
            hi[c] = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
            if (five) {
                lo[c] = _mm256_or_si256(lo[c], q5k_bit(hb, 2 * c));
                hi[c] = _mm256_or_si256(hi[c], q5k_bit(hb, 2 * c + 1));
            }
            /* every int16 lane: the scale of sub-block 2c (low nibbles) / 2c + 1 (high) */
            slo[c] = _mm256_shuffle_epi8(sc256, _mm256_set1_epi16((short)(0x0100 + 0x0404 * c)));
            shi[c] = _mm256_shuffle_epi8(sc256, _mm256_set1_epi16((short)(0x0302 + 0x0404 * c)));
        }
        for (uint32_t t = 0; t < nt; t++) {
            const int8_t *xq = x[t].q + 256 * s;
            __m256i sumi = _mm256_setzero_si256();
            for (uint32_t c = 0; c < 4; c++) {
                const __m256i pl = _mm256_maddubs_epi16(
                    lo[c], _mm256_loadu_si256((const __m256i *)(xq + 64 * c)));
                const __m256i ph = _mm256_maddubs_epi16(
                    hi[c], _mm256_loadu_si256((const __m256i *)(xq + 64 * c + 32)));
                sumi = _mm256_add_epi32(sumi, _mm256_add_epi32(_mm256_madd_epi16(pl, slo[c]),
                                                               _mm256_madd_epi16(ph, shi[c])));
            }
            const float xs = x[t].s[s];
            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * xs), _mm256_cvtepi32_ps(sumi), acc[t]);
            const __m128i pm =
                _mm_madd_epi16(mn16, _mm_loadu_si128((const __m128i *)(x[t].bs + 8 * s)));
            accm[t] = _mm_fmadd_ps(_mm_set1_ps(dmin * xs), _mm_cvtepi32_ps(pm), accm[t]);
        }
    }
    for (uint32_t t = 0; t < nt; t++) res[t] = hsum8(acc[t]) - hsum4(accm[t]);
}

static void rows_q4_k(const uint8_t *w, const xin *x, uint32_t nt, uint32_t n, float *res) {
    rows_qk(w, x, nt, n, res, 0);
}

static void rows_q5_k(const uint8_t *w, const xin *x, uint32_t nt, uint32_t n, float *res) {
    rows_qk(w, x, nt, n, res, 1);
}

/* One 32-byte chunk c of a Q4_K / Q5_K block (64 columns: the low nibbles against xl, the
 * high ones against xh; Q5_K: with the fifth bits of sub-blocks 2c, 2c + 1 from hb) times its
 * two sub-blocks' scales (sc shuffled by kl / kh), as int32 lanes. */
AI __m256i qk_chunk(__m256i v, __m256i hb, uint32_t c, __m256i xl, __m256i xh, __m256i sc,
                    __m256i kl, __m256i kh, const int five) {
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    __m256i lo = _mm256_and_si256(v, m4), hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m4);
    if (five) {
        lo = _mm256_or_si256(lo, q5k_bit(hb, 2 * c));
        hi = _mm256_or_si256(hi, q5k_bit(hb, 2 * c + 1));
    }
    return _mm256_add_epi32(_mm256_madd_epi16(_mm256_maddubs_epi16(lo, xl),
                                              _mm256_shuffle_epi8(sc, kl)),
                            _mm256_madd_epi16(_mm256_maddubs_epi16(hi, xh),
                                              _mm256_shuffle_epi8(sc, kh)));
}

/* Two Q4_K (five = 0) or Q5_K (five = 1) rows (w[0], w[1]: gate and up of one output, or two
 * down rows) against one token, every vector in a register, the input loaded once for both
 * (the tiled form keeps the unpacked nibbles and scales in arrays, which cost it ~2x at one
 * token; one row alone pays its input loads and horizontal sums twice as often). */
AI void row2_qk(const uint8_t *const w[2], const xin *x, uint32_t n, float res[2],
                const int five) {
    const uint32_t nsb = n / 256, bb = five ? 176 : 144, qo = five ? 48 : 16;
    const int8_t *xq = x->q;
    __m256 acc0 = _mm256_setzero_ps(), acc1 = _mm256_setzero_ps();
    __m128 accm0 = _mm_setzero_ps(), accm1 = _mm_setzero_ps();
    const uint8_t *w0 = w[0], *w1 = w[1];
    for (uint32_t s = 0; s < nsb; s++, w0 += bb, w1 += bb, xq += 256) {
        _mm_prefetch((const char *)(w0 + PF_AHEAD), _MM_HINT_T0);
        _mm_prefetch((const char *)(w0 + PF_AHEAD + 64), _MM_HINT_T0);
        _mm_prefetch((const char *)(w0 + PF_AHEAD + 128), _MM_HINT_T0);
        _mm_prefetch((const char *)(w1 + PF_AHEAD), _MM_HINT_T0);
        _mm_prefetch((const char *)(w1 + PF_AHEAD + 64), _MM_HINT_T0);
        _mm_prefetch((const char *)(w1 + PF_AHEAD + 128), _MM_HINT_T0);
        const __m256i hb0 = five ? _mm256_loadu_si256((const __m256i *)(w0 + 16))
                                 : _mm256_setzero_si256();
        const __m256i hb1 = five ? _mm256_loadu_si256((const __m256i *)(w1 + 16))
                                 : _mm256_setzero_si256();
        uint32_t u0[4], u1[4];
        q4k_unpack(w0 + 4, u0);
        q4k_unpack(w1 + 4, u1);
        const __m128i sa = _mm_cvtepu8_epi16(_mm_set_epi32(0, 0, (int)u0[1], (int)u0[0]));
        const __m128i sb = _mm_cvtepu8_epi16(_mm_set_epi32(0, 0, (int)u1[1], (int)u1[0]));
        const __m256i sc0 = _mm256_set_m128i(sa, sa), sc1 = _mm256_set_m128i(sb, sb);
        __m256i sumi0 = _mm256_setzero_si256(), sumi1 = _mm256_setzero_si256();
#define Q4K_CHUNK(c)                                                                           \
    do {                                                                                       \
        const __m256i xl = _mm256_loadu_si256((const __m256i *)(xq + 64 * (c)));               \
        const __m256i xh = _mm256_loadu_si256((const __m256i *)(xq + 64 * (c) + 32));          \
        const __m256i kl = _mm256_set1_epi16((short)(0x0100 + 0x0404 * (c)));                  \
        const __m256i kh = _mm256_set1_epi16((short)(0x0302 + 0x0404 * (c)));                  \
        const __m256i v0 = _mm256_loadu_si256((const __m256i *)(w0 + qo + 32 * (c)));          \
        const __m256i v1 = _mm256_loadu_si256((const __m256i *)(w1 + qo + 32 * (c)));          \
        sumi0 = _mm256_add_epi32(sumi0, qk_chunk(v0, hb0, c, xl, xh, sc0, kl, kh, five));     \
        sumi1 = _mm256_add_epi32(sumi1, qk_chunk(v1, hb1, c, xl, xh, sc1, kl, kh, five));     \
    } while (0)
        Q4K_CHUNK(0);
        Q4K_CHUNK(1);
        Q4K_CHUNK(2);
        Q4K_CHUNK(3);
#undef Q4K_CHUNK
        const float xs = x->s[s];
        /* the two rows' f16 d and dmin in one conversion: d0 dmin0 d1 dmin1 */
        uint32_t dd0, dd1;
        memcpy(&dd0, w0, 4);
        memcpy(&dd1, w1, 4);
        const __m128 dm = _mm_mul_ps(_mm_cvtph_ps(_mm_set_epi32(0, 0, (int)dd1, (int)dd0)),
                                     _mm_set1_ps(xs));
        acc0 = _mm256_fmadd_ps(_mm256_broadcastss_ps(dm), _mm256_cvtepi32_ps(sumi0), acc0);
        acc1 = _mm256_fmadd_ps(_mm256_broadcastss_ps(_mm_movehl_ps(dm, dm)),
                               _mm256_cvtepi32_ps(sumi1), acc1);
        const __m128i bsv = _mm_loadu_si128((const __m128i *)(x->bs + 8 * s));
        const __m128i pm0 =
            _mm_madd_epi16(_mm_cvtepu8_epi16(_mm_set_epi32(0, 0, (int)u0[3], (int)u0[2])), bsv);
        const __m128i pm1 =
            _mm_madd_epi16(_mm_cvtepu8_epi16(_mm_set_epi32(0, 0, (int)u1[3], (int)u1[2])), bsv);
        accm0 = _mm_fmadd_ps(_mm_shuffle_ps(dm, dm, 0x55), _mm_cvtepi32_ps(pm0), accm0);
        accm1 = _mm_fmadd_ps(_mm_shuffle_ps(dm, dm, 0xFF), _mm_cvtepi32_ps(pm1), accm1);
    }
    res[0] = hsum8(acc0) - hsum4(accm0);
    res[1] = hsum8(acc1) - hsum4(accm1);
}

static void row2_q4_k(const uint8_t *const w[2], const xin *x, uint32_t n, float res[2]) {
    row2_qk(w, x, n, res, 0);
}

static void row2_q5_k(const uint8_t *const w[2], const xin *x, uint32_t n, float res[2]) {
    row2_qk(w, x, n, res, 1);
}

/* Two rows of dt (Q4_K or Q5_K) against one token. */
AI void row2_k(int32_t dt, const uint8_t *const w[2], const xin *x, uint32_t n, float res[2]) {
    if (dt == SMOE_WDT_Q5_K)
        row2_q5_k(w, x, n, res);
    else
        row2_q4_k(w, x, n, res);
}

/* The integer sums of super-block s of a tile's tokens into their f32 accumulators:
 * acc[t] += d * s_x[t] * sumi[t] (Q6_K and IQ4_XS: no min term). */
AI void tile_fold(__m256 *acc, const __m256i *sumi, float d, const xin *x, uint32_t s,
                  uint32_t nt) {
    for (uint32_t t = 0; t < nt; t++)
        acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * x[t].s[s]), _mm256_cvtepi32_ps(sumi[t]),
                                 acc[t]);
}

/* ---- Q2_K and Q3_K: one input scale per 256 columns, a scale per 16 columns ---- */

/* Q2_K's 16 four-bit scales (three = 0) or Q3_K's 16 signed six-bit scales (three = 1, sc - 32,
 * the vector form of q3k_scales) as int16 lanes 0..15; Q2_K's mins into *mn likewise. */
AI __m256i q23_scales(const uint8_t *w, const int three, __m256i *mn) {
    const __m128i m4 = _mm_set1_epi8(0x0F);
    if (!three) {
        const __m128i b = _mm_loadu_si128((const __m128i *)w);
        *mn = _mm256_cvtepu8_epi16(_mm_and_si128(_mm_srli_epi16(b, 4), m4));
        return _mm256_cvtepu8_epi16(_mm_and_si128(b, m4));
    }
    const uint8_t *s12 = w + 96;
    uint64_t lo8;
    uint32_t hi4;
    memcpy(&lo8, s12, 8);
    memcpy(&hi4, s12 + 8, 4);
    const __m128i l = _mm_cvtsi64_si128((long long)lo8);
    /* bytes 0..7: low nibbles (sub-blocks 0..7), 8..15: high nibbles (8..15) */
    const __m128i lo = _mm_and_si128(_mm_unpacklo_epi64(l, _mm_srli_epi16(l, 4)), m4);
    /* int32 lane k: bits 2k..2k+1 of each of the four bytes (sub-blocks 4k .. 4k + 3) */
    const __m128i hv = _mm_and_si128(
        _mm_srlv_epi32(_mm_set1_epi32((int)hi4), _mm_setr_epi32(0, 2, 4, 6)), _mm_set1_epi8(3));
    const __m128i sc8 = _mm_sub_epi8(_mm_or_si128(lo, _mm_slli_epi16(hv, 4)), _mm_set1_epi8(32));
    *mn = _mm256_setzero_si256();
    return _mm256_cvtepi8_epi16(sc8);
}

/* The scale vector's h-th 128-bit lane in both lanes (the scales of half h's sub-blocks). */
AI __m256i q23_half_scales(__m256i sc, uint32_t h) {
    return h ? _mm256_permute2x128_si256(sc, sc, 0x11) : _mm256_permute2x128_si256(sc, sc, 0x00);
}

/* The scales of chunk j of half h (its two 16-column sub-blocks 8h + 2j, 8h + 2j + 1) in the
 * low / high 128-bit lanes, shuffled out of sch, the scale vector's h-th lane doubled. */
AI __m256i q23_chunk_scales(__m256i sch, uint32_t j) {
    return _mm256_shuffle_epi8(sch, _mm256_set_m128i(_mm_set1_epi16((short)(0x0302 + 0x0404 * j)),
                                                     _mm_set1_epi16((short)(0x0100 + 0x0404 * j))));
}

/* Chunk j (32 columns, bits 2j) of the 32 bytes v of 2-bit values; Q3_K (three): plus 4 where
 * bit 4h + j of the hmask bytes hb is set. */
AI __m256i q23_chunk(__m256i v, __m256i hb, uint32_t h, uint32_t j, const int three) {
    __m256i q = _mm256_and_si256(_mm256_srli_epi16(v, (int)(2 * j)), _mm256_set1_epi8(3));
    if (three)
        q = _mm256_or_si256(q, _mm256_and_si256(
                                   _mm256_slli_epi16(_mm256_srli_epi16(hb, (int)(4 * h + j)), 2),
                                   _mm256_set1_epi8(4)));
    return q;
}

/* Q2_K (three = 0) or Q3_K (three = 1) rows against nt tokens.  Per super-block and half h
 * the 32 bytes of 2-bit values give four chunks j of 32 columns (q23_chunk), each against its
 * 32 input values with the scales of its two 16-column sub-blocks (q23_chunk_scales). */
AI void rows_q23_k(const uint8_t *w, const xin *x, uint32_t nt, uint32_t n, float *res,
                   const int three) {
    const uint32_t nsb = n / 256, bb = three ? 110 : 84;
    __m256 acc[TILE], accm[TILE];
    for (uint32_t t = 0; t < nt; t++) {
        acc[t] = _mm256_setzero_ps();
        accm[t] = _mm256_setzero_ps();
    }
    for (uint32_t s = 0; s < nsb; s++, w += bb) {
        for (uint32_t k = 0; k < 2; k++)
            _mm_prefetch((const char *)(w + PF_AHEAD + 64 * k), _MM_HINT_T0);
        __m256i mn;
        const __m256i sc = q23_scales(w, three, &mn);
        const float d = ld_f16(w + (three ? 108 : 80)), dmin = three ? 0.0f : ld_f16(w + 82);
        const __m256i hb = three ? _mm256_loadu_si256((const __m256i *)w) : _mm256_setzero_si256();
        __m256i sumi[TILE];
        for (uint32_t t = 0; t < nt; t++) sumi[t] = _mm256_setzero_si256();
        for (uint32_t h = 0; h < 2; h++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(w + (three ? 32 : 16) + 32 * h));
            const __m256i sch = q23_half_scales(sc, h);
            for (uint32_t j = 0; j < 4; j++) {
                const __m256i q = q23_chunk(v, hb, h, j, three), skv = q23_chunk_scales(sch, j);
                for (uint32_t t = 0; t < nt; t++) {
                    const __m256i xv = _mm256_loadu_si256(
                        (const __m256i *)(x[t].q + 256 * s + 128 * h + 32 * j));
                    sumi[t] = _mm256_add_epi32(
                        sumi[t], _mm256_madd_epi16(_mm256_maddubs_epi16(q, xv), skv));
                }
            }
        }
        for (uint32_t t = 0; t < nt; t++) {
            const __m256i bsv = _mm256_loadu_si256((const __m256i *)(x[t].bs + 16 * s));
            const __m256i pm = _mm256_madd_epi16(three ? sc : mn, bsv);
            const float xs = x[t].s[s];
            if (three) /* sc * (u - 4): the offset in integers */
                sumi[t] = _mm256_sub_epi32(sumi[t], _mm256_slli_epi32(pm, 2));
            else
                accm[t] = _mm256_fmadd_ps(_mm256_set1_ps(dmin * xs), _mm256_cvtepi32_ps(pm),
                                          accm[t]);
            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * xs), _mm256_cvtepi32_ps(sumi[t]), acc[t]);
        }
    }
    for (uint32_t t = 0; t < nt; t++) res[t] = hsum8(acc[t]) - hsum8(accm[t]);
}

/* rows_q23_k for one token, every vector in a register: the scales of chunk (h, j) shuffled
 * out of the int16 scale vector (its h-th 128-bit lane doubled) instead of broadcast one by
 * one. */
AI float row1_q23_k(const uint8_t *w, const xin *x, uint32_t n, const int three) {
    const uint32_t nsb = n / 256, bb = three ? 110 : 84;
    __m256 acc = _mm256_setzero_ps(), accm = _mm256_setzero_ps();
    for (uint32_t s = 0; s < nsb; s++, w += bb) {
        _mm_prefetch((const char *)(w + PF_AHEAD), _MM_HINT_T0);
        _mm_prefetch((const char *)(w + PF_AHEAD + 64), _MM_HINT_T0);
        __m256i mn;
        const __m256i sc = q23_scales(w, three, &mn);
        const __m256i hb = three ? _mm256_loadu_si256((const __m256i *)w) : _mm256_setzero_si256();
        const int8_t *xq = x->q + 256 * s;
        __m256i sumi = _mm256_setzero_si256();
        for (uint32_t h = 0; h < 2; h++) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)(w + (three ? 32 : 16) + 32 * h));
            const __m256i sch = q23_half_scales(sc, h);
            for (uint32_t j = 0; j < 4; j++) {
                const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + 128 * h + 32 * j));
                sumi = _mm256_add_epi32(
                    sumi, _mm256_madd_epi16(_mm256_maddubs_epi16(q23_chunk(v, hb, h, j, three), xv),
                                            q23_chunk_scales(sch, j)));
            }
        }
        const __m256i bsv = _mm256_loadu_si256((const __m256i *)(x->bs + 16 * s));
        const __m256i pm = _mm256_madd_epi16(three ? sc : mn, bsv);
        const float xs = x->s[s];
        if (three)
            sumi = _mm256_sub_epi32(sumi, _mm256_slli_epi32(pm, 2));
        else
            accm = _mm256_fmadd_ps(_mm256_set1_ps(ld_f16(w + 82) * xs), _mm256_cvtepi32_ps(pm),
                                   accm);
        acc = _mm256_fmadd_ps(_mm256_set1_ps(ld_f16(w + (three ? 108 : 80)) * xs),
                              _mm256_cvtepi32_ps(sumi), acc);
    }
    return hsum8(acc) - hsum8(accm);
}

static void rows_q2_k(const uint8_t *w, const xin *x, uint32_t nt, uint32_t n, float *res) {
    if (nt == 1)
        res[0] = row1_q23_k(w, x, n, 0);
    else
        rows_q23_k(w, x, nt, n, res, 0);
}

static void rows_q3_k(const uint8_t *w, const xin *x, uint32_t nt, uint32_t n, float *res) {
    if (nt == 1)
        res[0] = row1_q23_k(w, x, n, 1);
    else
        rows_q23_k(w, x, nt, n, res, 1);
}

/* ---- Q6_K: one input scale per 256 columns, int16 scales per 16 columns ---- */

static void rows_q6_k(const uint8_t *w, const xin *x, uint32_t nt, uint32_t n, float *res) {
    const uint32_t nsb = n / 256;
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3);
    const __m256i k32 = _mm256_set1_epi8(32);
    __m256 acc[TILE];
    for (uint32_t t = 0; t < nt; t++) acc[t] = _mm256_setzero_ps();
    for (uint32_t s = 0; s < nsb; s++, w += 210) {
        for (uint32_t k = 0; k < 4; k++)
            _mm_prefetch((const char *)(w + PF_AHEAD + 64 * k), _MM_HINT_T0);
        const float d = ld_f16(w + 208);
        __m256i sumi[TILE];
        for (uint32_t t = 0; t < nt; t++) sumi[t] = _mm256_setzero_si256();
        for (uint32_t h = 0; h < 2; h++) {
            const uint8_t *ql = w + 64 * h, *qh = w + 128 + 32 * h;
            const __m128i sc16 =
                _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(w + 192 + 8 * h)));
            const __m256i sc256 = _mm256_set_m128i(sc16, sc16);
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)ql);
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
            const __m256i hb = _mm256_loadu_si256((const __m256i *)qh);
            __m256i q[4], sk[4];
            q[0] = _mm256_or_si256(_mm256_and_si256(l0, m4),
                                   _mm256_slli_epi16(_mm256_and_si256(hb, m3), 4));
            q[1] = _mm256_or_si256(
                _mm256_and_si256(l1, m4),
                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 2), m3), 4));
            q[2] = _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 4), m3), 4));
            q[3] = _mm256_or_si256(
                _mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(hb, 6), m3), 4));
            for (uint32_t k = 0; k < 4; k++) /* low 16 columns: scale 2k; high 16: 2k + 1 */
                sk[k] = _mm256_shuffle_epi8(
                    sc256, _mm256_set_m128i(_mm_set1_epi16((short)(0x0302 + 0x0404 * k)),
                                            _mm_set1_epi16((short)(0x0100 + 0x0404 * k))));
            for (uint32_t t = 0; t < nt; t++) {
                const int8_t *xq = x[t].q + 256 * s + 128 * h;
                for (uint32_t k = 0; k < 4; k++) {
                    const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + 32 * k));
                    const __m256i p = _mm256_sub_epi16(_mm256_maddubs_epi16(q[k], xv),
                                                       _mm256_maddubs_epi16(k32, xv));
                    sumi[t] = _mm256_add_epi32(sumi[t], _mm256_madd_epi16(p, sk[k]));
                }
            }
        }
        tile_fold(acc, sumi, d, x, s, nt);
    }
    for (uint32_t t = 0; t < nt; t++) res[t] = hsum8(acc[t]);
}

/* rows_q6_k for one token, every vector in a register. */
static float row1_q6_k(const uint8_t *w, const xin *x, uint32_t n) {
    const uint32_t nsb = n / 256;
    const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3);
    const __m256i k32 = _mm256_set1_epi8(32);
    const int8_t *xq = x->q;
    __m256 acc = _mm256_setzero_ps();
    for (uint32_t s = 0; s < nsb; s++, w += 210) {
        for (uint32_t k = 0; k < 4; k++)
            _mm_prefetch((const char *)(w + PF_AHEAD + 64 * k), _MM_HINT_T0);
        __m256i sumi = _mm256_setzero_si256();
        for (uint32_t h = 0; h < 2; h++, xq += 128) {
            const uint8_t *ql = w + 64 * h, *qh = w + 128 + 32 * h;
            const __m128i sc16 =
                _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(w + 192 + 8 * h)));
            const __m256i sc256 = _mm256_set_m128i(sc16, sc16);
            const __m256i l0 = _mm256_loadu_si256((const __m256i *)ql);
            const __m256i l1 = _mm256_loadu_si256((const __m256i *)(ql + 32));
            const __m256i hb = _mm256_loadu_si256((const __m256i *)qh);
#define Q6K_PART(k, q)                                                                         \
    do {                                                                                       \
        const __m256i xv = _mm256_loadu_si256((const __m256i *)(xq + 32 * (k)));               \
        const __m256i p =                                                                      \
            _mm256_sub_epi16(_mm256_maddubs_epi16(q, xv), _mm256_maddubs_epi16(k32, xv));      \
        const __m256i sk = _mm256_shuffle_epi8(                                                \
            sc256, _mm256_set_m128i(_mm_set1_epi16((short)(0x0302 + 0x0404 * (k))),            \
                                    _mm_set1_epi16((short)(0x0100 + 0x0404 * (k)))));          \
        sumi = _mm256_add_epi32(sumi, _mm256_madd_epi16(p, sk));                               \
    } while (0)
            Q6K_PART(0, _mm256_or_si256(_mm256_and_si256(l0, m4),
                                        _mm256_slli_epi16(_mm256_and_si256(hb, m3), 4)));
            Q6K_PART(1, _mm256_or_si256(_mm256_and_si256(l1, m4),
                                        _mm256_slli_epi16(
                                            _mm256_and_si256(_mm256_srli_epi16(hb, 2), m3), 4)));
            Q6K_PART(2, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4),
                                        _mm256_slli_epi16(
                                            _mm256_and_si256(_mm256_srli_epi16(hb, 4), m3), 4)));
            Q6K_PART(3, _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4),
                                        _mm256_slli_epi16(
                                            _mm256_and_si256(_mm256_srli_epi16(hb, 6), m3), 4)));
#undef Q6K_PART
        }
        acc = _mm256_fmadd_ps(_mm256_set1_ps(ld_f16(w + 208) * x->s[s]),
                              _mm256_cvtepi32_ps(sumi), acc);
    }
    return hsum8(acc);
}

/* ---- IQ4_XS: one input scale per 256 columns, int16 scales per 32 columns ---- */

/* ggml's kvalues_iq4nl in both 128-bit lanes (the vpshufb table of an IQ4_XS nibble) */
AI __m256i iq4_values(void) {
    return _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)iq4nl_values));
}

/* The vpshufb that spreads a dword [ls1 | ls2 << 16] to int16 lanes: the low 128 bits from
 * bytes 0-1, the high from bytes 2-3 (two sub-blocks' scales, eight lanes each) */
AI __m256i iq4_spread(void) {
    return _mm256_setr_epi8(0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 2, 3, 2, 3, 2, 3, 2,
                            3, 2, 3, 2, 3, 2, 3, 2, 3);
}

/* IQ4_XS at nt (1 .. IQ4_TILE) tokens, the input in pair order (pair_order): two
 * sub-blocks per step, their 32 bytes of nibbles one 256-bit load whose low and high nibbles,
 * looked up with one 256-bit vpshufb each, are [sub-block j columns 0-15 | j + 1 columns
 * 0-15] and the same for 16-31, against two loads of each token's input; the two sub-blocks'
 * scales as [ls_j x 8 | ls_j+1 x 8] int16 in vpmaddwd (llama.cpp's IQ4_XS x Q8_K sums, the
 * same integers), then one f32 FMA per super-block.  Each super-block is decoded once for
 * every token of the pass, and a token's result does not depend on nt (batch invariance,
 * INVARIANT_T: the same products in the same int32 lanes, summed exactly, then the same f32
 * FMAs and final sum).  Before (per sub-block a 128-bit unpacking, two lookups and an insert,
 * its scale broadcast alone, the input in block order): Zen 2 EPYC, 1 thread, 0.56-0.66 of
 * the read ceiling at one token.  Two tokens a pass, not TILE: at four the sixteen ymm
 * registers spill.  At 48 tokens a call (DeepSeek-V2-Lite's expert shape, one thread, AMD
 * EPYC Zen 1, benchmarks/expert_kernels.py, 5 interleaved rounds) the expert took 0.84-0.92
 * of its time on one token a pass; four tokens a pass 0.97-1.00.  This form at one token
 * replaced a one-token copy of it with two integer accumulators (same host, 3 rounds at 1
 * token 0.97-0.98 of its time, 2 rounds at 8 tokens 0.97). */
#define IQ4_TILE 2
AI void rows_iq4_xs(const uint8_t *w, const xin *x, uint32_t nt, uint32_t n, float *res) {
    const uint32_t nsb = n / 256;
    const __m256i m4 = _mm256_set1_epi8(0x0F), kv = iq4_values(), spread = iq4_spread();
    __m256 acc[IQ4_TILE]; /* constant indices only: the arrays stay in registers */
    __m256i si[IQ4_TILE];
    for (uint32_t t = 0; t < nt; t++) acc[t] = _mm256_setzero_ps();
    for (uint32_t s = 0; s < nsb; s++, w += 136) {
        for (uint32_t k = 0; k < 3; k++)
            _mm_prefetch((const char *)(w + PF_AHEAD + 64 * k), _MM_HINT_T0);
        uint32_t sh = (uint32_t)w[2] | ((uint32_t)w[3] << 8);
        const uint8_t *qs = w + 8;
        for (uint32_t t = 0; t < nt; t++) si[t] = _mm256_setzero_si256();
        for (uint32_t j = 0; j < 8; j += 2, qs += 32, sh >>= 4) {
            const __m256i v = _mm256_loadu_si256((const __m256i *)qs);
            const __m256i lo = _mm256_shuffle_epi8(kv, _mm256_and_si256(v, m4));
            const __m256i hi =
                _mm256_shuffle_epi8(kv, _mm256_and_si256(_mm256_srli_epi16(v, 4), m4));
            const __m256i alo = _mm256_sign_epi8(lo, lo), ahi = _mm256_sign_epi8(hi, hi);
            const uint8_t sl = w[4 + j / 2];
            const uint32_t ls1 = (uint16_t)(((sl & 0xF) | ((sh << 4) & 0x30)) - 32);
            const uint32_t ls2 = (uint16_t)(((sl >> 4) | ((sh << 2) & 0x30)) - 32);
            const __m256i sc =
                _mm256_shuffle_epi8(_mm256_set1_epi32((int)(ls1 | ls2 << 16)), spread);
            const uint32_t o = 256 * s + 32 * j;
            for (uint32_t t = 0; t < nt; t++) {
                const __m256i xl = _mm256_loadu_si256((const __m256i *)(x[t].q + o));
                const __m256i xh = _mm256_loadu_si256((const __m256i *)(x[t].q + o + 32));
                const __m256i pl = _mm256_maddubs_epi16(alo, _mm256_sign_epi8(xl, lo));
                const __m256i ph = _mm256_maddubs_epi16(ahi, _mm256_sign_epi8(xh, hi));
                si[t] = _mm256_add_epi32(si[t], _mm256_add_epi32(_mm256_madd_epi16(pl, sc),
                                                                 _mm256_madd_epi16(ph, sc)));
            }
        }
        const float d = ld_f16(w);
        for (uint32_t t = 0; t < nt; t++)
            acc[t] = _mm256_fmadd_ps(_mm256_set1_ps(d * x[t].s[s]), _mm256_cvtepi32_ps(si[t]),
                                     acc[t]);
    }
    for (uint32_t t = 0; t < nt; t++) res[t] = hsum8(acc[t]);
}

/* Row w of dt against tokens [t0, t0 + nt) (nt <= TILE) of the prepared input: res[0..nt).
 * nt > 1 when the call has tile_min_tokens(dt) tokens or more. */
AI void rows_fast(int32_t dt, const uint8_t *w, const smoe_ffn_job *j, uint32_t t0, uint32_t nt,
                  uint32_t n, float *res) {
    xin x[TILE];
    for (uint32_t t = 0; t < nt; t++) x[t] = xin_of(j, dt, t0 + t, n);
    if (dt == SMOE_WDT_Q4_1 && x[0].pairs) /* (each format its own inlined loop) */
        rows_b4(SMOE_WDT_Q4_1, w, x, nt, n, res);
    else if (dt == SMOE_WDT_Q4_1) /* the VNNI form's calls (input in block order) */
        for (uint32_t t = 0; t < nt; t++) res[t] = row1_q4_1(w, x + t, n);
    else if (dt == SMOE_WDT_MXFP4 && x[0].pairs)
        rows_b4(SMOE_WDT_MXFP4, w, x, nt, n, res);
    else if (dt == SMOE_WDT_Q4_0 && x[0].pairs)
        rows_b4(SMOE_WDT_Q4_0, w, x, nt, n, res);
    else if (smoe_wdt_block_cols(dt) == 32 && nt == 1)
        res[0] = row1_b32(dt, w, x, n);
    else if (smoe_wdt_block_cols(dt) == 32)
        rows_b32(dt, w, x, nt, n, res);
    else if (dt == SMOE_WDT_Q4_K)
        rows_q4_k(w, x, nt, n, res);
    else if (dt == SMOE_WDT_Q2_K)
        rows_q2_k(w, x, nt, n, res);
    else if (dt == SMOE_WDT_Q3_K)
        rows_q3_k(w, x, nt, n, res);
    else if (dt == SMOE_WDT_Q5_K)
        rows_q5_k(w, x, nt, n, res);
    else if (dt == SMOE_WDT_IQ4_XS) /* one token (or two) at a time */
        for (uint32_t t = 0; t < nt; t += IQ4_TILE)
            rows_iq4_xs(w, x + t, nt - t < IQ4_TILE ? nt - t : IQ4_TILE, n, res + t);
    else if (nt == 1)
        res[0] = row1_q6_k(w, x, n);
    else
        rows_q6_k(w, x, nt, n, res);
}

/* Batch invariance: each token of a call, at any token count, gets bit for bit what a
 * one-token call gives it (a verification of K drafts, a serving step's tokens at one expert,
 * prompts of one length prefilled together).  A call of up to INVARIANT_T tokens runs every
 * token through the one-token rows, row by row (the row stays in L1 for the next token),
 * unless its format's tiles share their decoding between tokens (tile_min_tokens).  Longer
 * calls (prefill) run TILE tokens a pass through the multi-token tiles, which sum each
 * token in the one-token order (tile_min_tokens).  The old tiles of the formats whose
 * one-token rows read the input in pair order (Q4_0, MXFP4, Q4_1, IQ4_XS; pair_order) folded
 * blocks in f32 in another order, which gave a prompt other last bits beside others of its
 * length; rows_b4x8 and rows_iq4_xs keep the one-token order now (at 48 tokens a call Q4_0's
 * expert took 0.73-0.74 of its old tiles' time on the
 * one-token rows, and 0.96-0.98 of that on rows_b4x8's two-token passes: DeepSeek-V2-Lite's
 * expert shape, one thread, AMD EPYC Zen 1, benchmarks/expert_kernels.py; Q8_0's tiles of
 * two accumulator sets 0.98-1.05x of its old ones).  The AVX-512 VNNI rows below keep the
 * one-token order at any count, INVARIANT_T tokens a pass.  tests/test_batch_invariance.py. */
#define INVARIANT_T 16

/* The fewest tokens of a call that run dt's multi-token tiles (rows_fast of nt > 1).  Every
 * block format's tiles sum each token as its one-token row does: Q8_0 (rows_b32, two
 * accumulators as row1_b32); Q4_0, Q4_1, MXFP4 and IQ4_XS (rows_b4x8, rows_iq4_xs: one form at
 * any nt); the K-quants (rows_qk, rows_q23_k, rows_q6_k: per super-block the integer sums of
 * row2_qk, row1_q23_k, row1_q6_k, exact in any order, then the same f32 products and FMAs in
 * the same order).  From two tokens for the pair-order rows, whose tiles share each block's
 * decoding between two tokens; past INVARIANT_T for the others. */
AI uint32_t tile_min_tokens(int32_t dt) {
    if (dt == SMOE_WDT_Q4_0 || dt == SMOE_WDT_Q4_1 || dt == SMOE_WDT_MXFP4 ||
        dt == SMOE_WDT_IQ4_XS)
        return 2;
    return INVARIANT_T + 1;
}

/* gate/up row i for token t alone (the one-token forms) */
static void gateup_one(const smoe_ffn_job *j, uint32_t t, uint32_t i) {
    const smoe_ffn_desc *d = j->d;
    const uint32_t H = d->H;
    const size_t rb = row_bytes(d->dtype, H);
    const uint8_t *gw = j->block + d->gate, *uw = j->block + d->up;
    float g, u;
    if (d->dtype == SMOE_WDT_Q4_K || d->dtype == SMOE_WDT_Q5_K) {
        /* gate and up rows of one output together */
        const xin x = xin_of(j, d->dtype, t, H);
        const uint8_t *w[2] = {gw + i * rb, uw + i * rb};
        float r[2];
        row2_k(d->dtype, w, &x, H, r);
        g = r[0], u = r[1];
    } else {
        rows_fast(d->dtype, gw + i * rb, j, t, 1, H, &g);
        rows_fast(d->dtype, uw + i * rb, j, t, 1, H, &u);
    }
    smoe_ffn_store_act(j, i, t, g, u);
}

static void gateup_fast(const smoe_ffn_job *j, uint32_t i0, uint32_t i1) {
    const smoe_ffn_desc *d = j->d;
    const uint32_t H = d->H;
    const size_t rb = row_bytes(d->dtype, H);
    const uint8_t *gw = j->block + d->gate, *uw = j->block + d->up;
    float g[TILE], u[TILE];
    if (j->T < tile_min_tokens(d->dtype)) {
        for (uint32_t i = i0; i < i1; i++)
            for (uint32_t t = 0; t < j->T; t++) gateup_one(j, t, i);
        return;
    }
    for (uint32_t i = i0; i < i1; i++)
        for (uint32_t t0 = 0; t0 < j->T; t0 += TILE) {
            const uint32_t nt = j->T - t0 < TILE ? j->T - t0 : TILE;
            rows_fast(d->dtype, gw + i * rb, j, t0, nt, H, g);
            rows_fast(d->dtype, uw + i * rb, j, t0, nt, H, u);
            for (uint32_t t = 0; t < nt; t++) smoe_ffn_store_act(j, i, t0 + t, g[t], u[t]);
        }
}

static void down_fast(const smoe_ffn_job *j, uint32_t h0, uint32_t h1) {
    const smoe_ffn_desc *d = j->d;
    const int32_t dt = smoe_ffn_down_dtype(d);
    const uint32_t I = d->I;
    const size_t rb = row_bytes(dt, I);
    const uint8_t *dw = j->block + d->down;
    float y[TILE];
    if ((dt == SMOE_WDT_Q4_K || dt == SMOE_WDT_Q5_K) && j->T <= INVARIANT_T) {
        /* two rows at a time, (h, h + half) of the chunk: each walks its half in memory
         * order (adjacent pairs step over every other row, which the hardware prefetcher
         * serves badly; ffn_avx2.c's avx2_down); every token in turn on the pair */
        xin x[INVARIANT_T];
        for (uint32_t t = 0; t < j->T; t++) x[t] = xin_of(j, dt, t, I);
        const uint32_t half = (h1 - h0) / 2;
        for (uint32_t h = h0; h < h0 + half; h++)
            for (uint32_t t = 0; t < j->T; t++) {
                const uint8_t *w[2] = {dw + h * rb, dw + (h + half) * rb};
                float r[2];
                row2_k(dt, w, &x[t], I, r);
                smoe_ffn_store_out(j, h, t, r[0]);
                smoe_ffn_store_out(j, h + half, t, r[1]);
            }
        if (!((h1 - h0) & 1)) return;
        h0 = h1 - 1; /* an odd chunk's last row, alone below */
    }
    if (j->T < tile_min_tokens(dt)) {
        for (uint32_t h = h0; h < h1; h++)
            for (uint32_t t = 0; t < j->T; t++) {
                rows_fast(dt, dw + h * rb, j, t, 1, I, y);
                smoe_ffn_store_out(j, h, t, y[0]);
            }
        return;
    }
    for (uint32_t h = h0; h < h1; h++)
        for (uint32_t t0 = 0; t0 < j->T; t0 += TILE) {
            const uint32_t nt = j->T - t0 < TILE ? j->T - t0 : TILE;
            rows_fast(dt, dw + h * rb, j, t0, nt, I, y);
            for (uint32_t t = 0; t < nt; t++) smoe_ffn_store_out(j, h, t0 + t, y[t]);
        }
}

AI int32_t hsum_i32(__m256i v) {
    __m128i h = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
    h = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0xB1));
    return _mm_cvtsi128_si32(h);
}

/* Quantize `m` (32 or 256) columns xb with inverse scale inv into qb (int8), returning the
 * sums of each `sub` (32 or 16) of them in bs[0 .. m/sub). */
AI void quant_cols(const float *xb, uint32_t m, __m256 inv, int8_t *qb, int16_t *bs,
                   uint32_t sub) {
    const __m256 lim = _mm256_set1_ps(127.0f), nlim = _mm256_set1_ps(-127.0f);
    for (uint32_t c = 0; c < m; c += 32) {
        __m256i iv[4];
        for (uint32_t k = 0; k < 4; k++) {
            __m256 y = _mm256_round_ps(_mm256_mul_ps(_mm256_loadu_ps(xb + c + 8 * k), inv),
                                       _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            y = _mm256_min_ps(_mm256_max_ps(y, nlim), lim); /* NaN lanes: -127 */
            iv[k] = _mm256_cvtps_epi32(y);
        }
        /* int32 -> int8 in column order: the packs interleave the 128-bit lanes, the
         * permute undoes it */
        __m256i p8 = _mm256_packs_epi16(_mm256_packs_epi32(iv[0], iv[1]),
                                        _mm256_packs_epi32(iv[2], iv[3]));
        p8 = _mm256_permutevar8x32_epi32(p8, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256((__m256i *)(qb + c), p8);
        const __m256i lo = _mm256_add_epi32(iv[0], iv[1]), hi = _mm256_add_epi32(iv[2], iv[3]);
        if (sub == 16) {
            bs[c / 16] = (int16_t)hsum_i32(lo);
            bs[c / 16 + 1] = (int16_t)hsum_i32(hi);
        } else {
            bs[c / 32] = (int16_t)hsum_i32(_mm256_add_epi32(lo, hi));
        }
    }
}

/* Per `m` columns (32 for Q8_0, Q4_0 and Q4_1, 256 for the K-quants, as llama.cpp's Q8_0 / Q8_K) of
 * each row: s = max|x| / 127, q = rint(x * (1 / s)) (ties to even), and the sum of every 32 q's.
 * A NaN among the m columns makes s NaN, so every output it feeds is NaN, as in f32 math.
 * Layout: q [T, n] int8; qs [T, n/m] f32; qsum's bytes [T, n/sub] int16 (sub: 16 before Q2_K
 * and Q3_K, else 32; used by the K-quants and Q4_1). */
static void prepare_avx2(int32_t dt, const float *src, size_t stride, const int32_t *rows,
                         uint32_t T, uint32_t n, int8_t *q, float *qs, float *qsum) {
    const uint32_t m = smoe_wdt_block_cols(dt), ns = n / m, sub = smoe_blocks_sum_cols(dt);
    const __m256 absm = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
    int16_t *bs = (int16_t *)qsum;
    for (uint32_t t = 0; t < T; t++) {
        const float *x = src + (rows ? (size_t)rows[t] : t) * stride;
        for (uint32_t b = 0; b < ns; b++) {
            const float *xb = x + (size_t)m * b;
            __m256 mx = _mm256_setzero_ps(), nan = _mm256_setzero_ps();
            for (uint32_t k = 0; k < m; k += 8) {
                const __m256 v = _mm256_loadu_ps(xb + k);
                nan = _mm256_or_ps(nan, _mm256_cmp_ps(v, v, _CMP_UNORD_Q));
                mx = _mm256_max_ps(mx, _mm256_and_ps(v, absm));
            }
            const int isnan = _mm256_movemask_ps(nan) != 0;
            __m128 r = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
            r = _mm_max_ps(r, _mm_movehl_ps(r, r));
            r = _mm_max_ss(r, _mm_movehdup_ps(r));
            const float sc = isnan ? __builtin_nanf("") : _mm_cvtss_f32(r) / 127.0f;
            const __m256 inv = _mm256_set1_ps(sc > 0.0f && !isnan ? 1.0f / sc : 0.0f);
            quant_cols(xb, m, inv, q + (size_t)t * n + (size_t)m * b,
                       bs + (size_t)t * (n / sub) + (m / sub) * b, sub);
            qs[(size_t)t * ns + b] = sc;
        }
    }
}

/* Pair order of one token's prepared int8 input q (n columns) for the one-token Q4_0 / MXFP4
 * / Q4_1 rows (rows_b4x8 and its tails) and IQ4_XS rows (rows_iq4_xs; its sub-blocks): per
 * two blocks, [block 0 columns 0-15 | block 1 columns 0-15 | block 0 columns 16-31 | block 1
 * columns 16-31], the halves the two blocks' low and high nibbles meet in one 256-bit step, so that
 * the rows load them instead of shuffling them for every row (on the Zen 2 EPYC their
 * unpacking, not memory, bound those rows); a last odd block stays as it is.  Scales and
 * sums stay per block. */
static void pair_order(int8_t *q, uint32_t n) {
    for (uint32_t c = 0; c + 64 <= n; c += 64) {
        const __m128i a = _mm_loadu_si128((const __m128i *)(q + c + 16));
        const __m128i b = _mm_loadu_si128((const __m128i *)(q + c + 32));
        _mm_storeu_si128((__m128i *)(q + c + 16), b);
        _mm_storeu_si128((__m128i *)(q + c + 32), a);
    }
}
#pragma GCC pop_options

static const smoe_ffn_impl impl_fast = {gateup_fast, down_fast, NULL};
#define HAVE_FAST 1
#else
#define HAVE_FAST 0
#endif

/* ---- AVX-512 VNNI: Q4_0 against one token, four blocks (128 columns) per vpdpbusd pair
 * (Q8_0: two blocks per vpdpbusd; Q4_K: 128 columns per 512-bit step, at rows_q4_k_vnni) ----
 * The AVX2 form above spends ~6 cycles a Q4_0 block at one token on an AMD EPYC Zen 4 (0.33
 * of the read ceiling at one thread): the sign trick (q - 8 signed), two vpmaddubsw/vpmaddwd
 * steps and a float conversion and FMA per 32 columns.  Here the nibbles q in [0, 15] are the
 * unsigned operand of vpdpbusd as they are: four blocks' 16 bytes in the four 128-bit lanes of
 * one register, their low nibbles (columns 0-15 of each block) against the input's matching
 * columns (two vshufi64x2 of the 128 prepared int8 values), then the high nibbles (16-31).  The
 * -8 offset is the accumulator's start value, -2 * (the prepared sum of the block's 32 int8
 * x) in each of the block's four int32 lanes (their sum: -8 sum x); the products are exact as
 * in the AVX2 form (a lane's 8 products <= 8 * 15 * 127), so the result equals it to float
 * rounding.  One float conversion and FMA per 128 columns, the four blocks' d * s_x spread
 * over their lanes with one vpermps.  MXFP4 (17-byte blocks) the same way, its nibbles looked
 * up (vpshufb) in the doubled E2M1 table offset by 12 to [0, 24] (a lane's 8 products <= 8 *
 * 24 * 127), the offset -12 sum x the start value (-3 * the block sum a lane) and d_w the
 * block's E8M0 scale halved.  Calls of any token count run these rows for every token in
 * the one-token order (every format unpacks a row's blocks once for up to four tokens:
 * rows_q4x_vnni, rows_q8_0_vnni, row_q4_k_vnni_tiled, row_q6_k_vnni_tiled,
 * row_iq4_xs_vnni_tiled; INVARIANT_T tokens a pass, vnni_rows_for); the formats without rows
 * here run the AVX2 form.  Q5_K runs Q4_K's rows with
 * its fifth bits ORed into the nibbles (q4k_super, five = 1): at one token 1.25-1.45x the
 * AVX2 rows' speed, at 4-8 tokens 2.0-2.5x (Zen 5, 1 thread,
 * kernels_epyc_zen5_q5_k_vnni_ab.json).  IQ4_XS has rows of its own (iq4xs_super): its
 * nibbles looked up in the table offset to unsigned bytes as MXFP4's, per sub-block scales
 * by vpmulld. */
#if HAVE_FAST && !defined(__clang__) && __GNUC__ >= 10
#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c,avx512f,avx512bw,avx512vl,avx512dq,avx512vnni")

/* Bytes ahead of the row position that the VNNI rows prefetch to L1.  At one token on an AMD
 * EPYC Zen 5 (1 thread, OLMoE's shape, from DRAM) PF_AHEAD's 1024 left these rows at 0.5-0.75
 * of the read ceiling, their rate from L3 near or above it: 4096 took Q4_0 26.8 -> 33.1 GB/s,
 * Q8_0 31.5 -> 38.6, Q6_K 29.3 -> 37.2, Q4_K 22.2 -> 27.9 (2048 and 8192 between; 16384 less;
 * a second prefetch, to L2 16384 ahead, less again).  Two tokens gain as much (Q8_0 1.2x);
 * 4-8 tokens read within 5 % either way, and 1024 for tiles of 3-4 tokens was no better
 * (kernels_epyc_zen5_vnni_prefetch_ab.json). */
#define PF_VNNI 4096

/* The four blocks' (w, bb = 18 or 17 bytes each) weights as the unsigned operands of
 * vpdpbusd: *lo their low nibbles (columns 0-15 of each block, a block a 128-bit lane), *hi
 * the high ones (16-31); Q4_0's nibbles q as they are (w_q = q - 8), MXFP4's looked up in the
 * table offset by 12.  Q4_0's blocks start at even bytes, so its 64 nibble bytes (2-17, 20-35,
 * 38-53, 56-71 of the four blocks' 72) are one two-source word permute of two loads (bytes
 * 0-63 and 8-71); MXFP4's odd ones take four 128-bit loads. */
AI void q4x_unpack(int32_t dt, const uint8_t *w, __m512i *lo, __m512i *hi) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    __m512i v;
    if (dt == SMOE_WDT_Q4_0) {
        static const int16_t nib[32] = {1,  2,  3,  4,  5,  6,  7,  8,  10, 11, 12,
                                        13, 14, 15, 16, 17, 19, 20, 21, 22, 23, 24,
                                        25, 26, 28, 29, 30, 31, 60, 61, 62, 63};
        const __m512i idx = _mm512_loadu_si512((const void *)nib);
        v = _mm512_permutex2var_epi16(_mm512_loadu_si512((const void *)w), idx,
                                      _mm512_loadu_si512((const void *)(w + 8)));
    } else {
        v = _mm512_castsi128_si512(_mm_loadu_si128((const __m128i *)(w + 1)));
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(w + 18)), 1);
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(w + 35)), 2);
        v = _mm512_inserti32x4(v, _mm_loadu_si128((const __m128i *)(w + 52)), 3);
    }
    *lo = _mm512_and_si512(v, m4);
    *hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), m4);
    if (dt == SMOE_WDT_MXFP4) {
        const __m512i kv = _mm512_broadcast_i32x4(
            _mm_setr_epi8(12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0));
        *lo = _mm512_shuffle_epi8(kv, *lo);
        *hi = _mm512_shuffle_epi8(kv, *hi);
    }
}

/* The four blocks' d, each in its block's four lanes.  Q4_0: the f16 at bytes 0, 18, 36, 54,
 * words 0, 9, 18, 27 of the group, spread by one word permute and converted.  MXFP4: the
 * E8M0 bytes at 0, 17, 34, 51 gathered into one general register, 2^(e - 128) built in four
 * lanes as e8m0_half does (e < 2: the subnormals), then spread by one permute (four 128-bit
 * loads and inserts before: the same bits, 1.10-1.14x faster at four tokens on a Zen 5). */
AI __m512 q4x_d(int32_t dt, const uint8_t *w) {
    if (dt == SMOE_WDT_MXFP4) {
        const uint32_t e4 = (uint32_t)w[0] | (uint32_t)w[17] << 8 | (uint32_t)w[34] << 16 |
                            (uint32_t)w[51] << 24;
        const __m128i e = _mm_cvtepu8_epi32(_mm_cvtsi32_si128((int)e4));
        const __m128i normal = _mm_slli_epi32(_mm_sub_epi32(e, _mm_set1_epi32(1)), 23);
        const __m128i sub = _mm_sllv_epi32(_mm_set1_epi32(0x00200000), e);
        const __m128i d4 = _mm_mask_blend_epi32(_mm_cmplt_epu32_mask(e, _mm_set1_epi32(2)),
                                                normal, sub);
        return _mm512_permutexvar_ps(
            _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3),
            _mm512_castps128_ps512(_mm_castsi128_ps(d4)));
    }
    static const int16_t dw[32] = {0, 0, 0, 0, 9, 9, 9, 9, 18, 18, 18, 18, 27, 27, 27, 27};
    const __m512i idx = _mm512_loadu_si512((const void *)dw);
    return _mm512_cvtph_ps(_mm512_castsi512_si256(
        _mm512_permutexvar_epi16(idx, _mm512_loadu_si512((const void *)w))));
}

/* Blocks b0..nb-1 of a Q4_0 / Q8_0 / MXFP4 row w (bb bytes a block) against one token in
 * the AVX2 form: what is left of a row past the VNNI groups. */
AI float q32_tail(int32_t dt, const uint8_t *w, size_t bb, uint32_t b0, uint32_t nb,
                  const xin *x) {
    __m256 tail = _mm256_setzero_ps();
    for (uint32_t t = b0; t < nb; t++) {
        const uint8_t *wb = w + bb * t;
        tail = q32_dot(q32_of(dt, wb), b32_scale(dt, wb), x->q + 32 * t, x->s[t], tail);
    }
    return hsum8(tail);
}

/* One token's input as rows_q4x_vnni's steps take it, built once a call (gateup_q4x_one,
 * down_q4x_one; the multi-token calls of gateup_vnni_tiles / down_vnni_tiles where q4x_tiled
 * says so) instead of once a row pair: per four blocks the int8 values' two shuffles, the
 * start value and the four scales spread over their lanes, six of a step's operations.
 * MXFP4, bound by its own work at one token (from L3 it read 26 GB/s where Q4_0 reads 40),
 * gained 1.07-1.16x with its scale change above; Q4_0, waiting on memory, 1.0-1.02x (Zen 5,
 * 1 thread, kernels_epyc_zen5_mxfp4_prep_ab.json). */
typedef struct q4xg {
    __m512i xlo, xhi, init;
    __m512 xs;
} q4xg;
#define Q4XG_MAX 128 /* groups on the stack: n <= 16384 columns (32 KiB) */

/* The group of blocks b .. b + 3 of token x as q4xg holds it. */
AI q4xg q4x_group(int32_t dt, const xin *x, uint32_t b) {
    const int off = dt == SMOE_WDT_MXFP4 ? 3 : 2; /* the offset per lane: 12 / 4, 8 / 4 */
    const __m512i rep4 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    q4xg g;
    const __m512i X0 = _mm512_loadu_si512((const void *)(x->q + 32 * b));
    const __m512i X1 = _mm512_loadu_si512((const void *)(x->q + 32 * b + 64));
    g.xlo = _mm512_shuffle_i64x2(X0, X1, _MM_SHUFFLE(2, 0, 2, 0));
    g.xhi = _mm512_shuffle_i64x2(X0, X1, _MM_SHUFFLE(3, 1, 3, 1));
    const __m128i s4 = _mm_cvtepi16_epi32(_mm_loadl_epi64((const __m128i *)(x->bs + b)));
    g.init = _mm512_permutexvar_epi32(
        rep4, _mm512_castsi128_si512(_mm_mullo_epi32(s4, _mm_set1_epi32(-off))));
    g.xs = _mm512_permutexvar_ps(rep4, _mm512_castps128_ps512(_mm_loadu_ps(x->s + b)));
    return g;
}

AI void q4x_prep(int32_t dt, const xin *x, uint32_t n, q4xg *g) {
    for (uint32_t b = 0; b + 4 <= n / 32; b += 4, g++) *g = q4x_group(dt, x, b);
}

/* nr (1 or 2) Q4_0 or MXFP4 rows w[r] of n columns against nt (1 .. VT) tokens x[t]:
 * res[r * VT + t].  Each four blocks of a row are unpacked once for the nt tokens; each (row,
 * token) sum takes the same operations in the same order at any nt (its own accumulator, the
 * scale d * s_x rounded as at one token, then the tail and the reduction), so a token's
 * result is bit for bit the one-token call's (batch invariance, INVARIANT_T).  g: the tokens'
 * inputs as q4x_prep built them (token t's n / 128 groups at g + t * (n / 128)), or NULL to
 * build each group here. */
#define VT 4
AI void rows_q4x_vnni(int32_t dt, const uint8_t *const *w, const int nr, const xin *x,
                      const q4xg *g, const uint32_t nt, uint32_t n, float *res) {
    const uint32_t nb = n / 32, bb = smoe_wdt_block_bytes(dt), gs = n / 128;
    __m512 acc[2][VT];
    for (int r = 0; r < 2; r++)
        for (uint32_t t = 0; t < VT; t++) acc[r][t] = _mm512_setzero_ps();
    uint32_t b = 0;
    for (; b + 4 <= nb; b += 4) {
        __m512i lo[2], hi[2];
        __m512 d[2];
        for (int r = 0; r < nr; r++) {
            const uint8_t *wb = w[r] + (size_t)bb * b;
            _mm_prefetch((const char *)(wb + PF_VNNI), _MM_HINT_T0);
            _mm_prefetch((const char *)(wb + PF_VNNI + 64), _MM_HINT_T0);
            q4x_unpack(dt, wb, &lo[r], &hi[r]);
            d[r] = q4x_d(dt, wb);
        }
        for (uint32_t t = 0; t < nt; t++) {
            const q4xg c = g ? g[t * gs + b / 4] : q4x_group(dt, &x[t], b);
            for (int r = 0; r < nr; r++) {
                const __m512i sumi =
                    _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(c.init, lo[r], c.xlo), hi[r], c.xhi);
                acc[r][t] = _mm512_fmadd_ps(_mm512_mul_ps(d[r], c.xs), _mm512_cvtepi32_ps(sumi),
                                            acc[r][t]);
            }
        }
    }
    for (int r = 0; r < nr; r++) /* fewer than four blocks left: the AVX2 step */
        for (uint32_t t = 0; t < nt; t++)
            res[r * VT + t] =
                _mm512_reduce_add_ps(acc[r][t]) + q32_tail(dt, w[r], bb, b, nb, &x[t]);
}

/* rows_q4x_vnni at one token on the input q4x_prep built: the same operations in the same
 * order, so the same bits. */
AI void rows_q4x_vnni_g(int32_t dt, const uint8_t *const *w, const int nr, const q4xg *g,
                        const xin *x, uint32_t n, float *res) {
    const uint32_t nb = n / 32, bb = smoe_wdt_block_bytes(dt);
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    uint32_t b = 0;
    for (; b + 4 <= nb; b += 4, g++) {
        for (int r = 0; r < nr; r++) {
            const uint8_t *wb = w[r] + (size_t)bb * b;
            _mm_prefetch((const char *)(wb + PF_VNNI), _MM_HINT_T0);
            _mm_prefetch((const char *)(wb + PF_VNNI + 64), _MM_HINT_T0);
            __m512i lo, hi;
            q4x_unpack(dt, wb, &lo, &hi);
            const __m512 d = q4x_d(dt, wb);
            const __m512i sumi =
                _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(g->init, lo, g->xlo), hi, g->xhi);
            acc[r] = _mm512_fmadd_ps(_mm512_mul_ps(d, g->xs), _mm512_cvtepi32_ps(sumi), acc[r]);
        }
    }
    for (int r = 0; r < nr; r++)
        res[r * VT] = _mm512_reduce_add_ps(acc[r]) + q32_tail(dt, w[r], bb, b, nb, x);
}

/* nr (1 or 2) Q8_0 rows w[r] of n columns against nt (1 .. VT) tokens x[t]: res[r * VT +
 * t].  Two blocks (64 columns) per vpdpbusd, |w| the unsigned operand and x negated where w
 * is negative (AVX-512 has no vpsignb; a -128 byte is 128 as unsigned, its magnitude), as the
 * AVX2 form's sign trick; the two blocks' d * s_x spread over their eight lanes each.  A row's
 * two blocks are loaded, their signs and magnitudes taken and their d converted once for the
 * nt tokens; each (row, token) sum then takes the one-token operations in the one-token order
 * (its own accumulator), so a token's result is bit for bit the one-token call's. */
AI void rows_q8_0_vnni(const uint8_t *const *w, const int nr, const xin *x, const uint32_t nt,
                       uint32_t n, float *res) {
    const uint32_t nb = n / 32;
    const __m512i rep8 = _mm512_setr_epi32(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1);
    __m512 acc[2][VT];
    for (int r = 0; r < 2; r++)
        for (uint32_t t = 0; t < VT; t++) acc[r][t] = _mm512_setzero_ps();
    uint32_t b = 0;
    for (; b + 2 <= nb; b += 2) {
        __m512i mag[2];
        __mmask64 neg[2];
        __m128 d[2];
        for (int r = 0; r < nr; r++) {
            const uint8_t *wb = w[r] + (size_t)34 * b;
            _mm_prefetch((const char *)(wb + PF_VNNI), _MM_HINT_T0);
            _mm_prefetch((const char *)(wb + PF_VNNI + 64), _MM_HINT_T0);
            const __m512i v = _mm512_inserti64x4(
                _mm512_castsi256_si512(_mm256_loadu_si256((const __m256i *)(wb + 2))),
                _mm256_loadu_si256((const __m256i *)(wb + 36)), 1);
            neg[r] = _mm512_movepi8_mask(v);
            mag[r] = _mm512_abs_epi8(v);
            uint16_t h[2];
            memcpy(&h[0], wb, 2);
            memcpy(&h[1], wb + 34, 2);
            d[r] = _mm_cvtph_ps(_mm_cvtsi32_si128((int)(h[0] | (uint32_t)h[1] << 16)));
        }
        for (uint32_t t = 0; t < nt; t++) {
            const __m512i X = _mm512_loadu_si512((const void *)(x[t].q + 32 * b));
            const __m128 xs2 = _mm_castpd_ps(_mm_load_sd((const double *)(x[t].s + b)));
            for (int r = 0; r < nr; r++) {
                const __m512i xv =
                    _mm512_mask_sub_epi8(X, neg[r], _mm512_setzero_si512(), X);
                const __m512i p = _mm512_dpbusd_epi32(_mm512_setzero_si512(), mag[r], xv);
                const __m128 sc = _mm_mul_ps(d[r], xs2);
                acc[r][t] = _mm512_fmadd_ps(
                    _mm512_permutexvar_ps(rep8, _mm512_castps128_ps512(sc)),
                    _mm512_cvtepi32_ps(p), acc[r][t]);
            }
        }
    }
    for (int r = 0; r < nr; r++) /* an odd last block: the AVX2 step */
        for (uint32_t t = 0; t < nt; t++)
            res[r * VT + t] = _mm512_reduce_add_ps(acc[r][t]) +
                              q32_tail(SMOE_WDT_Q8_0, w[r], 34, b, nb, &x[t]);
}

/* The vpshufb pattern that spreads Q4_K's eight scales (widened to int16, in each 128-bit
 * lane) over a 512-bit step: int16 lanes 0-15 take scale j1, 16-31 scale j2 (bytes 2j,
 * 2j + 1). */
AI __m512i q4k_sc_pattern(int j1, int j2) {
    return _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_set1_epi16((short)(0x0100 + 0x0202 * j1))),
        _mm256_set1_epi16((short)(0x0100 + 0x0202 * j2)), 1);
}

/* Bits j1 (bytes 0-31) and j2 (bytes 32-63) of the 32 bytes of hb (broadcast to both
 * 256-bit halves) at bit 4 of each byte: the fifth bits of Q5_K sub-blocks j1 and j2 (as the
 * value 16) lined up with a 64-byte load of the block's nibbles. */
AI __m512i q5k_bits(__m512i hb, int j1, int j2) {
    const __m512i cnt = _mm512_inserti64x4(_mm512_set1_epi16((short)j1),
                                           _mm256_set1_epi16((short)j2), 1);
    return _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(hb, cnt), _mm512_set1_epi8(1)),
                             4);
}

/* The Q4_K (five = 0, 144 bytes) or Q5_K (five = 1, 176 bytes: its 32 bytes of fifth bits at
 * 16, the nibbles at 48) super-block at wb (prefetched PF_VNNI on) as the 512-bit steps take
 * it: q[0..3] its values (Q4_K: nibbles in [0, 15]; Q5_K: with the fifth bit ORed in, [0, 31])
 * lined up with the input's xl0, xh0, xl1, xh1, sc[0..3] their sub-blocks' 6-bit scales as
 * int16 (vpdpwssd's operand), *mins the eight mins widened, *dmin (d, dmin) in f32. */
AI void q4k_super(const uint8_t *wb, __m512i q[4], __m512i sc[4], __m128i *mins, __m128 *dmin,
                  const int five) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const uint32_t qo = five ? 48 : 16;
    _mm_prefetch((const char *)(wb + PF_VNNI), _MM_HINT_T0);
    _mm_prefetch((const char *)(wb + PF_VNNI + 64), _MM_HINT_T0);
    _mm_prefetch((const char *)(wb + PF_VNNI + 128), _MM_HINT_T0);
    const __m128i u = q4k_unpack_v(wb + 4);
    const __m512i s8 = _mm512_broadcast_i32x4(_mm_cvtepu8_epi16(u));
    const __m512i v0 = _mm512_loadu_si512((const void *)(wb + qo));
    const __m512i v1 = _mm512_loadu_si512((const void *)(wb + qo + 64));
    q[0] = _mm512_and_si512(v0, m4);
    q[1] = _mm512_and_si512(_mm512_srli_epi16(v0, 4), m4);
    q[2] = _mm512_and_si512(v1, m4);
    q[3] = _mm512_and_si512(_mm512_srli_epi16(v1, 4), m4);
    if (five) { /* sub-blocks 0 | 2, 1 | 3 (v0's low, high nibbles), 4 | 6, 5 | 7 (v1's) */
        const __m512i hb =
            _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)(wb + 16)));
        q[0] = _mm512_or_si512(q[0], q5k_bits(hb, 0, 2));
        q[1] = _mm512_or_si512(q[1], q5k_bits(hb, 1, 3));
        q[2] = _mm512_or_si512(q[2], q5k_bits(hb, 4, 6));
        q[3] = _mm512_or_si512(q[3], q5k_bits(hb, 5, 7));
    }
    sc[0] = _mm512_shuffle_epi8(s8, q4k_sc_pattern(0, 2));
    sc[1] = _mm512_shuffle_epi8(s8, q4k_sc_pattern(1, 3));
    sc[2] = _mm512_shuffle_epi8(s8, q4k_sc_pattern(4, 6));
    sc[3] = _mm512_shuffle_epi8(s8, q4k_sc_pattern(5, 7));
    *mins = _mm_cvtepu8_epi16(_mm_srli_si128(u, 8));
    uint32_t dd;
    memcpy(&dd, wb, 4);
    *dmin = _mm_cvtph_ps(_mm_cvtsi32_si128((int)dd));
}

/* A super-block's 256 prepared int8 values as the 512-bit steps take them: x[0..3] = xl0,
 * xh0, xl1, xh1 (the columns of the nibbles q[0..3] of q4k_super, two vshufi64x2 each). */
AI void q4k_x(const int8_t *xq, __m512i x[4]) {
    const __m512i X0 = _mm512_loadu_si512((const void *)xq);
    const __m512i X1 = _mm512_loadu_si512((const void *)(xq + 64));
    const __m512i X2 = _mm512_loadu_si512((const void *)(xq + 128));
    const __m512i X3 = _mm512_loadu_si512((const void *)(xq + 192));
    x[0] = _mm512_shuffle_i64x2(X0, X1, _MM_SHUFFLE(1, 0, 1, 0));
    x[1] = _mm512_shuffle_i64x2(X0, X1, _MM_SHUFFLE(3, 2, 3, 2));
    x[2] = _mm512_shuffle_i64x2(X2, X3, _MM_SHUFFLE(1, 0, 1, 0));
    x[3] = _mm512_shuffle_i64x2(X2, X3, _MM_SHUFFLE(3, 2, 3, 2));
}

/* A super-block's integer sums against one token: the four steps' pair sums (vpmaddubsw)
 * times their sub-blocks' scales, added in int32 (vpdpwssd), in this order. */
AI __m512i q4k_sum(const __m512i q[4], const __m512i sc[4], const __m512i x[4]) {
    __m512i sumi = _mm512_dpwssd_epi32(_mm512_setzero_si512(), _mm512_maddubs_epi16(q[0], x[0]),
                                       sc[0]);
    sumi = _mm512_dpwssd_epi32(sumi, _mm512_maddubs_epi16(q[1], x[1]), sc[1]);
    sumi = _mm512_dpwssd_epi32(sumi, _mm512_maddubs_epi16(q[2], x[2]), sc[2]);
    return _mm512_dpwssd_epi32(sumi, _mm512_maddubs_epi16(q[3], x[3]), sc[3]);
}

/* nr (1 or 2) Q4_K rows w[r] of n columns against one token: the AVX2 form's integer sums
 * (the nibbles q in [0, 15] unsigned against the int8 x in vpmaddubsw, pairs <= 3810; times
 * the sub-block's 6-bit scale and summed in int32), 128 columns per 512-bit step.  A 64-byte
 * load of a block's nibbles holds four sub-blocks: its low nibbles are sub-blocks 4p and
 * 4p + 2 (bytes 0-31, 32-63), its high nibbles 4p + 1 and 4p + 3, so the input's matching
 * columns are two vshufi64x2 of the 128 prepared int8 values, shared by the rows; vpdpwssd
 * multiplies the pair sums by their sub-block's scale (a vpshufb of the eight scales
 * broadcast to the four 128-bit lanes) and adds them in one instruction.  The min term and
 * the f32 steps are the AVX2 form's, so the result equals it to float rounding. */
AI void rows_q4_k_vnni(const uint8_t *const *w, const int nr, const xin *x, uint32_t n,
                       float *res, const int five) {
    const uint32_t nsb = n / 256, bb = five ? 176 : 144;
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    __m128 accm[2] = {_mm_setzero_ps(), _mm_setzero_ps()};
    const int8_t *xq = x->q;
    for (uint32_t s = 0; s < nsb; s++, xq += 256) {
        __m512i xv[4];
        q4k_x(xq, xv);
        const __m128i bsv = _mm_loadu_si128((const __m128i *)(x->bs + 8 * s));
        const float xs = x->s[s];
        for (int r = 0; r < nr; r++) {
            __m512i q[4], sc[4];
            __m128i mins;
            __m128 dmin;
            q4k_super(w[r] + (size_t)bb * s, q, sc, &mins, &dmin, five);
            const __m512i sumi = q4k_sum(q, sc, xv);
            const __m128 dm = _mm_mul_ps(dmin, _mm_set1_ps(xs));
            acc[r] = _mm512_fmadd_ps(_mm512_broadcastss_ps(dm), _mm512_cvtepi32_ps(sumi), acc[r]);
            const __m128i pm = _mm_madd_epi16(mins, bsv);
            accm[r] = _mm_fmadd_ps(_mm_shuffle_ps(dm, dm, 0x55), _mm_cvtepi32_ps(pm), accm[r]);
        }
    }
    for (int r = 0; r < nr; r++) res[r] = _mm512_reduce_add_ps(acc[r]) - hsum4(accm[r]);
}

/* A token's n int8 values in q4k_x's order (its four vectors per super-block one after
 * another): what a multi-token Q4_K / Q5_K call prepares once (tiles_input) instead of
 * shuffling per row and token. */
AI void q4k_prep(const xin *x, uint32_t n, int8_t *xp) {
    for (uint32_t s = 0; s < n / 256; s++) {
        __m512i xv[4];
        q4k_x(x->q + (size_t)256 * s, xv);
        for (int k = 0; k < 4; k++) _mm512_storeu_si512((void *)(xp + 256 * s + 64 * k), xv[k]);
    }
}

/* One Q4_K row w of n columns against nt (1 .. VT) tokens x[t]: res[t], each (row, token) sum
 * with rows_q4_k_vnni's operations in its order (the same integer sums, d * s_x and dmin *
 * s_x rounded per token as there, the two accumulators, the reduction), so a token's result is
 * bit for bit its one-token call's.  A super-block's nibbles, scales and mins are unpacked once
 * for the nt tokens (a row alone: its unpacked super-block takes eight registers).  xp: the
 * tokens' values as q4k_prep laid them out (token t's at xp + t * n), or NULL to shuffle
 * x[t].q here. */
AI void row_q4_k_vnni_tiled(const uint8_t *w, const xin *x, const int8_t *xp, const uint32_t nt,
                            uint32_t n, float *res, const int five) {
    const uint32_t nsb = n / 256, bb = five ? 176 : 144;
    __m512 acc[VT];
    __m128 accm[VT];
    for (uint32_t t = 0; t < VT; t++) acc[t] = _mm512_setzero_ps(), accm[t] = _mm_setzero_ps();
    for (uint32_t s = 0; s < nsb; s++) {
        __m512i q[4], sc[4];
        __m128i mins;
        __m128 dmin;
        q4k_super(w + (size_t)bb * s, q, sc, &mins, &dmin, five);
        for (uint32_t t = 0; t < nt; t++) {
            __m512i xv[4];
            if (xp) {
                const int8_t *xs = xp + (size_t)t * n + 256 * s;
                for (int k = 0; k < 4; k++) xv[k] = _mm512_loadu_si512((const void *)(xs + 64 * k));
            } else
                q4k_x(x[t].q + (size_t)256 * s, xv);
            const __m512i sumi = q4k_sum(q, sc, xv);
            const __m128 dm = _mm_mul_ps(dmin, _mm_set1_ps(x[t].s[s]));
            acc[t] = _mm512_fmadd_ps(_mm512_broadcastss_ps(dm), _mm512_cvtepi32_ps(sumi), acc[t]);
            const __m128i bsv = _mm_loadu_si128((const __m128i *)(x[t].bs + 8 * s));
            const __m128i pm = _mm_madd_epi16(mins, bsv);
            accm[t] = _mm_fmadd_ps(_mm_shuffle_ps(dm, dm, 0x55), _mm_cvtepi32_ps(pm), accm[t]);
        }
    }
    for (uint32_t t = 0; t < nt; t++) res[t] = _mm512_reduce_add_ps(acc[t]) - hsum4(accm[t]);
}

/* Half h (0 or 1) of the Q6_K super-block at wb as rows_q6_k_vnni's 512-bit steps take it:
 * *qa / *qb its 6-bit values q in [0, 63] lined up with the input's first / second 64 int8
 * values, *sa / *sb their 16 columns' int8 scales widened to int16 (vpdpwssd's operand). */
AI void q6k_half(const uint8_t *wb, uint32_t h, __m512i *qa, __m512i *qb, __m512i *sa,
                 __m512i *sb) {
    const __m512i m4 = _mm512_set1_epi8(0x0F), m3 = _mm512_set1_epi8(3);
    const __m512i sh02 = _mm512_inserti64x4(_mm512_setzero_si512(), _mm256_set1_epi16(2), 1);
    const __m512i sh46 = _mm512_inserti64x4(_mm512_set1_epi16(4), _mm256_set1_epi16(6), 1);
    /* int16 lanes of 128-bit lane j: scale j (first 64 columns) or 4 + j (last 64) */
    const __m512i ia = _mm512_set_epi64(0x0003000300030003LL, 0x0003000300030003LL,
                                        0x0002000200020002LL, 0x0002000200020002LL,
                                        0x0001000100010001LL, 0x0001000100010001LL, 0, 0);
    const __m512i ib = _mm512_add_epi16(ia, _mm512_set1_epi16(4));
    const uint8_t *ql = wb + 64 * h, *qh = wb + 128 + 32 * h;
    const __m512i L = _mm512_loadu_si512((const void *)ql);
    const __m512i HB = _mm512_broadcast_i64x4(_mm256_loadu_si256((const __m256i *)qh));
    *qa = _mm512_or_si512(_mm512_and_si512(L, m4),
                          _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(HB, sh02), m3), 4));
    *qb = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(L, 4), m4),
                          _mm512_slli_epi16(_mm512_and_si512(_mm512_srlv_epi16(HB, sh46), m3), 4));
    const __m512i sc = _mm512_castsi128_si512(
        _mm_cvtepi8_epi16(_mm_loadl_epi64((const __m128i *)(wb + 192 + 8 * h))));
    *sa = _mm512_permutexvar_epi16(ia, sc);
    *sb = _mm512_permutexvar_epi16(ib, sc);
}

/* nr (1 or 2) Q6_K rows w[r] of n columns against one token: the AVX2 form's integer sums,
 * a half super-block (128 columns) per 512-bit step.  A half's 64 bytes of low bits are its
 * columns 0-31 | 32-63 (low nibbles) and 64-95 | 96-127 (high nibbles); its 32 bytes of high
 * bits, broadcast to both 256-bit halves and shifted by (0, 2) or (4, 6) bits per half
 * (vpsrlvw), complete them, so q in [0, 63] lines up with the input's 128 int8 values as they
 * are loaded.  32 * x (the q - 32 offset's vpmaddubsw) is the input's alone: once per half
 * for both rows.  vpdpwssd multiplies the pair sums by their 16 columns' int8 scale (vpermw
 * of the half's eight, widened once) and adds them.  Sums and the f32 step as the AVX2 form:
 * the result equals it to float rounding. */
AI void rows_q6_k_vnni(const uint8_t *const *w, const int nr, const xin *x, uint32_t n,
                       float *res) {
    const uint32_t nsb = n / 256;
    const __m512i k32 = _mm512_set1_epi8(32);
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    const int8_t *xq = x->q;
    for (uint32_t s = 0; s < nsb; s++) {
        __m512i sumi[2] = {_mm512_setzero_si512(), _mm512_setzero_si512()};
        for (uint32_t h = 0; h < 2; h++, xq += 128) {
            const __m512i X0 = _mm512_loadu_si512((const void *)xq);
            const __m512i X1 = _mm512_loadu_si512((const void *)(xq + 64));
            const __m512i o0 = _mm512_maddubs_epi16(k32, X0), o1 = _mm512_maddubs_epi16(k32, X1);
            for (int r = 0; r < nr; r++) {
                const uint8_t *wb = w[r] + (size_t)210 * s;
                if (h == 0)
                    for (uint32_t k = 0; k < 4; k++)
                        _mm_prefetch((const char *)(wb + PF_VNNI + 64 * k), _MM_HINT_T0);
                __m512i qa, qb, sa, sb;
                q6k_half(wb, h, &qa, &qb, &sa, &sb);
                sumi[r] = _mm512_dpwssd_epi32(
                    sumi[r], _mm512_sub_epi16(_mm512_maddubs_epi16(qa, X0), o0), sa);
                sumi[r] = _mm512_dpwssd_epi32(
                    sumi[r], _mm512_sub_epi16(_mm512_maddubs_epi16(qb, X1), o1), sb);
            }
        }
        for (int r = 0; r < nr; r++)
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(ld_f16(w[r] + (size_t)210 * s + 208) * x->s[s]),
                                     _mm512_cvtepi32_ps(sumi[r]), acc[r]);
    }
    for (int r = 0; r < nr; r++) res[r] = _mm512_reduce_add_ps(acc[r]);
}

/* One Q6_K row w of n columns against nt (1 .. VT) tokens x[t]: res[t], each (row, token) sum
 * with rows_q6_k_vnni's operations in its order (a half super-block's two vpdpwssd steps, the
 * two halves, then d * s_x), so a token's result is bit for bit its one-token call's.  A half
 * super-block's 6-bit values and scales are unpacked once for the nt tokens. */
AI void row_q6_k_vnni_tiled(const uint8_t *w, const xin *x, const uint32_t nt, uint32_t n,
                            float *res) {
    const uint32_t nsb = n / 256;
    const __m512i k32 = _mm512_set1_epi8(32);
    __m512 acc[VT];
    for (uint32_t t = 0; t < VT; t++) acc[t] = _mm512_setzero_ps();
    for (uint32_t s = 0; s < nsb; s++) {
        const uint8_t *wb = w + (size_t)210 * s;
        for (uint32_t k = 0; k < 4; k++)
            _mm_prefetch((const char *)(wb + PF_VNNI + 64 * k), _MM_HINT_T0);
        __m512i sumi[VT];
        for (uint32_t t = 0; t < VT; t++) sumi[t] = _mm512_setzero_si512();
        for (uint32_t h = 0; h < 2; h++) {
            __m512i qa, qb, sa, sb;
            q6k_half(wb, h, &qa, &qb, &sa, &sb);
            for (uint32_t t = 0; t < nt; t++) {
                const int8_t *xq = x[t].q + (size_t)256 * s + 128 * h;
                const __m512i X0 = _mm512_loadu_si512((const void *)xq);
                const __m512i X1 = _mm512_loadu_si512((const void *)(xq + 64));
                const __m512i o0 = _mm512_maddubs_epi16(k32, X0);
                const __m512i o1 = _mm512_maddubs_epi16(k32, X1);
                sumi[t] = _mm512_dpwssd_epi32(
                    sumi[t], _mm512_sub_epi16(_mm512_maddubs_epi16(qa, X0), o0), sa);
                sumi[t] = _mm512_dpwssd_epi32(
                    sumi[t], _mm512_sub_epi16(_mm512_maddubs_epi16(qb, X1), o1), sb);
            }
        }
        const float d = ld_f16(wb + 208);
        for (uint32_t t = 0; t < nt; t++)
            acc[t] = _mm512_fmadd_ps(_mm512_set1_ps(d * x[t].s[s]), _mm512_cvtepi32_ps(sumi[t]),
                                     acc[t]);
    }
    for (uint32_t t = 0; t < nt; t++) res[t] = _mm512_reduce_add_ps(acc[t]);
}

/* The IQ4_XS super-block at wb (136 bytes: d, scales_h, scales_l, then 128 bytes of nibbles;
 * prefetched PF_VNNI on) as the 512-bit steps take it.  A 64-byte load of the nibbles holds
 * four sub-blocks, one a 128-bit lane, low nibbles columns 0-15 and high ones 16-31 (Q4_0's
 * layout without the scales in between), so q[0..3] (sub-blocks 0-3 low, high, 4-7 low,
 * high) line up with iq4xs_x's input.  Each nibble is looked up (vpshufb) in kv + 128, ggml's
 * kvalues_iq4nl as unsigned bytes in [1, 241], vpdpbusd's unsigned operand; the offset -128 *
 * (the sub-block's x sum) is the accumulator's start value (iq4xs_init).  sc[0..1] are the
 * sub-blocks' scales ls - 32 in [-32, 31] as int32, each in its sub-block's four lanes (0-3,
 * 4-7): the low four bits at bit 4j of scales_l, the high two at bit 2j of scales_h. */
AI void iq4xs_super(const uint8_t *wb, __m512i q[4], __m512i sc[2]) {
    const __m512i m4 = _mm512_set1_epi8(0x0F);
    const __m512i kv = _mm512_broadcast_i32x4(_mm_xor_si128(
        _mm_loadu_si128((const __m128i *)(const void *)iq4nl_values), _mm_set1_epi8(-128)));
    const __m512i rep4 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    _mm_prefetch((const char *)(wb + PF_VNNI), _MM_HINT_T0);
    _mm_prefetch((const char *)(wb + PF_VNNI + 64), _MM_HINT_T0);
    _mm_prefetch((const char *)(wb + PF_VNNI + 128), _MM_HINT_T0);
    const __m512i v0 = _mm512_loadu_si512((const void *)(wb + 8));
    const __m512i v1 = _mm512_loadu_si512((const void *)(wb + 72));
    q[0] = _mm512_shuffle_epi8(kv, _mm512_and_si512(v0, m4));
    q[1] = _mm512_shuffle_epi8(kv, _mm512_and_si512(_mm512_srli_epi16(v0, 4), m4));
    q[2] = _mm512_shuffle_epi8(kv, _mm512_and_si512(v1, m4));
    q[3] = _mm512_shuffle_epi8(kv, _mm512_and_si512(_mm512_srli_epi16(v1, 4), m4));
    uint16_t sh;
    uint32_t sl;
    memcpy(&sh, wb + 2, 2);
    memcpy(&sl, wb + 4, 4);
    const __m256i sh_lo = _mm256_setr_epi32(0, 4, 8, 12, 16, 20, 24, 28);
    const __m256i sh_hi = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
    const __m256i lo = _mm256_and_si256(_mm256_srlv_epi32(_mm256_set1_epi32((int)sl), sh_lo),
                                        _mm256_set1_epi32(0x0F));
    const __m256i hi = _mm256_and_si256( /* (sh >> 2j & 3) << 4 */
        _mm256_srlv_epi32(_mm256_set1_epi32((int)sh << 4), sh_hi), _mm256_set1_epi32(0x30));
    const __m512i ls = _mm512_castsi256_si512(
        _mm256_sub_epi32(_mm256_or_si256(lo, hi), _mm256_set1_epi32(32)));
    sc[0] = _mm512_permutexvar_epi32(rep4, ls);
    sc[1] = _mm512_permutexvar_epi32(_mm512_add_epi32(rep4, _mm512_set1_epi32(4)), ls);
}

/* A super-block's 256 prepared int8 values as iq4xs_super's steps take them: x[0..3] = the
 * columns 0-15 of sub-blocks 0-3, their columns 16-31, then the same of sub-blocks 4-7 (two
 * vshufi64x2 of two loads each, as Q4_0's four blocks); init[0..1] the start values, -32 *
 * (the prepared sum of sub-block j's 32 int8 x) in each of its four lanes (their sum: -128 *
 * the sum, the table's offset). */
AI void iq4xs_x(const int8_t *xq, const int16_t *bs, __m512i x[4], __m512i init[2]) {
    const __m512i rep4 = _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3);
    const __m512i X0 = _mm512_loadu_si512((const void *)xq);
    const __m512i X1 = _mm512_loadu_si512((const void *)(xq + 64));
    const __m512i X2 = _mm512_loadu_si512((const void *)(xq + 128));
    const __m512i X3 = _mm512_loadu_si512((const void *)(xq + 192));
    x[0] = _mm512_shuffle_i64x2(X0, X1, _MM_SHUFFLE(2, 0, 2, 0));
    x[1] = _mm512_shuffle_i64x2(X0, X1, _MM_SHUFFLE(3, 1, 3, 1));
    x[2] = _mm512_shuffle_i64x2(X2, X3, _MM_SHUFFLE(2, 0, 2, 0));
    x[3] = _mm512_shuffle_i64x2(X2, X3, _MM_SHUFFLE(3, 1, 3, 1));
    const __m512i nb = _mm512_castsi256_si512(_mm256_sub_epi32(
        _mm256_setzero_si256(),
        _mm256_slli_epi32(_mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i *)bs)), 5)));
    init[0] = _mm512_permutexvar_epi32(rep4, nb);
    init[1] = _mm512_permutexvar_epi32(_mm512_add_epi32(rep4, _mm512_set1_epi32(4)), nb);
}

/* A super-block's integer sum against one token: per lane (kv + 128) . x - 32 * sum x over
 * the lane's 8 products (|.| <= 8 * 127 * 127, as (w) . x with w in [-127, 113]), times the
 * sub-block's scale (vpmulld), the two halves added: |lane| <= 2 * 32 * 129032 < 2^23, so
 * its float conversion is exact. */
AI __m512i iq4xs_sum(const __m512i q[4], const __m512i sc[2], const __m512i x[4],
                     const __m512i init[2]) {
    const __m512i s0 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(init[0], q[0], x[0]), q[1], x[1]);
    const __m512i s1 = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(init[1], q[2], x[2]), q[3], x[3]);
    return _mm512_add_epi32(_mm512_mullo_epi32(s0, sc[0]), _mm512_mullo_epi32(s1, sc[1]));
}

/* nr (1 or 2) IQ4_XS rows w[r] of n columns against one token: the AVX2 form's integer sums
 * (the same products w . x, summed per sub-block and times its scale in int32) by vpdpbusd on
 * the table offset to unsigned bytes, 128 columns per 512-bit step, the input's shuffles
 * shared by the rows; times d * s_x once per super-block, as the AVX2 form, so the result
 * equals it to float rounding (the AVX2 form ran at 0.42-0.56 of the read ceiling at one
 * token on a Zen 5 EPYC, 1 thread: its sign trick and vpmaddwd per 32 columns). */
AI void rows_iq4_xs_vnni(const uint8_t *const *w, const int nr, const xin *x, uint32_t n,
                         float *res) {
    const uint32_t nsb = n / 256;
    __m512 acc[2] = {_mm512_setzero_ps(), _mm512_setzero_ps()};
    for (uint32_t s = 0; s < nsb; s++) {
        __m512i xv[4], init[2];
        iq4xs_x(x->q + (size_t)256 * s, x->bs + 8 * s, xv, init);
        const float xs = x->s[s];
        for (int r = 0; r < nr; r++) {
            const uint8_t *wb = w[r] + (size_t)136 * s;
            __m512i q[4], sc[2];
            iq4xs_super(wb, q, sc);
            acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(ld_f16(wb) * xs),
                                     _mm512_cvtepi32_ps(iq4xs_sum(q, sc, xv, init)), acc[r]);
        }
    }
    for (int r = 0; r < nr; r++) res[r] = _mm512_reduce_add_ps(acc[r]);
}

/* One IQ4_XS row w of n columns against nt (1 .. VT) tokens x[t]: res[t], each (row, token)
 * with rows_iq4_xs_vnni's operations in its order, so a token's result is bit for bit its
 * one-token call's; a super-block's values and scales are looked up once for the nt tokens. */
AI void row_iq4_xs_vnni_tiled(const uint8_t *w, const xin *x, const uint32_t nt, uint32_t n,
                              float *res) {
    const uint32_t nsb = n / 256;
    __m512 acc[VT];
    for (uint32_t t = 0; t < VT; t++) acc[t] = _mm512_setzero_ps();
    for (uint32_t s = 0; s < nsb; s++) {
        const uint8_t *wb = w + (size_t)136 * s;
        __m512i q[4], sc[2];
        iq4xs_super(wb, q, sc);
        const float d = ld_f16(wb);
        for (uint32_t t = 0; t < nt; t++) {
            __m512i xv[4], init[2];
            iq4xs_x(x[t].q + (size_t)256 * s, x[t].bs + 8 * s, xv, init);
            acc[t] = _mm512_fmadd_ps(_mm512_set1_ps(d * x[t].s[s]),
                                     _mm512_cvtepi32_ps(iq4xs_sum(q, sc, xv, init)), acc[t]);
        }
    }
    for (uint32_t t = 0; t < nt; t++) res[t] = _mm512_reduce_add_ps(acc[t]);
}

/* nr (1 or 2) rows of dt (Q4_0, MXFP4, Q8_0, Q4_K, Q5_K, Q6_K or IQ4_XS) against nt (1 ..
 * VT) tokens x[t], each (row, token) as a one-token call computes it: res[r * VT + t]; a row's
 * blocks are unpacked once for the nt tokens.  p: the tokens' inputs prepared once a call
 * (tiles_input, prep_at: Q4_0 / MXFP4's q4xg groups, Q4_K / Q5_K's values in q4k_x's order),
 * NULL where there are none. */
AI void rows_vnni(int32_t dt, const uint8_t *const *w, const int nr, const xin *x,
                  const void *p, const uint32_t nt, uint32_t n, float *res) {
    if (dt == SMOE_WDT_Q4_0) { /* the format a constant in each form */
        rows_q4x_vnni(SMOE_WDT_Q4_0, w, nr, x, (const q4xg *)p, nt, n, res);
        return;
    }
    if (dt == SMOE_WDT_MXFP4) {
        rows_q4x_vnni(SMOE_WDT_MXFP4, w, nr, x, (const q4xg *)p, nt, n, res);
        return;
    }
    if (dt == SMOE_WDT_Q4_K && (nt > 1 || p)) { /* `five` a constant in each form */
        for (int k = 0; k < nr; k++)
            row_q4_k_vnni_tiled(w[k], x, (const int8_t *)p, nt, n, res + k * VT, 0);
        return;
    }
    if (dt == SMOE_WDT_Q5_K && (nt > 1 || p)) {
        for (int k = 0; k < nr; k++)
            row_q4_k_vnni_tiled(w[k], x, (const int8_t *)p, nt, n, res + k * VT, 1);
        return;
    }
    if (dt == SMOE_WDT_Q8_0) {
        rows_q8_0_vnni(w, nr, x, nt, n, res);
        return;
    }
    if (dt == SMOE_WDT_Q6_K && nt > 1) {
        for (int k = 0; k < nr; k++) row_q6_k_vnni_tiled(w[k], x, nt, n, res + k * VT);
        return;
    }
    if (dt == SMOE_WDT_IQ4_XS) {
        if (nt > 1)
            for (int k = 0; k < nr; k++) row_iq4_xs_vnni_tiled(w[k], x, nt, n, res + k * VT);
        else {
            float r[2];
            rows_iq4_xs_vnni(w, nr, x, n, r);
            for (int k = 0; k < nr; k++) res[k * VT] = r[k];
        }
        return;
    }
    for (uint32_t t = 0; t < nt; t++) { /* one token of Q4_K, Q5_K or Q6_K */
        float r[2];
        if (dt == SMOE_WDT_Q4_K)
            rows_q4_k_vnni(w, nr, &x[t], n, r, 0);
        else if (dt == SMOE_WDT_Q5_K)
            rows_q4_k_vnni(w, nr, &x[t], n, r, 1);
        else
            rows_q6_k_vnni(w, nr, &x[t], n, r);
        for (int k = 0; k < nr; k++) res[k * VT + t] = r[k];
    }
}

/* Whether the VNNI rows serve a matrix of dt: at any token count, every token in turn
 * through the one-token rows (batch invariance), INVARIANT_T tokens a pass (chunk_tokens).
 * Calls of more tokens (a prefill's tokens at one expert) used to run the AVX2 tiles: from
 * 17 tokens on, at 0.40x (Q4_0), 0.60-0.67x (Q4_K) and 0.63-0.66x (Q8_0) of the rate of
 * 16-token calls (OLMoE's shape, 1 thread, Intel Xeon with AMX). */
AI int vnni_rows_for(int32_t dt) {
    return dt == SMOE_WDT_Q4_0 || dt == SMOE_WDT_Q8_0 || dt == SMOE_WDT_Q4_K ||
           dt == SMOE_WDT_Q5_K || dt == SMOE_WDT_Q6_K || dt == SMOE_WDT_MXFP4 ||
           dt == SMOE_WDT_IQ4_XS;
}

/* Tokens in turn through the rows, `tile` (1 or VT) a call.  The one-token case (decode) gets
 * code of its own in which every count and the format are constants: the tiled rows with a
 * run-time token count read 5-10 % slower at one token on a Zen 5 EPYC, this form as fast as
 * the one-token rows before (kernels_epyc_zen5_q4x_vnni_tiles_ab.json). */
AI uint32_t tile_tokens(uint32_t T, uint32_t t0, const uint32_t tile) {
    return tile == 1 ? 1 : T - t0 < tile ? T - t0 : tile;
}

/* Groups of prepared input (q4xg) a multi-token Q4_0 / MXFP4 call builds on the stack: T
 * tokens of n / 128 (64 KiB: 16 tokens of 2048 columns, 4 of 8192; past that a call builds
 * each group where it is used). */
#define Q4XG_TILED_MAX 256

/* A multi-token call's inputs prepared once (tiles_input): Q4_0 / MXFP4 token t's q4xg groups
 * at g + t * (n / 128); Q4_K / Q5_K token t's int8 values in q4k_x's order at k + t * n. */
typedef union tiles_prep {
    q4xg g[Q4XG_TILED_MAX];
    int8_t k[Q4XG_TILED_MAX * sizeof(q4xg)];
} tiles_prep;

/* Whether a multi-token call of dt over n columns builds its tokens' inputs once (q4x_prep)
 * instead of once a row pair and token, where those six operations were about as many as the
 * two rows' products they feed: 1.15-1.32x at 4 and 8 tokens, from DRAM and hot, one-token
 * calls unchanged (Intel Xeon with AMX, 1 thread, 3 interleaved rounds,
 * kernels_intel_q4x_tiled_prep_ab.json). */
AI int q4x_tiled(int32_t dt, uint32_t T, uint32_t n) {
    return T > 1 && (dt == SMOE_WDT_Q4_0 || dt == SMOE_WDT_MXFP4) &&
           T * (n / 128) <= Q4XG_TILED_MAX;
}

/* The same for Q4_K / Q5_K, whose tiled rows (one row at a time) shuffled each token's 256
 * values per super-block for every row: four of about twenty operations.  Measured on a
 * noisy host (Intel Xeon with AMX, 1 thread, 5 alternating rounds, rows from L3): medians
 * 1.04-1.26x at 4 and 8 tokens; from DRAM within that hour's noise
 * (kernels_intel_q4k_tiled_prep_ab.json). */
AI int q4k_tiled(int32_t dt, uint32_t T, uint32_t n) {
    return T > 1 && (dt == SMOE_WDT_Q4_K || dt == SMOE_WDT_Q5_K) &&
           (size_t)T * n <= sizeof(tiles_prep);
}

/* x[t] for the call's tokens c0 .. c0 + T - 1 (T <= INVARIANT_T); where q4x_tiled or
 * q4k_tiled, their inputs prepared into *p and p returned, else NULL. */
AI const tiles_prep *tiles_input(const smoe_ffn_job *j, int32_t dt, uint32_t n, uint32_t c0,
                                 uint32_t T, xin *x, tiles_prep *p) {
    const int g = q4x_tiled(dt, T, n), k = q4k_tiled(dt, T, n);
    for (uint32_t t = 0; t < T; t++) {
        x[t] = xin_of(j, dt, c0 + t, n);
        if (g) q4x_prep(dt, &x[t], n, p->g + t * (n / 128));
        if (k) q4k_prep(&x[t], n, p->k + (size_t)t * n);
    }
    return g || k ? p : NULL;
}

/* A call's tokens in passes of INVARIANT_T (their inputs prepared once a pass, on the stack):
 * pass c0 has chunk_tokens(T, c0) of them.  Each pass reads the rows again, from L2/L3 at
 * prefill sizes, where these rows are bound by their arithmetic, not by reads. */
AI uint32_t chunk_tokens(uint32_t T, uint32_t c0) {
    return T - c0 < INVARIANT_T ? T - c0 : INVARIANT_T;
}

/* Token t0's part of the prepared inputs p of dt (NULL: none). */
AI const void *prep_at(const tiles_prep *p, int32_t dt, uint32_t t0, uint32_t n) {
    if (!p) return NULL;
    if (dt == SMOE_WDT_Q4_0 || dt == SMOE_WDT_MXFP4) return p->g + t0 * (n / 128);
    return p->k + (size_t)t0 * n;
}

AI void gateup_vnni_tiles(const smoe_ffn_job *j, uint32_t i0, uint32_t i1, const uint32_t tile) {
    const smoe_ffn_desc *d = j->d;
    const uint32_t H = d->H;
    const size_t rb = row_bytes(d->dtype, H);
    xin x[INVARIANT_T];
    tiles_prep buf;
    for (uint32_t c0 = 0; c0 < j->T; c0 += INVARIANT_T) {
        const uint32_t T = tile == 1 ? 1 : chunk_tokens(j->T, c0);
        const tiles_prep *p = tiles_input(j, d->dtype, H, c0, T, x, &buf);
        for (uint32_t i = i0; i < i1; i++) /* gate and up rows of one output together */
            for (uint32_t t0 = 0; t0 < T; t0 += tile) {
                const uint32_t nt = tile_tokens(T, t0, tile);
                const uint8_t *w[2] = {j->block + d->gate + i * rb, j->block + d->up + i * rb};
                float r[2 * VT];
                rows_vnni(d->dtype, w, 2, &x[t0], prep_at(p, d->dtype, t0, H), nt, H, r);
                for (uint32_t t = 0; t < nt; t++)
                    smoe_ffn_store_act(j, i, c0 + t0 + t, r[t], r[VT + t]);
            }
    }
}

/* Whether a one-token call of dt over n columns runs on the input q4x_prep builds. */
AI int q4x_one(int32_t dt, uint32_t T, uint32_t n) {
    return T == 1 && (dt == SMOE_WDT_Q4_0 || dt == SMOE_WDT_MXFP4) && n / 128 <= Q4XG_MAX;
}

/* rows_q4x_vnni_g with the format a constant in each form. */
AI void rows_q4x_g(int32_t dt, const uint8_t *const *w, const int nr, const q4xg *g,
                   const xin *x, uint32_t n, float *res) {
    if (dt == SMOE_WDT_Q4_0)
        rows_q4x_vnni_g(SMOE_WDT_Q4_0, w, nr, g, x, n, res);
    else
        rows_q4x_vnni_g(SMOE_WDT_MXFP4, w, nr, g, x, n, res);
}

static void gateup_q4x_one(const smoe_ffn_job *j, uint32_t i0, uint32_t i1) {
    const smoe_ffn_desc *d = j->d;
    const size_t rb = row_bytes(d->dtype, d->H);
    const xin x = xin_of(j, d->dtype, 0, d->H);
    q4xg g[Q4XG_MAX];
    q4x_prep(d->dtype, &x, d->H, g);
    for (uint32_t i = i0; i < i1; i++) {
        const uint8_t *w[2] = {j->block + d->gate + i * rb, j->block + d->up + i * rb};
        float r[2 * VT];
        rows_q4x_g(d->dtype, w, 2, g, &x, d->H, r);
        smoe_ffn_store_act(j, i, 0, r[0], r[VT]);
    }
}

static void down_q4x_one(const smoe_ffn_job *j, uint32_t h0, uint32_t h1) {
    const smoe_ffn_desc *d = j->d;
    const int32_t dt = smoe_ffn_down_dtype(d);
    const size_t rb = row_bytes(dt, d->I);
    const uint8_t *dw = j->block + d->down;
    const xin x = xin_of(j, dt, 0, d->I);
    q4xg g[Q4XG_MAX];
    q4x_prep(dt, &x, d->I, g);
    const uint32_t half = (h1 - h0) / 2; /* rows (h, h + half) together, as down_vnni_tiles */
    for (uint32_t h = h0; h < h0 + half; h++) {
        const uint8_t *w[2] = {dw + h * rb, dw + (h + half) * rb};
        float r[2 * VT];
        rows_q4x_g(dt, w, 2, g, &x, d->I, r);
        smoe_ffn_store_out(j, h, 0, r[0]);
        smoe_ffn_store_out(j, h + half, 0, r[VT]);
    }
    if ((h1 - h0) & 1) {
        const uint8_t *w[1] = {dw + (h1 - 1) * rb};
        float r[VT];
        rows_q4x_g(dt, w, 1, g, &x, d->I, r);
        smoe_ffn_store_out(j, h1 - 1, 0, r[0]);
    }
}

static void gateup_vnni(const smoe_ffn_job *j, uint32_t i0, uint32_t i1) {
    if (!vnni_rows_for(j->d->dtype))
        gateup_fast(j, i0, i1);
    else if (q4x_one(j->d->dtype, j->T, j->d->H))
        gateup_q4x_one(j, i0, i1);
    else if (j->T == 1)
        gateup_vnni_tiles(j, i0, i1, 1);
    else
        gateup_vnni_tiles(j, i0, i1, VT);
}

AI void down_vnni_tiles(const smoe_ffn_job *j, uint32_t h0, uint32_t h1, const uint32_t tile) {
    const smoe_ffn_desc *d = j->d;
    const int32_t dt = smoe_ffn_down_dtype(d);
    const uint32_t I = d->I;
    const size_t rb = row_bytes(dt, I);
    const uint8_t *dw = j->block + d->down;
    xin x[INVARIANT_T];
    tiles_prep buf;
    /* rows (h, h + half) together, each walking its half in memory order (as down_fast) */
    const uint32_t half = (h1 - h0) / 2;
    for (uint32_t c0 = 0; c0 < j->T; c0 += INVARIANT_T) {
        const uint32_t T = tile == 1 ? 1 : chunk_tokens(j->T, c0);
        const tiles_prep *p = tiles_input(j, dt, I, c0, T, x, &buf);
        for (uint32_t h = h0; h < h0 + half; h++)
            for (uint32_t t0 = 0; t0 < T; t0 += tile) {
                const uint32_t nt = tile_tokens(T, t0, tile);
                const uint8_t *w[2] = {dw + h * rb, dw + (h + half) * rb};
                float r[2 * VT];
                rows_vnni(dt, w, 2, &x[t0], prep_at(p, dt, t0, I), nt, I, r);
                for (uint32_t t = 0; t < nt; t++) {
                    smoe_ffn_store_out(j, h, c0 + t0 + t, r[t]);
                    smoe_ffn_store_out(j, h + half, c0 + t0 + t, r[VT + t]);
                }
            }
        if ((h1 - h0) & 1)
            for (uint32_t t0 = 0; t0 < T; t0 += tile) {
                const uint32_t nt = tile_tokens(T, t0, tile);
                const uint8_t *w[1] = {dw + (h1 - 1) * rb};
                float r[VT];
                rows_vnni(dt, w, 1, &x[t0], prep_at(p, dt, t0, I), nt, I, r);
                for (uint32_t t = 0; t < nt; t++)
                    smoe_ffn_store_out(j, h1 - 1, c0 + t0 + t, r[t]);
            }
    }
}

static void down_vnni(const smoe_ffn_job *j, uint32_t h0, uint32_t h1) {
    if (!vnni_rows_for(smoe_ffn_down_dtype(j->d)))
        down_fast(j, h0, h1);
    else if (q4x_one(smoe_ffn_down_dtype(j->d), j->T, j->d->I))
        down_q4x_one(j, h0, h1);
    else if (j->T == 1)
        down_vnni_tiles(j, h0, h1, 1);
    else
        down_vnni_tiles(j, h0, h1, VT);
}
#pragma GCC pop_options

static const smoe_ffn_impl impl_vnni = {gateup_vnni, down_vnni, NULL};
#define HAVE_VNNI 1
#else
#define HAVE_VNNI 0
#endif

const smoe_ffn_impl *smoe_ffn_impl_blocks(int32_t isa, int has_vnni, uint32_t precise) {
#if HAVE_VNNI
    if (!precise && isa >= SMOE_ISA_AVX512 && has_vnni) return &impl_vnni;
#else
    (void)has_vnni;
#endif
#if HAVE_FAST
    if (!precise && isa >= SMOE_ISA_AVX2) return &impl_fast;
#else
    (void)isa;
    (void)precise;
#endif
    return &impl_exact;
}

int smoe_blocks_fast(const smoe_ffn_impl *impl) {
#if HAVE_VNNI
    if (impl == &impl_vnni) return 1;
#endif
#if HAVE_FAST
    return impl == &impl_fast;
#else
    (void)impl;
    return 0;
#endif
}

uint32_t smoe_blocks_prepare(const smoe_ffn_impl *impl, int32_t dtype, const float *src,
                             size_t stride, const int32_t *rows, uint32_t T, uint32_t n,
                             int8_t *q, float *qs, float *qsum) {
#if HAVE_FAST
    prepare_avx2(dtype, src, stride, rows, T, n, q, qs, qsum);
    if (impl == &impl_fast &&
        (dtype == SMOE_WDT_Q4_0 || dtype == SMOE_WDT_MXFP4 || dtype == SMOE_WDT_IQ4_XS ||
         dtype == SMOE_WDT_Q4_1)) {
        for (uint32_t t = 0; t < T; t++) pair_order(q + (size_t)t * n, n);
        return 1;
    }
#else
    (void)impl, (void)dtype, (void)src, (void)stride, (void)rows, (void)T, (void)n, (void)q,
        (void)qs, (void)qsum;
#endif
    return 0;
}

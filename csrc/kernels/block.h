/* The element-wise pieces of a decoder layer's attention block between its matrix products, at
 * decode sizes, for specmoe._C.AttnBlock (csrc/attn_block.c): RMSNorm and the rotary embedding
 * (the rotate-half form of the Llama family) on f32 rows.
 *
 * bf16 models: with `bf16` set, every intermediate that torch would store as a bf16 tensor is
 * rounded to bf16 (round to nearest even, smoe_bf16_rne) at the same point, so that the block
 * follows the bf16 model's own arithmetic step by step (f32 math, bf16 storage) instead of
 * carrying extra f32 precision the unmodified model does not have.  With `bf16` clear the
 * arithmetic is torch's f32: no roundings beyond f32's, no fused multiply-add (-std=c11 turns
 * contraction off). */
#ifndef SMOE_BLOCK_H
#define SMOE_BLOCK_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

/* f32 -> bf16 bits, round to nearest even: what torch's Tensor.to(torch.bfloat16) gives (a NaN
 * keeps its sign and top payload bits, made quiet, as vcvtneps2bf16 does). */
static inline uint16_t smoe_bf16_rne(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    if ((b & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((b >> 16) | 0x40u);
    b += 0x7FFFu + ((b >> 16) & 1u);
    return (uint16_t)(b >> 16);
}

/* bf16 bits -> f32 (exact). */
static inline float smoe_bf16_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* f32 rounded to the nearest bf16 value, kept as f32. */
static inline float smoe_bf16_round1(float f) { return smoe_bf16_f32(smoe_bf16_rne(f)); }

/* x[i] = smoe_bf16_round1(x[i]) for i < n. */
void smoe_bf16_round(float *x, size_t n);

/* RMSNorm of `rows` rows of n values each, in place (transformers' Llama-family RMSNorm):
 *     y = x * rsqrt(mean(x^2) + eps)        (f32; bf16: y rounded to bf16)
 *     x = w * y                             (bf16: rounded to bf16)
 * w: n weights (the module's weight, widened to f32), or NULL for none. */
void smoe_rmsnorm(float *x, uint32_t rows, uint32_t n, const float *w, float eps, int bf16);

/* Rotary embedding of `heads` vectors of D values (D even) of one token, head h at
 * x + h * stride, in place, with that token's cos and sin (D values each):
 *     x = x * cos + rotate_half(x) * sin,   rotate_half(x) = (-x[D/2:], x[:D/2])
 * (bf16: each product and the sum rounded to bf16, as torch's three bf16 ops). */
void smoe_rotary_half(float *x, uint32_t heads, size_t stride, uint32_t D, const float *cos,
                      const float *sin, int bf16);

/* DeepSeek-V3's interleaved form (transformers' apply_rotary_pos_emb_interleave): the pairs
 * (x[2i], x[2i+1]) rotated by angle i, the results de-interleaved,
 *     out[i] = x[2i] cos[i] - x[2i+1] sin[i],  out[D/2 + i] = x[2i+1] cos[i] + x[2i] sin[i]
 * (cos, sin: the first D/2 of the token's D values; bf16: each product and the sum rounded);
 * heads at x + h * stride, in place, D <= SMOE_ROTARY_MAX. */
#define SMOE_ROTARY_MAX 1024u
void smoe_rotary_interleave(float *x, uint32_t heads, size_t stride, uint32_t D,
                            const float *cos, const float *sin, int bf16);

/* Rotary embedding on the pairs (x[2i], x[2i+1]) of `heads` vectors of D values (D even),
 * head h at x + h * stride, in place, pair i by angle i (c[i * step] its cosine, s[i * step]
 * its sine):
 *     (x[2i], x[2i+1]) = (x[2i] c - x[2i+1] s, x[2i] s + x[2i+1] c)
 * in f32 (the two products rounded, then one add or subtract), bf16: the results rounded to
 * bf16 once.  DeepSeek-V2's complex form (transformers' apply_rotary_emb: torch's complex64
 * product, then .type_as the bf16 input) with the token's D / 2 (re, im) pairs f: c = f, s =
 * f + 1, step 2; ERNIE-4.5's (its apply_rotary_pos_emb: cos and sin's first D / 2 values
 * repeated pairwise, q.float() * cos + rotate_half(q).float() * sin, rounded once) with the
 * token's cos and sin: step 1. */
void smoe_rotary_pairs(float *x, uint32_t heads, size_t stride, uint32_t D, const float *c,
                       const float *s, size_t step, int bf16);

#endif

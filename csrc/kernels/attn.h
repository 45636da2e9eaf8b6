/* Attention at decode sizes in C: multi-head latent attention (DeepSeek-V2/V3) in the absorbed
 * form.
 *
 * DeepSeek-V2 (arXiv 2405.04434) Sec. 2.1.2, Eq. 9-11 and "W^UK can be absorbed into W^Q, and
 * W^UV into W^O": for a query token t and head h, with the cached compressed latent c_j
 * ([r] wide, after kv_a_layernorm) and the shared rotary key k^R_j ([dr]) of every cached
 * position j < S,
 *
 *     q_lat[t,h]    = W_UK[h]^T q_nope[t,h]                        (dn -> r)
 *     score[t,h,j]  = (q_lat[t,h] . c_j + q_pe[t,h] . k^R_j) * scale + bias[t,j]
 *     p[t,h,:]      = softmax_j(score[t,h,:])
 *     o_lat[t,h]    = sum_j p[t,h,j] c_j                            (r wide)
 *     out[t, h*dv:(h+1)*dv] = W_UV[h] o_lat[t,h]                    (r -> dv)
 *
 * out then goes through o_proj (outside).  W_UK [H, dn, r] and W_UV [H, dv, r] are kv_b_proj's
 * weight split per head (each head's dn rows, then its dv rows), made contiguous by the caller.
 *
 * Arithmetic is f32 throughout (bf16 inputs widened exactly, int8/int4 weights converted in
 * the inner loops; no fused multiply-add, so every ISA gives the same bits).  The softmax is
 * computed in one pass over the positions (running maximum and rescaled sums, Milakov &
 * Gimelshein 2018), so no buffer grows with S.  Positions
 * whose score is -inf take no part; a query row whose every position is -inf gets zeros
 * (torch would give NaN).  A finite large negative bias (transformers' masks use the most
 * negative float) behaves as torch's softmax does: such positions get weight 0 next to any
 * unmasked one, uniform weight in a fully masked row.  Positions masked for every query of a
 * batch row (its holes: attn_impl.h, next_block) are left out of that row's sums, so its
 * bits are those of its step alone; a query masked everywhere in a row that has other
 * positions (a padding query, whose output nobody reads) then gets uniform weight over the
 * row's positions that are not holes.
 *
 * Threads: the batch rows' groups of heads (all of a row's heads, or fewer when the threads
 * outnumber the rows) are shared among the threads of c's pool; every output element is
 * computed by one thread in a fixed order, so results do not depend on the thread count.
 * Same serialization and GIL rule as smoe_ffn_forward. */
#ifndef SMOE_ATTN_H
#define SMOE_ATTN_H

#include "kernels.h"

typedef struct smoe_mla_desc {
    uint32_t H;      /* heads */
    uint32_t dn;     /* qk_nope_head_dim */
    uint32_t dr;     /* qk_rope_head_dim */
    uint32_t dv;     /* v_head_dim */
    uint32_t r;      /* kv_lora_rank */
    int32_t wdtype;  /* SMOE_WDT_F32, BF16, I8 or I4: w_uk and w_uv; or a GGUF block format
                      * (smoe_wdt_is_block): w_uk's, w_uv's in uv_dtype */
    uint32_t group;  /* I4: columns per scale (a multiple of 32 dividing r); else unused */
    float scale;     /* softmax scale (the module's `scaling`) */
    int32_t uv_dtype; /* GGUF blocks: w_uv's block format (llama.cpp's quantizer picks each
                       * tensor's type on its own: attn_k_b's 192 columns rule out the K-quants
                       * that attn_v_b may have); else unused */
} smoe_mla_desc;

/* The absorbed weights, kv_b_proj's rows regrouped per head (specmoe.storage.quant's quantization):
 *   uk [H, dn, r], uv [H, dv, r] in the descriptor's wdtype.  I4 holds one value q in [-8, 7]
 *   per byte (specmoe.storage.quant's nibble u minus 8; specmoe.models.mla.int4_values converts): the same
 *   values and scales as the packed format at twice its memory, because unpacking nibbles in
 *   the inner loops measured slower than reading bytes (this kernel is bound by arithmetic,
 *   not by the weight read: 2 MB a layer at DeepSeek-V2-Lite shapes);
 *   uk_scale, uv_scale: I8 f32 [H, dn] / [H, dv] (one per row); I4 f32 [H, dn, r / group] /
 *   [H, dv, r / group]; NULL for F32/BF16. */
/* GGUF blocks (wdtype a block format): the tensors llama.cpp's converter writes, as the file
 * holds them, so that steps 1 and 3 read the file's bits with the block kernels' rows (the
 * input quantized per block as for any GGUF matrix, smoe_blocks_matvec):
 *   uk  attn_k_b [H, r, dn]: per head r rows of dn columns (each head's W_UK transposed), in
 *       wdtype, dn a multiple of its block columns;
 *   uv  attn_v_b [H, dv, r]: per head dv rows of r columns in uv_dtype, r a multiple of its
 *       block columns;
 *   no scales (they are in the blocks). */
typedef struct smoe_mla_weights {
    const void *uk, *uv;
    const float *uk_scale, *uv_scale;
} smoe_mla_weights;

/* Shapes and dtypes in range (every dim in 1..65536, wdtype F32/BF16/I8/I4 with a valid I4
 * group or two GGUF block formats whose columns divide dn and r, finite scale > 0). */
int smoe_mla_desc_check(const smoe_mla_desc *d, smoe_err *err);

/* Scratch bytes smoe_mla_decode needs for T query tokens on c (per thread, for each head of
 * a group: q_lat and o_lat, [T, r] f32 each, and the running softmax state; a block of cached
 * rows widened to f32). */
size_t smoe_mla_scratch_bytes(const smoe_kctx *c, const smoe_mla_desc *d, uint32_t T);

/* One call for B batch rows of T query tokens each, against S cached positions per row.
 * Arrays are dense except where a stride is given (strides in elements):
 *   q_nope  f32 [B, H, T, dn]          q_pe  f32 [B, H, T, dr] (rotary already applied)
 *   ckv     [B] rows of [S, r]: row b, position j at ckv + b * ckv_bstride + j * r elements;
 *           F32 or BF16 (ckv_dtype)
 *   kpe     likewise [B] x [S, dr] at kpe + b * kpe_bstride + j * dr; F32 or BF16 (kpe_dtype)
 *   w       the absorbed weights (smoe_mla_weights)
 *   bias    f32 [Bb, T, S] additive (Bb = 1: shared by every row, or B), or NULL (nothing
 *           masked: every query sees every cached position)
 *   out     f32 [B, T, H * dv], overwritten
 * S >= 1, T >= 1.  scratch: scratch_bytes of it, smoe_mla_scratch_bytes(c, d, T) for every
 * thread of c to take part (less lets fewer threads work; less than one thread's is EINVAL). */
int smoe_mla_decode(smoe_kctx *c, const smoe_mla_desc *d, uint32_t B, uint32_t T, uint32_t S,
                    const float *q_nope, const float *q_pe, const void *ckv, int32_t ckv_dtype,
                    size_t ckv_bstride, const void *kpe, int32_t kpe_dtype, size_t kpe_bstride,
                    const smoe_mla_weights *w, const float *bias, uint32_t bias_rows,
                    float *out, void *scratch, size_t scratch_bytes, smoe_err *err);

/* Multi-head attention with grouped keys (MHA / GQA / MQA) at decode sizes, for the models'
 * own attention (specmoe.models.attention): for query token t of batch row b and head h, with
 * G = H / Hkv query heads per key head,
 *
 *     out[b, t, h, :] = sum_j softmax_j(q[b, h, t] . k[b, h / G, j] * scale + bias[b, t, j])
 *                       v[b, h / G, j]
 *
 * With attention sinks (GPT-OSS: one learned logit per head, transformers' ``s_aux``), head h's
 * softmax also counts sinks[h] in its denominator, a position with no value:
 *     weight_j = exp(s_j) / (sum_i exp(s_i) + exp(sinks[h]))
 * (the running softmax starts from (max, sum) = (sinks[h], 1) instead of (-inf, 0)), so a
 * query row whose every position is masked gets zeros, as torch gives.
 *
 * the same online softmax, masking rules, arithmetic (f32, no FMA: the same bits on every
 * ISA) as smoe_mla_decode; threads share the key/value heads' groups of query heads.
 *   q     f32 [B, H, T, D]
 *   k, v  F32 or BF16 (kv_dtype): position j of (b, g) at k + b * kv_bstride + g * kv_hstride
 *         + j * D elements (v likewise, with the same strides)
 *   bias  f32 [Bb, T, S] additive (Bb = 1 or B), or NULL
 *   out   f32 [B, T, H, D], overwritten
 * scratch: smoe_mha_scratch_bytes(c, D, T) for every thread of c to take part. */
typedef struct smoe_mha_desc {
    uint32_t H, Hkv, D; /* query heads, key/value heads (H % Hkv == 0), head dim; 1..65536 */
    float scale;        /* softmax scale */
    const float *sinks; /* f32 [H] attention sinks (finite), or NULL: none */
} smoe_mha_desc;

size_t smoe_mha_scratch_bytes(const smoe_kctx *c, uint32_t D, uint32_t T);

int smoe_mha_decode(smoe_kctx *c, const smoe_mha_desc *d, uint32_t B, uint32_t T, uint32_t S,
                    const float *q, const void *k, const void *v, int32_t kv_dtype,
                    size_t kv_bstride, size_t kv_hstride, const float *bias, uint32_t bias_rows,
                    float *out, void *scratch, size_t scratch_bytes, smoe_err *err);

#endif

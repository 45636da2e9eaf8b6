/* One routed-expert MoE layer in C: group tokens by expert, fetch each needed expert's block
 * from an expert source (the cache, or a resident buffer), run the expert FFN on all of that
 * expert's tokens (its weights are read once per call), accumulate weight * output.
 *
 * Expert blocks are in the canonical layout (see specmoe/hf.py): inside one block, tensors at
 * byte offsets given by smoe_moe_layout: w_gate [I,H], w_up [I,H], w_down [H,I] and optional
 * biases b_gate [I], b_up [I], b_down [H].  Element type f32 or bf16 (raw uint16).
 *
 * Accumulation order is ascending expert id, then token order, matching transformers' eager
 * experts forward, so an f32 store reproduces the unmodified model up to the FFN's own
 * summation order.
 *
 * Thread safety: smoe_moe_forward touches only its arguments and the source; it may run
 * without the GIL.  It allocates its scratch per call.
 */
#ifndef SMOE_MOE_H
#define SMOE_MOE_H

#include "common.h"

enum { SMOE_MOE_F32 = 0, SMOE_MOE_BF16 = 1 };
enum { SMOE_MOE_ACT_SILU = 0, SMOE_MOE_ACT_GPTOSS = 1 };

#define SMOE_MOE_NONE UINT64_MAX /* offset of an absent tensor */

typedef struct smoe_moe_layout {
    uint32_t hidden, inter;  /* H, I */
    int dtype;               /* SMOE_MOE_F32 / SMOE_MOE_BF16 */
    int act;                 /* SMOE_MOE_ACT_* */
    float alpha, limit;      /* GPT-OSS activation parameters */
    uint64_t block_bytes;    /* every offset + tensor size must fit in this */
    uint64_t off_gate, off_up, off_down;       /* required */
    uint64_t off_bgate, off_bup, off_bdown;    /* f32 biases or SMOE_MOE_NONE */
} smoe_moe_layout;

/* Where expert blocks come from.  acquire pins and returns the block; release unpins. */
typedef struct smoe_moe_source {
    void *ctx;
    int (*acquire)(void *ctx, uint32_t layer, uint32_t expert, const uint8_t **data,
                   smoe_err *err);
    int (*release)(void *ctx, uint32_t layer, uint32_t expert, smoe_err *err);
} smoe_moe_source;

/* Check the layout is self-consistent (sizes fit the block, dtype/act known). */
int smoe_moe_layout_check(const smoe_moe_layout *lo, smoe_err *err);

/* y[n,H] = FFN(block)(x[n,H]) for n tokens, f32 in and out. */
int smoe_moe_expert_ffn(const smoe_moe_layout *lo, const uint8_t *block, const float *x,
                        uint32_t n, float *y, smoe_err *err);

/* out[T,H] = sum over k of w[t,k] * FFN(expert idx[t,k])(x[t]).  idx entries outside
 * 0..num_experts-1 are SMOE_EINVAL (checked before any expert is fetched).  Experts are
 * visited in ascending id; each is acquired, run on all its tokens, and released before the
 * next.  `used` (may be NULL, num_experts bytes) is set to 1 for every expert used. */
int smoe_moe_forward(const smoe_moe_layout *lo, const smoe_moe_source *src, uint32_t layer,
                     uint32_t num_experts, const float *x, uint32_t T, const int64_t *idx,
                     const float *w, uint32_t k, float *out, uint8_t *used, smoe_err *err);

#endif

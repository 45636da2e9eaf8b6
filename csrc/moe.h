/* One routed-expert MoE layer in C: group tokens by expert, fetch each needed expert's block
 * from an expert source (the cache, or a resident buffer of every block), run the expert FFN
 * kernel (kernels/kernels.h) once on all of that expert's tokens (its weights are read once
 * per call), accumulating routing weight * output.
 *
 * Order: experts in ascending id (or the caller's visit order, smoe_moe_forward_order), each
 * expert's tokens in token order, so an f32 store in id order reproduces transformers' eager
 * experts forward up to the kernel's own summation order.
 *
 * Decode-sized calls run expert-parallel: when every expert of the call sees at most
 * SMOE_MOE_EP_MAX_TOKENS tokens, at least as many experts are used as the kernel context has
 * threads, and the source can hold all of them pinned at once (multi_pin), the experts are
 * acquired first, then computed side by side, one whole expert per thread
 * (smoe_ffn_forward_many: no barrier per expert), each into rows of its own that are summed per
 * token in ascending expert id -- the same values, bit for bit, as one expert at a time with
 * its rows split across the threads.
 *
 * Thread safety: smoe_moe_forward touches only its arguments, the source and the kernel
 * context (whose calls serialize on its pool); it may run without the GIL.  Scratch memory is
 * allocated per call.
 */
#ifndef SMOE_MOE_H
#define SMOE_MOE_H

#include "common.h"
#include "kernels/kernels.h"

/* Where expert blocks come from.  acquire pins and returns the block; release unpins. */
typedef struct smoe_moe_source {
    void *ctx;
    int (*acquire)(void *ctx, uint32_t layer, uint32_t expert, const uint8_t **data,
                   smoe_err *err);
    int (*release)(void *ctx, uint32_t layer, uint32_t expert, smoe_err *err);
    int multi_pin; /* every expert of a layer can be pinned at once (a resident buffer, or a
                      cache with a slot for every expert); 0 (the default): one at a time */
} smoe_moe_source;

/* Most tokens per expert for the expert-parallel path (above: experts one at a time). */
#define SMOE_MOE_EP_MAX_TOKENS 4u

/* The expert source that pins blocks in a cache (smoe_cache_acquire / smoe_cache_release);
 * multi_pin when the cache has a slot for every expert. */
struct smoe_cache;
smoe_moe_source smoe_moe_cache_source(struct smoe_cache *cache);

/* out[T,H] = sum_j w[t,j] * FFN_{idx[t,j]}(x[t]) with the expert FFN described by d (a
 * descriptor validated by smoe_ffn_desc_check against the block size).  x, out: f32 [T,H]
 * row-major (out is overwritten).  idx: int64 [T,k], each in 0..num_experts-1 (else
 * SMOE_EINVAL, checked before any expert is fetched; a token listing one expert twice is
 * SMOE_EINVAL too).  `used` (may be NULL; num_experts bytes) gets 1 for every expert used.
 * kc may be NULL (single-threaded kernel).  Errors from the source or the kernel abort the
 * call after releasing what was acquired. */
int smoe_moe_forward(smoe_kctx *kc, const smoe_ffn_desc *d, const smoe_moe_source *src,
                     uint32_t layer, uint32_t num_experts, const float *x, uint32_t T,
                     const int64_t *idx, const float *w, uint32_t k, float *out, uint8_t *used,
                     smoe_err *err);

/* smoe_moe_forward over the (token, slot) pairs i with take[i] != 0 only (take: [T*k], NULL =
 * all): the others are neither fetched nor computed (their ids are still range-checked).  The
 * miss handling of the per-layer path (layer.h) uses it to skip dropped experts and to split
 * a layer between the cache and a resident low-bit copy. */
int smoe_moe_forward_ex(smoe_kctx *kc, const smoe_ffn_desc *d, const smoe_moe_source *src,
                        uint32_t layer, uint32_t num_experts, const float *x, uint32_t T,
                        const int64_t *idx, const float *w, uint32_t k, const uint8_t *take,
                        float *out, uint8_t *used, smoe_err *err);

/* smoe_moe_forward_ex visiting the experts in `order` (a permutation of 0..num_experts-1;
 * NULL = ascending id).  fixed_sum = 0: each expert accumulates into out as it is visited, so
 * a token's sum follows the visit order.  fixed_sum != 0: each (token, expert) pair's weighted
 * output goes to a row of its own (scratch: pairs x H floats), and the rows are then added
 * into out per token in ascending expert id, so the result does not depend on the visit order
 * (transformers' eager order of operations: weight * expert(x), then index_add per expert).
 * The per-layer path computes a layer's resident experts first while its misses load on the
 * prefetch worker, with fixed_sum so that outputs do not depend on that timing (layer.h). */
int smoe_moe_forward_order(smoe_kctx *kc, const smoe_ffn_desc *d, const smoe_moe_source *src,
                           uint32_t layer, uint32_t num_experts, const float *x, uint32_t T,
                           const int64_t *idx, const float *w, uint32_t k, const uint8_t *take,
                           const uint32_t *order, int fixed_sum, float *out, uint8_t *used,
                           smoe_err *err);

/* The expert source over a resident buffer of every block in store order (block (layer, e)
 * at (layer * num_experts + e) * block_bytes, `size` bytes in all).  ctx must outlive uses. */
typedef struct smoe_moe_resident {
    const uint8_t *base;
    uint64_t size, block_bytes;
    uint32_t num_experts;
} smoe_moe_resident;
smoe_moe_source smoe_moe_resident_source(smoe_moe_resident *r);

#endif

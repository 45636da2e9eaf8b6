/* Expert tiers (issue 36 item 2): where the per-layer path (layer.h) finds a MoE layer's
 * experts and computes them.  smoe_layers runs every step of a layer that decides something --
 * the pass, next-layer prediction and prefetch, the policy's counts, cache-aware routing, the
 * miss rules, the draft tokens' rule, the prediction counters -- once, in layer.c, on the
 * tier's slot table (slots.h: the same bookkeeping for every tier); the tier only says where
 * the bytes are and which kernels read them:
 *
 *   host tier     the CPU cache (cache.h): x and out in host memory, the CPU kernels (moe.h)
 *                 on the kernel context of smoe_layers; the only tier with parallel misses.
 *   device tier   a cache whose slots another memory holds (cuda/gcache.h: GPU memory, or host
 *                 memory in its emulation): x and out in the tier's memory, the tier's
 *                 kernels through smoe_tier_ops.  layer.c groups the layer's (token, slot)
 *                 pairs by expert on the host (ascending expert id, token order: the CPU's
 *                 order), makes the rows and weights visible to the kernels once per call
 *                 (`upload`: one copy), then per expert acquires its block (or addresses it
 *                 in a resident low-bit copy), runs `expert` and releases it -- a loop in C,
 *                 no Python and no device-to-host read.  A tier with `experts` gets the
 *                 layer's experts of few tokens in groups instead: each group's blocks
 *                 acquired (at most as many as the cache has slots, so the pins cannot
 *                 starve each other), one `experts` call, then released: on the GPU one
 *                 launch group per layer at decode instead of one per expert.
 *
 * The hybrid tier (issue 37, layer.h smoe_layers_set_hybrid) is a device tier whose missing
 * experts may instead run where they live: the CPU kernels on host_block's bytes and the
 * layer's input on the host, their sum added to out with add_host (one copy per layer).
 *
 * Routing needs the layer's input on the host (the router copy's scores for prediction,
 * cache-aware routing and SUBSTITUTE) and its top-k ids and weights: the caller of a device
 * tier passes both (smoe_layers_forward_on: x on the host, xd in the tier's memory).
 *
 * Threads: the ops are called only from inside a smoe_layers forward call (under its mu) and
 * from smoe_layers_init / set_lowbit (check); their ctx is not shared with anything else.
 */
#ifndef SMOE_TIER_H
#define SMOE_TIER_H

#include "common.h"
#include "kernels/kernels.h"
#include "slots.h"

/* Bounds of one `experts` call (a group): experts, pairs per expert (an expert with more runs
 * alone, where a GPU may take its GEMM path), pairs in all (the GPU tier's scratch rows). */
#define SMOE_TIER_GROUP 32
#define SMOE_TIER_GROUP_T 16
#define SMOE_TIER_GROUP_PAIRS 256

struct smoe_cache;

typedef struct smoe_tier_ops {
    /* d is an expert format the tier's kernels run (else SMOE_EINVAL naming it). */
    int (*check)(void *ctx, const smoe_ffn_desc *d, smoe_err *err);
    /* out[0..n) = 0 (tier memory), ordered on stream before later work. */
    int (*zero)(void *ctx, float *out, size_t n, void *stream, smoe_err *err);
    /* The n pairs' rows (int32) and weights (f32), host arrays the caller may reuse as soon
     * as this returns, made visible to `expert` calls enqueued after it on stream: *rows_t and
     * *scale_t (tier memory) stay valid until the next upload. */
    int (*upload)(void *ctx, const int32_t *rows, const float *scale, uint32_t n,
                  const int32_t **rows_t, const float **scale_t, void *stream, smoe_err *err);
    /* out[rows[t]] += scale[t] * FFN(x[rows[t]]) for t < n, rows distinct, on the expert block
     * at `block` (tier memory) laid out as d says; x, out [*, d->H] in tier memory. */
    int (*expert)(void *ctx, const smoe_ffn_desc *d, const uint8_t *block, const float *x,
                  const int32_t *rows, const float *scale, uint32_t n, float *out,
                  void *stream, smoe_err *err);
    /* Optional (NULL: one `expert` call per expert): `expert` for m experts of format d at
     * once (one launch group on a GPU), expert j on blocks[j] with the pairs
     * rows[first[j] .. first[j] + count[j]) and scale likewise (uploaded arrays), every out
     * element accumulated in ascending j as m `expert` calls would.  The caller keeps
     * 1 <= m <= SMOE_TIER_GROUP, 1 <= count[j] <= SMOE_TIER_GROUP_T and the counts' sum
     * <= SMOE_TIER_GROUP_PAIRS. */
    int (*experts)(void *ctx, const smoe_ffn_desc *d, uint32_t m, const uint8_t *const *blocks,
                   const uint32_t *first, const uint32_t *count, const float *x,
                   const int32_t *rows, const float *scale, float *out, void *stream,
                   smoe_err *err);
    /* Pin (layer, expert) in the tier's cache and return its block (tier memory); stream
     * waits for its load.  release drops the pin after the work enqueued on stream. */
    int (*acquire)(void *ctx, uint32_t layer, uint32_t expert, void *stream,
                   const uint8_t **block, smoe_err *err);
    int (*release)(void *ctx, uint32_t layer, uint32_t expert, void *stream, smoe_err *err);
    /* The hybrid tier (issue 37; optional, NULL: the tier has none): *block = expert (layer,
     * expert)'s block in host memory, laid out as the tier's main format (the GPU cache's
     * pinned host copy of the store, or the store file mapped into memory: the OS page cache
     * is then the RAM tier between the disk and the GPU), valid while the tier is.
     * SMOE_ESTATE when the tier has no host path, SMOE_ECORRUPT on a checksum mismatch. */
    int (*host_block)(void *ctx, uint32_t layer, uint32_t expert, const uint8_t **block,
                      smoe_err *err);
    /* out[0..n) (tier memory) += host[0..n) (host memory), ordered on stream after the work
     * enqueued before it; host may be reused as soon as this returns. */
    int (*add_host)(void *ctx, float *out, const float *host, size_t n, void *stream,
                    smoe_err *err);
} smoe_tier_ops;

typedef struct smoe_tier {
    smoe_slots *tab;          /* the cache's bookkeeping (borrowed; outlives the layers) */
    struct smoe_cache *cache; /* host tier: the CPU cache; NULL for a device tier */
    const smoe_tier_ops *ops; /* device tier: its memory and kernels; NULL for the host tier */
    void *ctx;                /* ops' context (borrowed) */
} smoe_tier;

/* The host tier over a CPU cache. */
smoe_tier smoe_tier_host(struct smoe_cache *cache);

#endif

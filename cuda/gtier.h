/* The GPU cache as an expert tier of the per-layer path (csrc/tier.h; issue 36 item 2): with
 * it, csrc/layer.c runs a GPU MoE layer in one C call -- the same routing, prediction,
 * prefetch, miss rules and counters as the CPU tier -- and this file supplies only the
 * device's side: zeroing the output, the pairs' rows and weights copied to the device once per
 * call, the experts' kernels (cuda/ffn.cu: smoe_gpu_ffn_forward_group for a group of experts of
 * few tokens, three launches; smoe_gpu_ffn_forward for one expert, on the slot the GPU cache
 * pins), all on the caller's compute stream.
 *
 * device < 0 (the GPU cache's host emulation, gcache.h): the same calls on host memory --
 * memset, the rows used in place, the CPU expert kernel (single-threaded) on the emulated
 * slot -- so every machine runs this tier's layer path; only the CUDA calls below are left to
 * a machine with a GPU.  The emulation refuses what the GPU kernels refuse (int2 experts).
 *
 * The hybrid tier's host path (tier.h host_block): the GPU cache's pinned host copy, or in
 * staged mode the store file mapped read-only at init (pages come from the OS page cache,
 * the disk behind it; each block's CRC32C is checked on its first use when the store
 * verifies reads).
 *
 * Threads: a tier is used by one smoe_layers at a time (its calls run under that layers'
 * mutex); init and free are not concurrent with anything.
 */
#ifndef SMOE_GTIER_H
#define SMOE_GTIER_H

#include "gcache.h"
#include "gpu.h"
#include "tier.h"

typedef struct smoe_gtier {
    smoe_gcache *cache;  /* borrowed; outlives the tier */
    int device;          /* the cache's: -1 host emulation */
    uint32_t H, I;       /* the experts' shape (every format the tier runs) */
    int grouped;         /* 1: the `experts` op (grouped launches); 0: one call per expert */
    smoe_gpu_ffn ffn;    /* owned (GPU): cuBLAS handle and scratch for (H, I) */
    int ffn_ready;
    void *dbuf;          /* owned (GPU): device rows then weights of the last upload */
    size_t dcap;         /* bytes */
    const uint8_t *map;  /* owned (staged mode): the store file mapped read-only, the hybrid
                          * tier's host path when there is no pinned host copy */
    size_t map_len;
    uint8_t *checked;    /* owned (with map and a verifying store): [L * E] block's CRC checked */
    void *abuf;          /* owned (GPU): the hybrid tier's CPU share, copied for add_host */
    size_t acap;         /* bytes */
    void *scratch;       /* owned (emulation): the CPU kernel's scratch */
    size_t scap;         /* bytes */
} smoe_gtier;

/* A tier over cache for experts of hidden size H and intermediate size I; grouped: whether
 * the layer path gets the `experts` op (tier.h) or one `expert` call per expert. */
int smoe_gtier_init(smoe_gtier *t, smoe_gcache *cache, uint32_t H, uint32_t I, int grouped,
                    smoe_err *err);
void smoe_gtier_free(smoe_gtier *t);

/* The smoe_tier whose ops run on t (valid while t is). */
smoe_tier smoe_gtier_tier(smoe_gtier *t);

#endif

/* The per-layer path of an offloaded model in one C call: smoe_layers holds, for every MoE
 * layer of one model, what the call needs (the cache, the kernel context, the parsed expert
 * FFN descriptor, a f32 copy of each layer's router for next-layer prediction, the prefetch
 * settings) and the counters the Engine reports.  Built once per Engine (specmoe/hf.py) and
 * called once per MoE layer and forward pass, with the GIL released:
 *
 *   smoe_layers_forward(g, pos, x[T,H], idx[T,k], w[T,k], out[T,H], used[E], ...)
 *     1. pos == 0: a new forward pass (passes++, tokens += T, smoe_cache_begin_pass);
 *     2. prefetch on and pos+1 < L: the next layer's router on x (scores[T,E] = x Wr^T + b,
 *        then sigmoid or softmax plus the correction bias where the model has one), or the
 *        scores the caller passes (a Python predictor); per token the top
 *        m = clamp(ceil(k * overfetch), k, E) experts, or (mass > 0) the fewest experts, at
 *        least k, whose softmax probability reaches mass; the union queued to the prefetch
 *        worker with priority = the best score (probability in mass mode) over the tokens;
 *     3. feed_counts (a utility-space policy): how many tokens route to each expert of this
 *        layer, to the policy before the layer's accesses (smoe_cache_counts);
 *     4. the experts (smoe_moe_forward through the cache), out overwritten, used[e] = 1;
 *     5. precision/recall of the prediction made for this layer against `used`.
 *
 * Exactly the Python path it replaces (tests/test_layers.py checks the prediction and the
 * counters against a numpy reference).  Ties in the top-m choose the lower expert id.
 *
 * Threads: one mutex per object serialises forward calls and guards every field marked [mu];
 * the cache and kernel context have their own locking.  Construction and free are not
 * concurrent with anything.  Scratch buffers grow (under mu) when a call brings more tokens
 * than any earlier one: a prefill allocates, decode steps do not.
 */
#ifndef SMOE_LAYER_H
#define SMOE_LAYER_H

#include <pthread.h>

#include "cache.h"
#include "common.h"
#include "kernels/kernels.h"

typedef struct smoe_layer_router {
    float *w;    /* owned; [E, H] f32 */
    float *b;    /* owned; [E] or NULL */
    float *corr; /* owned; [E] or NULL: added to the scores when choosing experts */
} smoe_layer_router;

typedef struct smoe_layer_counters {
    uint64_t tokens;          /* tokens through layer 0 (all forward passes) */
    uint64_t passes;          /* forward passes (calls at layer 0) */
    uint64_t predicted;       /* experts predicted for a layer, summed over layers and passes */
    uint64_t true_positive;   /* of those, used by the layer */
    uint64_t actual;          /* experts used by layers that had a prediction */
} smoe_layer_counters;

typedef struct smoe_layers {
    pthread_mutex_t mu;
    uint32_t L, E, H, k;
    smoe_cache *cache;        /* borrowed; outlives every forward call (the binding pins it) */
    smoe_kctx *kc;            /* borrowed; may be NULL (single-threaded kernels) */
    smoe_ffn_desc desc;       /* validated against the cache's block size */
    smoe_layer_router *routers; /* owned; [L] */
    int sigmoid;              /* scores = sigmoid(logits) + corr (else softmax + corr) */
    /* settings [mu] */
    int prefetch;             /* next-layer prediction and prefetch on */
    double overfetch;         /* >= 1 */
    double mass;              /* (0, 1]: mass mode; 0: top-m mode */
    int feed_counts;          /* feed per-layer activation counts to the policy */
    /* state [mu] */
    smoe_layer_counters counters;
    uint8_t *pred;            /* owned; [L * E] the prediction made for each layer */
    uint8_t *pred_valid;      /* owned; [L] */
    /* scratch [mu] */
    float *scores;            /* owned; [cap_tokens * E] */
    uint32_t cap_tokens;
    float *best;              /* owned; [E] priority per expert of the next layer */
    int32_t *keys;            /* owned; [E] */
    float *prios;             /* owned; [E] */
    uint32_t *counts;         /* owned; [E] */
    int32_t *order;           /* owned; [E] per-token ranking */
    float *prob;              /* owned; [E] one token's probabilities (mass mode) */
} smoe_layers;

/* Build for L layers of E experts, hidden H, top-k k, over `cache` (block size checked against
 * desc) with routers[pos] = (w [E,H], b [E] or NULL, corr [E] or NULL) copied; `sigmoid`
 * chooses the score function used with a correction bias.  SMOE_EINVAL on bad shapes. */
int smoe_layers_init(smoe_layers *g, smoe_cache *cache, smoe_kctx *kc, const smoe_ffn_desc *d,
                     uint32_t L, uint32_t E, uint32_t H, uint32_t k, const float *const *w,
                     const float *const *b, const float *const *corr, int sigmoid,
                     smoe_err *err);
void smoe_layers_free(smoe_layers *g);

/* Settings (validated: overfetch >= 1, mass in [0, 1]); forgets pending predictions. */
int smoe_layers_configure(smoe_layers *g, int prefetch, double overfetch, double mass,
                          int feed_counts, smoe_err *err);

/* One MoE layer (see the top of this file).  scores: NULL (use the router) or [T, E] f32
 * scores of layer pos+1 from the caller.  replace: the prefetch request replaces the queue
 * (else it adds to it, e.g. behind a draft-driven lookahead).  Blocks; call without the GIL. */
int smoe_layers_forward(smoe_layers *g, uint32_t pos, const float *x, uint32_t T,
                        const int64_t *idx, const float *w, float *out, uint8_t *used,
                        const float *scores, int replace, smoe_err *err);

/* Copy the counters (and reset them when reset != 0), forget pending predictions when reset. */
void smoe_layers_counters(smoe_layers *g, smoe_layer_counters *out, int reset);

#endif

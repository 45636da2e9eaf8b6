/* The per-layer path of an offloaded model in one C call: smoe_layers holds, for every MoE
 * layer of one model, what the call needs (the cache, the kernel context, the parsed expert
 * FFN descriptor, a f32 copy of each layer's router for next-layer prediction, the prefetch
 * settings) and the counters the Engine reports.  Built once per Engine (specmoe/runtime/engine.py) and
 * called once per MoE layer and forward pass, with the GIL released:
 *
 *   smoe_layers_forward(g, pos, x[T,H], idx[T,k], w[T,k], out[T,H], used[E], ...)
 *     1. pos == 0: a new forward pass (passes++, tokens += T, smoe_slots_begin_pass);
 *     2. prefetch on and pos+1 < L: the next layer's router on x (scores[T,E] = x Wr^T + b,
 *        then sigmoid or softmax plus the correction bias where the model has one), or the
 *        scores the caller passes (a Python predictor), or the learned or oracle predictor's
 *        (smoe_layers_set_predictor, below); per token the top
 *        m = clamp(ceil(k * overfetch), k, E) experts, or (mass > 0) the fewest experts, at
 *        least k, whose softmax probability reaches mass; the union queued to the prefetch
 *        worker with priority = the best score (probability in mass mode) over the tokens;
 *     3. feed_counts (a utility-space policy): how many tokens route to each expert of this
 *        layer, to the policy before the layer's accesses (smoe_slots_counts);
 *     4. cache-aware routing and miss handling (SpecMD Sec. 3.1.1 and 3.1.2, below), when on;
 *     5. the experts on the layers' expert tier (tier.h), out overwritten, used[e] = 1: on
 *        the host tier smoe_moe_forward through the CPU cache, as below; on a device tier
 *        (the GPU cache, cuda/gtier.h) the same pairs grouped by expert in the same order and
 *        run by the tier's kernels on its stream (dev_moe in layer.c), the low-bit copies'
 *        and the draft tokens' shares accumulated into out there too;
 *        with parallel_misses on (smoe_layers_set_parallel; host tier only), the layer's
 *        misses are queued to the prefetch worker first (highest priority) and its resident
 *        experts pinned and computed first, so the loads overlap that compute; the missing
 *        experts come last (acquire waits for a load in flight, or loads a request the
 *        worker has not started yet itself).  The pins keep the worker from evicting an
 *        expert this layer is about to use; each is dropped as soon as its expert is
 *        computed, so the misses' own acquires never wait on this call's pins.  Every call
 *        with parallel_misses on sums a token's experts in ascending id from per-pair rows
 *        (smoe_moe_forward_order's fixed_sum), whatever order they were computed in, so the
 *        outputs never depend on the worker's timing; calls above SMOE_PARALLEL_MAX_FLOATS
 *        (T * k * H), and every call when the cache has a slot for every expert, take the
 *        plain path.  Off: ascending expert id, blocking loads;
 *     6. precision/recall of the prediction made for this layer against `used`.
 *
 * Step 4 (SpecMD, Algorithm 1 phases 1 and 2), from one snapshot of which of the layer's experts
 * are READY in the cache (smoe_cache_resident_mask; a prefetch still loading is not resident):
 *   - cache-aware routing (Sec. 3.1.1, Eq. 1: z' = z + lambda * Delta_avg * 1_C), on when
 *     route_lambda > 0.  z: this layer's router logits recomputed from x with the router copy
 *     (or, for a model with a correction bias, the selection scores score(z) + corr).
 *     Delta_avg: the running mean over every token this layer has seen (this call's included)
 *     of the token's logit range max(z) - min(z).  SpecMD calls Delta_avg "the historical
 *     average logit value"; a mean logit can be ~0 or negative and would make the boost
 *     vanish or penalise cached experts, so we read it as the average logit *range*, the
 *     scale of the MixtureCache prior SpecMD cites (Skliar et al. 2025), which makes lambda
 *     scale-free (SpecMD Sec. 5.4: lambda in 0.1..0.5 works best).  The model's own top-k
 *     (idx) is kept except where a boosted cached expert now beats an uncached selected one:
 *     per token the lowest uncached selected expert is swapped for the highest cached
 *     unselected one while z'[cached] > z[uncached] -- the top-k of z' whenever idx is the
 *     top-k of z, and the model's own routing elsewhere (group-limited routing).  Dual-logit
 *     weights (Appendix A.1): an expert swapped in gets c_t * p_t[e], p = softmax(z) (sigmoid
 *     for sigmoid routers) of the *unmodified* logits, c_t = sum_j w[t,j] / sum_j p_t[idx[t,j]]
 *     carrying the model's own scaling (top-k renormalisation, routed scaling factor);
 *   - miss handling (Sec. 3.1.2) of the (token, slot) pairs whose expert is not resident:
 *       FETCH       load it (blocking; today's behaviour, the default);
 *       DROP        skip it -- unless some token ranks it (by routing weight, ties by slot)
 *                   among its top miss_keep, then it is fetched and serves all its tokens
 *                   ("dropping only low-rank experts and always fetching high-rank ones",
 *                   Sec. 3.1.2; Skliar et al.: models are resilient beyond rank 2, so the
 *                   default keep is 2).  The remaining weights are not renormalised
 *                   (Algorithm 1 line 6: weights' = router_weights[experts'], no
 *                   renormalisation step);
 *       SUBSTITUTE  per token, the resident expert of the layer not already in the token's
 *                   set whose selection score is closest to the missing one's (score
 *                   proximity, Sec. 3.1.2 after Zhu et al. 2025; ties: lower id) takes its
 *                   place with the missing expert's weight; no candidate: fetch.  No score
 *                   tolerance (Zhu et al.'s threshold is not given in SpecMD);
 *       LOWEST_BIT  compute it from the resident low-bit copy (smoe_layers_set_lowbit level 0:
 *                   e.g. the self-draft's int4 experts, or an int2 copy), no load
 *                   ("fetch-lowest-bit", Sec. 3.1.2: the lowest precision available; here it
 *                   is already in memory);
 *       PRIORITY    "fetch-priority" (Sec. 3.1.2 and 5.3: "always fetches highest precision
 *                   with fallback levels (int8 -> int4 -> int2) ... selectively degrades
 *                   low-importance experts"): the experts some token ranks among its top
 *                   miss_keep are fetched at full precision (DROP's rule); every other missing
 *                   pair is computed from a low-bit copy chosen by the pair's own rank: ranks
 *                   miss_keep..miss_keep2-1 from copy 0 (e.g. int4), ranks miss_keep2.. from
 *                   copy 1 (e.g. int2; miss_keep2 = k: copy 0 for all, two levels).  SpecMD
 *                   degrades the bottom 60 % by gating score, i.e. miss_keep = ceil(0.4 k);
 *                   how the degraded ranks split between its int4 and int2 levels it does not
 *                   say (HOBBIT, which it cites for the cascade, uses gating-score thresholds),
 *                   so miss_keep2 is a setting (specmoe/runtime/misses.py picks the lower half).
 *   A resident expert evicted between the snapshot and its acquire is fetched (a miss).
 *   Counted in smoe_layer_counters: missing, dropped, substituted, lowbit, lowbit2, rerouted.
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
#include "moe.h"
#include "tier.h"

typedef struct smoe_layer_router {
    float *w;    /* owned; [E, H] f32 */
    float *b;    /* owned; [E] or NULL */
    float *corr; /* owned; [E] or NULL: added to the scores when choosing experts */
    float scale; /* routing weights' factor in smoe_layers_forward_routed (1: none) [mu] */
    uint32_t n_group, topk_group; /* its group-limited choice (sigmoid routers: DeepSeek-V3's
                                     n_group, topk_group; 1, 1 none) [mu] */
} smoe_layer_router;

/* A block's shared FFN (DeepSeek's shared experts; Qwen2-MoE's, Qwen3-Next's and Qwen3.5's
 * gated shared expert), run by smoe_layers_forward_routed after the routed experts and added
 * to their output: down(silu(gate x) * up x), times sigmoid(og x) when the output gate og is
 * given; each projection a linear descriptor, weight block and bias (NULL: none) -- gate and
 * up [I, H], down [H, I], og [1, H].  Borrowed: the caller keeps them alive and unchanged
 * while they are set (the binding holds the specmoe._C.Linear objects that own them). */
enum { SMOE_MLP_OUT_GATE = 3 }; /* d[3]: the output gate og, NULL for none */
typedef struct smoe_shared_ffn {
    const smoe_linear_desc *d[4]; /* gate, up, down, og; d[0] NULL: the layer has none */
    const uint8_t *block[4];
    const float *bias[4];
} smoe_shared_ffn;

/* The growing buffers of smoe_silu_mlp_add, owned by its caller (released with
 * smoe_mlp_bufs_free); zero-initialised means empty. */
typedef struct smoe_mlp_bufs {
    float *rows;        /* gate, up and output rows: T * (2 I + H) floats */
    size_t rows_cap;    /* floats */
    void *scratch;      /* the linear kernels' scratch */
    size_t scratch_cap; /* bytes */
} smoe_mlp_bufs;

void smoe_mlp_bufs_free(smoe_mlp_bufs *b);

/* SMOE_OK when f is a whole SiLU MLP whose projections chain H -> I -> H (gate and up
 * [I, H], down [H, I]; an output gate [1, H]); else SMOE_EINVAL naming `what`. */
int smoe_silu_mlp_check(const smoe_shared_ffn *f, uint32_t H, const char *what, smoe_err *err);

/* out[T, H] += down(silu(gate x) * up x) for the T rows of x [T, H], on the threads of kc:
 * the one routine for a SiLU MLP of three linear layers (a MoE block's shared experts in
 * smoe_layers_forward_routed, a dense decoder layer's MLP in specmoe._C.MLABlock); with an
 * output gate, each row's MLP output times sigmoid(og x) first (Qwen2-MoE's
 * shared_expert_gate).  bf16: round every intermediate as a bf16 model does (gate, up, the
 * activation, the product, the MLP's output, og x, its sigmoid and the gated output, out
 * before and after the sum).  The caller serialises calls on b. */
int smoe_silu_mlp_add(smoe_kctx *kc, const smoe_shared_ffn *f, const float *x, uint32_t H,
                      uint32_t T, int bf16, smoe_mlp_bufs *b, float *out, smoe_err *err);

typedef struct smoe_layer_counters {
    uint64_t tokens;          /* tokens through layer 0 (all forward passes) */
    uint64_t passes;          /* forward passes (calls at layer 0) */
    uint64_t predicted;       /* experts predicted for a layer, summed over layers and passes */
    uint64_t true_positive;   /* of those, used by the layer */
    uint64_t actual;          /* experts used by layers that had a prediction */
    /* step 4 (only while routing or a miss mode other than FETCH is on), in (token, slot)
     * pairs: */
    uint64_t rerouted;        /* pairs cache-aware routing moved to a cached expert */
    uint64_t missing;         /* pairs whose expert was not resident (after routing) */
    uint64_t dropped;         /* of those, skipped (DROP) */
    uint64_t substituted;     /* of those, served by a resident substitute (SUBSTITUTE) */
    uint64_t lowbit;          /* of those, computed from a low-bit copy (LOWEST_BIT, PRIORITY,
                               * draft tokens) */
    uint64_t lowbit2;         /* of those, from low-bit copy 1 (PRIORITY's lowest ranks) */
    uint64_t overlapped;      /* experts queued to the worker ahead of their layer's compute
                               * (parallel_misses), summed over layers and passes */
    uint64_t draft_kept;      /* draft-token pairs whose missing expert was not fetched for
                               * them (low-bit copy or skipped; also in lowbit / dropped) */
    /* the hybrid tier (smoe_layers_set_hybrid), summed over layers and passes: */
    uint64_t hybrid_cpu_experts; /* missing experts computed on the CPU where they live */
    uint64_t hybrid_cpu_pairs;   /* their (token, slot) pairs */
    uint64_t hybrid_copied;      /* missing experts the split sent to the fast tier's cache */
    uint64_t hybrid_admitted;    /* CPU experts queued to the cache's worker for admission */
} smoe_layer_counters;

/* Largest T * k * H (floats of per-pair rows) that takes the parallel-misses path: 16 MiB. */
#define SMOE_PARALLEL_MAX_FLOATS (4u << 20)

enum { SMOE_MISS_FETCH = 0, SMOE_MISS_DROP = 1, SMOE_MISS_SUBSTITUTE = 2,
       SMOE_MISS_LOWEST_BIT = 3, SMOE_MISS_PRIORITY = 4 };

/* Step 2's predictor (smoe_layers_set_predictor): what ranks the next layer's experts when the
 * caller passes no scores. */
enum {
    SMOE_LPRED_ROUTER = 0,  /* the next layer's router on this layer's input (the default) */
    SMOE_LPRED_LEARNED = 1, /* the learned next-use model's q (policy/nextuse.h), as the
                             * simulator's SMOE_PRED_LEARNED (sim.h): a one-slot nextuse policy
                             * fed each layer's routing as it runs */
    SMOE_LPRED_ORACLE = 2   /* replay only: the trace's experts of the next layer for the same
                             * tokens (the offline bound's prefetch of depth 1) */
};

struct smoe_policy;

typedef struct smoe_layers {
    pthread_mutex_t mu;
    uint32_t L, E, H, k;
    smoe_tier tier;           /* where the experts are (tier.h); its cache and context are
                               * borrowed and outlive every forward call (the binding pins them) */
    smoe_kctx *kc;            /* borrowed; may be NULL (single-threaded kernels) */
    smoe_ffn_desc desc;       /* validated against the cache's block size */
    int32_t *down_dt;         /* owned; [L] or NULL: each layer's down_dtype (a GGUF block
                               * store whose layers' down projections differ in format,
                               * smoe_layers_set_down_dtypes) [mu] */
    smoe_layer_router *routers; /* owned; [L] */
    smoe_shared_ffn *shared;  /* owned array, borrowed contents; [L] (smoe_layers_set_block) [mu] */
    int sigmoid;              /* scores = sigmoid(logits) + corr (else softmax + corr) */
    /* settings [mu] */
    int prefetch;             /* next-layer prediction and prefetch on */
    double overfetch;         /* >= 1 */
    double mass;              /* (0, 1]: mass mode; 0: top-m mode */
    int feed_counts;          /* feed per-layer activation counts to the policy */
    int miss;                 /* SMOE_MISS_* */
    uint32_t miss_keep;       /* DROP, PRIORITY: ranks 0..miss_keep-1 are always fetched */
    uint32_t miss_keep2;      /* PRIORITY: ranks miss_keep..miss_keep2-1 from low-bit copy 0,
                               * the rest from copy 1 (miss_keep <= miss_keep2 <= k) */
    double route_lambda;      /* cache-aware routing strength, 0: off */
    smoe_moe_resident lowbit[2]; /* low-bit copies (base NULL: none), memory borrowed: [0] for
                               * LOWEST_BIT, draft tokens and PRIORITY's first fallback level,
                               * [1] for PRIORITY's second (only with [0]) */
    smoe_ffn_desc lowbit_desc[2];
    smoe_moe_resident draft;  /* the self-draft's copy (base NULL: none), memory borrowed: what
                               * smoe_layers_forward_draft computes from (MoE-SpeQ) */
    smoe_ffn_desc draft_desc;
    int parallel_misses;      /* step 5: misses load on the worker while residents compute */
    int hybrid;               /* device tier: missing experts split between copies and the CPU
                               * (smoe_layers_set_hybrid) */
    int hybrid_admit;         /* queue the CPU's experts to the cache's worker */
    double hy_io, hy_gpu, hy_cpu; /* the split's costs, seconds (route.h balance_cut) */
    int predictor;            /* SMOE_LPRED_* (smoe_layers_set_predictor) [mu] */
    struct smoe_policy *learner; /* owned; SMOE_LPRED_LEARNED's one-slot nextuse policy, fed
                               * every real token's routing of every layer (else NULL) [mu] */
    double *lq;               /* owned; [E] the learner's q of the layer predicted [mu] */
    /* routing replay (smoe_layers_set_replay) [mu] */
    int16_t *replay;          /* owned; [replay_n, L, k] the trace's experts, or NULL: off */
    uint64_t replay_n;        /* tokens in the trace */
    uint64_t replay_next;     /* the trace token the next pass starts at */
    uint64_t replay_base;     /* the trace token of this pass's first token */
    uint64_t replay_pass;     /* counters.passes of the pass replay_base belongs to (a pass
                               * started by smoe_layers_forward is not replayed) */
    float *prior_table;       /* owned; [prior_n][L * E] token priors, or NULL: none [mu] */
    uint64_t prior_n;
    int32_t *prior_rows;      /* owned; [replay_n] row of each trace token, -1: no prior, or
                               * NULL [mu] */
    int32_t prior_next;       /* the next pass's row (set_next_prior), -1: none [mu] */
    /* state [mu] */
    double *delta_sum;        /* owned; [L] sum of tokens' logit ranges (routing's Delta_avg) */
    uint64_t *delta_n;        /* owned; [L] tokens in delta_sum */
    smoe_layer_counters counters;
    uint8_t *pred;            /* owned; [L * E] the prediction made for each layer */
    uint8_t *pred_valid;      /* owned; [L] */
    /* scratch [mu] */
    float *scores;            /* owned; [cap_tokens * E] */
    uint32_t cap_tokens;
    void *lin_scratch;        /* owned; the linear kernels' scratch (router GEMV, shared FFN) */
    size_t lin_scratch_cap;
    smoe_mlp_bufs sh;         /* owned; the shared FFN's rows and scratch [mu] */
    float *best;              /* owned; [E] priority per expert of the next layer */
    int32_t *keys;            /* owned; [E] */
    float *prios;             /* owned; [E] */
    float *pprob;             /* owned; [E] the prefetch requests' probabilities of use */
    uint32_t *counts;         /* owned; [E] */
    int32_t *order;           /* owned; [E] per-token ranking */
    float *prob;              /* owned; [E] one token's probabilities (mass mode) */
    /* scratch of step 4 [mu] */
    uint32_t cap_pairs;       /* tokens the buffers below hold */
    int64_t *idx2;            /* owned; [cap * k] routed ids after step 4 */
    float *w2;                /* owned; [cap * k] their weights */
    uint8_t *take;            /* owned; [cap * k] pair served by the cache */
    uint8_t *take_lb;         /* owned; [cap * k] 0, or 1 + the low-bit copy serving the pair */
    uint8_t *take_lv;         /* owned; [cap * k] the pairs of one low-bit copy (a call's mask) */
    uint8_t *take2;           /* owned; [cap * k] draft tokens' pairs served by the cache */
    float *out2;              /* owned; [cap * H] the low-bit copy's share of out */
    float *zt, *vt, *pt;      /* owned; [E] one token's logits, selection values, probs */
    uint8_t *resident;        /* owned; [E] snapshot of the layer's READY experts */
    uint8_t *mark;            /* owned; [E] one token's current experts; DROP: needed */
    uint8_t *used2;           /* owned; [E] */
    /* scratch of step 5 with parallel_misses [mu] */
    uint32_t *visit;          /* owned; [E] expert visit order: resident, then missing */
    uint8_t *pinned;          /* owned; [E] resident experts pinned ahead of their compute */
    const uint8_t **blocks;   /* owned; [E] the pinned experts' blocks */
    uint32_t pos_pinned;      /* the layer those pins belong to */
    /* scratch of a device tier's compute (tier.h) [mu] */
    uint32_t *grp_start;      /* owned; [E + 1] each expert's first pair */
    uint32_t cap_grp;         /* pairs the buffers below hold */
    int32_t *grp_rows;        /* owned; [cap_grp] each pair's token, grouped by expert */
    float *grp_scale;         /* owned; [cap_grp] its weight */
    /* scratch of the hybrid tier's split and CPU share [mu] */
    uint8_t *hy_state;        /* owned; [E] the layer's slot states */
    uint8_t *hy_oncpu;        /* owned; [E] experts of this call computed on the CPU */
    uint32_t *hy_miss;        /* owned; [E] missing experts, most tokens first */
    uint32_t *hy_cnt;         /* owned; [E] their token counts */
    uint32_t hy_cut, hy_nadmit; /* this call's copied prefix of hy_miss, CPU experts to admit */
    float *hy_out;            /* owned; [hy_cap floats] the CPU's share of out (host) */
    size_t hy_cap;
    void *hy_scratch;         /* owned; the CPU kernels' scratch */
    size_t hy_scap;
} smoe_layers;

/* Build for L layers of E experts, hidden H, top-k k, over the expert tier `tier` (its cache's
 * block size checked against desc; a device tier's kernels must take desc) with routers[pos] =
 * (w [E,H], b [E] or NULL, corr [E] or NULL) copied; `sigmoid` chooses the score function
 * used with a correction bias.  kc: the CPU kernels' threads (the host tier's experts, and on
 * every tier the router GEMVs and the shared FFN).  SMOE_EINVAL on bad shapes. */
int smoe_layers_init(smoe_layers *g, const smoe_tier *tier, smoe_kctx *kc,
                     const smoe_ffn_desc *d,
                     uint32_t L, uint32_t E, uint32_t H, uint32_t k, const float *const *w,
                     const float *const *b, const float *const *corr, int sigmoid,
                     smoe_err *err);
void smoe_layers_free(smoe_layers *g);

/* Settings (validated: overfetch >= 1, mass in [0, 1]); forgets pending predictions. */
int smoe_layers_configure(smoe_layers *g, int prefetch, double overfetch, double mass,
                          int feed_counts, smoe_err *err);

/* The settings smoe_layers_configure and smoe_layers_set_miss set (read under mu): their one
 * copy, which the engines read back (specmoe/runtime/engine_base.py: prefetch, overfetch,
 * mass; miss, miss_keep, miss_keep2, route_lambda; the predictor, SMOE_LPRED_*). */
void smoe_layers_get_config(smoe_layers *g, int *prefetch, double *overfetch, double *mass,
                            int *feed_counts, int *miss, uint32_t *miss_keep,
                            uint32_t *miss_keep2, double *route_lambda, int *predictor);

/* Step 4 settings (validated): miss in SMOE_MISS_*, miss_keep <= miss_keep2 <= k,
 * route_lambda finite >= 0.  LOWEST_BIT and PRIORITY need low-bit copy 0, PRIORITY with
 * miss_keep2 < k also copy 1 (smoe_layers_set_lowbit), else SMOE_EINVAL. */
int smoe_layers_set_miss(smoe_layers *g, int miss, uint32_t miss_keep, uint32_t miss_keep2,
                         double route_lambda, smoe_err *err);

/* Per-layer formats of the down matrix (a GGUF file's Q4_K_M: Q4_K on most layers, Q6_K on
 * others): dts[l] (l < L) is layer l's desc.down_dtype, each validated with the layers' desc
 * against the cache's slot size (the store's down tensor is sized for the largest); NULL: every
 * layer uses desc as given.  CPU tier only. */
int smoe_layers_set_down_dtypes(smoe_layers *g, const int32_t *dts, smoe_err *err);

/* Step 5's overlap of a layer's misses with its resident experts' compute (on != 0); needs the
 * cache's prefetch worker (without one it changes nothing). */
void smoe_layers_set_parallel(smoe_layers *g, int on);

/* The hybrid tier (issue 37; MoE-SpAc section 3.3) on a device tier whose ops have a host
 * copy (tier.h host_block, add_host): per call, the experts a layer needs that are neither
 * resident nor loading are split by route.h's smoe_route_balance_cut with costs t_io (one
 * copy), t_gpu (one expert call on the device) and t_cpu (one token-expert product on the CPU
 * kernels), seconds, measured by the caller.  The cut's experts (most tokens first) are copied
 * and run on the device as without the split; the rest run on the CPU kernels (kc) from the
 * host copy while the device computes its share (their work is enqueued first), and their sum
 * is added to out on the stream (add_host).  admit != 0: the CPU's experts are then queued to
 * the cache's prefetch worker below every prediction (priority -1e30 / their token count),
 * hottest first and as many as fit the layer's I/O budget (Eq. 10: the copies' time, the
 * cut's included, within max(T_cpu, T_gpu); without the drafting term), where the policy's
 * admission rule decides whether each enters the cache (slots.h: a utility policy admits a
 * key only over a victim of no higher utility; MoE-SpAc's levels with the `spac` policy);
 * without a worker nothing is queued.  Only the cache's own share is split (not low-bit
 * copies, the draft copy or the host tier).  on = 0 turns it off.  SMOE_EINVAL: costs not
 * finite >= 0; SMOE_ESTATE: the tier has no host copy (the host tier, or a GPU cache in
 * staged mode). */
int smoe_layers_set_hybrid(smoe_layers *g, int on, double t_io, double t_gpu, double t_cpu,
                           int admit, smoe_err *err);

/* Resident low-bit copy `level` (0 or 1, see lowbit above): every block in store order at base
 * (size bytes, block_bytes each, the FFN in desc, same H; in the tier's memory: GPU memory on
 * a GPU tier, and desc a format its kernels take), borrowed until replaced; base NULL
 * removes it (SMOE_ESTATE while the miss mode uses it, or for copy 0 while copy 1 is set). */
int smoe_layers_set_lowbit(smoe_layers *g, uint32_t level, const uint8_t *base, uint64_t size,
                           uint64_t block_bytes, const smoe_ffn_desc *desc, smoe_err *err);

/* One MoE layer (see the top of this file).  scores: NULL (use the router) or [T, E] f32
 * scores of layer pos+1 from the caller.  replace: the prefetch request replaces the queue
 * (else it adds to it, e.g. behind a draft-driven lookahead).  draft: NULL or [T] flags of
 * draft tokens (the MTP drafter's masks, specmoe/speculation/mtp.py), which never make an expert load: a
 * draft token's missing expert is computed from the low-bit copy when the layer has one, else
 * skipped (weights not renormalised), unless it is resident or fetched for a real token
 * anyway; draft tokens take no part in the next-layer prediction, in DROP/PRIORITY's kept
 * ranks or in the policy's counts, and their pairs run in expert calls of their own, so the
 * real tokens' outputs are those of a forward whose draft rows hold anything else (exact
 * for f32/bf16 whatever the drafts route to).  Blocks; call without the GIL. */
int smoe_layers_forward(smoe_layers *g, uint32_t pos, const float *x, uint32_t T,
                        const int64_t *idx, const float *w, float *out, uint8_t *used,
                        const float *scores, int replace, const uint8_t *draft,
                        smoe_err *err);

/* smoe_layers_forward on any tier: x [T,H] on the host (routing, prediction, step 4), xd the
 * same rows in the tier's memory and out [T,H] there too (the host tier: xd == x, out host
 * memory), stream the device tier's compute stream (NULL on the host tier).  The experts'
 * work is enqueued on stream; it may still run when this returns. */
int smoe_layers_forward_on(smoe_layers *g, uint32_t pos, const float *x, const float *xd,
                           uint32_t T, const int64_t *idx, const float *w, float *out,
                           uint8_t *used, const float *scores, int replace,
                           const uint8_t *draft, void *stream, smoe_err *err);

/* The self-draft's resident copy of every expert (store order at base, in the tier's memory,
 * borrowed until replaced; base NULL removes it), for smoe_layers_forward_draft. */
int smoe_layers_set_draft(smoe_layers *g, const uint8_t *base, uint64_t size,
                          uint64_t block_bytes, const smoe_ffn_desc *desc, smoe_err *err);

/* A draft forward's MoE layer (MoE-SpeQ's self-draft): out [T,H] (tier memory, overwritten) =
 * the routed experts of idx/w computed from the draft copy, on the tier's kernels and stream;
 * no cache access, no prediction, no counters.  xd: the layer's input in the tier's memory.
 * SMOE_ESTATE without a draft copy.  Blocks; call without the GIL. */
int smoe_layers_forward_draft(smoe_layers *g, uint32_t pos, const float *xd, uint32_t T,
                              const int64_t *idx, const float *w, float *out, uint8_t *used,
                              void *stream, smoe_err *err);

/* route_flags of smoe_layers_forward_routed. */
enum {
    SMOE_ROUTE_RENORM = 1,
    SMOE_ROUTE_BF16_LOGITS = 2,
    SMOE_ROUTE_BF16_WEIGHTS = 4,
    SMOE_ROUTE_BF16_OUT = 8, /* the block's output as a bf16 model adds it up (shared FFN) */
    SMOE_ROUTE_TOPK_SOFTMAX = 16, /* GPT-OSS's router: the k largest logits z, the weights the
                                     softmax of those k (f32), not of all E */
    SMOE_ROUTE_ALL = 31
};

/* smoe_layers_forward with this layer's routing computed here first, from the same router
 * copy as the prediction -- the model's softmax top-k router (OLMoE, Qwen-MoE, Mixtral,
 * DeepSeek-V2's greedy top-k; ERNIE-4.5's with its correction bias) or sigmoid one
 * (DeepSeek-V3's noaux_tc: V3, R1, Kimi-K2, GLM-4.5 / 4.7-Flash, dots1):
 *     z = x W^T + b                 (f32; rounded to bf16 with SMOE_ROUTE_BF16_LOGITS, as a
 *                                    bf16 model's F.linear output)
 *     p = softmax(z)                (f32), or sigmoid(z) for a sigmoid router, where then
 *     v = p + corr                  (the correction bias; none: 0), limited to the layer's
 *                                    groups (smoe_route_group_limit, set_block's n_group and
 *                                    topk_group; 1, 1: all); a softmax router with a
 *                                    correction bias (ERNIE-4.5's Ernie4_5_MoeStatics) chooses
 *                                    by v = p + corr too, without groups
 *     the k largest v (without a correction bias v = p; SMOE_ROUTE_TOPK_SOFTMAX: z) per
 *     token, descending (ties: lower id), into idx;
 *     their p into w, divided by their sum (sigmoid: the sum + 1e-20, V3's; softmax with
 *     a correction bias: the sum, at least 1e-12, ERNIE-4.5's moe_norm_min) with
 *     SMOE_ROUTE_RENORM (SMOE_ROUTE_TOPK_SOFTMAX: exp(z - the largest z) over the k's sum,
 *     GPT-OSS's softmax of the chosen logits; RENORM then changes nothing),
 *     times the layer's routing scale (smoe_layers_set_block; DeepSeek's
 *     routed_scaling_factor), rounded to bf16 with SMOE_ROUTE_BF16_WEIGHTS (a bf16 model's
 *     weights cast back to its dtype).
 * Then, when the layer has a shared FFN (smoe_layers_set_block), out += its output on x, as
 * DeepSeek's MoE block adds them: f32 throughout, or with SMOE_ROUTE_BF16_OUT as a bf16 model
 * computes it -- the experts' sum rounded to bf16, each projection's output, the activation
 * silu(g) and the product with u rounded to bf16, and the sum rounded to bf16.
 * idx, w: [T, k] outputs.  The logits' summation order differs from torch's GEMV, so a
 * near-tie at the k-th place (equal bf16 logits are not rare) may choose differently from
 * transformers' router (whose topk breaks ties in no documented order). */
int smoe_layers_forward_routed(smoe_layers *g, uint32_t pos, const float *x, uint32_t T,
                               int route_flags, int64_t *idx, float *w, float *out,
                               uint8_t *used, int replace, const uint8_t *draft,
                               smoe_err *err);

/* Layer pos's routing scale (finite, > 0), group-limited choice (n_group dividing E into
 * groups of >= 2 when > 1, topk_group in 1..n_group keeping room for k experts; 1, 1: none)
 * and shared FFN (NULL or d[0] NULL: none; else the three projections' shapes must chain
 * H -> I -> H), used by smoe_layers_forward_routed.  Takes mu: waits for a forward in
 * flight. */
int smoe_layers_set_block(smoe_layers *g, uint32_t pos, float route_scale, uint32_t n_group,
                          uint32_t topk_group, const smoe_shared_ffn *shared, smoe_err *err);

/* Step 2's predictor when the caller passes no scores (SMOE_LPRED_*); forgets pending
 * predictions.  LEARNED builds a fresh nextuse policy of one slot from model/model_len
 * (policy/nextuse.h; NULL: its built-in temporal weights; a bad model is the policy's
 * SMOE_EINVAL), fed from then on, at each layer call, the pass (at pos 0) and the union of the
 * real tokens' experts of the layer (smoe_policy_pass / smoe_policy_access, as sim.c feeds
 * SMOE_PRED_LEARNED), and ranks the next layer's experts by its q: the top
 * m = clamp(ceil(k * overfetch), k, E) by q, priority q (the mass rule does not apply: q are
 * probabilities of different events, not a distribution).  ORACLE needs a replay
 * (SMOE_ESTATE without one): the trace's k experts of layer pos+1 for each token of the call,
 * priority k - rank (overfetch adds no more).  ROUTER: smoe_route_predict as documented above. */
int smoe_layers_set_predictor(smoe_layers *g, int predictor, const double *model,
                              uint64_t model_len, smoe_err *err);

/* Routing replay (issue 41 item 2; benchmarks and research, never on by default): experts
 * [n, L, k] (copied; each row k distinct ids < E, else SMOE_EINVAL naming the first bad one)
 * replaces what smoe_layers_forward_routed's router chooses: a pass of T tokens (a call at
 * pos 0) takes the trace's next T tokens, and at every layer token t routes to trace row
 * (first + t, pos) in the trace's order, with weights from the router's probabilities p of
 * that layer restricted to that set (renormalised over it with SMOE_ROUTE_RENORM, times the
 * routing scale, rounded as the flags say): with random weights the access pattern is the
 * recorded model's, the arithmetic the model's own.  A pass that needs more tokens than are
 * left is SMOE_ESTATE before anything runs.  Draft tokens are SMOE_EINVAL under a replay (a
 * replay is a sequence of real tokens).  Calls with caller-chosen routing
 * (smoe_layers_forward) are not replayed.  experts NULL: off (SMOE_ESTATE while the ORACLE
 * predictor is set).  The next pass starts at trace token `start` (<= n, else SMOE_EINVAL): 0
 * for a new replay, the position read back (smoe_layers_replay_position) to carry one over. */
int smoe_layers_set_replay(smoe_layers *g, const int16_t *experts, uint64_t n, uint64_t start,
                           smoe_err *err);

/* Trace tokens a replay has consumed (0 without one) and its length. */
void smoe_layers_replay_position(smoe_layers *g, uint64_t *used, uint64_t *n);

/* Token priors (policy.h on_prior; issue 42 item 1: what a pass's token says before its
 * layers run).  A pass of one token gets a row of table [n][L * E], given to the cache's
 * policy after its on_pass and to the learned predictor's (sim.c gives the simulator's passes
 * the same): under a replay with rows, the replayed token t's row rows[t]; otherwise the row
 * set by smoe_layers_set_next_prior before the pass (the caller knows the token's id); none
 * (NULL) for a row < 0, a pass of several tokens, or no table.  Copies table and rows; rows
 * NULL: none (nrows ignored), else nrows must be the replay's length and every row < n
 * (SMOE_EINVAL) and a replay must be set (SMOE_ESTATE).  table NULL: off.  A new replay
 * drops the rows, not the table. */
int smoe_layers_set_priors(smoe_layers *g, const float *table, uint64_t n, const int32_t *rows,
                           uint64_t nrows, smoe_err *err);

/* The table row of the next pass's token (-1: none), consumed when that pass starts; a
 * replay's own rows take precedence.  SMOE_EINVAL for a row >= the table's rows (or with no
 * table). */
int smoe_layers_set_next_prior(smoe_layers *g, int32_t row, smoe_err *err);

/* Copy the counters (and reset them when reset != 0), forget pending predictions when reset. */
void smoe_layers_counters(smoe_layers *g, smoe_layer_counters *out, int reset);

#endif

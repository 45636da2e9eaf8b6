/* Trace-driven simulator: replays a routing trace through a cache of `nslots` expert slots
 * under one of the eviction policies of csrc/policy/ (the very objects the live cache uses),
 * with an optional prefetch predictor, and estimates time with a small hardware model.
 *
 * Replay order: token by token in text order (each token is one forward pass), each token
 * through all MoE layers in order, each layer's experts in recorded order.
 *
 * Verification groups (tr->verify_tokens = g > 1; 0 or 1 = the one-token passes above): each
 * pass covers g consecutive tokens (the last pass of a trace may have fewer), as a speculative
 * verification pass of K = g-1 draft tokens plus one does.  A pass goes layer by layer; at each
 * layer its demand accesses are the union of the g tokens' experts, each expert once, in order
 * of first appearance (token order, then recorded order), like the live moe_forward that
 * acquires each needed expert once per layer per pass.  Before the pass's first access (right
 * after on_pass) the policy gets on_counts with, for every layer, the number of the pass's
 * tokens that route to each expert (every layer is observed): the live loop feeds the draft's
 * predicted counts before verification, and in a trace the verified tokens' routing is that
 * prediction made exact.  Time per pass: token_fixed_s once (the pass reads the dense weights
 * once), per layer layer_fixed_s plus expert_bytes / fast_bw per distinct expert.  Prefetch
 * predictors are defined per token and are not available with g > 1 (SMOE_EINVAL).
 *
 * Lookahead shield (tr->protect, demand only, any verify_tokens): MoE-SpeQ's expert lookahead
 * buffer (Sec. 3.3) with lookahead-aware eviction, as Engine.protect_lookahead runs it live
 * (smoe_slots_set_protected): before a pass's first access the experts its tokens route to in
 * every layer are protected -- the draft's routing, made exact by the trace as for on_counts --
 * and after each layer's accesses that layer's are released (the set becomes the keys of the
 * layers still to run).  A victim is sought among unprotected slots first, and only when the
 * policy finds none there among all (counted in protected_evictions).
 *
 * Cache semantics: the simulated cache is the live caches' slot table (slots.h), driven by
 * the replay through its rules (smoe_slots_claim, _loaded, _touch, _unpin, _set_pass), so slot
 * choice, victims (demand, prefetch admission, the lookahead shield), policy events and the
 * eviction counts are the live code's; the replay adds only its clock.  In words:
 *   - pass boundary at every token: on_pass(t + 1) for token t = 0, 1, ... (ids start at 1);
 *     a policy with on_counts (spac, spac_ema, score) then gets the token's experts with count 1 for every
 *     layer (the one-token case of the verification groups below; other policies see nothing);
 *   - demand hit: on_access;  demand miss: the lowest-numbered free slot, else the policy's
 *     victim among slots not being loaded right now (on_evict), then on_insert(s, key, 0);
 *   - prefetch load: the same with on_insert(s, key, 1), but the victim must also not have
 *     been used by demand in the current pass and, under a policy with a utility (spac), not
 *     have a higher utility than the prefetched key; no victim -> the request is dropped;
 *     under a policy with a threshold (spac's τ_t) a request whose key's utility is below it
 *     is dropped before a slot is looked for (only hot experts are prefetched);
 *   - nothing is pinned between accesses (each access is acquire + release, as in the
 *     agreement test), so with no prefetch the hit/miss counts equal the live cache's.
 * A collision miss is a miss on an expert evicted earlier in the same pass.  A demand access
 * that finds its expert still being prefetched is a miss (as in cache.c: "late"); it waits.
 *
 * Time model (all times in seconds, one request stream, batch 1 decoding):
 *   compute   decode is weight-read bound: an expert costs expert_bytes / fast_bw; each MoE
 *             layer adds layer_fixed_s (attention, router, shared experts: resident weights)
 *             and each token token_fixed_s (dense layers, embeddings, LM head).
 *   per layer: t += layer_fixed_s; then the layer's demand accesses in order: a hit costs
 *             nothing, a miss loads on the link now (link_latency_s + expert_bytes / link_bw)
 *             and compute waits for it (stall), a late prefetch waits until it is ready
 *             (stall); then the predictor issues prefetches for coming layers (they replace
 *             the queued, not yet started requests); then t += compute of the layer's experts.
 *   prefetch  a separate copy engine takes queued requests one at a time in order (highest
 *             score first, nearest layer first) as soon as it is free; a request whose expert
 *             is already resident is skipped; the slot is chosen (and a victim evicted) when
 *             the copy starts; the copy takes link_latency_s + expert_bytes / link_bw and
 *             overlaps compute.  The link is shared: a demand load pre-empts the copy engine,
 *             pushing the in-flight prefetch back by the demand load's duration.  With
 *             admission on, a request is loaded only when admit.h's rule accepts it when the
 *             copy would start (its victim then known), else it is refused.
 *   stall_s   total time compute waited for loads; total_s the simulated decode time.
 */
#ifndef SMOE_SIM_H
#define SMOE_SIM_H

#include "common.h"
#include "policy/policy.h"

enum {
    SMOE_PRED_NONE = 0,    /* demand only */
    SMOE_PRED_ORACLE = 1,  /* the true experts of the next `depth` layer positions */
    SMOE_PRED_ROUTER = 2,  /* next layer's router logits (recorded in the trace) */
    SMOE_PRED_HISTORY = 3, /* recent use of the target layer + layer-to-layer co-activation */
    SMOE_PRED_LEARNED = 4  /* the learned next-use model's q (policy/nextuse.h): the experts of
                              the target layer most likely used at its next run, the model fed
                              every token's routing as it is replayed */
};

typedef struct smoe_sim_trace {
    const int16_t *experts; /* [num_tokens, num_layers, top_k], ids < num_experts */
    const float *logits;    /* [num_tokens, num_layers, num_experts] or NULL */
    uint64_t num_tokens;
    uint32_t num_layers, top_k, num_experts;
    uint32_t verify_tokens; /* tokens per pass (verification group); 0 or 1: one per pass */
    uint32_t protect;       /* 1: the expert lookahead buffer's eviction shield (below) */
    /* The tokens' priors (policy.h on_prior; issue 42 item 1), or NULL: at token t's pass the
     * cache's policy and the learned predictor get prior_table + prior_rows[t] * num_layers *
     * num_experts, or NULL where prior_rows[t] < 0 (an unknown token).  Rows are < prior_n.
     * Passes of several tokens (verify_tokens > 1, protect) get none. */
    const float *prior_table;   /* [prior_n, num_layers * num_experts] */
    const int32_t *prior_rows;  /* [num_tokens] */
    uint64_t prior_n;
} smoe_sim_trace;

typedef struct smoe_sim_hw {
    double expert_bytes;   /* bytes of one routed expert */
    double fast_bw;        /* fast-tier read bandwidth, bytes/s (compute model) */
    double link_bw;        /* slow -> fast link bandwidth, bytes/s */
    double link_latency_s; /* fixed cost of one load */
    double layer_fixed_s;  /* per token per MoE layer */
    double token_fixed_s;  /* per token */
} smoe_sim_hw;

typedef struct smoe_sim_prefetch {
    int32_t predictor;  /* SMOE_PRED_* */
    uint32_t depth;     /* layer positions ahead to predict (oracle, history); router: 1 */
    uint32_t topk;      /* experts fetched per predicted layer (0: the trace's top_k); with
                           percentile > 0 it caps the count (0: no cap) */
    double percentile;  /* in [0, 1): fetch the experts whose score is >= this quantile of the
                           layer's scores and > 0; 0 = fixed top-k selection */
    uint32_t history;   /* history predictor: window of recent tokens (>= 1) */
    double cooc_weight; /* history predictor: weight of co-activation vs recent use, [0, 1] */
    const double *model; /* learned predictor: the nextuse model (NextUseModel.flat()), or
                            NULL for the built-in temporal weights */
    uint64_t model_len;
    int32_t admission;  /* 1: prefetch admission by expected benefit (admit.h), the live
                           caches' rule through the same slot table (2: without its byte
                           budget, the time-only rule of the offline bound): each request
                           carries its predictor score as the probability of use (oracle 1;
                           router the softmax probability; learned q; history its score) and
                           the layer steps ahead it was predicted for; the table's estimates
                           are fed the replay's virtual clock (every load, stall and pass) */
} smoe_sim_prefetch;

typedef struct smoe_sim_result {
    uint64_t accesses, hits, misses, collision_misses, evictions;
    uint64_t prefetch_issued;  /* prefetch copies started */
    uint64_t prefetch_used;    /* prefetched experts later used by demand (incl. late) */
    uint64_t prefetch_late;    /* demand found the prefetch still in flight (counted a miss) */
    uint64_t prefetch_wasted;  /* prefetched experts evicted unused */
    uint64_t prefetch_dropped; /* requests dropped: no evictable slot */
    uint64_t prefetch_refused; /* requests refused by the admission rule (pf->admission) */
    uint64_t predicted;        /* experts predicted for the next layer (all predictions) */
    uint64_t predicted_true;   /* of those, experts the next layer really used */
    uint64_t next_true;        /* true experts of the next layer at prediction points */
    double stall_s, compute_s, total_s;
    double elapsed_s;          /* wall time of the replay */
    /* miss handling (smoe_sim_miss), in accesses: */
    uint64_t missing;          /* demanded experts not resident (absent or still in flight) */
    uint64_t dropped;          /* of those, skipped */
    uint64_t substituted;      /* of those, replaced by a resident expert (counted a hit) */
    uint64_t lowbit;           /* of those, computed from a resident low-bit copy */
    uint64_t lowbit2;          /* of those, from the second copy (PRIORITY, ranks >= keep2) */
    uint64_t protected_evictions; /* evictions of a protected key (tr->protect) */
    /* the hybrid tier (SMOE_SIM_HYBRID), in experts: */
    uint64_t hybrid_copied;    /* missing experts the cut demanded */
    uint64_t hybrid_cpu;       /* missing experts computed on the CPU */
    uint64_t hybrid_admitted;  /* of those, queued for admission (Eq. 10) */
    double hybrid_cpu_wait_s;  /* time layers waited for the CPU's part past the device's */
} smoe_sim_result;

/* SpecMD miss handling (Sec. 3.1.2), the live rule of csrc/layer.h step 4 on a trace.  An
 * expert is resident when its slot is loaded (a prefetch still in flight is not, as in the
 * live cache).  A missing expert of token t at layer l is
 *   FETCH       demanded as usual (load, stall);
 *   DROP        skipped (no load, no compute, the cache and policy see nothing) unless its
 *               rank in the token's routing is below keep -- the rank by the trace's router
 *               logits (descending, ties by recorded position) when the trace has them, else
 *               its recorded position (the real traces list the router's top-k unsorted, so
 *               there the rank is only the router's output order);
 *   SUBSTITUTE  replaced by the resident expert of layer l not in the token's set (nor already
 *               substituting in it) whose logit is closest to the missing one's (ties: lower
 *               id; without logits: the lowest resident id), demanded instead (a hit); none:
 *               fetched;
 *   LOWEST_BIT  computed from a resident low-bit copy: no load, compute lowbit_ratio *
 *               expert_bytes / fast_bw;
 *   PRIORITY    fetch-priority: a rank below keep (DROP's rank) is demanded as usual, the
 *               others are computed from a low-bit copy as LOWEST_BIT: ranks keep..keep2-1
 *               from the first (lowbit_ratio), ranks keep2.. from the second (lowbit2_ratio;
 *               SpecMD's int8 -> int4 -> int2 cascade, layer.h step 4).
 * Not available with verification groups (verify_tokens > 1): SMOE_EINVAL.
 *
 *   HYBRID      the hybrid GPU tier (issue 37; csrc/layer.c hybrid_split, MoE-SpAc section
 *               3.3): per layer, the token's missing experts (not in a slot; one in flight
 *               counts as on the device, as live) are ordered by count, then id, and the
 *               first cut = smoe_route_balance_cut(counts, m, on_fast, t_io, t_gpu, t_cpu) of
 *               them are demanded (loaded as FETCH), the others computed on the CPU where
 *               they live (no load, no slot, the cache and policy see nothing): t_io is one
 *               load (link_latency_s + expert_bytes / link_bw), t_gpu one expert's compute
 *               (expert_bytes / fast_bw), t_cpu = cpu_expert_s.  The CPU's part starts with
 *               the layer's demand accesses and overlaps them and the device's compute: the
 *               layer ends at the later of the two.  With a predictor the hottest
 *               smoe_route_balance_admit(.., window) of the CPU's experts (Eq. 10: those
 *               whose copy pays, as many as fit the layer's window max(T_cpu, T_gpu) left
 *               after the cut's copies) are queued to the copy engine after the layer's
 *               predictions, as the live layer queues them (admission to the cache).
 *               Not numbered as layer.h's miss rules: the live tier's switch is
 *               smoe_layers_set_hybrid, and it composes with them; here it replaces them.
 */
enum { SMOE_SIM_FETCH = 0, SMOE_SIM_DROP = 1, SMOE_SIM_SUBSTITUTE = 2, SMOE_SIM_LOWEST_BIT = 3,
       SMOE_SIM_PRIORITY = 4, SMOE_SIM_HYBRID = 5 };

typedef struct smoe_sim_miss {
    int32_t mode;        /* SMOE_SIM_*, numbered as layer.h's SMOE_MISS_* */
    uint32_t keep;       /* DROP, PRIORITY: ranks 0..keep-1 are always fetched */
    double lowbit_ratio; /* LOWEST_BIT, PRIORITY: bytes of the low-bit copy / expert_bytes,
                            in (0, 1] */
    uint32_t keep2;      /* PRIORITY: ranks keep2.. from the second copy; >= top_k: none
                            (keep <= keep2) */
    double lowbit2_ratio; /* the second copy's bytes / expert_bytes, in (0, 1] when used */
    double cpu_expert_s;  /* HYBRID: the CPU's time for one expert and one token, > 0 */
} smoe_sim_miss;

/* Replay `tr` through a cache of `nslots` slots managed by `policy` (built for nslots,
 * tr->num_layers, tr->num_experts; borrowed, left in its final state).  `pf` may be NULL
 * (no prefetch).  Returns 0, SMOE_EINVAL (bad argument, named), SMOE_ENOMEM, or
 * SMOE_EPOLICY when the policy reported a failure or returned an invalid victim. */
int smoe_sim_run(const smoe_sim_trace *tr, smoe_policy *policy, uint32_t nslots,
                 const smoe_sim_prefetch *pf, const smoe_sim_hw *hw, smoe_sim_result *out,
                 smoe_err *err);

/* smoe_sim_run with a miss-handling rule (NULL: FETCH). */
int smoe_sim_run_miss(const smoe_sim_trace *tr, smoe_policy *policy, uint32_t nslots,
                      const smoe_sim_prefetch *pf, const smoe_sim_hw *hw,
                      const smoe_sim_miss *miss, smoe_sim_result *out, smoe_err *err);

#endif

/* The routing rules written once, for the CPU layers (layer.c), the GPU tier
 * (specmoe.runtime.gpu_engine through _C.predict_next) and any later caller: the models' score
 * function over router logits, the expert ranking, and the next-layer prediction that decides
 * which experts are prefetched.  Plain loops over caller-owned buffers; no allocation. */
#ifndef SMOE_ROUTE_H
#define SMOE_ROUTE_H

#include <stdint.h>

/* s[T,E] in place: the score function of a model whose router has a correction bias corr[E]
 * (DeepSeek-V3 and its kin): sigmoid(l) + corr when sigmoid, else softmax(l) + corr.  Without a
 * correction bias (corr NULL) the logits are the scores and s is left as it is. */
void smoe_route_scores(float *s, uint32_t T, uint32_t E, int sigmoid, const float *corr);

/* order[0..E) = expert ids by v descending, ties by the lower id. */
void smoe_route_rank(const float *v, uint32_t E, int32_t *order);

/* order[0..k) = the first k of smoe_route_rank's order (the k largest v, descending, ties by
 * the lower id), in O(E k) at worst; k <= E. */
void smoe_route_topk(const float *v, uint32_t E, uint32_t k, int32_t *order);

/* DeepSeek-V3's group-limited choice (transformers' DeepseekV3TopkRouter, llama.cpp's
 * expert_group_used_count) on one token's selection values v [E], in place: the E experts in
 * n_group groups of E / n_group (>= 2) in id order; a group's score is the sum of its two
 * largest v; the topk_group groups of the largest scores (ties by the lower group) keep
 * their v, every other expert's v becomes -inf.  gs: scratch [n_group]. */
void smoe_route_group_limit(float *v, uint32_t E, uint32_t n_group, uint32_t topk_group,
                            float *gs);

/* The next-layer prediction (layer.h, step 1) from scores[T,E] of the tokens t with
 * !(skip && skip[t]):
 *   mass <= 0: per token the top m = clamp(ceil(k * overfetch), k, E) experts by score;
 *   mass  > 0: per token the fewest experts, at least k, whose softmax probability of the
 *              scores sums to >= mass (ranked by that probability).
 * mark[E] = 1 for every expert chosen by some token (0 otherwise); best[E] = the highest score
 * (mass mode: probability) with which a token chose it, -INFINITY when none did: the prefetch
 * priority.  order[E] and prob[E] are scratch. */
void smoe_route_predict(const float *scores, uint32_t T, uint32_t E, uint32_t k, double overfetch,
                        double mass, const uint8_t *skip, uint8_t *mark, float *best,
                        int32_t *order, float *prob);

/* The hybrid tier's split of a layer's missing experts (issue 37; MoE-SpAc section 3.3, the
 * heterogeneous workload balancer): how many to copy to the fast tier, the rest computed on
 * the CPU where they live.  counts[0..m) are the tokens routed to each missing expert in
 * descending order (the copied ones are the first n: hot on the GPU, cold on the CPU, section
 * 2.3); on_fast the layer's experts already resident or loading.  For a cut n:
 *     T_cpu(n) = t_cpu * sum(counts[n:])                 (Eq. 7: token-expert products)
 *     T_gpu(n) = t_io * n + t_gpu * (on_fast + n)         (Eq. 8: each GPU expert once for all
 *                                                          its tokens, plus the n copies, which
 *                                                          at decode have no drafting window of
 *                                                          Eq. 10 to hide in)
 * and the answer minimises |T_cpu(n) - T_gpu(n)| (Eq. 9) over n in 0..m, the smaller n on a
 * tie, in O(m).  Deviations: the decision variable is the cut in this layer's token counts,
 * not a threshold tau on the estimator's levels (every tau of Eq. 12 is such a cut; at
 * decode the counts are known exactly); Eq. 11 holds by construction (the cache evicts to
 * make room, the CPU's experts take no slot).  Costs are seconds, finite and >= 0. */
uint32_t smoe_route_balance_cut(const uint32_t *counts, uint32_t m, uint32_t on_fast,
                                double t_io, double t_gpu, double t_cpu);

/* The hybrid tier's admission (MoE-SpAc section 3.3, Eq. 10): of experts the CPU would
 * otherwise compute, with token counts `counts` [m] in descending order, how many of the
 * first to copy to the fast tier: those whose copy pays (t_cpu * count > t_gpu: the CPU time
 * it saves exceeds the device time it costs), at most floor(window / t_io) of them (the
 * copies must fit the computation window: T_total, plus gamma * T_draft / L while
 * speculating).  t_io = 0: no cap; window <= 0: none. */
uint32_t smoe_route_balance_admit(const uint32_t *counts, uint32_t m, double t_io,
                                  double t_gpu, double t_cpu, double window);

#endif

/* Learned next-use eviction ("nextuse", issue 42): Belady's rule with a learned future.
 *
 * Belady evicts the resident expert whose next use is furthest away.  Online the next use is
 * not known, but two things about it are: *when* the expert's layer next runs (exactly: the
 * layer-by-layer order of a forward pass), and *how likely* the expert is to be used then (a
 * logistic model of what the policy has seen).  The policy evicts the slot of least value
 *
 *     v(k) = q(k) / (dl(k) + c)  +  beta * r(k) / (dl(k) + L + c)
 *
 * the expected hits per unit of slot time over the next two runs of the key's layer: q the
 * predicted probability that key k = (layer l, expert e) is used at the next run of layer l,
 * dl the layer steps until that run, r a long-run use rate standing for the run after it, L
 * the number of MoE layers; c and beta come with the model (ties: the lowest slot).
 *
 * State, all from the event stream of policy.h (nothing else is needed, so the live caches
 * and the simulator run it unchanged): an internal pass counter P (1 before the first on_pass,
 * +1 at each on_pass); per key the pass of its last demand touch (access or demand insert; a
 * prefetch insert is no use), 0 = never; per key two exponential averages of "used in a pass"
 * (es with alpha_s, el with alpha_l), folded in at each on_pass for the pass that ends; lc =
 * the layer of the latest demand touch in the current pass, -1 before the first one.
 *
 * Features of key k = (l, e), at a victim choice:
 *   inpass  = l > lc, or l == lc and k not touched in pass P (the next run of layer l is in
 *             the current pass: still to come, or running now and k not yet asked for);
 *   dl      = inpass ? (l == lc ? 0 : l - lc) : l - lc + L       (lc = -1: l + 1);
 *   last    = 1 when k was used in the latest run of layer l before that next run (pass P - 1
 *             when inpass, else P), else 0;
 *   es, el  = the averages (through pass P - 1);
 *   gap     = log(min(max(R - used(k), 1), 256)), R = P when inpass else P + 1; log 256 when
 *             never used (the max matters only when a layer comes twice in one pass);
 *   cross   = with cross tables, when inpass, l >= 1, l <= lc + 1 and layer l - 1 has demand
 *             touches in pass P (so they belong to the same pass as k's next run), "fresh":
 *                 bias[l][e] + sum over d = 1 .. min(D, l) of the mean of cross_d[l][a][e]
 *                 over the experts a of layer l - d touched in pass P (0 when none are),
 *             the evidence the token's routing at its D layers before l brings for e at l
 *             (D = 1, no bias: the format-1/2 model, one naive-Bayes table); else absent.
 *             The mean, not the sum, keeps a batched pass (the union of several tokens'
 *             experts) on the scale of one token's.
 *   prior   = when inpass and the pass's token prior is known (on_prior, policy.h: the caller's
 *             per-key log ratio of "the pass's token uses it", from a table keyed by the token
 *             id, issue 42 item 1): prior[k]; else absent.
 *   q = sigmoid(w_fresh . (1, last, es, el, gap, cross) [+ w_tok_fresh . (1, prior)]) when
 *       fresh, else sigmoid(w_stale . (1, last, es, el, gap) [+ w_tok_stale . (1, prior)]),
 *       the bracket where the prior is present (added after the rest).
 * All arithmetic in double; the plain-Python reference (tests/ref_policies.py RefNextUse)
 * follows the same order of operations.
 *
 * Model: a flat array of doubles (specmoe.sim.nextuse.NextUseModel.flat):
 *   [0] format version (1, 2 or 3); [1..6] w_fresh; [7..11] w_stale; [12] alpha_s;
 *   [13] alpha_l; [14] c; [15] beta; [16] formats 1-2: 1 when one cross table follows, else
 *   0; format 3: D, the number of cross tables (0 .. SMOE_NU_MAX_DEPTH); formats 2-3:
 *   [17..18] w_tok_fresh, [19..20] w_tok_stale (format 1: no token weights, the prior is
 *   ignored); then, format 3 with D > 0, bias[l][e] (num_layers * num_experts values); then
 *   the D tables cross_1 .. cross_D, each num_layers * num_experts^2 values (cross_d[l][a][e],
 *   l-major; layers l < d unused).
 * Without a model (params->model == NULL: the policy created by name) the built-in weights
 * below are used, with no cross table: the temporal part, which does not depend on the
 * model's shape.
 *
 * Prefetch admission (issue 42 item 3): the policy's utility is this value (as an integer,
 * 1e8 per unit), so the prefetch rule shared by the live caches and the simulator
 * (policy.h, smoe_policy_prefetch_may_evict) lets a prefetch evict only a slot whose value
 * is at most that of the expert it brings: a prefetch that would displace something the
 * model expects to be used sooner per slot-time is dropped.
 *
 * Cost: on_pass O(num_layers * num_experts); victim O(nslots + 2 * D * (top_k + 1) *
 * num_experts), the q of keys without a fresh cross feature memoised per pass (an exp per key
 * and pass).
 */
#ifndef SMOE_POLICY_NEXTUSE_H
#define SMOE_POLICY_NEXTUSE_H

#include "policy.h"

enum { SMOE_NU_VERSION = 3, SMOE_NU_HEADER = 21, SMOE_NU_HEADER_V1 = 17, SMOE_NU_MAX_DEPTH = 8 };

/* The predicted q of every key (out[num_layers * num_experts]) in the policy's current state;
 * p must be a nextuse policy (SMOE_EINVAL otherwise).  For tests and benchmarks. */
int smoe_nextuse_predict(smoe_policy *p, double *out, smoe_err *err);

/* The q of the experts of one layer (out[num_experts]) in the current state: the simulator's
 * learned prefetch predictor (sim.h, SMOE_PRED_LEARNED) keeps a nextuse policy of one slot,
 * feeds it the replayed routing (on_pass, on_access) and ranks by this.  p must be a nextuse
 * policy and layer < num_layers (unchecked: the simulator's own object). */
void smoe_nextuse_layer_q(smoe_policy *p, uint32_t layer, double *out);

#endif

/* The per-iteration acceptance rule of speculative decoding.
 *
 * After one target forward over the K+1 positions (last accepted token + K draft tokens), the
 * loop knows p[i] = the target's distribution of the token after position i (i = 0..K) and
 * asks: how many of the K drafts are accepted (n), and which token comes next.  The iteration
 * then emits draft[0..n-1] followed by next_token (n + 1 tokens).
 *
 * Shapes (row-major, no padding):
 *   p      float  [K+1][V]  target probabilities
 *   draft  int64  [K]       draft ids in [0, V)
 *   q      float  [K][V]    draft probabilities the drafts were sampled from, or NULL: the
 *                           proposal was deterministic (n-gram lookup, greedy drafter), and
 *                           q[i] is taken as one-hot at draft[i]
 *   u      double [K+1][2]  caller's uniforms in [0, 1), or NULL for GREEDY
 *
 * GREEDY (u == NULL; q is ignored): accept draft i, in order, while draft[i] == argmax(p[i]);
 * stop at the first mismatch.  next_token = argmax(p[n]).  argmax ties go to the lowest index
 * (like numpy/torch).
 *
 * SAMPLING (u != NULL), the speculative-sampling rule of Leviathan et al. (2023) and Chen et
 * al. (2023), which makes every emitted token follow the target distribution exactly:
 *   for i = 0..K-1, d = draft[i], with P = p[i][d] and Q = q[i][d] as doubles:
 *     Q > 0:        accept iff u[i][0] < P / Q   (the same as u < min(1, P/Q) since u < 1)
 *     Q == 0, P > 0: accept (ratio +inf)
 *     Q == 0, P == 0: reject (0/0: the target never emits d, so it must not be accepted)
 *   first rejection at i: next_token ~ residual r[j] = max(0, p[i][j] - q[i][j]) (computed in
 *     double), normalised, sampled with v = u[i][1]; if r sums to 0 (only through rounding,
 *     or a p = q = 0 rejection where p[i] == q[i]), sample from p[i] instead.
 *   all K accepted: next_token ~ p[K] sampled with v = u[K][1].  (u[K][0] is unused.)
 * Sampling a row w[0..V-1] with v in [0, 1): inverse CDF.  total = sum of w in index order,
 * accumulated in double; the answer is the smallest j with w[j] > 0 and cumsum(w)[j] > v*total.
 * A zero-probability id is never returned.  If rounding leaves no such j (v*total rounded up
 * to total), the last j with w[j] > 0 is returned.  Two passes over the row, no buffer.
 *
 * Validation (smoe_spec_accept_check) is separate.  smoe_spec_accept is memory-safe whenever
 * the draft ids are in [0, V) and u (if given) is in [0, 1): it then always reads inside the
 * arrays and answers an id in [0, V) or SMOE_EINVAL.  Its answer follows the rule above when
 * also every p row is non-negative, finite and sums to 1 within SMOE_SPEC_SUM_TOL (so no row
 * is all zero), and q rows the same; with other values the answer is unspecified.
 *
 * No allocation, no global state; thread-safe on distinct or read-only inputs.
 */
#ifndef SMOE_SPEC_VERIFY_H
#define SMOE_SPEC_VERIFY_H

#include "../common.h"

/* |sum(row) - 1| allowed for p and q rows (sums accumulated in double).  Loose enough for
 * float32 softmax over large vocabularies, tight enough to catch logits or counts. */
#define SMOE_SPEC_SUM_TOL 1e-3

/* Check the inputs above (q and u may be NULL): draft ids in range and u in [0, 1) (O(K));
 * with values != 0 also every entry and row sum of p and q (reads each once, O((2K+1)V),
 * about as long as the rule itself in greedy mode).  Returns 0, or SMOE_EINVAL with a
 * message naming the array, row and column. */
int smoe_spec_accept_check(const float *p, const int64_t *draft, const float *q,
                           const double *u, int32_t k, int64_t v, int values, smoe_err *err);

/* The rule above.  *n_accepted gets n in 0..k, *next_token the next token id.  Returns 0, or
 * SMOE_EINVAL for k < 0 or v < 1 (value errors are the caller's to check first). */
int smoe_spec_accept(const float *p, const int64_t *draft, const float *q, const double *u,
                     int32_t k, int64_t v, int32_t *n_accepted, int64_t *next_token,
                     smoe_err *err);

/* argmax of row[0..v-1], ties to the lowest index; v >= 1. */
int64_t smoe_spec_argmax(const float *row, int64_t v);

/* Inverse-CDF sample of the row (see above) with uniform x in [0, 1); the row must have a
 * positive entry (returns -1 otherwise). */
int64_t smoe_spec_sample(const float *row, int64_t v, double x);

#endif

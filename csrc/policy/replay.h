/* Demand-only replay of a key sequence through one policy, with the cache's semantics from
 * policy.h, but no store, no threads and no pins other than an optional random mask.  Used by
 * the policy tests (through _C.replay) and reusable by the simulator.
 *
 * For each access i (keys[i] in 0..num_layers*num_experts-1):
 *   - if i is the next entry of opts->pass_starts (sorted, strictly increasing), first call
 *     on_pass(j+1) where j is that entry's index (so pass ids are 1, 2, ...);
 *   - key resident in slot s:  hits[i] = 1, on_access(s, key), victims[i] = -1;
 *   - else a free slot exists: take the lowest-numbered one, on_insert(s, key, 0),
 *     victims[i] = -1;
 *   - else v = victim(evictable, ctx), on_evict(v, old key), on_insert(v, key, 0),
 *     victims[i] = old key.  If victim returns -1 (possible only with a mask) the access is a
 *     miss that bypasses the cache: nothing is inserted and victims[i] = -1.
 *
 * Optional evictable mask (opts->mask_seed != 0): before every victim() call the replay draws,
 * from one splitmix64 stream seeded with mask_seed (state advanced once per draw), one value per
 * slot in slot order 0..nslots-1; slot s is evictable iff (draw & 3) != 0 (about 3 in 4).
 *
 * Optional activation counts (opts->count_offsets != NULL; needs pass_starts): right after
 * on_pass(j+1) the replay calls on_counts(count_keys + o[j], count_vals + o[j], o[j+1] - o[j])
 * with o = count_offsets (npass + 1 entries, non-decreasing, o[0] = 0), i.e. the counts of a
 * pass are fed before its accesses (as the live loop feeds the draft's counts before
 * verification).  Count keys must be in range.  A policy without on_counts ignores them.
 *
 * A victim() answer that is not a resident evictable slot, or a failure the policy records in
 * p->failure, stops the replay with SMOE_EPOLICY (message names the access index).
 * The policy must be fresh (no events seen yet): the replay starts from an empty cache.
 */
#ifndef SMOE_POLICY_REPLAY_H
#define SMOE_POLICY_REPLAY_H

#include "policy.h"

typedef struct smoe_replay_opts {
    const uint64_t *pass_starts; /* sorted access indices at which a new pass begins, or NULL */
    uint64_t npass;              /* entries in pass_starts */
    uint64_t mask_seed;          /* 0: every resident slot evictable; else random mask (above) */
    const uint64_t *count_offsets; /* NULL, or npass + 1 offsets into count_keys/count_vals */
    const int32_t *count_keys;
    const uint32_t *count_vals;
    /* NULL, or the passes' priors (policy.h on_prior), given after on_pass (and the counts):
     * pass j gets prior_table + prior_rows[j] * nkeys, or NULL where prior_rows[j] < 0;
     * prior_rows has npass entries, each < prior_n. */
    const float *prior_table;
    const int32_t *prior_rows;
    uint64_t prior_n;
} smoe_replay_opts;

/* hits (n entries) and victims (n entries) are filled by the call.  opts may be NULL.
 * Returns 0, SMOE_EINVAL (key out of range, unsorted pass_starts, bad count offsets), SMOE_ENOMEM or
 * SMOE_EPOLICY, with err filled. */
int smoe_policy_replay(smoe_policy *p, const int32_t *keys, uint64_t n,
                       const smoe_replay_opts *opts, uint8_t *hits, int32_t *victims,
                       smoe_err *err);

/* splitmix64 step: the generator used by the random policy and the replay mask. */
static inline uint64_t smoe_splitmix64(uint64_t *state) {
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

#endif

/* Demand-only replay of a key sequence through one policy (contract in replay.h). */
#include "replay.h"

#include <inttypes.h>
#include <stdlib.h>

typedef struct replay_mask {
    const uint8_t *ok; /* one byte per slot for the current victim() call */
} replay_mask;

static int replay_evictable(void *ctx, uint32_t slot) {
    return ((const replay_mask *)ctx)->ok[slot];
}

static int replay_failed(smoe_policy *p, uint64_t i, smoe_err *err) {
    return smoe_err_set(err, SMOE_EPOLICY, "policy %s failed at access %" PRIu64 ": %s",
                        p->ops->name, i, p->failure.msg[0] ? p->failure.msg : "(no message)");
}

int smoe_policy_replay(smoe_policy *p, const int32_t *keys, uint64_t n,
                       const smoe_replay_opts *opts, uint8_t *hits, int32_t *victims,
                       smoe_err *err) {
    const uint64_t nkeys = (uint64_t)p->num_layers * p->num_experts;
    const uint32_t nslots = p->nslots;
    const uint64_t *ps = opts ? opts->pass_starts : NULL;
    const uint64_t npass = (opts && ps) ? opts->npass : 0;
    const uint64_t mask_seed = opts ? opts->mask_seed : 0;

    for (uint64_t i = 0; i < n; i++)
        if (keys[i] < 0 || (uint64_t)keys[i] >= nkeys)
            return smoe_err_set(err, SMOE_EINVAL, "replay: key %" PRId32 " at access %" PRIu64
                                " is outside 0..%" PRIu64 " (num_layers*num_experts-1)",
                                keys[i], i, nkeys - 1);
    for (uint64_t j = 1; j < npass; j++)
        if (ps[j] <= ps[j - 1])
            return smoe_err_set(err, SMOE_EINVAL, "replay: pass_starts must increase strictly "
                                "(entry %" PRIu64 " is %" PRIu64 " after %" PRIu64 ")",
                                j, ps[j], ps[j - 1]);

    const int32_t *prow = (opts && npass) ? opts->prior_rows : NULL;
    for (uint64_t j = 0; prow && j < npass; j++)
        if (!opts->prior_table || (prow[j] >= 0 && (uint64_t)prow[j] >= opts->prior_n))
            return smoe_err_set(err, SMOE_EINVAL, "replay: prior row %" PRId32 " of pass %"
                                PRIu64 " is outside the table's %" PRIu64 " rows", prow[j], j,
                                opts->prior_table ? opts->prior_n : 0);
    const uint64_t *co = (opts && npass) ? opts->count_offsets : NULL;
    if (co) {
        if (co[0] != 0)
            return smoe_err_set(err, SMOE_EINVAL, "replay: count offsets must start at 0, got "
                                "%" PRIu64, co[0]);
        for (uint64_t j = 0; j < npass; j++) {
            if (co[j + 1] < co[j] || co[j + 1] - co[j] > UINT32_MAX)
                return smoe_err_set(err, SMOE_EINVAL, "replay: count offsets must not decrease "
                                    "(pass %" PRIu64 ": %" PRIu64 " then %" PRIu64 ")", j,
                                    co[j], co[j + 1]);
        }
        for (uint64_t i = 0; i < co[npass]; i++)
            if (opts->count_keys[i] < 0 || (uint64_t)opts->count_keys[i] >= nkeys)
                return smoe_err_set(err, SMOE_EINVAL, "replay: count key %" PRId32 " at entry %"
                                    PRIu64 " is outside 0..%" PRIu64, opts->count_keys[i], i,
                                    nkeys - 1);
    }

    int32_t *slot_of = malloc(nkeys * sizeof *slot_of);   /* key -> slot or -1 */
    int32_t *key_of = malloc(nslots * sizeof *key_of);    /* slot -> key or -1 */
    uint8_t *ok = mask_seed ? malloc(nslots) : NULL;
    if (!slot_of || !key_of || (mask_seed && !ok)) {
        free(slot_of);
        free(key_of);
        free(ok);
        return smoe_err_set(err, SMOE_ENOMEM, "replay: out of memory");
    }
    for (uint64_t k = 0; k < nkeys; k++) slot_of[k] = -1;
    for (uint32_t s = 0; s < nslots; s++) key_of[s] = -1;

    int rc = 0;
    uint32_t used = 0; /* free slots are used lowest first and never freed again */
    uint64_t next_pass = 0, rng = mask_seed;
    replay_mask mask = {ok};
    smoe_err_clear(&p->failure);
    for (uint64_t i = 0; i < n; i++) {
        while (next_pass < npass && ps[next_pass] <= i) {
            if (ps[next_pass] == i) {
                smoe_policy_pass(p, next_pass + 1);
                if (co)
                    smoe_policy_counts(p, opts->count_keys + co[next_pass],
                                       opts->count_vals + co[next_pass],
                                       (uint32_t)(co[next_pass + 1] - co[next_pass]));
                if (prow)
                    smoe_policy_prior(p, prow[next_pass] < 0 ? NULL
                                         : opts->prior_table + (uint64_t)prow[next_pass] * nkeys);
            }
            next_pass++;
        }
        const int32_t key = keys[i];
        int32_t s = slot_of[key];
        victims[i] = -1;
        if (s >= 0) {
            hits[i] = 1;
            smoe_policy_access(p, (uint32_t)s, key);
        } else {
            hits[i] = 0;
            if (used < nslots) {
                s = (int32_t)used++;
            } else {
                if (ok)
                    for (uint32_t t = 0; t < nslots; t++)
                        ok[t] = (smoe_splitmix64(&rng) & 3) != 0;
                smoe_err verr;
                smoe_err_clear(&verr);
                if (smoe_policy_checked_victim(p, ok ? replay_evictable : NULL, &mask, &s,
                                               &verr) < 0) {
                    rc = smoe_err_set(err, SMOE_EPOLICY, "at access %" PRIu64 ": %s", i,
                                      verr.msg);
                    break;
                }
                if (s < 0) {
                    if (!ok) {
                        rc = smoe_err_set(err, SMOE_EPOLICY, "policy %s found no victim at "
                                          "access %" PRIu64 " with every slot evictable",
                                          p->ops->name, i);
                        break;
                    }
                    continue; /* bypass: nothing evictable */
                }
                const int32_t old = key_of[s];
                smoe_policy_evict(p, (uint32_t)s, old);
                slot_of[old] = -1;
                victims[i] = old;
            }
            key_of[s] = key;
            slot_of[key] = s;
            smoe_policy_insert(p, (uint32_t)s, key, 0);
        }
        if (p->failure.code) {
            rc = replay_failed(p, i, err);
            break;
        }
    }
    free(slot_of);
    free(key_of);
    free(ok);
    return rc;
}

/* Policy registry and lifetime helpers. */
#include "policy.h"

#include <stdlib.h>
#include <string.h>

static const smoe_policy_ops *const builtins[] = {
    &smoe_policy_lru, &smoe_policy_lfu, &smoe_policy_fifo, &smoe_policy_mru,
    &smoe_policy_random, &smoe_policy_least_stale, &smoe_policy_belady, &smoe_policy_spac,
    &smoe_policy_spac_ema, &smoe_policy_lhu, &smoe_policy_fld, &smoe_policy_score,
    &smoe_policy_nextuse,
};

const smoe_policy_ops *smoe_policy_find(const char *name) {
    for (size_t i = 0; i < sizeof builtins / sizeof builtins[0]; i++)
        if (strcmp(builtins[i]->name, name) == 0) return builtins[i];
    return NULL;
}

const char *smoe_policy_names(void) {
    return "lru, lfu, fifo, mru, random, least_stale, belady, spac, spac_ema, lhu, fld, score, "
           "nextuse";
}

int smoe_policy_checked_victim(smoe_policy *p, smoe_evictable_fn ok, void *ctx, int32_t *slot,
                               smoe_err *err) {
    int32_t v = smoe_policy_victim(p, ok, ctx);
    *slot = -1;
    if (p->failure.code) {
        smoe_err_set(err, SMOE_EPOLICY, "policy %s: %s", p->ops->name,
                     p->failure.msg[0] ? p->failure.msg : "(no message)");
        smoe_err_clear(&p->failure);
        return SMOE_EPOLICY;
    }
    if (v == -1) return 0;
    if (v < 0 || (uint32_t)v >= p->nslots || (ok && !ok(ctx, (uint32_t)v)))
        return smoe_err_set(err, SMOE_EPOLICY,
                            "policy %s returned slot %d, which is %s of its %u slots",
                            p->ops->name, (int)v,
                            v < 0 || (uint32_t)v >= p->nslots ? "out of range"
                                                              : "not an evictable one",
                            p->nslots);
    *slot = v;
    return 0;
}

int smoe_policy_create_named(smoe_policy **out, const char *name,
                             const smoe_policy_params *params, smoe_err *err) {
    *out = NULL;
    const smoe_policy_ops *ops = smoe_policy_find(name);
    if (!ops)
        return smoe_err_set(err, SMOE_EINVAL, "unknown eviction policy '%s'; built-in policies: %s",
                            name, smoe_policy_names());
    return smoe_policy_create(out, ops, params, err);
}

int smoe_policy_create(smoe_policy **out, const smoe_policy_ops *ops,
                       const smoe_policy_params *params, smoe_err *err) {
    *out = NULL;
    if (params->nslots == 0 || params->num_layers == 0 || params->num_experts == 0)
        return smoe_err_set(err, SMOE_EINVAL, "policy %s: nslots, num_layers and num_experts "
                            "must be positive", ops->name);
    if ((uint64_t)params->num_layers * params->num_experts > (uint64_t)INT32_MAX)
        return smoe_err_set(err, SMOE_EINVAL, "policy %s: num_layers*num_experts = %llu does "
                            "not fit an int32 key", ops->name,
                            (unsigned long long)params->num_layers * params->num_experts);
    smoe_policy *p = calloc(1, sizeof *p);
    if (!p) return smoe_err_set(err, SMOE_ENOMEM, "policy %s: out of memory", ops->name);
    p->ops = ops;
    p->nslots = params->nslots;
    p->num_layers = params->num_layers;
    p->num_experts = params->num_experts;
    int rc = ops->init(p, params, err);
    if (rc < 0) {
        free(p);
        return rc;
    }
    *out = p;
    return 0;
}

void smoe_policy_destroy(smoe_policy *p) {
    if (!p) return;
    if (p->ops->free) p->ops->free(p);
    free(p);
}

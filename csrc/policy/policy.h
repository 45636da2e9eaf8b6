/* Eviction policies behind one small vtable, shared by the live cache (cache.c) and the
 * simulator (sim.c), so a policy measured in the simulator is the policy that runs.
 *
 * A policy tracks slots 0..nslots-1 and the expert key (layer*num_experts+expert) in each.
 * It sees events and answers one question: which slot to give up.  Event contract (the
 * Python references in tests/ mirror it exactly):
 *
 *   demand hit  on slot s:  on_access(s, key)
 *   demand miss:            if a free slot exists the cache takes the lowest-numbered free
 *                           slot; otherwise v = victim(...), then on_evict(v, old_key);
 *                           then on_insert(s, key, 0)  (an insert by demand is also an access)
 *   prefetch load:          same as a miss but on_insert(s, key, 1); not an access
 *   forward pass boundary:  on_pass(pass_id)  (pass ids start at 1 and increase by one)
 *   policy swap:            the new policy gets on_insert(s, key, 0) for each resident slot,
 *                           oldest last access first
 *   activation counts:      on_counts(keys, counts, n)  (optional op; see below)
 *
 * victim() must return a slot that is resident (inserted and not evicted) and for which
 * evictable(ctx, slot) is non-zero (evictable == NULL means every resident slot may go), or -1
 * when no such slot exists.  victim() does not remove the slot: the cache calls on_evict next.
 *
 * Callers serialise all calls on one policy object (the cache holds its mutex); policies keep
 * no global state.  Nothing here allocates after init except the Python bridge.
 */
#ifndef SMOE_POLICY_H
#define SMOE_POLICY_H

#include "../common.h"

typedef int (*smoe_evictable_fn)(void *ctx, uint32_t slot);

typedef struct smoe_policy smoe_policy;

/* Within-queue order of Least-Stale (see policy/least_stale.c). */
enum {
    SMOE_LS_ORDER_LAYER = 0, /* furthest next use by layer position first, then oldest access */
    SMOE_LS_ORDER_LRU = 1,   /* oldest access first */
    SMOE_LS_ORDER_FIFO = 2   /* oldest insertion first */
};

typedef struct smoe_policy_params {
    uint32_t nslots;
    uint32_t num_layers;
    uint32_t num_experts;
    uint64_t seed;        /* random */
    int32_t order;        /* least_stale: SMOE_LS_ORDER_* */
    const int32_t *future; /* belady: the future demand access sequence of keys (copied) */
    uint64_t future_len;
    int32_t levels;       /* spac, spac_ema: utility levels K (utility in 0..K); 0 = default (4) */
    int32_t theta0;       /* spac: initial boundaries θ↑ = θ↓ = ⌊γ/2⌋ (MoE-SpAc Alg. 1 line 3;
                             raised to 1 when 0 is meant, see spac.c); 0 = default 4 (γ = 8) */
    const double *model;  /* nextuse: the learned model (policy/nextuse.h, copied), or NULL */
    uint64_t model_len;
    /* spac's ablations (MoE-SpAc §4.4; all 0 = the published design, see spac.c):
     * spac_up / spac_dn > 0: fixed boundaries θ↑ / θ↓ (no adaptive calibration; both or none);
     * spac_tau in 1..K: a static threshold τ instead of Eq. 11-12's τ_t;
     * spac_counts: utility = min(K, f), the pass's count itself (no estimator);
     * spac_nogate: the prefetcher is not gated by τ (threshold op 0): prefetch ranked by the
     * predictor alone, eviction by the utility (separate prefetch and eviction scores). */
    int32_t spac_up, spac_dn, spac_tau, spac_counts, spac_nogate;
} smoe_policy_params;

typedef struct smoe_policy_ops {
    const char *name;
    int (*init)(smoe_policy *p, const smoe_policy_params *params, smoe_err *err);
    void (*free)(smoe_policy *p);
    void (*on_insert)(smoe_policy *p, uint32_t slot, int32_t key, int prefetch);
    void (*on_access)(smoe_policy *p, uint32_t slot, int32_t key);
    void (*on_evict)(smoe_policy *p, uint32_t slot, int32_t key);
    void (*on_pass)(smoe_policy *p, uint64_t pass_id);
    int32_t (*victim)(smoe_policy *p, smoe_evictable_fn evictable, void *ctx);
    /* Optional (spac, spac_ema and score use it).  Activation counts of one verification pass:
     * counts[i] tokens of the pass activated expert keys[i] (0 <= keys[i] < num_layers *
     * num_experts; keys need not be resident).  A layer is "observed" by this call when at
     * least one of keys[] belongs to it; experts of an observed layer absent from keys[] have
     * count 0; layers not observed are left as they are.  A key listed twice: the last count
     * wins.  Keys out of range are ignored.  Not an access: residency is unchanged. */
    void (*on_counts)(smoe_policy *p, const int32_t *keys, const uint32_t *counts, uint32_t n);
    /* Optional: the policy's current integer utility of any key (resident or not), >= 0, or -1
     * for a key out of range. */
    int32_t (*utility)(const smoe_policy *p, int32_t key);
    /* Optional (spac): the hot/cold threshold τ_t on the utility scale (MoE-SpAc §3.3): keys
     * with utility >= τ are hot; a prefetcher processes only hot keys (§3.4). */
    int32_t (*threshold)(const smoe_policy *p);
    /* Optional (nextuse, belady): the probability in [0, 1] that evicting the resident key
     * now means bringing it back (its predicted next use; Belady: only if demand-only Belady
     * would not evict it next anyway): the victim's cost in the prefetch admission rule
     * (admit.h, issue 42 item 3).  Policies without it are charged the cache's measured rate
     * of regretted evictions. */
    double (*regret)(const smoe_policy *p, int32_t key);
    /* Optional (nextuse): what is known of the current pass's token before its layers run:
     * prior[num_layers * num_experts], per key the evidence (a log ratio, finite) that the
     * pass's token uses it, from a table keyed by the token (issue 42 item 1: "the context's
     * token ids"); NULL: nothing is known (an unknown token, a pass of several tokens).  Given
     * after on_pass and before the pass's first access; it holds until the next on_pass.  The
     * policy copies the values. */
    void (*on_prior)(smoe_policy *p, const float *prior);
} smoe_policy_ops;

struct smoe_policy {
    const smoe_policy_ops *ops;
    void *state; /* owned by the policy implementation */
    uint32_t nslots;
    uint32_t num_layers;
    uint32_t num_experts;
    /* Set by a policy whose callbacks can fail (the Python bridge): non-zero code + message
     * tell the caller to report SMOE_EPOLICY after the current operation. */
    smoe_err failure;
};

/* Built-in policy vtables, one per file under csrc/policy/. */
extern const smoe_policy_ops smoe_policy_lru;
extern const smoe_policy_ops smoe_policy_lfu;
extern const smoe_policy_ops smoe_policy_fifo;
extern const smoe_policy_ops smoe_policy_mru;
extern const smoe_policy_ops smoe_policy_random;
extern const smoe_policy_ops smoe_policy_least_stale;
extern const smoe_policy_ops smoe_policy_belady;
extern const smoe_policy_ops smoe_policy_spac;
extern const smoe_policy_ops smoe_policy_spac_ema;
extern const smoe_policy_ops smoe_policy_lhu;
extern const smoe_policy_ops smoe_policy_fld;
extern const smoe_policy_ops smoe_policy_score;
extern const smoe_policy_ops smoe_policy_nextuse;

/* Look a built-in up by name ("lru", "lfu", "fifo", "mru", "random", "least_stale", "belady",
 * "spac", "spac_ema", "lhu", "fld", "score", "nextuse");
 * NULL when unknown. */
const smoe_policy_ops *smoe_policy_find(const char *name);

/* Comma-separated names of the built-ins, for error messages. */
const char *smoe_policy_names(void);

/* The one policy-from-name rule: smoe_policy_find(name) then smoe_policy_create; an unknown
 * name is SMOE_EINVAL "unknown eviction policy '<name>'; built-in policies: ...". */
int smoe_policy_create_named(smoe_policy **out, const char *name,
                             const smoe_policy_params *params, smoe_err *err);

/* Allocate and init a policy; *out owned by the caller, free with smoe_policy_destroy. */
int smoe_policy_create(smoe_policy **out, const smoe_policy_ops *ops,
                       const smoe_policy_params *params, smoe_err *err);
void smoe_policy_destroy(smoe_policy *p);

/* Inline dispatch helpers: the hot path calls these. */
static inline void smoe_policy_insert(smoe_policy *p, uint32_t s, int32_t k, int pf) {
    p->ops->on_insert(p, s, k, pf);
}
static inline void smoe_policy_access(smoe_policy *p, uint32_t s, int32_t k) {
    p->ops->on_access(p, s, k);
}
static inline void smoe_policy_evict(smoe_policy *p, uint32_t s, int32_t k) {
    p->ops->on_evict(p, s, k);
}
static inline void smoe_policy_pass(smoe_policy *p, uint64_t pass_id) {
    if (p->ops->on_pass) p->ops->on_pass(p, pass_id);
}
/* No-op for a policy without on_counts. */
static inline void smoe_policy_counts(smoe_policy *p, const int32_t *keys, const uint32_t *counts,
                                      uint32_t n) {
    if (p->ops->on_counts) p->ops->on_counts(p, keys, counts, n);
}
/* No-op for a policy without on_prior. */
static inline void smoe_policy_prior(smoe_policy *p, const float *prior) {
    if (p->ops->on_prior) p->ops->on_prior(p, prior);
}
/* -1 when the policy has no utility (or the key is out of range). */
static inline int32_t smoe_policy_utility(const smoe_policy *p, int32_t key) {
    return p->ops->utility ? p->ops->utility(p, key) : -1;
}
/* -1 when the policy has no threshold. */
static inline int32_t smoe_policy_threshold(const smoe_policy *p) {
    return p->ops->threshold ? p->ops->threshold(p) : -1;
}
/* -1 when the policy has no regret estimate. */
static inline double smoe_policy_regret(const smoe_policy *p, int32_t key) {
    return p->ops->regret ? p->ops->regret(p, key) : -1.0;
}
static inline int32_t smoe_policy_victim(smoe_policy *p, smoe_evictable_fn f, void *ctx) {
    return p->ops->victim(p, f, ctx);
}

/* The victim rule, one routine for the live caches (slots.c), the simulator (sim.c) and replay
 * (replay.c): ask p for a victim among the slots `ok` accepts (NULL: every slot), then check
 * the answer.  Returns 0 with *slot = the victim, or -1 when the policy found none (every
 * candidate refused); SMOE_EPOLICY with err filled when the policy failed (its failure message,
 * p->failure cleared) or returned a slot out of range or not accepted by `ok`.  The caller
 * owns what happens next (the free-slot rule before it, the eviction bookkeeping after it). */
int smoe_policy_checked_victim(smoe_policy *p, smoe_evictable_fn ok, void *ctx, int32_t *slot,
                               smoe_err *err);

/* The prefetch admission rule, one routine for the live caches (slots.c) and the simulator
 * (sim.c): a prefetch load of key `want` may evict an otherwise evictable slot holding
 * `victim` only when that slot was not used by demand in the current pass (last_pass !=
 * pass_id) and, under a policy with a utility (spac: prefetch and eviction decided in one
 * utility space, MoE-SpAc), utility(victim) <= utility(want).  Called where policy calls are
 * serialised (the cache's mutex held). */
static inline int smoe_policy_prefetch_may_evict(const smoe_policy *p, uint64_t last_pass,
                                                 uint64_t pass_id, int32_t victim,
                                                 int32_t want) {
    if (last_pass == pass_id) return 0;
    return !p->ops->utility || smoe_policy_utility(p, victim) <= smoe_policy_utility(p, want);
}

#endif

/* Learned next-use eviction: see nextuse.h for the rule, the features and the model layout. */
#include "nextuse.h"

#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* Built-in model (no cross table): the temporal weights fitted on the DeepSeek-V2-Lite puffin
 * traces' training split by training/nextuse.py (the packaged model's w_stale), used when the
 * policy is created without a model. */
static const double builtin_model[SMOE_NU_HEADER_V1] = {
    1, /* format 1: no token weights */
    /* w_fresh (unused without a cross table) */ 0, 0, 0, 0, 0, 0,
    /* w_stale */ -2.289, 0.502, 0.843, 3.391, -0.266,
    /* alpha_s, alpha_l */ 1.0 / 8, 1.0 / 64,
    /* c, beta */ 1.0, 1.0,
    /* no cross table */ 0};

typedef struct nu_state {
    double wf[6], ws[5], as, al, c, beta;
    double wtf[2], wts[2]; /* token weights (bias, prior) with and without the cross feature;
                              0 for a format-1 model */
    uint32_t depth;  /* D: the number of cross tables (0: no cross feature) */
    double *cross;   /* [D][L][E][E] (cross_d at d - 1) or NULL (owned) */
    double *xbias;   /* [L][E] the cross feature's bias (zeros before format 3), or NULL */
    double *prior;   /* [nkeys] the current pass's token prior (on_prior), valid if has_prior */
    int has_prior;
    int tok;         /* the model has token weights (format 2): on_prior is heeded */
    uint64_t *used;  /* [nkeys] internal pass of the last demand touch; 0 = never */
    double *es, *el; /* [nkeys] */
    int32_t *key_of; /* [nslots], -1 when free */
    double *xv;      /* [3][E] scratch: cross features of layers lc and lc + 1, and a sum */
    /* Memo of the q without the cross feature, per key and inpass (0/1): valid while the
     * pass and the key's last use are those it was computed at (es, el change only at
     * on_pass, used at a touch), so a victim scan computes each key's q about once a pass. */
    double *memo_q;     /* [2][nkeys] */
    uint64_t *memo_at;  /* [2][nkeys] pass * 2^32 ^ used (0: empty; both < 2^32 in practice) */
    uint32_t *prev;  /* [E] scratch: experts of a layer touched in the current pass */
    uint64_t pass;   /* internal pass counter, from 1 */
    int32_t lc;      /* layer of the latest demand touch in this pass, -1 none */
    uint64_t events; /* +1 at each demand touch and pass: the cross vectors' freshness */
    uint64_t xv_at;  /* events when xv / fresh were last computed (0: never) */
    int fresh[2];    /* xv[i] holds layer lc + i's cross features */
} nu_state;

static void nu_free(smoe_policy *p) {
    nu_state *st = p->state;
    if (!st) return;
    free(st->cross);
    free(st->xbias);
    free(st->prior);
    free(st->used);
    free(st->es);
    free(st->el);
    free(st->key_of);
    free(st->xv);
    free(st->prev);
    free(st->memo_q);
    free(st->memo_at);
    free(st);
    p->state = NULL;
}

static int nu_init(smoe_policy *p, const smoe_policy_params *params, smoe_err *err) {
    const uint64_t L = params->num_layers, E = params->num_experts, nkeys = L * E;
    const double *m = params->model ? params->model : builtin_model;
    const uint64_t len = params->model ? params->model_len : SMOE_NU_HEADER_V1;
    const int version = len ? (m[0] == 1.0 ? 1 : m[0] == 2.0 ? 2 : m[0] == 3.0 ? 3 : 0) : 0;
    const uint64_t head = version == 1 ? SMOE_NU_HEADER_V1 : SMOE_NU_HEADER;
    if (!version || len < head)
        return smoe_err_set(err, SMOE_EINVAL, "nextuse: the model must be a format-1 to -%d "
                            "array of at least %d values (specmoe.sim.nextuse.NextUseModel."
                            "flat()), got %" PRIu64 " values%s", SMOE_NU_VERSION,
                            SMOE_NU_HEADER_V1, len,
                            len && !version ? " of another format" : "");
    if (version == 3 && !(m[16] >= 0 && m[16] <= SMOE_NU_MAX_DEPTH && m[16] == floor(m[16])))
        return smoe_err_set(err, SMOE_EINVAL, "nextuse: a format-3 model's table count must be "
                            "a whole number in 0..%d, got %g", SMOE_NU_MAX_DEPTH, m[16]);
    const uint32_t depth = version == 3 ? (uint32_t)m[16] : m[16] != 0.0 ? 1u : 0u;
    const int has_bias = version == 3 && depth > 0;
    const uint64_t want = head + (has_bias ? L * E : 0) + depth * L * E * E;
    if (len != want)
        return smoe_err_set(err, SMOE_EINVAL, "nextuse: the model has %" PRIu64 " values; a "
                            "model with %u cross table%s for %" PRIu64 " layers x %" PRIu64
                            " experts has %" PRIu64 " (was it trained for another model?)",
                            len, depth, depth == 1 ? "" : "s", L, E, want);
    for (uint64_t i = 1; i < len; i++)
        if (!isfinite(m[i]))
            return smoe_err_set(err, SMOE_EINVAL, "nextuse: model value %" PRIu64 " is not "
                                "finite", i);
    if (!(m[12] > 0 && m[12] <= 1 && m[13] > 0 && m[13] <= 1 && m[14] > 0 && m[15] >= 0))
        return smoe_err_set(err, SMOE_EINVAL, "nextuse: need alpha_s, alpha_l in (0, 1], c > 0 "
                            "and beta >= 0, got %g, %g, %g, %g", m[12], m[13], m[14], m[15]);
    nu_state *st = calloc(1, sizeof *st);
    p->state = st;
    if (st) {
        st->used = calloc(nkeys, sizeof *st->used);
        st->es = calloc(nkeys, sizeof *st->es);
        st->el = calloc(nkeys, sizeof *st->el);
        st->key_of = malloc(params->nslots * sizeof *st->key_of);
        st->xv = malloc(3 * E * sizeof *st->xv);
        st->prev = malloc(E * sizeof *st->prev);
        st->memo_q = malloc(2 * nkeys * sizeof *st->memo_q);
        st->memo_at = calloc(2 * nkeys, sizeof *st->memo_at);
        st->prior = malloc(nkeys * sizeof *st->prior);
        if (depth) {
            st->cross = malloc(depth * L * E * E * sizeof *st->cross);
            st->xbias = calloc(L * E, sizeof *st->xbias);
        }
    }
    if (!st || !st->used || !st->es || !st->el || !st->key_of || !st->xv || !st->prev ||
        !st->memo_q || !st->memo_at || !st->prior || (depth && (!st->cross || !st->xbias))) {
        nu_free(p);
        return smoe_err_set(err, SMOE_ENOMEM, "nextuse: out of memory for %" PRIu64 " keys",
                            nkeys);
    }
    memcpy(st->wf, m + 1, sizeof st->wf);
    memcpy(st->ws, m + 7, sizeof st->ws);
    st->as = m[12];
    st->al = m[13];
    st->c = m[14];
    st->beta = m[15];
    if (version >= 2) {
        st->tok = 1;
        memcpy(st->wtf, m + 17, sizeof st->wtf);
        memcpy(st->wts, m + 19, sizeof st->wts);
    }
    st->depth = depth;
    if (has_bias) memcpy(st->xbias, m + head, L * E * sizeof *st->xbias);
    if (depth)
        memcpy(st->cross, m + head + (has_bias ? L * E : 0),
               depth * L * E * E * sizeof *st->cross);
    for (uint32_t s = 0; s < params->nslots; s++) st->key_of[s] = -1;
    st->pass = 1;
    st->lc = -1;
    return 0;
}

static void nu_touch(nu_state *st, uint32_t L, uint32_t E, int32_t key) {
    if (key < 0 || (uint64_t)key >= (uint64_t)L * E) return; /* not a key of this cache */
    st->used[key] = st->pass;
    st->lc = (int32_t)((uint32_t)key / E);
    st->events++;
}

static void nu_insert(smoe_policy *p, uint32_t slot, int32_t key, int prefetch) {
    nu_state *st = p->state;
    if (slot < p->nslots) st->key_of[slot] = key;
    if (!prefetch) nu_touch(st, p->num_layers, p->num_experts, key);
}

static void nu_access(smoe_policy *p, uint32_t slot, int32_t key) {
    (void)slot;
    nu_touch(p->state, p->num_layers, p->num_experts, key);
}

static void nu_evict(smoe_policy *p, uint32_t slot, int32_t key) {
    nu_state *st = p->state;
    (void)key;
    if (slot < p->nslots) st->key_of[slot] = -1;
}

/* The pass that ends is folded into the averages; a new one begins. */
static void nu_pass(smoe_policy *p, uint64_t pass_id) {
    nu_state *st = p->state;
    (void)pass_id;
    const uint64_t nkeys = (uint64_t)p->num_layers * p->num_experts;
    for (uint64_t k = 0; k < nkeys; k++) {
        const double u = st->used[k] == st->pass ? 1.0 : 0.0;
        st->es[k] += st->as * (u - st->es[k]);
        st->el[k] += st->al * (u - st->el[k]);
    }
    st->pass++;
    st->lc = -1;
    st->has_prior = 0; /* the new pass's token is not known until on_prior */
    st->events++;
}

/* The pass's token prior (policy.h on_prior): copied; the memoised q of keys whose next run
 * is in this pass depend on it, so the memo is emptied.  Ignored by a format-1 model. */
static void nu_prior(smoe_policy *p, const float *prior) {
    nu_state *st = p->state;
    const uint64_t nkeys = (uint64_t)p->num_layers * p->num_experts;
    if (!st->tok) return;
    st->has_prior = prior != NULL;
    if (prior)
        for (uint64_t k = 0; k < nkeys; k++) st->prior[k] = (double)prior[k];
    memset(st->memo_at, 0, 2 * nkeys * sizeof *st->memo_at);
}

/* The cross feature of layer l (nextuse.h) into out[E]: bias[l] plus, for d = 1 .. min(D, l),
 * the mean cross_d[l][a][e] over the experts a of layer l - d touched in the current pass.
 * Returns 0 (out undefined) when layer l - 1 has no such touch: no fresh feature for l. */
static int nu_cross(const nu_state *st, uint32_t L, uint32_t E, uint32_t l, double *out) {
    if (!st->depth || l == 0) return 0;
    for (uint32_t d = 1; d <= st->depth && d <= l; d++) {
        uint32_t n = 0;
        const uint64_t *u = st->used + (uint64_t)(l - d) * E;
        for (uint32_t a = 0; a < E; a++)
            if (u[a] == st->pass) st->prev[n++] = a;
        if (!n) {
            if (d == 1) return 0;
            continue;
        }
        if (d == 1)
            for (uint32_t e = 0; e < E; e++) out[e] = st->xbias[(uint64_t)l * E + e];
        const double *tab = st->cross + (uint64_t)(d - 1) * L * E * E;
        double *acc = out + E; /* the table's sum, in the caller's second E values */
        for (uint32_t e = 0; e < E; e++) acc[e] = 0.0;
        for (uint32_t i = 0; i < n; i++) {
            const double *row = tab + ((uint64_t)l * E + st->prev[i]) * E;
            for (uint32_t e = 0; e < E; e++) acc[e] += row[e];
        }
        for (uint32_t e = 0; e < E; e++) out[e] += acc[e] / (double)n;
    }
    return 1;
}

/* The scratch cross vectors for layers lc and lc + 1 (the only ones that can be fresh),
 * recomputed only after a touch or a pass; st->fresh[i] says whether xv[i] holds layer
 * lc + i's. */
static void nu_prepare(nu_state *st, uint32_t L, uint32_t E) {
    if (st->xv_at == st->events + 1) return;
    for (int i = 0; i < 2; i++) { /* layer lc + 1's sum scratch is the third vector */
        const int32_t l = st->lc + i;
        st->fresh[i] = l >= 1 && l < (int32_t)L && nu_cross(st, L, E, (uint32_t)l, st->xv + i * E);
    }
    st->xv_at = st->events + 1;
}

/* q and the distance dl of key k (nextuse.h). */
static double nu_q(nu_state *st, uint32_t L, uint32_t E, int32_t key, double *dl_out) {
    const int *fresh = st->fresh;
    const int32_t l = (int32_t)((uint32_t)key / E), lc = st->lc;
    const uint32_t e = (uint32_t)key % E;
    const uint64_t up = st->used[key], P = st->pass;
    const int inpass = l > lc || (l == lc && up != P);
    *dl_out = inpass ? (l == lc ? 0.0 : (double)(l - lc)) : (double)(l - lc + (int32_t)L);
    const int slot = l - lc; /* 0: layer lc, 1: layer lc + 1 */
    const int use_cross = inpass && (slot == 0 || slot == 1) && fresh[slot];
    const uint64_t nkeys = (uint64_t)L * E, m = (uint64_t)inpass * nkeys + (uint64_t)key;
    const uint64_t at = (P << 32) ^ up;
    if (!use_cross && st->memo_at[m] == at) return st->memo_q[m];
    const uint64_t ref = inpass ? P : P + 1;
    const double last = up > 0 && up == (inpass ? P - 1 : P) ? 1.0 : 0.0;
    /* gap >= 1: a key used in this pass whose layer comes again in it (layers out of order,
     * or a cache that never calls on_pass) counts as used one pass ago */
    const uint64_t g = up == 0 ? 256 : ref - up < 1 ? 1 : ref - up < 256 ? ref - up : 256;
    const double gap = log((double)g);
    double z;
    if (use_cross)
        z = st->wf[0] + st->wf[1] * last + st->wf[2] * st->es[key] + st->wf[3] * st->el[key] +
            st->wf[4] * gap + st->wf[5] * st->xv[slot * E + e];
    else
        z = st->ws[0] + st->ws[1] * last + st->ws[2] * st->es[key] + st->ws[3] * st->el[key] +
            st->ws[4] * gap;
    if (inpass && st->has_prior) { /* the key's next run is this pass's token's */
        const double *wt = use_cross ? st->wtf : st->wts;
        z += wt[0] + wt[1] * st->prior[key];
    }
    const double q = 1.0 / (1.0 + exp(-z));
    if (!use_cross) {
        st->memo_q[m] = q;
        st->memo_at[m] = at;
    }
    return q;
}

/* The value of keeping key (nextuse.h); nu_prepare first. */
static double nu_value(nu_state *st, uint32_t L, uint32_t E, int32_t key) {
    double dl;
    const double q = nu_q(st, L, E, key, &dl);
    return q / (dl + st->c) + st->beta * st->el[key] / (dl + (double)L + st->c);
}

static int32_t nu_victim(smoe_policy *p, smoe_evictable_fn ok, void *ctx) {
    nu_state *st = p->state;
    const uint32_t L = p->num_layers, E = p->num_experts;
    nu_prepare(st, L, E);
    int32_t best = -1;
    double best_v = 0.0;
    for (uint32_t s = 0; s < p->nslots; s++) {
        const int32_t k = st->key_of[s];
        if (k < 0 || (ok && !ok(ctx, s))) continue;
        const double v = nu_value(st, L, E, k);
        if (best < 0 || v < best_v) {
            best = (int32_t)s;
            best_v = v;
        }
    }
    return best;
}

/* The value of keeping key, as an integer (1e8 per unit of value; the value is at most
 * 1 + beta): with it the shared prefetch rule (policy.h, smoe_policy_prefetch_may_evict)
 * lets a prefetch evict only a slot worth no more than the key it brings.  The policy's
 * memo and scratch are updated (callers hold the cache's mutex, as for every policy call). */
static int32_t nu_utility(const smoe_policy *cp, int32_t key) {
    smoe_policy *p = (smoe_policy *)cp; /* the memo and the scratch only */
    const uint32_t L = p->num_layers, E = p->num_experts;
    if (key < 0 || (uint64_t)key >= (uint64_t)L * E) return -1;
    nu_state *st = p->state;
    nu_prepare(st, L, E);
    const double v = nu_value(st, L, E, key) * 1e8;
    return v >= (double)INT32_MAX ? INT32_MAX : (int32_t)llround(v);
}

/* The admission rule's regret of evicting resident `key` (policy.h): the model's q that it is
 * used at its layer's next run. */
static double nu_regret(const smoe_policy *cp, int32_t key) {
    smoe_policy *p = (smoe_policy *)cp; /* the memo and the scratch only */
    const uint32_t L = p->num_layers, E = p->num_experts;
    if (key < 0 || (uint64_t)key >= (uint64_t)L * E) return 0.0;
    nu_state *st = p->state;
    nu_prepare(st, L, E);
    double dl;
    return nu_q(st, L, E, key, &dl);
}

const smoe_policy_ops smoe_policy_nextuse = {
    .name = "nextuse",
    .init = nu_init,
    .free = nu_free,
    .on_insert = nu_insert,
    .on_access = nu_access,
    .on_evict = nu_evict,
    .on_pass = nu_pass,
    .victim = nu_victim,
    .utility = nu_utility,
    .regret = nu_regret,
    .on_prior = nu_prior,
};

void smoe_nextuse_layer_q(smoe_policy *p, uint32_t layer, double *out) {
    nu_state *st = p->state;
    const uint32_t L = p->num_layers, E = p->num_experts;
    nu_prepare(st, L, E);
    double dl;
    for (uint32_t e = 0; e < E; e++) out[e] = nu_q(st, L, E, (int32_t)(layer * E + e), &dl);
}

int smoe_nextuse_predict(smoe_policy *p, double *out, smoe_err *err) {
    if (!p || p->ops != &smoe_policy_nextuse)
        return smoe_err_set(err, SMOE_EINVAL, "predict: not a nextuse policy");
    for (uint32_t l = 0; l < p->num_layers; l++)
        smoe_nextuse_layer_q(p, l, out + (uint64_t)l * p->num_experts);
    return 0;
}

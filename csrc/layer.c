/* The per-layer path of an offloaded model (layer.h). */
#include "layer.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/block.h"
#include "moe.h"
#include "policy/nextuse.h"
#include "route.h"

static float *copy_f32(const float *src, size_t n) {
    float *p = malloc(sizeof *p * n);
    if (p) memcpy(p, src, sizeof *p * n);
    return p;
}

int smoe_layers_init(smoe_layers *g, const smoe_tier *tier, smoe_kctx *kc,
                     const smoe_ffn_desc *d,
                     uint32_t L, uint32_t E, uint32_t H, uint32_t k, const float *const *w,
                     const float *const *b, const float *const *corr, int sigmoid,
                     smoe_err *err) {
    memset(g, 0, sizeof *g);
    if (!L || !E || !H || !k || k > E)
        return smoe_err_set(err, SMOE_EINVAL,
                            "layers: need L, E, H, k > 0 and k <= E (got %u, %u, %u, %u)", L, E,
                            H, k);
    if (!tier->tab || !tier->cache == !tier->ops)
        return smoe_err_set(err, SMOE_EINVAL, "layers: a tier is a CPU cache or device ops");
    const smoe_slots *tab = tier->tab;
    if (tab->num_layers != L || tab->num_experts != E)
        return smoe_err_set(err, SMOE_EINVAL,
                            "layers: the cache holds %u layers x %u experts, the model %u x %u",
                            tab->num_layers, tab->num_experts, L, E);
    if (d->H != H)
        return smoe_err_set(err, SMOE_EINVAL, "layers: expert hidden size %u, model %u", d->H, H);
    int rc = smoe_ffn_desc_check(d, tab->slot_bytes, err);
    if (!rc && tier->ops) rc = tier->ops->check(tier->ctx, d, err);
    if (rc) return rc;
    g->L = L, g->E = E, g->H = H, g->k = k;
    g->tier = *tier, g->kc = kc, g->desc = *d, g->sigmoid = sigmoid;
    g->prefetch = 1, g->overfetch = 1.5, g->mass = 0.0;
    g->prior_next = -1;
    g->routers = calloc(L, sizeof *g->routers);
    g->shared = calloc(L, sizeof *g->shared);
    g->pred = calloc((size_t)L * E, 1);
    g->pred_valid = calloc(L, 1);
    g->best = malloc(sizeof *g->best * E);
    g->keys = malloc(sizeof *g->keys * E);
    g->prios = malloc(sizeof *g->prios * E);
    g->pprob = malloc(sizeof *g->pprob * E);
    g->counts = malloc(sizeof *g->counts * E);
    g->order = malloc(sizeof *g->order * E);
    g->prob = malloc(sizeof *g->prob * E);
    g->delta_sum = calloc(L, sizeof *g->delta_sum);
    g->delta_n = calloc(L, sizeof *g->delta_n);
    g->zt = malloc(sizeof *g->zt * E);
    g->vt = malloc(sizeof *g->vt * E);
    g->pt = malloc(sizeof *g->pt * E);
    g->resident = malloc(E);
    g->mark = malloc(E);
    g->used2 = malloc(E);
    g->visit = malloc(sizeof *g->visit * E);
    g->pinned = calloc(E, 1);
    g->blocks = calloc(E, sizeof *g->blocks);
    g->grp_start = malloc(sizeof *g->grp_start * ((size_t)E + 1));
    g->hy_state = malloc(E);
    g->hy_oncpu = malloc(E);
    g->hy_miss = malloc(sizeof *g->hy_miss * E);
    g->hy_cnt = malloc(sizeof *g->hy_cnt * E);
    if (!g->hy_state || !g->hy_oncpu || !g->hy_miss || !g->hy_cnt) goto nomem;
    if (!g->routers || !g->shared || !g->pred || !g->pred_valid || !g->best || !g->keys ||
        !g->prios || !g->pprob || !g->counts || !g->order || !g->prob || !g->delta_sum ||
        !g->delta_n ||
        !g->zt || !g->vt || !g->pt || !g->resident || !g->mark || !g->used2 || !g->visit ||
        !g->pinned || !g->blocks || !g->grp_start)
        goto nomem;
    g->miss = SMOE_MISS_FETCH, g->miss_keep = k < 2 ? k : 2, g->miss_keep2 = k;
    g->route_lambda = 0.0;
    for (uint32_t l = 0; l < L; l++) {
        smoe_layer_router *r = &g->routers[l];
        r->scale = 1.0f;
        r->n_group = r->topk_group = 1;
        if (!w[l]) {
            smoe_layers_free(g);
            return smoe_err_set(err, SMOE_EINVAL, "layers: layer %u has no router weight", l);
        }
        if (!(r->w = copy_f32(w[l], (size_t)E * H))) goto nomem;
        if (b && b[l] && !(r->b = copy_f32(b[l], E))) goto nomem;
        if (corr && corr[l] && !(r->corr = copy_f32(corr[l], E))) goto nomem;
    }
    if (pthread_mutex_init(&g->mu, NULL)) goto nomem;
    return SMOE_OK;
nomem:
    smoe_layers_free(g);
    return smoe_err_set(err, SMOE_ENOMEM, "layers: out of memory");
}

void smoe_layers_free(smoe_layers *g) {
    free(g->down_dt);
    g->down_dt = NULL;
    if (g->routers) {
        for (uint32_t l = 0; l < g->L; l++) {
            free(g->routers[l].w);
            free(g->routers[l].b);
            free(g->routers[l].corr);
        }
        pthread_mutex_destroy(&g->mu);
    }
    free(g->routers);
    free(g->shared);
    smoe_policy_destroy(g->learner);
    g->learner = NULL;
    free(g->lq);
    g->lq = NULL;
    free(g->replay);
    g->replay = NULL;
    free(g->prior_table);
    free(g->prior_rows);
    g->prior_table = NULL;
    g->prior_rows = NULL;
    smoe_mlp_bufs_free(&g->sh);
    free(g->pred);
    free(g->pred_valid);
    free(g->scores);
    free(g->lin_scratch);
    free(g->best);
    free(g->keys);
    free(g->prios);
    free(g->pprob);
    free(g->counts);
    free(g->order);
    free(g->prob);
    free(g->delta_sum);
    free(g->delta_n);
    free(g->idx2);
    free(g->w2);
    free(g->take);
    free(g->take_lb);
    free(g->take_lv);
    free(g->take2);
    free(g->out2);
    free(g->zt);
    free(g->vt);
    free(g->pt);
    free(g->resident);
    free(g->mark);
    free(g->used2);
    free(g->visit);
    free(g->pinned);
    free(g->blocks);
    free(g->grp_start);
    free(g->grp_rows);
    free(g->grp_scale);
    free(g->hy_state);
    free(g->hy_oncpu);
    free(g->hy_miss);
    free(g->hy_cnt);
    free(g->hy_out);
    free(g->hy_scratch);
    memset(g, 0, sizeof *g);
}

int smoe_layers_configure(smoe_layers *g, int prefetch, double overfetch, double mass,
                          int feed_counts, smoe_err *err) {
    if (!(overfetch >= 1.0) || !(mass >= 0.0 && mass <= 1.0))
        return smoe_err_set(err, SMOE_EINVAL,
                            "layers: overfetch must be >= 1 and mass in [0, 1] (got %g, %g)",
                            overfetch, mass);
    pthread_mutex_lock(&g->mu);
    g->prefetch = prefetch != 0, g->overfetch = overfetch, g->mass = mass;
    g->feed_counts = feed_counts != 0;
    memset(g->pred_valid, 0, g->L);
    pthread_mutex_unlock(&g->mu);
    return SMOE_OK;
}

int smoe_layers_set_predictor(smoe_layers *g, int predictor, const double *model,
                              uint64_t model_len, smoe_err *err) {
    if (predictor != SMOE_LPRED_ROUTER && predictor != SMOE_LPRED_LEARNED &&
        predictor != SMOE_LPRED_ORACLE)
        return smoe_err_set(err, SMOE_EINVAL, "layers: unknown predictor %d", predictor);
    smoe_policy *learner = NULL;
    double *lq = NULL;
    if (predictor == SMOE_LPRED_LEARNED) { /* built outside the lock: it may be large */
        smoe_policy_params lp = {.nslots = 1, .num_layers = g->L, .num_experts = g->E,
                                 .model = model, .model_len = model_len};
        int rc = smoe_policy_create(&learner, &smoe_policy_nextuse, &lp, err);
        if (rc < 0) return rc;
        if (!(lq = malloc(sizeof *lq * g->E))) {
            smoe_policy_destroy(learner);
            return smoe_err_set(err, SMOE_ENOMEM, "layers: out of memory");
        }
    }
    pthread_mutex_lock(&g->mu);
    int rc = SMOE_OK;
    if (predictor == SMOE_LPRED_ORACLE && !g->replay) {
        rc = smoe_err_set(err, SMOE_ESTATE, "layers: the oracle predictor needs a routing "
                          "replay (smoe_layers_set_replay)");
    } else {
        smoe_policy *old = g->learner;
        double *oldq = g->lq;
        g->learner = learner, g->lq = lq, g->predictor = predictor;
        learner = old, lq = oldq; /* freed below, outside the lock */
        memset(g->pred_valid, 0, g->L);
    }
    pthread_mutex_unlock(&g->mu);
    smoe_policy_destroy(learner);
    free(lq);
    return rc;
}

int smoe_layers_set_replay(smoe_layers *g, const int16_t *experts, uint64_t n, uint64_t start,
                           smoe_err *err) {
    const uint32_t L = g->L, E = g->E, k = g->k;
    int16_t *copy = NULL;
    if (experts) {
        if (!n) return smoe_err_set(err, SMOE_EINVAL, "replay: the trace has no tokens");
        if (start > n)
            return smoe_err_set(err, SMOE_EINVAL, "replay: start %llu is past the trace's %llu "
                                "tokens", (unsigned long long)start, (unsigned long long)n);
        if (n > SIZE_MAX / ((size_t)L * k * sizeof *copy))
            return smoe_err_set(err, SMOE_EINVAL, "replay: %llu tokens is too many",
                                (unsigned long long)n);
        const size_t rows = (size_t)n * L;
        for (size_t r = 0; r < rows; r++) {
            const int16_t *ids = experts + r * k;
            for (uint32_t j = 0; j < k; j++) {
                int bad = ids[j] < 0 || (uint32_t)ids[j] >= E;
                for (uint32_t i = 0; i < j && !bad; i++) bad = ids[i] == ids[j];
                if (bad)
                    return smoe_err_set(err, SMOE_EINVAL, "replay: token %zu, layer position %zu "
                                        "routes to expert %d %s", r / L, r % L, (int)ids[j],
                                        ids[j] < 0 || (uint32_t)ids[j] >= E
                                            ? "outside the model's experts" : "twice");
            }
        }
        if (!(copy = malloc(rows * k * sizeof *copy)))
            return smoe_err_set(err, SMOE_ENOMEM, "replay: no memory for %llu tokens",
                                (unsigned long long)n);
        memcpy(copy, experts, rows * k * sizeof *copy);
    }
    pthread_mutex_lock(&g->mu);
    int rc = SMOE_OK;
    int32_t *old_rows = NULL;
    if (!copy && g->predictor == SMOE_LPRED_ORACLE) {
        rc = smoe_err_set(err, SMOE_ESTATE, "replay: the oracle predictor is set; choose another "
                          "before turning the replay off");
    } else {
        int16_t *old = g->replay;
        g->replay = copy, g->replay_n = copy ? n : 0;
        g->replay_next = copy ? start : 0;
        g->replay_base = g->replay_pass = 0;
        old_rows = g->prior_rows; /* the old trace's rows; the table stays */
        g->prior_rows = NULL;
        copy = old;
    }
    pthread_mutex_unlock(&g->mu);
    free(copy);
    free(old_rows);
    return rc;
}

int smoe_layers_set_priors(smoe_layers *g, const float *table, uint64_t n, const int32_t *rows,
                           uint64_t nrows, smoe_err *err) {
    const size_t per = (size_t)g->L * g->E;
    float *tab = NULL;
    int32_t *rw = NULL;
    if (!table) rows = NULL, n = 0;
    for (uint64_t t = 0; rows && t < nrows; t++)
        if (rows[t] >= 0 && (uint64_t)rows[t] >= n)
            return smoe_err_set(err, SMOE_EINVAL, "priors: row %d of token %llu is outside the "
                                "table's %llu rows", (int)rows[t], (unsigned long long)t,
                                (unsigned long long)n);
    if (table) {
        if (!n || n > SIZE_MAX / (per * sizeof *tab) || (rows && nrows > SIZE_MAX / sizeof *rw))
            return smoe_err_set(err, SMOE_EINVAL, "priors: a table of %llu rows",
                                (unsigned long long)n);
        tab = malloc(n * per * sizeof *tab);
        rw = rows ? malloc((nrows ? nrows : 1) * sizeof *rw) : NULL;
        if (!tab || (rows && !rw)) {
            free(tab);
            free(rw);
            return smoe_err_set(err, SMOE_ENOMEM, "priors: out of memory");
        }
        memcpy(tab, table, n * per * sizeof *tab);
        if (rows) memcpy(rw, rows, nrows * sizeof *rw);
    }
    pthread_mutex_lock(&g->mu);
    int rc = SMOE_OK;
    if (rows && !g->replay)
        rc = smoe_err_set(err, SMOE_ESTATE, "priors: rows per trace token need a routing replay");
    else if (rows && nrows != g->replay_n)
        rc = smoe_err_set(err, SMOE_EINVAL, "priors: %llu rows for a replay of %llu tokens",
                          (unsigned long long)nrows, (unsigned long long)g->replay_n);
    if (rc == SMOE_OK) {
        float *ot = g->prior_table;
        int32_t *orw = g->prior_rows;
        g->prior_table = tab, g->prior_rows = rw, g->prior_n = n;
        g->prior_next = -1;
        tab = ot, rw = orw; /* the old ones, freed below */
    }
    pthread_mutex_unlock(&g->mu);
    free(tab);
    free(rw);
    return rc;
}

int smoe_layers_set_next_prior(smoe_layers *g, int32_t row, smoe_err *err) {
    pthread_mutex_lock(&g->mu);
    int rc = SMOE_OK;
    if (row >= 0 && (uint64_t)row >= g->prior_n)
        rc = smoe_err_set(err, SMOE_EINVAL, "priors: row %d of a table of %llu rows", (int)row,
                          (unsigned long long)g->prior_n);
    else
        g->prior_next = row < 0 ? -1 : row;
    pthread_mutex_unlock(&g->mu);
    return rc;
}

/* The prior of the pass that starts (forward_locked at pos 0; [mu]; layer.h
 * smoe_layers_set_priors): a pass of one token, its replayed row or else the row set for it;
 * NULL without one.  The set row is consumed. */
static const float *pass_prior(smoe_layers *g, uint32_t T) {
    const int32_t next = g->prior_next;
    g->prior_next = -1;
    if (!g->prior_table || T != 1) return NULL;
    const int replayed = g->prior_rows && g->replay_pass == g->counters.passes;
    const int32_t r = replayed ? g->prior_rows[g->replay_base] : next;
    return r < 0 ? NULL : g->prior_table + (size_t)r * g->L * g->E;
}

void smoe_layers_replay_position(smoe_layers *g, uint64_t *used, uint64_t *n) {
    pthread_mutex_lock(&g->mu);
    *used = g->replay_next, *n = g->replay_n;
    pthread_mutex_unlock(&g->mu);
}

void smoe_layers_get_config(smoe_layers *g, int *prefetch, double *overfetch, double *mass,
                            int *feed_counts, int *miss, uint32_t *miss_keep,
                            uint32_t *miss_keep2, double *route_lambda, int *predictor) {
    pthread_mutex_lock(&g->mu);
    *prefetch = g->prefetch, *overfetch = g->overfetch, *mass = g->mass;
    *feed_counts = g->feed_counts;
    *miss = g->miss, *miss_keep = g->miss_keep, *miss_keep2 = g->miss_keep2;
    *route_lambda = g->route_lambda, *predictor = g->predictor;
    pthread_mutex_unlock(&g->mu);
}

int smoe_layers_set_down_dtypes(smoe_layers *g, const int32_t *dts, smoe_err *err) {
    int32_t *cp = NULL;
    if (dts) {
        if (g->tier.ops)
            return smoe_err_set(err, SMOE_EINVAL, "layers: per-layer down formats are for the "
                                "CPU tier (GGUF block weights run on the CPU only)");
        for (uint32_t l = 0; l < g->L; l++) {
            smoe_ffn_desc d = g->desc;
            d.down_dtype = dts[l] == d.dtype ? 0 : dts[l];
            int rc = smoe_ffn_desc_check(&d, g->tier.tab->slot_bytes, err);
            if (rc) return rc;
        }
        cp = malloc(sizeof *cp * g->L);
        if (!cp) return smoe_err_set(err, SMOE_ENOMEM, "layers: out of memory");
        memcpy(cp, dts, sizeof *cp * g->L);
    }
    pthread_mutex_lock(&g->mu);
    free(g->down_dt);
    g->down_dt = cp;
    pthread_mutex_unlock(&g->mu);
    return SMOE_OK;
}

void smoe_layers_set_parallel(smoe_layers *g, int on) {
    pthread_mutex_lock(&g->mu);
    g->parallel_misses = on != 0;
    pthread_mutex_unlock(&g->mu);
}

int smoe_layers_set_hybrid(smoe_layers *g, int on, double t_io, double t_gpu, double t_cpu,
                           int admit, smoe_err *err) {
    if (on) {
        if (!(isfinite(t_io) && isfinite(t_gpu) && isfinite(t_cpu) && t_io >= 0.0 &&
              t_gpu >= 0.0 && t_cpu >= 0.0))
            return smoe_err_set(err, SMOE_EINVAL, "hybrid tier: costs must be finite and >= 0 "
                                "seconds, got t_io=%g, t_gpu=%g, t_cpu=%g", t_io, t_gpu, t_cpu);
        const smoe_tier_ops *ops = g->tier.ops;
        const uint8_t *probe;
        smoe_err perr;
        if (!ops || !ops->host_block || !ops->add_host ||
            ops->host_block(g->tier.ctx, 0, 0, &probe, &perr))
            return smoe_err_set(err, SMOE_ESTATE, "hybrid tier: the expert tier has no host "
                                "path to compute from (a GPU cache has one)");
    }
    pthread_mutex_lock(&g->mu);
    g->hybrid = on != 0;
    g->hybrid_admit = admit != 0;
    g->hy_io = t_io, g->hy_gpu = t_gpu, g->hy_cpu = t_cpu;
    pthread_mutex_unlock(&g->mu);
    return SMOE_OK;
}

/* The miss modes that compute from the resident low-bit copy. */
static int uses_lowbit(int miss) {
    return miss == SMOE_MISS_LOWEST_BIT || miss == SMOE_MISS_PRIORITY;
}

/* The miss modes whose step 4 decides per pair what the cache serves (g->take). */
static int sets_take(int miss) { return miss == SMOE_MISS_DROP || uses_lowbit(miss); }

static const char *lowbit_mode_name(int miss) {
    return miss == SMOE_MISS_PRIORITY ? "priority" : "lowest_bit";
}

/* Whether settings (miss, keep2) compute some pair from low-bit copy `level`. */
static int uses_copy(const smoe_layers *g, int miss, uint32_t keep2, uint32_t level) {
    if (level == 0) return uses_lowbit(miss);
    return miss == SMOE_MISS_PRIORITY && keep2 < g->k;
}

int smoe_layers_set_miss(smoe_layers *g, int miss, uint32_t miss_keep, uint32_t miss_keep2,
                         double route_lambda, smoe_err *err) {
    if (miss < SMOE_MISS_FETCH || miss > SMOE_MISS_PRIORITY)
        return smoe_err_set(err, SMOE_EINVAL, "layers: unknown miss mode %d", miss);
    if (miss_keep > g->k)
        return smoe_err_set(err, SMOE_EINVAL, "layers: miss_keep %u exceeds top_k %u",
                            miss_keep, g->k);
    if (miss_keep2 < miss_keep || miss_keep2 > g->k)
        return smoe_err_set(err, SMOE_EINVAL, "layers: miss_keep2 %u must be in "
                            "[miss_keep %u, top_k %u]", miss_keep2, miss_keep, g->k);
    if (!isfinite(route_lambda) || route_lambda < 0.0)
        return smoe_err_set(err, SMOE_EINVAL, "layers: route_lambda must be finite and >= 0, "
                            "got %g", route_lambda);
    pthread_mutex_lock(&g->mu);
    int rc = SMOE_OK;
    if (uses_copy(g, miss, miss_keep2, 0) && !g->lowbit[0].base)
        rc = smoe_err_set(err, SMOE_EINVAL, "layers: miss mode %s needs a resident "
                          "low-bit copy of the experts (the self-draft's, "
                          "Engine.enable_self_draft)",
                          lowbit_mode_name(miss));
    else if (uses_copy(g, miss, miss_keep2, 1) && !g->lowbit[1].base)
        rc = smoe_err_set(err, SMOE_EINVAL, "layers: miss mode priority with miss_keep2 %u < "
                          "top_k %u needs a second resident low-bit copy", miss_keep2, g->k);
    else
        g->miss = miss, g->miss_keep = miss_keep, g->miss_keep2 = miss_keep2,
        g->route_lambda = route_lambda;
    pthread_mutex_unlock(&g->mu);
    return rc;
}

/* A resident copy of every expert (size bytes of block_bytes blocks in desc's format) fits the
 * layers: the model's hidden size, a valid descriptor the tier's kernels take, every block. */
static int check_copy(const smoe_layers *g, uint64_t size, uint64_t block_bytes,
                      const smoe_ffn_desc *desc, const char *what, smoe_err *err) {
    if (desc->H != g->H)
        return smoe_err_set(err, SMOE_EINVAL, "layers: %s has hidden size %u, the model %u",
                            what, desc->H, g->H);
    int rc = smoe_ffn_desc_check(desc, block_bytes, err);
    if (!rc && g->tier.ops) rc = g->tier.ops->check(g->tier.ctx, desc, err);
    if (rc) return rc;
    if (size < (uint64_t)g->L * g->E * block_bytes)
        return smoe_err_set(err, SMOE_EINVAL, "layers: %s of %llu bytes, %u x %u blocks of %llu "
                            "bytes need %llu", what, (unsigned long long)size, g->L, g->E,
                            (unsigned long long)block_bytes,
                            (unsigned long long)g->L * g->E * block_bytes);
    return SMOE_OK;
}

int smoe_layers_set_lowbit(smoe_layers *g, uint32_t level, const uint8_t *base, uint64_t size,
                           uint64_t block_bytes, const smoe_ffn_desc *desc, smoe_err *err) {
    if (level > 1)
        return smoe_err_set(err, SMOE_EINVAL, "layers: low-bit copy level %u (0 or 1)", level);
    if (base) {
        int rc = check_copy(g, size, block_bytes, desc, "low-bit copy", err);
        if (rc) return rc;
    }
    pthread_mutex_lock(&g->mu);
    int rc = SMOE_OK;
    if (!base && uses_copy(g, g->miss, g->miss_keep2, level)) {
        rc = smoe_err_set(err, SMOE_ESTATE, "layers: low-bit copy %u is in use by miss mode "
                          "%s", level, lowbit_mode_name(g->miss));
    } else if (!base && level == 0 && g->lowbit[1].base) {
        rc = smoe_err_set(err, SMOE_ESTATE, "layers: remove low-bit copy 1 before copy 0");
    } else if (base && level == 1 && !g->lowbit[0].base) {
        rc = smoe_err_set(err, SMOE_ESTATE, "layers: set low-bit copy 0 before copy 1");
    } else if (!base) {
        memset(&g->lowbit[level], 0, sizeof g->lowbit[level]);
    } else {
        g->lowbit[level] = (smoe_moe_resident){base, size, block_bytes, g->E};
        g->lowbit_desc[level] = *desc;
    }
    pthread_mutex_unlock(&g->mu);
    return rc;
}

void smoe_layers_counters(smoe_layers *g, smoe_layer_counters *out, int reset) {
    pthread_mutex_lock(&g->mu);
    if (out) *out = g->counters;
    if (reset) {
        memset(&g->counters, 0, sizeof g->counters);
        memset(g->pred_valid, 0, g->L);
    }
    pthread_mutex_unlock(&g->mu);
}

/* lin_scratch large enough for smoe_linear_forward on d with T tokens. */
static int grow_lin_scratch(smoe_layers *g, const smoe_linear_desc *d, uint32_t T,
                            smoe_err *err) {
    const size_t need = smoe_linear_scratch_bytes(d, T);
    if (need <= g->lin_scratch_cap) return SMOE_OK;
    void *p = realloc(g->lin_scratch, need);
    if (!p) return smoe_err_set(err, SMOE_ENOMEM, "layers: %zu bytes of linear scratch", need);
    g->lin_scratch = p;
    g->lin_scratch_cap = need;
    return SMOE_OK;
}

/* logits[t, e] = x[t] . W_pos[e] + b_pos[e] for t < T: router pos's f32 copy through the
 * dense linear kernel (exact f32 products, vector accumulation; threads of g->kc).  The one
 * routine for a router's logits over a call's tokens (next-layer prediction, this layer's
 * routing). */
static int router_logits(smoe_layers *g, uint32_t pos, const float *x, uint32_t T,
                         float *logits, smoe_err *err) {
    const smoe_layer_router *r = &g->routers[pos];
    smoe_linear_desc d = {g->E, g->H, SMOE_WDT_F32, 0, 1, 0, SMOE_NO_TENSOR};
    int rc = grow_lin_scratch(g, &d, T, err);
    if (rc) return rc;
    return smoe_linear_forward(g->kc, &d, (const uint8_t *)r->w, r->b, x, g->H, T, logits, g->E,
                               g->lin_scratch, err);
}

/* scores[t, e] of router pos on x[t]: the logits, then the model's score function when it has
 * a correction bias (route.h). */
static int router_scores(smoe_layers *g, uint32_t pos, const float *x, uint32_t T,
                         float *scores, smoe_err *err) {
    int rc = router_logits(g, pos, x, T, scores, err);
    if (rc) return rc;
    smoe_route_scores(scores, T, g->E, g->sigmoid, g->routers[pos].corr);
    return SMOE_OK;
}

/* The experts predicted for layer `next` (route.h's rule) from scores[T,E] of the tokens not
 * flagged in draft (NULL: all): marks g->pred, fills g->best. */
static void predict(smoe_layers *g, uint32_t next, const float *scores, uint32_t T,
                    const uint8_t *draft, double mass) {
    smoe_route_predict(scores, T, g->E, g->k, g->overfetch, mass, draft,
                       g->pred + (size_t)next * g->E, g->best, g->order, g->prob);
    g->pred_valid[next] = 1;
}

static int grow_scores(smoe_layers *g, uint32_t T, smoe_err *err) {
    if (T <= g->cap_tokens) return SMOE_OK;
    float *s = realloc(g->scores, sizeof *s * (size_t)T * g->E);
    if (!s) return smoe_err_set(err, SMOE_ENOMEM, "layers: no memory for %u tokens' scores", T);
    g->scores = s;
    g->cap_tokens = T;
    return SMOE_OK;
}

/* The learned predictor's feed (layer.h, smoe_layers_set_predictor): the union of layer
 * pos's experts over the real tokens, in token then slot order, as accesses of its one slot. */
static void feed_learner(smoe_layers *g, uint32_t pos, uint32_t T, const int64_t *idx,
                         const uint8_t *draft) {
    const uint32_t E = g->E, k = g->k;
    memset(g->mark, 0, E);
    for (size_t i = 0; i < (size_t)T * k; i++)
        if ((!draft || !draft[i / k]) && !g->mark[idx[i]]) {
            g->mark[idx[i]] = 1;
            smoe_policy_access(g->learner, 0, (int32_t)(pos * E + (uint32_t)idx[i]));
        }
}

/* Step 2's scores of layer next for a predictor other than the router, into g->scores (grown
 * for T tokens); *rows = the rows written (1 for the learned q, shared by every token), 0 when
 * there is nothing to predict from (an oracle outside a replayed pass). */
static int predictor_scores(smoe_layers *g, uint32_t next, uint32_t T, uint32_t *rows,
                            smoe_err *err) {
    const uint32_t E = g->E, k = g->k;
    int rc = grow_scores(g, T, err);
    if (rc) return rc;
    if (g->predictor == SMOE_LPRED_LEARNED) {
        smoe_nextuse_layer_q(g->learner, next, g->lq);
        for (uint32_t e = 0; e < E; e++) g->scores[e] = (float)g->lq[e];
        *rows = 1;
        return SMOE_OK;
    }
    *rows = 0; /* the oracle: the trace's next layer for the pass's tokens */
    if (!g->replay || g->replay_pass != g->counters.passes) return SMOE_OK;
    for (uint32_t t = 0; t < T; t++) {
        float *sc = g->scores + (size_t)t * E;
        const int16_t *ids = g->replay + ((size_t)(g->replay_base + t) * g->L + next) * k;
        for (uint32_t e = 0; e < E; e++) sc[e] = 0.0f;
        for (uint32_t j = 0; j < k; j++) sc[ids[j]] = (float)(k - j);
    }
    *rows = T;
    return SMOE_OK;
}

static int grow_pairs(smoe_layers *g, uint32_t T, smoe_err *err) {
    if (T <= g->cap_pairs) return SMOE_OK;
    const size_t nk = (size_t)T * g->k;
    int64_t *i2 = realloc(g->idx2, sizeof *i2 * nk);
    if (i2) g->idx2 = i2;
    float *w2 = realloc(g->w2, sizeof *w2 * nk);
    if (w2) g->w2 = w2;
    uint8_t *tk = realloc(g->take, nk);
    if (tk) g->take = tk;
    uint8_t *tl = realloc(g->take_lb, nk);
    if (tl) g->take_lb = tl;
    uint8_t *tv = realloc(g->take_lv, nk);
    if (tv) g->take_lv = tv;
    uint8_t *t2 = realloc(g->take2, nk);
    if (t2) g->take2 = t2;
    float *o2 = realloc(g->out2, sizeof *o2 * (size_t)T * g->H);
    if (o2) g->out2 = o2;
    if (!i2 || !w2 || !tk || !tl || !tv || !t2 || !o2)
        return smoe_err_set(err, SMOE_ENOMEM, "layers: no memory for %u tokens' routing", T);
    g->cap_pairs = T;
    return SMOE_OK;
}

/* One token's router logits zt (raw, plus bias) of layer pos, selection values vt (zt, or
 * score(zt) + corr with a correction bias) and probabilities pt (softmax or sigmoid of zt). */
static void token_scores(smoe_layers *g, uint32_t pos, const float *xt) {
    const smoe_layer_router *r = &g->routers[pos];
    const uint32_t E = g->E, H = g->H;
    for (uint32_t e = 0; e < E; e++) {
        const float *we = r->w + (size_t)e * H;
        float acc = 0.0f;
        for (uint32_t h = 0; h < H; h++) acc += we[h] * xt[h];
        g->zt[e] = acc + (r->b ? r->b[e] : 0.0f);
    }
    if (g->sigmoid) {
        for (uint32_t e = 0; e < E; e++) g->pt[e] = 1.0f / (1.0f + expf(-g->zt[e]));
    } else {
        float mx = g->zt[0], sum = 0.0f;
        for (uint32_t e = 1; e < E; e++) mx = g->zt[e] > mx ? g->zt[e] : mx;
        for (uint32_t e = 0; e < E; e++) sum += (g->pt[e] = expf(g->zt[e] - mx));
        for (uint32_t e = 0; e < E; e++) g->pt[e] /= sum;
    }
    for (uint32_t e = 0; e < E; e++) g->vt[e] = r->corr ? g->pt[e] + r->corr[e] : g->zt[e];
}

/* Cache-aware routing of one token (layer.h step 4): ix/wx its k ids and weights, rewritten. */
static void route_token(smoe_layers *g, uint32_t pos, int64_t *ix, float *wx) {
    const uint32_t E = g->E, k = g->k;
    const float *v = g->vt, *p = g->pt;
    float mx = v[0], mn = v[0];
    for (uint32_t e = 1; e < E; e++) {
        mx = v[e] > mx ? v[e] : mx;
        mn = v[e] < mn ? v[e] : mn;
    }
    g->delta_sum[pos] += (double)mx - (double)mn;
    g->delta_n[pos]++;
    const float boost = (float)(g->route_lambda * g->delta_sum[pos] / (double)g->delta_n[pos]);
    double sw = 0.0, sp = 0.0;
    memset(g->mark, 0, E);
    for (uint32_t j = 0; j < k; j++) {
        g->mark[ix[j]] = 1;
        sw += wx[j];
        sp += p[ix[j]];
    }
    const double c = sp > 0.0 ? sw / sp : 1.0;
    smoe_route_rank(v, E, g->order);
    int32_t ic = 0, iu = (int32_t)E - 1;
    for (;;) {
        while (ic < (int32_t)E && !(g->resident[g->order[ic]] && !g->mark[g->order[ic]])) ic++;
        while (iu >= 0 && !(!g->resident[g->order[iu]] && g->mark[g->order[iu]])) iu--;
        if (ic >= (int32_t)E || iu < 0) break;
        const int32_t ec = g->order[ic], eu = g->order[iu];
        if (!(v[ec] + boost > v[eu])) break;
        for (uint32_t j = 0; j < k; j++)
            if (ix[j] == eu) {
                ix[j] = ec;
                wx[j] = (float)(c * p[ec]);
                break;
            }
        g->mark[eu] = 0, g->mark[ec] = 1;
        g->counters.rerouted++;
        ic++, iu--;
    }
}

/* Substitution of one token's missing experts (layer.h step 4). */
static void substitute_token(smoe_layers *g, int64_t *ix) {
    const uint32_t E = g->E, k = g->k;
    const float *v = g->vt;
    memset(g->mark, 0, E);
    for (uint32_t j = 0; j < k; j++) g->mark[ix[j]] = 1;
    for (uint32_t j = 0; j < k; j++) {
        const int64_t e = ix[j];
        if (g->resident[e]) continue;
        int32_t best = -1;
        float bd = 0.0f;
        for (uint32_t c = 0; c < E; c++) {
            if (!g->resident[c] || g->mark[c]) continue;
            const float d = fabsf(v[c] - v[e]);
            if (best < 0 || d < bd) best = (int32_t)c, bd = d;
        }
        if (best < 0) continue; /* nothing resident to stand in: fetch */
        ix[j] = best;
        g->mark[best] = 1;
        g->counters.substituted++;
    }
}

/* Step 4 of layer.h on (idx, w) -> (g->idx2, g->w2) with g->take / g->take_lb filled for the
 * modes that need them; *lowbit_pairs = pairs for the low-bit copy. */
/* The rank of slot j among a token's k routing weights (descending; ties by slot). */
static uint32_t weight_rank(const float *wt, uint32_t k, uint32_t j) {
    uint32_t r = 0;
    for (uint32_t q = 0; q < k; q++) r += wt[q] > wt[j] || (wt[q] == wt[j] && q < j);
    return r;
}

/* Per expert of the layer (g->mark): 1 when it is missing and some token (not a draft token)
 * ranks it among its top miss_keep by routing weight -- the experts DROP and PRIORITY still
 * fetch. */
static const uint8_t *mark_kept(smoe_layers *g, size_t nk, const uint8_t *draft) {
    const uint32_t k = g->k;
    uint8_t *need = g->mark;
    memset(need, 0, g->E);
    for (size_t i = 0; i < nk; i++) {
        const int64_t e = g->idx2[i];
        if (g->resident[e] || need[e] || (draft && draft[i / k])) continue;
        if (weight_rank(g->w2 + (i / k) * k, k, (uint32_t)(i % k)) < g->miss_keep) need[e] = 1;
    }
    return need;
}

/* Draft tokens (layer.h): after the miss mode has decided, a draft token's pair keeps its
 * expert at full precision only when it is resident or fetched anyway for a real token; else
 * it is computed from low-bit copy 0 when there is one, or skipped.  g->take / g->take_lb
 * hold every pair's decision on return (they are written here for any mode). */
static void resolve_draft(smoe_layers *g, size_t nk, const uint8_t *draft, int take_set,
                          uint32_t *lowbit_pairs) {
    const uint32_t k = g->k;
    const int lb = g->lowbit[0].base != NULL;
    uint8_t *fetched = g->mark; /* per expert: served at full precision to a real token */
    memset(fetched, 0, g->E);
    for (size_t i = 0; i < nk; i++) {
        if (!take_set) g->take[i] = 1, g->take_lb[i] = 0;
        if (!draft[i / k] && g->take[i]) fetched[g->idx2[i]] = 1;
    }
    for (size_t i = 0; i < nk; i++) {
        if (!draft[i / k]) continue;
        const int64_t e = g->idx2[i];
        const uint8_t full = (uint8_t)(g->resident[e] || fetched[e]);
        const uint8_t low = (uint8_t)(!full && lb);
        const uint8_t prev = g->take_lb[i];
        if (low && !prev) (*lowbit_pairs)++, g->counters.lowbit++;
        if (!low && prev) (*lowbit_pairs)--, g->counters.lowbit--; /* fetched anyway */
        if (prev == 2) g->counters.lowbit2--; /* drafts use copy 0 */
        if (!full && !low) g->counters.dropped++;
        g->counters.draft_kept += !full;
        g->take[i] = full;
        g->take_lb[i] = low;
    }
}

static int route_and_resolve(smoe_layers *g, uint32_t pos, const float *x, uint32_t T,
                             const int64_t *idx, const float *w, const uint8_t *draft,
                             uint32_t *lowbit_pairs, smoe_err *err) {
    const uint32_t k = g->k;
    const size_t nk = (size_t)T * k;
    int rc;
    if ((rc = grow_pairs(g, T, err))) return rc;
    if ((rc = smoe_slots_resident_mask(g->tier.tab, pos, g->resident, err))) return rc;
    memcpy(g->idx2, idx, sizeof *idx * nk);
    memcpy(g->w2, w, sizeof *w * nk);
    const int scores = g->route_lambda > 0.0 || g->miss == SMOE_MISS_SUBSTITUTE;
    for (uint32_t t = 0; t < T; t++) {
        int64_t *ix = g->idx2 + (size_t)t * k;
        float *wx = g->w2 + (size_t)t * k;
        if (scores) token_scores(g, pos, x + (size_t)t * g->H);
        if (g->route_lambda > 0.0) route_token(g, pos, ix, wx);
        for (uint32_t j = 0; j < k; j++) g->counters.missing += !g->resident[ix[j]];
        if (g->miss == SMOE_MISS_SUBSTITUTE) substitute_token(g, ix);
    }
    *lowbit_pairs = 0;
    if (g->miss == SMOE_MISS_DROP || g->miss == SMOE_MISS_PRIORITY) {
        /* the missing experts some token ranks in its top miss_keep: fetched */
        const uint8_t *need = mark_kept(g, nk, draft);
        for (size_t i = 0; i < nk; i++) {
            const int64_t e = g->idx2[i];
            g->take[i] = (uint8_t)(g->resident[e] || need[e]);
            if (g->miss == SMOE_MISS_DROP) {
                /* a draft pair's fate (and count) is resolve_draft's */
                g->counters.dropped += !g->take[i] && !(draft && draft[i / k]);
                g->take_lb[i] = 0; /* read by resolve_draft */
            } else { /* PRIORITY: the rest from a low-bit copy, by the pair's own rank */
                uint8_t lv = 0;
                if (!g->take[i])
                    lv = weight_rank(g->w2 + (i / k) * k, k, (uint32_t)(i % k)) < g->miss_keep2
                             ? 1 : 2;
                g->take_lb[i] = lv;
                *lowbit_pairs += lv != 0;
                g->counters.lowbit2 += lv == 2;
            }
        }
        if (g->miss == SMOE_MISS_PRIORITY) g->counters.lowbit += *lowbit_pairs;
    } else if (g->miss == SMOE_MISS_LOWEST_BIT) {
        for (size_t i = 0; i < nk; i++) {
            const uint8_t lb = (uint8_t)!g->resident[g->idx2[i]];
            g->take[i] = (uint8_t)!lb;
            g->take_lb[i] = lb;
            *lowbit_pairs += lb;
        }
        g->counters.lowbit += *lowbit_pairs;
    }
    if (draft) resolve_draft(g, nk, draft, sets_take(g->miss), lowbit_pairs);
    return SMOE_OK;
}

/* ---- step 5 with parallel_misses: the layer's misses load while its residents compute ---- */

/* The expert source of an overlapped layer: an expert pinned ahead (g->pinned) is served from
 * that pin, which its release drops; any other goes through the cache as usual. */
static int pinned_acquire(void *ctx, uint32_t layer, uint32_t expert, const uint8_t **data,
                          smoe_err *err) {
    smoe_layers *g = ctx;
    if (layer == g->pos_pinned && g->pinned[expert]) {
        *data = g->blocks[expert];
        return SMOE_OK;
    }
    return smoe_cache_acquire(g->tier.cache, layer, expert, data, err);
}

static int pinned_release(void *ctx, uint32_t layer, uint32_t expert, smoe_err *err) {
    smoe_layers *g = ctx;
    if (layer == g->pos_pinned && g->pinned[expert]) g->pinned[expert] = 0;
    return smoe_cache_release(g->tier.cache, layer, expert, err);
}

/* Drop the pins taken ahead that the forward did not consume (an error part way). */
static void unpin_rest(smoe_layers *g) {
    for (uint32_t e = 0; e < g->E; e++)
        if (g->pinned[e]) {
            smoe_err ignore;
            smoe_cache_release(g->tier.cache, g->pos_pinned, e, &ignore);
            g->pinned[e] = 0;
        }
}

/* Before the layer's experts run: queue its missing experts (needed by a taken pair, not READY
 * in the snapshot) to the prefetch worker at the highest priority, pin its resident ones, and
 * write the visit order (resident, then missing, then the rest) to g->visit.  *overlap = 1
 * when there was something to overlap (a miss and a resident expert), else nothing is pinned
 * or queued and the caller keeps the plain order.  A cache without a worker: *overlap = 0. */
static int queue_layer_misses(smoe_layers *g, uint32_t pos, const int64_t *idx,
                              const uint8_t *take, uint32_t T, int *overlap, smoe_err *err) {
    const uint32_t E = g->E;
    const size_t nk = (size_t)T * g->k;
    uint8_t *need = g->mark; /* scratch: step 4 is done with it */
    int rc;
    *overlap = 0;
    memset(need, 0, E);
    for (size_t i = 0; i < nk; i++)
        if (!take || take[i]) need[idx[i]] = 1;
    if ((rc = smoe_slots_resident_mask(g->tier.tab, pos, g->resident, err))) return rc;
    uint32_t nmiss = 0, nres = 0;
    for (uint32_t e = 0; e < E; e++) {
        if (!need[e]) continue;
        if (g->resident[e]) {
            nres++;
        } else {
            g->keys[nmiss] = (int32_t)(pos * E + e);
            g->prios[nmiss] = FLT_MAX;
            nmiss++;
        }
    }
    if (!nmiss || !nres) return SMOE_OK; /* nothing to overlap */
    smoe_err qerr;
    smoe_err_clear(&qerr);
    rc = smoe_slots_prefetch(g->tier.tab, g->keys, g->prios, nmiss, 0, &qerr);
    if (rc == SMOE_ESTATE) return SMOE_OK; /* no prefetch worker: plain order */
    if (rc) {
        *err = qerr;
        return rc;
    }
    g->pos_pinned = pos;
    uint32_t n = 0;
    for (uint32_t e = 0; e < E; e++) /* resident first (pinned now), then missing, then rest */
        if (need[e] && g->resident[e]) {
            if ((rc = smoe_cache_acquire(g->tier.cache, pos, e, &g->blocks[e], err))) {
                unpin_rest(g);
                return rc;
            }
            g->pinned[e] = 1;
            g->visit[n++] = e;
        }
    for (uint32_t e = 0; e < E; e++)
        if (need[e] && !g->resident[e]) g->visit[n++] = e;
    for (uint32_t e = 0; e < E; e++)
        if (!need[e]) g->visit[n++] = e;
    g->counters.overlapped += nmiss;
    *overlap = 1;
    return SMOE_OK;
}

/* Step 5 on the host tier: the CPU cache's experts on the CPU kernels (moe.h) into out,
 * then the draft tokens' and the low-bit copies' shares added. */
static int host_moe(smoe_layers *g, uint32_t pos, const float *x, uint32_t T,
                    const int64_t *idx, const float *w, const uint8_t *take,
                    const uint8_t *draft, uint32_t lowbit_pairs, float *out, uint8_t *used,
                    smoe_err *err) {
    const uint32_t E = g->E, k = g->k;
    int rc;
    smoe_moe_source src = smoe_moe_cache_source(g->tier.cache);
    int overlap = 0;
    /* parallel misses: with the fixed-order sum for every call it is on (overlap or not), so
     * outputs depend on the inputs and T only, never on which experts the worker had loaded;
     * beyond SMOE_PARALLEL_MAX_FLOATS of per-pair rows (large prefills), and with a cache
     * that holds every expert (nothing can miss for long: tab.nslots is fixed at init), the
     * plain path */
    const int par = g->parallel_misses && T > 0 &&
                    (uint64_t)T * k * g->H <= SMOE_PARALLEL_MAX_FLOATS &&
                    (uint64_t)g->tier.tab->nslots < (uint64_t)g->L * E;
    if (par) {
        if ((rc = queue_layer_misses(g, pos, idx, take, T, &overlap, err))) return rc;
        if (overlap) src = (smoe_moe_source){g, pinned_acquire, pinned_release, 0};
    }
    /* this layer's: its own down format (smoe_layers_set_down_dtypes) */
    smoe_ffn_desc dl = g->desc;
    if (g->down_dt) dl.down_dtype = g->down_dt[pos] == dl.dtype ? 0 : g->down_dt[pos];
    rc = smoe_moe_forward_order(g->kc, &dl, &src, pos, E, x, T, idx, w, k, take,
                                overlap ? g->visit : NULL, par, out, used, err);
    if (overlap) unpin_rest(g);
    if (rc) return rc;
    if (draft) {
        /* The draft tokens' full-precision pairs in expert calls of their own: the real
         * tokens' groups never contain a draft row, so their results (f32/bf16 kernels round
         * differently with the group size) do not depend on the drafts or on which of the
         * drafts' experts happened to be resident.  Rows are disjoint: adding is exact. */
        smoe_moe_source csrc = smoe_moe_cache_source(g->tier.cache);
        rc = smoe_moe_forward_ex(g->kc, &dl, &csrc, pos, E, x, T, idx, w, k, g->take2,
                                 g->out2, g->used2, err);
        if (rc) return rc;
        for (size_t i = 0; i < (size_t)T * g->H; i++) out[i] += g->out2[i];
        for (uint32_t e = 0; e < E; e++) used[e] |= g->used2[e];
    }
    for (uint8_t lv = 1; lv <= 2 && lowbit_pairs; lv++) {
        /* the missing experts from resident low-bit copy lv - 1, added to out */
        size_t n = 0;
        for (size_t i = 0; i < (size_t)T * k; i++) n += g->take_lv[i] = g->take_lb[i] == lv;
        if (!n) continue;
        smoe_moe_source lsrc = smoe_moe_resident_source(&g->lowbit[lv - 1]);
        rc = smoe_moe_forward_ex(g->kc, &g->lowbit_desc[lv - 1], &lsrc, pos, E, x, T, idx, w, k,
                                 g->take_lv, g->out2, g->used2, err);
        if (rc) return rc;
        for (size_t i = 0; i < (size_t)T * g->H; i++) out[i] += g->out2[i];
        for (uint32_t e = 0; e < E; e++) used[e] |= g->used2[e];
    }
    return SMOE_OK;
}

/* ---- step 5 on a device tier (tier.h) ---------------------------------------------------- */

/* What a forward call computes on: x on the host (routing), xd and out in the tier's memory,
 * the device tier's stream. */
typedef struct layer_io {
    const float *x, *xd;
    float *out;
    void *stream;
} layer_io;

static int grow_groups(smoe_layers *g, size_t n, smoe_err *err) {
    if (n <= g->cap_grp) return SMOE_OK;
    int32_t *r = realloc(g->grp_rows, sizeof *r * n);
    if (r) g->grp_rows = r;
    float *c = realloc(g->grp_scale, sizeof *c * n);
    if (c) g->grp_scale = c;
    if (!r || !c) return smoe_err_set(err, SMOE_ENOMEM, "layers: no memory for %zu pairs", n);
    g->cap_grp = (uint32_t)n;
    return SMOE_OK;
}

/* The hybrid tier's split (smoe_layers_set_hybrid): hy_oncpu[e] = 1 for each expert of this
 * call's groups (start) that route.h's cut leaves to the CPU, *ncpu their count; hy_miss /
 * hy_cnt the missing experts (most tokens first), hy_cut the copied prefix, hy_nadmit how
 * many CPU experts the admission's I/O budget takes. */
static int hybrid_split(smoe_layers *g, uint32_t pos, const uint32_t *start, uint32_t *ncpu,
                        smoe_err *err) {
    const uint32_t E = g->E;
    int rc = smoe_slots_layer_states(g->tier.tab, pos, g->hy_state, err);
    if (rc) return rc;
    uint32_t m = 0, on_fast = 0;
    memset(g->hy_oncpu, 0, E);
    for (uint32_t e = 0; e < E; e++) {
        const uint32_t ne = start[e + 1] - start[e];
        if (!ne) continue;
        if (g->hy_state[e] != SMOE_SLOT_EMPTY) { /* resident or loading: on the device */
            on_fast++;
            continue;
        }
        uint32_t j = m++; /* insertion by count descending, then expert ascending */
        while (j > 0 && g->hy_cnt[j - 1] < ne) {
            g->hy_cnt[j] = g->hy_cnt[j - 1], g->hy_miss[j] = g->hy_miss[j - 1];
            j--;
        }
        g->hy_cnt[j] = ne, g->hy_miss[j] = e;
    }
    const uint32_t cut =
        smoe_route_balance_cut(g->hy_cnt, m, on_fast, g->hy_io, g->hy_gpu, g->hy_cpu);
    for (uint32_t i = cut; i < m; i++) g->hy_oncpu[g->hy_miss[i]] = 1;
    g->counters.hybrid_copied += cut;
    /* Admission (route.h smoe_route_balance_admit, Eq. 10): the CPU's experts whose copy
     * pays, hottest first, as many as fit the layer's computation window T_total =
     * max(T_cpu, T_gpu) left after the cut's copies; the drafting term gamma * T_draft / L
     * is the lookahead's (GpuEngine.lookahead), the layer call does not know it. */
    double tail = 0.0;
    for (uint32_t i = cut; i < m; i++) tail += g->hy_cnt[i];
    const double t_cpu = g->hy_cpu * tail,
                 t_gpu = g->hy_io * cut + g->hy_gpu * ((double)on_fast + cut);
    const double spare = (t_cpu > t_gpu ? t_cpu : t_gpu) - g->hy_io * cut;
    g->hy_cut = cut;
    g->hy_nadmit = smoe_route_balance_admit(g->hy_cnt + cut, m - cut, g->hy_io, g->hy_gpu,
                                            g->hy_cpu, spare);
    *ncpu = m - cut;
    return SMOE_OK;
}

/* The hybrid tier's CPU share: the hy_oncpu experts' pairs (grouped at start, host arrays
 * grp_rows / grp_scale) on the CPU kernels from the tier's host copy into hy_out, added to
 * io->out on the stream; then (hybrid_admit) the hottest hy_nadmit of them (hybrid_split's
 * Eq. 10 budget) queued to the cache's worker for admission. */
static int hybrid_cpu(smoe_layers *g, const layer_io *io, const smoe_ffn_desc *d, uint32_t pos,
                      const uint32_t *start, uint32_t T, smoe_err *err) {
    const smoe_tier_ops *ops = g->tier.ops;
    void *ctx = g->tier.ctx;
    const uint32_t E = g->E, H = g->H;
    const size_t nf = (size_t)T * H;
    int rc;
    if (nf > g->hy_cap) {
        float *p = realloc(g->hy_out, sizeof *p * nf);
        if (!p) return smoe_err_set(err, SMOE_ENOMEM, "hybrid tier: no memory for %zu floats", nf);
        g->hy_out = p, g->hy_cap = nf;
    }
    memset(g->hy_out, 0, sizeof *g->hy_out * nf);
    uint32_t nq = 0;
    for (uint32_t e = 0; e < E; e++) {
        if (!g->hy_oncpu[e]) continue;
        const uint32_t s0 = start[e], ne = start[e + 1] - s0;
        const size_t need = smoe_ffn_scratch_bytes(d, ne);
        if (need > g->hy_scap) {
            void *p = realloc(g->hy_scratch, need);
            if (!p) return smoe_err_set(err, SMOE_ENOMEM, "hybrid tier: %zu bytes of scratch",
                                        need);
            g->hy_scratch = p, g->hy_scap = need;
        }
        const uint8_t *block;
        if ((rc = ops->host_block(ctx, pos, e, &block, err))) return rc;
        if ((rc = smoe_ffn_forward(g->kc, d, block, io->x, H, g->grp_rows + s0,
                                   g->grp_scale + s0, ne, g->hy_out, H, g->hy_scratch, err)))
            return rc;
        g->counters.hybrid_cpu_experts++;
        g->counters.hybrid_cpu_pairs += ne;
    }
    /* The admissions rank below every prediction in the worker's queue (the next layer's
     * experts, queued at this layer's start, are needed sooner than a copy that serves this
     * layer's next token), hottest first among themselves: priorities -1e30 / count, below
     * any router probability, learned q or caller's score above -1e30.  The simulator queues
     * them after the predictions too (sim.c).  On the H100 (2026-12-05) they ranked by count
     * (>= 1, above every probability) and went first. */
    for (uint32_t i = g->hy_cut; i < g->hy_cut + g->hy_nadmit; i++, nq++) {
        g->keys[nq] = (int32_t)(pos * E + g->hy_miss[i]);
        g->prios[nq] = -1e30f / (float)g->hy_cnt[i];
    }
    if ((rc = ops->add_host(ctx, io->out, g->hy_out, nf, io->stream, err))) return rc;
    if (g->hybrid_admit && nq) {
        smoe_err qerr;
        smoe_err_clear(&qerr);
        rc = smoe_slots_prefetch(g->tier.tab, g->keys, g->prios, nq, 0, &qerr);
        if (rc == SMOE_OK) {
            g->counters.hybrid_admitted += nq;
        } else if (rc != SMOE_ESTATE) { /* SMOE_ESTATE: no worker, nothing to admit with */
            *err = qerr;
            return rc;
        }
    }
    return SMOE_OK;
}

/* Expert e of layer pos for the device tier's kernels: pinned in the tier's cache (res NULL;
 * dev_release drops the pin) or addressed in the resident copy res. */
static int dev_block(smoe_layers *g, const smoe_moe_resident *res, uint32_t pos, uint32_t e,
                     void *stream, const uint8_t **block, smoe_err *err) {
    if (res) {
        *block = res->base + ((uint64_t)pos * g->E + e) * res->block_bytes;
        return SMOE_OK;
    }
    return g->tier.ops->acquire(g->tier.ctx, pos, e, stream, block, err);
}

/* dev_block's pin dropped (nothing for res); rc the call's status so far: a release error is
 * reported in err only when nothing failed before.  Returns the status after it. */
static int dev_release(smoe_layers *g, const smoe_moe_resident *res, uint32_t pos, uint32_t e,
                       void *stream, int rc, smoe_err *err) {
    if (res) return rc;
    smoe_err rerr;
    const int rr = g->tier.ops->release(g->tier.ctx, pos, e, stream, rc ? &rerr : err);
    return rc ? rc : rr;
}

/* The device tier's smoe_moe_forward_ex: out (tier memory) gets, on io->stream, the pairs with
 * take[i] (NULL: all) -- zeroed first unless accumulate -- computed from the tier's cache
 * (res NULL) or the resident copy res (format d), grouped as the CPU groups them (ascending
 * expert, token order); used[e] = 1 for each expert computed (zeroed first unless
 * accumulate). */
static int dev_moe(smoe_layers *g, const layer_io *io, const smoe_ffn_desc *d,
                   const smoe_moe_resident *res, uint32_t pos, uint32_t T, const int64_t *idx,
                   const float *w, const uint8_t *take, int accumulate, uint8_t *used,
                   smoe_err *err) {
    const smoe_tier_ops *ops = g->tier.ops;
    void *ctx = g->tier.ctx;
    const uint32_t E = g->E, k = g->k;
    const size_t nk = (size_t)T * k;
    int rc;
    if (!accumulate) {
        memset(used, 0, E);
        if ((rc = ops->zero(ctx, io->out, (size_t)T * g->H, io->stream, err))) return rc;
    }
    uint32_t *start = g->grp_start;
    memset(start, 0, sizeof *start * ((size_t)E + 1));
    for (size_t i = 0; i < nk; i++)
        if (!take || take[i]) start[idx[i] + 1]++;
    for (uint32_t e = 0; e < E; e++) start[e + 1] += start[e];
    const uint32_t n = start[E];
    if (!n) return SMOE_OK;
    if ((rc = grow_groups(g, n, err))) return rc;
    uint32_t *fill = g->counts; /* scratch [E]: step 3 is done with it */
    memcpy(fill, start, sizeof *fill * E);
    for (size_t i = 0; i < nk; i++) {
        if (take && !take[i]) continue;
        const uint32_t p = fill[idx[i]]++;
        g->grp_rows[p] = (int32_t)(i / k);
        g->grp_scale[p] = w[i];
    }
    for (uint32_t e = 0; e < E; e++) /* distinct rows: the kernels' contract */
        for (uint32_t p = start[e] + 1; p < start[e + 1]; p++)
            if (g->grp_rows[p] == g->grp_rows[p - 1])
                return smoe_err_set(err, SMOE_EINVAL, "moe layer %u: token %d lists expert %u "
                                    "twice", pos, g->grp_rows[p], e);
    uint32_t ncpu = 0; /* the hybrid tier: the cache's own share split, the CPU's part last */
    if (g->hybrid && !res && (rc = hybrid_split(g, pos, start, &ncpu, err))) return rc;
    const int32_t *rows;
    const float *scale;
    if ((rc = ops->upload(ctx, g->grp_rows, g->grp_scale, n, &rows, &scale, io->stream, err)))
        return rc;
    /* a group's pins at most the cache's slots: acquiring one more then always finds a slot
     * that is not this group's */
    const uint32_t gmax = !ops->experts ? 0
                          : res ? SMOE_TIER_GROUP
                          : g->tier.tab->nslots < SMOE_TIER_GROUP ? g->tier.tab->nslots
                                                                  : SMOE_TIER_GROUP;
    for (uint32_t e = 0; e < E;) {
        const uint32_t s0 = start[e], ne = start[e + 1] - s0;
        if (!ne || (ncpu && g->hy_oncpu[e])) {
            e++;
            continue;
        }
        if (gmax > 0 && ne <= SMOE_TIER_GROUP_T) { /* a group from e on: one `experts` call */
            const uint8_t *blocks[SMOE_TIER_GROUP];
            uint32_t first[SMOE_TIER_GROUP], count[SMOE_TIER_GROUP], ids[SMOE_TIER_GROUP];
            uint32_t m = 0, pairs = 0;
            for (; e < E && m < gmax; e++) {
                const uint32_t c = start[e + 1] - start[e];
                if (!c || (ncpu && g->hy_oncpu[e])) continue;
                if (c > SMOE_TIER_GROUP_T || pairs + c > SMOE_TIER_GROUP_PAIRS) break;
                if ((rc = dev_block(g, res, pos, e, io->stream, &blocks[m], err))) break;
                first[m] = start[e], count[m] = c, ids[m++] = e;
                pairs += c;
            }
            if (!rc)
                rc = ops->experts(ctx, d, m, blocks, first, count, io->xd, rows, scale, io->out,
                                  io->stream, err);
            for (uint32_t j = 0; j < m; j++) {
                rc = dev_release(g, res, pos, ids[j], io->stream, rc, err);
                used[ids[j]] = 1;
            }
            if (rc) return rc;
            continue;
        }
        const uint8_t *block;
        if ((rc = dev_block(g, res, pos, e, io->stream, &block, err))) return rc;
        rc = ops->expert(ctx, d, block, io->xd, rows + s0, scale + s0, ne, io->out, io->stream,
                         err);
        if ((rc = dev_release(g, res, pos, e, io->stream, rc, err))) return rc;
        used[e] = 1;
        e++;
    }
    if (ncpu) { /* the device's share is enqueued: the CPU's runs while it computes */
        if ((rc = hybrid_cpu(g, io, d, pos, start, T, err))) return rc;
        for (uint32_t e = 0; e < E; e++) used[e] |= g->hy_oncpu[e];
    }
    return SMOE_OK;
}

static int forward_locked(smoe_layers *g, uint32_t pos, const layer_io *io, uint32_t T,
                          const int64_t *idx, const float *w, uint8_t *used,
                          const float *scores, int replace, const uint8_t *draft,
                          smoe_err *err) {
    const float *x = io->x;
    float *out = io->out;
    const uint32_t E = g->E, k = g->k;
    int rc;
    if (pos >= g->L)
        return smoe_err_set(err, SMOE_EINVAL, "layers: position %u of %u layers", pos, g->L);
    for (size_t i = 0; i < (size_t)T * k; i++) /* before anything is queued or counted */
        if (idx[i] < 0 || idx[i] >= (int64_t)E)
            return smoe_err_set(err, SMOE_EINVAL,
                                "moe layer %u: token %zu slot %zu routes to expert %lld, "
                                "outside 0..%u",
                                pos, i / k, i % k, (long long)idx[i], E - 1);
    if (draft) { /* no flagged token: the plain path */
        uint32_t t = 0;
        while (t < T && !draft[t]) t++;
        if (t == T) draft = NULL;
    }
    if (pos == 0) {
        g->counters.passes++;
        g->counters.tokens += T;
        const float *prior = pass_prior(g, T);
        smoe_slots_begin_pass_prior(g->tier.tab, prior);
        if (g->learner) {
            smoe_policy_pass(g->learner, g->counters.passes);
            smoe_policy_prior(g->learner, prior);
        }
    }
    if (g->learner && T > 0) feed_learner(g, pos, T, idx, draft);
    if (g->prefetch && pos + 1 < g->L && T > 0) {
        double mass = g->mass;
        uint32_t rows = T;
        const uint8_t *skip = draft;
        /* the admission rule's probability of use (admit.h): the router's probability, the
         * learned q, 1 for the oracle; unknown for a caller's scores */
        const int known_p = !scores;
        if (!scores && g->predictor != SMOE_LPRED_ROUTER) {
            if ((rc = predictor_scores(g, pos + 1, T, &rows, err))) return rc;
            scores = g->scores, mass = 0.0;
            if (rows < T) skip = NULL; /* one row for all tokens, or none */
        } else if (!scores) {
            if ((rc = grow_scores(g, T, err))) return rc;
            if ((rc = router_scores(g, pos + 1, x, T, g->scores, err))) return rc;
            scores = g->scores;
        }
        if (rows) {
            predict(g, pos + 1, scores, rows, skip, mass);
            uint32_t n = 0;
            const uint8_t *p = g->pred + (size_t)(pos + 1) * E;
            for (uint32_t e = 0; e < E; e++)
                if (p[e]) {
                    g->keys[n] = (int32_t)((pos + 1) * E + e);
                    g->prios[n] = g->best[e];
                    const float q = g->predictor == SMOE_LPRED_ORACLE ? 1.0f : g->best[e];
                    g->pprob[n] = q > 1.0f ? 1.0f : q < 0.0f ? 0.0f : q;
                    n++;
                }
            rc = smoe_slots_prefetch_p(g->tier.tab, g->keys, g->prios, known_p ? g->pprob : NULL,
                                       1, n, replace, err);
            if (rc) return rc;
        }
    }
    const int step4 = T > 0 && (g->route_lambda > 0.0 || g->miss != SMOE_MISS_FETCH || draft);
    uint32_t lowbit_pairs = 0;
    if (step4) {
        if ((rc = route_and_resolve(g, pos, x, T, idx, w, draft, &lowbit_pairs, err))) return rc;
        idx = g->idx2, w = g->w2;
    }
    const uint8_t *take = step4 && (sets_take(g->miss) || draft) ? g->take : NULL;
    if (g->feed_counts && T > 0) { /* the real tokens' activations (drafts are not demand) */
        memset(g->counts, 0, sizeof *g->counts * E);
        for (size_t i = 0; i < (size_t)T * k; i++)
            if (!draft || !draft[i / k]) g->counts[idx[i]]++;
        uint32_t n = 0;
        for (uint32_t e = 0; e < E; e++)
            if (g->counts[e]) {
                g->keys[n] = (int32_t)(pos * E + e);
                g->counts[n] = g->counts[e];
                n++;
            }
        if ((rc = smoe_slots_counts(g->tier.tab, g->keys, g->counts, n, err))) return rc;
    }
    if (draft) { /* take == g->take here: split it into the real and the draft tokens' pairs */
        for (size_t i = 0; i < (size_t)T * k; i++) {
            g->take2[i] = (uint8_t)(g->take[i] && draft[i / k]);
            g->take[i] = (uint8_t)(g->take[i] && !draft[i / k]);
        }
    }
    if (g->tier.ops) { /* a device tier: every share accumulates into out on its stream */
        rc = dev_moe(g, io, &g->desc, NULL, pos, T, idx, w, take, 0, used, err);
        if (!rc && draft)
            rc = dev_moe(g, io, &g->desc, NULL, pos, T, idx, w, g->take2, 1, used, err);
        for (uint8_t lv = 1; lv <= 2 && lowbit_pairs && !rc; lv++) {
            size_t n = 0;
            for (size_t i = 0; i < (size_t)T * k; i++) n += g->take_lv[i] = g->take_lb[i] == lv;
            if (n)
                rc = dev_moe(g, io, &g->lowbit_desc[lv - 1], &g->lowbit[lv - 1], pos, T, idx, w,
                             g->take_lv, 1, used, err);
        }
        if (rc) return rc;
    } else if ((rc = host_moe(g, pos, x, T, idx, w, take, draft, lowbit_pairs, out, used,
                              err))) {
        return rc;
    }
    if (g->pred_valid[pos]) {
        const uint8_t *p = g->pred + (size_t)pos * E;
        for (uint32_t e = 0; e < E; e++) {
            g->counters.predicted += p[e];
            g->counters.actual += used[e];
            g->counters.true_positive += p[e] & used[e];
        }
        g->pred_valid[pos] = 0;
    }
    return SMOE_OK;
}

/* This layer's routing (layer.h, smoe_layers_forward_routed) into idx, w [T, k]; under a
 * replay (smoe_layers_set_replay) the trace's experts with the router's weights. */
static int route(smoe_layers *g, uint32_t pos, const float *x, uint32_t T, int flags,
                 const uint8_t *draft, int64_t *idx, float *w, smoe_err *err) {
    const uint32_t E = g->E, k = g->k;
    const smoe_layer_router *r = &g->routers[pos];
    if (!g->sigmoid && r->corr && (flags & SMOE_ROUTE_TOPK_SOFTMAX))
        return smoe_err_set(err, SMOE_EINVAL,
                            "layers: ROUTE_TOPK_SOFTMAX chooses by the logits; layer %u's "
                            "router has a correction bias", pos);
    const int16_t *rp = NULL; /* the replayed rows of this pass's tokens at layer pos */
    if (g->replay) {
        for (uint32_t t = 0; draft && t < T; t++)
            if (draft[t])
                return smoe_err_set(err, SMOE_EINVAL, "replay: draft tokens cannot be replayed "
                                    "(a replay is a sequence of real tokens)");
        if (pos == 0) {
            if (T > g->replay_n - g->replay_next)
                return smoe_err_set(err, SMOE_ESTATE, "replay: the trace's %llu tokens are used "
                                    "up (%llu left, this pass has %u)",
                                    (unsigned long long)g->replay_n,
                                    (unsigned long long)(g->replay_n - g->replay_next), T);
            g->replay_base = g->replay_next;
            g->replay_next += T;
            g->replay_pass = g->counters.passes + 1; /* forward_locked starts it */
        } else if (g->replay_pass != g->counters.passes) {
            return smoe_err_set(err, SMOE_ESTATE, "replay: layer %u of a pass whose first layer "
                                "was not replayed", pos);
        }
        rp = g->replay + ((size_t)g->replay_base * g->L + pos) * k;
    }
    int rc = grow_scores(g, T, err);
    if (!rc) rc = router_logits(g, pos, x, T, g->scores, err);
    if (rc) return rc;
    for (uint32_t t = 0; t < T; t++) {
        float *z = g->scores + (size_t)t * E, *p = g->prob, *v = p;
        if (flags & SMOE_ROUTE_BF16_LOGITS) smoe_bf16_round(z, E);
        if (g->sigmoid) { /* DeepSeek-V3: choose by v = p + corr in the kept groups */
            v = g->vt; /* (vt, pt: free until forward_locked's token_scores) */
            for (uint32_t e = 0; e < E; e++) {
                p[e] = 1.0f / (1.0f + expf(-z[e]));
                v[e] = p[e] + (r->corr ? r->corr[e] : 0.0f);
            }
            if (r->n_group > 1) smoe_route_group_limit(v, E, r->n_group, r->topk_group, g->pt);
        } else if (flags & SMOE_ROUTE_TOPK_SOFTMAX) {
            v = z; /* GPT-OSS: chosen by the logits, p below over the chosen k only */
        } else {
            float mx = z[0], sum = 0.0f;
            for (uint32_t e = 1; e < E; e++) mx = z[e] > mx ? z[e] : mx;
            for (uint32_t e = 0; e < E; e++) sum += (p[e] = expf(z[e] - mx));
            for (uint32_t e = 0; e < E; e++) p[e] = p[e] / sum;
            if (r->corr) { /* ERNIE-4.5: choose by v = p + corr, weigh by p */
                v = g->vt; /* (free until forward_locked's token_scores) */
                for (uint32_t e = 0; e < E; e++) v[e] = p[e] + r->corr[e];
            }
        }
        if (rp) { /* the trace's experts, in its order */
            const int16_t *ids = rp + (size_t)t * g->L * k;
            for (uint32_t j = 0; j < k; j++) g->order[j] = ids[j];
        } else {
            smoe_route_topk(v, E, k, g->order);
        }
        if (!g->sigmoid && (flags & SMOE_ROUTE_TOPK_SOFTMAX)) { /* softmax of the k logits */
            float mx = z[g->order[0]], sum = 0.0f;
            for (uint32_t j = 1; j < k; j++) mx = z[g->order[j]] > mx ? z[g->order[j]] : mx;
            for (uint32_t j = 0; j < k; j++) sum += (p[g->order[j]] = expf(z[g->order[j]] - mx));
            for (uint32_t j = 0; j < k; j++) p[g->order[j]] /= sum;
        }
        float tot = 0.0f;
        for (uint32_t j = 0; j < k; j++) tot += p[g->order[j]];
        if (g->sigmoid) tot += 1e-20f; /* V3's denominator */
        else if (r->corr && tot < 1e-12f) tot = 1e-12f; /* ERNIE's moe_norm_min clamp */
        const float scale = r->scale;
        for (uint32_t j = 0; j < k; j++) {
            const int32_t e = g->order[j];
            const float we = (flags & SMOE_ROUTE_RENORM ? p[e] / tot : p[e]) * scale;
            idx[(size_t)t * k + j] = e;
            w[(size_t)t * k + j] = flags & SMOE_ROUTE_BF16_WEIGHTS ? smoe_bf16_round1(we) : we;
        }
    }
    return SMOE_OK;
}

void smoe_mlp_bufs_free(smoe_mlp_bufs *b) {
    free(b->rows);
    free(b->scratch);
    memset(b, 0, sizeof *b);
}

int smoe_silu_mlp_check(const smoe_shared_ffn *f, uint32_t H, const char *what, smoe_err *err) {
    for (int i = 0; i < 3; i++)
        if (!f->d[i] || !f->block[i])
            return smoe_err_set(err, SMOE_EINVAL, "%s projection %d missing", what, i);
    const uint32_t I = f->d[0]->N;
    if (f->d[0]->K != H || f->d[1]->K != H || f->d[1]->N != I || f->d[2]->K != I ||
        f->d[2]->N != H)
        return smoe_err_set(err, SMOE_EINVAL,
                            "%s shapes gate %ux%u, up %ux%u, down %ux%u do not chain hidden %u "
                            "-> I -> hidden",
                            what, f->d[0]->N, f->d[0]->K, f->d[1]->N, f->d[1]->K, f->d[2]->N,
                            f->d[2]->K, H);
    const smoe_linear_desc *og = f->d[SMOE_MLP_OUT_GATE];
    if (og && (!f->block[SMOE_MLP_OUT_GATE] || og->N != 1 || og->K != H))
        return smoe_err_set(err, SMOE_EINVAL, "%s output gate is %ux%u, expected 1x%u", what,
                            og->N, og->K, H);
    return SMOE_OK;
}

int smoe_silu_mlp_add(smoe_kctx *kc, const smoe_shared_ffn *f, const float *x, uint32_t H,
                      uint32_t T, int bf16, smoe_mlp_bufs *b, float *out, smoe_err *err) {
    const uint32_t I = f->d[0]->N;
    const smoe_linear_desc *og = f->d[SMOE_MLP_OUT_GATE];
    const size_t need = (size_t)T * (2 * (size_t)I + H + 1);
    if (need > b->rows_cap) {
        float *p = realloc(b->rows, sizeof *p * need);
        if (!p) return smoe_err_set(err, SMOE_ENOMEM, "SiLU MLP: no memory for %zu rows", need);
        b->rows = p;
        b->rows_cap = need;
    }
    for (int i = 0; i < 4; i++) {
        if (!f->d[i]) continue; /* (the output gate, when there is none) */
        const size_t sn = smoe_linear_scratch_bytes(f->d[i], T);
        if (sn <= b->scratch_cap) continue;
        void *p = realloc(b->scratch, sn);
        if (!p) return smoe_err_set(err, SMOE_ENOMEM, "SiLU MLP: %zu bytes of scratch", sn);
        b->scratch = p;
        b->scratch_cap = sn;
    }
    float *gt = b->rows, *ut = gt + (size_t)T * I, *st = ut + (size_t)T * I;
    float *gl = st + (size_t)T * H; /* the output gate's logits [T] */
    int rc = SMOE_OK;
    float *const gu[2] = {gt, ut}; /* gate and up on x */
    for (int i = 0; i < 2 && rc == SMOE_OK; i++)
        rc = smoe_linear_forward(kc, f->d[i], f->block[i], f->bias[i], x, H, T, gu[i], I,
                                 b->scratch, err);
    if (rc != SMOE_OK) return rc;
    const size_t n = (size_t)T * I;
    if (bf16) {
        smoe_bf16_round(gt, n);
        smoe_bf16_round(ut, n);
    }
    for (size_t i = 0; i < n; i++) gt[i] = gt[i] / (1.0f + expf(-gt[i])); /* silu */
    if (bf16) smoe_bf16_round(gt, n);
    for (size_t i = 0; i < n; i++) gt[i] *= ut[i];
    if (bf16) smoe_bf16_round(gt, n);
    rc = smoe_linear_forward(kc, f->d[2], f->block[2], f->bias[2], gt, I, T, st, H, b->scratch,
                             err);
    if (rc != SMOE_OK) return rc;
    const size_t m = (size_t)T * H;
    if (bf16) smoe_bf16_round(st, m);
    if (og) { /* st *= sigmoid(og x), row by row */
        rc = smoe_linear_forward(kc, og, f->block[SMOE_MLP_OUT_GATE],
                                 f->bias[SMOE_MLP_OUT_GATE], x, H, T, gl, 1, b->scratch, err);
        if (rc != SMOE_OK) return rc;
        for (uint32_t t = 0; t < T; t++) {
            float z = bf16 ? smoe_bf16_round1(gl[t]) : gl[t];
            z = 1.0f / (1.0f + expf(-z));
            if (bf16) z = smoe_bf16_round1(z);
            float *row = st + (size_t)t * H;
            for (uint32_t h = 0; h < H; h++) row[h] = z * row[h];
            if (bf16) smoe_bf16_round(row, H);
        }
    }
    if (bf16) smoe_bf16_round(out, m); /* what out held, in the model's dtype */
    for (size_t i = 0; i < m; i++) out[i] += st[i];
    if (bf16) smoe_bf16_round(out, m);
    return SMOE_OK;
}

int smoe_layers_forward_routed(smoe_layers *g, uint32_t pos, const float *x, uint32_t T,
                               int flags, int64_t *idx, float *w, float *out, uint8_t *used,
                               int replace, const uint8_t *draft, smoe_err *err) {
    if (g->tier.ops)
        return smoe_err_set(err, SMOE_EINVAL, "layers: forward_routed runs on the CPU tier "
                            "(a device tier's model routes on its device)");
    const layer_io io = {x, x, out, NULL};
    pthread_mutex_lock(&g->mu);
    int rc = route(g, pos, x, T, flags, draft, idx, w, err);
    if (!rc) rc = forward_locked(g, pos, &io, T, idx, w, used, NULL, replace, draft, err);
    if (!rc && T && g->shared[pos].d[0])  /* the shared experts, added to the routed ones */
        rc = smoe_silu_mlp_add(g->kc, &g->shared[pos], x, g->H, T, flags & SMOE_ROUTE_BF16_OUT,
                               &g->sh, out, err);
    pthread_mutex_unlock(&g->mu);
    return rc;
}

int smoe_layers_set_block(smoe_layers *g, uint32_t pos, float route_scale, uint32_t n_group,
                          uint32_t topk_group, const smoe_shared_ffn *shared, smoe_err *err) {
    if (pos >= g->L) return smoe_err_set(err, SMOE_EINVAL, "layers: pos %u outside 0..%u", pos,
                                         g->L - 1);
    if (!(route_scale > 0.0f) || !isfinite(route_scale))
        return smoe_err_set(err, SMOE_EINVAL, "layers: routing scale must be finite and > 0");
    if (n_group < 1 || g->E % n_group || (n_group > 1 && g->E / n_group < 2) ||
        topk_group < 1 || topk_group > n_group || (uint64_t)topk_group * (g->E / n_group) < g->k)
        return smoe_err_set(err, SMOE_EINVAL,
                            "layers: groups (n_group=%u, topk_group=%u) do not fit %u experts, "
                            "top-%u (n_group divides them into groups of >= 2, topk_group in "
                            "1..n_group keeps >= top-k of them)", n_group, topk_group, g->E,
                            g->k);
    smoe_shared_ffn none;
    memset(&none, 0, sizeof none);
    if (shared && shared->d[0]) {
        int rc = smoe_silu_mlp_check(shared, g->H, "layers: shared FFN", err);
        if (rc != SMOE_OK) return rc;
    } else {
        shared = &none;
    }
    pthread_mutex_lock(&g->mu);
    g->routers[pos].scale = route_scale;
    g->routers[pos].n_group = n_group;
    g->routers[pos].topk_group = topk_group;
    g->shared[pos] = *shared;
    pthread_mutex_unlock(&g->mu);
    return SMOE_OK;
}

int smoe_layers_forward(smoe_layers *g, uint32_t pos, const float *x, uint32_t T,
                        const int64_t *idx, const float *w, float *out, uint8_t *used,
                        const float *scores, int replace, const uint8_t *draft,
                        smoe_err *err) {
    return smoe_layers_forward_on(g, pos, x, x, T, idx, w, out, used, scores, replace, draft,
                                  NULL, err);
}

int smoe_layers_forward_on(smoe_layers *g, uint32_t pos, const float *x, const float *xd,
                           uint32_t T, const int64_t *idx, const float *w, float *out,
                           uint8_t *used, const float *scores, int replace,
                           const uint8_t *draft, void *stream, smoe_err *err) {
    if (!g->tier.ops && xd != x)
        return smoe_err_set(err, SMOE_EINVAL, "layers: the CPU tier computes on x itself");
    const layer_io io = {x, xd, out, stream};
    pthread_mutex_lock(&g->mu);
    int rc = forward_locked(g, pos, &io, T, idx, w, used, scores, replace, draft, err);
    pthread_mutex_unlock(&g->mu);
    return rc;
}

int smoe_layers_set_draft(smoe_layers *g, const uint8_t *base, uint64_t size,
                          uint64_t block_bytes, const smoe_ffn_desc *desc, smoe_err *err) {
    if (base) {
        int rc = check_copy(g, size, block_bytes, desc, "draft copy", err);
        if (rc) return rc;
    }
    pthread_mutex_lock(&g->mu);
    if (base) {
        g->draft = (smoe_moe_resident){base, size, block_bytes, g->E};
        g->draft_desc = *desc;
    } else {
        memset(&g->draft, 0, sizeof g->draft);
    }
    pthread_mutex_unlock(&g->mu);
    return SMOE_OK;
}

int smoe_layers_forward_draft(smoe_layers *g, uint32_t pos, const float *xd, uint32_t T,
                              const int64_t *idx, const float *w, float *out, uint8_t *used,
                              void *stream, smoe_err *err) {
    if (pos >= g->L)
        return smoe_err_set(err, SMOE_EINVAL, "layers: position %u of %u layers", pos, g->L);
    const layer_io io = {xd, xd, out, stream};
    pthread_mutex_lock(&g->mu);
    int rc;
    if (!g->draft.base) {
        rc = smoe_err_set(err, SMOE_ESTATE, "layers: no draft copy (smoe_layers_set_draft)");
    } else if (g->tier.ops) {
        rc = SMOE_OK;
        for (size_t i = 0; i < (size_t)T * g->k && !rc; i++)
            if (idx[i] < 0 || idx[i] >= (int64_t)g->E)
                rc = smoe_err_set(err, SMOE_EINVAL, "moe layer %u: token %zu routes to expert "
                                  "%lld, outside 0..%u", pos, i / g->k, (long long)idx[i],
                                  g->E - 1);
        if (!rc)
            rc = dev_moe(g, &io, &g->draft_desc, &g->draft, pos, T, idx, w, NULL, 0, used,
                         err);
    } else {
        smoe_moe_source src = smoe_moe_resident_source(&g->draft);
        rc = smoe_moe_forward(g->kc, &g->draft_desc, &src, pos, g->E, xd, T, idx, w, g->k, out,
                              used, err);
    }
    pthread_mutex_unlock(&g->mu);
    return rc;
}

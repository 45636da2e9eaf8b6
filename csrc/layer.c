/* The per-layer path of an offloaded model (layer.h). */
#include "layer.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "moe.h"

static float *copy_f32(const float *src, size_t n) {
    float *p = malloc(sizeof *p * n);
    if (p) memcpy(p, src, sizeof *p * n);
    return p;
}

int smoe_layers_init(smoe_layers *g, smoe_cache *cache, smoe_kctx *kc, const smoe_ffn_desc *d,
                     uint32_t L, uint32_t E, uint32_t H, uint32_t k, const float *const *w,
                     const float *const *b, const float *const *corr, int sigmoid,
                     smoe_err *err) {
    memset(g, 0, sizeof *g);
    if (!L || !E || !H || !k || k > E)
        return smoe_err_set(err, SMOE_EINVAL,
                            "layers: need L, E, H, k > 0 and k <= E (got %u, %u, %u, %u)", L, E,
                            H, k);
    if (cache->tab.num_layers != L || cache->tab.num_experts != E)
        return smoe_err_set(err, SMOE_EINVAL,
                            "layers: the cache holds %u layers x %u experts, the model %u x %u",
                            cache->tab.num_layers, cache->tab.num_experts, L, E);
    if (d->H != H)
        return smoe_err_set(err, SMOE_EINVAL, "layers: expert hidden size %u, model %u", d->H, H);
    int rc = smoe_ffn_desc_check(d, cache->tab.slot_bytes, err);
    if (rc) return rc;
    g->L = L, g->E = E, g->H = H, g->k = k;
    g->cache = cache, g->kc = kc, g->desc = *d, g->sigmoid = sigmoid;
    g->prefetch = 1, g->overfetch = 1.5, g->mass = 0.0;
    g->routers = calloc(L, sizeof *g->routers);
    g->pred = calloc((size_t)L * E, 1);
    g->pred_valid = calloc(L, 1);
    g->best = malloc(sizeof *g->best * E);
    g->keys = malloc(sizeof *g->keys * E);
    g->prios = malloc(sizeof *g->prios * E);
    g->counts = malloc(sizeof *g->counts * E);
    g->order = malloc(sizeof *g->order * E);
    g->prob = malloc(sizeof *g->prob * E);
    if (!g->routers || !g->pred || !g->pred_valid || !g->best || !g->keys || !g->prios ||
        !g->counts || !g->order || !g->prob)
        goto nomem;
    for (uint32_t l = 0; l < L; l++) {
        smoe_layer_router *r = &g->routers[l];
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
    if (g->routers) {
        for (uint32_t l = 0; l < g->L; l++) {
            free(g->routers[l].w);
            free(g->routers[l].b);
            free(g->routers[l].corr);
        }
        pthread_mutex_destroy(&g->mu);
    }
    free(g->routers);
    free(g->pred);
    free(g->pred_valid);
    free(g->scores);
    free(g->best);
    free(g->keys);
    free(g->prios);
    free(g->counts);
    free(g->order);
    free(g->prob);
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

void smoe_layers_counters(smoe_layers *g, smoe_layer_counters *out, int reset) {
    pthread_mutex_lock(&g->mu);
    if (out) *out = g->counters;
    if (reset) {
        memset(&g->counters, 0, sizeof g->counters);
        memset(g->pred_valid, 0, g->L);
    }
    pthread_mutex_unlock(&g->mu);
}

/* scores[t, e] of router r on x[t] (the logits, then the model's score function when it has a
 * correction bias: sigmoid(l) + corr, or softmax(l) + corr). */
static void router_scores(const smoe_layers *g, const smoe_layer_router *r, const float *x,
                          uint32_t T, float *scores) {
    const uint32_t E = g->E, H = g->H;
    for (uint32_t t = 0; t < T; t++) {
        const float *xt = x + (size_t)t * H;
        float *s = scores + (size_t)t * E;
        for (uint32_t e = 0; e < E; e++) {
            const float *we = r->w + (size_t)e * H;
            float acc = 0.0f;
            for (uint32_t h = 0; h < H; h++) acc += we[h] * xt[h];
            s[e] = acc + (r->b ? r->b[e] : 0.0f);
        }
        if (!r->corr) continue;
        if (g->sigmoid) {
            for (uint32_t e = 0; e < E; e++) s[e] = 1.0f / (1.0f + expf(-s[e])) + r->corr[e];
        } else {
            float mx = s[0], sum = 0.0f;
            for (uint32_t e = 1; e < E; e++) mx = s[e] > mx ? s[e] : mx;
            for (uint32_t e = 0; e < E; e++) sum += (s[e] = expf(s[e] - mx));
            for (uint32_t e = 0; e < E; e++) s[e] = s[e] / sum + r->corr[e];
        }
    }
}

/* order[0..E) = expert ids by value descending, ties by lower id (insertion sort: E is small
 * and the caller needs only the first few, but a full order keeps the rule obvious). */
static void rank(const float *v, uint32_t E, int32_t *order) {
    for (uint32_t i = 0; i < E; i++) {
        int32_t e = (int32_t)i;
        uint32_t j = i;
        while (j > 0 && v[order[j - 1]] < v[e]) {
            order[j] = order[j - 1];
            j--;
        }
        order[j] = e;
    }
}

/* The experts predicted for layer `next` from scores[T,E]: marks g->pred, fills g->best. */
static void predict(smoe_layers *g, uint32_t next, const float *scores, uint32_t T) {
    const uint32_t E = g->E, k = g->k;
    uint8_t *p = g->pred + (size_t)next * E;
    memset(p, 0, E);
    for (uint32_t e = 0; e < E; e++) g->best[e] = -INFINITY;
    uint32_t m = (uint32_t)ceil((double)k * g->overfetch - 1e-9);
    if (m < k) m = k;
    if (m > E) m = E;
    float *prob = g->prob;
    for (uint32_t t = 0; t < T; t++) {
        const float *s = scores + (size_t)t * E;
        if (g->mass <= 0.0) {
            rank(s, E, g->order);
            for (uint32_t r = 0; r < m; r++) {
                int32_t e = g->order[r];
                p[e] = 1;
                if (s[e] > g->best[e]) g->best[e] = s[e];
            }
        } else {
            float mx = s[0], sum = 0.0f;
            for (uint32_t e = 1; e < E; e++) mx = s[e] > mx ? s[e] : mx;
            for (uint32_t e = 0; e < E; e++) sum += (prob[e] = expf(s[e] - mx));
            for (uint32_t e = 0; e < E; e++) prob[e] /= sum;
            rank(prob, E, g->order);
            double before = 0.0; /* probability mass of the experts ranked above */
            for (uint32_t r = 0; r < E; r++) {
                int32_t e = g->order[r];
                if (r >= k && before >= g->mass) break;
                p[e] = 1;
                if (prob[e] > g->best[e]) g->best[e] = prob[e];
                before += prob[e];
            }
        }
    }
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

static int forward_locked(smoe_layers *g, uint32_t pos, const float *x, uint32_t T,
                          const int64_t *idx, const float *w, float *out, uint8_t *used,
                          const float *scores, int replace, smoe_err *err) {
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
    if (pos == 0) {
        g->counters.passes++;
        g->counters.tokens += T;
        smoe_slots_begin_pass(&g->cache->tab);
    }
    if (g->prefetch && pos + 1 < g->L && T > 0) {
        if (!scores) {
            if ((rc = grow_scores(g, T, err))) return rc;
            router_scores(g, &g->routers[pos + 1], x, T, g->scores);
            scores = g->scores;
        }
        predict(g, pos + 1, scores, T);
        uint32_t n = 0;
        const uint8_t *p = g->pred + (size_t)(pos + 1) * E;
        for (uint32_t e = 0; e < E; e++)
            if (p[e]) {
                g->keys[n] = (int32_t)((pos + 1) * E + e);
                g->prios[n] = g->best[e];
                n++;
            }
        rc = smoe_slots_prefetch(&g->cache->tab, g->keys, g->prios, n, replace, err);
        if (rc) return rc;
    }
    if (g->feed_counts && T > 0) {
        memset(g->counts, 0, sizeof *g->counts * E);
        for (size_t i = 0; i < (size_t)T * k; i++) g->counts[idx[i]]++;
        uint32_t n = 0;
        for (uint32_t e = 0; e < E; e++)
            if (g->counts[e]) {
                g->keys[n] = (int32_t)(pos * E + e);
                g->counts[n] = g->counts[e];
                n++;
            }
        if ((rc = smoe_slots_counts(&g->cache->tab, g->keys, g->counts, n, err))) return rc;
    }
    smoe_moe_source src = smoe_moe_cache_source(g->cache);
    rc = smoe_moe_forward(g->kc, &g->desc, &src, pos, E, x, T, idx, w, k, out, used, err);
    if (rc) return rc;
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

int smoe_layers_forward(smoe_layers *g, uint32_t pos, const float *x, uint32_t T,
                        const int64_t *idx, const float *w, float *out, uint8_t *used,
                        const float *scores, int replace, smoe_err *err) {
    pthread_mutex_lock(&g->mu);
    int rc = forward_locked(g, pos, x, T, idx, w, out, used, scores, replace, err);
    pthread_mutex_unlock(&g->mu);
    return rc;
}

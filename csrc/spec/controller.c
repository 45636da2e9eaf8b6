/* Controller object shared by every speculation controller: parameter defaults, argument
 * checks, gamma-tolerance pruning, plain-iteration timing, telemetry ring; plus the two
 * stateless-ish controllers (static K, transformers' heuristic schedule).  See controller.h. */
#include "controller.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static int fill_defaults(smoe_spec_params *p, smoe_err *err) {
#define DEF(f, v) \
    if (p->f == 0) p->f = (v)
    DEF(k_max, 8);
    DEF(initial, -1); /* per-controller default, resolved in init */
    DEF(trials, 4);
    DEF(trial_len, 4);
    DEF(set_len, 16);
    DEF(backoff_max, 1024);
    DEF(base_len, 4);
    DEF(base_refresh, 100);
    DEF(trial_pool, 12);
    DEF(converge, 0.10);
    DEF(alpha, 0.2);
    DEF(p_init, 0.6);
    DEF(probe, 16);
    DEF(budget, 0.05);
    DEF(telemetry_cap, 65536u);
#undef DEF
    if (p->k_max < 1 || p->k_max > SMOE_SPEC_KMAX)
        return smoe_err_set(err, SMOE_EINVAL, "spec controller: k_max must be in 1..%d, got %d",
                            SMOE_SPEC_KMAX, (int)p->k_max);
    if (p->k < 0 || p->k > p->k_max)
        return smoe_err_set(err, SMOE_EINVAL, "spec controller: k must be in 0..k_max=%d, got %d",
                            (int)p->k_max, (int)p->k);
    if (p->initial != -1 && (p->initial < 0 || p->initial > p->k_max))
        return smoe_err_set(err, SMOE_EINVAL,
                            "spec controller: initial must be in 0..k_max=%d, got %d",
                            (int)p->k_max, (int)p->initial);
    if (p->trials < 1 || p->trial_len < 1 || p->set_len < 1 || p->base_len < 1 ||
        p->base_refresh < 1 || p->backoff_max < 1)
        return smoe_err_set(err, SMOE_EINVAL,
                            "spec controller: trials, trial_len, set_len, backoff_max, base_len "
                            "and base_refresh must be >= 1 (got %d, %d, %d, %d, %d, %d)",
                            (int)p->trials, (int)p->trial_len, (int)p->set_len,
                            (int)p->backoff_max, (int)p->base_len, (int)p->base_refresh);
    if (p->trial_pool < 1 || p->trial_pool > 64)
        return smoe_err_set(err, SMOE_EINVAL, "spec controller: trial_pool must be in 1..64, got %d",
                            (int)p->trial_pool);
    if (!(p->alpha > 0.0 && p->alpha <= 1.0))
        return smoe_err_set(err, SMOE_EINVAL, "spec controller: alpha must be in (0, 1], got %g",
                            p->alpha);
    if (!(p->p_init >= 0.0 && p->p_init <= 1.0))
        return smoe_err_set(err, SMOE_EINVAL, "spec controller: p_init must be in [0, 1], got %g",
                            p->p_init);
    if (!(p->converge == -1.0 || (p->converge > 0.0 && p->converge < 1.0)))
        return smoe_err_set(err, SMOE_EINVAL,
                            "spec controller: converge must be in (0, 1) or -1 (never), got %g",
                            p->converge);
    if (!(p->t_first >= 0.0 && p->t_first < 1e6))
        return smoe_err_set(err, SMOE_EINVAL, "spec controller: t_first must be in [0, 1e6) "
                            "seconds, got %g", p->t_first);
    if (!(p->budget < 0.0 || (p->budget > 0.0 && p->budget <= 1.0)))
        return smoe_err_set(err, SMOE_EINVAL, "spec controller: budget must be in (0, 1] or "
                            "negative (off), got %g", p->budget);
    if (p->probe < -1)
        return smoe_err_set(err, SMOE_EINVAL, "spec controller: probe must be >= 1 or -1 (never), "
                            "got %d", (int)p->probe);
    if (p->telemetry_cap > (1u << 26))
        return smoe_err_set(err, SMOE_EINVAL, "spec controller: telemetry_cap %u exceeds %u",
                            (unsigned)p->telemetry_cap, 1u << 26);
    return SMOE_OK;
}

const smoe_spec_ctl_ops *smoe_spec_ctl_find(const char *name) {
    static const smoe_spec_ctl_ops *const all[] = {&smoe_spec_static, &smoe_spec_heuristic,
                                                   &smoe_spec_cascade, &smoe_spec_speq};
    if (!name) return NULL;
    for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
        if (strcmp(all[i]->name, name) == 0) return all[i];
    return NULL;
}

int smoe_spec_ctl_create(smoe_spec_ctl **out, const smoe_spec_ctl_ops *ops,
                         const smoe_spec_params *params, smoe_err *err) {
    *out = NULL;
    if (!ops) return smoe_err_set(err, SMOE_EINVAL, "spec controller: no controller given");
    smoe_spec_ctl *c = calloc(1, sizeof *c);
    if (!c) return smoe_err_set(err, SMOE_ENOMEM, "spec controller: out of memory");
    c->ops = ops;
    if (params) c->params = *params;
    int rc = fill_defaults(&c->params, err);
    if (rc) {
        free(c);
        return rc;
    }
    for (int32_t k = 0; k <= c->params.k_max; k++) c->allowed[k] = c->tau_ok[k] = 1;
    for (int32_t j = 0; j <= SMOE_SPEC_KMAX; j++) c->acc_p[j] = 1.0;
    c->batch = 1;
    c->ring_cap = c->params.telemetry_cap;
    c->ring = malloc((size_t)c->ring_cap * sizeof *c->ring);
    /* second half: scratch for the sorted copy smoe_spec_ctl_base takes the median of */
    c->base_ring = malloc(2 * (size_t)c->params.base_len * sizeof *c->base_ring);
    if (!c->ring || !c->base_ring) {
        unsigned cap = (unsigned)c->ring_cap;
        free(c->ring);
        free(c->base_ring);
        free(c);
        return smoe_err_set(err, SMOE_ENOMEM, "spec controller: out of memory (telemetry %u)",
                            cap);
    }
    rc = ops->init(c, &c->params, err);
    if (rc) {
        free(c->ring);
        free(c->base_ring);
        free(c);
        return rc;
    }
    *out = c;
    return SMOE_OK;
}

void smoe_spec_ctl_destroy(smoe_spec_ctl *c) {
    if (!c) return;
    if (c->ops && c->ops->free) c->ops->free(c);
    free(c->ring);
    free(c->base_ring);
    free(c);
}

int32_t smoe_spec_ctl_clamp(const smoe_spec_ctl *c, int32_t k) {
    if (k > c->params.k_max) k = c->params.k_max;
    while (k > 0 && !c->allowed[k]) k--;
    return k < 0 ? 0 : k;
}

void smoe_spec_ctl_begin_request(smoe_spec_ctl *c) {
    if (c->ops->begin_request) c->ops->begin_request(c);
}

int32_t smoe_spec_ctl_next_k(const smoe_spec_ctl *c) {
    return smoe_spec_ctl_clamp(c, c->ops->next_k(c));
}

int smoe_spec_ctl_within_budget(const smoe_spec_ctl *c) {
    return c->params.budget < 0.0 ||
           c->spec_loss + c->loss_max <= c->params.budget * c->t_total;
}

int32_t smoe_spec_ctl_budget_wait(const smoe_spec_ctl *c) {
    if (smoe_spec_ctl_within_budget(c)) return 0;
    double base = smoe_spec_ctl_base(c);
    if (isnan(base) || !(base > 0.0)) return c->params.base_len < c->params.backoff_max
                                                 ? c->params.base_len
                                                 : c->params.backoff_max;
    double n = ceil((c->spec_loss + c->loss_max - c->params.budget * c->t_total) /
                    (c->params.budget * base));
    if (!(n >= 1.0)) return 1;
    return n > (double)c->params.backoff_max ? c->params.backoff_max : (int32_t)n;
}

double smoe_spec_ctl_base(const smoe_spec_ctl *c) {
    int32_t n = c->base_n;
    if (n == 0) return NAN;
    double *v = c->base_ring + c->params.base_len; /* scratch, see smoe_spec_ctl_create */
    for (int32_t i = 0; i < n; i++) { /* insertion sort: base_len is a handful */
        double x = c->base_ring[i];
        int32_t j = i;
        for (; j > 0 && v[j - 1] > x; j--) v[j] = v[j - 1];
        v[j] = x;
    }
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

double smoe_spec_obs_etr(const smoe_spec_obs *o) {
    if (o->nrows <= 0) return (double)(o->accepted + 1);
    double s = 0.0;
    for (int32_t i = 0; i < o->nrows; i++) s += (double)(o->row_acc[i] + 1);
    return s / (double)o->nrows;
}

double smoe_spec_ctl_lambda(const smoe_spec_ctl *c, int32_t k) {
    if (k < 0 || k > c->params.k_max) return NAN;
    double e = 1.0, prod = 1.0;
    for (int32_t j = 1; j <= k; j++) {
        prod *= c->acc_n[j] >= c->succ_min ? c->acc_p[j] : 1.0;
        e += prod;
    }
    return e;
}

double smoe_spec_ctl_speedup(const smoe_spec_ctl *c, int32_t k) {
    if (k < 0 || k > c->params.k_max) return NAN;
    if (k == 0) return 1.0;
    double tau = 1.0;
    if (c->ntau > 0) {
        if (k + 1 > c->ntau) return 0.0; /* beyond the measured range: cannot be shown to pay */
        tau = c->tau[k + 1];
    }
    double delta = c->has_delta ? c->delta : 0.0;
    /* gamma-tolerance paper, section 3.1, equation (1), gamma = k */
    return smoe_spec_ctl_lambda(c, k) * tau / (1.0 + (double)k * delta * tau);
}

static void recompute_allowed(smoe_spec_ctl *c) {
    c->allowed[0] = 1;
    for (int32_t k = 1; k <= c->params.k_max; k++)
        c->allowed[k] = c->tau_ok[k] && (!c->succ_on || smoe_spec_ctl_speedup(c, k) > 1.0);
}

/* The success model learns from one validated observation (controller.h). */
static void success_learn(smoe_spec_ctl *c, const smoe_spec_obs *o) {
    double a = c->params.alpha;
    int32_t rows = o->nrows > 0 ? o->nrows : 1;
    for (int32_t r = 0; r < rows; r++) {
        int32_t k = o->nrows > 0 ? o->row_k[r] : o->k;
        int32_t acc = o->nrows > 0 ? o->row_acc[r] : o->accepted;
        for (int32_t j = 1; j <= k && j <= acc + 1; j++) {
            double x = j <= acc ? 1.0 : 0.0;
            c->acc_p[j] = (1.0 - a) * c->acc_p[j] + a * x;
            c->acc_n[j]++;
        }
    }
    double base = smoe_spec_ctl_base(c);
    if (o->k >= 1 && o->t_draft > 0.0 && !isnan(base) && base > 0.0) {
        double d = o->t_draft / (double)o->k / base;
        c->delta = c->has_delta ? (1.0 - a) * c->delta + a * d : d;
        c->has_delta = 1;
    }
    if (!c->succ_on) return;
    int any_tau = 0, any_pays = 0; /* is every K that tau allows ruled out by S? */
    for (int32_t k = 1; k <= c->params.k_max; k++) {
        if (!c->tau_ok[k]) continue;
        any_tau = 1;
        if (smoe_spec_ctl_speedup(c, k) > 1.0) any_pays = 1;
    }
    int all_blocked = any_tau && !any_pays;
    c->succ_zero_run = (o->k == 0 && all_blocked) ? c->succ_zero_run + 1 : 0;
    if (o->k >= 1 && !all_blocked && c->acc_n[1] >= c->succ_min)
        c->succ_probe_cur = (uint64_t)c->succ_probe; /* measured, and some K pays */
    if (c->succ_zero_run >= c->succ_probe_cur) {
        uint64_t nxt = 2 * c->succ_probe_cur, cap = SMOE_SPEC_PROBE_MAX;
        if (cap < (uint64_t)c->succ_probe) cap = (uint64_t)c->succ_probe;
        c->succ_probe_cur = nxt > cap ? cap : nxt;
        for (int32_t j = 0; j <= SMOE_SPEC_KMAX; j++) {
            c->acc_p[j] = 1.0;
            c->acc_n[j] = 0;
        }
        c->has_delta = 0;
        c->delta = 0.0;
        c->succ_zero_run = 0;
    }
}

int smoe_spec_ctl_set_success(smoe_spec_ctl *c, int on, int32_t min_obs, int32_t probe,
                              smoe_err *err) {
    if (on && (min_obs < 1 || probe < 1))
        return smoe_err_set(err, SMOE_EINVAL,
                            "spec %s: success model needs min_obs >= 1 and probe >= 1 "
                            "(got %d, %d)", c->ops->name, (int)min_obs, (int)probe);
    c->succ_on = on ? 1 : 0;
    if (on) {
        c->succ_min = min_obs;
        c->succ_probe = probe;
    }
    c->succ_zero_run = 0;
    c->succ_probe_cur = (uint64_t)c->succ_probe;
    recompute_allowed(c);
    return SMOE_OK;
}

int smoe_spec_ctl_set_batch(smoe_spec_ctl *c, int32_t batch, smoe_err *err) {
    if (batch < 1)
        return smoe_err_set(err, SMOE_EINVAL, "spec %s: batch must be >= 1, got %d",
                            c->ops->name, (int)batch);
    if (batch == c->batch) return SMOE_OK;
    c->batch = batch;
    c->base_n = 0; /* plain-step time depends on the batch size: measure it again */
    c->base_pos = 0;
    c->has_delta = 0; /* relative to t_base */
    c->delta = 0.0;
    recompute_allowed(c);
    smoe_spec_ctl_begin_request(c);
    return SMOE_OK;
}

int smoe_spec_ctl_observe(smoe_spec_ctl *c, const smoe_spec_obs *o, smoe_err *err) {
    if (o->k < 0 || o->k > c->params.k_max)
        return smoe_err_set(err, SMOE_EINVAL, "spec %s: k must be in 0..k_max=%d, got %d",
                            c->ops->name, (int)c->params.k_max, (int)o->k);
    if (o->accepted < 0 || o->accepted > o->k)
        return smoe_err_set(err, SMOE_EINVAL, "spec %s: accepted must be in 0..k=%d, got %d",
                            c->ops->name, (int)o->k, (int)o->accepted);
    if (!isfinite(o->t_iter) || o->t_iter <= 0.0)
        return smoe_err_set(err, SMOE_EINVAL, "spec %s: t_iter must be finite and > 0, got %g",
                            c->ops->name, o->t_iter);
    if (!isfinite(o->t_draft) || o->t_draft < 0.0 || o->t_draft > o->t_iter)
        return smoe_err_set(err, SMOE_EINVAL,
                            "spec %s: t_draft must be finite and in [0, t_iter=%g], got %g",
                            c->ops->name, o->t_iter, o->t_draft);
    if (!isfinite(o->t_io) || o->t_io < 0.0 || o->t_draft + o->t_io > o->t_iter)
        return smoe_err_set(err, SMOE_EINVAL,
                            "spec %s: t_io must be finite, >= 0 and t_draft + t_io <= t_iter=%g, "
                            "got t_io=%g",
                            c->ops->name, o->t_iter, o->t_io);
    if (o->experts_loaded < 0)
        return smoe_err_set(err, SMOE_EINVAL, "spec %s: experts_loaded must be >= 0, got %lld",
                            c->ops->name, (long long)o->experts_loaded);
    if (o->nrows < 0 || (o->nrows > 0 && (!o->row_k || !o->row_acc)))
        return smoe_err_set(err, SMOE_EINVAL, "spec %s: nrows must be >= 0 with both row arrays",
                            c->ops->name);
    for (int32_t i = 0; i < o->nrows; i++) {
        if (o->row_k[i] < 0 || o->row_k[i] > o->k)
            return smoe_err_set(err, SMOE_EINVAL, "spec %s: rows_k[%d] must be in 0..k=%d, got %d",
                                c->ops->name, (int)i, (int)o->k, (int)o->row_k[i]);
        if (o->row_acc[i] < 0 || o->row_acc[i] > o->row_k[i])
            return smoe_err_set(err, SMOE_EINVAL,
                                "spec %s: rows_accepted[%d] must be in 0..rows_k[%d]=%d, got %d",
                                c->ops->name, (int)i, (int)i, (int)o->row_k[i],
                                (int)o->row_acc[i]);
    }
    int32_t planned = smoe_spec_ctl_next_k(c);
    if (o->k == 0) {
        c->base_ring[c->base_pos] = o->t_iter;
        c->base_pos = (c->base_pos + 1) % c->params.base_len;
        if (c->base_n < c->params.base_len) c->base_n++;
        c->last_base_iter = c->n_obs;
    }
    c->t_total += o->t_iter;
    if (o->k >= 1) { /* the slowdown budget's L (controller.h) */
        double base = smoe_spec_ctl_base(c);
        if (!isnan(base)) {
            double loss = o->t_iter - smoe_spec_obs_etr(o) * base;
            c->spec_loss += loss;
            if (loss > c->loss_max) c->loss_max = loss;
        }
    }
    success_learn(c, o);
    if (c->succ_on) recompute_allowed(c);
    int32_t phase = SMOE_SPEC_PHASE_NONE;
    double u = c->ops->observe(c, o, &phase);
    if (c->ring_cap) {
        smoe_spec_rec *r = &c->ring[c->n_obs % c->ring_cap];
        r->iter = c->n_obs;
        r->k = o->k;
        r->accepted = o->accepted;
        r->t_iter = o->t_iter;
        r->utility = u;
        r->phase = phase;
        r->k_planned = planned;
        r->experts_loaded = o->experts_loaded;
    }
    c->n_obs++;
    return SMOE_OK;
}

int smoe_spec_ctl_set_tau(smoe_spec_ctl *c, const double *tau, int32_t n, smoe_err *err) {
    if (n < 0 || n > SMOE_SPEC_TAU_MAX)
        return smoe_err_set(err, SMOE_EINVAL, "spec %s: tau must have 0..%d entries, got %d",
                            c->ops->name, SMOE_SPEC_TAU_MAX, (int)n);
    for (int32_t i = 0; i < n; i++)
        if (!isfinite(tau[i]) || tau[i] <= 0.0)
            return smoe_err_set(err, SMOE_EINVAL,
                                "spec %s: tau(%d) must be finite and > 0, got %g", c->ops->name,
                                (int)(i + 1), tau[i]);
    c->ntau = n;
    for (int32_t g = 1; g <= n; g++) c->tau[g] = tau[g - 1];
    c->tau_ok[0] = 1;
    for (int32_t k = 1; k <= c->params.k_max; k++) {
        int32_t g = k + 1;
        if (n == 0)
            c->tau_ok[k] = 1;
        else
            c->tau_ok[k] = g <= n && (double)g * c->tau[g] > 1.0;
    }
    recompute_allowed(c);
    return SMOE_OK;
}

int smoe_spec_ctl_set_io_cost(smoe_spec_ctl *c, const double *cost, int32_t n, smoe_err *err) {
    if (n < 0 || n > c->params.k_max + 1)
        return smoe_err_set(err, SMOE_EINVAL,
                            "spec %s: io_cost must have 0..k_max+1=%d entries, got %d",
                            c->ops->name, (int)(c->params.k_max + 1), (int)n);
    for (int32_t i = 0; i < n; i++)
        if (!isfinite(cost[i]) || cost[i] < 0.0)
            return smoe_err_set(err, SMOE_EINVAL,
                                "spec %s: io_cost[%d] must be finite and >= 0, got %g",
                                c->ops->name, (int)i, cost[i]);
    for (int32_t k = 0; k <= c->params.k_max; k++) c->io_cost[k] = k < n ? cost[k] : 0.0;
    c->io_given = 1; /* the learned estimate (speq.c) stops overwriting it */
    return SMOE_OK;
}

uint32_t smoe_spec_ctl_telemetry(const smoe_spec_ctl *c, smoe_spec_rec *out) {
    if (c->ring_cap == 0) return 0;
    uint64_t n = c->n_obs < c->ring_cap ? c->n_obs : c->ring_cap;
    uint64_t first = c->n_obs - n;
    for (uint64_t i = 0; i < n; i++) out[i] = c->ring[(first + i) % c->ring_cap];
    return (uint32_t)n;
}

/* Instant utility of one iteration against the shared plain-iteration timing. */
static double instant_utility(const smoe_spec_ctl *c, const smoe_spec_obs *o) {
    double base = smoe_spec_ctl_base(c);
    return isnan(base) ? NAN : smoe_spec_obs_etr(o) * base / o->t_iter;
}

/* ---- static K -------------------------------------------------------------------------- */

static int static_init(smoe_spec_ctl *c, const smoe_spec_params *p, smoe_err *err) {
    (void)p;
    (void)err;
    c->state = NULL;
    return SMOE_OK;
}
static int32_t static_next_k(const smoe_spec_ctl *c) { return c->params.k; }
static double static_observe(smoe_spec_ctl *c, const smoe_spec_obs *o, int32_t *phase) {
    *phase = SMOE_SPEC_PHASE_NONE;
    return instant_utility(c, o);
}
int32_t smoe_spec_ctl_no_phase(const smoe_spec_ctl *c) {
    (void)c;
    return SMOE_SPEC_PHASE_NONE;
}

const smoe_spec_ctl_ops smoe_spec_static = {"static",       static_init,    NULL, static_next_k,
                                            static_observe, smoe_spec_ctl_no_phase, NULL};

/* ---- transformers' heuristic schedule ----------------------------------------------------- */

typedef struct heur_state {
    int32_t k;
} heur_state;

static int heur_init(smoe_spec_ctl *c, const smoe_spec_params *p, smoe_err *err) {
    int32_t init = p->initial == -1 ? 5 : p->initial;
    if (init > p->k_max) init = p->k_max;
    if (init < 1)
        return smoe_err_set(err, SMOE_EINVAL, "spec heuristic: initial must be >= 1, got %d",
                            (int)init);
    heur_state *s = malloc(sizeof *s);
    if (!s) return smoe_err_set(err, SMOE_ENOMEM, "spec heuristic: out of memory");
    s->k = init;
    c->state = s;
    return SMOE_OK;
}
static void heur_free(smoe_spec_ctl *c) {
    free(c->state);
    c->state = NULL;
}
static int32_t heur_next_k(const smoe_spec_ctl *c) { return ((const heur_state *)c->state)->k; }
static double heur_observe(smoe_spec_ctl *c, const smoe_spec_obs *o, int32_t *phase) {
    heur_state *s = c->state;
    *phase = SMOE_SPEC_PHASE_NONE;
    if (o->k >= 1) {
        if (o->accepted == o->k)
            s->k += 2;
        else
            s->k -= 1;
        if (s->k < 1) s->k = 1;
        if (s->k > c->params.k_max) s->k = c->params.k_max;
    }
    return instant_utility(c, o);
}

const smoe_spec_ctl_ops smoe_spec_heuristic = {"heuristic",  heur_init,   heur_free,
                                               heur_next_k, heur_observe, smoe_spec_ctl_no_phase,
                                               NULL};

/* MoE-SpeQ's amortization governor: K = argmax_k E[N(k)] / T_cycle(k).  The acceptance,
 * draft-time and verify-time models are specified in controller.h; tests/test_spec.py holds
 * an independent Python reference. */
#include "controller.h"

#include <math.h>
#include <stdlib.h>

typedef struct speq_state {
    double p[SMOE_SPEC_KMAX + 1];  /* p[j], j = 1..k_max: acceptance of position j */
    double t_draft_tok;            /* EMA of t_draft / k (0 until a t_draft > 0 was seen) */
    int has_draft;
    double t1;                     /* EMA of v * tau(g) (tau model) */
    int has_t1;
    /* exponentially weighted least squares of v on g */
    double w, sx, sy, sxx, sxy;
    int32_t g_first;
    int distinct;                  /* two different g were seen */
    uint64_t n;
    uint64_t zero_run;             /* consecutive latest observations with k == 0 */
    uint8_t tried[SMOE_SPEC_KMAX + 1]; /* k (the step's largest) was verified at least once */
    /* the learned I/O cost (controller.h, io_cost) */
    double loaded[SMOE_SPEC_KMAX + 1]; /* EMA of experts_loaded per k verified */
    uint8_t loaded_seen[SMOE_SPEC_KMAX + 1];
    double t_load;                 /* EMA of t_io / experts_loaded (0: none timed yet) */
} speq_state;

#define SPEQ_IO_EMA 0.2 /* the weight of a new sample in the I/O-cost EMAs */

/* Learn the I/O cost from one observation and rewrite c->io_cost (controller.h). */
static void speq_learn_io(smoe_spec_ctl *c, speq_state *s, const smoe_spec_obs *o) {
    const double a = SPEQ_IO_EMA;
    const int32_t k = o->k, km = c->params.k_max;
    const double n = (double)o->experts_loaded;
    s->loaded[k] = s->loaded_seen[k] ? (1.0 - a) * s->loaded[k] + a * n : n;
    s->loaded_seen[k] = 1;
    if (o->experts_loaded > 0) {
        double per = o->t_io / n;
        s->t_load = s->t_load == 0.0 ? per : (1.0 - a) * s->t_load + a * per;
    }
    for (int32_t q = 0; q <= km; q++) {
        if (s->t_load <= 0.0) {
            c->io_cost[q] = 0.0;
            continue;
        }
        int32_t j = -1; /* the nearest observed k, the smaller on a tie */
        for (int32_t d = 0; d <= km && j < 0; d++) {
            if (q - d >= 0 && s->loaded_seen[q - d]) j = q - d;
            else if (q + d <= km && s->loaded_seen[q + d]) j = q + d;
        }
        c->io_cost[q] = j == q ? s->loaded[q] * s->t_load
                               : s->loaded[j] * (double)(q + 1) / (double)(j + 1) * s->t_load;
    }
}

static int speq_init(smoe_spec_ctl *c, const smoe_spec_params *p, smoe_err *err) {
    (void)err;
    speq_state *s = calloc(1, sizeof *s);
    if (!s) return smoe_err_set(err, SMOE_ENOMEM, "spec speq: out of memory");
    for (int32_t j = 0; j <= SMOE_SPEC_KMAX; j++) s->p[j] = p->p_init;
    c->state = s;
    return SMOE_OK;
}

static void speq_free(smoe_spec_ctl *c) {
    free(c->state);
    c->state = NULL;
}

static double expected_tokens(const speq_state *s, int32_t k) {
    double e = 1.0, prod = 1.0;
    for (int32_t i = 1; i <= k; i++) {
        prod *= s->p[i];
        e += prod;
    }
    return e;
}

static double verify_time(const smoe_spec_ctl *c, const speq_state *s, int32_t g) {
    double t;
    if (c->ntau > 0 && s->has_t1 && g <= c->ntau) {
        t = s->t1 / c->tau[g];
    } else if (s->w > 0.0) {
        double b = 0.0;
        if (s->distinct) {
            double den = s->w * s->sxx - s->sx * s->sx;
            if (den > 0.0) b = (s->w * s->sxy - s->sx * s->sy) / den;
        }
        t = (s->sy - b * s->sx) / s->w + b * (double)g;
    } else {
        t = 0.0;
    }
    return t > 0.0 ? t : 0.0;
}

/* T_cycle(k)'s terms (Eq. 3): parts[0] drafting k tokens, [1] the first mandatory fetch,
 * [2] verifying k + 1 tokens, [3] loading the experts the draft adds (io_cost[k]). */
static void cycle_parts(const smoe_spec_ctl *c, const speq_state *s, int32_t k,
                        double parts[4]) {
    parts[0] = (double)k * s->t_draft_tok;
    parts[1] = c->params.t_first;
    parts[2] = verify_time(c, s, k + 1);
    parts[3] = c->io_cost[k];
}

static double cycle_time(const smoe_spec_ctl *c, const speq_state *s, int32_t k) {
    double p[4];
    cycle_parts(c, s, k, p);
    double t = p[0] + p[1] + p[2] + p[3];
    return t > 1e-12 ? t : 1e-12;
}

static int32_t speq_best(const smoe_spec_ctl *c, const speq_state *s, int32_t k_min) {
    int32_t best = 0;
    double best_v = -1.0;
    for (int32_t k = k_min; k <= c->params.k_max; k++) {
        if (!c->allowed[k]) continue;
        double v = expected_tokens(s, k) / cycle_time(c, s, k);
        if (v > best_v) {
            best_v = v;
            best = k;
        }
    }
    return best;
}

/* The probe's K (controller.h): the smallest allowed k >= 1 never verified, else the best
 * allowed k >= 1 by the objective; 0 when no k >= 1 is allowed. */
static int32_t speq_probe_k(const smoe_spec_ctl *c, const speq_state *s) {
    for (int32_t k = 1; k <= c->params.k_max; k++)
        if (c->allowed[k] && !s->tried[k]) return k;
    return speq_best(c, s, 1);
}

static int32_t speq_next_k(const smoe_spec_ctl *c) {
    const speq_state *s = c->state;
    if (s->n == 0) return c->params.initial == -1 ? 1 : c->params.initial;
    int32_t k = speq_best(c, s, 0);
    if (k == 0 && c->params.probe > 0 && s->zero_run >= (uint64_t)c->params.probe &&
        smoe_spec_ctl_within_budget(c))
        k = speq_probe_k(c, s);
    return k;
}

static double speq_observe(smoe_spec_ctl *c, const smoe_spec_obs *o, int32_t *phase) {
    speq_state *s = c->state;
    double a = c->params.alpha;
    *phase = SMOE_SPEC_PHASE_NONE;
    /* acceptance per position: 1..accepted accepted, accepted+1 rejected (if drafted) */
    int32_t rows = o->nrows > 0 ? o->nrows : 1; /* a batch step: every row's positions */
    for (int32_t r = 0; r < rows; r++) {
        int32_t k = o->nrows > 0 ? o->row_k[r] : o->k;
        int32_t acc = o->nrows > 0 ? o->row_acc[r] : o->accepted;
        for (int32_t j = 1; j <= k && j <= acc + 1; j++) {
            double x = j <= acc ? 1.0 : 0.0;
            s->p[j] = (1.0 - a) * s->p[j] + a * x;
        }
    }
    if (o->k >= 1 && o->t_draft > 0.0) {
        double d = o->t_draft / (double)o->k;
        s->t_draft_tok = s->has_draft ? (1.0 - a) * s->t_draft_tok + a * d : d;
        s->has_draft = 1;
    }
    int32_t g = o->k + 1;
    double v = o->t_iter - o->t_draft - o->t_io;
    if (v < 0.0) v = 0.0;
    if (c->ntau >= g) {
        double t1 = v * c->tau[g];
        s->t1 = s->has_t1 ? (1.0 - a) * s->t1 + a * t1 : t1;
        s->has_t1 = 1;
    }
    double x = (double)g, keep = 1.0 - a;
    s->w = keep * s->w + 1.0;
    s->sx = keep * s->sx + x;
    s->sy = keep * s->sy + v;
    s->sxx = keep * s->sxx + x * x;
    s->sxy = keep * s->sxy + x * v;
    if (s->n == 0)
        s->g_first = g;
    else if (g != s->g_first)
        s->distinct = 1;
    s->n++;
    s->zero_run = o->k == 0 ? s->zero_run + 1 : 0;
    s->tried[o->k] = 1;
    int32_t k = speq_best(c, s, 0);
    double u = expected_tokens(s, k) / cycle_time(c, s, k) * cycle_time(c, s, 0);
    if (!c->io_given) speq_learn_io(c, s, o);
    return u;
}

const smoe_spec_ctl_ops smoe_spec_speq = {"speq", speq_init, speq_free, speq_next_k,
                                          speq_observe, smoe_spec_ctl_no_phase, NULL};

double smoe_spec_speq_expected_tokens(const smoe_spec_ctl *c, int32_t k) {
    if (c->ops != &smoe_spec_speq || k < 0 || k > c->params.k_max) return NAN;
    return expected_tokens(c->state, k);
}

double smoe_spec_speq_cycle_time(const smoe_spec_ctl *c, int32_t k) {
    if (c->ops != &smoe_spec_speq || k < 0 || k > c->params.k_max) return NAN;
    return cycle_time(c, c->state, k);
}

int smoe_spec_speq_cycle_parts(const smoe_spec_ctl *c, int32_t k, double parts[4]) {
    if (c->ops != &smoe_spec_speq || k < 0 || k > c->params.k_max) return -1;
    cycle_parts(c, c->state, k, parts);
    return 0;
}

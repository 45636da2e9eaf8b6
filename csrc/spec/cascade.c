/* Cascade: utility-driven test-and-set speculation control.  The state machine and every
 * open choice are specified in controller.h; tests/test_spec.py holds an independent Python
 * reference of the same specification. */
#include "controller.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define CASCADE_POOL_MAX 64 /* largest trial_pool */

/* One TEST or SET iteration remembered for the trial utilities (see controller.h, pool). */
typedef struct pool_rec {
    double etr, t;
    uint64_t iter;
    uint64_t req; /* the request it belongs to (cascade_state.req) */
} pool_rec;

typedef struct cascade_state {
    int32_t phase;
    int32_t n;          /* iterations observed in the current phase (or trial) */
    double etr_sum;     /* sums over the current trial / set phase */
    double t_sum;
    /* test phase */
    int32_t cur_k;      /* K of the running trial */
    int32_t ntrials;
    int32_t dir, flipped;
    int32_t best_k;
    double best_u;
    uint8_t tried[SMOE_SPEC_KMAX + 1];
    /* set / back-off */
    int32_t set_k;
    int32_t backoff_len;     /* length of the next back-off phase */
    int32_t cur_backoff_len; /* length of the running back-off phase */
    int32_t center;          /* best non-zero K of the most recent test phase that found one */
    int32_t initial;         /* the first centre of every request */
    double last_u;           /* U of the previous trial of the running test phase */
    uint64_t req;            /* requests begun (begin_request) */
    /* the base confirmed after the trials (controller.h) */
    int32_t tested;           /* a TEST phase was ever entered */
    uint64_t test_start;      /* index of the first TEST iteration */
    int32_t confirming;       /* the running BASE phase re-takes the test phase's decision */
    double confirm_before;    /* t_base when that test phase ended */
    double trial_u[SMOE_SPEC_KMAX + 1];    /* U of each K tried in the running test phase */
    double trial_base[SMOE_SPEC_KMAX + 1]; /* the t_base that U was computed with */
    /* per planned K, the last CASCADE_POOL_MAX TEST/SET iterations (ring, newest at pos-1),
     * kept across requests: utilities pool the current request's, the hopeless test reads
     * every request's iteration times */
    pool_rec pool[SMOE_SPEC_KMAX + 1][CASCADE_POOL_MAX];
    int32_t pool_pos[SMOE_SPEC_KMAX + 1], pool_n[SMOE_SPEC_KMAX + 1];
} cascade_state;

static void pool_add(cascade_state *s, int32_t k, double etr, double t, uint64_t iter) {
    pool_rec *r = &s->pool[k][s->pool_pos[k]];
    r->etr = etr;
    r->t = t;
    r->iter = iter;
    r->req = s->req;
    s->pool_pos[k] = (s->pool_pos[k] + 1) % CASCADE_POOL_MAX;
    if (s->pool_n[k] < CASCADE_POOL_MAX) s->pool_n[k]++;
}

/* U of the trial at K that just ended with iteration `now`: its own trial_len iterations and
 * earlier ones at K, newest first, up to trial_pool in all, those older than base_refresh
 * iterations left out. */
static double pooled_utility(const smoe_spec_ctl *c, const cascade_state *s, int32_t k,
                             uint64_t now, double base) {
    int32_t want = c->params.trial_pool > c->params.trial_len ? c->params.trial_pool
                                                                : c->params.trial_len;
    double etr = 0.0, t = 0.0;
    int32_t used = 0;
    for (int32_t i = 0; i < s->pool_n[k] && used < want; i++) {
        const pool_rec *r =
            &s->pool[k][(s->pool_pos[k] - 1 - i + CASCADE_POOL_MAX) % CASCADE_POOL_MAX];
        if (r->req != s->req) break; /* an earlier request's: this one's are all newer */
        if (used >= c->params.trial_len && r->iter + (uint64_t)c->params.base_refresh <= now)
            break;
        etr += r->etr;
        t += r->t;
        used++;
    }
    return etr / (t / base);
}

/* Can the running trial still reach U >= 1?  Its best case: each of its trial_len - n remaining
 * iterations accepts all cur_k drafts (ETR cur_k + 1) at the mean time of its n iterations so
 * far (controller.h, "hopeless trials"). */
static int trial_hopeless(const smoe_spec_ctl *c, const cascade_state *s, double base) {
    int32_t left = c->params.trial_len - s->n;
    if (left <= 0 || s->n <= 0 || isnan(base) || !(base > 0.0)) return 0;
    double etr = s->etr_sum + (double)left * (double)(s->cur_k + 1);
    double t = s->t_sum * (double)c->params.trial_len / (double)s->n;
    return etr / (t / base) < 1.0;
}

/* The best case of a trial at K from what K has cost lately, whatever the request: K + 1
 * tokens over the mean t_iter of the iterations planned at K within the last base_refresh
 * iterations (any request's), in plain steps; NAN when there is none or no t_base
 * (controller.h, "hopeless trials"). */
static double recent_best_u(const smoe_spec_ctl *c, const cascade_state *s, int32_t k,
                            uint64_t now) {
    double base = smoe_spec_ctl_base(c);
    if (isnan(base) || !(base > 0.0)) return NAN;
    double t = 0.0;
    int32_t n = 0;
    for (int32_t i = 0; i < s->pool_n[k]; i++) {
        const pool_rec *r =
            &s->pool[k][(s->pool_pos[k] - 1 - i + CASCADE_POOL_MAX) % CASCADE_POOL_MAX];
        if (r->iter + (uint64_t)c->params.base_refresh <= now) break;
        t += r->t;
        n++;
    }
    return n > 0 ? (double)(k + 1) / (t / (double)n / base) : NAN;
}

static int32_t nearest_untried(const smoe_spec_ctl *c, const cascade_state *s, int32_t from,
                               int32_t dir) {
    for (int32_t k = from + dir; k >= 1 && k <= c->params.k_max; k += dir)
        if (c->allowed[k] && !s->tried[k]) return k;
    return 0;
}

static void finish_trial(const smoe_spec_ctl *c, cascade_state *s, double u, uint64_t now);

/* The trial just entered at s->cur_k is known not to pay (recent_best_u < 1): it ends at once
 * with that bound as its U, without an iteration, and the test phase goes on as after it. */
static void skip_if_hopeless(const smoe_spec_ctl *c, cascade_state *s, uint64_t now) {
    if (s->phase != SMOE_SPEC_PHASE_TEST) return;
    double u = recent_best_u(c, s, s->cur_k, now);
    if (u < 1.0) finish_trial(c, s, u, now); /* (false for NAN) */
}

static void enter(cascade_state *s, int32_t phase) {
    s->phase = phase;
    s->n = 0;
    s->etr_sum = 0.0;
    s->t_sum = 0.0;
}

static void decide(const smoe_spec_ctl *c, cascade_state *s) {
    if (s->best_k > 0 && s->best_u >= 1.0) {
        enter(s, SMOE_SPEC_PHASE_SET);
        s->set_k = s->best_k;
        s->center = s->best_k;
        s->backoff_len = c->params.set_len;
    } else {
        enter(s, SMOE_SPEC_PHASE_BACKOFF);
        s->cur_backoff_len = s->backoff_len;
        int64_t nxt = 2 * (int64_t)s->backoff_len;
        s->backoff_len = nxt > c->params.backoff_max ? c->params.backoff_max : (int32_t)nxt;
    }
}

static void start_test(const smoe_spec_ctl *c, cascade_state *s, uint64_t now) {
    int32_t wait = smoe_spec_ctl_budget_wait(c);
    if (wait > 0) { /* outside the slowdown budget: plain steps until back within it */
        enter(s, SMOE_SPEC_PHASE_BACKOFF);
        s->cur_backoff_len = wait;
        return;
    }
    memset(s->tried, 0, sizeof s->tried);
    s->best_k = 0;
    s->best_u = -INFINITY;
    s->ntrials = 0;
    s->flipped = 0;
    s->dir = 1;
    int32_t k0 = smoe_spec_ctl_clamp(c, s->center);
    if (k0 == 0) k0 = nearest_untried(c, s, s->center, +1);
    if (k0 == 0) {
        decide(c, s); /* no K >= 1 is allowed: nothing to test */
        return;
    }
    if (!s->tested) {
        s->tested = 1;
        s->test_start = now + 1; /* the next iteration is the first TEST one */
    }
    enter(s, SMOE_SPEC_PHASE_TEST);
    s->cur_k = k0;
    skip_if_hopeless(c, s, now);
}

/* A new cycle after the iteration with index `now`: measure the base again when it is
 * stale, else test. */
static void new_cycle(const smoe_spec_ctl *c, cascade_state *s, uint64_t now) {
    if (c->base_n == 0 || now - c->last_base_iter >= (uint64_t)c->params.base_refresh)
        enter(s, SMOE_SPEC_PHASE_BASE);
    else
        start_test(c, s, now);
}

/* End of a SET or BACKOFF phase (called from observe: c->n_obs is the index of the
 * iteration just observed). */
static void end_set(const smoe_spec_ctl *c, cascade_state *s) { new_cycle(c, s, c->n_obs); }

/* The end of a test phase after the iteration `now`: decide, unless the phase would SET on a
 * t_base measured before any trial (or stale): then a BASE phase confirms it first
 * (controller.h, "the base confirmed after the trials"). */
static void conclude(const smoe_spec_ctl *c, cascade_state *s, uint64_t now) {
    if (s->best_k > 0 && s->best_u >= 1.0 &&
        (c->last_base_iter < s->test_start ||
         now - c->last_base_iter >= (uint64_t)c->params.base_refresh)) {
        s->confirm_before = smoe_spec_ctl_base(c);
        enter(s, SMOE_SPEC_PHASE_BASE);
        s->confirming = 1;
        return;
    }
    decide(c, s);
}

/* After the confirming BASE phase: every tried K's U against the smaller of the two bases,
 * then the decision as usual. */
static void reconsider(const smoe_spec_ctl *c, cascade_state *s) {
    double after = smoe_spec_ctl_base(c);
    double b = s->confirm_before < after ? s->confirm_before : after;
    s->confirming = 0;
    s->best_k = 0;
    s->best_u = -INFINITY;
    for (int32_t k = 1; k <= c->params.k_max; k++) { /* ascending: ties go to the smaller K */
        if (!s->tried[k]) continue;
        double u = s->trial_base[k] > 0.0 ? s->trial_u[k] * (b / s->trial_base[k])
                                          : s->trial_u[k];
        if (u > s->best_u) {
            s->best_u = u;
            s->best_k = k;
        }
    }
    decide(c, s);
}

static void finish_trial(const smoe_spec_ctl *c, cascade_state *s, double u, uint64_t now) {
    if (isnan(u)) u = 0.0; /* no plain iteration observed: cannot show that K pays */
    int32_t k = s->cur_k;
    int first = s->ntrials == 0;
    s->tried[k] = 1;
    s->trial_u[k] = u;
    s->trial_base[k] = smoe_spec_ctl_base(c);
    s->ntrials++;
    int beats = u > s->best_u;
    if (beats || (u == s->best_u && k < s->best_k)) {
        s->best_u = u;
        s->best_k = k;
    }
    if (first) s->dir = u >= 1.0 ? 1 : -1;
    double prev = s->last_u;
    s->last_u = u;
    if ((k == 1 && !(u >= 1.0)) || s->ntrials >= c->params.trials ||
        !smoe_spec_ctl_within_budget(c)) {
        conclude(c, s, now);
        return;
    }
    if (!first && c->params.converge > 0.0 &&
        fabs(u - prev) <= c->params.converge * fmax(fabs(u), fabs(prev))) {
        conclude(c, s, now); /* successive utilities converged */
        return;
    }
    int32_t next = 0;
    if (first || beats) next = nearest_untried(c, s, s->best_k, s->dir);
    if (next == 0 && !first && !beats && s->flipped) {
        conclude(c, s, now); /* second failure */
        return;
    }
    if (next == 0 && !s->flipped) {
        s->flipped = 1;
        s->dir = -s->dir;
        next = nearest_untried(c, s, s->best_k, s->dir);
    }
    if (next == 0) {
        conclude(c, s, now);
        return;
    }
    enter(s, SMOE_SPEC_PHASE_TEST);
    s->cur_k = next;
    skip_if_hopeless(c, s, now);
}

static int cascade_init(smoe_spec_ctl *c, const smoe_spec_params *p, smoe_err *err) {
    int32_t init = p->initial == -1 ? 2 : p->initial;
    if (init < 1)
        return smoe_err_set(err, SMOE_EINVAL, "spec cascade: initial must be >= 1, got %d",
                            (int)init);
    cascade_state *s = calloc(1, sizeof *s);
    if (!s) return smoe_err_set(err, SMOE_ENOMEM, "spec cascade: out of memory");
    s->center = init;
    s->initial = init;
    s->backoff_len = p->set_len;
    enter(s, SMOE_SPEC_PHASE_BASE);
    c->state = s;
    return SMOE_OK;
}

static void cascade_free(smoe_spec_ctl *c) {
    free(c->state);
    c->state = NULL;
}

static int32_t cascade_next_k(const smoe_spec_ctl *c) {
    const cascade_state *s = c->state;
    switch (s->phase) {
    case SMOE_SPEC_PHASE_TEST: return s->cur_k;
    case SMOE_SPEC_PHASE_SET: return s->set_k;
    default: return 0;
    }
}

static int32_t cascade_phase(const smoe_spec_ctl *c) {
    return ((const cascade_state *)c->state)->phase;
}

static double cascade_observe(smoe_spec_ctl *c, const smoe_spec_obs *o, int32_t *phase) {
    cascade_state *s = c->state;
    double base = smoe_spec_ctl_base(c); /* already includes o when o->k == 0 */
    *phase = s->phase;
    s->n++;
    double etr = smoe_spec_obs_etr(o); /* a batch step: the batch's tokens per sequence */
    s->etr_sum += etr;
    s->t_sum += o->t_iter;
    /* running utility of the trial / set phase: mean(ETR) / (mean(t) / base) */
    double u = s->etr_sum / (s->t_sum / base);
    uint64_t now = c->n_obs; /* index of this iteration */
    if (s->phase == SMOE_SPEC_PHASE_TEST)
        pool_add(s, s->cur_k, etr, o->t_iter, now);
    else if (s->phase == SMOE_SPEC_PHASE_SET)
        pool_add(s, s->set_k, etr, o->t_iter, now);
    switch (s->phase) {
    case SMOE_SPEC_PHASE_BASE:
        u = etr * base / o->t_iter;
        if (s->n >= c->params.base_len) {
            if (s->confirming)
                reconsider(c, s);
            else
                start_test(c, s, now);
        }
        break;
    case SMOE_SPEC_PHASE_TEST:
        if (s->n >= c->params.trial_len) {
            u = pooled_utility(c, s, s->cur_k, now, base);
            finish_trial(c, s, u, now);
        } else if (trial_hopeless(c, s, base) || !smoe_spec_ctl_within_budget(c)) {
            finish_trial(c, s, u, now); /* its running U (hopeless: below its best case,
                                         * below 1; over budget: the test phase ends) */
        }
        break;
    case SMOE_SPEC_PHASE_SET:
        if (s->n >= c->params.set_len || (u < 1.0 && !smoe_spec_ctl_within_budget(c)))
            end_set(c, s);
        break;
    case SMOE_SPEC_PHASE_BACKOFF:
    default:
        u = etr * base / o->t_iter;
        if (s->n >= s->cur_backoff_len) end_set(c, s);
        break;
    }
    return u;
}

static void cascade_begin_request(smoe_spec_ctl *c) {
    cascade_state *s = c->state;
    s->req++; /* the pools' earlier records stop counting toward utilities */
    s->center = s->initial;
    s->backoff_len = c->params.set_len;
    s->confirming = 0;
    if (c->n_obs == 0) {
        enter(s, SMOE_SPEC_PHASE_BASE);
        return;
    }
    new_cycle(c, s, c->n_obs - 1); /* index of the last iteration observed */
}

const smoe_spec_ctl_ops smoe_spec_cascade = {"cascade",       cascade_init,    cascade_free,
                                             cascade_next_k,  cascade_observe, cascade_phase,
                                             cascade_begin_request};

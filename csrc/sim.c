/* Trace-driven simulator (see sim.h for the cache semantics and the time model). */
#include "sim.h"

#include <inttypes.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "policy/nextuse.h"
#include "route.h"
#include "slots.h"

typedef struct sim {
    const smoe_sim_trace *tr;
    const smoe_sim_hw *hw;
    const smoe_sim_prefetch *pf; /* NULL or predictor != NONE */
    smoe_policy *pol;
    smoe_sim_result *r;
    uint32_t nslots, nkeys, L, K, E;

    /* The simulated cache is the live cache's slot table (slots.h), driven through its rules
     * (smoe_slots_claim / loaded / touch) by this one thread: no worker, no loads, no mutex
     * contention.  It borrows `pol` (set back to NULL before the table is freed).  The slot
     * of the prefetch in flight is LOADING there, so no victim search takes it. */
    smoe_slots tab;
    int tab_ready;         /* tab initialised (sim_free frees it) */
    double now;
    double load_s;         /* link_latency_s + expert_bytes / link_bw */
    double expert_s;       /* expert_bytes / fast_bw */

    /* copy engine */
    int32_t inflight;      /* slot being prefetched (LOADING in tab), -1 none */
    double inflight_ready;
    double ce_free;        /* when the copy engine became / becomes free */
    int32_t *q_key;        /* FIFO of requested keys, replaced at every issue */
    float *q_prob;         /* their predictor scores (admission: the probability of use) */
    uint32_t *q_steps;     /* their layer steps ahead of the issue */
    uint32_t q_head, q_len, q_cap;
    double q_issue;        /* issue time of the queued requests */
    uint64_t *q_stamp;     /* per key: issue id that queued it (dedup) */
    uint64_t issue_id;

    /* predictors */
    float *scores;         /* [E] */
    float *sorted;         /* [E] scratch for the percentile */
    uint32_t *sel;         /* [E] selected experts */
    float *selq;           /* [E] their scores */
    uint32_t *freq;        /* history: [L][E] uses in the window */
    uint32_t *cooc;        /* history: [L][E][E] uses of b at position l+1 after a at l */
    uint32_t *cnt;         /* history: [L][E] uses of a at position l with a successor seen */
    smoe_policy *learner;  /* learned: a one-slot nextuse policy fed the replayed routing */
    double *lq;            /* learned: [E] q of the target layer */
    uint64_t tokens_seen;

    /* activation counts for policies with on_counts, and the group replay */
    uint64_t *cstamp;      /* [nkeys] token id + 1 that last counted the key */
    uint32_t *ccnt;        /* [nkeys] count of the current pass (0 outside feed_counts) */
    int32_t *ckeys;        /* [nkeys] keys with a count */
    uint32_t *cvals;       /* [nkeys] their counts */
    uint64_t *seen;        /* [nkeys] groups: pass id that last demanded the key */

    /* lookahead shield (tr->protect) */
    int32_t *pkeys;        /* [nkeys] the protected keys of the pass's layers still to run */
    uint64_t *pstamp;      /* [nkeys] dedup stamp of pkeys */
    uint64_t pstamp_id;

    /* miss handling (NULL: fetch) */
    const smoe_sim_miss *miss;
    uint8_t *tok_mark;     /* [E] one token's experts (and substitutes) at a layer */
    /* hybrid: the layer's missing experts by (count, id) and their counts (all 1: one
     * token per pass), [K] each; the cut, the CPU's remainder, how many of those to admit */
    uint32_t *hy_miss, *hy_cnt;
    uint32_t hy_cut, hy_ncpu, hy_nadmit;
    int32_t hy_base;
} sim;

static const int16_t *row(const sim *s, uint64_t t, uint32_t l) {
    return s->tr->experts + ((size_t)t * s->L + l) * s->K;
}

/* A slot for a demand load of `key` (absent) through the table's rule (smoe_slots_claim): the
 * slot, LOADING; -1 when nothing may be evicted; -2 on a policy failure or invalid victim (err
 * filled).  Prefetch copies go through smoe_slots_claim_prefetch (advance). */
static int32_t take_slot(sim *s, int32_t key, smoe_err *err) {
    int rc;
    int32_t slot = smoe_slots_claim(&s->tab, key, 0, &rc, err);
    return rc < 0 ? -2 : slot;
}

/* The prefetch in flight has landed (its slot READY); the copy engine is free from then. */
static void land_inflight(sim *s) {
    smoe_slots_loaded(&s->tab, (uint32_t)s->inflight);
    s->ce_free = s->inflight_ready;
    s->inflight = -1;
}

/* Demand waits for the prefetch in flight (stall up to its ready time), which then lands. */
static void wait_inflight(sim *s) {
    smoe_admit_fetch(&s->tab.admit, s->inflight_ready - s->now, 0);
    s->r->stall_s += s->inflight_ready - s->now;
    s->now = s->inflight_ready;
    land_inflight(s);
}

static int32_t slot_of(const sim *s, int32_t key) { return s->tab.map[key]; }

/* The table's ops: the replay never asks it to load (it marks slots loaded itself). */
static int sim_no_load(void *owner, uint32_t s, int32_t key, smoe_err *err) {
    (void)owner;
    return smoe_err_set(err, SMOE_ESTATE, "simulated cache: no loads (slot %u, key %d)", s,
                        (int)key);
}

static const smoe_slots_ops sim_ops = {sim_no_load, NULL, NULL, NULL};

/* Run the copy engine up to time `now`: finish the in-flight copy, start queued ones. */
static int advance(sim *s, double now, smoe_err *err) {
    for (;;) {
        if (s->inflight >= 0) {
            if (s->inflight_ready > now) return 0;
            land_inflight(s);
        }
        if (!s->q_len) return 0;
        double start = s->ce_free > s->q_issue ? s->ce_free : s->q_issue;
        if (start > now) return 0;
        const uint32_t qi = s->q_head;
        int32_t key = s->q_key[qi];
        s->q_head++;
        s->q_len--;
        if (slot_of(s, key) >= 0) continue;
        /* A policy with a hot/cold threshold (spac): only hot experts are prefetched (MoE-SpAc
         * §3.4, "the prefetcher only processes queues with levels s >= τ"). */
        if (s->pol->ops->threshold &&
            smoe_policy_utility(s->pol, key) < smoe_policy_threshold(s->pol)) {
            s->r->prefetch_dropped++;
            continue;
        }
        const smoe_prefetch_req req = {.key = key, .prob = s->q_prob[qi],
                                       .steps = s->q_steps[qi], .issued = s->q_issue};
        int rc;
        int32_t slot = smoe_slots_claim_prefetch(&s->tab, &req, start, &rc, err);
        if (slot == -2) return SMOE_EPOLICY;
        if (slot < 0) continue; /* dropped or refused: the table counts them */
        smoe_admit_load(&s->tab.admit, s->load_s);
        s->r->prefetch_issued++;
        s->inflight = slot;
        s->inflight_ready = start + s->load_s;
        s->ce_free = s->inflight_ready;
    }
}

static int demand(sim *s, int32_t key, smoe_err *err) {
    smoe_sim_result *r = s->r;
    r->accesses++;
    int32_t slot = slot_of(s, key);
    if (slot >= 0) {
        if (slot == s->inflight) { /* late prefetch: wait for it */
            r->misses++;
            r->prefetch_late++;
            wait_inflight(s);
        } else {
            r->hits++;
            /* the admission rule's estimates (admit.h) on the replay's clock */
            if (s->tab.slots[slot].prefetched) smoe_admit_fetch(&s->tab.admit, 0.0, 0);
        }
        smoe_slots_touch(&s->tab, (uint32_t)slot); /* on_access, prefetch_used */
        return 0;
    }
    r->misses++;
    smoe_slots_missed(&s->tab, key); /* collision misses, the admission rule's regret */
    slot = take_slot(s, key, err);
    if (slot == -1 && s->inflight >= 0) { /* only the in-flight slot could go: wait for it */
        wait_inflight(s);
        slot = take_slot(s, key, err);
    }
    if (slot < -1) return SMOE_EPOLICY;
    if (slot < 0)
        return smoe_err_set(err, SMOE_EPOLICY, "policy %s found no victim for a demand miss on "
                            "key %d with all %u slots resident", s->pol->ops->name, (int)key,
                            s->nslots);
    smoe_slots_loaded(&s->tab, (uint32_t)slot); /* (its time: the stall below) */
    smoe_slots_unpin(&s->tab, (uint32_t)slot);  /* each access is acquire + release */
    if (s->inflight >= 0) { /* the demand load pre-empts the copy engine on the shared link */
        s->inflight_ready += s->load_s;
        s->ce_free = s->inflight_ready;
    }
    r->stall_s += s->load_s;
    smoe_admit_load(&s->tab.admit, s->load_s);
    smoe_admit_fetch(&s->tab.admit, s->load_s, 1);
    s->now += s->load_s;
    return 0;
}

static int resident(const sim *s, int32_t key) {
    const int32_t slot = slot_of(s, key);
    return slot >= 0 && s->tab.slots[slot].state == SMOE_SLOT_READY;
}

/* The rank of the token's i-th recorded expert among its K: by the router logits (descending,
 * ties by recorded position) when the trace has them, else the recorded position. */
static uint32_t routing_rank(const int16_t *ex, const float *lg, uint32_t K, uint32_t i) {
    if (!lg) return i;
    uint32_t r = 0;
    for (uint32_t q = 0; q < K; q++)
        r += lg[ex[q]] > lg[ex[i]] || (lg[ex[q]] == lg[ex[i]] && q < i);
    return r;
}

/* The demand accesses of token t at layer l under the miss rule (sim.h); returns through
 * *computed, *low and *low2 the experts computed at full precision and from the first and
 * the second low-bit copy. */
static int layer_accesses(sim *s, uint64_t t, uint32_t l, const int16_t *ex, uint32_t *computed,
                          uint32_t *low, uint32_t *low2, smoe_err *err) {
    const uint32_t K = s->K, E = s->E;
    const int32_t base = (int32_t)(l * E);
    const smoe_sim_miss *m = s->miss;
    const float *lg = s->tr->logits ? s->tr->logits + ((size_t)t * s->L + l) * E : NULL;
    int rc;
    *computed = 0, *low = 0, *low2 = 0;
    if (m && m->mode == SMOE_SIM_HYBRID) { /* sim.h HYBRID: which missing experts the CPU runs */
        if (s->pf && (rc = advance(s, s->now, err)) < 0) return rc;
        uint32_t nm = 0, on_fast = 0;
        memset(s->tok_mark, 0, E);
        for (uint32_t i = 0; i < K; i++) {
            const uint32_t e = (uint32_t)ex[i];
            if (slot_of(s, base + (int32_t)e) >= 0) { /* resident or in flight */
                on_fast++;
                continue;
            }
            uint32_t j = nm++; /* one token: every count is 1 (hy_cnt), so by id */
            while (j > 0 && s->hy_miss[j - 1] > e) s->hy_miss[j] = s->hy_miss[j - 1], j--;
            s->hy_miss[j] = e;
        }
        const double t_cpu = m->cpu_expert_s;
        const uint32_t cut = smoe_route_balance_cut(s->hy_cnt, nm, on_fast, s->load_s,
                                                    s->expert_s, t_cpu);
        for (uint32_t i = cut; i < nm; i++) s->tok_mark[s->hy_miss[i]] = 1;
        /* Eq. 10's window, as hybrid_split: max(T_cpu, T_gpu) less the cut's copies */
        const double tc = t_cpu * (nm - cut),
                     tg = s->load_s * cut + s->expert_s * ((double)on_fast + cut);
        s->hy_nadmit = smoe_route_balance_admit(s->hy_cnt + cut, nm - cut, s->load_s,
                                                s->expert_s, t_cpu,
                                                (tc > tg ? tc : tg) - s->load_s * cut);
        s->hy_cut = cut, s->hy_ncpu = nm - cut;
        s->hy_base = base;
        s->r->missing += nm;
        s->r->hybrid_copied += cut;
        s->r->hybrid_cpu += nm - cut;
        for (uint32_t i = 0; i < K; i++) {
            if (s->tok_mark[ex[i]]) continue; /* on the CPU */
            if (s->pf && (rc = advance(s, s->now, err)) < 0) return rc;
            if ((rc = demand(s, base + ex[i], err)) < 0) return rc;
            (*computed)++;
        }
        return 0;
    }
    if (m && m->mode == SMOE_SIM_SUBSTITUTE) {
        memset(s->tok_mark, 0, E);
        for (uint32_t i = 0; i < K; i++) s->tok_mark[ex[i]] = 1;
    }
    for (uint32_t i = 0; i < K; i++) {
        if (s->pf && (rc = advance(s, s->now, err)) < 0) return rc;
        int32_t key = base + ex[i];
        if (m && m->mode != SMOE_SIM_FETCH && !resident(s, key)) {
            s->r->missing++;
            const int ranked = m->mode == SMOE_SIM_DROP || m->mode == SMOE_SIM_PRIORITY;
            const uint32_t rank = ranked ? routing_rank(ex, lg, K, i) : 0;
            const int low_rank = ranked && rank >= m->keep;
            if (m->mode == SMOE_SIM_LOWEST_BIT || (m->mode == SMOE_SIM_PRIORITY && low_rank)) {
                s->r->lowbit++;
                if (m->mode == SMOE_SIM_PRIORITY && rank >= m->keep2) {
                    s->r->lowbit2++;
                    (*low2)++;
                } else {
                    (*low)++;
                }
                continue;
            }
            if (m->mode == SMOE_SIM_DROP) {
                if (low_rank) {
                    s->r->dropped++;
                    continue;
                }
            } else if (m->mode == SMOE_SIM_SUBSTITUTE) {
                int32_t best = -1;
                float bd = 0.0f;
                for (uint32_t c = 0; c < E; c++) {
                    if (s->tok_mark[c] || !resident(s, base + (int32_t)c)) continue;
                    float d = lg ? fabsf(lg[c] - lg[ex[i]]) : 0.0f;
                    if (best < 0 || d < bd) best = (int32_t)c, bd = d;
                }
                if (best >= 0) {
                    s->tok_mark[best] = 1;
                    s->r->substituted++;
                    key = base + best;
                }
            }
        }
        if ((rc = demand(s, key, err)) < 0) return rc;
        (*computed)++;
    }
    return 0;
}

static int cmp_float(const void *a, const void *b) {
    float x = *(const float *)a, y = *(const float *)b;
    return (x > y) - (x < y);
}

/* Indices of the experts to fetch from scores[0..E-1], best first, into s->sel. */
static uint32_t select_experts(sim *s) {
    const smoe_sim_prefetch *pf = s->pf;
    uint32_t E = s->E, n = 0;
    float thr = 0.0f;
    uint32_t cap = pf->topk ? pf->topk : s->K;
    if (pf->percentile > 0.0) {
        /* the q-quantile: the need-th smallest score, need = floor(q*(E-1)) + 1 */
        uint32_t need = (uint32_t)floor(pf->percentile * (double)(E - 1)) + 1;
        memcpy(s->sorted, s->scores, E * sizeof *s->sorted);
        qsort(s->sorted, E, sizeof *s->sorted, cmp_float);
        thr = s->sorted[need - 1];
        cap = pf->topk ? pf->topk : E;
    }
    if (cap > E) cap = E;
    while (n < cap) {
        int32_t best = -1;
        for (uint32_t e = 0; e < E; e++)
            if (s->scores[e] > 0.0f && s->scores[e] >= thr &&
                (best < 0 || s->scores[e] > s->scores[best]))
                best = (int32_t)e;
        if (best < 0) break;
        s->selq[n] = s->scores[best];
        s->sel[n++] = (uint32_t)best;
        s->scores[best] = -1.0f;
    }
    return n;
}

static void queue_push(sim *s, int32_t key, float prob, uint32_t steps) {
    if (s->q_stamp[key] == s->issue_id || slot_of(s, key) >= 0) return;
    if (s->q_head + s->q_len >= s->q_cap) return; /* cannot happen: q_cap = depth * E */
    s->q_stamp[key] = s->issue_id;
    const uint32_t i = s->q_head + s->q_len++;
    s->q_key[i] = key;
    s->q_prob[i] = prob > 1.0f ? 1.0f : prob;
    s->q_steps[i] = steps;
}

/* Position after (t, l) by j steps in replay order; 0 when past the end. */
static int step(const sim *s, uint64_t t, uint32_t l, uint32_t j, uint64_t *tt, uint32_t *ll) {
    uint64_t p = (uint64_t)l + j;
    *tt = t + p / s->L;
    *ll = (uint32_t)(p % s->L);
    return *tt < s->tr->num_tokens;
}

/* After the demand accesses of (t, l): predict coming layers and replace the queue. */
static void predict(sim *s, uint64_t t, uint32_t l) {
    const smoe_sim_prefetch *pf = s->pf;
    uint32_t E = s->E, K = s->K;
    s->issue_id++;
    s->q_head = s->q_len = 0;
    s->q_issue = s->now;
    uint32_t depth = pf->predictor == SMOE_PRED_ROUTER ? 1 : pf->depth;
    for (uint32_t j = 1; j <= depth; j++) {
        uint64_t tt;
        uint32_t ll;
        if (!step(s, t, l, j, &tt, &ll)) break;
        const int16_t *truth = row(s, tt, ll);
        uint32_t n;
        if (pf->predictor == SMOE_PRED_ORACLE) {
            for (uint32_t i = 0; i < K; i++) s->sel[i] = (uint32_t)truth[i], s->selq[i] = 1.0f;
            n = K;
        } else if (pf->predictor == SMOE_PRED_ROUTER) {
            if (tt != t) break; /* the next token's router input is not known yet */
            const float *lg = s->tr->logits + ((size_t)tt * s->L + ll) * E;
            float mx = lg[0];
            for (uint32_t e = 1; e < E; e++) mx = lg[e] > mx ? lg[e] : mx;
            double sum = 0;
            for (uint32_t e = 0; e < E; e++) sum += (s->scores[e] = expf(lg[e] - mx));
            for (uint32_t e = 0; e < E; e++) s->scores[e] = (float)(s->scores[e] / sum);
            n = select_experts(s);
        } else if (pf->predictor == SMOE_PRED_LEARNED) {
            smoe_nextuse_layer_q(s->learner, ll, s->lq);
            for (uint32_t e = 0; e < E; e++) s->scores[e] = (float)s->lq[e];
            n = select_experts(s);
        } else { /* history */
            uint64_t win = s->tokens_seen < pf->history ? s->tokens_seen : pf->history;
            double w = pf->cooc_weight;
            const uint32_t *fr = s->freq + (size_t)ll * E;
            for (uint32_t e = 0; e < E; e++)
                s->scores[e] = win ? (float)((1.0 - w) * fr[e] / (double)win) : 0.0f;
            if (j == 1 && w > 0) {
                const int16_t *cur = row(s, t, l);
                for (uint32_t i = 0; i < K; i++) {
                    uint32_t a = (uint32_t)cur[i];
                    uint32_t c = s->cnt[(size_t)l * E + a];
                    if (!c) continue;
                    const uint32_t *co = s->cooc + ((size_t)l * E + a) * E;
                    double f = w / ((double)c * K);
                    for (uint32_t e = 0; e < E; e++) s->scores[e] += (float)(f * co[e]);
                }
            }
            n = select_experts(s);
        }
        if (j == 1) {
            s->r->predicted += n;
            s->r->next_true += K;
            for (uint32_t i = 0; i < n; i++)
                for (uint32_t q = 0; q < K; q++)
                    if ((uint32_t)truth[q] == s->sel[i]) {
                        s->r->predicted_true++;
                        break;
                    }
        }
        for (uint32_t i = 0; i < n; i++) queue_push(s, smoe_key(ll, s->sel[i], E), s->selq[i], j);
    }
}

/* History predictor learning, after the accesses of (t, l). */
static void learn(sim *s, uint64_t t, uint32_t l) {
    uint32_t E = s->E, K = s->K;
    uint64_t pt;
    uint32_t pl;
    if (l > 0) {
        pt = t;
        pl = l - 1;
    } else if (t > 0) {
        pt = t - 1;
        pl = s->L - 1;
    } else {
        return;
    }
    const int16_t *prev = row(s, pt, pl), *cur = row(s, t, l);
    for (uint32_t i = 0; i < K; i++) {
        uint32_t a = (uint32_t)prev[i];
        s->cnt[(size_t)pl * E + a]++;
        uint32_t *co = s->cooc + ((size_t)pl * E + a) * E;
        for (uint32_t q = 0; q < K; q++) co[cur[q]]++;
    }
}

static void learn_token(sim *s, uint64_t t) {
    uint32_t E = s->E, K = s->K;
    for (uint32_t l = 0; l < s->L; l++) {
        const int16_t *cur = row(s, t, l);
        for (uint32_t i = 0; i < K; i++) s->freq[(size_t)l * E + cur[i]]++;
        if (t >= s->pf->history) {
            const int16_t *old = row(s, t - s->pf->history, l);
            for (uint32_t i = 0; i < K; i++) s->freq[(size_t)l * E + old[i]]--;
        }
    }
    s->tokens_seen++;
}

/* on_counts with, for every layer, the number of tokens t0..t1-1 that route to each expert
 * (a token counts once per expert).  Only called for policies with on_counts. */
static void feed_counts(sim *s, uint64_t t0, uint64_t t1) {
    const uint32_t L = s->L, K = s->K, E = s->E;
    uint32_t n = 0;
    for (uint32_t l = 0; l < L; l++)
        for (uint64_t t = t0; t < t1; t++) {
            const int16_t *r = row(s, t, l);
            for (uint32_t i = 0; i < K; i++) {
                const uint32_t key = l * E + (uint32_t)r[i];
                if (s->cstamp[key] == t + 1) continue;
                s->cstamp[key] = t + 1;
                if (s->ccnt[key]++ == 0) s->ckeys[n++] = (int32_t)key;
            }
        }
    for (uint32_t i = 0; i < n; i++) {
        s->cvals[i] = s->ccnt[s->ckeys[i]];
        s->ccnt[s->ckeys[i]] = 0;
    }
    smoe_policy_counts(s->pol, s->ckeys, s->cvals, n);
}

/* The lookahead shield (sim.h): protect the experts tokens t0..t1-1 route to in layers
 * l0..L-1 (none when l0 == L: the set is cleared). */
static int protect_rest(sim *s, uint64_t t0, uint64_t t1, uint32_t l0, smoe_err *err) {
    const uint32_t K = s->K, E = s->E;
    uint32_t n = 0;
    s->pstamp_id++;
    for (uint32_t l = l0; l < s->L; l++)
        for (uint64_t t = t0; t < t1; t++) {
            const int16_t *r = row(s, t, l);
            for (uint32_t i = 0; i < K; i++) {
                const uint32_t key = l * E + (uint32_t)r[i];
                if (s->pstamp[key] == s->pstamp_id) continue;
                s->pstamp[key] = s->pstamp_id;
                s->pkeys[n++] = (int32_t)key;
            }
        }
    return smoe_slots_set_protected(&s->tab, s->pkeys, n, err);
}

/* Replay with verification groups of g = tr->verify_tokens tokens per pass (sim.h; also the
 * one-token passes of a replay with the lookahead shield); demand only (check_args rejects
 * predictors and miss rules). */
static int run_groups(sim *s, smoe_err *err) {
    const smoe_sim_trace *tr = s->tr;
    const smoe_sim_hw *hw = s->hw;
    const uint32_t g = tr->verify_tokens > 1 ? tr->verify_tokens : 1, L = s->L, K = s->K,
                   E = s->E;
    const int feed = s->pol->ops->on_counts != NULL;
    int rc = 0;
    for (uint64_t t0 = 0; t0 < tr->num_tokens && rc == 0; t0 += g) {
        const uint64_t t1 = t0 + g < tr->num_tokens ? t0 + g : tr->num_tokens;
        smoe_slots_set_pass(&s->tab, s->tab.pass_id + 1);
        if (feed) feed_counts(s, t0, t1);
        if (tr->protect && (rc = protect_rest(s, t0, t1, 0, err)) < 0) break;
        s->now += hw->token_fixed_s;
        s->r->compute_s += hw->token_fixed_s;
        for (uint32_t l = 0; l < L && rc == 0; l++) {
            s->now += hw->layer_fixed_s;
            uint32_t distinct = 0;
            for (uint64_t t = t0; t < t1 && rc == 0; t++) {
                const int16_t *r = row(s, t, l);
                for (uint32_t i = 0; i < K; i++) {
                    const uint32_t key = l * E + (uint32_t)r[i];
                    if (s->seen[key] == s->tab.pass_id) continue;
                    s->seen[key] = s->tab.pass_id;
                    distinct++;
                    if ((rc = demand(s, (int32_t)key, err)) < 0) break;
                }
            }
            s->now += distinct * s->expert_s;
            s->r->compute_s += hw->layer_fixed_s + distinct * s->expert_s;
            if (rc == 0 && tr->protect) rc = protect_rest(s, t0, t1, l + 1, err);
        }
        if (rc == 0 && s->pol->failure.code) {
            *err = s->pol->failure;
            err->code = SMOE_EPOLICY;
            rc = SMOE_EPOLICY;
        }
    }
    return rc;
}

static void sim_free(sim *s) {
    if (s->tab_ready) {
        s->tab.policy = NULL; /* borrowed: the caller's */
        smoe_slots_free(&s->tab);
    }
    free(s->q_key);
    free(s->q_prob);
    free(s->q_steps);
    free(s->selq);
    free(s->q_stamp);
    free(s->scores);
    free(s->sorted);
    free(s->sel);
    free(s->freq);
    free(s->cooc);
    free(s->cnt);
    smoe_policy_destroy(s->learner);
    free(s->lq);
    free(s->cstamp);
    free(s->ccnt);
    free(s->ckeys);
    free(s->cvals);
    free(s->seen);
    free(s->pkeys);
    free(s->pstamp);
    free(s->tok_mark);
    free(s->hy_miss);
    free(s->hy_cnt);
}

static int check_args(const smoe_sim_trace *tr, smoe_policy *pol, uint32_t nslots,
                      const smoe_sim_prefetch *pf, const smoe_sim_hw *hw,
                      const smoe_sim_miss *miss, smoe_err *err) {
    if (!tr || !tr->experts || !pol || !hw)
        return smoe_err_set(err, SMOE_EINVAL, "simulate: trace, policy and hardware are required");
    if (tr->num_layers == 0 || tr->top_k == 0 || tr->num_experts == 0 ||
        tr->top_k > tr->num_experts || tr->num_experts > 32768 ||
        (uint64_t)tr->num_layers * tr->num_experts > INT32_MAX)
        return smoe_err_set(err, SMOE_EINVAL, "simulate: bad trace shape: %u layers, top_k %u, "
                            "%u experts", tr->num_layers, tr->top_k, tr->num_experts);
    if (nslots == 0)
        return smoe_err_set(err, SMOE_EINVAL, "simulate: capacity must be at least 1 slot");
    if (pol->nslots != nslots || pol->num_layers != tr->num_layers ||
        pol->num_experts != tr->num_experts)
        return smoe_err_set(err, SMOE_EINVAL, "simulate: policy %s was built for %u slots, %u "
                            "layers, %u experts; the run has %u, %u, %u", pol->ops->name,
                            pol->nslots, pol->num_layers, pol->num_experts, nslots,
                            tr->num_layers, tr->num_experts);
    const double v[6] = {hw->expert_bytes, hw->fast_bw, hw->link_bw, hw->link_latency_s,
                         hw->layer_fixed_s, hw->token_fixed_s};
    const char *names[6] = {"expert_bytes", "fast_bw", "link_bw", "link_latency_s",
                            "layer_fixed_s", "token_fixed_s"};
    for (int i = 0; i < 6; i++)
        if (!isfinite(v[i]) || v[i] < 0 || (i < 3 && v[i] <= 0))
            return smoe_err_set(err, SMOE_EINVAL, "simulate: hardware %s must be %s, got %g",
                                names[i], i < 3 ? "positive" : "non-negative", v[i]);
    if (tr->verify_tokens > 1 && miss && miss->mode != SMOE_SIM_FETCH)
        return smoe_err_set(err, SMOE_EINVAL, "simulate: miss handling other than fetch "
                            "replays one token per pass; verify_tokens = %u needs miss fetch",
                            tr->verify_tokens);
    if (miss && (miss->mode < SMOE_SIM_FETCH || miss->mode > SMOE_SIM_HYBRID ||
                 miss->keep > tr->top_k ||
                 !(miss->lowbit_ratio > 0.0 && miss->lowbit_ratio <= 1.0)))
        return smoe_err_set(err, SMOE_EINVAL, "simulate: miss mode %d must be 0..5, keep %u "
                            "at most top_k %u, lowbit_ratio %g in (0, 1]", (int)miss->mode,
                            miss->keep, tr->top_k, miss->lowbit_ratio);
    if (miss && miss->mode == SMOE_SIM_HYBRID &&
        !(isfinite(miss->cpu_expert_s) && miss->cpu_expert_s > 0.0))
        return smoe_err_set(err, SMOE_EINVAL, "simulate: the hybrid tier needs the CPU's time "
                            "per expert and token (cpu_expert_s) > 0, got %g",
                            miss->cpu_expert_s);
    if (miss && (miss->keep2 < miss->keep ||
                 (miss->keep2 < tr->top_k &&
                  !(miss->lowbit2_ratio > 0.0 && miss->lowbit2_ratio <= 1.0))))
        return smoe_err_set(err, SMOE_EINVAL, "simulate: miss keep2 %u must be >= keep %u, "
                            "and lowbit2_ratio %g in (0, 1] when keep2 < top_k %u",
                            miss->keep2, miss->keep, miss->lowbit2_ratio, tr->top_k);
    if (tr->protect > 1)
        return smoe_err_set(err, SMOE_EINVAL, "simulate: protect must be 0 or 1, got %u",
                            tr->protect);
    if (tr->protect && ((pf && pf->predictor != SMOE_PRED_NONE) ||
                        (miss && miss->mode != SMOE_SIM_FETCH)))
        return smoe_err_set(err, SMOE_EINVAL, "simulate: the lookahead shield (protect) replays "
                            "demand only: it needs predictor none and miss fetch");
    if (tr->verify_tokens > 1 && pf && pf->predictor != SMOE_PRED_NONE)
        return smoe_err_set(err, SMOE_EINVAL, "simulate: prefetch predictors replay one token "
                            "per pass; verify_tokens = %u needs predictor none",
                            tr->verify_tokens);
    if (pf && pf->predictor != SMOE_PRED_NONE) {
        if (pf->predictor < SMOE_PRED_NONE || pf->predictor > SMOE_PRED_LEARNED)
            return smoe_err_set(err, SMOE_EINVAL, "simulate: unknown predictor %d",
                                (int)pf->predictor);
        if (pf->predictor == SMOE_PRED_ROUTER && !tr->logits)
            return smoe_err_set(err, SMOE_EINVAL, "simulate: the router predictor needs router "
                                "logits and this trace has none");
        if (pf->depth < 1 || pf->depth > 4096)
            return smoe_err_set(err, SMOE_EINVAL, "simulate: prefetch depth must be in 1..4096, "
                                "got %u", pf->depth);
        if (!(pf->percentile >= 0.0 && pf->percentile < 1.0))
            return smoe_err_set(err, SMOE_EINVAL, "simulate: prefetch percentile must be in "
                                "[0, 1), got %g", pf->percentile);
        if (pf->topk > tr->num_experts)
            return smoe_err_set(err, SMOE_EINVAL, "simulate: prefetch topk %u exceeds %u experts",
                                pf->topk, tr->num_experts);
        if (pf->predictor == SMOE_PRED_HISTORY &&
            (pf->history < 1 || !(pf->cooc_weight >= 0.0 && pf->cooc_weight <= 1.0)))
            return smoe_err_set(err, SMOE_EINVAL, "simulate: history predictor needs history >= "
                                "1 and cooc_weight in [0, 1], got %u and %g", pf->history,
                                pf->cooc_weight);
    }
    if (tr->prior_rows) {
        if (!tr->prior_table)
            return smoe_err_set(err, SMOE_EINVAL, "simulate: prior rows without a prior table");
        for (uint64_t t = 0; t < tr->num_tokens; t++)
            if (tr->prior_rows[t] >= 0 && (uint64_t)tr->prior_rows[t] >= tr->prior_n)
                return smoe_err_set(err, SMOE_EINVAL, "simulate: prior row %d of token %" PRIu64
                                    " is outside the table's %" PRIu64 " rows",
                                    (int)tr->prior_rows[t], t, tr->prior_n);
    }
    /* validate ids once so the hot loop can trust them */
    size_t n = (size_t)tr->num_tokens * tr->num_layers * tr->top_k;
    for (size_t i = 0; i < n; i++)
        if (tr->experts[i] < 0 || (uint32_t)tr->experts[i] >= tr->num_experts) {
            size_t per = (size_t)tr->num_layers * tr->top_k;
            return smoe_err_set(err, SMOE_EINVAL, "simulate: expert id %d at token %zu, layer "
                                "position %zu is outside 0..%u", (int)tr->experts[i], i / per,
                                (i % per) / tr->top_k, tr->num_experts - 1);
        }
    return 0;
}

int smoe_sim_run(const smoe_sim_trace *tr, smoe_policy *pol, uint32_t nslots,
                 const smoe_sim_prefetch *pf, const smoe_sim_hw *hw, smoe_sim_result *out,
                 smoe_err *err) {
    return smoe_sim_run_miss(tr, pol, nslots, pf, hw, NULL, out, err);
}

int smoe_sim_run_miss(const smoe_sim_trace *tr, smoe_policy *pol, uint32_t nslots,
                      const smoe_sim_prefetch *pf, const smoe_sim_hw *hw,
                      const smoe_sim_miss *miss, smoe_sim_result *out, smoe_err *err) {
    memset(out, 0, sizeof *out);
    int rc = check_args(tr, pol, nslots, pf, hw, miss, err);
    if (rc < 0) return rc;
    double t0 = smoe_now();
    sim s;
    memset(&s, 0, sizeof s);
    s.tr = tr;
    s.hw = hw;
    s.pf = (pf && pf->predictor != SMOE_PRED_NONE) ? pf : NULL;
    s.pol = pol;
    s.r = out;
    s.nslots = nslots;
    s.L = tr->num_layers;
    s.K = tr->top_k;
    s.E = tr->num_experts;
    s.nkeys = s.L * s.E;
    s.inflight = -1;
    s.load_s = hw->link_latency_s + hw->expert_bytes / hw->link_bw;
    s.expert_s = hw->expert_bytes / hw->fast_bw;
    /* slot_bytes only feeds the table's bytes_read statistic here */
    const double eb = hw->expert_bytes;
    rc = smoe_slots_init(&s.tab, "simulated cache", s.L, s.E,
                         eb >= 1.0 && eb < 1e18 ? (uint64_t)eb : 1, nslots, 0, pol, &sim_ops, &s,
                         err);
    if (rc < 0) return rc;
    s.tab_ready = 1;
    s.miss = (miss && miss->mode != SMOE_SIM_FETCH) ? miss : NULL;
    const int hybrid = s.miss && s.miss->mode == SMOE_SIM_HYBRID;
    s.tok_mark = malloc(s.E);
    s.hy_miss = malloc(s.K * sizeof *s.hy_miss);
    s.hy_cnt = malloc(s.K * sizeof *s.hy_cnt);
    int ok = s.tok_mark && s.hy_miss && s.hy_cnt;
    for (uint32_t i = 0; ok && i < s.K; i++) s.hy_cnt[i] = 1; /* one token per pass */
    if (ok && s.pf) {
        /* the predictions' depth * E requests, and the hybrid tier's admissions (K) */
        s.q_cap = s.pf->depth * s.E + (hybrid ? s.K : 0);
        s.q_key = malloc(s.q_cap * sizeof *s.q_key);
        s.q_prob = malloc(s.q_cap * sizeof *s.q_prob);
        s.q_steps = malloc(s.q_cap * sizeof *s.q_steps);
        s.selq = malloc(s.E * sizeof *s.selq);
        s.q_stamp = calloc(s.nkeys, sizeof *s.q_stamp);
        s.scores = malloc(s.E * sizeof *s.scores);
        s.sorted = malloc(s.E * sizeof *s.sorted);
        s.sel = malloc(s.E * sizeof *s.sel);
        ok = s.q_key && s.q_prob && s.q_steps && s.selq && s.q_stamp && s.scores && s.sorted &&
             s.sel;
        if (ok && s.pf->predictor == SMOE_PRED_HISTORY) {
            s.freq = calloc(s.nkeys, sizeof *s.freq);
            s.cnt = calloc(s.nkeys, sizeof *s.cnt);
            s.cooc = calloc((size_t)s.nkeys * s.E, sizeof *s.cooc);
            ok = s.freq && s.cnt && s.cooc;
        }
        if (ok && s.pf->predictor == SMOE_PRED_LEARNED) {
            s.lq = malloc(s.E * sizeof *s.lq);
            ok = s.lq != NULL;
            smoe_policy_params lp = {.nslots = 1, .num_layers = s.L, .num_experts = s.E,
                                     .model = s.pf->model, .model_len = s.pf->model_len};
            if (ok && (rc = smoe_policy_create(&s.learner, &smoe_policy_nextuse, &lp, err)) < 0) {
                sim_free(&s);
                return rc; /* a bad model, named by the policy */
            }
        }
    }
    const int feed = pol->ops->on_counts != NULL;
    const int groups = tr->verify_tokens > 1 || tr->protect;
    if (ok && tr->protect) {
        s.pkeys = malloc(s.nkeys * sizeof *s.pkeys);
        s.pstamp = calloc(s.nkeys, sizeof *s.pstamp);
        ok = s.pkeys && s.pstamp;
    }
    if (ok && (feed || groups)) {
        s.cstamp = calloc(s.nkeys, sizeof *s.cstamp);
        s.ccnt = calloc(s.nkeys, sizeof *s.ccnt);
        s.ckeys = malloc(s.nkeys * sizeof *s.ckeys);
        s.cvals = malloc(s.nkeys * sizeof *s.cvals);
        s.seen = calloc(s.nkeys, sizeof *s.seen);
        ok = s.cstamp && s.ccnt && s.ckeys && s.cvals && s.seen;
    }
    if (!ok) {
        sim_free(&s);
        return smoe_err_set(err, SMOE_ENOMEM, "simulate: out of memory for %u slots", nslots);
    }
    s.tab.pass_id = 0; /* passes are numbered from 1 by the replay (smoe_slots_set_pass) */
    s.tab.admit.on = s.pf && s.pf->admission;
    if (s.pf && s.pf->admission == 2) s.tab.admit.budget = 0.0; /* the time-only rule */
    s.tab.admit.contention = 0.0; /* a demand load pre-empts the copy engine (sim.h) */
    s.tab.admit.measure = 0;

    const int hist = s.pf && s.pf->predictor == SMOE_PRED_HISTORY;
    smoe_policy *learner = s.learner;
    const double low_s = s.expert_s * (miss ? miss->lowbit_ratio : 1.0);
    const double low2_s = s.expert_s * (miss ? miss->lowbit2_ratio : 1.0);
    const int16_t *ex = tr->experts;
    rc = 0;
    if (groups) rc = run_groups(&s, err);
    for (uint64_t t = 0; !groups && t < tr->num_tokens && rc == 0; t++) {
        if (s.pf && (rc = advance(&s, s.now, err)) < 0) break;
        smoe_slots_set_pass(&s.tab, t + 1);
        smoe_admit_pass(&s.tab.admit, s.now);
        if (learner) smoe_policy_pass(learner, t + 1);
        if (tr->prior_rows) { /* what the token tells before its layers run */
            const int32_t r = tr->prior_rows[t];
            const float *pr = r >= 0 ? tr->prior_table + (size_t)r * s.L * s.E : NULL;
            smoe_slots_set_prior(&s.tab, pr);
            if (learner) smoe_policy_prior(learner, pr);
        }
        if (feed) feed_counts(&s, t, t + 1);
        s.now += hw->token_fixed_s;
        out->compute_s += hw->token_fixed_s;
        for (uint32_t l = 0; l < s.L; l++, ex += s.K) {
            s.now += hw->layer_fixed_s;
            const double l0 = s.now; /* the hybrid tier's CPU part starts here */
            uint32_t full = 0, low = 0, low2 = 0;
            if ((rc = layer_accesses(&s, t, l, ex, &full, &low, &low2, err)) < 0) break;
            if (s.pf) {
                if (hist) learn(&s, t, l);
                if (learner) /* the token's routing at this layer, as the router chose it */
                    for (uint32_t i = 0; i < s.K; i++)
                        smoe_policy_access(learner, 0, (int32_t)(l * s.E + (uint32_t)ex[i]));
                predict(&s, t, l);
            }
            if (hybrid && s.pf) { /* admission: the hottest of the CPU's, after predictions,
                                   * where the live layer ranks them (layer.c hybrid_cpu) */
                for (uint32_t i = s.hy_cut; i < s.hy_cut + s.hy_nadmit; i++)
                    queue_push(&s, s.hy_base + (int32_t)s.hy_miss[i], 1.0f, 1);
                out->hybrid_admitted += s.hy_nadmit;
            }
            const double c = full * s.expert_s + low * low_s + low2 * low2_s;
            s.now += c;
            if (hybrid && s.hy_ncpu) { /* the layer ends when the CPU's part does */
                const double cpu_end = l0 + miss->cpu_expert_s * s.hy_ncpu;
                if (cpu_end > s.now) {
                    out->hybrid_cpu_wait_s += cpu_end - s.now;
                    s.now = cpu_end;
                }
            }
            out->compute_s += hw->layer_fixed_s + c;
        }
        if (rc == 0 && hist) learn_token(&s, t);
        if (rc == 0 && pol->failure.code) {
            *err = pol->failure;
            err->code = SMOE_EPOLICY;
            rc = SMOE_EPOLICY;
        }
    }
    if (rc == 0 && pol->failure.code) {
        *err = pol->failure;
        err->code = SMOE_EPOLICY;
        rc = SMOE_EPOLICY;
    }
    /* what the table counts itself, by the same rules as the live cache */
    out->evictions = s.tab.stats.evictions;
    out->collision_misses = s.tab.stats.collision_misses;
    out->prefetch_used = s.tab.stats.prefetch_used;
    out->prefetch_wasted = s.tab.stats.prefetch_wasted;
    out->prefetch_dropped += s.tab.stats.prefetch_dropped;
    out->prefetch_refused = s.tab.stats.prefetch_refused;
    out->protected_evictions = s.tab.stats.protected_evictions;
    out->total_s = s.now;
    out->elapsed_s = smoe_now() - t0;
    sim_free(&s);
    return rc;
}

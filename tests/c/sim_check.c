/* Memory-safety sweep of the simulator (csrc/sim.c) under AddressSanitizer+UBSan, without
 * Python: a random trace replayed through every built-in policy at many capacities, with
 * every predictor, selection mode and two hardware balances (late and timely prefetches), with
 * the lookahead shield, as the hybrid tier, and with token priors for nextuse and the learned
 * predictor.
 * Checks counters add up and that a replay is deterministic. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "policy/policy.h"
#include "sim.h"

static int run_miss(const smoe_sim_trace *tr, const char *name, uint32_t ns, const int32_t *fut,
                    uint64_t nfut, const smoe_sim_prefetch *pf, const smoe_sim_hw *hw,
                    const smoe_sim_miss *miss, smoe_sim_result *r) {
    smoe_policy_params pp = {.nslots = ns, .num_layers = tr->num_layers,
                             .num_experts = tr->num_experts, .seed = 3, .order = (int32_t)(ns % 3),
                             .future = fut, .future_len = nfut};
    smoe_policy *p;
    smoe_err err;
    if (smoe_policy_create(&p, smoe_policy_find(name), &pp, &err) < 0) {
        fprintf(stderr, "create %s: %s\n", name, err.msg);
        return -1;
    }
    int rc = smoe_sim_run_miss(tr, p, ns, pf, hw, miss, r, &err);
    smoe_policy_destroy(p);
    if (rc < 0) fprintf(stderr, "%s nslots=%u predictor=%d: %s\n", name, ns, pf->predictor, err.msg);
    return rc;
}

static int run(const smoe_sim_trace *tr, const char *name, uint32_t ns, const int32_t *fut,
               uint64_t nfut, const smoe_sim_prefetch *pf, const smoe_sim_hw *hw,
               smoe_sim_result *r) {
    return run_miss(tr, name, ns, fut, nfut, pf, hw, NULL, r);
}

int main(void) {
    const char *names[] = {"lru", "lfu", "fifo", "mru", "random", "least_stale", "belady"};
    const uint32_t N = 300, L = 5, K = 3, E = 12;
    int16_t *ex = malloc((size_t)N * L * K * sizeof *ex);
    float *lg = malloc((size_t)N * L * E * sizeof *lg);
    int32_t *fut = malloc((size_t)N * L * K * sizeof *fut);
    if (!ex || !lg || !fut) return 1;
    uint64_t s = 12345;
    for (uint32_t i = 0; i < N * L; i++) {
        int used[64] = {0};
        for (uint32_t k = 0; k < K; k++) {
            int e;
            do {
                s = s * 6364136223846793005ull + 1442695040888963407ull;
                e = (int)((s >> 33) % E);
            } while (used[e]);
            used[e] = 1;
            ex[i * K + k] = (int16_t)e;
        }
    }
    for (size_t i = 0; i < (size_t)N * L * E; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        lg[i] = (float)(s >> 40) / (float)(1 << 24);
    }
    for (uint32_t i = 0; i < N * L * K; i++) fut[i] = (int32_t)(((i / K) % L) * E) + ex[i];
    smoe_sim_trace tr = {ex, lg, N, L, K, E, 1, 0, NULL, NULL, 0};
    smoe_sim_hw hws[2] = {{17e6, 1e12, 25e9, 1e-5, 5e-5, 4e-4}, {17e6, 2e11, 4e12, 1e-6, 0, 0}};
    int runs = 0;
    for (int pi = 0; pi < 7; pi++)
        for (uint32_t ns = 1; ns <= L * E; ns += 7)
            for (int pr = 0; pr < 5; pr++) /* none, oracle, router, history, learned */
                for (int h = 0; h < 2; h++) {
                    /* learned: the built-in temporal model; admission on every other run */
                    smoe_sim_prefetch pf = {pr, 1 + ns % 3, ns % 5, (ns % 2) ? 0.8 : 0.0, 4, 0.8,
                                            NULL, 0, (int32_t)((ns / 7 + (uint32_t)h) % 2)};
                    smoe_sim_result a, b;
                    if (run(&tr, names[pi], ns, fut, N * L * K, &pf, &hws[h], &a) < 0 ||
                        run(&tr, names[pi], ns, fut, N * L * K, &pf, &hws[h], &b) < 0)
                        return 1;
                    if (a.hits + a.misses != a.accesses || a.accesses != (uint64_t)N * L * K ||
                        a.collision_misses > a.misses || a.prefetch_used > a.prefetch_issued ||
                        a.hits != b.hits || a.total_s != b.total_s || a.stall_s < 0 ||
                        a.prefetch_refused != b.prefetch_refused ||
                        (!pf.admission && a.prefetch_refused != 0)) {
                        fprintf(stderr, "%s nslots=%u predictor=%d: inconsistent counters\n",
                                names[pi], ns, pr);
                        return 1;
                    }
                    runs++;
                }
    /* the lookahead shield (demand only) in one-token and three-token passes */
    smoe_sim_prefetch none = {0, 1, 0, 0.0, 4, 0.8, NULL, 0, 0};
    for (int pi = 0; pi < 7; pi++)
        for (uint32_t ns = 1; ns <= L * E; ns += 5)
            for (uint32_t g = 1; g <= 3; g += 2) {
                smoe_sim_trace tp = tr;
                tp.protect = 1;
                tp.verify_tokens = g;
                smoe_sim_result a, b;
                if (run(&tp, names[pi], ns, fut, N * L * K, &none, &hws[0], &a) < 0 ||
                    run(&tp, names[pi], ns, fut, N * L * K, &none, &hws[0], &b) < 0)
                    return 1;
                if (a.hits + a.misses != a.accesses || a.protected_evictions > a.evictions ||
                    a.hits != b.hits || a.protected_evictions != b.protected_evictions ||
                    (g == 1 && a.accesses != (uint64_t)N * L * K) ||
                    (ns < K && a.misses != a.accesses)) {
                    fprintf(stderr, "%s nslots=%u g=%u protect: inconsistent counters\n",
                            names[pi], ns, g);
                    return 1;
                }
                runs++;
            }
    /* the hybrid tier: missing experts split between copies and the CPU, a CPU faster and
     * slower than the link, with and without a predictor (admissions through its queue) */
    for (int pi = 0; pi < 7; pi++)
        for (uint32_t ns = 1; ns <= L * E; ns += 9)
            for (int pr = 0; pr < 4; pr += 3) /* none, history */
                for (int c = 0; c < 2; c++) {
                    smoe_sim_prefetch pf = {pr, 2, 0, 0.0, 4, 0.8, NULL, 0, 0};
                    smoe_sim_miss hy = {SMOE_SIM_HYBRID, 0, 1.0, K, 1.0, c ? 2e-3 : 2e-5};
                    smoe_sim_result a, b;
                    if (run_miss(&tr, names[pi], ns, fut, N * L * K, &pf, &hws[0], &hy, &a) < 0 ||
                        run_miss(&tr, names[pi], ns, fut, N * L * K, &pf, &hws[0], &hy, &b) < 0)
                        return 1;
                    if (a.hits + a.misses != a.accesses ||
                        a.hybrid_copied + a.hybrid_cpu != a.missing ||
                        a.accesses + a.hybrid_cpu != (uint64_t)N * L * K ||
                        a.hits != b.hits || a.total_s != b.total_s ||
                        (pr == 0 && a.hybrid_admitted != 0) || a.hybrid_cpu_wait_s < 0) {
                        fprintf(stderr, "%s nslots=%u predictor=%d hybrid: inconsistent "
                                "counters\n", names[pi], ns, pr);
                        return 1;
                    }
                    runs++;
                }
    /* token priors (policy.h on_prior): a format-2 nextuse model with token weights as the
     * cache's policy and the learned predictor's, three prior rows and unknown tokens */
    {
        double model[21] = {2, -1, 0.5, 0.8, 3, -0.3, 1, -2, 0.5, 0.8, 3, -0.3,
                            1.0 / 8, 1.0 / 64, 1, 1, 0, 0.2, 0.7, -0.1, 0.9};
        float *ptab = malloc((size_t)3 * L * E * sizeof *ptab);
        int32_t *prow = malloc((size_t)N * sizeof *prow);
        if (!ptab || !prow) return 1;
        for (size_t i = 0; i < (size_t)3 * L * E; i++) {
            s = s * 6364136223846793005ull + 1442695040888963407ull;
            ptab[i] = (float)((double)(s >> 40) / (double)(1 << 24) * 4.0 - 2.0);
        }
        for (uint32_t t = 0; t < N; t++) prow[t] = (int32_t)(t % 4) - 1;
        smoe_sim_trace tp = tr;
        tp.prior_table = ptab;
        tp.prior_rows = prow;
        tp.prior_n = 3;
        for (uint32_t ns = 1; ns <= L * E; ns += 6)
            for (int adm = 0; adm < 2; adm++) {
                smoe_sim_prefetch pf = {SMOE_PRED_LEARNED, 2, 0, 0.0, 4, 0.8, model, 21, adm};
                smoe_policy_params pp = {.nslots = ns, .num_layers = L, .num_experts = E,
                                         .model = model, .model_len = 21};
                smoe_sim_result a[2];
                for (int rep = 0; rep < 2; rep++) {
                    smoe_policy *p;
                    smoe_err err;
                    if (smoe_policy_create(&p, smoe_policy_find("nextuse"), &pp, &err) < 0 ||
                        smoe_sim_run(&tp, p, ns, &pf, &hws[0], &a[rep], &err) < 0) {
                        fprintf(stderr, "nextuse + priors nslots=%u: %s\n", ns, err.msg);
                        return 1;
                    }
                    smoe_policy_destroy(p);
                }
                if (a[0].hits + a[0].misses != a[0].accesses || a[0].hits != a[1].hits ||
                    a[0].total_s != a[1].total_s || a[0].predicted_true != a[1].predicted_true) {
                    fprintf(stderr, "nextuse + priors nslots=%u: inconsistent counters\n", ns);
                    return 1;
                }
                runs++;
            }
        free(ptab);
        free(prow);
    }
    printf("sim_check: %d runs ok\n", runs);
    free(ex);
    free(lg);
    free(fut);
    return 0;
}

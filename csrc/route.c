/* The routing rules shared by every tier (declared in route.h). */
#include "route.h"

#include <math.h>
#include <string.h>

void smoe_route_scores(float *s, uint32_t T, uint32_t E, int sigmoid, const float *corr) {
    if (!corr) return;
    for (uint32_t t = 0; t < T; t++, s += E) {
        if (sigmoid) {
            for (uint32_t e = 0; e < E; e++) s[e] = 1.0f / (1.0f + expf(-s[e])) + corr[e];
        } else {
            float mx = s[0], sum = 0.0f;
            for (uint32_t e = 1; e < E; e++) mx = s[e] > mx ? s[e] : mx;
            for (uint32_t e = 0; e < E; e++) sum += (s[e] = expf(s[e] - mx));
            for (uint32_t e = 0; e < E; e++) s[e] = s[e] / sum + corr[e];
        }
    }
}

void smoe_route_topk(const float *v, uint32_t E, uint32_t k, int32_t *order) {
    uint32_t n = 0; /* order[0..n) sorted as smoe_route_rank sorts them */
    for (uint32_t i = 0; i < E; i++) {
        const int32_t e = (int32_t)i;
        if (n == k && !(v[order[k - 1]] < v[e])) continue; /* (an equal v: the lower id won) */
        uint32_t j = n < k ? n++ : k - 1;
        while (j > 0 && v[order[j - 1]] < v[e]) {
            order[j] = order[j - 1];
            j--;
        }
        order[j] = e;
    }
}

void smoe_route_group_limit(float *v, uint32_t E, uint32_t n_group, uint32_t topk_group,
                            float *gs) {
    const uint32_t size = E / n_group;
    for (uint32_t gi = 0; gi < n_group; gi++) { /* the two largest of the group, summed */
        const float *vg = v + (size_t)gi * size;
        float a = vg[0], b = vg[1];
        if (b > a) a = vg[1], b = vg[0];
        for (uint32_t i = 2; i < size; i++) {
            if (vg[i] > a) b = a, a = vg[i];
            else if (vg[i] > b) b = vg[i];
        }
        gs[gi] = a + b;
    }
    for (uint32_t gi = 0; gi < n_group; gi++) { /* rank of group gi among the groups */
        uint32_t above = 0;
        for (uint32_t o = 0; o < n_group; o++)
            above += gs[o] > gs[gi] || (gs[o] == gs[gi] && o < gi);
        if (above >= topk_group)
            for (uint32_t i = 0; i < size; i++) v[(size_t)gi * size + i] = -INFINITY;
    }
}

/* Insertion sort: E is small and callers need only the first few, but a full order keeps the
 * rule obvious. */
void smoe_route_rank(const float *v, uint32_t E, int32_t *order) {
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

void smoe_route_predict(const float *scores, uint32_t T, uint32_t E, uint32_t k, double overfetch,
                        double mass, const uint8_t *skip, uint8_t *mark, float *best,
                        int32_t *order, float *prob) {
    memset(mark, 0, E);
    for (uint32_t e = 0; e < E; e++) best[e] = -INFINITY;
    uint32_t m = (uint32_t)ceil((double)k * overfetch - 1e-9);
    if (m < k) m = k;
    if (m > E) m = E;
    for (uint32_t t = 0; t < T; t++) {
        if (skip && skip[t]) continue;
        const float *s = scores + (size_t)t * E;
        if (mass <= 0.0) {
            smoe_route_rank(s, E, order);
            for (uint32_t r = 0; r < m; r++) {
                int32_t e = order[r];
                mark[e] = 1;
                if (s[e] > best[e]) best[e] = s[e];
            }
        } else {
            float mx = s[0], sum = 0.0f;
            for (uint32_t e = 1; e < E; e++) mx = s[e] > mx ? s[e] : mx;
            for (uint32_t e = 0; e < E; e++) sum += (prob[e] = expf(s[e] - mx));
            for (uint32_t e = 0; e < E; e++) prob[e] /= sum;
            smoe_route_rank(prob, E, order);
            double before = 0.0; /* probability mass of the experts ranked above */
            for (uint32_t r = 0; r < E; r++) {
                int32_t e = order[r];
                if (r >= k && before >= mass) break;
                mark[e] = 1;
                if (prob[e] > best[e]) best[e] = prob[e];
                before += prob[e];
            }
        }
    }
}

uint32_t smoe_route_balance_cut(const uint32_t *counts, uint32_t m, uint32_t on_fast,
                                double t_io, double t_gpu, double t_cpu) {
    double tail = 0.0; /* sum(counts[n:]) for the current n */
    for (uint32_t i = 0; i < m; i++) tail += counts[i];
    uint32_t best_n = 0;
    double best = 0.0;
    for (uint32_t n = 0; n <= m; n++) {
        if (n) tail -= counts[n - 1];
        const double diff = fabs(t_cpu * tail - (t_io * n + t_gpu * ((double)on_fast + n)));
        if (n == 0 || diff < best) best_n = n, best = diff;
    }
    return best_n;
}

uint32_t smoe_route_balance_admit(const uint32_t *counts, uint32_t m, double t_io,
                                  double t_gpu, double t_cpu, double window) {
    uint32_t n = 0;
    while (n < m && t_cpu * counts[n] > t_gpu) n++;
    if (t_io > 0.0) {
        const double fit = window > 0.0 ? floor(window / t_io) : 0.0;
        if (fit < (double)n) n = (uint32_t)fit;
    }
    return n;
}

/* Acceptance rule of speculative decoding; the rule and every choice are in verify.h. */
#include "verify.h"

#include <float.h>
#include <math.h>

int64_t smoe_spec_argmax(const float *row, int64_t v) {
    int64_t best = 0;
    float m = row[0];
    for (int64_t j = 1; j < v; j++) {
        if (row[j] > m) { /* strict: ties keep the lowest index */
            m = row[j];
            best = j;
        }
    }
    return best;
}

/* Residual entry max(0, p - q) in double; q == NULL means one-hot at d. */
static inline double resid(const float *p, const float *q, int64_t d, int64_t j) {
    double qj = q ? (double)q[j] : (j == d ? 1.0 : 0.0);
    double r = (double)p[j] - qj;
    return r > 0.0 ? r : 0.0;
}

/* Inverse CDF over the weights w(j) = p[j] (q unused, residual 0) or the residual
 * max(0, p[j] - q[j]) (residual 1).  Returns -1 when the weights sum to 0. */
static int64_t sample_w(const float *p, const float *q, int64_t d, int residual, int64_t v,
                        double x) {
    double total = 0.0;
    if (residual) {
        for (int64_t j = 0; j < v; j++) total += resid(p, q, d, j);
    } else {
        for (int64_t j = 0; j < v; j++) total += (double)p[j];
    }
    if (!(total > 0.0)) return -1;
    double thr = x * total, c = 0.0;
    int64_t last = -1;
    for (int64_t j = 0; j < v; j++) {
        double w = residual ? resid(p, q, d, j) : (double)p[j];
        if (w > 0.0) {
            c += w;
            last = j;
            if (c > thr) return j;
        }
    }
    return last; /* only when x*total rounded up to total */
}

int64_t smoe_spec_sample(const float *row, int64_t v, double x) {
    return sample_w(row, NULL, 0, 0, v, x);
}

int smoe_spec_accept_check(const float *p, const int64_t *draft, const float *q,
                           const double *u, int32_t k, int64_t v, smoe_err *err) {
    if (k < 0) return smoe_err_set(err, SMOE_EINVAL, "spec_accept: K=%d is negative", (int)k);
    if (v < 1) return smoe_err_set(err, SMOE_EINVAL, "spec_accept: vocabulary size %lld < 1",
                                   (long long)v);
    for (int32_t a = 0; a < 2; a++) {
        const float *m = a == 0 ? p : q;
        const char *name = a == 0 ? "p" : "q";
        int64_t rows = a == 0 ? (int64_t)k + 1 : (int64_t)k;
        if (!m) continue;
        for (int64_t i = 0; i < rows; i++) {
            const float *row = m + i * v;
            double s = 0.0;
            int bad = 0;
            for (int64_t j = 0; j < v; j++) {
                float x = row[j];
                bad |= !(x >= 0.0f && x <= FLT_MAX); /* NaN, negative or inf */
                s += (double)x;
            }
            if (bad) {
                for (int64_t j = 0; j < v; j++) {
                    float x = row[j];
                    if (!(x >= 0.0f && x <= FLT_MAX))
                        return smoe_err_set(err, SMOE_EINVAL,
                                            "spec_accept: %s[%lld, %lld] = %g is not a "
                                            "probability (must be finite and >= 0)",
                                            name, (long long)i, (long long)j, (double)x);
                }
            }
            if (!(fabs(s - 1.0) <= SMOE_SPEC_SUM_TOL))
                return smoe_err_set(err, SMOE_EINVAL,
                                    "spec_accept: row %lld of %s sums to %.9g, not 1 (tolerance "
                                    "%g): pass probabilities (softmax), not logits or counts",
                                    (long long)i, name, s, SMOE_SPEC_SUM_TOL);
        }
    }
    for (int32_t i = 0; i < k; i++)
        if (draft[i] < 0 || draft[i] >= v)
            return smoe_err_set(err, SMOE_EINVAL,
                                "spec_accept: draft[%d] = %lld is outside the vocabulary [0, %lld)",
                                (int)i, (long long)draft[i], (long long)v);
    if (u) {
        for (int64_t i = 0; i < 2 * ((int64_t)k + 1); i++)
            if (!(u[i] >= 0.0 && u[i] < 1.0))
                return smoe_err_set(err, SMOE_EINVAL,
                                    "spec_accept: u[%lld, %lld] = %.17g is outside [0, 1)",
                                    (long long)(i / 2), (long long)(i % 2), u[i]);
    }
    return 0;
}

int smoe_spec_accept(const float *p, const int64_t *draft, const float *q, const double *u,
                     int32_t k, int64_t v, int32_t *n_accepted, int64_t *next_token,
                     smoe_err *err) {
    if (k < 0 || v < 1)
        return smoe_err_set(err, SMOE_EINVAL, "spec_accept: bad K=%d or V=%lld", (int)k,
                            (long long)v);
    if (!u) { /* greedy */
        int32_t n = 0;
        int64_t best = smoe_spec_argmax(p, v);
        while (n < k && draft[n] == best) {
            n++;
            best = smoe_spec_argmax(p + (int64_t)n * v, v);
        }
        *n_accepted = n;
        *next_token = best;
        return 0;
    }
    for (int32_t i = 0; i < k; i++) {
        const float *pi = p + (int64_t)i * v;
        const float *qi = q ? q + (int64_t)i * v : NULL;
        int64_t d = draft[i];
        double pd = (double)pi[d], qd = qi ? (double)qi[d] : 1.0;
        int ok = qd > 0.0 ? u[2 * i] < pd / qd : pd > 0.0;
        if (ok) continue;
        int64_t t = sample_w(pi, qi, d, 1, v, u[2 * i + 1]);
        if (t < 0) t = sample_w(pi, NULL, 0, 0, v, u[2 * i + 1]);
        if (t < 0)
            return smoe_err_set(err, SMOE_EINVAL, "spec_accept: row %d of p is all zero",
                                (int)i);
        *n_accepted = i;
        *next_token = t;
        return 0;
    }
    int64_t t = sample_w(p + (int64_t)k * v, NULL, 0, 0, v, u[2 * k + 1]);
    if (t < 0)
        return smoe_err_set(err, SMOE_EINVAL, "spec_accept: row %d of p is all zero", (int)k);
    *n_accepted = k;
    *next_token = t;
    return 0;
}

/* Acceptance rule of speculative decoding; the rule and every choice are in verify.h. */
#include "verify.h"

#include <float.h>
#include <math.h>
#include <string.h>

/* The two O(V) row scans below (argmax, check) use GCC/Clang vector extensions: 16-byte
 * vectors that every target has (SSE2 on x86-64, NEON on arm64), no ISA dispatch needed.
 * Plain loops do not vectorise here: float max/min and double sums may not be reordered
 * without -ffast-math. */
typedef float smoe_f4 __attribute__((vector_size(16)));
typedef int32_t smoe_i4 __attribute__((vector_size(16)));
typedef uint32_t smoe_u4 __attribute__((vector_size(16)));
typedef double smoe_d2 __attribute__((vector_size(16)));

static inline smoe_f4 ld4(const float *x) {
    smoe_f4 r;
    memcpy(&r, x, sizeof r); /* unaligned load */
    return r;
}

int64_t smoe_spec_argmax(const float *row, int64_t v) {
    float m = -INFINITY;
    int64_t j = 0;
    if (v >= 16) {
        smoe_f4 mx[4];
        for (int l = 0; l < 4; l++) mx[l] = ld4(row + 4 * l);
        for (j = 16; j + 16 <= v; j += 16)
            for (int l = 0; l < 4; l++) {
                smoe_f4 x = ld4(row + j + 4 * l);
                smoe_i4 gt = x > mx[l]; /* all ones where x wins; NaN never wins */
                mx[l] = (smoe_f4)(((smoe_i4)x & gt) | ((smoe_i4)mx[l] & ~gt));
            }
        for (int l = 0; l < 4; l++)
            for (int e = 0; e < 4; e++) m = mx[l][e] > m ? mx[l][e] : m;
    }
    for (; j < v; j++) m = row[j] > m ? row[j] : m;
    for (j = 0; j < v; j++) /* the lowest index holding the maximum */
        if (row[j] == m) return j;
    return 0; /* only for rows of NaN, which the check refuses */
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

/* Sum of a row in double (in lane order, not index order: it is only compared with 1), or
 * NaN when an entry is negative, NaN or infinite.  The entry test works on the bit pattern:
 * a float is finite and >= 0 iff its bits are <= 0x7F7FFFFF (+0 .. FLT_MAX) or exactly
 * 0x80000000 (-0). */
static double row_scan(const float *row, int64_t v) {
    smoe_d2 s[4] = {{0.0, 0.0}, {0.0, 0.0}, {0.0, 0.0}, {0.0, 0.0}};
    smoe_i4 bad = {0, 0, 0, 0};
    const smoe_u4 top = {0x7F7FFFFFu, 0x7F7FFFFFu, 0x7F7FFFFFu, 0x7F7FFFFFu};
    const smoe_u4 nz = {0x80000000u, 0x80000000u, 0x80000000u, 0x80000000u};
    int64_t j = 0;
    for (; j + 8 <= v; j += 8)
        for (int h = 0; h < 2; h++) {
            smoe_f4 x = ld4(row + j + 4 * h);
            smoe_u4 b = (smoe_u4)x;
            bad |= (b > top) & (b != nz);
            s[2 * h] += (smoe_d2){x[0], x[1]};
            s[2 * h + 1] += (smoe_d2){x[2], x[3]};
        }
    double t = 0.0;
    for (int l = 0; l < 4; l++) t += s[l][0] + s[l][1];
    int any = bad[0] | bad[1] | bad[2] | bad[3];
    for (; j < v; j++) {
        float x = row[j];
        any |= !(x >= 0.0f && x <= FLT_MAX);
        t += (double)x;
    }
    return any ? NAN : t;
}

int smoe_spec_accept_check(const float *p, const int64_t *draft, const float *q,
                           const double *u, int32_t k, int64_t v, int values, smoe_err *err) {
    if (k < 0) return smoe_err_set(err, SMOE_EINVAL, "spec_accept: K=%d is negative", (int)k);
    if (v < 1) return smoe_err_set(err, SMOE_EINVAL, "spec_accept: vocabulary size %lld < 1",
                                   (long long)v);
    for (int32_t a = 0; values && a < 2; a++) {
        const float *m = a == 0 ? p : q;
        const char *name = a == 0 ? "p" : "q";
        int64_t rows = a == 0 ? (int64_t)k + 1 : (int64_t)k;
        if (!m) continue;
        for (int64_t i = 0; i < rows; i++) {
            const float *row = m + i * v;
            double s = row_scan(row, v);
            if (isnan(s)) { /* a bad entry: name the first one */
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

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

static inline smoe_f4 ld4(const float *x) {
    smoe_f4 r;
    memcpy(&r, x, sizeof r); /* unaligned load */
    return r;
}

int64_t smoe_spec_argmax(const float *row, int64_t v) {
    float m = -INFINITY;
    int64_t best = 0, j = 0;
    if (v >= 16 && v / 16 <= INT32_MAX) {
        /* 16 lanes, each keeping its maximum and the block of its first occurrence (strict >
         * keeps the earliest within a lane); NaN never wins a comparison. */
        smoe_f4 mx[4];
        smoe_i4 bi[4];
        for (int l = 0; l < 4; l++) {
            mx[l] = ld4(row + 4 * l);
            bi[l] = (smoe_i4){0, 0, 0, 0};
        }
        int32_t blk = 1;
        for (j = 16; j + 16 <= v; j += 16, blk++) {
            smoe_i4 bv = {blk, blk, blk, blk};
            for (int l = 0; l < 4; l++) {
                smoe_f4 x = ld4(row + j + 4 * l);
                smoe_i4 gt = x > mx[l]; /* all ones where x wins */
                mx[l] = (smoe_f4)(((smoe_i4)x & gt) | ((smoe_i4)mx[l] & ~gt));
                bi[l] = (bv & gt) | (bi[l] & ~gt);
            }
        }
        for (int l = 0; l < 4; l++) /* the largest lane value, lowest index among equals */
            for (int e = 0; e < 4; e++) {
                float x = mx[l][e];
                int64_t idx = (int64_t)bi[l][e] * 16 + 4 * l + e;
                if (x > m || (x == m && idx < best)) {
                    m = x;
                    best = idx;
                }
            }
    }
    for (; j < v; j++) /* the tail's indices are all larger: strict > */
        if (row[j] > m) {
            m = row[j];
            best = j;
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

/* Sum of a row (not in index order, with float partial sums: it is only compared with 1
 * within SMOE_SPEC_SUM_TOL), or NaN when an entry is negative, NaN or infinite.  The entry
 * test works on the bit pattern: a float is finite and >= 0 iff its bits are <= 0x7F7FFFFF
 * (+0 .. FLT_MAX) or exactly 0x80000000 (-0). */
static double row_scan(const float *row, int64_t v) {
    smoe_i4 bad = {0, 0, 0, 0};
    const smoe_u4 top = {0x7F7FFFFFu, 0x7F7FFFFFu, 0x7F7FFFFFu, 0x7F7FFFFFu};
    const smoe_u4 nz = {0x80000000u, 0x80000000u, 0x80000000u, 0x80000000u};
    double t = 0.0;
    int64_t j = 0;
    /* float partial sums over chunks of 1024 entries (64 per lane: relative error below
     * 64 * 2^-24 = 4e-6), each chunk then added in double */
    while (j + 16 <= v) {
        smoe_f4 s[4] = {{0, 0, 0, 0}, {0, 0, 0, 0}, {0, 0, 0, 0}, {0, 0, 0, 0}};
        int64_t end = j + 1024 <= v ? j + 1024 : v - (v - j) % 16;
        for (; j < end; j += 16)
            for (int l = 0; l < 4; l++) {
                smoe_f4 x = ld4(row + j + 4 * l);
                smoe_u4 b = (smoe_u4)x;
                bad |= (smoe_i4)((b > top) & (b != nz));
                s[l] += x;
            }
        smoe_f4 c = (s[0] + s[1]) + (s[2] + s[3]);
        t += ((double)c[0] + (double)c[1]) + ((double)c[2] + (double)c[3]);
    }
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

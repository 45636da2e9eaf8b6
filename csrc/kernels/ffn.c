/* Expert FFN: descriptor checks, the call driver (gather x, two parallel phases) and the
 * scalar reference path.  The vector paths live in ffn_avx2.c / ffn_avx512.c. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kimpl.h"

void smoe_ffn_desc_default(smoe_ffn_desc *d, uint32_t H, uint32_t I, int32_t dtype, int32_t act) {
    memset(d, 0, sizeof *d);
    d->H = H;
    d->I = I;
    d->dtype = dtype;
    d->act = act;
    d->alpha = 1.702f;
    d->limit = 7.0f;
    d->group = 128;
    d->gate = d->up = d->down = SMOE_NO_TENSOR;
    d->gate_scale = d->up_scale = d->down_scale = SMOE_NO_TENSOR;
    d->gate_bias = d->up_bias = d->down_bias = SMOE_NO_TENSOR;
}

static uint32_t group_of(const smoe_ffn_desc *d) { return d->group ? d->group : 128u; }

static uint64_t wbytes(int32_t dtype, uint32_t rows, uint32_t cols) {
    uint64_t n = (uint64_t)rows * cols;
    switch (dtype) {
    case SMOE_WDT_F32: return n * 4;
    case SMOE_WDT_BF16: return n * 2;
    case SMOE_WDT_I8: return n;
    case SMOE_WDT_I4: return n / 2;
    case SMOE_WDT_I2: return n / 4;
    case SMOE_WDT_Q8_0:
    case SMOE_WDT_Q4_K:
    case SMOE_WDT_Q6_K:
    case SMOE_WDT_Q4_0:
    case SMOE_WDT_Q5_K:
    case SMOE_WDT_IQ4_XS:
    case SMOE_WDT_Q4_1:
    case SMOE_WDT_Q2_K:
    case SMOE_WDT_Q3_K:
    case SMOE_WDT_MXFP4:
        return (uint64_t)rows * (cols / smoe_wdt_block_cols(dtype)) * smoe_wdt_block_bytes(dtype);
    default: return 0;
    }
}

uint64_t smoe_ffn_weight_bytes(const smoe_ffn_desc *d, uint32_t rows, uint32_t cols) {
    return wbytes(d->dtype, rows, cols);
}

uint64_t smoe_ffn_scale_bytes(const smoe_ffn_desc *d, uint32_t rows, uint32_t cols) {
    switch (d->dtype) {
    case SMOE_WDT_I8: return (uint64_t)rows * 4;
    case SMOE_WDT_I4: return (uint64_t)rows * (cols / group_of(d)) * 4;
    case SMOE_WDT_I2: return (uint64_t)rows * (cols / group_of(d)) * 8; /* (scale, offset) */
    default: return 0;
    }
}

static int check_tensor(const char *name, uint64_t off, uint64_t nbytes, uint64_t align,
                        int required, uint64_t block_bytes, smoe_err *err) {
    if (off == SMOE_NO_TENSOR) {
        if (required) return smoe_err_set(err, SMOE_EINVAL, "tensor '%s' is missing", name);
        return SMOE_OK;
    }
    if (off % align)
        return smoe_err_set(err, SMOE_EINVAL,
                            "tensor '%s' at offset %llu is not %llu-byte aligned", name,
                            (unsigned long long)off, (unsigned long long)align);
    if (block_bytes && (off > block_bytes || nbytes > block_bytes - off))
        return smoe_err_set(err, SMOE_EINVAL,
                            "tensor '%s' (%llu bytes at offset %llu) does not fit in the "
                            "%llu-byte block",
                            name, (unsigned long long)nbytes, (unsigned long long)off,
                            (unsigned long long)block_bytes);
    return SMOE_OK;
}

int smoe_ffn_desc_check(const smoe_ffn_desc *d, uint64_t block_bytes, smoe_err *err) {
    if (d->dtype < SMOE_WDT_F32 || d->dtype > SMOE_WDT_MXFP4)
        return smoe_err_set(err, SMOE_EINVAL, "unknown expert weight dtype %d", d->dtype);
    const int32_t ddt = smoe_ffn_down_dtype(d);
    if (d->down_dtype && !(smoe_wdt_is_block(d->dtype) && smoe_wdt_is_block(d->down_dtype)))
        return smoe_err_set(err, SMOE_EINVAL,
                            "down_dtype %d: only the GGUF block formats (Q8_0, Q2_K-Q6_K, "
                            "Q4_0, Q4_1, IQ4_XS, MXFP4) may differ between the matrices (dtype %d)",
                            d->down_dtype, d->dtype);
    if (smoe_wdt_is_block(d->dtype)) {
        const uint32_t gc = smoe_wdt_block_cols(d->dtype), dc = smoe_wdt_block_cols(ddt);
        if (d->H % gc)
            return smoe_err_set(err, SMOE_EINVAL,
                                "GGUF blocks of %u columns: hidden size H=%u (the columns of "
                                "gate/up) is not a multiple",
                                gc, d->H);
        if (d->I % dc)
            return smoe_err_set(err, SMOE_EINVAL,
                                "GGUF blocks of %u columns: intermediate size I=%u (the columns "
                                "of down) is not a multiple",
                                dc, d->I);
    }
    if (d->act != SMOE_ACT_SILU && d->act != SMOE_ACT_GPTOSS)
        return smoe_err_set(err, SMOE_EINVAL, "unknown expert activation %d", d->act);
    if (d->H == 0 || d->I == 0)
        return smoe_err_set(err, SMOE_EINVAL, "expert shape H=%u I=%u must be positive", d->H,
                            d->I);
    if (d->H > (1u << 24) || d->I > (1u << 24))
        return smoe_err_set(err, SMOE_EINVAL, "expert shape H=%u I=%u is implausibly large",
                            d->H, d->I);
    if (d->dtype == SMOE_WDT_I4 || d->dtype == SMOE_WDT_I2) {
        const char *nm = d->dtype == SMOE_WDT_I4 ? "int4" : "int2";
        uint32_t g = group_of(d), mult = d->dtype == SMOE_WDT_I4 ? 32 : 64;
        if (g % mult || g > 4096)
            return smoe_err_set(err, SMOE_EINVAL,
                                "%s group size %u must be a multiple of %u (at most 4096)", nm, g,
                                mult);
        if (d->H % g)
            return smoe_err_set(err, SMOE_EINVAL,
                                "%s: hidden size H=%u is not a multiple of the group size %u", nm,
                                d->H, g);
        if (d->I % g)
            return smoe_err_set(err, SMOE_EINVAL,
                                "%s: intermediate size I=%u is not a multiple of the group size "
                                "%u",
                                nm, d->I, g);
    }
    if (d->act == SMOE_ACT_GPTOSS && !(d->limit > 0.0f && d->alpha == d->alpha))
        return smoe_err_set(err, SMOE_EINVAL, "gptoss activation needs limit > 0 (got %g)",
                            (double)d->limit);
    uint64_t wal = d->dtype == SMOE_WDT_F32 ? 4 : d->dtype == SMOE_WDT_BF16 ? 2 : 1;
    int q = d->dtype == SMOE_WDT_I8 || d->dtype == SMOE_WDT_I4 || d->dtype == SMOE_WDT_I2;
    int rc;
    if ((rc = check_tensor("gate", d->gate, smoe_ffn_weight_bytes(d, d->I, d->H), wal, 1,
                           block_bytes, err)) ||
        (rc = check_tensor("up", d->up, smoe_ffn_weight_bytes(d, d->I, d->H), wal, 1, block_bytes,
                           err)) ||
        (rc = check_tensor("down", d->down, wbytes(ddt, d->H, d->I), wal, 1, block_bytes,
                           err)))
        return rc;
    if (q) {
        if ((rc = check_tensor("gate.scale", d->gate_scale, smoe_ffn_scale_bytes(d, d->I, d->H),
                               4, 1, block_bytes, err)) ||
            (rc = check_tensor("up.scale", d->up_scale, smoe_ffn_scale_bytes(d, d->I, d->H), 4, 1,
                               block_bytes, err)) ||
            (rc = check_tensor("down.scale", d->down_scale, smoe_ffn_scale_bytes(d, d->H, d->I),
                               4, 1, block_bytes, err)))
            return rc;
    } else if (d->gate_scale != SMOE_NO_TENSOR || d->up_scale != SMOE_NO_TENSOR ||
               d->down_scale != SMOE_NO_TENSOR) {
        return smoe_err_set(err, SMOE_EINVAL,
                            smoe_wdt_is_block(d->dtype)
                                ? "expert scale tensors given for GGUF block weights (their "
                                  "scales are inside the blocks)"
                                : "expert scales given for an unquantized dtype");
    }
    if ((rc = check_tensor("gate.bias", d->gate_bias, (uint64_t)d->I * 4, 4, 0, block_bytes,
                           err)) ||
        (rc = check_tensor("up.bias", d->up_bias, (uint64_t)d->I * 4, 4, 0, block_bytes, err)) ||
        (rc = check_tensor("down.bias", d->down_bias, (uint64_t)d->H * 4, 4, 0, block_bytes,
                           err)))
        return rc;
    return SMOE_OK;
}

static size_t round64(size_t n) { return (n + 63) & ~(size_t)63; }

/* Layout: xs [T,H] f32 (fast path: the prepared x) | act [T,I] f32 | prepared act (fast
 * path, <= 2 bytes per value) | scales and group sums of both prepared inputs: [T, n/128 + 1]
 * and [T, n/32 + 1] (int8/int4), or [T, n/32] and [T, n/32] (GGUF blocks) -- sized for the
 * larger, 2 * n/32 floats per row of each input. */
static size_t aux_bytes(const smoe_ffn_desc *d, uint32_t T) {
    return round64((size_t)T * (d->H / 16 + d->I / 16 + 4) * 4);
}

size_t smoe_ffn_scratch_bytes(const smoe_ffn_desc *d, uint32_t T) {
    return 64 + round64((size_t)T * d->H * 4) + round64((size_t)T * d->I * 4) +
           round64((size_t)T * d->I * 2) + aux_bytes(d, T);
}

float smoe_ffn_activate(const smoe_ffn_desc *d, float g, float u) {
    if (d->act == SMOE_ACT_GPTOSS) {
        float lim = d->limit;
        if (g > lim) g = lim;
        if (u > lim) u = lim;
        if (u < -lim) u = -lim;
        float glu = g / (1.0f + expf(-d->alpha * g));
        return (u + 1.0f) * glu;
    }
    return g / (1.0f + expf(-g)) * u;
}

/* ---- scalar path ---- */

static inline float bf16_to_f32(uint16_t v) {
    uint32_t b = (uint32_t)v << 16;
    float f;
    memcpy(&f, &b, 4);
    return f;
}

/* Dot of weight row r of matrix (off, soff) with the prepared input x (n columns). */
static float row_dot(const smoe_ffn_job *j, uint64_t off, uint64_t soff, uint32_t r, uint32_t n,
                     const float *x) {
    const smoe_ffn_desc *d = j->d;
    float acc = 0.0f;
    switch (d->dtype) {
    case SMOE_WDT_F32: {
        const float *w = (const float *)(j->block + off) + (size_t)r * n;
        for (uint32_t c = 0; c < n; c++) acc += w[c] * x[c];
        return acc;
    }
    case SMOE_WDT_BF16: {
        const uint16_t *w = (const uint16_t *)(j->block + off) + (size_t)r * n;
        for (uint32_t c = 0; c < n; c++) acc += bf16_to_f32(w[c]) * x[smoe_perm_pos(c, n)];
        return acc;
    }
    case SMOE_WDT_I8: {
        const int8_t *w = (const int8_t *)(j->block + off) + (size_t)r * n;
        const float *s = (const float *)(j->block + soff);
        for (uint32_t c = 0; c < n; c++) acc += (float)w[c] * x[c];
        return acc * s[r];
    }
    default: { /* I4, x permuted per 32 columns (see smoe_perm_pos) */
        uint32_t g = j->group, ng = n / g;
        const uint8_t *w = j->block + off + (size_t)r * (n / 2);
        const float *s = (const float *)(j->block + soff) + (size_t)r * ng;
        for (uint32_t gi = 0; gi < ng; gi++) {
            float part = 0.0f;
            for (uint32_t b = gi * g; b < (gi + 1) * g; b += 32) {
                const uint8_t *wb = w + b / 2;
                for (uint32_t k = 0; k < 16; k++) {
                    part += (float)((int)(wb[k] & 15u) - 8) * x[b + k];
                    part += (float)((int)(wb[k] >> 4) - 8) * x[b + 16 + k];
                }
            }
            acc += part * s[gi];
        }
        return acc;
    }
    }
}

static void scalar_gateup(const smoe_ffn_job *j, uint32_t i0, uint32_t i1) {
    const smoe_ffn_desc *d = j->d;
    for (uint32_t i = i0; i < i1; i++)
        for (uint32_t t = 0; t < j->T; t++) {
            const float *x = j->xs + (size_t)t * d->H;
            float g = row_dot(j, d->gate, d->gate_scale, i, d->H, x);
            float u = row_dot(j, d->up, d->up_scale, i, d->H, x);
            smoe_ffn_store_act(j, i, t, g, u);
        }
}

static void scalar_down(const smoe_ffn_job *j, uint32_t h0, uint32_t h1) {
    const smoe_ffn_desc *d = j->d;
    for (uint32_t h = h0; h < h1; h++)
        for (uint32_t t = 0; t < j->T; t++)
            smoe_ffn_store_out(j, h, t,
                               row_dot(j, d->down, d->down_scale, h, d->I,
                                       j->act + (size_t)t * d->I));
}

static uint64_t scalar_read_sum(const uint8_t *p, size_t n) {
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    size_t i = 0;
    for (; i + 32 <= n; i += 32) {
        uint64_t a, b, c, e;
        memcpy(&a, p + i, 8);
        memcpy(&b, p + i + 8, 8);
        memcpy(&c, p + i + 16, 8);
        memcpy(&e, p + i + 24, 8);
        s0 += a;
        s1 += b;
        s2 += c;
        s3 += e;
    }
    for (; i < n; i++) s0 += p[i];
    return s0 + s1 + s2 + s3;
}

const smoe_ffn_impl smoe_ffn_impl_scalar = {scalar_gateup, scalar_down, scalar_read_sum};

/* ---- driver ---- */

/* The exact path's entry points for weights of `dtype` on `isa` (int2 has its own, ffn_i2.c). */
static const smoe_ffn_impl *impl_for(int32_t isa, int32_t dtype) {
    if (dtype == SMOE_WDT_I2) return smoe_ffn_impl_i2(isa);
    switch (isa) {
    case SMOE_ISA_AVX512: return &smoe_ffn_impl_avx512;
    case SMOE_ISA_AVX2: return &smoe_ffn_impl_avx2;
    default: return &smoe_ffn_impl_scalar;
    }
}

typedef struct phase_arg {
    smoe_split split; /* the phase's chunks (phase_start) */
    const smoe_ffn_impl *impl;
    const smoe_ffn_job *job;
    int phase;   /* 1: gate/up over I rows, 2: down over H rows */
    uint32_t ch; /* rows per chunk */
} phase_arg;

/* Rows per chunk: a multiple of 16 giving ~16 chunks per thread. */
static uint32_t chunk_rows(uint32_t n, uint32_t parts) {
    uint32_t c = (n + 16 * parts - 1) / (16 * parts);
    c = (c + 15) & ~15u;
    return c < 16 ? 16 : c;
}

static uint32_t phase_rows(const phase_arg *pa) {
    return pa->phase == 1 ? pa->job->d->I : pa->job->d->H;
}

/* Set pa up for `phase` on a pool of `threads`: its rows in chunks, a range of them per thread
 * (smoe_split: a thread reads one sequential stream, and one that is descheduled or wakes late
 * costs only the chunk it holds -- the caller starts at once, without waiting for the workers
 * to wake, and takes what they have not). */
static void phase_start(phase_arg *pa, int phase, uint32_t threads) {
    pa->phase = phase;
    uint32_t rows = phase_rows(pa);
    pa->ch = chunk_rows(rows, threads);
    smoe_split_init(&pa->split, (rows + pa->ch - 1) / pa->ch, threads);
}

static void phase_run(void *varg, uint32_t k, uint32_t n) {
    (void)n;
    phase_arg *pa = varg;
    const uint32_t rows = phase_rows(pa), ch = pa->ch;
    uint32_t c;
    while (smoe_split_next(&pa->split, k, &c)) {
        uint32_t a = c * ch, b = rows - a < ch ? rows : a + ch;
        if (pa->phase == 1)
            pa->impl->gateup(pa->job, a, b);
        else
            pa->impl->down(pa->job, a, b);
    }
}

/* The fast (rounded-activation) path for weights of this dtype/group on a context with these
 * features, or NULL for the exact path: ffn_fast.c's AVX-512 forms where the CPU has the
 * extension, else ffn_fast_avx2.c's int8/int4 forms on AVX2 (same arithmetic; also what an
 * AVX-512 CPU without VNNI runs).  The callers add their shape rules (fast_dim_ok on every
 * input dimension). */
typedef struct kfeat kfeat;
static const smoe_ffn_impl *fast_impl(int32_t dtype, uint32_t group, uint32_t precise,
                                      const kfeat *f);

/* An input dimension the fast path reads: a multiple of 64 (bf16/int8: the one-token rows step
 * 64 columns, the others 32; int4: per-128-column activation blocks and a trailing 64, which
 * only group-64 weights have, ffn_fast.c dot_i4_g64); at most 65536.  Multiples of 64 that are
 * not of 128 (GPT-OSS's 2880) ran the exact path at ~0.43 of the read rate before (bf16/int8),
 * int4 with groups of 64 likewise (DeepSeek-V2-Lite's dense down projection, 10944 columns). */
static int fast_dim_ok(int32_t dtype, uint32_t n) {
    (void)dtype;
    return n % 64u == 0 && n <= 65536;
}

/* What a call takes from its context: ISA, features, the stream prefetch distance. */
struct kfeat {
    int32_t isa;
    int has_bf16, has_vnni;
    uint32_t stream_pf;
};

static const smoe_ffn_impl *fast_impl(int32_t dtype, uint32_t group, uint32_t precise,
                                      const kfeat *f) {
    if (precise) return NULL;
    const int g_ok = group == 64 || group % 128 == 0;
    /* groups of 32 (GGUF's Q4_0 blocks kept as they are) have the AVX2 form only, which an
     * AVX-512 CPU runs too */
    if (smoe_ffn_fast_built && f->isa >= SMOE_ISA_AVX512) {
        int ok = dtype == SMOE_WDT_BF16 ? f->has_bf16
                 : dtype == SMOE_WDT_I8 ? f->has_vnni
                 : dtype == SMOE_WDT_I4 ? f->has_vnni && g_ok : 0;
        if (ok) return &smoe_ffn_impl_fast;
    }
    if (smoe_ffn_fast_avx2_built && f->isa >= SMOE_ISA_AVX2 &&
        (dtype == SMOE_WDT_I8 || (dtype == SMOE_WDT_I4 && (g_ok || group == 32))))
        return &smoe_ffn_impl_fast_avx2;
    return NULL;
}

/* Prepare T rows of src (n columns) for the fast path `impl` (fast_impl's answer). */
static void fast_prepare(const smoe_ffn_impl *impl, int32_t dtype, uint32_t group,
                         const float *src, size_t src_stride, const int32_t *rows, uint32_t T,
                         uint32_t n, void *q, float *qs, float *qsum) {
    if (impl == &smoe_ffn_impl_fast_avx2)
        smoe_fast_prepare_avx2(dtype, group, src, src_stride, rows, T, n, q, qs, qsum);
    else
        smoe_fast_prepare(dtype, src, src_stride, rows, T, n, q, qs, qsum);
}

/* The features of c, or of a throwaway single-threaded context when c is NULL. */
static int ctx_features(smoe_kctx *c, kfeat *f, smoe_err *err) {
    smoe_kctx local;
    if (!c) {
        int rc = smoe_kctx_init(&local, 1, err);
        if (rc) return rc;
        c = &local;
    }
    f->isa = c->isa;
    f->has_bf16 = c->has_bf16;
    f->has_vnni = c->has_vnni;
    f->stream_pf = __atomic_load_n(&c->stream_pf, __ATOMIC_RELAXED); /* settable from Python */
    if (c == &local) smoe_kctx_free(&local);
    return SMOE_OK;
}

/* Copy T rows of x (n columns; row rows[t] or t) into dst [T, n], in the permuted column order
 * of BF16/I4 weights when perm (see smoe_perm_pos). */
static void gather_rows(const float *x, size_t x_stride, const int32_t *rows, uint32_t T,
                        uint32_t n, int perm, float *dst) {
    for (uint32_t t = 0; t < T; t++) {
        size_t r = rows ? (size_t)rows[t] : t;
        const float *src = x + r * x_stride;
        float *o = dst + (size_t)t * n;
        if (perm)
            for (uint32_t col = 0; col < n; col++) o[smoe_perm_pos(col, n)] = src[col];
        else
            memcpy(o, src, (size_t)n * 4);
    }
}

/* ffn_run for GGUF block weights (ffn_blocks.c): the fast form quantizes x into xs's bytes and
 * act into the prepared-act area, with their scales and sums in the aux area; the exact form
 * gathers x as f32 (natural column order). */
static void blocks_run(smoe_kpool *pool, const kfeat *f, const smoe_ffn_desc *d,
                       const uint8_t *block, const float *x, size_t x_stride, const int32_t *rows,
                       const float *scale, uint32_t T, float *out, size_t out_stride, float *xs,
                       float *act) {
    const uint32_t H = d->H, I = d->I, nt = smoe_kpool_threads(pool);
    phase_arg pa;
    pa.impl = smoe_ffn_impl_blocks(f->isa, f->has_vnni, d->precise);
    smoe_ffn_job job = {d,     block, T,          0,    xs,   act,  rows,
                        scale, out,   out_stride, NULL, NULL, NULL, f->stream_pf, 0};
    pa.job = &job;
    const int fast = smoe_blocks_fast(pa.impl);
    int8_t *aq = (int8_t *)((uint8_t *)act + round64((size_t)T * I * 4));
    float *xsc = (float *)((uint8_t *)aq + round64((size_t)T * I * 2));
    float *xsum = xsc + (size_t)T * (H / 32), *asc = xsum + (size_t)T * (H / 32);
    float *asum = asc + (size_t)T * (I / 32);
    if (fast) {
        job.qpairs = smoe_blocks_prepare(pa.impl, d->dtype, x, x_stride, rows, T, H,
                                         (int8_t *)xs, xsc, xsum);
        job.xs = NULL;
        job.q = xs;
        job.qs = xsc;
        job.qsum = xsum;
    } else {
        gather_rows(x, x_stride, rows, T, H, 0, xs);
    }
    phase_start(&pa, 1, nt);
    smoe_kpool_run(pool, phase_run, &pa);
    if (fast) {
        job.qpairs = smoe_blocks_prepare(pa.impl, smoe_ffn_down_dtype(d), act, I, NULL, T, I, aq,
                                         asc, asum);
        job.q = aq;
        job.qs = asc;
        job.qsum = asum;
    }
    phase_start(&pa, 2, nt);
    smoe_kpool_run(pool, phase_run, &pa);
}

/* One FFN call on `pool` (NULL: this thread alone) with the given ISA and features; the
 * arguments are checked by the callers. */
static void ffn_run(smoe_kpool *pool, const kfeat *f, const smoe_ffn_desc *d,
                    const uint8_t *block, const float *x, size_t x_stride, const int32_t *rows,
                    const float *scale, uint32_t T, float *out, size_t out_stride,
                    void *scratch) {
    uintptr_t base = ((uintptr_t)scratch + 63) & ~(uintptr_t)63;
    float *xs = (float *)base;
    float *act = (float *)(base + round64((size_t)T * d->H * 4));
    const uint32_t nt = smoe_kpool_threads(pool);
    if (smoe_wdt_is_block(d->dtype)) {
        blocks_run(pool, f, d, block, x, x_stride, rows, scale, T, out, out_stride, xs, act);
        return;
    }
    phase_arg pa;
    const smoe_ffn_impl *fast = fast_impl(d->dtype, group_of(d), d->precise, f);
    if (fast && fast_dim_ok(d->dtype, d->H) && fast_dim_ok(d->dtype, d->I)) {
        /* scales [T, n/128 + 1] and sums [T, n/32 + 1] of x, then of act (aux_bytes) */
        void *aq = (uint8_t *)act + round64((size_t)T * d->I * 4);
        float *sc = (float *)((uint8_t *)aq + round64((size_t)T * d->I * 2));
        float *xsc = sc, *asc = sc + (size_t)T * (d->H / 128 + 1);
        float *xsum = asc + (size_t)T * (d->I / 128 + 1);
        float *asum = xsum + (size_t)T * (d->H / 32 + 1);
        fast_prepare(fast, d->dtype, group_of(d), x, x_stride, rows, T, d->H, xs, xsc, xsum);
        smoe_ffn_job job = {d,     block, T,          group_of(d), NULL, act,         rows,
                            scale, out,   out_stride, xs,          xsc,  xsum, f->stream_pf, 0};
        pa.impl = fast;
        pa.job = &job;
        phase_start(&pa, 1, nt);
        smoe_kpool_run(pool, phase_run, &pa);
        fast_prepare(fast, d->dtype, group_of(d), act, d->I, NULL, T, d->I, aq, asc, asum);
        job.q = aq;
        job.qs = asc;
        job.qsum = asum;
        phase_start(&pa, 2, nt);
        smoe_kpool_run(pool, phase_run, &pa);
        return;
    }
    gather_rows(x, x_stride, rows, T, d->H, smoe_dtype_permuted(d->dtype), xs);
    smoe_ffn_job job = {d, block, T, group_of(d), xs, act, rows, scale, out, out_stride,
                        NULL, NULL, NULL, f->stream_pf, 0};
    pa.impl = impl_for(f->isa, d->dtype);
    pa.job = &job;
    phase_start(&pa, 1, nt);
    smoe_kpool_run(pool, phase_run, &pa);
    phase_start(&pa, 2, nt);
    smoe_kpool_run(pool, phase_run, &pa);
}

static int check_call(const smoe_ffn_desc *d, const uint8_t *block, const float *x,
                      size_t x_stride, const float *out, size_t out_stride, const void *scratch,
                      const char *fn, smoe_err *err) {
    if (!d || !block || !x || !out || !scratch)
        return smoe_err_set(err, SMOE_EINVAL, "%s: NULL argument", fn);
    if (x_stride < d->H || out_stride < d->H)
        return smoe_err_set(err, SMOE_EINVAL, "%s: row strides (x %zu, out %zu) below H=%u", fn,
                            x_stride, out_stride, d->H);
    return SMOE_OK;
}

int smoe_ffn_forward(smoe_kctx *c, const smoe_ffn_desc *d, const uint8_t *block, const float *x,
                     size_t x_stride, const int32_t *rows, const float *scale, uint32_t T,
                     float *out, size_t out_stride, void *scratch, smoe_err *err) {
    if (T == 0) return SMOE_OK;
    int rc = check_call(d, block, x, x_stride, out, out_stride, scratch, "smoe_ffn_forward", err);
    if (rc) return rc;
    kfeat f;
    if ((rc = ctx_features(c, &f, err))) return rc;
    smoe_kpool *pool = c ? c->pool : NULL;
    smoe_kpool_lock(pool);
    ffn_run(pool, &f, d, block, x, x_stride, rows, scale, T, out, out_stride, scratch);
    smoe_kpool_unlock(pool);
    return SMOE_OK;
}

static uint32_t pool_threads(const smoe_kctx *c) { return c && c->pool ? c->nthreads : 1; }

size_t smoe_ffn_many_scratch_bytes(const smoe_kctx *c, const smoe_ffn_desc *d, uint32_t maxT) {
    return pool_threads(c) * smoe_ffn_scratch_bytes(d, maxT ? maxT : 1);
}

typedef struct many_arg {
    const smoe_ffn_desc *d;
    const smoe_ffn_task *tasks;
    uint32_t n;
    kfeat f;
    uint8_t *scratch;
    size_t per;    /* scratch bytes per thread */
    uint32_t next; /* next task to take (atomic) */
} many_arg;

/* Each thread takes whole tasks (an atomic counter, as phase_run) and runs them alone. */
static void many_run(void *varg, uint32_t k, uint32_t n) {
    (void)n;
    many_arg *ma = varg;
    for (;;) {
        uint32_t i = __atomic_fetch_add(&ma->next, 1u, __ATOMIC_RELAXED);
        if (i >= ma->n) break;
        const smoe_ffn_task *t = &ma->tasks[i];
        if (t->T)
            ffn_run(NULL, &ma->f, ma->d, t->block, t->x, t->x_stride, t->rows, t->scale, t->T,
                    t->out, t->out_stride, ma->scratch + (size_t)k * ma->per);
    }
}

int smoe_ffn_forward_many(smoe_kctx *c, const smoe_ffn_desc *d, const smoe_ffn_task *tasks,
                          uint32_t n, void *scratch, smoe_err *err) {
    if (n == 0) return SMOE_OK;
    if (!tasks) return smoe_err_set(err, SMOE_EINVAL, "smoe_ffn_forward_many: NULL tasks");
    uint32_t maxT = 0;
    int rc;
    for (uint32_t i = 0; i < n; i++) {
        const smoe_ffn_task *t = &tasks[i];
        if ((rc = check_call(d, t->block, t->x, t->x_stride, t->out, t->out_stride, scratch,
                             "smoe_ffn_forward_many", err)))
            return rc;
        if (t->T > maxT) maxT = t->T;
    }
    many_arg ma = {d, tasks, n, {0, 0, 0, 0}, scratch, smoe_ffn_scratch_bytes(d, maxT ? maxT : 1),
                   0};
    if ((rc = ctx_features(c, &ma.f, err))) return rc;
    smoe_kpool *pool = c ? c->pool : NULL;
    if (c) __atomic_fetch_add(&c->many_calls, 1u, __ATOMIC_RELAXED);
    smoe_kpool_lock(pool);
    smoe_kpool_run(pool, many_run, &ma);
    smoe_kpool_unlock(pool);
    return SMOE_OK;
}

/* ---- dense linear layers ---- */

/* The FFN descriptor whose down projection is the linear layer: phase 2 of a job over it
 * accumulates W . act into out (which smoe_linear_forward first fills with the bias or zeros),
 * so the linear layer reuses every per-ISA down kernel. */
static void linear_as_down(const smoe_linear_desc *l, smoe_ffn_desc *d) {
    smoe_ffn_desc_default(d, l->N, l->K, l->dtype, SMOE_ACT_SILU);
    d->group = l->group ? l->group : 128u;
    d->precise = l->precise;
    d->down = l->w;
    d->down_scale = l->w_scale;
}

int smoe_linear_desc_check(const smoe_linear_desc *l, uint64_t block_bytes, smoe_err *err) {
    if (l->dtype == SMOE_WDT_I2)
        return smoe_err_set(err, SMOE_EINVAL, "int2 weights are for expert FFNs only, not for "
                            "linear layers (use f32, bf16, int8, int4 or a GGUF block format)");
    if (l->dtype < SMOE_WDT_F32 || l->dtype > SMOE_WDT_MXFP4)
        return smoe_err_set(err, SMOE_EINVAL, "unknown linear weight dtype %d", l->dtype);
    if (l->N == 0 || l->K == 0 || l->N > (1u << 24) || l->K > (1u << 24))
        return smoe_err_set(err, SMOE_EINVAL, "linear shape N=%u K=%u out of range (1..2^24)",
                            l->N, l->K);
    smoe_ffn_desc d;
    linear_as_down(l, &d);
    const int blocks = smoe_wdt_is_block(l->dtype);
    if (blocks && l->K % smoe_wdt_block_cols(l->dtype))
        return smoe_err_set(err, SMOE_EINVAL,
                            "GGUF blocks of %u columns: linear K=%u is not a multiple",
                            smoe_wdt_block_cols(l->dtype), l->K);
    if (l->dtype == SMOE_WDT_I4) {
        uint32_t g = group_of(&d);
        if (g % 32 || g > 4096 || l->K % g)
            return smoe_err_set(err, SMOE_EINVAL,
                                "int4 linear: group %u must be a multiple of 32 (at most 4096) "
                                "dividing K=%u",
                                g, l->K);
    }
    uint64_t wal = l->dtype == SMOE_WDT_F32 ? 4 : l->dtype == SMOE_WDT_BF16 ? 2 : 1;
    int q = l->dtype == SMOE_WDT_I8 || l->dtype == SMOE_WDT_I4;
    int rc = check_tensor("weight", l->w,
                          blocks ? wbytes(l->dtype, l->N, l->K)
                                 : smoe_ffn_weight_bytes(&d, l->N, l->K),
                          wal, 1, block_bytes, err);
    if (rc) return rc;
    if (q) {
        rc = check_tensor("weight.scale", l->w_scale, smoe_ffn_scale_bytes(&d, l->N, l->K), 4, 1,
                          block_bytes, err);
        if (rc) return rc;
    } else if (l->w_scale != SMOE_NO_TENSOR) {
        return smoe_err_set(err, SMOE_EINVAL,
                            blocks ? "linear scale given for GGUF block weights (their scales "
                                     "are inside the blocks)"
                                   : "linear scale given for an unquantized dtype");
    }
    return SMOE_OK;
}

/* Layout: act [Tc, K] f32 (exact path: x in the weights' column order) | prepared x (fast
 * path, <= 2 bytes per value) | its scales and block sums.  Tc = min(T, SMOE_LINEAR_TCHUNK). */
size_t smoe_linear_scratch_bytes(const smoe_linear_desc *l, uint32_t T) {
    size_t tc = T < SMOE_LINEAR_TCHUNK ? T : SMOE_LINEAR_TCHUNK;
    if (tc == 0) tc = 1;
    /* GGUF blocks: scales [tc, K/32] and int16 sums [tc, K/16] (smoe_blocks_prepare) */
    return 64 + round64(tc * l->K * 4) + round64(tc * l->K * 2) +
           round64(tc * (l->K / 128 + 2 * (l->K / 32) + 2) * 4);
}

int smoe_linear_forward(smoe_kctx *c, const smoe_linear_desc *l, const uint8_t *block,
                        const float *bias, const float *x, size_t x_stride, uint32_t T, float *out,
                        size_t out_stride, void *scratch, smoe_err *err) {
    if (T == 0) return SMOE_OK;
    if (!l || !block || !x || !out || !scratch)
        return smoe_err_set(err, SMOE_EINVAL, "smoe_linear_forward: NULL argument");
    if (x_stride < l->K || out_stride < l->N)
        return smoe_err_set(err, SMOE_EINVAL,
                            "smoe_linear_forward: row strides (x %zu, out %zu) below K=%u / N=%u",
                            x_stride, out_stride, l->K, l->N);
    kfeat f;
    int rc = ctx_features(c, &f, err);
    if (rc) return rc;
    smoe_ffn_desc d;
    linear_as_down(l, &d);
    const int blocks = smoe_wdt_is_block(d.dtype);
    /* GGUF blocks: ffn_blocks.c's rows (blocks_run's phase 2); their fast form prepares x
     * with smoe_blocks_prepare, the exact one reads it as f32 in column order */
    const smoe_ffn_impl *bimpl = blocks ? smoe_ffn_impl_blocks(f.isa, f.has_vnni, d.precise)
                                        : NULL;
    const smoe_ffn_impl *fast = blocks ? NULL : fast_impl(d.dtype, d.group, d.precise, &f);
    if (!fast_dim_ok(d.dtype, l->K)) fast = NULL;
    uint32_t tc = T < SMOE_LINEAR_TCHUNK ? T : SMOE_LINEAR_TCHUNK;
    uintptr_t base = ((uintptr_t)scratch + 63) & ~(uintptr_t)63;
    float *act = (float *)base;
    void *q = (uint8_t *)act + round64((size_t)tc * l->K * 4);
    float *qs = (float *)((uint8_t *)q + round64((size_t)tc * l->K * 2));
    float *qsum = qs + (size_t)tc * (l->K / 128 + 1);
    smoe_kpool *pool = c ? c->pool : NULL;
    smoe_kpool_lock(pool);
    for (uint32_t t0 = 0; t0 < T; t0 += tc) {
        uint32_t nt = T - t0 < tc ? T - t0 : tc;
        const float *xc = x + (size_t)t0 * x_stride;
        float *oc = out + (size_t)t0 * out_stride;
        for (uint32_t t = 0; t < nt; t++) {
            float *o = oc + (size_t)t * out_stride;
            if (bias)
                memcpy(o, bias, (size_t)l->N * 4);
            else
                memset(o, 0, (size_t)l->N * 4);
        }
        smoe_ffn_job job = {&d,   block, nt,         d.group, NULL, act,        NULL,
                            NULL, oc,    out_stride, NULL,    NULL, NULL, f.stream_pf, 0};
        phase_arg pa;
        pa.impl = blocks ? bimpl : impl_for(f.isa, d.dtype);
        pa.job = &job;
        phase_start(&pa, 2, smoe_kpool_threads(pool));
        if (blocks && smoe_blocks_fast(bimpl)) {
            job.qpairs = smoe_blocks_prepare(bimpl, d.dtype, xc, x_stride, NULL, nt, l->K,
                                             (int8_t *)q, qs, qs + (size_t)tc * (l->K / 32));
            job.q = q;
            job.qs = qs;
            job.qsum = qs + (size_t)tc * (l->K / 32);
        } else if (blocks) {
            gather_rows(xc, x_stride, NULL, nt, l->K, 0, act);
        } else if (fast) {
            fast_prepare(fast, d.dtype, d.group, xc, x_stride, NULL, nt, l->K, q, qs, qsum);
            job.q = q;
            job.qs = qs;
            job.qsum = qsum;
            pa.impl = fast;
        } else {
            gather_rows(xc, x_stride, NULL, nt, l->K, smoe_dtype_permuted(d.dtype), act);
        }
        smoe_kpool_run(pool, phase_run, &pa);
    }
    smoe_kpool_unlock(pool);
    return SMOE_OK;
}

/* ---- one GGUF block matrix against one vector, on the calling thread (kimpl.h) ---- */

/* act f32 [K] (the exact form's input) | q int8 [K] | qs f32 [K/32] | int16 sums [K/16] */
size_t smoe_blocks_matvec_scratch(uint32_t K) {
    return 64 + round64((size_t)K * 4) + round64(K) + round64((size_t)(K / 32 + 1) * 4) +
           round64((size_t)(K / 16 + 1) * 2);
}

void smoe_blocks_matvec(const smoe_ffn_impl *impl, int32_t dt, const uint8_t *w, uint32_t N,
                        uint32_t K, const float *x, float *y, void *scratch) {
    smoe_ffn_desc d;
    smoe_ffn_desc_default(&d, N, K, dt, SMOE_ACT_SILU); /* W as a down projection, as
                                                        * linear_as_down */
    d.down = 0;
    float *act = (float *)(((uintptr_t)scratch + 63) & ~(uintptr_t)63);
    int8_t *q = (int8_t *)act + round64((size_t)K * 4);
    float *qs = (float *)(q + round64(K));
    float *qsum = (float *)((uint8_t *)qs + round64((size_t)(K / 32 + 1) * 4));
    memset(y, 0, (size_t)N * 4);
    smoe_ffn_job job;
    memset(&job, 0, sizeof job);
    job.d = &d;
    job.block = w;
    job.T = 1;
    job.group = d.group;
    job.act = act;
    job.out = y;
    job.out_stride = N;
    if (smoe_blocks_fast(impl)) {
        job.qpairs = smoe_blocks_prepare(impl, dt, x, K, NULL, 1, K, q, qs, qsum);
        job.q = q;
        job.qs = qs;
        job.qsum = qsum;
    } else {
        memcpy(act, x, (size_t)K * 4);
    }
    impl->down(&job, 0, N);
}

/* ---- read-bandwidth ceiling ---- */

typedef struct read_arg {
    smoe_split split; /* the chunks of one iteration (reset per iteration) */
    const smoe_ffn_impl *impl;
    const uint8_t *buf;
    size_t bytes;
    size_t chunk; /* bytes per chunk, multiple of 64 */
    uint64_t sums[1024];
} read_arg;

/* Same scheduling as the kernels (a range of ~16 chunks per thread, smoe_split), so the ceiling
 * and the kernel see the same exposure to a busy machine. */
static void read_run(void *varg, uint32_t k, uint32_t n) {
    (void)n;
    read_arg *ra = varg;
    uint32_t c;
    while (smoe_split_next(&ra->split, k, &c)) {
        size_t a = (size_t)c * ra->chunk;
        size_t b = ra->bytes - a < ra->chunk ? ra->bytes : a + ra->chunk;
        ra->sums[k] += ra->impl->read_sum(ra->buf + a, b - a);
    }
}

int smoe_read_bw(smoe_kctx *c, const uint8_t *buf, size_t bytes, uint32_t iters,
                 double *bytes_per_s, smoe_err *err) {
    if (!c || !buf || !bytes_per_s || iters == 0)
        return smoe_err_set(err, SMOE_EINVAL, "smoe_read_bw: bad argument");
    const size_t rab = (sizeof(read_arg) + 63) & ~(size_t)63;
    read_arg *ra = aligned_alloc(64, rab);
    if (!ra) return smoe_err_set(err, SMOE_ENOMEM, "smoe_read_bw: out of memory");
    memset(ra, 0, rab);
    ra->impl = impl_for(c->isa, SMOE_WDT_F32);
    ra->buf = buf;
    ra->bytes = bytes;
    const uint32_t parts = smoe_kpool_threads(c->pool);
    ra->chunk = ((bytes / (16 * (size_t)parts)) + 63) & ~(size_t)63;
    if (ra->chunk < 4096) ra->chunk = 4096;
    const uint32_t nchunks = (uint32_t)((bytes + ra->chunk - 1) / ra->chunk);
    smoe_kpool_lock(c->pool);
    double t0 = smoe_now();
    for (uint32_t it = 0; it < iters; it++) {
        smoe_split_init(&ra->split, nchunks, parts);
        smoe_kpool_run(c->pool, read_run, ra);
    }
    double dt = smoe_now() - t0;
    smoe_kpool_unlock(c->pool);
    uint64_t s = 0;
    for (uint32_t k = 0; k < 1024; k++) s += ra->sums[k];
    free(ra);
    /* s depends on every byte read; publishing it keeps the reads alive. */
    volatile uint64_t sink = s;
    (void)sink;
    *bytes_per_s = (double)bytes * iters / (dt > 0 ? dt : 1e-9);
    return SMOE_OK;
}

/* Private pieces shared by the kernel files: the per-call job, the per-ISA function table and
 * the thread pool.  Not part of the contract (see kernels.h). */
#ifndef SMOE_KIMPL_H
#define SMOE_KIMPL_H

#include "kernels.h"

/* One smoe_ffn_forward call as the workers see it.  Read-only during a phase except the
 * disjoint output ranges each worker owns (act columns in phase 1, out columns in phase 2). */
typedef struct smoe_ffn_job {
    const smoe_ffn_desc *d;
    const uint8_t *block;
    uint32_t T;
    uint32_t group;     /* I4 group (resolved) */
    const float *xs;    /* [T, H] gathered x; BF16/I4: smoe_perm_pos layout */
    float *act;         /* [T, I] activations; BF16/I4: smoe_perm_pos layout */
    const int32_t *rows;
    const float *scale;
    float *out;
    size_t out_stride;
    /* fast path only (ffn_fast.c): the prepared input of the current phase (x in phase 1,
     * act in phase 2): bf16 / u8 / s8 values, per-token or per-128-block scales, block sums */
    const void *q;
    const float *qs;
    const float *qsum; /* int4: [T, n/128] block scale * sum of the block's int8 values (AVX2:
                        * [T, n/group], per weight group, see smoe_fast_prepare_avx2) */
    uint32_t stream_pf; /* the context's stream_pf (kernels.h) */
    uint32_t qpairs;    /* GGUF blocks: q in pair order (what smoe_blocks_prepare returned) */
} smoe_ffn_job;

/* Position of column c (of n) in the permuted layout of x / act used by BF16 and I4 weights:
 * within each FULL block of 32 columns, even columns first, odd columns next, so that one
 * 32-bit lane of packed weights (two bf16, or a byte of two nibbles) splits into an "even"
 * vector and an "odd" vector with a shift / mask, no shuffles.  Columns of a trailing
 * partial block (BF16 only; I4 needs n % 32 == 0) keep their place. */
static inline uint32_t smoe_perm_pos(uint32_t c, uint32_t n) {
    if (c >= (n & ~31u)) return c;
    uint32_t b = c & ~31u, k = c & 31u;
    return b + ((k & 1u) ? 16u + (k >> 1) : (k >> 1));
}

static inline int smoe_dtype_permuted(int32_t dtype) {
    return dtype == SMOE_WDT_BF16 || dtype == SMOE_WDT_I4;
}

/* Per-ISA entry points.  gateup computes act rows [i0, i1) for every token; down computes out
 * columns [h0, h1) for every token; read_sum sums bytes (for smoe_read_bw). */
typedef struct smoe_ffn_impl {
    void (*gateup)(const smoe_ffn_job *j, uint32_t i0, uint32_t i1);
    void (*down)(const smoe_ffn_job *j, uint32_t h0, uint32_t h1);
    uint64_t (*read_sum)(const uint8_t *p, size_t n);
} smoe_ffn_impl;

extern const smoe_ffn_impl smoe_ffn_impl_scalar;
extern const smoe_ffn_impl smoe_ffn_impl_avx2;
extern const smoe_ffn_impl smoe_ffn_impl_avx512;
/* Int2 weights on `isa` (ffn_i2.c): exact f32 math on the widened weights, every ISA. */
const smoe_ffn_impl *smoe_ffn_impl_i2(int32_t isa);
/* Fast paths with rounded activations (ffn_fast.c); smoe_ffn_fast_built is 0 when the compiler
 * could not build them.  smoe_fast_prepare rounds/quantizes T rows of src (n columns; row
 * rows[t] or t) into q [T, n] (bf16 / int8+128 / int4-partner int8 layout), qs (int8: [T]
 * scales, int4: [T, n/128]) and qsum (int4: [T, n/128] scale * sum of the int8 values). */
extern const smoe_ffn_impl smoe_ffn_impl_fast;
/* AVX-512 forms of the MLA kernel's int8/int4 weight loops (mla_avx512.c, same bits as
 * mla.c's plain loops; group 0 = int8, a scale a row).  y[c] += (a * scale) * q[c] over one
 * row of n columns; res[e] = row e of nrows . x (n columns). */
#if defined(__x86_64__) && defined(__GNUC__)
void smoe_mla_axpy_q_avx512(float *y, float a, const int8_t *q, const float *sc,
                            uint32_t group, uint32_t n);
void smoe_mla_dotq_avx512(const float *x, const int8_t *w, size_t wrow, const float *sc,
                          size_t srow, uint32_t group, uint32_t n, uint32_t nrows, float *res);
/* f32 or bf16 rows (bf16: values as uint16 bits) for attn_impl.h's loops, weights or cached
 * rows: y[c] += a[q] * rows[q][c] for q = 0 .. nrows - 1 in that order; res[e] = row e . x,
 * rows wrow values apart. */
void smoe_attn_axpy_avx512(float *y, const float *a, const void *const *rows, uint32_t nrows,
                           uint32_t n, int bf16);
void smoe_attn_dot_avx512(const float *x, const void *w, size_t wrow, uint32_t n, uint32_t nrows,
                          float *res, int bf16);
/* The same four loops for AVX2 (mla_avx2.c, the same bits). */
void smoe_mla_axpy_q_avx2(float *y, float a, const int8_t *q, const float *sc, uint32_t group,
                          uint32_t n);
void smoe_mla_dotq_avx2(const float *x, const int8_t *w, size_t wrow, const float *sc,
                        size_t srow, uint32_t group, uint32_t n, uint32_t nrows, float *res);
void smoe_attn_axpy_avx2(float *y, const float *a, const void *const *rows, uint32_t nrows,
                         uint32_t n, int bf16);
void smoe_attn_dot_avx2(const float *x, const void *w, size_t wrow, uint32_t n, uint32_t nrows,
                        float *res, int bf16);
#endif
extern const int smoe_ffn_fast_built;
/* The AVX2 fast paths for int8 and int4 (ffn_fast_avx2.c: ffn_fast.c's arithmetic with AVX2
 * instructions; int4 groups of 64 or a multiple of 128).  Its preparation differs in qsum:
 * [T, n/group], each weight group's sum of block scale * int8 values (prepare_avx2). */
extern const smoe_ffn_impl smoe_ffn_impl_fast_avx2;
extern const int smoe_ffn_fast_avx2_built;
void smoe_fast_prepare_avx2(int32_t dtype, uint32_t group, const float *src, size_t src_stride,
                            const int32_t *rows, uint32_t T, uint32_t n, void *q, float *qs,
                            float *qsum);
void smoe_fast_prepare(int32_t dtype, const float *src, size_t src_stride, const int32_t *rows,
                       uint32_t T, uint32_t n, void *q, float *qs, float *qsum);

/* GGUF block weights (ffn_blocks.c): the entry points for a call on `isa` (`has_vnni`: the
 * CPU has AVX512_VNNI) with `precise` (the fast int8-input form on AVX2 unless precise, its
 * one-token Q4_0 rows through AVX-512 VNNI where there is that, else the exact f32 form);
 * smoe_blocks_fast says whether impl is the fast form, whose input smoe_blocks_prepare
 * quantizes for a matrix of `dtype`: T rows of src (n columns, a multiple of that dtype's
 * block; row rows[t] or t) into q [T, n] int8, qs [T, n/32] (Q8_0) or [T, n/256] scales and,
 * in qsum's bytes, int16 sums of every 32 values [T, n/32].  For impl's rows of Q4_0, MXFP4,
 * Q4_1 and IQ4_XS (the AVX2 fast form, any T) q's blocks go in pair order
 * (ffn_blocks.c, pair_order); it returns 1 then, else 0: the job's qpairs. */
const smoe_ffn_impl *smoe_ffn_impl_blocks(int32_t isa, int has_vnni, uint32_t precise);
int smoe_blocks_fast(const smoe_ffn_impl *impl);
uint32_t smoe_blocks_prepare(const smoe_ffn_impl *impl, int32_t dtype, const float *src,
                             size_t stride, const int32_t *rows, uint32_t T, uint32_t n,
                             int8_t *q, float *qs, float *qsum);

/* y[0..N) = W . x on the calling thread alone (no pool, no lock): W [N, K] in the GGUF block
 * format dt at w (rows of K / block-columns blocks, as a file holds them), x f32 [K].  The
 * rows of smoe_linear_forward at one token on impl (smoe_ffn_impl_blocks: the fast forms
 * quantize x per block, smoe_blocks_prepare; the exact one reads it in f32), for kernels
 * that split their own work over the threads (smoe_mla_decode's heads).  K a multiple of dt's
 * block columns (the caller checks); scratch: smoe_blocks_matvec_scratch(K) bytes, any
 * alignment; y overwritten. */
size_t smoe_blocks_matvec_scratch(uint32_t K);
void smoe_blocks_matvec(const smoe_ffn_impl *impl, int32_t dt, const uint8_t *w, uint32_t N,
                        uint32_t K, const float *x, float *y, void *scratch);

/* Scalar activation shared by every ISA (exactly the formula in kernels.h). */
float smoe_ffn_activate(const smoe_ffn_desc *d, float g, float u);

/* Pointers into the block. */
static inline const void *smoe_ffn_ptr(const smoe_ffn_job *j, uint64_t off) {
    return off == SMOE_NO_TENSOR ? NULL : (const void *)(j->block + off);
}

/* Finish one (row i, token t) of phase 1: biases, activation, store. */
static inline void smoe_ffn_store_act(const smoe_ffn_job *j, uint32_t i, uint32_t t, float g,
                                      float u) {
    const smoe_ffn_desc *d = j->d;
    const float *gb = (const float *)smoe_ffn_ptr(j, d->gate_bias);
    const float *ub = (const float *)smoe_ffn_ptr(j, d->up_bias);
    if (gb) g += gb[i];
    if (ub) u += ub[i];
    uint32_t pos = smoe_dtype_permuted(d->dtype) ? smoe_perm_pos(i, d->I) : i;
    j->act[(size_t)t * d->I + pos] = smoe_ffn_activate(d, g, u);
}

/* Finish one (row h, token t) of phase 2: bias, routing weight, accumulate into out. */
static inline void smoe_ffn_store_out(const smoe_ffn_job *j, uint32_t h, uint32_t t, float y) {
    const float *db = (const float *)smoe_ffn_ptr(j, j->d->down_bias);
    if (db) y += db[h];
    float s = j->scale ? j->scale[t] : 1.0f;
    size_t r = j->rows ? (size_t)j->rows[t] : t;
    j->out[r * j->out_stride + h] += s * y;
}

/* Thread pool (pool.c).  run() calls fn(arg, 0, n) on the calling thread and fn(arg, k, n) on
 * every worker k in [1, n) that wakes while the caller is still inside its own fn; it returns
 * when all calls that started are done.  So fn must claim its work dynamically (an atomic
 * counter or a smoe_split in arg), never assume that every k runs. */
typedef void (*smoe_kpool_fn)(void *arg, uint32_t k, uint32_t n);
int smoe_kpool_new(smoe_kpool **out, uint32_t nthreads, smoe_err *err);
void smoe_kpool_delete(smoe_kpool *p);
void smoe_kpool_run(smoe_kpool *p, smoe_kpool_fn fn, void *arg);
/* Threads a run on p uses, the caller included (1 for NULL). */
uint32_t smoe_kpool_threads(const smoe_kpool *p);

/* Chunks [0, n) of one pool run, cut into contiguous ranges, one per thread (threads beyond
 * SMOE_SPLIT_RANGES share ranges, k % ranges).  A thread takes its own range's chunks in order
 * from the front, so the rows it reads form one sequential stream along which its software
 * prefetches (ffn_fast.c, 1-16 KB ahead) land in rows it reads next; with its range empty it
 * takes the other ranges' chunks from the back, so a thread that is descheduled or wakes late
 * costs only the chunk it holds (the pool's join protocol, pool.c).
 * A shared counter instead (each thread the next chunk of all) interleaved the threads' chunks,
 * so each chunk's tail prefetched rows the other thread then read, and its start was not
 * prefetched: an OLMoE-shape int4 expert at 2 threads (C harness, DRAM) took 96 us in gate/up
 * and 56 us in down that way, 69-71 us and 40-42 us with ranges (2026-11-26).
 * front (low 32 bits) and back (high 32) of each range change by compare-and-swap; each range
 * on its own cache line. */
#define SMOE_SPLIT_RANGES 16
typedef struct smoe_split {
    struct {
        uint64_t fb; /* (atomic) front | back << 32: the range's chunks left are [front, back) */
        char pad[56];
    } r[SMOE_SPLIT_RANGES];
    uint32_t ranges;
} __attribute__((aligned(64))) smoe_split;
/* n chunks over `threads` threads (smoe_kpool_threads). */
void smoe_split_init(smoe_split *s, uint32_t n, uint32_t threads);
/* The next chunk for thread k into *c; 0 when every chunk has been taken. */
int smoe_split_next(smoe_split *s, uint32_t k, uint32_t *c);
/* Serialize whole calls (several phases) on one pool. */
void smoe_kpool_lock(smoe_kpool *p);
void smoe_kpool_unlock(smoe_kpool *p);

#endif

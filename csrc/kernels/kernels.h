/* Expert FFN kernels: one routed expert applied to the tokens routed to it, weights read once.
 *
 * Canonical expert layout (the store writer converts every architecture to it; names are the
 * keys of specmoe.storage.quant.expert_tensors and of the store schema):
 *   "gate" [I,H], "up" [I,H], "down" [H,I]   row-major, one row per OUTPUT element
 *   "gate.bias" [I], "up.bias" [I], "down.bias" [H]   optional, always f32
 *   "gate.scale", "up.scale", "down.scale"           only for quantized dtypes, always f32
 * Weight dtypes (smoe_wdtype):
 *   F32   plain float32.
 *   BF16  bfloat16 bit patterns (uint16, round-to-nearest-even from f32).
 *   I8    int8 symmetric per output row: w[r,c] = q[r,c] * scale[r]; scale [rows] f32,
 *         q in [-127, 127].
 *   I4    int4 symmetric in groups of `group` consecutive input columns (group is a multiple
 *         of 32 dividing both H and I; 128 by default): w[r,c] = (u[r,c] - 8) * scale[r, c/group]
 *         with u in [1, 15] (q = u - 8 in [-7, 7]); two values per byte, column 2j in the LOW
 *         nibble of byte j of the row, column 2j+1 in the high nibble: packed [rows, cols/2] u8;
 *         scale [rows, cols/group] f32 (f32 rather than f16: exact, and only 1/32 extra bytes
 *         per weight byte at group 128).
 *   I2    int2 asymmetric in groups of `group` consecutive input columns (group a multiple of
 *         64 dividing both H and I): w[r,c] = u[r,c] * scale[r,c/group,0] + scale[r,c/group,1]
 *         with u in [0, 3] (HQQ-style scale and zero point, SpecMD's lowest fallback level);
 *         four values per byte in a planar order per 64 columns: byte j (0..15) of the 16-byte
 *         block holding columns [64b, 64b+64) of a row has column 64b + 16i + j in bits
 *         2i..2i+1, so one 16-byte load widens to four vectors of 16 consecutive columns with
 *         shifts and a mask: packed [rows, cols/4] u8; scale [rows, cols/group, 2] f32
 *         (scale, offset).  For expert FFNs only (not smoe_linear_forward, not the GPU).
 *   Q8_0  GGUF blocks of 32 columns, 34 bytes: f16 d, int8 q[32]; w = d * q.
 *   Q4_K  GGUF super-blocks of 256 columns, 144 bytes: f16 d, f16 dmin, 12 bytes of eight 6-bit
 *         (scale, min) pairs, 128 bytes of nibbles; sub-block j (32 columns) has
 *         w = d * sc_j * q - dmin * m_j, q in [0, 15] (ggml's dequantize_row_q4_K).
 *   Q6_K  GGUF super-blocks of 256 columns, 210 bytes: ql[128] low nibbles, qh[64] high 2-bit
 *         pairs, int8 sc[16] (one per 16 columns), f16 d; w = d * sc * (q - 32), q in [0, 63].
 *   Q4_0  GGUF blocks of 32 columns, 18 bytes: f16 d, 16 bytes whose low nibbles are columns
 *         0..15 and high nibbles 16..31; w = d * (q - 8), q in [0, 15].
 *   Q5_K  GGUF super-blocks of 256 columns, 176 bytes: Q4_K's d, dmin and 12 scale bytes, then
 *         qh[32] (the fifth bits: bit j of qh[l] is column l of sub-block j) and qs[128] (Q4_K's
 *         nibbles); w = d * sc_j * q - dmin * m_j, q in [0, 31] (ggml's dequantize_row_q5_K).
 *   IQ4_XS GGUF super-blocks of 256 columns, 136 bytes: f16 d, u16 scales_h (2 high bits per
 *         sub-block), scales_l[4] (4 low bits per sub-block), qs[128]: sub-block j (32
 *         columns) has the 6-bit scale ls_j and w = d * (ls_j - 32) * kv[q], q a nibble (low
 *         nibbles of qs[16j..16j+15] are its columns 0..15, high ones 16..31), kv ggml's
 *         non-linear table kvalues_iq4nl (-127 .. 113) (ggml's dequantize_row_iq4_xs).
 *   MXFP4 GGUF blocks of 32 columns, 17 bytes: an E8M0 exponent e, 16 bytes whose low nibbles
 *         are columns 0..15 and high nibbles 16..31; w = 2^(e - 128) * kv[q], kv the FP4
 *         (E2M1) values doubled, {0, 1, 2, 3, 4, 6, 8, 12} and their negatives for q >= 8
 *         (ggml's dequantize_row_mxfp4, ggml_e8m0_to_fp32_half: GPT-OSS's expert format).
 *         The block formats keep a GGUF file's experts as they are (ffn_blocks.c); the three
 *         matrices may mix them (desc.down_dtype: a Q4_K_M file's down projections are often
 *         Q6_K or Q8_0 where gate/up are Q4_K).  Expert FFNs only, CPU only.
 * Activations (smoe_act), with g = gate row . x + gate.bias, u = up row . x + up.bias:
 *   SILU    a = silu(g) * u = g / (1 + exp(-g)) * u        (Mixtral, Qwen2/3-MoE, OLMoE,
 *                                                             PhiMoE, DeepSeek-V2/V3)
 *   GPTOSS  g = min(g, limit); u = clamp(u, -limit, limit); a = (u + 1) * g * sigmoid(alpha*g)
 *           (transformers GptOssExperts._apply_gate; alpha 1.702, limit 7.0 by default)
 * Then y = down . a + down.bias, and out[row] += scale * y.
 *
 * Threads: a smoe_kctx owns a persistent pthread pool (created once by smoe_kctx_init; no
 * thread is created per call) and the ISA choice.  A call splits output rows across the pool
 * (gate/up rows, then a barrier, then down rows), so every weight byte is read once per call
 * whatever the token count.  smoe_ffn_forward may be called from several threads on the same
 * context: calls are serialized on the context's pool mutex.  Blocking: call without the GIL.
 */
#ifndef SMOE_KERNELS_H
#define SMOE_KERNELS_H

#include <pthread.h>

#include "../common.h"

typedef enum smoe_wdtype {
    SMOE_WDT_F32 = 0,
    SMOE_WDT_BF16 = 1,
    SMOE_WDT_I8 = 2,
    SMOE_WDT_I4 = 3,
    SMOE_WDT_I2 = 4,
    SMOE_WDT_Q8_0 = 5,
    SMOE_WDT_Q4_K = 6,
    SMOE_WDT_Q6_K = 7,
    SMOE_WDT_Q4_0 = 8,
    SMOE_WDT_Q5_K = 9,
    SMOE_WDT_IQ4_XS = 10,
    SMOE_WDT_Q4_1 = 11,
    SMOE_WDT_Q2_K = 12,
    SMOE_WDT_Q3_K = 13,
    SMOE_WDT_MXFP4 = 14
} smoe_wdtype;

/* GGUF block formats kept as a GGUF file holds them (ggml's block_q8_0 / block_q4_K /
 * block_q6_K / block_q4_0 / block_q5_K / block_iq4_xs / block_q4_1 / block_q2_K / block_q3_K /
 * block_mxfp4, bit
 * for bit; Q4_1 is also
 * what asymmetric GPTQ / AWQ int4 repacks onto): each row of `cols` columns is cols /
 * smoe_wdt_block_cols blocks of smoe_wdt_block_bytes, the scales inside the blocks (no scale
 * tensor).  Expert FFNs only, CPU only (ffn_blocks.c). */
static inline int smoe_wdt_is_block(int32_t dt) {
    return dt == SMOE_WDT_Q8_0 || dt == SMOE_WDT_Q4_K || dt == SMOE_WDT_Q6_K ||
           dt == SMOE_WDT_Q4_0 || dt == SMOE_WDT_Q5_K || dt == SMOE_WDT_IQ4_XS ||
           dt == SMOE_WDT_Q4_1 || dt == SMOE_WDT_Q2_K || dt == SMOE_WDT_Q3_K ||
           dt == SMOE_WDT_MXFP4;
}
static inline uint32_t smoe_wdt_block_cols(int32_t dt) {
    return dt == SMOE_WDT_Q8_0 || dt == SMOE_WDT_Q4_0 || dt == SMOE_WDT_Q4_1 ||
                   dt == SMOE_WDT_MXFP4
               ? 32u
               : 256u;
}
static inline uint32_t smoe_wdt_block_bytes(int32_t dt) {
    return dt == SMOE_WDT_Q8_0     ? 34u
           : dt == SMOE_WDT_Q4_K   ? 144u
           : dt == SMOE_WDT_Q6_K   ? 210u
           : dt == SMOE_WDT_Q4_0   ? 18u
           : dt == SMOE_WDT_Q5_K   ? 176u
           : dt == SMOE_WDT_IQ4_XS ? 136u
           : dt == SMOE_WDT_Q4_1   ? 20u
           : dt == SMOE_WDT_Q2_K   ? 84u
           : dt == SMOE_WDT_Q3_K   ? 110u
           : dt == SMOE_WDT_MXFP4  ? 17u
                                   : 0u;
}
/* Weight formats the GPU kernels (cuda/ffn.cu) do not take. */
static inline int smoe_wdt_cpu_only(int32_t dt) {
    return dt == SMOE_WDT_I2 || smoe_wdt_is_block(dt);
}

typedef enum smoe_act { SMOE_ACT_SILU = 0, SMOE_ACT_GPTOSS = 1 } smoe_act;

/* Instruction sets, lowest first.  AVX512 means AVX-512 F/BW/VL/DQ (+BF16/VNNI used only when
 * present); AVX2 means AVX2 + FMA + F16C. */
typedef enum smoe_isa { SMOE_ISA_SCALAR = 0, SMOE_ISA_AVX2 = 1, SMOE_ISA_AVX512 = 2 } smoe_isa;

#define SMOE_NO_TENSOR UINT64_MAX /* offset value of an absent optional tensor */

/* Where each tensor of one expert lives inside an expert block (byte offsets from the block
 * start), plus shapes and math.  Offsets must be aligned to the element size (4 for f32
 * tensors and scales, 2 for bf16); 64-byte alignment is best.  Build it with the Python
 * FFNSpec.from_store_schema or fill it by hand, then validate with smoe_ffn_desc_check. */
typedef struct smoe_ffn_desc {
    uint32_t H;      /* hidden size (input of gate/up, output of down) */
    uint32_t I;      /* intermediate size */
    int32_t dtype;   /* smoe_wdtype, same for the three matrices */
    int32_t act;     /* smoe_act */
    float alpha;     /* GPTOSS only */
    float limit;     /* GPTOSS only */
    uint32_t group;  /* I4, I2: group size along the input dim; 0 -> 128 */
    uint64_t gate, up, down;                   /* weights (required) */
    uint64_t gate_scale, up_scale, down_scale; /* required for I8/I4, else SMOE_NO_TENSOR */
    uint64_t gate_bias, up_bias, down_bias;    /* optional, SMOE_NO_TENSOR when absent */
    uint32_t precise; /* 0 (default): fast integer/bf16-dot paths where the CPU has them (see
                         "Accuracy" at smoe_ffn_forward); 1: exact f32 math on widened weights */
    int32_t down_dtype; /* the down matrix's dtype where it differs from dtype: only a block
                           format under a block-format dtype (Q8_0 / Q4_K / Q6_K / Q4_0 /
                           Q5_K / IQ4_XS); 0 (F32, the zero of a memset descriptor) means
                           "the same as dtype" */
} smoe_ffn_desc;

/* The dtype of d's down matrix (down_dtype, or dtype when that is 0). */
static inline int32_t smoe_ffn_down_dtype(const smoe_ffn_desc *d) {
    return d->down_dtype ? d->down_dtype : d->dtype;
}

/* Fill d with shapes/dtype/act and every offset = SMOE_NO_TENSOR (alpha 1.702, limit 7.0,
 * group 128, precise 0). */
void smoe_ffn_desc_default(smoe_ffn_desc *d, uint32_t H, uint32_t I, int32_t dtype, int32_t act);

/* Validate d: dtype/act known, H,I > 0, group valid for I4 (multiple of 32 dividing H and I)
 * and I2 (multiple of 64 dividing H and I),
 * required tensors present, every tensor inside [0, block_bytes) and aligned.  Errors name the
 * tensor.  block_bytes = 0 skips the bounds check. */
int smoe_ffn_desc_check(const smoe_ffn_desc *d, uint64_t block_bytes, smoe_err *err);

/* Bytes of each weight/scale tensor for d (for writers and for the checks). */
uint64_t smoe_ffn_weight_bytes(const smoe_ffn_desc *d, uint32_t rows, uint32_t cols);
uint64_t smoe_ffn_scale_bytes(const smoe_ffn_desc *d, uint32_t rows, uint32_t cols);

/* Scratch bytes smoe_ffn_forward needs for T tokens (includes 64 bytes of alignment slack). */
size_t smoe_ffn_scratch_bytes(const smoe_ffn_desc *d, uint32_t T);

/* ---- kernel context: thread pool + ISA ---- */

typedef struct smoe_kpool smoe_kpool; /* private (kernels/pool.c) */

typedef struct smoe_kctx {
    smoe_kpool *pool;   /* owned; NULL when single-threaded */
    uint32_t nthreads;  /* threads used per call, including the caller */
    int32_t isa;        /* smoe_isa in use */
    int32_t isa_max;    /* best smoe_isa this CPU supports */
    int32_t has_bf16;   /* CPU has AVX512_BF16 */
    int32_t has_vnni;   /* CPU has AVX512_VNNI */
    uint32_t stream_pf; /* bytes ahead that the one-token bf16 and int8 row loops (one
                         * sequential stream: ffn_fast.c rows16_*) prefetch to L2; 0: none,
                         * the hardware prefetcher alone.  Init: 4096 on Intel CPUs, 0
                         * elsewhere; SPECMOE_STREAM_PREFETCH=N overrides.  Read once per call
                         * (atomically: Python may set it between calls). */
    uint64_t many_calls; /* smoe_ffn_forward_many calls on this context (atomic) */
} smoe_kctx;

#define SMOE_STREAM_PF_MAX (1u << 20) /* the largest stream_pf accepted, bytes */

/* nthreads = 0 -> number of online CPUs.  ISA: the best supported, unless the environment
 * variable SPECMOE_ISA=scalar|avx2|avx512 asks for a lower one; stream_pf: see above
 * (SPECMOE_STREAM_PREFETCH: bytes, 0 to 1 MiB). */
int smoe_kctx_init(smoe_kctx *c, uint32_t nthreads, smoe_err *err);
void smoe_kctx_free(smoe_kctx *c);
/* Change the thread count (restarts the pool) or the ISA: not while a call runs on c. */
int smoe_kctx_set_threads(smoe_kctx *c, uint32_t nthreads, smoe_err *err);
/* Force an ISA (<= isa_max, else SMOE_EINVAL); isa < 0 -> best supported. */
int smoe_kctx_set_isa(smoe_kctx *c, int32_t isa, smoe_err *err);
const char *smoe_isa_name(int32_t isa);

/* out[r_t, :] += scale[t] * FFN(x[r_t, :]) for t in [0, T), r_t = rows ? rows[t] : t.
 *   c       context (threads, ISA); NULL -> single-threaded, best ISA.
 *   d       validated descriptor (smoe_ffn_desc_check); block = the expert block.
 *   x       f32 hidden states, row r at x + r * x_stride (x_stride >= H floats).
 *   rows    T row indices into x and out, or NULL for 0..T-1 (a repeated row accumulates
 *           twice; each out column is owned by one thread, so this is race-free).
 *   scale   T routing weights, or NULL for 1.0.
 *   out     f32, row r at out + r * out_stride (out_stride >= H); accumulated into.
 *   scratch smoe_ffn_scratch_bytes(d, T) bytes, any alignment; not shared between concurrent
 *           calls.
 * T = 0 is a no-op.  Every weight byte is read once for all T tokens (tiles of 8 tokens per
 * weight row on AVX-512, 4 on AVX2; a row is re-read from L1/L2 for further tiles).
 * Accuracy: with d->precise = 1 (and on every path below AVX-512, and for F32) weights are
 * widened exactly to f32 and accumulated in f32 against f32 x, so the result matches an f32
 * computation on the dequantized weights to f32 rounding.  With precise = 0 (default) and
 * H, I multiples of 64 (int4: groups of 64 or a multiple of 128), the AVX-512 fast paths
 * round the activations once per call (x and the intermediate act): BF16 to bf16 (vdpbf16ps;
 * FFN output error ~3e-3 relative, in norm), I8 to int16 per token (vpdpwssd; ~1e-4), I4 to
 * int8 per 128 columns (vpdpbusd; ~2e-2, small next to int4's own weight error) -- details and
 * bounds in ffn_fast.c.  On AVX2 (a CPU without AVX-512 VNNI, or SPECMOE_ISA=avx2) int8 and
 * int4 take the same arithmetic with AVX2 instructions (vpmaddwd / vpmaddubsw, ffn_fast_avx2.c:
 * the same rounding, another f32 summation order); bf16 keeps the exact path there. */
int smoe_ffn_forward(smoe_kctx *c, const smoe_ffn_desc *d, const uint8_t *block, const float *x,
                     size_t x_stride, const int32_t *rows, const float *scale, uint32_t T,
                     float *out, size_t out_stride, void *scratch, smoe_err *err);

/* One expert's share of a smoe_ffn_forward_many call: smoe_ffn_forward's arguments. */
typedef struct smoe_ffn_task {
    const uint8_t *block;
    const float *x;
    size_t x_stride;
    const int32_t *rows; /* or NULL */
    const float *scale;  /* or NULL */
    uint32_t T;
    float *out;
    size_t out_stride;
} smoe_ffn_task;

/* Scratch bytes smoe_ffn_forward_many needs on c for tasks of at most maxT tokens: one
 * smoe_ffn_scratch_bytes(d, maxT) per thread of c. */
size_t smoe_ffn_many_scratch_bytes(const smoe_kctx *c, const smoe_ffn_desc *d, uint32_t maxT);

/* Several experts of one descriptor side by side: each task runs whole on one thread of c's
 * pool (threads claim tasks in order), instead of each expert's rows split across the threads
 * with two barriers per expert as smoe_ffn_forward does.  For decode-sized calls, where a
 * handful of experts each see a token or two.  Every output element is computed by the same
 * per-row code as in smoe_ffn_forward, so each task's result is bit-identical to a
 * smoe_ffn_forward call on it.  The tasks' output rows must not overlap (tasks may then
 * accumulate concurrently).  Same serialization and GIL rule as smoe_ffn_forward. */
int smoe_ffn_forward_many(smoe_kctx *c, const smoe_ffn_desc *d, const smoe_ffn_task *tasks,
                          uint32_t n, void *scratch, smoe_err *err);

/* ---- dense linear layers (attention projections, shared/dense MLP, lm_head) ----
 *
 * out[t, :] = W . x[t, :] + bias for t in [0, T): W [N, K] row-major in one of the expert weight
 * formats above (F32, BF16, I8 per-row scales, I4 groups of `group` input columns, or a GGUF
 * block format: each row K / block-columns blocks as a GGUF file holds them, read by
 * ffn_blocks.c's rows; K a multiple of the block's columns), bias [N]
 * f32 optional and separate (so that an f32/bf16 block can be the framework's own weight
 * tensor, shared rather than copied).  The rows are computed by the same per-ISA row kernels as the expert FFN's down
 * projection (one routine per format, shared), so accuracy is as stated at smoe_ffn_forward:
 * precise = 1 is exact f32 math on the widened weights; precise = 0 lets the fast paths (AVX-512,
 * and int8/int4 on AVX2) round x once per call (bf16 / int16 / int8 per 128 columns) when K is
 * a multiple of 64 (int4: with groups of 64 or a multiple of 128).
 * Offsets are from the start of the block holding the weight and its scales. */
typedef struct smoe_linear_desc {
    uint32_t N;        /* output features (rows of W) */
    uint32_t K;        /* input features */
    int32_t dtype;     /* smoe_wdtype */
    uint32_t group;    /* I4 only; 0 -> 128 */
    uint32_t precise;  /* as smoe_ffn_desc.precise */
    uint64_t w;        /* weight (required) */
    uint64_t w_scale;  /* required for I8/I4, else SMOE_NO_TENSOR */
} smoe_linear_desc;

/* Validate d against a block of block_bytes (0 skips the bounds check); errors name the tensor. */
int smoe_linear_desc_check(const smoe_linear_desc *d, uint64_t block_bytes, smoe_err *err);

/* Tokens per internal chunk of smoe_linear_forward: bounds the scratch for long prefills (the
 * weights are read once per chunk). */
#define SMOE_LINEAR_TCHUNK 64u

/* Scratch bytes smoe_linear_forward needs for any T (sized for min(T, SMOE_LINEAR_TCHUNK)). */
size_t smoe_linear_scratch_bytes(const smoe_linear_desc *d, uint32_t T);

/* out[t, :] = W . x[t, :] + bias (out is overwritten, not accumulated; bias [N] f32 or NULL).
 * x f32 rows at x + t * x_stride (x_stride >= K), out f32 rows at out + t * out_stride (>= N).
 * Same threads, serialization and GIL rule as smoe_ffn_forward.  T = 0 is a no-op. */
int smoe_linear_forward(smoe_kctx *c, const smoe_linear_desc *d, const uint8_t *block,
                        const float *bias, const float *x, size_t x_stride, uint32_t T, float *out,
                        size_t out_stride, void *scratch, smoe_err *err);

/* The gated delta rule, recurrent form (Qwen3-Next's and Qwen3.5's gated DeltaNet decode step,
 * as transformers' torch_recurrent_gated_delta_rule computes it): for each sequence b, value
 * head h (its key head h / (Hv / Hk)) and token t in order,
 *   q, k  <- q / |q|, k / |k| when l2norm (|x| = sqrt(sum x^2 + 1e-6)); then q /= sqrt(dk)
 *   u     <- beta[b,t,h] * (v - e S^T k),   e = exp(g[b,t,h])        (S: state[b, h])
 *   S     <- e S + k u^T                                            (in place)
 *   out   <- S^T q
 * q, k f32 [B, T, Hk, dk]; v, out f32 [B, T, Hv, dv]; g (the log decay), beta f32 [B, T, Hv];
 * state f32 [B, Hv, dk, dv], C order, updated in place.  Hv a multiple of Hk, dk, dv <= 512.
 * (sequence, head) pairs are split over c's threads (c NULL: the caller alone); f32 throughout,
 * the sums in another order than torch's (agreement to f32 rounding: tests/test_linear_attn.py).
 * Returns the usual status. */
int smoe_gated_delta(smoe_kctx *c, const float *q, const float *k, const float *v,
                     const float *g, const float *beta, float *state, float *out, uint32_t B,
                     uint32_t T, uint32_t Hk, uint32_t Hv, uint32_t dk, uint32_t dv,
                     int l2norm, smoe_err *err);

/* smoe_gated_delta for T tokens of one sequence whose q, k (token stride sq floats) and v
 * (stride sv) sit inside wider rows (a gated DeltaNet block's convolved q|k|v, one row a
 * token); g, beta [T, Hv], out [T, Hv, dv] as there.  hist NULL: state [Hv, dk, dv] updated in
 * place, as there; else state is only read and hist [T, Hv, dk, dv] gets the state after each
 * token (each token reads the one before and writes its own: no copy).  The same arithmetic
 * per token either way. */
int smoe_gated_delta_seq(smoe_kctx *c, const float *q, const float *k, const float *v,
                         size_t sq, size_t sv, const float *g, const float *beta, float *state,
                         float *hist, float *out, uint32_t T, uint32_t Hk, uint32_t Hv,
                         uint32_t dk, uint32_t dv, int l2norm, smoe_err *err);

/* Ceiling for benchmarks: read `bytes` of buf `iters` times with the same threads and ISA as
 * the kernels (vector loads, summed so they cannot be elided).  *bytes_per_s receives the
 * rate; the return is the usual status. */
int smoe_read_bw(smoe_kctx *c, const uint8_t *buf, size_t bytes, uint32_t iters,
                 double *bytes_per_s, smoe_err *err);

#endif

/* Expert FFN on the GPU over the CPU kernels' block layout (csrc/kernels/kernels.h).
 *
 * Two paths (smoe_gpu_ffn_forward's `path`):
 *  - dequant: one warp per output row; each lane widens 8 consecutive weights at a time to f32
 *    (bf16 bits << 16; int8 q; int4 (u - 8) with the even column in the low nibble) and
 *    accumulates against f32 x for a tile of TT tokens, then the warp reduces.  Scales are
 *    applied per row (int8) or per group of `group` columns (int4) exactly as the CPU scalar
 *    path does, so the result is the f32 computation on the dequantized weights (CPU
 *    precise=1) up to summation order.  Gate and up rows are computed by the same warp and the
 *    activation applied there; the down kernel adds the bias, multiplies by the routing
 *    weight and accumulates into out (one lane owns each out element: race-free).
 *  - cuBLAS (F32, BF16): x gathered (and for BF16 rounded to bf16 round-to-nearest-even),
 *    G = X W_gate^T and U = X W_up^T by GEMM, activation, Y = A W_down^T, then a scatter
 *    kernel (one thread per out column, tokens in order) adds bias * routing weight.
 *
 * Tokens grouped by expert: the caller passes the rows routed to this expert (as the CPU
 * smoe_ffn_forward); every weight byte is read once per tile of TT tokens (the tile's rows
 * of x stay in L1/L2).
 */
#include <cublas_v2.h>
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <stdint.h>
#include <string.h>

#include "gpu.h"

#define TT 4       /* tokens per register tile of the dequant kernels */
#define WARPS 8    /* warps (rows) per block of the dequant kernels */

/* ---- device helpers ---------------------------------------------------------------------- */

__device__ __forceinline__ float bf16_bits_to_f32(uint32_t bits16) {
    return __uint_as_float(bits16 << 16);
}

__device__ __forceinline__ float activate(int act, float alpha, float limit, float g, float u) {
    if (act == SMOE_ACT_GPTOSS) {
        g = fminf(g, limit);
        u = fminf(fmaxf(u, -limit), limit);
        float glu = g / (1.0f + expf(-alpha * g));
        return (u + 1.0f) * glu;
    }
    return g / (1.0f + expf(-g)) * u;
}

/* Widen the 8 weights of row `w` (raw bytes) at columns c..c+7 (c a multiple of 8) into f[].
 * VEC: one vector load (the caller checked 16-byte row alignment and n % 8 == 0). */
template <int DT, bool VEC>
__device__ __forceinline__ void load8(const uint8_t *w, uint32_t c, float f[8]) {
    if (DT == SMOE_WDT_F32) {
        const float *p = reinterpret_cast<const float *>(w) + c;
        if (VEC) {
            float4 a = *reinterpret_cast<const float4 *>(p);
            float4 b = *reinterpret_cast<const float4 *>(p + 4);
            f[0] = a.x; f[1] = a.y; f[2] = a.z; f[3] = a.w;
            f[4] = b.x; f[5] = b.y; f[6] = b.z; f[7] = b.w;
        } else {
            for (int k = 0; k < 8; k++) f[k] = p[k];
        }
    } else if (DT == SMOE_WDT_BF16) {
        const uint16_t *p = reinterpret_cast<const uint16_t *>(w) + c;
        if (VEC) {
            uint4 v = *reinterpret_cast<const uint4 *>(p);
            uint32_t q[4] = {v.x, v.y, v.z, v.w};
            for (int k = 0; k < 4; k++) {
                f[2 * k] = bf16_bits_to_f32(q[k] & 0xffffu);
                f[2 * k + 1] = bf16_bits_to_f32(q[k] >> 16);
            }
        } else {
            for (int k = 0; k < 8; k++) f[k] = bf16_bits_to_f32(p[k]);
        }
    } else if (DT == SMOE_WDT_I8) {
        const int8_t *p = reinterpret_cast<const int8_t *>(w) + c;
        if (VEC) {
            uint2 v = *reinterpret_cast<const uint2 *>(p);
            uint32_t q[2] = {v.x, v.y};
            for (int k = 0; k < 8; k++)
                f[k] = (float)(int8_t)((q[k >> 2] >> (8 * (k & 3))) & 0xffu);
        } else {
            for (int k = 0; k < 8; k++) f[k] = (float)p[k];
        }
    } else { /* I4: byte j holds column 2j (low nibble) and 2j+1 (high nibble) */
        const uint8_t *p = w + c / 2;
        uint32_t v;
        if (VEC) {
            v = *reinterpret_cast<const uint32_t *>(p);
        } else {
            v = (uint32_t)p[0] | ((uint32_t)p[1] << 8) | ((uint32_t)p[2] << 16) |
                ((uint32_t)p[3] << 24);
        }
        for (int k = 0; k < 8; k++) f[k] = (float)((int)((v >> (4 * k)) & 15u) - 8);
    }
}

template <int DT>
__device__ __forceinline__ float load1(const uint8_t *w, uint32_t c) {
    if (DT == SMOE_WDT_F32) return reinterpret_cast<const float *>(w)[c];
    if (DT == SMOE_WDT_BF16) return bf16_bits_to_f32(reinterpret_cast<const uint16_t *>(w)[c]);
    if (DT == SMOE_WDT_I8) return (float)reinterpret_cast<const int8_t *>(w)[c];
    uint8_t b = w[c / 2];
    return (float)((int)((c & 1u) ? (b >> 4) : (b & 15u)) - 8);
}

/* Bytes of one weight row of n columns. */
template <int DT>
__device__ __forceinline__ uint64_t row_bytes(uint32_t n) {
    return DT == SMOE_WDT_F32 ? 4ull * n : DT == SMOE_WDT_BF16 ? 2ull * n
                                         : DT == SMOE_WDT_I8   ? (uint64_t)n
                                                               : (uint64_t)n / 2;
}

/* Per-lane partial dot products of weight row r (matrix at W, scales at S) with the tile's
 * inputs xp[k] (NULL: inactive token) over n columns.  Int4 group scales are applied per
 * 8-column chunk (a chunk never straddles a group: group is a multiple of 32); the int8 row
 * scale is applied by the caller after the reduction. */
template <int DT, bool VEC>
__device__ __forceinline__ void row_dot(const uint8_t *W, const float *S, uint32_t r,
                                        uint32_t n, uint32_t group, const float *const xp[TT],
                                        float acc[TT]) {
    const uint8_t *w = W + (uint64_t)r * row_bytes<DT>(n);
    const int lane = threadIdx.x & 31;
    const uint32_t n8 = n & ~7u;
    for (uint32_t c = (uint32_t)lane * 8; c < n8; c += 256) {
        float f[8];
        load8<DT, VEC>(w, c, f);
        float s = 1.0f;
        if (DT == SMOE_WDT_I4) s = S[(uint64_t)r * (n / group) + c / group];
        for (int k = 0; k < TT; k++) {
            if (!xp[k]) continue;
            const float *x = xp[k] + c;
            float part = 0.0f;
            for (int j = 0; j < 8; j++) part = fmaf(f[j], x[j], part);
            acc[k] = fmaf(part, s, acc[k]);
        }
    }
    for (uint32_t c = n8 + (uint32_t)lane; c < n; c += 32) { /* tail (F32/BF16/I8 only) */
        float wv = load1<DT>(w, c);
        for (int k = 0; k < TT; k++)
            if (xp[k]) acc[k] = fmaf(wv, xp[k][c], acc[k]);
    }
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

/* Everything a dequant kernel needs, by value. */
struct ffn_args {
    const uint8_t *gate, *up, *down;
    const float *gate_s, *up_s, *down_s;
    const float *gate_b, *up_b, *down_b;
    const float *x;
    size_t x_stride;
    const int32_t *rows;
    const float *scale;
    uint32_t T, H, I, group;
    int act;
    float alpha, limit;
    float *actv; /* [T, I] */
    float *out;
    size_t out_stride;
};

/* Phase 1 for row i: act[t, i] = activation(gate_i . x_t + gb_i, up_i . x_t + ub_i). */
template <int DT, bool VEC>
__device__ __forceinline__ void gateup_row(const ffn_args &a, uint32_t i) {
    const int lane = threadIdx.x & 31;
    for (uint32_t t0 = 0; t0 < a.T; t0 += TT) {
        const float *xp[TT];
        for (int k = 0; k < TT; k++) {
            uint32_t t = t0 + k;
            xp[k] = t < a.T ? a.x + (size_t)(a.rows ? a.rows[t] : (int32_t)t) * a.x_stride
                            : nullptr;
        }
        float ag[TT] = {0}, au[TT] = {0};
        row_dot<DT, VEC>(a.gate, a.gate_s, i, a.H, a.group, xp, ag);
        row_dot<DT, VEC>(a.up, a.up_s, i, a.H, a.group, xp, au);
        for (int k = 0; k < TT; k++) {
            float g = warp_sum(ag[k]), u = warp_sum(au[k]);
            if (lane == k && t0 + k < a.T) {
                if (DT == SMOE_WDT_I8) {
                    g *= a.gate_s[i];
                    u *= a.up_s[i];
                }
                if (a.gate_b) g += a.gate_b[i];
                if (a.up_b) u += a.up_b[i];
                a.actv[(size_t)(t0 + k) * a.I + i] = activate(a.act, a.alpha, a.limit, g, u);
            }
        }
    }
}

/* Phase 2 for column h: v_t = down_h . act_t (* the int8 row scale) + db_h, then
 * out[r_t, h] += scale_t * v_t, or (ybuf) ybuf[t * H + h] = v_t for k_combine. */
template <int DT, bool VEC>
__device__ __forceinline__ void down_row(const ffn_args &a, uint32_t h, float *ybuf) {
    const int lane = threadIdx.x & 31;
    for (uint32_t t0 = 0; t0 < a.T; t0 += TT) {
        const float *xp[TT];
        for (int k = 0; k < TT; k++)
            xp[k] = t0 + k < a.T ? a.actv + (size_t)(t0 + k) * a.I : nullptr;
        float ay[TT] = {0};
        row_dot<DT, VEC>(a.down, a.down_s, h, a.I, a.group, xp, ay);
        /* lane 0 finishes every token of the tile in order: a row repeated in rows is then
         * accumulated by one thread, never concurrently */
        float y[TT];
        for (int k = 0; k < TT; k++) y[k] = warp_sum(ay[k]);
        if (lane == 0) {
            for (int k = 0; k < TT; k++) {
                uint32_t t = t0 + k;
                if (t >= a.T) break;
                float v = y[k];
                if (DT == SMOE_WDT_I8) v *= a.down_s[h];
                if (a.down_b) v += a.down_b[h];
                if (ybuf) {
                    ybuf[(size_t)t * a.H + h] = v;
                    continue;
                }
                float s = a.scale ? a.scale[t] : 1.0f;
                size_t r = (size_t)(a.rows ? a.rows[t] : (int32_t)t);
                a.out[r * a.out_stride + h] += s * v;
            }
        }
    }
}

template <int DT, bool VEC>
__global__ void __launch_bounds__(32 * WARPS) k_gateup(ffn_args a) {
    const uint32_t i = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (i < a.I) gateup_row<DT, VEC>(a, i);
}

template <int DT, bool VEC>
__global__ void __launch_bounds__(32 * WARPS) k_down(ffn_args a) {
    const uint32_t h = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (h < a.H) down_row<DT, VEC>(a, h, nullptr);
}

/* A group of experts (smoe_gpu_ffn_forward_group), by value: each expert's tensors at the
 * same offsets (SMOE_NO_TENSOR: none) in its block; pairs rows[first[j] ..] in the uploaded
 * arrays, scratch rows loc[j] .. loc[j + 1) of act and y. */
struct group_tab {
    const uint8_t *blk[SMOE_GPU_GROUP_MAX];
    uint32_t first[SMOE_GPU_GROUP_MAX];
    uint32_t loc[SMOE_GPU_GROUP_MAX + 1];
    uint64_t o_gate, o_up, o_down, o_gs, o_us, o_ds, o_gb, o_ub, o_db;
    float *ybuf; /* [loc[m], H] */
};

__device__ __forceinline__ const void *at(const uint8_t *b, uint64_t off) {
    return off == SMOE_NO_TENSOR ? nullptr : b + off;
}

/* The common arguments a (x, rows, scale, shapes, act, out) made expert j's. */
__device__ __forceinline__ ffn_args expert_args(const ffn_args &a, const group_tab &g,
                                                uint32_t j) {
    ffn_args e = a;
    const uint8_t *b = g.blk[j];
    e.gate = (const uint8_t *)at(b, g.o_gate);
    e.up = (const uint8_t *)at(b, g.o_up);
    e.down = (const uint8_t *)at(b, g.o_down);
    e.gate_s = (const float *)at(b, g.o_gs);
    e.up_s = (const float *)at(b, g.o_us);
    e.down_s = (const float *)at(b, g.o_ds);
    e.gate_b = (const float *)at(b, g.o_gb);
    e.up_b = (const float *)at(b, g.o_ub);
    e.down_b = (const float *)at(b, g.o_db);
    e.rows = a.rows + g.first[j];
    e.scale = a.scale ? a.scale + g.first[j] : nullptr;
    e.T = g.loc[j + 1] - g.loc[j];
    e.actv = a.actv + (size_t)g.loc[j] * a.I;
    return e;
}

/* Phase 1 of a group: blockIdx.y is the expert. */
template <int DT, bool VEC>
__global__ void __launch_bounds__(32 * WARPS) k_gateup_group(ffn_args a, group_tab g) {
    const uint32_t i = blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (i < a.I) gateup_row<DT, VEC>(expert_args(a, g, blockIdx.y), i);
}

/* Phase 2 of a group into g.ybuf (experts write disjoint rows of it). */
template <int DT, bool VEC>
__global__ void __launch_bounds__(32 * WARPS) k_down_group(ffn_args a, group_tab g) {
    const uint32_t h = blockIdx.x * WARPS + (threadIdx.x >> 5);
    const uint32_t j = blockIdx.y;
    if (h < a.H) down_row<DT, VEC>(expert_args(a, g, j), h, g.ybuf + (size_t)g.loc[j] * a.H);
}

/* Phase 3 of a group: out[r, h] += scale * y for every pair, one thread per column h, the
 * pairs in order (expert by expert, tokens in order): the additions of m per-expert calls. */
__global__ void k_combine(ffn_args a, group_tab g, uint32_t m) {
    for (uint32_t h = blockIdx.x * blockDim.x + threadIdx.x; h < a.H;
         h += gridDim.x * blockDim.x) {
        for (uint32_t j = 0; j < m; j++) {
            for (uint32_t p = g.loc[j]; p < g.loc[j + 1]; p++) {
                const uint32_t q = g.first[j] + (p - g.loc[j]);
                float s = a.scale ? a.scale[q] : 1.0f;
                float v = g.ybuf[(size_t)p * a.H + h];
                a.out[(size_t)a.rows[q] * a.out_stride + h] += s * v;
            }
        }
    }
}

/* cuBLAS path helpers. */
__global__ void k_gather(const float *x, size_t x_stride, const int32_t *rows, uint32_t T,
                         uint32_t H, float *xs, __nv_bfloat16 *xb) {
    size_t n = (size_t)T * H;
    for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (size_t)gridDim.x * blockDim.x) {
        size_t t = e / H, c = e % H;
        size_t r = (size_t)(rows ? rows[t] : (int32_t)t);
        float v = x[r * x_stride + c];
        xs[e] = v;
        if (xb) xb[e] = __float2bfloat16_rn(v);
    }
}

__global__ void k_act(const float *g, const float *u, const float *gb, const float *ub,
                      uint32_t T, uint32_t I, int act, float alpha, float limit, float *out,
                      __nv_bfloat16 *outb) {
    size_t n = (size_t)T * I;
    for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (size_t)gridDim.x * blockDim.x) {
        size_t i = e % I;
        float gv = g[e] + (gb ? gb[i] : 0.0f), uv = u[e] + (ub ? ub[i] : 0.0f);
        float v = activate(act, alpha, limit, gv, uv);
        out[e] = v;
        if (outb) outb[e] = __float2bfloat16_rn(v);
    }
}

__global__ void k_scatter(const float *y, const float *db, const int32_t *rows,
                          const float *scale, uint32_t T, uint32_t H, float *out,
                          size_t out_stride) {
    for (uint32_t h = blockIdx.x * blockDim.x + threadIdx.x; h < H; h += gridDim.x * blockDim.x) {
        float b = db ? db[h] : 0.0f;
        for (uint32_t t = 0; t < T; t++) { /* in token order: repeated rows are race-free */
            size_t r = (size_t)(rows ? rows[t] : (int32_t)t);
            float s = scale ? scale[t] : 1.0f;
            out[r * out_stride + h] += s * (y[(size_t)t * H + h] + b);
        }
    }
}

/* The hybrid tier's CPU share added into the layer's output. */
__global__ void k_add(float *out, const float *in, size_t n) {
    for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < n;
         e += (size_t)gridDim.x * blockDim.x)
        out[e] += in[e];
}

/* ---- host side --------------------------------------------------------------------------- */

static int cuda_fail(smoe_err *err, cudaError_t e, const char *what) {
    return smoe_err_set(err, SMOE_EDEVICE, "CUDA error in %s: %s (%s)", what,
                        cudaGetErrorName(e), cudaGetErrorString(e));
}

static int cublas_fail(smoe_err *err, cublasStatus_t s, const char *what) {
    return smoe_err_set(err, SMOE_EDEVICE, "cuBLAS error in %s: status %d", what, (int)s);
}

extern "C" int smoe_gpu_device_count(int *n, smoe_err *err) {
    *n = 0;
    cudaError_t e = cudaGetDeviceCount(n);
    if (e != cudaSuccess) {
        *n = 0;
        return smoe_err_set(err, SMOE_EDEVICE, "no usable CUDA device: %s (%s)",
                            cudaGetErrorName(e), cudaGetErrorString(e));
    }
    return 0;
}

extern "C" int smoe_gpu_device_info(int dev, char *name, size_t name_len, int *major, int *minor,
                                    uint64_t *total_mem, smoe_err *err) {
    cudaDeviceProp p;
    cudaError_t e = cudaGetDeviceProperties(&p, dev);
    if (e != cudaSuccess) return cuda_fail(err, e, "cudaGetDeviceProperties");
    if (name_len) {
        strncpy(name, p.name, name_len - 1);
        name[name_len - 1] = '\0';
    }
    *major = p.major;
    *minor = p.minor;
    *total_mem = (uint64_t)p.totalGlobalMem;
    return 0;
}

extern "C" void smoe_gpu_ffn_free(smoe_gpu_ffn *f) {
    if (f->cublas) cublasDestroy((cublasHandle_t)f->cublas);
    void *bufs[] = {f->xs, f->xs_bf16, f->g, f->u, f->act, f->act_bf16, f->y};
    for (size_t k = 0; k < sizeof bufs / sizeof bufs[0]; k++)
        if (bufs[k]) cudaFree(bufs[k]);
    memset(f, 0, sizeof *f);
}

extern "C" int smoe_gpu_ffn_init(smoe_gpu_ffn *f, int device, uint32_t H, uint32_t I,
                                 uint32_t max_tokens, smoe_err *err) {
    memset(f, 0, sizeof *f);
    if (H == 0 || I == 0 || max_tokens == 0)
        return smoe_err_set(err, SMOE_EINVAL, "GPU FFN: H=%u, I=%u and max_tokens=%u must be "
                            "positive", H, I, max_tokens);
    cudaError_t e = cudaSetDevice(device);
    if (e != cudaSuccess) return cuda_fail(err, e, "cudaSetDevice");
    f->device = device;
    f->H = H;
    f->I = I;
    f->max_tokens = max_tokens;
    size_t th = (size_t)max_tokens * H, ti = (size_t)max_tokens * I;
    struct { void **p; size_t bytes; } want[] = {
        {(void **)&f->xs, th * 4}, {(void **)&f->xs_bf16, th * 2}, {(void **)&f->g, ti * 4},
        {(void **)&f->u, ti * 4},  {(void **)&f->act, ti * 4},     {(void **)&f->act_bf16, ti * 2},
        {(void **)&f->y, th * 4}};
    for (size_t k = 0; k < sizeof want / sizeof want[0]; k++) {
        e = cudaMalloc(want[k].p, want[k].bytes);
        if (e != cudaSuccess) {
            smoe_gpu_ffn_free(f);
            return smoe_err_set(err, SMOE_ENOMEM, "GPU FFN: cannot allocate %zu bytes of "
                                "scratch: %s", want[k].bytes, cudaGetErrorString(e));
        }
    }
    cublasHandle_t h;
    cublasStatus_t s = cublasCreate(&h);
    if (s != CUBLAS_STATUS_SUCCESS) {
        smoe_gpu_ffn_free(f);
        return cublas_fail(err, s, "cublasCreate");
    }
    f->cublas = h;
    return 0;
}

static const void *tensor(const uint8_t *block, uint64_t off) {
    return off == SMOE_NO_TENSOR ? nullptr : block + off;
}

template <int DT, bool VEC>
static void launch_dequant(const ffn_args &a, cudaStream_t st) {
    k_gateup<DT, VEC><<<(a.I + WARPS - 1) / WARPS, 32 * WARPS, 0, st>>>(a);
    k_down<DT, VEC><<<(a.H + WARPS - 1) / WARPS, 32 * WARPS, 0, st>>>(a);
}

template <int DT>
static void launch_dequant_dt(const ffn_args &a, bool vec, cudaStream_t st) {
    if (vec)
        launch_dequant<DT, true>(a, st);
    else
        launch_dequant<DT, false>(a, st);
}

/* Row-major W [rows, cols] times row-major X [T, cols] -> row-major C [T, rows]
 * (column-major view: C^T = W^T(col-major [cols, rows]) ^T . X^T). */
static cublasStatus_t gemm(cublasHandle_t h, int bf16, const void *W, const void *X, float *C,
                           uint32_t rows, uint32_t cols, uint32_t T) {
    const float one = 1.0f, zero = 0.0f;
    if (!bf16)
        return cublasSgemm(h, CUBLAS_OP_T, CUBLAS_OP_N, (int)rows, (int)T, (int)cols, &one,
                           (const float *)W, (int)cols, (const float *)X, (int)cols, &zero, C,
                           (int)rows);
    return cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, (int)rows, (int)T, (int)cols, &one, W,
                        CUDA_R_16BF, (int)cols, X, CUDA_R_16BF, (int)cols, &zero, C, CUDA_R_32F,
                        (int)rows, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
}

static int grid_for(size_t n) {
    size_t b = (n + 255) / 256;
    return (int)(b > 4096 ? 4096 : b < 1 ? 1 : b);
}

/* The checks every FFN call makes: a descriptor the GPU kernels run, of the context's shape,
 * strides of at least H. */
static int check_call(const smoe_gpu_ffn *f, const smoe_ffn_desc *d, size_t x_stride,
                      size_t out_stride, smoe_err *err) {
    int rc = smoe_ffn_desc_check(d, 0, err);
    if (rc < 0) return rc;
    if (smoe_wdt_cpu_only(d->dtype))
        return smoe_err_set(err, SMOE_EINVAL, "int2 and GGUF block expert weights run on the CPU "
                            "only (the GPU kernels take f32, bf16, int8 and int4)");
    if (d->H != f->H || d->I != f->I)
        return smoe_err_set(err, SMOE_EINVAL, "GPU FFN context is for H=%u, I=%u; the expert "
                            "is H=%u, I=%u", f->H, f->I, d->H, d->I);
    if (x_stride < d->H || out_stride < d->H)
        return smoe_err_set(err, SMOE_EINVAL, "x_stride (%zu) and out_stride (%zu) must be at "
                            "least H = %u", x_stride, out_stride, d->H);
    return 0;
}

extern "C" int smoe_gpu_ffn_forward(smoe_gpu_ffn *f, const smoe_ffn_desc *d, const uint8_t *block,
                                    const float *x, size_t x_stride, const int32_t *rows,
                                    const float *scale, uint32_t T, float *out,
                                    size_t out_stride, int path, void *stream, smoe_err *err) {
    int rc = check_call(f, d, x_stride, out_stride, err);
    if (rc < 0) return rc;
    if (path < SMOE_GPU_PATH_AUTO || path > SMOE_GPU_PATH_CUBLAS)
        return smoe_err_set(err, SMOE_EINVAL, "unknown GPU FFN path %d", path);
    int dense = d->dtype == SMOE_WDT_F32 || d->dtype == SMOE_WDT_BF16;
    if (path == SMOE_GPU_PATH_CUBLAS && !dense)
        return smoe_err_set(err, SMOE_EINVAL, "the cuBLAS path takes f32 or bf16 experts; "
                            "int8/int4 run on the dequantizing kernels");
    int use_blas = path == SMOE_GPU_PATH_CUBLAS || (path == SMOE_GPU_PATH_AUTO && dense && !d->precise);
    if (T == 0) return 0;
    cudaStream_t st = (cudaStream_t)stream;
    cudaError_t e = cudaSetDevice(f->device);
    if (e != cudaSuccess) return cuda_fail(err, e, "cudaSetDevice");
    const uint32_t group = d->group ? d->group : 128u;

    if (!use_blas) {
        /* the dequant kernels read x and act directly (no gather): act scratch bounds the
         * tokens per launch */
        uintptr_t ag = (uintptr_t)tensor(block, d->gate), au = (uintptr_t)tensor(block, d->up),
                  ad = (uintptr_t)tensor(block, d->down);
        bool vec = ((ag | au | ad) % 16 == 0) && d->H % 8 == 0 && d->I % 8 == 0;
        for (uint32_t t0 = 0; t0 < T; t0 += f->max_tokens) {
            uint32_t n = T - t0 < f->max_tokens ? T - t0 : f->max_tokens;
            ffn_args a;
            a.gate = (const uint8_t *)tensor(block, d->gate);
            a.up = (const uint8_t *)tensor(block, d->up);
            a.down = (const uint8_t *)tensor(block, d->down);
            a.gate_s = (const float *)tensor(block, d->gate_scale);
            a.up_s = (const float *)tensor(block, d->up_scale);
            a.down_s = (const float *)tensor(block, d->down_scale);
            a.gate_b = (const float *)tensor(block, d->gate_bias);
            a.up_b = (const float *)tensor(block, d->up_bias);
            a.down_b = (const float *)tensor(block, d->down_bias);
            a.rows = rows ? rows + t0 : nullptr;
            a.x = rows ? x : x + (size_t)t0 * x_stride;
            a.x_stride = x_stride;
            a.scale = scale ? scale + t0 : nullptr;
            a.T = n;
            a.H = d->H;
            a.I = d->I;
            a.group = group;
            a.act = d->act;
            a.alpha = d->alpha;
            a.limit = d->limit;
            a.actv = f->act;
            a.out = rows ? out : out + (size_t)t0 * out_stride;
            a.out_stride = out_stride;
            switch (d->dtype) {
            case SMOE_WDT_F32: launch_dequant_dt<SMOE_WDT_F32>(a, vec, st); break;
            case SMOE_WDT_BF16: launch_dequant_dt<SMOE_WDT_BF16>(a, vec, st); break;
            case SMOE_WDT_I8: launch_dequant_dt<SMOE_WDT_I8>(a, vec, st); break;
            default: launch_dequant_dt<SMOE_WDT_I4>(a, vec, st); break;
            }
            e = cudaGetLastError();
            if (e != cudaSuccess) return cuda_fail(err, e, "the dequantizing FFN kernels");
        }
        return 0;
    }

    cublasHandle_t h = (cublasHandle_t)f->cublas;
    cublasStatus_t s = cublasSetStream(h, st);
    if (s != CUBLAS_STATUS_SUCCESS) return cublas_fail(err, s, "cublasSetStream");
    const int bf16 = d->dtype == SMOE_WDT_BF16;
    for (uint32_t t0 = 0; t0 < T; t0 += f->max_tokens) {
        uint32_t n = T - t0 < f->max_tokens ? T - t0 : f->max_tokens;
        const int32_t *r = rows ? rows + t0 : nullptr;
        const float *xb = rows ? x : x + (size_t)t0 * x_stride;
        float *ob = rows ? out : out + (size_t)t0 * out_stride;
        const float *sc = scale ? scale + t0 : nullptr;
        k_gather<<<grid_for((size_t)n * d->H), 256, 0, st>>>(
            xb, x_stride, r, n, d->H, f->xs, bf16 ? (__nv_bfloat16 *)f->xs_bf16 : nullptr);
        const void *X = bf16 ? (const void *)f->xs_bf16 : (const void *)f->xs;
        if ((s = gemm(h, bf16, tensor(block, d->gate), X, f->g, d->I, d->H, n)) ||
            (s = gemm(h, bf16, tensor(block, d->up), X, f->u, d->I, d->H, n)))
            return cublas_fail(err, s, "gate/up GEMM");
        k_act<<<grid_for((size_t)n * d->I), 256, 0, st>>>(
            f->g, f->u, (const float *)tensor(block, d->gate_bias),
            (const float *)tensor(block, d->up_bias), n, d->I, d->act, d->alpha, d->limit,
            f->act, bf16 ? (__nv_bfloat16 *)f->act_bf16 : nullptr);
        const void *A = bf16 ? (const void *)f->act_bf16 : (const void *)f->act;
        if ((s = gemm(h, bf16, tensor(block, d->down), A, f->y, d->H, d->I, n)))
            return cublas_fail(err, s, "down GEMM");
        k_scatter<<<grid_for(d->H), 256, 0, st>>>(f->y, (const float *)tensor(block, d->down_bias),
                                                  r, sc, n, d->H, ob, out_stride);
        e = cudaGetLastError();
        if (e != cudaSuccess) return cuda_fail(err, e, "the cuBLAS-path FFN kernels");
    }
    return 0;
}

template <int DT, bool VEC>
static void launch_group(const ffn_args &a, const group_tab &g, uint32_t m, cudaStream_t st) {
    k_gateup_group<DT, VEC><<<dim3((a.I + WARPS - 1) / WARPS, m), 32 * WARPS, 0, st>>>(a, g);
    k_down_group<DT, VEC><<<dim3((a.H + WARPS - 1) / WARPS, m), 32 * WARPS, 0, st>>>(a, g);
    k_combine<<<grid_for(a.H), 256, 0, st>>>(a, g, m);
}

template <int DT>
static void launch_group_dt(const ffn_args &a, const group_tab &g, uint32_t m, bool vec,
                            cudaStream_t st) {
    if (vec)
        launch_group<DT, true>(a, g, m, st);
    else
        launch_group<DT, false>(a, g, m, st);
}

extern "C" int smoe_gpu_ffn_forward_group(smoe_gpu_ffn *f, const smoe_ffn_desc *d, uint32_t m,
                                          const uint8_t *const *blocks, const uint32_t *first,
                                          const uint32_t *count, const float *x,
                                          size_t x_stride, const int32_t *rows,
                                          const float *scale, float *out, size_t out_stride,
                                          void *stream, smoe_err *err) {
    int rc = check_call(f, d, x_stride, out_stride, err);
    if (rc < 0) return rc;
    if (m == 0 || m > SMOE_GPU_GROUP_MAX || !rows)
        return smoe_err_set(err, SMOE_EINVAL, "GPU FFN group: %u experts (1 to %d) and rows "
                            "are required", m, SMOE_GPU_GROUP_MAX);
    group_tab g;
    memset(&g, 0, sizeof g);
    uintptr_t align = 0;
    g.loc[0] = 0;
    for (uint32_t j = 0; j < m; j++) {
        if (count[j] == 0 || g.loc[j] + count[j] > f->max_tokens)
            return smoe_err_set(err, SMOE_EINVAL, "GPU FFN group: expert %u has %u pairs (the "
                                "group at most %u in all, each at least 1)", j, count[j],
                                f->max_tokens);
        g.blk[j] = blocks[j];
        g.first[j] = first[j];
        g.loc[j + 1] = g.loc[j] + count[j];
        align |= (uintptr_t)blocks[j];
    }
    g.o_gate = d->gate, g.o_up = d->up, g.o_down = d->down;
    g.o_gs = d->gate_scale, g.o_us = d->up_scale, g.o_ds = d->down_scale;
    g.o_gb = d->gate_bias, g.o_ub = d->up_bias, g.o_db = d->down_bias;
    g.ybuf = f->y;
    const bool vec = ((align | d->gate | d->up | d->down) % 16 == 0) && d->H % 8 == 0 &&
                     d->I % 8 == 0;
    cudaStream_t st = (cudaStream_t)stream;
    cudaError_t e = cudaSetDevice(f->device);
    if (e != cudaSuccess) return cuda_fail(err, e, "cudaSetDevice");
    ffn_args a;
    memset(&a, 0, sizeof a);
    a.x = x;
    a.x_stride = x_stride;
    a.rows = rows;
    a.scale = scale;
    a.H = d->H;
    a.I = d->I;
    a.group = d->group ? d->group : 128u;
    a.act = d->act;
    a.alpha = d->alpha;
    a.limit = d->limit;
    a.actv = f->act;
    a.out = out;
    a.out_stride = out_stride;
    switch (d->dtype) {
    case SMOE_WDT_F32: launch_group_dt<SMOE_WDT_F32>(a, g, m, vec, st); break;
    case SMOE_WDT_BF16: launch_group_dt<SMOE_WDT_BF16>(a, g, m, vec, st); break;
    case SMOE_WDT_I8: launch_group_dt<SMOE_WDT_I8>(a, g, m, vec, st); break;
    default: launch_group_dt<SMOE_WDT_I4>(a, g, m, vec, st); break;
    }
    e = cudaGetLastError();
    return e == cudaSuccess ? 0 : cuda_fail(err, e, "the grouped FFN kernels");
}

extern "C" int smoe_gpu_add_f32(float *out, const float *in, size_t n, void *stream,
                                smoe_err *err) {
    if (!n) return 0;
    k_add<<<grid_for(n), 256, 0, (cudaStream_t)stream>>>(out, in, n);
    cudaError_t e = cudaGetLastError();
    return e == cudaSuccess ? 0 : cuda_fail(err, e, "adding the CPU's share (k_add)");
}

/* GPU tier (issue 12): expert FFN kernels on the GPU and the GPU expert cache.
 *
 * This header is plain C (no CUDA types): streams and device pointers are passed as void*,
 * so the CPython binding (csrc/bindings/py_cuda.c, compiled by the host C compiler) and the CUDA
 * sources (cuda/ffn.cu, compiled by nvcc) share it.  Everything here is linked into the
 * separate extension specmoe._cuda only; specmoe._C never depends on CUDA.
 *
 * Weight layout: the expert block is byte-for-byte the block of the CPU kernels and of the
 * store (csrc/kernels/kernels.h: F32, BF16, I8 per-row scales, I4 groups with the low nibble
 * holding the even column; optional f32 biases; SiLU and GPT-OSS activations).  A block is
 * copied to the GPU unchanged; the kernels dequantize it there.
 */
#ifndef SMOE_GPU_H
#define SMOE_GPU_H

#ifdef __cplusplus
extern "C" { /* the C core's headers have no guards of their own */
#endif

#include "common.h"
#include "kernels/kernels.h"

/* ---- devices --------------------------------------------------------------------------- */

/* Number of CUDA devices into *n.  No driver / no device: SMOE_EDEVICE with the runtime's
 * reason (the caller turns it into a clear "no GPU" message). */
int smoe_gpu_device_count(int *n, smoe_err *err);

/* Name, compute capability and memory of device `dev`. */
int smoe_gpu_device_info(int dev, char *name, size_t name_len, int *major, int *minor,
                         uint64_t *total_mem, smoe_err *err);

/* ---- expert FFN on the GPU --------------------------------------------------------------- */

/* Per-caller FFN context: a cuBLAS handle and device scratch for up to max_tokens tokens of
 * an expert of shape (H, I), allocated once at init (forward never allocates; more tokens
 * than max_tokens are processed in chunks).  One context is used by one thread at a time. */
typedef struct smoe_gpu_ffn {
    int device;
    uint32_t H, I, max_tokens;
    void *cublas;      /* cublasHandle_t, owned */
    float *xs;         /* [max_tokens, H] gathered x (f32) */
    uint16_t *xs_bf16; /* [max_tokens, H] x rounded to bf16 (cuBLAS bf16 path) */
    float *g, *u;      /* [max_tokens, I] gate / up outputs (cuBLAS path) */
    float *act;        /* [max_tokens, I] activations */
    uint16_t *act_bf16;/* [max_tokens, I] activations rounded to bf16 (cuBLAS bf16 path) */
    float *y;          /* [max_tokens, H] down outputs (cuBLAS path) */
} smoe_gpu_ffn;

int smoe_gpu_ffn_init(smoe_gpu_ffn *f, int device, uint32_t H, uint32_t I, uint32_t max_tokens,
                      smoe_err *err);
void smoe_gpu_ffn_free(smoe_gpu_ffn *f);

/* Paths of smoe_gpu_ffn_forward. */
enum {
    SMOE_GPU_PATH_AUTO = 0,   /* F32/BF16 -> cuBLAS unless d->precise; I8/I4 -> dequant GEMV */
    SMOE_GPU_PATH_DEQUANT = 1,/* the dequantizing kernels for every dtype: weights widened to
                                 f32 exactly, f32 accumulation (the CPU precise=1 math) */
    SMOE_GPU_PATH_CUBLAS = 2  /* cuBLAS GEMM (F32: SGEMM, TF32 off; BF16: x and act rounded to
                                 bf16, f32 accumulation) -- F32/BF16 only */
};

/* out[r_t, :] += scale[t] * FFN(x[r_t, :]) for t in [0, T) on `stream` (cudaStream_t; NULL:
 * the legacy default stream), asynchronously: nothing waits on the host.  All pointers are
 * device pointers: block (the expert block, laid out as d says), x (f32, row stride
 * x_stride floats), rows (T int32 row indices, or NULL for 0..T-1), scale (T f32, or NULL
 * for 1), out (f32, row stride out_stride).  d must pass smoe_ffn_desc_check and match the
 * context's H, I.  A row repeated in rows accumulates twice (one thread owns each out
 * element of a call, so that is race-free).  Launch errors come back as SMOE_EDEVICE naming
 * the kernel. */
int smoe_gpu_ffn_forward(smoe_gpu_ffn *f, const smoe_ffn_desc *d, const uint8_t *block,
                         const float *x, size_t x_stride, const int32_t *rows,
                         const float *scale, uint32_t T, float *out, size_t out_stride,
                         int path, void *stream, smoe_err *err);

/* smoe_gpu_ffn_forward for m experts of format d at once, on the dequantizing kernels in
 * three launches (gate/up of every expert, down of every expert into scratch, then each out
 * element summed over the pairs in order: the same additions, in the same order, as m calls
 * of the dequant path): expert j on blocks[j] (device) with pairs rows[first[j] ..
 * first[j] + count[j]) and scale likewise (device arrays).  1 <= m <= SMOE_GPU_GROUP_MAX,
 * each count[j] >= 1 and their sum <= the context's max_tokens (else SMOE_EINVAL). */
#define SMOE_GPU_GROUP_MAX 32
int smoe_gpu_ffn_forward_group(smoe_gpu_ffn *f, const smoe_ffn_desc *d, uint32_t m,
                               const uint8_t *const *blocks, const uint32_t *first,
                               const uint32_t *count, const float *x, size_t x_stride,
                               const int32_t *rows, const float *scale, float *out,
                               size_t out_stride, void *stream, smoe_err *err);

/* out[0..n) += in[0..n) (device pointers, f32) on `stream`, asynchronously. */
int smoe_gpu_add_f32(float *out, const float *in, size_t n, void *stream, smoe_err *err);

#ifdef __cplusplus
}
#endif

#endif

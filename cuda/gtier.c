/* The GPU cache's ops as an expert tier (gtier.h). */
#include "gtier.h"

#include <cuda_runtime_api.h>
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

static int cu_fail(smoe_err *err, cudaError_t e, const char *what) {
    return smoe_err_set(err, SMOE_EDEVICE, "GPU tier: %s failed: %s (%s)", what,
                        cudaGetErrorName(e), cudaGetErrorString(e));
}

static int emu(const smoe_gtier *t) { return t->device < 0; }

/* Device buffer *buf of *cap bytes grown to at least need: it grows with the largest call (a
 * prefill), then stays.  The stream is drained first, since work enqueued on it may still
 * read the old buffer.  `what` names the buffer in errors. */
static int grow_dev(void **buf, size_t *cap, size_t need, void *stream, const char *what,
                    smoe_err *err) {
    if (need <= *cap) return SMOE_OK;
    cudaError_t e;
    if (*buf && (e = cudaStreamSynchronize((cudaStream_t)stream)) != cudaSuccess)
        return smoe_err_set(err, SMOE_EDEVICE, "GPU tier: waiting for the stream before growing "
                            "%s failed: %s (%s)", what, cudaGetErrorName(e),
                            cudaGetErrorString(e));
    cudaFree(*buf);
    *buf = NULL, *cap = 0;
    if ((e = cudaMalloc(buf, need)) != cudaSuccess)
        return smoe_err_set(err, SMOE_EDEVICE, "GPU tier: allocating %s (%zu bytes) failed: "
                            "%s (%s)", what, need, cudaGetErrorName(e), cudaGetErrorString(e));
    *cap = need;
    return SMOE_OK;
}

static int t_check(void *ctx, const smoe_ffn_desc *d, smoe_err *err) {
    const smoe_gtier *t = ctx;
    if (d->H != t->H || d->I != t->I)
        return smoe_err_set(err, SMOE_EINVAL, "GPU tier: built for experts of H=%u, I=%u; this "
                            "one is H=%u, I=%u", t->H, t->I, d->H, d->I);
    if (smoe_wdt_cpu_only(d->dtype))
        return smoe_err_set(err, SMOE_EINVAL, "int2 and GGUF block expert weights run on the CPU "
                            "only (the GPU kernels take f32, bf16, int8 and int4)");
    return SMOE_OK;
}

static int t_zero(void *ctx, float *out, size_t n, void *stream, smoe_err *err) {
    smoe_gtier *t = ctx;
    if (emu(t)) {
        memset(out, 0, sizeof *out * n);
        return SMOE_OK;
    }
    cudaError_t e = cudaMemsetAsync(out, 0, sizeof *out * n, (cudaStream_t)stream);
    return e == cudaSuccess ? SMOE_OK : cu_fail(err, e, "zeroing the layer's output");
}

static int t_upload(void *ctx, const int32_t *rows, const float *scale, uint32_t n,
                    const int32_t **rows_t, const float **scale_t, void *stream,
                    smoe_err *err) {
    smoe_gtier *t = ctx;
    if (emu(t)) { /* host memory already */
        *rows_t = rows, *scale_t = scale;
        return SMOE_OK;
    }
    const size_t rb = (sizeof *rows * (size_t)n + 255) & ~(size_t)255;
    const size_t need = rb + sizeof *scale * (size_t)n;
    cudaError_t e;
    int rc = grow_dev(&t->dbuf, &t->dcap, need, stream, "the pair buffer", err);
    if (rc) return rc;
    /* from pageable memory: each returns once its source is staged, so the caller may reuse
     * rows and scale at once; the device copies stay ordered on stream before the kernels */
    uint8_t *d = t->dbuf;
    if ((e = cudaMemcpyAsync(d, rows, sizeof *rows * (size_t)n, cudaMemcpyHostToDevice,
                             (cudaStream_t)stream)) != cudaSuccess ||
        (e = cudaMemcpyAsync(d + rb, scale, sizeof *scale * (size_t)n, cudaMemcpyHostToDevice,
                             (cudaStream_t)stream)) != cudaSuccess)
        return cu_fail(err, e, "copying the layer's rows and weights");
    *rows_t = (const int32_t *)d, *scale_t = (const float *)(d + rb);
    return SMOE_OK;
}

static int t_expert(void *ctx, const smoe_ffn_desc *d, const uint8_t *block, const float *x,
                    const int32_t *rows, const float *scale, uint32_t n, float *out,
                    void *stream, smoe_err *err) {
    smoe_gtier *t = ctx;
    if (!emu(t))
        return smoe_gpu_ffn_forward(&t->ffn, d, block, x, d->H, rows, scale, n, out, d->H,
                                    SMOE_GPU_PATH_AUTO, stream, err);
    const size_t need = smoe_ffn_scratch_bytes(d, n);
    if (need > t->scap) {
        void *p = realloc(t->scratch, need);
        if (!p) return smoe_err_set(err, SMOE_ENOMEM, "GPU tier: %zu bytes of scratch", need);
        t->scratch = p, t->scap = need;
    }
    return smoe_ffn_forward(NULL, d, block, x, d->H, rows, scale, n, out, d->H, t->scratch,
                            err);
}

static int t_experts(void *ctx, const smoe_ffn_desc *d, uint32_t m, const uint8_t *const *blocks,
                     const uint32_t *first, const uint32_t *count, const float *x,
                     const int32_t *rows, const float *scale, float *out, void *stream,
                     smoe_err *err) {
    smoe_gtier *t = ctx;
    if (!emu(t))
        return smoe_gpu_ffn_forward_group(&t->ffn, d, m, blocks, first, count, x, d->H, rows,
                                          scale, out, d->H, stream, err);
    for (uint32_t j = 0; j < m; j++) { /* the emulation: the per-expert calls, in order */
        int rc = t_expert(ctx, d, blocks[j], x, rows + first[j], scale + first[j], count[j],
                          out, stream, err);
        if (rc) return rc;
    }
    return SMOE_OK;
}

static int t_acquire(void *ctx, uint32_t layer, uint32_t expert, void *stream,
                     const uint8_t **block, smoe_err *err) {
    return smoe_gcache_acquire(((smoe_gtier *)ctx)->cache, layer, expert, stream, block, err);
}

static int t_release(void *ctx, uint32_t layer, uint32_t expert, void *stream, smoe_err *err) {
    return smoe_gcache_release(((smoe_gtier *)ctx)->cache, layer, expert, stream, err);
}

static int t_host_block(void *ctx, uint32_t layer, uint32_t expert, const uint8_t **block,
                        smoe_err *err) {
    smoe_gtier *t = ctx;
    const smoe_gcache *c = t->cache;
    const smoe_store *st = c->store;
    if (layer >= st->num_layers || expert >= st->num_experts)
        return smoe_err_set(err, SMOE_EINVAL, "GPU tier: expert (%u, %u) out of range %u x %u",
                            layer, expert, st->num_layers, st->num_experts);
    const uint64_t key = (uint64_t)layer * st->num_experts + expert;
    if (c->host_copy) { /* verified when it was read */
        *block = c->host_copy + key * st->block_bytes;
        return SMOE_OK;
    }
    if (!t->map)
        return smoe_err_set(err, SMOE_ESTATE, "GPU tier: no host path to the experts");
    const uint8_t *b = t->map + st->data_offset + key * st->block_bytes;
    if (t->checked && !t->checked[key]) {
        const uint32_t got = smoe_crc32c(0, b, st->block_bytes);
        if (got != st->crc[key])
            return smoe_err_set(err, SMOE_ECORRUPT, "%s: checksum mismatch in layer %u expert "
                                "%u (offset %llu), read through the hybrid tier's mapping",
                                st->path, layer, expert,
                                (unsigned long long)(st->data_offset + key * st->block_bytes));
        t->checked[key] = 1;
    }
    *block = b;
    return SMOE_OK;
}

static int t_add_host(void *ctx, float *out, const float *host, size_t n, void *stream,
                      smoe_err *err) {
    smoe_gtier *t = ctx;
    if (emu(t)) {
        for (size_t i = 0; i < n; i++) out[i] += host[i];
        return SMOE_OK;
    }
    const size_t need = sizeof *host * n;
    cudaError_t e;
    int rc = grow_dev(&t->abuf, &t->acap, need, stream, "the CPU share's buffer", err);
    if (rc) return rc;
    /* from pageable memory: returns once the source is staged (host reusable at once); the
     * copy stays ordered on stream before the add */
    if ((e = cudaMemcpyAsync(t->abuf, host, need, cudaMemcpyHostToDevice,
                             (cudaStream_t)stream)) != cudaSuccess)
        return cu_fail(err, e, "copying the CPU's share of the layer");
    return smoe_gpu_add_f32(out, t->abuf, n, stream, err);
}

static const smoe_tier_ops gtier_ops = {t_check,   t_zero,    t_upload,     t_expert,
                                        t_experts, t_acquire, t_release,    t_host_block,
                                        t_add_host};
/* grouped = 0: one kernel call per expert (the A/B of grouped launches) */
static const smoe_tier_ops gtier_ops_single = {t_check,   t_zero,    t_upload,     t_expert,
                                               NULL,      t_acquire, t_release,    t_host_block,
                                               t_add_host};

int smoe_gtier_init(smoe_gtier *t, smoe_gcache *cache, uint32_t H, uint32_t I, int grouped,
                    smoe_err *err) {
    memset(t, 0, sizeof *t);
    t->cache = cache;
    t->grouped = grouped != 0;
    t->device = cache->device;
    t->H = H, t->I = I;
    const smoe_store *st = cache->store;
    if (!cache->host_copy) { /* staged: the hybrid tier computes from the mapped file */
        const uint64_t n = (uint64_t)st->num_layers * st->num_experts;
        const size_t len = (size_t)(st->data_offset + n * st->block_bytes);
        void *m = mmap(NULL, len, PROT_READ, MAP_SHARED, st->fd, 0);
        if (m == MAP_FAILED)
            return smoe_err_set(err, SMOE_EIO, "GPU tier: mapping %s (%zu bytes) failed: %s",
                                st->path, len, strerror(errno));
        t->map = m, t->map_len = len;
        if (st->crc && (st->flags & SMOE_STORE_VERIFY) && !(t->checked = calloc(n, 1))) {
            smoe_gtier_free(t);
            return smoe_err_set(err, SMOE_ENOMEM, "GPU tier: no memory for %llu flags",
                                (unsigned long long)n);
        }
    }
    if (!emu(t)) {
        int rc = smoe_gpu_ffn_init(&t->ffn, t->device, H, I, SMOE_TIER_GROUP_PAIRS, err);
        if (rc) {
            smoe_gtier_free(t);
            return rc;
        }
        t->ffn_ready = 1;
    }
    return SMOE_OK;
}

void smoe_gtier_free(smoe_gtier *t) {
    if (t->ffn_ready) smoe_gpu_ffn_free(&t->ffn);
    if (t->dbuf) cudaFree(t->dbuf);
    if (t->abuf) cudaFree(t->abuf);
    if (t->map) munmap((void *)t->map, t->map_len);
    free(t->checked);
    free(t->scratch);
    memset(t, 0, sizeof *t);
}

smoe_tier smoe_gtier_tier(smoe_gtier *t) {
    return (smoe_tier){&t->cache->tab, NULL, t->grouped ? &gtier_ops : &gtier_ops_single, t};
}

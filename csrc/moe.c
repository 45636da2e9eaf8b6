/* MoE layer: token grouping, expert fetch through a source, one kernel call per expert.
 * See moe.h. */
#include "moe.h"

#include "cache.h"

#include <stdlib.h>
#include <string.h>

int smoe_moe_forward(smoe_kctx *kc, const smoe_ffn_desc *d, const smoe_moe_source *src,
                     uint32_t layer, uint32_t num_experts, const float *x, uint32_t T,
                     const int64_t *idx, const float *w, uint32_t k, float *out, uint8_t *used,
                     smoe_err *err) {
    return smoe_moe_forward_ex(kc, d, src, layer, num_experts, x, T, idx, w, k, NULL, out, used,
                               err);
}

int smoe_moe_forward_ex(smoe_kctx *kc, const smoe_ffn_desc *d, const smoe_moe_source *src,
                        uint32_t layer, uint32_t num_experts, const float *x, uint32_t T,
                        const int64_t *idx, const float *w, uint32_t k, const uint8_t *take,
                        float *out, uint8_t *used, smoe_err *err) {
    return smoe_moe_forward_order(kc, d, src, layer, num_experts, x, T, idx, w, k, take, NULL,
                                  0, out, used, err);
}

/* Add each pair's row of contrib into its token's row of out, pairs in expert order: a token's
 * experts in ascending id. */
static void sum_pairs(float *out, const float *contrib, const int32_t *rows, uint32_t npairs,
                      uint32_t H) {
    for (uint32_t p = 0; p < npairs; p++) {
        float *o = out + (size_t)rows[p] * H;
        const float *c = contrib + (size_t)p * H;
        for (uint32_t h = 0; h < H; h++) o[h] += c[h];
    }
}

/* The expert-parallel path (moe.h): pairs sorted by expert (start, rows, scale), at most
 * maxn per expert; out zeroed.  All needed experts are pinned in the visit order, computed
 * by smoe_ffn_forward_many into per-pair rows, released, then summed. */
static int forward_parallel(smoe_kctx *kc, const smoe_ffn_desc *d, const smoe_moe_source *src,
                            uint32_t layer, uint32_t num_experts, const float *x,
                            const uint32_t *start, const int32_t *rows, const float *scale,
                            uint32_t maxn, const uint32_t *order, float *out, uint8_t *used,
                            smoe_err *err) {
    const uint32_t H = d->H, npairs = start[num_experts];
    float *xg = malloc(sizeof *xg * (size_t)npairs * H);
    float *contrib = calloc((size_t)npairs * H, sizeof *contrib);
    smoe_ffn_task *tasks = malloc(sizeof *tasks * num_experts);
    uint32_t *pinned = malloc(sizeof *pinned * num_experts);
    void *scratch = malloc(smoe_ffn_many_scratch_bytes(kc, d, maxn));
    uint32_t n = 0;
    int rc = SMOE_OK;
    if (!xg || !contrib || !tasks || !pinned || !scratch) {
        rc = smoe_err_set(err, SMOE_ENOMEM, "moe layer %u: no memory for %u expert pairs", layer,
                          npairs);
        goto done;
    }
    for (uint32_t p = 0; p < npairs; p++)
        memcpy(xg + (size_t)p * H, x + (size_t)rows[p] * H, sizeof *xg * H);
    for (uint32_t q = 0; q < num_experts; q++) {
        const uint32_t e = order ? order[q] : q;
        if (start[e + 1] == start[e]) continue;
        if (used) used[e] = 1;
        const uint8_t *block = NULL;
        if ((rc = src->acquire(src->ctx, layer, e, &block, err))) goto done;
        pinned[n] = e;
        tasks[n++] = (smoe_ffn_task){block, xg + (size_t)start[e] * H, H, NULL, scale + start[e],
                                     start[e + 1] - start[e], contrib + (size_t)start[e] * H, H};
    }
    rc = smoe_ffn_forward_many(kc, d, tasks, n, scratch, err);
done:
    for (uint32_t i = 0; i < n; i++) { /* the first error wins */
        int rr = src->release(src->ctx, layer, pinned[i], rc ? NULL : err);
        if (!rc) rc = rr;
    }
    if (!rc) sum_pairs(out, contrib, rows, npairs, H);
    free(xg);
    free(contrib);
    free(tasks);
    free(pinned);
    free(scratch);
    return rc;
}

int smoe_moe_forward_order(smoe_kctx *kc, const smoe_ffn_desc *d, const smoe_moe_source *src,
                           uint32_t layer, uint32_t num_experts, const float *x, uint32_t T,
                           const int64_t *idx, const float *w, uint32_t k, const uint8_t *take,
                           const uint32_t *order, int fixed_sum, float *out, uint8_t *used,
                           smoe_err *err) {
    const uint32_t H = d->H;
    const size_t nk = (size_t)T * k;
    memset(out, 0, sizeof(float) * (size_t)T * H);
    if (used) memset(used, 0, num_experts);
    if (nk == 0) return SMOE_OK;
    for (size_t i = 0; i < nk; i++)
        if (idx[i] < 0 || idx[i] >= (int64_t)num_experts)
            return smoe_err_set(err, SMOE_EINVAL,
                                "moe layer %u: token %zu slot %zu routes to expert %lld, outside "
                                "0..%u",
                                layer, i / k, i % k, (long long)idx[i], num_experts - 1);
    /* counting sort of (token, slot) pairs by expert; token order kept inside an expert */
    uint32_t *start = calloc((size_t)num_experts + 1, sizeof *start);
    uint32_t *fill = malloc(sizeof *fill * num_experts);
    int32_t *rows = malloc(sizeof *rows * nk);
    float *scale = malloc(sizeof *scale * nk);
    void *scratch = NULL;
    float *contrib = NULL, *xg = NULL; /* fixed_sum: per-pair contributions, gathered rows */
    int rc = SMOE_OK;
    if (!start || !fill || !rows || !scale) {
        rc = smoe_err_set(err, SMOE_ENOMEM, "moe layer %u: no memory for %u tokens", layer, T);
        goto done;
    }
    for (size_t i = 0; i < nk; i++)
        if (!take || take[i]) start[idx[i] + 1]++;
    uint32_t maxn = 0, nexp = 0;
    for (uint32_t e = 0; e < num_experts; e++) {
        uint32_t n = start[e + 1];
        if (n > maxn) maxn = n;
        nexp += n > 0;
        start[e + 1] += start[e];
    }
    memcpy(fill, start, sizeof *fill * num_experts);
    for (size_t i = 0; i < nk; i++) {
        if (take && !take[i]) continue;
        uint32_t p = fill[idx[i]]++;
        rows[p] = (int32_t)(i / k);
        scale[p] = w[i];
    }
    for (uint32_t e = 0; e < num_experts; e++) /* distinct rows: the kernel's contract */
        for (uint32_t p = start[e] + 1; p < start[e + 1]; p++)
            if (rows[p] == rows[p - 1]) {
                rc = smoe_err_set(err, SMOE_EINVAL,
                                  "moe layer %u: token %d routes to expert %u more than once",
                                  layer, rows[p], e);
                goto done;
            }
    if (order) /* checked before anything is pinned */
        for (uint32_t q = 0; q < num_experts; q++)
            if (order[q] >= num_experts) {
                rc = smoe_err_set(err, SMOE_EINVAL, "moe layer %u: visit order names expert %u "
                                  "of %u", layer, order[q], num_experts);
                goto done;
            }
    if (src->multi_pin && kc && kc->pool && nexp >= kc->nthreads && nexp >= 2 &&
        maxn <= SMOE_MOE_EP_MAX_TOKENS) {
        rc = forward_parallel(kc, d, src, layer, num_experts, x, start, rows, scale, maxn, order,
                              out, used, err);
        goto done;
    }
    size_t nrows = (size_t)start[num_experts] + 1;
    if (!(scratch = malloc(smoe_ffn_scratch_bytes(d, maxn))) ||
        (fixed_sum && (!(contrib = malloc(sizeof *contrib * nrows * H)) ||
                       !(xg = malloc(sizeof *xg * ((size_t)maxn + 1) * H))))) {
        rc = smoe_err_set(err, SMOE_ENOMEM, "moe layer %u: no kernel scratch for %u tokens",
                          layer, maxn);
        goto done;
    }
    for (uint32_t q = 0; q < num_experts; q++) {
        const uint32_t e = order ? order[q] : q;
        uint32_t n = start[e + 1] - start[e];
        if (!n) continue;
        if (used) used[e] = 1;
        const uint8_t *block = NULL;
        rc = src->acquire(src->ctx, layer, e, &block, err);
        if (rc) goto done;
        if (fixed_sum) { /* this expert's weighted outputs into rows of their own */
            float *c = contrib + (size_t)start[e] * H;
            memset(c, 0, sizeof *c * (size_t)n * H);
            for (uint32_t i = 0; i < n; i++)
                memcpy(xg + (size_t)i * H, x + (size_t)rows[start[e] + i] * H, sizeof *xg * H);
            rc = smoe_ffn_forward(kc, d, block, xg, H, NULL, scale + start[e], n, c, H, scratch,
                                  err);
        } else {
            rc = smoe_ffn_forward(kc, d, block, x, H, rows + start[e], scale + start[e], n, out,
                                  H, scratch, err);
        }
        int rr = src->release(src->ctx, layer, e, rc ? NULL : err);
        if (!rc) rc = rr;
        if (rc) goto done;
    }
    if (fixed_sum) /* each token's experts summed in ascending id, whatever the visit order */
        sum_pairs(out, contrib, rows, start[num_experts], H);
done:
    free(start);
    free(fill);
    free(rows);
    free(scale);
    free(scratch);
    free(contrib);
    free(xg);
    return rc;
}

static int cache_acquire(void *ctx, uint32_t layer, uint32_t expert, const uint8_t **data,
                         smoe_err *err) {
    return smoe_cache_acquire(ctx, layer, expert, data, err);
}

static int cache_release(void *ctx, uint32_t layer, uint32_t expert, smoe_err *err) {
    return smoe_cache_release(ctx, layer, expert, err);
}

smoe_moe_source smoe_moe_cache_source(struct smoe_cache *cache) {
    const int all = (uint64_t)cache->tab.nslots >=
                    (uint64_t)cache->tab.num_layers * cache->tab.num_experts;
    return (smoe_moe_source){cache, cache_acquire, cache_release, all};
}

static int resident_acquire(void *ctx, uint32_t layer, uint32_t expert, const uint8_t **data,
                            smoe_err *err) {
    const smoe_moe_resident *r = ctx;
    uint64_t off = ((uint64_t)layer * r->num_experts + expert) * r->block_bytes;
    if (off + r->block_bytes > r->size)
        return smoe_err_set(err, SMOE_EINVAL,
                            "moe: layer %u expert %u lies past the end of the %llu-byte resident "
                            "buffer", layer, expert, (unsigned long long)r->size);
    *data = r->base + off;
    return SMOE_OK;
}

static int resident_release(void *ctx, uint32_t layer, uint32_t expert, smoe_err *err) {
    (void)ctx, (void)layer, (void)expert, (void)err;
    return SMOE_OK;
}

smoe_moe_source smoe_moe_resident_source(smoe_moe_resident *r) {
    return (smoe_moe_source){r, resident_acquire, resident_release, 1};
}

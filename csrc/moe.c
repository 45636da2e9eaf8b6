/* MoE layer: token grouping, expert fetch through a source, per-expert FFN, weighted sum.
 * See moe.h.  The FFN here is the portable reference path (f32/bf16 weights, f32 math with
 * 16 partial sums per dot product so the compiler can vectorise it). */
#include "moe.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define LANES 16

static inline float bf16_to_f32(uint16_t v) {
    uint32_t u = (uint32_t)v << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static float dot_f32(const float *a, const float *x, uint32_t n) {
    float acc[LANES] = {0};
    uint32_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += a[i + j] * x[i + j];
    float s = 0.f;
    for (int j = 0; j < LANES; j++) s += acc[j];
    for (; i < n; i++) s += a[i] * x[i];
    return s;
}

static float dot_bf16(const uint16_t *a, const float *x, uint32_t n) {
    float acc[LANES] = {0};
    uint32_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int j = 0; j < LANES; j++) acc[j] += bf16_to_f32(a[i + j]) * x[i + j];
    float s = 0.f;
    for (int j = 0; j < LANES; j++) s += acc[j];
    for (; i < n; i++) s += bf16_to_f32(a[i]) * x[i];
    return s;
}

static size_t elem_size(int dtype) { return dtype == SMOE_MOE_BF16 ? 2 : 4; }

int smoe_moe_layout_check(const smoe_moe_layout *lo, smoe_err *err) {
    if (lo->hidden == 0 || lo->inter == 0)
        return smoe_err_set(err, SMOE_EINVAL, "moe layout: hidden=%u inter=%u must be positive",
                            lo->hidden, lo->inter);
    if (lo->dtype != SMOE_MOE_F32 && lo->dtype != SMOE_MOE_BF16)
        return smoe_err_set(err, SMOE_EINVAL, "moe layout: unknown dtype %d", lo->dtype);
    if (lo->act != SMOE_MOE_ACT_SILU && lo->act != SMOE_MOE_ACT_GPTOSS)
        return smoe_err_set(err, SMOE_EINVAL, "moe layout: unknown activation %d", lo->act);
    uint64_t mat = (uint64_t)lo->hidden * lo->inter * elem_size(lo->dtype);
    struct {
        const char *name;
        uint64_t off, size;
        int required;
    } t[6] = {{"w_gate", lo->off_gate, mat, 1},
              {"w_up", lo->off_up, mat, 1},
              {"w_down", lo->off_down, mat, 1},
              {"b_gate", lo->off_bgate, 4ull * lo->inter, 0},
              {"b_up", lo->off_bup, 4ull * lo->inter, 0},
              {"b_down", lo->off_bdown, 4ull * lo->hidden, 0}};
    for (int i = 0; i < 6; i++) {
        if (t[i].off == SMOE_MOE_NONE) {
            if (t[i].required)
                return smoe_err_set(err, SMOE_EINVAL, "moe layout: tensor %s is missing",
                                    t[i].name);
            continue;
        }
        if (t[i].off > lo->block_bytes || t[i].size > lo->block_bytes - t[i].off)
            return smoe_err_set(err, SMOE_EINVAL,
                                "moe layout: tensor %s at offset %llu (%llu bytes) exceeds the "
                                "%llu-byte block",
                                t[i].name, (unsigned long long)t[i].off,
                                (unsigned long long)t[i].size,
                                (unsigned long long)lo->block_bytes);
        if (t[i].off % 4)
            return smoe_err_set(err, SMOE_EINVAL, "moe layout: tensor %s offset %llu not 4-aligned",
                                t[i].name, (unsigned long long)t[i].off);
    }
    return SMOE_OK;
}

static inline float row_dot(const smoe_moe_layout *lo, const uint8_t *m, uint64_t row,
                            uint32_t len, const float *x) {
    if (lo->dtype == SMOE_MOE_BF16) return dot_bf16((const uint16_t *)m + row * len, x, len);
    return dot_f32((const float *)m + row * len, x, len);
}

static inline float activate(const smoe_moe_layout *lo, float g, float u) {
    if (lo->act == SMOE_MOE_ACT_GPTOSS) {
        if (g > lo->limit) g = lo->limit;
        if (u > lo->limit) u = lo->limit;
        if (u < -lo->limit) u = -lo->limit;
        float glu = g / (1.f + expf(-g * lo->alpha));
        return (u + 1.f) * glu;
    }
    return g / (1.f + expf(-g)) * u;
}

int smoe_moe_expert_ffn(const smoe_moe_layout *lo, const uint8_t *block, const float *x,
                        uint32_t n, float *y, smoe_err *err) {
    const uint32_t H = lo->hidden, I = lo->inter;
    float *h = malloc(sizeof(float) * (size_t)n * I);
    if (!h) return smoe_err_set(err, SMOE_ENOMEM, "moe: no memory for %u x %u activations", n, I);
    const uint8_t *wg = block + lo->off_gate, *wu = block + lo->off_up, *wd = block + lo->off_down;
    const float *bg = lo->off_bgate == SMOE_MOE_NONE ? NULL : (const float *)(block + lo->off_bgate);
    const float *bu = lo->off_bup == SMOE_MOE_NONE ? NULL : (const float *)(block + lo->off_bup);
    const float *bd = lo->off_bdown == SMOE_MOE_NONE ? NULL : (const float *)(block + lo->off_bdown);
    /* rows outermost: each weight row is read once for all n tokens */
    for (uint32_t i = 0; i < I; i++)
        for (uint32_t t = 0; t < n; t++) {
            float g = row_dot(lo, wg, i, H, x + (size_t)t * H);
            float u = row_dot(lo, wu, i, H, x + (size_t)t * H);
            if (bg) g += bg[i];
            if (bu) u += bu[i];
            h[(size_t)t * I + i] = activate(lo, g, u);
        }
    for (uint32_t j = 0; j < H; j++)
        for (uint32_t t = 0; t < n; t++) {
            float v = row_dot(lo, wd, j, I, h + (size_t)t * I);
            y[(size_t)t * H + j] = bd ? v + bd[j] : v;
        }
    free(h);
    return SMOE_OK;
}

int smoe_moe_forward(const smoe_moe_layout *lo, const smoe_moe_source *src, uint32_t layer,
                     uint32_t num_experts, const float *x, uint32_t T, const int64_t *idx,
                     const float *w, uint32_t k, float *out, uint8_t *used, smoe_err *err) {
    const uint32_t H = lo->hidden;
    size_t nk = (size_t)T * k;
    memset(out, 0, sizeof(float) * (size_t)T * H);
    if (used) memset(used, 0, num_experts);
    if (nk == 0) return SMOE_OK;
    for (size_t i = 0; i < nk; i++)
        if (idx[i] < 0 || idx[i] >= (int64_t)num_experts)
            return smoe_err_set(err, SMOE_EINVAL,
                                "moe layer %u: token %zu slot %zu routes to expert %lld, outside "
                                "0..%u",
                                layer, i / k, i % k, (long long)idx[i], num_experts - 1);
    /* counting sort of (token, slot) pairs by expert, token order kept inside an expert */
    uint32_t *start = calloc((size_t)num_experts + 1, sizeof *start);
    uint32_t *order = malloc(sizeof *order * nk);
    float *xs = malloc(sizeof(float) * nk * H);
    float *ys = malloc(sizeof(float) * nk * H);
    int rc = SMOE_OK;
    if (!start || !order || !xs || !ys) {
        rc = smoe_err_set(err, SMOE_ENOMEM, "moe layer %u: no memory for %u tokens", layer, T);
        goto done;
    }
    for (size_t i = 0; i < nk; i++) start[idx[i] + 1]++;
    for (uint32_t e = 0; e < num_experts; e++) start[e + 1] += start[e];
    {
        uint32_t *fill = malloc(sizeof *fill * num_experts);
        if (!fill) {
            rc = smoe_err_set(err, SMOE_ENOMEM, "moe layer %u: no memory", layer);
            goto done;
        }
        memcpy(fill, start, sizeof *fill * num_experts);
        for (size_t i = 0; i < nk; i++) order[fill[idx[i]]++] = (uint32_t)i;
        free(fill);
    }
    for (uint32_t e = 0; e < num_experts; e++) {
        uint32_t n = start[e + 1] - start[e];
        if (!n) continue;
        if (used) used[e] = 1;
        const uint32_t *pairs = order + start[e];
        for (uint32_t j = 0; j < n; j++)
            memcpy(xs + (size_t)j * H, x + (size_t)(pairs[j] / k) * H, sizeof(float) * H);
        const uint8_t *block = NULL;
        rc = src->acquire(src->ctx, layer, e, &block, err);
        if (rc) goto done;
        rc = smoe_moe_expert_ffn(lo, block, xs, n, ys, err);
        int rr = src->release(src->ctx, layer, e, rc ? NULL : err);
        if (!rc) rc = rr;
        if (rc) goto done;
        for (uint32_t j = 0; j < n; j++) {
            float *o = out + (size_t)(pairs[j] / k) * H;
            const float *yy = ys + (size_t)j * H;
            float wt = w[pairs[j]];
            for (uint32_t c = 0; c < H; c++) o[c] += yy[c] * wt;
        }
    }
done:
    free(start);
    free(order);
    free(xs);
    free(ys);
    return rc;
}

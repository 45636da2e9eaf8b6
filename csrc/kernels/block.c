/* RMSNorm and rotary embedding on f32 rows (see block.h). */
#include "block.h"

#include <math.h>

void smoe_bf16_round(float *x, size_t n) {
    for (size_t i = 0; i < n; i++) x[i] = smoe_bf16_round1(x[i]);
}

void smoe_rmsnorm(float *x, uint32_t rows, uint32_t n, const float *w, float eps, int bf16) {
    for (uint32_t r = 0; r < rows; r++) {
        float *v = x + (size_t)r * n;
        float ss = 0.0f;
        for (uint32_t i = 0; i < n; i++) ss += v[i] * v[i];
        const float inv = 1.0f / sqrtf(ss / (float)n + eps);
        for (uint32_t i = 0; i < n; i++) {
            float y = v[i] * inv;
            if (bf16) y = smoe_bf16_round1(y);
            if (w) y = w[i] * y;
            v[i] = bf16 ? smoe_bf16_round1(y) : y;
        }
    }
}

void smoe_rotary_half(float *x, uint32_t heads, size_t stride, uint32_t D, const float *cos,
                      const float *sin, int bf16) {
    const uint32_t h2 = D / 2;
    for (uint32_t h = 0; h < heads; h++) {
        float *v = x + (size_t)h * stride;
        for (uint32_t i = 0; i < h2; i++) {
            const float a = v[i], b = v[i + h2];
            float a1 = a * cos[i], a2 = -b * sin[i];         /* rotate_half: -x[D/2:] first */
            float b1 = b * cos[i + h2], b2 = a * sin[i + h2];
            if (bf16) {
                a1 = smoe_bf16_round1(a1);
                a2 = smoe_bf16_round1(a2);
                b1 = smoe_bf16_round1(b1);
                b2 = smoe_bf16_round1(b2);
            }
            const float ra = a1 + a2, rb = b1 + b2;
            v[i] = bf16 ? smoe_bf16_round1(ra) : ra;
            v[i + h2] = bf16 ? smoe_bf16_round1(rb) : rb;
        }
    }
}

void smoe_rotary_pairs(float *x, uint32_t heads, size_t stride, uint32_t D, const float *c,
                       const float *s, size_t step, int bf16) {
    for (uint32_t h = 0; h < heads; h++) {
        float *v = x + (size_t)h * stride;
        for (uint32_t i = 0; i < D / 2; i++) {
            const float a = v[2 * i], b = v[2 * i + 1], ci = c[i * step], si = s[i * step];
            const float re = a * ci - b * si, im = a * si + b * ci;
            v[2 * i] = bf16 ? smoe_bf16_round1(re) : re;
            v[2 * i + 1] = bf16 ? smoe_bf16_round1(im) : im;
        }
    }
}

void smoe_rotary_interleave(float *x, uint32_t heads, size_t stride, uint32_t D,
                            const float *cos, const float *sin, int bf16) {
    const uint32_t h2 = D / 2;
    float out[SMOE_ROTARY_MAX];
    for (uint32_t h = 0; h < heads; h++) {
        float *v = x + (size_t)h * stride;
        for (uint32_t i = 0; i < h2; i++) {
            const float a = v[2 * i], b = v[2 * i + 1];
            float a1 = a * cos[i], a2 = b * sin[i], b1 = b * cos[i], b2 = a * sin[i];
            if (bf16) {
                a1 = smoe_bf16_round1(a1);
                a2 = smoe_bf16_round1(a2);
                b1 = smoe_bf16_round1(b1);
                b2 = smoe_bf16_round1(b2);
            }
            const float ra = a1 - a2, rb = b1 + b2;
            out[i] = bf16 ? smoe_bf16_round1(ra) : ra;
            out[h2 + i] = bf16 ? smoe_bf16_round1(rb) : rb;
        }
        memcpy(v, out, (size_t)D * sizeof(float));
    }
}

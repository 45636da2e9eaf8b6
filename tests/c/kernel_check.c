/* Sanitizer driver for the kernel thread pool and the fast paths (no numeric checks: numerics
 * are tested against numpy in tests/test_kernels.py).  Two threads call smoe_ffn_forward
 * concurrently on one 3-thread context with 1..3 tokens, for bf16, int8 and int4 blocks
 * (H=256, I=384: the AVX-512 fast paths where the CPU has BF16/VNNI).  Not wired into the
 * Makefile yet; run from the repository root:
 *   gcc -std=c11 -O1 -g -fsanitize=thread -Icsrc -o /tmp/kc tests/c/kernel_check.c
 *       csrc/kernels/ALL.c csrc/common.c -lpthread -lm && /tmp/kc
 *   where ALL.c stands for every .c file in csrc/kernels; the same with
 *   -fsanitize=address,undefined -fno-sanitize-recover=all. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "kernels/kernels.h"
static smoe_kctx ctx;
static smoe_ffn_desc d;
static uint8_t *block;
static void *run(void *arg) {
    (void)arg;
    uint32_t T = 3;
    float *x = calloc((size_t)T * d.H, 4), *out = calloc((size_t)T * d.H, 4);
    for (uint32_t i = 0; i < T * d.H; i++) x[i] = (float)(i % 7) - 3.0f;
    void *scr = malloc(smoe_ffn_scratch_bytes(&d, T));
    smoe_err err;
    for (int it = 0; it < 50; it++) {
        uint32_t tt = 1 + (uint32_t)it % T;
        if (smoe_ffn_forward(&ctx, &d, block, x, d.H, NULL, NULL, tt, out, d.H, scr, &err)) {
            printf("err %s\n", err.msg);
            exit(1);
        }
    }
    free(x); free(out); free(scr);
    return NULL;
}
int main(void) {
    smoe_err err;
    if (smoe_kctx_init(&ctx, 3, &err)) return 1;
    for (int dt = 1; dt <= 3; dt++) {
        uint32_t H = 256, I = 384;
        smoe_ffn_desc_default(&d, H, I, dt, 0);
        uint64_t wb = smoe_ffn_weight_bytes(&d, I, H), sb = smoe_ffn_scale_bytes(&d, I, H);
        uint64_t wbd = smoe_ffn_weight_bytes(&d, H, I), sbd = smoe_ffn_scale_bytes(&d, H, I);
        size_t tot = 2 * wb + wbd + 2 * sb + sbd + 1024;
        block = calloc(tot, 1);
        for (size_t i = 0; i < tot; i++) block[i] = (uint8_t)(i * 37 % 11);
        uint64_t o = 0;
        d.gate = o; o += wb; d.up = o; o += wb; d.down = o; o += wbd;
        o = (o + 63) & ~63ull;
        if (sb) {
            d.gate_scale = o; o += sb; d.up_scale = o; o += sb; d.down_scale = o; o += sbd;
            for (uint64_t k = d.gate_scale; k < o; k += 4) { float f = 0.01f; memcpy(block + k, &f, 4); }
        }
        if (smoe_ffn_desc_check(&d, tot, &err)) { printf("desc %s\n", err.msg); return 1; }
        pthread_t th[2];
        for (int i = 0; i < 2; i++) pthread_create(&th[i], NULL, run, NULL);
        for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
        free(block);
        printf("dtype %d ok\n", dt);
    }
    smoe_kctx_free(&ctx);
    return 0;
}

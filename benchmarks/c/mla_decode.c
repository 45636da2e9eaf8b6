/* The absorbed MLA kernel (csrc/kernels/mla.c, smoe_mla_decode) at decode, timed in C against
 * a plain read loop over the same weights (the "C harness" of mla.c's and mla_avx512.c's
 * notes).  One query token, one batch row, bf16 absorbed weights (MLA_WDTYPE=int8 or int4:
 * those formats, one value a byte, int4 in groups of 32 columns) and bf16 cache, on the
 * kernel context's best ISA.
 *
 * Build and run from the repository root:
 *
 *   K=csrc/kernels; gcc -O3 -std=c11 -D_GNU_SOURCE -Icsrc -I$K -o /tmp/mla_decode \
 *       benchmarks/c/mla_decode.c $K/[a-z]*.c csrc/common.c -lm -lpthread
 *   (every kernel file: GGUF block weights run through the block rows of ffn_blocks.c)
 *   /tmp/mla_decode S [threads] [reps]     # S cached positions
 *
 * Shapes: DeepSeek-V2-Lite's (16 heads, qk_nope 128, rope 64, v 128, kv_lora_rank 512: 4.2 MB
 * of weights a layer); MLA_HEADS sets another head count.  The weights are N layers' worth
 * (N = 128 MiB / layer bytes, at least 2; MLA_ROTATION sets another footprint in bytes) on 4 KB
 * pages, rotated so that every call reads them from DRAM; after each call the read loop
 * reads another layer's weights (interleaved).  Prints one JSON line: medians of the call
 * (us) and of both rates (GB/s of weight bytes), and their ratio.  On a shared VM single
 * samples move by 2x; compare builds by alternating runs. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "attn.h"

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static uint16_t *bf16_fill(size_t n, uint32_t seed) {
    uint16_t *p = aligned_alloc(64, (n * 2 + 63) / 64 * 64);
    if (!p) {
        fprintf(stderr, "out of memory\n");
        exit(1);
    }
    for (size_t i = 0; i < n; i++) /* values in [1, 2) / 128: finite, no overflow */
        p[i] = (uint16_t)(0x3C00u + ((i * 2654435761u + seed) >> 7) % 128u);
    return p;
}

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: %s S [threads] [reps]\n", argv[0]);
        return 2;
    }
    const long S = atol(argv[1]), th = argc > 2 ? atol(argv[2]) : 1,
               reps = argc > 3 ? atol(argv[3]) : 20;
    const char *eh = getenv("MLA_HEADS");
    const long H = eh ? atol(eh) : 16;
    if (S < 1 || S > 1 << 20 || th < 1 || th > 256 || reps < 1 || H < 1 || H > 1024) {
        fprintf(stderr, "S must be 1..2^20, threads 1..256, reps >= 1, MLA_HEADS 1..1024\n");
        return 2;
    }
    const uint32_t dn = 128, dr = 64, dv = 128, r = 512;
    const char *ew = getenv("MLA_WDTYPE");
    const int32_t wdt = !ew || !strcmp(ew, "bf16") ? SMOE_WDT_BF16
                        : !strcmp(ew, "int8")      ? SMOE_WDT_I8
                        : !strcmp(ew, "int4")      ? SMOE_WDT_I4
                                                   : -1;
    if (wdt < 0) {
        fprintf(stderr, "MLA_WDTYPE must be bf16, int8 or int4\n");
        return 2;
    }
    const size_t wsz = wdt == SMOE_WDT_BF16 ? 2 : 1;     /* bytes a weight value */
    const uint32_t group = wdt == SMOE_WDT_I4 ? 32 : 0; /* int4: columns a scale */
    smoe_err err;
    smoe_kctx c;
    if (smoe_kctx_init(&c, (uint32_t)th, &err)) {
        fprintf(stderr, "kernel context: %s\n", err.msg);
        return 1;
    }
    smoe_mla_desc d = {.H = (uint32_t)H, .dn = dn, .dr = dr, .dv = dv, .r = r,
                       .wdtype = wdt, .group = group, .scale = 0.07f};
    const size_t wn = (size_t)H * dn * r, vn = (size_t)H * dv * r; /* values */
    const size_t layer = (wn + vn) * wsz;
    const char *er = getenv("MLA_ROTATION");
    size_t n = (er ? (size_t)atoll(er) : (size_t)128 << 20) / layer;
    if (n < 2) n = 2;
    uint16_t **uk = malloc(n * sizeof *uk), **uv = malloc(n * sizeof *uv);
    for (size_t l = 0; l < n; l++) { /* int8/int4: the bf16 fill's bytes, masked into range */
        uk[l] = bf16_fill((wn * wsz + 1) / 2, (uint32_t)l);
        uv[l] = bf16_fill((vn * wsz + 1) / 2, (uint32_t)l + 7u);
        for (size_t i = 0; wsz == 1 && i < wn; i++)
            ((int8_t *)uk[l])[i] = (int8_t)(((uint8_t *)uk[l])[i] & (group ? 7 : 63));
        for (size_t i = 0; wsz == 1 && i < vn; i++)
            ((int8_t *)uv[l])[i] = (int8_t)(((uint8_t *)uv[l])[i] & (group ? 7 : 63));
    }
    /* scales: int8 one a row, int4 one a group of a row (the same for every layer) */
    const size_t ncol = group ? r / group : 1;
    float *uks = malloc((size_t)H * dn * ncol * 4), *uvs = malloc((size_t)H * dv * ncol * 4);
    for (size_t i = 0; i < (size_t)H * dn * ncol; i++) uks[i] = 0.01f;
    for (size_t i = 0; i < (size_t)H * dv * ncol; i++) uvs[i] = 0.01f;
    const int quant = wsz == 1;
    float *qn = malloc((size_t)H * dn * 4), *qp = malloc((size_t)H * dr * 4),
          *out = malloc((size_t)H * dv * 4);
    for (size_t i = 0; i < (size_t)H * dn; i++) qn[i] = 0.01f * (float)(i % 7);
    for (size_t i = 0; i < (size_t)H * dr; i++) qp[i] = 0.01f * (float)(i % 5);
    uint16_t *ckv = bf16_fill((size_t)S * r, 3), *kpe = bf16_fill((size_t)S * dr, 5);
    const size_t sb = smoe_mla_scratch_bytes(&c, &d, 1);
    void *scratch = aligned_alloc(64, (sb + 63) / 64 * 64);
    const size_t ns = (size_t)reps * n;
    double *tk = malloc(ns * sizeof *tk), *tr = malloc(ns * sizeof *tr);
    volatile uint64_t sink = 0;
    for (size_t i = 0; i < ns; i++) {
        const size_t l = i % n, l2 = (i + n / 2) % n;
        const smoe_mla_weights w = {uk[l], uv[l], quant ? uks : NULL, quant ? uvs : NULL};
        double t = now();
        if (smoe_mla_decode(&c, &d, 1, 1, (uint32_t)S, qn, qp, ckv, SMOE_WDT_BF16, 0, kpe,
                            SMOE_WDT_BF16, 0, &w, NULL, 1, out, scratch, sb, &err)) {
            fprintf(stderr, "smoe_mla_decode: %s\n", err.msg);
            return 1;
        }
        tk[i] = now() - t;
        const uint64_t *a = (const uint64_t *)uk[l2], *b = (const uint64_t *)uv[l2];
        uint64_t s0 = 0;
        t = now();
        for (size_t k = 0; k < wn * wsz / 8; k++) s0 += a[k];
        for (size_t k = 0; k < vn * wsz / 8; k++) s0 += b[k];
        tr[i] = now() - t;
        sink += s0;
    }
    const size_t skip = n < ns / 2 ? n : 0; /* the first round: page faults, cold caches */
    qsort(tk + skip, ns - skip, sizeof *tk, cmp_double);
    qsort(tr + skip, ns - skip, sizeof *tr, cmp_double);
    const double mk = tk[skip + (ns - skip) / 2], mr = tr[skip + (ns - skip) / 2];
    int finite = 1;
    for (size_t i = 0; i < (size_t)H * dv; i++) finite &= out[i] == out[i];
    printf("{\"S\": %ld, \"heads\": %ld, \"weights\": \"%s\", \"threads\": %ld, "
           "\"isa\": \"%s\", \"layers\": %zu, \"samples\": %zu, \"call_us\": %.1f, "
           "\"call_gbps\": %.2f, \"read_gbps\": %.2f, \"frac_of_read\": %.3f, \"finite\": %s}\n",
           S, H, ew ? ew : "bf16", th, smoe_isa_name(c.isa), n, ns - skip, mk * 1e6,
           (double)layer / mk / 1e9, (double)layer / mr / 1e9, mr / mk, finite ? "true" : "false");
    (void)sink;
    smoe_kctx_free(&c);
    return 0;
}

/* The one-token fast kernels' two phases, timed apart from everything around them, against a
 * plain read loop over the same memory (the "C harness" of csrc/kernels/ffn_fast.c's notes).
 *
 * benchmarks/expert_kernels.py times whole expert calls from Python; this isolates the row loops
 * (fast_gateup: gate/up rows and the activation; fast_down: down rows), so that a change to
 * how rows are read (one at a time, pairs, fours) can be measured without the per-call work
 * or the interpreter.  It includes ffn_fast.c itself to reach those static functions.
 *
 * Build and run from the repository root (one thread, the calling one; int4 or int8 weights
 * with random bytes, 4 KB pages):
 *
 *   K=csrc/kernels; gcc -O3 -Icsrc -I$K -o /tmp/ffn_rows benchmarks/c/ffn_rows.c \
 *       $K/ffn.c $K/ffn_avx2.c $K/ffn_avx512.c $K/ffn_fast_avx2.c $K/ffn_i2.c $K/ffn_blocks.c \
 *       $K/pool.c csrc/common.c -lm -lpthread
 *   /tmp/ffn_rows int4 4096 14336 128 [reps]     # dtype H I group (group: int4 only)
 *
 * Weights are N copies of one expert, N = 1 GiB / expert bytes (at least 3; FFN_ROWS_ROTATION
 * sets another footprint in bytes), rotated so that
 * every sample reads from DRAM; each repeat reads copy i with the read loop, runs gate/up on
 * copy i+1, down on copy i+2 and a whole expert call (smoe_ffn_forward: both phases with the
 * activation preparation between them, one thread) on a copy of a packed expert (interleaved,
 * as expert_kernels.py does).  Prints one JSON line: the best rate of each (GB/s of weight + scale
 * bytes) and their fractions of the read loop's best (FFN_ROWS_DEBUG=1: every sample to stderr;
 * the row loops and the whole call take the kernel context's stream_pf, which
 * SPECMOE_STREAM_PREFETCH sets).  On a shared VM single samples move
 * by 2x; compare builds by alternating runs.  Needs a CPU with AVX-512 VNNI (the fast int4/int8
 * path). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../../csrc/kernels/ffn_fast.c"

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static uint8_t *copies(size_t bytes, size_t n, size_t scale_off, size_t scale_bytes) {
    uint8_t *m = aligned_alloc(4096, bytes * n);
    if (!m) {
        fprintf(stderr, "out of memory\n");
        exit(1);
    }
    for (size_t i = 0; i < bytes * n; i++) m[i] = (uint8_t)((i * 2654435761u) >> 13);
    for (size_t c = 0; c < n; c++) { /* finite, equal scales: the values do not matter */
        float *s = (float *)(m + c * bytes + scale_off);
        for (size_t i = 0; i < scale_bytes / 4; i++) s[i] = 0.01f;
    }
    return m;
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: %s int4|int8 H I [group] [reps]\n", argv[0]);
        return 2;
    }
    const int i4 = strcmp(argv[1], "int4") == 0;
    if (!i4 && strcmp(argv[1], "int8") != 0) {
        fprintf(stderr, "dtype must be int4 or int8\n");
        return 2;
    }
    const uint32_t H = (uint32_t)atoi(argv[2]), I = (uint32_t)atoi(argv[3]);
    const uint32_t G = i4 ? (argc > 4 ? (uint32_t)atoi(argv[4]) : 128) : 0;
    const int reps = argc > 5 ? atoi(argv[5]) : 60;
    if (H % 64 || I % 64 || (i4 && (G == 0 || H % G || I % G))) {
        fprintf(stderr, "H and I must be multiples of 64 (and of the int4 group)\n");
        return 2;
    }
    /* gate/up block: gate, up, gate scales, up scales; down block: down, down scales */
    const size_t wrow = i4 ? (size_t)H / 2 : H, drow = i4 ? (size_t)I / 2 : I;
    const size_t gsc = i4 ? (size_t)I * (H / G) * 4 : (size_t)I * 4;
    const size_t dsc = i4 ? (size_t)H * (I / G) * 4 : (size_t)H * 4;
    const size_t gub = 2 * wrow * I + 2 * gsc, db = drow * H + dsc;
    /* rotation footprint: 1 GiB, or FFN_ROWS_ROTATION bytes (a smoke test's small one) */
    const char *rot_env = getenv("FFN_ROWS_ROTATION");
    const size_t rot = rot_env ? (size_t)strtoull(rot_env, NULL, 10) : ((size_t)1 << 30);
    size_t n = rot / (gub + db) + 1;
    if (n < 3) n = 3;
    uint8_t *gu = copies(gub, n, 2 * wrow * I, 2 * gsc), *dn = copies(db, n, drow * H, dsc);
    /* whole experts as kernels.pack_block lays them out: gate, up, down, then their scales */
    const size_t eb = 2 * wrow * I + drow * H + 2 * gsc + dsc;
    size_t ne = rot / eb + 1;
    if (ne < 3) ne = 3;
    uint8_t *ex = copies(eb, ne, 2 * wrow * I + drow * H, 2 * gsc + dsc);
    uint8_t *rd = gu; /* the read loop reads the gate/up copies (the larger block) */

    smoe_ffn_desc d;
    memset(&d, 0, sizeof d);
    d.H = H;
    d.I = I;
    d.dtype = i4 ? SMOE_WDT_I4 : SMOE_WDT_I8;
    d.act = SMOE_ACT_SILU;
    d.group = G;
    d.gate = 0;
    d.up = wrow * I;
    d.gate_scale = 2 * wrow * I;
    d.up_scale = 2 * wrow * I + gsc;
    d.gate_bias = d.up_bias = d.down_bias = SMOE_NO_TENSOR;
    smoe_ffn_desc dd = d;
    dd.down = 0;
    dd.down_scale = drow * H;
    smoe_ffn_desc de = d;
    de.down = 2 * wrow * I;
    de.gate_scale = 2 * wrow * I + drow * H;
    de.up_scale = de.gate_scale + gsc;
    de.down_scale = de.up_scale + gsc;
    void *scratch = malloc(smoe_ffn_scratch_bytes(&de, 1));
    smoe_kctx kc;
    smoe_err kerr;
    if (smoe_kctx_init(&kc, 1, &kerr)) {
        fprintf(stderr, "kernel context: %s\n", kerr.msg);
        return 1;
    }

    float *x = malloc((size_t)H * 4), *act = calloc(I, 4), *out = calloc(H, 4);
    void *qx = aligned_alloc(64, (size_t)H * 2), *qa = aligned_alloc(64, (size_t)I * 2);
    float *qs = calloc(H / 64 + 2, 4), *qsum = calloc(H / 64 + 2, 4);
    float *as = calloc(I / 64 + 2, 4), *asum = calloc(I / 64 + 2, 4);
    for (uint32_t k = 0; k < H; k++) x[k] = (float)((k * 37u) % 17u) - 8.0f;
    smoe_fast_prepare(d.dtype, x, H, NULL, 1, H, qx, qs, qsum);
    smoe_ffn_job j;
    memset(&j, 0, sizeof j);
    j.d = &d;
    j.T = 1;
    j.group = G;
    j.act = act;
    j.q = qx;
    j.qs = qs;
    j.qsum = qsum;
    j.out = out;
    j.out_stride = H;
    j.block = gu;
    j.stream_pf = kc.stream_pf; /* the context's, as smoe_ffn_forward's calls below use */
    fast_gateup(&j, 0, I); /* an activation for the down phase */
    smoe_fast_prepare(d.dtype, act, I, NULL, 1, I, qa, as, asum);
    smoe_ffn_job k = j;
    k.d = &dd;
    k.q = qa;
    k.qs = as;
    k.qsum = asum;

    double best_r = 1e30, best_g = 1e30, best_d = 1e30, best_e = 1e30;
    uint64_t sink = 0;
    size_t pos = 1; /* copy 0 was just read by the activation's gate/up */
    for (int r = 0; r < reps; r++) {
        double t0 = now();
        sink += smoe_ffn_impl_avx512.read_sum(rd + (pos++ % n) * gub, gub);
        double t1 = now();
        j.block = gu + (pos++ % n) * gub;
        fast_gateup(&j, 0, I);
        double t2 = now();
        k.block = dn + (pos++ % n) * db;
        fast_down(&k, 0, H);
        double t3 = now();
        smoe_ffn_forward(&kc, &de, ex + (pos++ % ne) * eb, x, H, NULL, NULL, 1, out, H, scratch,
                         &kerr);
        double t4 = now();
        if (getenv("FFN_ROWS_DEBUG"))
            fprintf(stderr, "read %.1f gateup %.1f down %.1f expert %.1f\n", gub / (t1 - t0) / 1e9,
                    gub / (t2 - t1) / 1e9, db / (t3 - t2) / 1e9, eb / (t4 - t3) / 1e9);
        if (t4 - t3 < best_e) best_e = t4 - t3;
        if (t1 - t0 < best_r) best_r = t1 - t0;
        if (t2 - t1 < best_g) best_g = t2 - t1;
        if (t3 - t2 < best_d) best_d = t3 - t2;
    }
    double rr = gub / best_r / 1e9, rg = gub / best_g / 1e9, rdn = db / best_d / 1e9;
    double re = eb / best_e / 1e9;
    printf("{\"dtype\": \"%s\", \"H\": %u, \"I\": %u, \"group\": %u, \"copies\": %zu, "
           "\"reps\": %d, \"read_gbps\": %.2f, \"gateup_gbps\": %.2f, \"down_gbps\": %.2f, "
           "\"expert_gbps\": %.2f, \"gateup_frac\": %.3f, \"down_frac\": %.3f, "
           "\"expert_frac\": %.3f, \"stream_pf\": %u, \"sink\": %u}\n",
           argv[1], H, I, G, n, reps, rr, rg, rdn, re, rg / rr, rdn / rr, re / rr,
           kc.stream_pf, (unsigned)(sink & 1));
    smoe_kctx_free(&kc);
    return 0;
}

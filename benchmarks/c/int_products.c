/* The compute ceiling of the AVX2 fast rows (csrc/kernels/ffn_fast_avx2.c) on the host: their
 * instruction mix per weight, one row against one token, with the weights and the activations
 * in L1, so that nothing waits on memory.  Compared with the read ceiling that
 * benchmarks/expert_kernels.py measures on the same host, it says how close to the read limit
 * the row loops can get there at all.
 *
 * The two loops repeat the arithmetic of the kernel's one-token rows, instruction for
 * instruction:
 *   int4 (dot_i4, I4_BLOCK: groups of 128): per 128 columns two 32-byte loads, the nibbles by
 *        one and / shift / and each, four vpmaddubsw against the int8 activations, their int16
 *        sums added, one vpmaddwd with ones, one conversion and one fma with the block's scale;
 *   int8 (dot_i8): per 32 columns two sign extensions to int16, two vpmaddwd against the int16
 *        activations, their int32 sums added.
 * On AMD Zen 1 (EPYC 7001) a 256-bit operation runs as two 128-bit micro-ops and vector integer
 * multiplies have one pipe (Agner Fog's instruction tables), so the vpmaddubsw / vpmaddwd
 * bound both loops; on 2026-12-04 there they read
 * 10.7-11.7 GB/s of int4 and 14.1-15.3 GB/s of int8, where the read ceiling is 19-20 GB/s
 * (docs/performance.md, "Zen 1").
 *
 * Build and run from the repository root (one thread):
 *
 *   gcc -O2 -mavx2 -mfma -o /tmp/int_products benchmarks/c/int_products.c
 *   /tmp/int_products [rounds]
 *
 * Both loops' results are first checked against plain C of the same arithmetic (exit 1 if they
 * differ).  Prints one JSON line: the best of `rounds` (default 5) rates of each loop, in G weights/s
 * and in GB/s of weight bytes (int4: half a byte per weight).  expert_kernels.py counts the
 * scales too (int4 groups of 128: 1/16 more bytes), so its GB/s run that much above these. */
#include <immintrin.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

enum { COLS = 16384 }; /* one row: 8 KB of int4, 16 KB of int8, L1-sized with its input */

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static uint8_t w4[COLS / 2] __attribute__((aligned(64)));
static int8_t x8[COLS] __attribute__((aligned(64)));
static int8_t w8[COLS] __attribute__((aligned(64)));
static int16_t x16[COLS] __attribute__((aligned(64)));
static float scale[COLS / 128];

/* one int4 row: the lanes of its dot product (the kernel sums them afterwards) */
static __m256 row_i4(void) {
    const __m256i ones = _mm256_set1_epi16(1), m4 = _mm256_set1_epi8(0x0F);
    __m256 f = _mm256_setzero_ps();
    for (int b = 0; b < COLS / 128; b++) {
        const __m256i v0 = _mm256_load_si256((const __m256i *)(w4 + b * 64));
        const __m256i v1 = _mm256_load_si256((const __m256i *)(w4 + b * 64 + 32));
        const __m256i l0 = _mm256_and_si256(v0, m4);
        const __m256i h0 = _mm256_and_si256(_mm256_srli_epi16(v0, 4), m4);
        const __m256i l1 = _mm256_and_si256(v1, m4);
        const __m256i h1 = _mm256_and_si256(_mm256_srli_epi16(v1, 4), m4);
        const int8_t *xb = x8 + b * 128;
        const __m256i p0 = _mm256_add_epi16(
            _mm256_maddubs_epi16(l0, _mm256_load_si256((const __m256i *)xb)),
            _mm256_maddubs_epi16(h0, _mm256_load_si256((const __m256i *)(xb + 64))));
        const __m256i p1 = _mm256_add_epi16(
            _mm256_maddubs_epi16(l1, _mm256_load_si256((const __m256i *)(xb + 32))),
            _mm256_maddubs_epi16(h1, _mm256_load_si256((const __m256i *)(xb + 96))));
        f = _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_madd_epi16(_mm256_add_epi16(p0, p1), ones)),
                            _mm256_broadcast_ss(&scale[b]), f);
    }
    return f;
}

/* one int8 row: the int32 lanes of its dot product */
static __m256i row_i8(void) {
    __m256i a = _mm256_setzero_si256();
    for (int k = 0; k < COLS; k += 32) {
        const __m256i v0 = _mm256_cvtepi8_epi16(_mm_load_si128((const __m128i *)(w8 + k)));
        const __m256i v1 = _mm256_cvtepi8_epi16(_mm_load_si128((const __m128i *)(w8 + k + 16)));
        const __m256i p0 = _mm256_madd_epi16(v0, _mm256_load_si256((const __m256i *)(x16 + k)));
        const __m256i p1 =
            _mm256_madd_epi16(v1, _mm256_load_si256((const __m256i *)(x16 + k + 16)));
        a = _mm256_add_epi32(a, _mm256_add_epi32(p0, p1));
    }
    return a;
}

/* The loops' results against plain C of the same arithmetic, so that what is timed is the
 * whole computation: int4 against the scaled block sums (layout of prepare_avx2: byte j of a
 * block's first 32 bytes pairs its low nibble with column j and its high one with column
 * 64 + j, the next 32 bytes with 32 + j and 96 + j), int8 as the wrapped int32 sum. */
static int check(void) {
    double want4 = 0.0;
    for (int b = 0; b < COLS / 128; b++) {
        long long sb = 0;
        for (int c = 0; c < 2; c++)
            for (int j = 0; j < 32; j++) {
                const uint8_t v = w4[b * 64 + 32 * c + j];
                sb += (long long)(v & 15) * x8[b * 128 + 32 * c + j];
                sb += (long long)(v >> 4) * x8[b * 128 + 64 + 32 * c + j];
            }
        want4 += (double)scale[b] * (double)sb;
    }
    float l4[8];
    _mm256_storeu_ps(l4, row_i4());
    double got4 = 0.0;
    for (int i = 0; i < 8; i++) got4 += l4[i];
    uint32_t want8 = 0, got8 = 0;
    for (int k = 0; k < COLS; k++) want8 += (uint32_t)((int32_t)w8[k] * x16[k]);
    int32_t l8[8];
    _mm256_storeu_si256((__m256i *)l8, row_i8());
    for (int i = 0; i < 8; i++) got8 += (uint32_t)l8[i];
    if (got8 != want8 || !(got4 - want4 <= 1e-5 * (1.0 + (want4 < 0 ? -want4 : want4))) ||
        !(want4 - got4 <= 1e-5 * (1.0 + (want4 < 0 ? -want4 : want4)))) {
        fprintf(stderr, "int_products: loop results differ from the plain arithmetic "
                        "(int4 %.9g against %.9g, int8 %u against %u)\n",
                got4, want4, got8, want8);
        return 1;
    }
    return 0;
}

int main(int argc, char **argv) {
    const int rounds = argc > 1 ? atoi(argv[1]) : 5;
    const int reps = 4000;
    for (int i = 0; i < COLS / 2; i++) w4[i] = (uint8_t)(i * 37 + 11);
    for (int i = 0; i < COLS; i++) {
        x8[i] = (int8_t)(i * 13 - 7);
        w8[i] = (int8_t)(i * 29 + 3);
        x16[i] = (int16_t)(i * 97 - 5000);
    }
    for (int i = 0; i < COLS / 128; i++) scale[i] = 1.0f + 1e-3f * (float)i;
    if (check()) return 1;
    double best4 = 1e30, best8 = 1e30;
    __m256 sink4 = _mm256_setzero_ps();
    __m256i sink8 = _mm256_setzero_si256();
    for (int r = 0; r < rounds; r++) { /* interleaved: one round of each */
        double t0 = now();
        /* (the memory clobber: the arrays may have changed, so every call computes) */
        for (int i = 0; i < reps; i++) {
            __asm__ volatile("" ::: "memory");
            sink4 = _mm256_add_ps(sink4, row_i4());
        }
        double t1 = now();
        for (int i = 0; i < reps; i++) {
            __asm__ volatile("" ::: "memory");
            sink8 = _mm256_add_epi32(sink8, row_i8());
        }
        double t2 = now();
        if (t1 - t0 < best4) best4 = t1 - t0;
        if (t2 - t1 < best8) best8 = t2 - t1;
    }
    float s4[8];
    int32_t s8[8];
    _mm256_storeu_ps(s4, sink4);
    _mm256_storeu_si256((__m256i *)s8, sink8);
    const double g4 = (double)reps * COLS / best4 / 1e9, g8 = (double)reps * COLS / best8 / 1e9;
    printf("{\"int4_gweights_s\": %.2f, \"int4_gbps\": %.2f, \"int8_gweights_s\": %.2f, "
           "\"int8_gbps\": %.2f, \"rounds\": %d, \"sink\": %g}\n",
           g4, g4 / 2, g8, g8, rounds, (double)s4[0] + (double)s8[0]);
    return 0;
}

/* Checks of smoe_split (csrc/kernels/pool.c), the chunk split of the kernels' pool runs:
 *  1. every chunk is taken exactly once, for 1-20 threads and 0-70 chunks, whichever threads
 *     ask (all in turn, one alone, or one arriving after the others are done);
 *  2. a thread's own range comes first, front to back (one sequential stream), and chunks of
 *     other ranges come from their backs;
 *  3. threads racing on one split (real pthreads, one of them starting late) take every chunk
 *     exactly once.
 * Built and run by tests/test_kernels.py (test_split_check); under the sanitizers by hand:
 *   cc -std=c11 -D_GNU_SOURCE -pthread -fsanitize=thread -Icsrc -o /tmp/sc \
 *       tests/c/split_check.c csrc/kernels/pool.c csrc/common.c && /tmp/sc
 * Prints "ok" and exits 0, or prints the first failure and exits 1. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kernels/kimpl.h"

#define FAIL(...)                                                                              \
    do {                                                                                       \
        printf(__VA_ARGS__);                                                                   \
        printf("\n");                                                                          \
        exit(1);                                                                               \
    } while (0)

/* The range [a, b) that thread k owns among `threads` for n chunks (smoe_split_init's cut). */
static void own_range(uint32_t n, uint32_t threads, uint32_t k, uint32_t *a, uint32_t *b) {
    uint32_t R = threads > SMOE_SPLIT_RANGES ? SMOE_SPLIT_RANGES : threads, r = k % R;
    *a = (uint32_t)((uint64_t)n * r / R);
    *b = (uint32_t)((uint64_t)n * (r + 1) / R);
}

/* One thread at a time in the order `who` gives (who[i] < threads; -1 ends), each taking one
 * chunk per turn; then every thread once more until none gets anything. */
static void sequential(uint32_t n, uint32_t threads, const int *who) {
    static smoe_split s;
    static uint32_t seen[128], last[32];
    static int in_own[32];
    memset(seen, 0, sizeof seen);
    for (uint32_t k = 0; k < 32; k++) last[k] = UINT32_MAX, in_own[k] = 1;
    smoe_split_init(&s, n, threads);
    uint32_t got = 0;
    for (int i = 0;; i++) {
        int k = who[i];
        if (k < 0) break;
        uint32_t c, a, b;
        if (!smoe_split_next(&s, (uint32_t)k, &c)) continue;
        if (c >= n) FAIL("n=%u threads=%u: chunk %u out of range", n, threads, c);
        if (seen[c]++) FAIL("n=%u threads=%u: chunk %u taken twice", n, threads, c);
        got++;
        own_range(n, threads, (uint32_t)k, &a, &b);
        /* more threads than ranges share them (both take fronts): no order to check */
        int own = c >= a && c < b && threads <= SMOE_SPLIT_RANGES;
        if (own && !in_own[k])
            FAIL("n=%u threads=%u: thread %d took own chunk %u after stealing", n, threads, k, c);
        if (own && last[k] != UINT32_MAX && c != last[k] + 1)
            FAIL("n=%u threads=%u: thread %d's own chunks out of order (%u after %u)", n,
                 threads, k, c, last[k]);
        if (own && last[k] == UINT32_MAX && c != a)
            FAIL("n=%u threads=%u: thread %d began its range at %u, not %u", n, threads, k, c, a);
        if (own) last[k] = c;
        else in_own[k] = 0;
    }
    for (int more = 1; more;) {
        more = 0;
        for (uint32_t k = 0; k < threads; k++) {
            uint32_t c;
            if (!smoe_split_next(&s, k, &c)) continue;
            if (c >= n || seen[c]++) FAIL("n=%u threads=%u: chunk %u bad or twice", n, threads, c);
            got++;
            more = 1;
        }
    }
    if (got != n) FAIL("n=%u threads=%u: %u chunks taken", n, threads, got);
}

/* A steal takes the back of the first non-empty range after the thread's own. */
static void steal_order(void) {
    smoe_split s;
    smoe_split_init(&s, 8, 2); /* thread 0: [0, 4), thread 1: [4, 8) */
    const uint32_t want[8] = {0, 1, 2, 3, 7, 6, 5, 4};
    for (int i = 0; i < 8; i++) {
        uint32_t c;
        if (!smoe_split_next(&s, 0, &c) || c != want[i])
            FAIL("thread 0 alone: take %d was %u, want %u", i, c, want[i]);
    }
    uint32_t c;
    if (smoe_split_next(&s, 1, &c)) FAIL("thread 1 got %u from an empty split", c);
}

typedef struct racer {
    smoe_split *s;
    uint32_t k, late_us;
    uint32_t *count; /* per chunk, atomic */
} racer;

static void *race(void *varg) {
    racer *r = varg;
    if (r->late_us) {
        struct timespec ts = {0, (long)r->late_us * 1000};
        nanosleep(&ts, NULL);
    }
    uint32_t c;
    while (smoe_split_next(r->s, r->k, &c)) __atomic_add_fetch(&r->count[c], 1u, __ATOMIC_RELAXED);
    return NULL;
}

static void racing(uint32_t n, uint32_t threads, int rounds) {
    static smoe_split s;
    uint32_t *count = calloc(n ? n : 1, 4);
    pthread_t th[8];
    racer rs[8];
    for (int round = 0; round < rounds; round++) {
        memset(count, 0, (size_t)(n ? n : 1) * 4);
        smoe_split_init(&s, n, threads);
        for (uint32_t k = 0; k < threads; k++) {
            rs[k] = (racer){&s, k, k == threads - 1 ? (uint32_t)(round % 3) * 50 : 0, count};
            pthread_create(&th[k], NULL, race, &rs[k]);
        }
        for (uint32_t k = 0; k < threads; k++) pthread_join(th[k], NULL);
        for (uint32_t c = 0; c < n; c++)
            if (count[c] != 1)
                FAIL("race n=%u threads=%u round %d: chunk %u taken %u times", n, threads, round,
                     c, count[c]);
    }
    free(count);
}

int main(void) {
    static int who[4096];
    unsigned seed = 12345;
    for (uint32_t threads = 1; threads <= 20; threads++)
        for (uint32_t n = 0; n <= 70; n++) {
            int i = 0; /* all in turn */
            for (uint32_t r = 0; r < n; r++)
                for (uint32_t k = 0; k < threads; k++) who[i++] = (int)k;
            who[i] = -1;
            sequential(n, threads, who);
            for (i = 0; i < (int)n; i++) who[i] = 0; /* the caller alone: no worker woke */
            who[i] = -1;
            sequential(n, threads, who);
            for (i = 0; i < 200; i++) { /* random turns, then a late thread (the last) */
                seed = seed * 1103515245u + 12345u;
                who[i] = (int)((seed >> 16) % (threads > 1 ? threads - 1 : 1));
            }
            who[i] = -1;
            sequential(n, threads, who);
        }
    steal_order();
    racing(100000, 2, 20);
    racing(1000, 3, 200);
    racing(37, 4, 500);
    racing(0, 2, 10);
    printf("ok\n");
    return 0;
}

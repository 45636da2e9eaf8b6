#define _POSIX_C_SOURCE 200809L
#include "common.h"

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <time.h>
#ifdef __linux__
#include <sys/mman.h>
#endif

double smoe_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void smoe_advise_huge(const void *p, size_t n, int collapse) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
    const uintptr_t huge = (uintptr_t)2 << 20;
    const uintptr_t a = ((uintptr_t)p + huge - 1) & ~(huge - 1);
    const uintptr_t b = ((uintptr_t)p + n) & ~(huge - 1);
    if (!p || b <= a) return; /* no whole 2 MB page inside */
    const char *env = getenv("SPECMOE_HUGEPAGES");
    if (env && env[0] == '0') return; /* switched off (A/B measurements, THP trouble) */
    (void)madvise((void *)a, b - a, MADV_HUGEPAGE);
#ifndef MADV_COLLAPSE
#define MADV_COLLAPSE 25 /* Linux 6.1 */
#endif
    /* EAGAIN is transient (pages busy, a temporary shortage): a few more tries, then the
     * weights stay on whatever pages they have */
    for (int tries = 0; collapse && tries < 3; tries++)
        if (madvise((void *)a, b - a, MADV_COLLAPSE) == 0 || errno != EAGAIN) break;
#else
    (void)p, (void)n, (void)collapse;
#endif
}

/* specmoe common definitions: error codes and the error record every C function fills.
 *
 * Convention: functions return 0 (SMOE_OK) or a negative SMOE_E* code and, on failure, fill a
 * smoe_err with a message that names what was wrong (file, offset, layer, expert).  module.c
 * turns the code into a Python exception (see smoe_py_raise in py_common.h).
 */
#ifndef SMOE_COMMON_H
#define SMOE_COMMON_H

#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

enum {
    SMOE_OK = 0,
    SMOE_EINVAL = -1,   /* bad argument -> ValueError */
    SMOE_ENOMEM = -2,   /* allocation failed -> MemoryError */
    SMOE_EIO = -3,      /* read/write/open failed -> specmoe.StoreError */
    SMOE_ECORRUPT = -4, /* truncated/damaged/foreign file, checksum mismatch -> StoreError */
    SMOE_ECACHE = -5,   /* cache cannot satisfy the request (all slots pinned, closed) -> CacheError */
    SMOE_EPOLICY = -6,  /* eviction policy failed (e.g. a Python policy raised) -> PolicyError */
    SMOE_ESTATE = -7,   /* object used in the wrong state (closed, released twice) -> CacheError */
    SMOE_EDEVICE = -8   /* a CUDA or cuBLAS call failed, or no GPU is usable -> specmoe.CudaError
                           (raised by specmoe._cuda; the base SpecmoeError elsewhere) */
};

#define SMOE_ERR_MSG 512

typedef struct smoe_err {
    int code;
    char msg[SMOE_ERR_MSG];
} smoe_err;

/* Fill *e (may be NULL) and return code, so callers can write `return smoe_err_set(...)`. */
static inline int smoe_err_set(smoe_err *e, int code, const char *fmt, ...)
#if defined(__GNUC__)
    __attribute__((format(printf, 3, 4)))
#endif
    ;
static inline int smoe_err_set(smoe_err *e, int code, const char *fmt, ...) {
    if (e) {
        va_list ap;
        va_start(ap, fmt);
        e->code = code;
        vsnprintf(e->msg, sizeof e->msg, fmt, ap);
        va_end(ap);
    }
    return code;
}

static inline void smoe_err_clear(smoe_err *e) {
    if (e) {
        e->code = 0;
        e->msg[0] = '\0';
    }
}

/* Monotonic clock in seconds. */
double smoe_now(void);

/* Ask Linux to back [p, p + n) with 2 MB pages where it holds whole ones (a hint: errors are
 * ignored, contents never change): MADV_HUGEPAGE, and with collapse also MADV_COLLAPSE
 * (Linux 6.1+), which moves already-written memory onto huge pages now.  A core streams
 * weights markedly faster from huge pages -- a plain one-stream read loop here went from
 * 18-21 to 27-30 GB/s -- since a 4 KB page is where the hardware prefetcher stops and a TLB
 * miss starts.  For weights that stay for the model's lifetime (the dense layers' blocks, the
 * cache's slots).  NumPy already asks for huge pages on its large arrays (the quantized
 * blocks), so what this adds in practice is the cache's slab (C memory: DeepSeek-V2-Lite int4
 * decode 20.2-21.2 -> 17.9-18.6 ms a step at 1 thread) and any block allocated without that
 * request; transformers' bf16 weights mapped from the safetensors file are file pages, left
 * to the page cache (which held them in 2 MB folios here).  With THP "never" it does
 * nothing.  No-op off Linux, and with the environment
 * variable SPECMOE_HUGEPAGES=0. */
void smoe_advise_huge(const void *p, size_t n, int collapse);

/* Expert key: layer * num_experts + expert.  Layers are 0-based positions in the store. */
static inline int32_t smoe_key(uint32_t layer, uint32_t expert, uint32_t num_experts) {
    return (int32_t)(layer * num_experts + expert);
}

#define SMOE_ALIGN 4096u /* slow-tier block alignment and fast-tier slot alignment */

#endif

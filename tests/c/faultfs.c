/* LD_PRELOAD fault injector for the store's reads (tests/test_faults.py).
 *
 * Wraps pread, pread64 and read.  A call is *eligible* when its descriptor's path
 * (readlink /proc/self/fd/N) contains the armed substring and the calling thread matches the
 * armed thread class.  After `after` eligible calls pass through untouched, the next `count`
 * eligible calls (-1: all of them) are faulted according to the mode:
 *
 *   1 eio    return -1 with errno = EIO
 *   2 short  read at most half the request (at least 1 byte): a correct reader loops
 *   3 eof    return 0 (end of file where the file has data)
 *   4 zeros  do the read, then overwrite the bytes with zeros and return the full count
 *            (silent corruption: only a checksum can catch it)
 *
 * Thread classes: 0 any thread, 1 the process's main thread only (demand loads of a caller
 * on the main thread), 2 every other thread (the prefetch worker).
 *
 * Control from the process under test through ctypes (ctypes.CDLL(None) sees these symbols):
 *   smoe_fault_arm(const char *path_substr, int mode, long after, long count, int threads)
 *   smoe_fault_disarm(void)
 *   long smoe_fault_injected(void)     faults injected since the last arm
 * or at start-up from the environment: SMOE_FAULT_PATH=substr and
 * SMOE_FAULT=mode,after,count,threads (numbers as above).
 *
 * No global state other than these atomics and the substring (written only by arm, which the
 * tests call while no store read is in flight).
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <sys/types.h>
#include <unistd.h>

typedef ssize_t (*pread_fn)(int, void *, size_t, off_t);
typedef ssize_t (*read_fn)(int, void *, size_t);

static char g_path[1024];
static atomic_int g_mode;     /* 0: disarmed */
static atomic_long g_after;   /* eligible calls left to pass before faulting */
static atomic_long g_count;   /* faults left to inject; -1 unlimited */
static atomic_int g_threads;  /* 0 any, 1 main only, 2 non-main only */
static atomic_long g_injected;

void smoe_fault_arm(const char *path_substr, int mode, long after, long count, int threads) {
    atomic_store(&g_mode, 0);
    snprintf(g_path, sizeof g_path, "%s", path_substr ? path_substr : "");
    atomic_store(&g_after, after);
    atomic_store(&g_count, count);
    atomic_store(&g_threads, threads);
    atomic_store(&g_injected, 0);
    atomic_store(&g_mode, mode);
}

void smoe_fault_disarm(void) { atomic_store(&g_mode, 0); }

long smoe_fault_injected(void) { return atomic_load(&g_injected); }

__attribute__((constructor)) static void fault_init(void) {
    const char *p = getenv("SMOE_FAULT_PATH"), *f = getenv("SMOE_FAULT");
    if (!p || !f) return;
    int mode = 0, threads = 0;
    long after = 0, count = -1;
    if (sscanf(f, "%d,%ld,%ld,%d", &mode, &after, &count, &threads) >= 1)
        smoe_fault_arm(p, mode, after, count, threads);
}

/* The fault mode for this call, or 0 to pass it through. */
static int decide(int fd) {
    int mode = atomic_load(&g_mode);
    if (mode == 0) return 0;
    int th = atomic_load(&g_threads);
    if (th != 0) {
        int is_main = (pid_t)syscall(SYS_gettid) == getpid();
        if ((th == 1) != is_main) return 0;
    }
    char link[64], target[1024];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, target, sizeof target - 1);
    if (n <= 0) return 0;
    target[n] = '\0';
    if (!strstr(target, g_path)) return 0;
    if (atomic_fetch_sub(&g_after, 1) > 0) return 0;
    long left = atomic_load(&g_count);
    for (;;) {
        if (left == 0) return 0;
        if (left < 0) break;
        if (atomic_compare_exchange_weak(&g_count, &left, left - 1)) break;
    }
    atomic_fetch_add(&g_injected, 1);
    return mode;
}

static ssize_t faulted(int mode, int fd, void *buf, size_t len, off_t off, int positioned) {
    static pread_fn real_pread;
    static read_fn real_read;
    if (!real_pread) real_pread = (pread_fn)dlsym(RTLD_NEXT, "pread64");
    if (!real_read) real_read = (read_fn)dlsym(RTLD_NEXT, "read");
    switch (mode) {
    case 1:
        errno = EIO;
        return -1;
    case 2: {
        size_t half = len > 1 ? len / 2 : len;
        return positioned ? real_pread(fd, buf, half, off) : real_read(fd, buf, half);
    }
    case 3:
        return 0;
    default: {
        ssize_t r = positioned ? real_pread(fd, buf, len, off) : real_read(fd, buf, len);
        if (r > 0) memset(buf, 0, (size_t)r);
        return r;
    }
    }
}

ssize_t pread64(int fd, void *buf, size_t len, off_t off) {
    static pread_fn real;
    if (!real) real = (pread_fn)dlsym(RTLD_NEXT, "pread64");
    int mode = decide(fd);
    return mode ? faulted(mode, fd, buf, len, off, 1) : real(fd, buf, len, off);
}

ssize_t pread(int fd, void *buf, size_t len, off_t off) { return pread64(fd, buf, len, off); }

ssize_t read(int fd, void *buf, size_t len) {
    static read_fn real;
    if (!real) real = (read_fn)dlsym(RTLD_NEXT, "read");
    int mode = decide(fd);
    return mode ? faulted(mode, fd, buf, len, 0, 0) : real(fd, buf, len);
}

/* libFuzzer target for the C side of the store: smoe_store_open / smoe_store_read with
 * header-derived numbers and file contents taken from the fuzzer's input, and the CRC32C
 * hardware path against the table path.
 *
 * The JSON header itself is parsed in Python (specmoe/storage/store.py `_parse_header`, fuzzed by
 * tests/fuzz/fuzz_inputs.py); what reaches C from it is (data_offset, block_bytes,
 * num_layers, num_experts, crc table) and the file's bytes.  This target feeds arbitrary
 * values of those - valid-looking ones most of the time, raw 64/32-bit ones when the first
 * byte says so - and checks, besides the sanitizers (ASan+UBSan):
 *   - open succeeds only when the file holds every block (size check, no overflow);
 *   - a successful read returns exactly the file's bytes at the documented offset, and with
 *     verification on only when the block's CRC32C matches the table;
 *   - a failed call returns a negative SMOE_E* code with a message naming the file;
 *   - out-of-range (layer, expert) is SMOE_EINVAL;
 *   - smoe_crc32c (SSE4.2, 3-way) == smoe_crc32c_portable on the input bytes.
 * Any violation calls abort(), which libFuzzer reports as a crash with the input saved.
 *
 * Input layout: [32-byte parameter record][file bytes].  Record: byte 0 mode (bit 0 raw
 * values, bit 1 verify, bit 2 all checksums true, bit 3 CRC differential over 16 KiB), bytes 1-5 small values, 4-11 raw
 * data_offset, 12-19 raw block_bytes (also the true-checksum mask), 20-23 raw num_layers,
 * 24-27 raw num_experts, 28-31 seed of the wrong checksums.  The file is written to a memfd and
 * opened by its /proc/self/fd path, so no disk I/O happens per execution.
 *
 * Build: clang -fsanitize=fuzzer,address,undefined (see tests/fuzz/Makefile).
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "store.h"

#define CHECK(cond)                                                                     \
    do {                                                                                \
        if (!(cond)) {                                                                  \
            fprintf(stderr, "store_fuzz: check failed at line %d: %s\n", __LINE__, #cond); \
            abort();                                                                    \
        }                                                                               \
    } while (0)

static int g_fd = -1;
static char g_path[64];

static uint64_t rd64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}
static uint32_t rd32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (g_fd < 0) {
        g_fd = memfd_create("smoe-fuzz-store", MFD_CLOEXEC);
        CHECK(g_fd >= 0);
        snprintf(g_path, sizeof g_path, "/proc/self/fd/%d", g_fd);
    }
    /* differential CRC check on the whole input (exercises the 3-way path above 12 KiB) */
    /* the whole 3-way path (>= 12 KiB) when bit 3 of the mode byte is set, else 4 KiB:
     * the table path is slow under ASan and this runs on every input */
    size_t cn = (size && (data[0] & 8)) ? (size < 16384 ? size : 16384) : (size < 4096 ? size : 4096);
    CHECK(smoe_crc32c(0, data, cn) == smoe_crc32c_portable(0, data, cn));
    if (cn > 7) CHECK(smoe_crc32c(smoe_crc32c(0, data, 7), data + 7, cn - 7) ==
                      smoe_crc32c(0, data, cn));
    if (size < 32) return 0;
    const uint8_t *prm = data;
    const uint8_t *file = data + 32;
    size_t fsize = size - 32;

    uint8_t mode = prm[0];
    uint64_t data_offset, block_bytes;
    uint32_t nl, ne;
    if (mode & 1) { /* raw values, as a hostile header could make them */
        data_offset = rd64(prm + 4);
        block_bytes = rd64(prm + 12);
        nl = rd32(prm + 20);
        ne = rd32(prm + 24);
    } else { /* plausible values, so reads happen often */
        data_offset = (uint64_t)(prm[1] % 4) * SMOE_ALIGN;
        block_bytes = (uint64_t)(prm[2] % 4) * SMOE_ALIGN + ((prm[3] & 0x80) ? prm[3] : 0);
        nl = 1u + prm[4] % 4;
        ne = 1u + prm[5] % 8;
    }
    int flags = (mode & 2) ? SMOE_STORE_VERIFY : 0;
    /* which blocks get their true checksum (all of them when bit 2 is set) */
    uint64_t correct_mask = (mode & 4) ? ~(uint64_t)0 : rd64(prm + 12);

    CHECK(ftruncate(g_fd, 0) == 0);
    if (fsize) CHECK(pwrite(g_fd, file, fsize, 0) == (ssize_t)fsize);

    /* the crc table the Python side would pass: one entry per block (bounded here; a table
     * for more blocks than the file can hold is refused by open before it is read) */
    uint64_t nblocks = (uint64_t)nl * ne;
    uint32_t *crc = NULL;
    if (nblocks > 0 && nblocks <= 4096) {
        crc = calloc(nblocks, sizeof *crc);
        CHECK(crc);
        for (uint64_t i = 0; i < nblocks; i++) {
            uint64_t off = data_offset + i * block_bytes;
            if (((correct_mask >> (i % 64)) & 1u) && block_bytes && off <= fsize &&
                block_bytes <= fsize - off && data_offset <= fsize)
                crc[i] = smoe_crc32c(0, file + off, (size_t)block_bytes);
            else
                crc[i] = rd32(prm + 28) ^ (uint32_t)i;
        }
    } else if (flags & SMOE_STORE_VERIFY) {
        flags &= ~SMOE_STORE_VERIFY; /* the caller can only pass a table it has */
    }

    smoe_store s;
    smoe_err err;
    smoe_err_clear(&err);
    int rc = smoe_store_open(&s, g_path, data_offset, block_bytes, nl, ne, crc, flags, &err);
    int shape_ok = block_bytes > 0 && block_bytes % SMOE_ALIGN == 0 &&
                   data_offset % SMOE_ALIGN == 0 && nl > 0 && ne > 0;
    int fits = 0;
    if (shape_ok && block_bytes <= (UINT64_MAX - data_offset) / nblocks)
        fits = data_offset + nblocks * block_bytes <= fsize;
    if (rc != 0) {
        CHECK(rc < 0 && err.code == rc && err.msg[0] != '\0');
        CHECK(!(shape_ok && fits)); /* a well-formed store that fits must open */
        free(crc);
        return 0;
    }
    CHECK(shape_ok && fits);

    uint8_t *buf = aligned_alloc(SMOE_ALIGN, (size_t)block_bytes);
    CHECK(buf);
    unsigned reads = 0;
    for (uint32_t l = 0; l < nl && reads < 16; l++) {
        for (uint32_t e = 0; e < ne && reads < 16; e++, reads++) {
            uint64_t idx = (uint64_t)l * ne + e;
            uint64_t off = data_offset + idx * block_bytes;
            smoe_err_clear(&err);
            int r = smoe_store_read(&s, l, e, buf, &err);
            if (r == 0) {
                CHECK(memcmp(buf, file + off, (size_t)block_bytes) == 0);
                if (flags & SMOE_STORE_VERIFY)
                    CHECK(smoe_crc32c(0, buf, (size_t)block_bytes) == crc[idx]);
            } else {
                CHECK(r < 0 && strstr(err.msg, g_path) != NULL);
                CHECK(flags & SMOE_STORE_VERIFY); /* only a checksum can fail here */
                CHECK(smoe_crc32c(0, file + off, (size_t)block_bytes) != crc[idx]);
            }
        }
    }
    /* out-of-range blocks are refused, never read */
    smoe_err_clear(&err);
    CHECK(smoe_store_read(&s, nl, 0, buf, &err) == SMOE_EINVAL);
    CHECK(smoe_store_read(&s, 0, ne, buf, &err) == SMOE_EINVAL);
    smoe_store_close(&s);
    smoe_err_clear(&err);
    CHECK(smoe_store_read(&s, 0, 0, buf, &err) < 0); /* closed */
    free(buf);
    free(crc);
    return 0;
}

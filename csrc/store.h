/* Slow tier: expert blocks in one safetensors-compatible file.
 *
 * File layout (written by specmoe/storage/store.py, see its docstring for the full format):
 *   [u64 little-endian header length N][N bytes JSON header, space padded][data]
 * The data section starts at `data_offset` (a multiple of SMOE_ALIGN).  Block (layer, expert)
 * occupies `block_bytes` (a multiple of SMOE_ALIGN) at
 *   data_offset + (layer * num_experts + expert) * block_bytes.
 * The JSON header is parsed and validated in Python; C receives the numbers it needs here.
 *
 * Thread safety: after smoe_store_open, smoe_store_read may be called from any number of
 * threads at once (pread on a shared descriptor; no mutable shared state except the atomic
 * byte counter).  open/close must not race with reads.
 */
#ifndef SMOE_STORE_H
#define SMOE_STORE_H

#include "common.h"

enum {
    SMOE_STORE_DIRECT = 1, /* try O_DIRECT (bypass the page cache); falls back if refused */
    SMOE_STORE_VERIFY = 2  /* verify each block's CRC32C on every read */
};

typedef struct smoe_store {
    int fd;        /* buffered descriptor, always open */
    int fd_direct; /* O_DIRECT descriptor, or -1 when not requested or refused */
    int flags;     /* SMOE_STORE_* as requested */
    char path[1024];
    uint64_t data_offset;
    uint64_t block_bytes;
    uint32_t num_layers;
    uint32_t num_experts;
    uint32_t *crc; /* owned; num_layers*num_experts CRC32C of each full block, or NULL */
    uint64_t bytes_read; /* updated atomically (__atomic builtins) */
    int direct_off; /* set atomically once an O_DIRECT read was refused (EINVAL): from then on
                       every read uses the buffered descriptor; fd_direct stays open until
                       close so a concurrent reader never sees it closed under it */
} smoe_store;

/* Open `path`.  `crc` (may be NULL when VERIFY is not requested) is copied.  Checks that the
 * file is large enough for all blocks; a short file is SMOE_ECORRUPT naming the file. */
int smoe_store_open(smoe_store *s, const char *path, uint64_t data_offset, uint64_t block_bytes,
                    uint32_t num_layers, uint32_t num_experts, const uint32_t *crc, int flags,
                    smoe_err *err);

/* Read block (layer, expert) into dst (block_bytes bytes; SMOE_ALIGN-aligned for O_DIRECT,
 * otherwise the buffered path is used).  Short read -> SMOE_ECORRUPT; checksum mismatch ->
 * SMOE_ECORRUPT naming file, layer, expert and offset.  Blocking: call without the GIL. */
int smoe_store_read(smoe_store *s, uint32_t layer, uint32_t expert, void *dst, smoe_err *err);

/* Whether reads currently go through O_DIRECT. */
int smoe_store_is_direct(const smoe_store *s);

void smoe_store_close(smoe_store *s);

/* CRC32C (Castagnoli), hardware SSE4.2 path where the CPU has it, table otherwise.
 * Start with crc = 0; chaining: smoe_crc32c(smoe_crc32c(0, a, n), b, m) == crc of a||b. */
uint32_t smoe_crc32c(uint32_t crc, const void *buf, size_t len);

/* The same CRC32C through the table path only (for tests comparing the two paths). */
uint32_t smoe_crc32c_portable(uint32_t crc, const void *buf, size_t len);

#endif

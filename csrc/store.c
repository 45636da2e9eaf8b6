/* Slow tier: positioned reads of expert blocks from one file, with optional O_DIRECT and a
 * CRC32C check of every block read.  See store.h for the layout and thread-safety contract. */
#include "store.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <nmmintrin.h>
#define SMOE_HAVE_SSE42_PATH 1
#endif

/* ---- CRC32C (Castagnoli, reflected polynomial 0x82F63B78) ---- */

static const uint32_t crc32c_table[256] = {
    0x00000000u, 0xf26b8303u, 0xe13b70f7u, 0x1350f3f4u, 0xc79a971fu, 0x35f1141cu,
    0x26a1e7e8u, 0xd4ca64ebu, 0x8ad958cfu, 0x78b2dbccu, 0x6be22838u, 0x9989ab3bu,
    0x4d43cfd0u, 0xbf284cd3u, 0xac78bf27u, 0x5e133c24u, 0x105ec76fu, 0xe235446cu,
    0xf165b798u, 0x030e349bu, 0xd7c45070u, 0x25afd373u, 0x36ff2087u, 0xc494a384u,
    0x9a879fa0u, 0x68ec1ca3u, 0x7bbcef57u, 0x89d76c54u, 0x5d1d08bfu, 0xaf768bbcu,
    0xbc267848u, 0x4e4dfb4bu, 0x20bd8edeu, 0xd2d60dddu, 0xc186fe29u, 0x33ed7d2au,
    0xe72719c1u, 0x154c9ac2u, 0x061c6936u, 0xf477ea35u, 0xaa64d611u, 0x580f5512u,
    0x4b5fa6e6u, 0xb93425e5u, 0x6dfe410eu, 0x9f95c20du, 0x8cc531f9u, 0x7eaeb2fau,
    0x30e349b1u, 0xc288cab2u, 0xd1d83946u, 0x23b3ba45u, 0xf779deaeu, 0x05125dadu,
    0x1642ae59u, 0xe4292d5au, 0xba3a117eu, 0x4851927du, 0x5b016189u, 0xa96ae28au,
    0x7da08661u, 0x8fcb0562u, 0x9c9bf696u, 0x6ef07595u, 0x417b1dbcu, 0xb3109ebfu,
    0xa0406d4bu, 0x522bee48u, 0x86e18aa3u, 0x748a09a0u, 0x67dafa54u, 0x95b17957u,
    0xcba24573u, 0x39c9c670u, 0x2a993584u, 0xd8f2b687u, 0x0c38d26cu, 0xfe53516fu,
    0xed03a29bu, 0x1f682198u, 0x5125dad3u, 0xa34e59d0u, 0xb01eaa24u, 0x42752927u,
    0x96bf4dccu, 0x64d4cecfu, 0x77843d3bu, 0x85efbe38u, 0xdbfc821cu, 0x2997011fu,
    0x3ac7f2ebu, 0xc8ac71e8u, 0x1c661503u, 0xee0d9600u, 0xfd5d65f4u, 0x0f36e6f7u,
    0x61c69362u, 0x93ad1061u, 0x80fde395u, 0x72966096u, 0xa65c047du, 0x5437877eu,
    0x4767748au, 0xb50cf789u, 0xeb1fcbadu, 0x197448aeu, 0x0a24bb5au, 0xf84f3859u,
    0x2c855cb2u, 0xdeeedfb1u, 0xcdbe2c45u, 0x3fd5af46u, 0x7198540du, 0x83f3d70eu,
    0x90a324fau, 0x62c8a7f9u, 0xb602c312u, 0x44694011u, 0x5739b3e5u, 0xa55230e6u,
    0xfb410cc2u, 0x092a8fc1u, 0x1a7a7c35u, 0xe811ff36u, 0x3cdb9bddu, 0xceb018deu,
    0xdde0eb2au, 0x2f8b6829u, 0x82f63b78u, 0x709db87bu, 0x63cd4b8fu, 0x91a6c88cu,
    0x456cac67u, 0xb7072f64u, 0xa457dc90u, 0x563c5f93u, 0x082f63b7u, 0xfa44e0b4u,
    0xe9141340u, 0x1b7f9043u, 0xcfb5f4a8u, 0x3dde77abu, 0x2e8e845fu, 0xdce5075cu,
    0x92a8fc17u, 0x60c37f14u, 0x73938ce0u, 0x81f80fe3u, 0x55326b08u, 0xa759e80bu,
    0xb4091bffu, 0x466298fcu, 0x1871a4d8u, 0xea1a27dbu, 0xf94ad42fu, 0x0b21572cu,
    0xdfeb33c7u, 0x2d80b0c4u, 0x3ed04330u, 0xccbbc033u, 0xa24bb5a6u, 0x502036a5u,
    0x4370c551u, 0xb11b4652u, 0x65d122b9u, 0x97baa1bau, 0x84ea524eu, 0x7681d14du,
    0x2892ed69u, 0xdaf96e6au, 0xc9a99d9eu, 0x3bc21e9du, 0xef087a76u, 0x1d63f975u,
    0x0e330a81u, 0xfc588982u, 0xb21572c9u, 0x407ef1cau, 0x532e023eu, 0xa145813du,
    0x758fe5d6u, 0x87e466d5u, 0x94b49521u, 0x66df1622u, 0x38cc2a06u, 0xcaa7a905u,
    0xd9f75af1u, 0x2b9cd9f2u, 0xff56bd19u, 0x0d3d3e1au, 0x1e6dcdeeu, 0xec064eedu,
    0xc38d26c4u, 0x31e6a5c7u, 0x22b65633u, 0xd0ddd530u, 0x0417b1dbu, 0xf67c32d8u,
    0xe52cc12cu, 0x1747422fu, 0x49547e0bu, 0xbb3ffd08u, 0xa86f0efcu, 0x5a048dffu,
    0x8ecee914u, 0x7ca56a17u, 0x6ff599e3u, 0x9d9e1ae0u, 0xd3d3e1abu, 0x21b862a8u,
    0x32e8915cu, 0xc083125fu, 0x144976b4u, 0xe622f5b7u, 0xf5720643u, 0x07198540u,
    0x590ab964u, 0xab613a67u, 0xb831c993u, 0x4a5a4a90u, 0x9e902e7bu, 0x6cfbad78u,
    0x7fab5e8cu, 0x8dc0dd8fu, 0xe330a81au, 0x115b2b19u, 0x020bd8edu, 0xf0605beeu,
    0x24aa3f05u, 0xd6c1bc06u, 0xc5914ff2u, 0x37faccf1u, 0x69e9f0d5u, 0x9b8273d6u,
    0x88d28022u, 0x7ab90321u, 0xae7367cau, 0x5c18e4c9u, 0x4f48173du, 0xbd23943eu,
    0xf36e6f75u, 0x0105ec76u, 0x12551f82u, 0xe03e9c81u, 0x34f4f86au, 0xc69f7b69u,
    0xd5cf889du, 0x27a40b9eu, 0x79b737bau, 0x8bdcb4b9u, 0x988c474du, 0x6ae7c44eu,
    0xbe2da0a5u, 0x4c4623a6u, 0x5f16d052u, 0xad7d5351u,
};

static uint32_t crc32c_sw(uint32_t crc, const uint8_t *p, size_t len) {
    for (size_t i = 0; i < len; i++) crc = crc32c_table[(crc ^ p[i]) & 0xffu] ^ (crc >> 8);
    return crc;
}

#if defined(SMOE_HAVE_SSE42_PATH) && defined(__x86_64__)
/* a(x) * b(x) mod P(x) in the reflected bit order (bit 31 is x^0). */
static uint32_t crc32c_mulmod(uint32_t a, uint32_t b) {
    uint32_t prod = 0;
    for (int i = 0; i < 32; i++) {
        if (a & 0x80000000u) prod ^= b;
        a <<= 1;
        b = (b & 1u) ? (b >> 1) ^ 0x82F63B78u : b >> 1;
    }
    return prod;
}
#endif

#ifdef SMOE_HAVE_SSE42_PATH
#define SMOE_CRC_STRIPE 4096u /* bytes per stream per round of the 3-way loop */

/* Raw (no pre/post inversion) CRC of len bytes, 8 at a time where possible. */
__attribute__((target("sse4.2"))) static uint32_t crc32c_hw(uint32_t crc, const uint8_t *p,
                                                             size_t len) {
    /* Byte steps until p is 8-byte aligned. */
    while (len > 0 && ((uintptr_t)p & 7u) != 0) {
        crc = _mm_crc32_u8(crc, *p);
        p++;
        len--;
    }
#if defined(__x86_64__)
    if (len >= 3 * (size_t)SMOE_CRC_STRIPE) {
        /* The crc32 instruction has a latency of ~3 cycles but issues every cycle: run three
         * independent streams over consecutive stripes A|B|C and merge them with
         *   crc(A|B) = crc(A) * x^(8|B|) mod P  xor  crc0(B)
         * where the multiplier k = x^(8*STRIPE) mod P is obtained by feeding zeros to x^0. */
        uint64_t k64 = 0x80000000u;
        for (unsigned i = 0; i < SMOE_CRC_STRIPE / 8; i++) k64 = _mm_crc32_u64(k64, 0);
        uint32_t k = (uint32_t)k64;
        while (len >= 3 * (size_t)SMOE_CRC_STRIPE) {
            uint64_t a = crc, b = 0, c = 0;
            const uint8_t *pb = p + SMOE_CRC_STRIPE, *pc = p + 2 * SMOE_CRC_STRIPE;
            for (unsigned i = 0; i < SMOE_CRC_STRIPE; i += 8) {
                uint64_t wa, wb, wc;
                memcpy(&wa, p + i, 8);
                memcpy(&wb, pb + i, 8);
                memcpy(&wc, pc + i, 8);
                a = _mm_crc32_u64(a, wa);
                b = _mm_crc32_u64(b, wb);
                c = _mm_crc32_u64(c, wc);
            }
            crc = crc32c_mulmod((uint32_t)a, k) ^ (uint32_t)b;
            crc = crc32c_mulmod(crc, k) ^ (uint32_t)c;
            p += 3 * SMOE_CRC_STRIPE;
            len -= 3 * SMOE_CRC_STRIPE;
        }
    }
    uint64_t c64 = crc;
    while (len >= 8) {
        uint64_t w;
        memcpy(&w, p, 8);
        c64 = _mm_crc32_u64(c64, w);
        p += 8;
        len -= 8;
    }
    crc = (uint32_t)c64;
#endif
    while (len >= 4) {
        uint32_t w;
        memcpy(&w, p, 4);
        crc = _mm_crc32_u32(crc, w);
        p += 4;
        len -= 4;
    }
    while (len > 0) {
        crc = _mm_crc32_u8(crc, *p);
        p++;
        len--;
    }
    return crc;
}
#endif

uint32_t smoe_crc32c(uint32_t crc, const void *buf, size_t len) {
    const uint8_t *p = (const uint8_t *)buf;
    crc = ~crc;
#ifdef SMOE_HAVE_SSE42_PATH
    if (__builtin_cpu_supports("sse4.2"))
        crc = crc32c_hw(crc, p, len);
    else
        crc = crc32c_sw(crc, p, len);
#else
    crc = crc32c_sw(crc, p, len);
#endif
    return ~crc;
}

/* Table-only path, exported for tests that compare the two implementations. */
uint32_t smoe_crc32c_portable(uint32_t crc, const void *buf, size_t len) {
    return ~crc32c_sw(~crc, (const uint8_t *)buf, len);
}

/* ---- store ---- */

int smoe_store_open(smoe_store *s, const char *path, uint64_t data_offset, uint64_t block_bytes,
                    uint32_t num_layers, uint32_t num_experts, const uint32_t *crc, int flags,
                    smoe_err *err) {
    memset(s, 0, sizeof *s);
    s->fd = -1;
    s->fd_direct = -1;
    if (!path || strlen(path) >= sizeof s->path)
        return smoe_err_set(err, SMOE_EINVAL, "store path is missing or longer than %zu bytes",
                            sizeof s->path - 1);
    if (block_bytes == 0 || block_bytes % SMOE_ALIGN != 0 || data_offset % SMOE_ALIGN != 0)
        return smoe_err_set(err, SMOE_EINVAL,
                            "%s: block_bytes %llu and data_offset %llu must be multiples of %u "
                            "(block_bytes > 0)",
                            path, (unsigned long long)block_bytes,
                            (unsigned long long)data_offset, SMOE_ALIGN);
    if (num_layers == 0 || num_experts == 0)
        return smoe_err_set(err, SMOE_EINVAL, "%s: num_layers %u and num_experts %u must be > 0",
                            path, num_layers, num_experts);
    if ((flags & SMOE_STORE_VERIFY) && !crc)
        return smoe_err_set(err, SMOE_EINVAL, "%s: verification requested without checksums",
                            path);
    uint64_t nblocks = (uint64_t)num_layers * num_experts;
    if (block_bytes > (UINT64_MAX - data_offset) / nblocks)
        return smoe_err_set(err, SMOE_EINVAL, "%s: store size overflows 64 bits", path);
    uint64_t need = data_offset + nblocks * block_bytes;

    snprintf(s->path, sizeof s->path, "%s", path);
    s->flags = flags;
    s->data_offset = data_offset;
    s->block_bytes = block_bytes;
    s->num_layers = num_layers;
    s->num_experts = num_experts;

    s->fd = open(path, O_RDONLY | O_CLOEXEC);
    if (s->fd < 0) {
        int e = errno;
        return smoe_err_set(err, SMOE_EIO, "%s: cannot open: %s", path, strerror(e));
    }
    struct stat st;
    if (fstat(s->fd, &st) != 0) {
        int e = errno;
        smoe_store_close(s);
        return smoe_err_set(err, SMOE_EIO, "%s: cannot stat: %s", path, strerror(e));
    }
    if ((uint64_t)st.st_size < need) {
        int rc = smoe_err_set(err, SMOE_ECORRUPT,
                              "%s: truncated: %llu bytes, but %u layers x %u experts x %llu-byte "
                              "blocks from offset %llu need %llu",
                              path, (unsigned long long)st.st_size, num_layers, num_experts,
                              (unsigned long long)block_bytes, (unsigned long long)data_offset,
                              (unsigned long long)need);
        smoe_store_close(s);
        return rc;
    }
    if (flags & SMOE_STORE_VERIFY) {
        s->crc = malloc(nblocks * sizeof *s->crc);
        if (!s->crc) {
            smoe_store_close(s);
            return smoe_err_set(err, SMOE_ENOMEM, "%s: cannot allocate %llu checksums", path,
                                (unsigned long long)nblocks);
        }
        memcpy(s->crc, crc, nblocks * sizeof *s->crc);
    }
    if (flags & SMOE_STORE_DIRECT) {
        /* Refusal (EINVAL on filesystems without O_DIRECT) is not an error: stay buffered. */
        s->fd_direct = open(path, O_RDONLY | O_CLOEXEC | O_DIRECT);
    }
    return SMOE_OK;
}

/* Read exactly len bytes at off.  Returns 0, or the errno of a failed pread, or -1 at EOF. */
static int pread_full(int fd, void *dst, uint64_t len, uint64_t off, uint64_t *got) {
    uint8_t *p = (uint8_t *)dst;
    uint64_t done = 0;
    while (done < len) {
        uint64_t want = len - done;
        if (want > (uint64_t)1 << 30) want = (uint64_t)1 << 30; /* keep each call modest */
        ssize_t n = pread(fd, p + done, (size_t)want, (off_t)(off + done));
        if (n < 0) {
            if (errno == EINTR) continue;
            *got = done;
            return errno;
        }
        if (n == 0) {
            *got = done;
            return -1;
        }
        done += (uint64_t)n;
    }
    *got = done;
    return 0;
}

int smoe_store_read(smoe_store *s, uint32_t layer, uint32_t expert, void *dst, smoe_err *err) {
    if (s->fd < 0) return smoe_err_set(err, SMOE_EIO, "%s: store is closed", s->path);
    if (layer >= s->num_layers || expert >= s->num_experts)
        return smoe_err_set(err, SMOE_EINVAL,
                            "%s: block (layer %u, expert %u) out of range (%u layers, %u experts)",
                            s->path, layer, expert, s->num_layers, s->num_experts);
    if (!dst) return smoe_err_set(err, SMOE_EINVAL, "%s: destination is NULL", s->path);
    uint64_t idx = (uint64_t)layer * s->num_experts + expert;
    uint64_t off = s->data_offset + idx * s->block_bytes;
    uint64_t got = 0;
    int rc = 1; /* 1: not yet read */

    int use_direct = s->fd_direct >= 0 && !__atomic_load_n(&s->direct_off, __ATOMIC_RELAXED) &&
                     ((uintptr_t)dst % SMOE_ALIGN) == 0;
    if (use_direct) {
        rc = pread_full(s->fd_direct, dst, s->block_bytes, off, &got);
        if (rc == EINVAL) {
            /* The filesystem accepted the O_DIRECT open but refuses the read: go buffered for
             * good (reported by smoe_store_is_direct). */
            __atomic_store_n(&s->direct_off, 1, __ATOMIC_RELAXED);
            rc = 1;
        }
    }
    if (rc == 1) rc = pread_full(s->fd, dst, s->block_bytes, off, &got);
    if (rc == -1)
        return smoe_err_set(err, SMOE_ECORRUPT,
                            "%s: truncated: block (layer %u, expert %u) at offset %llu: read %llu "
                            "of %llu bytes before end of file",
                            s->path, layer, expert, (unsigned long long)off,
                            (unsigned long long)got, (unsigned long long)s->block_bytes);
    if (rc != 0)
        return smoe_err_set(err, SMOE_EIO, "%s: read of block (layer %u, expert %u) at offset %llu "
                            "failed: %s",
                            s->path, layer, expert, (unsigned long long)off, strerror(rc));
    __atomic_add_fetch(&s->bytes_read, s->block_bytes, __ATOMIC_RELAXED);
    if ((s->flags & SMOE_STORE_VERIFY) && s->crc) {
        uint32_t c = smoe_crc32c(0, dst, (size_t)s->block_bytes);
        if (c != s->crc[idx])
            return smoe_err_set(err, SMOE_ECORRUPT,
                                "%s: checksum mismatch in block (layer %u, expert %u) at offset "
                                "%llu: stored crc32c 0x%08x, computed 0x%08x",
                                s->path, layer, expert, (unsigned long long)off, s->crc[idx], c);
    }
    return SMOE_OK;
}

int smoe_store_is_direct(const smoe_store *s) {
    return s->fd_direct >= 0 && !__atomic_load_n(&s->direct_off, __ATOMIC_RELAXED);
}

void smoe_store_close(smoe_store *s) {
    if (s->fd_direct >= 0) close(s->fd_direct);
    if (s->fd >= 0) close(s->fd);
    s->fd_direct = -1;
    s->fd = -1;
    free(s->crc);
    s->crc = NULL;
}

/* Randomized stress test of the expert cache and its prefetch worker, built straight from
 * the csrc sources (no interpreter) so ThreadSanitizer and AddressSanitizer see every access.
 *
 * A small store file is generated first: data_offset 4096, every block filled with 64-bit
 * words derived from its key, so a consumer can check that the bytes it was handed belong to
 * the expert it asked for.  One block is given a wrong CRC so its loads fail (the error path
 * runs under the sanitizers too).  Then consumer threads acquire/verify/release random
 * experts layer by layer while one of them starts passes and issues prefetches and cancels,
 * and the main thread swaps the policy, pauses and resumes the worker and waits for it.  At
 * the end the cache invariants and the counters are checked.  Exit status 0 only when every
 * check passed.
 *
 * usage: stress_cache   (environment STRESS_ITERS overrides the number of rounds) */
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cache.h"
#include "policy/policy.h"
#include "store.h"

#define NL 6u
#define NE 16u
#define BLOCK 8192u
#define NSLOTS 12u
#define TOPK 2u
#define NCONSUMERS 4
#define BAD_LAYER 3u
#define BAD_EXPERT 5u

static uint64_t word_of(int32_t key, uint64_t i) {
    uint64_t x = ((uint64_t)(uint32_t)key + 1) * 0x9E3779B97F4A7C15ull ^ (i * 0xD6E8FEB86659FD93ull);
    x ^= x >> 29;
    return x;
}

static void fill_block(uint8_t *b, int32_t key) {
    uint64_t *w = (uint64_t *)b;
    for (uint64_t i = 0; i < BLOCK / 8; i++) w[i] = word_of(key, i);
}

static int check_block(const uint8_t *b, int32_t key) {
    const uint64_t *w = (const uint64_t *)b;
    for (uint64_t i = 0; i < BLOCK / 8; i++)
        if (w[i] != word_of(key, i)) return -1;
    return 0;
}

static uint64_t rng_next(uint64_t *s) { /* xorshift64* */
    uint64_t x = *s;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *s = x;
    return x * 0x2545F4914F6CDD1Dull;
}

typedef struct {
    smoe_cache *cache;
    int id;
    int rounds;
    atomic_int *failures;
    atomic_ullong *acquires;     /* acquire calls made */
    atomic_ullong *load_errors;  /* acquires that returned the expected store error */
} worker_arg;

static atomic_int g_done;

#define FAIL(a, ...)                                                                        \
    do {                                                                                    \
        fprintf(stderr, "stress_cache: " __VA_ARGS__);                                      \
        fputc('\n', stderr);                                                                \
        atomic_fetch_add((a)->failures, 1);                                                 \
    } while (0)

static void *consumer(void *p) {
    worker_arg *a = p;
    uint64_t rng = 0x1234567ull + (uint64_t)a->id * 7919u;
    for (int r = 0; r < a->rounds; r++) {
        if (a->id == 0) smoe_slots_begin_pass(&a->cache->tab);
        for (uint32_t l = 0; l < NL; l++) {
            uint32_t e[TOPK];
            e[0] = (uint32_t)(rng_next(&rng) % NE);
            do e[1] = (uint32_t)(rng_next(&rng) % NE); while (e[1] == e[0]);
            if (a->id == 0 && l + 1 < NL) { /* predict the next layer */
                int32_t keys[3];
                float pr[3], prob[3];
                for (int i = 0; i < 3; i++) {
                    keys[i] = smoe_key(l + 1, (uint32_t)(rng_next(&rng) % NE), NE);
                    pr[i] = (float)(rng_next(&rng) % 4);
                    prob[i] = (float)(rng_next(&rng) % 5) / 4.0f;
                }
                smoe_err err;
                /* the admission rule (admit.h) on every other pass: its estimates and the
                 * worker's refusals race with the demand threads too */
                smoe_slots_set_admission(&a->cache->tab, (r >> 1) & 1, (r >> 2) & 1);
                if (smoe_slots_prefetch_p(&a->cache->tab, keys, pr, (r & 2) ? prob : NULL,
                                          1 + l % 2, 3, (int)(r & 1), &err) < 0)
                    FAIL(a, "prefetch: %s", err.msg);
                if (rng_next(&rng) % 5 == 0) smoe_slots_cancel(&a->cache->tab, keys[0]);
                if (rng_next(&rng) % 17 == 0) smoe_slots_cancel(&a->cache->tab, -1);
            }
            if (a->id == 1 && rng_next(&rng) % 3 == 0) { /* lookahead-buffer churn */
                int32_t keys[4];
                uint32_t n = (uint32_t)(rng_next(&rng) % 5); /* 0 clears the set */
                for (uint32_t i = 0; i < n; i++)
                    keys[i] = smoe_key((uint32_t)(rng_next(&rng) % NL),
                                       (uint32_t)(rng_next(&rng) % NE), NE);
                smoe_err err;
                if (smoe_slots_set_protected(&a->cache->tab, keys, n, &err) < 0)
                    FAIL(a, "set_protected: %s", err.msg);
            }
            int held[TOPK] = {0, 0};
            for (uint32_t i = 0; i < TOPK; i++) {
                const uint8_t *data = NULL;
                smoe_err err;
                smoe_err_clear(&err);
                atomic_fetch_add(a->acquires, 1);
                int rc = smoe_cache_acquire(a->cache, l, e[i], &data, &err);
                int bad = (l == BAD_LAYER && e[i] == BAD_EXPERT);
                if (bad) {
                    if (rc != SMOE_ECORRUPT) FAIL(a, "bad block: expected ECORRUPT, got %d", rc);
                    else atomic_fetch_add(a->load_errors, 1);
                    continue;
                }
                if (rc < 0) {
                    FAIL(a, "acquire(%u,%u): %d %s", l, e[i], rc, err.msg);
                    continue;
                }
                held[i] = 1;
                if (check_block(data, smoe_key(l, e[i], NE)) < 0)
                    FAIL(a, "acquire(%u,%u) returned another expert's bytes", l, e[i]);
            }
            for (uint32_t i = 0; i < TOPK; i++) {
                if (!held[i]) continue;
                smoe_err err;
                if (smoe_cache_release(a->cache, l, e[i], &err) < 0)
                    FAIL(a, "release(%u,%u): %s", l, e[i], err.msg);
            }
        }
    }
    return NULL;
}

static int check_invariants(smoe_cache *c) {
    int bad = 0;
    pthread_mutex_lock(&c->tab.mu);
    uint32_t nkeys = c->tab.num_layers * c->tab.num_experts;
    for (uint32_t s = 0; s < c->tab.nslots; s++) {
        smoe_slot *sl = &c->tab.slots[s];
        if (sl->pins != 0) bad++, fprintf(stderr, "slot %u still pinned (%d)\n", s, sl->pins);
        if (sl->state == SMOE_SLOT_LOADING) bad++, fprintf(stderr, "slot %u still loading\n", s);
        if (sl->state == SMOE_SLOT_READY) {
            if (sl->key < 0 || (uint32_t)sl->key >= nkeys || c->tab.map[sl->key] != (int32_t)s)
                bad++, fprintf(stderr, "slot %u key %d not mapped back\n", s, sl->key);
            else if (check_block(c->slab + (uint64_t)s * c->tab.slot_bytes, sl->key) < 0)
                bad++, fprintf(stderr, "slot %u holds wrong bytes\n", s);
        }
    }
    for (uint32_t k = 0; k < nkeys; k++) {
        int32_t s = c->tab.map[k];
        if (s >= 0 && ((uint32_t)s >= c->tab.nslots || c->tab.slots[s].key != (int32_t)k))
            bad++, fprintf(stderr, "map[%u] = %d inconsistent\n", k, s);
    }
    pthread_mutex_unlock(&c->tab.mu);
    return bad;
}

int main(void) {
    const char *env = getenv("STRESS_ITERS");
    int rounds = env ? atoi(env) : 150;
    char path[] = "/tmp/smoe_stress_XXXXXX";
    int fd = mkstemp(path);
    if (fd < 0) {
        perror("mkstemp");
        return 2;
    }
    uint32_t nblocks = NL * NE;
    uint8_t *block = calloc(1, BLOCK);
    uint32_t *crc = calloc(nblocks, sizeof *crc);
    uint8_t head[4096];
    memset(head, ' ', sizeof head);
    if (write(fd, head, sizeof head) != (ssize_t)sizeof head) return 2;
    for (uint32_t k = 0; k < nblocks; k++) {
        fill_block(block, (int32_t)k);
        crc[k] = smoe_crc32c(0, block, BLOCK);
        if (write(fd, block, BLOCK) != (ssize_t)BLOCK) return 2;
    }
    close(fd);
    crc[smoe_key(BAD_LAYER, BAD_EXPERT, NE)] ^= 1u; /* this block's loads must fail */
    free(block);

    smoe_err err;
    smoe_store store;
    if (smoe_store_open(&store, path, 4096, BLOCK, NL, NE, crc, SMOE_STORE_VERIFY, &err) < 0) {
        fprintf(stderr, "store open: %s\n", err.msg);
        return 2;
    }
    free(crc);
    smoe_policy_params pp = {.nslots = NSLOTS, .num_layers = NL, .num_experts = NE, .seed = 7};
    smoe_policy *pol;
    if (smoe_policy_create(&pol, smoe_policy_find("lru"), &pp, &err) < 0) return 2;
    smoe_cache cache;
    if (smoe_cache_init(&cache, &store, NSLOTS, TOPK, pol, 1, &err) < 0) {
        fprintf(stderr, "cache init: %s\n", err.msg);
        return 2;
    }

    atomic_int failures = 0;
    atomic_ullong acquires = 0, load_errors = 0;
    pthread_t th[NCONSUMERS];
    worker_arg args[NCONSUMERS];
    for (int i = 0; i < NCONSUMERS; i++) {
        args[i] = (worker_arg){&cache, i, rounds, &failures, &acquires, &load_errors};
        pthread_create(&th[i], NULL, consumer, &args[i]);
    }
    /* swap policies while the consumers run: every built-in that exists */
    static const char *names[] = {"lfu", "fifo", "lru", "mru", "random", "least_stale", "spac",
                                  "nextuse", "lru"};
    for (int i = 0; i < 40; i++) {
        const smoe_policy_ops *ops = smoe_policy_find(names[i % 9]);
        if (!ops) ops = smoe_policy_find("lru");
        smoe_policy *p2;
        if (smoe_policy_create(&p2, ops, &pp, &err) < 0) return 2;
        if (smoe_slots_set_policy(&cache.tab, p2, &err) < 0) {
            fprintf(stderr, "set_policy: %s\n", err.msg);
            failures++;
        }
        /* activation counts and utilities under the cache mutex (no-op / PolicyError for the
         * policies without them) while consumers and the worker run */
        {
            int32_t ck[3] = {i % (NL * NE), (i * 7) % (NL * NE), (i * 13) % (NL * NE)};
            uint32_t cv[3] = {(uint32_t)(i % 5), 1, 3};
            int32_t u[3];
            if (smoe_slots_counts(&cache.tab, ck, cv, 3, &err) < 0) {
                fprintf(stderr, "counts: %s\n", err.msg);
                failures++;
            }
            int urc = smoe_slots_utility(&cache.tab, ck, u, 3, &err);
            if (urc < 0 && urc != SMOE_EPOLICY) {
                fprintf(stderr, "utility: %s\n", err.msg);
                failures++;
            }
        }
        smoe_cache_stats st;
        smoe_slots_get_stats(&cache.tab, &st);
        if (i % 5 == 1) smoe_slots_pause_worker(&cache.tab, 1); /* requests pile up, then resume */
        if (i % 5 == 3) (void)smoe_slots_queue_len(&cache.tab);
        usleep(2000);
        if (i % 5 == 1) smoe_slots_pause_worker(&cache.tab, 0);
        if (i % 9 == 4) smoe_slots_wait_idle(&cache.tab);
    }
    for (int i = 0; i < NCONSUMERS; i++) pthread_join(th[i], NULL);
    atomic_store(&g_done, 1);
    smoe_slots_wait_idle(&cache.tab);

    smoe_cache_stats st;
    smoe_slots_get_stats(&cache.tab, &st);
    failures += check_invariants(&cache);
    if (st.hits + st.misses != acquires) {
        fprintf(stderr, "hits %llu + misses %llu != acquires %llu\n",
                (unsigned long long)st.hits, (unsigned long long)st.misses,
                (unsigned long long)acquires);
        failures++;
    }
    /* A prefetch load ends at most one way (used, evicted unused, failed), hence the sum.
     * prefetch_late counts accesses, not loads: several consumers can wait on one prefetch
     * load (each access late, the load used once), so it is bounded by the misses only. */
    if (st.prefetch_used + st.prefetch_wasted + st.prefetch_failed > st.prefetch_issued ||
        st.prefetch_late > st.misses) {
        fprintf(stderr, "prefetch counters inconsistent\n");
        failures++;
    }
    if (load_errors == 0) fprintf(stderr, "note: the corrupt block was never requested\n");
    printf("stress_cache: %llu acquires, %llu hits, %llu misses (%llu collision), prefetch "
           "issued %llu used %llu late %llu wasted %llu dropped %llu refused %llu failed %llu, "
           "%llu protected evictions, %llu load errors: %s\n",
           (unsigned long long)acquires, (unsigned long long)st.hits,
           (unsigned long long)st.misses, (unsigned long long)st.collision_misses,
           (unsigned long long)st.prefetch_issued, (unsigned long long)st.prefetch_used,
           (unsigned long long)st.prefetch_late, (unsigned long long)st.prefetch_wasted,
           (unsigned long long)st.prefetch_dropped, (unsigned long long)st.prefetch_refused,
           (unsigned long long)st.prefetch_failed,
           (unsigned long long)st.protected_evictions, (unsigned long long)load_errors,
           failures ? "FAILED" : "ok");
    smoe_cache_free(&cache);
    smoe_store_close(&store);
    unlink(path);
    return failures ? 1 : 0;
}

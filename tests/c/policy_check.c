/* Victim search of LFU, Least-Stale (three orders) and SpAc against brute-force scans written
 * here from the orders documented at the top of each policy file, under AddressSanitizer+UBSan.
 *
 * The policies keep ordered structures (count buckets, per-layer touch lists, heaps) so that
 * victim() need not scan every slot; this drives them with random event sequences that the
 * replay tests cannot produce: evictions of arbitrary resident slots, re-inserts into a
 * resident slot, accesses with a key from another layer, repeated and decreasing pass ids,
 * and evictable() masks from "everything" down to "nothing" (1 slot in 100, 1 in 10, 3 in 4),
 * at 1 to 700 slots.  Every victim() answer must equal the scan's. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "policy/policy.h"

typedef struct ref_slot {
    int resident;
    int32_t key;
    uint64_t count, touched, inserted, pass;
} ref_slot;

typedef struct ref {
    ref_slot *s;
    uint64_t clock, pass;
    uint32_t cur, L, E;
} ref;

typedef struct mask {
    uint8_t *ok;
    uint64_t calls;
} mask;

static int mask_ok(void *ctx, uint32_t slot) {
    mask *m = ctx;
    m->calls++;
    return m->ok[slot];
}

static uint64_t rng_next(uint64_t *x) {
    *x ^= *x << 13;
    *x ^= *x >> 7;
    *x ^= *x << 17;
    return *x;
}

static uint32_t layer_of(const ref *r, int32_t key) {
    uint32_t j = key >= 0 ? (uint32_t)key / r->E : 0;
    return j < r->L ? j : r->L - 1;
}

/* Non-zero when resident slot a goes before resident slot b. */
static int ref_before(const char *name, int order, const smoe_policy *p, const ref *r,
                      uint32_t a, uint32_t b) {
    const ref_slot *x = &r->s[a], *y = &r->s[b];
    if (!strcmp(name, "lfu")) {
        if (x->count != y->count) return x->count < y->count;
        return x->touched < y->touched;
    }
    if (!strcmp(name, "spac_ema")) {
        int32_t ux = smoe_policy_utility(p, x->key), uy = smoe_policy_utility(p, y->key);
        if (ux < 0) ux = 0;
        if (uy < 0) uy = 0;
        if (ux != uy) return ux < uy;
        return x->touched < y->touched;
    }
    int xs = x->pass != r->pass, ys = y->pass != r->pass;
    if (xs != ys) return xs;
    if (order == SMOE_LS_ORDER_FIFO) return x->inserted < y->inserted;
    if (order == SMOE_LS_ORDER_LAYER) {
        uint32_t jx = layer_of(r, x->key), jy = layer_of(r, y->key);
        uint32_t dx = jx > r->cur ? jx - r->cur : jx + r->L - r->cur;
        uint32_t dy = jy > r->cur ? jy - r->cur : jy + r->L - r->cur;
        if (xs && jx == r->cur) dx = 0; /* stale and of the current layer: last */
        if (ys && jy == r->cur) dy = 0;
        if (dx != dy) return dx > dy;
    }
    return x->touched < y->touched;
}

static void ref_demand(ref *r, int32_t key) {
    if (key >= 0 && (uint32_t)key / r->E < r->L) r->cur = (uint32_t)key / r->E;
}

static int run(const char *name, int order, uint32_t ns, uint64_t seed, uint64_t steps) {
    const uint32_t L = 7, E = 40;
    smoe_policy_params pp = {.nslots = ns, .num_layers = L, .num_experts = E, .order = order,
                             .levels = 3};
    smoe_policy *p;
    smoe_err err;
    if (smoe_policy_create(&p, smoe_policy_find(name), &pp, &err) < 0) {
        fprintf(stderr, "create %s: %s\n", name, err.msg);
        return 1;
    }
    ref r = {calloc(ns, sizeof(ref_slot)), 0, 0, 0, L, E};
    mask m = {malloc(ns), 0};
    int32_t ckeys[64];
    uint32_t cvals[64];
    if (!r.s || !m.ok) return 1;
    uint64_t x = seed * 2654435761u + 1, victims = 0, max_pass = 0;
    int fails = 0;
    for (uint64_t t = 0; t < steps && !fails; t++) {
        uint32_t s = (uint32_t)(rng_next(&x) % ns);
        uint32_t ev = (uint32_t)(rng_next(&x) % 100);
        int32_t key = (int32_t)(rng_next(&x) % (L * E));
        if (ev < 30) { /* insert (into a free slot mostly; sometimes over a resident one) */
            if (r.s[s].resident && rng_next(&x) % 4) {
                smoe_policy_evict(p, s, r.s[s].key);
                r.s[s].resident = 0;
            }
            int pf = (int)(rng_next(&x) % 3 == 0);
            smoe_policy_insert(p, s, key, pf);
            r.s[s] = (ref_slot){1, key, pf ? 0 : 1, ++r.clock, r.clock, r.pass};
            if (!pf) ref_demand(&r, key);
        } else if (ev < 70) { /* access a resident slot (key of the slot, or another one) */
            if (!r.s[s].resident) continue;
            int32_t k = rng_next(&x) % 8 ? r.s[s].key : key;
            smoe_policy_access(p, s, k);
            r.s[s].count++;
            r.s[s].touched = ++r.clock;
            r.s[s].pass = r.pass;
            ref_demand(&r, k);
        } else if (ev < 78) { /* evict any resident slot */
            if (!r.s[s].resident) continue;
            smoe_policy_evict(p, s, r.s[s].key);
            r.s[s].resident = 0;
        } else if (ev < 82) { /* pass boundary: usually the next id */
            uint32_t kind = (uint32_t)(rng_next(&x) % 10);
            uint64_t id = kind < 7 ? max_pass + 1 : kind < 8 ? r.pass
                          : rng_next(&x) % (max_pass + 2);
            smoe_policy_pass(p, id);
            r.pass = id;
            if (id > max_pass) max_pass = id;
        } else if (ev < 85) { /* activation counts (spac only acts on them) */
            uint32_t n = (uint32_t)(rng_next(&x) % 64);
            for (uint32_t i = 0; i < n; i++) {
                ckeys[i] = (int32_t)(rng_next(&x) % (L * E));
                cvals[i] = (uint32_t)(rng_next(&x) % 6);
            }
            smoe_policy_counts(p, ckeys, cvals, n);
        } else { /* victim under a random mask */
            static const uint32_t keep_pct[] = {100, 75, 10, 1, 0};
            uint32_t keep = keep_pct[rng_next(&x) % 5];
            for (uint32_t i = 0; i < ns; i++) m.ok[i] = (uint32_t)(rng_next(&x) % 100) < keep;
            int32_t want = -1;
            for (uint32_t i = 0; i < ns; i++)
                if (r.s[i].resident && m.ok[i] &&
                    (want < 0 || ref_before(name, order, p, &r, i, (uint32_t)want)))
                    want = (int32_t)i;
            int32_t got = smoe_policy_victim(p, keep == 100 ? NULL : mask_ok, &m);
            victims++;
            if (got != want) {
                fprintf(stderr, "%s order=%d nslots=%u seed=%llu step %llu: victim %d, scan %d\n",
                        name, order, ns, (unsigned long long)seed, (unsigned long long)t,
                        (int)got, (int)want);
                fails++;
            }
            if (got >= 0 && rng_next(&x) % 2) { /* evict it, as the cache would */
                smoe_policy_evict(p, (uint32_t)got, r.s[got].key);
                r.s[got].resident = 0;
            }
        }
    }
    smoe_policy_destroy(p);
    free(r.s);
    free(m.ok);
    return fails;
}

int main(void) {
    const struct { const char *name; int order; } pols[] = {
        {"lfu", 0}, {"least_stale", SMOE_LS_ORDER_LAYER}, {"least_stale", SMOE_LS_ORDER_LRU},
        {"least_stale", SMOE_LS_ORDER_FIFO}, {"spac_ema", 0}};
    const uint32_t sizes[] = {1, 2, 5, 33, 280, 700};
    int fails = 0, runs = 0;
    for (size_t i = 0; i < sizeof pols / sizeof pols[0]; i++)
        for (size_t j = 0; j < sizeof sizes / sizeof sizes[0]; j++)
            for (uint64_t seed = 1; seed <= 3; seed++) {
                fails += run(pols[i].name, pols[i].order, sizes[j], seed * 100 + j,
                             sizes[j] < 100 ? 20000 : 60000);
                runs++;
            }
    printf("policy_check: %d runs, %d failures\n", runs, fails);
    return fails ? 1 : 0;
}

/* Random: evict a uniformly drawn evictable resident slot, deterministic given the seed.
 *
 * Generator: splitmix64 (replay.h) with state = seed at init; one draw per victim() call that
 * finds at least one candidate (none when there is no candidate).  Selection rule: with the n
 * evictable resident slots listed in increasing slot order, the victim is entry r % n, where r
 * is the draw.  Events other than victim() consume no randomness. */
#include <stdlib.h>

#include "policy.h"
#include "replay.h"

typedef struct random_state {
    uint8_t *resident;
    uint32_t *cand; /* scratch for victim(): the evictable resident slots in slot order */
    uint64_t rng;
} random_state;

static void random_free(smoe_policy *p) {
    random_state *st = p->state;
    if (!st) return;
    free(st->resident);
    free(st->cand);
    free(st);
}

static int random_init(smoe_policy *p, const smoe_policy_params *params, smoe_err *err) {
    random_state *st = calloc(1, sizeof *st);
    p->state = st;
    if (st) {
        st->resident = calloc(params->nslots, 1);
        st->cand = malloc(params->nslots * sizeof *st->cand);
    }
    if (!st || !st->resident || !st->cand) {
        random_free(p);
        p->state = NULL;
        return smoe_err_set(err, SMOE_ENOMEM, "random: out of memory");
    }
    st->rng = params->seed;
    return 0;
}

static void random_insert(smoe_policy *p, uint32_t slot, int32_t key, int prefetch) {
    random_state *st = p->state;
    (void)key;
    (void)prefetch;
    if (slot < p->nslots) st->resident[slot] = 1;
}

static void random_access(smoe_policy *p, uint32_t slot, int32_t key) {
    (void)p;
    (void)slot;
    (void)key;
}

static void random_evict(smoe_policy *p, uint32_t slot, int32_t key) {
    random_state *st = p->state;
    (void)key;
    if (slot < p->nslots) st->resident[slot] = 0;
}

static int32_t random_victim(smoe_policy *p, smoe_evictable_fn ok, void *ctx) {
    random_state *st = p->state;
    uint32_t n = 0;
    for (uint32_t s = 0; s < p->nslots; s++)
        if (st->resident[s] && (!ok || ok(ctx, s))) st->cand[n++] = s;
    if (n == 0) return -1;
    return (int32_t)st->cand[smoe_splitmix64(&st->rng) % n];
}

const smoe_policy_ops smoe_policy_random = {
    .name = "random",
    .init = random_init,
    .free = random_free,
    .on_insert = random_insert,
    .on_access = random_access,
    .on_evict = random_evict,
    .on_pass = NULL,
    .victim = random_victim,
};

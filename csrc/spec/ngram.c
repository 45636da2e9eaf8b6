/* Prompt-lookup n-gram drafter with an incremental index; see ngram.h for the definition. */
#include "ngram.h"

#include <stdlib.h>
#include <string.h>

#define TAB_INIT 256u

static inline uint64_t mix64(uint64_t x) {
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    x ^= x >> 31;
    return x;
}

/* hs[n] = hash of the n-gram h[e-n+1..e], n = 1..nmax (built backwards from e). */
static void ngram_hashes(const int32_t *h, int64_t e, int32_t nmax, uint64_t *hs) {
    uint64_t x = 0x9e3779b97f4a7c15ull;
    for (int32_t n = 1; n <= nmax; n++) {
        x = mix64(x + (uint64_t)(uint32_t)h[e - n + 1] + 0x632be59bd9b4e019ull);
        hs[n] = x ? x : 1;
    }
}

static int tab_alloc(smoe_ngram_table *t, uint64_t cap) {
    uint64_t *hash = calloc(cap, sizeof *hash);
    int64_t *pos = malloc(cap * sizeof *pos);
    if (!hash || !pos) {
        free(hash);
        free(pos);
        return -1;
    }
    t->hash = hash;
    t->pos = pos;
    t->cap = cap;
    t->used = 0;
    return 0;
}

static void tab_free(smoe_ngram_table *t) {
    free(t->hash);
    free(t->pos);
    memset(t, 0, sizeof *t);
}

static int same(const int32_t *h, int64_t a, int64_t b, int32_t n) {
    return memcmp(h + a, h + b, (size_t)n * sizeof *h) == 0;
}

/* Insert-or-update the n-gram starting at start (hash hv) with position start. */
static int tab_put(smoe_ngram_table *t, const int32_t *h, int32_t n, uint64_t hv, int64_t start) {
    if (t->cap == 0 || 2 * (t->used + 1) > t->cap) {
        smoe_ngram_table nt;
        if (tab_alloc(&nt, t->cap ? 2 * t->cap : TAB_INIT) < 0) return -1;
        for (uint64_t i = 0; i < t->cap; i++) {
            if (!t->hash[i]) continue;
            uint64_t j = t->hash[i] & (nt.cap - 1);
            while (nt.hash[j]) j = (j + 1) & (nt.cap - 1);
            nt.hash[j] = t->hash[i];
            nt.pos[j] = t->pos[i];
            nt.used++;
        }
        tab_free(t);
        *t = nt;
    }
    uint64_t j = hv & (t->cap - 1);
    while (t->hash[j]) {
        if (t->hash[j] == hv && same(h, t->pos[j], start, n)) {
            t->pos[j] = start; /* more recent occurrence */
            return 0;
        }
        j = (j + 1) & (t->cap - 1);
    }
    t->hash[j] = hv;
    t->pos[j] = start;
    t->used++;
    return 0;
}

static int64_t tab_get(const smoe_ngram_table *t, const int32_t *h, int32_t n, uint64_t hv,
                       int64_t start) {
    if (t->cap == 0) return -1;
    uint64_t j = hv & (t->cap - 1);
    while (t->hash[j]) {
        if (t->hash[j] == hv && same(h, t->pos[j], start, n)) return t->pos[j];
        j = (j + 1) & (t->cap - 1);
    }
    return -1;
}

int smoe_ngram_init(smoe_ngram *g, int32_t max_n, int32_t min_n, smoe_err *err) {
    memset(g, 0, sizeof *g);
    if (min_n < 1 || max_n < min_n || max_n > SMOE_NGRAM_MAX_N)
        return smoe_err_set(err, SMOE_EINVAL,
                            "ngram drafter: need 1 <= min_n <= max_n <= %d, got min_n=%d max_n=%d",
                            SMOE_NGRAM_MAX_N, (int)min_n, (int)max_n);
    g->max_n = max_n;
    g->min_n = min_n;
    return SMOE_OK;
}

void smoe_ngram_free(smoe_ngram *g) {
    for (int32_t n = 0; n <= SMOE_NGRAM_MAX_N; n++) tab_free(&g->tab[n]);
    free(g->hist);
    g->hist = NULL;
    g->len = g->cap = 0;
}

void smoe_ngram_reset(smoe_ngram *g) {
    g->len = 0;
    for (int32_t n = 0; n <= SMOE_NGRAM_MAX_N; n++) {
        smoe_ngram_table *t = &g->tab[n];
        if (t->cap) memset(t->hash, 0, t->cap * sizeof *t->hash);
        t->used = 0;
    }
}

/* Index the n-grams ending at e (they became "earlier" once token e+1 exists). */
static int index_end(smoe_ngram *g, int64_t e, smoe_err *err) {
    uint64_t hs[SMOE_NGRAM_MAX_N + 1];
    int32_t nmax = g->max_n;
    if ((int64_t)nmax > e + 1) nmax = (int32_t)(e + 1);
    if (nmax < g->min_n) return SMOE_OK;
    ngram_hashes(g->hist, e, nmax, hs);
    for (int32_t n = g->min_n; n <= nmax; n++)
        if (tab_put(&g->tab[n], g->hist, n, hs[n], e - n + 1) < 0)
            return smoe_err_set(err, SMOE_ENOMEM, "ngram drafter: out of memory (index n=%d)",
                                (int)n);
    return SMOE_OK;
}

int smoe_ngram_append(smoe_ngram *g, const int32_t *tok, int64_t n, smoe_err *err) {
    if (n < 0) return smoe_err_set(err, SMOE_EINVAL, "ngram drafter: negative token count");
    if (n == 0) return SMOE_OK;
    if (g->len + n > g->cap) {
        int64_t cap = g->cap ? g->cap : 1024;
        while (cap < g->len + n) cap *= 2;
        int32_t *h = realloc(g->hist, (size_t)cap * sizeof *h);
        if (!h)
            return smoe_err_set(err, SMOE_ENOMEM, "ngram drafter: out of memory (%lld tokens)",
                                (long long)cap);
        g->hist = h;
        g->cap = cap;
    }
    for (int64_t i = 0; i < n; i++) {
        g->hist[g->len++] = tok[i];
        if (g->len >= 2) {
            int rc = index_end(g, g->len - 2, err);
            if (rc) return rc;
        }
    }
    return SMOE_OK;
}

int smoe_ngram_truncate(smoe_ngram *g, int64_t len, smoe_err *err) {
    if (len < 0 || len > g->len)
        return smoe_err_set(err, SMOE_EINVAL, "ngram drafter: truncate to %lld of %lld tokens",
                            (long long)len, (long long)g->len);
    if (len == g->len) return SMOE_OK;
    int64_t keep = len;
    smoe_ngram_reset(g);
    g->len = keep;
    for (int64_t e = 0; e + 2 <= keep; e++) {
        int rc = index_end(g, e, err);
        if (rc) return rc;
    }
    return SMOE_OK;
}

int smoe_ngram_propose(const smoe_ngram *g, int32_t k, int32_t *out, int32_t *n_out,
                       int32_t *n_match, smoe_err *err) {
    *n_out = 0;
    *n_match = 0;
    if (k < 0) return smoe_err_set(err, SMOE_EINVAL, "ngram drafter: k must be >= 0, got %d", (int)k);
    int64_t L = g->len;
    if (k == 0 || L < 2) return SMOE_OK;
    int32_t nmax = g->max_n;
    if ((int64_t)nmax > L - 1) nmax = (int32_t)(L - 1);
    if (nmax < g->min_n) return SMOE_OK;
    uint64_t hs[SMOE_NGRAM_MAX_N + 1];
    ngram_hashes(g->hist, L - 1, nmax, hs);
    for (int32_t n = nmax; n >= g->min_n; n--) {
        int64_t p = tab_get(&g->tab[n], g->hist, n, hs[n], L - n);
        if (p < 0) continue;
        for (int32_t i = 0; i < k; i++) {
            int64_t j = p + n + i;
            out[i] = j < L ? g->hist[j] : out[j - L];
        }
        *n_out = k;
        *n_match = n;
        return SMOE_OK;
    }
    return SMOE_OK;
}

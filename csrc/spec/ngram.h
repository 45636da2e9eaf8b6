/* Prompt-lookup n-gram drafter: propose the tokens that followed the most recent earlier
 * occurrence of the history's last n tokens.
 *
 * Definition (tests/test_spec.py has a brute-force reference of exactly this):
 *   history h[0..L-1].  For n = max_n down to min_n (only n <= L - 1): let p be the largest
 *   start with p + n <= L - 1 (an EARLIER occurrence: it ends before the last token) and
 *   h[p..p+n-1] == h[L-n..L-1].  The first n that has such a p wins.  The proposal is
 *   d[i] = x[p + n + i] for i = 0..k-1, where x is the history followed by the proposal
 *   itself (x[j] = h[j] for j < L, x[j] = d[j - L] otherwise; well defined because
 *   p + n + i - L < i).  So a proposal is always exactly k tokens long, and a repeating
 *   pattern is continued with its period (like an overlapping LZ77 copy).  No match for any
 *   n: the proposal is empty.
 *
 * Index: for each n, an open-addressing hash table maps an n-gram (hash of its tokens,
 * checked against the history on a hit) to the start of its most recent occurrence.  The
 * n-grams ending at position j are inserted when token j+1 arrives, so the table never holds
 * the suffix itself.  append() costs O(max_n) hashing per token (hashes are built from the
 * end of the n-gram backwards, one token per n) plus O(n) to confirm an n-gram already in
 * a table (O(max_n^2) at worst, 6 token compares at the default max_n=3); propose() costs
 * O(sum of n tried + k).  Neither depends on L.
 * Tables grow by doubling at load 1/2 (amortised O(1)).
 *
 * Not thread-safe; no global state.
 */
#ifndef SMOE_SPEC_NGRAM_H
#define SMOE_SPEC_NGRAM_H

#include "../common.h"

#define SMOE_NGRAM_MAX_N 32

typedef struct smoe_ngram_table {
    uint64_t *hash;  /* [cap] 0 = empty (hashes are forced non-zero) */
    int64_t *pos;    /* [cap] start position of the most recent occurrence */
    uint64_t cap;    /* power of two */
    uint64_t used;
} smoe_ngram_table;

typedef struct smoe_ngram {
    int32_t max_n, min_n;
    int32_t *hist;
    int64_t len, cap;
    smoe_ngram_table tab[SMOE_NGRAM_MAX_N + 1]; /* tab[n], n = min_n..max_n */
} smoe_ngram;

/* 1 <= min_n <= max_n <= SMOE_NGRAM_MAX_N. */
int smoe_ngram_init(smoe_ngram *g, int32_t max_n, int32_t min_n, smoe_err *err);
void smoe_ngram_free(smoe_ngram *g);
/* Forget the history (keeps the allocations). */
void smoe_ngram_reset(smoe_ngram *g);
/* Append n tokens to the history and index the n-grams that became "earlier". */
int smoe_ngram_append(smoe_ngram *g, const int32_t *tok, int64_t n, smoe_err *err);
/* Keep only the first len tokens (len <= current length); rebuilds the index (O(len)). */
int smoe_ngram_truncate(smoe_ngram *g, int64_t len, smoe_err *err);
/* Write up to k tokens to out[0..k-1] (see above); *n_out gets k or 0; *n_match the n that
 * matched (0 when none).  k >= 0. */
int smoe_ngram_propose(const smoe_ngram *g, int32_t k, int32_t *out, int32_t *n_out,
                       int32_t *n_match, smoe_err *err);

#endif

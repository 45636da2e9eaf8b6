/* Decoder layers at decode sizes in plain C: the state and compute behind specmoe._C.AttnBlock,
 * _C.MLABlock, _C.layer_chain and _C.DecodePlan (csrc/bindings/py_attn.c, py_decode.c, which
 * parse and check the Python arguments, keep the Python objects whose memory these structs
 * borrow, release the GIL around the calls here and raise the errors).
 *
 *   smoe_attn_block (attn_block.c)  a Llama-family attention module: projections, q/k norms,
 *                                   rotary, smoe_mha_decode, output projection; a whole
 *                                   decoder layer with a MoE block (smoe_layers)
 *   smoe_mla_block (mla_block.c)    a DeepSeek-V2/V3 MLA attention module (absorbed form) and
 *                                   its decoder layer (MoE block or a dense MLP)
 *   smoe_gdn_block (gdn_block.c)    a gated DeltaNet module (Qwen3.5's linear attention):
 *                                   projections, short convolution, gated delta rule, gated
 *                                   RMSNorm, output projection, for one decode token
 *   smoe_chain_item (decoder.c)     one layer call of a chain: decoder layers in a row
 *   smoe_decode_plan (decoder.c)    a one-token decode step: row copies, the chain, the final
 *                                   RMSNorm and lm_head
 *
 * Conventions as the rest of the core: functions return SMOE_OK or a negative SMOE_E* code and
 * fill *err.  Ownership: "borrowed" pointers are kept alive and unchanged by the caller (the
 * binding holds the Python objects that own them) for the struct's lifetime; "owned" memory is
 * released by the struct's destroy function.  A struct zeroed and then destroyed is fine (the
 * Python objects embed them zero-filled).  No allocation on the per-token paths beyond the
 * scratch and routing buffers that grow to the largest call seen (smoe_grow_scratch). */
#ifndef SMOE_DECODER_H
#define SMOE_DECODER_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

#include "common.h"
#include "kernels/attn.h"
#include "kernels/kernels.h"
#include "layer.h"

/* ---- shared helpers ---- */

/* Grow a scratch buffer to need bytes (first call, more tokens or more threads than before);
 * the caller serialises calls on *scratch.  SMOE_ENOMEM "attention: ..." on failure. */
int smoe_grow_scratch(void **scratch, size_t *cap, size_t need, smoe_err *err);

/* A block's per-token buffers (AttnBlock, MLABlock) sized for at least n tokens (n <=
 * max_tokens): *buf of *cap * per_tok + extra floats and *lscratch for the linear slots
 * ld[0..nld) (NULL ones skipped) at *cap tokens.  A call of more tokens than they hold, or the
 * first (*buf NULL), replaces them (*cap to n, at least doubling, at most max_tokens); they
 * stay that size.  The regions' offsets scale with *cap, so the caller grows them only at the
 * start of a call, under its block's mu (or at init).  SMOE_ENOMEM "<what>: ..." on failure,
 * the old buffers kept. */
int smoe_grow_token_bufs(float **buf, void **lscratch, uint32_t *cap, uint32_t n,
                         uint32_t max_tokens, size_t per_tok, size_t extra,
                         const smoe_linear_desc *const *ld, int nld, const char *what,
                         smoe_err *err);

/* out = the RMSNorm (kernels/block.h) of one row x of n values, both f32 or bf16 bits (b),
 * through the f32 row buf [n]: _C.rms_norm's rows and DecodePlan's final norm. */
void smoe_rms_norm_row(const void *x, void *out, int b, const float *w, float eps, int bf16,
                       float *buf, uint32_t n);

/* ---- smoe_attn_block: a Llama-family decoder layer's attention module ---- */

enum { SMOE_QKNORM_NONE = 0, SMOE_QKNORM_FULL = 1, SMOE_QKNORM_HEAD = 2 };

/* The norm kind of a name ("none", "full" over all heads, "head" per head), or -1. */
int smoe_qknorm_kind(const char *name);

/* Linear slots of an attention block: q, k, v, o projections, and q|k|v in one (optional). */
enum { SMOE_AB_Q = 0, SMOE_AB_K = 1, SMOE_AB_V = 2, SMOE_AB_O = 3, SMOE_AB_QKV = 4,
       SMOE_AB_N = 5 };

/* What smoe_attn_block_init takes; every pointer borrowed for the block's lifetime.
 *
 * Qwen3-Next's and Qwen3.5's gated attention (transformers' Qwen3NextAttention) takes three
 * more: gate (q_proj's rows are, per head, D query rows then D gate rows, and the attention
 * output is multiplied by sigmoid(gate) before o_proj: "gated attention"), rot
 * (the rotary embedding on the first rot values of each head only, the rest passed through:
 * partial_rotary_factor) and zc (every RMSNorm of the block zero-centred: smoe_dec_norm). */
typedef struct smoe_attn_block_cfg {
    const smoe_linear_desc *ld[SMOE_AB_N]; /* [QKV] NULL: none (pre runs q, k, v) */
    const uint8_t *lb[SMOE_AB_N];           /* the weight blocks */
    const float *lbias[SMOE_AB_N];          /* biases or NULL */
    const float *qn, *kn; /* q/k norm weights ([H D] / [Hkv D] full, [D] head), NULL for none;
                             zc: 1 + the module's weights */
    uint32_t H, Hkv, D, max_tokens;
    int norm;     /* SMOE_QKNORM_* */
    double eps;   /* the q/k norms' eps */
    int bf16;     /* round as a bf16 model does (kernels/block.h) */
    int gate;     /* q_proj [H (D query + D gate) rows]: the output gated (a gated block runs
                     whole layers only: smoe_attn_block_layer) */
    uint32_t rot; /* rotary width per head (even, <= D); 0: D */
    int zc;       /* the q/k norms and the layer's ln / ln1 / ln2 zero-centred (smoe_dec_norm) */
    const float *sinks; /* GPT-OSS's attention sinks: f32 [H] finite logits, one a head, in
                           every softmax's denominator (smoe_mha_desc); NULL: none */
    int pairs; /* the rotary on the pairs (x[2i], x[2i+1]) of each head's first rot values,
                  pair i by cos[i], sin[i] (ERNIE-4.5: smoe_rotary_pairs); 0: rotate-half */
} smoe_attn_block_cfg;

typedef struct smoe_attn_block {
    /* immutable after init; borrowed (see smoe_attn_block_cfg) */
    const smoe_linear_desc *ld[SMOE_AB_N];
    const uint8_t *lb[SMOE_AB_N];
    const float *lbias[SMOE_AB_N];
    const float *qn, *kn;
    uint32_t H, Hkv, D, hidden, max_tokens;
    int norm;
    float eps;
    int bf16;
    int gate, zc;      /* as in the cfg */
    uint32_t rot;      /* the cfg's, 0 made D */
    const float *sinks; /* the cfg's (borrowed) */
    int pairs;          /* the cfg's */
    /* owned; guarded by mu */
    uint32_t cap;       /* tokens buf and lscratch hold now: min(max_tokens, 16) at init, grown
                           (up to max_tokens) by the first call of more tokens, then kept */
    float *buf;         /* cap * (hidden + (H + 2 Hkv) * D + H * D) + 2 D floats: input, q|k|v
                           projections, attention output, one token's cos and sin; then
                           cap * (H * D + 3 hidden) for the layer call: q, the residual
                           stream, the normed input of the MoE block, its output; then, gated,
                           cap * ((3 H + 2 Hkv) * D): the projections' rows as q_proj gives
                           them (q and gate per head), and the gate */
    void *route;        /* the layer call's routing: route_cap bytes of (k int64 ids, k f32
                           weights) per token and E used flags; grows */
    size_t route_cap;
    void *lscratch;     /* linear scratch for cap tokens */
    void *ascratch;     /* attention scratch (grows with the thread count) */
    size_t ascratch_cap;
    smoe_shared_ffn mlp;    /* a dense layer's MLP (set_mlp), borrowed (d[0] NULL: none);
                               guarded by mu, changed by smoe_attn_block_set_mlp */
    smoe_mlp_bufs mlp_bufs; /* the MLP's rows and scratch, owned; guarded by mu */
    pthread_mutex_t mu; /* serializes pre / post / layer calls on the block; taken before a
                           smoe_layers' own mu (always in that order) */
    int ready;          /* init succeeded (mu initialised) */
} smoe_attn_block;

/* SMOE_EINVAL with the binding's message unless the dims and projections fit together
 * (heads a multiple of kv_heads, head_dim even, (heads + 2 kv_heads) * head_dim <= 2^24,
 * max_tokens 1..4096, eps in [0, 1], rot 0 or even and <= head_dim, sinks finite; q, k, v,
 * o, qkv hidden ->
 * G H D, Hkv D, Hkv D, hidden, (G H + 2 Hkv) D with hidden = q's K, G 2 when gated, else 1).
 * Reads cfg's dims, ld and sinks only. */
int smoe_attn_block_check(const smoe_attn_block_cfg *cfg, smoe_err *err);

/* Check cfg (as smoe_attn_block_check) and set *b up: buffers allocated (SMOE_ENOMEM), mutex
 * initialised (SMOE_ESTATE "AttnBlock: pthread_mutex_init failed").  *b zeroed before; on
 * failure nothing is left to release. */
int smoe_attn_block_init(smoe_attn_block *b, const smoe_attn_block_cfg *cfg, smoe_err *err);
void smoe_attn_block_destroy(smoe_attn_block *b);

/* The dense MLP layer calls with g NULL run (f borrowed while set; d[0] NULL: none), under
 * b->mu (it waits for a call in flight): GLM-4.5's and ERNIE-4.5's dense decoder layers. */
void smoe_attn_block_set_mlp(smoe_attn_block *b, const smoe_shared_ffn *f);

/* The first half of the block for B rows of nt tokens (B * nt in 1..max_tokens; a batch of
 * sequences decoding together), under b->mu (SMOE_EINVAL for a gated block): x [B * nt,
 * hidden] (f32, or bf16 bits when xb)
 * RMSNorm-ed with ln when given (the decoder layer's input layernorm), the q/k/v projections,
 * the q/k norms, the rotary embedding with cos / sin [B * nt, rot] (each token its own
 * position's; f32 or bf16 bits: cb, sb; the pairs form reads their first rot / 2 values); q into qp ([B, H, nt, D] f32), k and v into kp, vp
 * (token t of kv head h of row r at + r * kv_bs + h * kv_hs + t * D elements; bf16 bits when
 * kb / vb). */
int smoe_attn_block_pre(smoe_attn_block *b, smoe_kctx *c, const void *xp, int xb,
                        const void *cp, int cb, const void *sp, int sb, uint32_t B, uint32_t nt,
                        const float *ln, float ln_eps, float *qp, void *kp, int kb, void *vp,
                        int vb, size_t kv_bs, size_t kv_hs, smoe_err *err);

/* The second half, under b->mu (SMOE_EINVAL for a gated block): attention of q ([B, H, nt, D]
 * f32) over S cached positions of
 * each row (k, v as smoe_mha_decode takes them: kdt, element strides kbs, khs; bias f32
 * [bias_rows, nt, S] or NULL, bias_rows 1 or B), the output projection into op [B * nt,
 * hidden] (f32, or bf16 bits when ob).  With rp (the residual [B * nt, hidden] in op's dtype):
 * op = rp + the projection, and np_ = the RMSNorm (ln, ln_eps) of that sum (rp, op, np_
 * distinct). */
int smoe_attn_block_post(smoe_attn_block *b, smoe_kctx *c, const float *q, const void *kp,
                         const void *vp, int kdt, size_t kbs, size_t khs, uint32_t B,
                         uint32_t nt, uint32_t S, const float *bias, uint32_t bias_rows,
                         float scale, void *op, int ob, const void *rp, const float *ln,
                         float ln_eps, void *np_, smoe_err *err);

/* One whole decoder layer's arguments (AttnBlock.layer), checked by the caller. */
typedef struct smoe_attn_layer_args {
    long pos;    /* the MoE layer's position in the smoe_layers (unused for a dense layer) */
    int dense;   /* the block's MLP (set_mlp) instead of a MoE block: no smoe_layers (g NULL) */
    uint32_t B;  /* rows (sequences of a decode batch), each nt tokens; B * nt <= max_tokens */
    uint32_t nt; /* tokens per row */
    int flags;   /* route flags (layer.h) */
    int xb, cb, sb, kb, ob; /* bf16 bits (1) or f32 (0): x, cos, sin, the KV buffers, out */
    long long S; /* cached positions; S + nt <= cap */
    int64_t cap; /* the KV buffers' capacity (positions) */
    double scale;
    const float *bias, *ln1, *ln2; /* bias f32 [bias_rows (1 or B), nt, S + nt] or NULL */
    uint32_t bias_rows;
    float eps1, eps2;
    const void *xp, *cp, *sp; /* x [B * nt, hidden], cos, sin [B * nt, rot] */
    uint8_t *kp, *vp;         /* KV buffers [B, Hkv, cap, D] */
    void *op;                 /* out [B * nt, hidden], x's dtype, not aliasing x */
} smoe_attn_layer_args;

/* The layer on the begun MoE layers g (layer pos, hidden = b->hidden), under b->mu then g's:
 * input norm, pre (new k, v written at S), attention over S + nt positions, the output gate
 * (gated), output projection, residual add, post-attention norm, the MoE block, residual add
 * into op.  g NULL: a dense layer, the block's MLP (set_mlp) instead of the MoE block
 * (SMOE_ESTATE when none is set now).  *ta and *tm get the seconds in the attention and MoE
 * (or MLP) parts. */
int smoe_attn_block_layer(smoe_attn_block *b, smoe_kctx *c, smoe_layers *g,
                          const smoe_attn_layer_args *a, double *ta, double *tm, smoe_err *err);

/* ---- smoe_mla_block: a DeepSeek-V2/V3 decoder layer's MLA attention module ---- */

/* Linear slots: q_proj (q_b_proj with q_a), kv_a_proj_with_mqa, o_proj, q_a_proj (optional),
 * (q or q_a) | kv_a in one (optional). */
enum { SMOE_ML_Q = 0, SMOE_ML_KVA = 1, SMOE_ML_O = 2, SMOE_ML_QA = 3, SMOE_ML_JOINT = 4,
       SMOE_ML_N = 5 };
/* Rotary forms: DeepSeek-V2's complex product (freqs [T, rope_dim / 2, 2]), DeepSeek-V3's
 * rotate-half and interleaved forms (freqs [T, 2, rope_dim]: cos, sin) -- kernels/block.h */
enum { SMOE_ROPE_COMPLEX = 0, SMOE_ROPE_HALF = 1, SMOE_ROPE_INTERLEAVE = 2 };

/* The rope form of a name ("complex", "half", "interleave"), or -1. */
int smoe_rope_kind(const char *name);

/* What smoe_mla_block_init takes; every pointer borrowed for the block's lifetime. */
typedef struct smoe_mla_block_cfg {
    const smoe_mla_desc *d;     /* the MLADecode's descriptor (checked) and absorbed weights */
    const smoe_mla_weights *w;
    const smoe_linear_desc *ld[SMOE_ML_N]; /* NULL where absent (QA, JOINT optional) */
    const uint8_t *lb[SMOE_ML_N];
    const float *lbias[SMOE_ML_N];
    const float *kvn, *qan; /* kv_a_layernorm [r], q_a_layernorm [q_lora_rank] (NULL w/o QA) */
    double kv_eps, qa_eps;
    uint32_t max_tokens;
    int bf16, rope;
} smoe_mla_block_cfg;

typedef struct smoe_mla_block {
    /* immutable after init; borrowed (see smoe_mla_block_cfg) */
    const smoe_mla_desc *d;
    const smoe_mla_weights *w;
    const smoe_linear_desc *ld[SMOE_ML_N];
    const uint8_t *lb[SMOE_ML_N];
    const float *lbias[SMOE_ML_N];
    const float *kvn, *qan;
    uint32_t hidden, qa, nq0, max_tokens; /* qa: q_lora_rank (0: none); nq0: the first
                                             projection's width (qa, or H * (dn + dr));
                                             max_tokens: a call's tokens, every row's */
    float kv_eps, qa_eps;
    int bf16, rope;
    /* owned; guarded by mu */
    uint32_t cap;       /* tokens buf and lscratch hold: 16 (or max_tokens) at init, grown
                           to a larger call's tokens (at least doubling, at most max_tokens) */
    float *buf;         /* cap * (hidden + nq0 + r + dr + H (dn + dr) + H dn + H dr + H dv +
                           3 hidden) floats: see mla_block.c */
    void *route;        /* decoder tail's routing buffers; grows */
    size_t route_cap;
    void *lscratch;     /* linear scratch for cap tokens */
    void *ascratch;     /* MLA scratch (grows with the thread count) */
    size_t ascratch_cap;
    smoe_shared_ffn mlp;    /* the dense MLP (set_mlp), borrowed (d[0] NULL: none); guarded
                               by mu, changed by smoe_mla_block_set_mlp */
    smoe_mlp_bufs mlp_bufs; /* the MLP's rows and scratch, owned */
    pthread_mutex_t mu;     /* serializes calls on the block; before a smoe_layers' mu */
    int ready;
} smoe_mla_block;

/* SMOE_EINVAL with the binding's message unless max_tokens, the eps and the rope dim are in
 * range and the projections' shapes fit d (hidden = kv_a's K, q_lora_rank = q_a's N). */
int smoe_mla_block_check(const smoe_mla_block_cfg *cfg, smoe_err *err);

/* Check cfg and set *b up (zeroed before): SMOE_ENOMEM when the buffers or the mutex fail. */
int smoe_mla_block_init(smoe_mla_block *b, const smoe_mla_block_cfg *cfg, smoe_err *err);
void smoe_mla_block_destroy(smoe_mla_block *b);

/* The dense MLP layer(dense) runs (f borrowed while set; d[0] NULL: none), under b->mu. */
void smoe_mla_block_set_mlp(smoe_mla_block *b, const smoe_shared_ffn *f);

/* The checked arguments common to attn and layer: B rows (sequences) of nt tokens each, B * nt
 * <= max_tokens in all, every row with S cached positions (a batch's cache with holes: the
 * bias masks them), each row's tokens in its own order (token i of row b is x's row b nt + i;
 * the batch-invariant kernels give it the bits of its row alone). */
typedef struct smoe_mla_args {
    uint32_t B, nt, S, cap; /* rows, tokens per row, cached positions, the KV buffers' positions
                               per row (S + nt <= cap) */
    int xb, cb;          /* x and the caches: bf16 bits (1) or f32 */
    const void *xp;      /* x [B nt, hidden] */
    const float *fp;     /* rotary freqs [B nt, dr / 2, 2] complex, [B nt, 2, dr] half and
                            interleave: each token's own position */
    const float *bias, *ln1, *ln2; /* bias [bias_rows (1 or B), nt, S + nt] or NULL */
    uint32_t bias_rows;
    float eps1, eps2;
    void *cp, *kp; /* latent cache [B, cap, r], rotary key cache [B, cap, dr] */
} smoe_mla_args;

/* MLABlock.attn under b->mu: the attention module, out op = x + it, np_ = the post-attention
 * RMSNorm of that (op, np_ in x's dtype). */
int smoe_mla_block_attn(smoe_mla_block *b, smoe_kctx *c, const smoe_mla_args *a, void *op,
                        void *np_, smoe_err *err);

/* MLABlock.layer's arguments. */
typedef struct smoe_mla_layer_args {
    long pos;  /* the MoE layer's position (unused for a dense layer) */
    int flags;
    int dense; /* the block's MLP (set_mlp) instead of a MoE block */
    smoe_mla_args a;
    void *op;  /* out [B nt, hidden], x's dtype */
} smoe_mla_layer_args;

/* The whole layer on the begun MoE layers g (NULL: dense, the block's MLP), under b->mu;
 * SMOE_ESTATE when dense and the MLP was removed since the call was checked.  *ta, *tm: the
 * seconds in the attention part and the MoE block / MLP. */
int smoe_mla_block_layer(smoe_mla_block *b, smoe_kctx *c, smoe_layers *g,
                         const smoe_mla_layer_args *l, double *ta, double *tm, smoe_err *err);

/* ---- smoe_gdn_block: a gated DeltaNet (linear attention) module at decode ---- */

/* Linear slots of a gated DeltaNet block: up to four input projections (slots 0..n_in-1),
 * whose outputs side by side are the module's y = [q|k|v | z | b | a] (C + Hv dv + 2 Hv values)
 * in that order or, with an order table, a permutation of it (Qwen3-Next's in_proj_qkvz and
 * in_proj_ba, interleaved per key head); then the output projection. */
enum { SMOE_GB_IN_MAX = 4, SMOE_GB_OUT = 4, SMOE_GB_N = 5 };

/* What smoe_gdn_block_init takes; every pointer borrowed for the block's lifetime.  C = 2 Hk dk
 * + Hv dv channels go through the short convolution (q, k, v of one token side by side). */
typedef struct smoe_gdn_block_cfg {
    const smoe_linear_desc *ld[SMOE_GB_N]; /* inputs [0, n_in), NULL after; [OUT] */
    const uint8_t *lb[SMOE_GB_N];          /* the weight blocks */
    const float *lbias[SMOE_GB_N];         /* biases or NULL */
    uint32_t n_in;        /* input projections, 1..SMOE_GB_IN_MAX */
    const int32_t *order; /* NULL, or [C + Hv dv + 2 Hv]: y[j] = (the inputs' outputs)[order[j]],
                             a permutation */
    const float *conv_w;  /* [C, K] the depthwise kernel (f32) */
    const float *conv_b;  /* [C] or NULL */
    const float *decay;   /* [Hv] -exp(A_log), as the module computes it in f32 */
    const float *dt_bias; /* [Hv] */
    const float *norm_w;  /* [dv] the gated RMSNorm's weight */
    uint32_t Hk, Hv, dk, dv, K, max_rows;
    double eps;           /* the gated RMSNorm's */
    int bf16;             /* round as a bf16 model does (kernels/block.h) */
} smoe_gdn_block_cfg;

typedef struct smoe_gdn_block {
    /* immutable after init; borrowed (see smoe_gdn_block_cfg) */
    const smoe_linear_desc *ld[SMOE_GB_N];
    const uint8_t *lb[SMOE_GB_N];
    const float *lbias[SMOE_GB_N];
    const int32_t *order;
    const float *conv_w, *conv_b, *decay, *dt_bias, *norm_w;
    uint32_t n_in, Hk, Hv, dk, dv, K, C, hidden, max_rows;
    float eps;
    int bf16;
    /* owned; guarded by mu */
    uint32_t cap;       /* rows buf and lscratch hold now (grown up to max_rows, then kept) */
    float *buf;         /* cap * (hidden + 2 (C + Hv dv + 2 Hv) + C + 2 Hv + Hv dv + hidden)
                           floats: input, projections (as the inputs give them, then in y's
                           order), convolved q|k|v, g and beta, the rule's output, the output
                           projection's; then cap * 2 hidden for the layer call: the normed
                           input, the MoE block's output */
    void *lscratch;     /* linear scratch for cap rows */
    void *route;        /* the layer call's routing: route_cap bytes of (k int64 ids, k f32
                           weights) per row and E used flags; grows */
    size_t route_cap;
    pthread_mutex_t mu; /* serializes step and layer calls on the block; taken before a
                           smoe_layers' own mu (always in that order) */
    int ready;          /* init succeeded (mu initialised) */
} smoe_gdn_block;

/* SMOE_EINVAL with the binding's message unless the dims and projections fit together (Hv a
 * multiple of Hk; dk, dv in 1..512; K in 2..16; max_rows 1..4096; eps in [0, 1]; the inputs
 * hidden -> N_i with sum N_i = C + Hv dv + 2 Hv, out Hv dv -> hidden; an order table a
 * permutation; the weights conv_w, decay, dt_bias, norm_w given).  Reads cfg's dims, ld and
 * order. */
int smoe_gdn_block_check(const smoe_gdn_block_cfg *cfg, smoe_err *err);

/* Check cfg and set *b up (buffers for min(max_rows, 16) rows, the mutex); *b zeroed before;
 * on failure nothing is left to release. */
int smoe_gdn_block_init(smoe_gdn_block *b, const smoe_gdn_block_cfg *cfg, smoe_err *err);
void smoe_gdn_block_destroy(smoe_gdn_block *b);

/* One decode token of each of B sequences (1..max_rows), under b->mu: x [B, hidden] (f32, or
 * bf16 bits when xb) -> out [B, hidden] (f32 / bf16 bits when ob), with row r's convolution
 * window conv [B, C, K] (f32 / bf16 bits when cb) and recurrent state [B, Hv, dk, dv] (f32)
 * updated in place.  What transformers' Qwen3_5MoeGatedDeltaNet.forward computes for one
 * cached token (Yang et al., "Gated Delta Networks", 2024):
 *   y = [qkv | z | b | a] = the projections of x (permuted by order)  (bf16: rounded)
 *   conv[c] = [conv[c][1:], qkv[c]];  u[c] = silu(sum_j w[c][j] conv[c][j] + bias[c])
 *                                                                 (f32; bf16: u rounded)
 *   beta = sigmoid(b) (bf16: rounded);  g = decay * softplus(a + dt_bias)   (f32)
 *   o = the gated delta rule of q, k, v = u's thirds (smoe_gated_delta, l2-normalised q, k)
 *                                                                 (bf16: o rounded)
 *   n = o * rsqrt(mean(o^2) + eps) per value head (bf16: rounded); n = norm_w * n (bf16:
 *   rounded); n = n * silu(z) (bf16: rounded);  out = out_proj(n)  (bf16: rounded)
 * The sums run in other orders than torch's (agreement to rounding:
 * tests/test_linear_attn.py). */
int smoe_gdn_block_step(smoe_gdn_block *b, smoe_kctx *c, const void *xp, int xb, uint32_t B,
                        void *conv, int cb, float *state, void *outp, int ob, smoe_err *err);

/* T tokens (1..max_rows) of one sequence, under b->mu, as transformers' module computes them on
 * a cache that records its past (Qwen3_5MoeGatedDeltaNet.forward with T <= the states it
 * keeps: every token a recurrent step): x [T, hidden] (f32 / bf16 bits when xb) -> out [T,
 * hidden] (ob).  conv [C, L] (f32 / bf16 bits when cb), L >= T + K - 1: its first L - T
 * columns the window so far, its last T columns written, token t's q|k|v into column L - T + t
 * and its convolution over the K columns ending there (smoe_gdn_block_step's products, the
 * window not shifted: the cache keeps the grown window until it is cut back).  The recurrent
 * state [Hv, dk, dv] (f32): with hist NULL updated in place to the state after the last token;
 * else read only, and hist [T, Hv, dk, dv] (f32, not aliasing it) gets hist[t] = the state
 * after token t (what a cut back to t + 1 of the tokens restores; hist[T - 1] the last). */
int smoe_gdn_block_steps(smoe_gdn_block *b, smoe_kctx *c, const void *xp, int xb, uint32_t T,
                         void *conv, int cb, uint32_t L, float *state, float *hist, void *outp,
                         int ob, smoe_err *err);

/* A whole Qwen3.5 decoder layer around the block, for one decode token of B rows. */
typedef struct smoe_gdn_layer_args {
    long pos;                 /* the MoE layer's position in the smoe_layers */
    int flags;                /* route flags (layer.h) */
    uint32_t B;               /* rows, 1..max_rows */
    const void *xp;           /* x [B, hidden], f32 or bf16 bits (xb) */
    int xb, cb;               /* conv's dtype: bf16 bits (1) or f32 */
    void *conv;               /* [B, C, K] */
    float *state;             /* [B, Hv, dk, dv] */
    const float *ln1, *ln2;   /* the input and post-attention norms' weights [hidden] */
    float eps1, eps2;
    int zc;                   /* both norms zero-centred (weights 1 + w), else Llama form */
    void *op;                 /* out [B, hidden], x's dtype, not aliasing x */
} smoe_gdn_layer_args;

/* The layer on the begun MoE layers g (layer pos, hidden = b->hidden), under b->mu then g's:
 * the input norm (smoe_dec_norm), smoe_gdn_block_step's module, the residual add, the
 * post-attention norm, the MoE block routed in C (smoe_layers_forward_routed), the second
 * residual add into op; each as the module-by-module path computes it.  *ta and *tm get the
 * seconds in the linear-attention and MoE parts. */
int smoe_gdn_block_layer(smoe_gdn_block *b, smoe_kctx *c, smoe_layers *g,
                         const smoe_gdn_layer_args *a, double *ta, double *tm, smoe_err *err);

/* ---- layer chains ---- */

/* The block kinds of a chain item. */
enum { SMOE_CHAIN_ATTN = 0, SMOE_CHAIN_MLA = 1, SMOE_CHAIN_GDN = 2 };

/* One decoder layer call of a chain.  blk, c borrowed; g set by the caller (the begun
 * smoe_layers, or NULL for a dense MLA layer) for the run and cleared after. */
typedef struct smoe_chain_item {
    int kind;   /* SMOE_CHAIN_*: the layer function and union member (ab, ml, gd) */
    void *blk;  /* smoe_attn_block *, smoe_mla_block * or smoe_gdn_block * */
    smoe_kctx *c;
    smoe_layers *g;
    union {
        smoe_attn_layer_args ab;
        smoe_mla_layer_args ml;
        smoe_gdn_layer_args gd; /* (no positions: a plan's S leaves it as it is) */
    } u;
} smoe_chain_item;

/* Run it[0..n) in order (a failing layer stops the run); adds the seconds in their attention
 * parts, MoE blocks and dense MLPs to t[0..3). */
int smoe_chain_exec(const smoe_chain_item *it, size_t n, double t[3], smoe_err *err);

/* ---- smoe_decode_plan: a whole one-token decode step ---- */

/* A per-step row copy: dst = table[r] (r: the token for the embedding, S for a rotary table).
 * table and dst borrowed. */
typedef struct smoe_plan_row {
    const uint8_t *table;
    int64_t rows;
    size_t row_bytes;
    uint8_t *dst;
} smoe_plan_row;

/* The lm_head: out [1, head_n] = the head's linear layer on x [1, K] (xb/ob: bf16 bits). */
typedef int (*smoe_plan_head_fn)(void *arg, smoe_kctx *c, const void *x, int xb, uint32_t T,
                                 void *out, int ob, smoe_err *err);

/* Every pointer but it, rows, norm_buf and logit_buf (owned, malloc'ed by the creator and freed
 * by smoe_decode_plan_destroy) is borrowed.  The fields are written once when the plan is
 * built; a step writes the items' S and g, norm's out, the head's logits, and uses norm_buf and
 * logit_buf: one step of a plan at a time (the caller's busy flag). */
typedef struct smoe_decode_plan {
    size_t n;
    smoe_chain_item *it;  /* [n] */
    size_t nrows;
    smoe_plan_row *rows;  /* [nrows] rotary rows, copied from row S */
    smoe_plan_row embed;  /* table NULL: none; else row `token` into the first layer's x */
    const void *norm_x;   /* final RMSNorm: NULL none, else x [1, n] -> out, f32/bf16 (nb) */
    void *norm_out;
    const float *norm_w;
    float norm_eps;
    int nb, norm_bf16;
    uint32_t norm_n;
    float *norm_buf;      /* [norm_n] f32 row */
    smoe_plan_head_fn head; /* NULL: none */
    void *head_arg;
    const void *head_x;   /* its input [1, K], f32/bf16 (hb) */
    int hb;
    uint32_t head_n;
    float *logit_buf;     /* [head_n] bf16 logits widened for argmax */
} smoe_decode_plan;

void smoe_decode_plan_destroy(smoe_decode_plan *p);

/* One step at S cached positions (token, S checked by the caller against the tables and every
 * KV capacity; the items' g begun): embedding row, rotary rows, the chain (S written into
 * every item first), the final norm, the head on head_c into logits lp (lb: bf16 bits), and
 * with argmax the greedy token into *best (else -1).  t[0..4): seconds in attention, MoE
 * blocks, dense MLPs, norm and head. */
int smoe_decode_plan_step(smoe_decode_plan *p, int64_t tok, int64_t S, smoe_kctx *head_c,
                          void *lp, int lb, int argmax, double t[4], int64_t *best,
                          smoe_err *err);

#endif

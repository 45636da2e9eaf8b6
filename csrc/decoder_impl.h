/* Pieces shared by csrc/attn_block.c, csrc/mla_block.c and csrc/decoder.c (not an API). */
#ifndef SMOE_DECODER_IMPL_H
#define SMOE_DECODER_IMPL_H

#include "decoder.h"

/* n values of src (f32, or bf16 bits when bf16) into dst as f32. */
void smoe_dec_widen(float *dst, const void *src, int bf16, size_t n);

/* n values of src into dst: f32, or bf16 bits when ob (src holds bf16 values then). */
void smoe_dec_store(void *dst, int ob, const float *src, size_t n);

/* of += the residual rp (f32, or bf16 bits when rb), rounded as a bf16 model rounds the sum
 * (bf16 set). */
void smoe_dec_residual_add(int bf16, float *of, const void *rp, int rb, size_t n);

/* A dense decoder layer's MLP for smoe_dec_tail: the SiLU MLP, its buffers and the kernel
 * context it runs on. */
typedef struct smoe_dense_mlp {
    smoe_kctx *c;
    const smoe_shared_ffn *f;
    smoe_mlp_bufs *b;
} smoe_dense_mlp;

/* The RMSNorm of `rows` rows of n values in place, in the Llama family's form (zc 0:
 * smoe_rmsnorm, a bf16 model's roundings step by step) or the zero-centred one (zc 1: w holds
 * 1 + the module's weight, applied in f32, the result rounded once to bf16 when bf16:
 * Qwen3-Next's and Qwen3.5's norms). */
void smoe_dec_norm(float *x, uint32_t rows, uint32_t n, const float *w, float eps, int bf16,
                   int zc);

/* The rest of a decoder layer after its attention, under the block's mutex: h (the attention
 * output, f32 [nt, hid]) += the layer input xp (f32, or bf16 bits when xb); nrm = the
 * post-attention RMSNorm of h (smoe_dec_norm, form zc2); the MoE block routed in C on nrm into
 * moe -- or, for a dense layer (g NULL), the MLP `mlp` on nrm; out op = h + moe in the model's
 * dtype (bf16 bits when ob).  bf16: every sum rounded as a bf16 model rounds it.  The routing
 * buffers (nt x k expert ids and weights, E used flags) grow in *route; *t1 is set when the MoE
 * block (the MLP) begins. */
int smoe_dec_tail(int bf16, smoe_layers *g, const smoe_dense_mlp *mlp, uint32_t pos, int flags,
                  uint32_t nt, uint32_t hid, float *h, const void *xp, int xb, const float *ln2,
                  float eps2, int zc2, float *nrm, float *moe, void **route, size_t *route_cap,
                  void *op, int ob, double *t1, smoe_err *err);

#endif

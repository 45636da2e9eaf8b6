/* What csrc/bindings/py_attn.c (MLADecode, AttnDecode, AttnBlock), py_decode.c (MLABlock,
 * layer_chain, rms_norm, DecodePlan) and py_gdn.c (GdnBlock) share: argument checks of the
 * decode-attention calls (the argument, set_mlp and init-error helpers defined in
 * py_block_args.c), and the pieces of one file's types the other reads.  The state and
 * compute behind them are plain C (csrc/decoder.h). */
#ifndef SMOE_PY_ATTN_H
#define SMOE_PY_ATTN_H

#include "decoder.h"
#include "py_common.h"
#include "py_numpy.h"

/* The array's dims must equal want[0..n) (a want of -1 matches any size); -1 with ValueError
 * naming it otherwise. */
int smoe_py_dims_are(PyObject *o, const char *name, const npy_intp *want, int n);

/* The optional additive bias argument: None -> NULL, 0 rows; else float32 [1 or B, T, S]. */
int smoe_py_bias_arg(PyObject *o, npy_intp B, npy_intp T, npy_intp S, const float **bias,
                     uint32_t *rows);

/* An RMSNorm's weights (float32 [n], C-contiguous) and eps (a float in [0, 1]) into *w, *eps;
 * -1 with an error otherwise. */
int smoe_py_norm_arg(PyObject *wo, PyObject *eo, uint32_t n, const float **w, float *eps);

/* The _C.Layers of a layer call (AttnBlock.layer, MLABlock.layer, GdnBlock.layer), begun
 * (smoe_py_layers_begin; end with smoe_py_layers_end) when pos is one of its MoE layers and
 * its hidden size is the block's (hid); NULL with an error otherwise. */
smoe_layers *smoe_py_layer_call_begin(PyObject *layers, long pos, uint32_t hid);

/* set_mlp's argument (AttnBlock, MLABlock): None (no MLP, *f zeroed) or a (gate, up, down)
 * tuple of _C.Linear chaining hid -> I -> hid into *f (the parts borrowed from arg); -1 with
 * the exception set.  who: the check's message prefix ("MLABlock.set_mlp: the MLP's"). */
int smoe_py_set_mlp_arg(PyObject *arg, uint32_t hid, const char *who, smoe_shared_ffn *f);

/* A failed smoe_*_block_init as the block constructors (AttnBlock, GdnBlock) raise it:
 * MemoryError without a message, ValueError with the check's, RuntimeError otherwise (the
 * mutex); returns -1. */
int smoe_py_block_init_raise(const smoe_err *err);

/* The start of every method of these objects: the object initialised (ready) and nargs one of
 * n1, n2 (n2 = n1: exactly n1); -1 with the exception set.  usage: the call's form. */
int smoe_py_method_start(int ready, const char *type, const char *usage, Py_ssize_t nargs,
                         Py_ssize_t n1, Py_ssize_t n2);

/* The descriptor and absorbed weights of an initialised _C.MLADecode (borrowed: immutable
 * while the object lives); -1 without an exception when o is none. */
int smoe_py_mla_parts(PyObject *o, const smoe_mla_desc **d, const smoe_mla_weights **w);

/* Whether o is a _C.AttnBlock. */
int smoe_py_is_attn_block(PyObject *o);

/* AttnBlock.layer's 16 arguments checked into *a (nothing begun, no lock taken), and the
 * block's C state and kernel context (borrowed from blk, an AttnBlock); -1 with the exception
 * set. */
int smoe_py_attn_layer_parse(PyObject *blk, PyObject *const *args, Py_ssize_t nargs,
                             smoe_attn_layer_args *a, smoe_attn_block **b, smoe_kctx **c);

/* Whether o is a _C.GdnBlock (py_gdn.c). */
int smoe_py_is_gdn_block(PyObject *o);

/* GdnBlock.layer's 12 arguments checked into *a (nothing begun, no lock taken), and the
 * block's C state and kernel context (borrowed from blk, a GdnBlock); -1 with the exception
 * set (py_gdn.c). */
int smoe_py_gdn_layer_parse(PyObject *blk, PyObject *const *args, Py_ssize_t nargs,
                            smoe_gdn_layer_args *a, smoe_gdn_block **b, smoe_kctx **c);

/* AttnBlock.layer, MLABlock.layer and GdnBlock.layer, one routine (py_decode.c). */
PyObject *smoe_py_layer_method(PyObject *self, PyObject *const *args, Py_ssize_t nargs);

/* Register MLABlock, DecodePlan, layer_chain and rms_norm (py_decode.c); called by
 * smoe_py_attn_init after its own types. */
int smoe_py_decode_init(PyObject *m);

#endif

/* Binding pieces of the kernels area that other bindings may reuse (e.g. an MoE-layer
 * function that runs experts through a KernelContext). */
#ifndef SMOE_PY_KERNELS_H
#define SMOE_PY_KERNELS_H

#include "py_common.h"
#include "kernels/kernels.h"
#include "py_desc.h"

/* The context of a specmoe._C.KernelContext object, or NULL with TypeError set. */
smoe_kctx *smoe_py_kctx(PyObject *obj);

/* A C-contiguous (and, when writable, writable) float32 or bf16 (uint16/int16 bits) array of
 * ndim dims, the kernels' f32/bf16 inputs and outputs: 0 for float32, 1 for bf16; -1 with
 * TypeError (not an array) or ValueError naming it otherwise. */
int smoe_py_f32_or_bf16(PyObject *o, const char *name, int ndim, int writable);

/* The descriptor, weight block and bias (NULL when none) of a specmoe._C.Linear object,
 * borrowed: valid while the caller holds a reference to obj (all are immutable after
 * construction).  Returns 0, or -1 with TypeError set when obj is not an initialised Linear. */
int smoe_py_linear_parts(PyObject *obj, const smoe_linear_desc **d, const uint8_t **block,
                         const float **bias);

/* The KernelContext of a specmoe._C.Linear object (GIL held), or NULL with TypeError set. */
smoe_kctx *smoe_py_linear_kctx(PyObject *obj);

/* The Linear obj (checked by smoe_py_linear_kctx, which gave c) on T tokens: out [T, N] = x
 * [T, K] W^T + b, x and out f32 or bf16 bits (xb, ob; bf16 widened and rounded as
 * Linear.forward does), not aliasing.  Needs no GIL (the caller keeps obj, x and out alive);
 * serialised with the object's other calls.  SMOE_OK or an error in *err. */
int smoe_py_linear_run(PyObject *obj, smoe_kctx *c, const void *x, int xb, uint32_t T, void *out,
                       int ob, smoe_err *err);

#endif

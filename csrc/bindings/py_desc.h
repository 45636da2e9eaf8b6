/* The one parser of the expert-FFN descriptor dict (specmoe.runtime.kernels.FFNSpec.desc()) for
 * both extensions: compiled once into the static library smoe_pybind (setup.py), which
 * specmoe._C and specmoe._cuda both link.  It raises plain Python exceptions only (TypeError,
 * ValueError), so it needs neither extension's exception objects. */
#ifndef SMOE_PY_DESC_H
#define SMOE_PY_DESC_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>

#include "kernels/kernels.h"

/* dict[key] as a non-negative int into *out; absent or None: ValueError "<what>: missing
 * <key>" when required, else *out = SMOE_NO_TENSOR.  0, or -1 with an exception set. */
int smoe_py_dict_u64(PyObject *dict, const char *what, const char *key, uint64_t *out,
                     int required);

/* Parse a descriptor dict (keys H, I, dtype, act, alpha, limit, precise, group, and the tensor
 * offsets gate/up/down[_scale|_bias]; None offsets mean "no tensor") and check it against a
 * block of block_bytes (0: offsets unchecked against a size) with smoe_ffn_desc_check.
 * 0, or -1 with TypeError / ValueError set. */
int smoe_py_ffn_desc_parse(PyObject *dict, uint64_t block_bytes, smoe_ffn_desc *d);

#endif

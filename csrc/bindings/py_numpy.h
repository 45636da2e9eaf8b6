/* Include this (not numpy/arrayobject.h) from py_*.c files that use the NumPy C API: the
 * API table is imported once in module.c and shared through PY_ARRAY_UNIQUE_SYMBOL. */
#ifndef SMOE_PY_NUMPY_H
#define SMOE_PY_NUMPY_H
#include "py_common.h"
#define NPY_NO_DEPRECATED_API NPY_1_20_API_VERSION
#define PY_ARRAY_UNIQUE_SYMBOL smoe_ARRAY_API
#define NO_IMPORT_ARRAY
#include <numpy/arrayobject.h>

/* obj as a new contiguous 1-D int32 array whose values all lie in 0..limit-1 (limit at most
 * 2^31).  `what` names the argument and `noun` one element ("key", "token id") in the
 * ValueError raised otherwise.  Returns NULL with an exception set. */
PyArrayObject *smoe_py_index_array(PyObject *obj, uint64_t limit, const char *what,
                                   const char *noun);

/* obj itself (borrowed) when it is a C-contiguous numpy array of `type` (NPY_FLOAT32,
 * NPY_INT64 or NPY_UINT8) with `ndim` dims, writable if asked; else NULL with TypeError (not
 * an array) or ValueError naming `name`.  No copy: the per-layer calls take caller buffers. */
PyArrayObject *smoe_py_want_array(PyObject *obj, const char *name, int type, int ndim,
                                  int writable);
#endif

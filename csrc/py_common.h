/* Shared pieces of the CPython binding.  Each py_*.c file owns one area and registers its
 * types/functions from its smoe_py_*_init(module) function, called by module.c. */
#ifndef SMOE_PY_COMMON_H
#define SMOE_PY_COMMON_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "common.h"

/* Exception types created once at module init (module.c); read-only afterwards. */
extern PyObject *smoe_py_Error;       /* specmoe.SpecmoeError, base of the others */
extern PyObject *smoe_py_StoreError;  /* specmoe.StoreError */
extern PyObject *smoe_py_CacheError;  /* specmoe.CacheError */
extern PyObject *smoe_py_PolicyError; /* specmoe.PolicyError */

/* Set the Python exception that matches err->code (ValueError, MemoryError, StoreError,
 * CacheError, PolicyError) with err->msg.  Returns NULL for `return smoe_py_raise(&e);`. */
PyObject *smoe_py_raise(const smoe_err *err);

/* Area initialisers (one per py_*.c).  Return 0, or -1 with an exception set. */
int smoe_py_store_init(PyObject *m);
int smoe_py_policy_init(PyObject *m);
int smoe_py_cache_init(PyObject *m);
int smoe_py_kernels_init(PyObject *m);
int smoe_py_sim_init(PyObject *m);
int smoe_py_moe_init(PyObject *m);
int smoe_py_spec_init(PyObject *m);
int smoe_py_layer_init(PyObject *m);
int smoe_py_linear_init(PyObject *m);
int smoe_py_attn_init(PyObject *m);

#endif

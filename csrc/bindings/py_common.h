/* Shared pieces of the CPython binding.  Each py_*.c file owns one area and registers its
 * types/functions from its smoe_py_*_init(module) function, called by module.c. */
#ifndef SMOE_PY_COMMON_H
#define SMOE_PY_COMMON_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "common.h"

/* Lock order, for every binding.  A forward holds a block's mutex (csrc/decoder.h), then the MoE
 * layers' mutex (smoe_layers.mu), then the slot table's (smoe_slots.mu); with that last one
 * held, a Python eviction policy's callbacks take the GIL (bindings/py_bridge.c), on the calling
 * thread or on the prefetch worker.  So the GIL comes after all three, and a thread that holds
 * the GIL must never wait for any of them: every binding that calls a C function taking one of
 * these mutexes releases the GIL first (Py_BEGIN_ALLOW_THREADS around the call), setters and
 * getters included, however short the critical section.  Issue 43 found the three-way deadlock
 * that breaking this rule causes (a setter holding the GIL, a forward holding the layers' mutex,
 * the worker holding the slots' mutex in a Python policy); tests/test_threads.py keeps it
 * covered for every setter. */

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
int smoe_py_route_init(PyObject *m);
int smoe_py_gdn_init(PyObject *m);

#endif

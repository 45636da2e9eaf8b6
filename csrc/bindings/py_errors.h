/* The one mapping from SMOE_E* codes (common.h) to Python exceptions, for both bindings:
 * csrc/bindings/module.c (specmoe._C) and csrc/bindings/py_cuda.c (specmoe._cuda).  Each binding passes its
 * exception objects (the _cuda module takes specmoe._C's and adds CudaError), so an error code
 * means the same exception whichever extension raises it.  Header-only: it needs Python.h,
 * which the pure-C core does not include. */
#ifndef SMOE_PY_ERRORS_H
#define SMOE_PY_ERRORS_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "common.h"

typedef struct smoe_py_errors {
    PyObject *base;   /* specmoe.SpecmoeError */
    PyObject *store;  /* specmoe.StoreError */
    PyObject *cache;  /* specmoe.CacheError */
    PyObject *policy; /* specmoe.PolicyError */
    PyObject *device; /* specmoe.CudaError, or NULL where none exists (then: base) */
} smoe_py_errors;

/* Set the exception of err->code with err->msg (`fallback` when empty); returns NULL. */
static inline PyObject *smoe_py_errors_raise(const smoe_py_errors *x, const smoe_err *err,
                                             const char *fallback) {
    PyObject *type;
    switch (err->code) {
    case SMOE_EINVAL: type = PyExc_ValueError; break;
    case SMOE_ENOMEM: type = PyExc_MemoryError; break;
    case SMOE_EIO:
    case SMOE_ECORRUPT: type = x->store; break;
    case SMOE_EPOLICY: type = x->policy; break;
    case SMOE_ECACHE:
    case SMOE_ESTATE: type = x->cache; break;
    case SMOE_EDEVICE: type = x->device ? x->device : x->base; break;
    default: type = x->base; break;
    }
    PyErr_SetString(type, err->msg[0] ? err->msg : fallback);
    return NULL;
}

#endif

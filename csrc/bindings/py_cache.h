/* Contract between py_cache.c (the _C.Cache type) and other bindings whose C code uses a cache
 * directly (e.g. an MoE forward that acquires experts and runs kernels without returning to
 * Python).  Call both functions with the GIL held; between them the cache may be used from C
 * with the GIL released, and Cache.close() refuses to run (CacheError) meanwhile.  The caller
 * also keeps its own reference to obj for that time. */
#ifndef SMOE_PY_CACHE_H
#define SMOE_PY_CACHE_H

#include "cache.h"
#include "py_common.h"

/* The smoe_cache inside a _C.Cache (or an object whose `native` attribute is one, such as
 * specmoe.ExpertCache), marked in use.  NULL with TypeError, or CacheError when closed. */
smoe_cache *smoe_py_cache_begin(PyObject *obj);

/* End a use started by smoe_py_cache_begin on the same obj. */
void smoe_py_cache_end(PyObject *obj);

#endif

/* Contract between py_store.c (the _C.Store type) and the bindings that borrow a store
 * (py_cache.c).  A borrower keeps a strong reference to the Python object for as long as it
 * uses the smoe_store*; the store is only closed by Store.close() or deallocation, so a
 * borrower must check it is still open (smoe_py_store_get again) before each use it starts
 * with the GIL held, or prevent close by holding its reference and documenting that
 * Store.close() must not be called while a cache uses it. */
#ifndef SMOE_PY_STORE_H
#define SMOE_PY_STORE_H

#include "py_common.h"
#include "store.h"

/* Return the smoe_store inside a _C.Store object (borrowed: valid while obj is alive and not
 * closed).  Returns NULL with TypeError if obj is not a _C.Store, or StoreError if it has
 * been closed.  Call with the GIL held. */
smoe_store *smoe_py_store_get(PyObject *obj);

#endif

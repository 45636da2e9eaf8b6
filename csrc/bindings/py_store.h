/* Contract between py_store.c (the _C.Store type) and the bindings that borrow a store
 * (py_cache.c).  specmoe.ExpertStore is a Python subclass of _C.Store, so both are accepted.
 *
 * A binding that keeps using the smoe_store* after returning to Python (a cache, whose
 * prefetch worker reads without the GIL) must BORROW it: smoe_py_store_borrow takes a strong
 * reference to the object and makes Store.close() refuse (StoreError "in use") until the
 * matching smoe_py_store_unborrow, so the descriptor can never be closed under a reader. */
#ifndef SMOE_PY_STORE_H
#define SMOE_PY_STORE_H

#include "py_common.h"
#include "store.h"

/* Return the smoe_store inside a _C.Store object (borrowed pointer, valid while obj is alive
 * and open).  Returns NULL with TypeError if obj is not a _C.Store, or StoreError if it is
 * closed (or was never opened).  Call with the GIL held. */
smoe_store *smoe_py_store_get(PyObject *obj);

/* Like smoe_py_store_get, and on success also Py_INCREF(obj) and count a borrow that blocks
 * close().  Pair every successful call with one smoe_py_store_unborrow(obj). GIL held. */
smoe_store *smoe_py_store_borrow(PyObject *obj);

/* Undo one smoe_py_store_borrow: drop the borrow count and the reference.  GIL held. */
void smoe_py_store_unborrow(PyObject *obj);

#endif

/* The Python bridge policy ("python"): eviction decided by a Python object, the slow path for
 * experiments.  Built only into the _C extension (it needs Python.h); the C-only builds of
 * tests/c and the _cuda extension leave csrc/policy/py_*.c out. */
#ifndef SMOE_POLICY_PY_BRIDGE_H
#define SMOE_POLICY_PY_BRIDGE_H

#include "py_common.h"
#include "policy/policy.h"

/* A bridge policy around obj (GIL held): each event calls obj's method of the same name
 * (on_insert, on_access, on_evict, on_pass, victim, on_counts, utility; victim required),
 * taking the GIL itself.  Returns NULL with a Python exception set. */
smoe_policy *smoe_py_bridge_create(PyObject *obj, const smoe_policy_params *params);

#endif

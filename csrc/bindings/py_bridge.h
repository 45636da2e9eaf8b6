/* The Python bridge policy ("python"): eviction decided by a Python object, the slow path for
 * experiments.  Compiled once into smoe_pybind (setup.py), which both extensions link: the CPU
 * cache (specmoe._C) and the GPU cache (specmoe._cuda) take Python policies alike.  Needs only
 * Python.h and the policy interface. */
#ifndef SMOE_POLICY_PY_BRIDGE_H
#define SMOE_POLICY_PY_BRIDGE_H

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "policy/policy.h"

/* A bridge policy around obj (GIL held): each event calls obj's method of the same name
 * (on_insert, on_access, on_evict, on_pass, victim, on_counts, utility; victim required),
 * taking the GIL itself.  Returns NULL with a Python exception set. */
smoe_policy *smoe_py_bridge_create(PyObject *obj, const smoe_policy_params *params);

#endif

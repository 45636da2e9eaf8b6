/* Contract between py_policy.c (the _C.Policy type) and the other bindings that consume a
 * policy (py_cache.c, py_sim.c). */
#ifndef SMOE_PY_POLICY_H
#define SMOE_PY_POLICY_H

#include "py_common.h"
#include "policy/policy.h"

/* If obj is a _C.Policy not yet taken, detach and return its smoe_policy (ownership passes to
 * the caller, who frees it with smoe_policy_destroy) and mark obj as taken.  Checks that the
 * policy was built for nslots/num_layers/num_experts.  Returns NULL with a Python exception
 * set (TypeError, ValueError, or PolicyError "policy already in use") otherwise. */
smoe_policy *smoe_py_policy_take(PyObject *obj, uint32_t nslots, uint32_t num_layers,
                                 uint32_t num_experts);

#endif

/* A device expert tier (csrc/tier.h) handed from specmoe._cuda to specmoe._C.Layers: a
 * PyCapsule named SMOE_PY_TIER_CAPSULE whose pointer is a smoe_py_tier.  The capsule holds a
 * strong reference to `owner` (the _cuda.Tier object, which holds the GPU cache and kernel
 * context the tier borrows), and _C.Layers holds the capsule, so nothing the tier points at is
 * freed while a Layers uses it; begin/end bracket each call that uses the tier, so the cache
 * cannot be closed under one (as smoe_py_cache_begin/end do for the CPU cache). */
#ifndef SMOE_PY_TIER_H
#define SMOE_PY_TIER_H

#include "py_common.h"
#include "tier.h"

#define SMOE_PY_TIER_CAPSULE "specmoe.tier"

typedef struct smoe_py_tier {
    smoe_tier tier;
    PyObject *owner;               /* borrowed from the capsule's reference */
    int (*begin)(PyObject *owner); /* GIL held: mark in use; -1 with an exception if closed */
    void (*end)(PyObject *owner);  /* GIL held */
} smoe_py_tier;

#endif

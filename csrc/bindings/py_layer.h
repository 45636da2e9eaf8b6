/* What other bindings may use of specmoe._C.Layers (py_layer.c). */
#ifndef SMOE_PY_LAYER_H
#define SMOE_PY_LAYER_H

#include "py_common.h"
#include "layer.h"

/* The smoe_layers of a _C.Layers object, its cache marked in use (smoe_py_cache_begin) so that
 * it cannot close under a call; NULL with TypeError (not an initialised Layers) or CacheError
 * (closed).  End with smoe_py_layers_end(obj).  Both with the GIL held; the smoe_layers is
 * used between them without it (its own mutex serialises calls). */
smoe_layers *smoe_py_layers_begin(PyObject *obj);
void smoe_py_layers_end(PyObject *obj);

/* A route_flags argument (a combination of the ROUTE_* flags, csrc/layer.h)
 * into *flags; -1 with ValueError/TypeError otherwise. */
int smoe_py_route_flags(PyObject *o, int *flags);

/* A (gate, up, down) tuple of specmoe._C.Linear into *f (borrowed parts: valid while the
 * caller keeps the tuple); None gives an empty *f (d[0] NULL).  -1 with TypeError naming
 * `what` otherwise.  Shapes are not checked here (smoe_silu_mlp_check). */
int smoe_py_mlp_parts(PyObject *t, smoe_shared_ffn *f, const char *what);

#endif

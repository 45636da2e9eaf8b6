/* Python binding for the cache area (placeholder: filled in by its own change). */
#include "py_common.h"

int smoe_py_cache_init(PyObject *m) {
    (void)m;
    return 0;
}

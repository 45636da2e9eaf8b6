/* Python binding for the store area (placeholder: filled in by its own change). */
#include "py_common.h"

int smoe_py_store_init(PyObject *m) {
    (void)m;
    return 0;
}

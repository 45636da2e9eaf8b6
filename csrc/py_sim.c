/* Python binding for the sim area (placeholder: filled in by its own change). */
#include "py_common.h"

int smoe_py_sim_init(PyObject *m) {
    (void)m;
    return 0;
}

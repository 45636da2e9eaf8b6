/* Python binding for the policy area (placeholder: filled in by its own change). */
#include "py_common.h"

int smoe_py_policy_init(PyObject *m) {
    (void)m;
    return 0;
}

/* Argument and error helpers shared by the decoder-block bindings (py_attn.c, py_decode.c,
 * py_gdn.c), declared in py_attn.h. */
#include "py_attn.h"
#include "py_common.h"
#include "py_numpy.h"

int smoe_py_block_init_raise(const smoe_err *err) {
    if (err->code == SMOE_ENOMEM)
        PyErr_NoMemory();
    else if (err->code == SMOE_EINVAL)
        PyErr_SetString(PyExc_ValueError, err->msg);
    else
        PyErr_SetString(PyExc_RuntimeError, err->msg);
    return -1;
}

int smoe_py_norm_arg(PyObject *wo, PyObject *eo, uint32_t n, const float **w, float *eps) {
    PyArrayObject *a = smoe_py_want_array(wo, "ln", NPY_FLOAT32, 1, 0);
    if (!a) return -1;
    if (PyArray_DIM(a, 0) != (npy_intp)n) {
        PyErr_Format(PyExc_ValueError, "ln has %zd weights, expected hidden=%u",
                     (Py_ssize_t)PyArray_DIM(a, 0), n);
        return -1;
    }
    double e = PyFloat_AsDouble(eo);
    if (e == -1.0 && PyErr_Occurred()) return -1;
    if (!(e >= 0.0) || e > 1.0) {
        smoe_err err; /* (PyErr_Format has no %g) */
        smoe_err_set(&err, SMOE_EINVAL, "ln_eps must be in [0, 1], got %g", e);
        smoe_py_raise(&err);
        return -1;
    }
    *w = (const float *)PyArray_DATA(a);
    *eps = (float)e;
    return 0;
}

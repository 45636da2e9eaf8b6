/* Argument and error helpers shared by the decoder-block bindings (py_attn.c, py_decode.c,
 * py_gdn.c), declared in py_attn.h. */
#include "py_attn.h"
#include "py_common.h"
#include "py_layer.h"
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

/* The array's dims must equal want[0..n) (a want of -1 matches any size). */
int smoe_py_dims_are(PyObject *o, const char *name, const npy_intp *want, int n) {
    PyArrayObject *a = (PyArrayObject *)o;
    for (int i = 0; i < n; i++)
        if (want[i] >= 0 && PyArray_DIM(a, i) != want[i]) {
            PyErr_Format(PyExc_ValueError, "%s: dimension %d is %zd, expected %zd", name, i,
                         (Py_ssize_t)PyArray_DIM(a, i), (Py_ssize_t)want[i]);
            return -1;
        }
    return 0;
}

/* The optional additive bias argument: None -> NULL, 0 rows; else float32 [1 or B, T, S]. */
int smoe_py_bias_arg(PyObject *o, npy_intp B, npy_intp T, npy_intp S, const float **bias,
                     uint32_t *rows) {
    *bias = NULL;
    *rows = 0;
    if (o == Py_None) return 0;
    PyArrayObject *b = smoe_py_want_array(o, "bias", NPY_FLOAT32, 3, 0);
    if (!b) return -1;
    npy_intp w_b[3] = {-1, T, S};
    if (smoe_py_dims_are(o, "bias [1 or B, T, S]", w_b, 3)) return -1;
    if (PyArray_DIM(b, 0) != 1 && PyArray_DIM(b, 0) != B) {
        PyErr_Format(PyExc_ValueError, "bias has %zd rows, expected 1 or B=%zd",
                     (Py_ssize_t)PyArray_DIM(b, 0), (Py_ssize_t)B);
        return -1;
    }
    *bias = (const float *)PyArray_DATA(b);
    *rows = (uint32_t)PyArray_DIM(b, 0);
    return 0;
}

/* The start of every method of these objects: the object initialised (ready) and nargs one of
 * n1, n2 (n2 = n1: exactly n1); -1 with the exception set.  usage: the call's form, for the
 * message. */
int smoe_py_method_start(int ready, const char *type, const char *usage, Py_ssize_t nargs,
                         Py_ssize_t n1, Py_ssize_t n2) {
    if (!ready) {
        PyErr_Format(PyExc_ValueError, "%s is not initialised", type);
        return -1;
    }
    if (nargs == n1 || nargs == n2) return 0;
    if (n1 == n2)
        PyErr_Format(PyExc_TypeError, "%s takes %zd arguments, got %zd", usage, n1, nargs);
    else
        PyErr_Format(PyExc_TypeError, "%s takes %zd or %zd arguments, got %zd", usage, n1, n2,
                     nargs);
    return -1;
}

int smoe_py_set_mlp_arg(PyObject *arg, uint32_t hid, const char *who, smoe_shared_ffn *f) {
    if (smoe_py_mlp_parts(arg, f, "set_mlp: mlp") < 0) return -1;
    if (arg == Py_None) return 0;
    smoe_err e;
    smoe_err_clear(&e);
    if (smoe_silu_mlp_check(f, hid, who, &e)) {
        smoe_py_raise(&e);
        return -1;
    }
    return 0;
}

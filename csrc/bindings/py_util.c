/* Small conversions shared by the py_*.c bindings. */
#include "py_numpy.h"

PyArrayObject *smoe_py_index_array(PyObject *obj, uint64_t limit, const char *what,
                                   const char *noun) {
    PyArrayObject *a64 = (PyArrayObject *)PyArray_FROM_OTF(obj, NPY_INT64, NPY_ARRAY_IN_ARRAY);
    if (!a64) return NULL;
    if (PyArray_NDIM(a64) != 1) {
        PyErr_Format(PyExc_ValueError, "%s must be a 1-D sequence of %ss, got %d dimensions",
                     what, noun, PyArray_NDIM(a64));
        Py_DECREF(a64);
        return NULL;
    }
    npy_intp n = PyArray_DIM(a64, 0);
    PyArrayObject *out = (PyArrayObject *)PyArray_SimpleNew(1, &n, NPY_INT32);
    if (!out) {
        Py_DECREF(a64);
        return NULL;
    }
    const int64_t *src = PyArray_DATA(a64);
    int32_t *dst = PyArray_DATA(out);
    for (npy_intp i = 0; i < n; i++) {
        if (src[i] < 0 || (uint64_t)src[i] >= limit) {
            PyErr_Format(PyExc_ValueError, "%s: %s %lld at position %zd is outside 0..%llu", what,
                         noun, (long long)src[i], (Py_ssize_t)i,
                         (unsigned long long)(limit - 1));
            Py_DECREF(a64);
            Py_DECREF(out);
            return NULL;
        }
        dst[i] = (int32_t)src[i];
    }
    Py_DECREF(a64);
    return out;
}

PyArrayObject *smoe_py_want_array(PyObject *obj, const char *name, int type, int ndim,
                                  int writable) {
    if (!PyArray_Check(obj)) {
        PyErr_Format(PyExc_TypeError, "%s must be a numpy array", name);
        return NULL;
    }
    PyArrayObject *a = (PyArrayObject *)obj;
    if (PyArray_TYPE(a) != type || PyArray_NDIM(a) != ndim || !PyArray_IS_C_CONTIGUOUS(a) ||
        (writable && !PyArray_ISWRITEABLE(a))) {
        PyErr_Format(PyExc_ValueError, "%s must be a C-contiguous %s%s array of %d dims", name,
                     writable ? "writable " : "",
                     type == NPY_FLOAT32 ? "float32" : type == NPY_INT64 ? "int64" : "uint8",
                     ndim);
        return NULL;
    }
    return a;
}

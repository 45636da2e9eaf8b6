/* The expert-FFN descriptor parser of both extensions (declared in py_desc.h). */
#include "py_desc.h"

int smoe_py_dict_u64(PyObject *dict, const char *what, const char *key, uint64_t *out,
                     int required) {
    PyObject *v = PyDict_GetItemString(dict, key); /* borrowed */
    if (!v || v == Py_None) {
        if (required) {
            PyErr_Format(PyExc_ValueError, "%s: missing %s", what, key);
            return -1;
        }
        *out = SMOE_NO_TENSOR;
        return 0;
    }
    unsigned long long x = PyLong_AsUnsignedLongLong(v);
    if (x == (unsigned long long)-1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "%s: %s must be a non-negative int, got %R", what, key,
                     v);
        return -1;
    }
    *out = x;
    return 0;
}

static int dict_u64(PyObject *dict, const char *key, uint64_t *out, int required) {
    return smoe_py_dict_u64(dict, "FFN descriptor", key, out, required);
}

int smoe_py_ffn_desc_parse(PyObject *dict, uint64_t block_bytes, smoe_ffn_desc *d) {
    if (!PyDict_Check(dict)) {
        PyErr_SetString(PyExc_TypeError, "FFN descriptor must be a dict (FFNSpec.desc())");
        return -1;
    }
    uint64_t hid, inter, dt, act, group;
    if (dict_u64(dict, "H", &hid, 1) || dict_u64(dict, "I", &inter, 1) ||
        dict_u64(dict, "dtype", &dt, 1) || dict_u64(dict, "act", &act, 1) ||
        dict_u64(dict, "group", &group, 0))
        return -1;
    if (hid > UINT32_MAX || inter > UINT32_MAX || dt > 100 || act > 100 ||
        (group != SMOE_NO_TENSOR && group > UINT32_MAX)) {
        PyErr_SetString(PyExc_ValueError, "FFN descriptor: field out of range");
        return -1;
    }
    smoe_ffn_desc_default(d, (uint32_t)hid, (uint32_t)inter, (int32_t)dt, (int32_t)act);
    if (group != SMOE_NO_TENSOR) d->group = (uint32_t)group;
    PyObject *v;
    if ((v = PyDict_GetItemString(dict, "alpha")) && v != Py_None) {
        double a = PyFloat_AsDouble(v);
        if (a == -1.0 && PyErr_Occurred()) return -1;
        d->alpha = (float)a;
    }
    if ((v = PyDict_GetItemString(dict, "limit")) && v != Py_None) {
        double a = PyFloat_AsDouble(v);
        if (a == -1.0 && PyErr_Occurred()) return -1;
        d->limit = (float)a;
    }
    if ((v = PyDict_GetItemString(dict, "precise")) && v != Py_None) {
        int b = PyObject_IsTrue(v);
        if (b < 0) return -1;
        d->precise = (uint32_t)b;
    }
    uint64_t ddt;
    if (dict_u64(dict, "down_dtype", &ddt, 0)) return -1;
    if (ddt != SMOE_NO_TENSOR) {
        if (ddt > 100) {
            PyErr_SetString(PyExc_ValueError, "FFN descriptor: down_dtype out of range");
            return -1;
        }
        d->down_dtype = (int32_t)ddt == d->dtype ? 0 : (int32_t)ddt;
    }
    if (dict_u64(dict, "gate", &d->gate, 1) || dict_u64(dict, "up", &d->up, 1) ||
        dict_u64(dict, "down", &d->down, 1) || dict_u64(dict, "gate_scale", &d->gate_scale, 0) ||
        dict_u64(dict, "up_scale", &d->up_scale, 0) ||
        dict_u64(dict, "down_scale", &d->down_scale, 0) ||
        dict_u64(dict, "gate_bias", &d->gate_bias, 0) ||
        dict_u64(dict, "up_bias", &d->up_bias, 0) ||
        dict_u64(dict, "down_bias", &d->down_bias, 0))
        return -1;
    smoe_err err;
    smoe_err_clear(&err);
    if (smoe_ffn_desc_check(d, block_bytes, &err) != 0) { /* SMOE_EINVAL: a bad descriptor */
        PyErr_SetString(PyExc_ValueError, err.msg[0] ? err.msg : "FFN descriptor: invalid");
        return -1;
    }
    return 0;
}

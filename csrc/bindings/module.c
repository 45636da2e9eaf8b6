/* specmoe._C: module definition, exception types, error mapping.  The types and functions of
 * each area live in their own py_*.c file and are registered from here. */
#include "py_common.h"
#include "py_errors.h"

#define NPY_NO_DEPRECATED_API NPY_1_20_API_VERSION
#define PY_ARRAY_UNIQUE_SYMBOL smoe_ARRAY_API
#include <numpy/arrayobject.h>

PyObject *smoe_py_Error;
PyObject *smoe_py_StoreError;
PyObject *smoe_py_CacheError;
PyObject *smoe_py_PolicyError;

PyObject *smoe_py_raise(const smoe_err *err) {
    const smoe_py_errors x = {smoe_py_Error, smoe_py_StoreError, smoe_py_CacheError,
                              smoe_py_PolicyError, NULL};
    return smoe_py_errors_raise(&x, err, "specmoe: unknown error");
}

static struct PyModuleDef smoe_module = {
    PyModuleDef_HEAD_INIT, "specmoe._C",
    "specmoe C core: expert store, cache, policies, prefetch worker, kernels, simulator.", -1,
    NULL, NULL, NULL, NULL, NULL};

static int add_exc(PyObject *m, PyObject **slot, const char *qual, const char *attr,
                   PyObject *base, const char *doc) {
    *slot = PyErr_NewExceptionWithDoc(qual, doc, base, NULL);
    if (!*slot) return -1;
    Py_INCREF(*slot);
    if (PyModule_AddObject(m, attr, *slot) < 0) {
        Py_DECREF(*slot);
        return -1;
    }
    return 0;
}

PyMODINIT_FUNC PyInit__C(void) {
    import_array();
    PyObject *m = PyModule_Create(&smoe_module);
    if (!m) return NULL;
    if (add_exc(m, &smoe_py_Error, "specmoe.SpecmoeError", "SpecmoeError", PyExc_RuntimeError,
                "Base class of specmoe errors.") < 0 ||
        add_exc(m, &smoe_py_StoreError, "specmoe.StoreError", "StoreError", smoe_py_Error,
                "The expert store file is missing, truncated, damaged or foreign.") < 0 ||
        add_exc(m, &smoe_py_CacheError, "specmoe.CacheError", "CacheError", smoe_py_Error,
                "The expert cache cannot satisfy a request.") < 0 ||
        add_exc(m, &smoe_py_PolicyError, "specmoe.PolicyError", "PolicyError", smoe_py_Error,
                "An eviction policy failed.") < 0)
        goto fail;
    if (smoe_py_store_init(m) < 0 || smoe_py_policy_init(m) < 0 || smoe_py_cache_init(m) < 0 ||
        smoe_py_kernels_init(m) < 0 || smoe_py_sim_init(m) < 0 ||
        smoe_py_moe_init(m) < 0 || smoe_py_spec_init(m) < 0 || smoe_py_layer_init(m) < 0 ||
        smoe_py_linear_init(m) < 0 || smoe_py_attn_init(m) < 0 || smoe_py_route_init(m) < 0 ||
        smoe_py_gdn_init(m) < 0)
        goto fail;
    return m;
fail:
    Py_DECREF(m);
    return NULL;
}

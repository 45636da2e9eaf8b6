/* specmoe._C.predict_next and route_scores: the routing rules of csrc/route.h for callers
 * outside the C layers (the SpAc balancer's path of the GPU tier predicts with them; trace
 * recording scores router logits with them), so every caller applies the same rule. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "py_numpy.h"
#include "route.h"

/* A correction-bias argument: None (*corr NULL) or float32 [E]; -1 with an error naming fn. */
static int want_corr(PyObject *o, npy_intp E, const char *fn, const float **corr) {
    *corr = NULL;
    if (o == Py_None) return 0;
    PyArrayObject *c = smoe_py_want_array(o, "corr", NPY_FLOAT32, 1, 0);
    if (!c) return -1;
    if (PyArray_DIM(c, 0) != E) {
        PyErr_Format(PyExc_ValueError, "%s: corr has %zd entries, for %zd experts", fn,
                     (Py_ssize_t)PyArray_DIM(c, 0), (Py_ssize_t)E);
        return -1;
    }
    *corr = PyArray_DATA(c);
    return 0;
}

static PyObject *py_predict_next(PyObject *mod, PyObject *args, PyObject *kw) {
    (void)mod;
    static char *kwlist[] = {"logits", "k", "overfetch", "mass", "sigmoid", "corr", NULL};
    PyObject *lo, *corr_o = Py_None;
    unsigned int k;
    double overfetch, mass = 0.0;
    int sigmoid = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OId|dpO:predict_next", kwlist, &lo, &k,
                                     &overfetch, &mass, &sigmoid, &corr_o))
        return NULL;
    PyArrayObject *lg = smoe_py_want_array(lo, "logits", NPY_FLOAT32, 2, 0);
    if (!lg) return NULL;
    const npy_intp T = PyArray_DIM(lg, 0), E = PyArray_DIM(lg, 1);
    if (E < 1 || E > 65536 || k < 1 || (npy_intp)k > E) {
        PyErr_Format(PyExc_ValueError, "predict_next: logits [T, E] with 1 <= k <= E <= 65536, "
                     "got E=%zd k=%u", (Py_ssize_t)E, k);
        return NULL;
    }
    if (!(overfetch >= 1.0) || !(mass >= 0.0 && mass <= 1.0)) {
        smoe_err e; /* (PyErr_Format has no %g) */
        smoe_err_set(&e, SMOE_EINVAL, "predict_next: overfetch must be >= 1 and mass in "
                     "[0, 1] (got %g, %g)", overfetch, mass);
        return smoe_py_raise(&e);
    }
    const float *corr;
    if (want_corr(corr_o, E, "predict_next", &corr) < 0) return NULL;
    /* scores: a copy of the logits (the caller's array is not written), then E-sized scratch */
    size_t n_sc = (size_t)T * (size_t)E;
    float *sc = malloc(sizeof *sc * (n_sc + 2 * (size_t)E) + sizeof(int32_t) * (size_t)E +
                       (size_t)E);
    if (!sc) return PyErr_NoMemory();
    float *best = sc + n_sc, *prob = best + E;
    int32_t *order = (int32_t *)(prob + E);
    uint8_t *mark = (uint8_t *)(order + E);
    memcpy(sc, PyArray_DATA(lg), sizeof *sc * n_sc);
    Py_BEGIN_ALLOW_THREADS
    smoe_route_scores(sc, (uint32_t)T, (uint32_t)E, sigmoid, corr);
    smoe_route_predict(sc, (uint32_t)T, (uint32_t)E, k, overfetch, mass, NULL, mark, best, order,
                       prob);
    Py_END_ALLOW_THREADS
    npy_intp n = 0;
    for (npy_intp e = 0; e < E; e++) n += mark[e] != 0;
    PyObject *ids = PyArray_SimpleNew(1, &n, NPY_INT64);
    PyObject *pri = PyArray_SimpleNew(1, &n, NPY_FLOAT32);
    if (!ids || !pri) {
        free(sc);
        Py_XDECREF(ids);
        Py_XDECREF(pri);
        return NULL;
    }
    int64_t *pi = PyArray_DATA((PyArrayObject *)ids);
    float *pp = PyArray_DATA((PyArrayObject *)pri);
    for (npy_intp e = 0, j = 0; e < E; e++)
        if (mark[e]) pi[j] = e, pp[j] = best[e], j++;
    free(sc);
    return Py_BuildValue("(NN)", ids, pri);
}

static PyObject *py_route_scores(PyObject *mod, PyObject *args, PyObject *kw) {
    (void)mod;
    static char *kwlist[] = {"scores", "sigmoid", "corr", NULL};
    PyObject *so, *corr_o = Py_None;
    int sigmoid = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|pO:route_scores", kwlist, &so, &sigmoid,
                                     &corr_o))
        return NULL;
    PyArrayObject *s = smoe_py_want_array(so, "scores", NPY_FLOAT32, 2, 1);
    if (!s) return NULL;
    const npy_intp T = PyArray_DIM(s, 0), E = PyArray_DIM(s, 1);
    const float *corr;
    if (want_corr(corr_o, E, "route_scores", &corr) < 0) return NULL;
    if (T > UINT32_MAX || E > UINT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "route_scores: too many tokens or experts");
        return NULL;
    }
    smoe_route_scores(PyArray_DATA(s), (uint32_t)T, (uint32_t)E, sigmoid, corr);
    Py_RETURN_NONE;
}

/* counts (any integer sequence) as a descending uint32 array, or NULL with ValueError. */
static PyArrayObject *descending_counts(PyObject *co, const char *fn) {
    PyArrayObject *c = (PyArrayObject *)PyArray_FROMANY(co, NPY_UINT32, 1, 1,
                                                        NPY_ARRAY_IN_ARRAY | NPY_ARRAY_FORCECAST);
    if (!c) return NULL;
    const npy_intp m = PyArray_DIM(c, 0);
    const uint32_t *v = PyArray_DATA(c);
    for (npy_intp i = 1; i < m; i++)
        if (v[i] > v[i - 1]) {
            Py_DECREF(c);
            PyErr_Format(PyExc_ValueError, "%s: counts must be in descending order", fn);
            return NULL;
        }
    if (m > UINT32_MAX) {
        Py_DECREF(c);
        PyErr_Format(PyExc_ValueError, "%s: too many experts", fn);
        return NULL;
    }
    return c;
}

/* Costs finite and >= 0 (seconds), else ValueError naming them. */
static int check_costs(const char *fn, double t_io, double t_gpu, double t_cpu) {
    if (isfinite(t_io) && isfinite(t_gpu) && isfinite(t_cpu) && t_io >= 0 && t_gpu >= 0 &&
        t_cpu >= 0)
        return 0;
    smoe_err e; /* (PyErr_Format has no %g) */
    smoe_err_set(&e, SMOE_EINVAL, "%s: costs must be finite and >= 0, got t_io=%g, t_gpu=%g, "
                 "t_cpu=%g", fn, t_io, t_gpu, t_cpu);
    smoe_py_raise(&e);
    return -1;
}

static PyObject *py_balance_cut(PyObject *mod, PyObject *args, PyObject *kw) {
    (void)mod;
    static char *kwlist[] = {"counts", "on_fast", "t_io", "t_gpu", "t_cpu", NULL};
    PyObject *co;
    unsigned int on_fast;
    double t_io, t_gpu, t_cpu;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OIddd:balance_cut", kwlist, &co, &on_fast,
                                     &t_io, &t_gpu, &t_cpu))
        return NULL;
    if (check_costs("balance_cut", t_io, t_gpu, t_cpu) < 0) return NULL;
    PyArrayObject *c = descending_counts(co, "balance_cut");
    if (!c) return NULL;
    const uint32_t n = smoe_route_balance_cut(PyArray_DATA(c), (uint32_t)PyArray_DIM(c, 0),
                                              on_fast, t_io, t_gpu, t_cpu);
    Py_DECREF(c);
    return PyLong_FromUnsignedLong(n);
}

static PyObject *py_balance_admit(PyObject *mod, PyObject *args, PyObject *kw) {
    (void)mod;
    static char *kwlist[] = {"counts", "t_io", "t_gpu", "t_cpu", "window", NULL};
    PyObject *co;
    double t_io, t_gpu, t_cpu, window;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "Odddd:balance_admit", kwlist, &co, &t_io,
                                     &t_gpu, &t_cpu, &window))
        return NULL;
    if (check_costs("balance_admit", t_io, t_gpu, t_cpu) < 0) return NULL;
    if (isnan(window)) {
        PyErr_SetString(PyExc_ValueError, "balance_admit: window is NaN");
        return NULL;
    }
    PyArrayObject *c = descending_counts(co, "balance_admit");
    if (!c) return NULL;
    const uint32_t n = smoe_route_balance_admit(PyArray_DATA(c), (uint32_t)PyArray_DIM(c, 0),
                                                t_io, t_gpu, t_cpu, window);
    Py_DECREF(c);
    return PyLong_FromUnsignedLong(n);
}

static PyMethodDef route_functions[] = {
    {"predict_next", (PyCFunction)(void (*)(void))py_predict_next, METH_VARARGS | METH_KEYWORDS,
     "predict_next(logits, k, overfetch, mass=0.0, sigmoid=False, corr=None) -> (experts, "
     "priorities)\n"
     "The next-layer prediction rule of the CPU layers (csrc/route.h) over router logits\n"
     "float32 [T, E]: the model's score function (sigmoid/softmax + corr when corr is given),\n"
     "then per token the top ceil(k * overfetch) experts, or with mass > 0 the fewest (at least\n"
     "k) whose softmax probability sums to mass.  experts: int64 ids ascending; priorities:\n"
     "float32, each expert's best score (mass: probability), the prefetch priority."},
    {"route_scores", (PyCFunction)(void (*)(void))py_route_scores, METH_VARARGS | METH_KEYWORDS,
     "route_scores(scores, sigmoid=False, corr=None)\n"
     "scores float32 [T, E] (writable, in place): router logits become the model's selection\n"
     "scores (csrc/route.h): with a correction bias corr [E], sigmoid(l) + corr (sigmoid) or\n"
     "softmax(l) + corr; without one the logits are left as they are."},
    {"balance_cut", (PyCFunction)(void (*)(void))py_balance_cut, METH_VARARGS | METH_KEYWORDS,
     "balance_cut(counts, on_fast, t_io, t_gpu, t_cpu) -> int\n"
     "The hybrid tier's split (csrc/route.h, MoE-SpAc section 3.3 Eq. 7-9): of a layer's\n"
     "missing experts with token counts `counts` (descending), how many to copy to the fast\n"
     "tier; the rest are computed on the CPU.  on_fast: the layer's experts already there."},
    {"balance_admit", (PyCFunction)(void (*)(void))py_balance_admit,
     METH_VARARGS | METH_KEYWORDS,
     "balance_admit(counts, t_io, t_gpu, t_cpu, window) -> int\n"
     "The hybrid tier's admission (csrc/route.h, MoE-SpAc Eq. 10): of experts the CPU would\n"
     "compute, token counts `counts` (descending), how many of the first to copy: those with\n"
     "t_cpu * count > t_gpu, at most floor(window / t_io)."},
    {NULL, NULL, 0, NULL}};

int smoe_py_route_init(PyObject *m) { return PyModule_AddFunctions(m, route_functions); }

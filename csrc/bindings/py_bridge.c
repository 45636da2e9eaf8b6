/* The Python bridge policy (declared in py_bridge.h). */
#include "py_bridge.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>

/* The Python bridge.  Every callback takes the GIL itself (PyGILState_Ensure), because the
 * cache calls policies from threads that do not hold it.  A callback that raises, or a victim
 * answer that is not a candidate, is recorded in p->failure (SMOE_EPOLICY; the first failure
 * wins) and the Python error is cleared before the GIL is released: no exception ever stays
 * set across threads.  victim() then returns -1. */

enum { PYB_INSERT, PYB_ACCESS, PYB_EVICT, PYB_PASS, PYB_VICTIM, PYB_COUNTS, PYB_UTILITY, PYB_N };
static const char *const pyb_names[PYB_N] = {"on_insert", "on_access", "on_evict", "on_pass",
                                             "victim", "on_counts", "utility"};

typedef struct pyb_state {
    PyObject *obj;
    PyObject *meth[PYB_N]; /* bound methods, NULL when absent (victim is required) */
    uint8_t *resident;     /* [nslots] */
    uint32_t *cand;        /* [nslots] scratch for victim() */
} pyb_state;

/* Record the pending Python exception (GIL held) as the policy's failure and clear it. */
static void pyb_fail_exc(smoe_policy *p, const char *what) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    if (p->failure.code == 0) {
        const char *tname = type ? ((PyTypeObject *)type)->tp_name : "error";
        PyObject *s = value ? PyObject_Str(value) : NULL;
        const char *msg = s ? PyUnicode_AsUTF8(s) : NULL;
        if (!msg) PyErr_Clear();
        smoe_err_set(&p->failure, SMOE_EPOLICY, "python policy: %s raised %s: %s", what, tname,
                     msg ? msg : "(unprintable)");
        Py_XDECREF(s);
    }
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    PyErr_Clear();
}

static void pyb_call(smoe_policy *p, int which, const char *fmt, ...) {
    pyb_state *st = p->state;
    if (!st->meth[which]) return;
    PyGILState_STATE g = PyGILState_Ensure();
    va_list ap;
    va_start(ap, fmt);
    PyObject *args = Py_VaBuildValue(fmt, ap);
    va_end(ap);
    PyObject *r = args ? PyObject_CallObject(st->meth[which], args) : NULL;
    Py_XDECREF(args);
    if (!r) pyb_fail_exc(p, pyb_names[which]);
    Py_XDECREF(r);
    PyGILState_Release(g);
}

static int pyb_init(smoe_policy *p, const smoe_policy_params *params, smoe_err *err) {
    (void)p;
    (void)params;
    return smoe_err_set(err, SMOE_EINVAL, "python policy: create it with pyobj= (a Python object)");
}

static void pyb_free(smoe_policy *p) {
    pyb_state *st = p->state;
    if (!st) return;
    if (Py_IsInitialized()) {
        PyGILState_STATE g = PyGILState_Ensure();
        for (int i = 0; i < PYB_N; i++) Py_XDECREF(st->meth[i]);
        Py_XDECREF(st->obj);
        PyGILState_Release(g);
    }
    free(st->resident);
    free(st->cand);
    free(st);
}

static void pyb_insert(smoe_policy *p, uint32_t slot, int32_t key, int prefetch) {
    pyb_state *st = p->state;
    if (slot < p->nslots) st->resident[slot] = 1;
    pyb_call(p, PYB_INSERT, "(IiO)", (unsigned)slot, (int)key, prefetch ? Py_True : Py_False);
}

static void pyb_access(smoe_policy *p, uint32_t slot, int32_t key) {
    pyb_call(p, PYB_ACCESS, "(Ii)", (unsigned)slot, (int)key);
}

static void pyb_evict(smoe_policy *p, uint32_t slot, int32_t key) {
    pyb_state *st = p->state;
    if (slot < p->nslots) st->resident[slot] = 0;
    pyb_call(p, PYB_EVICT, "(Ii)", (unsigned)slot, (int)key);
}

static void pyb_pass(smoe_policy *p, uint64_t pass_id) {
    pyb_call(p, PYB_PASS, "(K)", (unsigned long long)pass_id);
}

static int32_t pyb_victim(smoe_policy *p, smoe_evictable_fn ok, void *ctx) {
    pyb_state *st = p->state;
    /* The candidates are computed before taking the GIL, so evictable() (which may look at
     * caller state) is never called with the GIL held. */
    uint32_t n = 0;
    for (uint32_t s = 0; s < p->nslots; s++)
        if (st->resident[s] && (!ok || ok(ctx, s))) st->cand[n++] = s;
    if (n == 0) return -1;
    int32_t ans = -1;
    PyGILState_STATE g = PyGILState_Ensure();
    PyObject *cand = PyList_New(n), *r = NULL;
    if (!cand) goto fail;
    for (uint32_t i = 0; i < n; i++) {
        PyObject *v = PyLong_FromUnsignedLong(st->cand[i]);
        if (!v) goto fail;
        PyList_SET_ITEM(cand, i, v);
    }
    r = PyObject_CallOneArg(st->meth[PYB_VICTIM], cand);
    if (!r) goto fail;
    long v = PyLong_Check(r) ? PyLong_AsLong(r) : -1;
    if (v == -1 && PyErr_Occurred()) goto fail;
    int found = 0;
    if (PyLong_Check(r))
        for (uint32_t i = 0; i < n && !found; i++) found = (long)st->cand[i] == v;
    if (!found) {
        if (p->failure.code == 0) {
            PyObject *rs = PyObject_Repr(r);
            const char *m = rs ? PyUnicode_AsUTF8(rs) : NULL;
            if (!m) PyErr_Clear();
            smoe_err_set(&p->failure, SMOE_EPOLICY, "python policy: victim returned %s, which "
                         "is not one of the %" PRIu32 " candidate slots it was given",
                         m ? m : "(unprintable)", n);
            Py_XDECREF(rs);
        }
        goto done;
    }
    ans = (int32_t)v;
    goto done;
fail:
    pyb_fail_exc(p, "victim");
done:
    Py_XDECREF(cand);
    Py_XDECREF(r);
    PyErr_Clear();
    PyGILState_Release(g);
    return ans;
}

/* on_counts(keys: list[int], counts: list[int]) when the object defines it. */
static void pyb_counts(smoe_policy *p, const int32_t *keys, const uint32_t *counts, uint32_t n) {
    pyb_state *st = p->state;
    if (!st->meth[PYB_COUNTS]) return;
    PyGILState_STATE g = PyGILState_Ensure();
    PyObject *k = PyList_New(n), *c = PyList_New(n), *r = NULL;
    if (!k || !c) goto fail;
    for (uint32_t i = 0; i < n; i++) {
        PyObject *a = PyLong_FromLong(keys[i]), *b = PyLong_FromUnsignedLong(counts[i]);
        if (!a || !b) {
            Py_XDECREF(a);
            Py_XDECREF(b);
            goto fail;
        }
        PyList_SET_ITEM(k, i, a);
        PyList_SET_ITEM(c, i, b);
    }
    r = PyObject_CallFunctionObjArgs(st->meth[PYB_COUNTS], k, c, NULL);
    if (r) goto done;
fail:
    pyb_fail_exc(p, "on_counts");
done:
    Py_XDECREF(k);
    Py_XDECREF(c);
    Py_XDECREF(r);
    PyGILState_Release(g);
}

/* utility(key) -> int >= 0; a raise or a bad answer is recorded as the policy's failure
 * (p->failure is the one field a const policy may change: callers check it after). */
static int32_t pyb_utility(const smoe_policy *cp, int32_t key) {
    smoe_policy *p = (smoe_policy *)cp;
    pyb_state *st = p->state;
    if (!st->meth[PYB_UTILITY]) return -1;
    PyGILState_STATE g = PyGILState_Ensure();
    int32_t ans = -1;
    PyObject *r = PyObject_CallFunction(st->meth[PYB_UTILITY], "i", (int)key);
    long v = r && PyLong_Check(r) && !PyBool_Check(r) ? PyLong_AsLong(r) : -1;
    if (!r || (v == -1 && PyErr_Occurred())) {
        pyb_fail_exc(p, "utility");
    } else if (v < 0 || v > INT32_MAX || !PyLong_Check(r) || PyBool_Check(r)) {
        if (p->failure.code == 0)
            smoe_err_set(&p->failure, SMOE_EPOLICY, "python policy: utility(%d) must return an "
                         "int in 0..2^31-1", (int)key);
    } else {
        ans = (int32_t)v;
    }
    Py_XDECREF(r);
    PyErr_Clear();
    PyGILState_Release(g);
    return ans;
}

static const smoe_policy_ops smoe_policy_python = {
    .name = "python",
    .init = pyb_init,
    .free = pyb_free,
    .on_insert = pyb_insert,
    .on_access = pyb_access,
    .on_evict = pyb_evict,
    .on_pass = pyb_pass,
    .victim = pyb_victim,
    .on_counts = pyb_counts,
};

/* The same for an object that defines utility(key). */
static const smoe_policy_ops smoe_policy_python_utility = {
    .name = "python",
    .init = pyb_init,
    .free = pyb_free,
    .on_insert = pyb_insert,
    .on_access = pyb_access,
    .on_evict = pyb_evict,
    .on_pass = pyb_pass,
    .victim = pyb_victim,
    .on_counts = pyb_counts,
    .utility = pyb_utility,
};

smoe_policy *smoe_py_bridge_create(PyObject *obj, const smoe_policy_params *params) {
    smoe_policy *p = calloc(1, sizeof *p);
    pyb_state *st = calloc(1, sizeof *st);
    uint8_t *res = calloc(params->nslots, 1);
    uint32_t *cand = malloc(params->nslots * sizeof *cand);
    if (!p || !st || !res || !cand) {
        free(p);
        free(st);
        free(res);
        free(cand);
        PyErr_NoMemory();
        return NULL;
    }
    st->resident = res;
    st->cand = cand;
    p->ops = &smoe_policy_python;
    p->state = st;
    p->nslots = params->nslots;
    p->num_layers = params->num_layers;
    p->num_experts = params->num_experts;
    Py_INCREF(obj);
    st->obj = obj;
    for (int i = 0; i < PYB_N; i++) {
        PyObject *m = PyObject_GetAttrString(obj, pyb_names[i]);
        if (!m) {
            if (!PyErr_ExceptionMatches(PyExc_AttributeError)) goto fail;
            PyErr_Clear();
            continue;
        }
        if (m == Py_None) {
            Py_DECREF(m);
            continue;
        }
        if (!PyCallable_Check(m)) {
            PyErr_Format(PyExc_TypeError, "python policy: %s of %R is not callable",
                         pyb_names[i], obj);
            Py_DECREF(m);
            goto fail;
        }
        st->meth[i] = m;
    }
    if (!st->meth[PYB_VICTIM]) {
        PyErr_Format(PyExc_TypeError, "python policy: %R has no victim(candidates) method", obj);
        goto fail;
    }
    if (st->meth[PYB_UTILITY]) p->ops = &smoe_policy_python_utility;
    return p;
fail:
    smoe_policy_destroy(p);
    return NULL;
}

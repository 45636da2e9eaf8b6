/* Python binding of the simulator: _C.simulate (see sim.h for the model, specmoe/sim/replay.py for
 * the public wrapper). */
#include "py_numpy.h"
#include "py_policy.h"
#include "sim.h"

#include <stdlib.h>
#include <string.h>

static PyArrayObject *as_array(PyObject *o, int type, int ndim, const char *what) {
    PyArrayObject *a = (PyArrayObject *)PyArray_FROMANY(o, type, ndim, ndim,
                                                         NPY_ARRAY_IN_ARRAY);
    if (!a) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError, "simulate: %s must be a %d-dimensional array convertible "
                     "to %s", what, ndim, type == NPY_INT16 ? "int16" : "float32");
    }
    return a;
}

static int set_item(PyObject *d, const char *k, PyObject *v) {
    if (!v) return -1;
    int rc = PyDict_SetItemString(d, k, v);
    Py_DECREF(v);
    return rc;
}

static PyObject *result_dict(const smoe_sim_result *r) {
    PyObject *d = PyDict_New();
    if (!d) return NULL;
#define U(f) set_item(d, #f, PyLong_FromUnsignedLongLong(r->f))
#define F(f) set_item(d, #f, PyFloat_FromDouble(r->f))
    if (U(accesses) || U(hits) || U(misses) || U(collision_misses) || U(evictions) ||
        U(prefetch_issued) || U(prefetch_used) || U(prefetch_late) || U(prefetch_wasted) ||
        U(prefetch_dropped) || U(prefetch_refused) || U(predicted) || U(predicted_true) ||
        U(next_true) ||
        F(stall_s) || F(compute_s) || F(total_s) || F(elapsed_s) || U(missing) || U(dropped) ||
        U(substituted) || U(lowbit) || U(lowbit2) || U(protected_evictions) ||
        U(hybrid_copied) || U(hybrid_cpu) || U(hybrid_admitted) || F(hybrid_cpu_wait_s)) {
        Py_DECREF(d);
        return NULL;
    }
#undef U
#undef F
    return d;
}

PyDoc_STRVAR(simulate_doc,
"simulate(experts, num_experts, policy, nslots, *, logits=None, predictor=0, depth=1, topk=0,\n"
"         percentile=0.0, history=16, cooc_weight=0.8, expert_bytes, fast_bw, link_bw,\n"
"         link_latency_s, layer_fixed_s=0.0, token_fixed_s=0.0, seed=0, order=0, levels=0,\n"
"         verify_tokens=1, miss=0, miss_keep=0, lowbit_ratio=1.0, gamma=-1,\n"
"         miss_keep2=top_k, lowbit2_ratio=1.0, protect=False, model=None,\n"
"         admission=0, cpu_expert_s=0.0, prior_table=None, prior_rows=None) -> dict\n\n"
"Replay a routing trace (experts: int16 [tokens, layers, top_k]) through a cache of nslots\n"
"slots.  policy is a built-in name (created here; belady gets the trace's future, random\n"
"`seed`, least_stale `order`, spac/spac_ema `levels`, spac `gamma` = draft length, -1 = 8)\n"
"or a _C.Policy (taken: it cannot be used again).\n"
"verify_tokens g > 1: each pass verifies g consecutive tokens (union of their experts per\n"
"layer; on_counts before the pass; demand only, see csrc/sim.h).  predictor:\n"
"0 none, 1 oracle, 2 router (needs logits float32 [tokens, layers, num_experts]), 3 history,\n"
"4 learned (the nextuse model's q; model= NextUseModel.flat(), None: built-in temporal).\n"
"miss: 0 fetch, 1 drop (ranks >= miss_keep), 2 substitute, 3 lowest_bit (compute\n"
"lowbit_ratio of an expert's), 4 priority (ranks >= miss_keep as lowest_bit, the others\n"
"fetched; ranks >= miss_keep2 from a second copy costing lowbit2_ratio), 5 hybrid (missing\n"
"experts split between copies and the CPU, cpu_expert_s the CPU's time per expert and\n"
"token), see smoe_sim_miss in csrc/sim.h.\n"
"protect: the expert lookahead buffer's eviction shield (demand only; csrc/sim.h).\n"
"admission: prefetch admission by expected benefit (csrc/admit.h), the live caches' rule:\n"
"    0 off, 1 on, 2 on without its byte budget (the time-only rule).\n"
"prior_table (float32 [n, layers * num_experts]) and prior_rows (int32 [tokens], -1 none):\n"
"token t's prior for the policy and the learned predictor (policy.h on_prior).\n"
"Returns the counters and times of smoe_sim_result (see csrc/sim.h).  Releases the GIL.");

static PyObject *py_simulate(PyObject *self, PyObject *args, PyObject *kw) {
    (void)self;
    static char *kwlist[] = {"experts", "num_experts", "policy", "nslots", "logits", "predictor",
                             "depth", "topk", "percentile", "history", "cooc_weight",
                             "expert_bytes", "fast_bw", "link_bw", "link_latency_s",
                             "layer_fixed_s", "token_fixed_s", "seed", "order", "levels",
                             "verify_tokens", "miss", "miss_keep", "lowbit_ratio", "gamma",
                             "miss_keep2", "lowbit2_ratio", "protect", "model",
                             "admission", "cpu_expert_s", "prior_table", "prior_rows",
                             NULL};
    PyObject *experts_o, *policy_o, *logits_o = Py_None, *model_o = Py_None;
    PyObject *ptab_o = Py_None, *prows_o = Py_None;
    long long num_experts, nslots;
    int predictor = 0, order = 0;
    long long depth = 1, topk = 0, history = 16;
    double percentile = 0.0, cooc_weight = 0.8;
    double expert_bytes = -1, fast_bw = -1, link_bw = -1, link_latency_s = -1;
    double layer_fixed_s = 0.0, token_fixed_s = 0.0;
    unsigned long long seed = 0;
    int levels = 0;
    long long verify_tokens = 1, gamma = -1;
    int miss = 0;
    unsigned int miss_keep = 0, miss_keep2 = UINT32_MAX;
    double lowbit_ratio = 1.0, lowbit2_ratio = 1.0, cpu_expert_s = 0.0;
    int protect = 0, admission = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OLOL|$OiLLdLdddddddKiiLiIdLIdpOidOO", kwlist, &experts_o,
                                     &num_experts, &policy_o, &nslots, &logits_o, &predictor,
                                     &depth, &topk, &percentile, &history, &cooc_weight,
                                     &expert_bytes, &fast_bw, &link_bw, &link_latency_s,
                                     &layer_fixed_s, &token_fixed_s, &seed, &order, &levels,
                                     &verify_tokens, &miss, &miss_keep, &lowbit_ratio,
                                     &gamma, &miss_keep2, &lowbit2_ratio, &protect, &model_o,
                                     &admission, &cpu_expert_s, &ptab_o, &prows_o))
        return NULL;
    if (gamma < -1 || gamma > 65536) {
        PyErr_Format(PyExc_ValueError, "simulate: gamma (spac's draft length) must be in "
                     "0..65536 or -1 (default), got %lld", gamma);
        return NULL;
    }
    if (admission < 0 || admission > 2) {
        PyErr_Format(PyExc_ValueError, "simulate: admission must be 0 (off), 1 (on) or 2 (on "
                     "without its byte budget), got %d", admission);
        return NULL;
    }
    if (verify_tokens < 1 || verify_tokens > 65536) {
        PyErr_Format(PyExc_ValueError, "simulate: verify_tokens (tokens per pass) must be in "
                     "1..65536, got %lld", verify_tokens);
        return NULL;
    }
    if (expert_bytes < 0 || fast_bw < 0 || link_bw < 0 || link_latency_s < 0) {
        PyErr_SetString(PyExc_TypeError, "simulate: expert_bytes, fast_bw, link_bw and "
                        "link_latency_s are required (non-negative)");
        return NULL;
    }
    if (num_experts < 1 || num_experts > 32768) {
        PyErr_Format(PyExc_ValueError, "simulate: num_experts must be in 1..32768, got %lld",
                     num_experts);
        return NULL;
    }
    if (nslots < 1 || nslots > (long long)UINT32_MAX) {
        PyErr_Format(PyExc_ValueError, "simulate: nslots must be a positive slot count, got %lld",
                     nslots);
        return NULL;
    }
    if (depth < 1 || depth > 4096 || topk < 0 || topk > num_experts || history < 1 ||
        history > (long long)UINT32_MAX) {
        PyErr_Format(PyExc_ValueError, "simulate: need depth in 1..4096, topk in 0..%lld and "
                     "history >= 1 (got %lld, %lld, %lld)", num_experts, depth, topk, history);
        return NULL;
    }
    PyArrayObject *ex = as_array(experts_o, NPY_INT16, 3, "experts");
    if (!ex) return NULL;
    PyArrayObject *lg = NULL, *mod = NULL, *ptab = NULL, *prows = NULL;
    smoe_policy *pol = NULL;
    int32_t *future = NULL;
    PyObject *ret = NULL;
    npy_intp *dims = PyArray_DIMS(ex);
    if (dims[1] < 1 || dims[2] < 1 || dims[2] > num_experts ||
        (long long)dims[1] * num_experts > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "simulate: experts has shape (%lld, %lld, %lld): need at "
                     "least one layer and 1..num_experts (%lld) experts per token",
                     (long long)dims[0], (long long)dims[1], (long long)dims[2], num_experts);
        goto done;
    }
    if (logits_o != Py_None) {
        lg = as_array(logits_o, NPY_FLOAT32, 3, "logits");
        if (!lg) goto done;
        npy_intp *ld = PyArray_DIMS(lg);
        if (ld[0] != dims[0] || ld[1] != dims[1] || ld[2] != num_experts) {
            PyErr_Format(PyExc_ValueError, "simulate: logits shape (%lld, %lld, %lld) does not "
                         "match (tokens, layers, num_experts) = (%lld, %lld, %lld)",
                         (long long)ld[0], (long long)ld[1], (long long)ld[2],
                         (long long)dims[0], (long long)dims[1], num_experts);
            goto done;
        }
    }
    if ((ptab_o == Py_None) != (prows_o == Py_None)) {
        PyErr_SetString(PyExc_ValueError, "simulate: prior_table and prior_rows go together");
        goto done;
    }
    if (ptab_o != Py_None) {
        ptab = as_array(ptab_o, NPY_FLOAT32, 2, "prior_table");
        if (!ptab) goto done;
        prows = as_array(prows_o, NPY_INT32, 1, "prior_rows");
        if (!prows) goto done;
        if (PyArray_DIM(ptab, 1) != dims[1] * (npy_intp)num_experts ||
            PyArray_DIM(prows, 0) != dims[0]) {
            PyErr_Format(PyExc_ValueError, "simulate: prior_table must be [n, %lld] and "
                         "prior_rows [%lld], got [%lld, %lld] and [%lld]",
                         (long long)(dims[1] * num_experts), (long long)dims[0],
                         (long long)PyArray_DIM(ptab, 0), (long long)PyArray_DIM(ptab, 1),
                         (long long)PyArray_DIM(prows, 0));
            goto done;
        }
    }
    smoe_sim_trace tr = {
        .experts = (const int16_t *)PyArray_DATA(ex),
        .logits = lg ? (const float *)PyArray_DATA(lg) : NULL,
        .num_tokens = (uint64_t)dims[0],
        .num_layers = (uint32_t)dims[1],
        .top_k = (uint32_t)dims[2],
        .num_experts = (uint32_t)num_experts,
        .verify_tokens = (uint32_t)verify_tokens,
        .protect = (uint32_t)protect,
        .prior_table = ptab ? (const float *)PyArray_DATA(ptab) : NULL,
        .prior_rows = prows ? (const int32_t *)PyArray_DATA(prows) : NULL,
        .prior_n = ptab ? (uint64_t)PyArray_DIM(ptab, 0) : 0,
    };
    smoe_err err;
    smoe_err_clear(&err);
    if (PyUnicode_Check(policy_o)) {
        const char *name = PyUnicode_AsUTF8(policy_o);
        if (!name) goto done;
        uint64_t n = (uint64_t)dims[0] * (uint64_t)dims[1] * (uint64_t)dims[2];
        smoe_policy_params params = {.nslots = (uint32_t)nslots, .num_layers = tr.num_layers,
                                     .num_experts = tr.num_experts, .seed = seed,
                                     .order = order, .levels = levels,
                                     .theta0 = gamma < 0 ? 0 : gamma < 2 ? 1 : (int32_t)(gamma / 2)};
        if (strcmp(name, "belady") == 0) {
            future = malloc((n ? n : 1) * sizeof *future);
            if (!future) {
                PyErr_NoMemory();
                goto done;
            }
            const int16_t *e = tr.experts;
            for (uint64_t i = 0; i < n; i++)
                future[i] = (int32_t)(((i / tr.top_k) % tr.num_layers) * tr.num_experts) + e[i];
            params.future = future;
            params.future_len = n;
        }
        if (smoe_policy_create_named(&pol, name, &params, &err) < 0) {
            smoe_py_raise(&err);
            goto done;
        }
    } else {
        pol = smoe_py_policy_take(policy_o, (uint32_t)nslots, tr.num_layers, tr.num_experts);
        if (!pol) goto done;
    }
    smoe_sim_prefetch pf = {.predictor = predictor, .depth = (uint32_t)depth,
                            .topk = (uint32_t)topk, .percentile = percentile,
                            .history = (uint32_t)history, .cooc_weight = cooc_weight,
                            .admission = admission};
    if (model_o != Py_None) { /* the learned predictor's model (NextUseModel.flat()) */
        mod = (PyArrayObject *)PyArray_FROM_OTF(model_o, NPY_FLOAT64, NPY_ARRAY_IN_ARRAY);
        if (!mod) goto done;
        if (PyArray_NDIM(mod) != 1) {
            PyErr_SetString(PyExc_ValueError, "simulate: model must be a 1-D float array "
                            "(NextUseModel.flat())");
            goto done;
        }
        pf.model = PyArray_DATA(mod);
        pf.model_len = (uint64_t)PyArray_DIM(mod, 0);
    }
    smoe_sim_hw hw = {.expert_bytes = expert_bytes, .fast_bw = fast_bw, .link_bw = link_bw,
                      .link_latency_s = link_latency_s, .layer_fixed_s = layer_fixed_s,
                      .token_fixed_s = token_fixed_s};
    smoe_sim_miss mh = {.mode = miss, .keep = miss_keep, .lowbit_ratio = lowbit_ratio,
                        .keep2 = miss_keep2, .lowbit2_ratio = lowbit2_ratio,
                        .cpu_expert_s = cpu_expert_s};
    smoe_sim_result res;
    int rc;
    Py_BEGIN_ALLOW_THREADS
    rc = smoe_sim_run_miss(&tr, pol, (uint32_t)nslots, &pf, &hw, &mh, &res, &err);
    Py_END_ALLOW_THREADS
    if (rc < 0) {
        if (!PyErr_Occurred()) smoe_py_raise(&err);
        goto done;
    }
    ret = result_dict(&res);
done:
    smoe_policy_destroy(pol);
    free(future);
    Py_XDECREF(lg);
    Py_XDECREF(mod);
    Py_XDECREF(ptab);
    Py_XDECREF(prows);
    Py_DECREF(ex);
    return ret;
}

static PyMethodDef sim_methods[] = {
    {"simulate", (PyCFunction)(void (*)(void))py_simulate, METH_VARARGS | METH_KEYWORDS,
     simulate_doc},
    {NULL, NULL, 0, NULL},
};

int smoe_py_sim_init(PyObject *m) {
    return PyModule_AddFunctions(m, sim_methods);
}

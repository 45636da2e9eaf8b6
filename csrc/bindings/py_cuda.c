/* specmoe._cuda: the CPython binding of the GPU tier (cuda/gpu.h, cuda/gcache.h).
 *
 * A separate extension from specmoe._C: only this module links the CUDA runtime (statically)
 * and cuBLAS, so `import specmoe` never needs CUDA.  Loaded lazily by specmoe/runtime/cuda.py, which
 * preloads libcublas and turns import failures into a clear message.
 *
 * Device memory is passed as integer addresses (torch.Tensor.data_ptr()), streams as integer
 * cudaStream_t handles (torch.cuda.Stream.cuda_stream; 0 = legacy default stream): this module
 * allocates no tensors itself.  Errors map to the exceptions of specmoe._C (ValueError,
 * MemoryError, StoreError, CacheError, PolicyError) and to CudaError (a SpecmoeError) for
 * CUDA failures.  The GIL is released around every call into the cache or a kernel launch.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#include <cuda_runtime_api.h>

#include "gcache.h"
#include "gpu.h"
#include "gtier.h"
#include "py_bridge.h"
#include "py_desc.h"
#include "py_errors.h"
#include "py_tier.h"

static PyObject *Err_Base, *Err_Store, *Err_Cache, *Err_Policy, *Err_Cuda; /* set at init */

/* csrc/bindings/py_errors.h's mapping (the one specmoe._C uses), CUDA failures (SMOE_EDEVICE) to
 * CudaError; it used to classify SMOE_ESTATE by searching the message for "CUDA" or "GPU",
 * which also sent the GPU cache's state errors ("... in the GPU cache") to CudaError. */
static PyObject *raise_err(const smoe_err *e) {
    const smoe_py_errors x = {Err_Base, Err_Store, Err_Cache, Err_Policy, Err_Cuda};
    return smoe_py_errors_raise(&x, e, "specmoe._cuda: unknown error");
}

/* ---- descriptor ---------------------------------------------------------------------------- */

/* The shared parser (py_desc.h), then what the GPU kernels (cuda/ffn.cu) do not take. */
static int parse_desc(PyObject *d, smoe_ffn_desc *out) {
    if (smoe_py_ffn_desc_parse(d, 0, out) < 0) return -1;
    if (smoe_wdt_cpu_only(out->dtype)) {
        PyErr_SetString(PyExc_ValueError, "int2 and GGUF block expert weights run on the CPU "
                        "only (the GPU kernels take f32, bf16, int8 and int4)");
        return -1;
    }
    return 0;
}

/* ---- module functions ----------------------------------------------------------------------- */

static PyObject *py_device_count(PyObject *self, PyObject *noargs) {
    (void)self;
    (void)noargs;
    int n = 0;
    smoe_err e;
    smoe_err_clear(&e);
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = smoe_gpu_device_count(&n, &e);
    Py_END_ALLOW_THREADS if (rc < 0) return raise_err(&e);
    return PyLong_FromLong(n);
}

static PyObject *py_device_info(PyObject *self, PyObject *arg) {
    (void)self;
    long dev = PyLong_AsLong(arg);
    if (dev == -1 && PyErr_Occurred()) return NULL;
    char name[256];
    int major = 0, minor = 0;
    uint64_t mem = 0;
    smoe_err e;
    smoe_err_clear(&e);
    if (smoe_gpu_device_info((int)dev, name, sizeof name, &major, &minor, &mem, &e) < 0)
        return raise_err(&e);
    return Py_BuildValue("{s:s,s:(ii),s:K}", "name", name, "capability", major, minor,
                         "total_memory", (unsigned long long)mem);
}

static PyObject *py_memcpy_async(PyObject *self, PyObject *args) {
    (void)self;
    unsigned long long dst, src, n, stream = 0;
    if (!PyArg_ParseTuple(args, "KKK|K", &dst, &src, &n, &stream)) return NULL;
    if (!dst || !src) {
        PyErr_SetString(PyExc_ValueError, "memcpy_async: null address");
        return NULL;
    }
    cudaError_t e;
    Py_BEGIN_ALLOW_THREADS e = cudaMemcpyAsync((void *)(uintptr_t)dst, (const void *)(uintptr_t)src,
                                               (size_t)n, cudaMemcpyDefault,
                                               (cudaStream_t)(uintptr_t)stream);
    Py_END_ALLOW_THREADS if (e != cudaSuccess) {
        PyErr_Format(Err_Cuda, "CUDA error in cudaMemcpyAsync: %s", cudaGetErrorString(e));
        return NULL;
    }
    Py_RETURN_NONE;
}

/* ---- FFN type ------------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    smoe_gpu_ffn f;
    int ready;
    int busy; /* [GIL] a forward is running with the GIL released */
} FFNObject;

static int FFN_init(FFNObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"device", "H", "I", "max_tokens", NULL};
    int device = 0;
    unsigned int H = 0, I = 0, maxt = 256;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iII|I", kwlist, &device, &H, &I, &maxt))
        return -1;
    if (self->ready) {
        PyErr_SetString(PyExc_RuntimeError, "FFN.__init__ called twice");
        return -1;
    }
    smoe_err e;
    smoe_err_clear(&e);
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = smoe_gpu_ffn_init(&self->f, device, H, I, maxt, &e);
    Py_END_ALLOW_THREADS if (rc < 0) {
        raise_err(&e);
        return -1;
    }
    self->ready = 1;
    return 0;
}

static void FFN_dealloc(FFNObject *self) {
    if (self->ready) smoe_gpu_ffn_free(&self->f);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *FFN_forward(FFNObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"desc", "block", "x", "x_stride", "rows", "scale", "T", "out",
                             "out_stride", "path", "stream", NULL};
    PyObject *desc;
    unsigned long long block, x, rows, scale, out, stream = 0;
    Py_ssize_t xs, os;
    unsigned int T;
    int path = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OKKnKKIKn|iK", kwlist, &desc, &block, &x, &xs,
                                     &rows, &scale, &T, &out, &os, &path, &stream))
        return NULL;
    if (!self->ready) {
        PyErr_SetString(PyExc_RuntimeError, "FFN not initialised");
        return NULL;
    }
    if (!block || !x || !out) {
        PyErr_SetString(PyExc_ValueError, "block, x and out must be non-null device addresses");
        return NULL;
    }
    if (xs <= 0 || os <= 0) {
        PyErr_SetString(PyExc_ValueError, "x_stride and out_stride must be positive");
        return NULL;
    }
    if (self->busy) {
        PyErr_SetString(PyExc_RuntimeError, "FFN.forward: this context is in use by another "
                        "thread (one context per thread)");
        return NULL;
    }
    smoe_ffn_desc d;
    if (parse_desc(desc, &d) < 0) return NULL;
    smoe_err e;
    smoe_err_clear(&e);
    int rc;
    self->busy = 1;
    Py_BEGIN_ALLOW_THREADS rc = smoe_gpu_ffn_forward(
        &self->f, &d, (const uint8_t *)(uintptr_t)block, (const float *)(uintptr_t)x,
        (size_t)xs, (const int32_t *)(uintptr_t)rows, (const float *)(uintptr_t)scale, T,
        (float *)(uintptr_t)out, (size_t)os, path, (void *)(uintptr_t)stream, &e);
    Py_END_ALLOW_THREADS self->busy = 0;
    if (rc < 0) return raise_err(&e);
    Py_RETURN_NONE;
}

static PyMethodDef FFN_methods[] = {
    {"forward", (PyCFunction)(void (*)(void))FFN_forward, METH_VARARGS | METH_KEYWORDS,
     "forward(desc, block, x, x_stride, rows, scale, T, out, out_stride, path=0, stream=0):\n"
     "out[rows[t]] += scale[t] * FFN(x[rows[t]]) on the GPU (device addresses; 0 for rows or\n"
     "scale means none).  path: 0 auto, 1 dequantizing kernels, 2 cuBLAS (f32/bf16)."},
    {NULL, NULL, 0, NULL}};

static PyTypeObject FFN_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "specmoe._cuda.FFN",
    .tp_basicsize = sizeof(FFNObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "FFN(device, H, I, max_tokens=256): GPU expert FFN context (cuBLAS handle and\n"
              "scratch for max_tokens tokens, allocated once).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)FFN_init,
    .tp_dealloc = (destructor)FFN_dealloc,
    .tp_methods = FFN_methods,
};

/* ---- GpuCache type -------------------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    smoe_store store;
    smoe_gcache cache;
    int store_open, ready, closed;
    int busy; /* [GIL] calls in flight with the GIL released */
} GCacheObject;

/* A policy from a built-in name, or the Python bridge (py_bridge.h, the CPU cache's own) over
 * an object with a victim(candidates) method: specmoe.PythonPolicy or any such object. */
static smoe_policy *make_policy(PyObject *spec, uint32_t nslots, uint32_t nl, uint32_t ne) {
    const smoe_policy_params pp = {.nslots = nslots, .num_layers = nl, .num_experts = ne};
    if (!PyUnicode_Check(spec)) {
        int has = PyObject_HasAttrString(spec, "victim");
        if (!has) {
            PyErr_Format(PyExc_TypeError, "policy must be a built-in policy name or an object "
                         "with a victim(candidates) method (specmoe.PythonPolicy), got %s",
                         Py_TYPE(spec)->tp_name);
            return NULL;
        }
        return smoe_py_bridge_create(spec, &pp);
    }
    const char *name = PyUnicode_AsUTF8(spec);
    if (!name) return NULL;
    smoe_policy *p = NULL;
    smoe_err e;
    smoe_err_clear(&e);
    if (smoe_policy_create_named(&p, name, &pp, &e) < 0) {
        raise_err(&e);
        return NULL;
    }
    return p;
}

static int GC_init(GCacheObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"path", "data_offset", "block_bytes", "num_layers", "num_experts",
                             "nslots", "policy", "device", "mode", "stages", "min_slots",
                             "prefetch", "crc", NULL};
    PyObject *path_bytes = NULL, *crc_obj = Py_None, *policy = NULL;
    unsigned long long off, bb;
    unsigned int nl, ne, nslots, stages = 2, min_slots = 1;
    const char *mode = "host";
    int device = 0, prefetch = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O&KKIII|OisIIpO", kwlist, PyUnicode_FSConverter,
                                     &path_bytes, &off, &bb, &nl, &ne, &nslots, &policy, &device,
                                     &mode, &stages, &min_slots, &prefetch, &crc_obj))
        return -1;
    int rc = -1;
    Py_buffer view = {0};
    int have_view = 0;
    if (self->ready || self->store_open) {
        PyErr_SetString(PyExc_RuntimeError, "GpuCache.__init__ called twice");
        goto done;
    }
    int m;
    if (strcmp(mode, "host") == 0) m = SMOE_GC_HOSTCOPY;
    else if (strcmp(mode, "staged") == 0) m = SMOE_GC_STAGED;
    else {
        PyErr_Format(PyExc_ValueError, "mode must be 'host' (pinned copy of the store in host "
                     "memory) or 'staged' (store reads into pinned staging buffers), got '%s'",
                     mode);
        goto done;
    }
    const uint32_t *crc = NULL;
    if (crc_obj != Py_None) {
        if (PyObject_GetBuffer(crc_obj, &view, PyBUF_C_CONTIGUOUS) < 0) goto done;
        have_view = 1;
        if ((uint64_t)view.len != (uint64_t)nl * ne * 4 || (uintptr_t)view.buf % 4) {
            PyErr_Format(PyExc_ValueError, "crc must hold one aligned uint32 per block (%llu "
                         "bytes), got %zd", (unsigned long long)nl * ne * 4, view.len);
            goto done;
        }
        crc = view.buf;
    }
    smoe_err e;
    smoe_err_clear(&e);
    if (smoe_store_open(&self->store, PyBytes_AS_STRING(path_bytes), off, bb, nl, ne, crc,
                        crc ? SMOE_STORE_VERIFY : 0, &e) < 0) {
        raise_err(&e);
        goto done;
    }
    self->store_open = 1;
    smoe_policy *p = NULL;
    if (policy) {
        p = make_policy(policy, nslots, nl, ne);
    } else {
        PyObject *lru = PyUnicode_FromString("lru");
        if (lru) p = make_policy(lru, nslots, nl, ne);
        Py_XDECREF(lru);
    }
    if (!p) goto done;
    int crc2;
    Py_BEGIN_ALLOW_THREADS crc2 = smoe_gcache_init(&self->cache, &self->store, device, nslots,
                                                   min_slots, p, m, stages, prefetch, &e);
    Py_END_ALLOW_THREADS if (crc2 < 0) {
        smoe_policy_destroy(p);
        raise_err(&e);
        goto done;
    }
    self->ready = 1;
    rc = 0;
done:
    if (rc < 0 && self->store_open) {
        smoe_store_close(&self->store);
        self->store_open = 0;
    }
    if (have_view) PyBuffer_Release(&view);
    Py_XDECREF(path_bytes);
    return rc;
}

static void GC_shutdown(GCacheObject *self) {
    if (self->ready) {
        Py_BEGIN_ALLOW_THREADS smoe_gcache_free(&self->cache);
        Py_END_ALLOW_THREADS self->ready = 0;
    }
    if (self->store_open) {
        smoe_store_close(&self->store);
        self->store_open = 0;
    }
}

static void GC_dealloc(GCacheObject *self) {
    GC_shutdown(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int GC_check(GCacheObject *self) {
    if (!self->ready || self->closed) {
        PyErr_SetString(Err_Cache, "the GPU cache is closed");
        return -1;
    }
    return 0;
}

static PyObject *GC_close(GCacheObject *self, PyObject *noargs) {
    (void)noargs;
    if (self->busy) {
        PyErr_SetString(Err_Cache, "close() while another thread is inside a GPU cache call");
        return NULL;
    }
    self->closed = 1;
    GC_shutdown(self);
    Py_RETURN_NONE;
}

static PyObject *GC_acquire(GCacheObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"layer", "expert", "stream", NULL};
    unsigned int layer, expert;
    unsigned long long stream = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "II|K", kwlist, &layer, &expert, &stream))
        return NULL;
    if (GC_check(self) < 0) return NULL;
    const uint8_t *data = NULL;
    smoe_err e;
    smoe_err_clear(&e);
    int rc;
    self->busy++;
    Py_BEGIN_ALLOW_THREADS rc = smoe_gcache_acquire(&self->cache, layer, expert,
                                                    (void *)(uintptr_t)stream, &data, &e);
    Py_END_ALLOW_THREADS self->busy--;
    if (rc < 0) return raise_err(&e);
    return PyLong_FromUnsignedLongLong((unsigned long long)(uintptr_t)data);
}

static PyObject *GC_release(GCacheObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"layer", "expert", "stream", NULL};
    unsigned int layer, expert;
    unsigned long long stream = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "II|K", kwlist, &layer, &expert, &stream))
        return NULL;
    if (GC_check(self) < 0) return NULL;
    smoe_err e;
    smoe_err_clear(&e);
    int rc;
    self->busy++;
    Py_BEGIN_ALLOW_THREADS rc = smoe_gcache_release(&self->cache, layer, expert,
                                                    (void *)(uintptr_t)stream, &e);
    Py_END_ALLOW_THREADS self->busy--;
    if (rc < 0) return raise_err(&e);
    Py_RETURN_NONE;
}

static PyObject *GC_begin_pass(GCacheObject *self, PyObject *noargs) {
    (void)noargs;
    if (GC_check(self) < 0) return NULL;
    self->busy++;
    Py_BEGIN_ALLOW_THREADS smoe_slots_begin_pass(&self->cache.tab);
    Py_END_ALLOW_THREADS self->busy--;
    Py_RETURN_NONE;
}

/* keys (and values) from a sequence of ints into a new malloc'd int64 list. */
static long long *seq_ints(PyObject *obj, const char *what, Py_ssize_t *n) {
    PyObject *seq = PySequence_Fast(obj, what);
    if (!seq) return NULL;
    *n = PySequence_Fast_GET_SIZE(seq);
    long long *v = PyMem_Malloc((size_t)(*n ? *n : 1) * sizeof *v);
    if (!v) {
        Py_DECREF(seq);
        PyErr_NoMemory();
        return NULL;
    }
    for (Py_ssize_t i = 0; i < *n; i++) {
        v[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
        if (v[i] == -1 && PyErr_Occurred()) {
            PyErr_Format(PyExc_TypeError, "%s must hold ints", what);
            PyMem_Free(v);
            Py_DECREF(seq);
            return NULL;
        }
    }
    Py_DECREF(seq);
    return v;
}

static PyObject *GC_prefetch(GCacheObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"keys", "priorities", "replace", NULL};
    PyObject *ko, *po = Py_None;
    int replace = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O|Op", kwlist, &ko, &po, &replace)) return NULL;
    if (GC_check(self) < 0) return NULL;
    Py_ssize_t n = 0;
    long long *k = seq_ints(ko, "keys", &n);
    if (!k) return NULL;
    int32_t *keys = PyMem_Malloc((size_t)(n ? n : 1) * sizeof *keys);
    float *pr = PyMem_Malloc((size_t)(n ? n : 1) * sizeof *pr);
    PyObject *res = NULL;
    if (!keys || !pr) {
        PyErr_NoMemory();
        goto done;
    }
    PyObject *pseq = NULL;
    if (po != Py_None) {
        pseq = PySequence_Fast(po, "priorities must be a sequence");
        if (!pseq) goto done;
        if (PySequence_Fast_GET_SIZE(pseq) != n) {
            Py_DECREF(pseq);
            PyErr_SetString(PyExc_ValueError, "keys and priorities differ in length");
            goto done;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (k[i] < INT32_MIN || k[i] > INT32_MAX) {
            Py_XDECREF(pseq);
            PyErr_Format(PyExc_ValueError, "prefetch key %lld out of range", k[i]);
            goto done;
        }
        keys[i] = (int32_t)k[i];
        pr[i] = 0.0f;
        if (pseq) {
            double v = PyFloat_AsDouble(PySequence_Fast_GET_ITEM(pseq, i));
            if (v == -1.0 && PyErr_Occurred()) {
                Py_DECREF(pseq);
                goto done;
            }
            pr[i] = (float)v;
        }
    }
    Py_XDECREF(pseq);
    smoe_err e;
    smoe_err_clear(&e);
    int rc;
    self->busy++;
    Py_BEGIN_ALLOW_THREADS rc = smoe_slots_prefetch(&self->cache.tab, keys, pr, (uint32_t)n,
                                                     replace, &e);
    Py_END_ALLOW_THREADS self->busy--;
    if (rc < 0) {
        raise_err(&e);
        goto done;
    }
    res = Py_None;
    Py_INCREF(res);
done:
    PyMem_Free(k);
    PyMem_Free(keys);
    PyMem_Free(pr);
    return res;
}

static PyObject *GC_cancel(GCacheObject *self, PyObject *args) {
    int key = -1;
    if (!PyArg_ParseTuple(args, "|i", &key)) return NULL;
    if (GC_check(self) < 0) return NULL;
    self->busy++;
    Py_BEGIN_ALLOW_THREADS smoe_slots_cancel(&self->cache.tab, key);
    Py_END_ALLOW_THREADS self->busy--;
    Py_RETURN_NONE;
}

/* layer_states(layer) -> bytes of num_experts SMOE_SLOT_* states (0 absent, 1 loading,
 * 2 ready): a snapshot, taken without loading anything (the MoE-SpAc balancer's miss set). */
static PyObject *GC_layer_states(GCacheObject *self, PyObject *arg) {
    if (GC_check(self) < 0) return NULL;
    long layer = PyLong_AsLong(arg);
    if (layer == -1 && PyErr_Occurred()) return NULL;
    if (layer < 0 || (unsigned long)layer >= self->cache.tab.num_layers) {
        PyErr_Format(PyExc_ValueError, "layer_states: layer %ld of %u", layer,
                     self->cache.tab.num_layers);
        return NULL;
    }
    PyObject *b = PyBytes_FromStringAndSize(NULL, (Py_ssize_t)self->cache.tab.num_experts);
    if (!b) return NULL;
    smoe_err e;
    smoe_err_clear(&e);
    int rc;
    uint8_t *states = (uint8_t *)PyBytes_AS_STRING(b);
    self->busy++;
    Py_BEGIN_ALLOW_THREADS rc = smoe_slots_layer_states(&self->cache.tab, (uint32_t)layer,
                                                        states, &e);
    Py_END_ALLOW_THREADS self->busy--;
    if (rc < 0) {
        Py_DECREF(b);
        return raise_err(&e);
    }
    return b;
}

static PyObject *GC_wait_idle(GCacheObject *self, PyObject *noargs) {
    (void)noargs;
    if (GC_check(self) < 0) return NULL;
    smoe_err e;
    smoe_err_clear(&e);
    int rc;
    self->busy++;
    Py_BEGIN_ALLOW_THREADS rc = smoe_gcache_wait_idle(&self->cache, &e);
    if (rc == 0) rc = smoe_slots_take_worker_error(&self->cache.tab, &e);
    Py_END_ALLOW_THREADS self->busy--;
    if (rc < 0) return raise_err(&e);
    Py_RETURN_NONE;
}

static PyObject *GC_pause_worker(GCacheObject *self, PyObject *arg) {
    int p = PyObject_IsTrue(arg);
    if (p < 0) return NULL;
    if (GC_check(self) < 0) return NULL;
    self->busy++;
    Py_BEGIN_ALLOW_THREADS smoe_slots_pause_worker(&self->cache.tab, p);
    Py_END_ALLOW_THREADS self->busy--;
    Py_RETURN_NONE;
}

static PyObject *GC_stats(GCacheObject *self, PyObject *noargs) {
    (void)noargs;
    if (GC_check(self) < 0) return NULL;
    smoe_gcache_stats s;
    self->busy++;
    Py_BEGIN_ALLOW_THREADS smoe_gcache_get_stats(&self->cache, &s);
    Py_END_ALLOW_THREADS self->busy--;
    const smoe_cache_stats *t = &s.c;
    return Py_BuildValue(
        "{s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:d}", "hits",
        (unsigned long long)t->hits, "misses", (unsigned long long)t->misses, "collision_misses",
        (unsigned long long)t->collision_misses, "prefetch_issued",
        (unsigned long long)t->prefetch_issued, "prefetch_used",
        (unsigned long long)t->prefetch_used, "prefetch_late",
        (unsigned long long)t->prefetch_late, "prefetch_wasted",
        (unsigned long long)t->prefetch_wasted, "prefetch_dropped",
        (unsigned long long)t->prefetch_dropped, "prefetch_refused",
        (unsigned long long)t->prefetch_refused, "prefetch_failed",
        (unsigned long long)t->prefetch_failed, "evictions", (unsigned long long)t->evictions,
        "bytes_read", (unsigned long long)t->bytes_read, "inflight_hits",
        (unsigned long long)s.inflight_hits, "protected_evictions",
        (unsigned long long)t->protected_evictions, "stall_s", t->stall_s);
}

static PyObject *GC_reset_stats(GCacheObject *self, PyObject *noargs) {
    (void)noargs;
    if (GC_check(self) < 0) return NULL;
    self->busy++;
    Py_BEGIN_ALLOW_THREADS smoe_gcache_reset_stats(&self->cache);
    Py_END_ALLOW_THREADS self->busy--;
    Py_RETURN_NONE;
}

static PyObject *GC_set_admission(GCacheObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"on", "byte_budget", NULL};
    int on = 0, budget = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "p|p:set_admission", kwlist, &on, &budget) ||
        GC_check(self) < 0)
        return NULL;
    self->busy++;
    Py_BEGIN_ALLOW_THREADS smoe_slots_set_admission(&self->cache.tab, on, budget);
    Py_END_ALLOW_THREADS self->busy--;
    Py_RETURN_NONE;
}

static PyObject *GC_set_throttle(GCacheObject *self, PyObject *args) {
    double bw, lat;
    if (!PyArg_ParseTuple(args, "dd:set_throttle", &bw, &lat) || GC_check(self) < 0)
        return NULL;
    smoe_err e;
    smoe_err_clear(&e);
    int rc = smoe_gcache_set_throttle(&self->cache, bw, lat, &e); /* its own short lock */
    if (rc < 0) return raise_err(&e);
    Py_RETURN_NONE;
}

static PyObject *GC_resident(GCacheObject *self, PyObject *noargs) {
    (void)noargs;
    if (GC_check(self) < 0) return NULL;
    int32_t *keys = PyMem_Malloc((size_t)self->cache.tab.nslots * sizeof *keys);
    if (!keys) return PyErr_NoMemory();
    uint32_t n;
    self->busy++;
    Py_BEGIN_ALLOW_THREADS n = smoe_slots_resident(&self->cache.tab, keys);
    Py_END_ALLOW_THREADS self->busy--;
    PyObject *l = PyList_New(n);
    for (uint32_t i = 0; l && i < n; i++) PyList_SET_ITEM(l, i, PyLong_FromLong(keys[i]));
    PyMem_Free(keys);
    return l;
}

static PyObject *GC_queued(GCacheObject *self, PyObject *noargs) {
    (void)noargs;
    if (GC_check(self) < 0) return NULL;
    const size_t cap = (size_t)self->cache.tab.num_layers * self->cache.tab.num_experts;
    int32_t *keys = PyMem_Malloc(cap * sizeof *keys);
    float *prios = PyMem_Malloc(cap * sizeof *prios);
    if (!keys || !prios) {
        PyMem_Free(keys), PyMem_Free(prios);
        return PyErr_NoMemory();
    }
    uint32_t n;
    self->busy++;
    Py_BEGIN_ALLOW_THREADS n = smoe_slots_queued(&self->cache.tab, keys, prios);
    Py_END_ALLOW_THREADS self->busy--;
    PyObject *l = PyList_New(n);
    for (uint32_t i = 0; l && i < n; i++) {
        PyObject *t = Py_BuildValue("(id)", (int)keys[i], (double)prios[i]);
        if (!t) {
            Py_CLEAR(l);
            break;
        }
        PyList_SET_ITEM(l, i, t);
    }
    PyMem_Free(keys), PyMem_Free(prios);
    return l;
}

static PyObject *GC_set_policy(GCacheObject *self, PyObject *arg) {
    if (GC_check(self) < 0) return NULL;
    smoe_policy *p = make_policy(arg, self->cache.tab.nslots, self->cache.tab.num_layers,
                                 self->cache.tab.num_experts);
    if (!p) return NULL;
    smoe_err e;
    smoe_err_clear(&e);
    int rc;
    self->busy++;
    Py_BEGIN_ALLOW_THREADS rc = smoe_slots_set_policy(&self->cache.tab, p, &e);
    Py_END_ALLOW_THREADS self->busy--;
    if (rc < 0) return raise_err(&e);
    Py_RETURN_NONE;
}

static PyObject *GC_counts(GCacheObject *self, PyObject *args) {
    PyObject *ko, *co;
    if (!PyArg_ParseTuple(args, "OO", &ko, &co)) return NULL;
    if (GC_check(self) < 0) return NULL;
    Py_ssize_t n = 0, m = 0;
    long long *k = seq_ints(ko, "keys", &n);
    if (!k) return NULL;
    long long *c = seq_ints(co, "counts", &m);
    PyObject *res = NULL;
    int32_t *keys = NULL;
    uint32_t *cnt = NULL;
    if (!c) goto done;
    if (n != m) {
        PyErr_SetString(PyExc_ValueError, "keys and counts differ in length");
        goto done;
    }
    keys = PyMem_Malloc((size_t)(n ? n : 1) * sizeof *keys);
    cnt = PyMem_Malloc((size_t)(n ? n : 1) * sizeof *cnt);
    if (!keys || !cnt) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (k[i] < INT32_MIN || k[i] > INT32_MAX || c[i] < 0 || c[i] > UINT32_MAX) {
            PyErr_SetString(PyExc_ValueError, "counts: key or count out of range");
            goto done;
        }
        keys[i] = (int32_t)k[i];
        cnt[i] = (uint32_t)c[i];
    }
    smoe_err e;
    smoe_err_clear(&e);
    int rc;
    self->busy++;
    Py_BEGIN_ALLOW_THREADS rc = smoe_slots_counts(&self->cache.tab, keys, cnt, (uint32_t)n, &e);
    Py_END_ALLOW_THREADS self->busy--;
    if (rc < 0) {
        raise_err(&e);
        goto done;
    }
    res = Py_None;
    Py_INCREF(res);
done:
    PyMem_Free(k);
    PyMem_Free(c);
    PyMem_Free(keys);
    PyMem_Free(cnt);
    return res;
}

/* protect(keys): the lookahead buffer's keys, evicted last (smoe_slots_set_protected, the
 * rule the CPU cache uses); an empty sequence clears the set. */
static PyObject *GC_protect(GCacheObject *self, PyObject *ko) {
    if (GC_check(self) < 0) return NULL;
    Py_ssize_t n = 0;
    long long *k = seq_ints(ko, "keys", &n);
    if (!k) return NULL;
    PyObject *res = NULL;
    int32_t *keys = PyMem_Malloc((size_t)(n ? n : 1) * sizeof *keys);
    if (!keys) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        if (k[i] < INT32_MIN || k[i] > INT32_MAX) {
            PyErr_SetString(PyExc_ValueError, "protect: key out of range");
            goto done;
        }
        keys[i] = (int32_t)k[i];
    }
    smoe_err e;
    smoe_err_clear(&e);
    int rc;
    self->busy++;
    Py_BEGIN_ALLOW_THREADS rc = smoe_slots_set_protected(&self->cache.tab, keys, (uint32_t)n, &e);
    Py_END_ALLOW_THREADS self->busy--;
    if (rc < 0) {
        raise_err(&e);
        goto done;
    }
    res = Py_None;
    Py_INCREF(res);
done:
    PyMem_Free(k);
    PyMem_Free(keys);
    return res;
}

static PyObject *GC_get_nslots(GCacheObject *self, void *cl) {
    (void)cl;
    return PyLong_FromUnsignedLong(self->ready ? self->cache.tab.nslots : 0);
}
static PyObject *GC_get_slot_bytes(GCacheObject *self, void *cl) {
    (void)cl;
    return PyLong_FromUnsignedLongLong(self->ready ? self->cache.tab.slot_bytes : 0);
}
static PyObject *GC_get_device(GCacheObject *self, void *cl) {
    (void)cl;
    return PyLong_FromLong(self->ready ? self->cache.device : 0);
}
static PyObject *GC_get_slab(GCacheObject *self, void *cl) {
    (void)cl;
    return PyLong_FromUnsignedLongLong(self->ready ? (uintptr_t)self->cache.slab : 0);
}

/* Address of the pinned host copy of the store (block of key k at host_copy + k * slot_bytes)
 * in "host" mode; 0 in "staged" mode or when closed. */
static PyObject *GC_get_host_copy(GCacheObject *self, void *cl) {
    (void)cl;
    return PyLong_FromUnsignedLongLong(
        self->ready && !self->closed ? (uintptr_t)self->cache.host_copy : 0);
}

static PyMethodDef GC_methods[] = {
    {"acquire", (PyCFunction)(void (*)(void))GC_acquire, METH_VARARGS | METH_KEYWORDS,
     "acquire(layer, expert, stream=0) -> device address of the pinned block"},
    {"release", (PyCFunction)(void (*)(void))GC_release, METH_VARARGS | METH_KEYWORDS,
     "release(layer, expert, stream=0): record the slot's free event on stream, unpin"},
    {"begin_pass", (PyCFunction)GC_begin_pass, METH_NOARGS, "start the next forward pass"},
    {"prefetch", (PyCFunction)(void (*)(void))GC_prefetch, METH_VARARGS | METH_KEYWORDS,
     "prefetch(keys, priorities=None, replace=False)"},
    {"cancel", (PyCFunction)GC_cancel, METH_VARARGS, "cancel(key=-1)"},
    {"wait_idle", (PyCFunction)GC_wait_idle, METH_NOARGS,
     "wait for the prefetch queue and the copy stream; raises the first prefetch error"},
    {"pause_worker", (PyCFunction)GC_pause_worker, METH_O, "pause_worker(paused)"},
    {"queued", (PyCFunction)GC_queued, METH_NOARGS,
     "queued() -> [(key, priority)]: the prefetch queue in the worker's order (a snapshot)"},
    {"stats", (PyCFunction)GC_stats, METH_NOARGS, "counters (dict)"},
    {"reset_stats", (PyCFunction)GC_reset_stats, METH_NOARGS, "zero the counters"},
    {"set_admission", (PyCFunction)(void (*)(void))GC_set_admission,
     METH_VARARGS | METH_KEYWORDS,
     "set_admission(on, byte_budget=True): prefetch admission by expected benefit "
     "(csrc/admit.h), with its byte budget or the time terms alone"},
    {"set_throttle", (PyCFunction)GC_set_throttle, METH_VARARGS,
     "set_throttle(bytes_per_s, latency_s): emulate a slower link for every load (0, 0: off)"},
    {"resident", (PyCFunction)GC_resident, METH_NOARGS, "keys of the READY slots, slot order"},
    {"layer_states", (PyCFunction)GC_layer_states, METH_O,
     "layer_states(layer) -> bytes: each expert's slot state (0 absent, 1 loading, 2 ready)"},
    {"set_policy", (PyCFunction)GC_set_policy, METH_O, "set_policy(policy): swap (a built-in name or a Python policy object), keep contents"},
    {"counts", (PyCFunction)GC_counts, METH_VARARGS, "counts(keys, counts): activation counts"},
    {"protect", (PyCFunction)GC_protect, METH_O,
     "protect(keys): evicted last, after every unprotected evictable slot ([]: clear)"},
    {"close", (PyCFunction)GC_close, METH_NOARGS, "stop the worker, free device memory"},
    {NULL, NULL, 0, NULL}};

static PyGetSetDef GC_getset[] = {
    {"nslots", (getter)GC_get_nslots, NULL, "number of slots", NULL},
    {"slot_bytes", (getter)GC_get_slot_bytes, NULL, "bytes per slot (one store block)", NULL},
    {"device", (getter)GC_get_device, NULL, "CUDA device (-1: host emulation)", NULL},
    {"slab", (getter)GC_get_slab, NULL, "address of slot 0 (device memory)", NULL},
    {"host_copy", (getter)GC_get_host_copy, NULL,
     "address of the pinned host copy of the store (\"host\" mode; 0 otherwise)", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyTypeObject GC_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "specmoe._cuda.GpuCache",
    .tp_basicsize = sizeof(GCacheObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "GpuCache(path, data_offset, block_bytes, num_layers, num_experts, nslots,\n"
              "policy='lru', device=0, mode='host', stages=2, min_slots=1, prefetch=True,\n"
              "crc=None): expert slots in GPU memory (device=-1: host emulation for tests).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)GC_init,
    .tp_dealloc = (destructor)GC_dealloc,
    .tp_methods = GC_methods,
    .tp_getset = GC_getset,
};

/* ---- Tier type: the GPU cache as an expert tier of specmoe._C.Layers (cuda/gtier.h) ------- */

typedef struct {
    PyObject_HEAD
    GCacheObject *cache; /* strong */
    smoe_gtier t;
    smoe_py_tier pt;     /* what the capsules point at (py_tier.h) */
    int ready;
} TierObject;

static int Tier_begin(PyObject *owner) {
    TierObject *self = (TierObject *)owner;
    if (!self->ready || GC_check(self->cache) < 0) {
        if (!PyErr_Occurred()) PyErr_SetString(Err_Cache, "the GPU tier is not initialised");
        return -1;
    }
    self->cache->busy++; /* close() of the cache is refused until Tier_end */
    return 0;
}

static void Tier_end(PyObject *owner) { ((TierObject *)owner)->cache->busy--; }

static int Tier_init(TierObject *self, PyObject *args, PyObject *kw) {
    static char *kwlist[] = {"cache", "H", "I", "grouped", NULL};
    PyObject *cache;
    unsigned int H, I;
    int grouped = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "O!II|p:Tier", kwlist, &GC_Type, &cache, &H, &I,
                                     &grouped))
        return -1;
    if (self->ready) {
        PyErr_SetString(PyExc_RuntimeError, "Tier.__init__ called twice");
        return -1;
    }
    GCacheObject *gc = (GCacheObject *)cache;
    if (GC_check(gc) < 0) return -1;
    smoe_err e;
    smoe_err_clear(&e);
    int rc;
    Py_BEGIN_ALLOW_THREADS rc = smoe_gtier_init(&self->t, &gc->cache, H, I, grouped, &e);
    Py_END_ALLOW_THREADS if (rc) {
        raise_err(&e);
        return -1;
    }
    Py_INCREF(cache);
    self->cache = gc;
    self->pt = (smoe_py_tier){smoe_gtier_tier(&self->t), (PyObject *)self, Tier_begin, Tier_end};
    self->ready = 1;
    return 0;
}

static void Tier_dealloc(TierObject *self) {
    if (self->ready) smoe_gtier_free(&self->t); /* no Layers uses it: they hold a capsule */
    Py_XDECREF(self->cache);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static void capsule_free(PyObject *cap) { Py_XDECREF((PyObject *)PyCapsule_GetContext(cap)); }

static PyObject *Tier_get_capsule(TierObject *self, void *cl) {
    (void)cl;
    if (!self->ready) {
        PyErr_SetString(PyExc_RuntimeError, "Tier not initialised");
        return NULL;
    }
    PyObject *cap = PyCapsule_New(&self->pt, SMOE_PY_TIER_CAPSULE, capsule_free);
    if (!cap) return NULL;
    Py_INCREF(self); /* the capsule keeps the tier (and so its cache) alive */
    if (PyCapsule_SetContext(cap, self) < 0) {
        Py_DECREF(self);
        Py_DECREF(cap);
        return NULL;
    }
    return cap;
}

static PyObject *Tier_get_grouped(TierObject *self, void *cl) {
    (void)cl;
    return PyBool_FromLong(self->ready && self->t.grouped);
}

static PyGetSetDef Tier_getset[] = {
    {"capsule", (getter)Tier_get_capsule, NULL,
     "a new capsule for specmoe._C.Layers(cache=...) (keeps this tier alive)", NULL},
    {"grouped", (getter)Tier_get_grouped, NULL,
     "whether a layer's experts of few tokens run as one launch group (cuda/gtier.h)", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

static PyTypeObject Tier_Type = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "specmoe._cuda.Tier",
    .tp_basicsize = sizeof(TierObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Tier(cache, H, I, grouped=True): the GPU cache as the expert tier of\n"
              "specmoe._C.Layers (cuda/gtier.h): one C call per MoE layer on the GPU (the host\n"
              "emulation when the cache's device is -1); grouped=False: one kernel call per\n"
              "expert instead of a launch group per layer (for A/B measurements).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Tier_init,
    .tp_dealloc = (destructor)Tier_dealloc,
    .tp_getset = Tier_getset,
};

/* ---- module --------------------------------------------------------------------------------- */

static PyMethodDef module_methods[] = {
    {"device_count", py_device_count, METH_NOARGS,
     "Number of CUDA devices; CudaError with the runtime's reason when there is no driver."},
    {"memcpy_async", py_memcpy_async, METH_VARARGS,
     "memcpy_async(dst, src, nbytes, stream=0): cudaMemcpyAsync(cudaMemcpyDefault) (tests)"},
    {"device_info", py_device_info, METH_O, "device_info(dev) -> {name, capability, memory}"},
    {NULL, NULL, 0, NULL}};

static struct PyModuleDef cuda_module = {
    PyModuleDef_HEAD_INIT, "specmoe._cuda",
    "specmoe GPU tier: expert FFN kernels (CUDA, cuBLAS) and the GPU expert cache.", -1,
    module_methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__cuda(void) {
    PyObject *c = PyImport_ImportModule("specmoe._C");
    if (!c) return NULL;
    Err_Base = PyObject_GetAttrString(c, "SpecmoeError");
    Err_Store = PyObject_GetAttrString(c, "StoreError");
    Err_Cache = PyObject_GetAttrString(c, "CacheError");
    Err_Policy = PyObject_GetAttrString(c, "PolicyError");
    Py_DECREF(c);
    if (!Err_Base || !Err_Store || !Err_Cache || !Err_Policy) return NULL;
    Err_Cuda = PyErr_NewExceptionWithDoc("specmoe.CudaError",
                                         "A CUDA or cuBLAS call failed, or no GPU is usable.",
                                         Err_Base, NULL);
    if (!Err_Cuda) return NULL;
    if (PyType_Ready(&FFN_Type) < 0 || PyType_Ready(&GC_Type) < 0 ||
        PyType_Ready(&Tier_Type) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&cuda_module);
    if (!m) return NULL;
    Py_INCREF(Err_Cuda);
    Py_INCREF(&FFN_Type);
    Py_INCREF(&GC_Type);
    Py_INCREF(&Tier_Type);
    if (PyModule_AddObject(m, "CudaError", Err_Cuda) < 0 ||
        PyModule_AddObject(m, "FFN", (PyObject *)&FFN_Type) < 0 ||
        PyModule_AddObject(m, "GpuCache", (PyObject *)&GC_Type) < 0 ||
        PyModule_AddObject(m, "Tier", (PyObject *)&Tier_Type) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}

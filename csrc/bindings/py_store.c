/* Python binding for the store area: the _C.Store type (wrapping smoe_store), the borrow
 * contract of py_store.h, and _C.crc32c.  The JSON header is parsed in specmoe/storage/store.py,
 * whose ExpertStore subclasses _C.Store and passes the numbers to Store.__init__. */
#include "py_numpy.h"
#include "py_store.h"

#include <string.h>

typedef struct {
    PyObject_HEAD
    smoe_store s;
    int is_open;      /* smoe_store_open succeeded and close has not run */
    int readers;      /* Store.read calls in flight with the GIL released */
    int borrows;      /* smoe_py_store_borrow calls not yet undone */
    PyObject *weakreflist;
} StoreObject;

static PyTypeObject StoreType;

static void store_close_now(StoreObject *self) {
    if (self->is_open) {
        smoe_store_close(&self->s);
        self->is_open = 0;
    }
}

static int Store_init(StoreObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"path", "data_offset", "block_bytes", "num_layers", "num_experts",
                             "crc", "direct", "verify", NULL};
    PyObject *path_bytes = NULL, *crc_obj = Py_None, *off_obj, *bb_obj;
    unsigned long long data_offset, block_bytes;
    long long num_layers, num_experts;
    int direct = 0, verify = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "O&O!O!LL|Opp", kwlist, PyUnicode_FSConverter,
                                     &path_bytes, &PyLong_Type, &off_obj, &PyLong_Type, &bb_obj,
                                     &num_layers, &num_experts, &crc_obj, &direct, &verify))
        return -1;
    /* Unsigned conversions that refuse negatives (OverflowError) instead of wrapping. */
    data_offset = PyLong_AsUnsignedLongLong(off_obj);
    if (data_offset == (unsigned long long)-1 && PyErr_Occurred()) {
        Py_DECREF(path_bytes);
        return -1;
    }
    block_bytes = PyLong_AsUnsignedLongLong(bb_obj);
    if (block_bytes == (unsigned long long)-1 && PyErr_Occurred()) {
        Py_DECREF(path_bytes);
        return -1;
    }
    int rc = -1;
    Py_buffer crc_view = {0};
    int have_view = 0;
    const char *path = PyBytes_AS_STRING(path_bytes);
    if (self->is_open || self->readers || self->borrows) {
        PyErr_Format(smoe_py_StoreError, "%s: Store.__init__ called on an open store", path);
        goto done;
    }
    if (num_layers <= 0 || num_layers > UINT32_MAX || num_experts <= 0 ||
        num_experts > UINT32_MAX) {
        PyErr_Format(PyExc_ValueError, "%s: num_layers %lld and num_experts %lld must be in 1..%u",
                     path, num_layers, num_experts, UINT32_MAX);
        goto done;
    }
    uint64_t nblocks = (uint64_t)num_layers * (uint64_t)num_experts;
    const uint32_t *crc = NULL;
    if (crc_obj != Py_None) {
        if (PyObject_GetBuffer(crc_obj, &crc_view, PyBUF_C_CONTIGUOUS) < 0) goto done;
        have_view = 1;
        if ((uint64_t)crc_view.len != nblocks * sizeof(uint32_t)) {
            PyErr_Format(PyExc_ValueError,
                         "%s: crc buffer has %zd bytes, expected %llu (one uint32 per block)",
                         path, crc_view.len, (unsigned long long)(nblocks * sizeof(uint32_t)));
            goto done;
        }
        crc = (const uint32_t *)crc_view.buf; /* copied by smoe_store_open; alignment: */
        if ((uintptr_t)crc % _Alignof(uint32_t) != 0) {
            PyErr_Format(PyExc_ValueError, "%s: crc buffer is not 4-byte aligned", path);
            goto done;
        }
    } else if (verify) {
        PyErr_Format(PyExc_ValueError, "%s: verify=True needs the block checksums (crc)", path);
        goto done;
    }
    int flags = (direct ? SMOE_STORE_DIRECT : 0) | (verify ? SMOE_STORE_VERIFY : 0);
    smoe_err err;
    smoe_err_clear(&err);
    int r;
    Py_BEGIN_ALLOW_THREADS
    r = smoe_store_open(&self->s, path, data_offset, block_bytes, (uint32_t)num_layers,
                        (uint32_t)num_experts, crc, flags, &err);
    Py_END_ALLOW_THREADS
    if (r != 0) {
        smoe_py_raise(&err);
        goto done;
    }
    self->is_open = 1;
    rc = 0;
done:
    if (have_view) PyBuffer_Release(&crc_view);
    Py_DECREF(path_bytes);
    return rc;
}

static void Store_dealloc(StoreObject *self) {
    if (self->weakreflist) PyObject_ClearWeakRefs((PyObject *)self);
    store_close_now(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int check_open(StoreObject *self) {
    if (!self->is_open) {
        PyErr_Format(smoe_py_StoreError, "%s: store is closed",
                     self->s.path[0] ? self->s.path : "<store>");
        return -1;
    }
    return 0;
}

/* A new 1-D uint8 array of n bytes whose data is SMOE_ALIGN-aligned (a view into a slightly
 * larger array, which it keeps alive as its base). */
static PyObject *aligned_bytes(uint64_t n) {
    npy_intp big = (npy_intp)(n + SMOE_ALIGN);
    PyArrayObject *base = (PyArrayObject *)PyArray_SimpleNew(1, &big, NPY_UINT8);
    if (!base) return NULL;
    char *p = PyArray_BYTES(base);
    size_t pad = (size_t)((SMOE_ALIGN - ((uintptr_t)p % SMOE_ALIGN)) % SMOE_ALIGN);
    npy_intp dims = (npy_intp)n;
    PyArray_Descr *d = PyArray_DescrFromType(NPY_UINT8);
    PyObject *view = PyArray_NewFromDescr(&PyArray_Type, d, 1, &dims, NULL, p + pad,
                                          NPY_ARRAY_CARRAY, NULL);
    if (!view) {
        Py_DECREF(base);
        return NULL;
    }
    if (PyArray_SetBaseObject((PyArrayObject *)view, (PyObject *)base) < 0) { /* steals base */
        Py_DECREF(view);
        return NULL;
    }
    return view;
}

static int parse_index(PyObject *o, const char *what, uint32_t limit, uint32_t *out) {
    long long v = PyLong_AsLongLong(o);
    if (v == -1 && PyErr_Occurred()) return -1;
    if (v < 0 || v >= (long long)limit) {
        PyErr_Format(PyExc_IndexError, "%s %lld out of range (store has %u)", what, v, limit);
        return -1;
    }
    *out = (uint32_t)v;
    return 0;
}

PyDoc_STRVAR(Store_read_doc,
             "read(layer, expert, out=None) -> numpy.ndarray\n\n"
             "Read block (layer, expert) into `out` (a writable C-contiguous buffer of exactly\n"
             "block_bytes bytes; 4096-aligned to use O_DIRECT) or into a new 4096-aligned uint8\n"
             "array, which is returned (or `out` itself).  Releases the GIL while reading.");

static PyObject *Store_read(StoreObject *self, PyObject *args, PyObject *kwds) {
    static char *kwlist[] = {"layer", "expert", "out", NULL};
    PyObject *lo, *eo, *out = Py_None;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "OO|O", kwlist, &lo, &eo, &out)) return NULL;
    if (check_open(self) < 0) return NULL;
    uint32_t layer, expert;
    if (parse_index(lo, "layer", self->s.num_layers, &layer) < 0 ||
        parse_index(eo, "expert", self->s.num_experts, &expert) < 0)
        return NULL;
    PyObject *result;
    Py_buffer view;
    if (out == Py_None) {
        result = aligned_bytes(self->s.block_bytes);
        if (!result) return NULL;
        if (PyObject_GetBuffer(result, &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
            Py_DECREF(result);
            return NULL;
        }
    } else {
        if (PyObject_GetBuffer(out, &view, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) return NULL;
        if ((uint64_t)view.len != self->s.block_bytes) {
            PyErr_Format(PyExc_ValueError, "%s: out has %zd bytes, a block has %llu",
                         self->s.path, view.len, (unsigned long long)self->s.block_bytes);
            PyBuffer_Release(&view);
            return NULL;
        }
        Py_INCREF(out);
        result = out;
    }
    smoe_err err;
    smoe_err_clear(&err);
    int r;
    self->readers++;
    Py_BEGIN_ALLOW_THREADS
    r = smoe_store_read(&self->s, layer, expert, view.buf, &err);
    Py_END_ALLOW_THREADS
    self->readers--;
    PyBuffer_Release(&view);
    if (r != 0) {
        Py_DECREF(result);
        return smoe_py_raise(&err);
    }
    return result;
}

static PyObject *Store_close(StoreObject *self, PyObject *unused) {
    (void)unused;
    if (self->readers || self->borrows) {
        PyErr_Format(smoe_py_StoreError,
                     "%s: cannot close: store in use (%d read(s) in flight, %d borrower(s) such "
                     "as a cache; close those first)",
                     self->s.path, self->readers, self->borrows);
        return NULL;
    }
    store_close_now(self);
    Py_RETURN_NONE;
}

static PyMethodDef Store_methods[] = {
    {"read", (PyCFunction)(void (*)(void))Store_read, METH_VARARGS | METH_KEYWORDS,
     Store_read_doc},
    {"close", (PyCFunction)Store_close, METH_NOARGS,
     "close() -> None\n\nClose the file (idempotent).  StoreError while a cache borrows it."},
    {NULL, NULL, 0, NULL}};

static PyObject *Store_get_path(StoreObject *self, void *c) {
    (void)c;
    return PyUnicode_DecodeFSDefault(self->s.path);
}
static PyObject *Store_get_num_layers(StoreObject *self, void *c) {
    (void)c;
    return PyLong_FromUnsignedLong(self->s.num_layers);
}
static PyObject *Store_get_num_experts(StoreObject *self, void *c) {
    (void)c;
    return PyLong_FromUnsignedLong(self->s.num_experts);
}
static PyObject *Store_get_block_bytes(StoreObject *self, void *c) {
    (void)c;
    return PyLong_FromUnsignedLongLong(self->s.block_bytes);
}
static PyObject *Store_get_data_offset(StoreObject *self, void *c) {
    (void)c;
    return PyLong_FromUnsignedLongLong(self->s.data_offset);
}
static PyObject *Store_get_direct(StoreObject *self, void *c) {
    (void)c;
    return PyBool_FromLong(self->is_open && smoe_store_is_direct(&self->s));
}
static PyObject *Store_get_verify(StoreObject *self, void *c) {
    (void)c;
    return PyBool_FromLong((self->s.flags & SMOE_STORE_VERIFY) != 0);
}
static PyObject *Store_get_bytes_read(StoreObject *self, void *c) {
    (void)c;
    return PyLong_FromUnsignedLongLong(__atomic_load_n(&self->s.bytes_read, __ATOMIC_RELAXED));
}
static PyObject *Store_get_closed(StoreObject *self, void *c) {
    (void)c;
    return PyBool_FromLong(!self->is_open);
}

static PyGetSetDef Store_getset[] = {
    {"path", (getter)Store_get_path, NULL, "Path of the store file.", NULL},
    {"num_layers", (getter)Store_get_num_layers, NULL, "Number of MoE layers.", NULL},
    {"num_experts", (getter)Store_get_num_experts, NULL, "Routed experts per layer.", NULL},
    {"block_bytes", (getter)Store_get_block_bytes, NULL, "Bytes per (layer, expert) block.",
     NULL},
    {"data_offset", (getter)Store_get_data_offset, NULL, "File offset of block (0, 0).", NULL},
    {"direct", (getter)Store_get_direct, NULL, "Whether reads currently use O_DIRECT.", NULL},
    {"verify", (getter)Store_get_verify, NULL, "Whether every read checks the CRC32C.", NULL},
    {"bytes_read", (getter)Store_get_bytes_read, NULL, "Bytes read from the file so far.", NULL},
    {"closed", (getter)Store_get_closed, NULL, "True once closed (or never opened).", NULL},
    {NULL, NULL, NULL, NULL, NULL}};

PyDoc_STRVAR(Store_doc,
             "Store(path, data_offset, block_bytes, num_layers, num_experts, crc=None, *,\n"
             "      direct=False, verify=True)\n\n"
             "Low-level reader of fixed-size expert blocks (see csrc/store.h).  `crc` is a\n"
             "buffer of num_layers*num_experts native uint32 CRC32C values (required when\n"
             "verify).  Use specmoe.ExpertStore, which parses the file header, instead.");

static PyTypeObject StoreType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "specmoe._C.Store",
    .tp_basicsize = sizeof(StoreObject),
    .tp_dealloc = (destructor)Store_dealloc,
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE,
    .tp_doc = Store_doc,
    .tp_weaklistoffset = offsetof(StoreObject, weakreflist),
    .tp_methods = Store_methods,
    .tp_getset = Store_getset,
    .tp_init = (initproc)Store_init,
    .tp_new = PyType_GenericNew,
};

smoe_store *smoe_py_store_get(PyObject *obj) {
    if (!PyObject_TypeCheck(obj, &StoreType)) {
        PyErr_Format(PyExc_TypeError, "expected a specmoe store (_C.Store / ExpertStore), got %s",
                     Py_TYPE(obj)->tp_name);
        return NULL;
    }
    StoreObject *so = (StoreObject *)obj;
    if (check_open(so) < 0) return NULL;
    return &so->s;
}

smoe_store *smoe_py_store_borrow(PyObject *obj) {
    smoe_store *s = smoe_py_store_get(obj);
    if (!s) return NULL;
    ((StoreObject *)obj)->borrows++;
    Py_INCREF(obj);
    return s;
}

void smoe_py_store_unborrow(PyObject *obj) {
    StoreObject *so = (StoreObject *)obj;
    if (so->borrows > 0) so->borrows--;
    Py_DECREF(obj);
}

/* ---- crc32c ---- */

static PyObject *crc_common(PyObject *args, PyObject *kwds, int portable) {
    static char *kwlist[] = {"data", "crc", NULL};
    Py_buffer view;
    long long crc = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "y*|L", kwlist, &view, &crc)) return NULL;
    if (crc < 0 || crc > (long long)UINT32_MAX) {
        PyBuffer_Release(&view);
        PyErr_Format(PyExc_ValueError, "crc %lld is not a 32-bit unsigned value", crc);
        return NULL;
    }
    uint32_t c = (uint32_t)crc;
    if (view.len >= (1 << 20)) {
        Py_BEGIN_ALLOW_THREADS
        c = portable ? smoe_crc32c_portable(c, view.buf, (size_t)view.len)
                     : smoe_crc32c(c, view.buf, (size_t)view.len);
        Py_END_ALLOW_THREADS
    } else {
        c = portable ? smoe_crc32c_portable(c, view.buf, (size_t)view.len)
                     : smoe_crc32c(c, view.buf, (size_t)view.len);
    }
    PyBuffer_Release(&view);
    return PyLong_FromUnsignedLong(c);
}

static PyObject *py_crc32c(PyObject *m, PyObject *args, PyObject *kwds) {
    (void)m;
    return crc_common(args, kwds, 0);
}

static PyObject *py_crc32c_portable(PyObject *m, PyObject *args, PyObject *kwds) {
    (void)m;
    return crc_common(args, kwds, 1);
}

static PyMethodDef store_functions[] = {
    {"crc32c", (PyCFunction)(void (*)(void))py_crc32c, METH_VARARGS | METH_KEYWORDS,
     "crc32c(data, crc=0) -> int\n\nCRC32C (Castagnoli) of a contiguous buffer, continuing "
     "from `crc` (hardware SSE4.2 path where available)."},
    {"_crc32c_portable", (PyCFunction)(void (*)(void))py_crc32c_portable,
     METH_VARARGS | METH_KEYWORDS,
     "_crc32c_portable(data, crc=0) -> int\n\nCRC32C through the table path only (tests)."},
    {NULL, NULL, 0, NULL}};

int smoe_py_store_init(PyObject *m) {
    if (PyModule_AddType(m, &StoreType) < 0) return -1;
    if (PyModule_AddFunctions(m, store_functions) < 0) return -1;
    return 0;
}

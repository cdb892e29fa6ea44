/* results.c: large CPU results that cring makes for the caller (the outputs
 * of the out-of-place allreduce, broadcast and reducescatter, the room of a
 * NumPy allgather) in blocks of
 * the process-wide result cache (common/result_cache.c): a ResultBlock owns
 * one block, lends it through the buffer protocol to the NumPy array or
 * torch tensor the caller gets, and hands it back to the cache once the last
 * array, tensor or view of it is gone. Allocates and wraps; no collectives. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include "../common/result_cache.h"
#include "pyext.h"

typedef struct {
    PyObject_HEAD void *data;
    Py_ssize_t len;
} ResultBlockObject;

static int ResultBlock_getbuffer(ResultBlockObject *self, Py_buffer *view, int flags) {
    return PyBuffer_FillInfo(view, (PyObject *)self, self->data, self->len, 0, flags);
}

/* The last view is gone (NumPy and torch hold the block while they view it):
 * the block goes back to the cache, on whichever thread drops it. */
static void ResultBlock_dealloc(ResultBlockObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    cring__result_block_put(self->data, (size_t)self->len);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyType_Slot ResultBlock_slots[] = {
    {Py_bf_getbuffer, ResultBlock_getbuffer},
    {Py_tp_dealloc, ResultBlock_dealloc},
    {Py_tp_doc, "Memory of one result from cring's result cache; given back when no view "
                "of it is left."},
    {0, NULL},
};
static PyType_Spec ResultBlock_spec = {"cring._C.ResultBlock", sizeof(ResultBlockObject), 0,
                                       Py_TPFLAGS_DEFAULT, ResultBlock_slots};

/* A ResultBlock of nbytes from the cache; NULL with MemoryError. */
static PyObject *block_new(module_state *s, size_t nbytes) {
    void *data;
    if (cring__result_block_get(nbytes, &data) != CRING_OK) return PyErr_NoMemory();
    ResultBlockObject *b = PyObject_New(ResultBlockObject, s->ResultBlockType);
    if (!b) {
        cring__result_block_put(data, nbytes);
        return NULL;
    }
    b->data = data;
    b->len = (Py_ssize_t)nbytes;
    return (PyObject *)b;
}

/* Attribute `name` of the already imported module `module_name`, looked up
 * once into *slot; NULL (no error) when the module is not imported. */
static PyObject *imported_attr(PyObject **slot, const char *module_name, const char *name) {
    if (*slot) return *slot;
    PyObject *key = PyUnicode_FromString(module_name);
    PyObject *mod = key ? PyImport_GetModule(key) : NULL;
    Py_XDECREF(key);
    if (mod) *slot = PyObject_GetAttrString(mod, name);
    Py_XDECREF(mod);
    if (!*slot) PyErr_Clear();
    return *slot;
}

int cring__pyext_result_empty(module_state *s, PyObject *x, int torch, PyObject *shape,
                              size_t nbytes, PyObject **made) {
    static PyObject *np_ndarray, *torch_frombuffer, *dtype_name, *view_name, *shape_name;
    *made = NULL;
    if (nbytes < CRING_RESULT_CACHE_MIN_BYTES) return 0;
    cring__result_cache_stats_t stats;
    cring__result_cache_stats(&stats);
    if (!stats.limit_bytes) return 0; /* CRING_RESULT_CACHE_BYTES=0: the caller's allocator */
    PyObject *maker = torch ? imported_attr(&torch_frombuffer, "torch", "frombuffer")
                            : imported_attr(&np_ndarray, "numpy", "ndarray");
    if (!maker) return 0;
    if ((!dtype_name && !(dtype_name = PyUnicode_InternFromString("dtype"))) ||
        (!view_name && !(view_name = PyUnicode_InternFromString("view"))) ||
        (!shape_name && !(shape_name = PyUnicode_InternFromString("shape"))))
        return -1;
    PyObject *dtype = PyObject_GetAttr(x, dtype_name);
    PyObject *own_shape = shape ? Py_NewRef(shape) : PyObject_GetAttr(x, shape_name);
    PyObject *block = dtype && own_shape ? block_new(s, nbytes) : NULL;
    PyObject *res = NULL;
    if (block && !torch) { /* numpy.ndarray(shape, dtype, buffer): base is the block */
        PyObject *args[3] = {own_shape, dtype, block};
        res = PyObject_Vectorcall(maker, args, 3, NULL);
    } else if (block) { /* torch.frombuffer(block, dtype=...).view(shape) */
        PyObject *kw = PyTuple_Pack(1, dtype_name);
        PyObject *args[2] = {block, dtype};
        PyObject *flat = kw ? PyObject_Vectorcall(maker, args, 1, kw) : NULL;
        Py_XDECREF(kw);
        if (flat) res = PyObject_CallMethodOneArg(flat, view_name, own_shape);
        Py_XDECREF(flat);
    }
    Py_XDECREF(block); /* the result holds it now, or it went back */
    Py_XDECREF(dtype);
    Py_XDECREF(own_shape);
    if (!res) return -1;
    *made = res;
    return 1;
}

/* result_empty(x, shape): see the method's doc. */
static PyObject *py_result_empty(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    static PyObject *itemsize_name, *is_cpu_name;
    if (nargs != 2 || !PyTuple_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "result_empty(x, shape): shape must be a tuple");
        return NULL;
    }
    PyObject *x = args[0], *shape = args[1];
    int torch = 0;
    if (!cring__dl_is_ndarray(x)) {
        if (!cring__dl_is_torch(x)) Py_RETURN_NONE;
        if (!is_cpu_name && !(is_cpu_name = PyUnicode_InternFromString("is_cpu"))) return NULL;
        PyObject *cpu = PyObject_GetAttr(x, is_cpu_name);
        if (!cpu) return NULL;
        int on_cpu = PyObject_IsTrue(cpu);
        Py_DECREF(cpu);
        if (on_cpu <= 0) return on_cpu < 0 ? NULL : Py_NewRef(Py_None);
        torch = 1;
    }
    if (!itemsize_name && !(itemsize_name = PyUnicode_InternFromString("itemsize"))) return NULL;
    PyObject *item = PyObject_GetAttr(x, itemsize_name);
    size_t nbytes = item ? PyLong_AsSize_t(item) : (size_t)-1;
    Py_XDECREF(item);
    if (nbytes == (size_t)-1 && PyErr_Occurred()) return NULL;
    for (Py_ssize_t d = 0; d < PyTuple_GET_SIZE(shape); d++) {
        size_t n = PyLong_AsSize_t(PyTuple_GET_ITEM(shape, d));
        if (n == (size_t)-1 && PyErr_Occurred()) return NULL;
        if (n && nbytes > SIZE_MAX / n) Py_RETURN_NONE; /* the caller's allocator says why */
        nbytes *= n;
    }
    PyObject *made;
    int rc = cring__pyext_result_empty(cring__pyext_state(module), x, torch, shape, nbytes, &made);
    if (rc < 0) return NULL;
    return rc ? made : Py_NewRef(Py_None);
}

/* result_cache_stats(): the cache's figures as a dict. */
static PyObject *py_result_cache_stats(PyObject *module, PyObject *unused) {
    cring__result_cache_stats_t st;
    cring__result_cache_stats(&st);
    return Py_BuildValue(
        "{s:n,s:n,s:n,s:n,s:K,s:K,s:K}", "limit_bytes", (Py_ssize_t)st.limit_bytes, "min_bytes",
        (Py_ssize_t)CRING_RESULT_CACHE_MIN_BYTES, "idle_bytes", (Py_ssize_t)st.idle_bytes,
        "lent_bytes", (Py_ssize_t)st.lent_bytes, "reused", (unsigned long long)st.reused, "mapped",
        (unsigned long long)st.mapped, "unmapped", (unsigned long long)st.unmapped);
}

static PyMethodDef result_functions[] = {
    {"result_empty", (PyCFunction)(void (*)(void))py_result_empty, METH_FASTCALL,
     "result_empty(x, shape)\n--\n\n"
     "A new, uninitialised NumPy array (x a numpy.ndarray) or CPU torch tensor of x's\n"
     "dtype and `shape` in a block of cring's result cache, or None when the result is\n"
     "smaller than the cache's minimum, the cache is off or x is of another kind."},
    {"result_cache_stats", py_result_cache_stats, METH_NOARGS,
     "result_cache_stats()\n--\n\n"
     "The result cache's limit, minimum, idle and lent bytes and its counters."},
    {NULL, NULL, 0, NULL}};

int cring__pyext_results_init(PyObject *module, module_state *s) {
    s->ResultBlockType = (PyTypeObject *)PyType_FromModuleAndSpec(module, &ResultBlock_spec, NULL);
    if (!s->ResultBlockType) return -1;
    return PyModule_AddFunctions(module, result_functions);
}

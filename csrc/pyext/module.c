/* module.c: cring._C, the only C file that includes Python.h. It reads tensors
 * through DLPack (no copy), maps cring statuses to Python exceptions, releases
 * the GIL around everything that can block, and keeps the communicator in
 * module state. It holds no collective logic of its own. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pythread.h>
#include <string.h>

#include "../common/common.h"
#include "../core/comm_internal.h"
#include "../reduce/reduce.h"
#include "cring/cring.h"
#include "dlpack_ingest.h"

/* ---- module state --------------------------------------------------------- */
typedef struct {
    cring_engine_t *engine;    /* NULL until init(); changed only with the GIL held */
    PyObject *CRingError;
    PyObject *TimeoutError;
    PyObject *PeerFailureError;
    PyObject *MismatchError;
    PyObject *NotInitializedError;
    PyTypeObject *StoreServerType;
    PyTypeObject *StoreClientType;
    PyTypeObject *OutputBufferType;
    PyTypeObject *HandleType;
    PyObject *allreduce_fallback; /* cring._api's allreduce_ for what allreduce_ hands back */
} module_state;

static module_state *get_state(PyObject *module) { return (module_state *)PyModule_GetState(module); }

/* One place that turns a cring status into a Python exception. */
static PyObject *raise_status(module_state *s, cring_status_t st, const char *context,
                              const char *detail) {
    PyObject *type;
    switch (st) {
    case CRING_ERR_INVALID_ARGUMENT: type = PyExc_ValueError; break;
    case CRING_ERR_NOT_SUPPORTED: type = PyExc_TypeError; break;
    case CRING_ERR_NO_MEMORY: type = PyExc_MemoryError; break;
    case CRING_ERR_TIMEOUT: type = s->TimeoutError; break;
    case CRING_ERR_PEER_FAILURE: type = s->PeerFailureError; break;
    case CRING_ERR_MISMATCH: type = s->MismatchError; break;
    default: type = s->CRingError; break;
    }
    if (detail && *detail)
        PyErr_Format(type, "%s: %s", context, detail);
    else
        PyErr_Format(type, "%s: %s", context, cring_status_string(st));
    return NULL;
}

static PyObject *raise_not_initialized(module_state *s) {
    PyErr_SetString(s->NotInitializedError,
                    "cring has not been initialized; call cring.init() first");
    return NULL;
}

/* ---- DLPack ingest (dlpack_ingest.c) ------------------------------------------ */
typedef cring__dl_ref_t tensor_ref;

/* A DLPack view of a CPU (or pinned host) tensor; see cring__dl_acquire. */
static int tensor_acquire(PyObject *obj, const char *name, int writable, tensor_ref *ref) {
    return cring__dl_acquire(obj, NULL, name, writable, CRING__DL_HOST, ref);
}

static void tensor_release(tensor_ref *ref) { cring__dl_release(ref); }

/* ---- init / shutdown / queries -------------------------------------------- */
static PyObject *py_init(PyObject *module, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"rank", "size", "addr", "port", "serve_store", "secret",
                             "job_key", "listen_addr", "transport", "timeout_s", NULL};
    module_state *s = get_state(module);
    cring_config_t cfg;
    cring_config_init(&cfg);
    const char *transport = "auto";
    int serve_store = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "iisip|zzzsd", kwlist, &cfg.rank, &cfg.size,
                                     &cfg.store_addr, &cfg.store_port, &serve_store, &cfg.secret,
                                     &cfg.job_key, &cfg.listen_addr, &transport, &cfg.timeout_s))
        return NULL;
    cfg.serve_store = serve_store;
    if (!strcmp(transport, "auto")) cfg.transport = CRING_TRANSPORT_AUTO;
    else if (!strcmp(transport, "tcp")) cfg.transport = CRING_TRANSPORT_TCP;
    else if (!strcmp(transport, "shm")) cfg.transport = CRING_TRANSPORT_SHM;
    else {
        PyErr_Format(PyExc_ValueError, "transport must be 'auto', 'tcp' or 'shm', got '%s'",
                     transport);
        return NULL;
    }
    if (s->engine) {
        PyErr_SetString(s->CRingError, "cring is already initialized; call shutdown() first");
        return NULL;
    }
    cring_comm_t *comm = NULL;
    cring_engine_t *engine = NULL;
    cring_status_t st;
    char detail[CRING__ERRMSG_BYTES];
    Py_BEGIN_ALLOW_THREADS
    st = cring_comm_init(&cfg, &comm);
    if (st != CRING_OK) snprintf(detail, sizeof detail, "%s", cring_last_init_error());
    else if ((st = cring_engine_start(comm, &engine)) != CRING_OK)
        snprintf(detail, sizeof detail, "%s", cring_engine_error_message());
    Py_END_ALLOW_THREADS
    if (st != CRING_OK) return raise_status(s, st, "cring.init failed", detail);
    s->engine = engine;
    Py_RETURN_NONE;
}

static PyObject *py_shutdown(PyObject *module, PyObject *unused) {
    module_state *s = get_state(module);
    cring_engine_t *engine = s->engine;
    s->engine = NULL; /* with the GIL held: no submission sees it any more */
    Py_BEGIN_ALLOW_THREADS
    cring_engine_stop(engine);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

static PyObject *py_is_initialized(PyObject *module, PyObject *unused) {
    return PyBool_FromLong(get_state(module)->engine != NULL);
}

static PyObject *py_topology(PyObject *module, PyObject *unused) {
    module_state *s = get_state(module);
    if (!s->engine) return raise_not_initialized(s);
    cring_comm_t *c = cring_engine_comm(s->engine);
    return Py_BuildValue("{s:i,s:i,s:i,s:i,s:i,s:i,s:s}", "rank", cring_comm_rank(c), "size",
                         cring_comm_size(c), "local_rank", cring_comm_local_rank(c),
                         "local_size", cring_comm_local_size(c), "cross_rank",
                         cring_comm_cross_rank(c), "cross_size", cring_comm_cross_size(c),
                         "transport", cring_comm_transport_name(c));
}

/* Describe a tensor as cring sees it: (shape, dtype name, read_only). */
static PyObject *py_tensor_info(PyObject *module, PyObject *args) {
    PyObject *obj;
    const char *name = "tensor";
    if (!PyArg_ParseTuple(args, "O|s", &obj, &name)) return NULL;
    tensor_ref ref;
    if (tensor_acquire(obj, name, 0, &ref) < 0) return NULL;
    PyObject *shape = PyTuple_New(ref.t->ndim);
    for (int i = 0; shape && i < ref.t->ndim; i++)
        PyTuple_SET_ITEM(shape, i, PyLong_FromLongLong(ref.t->shape[i]));
    PyObject *res = shape ? Py_BuildValue("(Nsi)", shape, cring_dtype_name(ref.dtype),
                                          (ref.flags & CRING_DL_FLAG_READ_ONLY) != 0)
                          : NULL;
    tensor_release(&ref);
    return res;
}

static int same_layout(const tensor_ref *a, const tensor_ref *b, const char *name) {
    if (a->dtype != b->dtype || a->numel != b->numel) {
        PyErr_Format(PyExc_ValueError,
                     "tensor '%s': output has %zu elements of %s, input %zu of %s", name,
                     b->numel, cring_dtype_name(b->dtype), a->numel, cring_dtype_name(a->dtype));
        return -1;
    }
    return 0;
}

/* ---- handles ------------------------------------------------------------------ */
/* A submitted request: the C handle plus the DLPack views that keep the
 * tensors' memory alive until the engine is done with them. */
typedef struct {
    PyObject_HEAD
    cring_handle_t *handle;
    tensor_ref *refs;
    int nrefs;
    int collective;
    char *name;
    int released;
} HandleObject;

static const char *collective_label(int c) {
    switch (c) {
    case CRING_COLL_ALLREDUCE: return "allreduce";
    case CRING_COLL_BROADCAST: return "broadcast";
    case CRING_COLL_ALLGATHER: return "allgather";
    case CRING_COLL_REDUCESCATTER: return "reducescatter";
    case CRING_COLL_ALLTOALL: return "alltoall";
    case CRING_COLL_JOIN: return "join";
    default: return "barrier";
    }
}

/* Wait (GIL released) and drop the tensor views. */
static cring_status_t handle_finish(HandleObject *self) {
    cring_status_t st;
    cring_handle_t *h = self->handle;
    if (!cring_handle_done(h)) {
        Py_BEGIN_ALLOW_THREADS
        st = cring_handle_wait(h);
        Py_END_ALLOW_THREADS
    } else {
        st = cring_handle_status(h);
    }
    if (!self->released) {
        for (int i = 0; i < self->nrefs; i++) tensor_release(&self->refs[i]);
        self->released = 1;
    }
    return st;
}

static PyObject *Handle_done(HandleObject *self, PyObject *unused) {
    return PyBool_FromLong(cring_handle_done(self->handle));
}

/* wait(): block until complete; raise the request's error, if any. */
static PyObject *raise_handle_error(module_state *s, cring_handle_t *h, cring_status_t st,
                                    int collective, const char *name);

static PyObject *Handle_wait(HandleObject *self, PyObject *unused) {
    cring_status_t st = handle_finish(self);
    if (st != CRING_OK)
        return raise_handle_error(PyType_GetModuleState(Py_TYPE(self)), self->handle, st,
                                  self->collective, self->name);
    Py_RETURN_NONE;
}

/* Result `index` of a completed allgather or alltoall (its bytes and, with
 * dims non-NULL, the first dimension from every rank), or NULL with
 * ValueError set. */
static const void *handle_result(HandleObject *self, int index, size_t *bytes,
                                 const int64_t **dims) {
    const void *src = cring_handle_done(self->handle)
                          ? cring_handle_output(self->handle, index, bytes, dims)
                          : NULL;
    if (!src)
        PyErr_SetString(PyExc_ValueError,
                        "no result to read (not complete, or not an allgather or alltoall)");
    return src;
}

/* copy_output(i, dst): copy allgather result i into tensor dst. */
static PyObject *Handle_copy_output(HandleObject *self, PyObject *args) {
    int index;
    PyObject *dst_obj;
    if (!PyArg_ParseTuple(args, "iO", &index, &dst_obj)) return NULL;
    size_t bytes;
    const void *src = handle_result(self, index, &bytes, NULL);
    if (!src) return NULL;
    tensor_ref dst;
    if (tensor_acquire(dst_obj, self->name, 1, &dst) < 0) return NULL;
    size_t have = dst.numel * cring_dtype_size(dst.dtype);
    if (have != bytes) {
        tensor_release(&dst);
        PyErr_Format(PyExc_ValueError, "allgather of '%s': output needs %zu bytes, got %zu",
                     self->name, bytes, have);
        return NULL;
    }
    if (bytes) memcpy(dst.data, src, bytes);
    tensor_release(&dst);
    Py_RETURN_NONE;
}

/* value(): after a join completes, the last rank to join. */
static PyObject *Handle_value(HandleObject *self, PyObject *unused) {
    if (!cring_handle_done(self->handle)) {
        PyErr_SetString(PyExc_ValueError, "the request has not completed");
        return NULL;
    }
    return PyLong_FromLongLong(cring_handle_value(self->handle));
}

/* ---- engine-allocated results, lent without a copy ------------------------- */
/* An allgather or alltoall result stays in memory the engine allocated; an
 * OutputBuffer exports it through the buffer protocol and keeps its handle
 * (and so the memory) alive for as long as any view of it exists. */
typedef struct {
    PyObject_HEAD
    PyObject *handle;
    void *data;
    Py_ssize_t len;
} OutputBufferObject;

static int OutputBuffer_getbuffer(OutputBufferObject *self, Py_buffer *view, int flags) {
    return PyBuffer_FillInfo(view, (PyObject *)self, self->data, self->len, 0, flags);
}

static void OutputBuffer_dealloc(OutputBufferObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    Py_XDECREF(self->handle);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyType_Slot OutputBuffer_slots[] = {
    {Py_bf_getbuffer, OutputBuffer_getbuffer},
    {Py_tp_dealloc, OutputBuffer_dealloc},
    {Py_tp_doc, "The bytes of one collective result, owned by its handle."},
    {0, NULL}};
static PyType_Spec OutputBuffer_spec = {"cring._C.OutputBuffer", sizeof(OutputBufferObject), 0,
                                        Py_TPFLAGS_DEFAULT, OutputBuffer_slots};

/* output_buffer(i): result i as a writable buffer (no copy). */
static PyObject *Handle_output_buffer(HandleObject *self, PyObject *args) {
    int index;
    if (!PyArg_ParseTuple(args, "i", &index)) return NULL;
    size_t bytes;
    const void *src = handle_result(self, index, &bytes, NULL);
    if (!src) return NULL;
    module_state *s = PyType_GetModuleState(Py_TYPE(self));
    OutputBufferObject *out = PyObject_New(OutputBufferObject, s->OutputBufferType);
    if (!out) return NULL;
    out->handle = Py_NewRef((PyObject *)self);
    out->data = (void *)src;
    out->len = (Py_ssize_t)bytes;
    return (PyObject *)out;
}

static void Handle_dealloc(HandleObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    if (self->handle) {
        handle_finish(self); /* the engine may still write into these tensors */
        cring_handle_free(self->handle);
    }
    PyMem_Free(self->refs);
    PyMem_Free(self->name);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyObject *Handle_get_name(HandleObject *self, void *closure) {
    return PyUnicode_FromString(self->name);
}

static PyMethodDef Handle_methods[] = {
    {"done", (PyCFunction)Handle_done, METH_NOARGS, "True once complete; never blocks."},
    {"wait", (PyCFunction)Handle_wait, METH_NOARGS, "Block until complete; raise its error."},
    {"copy_output", (PyCFunction)Handle_copy_output, METH_VARARGS,
     "copy_output(index, dst): copy an allgather or alltoall result into dst."},
    {"output_buffer", (PyCFunction)Handle_output_buffer, METH_VARARGS,
     "output_buffer(index): an allgather or alltoall result as a buffer, without a copy."},
    {"value", (PyCFunction)Handle_value, METH_NOARGS,
     "value(): after a join completes, the last rank to join."},
    {NULL}};
static PyGetSetDef Handle_getset[] = {{"name", (getter)Handle_get_name, NULL, NULL, NULL}, {NULL}};
static PyType_Slot Handle_slots[] = {
    {Py_tp_dealloc, Handle_dealloc},
    {Py_tp_methods, Handle_methods},
    {Py_tp_getset, Handle_getset},
    {Py_tp_doc, "A request submitted to cring's engine."},
    {0, NULL}};
static PyType_Spec Handle_spec = {"cring._C.Handle", sizeof(HandleObject), 0, Py_TPFLAGS_DEFAULT,
                                  Handle_slots};

/* all_gather_dims(handle, index, size) is exposed through a module function
 * because the handle does not know the world size. */
static PyObject *py_first_dims(PyObject *module, PyObject *args) {
    module_state *s = get_state(module);
    PyObject *hobj;
    int index, size;
    if (!PyArg_ParseTuple(args, "O!ii", s->HandleType, &hobj, &index, &size)) return NULL;
    HandleObject *self = (HandleObject *)hobj;
    const int64_t *dims;
    size_t bytes;
    if (!handle_result(self, index, &bytes, &dims)) return NULL;
    PyObject *list = PyList_New(size);
    for (int r = 0; list && r < size; r++) PyList_SET_ITEM(list, r, PyLong_FromLongLong(dims[r]));
    return list;
}

/* Raise the error of a completed handle (the detail names the tensor, or
 * the context adds it). */
static PyObject *raise_handle_error(module_state *s, cring_handle_t *h, cring_status_t st,
                                    int collective, const char *name) {
    char context[512], quoted[512];
    const char *detail = cring_handle_error(h);
    snprintf(quoted, sizeof quoted, "'%s'", name);
    if (strstr(detail, quoted)) /* the detail names the tensor already */
        snprintf(context, sizeof context, "%s failed", collective_label(collective));
    else
        snprintf(context, sizeof context, "%s of tensor '%s' failed",
                 collective_label(collective), name);
    return raise_status(s, st, context, detail);
}

#define STACK_TENSORS 4

static void raise_submit_error(module_state *s, cring_status_t st, int coll, const char *name) {
    char context[512];
    snprintf(context, sizeof context, "%s of tensor '%s'", collective_label(coll), name);
    raise_status(s, st, context, cring_engine_error_message());
}

/* Submit and wait with the GIL released; None, or NULL with the error set. */
static PyObject *submit_wait_here(module_state *s, cring_engine_t *engine,
                                  const cring_request_t *req) {
    cring_handle_t *handle;
    cring_status_t st = cring_engine_submit(engine, req, &handle);
    if (st != CRING_OK) {
        raise_submit_error(s, st, req->collective, req->name);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    st = cring_handle_wait(handle);
    Py_END_ALLOW_THREADS
    PyObject *result = st == CRING_OK ? Py_NewRef(Py_None)
                                      : raise_handle_error(s, handle, st, req->collective, req->name);
    cring_handle_free(handle);
    return result;
}

/* 0 if op can reduce dtype, else -1 with a TypeError naming the tensor. */
static int check_reducible(const char *name, cring_dtype_t dtype, int op) {
    if (cring__reduce_supported(dtype, (cring_op_t)op)) return 0;
    PyErr_Format(PyExc_TypeError, "tensor '%s': op %s cannot reduce dtype %s", name,
                 cring_op_name((cring_op_t)op), cring_dtype_name(dtype));
    return -1;
}

/* An op code for a reduction, or -1 with ValueError/NotImplementedError set. */
static int reduction_op(long op) {
    if (op == CRING_ADASUM) {
        PyErr_SetString(PyExc_NotImplementedError,
                        "cring does not implement Adasum; use cring.Average or Sum");
        return -1;
    }
    if (op < 0 || op >= CRING_OP_COUNT) {
        PyErr_Format(PyExc_ValueError,
                     "unknown reduction op %ld; use cring.Sum, Average, Min, Max or Product", op);
        return -1;
    }
    return (int)op;
}

/* The synchronous in-place allreduce of one NumPy array under a name, the
 * call a training loop or a small-message benchmark makes most: same checks
 * and errors as submit(), without a list, tuple or handle object. */
static PyObject *allreduce_ndarray(module_state *s, PyObject *tensor, PyObject *op_obj,
                                   const char *name) {
    long op_arg = op_obj ? PyLong_AsLong(op_obj) : CRING_AVERAGE;
    if (op_arg == -1 && PyErr_Occurred()) {
        PyErr_Clear();
        PyErr_Format(PyExc_ValueError,
                     "unknown reduction op %R; use cring.Sum, Average, Min, Max or Product", op_obj);
        return NULL;
    }
    if (!s->engine) return raise_not_initialized(s);
    int op = reduction_op(op_arg);
    if (op < 0) return NULL;
    tensor_ref ref;
    if (tensor_acquire(tensor, name, 1, &ref) < 0) return NULL;
    PyObject *result = NULL;
    if (check_reducible(name, ref.dtype, op) < 0) goto done;
    int64_t one = 1;
    cring_tensor_t t = {.send = ref.data, .recv = ref.data, .dtype = ref.dtype,
                        .ndim = ref.t->ndim, .shape = ref.t->ndim ? ref.t->shape : &one};
    cring_request_t req = {.name = name, .collective = CRING_COLL_ALLREDUCE, .op = (cring_op_t)op,
                           .prescale = 1.0, .postscale = 1.0, .compression = CRING_DTYPE_COUNT,
                           .ntensors = 1, .tensors = &t, .flags = CRING_REQUEST_CALLER_WAITS};
    result = submit_wait_here(s, s->engine, &req);
done:
    tensor_release(&ref);
    return result ? Py_NewRef(tensor) : NULL;
}

static int is_one(PyObject *x) {
    return !x || (PyFloat_CheckExact(x) && PyFloat_AS_DOUBLE(x) == 1.0) ||
           (PyLong_CheckExact(x) && PyLong_AsLong(x) == 1);
}

/* cring.allreduce_ itself. A NumPy array with a name and no compression or
 * scaling is reduced here; everything else (torch and CUDA tensors, names
 * to generate, compression) goes to the Python implementation, which
 * cring._api registers with set_allreduce_fallback. Binding the arguments
 * here rather than in a Python frame is a tenth of a small call. */
static PyObject *py_allreduce_(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                               PyObject *kwnames) {
    static const char *const names[] = {"tensor", "op", "name", "compression",
                                        "prescale_factor", "postscale_factor"};
    enum { NPARAMS = 6 };
    static PyObject *interned[NPARAMS]; /* call sites' keywords are interned: compare pointers */
    module_state *s = get_state(module);
    PyObject *v[NPARAMS] = {0};
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    int fast = nargs <= NPARAMS;
    for (int j = 0; j < NPARAMS && !interned[j]; j++)
        if (!(interned[j] = PyUnicode_InternFromString(names[j]))) return NULL;
    for (Py_ssize_t i = 0; fast && i < nargs; i++) v[i] = args[i];
    for (Py_ssize_t k = 0; fast && k < nkw; k++) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, k);
        int j = 0;
        while (j < NPARAMS && key != interned[j]) j++;
        if (j == NPARAMS) /* not interned: compare the text */
            while (--j >= 0 && PyUnicode_CompareWithASCIIString(key, names[j]) != 0) {}
        if (j < 0 || v[j]) fast = 0; /* the fallback raises the TypeError */
        else v[j] = args[nargs + k];
    }
    fast = fast && v[0] && cring__dl_is_ndarray(v[0]) && v[2] && PyUnicode_CheckExact(v[2]) &&
           (!v[3] || v[3] == Py_None) && is_one(v[4]) && is_one(v[5]);
    if (fast) {
        const char *name = PyUnicode_AsUTF8(v[2]);
        return name ? allreduce_ndarray(s, v[0], v[1], name) : NULL;
    }
    if (!s->allreduce_fallback) {
        PyErr_SetString(PyExc_RuntimeError, "cring._api did not register allreduce_'s fallback");
        return NULL;
    }
    return PyObject_Vectorcall(s->allreduce_fallback, args, (size_t)nargs, kwnames);
}

static PyObject *py_set_allreduce_fallback(PyObject *module, PyObject *fn) {
    module_state *s = get_state(module);
    Py_XSETREF(s->allreduce_fallback, Py_NewRef(fn));
    Py_RETURN_NONE;
}

/* submit(collective, name, tensors, op, root, prescale, postscale, compression,
 *        caller_waits[, splits]) -> Handle, or None once done when caller_waits is 2
 * tensors: list of (send, recv) pairs; recv None for allgather and alltoall
 * (splits: None or one row count per rank), recv is send
 * for in-place operations. caller_waits: 0 async, 1 the caller will wait on
 * the handle, 2 wait here (a synchronous call that needs no output copy; it
 * allocates nothing on the Python heap for up to STACK_TENSORS tensors). */
static PyObject *py_submit(PyObject *module, PyObject *args) {
    module_state *s = get_state(module);
    int coll, op, root, caller_waits;
    const char *name, *compression;
    PyObject *list, *splits_obj = Py_None;
    double prescale, postscale;
    if (!PyArg_ParseTuple(args, "isO!iiddzi|O", &coll, &name, &PyList_Type, &list, &op, &root,
                          &prescale, &postscale, &compression, &caller_waits, &splits_obj))
        return NULL;
    if (!s->engine) return raise_not_initialized(s);
    cring_engine_t *engine = s->engine;
    int size = cring_comm_size(cring_engine_comm(engine));
    int rank = cring_comm_rank(cring_engine_comm(engine));
    Py_ssize_t n = PyList_GET_SIZE(list);
    int reduces = coll == CRING_COLL_ALLREDUCE || coll == CRING_COLL_REDUCESCATTER;
    if (reduces && reduction_op(op) < 0) return NULL;
    if (coll == CRING_COLL_BROADCAST && (root < 0 || root >= size)) {
        PyErr_Format(PyExc_ValueError, "tensor '%s': root_rank %d is out of range for size %d",
                     name, root, size);
        return NULL;
    }
    cring_dtype_t comp = CRING_DTYPE_COUNT;
    if (compression) {
        if (!strcmp(compression, "float16")) comp = CRING_FLOAT16;
        else if (!strcmp(compression, "bfloat16")) comp = CRING_BFLOAT16;
        else {
            PyErr_Format(PyExc_ValueError, "compression must be float16 or bfloat16, got %s",
                         compression);
            return NULL;
        }
    }
    tensor_ref stack_refs[2 * STACK_TENSORS];
    cring_tensor_t stack_ts[STACK_TENSORS];
    int64_t stack_scalars[STACK_TENSORS];
    int on_stack = caller_waits == 2 && n <= STACK_TENSORS;
    tensor_ref *refs = on_stack ? stack_refs : PyMem_Calloc((size_t)(2 * n + 1), sizeof *refs);
    cring_tensor_t *ts = on_stack ? stack_ts : PyMem_Calloc((size_t)(n + 1), sizeof *ts);
    int64_t *scalar_shapes = on_stack ? stack_scalars : PyMem_Calloc((size_t)(n + 1), sizeof(int64_t));
    int nrefs = 0;
    PyObject *result = NULL;
    HandleObject *self = NULL;
    cring_handle_t *handle = NULL;
    int64_t *splits = NULL;
    if (!refs || !ts || !scalar_shapes) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *pair = PyList_GET_ITEM(list, i);
        if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2) {
            PyErr_SetString(PyExc_TypeError, "tensors must be (send, recv) pairs");
            goto done;
        }
        PyObject *send_obj = PyTuple_GET_ITEM(pair, 0), *recv_obj = PyTuple_GET_ITEM(pair, 1);
        int in_place = send_obj == recv_obj;
        int needs_write = coll != CRING_COLL_ALLGATHER && coll != CRING_COLL_ALLTOALL && in_place &&
                          !(coll == CRING_COLL_BROADCAST && rank == root);
        tensor_ref *in = &refs[nrefs];
        if (tensor_acquire(send_obj, name, needs_write, in) < 0) goto done;
        nrefs++;
        tensor_ref *out = in;
        if (!in_place && recv_obj != Py_None) {
            out = &refs[nrefs];
            if (tensor_acquire(recv_obj, name, 1, out) < 0) goto done;
            nrefs++;
            if (coll != CRING_COLL_REDUCESCATTER && same_layout(in, out, name) < 0) goto done;
            if (coll == CRING_COLL_REDUCESCATTER && out->dtype != in->dtype) {
                PyErr_Format(PyExc_ValueError, "tensor '%s': output dtype differs", name);
                goto done;
            }
        }
        if (reduces && check_reducible(name, in->dtype, op) < 0) goto done;
        if (comp != CRING_DTYPE_COUNT && in->dtype != CRING_FLOAT32) {
            PyErr_Format(PyExc_TypeError,
                         "tensor '%s': compression applies to float32 tensors, not %s", name,
                         cring_dtype_name(in->dtype));
            goto done;
        }
        ts[i].send = in->data;
        ts[i].recv = out->data;
        ts[i].dtype = in->dtype;
        ts[i].ndim = in->t->ndim;
        ts[i].shape = in->t->shape;
        if (in->t->ndim == 0) { /* a scalar counts as one element with one row */
            scalar_shapes[i] = 1;
            ts[i].ndim = coll == CRING_COLL_ALLGATHER ? 1 : 0;
            ts[i].shape = &scalar_shapes[i];
        }
    }
    if (splits_obj != Py_None) {
        PyObject *seq = PySequence_Fast(splits_obj, "splits must be a sequence of integers");
        if (!seq) goto done;
        if (PySequence_Fast_GET_SIZE(seq) != size) {
            PyErr_Format(PyExc_ValueError,
                         "tensor '%s': splits has %zd entries; it needs one per rank (%d)", name,
                         PySequence_Fast_GET_SIZE(seq), size);
            Py_DECREF(seq);
            goto done;
        }
        splits = PyMem_Malloc(sizeof *splits * (size_t)size);
        for (int r = 0; splits && r < size; r++) {
            splits[r] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, r));
            if (splits[r] == -1 && PyErr_Occurred()) {
                Py_DECREF(seq);
                goto done;
            }
        }
        Py_DECREF(seq);
        if (!splits) {
            PyErr_NoMemory();
            goto done;
        }
    }
    cring_request_t req = {.name = name, .collective = (cring_collective_t)coll,
                           .op = (cring_op_t)op, .root = root, .prescale = prescale,
                           .postscale = postscale, .compression = comp, .ntensors = (int)n,
                           .tensors = ts, .flags = caller_waits ? CRING_REQUEST_CALLER_WAITS : 0,
                           .splits = splits};
    if (caller_waits == 2) {
        result = submit_wait_here(s, engine, &req);
        goto done; /* the views are released below, after the engine is done */
    }
    cring_status_t st = cring_engine_submit(engine, &req, &handle);
    if (st != CRING_OK) {
        raise_submit_error(s, st, coll, name);
        goto done;
    }
    self = PyObject_New(HandleObject, s->HandleType);
    char *name_copy = PyMem_Malloc(strlen(name) + 1);
    if (!self || !name_copy) {
        /* cannot hand the views over: wait for the engine before dropping them */
        Py_BEGIN_ALLOW_THREADS
        cring_handle_wait(handle);
        Py_END_ALLOW_THREADS
        cring_handle_free(handle);
        PyMem_Free(name_copy);
        if (self) PyObject_Free(self);
        PyErr_NoMemory();
        goto done;
    }
    strcpy(name_copy, name);
    self->handle = handle;
    self->refs = refs; /* the handle object owns the views and arrays now */
    self->nrefs = nrefs;
    self->released = 0;
    self->collective = coll;
    self->name = name_copy;
    refs = NULL;
    nrefs = 0;
    result = (PyObject *)self;
done:
    PyMem_Free(splits);
    for (int i = 0; i < nrefs; i++) tensor_release(&refs[i]);
    if (!on_stack) {
        PyMem_Free(refs);
        PyMem_Free(ts);
        PyMem_Free(scalar_shapes);
    }
    return result;
}

/* ---- benchmark hooks: C-level loops, no Python in the timed region ---------- */
typedef struct {
    void *buf;
    size_t count;
    long iters;
    int raw; /* 1: the algorithm without the agreement step */
} bench_args;

static cring_status_t bench_direct(cring_comm_t *comm, void *p) {
    bench_args *a = p;
    cring_status_t st = cring_barrier(comm);
    for (long i = 0; st == CRING_OK && i < a->iters; i++)
        st = a->raw ? cring__comm_allreduce(comm, a->buf, a->buf, a->count, CRING_FLOAT32, CRING_SUM)
                    : cring_allreduce(comm, a->buf, a->buf, a->count, CRING_FLOAT32, CRING_SUM);
    return st;
}

/* bench_allreduce(mode, iters, nbytes) -> seconds for `iters` float32 sum
 * allreduces of nbytes, timed in C. mode: "engine" (submit + wait, as a
 * synchronous call), "direct" (cring_allreduce: agreement + algorithm) or
 * "raw" (the algorithm alone). Every rank must make the same call. */
static PyObject *py_bench_allreduce(PyObject *module, PyObject *args) {
    module_state *s = get_state(module);
    const char *mode;
    long iters;
    Py_ssize_t nbytes;
    if (!PyArg_ParseTuple(args, "sln", &mode, &iters, &nbytes)) return NULL;
    if (!s->engine) return raise_not_initialized(s);
    bench_args a = {.count = (size_t)nbytes / 4, .iters = iters, .raw = !strcmp(mode, "raw")};
    a.buf = calloc(a.count ? a.count : 1, 4);
    if (!a.buf) return PyErr_NoMemory();
    cring_engine_t *e = s->engine;
    cring_status_t st = CRING_OK;
    double t0 = 0, t1 = 0;
    Py_BEGIN_ALLOW_THREADS
    if (!strcmp(mode, "engine")) {
        int64_t shape = (int64_t)a.count;
        cring_tensor_t t = {.send = a.buf, .recv = a.buf, .dtype = CRING_FLOAT32, .ndim = 1,
                            .shape = &shape};
        cring_request_t q = {.name = "bench", .collective = CRING_COLL_ALLREDUCE,
                             .op = CRING_SUM, .prescale = 1, .postscale = 1,
                             .compression = CRING_DTYPE_COUNT, .ntensors = 1, .tensors = &t,
                             .flags = CRING_REQUEST_CALLER_WAITS};
        t0 = cring__now_s();
        for (long i = 0; st == CRING_OK && i < iters; i++) {
            cring_handle_t *h;
            st = cring_engine_submit(e, &q, &h);
            if (st != CRING_OK) break;
            st = cring_handle_wait(h);
            cring_handle_free(h);
        }
        t1 = cring__now_s();
    } else {
        a.iters = 0; /* a barrier first, outside the timed loop */
        st = cring_engine_exclusive(e, bench_direct, &a);
        a.iters = iters;
        t0 = cring__now_s();
        if (st == CRING_OK) st = cring_engine_exclusive(e, bench_direct, &a);
        t1 = cring__now_s();
    }
    Py_END_ALLOW_THREADS
    free(a.buf);
    if (st != CRING_OK) return raise_status(s, st, "benchmark failed", "");
    return PyFloat_FromDouble(t1 - t0);
}

typedef struct {
    void *buf;
    size_t count;
    cring_dtype_t dtype;
    cring_op_t op;
} direct_args;

static cring_status_t direct_call(cring_comm_t *comm, void *p) {
    direct_args *a = p;
    return cring_allreduce(comm, a->buf, a->buf, a->count, a->dtype, a->op);
}

/* direct_allreduce_(tensor, op): the public C cring_allreduce (agreement +
 * algorithm) on a tensor, bypassing the engine. A benchmark baseline: every
 * rank must call it at the same point with nothing in flight. */
static PyObject *py_direct_allreduce(PyObject *module, PyObject *args) {
    module_state *s = get_state(module);
    PyObject *obj;
    int op;
    if (!PyArg_ParseTuple(args, "Oi", &obj, &op)) return NULL;
    if (!s->engine) return raise_not_initialized(s);
    tensor_ref ref;
    if (tensor_acquire(obj, "direct", 1, &ref) < 0) return NULL;
    direct_args a = {ref.data, ref.numel, ref.dtype, (cring_op_t)op};
    cring_status_t st;
    Py_BEGIN_ALLOW_THREADS
    st = cring_engine_exclusive(s->engine, direct_call, &a);
    Py_END_ALLOW_THREADS
    tensor_release(&ref);
    if (st != CRING_OK) return raise_status(s, st, "direct allreduce failed", "");
    Py_RETURN_NONE;
}

static PyObject *py_engine_stats(PyObject *module, PyObject *unused) {
    module_state *s = get_state(module);
    if (!s->engine) return raise_not_initialized(s);
    cring_engine_stats_t st;
    cring_engine_get_stats(s->engine, &st);
    return Py_BuildValue("{s:K,s:K,s:K,s:K,s:K,s:K}", "cycles", st.cycles, "collectives",
                         st.collectives, "tensors", st.tensors, "fused_tensors", st.fused_tensors,
                         "cache_hits", st.cache_hits, "errors", st.errors);
}

static PyObject *py_timeline(PyObject *module, PyObject *args) {
    module_state *s = get_state(module);
    const char *path = NULL;
    if (!PyArg_ParseTuple(args, "z", &path)) return NULL;
    if (!s->engine) return raise_not_initialized(s);
    cring_status_t st = cring_engine_timeline(s->engine, path);
    if (st != CRING_OK) return raise_status(s, st, "cannot write the timeline", cring_last_init_error());
    Py_RETURN_NONE;
}

/* copy(src, dst): dst[...] = src[...] for tensors of equal dtype and size. */
static PyObject *py_copy(PyObject *module, PyObject *args) {
    PyObject *src_obj, *dst_obj;
    const char *name = "tensor";
    if (!PyArg_ParseTuple(args, "OO|s", &src_obj, &dst_obj, &name)) return NULL;
    tensor_ref src = {0}, dst = {0};
    PyObject *res = NULL;
    if (tensor_acquire(src_obj, name, 0, &src) < 0) goto done;
    if (tensor_acquire(dst_obj, name, 1, &dst) < 0) goto done;
    if (same_layout(&src, &dst, name) < 0) goto done;
    if (src.data != dst.data) memmove(dst.data, src.data, src.numel * cring_dtype_size(src.dtype));
    res = Py_None;
    Py_INCREF(res);
done:
    tensor_release(&src);
    tensor_release(&dst);
    return res;
}

static PyObject *py_reduce_isa(PyObject *module, PyObject *unused) {
    return PyUnicode_FromString(cring__reduce_isa());
}

/* ---- StoreServer ------------------------------------------------------------ */
typedef struct {
    PyObject_HEAD
    cring_store_server_t *server;
    int port;
} StoreServerObject;

static PyObject *StoreServer_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"bind_addr", "port", "secret", NULL};
    const char *addr;
    int port = 0;
    const char *secret = NULL;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "s|iz", kwlist, &addr, &port, &secret))
        return NULL;
    StoreServerObject *self = (StoreServerObject *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    cring_status_t st;
    char detail[CRING__ERRMSG_BYTES];
    Py_BEGIN_ALLOW_THREADS
    st = cring_store_server_start(addr, port, secret, &self->server, &self->port);
    if (st != CRING_OK) snprintf(detail, sizeof detail, "%s", cring__thread_errmsg()->text);
    Py_END_ALLOW_THREADS
    if (st != CRING_OK) {
        Py_DECREF(self);
        module_state *s = PyType_GetModuleState(type);
        return raise_status(s, st, "cannot start the rendezvous store", detail);
    }
    return (PyObject *)self;
}

static void stop_server(StoreServerObject *self) {
    cring_store_server_t *server = self->server;
    self->server = NULL;
    if (server) {
        Py_BEGIN_ALLOW_THREADS
        cring_store_server_stop(server);
        Py_END_ALLOW_THREADS
    }
}

static PyObject *StoreServer_stop(StoreServerObject *self, PyObject *unused) {
    stop_server(self);
    Py_RETURN_NONE;
}

static void StoreServer_dealloc(StoreServerObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    stop_server(self);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyObject *StoreServer_get_port(StoreServerObject *self, void *closure) {
    return PyLong_FromLong(self->port);
}

static PyMethodDef StoreServer_methods[] = {
    {"stop", (PyCFunction)StoreServer_stop, METH_NOARGS, "Stop serving and close connections."},
    {NULL}};
static PyGetSetDef StoreServer_getset[] = {
    {"port", (getter)StoreServer_get_port, NULL, "The TCP port being served.", NULL}, {NULL}};
static PyType_Slot StoreServer_slots[] = {
    {Py_tp_new, StoreServer_new},
    {Py_tp_dealloc, StoreServer_dealloc},
    {Py_tp_methods, StoreServer_methods},
    {Py_tp_getset, StoreServer_getset},
    {Py_tp_doc, "StoreServer(bind_addr, port=0, secret=None): the rendezvous key-value store, "
                "served from a background thread until stop()."},
    {0, NULL}};
static PyType_Spec StoreServer_spec = {"cring._C.StoreServer", sizeof(StoreServerObject), 0,
                                       Py_TPFLAGS_DEFAULT, StoreServer_slots};

/* ---- StoreClient ------------------------------------------------------------ */
/* A client of the rendezvous store for launchers and elastic workers: the
 * same wire protocol and authentication as the C core's. Calls from several
 * threads are serialised; interrupt() may be called while one blocks. */
typedef struct {
    PyObject_HEAD
    cring_store_t *client;
    PyThread_type_lock lock;
    char where[300];
} StoreClientObject;

static PyObject *StoreClient_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"addr", "port", "secret", "timeout_s", NULL};
    const char *addr, *secret = NULL;
    int port;
    double timeout_s = 30.0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "si|zd", kwlist, &addr, &port, &secret,
                                     &timeout_s))
        return NULL;
    StoreClientObject *self = (StoreClientObject *)type->tp_alloc(type, 0);
    if (!self) return NULL;
    snprintf(self->where, sizeof self->where, "%s:%d", addr, port);
    self->lock = PyThread_allocate_lock();
    if (!self->lock) {
        Py_DECREF(self);
        return PyErr_NoMemory();
    }
    cring_status_t st;
    char detail[CRING__ERRMSG_BYTES];
    Py_BEGIN_ALLOW_THREADS
    st = cring_store_connect(addr, port, secret, timeout_s, &self->client);
    if (st != CRING_OK) snprintf(detail, sizeof detail, "%s", cring__thread_errmsg()->text);
    Py_END_ALLOW_THREADS
    if (st != CRING_OK) {
        char context[400];
        snprintf(context, sizeof context, "cannot connect to the rendezvous store at %s",
                 self->where);
        Py_DECREF(self);
        return raise_status(PyType_GetModuleState(type), st, context, detail);
    }
    return (PyObject *)self;
}

/* Run one store call with the GIL released and the client's lock held. */
#define STORE_CALL(self, st, call)                                       \
    do {                                                                 \
        Py_BEGIN_ALLOW_THREADS                                           \
        PyThread_acquire_lock((self)->lock, WAIT_LOCK);                  \
        st = (self)->client ? (call) : CRING_ERR_CLOSED;                 \
        if (st != CRING_OK)                                              \
            snprintf(detail, sizeof detail, "%s", cring__thread_errmsg()->text); \
        PyThread_release_lock((self)->lock);                             \
        Py_END_ALLOW_THREADS                                             \
    } while (0)

static PyObject *store_error(StoreClientObject *self, cring_status_t st, const char *op,
                             const char *key, const char *detail) {
    char context[600];
    snprintf(context, sizeof context, "rendezvous store %s: %s of '%.200s'", self->where, op,
             key);
    return raise_status(PyType_GetModuleState(Py_TYPE(self)), st, context, detail);
}

static PyObject *StoreClient_set(StoreClientObject *self, PyObject *args) {
    const char *key;
    Py_buffer value;
    if (!PyArg_ParseTuple(args, "sy*", &key, &value)) return NULL;
    cring_status_t st;
    char detail[CRING__ERRMSG_BYTES] = "";
    STORE_CALL(self, st, cring_store_set(self->client, key, value.buf, (size_t)value.len));
    PyBuffer_Release(&value);
    if (st != CRING_OK) return store_error(self, st, "set", key, detail);
    Py_RETURN_NONE;
}

static PyObject *StoreClient_get(StoreClientObject *self, PyObject *args) {
    const char *key;
    double timeout_s;
    if (!PyArg_ParseTuple(args, "sd", &key, &timeout_s)) return NULL;
    cring_status_t st;
    char detail[CRING__ERRMSG_BYTES] = "";
    void *value = NULL;
    size_t len = 0;
    STORE_CALL(self, st, cring_store_get(self->client, key, timeout_s, &value, &len));
    if (st == CRING_ERR_TIMEOUT) Py_RETURN_NONE;
    if (st != CRING_OK) return store_error(self, st, "get", key, detail);
    PyObject *out = PyBytes_FromStringAndSize(value, (Py_ssize_t)len);
    free(value);
    return out;
}

static PyObject *StoreClient_add(StoreClientObject *self, PyObject *args) {
    const char *key;
    long long delta;
    if (!PyArg_ParseTuple(args, "sL", &key, &delta)) return NULL;
    cring_status_t st;
    char detail[CRING__ERRMSG_BYTES] = "";
    int64_t value = 0;
    STORE_CALL(self, st, cring_store_add(self->client, key, (int64_t)delta, &value));
    if (st != CRING_OK) return store_error(self, st, "add", key, detail);
    return PyLong_FromLongLong(value);
}

static PyObject *StoreClient_wait(StoreClientObject *self, PyObject *args) {
    PyObject *keys_obj;
    double timeout_s;
    if (!PyArg_ParseTuple(args, "Od", &keys_obj, &timeout_s)) return NULL;
    PyObject *seq = PySequence_Fast(keys_obj, "keys must be a sequence of strings");
    if (!seq) return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    const char **keys = PyMem_Calloc((size_t)(n ? n : 1), sizeof *keys);
    if (!keys) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        keys[i] = PyUnicode_AsUTF8(PySequence_Fast_GET_ITEM(seq, i));
        if (!keys[i]) {
            PyMem_Free(keys);
            Py_DECREF(seq);
            return NULL;
        }
    }
    cring_status_t st;
    char detail[CRING__ERRMSG_BYTES] = "";
    STORE_CALL(self, st, cring_store_wait(self->client, keys, (size_t)n, timeout_s));
    PyObject *out = st == CRING_OK ? Py_NewRef(Py_True)
                    : st == CRING_ERR_TIMEOUT ? Py_NewRef(Py_False)
                                              : store_error(self, st, "wait", n ? keys[0] : "", detail);
    PyMem_Free(keys);
    Py_DECREF(seq);
    return out;
}

static void close_client(StoreClientObject *self) {
    if (!self->lock) return;
    cring_store_interrupt(self->client); /* a blocked call returns, releasing the lock */
    Py_BEGIN_ALLOW_THREADS
    PyThread_acquire_lock(self->lock, WAIT_LOCK);
    cring_store_close(self->client);
    self->client = NULL;
    PyThread_release_lock(self->lock);
    Py_END_ALLOW_THREADS
}

static PyObject *StoreClient_close(StoreClientObject *self, PyObject *unused) {
    close_client(self);
    Py_RETURN_NONE;
}

static PyObject *StoreClient_interrupt(StoreClientObject *self, PyObject *unused) {
    cring_store_interrupt(self->client);
    Py_RETURN_NONE;
}

static void StoreClient_dealloc(StoreClientObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    close_client(self);
    if (self->lock) PyThread_free_lock(self->lock);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyMethodDef StoreClient_methods[] = {
    {"set", (PyCFunction)StoreClient_set, METH_VARARGS, "set(key, value: bytes)"},
    {"get", (PyCFunction)StoreClient_get, METH_VARARGS,
     "get(key, timeout_s) -> bytes, or None if the key did not appear in time"},
    {"add", (PyCFunction)StoreClient_add, METH_VARARGS, "add(key, delta) -> the new value"},
    {"wait", (PyCFunction)StoreClient_wait, METH_VARARGS,
     "wait(keys, timeout_s) -> True once all exist, False on time-out"},
    {"close", (PyCFunction)StoreClient_close, METH_NOARGS, "Close the connection."},
    {"interrupt", (PyCFunction)StoreClient_interrupt, METH_NOARGS,
     "Make a call blocked in another thread fail now (the client is broken after)."},
    {NULL}};
static PyType_Slot StoreClient_slots[] = {
    {Py_tp_new, StoreClient_new},
    {Py_tp_dealloc, StoreClient_dealloc},
    {Py_tp_methods, StoreClient_methods},
    {Py_tp_doc, "StoreClient(addr, port, secret=None, timeout_s=30.0): an authenticated "
                "client of the rendezvous store (connects, retrying, until timeout_s)."},
    {0, NULL}};
static PyType_Spec StoreClient_spec = {"cring._C.StoreClient", sizeof(StoreClientObject), 0,
                                       Py_TPFLAGS_DEFAULT, StoreClient_slots};

/* ---- module ----------------------------------------------------------------- */
static PyMethodDef module_methods[] = {
    {"init", (PyCFunction)(void (*)(void))py_init, METH_VARARGS | METH_KEYWORDS,
     "init(rank, size, addr, port, serve_store, secret=None, job_key=None, listen_addr=None, "
     "transport='auto', timeout_s=600.0)"},
    {"shutdown", py_shutdown, METH_NOARGS, "Stop the engine and destroy the communicator."},
    {"is_initialized", py_is_initialized, METH_NOARGS, NULL},
    {"topology", py_topology, METH_NOARGS, "dict of rank, size, local_*, cross_*, transport"},
    {"tensor_info", py_tensor_info, METH_VARARGS, "(shape, dtype name, read_only) via DLPack"},
    {"allreduce_", (PyCFunction)(void (*)(void))py_allreduce_, METH_FASTCALL | METH_KEYWORDS,
     "allreduce_($module, /, tensor, op=0, name=None, compression=None, prescale_factor=1.0,\n"
     "           postscale_factor=1.0)\n--\n\n"
     "Reduce `tensor` over all ranks in place and return the same object.\n"
     "op: cring.Average (0, the default, as in Horovod), Sum, Min, Max or Product."},
    {"set_allreduce_fallback", py_set_allreduce_fallback, METH_O,
     "set_allreduce_fallback(fn): where allreduce_ sends what it does not handle itself"},
    {"submit", py_submit, METH_VARARGS,
     "submit(collective, name, [(send, recv), ...], op, root, prescale, postscale, "
     "compression, caller_waits) -> Handle"},
    {"first_dims", py_first_dims, METH_VARARGS, "first_dims(handle, index, size)"},
    {"engine_stats", py_engine_stats, METH_NOARGS, "engine counters"},
    {"direct_allreduce_", py_direct_allreduce, METH_VARARGS,
     "direct_allreduce_(tensor, op): bypass the engine (benchmark baseline)"},
    {"bench_allreduce", py_bench_allreduce, METH_VARARGS,
     "bench_allreduce(mode, iters, nbytes) -> seconds (mode: engine, direct, raw)"},
    {"timeline", py_timeline, METH_VARARGS, "timeline(path or None)"},
    {"copy", py_copy, METH_VARARGS, "copy(src, dst[, name]): copy between DLPack tensors"},
    {"reduce_isa", py_reduce_isa, METH_NOARGS, "kernel family chosen for this CPU"},
    {NULL, NULL, 0, NULL}};

static int add_exception(PyObject *m, PyObject **slot, const char *name, PyObject *bases,
                         const char *doc) {
    char qual[128];
    snprintf(qual, sizeof qual, "cring.%s", name);
    *slot = PyErr_NewExceptionWithDoc(qual, doc, bases, NULL);
    if (!*slot) return -1;
    return PyModule_AddObjectRef(m, name, *slot);
}

/* gpu.c: adds cring._C.gpu, the GPU layer's bindings, sharing the engine slot. */
int cring__pyext_gpu_init(PyObject *module, cring_engine_t **engine_slot);

static int module_exec(PyObject *m) {
    module_state *s = get_state(m);
    if (add_exception(m, &s->CRingError, "CRingError", PyExc_RuntimeError,
                      "Base class of errors raised by cring's collectives.") < 0)
        return -1;
    if (add_exception(m, &s->TimeoutError, "TimeoutError", s->CRingError,
                      "A peer did not take part within CRING_TIMEOUT_SECONDS.") < 0)
        return -1;
    if (add_exception(m, &s->PeerFailureError, "PeerFailureError", s->CRingError,
                      "A peer process died or closed its connection.") < 0)
        return -1;
    if (add_exception(m, &s->MismatchError, "MismatchError", s->CRingError,
                      "Ranks called a collective with different arguments.") < 0)
        return -1;
    PyObject *bases = PyTuple_Pack(2, s->CRingError, PyExc_ValueError);
    if (!bases) return -1;
    int rc = add_exception(m, &s->NotInitializedError, "NotInitializedError", bases,
                           "A collective was called before cring.init().");
    Py_DECREF(bases);
    if (rc < 0) return -1;
    s->StoreServerType = (PyTypeObject *)PyType_FromModuleAndSpec(m, &StoreServer_spec, NULL);
    if (!s->StoreServerType) return -1;
    if (PyModule_AddObjectRef(m, "StoreServer", (PyObject *)s->StoreServerType) < 0) return -1;
    s->OutputBufferType = (PyTypeObject *)PyType_FromModuleAndSpec(m, &OutputBuffer_spec, NULL);
    if (!s->OutputBufferType) return -1;
    s->StoreClientType = (PyTypeObject *)PyType_FromModuleAndSpec(m, &StoreClient_spec, NULL);
    if (!s->StoreClientType) return -1;
    if (PyModule_AddObjectRef(m, "StoreClient", (PyObject *)s->StoreClientType) < 0) return -1;
    s->HandleType = (PyTypeObject *)PyType_FromModuleAndSpec(m, &Handle_spec, NULL);
    if (!s->HandleType) return -1;
    if (PyModule_AddObjectRef(m, "Handle", (PyObject *)s->HandleType) < 0) return -1;
    for (int c = CRING_COLL_ALLREDUCE; c <= CRING_COLL_JOIN; c++) {
        static const char *const names[] = {"", "ALLREDUCE", "BROADCAST", "ALLGATHER",
                                            "REDUCESCATTER", "BARRIER", "ALLTOALL", "JOIN"};
        if (PyModule_AddIntConstant(m, names[c], c) < 0) return -1;
    }
    if (cring__pyext_gpu_init(m, &s->engine) < 0) return -1; /* cring._C.gpu (gpu.c) */
    return 0;
}

static int module_traverse(PyObject *m, visitproc visit, void *arg) {
    module_state *s = get_state(m);
    Py_VISIT(s->CRingError);
    Py_VISIT(s->TimeoutError);
    Py_VISIT(s->PeerFailureError);
    Py_VISIT(s->MismatchError);
    Py_VISIT(s->NotInitializedError);
    Py_VISIT(s->StoreServerType);
    Py_VISIT(s->StoreClientType);
    Py_VISIT(s->OutputBufferType);
    Py_VISIT(s->HandleType);
    Py_VISIT(s->allreduce_fallback);
    return 0;
}

static int module_clear(PyObject *m) {
    module_state *s = get_state(m);
    Py_CLEAR(s->CRingError);
    Py_CLEAR(s->TimeoutError);
    Py_CLEAR(s->PeerFailureError);
    Py_CLEAR(s->MismatchError);
    Py_CLEAR(s->NotInitializedError);
    Py_CLEAR(s->StoreServerType);
    Py_CLEAR(s->StoreClientType);
    Py_CLEAR(s->OutputBufferType);
    Py_CLEAR(s->HandleType);
    Py_CLEAR(s->allreduce_fallback);
    return 0;
}

static void module_free(void *m) {
    module_state *s = get_state((PyObject *)m);
    module_clear((PyObject *)m);
    if (s->engine) {
        cring_engine_stop(s->engine);
        s->engine = NULL;
    }
}

static PyModuleDef_Slot module_slots[] = {{Py_mod_exec, module_exec}, {0, NULL}};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "cring._C",
    .m_doc = "cring's C core: communicator, collectives and the rendezvous store.",
    .m_size = sizeof(module_state),
    .m_methods = module_methods,
    .m_slots = module_slots,
    .m_traverse = module_traverse,
    .m_clear = module_clear,
    .m_free = module_free,
};

PyMODINIT_FUNC PyInit__C(void) { return PyModuleDef_Init(&module_def); }

/* gpu.c: cring._C.gpu, the Python face of the GPU layer (csrc/gpu): loading
 * NCCL and the CUDA runtime, DLPack views of CUDA tensors exported on the
 * caller's stream, NCCL collectives, the small argument exchange through the
 * engine, and pinned host buffers for the host-staged path. Mechanism only:
 * which path a tensor takes and what ranks must agree on is decided in
 * python/cring/_gpu.py. The GIL is released around everything that can block. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#include "../gpu/gpu.h"
#include "cring/cring.h"
#include "dlpack_ingest.h"

/* ---- state -------------------------------------------------------------------- */
typedef struct {
    PyObject_HEAD
    cring__gpu_t *g;
    cring_engine_t **engine_slot; /* the module's engine pointer (read with the GIL held) */
    PyObject *CRingError, *TimeoutError, *PeerFailureError, *MismatchError, *NotInitializedError;
    PyTypeObject *PinnedType;
} GpuState;

typedef struct {
    PyObject_HEAD
    GpuState *owner;
    void *ptr;
    size_t capacity;
    size_t nbytes;
    cring_dtype_t dtype;
    int ndim;
    int64_t *shape;
} PinnedObject;

static PyObject *raise_gpu(GpuState *s, cring_status_t st, const char *context, const char *detail) {
    PyObject *type;
    switch (st) {
    case CRING_ERR_INVALID_ARGUMENT: type = PyExc_ValueError; break;
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

/* ---- DLPack views of CUDA tensors (dlpack_ingest.c) ---------------------------- */
typedef cring__dl_ref_t gpu_view;

/* A DLPack view of a CUDA tensor exported on `stream`; see cring__dl_acquire. */
static int view_acquire(PyObject *obj, PyObject *stream, const char *name, int writable,
                        gpu_view *v) {
    return cring__dl_acquire(obj, stream, name, writable, CRING__DL_CUDA, v);
}

static void view_release(gpu_view *v) { cring__dl_release(v); }

static void view_capsule_destructor(PyObject *cap) {
    gpu_view *v = PyCapsule_GetPointer(cap, "cring.gpu_view");
    if (v) {
        view_release(v);
        PyMem_Free(v);
    }
}

/* view(obj, stream, writable, name) -> (owner, ptr, device_type, device_id,
 * shape, dtype): the tensor's memory stays valid while `owner` lives. */
static PyObject *Gpu_view(GpuState *self, PyObject *args) {
    PyObject *obj, *stream;
    int writable;
    const char *name;
    if (!PyArg_ParseTuple(args, "OOps", &obj, &stream, &writable, &name)) return NULL;
    gpu_view *v = PyMem_Malloc(sizeof *v);
    if (!v) return PyErr_NoMemory();
    if (view_acquire(obj, stream, name, writable, v) < 0) {
        PyMem_Free(v);
        return NULL;
    }
    PyObject *owner = PyCapsule_New(v, "cring.gpu_view", view_capsule_destructor);
    if (!owner) {
        view_release(v);
        PyMem_Free(v);
        return NULL;
    }
    PyObject *shape = PyTuple_New(v->t->ndim);
    for (int i = 0; shape && i < v->t->ndim; i++)
        PyTuple_SET_ITEM(shape, i, PyLong_FromLongLong(v->t->shape[i]));
    if (!shape) {
        Py_DECREF(owner);
        return NULL;
    }
    return Py_BuildValue("(NKiiNs)", owner, (unsigned long long)(uintptr_t)v->data,
                         v->t->device.device_type, v->t->device.device_id, shape,
                         cring_dtype_name(v->dtype));
}

/* ---- loading ---------------------------------------------------------------------- */
typedef cring_status_t (*load_fn)(cring__gpu_t *, const char *const *, size_t, cring__errmsg_t *);

static PyObject *load_common(GpuState *self, PyObject *args, load_fn fn, int nccl) {
    PyObject *list;
    if (!PyArg_ParseTuple(args, "O!", &PyList_Type, &list)) return NULL;
    Py_ssize_t n = PyList_GET_SIZE(list);
    const char **paths = PyMem_Calloc((size_t)n + 1, sizeof *paths);
    if (!paths) return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n; i++) {
        paths[i] = PyUnicode_AsUTF8(PyList_GET_ITEM(list, i));
        if (!paths[i]) {
            PyMem_Free(paths);
            return NULL;
        }
    }
    cring__errmsg_t err = {{0}};
    cring_status_t st;
    Py_BEGIN_ALLOW_THREADS
    st = fn(self->g, paths, (size_t)n, &err);
    Py_END_ALLOW_THREADS
    PyMem_Free(paths);
    if (st != CRING_OK) {
        PyErr_SetString(self->CRingError, err.text);
        return NULL;
    }
    return nccl ? Py_BuildValue("(si)", cring__gpu_nccl_path(self->g),
                                cring__gpu_nccl_version(self->g))
                : Py_BuildValue("(si)", cring__gpu_cudart_path(self->g),
                                cring__gpu_cudart_version(self->g));
}

static PyObject *Gpu_load_cudart(GpuState *self, PyObject *args) {
    return load_common(self, args, cring__gpu_load_cudart, 0);
}

static PyObject *Gpu_load_nccl(GpuState *self, PyObject *args) {
    return load_common(self, args, cring__gpu_load_nccl, 1);
}

static PyObject *Gpu_device_count(GpuState *self, PyObject *unused) {
    cring__errmsg_t why = {{0}};
    int n = cring__gpu_device_count(self->g, &why);
    return Py_BuildValue("(is)", n, n > 0 ? "" : why.text);
}

/* ---- agreement: a small allgather through the engine ---------------------------- */
/* exchange(name, values) -> [values of rank 0, values of rank 1, ...]: an
 * allgather of int64s named `name`, negotiated by the engine like any other
 * collective (so a rank that submitted a CPU collective of the same name gets
 * a MismatchError on every rank instead of a hang). */
static PyObject *Gpu_exchange(GpuState *self, PyObject *args) {
    const char *name;
    PyObject *list;
    if (!PyArg_ParseTuple(args, "sO!", &name, &PyList_Type, &list)) return NULL;
    cring_engine_t *engine = *self->engine_slot;
    if (!engine) {
        PyErr_SetString(self->NotInitializedError,
                        "cring has not been initialized; call cring.init() first");
        return NULL;
    }
    Py_ssize_t n = PyList_GET_SIZE(list);
    int64_t *values = PyMem_Calloc((size_t)n + 1, sizeof *values);
    if (!values) return PyErr_NoMemory();
    for (Py_ssize_t i = 0; i < n; i++) {
        values[i] = PyLong_AsLongLong(PyList_GET_ITEM(list, i));
        if (values[i] == -1 && PyErr_Occurred()) {
            PyMem_Free(values);
            return NULL;
        }
    }
    int64_t shape = (int64_t)n;
    cring_tensor_t t = {.send = values, .recv = NULL, .dtype = CRING_INT64, .ndim = 1,
                        .shape = &shape};
    cring_request_t req = {.name = name, .collective = CRING_COLL_ALLGATHER, .op = CRING_SUM,
                           .prescale = 1, .postscale = 1, .compression = CRING_DTYPE_COUNT,
                           .ntensors = 1, .tensors = &t, .flags = CRING_REQUEST_CALLER_WAITS};
    cring_handle_t *h = NULL;
    cring_status_t st = cring_engine_submit(engine, &req, &h);
    if (st != CRING_OK) {
        PyMem_Free(values);
        char context[512];
        snprintf(context, sizeof context, "CUDA collective '%s'", name);
        return raise_gpu(self, st, context, cring_engine_error_message());
    }
    int size = cring_comm_size(cring_engine_comm(engine));
    Py_BEGIN_ALLOW_THREADS
    st = cring_handle_wait(h);
    Py_END_ALLOW_THREADS
    PyMem_Free(values);
    PyObject *result = NULL;
    if (st != CRING_OK) {
        char context[512];
        snprintf(context, sizeof context, "CUDA collective '%s' (argument agreement)", name);
        raise_gpu(self, st, context, cring_handle_error(h));
        goto done;
    }
    size_t bytes = 0;
    const int64_t *dims = NULL;
    const int64_t *all = cring_handle_output(h, 0, &bytes, &dims);
    if (!all || !dims) {
        PyErr_Format(self->CRingError, "CUDA collective '%s': the argument exchange gave no result",
                     name);
        goto done;
    }
    result = PyList_New(size);
    for (int r = 0, at = 0; result && r < size; r++) {
        PyObject *row = PyList_New(dims[r]);
        if (!row) {
            Py_CLEAR(result);
            break;
        }
        for (int64_t i = 0; i < dims[r]; i++)
            PyList_SET_ITEM(row, i, PyLong_FromLongLong(all[at++]));
        PyList_SET_ITEM(result, r, row);
    }
done:
    cring_handle_free(h);
    return result;
}

/* ---- communicators and collectives ------------------------------------------------- */
/* comm_create(slot, device, rank, size, key, timeout_s) */
static PyObject *Gpu_comm_create(GpuState *self, PyObject *args) {
    int slot, device, rank, size;
    const char *key;
    double timeout_s;
    if (!PyArg_ParseTuple(args, "iiiisd", &slot, &device, &rank, &size, &key, &timeout_s))
        return NULL;
    cring_engine_t *engine = *self->engine_slot;
    if (!engine) {
        PyErr_SetString(self->NotInitializedError,
                        "cring has not been initialized; call cring.init() first");
        return NULL;
    }
    /* The communicator uses its store client only while it is being built;
     * afterwards the GPU layer is its only user (serialised by its lock). */
    cring_store_t *store = cring_comm_store(cring_engine_comm(engine));
    cring__errmsg_t err = {{0}};
    cring_status_t st = CRING_OK;
    char id[CRING__GPU_UNIQUE_ID_BYTES] = {0};
    int made = -1;
    Py_BEGIN_ALLOW_THREADS
    if (slot != cring__gpu_comm_count(self->g)) {
        st = cring__fail(&err, CRING_ERR_INVALID_ARGUMENT, "slot %d is not the next one", slot);
    } else if (rank == 0) {
        st = cring__gpu_unique_id(self->g, id, &err);
        if (st == CRING_OK && size > 1 && (st = cring_store_set(store, key, id, sizeof id)) != CRING_OK)
            cring__fail(&err, st, "rank 0 could not publish the NCCL id in the store");
    } else {
        void *value = NULL;
        size_t len = 0;
        st = cring_store_get(store, key, timeout_s, &value, &len);
        if (st != CRING_OK)
            cring__fail(&err, st, "rank %d got no NCCL id from rank 0 (store key '%s')", rank, key);
        else if (len != sizeof id)
            st = cring__fail(&err, CRING_ERR_PROTOCOL, "the NCCL id in the store has %zu bytes", len);
        else
            memcpy(id, value, sizeof id);
        free(value);
    }
    if (st == CRING_OK) st = cring__gpu_comm_init(self->g, device, rank, size, id, &made, &err);
    Py_END_ALLOW_THREADS
    if (st != CRING_OK) {
        char context[128];
        snprintf(context, sizeof context, "cannot create the NCCL communicator for cuda:%d",
                 device);
        return raise_gpu(self, st, context, err.text);
    }
    Py_RETURN_NONE;
}

static PyObject *Gpu_comm_count(GpuState *self, PyObject *unused) {
    return PyLong_FromLong(cring__gpu_comm_count(self->g));
}

static PyObject *Gpu_check(GpuState *self, PyObject *args) {
    int slot;
    if (!PyArg_ParseTuple(args, "i", &slot)) return NULL;
    cring__errmsg_t err = {{0}};
    cring_status_t st = cring__gpu_comm_check(self->g, slot, &err);
    if (st != CRING_OK) return raise_gpu(self, st, "NCCL failed", err.text);
    Py_RETURN_NONE;
}

static PyObject *Gpu_comms_destroy(GpuState *self, PyObject *unused) {
    Py_BEGIN_ALLOW_THREADS
    cring__gpu_comms_destroy(self->g);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* collective(slot, collective, op, root, scale, stream, name,
 *            [(send_ptr, recv_ptr, dtype, count, rank_counts or None), ...]) */
static PyObject *Gpu_collective(GpuState *self, PyObject *args) {
    int slot, coll, op, root;
    double scale;
    unsigned long long stream;
    const char *name;
    PyObject *list;
    if (!PyArg_ParseTuple(args, "iiiidKsO!", &slot, &coll, &op, &root, &scale, &stream, &name,
                          &PyList_Type, &list))
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(list);
    int size = *self->engine_slot ? cring_comm_size(cring_engine_comm(*self->engine_slot)) : 1;
    cring__gpu_tensor_t *ts = PyMem_Calloc((size_t)n + 1, sizeof *ts);
    size_t *counts = PyMem_Calloc((size_t)(n * size) + 1, sizeof *counts);
    PyObject *result = NULL;
    if (!ts || !counts) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        unsigned long long send, recv;
        const char *dtype;
        Py_ssize_t count;
        PyObject *rank_counts;
        PyObject *item = PyList_GET_ITEM(list, i);
        if (!PyArg_ParseTuple(item, "KKsnO", &send, &recv, &dtype, &count, &rank_counts)) goto done;
        ts[i].send = (const void *)(uintptr_t)send;
        ts[i].recv = (void *)(uintptr_t)recv;
        ts[i].count = (size_t)count;
        ts[i].stream = (void *)(uintptr_t)stream;
        if (!cring__dtype_from_name(dtype, &ts[i].dtype)) goto done;
        if (rank_counts != Py_None) {
            if (!PyList_Check(rank_counts) || PyList_GET_SIZE(rank_counts) != size) {
                PyErr_Format(PyExc_ValueError, "rank_counts must be a list of %d counts", size);
                goto done;
            }
            for (int r = 0; r < size; r++) {
                counts[i * size + r] = PyLong_AsSize_t(PyList_GET_ITEM(rank_counts, r));
                if (PyErr_Occurred()) goto done;
            }
            ts[i].rank_counts = &counts[i * size];
        }
    }
    cring__gpu_coll_t c = {.collective = (cring_collective_t)coll, .op = (cring_op_t)op,
                           .root = root, .scale = scale, .ntensors = (int)n, .tensors = ts};
    cring__errmsg_t err = {{0}};
    cring_status_t st;
    Py_BEGIN_ALLOW_THREADS
    st = cring__gpu_collective(self->g, slot, &c, &err);
    Py_END_ALLOW_THREADS
    if (st != CRING_OK) {
        char context[512];
        snprintf(context, sizeof context, "NCCL %s of tensor '%s' failed",
                 coll == CRING_COLL_ALLREDUCE   ? "allreduce"
                 : coll == CRING_COLL_BROADCAST ? "broadcast"
                 : coll == CRING_COLL_ALLGATHER ? "allgather"
                                                : "reducescatter",
                 name);
        raise_gpu(self, st, context, err.text);
        goto done;
    }
    result = Py_NewRef(Py_None);
done:
    PyMem_Free(ts);
    PyMem_Free(counts);
    return result;
}

/* ---- pinned host buffers ---------------------------------------------------------- */
static PinnedObject *pinned_new(GpuState *self, int ndim, const int64_t *shape,
                                cring_dtype_t dtype) {
    size_t numel = 1;
    for (int i = 0; i < ndim; i++) numel *= (size_t)shape[i];
    size_t nbytes = numel * cring_dtype_size(dtype);
    PinnedObject *p = PyObject_New(PinnedObject, self->PinnedType);
    if (!p) return NULL;
    p->owner = (GpuState *)Py_NewRef((PyObject *)self);
    p->ptr = NULL;
    p->capacity = 0;
    p->nbytes = nbytes;
    p->dtype = dtype;
    p->ndim = ndim;
    p->shape = PyMem_Calloc((size_t)ndim + 1, sizeof(int64_t));
    if (!p->shape) {
        Py_DECREF(p);
        return (PinnedObject *)PyErr_NoMemory();
    }
    memcpy(p->shape, shape, (size_t)ndim * sizeof(int64_t));
    cring__errmsg_t err = {{0}};
    cring_status_t st;
    Py_BEGIN_ALLOW_THREADS
    st = cring__gpu_pinned_get(self->g, nbytes, &p->ptr, &p->capacity, &err);
    Py_END_ALLOW_THREADS
    if (st != CRING_OK) {
        Py_DECREF(p);
        return (PinnedObject *)raise_gpu(self, st, "cannot allocate pinned host memory", err.text);
    }
    return p;
}

static int parse_shape(PyObject *seq, int64_t **shape_out, int *ndim_out) {
    PyObject *fast = PySequence_Fast(seq, "shape must be a sequence of ints");
    if (!fast) return -1;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(fast);
    int64_t *shape = PyMem_Calloc((size_t)n + 1, sizeof *shape);
    if (!shape) {
        Py_DECREF(fast);
        PyErr_NoMemory();
        return -1;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        shape[i] = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(fast, i));
        if (shape[i] < 0) {
            if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "negative dimension");
            PyMem_Free(shape);
            Py_DECREF(fast);
            return -1;
        }
    }
    Py_DECREF(fast);
    *shape_out = shape;
    *ndim_out = (int)n;
    return 0;
}

/* pinned(shape, dtype) -> an uninitialised PinnedBuffer */
static PyObject *Gpu_pinned(GpuState *self, PyObject *args) {
    PyObject *shape_obj;
    const char *dtype_name;
    if (!PyArg_ParseTuple(args, "Os", &shape_obj, &dtype_name)) return NULL;
    cring_dtype_t dtype;
    if (!cring__dtype_from_name(dtype_name, &dtype)) return NULL;
    int64_t *shape;
    int ndim;
    if (parse_shape(shape_obj, &shape, &ndim) < 0) return NULL;
    PinnedObject *p = pinned_new(self, ndim, shape, dtype);
    PyMem_Free(shape);
    return (PyObject *)p;
}

/* stage_in(obj, dlpack_stream, cuda_stream, name) -> PinnedBuffer holding a
 * copy of the CUDA tensor obj: exported for dlpack_stream (so the producer's
 * work comes first), copied on cuda_stream, which is then waited for. */
static PyObject *Gpu_stage_in(GpuState *self, PyObject *args) {
    PyObject *obj, *stream;
    unsigned long long stream_value;
    const char *name;
    if (!PyArg_ParseTuple(args, "OOKs", &obj, &stream, &stream_value, &name)) return NULL;
    gpu_view v;
    if (view_acquire(obj, stream, name, 0, &v) < 0) return NULL;
    PinnedObject *p = pinned_new(self, v.t->ndim, v.t->shape, v.dtype);
    if (!p) {
        view_release(&v);
        return NULL;
    }
    cring__errmsg_t err = {{0}};
    cring_status_t st;
    Py_BEGIN_ALLOW_THREADS
    st = cring__gpu_copy_sync(self->g, p->ptr, v.data, p->nbytes, 0,
                              (void *)(uintptr_t)stream_value, &err);
    Py_END_ALLOW_THREADS
    view_release(&v);
    if (st != CRING_OK) {
        Py_DECREF(p);
        char context[512];
        snprintf(context, sizeof context, "cannot stage tensor '%s' to host memory", name);
        return raise_gpu(self, st, context, err.text);
    }
    return (PyObject *)p;
}

/* stage_out(pinned, obj, dlpack_stream, cuda_stream, name): copy a
 * PinnedBuffer into the CUDA tensor obj on cuda_stream and wait for it. */
static PyObject *Gpu_stage_out(GpuState *self, PyObject *args) {
    PyObject *pinned_obj, *obj, *stream;
    unsigned long long stream_value;
    const char *name;
    if (!PyArg_ParseTuple(args, "O!OOKs", self->PinnedType, &pinned_obj, &obj, &stream,
                          &stream_value, &name))
        return NULL;
    PinnedObject *p = (PinnedObject *)pinned_obj;
    gpu_view v;
    if (view_acquire(obj, stream, name, 1, &v) < 0) return NULL;
    size_t have = v.numel * cring_dtype_size(v.dtype);
    if (have != p->nbytes) {
        view_release(&v);
        PyErr_Format(PyExc_ValueError, "tensor '%s': output has %zu bytes, result %zu", name,
                     have, p->nbytes);
        return NULL;
    }
    cring__errmsg_t err = {{0}};
    cring_status_t st;
    Py_BEGIN_ALLOW_THREADS
    st = cring__gpu_copy_sync(self->g, v.data, p->ptr, p->nbytes, 1,
                              (void *)(uintptr_t)stream_value, &err);
    Py_END_ALLOW_THREADS
    view_release(&v);
    if (st != CRING_OK) {
        char context[512];
        snprintf(context, sizeof context, "cannot copy the result of '%s' to the device", name);
        return raise_gpu(self, st, context, err.text);
    }
    Py_RETURN_NONE;
}

static PyObject *Gpu_stats(GpuState *self, PyObject *unused) {
    cring__gpu_stats_t s;
    cring__gpu_get_stats(self->g, &s);
    return Py_BuildValue("{s:K,s:K,s:K,s:K,s:K}", "communicators", s.communicators, "groups",
                         s.groups, "nccl_calls", s.nccl_calls, "staged_bytes", s.staged_bytes,
                         "pinned_allocs", s.pinned_allocs);
}

/* PinnedBuffer: host memory that exports itself through DLPack as
 * kDLCUDAHost, so the CPU collectives read and write it directly. */
typedef struct {
    cring_dl_managed_t managed;
    int64_t shape[]; /* ndim entries */
} pinned_export_t;

static void pinned_export_deleter(cring_dl_managed_t *m) {
    PyGILState_STATE gil = PyGILState_Ensure();
    Py_XDECREF((PyObject *)m->manager_ctx);
    PyMem_RawFree(m);
    PyGILState_Release(gil);
}

static void pinned_capsule_destructor(PyObject *cap) {
    if (PyCapsule_IsValid(cap, "dltensor")) { /* never consumed */
        cring_dl_managed_t *m = PyCapsule_GetPointer(cap, "dltensor");
        if (m && m->deleter) m->deleter(m);
    }
}

static PyObject *Pinned_dlpack(PinnedObject *self, PyObject *args, PyObject *kwargs) {
    /* stream, max_version, dl_device and copy are accepted and ignored: the
     * memory is host memory, ready as soon as this object exists. */
    pinned_export_t *e =
        PyMem_RawCalloc(1, sizeof *e + (size_t)(self->ndim + 1) * sizeof(int64_t));
    if (!e) return PyErr_NoMemory();
    memcpy(e->shape, self->shape, (size_t)self->ndim * sizeof(int64_t));
    cring_dl_tensor_t *t = &e->managed.dl_tensor;
    static char empty_buffer[8];
    t->data = self->ptr ? self->ptr : empty_buffer;
    t->device.device_type = CRING_DL_CUDA_HOST;
    t->device.device_id = 0;
    t->ndim = self->ndim;
    t->dtype = cring__dl_from_dtype(self->dtype);
    t->shape = e->shape;
    t->strides = NULL;
    t->byte_offset = 0;
    e->managed.manager_ctx = Py_NewRef((PyObject *)self);
    e->managed.deleter = pinned_export_deleter;
    PyObject *cap = PyCapsule_New(&e->managed, "dltensor", pinned_capsule_destructor);
    if (!cap) {
        Py_DECREF(self);
        PyMem_RawFree(e);
    }
    return cap;
}

static PyObject *Pinned_dlpack_device(PinnedObject *self, PyObject *unused) {
    return Py_BuildValue("(ii)", CRING_DL_CUDA_HOST, 0);
}

static PyObject *Pinned_get_shape(PinnedObject *self, void *closure) {
    PyObject *t = PyTuple_New(self->ndim);
    for (int i = 0; t && i < self->ndim; i++)
        PyTuple_SET_ITEM(t, i, PyLong_FromLongLong(self->shape[i]));
    return t;
}

static PyObject *Pinned_get_dtype(PinnedObject *self, void *closure) {
    return PyUnicode_FromString(cring_dtype_name(self->dtype));
}

static PyObject *Pinned_get_nbytes(PinnedObject *self, void *closure) {
    return PyLong_FromSize_t(self->nbytes);
}

static void Pinned_dealloc(PinnedObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    if (self->owner && self->ptr) cring__gpu_pinned_put(self->owner->g, self->ptr, self->capacity);
    Py_XDECREF(self->owner);
    PyMem_Free(self->shape);
    PyObject_Free(self);
    Py_DECREF(tp);
}

static PyMethodDef Pinned_methods[] = {
    {"__dlpack__", (PyCFunction)(void (*)(void))Pinned_dlpack, METH_VARARGS | METH_KEYWORDS,
     "Export as a DLPack capsule (device kDLCUDAHost)."},
    {"__dlpack_device__", (PyCFunction)Pinned_dlpack_device, METH_NOARGS, NULL},
    {NULL}};
static PyGetSetDef Pinned_getset[] = {
    {"shape", (getter)Pinned_get_shape, NULL, NULL, NULL},
    {"dtype", (getter)Pinned_get_dtype, NULL, "cring dtype name", NULL},
    {"nbytes", (getter)Pinned_get_nbytes, NULL, NULL, NULL},
    {NULL}};
static PyType_Slot Pinned_slots[] = {
    {Py_tp_dealloc, Pinned_dealloc},
    {Py_tp_methods, Pinned_methods},
    {Py_tp_getset, Pinned_getset},
    {Py_tp_doc, "Pinned host memory holding a staged copy of a CUDA tensor."},
    {0, NULL}};
static PyType_Spec Pinned_spec = {"cring._C.PinnedBuffer", sizeof(PinnedObject), 0,
                                  Py_TPFLAGS_DEFAULT, Pinned_slots};

/* ---- the state object ---------------------------------------------------------- */
/* The context itself is left to process exit: tearing NCCL down during
 * interpreter finalisation can hang or crash once CUDA has gone first.
 * cring.shutdown() destroys the communicators (comms_destroy). */
static void Gpu_dealloc(GpuState *self) {
    PyTypeObject *tp = Py_TYPE(self);
    Py_XDECREF(self->CRingError);
    Py_XDECREF(self->TimeoutError);
    Py_XDECREF(self->PeerFailureError);
    Py_XDECREF(self->MismatchError);
    Py_XDECREF(self->NotInitializedError);
    Py_XDECREF(self->PinnedType);
    PyObject_Free(self);
    Py_DECREF(tp);
}

static PyMethodDef Gpu_methods[] = {
    {"load_cudart", (PyCFunction)Gpu_load_cudart, METH_VARARGS,
     "load_cudart(wheel_paths) -> (path, version); CRingError saying why not"},
    {"load_nccl", (PyCFunction)Gpu_load_nccl, METH_VARARGS,
     "load_nccl(wheel_paths) -> (path, version code); CRingError saying why not"},
    {"device_count", (PyCFunction)Gpu_device_count, METH_NOARGS, "(count, reason when 0)"},
    {"view", (PyCFunction)Gpu_view, METH_VARARGS,
     "view(obj, stream, writable, name) -> (owner, ptr, device_type, device_id, shape, dtype)"},
    {"exchange", (PyCFunction)Gpu_exchange, METH_VARARGS,
     "exchange(name, [int, ...]) -> every rank's list (an allgather through the engine)"},
    {"comm_create", (PyCFunction)Gpu_comm_create, METH_VARARGS,
     "comm_create(slot, device, rank, size, store_key, timeout_s)"},
    {"comm_count", (PyCFunction)Gpu_comm_count, METH_NOARGS, NULL},
    {"check", (PyCFunction)Gpu_check, METH_VARARGS, "check(slot): raise NCCL's async error"},
    {"comms_destroy", (PyCFunction)Gpu_comms_destroy, METH_NOARGS, NULL},
    {"collective", (PyCFunction)Gpu_collective, METH_VARARGS,
     "collective(slot, collective, op, root, scale, stream, name, tensors)"},
    {"pinned", (PyCFunction)Gpu_pinned, METH_VARARGS, "pinned(shape, dtype) -> PinnedBuffer"},
    {"stage_in", (PyCFunction)Gpu_stage_in, METH_VARARGS,
     "stage_in(tensor, dlpack_stream, cuda_stream, name) -> PinnedBuffer"},
    {"stage_out", (PyCFunction)Gpu_stage_out, METH_VARARGS,
     "stage_out(pinned, tensor, dlpack_stream, cuda_stream, name)"},
    {"stats", (PyCFunction)Gpu_stats, METH_NOARGS, "counters of the GPU layer"},
    {NULL}};
static PyType_Slot Gpu_slots[] = {
    {Py_tp_dealloc, Gpu_dealloc},
    {Py_tp_methods, Gpu_methods},
    {Py_tp_doc, "cring's GPU layer: NCCL, the CUDA runtime and pinned staging buffers."},
    {0, NULL}};
static PyType_Spec Gpu_spec = {"cring._C.GpuState", sizeof(GpuState), 0, Py_TPFLAGS_DEFAULT,
                               Gpu_slots};

/* Called once from module_exec, after the exception types exist: adds
 * cring._C.gpu (a GpuState) and cring._C.PinnedBuffer. engine_slot is the
 * module's engine pointer, which outlives the GpuState. */
int cring__pyext_gpu_init(PyObject *module, cring_engine_t **engine_slot) {
    PyTypeObject *type = (PyTypeObject *)PyType_FromSpec(&Gpu_spec);
    if (!type) return -1;
    PyTypeObject *pinned_type = (PyTypeObject *)PyType_FromSpec(&Pinned_spec);
    if (!pinned_type) {
        Py_DECREF(type);
        return -1;
    }
    GpuState *self = PyObject_New(GpuState, type);
    Py_DECREF(type); /* the instance holds its type */
    if (!self) {
        Py_DECREF(pinned_type);
        return -1;
    }
    self->g = NULL;
    self->engine_slot = engine_slot;
    self->PinnedType = pinned_type;
    self->CRingError = PyObject_GetAttrString(module, "CRingError");
    self->TimeoutError = PyObject_GetAttrString(module, "TimeoutError");
    self->PeerFailureError = PyObject_GetAttrString(module, "PeerFailureError");
    self->MismatchError = PyObject_GetAttrString(module, "MismatchError");
    self->NotInitializedError = PyObject_GetAttrString(module, "NotInitializedError");
    int rc = -1;
    if (!self->CRingError || !self->TimeoutError || !self->PeerFailureError ||
        !self->MismatchError || !self->NotInitializedError)
        goto done;
    if (!(self->g = cring__gpu_global())) {
        PyErr_NoMemory();
        goto done;
    }
    if (PyModule_AddObjectRef(module, "PinnedBuffer", (PyObject *)pinned_type) < 0) goto done;
    if (PyModule_AddObjectRef(module, "gpu", (PyObject *)self) < 0) goto done;
    rc = 0;
done:
    Py_DECREF(self);
    return rc;
}

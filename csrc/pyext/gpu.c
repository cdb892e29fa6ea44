/* gpu.c: cring._C.gpu, the Python face of the GPU layer (csrc/gpu) beside the
 * one collective path: loading NCCL and the CUDA runtime into the process's
 * GPU context (which the engine's CUDA backend runs on), the layer's counters,
 * DLPack capsules of CUDA allgather results (owning their device memory),
 * pinned host buffers for the host-staged path, and the consumer's side of
 * a CUDA request: which stream the caller is on (use_stream, torch's current
 * stream) and ordering it after a completed request. CUDA collectives
 * themselves are submitted like any other (submit.c); nothing here talks to
 * the engine. The GIL is released around everything that can block. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#include "../gpu/gpu.h"
#include "pyext.h"

/* ---- state -------------------------------------------------------------------- */
/* s is the module's state, borrowed: the module holds this object as its
 * `gpu` attribute and outlives it. */
typedef struct {
    PyObject_HEAD cring__gpu_t *g;
    module_state *s;
    PyTypeObject *PinnedType;
} GpuState;

typedef struct {
    PyObject_HEAD GpuState *owner;
    void *ptr;
    size_t capacity;
    size_t nbytes;
    cring_dtype_t dtype;
    int ndim;
    int64_t *shape;
} PinnedObject;

/* ---- DLPack exports (pinned buffers, device results) ----------------------------- */
/* An export keeps its memory valid in one of two ways: a reference to the
 * Python object that owns it (pinned buffers), or owning the memory itself
 * (device results taken out of their handle), freed by the deleter, which
 * then needs no GIL and never waits: a consumer may release it from any
 * thread (cring__gpu_mem_free, ordered after the work queued by then on the
 * stream the result was handed out on). */
typedef struct {
    cring_dl_managed_t managed; /* first: the deleter gets its address */
    int owns_memory;            /* a device result: free it on free_stream */
    void *memory;
    size_t bytes;
    void *free_stream;
    int64_t shape[]; /* ndim entries */
} export_t;

static void export_deleter(cring_dl_managed_t *m) {
    export_t *e = (export_t *)m;
    if (e->owns_memory)
        cring__gpu_mem_free(cring__gpu_global(), m->dl_tensor.device.device_id, e->memory, e->bytes,
                            e->free_stream);
    if (m->manager_ctx) {
        PyGILState_STATE gil = PyGILState_Ensure();
        Py_DECREF((PyObject *)m->manager_ctx);
        PyGILState_Release(gil);
    }
    PyMem_RawFree(e);
}

static void export_capsule_destructor(PyObject *cap) {
    if (PyCapsule_IsValid(cap, "dltensor")) { /* never consumed */
        cring_dl_managed_t *m = PyCapsule_GetPointer(cap, "dltensor");
        if (m && m->deleter) m->deleter(m);
    }
}

/* A "dltensor" capsule of contiguous memory at data, kept valid by a
 * reference to owner (when not NULL) until the consumer's deleter runs; with
 * owns_memory, data is device memory of device_id (cring__gpu_mem_alloc's,
 * `bytes` long) that the deleter frees ordered on free_stream. On failure
 * nothing is freed (the caller still owns data). */
static PyObject *export_capsule_owning(void *data, size_t bytes, int device_type, int device_id,
                                       int ndim, const int64_t *shape, cring_dtype_t dtype,
                                       PyObject *owner, int owns_memory, void *free_stream) {
    export_t *e = PyMem_RawCalloc(1, sizeof *e + (size_t)(ndim + 1) * sizeof(int64_t));
    if (!e) return PyErr_NoMemory();
    memcpy(e->shape, shape, (size_t)ndim * sizeof(int64_t));
    cring_dl_tensor_t *t = &e->managed.dl_tensor;
    static char empty_buffer[8];
    t->data = data ? data : empty_buffer;
    t->device.device_type = device_type;
    t->device.device_id = device_id;
    t->ndim = ndim;
    t->dtype = cring__dl_from_dtype(dtype);
    t->shape = e->shape;
    t->strides = NULL;
    t->byte_offset = 0;
    e->managed.manager_ctx = owner ? Py_NewRef(owner) : NULL;
    e->managed.deleter = export_deleter;
    PyObject *cap = PyCapsule_New(&e->managed, "dltensor", export_capsule_destructor);
    if (!cap) {
        Py_XDECREF(owner);
        PyMem_RawFree(e);
        return NULL;
    }
    e->owns_memory = owns_memory; /* only now: the capsule owns it */
    e->memory = data;
    e->bytes = bytes;
    e->free_stream = free_stream;
    return cap;
}

static PyObject *export_capsule(void *data, int device_type, int device_id, int ndim,
                                const int64_t *shape, cring_dtype_t dtype, PyObject *owner) {
    return export_capsule_owning(data, 0, device_type, device_id, ndim, shape, dtype, owner, 0,
                                 NULL);
}

static int parse_shape(PyObject *seq, int64_t **shape_out, int *ndim_out);

/* output_capsule(handle, index, device, shape, dtype) -> a DLPack capsule
 * (kDLCUDA on `device`) of result `index` of a completed CUDA allgather or
 * alltoall, called after synchronize() on the same thread. The device memory
 * moves out of the handle into the export: the consumer's deleter frees it
 * (however long the handle lives), ordered after the work queued by then on
 * the stream synchronize() ordered after the result (the consumer's), as
 * torch's caching allocator frees a block on the stream it was allocated on
 * (other streams that use it must be ordered before that one); a second call
 * for the same result raises. */
static PyObject *Gpu_output_capsule(GpuState *self, PyObject *args) {
    PyObject *hobj, *shape_obj;
    int index, device;
    const char *dtype_name;
    if (!PyArg_ParseTuple(args, "O!iiOs", self->s->HandleType, &hobj, &index, &device, &shape_obj,
                          &dtype_name))
        return NULL;
    HandleObject *h = (HandleObject *)hobj;
    cring_dtype_t dtype;
    if (!cring__dtype_from_name(dtype_name, &dtype)) return NULL;
    int64_t *shape;
    int ndim;
    if (parse_shape(shape_obj, &shape, &ndim) < 0) return NULL;
    size_t numel = 1, bytes = 0;
    for (int i = 0; i < ndim; i++) numel *= (size_t)shape[i];
    const void *data = NULL;
    if (h->handle && cring_handle_done(h->handle) && index >= 0)
        data = cring_handle_output(h->handle, index, &bytes, NULL);
    PyObject *cap = NULL;
    cring_output_free_fn free_memory = NULL;
    void *free_ctx = NULL, *owned = NULL;
    void *consumer = NULL;
    if (data && h->cuda_device >= 0 &&
        cring__pyext_cuda_stream(h->cuda_device, h->cuda_torch, h->cuda_stream, &consumer) < 0)
        data = NULL; /* the exception is set */
    if (data && bytes == numel * cring_dtype_size(dtype))
        owned = cring_handle_take_output(h->handle, index, &bytes, &free_memory, &free_ctx);
    if (!owned && !PyErr_Occurred())
        PyErr_Format(PyExc_ValueError,
                     "tensor '%s': no device result %d of %zu bytes (it has %zu, or it was "
                     "handed out already)",
                     h->name ? h->name : "?", index, numel * cring_dtype_size(dtype), bytes);
    else if (owned) {
        cap = export_capsule_owning(owned, bytes, CRING_DL_CUDA, device, ndim, shape, dtype, NULL,
                                    1, consumer);
        if (!cap) free_memory(free_ctx, owned, bytes);
    }
    PyMem_Free(shape);
    return cap;
}

/* output_pointer(handle, index) -> the address of result `index` of a
 * completed CUDA allgather or alltoall (the room its caller lent, when the
 * result went there), or None. */
static PyObject *Gpu_output_pointer(GpuState *self, PyObject *args) {
    PyObject *hobj;
    int index;
    if (!PyArg_ParseTuple(args, "O!i", self->s->HandleType, &hobj, &index)) return NULL;
    HandleObject *h = (HandleObject *)hobj;
    const void *data = NULL;
    if (h->handle && cring_handle_done(h->handle) && index >= 0)
        data = cring_handle_output(h->handle, index, NULL, NULL);
    return data ? PyLong_FromVoidPtr((void *)data) : Py_NewRef(Py_None);
}

/* ---- the consumer's stream ------------------------------------------------------------ */
/* cring._gpu.use_stream(): this thread's stream, read by the C fast paths too. */
static _Thread_local int thread_stream_set;
static _Thread_local void *thread_stream;
/* torch._C._cuda_getCurrentRawStream, looked up once torch is imported; a
 * torch without CUDA has none (then the fallback stream is used). */
static PyObject *torch_raw_stream;
static int torch_raw_stream_state; /* 0 not looked up, 1 found, -1 absent */

static PyObject *Gpu_set_thread_stream(GpuState *self, PyObject *arg) {
    PyObject *previous = thread_stream_set ? PyLong_FromVoidPtr(thread_stream) : Py_NewRef(Py_None);
    if (!previous) return NULL;
    if (arg == Py_None) {
        thread_stream_set = 0;
        thread_stream = NULL;
    } else {
        unsigned long long raw = PyLong_AsUnsignedLongLong(arg);
        if (raw == (unsigned long long)-1 && PyErr_Occurred()) {
            Py_DECREF(previous);
            return NULL;
        }
        thread_stream_set = 1;
        thread_stream = (void *)(uintptr_t)raw;
    }
    return previous;
}

static PyObject *Gpu_thread_stream(GpuState *self, PyObject *unused) {
    return thread_stream_set ? PyLong_FromVoidPtr(thread_stream) : Py_NewRef(Py_None);
}

int cring__pyext_thread_stream_set(void) { return thread_stream_set; }

int cring__pyext_cuda_stream(int device, int torch, void *fallback, void **out) {
    *out = fallback;
    if (thread_stream_set) {
        *out = thread_stream;
        return 0;
    }
    if (!torch) return 0;
    if (torch_raw_stream_state == 0) {
        PyObject *name = PyUnicode_FromString("torch._C");
        PyObject *C = name ? PyImport_GetModule(name) : NULL;
        Py_XDECREF(name);
        torch_raw_stream = C ? PyObject_GetAttrString(C, "_cuda_getCurrentRawStream") : NULL;
        Py_XDECREF(C);
        PyErr_Clear();
        torch_raw_stream_state = torch_raw_stream ? 1 : -1;
    }
    if (torch_raw_stream_state < 0) return 0;
    PyObject *index = PyLong_FromLong(device);
    PyObject *res = index ? PyObject_CallOneArg(torch_raw_stream, index) : NULL;
    Py_XDECREF(index);
    if (!res) return -1;
    unsigned long long raw = PyLong_AsUnsignedLongLong(res);
    Py_DECREF(res);
    if (raw == (unsigned long long)-1 && PyErr_Occurred()) return -1;
    *out = (void *)(uintptr_t)raw;
    return 0;
}

int cring__pyext_cuda_after(module_state *s, cring_handle_t *h, const char *name, int device,
                            void *consumer, void *producer, int block_host) {
    cring__gpu_t *g = cring__gpu_global();
    cring__gpu_event_t *ev = cring_handle_device_event(h);
    if (!g || !ev) return 0;
    cring__errmsg_t err = {{0}};
    /* the communicator the work ran on, asked without waiting (its engine may
     * be inside NCCL, waiting for peers, while this thread holds the GIL) */
    cring_status_t st = cring__gpu_event_check(g, ev, &err);
    if (st == CRING_OK) st = cring__gpu_stream_wait(g, device, consumer, ev, &err);
    if (st == CRING_OK && producer != consumer)
        st = cring__gpu_stream_wait(g, device, producer, ev, &err);
    if (st == CRING_OK && block_host) { /* the work has run: an error of it is known now */
        Py_BEGIN_ALLOW_THREADS st = cring__gpu_event_sync(g, ev, &err);
        if (st == CRING_OK) st = cring__gpu_event_check(g, ev, &err); /* again: never waits */
        Py_END_ALLOW_THREADS
    }
    if (st == CRING_OK) return 0;
    char context[512];
    snprintf(context, sizeof context, "tensor '%s' on cuda:%d", name, device);
    cring__pyext_raise(s, st, context, err.text);
    return -1;
}

void cring__pyext_cuda_order_release(cring_handle_t *h, int device, void *producer) {
    cring__gpu_t *g = cring__gpu_global();
    cring__gpu_event_t *ev = cring_handle_device_event(h);
    cring__errmsg_t err = {{0}};
    if (g && ev) (void)cring__gpu_stream_wait(g, device, producer, ev, &err);
}

void *cring__pyext_cuda_event_ref(void *event) {
    if (event) cring__gpu_event_ref(event);
    return event;
}

void cring__pyext_cuda_event_put(void *event) {
    if (event) cring__gpu_event_put(cring__gpu_global(), event);
}

int cring__pyext_cuda_event_done(void *event) {
    return !event || cring__gpu_event_done(cring__gpu_global(), event);
}

void cring__pyext_cuda_event_wait(void *event) {
    cring__errmsg_t err = {{0}};
    if (event) (void)cring__gpu_event_sync(cring__gpu_global(), event, &err);
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
    Py_BEGIN_ALLOW_THREADS st = fn(self->g, paths, (size_t)n, &err);
    Py_END_ALLOW_THREADS PyMem_Free(paths);
    if (st != CRING_OK) { /* an answer, "not available because ...", for _gpu._load */
        PyErr_SetString(self->s->CRingError, err.text);
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

/* Whether NCCL of this version code has the one-rank reduce defect, which
 * the engine's CUDA backend then keeps clear of (csrc/gpu/cuda_api.h). */
static PyObject *Gpu_nccl_one_rank_defect(GpuState *self, PyObject *version) {
    (void)self;
    long code = PyLong_AsLong(version);
    if (code == -1 && PyErr_Occurred()) return NULL;
    return PyBool_FromLong(cring__gpu_nccl_one_rank_defect((int)code));
}

static PyObject *Gpu_device_count(GpuState *self, PyObject *unused) {
    cring__errmsg_t why = {{0}};
    int n = cring__gpu_device_count(self->g, &why);
    return Py_BuildValue("(is)", n, n > 0 ? "" : why.text);
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
    Py_BEGIN_ALLOW_THREADS st = cring__gpu_pinned_get(self->g, nbytes, &p->ptr, &p->capacity, &err);
    Py_END_ALLOW_THREADS if (st != CRING_OK) {
        Py_DECREF(p);
        return (PinnedObject *)cring__pyext_raise(self->s, st, "cannot allocate pinned host memory",
                                                  err.text);
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
    cring__dl_ref_t v;
    if (cring__dl_acquire(obj, stream, name, 0, CRING__DL_CUDA, &v) < 0) return NULL;
    PinnedObject *p = pinned_new(self, v.t->ndim, v.t->shape, v.dtype);
    if (!p) {
        cring__dl_release(&v);
        return NULL;
    }
    cring__errmsg_t err = {{0}};
    cring_status_t st;
    Py_BEGIN_ALLOW_THREADS st = cring__gpu_copy_sync(self->g, p->ptr, v.data, p->nbytes, 0,
                                                     (void *)(uintptr_t)stream_value, &err);
    Py_END_ALLOW_THREADS cring__dl_release(&v);
    if (st != CRING_OK) {
        Py_DECREF(p);
        char context[512];
        snprintf(context, sizeof context, "cannot stage tensor '%s' to host memory", name);
        return cring__pyext_raise(self->s, st, context, err.text);
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
    cring__dl_ref_t v;
    if (cring__dl_acquire(obj, stream, name, 1, CRING__DL_CUDA, &v) < 0) return NULL;
    size_t have = v.numel * cring_dtype_size(v.dtype);
    if (have != p->nbytes) {
        cring__dl_release(&v);
        PyErr_Format(PyExc_ValueError, "tensor '%s': output has %zu bytes, result %zu", name, have,
                     p->nbytes);
        return NULL;
    }
    cring__errmsg_t err = {{0}};
    cring_status_t st;
    Py_BEGIN_ALLOW_THREADS st = cring__gpu_copy_sync(self->g, v.data, p->ptr, p->nbytes, 1,
                                                     (void *)(uintptr_t)stream_value, &err);
    Py_END_ALLOW_THREADS cring__dl_release(&v);
    if (st != CRING_OK) {
        char context[512];
        snprintf(context, sizeof context, "cannot copy the result of '%s' to the device", name);
        return cring__pyext_raise(self->s, st, context, err.text);
    }
    Py_RETURN_NONE;
}

static PyObject *Gpu_stats(GpuState *self, PyObject *unused) {
    cring__gpu_stats_t s;
    cring__gpu_get_stats(self->g, &s);
    return Py_BuildValue("{s:K,s:i,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K}", "communicators",
                         s.communicators, "live_communicators", cring__gpu_comm_live(self->g),
                         "groups", s.groups, "nccl_calls", s.nccl_calls, "staged_bytes",
                         s.staged_bytes, "pinned_allocs", s.pinned_allocs, "device_allocs",
                         s.device_allocs, "device_reuses", s.device_reuses, "streams", s.streams,
                         "events", s.events, "stream_waits", s.stream_waits, "host_waits",
                         s.host_waits, "fused_copies", s.fused_copies);
}

/* PinnedBuffer: host memory that exports itself through DLPack as
 * kDLCUDAHost, so the CPU collectives read and write it directly. stream,
 * max_version, dl_device and copy are accepted and ignored: the memory is
 * host memory, ready as soon as this object exists. */
static PyObject *Pinned_dlpack(PinnedObject *self, PyObject *args, PyObject *kwargs) {
    return export_capsule(self->ptr, CRING_DL_CUDA_HOST, 0, self->ndim, self->shape, self->dtype,
                          (PyObject *)self);
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
/* The context is the process's (cring__gpu_global) and is left to process
 * exit: tearing NCCL down during interpreter finalisation can hang or crash
 * once CUDA has gone first. The engine's stop destroys the communicators. */
static void Gpu_dealloc(GpuState *self) {
    PyTypeObject *tp = Py_TYPE(self);
    Py_XDECREF(self->PinnedType);
    PyObject_Free(self);
    Py_DECREF(tp);
}

static PyMethodDef Gpu_methods[] = {
    {"load_cudart", (PyCFunction)Gpu_load_cudart, METH_VARARGS,
     "load_cudart(wheel_paths) -> (path, version); CRingError saying why not"},
    {"load_nccl", (PyCFunction)Gpu_load_nccl, METH_VARARGS,
     "load_nccl(wheel_paths) -> (path, version code); CRingError saying why not"},
    {"nccl_one_rank_defect", (PyCFunction)Gpu_nccl_one_rank_defect, METH_O,
     "nccl_one_rank_defect(version code) -> whether cring guards against it"},
    {"device_count", (PyCFunction)Gpu_device_count, METH_NOARGS, "(count, reason when 0)"},
    {"output_capsule", (PyCFunction)Gpu_output_capsule, METH_VARARGS,
     "output_capsule(handle, index, device, shape, dtype) -> DLPack capsule (kDLCUDA) of a "
     "CUDA allgather's result, which owns its device memory (freed by its deleter)"},
    {"output_pointer", (PyCFunction)Gpu_output_pointer, METH_VARARGS,
     "output_pointer(handle, index) -> address of a completed CUDA allgather's result, or None"},
    {"pinned", (PyCFunction)Gpu_pinned, METH_VARARGS, "pinned(shape, dtype) -> PinnedBuffer"},
    {"stage_in", (PyCFunction)Gpu_stage_in, METH_VARARGS,
     "stage_in(tensor, dlpack_stream, cuda_stream, name) -> PinnedBuffer"},
    {"stage_out", (PyCFunction)Gpu_stage_out, METH_VARARGS,
     "stage_out(pinned, tensor, dlpack_stream, cuda_stream, name)"},
    {"stats", (PyCFunction)Gpu_stats, METH_NOARGS, "counters of the GPU layer"},
    {"set_thread_stream", (PyCFunction)Gpu_set_thread_stream, METH_O,
     "set_thread_stream(stream or None) -> the previous one: this thread's CUDA collectives "
     "run after, and are waited for on, that cudaStream_t"},
    {"thread_stream", (PyCFunction)Gpu_thread_stream, METH_NOARGS,
     "this thread's stream from set_thread_stream, or None"},
    {NULL}};
static PyType_Slot Gpu_slots[] = {
    {Py_tp_dealloc, Gpu_dealloc},
    {Py_tp_methods, Gpu_methods},
    {Py_tp_doc, "cring's GPU layer: loading NCCL and the CUDA runtime, device results and "
                "pinned staging buffers."},
    {0, NULL}};
static PyType_Spec Gpu_spec = {"cring._C.GpuState", sizeof(GpuState), 0, Py_TPFLAGS_DEFAULT,
                               Gpu_slots};

int cring__pyext_gpu_init(PyObject *module, module_state *s) {
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
    self->s = s;
    self->PinnedType = pinned_type;
    int rc = -1;
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

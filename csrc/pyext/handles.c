/* handles.c: cring._C.Handle (a request in flight and the tensor views it
 * keeps alive), OutputBuffer (an engine-allocated result lent without a
 * copy), waits that run signal handlers, and the list of dropped requests.
 * It must not build requests or check arguments (submit.c does). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>
#include <structmember.h>

#include "pyext.h"

#define WAKE_S 0.1 /* how often a blocked wait runs signal handlers */

/* ---- waiting ------------------------------------------------------------------ */
int cring__pyext_wait(cring_handle_t *h, cring_status_t *st) {
    if (!cring_handle_done(h)) {
        int done;
        Py_BEGIN_ALLOW_THREADS done = cring_handle_wait_for(h, WAKE_S);
        Py_END_ALLOW_THREADS while (!done) {
            if (PyErr_CheckSignals() < 0) return 0; /* KeyboardInterrupt, pytest-timeout... */
            Py_BEGIN_ALLOW_THREADS done = cring_handle_wait_for(h, WAKE_S);
            Py_END_ALLOW_THREADS
        }
    }
    *st = cring_handle_status(h);
    return 1;
}

/* ---- dropped requests, and views waiting for CUDA work ------------------------------ */
/* Release views (a deleter may run Python code: an exception set stays set). */
static void release_views(cring__dl_ref_t *views, int n) {
    if (n <= 0) return;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    for (int i = 0; i < n; i++) cring__dl_release(&views[i]);
    PyErr_Restore(type, value, tb);
}

void cring__pyext_release_after(module_state *s, void *event, cring__dl_ref_t *views, int n) {
    if (n <= 0) return;
    if (!cring__pyext_cuda_event_done(event)) {
        cring__dl_ref_t *kept = PyMem_Calloc((size_t)n, sizeof *kept);
        cring__pyext_dropped_t *d = kept ? PyMem_Malloc(sizeof *d) : NULL;
        if (d) {
            memcpy(kept, views, sizeof *kept * (size_t)n); /* release() reads no inner pointer */
            memset(views, 0, sizeof *views * (size_t)n);   /* the caller's copies: empty */
            *d = (cring__pyext_dropped_t){.next = s->dropped,
                                          .event = cring__pyext_cuda_event_ref(event),
                                          .refs = kept,
                                          .nrefs = n,
                                          .cuda_device = -1};
            s->dropped = d;
            return;
        }
        PyMem_Free(kept); /* nowhere to keep them: the only safe thing left is to wait */
        Py_BEGIN_ALLOW_THREADS cring__pyext_cuda_event_wait(event);
        Py_END_ALLOW_THREADS
    }
    release_views(views, n);
}

void cring__pyext_drop(module_state *s, cring_handle_t *h, cring__dl_ref_t *refs, int nrefs,
                       int cuda_device, void *cuda_stream) {
    if (cring_handle_done(h)) {
        if (cuda_device >= 0 && nrefs) cring__pyext_cuda_order_release(h, cuda_device, cuda_stream);
        cring__pyext_release_after(s, cring_handle_device_event(h), refs, nrefs);
        PyMem_Free(refs);
        cring_handle_free(h);
        return;
    }
    cring__pyext_dropped_t *d = PyMem_Malloc(sizeof *d);
    if (!d) { /* nowhere to keep the views: the only safe thing left is to wait */
        Py_BEGIN_ALLOW_THREADS cring_handle_wait(h);
        Py_END_ALLOW_THREADS if (cuda_device >= 0 && nrefs)
            cring__pyext_cuda_order_release(h, cuda_device, cuda_stream);
        cring__pyext_release_after(s, cring_handle_device_event(h), refs, nrefs);
        PyMem_Free(refs);
        cring_handle_free(h);
        return;
    }
    *d = (cring__pyext_dropped_t){.next = s->dropped,
                                  .handle = h,
                                  .refs = refs,
                                  .nrefs = nrefs,
                                  .cuda_device = cuda_device,
                                  .cuda_stream = cuda_stream};
    s->dropped = d;
}

void cring__pyext_sweep(module_state *s, int all) {
    cring__pyext_dropped_t **link = &s->dropped;
    while (*link) {
        cring__pyext_dropped_t *d = *link;
        int ready =
            d->handle ? cring_handle_done(d->handle) : cring__pyext_cuda_event_done(d->event);
        if (!all && !ready) {
            link = &d->next;
            continue;
        }
        *link = d->next; /* unlink first: a view's deleter may run Python code */
        if (d->handle && cring_handle_done(d->handle)) {
            void *event = cring_handle_device_event(d->handle);
            if (d->cuda_device >= 0 && d->nrefs)
                cring__pyext_cuda_order_release(d->handle, d->cuda_device, d->cuda_stream);
            if (all && event) { /* the engine stopped: what it queued still runs */
                Py_BEGIN_ALLOW_THREADS cring__pyext_cuda_event_wait(event);
                Py_END_ALLOW_THREADS
            }
            cring__pyext_release_after(s, event, d->refs, d->nrefs); /* may queue them again */
        } else {
            if (all && !ready) {
                Py_BEGIN_ALLOW_THREADS cring__pyext_cuda_event_wait(d->event);
                Py_END_ALLOW_THREADS
            }
            release_views(d->refs, d->nrefs);
        }
        PyMem_Free(d->refs);
        if (d->handle) cring_handle_free(d->handle);
        cring__pyext_cuda_event_put(d->event);
        PyMem_Free(d);
    }
}

/* ---- Handle ---------------------------------------------------------------------- */
PyObject *cring__pyext_handle_new(module_state *s, cring_handle_t *handle, cring__dl_ref_t *refs,
                                  int nrefs, int collective, const char *name) {
    HandleObject *self = PyObject_New(HandleObject, s->HandleType);
    size_t len = strlen(name);
    char *name_copy = !self                         ? NULL
                      : len < sizeof self->name_buf ? self->name_buf
                                                    : PyMem_Malloc(len + 1);
    if (!self || !name_copy) { /* name_copy is NULL here */
        if (self) {
            self->handle = NULL; /* dealloc has nothing to do */
            self->refs = NULL;
            self->name = NULL;
            Py_DECREF(self);
        }
        cring__pyext_drop(s, handle, refs, nrefs, -1, NULL);
        return PyErr_NoMemory();
    }
    memcpy(name_copy, name, len + 1);
    self->handle = handle;
    self->refs = refs;
    self->nrefs = nrefs;
    self->released = 0;
    self->collective = collective;
    self->name = name_copy;
    self->cuda_device = -1;
    self->cuda_torch = 0;
    self->cuda_stream = NULL;
    return (PyObject *)self;
}

static PyObject *Handle_done(HandleObject *self, PyObject *unused) {
    return PyBool_FromLong(!self->handle || cring_handle_done(self->handle));
}

/* wait(block_host=False): block until complete (running signal handlers
 * every 100 ms); raise the request's error, if any. Interrupted, the request
 * counts as dropped: the exception propagates and the result is discarded.
 * A CUDA request completes once its work is enqueued: then the caller's
 * current stream (and the producer's) waits on its completion event, and
 * with block_host this thread waits for the device too. */
static PyObject *Handle_wait(HandleObject *self, PyObject *const *args, Py_ssize_t nargs) {
    module_state *s = PyType_GetModuleState(Py_TYPE(self));
    int block_host = 0;
    if (nargs > 1) {
        PyErr_SetString(PyExc_TypeError, "wait() takes at most one argument (block_host)");
        return NULL;
    }
    if (nargs == 1 && (block_host = PyObject_IsTrue(args[0])) < 0) return NULL;
    if (!self->handle) {
        PyErr_Format(s->CRingError,
                     "%s of tensor '%s': its wait was interrupted, so its result was discarded",
                     cring__pyext_collective_label(self->collective), self->name);
        return NULL;
    }
    cring_status_t st;
    if (!cring__pyext_wait(self->handle, &st)) { /* not done, so the views are still held */
        cring__pyext_drop(s, self->handle, self->refs, self->nrefs, self->cuda_device,
                          self->cuda_stream);
        self->handle = NULL;
        self->refs = NULL;
        self->nrefs = 0;
        self->released = 1;
        return NULL;
    }
    int ordered = 0;
    if (self->cuda_device >= 0) {
        void *consumer;
        ordered = cring__pyext_cuda_stream(self->cuda_device, self->cuda_torch, self->cuda_stream,
                                           &consumer);
        if (ordered == 0 && st == CRING_OK)
            ordered = cring__pyext_cuda_after(s, self->handle, self->name, self->cuda_device,
                                              consumer, self->cuda_stream, block_host);
        else if (ordered == 0) {
            /* failed: whatever it queued still runs before the caller's work */
            cring__pyext_cuda_order_release(self->handle, self->cuda_device, consumer);
            if (consumer != self->cuda_stream)
                cring__pyext_cuda_order_release(self->handle, self->cuda_device, self->cuda_stream);
        }
    }
    if (!self->released) { /* held on until cring's stream has run its work */
        cring__pyext_release_after(s, cring_handle_device_event(self->handle), self->refs,
                                   self->nrefs);
        self->released = 1;
    }
    if (ordered < 0) return NULL;
    if (s->dropped) cring__pyext_sweep(s, 0);
    if (st != CRING_OK)
        return cring__pyext_raise_handle(s, self->handle, st, self->collective, self->name);
    Py_RETURN_NONE;
}

/* Result `index` of a completed allgather or alltoall (its bytes and, with
 * dims non-NULL, the first dimension from every rank), or NULL with
 * ValueError set. */
static const void *handle_result(HandleObject *self, int index, size_t *bytes,
                                 const int64_t **dims) {
    const void *src = self->handle && cring_handle_done(self->handle)
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
    cring__dl_ref_t dst;
    if (cring__dl_acquire(dst_obj, NULL, self->name, 1, CRING__DL_HOST, &dst) < 0) return NULL;
    size_t have = dst.numel * cring_dtype_size(dst.dtype);
    if (have != bytes) {
        cring__dl_release(&dst);
        PyErr_Format(PyExc_ValueError, "allgather of '%s': output needs %zu bytes, got %zu",
                     self->name, bytes, have);
        return NULL;
    }
    if (bytes) memcpy(dst.data, src, bytes);
    cring__dl_release(&dst);
    Py_RETURN_NONE;
}

/* value(): after a join completes, the last rank to join. */
static PyObject *Handle_value(HandleObject *self, PyObject *unused) {
    if (!self->handle || !cring_handle_done(self->handle)) {
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
    PyObject_HEAD PyObject *handle;
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
    {0, NULL},
};
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

/* Dropping a handle never waits: what the engine may still use goes to the
 * module's dropped list, released once the request is done. */
static void Handle_dealloc(HandleObject *self) {
    PyTypeObject *tp = Py_TYPE(self);
    if (self->handle) {
        module_state *s = PyType_GetModuleState(tp);
        if (self->released) {
            PyMem_Free(self->refs);
            cring__pyext_drop(s, self->handle, NULL, 0, -1, NULL);
        } else {
            cring__pyext_drop(s, self->handle, self->refs, self->nrefs, self->cuda_device,
                              self->cuda_stream);
        }
    } else {
        PyMem_Free(self->refs);
    }
    if (self->name != self->name_buf) PyMem_Free(self->name);
    tp->tp_free(self);
    Py_DECREF(tp);
}

static PyObject *Handle_get_name(HandleObject *self, void *closure) {
    return PyUnicode_FromString(self->name);
}

static PyMethodDef Handle_methods[] = {
    {"done", (PyCFunction)Handle_done, METH_NOARGS, "True once complete; never blocks."},
    {"wait", (PyCFunction)(void (*)(void))Handle_wait, METH_FASTCALL,
     "wait(block_host=False): block until complete; raise its error. A CUDA request then "
     "orders the caller's current stream after it (and with block_host waits for the device)."},
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
    {0, NULL},
};
static PyType_Spec Handle_spec = {"cring._C.Handle", sizeof(HandleObject), 0, Py_TPFLAGS_DEFAULT,
                                  Handle_slots};

/* ---- cring.Handle, the Python wrapper ------------------------------------------
 * cring.Handle (python/cring/_core.py, the module's `handle_wrapper`) has the
 * slots _h, _finish, _result and _finished. Its slots' offsets are read
 * once from the class's member descriptors: the C fast paths write them and
 * synchronize() reads them directly (generic attribute access was a tenth
 * of a submission). A class without such slots goes through getattr/setattr
 * (making) or the Python synchronize (`synchronize_fallback`). */
enum { W_H, W_FINISH, W_RESULT, W_FINISHED, W_SLOTS };
static PyTypeObject *wrapper_type; /* the class the offsets belong to (a strong reference) */
static Py_ssize_t wrapper_off[W_SLOTS];
static PyObject *wrapper_attr[W_SLOTS]; /* the slots' names, interned */

/* The module's handle_wrapper class (a new reference), its offsets learnt;
 * NULL with an error. */
static PyTypeObject *wrapper_class(PyObject *module) {
    static const char *const names[W_SLOTS] = {"_h", "_finish", "_result", "_finished"};
    static PyObject *attr_name;
    for (int j = 0; j < W_SLOTS; j++)
        if (!wrapper_attr[j] && !(wrapper_attr[j] = PyUnicode_InternFromString(names[j])))
            return NULL;
    if (!attr_name && !(attr_name = PyUnicode_InternFromString("handle_wrapper"))) return NULL;
    PyObject *cls = PyObject_GetAttr(module, attr_name);
    if (!cls) return NULL;
    if (!PyType_Check(cls)) {
        Py_DECREF(cls);
        PyErr_SetString(PyExc_TypeError, "cring._C.handle_wrapper must be cring.Handle");
        return NULL;
    }
    PyTypeObject *wt = (PyTypeObject *)cls;
    if (wrapper_type != wt) {
        int direct = 1;
        for (int j = 0; j < W_SLOTS; j++) {
            PyObject *d = PyObject_GetAttr(cls, wrapper_attr[j]);
            if (!d) PyErr_Clear();
            if (d && Py_IS_TYPE(d, &PyMemberDescr_Type) &&
                ((PyMemberDescrObject *)d)->d_common.d_type == wt &&
                ((PyMemberDescrObject *)d)->d_member->type == T_OBJECT_EX)
                wrapper_off[j] = ((PyMemberDescrObject *)d)->d_member->offset;
            else direct = 0;
            Py_XDECREF(d);
        }
        Py_XSETREF(wrapper_type, direct ? (PyTypeObject *)Py_NewRef(cls) : NULL);
    }
    return wt;
}

static PyObject **wrapper_slot(PyObject *w, int j) {
    return (PyObject **)((char *)w + wrapper_off[j]);
}

PyObject *cring__pyext_wrap_handle(PyObject *module, PyObject *h, PyObject *finish,
                                   PyObject *result, PyObject *finished) {
    static PyObject *no_args;
    if (!no_args && !(no_args = PyTuple_New(0))) return NULL;
    PyTypeObject *wt = wrapper_class(module);
    if (!wt) return NULL;
    PyObject *values[W_SLOTS] = {h, finish, result, finished};
    PyObject *w = wt->tp_new(wt, no_args, NULL);
    if (w && wt == wrapper_type && Py_TYPE(w) == wt) {
        for (int j = 0; j < W_SLOTS; j++) Py_XSETREF(*wrapper_slot(w, j), Py_NewRef(values[j]));
    } else {
        for (int j = 0; w && j < W_SLOTS; j++)
            if (PyObject_SetAttr(w, wrapper_attr[j], values[j]) < 0) Py_CLEAR(w);
    }
    Py_DECREF(wt);
    return w;
}

/* h.wait(block_host): Handle_wait itself for a cring._C.Handle. */
static PyObject *wait_on(module_state *s, PyObject *h, PyObject *block_host) {
    if (Py_IS_TYPE(h, s->HandleType)) return Handle_wait((HandleObject *)h, &block_host, 1);
    static PyObject *wait_name;
    if (!wait_name && !(wait_name = PyUnicode_InternFromString("wait"))) return NULL;
    PyObject *call[2] = {h, block_host};
    return PyObject_VectorcallMethod(wait_name, call, 2 | PY_VECTORCALL_ARGUMENTS_OFFSET, NULL);
}

/* synchronize(handle, block_host=False): cring.synchronize itself (its
 * docstring is in _core.py's Python version, which handles anything but a
 * cring.Handle with all four slots set: `synchronize_fallback`). */
static PyObject *py_synchronize(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                                PyObject *kwnames) {
    static PyObject *fallback_name, *block_host_name;
    module_state *s = cring__pyext_state(module);
    if (!block_host_name && !(block_host_name = PyUnicode_InternFromString("block_host")))
        return NULL;
    PyObject *handle = nargs > 0 ? args[0] : NULL, *block_host = nargs > 1 ? args[1] : Py_False;
    int plain = nargs >= 1 && nargs <= 2;
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    if (nkw == 1 && nargs == 1 && PyTuple_GET_ITEM(kwnames, 0) == block_host_name)
        block_host = args[1];
    else if (nkw) plain = 0;
    if (plain && !wrapper_type) { /* learn the class once (no C allreduce_async_ yet) */
        PyTypeObject *wt = wrapper_class(module);
        if (wt) Py_DECREF(wt);
        else PyErr_Clear();
    }
    PyObject **slots[W_SLOTS];
    if (plain && wrapper_type && Py_IS_TYPE(handle, wrapper_type))
        for (int j = 0; j < W_SLOTS; j++) {
            slots[j] = wrapper_slot(handle, j);
            if (!*slots[j]) plain = 0; /* unset: Python raises the AttributeError */
        }
    else plain = 0;
    if (!plain) {
        if (!fallback_name && !(fallback_name = PyUnicode_InternFromString("synchronize_fallback")))
            return NULL;
        PyObject *fallback = PyObject_GetAttr(module, fallback_name);
        if (!fallback) return NULL;
        PyObject *res = PyObject_Vectorcall(fallback, args, (size_t)nargs, kwnames);
        Py_DECREF(fallback);
        return res;
    }
    int finished = PyObject_IsTrue(*slots[W_FINISHED]);
    if (finished < 0) return NULL;
    int block = finished ? PyObject_IsTrue(block_host) : 0;
    if (block < 0) return NULL;
    if (!finished || block) {
        PyObject *h = Py_NewRef(*slots[W_H]); /* the wait releases the GIL */
        PyObject *r = wait_on(s, h, block_host);
        if (r && !finished) {
            PyObject *finish = *slots[W_FINISH];
            if (finish && finish != Py_None) {
                PyObject *result = PyObject_CallOneArg(finish, h);
                if (!result) Py_CLEAR(r);
                else Py_XSETREF(*slots[W_RESULT], result);
            }
            if (r) Py_XSETREF(*slots[W_FINISHED], Py_NewRef(Py_True));
        }
        Py_DECREF(h);
        if (!r) return NULL;
        Py_DECREF(r);
    }
    PyObject *result = *slots[W_RESULT];
    if (!result) {
        PyErr_SetString(PyExc_AttributeError, "_result");
        return NULL;
    }
    return Py_NewRef(result);
}

/* first_dims(handle, index, size): a module function because the handle does
 * not know the world size. */
static PyObject *py_first_dims(PyObject *module, PyObject *args) {
    module_state *s = cring__pyext_state(module);
    PyObject *hobj;
    int index, size;
    if (!PyArg_ParseTuple(args, "O!ii", s->HandleType, &hobj, &index, &size)) return NULL;
    const int64_t *dims;
    size_t bytes;
    if (!handle_result((HandleObject *)hobj, index, &bytes, &dims)) return NULL;
    PyObject *list = PyList_New(size);
    for (int r = 0; list && r < size; r++) PyList_SET_ITEM(list, r, PyLong_FromLongLong(dims[r]));
    return list;
}

PyMethodDef cring__pyext_handle_functions[] = {
    {"first_dims", py_first_dims, METH_VARARGS, "first_dims(handle, index, size)"},
    {"synchronize", (PyCFunction)(void (*)(void))py_synchronize, METH_FASTCALL | METH_KEYWORDS,
     "synchronize($module, /, handle, block_host=False)\n--\n\n"
     "Wait for the collective and return its result (the output tensor, or\n"
     "a list for grouped calls); raise its error (MismatchError, ...). The wait\n"
     "runs signal handlers: Ctrl-C raises KeyboardInterrupt at once, and the\n"
     "collective then counts as dropped.\n\n"
     "CUDA tensors (the NCCL path): returns once the collective is enqueued on\n"
     "cring's stream, with the caller's current stream made to wait for it, as\n"
     "torch.distributed's work.wait() does: kernels queued afterwards see the\n"
     "result, and the host does not wait for the GPU. block_host=True also waits\n"
     "on this thread until the GPU has finished it (as Horovod's synchronize\n"
     "did); needed only to read the result from the host without a stream sync,\n"
     "or to time it."},
    {NULL, NULL, 0, NULL}};

int cring__pyext_handles_init(PyObject *m, module_state *s) {
    s->OutputBufferType = (PyTypeObject *)PyType_FromModuleAndSpec(m, &OutputBuffer_spec, NULL);
    if (!s->OutputBufferType) return -1;
    s->HandleType = (PyTypeObject *)PyType_FromModuleAndSpec(m, &Handle_spec, NULL);
    if (!s->HandleType) return -1;
    if (PyModule_AddObjectRef(m, "Handle", (PyObject *)s->HandleType) < 0) return -1;
    return PyModule_AddFunctions(m, cring__pyext_handle_functions);
}

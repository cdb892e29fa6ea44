/* submit.c: building engine requests from Python arguments: submit() for
 * every collective (on the global engine, or a process set's from
 * process_sets.c), the in-place allreduce fast paths (global set only:
 * allreduce_ for NumPy arrays and torch tensors on the CPU or CUDA,
 * allreduce_async_ for torch CUDA tensors; cring.torch's allreduce_,
 * allreduce_async_ and allreduce_async resolved into them or into
 * submit_small.c's allreduce_async), and the small DLPack utilities
 * (tensor_info, copy). The names of unnamed calls are noname.c's. Arguments are bound and checked once, here or in the
 * engine's validation (whose statuses errors.c maps); no waiting logic (handles.c). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#include "pyext.h"

#define STACK_TENSORS 4

static int same_layout(const cring__dl_ref_t *a, const cring__dl_ref_t *b, const char *name) {
    if (a->dtype != b->dtype || a->numel != b->numel) {
        PyErr_Format(PyExc_ValueError,
                     "tensor '%s': output has %zu elements of %s, input %zu of %s", name, b->numel,
                     cring_dtype_name(b->dtype), a->numel, cring_dtype_name(a->dtype));
        return -1;
    }
    return 0;
}

/* The reduction op an argument names (an int, a cring.ReduceOp or anything
 * with __index__; None is Average), or -1 with ValueError.
 * The engine checks that the op can reduce each tensor's dtype. */
int cring__pyext_parse_op(PyObject *obj) {
    if (!obj || obj == Py_None) return CRING_AVERAGE;
    long op = -1;
    if (PyLong_Check(obj) || (!PyFloat_Check(obj) && PyIndex_Check(obj))) {
        op = PyLong_Check(obj) ? PyLong_AsLong(obj) : -1;
        if (!PyLong_Check(obj)) {
            PyObject *index = PyNumber_Index(obj);
            op = index ? PyLong_AsLong(index) : -1;
            Py_XDECREF(index);
        }
        if (op == -1 && PyErr_Occurred()) PyErr_Clear();
        else if (op >= 0 && op < CRING_OP_COUNT) {
            return (int)op;
        }
    }
    PyErr_Format(PyExc_ValueError,
                 "unknown reduction op %R; use cring.Sum, Average, Min, Max, Product or Adasum",
                 obj);
    return -1;
}

/* On an interrupted wait-here: the views may live on the stack; move them to
 * the heap and hand them to the dropped list with the handle. */
static void drop_views(module_state *s, cring_handle_t *h, cring__dl_ref_t *views, int n,
                       const cring_device_t *device) {
    int cuda_device = device->type == CRING_DEVICE_CUDA ? device->id : -1;
    cring__dl_ref_t *kept = n ? PyMem_Calloc((size_t)n, sizeof *kept) : NULL;
    if (n && !kept) { /* nowhere to keep them: wait, then release */
        Py_BEGIN_ALLOW_THREADS cring_handle_wait(h);
        Py_END_ALLOW_THREADS if (cuda_device >= 0)
            cring__pyext_cuda_order_release(h, cuda_device, device->stream);
        cring_handle_free(h);
        for (int i = 0; i < n; i++) cring__dl_release(&views[i]);
        return;
    }
    if (n) memcpy(kept, views, sizeof *kept * (size_t)n); /* release() reads no inner pointer */
    memset(views, 0, sizeof *views * (size_t)n);
    cring__pyext_drop(s, h, kept, n, cuda_device, device->stream);
}

/* Submit, wait (running signal handlers) and report; views are the request's
 * tensor views: released here (cring__pyext_release_after: a CUDA request's
 * once cring's stream has run its work) and *nviews set to 0, except with
 * keep on success, where the caller releases them (the same way) after
 * using them. A CUDA request's stream (the caller's) then waits on its
 * completion, failed or not: no host wait for the device. Returns 0, or -1
 * with the error set. */
int cring__pyext_submit_wait_here(module_state *s, cring_engine_t *engine,
                                  const cring_request_t *req, cring__dl_ref_t *views, int *nviews) {
    return cring__pyext_submit_wait_keep(s, engine, req, views, nviews, NULL);
}

int cring__pyext_submit_wait_keep(module_state *s, cring_engine_t *engine,
                                  const cring_request_t *req, cring__dl_ref_t *views, int *nviews,
                                  cring_handle_t **keep) {
    cring_handle_t *handle;
    if (s->dropped) cring__pyext_sweep(s, 0);
    cring_status_t st = cring_engine_submit(engine, req, &handle);
    if (st != CRING_OK) { /* nothing was queued: the views go now */
        for (int i = 0; i < *nviews; i++) cring__dl_release(&views[i]);
        *nviews = 0;
        cring__pyext_raise_submit(s, st, req->collective, req->name);
        return -1;
    }
    if (!cring__pyext_wait(handle, &st)) { /* interrupted: the request counts as dropped */
        drop_views(s, handle, views, *nviews, &req->device);
        *nviews = 0;
        return -1;
    }
    int rc = 0;
    if (st == CRING_OK && req->device.type == CRING_DEVICE_CUDA)
        rc = cring__pyext_cuda_after(s, handle, req->name, req->device.id, req->device.stream,
                                     req->device.stream, 0);
    else if (st != CRING_OK) {
        if (req->device.type == CRING_DEVICE_CUDA) /* what it queued runs before the caller's */
            cring__pyext_cuda_order_release(handle, req->device.id, req->device.stream);
        cring__pyext_raise_handle(s, handle, st, req->collective, req->name);
        rc = -1;
    }
    if (keep && rc == 0) {
        *keep = handle;
        return 0;
    }
    cring__pyext_release_after(s, cring_handle_device_event(handle), views, *nviews);
    *nviews = 0;
    cring_handle_free(handle);
    return rc;
}

int cring__pyext_is_one(PyObject *x) {
    return !x || (PyFloat_CheckExact(x) && PyFloat_AS_DOUBLE(x) == 1.0) ||
           (PyLong_CheckExact(x) && PyLong_AsLong(x) == 1);
}

/* The arguments of allreduce_/allreduce_async_ (tensor, op=Average,
 * name=None, compression=None, prescale_factor=1.0, postscale_factor=1.0)
 * bound into v without a Python frame. 1 when a fast path may take the call
 * (a tensor, a str name, no compression, no scaling); 0 when it goes to the
 * Python fallback (which also raises the TypeErrors of bad keywords). */
enum { NPARAMS = 6 };
static int bind_allreduce(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                          PyObject **v) {
    static const char *const names[] = {
        "tensor", "op", "name", "compression", "prescale_factor", "postscale_factor"};
    static PyObject *interned[NPARAMS]; /* call sites' keywords are interned: compare pointers */
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    int fast = nargs <= NPARAMS;
    for (int j = 0; j < NPARAMS && !interned[j]; j++)
        if (!(interned[j] = PyUnicode_InternFromString(names[j]))) return -1;
    for (Py_ssize_t i = 0; fast && i < nargs; i++) v[i] = args[i];
    for (Py_ssize_t k = 0; fast && k < nkw; k++) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, k);
        int j = 0;
        while (j < NPARAMS && key != interned[j]) j++;
        if (j == NPARAMS) /* not interned: compare the text */
            while (--j >= 0 && PyUnicode_CompareWithASCIIString(key, names[j]) != 0) {
            }
        if (j < 0 || v[j]) fast = 0; /* the fallback raises the TypeError */
        else v[j] = args[nargs + k];
    }
    return fast && v[0] && (!v[2] || v[2] == Py_None || PyUnicode_CheckExact(v[2])) &&
           (!v[3] || v[3] == Py_None) && cring__pyext_is_one(v[4]) && cring__pyext_is_one(v[5]);
}

/* Call the module's Python fallback attribute `attr` with the call's arguments. */
static PyObject *fall_back(PyObject *module, PyObject **attr_name, const char *attr,
                           PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    if (!*attr_name && !(*attr_name = PyUnicode_InternFromString(attr))) return NULL;
    PyObject *fallback = PyObject_GetAttr(module, *attr_name);
    if (!fallback) return NULL;
    PyObject *res = PyObject_Vectorcall(fallback, args, (size_t)nargs, kwnames);
    Py_DECREF(fallback);
    return res;
}

/* The request of an in-place allreduce of one tensor view. */
static void one_tensor_request(cring_request_t *req, cring_tensor_t *t, int64_t *one,
                               const cring__dl_ref_t *ref, const char *name, int op) {
    *one = 1;
    *t = (cring_tensor_t){.send = ref->data,
                          .recv = ref->data,
                          .dtype = ref->dtype,
                          .ndim = ref->t->ndim,
                          .shape = ref->t->ndim ? ref->t->shape : one};
    *req = (cring_request_t){.name = name,
                             .collective = CRING_COLL_ALLREDUCE,
                             .op = (cring_op_t)op,
                             .prescale = 1.0,
                             .postscale = 1.0,
                             .compression = CRING_DTYPE_COUNT,
                             .ntensors = 1,
                             .tensors = t};
}

/* allreduce_(tensor, op=Average, name=None, compression=None, prescale_factor=1.0,
 * postscale_factor=1.0): cring.allreduce_ itself. A NumPy array or torch
 * tensor (CPU, or CUDA on the NCCL path) with a name and no compression or
 * scaling is reduced here, bound once, without a Python frame (a CUDA one:
 * an event on the caller's current stream, the engine's NCCL work after it,
 * and that stream ordered after the result; no host wait for the device);
 * everything else (other libraries' tensors, names to generate, compression,
 * scaling, host staging) goes to cring._api._allreduce_inplace_general,
 * which the module's `allreduce_fallback` attribute holds. */
static PyObject *py_allreduce_(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                               PyObject *kwnames) {
    static PyObject *fallback_name;
    module_state *s = cring__pyext_state(module);
    PyObject *v[NPARAMS] = {0};
    int fast = bind_allreduce(args, nargs, kwnames, v);
    if (fast < 0 || (fast && cring__dl_refuse_grad_leaf(v[0], "allreduce_") < 0)) return NULL;
    if (fast) {
        int op = cring__pyext_parse_op(v[1]);
        if (op < 0) return NULL;
        if (!s->engine) return cring__pyext_not_initialized(s);
        char generated[64];
        int unnamed = !v[2] || v[2] == Py_None;
        const char *name = unnamed ? generated : PyUnicode_AsUTF8(v[2]);
        if (!name ||
            (unnamed && cring__pyext_noname("allreduce", generated, sizeof generated, 0) < 0))
            return NULL;
        cring__dl_ref_t ref;
        int taken = cring__dl_acquire_fast(v[0], name, 1, 1, &ref);
        if (taken < 0) return NULL;
        if (taken && ref.t->device.device_type == CRING_DL_CUDA && !cring__pyext_cuda_fast_ok()) {
            cring__dl_release(&ref); /* the Python path loads NCCL or stages through the host */
            taken = 0;
        }
        if (taken) {
            int64_t one;
            cring_tensor_t t;
            cring_request_t req;
            if (unnamed) cring__pyext_noname("allreduce", generated, sizeof generated, 1);
            one_tensor_request(&req, &t, &one, &ref, name, op);
            /* by the name, as the Python path does: every rank flags a name alike */
            req.flags = CRING_REQUEST_CALLER_WAITS |
                        (cring__pyext_is_generated(name) ? CRING_REQUEST_SEQUENCED : 0);
            if (ref.t->device.device_type == CRING_DL_CUDA &&
                cring__pyext_cuda_device_of(&ref, &req.device) < 0) {
                cring__dl_release(&ref);
                return NULL;
            }
            int nviews = 1;
            int rc = cring__pyext_submit_wait_here(s, s->engine, &req, &ref, &nviews);
            if (nviews) cring__dl_release(&ref);
            return rc < 0 ? NULL : Py_NewRef(v[0]);
        }
    }
    return fall_back(module, &fallback_name, "allreduce_fallback", args, nargs, kwnames);
}

/* allreduce_async_(tensor, op=Average, name=None, ...): cring.allreduce_async_
 * itself. A NumPy array, a CPU torch tensor or a torch CUDA tensor on the
 * NCCL path, without compression or scaling, is queued here without a
 * Python frame (a CUDA one after an event on the caller's current stream):
 * the request, and a cring.Handle (the class the module's `handle_wrapper`
 * attribute holds) whose synchronize() returns the tensor. Unnamed calls get
 * the next generated name. Everything else goes to the module's
 * `allreduce_async_fallback`. */
static PyObject *py_allreduce_async_(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                                     PyObject *kwnames) {
    static PyObject *fallback_name;
    module_state *s = cring__pyext_state(module);
    PyObject *v[NPARAMS] = {0};
    static PyObject *is_cuda_name;
    if (!is_cuda_name && !(is_cuda_name = PyUnicode_InternFromString("is_cuda"))) return NULL;
    int fast = bind_allreduce(args, nargs, kwnames, v);
    if (fast < 0 || (fast && cring__dl_refuse_grad_leaf(v[0], "allreduce_async_") < 0)) return NULL;
    int cuda = 0; /* a torch CUDA tensor on the NCCL path; else a NumPy array or CPU tensor */
    if (!fast || !s->engine) {
        fast = 0;
    } else if (cring__dl_is_ndarray(v[0])) {
        fast = 1; /* the common case first: no torch type checks */
    } else if (cring__dl_is_torch(v[0])) {
        PyObject *is_cuda = PyObject_GetAttr(v[0], is_cuda_name);
        cuda = is_cuda == Py_True;
        fast = is_cuda != NULL && (!cuda || cring__pyext_cuda_fast_ok());
        Py_XDECREF(is_cuda);
        PyErr_Clear();
    } else {
        fast = 0;
    }
    cring__dl_ref_t *ref = NULL;
    int taken = 0, unnamed = !v[2] || v[2] == Py_None;
    char generated[64];
    const char *name = NULL;
    int op = -1;
    if (fast && (op = cring__pyext_parse_op(v[1])) >= 0 &&
        (name = unnamed ? (cring__pyext_noname("allreduce", generated, sizeof generated, 0) < 0
                               ? NULL
                               : generated)
                        : PyUnicode_AsUTF8(v[2])) &&
        (ref = PyMem_Calloc(1, sizeof *ref)))
        taken = cring__dl_acquire_fast(v[0], name, 1, cuda, ref);
    if (PyErr_Occurred()) {
        PyMem_Free(ref);
        return NULL;
    }
    if (taken && (ref->t->device.device_type == CRING_DL_CUDA) != cuda) { /* Python's route */
        cring__dl_release(ref);
        taken = 0;
    }
    if (!taken) {
        PyMem_Free(ref);
        return fall_back(module, &fallback_name, "allreduce_async_fallback", args, nargs, kwnames);
    }
    if (unnamed) cring__pyext_noname("allreduce", generated, sizeof generated, 1);
    int64_t one;
    cring_tensor_t t;
    cring_request_t req;
    one_tensor_request(&req, &t, &one, ref, name, op);
    if (cring__pyext_is_generated(name))
        req.flags = CRING_REQUEST_SEQUENCED; /* as the Python path: by name */
    if (cuda && cring__pyext_cuda_device_of(ref, &req.device) < 0) goto fail;
    if (s->dropped) cring__pyext_sweep(s, 0);
    cring_handle_t *handle;
    cring_status_t st = cring_engine_submit(s->engine, &req, &handle);
    if (st != CRING_OK) {
        cring__pyext_raise_submit(s, st, CRING_COLL_ALLREDUCE, name);
        goto fail;
    }
    HandleObject *h =
        (HandleObject *)cring__pyext_handle_new(s, handle, ref, 1, CRING_COLL_ALLREDUCE, name);
    if (!h) return NULL; /* it took the view */
    if (cuda) {
        h->cuda_device = req.device.id;
        h->cuda_torch = 1;
        h->cuda_stream = req.device.stream;
    }
    PyObject *w = cring__pyext_wrap_handle(module, (PyObject *)h, Py_None, v[0], Py_False);
    Py_DECREF(h); /* the wrapper holds it; without one, dropping it never waits */
    return w;
fail:
    cring__dl_release(ref);
    PyMem_Free(ref);
    return NULL;
}

/* cring.torch's allreduce_(tensor, average=None, name=None, op=None,
 * prescale_factor=1.0, postscale_factor=1.0, process_set=global_process_set),
 * allreduce_async_ and allreduce_async (out of place): Horovod's arguments
 * resolved here (op None is Average), then cring's own allreduce_,
 * allreduce_async_ or allreduce_async (submit_small.c), so a torch tensor
 * reaches the queue from cring.torch without a Python frame too.
 * cring's errors are raised as cring.torch raises them (the module's
 * `torch_error_hook`, cring.torch's _internal_error: a replacement or None).
 * A deprecated `average`, another process set or a keyword cring does not
 * know goes to the Python function (`torch_allreduce_fallback`,
 * `torch_allreduce_async_fallback`, `torch_allreduce_async_out_fallback`). */
static void torch_wrap_error(PyObject *module) {
    static PyObject *hook_name;
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (tb && value) PyException_SetTraceback(value, tb);
    if (!hook_name && !(hook_name = PyUnicode_InternFromString("torch_error_hook"))) goto restore;
    PyObject *hook = PyObject_GetAttr(module, hook_name);
    PyObject *wrapped = hook ? PyObject_CallOneArg(hook, value) : NULL;
    Py_XDECREF(hook);
    if (!wrapped) { /* the hook's own error stands */
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
        return;
    }
    if (wrapped == Py_None || !PyExceptionInstance_Check(wrapped)) {
        Py_DECREF(wrapped);
        goto restore;
    }
    PyException_SetCause(wrapped, Py_NewRef(value)); /* raise wrapped from value */
    PyErr_SetObject((PyObject *)Py_TYPE(wrapped), wrapped);
    Py_DECREF(wrapped);
    Py_XDECREF(type);
    Py_XDECREF(value);
    Py_XDECREF(tb);
    return;
restore:
    PyErr_Restore(type, value, tb);
}

enum { TORCH_SYNC_INPLACE, TORCH_ASYNC_INPLACE, TORCH_ASYNC_OUT, TORCH_MODES };

static PyObject *torch_forward(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                               PyObject *kwnames, int mode) {
    static const char *const names[] = {"tensor",          "average",          "name",       "op",
                                        "prescale_factor", "postscale_factor", "process_set"};
    enum { N = 7 };
    static const char *const fallbacks[TORCH_MODES] = {"torch_allreduce_fallback",
                                                       "torch_allreduce_async_fallback",
                                                       "torch_allreduce_async_out_fallback"};
    static PyObject *interned[N], *fallback_names[TORCH_MODES], *global_name, *one, *average;
    PyObject *v[N] = {0};
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    int fast = nargs <= N;
    for (int j = 0; j < N && !interned[j]; j++)
        if (!(interned[j] = PyUnicode_InternFromString(names[j]))) return NULL;
    if (!one && !(one = PyFloat_FromDouble(1.0))) return NULL;
    if (!average && !(average = PyLong_FromLong(CRING_AVERAGE))) return NULL;
    if (!global_name && !(global_name = PyUnicode_InternFromString("torch_global_process_set")))
        return NULL;
    for (Py_ssize_t i = 0; fast && i < nargs; i++) v[i] = args[i];
    for (Py_ssize_t k = 0; fast && k < nkw; k++) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, k);
        int j = 0;
        while (j < N && key != interned[j]) j++;
        if (j == N)
            while (--j >= 0 && PyUnicode_CompareWithASCIIString(key, names[j]) != 0) {
            }
        if (j < 0 || v[j]) fast = 0;
        else v[j] = args[nargs + k];
    }
    fast = fast && v[0] && (!v[1] || v[1] == Py_None);
    if (fast && v[6]) {
        PyObject *global = PyObject_GetAttr(module, global_name);
        fast = global && v[6] == global;
        Py_XDECREF(global);
        PyErr_Clear();
    }
    if (!fast)
        return fall_back(module, &fallback_names[mode], fallbacks[mode], args, nargs, kwnames);
    PyObject *forward[6] = {v[0],
                            v[3] && v[3] != Py_None ? v[3] : average,
                            v[2] ? v[2] : Py_None,
                            Py_None,
                            v[4] ? v[4] : one,
                            v[5] ? v[5] : one};
    PyObject *res = mode == TORCH_ASYNC_OUT ? cring__pyext_allreduce_async(module, forward, 6, NULL)
                    : mode == TORCH_ASYNC_INPLACE ? py_allreduce_async_(module, forward, 6, NULL)
                                                  : py_allreduce_(module, forward, 6, NULL);
    if (!res) torch_wrap_error(module);
    return res;
}

static PyObject *py_torch_allreduce_(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                                     PyObject *kwnames) {
    return torch_forward(module, args, nargs, kwnames, TORCH_SYNC_INPLACE);
}

static PyObject *py_torch_allreduce_async_(PyObject *module, PyObject *const *args,
                                           Py_ssize_t nargs, PyObject *kwnames) {
    return torch_forward(module, args, nargs, kwnames, TORCH_ASYNC_INPLACE);
}

static PyObject *py_torch_allreduce_async(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                                          PyObject *kwnames) {
    return torch_forward(module, args, nargs, kwnames, TORCH_ASYNC_OUT);
}

/* A CUDA call's tensors share one device: the first sets device->id, the
 * others (index > 0) must match. Returns 0, or -1 with ValueError. */
static int cuda_device(const cring__dl_ref_t *ref, Py_ssize_t index, cring_device_t *device,
                       const char *name) {
    int id = ref->t->device.device_id;
    if (index == 0) device->id = id;
    if (id == device->id) return 0;
    PyErr_Format(PyExc_ValueError,
                 "tensor '%s': every tensor of one call must be on the same CUDA device, got "
                 "cuda:%d and cuda:%d",
                 name, device->id, id);
    return -1;
}

/* submit(collective, name, tensors, op, root, prescale, postscale, compression,
 *        caller_waits[, splits[, stream[, process_set]]]) -> Handle, or None once done when
 *        caller_waits is 2
 * tensors: list of (send, recv) pairs; recv None for allgather and alltoall
 * (splits: None or one row count per rank; a CUDA allgather may lend room of
 * size x send's elements, cring.h), recv is send
 * for in-place operations. op: as for allreduce_ (ignored unless the
 * collective reduces). caller_waits: 0 async, 1 the caller will wait on
 * the handle, 2 wait here (a synchronous call that needs no output copy; it
 * allocates nothing on the Python heap for up to STACK_TENSORS tensors).
 * stream: None for CPU tensors; for CUDA tensors the cudaStream_t (an int, 0
 * the legacy default stream) the caller's work is ordered on: the tensors are
 * exported for it and the engine's CUDA backend enqueues on it.
 * process_set: a process set's id (0, the default: the global set); its own
 * engine runs the request, ranks (root, splits) count within the set, and
 * root is given as a global rank (Horovod's rule). */
static PyObject *py_submit(PyObject *module, PyObject *args) {
    module_state *s = cring__pyext_state(module);
    int coll, root, caller_waits, process_set = 0;
    const char *name, *compression;
    PyObject *list, *op_obj, *splits_obj = Py_None, *stream_obj = Py_None;
    double prescale, postscale;
    if (!PyArg_ParseTuple(args, "isO!Oiddzi|OOi", &coll, &name, &PyList_Type, &list, &op_obj, &root,
                          &prescale, &postscale, &compression, &caller_waits, &splits_obj,
                          &stream_obj, &process_set))
        return NULL;
    int reduces = coll == CRING_COLL_ALLREDUCE || coll == CRING_COLL_REDUCESCATTER;
    int op = reduces ? cring__pyext_parse_op(op_obj)
                     : 0; /* an argument error before "not initialized" */
    if (op < 0) return NULL;
    if (coll == CRING_COLL_REDUCESCATTER && op == CRING_ADASUM) {
        /* a RuntimeError, as Horovod raises (its suite checks the class) */
        PyErr_Format(PyExc_NotImplementedError,
                     "tensor '%s': reducescatter does not support Adasum; use Sum or Average",
                     name);
        return NULL;
    }
    if (!s->engine) return cring__pyext_not_initialized(s);
    cring_engine_t *engine = s->engine;
    if (process_set != 0) { /* process_sets.c: another set's engine, or the error */
        const cring__pyext_pset_t *set;
        if (!(engine = cring__pyext_pset_engine(s, process_set, &set))) return NULL;
        if (coll == CRING_COLL_BROADCAST && (root = cring__pyext_pset_root(s, set, root, name)) < 0)
            return NULL;
        if (coll == CRING_COLL_JOIN) {
            PyErr_SetString(PyExc_ValueError,
                            "join() runs on the global process set only (as in Horovod)");
            return NULL;
        }
    }
    int size = cring_comm_size(cring_engine_comm(engine));
    int rank = cring_comm_rank(cring_engine_comm(engine));
    Py_ssize_t n = PyList_GET_SIZE(list);
    if (coll == CRING_COLL_BROADCAST && (root < 0 || root >= size)) {
        /* checked before reading the tensors, in the words Horovod users know */
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
    cring_device_t device = {.type = CRING_DEVICE_CPU};
    cring__dl_device_t kind = CRING__DL_HOST;
    PyObject *dl_stream = NULL; /* what __dlpack__(stream=...) gets: 1 is the legacy default */
    if (stream_obj != Py_None) {
        unsigned long long raw = PyLong_AsUnsignedLongLong(stream_obj);
        if (raw == (unsigned long long)-1 && PyErr_Occurred()) return NULL;
        device = (cring_device_t){.type = CRING_DEVICE_CUDA, .stream = (void *)(uintptr_t)raw};
        kind = CRING__DL_CUDA;
        if (!(dl_stream = PyLong_FromUnsignedLongLong(raw ? raw : 1))) return NULL;
    }
    cring__dl_ref_t stack_refs[2 * STACK_TENSORS];
    cring_tensor_t stack_ts[STACK_TENSORS];
    int64_t stack_scalars[STACK_TENSORS];
    int on_stack = caller_waits == 2 && n <= STACK_TENSORS;
    cring__dl_ref_t *refs = on_stack ? stack_refs : PyMem_Calloc((size_t)(2 * n + 1), sizeof *refs);
    cring_tensor_t *ts = on_stack ? stack_ts : PyMem_Calloc((size_t)(n + 1), sizeof *ts);
    int64_t *scalar_shapes =
        on_stack ? stack_scalars : PyMem_Calloc((size_t)(n + 1), sizeof(int64_t));
    int nrefs = 0;
    PyObject *result = NULL;
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
        cring__dl_ref_t *in = &refs[nrefs];
        if ((kind == CRING__DL_CUDA
                 ? cring__pyext_acquire_cuda(send_obj, dl_stream, device.stream, name, needs_write,
                                             in)
                 : cring__dl_acquire(send_obj, dl_stream, name, needs_write, kind, in)) < 0)
            goto done;
        nrefs++;
        if (kind == CRING__DL_CUDA && cuda_device(in, i, &device, name) < 0) goto done;
        cring__dl_ref_t *out = in;
        if (!in_place && recv_obj != Py_None) {
            out = &refs[nrefs];
            if ((kind == CRING__DL_CUDA
                     ? cring__pyext_acquire_cuda(recv_obj, dl_stream, device.stream, name, 1, out)
                     : cring__dl_acquire(recv_obj, dl_stream, name, 1, kind, out)) < 0)
                goto done;
            nrefs++;
            if (kind == CRING__DL_CUDA && cuda_device(out, 1, &device, name) < 0) goto done;
            if (coll == CRING_COLL_ALLGATHER) { /* room lent for the result (CUDA) */
                if (out->dtype != in->dtype || out->numel != (size_t)size * in->numel) {
                    PyErr_Format(PyExc_ValueError,
                                 "tensor '%s': room for the allgather has %zu elements of %s, "
                                 "not %d x %zu of %s",
                                 name, out->numel, cring_dtype_name(out->dtype), size, in->numel,
                                 cring_dtype_name(in->dtype));
                    goto done;
                }
            } else if (coll != CRING_COLL_REDUCESCATTER && same_layout(in, out, name) < 0)
                goto done;
            if (coll == CRING_COLL_REDUCESCATTER && out->dtype != in->dtype) {
                PyErr_Format(PyExc_ValueError, "tensor '%s': output dtype differs", name);
                goto done;
            }
        }
        ts[i].send = in->data;
        /* allgather and alltoall: recv is room lent for the result, or none */
        ts[i].recv = out == in && (coll == CRING_COLL_ALLGATHER || coll == CRING_COLL_ALLTOALL)
                         ? NULL
                         : out->data;
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
    if (process_set != 0) { /* reading the tensors ran Python: the set may be gone */
        const cring__pyext_pset_t *set;
        if (!(engine = cring__pyext_pset_engine(s, process_set, &set))) goto done;
    }
    cring_request_t req = {.name = name,
                           .collective = (cring_collective_t)coll,
                           .op = (cring_op_t)op,
                           .root = root,
                           .prescale = prescale,
                           .postscale = postscale,
                           .compression = comp,
                           .ntensors = (int)n,
                           .tensors = ts,
                           .flags = (caller_waits ? CRING_REQUEST_CALLER_WAITS : 0) |
                                    (cring__pyext_is_generated(name) ? CRING_REQUEST_SEQUENCED : 0),
                           .splits = splits,
                           .device = device};
    if (caller_waits == 2) {
        if (cring__pyext_submit_wait_here(s, engine, &req, refs, &nrefs) == 0)
            result = Py_NewRef(Py_None);
        goto done; /* the views are released below, after the engine is done */
    }
    if (s->dropped) cring__pyext_sweep(s, 0);
    cring_handle_t *handle;
    cring_status_t st = cring_engine_submit(engine, &req, &handle);
    if (st != CRING_OK) {
        cring__pyext_raise_submit(s, st, coll, name);
        goto done;
    }
    PyObject *first_tensor = n ? PyTuple_GET_ITEM(PyList_GET_ITEM(list, 0), 0) : NULL;
    result = cring__pyext_handle_new(s, handle, refs, nrefs, coll, name); /* takes the views */
    if (result && device.type == CRING_DEVICE_CUDA) {
        HandleObject *h = (HandleObject *)result;
        h->cuda_device = device.id;
        h->cuda_torch = first_tensor && cring__dl_is_torch(first_tensor);
        h->cuda_stream = device.stream;
    }
    refs = NULL;
    nrefs = 0;
done:
    Py_XDECREF(dl_stream);
    PyMem_Free(splits);
    for (int i = 0; i < nrefs; i++) cring__dl_release(&refs[i]);
    if (!on_stack) {
        PyMem_Free(refs);
        PyMem_Free(ts);
        PyMem_Free(scalar_shapes);
    }
    return result;
}

/* Describe a tensor as cring sees it: (shape, dtype name, read_only). */
static PyObject *py_tensor_info(PyObject *module, PyObject *args) {
    PyObject *obj;
    const char *name = "tensor";
    if (!PyArg_ParseTuple(args, "O|s", &obj, &name)) return NULL;
    cring__dl_ref_t ref;
    if (cring__dl_acquire(obj, NULL, name, 0, CRING__DL_HOST, &ref) < 0) return NULL;
    PyObject *shape = PyTuple_New(ref.t->ndim);
    for (int i = 0; shape && i < ref.t->ndim; i++)
        PyTuple_SET_ITEM(shape, i, PyLong_FromLongLong(ref.t->shape[i]));
    PyObject *res = shape ? Py_BuildValue("(Nsi)", shape, cring_dtype_name(ref.dtype),
                                          (ref.flags & CRING_DL_FLAG_READ_ONLY) != 0)
                          : NULL;
    cring__dl_release(&ref);
    return res;
}

/* copy(src, dst): dst[...] = src[...] for tensors of equal dtype and size. */
static PyObject *py_copy(PyObject *module, PyObject *args) {
    PyObject *src_obj, *dst_obj;
    const char *name = "tensor";
    if (!PyArg_ParseTuple(args, "OO|s", &src_obj, &dst_obj, &name)) return NULL;
    cring__dl_ref_t src = {0}, dst = {0};
    PyObject *res = NULL;
    if (cring__dl_acquire(src_obj, NULL, name, 0, CRING__DL_HOST, &src) < 0) goto done;
    if (cring__dl_acquire(dst_obj, NULL, name, 1, CRING__DL_HOST, &dst) < 0) goto done;
    if (same_layout(&src, &dst, name) < 0) goto done;
    if (src.data != dst.data) memmove(dst.data, src.data, src.numel * cring_dtype_size(src.dtype));
    res = Py_NewRef(Py_None);
done:
    cring__dl_release(&src);
    cring__dl_release(&dst);
    return res;
}

PyMethodDef cring__pyext_submit_functions[] = {
    {"allreduce_", (PyCFunction)(void (*)(void))py_allreduce_, METH_FASTCALL | METH_KEYWORDS,
     "allreduce_($module, /, tensor, op=0, name=None, compression=None, prescale_factor=1.0,\n"
     "           postscale_factor=1.0)\n--\n\n"
     "Reduce `tensor` over all ranks in place and return the same object.\n"
     "op: cring.Average (0, the default, as in Horovod), Sum, Min, Max or Product."},
    {"allreduce_async_", (PyCFunction)(void (*)(void))py_allreduce_async_,
     METH_FASTCALL | METH_KEYWORDS,
     "allreduce_async_($module, /, tensor, op=0, name=None, compression=None,\n"
     "                 prescale_factor=1.0, postscale_factor=1.0)\n--\n\n"
     "Start an in-place allreduce; synchronize() returns the tensor itself."},
    {"torch_allreduce_", (PyCFunction)(void (*)(void))py_torch_allreduce_,
     METH_FASTCALL | METH_KEYWORDS,
     "cring.torch.allreduce_ (Horovod's arguments) forwarded to allreduce_ in C"},
    {"torch_allreduce_async_", (PyCFunction)(void (*)(void))py_torch_allreduce_async_,
     METH_FASTCALL | METH_KEYWORDS,
     "cring.torch.allreduce_async_ (Horovod's arguments) forwarded to allreduce_async_ in C"},
    {"torch_allreduce_async", (PyCFunction)(void (*)(void))py_torch_allreduce_async,
     METH_FASTCALL | METH_KEYWORDS,
     "cring.torch.allreduce_async (Horovod's arguments) forwarded to allreduce_async in C"},
    {"submit", py_submit, METH_VARARGS,
     "submit(collective, name, [(send, recv), ...], op, root, prescale, postscale, "
     "compression, caller_waits[, splits[, stream[, process_set]]]) -> Handle"},
    {"noname", cring__pyext_py_noname, METH_O,
     "noname(kind) -> the next name of an unnamed call of that kind"},
    {"noname_reset", cring__pyext_py_noname_reset, METH_VARARGS,
     "noname_reset([suffix]): count unnamed calls (of kinds ending in suffix) from 0 again"},
    {"tensor_info", py_tensor_info, METH_VARARGS, "(shape, dtype name, read_only) via DLPack"},
    {"copy", py_copy, METH_VARARGS, "copy(src, dst[, name]): copy between DLPack tensors"},
    {NULL, NULL, 0, NULL}};

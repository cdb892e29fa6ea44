/* submit_small.c: the C fast paths of cring.broadcast_ (NumPy arrays and CPU
 * torch tensors) and cring.allgather (NumPy arrays; torch CUDA tensors in
 * submit_cuda.c): arguments bound without
 * a Python frame, the request submitted and waited on here; a small one
 * rides the engine's negotiation round. And cring.allreduce_async, the
 * out-of-place form (NumPy arrays and CPU torch tensors): the output
 * allocated and the request queued here, the engine reading the input and
 * writing the output directly, and cring.allreduce, the same waited on
 * here. Everything else goes to the Python
 * implementation the module's *_fallback attributes hold. No waiting logic
 * (handles.c) and no argument checks of its own beyond choosing the path. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#include "pyext.h"

/* Results up to this size are copied into a new NumPy array (cheaper than
 * wrapping the engine's memory); larger ones are lent as a view. */
#define COPY_RESULT_MAX_BYTES (256u << 10)

/* Bind positional and keyword arguments to the n parameters `names`
 * (interned once; call sites' keywords are interned: compare pointers).
 * 1 when bound, 0 when the Python fallback must take the call (it raises
 * the TypeErrors of bad arguments), -1 with an error set. */
static int bind(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames,
                const char *const *names, PyObject **interned, int n, PyObject **v) {
    for (int j = 0; j < n && !interned[j]; j++)
        if (!(interned[j] = PyUnicode_InternFromString(names[j]))) return -1;
    if (nargs > n) return 0;
    for (Py_ssize_t i = 0; i < nargs; i++) v[i] = args[i];
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t k = 0; k < nkw; k++) {
        PyObject *key = PyTuple_GET_ITEM(kwnames, k);
        int j = 0;
        while (j < n && key != interned[j]) j++;
        if (j == n) /* not interned: compare the text */
            while (--j >= 0 && PyUnicode_CompareWithASCIIString(key, names[j]) != 0) {
            }
        if (j < 0 || v[j]) return 0;
        v[j] = args[nargs + k];
    }
    return 1;
}

static PyObject *fall_back(PyObject *module, PyObject **attr_name, const char *attr,
                           PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    if (!*attr_name && !(*attr_name = PyUnicode_InternFromString(attr))) return NULL;
    PyObject *fallback = PyObject_GetAttr(module, *attr_name);
    if (!fallback) return NULL;
    PyObject *res = PyObject_Vectorcall(fallback, args, (size_t)nargs, kwnames);
    Py_DECREF(fallback);
    return res;
}

/* The name of the call: the given str, or the next generated one of `kind`
 * (peeked: counted only once the fast path takes the call). NULL with the
 * error set; *unnamed tells which. */
static const char *call_name(PyObject *arg, const char *kind, char *buf, size_t cap, int *unnamed) {
    *unnamed = !arg || arg == Py_None;
    if (!*unnamed) return PyUnicode_AsUTF8(arg);
    return cring__pyext_noname(kind, buf, cap, 0) < 0 ? NULL : buf;
}

static int name_ok(PyObject *arg) { return !arg || arg == Py_None || PyUnicode_CheckExact(arg); }

/* The one-tensor request of a view (a 0-d tensor counts as one element,
 * one row for allgather). */
static void one_request(cring_request_t *req, cring_tensor_t *t, int64_t *one,
                        const cring__dl_ref_t *ref, const char *name, int coll, int root,
                        int unnamed) {
    *one = 1;
    int scalar = ref->t->ndim == 0;
    *t = (cring_tensor_t){.send = ref->data,
                          .recv = coll == CRING_COLL_ALLGATHER ? NULL : ref->data, /* room */
                          .dtype = ref->dtype,
                          .ndim = scalar ? (coll == CRING_COLL_ALLGATHER) : ref->t->ndim,
                          .shape = scalar ? one : ref->t->shape};
    *req = (cring_request_t){.name = name,
                             .collective = (cring_collective_t)coll,
                             .root = root,
                             .prescale = 1.0,
                             .postscale = 1.0,
                             .compression = CRING_DTYPE_COUNT,
                             .ntensors = 1,
                             .tensors = t,
                             .flags = CRING_REQUEST_CALLER_WAITS |
                                      (unnamed ? CRING_REQUEST_SEQUENCED : 0)};
}

/* broadcast_(tensor, root_rank, name=None): cring.broadcast_ itself. A NumPy
 * array or CPU torch tensor with an int root in range is broadcast here;
 * the rest (other tensors, bad arguments and their errors) goes to
 * cring._collectives._broadcast_inplace_general (`broadcast_fallback`). */
static PyObject *py_broadcast_(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                               PyObject *kwnames) {
    static const char *const names[] = {"tensor", "root_rank", "name"};
    static PyObject *interned[3], *fallback_name;
    module_state *s = cring__pyext_state(module);
    PyObject *v[3] = {0};
    int fast = bind(args, nargs, kwnames, names, interned, 3, v);
    if (fast < 0 || (fast && v[0] && cring__dl_refuse_grad_leaf(v[0], "broadcast_") < 0))
        return NULL;
    fast = fast && v[0] && v[1] && PyLong_CheckExact(v[1]) && name_ok(v[2]) && s->engine;
    if (fast) {
        cring_comm_t *comm = cring_engine_comm(s->engine);
        int overflow;
        long root = PyLong_AsLongAndOverflow(v[1], &overflow);
        int rank = cring_comm_rank(comm);
        if (!overflow && root >= 0 && root < cring_comm_size(comm)) { /* else Python's error */
            char generated[64];
            int unnamed;
            const char *name = call_name(v[2], "broadcast", generated, sizeof generated, &unnamed);
            if (!name) return NULL;
            cring__dl_ref_t ref;
            int taken = cring__dl_acquire_fast(v[0], name, rank != root, 0, &ref);
            if (taken < 0) return NULL;
            if (taken) {
                if (unnamed) cring__pyext_noname("broadcast", generated, sizeof generated, 1);
                int64_t one;
                cring_tensor_t t;
                cring_request_t req;
                one_request(&req, &t, &one, &ref, name, CRING_COLL_BROADCAST, (int)root, unnamed);
                int nviews = 1;
                int rc = cring__pyext_submit_wait_here(s, s->engine, &req, &ref, &nviews);
                if (nviews) cring__dl_release(&ref);
                return rc < 0 ? NULL : Py_NewRef(v[0]);
            }
        }
    }
    return fall_back(module, &fallback_name, "broadcast_fallback", args, nargs, kwnames);
}

PyObject *cring__pyext_rows_shape(const cring__dl_ref_t *ref, int64_t rows) {
    int ndim = ref->t->ndim ? ref->t->ndim : 1;
    PyObject *shape = PyTuple_New(ndim);
    for (int d = 0; shape && d < ndim; d++) {
        PyObject *dim = PyLong_FromLongLong(d ? ref->t->shape[d] : rows);
        if (!dim) Py_CLEAR(shape);
        else PyTuple_SET_ITEM(shape, d, dim);
    }
    return shape;
}

PyObject *cring__pyext_lend_result(PyObject *module, module_state *s, cring_handle_t *h,
                                   const char *name, PyObject **attr_name, const char *attr,
                                   PyObject *x, PyObject *shape, const cring_device_t *cuda) {
    if (!*attr_name && !(*attr_name = PyUnicode_InternFromString(attr))) {
        cring_handle_free(h);
        return NULL;
    }
    PyObject *hobj = cring__pyext_handle_new(s, h, NULL, 0, CRING_COLL_ALLGATHER, name);
    if (!hobj) return NULL;               /* it freed h */
    ((HandleObject *)hobj)->released = 1; /* it holds no views: the caller releases them */
    if (cuda) {
        ((HandleObject *)hobj)->cuda_device = cuda->id;
        ((HandleObject *)hobj)->cuda_torch = 1;
        ((HandleObject *)hobj)->cuda_stream = cuda->stream;
    }
    PyObject *res = NULL, *view = PyObject_GetAttr(module, *attr_name);
    if (view) res = PyObject_CallFunctionObjArgs(view, x, hobj, shape, NULL);
    Py_XDECREF(view);
    Py_DECREF(hobj);
    return res;
}

/* numpy.empty(shape, x.dtype) (GIL held); NULL with the error set. */
static PyObject *np_empty_of(PyObject *x, PyObject *shape) {
    static PyObject *np_empty, *dtype_name;
    if (!np_empty) {
        PyObject *np = PyImport_ImportModule("numpy");
        np_empty = np ? PyObject_GetAttrString(np, "empty") : NULL;
        Py_XDECREF(np);
        if (!np_empty) return NULL;
    }
    if (!dtype_name && !(dtype_name = PyUnicode_InternFromString("dtype"))) return NULL;
    PyObject *dtype = PyObject_GetAttr(x, dtype_name);
    if (!dtype) return NULL;
    PyObject *call_args[2] = {shape, dtype};
    PyObject *res = PyObject_Vectorcall(np_empty, call_args, 2, NULL);
    Py_DECREF(dtype);
    return res;
}

/* The completed allgather h as a NumPy array like x: small results copied
 * into a new array, large ones lent without a copy through the module's
 * `allgather_view(x, handle, shape)` (the handle object keeps the memory). */
static PyObject *allgather_result(PyObject *module, module_state *s, PyObject *x, cring_handle_t *h,
                                  const cring__dl_ref_t *ref, const char *name) {
    static PyObject *view_name;
    size_t bytes;
    const int64_t *dims;
    const void *src = cring_handle_output(h, 0, &bytes, &dims);
    int size = cring_comm_size(cring_engine_comm(s->engine));
    int64_t rows = 0;
    for (int q = 0; q < size; q++) rows += dims[q];
    PyObject *shape = cring__pyext_rows_shape(ref, rows);
    if (!shape || !src) {
        cring_handle_free(h);
        if (shape && !src) PyErr_SetString(PyExc_RuntimeError, "allgather returned no result");
        Py_XDECREF(shape);
        return NULL;
    }
    PyObject *res = NULL;
    if (bytes > COPY_RESULT_MAX_BYTES) {
        res = cring__pyext_lend_result(module, s, h, name, &view_name, "allgather_view", x, shape,
                                       NULL);
        h = NULL; /* the handle object owns it, even on failure */
        goto done;
    }
    res = np_empty_of(x, shape);
    cring__dl_ref_t out;
    if (res && cring__dl_acquire_fast(res, name, 1, 0, &out) == 1) {
        memcpy(out.data, src, bytes);
        cring__dl_release(&out);
    } else if (res) {
        Py_CLEAR(res);
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_RuntimeError, "cannot fill the result");
    }
done:
    if (h) cring_handle_free(h);
    Py_DECREF(shape);
    return res;
}

/* cring__pyext_rows_shape(in, rows), the tuple of the previous call again
 * when it is equal (GIL held): a loop of calls then makes no tuple, whose
 * allocations would also count towards the garbage collector's next pass. */
static PyObject *same_shape(const cring__dl_ref_t *in, int64_t rows) {
    static PyObject *last;
    int ndim = in->t->ndim ? in->t->ndim : 1;
    int same = last && PyTuple_GET_SIZE(last) == ndim;
    for (int d = 0; same && d < ndim; d++)
        same = PyLong_AsLongLong(PyTuple_GET_ITEM(last, d)) == (d ? in->t->shape[d] : rows);
    if (same) return Py_NewRef(last);
    PyObject *shape = cring__pyext_rows_shape(in, rows);
    if (shape) Py_XSETREF(last, Py_NewRef(shape));
    return shape;
}

/* Room for the allgather of the NumPy array x (viewed as *in) when every
 * rank gives as many rows as this one (the usual case): a new array of
 * size x its rows, from 1 MiB in a block of the result cache (results.c),
 * else numpy.empty; bound writable in *out. The engine writes the result
 * there when it fits (cring__output_place), so a call makes one array and
 * copies nothing after the collective. 1 when made; 0, nothing set, when
 * it cannot be (the engine then places the result: allgather_result); -1
 * with the error set (MemoryError). */
static int allgather_room(module_state *s, PyObject *x, const cring__dl_ref_t *in, int size,
                          const char *name, PyObject **made, cring__dl_ref_t *out) {
    int64_t rows = in->t->ndim ? in->t->shape[0] : 1;
    size_t nbytes = in->numel * cring_dtype_size(in->dtype);
    if (nbytes > SIZE_MAX / (size_t)size || rows > INT64_MAX / size) return 0;
    PyObject *shape = same_shape(in, rows * size);
    if (!shape) return -1;
    int rc = cring__pyext_result_empty(s, x, 0, shape, nbytes * (size_t)size, made);
    if (rc == 0) {
        *made = np_empty_of(x, shape);
        rc = *made ? 1 : -1;
    }
    Py_DECREF(shape);
    if (rc < 0) return -1;
    int got = cring__dl_acquire_fast(*made, name, 1, 0, out);
    if (got == 1 && out->dtype == in->dtype && out->numel == in->numel * (size_t)size) return 1;
    if (got == 1) cring__dl_release(out); /* unlike x: left unused */
    PyErr_Clear();
    Py_CLEAR(*made);
    return 0;
}

/* The result the engine wrote into the room lent with h's request: the
 * room itself (*room moved into the result) when every rank gave as many
 * rows as this one (room_rows in all), else its first rows, the gathered
 * ones (a view of it). NULL with the error set. */
static PyObject *lent_rows(cring_handle_t *h, int size, int64_t room_rows, PyObject **room) {
    const int64_t *dims;
    cring_handle_output(h, 0, NULL, &dims);
    int64_t rows = 0;
    for (int q = 0; q < size; q++) rows += dims[q];
    PyObject *whole = *room;
    *room = NULL;
    if (rows == room_rows) return whole;
    PyObject *stop = PyLong_FromLongLong(rows);
    PyObject *first = stop ? PySlice_New(NULL, stop, NULL) : NULL;
    PyObject *res = first ? PyObject_GetItem(whole, first) : NULL;
    Py_XDECREF(first);
    Py_XDECREF(stop);
    Py_DECREF(whole);
    return res;
}

/* allgather(tensor, name=None): cring.allgather itself. A NumPy array is
 * gathered here (into room made before the call: allgather_room), a torch
 * CUDA tensor on the NCCL path in submit_cuda.c; the rest goes to
 * cring._collectives._allgather_general (`allgather_fallback`). */
static PyObject *py_allgather(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                              PyObject *kwnames) {
    static const char *const names[] = {"tensor", "name"};
    static PyObject *interned[2], *fallback_name;
    module_state *s = cring__pyext_state(module);
    PyObject *v[2] = {0};
    int fast = bind(args, nargs, kwnames, names, interned, 2, v);
    if (fast < 0) return NULL;
    if (fast && v[0] && name_ok(v[1]) && s->engine && cring__dl_is_ndarray(v[0])) {
        char generated[64];
        int unnamed;
        const char *name = call_name(v[1], "allgather", generated, sizeof generated, &unnamed);
        if (!name) return NULL;
        cring__dl_ref_t refs[2] = {0};
        int taken = cring__dl_acquire_fast(v[0], name, 0, 0, &refs[0]);
        if (taken < 0 && !PyErr_ExceptionMatches(PyExc_ValueError)) return NULL;
        if (taken < 0) PyErr_Clear(); /* e.g. strided: the general path copies it (or refuses) */
        if (taken > 0) {
            PyObject *room = NULL;
            int size = cring_comm_size(cring_engine_comm(s->engine));
            int lent = allgather_room(s, v[0], &refs[0], size, name, &room, &refs[1]);
            if (lent < 0) {
                cring__dl_release(&refs[0]);
                return NULL;
            }
            if (unnamed) cring__pyext_noname("allgather", generated, sizeof generated, 1);
            int64_t one;
            cring_tensor_t t;
            cring_request_t req;
            one_request(&req, &t, &one, &refs[0], name, CRING_COLL_ALLGATHER, 0, unnamed);
            t.recv = lent ? refs[1].data : NULL; /* room for the result, or none */
            int nviews = 1 + lent;
            cring_handle_t *h = NULL;
            int rc = cring__pyext_submit_wait_keep(s, s->engine, &req, refs, &nviews, &h);
            PyObject *res = NULL;
            if (rc == 0 && lent && cring_handle_output(h, 0, NULL, NULL) == t.recv) {
                res = lent_rows(h, size, t.shape[0] * size, &room);
                cring_handle_free(h);
            } else if (rc == 0) { /* the engine's memory: the result did not fit */
                res = allgather_result(module, s, v[0], h, &refs[0], name); /* frees h */
            }
            for (int i = 0; i < nviews; i++) cring__dl_release(&refs[i]);
            Py_XDECREF(room);
            return res;
        }
    } else if (fast && v[0] && name_ok(v[1]) && s->engine && cring__dl_is_torch(v[0]) &&
               cring__pyext_cuda_fast_ok()) {
        char generated[64];
        int unnamed, declined;
        const char *name = call_name(v[1], "allgather", generated, sizeof generated, &unnamed);
        if (!name) return NULL;
        PyObject *res =
            cring__pyext_torch_cuda_allgather(module, s, v[0], name, unnamed, &declined);
        if (!declined) return res;
    }
    return fall_back(module, &fallback_name, "allgather_fallback", args, nargs, kwnames);
}

/* A new uninitialised tensor like x (a NumPy array or a torch tensor on the
 * host): from 1 MiB in a block of the result cache (results.c: a loop of
 * large calls reuses the memory of results already dropped), else through
 * numpy.empty_like / torch.empty_like (C functions: no Python frame); bound
 * as a writable view in *out of x's dtype and size. 1 when made; 0, nothing
 * set, when it cannot be (the Python path takes the call); -1 with the
 * error set (MemoryError, ...). */
static int empty_like(module_state *s, PyObject *x, int torch, const char *name,
                      const cring__dl_ref_t *in, PyObject **made, cring__dl_ref_t *out) {
    static PyObject *np_empty_like, *torch_empty_like;
    PyObject **fn = torch ? &torch_empty_like : &np_empty_like;
    int cached =
        cring__pyext_result_empty(s, x, torch, NULL, in->numel * cring_dtype_size(in->dtype), made);
    if (cached < 0) return -1;
    if (!cached && !*fn) {
        PyObject *mod_name = PyUnicode_FromString(torch ? "torch" : "numpy");
        PyObject *mod = mod_name ? PyImport_GetModule(mod_name) : NULL; /* never imported here */
        Py_XDECREF(mod_name);
        *fn = mod ? PyObject_GetAttrString(mod, "empty_like") : NULL;
        Py_XDECREF(mod);
        if (!*fn) {
            PyErr_Clear();
            return 0;
        }
    }
    if (!cached) *made = PyObject_CallOneArg(*fn, x);
    if (!*made) return -1;
    int taken = cring__dl_acquire_fast(*made, name, 1, 0, out);
    if (taken == 1 && (out->dtype != in->dtype || out->numel != in->numel)) {
        cring__dl_release(out);
        taken = 0;
    }
    if (taken != 1) {
        PyErr_Clear();
        Py_CLEAR(*made);
        return 0;
    }
    return 1;
}

/* The parameters of cring.allreduce and cring.allreduce_async. */
static const char *const allreduce_out_names[] = {
    "tensor", "op", "name", "compression", "prescale_factor", "postscale_factor", "process_set"};

/* What both out-of-place forms share: bind the arguments and, for a
 * contiguous NumPy array or CPU torch tensor on the global set without
 * compression or scaling, read the input, make the output by empty_like
 * and fill *req (one tensor *t sent from the input, received into the
 * output; `flags` added to its flags; *name_buf holds a generated name).
 * 1 when taken (refs[0] the input view, refs[1] the output's, *result the
 * new output: the caller releases them); 0 when the Python fallback must
 * take the call, nothing held; -1 with the error set, nothing held. */
static int allreduce_out_prepare(module_state *s, PyObject *const *args, Py_ssize_t nargs,
                                 PyObject *kwnames, PyObject **interned, uint32_t flags,
                                 char *name_buf, size_t name_cap, cring__dl_ref_t *refs,
                                 PyObject **result, cring_tensor_t *t, int64_t *one,
                                 cring_request_t *req) {
    PyObject *v[7] = {0};
    int fast = bind(args, nargs, kwnames, allreduce_out_names, interned, 7, v);
    if (fast < 0) return -1;
    int torch = 0;
    fast = fast && v[0] && s->engine && name_ok(v[2]) && (!v[3] || v[3] == Py_None) &&
           cring__pyext_is_one(v[4]) && cring__pyext_is_one(v[5]) && (!v[6] || v[6] == Py_None) &&
           (cring__dl_is_ndarray(v[0]) || (torch = cring__dl_is_torch(v[0])));
    if (!fast) return 0;
    int op = cring__pyext_parse_op(v[1]);
    if (op < 0) return -1;
    int unnamed;
    const char *name = call_name(v[2], "allreduce", name_buf, name_cap, &unnamed);
    if (!name) return -1;
    int taken = cring__dl_acquire_fast(v[0], name, 0, 0, &refs[0]);
    if (taken != 1) { /* a device tensor, or one the Python path copies or words the error of */
        PyErr_Clear();
        return 0;
    }
    taken = empty_like(s, v[0], torch, name, &refs[0], result, &refs[1]);
    if (taken != 1) {
        cring__dl_release(&refs[0]);
        return taken;
    }
    if (unnamed) cring__pyext_noname("allreduce", name_buf, name_cap, 1);
    *one = 1;
    *t = (cring_tensor_t){.send = refs[0].data,
                          .recv = refs[1].data,
                          .dtype = refs[0].dtype,
                          .ndim = refs[0].t->ndim,
                          .shape = refs[0].t->ndim ? refs[0].t->shape : one};
    *req = (cring_request_t){.name = name,
                             .collective = CRING_COLL_ALLREDUCE,
                             .op = (cring_op_t)op,
                             .prescale = 1.0,
                             .postscale = 1.0,
                             .compression = CRING_DTYPE_COUNT,
                             .ntensors = 1,
                             .tensors = t,
                             .flags = flags | (unnamed ? CRING_REQUEST_SEQUENCED : 0)};
    return 1;
}

/* allreduce_async(tensor, op=Average, name=None, compression=None,
 * prescale_factor=1.0, postscale_factor=1.0, process_set=None):
 * cring.allreduce_async itself. A contiguous NumPy array or CPU torch
 * tensor on the global set, without compression or scaling, is queued here:
 * the output made by empty_like, one request whose tensor is sent from the
 * input and received into the output (the engine's fused paths read and
 * write each tensor directly: no staging copy beyond the in-place form's),
 * and a cring.Handle whose synchronize() returns the output. Both views stay
 * with the handle until the engine is done: the input must not change
 * before synchronize(), as with Horovod. Everything else (CUDA tensors,
 * other libraries' tensors, strided ones, compression, scaling, process
 * sets) goes to the module's
 * `allreduce_async_out_fallback`. */
PyObject *cring__pyext_allreduce_async(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                                       PyObject *kwnames) {
    static PyObject *interned[7], *fallback_name;
    module_state *s = cring__pyext_state(module);
    char generated[64];
    int64_t one;
    cring_tensor_t t;
    cring_request_t req;
    PyObject *result = NULL;
    cring__dl_ref_t *refs = PyMem_Calloc(2, sizeof *refs);
    if (!refs) return PyErr_NoMemory();
    int taken = allreduce_out_prepare(s, args, nargs, kwnames, interned, 0, generated,
                                      sizeof generated, refs, &result, &t, &one, &req);
    if (taken != 1) {
        PyMem_Free(refs);
        if (taken < 0) return NULL;
        return fall_back(module, &fallback_name, "allreduce_async_out_fallback", args, nargs,
                         kwnames);
    }
    if (s->dropped) cring__pyext_sweep(s, 0);
    cring_handle_t *handle;
    cring_status_t st = cring_engine_submit(s->engine, &req, &handle);
    if (st != CRING_OK) {
        cring__dl_release(&refs[0]);
        cring__dl_release(&refs[1]);
        PyMem_Free(refs);
        Py_DECREF(result);
        return cring__pyext_raise_submit(s, st, CRING_COLL_ALLREDUCE, req.name);
    }
    PyObject *h = cring__pyext_handle_new(s, handle, refs, 2, CRING_COLL_ALLREDUCE, req.name);
    PyObject *w = h ? cring__pyext_wrap_handle(module, h, Py_None, result, Py_False) : NULL;
    Py_XDECREF(h); /* the wrapper holds it; without one, dropping it never waits */
    Py_DECREF(result);
    return w;
}

/* allreduce(tensor, op=Average, name=None, compression=None,
 * prescale_factor=1.0, postscale_factor=1.0, process_set=None):
 * cring.allreduce itself. What allreduce_async takes here is reduced here
 * and waited on by the caller, as allreduce_ is (no handle, no Python
 * frame): beyond the in-place call it costs the output's allocation
 * (empty_like) and the engine's writing into it instead of over the input.
 * Everything else goes to the module's `allreduce_out_fallback`. */
static PyObject *py_allreduce(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                              PyObject *kwnames) {
    static PyObject *interned[7], *fallback_name;
    module_state *s = cring__pyext_state(module);
    char generated[64];
    int64_t one;
    cring_tensor_t t;
    cring_request_t req;
    cring__dl_ref_t refs[2];
    PyObject *result = NULL;
    int taken = allreduce_out_prepare(s, args, nargs, kwnames, interned, CRING_REQUEST_CALLER_WAITS,
                                      generated, sizeof generated, refs, &result, &t, &one, &req);
    if (taken < 0) return NULL;
    if (!taken)
        return fall_back(module, &fallback_name, "allreduce_out_fallback", args, nargs, kwnames);
    int nviews = 2;
    int rc = cring__pyext_submit_wait_here(s, s->engine, &req, refs, &nviews);
    for (int i = 0; i < nviews; i++) cring__dl_release(&refs[i]);
    if (rc < 0) Py_CLEAR(result);
    return result;
}

PyMethodDef cring__pyext_small_functions[] = {
    {"broadcast_", (PyCFunction)(void (*)(void))py_broadcast_, METH_FASTCALL | METH_KEYWORDS,
     "broadcast_($module, /, tensor, root_rank, name=None)\n--\n\n"
     "Overwrite `tensor` on every rank with root_rank's values; returns it."},
    {"allgather", (PyCFunction)(void (*)(void))py_allgather, METH_FASTCALL | METH_KEYWORDS,
     "allgather($module, /, tensor, name=None)\n--\n\n"
     "Concatenate every rank's tensor along the first dimension (which may\n"
     "differ between ranks); trailing dimensions and dtype must match. A 0-d\n"
     "tensor gathers as one row."},
    {"allreduce", (PyCFunction)(void (*)(void))py_allreduce, METH_FASTCALL | METH_KEYWORDS,
     "allreduce($module, /, tensor, op=0, name=None, compression=None,\n"
     "          prescale_factor=1.0, postscale_factor=1.0, process_set=None)\n--\n\n"
     "Return a new tensor holding the reduction of `tensor` over all ranks."},
    {"allreduce_async", (PyCFunction)(void (*)(void))cring__pyext_allreduce_async,
     METH_FASTCALL | METH_KEYWORDS,
     "allreduce_async($module, /, tensor, op=0, name=None, compression=None,\n"
     "                prescale_factor=1.0, postscale_factor=1.0, process_set=None)\n--\n\n"
     "Start an allreduce into a new tensor; synchronize() returns it."},
    {NULL, NULL, 0, NULL}};

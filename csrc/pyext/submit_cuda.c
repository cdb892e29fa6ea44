/* submit_cuda.c: what the bindings need to take torch CUDA tensors on the
 * NCCL path from C: whether the fast paths may (NCCL and the CUDA runtime
 * loaded, CRING_GPU_OPERATIONS not "host"), a tensor's device and the
 * caller's stream, the general path's export of a CUDA tensor, and the C
 * fast path of cring.allgather for a torch CUDA tensor (room for the result
 * from torch's allocator on the stream the request is ordered after, the
 * request submitted and waited on here). Used by
 * submit.c and submit_small.c; no request of its own beyond the allgather. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>
#include <string.h>

#include "../gpu/gpu.h"
#include "pyext.h"

int cring__pyext_cuda_fast_ok(void) {
    const char *mode = getenv("CRING_GPU_OPERATIONS");
    if (mode && *mode && strcmp(mode, "nccl") != 0) return 0;
    cring__gpu_t *g = cring__gpu_global();
    return g && cring__gpu_nccl_path(g) && cring__gpu_cudart_path(g);
}

int cring__pyext_cuda_device_of(const cring__dl_ref_t *ref, cring_device_t *device) {
    void *stream = NULL;
    int id = ref->t->device.device_id;
    if (cring__pyext_cuda_stream(id, 1, NULL, &stream) < 0) return -1;
    *device = (cring_device_t){.type = CRING_DEVICE_CUDA, .id = id, .stream = stream};
    return 0;
}

/* torch's __dlpack__(stream=) only makes `raw` wait for torch's current
 * stream, which is `raw` itself when cring orders on it (the engine records
 * its ready event on `raw` at submission), and its Python cost tens of
 * microseconds a call on a GPU machine (two exports an out-of-place call). */
int cring__pyext_acquire_cuda(PyObject *obj, PyObject *dl_stream, void *raw, const char *name,
                              int writable, cring__dl_ref_t *ref) {
    if (cring__dl_is_torch(obj)) {
        int got = cring__dl_acquire_fast(obj, name, writable, 1, ref);
        if (got < 0) return -1;
        if (got) {
            void *current = NULL;
            if (ref->t->device.device_type == CRING_DL_CUDA &&
                cring__pyext_cuda_stream((int)ref->t->device.device_id, 1, NULL, &current) == 0 &&
                current == raw)
                return 0;
            PyErr_Clear();
            cring__dl_release(ref);
        }
    }
    return cring__dl_acquire(obj, dl_stream, name, writable, CRING__DL_CUDA, ref);
}

/* ---- cring.allgather of a torch CUDA tensor ------------------------------------------ */

/* x.new_empty(shape): torch's allocator on x's device and dtype, on the
 * current stream (the one the request is ordered after). */
static PyObject *new_empty(PyObject *x, PyObject *shape) {
    static PyObject *method;
    if (!method && !(method = PyUnicode_InternFromString("new_empty"))) return NULL;
    return PyObject_CallMethodOneArg(x, method, shape);
}

/* The result once the engine is done: the room when the result went there
 * (its first `rows` rows), else the engine's own memory through the module's
 * `allgather_cuda_view(x, handle, shape)` (cring._gpu.result_like). */
static PyObject *gathered(PyObject *module, module_state *s, PyObject *x, PyObject *room,
                          const cring__dl_ref_t *in, const cring__dl_ref_t *out, cring_handle_t *h,
                          const char *name, const cring_device_t *device) {
    static PyObject *view_name;
    size_t bytes;
    const int64_t *dims;
    const void *src = cring_handle_output(h, 0, &bytes, &dims);
    int size = cring_comm_size(cring_engine_comm(s->engine));
    int64_t rows = 0, room_rows = out->t->shape[0];
    for (int q = 0; q < size; q++) rows += dims[q];
    if (src == out->data) {
        cring_handle_free(h);
        if (rows == room_rows) return Py_NewRef(room);
        return PyObject_CallMethod(room, "narrow", "iLL", 0, 0LL, (long long)rows);
    }
    PyObject *shape = cring__pyext_rows_shape(in, rows);
    if (!shape) {
        cring_handle_free(h);
        return NULL;
    }
    PyObject *res = cring__pyext_lend_result(module, s, h, name, &view_name, "allgather_cuda_view",
                                             x, shape, device);
    Py_DECREF(shape);
    return res;
}

PyObject *cring__pyext_torch_cuda_allgather(PyObject *module, module_state *s, PyObject *x,
                                            const char *name, int unnamed, int *declined) {
    *declined = 0;
    if (cring__pyext_thread_stream_set()) {
        /* torch's allocator would serve the room on torch's current stream,
         * which neither orders cring's stream nor waits for the result (the
         * use_stream() stream does): the Python path, lending no room then */
        *declined = 1;
        return NULL;
    }
    cring__dl_ref_t views[2];
    int taken = cring__dl_acquire_fast(x, name, 0, 1, &views[0]);
    if (taken < 0 && !PyErr_ExceptionMatches(PyExc_ValueError)) return NULL;
    if (taken < 0) { /* e.g. strided: the Python path copies it (or words the error) */
        PyErr_Clear();
        *declined = 1;
        return NULL;
    }
    if (!taken || views[0].t->device.device_type != CRING_DL_CUDA || views[0].numel == 0) {
        if (taken) cring__dl_release(&views[0]);
        *declined = 1; /* a CPU or empty tensor: the Python path's business */
        return NULL;
    }
    cring_device_t device;
    if (cring__pyext_cuda_device_of(&views[0], &device) < 0) {
        cring__dl_release(&views[0]);
        return NULL;
    }
    int size = cring_comm_size(cring_engine_comm(s->engine));
    int ndim = views[0].t->ndim ? views[0].t->ndim : 1;
    int64_t rows = views[0].t->ndim ? views[0].t->shape[0] : 1;
    PyObject *shape = cring__pyext_rows_shape(&views[0], (int64_t)size * rows), *room = NULL;
    if (shape) room = new_empty(x, shape);
    Py_XDECREF(shape);
    taken = room ? cring__dl_acquire_fast(room, name, 1, 1, &views[1]) : -1;
    if (taken == 1 &&
        (views[1].t->device.device_type != CRING_DL_CUDA || views[1].dtype != views[0].dtype ||
         views[1].numel != (size_t)size * views[0].numel)) {
        cring__dl_release(&views[1]);
        taken = 0;
    }
    if (taken != 1) { /* no room of torch's: the Python path words what went wrong */
        PyErr_Clear();
        Py_XDECREF(room);
        cring__dl_release(&views[0]);
        *declined = 1;
        return NULL;
    }
    if (unnamed) {
        char generated[64];
        cring__pyext_noname("allgather", generated, sizeof generated, 1);
    }
    int64_t one = 1;
    cring_tensor_t t = {.send = views[0].data,
                        .recv = views[1].data,
                        .dtype = views[0].dtype,
                        .ndim = ndim,
                        .shape = views[0].t->ndim ? views[0].t->shape : &one};
    cring_request_t req = {.name = name,
                           .collective = CRING_COLL_ALLGATHER,
                           .prescale = 1.0,
                           .postscale = 1.0,
                           .compression = CRING_DTYPE_COUNT,
                           .ntensors = 1,
                           .tensors = &t,
                           .device = device,
                           .flags = CRING_REQUEST_CALLER_WAITS |
                                    (unnamed ? CRING_REQUEST_SEQUENCED : 0)};
    int nviews = 2;
    cring_handle_t *h = NULL;
    int rc = cring__pyext_submit_wait_keep(s, s->engine, &req, views, &nviews, &h);
    void *event = rc < 0 ? NULL : cring__pyext_cuda_event_ref(cring_handle_device_event(h));
    PyObject *res =
        rc < 0 ? NULL : gathered(module, s, x, room, &views[0], &views[1], h, name, &device);
    cring__pyext_release_after(s, event, views, nviews); /* once cring's stream is done */
    cring__pyext_cuda_event_put(event);
    Py_DECREF(room);
    return res;
}

/* pyext.h: the one header the files of cring._C share: the module state, the
 * Handle object, the status -> exception helper and each file's entry points.
 * Included only by the C files of csrc/pyext, after Python.h; nothing outside pyext sees it. */
#ifndef CRING_PYEXT_PYEXT_H
#define CRING_PYEXT_PYEXT_H

#include "cring/cring.h"
#include "dlpack_ingest.h"

/* Tensor views the engine or the device may still use: those of a handle
 * dropped in flight (kept until the engine reports it done), and those of a
 * completed CUDA request whose work cring's stream has not run yet (kept
 * until its completion event has: docs/gpu.md, "Ordering and lifetime"). */
typedef struct cring__pyext_dropped {
    struct cring__pyext_dropped *next;
    cring_handle_t *handle; /* NULL: waiting for `event` only */
    void *event;            /* a reference to a CUDA completion event, or NULL */
    cring__dl_ref_t *refs;  /* PyMem, released with the GIL held */
    int nrefs;
    int cuda_device;   /* -1 unless a CUDA request: then the producer's stream */
    void *cuda_stream; /* waits on its completion before the views go */
} cring__pyext_dropped_t;

/* One process set (process_sets.c): its global ranks, ascending, and its
 * engine when this rank is a member (NULL otherwise). */
typedef struct {
    int id;
    int nranks;
    int *ranks; /* PyMem_Raw */
    cring_engine_t *engine;
} cring__pyext_pset_t;

/* The registry of process sets and the global init's configuration they
 * derive their own from (strings copied, PyMem_Raw). */
typedef struct {
    cring__pyext_pset_t *sets;
    int nsets;
    char *store_addr, *secret, *job_key;
    int store_port;
    cring_transport_kind_t transport;
    double timeout_s;
    int rank;            /* this process's global rank */
    unsigned generation; /* sets built since init: part of each set's store keys */
} cring__pyext_psets_t;

typedef struct {
    cring_engine_t *engine; /* NULL until init(); changed only with the GIL held */
    PyObject *CRingError;
    PyObject *TimeoutError;
    PyObject *PeerFailureError;
    PyObject *MismatchError;
    PyObject *NotInitializedError;
    PyTypeObject *StoreServerType;
    PyTypeObject *StoreClientType;
    PyTypeObject *OutputBufferType;
    PyTypeObject *HandleType;
    PyTypeObject *ResultBlockType;
    cring__pyext_dropped_t *dropped; /* handles dropped while in flight (GIL held) */
    cring__pyext_psets_t psets;      /* process sets (process_sets.c; GIL held) */
} module_state;

static inline module_state *cring__pyext_state(PyObject *module) {
    return (module_state *)PyModule_GetState(module);
}

/* A submitted request: the C handle plus the DLPack views that keep the
 * tensors' memory alive until the engine is done with them. */
typedef struct {
    PyObject_HEAD cring_handle_t *handle;
    cring__dl_ref_t *refs; /* PyMem array of nrefs views */
    int nrefs;
    int collective;
    char *name;
    int released;      /* the views were released (the handle completed and was waited on) */
    int cuda_device;   /* CUDA requests: the device; -1 otherwise */
    int cuda_torch;    /* the tensors are torch's (its current stream is the consumer's) */
    void *cuda_stream; /* the producer's stream at submission */
    char name_buf[48]; /* name points here when it fits (no allocation) */
} HandleObject;

/* ---- errors.c: the one status -> exception mapping -------------------------- */
/* Set the exception for status st and return NULL:
 *   INVALID_ARGUMENT -> ValueError      NOT_SUPPORTED -> TypeError (a dtype, op
 *   NO_MEMORY -> MemoryError            or device the caller picked, as NumPy)
 *   TIMEOUT -> cring.TimeoutError       PEER_FAILURE -> cring.PeerFailureError
 *   MISMATCH -> cring.MismatchError     anything else -> cring.CRingError
 * The message is "<context>: <detail>", or the status's own text without a detail. */
PyObject *cring__pyext_raise(module_state *s, cring_status_t st, const char *context,
                             const char *detail);
/* NotInitializedError ("call cring.init() first"); returns NULL. */
PyObject *cring__pyext_not_initialized(module_state *s);
/* "allreduce", "broadcast", ... for messages. */
const char *cring__pyext_collective_label(int collective);
/* The error of a completed handle, naming the tensor unless its detail does. */
PyObject *cring__pyext_raise_handle(module_state *s, cring_handle_t *h, cring_status_t st,
                                    int collective, const char *name);
/* The error of a failed cring_engine_submit (its message names the tensor). */
PyObject *cring__pyext_raise_submit(module_state *s, cring_status_t st, int collective,
                                    const char *name);

/* ---- handles.c -------------------------------------------------------------- */
/* Create Handle and OutputBuffer types in s. */
int cring__pyext_handles_init(PyObject *module, module_state *s);
/* A Handle owning `handle`, the nrefs views in refs (a PyMem array) and a copy
 * of name. On failure (NULL, MemoryError set) it waits for the engine, then
 * releases the views and frees handle and refs. */
PyObject *cring__pyext_handle_new(module_state *s, cring_handle_t *handle, cring__dl_ref_t *refs,
                                  int nrefs, int collective, const char *name);
/* Wait for h with the GIL released, waking every 100 ms to run signal
 * handlers. Returns 1 with *st set once done, or 0 with the signal handler's
 * exception set (the request is still in flight). Needs the GIL. */
int cring__pyext_wait(cring_handle_t *h, cring_status_t *st);
/* Keep views the engine may still use until h completes; takes h and refs
 * (a PyMem array, or NULL with nrefs 0). For a CUDA request (cuda_device >=
 * 0), cuda_stream (the producer's) is made to wait on its completion before
 * the views go, so their memory is not reused under cring's stream. Needs
 * the GIL. */
void cring__pyext_drop(module_state *s, cring_handle_t *h, cring__dl_ref_t *refs, int nrefs,
                       int cuda_device, void *cuda_stream);
/* Release what dropped handles kept once their request is done, and views
 * whose CUDA work has run; with all set (after the engine stopped),
 * everything (waiting, without the GIL, for CUDA work still queued).
 * Needs the GIL. */
void cring__pyext_sweep(module_state *s, int all);
/* Release the views of a completed request whose CUDA completion event is
 * `event` (borrowed; NULL for none): at once when there is none or cring's
 * stream has run that work, else they move (copied: the caller must not
 * release them too) to the dropped list with a reference to the event,
 * released by a later sweep once the work has run. So a tensor's memory is
 * never handed out again while cring's stream may still read or write it,
 * whatever stream the framework allocated it on. An exception set stays
 * set (a deleter may run Python code). Needs the GIL. */
void cring__pyext_release_after(module_state *s, void *event, cring__dl_ref_t *views, int n);
extern PyMethodDef cring__pyext_handle_functions[];
/* A new cring.Handle (the module's handle_wrapper class) with its slots
 * _h, _finish, _result and _finished set to the given objects; NULL with
 * an error. */
PyObject *cring__pyext_wrap_handle(PyObject *module, PyObject *h, PyObject *finish,
                                   PyObject *result, PyObject *finished);

/* ---- submit.c ---------------------------------------------------------------- */
extern PyMethodDef cring__pyext_submit_functions[];
/* The reduction op an argument names (None: Average), or -1 with the error set. */
int cring__pyext_parse_op(PyObject *obj);
/* The next name of an unnamed call of `kind` ("allreduce.noname.3") into out,
 * counted when `consume`; -1 with the error set. Needs the GIL. */
int cring__pyext_noname(const char *kind, char *out, size_t cap, int consume);
/* Whether name is one cring__pyext_noname made (".noname." then digits only).
 * Every path flags such a name CRING_REQUEST_SEQUENCED, named or not, so
 * every rank flags a name alike (the engine never holds such a request for a
 * gradient bucket). */
int cring__pyext_is_generated(const char *name);
/* cring._C.noname(kind) and noname_reset([suffix]) (submit.c's table): the
 * next name of an unnamed call of that kind; every kind (or those ending in
 * suffix, a removed process set's) counting from 0 again. */
PyObject *cring__pyext_py_noname(PyObject *module, PyObject *arg);
PyObject *cring__pyext_py_noname_reset(PyObject *module, PyObject *args);
/* Submit req, wait here (running signal handlers) and raise its error; views
 * are its tensor views, released here (cring__pyext_release_after: a CUDA
 * request's once cring's stream has run its work, whether it succeeded or
 * not) or kept by the dropped list when the wait is interrupted; *nviews is
 * 0 after. 0, or -1 with the error set. */
int cring__pyext_submit_wait_here(module_state *s, cring_engine_t *engine,
                                  const cring_request_t *req, cring__dl_ref_t *views, int *nviews);

/* cring__pyext_submit_wait_here, and on success the completed handle in
 * *keep when keep is not NULL: then the views stay the caller's, who
 * releases them with cring__pyext_release_after (the handle's completion
 * event) once done with them, and frees the handle. */
int cring__pyext_submit_wait_keep(module_state *s, cring_engine_t *engine,
                                  const cring_request_t *req, cring__dl_ref_t *views, int *nviews,
                                  cring_handle_t **keep);

/* Is x absent, or the int or float 1 (a scale factor that scales nothing)? */
int cring__pyext_is_one(PyObject *x);

/* ---- submit_cuda.c ------------------------------------------------------------- */
/* May a torch CUDA tensor take a C fast path? Only on the NCCL path
 * (CRING_GPU_OPERATIONS unset or nccl) once the Python path has loaded NCCL
 * and the CUDA runtime (its first call does, with the errors worded there). */
int cring__pyext_cuda_fast_ok(void);
/* For a taken CUDA view: its device and the caller's stream, read once.
 * 0, or -1 with the error set. */
int cring__pyext_cuda_device_of(const cring__dl_ref_t *ref, cring_device_t *device);
/* A tensor of a CUDA call on the general path: a plain torch tensor whose
 * device's stream for cring (use_stream()'s, else torch's current one) is
 * `raw` is exported without torch's __dlpack__(stream=); anything else goes
 * through __dlpack__ with dl_stream. 0, or -1 with the error set. */
int cring__pyext_acquire_cuda(PyObject *obj, PyObject *dl_stream, void *raw, const char *name,
                              int writable, cring__dl_ref_t *ref);
/* cring.allgather of torch CUDA tensor x on the global set, the NCCL path
 * (cring__pyext_cuda_fast_ok): room of size x rows from x.new_empty lent
 * for the result, submitted and waited on here, the caller's stream ordered
 * after it; the room (or its first rows) returned, or the engine's memory as
 * x's kind through the module's `allgather_cuda_view`. *declined (NULL, no
 * error) when x is no CUDA tensor, is empty or no room could be made: the
 * Python path takes the call. `unnamed`: name is the peeked generated one,
 * counted here once the call is taken. */
PyObject *cring__pyext_torch_cuda_allgather(PyObject *module, module_state *s, PyObject *x,
                                            const char *name, int unnamed, int *declined);

/* ---- submit_small.c ---------------------------------------------------------- */
/* broadcast_ and allgather for NumPy arrays (and broadcast_ for CPU torch
 * tensors) bound and run in C, and allreduce_async (out of place) for NumPy
 * arrays and CPU torch tensors queued in C; the rest goes to their Python
 * fallbacks. */
extern PyMethodDef cring__pyext_small_functions[];
/* cring.allreduce_async (tensor, op, name, compression, prescale_factor,
 * postscale_factor, process_set): a cring.Handle, or the fallback's result. */
PyObject *cring__pyext_allreduce_async(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                                       PyObject *kwnames);
/* The shape of an allgather result of `rows` rows whose other dimensions are
 * ref's (a 0-d ref gathers as one row: (rows,)); NULL with the error set. */
PyObject *cring__pyext_rows_shape(const cring__dl_ref_t *ref, int64_t rows);
/* The completed allgather h lent without a copy through the module's
 * attribute `attr` (interned into *attr_name once), called as (x, handle,
 * shape) with a Handle that owns h (also on failure) and holds no views.
 * cuda: the device and the stream the caller was ordered on for a CUDA
 * result (a torch tensor's), so its memory is given back on that stream;
 * NULL for host results. */
PyObject *cring__pyext_lend_result(PyObject *module, module_state *s, cring_handle_t *h,
                                   const char *name, PyObject **attr_name, const char *attr,
                                   PyObject *x, PyObject *shape, const cring_device_t *cuda);
extern PyMethodDef cring__pyext_region_functions[]; /* region_bindings.c */

/* ---- results.c --------------------------------------------------------------- */
/* Add cring._C.ResultBlock's type, result_empty and result_cache_stats. */
int cring__pyext_results_init(PyObject *module, module_state *s);
/* A new, uninitialised NumPy array (x a numpy.ndarray; a plain ndarray like
 * numpy.empty's) or CPU torch tensor (`torch` set) of x's dtype and `shape`
 * (NULL: x's), nbytes in all, over a block of the result cache that goes
 * back when the last view of it is gone. 1 with *made; 0, nothing set, when
 * nbytes is below CRING_RESULT_CACHE_MIN_BYTES, the cache keeps nothing
 * (CRING_RESULT_CACHE_BYTES=0) or the library is not imported: the caller
 * allocates as before; -1 with the error set (MemoryError, ...). Needs the GIL. */
int cring__pyext_result_empty(module_state *s, PyObject *x, int torch, PyObject *shape,
                              size_t nbytes, PyObject **made);

/* ---- process_sets.c ---------------------------------------------------------- */
/* Keep what a process set's communicator needs of the global init's config
 * (after a successful init). 0, or -1 with MemoryError. */
int cring__pyext_psets_configure(module_state *s, const cring_config_t *cfg);
/* The engine of process set `id` (0: the global one) and, for another set,
 * its entry in *set (NULL for the global one). NULL with the error set:
 * NotInitializedError, or ValueError for an unknown set or a rank outside it
 * ("rank 3 is not in process set 2 (ranks [0, 1])"). Needs the GIL. */
cring_engine_t *cring__pyext_pset_engine(module_state *s, int id, const cring__pyext_pset_t **set);
/* Global rank `root` as a rank of `set`, or -1 with ValueError naming `name`. */
int cring__pyext_pset_root(module_state *s, const cring__pyext_pset_t *set, int root,
                           const char *name);
/* Stop every set's engine (before the global one's); the registry is empty after. */
void cring__pyext_psets_stop_all(module_state *s);
/* stop_all, and free the kept configuration (module teardown). */
void cring__pyext_psets_free(module_state *s);
extern PyMethodDef cring__pyext_process_set_functions[];

/* ---- store_bindings.c ------------------------------------------------------ */
int cring__pyext_store_init(PyObject *module, module_state *s);

/* ---- gpu.c ----------------------------------------------------------------- */
/* Adds cring._C.gpu, the GPU layer's bindings, and cring._C.PinnedBuffer;
 * called once from module_exec, after the exception and Handle types exist. */
int cring__pyext_gpu_init(PyObject *module, module_state *s);
/* The stream a CUDA consumer on `device` orders its work on: the thread's
 * cring._gpu.use_stream() stream, else torch's current stream when `torch`
 * (torch._C._cuda_getCurrentRawStream, looked up once), else `fallback`.
 * 0 with *out set, or -1 with the error set. Needs the GIL. */
int cring__pyext_cuda_stream(int device, int torch, void *fallback, void **out);
/* 1 while this thread is inside cring._gpu.use_stream() (its stream, not the
 * framework's current one, orders its CUDA work), else 0. */
int cring__pyext_thread_stream_set(void);
/* After a CUDA request h completed successfully: surface NCCL's
 * asynchronous errors, make `consumer` (and `producer` when it differs) wait
 * on h's completion event, and with block_host wait for it on this thread
 * (the GIL released). 0, or -1 with the exception set. Needs the GIL. */
int cring__pyext_cuda_after(module_state *s, cring_handle_t *h, const char *name, int device,
                            void *consumer, void *producer, int block_host);
/* The producer's stream of a dropped CUDA request waits on its completion
 * (best effort: errors are ignored, nothing is raised). */
void cring__pyext_cuda_order_release(cring_handle_t *h, int device, void *producer);
/* A CUDA completion event (cring_handle_device_event's): another reference,
 * dropping one, whether its work has run (1; also for NULL), and a host wait
 * for it (call without the GIL). */
void *cring__pyext_cuda_event_ref(void *event);
void cring__pyext_cuda_event_put(void *event);
int cring__pyext_cuda_event_done(void *event);
void cring__pyext_cuda_event_wait(void *event);

#endif

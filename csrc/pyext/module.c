/* module.c: cring._C itself: the module state (the engine pointer and the
 * exception and object types), init/shutdown, the queries (topology, stats,
 * timeline) and module set-up. Handles, submission and the store live in
 * their own files (pyext.h lists them); no collective logic here. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#include "../common/common.h"
#include "../common/result_cache.h"
#include "pyext.h"

/* ---- init / shutdown / queries -------------------------------------------- */
static PyObject *py_init(PyObject *module, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"rank",        "size",      "addr",    "port",
                             "serve_store", "secret",    "job_key", "listen_addr",
                             "transport",   "timeout_s", NULL};
    module_state *s = cring__pyext_state(module);
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
    Py_BEGIN_ALLOW_THREADS st = cring_comm_init(&cfg, &comm);
    if (st != CRING_OK) snprintf(detail, sizeof detail, "%s", cring_last_init_error());
    else if ((st = cring_engine_start(comm, &engine)) != CRING_OK)
        snprintf(detail, sizeof detail, "%s", cring_engine_error_message());
    Py_END_ALLOW_THREADS if (st != CRING_OK) return cring__pyext_raise(s, st, "cring.init failed",
                                                                       detail);
    s->engine = engine;
    if (cring__pyext_psets_configure(s, &cfg) < 0) return NULL; /* process_sets.c */
    Py_RETURN_NONE;
}

/* Stop the engine (pending requests complete with ERR_CLOSED), then release
 * what dropped handles kept alive. */
static PyObject *py_shutdown(PyObject *module, PyObject *unused) {
    module_state *s = cring__pyext_state(module);
    cring__pyext_psets_stop_all(s); /* process sets before the global engine */
    cring_engine_t *engine = s->engine;
    s->engine = NULL; /* with the GIL held: no submission sees it any more */
    Py_BEGIN_ALLOW_THREADS cring_engine_stop(engine);
    Py_END_ALLOW_THREADS cring__pyext_sweep(s, 1);
    cring__result_cache_trim(); /* idle result memory goes back; lent blocks come back later */
    Py_RETURN_NONE;
}

static PyObject *py_is_initialized(PyObject *module, PyObject *unused) {
    return PyBool_FromLong(cring__pyext_state(module)->engine != NULL);
}

static PyObject *py_topology(PyObject *module, PyObject *unused) {
    module_state *s = cring__pyext_state(module);
    if (!s->engine) return cring__pyext_not_initialized(s);
    cring_comm_t *c = cring_engine_comm(s->engine);
    return Py_BuildValue("{s:i,s:i,s:i,s:i,s:i,s:i,s:s}", "rank", cring_comm_rank(c), "size",
                         cring_comm_size(c), "local_rank", cring_comm_local_rank(c), "local_size",
                         cring_comm_local_size(c), "cross_rank", cring_comm_cross_rank(c),
                         "cross_size", cring_comm_cross_size(c), "transport",
                         cring_comm_transport_name(c));
}

static PyObject *py_engine_stats(PyObject *module, PyObject *unused) {
    module_state *s = cring__pyext_state(module);
    if (!s->engine) return cring__pyext_not_initialized(s);
    cring_engine_stats_t st;
    cring_engine_get_stats(s->engine, &st);
    static const char *const autotune[] = {"off", "tuning", "settled"};
    return Py_BuildValue(
        "{s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:K,s:d,s:s}", "cycles", st.cycles,
        "collectives", st.collectives, "tensors", st.tensors, "fused_tensors", st.fused_tensors,
        "cache_hits", st.cache_hits, "errors", st.errors, "bucket_held", st.bucket_held,
        "bucket_idle_releases", st.bucket_idle_releases, "tcp_bytes_sent", st.tcp_bytes_sent,
        "tcp_bytes_received", st.tcp_bytes_received, "shm_bytes_sent", st.shm_bytes_sent,
        "shm_bytes_received", st.shm_bytes_received, "fusion_threshold_bytes",
        (unsigned long long)st.fusion_threshold_bytes, "cycle_time_ms", st.cycle_time_ms,
        "autotune", autotune[st.autotune >= 0 && st.autotune <= 2 ? st.autotune : 0]);
}

static PyObject *py_timeline(PyObject *module, PyObject *args) {
    module_state *s = cring__pyext_state(module);
    const char *path = NULL;
    int mark_cycles = 0;
    if (!PyArg_ParseTuple(args, "z|p", &path, &mark_cycles)) return NULL;
    if (!s->engine) return cring__pyext_not_initialized(s);
    cring_engine_timeline_mark_cycles(s->engine, mark_cycles);
    cring_status_t st = cring_engine_timeline(s->engine, path);
    if (st != CRING_OK)
        return cring__pyext_raise(s, st, "cannot write the timeline", cring_last_init_error());
    Py_RETURN_NONE;
}

static PyObject *py_reduce_isa(PyObject *module, PyObject *unused) {
    return PyUnicode_FromString(cring_reduce_isa());
}

/* The shared-memory collectives' sizes on this machine and the caches they
 * come from: a dict of byte counts (cring_shm_tuning). */
static PyObject *py_shm_tuning(PyObject *module, PyObject *unused) {
    cring_shm_tuning_t t;
    cring_shm_tuning(&t);
    return Py_BuildValue(
        "{s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n,s:n}", "l1d_bytes", (Py_ssize_t)t.l1d_bytes, "l2_bytes",
        (Py_ssize_t)t.l2_bytes, "l3_bytes", (Py_ssize_t)t.l3_bytes, "round_bytes",
        (Py_ssize_t)t.round_bytes, "small_allreduce_bytes", (Py_ssize_t)t.small_allreduce_bytes,
        "reduce_block_bytes", (Py_ssize_t)t.reduce_block_bytes, "stream_min_bytes",
        (Py_ssize_t)t.stream_min_bytes, "inplace_round_bytes", (Py_ssize_t)t.inplace_round_bytes,
        "inplace_stream_min_bytes", (Py_ssize_t)t.inplace_stream_min_bytes);
}

/* ---- module ----------------------------------------------------------------- */
static PyMethodDef module_methods[] = {
    {"init", (PyCFunction)(void (*)(void))py_init, METH_VARARGS | METH_KEYWORDS,
     "init(rank, size, addr, port, serve_store, secret=None, job_key=None, listen_addr=None, "
     "transport='auto', timeout_s=600.0)"},
    {"shutdown", py_shutdown, METH_NOARGS, "Stop the engine and destroy the communicator."},
    {"is_initialized", py_is_initialized, METH_NOARGS, NULL},
    {"topology", py_topology, METH_NOARGS, "dict of rank, size, local_*, cross_*, transport"},
    {"engine_stats", py_engine_stats, METH_NOARGS, "engine counters"},
    {"timeline", py_timeline, METH_VARARGS, "timeline(path or None, mark_cycles=False)"},
    {"reduce_isa", py_reduce_isa, METH_NOARGS, "kernel family chosen for this CPU"},
    {"shm_tuning", py_shm_tuning, METH_NOARGS,
     "the shared-memory collectives' sizes on this machine and the caches they come from"},
    {NULL, NULL, 0, NULL}};

static int add_exception(PyObject *m, PyObject **slot, const char *name, PyObject *bases,
                         const char *doc) {
    char qual[128];
    snprintf(qual, sizeof qual, "cring.%s", name);
    *slot = PyErr_NewExceptionWithDoc(qual, doc, bases, NULL);
    if (!*slot) return -1;
    return PyModule_AddObjectRef(m, name, *slot);
}

static int module_exec(PyObject *m) {
    module_state *s = cring__pyext_state(m);
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
    if (cring__pyext_store_init(m, s) < 0) return -1;   /* store_bindings.c */
    if (cring__pyext_handles_init(m, s) < 0) return -1; /* handles.c */
    if (cring__pyext_results_init(m, s) < 0) return -1; /* results.c */
    if (PyModule_AddFunctions(m, cring__pyext_submit_functions) < 0) return -1; /* submit.c */
    if (PyModule_AddFunctions(m, cring__pyext_process_set_functions) < 0) return -1;
    if (PyModule_AddFunctions(m, cring__pyext_small_functions) < 0) return -1;
    if (PyModule_AddFunctions(m, cring__pyext_region_functions) < 0) return -1;
    /* The collectives, from cring.h's table: _C.ALLREDUCE ... and
     * _C.COLLECTIVE_NAMES {value: "allreduce", ...}. */
    PyObject *names = PyDict_New();
    if (!names) return -1;
#define CRING__EXPORT_COLLECTIVE(name, value, str)                                                 \
    if (PyModule_AddIntConstant(m, #name, value) < 0) goto names_error;                            \
    {                                                                                              \
        PyObject *k = PyLong_FromLong(value), *v = PyUnicode_FromString(str);                      \
        int bad = !k || !v || PyDict_SetItem(names, k, v) < 0;                                     \
        Py_XDECREF(k);                                                                             \
        Py_XDECREF(v);                                                                             \
        if (bad) goto names_error;                                                                 \
    }
    CRING_COLLECTIVE_MAP(CRING__EXPORT_COLLECTIVE)
#undef CRING__EXPORT_COLLECTIVE
    if (PyModule_AddObject(m, "COLLECTIVE_NAMES", names) < 0) goto names_error;
    if (cring__pyext_gpu_init(m, s) < 0) return -1; /* cring._C.gpu (gpu.c) */
    return 0;
names_error:
    Py_DECREF(names);
    return -1;
}

static int module_traverse(PyObject *m, visitproc visit, void *arg) {
    module_state *s = cring__pyext_state(m);
    Py_VISIT(s->CRingError);
    Py_VISIT(s->TimeoutError);
    Py_VISIT(s->PeerFailureError);
    Py_VISIT(s->MismatchError);
    Py_VISIT(s->NotInitializedError);
    Py_VISIT(s->StoreServerType);
    Py_VISIT(s->StoreClientType);
    Py_VISIT(s->OutputBufferType);
    Py_VISIT(s->HandleType);
    Py_VISIT(s->ResultBlockType);
    return 0;
}

static int module_clear(PyObject *m) {
    module_state *s = cring__pyext_state(m);
    Py_CLEAR(s->CRingError);
    Py_CLEAR(s->TimeoutError);
    Py_CLEAR(s->PeerFailureError);
    Py_CLEAR(s->MismatchError);
    Py_CLEAR(s->NotInitializedError);
    Py_CLEAR(s->StoreServerType);
    Py_CLEAR(s->StoreClientType);
    Py_CLEAR(s->OutputBufferType);
    Py_CLEAR(s->HandleType);
    Py_CLEAR(s->ResultBlockType);
    return 0;
}

static void module_free(void *m) {
    module_state *s = cring__pyext_state((PyObject *)m);
    cring__pyext_psets_free(s); /* process sets before the global engine */
    if (s->engine) {
        cring_engine_stop(s->engine);
        s->engine = NULL;
    }
    cring__pyext_sweep(s, 1); /* the engine is stopped: nothing writes into them any more */
    module_clear((PyObject *)m);
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

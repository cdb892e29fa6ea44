/* store_bindings.c: cring._C.StoreServer and StoreClient, the rendezvous
 * key-value store (csrc/bootstrap) for launchers and elastic workers. Every
 * call that can block runs with the GIL released; no collective logic here. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <pythread.h>
#include <stdio.h>
#include <stdlib.h>

#include "../common/common.h"
#include "pyext.h"

/* ---- StoreServer ------------------------------------------------------------ */
typedef struct {
    PyObject_HEAD cring_store_server_t *server;
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
    Py_BEGIN_ALLOW_THREADS st =
        cring_store_server_start(addr, port, secret, &self->server, &self->port);
    if (st != CRING_OK) snprintf(detail, sizeof detail, "%s", cring__thread_errmsg()->text);
    Py_END_ALLOW_THREADS if (st != CRING_OK) {
        Py_DECREF(self);
        module_state *s = PyType_GetModuleState(type);
        return cring__pyext_raise(s, st, "cannot start the rendezvous store", detail);
    }
    return (PyObject *)self;
}

static void stop_server(StoreServerObject *self) {
    cring_store_server_t *server = self->server;
    self->server = NULL;
    if (server) {
        Py_BEGIN_ALLOW_THREADS cring_store_server_stop(server);
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
    PyObject_HEAD cring_store_t *client;
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
    Py_BEGIN_ALLOW_THREADS st = cring_store_connect(addr, port, secret, timeout_s, &self->client);
    if (st != CRING_OK) snprintf(detail, sizeof detail, "%s", cring__thread_errmsg()->text);
    Py_END_ALLOW_THREADS if (st != CRING_OK) {
        char context[400];
        snprintf(context, sizeof context, "cannot connect to the rendezvous store at %s",
                 self->where);
        Py_DECREF(self);
        return cring__pyext_raise(PyType_GetModuleState(type), st, context, detail);
    }
    return (PyObject *)self;
}

/* Run one store call with the GIL released and the client's lock held. */
#define STORE_CALL(self, st, call)                                                                 \
    do {                                                                                           \
        Py_BEGIN_ALLOW_THREADS PyThread_acquire_lock((self)->lock, WAIT_LOCK);                     \
        st = (self)->client ? (call) : CRING_ERR_CLOSED;                                           \
        if (st != CRING_OK) snprintf(detail, sizeof detail, "%s", cring__thread_errmsg()->text);   \
        PyThread_release_lock((self)->lock);                                                       \
        Py_END_ALLOW_THREADS                                                                       \
    } while (0)

static PyObject *store_error(StoreClientObject *self, cring_status_t st, const char *op,
                             const char *key, const char *detail) {
    char context[600];
    snprintf(context, sizeof context, "rendezvous store %s: %s of '%.200s'", self->where, op, key);
    return cring__pyext_raise(PyType_GetModuleState(Py_TYPE(self)), st, context, detail);
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
                    : st == CRING_ERR_TIMEOUT
                        ? Py_NewRef(Py_False)
                        : store_error(self, st, "wait", n ? keys[0] : "", detail);
    PyMem_Free(keys);
    Py_DECREF(seq);
    return out;
}

static void close_client(StoreClientObject *self) {
    if (!self->lock) return;
    cring_store_interrupt(self->client); /* a blocked call returns, releasing the lock */
    Py_BEGIN_ALLOW_THREADS PyThread_acquire_lock(self->lock, WAIT_LOCK);
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

int cring__pyext_store_init(PyObject *m, module_state *s) {
    s->StoreServerType = (PyTypeObject *)PyType_FromModuleAndSpec(m, &StoreServer_spec, NULL);
    if (!s->StoreServerType) return -1;
    if (PyModule_AddObjectRef(m, "StoreServer", (PyObject *)s->StoreServerType) < 0) return -1;
    s->StoreClientType = (PyTypeObject *)PyType_FromModuleAndSpec(m, &StoreClient_spec, NULL);
    if (!s->StoreClientType) return -1;
    return PyModule_AddObjectRef(m, "StoreClient", (PyObject *)s->StoreClientType);
}

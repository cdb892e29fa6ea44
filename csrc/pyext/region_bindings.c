/* region_bindings.c: cring._C.shared_region, the binding of
 * cring_comm_shared_region for cring.torch's gradient buckets. No layout of
 * buckets here (python/cring/torch/_buckets.py) and no mapping (the core). */
#include <Python.h>

#include "pyext.h"

/* shared_region(nbytes) -> the region's address (an int), or None where the
 * transport has no shared regions (TCP, hierarchical, one rank) or a rank
 * could not map one; raises on a mismatch between ranks or a failed store.
 * Collective over the global set. */
static PyObject *py_shared_region(PyObject *module, PyObject *args) {
    module_state *s = cring__pyext_state(module);
    Py_ssize_t nbytes;
    if (!PyArg_ParseTuple(args, "n", &nbytes)) return NULL;
    if (nbytes <= 0) {
        PyErr_Format(PyExc_ValueError, "shared_region: nbytes must be > 0, got %zd", nbytes);
        return NULL;
    }
    if (!s->engine) return cring__pyext_not_initialized(s);
    cring_comm_t *c = cring_engine_comm(s->engine);
    void *data = NULL;
    cring_status_t st;
    Py_BEGIN_ALLOW_THREADS st = cring_comm_shared_region(c, (size_t)nbytes, &data);
    Py_END_ALLOW_THREADS if (st == CRING_ERR_NOT_SUPPORTED || st == CRING_ERR_SYSTEM ||
                             st == CRING_ERR_NO_MEMORY) Py_RETURN_NONE;
    if (st != CRING_OK) return cring__pyext_raise(s, st, "shared_region", cring_comm_last_error(c));
    return PyLong_FromVoidPtr(data);
}

PyMethodDef cring__pyext_region_functions[] = {
    {"shared_region", py_shared_region, METH_VARARGS,
     "shared_region(nbytes) -> address or None: a region every local peer maps (collective)"},
    {NULL, NULL, 0, NULL}};

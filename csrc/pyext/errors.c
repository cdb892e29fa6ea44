/* errors.c: the one mapping from a cring status to a Python exception, used
 * by every file of cring._C. It decides exception types and message shape
 * only; it must not look at requests, tensors or the engine's state. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#include "pyext.h"

PyObject *cring__pyext_raise(module_state *s, cring_status_t st, const char *context,
                             const char *detail) {
    PyObject *type;
    switch (st) {
    case CRING_ERR_INVALID_ARGUMENT: type = PyExc_ValueError; break;
    case CRING_ERR_NOT_SUPPORTED: type = PyExc_TypeError; break;
    case CRING_ERR_NO_MEMORY: type = PyExc_MemoryError; break;
    case CRING_ERR_TIMEOUT: type = s->TimeoutError; break;
    case CRING_ERR_PEER_FAILURE: type = s->PeerFailureError; break;
    case CRING_ERR_MISMATCH: type = s->MismatchError; break;
    default: type = s->CRingError; break;
    }
    if (detail && *detail) PyErr_Format(type, "%s: %s", context, detail);
    else PyErr_Format(type, "%s: %s", context, cring_status_string(st));
    return NULL;
}

PyObject *cring__pyext_not_initialized(module_state *s) {
    PyErr_SetString(s->NotInitializedError,
                    "cring has not been initialized; call cring.init() first");
    return NULL;
}

const char *cring__pyext_collective_label(int c) {
    return cring_collective_name((cring_collective_t)c);
}

/* Does the detail name the tensor other than in the "('x' was pending)" note
 * that a failure of everything pending appends? That note alone still gets
 * "<collective> of tensor 'x' failed" in front, so the message leads with it. */
static int names_tensor(const char *detail, const char *quoted) {
    static const char pending[] = " was pending)";
    for (const char *hit = strstr(detail, quoted); hit; hit = strstr(hit + 1, quoted)) {
        int note = hit > detail && hit[-1] == '(' &&
                   strncmp(hit + strlen(quoted), pending, sizeof pending - 1) == 0;
        if (!note) return 1;
    }
    return 0;
}

PyObject *cring__pyext_raise_handle(module_state *s, cring_handle_t *h, cring_status_t st,
                                    int collective, const char *name) {
    char context[512], quoted[512];
    const char *detail = cring_handle_error(h);
    snprintf(quoted, sizeof quoted, "'%s'", name);
    if (names_tensor(detail, quoted)) /* the detail names the tensor already */
        snprintf(context, sizeof context, "%s failed", cring__pyext_collective_label(collective));
    else
        snprintf(context, sizeof context, "%s of tensor '%s' failed",
                 cring__pyext_collective_label(collective), name);
    return cring__pyext_raise(s, st, context, detail);
}

PyObject *cring__pyext_raise_submit(module_state *s, cring_status_t st, int collective,
                                    const char *name) {
    char context[512], quoted[512];
    const char *detail = cring_engine_error_message();
    snprintf(quoted, sizeof quoted, "'%s'", name);
    if (names_tensor(detail, quoted)) /* the engine's message names the tensor already */
        snprintf(context, sizeof context, "%s", cring__pyext_collective_label(collective));
    else
        snprintf(context, sizeof context, "%s of tensor '%s'",
                 cring__pyext_collective_label(collective), name);
    return cring__pyext_raise(s, st, context, detail);
}

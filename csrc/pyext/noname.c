/* noname.c: the names of unnamed calls, which submit.c and submit_small.c
 * give to requests without one. The k-th unnamed call of a kind is
 * "<kind>.noname.<k mod NONAME_CYCLE>": every rank makes unnamed calls in the
 * same order, so the names match in call order, and reused names let the
 * response cache serve them (a name still in flight makes the next one wait
 * behind it: CRING_REQUEST_SEQUENCED). The cycle bounds how many unnamed
 * calls of a kind one round can fuse. Needs the GIL; no requests of its own. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#include "pyext.h"

#define NONAME_CYCLE 64  /* at most 100: two digits */
#define NONAME_KINDS 256 /* kinds x process sets */
static struct {
    char kind[40];
    unsigned long long next;
} noname_counters[NONAME_KINDS];
static int noname_nkinds;

/* pyext.h */
int cring__pyext_noname(const char *kind, char *out, size_t cap, int consume) {
    int i = 0;
    while (i < noname_nkinds && strcmp(noname_counters[i].kind, kind) != 0) i++;
    if (i == noname_nkinds) {
        if (i == NONAME_KINDS || strlen(kind) >= sizeof noname_counters[i].kind) {
            PyErr_Format(PyExc_ValueError, "cannot name unnamed '%s' calls", kind);
            return -1;
        }
        snprintf(noname_counters[i].kind, sizeof noname_counters[i].kind, "%s", kind);
        noname_counters[i].next = 0;
        noname_nkinds++;
    }
    /* by hand: snprintf's "%s...%llu" costs a tenth of a small call */
    size_t len = strlen(noname_counters[i].kind);
    unsigned k = (unsigned)(noname_counters[i].next % NONAME_CYCLE);
    if (cap < len + 8 + 4) return PyErr_Format(PyExc_ValueError, "kind %s too long", kind), -1;
    memcpy(out, noname_counters[i].kind, len);
    memcpy(out + len, ".noname.", 8);
    len += 8;
    if (k >= 10) out[len++] = (char)('0' + k / 10);
    out[len++] = (char)('0' + k % 10);
    out[len] = 0;
    noname_counters[i].next += consume != 0;
    return 0;
}

/* pyext.h */
int cring__pyext_is_generated(const char *name) {
    const char *p = strstr(name, ".noname.");
    if (!p || !p[8]) return 0;
    for (p += 8; *p; p++)
        if (*p < '0' || *p > '9') return 0;
    return 1;
}

/* noname(kind) -> the next name of an unnamed call of that kind. */
PyObject *cring__pyext_py_noname(PyObject *module, PyObject *arg) {
    const char *kind = PyUnicode_AsUTF8(arg);
    char name[64];
    if (!kind || cring__pyext_noname(kind, name, sizeof name, 1) < 0) return NULL;
    return PyUnicode_FromString(name);
}

/* noname_reset([suffix]): every kind counts from 0 again (a new job: init),
 * or only the kinds that end in suffix (a removed process set's). */
PyObject *cring__pyext_py_noname_reset(PyObject *module, PyObject *args) {
    const char *suffix = NULL;
    if (!PyArg_ParseTuple(args, "|s", &suffix)) return NULL;
    size_t ls = suffix ? strlen(suffix) : 0;
    for (int i = 0; i < noname_nkinds; i++) {
        size_t lk = strlen(noname_counters[i].kind);
        if (!suffix || (lk >= ls && strcmp(noname_counters[i].kind + lk - ls, suffix) == 0))
            noname_counters[i].next = 0;
    }
    Py_RETURN_NONE;
}

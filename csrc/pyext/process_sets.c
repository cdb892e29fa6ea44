/* process_sets.c: the registry of process sets: set id -> its own communicator
 * and engine (or "this rank is not a member"), built from the global init's
 * configuration, and stopped before the global engine. It must not agree on
 * membership (cring._api does that over the global engine first) or build requests. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdlib.h>
#include <string.h>

#include "../common/common.h"
#include "pyext.h"

static char *copy_text(const char *text) {
    if (!text) return NULL;
    size_t n = strlen(text) + 1;
    char *copy = PyMem_RawMalloc(n);
    if (copy) memcpy(copy, text, n);
    return copy;
}

static void free_config(cring__pyext_psets_t *p) {
    PyMem_RawFree(p->store_addr);
    PyMem_RawFree(p->secret);
    PyMem_RawFree(p->job_key);
    p->store_addr = p->secret = p->job_key = NULL;
}

int cring__pyext_psets_configure(module_state *s, const cring_config_t *cfg) {
    cring__pyext_psets_t *p = &s->psets;
    free_config(p);
    p->store_addr = copy_text(cfg->store_addr);
    p->secret = copy_text(cfg->secret);
    p->job_key = copy_text(cfg->job_key && *cfg->job_key ? cfg->job_key : "cring");
    p->store_port = cfg->store_port;
    p->transport = cfg->transport;
    p->timeout_s = cfg->timeout_s;
    p->rank = cfg->rank;
    p->generation = 0;
    if ((cfg->store_addr && !p->store_addr) || (cfg->secret && !p->secret) || !p->job_key) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

static cring__pyext_pset_t *find(module_state *s, int id) {
    for (int i = 0; i < s->psets.nsets; i++)
        if (s->psets.sets[i].id == id) return &s->psets.sets[i];
    return NULL;
}

/* "[0, 2, 3]" (cut short past the buffer) */
static void format_ranks(const cring__pyext_pset_t *set, char *out, size_t len) {
    size_t used = (size_t)snprintf(out, len, "[");
    for (int i = 0; i < set->nranks && used + 16 < len; i++)
        used += (size_t)snprintf(out + used, len - used, "%s%d", i ? ", " : "", set->ranks[i]);
    if (used + 16 >= len) used += (size_t)snprintf(out + used, len - used, ", ...");
    snprintf(out + used, len - used, "]");
}

cring_engine_t *cring__pyext_pset_engine(module_state *s, int id, const cring__pyext_pset_t **set) {
    *set = NULL;
    if (!s->engine) {
        cring__pyext_not_initialized(s);
        return NULL;
    }
    if (id == 0) return s->engine;
    const cring__pyext_pset_t *found = find(s, id);
    if (!found) {
        PyErr_Format(PyExc_ValueError,
                     "process set %d is not known on rank %d (removed, or never added; "
                     "add it with cring.add_process_set on every rank)",
                     id, s->psets.rank);
        return NULL;
    }
    if (!found->engine) {
        char ranks[512];
        format_ranks(found, ranks, sizeof ranks);
        PyErr_Format(PyExc_ValueError, "rank %d is not in process set %d (ranks %s)", s->psets.rank,
                     id, ranks);
        return NULL;
    }
    *set = found;
    return found->engine;
}

int cring__pyext_pset_root(module_state *s, const cring__pyext_pset_t *set, int root,
                           const char *name) {
    for (int i = 0; i < set->nranks; i++)
        if (set->ranks[i] == root) return i;
    char ranks[512];
    format_ranks(set, ranks, sizeof ranks);
    PyErr_Format(PyExc_ValueError, "tensor '%s': root_rank %d is not in process set %d (ranks %s)",
                 name, root, set->id, ranks);
    (void)s;
    return -1;
}

/* Start the engine of a set this rank belongs to: a communicator over the
 * same rendezvous store under its own key prefix, ranks renumbered. The
 * timeline of CRING_TIMELINE gets its own file per set ("trace.json" ->
 * "trace.ps<id>.json", written by the set's rank 0 as the engine does). */
static cring_status_t start_set_engine(module_state *s, int id, int index, int nranks,
                                       cring_engine_t **engine, char *detail, size_t len) {
    cring__pyext_psets_t *p = &s->psets;
    char job_key[600];
    snprintf(job_key, sizeof job_key, "%s/ps%d/%u", p->job_key, id, p->generation);
    cring_config_t cfg;
    cring_config_init(&cfg);
    cfg.rank = index;
    cfg.size = nranks;
    cfg.store_addr = p->store_addr;
    cfg.store_port = p->store_port;
    cfg.serve_store = 0;
    cfg.secret = p->secret;
    cfg.job_key = job_key;
    cfg.transport = p->transport;
    cfg.timeout_s = p->timeout_s;
    cring_comm_t *comm = NULL;
    cring_status_t st;
    Py_BEGIN_ALLOW_THREADS st = cring_comm_init(&cfg, &comm);
    if (st != CRING_OK) snprintf(detail, len, "%s", cring_last_init_error());
    Py_END_ALLOW_THREADS if (st != CRING_OK) return st;
    /* engine start reads CRING_TIMELINE and CRING_AUTOTUNE_LOG once; with the
     * GIL held, nothing else of ours reads them. Each set writes its own
     * files ("trace.json" -> "trace.ps3.json"), not over the global set's. */
    static const char *const per_set[] = {"CRING_TIMELINE", "CRING_AUTOTUNE_LOG"};
    char *saved[2] = {NULL, NULL};
    for (int v = 0; v < 2; v++) {
        const char *value = getenv(per_set[v]);
        if (!value || !*value || !(saved[v] = copy_text(value))) continue;
        char path[4096];
        const char *dot = strrchr(saved[v], '.');
        if (dot && !strchr(dot, '/'))
            snprintf(path, sizeof path, "%.*s.ps%d%s", (int)(dot - saved[v]), saved[v], id, dot);
        else snprintf(path, sizeof path, "%s.ps%d", saved[v], id);
        setenv(per_set[v], path, 1);
    }
    st = cring_engine_start(comm, engine); /* takes comm, even on failure */
    if (st != CRING_OK) snprintf(detail, len, "%s", cring_engine_error_message());
    for (int v = 0; v < 2; v++) {
        if (saved[v]) setenv(per_set[v], saved[v], 1);
        PyMem_RawFree(saved[v]);
    }
    return st;
}

/* process_set_add(id, ranks): register set `id` over the sorted, distinct
 * global ranks `ranks`; a member builds its communicator and engine (every
 * member must call it: it rendezvouses). */
static PyObject *py_process_set_add(PyObject *module, PyObject *args) {
    module_state *s = cring__pyext_state(module);
    int id;
    PyObject *list;
    if (!PyArg_ParseTuple(args, "iO!", &id, &PyList_Type, &list)) return NULL;
    if (!s->engine) return cring__pyext_not_initialized(s);
    int size = cring_comm_size(cring_engine_comm(s->engine));
    Py_ssize_t n = PyList_GET_SIZE(list);
    if (id <= 0 || find(s, id)) {
        PyErr_Format(PyExc_ValueError, "process set id %d is taken or invalid", id);
        return NULL;
    }
    if (n < 1 || n > size) {
        PyErr_Format(PyExc_ValueError, "a process set needs 1 to %d ranks, got %zd", size, n);
        return NULL;
    }
    int *ranks = PyMem_RawMalloc(sizeof *ranks * (size_t)n);
    if (!ranks) return PyErr_NoMemory();
    int index = -1;
    for (Py_ssize_t i = 0; i < n; i++) {
        long r = PyLong_AsLong(PyList_GET_ITEM(list, i));
        if (r == -1 && PyErr_Occurred()) goto fail;
        if (r < 0 || r >= size || (i && r <= ranks[i - 1])) {
            PyErr_Format(PyExc_ValueError,
                         "process set ranks must be distinct, ascending and in [0, %d)", size);
            goto fail;
        }
        ranks[i] = (int)r;
        if (r == s->psets.rank) index = (int)i;
    }
    cring__pyext_psets_t *p = &s->psets;
    cring__pyext_pset_t *grown = PyMem_RawRealloc(p->sets, sizeof *grown * (size_t)(p->nsets + 1));
    if (!grown) {
        PyErr_NoMemory();
        goto fail;
    }
    p->sets = grown;
    cring_engine_t *engine = NULL;
    if (index >= 0) {
        char detail[CRING__ERRMSG_BYTES] = "";
        cring_status_t st = start_set_engine(s, id, index, (int)n, &engine, detail, sizeof detail);
        if (st != CRING_OK) {
            char context[64];
            snprintf(context, sizeof context, "cannot start process set %d", id);
            cring__pyext_raise(s, st, context, detail);
            goto fail;
        }
    }
    p->generation++;
    p->sets[p->nsets++] =
        (cring__pyext_pset_t){.id = id, .nranks = (int)n, .ranks = ranks, .engine = engine};
    Py_RETURN_NONE;
fail:
    PyMem_RawFree(ranks);
    return NULL;
}

/* Unlink set i (GIL held, so no submission sees it any more), then stop its
 * engine with the GIL released; pending requests complete with ERR_CLOSED. */
static void remove_at(module_state *s, int i) {
    cring__pyext_psets_t *p = &s->psets;
    cring__pyext_pset_t set = p->sets[i];
    memmove(&p->sets[i], &p->sets[i + 1], sizeof *p->sets * (size_t)(p->nsets - i - 1));
    p->nsets--;
    if (set.engine) {
        Py_BEGIN_ALLOW_THREADS cring_engine_stop(set.engine);
        Py_END_ALLOW_THREADS
    }
    PyMem_RawFree(set.ranks);
}

/* process_set_remove(id) -> bool: whether set `id` was registered. */
static PyObject *py_process_set_remove(PyObject *module, PyObject *args) {
    module_state *s = cring__pyext_state(module);
    int id;
    if (!PyArg_ParseTuple(args, "i", &id)) return NULL;
    for (int i = 0; i < s->psets.nsets; i++)
        if (s->psets.sets[i].id == id) {
            remove_at(s, i);
            if (s->dropped) cring__pyext_sweep(s, 0);
            Py_RETURN_TRUE;
        }
    Py_RETURN_FALSE;
}

/* process_sets() -> {id: [ranks]} for the sets registered on this rank. */
static PyObject *py_process_sets(PyObject *module, PyObject *unused) {
    module_state *s = cring__pyext_state(module);
    PyObject *out = PyDict_New();
    for (int i = 0; out && i < s->psets.nsets; i++) {
        const cring__pyext_pset_t *set = &s->psets.sets[i];
        PyObject *ranks = PyList_New(set->nranks), *key = PyLong_FromLong(set->id);
        for (int j = 0; ranks && j < set->nranks; j++)
            PyList_SET_ITEM(ranks, j, PyLong_FromLong(set->ranks[j]));
        if (!ranks || !key || PyDict_SetItem(out, key, ranks) < 0) Py_CLEAR(out);
        Py_XDECREF(ranks);
        Py_XDECREF(key);
    }
    return out;
}

void cring__pyext_psets_stop_all(module_state *s) {
    while (s->psets.nsets > 0) remove_at(s, s->psets.nsets - 1);
    PyMem_RawFree(s->psets.sets);
    s->psets.sets = NULL;
}

void cring__pyext_psets_free(module_state *s) {
    cring__pyext_psets_stop_all(s);
    free_config(&s->psets);
}

PyMethodDef cring__pyext_process_set_functions[] = {
    {"process_set_add", py_process_set_add, METH_VARARGS,
     "process_set_add(id, ranks): register a process set (a member starts its engine)"},
    {"process_set_remove", py_process_set_remove, METH_VARARGS,
     "process_set_remove(id) -> bool: stop and forget a process set"},
    {"process_sets", py_process_sets, METH_NOARGS, "{id: [ranks]} of the registered sets"},
    {NULL, NULL, 0, NULL}};

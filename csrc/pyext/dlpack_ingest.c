/* dlpack_ingest.c: see dlpack_ingest.h. */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>

#include "dlpack_ingest.h"

void cring__dl_release(cring__dl_ref_t *ref) {
    Py_XDECREF(ref->owner);
    if (ref->managed) {
        if (ref->versioned) {
            cring_dl_managed_versioned_t *m = ref->managed;
            if (m->deleter) m->deleter(m);
        } else {
            cring_dl_managed_t *m = ref->managed;
            if (m->deleter) m->deleter(m);
        }
    }
    Py_XDECREF(ref->capsule);
    memset(ref, 0, sizeof *ref);
}

int cring__dl_to_dtype(cring_dl_dtype_t dt, cring_dtype_t *out) {
    if (dt.lanes != 1) return 0;
    switch (dt.code) {
    case CRING_DL_FLOAT:
        if (dt.bits == 16) *out = CRING_FLOAT16;
        else if (dt.bits == 32) *out = CRING_FLOAT32;
        else if (dt.bits == 64) *out = CRING_FLOAT64;
        else return 0;
        return 1;
    case CRING_DL_BFLOAT:
        if (dt.bits != 16) return 0;
        *out = CRING_BFLOAT16;
        return 1;
    case CRING_DL_INT:
        if (dt.bits == 8) *out = CRING_INT8;
        else if (dt.bits == 16) *out = CRING_INT16;
        else if (dt.bits == 32) *out = CRING_INT32;
        else if (dt.bits == 64) *out = CRING_INT64;
        else return 0;
        return 1;
    case CRING_DL_UINT:
        if (dt.bits == 8) *out = CRING_UINT8;
        else if (dt.bits == 16) *out = CRING_UINT16;
        else if (dt.bits == 32) *out = CRING_UINT32;
        else if (dt.bits == 64) *out = CRING_UINT64;
        else return 0;
        return 1;
    case CRING_DL_BOOL:
        if (dt.bits != 8) return 0;
        *out = CRING_BOOL;
        return 1;
    default: return 0;
    }
}

cring_dl_dtype_t cring__dl_from_dtype(cring_dtype_t d) {
    cring_dl_dtype_t dt = {.lanes = 1, .bits = (uint8_t)(8 * cring_dtype_size(d))};
    switch (d) {
    case CRING_FLOAT16:
    case CRING_FLOAT32:
    case CRING_FLOAT64: dt.code = CRING_DL_FLOAT; break;
    case CRING_BFLOAT16: dt.code = CRING_DL_BFLOAT; break;
    case CRING_UINT8:
    case CRING_UINT16:
    case CRING_UINT32:
    case CRING_UINT64: dt.code = CRING_DL_UINT; break;
    case CRING_BOOL: dt.code = CRING_DL_BOOL; break;
    default: dt.code = CRING_DL_INT; break;
    }
    return dt;
}

int cring__dtype_from_name(const char *name, cring_dtype_t *out) {
    for (int d = 0; d < CRING_DTYPE_COUNT; d++)
        if (!strcmp(name, cring_dtype_name((cring_dtype_t)d))) {
            *out = (cring_dtype_t)d;
            return 1;
        }
    PyErr_Format(PyExc_TypeError, "unknown dtype '%s'", name);
    return 0;
}

static void dl_dtype_name(cring_dl_dtype_t dt, char *out, size_t n) {
    static const char *const codes[] = {"int",    "uint",    "float", "opaque",
                                        "bfloat", "complex", "bool"};
    const char *c = dt.code < 7 ? codes[dt.code] : "code";
    if (dt.lanes != 1) snprintf(out, n, "%s%dx%d", c, dt.bits, dt.lanes);
    else snprintf(out, n, "%s%d", c, dt.bits);
}

static const char *device_name(int device_type) {
    switch (device_type) {
    case CRING_DL_CUDA: return "cuda";
    case CRING_DL_CUDA_MANAGED: return "cuda (managed)";
    case CRING_DL_ROCM: return "rocm";
    default: return "a non-CPU device";
    }
}

/* obj.__dlpack__([stream=stream,] max_version=(1, 0)) by vectorcall, falling
 * back to the call without max_version for producers that predate DLPack 1.0.
 * The kwnames and version tuples are immutable and cached once. */
static PyObject *export_dlpack(PyObject *method, PyObject *stream) {
    static PyObject *kw_version = NULL, *kw_stream_version = NULL, *kw_stream = NULL,
                    *version = NULL;
    if (!version) {
        kw_version = Py_BuildValue("(s)", "max_version");
        kw_stream_version = Py_BuildValue("(ss)", "stream", "max_version");
        kw_stream = Py_BuildValue("(s)", "stream");
        version = Py_BuildValue("(ii)", 1, 0);
        if (!kw_version || !kw_stream_version || !kw_stream || !version) {
            Py_CLEAR(kw_version);
            Py_CLEAR(kw_stream_version);
            Py_CLEAR(kw_stream);
            Py_CLEAR(version);
            return NULL;
        }
    }
    PyObject *vargs[3];
    PyObject *cap;
    vargs[0] = NULL;
    if (stream) {
        vargs[1] = stream;
        vargs[2] = version;
        cap = PyObject_Vectorcall(method, vargs + 1, PY_VECTORCALL_ARGUMENTS_OFFSET,
                                  kw_stream_version);
    } else {
        vargs[1] = version;
        cap = PyObject_Vectorcall(method, vargs + 1, PY_VECTORCALL_ARGUMENTS_OFFSET, kw_version);
    }
    if (!cap && PyErr_ExceptionMatches(PyExc_TypeError)) {
        PyErr_Clear();
        if (stream) {
            vargs[1] = stream;
            cap = PyObject_Vectorcall(method, vargs + 1, PY_VECTORCALL_ARGUMENTS_OFFSET, kw_stream);
        } else {
            cap = PyObject_CallNoArgs(method);
        }
    }
    return cap;
}

/* Take the capsule: the view moves into *ref, the capsule is marked used. */
static int take_capsule(PyObject *cap, const char *name, cring__dl_ref_t *ref) {
    ref->capsule = cap;
    if (PyCapsule_IsValid(cap, "dltensor_versioned")) {
        cring_dl_managed_versioned_t *m = PyCapsule_GetPointer(cap, "dltensor_versioned");
        if (m->version.major != 1) {
            PyErr_Format(PyExc_TypeError, "tensor '%s' uses DLPack %u.%u; cring reads 1.x", name,
                         m->version.major, m->version.minor);
            Py_CLEAR(ref->capsule);
            return -1;
        }
        PyCapsule_SetName(cap, "used_dltensor_versioned");
        ref->managed = m;
        ref->versioned = 1;
        ref->t = &m->dl_tensor;
        ref->flags = m->flags;
    } else if (PyCapsule_IsValid(cap, "dltensor")) {
        cring_dl_managed_t *m = PyCapsule_GetPointer(cap, "dltensor");
        PyCapsule_SetName(cap, "used_dltensor");
        ref->managed = m;
        ref->t = &m->dl_tensor;
    } else {
        PyErr_Format(PyExc_TypeError, "tensor '%s': __dlpack__ did not return a DLPack capsule",
                     name);
        Py_CLEAR(ref->capsule);
        return -1;
    }
    return 0;
}

static int check_device(const cring_dl_tensor_t *t, const char *name, cring__dl_device_t device) {
    int type = t->device.device_type;
    int cuda = type == CRING_DL_CUDA || type == CRING_DL_CUDA_MANAGED;
    if (device == CRING__DL_CUDA) {
        if (cuda) return 0;
        PyErr_Format(PyExc_ValueError,
                     "tensor '%s' is not a CUDA tensor (DLPack device type %d), but the other "
                     "tensors of this call are: pass every tensor of one call on the same device",
                     name, type);
        return -1;
    }
    if (type == CRING_DL_CPU || type == CRING_DL_CUDA_HOST) return 0;
    /* CUDA tensors take the GPU path (python/cring/_gpu.py, gpu.c) before
     * reaching the CPU path; one that arrives was mixed with CPU tensors. */
    PyErr_Format(PyExc_ValueError,
                 cuda ? "tensor '%s' is on %s:%d, but this call takes CPU tensors: pass "
                        "every tensor of one call on the same device"
                      : "tensor '%s' is on %s:%d; cring takes CPU and CUDA tensors: move it "
                        "to the CPU first (for torch: tensor.cpu())",
                 name, device_name(type), t->device.device_id);
    return -1;
}

_Static_assert(sizeof(Py_ssize_t) == sizeof(int64_t), "buffer shapes are read as int64");

/* The dtype a NumPy buffer format names (native byte order only); 0 if
 * none. Used to check the array fields against the buffer export. */
static int format_dtype(const char *f, Py_ssize_t itemsize, cring_dtype_t *out) {
    if (f[0] == '@' || f[0] == '=') f++;
    if (!f[0] || f[1]) return 0;
    switch (f[0]) {
    case 'e': *out = CRING_FLOAT16; break;
    case 'f': *out = CRING_FLOAT32; break;
    case 'd': *out = CRING_FLOAT64; break;
    case 'b': *out = CRING_INT8; break;
    case 'B': *out = CRING_UINT8; break;
    case '?': *out = CRING_BOOL; break;
    case 'h':
    case 'i':
    case 'l':
    case 'q':
        if (itemsize == 2) *out = CRING_INT16;
        else if (itemsize == 4) *out = CRING_INT32;
        else if (itemsize == 8) *out = CRING_INT64;
        else return 0;
        break;
    case 'H':
    case 'I':
    case 'L':
    case 'Q':
        if (itemsize == 2) *out = CRING_UINT16;
        else if (itemsize == 4) *out = CRING_UINT32;
        else if (itemsize == 8) *out = CRING_UINT64;
        else return 0;
        break;
    default: return 0;
    }
    return (size_t)itemsize == cring_dtype_size(*out);
}

int cring__dl_is_ndarray(PyObject *obj) {
    static PyTypeObject *ndarray_type = NULL; /* learnt from the first one seen */
    PyTypeObject *type = Py_TYPE(obj);
    if (type == ndarray_type) return 1;
    if (ndarray_type || strcmp(type->tp_name, "numpy.ndarray") != 0) return 0;
    ndarray_type = type;
    return 1;
}

/* The leading fields of NumPy's array and dtype objects, whose layout NumPy
 * keeps stable across 1.x and 2.x (its PyArray_DATA, PyArray_NDIM, ...
 * macros compile to them in every extension built against it). */
typedef struct {
    PyObject_HEAD char *data;
    int nd;
    Py_ssize_t *dimensions;
    Py_ssize_t *strides;
    PyObject *base;
    PyObject *descr;
    int flags;
} np_array_head;

typedef struct {
    PyObject_HEAD PyTypeObject *typeobj;
    char kind, type, byteorder, former_flags;
    int type_num;
} np_descr_head;

#define NP_C_CONTIGUOUS 0x0001
#define NP_WRITEABLE 0x0400

/* NumPy type numbers (NPY_BOOL ... NPY_HALF) -> cring dtype, by size where
 * C types differ by platform; 0 for the rest. */
static int type_num_dtype(int type_num, cring_dtype_t *out) {
    switch (type_num) {
    case 0: *out = CRING_BOOL; return 1;
    case 1: *out = CRING_INT8; return 1;
    case 2: *out = CRING_UINT8; return 1;
    case 3: *out = sizeof(short) == 2 ? CRING_INT16 : CRING_DTYPE_COUNT; break;     /* short */
    case 4: *out = sizeof(short) == 2 ? CRING_UINT16 : CRING_DTYPE_COUNT; break;    /* ushort */
    case 5: *out = sizeof(int) == 4 ? CRING_INT32 : CRING_DTYPE_COUNT; break;       /* int */
    case 6: *out = sizeof(int) == 4 ? CRING_UINT32 : CRING_DTYPE_COUNT; break;      /* uint */
    case 7: *out = sizeof(long) == 8 ? CRING_INT64 : CRING_INT32; break;            /* long */
    case 8: *out = sizeof(long) == 8 ? CRING_UINT64 : CRING_UINT32; break;          /* ulong */
    case 9: *out = sizeof(long long) == 8 ? CRING_INT64 : CRING_DTYPE_COUNT; break; /* long long */
    case 10:
        *out = sizeof(long long) == 8 ? CRING_UINT64 : CRING_DTYPE_COUNT;
        break; /* ulonglong */
    case 11: *out = CRING_FLOAT32; return 1;
    case 12: *out = CRING_FLOAT64; return 1;
    case 23: *out = CRING_FLOAT16; return 1;
    default: return 0;
    }
    return *out != CRING_DTYPE_COUNT;
}

/* Read a NumPy array from its fields: 1 when taken (a reference held in
 * ref->owner keeps it alive and unresizable), else 0. Reading the fields
 * rather than exporting and freeing a DLPack capsule saves small
 * synchronous calls about 0.15 us per tensor. */
static int acquire_fields(PyObject *obj, int writable, cring__dl_ref_t *ref) {
    const np_array_head *a = (const np_array_head *)obj;
    const np_descr_head *d = (const np_descr_head *)a->descr;
    cring_dtype_t dtype;
    if (!(a->flags & NP_C_CONTIGUOUS) || (writable && !(a->flags & NP_WRITEABLE)) || !d ||
        !(d->byteorder == '=' || d->byteorder == '|') || !type_num_dtype(d->type_num, &dtype))
        return 0;
    size_t numel = 1;
    for (int i = 0; i < a->nd; i++) numel *= (size_t)a->dimensions[i];
    cring_dl_tensor_t *t = &ref->own;
    t->data = a->data;
    t->device.device_type = CRING_DL_CPU;
    t->ndim = a->nd;
    t->dtype = cring__dl_from_dtype(dtype);
    t->shape = (int64_t *)a->dimensions;
    ref->t = t;
    ref->dtype = dtype;
    ref->data = a->data;
    ref->numel = numel;
    ref->owner = Py_NewRef(obj);
    return 1;
}

/* Is reading the fields safe with the NumPy loaded here? Checked once
 * against the buffer protocol on the first contiguous array seen. */
static int fields_agree(PyObject *obj) {
    static int verdict = -1;
    if (verdict >= 0) return verdict;
    Py_buffer v;
    if (PyObject_GetBuffer(obj, &v, PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) != 0) {
        PyErr_Clear();
        return 0; /* decide on another array */
    }
    cring__dl_ref_t probe;
    memset(&probe, 0, sizeof probe);
    cring_dtype_t dtype;
    int ok = acquire_fields(obj, 0, &probe) && v.format &&
             format_dtype(v.format, v.itemsize, &dtype) && dtype == probe.dtype &&
             v.buf == probe.data && v.ndim == probe.t->ndim &&
             (size_t)v.len == probe.numel * (size_t)v.itemsize;
    for (int i = 0; ok && i < v.ndim; i++) ok = v.shape[i] == probe.t->shape[i];
    if (ok || probe.owner) verdict = ok; /* the fields were readable: a firm answer */
    Py_XDECREF(probe.owner);
    PyBuffer_Release(&v);
    return ok;
}

/* A contiguous native NumPy array, read from its fields when they agree
 * with NumPy's buffer export; 0 (no error set) to go the DLPack way, which
 * also words the errors for what this declines (read-only, strided, odd
 * dtypes). */
static int acquire_ndarray(PyObject *obj, int writable, cring__dl_ref_t *ref) {
    return cring__dl_is_ndarray(obj) && fields_agree(obj) && acquire_fields(obj, writable, ref);
}

/* torch.Tensor.__dlpack__ is Python code that costs several microseconds
 * before it calls torch._C._to_dlpack_versioned; for a plain torch.Tensor or
 * nn.Parameter read on the host without a stream, cring calls that function
 * itself (a CUDA tensor found this way is handed back untouched: no stream
 * is synchronised by the export).
 * What __dlpack__ checks first does not apply here: cring reads tensors that
 * require grad through a detached view anyway (same storage), refuses complex
 * dtypes (so no conjugate bit), and the function refuses non-strided layouts.
 * The types and the function come from an already imported torch (never
 * imported here); learnt once, held for the life of the process. */
static PyObject *torch_tensor_type, *torch_param_type, *torch_to_dlpack;

static PyObject *torch_attr(PyObject *torch, const char *dotted) {
    PyObject *obj = Py_NewRef(torch);
    char part[64];
    for (const char *p = dotted; obj && *p;) {
        size_t n = strcspn(p, ".");
        snprintf(part, sizeof part, "%.*s", (int)n, p);
        PyObject *next = PyObject_GetAttrString(obj, part);
        Py_DECREF(obj);
        obj = next;
        p += n + (p[n] == '.');
    }
    return obj;
}

/* Is type torch.Tensor or nn.Parameter (learnt at the first one seen)? */
static int torch_known(PyTypeObject *type) {
    if (!torch_to_dlpack) {
        if (strcmp(type->tp_name, "Tensor") && strcmp(type->tp_name, "Parameter")) return 0;
        PyObject *name = PyUnicode_FromString("torch");
        PyObject *torch = name ? PyImport_GetModule(name) : NULL;
        Py_XDECREF(name);
        if (!torch) {
            PyErr_Clear();
            return 0;
        }
        PyObject *tensor = torch_attr(torch, "Tensor"), *param = torch_attr(torch, "nn.Parameter");
        PyObject *fn = torch_attr(torch, "_C._to_dlpack_versioned");
        Py_DECREF(torch);
        if (!tensor || !param || !fn) {
            PyErr_Clear();
            Py_XDECREF(tensor);
            Py_XDECREF(param);
            Py_XDECREF(fn);
            return 0;
        }
        torch_tensor_type = tensor;
        torch_param_type = param;
        torch_to_dlpack = fn;
    }
    return type == (PyTypeObject *)torch_tensor_type || type == (PyTypeObject *)torch_param_type;
}

/* The capsule of a plain CPU-or-CUDA torch tensor, NULL without an error
 * when obj is not one, or NULL with the export's error set. */
static PyObject *torch_export(PyObject *obj, int *is_torch) {
    *is_torch = 0;
    if (!torch_known(Py_TYPE(obj))) return NULL;
    *is_torch = 1;
    return PyObject_CallOneArg(torch_to_dlpack, obj);
}

static int check_tensor(cring__dl_ref_t *ref, const char *name, int writable,
                        cring__dl_device_t device);

int cring__dl_acquire_cpu(PyObject *obj, const char *name, int writable, cring__dl_ref_t *ref) {
    return cring__dl_acquire_fast(obj, name, writable, 0, ref);
}

int cring__dl_is_torch(PyObject *obj) { return torch_known(Py_TYPE(obj)); }

/* Is obj's attribute *name (interned once from `attr`) True? 0 when absent
 * (the error is cleared). */
static int attr_true(PyObject *obj, PyObject **name, const char *attr) {
    if (!*name && !(*name = PyUnicode_InternFromString(attr))) {
        PyErr_Clear();
        return 0;
    }
    PyObject *v = PyObject_GetAttr(obj, *name);
    if (!v) {
        PyErr_Clear();
        return 0;
    }
    int yes = v == Py_True;
    Py_DECREF(v);
    return yes;
}

int cring__dl_refuse_grad_leaf(PyObject *obj, const char *what) {
    static PyObject *requires_grad, *is_leaf;
    if (cring__dl_is_ndarray(obj) || !attr_true(obj, &requires_grad, "requires_grad") ||
        !attr_true(obj, &is_leaf, "is_leaf"))
        return 0;
    /* torch is imported (obj is one of its tensors): its grad mode decides, as
     * torch.no_grad() allows in-place changes of parameters */
    PyObject *name = PyUnicode_FromString("torch");
    PyObject *torch = name ? PyImport_GetModule(name) : NULL;
    Py_XDECREF(name);
    PyObject *enabled = torch ? PyObject_CallMethod(torch, "is_grad_enabled", NULL) : NULL;
    Py_XDECREF(torch);
    if (!enabled) {
        PyErr_Clear();
        return 0;
    }
    int on = enabled == Py_True;
    Py_DECREF(enabled);
    if (!on) return 0;
    PyErr_Format(PyExc_RuntimeError,
                 "a leaf Variable that requires grad is being used in an in-place operation. "
                 "(cring's %s writes the tensor: pass its .data or .detach(), or call it under "
                 "torch.no_grad())",
                 what);
    return -1;
}

int cring__dl_acquire_fast(PyObject *obj, const char *name, int writable, int cuda,
                           cring__dl_ref_t *ref) {
    memset(ref, 0, sizeof *ref);
    if (acquire_ndarray(obj, writable, ref)) return 1;
    if (cring__dl_is_ndarray(obj)) /* declined by the field reader: DLPack words the error */
        return cring__dl_acquire(obj, NULL, name, writable, CRING__DL_HOST, ref) < 0 ? -1 : 1;
    int is_torch;
    PyObject *cap = torch_export(obj, &is_torch);
    if (!is_torch) return 0;
    if (!cap || take_capsule(cap, name, ref) < 0) {
        PyErr_Clear(); /* the general path meets the same problem and words the error */
        memset(ref, 0, sizeof *ref);
        return 0;
    }
    int type = ref->t->device.device_type;
    if (type != CRING_DL_CPU && type != CRING_DL_CUDA_HOST) { /* a device tensor */
        if (cuda && type == CRING_DL_CUDA)
            return check_tensor(ref, name, writable, CRING__DL_CUDA) < 0 ? -1 : 1;
        cring__dl_release(ref);
        return 0;
    }
    return check_tensor(ref, name, writable, CRING__DL_HOST) < 0 ? -1 : 1;
}

int cring__dl_acquire(PyObject *obj, PyObject *stream, const char *name, int writable,
                      cring__dl_device_t device, cring__dl_ref_t *ref) {
    memset(ref, 0, sizeof *ref);
    if (device == CRING__DL_HOST && acquire_ndarray(obj, writable, ref)) return 0;
    if (!stream && device == CRING__DL_HOST) { /* CUDA exports keep __dlpack__'s stream order */
        int is_torch;
        PyObject *cap = torch_export(obj, &is_torch);
        if (cap) {
            if (take_capsule(cap, name, ref) < 0) return -1;
            return check_tensor(ref, name, writable, device);
        }
        if (is_torch) PyErr_Clear(); /* __dlpack__ below words the error */
    }
    PyObject *method = PyObject_GetAttrString(obj, "__dlpack__");
    if (!method) {
        PyErr_Clear();
        PyErr_Format(PyExc_TypeError,
                     "tensor '%s' must support DLPack (a NumPy array, torch tensor, ...), "
                     "got %.200s",
                     name, Py_TYPE(obj)->tp_name);
        return -1;
    }
    PyObject *cap = export_dlpack(method, stream);
    Py_DECREF(method);
    if (!cap) {
        PyObject *type, *value, *tb;
        PyErr_Fetch(&type, &value, &tb);
        PyObject *msg = value ? PyObject_Str(value) : NULL;
        PyErr_Format(PyExc_ValueError, "tensor '%s' cannot be exported through DLPack: %S", name,
                     msg ? msg : Py_None);
        Py_XDECREF(msg);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
        return -1;
    }
    if (take_capsule(cap, name, ref) < 0) return -1;
    return check_tensor(ref, name, writable, device);
}

/* Check a taken capsule's device, dtype, writability and layout and fill
 * ref's numel and data; on failure release it and return -1. */
static int check_tensor(cring__dl_ref_t *ref, const char *name, int writable,
                        cring__dl_device_t device) {
    cring_dl_tensor_t *t = ref->t;
    if (check_device(t, name, device) < 0) goto fail;
    if (!cring__dl_to_dtype(t->dtype, &ref->dtype)) {
        char dn[32];
        dl_dtype_name(t->dtype, dn, sizeof dn);
        PyErr_Format(PyExc_TypeError,
                     "tensor '%s' has dtype %s, which cring does not support (supported: "
                     "float16, bfloat16, float32, float64, int8, uint8, int16, uint16, int32, "
                     "uint32, int64, uint64, bool)",
                     name, dn);
        goto fail;
    }
    if (writable && (ref->flags & CRING_DL_FLAG_READ_ONLY)) {
        PyErr_Format(PyExc_ValueError, "tensor '%s' is read-only, but this operation writes it",
                     name);
        goto fail;
    }
    size_t numel = 1;
    for (int i = 0; i < t->ndim; i++) {
        if (t->shape[i] < 0) {
            PyErr_Format(PyExc_ValueError, "tensor '%s' has a negative dimension", name);
            goto fail;
        }
        numel *= (size_t)t->shape[i];
    }
    if (t->strides && numel > 1) {
        int64_t expect = 1;
        for (int i = t->ndim - 1; i >= 0; i--) {
            if (t->shape[i] != 1 && t->strides[i] != expect) {
                PyErr_Format(PyExc_ValueError,
                             "tensor '%s' is not contiguous (dimension %d has stride %lld "
                             "elements, expected %lld); pass a contiguous copy "
                             "(numpy.ascontiguousarray(x) or x.contiguous())",
                             name, i, (long long)t->strides[i], (long long)expect);
                goto fail;
            }
            expect *= t->shape[i];
        }
    }
    ref->numel = numel;
    ref->data = (char *)t->data + t->byte_offset;
    return 0;
fail:
    cring__dl_release(ref);
    return -1;
}

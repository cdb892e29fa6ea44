/* dlpack_ingest.h: reading tensors through DLPack, shared by the CPU face
 * (submit.c, handles.c) and the GPU face (gpu.c) of cring._C: exporting __dlpack__
 * (optionally on a stream), taking the versioned or unversioned capsule,
 * checking device, dtype, writability, shape and contiguity, and mapping
 * dtypes between DLPack and cring. Needs Python.h before it. */
#ifndef CRING_PYEXT_DLPACK_INGEST_H
#define CRING_PYEXT_DLPACK_INGEST_H

#include <stddef.h>
#include <stdint.h>

#include "cring/cring.h"
#include "dlpack_abi.h"

/* A view of one tensor; its memory stays valid until cring__dl_release.
 * Contiguous native NumPy arrays are read without DLPack (no capsule to
 * build and free on every call), from the array's own fields, described by
 * `own` in DLPack terms; the ref must stay where it was acquired (t may
 * point into it). */
typedef struct {
    PyObject *capsule;
    PyObject *owner; /* a NumPy array read in place, referenced while the view lives */
    cring_dl_tensor_t own;
    void *managed;
    int versioned;
    cring_dl_tensor_t *t;
    uint64_t flags; /* DLPack 1.x flags; 0 for an unversioned capsule */
    void *data;     /* t->data + t->byte_offset */
    size_t numel;
    cring_dtype_t dtype;
} cring__dl_ref_t;

/* Which devices a caller takes. */
typedef enum {
    CRING__DL_HOST, /* CPU and CUDA pinned host memory */
    CRING__DL_CUDA, /* CUDA device and CUDA managed memory */
} cring__dl_device_t;

/* Get a DLPack view of obj, exported with stream=stream unless stream is
 * NULL. `writable` requires a writable tensor. On failure returns -1 with a
 * TypeError/ValueError naming the tensor set and *ref cleared. */
int cring__dl_acquire(PyObject *obj, PyObject *stream, const char *name, int writable,
                      cring__dl_device_t device, cring__dl_ref_t *ref);

/* The fast paths' acquire: a NumPy array or a plain torch tensor on the CPU.
 * 1 when taken; 0, nothing set, when obj is anything else (a CUDA tensor,
 * another library's tensor), for the caller to take the general route; -1
 * with the error set when it is one of those but unusable (read-only,
 * strided, unsupported dtype). */
int cring__dl_acquire_cpu(PyObject *obj, const char *name, int writable, cring__dl_ref_t *ref);

/* cring__dl_acquire_cpu, and with `cuda` set a plain torch CUDA tensor too
 * (exported without a stream: the caller orders it by an event on the
 * producer's stream). The ref's device type tells which was taken. */
int cring__dl_acquire_fast(PyObject *obj, const char *name, int writable, int cuda,
                           cring__dl_ref_t *ref);

/* Is obj a plain torch.Tensor or nn.Parameter (known once torch was seen)? */
int cring__dl_is_torch(PyObject *obj);

/* Torch's rule for in-place operations, for cring's in-place collectives
 * (`what`, e.g. "allreduce_"): -1 with torch's RuntimeError when obj is a leaf
 * tensor that requires grad and grad mode is on; else 0 (NumPy arrays and
 * anything without requires_grad at once). */
int cring__dl_refuse_grad_leaf(PyObject *obj, const char *what);

/* Is obj exactly a numpy.ndarray (which cring__dl_acquire may read from its
 * fields)? */
int cring__dl_is_ndarray(PyObject *obj);

/* Give the view back (calls the producer's deleter); safe on a cleared ref. */
void cring__dl_release(cring__dl_ref_t *ref);

/* DLPack dtype -> cring dtype; 0 when cring does not support it. */
int cring__dl_to_dtype(cring_dl_dtype_t dt, cring_dtype_t *out);

/* cring dtype -> DLPack dtype. */
cring_dl_dtype_t cring__dl_from_dtype(cring_dtype_t d);

/* cring dtype name ("float32", ...) -> dtype; 0 with a TypeError set if unknown. */
int cring__dtype_from_name(const char *name, cring_dtype_t *out);

#endif

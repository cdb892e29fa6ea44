/* gpu.h: cring's GPU layer. It loads the CUDA runtime and NCCL with dlopen at
 * first use (never linked, no CUDA headers), keeps one NCCL communicator per
 * device slot (its unique id exchanged through the rendezvous store), enqueues
 * grouped NCCL collectives on the caller's stream, and stages tensors through
 * pinned host memory for the CPU transports. It knows nothing of Python or of
 * the engine, and never synchronises a whole device. */
#ifndef CRING_GPU_GPU_H
#define CRING_GPU_GPU_H

#include <stddef.h>
#include <stdint.h>

#include "../common/common.h"
#include "cring/cring.h"

typedef struct cring__gpu cring__gpu_t;

/* A context with nothing loaded yet. ERR_NO_MEMORY. */
cring_status_t cring__gpu_create(cring__gpu_t **out);
/* Destroy the communicators (cring__gpu_comms_destroy), free the cached pinned
 * buffers and the context. The libraries stay mapped (NCCL keeps threads that
 * must not lose their code). NULL is a no-op. */
void cring__gpu_destroy(cring__gpu_t *g);

/* ---- loading ------------------------------------------------------------------
 * The first call searches, later calls return the remembered outcome. Order:
 *   1. CRING_CUDART_LIBRARY / CRING_NCCL_LIBRARY: that file only; a failure
 *      names it and nothing else is tried;
 *   2. a copy the process has loaded already (e.g. by torch);
 *   3. wheel_paths[0..n): files inside pip wheels (nvidia-nccl-cu12/13,
 *      nvidia-cuda-runtime), found by the caller on its import path;
 *   4. the dynamic linker's search path (libnccl.so.2, libcudart.so.13/.12).
 * NCCL older than 2.10.3 or lacking a needed symbol is refused. On failure:
 * ERR_NOT_SUPPORTED with every candidate tried and why in err. Thread-safe. */
cring_status_t cring__gpu_load_cudart(cring__gpu_t *g, const char *const *wheel_paths, size_t n,
                                      cring__errmsg_t *err);
cring_status_t cring__gpu_load_nccl(cring__gpu_t *g, const char *const *wheel_paths, size_t n,
                                    cring__errmsg_t *err);
/* After a successful load: the file loaded and its version (NCCL's code,
 * e.g. 23007 for 2.30.7; the runtime's, e.g. 12080). NULL / 0 before. */
const char *cring__gpu_cudart_path(const cring__gpu_t *g);
int cring__gpu_cudart_version(const cring__gpu_t *g);
const char *cring__gpu_nccl_path(const cring__gpu_t *g);
int cring__gpu_nccl_version(const cring__gpu_t *g);
/* Number of CUDA devices (the runtime must be loaded); 0 with the runtime's
 * reason in why (may be NULL) when it reports an error (no driver, ...). */
int cring__gpu_device_count(cring__gpu_t *g, cring__errmsg_t *why);

/* ---- communicators ----------------------------------------------------------- */
/* Create the NCCL communicator of `slot` on CUDA device `device` for this
 * rank of `size`. Slots are created in order: slot must equal
 * cring__gpu_comm_count(g). Rank 0 makes the NCCL unique id and sets it in
 * the store under key; the others get it (waiting up to timeout_s). Then
 * ncclCommInitRank with `device` current (the caller's device is restored).
 * Blocks until every rank has joined; every rank must call it with the same
 * slot, size and key. The store client is used only inside this call.
 * Errors: ERR_TIMEOUT (no id in time), ERR_INVALID_ARGUMENT (NCCL refused,
 * e.g. two ranks on one GPU), ERR_SYSTEM. Thread-safe. */
cring_status_t cring__gpu_comm_create(cring__gpu_t *g, int slot, int device, int rank, int size,
                                      cring_store_t *store, const char *key, double timeout_s,
                                      cring__errmsg_t *err);
int cring__gpu_comm_count(cring__gpu_t *g);
/* CRING_OK while slot's communicator has no asynchronous error, else the
 * error (ERR_PEER_FAILURE for NCCL's remote errors) with NCCL's message. */
cring_status_t cring__gpu_comm_check(cring__gpu_t *g, int slot, cring__errmsg_t *err);
/* Destroy every communicator (ncclCommAbort for one that failed, so a dead
 * peer cannot block this). Thread-safe; used at shutdown. */
void cring__gpu_comms_destroy(cring__gpu_t *g);

/* ---- collectives -------------------------------------------------------------- */
typedef struct cring__gpu_tensor {
    const void *send;         /* device memory */
    void *recv;               /* device memory; may equal send except for reducescatter */
    cring_dtype_t dtype;
    size_t count;             /* elements of send */
    /* ALLGATHER: elements each rank contributes (the recv layout, rank order);
     * REDUCESCATTER: elements each rank receives (sum = count). size entries,
     * equal on every rank. NULL for the other collectives. */
    const size_t *rank_counts;
} cring__gpu_tensor_t;

typedef struct cring__gpu_coll {
    cring_collective_t collective; /* ALLREDUCE, BROADCAST, ALLGATHER, REDUCESCATTER */
    cring_op_t op;                 /* reductions */
    int root;                      /* broadcast */
    double scale;                  /* 1: none; else inputs are multiplied (SUM/AVERAGE of
                                      floating dtypes: NCCL's pre-multiplied sum) */
    int ntensors;
    const cring__gpu_tensor_t *tensors;
    void *stream;                  /* cudaStream_t the work is ordered on */
} cring__gpu_coll_t;

/* Enqueue the collective of every tensor on c->stream inside one
 * ncclGroupStart/ncclGroupEnd, so NCCL runs them as one launch (the fusion of
 * a grouped call). Unequal allgather parts become grouped broadcasts, unequal
 * reducescatter parts grouped reduces. Returns once enqueued: no
 * synchronisation; buffers must stay valid until the stream has run the work.
 * Every rank must make the same calls in the same order on its slot. Errors:
 * ERR_NOT_SUPPORTED (op/dtype NCCL cannot do), ERR_BROKEN, NCCL's failures.
 * Thread-safe (calls are serialised per context). */
cring_status_t cring__gpu_collective(cring__gpu_t *g, int slot, const cring__gpu_coll_t *c,
                                     cring__errmsg_t *err);

/* ---- host staging --------------------------------------------------------------- */
/* A pinned host buffer of at least `bytes` (cudaHostAlloc, portable to every
 * device), reused from a cache of freed ones. *capacity_out is what to hand
 * back. bytes 0 gives NULL. Thread-safe. */
cring_status_t cring__gpu_pinned_get(cring__gpu_t *g, size_t bytes, void **ptr_out,
                                     size_t *capacity_out, cring__errmsg_t *err);
/* Return a buffer to the cache (at most CRING_GPU_PINNED_CACHE_BYTES, default
 * 256 MiB, stay cached; the rest is freed). The caller must know no copy
 * still uses it. Thread-safe. */
void cring__gpu_pinned_put(cring__gpu_t *g, void *ptr, size_t capacity);
/* cudaMemcpyAsync between device memory and pinned host memory on stream,
 * then cudaStreamSynchronize(stream) (that stream only). to_device selects the
 * direction. Thread-safe. */
cring_status_t cring__gpu_copy_sync(cring__gpu_t *g, void *dst, const void *src, size_t bytes,
                                    int to_device, void *stream, cring__errmsg_t *err);

typedef struct cring__gpu_stats {
    uint64_t communicators; /* NCCL communicators created */
    uint64_t groups;        /* ncclGroupStart/End pairs issued */
    uint64_t nccl_calls;    /* NCCL collectives enqueued */
    uint64_t staged_bytes;  /* bytes copied between device and pinned host memory */
    uint64_t pinned_allocs; /* cudaHostAlloc calls */
} cring__gpu_stats_t;
void cring__gpu_get_stats(cring__gpu_t *g, cring__gpu_stats_t *out);

#endif /* CRING_GPU_GPU_H */

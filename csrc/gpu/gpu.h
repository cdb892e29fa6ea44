/* gpu.h: cring's GPU layer. It loads the CUDA runtime and NCCL with dlopen at
 * first use (never linked, no CUDA headers), keeps one NCCL communicator per
 * CUDA device (made from a unique id its caller distributes), enqueues grouped
 * NCCL collectives on the tensors' streams, allocates device memory for
 * results, keeps cring's own stream, ordering events and fusion buffer per
 * device (stream.c), and stages tensors through pinned host memory for the
 * CPU transports. It knows nothing of Python or of the engine (whose CUDA
 * backend, csrc/engine/exec_cuda.c, is its caller), and never synchronises a
 * device except in cring__gpu_device_free and cring__gpu_event_sync. */
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
/* 1 when NCCL of this version code has the one-rank reduce defect (2.27.0 up
 * to 2.29.6: at one rank, ncclAvg and ncclPreMulSum leave the tail of an
 * out-of-place result unwritten), so cring must not reduce with those at one
 * rank; 0 otherwise. Pure. */
int cring__gpu_nccl_one_rank_defect(int version);
/* Number of CUDA devices (the runtime must be loaded); 0 with the runtime's
 * reason in why (may be NULL) when it reports an error (no driver, ...). */
int cring__gpu_device_count(cring__gpu_t *g, cring__errmsg_t *why);

/* ---- the process's context ------------------------------------------------------- */
/* The one context of this process, created at the first call and never
 * destroyed (the libraries stay mapped; cring__gpu_comms_destroy releases the
 * communicators). The Python binding loads the libraries into it before
 * submitting a CUDA request; the engine's CUDA backend (exec_cuda.c) runs on
 * it. NULL only when out of memory. Thread-safe. */
cring__gpu_t *cring__gpu_global(void);

/* ---- communicators ----------------------------------------------------------- */
#define CRING__GPU_UNIQUE_ID_BYTES 128
/* A fresh NCCL unique id (ncclGetUniqueId) for rank 0 to hand to the others.
 * NCCL must be loaded. Thread-safe. */
cring_status_t cring__gpu_unique_id(cring__gpu_t *g, void *id_out /* UNIQUE_ID_BYTES */,
                                    cring__errmsg_t *err);
/* Create the NCCL communicator of CUDA device `device` for this rank of
 * `size` from rank 0's unique id (ncclCommInitRank with `device` current; the
 * caller's device is restored), in the next free slot (*slot_out). Blocks
 * until every rank has joined: every rank must call it at the same point of
 * its sequence of NCCL calls. Errors: ERR_INVALID_ARGUMENT (NCCL refused, e.g.
 * two ranks on one GPU), ERR_NOT_SUPPORTED (too many devices), ERR_SYSTEM.
 * Thread-safe. */
cring_status_t cring__gpu_comm_init(cring__gpu_t *g, int device, int rank, int size,
                                    const void *unique_id, int *slot_out, cring__errmsg_t *err);
/* The slot of device's communicator, -1 when there is none; the device of
 * slot's communicator, -1 when there is none. Thread-safe. */
int cring__gpu_comm_slot(cring__gpu_t *g, int device);
int cring__gpu_comm_device(cring__gpu_t *g, int slot);
int cring__gpu_comm_count(cring__gpu_t *g);
/* CRING_OK while slot's communicator has no asynchronous error, else the
 * error (ERR_PEER_FAILURE for NCCL's remote errors) with NCCL's message. */
cring_status_t cring__gpu_comm_check(cring__gpu_t *g, int slot, cring__errmsg_t *err);
/* cring__gpu_comm_check of every communicator: the first error. Thread-safe. */
cring_status_t cring__gpu_comms_check_all(cring__gpu_t *g, cring__errmsg_t *err);
/* Destroy every communicator (ncclCommAbort for one that failed, so a dead
 * peer cannot block this). Thread-safe; used when the engine stops. */
void cring__gpu_comms_destroy(cring__gpu_t *g);

/* ---- collectives -------------------------------------------------------------- */
/* Hand-aligned: one column of field comments, some over several lines. */
/* clang-format off */
typedef struct cring__gpu_tensor {
    const void *send;         /* device memory */
    void *recv;               /* device memory; may equal send except for reducescatter */
    cring_dtype_t dtype;
    size_t count;             /* elements of send */
    /* ALLGATHER: elements each rank contributes (the recv layout, rank order);
     * REDUCESCATTER: elements each rank receives (sum = count); size entries,
     * equal on every rank. ALLTOALL: elements this rank sends to each rank
     * (send layout, rank order; sum = count). NULL for the other collectives. */
    const size_t *rank_counts;
    void *stream;             /* cudaStream_t this tensor's work is ordered on
                                 (NULL: the legacy default stream) */
    /* ALLTOALL: elements this rank receives from each rank (recv layout, rank
     * order). NULL for the other collectives. */
    const size_t *recv_counts;
} cring__gpu_tensor_t;
/* clang-format on */

typedef struct cring__gpu_coll {
    cring_collective_t collective; /* ALLREDUCE, BROADCAST, ALLGATHER, REDUCESCATTER, ALLTOALL */
    cring_op_t op;                 /* reductions */
    int root;                      /* broadcast */
    double scale;                  /* 1: none; else inputs are multiplied (SUM/AVERAGE of
                                      floating dtypes: NCCL's pre-multiplied sum) */
    int ntensors;
    const cring__gpu_tensor_t *tensors;
} cring__gpu_coll_t;

/* Enqueue the collective of every tensor, each on its own stream, inside one
 * ncclGroupStart/ncclGroupEnd, so NCCL runs them as one launch (the fusion of
 * a grouped call; NCCL orders the streams of one group after each other).
 * Unequal allgather parts become grouped broadcasts, unequal reducescatter
 * parts grouped reduces, an alltoall one ncclSend and one ncclRecv per peer
 * (every peer, zero counts included). Data movement (broadcast, allgather,
 * alltoall) goes as bytes, so every dtype moves. The communicator's device is made current for the
 * call. Returns once enqueued: no synchronisation; buffers must stay valid
 * until the streams have run the work. Every rank must make the same calls
 * in the same order on its slot. Errors: ERR_NOT_SUPPORTED (op/dtype NCCL
 * cannot do), ERR_BROKEN, NCCL's failures. Thread-safe (calls are serialised
 * per context). */
cring_status_t cring__gpu_collective(cring__gpu_t *g, int slot, const cring__gpu_coll_t *c,
                                     cring__errmsg_t *err);
/* Whether the collective can run through NCCL (dtype, op, scaling), checked
 * without a communicator: CRING_OK or ERR_NOT_SUPPORTED with the reason. */
cring_status_t cring__gpu_check(const cring__gpu_coll_t *c, cring__errmsg_t *err);
/* 1 when NCCL reduces dtype with op and the factors prescale, postscale to
 * what cring's CPU reduction gives (bit for bit on integers): a dtype and op
 * NCCL has, and factors only on Sum/Average of floating dtypes (NCCL's
 * pre-multiplied sum by their product). 0 otherwise (16-bit integers, bool,
 * Adasum, scaled integers, whose CPU results truncate after each factor,
 * scaled Min/Max/Product). Pure. */
int cring__gpu_can_reduce(cring_dtype_t dtype, cring_op_t op, double prescale, double postscale);

/* ---- device memory --------------------------------------------------------------- */
/* cudaMalloc of `bytes` on `device` (the caller's device is restored); bytes
 * 0 gives NULL. ERR_NO_MEMORY with the runtime's reason. Thread-safe. */
cring_status_t cring__gpu_device_alloc(cring__gpu_t *g, int device, size_t bytes, void **ptr_out,
                                       cring__errmsg_t *err);
/* cudaFree: waits for the device's work first, so memory a later stream
 * still reads is never reused early. NULL is a no-op. Thread-safe. */
void cring__gpu_device_free(cring__gpu_t *g, void *ptr);
/* cudaMemsetAsync(ptr, 0, bytes, stream). Thread-safe. */
cring_status_t cring__gpu_zero_async(cring__gpu_t *g, void *ptr, size_t bytes, void *stream,
                                     cring__errmsg_t *err);
/* cudaMemcpyAsync device to device on stream; no wait. Thread-safe. */
cring_status_t cring__gpu_copy_device(cring__gpu_t *g, void *dst, const void *src, size_t bytes,
                                      void *stream, cring__errmsg_t *err);

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
/* The same copy without the wait (the host memory must stay valid until
 * the stream has run it), and the wait alone. Thread-safe. */
cring_status_t cring__gpu_copy_host_async(cring__gpu_t *g, void *dst, const void *src, size_t bytes,
                                          int to_device, void *stream, cring__errmsg_t *err);
cring_status_t cring__gpu_stream_sync(cring__gpu_t *g, void *stream, cring__errmsg_t *err);

/* ---- streams, events, the fusion buffer (stream.c) ------------------------------- *
 * The engine's CUDA backend runs every CUDA collective of a device on one
 * stream cring owns (created at first use, non-blocking, kept for the life of
 * the process). Producers' streams and that stream are ordered by events from
 * a per-device pool: recorded on the producer's stream at submission, waited
 * on by cring's stream (cudaStreamWaitEvent), and one recorded on cring's
 * stream after a batch, which consumers' streams wait on. No host waits
 * except cring__gpu_event_sync. */
typedef struct cring__gpu_event cring__gpu_event_t;
/* Take an event from device's pool (creating one when it is empty) and
 * record it on stream (NULL: the legacy default stream of device); device is
 * made current for the call when it is not, then restored. The caller holds
 * the one reference. ERR_SYSTEM with the runtime's reason. Thread-safe. */
cring_status_t cring__gpu_event_record(cring__gpu_t *g, int device, void *stream,
                                       cring__gpu_event_t **out, cring__errmsg_t *err);
/* Another reference to ev. Thread-safe. */
void cring__gpu_event_ref(cring__gpu_event_t *ev);
/* Drop a reference; the last one returns ev to its pool. A wait already
 * enqueued on ev is unaffected by its next record, so this may follow
 * cring__gpu_stream_wait at once. NULL is a no-op. Thread-safe. */
void cring__gpu_event_put(cring__gpu_t *g, cring__gpu_event_t *ev);
int cring__gpu_event_device(const cring__gpu_event_t *ev);
/* Make stream (on device; NULL: its legacy default stream) wait for ev
 * (cudaStreamWaitEvent): no host wait. Thread-safe. */
cring_status_t cring__gpu_stream_wait(cring__gpu_t *g, int device, void *stream,
                                      const cring__gpu_event_t *ev, cring__errmsg_t *err);
/* 1 when ev's work has run (cudaEventQuery), 0 while it has not. A runtime
 * error (a broken device) also answers 1: nothing more will run, so nothing
 * should wait for it. Never blocks. Thread-safe. */
int cring__gpu_event_done(cring__gpu_t *g, const cring__gpu_event_t *ev);
/* Block the calling thread until ev's work has run (cudaEventSynchronize).
 * Thread-safe. */
cring_status_t cring__gpu_event_sync(cring__gpu_t *g, const cring__gpu_event_t *ev,
                                     cring__errmsg_t *err);
/* cring's stream on device (created at the first call). Thread-safe. */
cring_status_t cring__gpu_device_stream(cring__gpu_t *g, int device, void **stream_out,
                                        cring__errmsg_t *err);
/* device's fusion buffer, at least `bytes` (grown by cudaFree, which waits
 * for the device, then cudaMalloc). Only for work on device's cring stream,
 * which orders its reuse; one caller at a time (the engine's driver). */
cring_status_t cring__gpu_fusion_buffer(cring__gpu_t *g, int device, size_t bytes, void **buf_out,
                                        cring__errmsg_t *err);

typedef struct cring__gpu_stats {
    uint64_t communicators; /* NCCL communicators created */
    uint64_t groups;        /* ncclGroupStart/End pairs issued */
    uint64_t nccl_calls;    /* NCCL collectives enqueued */
    uint64_t staged_bytes;  /* bytes copied between device and pinned host memory */
    uint64_t pinned_allocs; /* cudaHostAlloc calls */
    uint64_t device_allocs; /* cudaMalloc calls (results of allgathers, fusion buffers) */
    uint64_t events;        /* events recorded (producers' and completions) */
    uint64_t stream_waits;  /* cudaStreamWaitEvent calls */
    uint64_t host_waits;    /* cudaEventSynchronize calls (synchronize(block_host=True)) */
    uint64_t fused_copies;  /* device-to-device copies into and out of fusion buffers */
} cring__gpu_stats_t;
void cring__gpu_get_stats(cring__gpu_t *g, cring__gpu_stats_t *out);

#endif /* CRING_GPU_GPU_H */

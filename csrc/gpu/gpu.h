/* gpu.h: cring's GPU layer. It loads the CUDA runtime and NCCL with dlopen at
 * first use (never linked, no CUDA headers), creates NCCL communicators for
 * their owners (an engine keeps one per CUDA device it runs work on, made from
 * a unique id it distributes), enqueues grouped NCCL collectives on the
 * tensors' streams, allocates device memory stream-ordered, lends cring-owned
 * streams and keeps the ordering events per device (stream.c), and stages
 * tensors through pinned host memory for the CPU transports. It knows nothing
 * of Python or of the engine (whose CUDA backend, csrc/engine/exec_cuda.c, is
 * its caller). It never synchronises a device: no cudaFree while cring runs
 * (memory.c), and the host waits only in cring__gpu_event_sync and
 * cring__gpu_stream_sync, which callers ask for. */
#ifndef CRING_GPU_GPU_H
#define CRING_GPU_GPU_H

#include <stddef.h>
#include <stdint.h>

#include "../common/common.h"
#include "cring/cring.h"

typedef struct cring__gpu cring__gpu_t;

/* A context with nothing loaded yet. ERR_NO_MEMORY. */
cring_status_t cring__gpu_create(cring__gpu_t **out);
/* Free the cached pinned buffers and device blocks and the context (the
 * communicators belong to their owners, who destroy them first). The
 * libraries stay mapped (NCCL keeps threads that must not lose their code).
 * NULL is a no-op. */
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
 * destroyed (the libraries stay mapped; each engine destroys its own
 * communicators). The Python binding loads the libraries into it before
 * submitting a CUDA request; the engine's CUDA backend (exec_cuda.c) runs on
 * it. NULL only when out of memory. Thread-safe. */
cring__gpu_t *cring__gpu_global(void);

/* ---- communicators -----------------------------------------------------------
 * A communicator belongs to its creator (the engine of one process set, for
 * one CUDA device), which alone enqueues on it and destroys it, so stopping one
 * engine never touches another's. Nothing here holds a lock of the context
 * while NCCL waits for peers: creation holds none, enqueueing holds the
 * communicator's own, and a check from another thread (synchronize) only
 * tries that one and never waits. */
typedef struct cring__gpu_comm cring__gpu_comm_t;
#define CRING__GPU_UNIQUE_ID_BYTES 128
/* A fresh NCCL unique id (ncclGetUniqueId) for rank 0 to hand to the others.
 * NCCL must be loaded. Thread-safe. */
cring_status_t cring__gpu_unique_id(cring__gpu_t *g, void *id_out /* UNIQUE_ID_BYTES */,
                                    cring__errmsg_t *err);
/* Create the NCCL communicator of CUDA device `device` for this rank of
 * `size` from rank 0's unique id (ncclCommInitRank with `device` current; the
 * caller's device is restored); *out is the caller's. Blocks until every rank
 * has joined: every rank must call it at the same point of its sequence of
 * NCCL calls on this communicator. Errors: ERR_INVALID_ARGUMENT (NCCL refused,
 * e.g. two ranks on one GPU), ERR_NO_MEMORY, ERR_SYSTEM. Thread-safe. */
cring_status_t cring__gpu_comm_create(cring__gpu_t *g, int device, int rank, int size,
                                      const void *unique_id, cring__gpu_comm_t **out,
                                      cring__errmsg_t *err);
/* Its device and size. Pure. */
int cring__gpu_comm_device(const cring__gpu_comm_t *c);
int cring__gpu_comm_size(const cring__gpu_comm_t *c);
/* CRING_OK while c has no error, else the error (ERR_PEER_FAILURE for NCCL's
 * remote errors) with NCCL's message; the first error breaks c for good. Asks
 * NCCL (ncclCommGetAsyncError) unless its owner is inside a call on it right
 * now (that call reports errors itself) or c was destroyed: never waits.
 * Thread-safe, any thread, GIL held or not. */
cring_status_t cring__gpu_comm_check(cring__gpu_t *g, cring__gpu_comm_t *c, cring__errmsg_t *err);
/* Break c (a later check or collective returns st with msg) and abort its
 * NCCL communicator so its queued work ends instead of waiting for peers: for
 * an owner whose other channel to the peers failed. Owner only. */
void cring__gpu_comm_fail(cring__gpu_t *g, cring__gpu_comm_t *c, cring_status_t st,
                          const char *msg);
/* The owner is done with c: ncclCommDestroy (ncclCommAbort when c is broken,
 * so a dead peer cannot block it), then the owner's reference goes; events
 * that watch c keep the object until they go. NULL is a no-op. */
void cring__gpu_comm_destroy(cring__gpu_t *g, cring__gpu_comm_t *c);
/* Communicators created and not yet destroyed, in this context. Thread-safe. */
int cring__gpu_comm_live(cring__gpu_t *g);

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

/* Enqueue the collective of every tensor on c, each on its own stream, inside
 * one ncclGroupStart/ncclGroupEnd, so NCCL runs them as one launch (the fusion
 * of a grouped call; NCCL orders the streams of one group after each other).
 * Unequal allgather parts become grouped broadcasts, unequal reducescatter
 * parts grouped reduces, an alltoall one ncclSend and one ncclRecv per peer
 * (every peer, zero counts included). Data movement (broadcast, allgather,
 * alltoall) goes as bytes, so every dtype moves. The communicator's device is made current for the
 * call. Returns once enqueued: no synchronisation; buffers must stay valid
 * until the streams have run the work. Every rank must make the same calls
 * in the same order on its communicator. Errors: ERR_NOT_SUPPORTED (op/dtype
 * NCCL cannot do), ERR_BROKEN, NCCL's failures (which break comm). Owner
 * only (calls on one communicator are serialised by its lock). */
cring_status_t cring__gpu_collective(cring__gpu_t *g, cring__gpu_comm_t *comm,
                                     const cring__gpu_coll_t *c, cring__errmsg_t *err);
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

/* ---- device memory ---------------------------------------------------------------
 * Stream-ordered: memory is allocated at a point of a stream and given back at
 * a point of a stream, and nothing waits for the device. With the runtime's
 * stream-ordered allocator (cudaMallocAsync/cudaFreeAsync, CUDA >= 11.2, on a
 * device with memory pools) that is CUDA's own. Without it, a free records an
 * event on its stream and keeps the block (power-of-two sizes from 4 KiB) for
 * the next allocation of its size and device once that event has passed;
 * cudaMalloc only when none has; the blocks go back to CUDA only with the
 * context. Never cudaFree, which waits for the whole device (and, beside
 * another communicator's NCCL kernels, can deadlock). */
/* `bytes` of device memory on `device` for work on `stream` (NULL: the legacy
 * default stream), valid from that point of the stream on; bytes 0 gives
 * NULL. ERR_NO_MEMORY with the runtime's reason. Thread-safe. */
cring_status_t cring__gpu_mem_alloc(cring__gpu_t *g, int device, size_t bytes, void *stream,
                                    void **ptr_out, cring__errmsg_t *err);
/* Give back ptr (from cring__gpu_mem_alloc on `device` with the same bytes)
 * once the work queued on `stream` so far is done: the caller must know that
 * no other stream still uses it. Never waits: safe on any thread, GIL held or
 * not (a DLPack deleter). NULL is a no-op. */
void cring__gpu_mem_free(cring__gpu_t *g, int device, void *ptr, size_t bytes, void *stream);
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

/* ---- streams and events (stream.c) ------------------------------------------- *
 * The engine's CUDA backend runs each device's collectives on a stream cring
 * owns (non-blocking; one per engine and device, lent from a per-device pool
 * and kept for the life of the process, since NCCL needs every rank to
 * enqueue one communicator's work in the same order and two engines' work on
 * one stream would interleave differently on each rank). Producers' streams
 * and that stream are ordered by events from a per-device pool: recorded on
 * the producer's stream at submission, waited on by cring's stream
 * (cudaStreamWaitEvent), and one recorded on cring's stream after a batch,
 * which consumers' streams wait on. No host waits except
 * cring__gpu_event_sync. */
typedef struct cring__gpu_stream cring__gpu_stream_t;
/* A cring stream on device for the caller alone (from the pool; created when
 * it is empty). ERR_SYSTEM with the runtime's reason. Thread-safe. */
cring_status_t cring__gpu_stream_acquire(cring__gpu_t *g, int device, cring__gpu_stream_t **out,
                                         cring__errmsg_t *err);
/* Its cudaStream_t and device. Pure. */
void *cring__gpu_stream_handle(const cring__gpu_stream_t *s);
int cring__gpu_stream_device(const cring__gpu_stream_t *s);
/* Back to the pool: the next owner's work queues after what is on it. NULL
 * is a no-op. Thread-safe. */
void cring__gpu_stream_release(cring__gpu_t *g, cring__gpu_stream_t *s);

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
/* ev follows work on comm: ev keeps a reference to comm until it goes back
 * to its pool, and cring__gpu_event_check asks comm. Call before handing ev
 * to other threads. */
void cring__gpu_event_watch(cring__gpu_event_t *ev, cring__gpu_comm_t *comm);
/* Whether the work before ev can still complete: cring__gpu_comm_check of
 * the communicator it watches (CRING_OK when none). Never waits. */
cring_status_t cring__gpu_event_check(cring__gpu_t *g, cring__gpu_event_t *ev,
                                      cring__errmsg_t *err);
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

typedef struct cring__gpu_stats {
    uint64_t communicators; /* NCCL communicators created */
    uint64_t groups;        /* ncclGroupStart/End pairs issued */
    uint64_t nccl_calls;    /* NCCL collectives enqueued */
    uint64_t staged_bytes;  /* bytes copied between device and pinned host memory */
    uint64_t pinned_allocs; /* cudaHostAlloc calls */
    uint64_t device_allocs; /* device allocations: results, fusion and zero buffers */
    uint64_t device_reuses; /* of them, blocks the fallback allocator handed out again */
    uint64_t streams;       /* cring streams created (one per engine and device in use) */
    uint64_t events;        /* events recorded (producers' and completions) */
    uint64_t stream_waits;  /* cudaStreamWaitEvent calls */
    uint64_t host_waits;    /* cudaEventSynchronize calls (synchronize(block_host=True)) */
    uint64_t fused_copies;  /* device-to-device copies into and out of fusion buffers */
} cring__gpu_stats_t;
void cring__gpu_get_stats(cring__gpu_t *g, cring__gpu_stats_t *out);

#endif /* CRING_GPU_GPU_H */

/* gpu_internal.h: the GPU context shared by loader.c, nccl.c, memory.c and
 * stream.c. Not for any other layer. */
#ifndef CRING_GPU_INTERNAL_H
#define CRING_GPU_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>

#include "cuda_api.h"
#include "gpu.h"

#define CRING__GPU_PINNED_CLASSES 48 /* power-of-two size classes from 4 KiB */
#define CRING__GPU_MAX_DEVICES 64    /* device ordinals with a lane (stream.c) */

typedef struct cring__gpu_library {
    int tried; /* a search has run; status and message below are final */
    cring_status_t status;
    cring__errmsg_t message;
    void *handle;
    char path[1024];
    int version;
} cring__gpu_library_t;

/* One NCCL communicator (nccl.c), owned by its creator (an engine), which
 * alone enqueues on it and destroys it. Ordering events of work on it hold
 * references, so a check through them stays safe after its destruction. */
struct cring__gpu_comm {
    ncclComm_t comm;
    int device;
    int rank, size;
    _Atomic int refs;
    /* Held by the owner across every call into this NCCL communicator
     * (enqueueing, destruction); other threads' checks only try it, so no
     * thread ever waits on a call that waits for peers. */
    pthread_mutex_t mu;
    int destroyed; /* ncclCommDestroy/Abort has run (under mu) */
    /* CRING_OK, or the error that broke it: set once, under mu, after error;
     * read without the lock (acquire). Broken: abort instead of destroy. */
    _Atomic int status;
    cring__errmsg_t error;
};

typedef struct cring__gpu_pinned {
    void *ptr;
    struct cring__gpu_pinned *next;
} cring__gpu_pinned_t;

/* An ordering event (stream.c): in its device's free list, or held by
 * references (a request waiting to run, the handles of a batch). */
struct cring__gpu_event {
    cudaEvent_t event;
    int device;
    _Atomic int refs;
    struct cring__gpu_comm *comm;  /* the communicator of the work before it, or NULL */
    struct cring__gpu_event *next; /* in the free list */
};

/* A cring-owned stream (stream.c): created once, kept for the process, lent
 * to one owner at a time (an engine, per device). */
struct cring__gpu_stream {
    cudaStream_t stream;
    int device;
    struct cring__gpu_stream *next; /* in the free list */
};

/* A device block kept by the allocator's fallback (memory.c) until the work
 * before its free is done, then handed out again. */
typedef struct cring__gpu_block {
    void *ptr;
    size_t capacity;
    int device;
    struct cring__gpu_event *done; /* recorded on the freeing stream */
    struct cring__gpu_block *next;
} cring__gpu_block_t;

/* How device memory is allocated on a device (memory.c). */
enum { CRING__GPU_ALLOC_UNKNOWN, CRING__GPU_ALLOC_ASYNC, CRING__GPU_ALLOC_CACHE };

/* What cring keeps per CUDA device: its free streams, the pool of events,
 * the allocation mode (stream.c, memory.c). */
typedef struct cring__gpu_lane {
    struct cring__gpu_stream *free_streams;
    struct cring__gpu_event *free_events;
    _Atomic int alloc_mode;
} cring__gpu_lane_t;

struct cring__gpu {
    pthread_mutex_t mu; /* loading, pinned cache, the fallback blocks, stats */
    cring__gpu_library_t cudart_lib, nccl_lib;
    cring__cudart_api_t cudart;
    cring__nccl_api_t nccl;
    _Atomic int live_comms; /* communicators created and not destroyed */
    cring__gpu_pinned_t *pinned_free[CRING__GPU_PINNED_CLASSES];
    size_t pinned_cached_bytes;
    size_t pinned_cache_limit;
    cring__gpu_block_t *blocks; /* the fallback allocator's freed blocks */
    cring__gpu_stats_t stats;
    pthread_mutex_t lane_mu; /* lanes: free streams, event pools */
    cring__gpu_lane_t lanes[CRING__GPU_MAX_DEVICES];
};

/* 1 when the runtime / NCCL have been loaded successfully. */
static inline int cring__gpu_has_cudart(const cring__gpu_t *g) {
    return g->cudart_lib.tried && g->cudart_lib.status == CRING_OK;
}
static inline int cring__gpu_has_nccl(const cring__gpu_t *g) {
    return g->nccl_lib.tried && g->nccl_lib.status == CRING_OK;
}

/* Make `device` current unless it is (or always); *previous gets the device
 * to restore with cring__gpu_leave_device (-1: none). nccl.c, stream.c. */
cring_status_t cring__gpu_enter_device(cring__gpu_t *g, int device, int always, int *previous,
                                       cring__errmsg_t *err);
void cring__gpu_leave_device(cring__gpu_t *g, int device, int previous);

/* Another reference to c / drop one; the last frees the object (nccl.c). */
void cring__gpu_comm_ref(struct cring__gpu_comm *c);
void cring__gpu_comm_unref(struct cring__gpu_comm *c);

/* "message (cuda error N)" from the runtime's string table. */
const char *cring__gpu_cuda_error(const cring__gpu_t *g, cudaError_t e);

#endif /* CRING_GPU_INTERNAL_H */

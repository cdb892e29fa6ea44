/* gpu_internal.h: the GPU context shared by loader.c, nccl.c and memory.c.
 * Not for any other layer. */
#ifndef CRING_GPU_INTERNAL_H
#define CRING_GPU_INTERNAL_H

#include <pthread.h>
#include <stdatomic.h>

#include "cuda_api.h"
#include "gpu.h"

#define CRING__GPU_MAX_SLOTS 16
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

typedef struct cring__gpu_comm {
    ncclComm_t comm;
    int device;
    int rank, size;
    int broken;            /* an error was seen: abort instead of destroy */
    cring__errmsg_t error; /* what broke it */
} cring__gpu_comm_t;

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
    struct cring__gpu_event *next; /* in the free list */
};

/* What cring keeps per CUDA device for the engine's CUDA backend: its own
 * stream, the device fusion buffer, the pool of events (stream.c). */
typedef struct cring__gpu_lane {
    int has_stream;
    cudaStream_t stream;
    void *fusion;
    size_t fusion_cap;
    struct cring__gpu_event *free_events;
} cring__gpu_lane_t;

struct cring__gpu {
    pthread_mutex_t mu;      /* loading, pinned cache, stats */
    pthread_mutex_t comm_mu; /* communicators and enqueueing, held while blocking */
    cring__gpu_library_t cudart_lib, nccl_lib;
    cring__cudart_api_t cudart;
    cring__nccl_api_t nccl;
    cring__gpu_comm_t comms[CRING__GPU_MAX_SLOTS];
    int ncomms;
    cring__gpu_pinned_t *pinned_free[CRING__GPU_PINNED_CLASSES];
    size_t pinned_cached_bytes;
    size_t pinned_cache_limit;
    cring__gpu_stats_t stats;
    pthread_mutex_t lane_mu; /* lanes: streams, fusion buffers, event pools */
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

/* "message (cuda error N)" from the runtime's string table. */
const char *cring__gpu_cuda_error(const cring__gpu_t *g, cudaError_t e);

#endif /* CRING_GPU_INTERNAL_H */

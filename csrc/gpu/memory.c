/* memory.c: the GPU layer's memory: pinned host buffers (cached, since
 * cudaHostAlloc/cudaFreeHost are slow and cudaFreeHost may wait for the
 * device), stream-ordered device memory (results, fusion and zero buffers;
 * see gpu.h: cudaMallocAsync/cudaFreeAsync, else a cache of blocks freed
 * behind an event), and the stream-ordered copies (host staging for the CPU
 * transports, device to device for results). The only wait is
 * cudaStreamSynchronize on the caller's stream, when asked for: no cudaFree
 * while cring runs. */
#include <stdlib.h>
#include <string.h>

#include "gpu_internal.h"

#define MIN_CLASS_BYTES 4096u

static int size_class(size_t bytes, size_t *class_bytes) {
    size_t c = MIN_CLASS_BYTES;
    int k = 0;
    while (c < bytes && k < CRING__GPU_PINNED_CLASSES - 1) {
        c <<= 1;
        k++;
    }
    *class_bytes = c;
    return c >= bytes ? k : -1;
}

cring_status_t cring__gpu_pinned_get(cring__gpu_t *g, size_t bytes, void **ptr_out,
                                     size_t *capacity_out, cring__errmsg_t *err) {
    *ptr_out = NULL;
    *capacity_out = 0;
    if (bytes == 0) return CRING_OK;
    if (!cring__gpu_has_cudart(g))
        return cring__fail(err, CRING_ERR_NOT_SUPPORTED, "the CUDA runtime is not loaded");
    size_t capacity;
    int k = size_class(bytes, &capacity);
    if (k < 0) return cring__fail(err, CRING_ERR_NO_MEMORY, "%zu bytes is too large", bytes);
    pthread_mutex_lock(&g->mu);
    cring__gpu_pinned_t *node = g->pinned_free[k];
    if (node) {
        g->pinned_free[k] = node->next;
        g->pinned_cached_bytes -= capacity;
    }
    pthread_mutex_unlock(&g->mu);
    if (node) {
        *ptr_out = node->ptr;
        *capacity_out = capacity;
        free(node);
        return CRING_OK;
    }
    void *p = NULL;
    cudaError_t e = g->cudart.HostAlloc(&p, capacity, CRING_CUDA_HOST_ALLOC_PORTABLE);
    if (e != CRING_CUDA_SUCCESS || !p)
        return cring__fail(err, CRING_ERR_NO_MEMORY, "cudaHostAlloc of %zu bytes: %s", capacity,
                           cring__gpu_cuda_error(g, e));
    pthread_mutex_lock(&g->mu);
    g->stats.pinned_allocs++;
    pthread_mutex_unlock(&g->mu);
    *ptr_out = p;
    *capacity_out = capacity;
    return CRING_OK;
}

void cring__gpu_pinned_put(cring__gpu_t *g, void *ptr, size_t capacity) {
    if (!ptr) return;
    size_t class_bytes;
    int k = size_class(capacity, &class_bytes);
    cring__gpu_pinned_t *node = malloc(sizeof *node);
    pthread_mutex_lock(&g->mu);
    int keep = node && k >= 0 && class_bytes == capacity &&
               g->pinned_cached_bytes + capacity <= g->pinned_cache_limit;
    if (keep) {
        node->ptr = ptr;
        node->next = g->pinned_free[k];
        g->pinned_free[k] = node;
        g->pinned_cached_bytes += capacity;
    }
    pthread_mutex_unlock(&g->mu);
    if (!keep) {
        free(node);
        g->cudart.FreeHost(ptr);
    }
}

cring_status_t cring__gpu_copy_host_async(cring__gpu_t *g, void *dst, const void *src, size_t bytes,
                                          int to_device, void *stream, cring__errmsg_t *err) {
    if (!cring__gpu_has_cudart(g))
        return cring__fail(err, CRING_ERR_NOT_SUPPORTED, "the CUDA runtime is not loaded");
    if (!bytes) return CRING_OK;
    int kind = to_device ? CRING_CUDA_MEMCPY_HOST_TO_DEVICE : CRING_CUDA_MEMCPY_DEVICE_TO_HOST;
    cudaError_t e = g->cudart.MemcpyAsync(dst, src, bytes, kind, stream);
    if (e != CRING_CUDA_SUCCESS)
        return cring__fail(err, CRING_ERR_SYSTEM, "cudaMemcpyAsync (%s, %zu bytes): %s",
                           to_device ? "host to device" : "device to host", bytes,
                           cring__gpu_cuda_error(g, e));
    pthread_mutex_lock(&g->mu);
    g->stats.staged_bytes += bytes;
    pthread_mutex_unlock(&g->mu);
    return CRING_OK;
}

cring_status_t cring__gpu_stream_sync(cring__gpu_t *g, void *stream, cring__errmsg_t *err) {
    if (!cring__gpu_has_cudart(g))
        return cring__fail(err, CRING_ERR_NOT_SUPPORTED, "the CUDA runtime is not loaded");
    cudaError_t e = g->cudart.StreamSynchronize(stream);
    if (e != CRING_CUDA_SUCCESS)
        return cring__fail(err, CRING_ERR_SYSTEM, "cudaStreamSynchronize: %s",
                           cring__gpu_cuda_error(g, e));
    return CRING_OK;
}

cring_status_t cring__gpu_copy_sync(cring__gpu_t *g, void *dst, const void *src, size_t bytes,
                                    int to_device, void *stream, cring__errmsg_t *err) {
    CRING_CHECK(cring__gpu_copy_host_async(g, dst, src, bytes, to_device, stream, err));
    return cring__gpu_stream_sync(g, stream, err);
}

/* ---- device memory ---- */
/* The device's allocation mode, deciding it at the first allocation: the
 * runtime's stream-ordered allocator when it has one and the device takes it
 * (cudaMallocAsync answers cudaErrorNotSupported on a device without memory
 * pools), else the cache below. */
static int alloc_mode(cring__gpu_t *g, int device) {
    return atomic_load(&g->lanes[device].alloc_mode);
}

static void count_alloc(cring__gpu_t *g, int reused) {
    pthread_mutex_lock(&g->mu);
    g->stats.device_allocs++;
    if (reused) g->stats.device_reuses++;
    pthread_mutex_unlock(&g->mu);
}

/* The fallback: a kept block of this device and capacity whose free has
 * passed on its stream, else NULL. */
static void *take_block(cring__gpu_t *g, int device, size_t capacity) {
    cring__gpu_event_t *done = NULL;
    void *ptr = NULL;
    pthread_mutex_lock(&g->mu);
    for (cring__gpu_block_t **link = &g->blocks; *link; link = &(*link)->next) {
        cring__gpu_block_t *b = *link;
        if (b->device != device || b->capacity != capacity) continue;
        if (b->done && g->cudart.EventQuery(b->done->event) != CRING_CUDA_SUCCESS) continue;
        *link = b->next;
        ptr = b->ptr;
        done = b->done;
        free(b);
        break;
    }
    pthread_mutex_unlock(&g->mu);
    cring__gpu_event_put(g, done);
    return ptr;
}

cring_status_t cring__gpu_mem_alloc(cring__gpu_t *g, int device, size_t bytes, void *stream,
                                    void **ptr_out, cring__errmsg_t *err) {
    *ptr_out = NULL;
    if (bytes == 0) return CRING_OK;
    if (!cring__gpu_has_cudart(g))
        return cring__fail(err, CRING_ERR_NOT_SUPPORTED, "the CUDA runtime is not loaded");
    if (device < 0 || device >= CRING__GPU_MAX_DEVICES)
        return cring__fail(err, CRING_ERR_NOT_SUPPORTED, "cuda:%d: cring handles devices 0-%d",
                           device, CRING__GPU_MAX_DEVICES - 1);
    int previous = -1;
    CRING_CHECK(cring__gpu_enter_device(g, device, 0, &previous, err));
    void *p = NULL;
    cudaError_t e = CRING_CUDA_SUCCESS;
    cring_status_t st = CRING_OK;
    int mode = alloc_mode(g, device);
    if (mode != CRING__GPU_ALLOC_CACHE && g->cudart.MallocAsync && g->cudart.FreeAsync) {
        e = g->cudart.MallocAsync(&p, bytes, stream);
        if (e == CRING_CUDA_SUCCESS && mode == CRING__GPU_ALLOC_UNKNOWN)
            atomic_store(&g->lanes[device].alloc_mode, CRING__GPU_ALLOC_ASYNC);
        if (e == CRING_CUDA_ERROR_NOT_SUPPORTED && mode == CRING__GPU_ALLOC_UNKNOWN) {
            atomic_store(&g->lanes[device].alloc_mode, CRING__GPU_ALLOC_CACHE);
            mode = CRING__GPU_ALLOC_CACHE;
        } else if (e != CRING_CUDA_SUCCESS || !p) {
            st =
                cring__fail(err, CRING_ERR_NO_MEMORY, "cudaMallocAsync of %zu bytes on cuda:%d: %s",
                            bytes, device, cring__gpu_cuda_error(g, e));
        }
    } else {
        atomic_store(&g->lanes[device].alloc_mode, CRING__GPU_ALLOC_CACHE);
        mode = CRING__GPU_ALLOC_CACHE;
    }
    int reused = 0;
    if (st == CRING_OK && mode == CRING__GPU_ALLOC_CACHE) {
        size_t capacity;
        if (size_class(bytes, &capacity) < 0) {
            st = cring__fail(err, CRING_ERR_NO_MEMORY, "%zu bytes is too large", bytes);
        } else if ((p = take_block(g, device, capacity))) {
            reused = 1;
        } else {
            e = g->cudart.Malloc(&p, capacity);
            if (e != CRING_CUDA_SUCCESS || !p)
                st = cring__fail(err, CRING_ERR_NO_MEMORY, "cudaMalloc of %zu bytes on cuda:%d: %s",
                                 capacity, device, cring__gpu_cuda_error(g, e));
        }
    }
    cring__gpu_leave_device(g, device, previous);
    if (st != CRING_OK) return st;
    count_alloc(g, reused);
    *ptr_out = p;
    return CRING_OK;
}

void cring__gpu_mem_free(cring__gpu_t *g, int device, void *ptr, size_t bytes, void *stream) {
    if (!ptr || !cring__gpu_has_cudart(g) || device < 0 || device >= CRING__GPU_MAX_DEVICES) return;
    if (alloc_mode(g, device) == CRING__GPU_ALLOC_ASYNC) {
        /* CUDA orders the free after stream's work and reuses the memory for
         * other streams only behind it */
        if (g->cudart.FreeAsync(ptr, stream) == CRING_CUDA_SUCCESS) return;
        /* stream no longer exists: order the free after the device's
         * legacy default stream instead (still no host wait) */
        int previous = -1;
        if (cring__gpu_enter_device(g, device, 0, &previous, NULL) == CRING_OK) {
            g->cudart.FreeAsync(ptr, NULL);
            cring__gpu_leave_device(g, device, previous);
        }
        return;
    }
    size_t capacity;
    size_class(bytes ? bytes : 1, &capacity);
    cring__gpu_block_t *b = malloc(sizeof *b);
    cring__gpu_event_t *done = NULL;
    if (b && cring__gpu_event_record(g, device, stream, &done, NULL) != CRING_OK)
        cring__gpu_event_record(g, device, NULL, &done, NULL);
    if (!b || !done) { /* nothing to order it by: never reused (a leak, not a race) */
        free(b);
        cring__gpu_event_put(g, done);
        cring__log(CRING__LOG_WARNING, -1,
                   "cannot order the free of %zu bytes on cuda:%d: the block is kept", bytes,
                   device);
        return;
    }
    b->ptr = ptr;
    b->capacity = capacity;
    b->device = device;
    b->done = done;
    pthread_mutex_lock(&g->mu);
    b->next = g->blocks;
    g->blocks = b;
    pthread_mutex_unlock(&g->mu);
}

cring_status_t cring__gpu_zero_async(cring__gpu_t *g, void *ptr, size_t bytes, void *stream,
                                     cring__errmsg_t *err) {
    if (!bytes) return CRING_OK;
    if (!cring__gpu_has_cudart(g))
        return cring__fail(err, CRING_ERR_NOT_SUPPORTED, "the CUDA runtime is not loaded");
    cudaError_t e = g->cudart.MemsetAsync(ptr, 0, bytes, stream);
    if (e != CRING_CUDA_SUCCESS)
        return cring__fail(err, CRING_ERR_SYSTEM, "cudaMemsetAsync of %zu bytes: %s", bytes,
                           cring__gpu_cuda_error(g, e));
    return CRING_OK;
}

cring_status_t cring__gpu_copy_device(cring__gpu_t *g, void *dst, const void *src, size_t bytes,
                                      void *stream, cring__errmsg_t *err) {
    if (!bytes) return CRING_OK;
    if (!cring__gpu_has_cudart(g))
        return cring__fail(err, CRING_ERR_NOT_SUPPORTED, "the CUDA runtime is not loaded");
    cudaError_t e =
        g->cudart.MemcpyAsync(dst, src, bytes, CRING_CUDA_MEMCPY_DEVICE_TO_DEVICE, stream);
    if (e != CRING_CUDA_SUCCESS)
        return cring__fail(err, CRING_ERR_SYSTEM,
                           "cudaMemcpyAsync (device to device, %zu bytes): %s", bytes,
                           cring__gpu_cuda_error(g, e));
    pthread_mutex_lock(&g->mu);
    g->stats.fused_copies++;
    pthread_mutex_unlock(&g->mu);
    return CRING_OK;
}

void cring__gpu_destroy(cring__gpu_t *g) {
    if (!g) return;
    for (int k = 0; k < CRING__GPU_PINNED_CLASSES; k++) {
        cring__gpu_pinned_t *node = g->pinned_free[k];
        while (node) {
            cring__gpu_pinned_t *next = node->next;
            g->cudart.FreeHost(node->ptr);
            free(node);
            node = next;
        }
    }
    while (g->blocks) { /* the context goes: the device may wait now */
        cring__gpu_block_t *b = g->blocks;
        g->blocks = b->next;
        cring__gpu_event_put(g, b->done);
        g->cudart.Free(b->ptr);
        free(b);
    }
    for (int d = 0; d < CRING__GPU_MAX_DEVICES; d++) {
        cring__gpu_lane_t *lane = &g->lanes[d];
        while (lane->free_events) {
            cring__gpu_event_t *ev = lane->free_events;
            lane->free_events = ev->next;
            g->cudart.EventDestroy(ev->event);
            free(ev);
        }
        while (lane->free_streams) { /* cring loads no cudaStreamDestroy: streams stay */
            cring__gpu_stream_t *st = lane->free_streams;
            lane->free_streams = st->next;
            free(st);
        }
    }
    pthread_mutex_destroy(&g->mu);
    pthread_mutex_destroy(&g->lane_mu);
    free(g);
}

/* memory.c: the GPU layer's memory: pinned host buffers (cached, since
 * cudaHostAlloc/cudaFreeHost are slow and cudaFreeHost may wait for the
 * device), device buffers for results the engine allocates, and the
 * stream-ordered copies (host staging for the CPU transports, device to device
 * for results). The only waits are cudaStreamSynchronize on the caller's
 * stream and the one cudaFree implies. */
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
cring_status_t cring__gpu_device_alloc(cring__gpu_t *g, int device, size_t bytes, void **ptr_out,
                                       cring__errmsg_t *err) {
    *ptr_out = NULL;
    if (bytes == 0) return CRING_OK;
    if (!cring__gpu_has_cudart(g))
        return cring__fail(err, CRING_ERR_NOT_SUPPORTED, "the CUDA runtime is not loaded");
    int previous = -1;
    if (g->cudart.GetDevice(&previous) != CRING_CUDA_SUCCESS) previous = -1;
    cudaError_t e = previous == device ? CRING_CUDA_SUCCESS : g->cudart.SetDevice(device);
    if (e != CRING_CUDA_SUCCESS)
        return cring__fail(err, CRING_ERR_SYSTEM, "cudaSetDevice(%d): %s", device,
                           cring__gpu_cuda_error(g, e));
    void *p = NULL;
    e = g->cudart.Malloc(&p, bytes);
    if (previous >= 0 && previous != device) g->cudart.SetDevice(previous);
    if (e != CRING_CUDA_SUCCESS || !p)
        return cring__fail(err, CRING_ERR_NO_MEMORY, "cudaMalloc of %zu bytes on cuda:%d: %s",
                           bytes, device, cring__gpu_cuda_error(g, e));
    pthread_mutex_lock(&g->mu);
    g->stats.device_allocs++;
    pthread_mutex_unlock(&g->mu);
    *ptr_out = p;
    return CRING_OK;
}

void cring__gpu_device_free(cring__gpu_t *g, void *ptr) {
    if (ptr && cring__gpu_has_cudart(g)) g->cudart.Free(ptr);
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
    if (cring__gpu_has_nccl(g)) cring__gpu_comms_destroy(g);
    for (int k = 0; k < CRING__GPU_PINNED_CLASSES; k++) {
        cring__gpu_pinned_t *node = g->pinned_free[k];
        while (node) {
            cring__gpu_pinned_t *next = node->next;
            g->cudart.FreeHost(node->ptr);
            free(node);
            node = next;
        }
    }
    for (int d = 0; d < CRING__GPU_MAX_DEVICES; d++) {
        cring__gpu_lane_t *lane = &g->lanes[d];
        cring__gpu_device_free(g, lane->fusion);
        while (lane->free_events) {
            cring__gpu_event_t *ev = lane->free_events;
            lane->free_events = ev->next;
            g->cudart.EventDestroy(ev->event);
            free(ev);
        }
    }
    pthread_mutex_destroy(&g->mu);
    pthread_mutex_destroy(&g->comm_mu);
    pthread_mutex_destroy(&g->lane_mu);
    free(g);
}

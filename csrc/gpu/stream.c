/* stream.c: what orders cring's CUDA work against its producers and consumers:
 * one cring-owned stream per device, pools of ordering events, and the device
 * fusion buffer the engine's CUDA backend packs small tensors into. It never
 * blocks the host except in cring__gpu_event_sync (asked for) and when a
 * fusion buffer grows (cudaFree waits for the device). */
#include <stdlib.h>
#include <string.h>

#include "gpu_internal.h"

static cring_status_t need_runtime(cring__gpu_t *g, int device, cring__errmsg_t *err) {
    if (!cring__gpu_has_cudart(g))
        return cring__fail(err, CRING_ERR_NOT_SUPPORTED, "the CUDA runtime is not loaded");
    if (device < 0 || device >= CRING__GPU_MAX_DEVICES)
        return cring__fail(err, CRING_ERR_NOT_SUPPORTED, "cuda:%d: cring handles devices 0-%d",
                           device, CRING__GPU_MAX_DEVICES - 1);
    return CRING_OK;
}

static void count(cring__gpu_t *g, uint64_t *field, uint64_t n) {
    pthread_mutex_lock(&g->mu);
    *field += n;
    pthread_mutex_unlock(&g->mu);
}

cring_status_t cring__gpu_event_record(cring__gpu_t *g, int device, void *stream,
                                       cring__gpu_event_t **out, cring__errmsg_t *err) {
    *out = NULL;
    CRING_CHECK(need_runtime(g, device, err));
    pthread_mutex_lock(&g->lane_mu);
    cring__gpu_lane_t *lane = &g->lanes[device];
    cring__gpu_event_t *ev = lane->free_events;
    if (ev) lane->free_events = ev->next;
    pthread_mutex_unlock(&g->lane_mu);
    int previous = -1;
    cring_status_t st = cring__gpu_enter_device(g, device, 0, &previous, err);
    if (st != CRING_OK) {
        if (ev) cring__gpu_event_put(g, ev);
        return st;
    }
    cudaError_t e = CRING_CUDA_SUCCESS;
    if (!ev) { /* the event belongs to the device current at its creation */
        ev = calloc(1, sizeof *ev);
        if (!ev) {
            cring__gpu_leave_device(g, device, previous);
            return cring__fail(err, CRING_ERR_NO_MEMORY, "out of memory");
        }
        ev->device = device;
        e = g->cudart.EventCreateWithFlags(&ev->event, CRING_CUDA_EVENT_DISABLE_TIMING);
        if (e != CRING_CUDA_SUCCESS) {
            free(ev);
            cring__gpu_leave_device(g, device, previous);
            return cring__fail(err, CRING_ERR_SYSTEM, "cudaEventCreateWithFlags on cuda:%d: %s",
                               device, cring__gpu_cuda_error(g, e));
        }
    }
    atomic_store(&ev->refs, 1);
    e = g->cudart.EventRecord(ev->event, stream);
    cring__gpu_leave_device(g, device, previous);
    if (e != CRING_CUDA_SUCCESS) {
        cring__gpu_event_put(g, ev);
        return cring__fail(err, CRING_ERR_SYSTEM, "cudaEventRecord on cuda:%d: %s", device,
                           cring__gpu_cuda_error(g, e));
    }
    count(g, &g->stats.events, 1);
    *out = ev;
    return CRING_OK;
}

void cring__gpu_event_ref(cring__gpu_event_t *ev) { atomic_fetch_add(&ev->refs, 1); }

void cring__gpu_event_put(cring__gpu_t *g, cring__gpu_event_t *ev) {
    if (!ev || atomic_fetch_sub(&ev->refs, 1) != 1) return;
    pthread_mutex_lock(&g->lane_mu);
    cring__gpu_lane_t *lane = &g->lanes[ev->device];
    ev->next = lane->free_events;
    lane->free_events = ev;
    pthread_mutex_unlock(&g->lane_mu);
}

int cring__gpu_event_device(const cring__gpu_event_t *ev) { return ev->device; }

cring_status_t cring__gpu_stream_wait(cring__gpu_t *g, int device, void *stream,
                                      const cring__gpu_event_t *ev, cring__errmsg_t *err) {
    CRING_CHECK(need_runtime(g, device, err));
    int previous = -1;
    if (!stream) /* the legacy default stream is the current device's */
        CRING_CHECK(cring__gpu_enter_device(g, device, 0, &previous, err));
    cudaError_t e = g->cudart.StreamWaitEvent(stream, ev->event, 0);
    if (!stream) cring__gpu_leave_device(g, device, previous);
    if (e != CRING_CUDA_SUCCESS)
        return cring__fail(err, CRING_ERR_SYSTEM, "cudaStreamWaitEvent on cuda:%d: %s", device,
                           cring__gpu_cuda_error(g, e));
    count(g, &g->stats.stream_waits, 1);
    return CRING_OK;
}

int cring__gpu_event_done(cring__gpu_t *g, const cring__gpu_event_t *ev) {
    if (!cring__gpu_has_cudart(g)) return 1;
    return g->cudart.EventQuery(ev->event) != CRING_CUDA_ERROR_NOT_READY;
}

cring_status_t cring__gpu_event_sync(cring__gpu_t *g, const cring__gpu_event_t *ev,
                                     cring__errmsg_t *err) {
    CRING_CHECK(need_runtime(g, ev->device, err));
    cudaError_t e = g->cudart.EventSynchronize(ev->event);
    if (e != CRING_CUDA_SUCCESS)
        return cring__fail(err, CRING_ERR_SYSTEM, "cudaEventSynchronize on cuda:%d: %s", ev->device,
                           cring__gpu_cuda_error(g, e));
    count(g, &g->stats.host_waits, 1);
    return CRING_OK;
}

cring_status_t cring__gpu_device_stream(cring__gpu_t *g, int device, void **stream_out,
                                        cring__errmsg_t *err) {
    *stream_out = NULL;
    CRING_CHECK(need_runtime(g, device, err));
    cring__gpu_lane_t *lane = &g->lanes[device];
    pthread_mutex_lock(&g->lane_mu);
    cring_status_t st = CRING_OK;
    if (!lane->has_stream) {
        int previous = -1;
        st = cring__gpu_enter_device(g, device, 0, &previous, err);
        if (st == CRING_OK) {
            cudaError_t e =
                g->cudart.StreamCreateWithFlags(&lane->stream, CRING_CUDA_STREAM_NON_BLOCKING);
            cring__gpu_leave_device(g, device, previous);
            if (e == CRING_CUDA_SUCCESS) lane->has_stream = 1;
            else
                st = cring__fail(err, CRING_ERR_SYSTEM, "cudaStreamCreateWithFlags on cuda:%d: %s",
                                 device, cring__gpu_cuda_error(g, e));
        }
    }
    *stream_out = lane->stream;
    pthread_mutex_unlock(&g->lane_mu);
    return st;
}

cring_status_t cring__gpu_fusion_buffer(cring__gpu_t *g, int device, size_t bytes, void **buf_out,
                                        cring__errmsg_t *err) {
    *buf_out = NULL;
    CRING_CHECK(need_runtime(g, device, err));
    cring__gpu_lane_t *lane = &g->lanes[device];
    if (bytes <= lane->fusion_cap) {
        *buf_out = lane->fusion;
        return CRING_OK;
    }
    size_t cap = lane->fusion_cap ? lane->fusion_cap : (size_t)1 << 20;
    while (cap < bytes) cap *= 2;
    cring__gpu_device_free(g, lane->fusion); /* waits for work still using it */
    lane->fusion = NULL;
    lane->fusion_cap = 0;
    CRING_CHECK(cring__gpu_device_alloc(g, device, cap, &lane->fusion, err));
    lane->fusion_cap = cap;
    *buf_out = lane->fusion;
    return CRING_OK;
}

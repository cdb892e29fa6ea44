/* stream.c: what orders cring's CUDA work against its producers and consumers:
 * the pools of cring-owned streams (lent to one engine each) and of ordering
 * events, per device. It never blocks the host except in
 * cring__gpu_event_sync (asked for), and never allocates device memory. */
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
    ev->comm = NULL;
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
    cring__gpu_comm_unref(ev->comm);
    ev->comm = NULL;
    pthread_mutex_lock(&g->lane_mu);
    cring__gpu_lane_t *lane = &g->lanes[ev->device];
    ev->next = lane->free_events;
    lane->free_events = ev;
    pthread_mutex_unlock(&g->lane_mu);
}

int cring__gpu_event_device(const cring__gpu_event_t *ev) { return ev->device; }

void cring__gpu_event_watch(cring__gpu_event_t *ev, cring__gpu_comm_t *comm) {
    if (comm) cring__gpu_comm_ref(comm);
    cring__gpu_comm_unref(ev->comm);
    ev->comm = comm;
}

cring_status_t cring__gpu_event_check(cring__gpu_t *g, cring__gpu_event_t *ev,
                                      cring__errmsg_t *err) {
    return ev->comm ? cring__gpu_comm_check(g, ev->comm, err) : CRING_OK;
}

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

cring_status_t cring__gpu_stream_acquire(cring__gpu_t *g, int device, cring__gpu_stream_t **out,
                                         cring__errmsg_t *err) {
    *out = NULL;
    CRING_CHECK(need_runtime(g, device, err));
    pthread_mutex_lock(&g->lane_mu);
    cring__gpu_lane_t *lane = &g->lanes[device];
    cring__gpu_stream_t *s = lane->free_streams;
    if (s) lane->free_streams = s->next;
    pthread_mutex_unlock(&g->lane_mu);
    if (s) {
        s->next = NULL;
        *out = s;
        return CRING_OK;
    }
    s = calloc(1, sizeof *s);
    if (!s) return cring__fail(err, CRING_ERR_NO_MEMORY, "out of memory");
    int previous = -1;
    cring_status_t st = cring__gpu_enter_device(g, device, 0, &previous, err);
    if (st == CRING_OK) {
        cudaError_t e = g->cudart.StreamCreateWithFlags(&s->stream, CRING_CUDA_STREAM_NON_BLOCKING);
        cring__gpu_leave_device(g, device, previous);
        if (e != CRING_CUDA_SUCCESS)
            st = cring__fail(err, CRING_ERR_SYSTEM, "cudaStreamCreateWithFlags on cuda:%d: %s",
                             device, cring__gpu_cuda_error(g, e));
    }
    if (st != CRING_OK) {
        free(s);
        return st;
    }
    s->device = device;
    pthread_mutex_lock(&g->mu);
    g->stats.streams++;
    pthread_mutex_unlock(&g->mu);
    *out = s;
    return CRING_OK;
}

void *cring__gpu_stream_handle(const cring__gpu_stream_t *s) { return s->stream; }
int cring__gpu_stream_device(const cring__gpu_stream_t *s) { return s->device; }

void cring__gpu_stream_release(cring__gpu_t *g, cring__gpu_stream_t *s) {
    if (!s) return;
    pthread_mutex_lock(&g->lane_mu);
    cring__gpu_lane_t *lane = &g->lanes[s->device];
    s->next = lane->free_streams;
    lane->free_streams = s;
    pthread_mutex_unlock(&g->lane_mu);
}

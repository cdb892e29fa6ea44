/* backend.h: the execution backend table. The engine negotiates, orders and
 * fuses; a backend only moves a ready batch's data on one kind of device.
 * Chosen per request by req->device.type (e->backends[type]), never by asking
 * a transport its name. Included by engine_internal.h (needs req_t). */
#ifndef CRING_ENGINE_BACKEND_H
#define CRING_ENGINE_BACKEND_H

typedef struct cring__backend {
    const char *name; /* "cpu", "cuda": for messages and the timeline */
    /* Run a batch of n ready requests of one fusion key (same collective,
     * dtype, op, device, scaling, compression) in the same order on every
     * rank. Complete nothing: return a status; the engine completes the
     * handles (and on a transport failure fails everything). */
    cring_status_t (*allreduce)(cring_engine_t *e, req_t **batch, int n);
    cring_status_t (*broadcast)(cring_engine_t *e, req_t **batch, int n);
    /* first_dims: ntensors x size, from negotiation. The backend fills
     * r->handle outputs (allocating them; set free_output for device memory). */
    cring_status_t (*allgather)(cring_engine_t *e, req_t *r, const int64_t *first_dims);
    cring_status_t (*reducescatter)(cring_engine_t *e, req_t *r);
    /* A batch of alltoalls: several only where execute.c groups them (CUDA,
     * where they share one NCCL group); each request's result as allgather's. */
    cring_status_t (*alltoall)(cring_engine_t *e, req_t **batch, int n);
    /* On the submitting thread, before the request is queued (may be NULL):
     * attach what execution will need from the moment of submission (CUDA:
     * an event on the producer's stream, in r->ready_event). A failure is the
     * submission's (cring__engine_submit_fail words it). */
    cring_status_t (*prepare)(cring_engine_t *e, req_t *r);
    /* Release what prepare attached to a request that never ran (may be NULL). */
    void (*discard)(req_t *r);
    /* Called once at cring_engine_stop on the engine thread's side (may be NULL). */
    void (*shutdown)(cring_engine_t *e);
    /* The engine's communicator failed (its driver calls this, may be NULL):
     * end what the backend has queued that waits for peers, so it fails
     * rather than waits; shutdown still follows. */
    void (*abort)(cring_engine_t *e, cring_status_t st, const char *msg);
} cring__backend_t;

extern const cring__backend_t cring__backend_cpu;  /* exec_cpu.c: shm/TCP via comm */
extern const cring__backend_t cring__backend_cuda; /* exec_cuda.c: NCCL via csrc/gpu */

#endif

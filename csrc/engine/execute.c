/* execute.c: running the responses of a round in one order on every rank:
 * sorting them by fusion key, forming batches up to the fusion threshold,
 * handing each batch to the backend of its device (e->backends), and
 * completing the handles. Owns the fusion buffer. Moves no data itself
 * except through a backend (barrier aside, which is the engine's own). */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine_internal.h"
#include "test_hooks.h"

#ifdef CRING_TEST_HOOKS
_Atomic int cring__test_fail_batch_room;
#endif

int cring__fusion_reserve(cring_engine_t *e, size_t bytes) {
    if (bytes <= e->exec.fusion_cap) return 0;
    void *p = realloc(e->exec.fusion, bytes);
    if (!p) return -1;
    e->exec.fusion = p;
    e->exec.fusion_cap = bytes;
    return 0;
}

/* Timeline of a batch that went through the fusion buffer: copy in over
 * [t0, t1), the collective over [t1, t2), copy out over [t2, t3). */
void cring__fused_spans(cring_engine_t *e, req_t **batch, int n, const char *phase, double t0,
                        double t1, double t2, double t3, const char *args) {
    if (!e->timeline) return;
    for (int b = 0; b < n; b++) {
        cring__engine_span(e, batch[b]->name, "MEMCPY_IN_FUSION_BUFFER", t0, t1, NULL);
        cring__engine_span(e, batch[b]->name, phase, t1, t2, args);
        cring__engine_span(e, batch[b]->name, "MEMCPY_OUT_FUSION_BUFFER", t2, t3, NULL);
    }
}

/* Order for fusion: same key next to each other, otherwise as negotiated. */
static int fusion_key_cmp(const req_t *a, const req_t *b) {
    if (a->coll != b->coll) return (int)a->coll - (int)b->coll;
    if (a->device.type != b->device.type) return (int)a->device.type - (int)b->device.type;
    if (a->device.id != b->device.id) return a->device.id - b->device.id;
    if (a->device.type != CRING_DEVICE_CPU) { /* the CPU backend scales per request */
        if (a->prescale != b->prescale) return a->prescale < b->prescale ? -1 : 1;
        if (a->postscale != b->postscale) return a->postscale < b->postscale ? -1 : 1;
    }
    if (a->coll == CRING_COLL_ALLREDUCE) {
        if (a->t[0].dtype != b->t[0].dtype) return (int)a->t[0].dtype - (int)b->t[0].dtype;
        if (a->op != b->op) return (int)a->op - (int)b->op;
        if (a->compression != b->compression) return (int)a->compression - (int)b->compression;
    }
    if (a->coll == CRING_COLL_BROADCAST && a->root != b->root) return a->root - b->root;
    return 0;
}

static int fusible(const req_t *r) {
    if (r->coll == CRING_COLL_ALLREDUCE) {
        for (int i = 1; i < r->ntensors; i++)
            if (r->t[i].dtype != r->t[0].dtype) return 0;
        return 1;
    }
    /* CUDA alltoalls share one NCCL group of sends and receives */
    return r->coll == CRING_COLL_BROADCAST ||
           (r->coll == CRING_COLL_ALLTOALL && r->device.type == CRING_DEVICE_CUDA);
}

static size_t req_wire_bytes(const req_t *r) {
    size_t n = 0;
    for (int i = 0; i < r->ntensors; i++)
        n += r->compression != CRING_DTYPE_COUNT ? r->t[i].count * 2 : r->t[i].bytes;
    return n;
}

/* On the CPU a single tensor this large runs on its own, in place: copying
 * it into and out of the fusion buffer costs more than the collective it
 * would share. Not on CUDA, where the trade-off reverses: two device copies
 * of a few MB cost far less than an NCCL launch, so a gradient bucket
 * (bucket.c) of large and small tensors is one call (exec_cuda.c still runs
 * a batch of one tensor in place). Decided from what every rank agreed on
 * (shape, dtype, compression, device type), so every rank forms the same
 * batches. */
#define UNFUSED_MIN_BYTES (1u << 20)
static int runs_alone(const req_t *r) {
    return r->device.type == CRING_DEVICE_CPU && r->ntensors == 1 &&
           req_wire_bytes(r) >= UNFUSED_MIN_BYTES;
}

/* Hand one batch to its device's backend (a barrier is the engine's own). */
static cring_status_t run_batch(cring_engine_t *e, const response_t *r0, req_t **batch, int nb) {
    req_t *r = r0->req;
    const cring__backend_t *be = e->backends[r->device.type];
    switch (r->coll) {
    case CRING_COLL_ALLREDUCE: return be->allreduce(e, batch, nb);
    case CRING_COLL_BROADCAST: return be->broadcast(e, batch, nb);
    case CRING_COLL_ALLGATHER: return be->allgather(e, r, r0->first_dims);
    case CRING_COLL_REDUCESCATTER: return be->reducescatter(e, r);
    case CRING_COLL_ALLTOALL: return be->alltoall(e, batch, nb);
    default: {
        double t0 = cring__engine_tl_now(e);
        cring_status_t st = cring__comm_barrier(e->comm);
        cring__engine_span(e, r->name, "BARRIER", t0, cring__engine_tl_now(e), NULL);
        cring__engine_stats_add(&e->stats.collectives, 1);
        return st;
    }
    }
}

/* Room for n requests in e->exec.batch, kept between rounds (a round
 * allocates nothing once it has grown). 0, or -1 when out of memory. */
static int batch_room(cring_engine_t *e, int n) {
    if (n <= e->exec.batch_cap) return 0;
#ifdef CRING_TEST_HOOKS
    if (atomic_load(&cring__test_fail_batch_room) > 0) {
        atomic_fetch_sub(&cring__test_fail_batch_room, 1);
        return -1;
    }
#endif
    int cap = e->exec.batch_cap ? e->exec.batch_cap : 64;
    while (cap < n) cap *= 2;
    req_t **grown = realloc(e->exec.batch, sizeof *grown * (size_t)cap);
    if (!grown) return -1;
    e->exec.batch = grown;
    e->exec.batch_cap = cap;
    return 0;
}

/* The round cannot run here: every response completes with an error naming
 * its tensor (nothing here may be recycled while its handle still waits),
 * and the engine stops taking part (the caller's transport failure, which
 * aborts the communicator so the peers stop waiting for this rank too). */
static cring_status_t cannot_run(cring_engine_t *e, response_t *resp, int n) {
    snprintf(e->exec.error, sizeof e->exec.error,
             "rank %d ran out of memory before running its collectives", e->rank);
    for (int i = 0; i < n; i++) {
        char msg[CRING__ERRMSG_BYTES + CRING__MAX_NAME_BYTES + 32];
        snprintf(msg, sizeof msg, "'%s': %s", resp[i].req->name, e->exec.error);
        cring__engine_complete(e, resp[i].req, CRING_ERR_NO_MEMORY, msg);
    }
    return CRING_ERR_NO_MEMORY;
}

/* Run every successful response in order, batching what can be fused, then
 * complete each request: each one completes here, whatever happens. Returns
 * a transport failure, if any (out of memory counts as one: this rank can no
 * longer run the collectives its peers run). */
cring_status_t cring__execute(cring_engine_t *e, response_t *resp, int n) {
    if (e->tune.on) cring__autotune_count(e, resp, n);
    /* Stable insertion sort by fusion key keeps the negotiated order within a key. */
    for (int i = 1; i < n; i++) {
        response_t cur = resp[i];
        int j = i - 1;
        while (j >= 0 && fusion_key_cmp(resp[j].req, cur.req) > 0) {
            resp[j + 1] = resp[j];
            j--;
        }
        resp[j + 1] = cur;
    }
    if (batch_room(e, n) != 0) return cannot_run(e, resp, n);
    req_t **batch = e->exec.batch;
    cring_status_t fatal = CRING_OK;
    int i = 0;
    while (i < n) {
        response_t *r0 = &resp[i];
        if (r0->status != CRING_OK || r0->executed) {
            cring__engine_complete(e, r0->req, r0->status, r0->error);
            i++;
            continue;
        }
        int nb = 1;
        batch[0] = r0->req;
        if (fusible(r0->req) && !runs_alone(r0->req)) {
            /* Consecutive responses of the same key that can share the buffer
             * join. On CUDA, so do later ones, moved up to resp[i + nb]: one
             * that does not fit stays behind for a later batch instead of
             * ending this one, for each batch is an NCCL launch (a round
             * releasing several gradient buckets makes one call of them while
             * they fit the threshold). Not on CPU, where batches stay as they were: a
             * float's sum there can change in the last bits with the batch
             * that carries it (at 3 ranks the ZeRO tests, which hold the
             * sharded and unsharded paths to the same bits, saw 1.4e-6 when
             * CPU batches changed), and a CPU batch is no launch. What every
             * rank agreed on decides it, so every rank forms the same
             * batches. */
            const int skip = r0->req->device.type == CRING_DEVICE_CUDA;
            size_t bytes = req_wire_bytes(r0->req);
            for (int j = i + 1; j < n && fusion_key_cmp(resp[j].req, r0->req) == 0; j++) {
                const req_t *q = resp[j].req;
                if (resp[j].status != CRING_OK || resp[j].executed || !fusible(q) ||
                    runs_alone(q) || bytes + req_wire_bytes(q) > e->exec.threshold) {
                    if (!skip) break;
                    continue;
                }
                bytes += req_wire_bytes(q);
                response_t cur = resp[j];
                memmove(&resp[i + nb + 1], &resp[i + nb], sizeof *resp * (size_t)(j - i - nb));
                resp[i + nb] = cur;
                batch[nb++] = cur.req;
            }
        }
        e->exec.error[0] = 0;
        cring_status_t st = run_batch(e, r0, batch, nb);
        for (int b = 0; b < nb; b++) {
            req_t *r = batch[b];
            if (st != CRING_OK) {
                char msg[CRING__ERRMSG_BYTES + CRING__MAX_NAME_BYTES + 8];
                const char *why = e->exec.error[0]            ? e->exec.error
                                  : st == CRING_ERR_NO_MEMORY ? "out of memory"
                                                              : cring__comm_error(e->comm);
                if (strstr(why, r->name)) snprintf(msg, sizeof msg, "%s", why);
                else snprintf(msg, sizeof msg, "'%s': %s", r->name, why); /* name the tensor */
                cring__engine_complete(e, r, st, msg);
            } else {
                cring__engine_complete(e, r, CRING_OK, NULL);
            }
        }
        if (st != CRING_OK && cring__comm_broken(e->comm) != CRING_OK) fatal = st;
        i += nb;
        if (fatal != CRING_OK) break;
    }
    /* after a fatal failure, the rest never ran: fail them too */
    for (; i < n; i++) cring__engine_complete(e, resp[i].req, fatal, cring__comm_error(e->comm));
    return fatal;
}

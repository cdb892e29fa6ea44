/* exec_cuda.c: the CUDA execution backend. A negotiated batch of CUDA requests
 * becomes one grouped NCCL call (csrc/gpu) enqueued on the requests' own
 * streams; each device's NCCL communicator is made at the first batch that
 * needs it. Returns once the work is enqueued: it never waits for the device,
 * never stages through host memory, and knows nothing of Python.
 *
 * Why lazy creation is collective-safe: every rank executes the same responses
 * in the same order, so every rank reaches a device's first batch together.
 * There, one allgather over the engine's communicator carries each rank's
 * readiness (NCCL loaded, device usable) and rank 0's NCCL unique id; every
 * rank takes part even when it is not ready, so the CPU communicator never
 * goes out of step, and a rank without NCCL fails the batch on every rank.
 *
 * The GPU context is the process's (cring__gpu_global): one engine per process
 * runs CUDA work at a time, and its stop destroys the communicators. */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../gpu/gpu.h"
#include "engine_internal.h"

static cring_status_t fail(cring_engine_t *e, cring_status_t st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static cring_status_t fail(cring_engine_t *e, cring_status_t st, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(e->exec.error, sizeof e->exec.error, fmt, ap);
    va_end(ap);
    return st;
}

/* The context with both libraries loaded (a binding that loaded them from
 * pip wheels did so first; otherwise the usual search runs here). */
static cring_status_t context(cring__gpu_t **out, cring__errmsg_t *err) {
    cring__gpu_t *g = cring__gpu_global();
    *out = g;
    if (!g) return cring__fail(err, CRING_ERR_NO_MEMORY, "out of memory");
    CRING_CHECK(cring__gpu_load_cudart(g, NULL, 0, err));
    return cring__gpu_load_nccl(g, NULL, 0, err);
}

/* One rank's part of the communicator set-up exchange. */
typedef struct {
    uint8_t ready; /* 1: this rank can create the communicator */
    uint8_t pad[7];
    char id[CRING__GPU_UNIQUE_ID_BYTES]; /* rank 0's matters */
} setup_t;

/* The slot of device's communicator, creating it (every rank at once; see the
 * top of the file). */
static cring_status_t comm_for(cring_engine_t *e, int device, cring__gpu_t **g_out, int *slot) {
    cring__errmsg_t err = {{0}};
    cring__gpu_t *g = NULL;
    cring_status_t mine = context(&g, &err);
    *g_out = g;
    if (mine == CRING_OK && (*slot = cring__gpu_comm_slot(g, device)) >= 0) return CRING_OK;
    /* Not there yet: check what can fail on one rank alone before the exchange. */
    if (mine == CRING_OK) {
        int count = cring__gpu_device_count(g, &err);
        if (count > 0 && device >= count)
            mine = cring__fail(&err, CRING_ERR_INVALID_ARGUMENT,
                               "this process sees %d CUDA device(s)", count);
        else if (count == 0) mine = CRING_ERR_NOT_SUPPORTED; /* err says why */
    }
    setup_t *all = calloc((size_t)e->size, sizeof *all);
    size_t *sizes = malloc(sizeof *sizes * (size_t)e->size);
    if (!all || !sizes) {
        free(all);
        free(sizes);
        return fail(e, CRING_ERR_NO_MEMORY, "out of memory");
    }
    setup_t me;
    memset(&me, 0, sizeof me);
    if (mine == CRING_OK && e->rank == 0) mine = cring__gpu_unique_id(g, me.id, &err);
    me.ready = mine == CRING_OK;
    for (int q = 0; q < e->size; q++) sizes[q] = sizeof me;
    cring_status_t st = cring__comm_allgatherv(e->comm, &me, sizeof me, all, sizes);
    if (st != CRING_OK) {
        fail(e, st, "while setting up NCCL for cuda:%d: %s", device, cring__comm_error(e->comm));
        goto done;
    }
    if (mine != CRING_OK) {
        st = fail(e, mine, "cannot use NCCL on cuda:%d: %s", device, err.text);
        goto done;
    }
    char unready[256] = "";
    size_t used = 0;
    for (int q = 0; q < e->size; q++)
        if (!all[q].ready && used < sizeof unready - 16)
            used += (size_t)snprintf(unready + used, sizeof unready - used, "%s%d",
                                     used ? ", " : "", q);
    if (used) {
        st = fail(e, CRING_ERR_NOT_SUPPORTED,
                  "NCCL cannot run on rank(s) %s (see their error): every rank needs NCCL and a "
                  "usable CUDA device, or set CRING_GPU_OPERATIONS=host on every rank",
                  unready);
        goto done;
    }
    st = cring__gpu_comm_init(g, device, e->rank, e->size, all[0].id, slot, &err);
    if (st != CRING_OK)
        fail(e, st, "cannot create the NCCL communicator for cuda:%d: %s", device, err.text);
done:
    free(all);
    free(sizes);
    return st;
}

/* A joined rank's stand-in has host zeros as data: NCCL needs device memory.
 * Allocate zeroed device buffers for its tensors (freed by ghost_free, whose
 * cudaFree waits for the collective). */
static cring_status_t ghost_buffers(cring_engine_t *e, cring__gpu_t *g, int device, req_t *r,
                                    void **buf) {
    size_t bytes = 0;
    for (int i = 0; i < r->ntensors; i++) bytes += (r->t[i].bytes + 255) & ~(size_t)255;
    cring__errmsg_t err = {{0}};
    cring_status_t st = cring__gpu_device_alloc(g, device, bytes, buf, &err);
    if (st == CRING_OK) st = cring__gpu_zero_async(g, *buf, bytes, r->device.stream, &err);
    if (st != CRING_OK)
        return fail(e, st, "a joined rank's zeros on cuda:%d: %s", device, err.text);
    size_t at = 0;
    for (int i = 0; i < r->ntensors; i++) {
        r->t[i].send = r->t[i].recv = (char *)*buf + at;
        at += (r->t[i].bytes + 255) & ~(size_t)255;
    }
    return CRING_OK;
}

/* The device a batch runs on. A joined rank's stand-in carries no device of
 * this rank: it uses the one this rank's NCCL work is on already. */
static int batch_device(cring__gpu_t *g, req_t *r) {
    int device = r->handle || !g ? -1 : cring__gpu_comm_device(g, 0);
    return device >= 0 ? device : r->device.id;
}

static const char *phase_name(cring_collective_t c) {
    switch (c) {
    case CRING_COLL_ALLREDUCE: return "NCCL_ALLREDUCE";
    case CRING_COLL_BROADCAST: return "NCCL_BROADCAST";
    case CRING_COLL_ALLGATHER: return "NCCL_ALLGATHER";
    default: return "NCCL_REDUCESCATTER";
    }
}

/* Enqueue c for the batch on its device's communicator, then surface an
 * asynchronous error NCCL already reports (a peer that died mid-call). */
static cring_status_t run(cring_engine_t *e, req_t **batch, int n, int device, cring__gpu_t *g,
                          int slot, const cring__gpu_coll_t *c) {
    double t0 = cring__engine_tl_now(e);
    for (int b = 0; b < n; b++)
        cring__engine_span(e, batch[b]->name, "QUEUE", batch[b]->ready_s, t0, NULL);
    cring__errmsg_t err = {{0}};
    cring_status_t st = cring__gpu_collective(g, slot, c, &err);
    if (st == CRING_OK) st = cring__gpu_comm_check(g, slot, &err);
    double t1 = cring__engine_tl_now(e);
    if (e->timeline) {
        char args[96];
        snprintf(args, sizeof args, "\"device\": \"cuda:%d\", \"grouped_tensors\": %d", device,
                 c->ntensors);
        for (int b = 0; b < n; b++)
            cring__engine_span(e, batch[b]->name, phase_name(c->collective), t0, t1, args);
    }
    cring__engine_stats_add(&e->stats.collectives, 1);
    if (c->ntensors > 1) cring__engine_stats_add(&e->stats.fused_tensors, (uint64_t)c->ntensors);
    if (st != CRING_OK) return fail(e, st, "NCCL on cuda:%d: %s", device, err.text);
    return CRING_OK;
}

/* Allreduce or broadcast: every tensor of every request, one group. */
static cring_status_t run_batch(cring_engine_t *e, req_t **batch, int n) {
    req_t *first = batch[0];
    if (first->compression != CRING_DTYPE_COUNT)
        return fail(e, CRING_ERR_NOT_SUPPORTED,
                    "'%s': compression of CUDA tensors is done by the binding, not by NCCL",
                    first->name);
    cring__gpu_t *g = cring__gpu_global();
    int device = batch_device(g, first), slot = -1;
    CRING_CHECK(comm_for(e, device, &g, &slot));
    int total = 0;
    for (int b = 0; b < n; b++) total += batch[b]->ntensors;
    cring__gpu_tensor_t *ts = calloc((size_t)total, sizeof *ts);
    void **ghosts = calloc((size_t)n, sizeof *ghosts);
    cring_status_t st = CRING_OK;
    if (!ts || !ghosts) {
        st = fail(e, CRING_ERR_NO_MEMORY, "out of memory");
        goto done;
    }
    int k = 0;
    for (int b = 0; b < n && st == CRING_OK; b++) {
        req_t *r = batch[b];
        if (!r->handle && r->ghost) st = ghost_buffers(e, g, device, r, &ghosts[b]);
        for (int i = 0; i < r->ntensors; i++)
            ts[k++] = (cring__gpu_tensor_t){.send = r->t[i].send,
                                            .recv = r->t[i].recv,
                                            .dtype = r->t[i].dtype,
                                            .count = r->t[i].count,
                                            .stream = r->device.stream};
    }
    if (st != CRING_OK) goto done;
    cring__gpu_coll_t c = {.collective = first->coll,
                           .op = first->op,
                           .root = first->root,
                           .scale = first->prescale * first->postscale,
                           .ntensors = total,
                           .tensors = ts};
    st = run(e, batch, n, device, g, slot, &c);
done:
    for (int b = 0; ghosts && b < n; b++) cring__gpu_device_free(g, ghosts[b]);
    free(ghosts);
    free(ts);
    return st;
}

static void free_device_output(void *ctx, void *ptr, size_t bytes) {
    (void)bytes;
    cring__gpu_device_free(ctx, ptr);
}

/* Allgather: results in device memory the handle owns (freed through
 * free_output); each rank's part as negotiated (first_dims). */
static cring_status_t run_allgather(cring_engine_t *e, req_t *r, const int64_t *first_dims) {
    cring_handle_t *h = r->handle;
    cring__gpu_t *g = cring__gpu_global();
    int device = r->device.id, slot = -1;
    CRING_CHECK(comm_for(e, device, &g, &slot));
    const size_t P = (size_t)e->size, nt = (size_t)r->ntensors;
    h->free_output = free_device_output;
    h->free_ctx = g;
    h->output_device = r->device;
    h->outputs = calloc(nt, sizeof *h->outputs);
    h->output_bytes = calloc(nt, sizeof *h->output_bytes);
    h->first_dims = malloc(sizeof(int64_t) * nt * P);
    size_t *counts = malloc(sizeof *counts * nt * P);
    cring__gpu_tensor_t *ts = calloc(nt, sizeof *ts);
    cring_status_t st = CRING_OK;
    if (!h->outputs || !h->output_bytes || !h->first_dims || !counts || !ts) {
        st = fail(e, CRING_ERR_NO_MEMORY, "out of memory");
        goto done;
    }
    memcpy(h->first_dims, first_dims, sizeof(int64_t) * nt * P);
    for (size_t i = 0; i < nt && st == CRING_OK; i++) {
        tensor_spec_t *t = &r->t[i];
        size_t *rc = counts + i * P, total = 0;
        for (size_t q = 0; q < P; q++) {
            rc[q] = (size_t)first_dims[i * P + q] * t->row_elems;
            total += rc[q];
        }
        rc[e->rank] = t->count; /* a 0-d tensor gathers as one row */
        cring__errmsg_t err = {{0}};
        size_t bytes = total * cring_dtype_size(t->dtype);
        st = cring__gpu_device_alloc(g, device, bytes, &h->outputs[i], &err);
        if (st != CRING_OK) {
            fail(e, st, "'%s': the allgather result: %s", r->name, err.text);
            break;
        }
        h->output_bytes[i] = bytes;
        ts[i] = (cring__gpu_tensor_t){.send = t->send,
                                      .recv = h->outputs[i],
                                      .dtype = t->dtype,
                                      .count = t->count,
                                      .rank_counts = rc,
                                      .stream = r->device.stream};
    }
    if (st == CRING_OK) {
        cring__gpu_coll_t c = {
            .collective = CRING_COLL_ALLGATHER, .scale = 1.0, .ntensors = (int)nt, .tensors = ts};
        st = run(e, &r, 1, device, g, slot, &c);
    }
done:
    free(counts);
    free(ts);
    return st;
}

/* Reducescatter: n rows split as n/P, one more for ranks below n%P. */
static cring_status_t run_reducescatter(cring_engine_t *e, req_t *r) {
    cring__gpu_t *g = cring__gpu_global();
    int device = r->device.id, slot = -1;
    CRING_CHECK(comm_for(e, device, &g, &slot));
    const size_t P = (size_t)e->size, nt = (size_t)r->ntensors;
    size_t *counts = malloc(sizeof *counts * nt * P);
    cring__gpu_tensor_t *ts = calloc(nt, sizeof *ts);
    cring_status_t st = CRING_OK;
    if (!counts || !ts) {
        st = fail(e, CRING_ERR_NO_MEMORY, "out of memory");
        goto done;
    }
    for (size_t i = 0; i < nt; i++) {
        tensor_spec_t *t = &r->t[i];
        size_t rows = (size_t)t->shape[0], *rc = counts + i * P;
        for (size_t q = 0; q < P; q++) rc[q] = (rows / P + (q < rows % P)) * t->row_elems;
        ts[i] = (cring__gpu_tensor_t){.send = t->send,
                                      .recv = t->recv,
                                      .dtype = t->dtype,
                                      .count = t->count,
                                      .rank_counts = rc,
                                      .stream = r->device.stream};
    }
    cring__gpu_coll_t c = {.collective = CRING_COLL_REDUCESCATTER,
                           .op = r->op,
                           .scale = r->prescale * r->postscale,
                           .ntensors = (int)nt,
                           .tensors = ts};
    st = run(e, &r, 1, device, g, slot, &c);
done:
    free(counts);
    free(ts);
    return st;
}

static cring_status_t run_alltoall(cring_engine_t *e, req_t *r) {
    return fail(e, CRING_ERR_NOT_SUPPORTED,
                "'%s': alltoall of CUDA tensors does not go through NCCL yet; set "
                "CRING_GPU_OPERATIONS=host to stage it through host memory",
                r->name);
}

static void shutdown_cuda(cring_engine_t *e) {
    (void)e;
    cring__gpu_t *g = cring__gpu_global();
    if (g && cring__gpu_comm_count(g) > 0) cring__gpu_comms_destroy(g);
}

const cring__backend_t cring__backend_cuda = {
    .name = "cuda",
    .allreduce = run_batch,
    .broadcast = run_batch,
    .allgather = run_allgather,
    .reducescatter = run_reducescatter,
    .alltoall = run_alltoall,
    .shutdown = shutdown_cuda,
};

/* exec_cuda.c: the CUDA execution backend. At submission (prepare, on the
 * submitting thread) it records an event on the producer's stream. A
 * negotiated batch runs on the engine's own cring stream of its device:
 * that stream first waits on the batch's producer events, then the batch's
 * allreduces (and broadcasts), large ones included (bucket.c makes a
 * training step's gradients a few such batches), are packed into the device
 * fusion buffer up to CRING_FUSION_THRESHOLD with device-to-device copies,
 * reduced by one NCCL call and unpacked; a batch of one tensor, or a tensor
 * too large to share a buffer, runs in place. A
 * completion event recorded after the batch goes to every handle of it, for
 * consumers' streams to wait on; a batch that fails after queueing work gets
 * one too (fail_after_queueing). Returns once the work is enqueued: it never
 * waits for the device (its device memory is stream-ordered: csrc/gpu/gpu.h),
 * and knows nothing of Python. A reduction NCCL cannot do as the CPU path does (a
 * dtype or op NCCL lacks, scaled integers, a scaled reduction at one rank on
 * an NCCL with the one-rank defect) is the exception: it is staged through
 * host memory and reduced by the CPU backend (exec_cuda_host.c), which waits
 * for cring's stream. Alltoall is one NCCL group of sends and receives.
 *
 * Why a fusion buffer rather than one NCCL group of many calls: a group still
 * launches NCCL's work per collective (and its per-call set-up on the host),
 * while the buffer costs two cheap copies per tensor and makes a batch of
 * many small gradients one NCCL collective, as Horovod does; the device
 * memory it needs is bounded by the threshold.
 *
 * Why lazy creation is collective-safe: every rank executes the same responses
 * in the same order, so every rank reaches a device's first batch together.
 * There, one allgather over the engine's communicator carries each rank's
 * readiness (NCCL loaded, device usable) and rank 0's NCCL unique id; every
 * rank takes part even when it is not ready, so the CPU communicator never
 * goes out of step, and a rank without NCCL fails the batch on every rank.
 *
 * What this backend keeps is the engine's own (e->exec.cuda): per CUDA device,
 * the NCCL communicator it made, the cring stream lent to it, and its fusion
 * and zero buffers. The engines of a process (the global set's and each
 * process set's) run side by side on their own streams and communicators,
 * and an engine's stop destroys only its own; the GPU context (libraries,
 * event pools, the stream pool) is the process's (cring__gpu_global). */
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../gpu/gpu.h"
#include "engine_internal.h"
#include "exec_cuda_host.h"

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

#define MAX_DEVICES 16 /* CUDA devices one engine runs work on */

/* One CUDA device of this engine: its communicator, the cring stream lent to
 * it, and the buffers used only on that stream (their reuse is ordered by
 * it; they grow by a stream-ordered free and allocation). */
typedef struct {
    int device;
    cring__gpu_comm_t *comm;
    cring__gpu_stream_t *stream;
    void *fusion; /* packed batches */
    size_t fusion_cap;
    void *zeros; /* a joined rank's part */
    size_t zeros_cap;
} cuda_device_t;

struct cring__cuda_state {
    int n;
    cuda_device_t devices[MAX_DEVICES];
};

static cuda_device_t *find_device(cring_engine_t *e, int device) {
    struct cring__cuda_state *cs = e->exec.cuda;
    for (int i = 0; cs && i < cs->n; i++)
        if (cs->devices[i].device == device) return &cs->devices[i];
    return NULL;
}

/* This engine's state of device, creating it (every rank at once; see the top
 * of the file): the stream is taken and the state made room for before the
 * exchange, so what fails on one rank alone fails every rank's batch. */
static cring_status_t device_for(cring_engine_t *e, int device, cring__gpu_t **g_out,
                                 cuda_device_t **out) {
    cring__errmsg_t err = {{0}};
    cring__gpu_t *g = NULL;
    cring_status_t mine = context(&g, &err);
    *g_out = g;
    *out = NULL;
    if (mine == CRING_OK && (*out = find_device(e, device))) return CRING_OK;
    /* Not there yet: check what can fail on one rank alone before the exchange. */
    if (mine == CRING_OK) {
        int count = cring__gpu_device_count(g, &err);
        if (count > 0 && device >= count)
            mine = cring__fail(&err, CRING_ERR_INVALID_ARGUMENT,
                               "this process sees %d CUDA device(s)", count);
        else if (count == 0) mine = CRING_ERR_NOT_SUPPORTED; /* err says why */
    }
    if (mine == CRING_OK && !e->exec.cuda && !(e->exec.cuda = calloc(1, sizeof *e->exec.cuda)))
        mine = cring__fail(&err, CRING_ERR_NO_MEMORY, "out of memory");
    if (mine == CRING_OK && e->exec.cuda->n == MAX_DEVICES)
        mine = cring__fail(&err, CRING_ERR_NOT_SUPPORTED, "at most %d CUDA devices per process set",
                           MAX_DEVICES);
    cring__gpu_stream_t *stream = NULL;
    if (mine == CRING_OK) mine = cring__gpu_stream_acquire(g, device, &stream, &err);
    setup_t *all = calloc((size_t)e->size, sizeof *all);
    size_t *sizes = malloc(sizeof *sizes * (size_t)e->size);
    cring_status_t st = CRING_OK;
    if (!all || !sizes) { /* the exchange cannot run: this rank's peers time out */
        st = fail(e, CRING_ERR_NO_MEMORY, "out of memory");
        goto done;
    }
    setup_t me;
    memset(&me, 0, sizeof me);
    if (mine == CRING_OK && e->rank == 0) mine = cring__gpu_unique_id(g, me.id, &err);
    me.ready = mine == CRING_OK;
    for (int q = 0; q < e->size; q++) sizes[q] = sizeof me;
    st = cring__comm_allgatherv(e->comm, &me, sizeof me, all, sizes);
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
    cring__gpu_comm_t *comm = NULL;
    st = cring__gpu_comm_create(g, device, e->rank, e->size, all[0].id, &comm, &err);
    if (st != CRING_OK) {
        fail(e, st, "cannot create the NCCL communicator for cuda:%d: %s", device, err.text);
        goto done;
    }
    cuda_device_t *d = &e->exec.cuda->devices[e->exec.cuda->n++];
    memset(d, 0, sizeof *d);
    d->device = device;
    d->comm = comm;
    d->stream = stream;
    stream = NULL;
    *out = d;
done:
    cring__gpu_stream_release(g, stream);
    free(all);
    free(sizes);
    return st;
}

/* ---- submission: the producer's event ------------------------------------------------ */
static cring_status_t prepare_cuda(cring_engine_t *e, req_t *r) {
    (void)e;
    cring__gpu_t *g = cring__gpu_global();
    if (!g) return cring__engine_submit_fail(CRING_ERR_NO_MEMORY, "out of memory");
    cring__errmsg_t err = {{0}};
    cring__gpu_event_t *ev = NULL;
    cring_status_t st = cring__gpu_load_cudart(g, NULL, 0, &err);
    if (st == CRING_OK) st = cring__gpu_event_record(g, r->device.id, r->device.stream, &ev, &err);
    if (st != CRING_OK)
        return cring__engine_submit_fail(st, "'%s' on cuda:%d: %s", r->name, r->device.id,
                                         err.text);
    r->ready_event = ev;
    return CRING_OK;
}

static void discard_cuda(req_t *r) {
    cring__gpu_event_put(cring__gpu_global(), r->ready_event);
    r->ready_event = NULL;
}

static void put_event(void *ev) { cring__gpu_event_put(cring__gpu_global(), ev); }

/* ---- execution ---------------------------------------------------------------------------- */
/* Where a batch runs: this engine's state of its device, and cring's stream there. */
typedef struct {
    cring__gpu_t *g;
    cuda_device_t *d;
    int device;
    void *stream;
} lane_t;

/* The device a batch runs on. A joined rank's stand-in carries no device of
 * this rank: it uses the one this engine's NCCL work is on already. */
static int batch_device(cring_engine_t *e, req_t *r) {
    const struct cring__cuda_state *cs = e->exec.cuda;
    return !r->handle && cs && cs->n > 0 ? cs->devices[0].device : r->device.id;
}

static cring_status_t open_lane(cring_engine_t *e, req_t *first, lane_t *L) {
    L->device = batch_device(e, first);
    CRING_CHECK(device_for(e, L->device, &L->g, &L->d));
    L->stream = cring__gpu_stream_handle(L->d->stream);
    return CRING_OK;
}

/* cring's stream waits for every producer of the batch; their events go back. */
static cring_status_t wait_producers(cring_engine_t *e, const lane_t *L, req_t **batch, int n) {
    cring_status_t st = CRING_OK;
    for (int b = 0; b < n; b++) {
        req_t *r = batch[b];
        if (!r->ready_event) continue;
        cring__errmsg_t err = {{0}};
        if (st == CRING_OK) {
            st = cring__gpu_stream_wait(L->g, L->device, L->stream, r->ready_event, &err);
            if (st != CRING_OK) fail(e, st, "'%s': %s", r->name, err.text);
        }
        discard_cuda(r);
    }
    return st;
}

/* The batch's completion: one event on cring's stream, a reference per
 * handle; it watches the communicator, so a consumer's synchronize learns of
 * an error that keeps the work from completing. */
static cring_status_t record_done(cring_engine_t *e, const lane_t *L, req_t **batch, int n) {
    cring__errmsg_t err = {{0}};
    cring__gpu_event_t *ev = NULL;
    cring_status_t st = cring__gpu_event_record(L->g, L->device, L->stream, &ev, &err);
    if (st != CRING_OK)
        return fail(e, st, "the completion event on cuda:%d: %s", L->device, err.text);
    cring__gpu_event_watch(ev, L->d->comm);
    for (int b = 0; b < n; b++) {
        cring_handle_t *h = batch[b]->handle;
        if (!h) continue;
        cring__gpu_event_ref(ev);
        h->device_event = ev;
        h->device_event_put = put_event;
    }
    cring__gpu_event_put(L->g, ev);
    return CRING_OK;
}

/* A batch that fails once its lane is open may have queued work on cring's
 * stream (waits, copies into and out of the fusion buffer, collectives of
 * its first tensors): its handles still get a completion event after that
 * work, so consumers' streams resume, and the binding lets the tensors go,
 * only once it has run (docs/gpu.md, "Ordering and lifetime"). Should even
 * that event fail, the engine thread waits for cring's stream here (an error
 * path only). Returns st; e->exec.error keeps the batch's own error. */
static cring_status_t fail_after_queueing(cring_engine_t *e, const lane_t *L, req_t **batch, int n,
                                          cring_status_t st) {
    if (st == CRING_OK) return st;
    char error[sizeof e->exec.error];
    memcpy(error, e->exec.error, sizeof error);
    if (record_done(e, L, batch, n) != CRING_OK) {
        cring__errmsg_t err = {{0}};
        (void)cring__gpu_stream_sync(L->g, L->stream, &err);
    }
    memcpy(e->exec.error, error, sizeof error);
    return st;
}

/* *buf (of *cap bytes, used only on the lane's stream) with room for bytes:
 * grown to the next power of two from 1 MiB by a free and an allocation both
 * ordered on that stream, so no host waits and no work still using the old
 * one sees it go. */
static cring_status_t lane_buffer(cring_engine_t *e, const lane_t *L, void **buf, size_t *cap,
                                  size_t bytes, const char *what) {
    if (bytes <= *cap) return CRING_OK;
    size_t want = *cap ? *cap : (size_t)1 << 20;
    while (want < bytes) want *= 2;
    cring__gpu_mem_free(L->g, L->device, *buf, *cap, L->stream);
    *buf = NULL;
    *cap = 0;
    cring__errmsg_t err = {{0}};
    cring_status_t st = cring__gpu_mem_alloc(L->g, L->device, want, L->stream, buf, &err);
    if (st != CRING_OK)
        return fail(e, st, "the %s buffer (%zu bytes) on cuda:%d: %s", what, want, L->device,
                    err.text);
    *cap = want;
    return CRING_OK;
}

/* A joined rank's stand-in has host zeros as data: NCCL needs device memory.
 * Its tensors get slices of the lane's zero buffer, cleared on the stream for
 * this batch (a collective writes its result there). */
static cring_status_t ghost_buffers(cring_engine_t *e, const lane_t *L, req_t **batch, int n) {
    size_t bytes = 0;
    for (int b = 0; b < n; b++)
        for (int i = 0; !batch[b]->handle && batch[b]->ghost && i < batch[b]->ntensors; i++)
            bytes += (batch[b]->t[i].bytes + 255) & ~(size_t)255;
    if (!bytes) return CRING_OK;
    CRING_CHECK(lane_buffer(e, L, &L->d->zeros, &L->d->zeros_cap, bytes, "joined rank's zero"));
    cring__errmsg_t err = {{0}};
    cring_status_t st = cring__gpu_zero_async(L->g, L->d->zeros, bytes, L->stream, &err);
    if (st != CRING_OK)
        return fail(e, st, "a joined rank's zeros on cuda:%d: %s", L->device, err.text);
    size_t at = 0;
    for (int b = 0; b < n; b++) {
        req_t *r = batch[b];
        for (int i = 0; !r->handle && r->ghost && i < r->ntensors; i++) {
            r->t[i].send = r->t[i].recv = (char *)L->d->zeros + at;
            at += (r->t[i].bytes + 255) & ~(size_t)255;
        }
    }
    return CRING_OK;
}

static const char *phase_name(cring_collective_t c) {
    switch (c) {
    case CRING_COLL_ALLREDUCE: return "NCCL_ALLREDUCE";
    case CRING_COLL_BROADCAST: return "NCCL_BCAST";
    case CRING_COLL_ALLGATHER: return "NCCL_ALLGATHER";
    case CRING_COLL_ALLTOALL: return "NCCL_ALLTOALL";
    default: return "NCCL_REDUCESCATTER";
    }
}

/* Enqueue one NCCL call on the lane, then surface an asynchronous error NCCL
 * already reports (a peer that died mid-call). */
static cring_status_t call(cring_engine_t *e, const lane_t *L, const cring__gpu_coll_t *c) {
    cring__errmsg_t err = {{0}};
    cring_status_t st = cring__gpu_collective(L->g, L->d->comm, c, &err);
    if (st == CRING_OK) st = cring__gpu_comm_check(L->g, L->d->comm, &err);
    cring__engine_stats_add(&e->stats.collectives, 1);
    if (st != CRING_OK) return fail(e, st, "NCCL on cuda:%d: %s", L->device, err.text);
    return CRING_OK;
}

static void spans(cring_engine_t *e, req_t **batch, int n, const char *phase, double t0, double t1,
                  const lane_t *L, int fused) {
    if (!e->timeline) return;
    char args[96];
    snprintf(args, sizeof args, "\"device\": \"cuda:%d\", \"fused_tensors\": %d", L->device, fused);
    for (int b = 0; b < n; b++) {
        cring__engine_span(e, batch[b]->name, "QUEUE", batch[b]->ready_s, t0, NULL);
        cring__engine_span(e, batch[b]->name, phase, t0, t1, args);
    }
}

/* One tensor of a batch: bytes and elements as the collective moves them
 * (a broadcast moves bytes, so tensors of any dtype share a buffer). */
typedef struct {
    const void *send;
    void *recv;
    size_t bytes, count;
    cring_dtype_t dtype;
} item_t;

/* items[0..m) through the fusion buffer as one NCCL call: pack (the root
 * only, for a broadcast), the collective in place on the buffer, unpack. */
static cring_status_t fused(cring_engine_t *e, const lane_t *L, const cring__gpu_coll_t *tmpl,
                            const item_t *items, int m, size_t bytes) {
    cring__errmsg_t err = {{0}};
    int bcast = tmpl->collective == CRING_COLL_BROADCAST;
    CRING_CHECK(lane_buffer(e, L, &L->d->fusion, &L->d->fusion_cap, bytes, "fusion"));
    void *buf = L->d->fusion;
    cring_status_t st = CRING_OK;
    size_t off = 0;
    for (int i = 0; i < m && st == CRING_OK && (!bcast || tmpl->root == e->rank); i++) {
        st = cring__gpu_copy_device(L->g, (char *)buf + off, items[i].send, items[i].bytes,
                                    L->stream, &err);
        off += items[i].bytes;
    }
    if (st != CRING_OK)
        return fail(e, st, "packing the fusion buffer on cuda:%d: %s", L->device, err.text);
    cring_dtype_t dt = bcast ? CRING_UINT8 : items[0].dtype;
    cring__gpu_tensor_t t = {.send = buf,
                             .recv = buf,
                             .dtype = dt,
                             .count = bytes / cring_dtype_size(dt),
                             .stream = L->stream};
    cring__gpu_coll_t c = *tmpl;
    c.ntensors = 1;
    c.tensors = &t;
    CRING_CHECK(call(e, L, &c));
    off = 0;
    for (int i = 0; i < m && st == CRING_OK; i++) {
        st = cring__gpu_copy_device(L->g, items[i].recv, (char *)buf + off, items[i].bytes,
                                    L->stream, &err);
        off += items[i].bytes;
    }
    if (st != CRING_OK)
        return fail(e, st, "unpacking the fusion buffer on cuda:%d: %s", L->device, err.text);
    cring__engine_stats_add(&e->stats.fused_tensors, (uint64_t)m);
    return CRING_OK;
}

/* Allreduce or broadcast of a batch: tensors in order, consecutive ones
 * packed together while they fit the threshold; one that fits with no
 * other runs in place. */
static cring_status_t run_batch(cring_engine_t *e, req_t **batch, int n) {
    req_t *first = batch[0];
    if (first->compression != CRING_DTYPE_COUNT)
        return fail(e, CRING_ERR_NOT_SUPPORTED,
                    "'%s': compression of CUDA tensors is done by the binding, not by NCCL",
                    first->name);
    lane_t L;
    CRING_CHECK(open_lane(e, first, &L));
    cring_status_t st = wait_producers(e, &L, batch, n);
    if (st == CRING_OK && cring__cuda_host_route(e, batch, n, cring__gpu_nccl_version(L.g))) {
        st = cring__cuda_host_run(e, L.g, L.device, L.stream, batch, n);
        if (st == CRING_OK) st = record_done(e, &L, batch, n);
        return fail_after_queueing(e, &L, batch, n, st);
    }
    if (st != CRING_OK) return fail_after_queueing(e, &L, batch, n, st);
    int total = 0;
    for (int b = 0; b < n; b++) total += batch[b]->ntensors;
    item_t *items = calloc((size_t)total + 1, sizeof *items);
    if (!items) {
        st = fail(e, CRING_ERR_NO_MEMORY, "out of memory");
        goto done;
    }
    st = ghost_buffers(e, &L, batch, n);
    int k = 0;
    for (int b = 0; b < n && st == CRING_OK; b++) {
        req_t *r = batch[b];
        for (int i = 0; i < r->ntensors && st == CRING_OK; i++)
            if (r->t[i].count)
                items[k++] = (item_t){.send = r->t[i].send,
                                      .recv = r->t[i].recv,
                                      .bytes = r->t[i].bytes,
                                      .count = r->t[i].count,
                                      .dtype = r->t[i].dtype};
    }
    if (st != CRING_OK) goto done;
    cring__gpu_coll_t tmpl = {.collective = first->coll,
                              .op = first->op,
                              .root = first->root,
                              .scale = first->prescale * first->postscale};
    /* what NCCL cannot do fails before anything is enqueued */
    for (int i = 0; i < k && st == CRING_OK; i++) {
        cring__gpu_tensor_t t = {.send = items[i].send,
                                 .recv = items[i].recv,
                                 .dtype = items[i].dtype,
                                 .count = items[i].count};
        cring__gpu_coll_t c = tmpl;
        c.ntensors = 1;
        c.tensors = &t;
        cring__errmsg_t err = {{0}};
        st = cring__gpu_check(&c, &err);
        if (st != CRING_OK) fail(e, st, "'%s': %s", first->name, err.text);
    }
    double t0 = cring__engine_tl_now(e);
    size_t cap = e->exec.threshold;
    int nfused = 0;
    for (int i = 0; i < k && st == CRING_OK;) {
        size_t bytes = items[i].bytes;
        int j = i + 1;
        /* a broadcast packs bytes; a reduction only tensors of one dtype (a
         * group may mix them) */
        while (j < k && bytes + items[j].bytes <= cap &&
               (tmpl.collective == CRING_COLL_BROADCAST || items[j].dtype == items[i].dtype))
            bytes += items[j++].bytes;
        if (j - i > 1) {
            st = fused(e, &L, &tmpl, items + i, j - i, bytes);
            nfused += j - i;
        } else {
            cring__gpu_tensor_t t = {.send = items[i].send,
                                     .recv = items[i].recv,
                                     .dtype = items[i].dtype,
                                     .count = items[i].count,
                                     .stream = L.stream};
            cring__gpu_coll_t c = tmpl;
            c.ntensors = 1;
            c.tensors = &t;
            st = call(e, &L, &c);
        }
        i = j;
    }
    if (st == CRING_OK) st = record_done(e, &L, batch, n);
    spans(e, batch, n, phase_name(first->coll), t0, cring__engine_tl_now(e), &L, nfused);
done:
    st = fail_after_queueing(e, &L, batch, n, st);
    free(items);
    return st;
}

/* A result the handle still owns when it goes: nothing but cring's stream
 * (ctx, process-lived) used it, so its free is ordered there. */
static void free_device_output(void *ctx, void *ptr, size_t bytes) {
    cring__gpu_mem_free(cring__gpu_global(), cring__gpu_stream_device(ctx), ptr, bytes,
                        cring__gpu_stream_handle(ctx));
}

/* The device memory of result i of r (allgather, alltoall), `bytes` long:
 * sets r->handle->outputs[i] and output_bytes[i]. The binding may lend room
 * with the request (tensor recv: size x the input's bytes for an allgather,
 * the input's bytes for an alltoall), allocated by the framework (torch's
 * caching allocator) on the producer's stream before the event that cring's
 * stream waits on, so no older work of that stream still uses it; a result
 * that fits goes there and the handle never frees it (output_lent). Any
 * other result is cring's own device memory, allocated on cring's stream,
 * freed with the handle (ordered on that stream) or by whoever takes it
 * (cring_handle_take_output: a DLPack export's deleter, ordered on its
 * consumer's stream). The handle's output arrays must exist. */
static cring_status_t output_memory(cring_engine_t *e, const lane_t *L, req_t *r, int i,
                                    size_t bytes) {
    cring_handle_t *h = r->handle;
    const tensor_spec_t *t = &r->t[i];
    h->free_output = free_device_output;
    h->free_ctx = L->d->stream;
    h->output_device = r->device;
    size_t room = t->recv ? t->bytes * (r->coll == CRING_COLL_ALLGATHER ? (size_t)e->size : 1) : 0;
    if (cring__output_lend(h, i, t, room, bytes)) return CRING_OK;
    cring__errmsg_t err = {{0}};
    /* an empty result still gets memory: a handle's result is never NULL */
    cring_status_t st =
        cring__gpu_mem_alloc(L->g, L->device, bytes ? bytes : 1, L->stream, &h->outputs[i], &err);
    if (st != CRING_OK) {
        h->output_bytes[i] = 0;
        return fail(e, st, "'%s': the result of tensor %d (%zu bytes): %s", r->name, i, bytes,
                    err.text);
    }
    return CRING_OK;
}

/* One request's grouped call on the lane, after its producer, then its completion. */
static cring_status_t run_one(cring_engine_t *e, const lane_t *L, req_t *r, cring__gpu_coll_t *c) {
    double t0 = cring__engine_tl_now(e);
    CRING_CHECK(call(e, L, c));
    if (c->ntensors > 1) cring__engine_stats_add(&e->stats.fused_tensors, (uint64_t)c->ntensors);
    spans(e, &r, 1, phase_name(c->collective), t0, cring__engine_tl_now(e), L, 0);
    return record_done(e, L, &r, 1);
}

/* Tensor i of allgather r: the elements each rank contributes (rows[q], the
 * first dimensions the peers' records gave, times the row) into counts, and
 * their sum. Rows come from other processes: a negative count, or one whose
 * bytes overflow, is a protocol error naming the tensor and the rank. Every
 * rank has the same rows, so every rank fails alike before NCCL sees it. */
static cring_status_t gather_counts(cring_engine_t *e, const req_t *r, int i, const int64_t *rows,
                                    size_t *counts, size_t *total) {
    const tensor_spec_t *t = &r->t[i];
    const size_t esize = cring_dtype_size(t->dtype), row = t->row_elems ? t->row_elems : 1;
    *total = 0;
    for (int q = 0; q < e->size; q++) { /* this rank's own too: every rank sees the same */
        if (rows[q] < 0 || (uint64_t)rows[q] > SIZE_MAX / row / esize)
            return fail(e, CRING_ERR_PROTOCOL,
                        "'%s' (tensor %d): rank %d described %lld rows of %zu elements for the "
                        "allgather, which cannot be (a corrupted request record?)",
                        r->name, i, q, (long long)rows[q], t->row_elems);
        /* a 0-d tensor gathers as one row */
        counts[q] = q == e->rank ? t->count : (size_t)rows[q] * t->row_elems;
        if (counts[q] > SIZE_MAX / esize - *total)
            return fail(e, CRING_ERR_PROTOCOL,
                        "'%s' (tensor %d): the allgather's parts up to rank %d exceed the "
                        "address space",
                        r->name, i, q);
        *total += counts[q];
    }
    return CRING_OK;
}

/* Allgather: results in the room the binding lent or in device memory the
 * handle owns (output_memory); each rank's part as negotiated (first_dims). */
static cring_status_t run_allgather(cring_engine_t *e, req_t *r, const int64_t *first_dims) {
    cring_handle_t *h = r->handle;
    lane_t L;
    CRING_CHECK(open_lane(e, r, &L));
    cring_status_t st = wait_producers(e, &L, &r, 1);
    if (st != CRING_OK) return fail_after_queueing(e, &L, &r, 1, st);
    const size_t P = (size_t)e->size, nt = (size_t)r->ntensors;
    size_t *counts = malloc(sizeof *counts * nt * P);
    cring__gpu_tensor_t *ts = calloc(nt, sizeof *ts);
    if (!counts || !ts || cring__handle_outputs(h, (int)nt, (int)P) != CRING_OK) {
        st = fail(e, CRING_ERR_NO_MEMORY, "out of memory");
        goto done;
    }
    memcpy(h->first_dims, first_dims, sizeof(int64_t) * nt * P);
    for (size_t i = 0; i < nt && st == CRING_OK; i++) {
        tensor_spec_t *t = &r->t[i];
        size_t *rc = counts + i * P, total = 0;
        st = gather_counts(e, r, (int)i, first_dims + i * P, rc, &total);
        if (st == CRING_OK)
            st = output_memory(e, &L, r, (int)i, total * cring_dtype_size(t->dtype));
        if (st != CRING_OK) break;
        ts[i] = (cring__gpu_tensor_t){.send = t->send,
                                      .recv = h->outputs[i],
                                      .dtype = t->dtype,
                                      .count = t->count,
                                      .rank_counts = rc,
                                      .stream = L.stream};
    }
    if (st == CRING_OK) {
        cring__gpu_coll_t c = {
            .collective = CRING_COLL_ALLGATHER, .scale = 1.0, .ntensors = (int)nt, .tensors = ts};
        st = run_one(e, &L, r, &c);
    }
done:
    free(counts);
    free(ts);
    return fail_after_queueing(e, &L, &r, 1, st);
}

/* Reducescatter: n rows split as n/P, one more for ranks below n%P. */
static cring_status_t run_reducescatter(cring_engine_t *e, req_t *r) {
    lane_t L;
    CRING_CHECK(open_lane(e, r, &L));
    cring_status_t st = wait_producers(e, &L, &r, 1);
    if (st == CRING_OK && cring__cuda_host_route(e, &r, 1, cring__gpu_nccl_version(L.g))) {
        st = cring__cuda_host_run(e, L.g, L.device, L.stream, &r, 1);
        if (st == CRING_OK) st = record_done(e, &L, &r, 1);
        return fail_after_queueing(e, &L, &r, 1, st);
    }
    if (st != CRING_OK) return fail_after_queueing(e, &L, &r, 1, st);
    const size_t P = (size_t)e->size, nt = (size_t)r->ntensors;
    size_t *counts = malloc(sizeof *counts * nt * P);
    cring__gpu_tensor_t *ts = calloc(nt, sizeof *ts);
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
                                      .stream = L.stream};
    }
    cring__gpu_coll_t c = {.collective = CRING_COLL_REDUCESCATTER,
                           .op = r->op,
                           .scale = r->prescale * r->postscale,
                           .ntensors = (int)nt,
                           .tensors = ts};
    st = run_one(e, &L, r, &c);
done:
    free(counts);
    free(ts);
    return fail_after_queueing(e, &L, &r, 1, st);
}

/* Alltoall of a batch (several ready alltoalls of one device, grouped by
 * execute.c): one allgather over the engine's communicator shares every
 * request's splits (rows to each rank), so each rank knows what it receives
 * from whom; then one NCCL group with a send and a receive per peer and
 * request, each into device memory its handle owns (output_memory). The
 * received rows per rank become first_dims, as on the CPU. */
static cring_status_t run_alltoall(cring_engine_t *e, req_t **batch, int n) {
    lane_t L;
    CRING_CHECK(open_lane(e, batch[0], &L));
    cring_status_t st = wait_producers(e, &L, batch, n);
    if (st != CRING_OK) return fail_after_queueing(e, &L, batch, n, st);
    const size_t P = (size_t)e->size, N = (size_t)n, me = (size_t)e->rank;
    int64_t *mine = malloc(sizeof *mine * N * P), *rows = malloc(sizeof *rows * N * P * P);
    size_t *counts = malloc(sizeof *counts * (P + 2 * N * P)); /* byte sizes; sent, received */
    cring__gpu_tensor_t *ts = calloc(N, sizeof *ts);
    if (!mine || !rows || !counts || !ts) {
        st = fail(e, CRING_ERR_NO_MEMORY, "out of memory");
        goto done;
    }
    for (size_t b = 0; b < N; b++) memcpy(mine + b * P, batch[b]->splits, sizeof *mine * P);
    for (size_t q = 0; q < P; q++) counts[q] = N * P * sizeof *rows;
    st = cring__comm_allgatherv(e->comm, mine, N * P * sizeof *rows, rows, counts);
    if (st != CRING_OK) {
        fail(e, st, "'%s': sharing the splits: %s", batch[0]->name, cring__comm_error(e->comm));
        goto done;
    }
    for (size_t b = 0; b < N && st == CRING_OK; b++) {
        req_t *r = batch[b];
        cring_handle_t *h = r->handle;
        tensor_spec_t *t = &r->t[0];
        size_t *sent = counts + P + 2 * b * P, *received = sent + P, total = 0;
        if (cring__handle_outputs(h, 1, (int)P) != CRING_OK) {
            st = fail(e, CRING_ERR_NO_MEMORY, "out of memory");
            break;
        }
        for (size_t q = 0; q < P; q++) {
            /* rows[q's block][request b][destination] */
            int64_t out = rows[me * N * P + b * P + q], in = rows[q * N * P + b * P + me];
            if (out < 0 || in < 0) {
                st = fail(e, CRING_ERR_PROTOCOL, "'%s': a negative split from a peer", r->name);
                break;
            }
            sent[q] = (size_t)out * t->row_elems;
            received[q] = (size_t)in * t->row_elems;
            h->first_dims[q] = in;
            total += received[q];
        }
        if (st == CRING_OK) st = output_memory(e, &L, r, 0, total * cring_dtype_size(t->dtype));
        if (st == CRING_OK)
            ts[b] = (cring__gpu_tensor_t){.send = t->send,
                                          .recv = h->outputs[0],
                                          .dtype = t->dtype,
                                          .count = t->count,
                                          .rank_counts = sent,
                                          .recv_counts = received,
                                          .stream = L.stream};
    }
    if (st != CRING_OK) goto done;
    cring__gpu_coll_t c = {
        .collective = CRING_COLL_ALLTOALL, .scale = 1.0, .ntensors = n, .tensors = ts};
    double t0 = cring__engine_tl_now(e);
    st = call(e, &L, &c);
    if (st != CRING_OK) goto done;
    if (n > 1) cring__engine_stats_add(&e->stats.fused_tensors, (uint64_t)n);
    spans(e, batch, n, phase_name(CRING_COLL_ALLTOALL), t0, cring__engine_tl_now(e), &L,
          n > 1 ? n : 0);
    st = record_done(e, &L, batch, n);
done:
    free(mine);
    free(rows);
    free(counts);
    free(ts);
    return fail_after_queueing(e, &L, batch, n, st);
}

/* The engine stops: its buffers go (ordered on their streams), then its
 * communicators, then the streams go back to the pool. Nothing of another
 * engine is touched. */
static void shutdown_cuda(cring_engine_t *e) {
    struct cring__cuda_state *cs = e->exec.cuda;
    if (!cs) return;
    cring__gpu_t *g = cring__gpu_global();
    for (int i = 0; i < cs->n; i++) {
        cuda_device_t *d = &cs->devices[i];
        void *stream = cring__gpu_stream_handle(d->stream);
        cring__gpu_mem_free(g, d->device, d->fusion, d->fusion_cap, stream);
        cring__gpu_mem_free(g, d->device, d->zeros, d->zeros_cap, stream);
        cring__gpu_comm_destroy(g, d->comm);
        cring__gpu_stream_release(g, d->stream);
    }
    free(cs);
    e->exec.cuda = NULL;
}

/* The engine's communicator failed: abort this engine's NCCL communicators,
 * so work already enqueued on them ends instead of waiting for peers that
 * are gone, and every synchronize of it raises the engine's error. */
static void abort_cuda(cring_engine_t *e, cring_status_t st, const char *msg) {
    struct cring__cuda_state *cs = e->exec.cuda;
    cring__gpu_t *g = cring__gpu_global();
    for (int i = 0; cs && g && i < cs->n; i++)
        cring__gpu_comm_fail(g, cs->devices[i].comm, st, msg);
}

const cring__backend_t cring__backend_cuda = {
    .name = "cuda",
    .allreduce = run_batch,
    .broadcast = run_batch,
    .allgather = run_allgather,
    .reducescatter = run_reducescatter,
    .alltoall = run_alltoall,
    .prepare = prepare_cuda,
    .discard = discard_cuda,
    .shutdown = shutdown_cuda,
    .abort = abort_cuda,
};

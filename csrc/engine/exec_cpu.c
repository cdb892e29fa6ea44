/* exec_cpu.c: the CPU backend: moves a ready batch's data for tensors in host
 * memory through the communicator (shared memory or TCP, whichever it
 * holds), staging through the fusion buffer where a batch fuses, converts
 * (compression) or scales. Completes nothing and decides nothing: the engine
 * has negotiated, ordered and batched already. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../algo/algo.h"
#include "../reduce/reduce.h"
#include "engine_internal.h"

/* Copy a batch's tensors into the fusion buffer `buf` as `wire` (scaled by
 * each request's prescale), in batch order; counts[k] gets the k-th
 * tensor's element count when counts is not NULL. */
static void pack_batch(req_t **batch, int n, cring_dtype_t wire, unsigned char *buf,
                       size_t *counts) {
    size_t off = 0, k = 0, es = cring_dtype_size(wire);
    for (int b = 0; b < n; b++)
        for (int i = 0; i < batch[b]->ntensors; i++) {
            tensor_spec_t *t = &batch[b]->t[i];
            cring__convert(wire, buf + off * es, t->dtype, t->send, t->count, batch[b]->prescale);
            off += t->count;
            if (counts) counts[k++] = t->count;
        }
}

/* The reverse of pack_batch: the reduced buffer into each tensor's recv,
 * converted back and scaled by each request's postscale. */
static void unpack_batch(req_t **batch, int n, cring_dtype_t wire, const unsigned char *buf) {
    size_t off = 0, es = cring_dtype_size(wire);
    for (int b = 0; b < n; b++)
        for (int i = 0; i < batch[b]->ntensors; i++) {
            tensor_spec_t *t = &batch[b]->t[i];
            cring__convert(t->dtype, t->recv, wire, buf + off * es, t->count, batch[b]->postscale);
            off += t->count;
        }
}

/* Adasum over a batch (core/adasum.c): always through the fusion buffer,
 * with each tensor's element count so that each keeps its own coefficients.
 * Scaling and compression apply as for the other ops. */
static cring_status_t run_adasum(cring_engine_t *e, req_t **batch, int n) {
    const req_t *first = batch[0];
    cring_dtype_t wire =
        first->compression != CRING_DTYPE_COUNT ? first->compression : first->t[0].dtype;
    size_t total = 0, ntensors = 0, es = cring_dtype_size(wire);
    for (int b = 0; b < n; b++)
        for (int i = 0; i < batch[b]->ntensors; i++) {
            total += batch[b]->t[i].count;
            ntensors++;
        }
    size_t *counts = malloc((ntensors ? ntensors : 1) * sizeof *counts);
    if (!counts || cring__fusion_reserve(e, total * es) != 0) {
        free(counts);
        return CRING_ERR_NO_MEMORY;
    }
    double t0 = cring__engine_tl_now(e);
    for (int b = 0; b < n; b++)
        cring__engine_span(e, batch[b]->name, "QUEUE", batch[b]->ready_s, t0, NULL);
    unsigned char *buf = e->exec.fusion;
    pack_batch(batch, n, wire, buf, counts);
    double t1 = cring__engine_tl_now(e);
    cring_status_t st = cring__comm_adasum(e->comm, buf, wire, counts, (int)ntensors);
    double t2 = cring__engine_tl_now(e);
    if (st == CRING_OK) unpack_batch(batch, n, wire, buf);
    double t3 = cring__engine_tl_now(e);
    char args[96];
    snprintf(args, sizeof args, "\"fused_tensors\": %zu, \"fused_bytes\": %zu", ntensors,
             total * es);
    cring__fused_spans(e, batch, n, "CPU_ADASUM_ALLREDUCE", t0, t1, t2, t3, args);
    cring__engine_stats_add(&e->stats.fused_tensors, ntensors);
    cring__engine_stats_add(&e->stats.collectives, 1);
    free(counts);
    return st;
}

/* Allreduce a batch in place of its tensors where the communicator can
 * (shared memory: its windows are the fusion buffer) and the wire dtype is
 * the tensors' own (no compression): no copy into and out of the fusion
 * buffer. A prescale scales each input into its output first (the result
 * overwrites it anyway), a postscale scales each output afterwards. Decided
 * from what every rank agreed on (transport, compression, the batch), so
 * every rank takes the same path. Returns ERR_NOT_SUPPORTED, having done nothing,
 * where it cannot. */
static cring_status_t run_allreduce_direct(cring_engine_t *e, req_t **batch, int n, size_t ntensors,
                                           double t0) {
    const req_t *first = batch[0];
    cring_dtype_t dtype = first->t[0].dtype;
    if (first->compression != CRING_DTYPE_COUNT || !cring__comm_can_allreduce_multi(e->comm))
        return CRING_ERR_NOT_SUPPORTED;
    cring__seg_t *segs = malloc(sizeof *segs * (ntensors ? ntensors : 1));
    if (!segs) return CRING_ERR_NO_MEMORY;
    size_t k = 0, total = 0;
    for (int b = 0; b < n; b++)
        for (int i = 0; i < batch[b]->ntensors; i++) {
            tensor_spec_t *t = &batch[b]->t[i];
            const void *send = t->send;
            if (batch[b]->prescale != 1.0) {
                cring__convert(dtype, t->recv, dtype, t->send, t->count, batch[b]->prescale);
                send = t->recv;
            }
            segs[k++] = (cring__seg_t){.send = send, .recv = t->recv, .count = t->count};
            total += t->count;
        }
    cring_status_t st = cring__comm_allreduce_multi(e->comm, segs, (int)k, dtype, first->op);
    free(segs);
    double t1 = cring__engine_tl_now(e);
    for (int b = 0; st == CRING_OK && b < n; b++)
        if (batch[b]->postscale != 1.0)
            for (int i = 0; i < batch[b]->ntensors; i++) {
                tensor_spec_t *t = &batch[b]->t[i];
                cring__convert(dtype, t->recv, dtype, t->recv, t->count, batch[b]->postscale);
            }
    if (e->timeline) {
        char args[96];
        snprintf(args, sizeof args, "\"fused_tensors\": %zu, \"fused_bytes\": %zu", ntensors,
                 total * cring_dtype_size(dtype));
        for (int b = 0; b < n; b++)
            cring__engine_span(e, batch[b]->name, "CPU_ALLREDUCE", t0, t1, args);
    }
    cring__engine_stats_add(&e->stats.fused_tensors, ntensors);
    return st;
}

/* Allreduce a batch of requests (one or many) with the same dtype, op and
 * compression: directly on the tensor when there is one tensor that needs no
 * staging; else in place of the tensors where the communicator can
 * (run_allreduce_direct); else through the fusion buffer. */
static cring_status_t run_allreduce(cring_engine_t *e, req_t **batch, int n) {
    const req_t *first = batch[0];
    if (first->op == CRING_ADASUM) return run_adasum(e, batch, n);
    cring_dtype_t dtype = first->t[0].dtype;
    cring_dtype_t wire = first->compression != CRING_DTYPE_COUNT ? first->compression : dtype;
    size_t total = 0, ntensors = 0;
    int staging = n > 1 || first->ntensors > 1 || wire != dtype || first->prescale != 1.0;
    for (int b = 0; b < n; b++)
        for (int i = 0; i < batch[b]->ntensors; i++) {
            total += batch[b]->t[i].count;
            ntensors++;
        }
    double t0 = cring__engine_tl_now(e);
    for (int b = 0; b < n; b++)
        cring__engine_span(e, batch[b]->name, "QUEUE", batch[b]->ready_s, t0, NULL);
    cring_status_t st;
    if (!staging) {
        tensor_spec_t *t = &first->t[0];
        st = cring__comm_allreduce(e->comm, t->send, t->recv, t->count, dtype, first->op);
        double t1 = cring__engine_tl_now(e);
        if (st == CRING_OK && first->postscale != 1.0)
            cring__convert(dtype, t->recv, dtype, t->recv, t->count, first->postscale);
        cring__engine_span(e, first->name, "CPU_ALLREDUCE", t0, t1, NULL);
    } else if ((n > 1 || first->ntensors > 1) &&
               (st = run_allreduce_direct(e, batch, n, ntensors, t0)) != CRING_ERR_NOT_SUPPORTED) {
        /* several tensors (as every rank has them), reduced in place */
    } else {
        size_t es = cring_dtype_size(wire);
        if (cring__fusion_reserve(e, total * es) != 0) return CRING_ERR_NO_MEMORY;
        unsigned char *buf = e->exec.fusion;
        pack_batch(batch, n, wire, buf, NULL);
        double t1 = cring__engine_tl_now(e);
        st = cring__comm_allreduce(e->comm, buf, buf, total, wire, first->op);
        double t2 = cring__engine_tl_now(e);
        if (st == CRING_OK) unpack_batch(batch, n, wire, buf);
        double t3 = cring__engine_tl_now(e);
        char args[96];
        snprintf(args, sizeof args, "\"fused_tensors\": %zu, \"fused_bytes\": %zu", ntensors,
                 total * es);
        cring__fused_spans(e, batch, n, "CPU_ALLREDUCE", t0, t1, t2, t3, args);
        cring__engine_stats_add(&e->stats.fused_tensors, ntensors);
    }
    cring__engine_stats_add(&e->stats.collectives, 1);
    return st;
}

/* A group whose tensors have different dtypes cannot share a fusion buffer:
 * reduce its tensors one by one (still one negotiated unit). */
static cring_status_t run_allreduce_each(cring_engine_t *e, req_t *r) {
    for (int i = 0; i < r->ntensors; i++) {
        req_t one = *r;
        one.ntensors = 1;
        one.t = &r->t[i];
        req_t *batch = &one;
        CRING_CHECK(run_allreduce(e, &batch, 1));
    }
    return CRING_OK;
}

/* Broadcast a batch with the same root: through the fusion buffer unless it
 * is one in-place tensor. */
static cring_status_t run_broadcast(cring_engine_t *e, req_t **batch, int n) {
    const req_t *first = batch[0];
    int root = first->root, i_am_root = e->rank == root;
    double t0 = cring__engine_tl_now(e);
    for (int b = 0; b < n; b++)
        cring__engine_span(e, batch[b]->name, "QUEUE", batch[b]->ready_s, t0, NULL);
    cring_status_t st;
    if (n == 1 && first->ntensors == 1) {
        tensor_spec_t *t = &first->t[0];
        if (i_am_root && t->send != t->recv) memcpy(t->recv, t->send, t->bytes);
        st = cring__comm_broadcast(e->comm, t->recv, t->bytes, root);
        cring__engine_span(e, first->name, "CPU_BCAST", t0, cring__engine_tl_now(e), NULL);
    } else {
        size_t total = 0, ntensors = 0;
        for (int b = 0; b < n; b++)
            for (int i = 0; i < batch[b]->ntensors; i++) {
                total += batch[b]->t[i].bytes;
                ntensors++;
            }
        if (cring__fusion_reserve(e, total) != 0) return CRING_ERR_NO_MEMORY;
        unsigned char *buf = e->exec.fusion;
        size_t off = 0;
        if (i_am_root)
            for (int b = 0; b < n; b++)
                for (int i = 0; i < batch[b]->ntensors; i++) {
                    memcpy(buf + off, batch[b]->t[i].send, batch[b]->t[i].bytes);
                    off += batch[b]->t[i].bytes;
                }
        double t1 = cring__engine_tl_now(e);
        st = cring__comm_broadcast(e->comm, buf, total, root);
        double t2 = cring__engine_tl_now(e);
        off = 0;
        if (st == CRING_OK)
            for (int b = 0; b < n; b++)
                for (int i = 0; i < batch[b]->ntensors; i++) {
                    memcpy(batch[b]->t[i].recv, buf + off, batch[b]->t[i].bytes);
                    off += batch[b]->t[i].bytes;
                }
        double t3 = cring__engine_tl_now(e);
        cring__fused_spans(e, batch, n, "CPU_BCAST", t0, t1, t2, t3, NULL);
        cring__engine_stats_add(&e->stats.fused_tensors, ntensors);
    }
    cring__engine_stats_add(&e->stats.collectives, 1);
    return st;
}

static cring_status_t run_allgather(cring_engine_t *e, req_t *r, const int64_t *first_dims) {
    cring_handle_t *h = r->handle;
    double t0 = cring__engine_tl_now(e);
    cring__engine_span(e, r->name, "QUEUE", r->ready_s, t0, NULL);
    size_t *sizes = malloc(sizeof *sizes * (size_t)e->size);
    if (!sizes || cring__handle_outputs(h, r->ntensors, e->size) != CRING_OK) {
        free(sizes);
        return CRING_ERR_NO_MEMORY;
    }
    memcpy(h->first_dims, first_dims, sizeof(int64_t) * (size_t)r->ntensors * (size_t)e->size);
    cring_status_t st = CRING_OK;
    for (int i = 0; i < r->ntensors && st == CRING_OK; i++) {
        tensor_spec_t *t = &r->t[i];
        size_t row_bytes = t->row_elems * cring_dtype_size(t->dtype), total = 0;
        for (int q = 0; q < e->size; q++) {
            sizes[q] = (size_t)first_dims[(size_t)i * (size_t)e->size + (size_t)q] * row_bytes;
            total += sizes[q];
        }
        sizes[e->rank] = t->bytes; /* a 0-d tensor gathers as one row */
        /* room the caller lent (size x its own part) holds an even result */
        if (!cring__output_place(e, h, i, t, t->bytes * (size_t)e->size, total)) {
            st = CRING_ERR_NO_MEMORY;
            break;
        }
        st = cring__comm_allgatherv(e->comm, t->send, t->bytes, h->outputs[i], sizes);
        cring__engine_stats_add(&e->stats.collectives, 1);
    }
    free(sizes);
    cring__engine_span(e, r->name, "CPU_ALLGATHER", t0, cring__engine_tl_now(e), NULL);
    return st;
}

static cring_status_t run_reducescatter(cring_engine_t *e, req_t *r) {
    double t0 = cring__engine_tl_now(e);
    cring__engine_span(e, r->name, "QUEUE", r->ready_s, t0, NULL);
    size_t *counts = malloc(sizeof *counts * (size_t)e->size);
    if (!counts) return CRING_ERR_NO_MEMORY;
    cring_status_t st = CRING_OK;
    for (int i = 0; i < r->ntensors && st == CRING_OK; i++) {
        tensor_spec_t *t = &r->t[i];
        size_t rows = (size_t)t->shape[0], p = (size_t)e->size;
        for (size_t q = 0; q < p; q++) counts[q] = (rows / p + (q < rows % p)) * t->row_elems;
        const void *send = t->send;
        if (r->prescale != 1.0) {
            if (cring__fusion_reserve(e, t->bytes) != 0) {
                st = CRING_ERR_NO_MEMORY;
                break;
            }
            cring__convert(t->dtype, e->exec.fusion, t->dtype, t->send, t->count, r->prescale);
            send = e->exec.fusion;
        }
        st = cring__comm_reducescatter(e->comm, send, t->recv, counts, t->dtype, r->op);
        if (st == CRING_OK && r->postscale != 1.0)
            cring__convert(t->dtype, t->recv, t->dtype, t->recv, counts[e->rank], r->postscale);
        cring__engine_stats_add(&e->stats.collectives, 1);
    }
    free(counts);
    cring__engine_span(e, r->name, "CPU_REDUCESCATTER", t0, cring__engine_tl_now(e), NULL);
    return st;
}

/* Alltoall: the ranks first share their splits (a size x size matrix of
 * rows), so every rank knows what it receives from whom; then one alltoallv
 * into an engine-allocated result. */
static cring_status_t run_alltoall(cring_engine_t *e, req_t *r) {
    cring_handle_t *h = r->handle;
    const size_t P = (size_t)e->size;
    tensor_spec_t *t = &r->t[0];
    double t0 = cring__engine_tl_now(e);
    cring__engine_span(e, r->name, "QUEUE", r->ready_s, t0, NULL);
    int64_t *rows = malloc(sizeof *rows * P * P);
    size_t *sizes = malloc(sizeof *sizes * (P + P * P));
    cring_status_t st = CRING_OK;
    if (!rows || !sizes || cring__handle_outputs(h, 1, (int)P) != CRING_OK) {
        st = CRING_ERR_NO_MEMORY;
        goto done;
    }
    for (size_t q = 0; q < P; q++) sizes[q] = P * sizeof *rows;
    st = cring__comm_allgatherv(e->comm, r->splits, P * sizeof *rows, rows, sizes);
    if (st != CRING_OK) goto done;
    size_t *matrix = sizes + P, row_bytes = t->row_elems * cring_dtype_size(t->dtype), total = 0;
    for (size_t k = 0; k < P * P; k++) {
        if (rows[k] < 0) {
            st = CRING_ERR_PROTOCOL; /* validated at submission: a corrupt peer */
            goto done;
        }
        matrix[k] = (size_t)rows[k] * row_bytes;
    }
    for (size_t q = 0; q < P; q++) {
        h->first_dims[q] = rows[q * P + (size_t)e->rank];
        total += matrix[q * P + (size_t)e->rank];
    }
    h->outputs[0] = cring__output_alloc(e, total);
    h->output_bytes[0] = total;
    if (!h->outputs[0]) {
        st = CRING_ERR_NO_MEMORY;
        goto done;
    }
    st = cring__comm_alltoallv(e->comm, t->send, h->outputs[0], matrix);
    cring__engine_stats_add(&e->stats.collectives, 1);
done:
    free(rows);
    free(sizes);
    cring__engine_span(e, r->name, "CPU_ALLTOALL", t0, cring__engine_tl_now(e), NULL);
    return st;
}

/* Alltoalls come one at a time on the CPU (execute.c groups only CUDA's). */
static cring_status_t cpu_alltoall(cring_engine_t *e, req_t **batch, int n) {
    for (int b = 0; b < n; b++) CRING_CHECK(run_alltoall(e, batch[b]));
    return CRING_OK;
}

/* A group whose tensors have different dtypes comes alone (it is not
 * fusible) and is reduced tensor by tensor. */
static cring_status_t cpu_allreduce(cring_engine_t *e, req_t **batch, int n) {
    const req_t *r = batch[0];
    for (int i = 1; n == 1 && i < r->ntensors; i++)
        if (r->t[i].dtype != r->t[0].dtype) return run_allreduce_each(e, batch[0]);
    return run_allreduce(e, batch, n);
}

const cring__backend_t cring__backend_cpu = {
    .name = "cpu",
    .allreduce = cpu_allreduce,
    .broadcast = run_broadcast,
    .allgather = run_allgather,
    .reducescatter = run_reducescatter,
    .alltoall = cpu_alltoall,
    .shutdown = NULL,
};

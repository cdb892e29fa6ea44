/* exec_cuda_host.c: the CUDA backend's exact route for reductions NCCL cannot
 * do as the CPU path does (16-bit integers, Adasum, scale factors on integers
 * or on Min/Max/Product, and scaled reductions at one rank on an NCCL with
 * the one-rank defect): the batch is staged through pinned host memory on
 * cring's stream and reduced by the CPU backend itself, so its results are
 * the CPU path's bit for bit. Needs no GPU kernel; it waits for cring's
 * stream (twice a batch), which the NCCL route never does. It decides
 * nothing about batching and completes nothing.
 *
 * The staging of one batch, every rank alike:
 *
 *   cring's stream:  [producers' events] -> D2H copies -> | sync |
 *   host:                                                  CPU backend
 *                                                          (communicator)
 *   cring's stream:                        H2D copies -> | sync | -> completion event
 *
 * Each tensor gets a slice of one pinned buffer (its input; a reducescatter
 * also its output rows), aligned to 64 bytes. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "exec_cuda_host.h"

#include "../reduce/reduce.h"

int cring__cuda_host_route(const cring_engine_t *e, req_t *const *batch, int n, int nccl_version) {
    for (int b = 0; b < n; b++) {
        const req_t *r = batch[b];
        if (r->coll != CRING_COLL_ALLREDUCE && r->coll != CRING_COLL_REDUCESCATTER) return 0;
        int scaled = r->prescale != 1.0 || r->postscale != 1.0;
        if (scaled && e->size == 1 && cring__gpu_nccl_one_rank_defect(nccl_version)) return 1;
        for (int i = 0; i < r->ntensors; i++)
            if (!cring__gpu_can_reduce(r->t[i].dtype, r->op, r->prescale, r->postscale)) return 1;
    }
    return 0;
}

#define ALIGN64(x) (((x) + 63) & ~(size_t)63)

/* At one rank this route stands in for NCCL's pre-multiplied sum (the
 * one-rank defect): for float16/bfloat16 it scales as that does and as
 * Horovod does on GPUs, by the one factor (prescale x postscale) rounded to
 * the tensor's dtype, so a result does not depend on which NCCL is loaded.
 * (The CPU path scales 16-bit floats by the float32 factor, as Horovod's CPU
 * path does.) Only where every tensor of the request is of that one dtype. */
static void one_rank_half_factors(const cring_engine_t *e, req_t *shadow) {
    if (e->size != 1 || (shadow->prescale == 1.0 && shadow->postscale == 1.0)) return;
    if (shadow->op != CRING_SUM && shadow->op != CRING_AVERAGE) return;
    cring_dtype_t d = shadow->t[0].dtype;
    if (d != CRING_FLOAT16 && d != CRING_BFLOAT16) return;
    for (int i = 1; i < shadow->ntensors; i++)
        if (shadow->t[i].dtype != d) return;
    double factor = shadow->prescale * shadow->postscale, rounded = 0.0;
    uint16_t bits = 0;
    cring__convert(d, &bits, CRING_FLOAT64, &factor, 1, 1.0);
    cring__convert(CRING_FLOAT64, &rounded, d, &bits, 1, 1.0);
    shadow->prescale = rounded;
    shadow->postscale = 1.0;
}

/* Rows of a reducescatter's result on this rank, in bytes. */
static size_t scatter_bytes(const cring_engine_t *e, const tensor_spec_t *t) {
    size_t rows = (size_t)t->shape[0], p = (size_t)e->size, q = (size_t)e->rank;
    return (rows / p + (q < rows % p)) * t->row_elems * cring_dtype_size(t->dtype);
}

cring_status_t cring__cuda_host_run(cring_engine_t *e, cring__gpu_t *g, int device, void *stream,
                                    req_t **batch, int n) {
    const int scatter = batch[0]->coll == CRING_COLL_REDUCESCATTER;
    size_t bytes = 0;
    int total = 0;
    for (int b = 0; b < n; b++) {
        total += batch[b]->ntensors;
        if (batch[b]->ghost && !batch[b]->handle) continue; /* host zeros already */
        for (int i = 0; i < batch[b]->ntensors; i++) {
            const tensor_spec_t *t = &batch[b]->t[i];
            bytes += ALIGN64(t->bytes) + (scatter ? ALIGN64(scatter_bytes(e, t)) : 0);
        }
    }
    req_t *shadows = calloc((size_t)n, sizeof *shadows);
    req_t **ptrs = calloc((size_t)n, sizeof *ptrs);
    tensor_spec_t *specs = calloc((size_t)total + 1, sizeof *specs);
    void *pinned = NULL;
    size_t capacity = 0;
    cring__errmsg_t err = {{0}};
    cring_status_t st = CRING_OK;
    if (!shadows || !ptrs || !specs) {
        st = CRING_ERR_NO_MEMORY;
        goto done;
    }
    double t0 = cring__engine_tl_now(e);
    st = cring__gpu_pinned_get(g, bytes, &pinned, &capacity, &err);
    if (st != CRING_OK) goto cuda_failed;
    /* the shadows: the same requests with host tensors; inputs copied in */
    size_t at = 0;
    tensor_spec_t *spec = specs;
    for (int b = 0; b < n && st == CRING_OK; b++) {
        req_t *r = batch[b];
        shadows[b] = *r;
        ptrs[b] = &shadows[b];
        if (r->ghost && !r->handle) continue; /* its tensors are host zeros */
        one_rank_half_factors(e, &shadows[b]);
        shadows[b].t = spec;
        for (int i = 0; i < r->ntensors && st == CRING_OK; i++, spec++) {
            *spec = r->t[i];
            char *in = (char *)pinned + at;
            at += ALIGN64(spec->bytes);
            spec->send = spec->recv = in;
            if (scatter) {
                spec->recv = (char *)pinned + at;
                at += ALIGN64(scatter_bytes(e, spec));
            }
            st = cring__gpu_copy_host_async(g, in, r->t[i].send, spec->bytes, 0, stream, &err);
        }
    }
    if (st == CRING_OK) st = cring__gpu_stream_sync(g, stream, &err);
    if (st != CRING_OK) goto cuda_failed;
    /* the CPU path itself */
    st = scatter ? cring__backend_cpu.reducescatter(e, ptrs[0])
                 : cring__backend_cpu.allreduce(e, ptrs, n);
    if (st != CRING_OK) goto done;
    for (int b = 0; b < n && st == CRING_OK; b++) {
        req_t *r = batch[b];
        if (r->ghost && !r->handle) continue;
        for (int i = 0; i < r->ntensors && st == CRING_OK; i++) {
            const tensor_spec_t *host = &shadows[b].t[i];
            size_t out = scatter ? scatter_bytes(e, host) : host->bytes;
            st = cring__gpu_copy_host_async(g, r->t[i].recv, host->recv, out, 1, stream, &err);
        }
    }
    if (st == CRING_OK) st = cring__gpu_stream_sync(g, stream, &err);
    if (st == CRING_OK) {
        /* on the timeline: the whole staged batch, around the CPU backend's own span */
        char args[64];
        snprintf(args, sizeof args, "\"device\": \"cuda:%d\"", device);
        for (int b = 0; b < n; b++)
            cring__engine_span(e, batch[b]->name, "CUDA_HOST_STAGED", t0, cring__engine_tl_now(e),
                               args);
        goto done;
    }
cuda_failed:
    snprintf(e->exec.error, sizeof e->exec.error,
             "'%.256s': staging through host memory on cuda:%d: %.512s", batch[0]->name, device,
             err.text);
done:
    if (pinned) cring__gpu_pinned_put(g, pinned, capacity);
    free(specs);
    free(ptrs);
    free(shadows);
    return st;
}

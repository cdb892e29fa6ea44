/* exec_cuda.c: the CUDA backend (stub). The NCCL backend replaces this file
 * wholesale; until then a CUDA request is negotiated like any other and then
 * fails on every rank with ERR_NOT_SUPPORTED. Must not touch host staging or
 * the communicator's data path. */
#include <stdio.h>

#include "engine_internal.h"

static cring_status_t not_supported(cring_engine_t *e) {
    snprintf(e->exec.error, sizeof e->exec.error,
             "CUDA tensors need the NCCL backend, which this build does not have");
    return CRING_ERR_NOT_SUPPORTED;
}

static cring_status_t cuda_batch(cring_engine_t *e, req_t **batch, int n) {
    (void)batch;
    (void)n;
    return not_supported(e);
}

static cring_status_t cuda_allgather(cring_engine_t *e, req_t *r, const int64_t *first_dims) {
    (void)r;
    (void)first_dims;
    return not_supported(e);
}

static cring_status_t cuda_one(cring_engine_t *e, req_t *r) {
    (void)r;
    return not_supported(e);
}

const cring__backend_t cring__backend_cuda = {
    .name = "cuda",
    .allreduce = cuda_batch,
    .broadcast = cuda_batch,
    .allgather = cuda_allgather,
    .reducescatter = cuda_one,
    .alltoall = cuda_one,
    .shutdown = NULL,
};

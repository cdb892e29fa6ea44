/* exec_cuda_host.h: the CUDA backend's host-staged route for reductions NCCL
 * cannot do as the CPU path does (exec_cuda_host.c). For exec_cuda.c only. */
#ifndef CRING_ENGINE_EXEC_CUDA_HOST_H
#define CRING_ENGINE_EXEC_CUDA_HOST_H

#include "../gpu/gpu.h"
#include "engine_internal.h"

/* 1 when the batch (allreduces of one fusion key, or one reducescatter) must
 * take the host route: some tensor's dtype, op or scale factors are not
 * something NCCL reduces exactly as the CPU path (cring__gpu_can_reduce), or
 * the batch is scaled on a communicator of one rank with an NCCL that has
 * the one-rank reduce defect (cring__gpu_nccl_one_rank_defect). Decided from
 * negotiated facts only (dtype, op, factors, size, NCCL's version), so every
 * rank takes the same route. */
int cring__cuda_host_route(const cring_engine_t *e, req_t *const *batch, int n, int nccl_version);

/* Run the batch through the CPU backend on pinned host copies: after the
 * producers (the caller has made `stream` wait for them), each device input
 * is copied to pinned host memory on `stream`, the stream is waited for, the
 * CPU backend reduces the copies through the engine's communicator (the
 * very machinery and rounding of CPU tensors), the results are copied back
 * to the device on `stream`, and the stream is waited for again before the
 * pinned memory is reused. A joined rank's stand-in (host zeros) is used as
 * it is. Returns the CPU backend's status or a CUDA failure (worded in
 * e->exec.error). Engine thread only. */
cring_status_t cring__cuda_host_run(cring_engine_t *e, cring__gpu_t *g, int device, void *stream,
                                    req_t **batch, int n);

#endif

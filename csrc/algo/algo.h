/* algo.h: collective algorithms as index math over a transport interface.
 * Ring algorithms run over any p2p transport; owner-slice algorithms run over
 * shared-memory windows. Nothing here opens sockets or maps memory. */
#ifndef CRING_ALGO_H
#define CRING_ALGO_H

#include <stddef.h>

#include "../transport/transport.h"

/* A growable scratch buffer owned by the caller (the communicator). */
typedef struct cring__scratch {
    void *ptr;
    size_t bytes;
} cring__scratch_t;
/* Make sure s->bytes >= bytes (contents are not kept). ERR_NO_MEMORY on failure. */
cring_status_t cring__scratch_reserve(cring__scratch_t *s, size_t bytes);
void cring__scratch_free(cring__scratch_t *s);

/* ---- ring algorithms over p2p (algo/ring.c) -------------------------------- */
cring_status_t cring__ring_allreduce(cring__p2p_t *p2p, cring__scratch_t *scratch, const void *send,
                                     void *recv, size_t count, cring_dtype_t dtype, cring_op_t op);
cring_status_t cring__ring_reducescatter(cring__p2p_t *p2p, cring__scratch_t *scratch,
                                         const void *send, void *recv, const size_t *counts,
                                         cring_dtype_t dtype, cring_op_t op);
cring_status_t cring__ring_allgatherv(cring__p2p_t *p2p, const void *send, size_t send_bytes,
                                      void *recv, const size_t *recv_bytes);
cring_status_t cring__ring_broadcast(cring__p2p_t *p2p, void *buf, size_t nbytes, int root);
cring_status_t cring__p2p_barrier(cring__p2p_t *p2p);
/* Alltoallv: matrix[q*size + r] bytes go from rank q to rank r (the same
 * matrix on every rank). send holds this rank's blocks in destination order,
 * recv receives blocks in source order; they must not overlap. */
cring_status_t cring__p2p_alltoallv(cring__p2p_t *p2p, const void *send, void *recv,
                                    const size_t *matrix);

/* ---- latency-bound allreduce over p2p (algo/tree.c) ------------------------- */
/* Recursive doubling: ceil(log2 P) (+2 when P is not a power of two) whole-
 * vector exchanges. Same contract as cring__ring_allreduce; uses count
 * elements of scratch. */
cring_status_t cring__tree_allreduce(cring__p2p_t *p2p, cring__scratch_t *scratch, const void *send,
                                     void *recv, size_t count, cring_dtype_t dtype, cring_op_t op);

/* ---- sizes of the shared-memory algorithms (algo/shm_tune.c) ---------------- */
/* This machine's choice (cring_shm_tuning: caches, CRING_SHM_* overrides)
 * as the transport's parameters, for rank 0 to put in the segment. */
void cring__shm_tuning_params(uint64_t params[CRING__SHM_PARAMS]);

/* ---- owner-slice algorithms over shared memory (algo/shm_coll.c) ----------- */
cring_status_t cring__shm_allreduce(cring__shm_t *shm, int rank, int size, const void *send,
                                    void *recv, size_t count, cring_dtype_t dtype, cring_op_t op);
/* One tensor of a multi-tensor allreduce: count elements from send into
 * recv (send == recv in place). offset is filled by the callee. */
typedef struct cring__seg {
    const void *send;
    void *recv;
    size_t count;
    size_t offset;
} cring__seg_t;
/* (algo/shm_multi.c) Allreduce every segment's tensor at once, the windows
 * serving as the fusion buffer: the same result, counters and window use
 * as cring__shm_allreduce over the tensors laid end to end, without
 * copying them into one buffer first. nsegs >= 0; all of one dtype. */
cring_status_t cring__shm_allreduce_multi(cring__shm_t *shm, int rank, int size, cring__seg_t *segs,
                                          int nsegs, cring_dtype_t dtype, cring_op_t op);
cring_status_t cring__shm_reducescatter(cring__shm_t *shm, int rank, int size, const void *send,
                                        void *recv, const size_t *counts, cring_dtype_t dtype,
                                        cring_op_t op);
cring_status_t cring__shm_allgatherv(cring__shm_t *shm, int rank, int size, const void *send,
                                     size_t send_bytes, void *recv, const size_t *recv_bytes);
cring_status_t cring__shm_broadcast(cring__shm_t *shm, int rank, int size, void *buf, size_t nbytes,
                                    int root);
cring_status_t cring__shm_barrier(cring__shm_t *shm);
/* Alltoallv with the matrix convention of cring__p2p_alltoallv. */
cring_status_t cring__shm_alltoallv(cring__shm_t *shm, int rank, int size, const void *send,
                                    void *recv, const size_t *matrix);
/* Every rank contributes `bytes` (each rank its own length, up to
 * cring__shm_gather_small_max) and gets a pointer to every rank's bytes,
 * valid until this rank's next collective: one exchange. ptrs_out[rank] is
 * `mine` itself. lens_out (may be NULL) receives every rank's length. */
cring_status_t cring__shm_gather_small(cring__shm_t *shm, int rank, int size, const void *mine,
                                       size_t bytes, const void **ptrs_out, size_t *lens_out);
size_t cring__shm_gather_small_max(const cring__shm_t *shm, int size);

/* ---- in place over mapped buffers (algo/shm_inplace.c) --------------------- */
/* Allreduce `count` elements at byte `offset` of every rank's mapped buffer
 * (data[q]: rank q's buffer in this process; headers[q]: 32 bytes of rank q's
 * own, never used for data), the result in place in every rank's buffer.
 * Every rank checks that all passed the same offset, count, dtype and op:
 * ERR_MISMATCH on every rank if not. The segment's counters order it with
 * the other shm collectives; returns after every peer finished reading this
 * rank's buffer. */
cring_status_t cring__shm_allreduce_mapped(cring__shm_t *shm, int rank, int size,
                                           unsigned char *const *data, void *const *headers,
                                           size_t offset, size_t count, cring_dtype_t dtype,
                                           cring_op_t op);

#endif /* CRING_ALGO_H */

/* shm_inplace.c: allreduce over buffers every rank of a host has mapped (the
 * shared regions of transport/shm_region.c): peers' data is read where it
 * lies and results are written in place, with no copy through the windows.
 * Pure index math over pointers and the segment's counters; no mapping here. */
#include <string.h>

#include "../reduce/reduce.h"
#include "algo.h"
#include "shm_layout.h"

/* Bytes per round (all slices together; SHM_P_INPLACE_ROUND): a round's
 * slices stay in the shared L3 between the owner's reduction and the peers'
 * copies. From SHM_P_INPLACE_STREAM bytes per copy on, copies stream. */

static size_t ceil_div(size_t a, size_t b) { return (a + b - 1) / b; }

/* What every rank writes into its header before the data moves, so that
 * every rank can check that all of them reduce the same place. */
typedef struct {
    uint64_t seq, offset, count, kind;
} inplace_desc_t;

/*
 * In-place allreduce over mapped buffers: data[q] is rank q's region as
 * this process sees it (the same offset in every rank's region), headers[q]
 * its descriptor line.
 *
 *   0  every rank writes {counter, offset, count, dtype/op} into its header
 *      and publishes base+1; after waiting for all, each compares all the
 *      descriptors (the same check on every rank: a mismatch is the same
 *      error everywhere, with the counters still in step)
 *   k  round k (bytes [k*R, (k+1)*R) of the buffer, cut into `size` slices):
 *      the owner of slice q reduces data[0..size-1] slice q into its own
 *      data[q] slice q, publishes base+2+k, then copies every other owner's
 *      reduced slice of round k out of that owner's buffer into its own
 *   end publish base+2+rounds and wait for all: nobody's buffer changes
 *      (the caller's post-scaling, the next backward) while a peer reads it
 *
 * Per rank and byte: read ~1.5, written ~1 (no copy in, no copy out). Every
 * result is computed once, by its owner, so all ranks hold identical bits.
 */
cring_status_t cring__shm_allreduce_mapped(cring__shm_t *shm, int rank, int size,
                                           unsigned char *const *data, void *const *headers,
                                           size_t offset, size_t count, cring_dtype_t dtype,
                                           cring_op_t op) {
    const size_t es = cring_dtype_size(dtype);
    if (size == 1 || count == 0) return CRING_OK;
    if (size > MAX_STACK_RANKS) return CRING_ERR_INVALID_ARGUMENT;
    const uint64_t base = cring__shm_seq(shm);
    CRING_CHECK(cring__shm_wait_all(shm, base)); /* peers are done reading our header */
    inplace_desc_t mine = {base, offset, count, (uint64_t)dtype | (uint64_t)op << 16};
    memcpy(headers[rank], &mine, sizeof mine);
    cring__shm_publish(shm, base + 1);
    CRING_CHECK(cring__shm_wait_all(shm, base + 1));
    int agree = 1;
    for (int q = 0; q < size; q++) {
        inplace_desc_t d;
        memcpy(&d, headers[q], sizeof d);
        agree &= memcmp(&d, &mine, sizeof d) == 0;
    }
    if (!agree) {
        /* every rank saw the same descriptors: all fail here alike; the last
         * publish lets each re-use its header for the next collective */
        cring__shm_publish(shm, base + 2);
        CRING_CHECK(cring__shm_wait_all(shm, base + 2));
        return CRING_ERR_MISMATCH;
    }
    const size_t al = es >= CRING_CACHE_LINE ? 1 : CRING_CACHE_LINE / es;
    const size_t chunk = CRING_MAX(shm_param(shm, SHM_P_INPLACE_ROUND) / es / al, 1) * al;
    const size_t stream_min = shm_param(shm, SHM_P_INPLACE_STREAM);
    const size_t rounds = ceil_div(count, chunk);
    const void *srcs[MAX_STACK_RANKS];
    unsigned char *buf[MAX_STACK_RANKS]; /* every rank's buffer, at the offset */
    for (int q = 0; q < size; q++) buf[q] = data[q] + offset;
    for (size_t k = 0; k < rounds; k++) {
        const size_t off = k * chunk, n = CRING_MIN(chunk, count - off);
        const size_t s = ceil_div(ceil_div(n, (size_t)size), al) * al;
        size_t lo = CRING_MIN((size_t)rank * s, n), hi = CRING_MIN(lo + s, n);
        if (hi > lo) {
            for (int q = 0; q < size; q++) srcs[q] = buf[q] + (off + lo) * es;
            cring__reduce_multi(dtype, op, buf[rank] + (off + lo) * es, (const void *const *)srcs,
                                size, hi - lo, size);
        }
        cring__shm_publish(shm, base + 2 + k);
        for (int i = 1; i < size; i++) {
            int q = (rank + i) % size; /* spread readers over different owners */
            size_t qlo = CRING_MIN((size_t)q * s, n), qhi = CRING_MIN(qlo + s, n);
            CRING_CHECK(cring__shm_wait(shm, q, base + 2 + k));
            if (qhi <= qlo) continue;
            size_t bytes = (qhi - qlo) * es;
            unsigned char *dst = buf[rank] + (off + qlo) * es;
            const unsigned char *src = buf[q] + (off + qlo) * es;
            if (bytes >= stream_min) cring__copy_stream(dst, src, bytes);
            else memcpy(dst, src, bytes);
        }
    }
    cring__shm_publish(shm, base + 2 + rounds);
    return cring__shm_wait_all(shm, base + 2 + rounds);
}

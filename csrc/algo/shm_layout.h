/* shm_layout.h: the round and slice layout that the owner-slice allreduces
 * over the shared-memory windows share (shm_coll.c for one buffer,
 * shm_multi.c for many tensors laid end to end). Both must use the same
 * sizes so that a fused batch moves exactly as a single buffer would; this
 * header is for csrc/algo only. */
#ifndef CRING_ALGO_SHM_LAYOUT_H
#define CRING_ALGO_SHM_LAYOUT_H

#include "algo.h"

#define MAX_STACK_RANKS 64

/* The sizes the algorithms work in, rank 0's choice (shm_tune.c: derived
 * from the caches, CRING_SHM_* overrides), read from the segment so that
 * every rank cuts rounds and slices alike. Indices into the transport's
 * parameters: */
enum {
    /* Bytes per round of the owner-slice allreduce, allgather and broadcast
     * (at most a window half): both halves of this rank's window and of
     * the peer's stay in the core's L2 between writes and reads. */
    SHM_P_ROUND,
    /* At or below this many bytes, allreduce uses one exchange in which
     * every rank reduces the whole message itself (fewer synchronisations). */
    SHM_P_SMALL,
    /* The owner reduces its slice in blocks of this many bytes and copies
     * each block out while it is in L1, instead of re-reading the slice. */
    SHM_P_BLOCK,
    /* From this many output bytes on, copies into user buffers use streaming
     * stores: such outputs do not stay in this core's share of the L3
     * anyway, and streaming saves the read-for-ownership. */
    SHM_P_STREAM,
    /* shm_inplace.c: bytes per round over mapped buffers, and the copy size
     * from which its copies stream. */
    SHM_P_INPLACE_ROUND,
    SHM_P_INPLACE_STREAM,
};

/* What a segment made without parameters (zeros) uses: the sizes cring
 * used before they were derived from the machine. */
static inline size_t shm_param(const cring__shm_t *shm, int which) {
    static const size_t fallback[] = {256u << 10, 16u << 10, 32u << 10,
                                      1u << 20,   4u << 20,  256u << 10};
    uint64_t v = cring__shm_params(shm)[which];
    return v ? (size_t)v : fallback[which];
}

static inline size_t shm_ceil_div(size_t a, size_t b) { return (a + b - 1) / b; }

/* Elements per cache line, so slices start on cache-line boundaries. */
static inline size_t shm_align_elems(size_t esize) {
    return esize >= CRING_CACHE_LINE ? 1 : CRING_CACHE_LINE / esize;
}

static inline size_t shm_round_bytes(cring__shm_t *shm) {
    return CRING_MIN(cring__shm_window_bytes(shm) / 2, shm_param(shm, SHM_P_ROUND));
}

/* The window half used by round k of a collective entered at counter value
 * `base` is (base + k) % 2: consecutive collectives start on alternating
 * halves (see shm_coll.c's file comment). */
static inline unsigned char *shm_half_of(cring__shm_t *shm, int peer, uint64_t base_plus_round) {
    size_t half = cring__shm_window_bytes(shm) / 2;
    return (unsigned char *)cring__shm_window(shm, peer) + (base_plus_round & 1) * half;
}

#endif

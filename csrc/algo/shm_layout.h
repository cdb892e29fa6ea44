/* shm_layout.h: the round and slice layout that the owner-slice allreduces
 * over the shared-memory windows share (shm_coll.c for one buffer,
 * shm_multi.c for many tensors laid end to end). Both must use the same
 * sizes so that a fused batch moves exactly as a single buffer would; this
 * header is for csrc/algo only. */
#ifndef CRING_ALGO_SHM_LAYOUT_H
#define CRING_ALGO_SHM_LAYOUT_H

#include "algo.h"

#define MAX_STACK_RANKS 64
/* At or below this many bytes per rank, allreduce uses one exchange in which
 * every rank reduces the whole message itself (fewer synchronisations). */
#define SMALL_ALLREDUCE_BYTES (16u << 10)
/* Bytes per round (at most a window half): small enough that a round's
 * window data stays in L2 while the peer reads it and that ranks overlap;
 * 128 KiB to 2 MiB measured within noise on 2 ranks, 2 MiB slightly worse. */
#define ROUND_BYTES (256u << 10)
/* The owner reduces its slice in blocks of this many bytes and copies each
 * block out while it is in L1, instead of re-reading the slice afterwards. */
#define REDUCE_BLOCK_BYTES (32u << 10)
/* From this many output bytes on, copies into user buffers use streaming
 * stores: such outputs are mostly not in cache and not read again at once,
 * and streaming saves the read-for-ownership. */
#define STREAM_MIN_BYTES (1u << 20)

static inline size_t shm_ceil_div(size_t a, size_t b) { return (a + b - 1) / b; }

/* Elements per cache line, so slices start on cache-line boundaries. */
static inline size_t shm_align_elems(size_t esize) {
    return esize >= CRING_CACHE_LINE ? 1 : CRING_CACHE_LINE / esize;
}

static inline size_t shm_round_bytes(cring__shm_t *shm) {
    return CRING_MIN(cring__shm_window_bytes(shm) / 2, ROUND_BYTES);
}

/* The window half used by round k of a collective entered at counter value
 * `base` is (base + k) % 2: consecutive collectives start on alternating
 * halves (see shm_coll.c's file comment). */
static inline unsigned char *shm_half_of(cring__shm_t *shm, int peer, uint64_t base_plus_round) {
    size_t half = cring__shm_window_bytes(shm) / 2;
    return (unsigned char *)cring__shm_window(shm, peer) + (base_plus_round & 1) * half;
}

#endif

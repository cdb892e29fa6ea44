/* shm_multi.c: the owner-slice allreduce of many tensors at once over the
 * shared-memory windows, with the windows as the fusion buffer: each tensor
 * is copied straight into, and its result straight out of, the windows
 * (no staging copy). Index math, memcpy and reduce kernels only; the
 * transport owns mapping, counters and waiting (transport/shm.c).
 *
 * The tensors are laid end to end as one virtual message of sum(counts)
 * elements; the rounds, slices, counter values and window halves are
 * exactly those of cring__shm_allreduce (shm_coll.c) on that message, so the
 * two keep the same invariants between consecutive collectives: the small
 * form publishes once (base+1); the large form publishes base+3k+1..3 in
 * round k and rewrites a half only after every rank read it two rounds ago.
 * The difference is only where a round's pieces come from and go to: a
 * range of the virtual message maps to pieces of one or more tensors. */
#include <string.h>

#include "../reduce/reduce.h"
#include "algo.h"
#include "shm_layout.h"

/* The same sizes and window halves as shm_coll.c's allreduce: shm_layout.h. */
/* The first segment whose elements reach past virtual element v. */
static int seg_at(const cring__seg_t *segs, int nsegs, size_t v) {
    int lo = 0, hi = nsegs - 1;
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (segs[mid].offset + segs[mid].count <= v) lo = mid + 1;
        else hi = mid;
    }
    return lo;
}

/* A piece: elements [v, v+n) of the virtual message are elements [e, e+n)
 * of segment i. Walk the pieces of [lo, hi) in order. */
typedef struct piece {
    int i;
    size_t v, e, n;
} piece_t;

static int first_piece(const cring__seg_t *segs, int nsegs, size_t lo, size_t hi, piece_t *p) {
    if (lo >= hi) return 0;
    p->i = seg_at(segs, nsegs, lo);
    while (p->i < nsegs && segs[p->i].count == 0) p->i++;
    p->v = lo;
    p->e = lo - segs[p->i].offset;
    p->n = CRING_MIN(segs[p->i].count - p->e, hi - lo);
    return 1;
}

static int next_piece(const cring__seg_t *segs, int nsegs, size_t hi, piece_t *p) {
    p->v += p->n;
    if (p->v >= hi) return 0;
    do p->i++;
    while (p->i < nsegs && segs[p->i].count == 0);
    p->e = 0;
    p->n = CRING_MIN(segs[p->i].count, hi - p->v);
    return 1;
}

#define FOR_PIECES(p, segs, nsegs, lo, hi)                                                         \
    for (int more_ = first_piece(segs, nsegs, lo, hi, &(p)); more_;                                \
         more_ = next_piece(segs, nsegs, hi, &(p)))

/* Copy virtual elements [lo, hi) of the inputs to dst (contiguous). */
static void gather_in(const cring__seg_t *segs, int nsegs, size_t es, size_t lo, size_t hi,
                      unsigned char *dst) {
    piece_t p;
    FOR_PIECES(p, segs, nsegs, lo, hi) {
        memcpy(dst + (p.v - lo) * es, (const unsigned char *)segs[p.i].send + p.e * es, p.n * es);
    }
}

/* Copy src (contiguous, virtual elements [lo, hi)) into the outputs. */
static void scatter_out(const cring__seg_t *segs, int nsegs, size_t es, size_t lo, size_t hi,
                        const unsigned char *src, int stream) {
    piece_t p;
    FOR_PIECES(p, segs, nsegs, lo, hi) {
        unsigned char *dst = (unsigned char *)segs[p.i].recv + p.e * es;
        const unsigned char *from = src + (p.v - lo) * es;
        if (stream && segs[p.i].send != segs[p.i].recv) cring__copy_stream(dst, from, p.n * es);
        else memcpy(dst, from, p.n * es);
    }
}

/*
 * Small form (the whole message at most SHM_P_SMALL bytes and a window
 * half): every rank gathers its inputs into its half base % 2 (publish
 * base+1), waits for all, and reduces every piece itself from all `size`
 * inputs in rank order, straight into the outputs.
 */
static cring_status_t small_multi(cring__shm_t *shm, int rank, int size, uint64_t base,
                                  const cring__seg_t *segs, int nsegs, size_t total,
                                  cring_dtype_t dtype, cring_op_t op) {
    const size_t es = cring_dtype_size(dtype);
    const void *srcs[MAX_STACK_RANKS];
    gather_in(segs, nsegs, es, 0, total, shm_half_of(shm, rank, base));
    cring__shm_publish(shm, base + 1);
    CRING_CHECK(cring__shm_wait_all(shm, base + 1));
    piece_t p;
    FOR_PIECES(p, segs, nsegs, 0, total) {
        for (int q = 0; q < size; q++)
            srcs[q] = q == rank ? (const unsigned char *)segs[p.i].send + p.e * es
                                : shm_half_of(shm, q, base) + p.v * es;
        cring__reduce_multi(dtype, op, (unsigned char *)segs[p.i].recv + p.e * es,
                            (const void *const *)srcs, size, p.n, size);
    }
    return CRING_OK;
}

/* The owner's step of a round: reduce virtual elements [lo, hi) (round-
 * relative offsets; the round starts at virtual element `off`) from its own
 * inputs and every peer's half into its own half, piece by piece, and copy
 * each piece into its output while it is in L1. */
static void reduce_own(cring__shm_t *shm, int rank, int size, uint64_t round,
                       const cring__seg_t *segs, int nsegs, size_t off, size_t lo, size_t hi,
                       cring_dtype_t dtype, cring_op_t op, int stream) {
    const size_t es = cring_dtype_size(dtype);
    unsigned char *mine = shm_half_of(shm, rank, round);
    const void *srcs[MAX_STACK_RANKS];
    piece_t p;
    FOR_PIECES(p, segs, nsegs, off + lo, off + hi) {
        size_t w = (p.v - off) * es; /* offset in the window halves */
        int k = 0;
        srcs[k++] = (const unsigned char *)segs[p.i].send + p.e * es;
        for (int q = 0; q < size; q++)
            if (q != rank) srcs[k++] = shm_half_of(shm, q, round) + w;
        cring__reduce_multi(dtype, op, mine + w, (const void *const *)srcs, size, p.n, size);
        unsigned char *dst = (unsigned char *)segs[p.i].recv + p.e * es;
        if (stream && segs[p.i].send != segs[p.i].recv) cring__copy_stream(dst, mine + w, p.n * es);
        else memcpy(dst, mine + w, p.n * es);
    }
}

/*
 * Large form: the rounds of cring__shm_allreduce over the virtual message.
 * Round k covers virtual elements [k*chunk, k*chunk + n), cut into `size`
 * slices of s elements (cache-line aligned), slice q owned by rank q:
 *
 *   A  every rank gathers its inputs for the slices it does not own into
 *      its window half (base+k) % 2                   (publish base+3k+1)
 *   B  the owner reduces its slice from its own inputs and every peer's
 *      half into its own half and its outputs, piece by piece (base+3k+2)
 *   C  every rank copies the other owners' results from their halves into
 *      its outputs                                    (publish base+3k+3)
 *
 * In place works as in shm_coll.c: every input element is read in A or B
 * before C writes its output.
 */
cring_status_t cring__shm_allreduce_multi(cring__shm_t *shm, int rank, int size, cring__seg_t *segs,
                                          int nsegs, cring_dtype_t dtype, cring_op_t op) {
    const size_t es = cring_dtype_size(dtype);
    size_t total = 0;
    for (int i = 0; i < nsegs; i++) {
        segs[i].offset = total;
        total += segs[i].count;
    }
    if (size == 1) {
        for (int i = 0; i < nsegs; i++)
            if (segs[i].send != segs[i].recv)
                memcpy(segs[i].recv, segs[i].send, segs[i].count * es);
        return CRING_OK;
    }
    const size_t half = cring__shm_window_bytes(shm) / 2;
    const size_t chunk = shm_round_bytes(shm) / es;
    const size_t al = shm_align_elems(es);
    const size_t block = CRING_MAX(shm_param(shm, SHM_P_BLOCK) / es / al, 1) * al;
    const int stream = total * es >= shm_param(shm, SHM_P_STREAM);
    const uint64_t base = cring__shm_seq(shm);
    const size_t rounds = shm_ceil_div(total, chunk);
    CRING_CHECK(cring__shm_wait_all(shm, base));
    if (total * es <= CRING_MIN(shm_param(shm, SHM_P_SMALL), half))
        return small_multi(shm, rank, size, base, segs, nsegs, total, dtype, op);
    for (size_t k = 0; k < rounds; k++) {
        const size_t off = k * chunk, n = CRING_MIN(chunk, total - off);
        const size_t s = shm_ceil_div(shm_ceil_div(n, (size_t)size), al) * al;
        unsigned char *mine = shm_half_of(shm, rank, base + k);
        if (k >= 2) CRING_CHECK(cring__shm_wait_all(shm, base + 3 * (k - 2) + 3));
        for (int q = 0; q < size; q++) {
            size_t lo = CRING_MIN((size_t)q * s, n), hi = CRING_MIN(lo + s, n);
            if (q != rank && hi > lo)
                gather_in(segs, nsegs, es, off + lo, off + hi, mine + lo * es);
        }
        cring__shm_publish(shm, base + 3 * k + 1);
        CRING_CHECK(cring__shm_wait_all(shm, base + 3 * k + 1));
        size_t lo = CRING_MIN((size_t)rank * s, n), hi = CRING_MIN(lo + s, n);
        for (size_t b = lo; b < hi; b += block)
            reduce_own(shm, rank, size, base + k, segs, nsegs, off, b, CRING_MIN(b + block, hi),
                       dtype, op, stream);
        cring__shm_publish(shm, base + 3 * k + 2);
        for (int i = 1; i < size; i++) {
            int q = (rank + i) % size; /* spread readers over different windows */
            size_t qlo = CRING_MIN((size_t)q * s, n), qhi = CRING_MIN(qlo + s, n);
            CRING_CHECK(cring__shm_wait(shm, q, base + 3 * k + 2));
            if (qhi > qlo)
                scatter_out(segs, nsegs, es, off + qlo, off + qhi,
                            shm_half_of(shm, q, base + k) + qlo * es, stream);
        }
        cring__shm_publish(shm, base + 3 * k + 3);
    }
    return CRING_OK;
}

/* shm_coll.c: collectives for ranks on one host, over the shared-memory
 * windows of transport/shm.c. Pure index math plus memcpy and the reduce
 * kernels; the transport owns mapping, counters and waiting.
 *
 * Each rank's progress counter advances by the same amount on every rank,
 * so the values to wait for are plain arithmetic on the counter at entry
 * ("base"). Windows are split in two halves; round k of a collective uses
 * half (base + k) % 2. Before its first write a collective waits until every
 * peer has reached `base`. Every algorithm but the small allreduce publishes
 * its last value only after its last read, so the windows are free then; the
 * small allreduce publishes once, before reading, and is safe because the
 * next collective's round 0 writes the other half, and its round 1 (the
 * small allreduce's half) comes only after every peer has published round
 * 0, which it does after finishing its reads. Within a collective the
 * halves double-buffer: round k rewrites a half only after every rank
 * finished reading it in round k-2. */
#include <string.h>

#include "../reduce/reduce.h"
#include "algo.h"
#include "shm_layout.h"

/* Window sizes, rounds and slices: shm_layout.h (shared with shm_multi.c). */
/* Copy into a user buffer, streaming or not (see SHM_P_STREAM). */
static void copy_out(void *dst, const void *src, size_t n, int stream) {
    if (stream) cring__copy_stream(dst, src, n);
    else memcpy(dst, src, n);
}

/* Reduce this rank's slice [lo, lo+n) (element offsets into a window half
 * and into `mine`) from its own input plus every peer's window half, into
 * dst. */
static void reduce_slice(cring__shm_t *shm, int rank, int size, uint64_t round,
                         const unsigned char *mine, size_t win_off_bytes, void *dst, size_t n,
                         cring_dtype_t dtype, cring_op_t op) {
    const void *stack_srcs[MAX_STACK_RANKS];
    const void **srcs = stack_srcs; /* size <= MAX_STACK_RANKS is checked by the comm */
    int k = 0;
    srcs[k++] = mine;
    for (int q = 0; q < size; q++)
        if (q != rank) srcs[k++] = shm_half_of(shm, q, round) + win_off_bytes;
    cring__reduce_multi(dtype, op, dst, (const void *const *)srcs, size, n, size);
}

/*
 * Small allreduce: every rank copies its input into its window half
 * base % 2 (publish base+1), waits for all, and reduces all `size` inputs
 * itself, in rank order so every rank computes bit-identical results. It
 * publishes nothing after reading: the next collective starts on the other
 * half, and peers publish again only once they have finished reading this
 * one, so one publish per small allreduce is enough.
 */
static cring_status_t small_allreduce(cring__shm_t *shm, int rank, int size, uint64_t base,
                                      const void *send, void *recv, size_t count,
                                      cring_dtype_t dtype, cring_op_t op) {
    const size_t bytes = count * cring_dtype_size(dtype);
    const void *srcs[MAX_STACK_RANKS];
    memcpy(shm_half_of(shm, rank, base), send, bytes);
    cring__shm_publish(shm, base + 1);
    CRING_CHECK(cring__shm_wait_all(shm, base + 1));
    for (int q = 0; q < size; q++) srcs[q] = q == rank ? send : shm_half_of(shm, q, base);
    cring__reduce_multi(dtype, op, recv, (const void *const *)srcs, size, count, size);
    return CRING_OK;
}

/*
 * Owner-slice allreduce. The message is cut into rounds (SHM_P_ROUND, at
 * most a window half); each round's elements are cut into `size` slices,
 * slice q owned by rank q. Rounds pipeline: a rank starts round k+1 while
 * peers still copy results out of round k (halves alternate).
 *
 *   A  every rank copies its input for the slices it does not own into its
 *      window half                                   (publish base+3k+1)
 *   B  the owner of slice q reduces its own input with slice q of every other
 *      rank's half, writes the result into slice q of its own half and of its
 *      output, block by block                         (publish base+3k+2)
 *   C  every rank copies the other owners' results out of their halves
 *                                                     (publish base+3k+3)
 *
 * Per rank and byte: read ~2, written ~2, which is close to a memcpy. In place
 * (send == recv) works: input slices are read in A or B before C overwrites.
 */
cring_status_t cring__shm_allreduce(cring__shm_t *shm, int rank, int size, const void *send,
                                    void *recv, size_t count, cring_dtype_t dtype, cring_op_t op) {
    const size_t es = cring_dtype_size(dtype);
    const unsigned char *in = send;
    unsigned char *out = recv;
    if (size == 1) {
        if (send != recv) memcpy(recv, send, count * es);
        return CRING_OK;
    }
    const size_t half = cring__shm_window_bytes(shm) / 2;
    const size_t chunk = shm_round_bytes(shm) / es;
    const size_t al = shm_align_elems(es);
    const size_t block = CRING_MAX(shm_param(shm, SHM_P_BLOCK) / es / al, 1) * al;
    /* In place, every output line was just read as input and is still
     * cached: plain stores are cheaper then. */
    const int stream = send != recv && count * es >= shm_param(shm, SHM_P_STREAM);
    const uint64_t base = cring__shm_seq(shm);
    const size_t rounds = shm_ceil_div(count, chunk);
    CRING_CHECK(cring__shm_wait_all(shm, base));
    if (count * es <= CRING_MIN(shm_param(shm, SHM_P_SMALL), half))
        return small_allreduce(shm, rank, size, base, send, recv, count, dtype, op);
    for (size_t k = 0; k < rounds; k++) {
        const size_t off = k * chunk, n = CRING_MIN(chunk, count - off);
        const size_t s = shm_ceil_div(shm_ceil_div(n, (size_t)size), al) * al;
        unsigned char *mine = shm_half_of(shm, rank, base + k);
        if (k >= 2) CRING_CHECK(cring__shm_wait_all(shm, base + 3 * (k - 2) + 3));
        for (int q = 0; q < size; q++) {
            size_t lo = CRING_MIN((size_t)q * s, n), hi = CRING_MIN(lo + s, n);
            if (q != rank && hi > lo) memcpy(mine + lo * es, in + (off + lo) * es, (hi - lo) * es);
        }
        cring__shm_publish(shm, base + 3 * k + 1);
        CRING_CHECK(cring__shm_wait_all(shm, base + 3 * k + 1));
        /* Reduce the own slice block by block and copy each block out while
         * it is still in L1, instead of re-reading the whole slice. */
        size_t lo = CRING_MIN((size_t)rank * s, n), hi = CRING_MIN(lo + s, n);
        for (size_t b = lo; b < hi; b += block) {
            size_t m = CRING_MIN(block, hi - b);
            reduce_slice(shm, rank, size, base + k, in + (off + b) * es, b * es, mine + b * es, m,
                         dtype, op);
            copy_out(out + (off + b) * es, mine + b * es, m * es, stream);
        }
        cring__shm_publish(shm, base + 3 * k + 2);
        for (int i = 1; i < size; i++) {
            int q = (rank + i) % size; /* spread readers over different windows */
            size_t qlo = CRING_MIN((size_t)q * s, n), qhi = CRING_MIN(qlo + s, n);
            CRING_CHECK(cring__shm_wait(shm, q, base + 3 * k + 2));
            if (qhi > qlo)
                copy_out(out + (off + qlo) * es, shm_half_of(shm, q, base + k) + qlo * es,
                         (qhi - qlo) * es, stream);
        }
        cring__shm_publish(shm, base + 3 * k + 3);
    }
    return CRING_OK;
}

/*
 * Owner-slice reduce-scatter with uneven slices (counts[q] elements for rank
 * q, laid out one after another in send). Each round moves a piece of up to E
 * elements of every slice; rank r's window half holds, at offset q*E, its
 * input for slice q (q != r).
 *
 *   A  copy pieces of the slices owned by others into the half  (base+2k+1)
 *   B  reduce own piece from own input + every peer's half      (base+2k+2)
 */
cring_status_t cring__shm_reducescatter(cring__shm_t *shm, int rank, int size, const void *send,
                                        void *recv, const size_t *counts, cring_dtype_t dtype,
                                        cring_op_t op) {
    const size_t es = cring_dtype_size(dtype);
    const unsigned char *in = send;
    unsigned char *out = recv;
    size_t offs[MAX_STACK_RANKS + 1], max_count = 0;
    offs[0] = 0;
    for (int q = 0; q < size; q++) {
        offs[q + 1] = offs[q] + counts[q];
        max_count = CRING_MAX(max_count, counts[q]);
    }
    if (size == 1) {
        memcpy(recv, send, counts[0] * es);
        return CRING_OK;
    }
    const size_t al = shm_align_elems(es);
    size_t piece = cring__shm_window_bytes(shm) / 2 / ((size_t)size * es) / al * al;
    if (piece == 0) piece = 1;
    const uint64_t base = cring__shm_seq(shm);
    const size_t rounds = shm_ceil_div(max_count, piece);
    CRING_CHECK(cring__shm_wait_all(shm, base));
    for (size_t k = 0; k < rounds; k++) {
        const size_t lo = k * piece;
        unsigned char *mine = shm_half_of(shm, rank, base + k);
        if (k >= 2) CRING_CHECK(cring__shm_wait_all(shm, base + 2 * (k - 2) + 2));
        for (int q = 0; q < size; q++) {
            if (q == rank || counts[q] <= lo) continue;
            size_t n = CRING_MIN(piece, counts[q] - lo);
            memcpy(mine + (size_t)q * piece * es, in + (offs[q] + lo) * es, n * es);
        }
        cring__shm_publish(shm, base + 2 * k + 1);
        CRING_CHECK(cring__shm_wait_all(shm, base + 2 * k + 1));
        if (counts[rank] > lo) {
            size_t n = CRING_MIN(piece, counts[rank] - lo);
            reduce_slice(shm, rank, size, base + k, in + (offs[rank] + lo) * es,
                         (size_t)rank * piece * es, out + lo * es, n, dtype, op);
        }
        cring__shm_publish(shm, base + 2 * k + 2);
    }
    return CRING_OK;
}

/*
 * Allgather with per-rank sizes. Round k: every rank copies the k-th round's
 * worth of its own block into its half (publish base+2k+1) and from there,
 * while it is in cache, into its own place in the output (unless in place),
 * so the input is read from memory once; every rank copies each peer's piece
 * out as soon as that peer has published, then publishes base+2k+2 so the
 * half can be reused two rounds later.
 */
cring_status_t cring__shm_allgatherv(cring__shm_t *shm, int rank, int size, const void *send,
                                     size_t send_bytes, void *recv, const size_t *recv_bytes) {
    unsigned char *out = recv;
    const unsigned char *in = send;
    size_t offs[MAX_STACK_RANKS + 1], max_bytes = 0;
    offs[0] = 0;
    for (int q = 0; q < size; q++) {
        offs[q + 1] = offs[q] + recv_bytes[q];
        max_bytes = CRING_MAX(max_bytes, recv_bytes[q]);
    }
    const int stream = offs[size] >= shm_param(shm, SHM_P_STREAM);
    const int own_copy = send != out + offs[rank] && send_bytes;
    if (size == 1) {
        if (own_copy) memcpy(out, send, send_bytes);
        return CRING_OK;
    }
    const size_t piece = shm_round_bytes(shm);
    const uint64_t base = cring__shm_seq(shm);
    const size_t rounds = shm_ceil_div(max_bytes, piece);
    CRING_CHECK(cring__shm_wait_all(shm, base));
    for (size_t k = 0; k < rounds; k++) {
        const size_t lo = k * piece;
        unsigned char *mine = shm_half_of(shm, rank, base + k);
        if (k >= 2) CRING_CHECK(cring__shm_wait_all(shm, base + 2 * (k - 2) + 2));
        if (send_bytes > lo) {
            size_t n = CRING_MIN(piece, send_bytes - lo);
            memcpy(mine, in + lo, n);
            cring__shm_publish(shm, base + 2 * k + 1);
            if (own_copy) copy_out(out + offs[rank] + lo, mine, n, stream);
        } else {
            cring__shm_publish(shm, base + 2 * k + 1);
        }
        for (int i = 1; i < size; i++) {
            int q = (rank + i) % size; /* spread readers over different windows */
            CRING_CHECK(cring__shm_wait(shm, q, base + 2 * k + 1));
            if (recv_bytes[q] > lo)
                copy_out(out + offs[q] + lo, shm_half_of(shm, q, base + k),
                         CRING_MIN(piece, recv_bytes[q] - lo), stream);
        }
        cring__shm_publish(shm, base + 2 * k + 2);
    }
    return CRING_OK;
}

/*
 * Broadcast: the root streams the buffer through its window halves in pieces
 * of a round (SHM_P_ROUND), so readers copy piece k out while the root copies piece
 * k+1 in; round k the root copies piece k in (publish base+2k+1 and +2),
 * readers copy it out and publish base+2k+2; the root reuses a half once
 * every reader published its round k-2.
 */
cring_status_t cring__shm_broadcast(cring__shm_t *shm, int rank, int size, void *buf, size_t nbytes,
                                    int root) {
    if (size == 1) return CRING_OK;
    unsigned char *data = buf;
    const size_t half = shm_round_bytes(shm);
    const int stream = nbytes >= shm_param(shm, SHM_P_STREAM);
    const uint64_t base = cring__shm_seq(shm);
    const size_t rounds = shm_ceil_div(nbytes, half);
    if (rank == root) CRING_CHECK(cring__shm_wait_all(shm, base));
    for (size_t k = 0; k < rounds; k++) {
        const size_t lo = k * half, n = CRING_MIN(half, nbytes - lo);
        if (rank == root) {
            /* round 1 reuses the half the previous collective may have used:
             * wait until every reader has entered this one */
            if (k == 1) CRING_CHECK(cring__shm_wait_all(shm, base + 1));
            if (k >= 2) CRING_CHECK(cring__shm_wait_all(shm, base + 2 * (k - 2) + 2));
            memcpy(shm_half_of(shm, root, base + k), data + lo, n);
            cring__shm_publish(shm, base + 2 * k + 1);
        } else {
            CRING_CHECK(cring__shm_wait(shm, root, base + 2 * k + 1));
            copy_out(data + lo, shm_half_of(shm, root, base + k), n, stream);
        }
        cring__shm_publish(shm, base + 2 * k + 2);
    }
    return CRING_OK;
}

/*
 * Gather small blocks. A reader that polls a peer's counter and then reads
 * its window pays two cross-core misses in a row; that second miss was a
 * fifth of a small engine round. So blocks go as flagged lines: each cache
 * line at the start of the window half holds a flag (the counter value this
 * collective publishes, mixed with the segment's random key so that other
 * collectives' data never reads as a flag; written last, with release
 * ordering) and 56 bytes
 * of [8-byte length | block]; a reader polls the lines themselves and gets
 * flag and data in one transfer. The first line always carries the length.
 * A block longer than fits the lines goes whole to the half's bulk area
 * (the first line's flag then covers it) and is read in place. Blocks read
 * from lines are copied into this rank's scratch area, part of its own half
 * that nobody else writes, so every pointer stays valid until this rank's
 * next collective, which starts on the other half. The counter is published
 * as usual (waits that park, the next collective's first wait), and a peer
 * whose flag was seen is known to have reached it. A wait past the spin
 * budget goes through cring__shm_wait (parking, liveness, time-out).
 *
 * Half layout, the same on every rank (it depends only on the half size and
 * the rank count): [lines | scratch: size x (lines_max + 8) | bulk].
 */
#define LINES_MAX_BYTES 2048
#define LINE_DATA (CRING_CACHE_LINE - 8)

static size_t line_count(size_t bytes) { return shm_ceil_div(bytes + 8, LINE_DATA); }

typedef struct {
    size_t lines_max; /* the longest block that travels in lines */
    size_t scratch;   /* offsets in the half */
    size_t bulk;
} lines_layout_t;

static lines_layout_t lines_layout(size_t half, int size) {
    lines_layout_t l;
    for (l.lines_max = LINES_MAX_BYTES;; l.lines_max /= 2) {
        l.scratch = line_count(l.lines_max) * CRING_CACHE_LINE;
        l.bulk = l.scratch +
                 (size_t)size * shm_ceil_div(l.lines_max + 8, CRING_CACHE_LINE) * CRING_CACHE_LINE;
        if (l.bulk <= half / 4 || l.lines_max == 0) return l;
    }
}

size_t cring__shm_gather_small_max(const cring__shm_t *shm, int size) {
    const size_t half = cring__shm_window_bytes(shm) / 2;
    lines_layout_t l = lines_layout(half, size);
    return half > l.bulk ? half - l.bulk : 0;
}

/* Spin until the first n flags of `lines` read `flag`; 0 once `spin`
 * pauses are spent. */
static int lines_ready(const unsigned char *lines, size_t n, uint64_t flag, long spin) {
    for (size_t i = 0; i < n; i++) {
        const uint64_t *f = (const uint64_t *)(const void *)(lines + i * CRING_CACHE_LINE);
        for (long k = 0; __atomic_load_n(f, __ATOMIC_ACQUIRE) != flag; k++) {
            if (spin-- <= 0) return 0;
            cring__shm_relax(k);
        }
    }
    return 1;
}

cring_status_t cring__shm_gather_small(cring__shm_t *shm, int rank, int size, const void *mine,
                                       size_t bytes, const void **ptrs_out, size_t *lens_out) {
    const size_t half = cring__shm_window_bytes(shm) / 2;
    const lines_layout_t l = lines_layout(half, size);
    const size_t slot = shm_ceil_div(l.lines_max + 8, CRING_CACHE_LINE) * CRING_CACHE_LINE;
    if (l.bulk >= half || bytes > half - l.bulk) return CRING_ERR_INVALID_ARGUMENT;
    const uint64_t base = cring__shm_seq(shm), want = base + 1;
    /* the counter value mixed with the segment's key: other collectives'
     * data left in the half never reads as this collective's flag */
    const uint64_t flag = want ^ cring__shm_flag_key(shm);
    CRING_CHECK(cring__shm_wait_all(shm, base));
    unsigned char *w = shm_half_of(shm, rank, base);
    /* [length | block] cut into lines; a bulk block goes first, and its
     * line carries only the length */
    const size_t staged = bytes <= l.lines_max ? bytes + 8 : 8;
    unsigned char stage[LINES_MAX_BYTES + 8];
    uint64_t len = bytes;
    memcpy(stage, &len, 8);
    if (staged > 8) memcpy(stage + 8, mine, bytes);
    else memcpy(w + l.bulk, mine, bytes);
    for (size_t i = 0, lo = 0; lo < staged; i++, lo += LINE_DATA) {
        unsigned char *line = w + i * CRING_CACHE_LINE;
        memcpy(line + 8, stage + lo, CRING_MIN(LINE_DATA, staged - lo));
        __atomic_store_n((uint64_t *)(void *)line, flag, __ATOMIC_RELEASE);
    }
    cring__shm_publish(shm, want);
    const long spin = cring__shm_spin_limit(shm);
    for (int i = 0; i < size; i++) {
        const int q = (rank + i) % size;
        if (q == rank) {
            ptrs_out[q] = mine; /* the caller's own block, valid as long */
            if (lens_out) lens_out[q] = bytes;
            continue;
        }
        const unsigned char *lines = shm_half_of(shm, q, base);
        if (!lines_ready(lines, 1, flag, spin)) CRING_CHECK(cring__shm_wait(shm, q, want));
        uint64_t qlen;
        memcpy(&qlen, lines + 8, 8);
        if (qlen > half - l.bulk) return CRING_ERR_PROTOCOL;
        if (qlen > l.lines_max) {
            ptrs_out[q] = lines + l.bulk;
        } else {
            const size_t nq = line_count((size_t)qlen);
            if (!lines_ready(lines, nq, flag, spin)) CRING_CHECK(cring__shm_wait(shm, q, want));
            unsigned char *out = w + l.scratch + (size_t)q * slot;
            for (size_t k = 0; k < nq; k++) /* [length | block] back together */
                memcpy(out + k * LINE_DATA, lines + k * CRING_CACHE_LINE + 8,
                       CRING_MIN(LINE_DATA, (size_t)qlen + 8 - k * LINE_DATA));
            ptrs_out[q] = out + 8;
        }
        cring__shm_saw(shm, q, want);
        if (lens_out) lens_out[q] = (size_t)qlen;
    }
    return CRING_OK;
}

cring_status_t cring__shm_barrier(cring__shm_t *shm) {
    uint64_t seq = cring__shm_seq(shm) + 1;
    cring__shm_publish(shm, seq);
    return cring__shm_wait_all(shm, seq);
}

/*
 * Alltoallv: matrix[q * size + r] bytes go from rank q to rank r; rank q's
 * send buffer holds its blocks in destination order, rank r's receive
 * buffer gets them in source order. Every rank streams its whole send
 * buffer through its window halves (round k carries bytes [k*half,
 * (k+1)*half)); a reader copies out the part of its own block that falls in
 * that range. The round count comes from the largest send buffer, which
 * every rank computes from the same matrix.
 */
cring_status_t cring__shm_alltoallv(cring__shm_t *shm, int rank, int size, const void *send,
                                    void *recv, const size_t *matrix) {
    const unsigned char *in = send;
    unsigned char *out = recv;
    const size_t P = (size_t)size;
    /* from[q]: where this rank's block starts in q's send buffer;
     * at[q]: where q's block goes in this rank's receive buffer */
    size_t from[MAX_STACK_RANKS], at[MAX_STACK_RANKS], mine_total = 0, max_total = 0, roff = 0;
    for (size_t q = 0; q < P; q++) {
        size_t total = 0;
        for (size_t r = 0; r < P; r++) {
            if (r == (size_t)rank) from[q] = total;
            total += matrix[q * P + r];
        }
        at[q] = roff;
        roff += matrix[q * P + (size_t)rank];
        max_total = CRING_MAX(max_total, total);
        if (q == (size_t)rank) mine_total = total;
    }
    const size_t self = matrix[(size_t)rank * P + (size_t)rank];
    if (self) memcpy(out + at[rank], in + from[rank], self);
    if (size == 1) return CRING_OK;
    const size_t half = cring__shm_window_bytes(shm) / 2;
    const uint64_t base = cring__shm_seq(shm);
    const size_t rounds = shm_ceil_div(max_total, half);
    CRING_CHECK(cring__shm_wait_all(shm, base));
    for (size_t k = 0; k < rounds; k++) {
        const size_t lo = k * half, hi = lo + half;
        if (k >= 2) CRING_CHECK(cring__shm_wait_all(shm, base + 2 * (k - 2) + 2));
        if (mine_total > lo)
            memcpy(shm_half_of(shm, rank, base + k), in + lo, CRING_MIN(half, mine_total - lo));
        cring__shm_publish(shm, base + 2 * k + 1);
        for (int i = 1; i < size; i++) {
            int q = (rank + i) % size;
            size_t seg_lo = from[q], seg_hi = seg_lo + matrix[(size_t)q * P + (size_t)rank];
            size_t a = CRING_MAX(seg_lo, lo), b = CRING_MIN(seg_hi, hi);
            if (a >= b) continue;
            CRING_CHECK(cring__shm_wait(shm, q, base + 2 * k + 1));
            memcpy(out + at[q] + (a - seg_lo), shm_half_of(shm, q, base + k) + (a - lo), b - a);
        }
        cring__shm_publish(shm, base + 2 * k + 2);
    }
    return CRING_OK;
}

/* ring.c: ring allreduce / reducescatter / allgatherv, tree-or-chain broadcast and
 * a dissemination barrier over the p2p interface, plus the scratch buffer.
 * Calls only p2p->ops->sendrecv and the reduce kernels: no sockets, no threads. */
#include <stdlib.h>
#include <string.h>

#include "../reduce/reduce.h"
#include "algo.h"

/* Reduce-scatter segment: received, reduced and forwarded while it is still in
 * cache (L2-sized), and small enough that a TCP peer keeps streaming the next
 * segment into its socket buffer while this one is being reduced. */
#define RING_SEGMENT_BYTES ((size_t)512 * 1024)
/* Broadcast: below this a binomial tree (latency), above it a pipelined chain
 * (bandwidth) in segments of BCAST_SEGMENT_BYTES. */
#define BCAST_TREE_MAX_BYTES ((size_t)64 * 1024)
#define BCAST_SEGMENT_BYTES ((size_t)256 * 1024)
/* Per-rank offset tables up to this many ranks live on the stack. */
#define STACK_RANKS 256

/* ---- scratch ------------------------------------------------------------------ */

/* Contract (algo.h): after CRING_OK, s->ptr holds at least `bytes` bytes aligned
 * to a cache line; old contents are not kept. On ERR_NO_MEMORY s is empty
 * (ptr NULL, bytes 0) and still safe to free. Not thread-safe per scratch. */
cring_status_t cring__scratch_reserve(cring__scratch_t *s, size_t bytes) {
    if (!s) return CRING_ERR_INVALID_ARGUMENT;
    if (s->ptr && s->bytes >= bytes) return CRING_OK;
    if (bytes > SIZE_MAX - CRING_CACHE_LINE) return CRING_ERR_NO_MEMORY;
    size_t rounded = (bytes + CRING_CACHE_LINE - 1) / CRING_CACHE_LINE * CRING_CACHE_LINE;
    if (rounded == 0) rounded = CRING_CACHE_LINE;
    free(s->ptr); /* contents need not survive: release before growing */
    s->ptr = aligned_alloc(CRING_CACHE_LINE, rounded);
    s->bytes = s->ptr ? rounded : 0;
    return s->ptr ? CRING_OK : CRING_ERR_NO_MEMORY;
}

/* Contract (algo.h): frees the buffer and leaves s empty; safe on an empty or
 * already-freed scratch and on NULL. */
void cring__scratch_free(cring__scratch_t *s) {
    if (!s) return;
    free(s->ptr);
    s->ptr = NULL;
    s->bytes = 0;
}

/* ---- helpers ---------------------------------------------------------------------- */

static int mod(int a, int p) { return ((a % p) + p) % p; }
static size_t ceil_div(size_t a, size_t b) { return (a + b - 1) / b; }

/* One exchange; a side with 0 bytes is switched off, and a call with nothing to
 * do at all is not made. */
static cring_status_t xfer(cring__p2p_t *p2p, int send_peer, const void *send_buf,
                           size_t send_bytes, int recv_peer, void *recv_buf, size_t recv_bytes) {
    if (!send_bytes && !recv_bytes) return CRING_OK;
    return p2p->ops->sendrecv(p2p, send_bytes ? send_peer : -1, send_buf, send_bytes,
                              recv_bytes ? recv_peer : -1, recv_buf, recv_bytes);
}

static int p2p_valid(const cring__p2p_t *p2p) {
    return p2p && p2p->ops && p2p->ops->sendrecv && p2p->size >= 1 && p2p->rank >= 0 &&
           p2p->rank < p2p->size;
}

/* How a buffer is cut into one block per rank: either count split as evenly as
 * possible (the first `remainder` blocks one element longer), or explicit
 * per-rank counts with their prefix sums. Units are elements. */
typedef struct ring_blocks {
    const size_t *counts;  /* NULL: even split */
    const size_t *offsets; /* prefix sums of counts (when counts != NULL) */
    size_t per_block, remainder;
} ring_blocks_t;

static size_t block_len(const ring_blocks_t *b, int i) {
    if (b->counts) return b->counts[i];
    return b->per_block + ((size_t)i < b->remainder);
}

static size_t block_off(const ring_blocks_t *b, int i) {
    if (b->counts) return b->offsets[i];
    return (size_t)i * b->per_block + CRING_MIN((size_t)i, b->remainder);
}

/* Fill offsets[0..size) with prefix sums of counts and *total with their sum.
 * ERR_INVALID_ARGUMENT when the total overflows `limit` (elements that fit in
 * SIZE_MAX bytes). */
static cring_status_t prefix_sums(const size_t *counts, int size, size_t limit, size_t *offsets,
                                  size_t *total) {
    size_t sum = 0;
    for (int i = 0; i < size; i++) {
        offsets[i] = sum;
        if (counts[i] > limit - sum) return CRING_ERR_INVALID_ARGUMENT;
        sum += counts[i];
    }
    *total = sum;
    return CRING_OK;
}

/* An offsets table: on the stack for up to STACK_RANKS ranks, else malloc'd. */
static size_t *offsets_table(int size, size_t *stack) {
    return size <= STACK_RANKS ? stack : malloc((size_t)size * sizeof(size_t));
}
static void offsets_release(size_t *table, size_t *stack) {
    if (table != stack) free(table);
}

/* ---- ring reduce-scatter (shared by allreduce and reducescatter) ------------------
 *
 * P ranks in a ring; rank r sends to r+1 and receives from r-1 (mod P). The
 * input is cut into P blocks B0..B(P-1); rank r ends up owning the fully
 * reduced block Br. In step s = 0..P-2 rank r
 *
 *     sends    block (r-s-1) mod P: its own input at s = 0, afterwards the
 *              partial it produced in step s-1;
 *     receives block (r-s-2) mod P from r-1 and combines it with its own input
 *              of that block, giving the partial it sends in step s+1.
 *
 * After P-1 steps the received block is (r-P) mod P = r, reduced over all ranks.
 * P = 4, block owned after each step (x = partial over the ranks listed):
 *
 *     step 0:  r0 sends B3 {0}       r1 sends B0 {1}       r2 sends B1 {2} ...
 *              r0 gets  B2 {3}+{0}   r1 gets  B3 {0}+{1}   ...
 *     step 1:  r0 sends B2 {3,0}     r0 gets B1 {2,3}+{0}
 *     step 2:  r0 sends B1 {2,3,0}   r0 gets B0 {1,2,3}+{0} = final B0
 *
 * Segments: every block is cut into columns of seg_elems elements, and the
 * P-1 steps above run once per column j (column-major order). A column of a
 * partial is therefore forwarded in the very next exchange, so partials need
 * only two segment buffers (A/B, alternating: receive into one while the other
 * is being sent), the data is reduced while hot in cache, and the transport
 * keeps streaming the next column into its buffers while this one is reduced.
 * Both neighbours cut a block the same way, so every message is received with
 * exactly the size it was sent with. Empty segments (short or empty blocks)
 * make one or both sides of an exchange 0 bytes.
 *
 * Reading and writing: `send` is only read; partials live in the two scratch
 * segments; only own_out (block r's place, counts[r] elements) is written,
 * own_out[i] = send[Br][i] op received[i]. own_out may be send's own block
 * (in-place allreduce): element-wise aliasing is fine for the kernels. */
static cring_status_t ring_reduce_scatter(cring__p2p_t *p2p, const ring_blocks_t *blocks,
                                          const char *send, char *own_out, cring_dtype_t dtype,
                                          cring_op_t op, char *seg_a, char *seg_b,
                                          size_t seg_elems) {
    const int P = p2p->size, r = p2p->rank;
    const int right = mod(r + 1, P), left = mod(r - 1, P);
    const size_t es = cring_dtype_size(dtype);
    const cring_op_t combine = op == CRING_AVERAGE ? CRING_SUM : op; /* divide at the end */
    size_t max_len = 0;
    for (int b = 0; b < P; b++) max_len = CRING_MAX(max_len, block_len(blocks, b));
    const size_t columns = ceil_div(max_len, seg_elems);

    for (size_t j = 0; j < columns; j++) {
        const size_t lo = j * seg_elems;
        char *bufs[2] = {seg_a, seg_b};
        const char *partial = NULL; /* column j of the block sent this step */
        for (int s = 0; s < P - 1; s++) {
            const int sb = mod(r - s - 1, P), rb = mod(r - s - 2, P);
            const size_t s_len = block_len(blocks, sb), r_len = block_len(blocks, rb);
            const size_t s_n = lo < s_len ? CRING_MIN(seg_elems, s_len - lo) : 0;
            const size_t r_n = lo < r_len ? CRING_MIN(seg_elems, r_len - lo) : 0;
            const char *s_ptr = s == 0 ? send + (block_off(blocks, sb) + lo) * es : partial;
            char *r_ptr = bufs[s & 1];
            CRING_CHECK(xfer(p2p, right, s_ptr, s_n * es, left, r_ptr, r_n * es));
            if (r_n) {
                const char *mine = send + (block_off(blocks, rb) + lo) * es;
                if (s == P - 2) { /* rb == r: the final value of this column */
                    const void *srcs[2] = {mine, r_ptr};
                    cring__reduce_multi(dtype, combine, own_out + lo * es, srcs, 2, r_n, 1);
                } else {
                    cring__reduce_inplace(dtype, combine, r_ptr, mine, r_n);
                }
            }
            partial = r_ptr;
        }
    }
    return CRING_OK;
}

/* ---- ring allgather (shared by allreduce and allgatherv) ----------------------------
 *
 * Every rank starts with its own block in place in buf. In step s = 0..P-2
 * rank r sends block (r-s) mod P to r+1 (its own at s = 0, afterwards the one
 * it received in step s-1) and receives block (r-s-1) mod P from r-1 straight
 * into its place in buf. P = 4, rank 0:
 *
 *     step 0: sends B0, receives B3     step 1: sends B3, receives B2
 *     step 2: sends B2, receives B1     -> buf holds B0..B3
 *
 * A block goes out whole in one exchange: there is no computation to overlap,
 * and one large message costs the transport less than many small ones.
 * Blocks may be empty (that side of the exchange is skipped). Units: elements
 * of es bytes. */
static cring_status_t ring_allgather(cring__p2p_t *p2p, const ring_blocks_t *blocks, size_t es,
                                     char *buf) {
    const int P = p2p->size, r = p2p->rank;
    const int right = mod(r + 1, P), left = mod(r - 1, P);
    for (int s = 0; s < P - 1; s++) {
        const int sb = mod(r - s, P), rb = mod(r - s - 1, P);
        CRING_CHECK(xfer(p2p, right, buf + block_off(blocks, sb) * es, block_len(blocks, sb) * es,
                         left, buf + block_off(blocks, rb) * es, block_len(blocks, rb) * es));
    }
    return CRING_OK;
}

/* Scratch for the reduce-scatter: two segments of the given size. */
static cring_status_t reserve_segments(cring__scratch_t *scratch, size_t seg_bytes, char **seg_a,
                                       char **seg_b) {
    size_t stride = ceil_div(seg_bytes, CRING_CACHE_LINE) * CRING_CACHE_LINE;
    CRING_CHECK(cring__scratch_reserve(scratch, 2 * stride));
    *seg_a = scratch->ptr;
    *seg_b = (char *)scratch->ptr + stride;
    return CRING_OK;
}

static cring_status_t check_reduction(cring__p2p_t *p2p, cring__scratch_t *scratch,
                                      cring_dtype_t dtype, cring_op_t op) {
    if (!p2p_valid(p2p) || !scratch) return CRING_ERR_INVALID_ARGUMENT;
    if (!cring__reduce_supported(dtype, op)) return CRING_ERR_NOT_SUPPORTED;
    return CRING_OK;
}

/* ---- allreduce ---------------------------------------------------------------------
 *
 * Ring reduce-scatter, then ring allgather, each P-1 steps, over P blocks of
 * count/P elements (the first count%P blocks one longer; with count < P some
 * blocks are empty). Each rank sends and receives 2(P-1)/P of the data.
 *
 *     reduce-scatter (above)          allgather (above)
 *     rank r: recv[Br] = sum of Br    rank r: recv[Bk] for every k
 *
 * AVERAGE sums, then divides only the owned block by P before the allgather
 * (1/P of the division work; every rank receives the divided blocks).
 * float16/bfloat16 partials are rounded to their dtype at every step (each
 * reduction is one kernel call, computed in float32).
 *
 * Contract (algo.h): every rank calls with the same count, dtype and op. send
 * is only read; recv (count elements) may equal send (in place) but must not
 * otherwise overlap it. Uses two segments of scratch (up to 1 MiB). Errors:
 * ERR_INVALID_ARGUMENT (bad p2p/scratch/NULL buffers/size overflow),
 * ERR_NOT_SUPPORTED (dtype/op), ERR_NO_MEMORY, and whatever sendrecv returns
 * (then recv holds unspecified data). Not thread-safe per p2p. */
cring_status_t cring__ring_allreduce(cring__p2p_t *p2p, cring__scratch_t *scratch, const void *send,
                                     void *recv, size_t count, cring_dtype_t dtype, cring_op_t op) {
    CRING_CHECK(check_reduction(p2p, scratch, dtype, op));
    const size_t es = cring_dtype_size(dtype);
    if (count == 0) return CRING_OK;
    if (!send || !recv || count > SIZE_MAX / es) return CRING_ERR_INVALID_ARGUMENT;
    const int P = p2p->size, r = p2p->rank;
    if (P == 1) {
        if (send != recv) memcpy(recv, send, count * es);
        return CRING_OK;
    }
    ring_blocks_t blocks = {.counts = NULL,
                            .offsets = NULL,
                            .per_block = count / (size_t)P,
                            .remainder = count % (size_t)P};
    const size_t seg_elems = CRING_MAX((size_t)1, RING_SEGMENT_BYTES / es);
    const size_t max_len = blocks.per_block + (blocks.remainder != 0);
    char *seg_a, *seg_b;
    CRING_CHECK(reserve_segments(scratch, CRING_MIN(seg_elems, max_len) * es, &seg_a, &seg_b));

    char *own = (char *)recv + block_off(&blocks, r) * es;
    CRING_CHECK(ring_reduce_scatter(p2p, &blocks, send, own, dtype, op, seg_a, seg_b, seg_elems));
    if (op == CRING_AVERAGE) cring__reduce_average(dtype, own, block_len(&blocks, r), P);
    return ring_allgather(p2p, &blocks, es, recv);
}

/* ---- reducescatter -----------------------------------------------------------------
 *
 * The reduce-scatter half of the allreduce with caller-given blocks: block k
 * is counts[k] elements starting at sum(counts[0..k)) of send (any may be 0).
 * Rank r's reduced block goes to recv; partials stay in the two scratch
 * segments, so send is never written. AVERAGE divides recv by P at the end.
 *
 * Contract (algo.h): counts has P entries, identical on every rank; recv holds
 * counts[r] elements and must not alias send. Scratch use: two segments (up to
 * 1 MiB). Errors as for cring__ring_allreduce. Not thread-safe per p2p. */
cring_status_t cring__ring_reducescatter(cring__p2p_t *p2p, cring__scratch_t *scratch,
                                         const void *send, void *recv, const size_t *counts,
                                         cring_dtype_t dtype, cring_op_t op) {
    CRING_CHECK(check_reduction(p2p, scratch, dtype, op));
    if (!counts) return CRING_ERR_INVALID_ARGUMENT;
    const size_t es = cring_dtype_size(dtype);
    const int P = p2p->size, r = p2p->rank;
    size_t stack[STACK_RANKS];
    size_t *offsets = offsets_table(P, stack);
    if (!offsets) return CRING_ERR_NO_MEMORY;
    cring_status_t st = CRING_OK;
    size_t total = 0;
    CRING_CHECK_GOTO(prefix_sums(counts, P, SIZE_MAX / es, offsets, &total), st, cleanup);
    if (total == 0) goto cleanup;
    if (!send || (counts[r] && !recv)) {
        st = CRING_ERR_INVALID_ARGUMENT;
        goto cleanup;
    }
    if (P == 1) {
        memcpy(recv, send, counts[0] * es);
        goto cleanup;
    }
    ring_blocks_t blocks = {.counts = counts, .offsets = offsets};
    size_t max_len = 0;
    for (int b = 0; b < P; b++) max_len = CRING_MAX(max_len, counts[b]);
    const size_t seg_elems = CRING_MAX((size_t)1, RING_SEGMENT_BYTES / es);
    char *seg_a, *seg_b;
    CRING_CHECK_GOTO(reserve_segments(scratch, CRING_MIN(seg_elems, max_len) * es, &seg_a, &seg_b),
                     st, cleanup);
    CRING_CHECK_GOTO(
        ring_reduce_scatter(p2p, &blocks, send, recv, dtype, op, seg_a, seg_b, seg_elems), st,
        cleanup);
    if (op == CRING_AVERAGE) cring__reduce_average(dtype, recv, counts[r], P);
cleanup:
    offsets_release(offsets, stack);
    return st;
}

/* ---- allgatherv --------------------------------------------------------------------
 *
 * Rank r first puts its own block (send_bytes bytes) at offset
 * sum(recv_bytes[0..r)) of recv, unless send already is that place, then runs
 * the ring allgather above over byte blocks of sizes recv_bytes[] (any may be
 * 0): P-1 steps, each forwarding the block received in the step before.
 *
 * Contract (algo.h): recv_bytes has P entries, identical on every rank, and
 * recv_bytes[r] == send_bytes (else ERR_INVALID_ARGUMENT). send is only read
 * and may be recv's block r itself; otherwise it must not overlap recv.
 * Errors: ERR_INVALID_ARGUMENT, ERR_NO_MEMORY (more than 256 ranks and no
 * memory for the offset table), and whatever sendrecv returns. Not thread-safe
 * per p2p. */
cring_status_t cring__ring_allgatherv(cring__p2p_t *p2p, const void *send, size_t send_bytes,
                                      void *recv, const size_t *recv_bytes) {
    if (!p2p_valid(p2p) || !recv_bytes) return CRING_ERR_INVALID_ARGUMENT;
    const int P = p2p->size, r = p2p->rank;
    if (recv_bytes[r] != send_bytes) return CRING_ERR_INVALID_ARGUMENT;
    size_t stack[STACK_RANKS];
    size_t *offsets = offsets_table(P, stack);
    if (!offsets) return CRING_ERR_NO_MEMORY;
    cring_status_t st = CRING_OK;
    size_t total = 0;
    CRING_CHECK_GOTO(prefix_sums(recv_bytes, P, SIZE_MAX, offsets, &total), st, cleanup);
    if (total == 0) goto cleanup;
    if (!recv || (send_bytes && !send)) {
        st = CRING_ERR_INVALID_ARGUMENT;
        goto cleanup;
    }
    char *mine = (char *)recv + offsets[r];
    if (send_bytes && (const char *)send != mine) memmove(mine, send, send_bytes);
    if (P > 1) {
        ring_blocks_t blocks = {.counts = recv_bytes, .offsets = offsets};
        CRING_CHECK_GOTO(ring_allgather(p2p, &blocks, 1, recv), st, cleanup);
    }
cleanup:
    offsets_release(offsets, stack);
    return st;
}

/* ---- broadcast -----------------------------------------------------------------------
 *
 * Ranks are renumbered so the root is v = 0: v = (r - root) mod P.
 *
 * Small messages (< 64 KiB): binomial tree, ceil(log2 P) rounds. In the round
 * with distance d = 1, 2, 4, ..., every v < d that has the data sends it to
 * v + d, and v in [d, 2d) receives from v - d. P = 6:
 *
 *     d=1: 0->1     d=2: 0->2, 1->3     d=4: 0->4, 1->5
 *
 * Large messages: a chain 0 -> 1 -> ... -> P-1 in segments of 256 KiB. In
 * exchange t = 0..K (K segments) a middle rank sends segment t-1 to v+1 while
 * receiving segment t from v-1, so all links carry data at once after P-2
 * exchanges of fill; the root only sends (segment t in exchange t), the last
 * rank only receives. Total time ~ (K + P - 2) segment times instead of
 * (P-1) * K for sending the whole message P-1 times.
 *
 * Contract (algo.h): every rank calls with the same nbytes and root; buf is
 * read on the root and written elsewhere. Errors: ERR_INVALID_ARGUMENT (root
 * out of range, NULL buf), and whatever sendrecv returns. Not thread-safe per
 * p2p. */
cring_status_t cring__ring_broadcast(cring__p2p_t *p2p, void *buf, size_t nbytes, int root) {
    if (!p2p_valid(p2p)) return CRING_ERR_INVALID_ARGUMENT;
    const int P = p2p->size, r = p2p->rank;
    if (root < 0 || root >= P) return CRING_ERR_INVALID_ARGUMENT;
    if (P == 1 || nbytes == 0) return CRING_OK;
    if (!buf) return CRING_ERR_INVALID_ARGUMENT;
    const int v = mod(r - root, P);
    char *data = buf;

    if (nbytes < BCAST_TREE_MAX_BYTES || P == 2) {
        for (int d = 1; d < P; d *= 2) {
            if (v < d) {
                if (v + d < P)
                    CRING_CHECK(xfer(p2p, mod(v + d + root, P), data, nbytes, -1, NULL, 0));
            } else if (v < 2 * d) {
                CRING_CHECK(xfer(p2p, -1, NULL, 0, mod(v - d + root, P), data, nbytes));
            }
            if (d > P / 2) break; /* the next d would be >= P; also avoids int overflow */
        }
        return CRING_OK;
    }

    const int prev = mod(r - 1, P), next = mod(r + 1, P);
    const size_t segments = ceil_div(nbytes, BCAST_SEGMENT_BYTES);
    for (size_t t = 0; t <= segments; t++) {
        /* send segment t-1 (not at t = 0), receive segment t (not at t = K) */
        size_t s_off = t ? (t - 1) * BCAST_SEGMENT_BYTES : 0;
        size_t s_n = (t && v < P - 1) ? CRING_MIN(BCAST_SEGMENT_BYTES, nbytes - s_off) : 0;
        size_t r_off = t * BCAST_SEGMENT_BYTES;
        size_t r_n = (t < segments && v > 0) ? CRING_MIN(BCAST_SEGMENT_BYTES, nbytes - r_off) : 0;
        if (v == 0) { /* the root sends segment t in exchange t: no fill delay */
            s_off = r_off;
            s_n = t < segments ? CRING_MIN(BCAST_SEGMENT_BYTES, nbytes - s_off) : 0;
        }
        CRING_CHECK(xfer(p2p, next, data + s_off, s_n, prev, data + r_off, r_n));
    }
    return CRING_OK;
}

/* ---- barrier -------------------------------------------------------------------------
 *
 * Dissemination barrier: in round k = 0..ceil(log2 P)-1 rank r sends one byte
 * to r + 2^k and receives one byte from r - 2^k (mod P). After round k every
 * rank has (transitively) heard from the 2^(k+1) ranks before it, so after the
 * last round from all P. P = 5: distances 1, 2, 4.
 *
 * Contract (algo.h): returns once every rank has entered. Errors: those of
 * sendrecv. Not thread-safe per p2p. */
cring_status_t cring__p2p_barrier(cring__p2p_t *p2p) {
    if (!p2p_valid(p2p)) return CRING_ERR_INVALID_ARGUMENT;
    const int P = p2p->size, r = p2p->rank;
    for (int d = 1; d < P; d *= 2) {
        unsigned char token_out = 1, token_in = 0;
        CRING_CHECK(xfer(p2p, mod(r + d, P), &token_out, 1, mod(r - d, P), &token_in, 1));
        if (d > P / 2) break; /* the next d would be >= P; also avoids int overflow */
    }
    return CRING_OK;
}

/*
 * Alltoallv over p2p: P-1 pairwise steps; at step d every rank sends its
 * block for rank+d while receiving the block from rank-d, so each step is a
 * permutation and no rank waits on two peers at once. matrix[q*P + r] bytes
 * go from q to r (see algo.h).
 */
cring_status_t cring__p2p_alltoallv(cring__p2p_t *p2p, const void *send, void *recv,
                                    const size_t *matrix) {
    if (!p2p_valid(p2p)) return CRING_ERR_INVALID_ARGUMENT;
    const size_t P = (size_t)p2p->size, r = (size_t)p2p->rank;
    size_t *soff = malloc(2 * P * sizeof *soff);
    if (!soff) return CRING_ERR_NO_MEMORY;
    size_t *roff = soff + P, s = 0, t = 0;
    for (size_t q = 0; q < P; q++) {
        soff[q] = s;
        s += matrix[r * P + q];
        roff[q] = t;
        t += matrix[q * P + r];
    }
    const unsigned char *in = send;
    unsigned char *out = recv;
    cring_status_t st = CRING_OK;
    if (matrix[r * P + r]) memcpy(out + roff[r], in + soff[r], matrix[r * P + r]);
    for (size_t d = 1; d < P && st == CRING_OK; d++) {
        size_t to = (r + d) % P, from = (r + P - d) % P;
        st = xfer(p2p, (int)to, in + soff[to], matrix[r * P + to], (int)from, out + roff[from],
                  matrix[from * P + r]);
    }
    free(soff);
    return st;
}

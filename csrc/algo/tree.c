/* tree.c: the latency-bound allreduce over p2p: recursive doubling in
 * ceil(log2 P) exchanges (plus two for a P that is not a power of two).
 * Calls only p2p->ops->sendrecv and the reduce kernels: no sockets, no threads. */
#include <string.h>

#include "../reduce/reduce.h"
#include "algo.h"

/* ---- recursive doubling ----------------------------------------------------------
 *
 * P' = the largest power of two <= P, and E = P - P' extra ranks. Every rank
 * holds the whole vector (recv, after copying send) and a scratch vector.
 *
 *   fold    ranks 0..2E-1 pair up (2i, 2i+1): the even one sends its vector
 *           to the odd one and sits out; the odd one reduces. The P' ranks
 *           left are renumbered 0..P'-1 (odd rank 2i+1 -> i, rank k >= 2E ->
 *           k - E).
 *   double  in step k = 0..log2(P')-1 each rank exchanges its whole vector
 *           with new rank (own ^ 2^k) and reduces: after step k it holds the
 *           reduction over its group of 2^(k+1) new ranks.
 *   unfold  each odd rank of the fold sends the result to its even partner.
 *
 * P = 6 (P' = 4, E = 2):   fold 0->1, 2->3;  new ranks {1,3,4,5} = {0,1,2,3}
 *                          step 0: 1<->3, 4<->5   step 1: 1<->4, 3<->5
 *                          unfold 1->0, 3->2
 *
 * Every reduction puts the lower rank's operand first, and the reduce kernels
 * are commutative element by element (IEEE + and * are), so every rank ends
 * with the same bits. AVERAGE sums and divides by P at the end, on every
 * rank. Each rank sends log2(P') (+1) whole vectors: the ring's 2(P-1)
 * smaller messages cost fewer bytes, so the communicator uses this only up to
 * a crossover size (CRING_TREE_MAX_BYTES, docs/scaling.md).
 *
 * Contract (algo.h): every rank calls with the same count, dtype and op.
 * send is only read; recv (count elements) may equal send but must not
 * otherwise overlap it. Uses count elements of scratch. Errors:
 * ERR_INVALID_ARGUMENT, ERR_NOT_SUPPORTED (dtype/op), ERR_NO_MEMORY, and
 * whatever sendrecv returns (then recv holds unspecified data). Not
 * thread-safe per p2p. */

/* Combine the partner's vector `theirs` into `mine` with the lower rank's
 * operand first. */
static void combine(cring_dtype_t dtype, cring_op_t op, char *mine, const char *theirs,
                    size_t count, int mine_first) {
    const void *srcs[2] = {mine_first ? (const void *)mine : theirs,
                           mine_first ? (const void *)theirs : mine};
    cring__reduce_multi(dtype, op, mine, srcs, 2, count, 1);
}

cring_status_t cring__tree_allreduce(cring__p2p_t *p2p, cring__scratch_t *scratch, const void *send,
                                     void *recv, size_t count, cring_dtype_t dtype, cring_op_t op) {
    if (!p2p || !p2p->ops || !p2p->ops->sendrecv || !scratch || p2p->size < 1 || p2p->rank < 0 ||
        p2p->rank >= p2p->size)
        return CRING_ERR_INVALID_ARGUMENT;
    if (!cring__reduce_supported(dtype, op)) return CRING_ERR_NOT_SUPPORTED;
    const size_t es = cring_dtype_size(dtype);
    if (count == 0) return CRING_OK;
    if (!send || !recv || count > SIZE_MAX / es) return CRING_ERR_INVALID_ARGUMENT;
    const size_t bytes = count * es;
    const int P = p2p->size, r = p2p->rank;
    if (send != recv) memcpy(recv, send, bytes);
    if (P == 1) return CRING_OK;
    CRING_CHECK(cring__scratch_reserve(scratch, bytes));
    char *mine = recv, *theirs = scratch->ptr;
    const cring_op_t sum_op = op == CRING_AVERAGE ? CRING_SUM : op;
    int pof2 = 1;
    while (pof2 * 2 <= P) pof2 *= 2;
    const int extra = P - pof2;
    int newrank;
    if (r < 2 * extra) {
        if (r % 2 == 0) {
            CRING_CHECK(p2p->ops->sendrecv(p2p, r + 1, mine, bytes, -1, NULL, 0));
            newrank = -1;
        } else {
            CRING_CHECK(p2p->ops->sendrecv(p2p, -1, NULL, 0, r - 1, theirs, bytes));
            combine(dtype, sum_op, mine, theirs, count, 0);
            newrank = r / 2;
        }
    } else {
        newrank = r - extra;
    }
    if (newrank >= 0) {
        for (int mask = 1; mask < pof2; mask <<= 1) {
            const int newpartner = newrank ^ mask;
            const int partner = newpartner < extra ? newpartner * 2 + 1 : newpartner + extra;
            CRING_CHECK(p2p->ops->sendrecv(p2p, partner, mine, bytes, partner, theirs, bytes));
            combine(dtype, sum_op, mine, theirs, count, newrank < newpartner);
        }
    }
    if (r < 2 * extra) {
        if (r % 2 == 1) CRING_CHECK(p2p->ops->sendrecv(p2p, r - 1, mine, bytes, -1, NULL, 0));
        else CRING_CHECK(p2p->ops->sendrecv(p2p, -1, NULL, 0, r + 1, mine, bytes));
    }
    if (op == CRING_AVERAGE) cring__reduce_average(dtype, mine, count, P);
    return CRING_OK;
}

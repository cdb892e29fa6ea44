/* agree.c: descriptor exchange and comparison before each blocking collective.
 * Uses the transports' own primitives (shm slots and counters, p2p ring
 * allgather); moves no user data. */
#include <stdio.h>
#include <string.h>

#include "agree.h"

const char *cring__collective_name(uint32_t collective) {
    switch (collective) {
    case CRING__COLL_ALLREDUCE: return "allreduce";
    case CRING__COLL_BROADCAST: return "broadcast";
    case CRING__COLL_ALLGATHER: return "allgather";
    case CRING__COLL_REDUCESCATTER: return "reducescatter";
    case CRING__COLL_BARRIER: return "barrier";
    case CRING__COLL_ALLTOALL: return "alltoall";
    default: return "unknown collective";
    }
}

uint64_t cring__fnv1a(const void *data, size_t n) {
    const unsigned char *p = data;
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < n; i++) h = (h ^ p[i]) * 0x100000001b3ull;
    return h;
}

/* Each rank writes its descriptor into its slot for this round's parity,
 * publishes, waits for everyone, and reads all slots. A slot is rewritten two
 * agreements later, and by then every rank has passed the agreement in
 * between, which it only reaches after reading this one. */
cring_status_t cring__agree_shm(cring__shm_t *shm, int rank, int size, uint64_t round,
                                const cring__desc_t *mine, cring__desc_t *all_out) {
    memcpy(cring__shm_slot(shm, rank, (int)(round & 1)), mine, sizeof *mine);
    uint64_t seq = cring__shm_seq(shm) + 1;
    cring__shm_publish(shm, seq);
    CRING_CHECK(cring__shm_wait_all(shm, seq));
    for (int r = 0; r < size; r++)
        memcpy(&all_out[r], cring__shm_slot(shm, r, (int)(round & 1)), sizeof *all_out);
    return CRING_OK;
}

cring_status_t cring__agree_p2p(cring__p2p_t *p2p, const cring__desc_t *mine,
                                cring__desc_t *all_out) {
    size_t sizes[p2p->size];
    for (int r = 0; r < p2p->size; r++) sizes[r] = sizeof(cring__desc_t);
    return cring__ring_allgatherv(p2p, mine, sizeof *mine, all_out, sizes);
}

static int describe_difference(const cring__desc_t *a, const cring__desc_t *b, char *out,
                               size_t out_len) {
    if (a->magic != CRING__DESC_MAGIC || b->magic != CRING__DESC_MAGIC)
        return snprintf(out, out_len, "corrupt descriptor");
    if (a->collective != b->collective)
        return snprintf(out, out_len, "collective %s vs %s", cring__collective_name(a->collective),
                        cring__collective_name(b->collective));
    if (a->dtype != b->dtype)
        return snprintf(out, out_len, "dtype %s vs %s", cring_dtype_name(a->dtype),
                        cring_dtype_name(b->dtype));
    if (a->count != b->count)
        return snprintf(out, out_len, "element count %llu vs %llu", (unsigned long long)a->count,
                        (unsigned long long)b->count);
    if (a->op != b->op)
        return snprintf(out, out_len, "op %s vs %s", cring_op_name(a->op), cring_op_name(b->op));
    if (a->root != b->root)
        return snprintf(out, out_len, "root rank %lld vs %lld", (long long)a->root,
                        (long long)b->root);
    if (a->table_hash != b->table_hash)
        return snprintf(out, out_len, "per-rank size table differs");
    return 0;
}

cring_status_t cring__agree_check(const cring__desc_t *all, int size, cring__errmsg_t *err) {
    char detail[256];
    int first_bad = -1, nbad = 0;
    for (int r = 1; r < size; r++) {
        if (describe_difference(&all[0], &all[r], detail, sizeof detail) > 0) {
            if (first_bad < 0) first_bad = r;
            nbad++;
        }
    }
    if (first_bad < 0) return CRING_OK;
    describe_difference(&all[0], &all[first_bad], detail, sizeof detail);
    int n = snprintf(err->text, sizeof err->text,
                     "ranks disagree on %s: rank 0 vs rank %d: %s (rank 0 first)",
                     cring__collective_name(all[0].collective), first_bad, detail);
    if (nbad > 1 && n > 0 && (size_t)n < sizeof err->text) {
        int m = snprintf(err->text + n, sizeof err->text - (size_t)n, "; differing ranks:");
        for (int r = 1; r < size && m > 0 && (size_t)(n + m) < sizeof err->text - 8; r++) {
            if (describe_difference(&all[0], &all[r], detail, sizeof detail) > 0)
                m += snprintf(err->text + n + m, sizeof err->text - (size_t)(n + m), " %d", r);
        }
    }
    return CRING_ERR_MISMATCH;
}

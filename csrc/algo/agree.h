/* agree.h: the argument-agreement step every blocking collective starts with:
 * each rank contributes a small descriptor of what it is about to do and gets
 * everyone's, so a disagreement becomes the same error on every rank instead
 * of a hang or corrupt data. It is also a barrier (everyone has arrived). */
#ifndef CRING_AGREE_H
#define CRING_AGREE_H

#include "algo.h"

enum {
    CRING__COLL_ALLREDUCE = 1,
    CRING__COLL_BROADCAST,
    CRING__COLL_ALLGATHER,
    CRING__COLL_REDUCESCATTER,
    CRING__COLL_BARRIER,
    CRING__COLL_ALLTOALL
};

typedef struct cring__desc {
    uint32_t magic;      /* CRING__DESC_MAGIC: catches corrupt or stray bytes */
    uint32_t collective; /* CRING__COLL_* */
    int32_t dtype;
    int32_t op;
    int64_t root;
    uint64_t count;      /* elements (bytes for allgather's own block) */
    uint64_t table_hash; /* FNV-1a of a per-rank size table, 0 when none */
} cring__desc_t;

#define CRING__DESC_MAGIC 0x43524731u

/* Name of a CRING__COLL_* value. */
const char *cring__collective_name(uint32_t collective);
/* FNV-1a 64-bit hash of n bytes. */
uint64_t cring__fnv1a(const void *data, size_t n);

/* Exchange descriptors. all_out receives `size` descriptors in rank order.
 * `round` counts agreements made on this communicator (the shm version
 * alternates descriptor slots by its parity). Transport errors are returned
 * as they are. */
cring_status_t cring__agree_shm(cring__shm_t *shm, int rank, int size, uint64_t round,
                                const cring__desc_t *mine, cring__desc_t *all_out);
cring_status_t cring__agree_p2p(cring__p2p_t *p2p, const cring__desc_t *mine,
                                cring__desc_t *all_out);

/* Compare every rank's descriptor with rank 0's. Returns CRING_OK when all
 * match, else CRING_ERR_MISMATCH with a message (identical on every rank)
 * naming the collective, the ranks and the field that differs. */
cring_status_t cring__agree_check(const cring__desc_t *all, int size, cring__errmsg_t *err);

#endif /* CRING_AGREE_H */

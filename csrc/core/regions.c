/* regions.c: the communicator's shared regions: the collective registration
 * (names and sizes through the store, a vote, every rank or none) and the
 * in-place allreduce of a buffer inside one. Mapping is transport/
 * shm_region.c's, the algorithm algo/shm_inplace.c's; nothing else here. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "comm_impl.h"

/* Each rank's mapping starts with a page of its own (the in-place
 * allreduce's descriptor); the data the caller gets follows, page-aligned. */
#define REGION_HEADER_BYTES 4096u

struct cring__region {
    size_t bytes, map_bytes;
    unsigned char *maps[CRING__SHM_MAX_RANKS];
    unsigned char *data[CRING__SHM_MAX_RANKS];
    void *headers[CRING__SHM_MAX_RANKS];
};

static void region_free(cring_comm_t *c, struct cring__region *r, int keep_own) {
    if (!r) return;
    for (int q = 0; q < c->size; q++)
        if (!(keep_own && q == c->rank)) cring__shm_region_unmap(r->maps[q], r->map_bytes);
    free(r);
}

/* Map every peer's region named in the store (generation gen); *ok and
 * *mismatch say what was found. Store failures are returned. */
static cring_status_t map_peers(cring_comm_t *c, struct cring__region *r, unsigned gen, int *ok,
                                int *mismatch, cring__errmsg_t *err) {
    for (int q = 0; q < c->size; q++) {
        if (q == c->rank) continue;
        char key[512];
        void *v = NULL;
        size_t len = 0;
        snprintf(key, sizeof key, "%s/region/%u/%d", c->key_prefix, gen, q);
        CRING_CHECK(cring_store_get(c->store, key, c->timeout_s, &v, &len));
        char text[160] = {0}, name[128] = {0};
        memcpy(text, v, CRING_MIN(len, sizeof text - 1));
        free(v);
        unsigned long long peer_bytes = 0;
        if (sscanf(text, "%llu %127s", &peer_bytes, name) != 2) {
            *ok = 0;
            cring__fail(err, CRING_ERR_PROTOCOL, "rank %d: malformed region record", q);
            continue;
        }
        if ((size_t)peer_bytes != r->bytes) {
            *ok = 0;
            *mismatch = 1;
            cring__fail(err, CRING_ERR_MISMATCH,
                        "shared region: rank %d asked for %llu bytes, rank %d for %zu", q,
                        peer_bytes, c->rank, r->bytes);
            continue;
        }
        if (!strcmp(name, "-")) {
            *ok = 0;
            continue;
        }
        void *p = NULL;
        if (cring__shm_region_open(name, r->map_bytes, &p, err) != CRING_OK) {
            *ok = 0;
            continue;
        }
        r->maps[q] = p;
    }
    return CRING_OK;
}

cring_status_t cring_comm_shared_region(cring_comm_t *c, size_t nbytes, void **data_out) {
    if (!c || !data_out) return CRING_ERR_INVALID_ARGUMENT;
    *data_out = NULL;
    const unsigned gen = c->region_calls++;
    if (c->ops != &cring__shm_ops || c->size < 2)
        return cring__fail(&c->err, CRING_ERR_NOT_SUPPORTED,
                           "shared regions need two or more ranks over shared memory "
                           "(transport: %s)",
                           c->ops->name);
    const int n = atomic_load_explicit(&c->nregions, memory_order_acquire);
    if (n >= CRING__MAX_REGIONS)
        return cring__fail(&c->err, CRING_ERR_NO_MEMORY, "at most %d shared regions",
                           CRING__MAX_REGIONS);
    struct cring__region *r = calloc(1, sizeof *r);
    if (!r) return CRING_ERR_NO_MEMORY;
    r->bytes = nbytes;
    r->map_bytes = REGION_HEADER_BYTES + nbytes;
    cring__errmsg_t err = {0};
    char name[128] = "-", key[512], value[160];
    void *own = NULL;
    cring_status_t created = cring__shm_region_create(r->map_bytes, name, sizeof name, &own, &err);
    if (created != CRING_OK) snprintf(name, sizeof name, "-");
    r->maps[c->rank] = own;
    int ok = created == CRING_OK, mismatch = 0, all_ok = 0;
    snprintf(key, sizeof key, "%s/region/%u/%d", c->key_prefix, gen, c->rank);
    snprintf(value, sizeof value, "%zu %s", nbytes, name);
    char what[64];
    snprintf(what, sizeof what, "region_ok/%u", gen);
    cring_status_t st = cring_store_set(c->store, key, value, strlen(value));
    if (st == CRING_OK) st = map_peers(c, r, gen, &ok, &mismatch, &err);
    if (st == CRING_OK) st = cring__comm_vote(c, what, ok, &all_ok);
    /* every rank mapped before it voted: the name is no longer needed */
    if (created == CRING_OK) cring__shm_region_unlink(name);
    if (st != CRING_OK || !all_ok) {
        region_free(c, r, 0);
        if (st != CRING_OK) return st;
        if (mismatch) return cring__fail(&c->err, CRING_ERR_MISMATCH, "%s", err.text);
        return cring__fail(&c->err, created != CRING_OK ? created : CRING_ERR_NOT_SUPPORTED,
                           "shared region of %zu bytes: %s", nbytes,
                           err.text[0] ? err.text : "another rank could not map its region");
    }
    for (int q = 0; q < c->size; q++) {
        r->headers[q] = r->maps[q];
        r->data[q] = r->maps[q] + REGION_HEADER_BYTES;
    }
    c->regions[n] = r;
    atomic_store_explicit(&c->nregions, n + 1, memory_order_release);
    *data_out = r->data[c->rank];
    return CRING_OK;
}

cring_status_t cring__comm_region_allreduce(cring_comm_t *c, void *buf, size_t count,
                                            cring_dtype_t dtype, cring_op_t op, int *handled) {
    const int n = atomic_load_explicit(&c->nregions, memory_order_acquire);
    const unsigned char *p = buf;
    const size_t bytes = count * cring_dtype_size(dtype);
    *handled = 0;
    for (int i = 0; i < n; i++) {
        const struct cring__region *r = c->regions[i];
        const unsigned char *lo = r->data[c->rank];
        if (p < lo || p + bytes > lo + r->bytes) continue;
        *handled = 1;
        cring_status_t st = cring__shm_allreduce_mapped(
            c->shm, c->rank, c->size, r->data, r->headers, (size_t)(p - lo), count, dtype, op);
        if (st == CRING_ERR_MISMATCH)
            cring__fail(&c->err, st,
                        "allreduce in a shared region: ranks passed buffers at different "
                        "offsets, counts, dtypes or ops");
        return st;
    }
    return CRING_OK;
}

void cring__comm_regions_destroy(cring_comm_t *c) {
    const int n = atomic_load_explicit(&c->nregions, memory_order_acquire);
    for (int i = 0; i < n; i++) region_free(c, c->regions[i], 1);
    atomic_store_explicit(&c->nregions, 0, memory_order_release);
}

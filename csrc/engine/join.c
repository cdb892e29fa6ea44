/* join.c: join(): a rank with no more work stands in, with zeros, for every
 * name the others still run, until every rank has joined. Owns the joined
 * flags (vector bytes [CRING__V_HEADER, vhdr)), the stand-in requests
 * ("ghosts"), the conflict rule and the join's completion. Runs on the
 * driving thread only. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../common/wire.h"
#include "engine_internal.h"

/* A joined rank's stand-in for a request it never submitted: the same
 * description (so fusion packs it exactly as the other ranks do) and zeros
 * as its data. NULL when out of memory or the record is malformed. */
req_t *cring__join_ghost(cring_engine_t *e, const uint8_t *rec, size_t len) {
    parsed_t p;
    if (cring__record_parse(rec, len, &p) != 0) return NULL;
    char name[CRING__MAX_NAME_BYTES + 1];
    memcpy(name, p.name, p.name_len);
    name[p.name_len] = 0;
    size_t ndims = 0, off = 0, bytes = 0;
    for (int i = 0; i < p.ntensors; i++) {
        ndims += p.tensors[off + 1];
        off += 2 + 8 * (size_t)p.tensors[off + 1];
    }
    size_t nt = p.ntensors > 0 ? (size_t)p.ntensors : 1;
    cring_tensor_t *ts = calloc(nt, sizeof *ts);
    int64_t *dims = malloc(sizeof *dims * (ndims ? ndims : 1));
    size_t *at = malloc(sizeof *at * nt);
    req_t *r = NULL;
    void *zeros = NULL;
    if (!ts || !dims || !at) goto done;
    off = 0;
    int64_t *d = dims;
    for (int i = 0; i < p.ntensors; i++) {
        ts[i].dtype = (cring_dtype_t)p.tensors[off];
        ts[i].ndim = p.tensors[off + 1];
        ts[i].shape = d;
        size_t count = 1;
        for (int k = 0; k < ts[i].ndim; k++) {
            d[k] = (int64_t)cring__wire_get(p.tensors + off + 2 + 8 * (size_t)k, 8);
            count *= (size_t)d[k];
        }
        d += ts[i].ndim;
        off += 2 + 8 * (size_t)ts[i].ndim;
        at[i] = bytes;
        bytes += (count * cring_dtype_size(ts[i].dtype) + 63) & ~(size_t)63;
    }
    zeros = calloc(bytes ? bytes : 1, 1);
    if (!zeros) goto done;
    for (int i = 0; i < p.ntensors; i++) ts[i].send = ts[i].recv = (char *)zeros + at[i];
    cring_request_t q = {.name = name,
                         .collective = (cring_collective_t)p.coll,
                         .op = (cring_op_t)p.op,
                         .root = p.root,
                         .prescale = p.prescale,
                         .postscale = p.postscale,
                         .compression = (cring_dtype_t)p.compression,
                         .ntensors = p.ntensors,
                         .tensors = ts,
                         .device = {.type = (cring_device_type_t)p.device_type}};
    r = cring__req_make(e, &q, e->size);
    if (r) {
        r->ghost = zeros;
        zeros = NULL;
    }
done:
    free(zeros);
    free(ts);
    free(dims);
    free(at);
    return r;
}

/* While some rank has joined, only allreduces that can take zeros for its
 * part run (Sum, Average); anything else fails on every rank. Returns 1 and
 * a message when the record describes such a request. */
int cring__join_conflict(cring_engine_t *e, const uint8_t *rec, size_t len, char *msg, size_t n) {
    parsed_t p;
    if (!e->join.njoined || cring__record_parse(rec, len, &p) != 0) return 0;
    if (p.coll == CRING_COLL_ALLREDUCE && (p.op == CRING_SUM || p.op == CRING_AVERAGE)) return 0;
    char who[256] = "";
    size_t o = 0;
    for (int q = 0; q < e->size && o < sizeof who - 16; q++)
        if (e->join.joined[q])
            o += (size_t)snprintf(who + o, sizeof who - o, "%s%d", o ? ", " : "", q);
    snprintf(msg, n,
             "'%.*s': %s%s%s cannot run while ranks [%s] have joined: after join() the other "
             "ranks may only allreduce with Sum or Average (joined ranks contribute zeros)",
             (int)p.name_len, p.name, cring_collective_name((cring_collective_t)p.coll),
             p.coll == CRING_COLL_ALLREDUCE ? " with op " : "",
             p.coll == CRING_COLL_ALLREDUCE ? cring_op_name((cring_op_t)p.op) : "", who);
    return 1;
}

static int name_cmp(const void *a, const void *b) {
    return strcmp((*(table_entry_t *const *)a)->name, (*(table_entry_t *const *)b)->name);
}

/* A rank just joined: entries that waited only for it are complete now.
 * Answered in name order, which every rank computes alike. */
cring_status_t cring__join_sweep(cring_engine_t *e, response_list_t *l) {
    if (!e->table.map.count) return CRING_OK;
    table_entry_t **done = malloc(sizeof *done * e->table.map.count);
    if (!done) return CRING_ERR_NO_MEMORY;
    size_t n = 0;
    for (size_t b = 0; b < e->table.map.nbuckets; b++)
        for (cring__strmap_entry_t *x = e->table.map.buckets[b]; x; x = x->next)
            if (cring__table_entry_complete(e, x->value)) done[n++] = x->value;
    qsort(done, n, sizeof *done, name_cmp);
    cring_status_t st = CRING_OK;
    for (size_t i = 0; i < n; i++) {
        cring__strmap_remove(&e->table.map, done[i]->name);
        if (st == CRING_OK) st = cring__table_answer(e, done[i], l);
        else cring__table_entry_free(done[i], e->size);
    }
    free(done);
    return st;
}

int cring__join_update(cring_engine_t *e, const uint8_t *v) {
    int grew = 0, njoined = 0;
    for (int q = 0; q < e->size; q++) {
        int j = v[CRING__V_HEADER + q] == 0;
        if (j && !e->join.joined[q]) {
            grew = 1;
            e->join.round[q] = e->drive.rounds_done;
        }
        e->join.joined[q] = (uint8_t)j;
        njoined += j;
    }
    e->join.njoined = njoined;
    return grew;
}

/* Every rank returns the same last rank: the latest to join, the highest
 * among those that joined in the same round. */
int cring__join_finish(cring_engine_t *e) {
    if (e->join.njoined != e->size || !e->join.req) return 0;
    int last = 0;
    for (int q = 0; q < e->size; q++)
        if (e->join.round[q] >= e->join.round[last]) last = q;
    req_t *j = e->join.req;
    e->join.req = NULL;
    memset(e->join.joined, 0, (size_t)e->size);
    memset(e->join.round, 0, sizeof *e->join.round * (size_t)e->size);
    e->join.njoined = 0;
    j->handle->value = last;
    atomic_store(&e->join.in_flight, 0);
    cring__engine_span(e, j->name, "JOIN", j->submit_s, cring__engine_tl_now(e), NULL);
    cring__engine_complete(e, j, CRING_OK, NULL);
    cring__req_free(j);
    return 1;
}

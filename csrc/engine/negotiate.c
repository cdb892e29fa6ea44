/* negotiate.c: one negotiation round, the way every rank agrees on what runs
 * next: the vector exchange (sparse blocks over shared memory, a dense MIN
 * over TCP, with a small allreduce riding along), reading the ready cache
 * slots, the record exchange when needed, then execution; plus the stall
 * check and failing everything after a transport failure. Never moves a
 * tensor's data except the speculated small allreduce.
 *
 * One negotiation round (every rank runs the same rounds in the same order):
 *
 *   1. MIN-allreduce of a byte vector V:
 *        V[0] = 0 if this rank has uncached requests to describe (or, on
 *               rank 0, time-out verdicts to send), else 1
 *        V[1] = 0 if this rank asks everyone to stop (stall shutdown), else 1
 *        V[2] = 0 if this rank has anything pending (or held), else 1
 *        V[3] = 0 if this rank asks every rank to release the CUDA requests
 *               held for their gradient bucket (bucket.c: a thread waits), else 1
 *        V[4] = 0 likewise, because nothing moved for a while (bucket.c), else 1
 *        V[5+q] per rank q: 0 once q has joined (join.c), else 1
 *        V[vhdr+i] per response-cache slot i: 0 invalidate, 2 pending here,
 *               1 otherwise. After MIN: 2 means pending on every rank (ready),
 *               0 means some rank's request no longer matches (evict).
 *   2. If MIN(V[0]) == 0: allgather of every rank's uncached request records
 *      (table.c). Every rank feeds them, in rank order, into the same table; a
 *      name is complete once all ranks described it, and is then checked
 *      (shape, dtype, op, root, device), answered, and put in the cache.
 *   3. Ready requests run in one order on every rank (execute.c): cached ones
 *      by slot, then table completions in completion order; compatible
 *      allreduces and broadcasts are packed into the fusion buffer up to the
 *      threshold; a CUDA allreduce whose gradient bucket (bucket.c) is not
 *      complete yet is held for a later round instead.
 *
 * Steady state (every name cached) costs one small allreduce per round. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../reduce/reduce.h"
#include "engine_internal.h"

/* A lone small allreduce rides along with the negotiation round (below). */
#define SPECULATE_MAX_BYTES 4096
/* A lone broadcast or allgather up to this size rides along too: it costs
 * a copy of its data into the round's block, and saves a collective. */
#define SPECULATE_MOVE_MAX_BYTES (64u << 10)
#define BLOCK_HEADER_BYTES 16 /* plus 8: six u32 header words in all */
#define BLOCK_IDS (BLOCK_HEADER_BYTES + 8)
#define ALL_IDLE 0x0101010101010101ull /* eight slot bytes that are all 1 */

/* The first slot at or after i that is not idle (state byte 1), or nslots;
 * idle slots are skipped eight at a time where a whole word is idle. */
static int next_busy(const uint8_t *sv, int i, int nslots) {
    while (i < nslots) {
        if ((i & 7) == 0 && i + 8 <= nslots) {
            uint64_t w;
            memcpy(&w, sv + i, 8);
            if (w == ALL_IDLE) {
                i += 8;
                continue;
            }
        }
        if (sv[i] != 1) return i;
        i++;
    }
    return nslots;
}

/* Where a block's riding data starts after its nids slot ids: 8-aligned, so
 * the kernels read doubles and int64s from it at their alignment. */
static size_t block_data_offset(size_t nids) { return (BLOCK_IDS + 4 * nids + 7) & ~(size_t)7; }

static void stall_check(cring_engine_t *e);

static int ensure_vec(cring_engine_t *e, size_t n) {
    if (n <= e->neg.vec_cap) return 0;
    uint8_t *v = realloc(e->neg.vec, n);
    if (!v) return -1;
    e->neg.vec = v;
    e->neg.vec_cap = n;
    return 0;
}

void cring__negotiate_fail_all(cring_engine_t *e, cring_status_t st, const char *msg) {
    cring__engine_drain(e);
    req_t **list = NULL;
    size_t n = 0, cap = 0;
    for (size_t b = 0; b < e->neg.pending.nbuckets; b++)
        for (cring__strmap_entry_t *x = e->neg.pending.buckets[b]; x; x = x->next) {
            if (n == cap) {
                cap = cap ? 2 * cap : 64;
                req_t **l = realloc(list, cap * sizeof *l);
                if (!l) break;
                list = l;
            }
            list[n++] = x->value;
        }
    cring__strmap_free(&e->neg.pending);
    e->neg.nuncached = 0;
    e->neg.last_attached = NULL;
    for (int i = 0; i < e->cache.capacity; i++) {
        e->cache.slots[i].local = NULL;
        if (e->cache.slot_state[i] == 2) e->cache.slot_state[i] = 1;
    }
    for (size_t i = 0; i < n; i++) {
        if (st != CRING_ERR_CLOSED) { /* say which of this rank's tensors it hit */
            char full[CRING__ERRMSG_BYTES + CRING__MAX_NAME_BYTES + 32];
            snprintf(full, sizeof full, "%s ('%s' was pending)", msg, list[i]->name);
            cring__engine_complete(e, list[i], st, full);
        } else {
            cring__engine_complete(e, list[i], st, msg);
        }
        cring__req_free(list[i]);
    }
    free(list);
    cring__bucket_fail_all(e, st, msg);
    if (e->join.req) {
        req_t *j = e->join.req;
        e->join.req = NULL;
        atomic_store(&e->join.in_flight, 0);
        cring__engine_complete(e, j, st, msg);
        cring__req_free(j);
    }
}

/* A request whose data can travel with this round: the only thing pending
 * here, cached, one small CPU tensor: a plain allreduce, a broadcast or an
 * allgather. */
static req_t *speculation_candidate(cring_engine_t *e) {
    req_t *r = e->neg.last_attached;
    if (!r || e->neg.pending.count != 1 || e->neg.nuncached || r->cache_id < 0) return NULL;
    if (r->ntensors != 1 || r->device.type != CRING_DEVICE_CPU ||
        e->cache.slot_state[r->cache_id] != 2)
        return NULL;
    switch (r->coll) {
    case CRING_COLL_ALLREDUCE: /* Adasum is no sum: it never rides the round */
        if (r->op == CRING_ADASUM || r->compression != CRING_DTYPE_COUNT || r->prescale != 1.0)
            return NULL;
        return r->t[0].bytes <= SPECULATE_MAX_BYTES ? r : NULL;
    case CRING_COLL_BROADCAST:
    case CRING_COLL_ALLGATHER: return r->t[0].bytes <= SPECULATE_MOVE_MAX_BYTES ? r : NULL;
    default: return NULL;
    }
}

/* The bytes rank q appends for spec: the same on every rank, for they come
 * from what the ranks agreed on (the cached slot: root, first dimensions,
 * the trailing shape and dtype). */
static size_t spec_payload(const cring_engine_t *e, const req_t *spec, int q) {
    const tensor_spec_t *t = &spec->t[0];
    switch (spec->coll) {
    case CRING_COLL_BROADCAST: return q == spec->root ? t->bytes : 0;
    case CRING_COLL_ALLGATHER:
        if (q == e->rank) return t->bytes; /* a 0-d tensor gathers as one row */
        return (size_t)e->cache.slots[spec->cache_id].first_dims[q] * t->row_elems *
               cring_dtype_size(t->dtype);
    default: return t->bytes;
    }
}

/* ---- the vector exchange ----------------------------------------------------------
 * Combine every rank's vector with MIN into e->neg.vec (0 beats 2 beats 1 per
 * slot; 0 beats 1 per flag).
 *
 * On shared memory each rank instead contributes a sparse block, gathered in
 * one exchange and combined locally, so a round costs the same however many
 * names are cached: the three flags, the slots it has pending and the slots
 * it invalidates. A rank whose only pending request is a small cached
 * allreduce also appends its data: when every rank did so for the same slot,
 * that request is reduced right here from the gathered blocks (in rank order,
 * so bit-identical on every rank) and needs no collective of its own
 * (*executed_out). Over TCP the dense vector is MIN-allreduced.
 *
 * Block: u32 flags (bit i set when v[i] == 0 for i < 3; bit 3 when this rank
 * joined; bits 4 and 5 when v[3], v[4] == 0), u32 npending, u32 ninvalid,
 * u32 spec_slot + 1, u32 spec_bytes, u32 nslots, then the pending ids, the
 * invalidated ids, then the data. */

static int ensure_block_space(cring_engine_t *e, size_t max_len) {
    const int P = e->size;
    if (max_len > e->neg.block_cap) {
        uint8_t *b = realloc(e->neg.block, max_len);
        if (!b) return -1;
        e->neg.block = b;
        e->neg.block_cap = max_len;
    }
    if (!e->neg.peer_blocks) {
        size_t nslots = (size_t)(e->cache.capacity ? e->cache.capacity : 1);
        e->neg.peer_blocks = calloc((size_t)P, sizeof *e->neg.peer_blocks);
        e->neg.peer_lens = calloc((size_t)P, sizeof *e->neg.peer_lens);
        e->neg.slot_hits = calloc(nslots, sizeof *e->neg.slot_hits);
        e->neg.inval_ids = calloc(nslots, sizeof *e->neg.inval_ids);
        e->neg.touched = calloc(nslots, sizeof *e->neg.touched);
        if (!e->neg.peer_blocks || !e->neg.peer_lens || !e->neg.slot_hits || !e->neg.inval_ids ||
            !e->neg.touched)
            return -1;
    }
    return 0;
}

/* Write this rank's block from its vector; returns its length. */
static size_t encode_block(cring_engine_t *e, const uint8_t *v, int nslots, const req_t *spec,
                           size_t payload) {
    uint32_t *ids = (uint32_t *)(e->neg.block + BLOCK_IDS);
    uint32_t npend = 0, ninval = 0, *inval = e->neg.inval_ids;
    const uint8_t *sv = v + e->join.vhdr;
    for (int i = next_busy(sv, 0, nslots); i < nslots; i = next_busy(sv, i + 1, nslots)) {
        if (sv[i] == 2) ids[npend++] = (uint32_t)i;
        else if (sv[i] == 0) inval[ninval++] = (uint32_t)i;
    }
    memcpy(ids + npend, inval, sizeof *inval * ninval);
    uint32_t header[6] = {(uint32_t)(v[0] == 0) | (uint32_t)(v[1] == 0) << 1 |
                              (uint32_t)(v[2] == 0) << 2 |
                              (uint32_t)(v[CRING__V_HEADER + e->rank] == 0) << 3 |
                              (uint32_t)(v[3] == 0) << 4 | (uint32_t)(v[4] == 0) << 5,
                          npend,
                          ninval,
                          spec ? (uint32_t)spec->cache_id + 1 : 0,
                          (uint32_t)payload,
                          (uint32_t)nslots};
    memcpy(e->neg.block, header, sizeof header);
    size_t len = BLOCK_IDS + 4 * (size_t)(npend + ninval);
    if (!spec) return len;
    size_t data = block_data_offset(npend + ninval);
    memset(e->neg.block + len, 0, data - len);
    len = data;
    /* memmove: gcc inlines a memcpy of unknown length here as `rep movsq`,
     * whose start-up costs more than copying a few bytes */
    memmove(e->neg.block + len, spec->t[0].send, payload);
    return len + payload;
}

/* Combine the gathered blocks into v: flags by OR, pending slots by count,
 * invalidations by union; the slots some rank listed go to e->neg.touched.
 * A slot no rank listed is idle (1) on every rank, this one included, so
 * its byte in v (this rank's own) is already right. *agree: every rank
 * speculated the same slot. */
static cring_status_t combine_blocks(cring_engine_t *e, uint8_t *v, int nslots, const req_t *spec,
                                     int *agree) {
    const int spec_here = spec != NULL;
    const int P = e->size;
    const uint32_t *mine = (const uint32_t *)e->neg.block;
    uint32_t flags = 0;
    *agree = spec_here;
    for (int q = 0; q < P; q++) {
        const uint8_t *b = e->neg.peer_blocks[q];
        uint32_t h[6];
        memcpy(h, b, sizeof h);
        if (e->neg.peer_lens[q] < BLOCK_IDS || h[5] != (uint32_t)nslots ||
            e->neg.peer_lens[q] < BLOCK_IDS + 4 * (size_t)(h[1] + h[2]) ||
            (h[4] && e->neg.peer_lens[q] < block_data_offset(h[1] + h[2]) + h[4])) {
            cring__log(CRING__LOG_ERROR, e->rank, "malformed negotiation block from rank %d", q);
            return CRING_ERR_PROTOCOL;
        }
        flags |= h[0];
        const uint8_t *qids = b + BLOCK_IDS;
        for (uint32_t k = 0; k < h[1] + h[2]; k++) {
            uint32_t id;
            memcpy(&id, qids + 4 * (size_t)k, 4);
            if (id >= (uint32_t)nslots) return CRING_ERR_PROTOCOL;
            e->neg.slot_hits[id] =
                k < h[1] ? e->neg.slot_hits[id] + 1 : (uint16_t)(e->neg.slot_hits[id] | 0x8000);
        }
        if (!spec_here || h[3] != mine[3] || h[4] != spec_payload(e, spec, q)) *agree = 0;
    }
    v[0] = (flags & 1) ? 0 : 1;
    v[1] = (flags & 2) ? 0 : 1;
    v[2] = (flags & 4) ? 0 : 1;
    v[3] = (flags & 16) ? 0 : 1;
    v[4] = (flags & 32) ? 0 : 1;
    for (int q = 0; q < P; q++) {
        uint32_t h0;
        memcpy(&h0, e->neg.peer_blocks[q], sizeof h0);
        v[CRING__V_HEADER + q] = (h0 & 8) ? 0 : 1;
    }
    e->neg.ntouched = 0;
    for (int pass = 0; pass < 2; pass++) /* read back the touched slots, then reset them */
        for (int q = 0; q < P; q++) {
            const uint8_t *b = e->neg.peer_blocks[q];
            uint32_t h[6];
            memcpy(h, b, sizeof h);
            const uint8_t *qids = b + BLOCK_IDS;
            for (uint32_t k = 0; k < h[1] + h[2]; k++) {
                uint32_t id;
                memcpy(&id, qids + 4 * (size_t)k, 4);
                if (pass == 1) {
                    e->neg.slot_hits[id] = 0;
                    continue;
                }
                uint16_t hits = e->neg.slot_hits[id];
                if (hits == 0xffff) continue; /* already decided */
                v[e->join.vhdr + id] = (hits & 0x8000) ? 0 : (hits == (uint16_t)P ? 2 : 1);
                e->neg.slot_hits[id] = 0xffff;
                e->neg.touched[e->neg.ntouched++] = id;
            }
        }
    return CRING_OK;
}

/* Every rank sent spec's data: reduce it from the blocks, in rank order. */
static void reduce_speculated(cring_engine_t *e, req_t *spec) {
    const int P = e->size;
    const void *srcs[P];
    for (int q = 0; q < P; q++) {
        uint32_t h[6];
        memcpy(h, e->neg.peer_blocks[q], sizeof h);
        srcs[q] = (const uint8_t *)e->neg.peer_blocks[q] + block_data_offset(h[1] + h[2]);
    }
    tensor_spec_t *t = &spec->t[0];
    double t0 = cring__engine_tl_now(e);
    cring__reduce_multi(t->dtype, spec->op, t->recv, srcs, P, t->count, P);
    if (spec->postscale != 1.0)
        cring__convert(t->dtype, t->recv, t->dtype, t->recv, t->count, spec->postscale);
    cring__engine_span(e, spec->name, "CPU_ALLREDUCE", t0, cring__engine_tl_now(e),
                       "\"with_negotiation\": true");
    cring__engine_stats_add(&e->stats.collectives, 1);
}

/* Every rank sent spec's part: a broadcast copies the root's block, an
 * allgather concatenates the blocks in rank order into a new result. */
static const uint8_t *block_data(const cring_engine_t *e, int q) {
    uint32_t h[6];
    memcpy(h, e->neg.peer_blocks[q], sizeof h);
    return (const uint8_t *)e->neg.peer_blocks[q] + block_data_offset(h[1] + h[2]);
}

static cring_status_t run_speculated(cring_engine_t *e, req_t *spec) {
    tensor_spec_t *t = &spec->t[0];
    double t0 = cring__engine_tl_now(e);
    if (spec->coll == CRING_COLL_ALLREDUCE) {
        reduce_speculated(e, spec);
        return CRING_OK;
    }
    if (spec->coll == CRING_COLL_BROADCAST) {
        const void *src = e->rank == spec->root ? t->send : block_data(e, spec->root);
        if (src != t->recv) memcpy(t->recv, src, t->bytes);
        cring__engine_span(e, spec->name, "CPU_BCAST", t0, cring__engine_tl_now(e),
                           "\"with_negotiation\": true");
    } else {
        const int P = e->size;
        const int64_t *dims = e->cache.slots[spec->cache_id].first_dims;
        cring_handle_t *h = spec->handle;
        size_t total = 0;
        for (int q = 0; q < P; q++) total += spec_payload(e, spec, q);
        uint8_t *out = NULL;
        if (cring__handle_outputs(h, 1, P) != CRING_OK ||
            !(out = cring__output_place(e, h, 0, t, t->bytes * (size_t)P, total))) {
            e->neg.spec_status = CRING_ERR_NO_MEMORY; /* its response says so (read_slots) */
            return CRING_OK;
        }
        memcpy(h->first_dims, dims, sizeof(int64_t) * (size_t)P);
        for (int q = 0; q < P; q++) {
            size_t n = spec_payload(e, spec, q);
            memcpy(out, q == e->rank ? t->send : block_data(e, q), n);
            out += n;
        }
        cring__engine_span(e, spec->name, "CPU_ALLGATHER", t0, cring__engine_tl_now(e),
                           "\"with_negotiation\": true");
    }
    cring__engine_stats_add(&e->stats.collectives, 1);
    return CRING_OK;
}

static cring_status_t exchange_vector(cring_engine_t *e, size_t vlen, req_t **executed_out) {
    *executed_out = NULL;
    e->neg.ntouched = -1; /* until the blocks say which slots were listed */
    uint8_t *v = e->neg.vec;
    const int nslots = (int)(vlen - e->join.vhdr);
    req_t *spec = speculation_candidate(e);
    size_t payload = spec ? spec_payload(e, spec, e->rank) : 0;
    size_t max_len = BLOCK_IDS + 4 * (size_t)nslots; /* worst case: every slot listed */
    /* the choice of exchange depends only on what every rank knows */
    if (!cring__comm_can_gather_small(e->comm))
        return cring__comm_allreduce(e->comm, v, v, vlen, CRING_UINT8, CRING_MIN);
    const size_t small_max = cring__comm_gather_small_max(e->comm);
    if (max_len > small_max)
        return cring__comm_allreduce(e->comm, v, v, vlen, CRING_UINT8, CRING_MIN);
    if (spec && max_len + payload + 8 > small_max) {
        spec = NULL; /* too large to ride: the other ranks see that in this block */
        payload = 0;
    }
    max_len += payload + 8; /* + the data's alignment */
    if (ensure_block_space(e, max_len) != 0) return CRING_ERR_NO_MEMORY;
    size_t len = encode_block(e, v, nslots, spec, payload);
    CRING_CHECK(
        cring__comm_gather_small(e->comm, e->neg.block, len, e->neg.peer_blocks, e->neg.peer_lens));
    int agree;
    CRING_CHECK(combine_blocks(e, v, nslots, spec, &agree));
    if (agree && v[e->join.vhdr + spec->cache_id] == 2 && v[1] != 0) {
        *executed_out = spec;
        return run_speculated(e, spec);
    }
    return CRING_OK;
}

/* ---- the round's steps ------------------------------------------------------------- */

/* This rank's vector before the MIN. */
static void fill_vector(cring_engine_t *e, uint8_t *v) {
    v[0] = e->neg.nuncached || e->table.ntimeouts ? 0 : 1;
    v[1] = e->neg.abort_requested ? 0 : 1;
    v[2] = e->neg.pending.count || e->join.req || e->bucket.plan.nheld ? 0 : 1;
    int release = cring__bucket_release_wanted(e);
    v[3] = release == CRING__RELEASE_WAITER ? 0 : 1;
    v[4] = release == CRING__RELEASE_IDLE ? 0 : 1;
    memset(v + CRING__V_HEADER, 1, (size_t)e->size);
    /* Joined: nothing of this rank's own is left, and it stands in (with
     * zeros) for every cached name the others have pending. */
    int joined_here = e->join.req && !e->neg.pending.count && !e->neg.nuncached;
    if (joined_here) {
        v[CRING__V_HEADER + e->rank] = 0;
        for (int i = 0; i < e->cache.nslots; i++)
            v[e->join.vhdr + i] =
                !e->cache.slots[i].in_use ? 1 : (e->cache.slot_state[i] == 0 ? 0 : 2);
    } else {
        memcpy(v + e->join.vhdr, e->cache.slot_state, (size_t)e->cache.nslots);
    }
}

/* Some rank asked everyone to stop (CRING_STALL_SHUTDOWN_SECONDS). */
static cring_status_t stall_shutdown(cring_engine_t *e) {
    snprintf(e->broken_msg, sizeof e->broken_msg,
             "a rank stopped the job: some tensor stalled for more than "
             "CRING_STALL_SHUTDOWN_SECONDS=%g (see the stall warnings)",
             e->neg.stall_shutdown_s);
    atomic_store(&e->broken, (int)CRING_ERR_TIMEOUT);
    cring__negotiate_fail_all(e, CRING_ERR_TIMEOUT, e->broken_msg);
    return CRING_ERR_TIMEOUT;
}

static void free_responses(response_list_t *l) {
    for (int i = 0; i < l->n; i++) {
        free(l->items[i].error);
        free(l->items[i].owned_dims);
    }
}

/* Slot i's byte in v is not 1: make its response (ready, 2) or evict it (0). */
static cring_status_t take_slot(cring_engine_t *e, int i, const uint8_t *sv, req_t *spec,
                                response_list_t *l, int all_joined) {
    if (sv[i] == 0) {
        cring__cache_evict(e, i);
        return CRING_OK;
    }
    if (all_joined) return CRING_OK;
    cache_slot_t *s = &e->cache.slots[i];
    req_t *r = s->local;
    char msg[CRING__MAX_NAME_BYTES + 512];
    int conflict = cring__join_conflict(e, s->record, s->record_len, msg, sizeof msg);
    if (!r && !conflict) r = cring__join_ghost(e, s->record, s->record_len);
    response_t *out = r ? cring__response_add(l) : NULL;
    if (!out && (r || !conflict)) {
        if (r && !s->local) cring__req_free(r);
        return CRING_ERR_NO_MEMORY;
    }
    if (out) {
        out->req = r;
        out->first_dims = s->first_dims;
        out->executed = spec && r == spec;
        if (out->executed && e->neg.spec_status != CRING_OK) {
            out->status = e->neg.spec_status;
            out->error = strdup("out of memory");
            e->neg.spec_status = CRING_OK;
        }
        if (conflict) {
            out->status = CRING_ERR_MISMATCH;
            out->error = strdup(msg);
        }
    }
    if (s->local) s->local->cache_id = -1;
    s->local = NULL;
    e->cache.slot_state[i] = 1;
    return CRING_OK;
}

/* Slots whose byte is not 1: ready (2) in slot order, or evicted (0).
 * After a sparse exchange with few slots listed, only those are looked at
 * (sorted: the same order); otherwise every byte is, skipping idle ones
 * eight at a time. Once every rank has joined, a 2 is only the joined
 * ranks' stand-in. */
static cring_status_t read_slots(cring_engine_t *e, const uint8_t *v, req_t *spec,
                                 response_list_t *l) {
    const uint8_t *sv = v + e->join.vhdr;
    const int nslots = e->cache.nslots;
    const int all_joined = e->join.njoined == e->size;
    const int nt = e->neg.ntouched;
    if (nt >= 0 && (size_t)nt * 8 < (size_t)nslots) {
        uint32_t *ids = e->neg.touched;
        for (int a = 1; a < nt; a++) { /* insertion sort: a few ids */
            uint32_t id = ids[a];
            int b = a - 1;
            for (; b >= 0 && ids[b] > id; b--) ids[b + 1] = ids[b];
            ids[b + 1] = id;
        }
        for (int a = 0; a < nt; a++)
            if ((int)ids[a] < nslots && sv[ids[a]] != 1)
                CRING_CHECK(take_slot(e, (int)ids[a], sv, spec, l, all_joined));
    } else {
        for (int i = next_busy(sv, 0, nslots); i < nslots; i = next_busy(sv, i + 1, nslots))
            CRING_CHECK(take_slot(e, i, sv, spec, l, all_joined));
    }
    while (e->cache.nslots > 0 && !e->cache.slots[e->cache.nslots - 1].in_use) e->cache.nslots--;
    return CRING_OK;
}

/* The responses' requests are no longer pending here. */
static void mark_ready(cring_engine_t *e, response_list_t *l) {
    double t_ready = cring__engine_tl_now(e);
    for (int i = 0; i < l->n; i++) {
        req_t *r = l->items[i].req;
        r->ready_s = t_ready;
        if (!r->handle) continue; /* a joined rank's stand-in */
        if (r == e->neg.last_attached) e->neg.last_attached = NULL;
        cring__strmap_remove_h(&e->neg.pending, r->name, r->name_hash);
        if (e->timeline) cring__engine_span_negotiated(e, r, t_ready);
    }
}

/* Hold what waits for its bucket, run the rest, then recycle their requests. */
static cring_status_t execute_responses(cring_engine_t *e, response_list_t *l, const uint8_t *v) {
    cring__bucket_round(e, l, v[3] == 0 || v[4] == 0, v[4] == 0);
    cring_status_t st = cring__execute(e, l->items, l->n);
    if (l->n > 0) cring__bucket_ran(e);
    for (int i = 0; i < l->n; i++) cring__req_recycle(e, l->items[i].req);
    free_responses(l);
    return st;
}

cring_status_t cring__negotiate_round(cring_engine_t *e, int *progress) {
    *progress = 0;
    const size_t vlen = e->join.vhdr + (size_t)e->cache.nslots;
    if (ensure_vec(e, vlen) != 0) return CRING_ERR_NO_MEMORY;
    uint8_t *v = e->neg.vec;
    fill_vector(e, v);
    cring__comm_announce(e->comm, e->drive.rounds_done + 1);
    req_t *spec = NULL;
    cring_status_t st = exchange_vector(e, vlen, &spec);
    e->drive.rounds_done++;
    cring__engine_stats_add(&e->stats.cycles, 1);
    if (e->timeline && atomic_load(&e->timeline_mark_cycles)) cring__engine_mark_cycle(e);
    if (st != CRING_OK) return cring__engine_transport_failed(e, st);
    if (v[1] == 0) return stall_shutdown(e);
    int grew = cring__join_update(e, v);

    /* the responses live in e->neg.resp between rounds: no malloc per round */
    response_list_t l = {e->neg.resp, 0, e->neg.cap_resp};
    st = read_slots(e, v, spec, &l);
    if (st == CRING_OK && v[0] == 0) st = cring__table_exchange(e, &l);
    if (st == CRING_OK && grew) st = cring__join_sweep(e, &l);
    if (st != CRING_OK) {
        free_responses(&l);
        e->neg.resp = l.items;
        e->neg.cap_resp = l.cap;
        return cring__engine_transport_failed(e, st);
    }
    mark_ready(e, &l);
    if (cring__join_finish(e)) *progress = 1;
    st = execute_responses(e, &l, v);
    e->neg.resp = l.items;
    e->neg.cap_resp = l.cap;
    /* a request held this round that this rank already votes to release:
     * the next round releases it, so a waiting driver runs it at once */
    *progress =
        *progress || l.n > 0 || (e->bucket.plan.nheld > 0 && cring__bucket_release_wanted(e));
    if (st != CRING_OK) return cring__engine_transport_failed(e, st);
    stall_check(e);
    if (e->tune.on && (st = cring__autotune_round(e)) != CRING_OK)
        return cring__engine_transport_failed(e, st);
    return CRING_OK;
}

/* The engine is going: free the round's buffers. */
void cring__negotiate_free(cring_engine_t *e) {
    cring__bucket_free(e);
    free(e->neg.uncached);
    free(e->neg.vec);
    free(e->neg.block);
    free(e->neg.resp);
    free(e->neg.peer_blocks);
    free(e->neg.peer_lens);
    free(e->neg.slot_hits);
    free(e->neg.inval_ids);
    free(e->neg.touched);
    e->neg.touched = NULL;
    e->neg.uncached = NULL;
    e->neg.vec = e->neg.block = NULL;
    e->neg.resp = NULL;
    e->neg.peer_blocks = NULL;
    e->neg.peer_lens = NULL;
    e->neg.slot_hits = NULL;
    e->neg.inval_ids = NULL;
    e->neg.nuncached = e->neg.cap_uncached = e->neg.vec_cap = e->neg.block_cap = 0;
    e->neg.cap_resp = 0;
}

/* ---- stall check -------------------------------------------------------------------- */

static void stall_check(cring_engine_t *e) {
    double now = cring__now_coarse_s();
    if (now - e->neg.last_stall_check_s < 0.05) return;
    e->neg.last_stall_check_s = now;
    /* Cached requests carry no rank detail: after half the stall threshold
     * (or a quarter of the time-out), have everyone re-describe them so the
     * table can name the missing ranks and rank 0 can time them out. */
    double redescribe_s = e->neg.stall_check_s / 2;
    if (e->neg.timeout_s > 0 && e->neg.timeout_s / 4 < redescribe_s)
        redescribe_s = e->neg.timeout_s / 4;
    for (int i = 0; i < e->cache.nslots; i++) {
        cache_slot_t *s = &e->cache.slots[i];
        if (s->in_use && s->local && now - s->local->submit_s > redescribe_s)
            e->cache.slot_state[i] = 0;
    }
    cring__table_check_timeouts(e, now);
    for (size_t b = 0; b < e->table.map.nbuckets; b++)
        for (cring__strmap_entry_t *x = e->table.map.buckets[b]; x; x = x->next) {
            table_entry_t *t = x->value;
            double age = now - t->first_seen_s;
            if (e->neg.stall_shutdown_s > 0 && age > e->neg.stall_shutdown_s)
                e->neg.abort_requested = 1;
            if (t->warned || age < e->neg.stall_check_s || !t->records[e->rank]) continue;
            char missing[512] = "", present[512] = "";
            size_t mo = 0, po = 0;
            for (int r = 0; r < e->size; r++) {
                char *buf = t->records[r] ? present : missing;
                size_t *o = t->records[r] ? &po : &mo;
                if (*o < sizeof missing - 16)
                    *o +=
                        (size_t)snprintf(buf + *o, sizeof missing - *o, "%s%d", *o ? ", " : "", r);
            }
            cring__log(CRING__LOG_WARNING, e->rank,
                       "stall: tensor '%s' was submitted by ranks [%s] %.0f s ago; missing "
                       "ranks: [%s] (CRING_STALL_CHECK_SECONDS=%g)",
                       t->name, present, age, missing, e->neg.stall_check_s);
            t->warned = 1;
        }
}

/* engine.c: the background engine. Requests are queued by any thread; one
 * driving thread at a time (the engine thread, or a thread waiting on its own
 * handle) runs negotiation rounds with the other ranks, executes what every
 * rank has submitted, fuses small allreduces and broadcasts into one buffer,
 * and completes handles. Collectives come from the communicator; this file
 * never touches sockets, shared memory or reduction kernels' internals.
 *
 * One negotiation round (every rank runs the same rounds in the same order):
 *
 *   1. MIN-allreduce of a byte vector V:
 *        V[0] = 0 if this rank has uncached requests to describe, else 1
 *        V[1] = 0 if this rank asks everyone to stop (stall shutdown), else 1
 *        V[2] = 0 if this rank has anything pending, else 1
 *        V[3+i] per response-cache slot i: 0 invalidate, 2 pending here,
 *               1 otherwise. After MIN: 2 means pending on every rank (ready),
 *               0 means some rank's request no longer matches (evict).
 *   2. If MIN(V[0]) == 0: allgather of every rank's uncached request records.
 *      Every rank feeds them, in rank order, into the same table; a name is
 *      complete once all ranks described it, and is then checked (shape,
 *      dtype, op, root), answered, and put in the cache.
 *   3. Ready requests run in one order on every rank: cached ones by slot,
 *      then table completions in completion order; compatible allreduces and
 *      broadcasts are packed into the fusion buffer up to the threshold.
 *
 * Steady state (every name cached) costs one small allreduce per round. */
#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "../core/comm_internal.h"
#include "../reduce/reduce.h"
#include "strmap.h"
#include "timeline.h"

#define V_HEADER 3
#define DEFAULT_FUSION_THRESHOLD (64u << 20)
#define DEFAULT_CACHE_CAPACITY 1024
#define MAX_NAME_BYTES 4096
/* A lone small allreduce rides along with the negotiation round (below). */
#define SPECULATE_MAX_BYTES 4096
#define BLOCK_HEADER_BYTES 16 /* plus 8: six u32 header words in all */

/* ---- requests and handles ----------------------------------------------------- */

typedef struct tensor_spec {
    const void *send;
    void *recv;
    cring_dtype_t dtype;
    int ndim;
    int64_t *shape;
    size_t count; /* elements */
    size_t bytes;
    size_t row_elems; /* elements per first-dimension row */
} tensor_spec_t;

typedef struct req {
    char *name;
    cring_collective_t coll;
    cring_op_t op;
    int root;
    double prescale, postscale;
    cring_dtype_t compression; /* CRING_DTYPE_COUNT: none */
    int ntensors;
    tensor_spec_t *t;
    int64_t *splits; /* alltoall: rows sent to each rank (size entries) */
    void *ghost;     /* a joined rank's stand-in: its zero buffer (handle is NULL) */
    cring_handle_t *handle;
    uint8_t *record; /* this rank's description of the request */
    size_t record_len;
    int cache_id;    /* slot in the response cache, -1 when not cached */
    int wants_resend;
    double submit_s, ready_s;
    struct req *next;
    size_t alloc_bytes; /* of this allocation, so a spare can be reused */
} req_t;

struct cring_handle {
    _Atomic int done;
    _Atomic int refs; /* the caller's and the engine's */
    cring_status_t status;
    char *error;
    int ntensors;
    int size;
    void **outputs; /* allgather results */
    size_t *output_bytes;
    int64_t *first_dims; /* ntensors x size */
    int64_t value;       /* join: the last rank to join */
    cring_engine_t *engine;
};

/* ---- negotiation state ------------------------------------------------------------ */

typedef struct cache_slot {
    int in_use;
    char *name;
    uint8_t *record; /* this rank's record when it was cached */
    size_t record_len;
    int64_t *first_dims; /* ntensors x size, for allgather */
    req_t *local;        /* this rank's request pending on this slot */
} cache_slot_t;

typedef struct table_entry {
    char *name;
    uint8_t **records; /* size entries, NULL until that rank described it */
    size_t *lens;
    int have;
    double first_seen_s;
    int warned;
} table_entry_t;

typedef struct response {
    req_t *req;
    int executed; /* its data already travelled with the negotiation round */
    cring_status_t status; /* CRING_ERR_MISMATCH with message, or OK */
    char *error;
    const int64_t *first_dims; /* allgather: ntensors x size (not owned) */
    int64_t *owned_dims;
} response_t;

struct cring_engine {
    cring_comm_t *comm;
    int rank, size;
    _Atomic int refs;
    pthread_t thread;
    int thread_started;
    _Atomic int stop;
    _Atomic int broken;           /* CRING_OK while usable */
    char broken_msg[CRING__ERRMSG_BYTES];

    /* submission */
    pthread_mutex_t queue_mu;
    req_t *queue_head, *queue_tail;
    cring__strmap_t in_flight; /* name -> req, from submit to completion */

    /* completion */
    pthread_mutex_t done_mu;
    pthread_cond_t done_cv;
    _Atomic int done_waiters; /* threads blocked on done_cv */

    /* driving state, under progress_mu */
    pthread_mutex_t progress_mu;
    _Atomic int callers_waiting; /* threads blocked on progress_mu for their own handle */
    _Atomic int thread_parked;   /* the engine thread waits for a busy driver to leave */
    /* Large allgather/alltoall results handed back by freed handles, kept for
     * the next result of the same size: fresh memory costs a page fault per
     * page, which dominated large allgathers. */
    _Atomic(cring_handle_t *) spare_handle; /* the last freed handle, for the next submit */
    _Atomic(req_t *) spare_req;             /* the last request run, likewise */
    pthread_mutex_t spare_mu;
    void *spare[4];
    size_t spare_bytes[4];
    int over_tcp;                /* the communicator's transport is TCP */
    cring__strmap_t pending;      /* drained requests waiting for a response */
    req_t **uncached;             /* requests to describe in the next round */
    size_t nuncached, cap_uncached;
    cache_slot_t *cache;
    uint8_t *slot_state; /* this rank's vector byte per slot: 0 invalidate, 1 idle, 2 pending */
    int cache_capacity, cache_slots; /* slots[0..cache_slots) are in the vector */
    cring__strmap_t cache_index;     /* name -> slot + 1 */
    cring__strmap_t table;           /* name -> table_entry_t */
    uint8_t *vec;
    size_t vec_cap;
    uint8_t *block; /* this rank's negotiation block, when gathering */
    response_t *resp; /* run_round's responses, kept between rounds (no malloc per round) */
    int cap_resp;
    size_t block_cap;
    const void **peer_blocks;
    size_t *peer_lens;
    uint16_t *slot_hits; /* per slot while combining blocks; all zero between rounds */
    uint32_t *inval_ids; /* scratch: slots this rank invalidates in a round */
    req_t *last_attached; /* the request most recently matched to a cache slot */
    void *fusion;
    size_t fusion_cap;
    uint64_t rounds_done;
    int abort_requested;
    double last_stall_check_s;

    /* join: vector bytes [V_HEADER, vhdr) carry one joined flag per rank */
    size_t vhdr;
    req_t *join_req;          /* this rank's join, once drained */
    _Atomic int join_in_flight; /* from submit to completion: no other submissions */
    uint8_t *joined;          /* per rank, as of the last round */
    uint64_t *join_round;     /* per rank: the round it was first seen joined, 0 if not */
    int njoined;

    /* configuration */
    size_t fusion_threshold;
    double cycle_time_s;
    double stall_check_s, stall_shutdown_s;

    /* introspection (relaxed atomics: counters only) */
    struct {
        _Atomic uint64_t cycles, collectives, tensors, fused_tensors, cache_hits, errors;
    } stats;
    pthread_mutex_t timeline_mu;
    cring__timeline_t *timeline;
    _Atomic int timeline_on; /* read without the lock by submitters */
};

static _Thread_local char submit_error[CRING__ERRMSG_BYTES];

const char *cring_engine_error_message(void) { return submit_error; }

static cring_status_t submit_fail(cring_status_t st, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static cring_status_t submit_fail(cring_status_t st, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(submit_error, sizeof submit_error, fmt, ap);
    va_end(ap);
    return st;
}

static const char *collective_name(cring_collective_t c) {
    switch (c) {
    case CRING_COLL_ALLREDUCE: return "allreduce";
    case CRING_COLL_BROADCAST: return "broadcast";
    case CRING_COLL_ALLGATHER: return "allgather";
    case CRING_COLL_REDUCESCATTER: return "reducescatter";
    case CRING_COLL_BARRIER: return "barrier";
    case CRING_COLL_ALLTOALL: return "alltoall";
    case CRING_COLL_JOIN: return "join";
    }
    return "unknown";
}

static void engine_release(cring_engine_t *e);
static void *output_alloc(cring_engine_t *e, size_t bytes);
static void output_free(cring_engine_t *e, void *p, size_t bytes);

/* A request and everything it owns (tensor specs, shapes, name, record) is
 * one allocation. */
static void req_free(req_t *r) {
    if (r) free(r->ghost);
    free(r);
}

static void handle_release(cring_handle_t *h) {
    if (atomic_fetch_sub(&h->refs, 1) != 1) return;
    cring_engine_t *e = h->engine;
    for (int i = 0; h->outputs && i < h->ntensors; i++)
        output_free(e, h->outputs[i], h->output_bytes ? h->output_bytes[i] : 0);
    free(h->outputs);
    free(h->output_bytes);
    free(h->first_dims);
    free(h->error);
    /* keep one for the next submission: a synchronous loop then allocates
     * no handle (the engine frees the spare when it goes) */
    if (e) free(atomic_exchange(&e->spare_handle, h));
    else free(h);
    if (e) engine_release(e);
}

/* ---- request records ----------------------------------------------------------------
 * u16 name_len, name, u8 collective, u8 op, u8 compression, i32 root,
 * u16 ntensors, then per tensor: u8 dtype, u8 ndim, i64 shape[ndim]
 * (little-endian). Everything every rank must agree on, except an
 * allgather's first dimensions. */

typedef struct parsed {
    const char *name;
    size_t name_len;
    int coll, op, compression, root, ntensors;
    const uint8_t *tensors; /* start of the tensor section */
    size_t tensors_len;
} parsed_t;

static void put_le(uint8_t **p, uint64_t v, int n) {
    for (int i = 0; i < n; i++) (*p)[i] = (uint8_t)(v >> (8 * i));
    *p += n;
}

static uint64_t get_le(const uint8_t *p, int n) {
    uint64_t v = 0;
    for (int i = 0; i < n; i++) v |= (uint64_t)p[i] << (8 * i);
    return v;
}

static size_t record_bytes(const cring_request_t *q) {
    size_t len = 2 + strlen(q->name) + 1 + 1 + 1 + 4 + 2;
    for (int i = 0; i < q->ntensors; i++) len += 2 + 8 * (size_t)q->tensors[i].ndim;
    return len;
}

/* Write r's record into r->record (sized by record_bytes). */
static void build_record(req_t *r) {
    size_t name_len = strlen(r->name);
    uint8_t *p = r->record;
    put_le(&p, name_len, 2);
    memcpy(p, r->name, name_len);
    p += name_len;
    put_le(&p, (uint64_t)r->coll, 1);
    put_le(&p, (uint64_t)r->op, 1);
    put_le(&p, (uint64_t)r->compression, 1);
    put_le(&p, (uint64_t)(uint32_t)r->root, 4);
    put_le(&p, (uint64_t)r->ntensors, 2);
    for (int i = 0; i < r->ntensors; i++) {
        put_le(&p, (uint64_t)r->t[i].dtype, 1);
        put_le(&p, (uint64_t)r->t[i].ndim, 1);
        for (int d = 0; d < r->t[i].ndim; d++) put_le(&p, (uint64_t)r->t[i].shape[d], 8);
    }
    r->record_len = (size_t)(p - r->record);
}

/* Parse and bounds-check a record (records come from other processes). */
static int parse_record(const uint8_t *rec, size_t len, parsed_t *out) {
    if (len < 2) return -1;
    size_t name_len = get_le(rec, 2);
    if (len < 2 + name_len + 9) return -1;
    const uint8_t *p = rec + 2 + name_len;
    out->name = (const char *)rec + 2;
    out->name_len = name_len;
    out->coll = (int)p[0];
    out->op = (int)p[1];
    out->compression = (int)p[2];
    out->root = (int)(int32_t)get_le(p + 3, 4);
    out->ntensors = (int)get_le(p + 7, 2);
    out->tensors = p + 9;
    out->tensors_len = len - (size_t)(out->tensors - rec);
    size_t off = 0;
    for (int i = 0; i < out->ntensors; i++) {
        if (off + 2 > out->tensors_len) return -1;
        off += 2 + 8 * (size_t)out->tensors[off + 1];
    }
    return off == out->tensors_len ? 0 : -1;
}

/* Describe tensor i of a parsed record: "float32 [4, 3]". */
static void describe_tensor(const parsed_t *p, int i, char *out, size_t n) {
    size_t off = 0;
    for (int k = 0; k < i; k++) off += 2 + 8 * (size_t)p->tensors[off + 1];
    int ndim = p->tensors[off + 1];
    int w = snprintf(out, n, "%s [", cring_dtype_name((cring_dtype_t)p->tensors[off]));
    for (int d = 0; d < ndim && w > 0 && (size_t)w < n; d++)
        w += snprintf(out + w, n - (size_t)w, "%s%lld", d ? ", " : "",
                      (long long)(int64_t)get_le(p->tensors + off + 2 + 8 * (size_t)d, 8));
    if (w > 0 && (size_t)w < n) snprintf(out + w, n - (size_t)w, "]");
}

/* How rank r's request differs from rank 0's, or 0 when they agree. */
static int difference(const parsed_t *a, const parsed_t *b, char *out, size_t n) {
    if (a->coll != b->coll)
        return snprintf(out, n, "collective %s vs %s", collective_name(a->coll),
                        collective_name(b->coll));
    if (a->ntensors != b->ntensors)
        return snprintf(out, n, "a group of %d tensors vs %d", a->ntensors, b->ntensors);
    if (a->op != b->op)
        return snprintf(out, n, "op %s vs %s", cring_op_name(a->op), cring_op_name(b->op));
    if (a->root != b->root) return snprintf(out, n, "root rank %d vs %d", a->root, b->root);
    if (a->compression != b->compression) return snprintf(out, n, "compression differs");
    size_t oa = 0, ob = 0;
    for (int i = 0; i < a->ntensors; i++) {
        int nda = a->tensors[oa + 1], ndb = b->tensors[ob + 1];
        int same = a->tensors[oa] == b->tensors[ob] && nda == ndb;
        for (int d = 0; same && d < nda; d++) {
            if (d == 0 && (a->coll == CRING_COLL_ALLGATHER || a->coll == CRING_COLL_ALLTOALL)) continue;
            same = get_le(a->tensors + oa + 2 + 8 * (size_t)d, 8) ==
                   get_le(b->tensors + ob + 2 + 8 * (size_t)d, 8);
        }
        if (!same) {
            char da[160], db[160];
            describe_tensor(a, i, da, sizeof da);
            describe_tensor(b, i, db, sizeof db);
            const char *what = a->tensors[oa] != b->tensors[ob] ? "dtype" : "shape";
            if (a->ntensors > 1) return snprintf(out, n, "%s of tensor %d: %s vs %s", what, i, da, db);
            return snprintf(out, n, "%s %s vs %s", what, da, db);
        }
        oa += 2 + 8 * (size_t)nda;
        ob += 2 + 8 * (size_t)ndb;
    }
    return 0;
}

/* First dimension of every tensor of a parsed record into dims[i*size + r]. */
static void record_first_dims(const parsed_t *p, int r, int size, int64_t *dims) {
    size_t off = 0;
    for (int i = 0; i < p->ntensors; i++) {
        int ndim = p->tensors[off + 1];
        dims[(size_t)i * (size_t)size + (size_t)r] =
            ndim ? (int64_t)get_le(p->tensors + off + 2, 8) : 1;
        off += 2 + 8 * (size_t)ndim;
    }
}

/* ---- completion -------------------------------------------------------------------------- */

/* Only the driver (progress_mu held) counts, so a plain load and store
 * suffice: a locked add costs more than some whole steps of a small
 * allreduce. Readers load the fields atomically. */
static void stats_add(cring_engine_t *e, _Atomic uint64_t *field, uint64_t n) {
    (void)e; /* counters live in e; the pointer is passed for symmetry with callers */
    atomic_store_explicit(field, atomic_load_explicit(field, memory_order_relaxed) + n,
                          memory_order_relaxed);
}

/* Complete a request: record the status, drop the name from the in-flight set,
 * wake waiters, release the engine's reference. The caller owns r. */
static void complete(cring_engine_t *e, req_t *r, cring_status_t st, const char *error) {
    cring_handle_t *h = r->handle;
    if (!h) return; /* a joined rank's stand-in */
    if (e->timeline) { /* a user who saw the handle complete finds it in the file */
        pthread_mutex_lock(&e->timeline_mu);
        cring__timeline_flush(e->timeline);
        pthread_mutex_unlock(&e->timeline_mu);
    }
    h->status = st;
    if (st != CRING_OK) h->error = strdup(error && *error ? error : cring_status_string(st));
    pthread_mutex_lock(&e->queue_mu);
    cring__strmap_remove(&e->in_flight, r->name);
    pthread_mutex_unlock(&e->queue_mu);
    stats_add(e, &e->stats.tensors, (uint64_t)r->ntensors);
    if (st != CRING_OK) stats_add(e, &e->stats.errors, 1);
    atomic_store(&h->done, 1);
    if (atomic_load(&e->done_waiters)) { /* seq_cst: pairs with wait_done_cv */
        pthread_mutex_lock(&e->done_mu);
        pthread_cond_broadcast(&e->done_cv);
        pthread_mutex_unlock(&e->done_mu);
    }
    handle_release(h);
}

/* ---- submission -------------------------------------------------------------------------- */

static cring_status_t validate(cring_engine_t *e, const cring_request_t *q) {
    if (!q->name || !*q->name) return submit_fail(CRING_ERR_INVALID_ARGUMENT, "a request needs a name");
    if (strlen(q->name) > MAX_NAME_BYTES)
        return submit_fail(CRING_ERR_INVALID_ARGUMENT, "name of %zu bytes is too long (max %d)",
                           strlen(q->name), MAX_NAME_BYTES);
    if (q->collective < CRING_COLL_ALLREDUCE || q->collective > CRING_COLL_JOIN)
        return submit_fail(CRING_ERR_INVALID_ARGUMENT, "unknown collective %d", (int)q->collective);
    if (q->ntensors < 0 || q->ntensors > 65535 || (q->ntensors && !q->tensors))
        return submit_fail(CRING_ERR_INVALID_ARGUMENT, "'%s': bad tensor list", q->name);
    int bare = q->collective == CRING_COLL_BARRIER || q->collective == CRING_COLL_JOIN;
    if (bare && q->ntensors)
        return submit_fail(CRING_ERR_INVALID_ARGUMENT, "a %s carries no tensors",
                           collective_name(q->collective));
    if (!bare && !q->ntensors)
        return submit_fail(CRING_ERR_INVALID_ARGUMENT, "'%s': no tensors", q->name);
    if (q->collective == CRING_COLL_ALLTOALL) {
        if (q->ntensors != 1)
            return submit_fail(CRING_ERR_INVALID_ARGUMENT, "'%s': alltoall takes one tensor", q->name);
        const cring_tensor_t *t = &q->tensors[0];
        if (t->ndim < 1 || !t->shape)
            return submit_fail(CRING_ERR_INVALID_ARGUMENT,
                               "'%s': alltoall needs a tensor with at least one dimension", q->name);
        if (q->splits) {
            int64_t sum = 0;
            for (int r = 0; r < e->size; r++) {
                if (q->splits[r] < 0)
                    return submit_fail(CRING_ERR_INVALID_ARGUMENT,
                                       "'%s': alltoall split %d for rank %d is negative", q->name,
                                       (int)q->splits[r], r);
                sum += q->splits[r];
            }
            if (sum != t->shape[0])
                return submit_fail(CRING_ERR_INVALID_ARGUMENT,
                                   "'%s': alltoall splits add up to %lld rows but the tensor's "
                                   "first dimension is %lld",
                                   q->name, (long long)sum, (long long)t->shape[0]);
        } else if (t->shape[0] % e->size) {
            return submit_fail(CRING_ERR_INVALID_ARGUMENT,
                               "'%s': alltoall without splits divides the first dimension (%lld) "
                               "evenly among %d ranks; it does not divide: pass splits",
                               q->name, (long long)t->shape[0], e->size);
        }
    }
    if (q->collective == CRING_COLL_BROADCAST && (q->root < 0 || q->root >= e->size))
        return submit_fail(CRING_ERR_INVALID_ARGUMENT,
                           "'%s': root rank %d is out of range for size %d", q->name, q->root,
                           e->size);
    int reduces = q->collective == CRING_COLL_ALLREDUCE || q->collective == CRING_COLL_REDUCESCATTER;
    int has_compression = q->compression != CRING_DTYPE_COUNT;
    if (has_compression && q->compression != CRING_FLOAT16 && q->compression != CRING_BFLOAT16)
        return submit_fail(CRING_ERR_INVALID_ARGUMENT, "'%s': compression must be float16 or bfloat16",
                           q->name);
    if (has_compression && q->collective != CRING_COLL_ALLREDUCE)
        return submit_fail(CRING_ERR_INVALID_ARGUMENT, "'%s': compression applies to allreduce only",
                           q->name);
    for (int i = 0; i < q->ntensors; i++) {
        const cring_tensor_t *t = &q->tensors[i];
        if (!cring_dtype_size(t->dtype))
            return submit_fail(CRING_ERR_INVALID_ARGUMENT, "'%s': invalid dtype", q->name);
        if (t->ndim < 0 || t->ndim > 32 || (t->ndim && !t->shape))
            return submit_fail(CRING_ERR_INVALID_ARGUMENT, "'%s': bad shape", q->name);
        for (int d = 0; d < t->ndim; d++)
            if (t->shape[d] < 0)
                return submit_fail(CRING_ERR_INVALID_ARGUMENT, "'%s': negative dimension", q->name);
        if (reduces && !cring__reduce_supported(t->dtype, q->op))
            return submit_fail(CRING_ERR_NOT_SUPPORTED, "'%s': op %s cannot reduce %s", q->name,
                               cring_op_name(q->op), cring_dtype_name(t->dtype));
        if (has_compression && t->dtype != CRING_FLOAT32)
            return submit_fail(CRING_ERR_INVALID_ARGUMENT,
                               "'%s': compression applies to float32 tensors, not %s", q->name,
                               cring_dtype_name(t->dtype));
        if (q->collective == CRING_COLL_REDUCESCATTER && t->ndim == 0)
            return submit_fail(CRING_ERR_INVALID_ARGUMENT,
                               "'%s': reducescatter needs at least one dimension", q->name);
    }
    return CRING_OK;
}

/* Free a request that has run, keeping it as the engine's spare if it is
 * the biggest seen lately: a loop of synchronous calls then allocates none. */
static void req_recycle(cring_engine_t *e, req_t *r) {
    if (!r || r->ghost) {
        req_free(r);
        return;
    }
    req_t *old = atomic_exchange(&e->spare_req, r);
    if (old && old->alloc_bytes > r->alloc_bytes) old = atomic_exchange(&e->spare_req, old);
    free(old);
}

static req_t *make_req(cring_engine_t *e, const cring_request_t *q, int size) {
    size_t ndims = 0, name_len = strlen(q->name);
    for (int i = 0; i < q->ntensors; i++) ndims += (size_t)q->tensors[i].ndim;
    size_t nsplits = q->collective == CRING_COLL_ALLTOALL ? (size_t)size : 0;
    ndims += nsplits;
    size_t bytes = sizeof(req_t) + sizeof(tensor_spec_t) * (size_t)q->ntensors +
                   sizeof(int64_t) * ndims + name_len + 1 + record_bytes(q);
    req_t *r = e ? atomic_exchange(&e->spare_req, NULL) : NULL;
    if (r && r->alloc_bytes < bytes) {
        free(r);
        r = NULL;
    }
    size_t alloc_bytes = r ? r->alloc_bytes : bytes;
    if (!r) r = malloc(bytes);
    if (!r) return NULL;
    memset(r, 0, sizeof *r);
    r->alloc_bytes = alloc_bytes;
    r->t = (tensor_spec_t *)(r + 1);
    int64_t *dims = (int64_t *)(r->t + q->ntensors);
    r->name = (char *)(dims + ndims);
    r->record = (uint8_t *)r->name + name_len + 1;
    memcpy(r->name, q->name, name_len + 1);
    r->coll = q->collective;
    r->op = q->op;
    r->root = q->root;
    r->prescale = q->prescale == 0 ? 1.0 : q->prescale;
    r->postscale = q->postscale == 0 ? 1.0 : q->postscale;
    r->compression = q->compression;
    r->ntensors = q->ntensors;
    r->cache_id = -1;
    if (nsplits) {
        r->splits = dims;
        dims += nsplits;
        for (size_t k = 0; k < nsplits; k++)
            r->splits[k] = q->splits ? q->splits[k] : q->tensors[0].shape[0] / size;
    }
    for (int i = 0; i < q->ntensors; i++) {
        const cring_tensor_t *in = &q->tensors[i];
        tensor_spec_t *t = &r->t[i];
        t->send = in->send;
        t->recv = in->recv;
        t->dtype = in->dtype;
        t->ndim = in->ndim;
        t->shape = dims;
        dims += in->ndim;
        t->count = 1;
        t->row_elems = 1;
        for (int d = 0; d < in->ndim; d++) {
            t->shape[d] = in->shape[d];
            t->count *= (size_t)in->shape[d];
            if (d > 0) t->row_elems *= (size_t)in->shape[d];
        }
        t->bytes = t->count * cring_dtype_size(t->dtype);
    }
    build_record(r);
    return r;
}

cring_status_t cring_engine_submit(cring_engine_t *e, const cring_request_t *q,
                                   cring_handle_t **handle_out) {
    *handle_out = NULL;
    submit_error[0] = 0;
    if (atomic_load(&e->broken) != CRING_OK)
        return submit_fail(CRING_ERR_BROKEN, "the engine failed earlier: %s", e->broken_msg);
    CRING_CHECK(validate(e, q));
    req_t *r = make_req(e, q, e->size);
    cring_handle_t *h = atomic_exchange(&e->spare_handle, NULL);
    if (h) memset(h, 0, sizeof *h);
    else h = calloc(1, sizeof *h);
    if (!r || !h) {
        req_free(r);
        free(h);
        return submit_fail(CRING_ERR_NO_MEMORY, "out of memory");
    }
    h->ntensors = q->ntensors;
    h->size = e->size;
    h->value = -1;
    h->engine = e;
    atomic_store(&h->refs, 2);
    r->handle = h;
    /* the coarse clock is cheaper but lags: the timeline needs the precise one */
    r->submit_s = atomic_load(&e->timeline_on) ? cring__now_s() : cring__now_coarse_s();
    pthread_mutex_lock(&e->queue_mu);
    if (atomic_load(&e->stop)) { /* checked under the lock: stop drains the queue after */
        pthread_mutex_unlock(&e->queue_mu);
        req_free(r);
        free(h);
        return submit_fail(CRING_ERR_CLOSED, "cring has been shut down");
    }
    if (atomic_load(&e->join_in_flight)) {
        pthread_mutex_unlock(&e->queue_mu);
        req_free(r);
        free(h);
        return submit_fail(CRING_ERR_INVALID_ARGUMENT,
                           "rank %d has called join(): no collective may be submitted until "
                           "join() returns", e->rank);
    }
    if (cring__strmap_get(&e->in_flight, r->name)) {
        pthread_mutex_unlock(&e->queue_mu);
        cring_status_t st = submit_fail(CRING_ERR_INVALID_ARGUMENT,
                                        "a request named '%s' is already in flight on rank %d; "
                                        "names must be unique until synchronized",
                                        r->name, e->rank);
        req_free(r);
        free(h);
        return st;
    }
    if (cring__strmap_put_borrowed(&e->in_flight, r->name, r) != 0) {
        pthread_mutex_unlock(&e->queue_mu);
        req_free(r);
        free(h);
        return submit_fail(CRING_ERR_NO_MEMORY, "out of memory");
    }
    atomic_fetch_add(&e->refs, 1);
    if (r->coll == CRING_COLL_JOIN) atomic_store(&e->join_in_flight, 1);
    if (e->queue_tail) e->queue_tail->next = r;
    else e->queue_head = r;
    e->queue_tail = r;
    pthread_mutex_unlock(&e->queue_mu);
    if (!(q->flags & CRING_REQUEST_CALLER_WAITS)) cring__comm_wake(e->comm);
    *handle_out = h;
    return CRING_OK;
}

/* ---- the response cache and the table ---------------------------------------------- */

static int push_uncached(cring_engine_t *e, req_t *r) {
    if (e->nuncached == e->cap_uncached) {
        size_t cap = e->cap_uncached ? 2 * e->cap_uncached : 64;
        req_t **u = realloc(e->uncached, cap * sizeof *u);
        if (!u) return -1;
        e->uncached = u;
        e->cap_uncached = cap;
    }
    e->uncached[e->nuncached++] = r;
    return 0;
}

static int cache_lookup(cring_engine_t *e, const char *name) {
    void *v = cring__strmap_get(&e->cache_index, name);
    return v ? (int)(intptr_t)v - 1 : -1;
}

static void cache_evict(cring_engine_t *e, int id) {
    cache_slot_t *s = &e->cache[id];
    if (!s->in_use) return;
    cring__strmap_remove(&e->cache_index, s->name);
    if (s->local) {
        s->local->cache_id = -1;
        push_uncached(e, s->local);
    }
    free(s->name);
    free(s->record);
    free(s->first_dims);
    memset(s, 0, sizeof *s);
    e->slot_state[id] = 1;
}

/* Insert a negotiated request: identical slot choice on every rank. */
static void cache_insert(cring_engine_t *e, req_t *r, const int64_t *first_dims) {
    int id = -1;
    for (int i = 0; i < e->cache_capacity; i++)
        if (!e->cache[i].in_use) {
            id = i;
            break;
        }
    if (id < 0) return; /* full: the name keeps going through the table */
    cache_slot_t *s = &e->cache[id];
    s->name = strdup(r->name);
    s->record = malloc(r->record_len);
    size_t ndims = (size_t)r->ntensors * (size_t)e->size;
    s->first_dims = malloc(sizeof(int64_t) * (ndims ? ndims : 1));
    if (!s->name || !s->record || !s->first_dims) {
        free(s->name);
        free(s->record);
        free(s->first_dims);
        memset(s, 0, sizeof *s);
        return;
    }
    memcpy(s->record, r->record, r->record_len);
    s->record_len = r->record_len;
    if (first_dims) memcpy(s->first_dims, first_dims, sizeof(int64_t) * ndims);
    s->in_use = 1;
    e->slot_state[id] = 1;
    cring__strmap_put(&e->cache_index, r->name, (void *)(intptr_t)(id + 1));
    if (id + 1 > e->cache_slots) e->cache_slots = id + 1;
}

static void table_entry_free(table_entry_t *t, int size) {
    if (!t) return;
    for (int r = 0; r < size; r++) free(t->records[r]);
    free(t->records);
    free(t->lens);
    free(t->name);
    free(t);
}

/* Move queued requests into the driver's structures. */
static void drain(cring_engine_t *e) {
    pthread_mutex_lock(&e->queue_mu);
    req_t *r = e->queue_head;
    e->queue_head = e->queue_tail = NULL;
    pthread_mutex_unlock(&e->queue_mu);
    while (r) {
        req_t *next = r->next;
        r->next = NULL;
        if (r->coll == CRING_COLL_JOIN) { /* takes effect once nothing else is pending */
            e->join_req = r;
            r = next;
            continue;
        }
        cring__strmap_put_borrowed(&e->pending, r->name, r);
        int id = cache_lookup(e, r->name);
        if (id >= 0 && e->cache[id].record_len == r->record_len &&
            memcmp(e->cache[id].record, r->record, r->record_len) == 0) {
            r->cache_id = id;
            e->cache[id].local = r;
            e->last_attached = r;
            if (e->slot_state[id] != 0) e->slot_state[id] = 2;
            stats_add(e, &e->stats.cache_hits, 1);
        } else {
            if (id >= 0) e->slot_state[id] = 0; /* changed: everyone re-negotiates */
            push_uncached(e, r);
        }
        r = next;
    }
}

/* ---- execution --------------------------------------------------------------------------- */

static void timeline_span(cring_engine_t *e, const char *name, const char *phase, double t0,
                          double t1, const char *args) {
    if (!e->timeline) return;
    pthread_mutex_lock(&e->timeline_mu);
    cring__timeline_span(e->timeline, name, phase, t0, t1, args);
    pthread_mutex_unlock(&e->timeline_mu);
}

/* Timestamps only matter to the timeline; reading the clock is not free. */
static double tl_now(const cring_engine_t *e) { return e->timeline ? cring__now_s() : 0.0; }

static int ensure_fusion(cring_engine_t *e, size_t bytes) {
    if (bytes <= e->fusion_cap) return 0;
    void *p = realloc(e->fusion, bytes);
    if (!p) return -1;
    e->fusion = p;
    e->fusion_cap = bytes;
    return 0;
}

static cring_status_t transport_failed(cring_engine_t *e, cring_status_t st);

/* Timeline of a batch that went through the fusion buffer: copy in over
 * [t0, t1), the collective over [t1, t2), copy out over [t2, t3). */
static void fused_spans(cring_engine_t *e, req_t **batch, int n, const char *phase, double t0,
                        double t1, double t2, double t3, const char *args) {
    if (!e->timeline) return;
    for (int b = 0; b < n; b++) {
        timeline_span(e, batch[b]->name, "MEMCPY_IN_FUSION_BUFFER", t0, t1, NULL);
        timeline_span(e, batch[b]->name, phase, t1, t2, args);
        timeline_span(e, batch[b]->name, "MEMCPY_OUT_FUSION_BUFFER", t2, t3, NULL);
    }
}

/* Allreduce a batch of requests (one or many) with the same dtype, op and
 * compression: directly on the tensor when there is one tensor that needs no
 * staging, else through the fusion buffer. */
static cring_status_t run_allreduce(cring_engine_t *e, req_t **batch, int n) {
    const req_t *first = batch[0];
    cring_dtype_t dtype = first->t[0].dtype;
    cring_dtype_t wire = first->compression != CRING_DTYPE_COUNT ? first->compression : dtype;
    size_t total = 0, ntensors = 0;
    int staging = n > 1 || first->ntensors > 1 || wire != dtype || first->prescale != 1.0;
    for (int b = 0; b < n; b++)
        for (int i = 0; i < batch[b]->ntensors; i++) {
            total += batch[b]->t[i].count;
            ntensors++;
        }
    double t0 = tl_now(e);
    for (int b = 0; b < n; b++) timeline_span(e, batch[b]->name, "QUEUE", batch[b]->ready_s, t0, NULL);
    cring_status_t st;
    if (!staging) {
        tensor_spec_t *t = &first->t[0];
        st = cring__comm_allreduce(e->comm, t->send, t->recv, t->count, dtype, first->op);
        double t1 = tl_now(e);
        if (st == CRING_OK && first->postscale != 1.0)
            cring__convert(dtype, t->recv, dtype, t->recv, t->count, first->postscale);
        timeline_span(e, first->name, "ALLREDUCE", t0, t1, NULL);
    } else {
        size_t es = cring_dtype_size(wire);
        if (ensure_fusion(e, total * es) != 0) return CRING_ERR_NO_MEMORY;
        unsigned char *buf = e->fusion;
        size_t off = 0;
        for (int b = 0; b < n; b++)
            for (int i = 0; i < batch[b]->ntensors; i++) {
                tensor_spec_t *t = &batch[b]->t[i];
                cring__convert(wire, buf + off * es, t->dtype, t->send, t->count, batch[b]->prescale);
                off += t->count;
            }
        double t1 = tl_now(e);
        st = cring__comm_allreduce(e->comm, buf, buf, total, wire, first->op);
        double t2 = tl_now(e);
        off = 0;
        if (st == CRING_OK)
            for (int b = 0; b < n; b++)
                for (int i = 0; i < batch[b]->ntensors; i++) {
                    tensor_spec_t *t = &batch[b]->t[i];
                    cring__convert(t->dtype, t->recv, wire, buf + off * es, t->count,
                                   batch[b]->postscale);
                    off += t->count;
                }
        double t3 = tl_now(e);
        char args[96];
        snprintf(args, sizeof args, "\"fused_tensors\": %zu, \"fused_bytes\": %zu", ntensors, total * es);
        fused_spans(e, batch, n, "ALLREDUCE", t0, t1, t2, t3, args);
        stats_add(e, &e->stats.fused_tensors, ntensors);
    }
    stats_add(e, &e->stats.collectives, 1);
    return st;
}

/* A group whose tensors have different dtypes cannot share a fusion buffer:
 * reduce its tensors one by one (still one negotiated unit). */
static cring_status_t run_allreduce_each(cring_engine_t *e, req_t *r) {
    for (int i = 0; i < r->ntensors; i++) {
        req_t one = *r;
        one.ntensors = 1;
        one.t = &r->t[i];
        req_t *batch = &one;
        CRING_CHECK(run_allreduce(e, &batch, 1));
    }
    return CRING_OK;
}

/* Broadcast a batch with the same root: through the fusion buffer unless it
 * is one in-place tensor. */
static cring_status_t run_broadcast(cring_engine_t *e, req_t **batch, int n) {
    const req_t *first = batch[0];
    int root = first->root, i_am_root = e->rank == root;
    double t0 = tl_now(e);
    for (int b = 0; b < n; b++) timeline_span(e, batch[b]->name, "QUEUE", batch[b]->ready_s, t0, NULL);
    cring_status_t st;
    if (n == 1 && first->ntensors == 1) {
        tensor_spec_t *t = &first->t[0];
        if (i_am_root && t->send != t->recv) memcpy(t->recv, t->send, t->bytes);
        st = cring__comm_broadcast(e->comm, t->recv, t->bytes, root);
        timeline_span(e, first->name, "BROADCAST", t0, tl_now(e), NULL);
    } else {
        size_t total = 0, ntensors = 0;
        for (int b = 0; b < n; b++)
            for (int i = 0; i < batch[b]->ntensors; i++) {
                total += batch[b]->t[i].bytes;
                ntensors++;
            }
        if (ensure_fusion(e, total) != 0) return CRING_ERR_NO_MEMORY;
        unsigned char *buf = e->fusion;
        size_t off = 0;
        if (i_am_root)
            for (int b = 0; b < n; b++)
                for (int i = 0; i < batch[b]->ntensors; i++) {
                    memcpy(buf + off, batch[b]->t[i].send, batch[b]->t[i].bytes);
                    off += batch[b]->t[i].bytes;
                }
        double t1 = tl_now(e);
        st = cring__comm_broadcast(e->comm, buf, total, root);
        double t2 = tl_now(e);
        off = 0;
        if (st == CRING_OK)
            for (int b = 0; b < n; b++)
                for (int i = 0; i < batch[b]->ntensors; i++) {
                    memcpy(batch[b]->t[i].recv, buf + off, batch[b]->t[i].bytes);
                    off += batch[b]->t[i].bytes;
                }
        double t3 = tl_now(e);
        fused_spans(e, batch, n, "BROADCAST", t0, t1, t2, t3, NULL);
        stats_add(e, &e->stats.fused_tensors, ntensors);
    }
    stats_add(e, &e->stats.collectives, 1);
    return st;
}

static cring_status_t run_allgather(cring_engine_t *e, req_t *r, const int64_t *first_dims) {
    cring_handle_t *h = r->handle;
    double t0 = tl_now(e);
    timeline_span(e, r->name, "QUEUE", r->ready_s, t0, NULL);
    h->outputs = calloc((size_t)r->ntensors, sizeof *h->outputs);
    h->output_bytes = calloc((size_t)r->ntensors, sizeof *h->output_bytes);
    h->first_dims = malloc(sizeof(int64_t) * (size_t)r->ntensors * (size_t)e->size);
    size_t *sizes = malloc(sizeof *sizes * (size_t)e->size);
    if (!h->outputs || !h->output_bytes || !h->first_dims || !sizes) {
        free(sizes);
        return CRING_ERR_NO_MEMORY;
    }
    memcpy(h->first_dims, first_dims, sizeof(int64_t) * (size_t)r->ntensors * (size_t)e->size);
    cring_status_t st = CRING_OK;
    for (int i = 0; i < r->ntensors && st == CRING_OK; i++) {
        tensor_spec_t *t = &r->t[i];
        size_t row_bytes = t->row_elems * cring_dtype_size(t->dtype), total = 0;
        for (int q = 0; q < e->size; q++) {
            sizes[q] = (size_t)first_dims[(size_t)i * (size_t)e->size + (size_t)q] * row_bytes;
            total += sizes[q];
        }
        sizes[e->rank] = t->bytes; /* a 0-d tensor gathers as one row */
        h->outputs[i] = output_alloc(e, total);
        h->output_bytes[i] = total;
        if (!h->outputs[i]) {
            st = CRING_ERR_NO_MEMORY;
            break;
        }
        st = cring__comm_allgatherv(e->comm, t->send, t->bytes, h->outputs[i], sizes);
        stats_add(e, &e->stats.collectives, 1);
    }
    free(sizes);
    timeline_span(e, r->name, "ALLGATHER", t0, tl_now(e), NULL);
    return st;
}

static cring_status_t run_reducescatter(cring_engine_t *e, req_t *r) {
    double t0 = tl_now(e);
    timeline_span(e, r->name, "QUEUE", r->ready_s, t0, NULL);
    size_t *counts = malloc(sizeof *counts * (size_t)e->size);
    if (!counts) return CRING_ERR_NO_MEMORY;
    cring_status_t st = CRING_OK;
    for (int i = 0; i < r->ntensors && st == CRING_OK; i++) {
        tensor_spec_t *t = &r->t[i];
        size_t rows = (size_t)t->shape[0], p = (size_t)e->size;
        for (size_t q = 0; q < p; q++) counts[q] = (rows / p + (q < rows % p)) * t->row_elems;
        const void *send = t->send;
        if (r->prescale != 1.0) {
            if (ensure_fusion(e, t->bytes) != 0) {
                st = CRING_ERR_NO_MEMORY;
                break;
            }
            cring__convert(t->dtype, e->fusion, t->dtype, t->send, t->count, r->prescale);
            send = e->fusion;
        }
        st = cring__comm_reducescatter(e->comm, send, t->recv, counts, t->dtype, r->op);
        if (st == CRING_OK && r->postscale != 1.0)
            cring__convert(t->dtype, t->recv, t->dtype, t->recv, counts[e->rank], r->postscale);
        stats_add(e, &e->stats.collectives, 1);
    }
    free(counts);
    timeline_span(e, r->name, "REDUCESCATTER", t0, tl_now(e), NULL);
    return st;
}

/* Alltoall: the ranks first share their splits (a size x size matrix of
 * rows), so every rank knows what it receives from whom; then one alltoallv
 * into an engine-allocated result. */
static cring_status_t run_alltoall(cring_engine_t *e, req_t *r) {
    cring_handle_t *h = r->handle;
    const size_t P = (size_t)e->size;
    tensor_spec_t *t = &r->t[0];
    double t0 = tl_now(e);
    timeline_span(e, r->name, "QUEUE", r->ready_s, t0, NULL);
    h->outputs = calloc(1, sizeof *h->outputs);
    h->output_bytes = calloc(1, sizeof *h->output_bytes);
    h->first_dims = malloc(sizeof(int64_t) * P);
    int64_t *rows = malloc(sizeof *rows * P * P);
    size_t *sizes = malloc(sizeof *sizes * (P + P * P));
    cring_status_t st = CRING_OK;
    if (!h->outputs || !h->output_bytes || !h->first_dims || !rows || !sizes) {
        st = CRING_ERR_NO_MEMORY;
        goto done;
    }
    for (size_t q = 0; q < P; q++) sizes[q] = P * sizeof *rows;
    st = cring__comm_allgatherv(e->comm, r->splits, P * sizeof *rows, rows, sizes);
    if (st != CRING_OK) goto done;
    size_t *matrix = sizes + P, row_bytes = t->row_elems * cring_dtype_size(t->dtype), total = 0;
    for (size_t k = 0; k < P * P; k++) {
        if (rows[k] < 0) {
            st = CRING_ERR_PROTOCOL; /* validated at submission: a corrupt peer */
            goto done;
        }
        matrix[k] = (size_t)rows[k] * row_bytes;
    }
    for (size_t q = 0; q < P; q++) {
        h->first_dims[q] = rows[q * P + (size_t)e->rank];
        total += matrix[q * P + (size_t)e->rank];
    }
    h->outputs[0] = output_alloc(e, total);
    h->output_bytes[0] = total;
    if (!h->outputs[0]) {
        st = CRING_ERR_NO_MEMORY;
        goto done;
    }
    st = cring__comm_alltoallv(e->comm, t->send, h->outputs[0], matrix);
    stats_add(e, &e->stats.collectives, 1);
done:
    free(rows);
    free(sizes);
    timeline_span(e, r->name, "ALLTOALL", t0, tl_now(e), NULL);
    return st;
}

/* Order for fusion: same key next to each other, otherwise as negotiated. */
static int fusion_key_cmp(const req_t *a, const req_t *b) {
    if (a->coll != b->coll) return (int)a->coll - (int)b->coll;
    if (a->coll == CRING_COLL_ALLREDUCE) {
        if (a->t[0].dtype != b->t[0].dtype) return (int)a->t[0].dtype - (int)b->t[0].dtype;
        if (a->op != b->op) return (int)a->op - (int)b->op;
        if (a->compression != b->compression) return (int)a->compression - (int)b->compression;
    }
    if (a->coll == CRING_COLL_BROADCAST && a->root != b->root) return a->root - b->root;
    return 0;
}

static int fusible(const req_t *r) {
    if (r->coll == CRING_COLL_ALLREDUCE) {
        for (int i = 1; i < r->ntensors; i++)
            if (r->t[i].dtype != r->t[0].dtype) return 0;
        return 1;
    }
    return r->coll == CRING_COLL_BROADCAST;
}

static size_t req_wire_bytes(const req_t *r) {
    size_t n = 0;
    for (int i = 0; i < r->ntensors; i++)
        n += r->compression != CRING_DTYPE_COUNT ? r->t[i].count * 2 : r->t[i].bytes;
    return n;
}

/* A single tensor this large runs on its own, in place: copying it into and
 * out of the fusion buffer costs more than the collective it would share.
 * Decided from what every rank agreed on (shape, dtype, compression), so
 * every rank forms the same batches. */
#define UNFUSED_MIN_BYTES (1u << 20)
static int runs_alone(const req_t *r) {
    return r->ntensors == 1 && req_wire_bytes(r) >= UNFUSED_MIN_BYTES;
}

/* Run every successful response in order, batching what can be fused, then
 * complete each request. Returns a transport failure, if any. */
static cring_status_t execute(cring_engine_t *e, response_t *resp, int n) {
    /* Stable insertion sort by fusion key keeps the negotiated order within a key. */
    for (int i = 1; i < n; i++) {
        response_t cur = resp[i];
        int j = i - 1;
        while (j >= 0 && fusion_key_cmp(resp[j].req, cur.req) > 0) {
            resp[j + 1] = resp[j];
            j--;
        }
        resp[j + 1] = cur;
    }
    req_t **batch = malloc(sizeof *batch * (size_t)(n ? n : 1));
    if (!batch) return CRING_ERR_NO_MEMORY;
    cring_status_t fatal = CRING_OK;
    int i = 0;
    while (i < n) {
        response_t *r0 = &resp[i];
        if (r0->status != CRING_OK || r0->executed) {
            complete(e, r0->req, r0->status, r0->error);
            i++;
            continue;
        }
        int nb = 1;
        batch[0] = r0->req;
        if (fusible(r0->req) && !runs_alone(r0->req)) {
            size_t bytes = req_wire_bytes(r0->req);
            while (i + nb < n && resp[i + nb].status == CRING_OK && !resp[i + nb].executed &&
                   fusible(resp[i + nb].req) && !runs_alone(resp[i + nb].req) &&
                   fusion_key_cmp(resp[i + nb].req, r0->req) == 0 &&
                   bytes + req_wire_bytes(resp[i + nb].req) <= e->fusion_threshold) {
                bytes += req_wire_bytes(resp[i + nb].req);
                batch[nb] = resp[i + nb].req;
                nb++;
            }
        }
        cring_status_t st;
        switch (r0->req->coll) {
        case CRING_COLL_ALLREDUCE:
            st = fusible(r0->req) ? run_allreduce(e, batch, nb) : run_allreduce_each(e, r0->req);
            break;
        case CRING_COLL_BROADCAST: st = run_broadcast(e, batch, nb); break;
        case CRING_COLL_ALLGATHER: st = run_allgather(e, r0->req, r0->first_dims); break;
        case CRING_COLL_REDUCESCATTER: st = run_reducescatter(e, r0->req); break;
        case CRING_COLL_ALLTOALL: st = run_alltoall(e, r0->req); break;
        default: {
            double t0 = tl_now(e);
            st = cring__comm_barrier(e->comm);
            timeline_span(e, r0->req->name, "BARRIER", t0, tl_now(e), NULL);
            stats_add(e, &e->stats.collectives, 1);
        }
        }
        for (int b = 0; b < nb; b++) {
            req_t *r = batch[b];
            if (st != CRING_OK) {
                char msg[CRING__ERRMSG_BYTES + 128];
                snprintf(msg, sizeof msg, "%s", st == CRING_ERR_NO_MEMORY ? "out of memory"
                                                                          : cring__comm_error(e->comm));
                complete(e, r, st, msg);
            } else {
                complete(e, r, CRING_OK, NULL);
            }
        }
        if (st != CRING_OK && cring__comm_broken(e->comm) != CRING_OK) fatal = st;
        i += nb;
        if (fatal != CRING_OK) break;
    }
    /* after a fatal failure, the rest never ran: fail them too */
    for (; i < n; i++) complete(e, resp[i].req, fatal, cring__comm_error(e->comm));
    free(batch);
    return fatal;
}

/* ---- one negotiation round ---------------------------------------------------------------- */

static int ensure_vec(cring_engine_t *e, size_t n) {
    if (n <= e->vec_cap) return 0;
    uint8_t *v = realloc(e->vec, n);
    if (!v) return -1;
    e->vec = v;
    e->vec_cap = n;
    return 0;
}

static void stall_check(cring_engine_t *e);

/* ---- join ------------------------------------------------------------------------------- */

/* A joined rank's stand-in for a request it never submitted: the same
 * description (so fusion packs it exactly as the other ranks do) and zeros
 * as its data. NULL when out of memory or the record is malformed. */
static req_t *make_ghost(cring_engine_t *e, const uint8_t *rec, size_t len) {
    parsed_t p;
    if (parse_record(rec, len, &p) != 0) return NULL;
    char name[MAX_NAME_BYTES + 1];
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
            d[k] = (int64_t)get_le(p.tensors + off + 2 + 8 * (size_t)k, 8);
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
    cring_request_t q = {.name = name, .collective = (cring_collective_t)p.coll,
                         .op = (cring_op_t)p.op, .root = p.root, .prescale = 1.0,
                         .postscale = 1.0, .compression = (cring_dtype_t)p.compression,
                         .ntensors = p.ntensors, .tensors = ts};
    r = make_req(e, &q, e->size);
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
static int joined_conflict(cring_engine_t *e, const uint8_t *rec, size_t len, char *msg, size_t n) {
    parsed_t p;
    if (!e->njoined || parse_record(rec, len, &p) != 0) return 0;
    if (p.coll == CRING_COLL_ALLREDUCE && (p.op == CRING_SUM || p.op == CRING_AVERAGE)) return 0;
    char who[256] = "";
    size_t o = 0;
    for (int q = 0; q < e->size && o < sizeof who - 16; q++)
        if (e->joined[q]) o += (size_t)snprintf(who + o, sizeof who - o, "%s%d", o ? ", " : "", q);
    snprintf(msg, n,
             "'%.*s': %s%s%s cannot run while ranks [%s] have joined: after join() the other "
             "ranks may only allreduce with Sum or Average (joined ranks contribute zeros)",
             (int)p.name_len, p.name, collective_name((cring_collective_t)p.coll),
             p.coll == CRING_COLL_ALLREDUCE ? " with op " : "",
             p.coll == CRING_COLL_ALLREDUCE ? cring_op_name((cring_op_t)p.op) : "", who);
    return 1;
}

static response_t *add_response(response_t **resp, int *nresp, int *cap_resp) {
    if (*nresp == *cap_resp) {
        int cap = *cap_resp ? 2 * *cap_resp : 64;
        response_t *nr = realloc(*resp, sizeof *nr * (size_t)cap);
        if (!nr) return NULL;
        *resp = nr;
        *cap_resp = cap;
    }
    response_t *out = &(*resp)[(*nresp)++];
    memset(out, 0, sizeof *out);
    return out;
}

/* A table entry every rank has described (or joined for): check that the
 * descriptions agree, answer it, and cache it. Frees t. */
static cring_status_t answer_entry(cring_engine_t *e, table_entry_t *t, response_t **resp,
                                   int *nresp, int *cap_resp) {
    const int P = e->size;
    cring_status_t st = CRING_OK;
    req_t *local = cring__strmap_get(&e->pending, t->name);
    int ref = 0;
    while (ref < P && !t->records[ref]) ref++;
    parsed_t p0;
    if (ref == P || parse_record(t->records[ref], t->lens[ref], &p0) != 0) goto done;
    char why[512] = "", scratch[512], others[256] = "";
    int bad = -1, nbad = 0;
    size_t oo = 0;
    for (int q = ref + 1; q < P; q++) {
        parsed_t pq;
        if (!t->records[q]) continue;
        if (parse_record(t->records[q], t->lens[q], &pq) != 0 ||
            difference(&p0, &pq, bad < 0 ? why : scratch, sizeof why) > 0) {
            if (bad < 0) bad = q;
            nbad++;
            if (oo < sizeof others - 16)
                oo += (size_t)snprintf(others + oo, sizeof others - oo, "%s%d", oo ? ", " : "", q);
        }
    }
    char msg[MAX_NAME_BYTES + 1024];
    cring_status_t verdict = CRING_OK;
    if (bad >= 0) {
        int m = snprintf(msg, sizeof msg,
                         "ranks disagree on tensor '%s': rank %d vs rank %d: %s (rank %d first)",
                         t->name, ref, bad, why, ref);
        if (nbad > 1 && m > 0 && (size_t)m < sizeof msg)
            snprintf(msg + m, sizeof msg - (size_t)m, "; ranks that differ from rank %d: [%s]", ref,
                     others);
        verdict = CRING_ERR_MISMATCH;
    } else if (joined_conflict(e, t->records[ref], t->lens[ref], msg, sizeof msg)) {
        verdict = CRING_ERR_MISMATCH;
    }
    if (verdict != CRING_OK) {
        if (local) { /* a joined rank has nothing to fail */
            response_t *out = add_response(resp, nresp, cap_resp);
            if (!out) {
                st = CRING_ERR_NO_MEMORY;
                goto done;
            }
            out->req = local;
            out->status = verdict;
            out->error = strdup(msg);
        }
        goto done;
    }
    req_t *r = local ? local : make_ghost(e, t->records[ref], t->lens[ref]);
    response_t *out = r ? add_response(resp, nresp, cap_resp) : NULL;
    if (!out) {
        if (!local) req_free(r);
        st = CRING_ERR_NO_MEMORY;
        goto done;
    }
    out->req = r;
    out->owned_dims = malloc(sizeof(int64_t) * (size_t)(p0.ntensors ? p0.ntensors : 1) * (size_t)P);
    if (out->owned_dims) {
        for (int q = 0; q < P; q++) {
            parsed_t pq;
            parse_record(t->records[q] ? t->records[q] : t->records[ref],
                         t->records[q] ? t->lens[q] : t->lens[ref], &pq);
            record_first_dims(&pq, q, P, out->owned_dims);
        }
    }
    out->first_dims = out->owned_dims;
    cache_insert(e, r, out->owned_dims);
done:
    table_entry_free(t, P);
    return st;
}

/* Names every rank described or joined for. */
static int entry_complete(const cring_engine_t *e, const table_entry_t *t) {
    for (int q = 0; q < e->size; q++)
        if (!t->records[q] && !e->joined[q]) return 0;
    return 1;
}

static int name_cmp(const void *a, const void *b) {
    return strcmp((*(table_entry_t *const *)a)->name, (*(table_entry_t *const *)b)->name);
}

/* A rank just joined: entries that waited only for it are complete now.
 * Answered in name order, which every rank computes alike. */
static cring_status_t sweep_joined(cring_engine_t *e, response_t **resp, int *nresp, int *cap) {
    if (!e->table.count) return CRING_OK;
    table_entry_t **done = malloc(sizeof *done * e->table.count);
    if (!done) return CRING_ERR_NO_MEMORY;
    size_t n = 0;
    for (size_t b = 0; b < e->table.nbuckets; b++)
        for (cring__strmap_entry_t *x = e->table.buckets[b]; x; x = x->next)
            if (entry_complete(e, x->value)) done[n++] = x->value;
    qsort(done, n, sizeof *done, name_cmp);
    cring_status_t st = CRING_OK;
    for (size_t i = 0; i < n; i++) {
        cring__strmap_remove(&e->table, done[i]->name);
        if (st == CRING_OK) st = answer_entry(e, done[i], resp, nresp, cap);
        else table_entry_free(done[i], e->size);
    }
    free(done);
    return st;
}

/* Exchange uncached records and feed them to the table; complete entries
 * become responses (appended to *resp). */
static cring_status_t exchange_records(cring_engine_t *e, response_t **resp, int *nresp,
                                       int *cap_resp) {
    const int P = e->size;
    uint64_t my_len = 0;
    for (size_t i = 0; i < e->nuncached; i++) my_len += 4 + e->uncached[i]->record_len;
    uint64_t *lens = calloc((size_t)P, sizeof *lens);
    size_t *sizes = calloc((size_t)P, sizeof *sizes);
    uint8_t *mine = malloc(my_len ? my_len : 1), *all = NULL;
    cring_status_t st = CRING_OK;
    if (!lens || !sizes || !mine) {
        st = CRING_ERR_NO_MEMORY;
        goto done;
    }
    uint8_t *p = mine;
    for (size_t i = 0; i < e->nuncached; i++) {
        req_t *r = e->uncached[i];
        put_le(&p, r->record_len, 4);
        memcpy(p, r->record, r->record_len);
        p += r->record_len;
    }
    e->nuncached = 0;
    for (int r = 0; r < P; r++) sizes[r] = sizeof(uint64_t);
    st = cring__comm_allgatherv(e->comm, &my_len, sizeof my_len, lens, sizes);
    if (st != CRING_OK) goto done;
    size_t total = 0;
    for (int r = 0; r < P; r++) {
        sizes[r] = (size_t)lens[r];
        total += sizes[r];
    }
    all = malloc(total ? total : 1);
    if (!all) {
        st = CRING_ERR_NO_MEMORY;
        goto done;
    }
    st = cring__comm_allgatherv(e->comm, mine, (size_t)my_len, all, sizes);
    if (st != CRING_OK) goto done;

    double now = cring__now_coarse_s();
    size_t off = 0;
    for (int r = 0; r < P; r++) {
        size_t end = off + sizes[r];
        while (off + 4 <= end) {
            size_t len = (size_t)get_le(all + off, 4);
            off += 4;
            parsed_t pr;
            if (len > end - off || parse_record(all + off, len, &pr) != 0) {
                cring__log(CRING__LOG_ERROR, e->rank, "malformed request record from rank %d", r);
                off = end;
                break;
            }
            char name[MAX_NAME_BYTES + 1];
            memcpy(name, pr.name, pr.name_len);
            name[pr.name_len] = 0;
            table_entry_t *t = cring__strmap_get(&e->table, name);
            if (!t) {
                t = calloc(1, sizeof *t);
                if (t) {
                    t->name = strdup(name);
                    t->records = calloc((size_t)P, sizeof *t->records);
                    t->lens = calloc((size_t)P, sizeof *t->lens);
                }
                if (!t || !t->name || !t->records || !t->lens) {
                    table_entry_free(t, P);
                    st = CRING_ERR_NO_MEMORY;
                    goto done;
                }
                t->first_seen_s = now;
                cring__strmap_put(&e->table, name, t);
            }
            if (!t->records[r]) t->have++;
            free(t->records[r]);
            t->records[r] = malloc(len);
            if (!t->records[r]) {
                st = CRING_ERR_NO_MEMORY;
                goto done;
            }
            memcpy(t->records[r], all + off, len);
            t->lens[r] = len;
            off += len;
            if (!entry_complete(e, t)) continue;
            cring__strmap_remove(&e->table, name);
            st = answer_entry(e, t, resp, nresp, cap_resp);
            if (st != CRING_OK) goto done;
        }
        off = end;
    }
done:
    free(lens);
    free(sizes);
    free(mine);
    free(all);
    return st;
}

/* Fail every request this rank holds: queued, pending or in the table. */
static void fail_all(cring_engine_t *e, cring_status_t st, const char *msg) {
    drain(e);
    req_t **list = NULL;
    size_t n = 0, cap = 0;
    for (size_t b = 0; b < e->pending.nbuckets; b++)
        for (cring__strmap_entry_t *x = e->pending.buckets[b]; x; x = x->next) {
            if (n == cap) {
                cap = cap ? 2 * cap : 64;
                req_t **l = realloc(list, cap * sizeof *l);
                if (!l) break;
                list = l;
            }
            list[n++] = x->value;
        }
    cring__strmap_free(&e->pending);
    e->nuncached = 0;
    e->last_attached = NULL;
    for (int i = 0; i < e->cache_capacity; i++) {
        e->cache[i].local = NULL;
        if (e->slot_state[i] == 2) e->slot_state[i] = 1;
    }
    for (size_t i = 0; i < n; i++) {
        complete(e, list[i], st, msg);
        req_free(list[i]);
    }
    free(list);
    if (e->join_req) {
        req_t *j = e->join_req;
        e->join_req = NULL;
        atomic_store(&e->join_in_flight, 0);
        complete(e, j, st, msg);
        req_free(j);
    }
}

static cring_status_t transport_failed(cring_engine_t *e, cring_status_t st) {
    int expected = CRING_OK;
    if (atomic_compare_exchange_strong(&e->broken, &expected, (int)st))
        snprintf(e->broken_msg, sizeof e->broken_msg, "%s", cring__comm_error(e->comm));
    fail_all(e, st, e->broken_msg);
    return st;
}

/* A request whose data can travel with this round: the only thing pending
 * here, cached, a plain small allreduce. */
static req_t *speculation_candidate(cring_engine_t *e) {
    req_t *r = e->last_attached;
    if (!r || e->pending.count != 1 || e->nuncached || r->cache_id < 0) return NULL;
    if (r->coll != CRING_COLL_ALLREDUCE || r->ntensors != 1 ||
        r->compression != CRING_DTYPE_COUNT || r->prescale != 1.0)
        return NULL;
    if (r->t[0].bytes > SPECULATE_MAX_BYTES || e->slot_state[r->cache_id] != 2) return NULL;
    return r;
}

/* Combine every rank's vector with MIN into e->vec (0 beats 2 beats 1 per
 * slot; 0 beats 1 per flag).
 *
 * On shared memory each rank instead contributes a sparse block, gathered in
 * one exchange and combined locally, so a round costs the same however many
 * names are cached: the three flags, the slots it has pending and the slots
 * it invalidates. A rank whose only pending request is a small cached
 * allreduce also appends its data: when every rank did so for the same slot,
 * that request is reduced right here from the gathered blocks (in rank order,
 * so bit-identical on every rank) and needs no collective of its own
 * (*executed_out). Over TCP the dense vector is MIN-allreduced. */
static cring_status_t exchange_vector(cring_engine_t *e, size_t vlen, req_t **executed_out) {
    *executed_out = NULL;
    const int P = e->size;
    uint8_t *v = e->vec;
    const int nslots = (int)(vlen - e->vhdr);
    req_t *spec = speculation_candidate(e);
    size_t payload = spec ? spec->t[0].bytes : 0;
    /* worst case: every slot listed */
    size_t max_len = BLOCK_HEADER_BYTES + 8 + 4 * (size_t)nslots + payload;
    if (!cring__comm_can_gather_small(e->comm) || max_len > cring__comm_gather_small_max(e->comm))
        return cring__comm_allreduce(e->comm, v, v, vlen, CRING_UINT8, CRING_MIN);
    if (max_len > e->block_cap) {
        uint8_t *b = realloc(e->block, max_len);
        if (!b) return CRING_ERR_NO_MEMORY;
        e->block = b;
        e->block_cap = max_len;
    }
    if (!e->peer_blocks) {
        e->peer_blocks = calloc((size_t)P, sizeof *e->peer_blocks);
        e->peer_lens = calloc((size_t)P, sizeof *e->peer_lens);
        e->slot_hits = calloc((size_t)(e->cache_capacity ? e->cache_capacity : 1), sizeof *e->slot_hits);
        e->inval_ids = calloc((size_t)(e->cache_capacity ? e->cache_capacity : 1), sizeof *e->inval_ids);
        if (!e->peer_blocks || !e->peer_lens || !e->slot_hits || !e->inval_ids)
            return CRING_ERR_NO_MEMORY;
    }
    /* block: u32 flags (bit i set when v[i] == 0), u32 npending, u32 ninvalid,
     * u32 spec_slot + 1, u32 spec_bytes, u32 nslots, then the ids, then data */
    uint32_t *ids = (uint32_t *)(e->block + BLOCK_HEADER_BYTES + 8);
    uint32_t npend = 0, ninval = 0, *inval = e->inval_ids;
    const uint8_t *sv = v + e->vhdr;
    for (int i = 0; i < nslots; i++) { /* skip idle slots eight at a time */
        if ((i & 7) == 0 && i + 8 <= nslots) {
            uint64_t w;
            memcpy(&w, sv + i, 8);
            if (w == 0x0101010101010101ull) {
                i += 7;
                continue;
            }
        }
        if (sv[i] == 2) ids[npend++] = (uint32_t)i;
        else if (sv[i] == 0) inval[ninval++] = (uint32_t)i;
    }
    memcpy(ids + npend, inval, sizeof *inval * ninval);
    uint32_t header[6] = {(uint32_t)(v[0] == 0) | (uint32_t)(v[1] == 0) << 1 | (uint32_t)(v[2] == 0) << 2 |
                              (uint32_t)(v[V_HEADER + e->rank] == 0) << 3,
                          npend, ninval, spec ? (uint32_t)spec->cache_id + 1 : 0, (uint32_t)payload,
                          (uint32_t)nslots};
    memcpy(e->block, header, sizeof header);
    size_t len = BLOCK_HEADER_BYTES + 8 + 4 * (size_t)(npend + ninval);
    /* memmove: gcc inlines a memcpy of unknown length here as `rep movsq`,
     * whose start-up costs more than copying a few bytes */
    if (spec) memmove(e->block + len, spec->t[0].send, payload);
    len += payload;
    CRING_CHECK(cring__comm_gather_small(e->comm, e->block, len, e->peer_blocks, e->peer_lens));

    /* combine: flags by OR, pending slots by count, invalidations by union */
    uint32_t flags = 0;
    int agree = spec != NULL;
    for (int q = 0; q < P; q++) {
        const uint8_t *b = e->peer_blocks[q];
        uint32_t h[6];
        memcpy(h, b, sizeof h);
        if (e->peer_lens[q] < BLOCK_HEADER_BYTES + 8 || h[5] != (uint32_t)nslots ||
            e->peer_lens[q] < BLOCK_HEADER_BYTES + 8 + 4 * (size_t)(h[1] + h[2]) + h[4]) {
            cring__log(CRING__LOG_ERROR, e->rank, "malformed negotiation block from rank %d", q);
            return CRING_ERR_PROTOCOL;
        }
        flags |= h[0];
        const uint8_t *qids = b + BLOCK_HEADER_BYTES + 8;
        for (uint32_t k = 0; k < h[1] + h[2]; k++) {
            uint32_t id;
            memcpy(&id, qids + 4 * (size_t)k, 4);
            if (id >= (uint32_t)nslots) return CRING_ERR_PROTOCOL;
            e->slot_hits[id] = k < h[1] ? e->slot_hits[id] + 1 : (uint16_t)(e->slot_hits[id] | 0x8000);
        }
        if (!spec || h[3] != header[3] || h[4] != header[4]) agree = 0;
    }
    v[0] = (flags & 1) ? 0 : 1;
    v[1] = (flags & 2) ? 0 : 1;
    v[2] = (flags & 4) ? 0 : 1;
    for (int q = 0; q < P; q++) {
        uint32_t h0;
        memcpy(&h0, e->peer_blocks[q], sizeof h0);
        v[V_HEADER + q] = (h0 & 8) ? 0 : 1;
    }
    memset(v + e->vhdr, 1, (size_t)nslots);
    for (int q = 0; q < P; q++) { /* read back the touched slots, and reset them */
        const uint8_t *b = e->peer_blocks[q];
        uint32_t h[6];
        memcpy(h, b, sizeof h);
        const uint8_t *qids = b + BLOCK_HEADER_BYTES + 8;
        for (uint32_t k = 0; k < h[1] + h[2]; k++) {
            uint32_t id;
            memcpy(&id, qids + 4 * (size_t)k, 4);
            uint16_t hits = e->slot_hits[id];
            if (hits == 0xffff) continue; /* already decided */
            v[e->vhdr + id] = (hits & 0x8000) ? 0 : (hits == (uint16_t)P ? 2 : 1);
            e->slot_hits[id] = 0xffff;
        }
    }
    for (int q = 0; q < P; q++) {
        const uint8_t *b = e->peer_blocks[q];
        uint32_t h[6];
        memcpy(h, b, sizeof h);
        const uint8_t *qids = b + BLOCK_HEADER_BYTES + 8;
        for (uint32_t k = 0; k < h[1] + h[2]; k++) {
            uint32_t id;
            memcpy(&id, qids + 4 * (size_t)k, 4);
            e->slot_hits[id] = 0;
        }
    }
    if (agree && v[e->vhdr + spec->cache_id] == 2 && v[1] != 0) {
        const void *srcs[P];
        size_t off = BLOCK_HEADER_BYTES + 8;
        for (int q = 0; q < P; q++) {
            uint32_t h[6];
            memcpy(h, e->peer_blocks[q], sizeof h);
            srcs[q] = (const uint8_t *)e->peer_blocks[q] + off + 4 * (size_t)(h[1] + h[2]);
        }
        tensor_spec_t *t = &spec->t[0];
        double t0 = tl_now(e);
        cring__reduce_multi(t->dtype, spec->op, t->recv, srcs, P, t->count, P);
        if (spec->postscale != 1.0)
            cring__convert(t->dtype, t->recv, t->dtype, t->recv, t->count, spec->postscale);
        timeline_span(e, spec->name, "ALLREDUCE", t0, tl_now(e), "\"with_negotiation\": true");
        stats_add(e, &e->stats.collectives, 1);
        *executed_out = spec;
    }
    return CRING_OK;
}

/* One round. *progress is set when some request completed. */
static cring_status_t run_round(cring_engine_t *e, int *progress) {
    *progress = 0;
    const size_t vlen = e->vhdr + (size_t)e->cache_slots;
    if (ensure_vec(e, vlen) != 0) return CRING_ERR_NO_MEMORY;
    uint8_t *v = e->vec;
    v[0] = e->nuncached ? 0 : 1;
    v[1] = e->abort_requested ? 0 : 1;
    v[2] = e->pending.count || e->join_req ? 0 : 1;
    memset(v + V_HEADER, 1, (size_t)e->size);
    /* Joined: nothing of this rank's own is left, and it stands in (with
     * zeros) for every cached name the others have pending. */
    int joined_here = e->join_req && !e->pending.count && !e->nuncached;
    if (joined_here) {
        v[V_HEADER + e->rank] = 0;
        for (int i = 0; i < e->cache_slots; i++)
            v[e->vhdr + i] = !e->cache[i].in_use ? 1 : (e->slot_state[i] == 0 ? 0 : 2);
    } else {
        memcpy(v + e->vhdr, e->slot_state, (size_t)e->cache_slots);
    }
    cring__comm_announce(e->comm, e->rounds_done + 1);
    req_t *spec = NULL;
    cring_status_t st = exchange_vector(e, vlen, &spec);
    e->rounds_done++;
    stats_add(e, &e->stats.cycles, 1);
    if (st != CRING_OK) return transport_failed(e, st);

    if (v[1] == 0) {
        snprintf(e->broken_msg, sizeof e->broken_msg,
                 "a rank stopped the job: some tensor stalled for more than "
                 "CRING_STALL_SHUTDOWN_SECONDS=%g (see the stall warnings)",
                 e->stall_shutdown_s);
        atomic_store(&e->broken, (int)CRING_ERR_TIMEOUT);
        fail_all(e, CRING_ERR_TIMEOUT, e->broken_msg);
        return CRING_ERR_TIMEOUT;
    }
    int grew = 0, njoined = 0;
    for (int q = 0; q < e->size; q++) {
        int j = v[V_HEADER + q] == 0;
        if (j && !e->joined[q]) {
            grew = 1;
            e->join_round[q] = e->rounds_done;
        }
        e->joined[q] = (uint8_t)j;
        njoined += j;
    }
    e->njoined = njoined;
    const int all_joined = njoined == e->size;
    /* Slots whose byte is not 1: ready (2) in slot order, or evicted (0).
     * Most bytes are 1 in steady state: skip them eight at a time. Once
     * every rank has joined, a 2 is only the joined ranks' stand-in. */
    response_t *resp = e->resp;
    int nresp = 0, cap = e->cap_resp;
    const uint8_t *sv = v + e->vhdr;
    const int nslots = e->cache_slots;
    for (int i = 0; i < nslots; i++) {
        if ((i & 7) == 0 && i + 8 <= nslots) {
            uint64_t w;
            memcpy(&w, sv + i, 8);
            if (w == 0x0101010101010101ull) {
                i += 7;
                continue;
            }
        }
        if (sv[i] == 1) continue;
        if (sv[i] == 0) {
            cache_evict(e, i);
            continue;
        }
        if (all_joined) continue;
        cache_slot_t *s = &e->cache[i];
        req_t *r = s->local;
        char msg[MAX_NAME_BYTES + 512];
        int conflict = joined_conflict(e, s->record, s->record_len, msg, sizeof msg);
        if (!r && !conflict) r = make_ghost(e, s->record, s->record_len);
        response_t *out = r ? add_response(&resp, &nresp, &cap) : NULL;
        if (!out && (r || !conflict)) {
            if (r && !s->local) req_free(r);
            for (int k = 0; k < nresp; k++) free(resp[k].error);
            e->resp = resp;
            e->cap_resp = cap;
            return transport_failed(e, CRING_ERR_NO_MEMORY);
        }
        if (out) {
            out->req = r;
            out->first_dims = s->first_dims;
            out->executed = spec && r == spec;
            if (conflict) {
                out->status = CRING_ERR_MISMATCH;
                out->error = strdup(msg);
            }
        }
        if (s->local) s->local->cache_id = -1;
        s->local = NULL;
        e->slot_state[i] = 1;
    }
    while (e->cache_slots > 0 && !e->cache[e->cache_slots - 1].in_use) e->cache_slots--;

    if (v[0] == 0 || grew) {
        st = v[0] == 0 ? exchange_records(e, &resp, &nresp, &cap) : CRING_OK;
        if (st == CRING_OK && grew) st = sweep_joined(e, &resp, &nresp, &cap);
        if (st != CRING_OK) {
            for (int i = 0; i < nresp; i++) {
                free(resp[i].error);
                free(resp[i].owned_dims);
            }
            e->resp = resp;
            e->cap_resp = cap;
            return transport_failed(e, st);
        }
    }
    double t_ready = tl_now(e);
    for (int i = 0; i < nresp; i++) {
        req_t *r = resp[i].req;
        r->ready_s = t_ready;
        if (!r->handle) continue; /* a joined rank's stand-in */
        if (r == e->last_attached) e->last_attached = NULL;
        cring__strmap_remove(&e->pending, r->name);
        timeline_span(e, r->name, "NEGOTIATE", r->submit_s, t_ready, NULL);
    }
    if (all_joined && e->join_req) { /* every rank returns the same last rank */
        int last = 0;
        for (int q = 0; q < e->size; q++)
            if (e->join_round[q] >= e->join_round[last]) last = q;
        req_t *j = e->join_req;
        e->join_req = NULL;
        memset(e->joined, 0, (size_t)e->size);
        memset(e->join_round, 0, sizeof *e->join_round * (size_t)e->size);
        e->njoined = 0;
        j->handle->value = last;
        atomic_store(&e->join_in_flight, 0);
        timeline_span(e, j->name, "JOIN", j->submit_s, tl_now(e), NULL);
        complete(e, j, CRING_OK, NULL);
        req_free(j);
        *progress = 1;
    }
    st = execute(e, resp, nresp);
    for (int i = 0; i < nresp; i++) {
        req_recycle(e, resp[i].req);
        free(resp[i].error);
        free(resp[i].owned_dims);
    }
    e->resp = resp;
    e->cap_resp = cap;
    *progress = *progress || nresp > 0;
    if (st != CRING_OK) return transport_failed(e, st);
    stall_check(e);
    return CRING_OK;
}

/* ---- stall check -------------------------------------------------------------------------- */

static void stall_check(cring_engine_t *e) {
    double now = cring__now_coarse_s();
    if (now - e->last_stall_check_s < 0.05) return;
    e->last_stall_check_s = now;
    /* Cached requests carry no rank detail: after half the threshold, have
     * everyone re-describe them so the table can name the missing ranks. */
    for (int i = 0; i < e->cache_slots; i++) {
        cache_slot_t *s = &e->cache[i];
        if (s->in_use && s->local && now - s->local->submit_s > e->stall_check_s / 2)
            e->slot_state[i] = 0;
    }
    for (size_t b = 0; b < e->table.nbuckets; b++)
        for (cring__strmap_entry_t *x = e->table.buckets[b]; x; x = x->next) {
            table_entry_t *t = x->value;
            double age = now - t->first_seen_s;
            if (e->stall_shutdown_s > 0 && age > e->stall_shutdown_s) e->abort_requested = 1;
            if (t->warned || age < e->stall_check_s || !t->records[e->rank]) continue;
            char missing[512] = "", present[512] = "";
            size_t mo = 0, po = 0;
            for (int r = 0; r < e->size; r++) {
                char *buf = t->records[r] ? present : missing;
                size_t *o = t->records[r] ? &po : &mo;
                if (*o < sizeof missing - 16)
                    *o += (size_t)snprintf(buf + *o, sizeof missing - *o, "%s%d", *o ? ", " : "", r);
            }
            cring__log(CRING__LOG_WARNING, e->rank,
                       "stall: tensor '%s' was submitted by ranks [%s] %.0f s ago; missing "
                       "ranks: [%s] (CRING_STALL_CHECK_SECONDS=%g)",
                       t->name, present, age, missing, e->stall_check_s);
            t->warned = 1;
        }
}

/* ---- driving ------------------------------------------------------------------------------- */

/* Run rounds while this rank has work or a peer waits for it. With `until`,
 * return as soon as that handle is done; with deadline_s > 0, once
 * cring__now_s() passes it (between rounds). Called with progress_mu held. */
static void drive(cring_engine_t *e, cring_handle_t *until, double deadline_s) {
    for (;;) {
        if (deadline_s > 0 && cring__now_s() >= deadline_s) return;
        if (atomic_load(&e->broken) != CRING_OK) {
            fail_all(e, (cring_status_t)atomic_load(&e->broken), e->broken_msg);
            return;
        }
        if (atomic_load(&e->stop)) return;
        if (until && atomic_load(&until->done)) return; /* before drain: it takes queue_mu */
        if (!until && atomic_load(&e->callers_waiting)) return; /* let them drive */
        uint64_t token = cring__comm_wake_token(e->comm);
        drain(e);
        if (until && atomic_load(&until->done)) return;
        int local = e->pending.count > 0 || e->join_req != NULL;
        if (!local && !cring__comm_peer_waiting(e->comm, e->rounds_done)) return;
        int progress = 0;
        if (run_round(e, &progress) != CRING_OK) continue;
        /* The engine thread paces its rounds by CRING_CYCLE_TIME while
         * asynchronous work keeps arriving, so what arrives together is
         * fused (Horovod's cycle); a thread waiting on its own handle never
         * waits for this timer. */
        if (!until && e->cycle_time_s > 0 && !atomic_load(&e->callers_waiting) &&
            (e->pending.count > 0 || e->queue_head != NULL)) {
            struct timespec ts = {(time_t)e->cycle_time_s,
                                  (long)((e->cycle_time_s - (double)(time_t)e->cycle_time_s) * 1e9)};
            nanosleep(&ts, NULL);
            continue;
        }
        if (!progress && local && !cring__comm_peer_waiting(e->comm, e->rounds_done) &&
            !(until && atomic_load(&until->done)))
            cring__comm_idle_wait(e->comm, token, e->cycle_time_s);
    }
}

/* Run rounds as this rank's driver (progress_mu held). */
static void drive_locked(cring_engine_t *e, cring_handle_t *until, double deadline_s) {
    if (atomic_load(&e->stop)) return;
    cring__comm_set_driving(e->comm, 1);
    drive(e, until, deadline_s);
    /* A peer that announced a round we did not serve rings our bell once its
     * spin runs out (see poke_if_idle in shm.c), so leaving never strands
     * it, and a fast peer does not make us hand rounds to the engine thread. */
    cring__comm_set_driving(e->comm, 0);
}

/* The engine thread takes the driver's role only if it is free. */
static int try_drive(cring_engine_t *e);

/* Another thread of this rank is driving: over TCP, the peers' data is
 * readable the whole time it runs, and waiting on the sockets would spin.
 * Park until that driver leaves (it wakes us; see cring_handle_wait) or the
 * time-out, then look again. The flag is set before the second trylock, so a
 * driver that left in between is either seen by the trylock or sees the flag. */
static void park_while_busy(cring_engine_t *e, uint64_t token) {
    atomic_store(&e->thread_parked, 1);
    if (!try_drive(e)) cring__comm_idle_wait_local(e->comm, token, 0.5);
    atomic_store(&e->thread_parked, 0);
}

static int try_drive(cring_engine_t *e) {
    if (pthread_mutex_trylock(&e->progress_mu) != 0) return 0;
    drive_locked(e, NULL, 0);
    pthread_mutex_unlock(&e->progress_mu);
    return 1;
}

static void wait_done_cv(cring_engine_t *e, const cring_handle_t *h, long ns) {
    pthread_mutex_lock(&e->done_mu);
    atomic_fetch_add(&e->done_waiters, 1);
    if (!h || !atomic_load(&((cring_handle_t *)h)->done)) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += ns;
        while (ts.tv_nsec >= 1000000000L) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000L;
        }
        pthread_cond_timedwait(&e->done_cv, &e->done_mu, &ts);
    }
    atomic_fetch_sub(&e->done_waiters, 1);
    pthread_mutex_unlock(&e->done_mu);
}

/* The engine thread drives only when something asks it to: a local async
 * submission, or a peer that waited for this rank past its spin phase while
 * no thread here was driving (it rings the bell). Serving every announced
 * round itself would steal rounds from threads waiting on their own
 * handles, which drive them without a context switch; and it steps aside as
 * soon as such a thread wants the role. */
static void *engine_main(void *arg) {
    cring_engine_t *e = arg;
    int rung = 1;
    cring__comm_background_thread(); /* nobody waits on this thread's spin */
    while (!atomic_load(&e->stop)) {
        uint64_t token = cring__comm_wake_token(e->comm);
        if (rung) {
            /* Asynchronous submissions: give the producer CRING_CYCLE_TIME
             * to submit more, so they fuse; a thread that starts waiting
             * drives at once instead (it does not wait for this timer). */
            pthread_mutex_lock(&e->queue_mu);
            int queued = e->queue_head != NULL;
            pthread_mutex_unlock(&e->queue_mu);
            if (queued && e->cycle_time_s > 0 && !atomic_load(&e->callers_waiting)) {
                struct timespec ts = {(time_t)e->cycle_time_s,
                                      (long)((e->cycle_time_s - (double)(time_t)e->cycle_time_s) * 1e9)};
                nanosleep(&ts, NULL);
            }
            if (!try_drive(e) && e->over_tcp) { /* busy: a thread drives for its own handle */
                park_while_busy(e, token);
                continue;
            }
        }
        rung = 0;
        if (atomic_load(&e->stop) || atomic_load(&e->broken) != CRING_OK) break;
        pthread_mutex_lock(&e->queue_mu);
        int queued = e->queue_head != NULL;
        pthread_mutex_unlock(&e->queue_mu);
        if (queued && !atomic_load(&e->callers_waiting)) {
            rung = 1;
            continue;
        }
        rung = cring__comm_idle_wait(e->comm, token, 0.5);
    }
    return NULL;
}

/* Wait for h as its driver until it is done or deadline_s (0: none) passes;
 * returns 1 once done. Taking progress_mu is itself bounded by the deadline,
 * so a wait with one never blocks past it behind another driver. */
static int wait_until(cring_handle_t *h, double deadline_s) {
    cring_engine_t *e = h->engine;
    while (!atomic_load(&h->done)) {
        atomic_fetch_add(&e->callers_waiting, 1);
        if (deadline_s > 0) {
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            double left = deadline_s - cring__now_s();
            if (left <= 0) {
                atomic_fetch_sub(&e->callers_waiting, 1);
                return atomic_load(&h->done);
            }
            long ns = ts.tv_nsec + (long)((left - (double)(time_t)left) * 1e9);
            ts.tv_sec += (time_t)left + ns / 1000000000L;
            ts.tv_nsec = ns % 1000000000L;
            if (pthread_mutex_timedlock(&e->progress_mu, &ts) != 0) {
                atomic_fetch_sub(&e->callers_waiting, 1);
                return atomic_load(&h->done);
            }
        } else {
            pthread_mutex_lock(&e->progress_mu);
        }
        atomic_fetch_sub(&e->callers_waiting, 1);
        drive_locked(e, h, deadline_s);
        int stopped = atomic_load(&e->stop);
        pthread_mutex_unlock(&e->progress_mu);
        if (atomic_load(&e->thread_parked)) cring__comm_wake(e->comm);
        if (stopped && !atomic_load(&h->done)) wait_done_cv(e, h, 10 * 1000 * 1000);
        if (deadline_s > 0 && cring__now_s() >= deadline_s) return atomic_load(&h->done);
    }
    return 1;
}

cring_status_t cring_handle_wait(cring_handle_t *h) {
    wait_until(h, 0);
    return h->status;
}

int cring_handle_wait_for(cring_handle_t *h, double timeout_s) {
    if (atomic_load(&h->done)) return 1;
    if (timeout_s <= 0) return 0;
    return wait_until(h, cring__now_s() + timeout_s);
}

int cring_handle_done(const cring_handle_t *h) { return atomic_load(&((cring_handle_t *)h)->done); }
cring_status_t cring_handle_status(const cring_handle_t *h) { return h->status; }
const char *cring_handle_error(const cring_handle_t *h) { return h->error ? h->error : ""; }
int64_t cring_handle_value(const cring_handle_t *h) { return h->value; }

const void *cring_handle_output(const cring_handle_t *h, int index, size_t *bytes_out,
                                const int64_t **first_dims_out) {
    if (!h->outputs || index < 0 || index >= h->ntensors) return NULL;
    if (bytes_out) *bytes_out = h->output_bytes[index];
    if (first_dims_out) *first_dims_out = h->first_dims + (size_t)index * (size_t)h->size;
    return h->outputs[index];
}

void cring_handle_free(cring_handle_t *h) {
    if (h) handle_release(h);
}

/* ---- lifecycle ------------------------------------------------------------------------------ */

#define SPARE_MIN_BYTES (1u << 20)

static void *output_alloc(cring_engine_t *e, size_t bytes) {
    if (bytes >= SPARE_MIN_BYTES) {
        pthread_mutex_lock(&e->spare_mu);
        for (int k = 0; k < 4; k++)
            if (e->spare[k] && e->spare_bytes[k] == bytes) {
                void *p = e->spare[k];
                e->spare[k] = NULL;
                pthread_mutex_unlock(&e->spare_mu);
                return p;
            }
        pthread_mutex_unlock(&e->spare_mu);
    }
    return malloc(bytes ? bytes : 1);
}

/* Keep a large result's memory for reuse (replacing the oldest kept one). */
static void output_free(cring_engine_t *e, void *p, size_t bytes) {
    if (!p) return;
    if (bytes >= SPARE_MIN_BYTES && e) {
        pthread_mutex_lock(&e->spare_mu);
        void *old = e->spare[3];
        memmove(e->spare + 1, e->spare, 3 * sizeof *e->spare);
        memmove(e->spare_bytes + 1, e->spare_bytes, 3 * sizeof *e->spare_bytes);
        e->spare[0] = p;
        e->spare_bytes[0] = bytes;
        pthread_mutex_unlock(&e->spare_mu);
        free(old);
        return;
    }
    free(p);
}

static void engine_release(cring_engine_t *e) {
    if (atomic_fetch_sub(&e->refs, 1) != 1) return;
    for (int k = 0; k < 4; k++) free(e->spare[k]);
    free(atomic_load(&e->spare_handle));
    free(atomic_load(&e->spare_req));
    pthread_mutex_destroy(&e->spare_mu);
    pthread_mutex_destroy(&e->queue_mu);
    pthread_mutex_destroy(&e->done_mu);
    pthread_cond_destroy(&e->done_cv);
    pthread_mutex_destroy(&e->progress_mu);
    pthread_mutex_destroy(&e->timeline_mu);
    free(e);
}

cring_status_t cring_engine_start(cring_comm_t *comm, cring_engine_t **out) {
    *out = NULL;
    cring_engine_t *e = calloc(1, sizeof *e);
    if (!e) {
        cring_comm_destroy(comm);
        return submit_fail(CRING_ERR_NO_MEMORY, "out of memory");
    }
    e->comm = comm;
    e->rank = cring_comm_rank(comm);
    e->size = cring_comm_size(comm);
    atomic_store(&e->refs, 1);
    pthread_mutex_init(&e->queue_mu, NULL);
    pthread_mutex_init(&e->done_mu, NULL);
    pthread_cond_init(&e->done_cv, NULL);
    pthread_mutex_init(&e->progress_mu, NULL);
    pthread_mutex_init(&e->timeline_mu, NULL);
    pthread_mutex_init(&e->spare_mu, NULL);
    long threshold = cring__env_long("CRING_FUSION_THRESHOLD", DEFAULT_FUSION_THRESHOLD);
    e->fusion_threshold = threshold > 0 ? (size_t)threshold : 0;
    e->cycle_time_s = cring__env_double("CRING_CYCLE_TIME", 1.0) / 1000.0;
    e->stall_check_s = cring__env_double("CRING_STALL_CHECK_SECONDS", 60.0);
    e->stall_shutdown_s = cring__env_double("CRING_STALL_SHUTDOWN_SECONDS", 0.0);
    e->cache_capacity = (int)cring__env_long("CRING_CACHE_CAPACITY", DEFAULT_CACHE_CAPACITY);
    if (e->cache_capacity < 0) e->cache_capacity = 0;
    e->vhdr = V_HEADER + (size_t)e->size;
    e->over_tcp = strcmp(cring_comm_transport_name(comm), "tcp") == 0;
    e->joined = calloc((size_t)e->size, 1);
    e->join_round = calloc((size_t)e->size, sizeof *e->join_round);
    e->cache = calloc((size_t)(e->cache_capacity ? e->cache_capacity : 1), sizeof *e->cache);
    e->slot_state = malloc((size_t)(e->cache_capacity ? e->cache_capacity : 1));
    if (e->slot_state) memset(e->slot_state, 1, (size_t)(e->cache_capacity ? e->cache_capacity : 1));
    if (!e->cache || !e->slot_state || !e->joined || !e->join_round) {
        free(e->slot_state);
        free(e->joined);
        free(e->join_round);
        cring_comm_destroy(comm);
        engine_release(e);
        return submit_fail(CRING_ERR_NO_MEMORY, "out of memory");
    }
    const char *tl = getenv("CRING_TIMELINE");
    if (tl && *tl) {
        char path[8192];
        /* one file per rank: "trace.json" -> "trace.json" on rank 0 of 1,
         * "trace.<rank>.json" otherwise */
        const char *dot = strrchr(tl, '.');
        if (e->size > 1 && dot && !strchr(dot, '/'))
            snprintf(path, sizeof path, "%.*s.%d%s", (int)(dot - tl), tl, e->rank, dot);
        else if (e->size > 1)
            snprintf(path, sizeof path, "%s.%d", tl, e->rank);
        else
            snprintf(path, sizeof path, "%s", tl);
        if (cring__timeline_open(path, e->rank, &e->timeline) != CRING_OK)
            cring__log(CRING__LOG_WARNING, e->rank, "CRING_TIMELINE: cannot write %s", path);
        atomic_store(&e->timeline_on, e->timeline != NULL);
    }
    if (pthread_create(&e->thread, NULL, engine_main, e) != 0) {
        cring_comm_destroy(comm);
        cring__timeline_close(e->timeline);
        free(e->cache);
        free(e->slot_state);
        free(e->joined);
        free(e->join_round);
        engine_release(e);
        return submit_fail(CRING_ERR_SYSTEM, "cannot start the engine thread");
    }
    e->thread_started = 1;
    *out = e;
    return CRING_OK;
}

cring_comm_t *cring_engine_comm(cring_engine_t *e) { return e->comm; }

void cring_engine_stop(cring_engine_t *e) {
    if (!e) return;
    pthread_mutex_lock(&e->queue_mu);
    atomic_store(&e->stop, 1);
    pthread_mutex_unlock(&e->queue_mu);
    cring__comm_wake(e->comm);
    if (e->thread_started) pthread_join(e->thread, NULL);
    pthread_mutex_lock(&e->progress_mu);
    fail_all(e, CRING_ERR_CLOSED, "cring was shut down before this request completed");
    for (int i = 0; i < e->cache_capacity; i++) {
        e->cache[i].local = NULL;
        cache_evict(e, i);
    }
    free(e->cache);
    free(e->slot_state);
    e->cache = NULL;
    e->slot_state = NULL;
    e->cache_capacity = e->cache_slots = 0;
    for (size_t b = 0; b < e->table.nbuckets; b++)
        for (cring__strmap_entry_t *x = e->table.buckets[b]; x; x = x->next)
            table_entry_free(x->value, e->size);
    cring__strmap_free(&e->table);
    cring__strmap_free(&e->cache_index);
    free(e->uncached);
    free(e->joined);
    free(e->join_round);
    e->joined = NULL;
    e->join_round = NULL;
    free(e->vec);
    free(e->block);
    free(e->resp);
    free(e->peer_blocks);
    free(e->peer_lens);
    free(e->slot_hits);
    free(e->inval_ids);
    e->slot_hits = NULL;
    e->inval_ids = NULL;
    e->block = NULL;
    e->peer_blocks = NULL;
    e->peer_lens = NULL;
    free(e->fusion);
    e->uncached = NULL;
    e->vec = NULL;
    e->fusion = NULL;
    cring_comm_destroy(e->comm);
    e->comm = NULL;
    pthread_mutex_unlock(&e->progress_mu);
    pthread_mutex_lock(&e->timeline_mu);
    cring__timeline_close(e->timeline);
    e->timeline = NULL;
    pthread_mutex_unlock(&e->timeline_mu);
    pthread_mutex_lock(&e->queue_mu);
    cring__strmap_free(&e->in_flight);
    pthread_mutex_unlock(&e->queue_mu);
    engine_release(e);
}

cring_status_t cring_engine_exclusive(cring_engine_t *e,
                                      cring_status_t (*fn)(cring_comm_t *, void *), void *arg) {
    pthread_mutex_lock(&e->progress_mu);
    cring_status_t st = e->comm ? fn(e->comm, arg) : CRING_ERR_CLOSED;
    pthread_mutex_unlock(&e->progress_mu);
    return st;
}

void cring_engine_get_stats(cring_engine_t *e, cring_engine_stats_t *out) {
    out->cycles = atomic_load(&e->stats.cycles);
    out->collectives = atomic_load(&e->stats.collectives);
    out->tensors = atomic_load(&e->stats.tensors);
    out->fused_tensors = atomic_load(&e->stats.fused_tensors);
    out->cache_hits = atomic_load(&e->stats.cache_hits);
    out->errors = atomic_load(&e->stats.errors);
}

cring_status_t cring_engine_timeline(cring_engine_t *e, const char *path) {
    cring__timeline_t *tl = NULL;
    if (path) CRING_CHECK(cring__timeline_open(path, e->rank, &tl));
    pthread_mutex_lock(&e->timeline_mu);
    cring__timeline_t *old = e->timeline;
    e->timeline = tl;
    atomic_store(&e->timeline_on, tl != NULL);
    pthread_mutex_unlock(&e->timeline_mu);
    cring__timeline_close(old);
    return CRING_OK;
}

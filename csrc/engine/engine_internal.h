/* engine_internal.h: the engine's shared types and the functions its rooms
 * call in one another. One sub-struct of struct cring_engine per room, named
 * after the file that owns it; a room writes only its own sub-struct (others
 * read it where noted). Nothing outside csrc/engine includes this header. */
#ifndef CRING_ENGINE_INTERNAL_H
#define CRING_ENGINE_INTERNAL_H

#include <pthread.h>
#include <stdio.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "../common/common.h"
#include "../core/comm_internal.h"
#include "bucket_plan.h"
#include "strmap.h"
#include "timeline.h"

#define CRING__V_HEADER 5 /* flag bytes at the head of the negotiation vector */
#define CRING__MAX_NAME_BYTES 4096
#define CRING__DEVICE_TYPES 2 /* CRING_DEVICE_CPU, CRING_DEVICE_CUDA */

/* ---- requests and handles (request.c, handle.c) ---------------------------- */

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

/* A bounded stack of freed blocks of one kind (handle.c), linked through
 * their first word; any thread (a spin lock: each hold is a few loads and
 * stores). */
typedef struct cring__pool {
    atomic_flag busy;
    void *head;
    _Atomic int count;
} cring__pool_t;
void cring__pool_init(cring__pool_t *p);
/* A kept block (its contents undefined), or NULL when none is kept. */
void *cring__pool_take(cring__pool_t *p);
/* Keep block (at least a pointer's size) for a later take; 0 when the pool
 * is full (the caller frees it then). */
int cring__pool_give(cring__pool_t *p, void *block);
/* Free every kept block and the pool's lock. */
void cring__pool_free_all(cring__pool_t *p);

typedef struct req {
    char *name;
    size_t name_hash; /* cring__strmap_hash(name), for the engine's maps */
    cring_collective_t coll;
    cring_op_t op;
    int root;
    double prescale, postscale;
    cring_dtype_t compression; /* CRING_DTYPE_COUNT: none */
    int ntensors;
    tensor_spec_t *t;
    int64_t *splits;       /* alltoall: rows sent to each rank (size entries) */
    cring_device_t device; /* where every tensor lives (copied from the request) */
    void *ghost;           /* a joined rank's stand-in: its zero buffer (handle is NULL) */
    void *ready_event;     /* CUDA: the event its backend's prepare recorded on the
                          producer's stream; taken by execution, else discarded */
    cring_handle_t *handle;
    uint8_t *record; /* this rank's description of the request */
    size_t record_len;
    int cache_id; /* slot in the response cache, -1 when not cached */
    int wants_resend;
    int sequenced; /* CRING_REQUEST_SEQUENCED: an unnamed call (never held: bucket.c) */
    double submit_s, ready_s;
    struct req *next;
    struct req *successor; /* CRING_REQUEST_SEQUENCED: the next request of this name */
    size_t alloc_bytes;    /* of this allocation, so a spare can be reused */
} req_t;

struct cring_handle {
    _Atomic int done;
    _Atomic int refs; /* the caller's and the engine's */
    cring_status_t status;
    char *error;
    int ntensors;
    int size;
    void **outputs; /* allgather / alltoall results */
    size_t *output_bytes;
    /* How to free outputs: NULL means the engine's CPU allocator (large ones
     * from the result cache); a backend whose outputs are device memory sets both. */
    void (*free_output)(void *ctx, void *ptr, size_t bytes);
    void *free_ctx;
    /* NULL, or per output 1 when it is memory the caller lent with the
     * request (never freed here; exec_cuda.c's output_memory) */
    unsigned char *output_lent;
    cring_device_t output_device; /* CPU unless a backend set it */
    /* The request while it is not done (the driver reads it: bucket.c asks
     * whether a thread waits on a held bucket); NULL once done. */
    struct req *req;
    /* CUDA: the event after the request's work on the backend's stream (a
     * reference the handle holds), and how to drop it. */
    void *device_event;
    void (*device_event_put)(void *event);
    int64_t *first_dims; /* ntensors x size */
    /* The arrays above for one result among up to 8 ranks
     * (cring__handle_outputs): a synchronous loop of small allgathers then
     * allocates nothing for them. */
    struct {
        void *output;
        size_t bytes;
        int64_t first_dims[8];
        unsigned char lent;
    } one;
    int64_t value; /* join: the last rank to join */
    cring_engine_t *engine;
};

/* A request record's bytes besides its name and tensors (request.c
 * describes the layout; table.c builds rank 0's time-out verdicts in it). */
#define CRING__RECORD_FIXED_BYTES 30

/* A request record parsed (request.c describes the layout). */
typedef struct parsed {
    const char *name;
    size_t name_len;
    int coll, op, compression, root, ntensors;
    int device_type, device_id;
    double prescale, postscale;
    const uint8_t *tensors; /* start of the tensor section */
    size_t tensors_len;
} parsed_t;

/* ---- negotiation (negotiate.c, table.c) ------------------------------------ */

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
    int timeout_sent; /* rank 0: its time-out verdict is queued or sent */
} table_entry_t;

typedef struct response {
    req_t *req;
    int executed;          /* its data already travelled with the negotiation round */
    cring_status_t status; /* CRING_ERR_MISMATCH / CRING_ERR_TIMEOUT with message, or OK */
    char *error;
    const int64_t *first_dims; /* allgather: ntensors x size (not owned) */
    int64_t *owned_dims;
} response_t;

/* A growing list of responses for one round. */
typedef struct response_list {
    response_t *items;
    int n, cap;
} response_list_t;

#include "backend.h"

/* ---- autotune (autotune.c) -------------------------------------------------- */

/* The knobs the tuner sets, as every rank applies them. */
typedef struct cring__tune_knobs {
    uint64_t fusion_threshold_bytes;
    uint32_t cycle_time_us;
} cring__tune_knobs_t;

enum {
    CRING__TUNE_BASELINE,
    CRING__TUNE_THRESHOLD,
    CRING__TUNE_CYCLE,
    CRING__TUNE_CONFIRM,
    CRING__TUNE_SETTLED
};

/* The search, a pure function of the scores it is given (autotune.c says
 * which trials it runs). `current` is the trial being measured. */
#define CRING__TUNE_CONFIRM_PAIRS 3
typedef struct cring__tune_search {
    cring__tune_knobs_t start, current, best;
    double best_score;
    int phase;      /* CRING__TUNE_*: which knob the current trial varies */
    int next;       /* the next grid index of the phase; in CONFIRM, trials done */
    int trials;     /* trials scored so far */
    int best_trial; /* which of them (1-based) scored best_score */
    /* CONFIRM: start and best alternate; each pair's best / start */
    double confirm_start_score, confirm_best_score, confirm_ratio[CRING__TUNE_CONFIRM_PAIRS];
} cring__tune_search_t;

#define CRING__TUNE_MAX_SAMPLES 32

/* The tuner's state. Rounds are numbered alike on every rank, so a sync
 * round (every rank broadcasts rank 0's decision and applies it) falls on
 * the same round boundary everywhere. Written by the driver only. */
typedef struct cring__tune {
    int on;                   /* tuning: the round hook runs (every rank) */
    uint64_t next_sync_round; /* rounds_done at which the next decision travels */
    /* rank 0, the coordinator */
    int warmup_windows, sample_windows, window; /* window: index within the trial */
    double window_s;                            /* aimed-at length of one window */
    double window_start_s, last_sync_s;
    uint64_t last_sync_round;
    /* a step: one cycle of the job's work, from one completion of the
     * anchor (the first name completed twice) to its next */
    uint64_t anchor;    /* hash of the anchor's name, 0 until one recurs */
    uint64_t *seen;     /* names' hashes until then (open addressing) */
    uint64_t steps;     /* anchor completions since window_start_s */
    double last_step_s; /* when the anchor last completed */
    int steps_per_window;
    double samples[CRING__TUNE_MAX_SAMPLES];
    cring__tune_search_t search;
    FILE *log;
    /* what cring_engine_get_stats shows (any thread reads them) */
    _Atomic uint64_t shown_threshold_bytes;
    _Atomic uint32_t shown_cycle_time_us;
    _Atomic int shown_state; /* CRING_AUTOTUNE_OFF / _TUNING / _SETTLED */
} cring__tune_t;

struct cring_engine {
    cring_comm_t *comm;
    int rank, size;
    _Atomic int refs;
    pthread_t thread;
    int thread_started;
    _Atomic int stop;
    _Atomic int broken; /* CRING_OK while usable */
    char broken_msg[CRING__ERRMSG_BYTES];
    /* execution backends by device type, chosen once at start */
    const cring__backend_t *backends[CRING__DEVICE_TYPES];

    /* engine.c: submission queue, name -> req from submit to completion */
    struct {
        pthread_mutex_t mu;
        req_t *head, *tail;
        cring__strmap_t in_flight;
    } queue;

    /* handle.c: completion signalling */
    struct {
        pthread_mutex_t mu;
        pthread_cond_t cv;
        _Atomic int waiters; /* threads blocked on cv */
    } done;

    /* engine.c: who drives rounds (state under mu) */
    struct {
        pthread_mutex_t mu;
        _Atomic int callers_waiting; /* threads blocked on mu for their own handle */
        _Atomic int thread_parked;   /* the engine thread waits for a busy driver to leave */
        uint64_t rounds_done;
        double cycle_time_s;
        /* another thread's driving keeps the peers' data readable, so the
         * engine thread must park rather than wait for input (comm property) */
        int park_while_busy;
        cring_handle_t *until; /* the handle the current driver waits for, or NULL */
    } drive;

    /* handle.c: spare objects. (Large allgather/alltoall results come from
     * the process-wide result cache, common/result_cache.c.) */
    struct {
        _Atomic(cring_handle_t *) handle; /* the last freed handle, for the next submit */
        _Atomic(req_t *) req;             /* the last request run, likewise */
        /* Beyond the one above: freed handles and small requests for the next
         * submissions, so a burst of asynchronous ones allocates nothing. */
        cring__pool_t handles, reqs;
    } spare;

    /* negotiate.c: the round's vector and blocks (under drive.mu) */
    struct {
        cring__strmap_t pending; /* drained requests waiting for a response */
        req_t **uncached;        /* requests to describe in the next round */
        size_t nuncached, cap_uncached;
        uint8_t *vec;
        size_t vec_cap;
        uint8_t *block; /* this rank's negotiation block, when gathering */
        size_t block_cap;
        const void **peer_blocks;
        size_t *peer_lens;
        uint16_t *slot_hits;        /* per slot while combining blocks; all zero between rounds */
        uint32_t *inval_ids;        /* scratch: slots this rank invalidates in a round */
        uint32_t *touched;          /* slots some rank listed in this round's blocks */
        int ntouched;               /* how many; -1 after a dense exchange (TCP) */
        req_t *last_attached;       /* the request most recently matched to a cache slot */
        cring_status_t spec_status; /* a request that rode the round but could not finish */
        response_t *resp;           /* run_round's responses, kept between rounds */
        int cap_resp;
        int abort_requested;
        double last_stall_check_s;
        double stall_check_s, stall_shutdown_s;
        double timeout_s; /* the communicator's: a name missing ranks this long fails */
    } neg;

    /* table.c: the response cache (slots in the vector) */
    struct {
        cache_slot_t *slots;
        uint8_t *slot_state; /* this rank's vector byte per slot: 0 invalidate, 1 idle, 2 pending */
        int capacity, nslots;  /* slots[0..nslots) are in the vector */
        cring__strmap_t index; /* name -> slot + 1 */
    } cache;

    /* table.c: names not every rank has described yet */
    struct {
        cring__strmap_t map; /* name -> table_entry_t */
        char **timeouts;     /* rank 0: names to time out in the next record exchange */
        size_t ntimeouts, cap_timeouts;
    } table;

    /* execute.c: fusion, the batch being run */
    struct {
        void *fusion;
        size_t fusion_cap;
        size_t threshold;
        char error[CRING__ERRMSG_BYTES]; /* a backend's message for its last failure */
        req_t **batch;                   /* room for a round's responses, kept between rounds */
        int batch_cap;
        /* exec_cuda.c: this engine's CUDA devices (communicator, stream,
         * device buffers each); NULL until its first CUDA batch */
        struct cring__cuda_state *cuda;
    } exec;

    /* bucket.c: the CUDA gradient bucket plan (bucket_plan.h, bucket_plan.c) */
    struct {
        cring__bplan_t plan;
    } bucket;

    /* join.c: vector bytes [CRING__V_HEADER, vhdr) carry one joined flag per rank */
    struct {
        size_t vhdr;
        req_t *req;            /* this rank's join, once drained */
        _Atomic int in_flight; /* from submit to completion: no other submissions */
        uint8_t *joined;       /* per rank, as of the last round */
        uint64_t *round;       /* per rank: the round it was first seen joined, 0 if not */
        int njoined;
    } join;

    /* introspection (relaxed atomics: counters only) */
    struct {
        _Atomic uint64_t cycles, collectives, tensors, fused_tensors, cache_hits, errors;
        _Atomic uint64_t bucket_held, bucket_idle_releases; /* bucket.c */
    } stats;
    pthread_mutex_t timeline_mu;
    cring__timeline_t *timeline;
    _Atomic int timeline_on;          /* read without the lock by submitters */
    _Atomic int timeline_mark_cycles; /* a CYCLE_START marker per negotiation round */
    cring__tune_t tune;               /* autotune.c (its hooks: execute.c, negotiate.c) */
};

/* ---- engine.c ---------------------------------------------------------------- */

/* Record why a submission failed (cring_engine_error_message) and return st. */
cring_status_t cring__engine_submit_fail(cring_status_t st, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
/* The communicator failed: mark the engine broken and fail every request. */
cring_status_t cring__engine_transport_failed(cring_engine_t *e, cring_status_t st);
void cring__engine_release(cring_engine_t *e);
/* r completed: drop its name from the in-flight set and queue the request
 * that waited behind it (CRING_REQUEST_SEQUENCED), or fail that one too when
 * the engine is stopping. */
void cring__engine_name_done(cring_engine_t *e, req_t *r, cring_status_t st, const char *error);
void cring__engine_span_write(cring_engine_t *e, const char *name, const char *phase, double t0,
                              double t1, const char *args);
/* A timeline span, when a timeline is open (a small call makes several: the
 * check stays inline, so without a timeline they cost nothing). */
static inline void cring__engine_span(cring_engine_t *e, const char *name, const char *phase,
                                      double t0, double t1, const char *args) {
    if (e->timeline) cring__engine_span_write(e, name, phase, t0, t1, args);
}

/* The Horovod-shaped spans around a request (call only with a timeline):
 * its row label and NEGOTIATE_<OP> from submission to t_ready; <OP> from
 * ready to done (QUEUE, the copies and the transfer nest inside it); a
 * CYCLE_START marker. */
void cring__engine_span_negotiated(cring_engine_t *e, const req_t *r, double t_ready);
void cring__engine_span_done(cring_engine_t *e, const req_t *r);
void cring__engine_mark_cycle(cring_engine_t *e);

/* Timestamps only matter to the timeline; reading the clock is not free. */
static inline double cring__engine_tl_now(const cring_engine_t *e) {
    return e->timeline ? cring__now_s() : 0.0;
}

/* Only the driver (drive.mu held) counts, so a plain load and store
 * suffice: a locked add costs more than some whole steps of a small
 * allreduce. Readers load the fields atomically. */
static inline void cring__engine_stats_add(_Atomic uint64_t *field, uint64_t n) {
    atomic_store_explicit(field, atomic_load_explicit(field, memory_order_relaxed) + n,
                          memory_order_relaxed);
}

/* ---- request.c --------------------------------------------------------------- */

cring_status_t cring__req_validate(cring_engine_t *e, const cring_request_t *q);
req_t *cring__req_make(cring_engine_t *e, const cring_request_t *q, int size);
void cring__req_free(req_t *r);
void cring__req_recycle(cring_engine_t *e, req_t *r);
int cring__record_parse(const uint8_t *rec, size_t len, parsed_t *out);
/* How b (rank rb) differs from a (rank ra): the length of the message written
 * to out, or 0 when they agree. */
int cring__record_difference(const parsed_t *a, int ra, const parsed_t *b, int rb, char *out,
                             size_t n);
void cring__record_first_dims(const parsed_t *p, int r, int size, int64_t *dims);
/* "cpu", "cuda:1" */
void cring__device_describe(int type, int id, char *out, size_t n);

/* ---- handle.c ---------------------------------------------------------------- */

/* Complete a request: record the status, drop the name from the in-flight set,
 * wake waiters, release the engine's reference. The caller owns r. */
void cring__engine_complete(cring_engine_t *e, req_t *r, cring_status_t st, const char *error);
void cring__handle_release(cring_handle_t *h);
void *cring__output_alloc(cring_engine_t *e, size_t bytes);
/* The output arrays of h for ntensors results among size ranks (outputs,
 * output_bytes, first_dims (ntensors x size), output_lent), zeroed, in one
 * allocation that the handle's release frees. CRING_ERR_NO_MEMORY, nothing
 * set, when out of memory. */
cring_status_t cring__handle_outputs(cring_handle_t *h, int ntensors, int size);
/* Result i of h, `bytes` long, in the room the caller lent with the request
 * (t->recv, `room` bytes) when it fits: marked lent (never freed by the
 * handle), set as outputs[i] and returned. Sets output_bytes[i] (the arrays
 * of cring__handle_outputs) either way; NULL, outputs[i] untouched, when
 * there is no room or it is too small: the caller allocates (on the CPU
 * cring__output_place, on CUDA exec_cuda.c's device memory). */
void *cring__output_lend(cring_handle_t *h, int i, const tensor_spec_t *t, size_t room,
                         size_t bytes);
/* Result i of h on the CPU: cring__output_lend's room, else
 * cring__output_alloc's memory; NULL when out of memory. */
void *cring__output_place(cring_engine_t *e, cring_handle_t *h, int i, const tensor_spec_t *t,
                          size_t room, size_t bytes);
void cring__spare_free_all(cring_engine_t *e);

/* ---- table.c: the response cache and the table ------------------------------- */

int cring__uncached_push(cring_engine_t *e, req_t *r);
void cring__cache_evict(cring_engine_t *e, int id);
void cring__table_entry_free(table_entry_t *t, int size);
/* Move queued requests into the driver's structures. */
void cring__engine_drain(cring_engine_t *e);
response_t *cring__response_add(response_list_t *l);
/* Names every rank described or joined for. */
int cring__table_entry_complete(const cring_engine_t *e, const table_entry_t *t);
/* A table entry every rank has described (or joined for): check, answer,
 * cache. Frees t. */
cring_status_t cring__table_answer(cring_engine_t *e, table_entry_t *t, response_list_t *l);
/* Exchange uncached records (and rank 0's time-out verdicts) and feed them to
 * the table; complete entries become responses. */
cring_status_t cring__table_exchange(cring_engine_t *e, response_list_t *l);
/* Rank 0: queue verdicts for names that waited past the time-out. */
void cring__table_check_timeouts(cring_engine_t *e, double now);
void cring__table_free_all(cring_engine_t *e);

/* ---- negotiate.c ------------------------------------------------------------- */

/* One round. *progress is set when some request completed. */
cring_status_t cring__negotiate_round(cring_engine_t *e, int *progress);
/* Fail every request this rank holds: queued, pending or in the table. */
void cring__negotiate_fail_all(cring_engine_t *e, cring_status_t st, const char *msg);
void cring__negotiate_free(cring_engine_t *e);

/* ---- join.c ------------------------------------------------------------------ */

req_t *cring__join_ghost(cring_engine_t *e, const uint8_t *rec, size_t len);
int cring__join_conflict(cring_engine_t *e, const uint8_t *rec, size_t len, char *msg, size_t n);
/* Read the joined flags from the combined vector; returns 1 when a rank
 * joined in this round. */
int cring__join_update(cring_engine_t *e, const uint8_t *v);
cring_status_t cring__join_sweep(cring_engine_t *e, response_list_t *l);
/* Every rank joined: complete this rank's join. Returns 1 if it did. */
int cring__join_finish(cring_engine_t *e);

/* ---- execute.c --------------------------------------------------------------- */

/* Run every successful response in order, batching what can be fused, then
 * complete each request. Returns a transport failure, if any. */
cring_status_t cring__execute(cring_engine_t *e, response_t *resp, int n);
int cring__fusion_reserve(cring_engine_t *e, size_t bytes);
void cring__fused_spans(cring_engine_t *e, req_t **batch, int n, const char *phase, double t0,
                        double t1, double t2, double t3, const char *args);

/* ---- bucket.c ------------------------------------------------------------------ */

/* Before execute: hand the round's ready CUDA allreduces to the planner,
 * take out of l those it holds (their bucket is not complete), and append
 * the held requests that go this round; release_all (the agreed flag V[3] or
 * V[4]) releases everything held, cut (V[4]) also cuts the plan. Never
 * fails: what cannot be appended fails its handle. */
void cring__bucket_round(cring_engine_t *e, response_list_t *l, int release_all, int cut);
/* This rank's vote for releasing everything held (cring__bplan_vote):
 * CRING__RELEASE_WAITER, CRING__RELEASE_IDLE or 0. */
int cring__bucket_release_wanted(cring_engine_t *e);
/* The round's batch ran: if it held gradients of the plan, held requests
 * are not idle (a long collective of the step is no reason to release). */
void cring__bucket_ran(cring_engine_t *e);
/* Fail every held request (a broken transport, the engine's stop). */
void cring__bucket_fail_all(cring_engine_t *e, cring_status_t st, const char *msg);
void cring__bucket_free(cring_engine_t *e);

/* ---- autotune.c --------------------------------------------------------------- */

/* Read CRING_AUTOTUNE*; the current knobs are e->exec.threshold and
 * e->drive.cycle_time_s, already read. Starts tuning when asked. */
void cring__autotune_start(cring_engine_t *e);
void cring__autotune_stop(cring_engine_t *e);
/* While e->tune.on, after every round on every rank: at a sync round, rank 0
 * decides and every rank applies the decision. Returns a transport failure. */
cring_status_t cring__autotune_round(cring_engine_t *e);
/* While e->tune.on: rank 0 notes the steps (anchor completions) of a round's
 * successful responses. */
void cring__autotune_count(cring_engine_t *e, const response_t *resp, int n);
/* The search (pure; tested in csrc/tests/test_autotune.c). step scores the
 * current trial and moves to the next; returns 1 once settled (current is
 * then the best). */
void cring__tune_search_init(cring__tune_search_t *s, cring__tune_knobs_t start);
int cring__tune_search_step(cring__tune_search_t *s, double score);
/* The median of n scores (sorts them in place). */
double cring__tune_median(double *scores, int n);

#endif

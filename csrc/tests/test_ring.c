/* test_ring.c: checks the ring collectives of algo/ring.c (allreduce, reducescatter,
 * allgatherv, broadcast, barrier) at world sizes 1..8 with zero, tiny, odd and
 * large counts, against references computed here. Ranks are threads joined by
 * an in-process fake transport; alarm() turns a deadlock into a failure. */
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "algo/algo.h"
#include "common/common.h"
#include "reduce/reduce.h"
#include "reduce/reduce_impl.h"
#include "testutil.h"

#define MAX_RANKS 8
#define BIG_COUNT 1000003

/* ---- fake p2p transport (a test double) ---------------------------------------------
 * Not a real transport: ranks are threads of this process, and every ordered
 * pair (from, to) has a bounded FIFO byte queue guarded by one world-wide mutex
 * and condition variable. sendrecv pushes into queue (me, send_peer) and pops
 * from queue (recv_peer, me) in the same loop, waiting only when neither side
 * can move, which is the progress guarantee transport.h promises. The small
 * capacity makes an algorithm that relies on more buffering than that deadlock
 * (and the watchdog fire) instead of passing by luck. It also checks the
 * rules a real transport enforces: no self-sends, peers in range, and (at the
 * end of each collective) that every byte sent was received. */
typedef struct fifo {
    unsigned char *data;
    size_t head, len;
} fifo_t;

typedef struct world {
    int size;
    size_t capacity; /* bytes per queue */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    fifo_t queues[MAX_RANKS * MAX_RANKS]; /* [from * size + to] */
    long fail_after;                      /* >= 0: the call after this many fails */
    long calls;
    int failed;
    int protocol_errors;
} world_t;

typedef struct fake_p2p {
    cring__p2p_t base; /* first, so a cring__p2p_t * is a fake_p2p_t * */
    world_t *world;
} fake_p2p_t;

static cring_status_t fake_sendrecv(cring__p2p_t *p2p, int send_peer, const void *send_buf,
                                    size_t send_bytes, int recv_peer, void *recv_buf,
                                    size_t recv_bytes) {
    fake_p2p_t *f = (fake_p2p_t *)p2p;
    world_t *w = f->world;
    const int me = p2p->rank;
    int do_send = send_peer >= 0 && send_bytes > 0;
    int do_recv = recv_peer >= 0 && recv_bytes > 0;
    pthread_mutex_lock(&w->mu);
    if ((do_send && (send_peer >= w->size || send_peer == me || !send_buf)) ||
        (do_recv && (recv_peer >= w->size || recv_peer == me || !recv_buf))) {
        w->protocol_errors++;
        pthread_mutex_unlock(&w->mu);
        return CRING_ERR_INVALID_ARGUMENT;
    }
    if (w->fail_after >= 0 && w->calls >= w->fail_after) w->failed = 1;
    w->calls++;
    fifo_t *out = do_send ? &w->queues[me * w->size + send_peer] : NULL;
    fifo_t *in = do_recv ? &w->queues[recv_peer * w->size + me] : NULL;
    size_t sent = do_send ? 0 : send_bytes, got = do_recv ? 0 : recv_bytes;
    cring_status_t st = CRING_OK;
    while (sent < send_bytes || got < recv_bytes) {
        if (w->failed) {
            st = CRING_ERR_PEER_FAILURE;
            break;
        }
        int moved = 0;
        while (sent < send_bytes && out->len < w->capacity) {
            size_t tail = (out->head + out->len) % w->capacity;
            size_t n = CRING_MIN(send_bytes - sent, w->capacity - out->len);
            n = CRING_MIN(n, w->capacity - tail);
            memcpy(out->data + tail, (const unsigned char *)send_buf + sent, n);
            out->len += n;
            sent += n;
            moved = 1;
        }
        while (got < recv_bytes && in->len > 0) {
            size_t n = CRING_MIN(recv_bytes - got, in->len);
            n = CRING_MIN(n, w->capacity - in->head);
            memcpy((unsigned char *)recv_buf + got, in->data + in->head, n);
            in->head = (in->head + n) % w->capacity;
            in->len -= n;
            got += n;
            moved = 1;
        }
        if (moved) pthread_cond_broadcast(&w->cv);
        else pthread_cond_wait(&w->cv, &w->mu);
    }
    if (st != CRING_OK) pthread_cond_broadcast(&w->cv);
    pthread_mutex_unlock(&w->mu);
    return st;
}

static void fake_destroy(cring__p2p_t *p2p) { (void)p2p; }

static const cring__p2p_ops_t fake_ops = {
    .name = "fake", .sendrecv = fake_sendrecv, .destroy = fake_destroy};

static world_t *world_new(int size, size_t capacity) {
    world_t *w = calloc(1, sizeof *w);
    CHECK(w);
    w->size = size;
    w->capacity = capacity;
    w->fail_after = -1;
    pthread_mutex_init(&w->mu, NULL);
    pthread_cond_init(&w->cv, NULL);
    for (int i = 0; i < size * size; i++) {
        w->queues[i].data = malloc(capacity);
        CHECK(w->queues[i].data);
    }
    return w;
}

static void world_free(world_t *w) {
    for (int i = 0; i < w->size * w->size; i++) free(w->queues[i].data);
    pthread_mutex_destroy(&w->mu);
    pthread_cond_destroy(&w->cv);
    free(w);
}

static int world_drained(world_t *w) {
    for (int i = 0; i < w->size * w->size; i++)
        if (w->queues[i].len) return 0;
    return 1;
}

/* ---- running one collective on every rank ------------------------------------------- */
typedef cring_status_t (*rank_fn)(void *ctx, cring__p2p_t *p2p, cring__scratch_t *scratch);

typedef struct rank_job {
    fake_p2p_t p2p;
    cring__scratch_t scratch;
    rank_fn fn;
    void *ctx;
    cring_status_t status;
} rank_job_t;

static void *rank_main(void *arg) {
    rank_job_t *job = arg;
    job->status = job->fn(job->ctx, &job->p2p.base, &job->scratch);
    cring__scratch_free(&job->scratch);
    cring__scratch_free(&job->scratch); /* twice: must be harmless */
    return NULL;
}

/* Run fn on ranks 0..size-1 in threads; statuses go to status[] (may be NULL:
 * then each must be CRING_OK). Checks that no byte was left in flight. */
static void run_world(int size, size_t capacity, rank_fn fn, void *ctx, long fail_after,
                      cring_status_t *status) {
    world_t *w = world_new(size, capacity);
    w->fail_after = fail_after;
    rank_job_t jobs[MAX_RANKS];
    pthread_t threads[MAX_RANKS];
    for (int r = 0; r < size; r++) {
        jobs[r] =
            (rank_job_t){.p2p = {.base = {.ops = &fake_ops, .rank = r, .size = size}, .world = w},
                         .fn = fn,
                         .ctx = ctx};
        CHECK(pthread_create(&threads[r], NULL, rank_main, &jobs[r]) == 0);
    }
    for (int r = 0; r < size; r++) CHECK(pthread_join(threads[r], NULL) == 0);
    CHECK(w->protocol_errors == 0);
    for (int r = 0; r < size; r++) {
        if (status) status[r] = jobs[r].status;
        else CHECK_OK(jobs[r].status);
    }
    if (!status) CHECK(world_drained(w));
    world_free(w);
}

/* Small queues for small messages (many partial transfers), larger ones for
 * the big counts so the test stays quick. */
static size_t capacity_for(size_t bytes) { return bytes > 100000 ? (size_t)1 << 20 : 61; }

/* ---- values and references -------------------------------------------------------------
 * Floating inputs are small integers (or powers of two for PRODUCT), so every
 * order of combination gives the same exact result and the reference can be
 * computed in double. Integer inputs are arbitrary bits (wrap-around). */
static uint64_t mix(uint64_t x) {
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return x;
}

static int is_float(cring_dtype_t dt) {
    return dt == CRING_FLOAT16 || dt == CRING_BFLOAT16 || dt == CRING_FLOAT32 ||
           dt == CRING_FLOAT64;
}

/* The logical value of rank r's element i (a double for floats, bits for ints). */
static double float_value(cring_op_t op, int r, size_t i, uint64_t seed) {
    uint64_t h = mix(seed * 1000003u + (uint64_t)r * 7919u + i);
    if (op == CRING_PRODUCT) {
        static const double choices[] = {1, -1, 2, 0.5, 1, -2};
        return choices[h % 6];
    }
    return (double)((int)(h % 15) - 7);
}

static void store_value(cring_dtype_t dt, void *buf, size_t i, double fv, uint64_t bits) {
    switch (dt) {
    case CRING_FLOAT16: ((uint16_t *)buf)[i] = cring__f32_to_f16((float)fv); break;
    case CRING_BFLOAT16: ((uint16_t *)buf)[i] = cring__f32_to_bf16((float)fv); break;
    case CRING_FLOAT32: ((float *)buf)[i] = (float)fv; break;
    case CRING_FLOAT64: ((double *)buf)[i] = fv; break;
    case CRING_INT8:
    case CRING_UINT8: ((uint8_t *)buf)[i] = (uint8_t)bits; break;
    case CRING_INT32: ((uint32_t *)buf)[i] = (uint32_t)bits; break;
    default: ((uint64_t *)buf)[i] = bits; break;
    }
}

static void fill_input(cring_dtype_t dt, cring_op_t op, int r, void *buf, size_t count,
                       uint64_t seed) {
    for (size_t i = 0; i < count; i++)
        store_value(dt, buf, i, float_value(op, r, i, seed),
                    mix(seed ^ ((uint64_t)r << 40) ^ (i * 2654435761u)));
}

static int64_t int_load(cring_dtype_t dt, const void *p, size_t i) {
    switch (dt) {
    case CRING_INT8: return ((const int8_t *)p)[i];
    case CRING_UINT8: return ((const uint8_t *)p)[i];
    case CRING_INT32: return ((const int32_t *)p)[i];
    default: return ((const int64_t *)p)[i];
    }
}

static int64_t int_wrap(cring_dtype_t dt, uint64_t v) {
    switch (dt) {
    case CRING_INT8: return (int8_t)(uint8_t)v;
    case CRING_UINT8: return (uint8_t)v;
    case CRING_INT32: return (int32_t)(uint32_t)v;
    default: return (int64_t)v;
    }
}

/* want[i - first] = op over ranks of input element i, for i in [first, first+n). */
static void reference(cring_dtype_t dt, cring_op_t op, int size, void *const *inputs, size_t first,
                      size_t n, void *want, uint64_t seed) {
    for (size_t k = 0; k < n; k++) {
        size_t i = first + k;
        if (is_float(dt)) {
            double acc = float_value(op, 0, i, seed);
            for (int r = 1; r < size; r++) {
                double x = float_value(op, r, i, seed);
                switch (op) {
                case CRING_SUM:
                case CRING_AVERAGE: acc += x; break;
                case CRING_PRODUCT: acc *= x; break;
                case CRING_MIN: acc = x < acc ? x : acc; break;
                default: acc = x > acc ? x : acc; break;
                }
            }
            if (op == CRING_AVERAGE) { /* divided in the compute precision */
                if (dt == CRING_FLOAT64) acc = acc / size;
                else acc = (double)((float)acc / (float)size);
            }
            store_value(dt, want, k, acc, 0);
        } else {
            int64_t acc = int_load(dt, inputs[0], i);
            for (int r = 1; r < size; r++) {
                int64_t x = int_load(dt, inputs[r], i);
                switch (op) {
                case CRING_SUM:
                case CRING_AVERAGE: acc = int_wrap(dt, (uint64_t)acc + (uint64_t)x); break;
                case CRING_PRODUCT: acc = int_wrap(dt, (uint64_t)acc * (uint64_t)x); break;
                case CRING_MIN: acc = x < acc ? x : acc; break;
                default: acc = x > acc ? x : acc; break;
                }
            }
            if (op == CRING_AVERAGE) acc /= size;
            store_value(dt, want, k, 0, (uint64_t)acc);
        }
    }
}

static void expect_bytes(const char *what, int size, int rank, const void *got, const void *want,
                         size_t nbytes) {
    if (nbytes && memcmp(got, want, nbytes)) {
        size_t at = 0;
        while (((const unsigned char *)got)[at] == ((const unsigned char *)want)[at]) at++;
        fprintf(stderr, "%s: size %d rank %d: first wrong byte %zu of %zu\n", what, size, rank, at,
                nbytes);
    }
    CHECK(nbytes == 0 || !memcmp(got, want, nbytes));
}

/* ---- allreduce --------------------------------------------------------------------------- */
typedef struct allreduce_case {
    cring_dtype_t dtype;
    cring_op_t op;
    size_t count;
    int in_place;
    int tree; /* recursive doubling (algo/tree.c) instead of the ring */
    void *send[MAX_RANKS], *recv[MAX_RANKS];
} allreduce_case_t;

static cring_status_t allreduce_rank(void *ctx, cring__p2p_t *p2p, cring__scratch_t *scratch) {
    allreduce_case_t *c = ctx;
    int r = p2p->rank;
    if (c->tree)
        return cring__tree_allreduce(p2p, scratch, c->send[r],
                                     c->in_place ? c->send[r] : c->recv[r], c->count, c->dtype,
                                     c->op);
    return cring__ring_allreduce(p2p, scratch, c->send[r], c->in_place ? c->send[r] : c->recv[r],
                                 c->count, c->dtype, c->op);
}

static void check_allreduce_with(int size, cring_dtype_t dt, cring_op_t op, size_t count,
                                 int in_place, int tree) {
    static uint64_t seed = 1;
    seed++;
    size_t es = cring_dtype_size(dt), bytes = count * es;
    allreduce_case_t c = {
        .dtype = dt, .op = op, .count = count, .in_place = in_place, .tree = tree};
    void *inputs[MAX_RANKS];
    for (int r = 0; r < size; r++) {
        c.send[r] = malloc(bytes + 1);
        c.recv[r] = malloc(bytes + 1);
        inputs[r] = malloc(bytes + 1);
        CHECK(c.send[r] && c.recv[r] && inputs[r]);
        fill_input(dt, op, r, inputs[r], count, seed);
        memcpy(c.send[r], inputs[r], bytes);
        memset(c.recv[r], 0x5a, bytes);
    }
    run_world(size, capacity_for(bytes), allreduce_rank, &c, -1, NULL);
    void *want = malloc(bytes + 1);
    CHECK(want);
    reference(dt, op, size, inputs, 0, count, want, seed);
    for (int r = 0; r < size; r++) {
        char what[96];
        snprintf(what, sizeof what, "%s allreduce %s %s count %zu%s", tree ? "tree" : "ring",
                 cring_dtype_name(dt), cring_op_name(op), count, in_place ? " in place" : "");
        expect_bytes(what, size, r, in_place ? c.send[r] : c.recv[r], want, bytes);
        if (!in_place)
            expect_bytes("allreduce left send alone", size, r, c.send[r], inputs[r], bytes);
        free(c.send[r]);
        free(c.recv[r]);
        free(inputs[r]);
    }
    free(want);
}

static void check_allreduce(int size, cring_dtype_t dt, cring_op_t op, size_t count, int in_place) {
    check_allreduce_with(size, dt, op, count, in_place, 0);
}

/* ---- reducescatter ------------------------------------------------------------------------- */
typedef struct reducescatter_case {
    cring_dtype_t dtype;
    cring_op_t op;
    size_t counts[MAX_RANKS];
    void *send[MAX_RANKS], *recv[MAX_RANKS];
} reducescatter_case_t;

static cring_status_t reducescatter_rank(void *ctx, cring__p2p_t *p2p, cring__scratch_t *scratch) {
    reducescatter_case_t *c = ctx;
    return cring__ring_reducescatter(p2p, scratch, c->send[p2p->rank], c->recv[p2p->rank],
                                     c->counts, c->dtype, c->op);
}

static void check_reducescatter(int size, cring_dtype_t dt, cring_op_t op, const size_t *counts) {
    static uint64_t seed = 100;
    seed++;
    size_t es = cring_dtype_size(dt), total = 0;
    reducescatter_case_t c = {.dtype = dt, .op = op};
    for (int r = 0; r < size; r++) {
        c.counts[r] = counts[r];
        total += counts[r];
    }
    void *inputs[MAX_RANKS];
    for (int r = 0; r < size; r++) {
        c.send[r] = malloc(total * es + 1);
        inputs[r] = malloc(total * es + 1);
        c.recv[r] = malloc(counts[r] * es + 1);
        CHECK(c.send[r] && inputs[r] && c.recv[r]);
        fill_input(dt, op, r, inputs[r], total, seed);
        memcpy(c.send[r], inputs[r], total * es);
        memset(c.recv[r], 0x5a, counts[r] * es);
    }
    run_world(size, capacity_for(total * es), reducescatter_rank, &c, -1, NULL);
    size_t first = 0;
    for (int r = 0; r < size; r++) {
        void *want = malloc(counts[r] * es + 1);
        CHECK(want);
        reference(dt, op, size, inputs, first, counts[r], want, seed);
        char what[96];
        snprintf(what, sizeof what, "reducescatter %s %s total %zu", cring_dtype_name(dt),
                 cring_op_name(op), total);
        expect_bytes(what, size, r, c.recv[r], want, counts[r] * es);
        expect_bytes("reducescatter left send alone", size, r, c.send[r], inputs[r], total * es);
        first += counts[r];
        free(want);
    }
    for (int r = 0; r < size; r++) {
        free(c.send[r]);
        free(c.recv[r]);
        free(inputs[r]);
    }
}

/* ---- allgatherv ---------------------------------------------------------------------------- */
typedef struct allgatherv_case {
    size_t bytes[MAX_RANKS];
    size_t offsets[MAX_RANKS];
    int in_place;
    void *send[MAX_RANKS], *recv[MAX_RANKS];
} allgatherv_case_t;

static cring_status_t allgatherv_rank(void *ctx, cring__p2p_t *p2p, cring__scratch_t *scratch) {
    allgatherv_case_t *c = ctx;
    int r = p2p->rank;
    const void *send = c->in_place ? (char *)c->recv[r] + c->offsets[r] : c->send[r];
    return cring__ring_allgatherv(p2p, send, c->bytes[r], c->recv[r], c->bytes);
}

static void check_allgatherv(int size, const size_t *bytes, int in_place) {
    allgatherv_case_t c = {.in_place = in_place};
    size_t total = 0;
    for (int r = 0; r < size; r++) {
        c.bytes[r] = bytes[r];
        c.offsets[r] = total;
        total += bytes[r];
    }
    unsigned char *want = malloc(total + 1);
    CHECK(want);
    for (size_t i = 0; i < total; i++) want[i] = (unsigned char)mix(i * 31 + (uint64_t)total);
    for (int r = 0; r < size; r++) {
        c.send[r] = malloc(bytes[r] + 1);
        c.recv[r] = malloc(total + 1);
        CHECK(c.send[r] && c.recv[r]);
        memcpy(c.send[r], want + c.offsets[r], bytes[r]);
        memset(c.recv[r], 0xee, total);
        if (in_place) memcpy((char *)c.recv[r] + c.offsets[r], want + c.offsets[r], bytes[r]);
    }
    run_world(size, capacity_for(total), allgatherv_rank, &c, -1, NULL);
    for (int r = 0; r < size; r++) {
        expect_bytes(in_place ? "allgatherv in place" : "allgatherv", size, r, c.recv[r], want,
                     total);
        free(c.send[r]);
        free(c.recv[r]);
    }
    free(want);
}

/* ---- broadcast ------------------------------------------------------------------------------ */
typedef struct broadcast_case {
    size_t nbytes;
    int root;
    void *buf[MAX_RANKS];
} broadcast_case_t;

static cring_status_t broadcast_rank(void *ctx, cring__p2p_t *p2p, cring__scratch_t *scratch) {
    broadcast_case_t *c = ctx;
    return cring__ring_broadcast(p2p, c->buf[p2p->rank], c->nbytes, c->root);
}

static void check_broadcast(int size, size_t nbytes, int root) {
    broadcast_case_t c = {.nbytes = nbytes, .root = root};
    unsigned char *want = malloc(nbytes + 1);
    CHECK(want);
    for (size_t i = 0; i < nbytes; i++) want[i] = (unsigned char)mix(i + (uint64_t)root * 77);
    for (int r = 0; r < size; r++) {
        c.buf[r] = malloc(nbytes + 1);
        CHECK(c.buf[r]);
        if (r == root) memcpy(c.buf[r], want, nbytes);
        else memset(c.buf[r], 0x11 * (r + 1), nbytes);
    }
    run_world(size, capacity_for(nbytes), broadcast_rank, &c, -1, NULL);
    for (int r = 0; r < size; r++) {
        expect_bytes("broadcast", size, r, c.buf[r], want, nbytes);
        free(c.buf[r]);
    }
    free(want);
}

/* ---- barrier ------------------------------------------------------------------------------- */
#define BARRIER_ROUNDS 25
typedef struct barrier_case {
    int size;
    atomic_int arrived[BARRIER_ROUNDS];
    atomic_int early_exits; /* a rank left round k before everyone arrived */
} barrier_case_t;

static cring_status_t barrier_rank(void *ctx, cring__p2p_t *p2p, cring__scratch_t *scratch) {
    barrier_case_t *c = ctx;
    for (int k = 0; k < BARRIER_ROUNDS; k++) {
        /* Stagger arrival so a broken barrier would let someone through early. */
        if ((p2p->rank + k) % 3 == 0) {
            struct timespec ts = {0, 200000 * ((p2p->rank + k) % 4)};
            nanosleep(&ts, NULL);
        }
        atomic_fetch_add(&c->arrived[k], 1);
        cring_status_t st = cring__p2p_barrier(p2p);
        if (st != CRING_OK) return st;
        if (atomic_load(&c->arrived[k]) != c->size) atomic_fetch_add(&c->early_exits, 1);
    }
    return CRING_OK;
}

static void check_barrier(int size) {
    barrier_case_t c;
    memset(&c, 0, sizeof c);
    c.size = size;
    run_world(size, 61, barrier_rank, &c, -1, NULL);
    CHECK(atomic_load(&c.early_exits) == 0);
    for (int k = 0; k < BARRIER_ROUNDS; k++) CHECK(atomic_load(&c.arrived[k]) == size);
}

/* ---- failures and bad arguments ------------------------------------------------------------- */
static void check_failure_propagates(void) {
    /* The fake fails its 5th exchange (counted over all ranks): every rank must
     * return an error rather than hang or report success. */
    int size = 4;
    allreduce_case_t c = {.dtype = CRING_FLOAT32, .op = CRING_SUM, .count = 100000};
    for (int r = 0; r < size; r++) {
        c.send[r] = calloc(c.count, 4);
        c.recv[r] = calloc(c.count, 4);
        CHECK(c.send[r] && c.recv[r]);
    }
    cring_status_t status[MAX_RANKS];
    run_world(size, 4096, allreduce_rank, &c, 5, status);
    for (int r = 0; r < size; r++) {
        CHECK(status[r] == CRING_ERR_PEER_FAILURE);
        free(c.send[r]);
        free(c.recv[r]);
    }
}

static void check_bad_arguments(void) {
    world_t *w = world_new(2, 64);
    fake_p2p_t p = {.base = {.ops = &fake_ops, .rank = 0, .size = 2}, .world = w};
    cring__scratch_t scratch = {0};
    float x[4] = {0};
    size_t sizes[2] = {4, 4};
    CHECK(cring__ring_allreduce(&p.base, &scratch, x, x, 4, CRING_BOOL, CRING_SUM) ==
          CRING_ERR_NOT_SUPPORTED);
    CHECK(cring__ring_allreduce(&p.base, &scratch, x, x, 4, CRING_FLOAT32, CRING_ADASUM) ==
          CRING_ERR_NOT_SUPPORTED);
    CHECK(cring__ring_allreduce(NULL, &scratch, x, x, 4, CRING_FLOAT32, CRING_SUM) ==
          CRING_ERR_INVALID_ARGUMENT);
    CHECK(cring__ring_allreduce(&p.base, &scratch, NULL, x, 4, CRING_FLOAT32, CRING_SUM) ==
          CRING_ERR_INVALID_ARGUMENT);
    CHECK(cring__ring_reducescatter(&p.base, &scratch, x, x, NULL, CRING_FLOAT32, CRING_SUM) ==
          CRING_ERR_INVALID_ARGUMENT);
    size_t huge[2] = {SIZE_MAX / 2, SIZE_MAX / 2};
    CHECK(cring__ring_reducescatter(&p.base, &scratch, x, x, huge, CRING_FLOAT32, CRING_SUM) ==
          CRING_ERR_INVALID_ARGUMENT);
    CHECK(cring__ring_allgatherv(&p.base, x, 3, x, sizes) == CRING_ERR_INVALID_ARGUMENT);
    CHECK(cring__ring_broadcast(&p.base, x, 4, 2) == CRING_ERR_INVALID_ARGUMENT);
    CHECK(cring__ring_broadcast(&p.base, x, 4, -1) == CRING_ERR_INVALID_ARGUMENT);
    /* zero-sized work needs no peer and succeeds at once */
    CHECK_OK(cring__ring_allreduce(&p.base, &scratch, NULL, NULL, 0, CRING_FLOAT32, CRING_SUM));
    CHECK_OK(cring__ring_broadcast(&p.base, NULL, 0, 1));
    CHECK(w->calls == 0 && world_drained(w));
    CHECK_OK(cring__scratch_reserve(&scratch, 1000));
    CHECK(scratch.bytes >= 1000 && ((uintptr_t)scratch.ptr % CRING_CACHE_LINE) == 0);
    CHECK_OK(cring__scratch_reserve(&scratch, 10));
    CHECK(scratch.bytes >= 1000); /* never shrinks */
    cring__scratch_free(&scratch);
    CHECK(scratch.ptr == NULL && scratch.bytes == 0);
    world_free(w);
}

/* ---- the matrix -------------------------------------------------------------------------------- */
static void watchdog(int sig) {
    (void)sig;
    static const char msg[] = "test_ring: watchdog expired (deadlock?)\n";
    ssize_t n = write(2, msg, sizeof msg - 1);
    (void)n;
    _exit(1);
}

int main(void) {
    signal(SIGALRM, watchdog);
    alarm(240);
    static const cring_dtype_t dtypes[] = {CRING_FLOAT16, CRING_BFLOAT16, CRING_FLOAT32,
                                           CRING_FLOAT64, CRING_INT8,     CRING_UINT8,
                                           CRING_INT32,   CRING_INT64};
    static const cring_op_t ops[] = {CRING_SUM, CRING_AVERAGE, CRING_MIN, CRING_MAX, CRING_PRODUCT};
    /* big allreduces: a few (dtype, op) pairs, one per kernel path that matters */
    static const struct {
        cring_dtype_t dtype;
        cring_op_t op;
    } big[] = {{CRING_FLOAT32, CRING_SUM},   {CRING_FLOAT32, CRING_AVERAGE},
               {CRING_FLOAT16, CRING_SUM},   {CRING_BFLOAT16, CRING_MAX},
               {CRING_INT32, CRING_PRODUCT}, {CRING_INT8, CRING_AVERAGE},
               {CRING_FLOAT64, CRING_MIN}};
    int cases = 0;
    double t0 = cring__now_s();
    check_bad_arguments();
    check_failure_propagates();

    for (int size = 1; size <= MAX_RANKS; size++) {
        /* allreduce: every dtype x op at small counts (0, 1, 7, size-1 < size), both
         * in place and not; large odd count for the pairs above */
        size_t small[] = {0, 1, 7, (size_t)(size - 1), 33};
        for (size_t d = 0; d < sizeof dtypes / sizeof dtypes[0]; d++)
            for (size_t o = 0; o < sizeof ops / sizeof ops[0]; o++)
                for (size_t k = 0; k < sizeof small / sizeof small[0]; k++)
                    for (int in_place = 0; in_place < 2; in_place++, cases++)
                        check_allreduce(size, dtypes[d], ops[o], small[k], in_place);
        for (size_t b = 0; b < sizeof big / sizeof big[0]; b++)
            for (int in_place = 0; in_place < 2; in_place++, cases++)
                check_allreduce(size, big[b].dtype, big[b].op, BIG_COUNT, in_place);
        /* recursive doubling (powers of two and the fold for the others):
         * every dtype x op at 33 elements (in place or not), 0 and 1, a larger
         * count for the kernels that matter */
        for (size_t d = 0; d < sizeof dtypes / sizeof dtypes[0]; d++)
            for (size_t o = 0; o < sizeof ops / sizeof ops[0]; o++, cases++)
                check_allreduce_with(size, dtypes[d], ops[o], 33, (int)(d + o) % 2, 1);
        check_allreduce_with(size, CRING_FLOAT32, CRING_SUM, 0, 0, 1);
        check_allreduce_with(size, CRING_UINT8, CRING_MIN, 1, 0, 1);
        for (size_t b = 0; b < sizeof big / sizeof big[0]; b++, cases++)
            check_allreduce_with(size, big[b].dtype, big[b].op, 4099, b % 2, 1);

        /* reducescatter: all zero; uneven with zeros; total < size; large uneven */
        size_t zeros[MAX_RANKS] = {0}, uneven[MAX_RANKS], tiny[MAX_RANKS] = {0}, large[MAX_RANKS];
        for (int r = 0; r < size; r++) {
            uneven[r] = r % 3 == 1 ? 0 : (size_t)(r * 5 + 3);
            large[r] = r == size / 2 && size > 1 ? 0 : BIG_COUNT / (size_t)size + (size_t)r * 1001;
        }
        tiny[size - 1] = 1;
        const size_t *patterns[] = {zeros, uneven, tiny, large};
        for (size_t p = 0; p < 4; p++)
            for (size_t d = 0; d < sizeof dtypes / sizeof dtypes[0]; d++) {
                cring_op_t op = ops[(d + p) % 5];
                check_reducescatter(size, dtypes[d], op, patterns[p]);
                cases++;
                if (p == 1) { /* every op at least once on the uneven pattern */
                    for (size_t o = 0; o < 5; o++, cases++)
                        check_reducescatter(size, dtypes[d], ops[o], patterns[p]);
                }
            }

        /* allgatherv: the same shapes in bytes, in place and not */
        size_t large_bytes[MAX_RANKS];
        for (int r = 0; r < size; r++) large_bytes[r] = large[r] * 3 + (size_t)r;
        const size_t *byte_patterns[] = {zeros, uneven, tiny, large_bytes};
        for (size_t p = 0; p < 4; p++)
            for (int in_place = 0; in_place < 2; in_place++, cases++)
                check_allgatherv(size, byte_patterns[p], in_place);

        /* broadcast: every root; both sides of the tree/chain switch */
        static const size_t bcast_sizes[] = {0, 1, 7, 65535, 65536, 65537, BIG_COUNT};
        for (int root = 0; root < size; root++)
            for (size_t k = 0; k < sizeof bcast_sizes / sizeof bcast_sizes[0]; k++, cases++)
                check_broadcast(size, bcast_sizes[k], root);

        check_barrier(size);
        cases++;
    }
    printf("test_ring: %d collective cases at world sizes 1..%d in %.1f s\n", cases, MAX_RANKS,
           cring__now_s() - t0);
    TEST_DONE("test_ring");
    return 0;
}

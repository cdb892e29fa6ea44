/* test_engine_faults.c: the engine where only a test can make it fail, through
 * the hooks of csrc/engine/test_hooks.h (compiled into the C tests only), at
 * 2 ranks:
 * - an allocation that fails when a round's batches are formed on one rank
 *   (issue 33, finding 5): every request of that round completes on that
 *   rank with an out-of-memory error naming its tensor (before, none did: the
 *   handles waited for ever and their requests were recycled under them),
 *   and the peer's complete too, at once, with an error naming their tensors
 *   (the rank aborts the communicator instead of leaving the peer to its
 *   time-out); later submissions are refused on both;
 * - a peer's request record that gives a CUDA allgather a negative or an
 *   overflowing number of rows (finding 10): a protocol error naming the
 *   tensor and the rank, on every rank, before NCCL sees anything; the
 *   engine goes on. Against the test doubles libfake_nccl/libfake_cudart. */
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/wire.h"
#include "cring/cring.h"
#include "engine/engine_internal.h"
#include "engine/test_hooks.h"
#include "gpu/gpu.h"
#include "testutil.h"

static cring_handle_t *submit(cring_engine_t *e, const char *name, cring_collective_t coll,
                              cring_tensor_t *t, cring_device_type_t type, int rank) {
    cring_request_t q = {.name = name,
                         .collective = coll,
                         .op = CRING_SUM,
                         .prescale = 1,
                         .postscale = 1,
                         .compression = CRING_DTYPE_COUNT,
                         .ntensors = 1,
                         .tensors = t,
                         .device = {.type = type,
                                    .stream = type == CRING_DEVICE_CUDA
                                                  ? (void *)(uintptr_t)(0x1000 + rank)
                                                  : NULL}};
    cring_handle_t *h = NULL;
    if (cring_engine_submit(e, &q, &h) != CRING_OK) {
        fprintf(stderr, "submit %s: %s\n", name, cring_engine_error_message());
        exit(1);
    }
    return h;
}

static cring_engine_t *start(int rank, int size, int port, const char *job) {
    cring_config_t cfg = testutil_config(rank, size, port, CRING_TRANSPORT_AUTO, 60);
    cfg.job_key = job;
    cring_comm_t *comm;
    CHECK_OK(cring_comm_init(&cfg, &comm));
    cring_engine_t *e;
    CHECK_OK(cring_engine_start(comm, &e));
    return e;
}

/* Rank 1 cannot make room for the first round's batches. */
static void run_out_of_memory(int rank, int size, int port, int unused) {
    alarm(60);
    if (rank == 1) atomic_store(&cring__test_fail_batch_room, 1);
    cring_engine_t *e = start(rank, size, port, "faults-oom");
    enum { N = 3 };
    static float x[N][5];
    int64_t five = 5;
    cring_tensor_t ts[N];
    cring_handle_t *hs[N];
    for (int k = 0; k < N; k++) {
        char name[32];
        snprintf(name, sizeof name, "oom.%d", k);
        for (int i = 0; i < 5; i++) x[k][i] = (float)(rank + i);
        ts[k] = (cring_tensor_t){x[k], x[k], CRING_FLOAT32, 1, &five};
        hs[k] = submit(e, name, CRING_COLL_ALLREDUCE, &ts[k], CRING_DEVICE_CPU, rank);
    }
    for (int k = 0; k < N; k++) {
        int done = cring_handle_wait_for(hs[k], 20.0);
        if (!done) fprintf(stderr, "rank %d: oom.%d never completed\n", rank, k);
        CHECK(done);
        char name[32];
        snprintf(name, sizeof name, "'oom.%d'", k);
        const char *error = cring_handle_error(hs[k]);
        if (cring_handle_status(hs[k]) == CRING_OK || !strstr(error, name) ||
            !strstr(error, "out of memory"))
            fprintf(stderr, "rank %d, oom.%d: %s (%s)\n", rank, k,
                    cring_status_string(cring_handle_status(hs[k])), error);
        CHECK(cring_handle_status(hs[k]) != CRING_OK);
        CHECK(strstr(error, name) != NULL);            /* which tensor */
        CHECK(strstr(error, "out of memory") != NULL); /* and why, on both ranks */
        if (rank == 1) CHECK(cring_handle_status(hs[k]) == CRING_ERR_NO_MEMORY);
        cring_handle_free(hs[k]);
    }
    /* the engine stopped taking part: a new submission is refused at once */
    cring_request_t q = {.name = "after",
                         .collective = CRING_COLL_ALLREDUCE,
                         .op = CRING_SUM,
                         .compression = CRING_DTYPE_COUNT,
                         .ntensors = 1,
                         .tensors = &ts[0]};
    cring_handle_t *h = NULL;
    CHECK(cring_engine_submit(e, &q, &h) != CRING_OK);
    cring_engine_stop(e);
    (void)unused;
    exit(0);
}

/* Rank 1's records of "hostile.*" CUDA allgathers claim another first
 * dimension: -3 rows, or so many that their bytes overflow. */
static void rewrite_first_dim(const char *name, uint8_t *record, size_t len) {
    int64_t rows = strcmp(name, "hostile.negative") == 0   ? -3
                   : strcmp(name, "hostile.overflow") == 0 ? (int64_t)1 << 61
                                                           : 0;
    if (!rows) return;
    parsed_t p;
    CHECK(cring__record_parse(record, len, &p) == 0);
    uint8_t *dim0 = (uint8_t *)p.tensors + 2; /* u8 dtype, u8 ndim, i64 shape[0] */
    cring__wire_put(&dim0, (uint64_t)rows, 8);
}

static void run_hostile_record(int rank, int size, int port, int unused) {
    alarm(60);
    if (rank == 1) cring__test_record_hook = rewrite_first_dim;
    cring_engine_t *e = start(rank, size, port, "faults-record");
    float x[6] = {0, 1, 2, 3, 4, 5};
    int64_t shape[2] = {2, 3};
    cring_tensor_t t = {x, NULL, CRING_FLOAT32, 2, shape};
    const char *names[] = {"hostile.negative", "hostile.overflow"};
    for (int k = 0; k < 2; k++) {
        cring_handle_t *h = submit(e, names[k], CRING_COLL_ALLGATHER, &t, CRING_DEVICE_CUDA, rank);
        CHECK(cring_handle_wait_for(h, 20.0));
        const char *error = cring_handle_error(h);
        if (cring_handle_status(h) != CRING_ERR_PROTOCOL)
            fprintf(stderr, "rank %d, %s: %s (%s)\n", rank, names[k],
                    cring_status_string(cring_handle_status(h)), error);
        CHECK(cring_handle_status(h) == CRING_ERR_PROTOCOL);
        CHECK(strstr(error, names[k]) != NULL && strstr(error, "rank 1") != NULL);
        cring_handle_free(h);
    }
    /* every rank refused the same request before NCCL: the engine goes on */
    cring_handle_t *h = submit(e, "honest", CRING_COLL_ALLGATHER, &t, CRING_DEVICE_CUDA, rank);
    CHECK_OK(cring_handle_wait(h));
    size_t bytes = 0;
    const float *all = cring_handle_output(h, 0, &bytes, NULL);
    CHECK(bytes == (size_t)size * sizeof x);
    /* the device result is read on the host once cring's stream has run */
    CHECK_OK(cring__gpu_event_sync(cring__gpu_global(), cring_handle_device_event(h), NULL));
    for (int q = 0; q < size; q++)
        for (int i = 0; i < 6; i++) CHECK(all[q * 6 + i] == (float)i);
    cring_handle_free(h);
    cring_engine_stop(e);
    (void)unused;
    exit(0);
}

int main(void) {
    (void)testutil_find_fakes(); /* sets CRING_NCCL_LIBRARY, CRING_CUDART_LIBRARY; the seed */
    testutil_run_world(2, run_out_of_memory, 0, "out of memory while forming batches");
    testutil_run_world(2, run_hostile_record, 0, "a peer's allgather rows that cannot be");
    TEST_DONE("test_engine_faults");
    return 0;
}

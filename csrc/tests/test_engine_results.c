/* test_engine_results.c: where CUDA allgather results live (exec_cuda.c's
 * output_memory, handle.c's cring_handle_take_output), against the test
 * doubles at world sizes 1-3, without Python. Room lent with the request
 * (recv: size x the input) holds a result that fits, with no device
 * allocation, and stays the caller's (never taken, never freed by the
 * handle); a result larger than the room gets engine memory, which
 * cring_handle_take_output moves out once: it stays readable after the handle
 * is freed and the engine has run more work (the fake's frees would have
 * overwritten it with 0xDB), until its new owner frees it. */
#include <limits.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cring/cring.h"
#include "gpu/gpu.h"
#include "testutil.h"

static testutil_fakes_t fakes;

/* An allgather of one int32 tensor of `rows` x 2 on cuda:0, with `room` lent
 * (or NULL), waited for. */
static cring_handle_t *allgather(cring_engine_t *e, const char *name, const int32_t *send,
                                 int64_t rows, int32_t *room) {
    int64_t shape[2] = {rows, 2};
    cring_tensor_t t = {send, room, CRING_INT32, 2, shape};
    cring_request_t q = {.name = name,
                         .collective = CRING_COLL_ALLGATHER,
                         .prescale = 1,
                         .postscale = 1,
                         .compression = CRING_DTYPE_COUNT,
                         .ntensors = 1,
                         .tensors = &t,
                         .device = {.type = CRING_DEVICE_CUDA, .id = 0, .stream = NULL}};
    cring_handle_t *h = NULL;
    CHECK_OK(cring_engine_submit(e, &q, &h));
    CHECK_OK(testutil_cuda_wait(h));
    return h;
}

/* Rank q's part: (q + 1) rows (uneven) or 2 rows (even) of q * 100 + i. */
static int check_parts(const int32_t *all, int size, int uneven) {
    int at = 0;
    for (int q = 0; q < size; q++)
        for (int i = 0; i < 2 * (uneven ? q + 1 : 2); i++)
            if (all[at++] != q * 100 + i) return 0;
    return 1;
}

static void run_rank(int rank, int size, int port, int unused) {
    alarm(120);
    cring_config_t cfg = testutil_config(rank, size, port, CRING_TRANSPORT_AUTO, 60);
    char job[32];
    snprintf(job, sizeof job, "engine-results-%d", size);
    cfg.job_key = job;
    cring_comm_t *comm;
    CHECK_OK(cring_comm_init(&cfg, &comm));
    cring_engine_t *e;
    CHECK_OK(cring_engine_start(comm, &e));
    cring__gpu_t *g = cring__gpu_global();
    int32_t send[8], room[3 * 2 * 2 * 2];
    for (int i = 0; i < 8; i++) send[i] = rank * 100 + i;

    /* 1. Even parts: the result is the lent room, no device allocation. */
    cring_handle_t *warm = allgather(e, "warm", send, 2, NULL); /* the communicator */
    cring_handle_free(warm);
    cring__gpu_stats_t before, after;
    cring__gpu_get_stats(g, &before);
    cring_handle_t *h = allgather(e, "even", send, 2, room);
    cring__gpu_get_stats(g, &after);
    size_t bytes = 0;
    CHECK(cring_handle_output(h, 0, &bytes, NULL) == room);
    CHECK(bytes == (size_t)size * 4 * sizeof(int32_t));
    CHECK(after.device_allocs == before.device_allocs);
    CHECK(check_parts(room, size, 0));
    cring_output_free_fn free_out = NULL;
    void *ctx = NULL;
    CHECK(cring_handle_take_output(h, 0, &bytes, &free_out, &ctx) == NULL); /* the caller's */
    cring_handle_free(h);
    CHECK(check_parts(room, size, 0)); /* freeing the handle left it alone */

    /* 2. Uneven parts (rank q has q + 1 rows, size (size + 1) / 2 in all),
     * room for size x this rank's rows: the ranks whose room holds them all
     * get the room, the others engine memory. */
    h = allgather(e, "uneven", send, rank + 1, room);
    const int32_t *all = cring_handle_output(h, 0, &bytes, NULL);
    CHECK(all != NULL && check_parts(all, size, 1));
    int lent = all == room;
    CHECK(lent == (size * (rank + 1) >= size * (size + 1) / 2));
    CHECK(lent || rank < size - 1); /* the last rank's room always holds it */
    int32_t *owned = cring_handle_take_output(h, 0, &bytes, &free_out, &ctx);
    CHECK((owned != NULL) == !lent);
    if (owned) {
        CHECK(owned == all && free_out != NULL);
        CHECK(cring_handle_take_output(h, 0, &bytes, &free_out, &ctx) == NULL); /* once */
    }
    cring_handle_free(h);
    for (int k = 0; k < 5; k++) { /* more work and allocations after the handle went */
        char name[16];
        snprintf(name, sizeof name, "later%d", k);
        cring_handle_free(allgather(e, name, send, 2, NULL));
    }
    if (owned) {
        CHECK(check_parts(owned, size, 1)); /* still the result, not 0xDB */
        free_out(ctx, owned, bytes);
    }
    cring_engine_stop(e);
    exit(0);
}

int main(void) {
    fakes = testutil_find_fakes();
    for (int size = 1; size <= 3; size++)
        testutil_run_world(size, run_rank, 0, "results of cuda allgathers");
    TEST_DONE("test_engine_results");
    return 0;
}

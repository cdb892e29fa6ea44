/* test_shm_multi.c: the multi-tensor allreduce over shared memory
 * (algo/shm_multi.c through cring__comm_allreduce_multi) at 1..4 ranks:
 * tensors of zero, odd and large counts (small form and several rounds), in
 * place and out of place, give every tensor's own sum, and plain allreduces
 * interleaved with them still agree (the window counters stay in step). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../algo/algo.h"
#include "../core/comm_internal.h"
#include "cring/cring.h"
#include "testutil.h"

#define MAX_SEGS 8

static int32_t value(int rank, int i, size_t j) { return (rank + 1) * (int32_t)(i * 7 + j % 13); }

/* One multi allreduce of counts[0..n) int32 tensors, then check. */
static void one_case(cring_comm_t *c, int rank, int size, const size_t *counts, int n,
                     int in_place) {
    cring__seg_t segs[MAX_SEGS];
    int32_t *in[MAX_SEGS], *out[MAX_SEGS];
    for (int i = 0; i < n; i++) {
        in[i] = malloc((counts[i] + 1) * sizeof(int32_t));
        out[i] = in_place ? in[i] : malloc((counts[i] + 1) * sizeof(int32_t));
        CHECK(in[i] && out[i]);
        for (size_t j = 0; j < counts[i]; j++) in[i][j] = value(rank, i, j);
        if (!in_place)
            for (size_t j = 0; j < counts[i]; j++) out[i][j] = -1;
        segs[i] = (cring__seg_t){.send = in[i], .recv = out[i], .count = counts[i]};
    }
    CHECK_OK(cring__comm_allreduce_multi(c, segs, n, CRING_INT32, CRING_SUM));
    int32_t ranks = size * (size + 1) / 2;
    for (int i = 0; i < n; i++) {
        for (size_t j = 0; j < counts[i]; j++)
            CHECK(out[i][j] == ranks * (int32_t)(i * 7 + j % 13));
        if (!in_place)
            for (size_t j = 0; j < counts[i]; j++) CHECK(in[i][j] == value(rank, i, j));
        if (!in_place) free(out[i]);
        free(in[i]);
    }
}

/* A plain allreduce of `count` float32 ones between the multi ones. */
static void plain(cring_comm_t *c, int size, size_t count) {
    float *x = malloc((count + 1) * sizeof(float));
    CHECK(x);
    for (size_t j = 0; j < count; j++) x[j] = 1.0f;
    CHECK_OK(cring__comm_allreduce(c, x, x, count, CRING_FLOAT32, CRING_SUM));
    for (size_t j = 0; j < count; j++) CHECK(x[j] == (float)size);
    free(x);
}

static void run_rank(int rank, int size, int port, int unused) {
    (void)unused;
    alarm(60);
    cring_config_t cfg = testutil_config(rank, size, port, CRING_TRANSPORT_SHM, 30);
    char job[32];
    snprintf(job, sizeof job, "multi-%d", size);
    cfg.job_key = job;
    cring_comm_t *c;
    CHECK_OK(cring_comm_init(&cfg, &c));
    CHECK(cring__comm_can_allreduce_multi(c));
    static const size_t small[] = {0, 1, 7, 1000, 0, 5};
    static const size_t large[] = {33333, 0, 1, 100003, 64, 70001, 17};
    static const size_t one_big[] = {300000};
    for (int in_place = 0; in_place < 2; in_place++) {
        one_case(c, rank, size, small, 6, in_place);
        plain(c, size, 3);
        one_case(c, rank, size, large, 7, in_place);
        one_case(c, rank, size, small, 6, in_place);
        plain(c, size, 200000);
        one_case(c, rank, size, one_big, 1, in_place);
        one_case(c, rank, size, large, 0, in_place); /* no tensors at all */
        one_case(c, rank, size, large, 7, in_place);
        plain(c, size, 5);
    }
    cring_comm_destroy(c);
    exit(0);
}

int main(void) {
    alarm(240);
    for (int size = 1; size <= 4; size++)
        testutil_run_world(size, run_rank, 0, "multi-tensor allreduce over shm");
    TEST_DONE("test_shm_multi");
    return 0;
}

/* region_bench.c: the in-place allreduce over shared regions against the
 * usual one through the shared-memory windows, 2 ranks, without Python or
 * the engine (docs/performance.md, "Zero-copy gradient buckets"):
 *
 *   make bench && build/bench/region_bench [float32 elements, default 21300000]
 *
 * Each sample times 3 in-place float32 sums of the same size, the two paths
 * alternating; prints the median and minimum of 7 samples of each. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cring/cring.h"
#include "tests/testutil.h"

#define SAMPLES 7
#define CALLS 3

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double timed(cring_comm_t *c, float *buf, size_t count) {
    CHECK_OK(cring_barrier(c));
    double t0 = now_s();
    for (int i = 0; i < CALLS; i++)
        CHECK_OK(cring_allreduce(c, buf, buf, count, CRING_FLOAT32, CRING_SUM));
    return (now_s() - t0) / CALLS;
}

static void run_rank(int rank, int size, int port, int count_arg) {
    cring_config_t cfg = testutil_config(rank, size, port, CRING_TRANSPORT_AUTO, 120);
    cring_comm_t *c = NULL;
    CHECK_OK(cring_comm_init(&cfg, &c));
    const size_t count = (size_t)count_arg, bytes = count * sizeof(float);
    void *region = NULL;
    CHECK_OK(cring_comm_shared_region(c, bytes, &region));
    float *own = aligned_alloc(4096, (bytes + 4095) / 4096 * 4096);
    CHECK(own != NULL);
    memset(own, 0, bytes); /* both buffers mapped in before timing */
    memset(region, 0, bytes);
    double in_place[SAMPLES], windows[SAMPLES];
    for (int k = 0; k < SAMPLES; k++) {
        in_place[k] = timed(c, region, count);
        windows[k] = timed(c, own, count);
    }
    qsort(in_place, SAMPLES, sizeof(double), cmp_double);
    qsort(windows, SAMPLES, sizeof(double), cmp_double);
    if (rank == 0)
        printf("%.1f MB float32 sum, 2 ranks: in place in a region %.2f ms (min %.2f), through "
               "the windows %.2f ms (min %.2f)\n",
               (double)bytes / 1e6, in_place[SAMPLES / 2] * 1e3, in_place[0] * 1e3,
               windows[SAMPLES / 2] * 1e3, windows[0] * 1e3);
    free(own);
    cring_comm_destroy(c);
    exit(0);
}

int main(int argc, char **argv) {
    long count = argc > 1 ? atol(argv[1]) : 21300000;
    if (count <= 0 || count > 1L << 30) {
        fprintf(stderr, "usage: region_bench [float32 elements, 1..2^30]\n");
        return 2;
    }
    testutil_run_world(2, run_rank, (int)count, "region_bench");
    return 0;
}

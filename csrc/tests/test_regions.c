/* test_regions.c: shared regions without Python: registration at 1-4 ranks
 * over shared memory (and refused over TCP and at one rank), the in-place
 * allreduce of buffers inside them checked against a reference (odd counts,
 * several rounds, an offset), mismatches reported on every rank with the
 * communicator still working, and other collectives interleaved. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cring/cring.h"
#include "testutil.h"

static float value(int rank, size_t i) { return (float)((rank * 7 + i * 13) % 9) - 4.0f; }

static void check_sum(const float *got, int size, size_t count) {
    size_t bad = 0;
    for (size_t i = 0; i < count; i++) {
        float want = 0;
        for (int r = 0; r < size; r++) want += value(r, i);
        if (got[i] != want && bad++ < 3) fprintf(stderr, "i=%zu got %g want %g\n", i, got[i], want);
    }
    CHECK(bad == 0);
}

static void run_rank(int rank, int size, int port, int transport) {
    cring_config_t cfg = testutil_config(rank, size, port, (cring_transport_kind_t)transport, 60);
    cring_comm_t *c = NULL;
    CHECK_OK(cring_comm_init(&cfg, &c));
    const size_t counts[] = {1024, 1000003, 3 * (1u << 20) + 5};
    const size_t cap = 4u << 22; /* floats: room for an offset plus the largest count */
    void *region = NULL;
    cring_status_t st = cring_comm_shared_region(c, cap * sizeof(float), &region);
    if (size == 1 || transport == CRING_TRANSPORT_TCP) {
        CHECK(st == CRING_ERR_NOT_SUPPORTED && region == NULL);
        cring_comm_destroy(c);
        exit(0);
    }
    CHECK_OK(st);
    float *buf = region;
    for (size_t k = 0; k < sizeof counts / sizeof counts[0]; k++) {
        size_t off = k * 17; /* not cache-line aligned */
        for (size_t i = 0; i < counts[k]; i++) buf[off + i] = value(rank, i);
        CHECK_OK(cring_allreduce(c, buf + off, buf + off, counts[k], CRING_FLOAT32, CRING_SUM));
        check_sum(buf + off, size, counts[k]);
        /* an ordinary collective in between keeps the counters in step */
        float x = 1.0f;
        CHECK_OK(cring_allreduce(c, &x, &x, 1, CRING_FLOAT32, CRING_SUM));
        CHECK(x == (float)size);
    }
    /* ranks at different offsets: the same error everywhere, then still usable */
    size_t off = rank == 0 ? 64 : 0;
    for (size_t i = 0; i < 5000; i++) buf[off + i] = value(rank, i);
    st = cring_allreduce(c, buf + off, buf + off, 5000, CRING_FLOAT32, CRING_SUM);
    CHECK(st == CRING_ERR_MISMATCH);
    for (size_t i = 0; i < 5000; i++) buf[i] = value(rank, i);
    CHECK_OK(cring_allreduce(c, buf, buf, 5000, CRING_FLOAT32, CRING_SUM));
    check_sum(buf, size, 5000);
    /* a second region; sizes that differ between ranks are refused on every rank */
    void *second = NULL;
    CHECK_OK(cring_comm_shared_region(c, 1u << 16, &second));
    CHECK(second != NULL && second != region);
    void *bad = NULL;
    st = cring_comm_shared_region(c, rank == 0 ? 8192 : 4096, &bad);
    CHECK(st == CRING_ERR_MISMATCH && bad == NULL);
    CHECK_OK(cring_barrier(c));
    cring_comm_destroy(c);
    /* the own mapping outlives the communicator */
    buf[0] = 1.0f;
    exit(0);
}

int main(void) {
    alarm(300);
    for (int size = 1; size <= 4; size++)
        testutil_run_world(size, run_rank, CRING_TRANSPORT_AUTO, "regions over shm");
    testutil_run_world(2, run_rank, CRING_TRANSPORT_TCP, "regions refused over tcp");
    TEST_DONE("test_regions");
    return 0;
}

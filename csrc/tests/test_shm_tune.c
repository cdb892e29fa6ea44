/* test_shm_tune.c: the shared-memory collectives' sizes (algo/shm_tune.c):
 * derived from the caches as powers of two in their ranges, each knob
 * honoured and clamped; and, at 1..5 ranks under very different sizes
 * (tiny rounds and blocks, no small form, streaming from 4 KiB, the
 * machine's own), allreduce in and out of place, the multi-tensor
 * allreduce, broadcast, allgatherv and reducescatter give exact results on
 * zero, odd and large counts. In every world only rank 0 sets the knobs and
 * the other ranks set conflicting ones: the job must use rank 0's. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../algo/algo.h"
#include "../core/comm_internal.h"
#include "cring/cring.h"
#include "testutil.h"

static const char *const KNOBS[] = {"CRING_SHM_ROUND_BYTES", "CRING_SHM_SMALL_BYTES",
                                    "CRING_SHM_REDUCE_BLOCK_BYTES", "CRING_SHM_STREAM_MIN_BYTES"};

/* Sizes to run under: round, small, block, stream; "" leaves a knob unset. */
static const char *const CONFIGS[][4] = {
    {"", "", "", ""},                   /* the machine's own */
    {"4096", "0", "1024", "4096"},      /* tiny rounds and blocks, no small form, streaming */
    {"12352", "64", "2048", "1048576"}, /* a round that is no power of two */
    {"1048576", "65536", "65536", "67108864"},
};
#define NCONFIGS (int)(sizeof CONFIGS / sizeof CONFIGS[0])

static int is_pow2(size_t n) { return n && (n & (n - 1)) == 0; }

static void derived_and_knobs(void) {
    for (int k = 0; k < 4; k++) unsetenv(KNOBS[k]);
    cring_shm_tuning_t t;
    cring_shm_tuning(&t);
    printf(
        "caches L1d %zu L2 %zu L3 %zu: round %zu small %zu block %zu stream %zu inplace %zu/%zu\n",
        t.l1d_bytes, t.l2_bytes, t.l3_bytes, t.round_bytes, t.small_allreduce_bytes,
        t.reduce_block_bytes, t.stream_min_bytes, t.inplace_round_bytes,
        t.inplace_stream_min_bytes);
    CHECK(is_pow2(t.round_bytes) && t.round_bytes >= (64u << 10) && t.round_bytes <= (1u << 20));
    CHECK(is_pow2(t.small_allreduce_bytes) && t.small_allreduce_bytes <= (64u << 10));
    CHECK(is_pow2(t.reduce_block_bytes) && t.reduce_block_bytes >= (8u << 10));
    CHECK(is_pow2(t.stream_min_bytes) && t.stream_min_bytes >= (1u << 20) &&
          t.stream_min_bytes <= (8u << 20));
    CHECK(is_pow2(t.inplace_round_bytes) && t.inplace_round_bytes <= (4u << 20));
    CHECK(is_pow2(t.inplace_stream_min_bytes));
    if (t.l2_bytes) { /* the rule: a round is a quarter of the L2, within its range */
        size_t want = t.l2_bytes / 4;
        if (want >= (64u << 10) && want <= (1u << 20) && is_pow2(want))
            CHECK(t.round_bytes == want);
    }
    setenv("CRING_SHM_ROUND_BYTES", "100000", 1); /* a cache line's multiple below */
    setenv("CRING_SHM_SMALL_BYTES", "0", 1);
    setenv("CRING_SHM_REDUCE_BLOCK_BYTES", "10", 1); /* raised to the least allowed */
    setenv("CRING_SHM_STREAM_MIN_BYTES", "8388608", 1);
    setenv("CRING_SHM_INPLACE_ROUND_BYTES", "1", 1);
    setenv("CRING_SHM_INPLACE_STREAM_MIN_BYTES", "65536", 1);
    cring_shm_tuning(&t);
    CHECK(t.round_bytes == 100000 / 64 * 64);
    CHECK(t.small_allreduce_bytes == 0);
    CHECK(t.reduce_block_bytes == 1024);
    CHECK(t.stream_min_bytes == (8u << 20));
    CHECK(t.inplace_round_bytes == 4096);
    CHECK(t.inplace_stream_min_bytes == 65536);
    for (int k = 0; k < 4; k++) unsetenv(KNOBS[k]);
    unsetenv("CRING_SHM_INPLACE_ROUND_BYTES");
    unsetenv("CRING_SHM_INPLACE_STREAM_MIN_BYTES");
}

static int32_t value(int rank, size_t j) { return (rank + 1) * (int32_t)(j % 101); }

static void allreduce_case(cring_comm_t *c, int rank, int size, size_t count, int in_place) {
    int32_t *in = calloc(count + 1, sizeof *in);
    CHECK(in);
    int32_t *out = in_place ? in : calloc(count + 1, sizeof *out);
    CHECK(out);
    for (size_t j = 0; j < count; j++) in[j] = value(rank, j);
    CHECK_OK(cring__comm_allreduce(c, in, out, count, CRING_INT32, CRING_SUM));
    const int32_t ranks = size * (size + 1) / 2;
    for (size_t j = 0; j < count; j++) CHECK(out[j] == ranks * (int32_t)(j % 101));
    if (!in_place) {
        for (size_t j = 0; j < count; j++) CHECK(in[j] == value(rank, j));
        free(out);
    }
    free(in);
}

static void multi_case(cring_comm_t *c, int rank, int size) {
    static const size_t counts[] = {0, 7, 33333, 1, 70001, 4096};
    enum { N = 6 };
    cring__seg_t segs[N];
    int32_t *bufs[N];
    for (int i = 0; i < N; i++) {
        bufs[i] = malloc((counts[i] + 1) * sizeof(int32_t));
        CHECK(bufs[i]);
        for (size_t j = 0; j < counts[i]; j++) bufs[i][j] = value(rank, j + (size_t)i);
        segs[i] = (cring__seg_t){.send = bufs[i], .recv = bufs[i], .count = counts[i]};
    }
    CHECK_OK(cring__comm_allreduce_multi(c, segs, N, CRING_INT32, CRING_SUM));
    const int32_t ranks = size * (size + 1) / 2;
    for (int i = 0; i < N; i++) {
        for (size_t j = 0; j < counts[i]; j++)
            CHECK(bufs[i][j] == ranks * (int32_t)((j + (size_t)i) % 101));
        free(bufs[i]);
    }
}

static void broadcast_case(cring_comm_t *c, int rank, int size, size_t nbytes) {
    int root = size - 1;
    unsigned char *b = malloc(nbytes + 1);
    CHECK(b);
    for (size_t j = 0; j < nbytes; j++) b[j] = rank == root ? (unsigned char)(j * 31 + 5) : 0;
    CHECK_OK(cring__comm_broadcast(c, b, nbytes, root));
    for (size_t j = 0; j < nbytes; j++) CHECK(b[j] == (unsigned char)(j * 31 + 5));
    free(b);
}

static void allgather_case(cring_comm_t *c, int rank, int size, size_t base) {
    size_t lens[64] = {0}, total = 0;
    for (int q = 0; q < size; q++) total += lens[q] = base + (size_t)q * 13; /* uneven */
    unsigned char *mine = malloc(lens[rank] + 1), *all = malloc(total + 1);
    CHECK(mine && all);
    for (size_t j = 0; j < lens[rank]; j++) mine[j] = (unsigned char)(rank * 17 + j);
    CHECK_OK(cring__comm_allgatherv(c, mine, lens[rank], all, lens));
    for (int q = 0, off = 0; q < size; off += (int)lens[q], q++)
        for (size_t j = 0; j < lens[q]; j++) CHECK(all[off + j] == (unsigned char)(q * 17 + j));
    free(mine);
    free(all);
}

static void reducescatter_case(cring_comm_t *c, int rank, int size, size_t base) {
    size_t counts[64] = {0}, total = 0, off = 0;
    for (int q = 0; q < size; q++) total += counts[q] = base + (size_t)q * 3;
    int32_t *in = malloc((total + 1) * sizeof *in), *out = malloc((counts[rank] + 1) * 4);
    CHECK(in && out);
    for (size_t j = 0; j < total; j++) in[j] = value(rank, j);
    CHECK_OK(cring__comm_reducescatter(c, in, out, counts, CRING_INT32, CRING_SUM));
    for (int q = 0; q < rank; q++) off += counts[q];
    const int32_t ranks = size * (size + 1) / 2;
    for (size_t j = 0; j < counts[rank]; j++) CHECK(out[j] == ranks * (int32_t)((off + j) % 101));
    free(in);
    free(out);
}

static void run_rank(int rank, int size, int port, int config) {
    alarm(120);
    /* rank 0 sets the config's sizes; the others ask for different ones */
    for (int k = 0; k < 4; k++) {
        const char *v = rank == 0 ? CONFIGS[config][k] : CONFIGS[(config + 1) % NCONFIGS][k];
        if (*v) setenv(KNOBS[k], v, 1);
        else unsetenv(KNOBS[k]);
    }
    cring_config_t cfg = testutil_config(rank, size, port, CRING_TRANSPORT_SHM, 60);
    char job[32];
    snprintf(job, sizeof job, "tune-%d-%d", config, size);
    cfg.job_key = job;
    cring_comm_t *c;
    CHECK_OK(cring_comm_init(&cfg, &c));
    static const size_t counts[] = {0, 1, 7, 1000, 4095, 4097, 16385, 100003, 300001};
    for (size_t i = 0; i < sizeof counts / sizeof counts[0]; i++)
        for (int in_place = 0; in_place < 2; in_place++)
            allreduce_case(c, rank, size, counts[i], in_place);
    multi_case(c, rank, size);
    for (size_t n = 0; n < 600000; n = n * 7 + 3) broadcast_case(c, rank, size, n);
    allgather_case(c, rank, size, 0);
    allgather_case(c, rank, size, 5);
    allgather_case(c, rank, size, 70001);
    reducescatter_case(c, rank, size, 1);
    reducescatter_case(c, rank, size, 50001);
    allreduce_case(c, rank, size, 12345, 0); /* the counters still in step */
    cring_comm_destroy(c);
    exit(0);
}

int main(void) {
    alarm(600);
    derived_and_knobs();
    for (int config = 0; config < NCONFIGS; config++) {
        char label[64];
        snprintf(label, sizeof label, "shm sizes, config %d", config);
        for (int size = 1; size <= 5; size++) testutil_run_world(size, run_rank, config, label);
    }
    TEST_DONE("test_shm_tune");
    return 0;
}

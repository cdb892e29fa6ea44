/* test_adasum.c: the Adasum allreduce (core/adasum.c) end to end without
 * Python: fork world sizes 1, 2, 4 and 8 over shared memory and TCP, reduce
 * several tensors fused in one buffer (element counts 0, 1, 7, 33, 1001) in
 * float64, float32, bfloat16 and float16, and compare with a pairwise tree
 * computed here in float64. Also: orthogonal vectors add, equal vectors
 * average, a zero vector adds plainly, and a size that is not a power of two
 * is refused before any communication. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "core/comm_internal.h"
#include "cring/cring.h"
#include "reduce/reduce.h"
#include "testutil.h"

static const size_t COUNTS[] = {0, 1, 7, 33, 1001};
#define NT (sizeof COUNTS / sizeof COUNTS[0])
static const cring_dtype_t DTYPES[] = {CRING_FLOAT64, CRING_FLOAT32, CRING_BFLOAT16, CRING_FLOAT16};
#define ND (sizeof DTYPES / sizeof DTYPES[0])

/* Rank q's element i of tensor t: exactly representable in bfloat16 and
 * float16 (small multiples of 1/8), different per tensor and rank. */
static double input(int q, size_t t, size_t i) {
    unsigned h = (unsigned)(q * 2654435761u) ^ (unsigned)(t * 40503u) ^ (unsigned)(i * 2246822519u);
    h ^= h >> 13;
    h *= 0x5bd1e995u;
    h ^= h >> 15;
    return (double)((int)(h % 33) - 16) / 8.0;
}

/* The pairwise combination, as the paper and Horovod state it. */
static void combine(double *a, const double *b, size_t n) {
    double dot = 0, na = 0, nb = 0;
    for (size_t i = 0; i < n; i++) {
        dot += a[i] * b[i];
        na += a[i] * a[i];
        nb += b[i] * b[i];
    }
    double ca = na >= sqrt(2.2250738585072014e-308) ? 1 - dot / (2 * na) : 1;
    double cb = nb >= sqrt(2.2250738585072014e-308) ? 1 - dot / (2 * nb) : 1;
    for (size_t i = 0; i < n; i++) a[i] = ca * a[i] + cb * b[i];
}

/* The pairwise tree over size ranks' vectors v[q] (n each); result in v[0]. */
static void ref_tree(double **v, int size, size_t n) {
    for (int d = 1; d < size; d <<= 1)
        for (int q = 0; q < size; q += 2 * d) combine(v[q], v[q + d], n);
}

static double tolerance(cring_dtype_t dt) {
    switch (dt) {
    case CRING_FLOAT64: return 1e-12;
    case CRING_FLOAT32: return 1e-5;
    case CRING_FLOAT16: return 1e-2;
    default: return 4e-2; /* bfloat16: rounded at every level */
    }
}

static cring_comm_t *join_world(int rank, int size, int port, int transport) {
    cring_config_t cfg = testutil_config(rank, size, port, (cring_transport_kind_t)transport, 60);
    char job[64];
    snprintf(job, sizeof job, "adasum-%d-%d", size, transport);
    cfg.job_key = job;
    cring_comm_t *comm = NULL;
    CHECK_OK(cring_comm_init(&cfg, &comm));
    return comm;
}

/* Every dtype: the fused buffer of NT tensors against the reference tree of
 * each tensor alone (so a tensor's coefficients never see another's data). */
static void check_fused(cring_comm_t *comm, int rank, int size) {
    size_t n = 0;
    for (size_t t = 0; t < NT; t++) n += COUNTS[t];
    double *mine = malloc(n * sizeof(double)), *got = malloc(n * sizeof(double));
    void *buf = malloc(n * 8);
    double **v = malloc((size_t)size * sizeof *v);
    CHECK(mine && got && buf && v);
    for (int q = 0; q < size; q++) CHECK((v[q] = malloc(COUNTS[NT - 1] * sizeof(double))));
    for (size_t di = 0; di < ND; di++) {
        cring_dtype_t dt = DTYPES[di];
        size_t off = 0;
        for (size_t t = 0; t < NT; t++)
            for (size_t i = 0; i < COUNTS[t]; i++) mine[off++] = input(rank, t, i);
        cring__convert(dt, buf, CRING_FLOAT64, mine, n, 1.0);
        CHECK_OK(cring__comm_adasum(comm, buf, dt, COUNTS, (int)NT));
        cring__convert(CRING_FLOAT64, got, dt, buf, n, 1.0);
        off = 0;
        for (size_t t = 0; t < NT; t++) {
            for (int q = 0; q < size; q++)
                for (size_t i = 0; i < COUNTS[t]; i++) v[q][i] = input(q, t, i);
            ref_tree(v, size, COUNTS[t]);
            double scale = 0;
            for (size_t i = 0; i < COUNTS[t]; i++) scale = fmax(scale, fabs(v[0][i]));
            for (size_t i = 0; i < COUNTS[t]; i++) {
                double err = fabs(got[off + i] - v[0][i]);
                if (err > tolerance(dt) * (1 + scale)) {
                    fprintf(stderr, "rank %d size %d %s tensor %zu [%zu]: got %g want %g\n", rank,
                            size, cring_dtype_name(dt), t, i, got[off + i], v[0][i]);
                    CHECK(0);
                }
            }
            off += COUNTS[t];
        }
        CHECK(1);
    }
    for (int q = 0; q < size; q++) free(v[q]);
    free(v);
    free(mine);
    free(got);
    free(buf);
}

/* Two ranks: orthogonal vectors add, equal vectors average, zero adds plainly. */
static void check_pairs(cring_comm_t *comm, int rank) {
    float x[4], want[4];
    /* orthogonal: e0 on rank 0, e1 on rank 1 */
    memset(x, 0, sizeof x);
    x[rank] = 3.0f;
    CHECK_OK(cring__comm_adasum(comm, x, CRING_FLOAT32, (const size_t[]){4}, 1));
    CHECK(x[0] == 3.0f && x[1] == 3.0f && x[2] == 0 && x[3] == 0);
    /* equal: the average (the vector itself) */
    for (int i = 0; i < 4; i++) x[i] = want[i] = (float)(i + 1);
    CHECK_OK(cring__comm_adasum(comm, x, CRING_FLOAT32, (const size_t[]){4}, 1));
    for (int i = 0; i < 4; i++) CHECK(fabsf(x[i] - want[i]) < 1e-6f);
    /* zero on rank 1: rank 0's vector */
    for (int i = 0; i < 4; i++) x[i] = want[i] = rank ? 0.0f : (float)(2 * i - 3);
    for (int i = 0; i < 4; i++) want[i] = (float)(2 * i - 3);
    CHECK_OK(cring__comm_adasum(comm, x, CRING_FLOAT32, (const size_t[]){4}, 1));
    for (int i = 0; i < 4; i++) CHECK(x[i] == want[i]);
    /* the same three as one fused buffer of three tensors: each its own */
    float f[12];
    size_t counts[3] = {4, 4, 4};
    memset(f, 0, sizeof f);
    f[rank] = 3.0f;
    for (int i = 0; i < 4; i++) f[4 + i] = (float)(i + 1);
    for (int i = 0; i < 4; i++) f[8 + i] = rank ? 0.0f : (float)(2 * i - 3);
    CHECK_OK(cring__comm_adasum(comm, f, CRING_FLOAT32, counts, 3));
    CHECK(f[0] == 3.0f && f[1] == 3.0f && f[2] == 0 && f[3] == 0);
    for (int i = 0; i < 4; i++) CHECK(fabsf(f[4 + i] - (float)(i + 1)) < 1e-6f);
    for (int i = 0; i < 4; i++) CHECK(f[8 + i] == (float)(2 * i - 3));
}

static void run_rank(int rank, int size, int port, int transport) {
    alarm(240);
    cring_comm_t *comm = join_world(rank, size, port, transport);
    check_fused(comm, rank, size);
    if (size == 2) check_pairs(comm, rank);
    /* unsupported dtypes are refused before communicating */
    int32_t ints[2] = {1, 2};
    CHECK(cring__comm_adasum(comm, ints, CRING_INT32, (const size_t[]){2}, 1) ==
          CRING_ERR_INVALID_ARGUMENT);
    CHECK_OK(cring_barrier(comm));
    cring_comm_destroy(comm);
    exit(0);
}

/* Three ranks: refused on every rank, and the communicator still works. */
static void run_not_power(int rank, int size, int port, int transport) {
    alarm(120);
    cring_comm_t *comm = join_world(rank, size, port, transport);
    CHECK(!cring__adasum_size_ok(size));
    float x[3] = {1, 2, 3};
    CHECK(cring__comm_adasum(comm, x, CRING_FLOAT32, (const size_t[]){3}, 1) ==
          CRING_ERR_NOT_SUPPORTED);
    CHECK(x[0] == 1 && x[1] == 2 && x[2] == 3);
    CHECK_OK(cring_allreduce(comm, x, x, 3, CRING_FLOAT32, CRING_SUM));
    CHECK(x[0] == 3 && x[2] == 9);
    cring_comm_destroy(comm);
    exit(0);
}

int main(void) {
    alarm(900);
    CHECK(cring__adasum_size_ok(1) && cring__adasum_size_ok(8) && !cring__adasum_size_ok(6));
    CHECK(cring__adasum_supported(CRING_BFLOAT16) && !cring__adasum_supported(CRING_INT64));
    for (int size = 1; size <= 8; size *= 2) {
        testutil_run_world(size, run_rank, CRING_TRANSPORT_AUTO, "adasum over shm");
        testutil_run_world(size, run_rank, CRING_TRANSPORT_TCP, "adasum over tcp");
    }
    testutil_run_world(3, run_not_power, CRING_TRANSPORT_AUTO, "adasum refuses 3 ranks");
    TEST_DONE("test_adasum");
    return 0;
}

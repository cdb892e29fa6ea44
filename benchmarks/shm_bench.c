/* shm_bench.c: microbenchmark of the shared-memory collectives (allreduce
 * float32 sum in place, broadcast from rank 0, allgather) without Python or
 * the engine: forks the ranks, which rendezvous through a store served by
 * rank 0 and call the communicator's collectives directly.
 *
 *   make bench && build/bench/shm_bench [-n ranks] [-r reps] [-R rotate_MiB]
 *       [-o misalign_bytes] [-s bytes]... [-c allreduce|broadcast|allgather]...
 *       [-t float32|bfloat16]
 *
 * Buffers rotate over at least rotate_MiB per rank (default 576, more than
 * this VM's reported 480 MiB L3), so inputs and outputs come from DRAM, as in
 * benchmarks/collectives.py. Buffers of 4 MiB and more ask for transparent
 * huge pages, as NumPy does. A repetition times enough back-to-back calls to
 * last about 5 ms; its time is the slowest rank's per-call time; the figure
 * is the median (and min) over repetitions. Every size is checked once. */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "core/comm_internal.h"
#include "cring/cring.h"
#include "tests/testutil.h"

#define MAX_SIZES 16
#define TARGET_REP_S 0.005

static size_t sizes[MAX_SIZES];
static int nsizes, reps = 30, rotate_mib = 576, misalign = 0;
static int do_coll[3] = {1, 1, 1};
/* -t bfloat16: allreduce in bfloat16 (the other collectives move bytes) */
static cring_dtype_t dtype = CRING_FLOAT32;
static const char *coll_names[3] = {"allreduce", "broadcast", "allgather"};

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

static double max_over_ranks(cring_comm_t *comm, double v) {
    CHECK_OK(cring__comm_allreduce(comm, &v, &v, 1, CRING_FLOAT64, CRING_MAX));
    return v;
}

/* One call of collective c on buffer set i. */
static void call(cring_comm_t *comm, int c, float **in, float **out, int i, size_t bytes,
                 const size_t *recv_bytes) {
    int size = cring_comm_size(comm);
    if (c == 0)
        CHECK_OK(cring__comm_allreduce(comm, in[i], in[i], bytes / cring_dtype_size(dtype), dtype,
                                       CRING_SUM));
    else if (c == 1) CHECK_OK(cring__comm_broadcast(comm, in[i], bytes, 0));
    else CHECK_OK(cring__comm_allgatherv(comm, in[i], bytes / (size_t)size, out[i], recv_bytes));
}

/* 64-aligned buffer; from 4 MiB on backed by huge pages where the kernel
 * allows (NumPy's rule), so large calls do not measure TLB misses. */
static void *alloc_buffer(size_t bytes) {
    const size_t huge = 2u << 20;
    if (bytes < (4u << 20)) return (char *)aligned_alloc(64, bytes + 64) + misalign;
    void *p = aligned_alloc(huge, (bytes + huge) / huge * huge);
    if (p) madvise(p, bytes, MADV_HUGEPAGE);
    return p ? (char *)p + misalign : NULL;
}

static void bench_one(cring_comm_t *comm, int c, size_t bytes) {
    const int rank = cring_comm_rank(comm), size = cring_comm_size(comm);
    bytes = bytes / (4 * (size_t)size) * 4 * (size_t)size;
    const size_t in_bytes = c == 2 ? bytes / (size_t)size : bytes;
    const size_t out_bytes = c == 2 ? bytes : 0;
    const size_t footprint = in_bytes + out_bytes;
    int nbuf = (int)ceil((double)rotate_mib * (1 << 20) / (double)footprint);
    if (nbuf < 2) nbuf = 2;
    float **in = calloc((size_t)nbuf, sizeof *in), **out = calloc((size_t)nbuf, sizeof *out);
    size_t recv_bytes[64];
    for (int q = 0; q < size; q++) recv_bytes[q] = in_bytes;
    for (int i = 0; i < nbuf; i++) {
        in[i] = alloc_buffer(in_bytes);
        CHECK(in[i]);
        for (size_t e = 0; e < in_bytes / 4; e++) in[i][e] = (float)(rank + 1);
        if (out_bytes) {
            out[i] = alloc_buffer(out_bytes);
            CHECK(out[i]);
            memset(out[i], 0, out_bytes);
        }
    }
    int k = 0;
    call(comm, c, in, out, k++ % nbuf, bytes, recv_bytes); /* warm-up */
    CHECK_OK(cring__comm_barrier(comm));
    double t0 = now_s();
    for (int j = 0; j < 3; j++) call(comm, c, in, out, k++ % nbuf, bytes, recv_bytes);
    double per_call = max_over_ranks(comm, (now_s() - t0) / 3);
    int per_rep = (int)(TARGET_REP_S / per_call);
    if (per_rep < 1) per_rep = 1;
    double *times = calloc((size_t)reps, sizeof *times);
    for (int r = 0; r < reps; r++) {
        CHECK_OK(cring__comm_barrier(comm));
        t0 = now_s();
        for (int j = 0; j < per_rep; j++) call(comm, c, in, out, k++ % nbuf, bytes, recv_bytes);
        times[r] = max_over_ranks(comm, (now_s() - t0) / per_rep);
    }
    /* check one fresh call */
    const size_t n = in_bytes / 4;
    if (c == 0 && dtype == CRING_BFLOAT16) { /* bfloat16 1.0 and 2.0 sum to 3.0 */
        uint16_t *h = (uint16_t *)in[0];
        for (size_t e = 0; e < in_bytes / 2; e++) h[e] = rank ? 0x4000 : 0x3f80;
        call(comm, c, in, out, 0, bytes, recv_bytes);
        for (size_t e = 0; e < in_bytes / 2; e++) CHECK(h[e] == 0x4040);
    } else {
        for (size_t e = 0; e < n; e++) in[0][e] = (float)((rank + 1) * (e % 1000));
        call(comm, c, in, out, 0, bytes, recv_bytes);
        for (size_t e = 0; e < n; e++) {
            float want;
            if (c == 0) want = (float)((size * (size + 1) / 2) * (e % 1000));
            else if (c == 1) want = (float)(e % 1000);
            else want = 0;
            if (c != 2 && in[0][e] != want) {
                fprintf(stderr, "%s %zu B: rank %d element %zu is %g, want %g\n", coll_names[c],
                        bytes, rank, e, in[0][e], want);
                exit(1);
            }
        }
        if (c == 2)
            for (int q = 0; q < size; q++)
                for (size_t e = 0; e < n; e++)
                    CHECK(out[0][(size_t)q * n + e] == (float)((q + 1) * (e % 1000)));
    }
    qsort(times, (size_t)reps, sizeof *times, cmp_double);
    if (rank == 0) {
        printf("%-10s %9.3f MiB  median %9.1f us  min %9.1f us  (%d calls/rep, %d buffers)\n",
               coll_names[c], bytes / 1048576.0, times[reps / 2] * 1e6, times[0] * 1e6, per_rep,
               nbuf);
        fflush(stdout);
    }
    for (int i = 0; i < nbuf; i++) {
        free(in[i] ? (char *)in[i] - misalign : NULL);
        free(out[i] ? (char *)out[i] - misalign : NULL);
    }
    free(in);
    free(out);
    free(times);
}

static void run_rank(int rank, int size, int port, int unused) {
    cring_config_t cfg = testutil_config(rank, size, port, CRING_TRANSPORT_SHM, 120);
    cfg.secret = "bench";
    cring_comm_t *comm = NULL;
    if (cring_comm_init(&cfg, &comm) != CRING_OK) {
        fprintf(stderr, "rank %d: init failed: %s\n", rank, cring_last_init_error());
        exit(1);
    }
    for (int c = 0; c < 3; c++)
        if (do_coll[c])
            for (int s = 0; s < nsizes; s++) bench_one(comm, c, sizes[s]);
    cring_comm_destroy(comm);
    exit(0);
}

int main(int argc, char **argv) {
    int np = 2, picked = 0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) goto usage;
        if (!strcmp(a, "-n")) np = atoi(v);
        else if (!strcmp(a, "-r")) reps = atoi(v);
        else if (!strcmp(a, "-R")) rotate_mib = atoi(v);
        else if (!strcmp(a, "-o")) misalign = atoi(v) & ~3; /* keep float alignment */
        else if (!strcmp(a, "-s") && nsizes < MAX_SIZES) sizes[nsizes++] = strtoull(v, NULL, 0);
        else if (!strcmp(a, "-t") && !strcmp(v, "bfloat16")) dtype = CRING_BFLOAT16;
        else if (!strcmp(a, "-t") && !strcmp(v, "float32")) dtype = CRING_FLOAT32;
        else if (!strcmp(a, "-c")) {
            if (!picked) memset(do_coll, 0, sizeof do_coll);
            picked = 1;
            int found = 0;
            for (int c = 0; c < 3; c++)
                if (!strcmp(v, coll_names[c])) do_coll[c] = found = 1;
            if (!found) goto usage;
        } else goto usage;
        i++;
    }
    if (np < 2 || np > 64 || reps < 1 || misalign < 0 || misalign >= 64) goto usage;
    if (!nsizes) {
        sizes[nsizes++] = 1u << 20;
        sizes[nsizes++] = 64u << 20;
    }
    testutil_run_world(np, run_rank, 0, "shm_bench");
    return 0;
usage:
    fprintf(stderr,
            "usage: %s [-n ranks] [-r reps] [-R rotate_MiB] [-o misalign_bytes] [-s bytes]... "
            "[-c allreduce|broadcast|allgather]... [-t float32|bfloat16]\n",
            argv[0]);
    return 2;
}

/* test_gpu_nccl.c: the GPU layer without a GPU, against the test doubles
 * libfake_nccl.so and libfake_cudart.so (built next to this program; "device
 * memory" is host memory there). Loader: explicit path, bad path, missing
 * symbol, too old a version, wheel candidates, remembered outcome. NCCL
 * path: communicators whose unique id rank 0 broadcasts over a real cring
 * communicator, at world sizes 1, 2 and 3, and every collective
 * (grouped, odd and zero counts, uneven allgather/reducescatter parts,
 * pre-multiplied sums, a stream per tensor, int16/bool moved as bytes, a
 * grouped uneven alltoall) checked against values computed here; NCCL's
 * one-rank reduce defect, reproduced by the fake, against an affected and a
 * fixed version. Communicators belong to their creators: two on one device
 * work side by side, destroying one leaves the other working, and a check
 * or a collective on one never waits for a thread inside another's creation
 * (the fake holds it there). Memory: the pinned-buffer cache, stream-ordered
 * copies, stream-ordered device memory (never a cudaFree; and the fallback
 * for a device without memory pools, which reuses freed blocks once their
 * stream has passed the free). (The engine's CUDA backend on top of this:
 * test_engine_cuda.c.) */
#include <pthread.h>
#include <stdatomic.h>
#include <dlfcn.h>
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cring/cring.h"
#include "gpu/gpu.h"
#include "testutil.h"

static testutil_fakes_t fakes;

/* The host waits for the streams these tests enqueue on (the fake runs a
 * stream's work late, as a GPU does): 0x5000, 0x5001, 0x77 and the legacy
 * default stream. */
static void settle(cring__gpu_t *g) {
    cring__errmsg_t err;
    void *const streams[] = {(void *)(uintptr_t)0x5000, (void *)(uintptr_t)0x5001,
                             (void *)(uintptr_t)0x77, NULL};
    for (size_t i = 0; i < sizeof streams / sizeof *streams; i++)
        CHECK_OK(cring__gpu_stream_sync(g, streams[i], &err));
}

/* The fake runtime's counters (fake_cuda_count): "malloc", "free", ... */
static long fake_cuda(const char *what) {
    void *lib = dlopen(fakes.cudart, RTLD_NOW | RTLD_NOLOAD);
    CHECK(lib != NULL);
    long (*fn)(const char *) = (long (*)(const char *))dlsym(lib, "fake_cuda_count");
    CHECK(fn != NULL);
    long n = fn(what);
    dlclose(lib);
    return n;
}

static cring__gpu_t *fresh(void) {
    cring__gpu_t *g = NULL;
    CHECK_OK(cring__gpu_create(&g));
    return g;
}

static void test_loader(void) {
    cring__errmsg_t err;
    cring__gpu_t *g;

    /* An explicit path that does not exist: the error names it, nothing else is tried. */
    setenv("CRING_NCCL_LIBRARY", "/nonexistent/libnccl.so.2", 1);
    g = fresh();
    CHECK(cring__gpu_load_nccl(g, NULL, 0, &err) == CRING_ERR_NOT_SUPPORTED);
    CHECK(strstr(err.text, "CRING_NCCL_LIBRARY=/nonexistent/libnccl.so.2") != NULL);
    CHECK(cring__gpu_nccl_path(g) == NULL);
    /* The outcome is remembered: fixing the variable later changes nothing. */
    setenv("CRING_NCCL_LIBRARY", fakes.nccl, 1);
    CHECK(cring__gpu_load_nccl(g, NULL, 0, &err) == CRING_ERR_NOT_SUPPORTED);
    cring__gpu_destroy(g);

    /* A library without a needed symbol is refused, naming the symbol. */
    setenv("CRING_NCCL_LIBRARY", fakes.nccl_no_allgather, 1);
    g = fresh();
    CHECK(cring__gpu_load_nccl(g, NULL, 0, &err) == CRING_ERR_NOT_SUPPORTED);
    CHECK(strstr(err.text, "ncclAllGather") != NULL);
    cring__gpu_destroy(g);

    /* Too old a NCCL is refused with its version. */
    setenv("CRING_NCCL_LIBRARY", fakes.nccl, 1);
    setenv("CRING_FAKE_NCCL_VERSION", "2708", 1);
    g = fresh();
    CHECK(cring__gpu_load_nccl(g, NULL, 0, &err) == CRING_ERR_NOT_SUPPORTED);
    CHECK(strstr(err.text, "NCCL 2.7.8 is too old") != NULL);
    cring__gpu_destroy(g);
    unsetenv("CRING_FAKE_NCCL_VERSION");

    /* The override works and reports the file and version. */
    g = fresh();
    CHECK_OK(cring__gpu_load_nccl(g, NULL, 0, &err));
    CHECK(cring__gpu_nccl_version(g) == 22703);
    CHECK(strstr(cring__gpu_nccl_path(g), "libfake_nccl.so") != NULL);
    cring__gpu_destroy(g);

    /* Without the variable, wheel candidates are tried in order (missing files skipped). */
    unsetenv("CRING_NCCL_LIBRARY");
    const char *wheels[] = {"/nonexistent/nvidia/nccl/lib/libnccl.so.2", fakes.nccl};
    g = fresh();
    void *system_nccl = dlopen("libnccl.so.2", RTLD_NOW | RTLD_NOLOAD);
    CHECK_OK(cring__gpu_load_nccl(g, wheels, 2, &err));
    if (!system_nccl) CHECK(strstr(cring__gpu_nccl_path(g), "libfake_nccl.so") != NULL);
    cring__gpu_destroy(g);

    /* Nothing anywhere: "not found", listing what was tried. */
    void *on_system = dlopen("libnccl.so.2", RTLD_NOW);
    if (!on_system) {
        g = fresh();
        CHECK(cring__gpu_load_nccl(g, NULL, 0, &err) == CRING_ERR_NOT_SUPPORTED);
        CHECK(strstr(err.text, "NCCL was not found") != NULL);
        CHECK(strstr(err.text, "libnccl.so.2") != NULL);
        cring__gpu_destroy(g);
    } else {
        dlclose(on_system);
    }

    /* The runtime: device count and the driver's complaint when there is none. */
    setenv("CRING_CUDART_LIBRARY", fakes.cudart, 1);
    g = fresh();
    CHECK_OK(cring__gpu_load_cudart(g, NULL, 0, &err));
    CHECK(cring__gpu_cudart_version(g) == 12080);
    CHECK(cring__gpu_device_count(g, &err) == 1);
    setenv("CRING_FAKE_CUDA_DEVICES", "error", 1);
    CHECK(cring__gpu_device_count(g, &err) == 0);
    CHECK(strstr(err.text, "driver version is insufficient") != NULL);
    setenv("CRING_FAKE_CUDA_DEVICES", "0", 1);
    CHECK(cring__gpu_device_count(g, &err) == 0);
    CHECK(strstr(err.text, "no CUDA device") != NULL);
    unsetenv("CRING_FAKE_CUDA_DEVICES");
    cring__gpu_destroy(g);
    printf("loader: ok\n");
    fflush(stdout);
}

/* rank r, element i: small integers, exact in every dtype used here */
static float fval(int rank, size_t i) { return (float)((int)((rank * 5 + i * 3) % 7) - 3); }

static void check_float(const float *got, float expect, const char *what, size_t i) {
    if (fabsf(*got - expect) > 1e-5f) {
        fprintf(stderr, "%s[%zu]: got %g, expected %g\n", what, i, *got, expect);
        exit(1);
    }
}

static void run_rank(int rank, int size, int port, int unused) {
    alarm(120);
    cring_config_t cfg = testutil_config(rank, size, port, CRING_TRANSPORT_AUTO, 60);
    cfg.job_key = "gpu-test";
    cring_comm_t *comm = NULL;
    CHECK_OK(cring_comm_init(&cfg, &comm));
    cring__gpu_t *g = fresh();
    cring__errmsg_t err;
    CHECK_OK(cring__gpu_load_cudart(g, NULL, 0, &err));
    CHECK_OK(cring__gpu_load_nccl(g, NULL, 0, &err));
    char id[CRING__GPU_UNIQUE_ID_BYTES] = {0};
    if (rank == 0) CHECK_OK(cring__gpu_unique_id(g, id, &err));
    CHECK_OK(cring_broadcast(comm, id, sizeof id, 0));
    cring__gpu_comm_t *comm0 = NULL;
    CHECK(cring__gpu_comm_live(g) == 0);
    CHECK_OK(cring__gpu_comm_create(g, 0, rank, size, id, &comm0, &err));
    CHECK(comm0 != NULL && cring__gpu_comm_device(comm0) == 0 &&
          cring__gpu_comm_size(comm0) == size);
    CHECK(cring__gpu_comm_live(g) == 1);
    void *stream = (void *)(uintptr_t)0x5000;

    /* One group: sums of float32 with 0, 1 and 1001 elements, and an int32 average. */
    const size_t counts[3] = {0, 1, 1001};
    float *f[3];
    for (int k = 0; k < 3; k++) {
        f[k] = malloc((counts[k] + 1) * sizeof(float));
        for (size_t i = 0; i < counts[k]; i++) f[k][i] = fval(rank, i + (size_t)k);
    }
    int32_t ints[5];
    for (int i = 0; i < 5; i++) ints[i] = rank * 10 + i - 7;
    cring__gpu_tensor_t ts[4] = {
        {f[0], f[0], CRING_FLOAT32, counts[0], NULL, stream, NULL},
        {f[1], f[1], CRING_FLOAT32, counts[1], NULL, stream, NULL},
        {f[2], f[2], CRING_FLOAT32, counts[2], NULL, (void *)(uintptr_t)0x5001, NULL},
    };
    cring__gpu_coll_t c = {.collective = CRING_COLL_ALLREDUCE,
                           .op = CRING_SUM,
                           .scale = 1.0,
                           .ntensors = 3,
                           .tensors = ts};
    CHECK_OK(cring__gpu_collective(g, comm0, &c, &err));
    settle(g);
    for (int k = 1; k < 3; k++)
        for (size_t i = 0; i < counts[k]; i++) {
            float expect = 0;
            for (int r = 0; r < size; r++) expect += fval(r, i + (size_t)k);
            check_float(&f[k][i], expect, "grouped sum", i);
        }
    ts[0] = (cring__gpu_tensor_t){ints, ints, CRING_INT32, 5, NULL, stream, NULL};
    c = (cring__gpu_coll_t){.collective = CRING_COLL_ALLREDUCE,
                            .op = CRING_AVERAGE,
                            .scale = 1.0,
                            .ntensors = 1,
                            .tensors = ts};
    CHECK_OK(cring__gpu_collective(g, comm0, &c, &err));
    settle(g);
    for (int i = 0; i < 5; i++) {
        int sum = 0;
        for (int r = 0; r < size; r++) sum += r * 10 + i - 7;
        CHECK(ints[i] == sum / size); /* toward zero */
    }

    /* Average with a scale: a pre-multiplied sum (scale / size). */
    float scaled[7];
    for (int i = 0; i < 7; i++) scaled[i] = fval(rank, (size_t)i);
    ts[0] = (cring__gpu_tensor_t){scaled, scaled, CRING_FLOAT32, 7, NULL, stream, NULL};
    c = (cring__gpu_coll_t){.collective = CRING_COLL_ALLREDUCE,
                            .op = CRING_AVERAGE,
                            .scale = 0.5,
                            .ntensors = 1,
                            .tensors = ts};
    CHECK_OK(cring__gpu_collective(g, comm0, &c, &err));
    settle(g);
    for (size_t i = 0; i < 7; i++) {
        float expect = 0;
        for (int r = 0; r < size; r++) expect += fval(r, i);
        check_float(&scaled[i], expect * 0.5f / (float)size, "scaled average", i);
    }
    /* A scale on Max is refused before anything is enqueued; the communicator stays usable. */
    c.op = CRING_MAX;
    CHECK(cring__gpu_collective(g, comm0, &c, &err) == CRING_ERR_NOT_SUPPORTED);
    CHECK(strstr(err.text, "scaling") != NULL);
    CHECK_OK(cring__gpu_comm_check(g, comm0, &err));

    /* Broadcast from the last rank, out of place. */
    double bsend[9], brecv[9];
    for (int i = 0; i < 9; i++) {
        bsend[i] = rank * 100.0 + i;
        brecv[i] = -1;
    }
    ts[0] = (cring__gpu_tensor_t){bsend, brecv, CRING_FLOAT64, 9, NULL, stream, NULL};
    c = (cring__gpu_coll_t){.collective = CRING_COLL_BROADCAST,
                            .root = size - 1,
                            .scale = 1.0,
                            .ntensors = 1,
                            .tensors = ts};
    CHECK_OK(cring__gpu_collective(g, comm0, &c, &err));
    settle(g);
    for (int i = 0; i < 9; i++) CHECK(brecv[i] == (size - 1) * 100.0 + i);

    /* Allgather: uneven parts (rank r sends r + 1 elements) and even ones, grouped. */
    size_t uneven[8], even[8], total = 0;
    for (int r = 0; r < size; r++) {
        uneven[r] = (size_t)r + 1;
        even[r] = 3;
        total += uneven[r];
    }
    int64_t gsend[8], grecv[64], esend[3], erecv[24];
    for (int i = 0; i <= rank; i++) gsend[i] = rank * 1000 + i;
    for (int i = 0; i < 3; i++) esend[i] = rank * 10 + i;
    ts[0] =
        (cring__gpu_tensor_t){gsend, grecv, CRING_INT64, (size_t)rank + 1, uneven, stream, NULL};
    ts[1] = (cring__gpu_tensor_t){esend, erecv, CRING_INT64, 3, even, stream, NULL};
    c = (cring__gpu_coll_t){
        .collective = CRING_COLL_ALLGATHER, .scale = 1.0, .ntensors = 2, .tensors = ts};
    CHECK_OK(cring__gpu_collective(g, comm0, &c, &err));
    settle(g);
    size_t at = 0;
    for (int r = 0; r < size; r++)
        for (int i = 0; i <= r; i++) CHECK(grecv[at++] == r * 1000 + i);
    CHECK(at == total);
    for (int r = 0; r < size; r++)
        for (int i = 0; i < 3; i++) CHECK(erecv[r * 3 + i] == r * 10 + i);

    /* Reducescatter: 7 rows over size ranks (uneven unless size divides 7) and 2 per rank. */
    size_t rs_counts[8], rs_even[8], off = 0, my_off = 0;
    for (int r = 0; r < size; r++) {
        rs_counts[r] = 7 / (size_t)size + ((size_t)r < 7 % (size_t)size ? 1 : 0);
        rs_even[r] = 2;
        if (r < rank) my_off += rs_counts[r];
    }
    float rsend[7], rrecv[7], esend2[16], erecv2[2];
    for (int i = 0; i < 7; i++) rsend[i] = fval(rank, (size_t)i);
    for (int i = 0; i < 2 * size; i++) esend2[i] = fval(rank, (size_t)i + 3);
    ts[0] = (cring__gpu_tensor_t){rsend, rrecv, CRING_FLOAT32, 7, rs_counts, stream, NULL};
    ts[1] = (cring__gpu_tensor_t){esend2,  erecv2, CRING_FLOAT32, 2 * (size_t)size,
                                  rs_even, stream, NULL};
    c = (cring__gpu_coll_t){.collective = CRING_COLL_REDUCESCATTER,
                            .op = CRING_SUM,
                            .scale = 1.0,
                            .ntensors = 2,
                            .tensors = ts};
    CHECK_OK(cring__gpu_collective(g, comm0, &c, &err));
    settle(g);
    for (size_t i = 0; i < rs_counts[rank]; i++) {
        float expect = 0;
        for (int r = 0; r < size; r++) expect += fval(r, my_off + i);
        check_float(&rrecv[i], expect, "reducescatter", i);
    }
    for (size_t i = 0; i < 2; i++) {
        float expect = 0;
        for (int r = 0; r < size; r++) expect += fval(r, (size_t)rank * 2 + i + 3);
        check_float(&erecv2[i], expect, "even reducescatter", i);
    }
    (void)off;

    /* Data movement of a dtype NCCL has no type for (int16, bool): as bytes. */
    int16_t hb[5];
    uint8_t flags[3];
    for (int i = 0; i < 5; i++) hb[i] = (int16_t)(rank == 0 ? -300 * i - 1 : 0);
    for (int i = 0; i < 3; i++) flags[i] = (uint8_t)(rank == 0 ? i % 2 : 7);
    ts[0] = (cring__gpu_tensor_t){hb, hb, CRING_INT16, 5, NULL, stream, NULL};
    ts[1] = (cring__gpu_tensor_t){flags, flags, CRING_BOOL, 3, NULL, stream, NULL};
    c = (cring__gpu_coll_t){
        .collective = CRING_COLL_BROADCAST, .root = 0, .scale = 1.0, .ntensors = 2, .tensors = ts};
    CHECK_OK(cring__gpu_collective(g, comm0, &c, &err));
    settle(g);
    for (int i = 0; i < 5; i++) CHECK(hb[i] == -300 * i - 1);
    for (int i = 0; i < 3; i++) CHECK(flags[i] == i % 2);
    /* ... but an int16 reduction is refused (the engine stages it through host memory) */
    c.collective = CRING_COLL_ALLREDUCE;
    c.ntensors = 1;
    CHECK(cring__gpu_collective(g, comm0, &c, &err) == CRING_ERR_NOT_SUPPORTED);
    CHECK(strstr(err.text, "int16") != NULL);
    CHECK(!cring__gpu_can_reduce(CRING_INT16, CRING_SUM, 1, 1));
    CHECK(!cring__gpu_can_reduce(CRING_INT32, CRING_SUM, 2, 1));
    CHECK(!cring__gpu_can_reduce(CRING_FLOAT32, CRING_MAX, 1, 0.5));
    CHECK(cring__gpu_can_reduce(CRING_FLOAT16, CRING_AVERAGE, 0.5, 3));
    CHECK(cring__gpu_can_reduce(CRING_UINT8, CRING_MIN, 1, 1));

    /* Alltoall, grouped with a second tensor: rank r sends (r + q) % 3 int16
     * elements to rank q (zero counts included), element value
     * 1000 r + 10 q + i; and 2 int64 to each rank. */
    size_t a_send[8], a_recv[8], a_total = 0, a_in = 0, two[8];
    for (int q = 0; q < size; q++) {
        a_send[q] = (size_t)(rank + q) % 3;
        a_recv[q] = (size_t)(q + rank) % 3;
        two[q] = 2;
        a_total += a_send[q];
        a_in += a_recv[q];
    }
    int16_t asend[32], arecv[32];
    int64_t bsend2[16], brecv2[16];
    size_t k2 = 0;
    for (int q = 0; q < size; q++)
        for (size_t i = 0; i < a_send[q]; i++) asend[k2++] = (int16_t)(1000 * rank + 10 * q + i);
    for (int i = 0; i < 2 * size; i++) bsend2[i] = rank * 100 + i;
    ts[0] = (cring__gpu_tensor_t){asend, arecv, CRING_INT16, a_total, a_send, stream, a_recv};
    ts[1] = (cring__gpu_tensor_t){bsend2, brecv2, CRING_INT64, 2 * (size_t)size, two, stream, two};
    c = (cring__gpu_coll_t){
        .collective = CRING_COLL_ALLTOALL, .scale = 1.0, .ntensors = 2, .tensors = ts};
    cring__gpu_stats_t before, after;
    cring__gpu_get_stats(g, &before);
    CHECK_OK(cring__gpu_collective(g, comm0, &c, &err));
    settle(g);
    cring__gpu_get_stats(g, &after);
    /* one group: a send and a receive per peer and tensor */
    CHECK(after.groups == before.groups + 1);
    CHECK(after.nccl_calls - before.nccl_calls == 4 * (uint64_t)size);
    k2 = 0;
    for (int q = 0; q < size; q++)
        for (size_t i = 0; i < a_recv[q]; i++)
            CHECK(arecv[k2++] == (int16_t)(1000 * q + 10 * rank + i));
    CHECK(k2 == a_in);
    for (int q = 0; q < size; q++)
        for (int i = 0; i < 2; i++) CHECK(brecv2[q * 2 + i] == q * 100 + rank * 2 + i);
    ts[0].recv_counts = NULL; /* refused before anything is enqueued */
    CHECK(cring__gpu_collective(g, comm0, &c, &err) == CRING_ERR_INVALID_ARGUMENT);

    cring__gpu_stats_t stats;
    cring__gpu_get_stats(g, &stats);
    CHECK(stats.communicators == 1);
    CHECK(stats.groups == 8);
    CHECK_OK(cring__gpu_comm_check(g, comm0, &err));
    for (int k = 0; k < 3; k++) free(f[k]);
    cring__gpu_comm_destroy(g, comm0);
    CHECK(cring__gpu_comm_live(g) == 0);
    cring__gpu_destroy(g);
    cring_comm_destroy(comm);
    exit(0);
}

/* NCCL's one-rank reduce defect, reproduced by the fake
 * (CRING_FAKE_NCCL_ONE_RANK_DEFECT=1 leaves the last n % 16 elements of a
 * one-rank Avg or PreMulSum result unwritten), against the NCCL version
 * `version`: an Average at one rank is a Sum (exact on every version); a
 * scaled one on an affected version is refused (the engine stages it through
 * host memory), and on a fixed version it goes through NCCL, where the
 * fake's defect shows: so the fake would catch the guard's removal. */
static void run_defect(int rank, int size, int port, int version) {
    alarm(60);
    cring__gpu_t *g = fresh();
    cring__errmsg_t err;
    CHECK_OK(cring__gpu_load_cudart(g, NULL, 0, &err));
    CHECK_OK(cring__gpu_load_nccl(g, NULL, 0, &err));
    CHECK(cring__gpu_nccl_version(g) == version);
    char id[CRING__GPU_UNIQUE_ID_BYTES];
    cring__gpu_comm_t *comm0 = NULL;
    CHECK_OK(cring__gpu_unique_id(g, id, &err));
    CHECK_OK(cring__gpu_comm_create(g, 0, 0, 1, id, &comm0, &err));
    enum { N = 17 * 17 * 17 }; /* 4913 = 16 * 307 + 1: the fake drops one */
    static float x[N], y[N];
    for (int i = 0; i < N; i++) {
        x[i] = (float)(i % 101) - 50;
        y[i] = -1e9f;
    }
    cring__gpu_tensor_t t = {x, y, CRING_FLOAT32, N, NULL, NULL, NULL};
    cring__gpu_coll_t c = {.collective = CRING_COLL_ALLREDUCE,
                           .op = CRING_AVERAGE,
                           .scale = 1.0,
                           .ntensors = 1,
                           .tensors = &t};
    CHECK_OK(cring__gpu_collective(g, comm0, &c, &err));
    settle(g);
    for (int i = 0; i < N; i++) CHECK(y[i] == x[i]);
    for (int i = 0; i < N; i++) y[i] = -1e9f;
    c.scale = 0.5;
    if (cring__gpu_nccl_one_rank_defect(version)) {
        CHECK(cring__gpu_collective(g, comm0, &c, &err) == CRING_ERR_NOT_SUPPORTED);
        CHECK(strstr(err.text, "one-rank") != NULL);
        CHECK(y[0] == -1e9f);
    } else {
        CHECK_OK(cring__gpu_collective(g, comm0, &c, &err));
        settle(g);
        for (int i = 0; i < N - 1; i++) CHECK(y[i] == x[i] * 0.5f);
        CHECK(y[N - 1] == -1e9f); /* the defect, reproduced */
    }
    CHECK_OK(cring__gpu_comm_check(g, comm0, &err));
    cring__gpu_comm_destroy(g, comm0);
    cring__gpu_destroy(g);
    (void)rank;
    (void)size;
    (void)port;
    exit(0);
}

/* After CRING_FAKE_NCCL_FAIL_AFTER collectives the communicator reports an
 * asynchronous remote error: the next call fails as a peer failure, and so
 * does every later one. */
static void run_async_error(int rank, int size, int port, int unused) {
    alarm(60);
    cring__gpu_t *g = fresh();
    cring__errmsg_t err;
    CHECK_OK(cring__gpu_load_cudart(g, NULL, 0, &err));
    CHECK_OK(cring__gpu_load_nccl(g, NULL, 0, &err));
    char id[CRING__GPU_UNIQUE_ID_BYTES];
    cring__gpu_comm_t *comm0 = NULL;
    CHECK_OK(cring__gpu_unique_id(g, id, &err));
    CHECK_OK(cring__gpu_comm_create(g, 0, 0, 1, id, &comm0, &err));
    float x[4] = {1, 2, 3, 4};
    cring__gpu_tensor_t t = {x, x, CRING_FLOAT32, 4, NULL, NULL, NULL};
    cring__gpu_coll_t c = {.collective = CRING_COLL_ALLREDUCE,
                           .op = CRING_SUM,
                           .scale = 1.0,
                           .ntensors = 1,
                           .tensors = &t};
    CHECK_OK(cring__gpu_collective(g, comm0, &c, &err));
    settle(g);
    CHECK(cring__gpu_comm_check(g, comm0, &err) == CRING_ERR_PEER_FAILURE);
    CHECK(strstr(err.text, "remote process exited") != NULL);
    CHECK(cring__gpu_collective(g, comm0, &c, &err) == CRING_ERR_BROKEN);
    CHECK(cring__gpu_comm_check(g, comm0, &err) == CRING_ERR_PEER_FAILURE); /* for good */
    cring__gpu_comm_destroy(g, comm0); /* aborts the broken communicator instead of waiting */
    cring__gpu_destroy(g);
    exit(0);
}

static void test_staging(void) {
    cring__gpu_t *g = fresh();
    cring__errmsg_t err;
    void *p = NULL, *q = NULL;
    size_t cap = 0, cap2 = 0;
    CHECK(cring__gpu_pinned_get(g, 100, &p, &cap, &err) == CRING_ERR_NOT_SUPPORTED);
    CHECK_OK(cring__gpu_load_cudart(g, NULL, 0, &err));
    CHECK_OK(cring__gpu_pinned_get(g, 0, &p, &cap, &err));
    CHECK(p == NULL && cap == 0);
    CHECK_OK(cring__gpu_pinned_get(g, 100, &p, &cap, &err));
    CHECK(p != NULL && cap == 4096);
    cring__gpu_pinned_put(g, p, cap);
    CHECK_OK(cring__gpu_pinned_get(g, 4000, &q, &cap2, &err));
    CHECK(q == p && cap2 == 4096); /* reused from the cache */
    CHECK_OK(cring__gpu_pinned_get(g, 5000, &p, &cap, &err));
    CHECK(cap == 8192 && p != q);
    char device[64], back[64];
    for (int i = 0; i < 64; i++) device[i] = (char)i;
    CHECK_OK(cring__gpu_copy_sync(g, q, device, 64, 0, (void *)0x77, &err));
    CHECK_OK(cring__gpu_copy_sync(g, back, q, 64, 1, (void *)0x77, &err));
    CHECK(memcmp(back, device, 64) == 0);
    cring__gpu_stats_t stats;
    cring__gpu_get_stats(g, &stats);
    CHECK(stats.pinned_allocs == 2);
    CHECK(stats.staged_bytes == 128);
    cring__gpu_pinned_put(g, p, cap);
    cring__gpu_pinned_put(g, q, cap2);
    /* device memory: stream-ordered (cudaMallocAsync/cudaFreeAsync), on the
     * device asked for, zeroed and copied on a stream; never a cudaFree */
    long frees0 = fake_cuda("free"), mallocs0 = fake_cuda("malloc");
    long async0 = fake_cuda("malloc_async"), async_frees0 = fake_cuda("free_async");
    void *d1 = NULL, *d2 = NULL;
    CHECK_OK(cring__gpu_mem_alloc(g, 0, 0, (void *)0x77, &d1, &err));
    CHECK(d1 == NULL);
    CHECK_OK(cring__gpu_mem_alloc(g, 0, 64, (void *)0x77, &d1, &err));
    CHECK_OK(cring__gpu_mem_alloc(g, 0, 64, (void *)0x77, &d2, &err));
    CHECK(cring__gpu_mem_alloc(g, 7, 64, (void *)0x77, &p, &err) ==
          CRING_ERR_SYSTEM); /* no cuda:7 */
    CHECK(strstr(err.text, "cudaSetDevice(7)") != NULL);
    CHECK_OK(cring__gpu_zero_async(g, d1, 64, (void *)0x77, &err));
    CHECK_OK(cring__gpu_copy_device(g, d2, d1, 64, (void *)0x77, &err));
    settle(g);
    for (int i = 0; i < 64; i++) CHECK(((char *)d2)[i] == 0);
    cring__gpu_get_stats(g, &stats);
    CHECK(stats.device_allocs == 2 && stats.device_reuses == 0);
    cring__gpu_mem_free(g, 0, d1, 64, (void *)0x77);
    cring__gpu_mem_free(g, 0, d2, 64, (void *)0x78);
    cring__gpu_mem_free(g, 0, NULL, 64, (void *)0x77);
    CHECK(fake_cuda("malloc_async") - async0 == 2 && fake_cuda("free_async") - async_frees0 == 2);
    CHECK(fake_cuda("malloc") == mallocs0 && fake_cuda("free") == frees0);
    /* streams and events (stream.c): streams lent one owner at a time */
    cring__gpu_stream_t *s1 = NULL, *s2 = NULL, *s3 = NULL;
    CHECK_OK(cring__gpu_stream_acquire(g, 0, &s1, &err));
    CHECK_OK(cring__gpu_stream_acquire(g, 0, &s2, &err));
    CHECK(s1 != s2 && cring__gpu_stream_handle(s1) != cring__gpu_stream_handle(s2));
    CHECK(cring__gpu_stream_device(s1) == 0);
    cring__gpu_stream_release(g, s2);
    CHECK_OK(cring__gpu_stream_acquire(g, 0, &s3, &err));
    CHECK(s3 == s2); /* back from the pool, not a new one */
    CHECK(cring__gpu_stream_acquire(g, 99, &s2, &err) == CRING_ERR_NOT_SUPPORTED);
    void *raw = cring__gpu_stream_handle(s1);
    cring__gpu_event_t *e1 = NULL, *e2 = NULL, *e3 = NULL;
    CHECK_OK(cring__gpu_event_record(g, 0, (void *)0x77, &e1, &err));
    CHECK_OK(cring__gpu_event_record(g, 0, NULL, &e2, &err)); /* the legacy default stream */
    CHECK(e1 != e2 && cring__gpu_event_device(e1) == 0);
    CHECK_OK(cring__gpu_stream_wait(g, 0, raw, e1, &err));
    CHECK_OK(cring__gpu_event_sync(g, e2, &err));
    CHECK_OK(cring__gpu_event_check(g, e2, &err)); /* it watches no communicator */
    cring__gpu_event_ref(e1);
    cring__gpu_event_put(g, e1); /* still held once */
    CHECK_OK(cring__gpu_event_record(g, 0, raw, &e3, &err));
    CHECK(e3 != e1);
    cring__gpu_event_put(g, e1); /* back to the pool: the next record reuses it */
    cring__gpu_event_put(g, e3);
    cring__gpu_event_t *e4 = NULL;
    CHECK_OK(cring__gpu_event_record(g, 0, raw, &e4, &err));
    CHECK(e4 == e3 || e4 == e1);
    cring__gpu_event_put(g, e4);
    cring__gpu_event_put(g, e2);
    cring__gpu_event_put(g, NULL);
    cring__gpu_stream_release(g, s1);
    cring__gpu_stream_release(g, s3);
    cring__gpu_get_stats(g, &stats);
    CHECK(stats.events == 4 && stats.stream_waits == 1 && stats.host_waits == 1);
    CHECK(stats.streams == 2);
    cring__gpu_destroy(g);
    CHECK(cring__gpu_global() != NULL && cring__gpu_global() == cring__gpu_global());
    printf("memory: ok\n");
    fflush(stdout);
}

/* Without stream-ordered allocation (a device without memory pools, as the
 * fake's CRING_FAKE_CUDA_ASYNC_ALLOC=unsupported says): a freed block waits
 * behind an event on its stream and is handed out again once that stream has
 * passed it; steady allocation and freeing makes no cudaMalloc and never a
 * cudaFree (only the context's destruction gives the blocks back). */
static void test_fallback_allocator(void) {
    setenv("CRING_FAKE_CUDA_ASYNC_ALLOC", "unsupported", 1);
    cring__gpu_t *g = fresh();
    cring__errmsg_t err;
    CHECK_OK(cring__gpu_load_cudart(g, NULL, 0, &err));
    long frees0 = fake_cuda("free"), mallocs0 = fake_cuda("malloc");
    long async0 = fake_cuda("malloc_async");
    void *s1 = (void *)0x77, *s2 = (void *)0x78, *a = NULL, *b = NULL, *c = NULL;
    CHECK_OK(cring__gpu_mem_alloc(g, 0, 100, s1, &a, &err));
    CHECK_OK(cring__gpu_mem_alloc(g, 0, 5000, s1, &b, &err));
    CHECK(a && b && a != b);
    cring__gpu_mem_free(g, 0, a, 100, s2);
    CHECK_OK(cring__gpu_stream_sync(g, s2, &err)); /* the free's event has passed */
    CHECK_OK(cring__gpu_mem_alloc(g, 0, 3000, s1, &c, &err));
    CHECK(c == a); /* same size class (4 KiB), same device */
    for (int i = 0; i < 100; i++) {
        cring__gpu_mem_free(g, 0, c, 3000, s1);
        CHECK_OK(cring__gpu_stream_sync(g, s1, &err));
        CHECK_OK(cring__gpu_mem_alloc(g, 0, 4096, s2, &c, &err));
    }
    cring__gpu_mem_free(g, 0, b, 5000, s1);
    cring__gpu_mem_free(g, 0, c, 4096, s2);
    cring__gpu_stats_t stats;
    cring__gpu_get_stats(g, &stats);
    CHECK(stats.device_allocs == 103 && stats.device_reuses == 101);
    CHECK(fake_cuda("malloc") - mallocs0 == 2);
    CHECK(fake_cuda("malloc_async") == async0); /* asked, refused: not counted */
    CHECK(fake_cuda("free") == frees0);
    cring__gpu_destroy(g); /* now the blocks go back */
    CHECK(fake_cuda("free") - frees0 == 2);
    unsetenv("CRING_FAKE_CUDA_ASYNC_ALLOC");
    printf("fallback allocator: ok\n");
    fflush(stdout);
}

typedef struct {
    cring__gpu_t *g;
    int rank, size;
    char id[CRING__GPU_UNIQUE_ID_BYTES];
    cring__gpu_comm_t *comm;
    _Atomic int done;
} creation_t;

static void *create_comm(void *arg) {
    creation_t *c = arg;
    cring__errmsg_t err;
    CHECK_OK(cring__gpu_comm_create(c->g, 0, c->rank, c->size, c->id, &c->comm, &err));
    atomic_store(&c->done, 1);
    return NULL;
}

/* One float allreduce on comm (the legacy default stream), checked. */
static void sum_on(cring__gpu_t *g, cring__gpu_comm_t *comm, int rank, int size, float salt) {
    float x[3] = {(float)rank + salt, 1, 2};
    cring__gpu_tensor_t t = {x, x, CRING_FLOAT32, 3, NULL, NULL, NULL};
    cring__gpu_coll_t c = {.collective = CRING_COLL_ALLREDUCE,
                           .op = CRING_SUM,
                           .scale = 1.0,
                           .ntensors = 1,
                           .tensors = &t};
    cring__errmsg_t err;
    CHECK_OK(cring__gpu_collective(g, comm, &c, &err));
    CHECK_OK(cring__gpu_stream_sync(g, NULL, &err)); /* the host reads once the stream ran it */
    CHECK(x[0] == (float)(size * (size - 1) / 2) + salt * (float)size && x[2] == 2.0f * size);
}

static void run_owned_comms(int rank, int size, int port, int unused) {
    alarm(60);
    cring_config_t cfg = testutil_config(rank, size, port, CRING_TRANSPORT_AUTO, 60);
    cfg.job_key = "gpu-owned";
    cring_comm_t *cpu = NULL;
    CHECK_OK(cring_comm_init(&cfg, &cpu));
    cring__gpu_t *g = fresh();
    cring__errmsg_t err;
    CHECK_OK(cring__gpu_load_cudart(g, NULL, 0, &err));
    CHECK_OK(cring__gpu_load_nccl(g, NULL, 0, &err));
    char id[2][CRING__GPU_UNIQUE_ID_BYTES] = {{0}};
    if (rank == 0) CHECK_OK(cring__gpu_unique_id(g, id[0], &err));
    if (rank == 0) CHECK_OK(cring__gpu_unique_id(g, id[1], &err));
    CHECK_OK(cring_broadcast(cpu, id, sizeof id, 0));
    cring__gpu_comm_t *a = NULL, *b = NULL;
    CHECK_OK(cring__gpu_comm_create(g, 0, rank, size, id[0], &a, &err));
    CHECK_OK(cring__gpu_comm_create(g, 0, rank, size, id[1], &b, &err));
    CHECK(cring__gpu_comm_live(g) == 2);
    sum_on(g, a, rank, size, 0);
    sum_on(g, b, rank, size, 1);
    cring__gpu_comm_destroy(g, b); /* one owner stops: the other goes on */
    CHECK(cring__gpu_comm_live(g) == 1);
    sum_on(g, a, rank, size, 2);
    CHECK_OK(cring__gpu_comm_check(g, a, &err));

    /* A third one whose creation the fake holds until a file exists: while a
     * thread is inside it (waiting for "peers"), checks and collectives on a
     * run, and an event watching a is checked, without waiting. */
    creation_t third = {.g = g, .rank = rank, .size = size};
    if (rank == 0) CHECK_OK(cring__gpu_unique_id(g, third.id, &err));
    CHECK_OK(cring_broadcast(cpu, third.id, sizeof third.id, 0));
    char gate[128], log[128];
    snprintf(gate, sizeof gate, "/tmp/cring-test-gate-%d-%d", port, rank);
    snprintf(log, sizeof log, "/tmp/cring-test-gate-%d-%d.log", port, rank);
    unlink(gate);
    unlink(log);
    setenv("CRING_FAKE_NCCL_INIT_GATE", gate, 1);
    setenv("CRING_FAKE_NCCL_LOG", log, 1);
    pthread_t thread;
    CHECK(pthread_create(&thread, NULL, create_comm, &third) == 0);
    for (int spins = 0;; spins++) { /* until the thread is inside ncclCommInitRank */
        char line[256] = "";
        FILE *f = fopen(log, "r");
        int inside = 0;
        while (f && fgets(line, sizeof line, f))
            if (strstr(line, "initstart")) inside = 1;
        if (f) fclose(f);
        if (inside) break;
        CHECK(spins < 20000);
        usleep(1000);
    }
    cring__gpu_event_t *ev = NULL;
    CHECK_OK(cring__gpu_event_record(g, 0, NULL, &ev, &err));
    cring__gpu_event_watch(ev, a);
    CHECK_OK(cring__gpu_comm_check(g, a, &err));
    CHECK_OK(cring__gpu_event_check(g, ev, &err));
    sum_on(g, a, rank, size, 3);
    CHECK(!atomic_load(&third.done)); /* all of that while the creation still waited */
    FILE *open_gate = fopen(gate, "w");
    CHECK(open_gate != NULL);
    fclose(open_gate);
    CHECK(pthread_join(thread, NULL) == 0);
    sum_on(g, third.comm, rank, size, 4);
    unsetenv("CRING_FAKE_NCCL_INIT_GATE");
    unsetenv("CRING_FAKE_NCCL_LOG");
    unlink(gate);
    unlink(log);

    /* a broken communicator: its events say so, the other is untouched */
    cring__gpu_comm_fail(g, third.comm, CRING_ERR_PEER_FAILURE, "the peers went away");
    cring__gpu_event_watch(ev, third.comm);
    CHECK(cring__gpu_event_check(g, ev, &err) == CRING_ERR_PEER_FAILURE);
    CHECK(strstr(err.text, "the peers went away") != NULL);
    CHECK_OK(cring__gpu_comm_check(g, a, &err));
    cring__gpu_comm_destroy(g, third.comm); /* aborted already: only the reference goes */
    CHECK(cring__gpu_event_check(g, ev, &err) == CRING_ERR_PEER_FAILURE); /* the event keeps it */
    cring__gpu_event_put(g, ev);
    cring__gpu_comm_destroy(g, a);
    CHECK(cring__gpu_comm_live(g) == 0);
    cring__gpu_destroy(g);
    cring_comm_destroy(cpu);
    (void)unused;
    exit(0);
}

int main(void) {
    fakes = testutil_find_fakes();
    unsetenv("CRING_NCCL_LIBRARY");
    unsetenv("CRING_CUDART_LIBRARY");
    test_loader();
    setenv("CRING_NCCL_LIBRARY", fakes.nccl, 1);
    setenv("CRING_CUDART_LIBRARY", fakes.cudart, 1);
    test_staging();
    test_fallback_allocator();
    /* the affected versions: 2.27.0 up to 2.29.6 */
    CHECK(!cring__gpu_nccl_one_rank_defect(22609) && cring__gpu_nccl_one_rank_defect(22700));
    CHECK(cring__gpu_nccl_one_rank_defect(22809) && cring__gpu_nccl_one_rank_defect(22906));
    CHECK(!cring__gpu_nccl_one_rank_defect(22907) && !cring__gpu_nccl_one_rank_defect(23007));
    setenv("CRING_FAKE_NCCL_VERSION", "22907", 1); /* one without the defect */
    for (int size = 1; size <= 3; size++) testutil_run_world(size, run_rank, 0, "nccl collectives");
    for (int size = 1; size <= 3; size += 2)
        testutil_run_world(size, run_owned_comms, 0, "communicators owned by their creators");
    setenv("CRING_FAKE_NCCL_ONE_RANK_DEFECT", "1", 1);
    setenv("CRING_FAKE_NCCL_VERSION", "22809", 1);
    testutil_run_world(1, run_defect, 22809, "one-rank defect, NCCL 2.28.9");
    setenv("CRING_FAKE_NCCL_VERSION", "22907", 1);
    testutil_run_world(1, run_defect, 22907, "one-rank defect, NCCL 2.29.7");
    unsetenv("CRING_FAKE_NCCL_ONE_RANK_DEFECT");
    unsetenv("CRING_FAKE_NCCL_VERSION");
    setenv("CRING_FAKE_NCCL_FAIL_AFTER", "1", 1);
    testutil_run_world(1, run_async_error, 0, "nccl asynchronous error");
    unsetenv("CRING_FAKE_NCCL_FAIL_AFTER");
    TEST_DONE("test_gpu_nccl");
    return 0;
}

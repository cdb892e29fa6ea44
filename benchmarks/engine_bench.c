/* engine_bench.c: the lone synchronous 8-byte allreduce, timed in C on two
 * forked ranks over shared memory: the bare algorithm, the direct C call
 * (cring_allreduce: agreement + algorithm) and the engine (submit + wait),
 * first fresh and then with 500 names in the response cache. A tool for
 * benchmarks/engine.py, which builds and runs it; never part of the module.
 *
 *   cc -O2 -std=c11 -D_GNU_SOURCE -Icsrc/include -Icsrc benchmarks/engine_bench.c \
 *      build/libcring.a -o build/bench/engine_bench -pthread -lrt -lm -ldl
 *   build/bench/engine_bench [iterations]
 *
 * Rank 0 prints one line per measurement: "lone <mode> <fresh|warm> <seconds per call>". */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "core/comm_internal.h"
#include "cring/cring.h"
#if defined(__has_include)
#if __has_include("engine/engine_tools.h")
#include "engine/engine_tools.h" /* cring_engine_exclusive, once it leaves cring.h */
#endif
#endif
#include "tests/testutil.h"

static long iters = 20000;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

typedef struct {
    float buf[2];
    long iters;
    int raw; /* 1: the algorithm without the agreement step */
} direct_args;

static cring_status_t direct_loop(cring_comm_t *comm, void *p) {
    direct_args *a = p;
    cring_status_t st = cring_barrier(comm);
    for (long i = 0; st == CRING_OK && i < a->iters; i++)
        st = a->raw ? cring__comm_allreduce(comm, a->buf, a->buf, 2, CRING_FLOAT32, CRING_SUM)
                    : cring_allreduce(comm, a->buf, a->buf, 2, CRING_FLOAT32, CRING_SUM);
    return st;
}

static cring_status_t submit_wait(cring_engine_t *e, const char *name, void *buf, int64_t count) {
    cring_tensor_t t = {
        .send = buf, .recv = buf, .dtype = CRING_FLOAT32, .ndim = 1, .shape = &count};
    cring_request_t q = {.name = name,
                         .collective = CRING_COLL_ALLREDUCE,
                         .op = CRING_SUM,
                         .prescale = 1,
                         .postscale = 1,
                         .compression = CRING_DTYPE_COUNT,
                         .ntensors = 1,
                         .tensors = &t,
                         .flags = CRING_REQUEST_CALLER_WAITS};
    cring_handle_t *h;
    cring_status_t st = cring_engine_submit(e, &q, &h);
    if (st != CRING_OK) return st;
    st = cring_handle_wait(h);
    cring_handle_free(h);
    return st;
}

/* Seconds per call of each mode; every rank makes the same calls. */
static void measure(cring_engine_t *e, int rank, const char *tag) {
    static const char *const modes[] = {"raw", "direct", "engine"};
    for (int m = 0; m < 3; m++) {
        double best = 1e30;
        for (int rep = 0; rep < 5; rep++) {
            direct_args a = {.iters = 0, .raw = m == 0};
            cring_status_t st = cring_engine_exclusive(e, direct_loop, &a); /* a barrier */
            double t0 = now_s();
            if (m < 2) {
                a.iters = iters;
                if (st == CRING_OK) st = cring_engine_exclusive(e, direct_loop, &a);
            } else {
                for (long i = 0; st == CRING_OK && i < iters; i++)
                    st = submit_wait(e, "lone", a.buf, 2);
            }
            double dt = (now_s() - t0) / (double)iters;
            if (st != CRING_OK) {
                fprintf(stderr, "rank %d: %s failed: %s\n", rank, modes[m],
                        cring_status_string(st));
                exit(1);
            }
            if (dt < best) best = dt;
        }
        if (rank == 0) printf("lone %s %s %.9g\n", modes[m], tag, best);
    }
    fflush(stdout);
}

static void run_rank(int rank, int size, int port, int unused) {
    cring_config_t cfg = testutil_config(rank, size, port, CRING_TRANSPORT_SHM, 120);
    cfg.secret = "bench";
    cring_comm_t *comm = NULL;
    cring_engine_t *e = NULL;
    if (cring_comm_init(&cfg, &comm) != CRING_OK || cring_engine_start(comm, &e) != CRING_OK) {
        fprintf(stderr, "rank %d: init failed: %s\n", rank, cring_last_init_error());
        exit(1);
    }
    measure(e, rank, "fresh");
    static float grads[500][1024];
    for (int i = 0; i < 500; i++) { /* 500 names in the response cache */
        char name[32];
        snprintf(name, sizeof name, "grad.%d", i);
        if (submit_wait(e, name, grads[i], 1024) != CRING_OK) exit(1);
    }
    measure(e, rank, "warm");
    cring_engine_stop(e);
    exit(0);
}

int main(int argc, char **argv) {
    if (argc > 1) iters = atol(argv[1]);
    if (iters < 1) {
        fprintf(stderr, "usage: %s [iterations]\n", argv[0]);
        return 2;
    }
    testutil_run_world(2, run_rank, 0, "engine_bench");
    return 0;
}

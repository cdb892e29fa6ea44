/* testutil.h: a tiny assertion kit for the C tests (no framework needed).
 * CHECK prints the failing expression with file:line and exits the test. */
#ifndef CRING_TESTUTIL_H
#define CRING_TESTUTIL_H

#include <arpa/inet.h>
#include <limits.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cring/cring.h"

static int testutil_checks = 0;

#define CHECK(cond)                                                                                \
    do {                                                                                           \
        testutil_checks++;                                                                         \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);               \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

#define CHECK_OK(call)                                                                             \
    do {                                                                                           \
        cring_status_t st_ = (call);                                                               \
        testutil_checks++;                                                                         \
        if (st_ != CRING_OK) {                                                                     \
            fprintf(stderr, "%s:%d: %s returned %s (%s)\n", __FILE__, __LINE__, #call,             \
                    cring_status_name(st_), cring_status_string(st_));                             \
            exit(1);                                                                               \
        }                                                                                          \
    } while (0)

/* The config of rank `rank` of a `size`-rank world whose rank 0 serves the
 * store on loopback `port` (what testutil_run_world's ranks receive). */
static __attribute__((unused)) cring_config_t
testutil_config(int rank, int size, int port, cring_transport_kind_t transport, double timeout_s) {
    cring_config_t cfg;
    cring_config_init(&cfg);
    cfg.rank = rank;
    cfg.size = size;
    cfg.store_port = port;
    cfg.serve_store = rank == 0;
    cfg.transport = transport;
    cfg.timeout_s = timeout_s;
    return cfg;
}

/* A free loopback port for rank 0 to serve the store on. */
static __attribute__((unused)) int testutil_free_port(void) {
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
    socklen_t len = sizeof a;
    if (fd < 0 || bind(fd, (struct sockaddr *)&a, sizeof a) != 0 ||
        getsockname(fd, (struct sockaddr *)&a, &len) != 0) {
        perror("free_port");
        exit(1);
    }
    close(fd);
    return ntohs(a.sin_port);
}

/* Fork `size` ranks running rank_main(rank, size, port, arg) (each exits),
 * wait for all, and fail the test when any did not exit 0. Rank 0 is meant
 * to serve the store on `port`: the parent starts no threads before forking
 * (a thread's memory would look leaked in every child under LeakSanitizer). */
static __attribute__((unused)) void
testutil_run_world(int size, void (*rank_main)(int, int, int, int), int arg, const char *label) {
    int port = testutil_free_port();
    pid_t pids[64];
    for (int r = 0; r < size; r++) {
        pids[r] = fork();
        CHECK(pids[r] >= 0);
        if (pids[r] == 0) rank_main(r, size, port, arg);
    }
    int failed = 0;
    for (int r = 0; r < size; r++) {
        int status;
        waitpid(pids[r], &status, 0);
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
            fprintf(stderr, "%s, size %d: rank %d failed (status 0x%x)\n", label, size, r, status);
            failed = 1;
        }
    }
    CHECK(!failed);
    printf("%s, size %d: ok\n", label, size);
    fflush(stdout);
}

#define TEST_DONE(name) printf("%s: %d checks passed\n", (name), testutil_checks)

/* ---- the GPU test doubles --------------------------------------------------------------
 * libfake_nccl.so, libfake_nccl_no_allgather.so and libfake_cudart.so, built
 * next to the test programs (csrc/tests/fake_*.c: a GPU whose streams run
 * their work late, on threads of their own, after random delays). */
typedef struct {
    char nccl[PATH_MAX], nccl_no_allgather[PATH_MAX], cudart[PATH_MAX];
} testutil_fakes_t;

/* The doubles' paths (each checked to exist), with CRING_NCCL_LIBRARY and
 * CRING_CUDART_LIBRARY set to them. The fake GPU's delays are seeded from
 * CRING_FAKE_CUDA_SEED: when it is unset, a seed is chosen here; it is
 * printed either way, so a failure can be replayed with it. Call before
 * forking the ranks (they inherit the environment). */
static __attribute__((unused)) testutil_fakes_t testutil_find_fakes(void) {
    testutil_fakes_t f;
    char dir[PATH_MAX - 64];
    ssize_t n = readlink("/proc/self/exe", dir, sizeof dir - 1);
    CHECK(n > 0);
    dir[n] = '\0';
    char *slash = strrchr(dir, '/');
    CHECK(slash != NULL);
    *slash = '\0';
    snprintf(f.nccl, sizeof f.nccl, "%s/libfake_nccl.so", dir);
    snprintf(f.nccl_no_allgather, sizeof f.nccl_no_allgather, "%s/libfake_nccl_no_allgather.so",
             dir);
    snprintf(f.cudart, sizeof f.cudart, "%s/libfake_cudart.so", dir);
    CHECK(access(f.nccl, R_OK) == 0);
    CHECK(access(f.nccl_no_allgather, R_OK) == 0);
    CHECK(access(f.cudart, R_OK) == 0);
    setenv("CRING_NCCL_LIBRARY", f.nccl, 1);
    setenv("CRING_CUDART_LIBRARY", f.cudart, 1);
    const char *seed = getenv("CRING_FAKE_CUDA_SEED");
    if (!seed || !*seed) {
        char chosen[32];
        snprintf(chosen, sizeof chosen, "%lu",
                 ((unsigned long)time(NULL) * 2654435761ul ^ (unsigned long)getpid()) %
                     1000000000ul);
        setenv("CRING_FAKE_CUDA_SEED", chosen, 1);
    }
    printf("fake GPU: CRING_FAKE_CUDA_SEED=%s (set it to replay this run)\n",
           getenv("CRING_FAKE_CUDA_SEED"));
    fflush(stdout);
    return f;
}

#ifdef CRING_GPU_GPU_H
/* Wait for a CUDA request as a host reader must: until its handle completes
 * (its work is then only enqueued), then until the device has run it (its
 * completion event). Returns the handle's status. */
static __attribute__((unused)) cring_status_t testutil_cuda_wait(cring_handle_t *h) {
    cring_status_t st = cring_handle_wait(h);
    const cring__gpu_event_t *ev = cring_handle_device_event(h);
    cring__errmsg_t err;
    if (ev) CHECK_OK(cring__gpu_event_sync(cring__gpu_global(), ev, &err));
    return st;
}
#endif

#endif

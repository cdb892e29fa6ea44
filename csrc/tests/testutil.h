/* testutil.h: a tiny assertion kit for the C tests (no framework needed).
 * CHECK prints the failing expression with file:line and exits the test. */
#ifndef CRING_TESTUTIL_H
#define CRING_TESTUTIL_H

#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/socket.h>
#include <sys/wait.h>
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

#endif

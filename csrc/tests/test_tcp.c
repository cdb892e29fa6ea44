/* test_tcp.c: the TCP transport across real processes: mesh set-up through the
 * store at world sizes 1..5, ring exchanges of 0 B .. 64 MiB, a rank that dies
 * mid-exchange, a hung peer (timeout) and a wrong secret. alarm() guards every
 * process; the parent checks each child's exit status. */
#include <errno.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/common.h"
#include "testutil.h"
#include "transport/transport.h"

#define SECRET "tcp-test-secret"
static int g_port;

typedef struct world {
    int rank, size;
    const char *name;
    cring_store_t *store;
} world_t;

typedef void (*child_fn)(world_t *w);

/* Build the transport for w with the given timeout and secret. */
static cring_status_t make_p2p(world_t *w, double timeout_s, const char *secret,
                               cring__errmsg_t *err, cring__p2p_t **out) {
    char prefix[64];
    snprintf(prefix, sizeof prefix, "test/%s/%d", w->name, w->size);
    cring__transport_init_t init = {
        .rank = w->rank,
        .size = w->size,
        .store = w->store,
        .key_prefix = prefix,
        .listen_addr = "127.0.0.1",
        .secret = secret,
        .timeout_s = timeout_s,
        .err = err,
    };
    return cring__tcp_create(&init, out);
}

static uint8_t pattern(int rank, size_t i, size_t size) {
    return (uint8_t)(i * 31u + (size_t)rank * 7u + size);
}

/* Ring exchanges of several sizes in both directions, checking every byte. */
static void ring_child(world_t *w) {
    cring__errmsg_t err = {{0}};
    cring__p2p_t *p2p = NULL;
    CHECK_OK(make_p2p(w, 30.0, SECRET, &err, &p2p));
    CHECK(p2p != NULL && p2p->rank == w->rank && p2p->size == w->size);
    CHECK(strcmp(p2p->ops->name, "tcp") == 0);
    const int rank = w->rank, size = w->size;
    const int right = (rank + 1) % size, left = (rank + size - 1) % size;
    static const size_t sizes[] = {0, 1, 7, 1000003, 64u << 20};
    const size_t max = 64u << 20;
    uint8_t *sendb = malloc(max), *recvb = malloc(max);
    CHECK(sendb && recvb);

    /* A peer equal to this rank or out of range is refused, not deadlocked. */
    CHECK(p2p->ops->sendrecv(p2p, rank, sendb, 4, -1, NULL, 0) == CRING_ERR_INVALID_ARGUMENT);
    CHECK(p2p->ops->sendrecv(p2p, -1, NULL, 0, rank, recvb, 4) == CRING_ERR_INVALID_ARGUMENT);
    CHECK(p2p->ops->sendrecv(p2p, size, sendb, 4, -1, NULL, 0) == CRING_ERR_INVALID_ARGUMENT);
    CHECK(strstr(err.text, "invalid") != NULL);
    CHECK_OK(p2p->ops->sendrecv(p2p, -1, NULL, 0, -1, NULL, 0)); /* nothing to do */

    if (size > 1) {
        for (int dir = 0; dir < 2; dir++) {
            int to = dir == 0 ? right : left, from = dir == 0 ? left : right;
            for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
                size_t n = sizes[k];
                for (size_t i = 0; i < n; i++) sendb[i] = pattern(rank, i, n);
                memset(recvb, 0xee, n);
                CHECK_OK(p2p->ops->sendrecv(p2p, to, sendb, n, from, recvb, n));
                size_t bad = n;
                for (size_t i = 0; i < n && bad == n; i++)
                    if (recvb[i] != pattern(from, i, n)) bad = i;
                if (bad != n)
                    fprintf(stderr, "rank %d: byte %zu of %zu from rank %d is wrong\n", rank, bad,
                            n, from);
                CHECK(bad == n);
            }
        }
        /* Several messages to one peer arrive in order; send-only and
         * receive-only calls pair up across ranks. */
        if (rank % 2 == 0 && rank + 1 < size) {
            for (uint8_t m = 0; m < 3; m++) {
                memset(sendb, m + 1, 1000);
                CHECK_OK(p2p->ops->sendrecv(p2p, rank + 1, sendb, 1000, -1, NULL, 0));
            }
        } else if (rank % 2 == 1) {
            for (uint8_t m = 0; m < 3; m++) {
                CHECK_OK(p2p->ops->sendrecv(p2p, -1, NULL, 0, rank - 1, recvb, 1000));
                CHECK(recvb[0] == m + 1 && recvb[999] == m + 1);
            }
        }
    }
    free(sendb);
    free(recvb);
    p2p->ops->destroy(p2p);
}

/* World of 3: rank 1 dies while rank 2 is inside a sendrecv with it; rank 2
 * (receiving) and rank 0 (sending 64 MiB) must see PEER_FAILURE quickly. */
static void death_child(world_t *w) {
    cring__errmsg_t err = {{0}};
    cring__p2p_t *p2p = NULL;
    CHECK_OK(make_p2p(w, 30.0, SECRET, &err, &p2p));
    const int rank = w->rank, size = w->size;
    uint8_t token = (uint8_t)rank, got = 0;
    /* Everyone connected and alive: one small ring step. */
    CHECK_OK(
        p2p->ops->sendrecv(p2p, (rank + 1) % size, &token, 1, (rank + size - 1) % size, &got, 1));
    const size_t big = 64u << 20;
    uint8_t *buf = calloc(1, big);
    CHECK(buf != NULL);
    if (rank == 1) {
        /* Wait until rank 2 is inside its sendrecv (it sends us one byte
         * there), then die without cleaning up. */
        CHECK_OK(p2p->ops->sendrecv(p2p, -1, NULL, 0, 2, &got, 1));
        _exit(0);
    }
    double t0 = cring__now_s();
    cring_status_t st;
    if (rank == 2) st = p2p->ops->sendrecv(p2p, 1, &token, 1, 1, buf, big);
    else st = p2p->ops->sendrecv(p2p, 1, buf, big, -1, NULL, 0);
    double took = cring__now_s() - t0;
    if (st != CRING_ERR_PEER_FAILURE)
        fprintf(stderr, "rank %d: got %s: %s\n", rank, cring_status_name(st), err.text);
    CHECK(st == CRING_ERR_PEER_FAILURE);
    CHECK(took < 5.0); /* a failure, not a timeout */
    CHECK(strstr(err.text, "rank 1") != NULL);
    /* The transport stays failed. */
    CHECK(p2p->ops->sendrecv(p2p, 1, &token, 1, -1, NULL, 0) == CRING_ERR_BROKEN);
    free(buf);
    p2p->ops->destroy(p2p);
}

/* World of 2: rank 1 is alive but never sends; rank 0 times out naming it. */
static void timeout_child(world_t *w) {
    cring__errmsg_t err = {{0}};
    cring__p2p_t *p2p = NULL;
    CHECK_OK(make_p2p(w, w->rank == 0 ? 1.0 : 30.0, SECRET, &err, &p2p));
    if (w->rank == 0) {
        uint8_t buf[10];
        double t0 = cring__now_s();
        CHECK(p2p->ops->sendrecv(p2p, -1, NULL, 0, 1, buf, sizeof buf) == CRING_ERR_TIMEOUT);
        double took = cring__now_s() - t0;
        CHECK(took >= 0.9 && took < 5.0);
        CHECK(strstr(err.text, "0 of 10 bytes from rank 1") != NULL);
        CHECK_OK(cring_store_set(w->store, "test/timeout/done", "", 0));
    } else {
        void *v = NULL;
        size_t n = 0;
        CHECK_OK(cring_store_get(w->store, "test/timeout/done", 30.0, &v, &n));
        free(v);
    }
    p2p->ops->destroy(p2p);
}

/* World of 2 where rank 1 has another secret: rank 0's connection is refused
 * (ERR_AUTH); rank 1 never gets a valid peer (ERR_TIMEOUT). */
static void auth_child(world_t *w) {
    cring__errmsg_t err = {{0}};
    cring__p2p_t *p2p = (cring__p2p_t *)1;
    if (w->rank == 0) {
        CHECK(make_p2p(w, 30.0, SECRET, &err, &p2p) == CRING_ERR_AUTH);
        CHECK(strstr(err.text, "rank 1") != NULL);
    } else {
        CHECK(make_p2p(w, 1.5, "another secret", &err, &p2p) == CRING_ERR_TIMEOUT);
        CHECK(strstr(err.text, "rank 0") != NULL);
    }
    CHECK(p2p == NULL);
}

/* Fork size children running fn; each must exit 0. */
static void run_world(const char *name, int size, child_fn fn) {
    pid_t pids[8];
    for (int r = 0; r < size; r++) {
        pids[r] = fork();
        CHECK(pids[r] >= 0);
        if (pids[r] == 0) {
            alarm(60); /* alarms are not inherited: each child arms its own */
            world_t w = {.rank = r, .size = size, .name = name, .store = NULL};
            CHECK_OK(cring_store_connect("127.0.0.1", g_port, SECRET, 20.0, &w.store));
            fn(&w);
            cring_store_close(w.store);
            _exit(0);
        }
    }
    int failed = 0;
    for (int r = 0; r < size; r++) {
        int status = 0;
        CHECK(waitpid(pids[r], &status, 0) == pids[r]);
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
            fprintf(stderr, "%s world %d: rank %d failed (status 0x%x)\n", name, size, r, status);
            failed = 1;
        }
    }
    CHECK(!failed);
    printf("%s: world size %d ok\n", name, size);
}

int main(void) {
    alarm(240); /* watchdog for the whole program */
    cring_store_server_t *server = NULL;
    CHECK_OK(cring_store_server_start("127.0.0.1", 0, SECRET, &server, &g_port));

    for (int size = 1; size <= 5; size++) run_world("ring", size, ring_child);
    run_world("death", 3, death_child);
    run_world("timeout", 2, timeout_child);
    run_world("auth", 2, auth_child);

    cring_store_server_stop(server);
    TEST_DONE("test_tcp");
    return 0;
}

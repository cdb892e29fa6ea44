/* test_store.c: the rendezvous store end to end: set/get/add/wait from threads
 * and processes, deferred gets, timeouts, authentication, hostile raw
 * connections and restart on the same port. Guarded by alarm(); no test sleeps
 * for correctness (short pauses only make the interesting ordering likely). */
#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/auth.h"
#include "common/common.h"
#include "common/net.h"
#include "testutil.h"

#define SECRET "s3cret"
static int g_port;

static void pause_ms(int ms) { (void)poll(NULL, 0, ms); }

static cring_store_t *client(void) {
    cring_store_t *c = NULL;
    CHECK_OK(cring_store_connect("127.0.0.1", g_port, SECRET, 10.0, &c));
    return c;
}

static void check_get(cring_store_t *c, const char *key, const char *expect) {
    void *v = NULL;
    size_t n = 0;
    CHECK_OK(cring_store_get(c, key, 10.0, &v, &n));
    CHECK(n == strlen(expect));
    CHECK(memcmp(v, expect, n) == 0);
    CHECK(((char *)v)[n] == '\0'); /* values come back NUL-terminated */
    free(v);
}

/* A good client still works: the server survived whatever came before. */
static void check_server_alive(const char *tag) {
    cring_store_t *c = client();
    char key[64];
    snprintf(key, sizeof key, "alive/%s", tag);
    CHECK_OK(cring_store_set(c, key, "yes", 3));
    check_get(c, key, "yes");
    cring_store_close(c);
}

/* ---- raw protocol helpers (mirror bootstrap/store_protocol.h) ---- */
static void put_u32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}

static int raw_connect(void) {
    int fd = -1;
    CHECK_OK(cring__net_connect("127.0.0.1", g_port, cring__now_s() + 5, &fd, NULL));
    return fd;
}

/* Complete the handshake with secret; returns the server's status byte. */
static int raw_auth(int fd, const char *secret) {
    uint8_t hello[20], answer[36], status = 0xff;
    CHECK_OK(cring__net_recv_all(fd, hello, sizeof hello, cring__now_s() + 5, NULL));
    CHECK(memcmp(hello, "CRS1", 4) == 0);
    memcpy(answer, "CRS1", 4);
    cring__auth_response(secret, hello + 4, answer + 4);
    CHECK_OK(cring__net_send_all(fd, answer, sizeof answer, cring__now_s() + 5, NULL));
    CHECK_OK(cring__net_recv_all(fd, &status, 1, cring__now_s() + 5, NULL));
    return status;
}

/* The server must close fd (read EOF) within a few seconds. */
static void expect_closed(int fd) {
    char buf[256];
    double deadline = cring__now_s() + 5;
    for (;;) {
        struct pollfd p = {.fd = fd, .events = POLLIN};
        CHECK(poll(&p, 1, 5000) == 1);
        ssize_t r = recv(fd, buf, sizeof buf, 0);
        if (r == 0 || (r < 0 && errno == ECONNRESET)) break;
        CHECK(r > 0);
        CHECK(cring__now_s() < deadline);
    }
    close(fd);
}

/* ---- threads -----------------------------------------------------------------
 * Thread bodies do not use CHECK (its counter is not thread-safe): they record
 * statuses and the main thread checks them after joining. */

/* Connect or return NULL (the status lands in *st). */
static cring_store_t *thread_client(cring_status_t *st) {
    cring_store_t *c = NULL;
    *st = cring_store_connect("127.0.0.1", g_port, SECRET, 10.0, &c);
    return c;
}

typedef struct getter {
    const char *key;
    double timeout_s;
    atomic_int started, done;
    cring_status_t st;
    char value[64];
    size_t len;
} getter_t;

static void *getter_main(void *arg) {
    getter_t *g = arg;
    cring_store_t *c = thread_client(&g->st);
    void *v = NULL;
    atomic_store(&g->started, 1);
    if (!c) {
        atomic_store(&g->done, 1);
        return NULL;
    }
    g->st = cring_store_get(c, g->key, g->timeout_s, &v, &g->len);
    if (g->st == CRING_OK) {
        memcpy(g->value, v, CRING_MIN(g->len, sizeof g->value));
        free(v);
    }
    cring_store_close(c);
    atomic_store(&g->done, 1);
    return NULL;
}

typedef struct waiter {
    atomic_int done;
    cring_status_t st;
} waiter_t;

static void *waiter_main(void *arg) {
    waiter_t *w = arg;
    cring_store_t *c = thread_client(&w->st);
    const char *keys[] = {"w/1", "w/2", "w/3"};
    if (c) w->st = cring_store_wait(c, keys, 3, 10.0);
    cring_store_close(c);
    atomic_store(&w->done, 1);
    return NULL;
}

typedef struct adder {
    cring_status_t st;
    int out_of_range; /* a returned value outside 1..800 */
} adder_t;

static void *adder_main(void *arg) {
    adder_t *a = arg;
    cring_store_t *c = thread_client(&a->st);
    for (int i = 0; c && i < 100 && a->st == CRING_OK; i++) {
        int64_t v = 0;
        a->st = cring_store_add(c, "counter", 1, &v);
        if (v < 1 || v > 800) a->out_of_range = 1;
    }
    cring_store_close(c);
    return NULL;
}

typedef struct late_connect {
    int port;
    cring_status_t st;
} late_connect_t;

static void *late_connect_main(void *arg) {
    late_connect_t *l = arg;
    cring_store_t *c = NULL;
    l->st = cring_store_connect("127.0.0.1", l->port, NULL, 10.0, &c);
    if (l->st == CRING_OK) {
        l->st = cring_store_set(c, "late", "1", 1);
        cring_store_close(c);
    }
    return NULL;
}

/* ---- tests ------------------------------------------------------------------- */

static void test_basic(void) {
    cring_store_t *c = client();
    CHECK_OK(cring_store_set(c, "a", "hello", 5));
    check_get(c, "a", "hello");
    CHECK_OK(cring_store_set(c, "a", "bye", 3)); /* overwrite */
    check_get(c, "a", "bye");
    CHECK_OK(cring_store_set(c, "empty", NULL, 0));
    void *v = NULL;
    size_t n = 99;
    CHECK_OK(cring_store_get(c, "empty", 1.0, &v, &n));
    CHECK(n == 0 && v != NULL);
    free(v);
    /* A 10 MiB value round-trips intact. */
    size_t big = 10u << 20;
    uint8_t *b = malloc(big);
    CHECK(b != NULL);
    for (size_t i = 0; i < big; i++) b[i] = (uint8_t)(i * 131 + 7);
    CHECK_OK(cring_store_set(c, "big", b, big));
    CHECK_OK(cring_store_get(c, "big", 5.0, &v, &n));
    CHECK(n == big && memcmp(v, b, big) == 0);
    free(v);
    free(b);
    /* Key limits. */
    char *long_key = malloc(5000);
    memset(long_key, 'k', 4999);
    long_key[4999] = '\0';
    CHECK(cring_store_set(c, long_key, "x", 1) == CRING_ERR_INVALID_ARGUMENT);
    long_key[4096] = '\0'; /* exactly 4096 bytes is allowed */
    CHECK_OK(cring_store_set(c, long_key, "x", 1));
    check_get(c, long_key, "x");
    free(long_key);
    /* ADD on a non-integer value is refused; the client stays usable. */
    CHECK(cring_store_add(c, "a", 1, NULL) == CRING_ERR_INVALID_ARGUMENT);
    int64_t nv = 0;
    CHECK_OK(cring_store_add(c, "fresh", -5, &nv));
    CHECK(nv == -5);
    CHECK_OK(cring_store_add(c, "fresh", 7, &nv));
    CHECK(nv == 2);
    CHECK_OK(cring_store_get(c, "fresh", 1.0, &v, &n));
    CHECK(n == 8 && ((uint8_t *)v)[0] == 2 && ((uint8_t *)v)[7] == 0); /* little-endian */
    free(v);
    cring_store_close(c);
    cring_store_close(NULL);
}

static void test_get_before_set(void) {
    getter_t g = {.key = "late/key", .timeout_s = 10.0};
    pthread_t th;
    CHECK(pthread_create(&th, NULL, getter_main, &g) == 0);
    while (!atomic_load(&g.started)) pause_ms(1);
    pause_ms(150);                /* give the GET time to reach the server */
    CHECK(!atomic_load(&g.done)); /* still waiting: the key does not exist */
    cring_store_t *c = client();
    CHECK_OK(cring_store_set(c, "late/key", "there", 5));
    cring_store_close(c);
    pthread_join(th, NULL);
    CHECK_OK(g.st);
    CHECK(g.len == 5 && memcmp(g.value, "there", 5) == 0);
}

static void test_wait(void) {
    waiter_t w = {0};
    pthread_t th;
    CHECK(pthread_create(&th, NULL, waiter_main, &w) == 0);
    cring_store_t *c = client();
    CHECK_OK(cring_store_set(c, "w/2", "", 0));
    CHECK_OK(cring_store_set(c, "w/1", "", 0));
    pause_ms(50);
    CHECK(!atomic_load(&w.done)); /* w/3 still missing */
    int64_t v;
    CHECK_OK(cring_store_add(c, "w/3", 1, &v)); /* ADD creates keys too */
    pthread_join(th, NULL);
    CHECK_OK(w.st);
    const char *keys[] = {"w/1", "w/never"};
    double t0 = cring__now_s();
    CHECK(cring_store_wait(c, keys, 2, 0.2) == CRING_ERR_TIMEOUT);
    CHECK(cring__now_s() - t0 >= 0.15);
    CHECK(strstr(cring__thread_errmsg()->text, "w/never") != NULL);
    CHECK_OK(cring_store_wait(c, keys, 1, 0.2));
    CHECK_OK(cring_store_wait(c, keys, 0, 0.2));
    cring_store_close(c);
}

static void test_concurrent_add(void) {
    pthread_t th[8];
    adder_t adders[8];
    memset(adders, 0, sizeof adders);
    for (int i = 0; i < 8; i++) CHECK(pthread_create(&th[i], NULL, adder_main, &adders[i]) == 0);
    for (int i = 0; i < 8; i++) pthread_join(th[i], NULL);
    for (int i = 0; i < 8; i++) {
        CHECK_OK(adders[i].st);
        CHECK(!adders[i].out_of_range);
    }
    cring_store_t *c = client();
    int64_t v = -1;
    CHECK_OK(cring_store_add(c, "counter", 0, &v));
    CHECK(v == 800);

    /* The same from 4 forked processes, 50 adds each. */
    pid_t pids[4];
    for (int i = 0; i < 4; i++) {
        pids[i] = fork();
        CHECK(pids[i] >= 0);
        if (pids[i] == 0) {
            alarm(20);
            cring_store_t *cc = NULL;
            if (cring_store_connect("127.0.0.1", g_port, SECRET, 10.0, &cc) != CRING_OK) _exit(2);
            for (int k = 0; k < 50; k++)
                if (cring_store_add(cc, "proc/counter", 1, NULL) != CRING_OK) _exit(3);
            cring_store_close(cc);
            _exit(0);
        }
    }
    for (int i = 0; i < 4; i++) {
        int status = 0;
        CHECK(waitpid(pids[i], &status, 0) == pids[i]);
        CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    }
    CHECK_OK(cring_store_add(c, "proc/counter", 0, &v));
    CHECK(v == 200);
    cring_store_close(c);
}

static void test_auth(void) {
    cring_store_t *c = NULL;
    CHECK(cring_store_connect("127.0.0.1", g_port, "wrong", 5.0, &c) == CRING_ERR_AUTH);
    CHECK(c == NULL);
    CHECK(strstr(cring__thread_errmsg()->text, "secret") != NULL);
    CHECK(cring_store_connect("127.0.0.1", g_port, NULL, 5.0, &c) == CRING_ERR_AUTH);
    CHECK(cring_store_connect("127.0.0.1", g_port, "", 5.0, &c) == CRING_ERR_AUTH);

    /* A server without a secret accepts only clients without one. */
    cring_store_server_t *open_server = NULL;
    int port = 0;
    CHECK_OK(cring_store_server_start("127.0.0.1", 0, NULL, &open_server, &port));
    CHECK_OK(cring_store_connect("127.0.0.1", port, NULL, 5.0, &c));
    CHECK_OK(cring_store_set(c, "k", "v", 1));
    cring_store_close(c);
    CHECK_OK(cring_store_connect("127.0.0.1", port, "", 5.0, &c));
    cring_store_close(c);
    CHECK(cring_store_connect("127.0.0.1", port, "x", 5.0, &c) == CRING_ERR_AUTH);
    cring_store_server_stop(open_server);
    cring_store_server_stop(NULL);
}

static void test_get_timeout(void) {
    cring_store_t *c = client();
    void *v = (void *)1;
    size_t n = 1;
    double t0 = cring__now_s();
    CHECK(cring_store_get(c, "missing/key", 0.2, &v, &n) == CRING_ERR_TIMEOUT);
    double took = cring__now_s() - t0;
    CHECK(took >= 0.15 && took < 3.0);
    CHECK(v == NULL && n == 0);
    CHECK(strstr(cring__thread_errmsg()->text, "missing/key") != NULL);
    /* Zero timeout checks once. */
    CHECK(cring_store_get(c, "missing/key", 0, &v, &n) == CRING_ERR_TIMEOUT);
    /* The client stays usable after a timed-out get (the server answered it). */
    CHECK_OK(cring_store_set(c, "after/timeout", "ok", 2));
    check_get(c, "after/timeout", "ok");
    cring_store_close(c);
}

static void test_hostile_connections(void) {
    /* 1. Garbage instead of the handshake: refused and closed. */
    int fd = raw_connect();
    uint8_t hello[20];
    CHECK_OK(cring__net_recv_all(fd, hello, sizeof hello, cring__now_s() + 5, NULL));
    char garbage[100];
    memset(garbage, 0x5a, sizeof garbage);
    CHECK_OK(cring__net_send_all(fd, garbage, sizeof garbage, cring__now_s() + 5, NULL));
    expect_closed(fd);
    check_server_alive("garbage");

    /* 2. Authenticated, then an oversized length header: that connection closes. */
    fd = raw_connect();
    CHECK(raw_auth(fd, SECRET) == 0);
    uint8_t hdr[5];
    put_u32(hdr, 0xffffffffu);
    hdr[4] = 1;
    CHECK_OK(cring__net_send_all(fd, hdr, 5, cring__now_s() + 5, NULL));
    expect_closed(fd);
    check_server_alive("oversized");

    /* 3. A length of 64 MiB + 1 is just over the limit. */
    fd = raw_connect();
    CHECK(raw_auth(fd, SECRET) == 0);
    put_u32(hdr, (64u << 20) + 1);
    CHECK_OK(cring__net_send_all(fd, hdr, 5, cring__now_s() + 5, NULL));
    expect_closed(fd);

    /* 4. Unknown opcode and a malformed GET close only that connection. */
    fd = raw_connect();
    CHECK(raw_auth(fd, SECRET) == 0);
    uint8_t bad[5];
    put_u32(bad, 1);
    bad[4] = 99;
    CHECK_OK(cring__net_send_all(fd, bad, 5, cring__now_s() + 5, NULL));
    expect_closed(fd);
    fd = raw_connect();
    CHECK(raw_auth(fd, SECRET) == 0);
    uint8_t bad_get[5 + 8 + 4];
    put_u32(bad_get, 1 + 8 + 4);
    bad_get[4] = 2;
    memset(bad_get + 5, 0, 8);
    put_u32(bad_get + 13, 1000); /* key length beyond the message */
    CHECK_OK(cring__net_send_all(fd, bad_get, sizeof bad_get, cring__now_s() + 5, NULL));
    expect_closed(fd);

    /* 5. Disconnect in the middle of a message. */
    fd = raw_connect();
    CHECK(raw_auth(fd, SECRET) == 0);
    uint8_t partial[15];
    put_u32(partial, 1000);
    partial[4] = 1;
    memset(partial + 5, 0, 10);
    CHECK_OK(cring__net_send_all(fd, partial, sizeof partial, cring__now_s() + 5, NULL));
    close(fd);
    check_server_alive("midmessage");

    /* 6. Silent and half-finished connections stay open while others are served. */
    int silent = raw_connect();
    int slow = raw_connect();
    CHECK(raw_auth(slow, SECRET) == 0);
    uint8_t *chunk = calloc(1, 1u << 20);
    put_u32(chunk, 64u << 20); /* announces 64 MiB, sends 1 MiB */
    chunk[4] = 1;
    CHECK_OK(cring__net_send_all(slow, chunk, 1u << 20, cring__now_s() + 5, NULL));
    free(chunk);
    check_server_alive("slow");
    close(silent);
    close(slow);

    /* 7. Pipelined requests on one raw connection are answered in order. */
    fd = raw_connect();
    CHECK(raw_auth(fd, SECRET) == 0);
    uint8_t pipe_msg[64];
    size_t n = 0;
    put_u32(pipe_msg + n, 1 + 4 + 2 + 3); /* SET "pk" = "val" */
    pipe_msg[n + 4] = 1;
    put_u32(pipe_msg + n + 5, 2);
    memcpy(pipe_msg + n + 9, "pkval", 5);
    n += 14;
    put_u32(pipe_msg + n, 1 + 8 + 4 + 2); /* GET "pk", timeout 1000 ms */
    pipe_msg[n + 4] = 2;
    memset(pipe_msg + n + 5, 0, 8);
    pipe_msg[n + 5] = 0xe8;
    pipe_msg[n + 6] = 0x03;
    put_u32(pipe_msg + n + 13, 2);
    memcpy(pipe_msg + n + 17, "pk", 2);
    n += 19;
    CHECK_OK(cring__net_send_all(fd, pipe_msg, n, cring__now_s() + 5, NULL));
    uint8_t reply[5 + 5 + 3];
    CHECK_OK(cring__net_recv_all(fd, reply, sizeof reply, cring__now_s() + 5, NULL));
    CHECK(reply[0] == 1 && reply[4] == 0); /* SET: ok */
    CHECK(reply[5] == 4 && reply[9] == 0); /* GET: ok + 3 bytes */
    CHECK(memcmp(reply + 10, "val", 3) == 0);
    close(fd);
    check_server_alive("pipelined");
}

static void test_many_clients(void) {
    enum { N = 300 };
    cring_store_t **cs = calloc(N, sizeof *cs);
    for (int i = 0; i < N; i++) cs[i] = client();
    char key[64], val[64];
    for (int i = 0; i < N; i++) {
        snprintf(key, sizeof key, "many/%d", i);
        snprintf(val, sizeof val, "v%d", i);
        CHECK_OK(cring_store_set(cs[i], key, val, strlen(val)));
    }
    for (int i = 0; i < N; i++) {
        int j = (i + 1) % N;
        snprintf(key, sizeof key, "many/%d", j);
        snprintf(val, sizeof val, "v%d", j);
        check_get(cs[i], key, val);
    }
    for (int i = 0; i < N; i++) cring_store_close(cs[i]);
    free(cs);
}

/* Stop with a client blocked in GET: it fails fast, then a new server
 * on the same port works. Also: a client may connect before the server. */
static void test_stop_restart(cring_store_server_t **server) {
    getter_t g = {.key = "never/set", .timeout_s = 30.0};
    pthread_t th;
    CHECK(pthread_create(&th, NULL, getter_main, &g) == 0);
    while (!atomic_load(&g.started)) pause_ms(1);
    pause_ms(100);
    double t0 = cring__now_s();
    cring_store_server_stop(*server);
    *server = NULL;
    pthread_join(th, NULL);
    CHECK(g.st == CRING_ERR_PEER_FAILURE);
    CHECK(cring__now_s() - t0 < 5.0);

    /* Nothing listening: connect times out naming the address. */
    cring_store_t *c = NULL;
    double t1 = cring__now_s();
    CHECK(cring_store_connect("127.0.0.1", g_port, SECRET, 0.3, &c) == CRING_ERR_TIMEOUT);
    CHECK(cring__now_s() - t1 < 3.0);
    char where[64];
    snprintf(where, sizeof where, "127.0.0.1:%d", g_port);
    CHECK(strstr(cring__thread_errmsg()->text, where) != NULL);

    /* Same port again. */
    int port = 0;
    CHECK_OK(cring_store_server_start("127.0.0.1", g_port, SECRET, server, &port));
    CHECK(port == g_port);
    check_server_alive("restarted");
    c = client();
    void *v = NULL;
    size_t n = 0;
    CHECK(cring_store_get(c, "a", 0.1, &v, &n) == CRING_ERR_TIMEOUT); /* fresh table */
    cring_store_close(c);

    /* A client that starts before its server connects once it is up. */
    cring_store_server_t *s2 = NULL;
    int p2 = 0;
    CHECK_OK(cring_store_server_start("127.0.0.1", 0, NULL, &s2, &p2));
    cring_store_server_stop(s2);
    late_connect_t l = {.port = p2};
    CHECK(pthread_create(&th, NULL, late_connect_main, &l) == 0);
    pause_ms(200); /* the client is retrying refused connections meanwhile */
    CHECK_OK(cring_store_server_start("127.0.0.1", p2, NULL, &s2, NULL));
    pthread_join(th, NULL);
    CHECK_OK(l.st);
    cring_store_server_stop(s2);
}

/* net.c helpers the store relies on, and a server bound to every interface. */
static void test_net_helpers(void) {
    char addr[64];
    CHECK_OK(cring__net_local_addr_toward("127.0.0.1", addr, sizeof addr));
    CHECK(strcmp(addr, "127.0.0.1") == 0);
    int fd = -1, port = 0;
    CHECK(cring__net_listen("127.0.0.1", 70000, 4, &fd, &port, NULL) == CRING_ERR_INVALID_ARGUMENT);
    CHECK_OK(cring__net_listen("127.0.0.1", 0, 4, &fd, &port, NULL));
    CHECK(port > 0);
    close(fd); /* now nothing listens there */
    cring__errmsg_t err;
    double t0 = cring__now_s();
    CHECK(cring__net_connect("127.0.0.1", port, t0 + 0.2, &fd, &err) == CRING_ERR_TIMEOUT);
    CHECK(cring__now_s() - t0 < 2.0);

    cring_store_server_t *any = NULL;
    CHECK_OK(cring_store_server_start(NULL, 0, NULL, &any, &port));
    const char *names[] = {"127.0.0.1", "localhost"};
    for (int i = 0; i < 2; i++) {
        cring_store_t *c = NULL;
        CHECK_OK(cring_store_connect(names[i], port, NULL, 5.0, &c));
        CHECK_OK(cring_store_set(c, "k", "v", 1));
        cring_store_close(c);
    }
    cring_store_server_stop(any);
}

int main(void) {
    alarm(120); /* watchdog: the whole program must finish well before this */
    cring_store_server_t *server = NULL;
    CHECK_OK(cring_store_server_start("127.0.0.1", 0, SECRET, &server, &g_port));
    CHECK(g_port > 0);

    test_net_helpers();
    test_basic();
    test_get_before_set();
    test_wait();
    test_concurrent_add();
    test_auth();
    test_get_timeout();
    test_hostile_connections();
    test_many_clients();
    test_stop_restart(&server);

    cring_store_server_stop(server);
    TEST_DONE("test_store");
    return 0;
}

/* test_fuzz.c: a bounded-time fuzz harness for the two things a stranger can
 * reach over the network: the rendezvous store's wire protocol and the TCP
 * transport's connection handshake. Valid messages are mutated (bit flips,
 * truncation, huge lengths, wrong MACs, random bytes), delivered whole, in
 * pieces or slowly, and closed, half-closed or left hanging; after every batch
 * a legitimate client must still be served correctly and quickly. The store
 * runs in a child process (its fd limit lowered for the flood test) so that a
 * crash shows as the child's exit status and LeakSanitizer checks it at exit.
 *
 * CRING_FUZZ_SECONDS (default 3) bounds the run; CRING_FUZZ_SEED=N replays one
 * seed (without it: fixed seeds 1..3, then a random one, printed). */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/auth.h"
#include "common/common.h"
#include "common/net.h"
#include "testutil.h"
#include "transport/transport.h"

#define SECRET "fuzz-secret"
#define MAX_MSG (64u << 20) /* the store's message limit */

/* ---- deterministic random numbers (splitmix64) -------------------------------- */
static uint64_t g_rng;
static uint64_t rnd(void) {
    uint64_t z = (g_rng += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
static uint32_t below(uint32_t n) { return n ? (uint32_t)(rnd() % n) : 0; }
static int chance(int percent) { return (int)below(100) < percent; }
static void rnd_fill(uint8_t *p, size_t n) {
    for (size_t i = 0; i < n; i++) p[i] = (uint8_t)rnd();
}

static void put_u32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static void put_u64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint32_t get_u32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static void pause_ms(int ms) { (void)poll(NULL, 0, ms); }

/* ---- a growable byte buffer ------------------------------------------------------ */
typedef struct buf {
    uint8_t *p;
    size_t len, cap;
} buf_t;

static void buf_reserve(buf_t *b, size_t extra) {
    if (b->cap - b->len >= extra) return;
    size_t want = b->cap ? b->cap * 2 : 256;
    while (want - b->len < extra) want *= 2;
    b->p = realloc(b->p, want);
    CHECK(b->p != NULL);
    b->cap = want;
}
static void buf_add(buf_t *b, const void *data, size_t n) {
    buf_reserve(b, n);
    if (n) memcpy(b->p + b->len, data, n);
    b->len += n;
}
static void buf_u32(buf_t *b, uint32_t v) {
    uint8_t x[4];
    put_u32(x, v);
    buf_add(b, x, 4);
}
static void buf_u64(buf_t *b, uint64_t v) {
    uint8_t x[8];
    put_u64(x, v);
    buf_add(b, x, 8);
}

/* ---- statistics printed at the end ---------------------------------------------- */
static struct {
    long store_cases, store_batches, handshakes_refused, handshakes_accepted, bytes_sent;
    long replies_checked, flood_connections, tcp_rounds, tcp_cases, tcp_refused;
    double worst_liveness_s, silent_strays_mesh_s;
} g_stats;

/* ============================================================================
 * The store under test, in a child process
 * ========================================================================== */
typedef struct store_child {
    pid_t pid;
    int port;
    int control_fd; /* closing it tells the child to stop */
} store_child_t;

/* Fork a child serving the store on 127.0.0.1 (fd limit nofile when > 0). */
static store_child_t start_store_child(long nofile) {
    int to_parent[2], to_child[2];
    CHECK(pipe(to_parent) == 0 && pipe(to_child) == 0);
    pid_t pid = fork();
    CHECK(pid >= 0);
    if (pid == 0) {
        close(to_parent[0]);
        close(to_child[1]);
        alarm(300);
        if (nofile > 0) {
            struct rlimit rl = {.rlim_cur = (rlim_t)nofile, .rlim_max = (rlim_t)nofile};
            if (setrlimit(RLIMIT_NOFILE, &rl) != 0) _exit(3);
        }
        cring_store_server_t *server = NULL;
        int port = 0;
        if (cring_store_server_start("127.0.0.1", 0, SECRET, &server, &port) != CRING_OK) _exit(4);
        if (write(to_parent[1], &port, sizeof port) != (ssize_t)sizeof port) _exit(5);
        close(to_parent[1]);
        char c;
        while (read(to_child[0], &c, 1) != 0) { /* wait for EOF */
        }
        cring_store_server_stop(server);
        close(to_child[0]);
        exit(0); /* through exit(): LeakSanitizer checks the server's memory */
    }
    close(to_parent[1]);
    close(to_child[0]);
    store_child_t s = {.pid = pid, .port = 0, .control_fd = to_child[1]};
    CHECK(read(to_parent[0], &s.port, sizeof s.port) == (ssize_t)sizeof s.port);
    close(to_parent[0]);
    CHECK(s.port > 0);
    return s;
}

/* The store must still be running (not crashed) right now. */
static void check_store_running(const store_child_t *s) {
    int status = 0;
    pid_t r = waitpid(s->pid, &status, WNOHANG);
    if (r != 0) fprintf(stderr, "store child died (status 0x%x)\n", status);
    CHECK(r == 0);
}

static void stop_store_child(store_child_t *s) {
    close(s->control_fd);
    int status = 0;
    CHECK(waitpid(s->pid, &status, 0) == s->pid);
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
        fprintf(stderr, "store child exited with status 0x%x\n", status);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
}

/* ---- raw connections ------------------------------------------------------------ */
static int raw_connect(int port) {
    int fd = -1;
    cring__errmsg_t err;
    cring_status_t st = cring__net_connect("127.0.0.1", port, cring__now_s() + 5, &fd, &err);
    if (st != CRING_OK) fprintf(stderr, "raw connect failed: %s\n", err.text);
    CHECK(st == CRING_OK);
    return fd;
}

/* Send, ignoring a peer that closed or stopped reading (the fuzz input may
 * well have made it do that). Returns 0 when everything went out. */
static int send_some(int fd, const uint8_t *p, size_t n, double timeout_s) {
    cring__errmsg_t err;
    g_stats.bytes_sent += (long)n;
    return cring__net_send_all(fd, p, n, cring__now_s() + timeout_s, &err) == CRING_OK ? 0 : -1;
}

/* Read until EOF, reset or timeout; returns the bytes (b) and 1 when the
 * stream ended (EOF or reset), 0 on timeout. */
static int drain(int fd, buf_t *b, double timeout_s) {
    double deadline = cring__now_s() + timeout_s;
    for (;;) {
        buf_reserve(b, 65536);
        ssize_t r = recv(fd, b->p + b->len, 65536, MSG_DONTWAIT);
        if (r > 0) {
            b->len += (size_t)r;
            continue;
        }
        if (r == 0) return 1;
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) return 1; /* ECONNRESET */
        double left = deadline - cring__now_s();
        if (left <= 0) return 0;
        struct pollfd p = {.fd = fd, .events = POLLIN};
        (void)poll(&p, 1, (int)(left * 1000) + 1);
    }
}

/* Read the server's hello; returns 0 and the nonce, or -1 if it never came. */
static int read_hello(int fd, uint8_t nonce[CRING__NONCE_BYTES]) {
    uint8_t hello[4 + CRING__NONCE_BYTES];
    cring__errmsg_t err;
    if (cring__net_recv_all(fd, hello, sizeof hello, cring__now_s() + 5, &err) != CRING_OK)
        return -1;
    CHECK(memcmp(hello, "CRS1", 4) == 0);
    memcpy(nonce, hello + 4, CRING__NONCE_BYTES);
    return 0;
}

/* Connect and authenticate; returns the fd (the status byte was 0). */
static int authed_connect(int port) {
    int fd = raw_connect(port);
    uint8_t nonce[CRING__NONCE_BYTES], answer[36], status = 0xff;
    CHECK(read_hello(fd, nonce) == 0);
    memcpy(answer, "CRS1", 4);
    cring__auth_response(SECRET, nonce, answer + 4);
    CHECK(send_some(fd, answer, sizeof answer, 5) == 0);
    cring__errmsg_t err;
    CHECK(cring__net_recv_all(fd, &status, 1, cring__now_s() + 5, &err) == CRING_OK);
    CHECK(status == 0);
    return fd;
}

/* ---- the legitimate client: correct answers, quickly ------------------------------ */
static void check_liveness(int port, const char *after) {
    static long round, served; /* served: liveness checks on this store */
    static int last_port;
    if (port != last_port) served = 0;
    last_port = port;
    round++;
    served++;
    double t0 = cring__now_s();
    cring_store_t *c = NULL;
    cring_status_t st = cring_store_connect("127.0.0.1", port, SECRET, 10.0, &c);
    if (st != CRING_OK)
        fprintf(stderr, "after %s: legitimate client cannot connect: %s\n", after,
                cring__thread_errmsg()->text);
    CHECK(st == CRING_OK);
    char key[96], val[64];
    snprintf(key, sizeof key, "live/%ld", round);
    int n = snprintf(val, sizeof val, "value-%ld-%" PRIu64, round, rnd());
    CHECK_OK(cring_store_set(c, key, val, (size_t)n));
    void *v = NULL;
    size_t len = 0;
    CHECK_OK(cring_store_get(c, key, 5.0, &v, &len));
    CHECK(len == (size_t)n && memcmp(v, val, len) == 0);
    free(v);
    int64_t counter = 0;
    CHECK_OK(cring_store_add(c, "live/counter", 1, &counter));
    CHECK(counter == served);
    const char *keys[] = {key, "live/counter"};
    CHECK_OK(cring_store_wait(c, keys, 2, 5.0));
    CHECK(cring_store_get(c, "live/never-set", 0, &v, &len) == CRING_ERR_TIMEOUT);
    cring_store_close(c);
    double took = cring__now_s() - t0;
    if (took > g_stats.worst_liveness_s) g_stats.worst_liveness_s = took;
    if (took > 2.0)
        fprintf(stderr, "after %s: the store took %.2f s to serve a client\n", after, took);
    CHECK(took < 2.0);
}

/* ---- valid requests and their mutations ------------------------------------------- */
enum { OP_SET = 1, OP_GET = 2, OP_ADD = 3, OP_WAIT = 4 };

static void rnd_key(char *key, size_t cap, size_t *len) {
    /* Mostly a small shared key space (so sets, gets and waits meet), sometimes
     * long or binary keys. */
    if (chance(80)) {
        *len = (size_t)snprintf(key, cap, "fz/%u", below(16));
    } else {
        *len = below(chance(50) ? 64 : (uint32_t)cap);
        rnd_fill((uint8_t *)key, *len);
    }
}

/* Append one valid request to b. Timeouts stay short unless fuzzed. */
static void gen_request(buf_t *b) {
    char key[4096];
    size_t klen;
    size_t start = b->len;
    buf_u32(b, 0); /* length, patched below */
    switch (below(4)) {
    case 0: {
        uint8_t op = OP_SET;
        buf_add(b, &op, 1);
        rnd_key(key, sizeof key, &klen);
        buf_u32(b, (uint32_t)klen);
        buf_add(b, key, klen);
        size_t vlen = chance(90) ? below(64) : below(200000);
        buf_reserve(b, vlen);
        rnd_fill(b->p + b->len, vlen);
        b->len += vlen;
        break;
    }
    case 1: {
        uint8_t op = OP_GET;
        buf_add(b, &op, 1);
        buf_u64(b, below(30));
        rnd_key(key, sizeof key, &klen);
        buf_u32(b, (uint32_t)klen);
        buf_add(b, key, klen);
        break;
    }
    case 2: {
        uint8_t op = OP_ADD;
        buf_add(b, &op, 1);
        rnd_key(key, sizeof key, &klen);
        buf_u32(b, (uint32_t)klen);
        buf_add(b, key, klen);
        buf_u64(b, rnd());
        break;
    }
    default: {
        uint8_t op = OP_WAIT;
        buf_add(b, &op, 1);
        buf_u64(b, below(30));
        uint32_t nkeys = below(5);
        buf_u32(b, nkeys);
        for (uint32_t i = 0; i < nkeys; i++) {
            rnd_key(key, sizeof key, &klen);
            buf_u32(b, (uint32_t)klen);
            buf_add(b, key, klen);
        }
        break;
    }
    }
    put_u32(b->p + start, (uint32_t)(b->len - start - 4));
}

/* Lengths that sit on or around the limits of the protocol. */
static uint32_t interesting_u32(uint32_t around) {
    static const uint32_t special[] = {
        0,     1,     2,           4,       5,           4095,        4096,        4097,
        65535, 65536, MAX_MSG - 1, MAX_MSG, MAX_MSG + 1, 0x7fffffffu, 0x80000000u, 0xffffffffu};
    switch (below(3)) {
    case 0: return special[below(sizeof special / sizeof special[0])];
    case 1: return around + below(5) - 2;
    default: return (uint32_t)rnd();
    }
}

/* Apply 1..4 random mutations to b[from..). */
static void mutate(buf_t *b, size_t from) {
    int n = 1 + (int)below(4);
    for (int k = 0; k < n; k++) {
        size_t len = b->len - from;
        uint8_t *p = b->p + from;
        switch (below(9)) {
        case 0: /* flip one bit */
            if (len) p[below((uint32_t)len)] ^= (uint8_t)(1u << below(8));
            break;
        case 1: /* set one byte */
            if (len) p[below((uint32_t)len)] = (uint8_t)rnd();
            break;
        case 2: /* truncate */ b->len = from + below((uint32_t)len + 1); break;
        case 3: { /* append random bytes */
            size_t extra = 1 + below(64);
            buf_reserve(b, extra);
            rnd_fill(b->p + b->len, extra);
            b->len += extra;
            break;
        }
        case 4: /* a length field (message or key) set to an interesting value */
            if (len >= 4) {
                size_t at = chance(50) ? 0 : below((uint32_t)(len - 3));
                put_u32(p + at, interesting_u32(get_u32(p + at)));
            }
            break;
        case 5: /* an opcode that does not exist, or another one */
            if (len >= 5) p[4] = chance(50) ? (uint8_t)rnd() : (uint8_t)(1 + below(4));
            break;
        case 6: { /* insert random bytes in the middle */
            size_t at = below((uint32_t)len + 1), extra = 1 + below(16);
            buf_reserve(b, extra);
            p = b->p + from;
            memmove(p + at + extra, p + at, len - at);
            rnd_fill(p + at, extra);
            b->len += extra;
            break;
        }
        case 7: /* a huge timeout (the request then waits until the key exists) */
            if (len >= 13 && (p[4] == OP_GET || p[4] == OP_WAIT)) put_u64(p + 5, rnd());
            break;
        default: /* replace everything with random bytes */
            b->len = from;
            {
                size_t r = below(chance(80) ? 64 : 8192);
                buf_reserve(b, r);
                rnd_fill(b->p + b->len, r);
                b->len += r;
            }
            break;
        }
    }
}

/* Every complete reply frame the server sent must be well formed. */
static void check_replies(const buf_t *b) {
    size_t off = 0;
    while (b->len - off >= 5) {
        uint32_t len = get_u32(b->p + off);
        uint8_t status = b->p[off + 4];
        if (len < 1 || len > MAX_MSG || status > 3)
            fprintf(stderr, "malformed reply frame: len %u status %u\n", len, status);
        CHECK(len >= 1 && len <= MAX_MSG && status <= 3);
        if (b->len - off < 4 + (size_t)len) break; /* cut short when the server closed */
        off += 4 + (size_t)len;
        g_stats.replies_checked++;
    }
}

/* Deliver data on fd whole, in random pieces, or slowly (a slowloris). */
static void deliver(int fd, const uint8_t *p, size_t n) {
    int mode = (int)below(10);
    if (mode < 6 || n == 0) {
        (void)send_some(fd, p, n, 0.5);
        return;
    }
    size_t off = 0;
    while (off < n) {
        size_t piece = mode < 9 ? 1 + below(64) : 1;
        if (piece > n - off) piece = n - off;
        if (send_some(fd, p + off, piece, 0.5) != 0) return;
        off += piece;
        if (mode == 9 && chance(30)) pause_ms(1);
        if (mode == 9 && off > 32) { /* slow for a while, then the rest at once */
            (void)send_some(fd, p + off, n - off, 0.5);
            return;
        }
    }
}

/* Connections deliberately left open across cases (idle, mid-message,
 * waiting on keys that never appear); closed at the end of the batch. */
#define MAX_HELD 64
static int g_held[MAX_HELD];
static int g_nheld;

static void finish_connection(int fd, int may_hold) {
    int how = (int)below(10);
    if (may_hold && how == 0 && g_nheld < MAX_HELD) {
        g_held[g_nheld++] = fd;
        return;
    }
    if (how <= 4) { /* half-close and read what comes back */
        buf_t replies = {0};
        shutdown(fd, SHUT_WR);
        (void)drain(fd, &replies, 2.0);
        check_replies(&replies);
        free(replies.p);
    }
    close(fd); /* or just drop it */
}

static void release_held(void) {
    for (int i = 0; i < g_nheld; i++) close(g_held[i]);
    g_nheld = 0;
}

/* One fuzz case against the handshake: the answer to the nonce is mutated,
 * replayed, made with a wrong secret, or random. Expect status 1 then close
 * for any complete wrong answer, status 0 for an intact one. */
static void fuzz_handshake_case(int port, uint8_t last_answer[36]) {
    int fd = raw_connect(port);
    uint8_t nonce[CRING__NONCE_BYTES];
    if (read_hello(fd, nonce) != 0) {
        close(fd);
        return;
    }
    uint8_t valid[36];
    memcpy(valid, "CRS1", 4);
    cring__auth_response(SECRET, nonce, valid + 4);
    buf_t b = {0};
    switch (below(6)) {
    case 0: /* a replayed answer from an earlier connection */ buf_add(&b, last_answer, 36); break;
    case 1: { /* the right protocol, the wrong secret */
        uint8_t wrong[36];
        memcpy(wrong, "CRS1", 4);
        char secret[32];
        snprintf(secret, sizeof secret, "guess-%u", below(1000));
        cring__auth_response(chance(20) ? NULL : secret, nonce, wrong + 4);
        buf_add(&b, wrong, 36);
        break;
    }
    case 2: /* random bytes */
        b.len = 0;
        buf_reserve(&b, 100);
        b.len = below(100);
        rnd_fill(b.p, b.len);
        break;
    default: /* the valid answer, mutated, maybe followed by requests */
        buf_add(&b, valid, 36);
        if (chance(30)) gen_request(&b);
        mutate(&b, 0);
        break;
    }
    memcpy(last_answer, valid, 36);
    int intact = b.len >= 36 && memcmp(b.p, valid, 36) == 0;
    deliver(fd, b.p, b.len);
    if (b.len >= 36 && intact) {
        /* The intact answer is accepted (whatever follows it). */
        uint8_t verdict = 0xff;
        cring__errmsg_t err;
        CHECK_OK(cring__net_recv_all(fd, &verdict, 1, cring__now_s() + 5, &err));
        CHECK(verdict == 0);
        g_stats.handshakes_accepted++;
    } else if (b.len >= 36) {
        /* A wrong complete answer gets the refusal byte (unless a reset
         * overtakes it), then the connection is closed. */
        buf_t reply = {0};
        shutdown(fd, SHUT_WR);
        int ended = drain(fd, &reply, 5.0);
        if (!ended) fprintf(stderr, "a refused connection was not closed\n");
        CHECK(ended);
        CHECK(reply.len <= 1); /* nothing but the verdict */
        if (reply.len == 1) {
            CHECK(reply.p[0] == 1);
            g_stats.handshakes_refused++;
        }
        free(reply.p);
    }
    free(b.p);
    finish_connection(fd, 1);
}

/* One fuzz case against requests on an authenticated connection. */
static void fuzz_request_case(int port) {
    int fd = authed_connect(port);
    buf_t b = {0};
    int nreq = 1 + (int)below(5);
    for (int i = 0; i < nreq; i++) {
        size_t start = b.len;
        gen_request(&b);
        if (chance(35)) mutate(&b, start);
    }
    deliver(fd, b.p, b.len);
    free(b.p);
    finish_connection(fd, 1);
}

/* Oversized and lying lengths: the server must refuse, or read and discard,
 * without running out of memory or stalling others. */
static void fuzz_oversized_case(int port) {
    int fd;
    uint8_t head[5];
    switch (below(4)) {
    case 0: /* over the limit: closed at once */
        fd = authed_connect(port);
        put_u32(head, MAX_MSG + 1 + below(1000000));
        head[4] = OP_SET;
        (void)send_some(fd, head, 5, 1);
        {
            buf_t r = {0};
            CHECK(drain(fd, &r, 3.0) == 1);
            CHECK(r.len == 0);
            free(r.p);
        }
        close(fd);
        break;
    case 1: { /* announces the maximum, sends a megabyte, then stops or leaves */
        fd = authed_connect(port);
        size_t n = 1u << 20;
        uint8_t *m = calloc(1, n);
        CHECK(m != NULL);
        put_u32(m, MAX_MSG);
        m[4] = OP_SET;
        (void)send_some(fd, m, n, 2);
        free(m);
        finish_connection(fd, 1);
        break;
    }
    case 2: { /* unauthenticated megabyte of garbage: refused, not buffered */
        fd = raw_connect(port);
        uint8_t nonce[CRING__NONCE_BYTES];
        if (read_hello(fd, nonce) == 0) {
            size_t n = 1u << 20;
            uint8_t *m = malloc(n);
            CHECK(m != NULL);
            rnd_fill(m, n);
            memcpy(m, "CRS1", 4);
            (void)send_some(fd, m, n, 2); /* the server closes part way */
            free(m);
            buf_t r = {0};
            CHECK(drain(fd, &r, 3.0) == 1);
            CHECK(r.len <= 1 && (r.len == 0 || r.p[0] == 1));
            free(r.p);
        }
        close(fd);
        break;
    }
    default: { /* a key length past the end of the message */
        fd = authed_connect(port);
        buf_t b = {0};
        uint8_t op = chance(50) ? OP_GET : OP_WAIT;
        buf_u32(&b, op == OP_GET ? 1 + 8 + 4 : 1 + 8 + 4 + 4);
        buf_add(&b, &op, 1);
        buf_u64(&b, 10);
        if (op == OP_WAIT) buf_u32(&b, 1 + below(3)); /* nkeys */
        uint32_t klen = interesting_u32(100);
        buf_u32(&b, klen ? klen : 1);
        (void)send_some(fd, b.p, b.len, 1);
        free(b.p);
        buf_t r = {0};
        CHECK(drain(fd, &r, 3.0) == 1); /* malformed: closed */
        check_replies(&r);
        free(r.p);
        close(fd);
        break;
    }
    }
}

/* A batch of mixed cases, then the liveness check. */
static void fuzz_store_batch(const store_child_t *s, int cases) {
    static uint8_t last_answer[36];
    for (int i = 0; i < cases; i++) {
        int kind = (int)below(10);
        if (kind < 3) fuzz_handshake_case(s->port, last_answer);
        else if (kind < 9) fuzz_request_case(s->port);
        else fuzz_oversized_case(s->port);
        g_stats.store_cases++;
    }
    check_store_running(s);
    check_liveness(s->port, "a fuzz batch");
    release_held();
    g_stats.store_batches++;
}

/* A slowloris while a legitimate client works: requests trickle in a byte at
 * a time on one connection while others are served at full speed. */
static void slowloris_while_serving(const store_child_t *s) {
    int slow = authed_connect(s->port);
    buf_t b = {0};
    for (int i = 0; i < 3; i++) gen_request(&b);
    for (size_t i = 0; i < b.len && i < 200; i++) {
        (void)send_some(slow, b.p + i, 1, 0.5);
        if (i % 50 == 0) check_liveness(s->port, "a slowloris byte");
    }
    free(b.p);
    close(slow);
}

/* Many connections at once: silent ones, ones that stop mid-handshake, and
 * authenticated ones waiting forever on a key; the store keeps serving. With
 * the store's fd limit low, the silent ones must not lock legitimate clients
 * out (the store drops the oldest unauthenticated connections). */
static void flood(const store_child_t *s, int n, const char *what) {
    int *fds = calloc((size_t)n, sizeof *fds);
    CHECK(fds != NULL);
    for (int i = 0; i < n; i++) {
        fds[i] = raw_connect(s->port);
        if (i % 3 == 1) (void)send_some(fds[i], (const uint8_t *)"CRS1", 4, 0.5); /* stalls */
    }
    g_stats.flood_connections += n;
    check_store_running(s);
    check_liveness(s->port, what);
    /* Authenticated waiters on keys that never appear, with huge timeouts. */
    int waiters[8];
    for (int i = 0; i < 8; i++) {
        waiters[i] = authed_connect(s->port);
        buf_t b = {0};
        buf_u32(&b, 0);
        uint8_t op = OP_GET;
        buf_add(&b, &op, 1);
        buf_u64(&b, ~0ull);
        buf_u32(&b, 9);
        buf_add(&b, "fz/never!", 9);
        put_u32(b.p, (uint32_t)(b.len - 4));
        CHECK(send_some(waiters[i], b.p, b.len, 1) == 0);
        free(b.p);
    }
    check_liveness(s->port, "forever-waiters");
    for (int i = 0; i < 8; i++) close(waiters[i]);
    for (int i = 0; i < n; i++) close(fds[i]);
    check_liveness(s->port, "the flood closed");
    free(fds);
}

static void fuzz_store(double seconds) {
    store_child_t s = start_store_child(0);
    double end = cring__now_s() + seconds;
    int batches = 0;
    do {
        fuzz_store_batch(&s, 40);
        batches++;
    } while (cring__now_s() < end || batches < 3);
    slowloris_while_serving(&s);
    flood(&s, 300, "300 idle connections");
    stop_store_child(&s);

    /* A store that can hold few descriptors, flooded past that limit. */
    store_child_t small = start_store_child(64);
    flood(&small, 150, "a flood past the store's fd limit");
    fuzz_store_batch(&small, 20);
    stop_store_child(&small);
}

/* ============================================================================
 * The TCP transport's handshake: a rank accepting its peers is sent mutated
 * answers before the real peer connects; all are refused, then the mesh forms.
 * ========================================================================== */
#define TCP_ANSWER 48

static void tcp_rank(int rank, int port, const char *prefix) {
    alarm(120);
    cring_store_t *store = NULL;
    if (cring_store_connect("127.0.0.1", port, SECRET, 20.0, &store) != CRING_OK) _exit(10);
    if (rank == 0) { /* the real peer connects only after the fuzzing */
        char go[128];
        snprintf(go, sizeof go, "%s/go", prefix);
        const char *keys[] = {go};
        if (cring_store_wait(store, keys, 1, 60.0) != CRING_OK) _exit(11);
    }
    cring__errmsg_t err = {{0}};
    cring__transport_init_t init = {.rank = rank,
                                    .size = 2,
                                    .store = store,
                                    .key_prefix = prefix,
                                    .listen_addr = "127.0.0.1",
                                    .secret = SECRET,
                                    .timeout_s = 60.0,
                                    .err = &err};
    cring__p2p_t *p2p = NULL;
    if (cring__tcp_create(&init, &p2p) != CRING_OK) {
        fprintf(stderr, "rank %d: tcp_create failed: %s\n", rank, err.text);
        _exit(12);
    }
    size_t n = 1u << 20;
    uint8_t *sb = malloc(n), *rb = malloc(n);
    if (!sb || !rb) _exit(13);
    for (size_t i = 0; i < n; i++) sb[i] = (uint8_t)(i * 7 + (size_t)rank);
    if (p2p->ops->sendrecv(p2p, 1 - rank, sb, n, 1 - rank, rb, n) != CRING_OK) {
        fprintf(stderr, "rank %d: exchange failed: %s\n", rank, err.text);
        _exit(14);
    }
    for (size_t i = 0; i < n; i++)
        if (rb[i] != (uint8_t)(i * 7 + (size_t)(1 - rank))) _exit(15);
    free(sb);
    free(rb);
    p2p->ops->destroy(p2p);
    cring_store_close(store);
    exit(0);
}

/* One connection to the accepting rank with a wrong answer. */
static void tcp_fuzz_case(const char *host, int port) {
    int fd = -1;
    cring__errmsg_t err;
    CHECK_OK(cring__net_connect(host, port, cring__now_s() + 5, &fd, &err));
    g_stats.tcp_cases++;
    int kind = (int)below(8);
    if (kind == 0) { /* connect and leave at once (a port scan) */
        close(fd);
        return;
    }
    uint8_t hello[4 + CRING__NONCE_BYTES];
    if (cring__net_recv_all(fd, hello, sizeof hello, cring__now_s() + 5, &err) != CRING_OK) {
        close(fd);
        return;
    }
    CHECK(memcmp(hello, "CRT1", 4) == 0);
    uint8_t valid[TCP_ANSWER];
    memcpy(valid, "CRT1", 4);
    put_u32(valid + 4, 0);  /* from rank 0 */
    put_u32(valid + 8, 1);  /* to rank 1 */
    put_u32(valid + 12, 2); /* world size 2 */
    cring__auth_response(SECRET, hello + 4, valid + 16);
    buf_t b = {0};
    if (kind == 1) { /* wrong secret */
        buf_add(&b, valid, TCP_ANSWER);
        cring__auth_response("not-the-secret", hello + 4, b.p + 16);
    } else if (kind == 2) { /* ranks or size that do not fit, with a valid MAC */
        buf_add(&b, valid, TCP_ANSWER);
        static const uint32_t odd[] = {1, 2, 3, 7, 0x7fffffffu, 0x80000000u, 0xffffffffu};
        put_u32(b.p + 4 + 4 * below(3), odd[below(7)]);
    } else if (kind == 3) { /* random bytes, maybe long */
        b.len = 0;
        size_t n = chance(80) ? below(100) : 100000;
        buf_reserve(&b, n);
        rnd_fill(b.p, n);
        b.len = n;
    } else {
        buf_add(&b, valid, TCP_ANSWER);
        mutate(&b, 0);
    }
    if (b.len >= TCP_ANSWER && memcmp(b.p, valid, TCP_ANSWER) == 0) b.p[16] ^= 1; /* never valid */
    if (b.len >= TCP_ANSWER) {
        /* With from=0,to=1,size=2 but another field changed it is still wrong. */
        uint32_t from = get_u32(b.p + 4), to = get_u32(b.p + 8), size = get_u32(b.p + 12);
        if (memcmp(b.p + 16, valid + 16, 32) == 0 && memcmp(b.p, "CRT1", 4) == 0 && from == 0 &&
            to == 1 && size == 2)
            b.p[20] ^= 0x80;
    }
    deliver(fd, b.p, b.len);
    if (b.len < TCP_ANSWER) {
        close(fd); /* incomplete: the rank must drop it when we leave */
        free(b.p);
        return;
    }
    buf_t reply = {0};
    int ended = drain(fd, &reply, 5.0);
    CHECK(ended);
    CHECK(reply.len <= 1);
    if (reply.len == 1) {
        CHECK(reply.p[0] != 0);
        g_stats.tcp_refused++;
    }
    free(reply.p);
    free(b.p);
    close(fd);
}

/* Stray connections that connect and then say nothing (or stop half way
 * through the answer) while the real peer arrives: the accepting rank must
 * not serve them one at a time, each for its handshake time-out. The mesh
 * forms within a couple of seconds, with the strays still open. */
static void tcp_silent_strays(const store_child_t *s, cring_store_t *store) {
    const char *prefix = "fuzz/tcp/silent";
    pid_t pids[2];
    for (int r = 1; r >= 0; r--) {
        pids[r] = fork();
        CHECK(pids[r] >= 0);
        if (pids[r] == 0) tcp_rank(r, s->port, prefix);
    }
    void *v = NULL;
    size_t len = 0;
    CHECK_OK(cring_store_get(store, "fuzz/tcp/silent/tcp/1", 30.0, &v, &len));
    char host[64];
    char *colon = memchr(v, ':', len);
    CHECK(colon != NULL && (size_t)(colon - (char *)v) < sizeof host);
    memcpy(host, v, (size_t)(colon - (char *)v));
    host[colon - (char *)v] = '\0';
    int port = atoi(colon + 1);
    free(v);
    int strays[8];
    for (int i = 0; i < 8; i++) {
        cring__errmsg_t err;
        CHECK_OK(cring__net_connect(host, port, cring__now_s() + 5, &strays[i], &err));
        if (i % 2) (void)send_some(strays[i], (const uint8_t *)"CRT1\0\0", 6, 0.5);
    }
    double t0 = cring__now_s();
    CHECK_OK(cring_store_set(store, "fuzz/tcp/silent/go", "", 0));
    for (int r = 0; r < 2; r++) {
        int status = 0;
        CHECK(waitpid(pids[r], &status, 0) == pids[r]);
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
            fprintf(stderr, "silent strays: rank %d failed (status 0x%x)\n", r, status);
        CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    }
    double took = cring__now_s() - t0;
    if (took > 5.0) fprintf(stderr, "8 silent strays delayed the mesh by %.1f s\n", took);
    CHECK(took < 5.0); /* each used to cost its 10 s handshake time-out */
    if (took > g_stats.silent_strays_mesh_s) g_stats.silent_strays_mesh_s = took;
    for (int i = 0; i < 8; i++) close(strays[i]);
    g_stats.tcp_cases += 8;
}

static void fuzz_tcp(double seconds) {
    store_child_t s = start_store_child(0);
    cring_store_t *store = NULL;
    CHECK_OK(cring_store_connect("127.0.0.1", s.port, SECRET, 10.0, &store));
    double end = cring__now_s() + seconds;
    int round = 0;
    do {
        char prefix[64];
        snprintf(prefix, sizeof prefix, "fuzz/tcp/%d", round);
        pid_t pids[2];
        for (int r = 1; r >= 0; r--) {
            pids[r] = fork();
            CHECK(pids[r] >= 0);
            if (pids[r] == 0) tcp_rank(r, s.port, prefix);
        }
        char key[128];
        snprintf(key, sizeof key, "%s/tcp/1", prefix);
        void *v = NULL;
        size_t len = 0;
        CHECK_OK(cring_store_get(store, key, 30.0, &v, &len));
        char host[64];
        char *colon = memchr(v, ':', len);
        CHECK(colon != NULL && (size_t)(colon - (char *)v) < sizeof host);
        memcpy(host, v, (size_t)(colon - (char *)v));
        host[colon - (char *)v] = '\0';
        int port = atoi(colon + 1);
        free(v);
        for (int i = 0; i < 25; i++) tcp_fuzz_case(host, port);
        snprintf(key, sizeof key, "%s/go", prefix);
        CHECK_OK(cring_store_set(store, key, "", 0));
        for (int r = 0; r < 2; r++) {
            int status = 0;
            CHECK(waitpid(pids[r], &status, 0) == pids[r]);
            if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
                fprintf(stderr, "tcp round %d: rank %d failed (status 0x%x)\n", round, r, status);
            CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
        }
        round++;
        g_stats.tcp_rounds++;
    } while (cring__now_s() < end || round < 2);
    tcp_silent_strays(&s, store);
    cring_store_close(store);
    stop_store_child(&s);
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    setenv("CRING_LOG_LEVEL", "error", 0); /* refusals are expected: do not log each */
    double seconds = cring__env_double("CRING_FUZZ_SECONDS", 3.0);
    if (!(seconds > 0)) seconds = 3.0;
    alarm((unsigned)(seconds * 3) + 240); /* watchdog */
    const char *seed_env = getenv("CRING_FUZZ_SEED");
    uint64_t seeds[4] = {1, 2, 3, 0};
    int nseeds = 4;
    if (seed_env && *seed_env) {
        seeds[0] = strtoull(seed_env, NULL, 0);
        nseeds = 1;
    } else {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        seeds[3] = (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 20) ^ (uint64_t)getpid();
    }
    double t0 = cring__now_s();
    for (int i = 0; i < nseeds; i++) {
        printf("seed %" PRIu64 " (replay with CRING_FUZZ_SEED=%" PRIu64 ")\n", seeds[i], seeds[i]);
        fflush(stdout);
        g_rng = seeds[i];
        fuzz_store(seconds * 0.6 / nseeds);
        fuzz_tcp(seconds * 0.4 / nseeds);
    }
    printf("store: %ld cases in %ld batches (%ld handshakes refused, %ld accepted, %ld reply "
           "frames checked, %ld flood connections, %.1f MB sent); worst legitimate client "
           "%.3f s\n",
           g_stats.store_cases, g_stats.store_batches, g_stats.handshakes_refused,
           g_stats.handshakes_accepted, g_stats.replies_checked, g_stats.flood_connections,
           (double)g_stats.bytes_sent / 1e6, g_stats.worst_liveness_s);
    printf("tcp: %ld rounds, %ld stray connections (%ld refused with a verdict, the rest "
           "dropped); every mesh formed and exchanged 1 MiB intact; with 8 silent strays "
           "open the mesh formed in %.2f s\n",
           g_stats.tcp_rounds, g_stats.tcp_cases, g_stats.tcp_refused,
           g_stats.silent_strays_mesh_s);
    printf("fuzzing took %.1f s\n", cring__now_s() - t0);
    TEST_DONE("test_fuzz");
    return 0;
}

/* store_server.c: the rendezvous store's server: one poll() thread serving
 * every connection (handshake, set/get/add/wait, deferred replies, time-outs)
 * over a hash table. It never blocks on one connection and never trusts a
 * length; the message layout is store_protocol.c's. */
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include "../common/auth.h"
#include "../common/common.h"
#include "../common/net.h"
#include "store_protocol.h"
#include "store_table.h"

/* An unauthenticated connection must finish the handshake within this. */
#define SERVER_HANDSHAKE_TIMEOUT_S 60.0
/* Stop handling a connection's requests while this much output is queued. */
#define SERVER_OUT_BACKLOG_BYTES (4u << 20)
/* Read at most this much from one connection per loop turn (fairness). */
#define SERVER_READ_BUDGET_BYTES (4u << 20)
#define SERVER_READ_CHUNK_BYTES (64u << 10)
/* Buffers above this size are freed when they drain. */
#define SERVER_KEEP_BUFFER_BYTES (1u << 20)

/* ---- connections ---------------------------------------------------------- */
typedef enum conn_state {
    CONN_HANDSHAKE = 0, /* hello sent, waiting for the client's answer */
    CONN_READY = 1,     /* authenticated: serving requests */
    CONN_CLOSING = 2    /* refused: flush the status byte, then close */
} conn_state_t;

typedef struct conn {
    int fd;
    conn_state_t state;
    int dead; /* close at the end of this loop turn */
    uint8_t nonce[CRING__NONCE_BYTES];
    double handshake_deadline;
    /* Unconsumed input is in[in_off .. in_len). */
    uint8_t *in;
    size_t in_off, in_len, in_cap;
    /* Unsent output is out[out_off .. out_len). */
    uint8_t *out;
    size_t out_off, out_len, out_cap;
    /* The request at the head of the input is a GET/WAIT waiting for keys. */
    int waiting;
    double wait_deadline;
} conn_t;

struct cring_store_server {
    int listen_fd;
    int wake_fd; /* eventfd: any write means "stop" */
    pthread_t thread;
    int thread_started;
    char *secret;
    int port;
    cring__kv_table_t table;
    conn_t **conns;
    size_t nconns, conns_cap;
    struct pollfd *pfds;
    size_t pfds_cap;
    double listen_paused_until; /* back off accept() after EMFILE and friends */
    /* Rate limit for warnings a stranger can trigger (see server_warn). */
    double warn_window_start;
    int warn_in_window;
    long warn_suppressed;
    int keys_created; /* a new key appeared this turn: retry waiters */
};

/* Warnings about refused or malformed connections, at most
 * SERVER_WARN_BURST per SERVER_WARN_WINDOW_S, then one line with the count
 * held back: a port scanner or a fuzzer must not flood the job's log.
 * Server thread only. */
#define SERVER_WARN_BURST 5
#define SERVER_WARN_WINDOW_S 10.0
static void server_warn(cring_store_server_t *s, const char *fmt, ...)
    __attribute__((format(printf, 2, 3)));
static void server_warn(cring_store_server_t *s, const char *fmt, ...) {
    if (!cring__log_enabled(CRING__LOG_WARNING)) return;
    double now = cring__now_s();
    if (now - s->warn_window_start >= SERVER_WARN_WINDOW_S) {
        if (s->warn_suppressed > 0)
            cring__log(CRING__LOG_WARNING, -1,
                       "store: %ld more refused, malformed or evicted connections in the "
                       "last %.0f s",
                       s->warn_suppressed, now - s->warn_window_start);
        s->warn_window_start = now;
        s->warn_in_window = 0;
        s->warn_suppressed = 0;
    }
    if (s->warn_in_window >= SERVER_WARN_BURST) {
        s->warn_suppressed++;
        return;
    }
    s->warn_in_window++;
    char line[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    int last = s->warn_in_window == SERVER_WARN_BURST;
    cring__log(CRING__LOG_WARNING, -1, "%s%s", line,
               last ? " (further such warnings are only counted)" : "");
}

static void conn_free(conn_t *c) {
    if (!c) return;
    if (c->fd >= 0) close(c->fd);
    free(c->in);
    free(c->out);
    free(c);
}

static size_t conn_out_pending(const conn_t *c) { return c->out_len - c->out_off; }

/* Reserve room for extra bytes at the end of the output buffer. */
static int conn_out_reserve(conn_t *c, size_t extra) {
    if (c->out_off == c->out_len) c->out_off = c->out_len = 0;
    if (c->out_cap - c->out_len >= extra) return 0;
    if (c->out_off > 0) { /* compact first */
        memmove(c->out, c->out + c->out_off, c->out_len - c->out_off);
        c->out_len -= c->out_off;
        c->out_off = 0;
        if (c->out_cap - c->out_len >= extra) return 0;
    }
    size_t want = CRING_MAX(c->out_cap * 2, c->out_len + extra);
    uint8_t *p = realloc(c->out, want);
    if (!p) return -1;
    c->out = p;
    c->out_cap = want;
    return 0;
}

static int conn_queue(conn_t *c, const void *data, size_t len) {
    if (conn_out_reserve(c, len) != 0) return -1;
    memcpy(c->out + c->out_len, data, len);
    c->out_len += len;
    return 0;
}

/* Queue a reply [u32 1 + a_len + b_len][status][a][b]; no memory kills the connection. */
static void conn_reply(conn_t *c, uint8_t status, const void *a, size_t a_len, const void *b,
                       size_t b_len) {
    uint8_t head[STORE_HEAD_BYTES];
    cring__store_put_head(head, status, a_len + b_len);
    if (conn_out_reserve(c, sizeof head + a_len + b_len) != 0) {
        cring__log(CRING__LOG_WARNING, -1, "store: out of memory for a reply; closing connection");
        c->dead = 1;
        return;
    }
    conn_queue(c, head, sizeof head);
    if (a_len) conn_queue(c, a, a_len);
    if (b_len) conn_queue(c, b, b_len);
}

/* Send what the socket takes now. */
static void conn_flush(conn_t *c) {
    while (!c->dead && conn_out_pending(c) > 0) {
        ssize_t w =
            send(c->fd, c->out + c->out_off, conn_out_pending(c), MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w > 0) {
            c->out_off += (size_t)w;
            continue;
        }
        if (w < 0 && errno == EINTR) continue;
        if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return;
        c->dead = 1; /* EPIPE, ECONNRESET, ...: the client went away */
        return;
    }
    if (conn_out_pending(c) == 0) {
        c->out_off = c->out_len = 0;
        if (c->out_cap > SERVER_KEEP_BUFFER_BYTES) {
            free(c->out);
            c->out = NULL;
            c->out_cap = 0;
        }
        if (c->state == CONN_CLOSING) c->dead = 1;
    }
}

/* Does the loop want POLLIN on c (as opposed to only noticing a hang-up)? */
static int conn_wants_input(const conn_t *c) {
    if (c->state == CONN_HANDSHAKE) return c->in_len - c->in_off < CLIENT_HELLO_BYTES;
    if (c->state == CONN_READY)
        return !c->waiting && conn_out_pending(c) <= SERVER_OUT_BACKLOG_BYTES;
    return 0;
}

/* Read what is available, up to the per-turn budget. EOF or error kills c. */
static void conn_read(conn_t *c) {
    size_t budget = SERVER_READ_BUDGET_BYTES;
    while (!c->dead && budget > 0) {
        if (c->in_off == c->in_len) c->in_off = c->in_len = 0;
        if (c->in_off > 0 && c->in_off >= c->in_cap / 2) {
            memmove(c->in, c->in + c->in_off, c->in_len - c->in_off);
            c->in_len -= c->in_off;
            c->in_off = 0;
        }
        /* Before authentication read only the 36-byte answer: a stranger
         * never makes the server buffer more than that (what follows it
         * stays in the socket until the connection is authenticated). */
        int handshake = c->state == CONN_HANDSHAKE;
        size_t chunk = handshake ? CLIENT_HELLO_BYTES : SERVER_READ_CHUNK_BYTES;
        if (c->in_cap - c->in_len < chunk) {
            size_t want = CRING_MAX(c->in_cap * 2, c->in_len + chunk);
            uint8_t *p = realloc(c->in, want);
            if (!p) {
                cring__log(CRING__LOG_WARNING, -1, "store: out of memory reading a request");
                c->dead = 1;
                return;
            }
            c->in = p;
            c->in_cap = want;
        }
        size_t room = CRING_MIN(c->in_cap - c->in_len, budget);
        if (handshake) {
            size_t have = c->in_len - c->in_off;
            if (have >= CLIENT_HELLO_BYTES) return;
            room = CRING_MIN(room, CLIENT_HELLO_BYTES - have);
        }
        ssize_t r = recv(c->fd, c->in + c->in_len, room, MSG_DONTWAIT);
        if (r > 0) {
            c->in_len += (size_t)r;
            budget -= (size_t)r;
            if ((size_t)r < room) return; /* drained for now */
            if (handshake) return;
            /* Do not buffer past the end of the head message: let it be handled. */
            if (c->in_len - c->in_off >= 4) {
                uint32_t len = cring__store_head_length(c->in + c->in_off);
                if (!cring__store_length_ok(len) || c->in_len - c->in_off >= 4 + (size_t)len)
                    return;
            }
            continue;
        }
        if (r == 0) {
            c->dead = 1; /* the client closed: normal at the end of a job */
            return;
        }
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) c->dead = 1;
        return;
    }
}

/* ---- request handling ------------------------------------------------------- */

/* A cursor over one request's payload; any overrun marks it bad. */
/* Result of handling one request. */
enum { HANDLE_DONE = 1, HANDLE_WAIT = 0, HANDLE_BAD = -1 };

/* Handle the request msg[0..len) (opcode first). On HANDLE_WAIT the request
 * stays at the head of the input and is retried when keys appear or
 * answered with TIMEOUT at c->wait_deadline. timed_out forces that answer. */
static int handle_request(cring_store_server_t *s, conn_t *c, const uint8_t *msg, size_t len,
                          double now, int timed_out) {
    cring__store_cursor_t cur = {.p = msg + 1, .left = len - 1, .bad = 0};
    switch (msg[0]) {
    case STORE_OP_SET: {
        size_t klen = 0;
        const char *key = cring__store_take_key(&cur, &klen);
        if (cur.bad) return HANDLE_BAD;
        int created = 0;
        if (cring__kv_put(&s->table, key, klen, cur.p, cur.left, &created) != 0) {
            conn_reply(c, STORE_REPLY_NO_MEMORY, NULL, 0, NULL, 0);
            return HANDLE_DONE;
        }
        if (created) s->keys_created = 1;
        conn_reply(c, STORE_REPLY_OK, NULL, 0, NULL, 0);
        return HANDLE_DONE;
    }
    case STORE_OP_GET: {
        uint64_t timeout_ms = cring__store_take_u64(&cur);
        size_t klen = 0;
        const char *key = cring__store_take_key(&cur, &klen);
        if (cur.bad || cur.left != 0) return HANDLE_BAD;
        cring__kv_entry_t *e = cring__kv_find(&s->table, key, klen);
        if (e) {
            conn_reply(c, STORE_REPLY_OK, e->value, e->value_len, NULL, 0);
            c->waiting = 0;
            return HANDLE_DONE;
        }
        if (timed_out) {
            conn_reply(c, STORE_REPLY_TIMEOUT, key, klen, NULL, 0);
            c->waiting = 0;
            return HANDLE_DONE;
        }
        if (!c->waiting) {
            c->waiting = 1;
            c->wait_deadline = cring__store_deadline(timeout_ms, now);
        }
        return HANDLE_WAIT;
    }
    case STORE_OP_ADD: {
        size_t klen = 0;
        const char *key = cring__store_take_key(&cur, &klen);
        uint64_t delta = cring__store_take_u64(&cur);
        if (cur.bad || cur.left != 0) return HANDLE_BAD;
        cring__kv_entry_t *e = cring__kv_find(&s->table, key, klen);
        uint64_t value = delta; /* wraps like two's complement, never UB */
        if (e) {
            if (e->value_len != 8) {
                conn_reply(c, STORE_REPLY_NOT_INTEGER, NULL, 0, NULL, 0);
                return HANDLE_DONE;
            }
            value += cring__store_get_u64(e->value);
        }
        uint8_t bytes[8];
        cring__store_put_u64(bytes, value);
        int created = 0;
        if (e) {
            memcpy(e->value, bytes, 8);
        } else if (cring__kv_put(&s->table, key, klen, bytes, 8, &created) != 0) {
            conn_reply(c, STORE_REPLY_NO_MEMORY, NULL, 0, NULL, 0);
            return HANDLE_DONE;
        }
        if (created) s->keys_created = 1;
        conn_reply(c, STORE_REPLY_OK, bytes, 8, NULL, 0);
        return HANDLE_DONE;
    }
    case STORE_OP_WAIT: {
        uint64_t timeout_ms = cring__store_take_u64(&cur);
        uint32_t nkeys = cring__store_take_u32(&cur);
        const char *missing = NULL;
        size_t missing_len = 0;
        for (uint32_t i = 0; i < nkeys && !cur.bad; i++) {
            size_t klen;
            const char *key = cring__store_take_key(&cur, &klen);
            if (!cur.bad && !missing && !cring__kv_find(&s->table, key, klen)) {
                missing = key;
                missing_len = klen;
            }
        }
        if (cur.bad || cur.left != 0) return HANDLE_BAD;
        if (!missing || timed_out) {
            if (missing) conn_reply(c, STORE_REPLY_TIMEOUT, missing, missing_len, NULL, 0);
            else conn_reply(c, STORE_REPLY_OK, NULL, 0, NULL, 0);
            c->waiting = 0;
            return HANDLE_DONE;
        }
        if (!c->waiting) {
            c->waiting = 1;
            c->wait_deadline = cring__store_deadline(timeout_ms, now);
        }
        return HANDLE_WAIT;
    }
    default: return HANDLE_BAD;
    }
}

/* Check the client's handshake answer at the head of the input. */
static void conn_handshake(cring_store_server_t *s, conn_t *c) {
    const uint8_t *hello = c->in + c->in_off;
    uint8_t expect[CRING__AUTH_BYTES];
    cring__auth_response(s->secret, c->nonce, expect);
    int ok = memcmp(hello, STORE_MAGIC, STORE_MAGIC_BYTES) == 0 &&
             cring__auth_equal(hello + STORE_MAGIC_BYTES, expect);
    c->in_off += CLIENT_HELLO_BYTES;
    uint8_t status = ok ? 0 : 1;
    if (conn_queue(c, &status, 1) != 0) {
        c->dead = 1;
        return;
    }
    if (ok) {
        c->state = CONN_READY;
    } else {
        server_warn(s, "store: refused a connection that did not present the job secret");
        c->state = CONN_CLOSING;
    }
}

/* Handle every complete request in c's input until one waits, the output
 * backlog is too large, or more input is needed. timed_out: answer the head
 * request (which must be waiting) with TIMEOUT. */
static void conn_pump(cring_store_server_t *s, conn_t *c, double now, int timed_out) {
    while (!c->dead) {
        size_t avail = c->in_len - c->in_off;
        if (c->state == CONN_HANDSHAKE) {
            if (avail < CLIENT_HELLO_BYTES) return;
            conn_handshake(s, c);
            continue;
        }
        if (c->state != CONN_READY) return;
        if (conn_out_pending(c) > SERVER_OUT_BACKLOG_BYTES) return;
        if (avail < 4) return;
        uint32_t len = cring__store_head_length(c->in + c->in_off);
        if (!cring__store_length_ok(len)) {
            server_warn(s,
                        "store: request of %" PRIu32 " bytes is empty or over the %u byte limit; "
                        "closing that connection",
                        len, STORE_MAX_MESSAGE_BYTES);
            c->dead = 1;
            return;
        }
        if (avail < 4 + (size_t)len) return;
        int r = handle_request(s, c, c->in + c->in_off + 4, len, now, timed_out);
        timed_out = 0;
        if (r == HANDLE_BAD) {
            server_warn(s,
                        "store: malformed request (opcode %u: %s, %" PRIu32 " bytes); closing "
                        "that connection",
                        c->in[c->in_off + 4], cring__store_op_name(c->in[c->in_off + 4]), len);
            c->dead = 1;
            return;
        }
        if (r == HANDLE_WAIT) return;
        c->in_off += 4 + (size_t)len;
        if (c->in_off == c->in_len) {
            c->in_off = c->in_len = 0;
            if (c->in_cap > SERVER_KEEP_BUFFER_BYTES) { /* do not keep a 64 MiB buffer */
                free(c->in);
                c->in = NULL;
                c->in_cap = 0;
            }
        }
    }
}

static int server_add_conn(cring_store_server_t *s, int fd) {
    if (s->nconns == s->conns_cap) {
        size_t n = s->conns_cap ? s->conns_cap * 2 : 16;
        conn_t **p = realloc(s->conns, n * sizeof *p);
        if (!p) return -1;
        s->conns = p;
        s->conns_cap = n;
    }
    conn_t *c = calloc(1, sizeof *c);
    if (!c) return -1;
    c->fd = fd;
    c->state = CONN_HANDSHAKE;
    c->handshake_deadline = cring__now_s() + SERVER_HANDSHAKE_TIMEOUT_S;
    cring__random_bytes(c->nonce, sizeof c->nonce);
    if (conn_queue(c, STORE_MAGIC, STORE_MAGIC_BYTES) != 0 ||
        conn_queue(c, c->nonce, sizeof c->nonce) != 0) {
        c->fd = -1;
        conn_free(c);
        return -1;
    }
    s->conns[s->nconns++] = c;
    conn_flush(c);
    return 0;
}

/* Out of descriptors: close the oldest connection that has not authenticated
 * yet, so that idle or stalled strangers cannot lock the job's own ranks out
 * (a rank whose handshake is cut short retries). Returns 1 if one was closed. */
static int server_evict_unauthenticated(cring_store_server_t *s) {
    conn_t *oldest = NULL;
    for (size_t i = 0; i < s->nconns; i++) {
        conn_t *c = s->conns[i];
        if (c->dead || c->fd < 0 || c->state != CONN_HANDSHAKE) continue;
        if (!oldest || c->handshake_deadline < oldest->handshake_deadline) oldest = c;
    }
    if (!oldest) return 0;
    close(oldest->fd); /* free the descriptor now; the entry goes at the end of the turn */
    oldest->fd = -1;
    oldest->dead = 1;
    return 1;
}

static void server_accept(cring_store_server_t *s) {
    int evicted = 0;
    for (int i = 0; i < 64; i++) {
        int fd = accept4(s->listen_fd, NULL, NULL, SOCK_NONBLOCK | SOCK_CLOEXEC);
        if (fd < 0) {
            if (errno == EINTR || errno == ECONNABORTED || errno == EPROTO) continue;
            if ((errno == EMFILE || errno == ENFILE) && server_evict_unauthenticated(s)) {
                if (evicted++ == 0)
                    server_warn(s, "store: out of file descriptors; closing the oldest "
                                   "unauthenticated connections to accept new ones");
                continue;
            }
            if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
                cring__log(CRING__LOG_WARNING, -1,
                           "store: cannot accept more connections (%s); pausing 100 ms",
                           strerror(errno));
                s->listen_paused_until = cring__now_s() + 0.1;
            }
            return; /* EAGAIN: nothing more pending */
        }
        int one = 1;
        (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
        if (server_add_conn(s, fd) != 0) {
            cring__log(CRING__LOG_WARNING, -1, "store: out of memory for a connection");
            close(fd);
            return;
        }
    }
}

/* Milliseconds poll() may sleep before the next deadline (-1: none). */
static int server_poll_timeout_ms(const cring_store_server_t *s, double now) {
    double next = INFINITY;
    for (size_t i = 0; i < s->nconns; i++) {
        const conn_t *c = s->conns[i];
        if (c->state == CONN_HANDSHAKE) next = CRING_MIN(next, c->handshake_deadline);
        if (c->waiting) next = CRING_MIN(next, c->wait_deadline);
    }
    if (s->listen_paused_until > now) next = CRING_MIN(next, s->listen_paused_until);
    if (isinf(next)) return -1;
    double ms = ceil((next - now) * 1000.0);
    if (ms <= 0) return 0;
    if (ms > (double)INT_MAX) return INT_MAX;
    return (int)ms;
}

static void server_remove_dead(cring_store_server_t *s) {
    size_t kept = 0;
    for (size_t i = 0; i < s->nconns; i++) {
        if (s->conns[i]->dead) conn_free(s->conns[i]);
        else s->conns[kept++] = s->conns[i];
    }
    s->nconns = kept;
}

static void *server_main(void *arg) {
    cring_store_server_t *s = arg;
    for (;;) {
        double now = cring__now_s();
        size_t n = 2 + s->nconns;
        if (n > s->pfds_cap) {
            size_t cap = CRING_MAX(n, s->pfds_cap * 2);
            struct pollfd *p = realloc(s->pfds, cap * sizeof *p);
            if (!p) {
                cring__log(CRING__LOG_ERROR, -1, "store: out of memory; retrying");
                (void)poll(NULL, 0, 10);
                continue;
            }
            s->pfds = p;
            s->pfds_cap = cap;
        }
        s->pfds[0] = (struct pollfd){.fd = s->wake_fd, .events = POLLIN};
        int listening = s->listen_paused_until <= now;
        s->pfds[1] = (struct pollfd){.fd = listening ? s->listen_fd : -1, .events = POLLIN};
        size_t polled = s->nconns;
        for (size_t i = 0; i < polled; i++) {
            conn_t *c = s->conns[i];
            short ev = conn_wants_input(c) ? POLLIN : POLLRDHUP;
            if (conn_out_pending(c) > 0) ev |= POLLOUT;
            s->pfds[2 + i] = (struct pollfd){.fd = c->fd, .events = ev};
        }
        int r = poll(s->pfds, n, server_poll_timeout_ms(s, now));
        if (r < 0) {
            if (errno == EINTR) continue;
            cring__log(CRING__LOG_ERROR, -1, "store: poll failed: %s", strerror(errno));
            (void)poll(NULL, 0, 10);
            continue;
        }
        if (s->pfds[0].revents) break; /* stop requested */
        now = cring__now_s();

        for (size_t i = 0; i < polled; i++) {
            conn_t *c = s->conns[i];
            short rev = s->pfds[2 + i].revents;
            if (!rev) continue;
            if (rev & POLLOUT) conn_flush(c);
            if (c->dead) continue;
            if (s->pfds[2 + i].events & POLLIN) {
                if (rev & (POLLIN | POLLERR | POLLHUP)) {
                    conn_read(c);
                    conn_pump(s, c, now, 0);
                }
            } else if (rev & (POLLRDHUP | POLLERR | POLLHUP)) {
                c->dead = 1; /* went away while waiting or while we were not reading */
            }
        }
        if (s->pfds[1].revents) server_accept(s);

        /* Deadlines: unfinished handshakes and waits that timed out. */
        for (size_t i = 0; i < s->nconns; i++) {
            conn_t *c = s->conns[i];
            if (c->dead) continue;
            if (c->state == CONN_HANDSHAKE && now >= c->handshake_deadline) c->dead = 1;
            else if (c->waiting && now >= c->wait_deadline) conn_pump(s, c, now, 1);
        }
        /* New keys may release waiting GET/WAIT requests (which may in turn
         * handle pipelined requests that create more keys). */
        while (s->keys_created) {
            s->keys_created = 0;
            for (size_t i = 0; i < s->nconns; i++) {
                conn_t *c = s->conns[i];
                if (!c->dead && c->waiting) conn_pump(s, c, now, 0);
            }
        }
        /* Send replies now rather than after another poll, and resume
         * connections whose backlog drained. */
        for (size_t i = 0; i < s->nconns; i++) {
            conn_t *c = s->conns[i];
            if (c->dead) continue;
            if (conn_out_pending(c) > 0) conn_flush(c);
            if (!c->dead && c->state == CONN_READY && !c->waiting) conn_pump(s, c, now, 0);
        }
        server_remove_dead(s);
    }
    if (s->warn_suppressed > 0)
        cring__log(CRING__LOG_WARNING, -1,
                   "store: %ld more refused, malformed or evicted connections before it stopped",
                   s->warn_suppressed);
    return NULL;
}

static void server_free(cring_store_server_t *s) {
    if (!s) return;
    for (size_t i = 0; i < s->nconns; i++) conn_free(s->conns[i]);
    free(s->conns);
    free(s->pfds);
    cring__kv_free(&s->table);
    if (s->listen_fd >= 0) close(s->listen_fd);
    if (s->wake_fd >= 0) close(s->wake_fd);
    if (s->secret) {
        memset(s->secret, 0, strlen(s->secret));
        free(s->secret);
    }
    free(s);
}

/* Contract: see cring.h. The thread runs with every signal blocked. Errors:
 * ERR_INVALID_ARGUMENT (bad address/port), ERR_SYSTEM (bind, thread),
 * ERR_NO_MEMORY; detail in cring__thread_errmsg(). */
cring_status_t cring_store_server_start(const char *bind_addr, int port, const char *secret,
                                        cring_store_server_t **server_out, int *bound_port) {
    cring__errmsg_t *err = cring__thread_errmsg();
    cring_status_t st = CRING_OK;
    if (!server_out)
        return cring__fail(err, CRING_ERR_INVALID_ARGUMENT, "server_out must not be NULL");
    *server_out = NULL;
    cring_store_server_t *s = calloc(1, sizeof *s);
    if (!s) return cring__fail(err, CRING_ERR_NO_MEMORY, "out of memory for the store server");
    s->listen_fd = -1;
    s->wake_fd = -1;
    s->secret = strdup(secret ? secret : "");
    if (!s->secret) {
        st = cring__fail(err, CRING_ERR_NO_MEMORY, "out of memory for the store server");
        goto cleanup;
    }
    CRING_CHECK_GOTO(cring__net_listen(bind_addr, port, 1024, &s->listen_fd, &s->port, err), st,
                     cleanup);
    if (cring__net_set_nonblocking(s->listen_fd, 1) != CRING_OK) {
        st = cring__fail(err, CRING_ERR_SYSTEM, "cannot make the store socket non-blocking: %s",
                         strerror(errno));
        goto cleanup;
    }
    s->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (s->wake_fd < 0) {
        st = cring__fail(err, CRING_ERR_SYSTEM, "eventfd failed: %s", strerror(errno));
        goto cleanup;
    }
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int rc = pthread_create(&s->thread, NULL, server_main, s);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc != 0) {
        st = cring__fail(err, CRING_ERR_SYSTEM, "cannot start the store thread: %s", strerror(rc));
        goto cleanup;
    }
    s->thread_started = 1;
    if (bound_port) *bound_port = s->port;
    *server_out = s;
    return CRING_OK;

cleanup:
    server_free(s);
    return st;
}

/* Contract: see cring.h. Wakes the thread through the eventfd, joins it, then
 * closes every connection (blocked clients see the connection close). Not
 * safe to call twice on one server. */
void cring_store_server_stop(cring_store_server_t *server) {
    if (!server) return;
    if (server->thread_started) {
        uint64_t one = 1;
        ssize_t w;
        do {
            w = write(server->wake_fd, &one, sizeof one);
        } while (w < 0 && errno == EINTR);
        pthread_join(server->thread, NULL);
    }
    server_free(server);
}

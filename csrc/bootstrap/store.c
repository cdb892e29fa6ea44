/* store.c: the rendezvous key-value store (set / get / add / wait over TCP,
 * authenticated with the job secret): one poll() server thread and a blocking
 * client. The server never blocks on one connection and never trusts a length. */
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

/* ---- Wire protocol ----------------------------------------------------------
 * Handshake: server -> "CRS1" + 16-byte nonce; client -> "CRS1" +
 * HMAC-SHA256(secret, nonce); server -> one status byte (0 accepted; anything
 * else refused, then the server closes). A server without a secret uses the
 * empty key, so only clients without a secret match it.
 *
 * Request: [u32 length][u8 opcode][payload], length = 1 + payload bytes, at
 * most STORE_MAX_MESSAGE_BYTES. Reply: [u32 length][u8 status][payload].
 * Integers are little-endian. A key is [u32 key_len][key bytes], key_len <= 4096.
 *   SET  key, value (rest of message)          -> OK
 *   GET  u64 timeout_ms, key                    -> OK value | TIMEOUT key
 *   ADD  key, i64 delta                         -> OK i64 new value | NOT_INTEGER
 *   WAIT u64 timeout_ms, u32 nkeys, key * nkeys -> OK | TIMEOUT first-missing-key
 * GET and WAIT replies are deferred until the keys exist; the server itself
 * answers TIMEOUT when timeout_ms passes, so the connection stays in step and
 * the client remains usable after a timed-out get. Requests on one
 * connection are answered in order. A malformed message closes that
 * connection only. */
#define STORE_MAGIC "CRS1"
#define STORE_MAGIC_BYTES 4
#define STORE_MAX_MESSAGE_BYTES (64u << 20)
#define STORE_MAX_KEY_BYTES 4096u

enum { OP_SET = 1, OP_GET = 2, OP_ADD = 3, OP_WAIT = 4 };
enum { REPLY_OK = 0, REPLY_TIMEOUT = 1, REPLY_NOT_INTEGER = 2, REPLY_NO_MEMORY = 3 };

#define SERVER_HELLO_BYTES (STORE_MAGIC_BYTES + CRING__NONCE_BYTES)
#define CLIENT_HELLO_BYTES (STORE_MAGIC_BYTES + CRING__AUTH_BYTES)
/* An unauthenticated connection must finish the handshake within this. */
#define SERVER_HANDSHAKE_TIMEOUT_S 60.0
/* Stop handling a connection's requests while this much output is queued. */
#define SERVER_OUT_BACKLOG_BYTES (4u << 20)
/* Read at most this much from one connection per loop turn (fairness). */
#define SERVER_READ_BUDGET_BYTES (4u << 20)
#define SERVER_READ_CHUNK_BYTES (64u << 10)
/* Buffers above this size are freed when they drain. */
#define SERVER_KEEP_BUFFER_BYTES (1u << 20)
/* Longest server-side wait honoured (about 30 years); longer means forever. */
#define STORE_MAX_TIMEOUT_MS 1000000000000ull

static void put_u32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static void put_u64(uint8_t *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint32_t get_u32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}
static uint64_t get_u64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

/* ============================================================================
 * Server
 * ========================================================================== */

/* ---- key-value table: chained hash table, keys and values are byte strings */
typedef struct kv_entry {
    struct kv_entry *next;
    uint64_t hash;
    uint8_t *value;
    size_t value_len;
    size_t key_len;
    char key[];
} kv_entry_t;

typedef struct kv_table {
    kv_entry_t **buckets;
    size_t nbuckets; /* power of two */
    size_t count;
} kv_table_t;

static uint64_t kv_hash(const char *key, size_t len) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    for (size_t i = 0; i < len; i++) h = (h ^ (uint8_t)key[i]) * 1099511628211ull;
    return h;
}

static kv_entry_t *kv_find(const kv_table_t *t, const char *key, size_t len) {
    if (t->nbuckets == 0) return NULL;
    uint64_t h = kv_hash(key, len);
    for (kv_entry_t *e = t->buckets[h & (t->nbuckets - 1)]; e; e = e->next)
        if (e->hash == h && e->key_len == len && memcmp(e->key, key, len) == 0) return e;
    return NULL;
}

static int kv_grow(kv_table_t *t) {
    size_t n = t->nbuckets ? t->nbuckets * 2 : 64;
    kv_entry_t **b = calloc(n, sizeof *b);
    if (!b) return -1;
    for (size_t i = 0; i < t->nbuckets; i++) {
        kv_entry_t *e = t->buckets[i];
        while (e) {
            kv_entry_t *next = e->next;
            e->next = b[e->hash & (n - 1)];
            b[e->hash & (n - 1)] = e;
            e = next;
        }
    }
    free(t->buckets);
    t->buckets = b;
    t->nbuckets = n;
    return 0;
}

/* Set key to a copy of value. *created is 1 when the key is new. -1: no memory. */
static int kv_put(kv_table_t *t, const char *key, size_t len, const void *value,
                  size_t value_len, int *created) {
    *created = 0;
    uint8_t *copy = malloc(value_len ? value_len : 1);
    if (!copy) return -1;
    if (value_len) memcpy(copy, value, value_len);
    kv_entry_t *e = kv_find(t, key, len);
    if (e) {
        free(e->value);
        e->value = copy;
        e->value_len = value_len;
        return 0;
    }
    if (t->count >= t->nbuckets && kv_grow(t) != 0) {
        free(copy);
        return -1;
    }
    e = malloc(sizeof *e + len + 1);
    if (!e) {
        free(copy);
        return -1;
    }
    e->hash = kv_hash(key, len);
    e->value = copy;
    e->value_len = value_len;
    e->key_len = len;
    memcpy(e->key, key, len);
    e->key[len] = '\0';
    e->next = t->buckets[e->hash & (t->nbuckets - 1)];
    t->buckets[e->hash & (t->nbuckets - 1)] = e;
    t->count++;
    *created = 1;
    return 0;
}

static void kv_free(kv_table_t *t) {
    for (size_t i = 0; i < t->nbuckets; i++) {
        kv_entry_t *e = t->buckets[i];
        while (e) {
            kv_entry_t *next = e->next;
            free(e->value);
            free(e);
            e = next;
        }
    }
    free(t->buckets);
    memset(t, 0, sizeof *t);
}

/* ---- connections ---------------------------------------------------------- */
typedef enum conn_state {
    CONN_HANDSHAKE = 0, /* hello sent, waiting for the client's answer */
    CONN_READY = 1,     /* authenticated: serving requests */
    CONN_CLOSING = 2    /* refused: flush the status byte, then close */
} conn_state_t;

typedef struct conn {
    int fd;
    conn_state_t state;
    int dead;                   /* close at the end of this loop turn */
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
    kv_table_t table;
    conn_t **conns;
    size_t nconns, conns_cap;
    struct pollfd *pfds;
    size_t pfds_cap;
    double listen_paused_until; /* back off accept() after EMFILE and friends */
    /* Rate limit for warnings a stranger can trigger (see server_warn). */
    double warn_window_start;
    int warn_in_window;
    long warn_suppressed;
    int keys_created;           /* a new key appeared this turn: retry waiters */
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
    uint8_t head[5];
    put_u32(head, (uint32_t)(1 + a_len + b_len));
    head[4] = status;
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
        ssize_t w = send(c->fd, c->out + c->out_off, conn_out_pending(c),
                         MSG_NOSIGNAL | MSG_DONTWAIT);
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
                uint32_t len = get_u32(c->in + c->in_off);
                if (len == 0 || len > STORE_MAX_MESSAGE_BYTES ||
                    c->in_len - c->in_off >= 4 + (size_t)len)
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
typedef struct cursor {
    const uint8_t *p;
    size_t left;
    int bad;
} cursor_t;

static const uint8_t *cursor_take(cursor_t *cur, size_t n) {
    if (cur->bad || cur->left < n) {
        cur->bad = 1;
        return NULL;
    }
    const uint8_t *r = cur->p;
    cur->p += n;
    cur->left -= n;
    return r;
}

static uint64_t cursor_u64(cursor_t *cur) {
    const uint8_t *p = cursor_take(cur, 8);
    return p ? get_u64(p) : 0;
}

static uint32_t cursor_u32(cursor_t *cur) {
    const uint8_t *p = cursor_take(cur, 4);
    return p ? get_u32(p) : 0;
}

/* Read [u32 len][bytes] as a key; sets *len. */
static const char *cursor_key(cursor_t *cur, size_t *len) {
    uint32_t n = cursor_u32(cur);
    if (n > STORE_MAX_KEY_BYTES) cur->bad = 1;
    const uint8_t *k = cursor_take(cur, n);
    *len = n;
    return (const char *)k;
}

static double timeout_deadline(uint64_t timeout_ms, double now) {
    if (timeout_ms >= STORE_MAX_TIMEOUT_MS) return INFINITY;
    return now + (double)timeout_ms / 1000.0;
}

/* Result of handling one request. */
enum { HANDLE_DONE = 1, HANDLE_WAIT = 0, HANDLE_BAD = -1 };

/* Handle the request msg[0..len) (opcode first). On HANDLE_WAIT the request
 * stays at the head of the input and is retried when keys appear or
 * answered with TIMEOUT at c->wait_deadline. timed_out forces that answer. */
static int handle_request(cring_store_server_t *s, conn_t *c, const uint8_t *msg, size_t len,
                          double now, int timed_out) {
    cursor_t cur = {.p = msg + 1, .left = len - 1, .bad = 0};
    switch (msg[0]) {
    case OP_SET: {
        size_t klen = 0;
        const char *key = cursor_key(&cur, &klen);
        if (cur.bad) return HANDLE_BAD;
        int created = 0;
        if (kv_put(&s->table, key, klen, cur.p, cur.left, &created) != 0) {
            conn_reply(c, REPLY_NO_MEMORY, NULL, 0, NULL, 0);
            return HANDLE_DONE;
        }
        if (created) s->keys_created = 1;
        conn_reply(c, REPLY_OK, NULL, 0, NULL, 0);
        return HANDLE_DONE;
    }
    case OP_GET: {
        uint64_t timeout_ms = cursor_u64(&cur);
        size_t klen = 0;
        const char *key = cursor_key(&cur, &klen);
        if (cur.bad || cur.left != 0) return HANDLE_BAD;
        kv_entry_t *e = kv_find(&s->table, key, klen);
        if (e) {
            conn_reply(c, REPLY_OK, e->value, e->value_len, NULL, 0);
            c->waiting = 0;
            return HANDLE_DONE;
        }
        if (timed_out) {
            conn_reply(c, REPLY_TIMEOUT, key, klen, NULL, 0);
            c->waiting = 0;
            return HANDLE_DONE;
        }
        if (!c->waiting) {
            c->waiting = 1;
            c->wait_deadline = timeout_deadline(timeout_ms, now);
        }
        return HANDLE_WAIT;
    }
    case OP_ADD: {
        size_t klen = 0;
        const char *key = cursor_key(&cur, &klen);
        uint64_t delta = cursor_u64(&cur);
        if (cur.bad || cur.left != 0) return HANDLE_BAD;
        kv_entry_t *e = kv_find(&s->table, key, klen);
        uint64_t value = delta; /* wraps like two's complement, never UB */
        if (e) {
            if (e->value_len != 8) {
                conn_reply(c, REPLY_NOT_INTEGER, NULL, 0, NULL, 0);
                return HANDLE_DONE;
            }
            value += get_u64(e->value);
        }
        uint8_t bytes[8];
        put_u64(bytes, value);
        int created = 0;
        if (e) {
            memcpy(e->value, bytes, 8);
        } else if (kv_put(&s->table, key, klen, bytes, 8, &created) != 0) {
            conn_reply(c, REPLY_NO_MEMORY, NULL, 0, NULL, 0);
            return HANDLE_DONE;
        }
        if (created) s->keys_created = 1;
        conn_reply(c, REPLY_OK, bytes, 8, NULL, 0);
        return HANDLE_DONE;
    }
    case OP_WAIT: {
        uint64_t timeout_ms = cursor_u64(&cur);
        uint32_t nkeys = cursor_u32(&cur);
        const char *missing = NULL;
        size_t missing_len = 0;
        for (uint32_t i = 0; i < nkeys && !cur.bad; i++) {
            size_t klen;
            const char *key = cursor_key(&cur, &klen);
            if (!cur.bad && !missing && !kv_find(&s->table, key, klen)) {
                missing = key;
                missing_len = klen;
            }
        }
        if (cur.bad || cur.left != 0) return HANDLE_BAD;
        if (!missing || timed_out) {
            if (missing)
                conn_reply(c, REPLY_TIMEOUT, missing, missing_len, NULL, 0);
            else
                conn_reply(c, REPLY_OK, NULL, 0, NULL, 0);
            c->waiting = 0;
            return HANDLE_DONE;
        }
        if (!c->waiting) {
            c->waiting = 1;
            c->wait_deadline = timeout_deadline(timeout_ms, now);
        }
        return HANDLE_WAIT;
    }
    default:
        return HANDLE_BAD;
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
        uint32_t len = get_u32(c->in + c->in_off);
        if (len == 0 || len > STORE_MAX_MESSAGE_BYTES) {
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
                        "store: malformed request (opcode %u, %" PRIu32 " bytes); closing that "
                        "connection",
                        c->in[c->in_off + 4], len);
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
        if (s->conns[i]->dead)
            conn_free(s->conns[i]);
        else
            s->conns[kept++] = s->conns[i];
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
    kv_free(&s->table);
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
        st = cring__fail(err, CRING_ERR_SYSTEM, "cannot start the store thread: %s",
                         strerror(rc));
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

/* ============================================================================
 * Client
 * ========================================================================== */

struct cring_store {
    int fd;                 /* -1 once broken */
    double op_timeout_s;    /* bound on set/add round trips and on sends */
    char addr[256];
    int port;
};

/* Extra time a client waits beyond its GET/WAIT timeout for the server's own
 * TIMEOUT answer before it gives up on the connection. */
#define CLIENT_REPLY_GRACE_S 10.0
/* Floor for the set/add round-trip bound. */
#define CLIENT_MIN_OP_TIMEOUT_S 30.0

static void client_break(cring_store_t *c) {
    if (c->fd >= 0) close(c->fd);
    c->fd = -1;
}

static cring_status_t client_usable(cring_store_t *c) {
    if (!c)
        return cring__fail(cring__thread_errmsg(), CRING_ERR_INVALID_ARGUMENT,
                           "store client is NULL");
    if (c->fd < 0)
        return cring__fail(cring__thread_errmsg(), CRING_ERR_BROKEN,
                           "store client for %s:%d is unusable after an earlier failure", c->addr,
                           c->port);
    return CRING_OK;
}

static cring_status_t check_key(const char *key, size_t *len) {
    if (!key)
        return cring__fail(cring__thread_errmsg(), CRING_ERR_INVALID_ARGUMENT, "store key is NULL");
    *len = strlen(key);
    if (*len > STORE_MAX_KEY_BYTES)
        return cring__fail(cring__thread_errmsg(), CRING_ERR_INVALID_ARGUMENT,
                           "store key of %zu bytes is over the %u byte limit", *len,
                           STORE_MAX_KEY_BYTES);
    return CRING_OK;
}

static uint64_t timeout_to_ms(double timeout_s) {
    if (!(timeout_s > 0)) return 0;
    double ms = ceil(timeout_s * 1000.0);
    if (ms >= (double)STORE_MAX_TIMEOUT_MS) return STORE_MAX_TIMEOUT_MS;
    return (uint64_t)ms;
}

/* Send the parts of one request, then read the reply [u32 len][u8 status]
 * [payload]; *payload_out is malloc'd (NULL when empty). Any transport
 * failure breaks the client (the stream would be out of step). */
static cring_status_t client_call(cring_store_t *c, const uint8_t *head, size_t head_len,
                                  const void *tail, size_t tail_len, double reply_deadline,
                                  const char *what, uint8_t *status_out, uint8_t **payload_out,
                                  size_t *payload_len_out) {
    cring__errmsg_t *err = cring__thread_errmsg();
    cring__errmsg_t detail;
    cring_status_t st;
    uint8_t *payload = NULL;
    *payload_out = NULL;
    *payload_len_out = 0;
    double send_deadline = cring__now_s() + c->op_timeout_s;
    CRING_CHECK_GOTO(cring__net_send_all(c->fd, head, head_len, send_deadline, &detail), st,
                     cleanup);
    if (tail_len)
        CRING_CHECK_GOTO(cring__net_send_all(c->fd, tail, tail_len, send_deadline, &detail), st,
                         cleanup);
    uint8_t reply_head[5];
    CRING_CHECK_GOTO(cring__net_recv_all(c->fd, reply_head, sizeof reply_head, reply_deadline,
                                         &detail),
                     st, cleanup);
    uint32_t len = get_u32(reply_head);
    if (len == 0 || len > STORE_MAX_MESSAGE_BYTES) {
        st = cring__fail(&detail, CRING_ERR_PROTOCOL, "reply of %" PRIu32 " bytes is malformed",
                         len);
        goto cleanup;
    }
    size_t payload_len = (size_t)len - 1;
    if (payload_len) {
        payload = malloc(payload_len + 1); /* + a NUL so string values are usable as is */
        if (!payload) {
            st = cring__fail(&detail, CRING_ERR_NO_MEMORY, "out of memory for a %zu byte reply",
                             payload_len);
            goto cleanup;
        }
        CRING_CHECK_GOTO(cring__net_recv_all(c->fd, payload, payload_len, reply_deadline, &detail),
                         st, cleanup);
        payload[payload_len] = 0;
    }
    *status_out = reply_head[4];
    *payload_out = payload;
    *payload_len_out = payload_len;
    return CRING_OK;

cleanup:
    free(payload);
    client_break(c);
    return cring__fail(err, st, "store %s at %s:%d failed: %s (client closed)", what, c->addr,
                       c->port, detail.text);
}

/* Build "[u32 len][op]" followed by body (body_len bytes) into buf; the total
 * message announces extra_len more bytes that follow separately. */
static size_t frame_head(uint8_t *buf, uint8_t op, size_t body_len, size_t extra_len) {
    put_u32(buf, (uint32_t)(1 + body_len + extra_len));
    buf[4] = op;
    return 5;
}

/* Map a non-OK reply status to an error. */
static cring_status_t reply_error(cring_store_t *c, uint8_t status, const char *what,
                                  const char *key) {
    cring__errmsg_t *err = cring__thread_errmsg();
    switch (status) {
    case REPLY_NOT_INTEGER:
        return cring__fail(err, CRING_ERR_INVALID_ARGUMENT,
                           "store %s of key '%s' at %s:%d: the value is not an 8-byte integer",
                           what, key, c->addr, c->port);
    case REPLY_NO_MEMORY:
        return cring__fail(err, CRING_ERR_NO_MEMORY,
                           "store %s of key '%s' at %s:%d: server is out of memory",
                           what, key, c->addr, c->port);
    default:
        return cring__fail(err, CRING_ERR_PROTOCOL,
                           "store %s of key '%s' at %s:%d: unexpected reply status %u", what, key,
                           c->addr, c->port, status);
    }
}

/* Contract: see cring.h. addr/secret are copied; timeout_s <= 0 means 600 s.
 * Refused or unreachable attempts, and handshakes cut short (a server that is
 * restarting), are retried until the deadline. Set/add round trips later are
 * bounded by max(timeout_s, 30 s). Errors: ERR_TIMEOUT, ERR_AUTH (the server
 * refused the secret), ERR_PROTOCOL (not a cring store), ERR_INVALID_ARGUMENT,
 * ERR_SYSTEM, ERR_NO_MEMORY; detail in cring__thread_errmsg(). */
cring_status_t cring_store_connect(const char *addr, int port, const char *secret,
                                   double timeout_s, cring_store_t **client_out) {
    cring__errmsg_t *err = cring__thread_errmsg();
    cring__errmsg_t detail;
    cring_status_t st = CRING_OK;
    int fd = -1;
    if (!client_out) return cring__fail(err, CRING_ERR_INVALID_ARGUMENT, "client_out is NULL");
    *client_out = NULL;
    if (!addr || !*addr)
        return cring__fail(err, CRING_ERR_INVALID_ARGUMENT, "store address is empty");
    if (strlen(addr) >= sizeof(((cring_store_t *)0)->addr))
        return cring__fail(err, CRING_ERR_INVALID_ARGUMENT, "store address is too long");
    if (!(timeout_s > 0)) timeout_s = 600.0;
    double deadline = cring__now_s() + timeout_s;
    cring_store_t *c = calloc(1, sizeof *c);
    if (!c) return cring__fail(err, CRING_ERR_NO_MEMORY, "out of memory for a store client");
    c->fd = -1;
    snprintf(c->addr, sizeof c->addr, "%s", addr);
    c->port = port;
    c->op_timeout_s = CRING_MAX(timeout_s, CLIENT_MIN_OP_TIMEOUT_S);

    for (;;) {
        st = cring__net_connect(addr, port, deadline, &fd, &detail);
        if (st != CRING_OK) {
            if (st == CRING_ERR_TIMEOUT)
                st = cring__fail(err, st,
                                 "could not reach the rendezvous store at %s:%d within %.1f s: %s",
                                 addr, port, timeout_s, detail.text);
            else
                st = cring__fail(err, st, "cannot connect to the rendezvous store at %s:%d: %s",
                                 addr, port, detail.text);
            goto cleanup;
        }
        uint8_t hello[SERVER_HELLO_BYTES];
        st = cring__net_recv_all(fd, hello, sizeof hello, deadline, &detail);
        if (st == CRING_OK && memcmp(hello, STORE_MAGIC, STORE_MAGIC_BYTES) != 0) {
            st = cring__fail(err, CRING_ERR_PROTOCOL,
                             "%s:%d is not a cring rendezvous store (bad greeting)", addr, port);
            goto cleanup;
        }
        uint8_t answer[CLIENT_HELLO_BYTES];
        if (st == CRING_OK) {
            memcpy(answer, STORE_MAGIC, STORE_MAGIC_BYTES);
            cring__auth_response(secret, hello + STORE_MAGIC_BYTES, answer + STORE_MAGIC_BYTES);
            st = cring__net_send_all(fd, answer, sizeof answer, deadline, &detail);
        }
        uint8_t verdict = 1;
        if (st == CRING_OK) st = cring__net_recv_all(fd, &verdict, 1, deadline, &detail);
        if (st == CRING_OK) {
            if (verdict != 0) {
                st = cring__fail(err, CRING_ERR_AUTH,
                                 "the rendezvous store at %s:%d refused this process's job "
                                 "secret (do the secrets match?)",
                                 addr, port);
                goto cleanup;
            }
            break;
        }
        close(fd);
        fd = -1;
        if (st == CRING_ERR_TIMEOUT) {
            st = cring__fail(err, st,
                             "the rendezvous store at %s:%d did not finish the handshake within "
                             "%.1f s: %s",
                             addr, port, timeout_s, detail.text);
            goto cleanup;
        }
        if (st != CRING_ERR_PEER_FAILURE || cring__now_s() >= deadline) {
            st = cring__fail(err, st, "handshake with the rendezvous store at %s:%d failed: %s",
                             addr, port, detail.text);
            goto cleanup;
        }
        (void)poll(NULL, 0, 20); /* the server went away mid-handshake: back off, retry */
    }
    c->fd = fd;
    *client_out = c;
    return CRING_OK;

cleanup:
    if (fd >= 0) close(fd);
    free(c);
    return st;
}

/* Contract: see cring.h. */
void cring_store_close(cring_store_t *client) {
    if (!client) return;
    client_break(client);
    free(client);
}

/* Contract: see cring.h. Returns once the server has stored the value.
 * Errors: ERR_INVALID_ARGUMENT (key over 4096 bytes, value over ~64 MiB),
 * ERR_BROKEN, ERR_PEER_FAILURE / ERR_TIMEOUT (the client is then broken). */
cring_status_t cring_store_set(cring_store_t *client, const char *key, const void *value,
                               size_t len) {
    size_t klen = 0;
    CRING_CHECK(client_usable(client));
    CRING_CHECK(check_key(key, &klen));
    if (len && !value)
        return cring__fail(cring__thread_errmsg(), CRING_ERR_INVALID_ARGUMENT, "value is NULL");
    size_t body = 4 + klen;
    if (len > STORE_MAX_MESSAGE_BYTES - 1 - body)
        return cring__fail(cring__thread_errmsg(), CRING_ERR_INVALID_ARGUMENT,
                           "store value of %zu bytes is over the %u byte message limit", len,
                           STORE_MAX_MESSAGE_BYTES);
    uint8_t head[5 + 4 + STORE_MAX_KEY_BYTES];
    size_t n = frame_head(head, OP_SET, body, len);
    put_u32(head + n, (uint32_t)klen);
    memcpy(head + n + 4, key, klen);
    uint8_t status;
    uint8_t *payload;
    size_t payload_len;
    CRING_CHECK(client_call(client, head, n + body, value, len,
                            cring__now_s() + client->op_timeout_s, "set", &status, &payload,
                            &payload_len));
    free(payload);
    if (status != REPLY_OK) return reply_error(client, status, "set", key);
    return CRING_OK;
}

/* Contract: see cring.h. The server answers TIMEOUT itself when timeout_s
 * passes, so after ERR_TIMEOUT the client stays usable; only if the server
 * does not answer within timeout_s + 10 s is the client closed (later calls
 * give ERR_BROKEN). timeout_s <= 0 checks once without waiting. On error
 * *value_out is NULL. The buffer always has one extra NUL byte after the
 * value (so a zero-length value gives a non-NULL buffer holding "\0"). */
cring_status_t cring_store_get(cring_store_t *client, const char *key, double timeout_s,
                               void **value_out, size_t *len_out) {
    size_t klen = 0;
    if (value_out) *value_out = NULL;
    if (len_out) *len_out = 0;
    CRING_CHECK(client_usable(client));
    CRING_CHECK(check_key(key, &klen));
    if (!value_out || !len_out)
        return cring__fail(cring__thread_errmsg(), CRING_ERR_INVALID_ARGUMENT,
                           "value_out and len_out must not be NULL");
    uint64_t timeout_ms = timeout_to_ms(timeout_s);
    size_t body = 8 + 4 + klen;
    uint8_t head[5 + 8 + 4 + STORE_MAX_KEY_BYTES];
    size_t n = frame_head(head, OP_GET, body, 0);
    put_u64(head + n, timeout_ms);
    put_u32(head + n + 8, (uint32_t)klen);
    memcpy(head + n + 12, key, klen);
    uint8_t status;
    uint8_t *payload;
    size_t payload_len;
    double reply_deadline = cring__now_s() + (double)timeout_ms / 1000.0 + CLIENT_REPLY_GRACE_S;
    CRING_CHECK(client_call(client, head, n + body, NULL, 0, reply_deadline, "get", &status,
                            &payload, &payload_len));
    if (status == REPLY_TIMEOUT) {
        free(payload);
        return cring__fail(cring__thread_errmsg(), CRING_ERR_TIMEOUT,
                           "key '%s' did not appear in the rendezvous store at %s:%d within %.3g s",
                           key, client->addr, client->port, timeout_s);
    }
    if (status != REPLY_OK) {
        free(payload);
        return reply_error(client, status, "get", key);
    }
    if (!payload) {
        payload = malloc(1);
        if (!payload)
            return cring__fail(cring__thread_errmsg(), CRING_ERR_NO_MEMORY, "out of memory");
        payload[0] = 0;
    }
    *value_out = payload;
    *len_out = payload_len;
    return CRING_OK;
}

/* Contract: see cring.h. The value is stored as 8 bytes little-endian;
 * arithmetic wraps modulo 2^64. Errors: ERR_INVALID_ARGUMENT (the key holds
 * a value that is not 8 bytes), ERR_BROKEN, ERR_PEER_FAILURE, ERR_TIMEOUT. */
cring_status_t cring_store_add(cring_store_t *client, const char *key, int64_t delta,
                               int64_t *new_value_out) {
    size_t klen = 0;
    CRING_CHECK(client_usable(client));
    CRING_CHECK(check_key(key, &klen));
    size_t body = 4 + klen + 8;
    uint8_t head[5 + 4 + STORE_MAX_KEY_BYTES + 8];
    size_t n = frame_head(head, OP_ADD, body, 0);
    put_u32(head + n, (uint32_t)klen);
    memcpy(head + n + 4, key, klen);
    put_u64(head + n + 4 + klen, (uint64_t)delta);
    uint8_t status;
    uint8_t *payload;
    size_t payload_len;
    CRING_CHECK(client_call(client, head, n + body, NULL, 0,
                            cring__now_s() + client->op_timeout_s, "add", &status, &payload,
                            &payload_len));
    if (status != REPLY_OK) {
        free(payload);
        return reply_error(client, status, "add", key);
    }
    if (payload_len != 8) {
        free(payload);
        client_break(client);
        return cring__fail(cring__thread_errmsg(), CRING_ERR_PROTOCOL,
                           "store add reply from %s:%d has %zu bytes, not 8", client->addr,
                           client->port, payload_len);
    }
    uint64_t v = get_u64(payload);
    free(payload);
    if (new_value_out) memcpy(new_value_out, &v, sizeof v);
    return CRING_OK;
}

/* Contract: see cring.h. Same timeout semantics as cring_store_get; the
 * message names the first key still missing. nkeys == 0 returns at once. */
cring_status_t cring_store_wait(cring_store_t *client, const char *const *keys, size_t nkeys,
                                double timeout_s) {
    CRING_CHECK(client_usable(client));
    if (nkeys == 0) return CRING_OK;
    if (!keys)
        return cring__fail(cring__thread_errmsg(), CRING_ERR_INVALID_ARGUMENT, "keys is NULL");
    size_t body = 8 + 4;
    for (size_t i = 0; i < nkeys; i++) {
        size_t klen = 0;
        CRING_CHECK(check_key(keys[i], &klen));
        body += 4 + klen;
        if (body > STORE_MAX_MESSAGE_BYTES - 1)
            return cring__fail(cring__thread_errmsg(), CRING_ERR_INVALID_ARGUMENT,
                               "too many keys for one store wait");
    }
    uint8_t *msg = malloc(5 + body);
    if (!msg) return cring__fail(cring__thread_errmsg(), CRING_ERR_NO_MEMORY, "out of memory");
    uint64_t timeout_ms = timeout_to_ms(timeout_s);
    size_t n = frame_head(msg, OP_WAIT, body, 0);
    put_u64(msg + n, timeout_ms);
    put_u32(msg + n + 8, (uint32_t)nkeys);
    n += 12;
    for (size_t i = 0; i < nkeys; i++) {
        size_t klen = strlen(keys[i]);
        put_u32(msg + n, (uint32_t)klen);
        memcpy(msg + n + 4, keys[i], klen);
        n += 4 + klen;
    }
    uint8_t status;
    uint8_t *payload;
    size_t payload_len;
    double reply_deadline = cring__now_s() + (double)timeout_ms / 1000.0 + CLIENT_REPLY_GRACE_S;
    cring_status_t st = client_call(client, msg, n, NULL, 0, reply_deadline, "wait", &status,
                                    &payload, &payload_len);
    free(msg);
    if (st != CRING_OK) return st;
    if (status == REPLY_TIMEOUT) {
        int shown = (int)CRING_MIN(payload_len, (size_t)200);
        st = cring__fail(cring__thread_errmsg(), CRING_ERR_TIMEOUT,
                         "key '%.*s' did not appear in the rendezvous store at %s:%d within %.3g s",
                         shown, payload ? (const char *)payload : "", client->addr, client->port,
                         timeout_s);
    } else if (status != REPLY_OK) {
        st = reply_error(client, status, "wait", keys[0]);
    }
    free(payload);
    return st;
}

/* Contract: see cring.h. Only shuts the socket down (never closes it), so it
 * is safe against a call blocked in another thread, which then fails. */
void cring_store_interrupt(cring_store_t *client) {
    if (!client) return;
    int fd = client->fd;
    if (fd >= 0) shutdown(fd, SHUT_RDWR);
}

/* tcp.c: the TCP point-to-point transport: an authenticated full mesh of
 * sockets built through the rendezvous store, and a sendrecv that progresses
 * both directions in one poll() loop. Knows nothing of dtypes or collectives. */
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <math.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "../common/auth.h"
#include "../common/net.h"
#include "transport.h"

/* ---- Mesh handshake -----------------------------------------------------------
 * The lower rank connects; the accepting (higher) rank sends "CRT1" + 16-byte
 * nonce; the connector answers "CRT1", u32 from_rank, u32 to_rank, u32 size
 * (little-endian) and HMAC-SHA256(secret, nonce); the acceptor replies one
 * status byte (0 accepted). Connections that fail the check are dropped and
 * the acceptor keeps waiting for the real peer. */
#define TCP_MAGIC "CRT1"
#define TCP_MAGIC_BYTES 4
#define TCP_HELLO_BYTES (TCP_MAGIC_BYTES + CRING__NONCE_BYTES)
#define TCP_ANSWER_BYTES (TCP_MAGIC_BYTES + 12 + CRING__AUTH_BYTES)
/* An accepted connection must finish its handshake within this (a stray
 * connection must not hold the mesh up for the whole timeout). */
#define TCP_ACCEPT_HANDSHAKE_S 10.0
/* Socket buffer size unless CRING_TCP_BUFFER_BYTES says otherwise (0 keeps
 * the kernel's auto-tuning). */
#define TCP_DEFAULT_BUFFER_BYTES (4L << 20)
/* Listen address when the communicator gives none. */
#define TCP_FALLBACK_LISTEN_ADDR "127.0.0.1"

typedef struct tcp_p2p {
    cring__p2p_t base;
    int *fds;              /* fds[peer]; -1 for this rank and unconnected peers */
    cring__errmsg_t *err;  /* owned by the communicator */
    double timeout_s;
    int broken;            /* an earlier failure left the streams out of step */
} tcp_p2p_t;

static void put_u32(uint8_t *p, uint32_t v) {
    for (int i = 0; i < 4; i++) p[i] = (uint8_t)(v >> (8 * i));
}
static uint32_t get_u32(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static int poll_ms_until(double deadline, double now) {
    double left = deadline - now;
    if (!(left > 0)) return 0;
    double ms = ceil(left * 1000.0);
    return ms > (double)INT_MAX ? INT_MAX : (int)ms;
}

/* ---- sendrecv -------------------------------------------------------------- */

static cring_status_t tcp_fail(tcp_p2p_t *t, cring_status_t st, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static cring_status_t tcp_fail(tcp_p2p_t *t, cring_status_t st, const char *fmt, ...) {
    if (t->err) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(t->err->text, sizeof t->err->text, fmt, ap);
        va_end(ap);
    }
    if (st != CRING_ERR_INVALID_ARGUMENT) t->broken = 1;
    return st;
}

static int is_peer_gone(int e) {
    return e == EPIPE || e == ECONNRESET || e == ENOTCONN || e == ECONNABORTED ||
           e == ETIMEDOUT || e == EHOSTUNREACH;
}

/* Contract: see cring__p2p_ops_t.sendrecv in transport.h. A peer equal to
 * this rank or out of range on an active side is ERR_INVALID_ARGUMENT (the
 * transport stays usable); any other failure leaves it broken and later
 * calls return ERR_BROKEN. Not thread-safe. */
static cring_status_t tcp_sendrecv(cring__p2p_t *p2p, int send_peer, const void *send_buf,
                                   size_t send_bytes, int recv_peer, void *recv_buf,
                                   size_t recv_bytes) {
    tcp_p2p_t *t = (tcp_p2p_t *)p2p;
    const int rank = p2p->rank, size = p2p->size;
    int do_send = send_peer >= 0 && send_bytes > 0;
    int do_recv = recv_peer >= 0 && recv_bytes > 0;
    if (do_send && (send_peer >= size || send_peer == rank || !send_buf))
        return tcp_fail(t, CRING_ERR_INVALID_ARGUMENT,
                        "rank %d: invalid send to peer %d of %d (%zu bytes)", rank, send_peer,
                        size, send_bytes);
    if (do_recv && (recv_peer >= size || recv_peer == rank || !recv_buf))
        return tcp_fail(t, CRING_ERR_INVALID_ARGUMENT,
                        "rank %d: invalid receive from peer %d of %d (%zu bytes)", rank,
                        recv_peer, size, recv_bytes);
    if (!do_send && !do_recv) return CRING_OK;
    if (t->broken)
        return tcp_fail(t, CRING_ERR_BROKEN,
                        "rank %d: TCP transport is unusable after an earlier failure", rank);

    const int sfd = do_send ? t->fds[send_peer] : -1;
    const int rfd = do_recv ? t->fds[recv_peer] : -1;
    const char *sp = send_buf;
    char *rp = recv_buf;
    size_t sent = 0, got = 0;
    double last_progress = cring__now_s();

    while ((do_send && sent < send_bytes) || (do_recv && got < recv_bytes)) {
        int progressed = 0;
        if (do_send && sent < send_bytes) {
            ssize_t w = send(sfd, sp + sent, send_bytes - sent, MSG_NOSIGNAL | MSG_DONTWAIT);
            if (w > 0) {
                sent += (size_t)w;
                progressed = 1;
            } else if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
                int e = errno;
                if (is_peer_gone(e))
                    return tcp_fail(t, CRING_ERR_PEER_FAILURE,
                                    "rank %d closed its connection to rank %d (%s) after %zu of "
                                    "%zu bytes were sent to it; rank %d probably exited",
                                    send_peer, rank, strerror(e), sent, send_bytes, send_peer);
                return tcp_fail(t, CRING_ERR_SYSTEM, "rank %d: send to rank %d failed: %s", rank,
                                send_peer, strerror(e));
            }
        }
        if (do_recv && got < recv_bytes) {
            ssize_t r = recv(rfd, rp + got, recv_bytes - got, MSG_DONTWAIT);
            if (r > 0) {
                got += (size_t)r;
                progressed = 1;
            } else if (r == 0) {
                return tcp_fail(t, CRING_ERR_PEER_FAILURE,
                                "rank %d closed its connection to rank %d after %zu of %zu bytes "
                                "were received from it; rank %d probably exited",
                                recv_peer, rank, got, recv_bytes, recv_peer);
            } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
                int e = errno;
                if (is_peer_gone(e))
                    return tcp_fail(t, CRING_ERR_PEER_FAILURE,
                                    "rank %d closed its connection to rank %d (%s) after %zu of "
                                    "%zu bytes were received from it; rank %d probably exited",
                                    recv_peer, rank, strerror(e), got, recv_bytes, recv_peer);
                return tcp_fail(t, CRING_ERR_SYSTEM, "rank %d: receive from rank %d failed: %s",
                                rank, recv_peer, strerror(e));
            }
        }
        double now = cring__now_s();
        if (progressed) {
            last_progress = now;
            continue;
        }
        double deadline = last_progress + t->timeout_s;
        if (now >= deadline) {
            char sdesc[128] = "", rdesc[128] = "";
            if (do_send && sent < send_bytes)
                snprintf(sdesc, sizeof sdesc, " sent %zu of %zu bytes to rank %d;", sent,
                         send_bytes, send_peer);
            if (do_recv && got < recv_bytes)
                snprintf(rdesc, sizeof rdesc, " received %zu of %zu bytes from rank %d;", got,
                         recv_bytes, recv_peer);
            return tcp_fail(t, CRING_ERR_TIMEOUT,
                            "rank %d: no progress for %.1f s:%s%s the peer is hung or too slow",
                            rank, t->timeout_s, sdesc, rdesc);
        }
        struct pollfd pfd[2];
        nfds_t n = 0;
        short sev = (do_send && sent < send_bytes) ? POLLOUT : 0;
        short rev = (do_recv && got < recv_bytes) ? POLLIN : 0;
        if (sev && rev && sfd == rfd) {
            pfd[n++] = (struct pollfd){.fd = sfd, .events = (short)(sev | rev)};
        } else {
            if (sev) pfd[n++] = (struct pollfd){.fd = sfd, .events = sev};
            if (rev) pfd[n++] = (struct pollfd){.fd = rfd, .events = rev};
        }
        int pr = poll(pfd, n, poll_ms_until(deadline, now));
        if (pr < 0 && errno != EINTR)
            return tcp_fail(t, CRING_ERR_SYSTEM, "rank %d: poll failed: %s", rank,
                            strerror(errno));
        /* Readiness, hang-up and errors are all discovered by the next send/recv. */
    }
    return CRING_OK;
}

/* Contract: see cring__p2p_ops_t.idle_wait. Polls every peer socket for
 * input (data or hang-up) and the wake descriptor; reads nothing. */
static int tcp_idle_wait(cring__p2p_t *p2p, int wake_fd, double max_wait_s) {
    tcp_p2p_t *t = (tcp_p2p_t *)p2p;
    struct pollfd stack_pfd[65];
    struct pollfd *pfd = p2p->size + 1 <= 65 ? stack_pfd : calloc((size_t)p2p->size + 1, sizeof *pfd);
    if (!pfd) return 0;
    nfds_t n = 0;
    if (wake_fd >= 0) pfd[n++] = (struct pollfd){.fd = wake_fd, .events = POLLIN};
    for (int i = 0; i < p2p->size; i++)
        if (t->fds[i] >= 0) pfd[n++] = (struct pollfd){.fd = t->fds[i], .events = POLLIN};
    int ms = max_wait_s > 2e6 ? 2000000000 : (int)(max_wait_s * 1000.0);
    int peer_input = 0;
    if (poll(pfd, n, ms < 0 ? 0 : ms) > 0) {
        for (nfds_t i = wake_fd >= 0 ? 1 : 0; i < n; i++)
            if (pfd[i].revents) peer_input = 1;
    }
    if (pfd != stack_pfd) free(pfd);
    return peer_input;
}

/* Contract: see cring__p2p_ops_t.cancel. */
static void tcp_cancel(cring__p2p_t *p2p) {
    tcp_p2p_t *t = (tcp_p2p_t *)p2p;
    t->broken = 1;
    for (int i = 0; i < p2p->size; i++)
        if (t->fds[i] >= 0) shutdown(t->fds[i], SHUT_RDWR);
}

/* Contract: see cring__p2p_ops_t.destroy. Closes every socket; never
 * communicates, so it cannot block on a dead peer. NULL is a no-op. */
static void tcp_destroy(cring__p2p_t *p2p) {
    tcp_p2p_t *t = (tcp_p2p_t *)p2p;
    if (!t) return;
    if (t->fds) {
        for (int i = 0; i < p2p->size; i++)
            if (t->fds[i] >= 0) close(t->fds[i]);
        free(t->fds);
    }
    free(t);
}

static const cring__p2p_ops_t tcp_ops = {
    .name = "tcp",
    .sendrecv = tcp_sendrecv,
    .idle_wait = tcp_idle_wait,
    .cancel = tcp_cancel,
    .destroy = tcp_destroy,
};

/* ---- mesh construction ---------------------------------------------------------- */

/* Split "host:port" or "[v6]:port" (value, len bytes, not NUL-terminated). */
static int parse_endpoint(const void *value, size_t len, char *host, size_t host_len,
                          int *port) {
    char text[320];
    if (len == 0 || len >= sizeof text) return -1;
    memcpy(text, value, len);
    text[len] = '\0';
    char *colon = strrchr(text, ':');
    if (!colon || colon == text) return -1;
    *colon = '\0';
    char *end;
    long p = strtol(colon + 1, &end, 10);
    if (*end != '\0' || p <= 0 || p > 65535) return -1;
    char *h = text;
    size_t hl = strlen(h);
    if (h[0] == '[' && hl >= 2 && h[hl - 1] == ']') {
        h[hl - 1] = '\0';
        h++;
    }
    size_t h_len = strlen(h);
    if (h_len == 0 || h_len >= host_len) return -1;
    memcpy(host, h, h_len + 1);
    *port = (int)p;
    return 0;
}

static void tune_socket(int fd, long buffer_bytes) {
    int one = 1;
    (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    if (buffer_bytes > 0) {
        int b = (int)CRING_MIN(buffer_bytes, (long)INT_MAX);
        (void)setsockopt(fd, SOL_SOCKET, SO_SNDBUF, &b, sizeof b);
        (void)setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &b, sizeof b);
    }
}

/* Connect to peer (> rank) at host:port and authenticate. */
static cring_status_t connect_peer(tcp_p2p_t *t, const cring__transport_init_t *init, int peer,
                                   const char *host, int port, double deadline) {
    cring__errmsg_t detail;
    cring_status_t st;
    int fd = -1;
    st = cring__net_connect(host, port, deadline, &fd, &detail);
    if (st != CRING_OK)
        return cring__fail(t->err, st, "rank %d: cannot connect to rank %d at %s:%d: %s",
                           init->rank, peer, host, port, detail.text);
    uint8_t hello[TCP_HELLO_BYTES];
    CRING_CHECK_GOTO(cring__net_recv_all(fd, hello, sizeof hello, deadline, &detail), st, cleanup);
    if (memcmp(hello, TCP_MAGIC, TCP_MAGIC_BYTES) != 0) {
        st = cring__fail(&detail, CRING_ERR_PROTOCOL, "the listener is not a cring rank");
        goto cleanup;
    }
    uint8_t answer[TCP_ANSWER_BYTES];
    memcpy(answer, TCP_MAGIC, TCP_MAGIC_BYTES);
    put_u32(answer + 4, (uint32_t)init->rank);
    put_u32(answer + 8, (uint32_t)peer);
    put_u32(answer + 12, (uint32_t)init->size);
    cring__auth_response(init->secret, hello + TCP_MAGIC_BYTES, answer + 16);
    CRING_CHECK_GOTO(cring__net_send_all(fd, answer, sizeof answer, deadline, &detail), st,
                     cleanup);
    uint8_t verdict = 1;
    st = cring__net_recv_all(fd, &verdict, 1, deadline, &detail);
    if (st == CRING_ERR_PEER_FAILURE) {
        st = cring__fail(&detail, CRING_ERR_PEER_FAILURE,
                         "it closed the connection before answering (it exited, or refused "
                         "the job secret)");
        goto cleanup;
    }
    if (st != CRING_OK) goto cleanup;
    if (verdict != 0) {
        st = cring__fail(&detail, CRING_ERR_AUTH,
                         "it refused the handshake (job secret or world size differ)");
        goto cleanup;
    }
    t->fds[peer] = fd;
    return CRING_OK;

cleanup:
    close(fd);
    return cring__fail(t->err, st, "rank %d: handshake with rank %d at %s:%d failed: %s",
                       init->rank, peer, host, port, detail.text);
}

/* Accept one connection and authenticate it as some rank below ours.
 * Returns CRING_OK with *accepted set to 1 when a peer joined, CRING_OK with
 * *accepted 0 when a stray connection was dropped, or an error. */
static cring_status_t accept_peer(tcp_p2p_t *t, const cring__transport_init_t *init,
                                  int listen_fd, double deadline, int *accepted,
                                  cring__errmsg_t *accept_err) {
    cring__errmsg_t detail;
    int fd = -1;
    *accepted = 0;
    cring_status_t st = cring__net_accept(listen_fd, deadline, &fd, accept_err);
    if (st != CRING_OK) return st; /* the caller names the missing ranks */
    uint8_t hello[TCP_HELLO_BYTES];
    memcpy(hello, TCP_MAGIC, TCP_MAGIC_BYTES);
    cring__random_bytes(hello + TCP_MAGIC_BYTES, CRING__NONCE_BYTES);
    double hs_deadline = CRING_MIN(deadline, cring__now_s() + TCP_ACCEPT_HANDSHAKE_S);
    uint8_t answer[TCP_ANSWER_BYTES];
    if (cring__net_send_all(fd, hello, sizeof hello, hs_deadline, &detail) != CRING_OK ||
        cring__net_recv_all(fd, answer, sizeof answer, hs_deadline, &detail) != CRING_OK) {
        cring__log(CRING__LOG_WARNING, init->rank, "dropped a connection during the handshake: %s",
                   detail.text);
        close(fd);
        return CRING_OK;
    }
    uint8_t expect[CRING__AUTH_BYTES];
    cring__auth_response(init->secret, hello + TCP_MAGIC_BYTES, expect);
    uint32_t from = get_u32(answer + 4), to = get_u32(answer + 8), size = get_u32(answer + 12);
    int authed = memcmp(answer, TCP_MAGIC, TCP_MAGIC_BYTES) == 0 &&
                 cring__auth_equal(answer + 16, expect);
    int fits = authed && to == (uint32_t)init->rank && size == (uint32_t)init->size &&
               from < (uint32_t)init->rank && t->fds[from] < 0;
    uint8_t verdict = fits ? 0 : 1;
    (void)cring__net_send_all(fd, &verdict, 1, hs_deadline, &detail);
    if (!fits) {
        cring__log(CRING__LOG_WARNING, init->rank,
                   "refused a connection: %s (claims rank %" PRIu32 " of %" PRIu32
                   " to rank %" PRIu32 ")",
                   authed ? "unexpected ranks or world size" : "wrong job secret", from, size, to);
        close(fd);
        return CRING_OK;
    }
    t->fds[from] = fd;
    *accepted = 1;
    return CRING_OK;
}

/* Contract: see transport.h. init (and the strings it points to) need only
 * live for the call; init->err must outlive the transport. listen_addr NULL
 * or "" means 127.0.0.1 (single-host only: the communicator should pass the
 * address from cring__net_local_addr_toward(store address)). The socket binds
 * listen_addr, falling back to every interface when that address is not
 * local; the published value is "listen_addr:port" ("[v6]:port" for IPv6
 * literals). Every wait is bounded by init->timeout_s (600 s when <= 0).
 * Errors: ERR_INVALID_ARGUMENT, ERR_TIMEOUT (a rank never showed up: the
 * message names it), ERR_AUTH (a peer refused the secret), ERR_SYSTEM,
 * ERR_NO_MEMORY and store errors. Not thread-safe with itself. */
cring_status_t cring__tcp_create(const cring__transport_init_t *init, cring__p2p_t **out) {
    cring_status_t st = CRING_OK;
    tcp_p2p_t *t = NULL;
    int listen_fd = -1;
    void *value = NULL;
    if (!out) return CRING_ERR_INVALID_ARGUMENT;
    *out = NULL;
    if (!init) return CRING_ERR_INVALID_ARGUMENT;
    if (init->size < 1 || init->rank < 0 || init->rank >= init->size)
        return cring__fail(init->err, CRING_ERR_INVALID_ARGUMENT, "invalid rank %d of size %d",
                           init->rank, init->size);
    if (init->size > 1 && !init->store)
        return cring__fail(init->err, CRING_ERR_INVALID_ARGUMENT,
                           "TCP transport needs a store client");
    t = calloc(1, sizeof *t);
    if (!t) return cring__fail(init->err, CRING_ERR_NO_MEMORY, "out of memory");
    t->base.ops = &tcp_ops;
    t->base.rank = init->rank;
    t->base.size = init->size;
    t->err = init->err;
    t->timeout_s = init->timeout_s > 0 ? init->timeout_s : 600.0;
    t->fds = malloc((size_t)init->size * sizeof *t->fds);
    if (!t->fds) {
        st = cring__fail(init->err, CRING_ERR_NO_MEMORY, "out of memory");
        goto cleanup;
    }
    for (int i = 0; i < init->size; i++) t->fds[i] = -1;
    if (init->size == 1) {
        *out = &t->base;
        return CRING_OK;
    }

    const int rank = init->rank, size = init->size;
    const double deadline = cring__now_s() + t->timeout_s;
    const char *prefix = init->key_prefix ? init->key_prefix : "";
    const char *listen_addr =
        (init->listen_addr && *init->listen_addr) ? init->listen_addr : TCP_FALLBACK_LISTEN_ADDR;
    long buffer_bytes = cring__env_long("CRING_TCP_BUFFER_BYTES", TCP_DEFAULT_BUFFER_BYTES);
    cring__errmsg_t detail;
    char key[512];

    /* 1. Listen (buffer sizes set here are inherited by accepted sockets). */
    int port = 0;
    if (cring__net_listen(listen_addr, 0, size + 16, &listen_fd, &port, &detail) != CRING_OK) {
        cring__log(CRING__LOG_INFO, rank, "cannot bind %s (%s); listening on every interface",
                   listen_addr, detail.text);
        CRING_CHECK_GOTO(cring__net_listen(NULL, 0, size + 16, &listen_fd, &port, init->err), st,
                         cleanup);
    }
    if (buffer_bytes > 0) tune_socket(listen_fd, buffer_bytes);

    /* 2. Publish our endpoint. */
    char endpoint[320];
    int is_v6_literal = strchr(listen_addr, ':') != NULL;
    snprintf(endpoint, sizeof endpoint, is_v6_literal ? "[%s]:%d" : "%s:%d", listen_addr, port);
    snprintf(key, sizeof key, "%s/tcp/%d", prefix, rank);
    st = cring_store_set(init->store, key, endpoint, strlen(endpoint));
    if (st != CRING_OK) {
        st = cring__fail(init->err, st, "rank %d: cannot publish its TCP address: %s", rank,
                         cring__thread_errmsg()->text);
        goto cleanup;
    }

    /* 3. Connect to every higher rank. Higher ranks finish their own connects
     * before accepting, and the highest rank only accepts, so this never
     * waits in a cycle. */
    for (int peer = rank + 1; peer < size; peer++) {
        size_t len = 0;
        snprintf(key, sizeof key, "%s/tcp/%d", prefix, peer);
        st = cring_store_get(init->store, key, CRING_MAX(deadline - cring__now_s(), 0.0), &value,
                             &len);
        if (st != CRING_OK) {
            st = cring__fail(init->err, st, "rank %d: rank %d never published its TCP address: %s",
                             rank, peer, cring__thread_errmsg()->text);
            goto cleanup;
        }
        char host[300];
        int peer_port = 0;
        if (parse_endpoint(value, len, host, sizeof host, &peer_port) != 0) {
            st = cring__fail(init->err, CRING_ERR_PROTOCOL,
                             "rank %d: malformed TCP address for rank %d under key %s", rank, peer,
                             key);
            goto cleanup;
        }
        free(value);
        value = NULL;
        CRING_CHECK_GOTO(connect_peer(t, init, peer, host, peer_port, deadline), st, cleanup);
    }

    /* 4. Accept every lower rank, in whatever order they arrive. */
    for (int joined = 0; joined < rank;) {
        int accepted = 0;
        st = accept_peer(t, init, listen_fd, deadline, &accepted, &detail);
        if (st != CRING_OK) {
            int missing = -1;
            for (int i = 0; i < rank && missing < 0; i++)
                if (t->fds[i] < 0) missing = i;
            st = cring__fail(init->err, st,
                             "rank %d: %d of %d lower ranks connected within %.1f s (rank %d "
                             "never did): %s",
                             rank, joined, rank, t->timeout_s, missing, detail.text);
            goto cleanup;
        }
        joined += accepted;
    }

    /* 5. Every socket non-blocking, no Nagle, large buffers. */
    for (int i = 0; i < size; i++) {
        if (t->fds[i] < 0) continue;
        if (cring__net_set_nonblocking(t->fds[i], 1) != CRING_OK) {
            st = cring__fail(init->err, CRING_ERR_SYSTEM, "rank %d: fcntl failed: %s", rank,
                             strerror(errno));
            goto cleanup;
        }
        tune_socket(t->fds[i], buffer_bytes);
    }
    close(listen_fd);
    *out = &t->base;
    return CRING_OK;

cleanup:
    free(value);
    if (listen_fd >= 0) close(listen_fd);
    tcp_destroy(t ? &t->base : NULL);
    return st;
}

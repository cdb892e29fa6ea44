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
#include "../common/wire.h"
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
    int *fds;             /* fds[peer]; -1 for this rank and unconnected peers */
    cring__errmsg_t *err; /* owned by the communicator */
    double timeout_s;
    int broken;                 /* an earlier failure left the streams out of step */
    cring_status_t fail_status; /* the first failure: what cancel tells the peers */
    uint8_t *reasons;           /* reasons[peer]: why it stopped (urgent byte), 0 if unknown */
} tcp_p2p_t;

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
    if (st != CRING_ERR_INVALID_ARGUMENT) {
        t->broken = 1;
        if (t->fail_status == CRING_OK && st != CRING_ERR_BROKEN) t->fail_status = st;
    }
    return st;
}

static int is_peer_gone(int e) {
    return e == EPIPE || e == ECONNRESET || e == ENOTCONN || e == ECONNABORTED || e == ETIMEDOUT ||
           e == EHOSTUNREACH;
}

/* ---- why a peer stopped ----------------------------------------------------------
 * A rank that fails shuts its connections down so that every peer stops too
 * (tcp_cancel). Just before, it sends each peer one byte of TCP urgent data
 * saying why: it timed out waiting, one of its own peers died, or something
 * else. A rank that then sees the connection end reads that byte (MSG_OOB),
 * so when one rank hangs every rank fails with ERR_TIMEOUT, as on shared
 * memory, instead of ERR_PEER_FAILURE blaming the rank that gave up first.
 * No byte: the process itself ended (killed, crashed, exited). Urgent data
 * never mixes with the byte stream, but the kernel forgets it once the
 * normal reader has passed it, so every poll here asks for POLLPRI and the
 * byte is read as soon as it arrives (a rank blocked on the peer that gives
 * up, the usual case, always sees it). Best effort: when it is missed the
 * error is ERR_PEER_FAILURE saying the peer exited. */
#define REASON_TIMEOUT 'T'
#define REASON_PEER_FAILURE 'P'
#define REASON_OTHER 'E'

/* Keep the reason byte peer sent on fd, if one is waiting (POLLPRI). */
static void note_reason(tcp_p2p_t *t, int peer, int fd) {
    uint8_t why = 0;
    if (recv(fd, &why, 1, MSG_OOB | MSG_DONTWAIT) == 1 && t->reasons) t->reasons[peer] = why;
}

/* The connection to `peer` (fd) ended or was reset while `progress` (how far
 * this exchange got, for the message) was under way: fail with the kind of
 * error the peer reported, or ERR_PEER_FAILURE when it just went away. */
static cring_status_t peer_stopped(tcp_p2p_t *t, int peer, int fd, const char *progress) {
    const int rank = t->base.rank;
    note_reason(t, peer, fd); /* not read yet? (it is lost once read past) */
    uint8_t why = t->reasons ? t->reasons[peer] : 0;
    switch (why) {
    case REASON_TIMEOUT:
        return tcp_fail(t, CRING_ERR_TIMEOUT,
                        "rank %d timed out waiting for another rank (CRING_TIMEOUT_SECONDS) and "
                        "stopped; its connection to rank %d closed %s",
                        peer, rank, progress);
    case REASON_PEER_FAILURE:
        return tcp_fail(t, CRING_ERR_PEER_FAILURE,
                        "rank %d stopped because another rank died or closed its connections; "
                        "its connection to rank %d closed %s",
                        peer, rank, progress);
    case REASON_OTHER:
        return tcp_fail(t, CRING_ERR_PEER_FAILURE,
                        "rank %d stopped after an error of its own; its connection to rank %d "
                        "closed %s",
                        peer, rank, progress);
    default:
        return tcp_fail(t, CRING_ERR_PEER_FAILURE,
                        "rank %d closed its connection to rank %d %s; rank %d exited or was "
                        "killed",
                        peer, rank, progress, peer);
    }
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
                        "rank %d: invalid send to peer %d of %d (%zu bytes)", rank, send_peer, size,
                        send_bytes);
    if (do_recv && (recv_peer >= size || recv_peer == rank || !recv_buf))
        return tcp_fail(t, CRING_ERR_INVALID_ARGUMENT,
                        "rank %d: invalid receive from peer %d of %d (%zu bytes)", rank, recv_peer,
                        size, recv_bytes);
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
                if (is_peer_gone(e)) {
                    char progress[160];
                    snprintf(progress, sizeof progress,
                             "(%s) after %zu of %zu bytes were sent to it", strerror(e), sent,
                             send_bytes);
                    return peer_stopped(t, send_peer, sfd, progress);
                }
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
                char progress[160];
                snprintf(progress, sizeof progress, "after %zu of %zu bytes were received from it",
                         got, recv_bytes);
                return peer_stopped(t, recv_peer, rfd, progress);
            } else if (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
                int e = errno;
                if (is_peer_gone(e)) {
                    char progress[160];
                    snprintf(progress, sizeof progress,
                             "(%s) after %zu of %zu bytes were received from it", strerror(e), got,
                             recv_bytes);
                    return peer_stopped(t, recv_peer, rfd, progress);
                }
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
        short sev = (do_send && sent < send_bytes) ? POLLOUT | POLLPRI : 0;
        short rev = (do_recv && got < recv_bytes) ? POLLIN | POLLPRI : 0;
        int speer = -1, rpeer = -1; /* the peer behind pfd[0] and pfd[1] */
        if (sev && rev && sfd == rfd) {
            speer = send_peer;
            pfd[n++] = (struct pollfd){.fd = sfd, .events = (short)(sev | rev)};
        } else {
            if (sev) {
                speer = send_peer;
                pfd[n++] = (struct pollfd){.fd = sfd, .events = sev};
            }
            if (rev) {
                rpeer = recv_peer;
                pfd[n++] = (struct pollfd){.fd = rfd, .events = rev};
            }
        }
        int pr = poll(pfd, n, poll_ms_until(deadline, now));
        if (pr < 0 && errno != EINTR)
            return tcp_fail(t, CRING_ERR_SYSTEM, "rank %d: poll failed: %s", rank, strerror(errno));
        /* A peer's reason byte is read at once (see peer_stopped); readiness,
         * hang-up and errors are discovered by the next send/recv. */
        for (nfds_t i = 0; pr > 0 && i < n; i++)
            if (pfd[i].revents & POLLPRI)
                note_reason(t, i == 0 && speer >= 0 ? speer : rpeer, pfd[i].fd);
    }
    /* one writer (the driving thread): a plain relaxed add, no locked op */
    if (do_send)
        atomic_store_explicit(&p2p->bytes_sent,
                              atomic_load_explicit(&p2p->bytes_sent, memory_order_relaxed) +
                                  send_bytes,
                              memory_order_relaxed);
    if (do_recv)
        atomic_store_explicit(&p2p->bytes_received,
                              atomic_load_explicit(&p2p->bytes_received, memory_order_relaxed) +
                                  recv_bytes,
                              memory_order_relaxed);
    return CRING_OK;
}

/* Contract: see cring__p2p_ops_t.idle_wait. Polls every peer socket for
 * input (data or hang-up) and the wake descriptor; reads nothing from the
 * streams (a reason byte a stopping peer sent as urgent data is kept). */
static int tcp_idle_wait(cring__p2p_t *p2p, int wake_fd, double max_wait_s) {
    tcp_p2p_t *t = (tcp_p2p_t *)p2p;
    struct pollfd stack_pfd[65];
    struct pollfd *pfd =
        p2p->size + 1 <= 65 ? stack_pfd : calloc((size_t)p2p->size + 1, sizeof *pfd);
    if (!pfd) return 0;
    nfds_t n = 0;
    if (wake_fd >= 0) pfd[n++] = (struct pollfd){.fd = wake_fd, .events = POLLIN};
    for (int i = 0; i < p2p->size; i++)
        if (t->fds[i] >= 0) pfd[n++] = (struct pollfd){.fd = t->fds[i], .events = POLLIN | POLLPRI};
    int ms = max_wait_s > 2e6 ? 2000000000 : (int)(max_wait_s * 1000.0);
    int peer_input = 0;
    if (poll(pfd, n, ms < 0 ? 0 : ms) > 0) {
        nfds_t i = wake_fd >= 0 ? 1 : 0;
        for (int peer = 0; peer < p2p->size; peer++) {
            if (t->fds[peer] < 0) continue;
            if (pfd[i].revents) peer_input = 1;
            if (pfd[i].revents & POLLPRI) note_reason(t, peer, pfd[i].fd);
            i++;
        }
    }
    if (pfd != stack_pfd) free(pfd);
    return peer_input;
}

/* Contract: see cring__p2p_ops_t.cancel. Each peer first gets the reason
 * byte (see peer_stopped). */
static void tcp_cancel(cring__p2p_t *p2p) {
    tcp_p2p_t *t = (tcp_p2p_t *)p2p;
    t->broken = 1;
    uint8_t why = t->fail_status == CRING_ERR_TIMEOUT        ? REASON_TIMEOUT
                  : t->fail_status == CRING_ERR_PEER_FAILURE ? REASON_PEER_FAILURE
                                                             : REASON_OTHER;
    for (int i = 0; i < p2p->size; i++) {
        if (t->fds[i] < 0) continue;
        (void)send(t->fds[i], &why, 1, MSG_OOB | MSG_NOSIGNAL | MSG_DONTWAIT);
        shutdown(t->fds[i], SHUT_RDWR);
    }
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
    free(t->reasons);
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
static int parse_endpoint(const void *value, size_t len, char *host, size_t host_len, int *port) {
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
    cring__wire_put_u32(answer + 4, (uint32_t)init->rank);
    cring__wire_put_u32(answer + 8, (uint32_t)peer);
    cring__wire_put_u32(answer + 12, (uint32_t)init->size);
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

/* ---- accepting the lower ranks --------------------------------------------------
 * Handshakes of accepted connections run side by side in one poll() loop, so a
 * stray connection that says nothing (a port scanner, a stalled process) costs
 * nothing but a slot: it cannot hold the real peers up. A connection must
 * finish within TCP_ACCEPT_HANDSHAKE_S; when TCP_MAX_PENDING_HANDSHAKES are in
 * progress the oldest is dropped for a newcomer. */
#define TCP_MAX_PENDING_HANDSHAKES 64

typedef struct pending_handshake {
    int fd;
    double deadline;
    uint8_t hello[TCP_HELLO_BYTES];
    size_t hello_sent;
    uint8_t answer[TCP_ANSWER_BYTES];
    size_t answer_got;
} pending_handshake_t;

static void pending_drop(pending_handshake_t *p, int *npending, int i, int rank, const char *why) {
    if (why)
        cring__log(CRING__LOG_WARNING, rank, "dropped a connection during the handshake: %s", why);
    close(p[i].fd);
    p[i] = p[--*npending];
}

/* Judge a complete answer: returns the joining rank (its socket is stored and
 * told 0), or -1 after refusing it (told 1, closed). */
static int pending_judge(tcp_p2p_t *t, const cring__transport_init_t *init,
                         pending_handshake_t *h) {
    cring__errmsg_t detail;
    uint8_t expect[CRING__AUTH_BYTES];
    cring__auth_response(init->secret, h->hello + TCP_MAGIC_BYTES, expect);
    const uint8_t *a = h->answer;
    uint32_t from = cring__wire_get_u32(a + 4), to = cring__wire_get_u32(a + 8),
             size = cring__wire_get_u32(a + 12);
    int authed = memcmp(a, TCP_MAGIC, TCP_MAGIC_BYTES) == 0 && cring__auth_equal(a + 16, expect);
    int fits = authed && to == (uint32_t)init->rank && size == (uint32_t)init->size &&
               from < (uint32_t)init->rank && t->fds[from] < 0;
    uint8_t verdict = fits ? 0 : 1;
    /* One byte into an empty socket buffer: does not wait in practice. */
    cring_status_t st = cring__net_send_all(h->fd, &verdict, 1, cring__now_s() + 1.0, &detail);
    if (!fits || st != CRING_OK) {
        if (!fits)
            cring__log(CRING__LOG_WARNING, init->rank,
                       "refused a connection: %s (claims rank %" PRIu32 " of %" PRIu32
                       " to rank %" PRIu32 ")",
                       authed ? "unexpected ranks or world size" : "wrong job secret", from, size,
                       to);
        close(h->fd);
        return -1;
    }
    t->fds[from] = h->fd;
    return (int)from;
}

/* Step the handshake on p[i] (hello out, answer in). Returns 1 when the
 * answer is complete, 0 to keep waiting, -1 when the connection failed
 * (why says how). */
static int pending_progress(pending_handshake_t *h, const char **why) {
    while (h->hello_sent < TCP_HELLO_BYTES) {
        ssize_t w = send(h->fd, h->hello + h->hello_sent, TCP_HELLO_BYTES - h->hello_sent,
                         MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w > 0) {
            h->hello_sent += (size_t)w;
            continue;
        }
        if (w < 0 && errno == EINTR) continue;
        if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) return 0;
        *why = "the connection closed before the greeting was sent";
        return -1;
    }
    while (h->answer_got < TCP_ANSWER_BYTES) {
        ssize_t r =
            recv(h->fd, h->answer + h->answer_got, TCP_ANSWER_BYTES - h->answer_got, MSG_DONTWAIT);
        if (r > 0) {
            h->answer_got += (size_t)r;
            continue;
        }
        if (r == 0) {
            *why = "the connection closed before a complete answer";
            return -1;
        }
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
        *why = "the connection failed before a complete answer";
        return -1;
    }
    return 1;
}

/* Accept and authenticate every rank below ours, in whatever order they
 * arrive, until deadline. Errors: ERR_TIMEOUT (detail names the first
 * missing rank), ERR_SYSTEM. */
static cring_status_t accept_lower_ranks(tcp_p2p_t *t, const cring__transport_init_t *init,
                                         int listen_fd, double deadline) {
    const int rank = init->rank;
    pending_handshake_t pending[TCP_MAX_PENDING_HANDSHAKES];
    struct pollfd pfd[1 + TCP_MAX_PENDING_HANDSHAKES];
    int npending = 0, joined = 0;
    cring_status_t st = CRING_OK;
    if (cring__net_set_nonblocking(listen_fd, 1) != CRING_OK)
        return cring__fail(t->err, CRING_ERR_SYSTEM, "rank %d: fcntl failed: %s", rank,
                           strerror(errno));
    while (joined < rank) {
        double now = cring__now_s();
        if (now >= deadline) {
            int missing = -1;
            for (int i = 0; i < rank && missing < 0; i++)
                if (t->fds[i] < 0) missing = i;
            st = cring__fail(t->err, CRING_ERR_TIMEOUT,
                             "rank %d: %d of %d lower ranks connected within %.1f s (rank %d "
                             "never did)",
                             rank, joined, rank, t->timeout_s, missing);
            goto done;
        }
        double wake = deadline;
        pfd[0] = (struct pollfd){.fd = listen_fd, .events = POLLIN};
        for (int i = 0; i < npending; i++) {
            short ev = pending[i].hello_sent < TCP_HELLO_BYTES ? POLLOUT : POLLIN;
            pfd[1 + i] = (struct pollfd){.fd = pending[i].fd, .events = ev};
            wake = CRING_MIN(wake, pending[i].deadline);
        }
        int pr = poll(pfd, (nfds_t)(1 + npending), poll_ms_until(wake, now));
        if (pr < 0 && errno != EINTR) {
            st = cring__fail(t->err, CRING_ERR_SYSTEM, "rank %d: poll failed: %s", rank,
                             strerror(errno));
            goto done;
        }
        now = cring__now_s();
        /* Handshakes in progress (from the end, as drops move the last entry). */
        for (int i = npending - 1; i >= 0; i--) {
            if (pr > 0 && pfd[1 + i].revents == 0 && now < pending[i].deadline) continue;
            const char *why = NULL;
            int r = pending_progress(&pending[i], &why);
            if (r == 0 && now >= pending[i].deadline) {
                r = -1;
                why = "no complete answer within the handshake time-out";
            }
            if (r < 0) {
                pending_drop(pending, &npending, i, rank, why);
            } else if (r > 0) {
                if (pending_judge(t, init, &pending[i]) >= 0) joined++;
                pending[i] = pending[--npending]; /* judged: the socket is kept or closed */
            }
        }
        /* New connections (the listening socket is non-blocking). */
        if (pr > 0 && (pfd[0].revents & POLLIN)) {
            for (int k = 0; k < 16; k++) {
                int fd = accept4(listen_fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
                if (fd < 0) {
                    if (errno == EINTR || errno == ECONNABORTED || errno == EPROTO) continue;
                    if (errno == EMFILE || errno == ENFILE) {
                        if (npending > 0) { /* make room: drop the oldest stranger */
                            int oldest = 0;
                            for (int i = 1; i < npending; i++)
                                if (pending[i].deadline < pending[oldest].deadline) oldest = i;
                            pending_drop(pending, &npending, oldest, rank,
                                         "out of file descriptors");
                            continue;
                        }
                        (void)poll(NULL, 0, 10);
                    }
                    break; /* EAGAIN: none left */
                }
                if (npending == TCP_MAX_PENDING_HANDSHAKES) {
                    int oldest = 0;
                    for (int i = 1; i < npending; i++)
                        if (pending[i].deadline < pending[oldest].deadline) oldest = i;
                    pending_drop(pending, &npending, oldest, rank, "too many handshakes at once");
                }
                pending_handshake_t *h = &pending[npending++];
                memset(h, 0, sizeof *h);
                h->fd = fd;
                h->deadline = CRING_MIN(deadline, now + TCP_ACCEPT_HANDSHAKE_S);
                memcpy(h->hello, TCP_MAGIC, TCP_MAGIC_BYTES);
                cring__random_bytes(h->hello + TCP_MAGIC_BYTES, CRING__NONCE_BYTES);
                int one = 1;
                (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
                const char *why = NULL;
                int r = pending_progress(h, &why); /* send the greeting now */
                if (r < 0) {
                    pending_drop(pending, &npending, npending - 1, rank, why);
                } else if (r > 0) {
                    if (pending_judge(t, init, h) >= 0) joined++;
                    --npending;
                }
            }
        }
    }
done:
    for (int i = 0; i < npending; i++) close(pending[i].fd);
    return st;
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
    t->reasons = calloc((size_t)init->size, 1);
    if (!t->fds || !t->reasons) {
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
    CRING_CHECK_GOTO(accept_lower_ranks(t, init, listen_fd, deadline), st, cleanup);

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

/* net.c: socket helpers for the store and the TCP transport: listen, connect
 * with retry and whole-buffer send/recv, all bounded by a deadline.
 * Knows no protocol; never raises SIGPIPE and never leaks a socket into exec. */
#include "net.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <math.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <arpa/inet.h>
#include <unistd.h>

/* Milliseconds left until deadline for poll(): 0 when passed, capped at INT_MAX. */
static int ms_until(double deadline) {
    double left = deadline - cring__now_s();
    if (!(left > 0)) return 0; /* also catches NaN */
    double ms = ceil(left * 1000.0);
    if (ms > (double)INT_MAX) return INT_MAX;
    return (int)ms;
}

/* poll one fd for events until deadline, retrying on EINTR.
 * Returns >0 with *revents set, 0 on timeout, -1 on error (errno set). */
static int poll_one(int fd, short events, double deadline, short *revents) {
    for (;;) {
        struct pollfd p = {.fd = fd, .events = events, .revents = 0};
        int r = poll(&p, 1, ms_until(deadline));
        if (r < 0 && errno == EINTR) continue;
        if (r > 0) *revents = p.revents;
        return r;
    }
}

static void set_nodelay(int fd) {
    int one = 1;
    (void)setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
}

/* Port number as a string for getaddrinfo. */
static void port_string(int port, char out[16]) { snprintf(out, 16, "%d", port); }

cring_status_t cring__net_set_nonblocking(int fd, int on) {
    int flags = fcntl(fd, F_GETFL);
    if (flags < 0) return CRING_ERR_SYSTEM;
    int want = on ? (flags | O_NONBLOCK) : (flags & ~O_NONBLOCK);
    if (want != flags && fcntl(fd, F_SETFL, want) < 0) return CRING_ERR_SYSTEM;
    return CRING_OK;
}

/* Contract: see net.h. The listening socket is close-on-exec and in blocking
 * mode; with no bind_addr an IPv6 dual-stack wildcard is preferred and IPv4
 * 0.0.0.0 used where IPv6 is unavailable. Errors: ERR_INVALID_ARGUMENT (bad
 * address or port), ERR_SYSTEM (socket/bind/listen failed), detail in err. */
cring_status_t cring__net_listen(const char *bind_addr, int port, int backlog, int *fd_out,
                                 int *port_out, cring__errmsg_t *err) {
    *fd_out = -1;
    if (port < 0 || port > 65535)
        return cring__fail(err, CRING_ERR_INVALID_ARGUMENT, "invalid port %d", port);
    const char *node = (bind_addr && *bind_addr) ? bind_addr : NULL;
    char service[16];
    port_string(port, service);
    struct addrinfo hints;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_PASSIVE | AI_NUMERICSERV;
    struct addrinfo *res = NULL;
    int gai = getaddrinfo(node, service, &hints, &res);
    if (gai != 0)
        return cring__fail(err, CRING_ERR_INVALID_ARGUMENT, "cannot resolve listen address %s: %s",
                           node ? node : "(any)", gai_strerror(gai));

    int last_errno = 0;
    int fd = -1;
    /* Two passes over the results: wildcard binds try IPv6 first (dual stack). */
    for (int pass = 0; pass < 2 && fd < 0; pass++) {
        for (struct addrinfo *ai = res; ai && fd < 0; ai = ai->ai_next) {
            int is_v6 = ai->ai_family == AF_INET6;
            if (node == NULL && (pass == 0) != is_v6) continue;
            if (node != NULL && pass == 1) break;
            int s = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC, ai->ai_protocol);
            if (s < 0) {
                last_errno = errno;
                continue;
            }
            int one = 1, zero = 0;
            (void)setsockopt(s, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
            if (is_v6 && node == NULL)
                (void)setsockopt(s, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
            if (bind(s, ai->ai_addr, ai->ai_addrlen) == 0 &&
                listen(s, backlog > 0 ? backlog : 128) == 0) {
                fd = s;
            } else {
                last_errno = errno;
                close(s);
            }
        }
    }
    freeaddrinfo(res);
    if (fd < 0)
        return cring__fail(err, CRING_ERR_SYSTEM, "cannot listen on %s:%d: %s",
                           node ? node : "(any)", port, strerror(last_errno));

    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    if (getsockname(fd, (struct sockaddr *)&ss, &sl) != 0) {
        int e = errno;
        close(fd);
        return cring__fail(err, CRING_ERR_SYSTEM, "getsockname failed: %s", strerror(e));
    }
    int bound = ss.ss_family == AF_INET6 ? ntohs(((struct sockaddr_in6 *)&ss)->sin6_port)
                                         : ntohs(((struct sockaddr_in *)&ss)->sin_port);
    *fd_out = fd;
    if (port_out) *port_out = bound;
    return CRING_OK;
}

/* Is this connect() failure worth another try (server not up yet)? */
static int connect_retryable(int e) {
    return e == ECONNREFUSED || e == ENETUNREACH || e == EHOSTUNREACH || e == ETIMEDOUT ||
           e == ECONNRESET || e == ECONNABORTED || e == EAGAIN || e == ENOENT;
}

/* One non-blocking connect attempt to ai, bounded by deadline.
 * Returns the connected fd (blocking mode) or -1 with errno set. */
static int connect_once(const struct addrinfo *ai, double deadline) {
    int s = socket(ai->ai_family, ai->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, ai->ai_protocol);
    if (s < 0) return -1;
    if (connect(s, ai->ai_addr, ai->ai_addrlen) != 0) {
        if (errno != EINPROGRESS && errno != EINTR) {
            int e = errno;
            close(s);
            errno = e;
            return -1;
        }
        short rev = 0;
        int r = poll_one(s, POLLOUT, deadline, &rev);
        if (r <= 0) {
            int e = r == 0 ? ETIMEDOUT : errno;
            close(s);
            errno = e;
            return -1;
        }
        int soerr = 0;
        socklen_t sl = sizeof soerr;
        if (getsockopt(s, SOL_SOCKET, SO_ERROR, &soerr, &sl) != 0) soerr = errno;
        if (soerr != 0) {
            close(s);
            errno = soerr;
            return -1;
        }
    }
    if (cring__net_set_nonblocking(s, 0) != CRING_OK) {
        int e = errno;
        close(s);
        errno = e;
        return -1;
    }
    set_nodelay(s);
    return s;
}

/* Contract: see net.h. The returned socket is blocking, close-on-exec, with
 * TCP_NODELAY. Between failed rounds it backs off 10 ms growing to 200 ms.
 * Errors: ERR_TIMEOUT (deadline passed while refused/unreachable),
 * ERR_INVALID_ARGUMENT (bad port), ERR_SYSTEM (other failures); detail in err. */
cring_status_t cring__net_connect(const char *addr, int port, double deadline, int *fd_out,
                                  cring__errmsg_t *err) {
    *fd_out = -1;
    if (!addr || !*addr)
        return cring__fail(err, CRING_ERR_INVALID_ARGUMENT, "no address to connect to");
    if (port <= 0 || port > 65535)
        return cring__fail(err, CRING_ERR_INVALID_ARGUMENT, "invalid port %d for %s", port, addr);
    char service[16];
    port_string(port, service);
    struct addrinfo hints;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    hints.ai_flags = AI_NUMERICSERV;

    int backoff_ms = 10;
    int last_errno = 0;
    const char *last_what = "connect";
    for (;;) {
        struct addrinfo *res = NULL;
        int gai = getaddrinfo(addr, service, &hints, &res);
        if (gai == 0) {
            for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
                int s = connect_once(ai, deadline);
                if (s >= 0) {
                    freeaddrinfo(res);
                    *fd_out = s;
                    return CRING_OK;
                }
                last_errno = errno;
                last_what = "connect";
                if (!connect_retryable(last_errno)) {
                    freeaddrinfo(res);
                    return cring__fail(err, CRING_ERR_SYSTEM, "cannot connect to %s:%d: %s", addr,
                                       port, strerror(last_errno));
                }
            }
            freeaddrinfo(res);
        } else if (gai == EAI_AGAIN) {
            last_errno = EAGAIN; /* name service not ready: retry */
            last_what = "resolve";
        } else {
            return cring__fail(err, CRING_ERR_INVALID_ARGUMENT, "cannot resolve %s: %s", addr,
                               gai_strerror(gai));
        }
        int left = ms_until(deadline);
        if (left <= 0)
            return cring__fail(err, CRING_ERR_TIMEOUT,
                               "timed out connecting to %s:%d (last %s error: %s)", addr, port,
                               last_what, strerror(last_errno));
        /* Back off before the next round (the server may not be up yet). */
        int wait_ms = CRING_MIN(backoff_ms, left);
        (void)poll(NULL, 0, wait_ms);
        backoff_ms = CRING_MIN(backoff_ms * 2, 200);
    }
}

/* Contract: see net.h. Uses MSG_DONTWAIT so a blocking fd never blocks past
 * the deadline, and MSG_NOSIGNAL so a closed peer is an error, not SIGPIPE. */
cring_status_t cring__net_send_all(int fd, const void *buf, size_t n, double deadline,
                                   cring__errmsg_t *err) {
    const char *p = buf;
    size_t done = 0;
    while (done < n) {
        ssize_t w = send(fd, p + done, n - done, MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w > 0) {
            done += (size_t)w;
            continue;
        }
        if (w < 0 && errno == EINTR) continue;
        if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
            short rev = 0;
            int r = poll_one(fd, POLLOUT, deadline, &rev);
            if (r == 0)
                return cring__fail(err, CRING_ERR_TIMEOUT, "send timed out after %zu of %zu bytes",
                                   done, n);
            if (r < 0)
                return cring__fail(err, CRING_ERR_SYSTEM, "poll failed: %s", strerror(errno));
            continue; /* POLLERR/POLLHUP: the next send reports the error */
        }
        if (w < 0 && (errno == EPIPE || errno == ECONNRESET || errno == ENOTCONN))
            return cring__fail(err, CRING_ERR_PEER_FAILURE,
                               "connection closed by peer after %zu of %zu bytes sent", done, n);
        return cring__fail(err, CRING_ERR_SYSTEM, "send failed: %s",
                           w < 0 ? strerror(errno) : "no progress");
    }
    return CRING_OK;
}

/* Contract: see net.h. Uses MSG_DONTWAIT so a blocking fd never blocks past
 * the deadline. EOF before n bytes is ERR_PEER_FAILURE. */
cring_status_t cring__net_recv_all(int fd, void *buf, size_t n, double deadline,
                                   cring__errmsg_t *err) {
    char *p = buf;
    size_t done = 0;
    while (done < n) {
        ssize_t r = recv(fd, p + done, n - done, MSG_DONTWAIT);
        if (r > 0) {
            done += (size_t)r;
            continue;
        }
        if (r == 0)
            return cring__fail(err, CRING_ERR_PEER_FAILURE,
                               "connection closed by peer after %zu of %zu bytes received", done,
                               n);
        if (errno == EINTR) continue;
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            short rev = 0;
            int pr = poll_one(fd, POLLIN, deadline, &rev);
            if (pr == 0)
                return cring__fail(err, CRING_ERR_TIMEOUT,
                                   "receive timed out after %zu of %zu bytes", done, n);
            if (pr < 0)
                return cring__fail(err, CRING_ERR_SYSTEM, "poll failed: %s", strerror(errno));
            continue;
        }
        if (errno == ECONNRESET || errno == ENOTCONN || errno == EPIPE)
            return cring__fail(err, CRING_ERR_PEER_FAILURE,
                               "connection reset by peer after %zu of %zu bytes received", done, n);
        return cring__fail(err, CRING_ERR_SYSTEM, "recv failed: %s", strerror(errno));
    }
    return CRING_OK;
}

/* Contract: see net.h. No packet is sent (a UDP connect only picks a route).
 * IPv6 results are written without brackets. Errors: ERR_INVALID_ARGUMENT
 * (toward unresolvable or out too small), ERR_SYSTEM (no route). */
cring_status_t cring__net_local_addr_toward(const char *toward, char *out, size_t out_len) {
    if (!toward || !*toward || !out || out_len < 2) return CRING_ERR_INVALID_ARGUMENT;
    struct addrinfo hints;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_DGRAM;
    hints.ai_flags = AI_NUMERICSERV;
    struct addrinfo *res = NULL;
    if (getaddrinfo(toward, "9", &hints, &res) != 0) return CRING_ERR_INVALID_ARGUMENT;
    cring_status_t st = CRING_ERR_SYSTEM;
    for (struct addrinfo *ai = res; ai && st != CRING_OK; ai = ai->ai_next) {
        int s = socket(ai->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
        if (s < 0) continue;
        struct sockaddr_storage ss;
        socklen_t sl = sizeof ss;
        if (connect(s, ai->ai_addr, ai->ai_addrlen) == 0 &&
            getsockname(s, (struct sockaddr *)&ss, &sl) == 0) {
            char text[INET6_ADDRSTRLEN];
            const void *src = ss.ss_family == AF_INET6
                                  ? (const void *)&((struct sockaddr_in6 *)&ss)->sin6_addr
                                  : (const void *)&((struct sockaddr_in *)&ss)->sin_addr;
            if (inet_ntop(ss.ss_family, src, text, sizeof text)) {
                if (strlen(text) < out_len) {
                    memcpy(out, text, strlen(text) + 1);
                    st = CRING_OK;
                } else {
                    st = CRING_ERR_INVALID_ARGUMENT;
                }
            }
        }
        close(s);
    }
    freeaddrinfo(res);
    return st;
}

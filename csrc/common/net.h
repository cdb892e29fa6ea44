/* net.h: small socket helpers shared by the rendezvous store and the TCP
 * transport: listen, connect with retry, whole-buffer send/recv with a
 * deadline. No protocol knowledge. */
#ifndef CRING_NET_H
#define CRING_NET_H

#include <stddef.h>

#include "common.h"

/* Listen on bind_addr:port (NULL or "" = all interfaces; port 0 = ephemeral)
 * with SO_REUSEADDR. *fd_out is the listening socket, *port_out the bound port. */
cring_status_t cring__net_listen(const char *bind_addr, int port, int backlog, int *fd_out,
                                 int *port_out, cring__errmsg_t *err);
/* Connect to addr:port (IPv4/IPv6 name or literal), retrying refused/unreachable
 * attempts until deadline (cring__now_s() clock). TCP_NODELAY is set. */
cring_status_t cring__net_connect(const char *addr, int port, double deadline, int *fd_out,
                                  cring__errmsg_t *err);
/* Send / receive exactly n bytes before deadline (blocking or non-blocking fd).
 * A closed connection is ERR_PEER_FAILURE, an expired deadline ERR_TIMEOUT. */
cring_status_t cring__net_send_all(int fd, const void *buf, size_t n, double deadline,
                                   cring__errmsg_t *err);
cring_status_t cring__net_recv_all(int fd, void *buf, size_t n, double deadline,
                                   cring__errmsg_t *err);
/* Set O_NONBLOCK on or off. */
cring_status_t cring__net_set_nonblocking(int fd, int on);
/* The address of this host that a peer can use to reach it when it connects
 * to `toward` (the store's address): the local address of a UDP socket
 * "connected" to it. Loopback stays loopback. out has room for 64 bytes. */
cring_status_t cring__net_local_addr_toward(const char *toward, char *out, size_t out_len);

#endif /* CRING_NET_H */

/* ops.c: the flat transports' ops tables (self, shm, tcp): each collective
 * without agreement and the idle-wait primitives, chosen once at init so that
 * no collective asks which transport it runs on. No setup, no agreement. */
#include <poll.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "../reduce/reduce.h"
#include "comm_impl.h"

/* ---- one table per transport --------------------------------------------------
 * Each transport's collectives (without agreement) and idle-wait primitives,
 * chosen once at init: no collective asks which transport it runs on. */

/* one rank: every collective is a copy */
static cring_status_t self_agree(cring_comm_t *c, cring__desc_t *d) { return CRING_OK; }
static cring_status_t self_allreduce(cring_comm_t *c, const void *send, void *recv, size_t count,
                                     cring_dtype_t dtype, cring_op_t op) {
    if (send != recv && count) memcpy(recv, send, count * cring_dtype_size(dtype));
    return CRING_OK;
}
static cring_status_t self_allreduce_multi(cring_comm_t *c, cring__seg_t *segs, int nsegs,
                                           cring_dtype_t dtype, cring_op_t op) {
    for (int i = 0; i < nsegs; i++)
        if (segs[i].send != segs[i].recv && segs[i].count)
            memcpy(segs[i].recv, segs[i].send, segs[i].count * cring_dtype_size(dtype));
    return CRING_OK;
}
static cring_status_t self_broadcast(cring_comm_t *c, void *buf, size_t nbytes, int root) {
    return CRING_OK;
}
static cring_status_t self_allgatherv(cring_comm_t *c, const void *send, size_t send_bytes,
                                      void *recv, const size_t *recv_bytes) {
    if (send != recv && send_bytes) memcpy(recv, send, send_bytes);
    return CRING_OK;
}
static cring_status_t self_reducescatter(cring_comm_t *c, const void *send, void *recv,
                                         const size_t *counts, cring_dtype_t dtype, cring_op_t op) {
    if (counts[0]) memcpy(recv, send, counts[0] * cring_dtype_size(dtype));
    return CRING_OK;
}
static cring_status_t self_barrier(cring_comm_t *c) { return CRING_OK; }
static cring_status_t self_alltoallv(cring_comm_t *c, const void *send, void *recv,
                                     const size_t *matrix) {
    if (matrix[0]) memcpy(recv, send, matrix[0]);
    return CRING_OK;
}
static cring_status_t self_gather_small(cring_comm_t *c, const void *mine, size_t bytes,
                                        const void **ptrs_out, size_t *lens_out) {
    ptrs_out[0] = mine;
    if (lens_out) lens_out[0] = bytes;
    return CRING_OK;
}
static size_t self_gather_small_max(const cring_comm_t *c) { return (size_t)-1; }
static void self_wake(cring_comm_t *c) {}
static void self_announce(cring_comm_t *c, uint64_t round) {}
static void self_set_driving(cring_comm_t *c, int on) {}
static int self_peer_waiting(cring_comm_t *c, uint64_t rounds_done) { return 0; }
static uint64_t self_wake_token(cring_comm_t *c) { return 0; }
/* nothing to wait for but a local wake, which needs no transport: sleep
 * briefly and let the caller look again */
static int self_idle_wait(cring_comm_t *c, uint64_t token, double max_wait_s) {
    struct timespec ts = {0, 1000000};
    if (max_wait_s > 0) nanosleep(&ts, NULL);
    return 1;
}

const struct cring__comm_ops cring__self_ops = {
    "self",
    0,
    self_agree,
    self_allreduce,
    self_broadcast,
    self_allgatherv,
    self_reducescatter,
    self_barrier,
    self_alltoallv,
    self_gather_small,
    self_gather_small_max,
    self_wake,
    self_announce,
    self_set_driving,
    self_peer_waiting,
    self_wake_token,
    self_idle_wait,
    self_idle_wait,
    self_allreduce_multi,
};

/* shared memory */
static cring_status_t shm_agree(cring_comm_t *c, cring__desc_t *d) {
    return cring__agree_shm(c->shm, c->rank, c->size, c->agreements, d, c->descs);
}
static cring_status_t shm_allreduce(cring_comm_t *c, const void *send, void *recv, size_t count,
                                    cring_dtype_t dtype, cring_op_t op) {
    size_t bytes = count * cring_dtype_size(dtype);
    cring__comm_count_shm(c, bytes, bytes);
    /* a buffer in a shared region (regions.c): in place, no window copies */
    if (send == recv && bytes >= 4096 && atomic_load_explicit(&c->nregions, memory_order_relaxed)) {
        int handled;
        cring_status_t st = cring__comm_region_allreduce(c, recv, count, dtype, op, &handled);
        if (handled) return st;
    }
    return cring__shm_allreduce(c->shm, c->rank, c->size, send, recv, count, dtype, op);
}
static cring_status_t shm_allreduce_multi(cring_comm_t *c, cring__seg_t *segs, int nsegs,
                                          cring_dtype_t dtype, cring_op_t op) {
    size_t bytes = 0;
    for (int i = 0; i < nsegs; i++) bytes += segs[i].count * cring_dtype_size(dtype);
    cring__comm_count_shm(c, bytes, bytes);
    return cring__shm_allreduce_multi(c->shm, c->rank, c->size, segs, nsegs, dtype, op);
}
static cring_status_t shm_broadcast(cring_comm_t *c, void *buf, size_t nbytes, int root) {
    cring__comm_count_shm(c, c->rank == root ? nbytes : 0, c->rank == root ? 0 : nbytes);
    return cring__shm_broadcast(c->shm, c->rank, c->size, buf, nbytes, root);
}
static cring_status_t shm_allgatherv(cring_comm_t *c, const void *send, size_t send_bytes,
                                     void *recv, const size_t *recv_bytes) {
    size_t total = 0;
    for (int r = 0; r < c->size; r++) total += recv_bytes[r];
    cring__comm_count_shm(c, send_bytes, total - send_bytes);
    return cring__shm_allgatherv(c->shm, c->rank, c->size, send, send_bytes, recv, recv_bytes);
}
static cring_status_t shm_reducescatter(cring_comm_t *c, const void *send, void *recv,
                                        const size_t *counts, cring_dtype_t dtype, cring_op_t op) {
    size_t total = 0;
    for (int r = 0; r < c->size; r++) total += counts[r];
    cring__comm_count_shm(c, total * cring_dtype_size(dtype),
                          counts[c->rank] * cring_dtype_size(dtype));
    return cring__shm_reducescatter(c->shm, c->rank, c->size, send, recv, counts, dtype, op);
}
static cring_status_t shm_barrier_op(cring_comm_t *c) { return cring__shm_barrier(c->shm); }
static cring_status_t shm_alltoallv(cring_comm_t *c, const void *send, void *recv,
                                    const size_t *matrix) {
    size_t sent = 0, received = 0;
    for (int r = 0; r < c->size; r++) {
        sent += matrix[(size_t)c->rank * (size_t)c->size + (size_t)r];
        received += matrix[(size_t)r * (size_t)c->size + (size_t)c->rank];
    }
    cring__comm_count_shm(c, sent, received);
    return cring__shm_alltoallv(c->shm, c->rank, c->size, send, recv, matrix);
}
static cring_status_t shm_gather_small(cring_comm_t *c, const void *mine, size_t bytes,
                                       const void **ptrs_out, size_t *lens_out) {
    cring_status_t st =
        cring__shm_gather_small(c->shm, c->rank, c->size, mine, bytes, ptrs_out, lens_out);
    size_t received = 0;
    for (int r = 0; lens_out && st == CRING_OK && r < c->size; r++)
        if (r != c->rank) received += lens_out[r];
    cring__comm_count_shm(c, bytes, received);
    return st;
}
static size_t shm_gather_small_max(const cring_comm_t *c) {
    return cring__shm_gather_small_max(c->shm, c->size);
}
static void shm_wake(cring_comm_t *c) { cring__shm_ring(c->shm, c->rank); }
static void shm_announce(cring_comm_t *c, uint64_t round) { cring__shm_announce(c->shm, round); }
static void shm_set_driving(cring_comm_t *c, int on) { cring__shm_set_driving(c->shm, on); }
static int shm_peer_waiting(cring_comm_t *c, uint64_t rounds_done) {
    return cring__shm_peer_announced(c->shm) > rounds_done;
}
static uint64_t shm_wake_token(cring_comm_t *c) { return cring__shm_bell(c->shm); }
static int shm_idle_wait(cring_comm_t *c, uint64_t token, double max_wait_s) {
    cring__shm_idle_wait(c->shm, (uint32_t)token, max_wait_s);
    return cring__shm_bell(c->shm) != (uint32_t)token;
}

const struct cring__comm_ops cring__shm_ops = {
    "shm",
    0,
    shm_agree,
    shm_allreduce,
    shm_broadcast,
    shm_allgatherv,
    shm_reducescatter,
    shm_barrier_op,
    shm_alltoallv,
    shm_gather_small,
    shm_gather_small_max,
    shm_wake,
    shm_announce,
    shm_set_driving,
    shm_peer_waiting,
    shm_wake_token,
    shm_idle_wait,
    shm_idle_wait,
    shm_allreduce_multi,
};

/* TCP: ring algorithms over point-to-point links; an eventfd wakes an idle rank */
static cring_status_t tcp_agree(cring_comm_t *c, cring__desc_t *d) {
    return cring__agree_p2p(c->p2p, d, c->descs);
}
static cring_status_t tcp_allreduce(cring_comm_t *c, const void *send, void *recv, size_t count,
                                    cring_dtype_t dtype, cring_op_t op) {
    return cring__comm_p2p_allreduce(c, send, recv, count, dtype, op);
}
static cring_status_t tcp_broadcast(cring_comm_t *c, void *buf, size_t nbytes, int root) {
    return nbytes ? cring__ring_broadcast(c->p2p, buf, nbytes, root) : CRING_OK;
}
static cring_status_t tcp_allgatherv(cring_comm_t *c, const void *send, size_t send_bytes,
                                     void *recv, const size_t *recv_bytes) {
    return cring__ring_allgatherv(c->p2p, send, send_bytes, recv, recv_bytes);
}
static cring_status_t tcp_reducescatter(cring_comm_t *c, const void *send, void *recv,
                                        const size_t *counts, cring_dtype_t dtype, cring_op_t op) {
    return cring__ring_reducescatter(c->p2p, &c->scratch, send, recv, counts, dtype, op);
}
static cring_status_t tcp_barrier(cring_comm_t *c) { return cring__p2p_barrier(c->p2p); }
static cring_status_t tcp_alltoallv(cring_comm_t *c, const void *send, void *recv,
                                    const size_t *matrix) {
    return cring__p2p_alltoallv(c->p2p, send, recv, matrix);
}
static void tcp_wake(cring_comm_t *c) {
    uint64_t one = 1;
    ssize_t w = write(c->wake_fd, &one, sizeof one);
    (void)w; /* EAGAIN means it is already signalled */
}
static void tcp_announce(cring_comm_t *c, uint64_t round) {} /* peers see the data itself */
static void tcp_set_driving(cring_comm_t *c, int on) {}
static int tcp_peer_waiting(cring_comm_t *c, uint64_t rounds_done) {
    return c->p2p->ops->idle_wait(c->p2p, -1, 0);
}
static uint64_t tcp_wake_token(cring_comm_t *c) { return 0; }
int cring__comm_drain_wake_fd(cring_comm_t *c) {
    uint64_t drained;
    int woken = 0;
    while (read(c->wake_fd, &drained, sizeof drained) > 0) woken = 1;
    return woken;
}
static int tcp_idle_wait(cring_comm_t *c, uint64_t token, double max_wait_s) {
    int peer_input = c->p2p->ops->idle_wait(c->p2p, c->wake_fd, max_wait_s);
    int woken = cring__comm_drain_wake_fd(c);
    return peer_input || woken;
}
static int tcp_idle_wait_local(cring_comm_t *c, uint64_t token, double max_wait_s) {
    struct pollfd pfd = {.fd = c->wake_fd, .events = POLLIN};
    int ms = max_wait_s > 2e6 ? 2000000000 : (int)(max_wait_s * 1000.0);
    int woken = poll(&pfd, 1, ms < 0 ? 0 : ms) > 0;
    return cring__comm_drain_wake_fd(c) || woken;
}

const struct cring__comm_ops cring__tcp_ops = {
    "tcp",
    1,
    tcp_agree,
    tcp_allreduce,
    tcp_broadcast,
    tcp_allgatherv,
    tcp_reducescatter,
    tcp_barrier,
    tcp_alltoallv,
    NULL,
    NULL,
    tcp_wake,
    tcp_announce,
    tcp_set_driving,
    tcp_peer_waiting,
    tcp_wake_token,
    tcp_idle_wait,
    tcp_idle_wait_local,
    NULL,
};

/* comm_internal.h: what the engine needs from a communicator beyond the
 * public API: collectives without the argument-agreement step (the engine has
 * negotiated already), and the idle-wait / wake-up primitives that let an
 * engine sleep until a peer or a local thread needs it. */
#ifndef CRING_COMM_INTERNAL_H
#define CRING_COMM_INTERNAL_H

#include "cring/cring.h"

/* Collectives with no agreement step: the caller guarantees every rank makes
 * the same call (same sizes, dtype, op, root). Same buffer contracts as the
 * public functions. A transport failure marks the communicator broken. Not
 * thread-safe: only the thread that drives the communicator calls these. */
cring_status_t cring__comm_allreduce(cring_comm_t *comm, const void *send, void *recv, size_t count,
                                     cring_dtype_t dtype, cring_op_t op);
cring_status_t cring__comm_broadcast(cring_comm_t *comm, void *buf, size_t nbytes, int root);
cring_status_t cring__comm_allgatherv(cring_comm_t *comm, const void *send, size_t send_bytes,
                                      void *recv, const size_t *recv_bytes);
cring_status_t cring__comm_reducescatter(cring_comm_t *comm, const void *send, void *recv,
                                         const size_t *counts, cring_dtype_t dtype, cring_op_t op);
cring_status_t cring__comm_barrier(cring_comm_t *comm);
/* matrix[q*size + r] bytes go from rank q to rank r (identical on every rank). */
cring_status_t cring__comm_alltoallv(cring_comm_t *comm, const void *send, void *recv,
                                     const size_t *matrix);
/* Allreduce many tensors of one dtype at once without packing them into
 * one buffer first (struct cring__seg: algo/algo.h; offsets are filled
 * in): the same result as an allreduce of the tensors laid end to end.
 * Only where cring__comm_can_allreduce_multi says so (shared memory);
 * ERR_NOT_SUPPORTED otherwise, before communicating. */
struct cring__seg;
int cring__comm_can_allreduce_multi(const cring_comm_t *comm);
cring_status_t cring__comm_allreduce_multi(cring_comm_t *comm, struct cring__seg *segs, int nsegs,
                                           cring_dtype_t dtype, cring_op_t op);
/* Gather small blocks of per-rank length in one exchange and return pointers
 * to every rank's block, valid until the next collective. Only on shared
 * memory (ERR_NOT_SUPPORTED otherwise, before communicating; check
 * cring__comm_can_gather_small first); bytes <= cring__comm_gather_small_max. */
int cring__comm_can_gather_small(const cring_comm_t *comm);
size_t cring__comm_gather_small_max(const cring_comm_t *comm);
cring_status_t cring__comm_gather_small(cring_comm_t *comm, const void *mine, size_t bytes,
                                        const void **ptrs_out, size_t *lens_out);

/* 1 when the idle wait also returns on a peer's incoming data (TCP): while
 * another thread of this rank drives, such data is always there, so a
 * thread that does not drive must park (cring__comm_idle_wait_local)
 * instead of idle-waiting, or it would spin. */
int cring__comm_idle_wait_sees_peer_input(const cring_comm_t *comm);
/* The communicator's bound on every wait (cring_config.timeout_s). */
double cring__comm_timeout_s(const cring_comm_t *comm);

/* Payload bytes this rank moved per transport since init: TCP as sent and
 * received on its sockets, shared memory as given to and taken from its
 * collectives. Thread-safe read (the values may lag a running collective). */
typedef struct cring__comm_traffic {
    uint64_t tcp_bytes_sent, tcp_bytes_received;
    uint64_t shm_bytes_sent, shm_bytes_received;
} cring__comm_traffic_t;
void cring__comm_traffic(const cring_comm_t *comm, cring__comm_traffic_t *out);

/* CRING_OK while usable, else the status that broke it. Thread-safe read. */
cring_status_t cring__comm_broken(const cring_comm_t *comm);
/* Break the communicator for a failure of this rank's own (st, why: what
 * cring__comm_error says from now on), and tell the peers, as a transport
 * failure does: local ranks see the shared segment aborted, remote ones
 * their connections cancelled, so none waits for this rank until its
 * time-out. No-op when already broken. Only the thread that drives it. */
void cring__comm_abort(cring_comm_t *comm, cring_status_t st, const char *why);
/* Detail of the last failure (owned by comm). */
const char *cring__comm_error(const cring_comm_t *comm);

/* Wake this rank's idle waiter. Thread-safe, cheap, callable from any thread. */
void cring__comm_wake(cring_comm_t *comm);
/* Tell every peer that this rank is about to start round `round` (1, 2, ...)
 * of collectives, so an idle peer joins (shared memory needs this; TCP peers
 * see the data itself). */
void cring__comm_announce(cring_comm_t *comm, uint64_t round);
/* Mark whether a thread of this rank is driving rounds (shared memory uses
 * it to decide whether a waiting peer must ring this rank's bell). */
void cring__comm_set_driving(cring_comm_t *comm, int on);
/* 1 when some peer has started a round after `rounds_done` (this rank's
 * count of finished rounds) and waits for this rank. Never blocks. */
int cring__comm_peer_waiting(cring_comm_t *comm, uint64_t rounds_done);
/* A token to take before checking for work, then pass to idle_wait, so a wake
 * between the check and the wait is not lost. */
uint64_t cring__comm_wake_token(cring_comm_t *comm);
/* Sleep until woken (cring__comm_wake or a peer's ring), TCP input arrives
 * from a peer, or max_wait_s passes. Returns 1 when woken, 0 on time-out. */
int cring__comm_idle_wait(cring_comm_t *comm, uint64_t token, double max_wait_s);
/* The same, but ignoring peers' TCP input: for a thread that must not spin on
 * sockets another thread of this rank is reading (only a local wake or the
 * time-out end it). On shared memory identical to cring__comm_idle_wait. */
int cring__comm_idle_wait_local(cring_comm_t *comm, uint64_t token, double max_wait_s);
/* Mark the calling thread as a background thread: its shared-memory waits
 * spin briefly before yielding (it runs beside the user's compute threads). */
void cring__comm_background_thread(void);

/* Adasum (core/adasum.c): buf holds ntensors tensors back to back (counts[i]
 * elements each, the same on every rank), reduced in place so that each
 * tensor becomes the pairwise adaptive sum over ranks, with its own
 * coefficients. dtype float16, bfloat16, float32 or float64
 * (cring__adasum_supported); the world size a power of two
 * (cring__adasum_size_ok), else ERR_NOT_SUPPORTED before communicating.
 * Same threading rule as the collectives above. */
int cring__adasum_supported(cring_dtype_t dtype);
int cring__adasum_size_ok(int size);
cring_status_t cring__comm_adasum(cring_comm_t *comm, void *buf, cring_dtype_t dtype,
                                  const size_t *counts, int ntensors);

#endif

/* transport.h: the two transport interfaces algorithms may use.
 * - p2p: a table of point-to-point operations (TCP today); algorithms call
 *   only sendrecv, never sockets.
 * - shm: per-rank shared-memory windows plus progress counters, for ranks on
 *   one host; algorithms get pointers and counters, never mmap or futex.
 * Transports know nothing of dtypes or reductions. */
#ifndef CRING_TRANSPORT_H
#define CRING_TRANSPORT_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "../common/common.h"

/* What every transport needs to set itself up. */
typedef struct cring__transport_init {
    int rank;
    int size;
    cring_store_t *store;    /* rendezvous store client (not owned) */
    const char *key_prefix;  /* prefix for this communicator's store keys */
    const char *listen_addr; /* TCP: address peers connect to (NULL: auto) */
    const char *secret;      /* job secret for peer handshakes (may be NULL) */
    double timeout_s;        /* bound on every wait */
    cring__errmsg_t *err;    /* where failure detail goes (owned by the comm) */
    /* shared memory: rank 0's CRING__SHM_PARAMS numbers for the algorithms
     * (NULL: zeros); other ranks' are ignored (see cring__shm_params) */
    const uint64_t *shm_params;
} cring__transport_init_t;

/* ---- point to point -------------------------------------------------------- */
typedef struct cring__p2p cring__p2p_t;

typedef struct cring__p2p_ops {
    const char *name;
    /* Send send_bytes from send_buf to send_peer while receiving exactly
     * recv_bytes from recv_peer into recv_buf; both progress together so a
     * ring never deadlocks. A side with peer < 0 or 0 bytes is skipped;
     * send_peer may equal recv_peer. Messages between a pair arrive in the
     * order sent. Errors: ERR_PEER_FAILURE (connection closed or reset),
     * ERR_TIMEOUT (no progress for timeout_s), ERR_SYSTEM. Detail goes to
     * the errmsg given at creation. */
    cring_status_t (*sendrecv)(cring__p2p_t *p2p, int send_peer, const void *send_buf,
                               size_t send_bytes, int recv_peer, void *recv_buf, size_t recv_bytes);
    /* Block until a peer sends something (the start of the next collective,
     * or a closed connection), wake_fd becomes readable (when >= 0), or
     * max_wait_s passes (0: just look). Consumes nothing from the peers'
     * streams. Returns 1 when a peer has input waiting. Never an error: a
     * closed connection is reported by the next sendrecv. */
    int (*idle_wait)(cring__p2p_t *p2p, int wake_fd, double max_wait_s);
    /* After a fatal error: shut every connection down (without closing the
     * descriptors) so peers blocked on this rank see the end of stream and
     * fail fast instead of waiting for their time-out. May be NULL. */
    void (*cancel)(cring__p2p_t *p2p);
    /* Close every connection and free; safe on a half-built object. */
    void (*destroy)(cring__p2p_t *p2p);
} cring__p2p_ops_t;

struct cring__p2p {
    const cring__p2p_ops_t *ops;
    int rank;
    int size;
    /* Payload bytes moved by completed sendrecv calls (written only by the
     * thread that drives the transport; read from any thread). */
    _Atomic uint64_t bytes_sent, bytes_received;
};

/* Build a full mesh of TCP connections: each rank listens on an ephemeral port,
 * publishes "<key_prefix>/tcp/<rank>" in the store, and lower ranks connect to
 * higher ones, authenticating with the secret. On error *out is NULL. */
cring_status_t cring__tcp_create(const cring__transport_init_t *init, cring__p2p_t **out);

/* ---- shared memory ---------------------------------------------------------- */
typedef struct cring__shm cring__shm_t;

/* Map one segment holding, per rank, a control block and a data window of
 * window_bytes. Rank 0 creates it; all ranks map it and check a nonce (so a
 * host that only looks the same is caught); the file is unlinked as soon as
 * every rank has it mapped, so nothing is left in /dev/shm even if processes
 * die. Requires every rank on this host. On error *out is NULL. */
cring_status_t cring__shm_create(const cring__transport_init_t *init, size_t window_bytes,
                                 cring__shm_t **out);
void cring__shm_destroy(cring__shm_t *shm);

/* Numbers the algorithms above choose (sizes of rounds and the like) that
 * every rank must use alike: rank 0's init->shm_params, carried in the
 * segment's header and copied by every rank at creation. The transport
 * never reads them. */
#define CRING__SHM_PARAMS 8
const uint64_t *cring__shm_params(const cring__shm_t *shm);

/* Base of peer's data window (peer == own rank gives this rank's). */
void *cring__shm_window(cring__shm_t *shm, int peer);
size_t cring__shm_window_bytes(const cring__shm_t *shm);
/* A per-rank descriptor slot of CRING__SHM_SLOT_BYTES, two of them (index 0/1),
 * for small exchanges such as argument agreement. */
#define CRING__SHM_SLOT_BYTES 256
void *cring__shm_slot(cring__shm_t *shm, int peer, int index);

/* This rank's progress counter: the last value published. Starts at 0 and only
 * grows; every rank publishes the same sequence of values. */
uint64_t cring__shm_seq(const cring__shm_t *shm);
/* Publish seq (> current) with release ordering and wake waiters. */
void cring__shm_publish(cring__shm_t *shm, uint64_t seq);
/* Wait until peer's counter >= seq: spin, then yield, then sleep on a futex.
 * Errors: ERR_PEER_FAILURE (peer process gone), ERR_TIMEOUT, ERR_BROKEN (another
 * rank aborted). Acquire ordering: the peer's writes before publish are seen. */
cring_status_t cring__shm_wait(cring__shm_t *shm, int peer, uint64_t seq);
/* Cap the spin phase of this thread's waits at iters (-1: no cap). For a
 * background thread, whose spinning only takes a core from compute threads
 * (no caller is waiting on it). */
void cring__shm_cap_thread_spin(long iters);
/* cring__shm_wait on every rank except this one. */
cring_status_t cring__shm_wait_all(cring__shm_t *shm, uint64_t seq);
/* Record that peer is known to have reached seq (seen through a release
 * store of its own, such as a flag next to data), so a later wait for it
 * needs no load of its counter. */
void cring__shm_saw(cring__shm_t *shm, int peer, uint64_t seq);
/* A random value shared by every rank of the segment, to mix into flags
 * written into windows, so that stale data of another collective never
 * reads as a flag. */
uint64_t cring__shm_flag_key(const cring__shm_t *shm);
/* One step of a spin-wait, i counting from 0: a pause, and now and then a
 * sched_yield so a runnable task on this core gets it. */
void cring__shm_relax(long i);
/* How many pause iterations a wait of this thread may spin before it yields. */
long cring__shm_spin_limit(const cring__shm_t *shm);
/* Mark the segment aborted so every waiter on every rank fails fast with the
 * same kind of error: `why` and `peer` (-1 if none) say what happened. The
 * first abort's reason wins. */
void cring__shm_abort(cring__shm_t *shm, cring_status_t why, int peer);
/* This rank shuts down cleanly: a peer that waits for it from now on fails at
 * once with ERR_PEER_FAILURE saying it left (not that it died). */
void cring__shm_leave(cring__shm_t *shm);

/* Doorbells wake an idle rank: ring peer's bell (any thread, any process
 * sharing the segment; cheap when nobody sleeps on it). */
void cring__shm_ring(cring__shm_t *shm, int peer);
/* The current value of this rank's bell, to pass to cring__shm_idle_wait. */
uint32_t cring__shm_bell(const cring__shm_t *shm);
/* Sleep until this rank's bell differs from `seen`, the segment is aborted,
 * or max_wait_s passes. */
void cring__shm_idle_wait(cring__shm_t *shm, uint32_t seen, double max_wait_s);
/* Announce that this rank is about to start round `round` of collectives
 * (rounds count from 1 and only grow). Rings nobody: a rank that then waits
 * for a peer rings that peer's bell if no thread of the peer is driving. */
void cring__shm_announce(cring__shm_t *shm, uint64_t round);
/* Say whether a thread of this rank is driving collectives now. */
void cring__shm_set_driving(cring__shm_t *shm, int on);
/* The highest round any peer has announced. */
uint64_t cring__shm_peer_announced(const cring__shm_t *shm);

/* ---- shared regions (transport/shm_region.c) -------------------------------- */
/* Create and map a new file of nbytes (zeroed) in /dev/shm under a fresh
 * random name written to name (name_len >= 64). The caller unlinks it with
 * cring__shm_region_unlink once every peer has it mapped. On error *out is
 * NULL and nothing is left behind. */
cring_status_t cring__shm_region_create(size_t nbytes, char *name, size_t name_len, void **out,
                                        cring__errmsg_t *err);
/* Map a peer's region by name; ERR_MISMATCH when its size is not nbytes,
 * ERR_NOT_SUPPORTED when it cannot be opened (another host). */
cring_status_t cring__shm_region_open(const char *name, size_t nbytes, void **out,
                                      cring__errmsg_t *err);
void cring__shm_region_unlink(const char *name);
void cring__shm_region_unmap(void *base, size_t nbytes);

#endif /* CRING_TRANSPORT_H */

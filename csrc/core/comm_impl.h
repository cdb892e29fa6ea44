/* comm_impl.h: the communicator's struct and the ops-table type, shared by
 * the files of csrc/core only (comm.c: setup and entry points; ops.c: the
 * flat tables; hier.c: the hierarchical table). No other layer includes it. */
#ifndef CRING_COMM_IMPL_H
#define CRING_COMM_IMPL_H

#include <stdatomic.h>
#include <stdint.h>

#include "../algo/agree.h"
#include "../algo/algo.h"
#include "comm_internal.h"

#define CRING__SHM_MAX_RANKS 64
#define CRING__MAX_REGIONS 16

/* A transport's collectives and idle-wait primitives (ops.c, hier.c). */
struct cring__comm_ops {
    const char *name; /* "self", "shm", "tcp", "hier(shm+tcp)" */
    /* The idle wait also returns when a peer's data arrives, so a thread that
     * is not driving must not use it while another thread of this rank drives
     * (it would spin on the driver's input). */
    int idle_wait_sees_peer_input;
    cring_status_t (*agree)(cring_comm_t *c, cring__desc_t *d);
    cring_status_t (*allreduce)(cring_comm_t *c, const void *send, void *recv, size_t count,
                                cring_dtype_t dtype, cring_op_t op);
    cring_status_t (*broadcast)(cring_comm_t *c, void *buf, size_t nbytes, int root);
    cring_status_t (*allgatherv)(cring_comm_t *c, const void *send, size_t send_bytes, void *recv,
                                 const size_t *recv_bytes);
    cring_status_t (*reducescatter)(cring_comm_t *c, const void *send, void *recv,
                                    const size_t *counts, cring_dtype_t dtype, cring_op_t op);
    cring_status_t (*barrier)(cring_comm_t *c);
    cring_status_t (*alltoallv)(cring_comm_t *c, const void *send, void *recv,
                                const size_t *matrix);
    /* NULL when the transport cannot gather small blocks in one exchange */
    cring_status_t (*gather_small)(cring_comm_t *c, const void *mine, size_t bytes,
                                   const void **ptrs_out, size_t *lens_out);
    size_t (*gather_small_max)(const cring_comm_t *c);
    void (*wake)(cring_comm_t *c);
    void (*announce)(cring_comm_t *c, uint64_t round);
    void (*set_driving)(cring_comm_t *c, int on);
    int (*peer_waiting)(cring_comm_t *c, uint64_t rounds_done);
    uint64_t (*wake_token)(cring_comm_t *c);
    int (*idle_wait)(cring_comm_t *c, uint64_t token, double max_wait_s);
    int (*idle_wait_local)(cring_comm_t *c, uint64_t token, double max_wait_s);
    /* NULL when the transport has no multi-tensor allreduce (the engine then
     * packs the tensors into its fusion buffer) */
    cring_status_t (*allreduce_multi)(cring_comm_t *c, cring__seg_t *segs, int nsegs,
                                      cring_dtype_t dtype, cring_op_t op);
};

extern const struct cring__comm_ops cring__self_ops, cring__shm_ops, cring__tcp_ops,
    cring__hier_ops;

struct cring_comm {
    int rank, size;
    int local_rank, local_size;
    int cross_rank, cross_size;
    double timeout_s;
    cring_store_server_t *server; /* when this rank serves the store */
    cring_store_t *store;
    /* Flat: exactly one of p2p and shm is set. Hierarchical: shm is this
     * host's segment (local_rank of local_size) and p2p the cross mesh
     * (host index of nhosts), both set. */
    cring__p2p_t *p2p;
    cring__shm_t *shm;
    cring__scratch_t scratch;
    cring__desc_t *descs; /* size entries, for agreement */
    uint64_t agreements;
    _Atomic int broken;                /* CRING_OK while usable, else the status that broke it */
    int wake_fd;                       /* eventfd for waking an idle TCP rank; -1 with shm */
    const struct cring__comm_ops *ops; /* the transport's table, chosen once at init */
    /* every rank's host index (hosts numbered by their lowest rank) and
     * local rank; nhosts hosts; hosts_even: each has local_size ranks */
    int *host_of, *local_of;
    int nhosts, hosts_even;
    size_t tree_max_bytes;    /* p2p allreduce: recursive doubling up to this */
    struct cring__hier *hier; /* set when the hierarchical table is in use */
    /* payload bytes this rank gave to / took from shared-memory collectives */
    _Atomic uint64_t shm_bytes_sent, shm_bytes_received;
    char key_prefix[256];
    cring__errmsg_t err;
    /* shared regions (regions.c): filled by registration on any thread,
     * published by the release store of nregions, read by the driver */
    struct cring__region *regions[CRING__MAX_REGIONS];
    _Atomic int nregions;
    unsigned region_calls; /* registrations attempted: part of their store keys */
};

/* Every rank says ok or not through the store under key `what`; *all_ok is 1
 * when every rank said ok. */
cring_status_t cring__comm_vote(cring_comm_t *c, const char *what, int ok, int *all_ok);
/* Count shared-memory payload bytes. One writer (the driving thread), so a
 * relaxed load and store, not a locked add: this sits on the shm hot path. */
static inline void cring__comm_count_shm(cring_comm_t *c, size_t sent, size_t received) {
    atomic_store_explicit(&c->shm_bytes_sent,
                          atomic_load_explicit(&c->shm_bytes_sent, memory_order_relaxed) + sent,
                          memory_order_relaxed);
    atomic_store_explicit(&c->shm_bytes_received,
                          atomic_load_explicit(&c->shm_bytes_received, memory_order_relaxed) +
                              received,
                          memory_order_relaxed);
}
/* Allreduce over c->p2p: recursive doubling up to c->tree_max_bytes, else the ring. */
cring_status_t cring__comm_p2p_allreduce(cring_comm_t *c, const void *send, void *recv,
                                         size_t count, cring_dtype_t dtype, cring_op_t op);
/* The shared-memory window size (CRING_SHM_WINDOW_BYTES, at least 8 KiB). */
size_t cring__comm_shm_window_bytes(void);
/* Drain the wake eventfd; 1 when it had been signalled. */
int cring__comm_drain_wake_fd(cring_comm_t *c);

/* hier.c. Called by choose_transport when ranks span hosts and some share
 * one: decides (the same way on every rank) whether to go hierarchical and,
 * if so, builds c->shm over this host's ranks and c->p2p across hosts and
 * sets c->hier. CRING_OK with c->hier NULL means "use the flat ring" (the
 * reason is logged). init is the flat transport's init, as a template. */
cring_status_t cring__hier_setup(cring_comm_t *c, const cring_config_t *cfg,
                                 const cring__transport_init_t *init);
/* After the wake eventfd exists: start the thread that turns local peers'
 * doorbell rings into wake-ups of the eventfd. */
cring_status_t cring__hier_start(cring_comm_t *c);

/* regions.c. The allreduce of a buffer inside a shared region, in place:
 * *handled is 0 (and nothing happened) when buf is not in one. */
cring_status_t cring__comm_region_allreduce(cring_comm_t *c, void *buf, size_t count,
                                            cring_dtype_t dtype, cring_op_t op, int *handled);
/* Unmap the peers' mappings (this rank's own stay mapped: callers' tensors
 * may outlive the communicator). */
void cring__comm_regions_destroy(cring_comm_t *c);
/* Stop that thread and free c->hier (the transports are the comm's). */
void cring__hier_destroy(cring_comm_t *c);

#endif

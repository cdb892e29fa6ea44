/* hier.c: the hierarchical ops table, for ranks that span hosts with several
 * on each: shared memory within a host, TCP across hosts, every local rank
 * carrying its own slice across. Also its setup and the doorbell thread.
 * It never touches sockets or mappings directly (transport.h does). */
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "../reduce/reduce.h"
#include "comm_impl.h"

/*
 * Layout. Hosts are numbered 0..H-1 by their lowest rank; each runs L ranks
 * (local ranks 0..L-1). c->shm is this host's segment (rank = local rank),
 * c->p2p a TCP mesh among the H ranks that share this rank's local rank
 * (rank = host index): one cross mesh per local rank, so all L ranks of a
 * host send and receive at once. rank_at[h*L + l] is the global rank of
 * local rank l on host h (ranks may be numbered in any order across hosts).
 *
 * allreduce (n elements)
 *   large:  local reduce-scatter into L slices   (shm: slice l on local rank l)
 *           cross allreduce of slice l            (TCP, among local rank l's)
 *           local allgather of the slices         (shm)
 *   small (<= CRING_TREE_MAX_BYTES, or n < L):
 *           local allreduce of the whole vector   (shm)
 *           cross allreduce of the whole vector   (TCP, every local rank:
 *           the same data, so no local step after it)
 * reducescatter: blocks reordered local-major (block of (h,l) at local slice
 *   l), local reduce-scatter, cross ring reduce-scatter of slice l.
 * allgatherv: cross ring allgather of local rank l's blocks, local allgather,
 *   then blocks put back in rank order.
 * broadcast: the root's host first (shm), then across: small, every local
 *   rank carries the whole buffer; large, local rank l carries slice l and
 *   each other host reassembles with a local allgather.
 * barrier: local barrier, then cross barrier (a rank past the cross barrier
 *   knows every host's ranks passed their local one).
 * alltoallv: two stages, cross then local: (h,l) sends (h',l) everything it
 *   has for host h' (blocks for (h',0..L-1)); then each rank hands every
 *   local peer what arrived for it.
 * AVERAGE sums in every stage and divides by the world size once at the end.
 *
 * Idle waits: TCP input from the cross mesh and the wake eventfd are polled
 * as on the flat TCP table; a local peer's doorbell (a futex in the segment)
 * cannot be polled, so a small thread sleeps on it and signals the eventfd.
 */

struct cring__hier {
    int nhosts, host;      /* H, and this rank's host index (its cross rank) */
    int *rank_at;          /* rank_at[h * L + l] */
    size_t *desc_bytes;    /* size entries of sizeof(cring__desc_t), for agreement */
    size_t *table;         /* scratch size tables: 3 * size + 2 * H * H + L * L entries */
    cring__scratch_t pack; /* blocks reordered between rank and local-major order */
    pthread_t bell_thread;
    int bell_started;
    _Atomic int bell_stop;
};

#define HIER_MAX_L CRING__SHM_MAX_RANKS

/* ---- setup ------------------------------------------------------------------------- */

cring_status_t cring__hier_setup(cring_comm_t *c, const cring_config_t *cfg,
                                 const cring__transport_init_t *init) {
    (void)cfg;
    const char *why = NULL;
    if (c->local_size < 2) why = "no two ranks share a host";
    else if (c->nhosts < 2) why = "one host";
    else if (!c->hosts_even) why = "the hosts run different numbers of ranks";
    else if (c->local_size > HIER_MAX_L) why = "more ranks on a host than shared memory takes";
    if (why) {
        /* the same verdict on every rank: it comes from the topology alone */
        if (c->rank == 0 && c->local_size > 1)
            cring__log(CRING__LOG_INFO, c->rank, "flat TCP ring across hosts: %s", why);
        return CRING_OK;
    }
    int all_want = 0, want = cring__env_long("CRING_HIERARCHICAL", 1) != 0;
    CRING_CHECK(cring__comm_vote(c, "hier_want", want, &all_want));
    if (!all_want) {
        if (c->rank == 0)
            cring__log(CRING__LOG_INFO, c->rank,
                       "flat TCP ring across hosts: CRING_HIERARCHICAL=0 on some rank");
        return CRING_OK;
    }
    const int L = c->local_size, H = c->nhosts, P = c->size;
    struct cring__hier *h = calloc(1, sizeof *h);
    if (!h) return cring__fail(&c->err, CRING_ERR_NO_MEMORY, "out of memory");
    h->nhosts = H;
    h->host = c->host_of[c->rank];
    h->rank_at = calloc((size_t)P, sizeof *h->rank_at);
    h->desc_bytes = calloc((size_t)P, sizeof *h->desc_bytes);
    h->table =
        calloc(3 * (size_t)P + 2 * (size_t)H * (size_t)H + (size_t)L * (size_t)L, sizeof *h->table);
    if (!h->rank_at || !h->desc_bytes || !h->table) {
        c->hier = h; /* freed by cring__hier_destroy */
        cring__hier_destroy(c);
        return cring__fail(&c->err, CRING_ERR_NO_MEMORY, "out of memory");
    }
    for (int r = 0; r < P; r++) {
        h->rank_at[c->host_of[r] * L + c->local_of[r]] = r;
        h->desc_bytes[r] = sizeof(cring__desc_t);
    }

    char local_prefix[400], cross_prefix[400];
    snprintf(local_prefix, sizeof local_prefix, "%s/hier/local/%d", init->key_prefix, h->host);
    snprintf(cross_prefix, sizeof cross_prefix, "%s/hier/cross/%d", init->key_prefix,
             c->local_rank);
    cring__transport_init_t local = *init, cross = *init;
    local.rank = c->local_rank;
    local.size = L;
    local.key_prefix = local_prefix;
    cross.rank = h->host;
    cross.size = H;
    cross.key_prefix = cross_prefix;

    cring_status_t st = cring__shm_create(&local, cring__comm_shm_window_bytes(), &c->shm);
    int all_ok = 0;
    cring_status_t vote = cring__comm_vote(c, "hier_shm_ok", st == CRING_OK, &all_ok);
    if (vote != CRING_OK || !all_ok) {
        if (c->rank == 0 && vote == CRING_OK)
            cring__log(CRING__LOG_INFO, c->rank,
                       "flat TCP ring across hosts: shared memory unavailable on some host (%s)",
                       st != CRING_OK ? c->err.text : "another rank failed");
        cring__shm_destroy(c->shm);
        c->shm = NULL;
        c->hier = h;
        cring__hier_destroy(c);
        if (vote != CRING_OK) return vote;
        c->err.text[0] = 0;
        return CRING_OK;
    }
    c->hier = h; /* from here the comm owns it (cring_comm_destroy) */
    return cring__tcp_create(&cross, &c->p2p);
}

static void *bell_main(void *arg) {
    cring_comm_t *c = arg;
    uint32_t seen = cring__shm_bell(c->shm);
    while (!atomic_load(&c->hier->bell_stop)) {
        double t0 = cring__now_s();
        cring__shm_idle_wait(c->shm, seen, 1.0);
        uint32_t now = cring__shm_bell(c->shm);
        if (now != seen) {
            seen = now;
            c->ops->wake(c);
        } else if (cring__now_s() - t0 < 1e-3) {
            /* an aborted segment no longer sleeps: do not spin on it */
            struct timespec ts = {0, 20 * 1000 * 1000};
            nanosleep(&ts, NULL);
        }
    }
    return NULL;
}

cring_status_t cring__hier_start(cring_comm_t *c) {
    if (!c->hier) return CRING_OK;
    if (pthread_create(&c->hier->bell_thread, NULL, bell_main, c) != 0)
        return cring__fail(&c->err, CRING_ERR_SYSTEM, "could not start the doorbell thread");
    c->hier->bell_started = 1;
    return CRING_OK;
}

void cring__hier_destroy(cring_comm_t *c) {
    struct cring__hier *h = c->hier;
    if (!h) return;
    if (h->bell_started) {
        atomic_store(&h->bell_stop, 1);
        cring__shm_ring(c->shm, c->local_rank);
        pthread_join(h->bell_thread, NULL);
    }
    cring__scratch_free(&h->pack);
    free(h->rank_at);
    free(h->desc_bytes);
    free(h->table);
    free(h);
    c->hier = NULL;
}

/* ---- local steps (shared memory, counted) ------------------------------------------ */

static cring_status_t local_allreduce(cring_comm_t *c, const void *send, void *recv, size_t count,
                                      cring_dtype_t dtype, cring_op_t op) {
    size_t bytes = count * cring_dtype_size(dtype);
    cring__comm_count_shm(c, bytes, bytes);
    return cring__shm_allreduce(c->shm, c->local_rank, c->local_size, send, recv, count, dtype, op);
}

static cring_status_t local_reducescatter(cring_comm_t *c, const void *send, void *recv,
                                          const size_t *counts, cring_dtype_t dtype,
                                          cring_op_t op) {
    size_t total = 0, es = cring_dtype_size(dtype);
    for (int l = 0; l < c->local_size; l++) total += counts[l];
    cring__comm_count_shm(c, total * es, counts[c->local_rank] * es);
    return cring__shm_reducescatter(c->shm, c->local_rank, c->local_size, send, recv, counts, dtype,
                                    op);
}

static cring_status_t local_allgatherv(cring_comm_t *c, const void *send, size_t send_bytes,
                                       void *recv, const size_t *recv_bytes) {
    size_t total = 0;
    for (int l = 0; l < c->local_size; l++) total += recv_bytes[l];
    cring__comm_count_shm(c, send_bytes, total - send_bytes);
    return cring__shm_allgatherv(c->shm, c->local_rank, c->local_size, send, send_bytes, recv,
                                 recv_bytes);
}

static cring_status_t local_broadcast(cring_comm_t *c, void *buf, size_t nbytes, int root) {
    int mine = c->local_rank == root;
    cring__comm_count_shm(c, mine ? nbytes : 0, mine ? 0 : nbytes);
    return cring__shm_broadcast(c->shm, c->local_rank, c->local_size, buf, nbytes, root);
}

/* The transports name peers by their rank in the sub-communicator: say what
 * those numbers mean in global ranks (a user knows only those). */
static cring_status_t annotate(cring_comm_t *c, cring_status_t st, int across) {
    if (st == CRING_OK || st == CRING_ERR_INVALID_ARGUMENT || st == CRING_ERR_NO_MEMORY ||
        st == CRING_ERR_NOT_SUPPORTED)
        return st;
    const struct cring__hier *h = c->hier;
    const int L = c->local_size;
    char map[400];
    size_t used = 0;
    int n = across ? h->nhosts : L;
    for (int i = 0; i < n && used + 24 < sizeof map; i++) {
        int g = across ? h->rank_at[i * L + c->local_rank] : h->rank_at[h->host * L + i];
        used += (size_t)snprintf(map + used, sizeof map - used, "%s%d=%d", i ? " " : "", i, g);
    }
    char text[sizeof c->err.text];
    snprintf(text, sizeof text, "%s", c->err.text);
    cring__fail(&c->err, st,
                "%s [rank %d, hierarchical: %s, so the ranks named are %s (as global ranks: %s)]",
                text, c->rank, across ? "between hosts" : "within its host",
                across ? "host indices" : "local ranks", map);
    return st;
}

#define LOCAL(call)                                                                                \
    do {                                                                                           \
        cring_status_t st_ = (call);                                                               \
        if (st_ != CRING_OK) return annotate(c, st_, 0);                                           \
    } while (0)
#define CROSS(call)                                                                                \
    do {                                                                                           \
        cring_status_t st_ = (call);                                                               \
        if (st_ != CRING_OK) return annotate(c, st_, 1);                                           \
    } while (0)

/* n split into L near-even parts: len[l], off[l] (off has L+1 entries). */
static void split_even(size_t n, int L, size_t *len, size_t *off) {
    off[0] = 0;
    for (int l = 0; l < L; l++) {
        len[l] = n / (size_t)L + ((size_t)l < n % (size_t)L);
        off[l + 1] = off[l] + len[l];
    }
}

/* ---- collectives ------------------------------------------------------------------- */

static cring_status_t hier_allreduce(cring_comm_t *c, const void *send, void *recv, size_t count,
                                     cring_dtype_t dtype, cring_op_t op) {
    if (count == 0) return CRING_OK;
    const size_t es = cring_dtype_size(dtype);
    const cring_op_t sum_op = op == CRING_AVERAGE ? CRING_SUM : op;
    const int L = c->local_size, l = c->local_rank;
    if (count * es <= c->tree_max_bytes || count < (size_t)L) {
        LOCAL(local_allreduce(c, send, recv, count, dtype, sum_op));
        CROSS(cring__comm_p2p_allreduce(c, recv, recv, count, dtype, sum_op));
        if (op == CRING_AVERAGE) cring__reduce_average(dtype, recv, count, c->size);
        return CRING_OK;
    }
    size_t len[HIER_MAX_L], off[HIER_MAX_L + 1], bytes[HIER_MAX_L];
    split_even(count, L, len, off);
    for (int q = 0; q < L; q++) bytes[q] = len[q] * es;
    char *own = (char *)recv + off[l] * es;
    LOCAL(local_reducescatter(c, send, own, len, dtype, sum_op));
    CROSS(cring__comm_p2p_allreduce(c, own, own, len[l], dtype, sum_op));
    if (op == CRING_AVERAGE) cring__reduce_average(dtype, own, len[l], c->size);
    LOCAL(local_allgatherv(c, own, bytes[l], recv, bytes));
    return CRING_OK;
}

static cring_status_t hier_reducescatter(cring_comm_t *c, const void *send, void *recv,
                                         const size_t *counts, cring_dtype_t dtype, cring_op_t op) {
    struct cring__hier *h = c->hier;
    const int P = c->size, L = c->local_size, H = h->nhosts, l = c->local_rank;
    const size_t es = cring_dtype_size(dtype);
    const cring_op_t sum_op = op == CRING_AVERAGE ? CRING_SUM : op;
    size_t *goff = h->table, *cross_counts = goff + P;
    size_t local_counts[HIER_MAX_L], local_off[HIER_MAX_L + 1];
    size_t total = 0;
    for (int r = 0; r < P; r++) {
        goff[r] = total;
        total += counts[r];
    }
    if (total == 0) return CRING_OK;
    CRING_CHECK(cring__scratch_reserve(&h->pack, total * es));
    char *pack = h->pack.ptr;
    const char *in = send;
    size_t pos = 0; /* local-major: slice q holds the blocks of (0,q), (1,q), ... */
    for (int q = 0; q < L; q++) {
        local_off[q] = pos;
        for (int hh = 0; hh < H; hh++) {
            int r = h->rank_at[hh * L + q];
            memcpy(pack + pos * es, in + goff[r] * es, counts[r] * es);
            pos += counts[r];
        }
        local_counts[q] = pos - local_off[q];
    }
    for (int hh = 0; hh < H; hh++) cross_counts[hh] = counts[h->rank_at[hh * L + l]];
    char *own = pack + local_off[l] * es;
    LOCAL(local_reducescatter(c, pack, own, local_counts, dtype, sum_op));
    CROSS(cring__ring_reducescatter(c->p2p, &c->scratch, own, recv, cross_counts, dtype, sum_op));
    if (op == CRING_AVERAGE) cring__reduce_average(dtype, recv, counts[c->rank], P);
    return CRING_OK;
}

static cring_status_t hier_allgatherv(cring_comm_t *c, const void *send, size_t send_bytes,
                                      void *recv, const size_t *recv_bytes) {
    struct cring__hier *h = c->hier;
    const int P = c->size, L = c->local_size, H = h->nhosts, l = c->local_rank;
    size_t *goff = h->table, *cross_bytes = goff + P;
    size_t local_bytes[HIER_MAX_L], local_off[HIER_MAX_L + 1];
    size_t total = 0;
    for (int r = 0; r < P; r++) {
        goff[r] = total;
        total += recv_bytes[r];
    }
    if (total == 0) return CRING_OK;
    local_off[0] = 0;
    for (int q = 0; q < L; q++) {
        local_bytes[q] = 0;
        for (int hh = 0; hh < H; hh++) local_bytes[q] += recv_bytes[h->rank_at[hh * L + q]];
        local_off[q + 1] = local_off[q] + local_bytes[q];
    }
    for (int hh = 0; hh < H; hh++) cross_bytes[hh] = recv_bytes[h->rank_at[hh * L + l]];
    CRING_CHECK(cring__scratch_reserve(&h->pack, total));
    char *pack = h->pack.ptr;
    CROSS(cring__ring_allgatherv(c->p2p, send, send_bytes, pack + local_off[l], cross_bytes));
    LOCAL(local_allgatherv(c, pack + local_off[l], local_bytes[l], pack, local_bytes));
    char *out = recv;
    size_t pos = 0;
    for (int q = 0; q < L; q++)
        for (int hh = 0; hh < H; hh++) {
            int r = h->rank_at[hh * L + q];
            memcpy(out + goff[r], pack + pos, recv_bytes[r]);
            pos += recv_bytes[r];
        }
    return CRING_OK;
}

static cring_status_t hier_broadcast(cring_comm_t *c, void *buf, size_t nbytes, int root) {
    if (nbytes == 0) return CRING_OK;
    const int L = c->local_size, l = c->local_rank;
    const int root_host = c->host_of[root], here = c->hier->host == root_host;
    if (here) LOCAL(local_broadcast(c, buf, nbytes, c->local_of[root]));
    if (nbytes <= c->tree_max_bytes || nbytes < (size_t)L) {
        CROSS(cring__ring_broadcast(c->p2p, buf, nbytes, root_host));
        return CRING_OK;
    }
    size_t len[HIER_MAX_L], off[HIER_MAX_L + 1];
    split_even(nbytes, L, len, off);
    char *mine = (char *)buf + off[l];
    CROSS(cring__ring_broadcast(c->p2p, mine, len[l], root_host));
    if (!here) LOCAL(local_allgatherv(c, mine, len[l], buf, len));
    return CRING_OK;
}

static cring_status_t hier_barrier(cring_comm_t *c) {
    LOCAL(cring__shm_barrier(c->shm));
    CROSS(cring__p2p_barrier(c->p2p));
    return CRING_OK;
}

/* Alltoallv in two stages (see the top). M(q, r): bytes rank q sends rank r. */
static cring_status_t hier_alltoallv(cring_comm_t *c, const void *send, void *recv,
                                     const size_t *matrix) {
    struct cring__hier *h = c->hier;
    const int P = c->size, L = c->local_size, H = h->nhosts, l = c->local_rank, me = c->rank;
    const int host = h->host;
    const int *at = h->rank_at;
#define M(q, r) matrix[(size_t)(q) * (size_t)P + (size_t)(r)]
    size_t *soff = h->table, *roff = soff + P, *boff = roff + P;
    size_t *cross_m = boff + P, *local_m = cross_m + (size_t)H * H;
    size_t stotal = 0, rtotal = 0;
    for (int r = 0; r < P; r++) {
        soff[r] = stotal;
        stotal += M(me, r);
        roff[r] = rtotal;
        rtotal += M(r, me);
    }
    /* cross_m[a*H + b]: what (a,l) sends (b,l): its blocks for every (b,y) */
    for (int a = 0; a < H; a++)
        for (int b = 0; b < H; b++) {
            size_t sum = 0;
            for (int y = 0; y < L; y++) sum += M(at[a * L + l], at[b * L + y]);
            cross_m[a * H + b] = sum;
        }
    /* local_m[x*L + y]: what (host,x) hands (host,y): blocks (a,x) -> (host,y) */
    for (int x = 0; x < L; x++)
        for (int y = 0; y < L; y++) {
            size_t sum = 0;
            for (int a = 0; a < H; a++) sum += M(at[a * L + x], at[host * L + y]);
            local_m[x * L + y] = sum;
        }
    size_t btotal = 0; /* stage 1 receives: from each host a, in source order */
    for (int a = 0; a < H; a++) {
        boff[a] = btotal;
        btotal += cross_m[a * H + host];
    }
    CRING_CHECK(cring__scratch_reserve(&h->pack, stotal + 2 * btotal + rtotal + 1));
    char *A = h->pack.ptr, *B = A + stotal, *C = B + btotal, *D = C + btotal;
    const char *in = send;
    char *out = recv;
    size_t pos = 0;
    for (int b = 0; b < H; b++) /* A: my blocks by destination host, then local rank */
        for (int y = 0; y < L; y++) {
            int r = at[b * L + y];
            memcpy(A + pos, in + soff[r], M(me, r));
            pos += M(me, r);
        }
    CROSS(cring__p2p_alltoallv(c->p2p, A, B, cross_m));
    pos = 0;
    for (int y = 0; y < L; y++) /* C: what arrived, by destination local rank */
        for (int a = 0; a < H; a++) {
            size_t at_b = boff[a];
            for (int y2 = 0; y2 < y; y2++) at_b += M(at[a * L + l], at[host * L + y2]);
            size_t n = M(at[a * L + l], at[host * L + y]);
            memcpy(C + pos, B + at_b, n);
            pos += n;
        }
    size_t sent = 0, received = 0;
    for (int y = 0; y < L; y++) {
        sent += local_m[l * L + y];
        received += local_m[y * L + l];
    }
    cring__comm_count_shm(c, sent, received);
    LOCAL(cring__shm_alltoallv(c->shm, l, L, C, D, local_m));
    pos = 0;
    for (int x = 0; x < L; x++) /* D: from local rank x, blocks of (0,x), (1,x), ... */
        for (int a = 0; a < H; a++) {
            int q = at[a * L + x];
            memcpy(out + roff[q], D + pos, M(q, me));
            pos += M(q, me);
        }
#undef M
    return CRING_OK;
}

static cring_status_t hier_agree(cring_comm_t *c, cring__desc_t *d) {
    return hier_allgatherv(c, d, sizeof *d, c->descs, c->hier->desc_bytes);
}

/* ---- idle waits: the TCP ones, plus local peers' rounds ---------------------------- */

static void hier_wake(cring_comm_t *c) { cring__tcp_ops.wake(c); }
static void hier_announce(cring_comm_t *c, uint64_t round) { cring__shm_announce(c->shm, round); }
static void hier_set_driving(cring_comm_t *c, int on) { cring__shm_set_driving(c->shm, on); }
static int hier_peer_waiting(cring_comm_t *c, uint64_t rounds_done) {
    return cring__shm_peer_announced(c->shm) > rounds_done || c->p2p->ops->idle_wait(c->p2p, -1, 0);
}
static uint64_t hier_wake_token(cring_comm_t *c) { return 0; }
static int hier_idle_wait(cring_comm_t *c, uint64_t token, double max_wait_s) {
    return cring__tcp_ops.idle_wait(c, token, max_wait_s);
}
static int hier_idle_wait_local(cring_comm_t *c, uint64_t token, double max_wait_s) {
    return cring__tcp_ops.idle_wait_local(c, token, max_wait_s);
}

const struct cring__comm_ops cring__hier_ops = {
    "hier(shm+tcp)",
    1,
    hier_agree,
    hier_allreduce,
    hier_broadcast,
    hier_allgatherv,
    hier_reducescatter,
    hier_barrier,
    hier_alltoallv,
    NULL,
    NULL,
    hier_wake,
    hier_announce,
    hier_set_driving,
    hier_peer_waiting,
    hier_wake_token,
    hier_idle_wait,
    hier_idle_wait_local,
    NULL,
};

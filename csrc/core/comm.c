/* comm.c: the communicator: rendezvous through the store, host topology,
 * transport choice, and the public blocking collectives, each of which agrees
 * on its arguments and then runs one algorithm. It never touches sockets or
 * shared memory directly. */
#include <errno.h>
#include <poll.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <time.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../common/net.h"
#include "../reduce/reduce.h"
#include "comm_impl.h"

#define SHM_MAX_RANKS CRING__SHM_MAX_RANKS
/* p2p allreduce: recursive doubling up to this many bytes, the ring above
 * (CRING_TREE_MAX_BYTES overrides; measured in docs/scaling.md). */
#define DEFAULT_TREE_MAX_BYTES ((size_t)64 * 1024)
#define DEFAULT_TIMEOUT_S 600.0
#define DEFAULT_SHM_WINDOW_BYTES (4u << 20)

void cring_config_init(cring_config_t *cfg) {
    memset(cfg, 0, sizeof *cfg);
    cfg->rank = 0;
    cfg->size = 1;
    cfg->store_addr = "127.0.0.1";
    cfg->transport = CRING_TRANSPORT_AUTO;
    cfg->timeout_s = DEFAULT_TIMEOUT_S;
}

const char *cring_last_init_error(void) { return cring__thread_errmsg()->text; }

/* A string that is equal for two processes exactly when they can share
 * memory: same kernel boot, same /dev/shm mount, same PID namespace (the
 * liveness check reads peers' PIDs) and same host name. The nonce check in
 * the shm transport then proves it. */
static void host_identity(char *out, size_t len) {
    char boot[64] = "?", host[256] = "?";
    FILE *f = fopen("/proc/sys/kernel/random/boot_id", "r");
    if (f) {
        if (!fgets(boot, sizeof boot, f)) strcpy(boot, "?");
        fclose(f);
        boot[strcspn(boot, "\n")] = 0;
    }
    gethostname(host, sizeof host - 1);
    struct stat shm_st = {0}, pidns_st = {0};
    stat("/dev/shm", &shm_st);
    stat("/proc/self/ns/pid", &pidns_st);
    snprintf(out, len, "%s|%s|%llx:%llx|%llx", boot, host, (unsigned long long)shm_st.st_dev,
             (unsigned long long)shm_st.st_ino, (unsigned long long)pidns_st.st_ino);
}

static cring_status_t exchange_topology(cring_comm_t *c) {
    cring_status_t st = CRING_OK;
    char key[512], mine[512];
    char **ids = calloc((size_t)c->size, sizeof *ids);
    if (!ids) return cring__fail(&c->err, CRING_ERR_NO_MEMORY, "out of memory");
    host_identity(mine, sizeof mine);
    snprintf(key, sizeof key, "%s/host/%d", c->key_prefix, c->rank);
    CRING_CHECK_GOTO(cring_store_set(c->store, key, mine, strlen(mine) + 1), st, cleanup);
    for (int r = 0; r < c->size; r++) {
        size_t len;
        snprintf(key, sizeof key, "%s/host/%d", c->key_prefix, r);
        CRING_CHECK_GOTO(cring_store_get(c->store, key, c->timeout_s, (void **)&ids[r], &len), st,
                         cleanup);
        if (len == 0 || ids[r][len - 1] != 0) {
            st = cring__fail(&c->err, CRING_ERR_PROTOCOL, "malformed host record of rank %d", r);
            goto cleanup;
        }
    }
    c->local_rank = c->local_size = 0;
    for (int r = 0; r < c->size; r++) {
        if (strcmp(ids[r], mine) != 0) continue;
        if (r < c->rank) c->local_rank++;
        c->local_size++;
    }
    /* Every rank's host (numbered by the host's lowest rank) and local rank,
     * for the hierarchical collectives. */
    size_t nranks = c->size > 0 ? (size_t)c->size : 1;
    c->host_of = calloc(nranks, sizeof *c->host_of);
    c->local_of = calloc(nranks, sizeof *c->local_of);
    if (!c->host_of || !c->local_of) {
        st = cring__fail(&c->err, CRING_ERR_NO_MEMORY, "out of memory");
        goto cleanup;
    }
    c->nhosts = 0;
    for (int r = 0; r < c->size; r++) {
        c->host_of[r] = -1;
        c->local_of[r] = 0;
        for (int q = 0; q < r; q++) {
            if (strcmp(ids[q], ids[r]) != 0) continue;
            c->host_of[r] = c->host_of[q];
            c->local_of[r]++;
        }
        if (c->host_of[r] < 0) c->host_of[r] = c->nhosts++;
    }
    c->hosts_even = 1;
    for (int r = 0; r < c->size; r++)
        if (c->local_of[r] >= c->local_size) c->hosts_even = 0;
    if (c->nhosts * c->local_size != c->size) c->hosts_even = 0;
    /* Local rank of every rank, to group the ranks that share ours. */
    c->cross_rank = c->cross_size = 0;
    for (int r = 0; r < c->size; r++) {
        int lr = 0;
        for (int q = 0; q < r; q++) lr += strcmp(ids[q], ids[r]) == 0;
        if (lr != c->local_rank) continue;
        if (r < c->rank) c->cross_rank++;
        c->cross_size++;
    }
cleanup:
    if (st != CRING_OK && c->err.text[0] == 0)
        cring__fail(&c->err, st, "rank %d: topology exchange through the store failed: %s", c->rank,
                    cring__thread_errmsg()->text);
    for (int r = 0; r < c->size; r++) free(ids[r]);
    free(ids);
    return st;
}

/* Every rank says whether something worked for it (the shared-memory
 * transport, the hierarchical setup); all use it only if all did. */
cring_status_t cring__comm_vote(cring_comm_t *c, const char *what, int ok, int *all_ok) {
    char key[512];
    snprintf(key, sizeof key, "%s/%s/%d", c->key_prefix, what, c->rank);
    CRING_CHECK(cring_store_set(c->store, key, ok ? "1" : "0", 1));
    *all_ok = 1;
    for (int r = 0; r < c->size; r++) {
        void *v = NULL;
        size_t len = 0;
        snprintf(key, sizeof key, "%s/%s/%d", c->key_prefix, what, r);
        CRING_CHECK(cring_store_get(c->store, key, c->timeout_s, &v, &len));
        if (len != 1 || ((char *)v)[0] != '1') *all_ok = 0;
        free(v);
    }
    return CRING_OK;
}

size_t cring__comm_shm_window_bytes(void) {
    long window = cring__env_long("CRING_SHM_WINDOW_BYTES", DEFAULT_SHM_WINDOW_BYTES);
    return window < 8192 ? 8192 : (size_t)window;
}

static cring_status_t choose_transport(cring_comm_t *c, const cring_config_t *cfg) {
    char listen_addr[64];
    char prefix[300];
    cring__transport_init_t init = {
        .rank = c->rank,
        .size = c->size,
        .store = c->store,
        .key_prefix = c->key_prefix,
        .listen_addr = cfg->listen_addr,
        .secret = cfg->secret,
        .timeout_s = c->timeout_s,
        .err = &c->err,
    };
    uint64_t shm_params[CRING__SHM_PARAMS];
    cring__shm_tuning_params(shm_params);
    init.shm_params = shm_params;
    int one_host = c->local_size == c->size;
    if (cfg->transport == CRING_TRANSPORT_SHM && !one_host)
        return cring__fail(&c->err, CRING_ERR_NOT_SUPPORTED,
                           "CRING_TRANSPORT=shm, but only %d of %d ranks share rank %d's host",
                           c->local_size, c->size, c->rank);
    if (cfg->transport == CRING_TRANSPORT_SHM && c->size > SHM_MAX_RANKS)
        return cring__fail(&c->err, CRING_ERR_NOT_SUPPORTED,
                           "the shared-memory transport supports at most %d ranks", SHM_MAX_RANKS);
    if (cfg->transport != CRING_TRANSPORT_TCP && one_host && c->size > 1 &&
        c->size <= SHM_MAX_RANKS) {
        cring_status_t st = cring__shm_create(&init, cring__comm_shm_window_bytes(), &c->shm);
        int all_ok = 0;
        CRING_CHECK(cring__comm_vote(c, "shm_ok", st == CRING_OK, &all_ok));
        if (all_ok) return CRING_OK;
        cring__shm_destroy(c->shm);
        c->shm = NULL;
        if (cfg->transport == CRING_TRANSPORT_SHM)
            return st != CRING_OK ? st
                                  : cring__fail(&c->err, CRING_ERR_NOT_SUPPORTED,
                                                "another rank could not map the shared memory");
        cring__log(CRING__LOG_INFO, c->rank, "shared memory unavailable (%s); using TCP",
                   st != CRING_OK ? c->err.text : "another rank failed");
        c->err.text[0] = 0;
    }
    if (!cfg->listen_addr) {
        if (cring__net_local_addr_toward(cfg->store_addr, listen_addr, sizeof listen_addr) !=
            CRING_OK)
            snprintf(listen_addr, sizeof listen_addr, "127.0.0.1");
        init.listen_addr = listen_addr;
    }
    snprintf(prefix, sizeof prefix, "%s", c->key_prefix);
    init.key_prefix = prefix;
    if (cfg->transport == CRING_TRANSPORT_AUTO && !one_host) {
        CRING_CHECK(cring__hier_setup(c, cfg, &init));
        if (c->hier) return CRING_OK;
    }
    return cring__tcp_create(&init, &c->p2p);
}

static cring_status_t validate_config(const cring_config_t *cfg) {
    cring__errmsg_t *e = cring__thread_errmsg();
    if (cfg->size < 1)
        return cring__fail(e, CRING_ERR_INVALID_ARGUMENT, "size must be >= 1, got %d", cfg->size);
    if (cfg->rank < 0 || cfg->rank >= cfg->size)
        return cring__fail(e, CRING_ERR_INVALID_ARGUMENT, "rank %d is out of range for size %d",
                           cfg->rank, cfg->size);
    if (cfg->size > 1 && (!cfg->store_addr || !*cfg->store_addr))
        return cring__fail(e, CRING_ERR_INVALID_ARGUMENT, "no rendezvous store address");
    if (cfg->size > 1 && (cfg->store_port < 0 || cfg->store_port > 65535 ||
                          (cfg->store_port == 0 && !cfg->serve_store)))
        return cring__fail(e, CRING_ERR_INVALID_ARGUMENT, "invalid rendezvous port %d",
                           cfg->store_port);
    if (cfg->transport < CRING_TRANSPORT_AUTO || cfg->transport > CRING_TRANSPORT_SHM)
        return cring__fail(e, CRING_ERR_INVALID_ARGUMENT, "unknown transport %d", cfg->transport);
    return CRING_OK;
}

cring_status_t cring_comm_init(const cring_config_t *cfg, cring_comm_t **comm_out) {
    cring_status_t st = CRING_OK;
    *comm_out = NULL;
    cring__thread_errmsg()->text[0] = 0;
    CRING_CHECK(validate_config(cfg));
    cring_comm_t *c = calloc(1, sizeof *c);
    if (!c) return cring__fail(cring__thread_errmsg(), CRING_ERR_NO_MEMORY, "out of memory");
    c->rank = cfg->rank;
    c->size = cfg->size;
    c->timeout_s = cfg->timeout_s > 0 ? cfg->timeout_s : DEFAULT_TIMEOUT_S;
    c->local_size = c->cross_size = 1;
    c->wake_fd = -1;
    c->ops = &cring__self_ops;
    long tree_max = cring__env_long("CRING_TREE_MAX_BYTES", (long)DEFAULT_TREE_MAX_BYTES);
    c->tree_max_bytes = tree_max < 0 ? 0 : (size_t)tree_max;
    snprintf(c->key_prefix, sizeof c->key_prefix, "%s",
             cfg->job_key && *cfg->job_key ? cfg->job_key : "cring");
    c->descs = calloc((size_t)c->size, sizeof *c->descs);
    if (!c->descs) {
        st = cring__fail(&c->err, CRING_ERR_NO_MEMORY, "out of memory");
        goto cleanup;
    }
    if (c->size == 1) goto cleanup; /* nothing to rendezvous with */

    int port = cfg->store_port;
    if (cfg->serve_store) {
        st = cring_store_server_start(cfg->store_addr, port, cfg->secret, &c->server, &port);
        if (st != CRING_OK) {
            cring__fail(&c->err, st, "rank %d could not serve the rendezvous store on %s:%d: %s",
                        c->rank, cfg->store_addr, cfg->store_port, cring__thread_errmsg()->text);
            goto cleanup;
        }
    }
    st = cring_store_connect(cfg->store_addr, port, cfg->secret, c->timeout_s, &c->store);
    if (st != CRING_OK) {
        cring__fail(&c->err, st, "rank %d could not reach the rendezvous store at %s:%d: %s",
                    c->rank, cfg->store_addr, port, cring__thread_errmsg()->text);
        goto cleanup;
    }
    CRING_CHECK_GOTO(exchange_topology(c), st, cleanup);
    CRING_CHECK_GOTO(choose_transport(c, cfg), st, cleanup);
    if (c->p2p) {
        c->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
        if (c->wake_fd < 0) {
            st = cring__fail(&c->err, CRING_ERR_SYSTEM, "eventfd failed: %s", strerror(errno));
            goto cleanup;
        }
    }
    /* Everyone is connected: one barrier over the transport proves it. */
    c->ops = c->hier ? &cring__hier_ops : c->shm ? &cring__shm_ops : &cring__tcp_ops;
    if (c->hier) CRING_CHECK_GOTO(cring__hier_start(c), st, cleanup);
    st = c->ops->barrier(c);

cleanup:
    if (st != CRING_OK) {
        if (c->err.text[0] == 0 && cring__thread_errmsg()->text[0] == 0)
            cring__fail(&c->err, st, "%s", cring_status_string(st));
        if (c->err.text[0]) cring__fail(cring__thread_errmsg(), st, "%s", c->err.text);
        cring_comm_destroy(c);
        return st;
    }
    *comm_out = c;
    return CRING_OK;
}

void cring_comm_destroy(cring_comm_t *c) {
    if (!c) return;
    cring__hier_destroy(c); /* first: its thread watches the segment */
    if (c->p2p) c->p2p->ops->destroy(c->p2p);
    cring__shm_leave(c->shm); /* peers still waiting for this rank learn it left */
    cring__comm_regions_destroy(c);
    cring__shm_destroy(c->shm);
    cring_store_close(c->store);
    cring_store_server_stop(c->server);
    cring__scratch_free(&c->scratch);
    if (c->wake_fd >= 0) close(c->wake_fd);
    free(c->descs);
    free(c->host_of);
    free(c->local_of);
    free(c);
}

const char *cring_collective_name(cring_collective_t collective) {
    switch (collective) {
#define CRING__COLLECTIVE_CASE(name, value, str)                                                   \
    case CRING_COLL_##name: return str;
        CRING_COLLECTIVE_MAP(CRING__COLLECTIVE_CASE)
#undef CRING__COLLECTIVE_CASE
    }
    return "unknown";
}

int cring_comm_rank(const cring_comm_t *c) { return c->rank; }
int cring_comm_size(const cring_comm_t *c) { return c->size; }
int cring_comm_local_rank(const cring_comm_t *c) { return c->local_rank; }
int cring_comm_local_size(const cring_comm_t *c) { return c->local_size; }
int cring_comm_cross_rank(const cring_comm_t *c) { return c->cross_rank; }
int cring_comm_cross_size(const cring_comm_t *c) { return c->cross_size; }
const char *cring_comm_last_error(const cring_comm_t *c) { return c->err.text; }
cring_store_t *cring_comm_store(cring_comm_t *c) { return c->store; }
const char *cring_comm_transport_name(const cring_comm_t *c) { return c->ops->name; }

/* A transport failure leaves peers at unknown points of the protocol: the
 * communicator cannot be trusted again. Tell the other local ranks too. */
static cring_status_t finish(cring_comm_t *c, cring_status_t st) {
    if (st == CRING_OK || st == CRING_ERR_MISMATCH || st == CRING_ERR_INVALID_ARGUMENT ||
        st == CRING_ERR_NOT_SUPPORTED)
        return st;
    int expected = CRING_OK;
    if (atomic_compare_exchange_strong(&c->broken, &expected, (int)st)) {
        if (c->shm) cring__shm_abort(c->shm, st, -1);
        if (c->p2p && c->p2p->ops->cancel) c->p2p->ops->cancel(c->p2p);
    }
    return st;
}

void cring__comm_abort(cring_comm_t *c, cring_status_t st, const char *why) {
    if (atomic_load(&c->broken) != CRING_OK) return;
    if (st == CRING_OK || st == CRING_ERR_MISMATCH || st == CRING_ERR_INVALID_ARGUMENT ||
        st == CRING_ERR_NOT_SUPPORTED)
        st = CRING_ERR_BROKEN; /* finish() keeps the communicator for these */
    cring__fail(&c->err, st, "rank %d stopped its collectives: %s", c->rank, why ? why : "");
    finish(c, st);
}

static cring_status_t check_usable(cring_comm_t *c) {
    int broken = atomic_load(&c->broken);
    if (broken == CRING_OK) return CRING_OK;
    return cring__fail(&c->err, CRING_ERR_BROKEN,
                       "rank %d: the communicator failed earlier (%s); shut down and "
                       "initialise again",
                       c->rank, cring_status_string((cring_status_t)broken));
}

/* Agree on the descriptor with every rank; ERR_MISMATCH leaves the comm usable
 * because every rank stops at the same point. */
static cring_status_t begin(cring_comm_t *c, cring__desc_t *d) {
    CRING_CHECK(check_usable(c));
    c->err.text[0] = 0;
    if (c->size == 1) return CRING_OK;
    d->magic = CRING__DESC_MAGIC;
    cring_status_t st = c->ops->agree(c, d);
    c->agreements++;
    if (st != CRING_OK) return finish(c, st);
    return cring__agree_check(c->descs, c->size, &c->err);
}

static cring_status_t check_reduce_args(cring_comm_t *c, cring_dtype_t dtype, cring_op_t op) {
    if (!cring_dtype_size(dtype))
        return cring__fail(&c->err, CRING_ERR_INVALID_ARGUMENT, "invalid dtype %d", (int)dtype);
    if ((int)op < 0 || op >= CRING_OP_COUNT)
        return cring__fail(&c->err, CRING_ERR_INVALID_ARGUMENT, "invalid op %d", (int)op);
    if (!cring__reduce_supported(dtype, op))
        return cring__fail(&c->err, CRING_ERR_NOT_SUPPORTED, "op %s is not supported for %s",
                           cring_op_name(op), cring_dtype_name(dtype));
    return CRING_OK;
}

cring_status_t cring__comm_p2p_allreduce(cring_comm_t *c, const void *send, void *recv,
                                         size_t count, cring_dtype_t dtype, cring_op_t op) {
    if (count * cring_dtype_size(dtype) <= c->tree_max_bytes)
        return cring__tree_allreduce(c->p2p, &c->scratch, send, recv, count, dtype, op);
    return cring__ring_allreduce(c->p2p, &c->scratch, send, recv, count, dtype, op);
}

void cring__comm_traffic(const cring_comm_t *c, cring__comm_traffic_t *out) {
    memset(out, 0, sizeof *out);
    if (c->p2p) {
        out->tcp_bytes_sent = atomic_load_explicit(&c->p2p->bytes_sent, memory_order_relaxed);
        out->tcp_bytes_received =
            atomic_load_explicit(&c->p2p->bytes_received, memory_order_relaxed);
    }
    out->shm_bytes_sent = atomic_load_explicit(&c->shm_bytes_sent, memory_order_relaxed);
    out->shm_bytes_received = atomic_load_explicit(&c->shm_bytes_received, memory_order_relaxed);
}

/* ---- collectives without agreement (the engine's entry points) -------------- */

cring_status_t cring__comm_allreduce(cring_comm_t *c, const void *send, void *recv, size_t count,
                                     cring_dtype_t dtype, cring_op_t op) {
    CRING_CHECK(check_usable(c));
    return finish(c, c->ops->allreduce(c, send, recv, count, dtype, op));
}

cring_status_t cring__comm_broadcast(cring_comm_t *c, void *buf, size_t nbytes, int root) {
    CRING_CHECK(check_usable(c));
    return finish(c, c->ops->broadcast(c, buf, nbytes, root));
}

cring_status_t cring__comm_allgatherv(cring_comm_t *c, const void *send, size_t send_bytes,
                                      void *recv, const size_t *recv_bytes) {
    CRING_CHECK(check_usable(c));
    return finish(c, c->ops->allgatherv(c, send, send_bytes, recv, recv_bytes));
}

cring_status_t cring__comm_reducescatter(cring_comm_t *c, const void *send, void *recv,
                                         const size_t *counts, cring_dtype_t dtype, cring_op_t op) {
    CRING_CHECK(check_usable(c));
    return finish(c, c->ops->reducescatter(c, send, recv, counts, dtype, op));
}

cring_status_t cring__comm_barrier(cring_comm_t *c) {
    CRING_CHECK(check_usable(c));
    return finish(c, c->ops->barrier(c));
}

cring_status_t cring__comm_alltoallv(cring_comm_t *c, const void *send, void *recv,
                                     const size_t *matrix) {
    CRING_CHECK(check_usable(c));
    return finish(c, c->ops->alltoallv(c, send, recv, matrix));
}

int cring__comm_can_allreduce_multi(const cring_comm_t *c) {
    return c->ops->allreduce_multi != NULL;
}

cring_status_t cring__comm_allreduce_multi(cring_comm_t *c, struct cring__seg *segs, int nsegs,
                                           cring_dtype_t dtype, cring_op_t op) {
    CRING_CHECK(check_usable(c));
    if (!c->ops->allreduce_multi) return CRING_ERR_NOT_SUPPORTED;
    return finish(c, c->ops->allreduce_multi(c, segs, nsegs, dtype, op));
}

int cring__comm_can_gather_small(const cring_comm_t *c) { return c->ops->gather_small != NULL; }

size_t cring__comm_gather_small_max(const cring_comm_t *c) {
    return c->ops->gather_small_max ? c->ops->gather_small_max(c) : 0;
}

cring_status_t cring__comm_gather_small(cring_comm_t *c, const void *mine, size_t bytes,
                                        const void **ptrs_out, size_t *lens_out) {
    CRING_CHECK(check_usable(c));
    if (!c->ops->gather_small) return CRING_ERR_NOT_SUPPORTED;
    return finish(c, c->ops->gather_small(c, mine, bytes, ptrs_out, lens_out));
}

int cring__comm_idle_wait_sees_peer_input(const cring_comm_t *c) {
    return c->ops->idle_wait_sees_peer_input;
}

double cring__comm_timeout_s(const cring_comm_t *c) { return c->timeout_s; }

cring_status_t cring__comm_broken(const cring_comm_t *c) {
    return (cring_status_t)atomic_load(&((cring_comm_t *)c)->broken);
}

const char *cring__comm_error(const cring_comm_t *c) { return c->err.text; }

void cring__comm_wake(cring_comm_t *c) { c->ops->wake(c); }

void cring__comm_announce(cring_comm_t *c, uint64_t round) { c->ops->announce(c, round); }

void cring__comm_set_driving(cring_comm_t *c, int on) { c->ops->set_driving(c, on); }

int cring__comm_peer_waiting(cring_comm_t *c, uint64_t rounds_done) {
    return c->ops->peer_waiting(c, rounds_done);
}

uint64_t cring__comm_wake_token(cring_comm_t *c) { return c->ops->wake_token(c); }

int cring__comm_idle_wait(cring_comm_t *c, uint64_t token, double max_wait_s) {
    return c->ops->idle_wait(c, token, max_wait_s);
}

int cring__comm_idle_wait_local(cring_comm_t *c, uint64_t token, double max_wait_s) {
    return c->ops->idle_wait_local(c, token, max_wait_s);
}

/* The same short spin the shared-memory transport uses when ranks
 * outnumber cores. */
void cring__comm_background_thread(void) { cring__shm_cap_thread_spin(200); }

/* ---- public collectives: agree, then run ------------------------------------- */

cring_status_t cring_allreduce(cring_comm_t *c, const void *send, void *recv, size_t count,
                               cring_dtype_t dtype, cring_op_t op) {
    CRING_CHECK(check_reduce_args(c, dtype, op));
    if (count && (!send || !recv))
        return cring__fail(&c->err, CRING_ERR_INVALID_ARGUMENT, "NULL buffer");
    cring__desc_t d = {
        .collective = CRING__COLL_ALLREDUCE, .dtype = dtype, .op = op, .count = count};
    CRING_CHECK(begin(c, &d));
    return cring__comm_allreduce(c, send, recv, count, dtype, op);
}

cring_status_t cring_broadcast(cring_comm_t *c, void *buf, size_t nbytes, int root) {
    if (root < 0 || root >= c->size)
        return cring__fail(&c->err, CRING_ERR_INVALID_ARGUMENT,
                           "root rank %d is out of range for size %d", root, c->size);
    if (nbytes && !buf) return cring__fail(&c->err, CRING_ERR_INVALID_ARGUMENT, "NULL buffer");
    cring__desc_t d = {
        .collective = CRING__COLL_BROADCAST, .dtype = -1, .op = -1, .root = root, .count = nbytes};
    CRING_CHECK(begin(c, &d));
    return cring__comm_broadcast(c, buf, nbytes, root);
}

cring_status_t cring_allgatherv(cring_comm_t *c, const void *send, size_t send_bytes, void *recv,
                                const size_t *recv_bytes) {
    if (!recv_bytes) return cring__fail(&c->err, CRING_ERR_INVALID_ARGUMENT, "NULL size table");
    if (recv_bytes[c->rank] != send_bytes)
        return cring__fail(&c->err, CRING_ERR_INVALID_ARGUMENT,
                           "rank %d sends %zu bytes but the size table says %zu", c->rank,
                           send_bytes, recv_bytes[c->rank]);
    size_t total = 0;
    for (int r = 0; r < c->size; r++) total += recv_bytes[r];
    if ((send_bytes && !send) || (total && !recv))
        return cring__fail(&c->err, CRING_ERR_INVALID_ARGUMENT, "NULL buffer");
    cring__desc_t d = {.collective = CRING__COLL_ALLGATHER,
                       .dtype = -1,
                       .op = -1,
                       .count = total,
                       .table_hash =
                           cring__fnv1a(recv_bytes, (size_t)c->size * sizeof *recv_bytes)};
    CRING_CHECK(begin(c, &d));
    return cring__comm_allgatherv(c, send, send_bytes, recv, recv_bytes);
}

cring_status_t cring_reducescatter(cring_comm_t *c, const void *send, void *recv,
                                   const size_t *counts, cring_dtype_t dtype, cring_op_t op) {
    CRING_CHECK(check_reduce_args(c, dtype, op));
    if (!counts) return cring__fail(&c->err, CRING_ERR_INVALID_ARGUMENT, "NULL count table");
    size_t total = 0;
    for (int r = 0; r < c->size; r++) total += counts[r];
    if ((total && !send) || (counts[c->rank] && !recv))
        return cring__fail(&c->err, CRING_ERR_INVALID_ARGUMENT, "NULL buffer");
    cring__desc_t d = {.collective = CRING__COLL_REDUCESCATTER,
                       .dtype = dtype,
                       .op = op,
                       .count = total,
                       .table_hash = cring__fnv1a(counts, (size_t)c->size * sizeof *counts)};
    CRING_CHECK(begin(c, &d));
    return cring__comm_reducescatter(c, send, recv, counts, dtype, op);
}

cring_status_t cring_alltoallv(cring_comm_t *c, const void *send, const size_t *send_bytes,
                               void *recv, const size_t *recv_bytes) {
    if (!send_bytes || !recv_bytes)
        return cring__fail(&c->err, CRING_ERR_INVALID_ARGUMENT, "NULL size table");
    const size_t P = (size_t)c->size;
    size_t stotal = 0, rtotal = 0;
    for (size_t r = 0; r < P; r++) {
        stotal += send_bytes[r];
        rtotal += recv_bytes[r];
    }
    if ((stotal && !send) || (rtotal && !recv))
        return cring__fail(&c->err, CRING_ERR_INVALID_ARGUMENT, "NULL buffer");
    if (stotal && rtotal && (const char *)send < (const char *)recv + rtotal &&
        (const char *)recv < (const char *)send + stotal)
        return cring__fail(&c->err, CRING_ERR_INVALID_ARGUMENT,
                           "alltoallv: send and receive buffers overlap");
    cring__desc_t d = {.collective = CRING__COLL_ALLTOALL, .dtype = -1, .op = -1};
    CRING_CHECK(begin(c, &d));
    /* Everyone's size tables, so every rank checks every pair the same way:
     * all[q*2P + r] bytes q sends to r, all[q*2P + P + r] bytes q expects
     * from r. One allocation: sizes (P), mine (2P), all (2P*P). */
    size_t *sizes = malloc(sizeof *sizes * (P + 2 * P + 2 * P * P));
    if (!sizes) return cring__fail(&c->err, CRING_ERR_NO_MEMORY, "out of memory");
    size_t *mine = sizes + P, *all = mine + 2 * P;
    memcpy(mine, send_bytes, P * sizeof *mine);
    memcpy(mine + P, recv_bytes, P * sizeof *mine);
    for (size_t r = 0; r < P; r++) sizes[r] = 2 * P * sizeof *mine;
    cring_status_t st = cring__comm_allgatherv(c, mine, 2 * P * sizeof *mine, all, sizes);
    for (size_t q = 0; q < P && st == CRING_OK; q++)
        for (size_t r = 0; r < P && st == CRING_OK; r++)
            if (all[q * 2 * P + r] != all[r * 2 * P + P + q])
                st = cring__fail(
                    &c->err, CRING_ERR_MISMATCH,
                    "alltoallv: rank %zu sends %zu bytes to rank %zu, which expects %zu", q,
                    all[q * 2 * P + r], r, all[r * 2 * P + P + q]);
    /* the matrix is the send halves, packed in place */
    for (size_t q = 0; q < P && st == CRING_OK; q++)
        memmove(all + q * P, all + q * 2 * P, P * sizeof *all);
    if (st == CRING_OK) st = cring__comm_alltoallv(c, send, recv, all);
    free(sizes);
    return st;
}

cring_status_t cring_barrier(cring_comm_t *c) {
    cring__desc_t d = {.collective = CRING__COLL_BARRIER, .dtype = -1, .op = -1};
    /* The agreement step is itself a full barrier. */
    return begin(c, &d);
}

/* nccl.c: NCCL communicators (objects their creator owns, made from a unique
 * id it distributes) and the collectives on them, each call's tensors
 * enqueued inside one ncclGroupStart/ncclGroupEnd on their streams. It never
 * waits for the device (ordering comes from the streams), and no thread
 * waits on a lock held across a call that waits for peers. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../reduce/reduce.h"
#include "gpu_internal.h"

static void count_stats(cring__gpu_t *g, uint64_t comms, uint64_t groups, uint64_t calls) {
    pthread_mutex_lock(&g->mu);
    g->stats.communicators += comms;
    g->stats.groups += groups;
    g->stats.nccl_calls += calls;
    pthread_mutex_unlock(&g->mu);
}

static cring_status_t nccl_status(ncclResult_t r) {
    switch (r) {
    case ncclRemoteError: return CRING_ERR_PEER_FAILURE;
    case ncclInvalidArgument:
    case ncclInvalidUsage: return CRING_ERR_INVALID_ARGUMENT;
    default: return CRING_ERR_SYSTEM;
    }
}

/* Describe NCCL's failure r of `what` into err (with NCCL's last message and
 * an optional hint appended). err may be NULL. */
static cring_status_t nccl_fail(cring__gpu_t *g, ncclComm_t comm, ncclResult_t r, const char *what,
                                const char *hint, cring__errmsg_t *err) {
    const char *last = g->nccl.GetLastError ? g->nccl.GetLastError(comm) : NULL;
    const char *text = g->nccl.GetErrorString(r);
    int has_last = last && *last;
    return cring__fail(err, nccl_status(r), "%s failed: %s%s%s%s%s", what,
                       text ? text : "unknown NCCL error", has_last ? " (" : "",
                       has_last ? last : "", has_last ? ")" : "", hint ? hint : "");
}

static int nccl_dtype(cring_dtype_t d, ncclDataType_t *out) {
    switch (d) {
    case CRING_FLOAT16: *out = ncclFloat16; return 1;
    case CRING_BFLOAT16: *out = ncclBfloat16; return 1;
    case CRING_FLOAT32: *out = ncclFloat32; return 1;
    case CRING_FLOAT64: *out = ncclFloat64; return 1;
    case CRING_INT8: *out = ncclInt8; return 1;
    case CRING_UINT8:
    case CRING_BOOL: *out = ncclUint8; return 1;
    case CRING_INT32: *out = ncclInt32; return 1;
    case CRING_INT64: *out = ncclInt64; return 1;
    case CRING_UINT32: *out = ncclUint32; return 1;
    case CRING_UINT64: *out = ncclUint64; return 1;
    default: return 0; /* NCCL has no 16-bit integers */
    }
}

static int nccl_op(cring_op_t op, ncclRedOp_t *out) {
    switch (op) {
    case CRING_SUM: *out = ncclSum; return 1;
    case CRING_AVERAGE: *out = ncclAvg; return 1;
    case CRING_MIN: *out = ncclMin; return 1;
    case CRING_MAX: *out = ncclMax; return 1;
    case CRING_PRODUCT: *out = ncclProd; return 1;
    default: return 0;
    }
}

static int is_floating(cring_dtype_t d) {
    return d == CRING_FLOAT16 || d == CRING_BFLOAT16 || d == CRING_FLOAT32 || d == CRING_FLOAT64;
}

/* Collectives that only move data: they go through NCCL as bytes (ncclUint8),
 * whatever the dtype. */
static int moves_bytes(cring_collective_t c) {
    return c == CRING_COLL_BROADCAST || c == CRING_COLL_ALLGATHER || c == CRING_COLL_ALLTOALL;
}

int cring__gpu_can_reduce(cring_dtype_t dtype, cring_op_t op, double prescale, double postscale) {
    ncclDataType_t dt;
    ncclRedOp_t nop;
    if (dtype == CRING_BOOL || !nccl_dtype(dtype, &dt) || !nccl_op(op, &nop)) return 0;
    if (prescale == 1.0 && postscale == 1.0) return 1;
    return is_floating(dtype) && (op == CRING_SUM || op == CRING_AVERAGE);
}

static cring_status_t require_libraries(cring__gpu_t *g, cring__errmsg_t *err) {
    if (!cring__gpu_has_nccl(g) || !cring__gpu_has_cudart(g))
        return cring__fail(err, CRING_ERR_NOT_SUPPORTED,
                           "NCCL and the CUDA runtime must be loaded first");
    return CRING_OK;
}

cring_status_t cring__gpu_unique_id(cring__gpu_t *g, void *id_out, cring__errmsg_t *err) {
    CRING_CHECK(require_libraries(g, err));
    ncclUniqueId id;
    memset(&id, 0, sizeof id);
    ncclResult_t r = g->nccl.GetUniqueId(&id);
    if (r != ncclSuccess) return nccl_fail(g, NULL, r, "ncclGetUniqueId", NULL, err);
    memcpy(id_out, &id, sizeof id);
    return CRING_OK;
}

cring_status_t cring__gpu_enter_device(cring__gpu_t *g, int device, int always, int *previous,
                                       cring__errmsg_t *err) {
    if (g->cudart.GetDevice(previous) != CRING_CUDA_SUCCESS) *previous = -1;
    if (*previous == device && !always) return CRING_OK;
    cudaError_t e = g->cudart.SetDevice(device);
    if (e != CRING_CUDA_SUCCESS)
        return cring__fail(err, CRING_ERR_SYSTEM, "cudaSetDevice(%d): %s", device,
                           cring__gpu_cuda_error(g, e));
    return CRING_OK;
}

void cring__gpu_leave_device(cring__gpu_t *g, int device, int previous) {
    if (previous >= 0 && previous != device) g->cudart.SetDevice(previous);
}

cring_status_t cring__gpu_comm_create(cring__gpu_t *g, int device, int rank, int size,
                                      const void *unique_id, cring__gpu_comm_t **out,
                                      cring__errmsg_t *err) {
    *out = NULL;
    CRING_CHECK(require_libraries(g, err));
    if (size < 1 || rank < 0 || rank >= size || device < 0)
        return cring__fail(err, CRING_ERR_INVALID_ARGUMENT, "bad rank %d / size %d / device %d",
                           rank, size, device);
    cring__gpu_comm_t *c = calloc(1, sizeof *c);
    if (!c) return cring__fail(err, CRING_ERR_NO_MEMORY, "out of memory");
    ncclUniqueId id;
    memcpy(&id, unique_id, sizeof id);
    int previous = -1;
    cring_status_t st = cring__gpu_enter_device(g, device, 1, &previous, err);
    if (st != CRING_OK) {
        free(c);
        return st;
    }
    /* no lock: nobody else can see c yet, and this waits for every peer */
    ncclResult_t r = g->nccl.CommInitRank(&c->comm, size, id, rank);
    cring__gpu_leave_device(g, device, previous);
    if (r != ncclSuccess) {
        st = nccl_fail(g, c->comm, r, "ncclCommInitRank",
                       r == ncclInvalidUsage
                           ? "; several ranks on one GPU need CRING_GPU_OPERATIONS=host"
                           : NULL,
                       err);
        free(c);
        return st;
    }
    c->device = device;
    c->rank = rank;
    c->size = size;
    atomic_store(&c->refs, 1);
    atomic_store(&c->status, CRING_OK);
    pthread_mutex_init(&c->mu, NULL);
    atomic_fetch_add(&g->live_comms, 1);
    count_stats(g, 1, 0, 0);
    *out = c;
    return CRING_OK;
}

int cring__gpu_comm_device(const cring__gpu_comm_t *c) { return c->device; }
int cring__gpu_comm_size(const cring__gpu_comm_t *c) { return c->size; }
int cring__gpu_comm_live(cring__gpu_t *g) { return atomic_load(&g->live_comms); }

void cring__gpu_comm_ref(cring__gpu_comm_t *c) { atomic_fetch_add(&c->refs, 1); }

void cring__gpu_comm_unref(cring__gpu_comm_t *c) {
    if (!c || atomic_fetch_sub(&c->refs, 1) != 1) return;
    pthread_mutex_destroy(&c->mu);
    free(c);
}

/* With c->mu held: record the first error (then publish it). */
static void break_locked(cring__gpu_comm_t *c, cring_status_t st, const cring__errmsg_t *why) {
    if (atomic_load(&c->status) != CRING_OK) return;
    c->error = *why;
    atomic_store_explicit(&c->status, (int)st, memory_order_release);
}

/* The error c is broken with, or CRING_OK. */
static cring_status_t broken_status(cring__gpu_comm_t *c, cring__errmsg_t *err) {
    cring_status_t st = (cring_status_t)atomic_load_explicit(&c->status, memory_order_acquire);
    if (st != CRING_OK && err) *err = c->error;
    return st;
}

/* With c->mu held: the error c is broken with, or the communicator's
 * asynchronous error (which then breaks it). */
static cring_status_t check_locked(cring__gpu_t *g, cring__gpu_comm_t *c, cring__errmsg_t *err) {
    if (broken_status(c, err) != CRING_OK) return broken_status(c, err);
    if (c->destroyed) return CRING_OK;
    ncclResult_t async_error = ncclSuccess;
    ncclResult_t r = g->nccl.CommGetAsyncError(c->comm, &async_error);
    if (r == ncclSuccess && (async_error == ncclSuccess || async_error == ncclInProgress))
        return CRING_OK;
    cring__errmsg_t why = {{0}};
    cring_status_t st = nccl_fail(g, c->comm, r != ncclSuccess ? r : async_error,
                                  "NCCL communicator (asynchronous error)", NULL, &why);
    break_locked(c, st, &why);
    return broken_status(c, err);
}

cring_status_t cring__gpu_comm_check(cring__gpu_t *g, cring__gpu_comm_t *c, cring__errmsg_t *err) {
    cring_status_t st = broken_status(c, err);
    if (st != CRING_OK) return st;
    /* its owner is inside NCCL on it (which can wait for peers): that call
     * reports an error itself, and this thread does not wait */
    if (pthread_mutex_trylock(&c->mu) != 0) return CRING_OK;
    st = check_locked(g, c, err);
    pthread_mutex_unlock(&c->mu);
    return st;
}

void cring__gpu_comm_fail(cring__gpu_t *g, cring__gpu_comm_t *c, cring_status_t st,
                          const char *msg) {
    if (!c) return;
    cring__errmsg_t why = {{0}};
    cring__fail(&why, st == CRING_OK ? CRING_ERR_BROKEN : st, "%s", msg ? msg : "");
    pthread_mutex_lock(&c->mu);
    break_locked(c, st == CRING_OK ? CRING_ERR_BROKEN : st, &why);
    if (!c->destroyed) {
        g->nccl.CommAbort(c->comm); /* its queued kernels end instead of waiting */
        c->destroyed = 1;
        atomic_fetch_sub(&g->live_comms, 1);
    }
    pthread_mutex_unlock(&c->mu);
}

void cring__gpu_comm_destroy(cring__gpu_t *g, cring__gpu_comm_t *c) {
    if (!c) return;
    pthread_mutex_lock(&c->mu);
    if (!c->destroyed) {
        ncclResult_t async_error = ncclSuccess;
        int broken = atomic_load(&c->status) != CRING_OK ||
                     g->nccl.CommGetAsyncError(c->comm, &async_error) != ncclSuccess ||
                     (async_error != ncclSuccess && async_error != ncclInProgress);
        if (broken) g->nccl.CommAbort(c->comm);
        else g->nccl.CommDestroy(c->comm);
        c->destroyed = 1;
        atomic_fetch_sub(&g->live_comms, 1);
    }
    pthread_mutex_unlock(&c->mu); /* work enqueued before this was not failed by it */
    cring__gpu_comm_unref(c);
}

/* Check one tensor's request before anything is enqueued. */
static cring_status_t check_tensor(const cring__gpu_coll_t *c, const cring__gpu_tensor_t *t,
                                   cring__errmsg_t *err) {
    ncclDataType_t dt;
    ncclRedOp_t op;
    if (moves_bytes(c->collective)) {
        if ((int)t->dtype < 0 || t->dtype >= CRING_DTYPE_COUNT)
            return cring__fail(err, CRING_ERR_INVALID_ARGUMENT, "bad dtype %d", (int)t->dtype);
    } else if (!nccl_dtype(t->dtype, &dt)) {
        return cring__fail(err, CRING_ERR_NOT_SUPPORTED, "NCCL cannot reduce dtype %s",
                           cring_dtype_name(t->dtype));
    } else {
        if (t->dtype == CRING_BOOL || !nccl_op(c->op, &op))
            return cring__fail(err, CRING_ERR_NOT_SUPPORTED, "op %s cannot reduce %s with NCCL",
                               cring_op_name(c->op), cring_dtype_name(t->dtype));
        if (c->scale != 1.0 &&
            (!is_floating(t->dtype) || (c->op != CRING_SUM && c->op != CRING_AVERAGE)))
            return cring__fail(err, CRING_ERR_NOT_SUPPORTED,
                               "scaling factors on the GPU apply to Sum and Average of floating "
                               "dtypes, not %s of %s",
                               cring_op_name(c->op), cring_dtype_name(t->dtype));
    }
    if ((c->collective == CRING_COLL_ALLGATHER || c->collective == CRING_COLL_REDUCESCATTER ||
         c->collective == CRING_COLL_ALLTOALL) &&
        !t->rank_counts)
        return cring__fail(err, CRING_ERR_INVALID_ARGUMENT, "per-rank counts are missing");
    if (c->collective == CRING_COLL_ALLTOALL && !t->recv_counts)
        return cring__fail(err, CRING_ERR_INVALID_ARGUMENT, "per-rank receive counts are missing");
    if (c->collective == CRING_COLL_REDUCESCATTER && t->count && t->send == t->recv)
        return cring__fail(err, CRING_ERR_INVALID_ARGUMENT, "reducescatter cannot run in place");
    return CRING_OK;
}

cring_status_t cring__gpu_check(const cring__gpu_coll_t *c, cring__errmsg_t *err) {
    for (int i = 0; i < c->ntensors; i++) CRING_CHECK(check_tensor(c, &c->tensors[i], err));
    return CRING_OK;
}

static int all_equal(const size_t *v, int n) {
    for (int i = 1; i < n; i++)
        if (v[i] != v[0]) return 0;
    return 1;
}

/* The pre-multiplied sum for dtype d with factor `scale` (Average folds the
 * division by the world size into it). */
static ncclResult_t make_premul(cring__gpu_t *g, cring__gpu_comm_t *cm, cring_dtype_t d,
                                double scalar, ncclRedOp_t *out) {
    union {
        double f64;
        float f32;
        uint16_t f16;
    } value;
    ncclDataType_t dt = ncclFloat32;
    nccl_dtype(d, &dt);
    if (d == CRING_FLOAT64) value.f64 = scalar;
    else if (d == CRING_FLOAT32) value.f32 = (float)scalar;
    else cring__convert(d, &value.f16, CRING_FLOAT64, &scalar, 1, 1.0);
    return g->nccl.RedOpCreatePreMulSum(out, &value, dt, ncclScalarHostImmediate, cm->comm);
}

/* Enqueue one tensor's work (inside the group). */
static ncclResult_t enqueue(cring__gpu_t *g, cring__gpu_comm_t *cm, const cring__gpu_coll_t *c,
                            const cring__gpu_tensor_t *t, ncclRedOp_t op, uint64_t *calls) {
    ncclDataType_t dt = ncclFloat32;
    size_t esize = cring_dtype_size(t->dtype), scale_count = 1;
    if (moves_bytes(c->collective)) { /* any dtype, as bytes: counts scale by the size */
        dt = ncclUint8;
        scale_count = esize;
        esize = 1;
    } else {
        nccl_dtype(t->dtype, &dt); /* checked by check_tensor */
    }
    cudaStream_t s = t->stream;
    ncclResult_t r = ncclSuccess;
    switch (c->collective) {
    case CRING_COLL_ALLREDUCE:
        if (!t->count) return ncclSuccess;
        ++*calls;
        return g->nccl.AllReduce(t->send, t->recv, t->count, dt, op, cm->comm, s);
    case CRING_COLL_BROADCAST:
        if (!t->count) return ncclSuccess;
        ++*calls;
        return g->nccl.Broadcast(t->send, t->recv, t->count * scale_count, dt, c->root, cm->comm,
                                 s);
    case CRING_COLL_ALLGATHER:
        if (all_equal(t->rank_counts, cm->size)) {
            if (!t->rank_counts[0]) return ncclSuccess;
            ++*calls;
            return g->nccl.AllGather(t->send, t->recv, t->rank_counts[0] * scale_count, dt,
                                     cm->comm, s);
        }
        /* Unequal parts: rank r broadcasts its part into its place of recv. */
        {
            size_t off = 0;
            for (int root = 0; root < cm->size && r == ncclSuccess; root++) {
                size_t n = t->rank_counts[root] * scale_count;
                char *dst = (char *)t->recv + off * esize;
                if (n) {
                    ++*calls;
                    r = g->nccl.Broadcast(root == cm->rank ? t->send : dst, dst, n, dt, root,
                                          cm->comm, s);
                }
                off += n;
            }
        }
        return r;
    case CRING_COLL_REDUCESCATTER:
        if (all_equal(t->rank_counts, cm->size)) {
            if (!t->rank_counts[0]) return ncclSuccess;
            ++*calls;
            return g->nccl.ReduceScatter(t->send, t->recv, t->rank_counts[0], dt, op, cm->comm, s);
        }
        /* Unequal parts: one reduce to each rank of its rows. */
        {
            size_t off = 0;
            for (int root = 0; root < cm->size && r == ncclSuccess; root++) {
                size_t n = t->rank_counts[root];
                if (n) {
                    ++*calls;
                    r = g->nccl.Reduce((const char *)t->send + off * esize,
                                       root == cm->rank ? t->recv : NULL, n, dt, op, root, cm->comm,
                                       s);
                }
                off += n;
            }
        }
        return r;
    case CRING_COLL_ALLTOALL:
        /* One send and one receive per peer, zero counts included (NCCL
         * takes them as no-ops), in rank order; the group pairs them. */
        {
            size_t soff = 0, roff = 0;
            for (int q = 0; q < cm->size && r == ncclSuccess; q++) {
                size_t ns = t->rank_counts[q] * scale_count, nr = t->recv_counts[q] * scale_count;
                ++*calls;
                r = g->nccl.Send((const char *)t->send + soff, ns, dt, q, cm->comm, s);
                if (r == ncclSuccess) {
                    ++*calls;
                    r = g->nccl.Recv((char *)t->recv + roff, nr, dt, q, cm->comm, s);
                }
                soff += ns;
                roff += nr;
            }
        }
        return r;
    default: return ncclInvalidArgument;
    }
}

cring_status_t cring__gpu_collective(cring__gpu_t *g, cring__gpu_comm_t *cm,
                                     const cring__gpu_coll_t *c, cring__errmsg_t *err) {
    CRING_CHECK(require_libraries(g, err));
    CRING_CHECK(cring__gpu_check(c, err));
    pthread_mutex_lock(&cm->mu);
    /* after an earlier failure: ERR_BROKEN, with what broke it */
    cring_status_t st =
        broken_status(cm, err) != CRING_OK ? CRING_ERR_BROKEN : check_locked(g, cm, err);
    if (st == CRING_OK && cm->destroyed)
        st = cring__fail(err, CRING_ERR_CLOSED, "the NCCL communicator was destroyed");
    if (st != CRING_OK) {
        pthread_mutex_unlock(&cm->mu);
        return st;
    }
    if (c->collective == CRING_COLL_BROADCAST && (c->root < 0 || c->root >= cm->size)) {
        pthread_mutex_unlock(&cm->mu);
        return cring__fail(err, CRING_ERR_INVALID_ARGUMENT, "root %d is out of range", c->root);
    }
    /* Reduction operators: the built-in one, or one pre-multiplied sum per dtype. */
    ncclRedOp_t builtin = ncclSum;
    nccl_op(c->op, &builtin);
    int reduces =
        c->collective == CRING_COLL_ALLREDUCE || c->collective == CRING_COLL_REDUCESCATTER;
    /* One rank: an average is the sum (exact), and never ncclAvg, whose
     * one-rank kernel drops a tail in NCCL 2.27.0-2.29.6 (cuda_api.h). A
     * scaled one-rank reduction on such a version is refused here: the
     * engine stages it through host memory instead (exec_cuda_host.c). */
    if (reduces && cm->size == 1 && c->op == CRING_AVERAGE) builtin = ncclSum;
    if (reduces && cm->size == 1 && c->scale != 1.0 &&
        cring__gpu_nccl_one_rank_defect(g->nccl_lib.version)) {
        pthread_mutex_unlock(&cm->mu);
        return cring__fail(err, CRING_ERR_NOT_SUPPORTED,
                           "NCCL %d's one-rank pre-multiplied sum leaves a tail unwritten (fixed "
                           "in 2.29.7): a scaled reduction on one rank cannot go through it",
                           g->nccl_lib.version);
    }
    ncclRedOp_t premul[CRING_DTYPE_COUNT];
    int have_premul[CRING_DTYPE_COUNT] = {0};
    ncclResult_t r = ncclSuccess;
    int previous = -1;
    st = cring__gpu_enter_device(g, cm->device, 0, &previous, err);
    if (st != CRING_OK) {
        pthread_mutex_unlock(&cm->mu);
        return st;
    }
    if (reduces && c->scale != 1.0) {
        double scalar = c->op == CRING_AVERAGE ? c->scale / cm->size : c->scale;
        for (int i = 0; i < c->ntensors && r == ncclSuccess; i++) {
            cring_dtype_t d = c->tensors[i].dtype;
            if (have_premul[d]) continue;
            r = make_premul(g, cm, d, scalar, &premul[d]);
            if (r == ncclSuccess) have_premul[d] = 1;
        }
        if (r != ncclSuccess) st = nccl_fail(g, cm->comm, r, "ncclRedOpCreatePreMulSum", NULL, err);
    }
    uint64_t calls = 0;
    if (st == CRING_OK) {
        r = g->nccl.GroupStart();
        if (r != ncclSuccess) {
            st = nccl_fail(g, cm->comm, r, "ncclGroupStart", NULL, err);
        } else {
            ncclResult_t first_error = ncclSuccess;
            for (int i = 0; i < c->ntensors && first_error == ncclSuccess; i++) {
                const cring__gpu_tensor_t *t = &c->tensors[i];
                ncclRedOp_t op = reduces && c->scale != 1.0 ? premul[t->dtype] : builtin;
                first_error = enqueue(g, cm, c, t, op, &calls);
            }
            r = g->nccl.GroupEnd(); /* always close the group */
            if (first_error != ncclSuccess)
                st = nccl_fail(g, cm->comm, first_error, "enqueueing a NCCL collective", NULL, err);
            else if (r != ncclSuccess) st = nccl_fail(g, cm->comm, r, "ncclGroupEnd", NULL, err);
        }
    }
    for (int d = 0; d < CRING_DTYPE_COUNT; d++)
        if (have_premul[d]) g->nccl.RedOpDestroy(premul[d], cm->comm);
    cring__gpu_leave_device(g, cm->device, previous);
    if (st != CRING_OK && st != CRING_ERR_INVALID_ARGUMENT) {
        cring__errmsg_t why = {{0}}; /* NCCL's state is unknown after a failed enqueue */
        if (err) why = *err;
        else cring__fail(&why, st, "an earlier NCCL call failed");
        break_locked(cm, st, &why);
    }
    pthread_mutex_unlock(&cm->mu);
    count_stats(g, 0, st == CRING_OK ? 1 : 0, calls);
    return st;
}

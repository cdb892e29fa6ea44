/* fake_nccl.c: a test double for libnccl.so.2, built as a shared library and
 * loaded through CRING_NCCL_LIBRARY by the CPU tests. "Device memory" is host
 * memory. The unique id names a POSIX shared-memory segment; the ranks of a
 * communicator are processes that map it, write their part to their own slot,
 * meet at a barrier and read the others' parts.
 *
 * As on a GPU, a collective runs when its stream reaches it: each call (a
 * group's calls together, at ncclGroupEnd, in call order, so a grouped call is
 * observable as one group in the log) is checked and logged when it is made,
 * then enqueued on the fake CUDA runtime's stream (fake_cudart.c's
 * fake_cuda_enqueue_group; a group on several streams joins them, as NCCL
 * does) and run by that stream's device thread, which waits there for its
 * peers. What fails there is an asynchronous error (ncclCommGetAsyncError),
 * as a peer missing for CRING_FAKE_NCCL_TIMEOUT_S is. ncclCommDestroy waits
 * for the communicator's queued work; ncclCommAbort makes it give up at once
 * (a device thread waiting for peers returns) and then frees it. Without the
 * fake runtime in the process, calls run at once on the calling thread.
 *
 * ncclSend/ncclRecv inside a group run together as one point-to-point phase:
 * each rank writes its sends (destination, bytes, payload) into its slot,
 * meets the others, and each receive takes the next send addressed to it from
 * its peer, which must have the same byte count (as NCCL requires). Every rank
 * of the communicator must take part in such a phase (cring's alltoall calls
 * every peer, zero counts included); a send or receive outside a group is a
 * phase of its own. Never used outside tests.
 *   CRING_FAKE_NCCL_LOG          append one line per call (rank, op, count, stream)
 *   CRING_FAKE_NCCL_VERSION      version code reported (default 22703)
 *   CRING_FAKE_NCCL_ONE_RANK_DEFECT  1: reproduce NCCL 2.27.0-2.29.6's
 *                                one-rank reduce defect (NVIDIA/nccl issue
 *                                1950): at nranks == 1, an allreduce, reduce or
 *                                reducescatter with ncclAvg or a pre-multiplied
 *                                sum leaves the last count % BLOCKS elements of
 *                                its result unwritten (whatever version is
 *                                reported, so tests can also show the defect
 *                                against a version cring trusts)
 *   CRING_FAKE_NCCL_DEFECT_BLOCKS  BLOCKS above (default 16: 17**3 elements
 *                                lose 1, 2**20 + 3 lose 3, as on the H100)
 *   CRING_FAKE_NCCL_SLOT_BYTES   largest part one rank may send (default 4 MiB)
 *   CRING_FAKE_NCCL_FAIL_AFTER   after this many collectives have run on a
 *                                communicator, report an asynchronous remote error
 *   CRING_FAKE_NCCL_TIMEOUT_S    barrier time-out (default 30): a missing peer
 *                                fails the call instead of hanging
 *   CRING_FAKE_NCCL_INIT_GATE    a path: every ncclCommInitRank of a process
 *                                but its first logs "initstart", then waits
 *                                until that file exists (at most the time-out
 *                                above, then fails), so a test can hold an
 *                                engine inside communicator set-up
 * fake_nccl_calls() (exported, for C tests): collectives this process called.
 * The element arithmetic (types, half and bfloat16, reductions) is in
 * fake_nccl_reduce.c, built into the same library.
 * Build with -DFAKE_NCCL_WITHOUT_ALLGATHER for a library lacking ncclAllGather. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <dlfcn.h>
#include <fcntl.h>
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "fake_log.h"
#include "fake_nccl.h"

#define EXPORT __attribute__((visibility("default")))

typedef struct {
    char internal[128];
} ncclUniqueId;

enum {
    OK = 0,
    SYSTEM_ERROR = 2,
    INTERNAL_ERROR = 3,
    INVALID_ARGUMENT = 4,
    INVALID_USAGE = 5,
    REMOTE_ERROR = 6
};
#define MAX_PREMUL 32
#define MAGIC "cring-fake-nccl"

typedef struct {
    _Atomic uint32_t joined;
    _Atomic uint32_t arrived;
    _Atomic uint32_t generation;
    uint32_t nranks;
    char pad[48];
} header_t;

struct ncclComm {
    int rank, nranks;
    header_t *hdr;
    unsigned char *slots;
    size_t slot_bytes, map_bytes;
    _Atomic int async_error; /* set by whichever thread sees it fail */
    _Atomic int aborted;     /* ncclCommAbort: queued and waiting work gives up */
    _Atomic int pending;     /* calls enqueued and not yet run */
    char async_message[256]; /* what failed, for ncclGetLastError */
    long collectives;        /* run so far (by the device thread) */
    double premul[MAX_PREMUL];
    int premul_used[MAX_PREMUL];
    char name[128];
};
typedef struct ncclComm *ncclComm_t;

static __thread char last_error[256];

static void log_line(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void log_line(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fake_vlog("CRING_FAKE_NCCL_LOG", fmt, ap);
    va_end(ap);
}

static int fail(int code, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int fail(int code, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(last_error, sizeof last_error, fmt, ap);
    va_end(ap);
    return code;
}

/* An error of work that ran after its call returned: the communicator's
 * asynchronous error (the first one stays), with its message. */
static int fail_async(struct ncclComm *c, int code, const char *what) {
    int none = OK;
    if (atomic_compare_exchange_strong(&c->async_error, &none, code))
        snprintf(c->async_message, sizeof c->async_message, "%s", what);
    return code;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static double env_double(const char *name, double dflt) {
    const char *s = getenv(name);
    return s && *s ? atof(s) : dflt;
}

/* ---- the shared segment ---- */
/* Every rank meets here. A peer missing for CRING_FAKE_NCCL_TIMEOUT_S, or an
 * abort, fails the call (and the communicator). */
static int barrier(ncclComm_t c) {
    header_t *h = c->hdr;
    uint32_t gen = atomic_load(&h->generation);
    if (atomic_fetch_add(&h->arrived, 1) == (uint32_t)c->nranks - 1) {
        atomic_store(&h->arrived, 0);
        atomic_fetch_add(&h->generation, 1);
        return OK;
    }
    double deadline = now_s() + env_double("CRING_FAKE_NCCL_TIMEOUT_S", 30);
    for (unsigned spins = 0; atomic_load(&h->generation) == gen; spins++) {
        if (spins > 1000) sched_yield();
        if (spins > 20000) {
            struct timespec pause = {0, 50000}; /* the machine is shared: do not spin long */
            nanosleep(&pause, NULL);
        }
        if ((spins & 255) == 0 && atomic_load(&c->aborted))
            return fail_async(c, SYSTEM_ERROR, "fake NCCL: the communicator was aborted");
        if ((spins & 255) == 0 && now_s() > deadline) {
            char what[128];
            snprintf(what, sizeof what, "fake NCCL: rank %d waited too long for its peers",
                     c->rank);
            fail(SYSTEM_ERROR, "%s", what);
            return fail_async(c, SYSTEM_ERROR, what);
        }
    }
    return OK;
}

EXPORT int ncclGetVersion(int *version) {
    *version = (int)env_double("CRING_FAKE_NCCL_VERSION", 22703);
    return OK;
}

EXPORT int ncclGetUniqueId(ncclUniqueId *id) {
    memset(id, 0, sizeof *id);
    unsigned long long nonce = 0;
    int fd = open("/dev/urandom", O_RDONLY);
    if (fd < 0 || read(fd, &nonce, sizeof nonce) != (ssize_t)sizeof nonce)
        nonce = (unsigned long long)now_s() * 1000003ull ^ (unsigned long long)getpid();
    if (fd >= 0) close(fd);
    snprintf(id->internal, sizeof id->internal, "%s/cring_fake_nccl_%d_%llx", MAGIC, (int)getpid(),
             nonce);
    return OK;
}

EXPORT const char *ncclGetErrorString(int result) {
    switch (result) {
    case OK: return "no error";
    case SYSTEM_ERROR: return "unhandled system error";
    case INTERNAL_ERROR: return "internal error";
    case INVALID_ARGUMENT: return "invalid argument";
    case INVALID_USAGE: return "invalid usage";
    case REMOTE_ERROR: return "remote process exited or there was a network error";
    default: return "unknown result code";
    }
}

EXPORT const char *ncclGetLastError(ncclComm_t comm) {
    if (comm && atomic_load(&comm->async_error) != OK && comm->async_message[0])
        return comm->async_message;
    return last_error;
}

EXPORT int ncclCommInitRank(ncclComm_t *out, int nranks, ncclUniqueId id, int rank) {
    *out = NULL;
    if (strncmp(id.internal, MAGIC "/", strlen(MAGIC) + 1) != 0)
        return fail(INVALID_ARGUMENT, "fake NCCL: the unique id was not made by ncclGetUniqueId");
    if (nranks < 1 || rank < 0 || rank >= nranks)
        return fail(INVALID_ARGUMENT, "fake NCCL: rank %d of %d", rank, nranks);
    static _Atomic int inits; /* of this process: the first is never gated */
    const char *gate = getenv("CRING_FAKE_NCCL_INIT_GATE");
    if (atomic_fetch_add(&inits, 1) > 0 && gate && *gate) {
        log_line("initstart rank=%d nranks=%d", rank, nranks);
        double deadline = now_s() + env_double("CRING_FAKE_NCCL_TIMEOUT_S", 30);
        while (access(gate, F_OK) != 0) {
            if (now_s() > deadline) {
                log_line("initfail rank=%d (the gate never opened)", rank);
                return fail(SYSTEM_ERROR, "fake NCCL: the init gate %s never opened", gate);
            }
            struct timespec pause = {0, 2000000};
            nanosleep(&pause, NULL);
        }
    }
    ncclComm_t c = calloc(1, sizeof *c);
    if (!c) return fail(SYSTEM_ERROR, "fake NCCL: out of memory");
    c->rank = rank;
    c->nranks = nranks;
    c->slot_bytes = (size_t)env_double("CRING_FAKE_NCCL_SLOT_BYTES", 4 << 20);
    c->map_bytes = sizeof(header_t) + (size_t)nranks * c->slot_bytes;
    snprintf(c->name, sizeof c->name, "%s", id.internal + strlen(MAGIC));
    int fd = shm_open(c->name, O_CREAT | O_RDWR, 0600);
    if (fd < 0 || ftruncate(fd, (off_t)c->map_bytes) != 0) {
        if (fd >= 0) close(fd);
        free(c);
        return fail(SYSTEM_ERROR, "fake NCCL: cannot create the shared segment");
    }
    void *p = mmap(NULL, c->map_bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    close(fd);
    if (p == MAP_FAILED) {
        free(c);
        return fail(SYSTEM_ERROR, "fake NCCL: cannot map the shared segment");
    }
    c->hdr = p;
    c->slots = (unsigned char *)p + sizeof(header_t);
    atomic_fetch_add(&c->hdr->joined, 1);
    double deadline = now_s() + env_double("CRING_FAKE_NCCL_TIMEOUT_S", 30);
    while (atomic_load(&c->hdr->joined) < (uint32_t)nranks) {
        if (now_s() > deadline) {
            munmap(p, c->map_bytes);
            shm_unlink(c->name);
            free(c);
            return fail(SYSTEM_ERROR, "fake NCCL: not every rank joined");
        }
        sched_yield();
    }
    if (barrier(c) != OK) {
        munmap(p, c->map_bytes);
        free(c);
        return SYSTEM_ERROR;
    }
    if (rank == 0) shm_unlink(c->name); /* everyone has it mapped */
    log_line("init rank=%d nranks=%d id=%s", rank, nranks, c->name);
    *out = c;
    return OK;
}

static void comm_free(ncclComm_t c) {
    if (!c) return;
    munmap(c->hdr, c->map_bytes);
    free(c);
}

/* Wait until the communicator's enqueued work has run (it gives up at once
 * after an abort, and after a time-out when a peer is missing). */
static void wait_idle(ncclComm_t c) {
    struct timespec pause = {0, 1000000};
    while (atomic_load(&c->pending) > 0) nanosleep(&pause, NULL);
}

/* Like NCCL's: waits for the communicator's work to complete first. */
EXPORT int ncclCommDestroy(ncclComm_t c) {
    if (!c) return OK;
    log_line("destroy rank=%d", c->rank);
    wait_idle(c);
    comm_free(c);
    return OK;
}

/* Work still queued or waiting for peers gives up; then the communicator goes. */
EXPORT int ncclCommAbort(ncclComm_t c) {
    if (!c) return OK;
    log_line("abort rank=%d", c->rank);
    atomic_store(&c->aborted, 1);
    wait_idle(c);
    comm_free(c);
    return OK;
}

EXPORT int ncclCommGetAsyncError(ncclComm_t c, int *async_error) {
    *async_error = c ? atomic_load(&c->async_error) : OK;
    return c ? OK : INVALID_ARGUMENT;
}

EXPORT int ncclRedOpCreatePreMulSum(int *op, void *scalar, int dt, int residence, ncclComm_t c) {
    for (int i = 0; i < MAX_PREMUL; i++) {
        if (c->premul_used[i]) continue;
        c->premul_used[i] = 1;
        c->premul[i] =
            fake__is_float(dt) ? fake__load_f(scalar, dt, 0) : (double)fake__load_i(scalar, dt, 0);
        *op = FIRST_PREMUL + i;
        log_line("premul rank=%d op=%d scalar=%g residence=%d", c->rank, *op, c->premul[i],
                 residence);
        return OK;
    }
    return fail(INTERNAL_ERROR, "fake NCCL: too many pre-multiplied sums");
}

EXPORT int ncclRedOpDestroy(int op, ncclComm_t c) {
    if (op < FIRST_PREMUL || op >= FIRST_PREMUL + MAX_PREMUL || !c->premul_used[op - FIRST_PREMUL])
        return fail(INVALID_ARGUMENT, "fake NCCL: op %d was not created", op);
    c->premul_used[op - FIRST_PREMUL] = 0;
    return OK;
}

/* ---- collectives ---- */
enum { K_ALLREDUCE, K_BROADCAST, K_REDUCE, K_ALLGATHER, K_REDUCESCATTER, K_SEND, K_RECV };
static const char *const kind_names[] = {"allreduce",     "broadcast", "reduce", "allgather",
                                         "reducescatter", "send",      "recv"};

typedef struct {
    int kind;
    const void *send;
    void *recv;
    size_t count;     /* allreduce/broadcast/reduce: elements; allgather: per rank send;
                     reducescatter: per rank recv */
    int dt, op, root; /* root: the peer of a send or receive */
    ncclComm_t comm;
    void *stream;
    double scalar; /* a pre-multiplied sum's factor, taken when the call is made (the op may
                      be destroyed before the call runs, as NCCL allows) */
} call_t;

#define MAX_GROUP 4096
static __thread int group_depth;
static __thread int group_len;
static __thread call_t group_calls[MAX_GROUP];

/* Elements of a reduction's result the kernel writes: all of them, except
 * with the one-rank defect switched on (see the top of the file). */
static size_t written(const call_t *k) {
    const char *on = getenv("CRING_FAKE_NCCL_ONE_RANK_DEFECT");
    if (!on || strcmp(on, "1") != 0 || k->comm->nranks != 1) return k->count;
    if (k->op != AVG && k->op < FIRST_PREMUL) return k->count;
    size_t blocks = (size_t)env_double("CRING_FAKE_NCCL_DEFECT_BLOCKS", 16);
    return blocks ? k->count - k->count % blocks : k->count;
}

/* The bytes one rank puts in its slot for a collective. */
static size_t part_bytes(const call_t *k) {
    size_t es = fake__type_size(k->dt);
    return k->kind == K_REDUCESCATTER ? k->count * (size_t)k->comm->nranks * es : k->count * es;
}

static int run(const call_t *k) {
    ncclComm_t c = k->comm;
    size_t part = part_bytes(k);
    unsigned char *mine = c->slots + (size_t)c->rank * c->slot_bytes;
    const unsigned char *parts[256];
    for (int r = 0; r < c->nranks && r < 256; r++) parts[r] = c->slots + (size_t)r * c->slot_bytes;
    int contributes = k->kind != K_BROADCAST || c->rank == k->root;
    if (contributes && part) memcpy(mine, k->send, part);
    int rc = barrier(c);
    if (rc != OK) return rc;
    switch (k->kind) {
    case K_ALLREDUCE:
        fake__reduce_parts(c->nranks, k->dt, k->op, k->scalar, parts, 0, written(k), k->recv);
        break;
    case K_REDUCE:
        if (c->rank == k->root)
            fake__reduce_parts(c->nranks, k->dt, k->op, k->scalar, parts, 0, written(k), k->recv);
        break;
    case K_BROADCAST: memcpy(k->recv, parts[k->root], part); break;
    case K_ALLGATHER:
        for (int r = 0; r < c->nranks; r++)
            memcpy((unsigned char *)k->recv + (size_t)r * part, parts[r], part);
        break;
    case K_REDUCESCATTER:
        fake__reduce_parts(c->nranks, k->dt, k->op, k->scalar, parts, (size_t)c->rank * k->count,
                           written(k), k->recv);
        break;
    }
    rc = barrier(c);
    if (rc != OK) return rc;
    c->collectives++;
    long fail_after = (long)env_double("CRING_FAKE_NCCL_FAIL_AFTER", 0);
    if (fail_after > 0 && c->collectives >= fail_after)
        fail_async(c, REMOTE_ERROR, "fake NCCL: CRING_FAKE_NCCL_FAIL_AFTER reached");
    return OK;
}

/* One send's record in its rank's slot, followed by its bytes (padded to 8). */
typedef struct {
    int64_t peer; /* -1 ends the list */
    uint64_t bytes;
} message_t;

/* The point-to-point calls k[0..m) of one group (one communicator): every
 * rank writes its sends, all meet, each receive reads the matching send (the
 * n-th receive from peer q takes q's n-th send to this rank), all meet. */
static int run_p2p(const call_t *k, int m) {
    ncclComm_t c = k[0].comm;
    unsigned char *mine = c->slots + (size_t)c->rank * c->slot_bytes;
    size_t at = 0;
    int rc = OK;
    for (int i = 0; i < m && rc == OK; i++) {
        if (k[i].comm != c)
            rc = fail(INVALID_USAGE, "fake NCCL: one group's sends use several communicators");
        else if (k[i].root < 0 || k[i].root >= c->nranks)
            rc = fail(INVALID_ARGUMENT, "fake NCCL: peer %d of %d", k[i].root, c->nranks);
        if (k[i].kind != K_SEND || rc != OK) continue;
        size_t bytes = k[i].count * fake__type_size(k[i].dt);
        if (at + sizeof(message_t) * 2 + bytes + 8 > c->slot_bytes) {
            rc = fail(INVALID_ARGUMENT, "fake NCCL: sends exceed CRING_FAKE_NCCL_SLOT_BYTES");
            break;
        }
        message_t h = {k[i].root, bytes};
        memcpy(mine + at, &h, sizeof h);
        at += sizeof h;
        if (bytes) memcpy(mine + at, k[i].send, bytes);
        at += (bytes + 7) & ~(size_t)7;
    }
    message_t end = {-1, 0};
    if (at + sizeof end <= c->slot_bytes) memcpy(mine + at, &end, sizeof end);
    int brc = barrier(c); /* every rank meets even after an error here */
    if (brc != OK) return brc;
    int taken[256] = {0}; /* receives from each peer so far */
    for (int i = 0; i < m && rc == OK; i++) {
        if (k[i].kind != K_RECV) continue;
        int q = k[i].root;
        size_t bytes = k[i].count * fake__type_size(k[i].dt), off = 0;
        const unsigned char *theirs = c->slots + (size_t)q * c->slot_bytes;
        int seen = 0, found = 0;
        for (;;) {
            message_t h;
            memcpy(&h, theirs + off, sizeof h);
            if (h.peer < 0) break;
            off += sizeof h;
            if (h.peer == c->rank && seen++ == taken[q]) {
                if (h.bytes != bytes)
                    rc = fail(INVALID_ARGUMENT,
                              "fake NCCL: rank %d receives %zu bytes from %d, which sends %llu",
                              c->rank, bytes, q, (unsigned long long)h.bytes);
                else if (bytes) memcpy(k[i].recv, theirs + off, bytes);
                found = 1;
                break;
            }
            off += ((size_t)h.bytes + 7) & ~(size_t)7;
        }
        taken[q]++;
        if (!found && rc == OK)
            rc = fail(INVALID_USAGE, "fake NCCL: rank %d receives from %d, which sends it nothing",
                      c->rank, q);
    }
    brc = barrier(c);
    if (rc == OK) rc = brc;
    if (rc == OK) c->collectives++;
    else if (atomic_load(&c->async_error) == OK) fail_async(c, rc, last_error);
    return rc;
}

static _Atomic long collective_calls;

EXPORT long fake_nccl_calls(void) { return atomic_load(&collective_calls); }

/* ---- enqueueing on the fake runtime's streams ---- */
typedef int (*enqueue_fn)(void *const *streams, int n, void (*fn)(void *), void *arg);
static enqueue_fn runtime_enqueue;
static pthread_once_t runtime_once = PTHREAD_ONCE_INIT;

/* fake_cudart.c's fake_cuda_enqueue_group, from the copy the process loaded
 * (cring loads it from CRING_CUDART_LIBRARY, privately). */
static void find_runtime(void) {
    runtime_enqueue = (enqueue_fn)dlsym(RTLD_DEFAULT, "fake_cuda_enqueue_group");
    const char *path = getenv("CRING_CUDART_LIBRARY");
    if (!runtime_enqueue && path && *path) {
        void *lib = dlopen(path, RTLD_NOW | RTLD_NOLOAD);
        if (lib) runtime_enqueue = (enqueue_fn)dlsym(lib, "fake_cuda_enqueue_group");
    }
}

typedef struct {
    int n;
    call_t calls[]; /* in call order */
} job_t;

/* A group's calls, in order (consecutive sends and receives as one phase);
 * the first failure stops the rest and becomes the communicator's error. */
static int run_calls(const call_t *calls, int n) {
    int rc = OK;
    for (int i = 0; i < n && rc == OK;) {
        ncclComm_t c = calls[i].comm;
        if (atomic_load(&c->aborted) || atomic_load(&c->async_error) != OK) {
            rc = atomic_load(&c->async_error) != OK ? atomic_load(&c->async_error) : SYSTEM_ERROR;
            break;
        }
        int j = i;
        while (j < n && (calls[j].kind == K_SEND || calls[j].kind == K_RECV)) j++;
        if (j > i) {
            rc = run_p2p(&calls[i], j - i);
            i = j;
        } else {
            rc = run(&calls[i++]);
        }
    }
    return rc;
}

/* On a stream's device thread: the job's calls, then they are no longer pending. */
static void run_job(void *arg) {
    job_t *job = arg;
    run_calls(job->calls, job->n);
    for (int i = 0; i < job->n; i++) atomic_fetch_sub(&job->calls[i].comm->pending, 1);
    free(job);
}

/* Enqueue calls[0..n) as one job on their streams (joined when several), or
 * run them here when no fake runtime is loaded. */
static int launch(const call_t *calls, int n) {
    if (n == 0) return OK;
    pthread_once(&runtime_once, find_runtime);
    if (!runtime_enqueue) return run_calls(calls, n);
    job_t *job = malloc(sizeof *job + sizeof(call_t) * (size_t)n);
    void **streams = malloc(sizeof *streams * (size_t)n);
    if (!job || !streams) {
        free(job);
        free(streams);
        return fail(SYSTEM_ERROR, "fake NCCL: out of memory");
    }
    job->n = n;
    memcpy(job->calls, calls, sizeof(call_t) * (size_t)n);
    int nstreams = 0;
    for (int i = 0; i < n; i++) {
        int seen = 0;
        for (int k = 0; k < nstreams && !seen; k++) seen = streams[k] == calls[i].stream;
        if (!seen) streams[nstreams++] = calls[i].stream;
        atomic_fetch_add(&calls[i].comm->pending, 1);
    }
    int rc = runtime_enqueue(streams, nstreams, run_job, job);
    free(streams);
    if (rc != 0) {
        for (int i = 0; i < n; i++) atomic_fetch_sub(&calls[i].comm->pending, 1);
        free(job);
        return fail(SYSTEM_ERROR, "fake NCCL: the fake runtime refused the work (cuda error %d)",
                    rc);
    }
    return OK;
}

/* What NCCL checks when a call is made. */
static int check_call(const call_t *k) {
    if (!k->comm) return fail(INVALID_ARGUMENT, "fake NCCL: NULL communicator");
    if (fake__type_size(k->dt) == 0)
        return fail(INVALID_ARGUMENT, "fake NCCL: bad datatype %d", k->dt);
    int async_error = atomic_load(&k->comm->async_error);
    if (async_error) return fail(async_error, "fake NCCL: communicator failed");
    if (atomic_load(&k->comm->aborted)) return fail(INVALID_USAGE, "fake NCCL: aborted");
    if (k->kind == K_SEND || k->kind == K_RECV) {
        if (k->root < 0 || k->root >= k->comm->nranks)
            return fail(INVALID_ARGUMENT, "fake NCCL: peer %d of %d", k->root, k->comm->nranks);
    } else if (part_bytes(k) > k->comm->slot_bytes) {
        return fail(INVALID_ARGUMENT, "fake NCCL: %zu bytes exceed CRING_FAKE_NCCL_SLOT_BYTES",
                    part_bytes(k));
    }
    return OK;
}

/* A group's sends of one phase must fit the sender's slot. */
static int check_sends(const call_t *k, int n) {
    for (int i = 0; i < n;) {
        int j = i;
        size_t need = sizeof(message_t);
        while (j < n && (k[j].kind == K_SEND || k[j].kind == K_RECV)) {
            if (k[j].comm != k[i].comm)
                return fail(INVALID_USAGE,
                            "fake NCCL: one group's sends use several communicators");
            if (k[j].kind == K_SEND)
                need +=
                    sizeof(message_t) + ((k[j].count * fake__type_size(k[j].dt) + 7) & ~(size_t)7);
            j++;
        }
        if (j > i && need + 8 > k[i].comm->slot_bytes)
            return fail(INVALID_ARGUMENT, "fake NCCL: sends exceed CRING_FAKE_NCCL_SLOT_BYTES");
        i = j > i ? j : i + 1;
    }
    return OK;
}

static int submit(call_t k) {
    atomic_fetch_add(&collective_calls, 1);
    int rc = check_call(&k);
    if (rc != OK) return rc;
    if (k.op >= FIRST_PREMUL && k.op < FIRST_PREMUL + MAX_PREMUL)
        k.scalar = k.comm->premul[k.op - FIRST_PREMUL];
    log_line("%s rank=%d count=%zu dtype=%d op=%d root=%d stream=0x%lx group=%d",
             kind_names[k.kind], k.comm->rank, k.count, k.dt, k.op, k.root,
             (unsigned long)(uintptr_t)k.stream, group_depth > 0);
    if (group_depth > 0) {
        if (group_len == MAX_GROUP) return fail(INTERNAL_ERROR, "fake NCCL: group too large");
        group_calls[group_len++] = k;
        return OK;
    }
    return launch(&k, 1);
}

EXPORT int ncclGroupStart(void) {
    group_depth++;
    return OK;
}

EXPORT int ncclGroupEnd(void) {
    if (group_depth == 0) return fail(INVALID_USAGE, "fake NCCL: ncclGroupEnd without start");
    if (--group_depth > 0) return OK;
    int n = group_len;
    group_len = 0;
    log_line("groupend calls=%d", n);
    int rc = check_sends(group_calls, n);
    return rc == OK ? launch(group_calls, n) : rc;
}

EXPORT int ncclAllReduce(const void *send, void *recv, size_t count, int dt, int op,
                         ncclComm_t comm, void *stream) {
    return submit((call_t){K_ALLREDUCE, send, recv, count, dt, op, 0, comm, stream, 1.0});
}

EXPORT int ncclBroadcast(const void *send, void *recv, size_t count, int dt, int root,
                         ncclComm_t comm, void *stream) {
    return submit((call_t){K_BROADCAST, send, recv, count, dt, 0, root, comm, stream, 1.0});
}

EXPORT int ncclReduce(const void *send, void *recv, size_t count, int dt, int op, int root,
                      ncclComm_t comm, void *stream) {
    return submit((call_t){K_REDUCE, send, recv, count, dt, op, root, comm, stream, 1.0});
}

#ifndef FAKE_NCCL_WITHOUT_ALLGATHER
EXPORT int ncclAllGather(const void *send, void *recv, size_t send_count, int dt, ncclComm_t comm,
                         void *stream) {
    return submit((call_t){K_ALLGATHER, send, recv, send_count, dt, 0, 0, comm, stream, 1.0});
}
#endif

EXPORT int ncclReduceScatter(const void *send, void *recv, size_t recv_count, int dt, int op,
                             ncclComm_t comm, void *stream) {
    return submit((call_t){K_REDUCESCATTER, send, recv, recv_count, dt, op, 0, comm, stream, 1.0});
}

EXPORT int ncclSend(const void *send, size_t count, int dt, int peer, ncclComm_t comm,
                    void *stream) {
    return submit((call_t){K_SEND, send, NULL, count, dt, 0, peer, comm, stream, 1.0});
}

EXPORT int ncclRecv(void *recv, size_t count, int dt, int peer, ncclComm_t comm, void *stream) {
    return submit((call_t){K_RECV, NULL, recv, count, dt, 0, peer, comm, stream, 1.0});
}

/* cring.h: the public C API of the cring collective library.
 * Everything a C program needs to build a communicator and run collectives; no
 * Python, no framework. Internal symbols (cring__*) never appear here. */
#ifndef CRING_CRING_H
#define CRING_CRING_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

#if defined(__GNUC__)
#define CRING_API __attribute__((visibility("default")))
#else
#define CRING_API
#endif

/* ---- Status codes ------------------------------------------------------- */
/* One X-macro so the enum, its name and its message never drift apart.
 * X(suffix, value, message) */
#define CRING_STATUS_MAP(X)                                                                        \
    X(OK, 0, "success")                                                                            \
    X(ERR_INVALID_ARGUMENT, -1, "invalid argument")                                                \
    X(ERR_NO_MEMORY, -2, "out of memory")                                                          \
    X(ERR_SYSTEM, -3, "a system call failed")                                                      \
    X(ERR_TIMEOUT, -4, "operation timed out")                                                      \
    X(ERR_PEER_FAILURE, -5, "a peer process died or closed its connection")                        \
    X(ERR_MISMATCH, -6, "ranks disagree on the operation")                                         \
    X(ERR_NOT_SUPPORTED, -7, "not supported")                                                      \
    X(ERR_PROTOCOL, -8, "malformed or unexpected message")                                         \
    X(ERR_AUTH, -9, "authentication failed")                                                       \
    X(ERR_BROKEN, -10, "communicator is unusable after an earlier failure")                        \
    X(ERR_CLOSED, -11, "object is closed")

typedef enum cring_status {
#define CRING__STATUS_ENUM(name, value, msg) CRING_##name = value,
    CRING_STATUS_MAP(CRING__STATUS_ENUM)
#undef CRING__STATUS_ENUM
} cring_status_t;

/* Static string for a status ("success", "operation timed out", ...).
 * Never NULL; unknown codes give "unknown status". Thread-safe. */
CRING_API const char *cring_status_string(cring_status_t status);
/* Static name for a status ("CRING_ERR_TIMEOUT"). Thread-safe. */
CRING_API const char *cring_status_name(cring_status_t status);

/* ---- Element types and reduction operations ----------------------------- */
typedef enum cring_dtype {
    CRING_FLOAT16 = 0,
    CRING_BFLOAT16 = 1,
    CRING_FLOAT32 = 2,
    CRING_FLOAT64 = 3,
    CRING_INT8 = 4,
    CRING_UINT8 = 5,
    CRING_INT32 = 6,
    CRING_INT64 = 7,
    CRING_BOOL = 8, /* broadcast / allgather only: not reducible */
    CRING_INT16 = 9,
    CRING_UINT16 = 10,
    CRING_UINT32 = 11,
    CRING_UINT64 = 12,
    CRING_DTYPE_COUNT
} cring_dtype_t;

/* Values follow Horovod's ReduceOp numbering so wrappers can pass them through. */
typedef enum cring_op {
    CRING_AVERAGE = 0, /* sum, then divide by the world size (integers: toward zero) */
    CRING_SUM = 1,
    CRING_ADASUM = 2, /* reserved: not supported */
    CRING_MIN = 3,
    CRING_MAX = 4,
    CRING_PRODUCT = 5,
    CRING_OP_COUNT
} cring_op_t;

/* Size in bytes of one element; 0 for an invalid dtype. */
CRING_API size_t cring_dtype_size(cring_dtype_t dtype);
/* "float32", ...; "invalid" for out-of-range values. */
CRING_API const char *cring_dtype_name(cring_dtype_t dtype);
/* "sum", "average", ...; "invalid" for out-of-range values. */
CRING_API const char *cring_op_name(cring_op_t op);

/* ---- Rendezvous key-value store ---------------------------------------- */
/* A small TCP key-value store used to exchange addresses at start-up. One
 * process serves it (rank 0 or the launcher); every rank is a client. Every
 * connection must present the job secret when the server has one. */
typedef struct cring_store_server cring_store_server_t;
typedef struct cring_store cring_store_t;

/* Start serving on bind_addr:port (port 0 picks a free port) in a background
 * thread. secret may be NULL or "" (no authentication). *bound_port receives
 * the port actually bound. On error nothing is left running.
 * Thread-safe with respect to other servers. */
CRING_API cring_status_t cring_store_server_start(const char *bind_addr, int port,
                                                  const char *secret,
                                                  cring_store_server_t **server_out,
                                                  int *bound_port);
/* Stop the thread, close every connection, free. NULL is a no-op. */
CRING_API void cring_store_server_stop(cring_store_server_t *server);

/* Connect to a store, retrying until timeout_s (the server may start later).
 * Errors: ERR_TIMEOUT, ERR_AUTH (wrong secret), ERR_SYSTEM. A client is used
 * by one thread at a time. */
CRING_API cring_status_t cring_store_connect(const char *addr, int port, const char *secret,
                                             double timeout_s, cring_store_t **client_out);
/* Close and free. NULL is a no-op. */
CRING_API void cring_store_close(cring_store_t *client);
/* Make a call blocked on client in another thread fail at once (the client is
 * broken afterwards). The only function that may be called concurrently with
 * another on the same client; not after cring_store_close. */
CRING_API void cring_store_interrupt(cring_store_t *client);
/* Set key to a copy of value (len bytes, may be 0). Overwrites. */
CRING_API cring_status_t cring_store_set(cring_store_t *client, const char *key, const void *value,
                                         size_t len);
/* Wait until key exists (up to timeout_s), then return a malloc'd copy of its
 * value in *value_out (caller frees with free()) and its length in *len_out.
 * Errors: ERR_TIMEOUT when the key did not appear in time. */
CRING_API cring_status_t cring_store_get(cring_store_t *client, const char *key, double timeout_s,
                                         void **value_out, size_t *len_out);
/* Atomically add delta to the 64-bit integer at key (a missing key counts as
 * 0) and return the new value. */
CRING_API cring_status_t cring_store_add(cring_store_t *client, const char *key, int64_t delta,
                                         int64_t *new_value_out);
/* Wait until every key in keys[0..nkeys) exists, up to timeout_s. */
CRING_API cring_status_t cring_store_wait(cring_store_t *client, const char *const *keys,
                                          size_t nkeys, double timeout_s);

/* ---- Communicator -------------------------------------------------------- */
typedef struct cring_comm cring_comm_t;

typedef enum cring_transport_kind {
    CRING_TRANSPORT_AUTO = 0, /* shared memory when every rank is on one host, else TCP */
    CRING_TRANSPORT_TCP = 1,  /* TCP between every pair, even on one host */
    CRING_TRANSPORT_SHM = 2   /* shared memory; fails if ranks span hosts */
} cring_transport_kind_t;

typedef struct cring_config {
    int rank;                /* 0 <= rank < size */
    int size;                /* >= 1 */
    const char *store_addr;  /* rendezvous store address */
    int store_port;          /* rendezvous store port */
    int serve_store;         /* nonzero: this process starts the store (rank 0) */
    const char *secret;      /* job secret, NULL or "" for none */
    const char *job_key;     /* prefix for store keys; distinct per init (may be NULL) */
    const char *listen_addr; /* address peers reach this rank on over TCP (NULL: auto) */
    cring_transport_kind_t transport;
    double timeout_s; /* bound on every wait, default 600 when <= 0 */
} cring_config_t;

/* Fill cfg with defaults (rank 0 of 1, AUTO transport, 600 s timeout). */
CRING_API void cring_config_init(cring_config_t *cfg);

/* Rendezvous with the other ranks and build a communicator. Blocks until every
 * rank has joined or timeout_s passes. On error *comm_out is NULL and nothing
 * is left behind (no thread, socket or shared-memory file); a message is in
 * cring_last_init_error(). Not thread-safe with itself in one process. */
CRING_API cring_status_t cring_comm_init(const cring_config_t *cfg, cring_comm_t **comm_out);
/* Message describing the last cring_comm_init failure in this thread. */
CRING_API const char *cring_last_init_error(void);
/* Free everything. Safe on a broken communicator; NULL is a no-op. Does not
 * communicate, so it never blocks on a dead peer. */
CRING_API void cring_comm_destroy(cring_comm_t *comm);

/* Queries; thread-safe. local_* count ranks sharing this host; cross_* count
 * ranks that share this rank's local rank (one per host when hosts are even). */
CRING_API int cring_comm_rank(const cring_comm_t *comm);
CRING_API int cring_comm_size(const cring_comm_t *comm);
CRING_API int cring_comm_local_rank(const cring_comm_t *comm);
CRING_API int cring_comm_local_size(const cring_comm_t *comm);
CRING_API int cring_comm_cross_rank(const cring_comm_t *comm);
CRING_API int cring_comm_cross_size(const cring_comm_t *comm);
/* "shm" or "tcp": the transport the collectives use. */
CRING_API const char *cring_comm_transport_name(const cring_comm_t *comm);
/* Detail for the last error a collective returned on this communicator
 * (which rank, what differed). Valid until the next call on comm. */
CRING_API const char *cring_comm_last_error(const cring_comm_t *comm);
/* The store client the communicator holds (for extra key exchange); owned by
 * comm. Not thread-safe. */
CRING_API cring_store_t *cring_comm_store(cring_comm_t *comm);

/* Collective over every rank of a communicator whose ranks all share one
 * host's memory (transport "shm"): map a zeroed region of nbytes for this
 * rank that every peer maps too. An allreduce whose buffer lies in a region
 * (send == recv, at the same offset and count on every rank) reads peers'
 * data in place and writes results in place, with no copy through the
 * segment. *data_out stays mapped until the process exits (never unmapped,
 * so tensors over it may outlive the communicator); hand out region memory
 * so that every rank uses the same offsets. Returns ERR_NOT_SUPPORTED on
 * every rank for another transport or one rank, ERR_MISMATCH on every rank
 * when ranks asked for different sizes, ERR_NO_MEMORY past 16 regions.
 * Safe to call while an engine drives the communicator. */
CRING_API cring_status_t cring_comm_shared_region(cring_comm_t *comm, size_t nbytes,
                                                  void **data_out);

/* ---- Collectives --------------------------------------------------------
 * Blocking; every rank must make the same calls in the same order. Each call
 * first checks that all ranks agree on its arguments (collective, dtype,
 * count, op, root); a disagreement returns ERR_MISMATCH on every rank, with
 * detail in cring_comm_last_error(), and leaves the communicator usable.
 * ERR_TIMEOUT and ERR_PEER_FAILURE leave it broken (every later call returns
 * ERR_BROKEN). Buffers are owned by the caller and only used during the call;
 * send and recv may be the same pointer (in place) but must not otherwise
 * overlap. Not thread-safe: one call at a time per communicator. */

/* recv[i] = op over ranks of send[i], for i < count. */
CRING_API cring_status_t cring_allreduce(cring_comm_t *comm, const void *send, void *recv,
                                         size_t count, cring_dtype_t dtype, cring_op_t op);
/* Copy nbytes of root's buf into every rank's buf. */
CRING_API cring_status_t cring_broadcast(cring_comm_t *comm, void *buf, size_t nbytes, int root);
/* Concatenate every rank's send (recv_bytes[r] bytes from rank r, which must
 * equal that rank's send_bytes) into recv, rank order. recv_bytes has size
 * entries, identical on every rank. */
CRING_API cring_status_t cring_allgatherv(cring_comm_t *comm, const void *send, size_t send_bytes,
                                          void *recv, const size_t *recv_bytes);
/* Reduce send (sum of counts[] elements) over ranks; rank r receives the
 * counts[r] elements that start at sum(counts[0..r)). counts has size
 * entries, identical on every rank. recv may not alias send. */
CRING_API cring_status_t cring_reducescatter(cring_comm_t *comm, const void *send, void *recv,
                                             const size_t *counts, cring_dtype_t dtype,
                                             cring_op_t op);
/* Rank r sends send_bytes[j] bytes to rank j (its blocks lie in send in
 * rank order) and receives recv_bytes[j] bytes from rank j (stored in recv in
 * rank order). Every pair must agree (rank i's send_bytes[j] == rank j's
 * recv_bytes[i]), else ERR_MISMATCH on every rank. send and recv must not
 * overlap. */
CRING_API cring_status_t cring_alltoallv(cring_comm_t *comm, const void *send,
                                         const size_t *send_bytes, void *recv,
                                         const size_t *recv_bytes);
/* Return once every rank has entered. */
CRING_API cring_status_t cring_barrier(cring_comm_t *comm);

/* ---- Engine: asynchronous, negotiated, fused collectives --------------------
 * A background thread owns the communicator. Ranks submit named requests in
 * any order from any thread; a request runs once every rank has submitted its
 * name, and ready allreduces (and broadcasts) with the same dtype and op are
 * packed into one fusion buffer. A disagreement between ranks on one name
 * (shape, dtype, op, root) fails that request's handle on every rank and
 * leaves the engine usable. */
typedef struct cring_engine cring_engine_t;
typedef struct cring_handle cring_handle_t;

/* One X-macro for the collectives, so the enum and the names never drift
 * apart. X(SUFFIX, value, "name") */
#define CRING_COLLECTIVE_MAP(X)                                                                    \
    X(ALLREDUCE, 1, "allreduce")                                                                   \
    X(BROADCAST, 2, "broadcast")                                                                   \
    X(ALLGATHER, 3, "allgather")                                                                   \
    X(REDUCESCATTER, 4, "reducescatter")                                                           \
    X(BARRIER, 5, "barrier")                                                                       \
    X(ALLTOALL, 6, "alltoall")                                                                     \
    X(JOIN, 7, "join")

typedef enum cring_collective {
#define CRING__COLLECTIVE_ENUM(name, value, str) CRING_COLL_##name = value,
    CRING_COLLECTIVE_MAP(CRING__COLLECTIVE_ENUM)
#undef CRING__COLLECTIVE_ENUM
} cring_collective_t;

/* Static lower-case name ("allreduce", ...); "unknown" for other values.
 * Thread-safe. */
CRING_API const char *cring_collective_name(cring_collective_t collective);

/* One tensor of a request. For ALLGATHER and ALLTOALL the engine places the
 * result (see cring_handle_output): recv may be NULL or lend room of size x
 * send's bytes (ALLGATHER, CPU or CUDA) or send's bytes (ALLTOALL, CUDA
 * only; the CPU ignores it), which a result that fits uses (the caller
 * keeps owning it; cring_handle_output then returns recv), while a larger
 * one gets memory of the engine's (device memory for CUDA tensors). For
 * REDUCESCATTER, recv holds this rank's rows (shape[0] split as n/P, +1 for
 * ranks < n%P). */
typedef struct cring_tensor {
    const void *send;
    void *recv; /* may equal send (in place) */
    cring_dtype_t dtype;
    int ndim;
    const int64_t *shape; /* ndim entries; copied at submission */
} cring_tensor_t;

/* Where a request's tensors live. Every tensor of a request is on the same
 * device. CPU is the zero value, so a zero-initialised request is a CPU one. */
typedef enum cring_device_type { CRING_DEVICE_CPU = 0, CRING_DEVICE_CUDA = 1 } cring_device_type_t;

typedef struct cring_device {
    cring_device_type_t type;
    int id;       /* CUDA device ordinal; 0 for the CPU */
    void *stream; /* CUDA: the cudaStream_t the inputs were produced on and the
                     results must be ordered on (NULL: the legacy default
                     stream). Unused for the CPU. */
} cring_device_t;

/* Hand-aligned: one column of field comments, some over several lines. */
/* clang-format off */
typedef struct cring_request {
    const char *name;               /* unique among this rank's requests in flight */
    cring_collective_t collective;
    cring_op_t op;                  /* reductions */
    int root;                       /* broadcast */
    double prescale;                /* multiply inputs before reducing (1: none) */
    double postscale;               /* multiply results after reducing (1: none) */
    cring_dtype_t compression;      /* FLOAT16 or BFLOAT16 to send float32 compressed;
                                       CRING_DTYPE_COUNT for none */
    int ntensors;                   /* >1: a group negotiated and run as one unit */
    const cring_tensor_t *tensors;
    int flags;                      /* CRING_REQUEST_* */
    const int64_t *splits;          /* ALLTOALL (one tensor): size entries, the rows
                                       of shape[0] sent to each rank in rank order;
                                       NULL splits shape[0] evenly (it must divide) */
    cring_device_t device;          /* where send/recv live; every rank must agree on
                                       the type (ERR_MISMATCH otherwise) */
} cring_request_t;
/* clang-format on */

/* JOIN (no tensors): this rank has no more work. Until every rank has joined,
 * the other ranks' allreduces (Sum and Average) complete with zeros as this
 * rank's contribution; any other collective fails on every rank while some
 * rank has joined. Requests submitted before the join complete first; no
 * request may be submitted while it is in flight. The handle completes once
 * every rank has joined; cring_handle_value then gives the last rank to
 * join (the highest rank among those that joined in the same round). */

/* The submitting thread calls cring_handle_wait at once and drives the
 * engine itself, so the engine thread need not be woken (saves a context
 * switch on synchronous calls). */
#define CRING_REQUEST_CALLER_WAITS 1
/* The name is one of a cycle that unnamed calls reuse in submission order
 * ("allreduce.noname.3"): a request whose name is still in flight on this
 * rank waits behind it (and is queued when it completes) instead of failing
 * as a duplicate, so the response cache serves unnamed calls too. Such a
 * request is no gradient: it is never held for a gradient bucket. Every rank
 * must set the flag alike for a name. */
#define CRING_REQUEST_SEQUENCED 2

typedef struct cring_engine_stats {
    uint64_t cycles;        /* negotiation rounds */
    uint64_t collectives;   /* data collectives run (a fused batch counts once) */
    uint64_t tensors;       /* tensors completed */
    uint64_t fused_tensors; /* tensors that went through the fusion buffer */
    uint64_t cache_hits;    /* requests negotiated from the response cache */
    uint64_t errors;        /* requests that completed with an error */
    /* Gradient buckets (docs/gpu.md, "Gradient buckets"): CUDA allreduces
     * that waited for the rest of their bucket, and releases of everything
     * held by the idle rule (no gradient for 0.2 s, or one held for 2 s)
     * rather than by complete buckets or a waiting thread. */
    uint64_t bucket_held, bucket_idle_releases;
    /* Payload bytes this rank moved since init, per transport: TCP as sent
     * and received on its sockets, shared memory as given to and taken from
     * its collectives (a hierarchical communicator uses both). */
    uint64_t tcp_bytes_sent, tcp_bytes_received;
    uint64_t shm_bytes_sent, shm_bytes_received;
    /* The knobs in force on this rank; with CRING_AUTOTUNE=1 the tuner
     * changes them (on every rank at the same round) until it settles. */
    uint64_t fusion_threshold_bytes;
    double cycle_time_ms;
    int autotune; /* CRING_AUTOTUNE_OFF, CRING_AUTOTUNE_TUNING, CRING_AUTOTUNE_SETTLED */
} cring_engine_stats_t;

enum { CRING_AUTOTUNE_OFF = 0, CRING_AUTOTUNE_TUNING = 1, CRING_AUTOTUNE_SETTLED = 2 };

/* Start the engine thread; it takes ownership of comm (destroyed by
 * cring_engine_stop, or here on failure). Reads CRING_FUSION_THRESHOLD (bytes,
 * default 64 MiB), CRING_CYCLE_TIME (ms), CRING_CACHE_CAPACITY,
 * CRING_STALL_CHECK_SECONDS, CRING_STALL_SHUTDOWN_SECONDS, CRING_TIMELINE,
 * CRING_AUTOTUNE and its CRING_AUTOTUNE_* settings (docs/autotune.md). */
CRING_API cring_status_t cring_engine_start(cring_comm_t *comm, cring_engine_t **engine_out);
/* Stop the thread and destroy the communicator; handles still pending complete
 * with ERR_CLOSED. Handles stay valid until freed. NULL is a no-op. */
CRING_API void cring_engine_stop(cring_engine_t *engine);
CRING_API cring_comm_t *cring_engine_comm(cring_engine_t *engine);

/* Queue a request (the engine copies everything but the buffers, which the
 * caller keeps valid until the handle is done). Errors, with *handle_out NULL
 * and a message in cring_engine_error_message(): ERR_INVALID_ARGUMENT (bad
 * request, or the name is already in flight on this rank), ERR_CLOSED, and
 * after a transport failure the status that broke the engine (ERR_PEER_FAILURE,
 * ERR_TIMEOUT, ...). Thread-safe. */
CRING_API cring_status_t cring_engine_submit(cring_engine_t *engine, const cring_request_t *req,
                                             cring_handle_t **handle_out);
/* Message for the last submit error in this thread. */
CRING_API const char *cring_engine_error_message(void);

/* 1 once the handle has completed (successfully or not). Never blocks. */
CRING_API int cring_handle_done(const cring_handle_t *handle);
/* Block until done; returns the handle's status. Thread-safe. */
CRING_API cring_status_t cring_handle_wait(cring_handle_t *handle);
/* Like cring_handle_wait, but give up after timeout_s seconds (driving the
 * engine meanwhile, as cring_handle_wait does). Returns 1 once done, 0 if not
 * yet (then the handle is untouched and may be waited on again). Bindings use
 * it to wake every ~100 ms and run signal handlers. Thread-safe. */
CRING_API int cring_handle_wait_for(cring_handle_t *handle, double timeout_s);
/* After completion: the status and, on error, a message naming the tensor,
 * the ranks and what differed. */
CRING_API cring_status_t cring_handle_status(const cring_handle_t *handle);
CRING_API const char *cring_handle_error(const cring_handle_t *handle);
/* After an ALLGATHER or ALLTOALL completes: the engine-allocated result for
 * tensor `index` (owned by the handle) and, per rank, the first dimension
 * received from it (first_dims[size]). */
CRING_API const void *cring_handle_output(const cring_handle_t *handle, int index,
                                          size_t *bytes_out, const int64_t **first_dims_out);
/* How a result taken out of its handle is freed: free(ctx, ptr, bytes). */
typedef void (*cring_output_free_fn)(void *ctx, void *ptr, size_t bytes);
/* After an ALLGATHER or ALLTOALL of device tensors completes: move result
 * `index` (engine-allocated, not lent) out of the handle, so the caller owns
 * the memory (a DLPack export's deleter, for one) and frees it with
 * *free_out(*ctx_out, ptr, *bytes_out) whenever it likes, before or after
 * cring_handle_free or the engine's stop. That free never waits: it is
 * ordered on the engine's stream (after the work queued there so far), so
 * the caller must have ordered that stream after its own use of the memory
 * on other streams first (the Python binding frees on the consumer's stream
 * instead, through the GPU layer). NULL (nothing moved) for host
 * results, results in room the caller lent, a result already taken, a handle
 * not complete, or a zero-byte result. Not thread-safe against another
 * take of the same handle. */
CRING_API void *cring_handle_take_output(cring_handle_t *handle, int index, size_t *bytes_out,
                                         cring_output_free_fn *free_out, void **ctx_out);
/* After a JOIN completes: the last rank to join. -1 otherwise. */
CRING_API int64_t cring_handle_value(const cring_handle_t *handle);
/* A completed CUDA request: the GPU layer's ordering event (a
 * cring__gpu_event_t, csrc/gpu/gpu.h) recorded on cring's stream after the
 * request's work, which a consumer's stream waits on; NULL for other
 * requests, before completion and after a failure. Owned by the handle
 * (valid until cring_handle_free). Thread-safe. */
CRING_API void *cring_handle_device_event(const cring_handle_t *handle);
/* Release the caller's reference. A handle still running is not cancelled:
 * its buffers must stay valid until it completes. */
CRING_API void cring_handle_free(cring_handle_t *handle);

CRING_API void cring_engine_get_stats(cring_engine_t *engine, cring_engine_stats_t *out);
/* Start writing a Chrome-trace timeline to path (replacing any current one);
 * NULL stops it. The file is valid JSON after every event written. */
CRING_API cring_status_t cring_engine_timeline(cring_engine_t *engine, const char *path);
/* Mark the start of every negotiation cycle in the timeline (Horovod's
 * CYCLE_START markers), or stop marking. Thread-safe. */
CRING_API void cring_engine_timeline_mark_cycles(cring_engine_t *engine, int on);

/* ---- Utilities for bindings and tools ---------------------------------------- */
/* Name of the reduction kernel family chosen for this CPU at run time
 * ("avx512", "avx2", "scalar", ...). Thread-safe. */
CRING_API const char *cring_reduce_isa(void);

/* The sizes the shared-memory collectives work in on this machine, and the
 * caches they come from (docs/performance.md, "Sizes from the machine").
 * A job uses rank 0's. Cache sizes are 0 where the machine reports none. */
typedef struct cring_shm_tuning {
    size_t l1d_bytes, l2_bytes, l3_bytes; /* per core (L3: as reported) */
    size_t round_bytes;                   /* CRING_SHM_ROUND_BYTES: L2 / 4 */
    size_t small_allreduce_bytes;         /* CRING_SHM_SMALL_BYTES: L1d / 3 */
    size_t reduce_block_bytes;            /* CRING_SHM_REDUCE_BLOCK_BYTES: L1d * 2/3 */
    size_t stream_min_bytes;              /* CRING_SHM_STREAM_MIN_BYTES: L3 per CPU / 2 */
    size_t inplace_round_bytes;           /* CRING_SHM_INPLACE_ROUND_BYTES: L3 / 8 */
    size_t inplace_stream_min_bytes;      /* CRING_SHM_INPLACE_STREAM_MIN_BYTES: L2 / 4 */
} cring_shm_tuning_t;
/* Fill *out from the caches and the environment (powers of two, clamped;
 * a variable that is set wins). Reads sysfs; thread-safe. */
CRING_API void cring_shm_tuning(cring_shm_tuning_t *out);

#ifdef __cplusplus
}
#endif
#endif /* CRING_CRING_H */

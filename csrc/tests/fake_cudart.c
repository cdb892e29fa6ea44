/* fake_cudart.c: a test double for libcudart that orders work as a GPU does,
 * built as a shared library (with fake_device.c, the streams and their
 * threads) and loaded through CRING_CUDART_LIBRARY by the CPU tests. "Device
 * memory" is host memory. It must never be kinder than a GPU where
 * correctness depends on ordering; it is never used outside tests.
 *
 * Streams. Every stream (cudaStreamCreateWithFlags's, the legacy default
 * stream of each device as NULL or cudaStreamLegacy, and any other handle a
 * caller names, e.g. a framework's stream, taken as a non-blocking stream of
 * the current device) is a FIFO queue run by a device thread of its own.
 * Before each operation the thread sleeps a random 0..CRING_FAKE_CUDA_DELAY_US
 * microseconds, so the host runs ahead of the device as it does on a GPU.
 * Copies, memsets, event records, host functions, stream-ordered frees and
 * NCCL collectives (fake_nccl.c enqueues them) run when their stream reaches
 * them. Only these order work across streams: cudaStreamWaitEvent (a wait on
 * the event's record at the time of the call, as CUDA does: recording the
 * event again later does not change it), the legacy default stream's implicit
 * synchronisation with blocking streams (flags 0; cring's own and unknown
 * streams are non-blocking), and a multi-stream NCCL group. The host waits
 * only in cudaStreamSynchronize, cudaEventSynchronize, cudaDeviceSynchronize,
 * cudaFree and cudaFreeHost (which synchronise the device, as the real ones
 * do) and in copies with pageable host memory (synchronous, as CUDA's are).
 *
 * Memory. cudaMalloc fills a block with 0xA5 (a result never written shows);
 * cudaFree synchronises the device, overwrites the block with 0xDB and keeps
 * it in a quarantine for a while before releasing it, so a late read shows
 * the poison. cudaMallocAsync/cudaFreeAsync are stream-ordered: the block is
 * poisoned when its stream reaches the free; the next cudaMallocAsync of the
 * same stream may take it at once, and one of any stream as soon as the free
 * has run (as CUDA's pools do, opportunistic reuse included).
 *
 * Seeded: CRING_FAKE_CUDA_SEED (decimal; default: from the clock and pid),
 * mixed with CRING_RANK and the stream's number, drives the delays; the first
 * line of the call log names it, and fake_cuda_seed() returns it.
 *
 * The call log: each call cring makes is appended to $CRING_FAKE_CUDA_LOG at
 * the time of the call, so tests can check what was asked of the runtime
 * (copy direction, bytes, stream). Events are numbered; a wait on, or a host
 * sync of, one never recorded fails. Streams cring creates are numbers from
 * 0xc0de0000. Call counters for C tests: fake_cuda_count("event_record" |
 * "stream_wait" | "event_sync" | "memcpy_d2d" | "stream_create" |
 * "event_create" | "malloc" | "free" | "malloc_async" | "free_async"; the
 * allocations count those that succeeded, the frees every call).
 *
 * For the other test doubles (not CUDA's API, never logged): fake_nccl.c
 * enqueues its collectives with fake_cuda_enqueue_group; the tests' framework
 * stand-ins (tests/gpu/fake_cuda.py) read and write "device memory" from the
 * host after fake_cuda_drain(stream), hand work between streams with
 * fake_cuda_order, track a freed block's streams with fake_cuda_mark /
 * fake_cuda_reached / fake_cuda_unmark, and queue slow "kernels" with
 * fake_cuda_kernel (on cring's own stream too: fake_cuda_created_stream).
 *   CRING_FAKE_CUDA_DEVICES   device count (default 1); "error": no driver
 *   CRING_FAKE_CUDA_ASYNC_ALLOC  "unsupported": cudaMallocAsync answers
 *                             cudaErrorNotSupported, as on a device without
 *                             memory pools
 *   CRING_FAKE_CUDA_DELAY_US  largest random delay before an operation (50)
 *   CRING_FAKE_CUDA_HANG_S    a host wait longer than this prints the streams'
 *                             state to stderr once (default 60) */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <fcntl.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "fake_device.h"

#define EXPORT __attribute__((visibility("default")))

enum { H2D = 1, D2H = 2, D2D = 3 };

static int device_count(void) {
    const char *s = getenv("CRING_FAKE_CUDA_DEVICES");
    if (!s || !*s) return 1;
    if (!strcmp(s, "error")) return -1;
    return atoi(s);
}

static _Atomic long n_event_record, n_stream_wait, n_event_sync, n_memcpy_d2d, n_stream_create,
    n_event_create, n_malloc, n_free, n_malloc_async, n_free_async;

EXPORT unsigned long fake_cuda_seed(void) { return fake__seed(); }

EXPORT long fake_cuda_count(const char *what) {
    if (!strcmp(what, "event_record")) return atomic_load(&n_event_record);
    if (!strcmp(what, "stream_wait")) return atomic_load(&n_stream_wait);
    if (!strcmp(what, "event_sync")) return atomic_load(&n_event_sync);
    if (!strcmp(what, "memcpy_d2d")) return atomic_load(&n_memcpy_d2d);
    if (!strcmp(what, "stream_create")) return atomic_load(&n_stream_create);
    if (!strcmp(what, "event_create")) return atomic_load(&n_event_create);
    if (!strcmp(what, "malloc")) return atomic_load(&n_malloc);
    if (!strcmp(what, "free")) return atomic_load(&n_free);
    if (!strcmp(what, "malloc_async")) return atomic_load(&n_malloc_async);
    if (!strcmp(what, "free_async")) return atomic_load(&n_free_async);
    return -1;
}

/* ---- the runtime's API ------------------------------------------------------------------ */
EXPORT int cudaGetDeviceCount(int *count) {
    int n = device_count();
    *count = n > 0 ? n : 0;
    return n < 0 ? ERROR_INSUFFICIENT_DRIVER : SUCCESS;
}

EXPORT int cudaGetDevice(int *device) {
    *device = fake__current_device;
    return SUCCESS;
}

EXPORT int cudaSetDevice(int device) {
    if (device < 0 || device >= device_count()) return ERROR_INVALID_DEVICE;
    fake__current_device = device;
    fake__log("setdevice %d", device);
    return SUCCESS;
}

EXPORT int cudaRuntimeGetVersion(int *version) {
    *version = 12080;
    return SUCCESS;
}

EXPORT const char *cudaGetErrorString(int error) {
    switch (error) {
    case SUCCESS: return "no error";
    case ERROR_INVALID_VALUE: return "invalid argument";
    case ERROR_MEMORY_ALLOCATION: return "out of memory";
    case ERROR_INSUFFICIENT_DRIVER:
        return "CUDA driver version is insufficient for CUDA runtime version";
    case ERROR_INVALID_DEVICE: return "invalid device ordinal";
    case ERROR_INVALID_RESOURCE_HANDLE: return "invalid resource handle";
    case ERROR_NOT_READY: return "device not ready";
    case ERROR_NOT_SUPPORTED: return "operation not supported";
    default: return "unknown error";
    }
}

/* ---- memory ---- */
/* Pinned host memory: remembered, since copies with it are asynchronous and
 * copies with pageable memory are not. */
typedef struct pinned {
    char *ptr;
    size_t bytes;
    struct pinned *next;
} pinned_t;
static pinned_t *pinned_blocks; /* under mu */

static int is_pinned(const void *p, size_t bytes) { /* under mu */
    for (pinned_t *b = pinned_blocks; b; b = b->next)
        if ((const char *)p >= b->ptr && (const char *)p + bytes <= b->ptr + b->bytes) return 1;
    return 0;
}

EXPORT int cudaHostAlloc(void **ptr, size_t bytes, unsigned int flags) {
    fake__start();
    *ptr = aligned_alloc(64, (bytes + 63) / 64 * 64);
    pinned_t *b = *ptr ? malloc(sizeof *b) : NULL;
    if (*ptr && !b) {
        free(*ptr);
        *ptr = NULL;
    }
    if (b) {
        fake__lock();
        *b = (pinned_t){*ptr, bytes, pinned_blocks};
        pinned_blocks = b;
        fake__unlock();
    }
    fake__log("hostalloc bytes=%zu flags=%u", bytes, flags);
    return *ptr ? SUCCESS : ERROR_MEMORY_ALLOCATION;
}

/* cudaFreeHost synchronises the device first, as CUDA's does. */
EXPORT int cudaFreeHost(void *ptr) {
    fake__drain_device(-1, "cudaFreeHost waits for the device");
    fake__lock();
    for (pinned_t **link = &pinned_blocks; *link; link = &(*link)->next)
        if ((*link)->ptr == ptr) {
            pinned_t *b = *link;
            *link = b->next;
            free(b);
            break;
        }
    fake__unlock();
    free(ptr);
    fake__log("freehost");
    return SUCCESS;
}

EXPORT int cudaMemcpyAsync(void *dst, const void *src, size_t bytes, int kind, void *stream) {
    fake__start();
    if (kind == D2D) atomic_fetch_add(&n_memcpy_d2d, 1);
    fake__log("memcpy kind=%s bytes=%zu stream=0x%lx",
              kind == H2D   ? "H2D"
              : kind == D2H ? "D2H"
              : kind == D2D ? "D2D"
                            : "other",
              bytes, (unsigned long)(uintptr_t)stream);
    fake_op_t *op = fake__op_new(OP_COPY);
    if (!op) return ERROR_MEMORY_ALLOCATION;
    op->dst = dst;
    op->src = src;
    op->bytes = bytes;
    fake__lock();
    int pageable =
        (kind == H2D && !is_pinned(src, bytes)) || (kind == D2H && !is_pinned(dst, bytes));
    fake__unlock();
    if (pageable && kind == H2D) { /* CUDA syncs the stream, then stages the source */
        fake__drain(stream, "a copy from pageable memory waits for its stream");
        op->staging = malloc(bytes ? bytes : 1);
        if (!op->staging) {
            free(op);
            return ERROR_MEMORY_ALLOCATION;
        }
        memcpy(op->staging, src, bytes);
    }
    if (pageable && kind == D2H) op->refs++; /* the host waits for it below */
    int rc = fake__enqueue(stream, op);
    if (rc == SUCCESS && pageable && kind == D2H) {
        fake__lock();
        fake__wait_done(op, "a copy to pageable memory");
        fake__op_put(op);
        fake__unlock();
    }
    return rc;
}

/* Device memory: a header before the block remembers its size and device. */
#define FAKE_HEADER 256 /* keeps the block 256-byte aligned */
#define FAKE_FREED 0xDB
#define QUARANTINE 32
typedef struct {
    size_t bytes, capacity;
    int device;
} header_t;

static void *quarantine[QUARANTINE]; /* freed blocks (their bases), poisoned; under mu */
static int quarantine_next;

static unsigned char *new_block(size_t bytes) {
    size_t capacity = (bytes + 255) / 256 * 256;
    unsigned char *base = aligned_alloc(256, FAKE_HEADER + (capacity ? capacity : 256));
    if (!base) return NULL;
    header_t h = {bytes, capacity, fake__current_device};
    memcpy(base, &h, sizeof h);
    memset(base + FAKE_HEADER, 0xA5, bytes);
    return base + FAKE_HEADER;
}

static header_t header_of(const void *ptr) {
    header_t h;
    memcpy(&h, (const unsigned char *)ptr - FAKE_HEADER, sizeof h);
    return h;
}

/* Poison a block and keep it in the quarantine (the oldest one there goes). */
static void free_block_poisoned(void *ptr) {
    memset(ptr, FAKE_FREED, header_of(ptr).capacity);
    fake__lock();
    void *old = quarantine[quarantine_next];
    quarantine[quarantine_next] = (unsigned char *)ptr - FAKE_HEADER;
    quarantine_next = (quarantine_next + 1) % QUARANTINE;
    fake__unlock();
    free(old);
}

EXPORT int cudaMalloc(void **ptr, size_t bytes) {
    fake__start();
    *ptr = new_block(bytes);
    if (*ptr) atomic_fetch_add(&n_malloc, 1);
    fake__log("malloc device=%d bytes=%zu", fake__current_device, bytes);
    return *ptr ? SUCCESS : ERROR_MEMORY_ALLOCATION;
}

/* cudaFree synchronises the device (CUDA's does), then poisons the block. */
EXPORT int cudaFree(void *ptr) {
    atomic_fetch_add(&n_free, 1);
    if (ptr) {
        fake__drain_device(header_of(ptr).device, "cudaFree waits for the device");
        free_block_poisoned(ptr);
    }
    fake__log("free");
    return SUCCESS;
}

/* Stream-ordered allocation: a block freed on a stream (its free queued,
 * perhaps not yet run) serves that stream's next allocation at once, and any
 * stream's once the free has run (it is poisoned by then). */
typedef struct pooled {
    void *ptr;
    uintptr_t stream;
    fake_op_t *freed; /* the free's poisoning (a reference) */
    struct pooled *next;
} pooled_t;
static pooled_t *pool; /* under mu */

/* CRING_FAKE_CUDA_ASYNC_ALLOC=unsupported: cudaErrorNotSupported (no pools). */
EXPORT int cudaMallocAsync(void **ptr, size_t bytes, void *stream) {
    fake__start();
    *ptr = NULL;
    const char *mode = getenv("CRING_FAKE_CUDA_ASYNC_ALLOC");
    if (mode && !strcmp(mode, "unsupported")) {
        fake__log("mallocasync bytes=%zu unsupported", bytes);
        return ERROR_NOT_SUPPORTED;
    }
    fake__lock();
    for (pooled_t **link = &pool; *link; link = &(*link)->next) {
        header_t h = header_of((*link)->ptr);
        int ordered = (*link)->stream == (uintptr_t)stream || (*link)->freed->done;
        if (ordered && h.device == fake__current_device && h.capacity >= bytes &&
            h.capacity <= 2 * bytes + 4096) {
            pooled_t *p = *link;
            *link = p->next;
            *ptr = p->ptr;
            h.bytes = bytes;
            memcpy((unsigned char *)*ptr - FAKE_HEADER, &h, sizeof h);
            fake__op_put(p->freed);
            free(p);
            break;
        }
    }
    fake__unlock();
    if (!*ptr) *ptr = new_block(bytes);
    if (*ptr) atomic_fetch_add(&n_malloc_async, 1);
    fake__log("mallocasync bytes=%zu stream=0x%lx", bytes, (unsigned long)(uintptr_t)stream);
    return *ptr ? SUCCESS : ERROR_MEMORY_ALLOCATION;
}

EXPORT int cudaFreeAsync(void *ptr, void *stream) {
    atomic_fetch_add(&n_free_async, 1);
    fake__log("freeasync stream=0x%lx", (unsigned long)(uintptr_t)stream);
    if (!ptr) return SUCCESS;
    pooled_t *p = malloc(sizeof *p);
    fake_op_t *op = fake__op_new(OP_SET); /* poison when the stream reaches the free */
    if (!p || !op) {
        free(p);
        free(op);
        return ERROR_MEMORY_ALLOCATION;
    }
    op->dst = ptr;
    op->value = FAKE_FREED;
    op->bytes = header_of(ptr).capacity;
    op->refs++; /* the pool's */
    int rc = fake__enqueue(stream, op);
    fake__lock();
    if (rc != SUCCESS) {
        fake__op_put(op);
        fake__unlock();
        free(p);
        return rc;
    }
    *p = (pooled_t){ptr, (uintptr_t)stream, op, pool};
    pool = p;
    fake__unlock();
    return SUCCESS;
}

EXPORT int cudaMemsetAsync(void *ptr, int value, size_t bytes, void *stream) {
    fake__log("memset bytes=%zu stream=0x%lx", bytes, (unsigned long)(uintptr_t)stream);
    fake_op_t *op = fake__op_new(OP_SET);
    if (!op) return ERROR_MEMORY_ALLOCATION;
    op->dst = ptr;
    op->value = value;
    op->bytes = bytes;
    return fake__enqueue(stream, op);
}

EXPORT int cudaLaunchHostFunc(void *stream, void (*fn)(void *), void *arg) {
    fake__log("hostfunc stream=0x%lx", (unsigned long)(uintptr_t)stream);
    fake_op_t *op = fake__op_new(OP_CALL);
    if (!op) return ERROR_MEMORY_ALLOCATION;
    op->fn = fn;
    op->arg = arg;
    return fake__enqueue(stream, op);
}

EXPORT int cudaStreamSynchronize(void *stream) {
    fake__log("sync stream=0x%lx", (unsigned long)(uintptr_t)stream);
    fake__drain(stream, "cudaStreamSynchronize");
    return SUCCESS;
}

EXPORT int cudaDeviceSynchronize(void) {
    fake__log("devicesync device=%d", fake__current_device);
    fake__drain_device(fake__current_device, "cudaDeviceSynchronize");
    return SUCCESS;
}

/* ---- events and streams ---- */
typedef struct {
    int id;
    int device;
    fake_op_t *last; /* the last record (a reference); NULL: never recorded */
} fake_event_t;

static _Atomic int next_event_id = 1;
static _Atomic unsigned long next_stream = 0xc0de0000ul;

EXPORT int cudaEventCreateWithFlags(void **event, unsigned int flags) {
    fake_event_t *ev = calloc(1, sizeof *ev);
    if (!ev) return ERROR_MEMORY_ALLOCATION;
    ev->id = atomic_fetch_add(&next_event_id, 1);
    ev->device = fake__current_device;
    atomic_fetch_add(&n_event_create, 1);
    fake__log("eventcreate event=%d device=%d flags=%u", ev->id, ev->device, flags);
    *event = ev;
    return SUCCESS;
}

/* A record still to run completes as usual; only the event goes. */
EXPORT int cudaEventDestroy(void *event) {
    fake_event_t *ev = event;
    if (!ev) return ERROR_INVALID_RESOURCE_HANDLE;
    fake__lock();
    fake__op_put(ev->last);
    fake__unlock();
    free(ev);
    return SUCCESS;
}

EXPORT int cudaEventRecord(void *event, void *stream) {
    fake_event_t *ev = event;
    if (!ev) return ERROR_INVALID_RESOURCE_HANDLE;
    atomic_fetch_add(&n_event_record, 1);
    fake__log("eventrecord event=%d stream=0x%lx", ev->id, (unsigned long)(uintptr_t)stream);
    fake_op_t *op = fake__op_new(OP_RECORD);
    if (!op) return ERROR_MEMORY_ALLOCATION;
    op->refs++; /* the event's */
    int rc = fake__enqueue(stream, op);
    fake__lock();
    if (rc == SUCCESS) {
        fake__op_put(ev->last);
        ev->last = op;
    }
    fake__unlock();
    return rc;
}

/* cudaErrorNotReady while the last record has not run; never recorded: done. */
EXPORT int cudaEventQuery(void *event) {
    fake_event_t *ev = event;
    if (!ev) return ERROR_INVALID_RESOURCE_HANDLE;
    fake__lock();
    int done = !ev->last || ev->last->done;
    fake__unlock();
    return done ? SUCCESS : ERROR_NOT_READY;
}

EXPORT int cudaEventSynchronize(void *event) {
    fake_event_t *ev = event;
    if (!ev) return ERROR_INVALID_RESOURCE_HANDLE;
    fake__lock();
    fake_op_t *last = ev->last;
    if (last) last->refs++;
    fake__unlock();
    if (!last) return ERROR_INVALID_RESOURCE_HANDLE; /* stricter than CUDA: a bug in the caller */
    atomic_fetch_add(&n_event_sync, 1);
    fake__log("eventsync event=%d", ev->id);
    fake__lock();
    fake__wait_done(last, "cudaEventSynchronize");
    fake__op_put(last);
    fake__unlock();
    return SUCCESS;
}

/* The wait is on the event's record as it is now (CUDA's semantics). */
EXPORT int cudaStreamWaitEvent(void *stream, void *event, unsigned int flags) {
    fake_event_t *ev = event;
    if (!ev) return ERROR_INVALID_RESOURCE_HANDLE;
    fake__start();
    fake__lock();
    fake_op_t *target = ev->last;
    if (target) target->refs++;
    fake__unlock();
    if (!target) return ERROR_INVALID_RESOURCE_HANDLE; /* stricter than CUDA: a bug */
    atomic_fetch_add(&n_stream_wait, 1);
    fake__log("streamwait stream=0x%lx event=%d flags=%u", (unsigned long)(uintptr_t)stream, ev->id,
              flags);
    fake_op_t *w = fake__op_new(OP_WAIT);
    if (!w) {
        fake__lock();
        fake__op_put(target);
        fake__unlock();
        return ERROR_MEMORY_ALLOCATION;
    }
    w->target = target;
    return fake__enqueue(stream, w);
}

#define CREATED_KEPT 64
static _Atomic unsigned long created[CREATED_KEPT]; /* the first streams created, in order */

EXPORT int cudaStreamCreateWithFlags(void **stream, unsigned int flags) {
    fake__start();
    unsigned long h = atomic_fetch_add(&next_stream, 1);
    if (h - 0xc0de0000ul < CREATED_KEPT) atomic_store(&created[h - 0xc0de0000ul], h);
    *stream = (void *)(uintptr_t)h;
    fake__lock();
    fake_stream_t *s = fake__stream_of(*stream);
    if (s) s->blocking = !(flags & 1u); /* cudaStreamNonBlocking */
    fake__unlock();
    atomic_fetch_add(&n_stream_create, 1);
    fake__log("streamcreate stream=0x%lx device=%d flags=%u", h, fake__current_device, flags);
    return s ? SUCCESS : ERROR_MEMORY_ALLOCATION;
}

/* ---- for the other test doubles (not CUDA's API; never logged) ------------------------- */
/* The k-th stream cudaStreamCreateWithFlags made in this process (cring's
 * own stream is the first), or 0: for tests that keep it busy. */
EXPORT unsigned long fake_cuda_created_stream(int k) {
    return k >= 0 && k < CREATED_KEPT ? atomic_load(&created[k]) : 0;
}

/* Run fn(arg) on streams[0]'s device thread once every stream of streams[0..n)
 * has run what was enqueued before; the other streams' later work waits for
 * it (a multi-stream NCCL group). 0, or a CUDA error (fn is then not run). */
EXPORT int fake_cuda_enqueue_group(void *const *streams, int n, void (*fn)(void *), void *arg) {
    if (n < 1) return ERROR_INVALID_VALUE;
    fake_op_t *call = fake__op_new(OP_CALL);
    if (!call) return ERROR_MEMORY_ALLOCATION;
    call->fn = fn;
    call->arg = arg;
    return fake__enqueue_group(streams, n, call);
}

EXPORT int fake_cuda_enqueue(void *stream, void (*fn)(void *), void *arg) {
    return fake_cuda_enqueue_group(&stream, 1, fn, arg);
}

/* The host waits for everything enqueued on stream so far (a framework's
 * host read of a tensor, which waits for its current stream). */
EXPORT void fake_cuda_drain(void *stream) { fake__drain(stream, "a framework's host access"); }

/* waiter's later work runs after what waited has enqueued so far. */
EXPORT int fake_cuda_order(void *waiter, void *waited) {
    fake__start();
    fake__lock();
    fake_stream_t *a = fake__stream_of(waiter), *b = fake__stream_of(waited);
    int rc = a && b ? (a == b ? SUCCESS : fake__append_wait(a, b->last)) : ERROR_MEMORY_ALLOCATION;
    fake__unlock();
    return rc;
}

/* A mark of stream's work so far (NULL: none), whether it has all run, and
 * its release: an event a caching allocator records at a free. */
EXPORT void *fake_cuda_mark(void *stream) {
    fake__start();
    fake__lock();
    fake_stream_t *s = fake__stream_of(stream);
    fake_op_t *last = s ? s->last : NULL;
    if (last) last->refs++;
    fake__unlock();
    return last;
}

EXPORT int fake_cuda_reached(void *mark) {
    if (!mark) return 1;
    fake__lock();
    int done = ((fake_op_t *)mark)->done;
    fake__unlock();
    return done;
}

EXPORT void fake_cuda_unmark(void *mark) {
    fake__lock();
    fake__op_put(mark);
    fake__unlock();
}

/* A "kernel" of the framework's: after delay_us, value written over
 * dst[0..bytes) (bytes 0: only the time). */
EXPORT int fake_cuda_kernel(void *stream, void *dst, int value, size_t bytes, unsigned delay_us) {
    fake_op_t *op = fake__op_new(OP_KERNEL);
    if (!op) return ERROR_MEMORY_ALLOCATION;
    op->dst = dst;
    op->value = value;
    op->bytes = bytes;
    op->delay_us = delay_us;
    return fake__enqueue(stream, op);
}

/* fake_cudart.c: a test double for libcudart that orders work as a GPU does,
 * built as a shared library and loaded through CRING_CUDART_LIBRARY by the CPU
 * tests. "Device memory" is host memory. It must never be kinder than a GPU
 * where correctness depends on ordering; it is never used outside tests.
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
 * poisoned when its stream reaches the free, and the next cudaMallocAsync of
 * the same stream may take it at once (as CUDA's pools do).
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
 * "event_create").
 *
 * For the other test doubles (not CUDA's API, never logged): fake_nccl.c
 * enqueues its collectives with fake_cuda_enqueue_group; the tests' framework
 * stand-ins (tests/gpu/fake_cuda.py) read and write "device memory" from the
 * host after fake_cuda_drain(stream), hand work between streams with
 * fake_cuda_order, track a freed block's streams with fake_cuda_mark /
 * fake_cuda_reached / fake_cuda_unmark, and queue slow "kernels" with
 * fake_cuda_kernel (on cring's own stream too: fake_cuda_created_stream).
 *   CRING_FAKE_CUDA_DEVICES   device count (default 1); "error": no driver
 *   CRING_FAKE_CUDA_DELAY_US  largest random delay before an operation (50)
 *   CRING_FAKE_CUDA_HANG_S    a host wait longer than this prints the streams'
 *                             state to stderr once (default 60) */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

enum {
    SUCCESS = 0,
    ERROR_INVALID_VALUE = 1,
    ERROR_MEMORY_ALLOCATION = 2,
    ERROR_INSUFFICIENT_DRIVER = 35,
    ERROR_INVALID_DEVICE = 101,
    ERROR_INVALID_RESOURCE_HANDLE = 400,
    ERROR_NOT_READY = 600,
};
enum { H2D = 1, D2H = 2, D2D = 3 };

static void log_line(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void log_line(const char *fmt, ...) {
    const char *path = getenv("CRING_FAKE_CUDA_LOG");
    if (!path || !*path) return;
    char line[512];
    int n = snprintf(line, sizeof line, "pid=%d ", (int)getpid());
    va_list ap;
    va_start(ap, fmt);
    n += vsnprintf(line + n, sizeof line - (size_t)n - 1, fmt, ap);
    va_end(ap);
    if (n > (int)sizeof line - 2) n = (int)sizeof line - 2;
    line[n++] = '\n';
    int fd = open(path, O_WRONLY | O_APPEND | O_CREAT, 0644);
    if (fd < 0) return;
    ssize_t w = write(fd, line, (size_t)n); /* one write: lines of processes never interleave */
    (void)w;
    close(fd);
}

static int device_count(void) {
    const char *s = getenv("CRING_FAKE_CUDA_DEVICES");
    if (!s || !*s) return 1;
    if (!strcmp(s, "error")) return -1;
    return atoi(s);
}

static __thread int current_device = 0;

static _Atomic long n_event_record, n_stream_wait, n_event_sync, n_memcpy_d2d, n_stream_create,
    n_event_create;

EXPORT long fake_cuda_count(const char *what) {
    if (!strcmp(what, "event_record")) return atomic_load(&n_event_record);
    if (!strcmp(what, "stream_wait")) return atomic_load(&n_stream_wait);
    if (!strcmp(what, "event_sync")) return atomic_load(&n_event_sync);
    if (!strcmp(what, "memcpy_d2d")) return atomic_load(&n_memcpy_d2d);
    if (!strcmp(what, "stream_create")) return atomic_load(&n_stream_create);
    if (!strcmp(what, "event_create")) return atomic_load(&n_event_create);
    return -1;
}

/* ---- the device: operations, streams, their threads ------------------------------------- */
enum { OP_COPY, OP_SET, OP_RECORD, OP_WAIT, OP_CALL, OP_KERNEL };

typedef struct op op_t;
typedef struct stream stream_t;

/* One operation of a stream. Referenced by its stream until it has run, by
 * an event's last record, by WAIT operations and by host waits. */
struct op {
    int kind;
    int refs;   /* under mu */
    int done;   /* under mu */
    op_t *next; /* the stream's queue */
    stream_t *stream;
    void *dst; /* COPY, SET, KERNEL */
    const void *src;
    size_t bytes;
    int value;         /* SET, KERNEL */
    unsigned delay_us; /* KERNEL */
    void *staging;     /* COPY from pageable memory: freed once it has run */
    op_t *target;      /* WAIT: the operation waited for (a reference) */
    void (*fn)(void *);
    void *arg; /* CALL */
};

struct stream {
    uintptr_t handle; /* 0 for a legacy default stream */
    int device;
    int blocking;      /* synchronises with the legacy default stream */
    int number;        /* order of first use in this process (seeds its delays) */
    op_t *head, *tail; /* not yet run; head is running or next */
    op_t *last;        /* the last operation enqueued (a reference), NULL when none */
    int has_thread;
    pthread_cond_t work;
    uint64_t rng;
    stream_t *next;
};

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t done_cv = PTHREAD_COND_INITIALIZER;
static stream_t *streams; /* under mu */
static int nstreams;
static unsigned long seed;
static unsigned delay_max_us = 50;
static double hang_s = 60;
static pthread_once_t init_once = PTHREAD_ONCE_INIT;

static uint64_t splitmix(uint64_t *x) {
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static void after_fork_child(void);
static void lock(void) { pthread_mutex_lock(&mu); }
static void unlock(void) { pthread_mutex_unlock(&mu); }

static void init(void) {
    const char *s = getenv("CRING_FAKE_CUDA_SEED");
    if (s && *s) seed = strtoul(s, NULL, 10);
    else {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        seed = ((unsigned long)ts.tv_nsec ^ ((unsigned long)getpid() << 20)) % 1000000000ul;
    }
    const char *d = getenv("CRING_FAKE_CUDA_DELAY_US");
    if (d && *d) delay_max_us = (unsigned)strtoul(d, NULL, 10);
    const char *h = getenv("CRING_FAKE_CUDA_HANG_S");
    if (h && *h) hang_s = atof(h);
    pthread_atfork(lock, unlock, after_fork_child);
    log_line("fake GPU seed=%lu delay_us=%u (CRING_FAKE_CUDA_SEED=%lu replays it)", seed,
             delay_max_us, seed);
}

EXPORT unsigned long fake_cuda_seed(void) {
    pthread_once(&init_once, init);
    return seed;
}

static void op_put(op_t *op) { /* under mu */
    if (!op || --op->refs > 0) return;
    if (op->target) op_put(op->target);
    free(op->staging);
    free(op);
}

static op_t *op_new(int kind) {
    op_t *op = calloc(1, sizeof *op);
    if (op) {
        op->kind = kind;
        op->refs = 1; /* the stream's, until it has run */
    }
    return op;
}

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void sleep_us(unsigned us) {
    if (!us) return;
    struct timespec ts = {us / 1000000, (long)(us % 1000000) * 1000};
    while (nanosleep(&ts, &ts) != 0 && errno == EINTR) {
    }
}

static void dump_streams(const char *why) { /* under mu */
    fprintf(stderr, "fake cudart (pid %d, seed %lu): %s; streams:\n", (int)getpid(), seed, why);
    for (stream_t *s = streams; s; s = s->next) {
        int pending = 0;
        for (op_t *op = s->head; op; op = op->next) pending++;
        fprintf(stderr, "  stream 0x%lx device %d: %d pending, next kind %d\n",
                (unsigned long)s->handle, s->device, pending, s->head ? s->head->kind : -1);
    }
}

/* Wait (under mu) until op has run. */
static void wait_done(op_t *op, const char *what) {
    double start = now_s();
    int told = 0;
    while (!op->done) {
        struct timespec until;
        clock_gettime(CLOCK_REALTIME, &until);
        until.tv_sec += 1;
        pthread_cond_timedwait(&done_cv, &mu, &until);
        if (!told && hang_s > 0 && now_s() - start > hang_s) {
            dump_streams(what);
            told = 1;
        }
    }
}

static void run_op(op_t *op) {
    switch (op->kind) {
    case OP_COPY:
        if (op->bytes) memmove(op->dst, op->staging ? op->staging : op->src, op->bytes);
        break;
    case OP_SET: memset(op->dst, op->value, op->bytes); break;
    case OP_KERNEL:
        sleep_us(op->delay_us);
        if (op->bytes) memset(op->dst, op->value, op->bytes);
        break;
    case OP_CALL: op->fn(op->arg); break;
    default: break;
    }
}

static void *device_thread(void *arg) {
    stream_t *s = arg;
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL); /* signals go to the program's threads */
    prctl(PR_SET_TIMERSLACK, 1000ul);       /* microsecond delays, not 50 us ones */
    lock();
    for (;;) {
        while (!s->head) pthread_cond_wait(&s->work, &mu);
        op_t *op = s->head;
        unsigned delay = delay_max_us ? (unsigned)(splitmix(&s->rng) % (delay_max_us + 1)) : 0;
        unlock();
        sleep_us(delay);
        lock();
        if (op->kind == OP_WAIT) wait_done(op->target, "a stream waits for an event");
        unlock();
        run_op(op);
        lock();
        op->done = 1;
        s->head = op->next;
        if (!s->head) s->tail = NULL;
        pthread_cond_broadcast(&done_cv);
        op_put(op);
    }
    return NULL;
}

/* The stream a handle names (created at first use), under mu. NULL and
 * cudaStreamLegacy (1) are the legacy default stream of the current device. */
static stream_t *stream_of(void *handle) {
    uintptr_t h = (uintptr_t)handle;
    int legacy = h == 0 || h == 1;
    for (stream_t *s = streams; s; s = s->next)
        if (legacy ? (s->handle == 0 && s->device == current_device) : s->handle == h) return s;
    stream_t *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->handle = legacy ? 0 : h;
    s->device = current_device;
    s->blocking = 0;
    s->number = nstreams++;
    const char *rank = getenv("CRING_RANK");
    s->rng = seed ^ ((uint64_t)(rank ? atoi(rank) + 1 : 0) << 40) ^ ((uint64_t)s->number << 20);
    pthread_cond_init(&s->work, NULL);
    s->next = streams;
    streams = s;
    return s;
}

static stream_t *legacy_of(int device) {
    int saved = current_device;
    current_device = device;
    stream_t *s = stream_of(NULL);
    current_device = saved;
    return s;
}

/* Append op to s (under mu); s takes op's reference. */
static int append(stream_t *s, op_t *op) {
    if (!s->has_thread) {
        pthread_t t;
        pthread_attr_t attr;
        pthread_attr_init(&attr);
        pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        int rc = pthread_create(&t, &attr, device_thread, s);
        pthread_attr_destroy(&attr);
        if (rc != 0) return ERROR_MEMORY_ALLOCATION;
        s->has_thread = 1;
    }
    op->stream = s;
    if (s->tail) s->tail->next = op;
    else s->head = op;
    s->tail = op;
    op->refs++; /* as the stream's last */
    op_put(s->last);
    s->last = op;
    pthread_cond_signal(&s->work);
    return SUCCESS;
}

/* A wait on s for target (no-op when it has run), under mu. */
static int append_wait(stream_t *s, op_t *target) {
    if (!target || target->done) return SUCCESS;
    op_t *w = op_new(OP_WAIT);
    if (!w) return ERROR_MEMORY_ALLOCATION;
    target->refs++;
    w->target = target;
    return append(s, w);
}

/* Enqueue op on the stream named by handle, with the legacy default stream's
 * implicit ordering. Takes op (freed on failure). */
static int enqueue(void *handle, op_t *op) {
    if (!op) return ERROR_MEMORY_ALLOCATION;
    pthread_once(&init_once, init);
    lock();
    stream_t *s = stream_of(handle);
    int rc = s ? SUCCESS : ERROR_MEMORY_ALLOCATION;
    if (rc == SUCCESS && s->handle == 0) { /* legacy: after every blocking stream */
        for (stream_t *b = streams; b && rc == SUCCESS; b = b->next)
            if (b->blocking && b->device == s->device) rc = append_wait(s, b->last);
    } else if (rc == SUCCESS && s->blocking) { /* blocking: after the legacy stream */
        rc = append_wait(s, legacy_of(s->device)->last);
    }
    if (rc == SUCCESS) rc = append(s, op);
    else op_put(op);
    unlock();
    return rc;
}

/* The host waits until everything enqueued on handle's stream so far has run. */
static void drain(void *handle, const char *why) {
    pthread_once(&init_once, init);
    lock();
    stream_t *s = stream_of(handle);
    op_t *last = s ? s->last : NULL;
    if (last) {
        last->refs++;
        wait_done(last, why);
        op_put(last);
    }
    unlock();
}

/* The host waits for every stream of device (-1: of every device). */
static void drain_device(int device, const char *why) {
    pthread_once(&init_once, init);
    lock();
    int n = 0;
    for (stream_t *s = streams; s; s = s->next) n++;
    op_t **lasts = calloc((size_t)n + 1, sizeof *lasts);
    int k = 0;
    for (stream_t *s = streams; s && lasts; s = s->next)
        if (s->last && (device < 0 || s->device == device)) {
            s->last->refs++;
            lasts[k++] = s->last;
        }
    for (int i = 0; i < k; i++) {
        wait_done(lasts[i], why);
        op_put(lasts[i]);
    }
    free(lasts);
    unlock();
}

/* In a child after fork: the device threads are gone. Work the parent left
 * queued is dropped (marked done so nothing waits on it); the streams start
 * afresh in this process. */
static void after_fork_child(void) {
    pthread_cond_init(&done_cv, NULL);
    for (stream_t *s = streams; s; s = s->next) {
        for (op_t *op = s->head; op; op = op->next) op->done = 1;
        s->head = s->tail = NULL;
        s->has_thread = 0;
        pthread_cond_init(&s->work, NULL);
    }
    unlock();
}

/* ---- the runtime's API ------------------------------------------------------------------ */
EXPORT int cudaGetDeviceCount(int *count) {
    int n = device_count();
    *count = n > 0 ? n : 0;
    return n < 0 ? ERROR_INSUFFICIENT_DRIVER : SUCCESS;
}

EXPORT int cudaGetDevice(int *device) {
    *device = current_device;
    return SUCCESS;
}

EXPORT int cudaSetDevice(int device) {
    if (device < 0 || device >= device_count()) return ERROR_INVALID_DEVICE;
    current_device = device;
    log_line("setdevice %d", device);
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
    pthread_once(&init_once, init);
    *ptr = aligned_alloc(64, (bytes + 63) / 64 * 64);
    pinned_t *b = *ptr ? malloc(sizeof *b) : NULL;
    if (*ptr && !b) {
        free(*ptr);
        *ptr = NULL;
    }
    if (b) {
        lock();
        *b = (pinned_t){*ptr, bytes, pinned_blocks};
        pinned_blocks = b;
        unlock();
    }
    log_line("hostalloc bytes=%zu flags=%u", bytes, flags);
    return *ptr ? SUCCESS : ERROR_MEMORY_ALLOCATION;
}

/* cudaFreeHost synchronises the device first, as CUDA's does. */
EXPORT int cudaFreeHost(void *ptr) {
    drain_device(-1, "cudaFreeHost waits for the device");
    lock();
    for (pinned_t **link = &pinned_blocks; *link; link = &(*link)->next)
        if ((*link)->ptr == ptr) {
            pinned_t *b = *link;
            *link = b->next;
            free(b);
            break;
        }
    unlock();
    free(ptr);
    log_line("freehost");
    return SUCCESS;
}

EXPORT int cudaMemcpyAsync(void *dst, const void *src, size_t bytes, int kind, void *stream) {
    pthread_once(&init_once, init);
    if (kind == D2D) atomic_fetch_add(&n_memcpy_d2d, 1);
    log_line("memcpy kind=%s bytes=%zu stream=0x%lx",
             kind == H2D   ? "H2D"
             : kind == D2H ? "D2H"
             : kind == D2D ? "D2D"
                           : "other",
             bytes, (unsigned long)(uintptr_t)stream);
    op_t *op = op_new(OP_COPY);
    if (!op) return ERROR_MEMORY_ALLOCATION;
    op->dst = dst;
    op->src = src;
    op->bytes = bytes;
    lock();
    int pageable =
        (kind == H2D && !is_pinned(src, bytes)) || (kind == D2H && !is_pinned(dst, bytes));
    unlock();
    if (pageable && kind == H2D) { /* CUDA syncs the stream, then stages the source */
        drain(stream, "a copy from pageable memory waits for its stream");
        op->staging = malloc(bytes ? bytes : 1);
        if (!op->staging) {
            free(op);
            return ERROR_MEMORY_ALLOCATION;
        }
        memcpy(op->staging, src, bytes);
    }
    if (pageable && kind == D2H) op->refs++; /* the host waits for it below */
    int rc = enqueue(stream, op);
    if (rc == SUCCESS && pageable && kind == D2H) {
        lock();
        wait_done(op, "a copy to pageable memory");
        op_put(op);
        unlock();
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
    header_t h = {bytes, capacity, current_device};
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
    lock();
    void *old = quarantine[quarantine_next];
    quarantine[quarantine_next] = (unsigned char *)ptr - FAKE_HEADER;
    quarantine_next = (quarantine_next + 1) % QUARANTINE;
    unlock();
    free(old);
}

EXPORT int cudaMalloc(void **ptr, size_t bytes) {
    pthread_once(&init_once, init);
    *ptr = new_block(bytes);
    log_line("malloc device=%d bytes=%zu", current_device, bytes);
    return *ptr ? SUCCESS : ERROR_MEMORY_ALLOCATION;
}

/* cudaFree synchronises the device (CUDA's does), then poisons the block. */
EXPORT int cudaFree(void *ptr) {
    if (ptr) {
        drain_device(header_of(ptr).device, "cudaFree waits for the device");
        free_block_poisoned(ptr);
    }
    log_line("free");
    return SUCCESS;
}

/* Stream-ordered allocation: blocks freed on a stream (their free queued,
 * perhaps not yet run) serve that stream's next allocations at once. */
typedef struct pooled {
    void *ptr;
    uintptr_t stream;
    struct pooled *next;
} pooled_t;
static pooled_t *pool; /* under mu */

EXPORT int cudaMallocAsync(void **ptr, size_t bytes, void *stream) {
    pthread_once(&init_once, init);
    *ptr = NULL;
    lock();
    for (pooled_t **link = &pool; *link; link = &(*link)->next) {
        header_t h = header_of((*link)->ptr);
        if ((*link)->stream == (uintptr_t)stream && h.capacity >= bytes &&
            h.capacity <= 2 * bytes + 4096) {
            pooled_t *p = *link;
            *link = p->next;
            *ptr = p->ptr;
            h.bytes = bytes;
            memcpy((unsigned char *)*ptr - FAKE_HEADER, &h, sizeof h);
            free(p);
            break;
        }
    }
    unlock();
    if (!*ptr) *ptr = new_block(bytes);
    log_line("mallocasync bytes=%zu stream=0x%lx", bytes, (unsigned long)(uintptr_t)stream);
    return *ptr ? SUCCESS : ERROR_MEMORY_ALLOCATION;
}

EXPORT int cudaFreeAsync(void *ptr, void *stream) {
    log_line("freeasync stream=0x%lx", (unsigned long)(uintptr_t)stream);
    if (!ptr) return SUCCESS;
    pooled_t *p = malloc(sizeof *p);
    op_t *op = op_new(OP_SET); /* poison when the stream reaches the free */
    if (!p || !op) {
        free(p);
        free(op);
        return ERROR_MEMORY_ALLOCATION;
    }
    op->dst = ptr;
    op->value = FAKE_FREED;
    op->bytes = header_of(ptr).capacity;
    int rc = enqueue(stream, op);
    if (rc != SUCCESS) {
        free(p);
        return rc;
    }
    lock();
    *p = (pooled_t){ptr, (uintptr_t)stream, pool};
    pool = p;
    unlock();
    return SUCCESS;
}

EXPORT int cudaMemsetAsync(void *ptr, int value, size_t bytes, void *stream) {
    log_line("memset bytes=%zu stream=0x%lx", bytes, (unsigned long)(uintptr_t)stream);
    op_t *op = op_new(OP_SET);
    if (!op) return ERROR_MEMORY_ALLOCATION;
    op->dst = ptr;
    op->value = value;
    op->bytes = bytes;
    return enqueue(stream, op);
}

EXPORT int cudaLaunchHostFunc(void *stream, void (*fn)(void *), void *arg) {
    log_line("hostfunc stream=0x%lx", (unsigned long)(uintptr_t)stream);
    op_t *op = op_new(OP_CALL);
    if (!op) return ERROR_MEMORY_ALLOCATION;
    op->fn = fn;
    op->arg = arg;
    return enqueue(stream, op);
}

EXPORT int cudaStreamSynchronize(void *stream) {
    log_line("sync stream=0x%lx", (unsigned long)(uintptr_t)stream);
    drain(stream, "cudaStreamSynchronize");
    return SUCCESS;
}

EXPORT int cudaDeviceSynchronize(void) {
    log_line("devicesync device=%d", current_device);
    drain_device(current_device, "cudaDeviceSynchronize");
    return SUCCESS;
}

/* ---- events and streams ---- */
typedef struct {
    int id;
    int device;
    op_t *last; /* the last record (a reference); NULL: never recorded */
} fake_event_t;

static _Atomic int next_event_id = 1;
static _Atomic unsigned long next_stream = 0xc0de0000ul;

EXPORT int cudaEventCreateWithFlags(void **event, unsigned int flags) {
    fake_event_t *ev = calloc(1, sizeof *ev);
    if (!ev) return ERROR_MEMORY_ALLOCATION;
    ev->id = atomic_fetch_add(&next_event_id, 1);
    ev->device = current_device;
    atomic_fetch_add(&n_event_create, 1);
    log_line("eventcreate event=%d device=%d flags=%u", ev->id, ev->device, flags);
    *event = ev;
    return SUCCESS;
}

/* A record still to run completes as usual; only the event goes. */
EXPORT int cudaEventDestroy(void *event) {
    fake_event_t *ev = event;
    if (!ev) return ERROR_INVALID_RESOURCE_HANDLE;
    lock();
    op_put(ev->last);
    unlock();
    free(ev);
    return SUCCESS;
}

EXPORT int cudaEventRecord(void *event, void *stream) {
    fake_event_t *ev = event;
    if (!ev) return ERROR_INVALID_RESOURCE_HANDLE;
    atomic_fetch_add(&n_event_record, 1);
    log_line("eventrecord event=%d stream=0x%lx", ev->id, (unsigned long)(uintptr_t)stream);
    op_t *op = op_new(OP_RECORD);
    if (!op) return ERROR_MEMORY_ALLOCATION;
    op->refs++; /* the event's */
    int rc = enqueue(stream, op);
    lock();
    if (rc == SUCCESS) {
        op_put(ev->last);
        ev->last = op;
    }
    unlock();
    return rc;
}

/* cudaErrorNotReady while the last record has not run; never recorded: done. */
EXPORT int cudaEventQuery(void *event) {
    fake_event_t *ev = event;
    if (!ev) return ERROR_INVALID_RESOURCE_HANDLE;
    lock();
    int done = !ev->last || ev->last->done;
    unlock();
    return done ? SUCCESS : ERROR_NOT_READY;
}

EXPORT int cudaEventSynchronize(void *event) {
    fake_event_t *ev = event;
    if (!ev) return ERROR_INVALID_RESOURCE_HANDLE;
    lock();
    op_t *last = ev->last;
    if (last) last->refs++;
    unlock();
    if (!last) return ERROR_INVALID_RESOURCE_HANDLE; /* stricter than CUDA: a bug in the caller */
    atomic_fetch_add(&n_event_sync, 1);
    log_line("eventsync event=%d", ev->id);
    lock();
    wait_done(last, "cudaEventSynchronize");
    op_put(last);
    unlock();
    return SUCCESS;
}

/* The wait is on the event's record as it is now (CUDA's semantics). */
EXPORT int cudaStreamWaitEvent(void *stream, void *event, unsigned int flags) {
    fake_event_t *ev = event;
    if (!ev) return ERROR_INVALID_RESOURCE_HANDLE;
    pthread_once(&init_once, init);
    lock();
    op_t *target = ev->last;
    if (target) target->refs++;
    unlock();
    if (!target) return ERROR_INVALID_RESOURCE_HANDLE; /* stricter than CUDA: a bug */
    atomic_fetch_add(&n_stream_wait, 1);
    log_line("streamwait stream=0x%lx event=%d flags=%u", (unsigned long)(uintptr_t)stream, ev->id,
             flags);
    op_t *w = op_new(OP_WAIT);
    if (!w) {
        lock();
        op_put(target);
        unlock();
        return ERROR_MEMORY_ALLOCATION;
    }
    w->target = target;
    return enqueue(stream, w);
}

#define CREATED_KEPT 64
static _Atomic unsigned long created[CREATED_KEPT]; /* the first streams created, in order */

EXPORT int cudaStreamCreateWithFlags(void **stream, unsigned int flags) {
    pthread_once(&init_once, init);
    unsigned long h = atomic_fetch_add(&next_stream, 1);
    if (h - 0xc0de0000ul < CREATED_KEPT) atomic_store(&created[h - 0xc0de0000ul], h);
    *stream = (void *)(uintptr_t)h;
    lock();
    stream_t *s = stream_of(*stream);
    if (s) s->blocking = !(flags & 1u); /* cudaStreamNonBlocking */
    unlock();
    atomic_fetch_add(&n_stream_create, 1);
    log_line("streamcreate stream=0x%lx device=%d flags=%u", h, current_device, flags);
    return s ? SUCCESS : ERROR_MEMORY_ALLOCATION;
}

/* ---- for the other test doubles (not CUDA's API; never logged) ------------------------- */
/* The k-th stream cudaStreamCreateWithFlags made in this process (cring's
 * own stream is the first), or 0: for tests that keep it busy. */
EXPORT unsigned long fake_cuda_created_stream(int k) {
    return k >= 0 && k < CREATED_KEPT ? atomic_load(&created[k]) : 0;
}

typedef struct {
    void (*fn)(void *);
    void *arg;
} call_t;

/* Run fn(arg) on streams[0]'s device thread once every stream of streams[0..n)
 * has run what was enqueued before; the other streams' later work waits for
 * it (a multi-stream NCCL group). 0, or a CUDA error (fn is then not run). */
EXPORT int fake_cuda_enqueue_group(void *const *streams_in, int n, void (*fn)(void *), void *arg) {
    pthread_once(&init_once, init);
    if (n < 1) return ERROR_INVALID_VALUE;
    op_t *call = op_new(OP_CALL);
    if (!call) return ERROR_MEMORY_ALLOCATION;
    call->fn = fn;
    call->arg = arg;
    lock();
    stream_t *first = stream_of(streams_in[0]);
    int rc = first ? SUCCESS : ERROR_MEMORY_ALLOCATION;
    for (int i = 1; i < n && rc == SUCCESS; i++) {
        stream_t *other = stream_of(streams_in[i]);
        if (!other) rc = ERROR_MEMORY_ALLOCATION;
        else if (other != first) rc = append_wait(first, other->last);
    }
    if (rc == SUCCESS && first->handle == 0) {
        for (stream_t *b = streams; b && rc == SUCCESS; b = b->next)
            if (b->blocking && b->device == first->device) rc = append_wait(first, b->last);
    } else if (rc == SUCCESS && first->blocking) {
        rc = append_wait(first, legacy_of(first->device)->last);
    }
    if (rc == SUCCESS) rc = append(first, call);
    else op_put(call);
    for (int i = 1; i < n && rc == SUCCESS; i++) {
        stream_t *other = stream_of(streams_in[i]);
        if (other != first) rc = append_wait(other, call);
    }
    unlock();
    return rc;
}

EXPORT int fake_cuda_enqueue(void *stream, void (*fn)(void *), void *arg) {
    return fake_cuda_enqueue_group(&stream, 1, fn, arg);
}

/* The host waits for everything enqueued on stream so far (a framework's
 * host read of a tensor, which waits for its current stream). */
EXPORT void fake_cuda_drain(void *stream) { drain(stream, "a framework's host access"); }

/* waiter's later work runs after what waited has enqueued so far. */
EXPORT int fake_cuda_order(void *waiter, void *waited) {
    pthread_once(&init_once, init);
    lock();
    stream_t *a = stream_of(waiter), *b = stream_of(waited);
    int rc = a && b ? (a == b ? SUCCESS : append_wait(a, b->last)) : ERROR_MEMORY_ALLOCATION;
    unlock();
    return rc;
}

/* A mark of stream's work so far (NULL: none), whether it has all run, and
 * its release: an event a caching allocator records at a free. */
EXPORT void *fake_cuda_mark(void *stream) {
    pthread_once(&init_once, init);
    lock();
    stream_t *s = stream_of(stream);
    op_t *last = s ? s->last : NULL;
    if (last) last->refs++;
    unlock();
    return last;
}

EXPORT int fake_cuda_reached(void *mark) {
    if (!mark) return 1;
    lock();
    int done = ((op_t *)mark)->done;
    unlock();
    return done;
}

EXPORT void fake_cuda_unmark(void *mark) {
    lock();
    op_put(mark);
    unlock();
}

/* A "kernel" of the framework's: after delay_us, value written over
 * dst[0..bytes) (bytes 0: only the time). */
EXPORT int fake_cuda_kernel(void *stream, void *dst, int value, size_t bytes, unsigned delay_us) {
    op_t *op = op_new(OP_KERNEL);
    if (!op) return ERROR_MEMORY_ALLOCATION;
    op->dst = dst;
    op->value = value;
    op->bytes = bytes;
    op->delay_us = delay_us;
    return enqueue(stream, op);
}

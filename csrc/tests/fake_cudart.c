/* fake_cudart.c: a test double for libcudart, built as a shared library and
 * loaded through CRING_CUDART_LIBRARY by the CPU tests. "Device memory" is
 * host memory, streams are opaque numbers, and each call cring makes is
 * appended to $CRING_FAKE_CUDA_LOG so tests can check what was asked of the
 * runtime (copy direction, bytes, stream). Events are numbered and remember
 * whether they were recorded (a wait on one that never was fails); streams
 * cring creates are numbers from 0xc0de0000. Call counters for C tests:
 * fake_cuda_count("event_record" | "stream_wait" | "event_sync" | "memcpy_d2d"
 * | "stream_create" | "event_create" | "malloc" | "free" | "malloc_async" |
 * "free_async"). Never used outside tests.
 *   CRING_FAKE_CUDA_DEVICES  device count (default 1); "error": no driver
 *   CRING_FAKE_CUDA_ASYNC_ALLOC  "unsupported": cudaMallocAsync answers
 *                            cudaErrorNotSupported, as on a device without
 *                            memory pools */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <fcntl.h>
#include <stdatomic.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

enum {
    SUCCESS = 0,
    ERROR_MEMORY_ALLOCATION = 2,
    ERROR_INSUFFICIENT_DRIVER = 35,
    ERROR_INVALID_DEVICE = 101,
    ERROR_INVALID_RESOURCE_HANDLE = 400,
    ERROR_NOT_SUPPORTED = 801,
};

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
    n_event_create, n_malloc, n_free, n_malloc_async, n_free_async;

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
    case ERROR_MEMORY_ALLOCATION: return "out of memory";
    case ERROR_INSUFFICIENT_DRIVER:
        return "CUDA driver version is insufficient for CUDA runtime version";
    case ERROR_INVALID_DEVICE: return "invalid device ordinal";
    case ERROR_INVALID_RESOURCE_HANDLE: return "invalid resource handle";
    case ERROR_NOT_SUPPORTED: return "operation not supported";
    default: return "unknown error";
    }
}

EXPORT int cudaHostAlloc(void **ptr, size_t bytes, unsigned int flags) {
    *ptr = aligned_alloc(64, (bytes + 63) / 64 * 64);
    log_line("hostalloc bytes=%zu flags=%u", bytes, flags);
    return *ptr ? SUCCESS : ERROR_MEMORY_ALLOCATION;
}

EXPORT int cudaFreeHost(void *ptr) {
    free(ptr);
    log_line("freehost");
    return SUCCESS;
}

EXPORT int cudaMemcpyAsync(void *dst, const void *src, size_t bytes, int kind, void *stream) {
    memmove(dst, src, bytes);
    if (kind == 3) atomic_fetch_add(&n_memcpy_d2d, 1);
    log_line("memcpy kind=%s bytes=%zu stream=0x%lx",
             kind == 1   ? "H2D"
             : kind == 2 ? "D2H"
             : kind == 3 ? "D2D"
                         : "other",
             bytes, (unsigned long)(uintptr_t)stream);
    return SUCCESS;
}

/* Device memory is host memory here, filled with 0xA5 so a result that was
 * never written shows. cudaFree overwrites the block with 0xDB before it
 * releases it, so a result read after its memory was freed shows too (a
 * header before the block remembers its size). */
#define FAKE_HEADER 256 /* keeps the block 256-byte aligned */
#define FAKE_FREED 0xDB
static void *device_block(size_t bytes) {
    unsigned char *base = aligned_alloc(256, FAKE_HEADER + (bytes + 255) / 256 * 256);
    if (!base) return NULL;
    memcpy(base, &bytes, sizeof bytes);
    memset(base + FAKE_HEADER, 0xA5, bytes);
    return base + FAKE_HEADER;
}

static void device_block_free(void *ptr) {
    if (!ptr) return;
    unsigned char *base = (unsigned char *)ptr - FAKE_HEADER;
    size_t bytes;
    memcpy(&bytes, base, sizeof bytes);
    memset(ptr, FAKE_FREED, bytes);
    free(base);
}

EXPORT int cudaMalloc(void **ptr, size_t bytes) {
    *ptr = device_block(bytes);
    atomic_fetch_add(&n_malloc, 1);
    log_line("malloc device=%d bytes=%zu", current_device, bytes);
    return *ptr ? SUCCESS : ERROR_MEMORY_ALLOCATION;
}

EXPORT int cudaFree(void *ptr) {
    device_block_free(ptr);
    atomic_fetch_add(&n_free, 1);
    log_line("free");
    return SUCCESS;
}

/* Stream-ordered allocation (CUDA 11.2): the memory is valid from the
 * allocation's position in the stream on, and freed (poisoned) when the
 * stream reaches the free. Streams here run work when it is queued, so both
 * happen at the call. */
EXPORT int cudaMallocAsync(void **ptr, size_t bytes, void *stream) {
    const char *mode = getenv("CRING_FAKE_CUDA_ASYNC_ALLOC");
    *ptr = NULL;
    if (mode && !strcmp(mode, "unsupported")) return ERROR_NOT_SUPPORTED;
    *ptr = device_block(bytes);
    atomic_fetch_add(&n_malloc_async, 1);
    log_line("mallocasync device=%d bytes=%zu stream=0x%lx", current_device, bytes,
             (unsigned long)(uintptr_t)stream);
    return *ptr ? SUCCESS : ERROR_MEMORY_ALLOCATION;
}

EXPORT int cudaFreeAsync(void *ptr, void *stream) {
    device_block_free(ptr);
    atomic_fetch_add(&n_free_async, 1);
    log_line("freeasync stream=0x%lx", (unsigned long)(uintptr_t)stream);
    return SUCCESS;
}

EXPORT int cudaMemsetAsync(void *ptr, int value, size_t bytes, void *stream) {
    memset(ptr, value, bytes);
    log_line("memset bytes=%zu stream=0x%lx", bytes, (unsigned long)(uintptr_t)stream);
    return SUCCESS;
}

EXPORT int cudaStreamSynchronize(void *stream) {
    log_line("sync stream=0x%lx", (unsigned long)(uintptr_t)stream);
    return SUCCESS;
}

/* ---- events and streams ---- */
typedef struct {
    int id;
    int device;
    int recorded;
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

EXPORT int cudaEventDestroy(void *event) {
    free(event);
    return SUCCESS;
}

EXPORT int cudaEventRecord(void *event, void *stream) {
    fake_event_t *ev = event;
    if (!ev) return ERROR_INVALID_RESOURCE_HANDLE;
    ev->recorded = 1;
    atomic_fetch_add(&n_event_record, 1);
    log_line("eventrecord event=%d stream=0x%lx", ev->id, (unsigned long)(uintptr_t)stream);
    return SUCCESS;
}

EXPORT int cudaEventQuery(void *event) {
    return event ? SUCCESS : ERROR_INVALID_RESOURCE_HANDLE; /* work here is done when enqueued */
}

EXPORT int cudaEventSynchronize(void *event) {
    fake_event_t *ev = event;
    if (!ev || !ev->recorded) return ERROR_INVALID_RESOURCE_HANDLE;
    atomic_fetch_add(&n_event_sync, 1);
    log_line("eventsync event=%d", ev->id);
    return SUCCESS;
}

EXPORT int cudaStreamWaitEvent(void *stream, void *event, unsigned int flags) {
    fake_event_t *ev = event;
    if (!ev || !ev->recorded) return ERROR_INVALID_RESOURCE_HANDLE;
    atomic_fetch_add(&n_stream_wait, 1);
    log_line("streamwait stream=0x%lx event=%d flags=%u", (unsigned long)(uintptr_t)stream, ev->id,
             flags);
    return SUCCESS;
}

EXPORT int cudaStreamCreateWithFlags(void **stream, unsigned int flags) {
    unsigned long s = atomic_fetch_add(&next_stream, 1);
    *stream = (void *)(uintptr_t)s;
    atomic_fetch_add(&n_stream_create, 1);
    log_line("streamcreate stream=0x%lx device=%d flags=%u", s, current_device, flags);
    return SUCCESS;
}

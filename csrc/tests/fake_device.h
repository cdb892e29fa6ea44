/* fake_device.h: the fake GPU's device (fake_device.c) as the fake CUDA
 * runtime (fake_cudart.c) uses it; the two are built into libfake_cudart.so
 * together. For those two files only; never used outside tests. */
#ifndef CRING_FAKE_DEVICE_H
#define CRING_FAKE_DEVICE_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>

/* the CUDA runtime's error codes the fake returns */
enum {
    SUCCESS = 0,
    ERROR_INVALID_VALUE = 1,
    ERROR_MEMORY_ALLOCATION = 2,
    ERROR_INSUFFICIENT_DRIVER = 35,
    ERROR_INVALID_DEVICE = 101,
    ERROR_INVALID_RESOURCE_HANDLE = 400,
    ERROR_NOT_READY = 600,
    ERROR_NOT_SUPPORTED = 801,
};

enum { OP_COPY, OP_SET, OP_RECORD, OP_WAIT, OP_CALL, OP_KERNEL };

typedef struct fake_op fake_op_t;
typedef struct fake_stream fake_stream_t;

/* One operation of a stream. Referenced by its stream until it has run, by
 * an event's last record, by WAIT operations and by host waits. */
struct fake_op {
    int kind;
    int refs;        /* under mu */
    int done;        /* under mu */
    fake_op_t *next; /* the stream's queue */
    fake_stream_t *stream;
    void *dst; /* COPY, SET, KERNEL */
    const void *src;
    size_t bytes;
    int value;         /* SET, KERNEL */
    unsigned delay_us; /* KERNEL */
    void *staging;     /* COPY from pageable memory: freed once it has run */
    fake_op_t *target; /* WAIT: the operation waited for (a reference) */
    void (*fn)(void *);
    void *arg; /* CALL */
};

struct fake_stream {
    uintptr_t handle; /* 0 for a legacy default stream */
    int device;
    int blocking;           /* synchronises with the legacy default stream */
    int number;             /* order of first use in this process (seeds its delays) */
    fake_op_t *head, *tail; /* not yet run; head is running or next */
    fake_op_t *last;        /* the last operation enqueued (a reference), NULL when none */
    int has_thread;
    pthread_cond_t work;
    uint64_t rng;
    fake_stream_t *next;
};

/* The calling thread's device (cudaSetDevice's). */
extern __thread int fake__current_device;

/* Read the knobs (seed, delays) once; register the fork handlers. */
void fake__start(void);
unsigned long fake__seed(void);
/* Append a line to $CRING_FAKE_CUDA_LOG (one write: lines never interleave). */
void fake__log(const char *fmt, ...) __attribute__((format(printf, 1, 2)));

/* The one lock of the device's state: streams, queues, op fields. */
void fake__lock(void);
void fake__unlock(void);
/* A new operation (one reference, which enqueueing hands to the stream). */
fake_op_t *fake__op_new(int kind);
/* Drop a reference (under the lock). */
void fake__op_put(fake_op_t *op);
/* Wait until op has run (under the lock, which it releases while waiting);
 * a wait longer than CRING_FAKE_CUDA_HANG_S prints the streams once. */
void fake__wait_done(fake_op_t *op, const char *what);
/* The stream a handle names, created at first use (under the lock): NULL and
 * cudaStreamLegacy are the current device's legacy default stream; any other
 * handle a non-blocking stream of the current device. */
fake_stream_t *fake__stream_of(void *handle);
/* s waits for target (nothing when it has run), under the lock. */
int fake__append_wait(fake_stream_t *s, fake_op_t *target);
/* Enqueue op on handles[0]'s stream after every stream of handles[0..n) has
 * run what it had queued, with the legacy default stream's implicit order;
 * the other streams' later work waits for op. Takes op. A CUDA error code. */
int fake__enqueue_group(void *const *handles, int n, fake_op_t *op);
int fake__enqueue(void *handle, fake_op_t *op);
/* The host waits for what a stream (every stream of a device, -1: of every
 * device) has queued so far. */
void fake__drain(void *handle, const char *why);
void fake__drain_device(int device, const char *why);

#endif

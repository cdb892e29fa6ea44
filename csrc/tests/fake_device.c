/* fake_device.c: the fake GPU's device, for the fake CUDA runtime
 * (fake_cudart.c, built into libfake_cudart.so with it): every stream a FIFO
 * queue of operations run by a device thread of its own after a seeded
 * random delay, the legacy default stream's implicit order, host waits, and
 * what a fork leaves behind. It knows nothing of the runtime's API (its
 * callers are) and is never used outside tests. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

#include "fake_device.h"
#include "fake_log.h"

__thread int fake__current_device = 0;

void fake__log(const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fake_vlog("CRING_FAKE_CUDA_LOG", fmt, ap);
    va_end(ap);
}

static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t done_cv = PTHREAD_COND_INITIALIZER;
static fake_stream_t *streams; /* under mu */
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
void fake__lock(void) { pthread_mutex_lock(&mu); }
void fake__unlock(void) { pthread_mutex_unlock(&mu); }

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
    pthread_atfork(fake__lock, fake__unlock, after_fork_child);
    fake__log("fake GPU seed=%lu delay_us=%u (CRING_FAKE_CUDA_SEED=%lu replays it)", seed,
              delay_max_us, seed);
}

void fake__start(void) { pthread_once(&init_once, init); }

unsigned long fake__seed(void) {
    fake__start();
    return seed;
}

void fake__op_put(fake_op_t *op) { /* under mu */
    if (!op || --op->refs > 0) return;
    if (op->target) fake__op_put(op->target);
    free(op->staging);
    free(op);
}

fake_op_t *fake__op_new(int kind) {
    fake_op_t *op = calloc(1, sizeof *op);
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
    for (fake_stream_t *s = streams; s; s = s->next) {
        int pending = 0;
        for (fake_op_t *op = s->head; op; op = op->next) pending++;
        fprintf(stderr, "  stream 0x%lx device %d: %d pending, next kind %d\n",
                (unsigned long)s->handle, s->device, pending, s->head ? s->head->kind : -1);
    }
}

/* Wait (under mu) until op has run. */
void fake__wait_done(fake_op_t *op, const char *what) {
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

static void run_op(fake_op_t *op) {
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
    fake_stream_t *s = arg;
    sigset_t all;
    sigfillset(&all);
    pthread_sigmask(SIG_BLOCK, &all, NULL); /* signals go to the program's threads */
    prctl(PR_SET_TIMERSLACK, 1000ul);       /* microsecond delays, not 50 us ones */
    fake__lock();
    for (;;) {
        while (!s->head) pthread_cond_wait(&s->work, &mu);
        fake_op_t *op = s->head;
        unsigned delay = delay_max_us ? (unsigned)(splitmix(&s->rng) % (delay_max_us + 1)) : 0;
        fake__unlock();
        sleep_us(delay);
        fake__lock();
        if (op->kind == OP_WAIT) fake__wait_done(op->target, "a stream waits for an event");
        fake__unlock();
        run_op(op);
        fake__lock();
        op->done = 1;
        s->head = op->next;
        if (!s->head) s->tail = NULL;
        pthread_cond_broadcast(&done_cv);
        fake__op_put(op);
    }
    return NULL;
}

/* The stream a handle names (created at first use), under mu. NULL and
 * cudaStreamLegacy (1) are the legacy default stream of the current device. */
fake_stream_t *fake__stream_of(void *handle) {
    uintptr_t h = (uintptr_t)handle;
    int legacy = h == 0 || h == 1;
    for (fake_stream_t *s = streams; s; s = s->next)
        if (legacy ? (s->handle == 0 && s->device == fake__current_device) : s->handle == h)
            return s;
    fake_stream_t *s = calloc(1, sizeof *s);
    if (!s) return NULL;
    s->handle = legacy ? 0 : h;
    s->device = fake__current_device;
    s->blocking = 0;
    s->number = nstreams++;
    const char *rank = getenv("CRING_RANK");
    s->rng = seed ^ ((uint64_t)(rank ? atoi(rank) + 1 : 0) << 40) ^ ((uint64_t)s->number << 20);
    pthread_cond_init(&s->work, NULL);
    s->next = streams;
    streams = s;
    return s;
}

static fake_stream_t *legacy_of(int device) {
    int saved = fake__current_device;
    fake__current_device = device;
    fake_stream_t *s = fake__stream_of(NULL);
    fake__current_device = saved;
    return s;
}

/* Append op to s (under mu); s takes op's reference. */
static int append(fake_stream_t *s, fake_op_t *op) {
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
    fake__op_put(s->last);
    s->last = op;
    pthread_cond_signal(&s->work);
    return SUCCESS;
}

/* A wait on s for target (no-op when it has run), under mu. */
int fake__append_wait(fake_stream_t *s, fake_op_t *target) {
    if (!target || target->done) return SUCCESS;
    fake_op_t *w = fake__op_new(OP_WAIT);
    if (!w) return ERROR_MEMORY_ALLOCATION;
    target->refs++;
    w->target = target;
    return append(s, w);
}

/* The legacy default stream's implicit order for work about to go on s:
 * after every blocking stream of its device (s legacy), or after the legacy
 * stream (s blocking). Under mu. */
static int implicit_waits(fake_stream_t *s) {
    int rc = SUCCESS;
    if (s->handle == 0) {
        for (fake_stream_t *b = streams; b && rc == SUCCESS; b = b->next)
            if (b->blocking && b->device == s->device) rc = fake__append_wait(s, b->last);
    } else if (s->blocking) {
        rc = fake__append_wait(s, legacy_of(s->device)->last);
    }
    return rc;
}

int fake__enqueue_group(void *const *handles, int n, fake_op_t *op) {
    if (!op) return ERROR_MEMORY_ALLOCATION;
    fake__start();
    fake__lock();
    fake_stream_t *first = n > 0 ? fake__stream_of(handles[0]) : NULL;
    int rc = first ? SUCCESS : ERROR_MEMORY_ALLOCATION;
    for (int i = 1; i < n && rc == SUCCESS; i++) {
        fake_stream_t *other = fake__stream_of(handles[i]);
        if (!other) rc = ERROR_MEMORY_ALLOCATION;
        else if (other != first) rc = fake__append_wait(first, other->last);
    }
    if (rc == SUCCESS) rc = implicit_waits(first);
    if (rc == SUCCESS) {
        op->refs++; /* ours, for the waits below */
        rc = append(first, op);
        for (int i = 1; i < n && rc == SUCCESS; i++) {
            fake_stream_t *other = fake__stream_of(handles[i]);
            if (other != first) rc = fake__append_wait(other, op);
        }
    }
    fake__op_put(op);
    fake__unlock();
    return rc;
}

int fake__enqueue(void *handle, fake_op_t *op) { return fake__enqueue_group(&handle, 1, op); }

/* The host waits until everything enqueued on handle's stream so far has run. */
void fake__drain(void *handle, const char *why) {
    fake__start();
    fake__lock();
    fake_stream_t *s = fake__stream_of(handle);
    fake_op_t *last = s ? s->last : NULL;
    if (last) {
        last->refs++;
        fake__wait_done(last, why);
        fake__op_put(last);
    }
    fake__unlock();
}

/* The host waits for every stream of device (-1: of every device). */
void fake__drain_device(int device, const char *why) {
    fake__start();
    fake__lock();
    int n = 0;
    for (fake_stream_t *s = streams; s; s = s->next) n++;
    fake_op_t **lasts = calloc((size_t)n + 1, sizeof *lasts);
    int k = 0;
    for (fake_stream_t *s = streams; s && lasts; s = s->next)
        if (s->last && (device < 0 || s->device == device)) {
            s->last->refs++;
            lasts[k++] = s->last;
        }
    for (int i = 0; i < k; i++) {
        fake__wait_done(lasts[i], why);
        fake__op_put(lasts[i]);
    }
    free(lasts);
    fake__unlock();
}

/* In a child after fork: the device threads are gone. Work the parent left
 * queued is dropped (marked done so nothing waits on it); the streams start
 * afresh in this process. */
static void after_fork_child(void) {
    pthread_cond_init(&done_cv, NULL);
    for (fake_stream_t *s = streams; s; s = s->next) {
        for (fake_op_t *op = s->head; op; op = op->next) op->done = 1;
        s->head = s->tail = NULL;
        s->has_thread = 0;
        pthread_cond_init(&s->work, NULL);
    }
    fake__unlock();
}

/* test_fake_gpu.c: the test doubles' fake GPU (fake_cudart.c, fake_nccl.c)
 * is as strict as a GPU where cring's correctness depends on it, so the
 * other CUDA tests can trust what passes there: work runs late; only
 * cudaStreamWaitEvent (on the record current at the call), the legacy
 * default stream order streams; host waits wait; cudaFree
 * synchronises the device and poisons; stream-ordered frees are reused at
 * once on their stream and on another only once they have run (counted;
 * refused as without memory pools when asked to); a collective waits for its peers on the device's
 * thread, and ncclCommAbort gets it out. Loads the doubles with dlopen (no
 * cring code involved). Slow "kernels" (fake_cuda_kernel) make the late
 * work late enough to observe. */
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "testutil.h"

#define SLOW_US 200000 /* a slow kernel: the host sees its work pending */

typedef void *stream_t;
static struct {
    int (*StreamCreateWithFlags)(stream_t *, unsigned);
    int (*EventCreateWithFlags)(void **, unsigned);
    int (*EventDestroy)(void *);
    int (*EventRecord)(void *, stream_t);
    int (*EventQuery)(void *);
    int (*EventSynchronize)(void *);
    int (*StreamWaitEvent)(stream_t, void *, unsigned);
    int (*StreamSynchronize)(stream_t);
    int (*Malloc)(void **, size_t);
    int (*Free)(void *);
    int (*MallocAsync)(void **, size_t, stream_t);
    int (*FreeAsync)(void *, stream_t);
    int (*MemsetAsync)(void *, int, size_t, stream_t);
    int (*LaunchHostFunc)(stream_t, void (*)(void *), void *);
    int (*kernel)(stream_t, void *, int, size_t, unsigned);
    long (*count)(const char *);
} cu;

typedef struct {
    char internal[128];
} nccl_id_t;
typedef void *nccl_comm_t;
static struct {
    int (*GetUniqueId)(nccl_id_t *);
    int (*CommInitRank)(nccl_comm_t *, int, nccl_id_t, int);
    int (*CommDestroy)(nccl_comm_t);
    int (*CommAbort)(nccl_comm_t);
    int (*AllReduce)(const void *, void *, size_t, int, int, nccl_comm_t, stream_t);
    int (*GroupStart)(void);
    int (*GroupEnd)(void);
} nc;

static void *need(void *lib, const char *name) {
    void *fn = dlsym(lib, name);
    if (!fn) fprintf(stderr, "missing %s\n", name);
    CHECK(fn != NULL);
    return fn;
}

static void load(const testutil_fakes_t *f) {
    void *c = dlopen(f->cudart, RTLD_NOW);
    void *n = dlopen(f->nccl, RTLD_NOW);
    CHECK(c != NULL && n != NULL);
    *(void **)&cu.StreamCreateWithFlags = need(c, "cudaStreamCreateWithFlags");
    *(void **)&cu.EventCreateWithFlags = need(c, "cudaEventCreateWithFlags");
    *(void **)&cu.EventDestroy = need(c, "cudaEventDestroy");
    *(void **)&cu.EventRecord = need(c, "cudaEventRecord");
    *(void **)&cu.EventQuery = need(c, "cudaEventQuery");
    *(void **)&cu.EventSynchronize = need(c, "cudaEventSynchronize");
    *(void **)&cu.StreamWaitEvent = need(c, "cudaStreamWaitEvent");
    *(void **)&cu.StreamSynchronize = need(c, "cudaStreamSynchronize");
    *(void **)&cu.Malloc = need(c, "cudaMalloc");
    *(void **)&cu.Free = need(c, "cudaFree");
    *(void **)&cu.MallocAsync = need(c, "cudaMallocAsync");
    *(void **)&cu.FreeAsync = need(c, "cudaFreeAsync");
    *(void **)&cu.MemsetAsync = need(c, "cudaMemsetAsync");
    *(void **)&cu.LaunchHostFunc = need(c, "cudaLaunchHostFunc");
    *(void **)&cu.kernel = need(c, "fake_cuda_kernel");
    *(void **)&cu.count = need(c, "fake_cuda_count");
    *(void **)&nc.GetUniqueId = need(n, "ncclGetUniqueId");
    *(void **)&nc.CommInitRank = need(n, "ncclCommInitRank");
    *(void **)&nc.CommDestroy = need(n, "ncclCommDestroy");
    *(void **)&nc.CommAbort = need(n, "ncclCommAbort");
    *(void **)&nc.AllReduce = need(n, "ncclAllReduce");
    *(void **)&nc.GroupStart = need(n, "ncclGroupStart");
    *(void **)&nc.GroupEnd = need(n, "ncclGroupEnd");
}

static stream_t stream(unsigned flags) {
    stream_t s = NULL;
    CHECK(cu.StreamCreateWithFlags(&s, flags) == 0);
    return s;
}

static void set_flag(void *arg) { *(volatile int *)arg = 1; }

/* Streams and events: late work, waits on the record of the call's time. */
static void test_streams_and_events(void) {
    unsigned char buf[64] = {0};
    stream_t a = stream(1), b = stream(1), c = stream(1);
    void *ev;
    CHECK(cu.EventCreateWithFlags(&ev, 2) == 0);

    /* late: a slow kernel's write is not there when the call returns */
    CHECK(cu.kernel(a, buf, 1, sizeof buf, SLOW_US) == 0);
    CHECK(buf[0] == 0);
    CHECK(cu.EventRecord(ev, a) == 0);
    CHECK(cu.EventQuery(ev) == 600); /* cudaErrorNotReady */
    /* b waits for the record on a; then c records the event again at once:
     * b's wait is still on a's record (CUDA's semantics) */
    CHECK(cu.StreamWaitEvent(b, ev, 0) == 0);
    CHECK(cu.EventRecord(ev, c) == 0);
    CHECK(cu.kernel(b, buf, 2, sizeof buf, 0) == 0);
    CHECK(cu.StreamSynchronize(b) == 0);
    CHECK(buf[0] == 2 && buf[63] == 2); /* after a's 1 */
    CHECK(cu.EventSynchronize(ev) == 0 && cu.EventQuery(ev) == 0);
    CHECK(cu.EventDestroy(ev) == 0);

    /* without a wait nothing orders two streams: a's slow 3 lands after b's 4 */
    CHECK(cu.kernel(a, buf, 3, sizeof buf, SLOW_US) == 0);
    CHECK(cu.kernel(b, buf, 4, sizeof buf, 0) == 0);
    CHECK(cu.StreamSynchronize(b) == 0);
    CHECK(buf[0] == 4);
    CHECK(cu.StreamSynchronize(a) == 0);
    CHECK(buf[0] == 3);

    /* the legacy default stream waits for blocking streams (flags 0), not for
     * non-blocking ones */
    stream_t blocking = stream(0);
    CHECK(cu.kernel(blocking, buf, 5, sizeof buf, SLOW_US) == 0);
    CHECK(cu.kernel(NULL, buf, 6, sizeof buf, 0) == 0);
    CHECK(cu.StreamSynchronize(NULL) == 0);
    CHECK(buf[0] == 6); /* after the blocking stream's 5 */
    CHECK(cu.kernel(a, buf, 7, sizeof buf, SLOW_US) == 0);
    CHECK(cu.kernel(NULL, buf, 8, sizeof buf, 0) == 0);
    CHECK(cu.StreamSynchronize(NULL) == 0);
    CHECK(buf[0] == 8);
    CHECK(cu.StreamSynchronize(a) == 0);
    CHECK(buf[0] == 7); /* the non-blocking stream's write came later */
    printf("streams and events: ok\n");
}

/* Memory: cudaFree waits for the device and poisons; stream-ordered frees. */
static void test_memory(void) {
    stream_t a = stream(1);
    unsigned char *p = NULL;
    CHECK(cu.Malloc((void **)&p, 100) == 0);
    CHECK(p[0] == 0xA5 && p[99] == 0xA5); /* never written shows */
    volatile int ran = 0;
    CHECK(cu.kernel(a, p, 1, 100, SLOW_US) == 0);
    CHECK(cu.LaunchHostFunc(a, set_flag, (void *)&ran) == 0);
    CHECK(ran == 0);
    CHECK(cu.Free(p) == 0); /* synchronises the device first */
    CHECK(ran == 1);
    CHECK(p[0] == 0xDB && p[99] == 0xDB); /* poisoned (kept in a quarantine) */

    unsigned char *q = NULL, *r = NULL;
    CHECK(cu.MallocAsync((void **)&q, 64, a) == 0);
    CHECK(cu.kernel(a, q, 9, 64, SLOW_US) == 0);
    CHECK(cu.FreeAsync(q, a) == 0);
    CHECK(q[0] == 0xA5); /* neither the kernel nor the free has run */
    CHECK(cu.MallocAsync((void **)&r, 64, a) == 0);
    CHECK(r == q); /* the same stream takes it back at once */
    CHECK(cu.MemsetAsync(r, 4, 64, a) == 0);
    CHECK(cu.StreamSynchronize(a) == 0);
    CHECK(r[0] == 4); /* kernel, poison, memset: in stream order */
    CHECK(cu.FreeAsync(r, a) == 0);
    CHECK(cu.StreamSynchronize(a) == 0);
    CHECK(r[0] == 0xDB);

    /* another stream takes a stream-ordered block only once its free has run */
    stream_t b = stream(1);
    unsigned char *s = NULL, *t = NULL, *u = NULL;
    long async0 = cu.count("malloc_async"), frees0 = cu.count("free_async");
    CHECK(cu.MallocAsync((void **)&s, 64, b) == 0);
    CHECK(s == r); /* r's free has run: any stream may have it */
    CHECK(cu.kernel(b, s, 3, 64, SLOW_US) == 0);
    CHECK(cu.FreeAsync(s, b) == 0);
    CHECK(cu.MallocAsync((void **)&t, 64, a) == 0);
    CHECK(t != s); /* s's free is still queued behind b's kernel */
    CHECK(cu.StreamSynchronize(b) == 0);
    CHECK(cu.MallocAsync((void **)&u, 64, a) == 0);
    CHECK(u == s && u[0] == 0xDB); /* now it may, poisoned */
    CHECK(cu.FreeAsync(t, a) == 0 && cu.FreeAsync(u, a) == 0);
    CHECK(cu.count("malloc_async") - async0 == 3 && cu.count("free_async") - frees0 == 3);
    /* a device without memory pools */
    setenv("CRING_FAKE_CUDA_ASYNC_ALLOC", "unsupported", 1);
    CHECK(cu.MallocAsync((void **)&t, 64, a) == 801 && t == NULL); /* cudaErrorNotSupported */
    unsetenv("CRING_FAKE_CUDA_ASYNC_ALLOC");
    CHECK(cu.count("malloc_async") - async0 == 3); /* only what succeeded counts */
    CHECK(cu.StreamSynchronize(a) == 0);
    printf("memory: ok\n");
}

/* ---- NCCL: two ranks as two threads of this process ---- */
typedef struct {
    nccl_id_t id;
    int rank;
    nccl_comm_t comm;
} member_t;

static void *join(void *arg) {
    member_t *m = arg;
    CHECK(nc.CommInitRank(&m->comm, 2, m->id, m->rank) == 0);
    return NULL;
}

static void pair(member_t m[2]) {
    CHECK(nc.GetUniqueId(&m[0].id) == 0);
    m[1].id = m[0].id;
    pthread_t t[2];
    for (int i = 0; i < 2; i++) {
        m[i].rank = i;
        CHECK(pthread_create(&t[i], NULL, join, &m[i]) == 0);
    }
    for (int i = 0; i < 2; i++) pthread_join(t[i], NULL);
}

static void test_nccl(void) {
    member_t m[2];
    pair(m);
    stream_t s[2] = {stream(1), stream(1)};
    float x[2][5];
    for (int r = 0; r < 2; r++)
        for (int i = 0; i < 5; i++) x[r][i] = (float)(r * 10 + i);
    /* enqueued, not run: the call returns before its peer has called */
    CHECK(nc.AllReduce(x[0], x[0], 5, 7, 0, m[0].comm, s[0]) == 0);
    usleep(20000);
    CHECK(x[0][1] == 1.0f);
    CHECK(nc.GroupStart() == 0); /* a group runs at ncclGroupEnd, on its stream */
    CHECK(nc.AllReduce(x[1], x[1], 5, 7, 0, m[1].comm, s[1]) == 0);
    CHECK(nc.GroupEnd() == 0);
    CHECK(cu.StreamSynchronize(s[0]) == 0 && cu.StreamSynchronize(s[1]) == 0);
    for (int i = 0; i < 5; i++) CHECK(x[0][i] == (float)(10 + 2 * i) && x[1][i] == x[0][i]);

    /* a collective whose peer never calls waits on the device's thread;
     * ncclCommAbort gets it out and the stream goes on */
    unsigned char after = 0;
    CHECK(nc.AllReduce(x[0], x[0], 5, 7, 0, m[0].comm, s[0]) == 0);
    CHECK(cu.kernel(s[0], &after, 1, 1, 0) == 0);
    usleep(50000);
    CHECK(after == 0); /* still waiting for rank 1 */
    CHECK(nc.CommAbort(m[0].comm) == 0);
    CHECK(cu.StreamSynchronize(s[0]) == 0);
    CHECK(after == 1);
    CHECK(nc.CommAbort(m[1].comm) == 0);

    /* ncclCommDestroy waits for the communicator's queued work */
    pair(m);
    CHECK(cu.kernel(s[0], NULL, 0, 0, SLOW_US) == 0); /* s[0] is busy first */
    CHECK(nc.AllReduce(x[0], x[0], 5, 7, 0, m[0].comm, s[0]) == 0);
    CHECK(nc.AllReduce(x[1], x[1], 5, 7, 0, m[1].comm, s[1]) == 0);
    CHECK(nc.CommDestroy(m[1].comm) == 0);
    CHECK(nc.CommDestroy(m[0].comm) == 0);
    CHECK(x[0][0] == 20.0f && x[1][4] == 2.0f * (10 + 8)); /* ran before the destroys returned */
    printf("nccl: ok\n");
}

int main(void) {
    testutil_fakes_t fakes = testutil_find_fakes();
    setenv("CRING_FAKE_NCCL_TIMEOUT_S", "60", 1); /* the abort, not a time-out, ends the wait */
    load(&fakes);
    test_streams_and_events();
    test_memory();
    test_nccl();
    TEST_DONE("test_fake_gpu");
    return 0;
}

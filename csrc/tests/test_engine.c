/* test_engine.c: the engine through the public C API, without Python: ranks
 * submit names in different orders, many small requests fuse into few
 * collectives, a mismatch fails one handle on every rank and the engine goes
 * on, a duplicate in-flight name is refused, groups, allgather and alltoall
 * work, join() lets the other ranks' allreduces finish with zeros, and a
 * handle freed before its peers submit never waits and still completes. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cring/cring.h"
#include "testutil.h"

#define NAMES 50
#define SMALL 1000

static cring_handle_t *submit1(cring_engine_t *e, const char *name, cring_collective_t coll,
                               const void *send, void *recv, cring_dtype_t dt, int64_t n,
                               cring_op_t op, int flags) {
    cring_tensor_t t = {.send = send, .recv = recv, .dtype = dt, .ndim = 1, .shape = &n};
    cring_request_t q = {.name = name,
                         .collective = coll,
                         .op = op,
                         .root = 0,
                         .prescale = 1,
                         .postscale = 1,
                         .compression = CRING_DTYPE_COUNT,
                         .ntensors = 1,
                         .tensors = &t,
                         .flags = flags};
    cring_handle_t *h = NULL;
    cring_status_t st = cring_engine_submit(e, &q, &h);
    if (st != CRING_OK) {
        fprintf(stderr, "submit %s: %s\n", name, cring_engine_error_message());
        return NULL;
    }
    return h;
}

static void run_rank(int rank, int size, int port, int transport) {
    alarm(120);
    cring_config_t cfg = testutil_config(rank, size, port, (cring_transport_kind_t)transport, 30);
    char job[32];
    snprintf(job, sizeof job, "eng-%d-%d", size, (int)transport);
    cfg.job_key = job;
    cring_comm_t *comm;
    CHECK_OK(cring_comm_init(&cfg, &comm));
    cring_engine_t *e;
    CHECK_OK(cring_engine_start(comm, &e));

    /* 1. Names in different orders: rank 1 submits in reverse. */
    static int32_t bufs[NAMES][17];
    cring_handle_t *hs[NAMES];
    for (int k = 0; k < NAMES; k++) {
        int i = rank == 1 ? NAMES - 1 - k : k;
        char name[32];
        snprintf(name, sizeof name, "w%d", i);
        for (int j = 0; j < 17; j++) bufs[i][j] = rank + i + j;
        hs[i] =
            submit1(e, name, CRING_COLL_ALLREDUCE, bufs[i], bufs[i], CRING_INT32, 17, CRING_SUM, 0);
        CHECK(hs[i] != NULL);
    }
    for (int i = 0; i < NAMES; i++) {
        CHECK_OK(cring_handle_wait(hs[i]));
        for (int j = 0; j < 17; j++) CHECK(bufs[i][j] == size * (i + j) + size * (size - 1) / 2);
        cring_handle_free(hs[i]);
    }

    /* 2. Many small requests fuse: far fewer collectives than requests. */
    cring_engine_stats_t before, after;
    cring_engine_get_stats(e, &before);
    static float small[SMALL][8];
    static cring_handle_t *sh[SMALL];
    for (int i = 0; i < SMALL; i++) {
        char name[32];
        snprintf(name, sizeof name, "s%d", i);
        for (int j = 0; j < 8; j++) small[i][j] = (float)(rank * 1000 + i);
        sh[i] = submit1(e, name, CRING_COLL_ALLREDUCE, small[i], small[i], CRING_FLOAT32, 8,
                        CRING_AVERAGE, 0);
        CHECK(sh[i] != NULL);
    }
    for (int i = 0; i < SMALL; i++) {
        CHECK_OK(cring_handle_wait(sh[i]));
        float want = (float)i + 1000.0f * (float)(size - 1) / 2.0f;
        for (int j = 0; j < 8; j++) CHECK(small[i][j] == want);
        cring_handle_free(sh[i]);
    }
    cring_engine_get_stats(e, &after);
    uint64_t colls = after.collectives - before.collectives;
    if (rank == 0)
        printf("size %d: %d small allreduces ran as %llu collectives\n", size, SMALL,
               (unsigned long long)colls);
    CHECK(colls < SMALL / 10);

    /* 3. Mismatch: every rank's handle fails naming the tensor, then it works again. */
    int32_t m[6] = {0};
    cring_handle_t *mh = submit1(e, "mis", CRING_COLL_ALLREDUCE, m, m, CRING_INT32,
                                 rank == size - 1 ? 6 : 5, CRING_SUM, CRING_REQUEST_CALLER_WAITS);
    CHECK(mh);
    if (size > 1) {
        CHECK(cring_handle_wait(mh) == CRING_ERR_MISMATCH);
        CHECK(strstr(cring_handle_error(mh), "'mis'") && strstr(cring_handle_error(mh), "shape"));
    } else {
        CHECK_OK(cring_handle_wait(mh));
    }
    cring_handle_free(mh);
    int32_t one = 1;
    cring_handle_t *oh = submit1(e, "after", CRING_COLL_ALLREDUCE, &one, &one, CRING_INT32, 1,
                                 CRING_SUM, CRING_REQUEST_CALLER_WAITS);
    CHECK_OK(cring_handle_wait(oh));
    CHECK(one == size);
    cring_handle_free(oh);

    /* 4. A duplicate in-flight name is refused at submission. Rank 0's "dup"
     * cannot complete before the check: the others submit theirs only after
     * "go", which rank 0 joins after the check. (One rank could complete it
     * at once, so this needs two.) */
    if (size > 1) {
        int32_t d1 = rank, d2 = rank, g = 0;
        cring_handle_t *dh = NULL;
        if (rank == 0) {
            dh = submit1(e, "dup", CRING_COLL_ALLREDUCE, &d1, &d1, CRING_INT32, 1, CRING_SUM, 0);
            CHECK(dh);
            cring_tensor_t t = {
                .send = &d2, .recv = &d2, .dtype = CRING_INT32, .ndim = 0, .shape = NULL};
            cring_request_t q = {.name = "dup",
                                 .collective = CRING_COLL_ALLREDUCE,
                                 .op = CRING_SUM,
                                 .compression = CRING_DTYPE_COUNT,
                                 .ntensors = 1,
                                 .tensors = &t};
            cring_handle_t *dh2 = NULL;
            CHECK(cring_engine_submit(e, &q, &dh2) == CRING_ERR_INVALID_ARGUMENT && dh2 == NULL);
            CHECK(strstr(cring_engine_error_message(), "already in flight"));
        }
        cring_handle_t *go =
            submit1(e, "go", CRING_COLL_ALLREDUCE, &g, &g, CRING_INT32, 1, CRING_SUM, 0);
        CHECK_OK(cring_handle_wait(go));
        cring_handle_free(go);
        if (rank != 0)
            dh = submit1(e, "dup", CRING_COLL_ALLREDUCE, &d1, &d1, CRING_INT32, 1, CRING_SUM, 0);
        CHECK_OK(cring_handle_wait(dh));
        CHECK(d1 == size * (size - 1) / 2);
        cring_handle_free(dh);
    }

    /* 5. Allgather with different first dimensions. */
    int64_t rows = rank + 1;
    int64_t shape[2] = {rows, 2};
    int32_t mine[16];
    for (int i = 0; i < 2 * rows; i++) mine[i] = rank;
    cring_tensor_t gt = {.send = mine, .dtype = CRING_INT32, .ndim = 2, .shape = shape};
    cring_request_t gq = {.name = "gather",
                          .collective = CRING_COLL_ALLGATHER,
                          .compression = CRING_DTYPE_COUNT,
                          .ntensors = 1,
                          .tensors = &gt};
    cring_handle_t *gh;
    CHECK_OK(cring_engine_submit(e, &gq, &gh));
    CHECK_OK(cring_handle_wait(gh));
    size_t bytes;
    const int64_t *dims;
    const int32_t *out = cring_handle_output(gh, 0, &bytes, &dims);
    CHECK(bytes == (size_t)(size * (size + 1)) * sizeof(int32_t));
    size_t k = 0;
    for (int r = 0; r < size; r++) {
        CHECK(dims[r] == r + 1);
        for (int i = 0; i < 2 * (r + 1); i++) CHECK(out[k++] == r);
    }
    cring_handle_free(gh);

    /* 6. Alltoall with uneven splits, large enough to take several window
     * rounds: rank r sends (r + j) % 3 + 1 rows of `cols` to rank j, each
     * value encoding (source, destination, row, column). */
    {
        const int64_t cols = 70001;
        int64_t splits[8], total = 0;
        for (int j = 0; j < size; j++) total += splits[j] = (rank + j) % 3 + 1;
        int64_t shp[2] = {total, cols};
        int32_t *src = malloc(sizeof *src * (size_t)(total * cols));
        int64_t row = 0;
        for (int j = 0; j < size; j++)
            for (int64_t i = 0; i < splits[j]; i++, row++)
                for (int64_t c = 0; c < cols; c++)
                    src[row * cols + c] =
                        (int32_t)(rank * 1000000 + j * 100000 + i * 1000 + c % 997);
        cring_tensor_t at = {.send = src, .dtype = CRING_INT32, .ndim = 2, .shape = shp};
        cring_request_t aq = {.name = "a2a",
                              .collective = CRING_COLL_ALLTOALL,
                              .compression = CRING_DTYPE_COUNT,
                              .ntensors = 1,
                              .tensors = &at,
                              .splits = splits};
        cring_handle_t *ah;
        CHECK_OK(cring_engine_submit(e, &aq, &ah));
        CHECK_OK(cring_handle_wait(ah));
        const int32_t *got = cring_handle_output(ah, 0, &bytes, &dims);
        size_t expect_rows = 0;
        for (int q = 0; q < size; q++) {
            CHECK(dims[q] == (q + rank) % 3 + 1);
            expect_rows += (size_t)dims[q];
        }
        CHECK(bytes == expect_rows * (size_t)cols * sizeof(int32_t));
        size_t at_row = 0;
        for (int q = 0; q < size; q++)
            for (int64_t i = 0; i < dims[q]; i++, at_row++)
                for (int64_t c = 0; c < cols; c += 999)
                    CHECK(got[at_row * (size_t)cols + (size_t)c] ==
                          (int32_t)(q * 1000000 + rank * 100000 + i * 1000 + c % 997));
        cring_handle_free(ah);
        free(src);

        /* splits that do not add up are refused at submission */
        splits[0] += 1;
        cring_handle_t *bad = NULL;
        CHECK(cring_engine_submit(e, &aq, &bad) == CRING_ERR_INVALID_ARGUMENT && !bad);
        CHECK(strstr(cring_engine_error_message(), "add up") != NULL);
    }

    /* 7. Join: the last rank has no data and joins at once; the others
     * allreduce twice (one cached name, one new) and see its part as zeros;
     * a Max while it is joined fails on every rank; join returns the last
     * rank to join, everywhere. */
    if (size > 1) {
        int last = size - 1;
        int32_t jv = -1;
        if (rank == last) {
            cring_request_t jq = {
                .name = "join", .collective = CRING_COLL_JOIN, .compression = CRING_DTYPE_COUNT};
            cring_handle_t *jh;
            CHECK_OK(cring_engine_submit(e, &jq, &jh));
            int32_t x = 1;
            cring_handle_t *no = NULL;
            CHECK(cring_engine_submit(e, &jq, &no) != CRING_OK && !no);
            CHECK(submit1(e, "late", CRING_COLL_ALLREDUCE, &x, &x, CRING_INT32, 1, CRING_SUM, 0) ==
                  NULL);
            CHECK_OK(cring_handle_wait(jh));
            jv = (int32_t)cring_handle_value(jh);
            cring_handle_free(jh);
        } else {
            for (int it = 0; it < 2; it++) {
                int32_t v[5];
                for (int i = 0; i < 5; i++) v[i] = rank + 1 + i;
                const char *nm = "fresh"; /* new, then cached */
                int64_t n5 = 5;
                cring_handle_t *h = submit1(e, nm, CRING_COLL_ALLREDUCE, v, v, CRING_INT32, n5,
                                            CRING_SUM, CRING_REQUEST_CALLER_WAITS);
                CHECK(h != NULL);
                CHECK_OK(cring_handle_wait(h));
                for (int i = 0; i < 5; i++) {
                    int32_t expect = 0; /* ranks 0..last-1 contribute r + 1 + i */
                    for (int r = 0; r < last; r++) expect += r + 1 + i;
                    CHECK(v[i] == expect);
                }
                cring_handle_free(h);
            }
            int32_t m = rank;
            cring_handle_t *mh2 =
                submit1(e, "max", CRING_COLL_ALLREDUCE, &m, &m, CRING_INT32, 1, CRING_MAX, 0);
            CHECK(cring_handle_wait(mh2) == CRING_ERR_MISMATCH);
            CHECK(strstr(cring_handle_error(mh2), "joined") != NULL);
            cring_handle_free(mh2);
            cring_request_t jq = {
                .name = "join", .collective = CRING_COLL_JOIN, .compression = CRING_DTYPE_COUNT};
            cring_handle_t *jh;
            CHECK_OK(cring_engine_submit(e, &jq, &jh));
            CHECK_OK(cring_handle_wait(jh));
            jv = (int32_t)cring_handle_value(jh);
            cring_handle_free(jh);
        }
        /* rank `last` joined first, so another rank joined last, and every
         * rank says the same one */
        CHECK(jv >= 0 && jv < last);
        int32_t lo = jv, hi = jv;
        cring_handle_t *lh =
            submit1(e, "jv-min", CRING_COLL_ALLREDUCE, &lo, &lo, CRING_INT32, 1, CRING_MIN, 0);
        cring_handle_t *hh =
            submit1(e, "jv-max", CRING_COLL_ALLREDUCE, &hi, &hi, CRING_INT32, 1, CRING_MAX, 0);
        CHECK_OK(cring_handle_wait(lh));
        CHECK_OK(cring_handle_wait(hh));
        CHECK(lo == jv && hi == jv);
        cring_handle_free(lh);
        cring_handle_free(hh);
        /* after the join everything works as before */
        int32_t one = 1;
        cring_handle_t *oh2 = submit1(e, "after-join", CRING_COLL_ALLREDUCE, &one, &one,
                                      CRING_INT32, 1, CRING_SUM, 0);
        CHECK_OK(cring_handle_wait(oh2));
        CHECK(one == size);
        cring_handle_free(oh2);
    }

    /* 8. A dropped handle never waits (issue 15, item 7): rank 0 submits
     * "dropped" and frees the handle at once, then both ranks pass a
     * barrier; only then does rank 1 submit "dropped". The engine keeps its
     * own reference, so the collective completes on both ranks and writes
     * rank 0's buffer; nothing leaks (ASan). */
    if (size > 1) {
        static int32_t dropped[33];
        for (int j = 0; j < 33; j++) dropped[j] = rank + j;
        cring_request_t bq = {.name = "drop-barrier",
                              .collective = CRING_COLL_BARRIER,
                              .compression = CRING_DTYPE_COUNT};
        cring_handle_t *bh = NULL;
        if (rank == 0) {
            cring_handle_t *dh = submit1(e, "dropped", CRING_COLL_ALLREDUCE, dropped, dropped,
                                         CRING_INT32, 33, CRING_SUM, 0);
            CHECK(dh != NULL);
            cring_handle_free(dh); /* returns at once: the engine holds its own reference */
        }
        CHECK_OK(cring_engine_submit(e, &bq, &bh));
        CHECK_OK(cring_handle_wait(bh));
        cring_handle_free(bh);
        if (rank != 0) {
            cring_handle_t *dh = submit1(e, "dropped", CRING_COLL_ALLREDUCE, dropped, dropped,
                                         CRING_INT32, 33, CRING_SUM, 0);
            CHECK_OK(cring_handle_wait(dh));
            cring_handle_free(dh);
        }
        /* a later collective completes after "dropped" ran everywhere */
        int32_t one = 1;
        cring_handle_t *ah = submit1(e, "after-drop", CRING_COLL_ALLREDUCE, &one, &one, CRING_INT32,
                                     1, CRING_SUM, 0);
        CHECK_OK(cring_handle_wait(ah));
        cring_handle_free(ah);
        CHECK(one == size);
        for (int j = 0; j < 33; j++) CHECK(dropped[j] == size * j + size * (size - 1) / 2);
    }

    cring_engine_stop(e);
    exit(0);
}

int main(void) {
    alarm(600);
    for (int size = 1; size <= 4; size++) {
        testutil_run_world(size, run_rank, CRING_TRANSPORT_AUTO, "engine over shm");
        testutil_run_world(size, run_rank, CRING_TRANSPORT_TCP, "engine over tcp");
    }
    TEST_DONE("test_engine");
    return 0;
}

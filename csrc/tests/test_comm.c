/* test_comm.c: the public C API end to end, without Python: fork world sizes
 * 1..8, rendezvous through a store served by the parent, and run every
 * collective over shared memory and over TCP with element counts 0, 1, 7, 33
 * and 1000003, checked against references computed here. Also: a mismatch is
 * reported on every rank and the communicator keeps working; and the
 * shared-memory paths around their thresholds, and the small gather. */
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "core/comm_internal.h"
#include "cring/cring.h"
#include "testutil.h"

static const size_t COUNTS[] = {0, 1, 7, 33, 1000003};
#define NCOUNTS (sizeof COUNTS / sizeof COUNTS[0])

/* Small integers, so every sum, min, max and product is exact in int32 and
 * float32 alike. */
static int value(int rank, size_t i, int salt) { return (int)((rank * 7 + i * 13 + salt) % 9) - 4; }

static int ref_reduce(cring_op_t op, int size, size_t i, int salt) {
    int acc = value(0, i, salt);
    for (int r = 1; r < size; r++) {
        int v = value(r, i, salt);
        switch (op) {
        case CRING_SUM:
        case CRING_AVERAGE: acc += v; break;
        case CRING_MIN: acc = v < acc ? v : acc; break;
        case CRING_MAX: acc = v > acc ? v : acc; break;
        case CRING_PRODUCT: acc *= v; break;
        default: break;
        }
    }
    if (op == CRING_AVERAGE) acc /= size; /* toward zero, as cring does for integers */
    return acc;
}

static void run_rank(int rank, int size, int port, int transport) {
    alarm(120);
    cring_config_t cfg = testutil_config(rank, size, port, (cring_transport_kind_t)transport, 60);
    cfg.secret = "test-secret";
    char job[64];
    snprintf(job, sizeof job, "job-%d-%d", size, (int)transport);
    cfg.job_key = job;
    cring_comm_t *comm = NULL;
    cring_status_t st = cring_comm_init(&cfg, &comm);
    if (st != CRING_OK) {
        fprintf(stderr, "rank %d: init failed: %s: %s\n", rank, cring_status_name(st),
                cring_last_init_error());
        exit(1);
    }
    CHECK(cring_comm_rank(comm) == rank && cring_comm_size(comm) == size);
    CHECK(cring_comm_local_size(comm) == size && cring_comm_local_rank(comm) == rank);
    CHECK(cring_comm_cross_size(comm) == 1 && cring_comm_cross_rank(comm) == 0);
    if (size > 1)
        CHECK(!strcmp(cring_comm_transport_name(comm),
                      transport == CRING_TRANSPORT_TCP ? "tcp" : "shm"));

    const size_t max = COUNTS[NCOUNTS - 1] + (size_t)size;
    int32_t *in = malloc(max * sizeof *in), *out = malloc(max * sizeof *out);
    float *fin = malloc(max * sizeof *fin), *fout = malloc(max * sizeof *fout);
    size_t *table = malloc((size_t)size * sizeof *table);
    static const cring_op_t ops[] = {CRING_SUM, CRING_AVERAGE, CRING_MIN, CRING_MAX, CRING_PRODUCT};
    for (size_t c = 0; c < NCOUNTS; c++) {
        size_t n = COUNTS[c];
        for (size_t o = 0; o < 5; o++) {
            cring_op_t op = ops[o];
            int salt = (int)o;
            /* int32 out of place, then float32 in place */
            for (size_t i = 0; i < n; i++) in[i] = value(rank, i, salt);
            CHECK_OK(cring_allreduce(comm, in, out, n, CRING_INT32, op));
            for (size_t i = 0; i < n; i++) CHECK(out[i] == ref_reduce(op, size, i, salt));
            for (size_t i = 0; i < n; i++) fin[i] = (float)value(rank, i, salt);
            CHECK_OK(cring_allreduce(comm, fin, fin, n, CRING_FLOAT32, op));
            for (size_t i = 0; i < n; i++) {
                float want = op == CRING_AVERAGE ? 0 : (float)ref_reduce(op, size, i, salt);
                if (op == CRING_AVERAGE) {
                    float s = 0;
                    for (int r = 0; r < size; r++) s += (float)value(r, i, salt);
                    want = s / (float)size;
                }
                float d = fin[i] - want;
                CHECK(d < 1e-5f && d > -1e-5f);
            }
            /* reducescatter with uneven blocks: rank r gets n/size (+1) */
            size_t off = 0, mine = 0, my_off = 0;
            for (int r = 0; r < size; r++) {
                table[r] = n / (size_t)size + ((size_t)r < n % (size_t)size);
                if (r == rank) {
                    mine = table[r];
                    my_off = off;
                }
                off += table[r];
            }
            for (size_t i = 0; i < n; i++) in[i] = value(rank, i, salt);
            CHECK_OK(cring_reducescatter(comm, in, out, table, CRING_INT32, op));
            for (size_t i = 0; i < mine; i++)
                CHECK(out[i] == ref_reduce(op, size, my_off + i, salt));
        }
        /* broadcast from every root */
        for (int root = 0; root < size; root++) {
            for (size_t i = 0; i < n; i++) in[i] = rank == root ? value(root, i, 5) : -99;
            CHECK_OK(cring_broadcast(comm, in, n * sizeof *in, root));
            for (size_t i = 0; i < n; i++) CHECK(in[i] == value(root, i, 5));
        }
        /* allgatherv: rank r contributes n + r elements */
        size_t total = 0;
        for (int r = 0; r < size; r++) {
            table[r] = (n + (size_t)r) * sizeof(int32_t);
            total += n + (size_t)r;
        }
        int32_t *all = malloc((total + 1) * sizeof *all);
        for (size_t i = 0; i < n + (size_t)rank; i++) in[i] = value(rank, i, 6);
        CHECK_OK(cring_allgatherv(comm, in, table[rank], all, table));
        size_t k = 0;
        for (int r = 0; r < size; r++)
            for (size_t i = 0; i < n + (size_t)r; i++) CHECK(all[k++] == value(r, i, 6));
        free(all);
    }
    CHECK_OK(cring_barrier(comm));

    /* alltoallv: rank r sends (r + 2j) % 5 * 40000 + 3 bytes to rank j (some
     * blocks span several shared-memory window halves); then a pair whose
     * sizes disagree fails on every rank and the next call works. */
    {
        size_t *sb = malloc(2 * sizeof *sb * (size_t)size), *rb = sb + size, stot = 0, rtot = 0;
        for (int j = 0; j < size; j++) {
            stot += sb[j] = (size_t)((rank + 2 * j) % 5) * 40000 + 3;
            rtot += rb[j] = (size_t)((j + 2 * rank) % 5) * 40000 + 3;
        }
        unsigned char *sbuf = malloc(stot), *rbuf = malloc(rtot);
        size_t o = 0;
        for (int j = 0; j < size; j++)
            for (size_t i = 0; i < sb[j]; i++)
                sbuf[o++] = (unsigned char)(rank * 31 + j * 7 + i % 251);
        CHECK_OK(cring_alltoallv(comm, sbuf, sb, rbuf, rb));
        o = 0;
        for (int q = 0; q < size; q++)
            for (size_t i = 0; i < rb[q]; i++)
                CHECK(rbuf[o++] == (unsigned char)(q * 31 + rank * 7 + i % 251));
        if (size > 1) {
            rb[0] += rank == size - 1; /* the last rank expects one byte too many from rank 0 */
            CHECK(cring_alltoallv(comm, sbuf, sb, rbuf, rb) == CRING_ERR_MISMATCH);
            CHECK(strstr(cring_comm_last_error(comm), "alltoallv: rank 0 sends") != NULL);
            rb[0] -= rank == size - 1;
            CHECK_OK(cring_alltoallv(comm, sbuf, sb, rbuf, rb));
        }
        CHECK(cring_alltoallv(comm, sbuf, sb, sbuf, rb) == CRING_ERR_INVALID_ARGUMENT);
        free(sbuf);
        free(rbuf);
        free(sb);
    }

    /* Disagreement: every rank gets ERR_MISMATCH naming rank 0 vs the other,
     * and the next collective works. */
    if (size > 1) {
        size_t n = rank == size - 1 ? 5 : 4;
        st = cring_allreduce(comm, in, out, n, CRING_INT32, CRING_SUM);
        CHECK(st == CRING_ERR_MISMATCH);
        CHECK(strstr(cring_comm_last_error(comm), "element count") != NULL);
        st = cring_broadcast(comm, in, 4, rank == 0 ? 0 : 1 % size);
        CHECK(st == CRING_ERR_MISMATCH);
        CHECK(strstr(cring_comm_last_error(comm), "root") != NULL);
        for (size_t i = 0; i < 4; i++) in[i] = rank;
        CHECK_OK(cring_allreduce(comm, in, out, 4, CRING_INT32, CRING_SUM));
        CHECK(out[0] == size * (size - 1) / 2);
    }
    CHECK(cring_allreduce(comm, in, out, 1, CRING_BOOL, CRING_SUM) == CRING_ERR_NOT_SUPPORTED);
    CHECK(cring_broadcast(comm, in, 4, size) == CRING_ERR_INVALID_ARGUMENT);
    cring_comm_destroy(comm);
    free(in);
    free(out);
    free(fin);
    free(fout);
    free(table);
    exit(0);
}

/* ---- shared-memory data paths -------------------------------------------------
 * The shm collectives move data in rounds of 256 KiB (less than a window
 * half) and use streaming stores for outputs of 1 MiB and more: check counts
 * on both sides of every round boundary and of those thresholds, in place and
 * out of place, with buffers off cache-line (and vector) alignment. */
#define SHM_ROUND_BYTES (256u << 10)

static int64_t shm_value(int rank, size_t i) { return (int64_t)(rank + 1) * (int64_t)(i % 7 + 1); }

static void put(cring_dtype_t dt, void *buf, size_t i, int64_t v) {
    switch (dt) {
    case CRING_FLOAT32: ((float *)buf)[i] = (float)v; break;
    case CRING_FLOAT64: ((double *)buf)[i] = (double)v; break;
    case CRING_INT8: ((int8_t *)buf)[i] = (int8_t)v; break;
    default: ((int64_t *)buf)[i] = v; break;
    }
}

static int64_t get(cring_dtype_t dt, const void *buf, size_t i) {
    switch (dt) {
    case CRING_FLOAT32: return (int64_t)((const float *)buf)[i];
    case CRING_FLOAT64: return (int64_t)((const double *)buf)[i];
    case CRING_INT8: return ((const int8_t *)buf)[i];
    default: return ((const int64_t *)buf)[i];
    }
}

static void run_shm_paths(int rank, int size, int port, int unused) {
    alarm(300);
    cring_config_t cfg = testutil_config(rank, size, port, CRING_TRANSPORT_SHM, 60);
    cfg.secret = "test-secret";
    cring_comm_t *comm = NULL;
    CHECK_OK(cring_comm_init(&cfg, &comm));
    const size_t max_bytes = (3u << 20) + 4096;
    unsigned char *a = malloc(max_bytes + 128), *b = malloc(max_bytes + 128);
    CHECK(a && b);

    static const cring_dtype_t dtypes[] = {CRING_FLOAT32, CRING_FLOAT64, CRING_INT8, CRING_INT64};
    for (size_t d = 0; d < sizeof dtypes / sizeof dtypes[0]; d++) {
        cring_dtype_t dt = dtypes[d];
        size_t es = cring_dtype_size(dt), r = SHM_ROUND_BYTES / es;
        size_t counts[] = {
            (16u << 10) / es + 1, r - 1,    r, r + 1, 2 * r + 17, (1u << 20) / es - 1,
            (1u << 20) / es + 13, 5 * r + 3};
        for (size_t c = 0; c < sizeof counts / sizeof counts[0]; c++) {
            size_t n = counts[c];
            for (int mode = 0; mode < 3; mode++) {
                /* 0: in place, aligned; 1: out of place, both one element
                 * off alignment; 2: out of place, MAX, send aligned */
                cring_op_t op = mode == 2 ? CRING_MAX : CRING_SUM;
                void *send = mode == 1 ? a + es : a, *recv = mode == 0 ? send : b + es;
                for (size_t i = 0; i < n; i++) put(dt, send, i, shm_value(rank, i));
                if (mode) memset(b, 0x5a, n * es + 2 * es);
                CHECK_OK(cring_allreduce(comm, send, recv, n, dt, op));
                for (size_t i = 0; i < n; i++) {
                    int64_t want = op == CRING_MAX
                                       ? shm_value(size - 1, i)
                                       : (int64_t)size * (size + 1) / 2 * (int64_t)(i % 7 + 1);
                    if (get(dt, recv, i) != want) {
                        fprintf(stderr,
                                "allreduce %s n=%zu mode %d: element %zu is %lld, want %lld\n",
                                cring_dtype_name(dt), n, mode, i, (long long)get(dt, recv, i),
                                (long long)want);
                        exit(1);
                    }
                }
                if (mode) CHECK(b[0] == 0x5a && b[es + n * es] == 0x5a); /* nothing outside */
            }
        }
    }

    size_t bcast[] = {SHM_ROUND_BYTES - 1, SHM_ROUND_BYTES + 1, (1u << 20) - 3, (1u << 20) + 5,
                      (3u << 20) + 7};
    for (size_t c = 0; c < sizeof bcast / sizeof bcast[0]; c++) {
        for (int root = 0; root < size; root += size - 1) {
            unsigned char *buf = a + 3;
            size_t n = bcast[c];
            for (size_t i = 0; i < n; i++)
                buf[i] = rank == root ? (unsigned char)(i * 13 + root) : 0;
            buf[n] = 0x77;
            CHECK_OK(cring_broadcast(comm, buf, n, root));
            for (size_t i = 0; i < n; i++) CHECK(buf[i] == (unsigned char)(i * 13 + root));
            CHECK(buf[n] == 0x77);
            if (root == size - 1) break;
        }
    }

    /* allgatherv: rank q sends base + 13q bytes; out of place (output one
     * byte off alignment) and in place */
    size_t bases[] = {100, SHM_ROUND_BYTES - 5, (600u << 10) + 1};
    size_t table[64];
    for (size_t c = 0; c < sizeof bases / sizeof bases[0]; c++) {
        size_t total = 0, mine_off = 0;
        for (int q = 0; q < size; q++) {
            table[q] = bases[c] + 13 * (size_t)q;
            if (q == rank) mine_off = total;
            total += table[q];
        }
        CHECK(total + 2 <= max_bytes);
        for (int in_place = 0; in_place < 2; in_place++) {
            unsigned char *out = b + 1;
            memset(b, 0, total + 2);
            unsigned char *send = in_place ? out + mine_off : a;
            for (size_t i = 0; i < table[rank]; i++) send[i] = (unsigned char)(i * 3 + rank * 101);
            CHECK_OK(cring_allgatherv(comm, send, table[rank], out, table));
            size_t o = 0;
            for (int q = 0; q < size; q++)
                for (size_t i = 0; i < table[q]; i++)
                    CHECK(out[o++] == (unsigned char)(i * 3 + q * 101));
            CHECK(b[0] == 0 && out[total] == 0);
        }
    }
    cring_comm_destroy(comm);
    free(a);
    free(b);
    exit(0);
}

/* Small gathers (the engine's negotiation): blocks of every length around
 * the flagged-line boundaries (56 bytes per line, 2048 bytes in lines, more
 * in bulk), different on every rank and every call, alternating with
 * allreduces that leave data in the window halves. Every rank must see
 * every block exactly, and its own block as `mine`. */
static unsigned char gather_byte(int rank, size_t i, int call) {
    return (unsigned char)(rank * 59 + i * 7 + call * 31 + 1);
}

static void run_gather_small(int rank, int size, int port, int unused) {
    alarm(300);
    cring_config_t cfg = testutil_config(rank, size, port, CRING_TRANSPORT_SHM, 60);
    cfg.secret = "test-secret";
    cring_comm_t *comm = NULL;
    CHECK_OK(cring_comm_init(&cfg, &comm));
    static const size_t lens[] = {0,   1,    7,    47,   48,   49,   55,   56,   57,   104,
                                  105, 1000, 2039, 2040, 2041, 2047, 2048, 2049, 4096, 70000};
    const int nlens = (int)(sizeof lens / sizeof lens[0]);
    CHECK(cring__comm_can_gather_small(comm));
    CHECK(cring__comm_gather_small_max(comm) >= 70000);
    unsigned char *mine = malloc(70000);
    int64_t *junk = malloc(4096 * sizeof *junk);
    CHECK(mine && junk);
    const void *ptrs[8];
    size_t got[8];
    for (int call = 0; call < 3 * nlens; call++) {
        size_t len = lens[(call + 3 * rank) % nlens];
        for (size_t i = 0; i < len; i++) mine[i] = gather_byte(rank, i, call);
        CHECK_OK(cring__comm_gather_small(comm, mine, len, ptrs, got));
        CHECK(ptrs[rank] == mine && got[rank] == len);
        for (int q = 0; q < size; q++) {
            size_t want = lens[(call + 3 * q) % nlens];
            CHECK(got[q] == want);
            const unsigned char *p = ptrs[q];
            for (size_t i = 0; i < want; i++)
                if (p[i] != gather_byte(q, i, call)) CHECK(p[i] == gather_byte(q, i, call));
        }
        if (call % 3 == 2) { /* stale data in the halves: large values, which a flag
                              * compared with >= instead of == would take for set */
            for (int i = 0; i < 4096; i++) junk[i] = INT64_MAX - 4096 * call - i;
            CHECK_OK(cring_allreduce(comm, junk, junk, 4096, CRING_INT64, CRING_MAX));
        }
    }
    cring_comm_destroy(comm);
    free(mine);
    free(junk);
    exit(0);
}

int main(void) {
    alarm(600);
    for (int size = 2; size <= 4; size++) {
        testutil_run_world(size, run_shm_paths, 0, "shm rounds, thresholds, alignment");
        testutil_run_world(size, run_gather_small, 0, "small gathers in lines and bulk");
    }
    for (int size = 1; size <= 8; size++) {
        testutil_run_world(size, run_rank, CRING_TRANSPORT_AUTO, "comm over shm");
        testutil_run_world(size, run_rank, CRING_TRANSPORT_TCP, "comm over tcp");
    }
    TEST_DONE("test_comm");
    return 0;
}

/* test_comm.c: the public C API end to end, without Python: fork world sizes
 * 1..8, rendezvous through a store served by the parent, and run every
 * collective over shared memory and over TCP with element counts 0, 1, 7, 33
 * and 1000003, checked against references computed here. Also: a mismatch is
 * reported on every rank and the communicator keeps working. */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

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
    cring_config_t cfg;
    cring_config_init(&cfg);
    cfg.rank = rank;
    cfg.size = size;
    cfg.store_addr = "127.0.0.1";
    cfg.store_port = port;
    cfg.serve_store = rank == 0;
    cfg.secret = "test-secret";
    cfg.transport = (cring_transport_kind_t)transport;
    cfg.timeout_s = 60;
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
                if (r == rank) { mine = table[r]; my_off = off; }
                off += table[r];
            }
            for (size_t i = 0; i < n; i++) in[i] = value(rank, i, salt);
            CHECK_OK(cring_reducescatter(comm, in, out, table, CRING_INT32, op));
            for (size_t i = 0; i < mine; i++) CHECK(out[i] == ref_reduce(op, size, my_off + i, salt));
        }
        /* broadcast from every root */
        for (int root = 0; root < size; root++) {
            for (size_t i = 0; i < n; i++) in[i] = rank == root ? value(root, i, 5) : -99;
            CHECK_OK(cring_broadcast(comm, in, n * sizeof *in, root));
            for (size_t i = 0; i < n; i++) CHECK(in[i] == value(root, i, 5));
        }
        /* allgatherv: rank r contributes n + r elements */
        size_t total = 0;
        for (int r = 0; r < size; r++) { table[r] = (n + (size_t)r) * sizeof(int32_t); total += n + (size_t)r; }
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
            for (size_t i = 0; i < sb[j]; i++) sbuf[o++] = (unsigned char)(rank * 31 + j * 7 + i % 251);
        CHECK_OK(cring_alltoallv(comm, sbuf, sb, rbuf, rb));
        o = 0;
        for (int q = 0; q < size; q++)
            for (size_t i = 0; i < rb[q]; i++) CHECK(rbuf[o++] == (unsigned char)(q * 31 + rank * 7 + i % 251));
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
    free(in); free(out); free(fin); free(fout); free(table);
    exit(0);
}

int main(void) {
    alarm(600);
    for (int size = 1; size <= 8; size++) {
        testutil_run_world(size, run_rank, CRING_TRANSPORT_AUTO, "comm over shm");
        testutil_run_world(size, run_rank, CRING_TRANSPORT_TCP, "comm over tcp");
    }
    TEST_DONE("test_comm");
    return 0;
}

/* adasum.c: the Adasum allreduce (Maleki et al., MLSys 2021; Horovod's
 * op=Adasum) over the communicator's own primitives (alltoallv, allgatherv),
 * so it runs on shared memory and TCP alike. Owns no transport state and never
 * touches a socket or a segment; the engine validates dtype and size first.
 *
 * ---- the pairwise combination ---------------------------------------------------
 * Two vectors a, b become
 *     (1 - a.b / (2 |a|^2)) a  +  (1 - a.b / (2 |b|^2)) b
 * (a coefficient is 1 when its vector's squared norm is below sqrt(DBL_MIN), so
 * a zero vector adds plainly). Orthogonal vectors add; equal vectors average.
 * Dot products and norms accumulate in float64 whatever the element type.
 *
 * ---- the distributed algorithm: vector halving, distance doubling --------------
 * P = 2^k ranks; the buffer holds n elements. Every rank starts with its own
 * vector and the whole range [0, n). At level d = 1, 2, 4, ..., P/2:
 *
 *     rank r and its partner r ^ d hold the same range [off, off + len); the
 *     one whose bit d is clear ("left") keeps the first len/2 elements, the
 *     other ("right") the rest. Each sends its partner the half it gives
 *     up (one alltoallv with a single non-zero entry per rank), so afterwards
 *     each holds, for its kept half, a = its own vector and b = its partner's.
 *
 *     Before level d, rank r's vector is the combination of the d ranks of its
 *     block (r with the low log2(d) bits cleared, d ranks). The left partner
 *     carries the lower block's vector L, the right one the upper block's R.
 *     The 2d ranks of the pair of blocks hold disjoint slices of L and R that
 *     cover [0, n), so summing each rank's partial [L.R, |L|^2, |R|^2] over
 *     those 2d ranks (one allgatherv of 3 doubles per tensor, summed in rank
 *     order so every rank gets bit-identical coefficients) gives the full dot
 *     product and norms; each rank then combines its slice in place.
 *
 *     d=1:  [0 1][2 3][4 5][6 7]   pairs combine g0,g1 -> L01 ...
 *     d=2:  [0 1 2 3][4 5 6 7]     adasum(L01, L23) ...
 *     d=4:  [0 ... 7]              adasum(L0123, L4567)
 *
 * So the result equals the pairwise tree adasum(adasum(g0, g1), adasum(g2, g3))
 * and so on. Rank r ends with a slice whose position is r's bits read from
 * the lowest up; one allgatherv of the slices and a copy into place finish.
 *
 * Several tensors fused in one buffer: each keeps its own coefficients. Every
 * level sums per-tensor partials over the intersection of the rank's slice
 * with the tensor's range, so tensors never mix their dot products. */
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "../common/common.h"
#include "../reduce/reduce.h"
#include "comm_internal.h"

int cring__adasum_supported(cring_dtype_t dtype) {
    return dtype == CRING_FLOAT16 || dtype == CRING_BFLOAT16 || dtype == CRING_FLOAT32 ||
           dtype == CRING_FLOAT64;
}

int cring__adasum_size_ok(int size) { return size >= 1 && (size & (size - 1)) == 0; }

/* Elements converted to float64 at a time for float16/bfloat16. */
#define BLOCK 512

/* count elements of dtype at p as float64 into out. */
static void load_f64(cring_dtype_t dtype, const void *p, size_t count, double *out) {
    cring__convert(CRING_FLOAT64, out, dtype, p, count, 1.0);
}

/* sums[0] += a.b, sums[1] += |a|^2, sums[2] += |b|^2 over count elements. */
static void dot_norms(cring_dtype_t dtype, const void *a, const void *b, size_t count,
                      double sums[3]) {
    double dot = 0, na = 0, nb = 0;
    if (dtype == CRING_FLOAT32) {
        const float *x = a, *y = b;
        for (size_t i = 0; i < count; i++) {
            double u = x[i], v = y[i];
            dot += u * v;
            na += u * u;
            nb += v * v;
        }
    } else if (dtype == CRING_FLOAT64) {
        const double *x = a, *y = b;
        for (size_t i = 0; i < count; i++) {
            dot += x[i] * y[i];
            na += x[i] * x[i];
            nb += y[i] * y[i];
        }
    } else {
        size_t es = cring_dtype_size(dtype);
        double x[BLOCK], y[BLOCK];
        for (size_t done = 0; done < count; done += BLOCK) {
            size_t k = count - done < BLOCK ? count - done : BLOCK;
            load_f64(dtype, (const unsigned char *)a + done * es, k, x);
            load_f64(dtype, (const unsigned char *)b + done * es, k, y);
            for (size_t i = 0; i < k; i++) {
                dot += x[i] * y[i];
                na += x[i] * x[i];
                nb += y[i] * y[i];
            }
        }
    }
    sums[0] += dot;
    sums[1] += na;
    sums[2] += nb;
}

/* a = ca * a + cb * b over count elements, computed in float64. */
static void scaled_add(cring_dtype_t dtype, void *a, const void *b, size_t count, double ca,
                       double cb) {
    if (dtype == CRING_FLOAT32) {
        float *x = a;
        const float *y = b;
        for (size_t i = 0; i < count; i++) x[i] = (float)(ca * (double)x[i] + cb * (double)y[i]);
    } else if (dtype == CRING_FLOAT64) {
        double *x = a;
        const double *y = b;
        for (size_t i = 0; i < count; i++) x[i] = ca * x[i] + cb * y[i];
    } else {
        size_t es = cring_dtype_size(dtype);
        double x[BLOCK], y[BLOCK];
        for (size_t done = 0; done < count; done += BLOCK) {
            size_t k = count - done < BLOCK ? count - done : BLOCK;
            unsigned char *at = (unsigned char *)a + done * es;
            load_f64(dtype, at, k, x);
            load_f64(dtype, (const unsigned char *)b + done * es, k, y);
            for (size_t i = 0; i < k; i++) x[i] = ca * x[i] + cb * y[i];
            cring__convert(dtype, at, CRING_FLOAT64, x, k, 1.0);
        }
    }
}

/* The coefficient of a vector with squared norm `norm2` against dot product `dot`. */
static double coefficient(double dot, double norm2) {
    return norm2 >= sqrt(DBL_MIN) ? 1.0 - dot / norm2 * 0.5 : 1.0;
}

typedef struct adasum_state {
    int rank, size, ntensors;
    size_t *slice_off, *slice_len; /* every rank's current range */
    size_t *tensor_off;            /* ntensors + 1 prefix sums of the counts */
    size_t *matrix;                /* size x size alltoallv bytes */
    size_t *gather_bytes;          /* size entries of 3 * ntensors doubles */
    double *mine, *all;            /* 3 * ntensors; size * 3 * ntensors */
    unsigned char *scratch;        /* n elements: the partner's half, then the final gather */
} adasum_state_t;

static void state_free(adasum_state_t *s) {
    free(s->slice_off);
    free(s->tensor_off);
    free(s->matrix);
    free(s->mine);
    free(s->scratch);
}

static cring_status_t state_init(adasum_state_t *s, cring_comm_t *comm, const size_t *counts,
                                 int ntensors, size_t n, size_t es) {
    memset(s, 0, sizeof *s);
    s->rank = cring_comm_rank(comm);
    s->size = cring_comm_size(comm);
    s->ntensors = ntensors;
    size_t P = (size_t)s->size, T = (size_t)ntensors;
    s->slice_off = malloc(sizeof(size_t) * 2 * P);
    s->tensor_off = malloc(sizeof(size_t) * (T + 1));
    s->matrix = malloc(sizeof(size_t) * (P * P + P));
    s->mine = malloc(sizeof(double) * 3 * T * (P + 1));
    s->scratch = malloc(n * es);
    if (!s->slice_off || !s->tensor_off || !s->matrix || !s->mine || !s->scratch) {
        state_free(s);
        return CRING_ERR_NO_MEMORY;
    }
    s->slice_len = s->slice_off + P;
    s->gather_bytes = s->matrix + P * P;
    s->all = s->mine + 3 * T;
    for (size_t q = 0; q < P; q++) {
        s->slice_off[q] = 0;
        s->slice_len[q] = n;
        s->gather_bytes[q] = 3 * T * sizeof(double);
    }
    s->tensor_off[0] = 0;
    for (size_t i = 0; i < T; i++) s->tensor_off[i + 1] = s->tensor_off[i] + counts[i];
    return CRING_OK;
}

/* Rank q's kept part of its current range at level d: the first half when
 * bit d of q is clear, else the second (the first half is len / 2 long). */
static void kept(const adasum_state_t *s, int q, size_t d, size_t *off, size_t *len) {
    size_t first = s->slice_len[q] / 2;
    if (((size_t)q & d) == 0) {
        *off = s->slice_off[q];
        *len = first;
    } else {
        *off = s->slice_off[q] + first;
        *len = s->slice_len[q] - first;
    }
}

/* One level: exchange halves with the partner, sum the per-tensor partials
 * over the 2d-rank group, combine this rank's slice in place. */
static cring_status_t level(adasum_state_t *s, cring_comm_t *comm, void *buf, cring_dtype_t dtype,
                            size_t d) {
    const size_t P = (size_t)s->size, T = (size_t)s->ntensors, es = cring_dtype_size(dtype);
    const int r = s->rank, left = ((size_t)r & d) == 0;
    memset(s->matrix, 0, sizeof(size_t) * P * P);
    for (size_t q = 0; q < P; q++) {
        size_t koff, klen, partner = q ^ d;
        kept(s, (int)q, d, &koff, &klen);
        /* q gives away the rest of its range: what the partner keeps */
        s->matrix[q * P + partner] = (s->slice_len[q] - klen) * es;
    }
    size_t off, len;
    kept(s, r, d, &off, &len);
    size_t give_off = left ? off + len : s->slice_off[r];
    unsigned char *base = buf;
    CRING_CHECK(cring__comm_alltoallv(comm, base + give_off * es, s->scratch, s->matrix));

    /* a = this rank's own vector on [off, off+len) (in buf), b = the partner's
     * (scratch holds element off at 0). Partials as [dot, |left|^2, |right|^2]
     * per tensor. */
    for (size_t i = 0; i < T; i++) {
        double sums[3] = {0, 0, 0};
        size_t lo = s->tensor_off[i] > off ? s->tensor_off[i] : off;
        size_t hi = s->tensor_off[i + 1] < off + len ? s->tensor_off[i + 1] : off + len;
        if (lo < hi) dot_norms(dtype, base + lo * es, s->scratch + (lo - off) * es, hi - lo, sums);
        s->mine[3 * i] = sums[0];
        s->mine[3 * i + 1] = left ? sums[1] : sums[2];
        s->mine[3 * i + 2] = left ? sums[2] : sums[1];
    }
    CRING_CHECK(
        cring__comm_allgatherv(comm, s->mine, 3 * T * sizeof(double), s->all, s->gather_bytes));
    size_t group = (size_t)r & ~(2 * d - 1);
    for (size_t i = 0; i < T; i++) {
        double dot = 0, nl = 0, nr = 0;
        for (size_t q = group; q < group + 2 * d; q++) {
            const double *p = s->all + q * 3 * T + 3 * i;
            dot += p[0];
            nl += p[1];
            nr += p[2];
        }
        double cl = coefficient(dot, nl), cr = coefficient(dot, nr);
        size_t lo = s->tensor_off[i] > off ? s->tensor_off[i] : off;
        size_t hi = s->tensor_off[i + 1] < off + len ? s->tensor_off[i + 1] : off + len;
        if (lo < hi)
            scaled_add(dtype, base + lo * es, s->scratch + (lo - off) * es, hi - lo, left ? cl : cr,
                       left ? cr : cl);
    }
    for (size_t q = 0; q < P; q++) {
        size_t koff, klen;
        kept(s, (int)q, d, &koff, &klen);
        s->matrix[q] = koff; /* reuse as scratch: the new ranges after the loop */
        s->slice_len[q] = klen;
    }
    for (size_t q = 0; q < P; q++) s->slice_off[q] = s->matrix[q];
    return CRING_OK;
}

/* Everyone's final slice to everyone, then each slice copied into place. */
static cring_status_t gather_slices(adasum_state_t *s, cring_comm_t *comm, void *buf, size_t es) {
    const size_t P = (size_t)s->size;
    unsigned char *base = buf;
    size_t *bytes = s->matrix; /* P entries */
    for (size_t q = 0; q < P; q++) bytes[q] = s->slice_len[q] * es;
    CRING_CHECK(cring__comm_allgatherv(comm, base + s->slice_off[s->rank] * es, bytes[s->rank],
                                       s->scratch, bytes));
    size_t at = 0;
    for (size_t q = 0; q < P; q++) {
        if ((int)q != s->rank && bytes[q])
            memcpy(base + s->slice_off[q] * es, s->scratch + at, bytes[q]);
        at += bytes[q];
    }
    return CRING_OK;
}

cring_status_t cring__comm_adasum(cring_comm_t *comm, void *buf, cring_dtype_t dtype,
                                  const size_t *counts, int ntensors) {
    if (!comm || ntensors < 0 || (ntensors && !counts) || !cring__adasum_supported(dtype))
        return CRING_ERR_INVALID_ARGUMENT;
    int size = cring_comm_size(comm);
    if (!cring__adasum_size_ok(size)) return CRING_ERR_NOT_SUPPORTED;
    size_t n = 0, es = cring_dtype_size(dtype);
    for (int i = 0; i < ntensors; i++) n += counts[i];
    if (size == 1 || n == 0) return CRING_OK; /* the same on every rank: shapes agree */
    if (!buf) return CRING_ERR_INVALID_ARGUMENT;
    adasum_state_t s;
    CRING_CHECK(state_init(&s, comm, counts, ntensors, n, es));
    cring_status_t st = CRING_OK;
    for (size_t d = 1; d < (size_t)size && st == CRING_OK; d <<= 1)
        st = level(&s, comm, buf, dtype, d);
    if (st == CRING_OK) st = gather_slices(&s, comm, buf, es);
    state_free(&s);
    return st;
}

/* test_reduce.c: checks every reduction kernel (dtype x op x count, in place and
 * out of place, 1..5 sources, AVERAGE) against a plain reference written here,
 * once per kernel family: the program re-runs itself with each value of
 * CRING_REDUCE_ISA. Ends with a timing printout (informative, not asserted). */
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/common.h"
#include "reduce/reduce.h"
#include "reduce/reduce_impl.h"
#include "testutil.h"

/* ---- reference float16 / bfloat16 converters -------------------------------
 * Written differently from the library's on purpose: through double arithmetic
 * (ldexp / frexp / rint, which rounds half to even in the default mode). */
static float ref_f16_to_f32(uint16_t h) {
    int sign = h >> 15, exponent = (h >> 10) & 31, mantissa = h & 1023;
    double v;
    if (exponent == 31) v = mantissa ? NAN : INFINITY;
    else if (exponent == 0) v = ldexp(mantissa, -24);
    else v = ldexp(1024 + mantissa, exponent - 25);
    return (float)(sign ? -v : v);
}

static uint16_t ref_f32_to_f16(float f) {
    if (isnan(f)) return 0x7e00;
    uint16_t sign = signbit(f) ? 0x8000 : 0;
    double a = fabs((double)f);
    if (a >= 65520.0) return sign | 0x7c00;
    if (a < ldexp(1.0, -14)) return sign | (uint16_t)rint(ldexp(a, 24)); /* may reach 0x400 */
    int e;
    frexp(a, &e); /* a = m * 2^e, m in [0.5, 1) */
    int exponent = e - 1;
    double q = rint((ldexp(a, -exponent) - 1.0) * 1024.0);
    if (q >= 1024.0) {
        q = 0;
        exponent++;
    }
    if (exponent + 15 >= 31) return sign | 0x7c00;
    return sign | (uint16_t)((exponent + 15) << 10) | (uint16_t)q;
}

static float ref_bf16_to_f32(uint16_t b) {
    int sign = b >> 15, exponent = (b >> 7) & 255, mantissa = b & 127;
    double v;
    if (exponent == 255) v = mantissa ? NAN : INFINITY;
    else if (exponent == 0) v = ldexp(mantissa, -133);
    else v = ldexp(128 + mantissa, exponent - 134);
    return (float)(sign ? -v : v);
}

static uint16_t ref_f32_to_bf16(float f) {
    if (isnan(f)) return 0x7fc0;
    uint16_t sign = signbit(f) ? 0x8000 : 0;
    double a = fabs((double)f);
    if (isinf(f)) return sign | 0x7f80;
    if (a < ldexp(1.0, -126)) return sign | (uint16_t)rint(ldexp(a, 133));
    int e;
    frexp(a, &e);
    int exponent = e - 1;
    double q = rint((ldexp(a, -exponent) - 1.0) * 128.0);
    if (q >= 128.0) {
        q = 0;
        exponent++;
    }
    if (exponent + 127 >= 255) return sign | 0x7f80;
    return sign | (uint16_t)((exponent + 127) << 7) | (uint16_t)q;
}

/* ---- reference reduction ------------------------------------------------------ */
static const cring_dtype_t all_dtypes[] = {
    CRING_FLOAT16, CRING_BFLOAT16, CRING_FLOAT32, CRING_FLOAT64, CRING_INT8,  CRING_UINT8,
    CRING_INT16,   CRING_UINT16,   CRING_INT32,   CRING_UINT32,  CRING_INT64, CRING_UINT64};
static const cring_op_t all_ops[] = {CRING_SUM, CRING_AVERAGE, CRING_MIN, CRING_MAX, CRING_PRODUCT};
#define N_DTYPES (sizeof all_dtypes / sizeof all_dtypes[0])
#define N_OPS (sizeof all_ops / sizeof all_ops[0])

static double ref_fcombine(cring_op_t op, double a, double x) {
    switch (op) {
    case CRING_SUM:
    case CRING_AVERAGE: return a + x;
    case CRING_PRODUCT: return a * x;
    case CRING_MIN: return (isnan(x) || x < a) ? x : a; /* NaN wins; ties keep the first */
    case CRING_MAX: return (isnan(x) || x > a) ? x : a;
    default: return NAN;
    }
}

static float ref_fcombine32(cring_op_t op, float a, float x) {
    switch (op) {
    case CRING_SUM:
    case CRING_AVERAGE: return a + x;
    case CRING_PRODUCT: return a * x;
    case CRING_MIN: return (isnan(x) || x < a) ? x : a;
    case CRING_MAX: return (isnan(x) || x > a) ? x : a;
    default: return NAN;
    }
}

/* Load element i of an integer array, sign-extended for signed dtypes. uint64
 * values above INT64_MAX come out negative: the reference compares and
 * divides uint64 separately (ref_is_u64). */
static int64_t ref_iload(cring_dtype_t dt, const void *p, size_t i) {
    switch (dt) {
    case CRING_INT8: return ((const int8_t *)p)[i];
    case CRING_UINT8: return ((const uint8_t *)p)[i];
    case CRING_INT16: return ((const int16_t *)p)[i];
    case CRING_UINT16: return ((const uint16_t *)p)[i];
    case CRING_INT32: return ((const int32_t *)p)[i];
    case CRING_UINT32: return ((const uint32_t *)p)[i];
    default: return ((const int64_t *)p)[i];
    }
}

static void ref_istore(cring_dtype_t dt, void *p, size_t i, uint64_t v) {
    switch (dt) {
    case CRING_INT8:
    case CRING_UINT8: ((uint8_t *)p)[i] = (uint8_t)v; break;
    case CRING_INT16:
    case CRING_UINT16: ((uint16_t *)p)[i] = (uint16_t)v; break;
    case CRING_INT32:
    case CRING_UINT32: ((uint32_t *)p)[i] = (uint32_t)v; break;
    default: ((uint64_t *)p)[i] = v; break;
    }
}

/* Truncate to the dtype width and sign-extend again (models wrap-around). */
static int64_t ref_wrap(cring_dtype_t dt, uint64_t v) {
    switch (dt) {
    case CRING_INT8: return (int8_t)(uint8_t)v;
    case CRING_UINT8: return (uint8_t)v;
    case CRING_INT16: return (int16_t)(uint16_t)v;
    case CRING_UINT16: return (uint16_t)v;
    case CRING_INT32: return (int32_t)(uint32_t)v;
    case CRING_UINT32: return (uint32_t)v;
    default: return (int64_t)v;
    }
}

static int ref_is_u64(cring_dtype_t dt) { return dt == CRING_UINT64; }

/* out[i] = fold of op over srcs[0..nsrc)[i], then / divisor when divide. */
static void ref_reduce(cring_dtype_t dt, cring_op_t op, void *out, const void *const *srcs,
                       int nsrc, size_t count, int divisor, int divide) {
    for (size_t i = 0; i < count; i++) {
        switch (dt) {
        case CRING_FLOAT16:
        case CRING_BFLOAT16: {
            float (*load)(uint16_t) = dt == CRING_FLOAT16 ? ref_f16_to_f32 : ref_bf16_to_f32;
            float acc = load(((const uint16_t *)srcs[0])[i]);
            for (int k = 1; k < nsrc; k++)
                acc = ref_fcombine32(op, acc, load(((const uint16_t *)srcs[k])[i]));
            if (divide) acc = acc / (float)divisor;
            ((uint16_t *)out)[i] = dt == CRING_FLOAT16 ? ref_f32_to_f16(acc) : ref_f32_to_bf16(acc);
            break;
        }
        case CRING_FLOAT32: {
            float acc = ((const float *)srcs[0])[i];
            for (int k = 1; k < nsrc; k++)
                acc = ref_fcombine32(op, acc, ((const float *)srcs[k])[i]);
            if (divide) acc = acc / (float)divisor;
            ((float *)out)[i] = acc;
            break;
        }
        case CRING_FLOAT64: {
            double acc = ((const double *)srcs[0])[i];
            for (int k = 1; k < nsrc; k++)
                acc = ref_fcombine(op, acc, ((const double *)srcs[k])[i]);
            if (divide) acc = acc / (double)divisor;
            ((double *)out)[i] = acc;
            break;
        }
        default: {
            int64_t acc = ref_iload(dt, srcs[0], i);
            for (int k = 1; k < nsrc; k++) {
                int64_t x = ref_iload(dt, srcs[k], i);
                switch (op) {
                case CRING_SUM:
                case CRING_AVERAGE: acc = ref_wrap(dt, (uint64_t)acc + (uint64_t)x); break;
                case CRING_PRODUCT: acc = ref_wrap(dt, (uint64_t)acc * (uint64_t)x); break;
                case CRING_MIN:
                    if (ref_is_u64(dt)) acc = (uint64_t)x < (uint64_t)acc ? x : acc;
                    else acc = x < acc ? x : acc;
                    break;
                case CRING_MAX:
                    if (ref_is_u64(dt)) acc = (uint64_t)x > (uint64_t)acc ? x : acc;
                    else acc = x > acc ? x : acc;
                    break;
                default: break;
                }
            }
            if (divide && ref_is_u64(dt)) acc = (int64_t)((uint64_t)acc / (uint64_t)divisor);
            else if (divide) acc = acc / divisor;
            ref_istore(dt, out, i, (uint64_t)acc);
            break;
        }
        }
    }
}

/* Equal bit for bit, except that any NaN equals any NaN. */
static int same_element(cring_dtype_t dt, const void *a, const void *b, size_t i) {
    switch (dt) {
    case CRING_FLOAT16: {
        uint16_t x = ((const uint16_t *)a)[i], y = ((const uint16_t *)b)[i];
        if ((x & 0x7fff) > 0x7c00 && (y & 0x7fff) > 0x7c00) return 1;
        return x == y;
    }
    case CRING_BFLOAT16: {
        uint16_t x = ((const uint16_t *)a)[i], y = ((const uint16_t *)b)[i];
        if ((x & 0x7fff) > 0x7f80 && (y & 0x7fff) > 0x7f80) return 1;
        return x == y;
    }
    case CRING_FLOAT32: {
        float x = ((const float *)a)[i], y = ((const float *)b)[i];
        if (isnan(x) && isnan(y)) return 1;
        return !memcmp(&x, &y, sizeof x);
    }
    case CRING_FLOAT64: {
        double x = ((const double *)a)[i], y = ((const double *)b)[i];
        if (isnan(x) && isnan(y)) return 1;
        return !memcmp(&x, &y, sizeof x);
    }
    default: {
        size_t es = cring_dtype_size(dt);
        return !memcmp((const char *)a + i * es, (const char *)b + i * es, es);
    }
    }
}

static int mismatches_reported = 0;

static void expect_same(const char *what, cring_dtype_t dt, cring_op_t op, size_t count, int nsrc,
                        const void *got, const void *want) {
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < count; i++)
        if (!same_element(dt, got, want, i)) {
            if (!bad) first = i;
            bad++;
        }
    if (bad && mismatches_reported++ < 10) {
        size_t es = cring_dtype_size(dt);
        uint64_t g = 0, w = 0;
        memcpy(&g, (const char *)got + first * es, es);
        memcpy(&w, (const char *)want + first * es, es);
        fprintf(stderr,
                "%s %s %s count=%zu nsrc=%d isa=%s: %zu bad, first at %zu got 0x%llx want "
                "0x%llx\n",
                what, cring_dtype_name(dt), cring_op_name(op), count, nsrc, cring__reduce_isa(),
                bad, first, (unsigned long long)g, (unsigned long long)w);
    }
    CHECK(bad == 0);
}

/* ---- inputs -------------------------------------------------------------------- */
static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static uint64_t rng(void) { /* xorshift64* */
    rng_state ^= rng_state >> 12;
    rng_state ^= rng_state << 25;
    rng_state ^= rng_state >> 27;
    return rng_state * 0x2545f4914f6cdd1dull;
}

/* Specials first (pairs chosen so source 0 op source 1 hits the hard cases),
 * then random values: half "ordinary" numbers, the rest raw bit patterns. */
static const uint16_t f16_special[][2] = {
    {0x3c00, 0x1000}, /* 1 + 2^-11: a tie, stays 1 (even) */
    {0x3c01, 0x1000}, /* (1 + 2^-10) + 2^-11: a tie, rounds up to 0x3c02 */
    {0x0001, 0x0001}, /* smallest subnormals */
    {0x03ff, 0x0001}, /* largest subnormal + smallest: becomes the smallest normal */
    {0x8001, 0x0002}, /* subnormals of both signs */
    {0x7bff, 0x7bff}, /* 65504 + 65504: overflow to inf */
    {0x7bff, 0x5000}, /* 65504 + 32 = 65536: above the 65520 tie, inf */
    {0x7bff, 0x4c00}, /* 65504 + 16 = 65520: the tie to inf */
    {0x7c00, 0xfc00}, /* inf + -inf = NaN */
    {0x7e00, 0x3c00}, /* NaN with a number */
    {0x3c00, 0x7e01}, /* number with a NaN */
    {0x8000, 0x0000}, /* -0, +0 */
    {0x0000, 0x8000}, /* +0, -0 */
    {0x7c00, 0x3c00}, /* inf */
    {0x0200, 0x4000}, /* subnormal * 2 */
    {0x0001, 0x3800}, /* 2^-24 * 0.5 = 2^-25: tie to zero */
    {0x0003, 0x3800}, /* 3 * 2^-25: tie, rounds to 2 * 2^-24 (even) */
    {0x7d00, 0x7c00}, /* signalling-looking NaN */
};
static const uint16_t bf16_special[][2] = {
    {0x3f80, 0x3b80}, /* 1 + 2^-8: a tie, stays 1 */
    {0x3f81, 0x3b80}, /* a tie that rounds up */
    {0x0001, 0x0001}, /* subnormals */
    {0x7f7f, 0x7f7f}, /* max + max: inf */
    {0x7f80, 0xff80}, /* inf + -inf */
    {0x7fc0, 0x3f80}, /* NaN */
    {0x3f80, 0x7f81}, /* number with a NaN whose top payload bits are small */
    {0x8000, 0x0000}, /* -0, +0 */
    {0x0000, 0x8000},
};

static void fill(cring_dtype_t dt, void *buf, size_t count, int which) {
    for (size_t i = 0; i < count; i++) {
        uint64_t r = rng();
        switch (dt) {
        case CRING_FLOAT16: {
            size_t nspecial = sizeof f16_special / sizeof f16_special[0];
            uint16_t v;
            if (i < nspecial && which < 2) v = f16_special[i][which];
            else if (r & 1) v = (uint16_t)(r >> 16);
            else v = ref_f32_to_f16((float)((int)((r >> 8) % 2001) - 1000) / 64.0f);
            ((uint16_t *)buf)[i] = v;
            break;
        }
        case CRING_BFLOAT16: {
            size_t nspecial = sizeof bf16_special / sizeof bf16_special[0];
            uint16_t v;
            if (i < nspecial && which < 2) v = bf16_special[i][which];
            else if (r & 1) v = (uint16_t)(r >> 16);
            else v = ref_f32_to_bf16((float)((int)((r >> 8) % 2001) - 1000) / 8.0f);
            ((uint16_t *)buf)[i] = v;
            break;
        }
        case CRING_FLOAT32: {
            float v;
            if ((r & 15) == 0) {
                uint32_t bits = (uint32_t)(r >> 20);
                memcpy(&v, &bits, sizeof v); /* anything: NaN, inf, subnormal */
            } else {
                v = ldexpf((float)((int64_t)(r >> 20) % 100000) / 1000.0f,
                           (int)((r >> 8) % 40) - 20);
                if (r >> 63) v = -v;
            }
            ((float *)buf)[i] = v;
            break;
        }
        case CRING_FLOAT64: {
            double v;
            if ((r & 15) == 0) {
                uint64_t bits = rng();
                memcpy(&v, &bits, sizeof v);
            } else {
                v = ldexp((double)((int64_t)(r >> 20) % 1000000) / 1000.0,
                          (int)((r >> 8) % 80) - 40);
                if (r >> 63) v = -v;
            }
            ((double *)buf)[i] = v;
            break;
        }
        default: {
            size_t es = cring_dtype_size(dt);
            /* small values sometimes, so MIN/MAX/PRODUCT see ordinary numbers too */
            uint64_t v = (r & 3) == 0 ? (uint64_t)((int64_t)(r >> 32) % 7) : rng();
            memcpy((char *)buf + i * es, &v, es);
            break;
        }
        }
    }
}

/* ---- the checks for the kernel family this process chose ---------------------------- */
#define MAX_SRC 5

static void run_checks(void) {
    /* 65539 = 16 tiles of INT_AVERAGE_TILE plus 3, and 3 past a multiple of
     * every vector width: the same loop paths and tails as a million elements
     * (which this sweep used until it was 2.5 of the CI's 17 minutes). */
    static const size_t counts[] = {0, 1, 7, 33, 65539};
    const size_t maxcount = 65539;
    void *src[MAX_SRC], *dst = malloc(maxcount * 8), *want = malloc(maxcount * 8);
    void *work[MAX_SRC];
    CHECK(dst && want);
    for (int k = 0; k < MAX_SRC; k++) {
        src[k] = malloc(maxcount * 8);
        work[k] = malloc(maxcount * 8);
        CHECK(src[k] && work[k]);
    }

    for (size_t d = 0; d < N_DTYPES; d++) {
        cring_dtype_t dt = all_dtypes[d];
        size_t es = cring_dtype_size(dt);
        for (int k = 0; k < MAX_SRC; k++) fill(dt, src[k], maxcount, k);
        for (size_t o = 0; o < N_OPS; o++) {
            cring_op_t op = all_ops[o];
            CHECK(cring__reduce_supported(dt, op));
            for (size_t c = 0; c < sizeof counts / sizeof counts[0]; c++) {
                size_t n = counts[c];
                const void *two[2] = {src[0], src[1]};

                /* reduce_inplace: dst = src0 op src1 (AVERAGE acts as SUM) */
                memcpy(dst, src[0], n * es);
                cring__reduce_inplace(dt, op, dst, src[1], n);
                ref_reduce(dt, op, want, two, 2, n, 1, 0);
                expect_same("inplace", dt, op, n, 2, dst, want);

                /* reduce_inplace with dst == src */
                memcpy(dst, src[2], n * es);
                cring__reduce_inplace(dt, op, dst, dst, n);
                const void *same[2] = {src[2], src[2]};
                ref_reduce(dt, op, want, same, 2, n, 1, 0);
                expect_same("inplace-self", dt, op, n, 2, dst, want);

                /* reduce_multi into a separate dst, nsrc = 1..5, divisor = nsrc */
                for (int nsrc = 1; nsrc <= MAX_SRC; nsrc++) {
                    memset(dst, 0xa5, n * es);
                    cring__reduce_multi(dt, op, dst, (const void *const *)src, nsrc, n, nsrc);
                    ref_reduce(dt, op, want, (const void *const *)src, nsrc, n, nsrc,
                               op == CRING_AVERAGE);
                    expect_same("multi", dt, op, n, nsrc, dst, want);
                }

                /* reduce_multi in place: dst == srcs[0], and dst == srcs[last] */
                for (int nsrc = 1; nsrc <= MAX_SRC; nsrc += 2) {
                    for (int where = 0; where < 2; where++) {
                        int alias = where ? nsrc - 1 : 0;
                        const void *srcs[MAX_SRC];
                        for (int k = 0; k < nsrc; k++) {
                            memcpy(work[k], src[k], n * es);
                            srcs[k] = work[k];
                        }
                        ref_reduce(dt, op, want, (const void *const *)src, nsrc, n, 7,
                                   op == CRING_AVERAGE);
                        cring__reduce_multi(dt, op, work[alias], srcs, nsrc, n, 7);
                        expect_same("multi-inplace", dt, op, n, nsrc, work[alias], want);
                    }
                }
            }
        }
        /* reduce_average alone, divisors 1, 3 and 8 */
        for (size_t c = 0; c < sizeof counts / sizeof counts[0]; c++) {
            size_t n = counts[c];
            static const int divisors[] = {1, 3, 8};
            for (int v = 0; v < 3; v++) {
                memcpy(dst, src[3], n * es);
                cring__reduce_average(dt, dst, n, divisors[v]);
                const void *one[1] = {src[3]};
                ref_reduce(dt, CRING_AVERAGE, want, one, 1, n, divisors[v], 1);
                expect_same("average", dt, CRING_AVERAGE, n, 1, dst, want);
            }
        }
    }
    for (int k = 0; k < MAX_SRC; k++) {
        free(src[k]);
        free(work[k]);
    }
    free(dst);
    free(want);
}

/* The converters of reduce_impl.h against the references, over every input. */
/* cring__copy_stream: every length around the streaming threshold and the
 * vector widths, every source and destination misalignment within a cache
 * line; the bytes right before and after dst stay untouched. */
static void check_copy_stream(void) {
    const size_t max = 3 * CRING__COPY_STREAM_MIN_BYTES + 300;
    unsigned char *src = malloc(max + 128), *dst = malloc(max + 256);
    CHECK(src && dst);
    for (size_t i = 0; i < max + 128; i++) src[i] = (unsigned char)(i * 7 + i / 251);
    static const size_t lens[] = {0,    1,    31,   63,   64,   65,   127,  1000,
                                  1023, 1024, 1025, 1087, 1151, 2048, 2111, 3 * 1024 + 191};
    for (size_t li = 0; li < sizeof lens / sizeof lens[0]; li++) {
        size_t n = lens[li];
        CHECK(n <= max);
        for (size_t so = 0; so < 64; so += 5) {
            for (size_t dso = 0; dso < 64; dso += 3) {
                unsigned char *d = dst + 64 + dso;
                memset(dst, 0xa5, max + 256);
                cring__copy_stream(d, src + so, n);
                CHECK(memcmp(d, src + so, n) == 0);
                CHECK(d[-1] == 0xa5 && d[n] == 0xa5);
            }
        }
    }
    /* a large copy, 1 byte off alignment on both sides */
    size_t big = (8u << 20) + 77;
    unsigned char *a = malloc(big + 1), *b = malloc(big + 2);
    CHECK(a && b);
    for (size_t i = 0; i < big + 1; i++) a[i] = (unsigned char)(i ^ (i >> 9));
    memset(b, 0, big + 2);
    cring__copy_stream(b + 1, a + 1, big);
    CHECK(memcmp(b + 1, a + 1, big) == 0 && b[0] == 0 && b[big + 1] == 0);
    printf("  copy_stream (%s): ok\n", cring__copy_stream_isa());
    free(a);
    free(b);
    free(src);
    free(dst);
}

static void check_converters(void) {
    for (uint32_t h = 0; h < 65536; h++) {
        float a = cring__f16_to_f32((uint16_t)h), b = ref_f16_to_f32((uint16_t)h);
        CHECK((isnan(a) && isnan(b)) || !memcmp(&a, &b, sizeof a));
        a = cring__bf16_to_f32((uint16_t)h);
        b = ref_bf16_to_f32((uint16_t)h);
        CHECK((isnan(a) && isnan(b)) || !memcmp(&a, &b, sizeof a));
    }
    /* float -> half: every 997th float bit pattern (the ties are checked below) */
    for (uint64_t x = 0; x <= 0xffffffffull; x += 997) {
        uint32_t bits = (uint32_t)x;
        float f;
        memcpy(&f, &bits, sizeof f);
        uint16_t h = cring__f32_to_f16(f), rh = ref_f32_to_f16(f);
        if (isnan(f)) CHECK((h & 0x7fff) > 0x7c00);
        else CHECK(h == rh);
        uint16_t bf = cring__f32_to_bf16(f), rbf = ref_f32_to_bf16(f);
        if (isnan(f)) CHECK((bf & 0x7fff) > 0x7f80);
        else CHECK(bf == rbf);
    }
    /* exact ties between neighbouring halves round to the even one */
    for (uint32_t h = 0; h < 0x7bff; h++) {
        float lo = ref_f16_to_f32((uint16_t)h), hi = ref_f16_to_f32((uint16_t)(h + 1));
        float mid = (float)(((double)lo + (double)hi) / 2);
        uint16_t want = (h & 1) ? (uint16_t)(h + 1) : (uint16_t)h;
        CHECK(cring__f32_to_f16(mid) == want);
        CHECK(cring__f32_to_f16(-mid) == (want | 0x8000));
    }
    CHECK(!cring__reduce_supported(CRING_BOOL, CRING_SUM));
    CHECK(!cring__reduce_supported(CRING_FLOAT32, CRING_ADASUM));
    CHECK(!cring__reduce_supported(CRING_DTYPE_COUNT, CRING_SUM));
    CHECK(!cring__reduce_supported(CRING_FLOAT32, CRING_OP_COUNT));
}

/* ---- timing (printed, not asserted) --------------------------------------------------- */
static double time_best(void (*fn)(void *), void *arg, int reps) {
    double best = 1e30;
    for (int r = 0; r < reps; r++) {
        double t0 = cring__now_s();
        fn(arg);
        double t = cring__now_s() - t0;
        if (t < best) best = t;
    }
    return best;
}

struct timing_case {
    cring_dtype_t dtype;
    void *dst, *src;
    size_t count;
    int scalar;
};

static void run_sum(void *arg) {
    struct timing_case *c = arg;
    if (c->scalar) {
        const void *srcs[2] = {c->dst, c->src};
        cring__reduce_scalar_kernels.fn[c->dtype][CRING__K_SUM](c->dst, srcs, 2, 0, c->count, 1);
    } else {
        cring__reduce_inplace(c->dtype, CRING_SUM, c->dst, c->src, c->count);
    }
}

static void run_copy(void *arg) {
    struct timing_case *c = arg;
    memcpy(c->dst, c->src, c->count * cring_dtype_size(c->dtype));
}

static void run_copy_stream(void *arg) {
    struct timing_case *c = arg;
    cring__copy_stream(c->dst, c->src, c->count * cring_dtype_size(c->dtype));
}

static void print_timings(void) {
    size_t big = 64u << 20;
    void *a = malloc(big), *b = malloc(big);
    CHECK(a && b);
    memset(a, 0, big); /* zeros: every dtype sums without NaN/inf slow paths */
    memset(b, 0, big);
    printf("timing (best of 5; bandwidth counts 2 reads + 1 write), kernels: %s\n",
           cring__reduce_isa());
    struct timing_case cases[] = {
        {CRING_FLOAT32, a, b, (16u << 20) / 4, 1},  {CRING_FLOAT32, a, b, (16u << 20) / 4, 0},
        {CRING_FLOAT16, a, b, (16u << 20) / 2, 1},  {CRING_FLOAT16, a, b, (16u << 20) / 2, 0},
        {CRING_BFLOAT16, a, b, (16u << 20) / 2, 1}, {CRING_BFLOAT16, a, b, (16u << 20) / 2, 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        struct timing_case *c = &cases[i];
        double t = time_best(run_sum, c, 5);
        double bytes = (double)c->count * (double)cring_dtype_size(c->dtype);
        printf("  %-8s sum 16 MiB  %-8s %8.3f ms  %6.1f GB/s\n", cring_dtype_name(c->dtype),
               c->scalar ? "scalar" : cring__reduce_isa(), t * 1e3, 3 * bytes / t / 1e9);
    }
    struct timing_case f32big = {CRING_FLOAT32, a, b, big / 4, 0};
    double t = time_best(run_sum, &f32big, 5);
    printf("  float32  sum 64 MiB  %-8s %8.3f ms  %6.1f GB/s\n", cring__reduce_isa(), t * 1e3,
           3.0 * (double)big / t / 1e9);
    t = time_best(run_copy, &f32big, 5);
    printf("  memcpy       64 MiB  (reference) %8.3f ms  %6.1f GB/s (1 read + 1 write)\n", t * 1e3,
           2.0 * (double)big / t / 1e9);
    t = time_best(run_copy_stream, &f32big, 5);
    printf("  copy_stream  64 MiB  %-11s %8.3f ms  %6.1f GB/s (1 read + 1 write)\n",
           cring__copy_stream_isa(), t * 1e3, 2.0 * (double)big / t / 1e9);
    free(a);
    free(b);
}

int main(int argc, char **argv) {
    if (argc > 1 && !strcmp(argv[1], "--child")) {
        check_converters();
        check_copy_stream();
        run_checks();
        printf("  kernels %-6s (CRING_REDUCE_ISA=%s): %d checks passed\n", cring__reduce_isa(),
               getenv("CRING_REDUCE_ISA") ? getenv("CRING_REDUCE_ISA") : "", testutil_checks);
        return 0;
    }
    /* Each kernel family is chosen once per process, so run the checks in a
     * fresh copy of this program per CRING_REDUCE_ISA value. */
    /* the fourth: AVX-512 with the packus bfloat16 kernels, which a CPU with
     * AVX512_BF16 would otherwise never run */
    static const char *const isas[] = {"scalar", "avx2", "avx512", "avx512"};
    for (int i = 0; i < 4; i++) {
        fflush(stdout);
        pid_t pid = fork();
        CHECK(pid >= 0);
        if (pid == 0) {
            setenv("CRING_REDUCE_ISA", isas[i], 1);
            if (i == 3) setenv("CRING_REDUCE_BF16", "pack", 1);
            char *child_argv[] = {argv[0], "--child", NULL};
            execv("/proc/self/exe", child_argv);
            _exit(127);
        }
        int status = 0;
        CHECK(waitpid(pid, &status, 0) == pid);
        if (!WIFEXITED(status) || WEXITSTATUS(status) != 0)
            fprintf(stderr, "checks under CRING_REDUCE_ISA=%s failed (status %d)\n", isas[i],
                    status);
        CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0);
    }
    print_timings();
    TEST_DONE("test_reduce");
    return 0;
}

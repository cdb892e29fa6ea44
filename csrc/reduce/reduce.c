/* reduce.c: the portable (scalar) reduction kernels, the one-time choice of the
 * kernel family for this CPU, and the entry points of reduce.h.
 * Pure computation: no communication, no allocation, no -march=native. */
#include "reduce/reduce.h"

#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/common.h"
#include "reduce/reduce_impl.h"

/* ---- Semantics shared by every kernel family --------------------------------
 * - Integers wrap modulo 2^bits: sums and products are computed in the unsigned
 *   type of the same width; MIN/MAX compare as signed (int8/16/32/64) or
 *   unsigned (uint8/16/32/64). Integer AVERAGE divides the wrapped sum toward zero.
 * - Floating MIN/MAX propagate NaN like numpy.minimum/maximum: if either input
 *   is NaN the result is NaN. MIN(-0, +0) returns whichever came first.
 * - float16/bfloat16 are widened to float32, combined (all sources, then the
 *   AVERAGE division), and rounded to nearest even once at the store.
 * - Sources are combined left to right (srcs[0] op srcs[1] op ...), so every
 *   family gives bit-identical results. */

/* ---- scalar combine helpers ------------------------------------------------- */
#define S_SUM(a, x) ((a) + (x))
#define S_PROD(a, x) ((a) * (x))
/* NaN-propagating: take x when it is smaller or NaN, else keep a (a NaN a stays). */
#define S_FMIN(a, x) (((x) < (a) || (x) != (x)) ? (x) : (a))
#define S_FMAX(a, x) (((x) > (a) || (x) != (x)) ? (x) : (a))

/* The per-element load/store in the compute type. */
#define LD_SAME(v) (v)
#define ST_SAME(v) (v)
#define LD_F16(v) cring__f16_to_f32(v)
#define ST_F16(v) cring__f32_to_f16(v)
#define LD_BF16(v) cring__bf16_to_f32(v)
#define ST_BF16(v) cring__f32_to_bf16(v)

/* One scalar kernel: T is the stored type, C the compute type. */
#define SCALAR_KERNEL(fname, T, C, LD, ST, COMBINE, DIVIDE)                                        \
    static void fname(void *dst_, const void *const *srcs, int nsrc, size_t begin, size_t end,     \
                      int divisor) {                                                               \
        T *dst = dst_;                                                                             \
        for (size_t i = begin; i < end; i++) {                                                     \
            C acc = LD(((const T *)srcs[0])[i]);                                                   \
            for (int k = 1; k < nsrc; k++) {                                                       \
                C x = LD(((const T *)srcs[k])[i]);                                                 \
                acc = COMBINE(acc, x);                                                             \
            }                                                                                      \
            if (DIVIDE) acc = acc / (C)divisor;                                                    \
            dst[i] = ST(acc);                                                                      \
        }                                                                                          \
    }

/* Integer MIN/MAX: compare through the signed (or unsigned) view S. */
#define S_IMIN(S) S_IMIN_##S
#define S_IMAX(S) S_IMAX_##S
#define S_IMIN_int8_t(a, x) ((int8_t)(x) < (int8_t)(a) ? (x) : (a))
#define S_IMAX_int8_t(a, x) ((int8_t)(x) > (int8_t)(a) ? (x) : (a))
#define S_IMIN_uint8_t(a, x) ((x) < (a) ? (x) : (a))
#define S_IMAX_uint8_t(a, x) ((x) > (a) ? (x) : (a))
#define S_IMIN_int32_t(a, x) ((int32_t)(x) < (int32_t)(a) ? (x) : (a))
#define S_IMAX_int32_t(a, x) ((int32_t)(x) > (int32_t)(a) ? (x) : (a))
#define S_IMIN_int64_t(a, x) ((int64_t)(x) < (int64_t)(a) ? (x) : (a))
#define S_IMAX_int64_t(a, x) ((int64_t)(x) > (int64_t)(a) ? (x) : (a))
#define S_IMIN_int16_t(a, x) ((int16_t)(x) < (int16_t)(a) ? (x) : (a))
#define S_IMAX_int16_t(a, x) ((int16_t)(x) > (int16_t)(a) ? (x) : (a))
#define S_IMIN_uint16_t(a, x) ((x) < (a) ? (x) : (a))
#define S_IMAX_uint16_t(a, x) ((x) > (a) ? (x) : (a))
#define S_IMIN_uint32_t(a, x) ((x) < (a) ? (x) : (a))
#define S_IMAX_uint32_t(a, x) ((x) > (a) ? (x) : (a))
#define S_IMIN_uint64_t(a, x) ((x) < (a) ? (x) : (a))
#define S_IMAX_uint64_t(a, x) ((x) > (a) ? (x) : (a))

/* Products of unsigned char promote to int; 255*255 fits, and the store wraps.
 * 16-bit integers compute in uint32_t (65535*65535 would overflow int), which
 * wraps modulo 2^32 and so agrees with 2^16 at the truncating store. */
#define FLOAT_KERNELS(name, T, C, LD, ST)                                                          \
    SCALAR_KERNEL(scalar_##name##_sum, T, C, LD, ST, S_SUM, 0)                                     \
    SCALAR_KERNEL(scalar_##name##_avg, T, C, LD, ST, S_SUM, 1)                                     \
    SCALAR_KERNEL(scalar_##name##_min, T, C, LD, ST, S_FMIN, 0)                                    \
    SCALAR_KERNEL(scalar_##name##_max, T, C, LD, ST, S_FMAX, 0)                                    \
    SCALAR_KERNEL(scalar_##name##_prod, T, C, LD, ST, S_PROD, 0)
#define INT_KERNELS_IN(name, U, C, S)                                                              \
    SCALAR_KERNEL(scalar_##name##_sum, U, C, LD_SAME, (U), S_SUM, 0)                               \
    SCALAR_KERNEL(scalar_##name##_min, U, C, LD_SAME, (U), S_IMIN(S), 0)                           \
    SCALAR_KERNEL(scalar_##name##_max, U, C, LD_SAME, (U), S_IMAX(S), 0)                           \
    SCALAR_KERNEL(scalar_##name##_prod, U, C, LD_SAME, (U), S_PROD, 0)
#define INT_KERNELS(name, U, S) INT_KERNELS_IN(name, U, U, S)

FLOAT_KERNELS(f16, uint16_t, float, LD_F16, ST_F16)
FLOAT_KERNELS(bf16, uint16_t, float, LD_BF16, ST_BF16)
FLOAT_KERNELS(f32, float, float, LD_SAME, ST_SAME)
FLOAT_KERNELS(f64, double, double, LD_SAME, ST_SAME)
INT_KERNELS(i8, uint8_t, int8_t)
INT_KERNELS(u8, uint8_t, uint8_t)
INT_KERNELS(i32, uint32_t, int32_t)
INT_KERNELS(i64, uint64_t, int64_t)
INT_KERNELS_IN(i16, uint16_t, uint32_t, int16_t)
INT_KERNELS_IN(u16, uint16_t, uint32_t, uint16_t)
INT_KERNELS(u32, uint32_t, uint32_t)
INT_KERNELS(u64, uint64_t, uint64_t)

#define FLOAT_ROW(name)                                                                            \
    {                                                                                              \
        scalar_##name##_sum, scalar_##name##_avg, scalar_##name##_min, scalar_##name##_max,        \
            scalar_##name##_prod                                                                   \
    }
#define INT_ROW(name)                                                                              \
    { scalar_##name##_sum, NULL, scalar_##name##_min, scalar_##name##_max, scalar_##name##_prod }

const cring__reduce_kernels_t cring__reduce_scalar_kernels = {
    .name = "scalar",
    .fn =
        {
            [CRING_FLOAT16] = FLOAT_ROW(f16),
            [CRING_BFLOAT16] = FLOAT_ROW(bf16),
            [CRING_FLOAT32] = FLOAT_ROW(f32),
            [CRING_FLOAT64] = FLOAT_ROW(f64),
            [CRING_INT8] = INT_ROW(i8),
            [CRING_UINT8] = INT_ROW(u8),
            [CRING_INT32] = INT_ROW(i32),
            [CRING_INT64] = INT_ROW(i64),
            [CRING_INT16] = INT_ROW(i16),
            [CRING_UINT16] = INT_ROW(u16),
            [CRING_UINT32] = INT_ROW(u32),
            [CRING_UINT64] = INT_ROW(u64),
        },
};

/* ---- one-time choice of the kernel family ---------------------------------- */
static const cring__reduce_kernels_t *chosen_kernels = &cring__reduce_scalar_kernels;
static pthread_once_t choose_once = PTHREAD_ONCE_INIT;

static void choose_kernels(void) {
    /* cap: 0 scalar, 1 avx2, 2 avx512 */
    int cap = 2;
    const char *env = getenv("CRING_REDUCE_ISA");
    if (env && *env) {
        if (!strcmp(env, "scalar")) cap = 0;
        else if (!strcmp(env, "avx2")) cap = 1;
        else if (!strcmp(env, "avx512")) cap = 2;
        else
            cring__log(CRING__LOG_WARNING, -1,
                       "CRING_REDUCE_ISA=%s not understood (scalar|avx2|avx512); ignored", env);
    }
    const cring__reduce_kernels_t *k = &cring__reduce_scalar_kernels;
#if defined(__x86_64__)
    __builtin_cpu_init();
    int has_avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c") &&
                   __builtin_cpu_supports("fma");
    int has_avx512 = has_avx2 && __builtin_cpu_supports("avx512f") &&
                     __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512dq") &&
                     __builtin_cpu_supports("avx512vl");
    if (cap >= 2 && has_avx512) k = &cring__reduce_avx512_kernels;
    else if (cap >= 1 && has_avx2) k = &cring__reduce_avx2_kernels;
#else
    (void)cap;
#endif
    chosen_kernels = k;
    cring__log(CRING__LOG_DEBUG, -1, "reduction kernels: %s", k->name);
}

/* pthread_once gives the ordering: every caller sees chosen_kernels written. */
static const cring__reduce_kernels_t *kernels(void) {
    pthread_once(&choose_once, choose_kernels);
    return chosen_kernels;
}

static int op_slot(cring_op_t op) {
    switch (op) {
    case CRING_SUM: return CRING__K_SUM;
    case CRING_AVERAGE: return CRING__K_AVG;
    case CRING_MIN: return CRING__K_MIN;
    case CRING_MAX: return CRING__K_MAX;
    case CRING_PRODUCT: return CRING__K_PROD;
    default: return -1;
    }
}

static int is_integer(cring_dtype_t dtype) {
    switch (dtype) {
    case CRING_INT8:
    case CRING_UINT8:
    case CRING_INT16:
    case CRING_UINT16:
    case CRING_INT32:
    case CRING_UINT32:
    case CRING_INT64:
    case CRING_UINT64: return 1;
    default: return 0;
    }
}

/* buf[i] /= divisor toward zero for i in [begin, end), on the signed (or
 * unsigned) view of the stored integers. */
static void int_divide(cring_dtype_t dtype, void *buf, size_t begin, size_t end, int divisor) {
    switch (dtype) {
    case CRING_INT8: {
        int8_t *p = buf;
        for (size_t i = begin; i < end; i++) p[i] = (int8_t)(p[i] / divisor);
        break;
    }
    case CRING_UINT8: {
        uint8_t *p = buf;
        for (size_t i = begin; i < end; i++) p[i] = (uint8_t)(p[i] / divisor);
        break;
    }
    case CRING_INT32: {
        int32_t *p = buf;
        for (size_t i = begin; i < end; i++) p[i] = p[i] / divisor;
        break;
    }
    case CRING_INT64: {
        int64_t *p = buf;
        for (size_t i = begin; i < end; i++) p[i] = p[i] / (int64_t)divisor;
        break;
    }
    case CRING_INT16: {
        int16_t *p = buf;
        for (size_t i = begin; i < end; i++) p[i] = (int16_t)(p[i] / divisor);
        break;
    }
    case CRING_UINT16: {
        uint16_t *p = buf;
        for (size_t i = begin; i < end; i++) p[i] = (uint16_t)(p[i] / divisor);
        break;
    }
    case CRING_UINT32: {
        uint32_t *p = buf;
        for (size_t i = begin; i < end; i++) p[i] = p[i] / (uint32_t)divisor;
        break;
    }
    case CRING_UINT64: {
        uint64_t *p = buf;
        for (size_t i = begin; i < end; i++) p[i] = p[i] / (uint64_t)divisor;
        break;
    }
    default: break;
    }
}

/* Elements per tile when an integer AVERAGE sums then divides, so the divide
 * pass reads the sums from cache. */
#define INT_AVERAGE_TILE 4096

/* Contracts of the functions below: see reduce.h. Unsupported (dtype, op)
 * pairs make them do nothing (they never index past the tables). */
int cring__reduce_supported(cring_dtype_t dtype, cring_op_t op) {
    if ((int)dtype < 0 || dtype >= CRING_DTYPE_COUNT || dtype == CRING_BOOL) return 0;
    return op_slot(op) >= 0;
}

const char *cring__reduce_isa(void) { return kernels()->name; }

const char *cring_reduce_isa(void) { return cring__reduce_isa(); }

void cring__reduce_inplace(cring_dtype_t dtype, cring_op_t op, void *dst, const void *src,
                           size_t count) {
    if (count == 0 || !cring__reduce_supported(dtype, op)) return;
    int slot = op == CRING_AVERAGE ? CRING__K_SUM : op_slot(op);
    const void *srcs[2] = {dst, src};
    kernels()->fn[dtype][slot](dst, srcs, 2, 0, count, 1);
}

void cring__reduce_multi(cring_dtype_t dtype, cring_op_t op, void *dst, const void *const *srcs,
                         int nsrc, size_t count, int divisor) {
    if (count == 0 || nsrc < 1 || !cring__reduce_supported(dtype, op)) return;
    const cring__reduce_kernels_t *k = kernels();
    if (op == CRING_AVERAGE && divisor < 1) divisor = 1; /* contract: divisor >= 1 */
    if (op == CRING_AVERAGE && is_integer(dtype)) {
        for (size_t begin = 0; begin < count; begin += INT_AVERAGE_TILE) {
            size_t end = CRING_MIN(count, begin + INT_AVERAGE_TILE);
            k->fn[dtype][CRING__K_SUM](dst, srcs, nsrc, begin, end, 1);
            if (divisor != 1) int_divide(dtype, dst, begin, end, divisor);
        }
        return;
    }
    k->fn[dtype][op_slot(op)](dst, srcs, nsrc, 0, count, divisor);
}

void cring__reduce_average(cring_dtype_t dtype, void *buf, size_t count, int divisor) {
    if (count == 0 || divisor <= 1 || !cring__reduce_supported(dtype, CRING_AVERAGE)) return;
    if (is_integer(dtype)) {
        int_divide(dtype, buf, 0, count, divisor);
        return;
    }
    const void *srcs[1] = {buf};
    kernels()->fn[dtype][CRING__K_AVG](buf, srcs, 1, 0, count, divisor);
}

/* reduce_impl.h: private to csrc/reduce: the kernel-table type shared by the
 * portable kernels (reduce.c) and the x86 vector kernels (reduce_x86.c), plus
 * the scalar float16/bfloat16 converters. Nothing outside csrc/reduce includes it. */
#ifndef CRING_REDUCE_IMPL_H
#define CRING_REDUCE_IMPL_H

#include <stddef.h>
#include <stdint.h>

#include "cring/cring.h"

/* Kernel slots per dtype. AVERAGE has its own slot for floating types (sum,
 * then divide in the compute precision before the store); for integer dtypes
 * that slot is NULL and reduce.c divides after the SUM kernel. */
enum {
    CRING__K_SUM = 0,
    CRING__K_AVG = 1,
    CRING__K_MIN = 2,
    CRING__K_MAX = 3,
    CRING__K_PROD = 4,
    CRING__K_COUNT
};

/* dst[i] = srcs[0][i] (op) srcs[1][i] (op) ... srcs[nsrc-1][i] for begin <= i < end,
 * combined left to right in the compute precision (float32 for float16 and
 * bfloat16). The AVERAGE slot then divides by divisor (>= 1). dst may equal any
 * srcs[k] element-wise. Every variant of a slot gives bit-identical results
 * (up to NaN payloads), so ranks on different CPUs agree. */
typedef void (*cring__reduce_kernel_fn)(void *dst, const void *const *srcs, int nsrc, size_t begin,
                                        size_t end, int divisor);

typedef struct cring__reduce_kernels {
    const char *name; /* "scalar", "avx2", "avx512" */
    cring__reduce_kernel_fn fn[CRING_DTYPE_COUNT][CRING__K_COUNT];
} cring__reduce_kernels_t;

/* Portable kernels (reduce.c); the vector kernels finish their tails with these. */
extern const cring__reduce_kernels_t cring__reduce_scalar_kernels;

#if defined(__x86_64__)
/* reduce_x86.c. Use only after checking the CPU: avx2 needs avx2+f16c+fma,
 * avx512 needs avx512f+avx512bw+avx512dq+avx512vl. */
extern const cring__reduce_kernels_t cring__reduce_avx2_kernels;
extern const cring__reduce_kernels_t cring__reduce_avx512_kernels;
#endif

/* IEEE binary16 <-> binary32, round to nearest even; NaN stays NaN (quiet bit
 * set, top payload bits kept, as the F16C instructions do); overflow gives inf;
 * float16 subnormals are exact both ways. */
static inline float cring__f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t exponent = (h >> 10) & 0x1fu;
    uint32_t mantissa = h & 0x3ffu;
    uint32_t bits;
    if (exponent == 0x1f) { /* inf or NaN */
        bits = sign | 0x7f800000u | (mantissa << 13) | (mantissa ? 0x400000u : 0);
    } else if (exponent != 0) { /* normal: rebias 15 -> 127 */
        bits = sign | ((exponent + 112u) << 23) | (mantissa << 13);
    } else if (mantissa == 0) {
        bits = sign;
    } else { /* subnormal: mantissa * 2^-24, normalise so bit 10 is the implicit 1 */
        uint32_t shift = 0;
        while (!(mantissa & 0x400u)) {
            mantissa <<= 1;
            shift++;
        }
        bits = sign | ((113u - shift) << 23) | ((mantissa & 0x3ffu) << 13);
    }
    float f;
    __builtin_memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t cring__f32_to_f16(float f) {
    uint32_t x;
    __builtin_memcpy(&x, &f, sizeof x);
    uint32_t sign = (x >> 16) & 0x8000u;
    uint32_t ax = x & 0x7fffffffu;
    if (ax > 0x7f800000u) return (uint16_t)(sign | 0x7e00u | ((ax >> 13) & 0x3ffu));
    if (ax >= 0x477ff000u) return (uint16_t)(sign | 0x7c00u); /* >= 65520 rounds to inf */
    if (ax >= 0x38800000u) {                                  /* >= 2^-14: normal */
        ax += 0xfffu + ((ax >> 13) & 1u);                     /* round to nearest even */
        return (uint16_t)(sign | ((ax - (112u << 23)) >> 13));
    }
    uint32_t exponent = ax >> 23;
    if (exponent < 102) return (uint16_t)sign; /* below 2^-25: rounds to zero */
    /* subnormal result: round(value * 2^24) = mantissa24 >> (126 - exponent) */
    uint32_t mantissa = (ax & 0x7fffffu) | 0x800000u;
    uint32_t shift = 126 - exponent; /* 14..24 */
    uint32_t result = mantissa >> shift;
    uint32_t rest = mantissa & ((1u << shift) - 1);
    uint32_t half = 1u << (shift - 1);
    if (rest > half || (rest == half && (result & 1u))) result++;
    return (uint16_t)(sign | result);
}

/* bfloat16 is the top half of a binary32. */
static inline float cring__bf16_to_f32(uint16_t b) {
    uint32_t bits = (uint32_t)b << 16;
    float f;
    __builtin_memcpy(&f, &bits, sizeof f);
    return f;
}

static inline uint16_t cring__f32_to_bf16(float f) {
    uint32_t x;
    __builtin_memcpy(&x, &f, sizeof x);
    if ((x & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((x >> 16) | 0x40u); /* quiet NaN */
    return (uint16_t)((x + 0x7fffu + ((x >> 16) & 1u)) >> 16);
}

#endif /* CRING_REDUCE_IMPL_H */

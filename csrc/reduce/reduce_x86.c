/* reduce_x86.c: AVX2 and AVX-512 variants of the reduction kernels, each compiled
 * with a function-level target attribute so the build needs no -m flags; reduce.c
 * calls them only after checking the CPU. Must stay bit-identical to the scalar
 * kernels (tails are finished by them) and must not allocate. */
#include "reduce/reduce_impl.h"

#if defined(__x86_64__)

#include <immintrin.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define TARGET_AVX2 __attribute__((target("avx2,f16c,fma")))
#define TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,f16c,fma")))
#define TARGET_AVX512_DECL TARGET_AVX512

/* ---- vector types (GCC vector extensions) -----------------------------------
 * Arithmetic is written with the extensions so one template serves every width;
 * the target attribute decides which instructions implement it. *_u types are
 * the unaligned, may_alias views used for loads and stores (like __m256_u). */
#define DECLARE_VECTOR_TYPES(VB, W)                                                                \
    typedef float vf32_##W __attribute__((vector_size(VB)));                                       \
    typedef double vf64_##W __attribute__((vector_size(VB)));                                      \
    typedef uint8_t vu8_##W __attribute__((vector_size(VB)));                                      \
    typedef int8_t vs8_##W __attribute__((vector_size(VB)));                                       \
    typedef uint16_t vu16_##W __attribute__((vector_size(VB)));                                    \
    typedef int16_t vs16_##W __attribute__((vector_size(VB)));                                     \
    typedef uint32_t vu32_##W __attribute__((vector_size(VB)));                                    \
    typedef int32_t vs32_##W __attribute__((vector_size(VB)));                                     \
    typedef uint64_t vu64_##W __attribute__((vector_size(VB)));                                    \
    typedef int64_t vs64_##W __attribute__((vector_size(VB)));                                     \
    typedef float vf32_##W##_u __attribute__((vector_size(VB), aligned(1), may_alias));            \
    typedef double vf64_##W##_u __attribute__((vector_size(VB), aligned(1), may_alias));           \
    typedef uint8_t vu8_##W##_u __attribute__((vector_size(VB), aligned(1), may_alias));           \
    typedef uint16_t vu16_##W##_u __attribute__((vector_size(VB), aligned(1), may_alias));         \
    typedef uint32_t vu32_##W##_u __attribute__((vector_size(VB), aligned(1), may_alias));         \
    typedef uint64_t vu64_##W##_u __attribute__((vector_size(VB), aligned(1), may_alias));

DECLARE_VECTOR_TYPES(32, 256)
DECLARE_VECTOR_TYPES(64, 512)

/* ---- combine operations on vectors -------------------------------------------
 * VC: compute vector type, MT: signed integer vector of the same lane width
 * (comparison masks), CT: the type to compare in (signed view for int8/16/32/64). */
#define V_SUM(VC, MT, CT, a, x) ((a) + (x))
#define V_PROD(VC, MT, CT, a, x) ((a) * (x))
#define V_BLEND(VC, MT, m, x, a) ((VC)((((MT)(x)) & (m)) | (((MT)(a)) & ~(m))))
/* Same rule as the scalar S_FMIN/S_FMAX: take x when it wins or is NaN. */
#define V_FMIN(VC, MT, CT, a, x)                                                                   \
    ({                                                                                             \
        MT m_ = (MT)((x) < (a)) | (MT)((x) != (x));                                                \
        V_BLEND(VC, MT, m_, x, a);                                                                 \
    })
#define V_FMAX(VC, MT, CT, a, x)                                                                   \
    ({                                                                                             \
        MT m_ = (MT)((x) > (a)) | (MT)((x) != (x));                                                \
        V_BLEND(VC, MT, m_, x, a);                                                                 \
    })
#define V_IMIN(VC, MT, CT, a, x)                                                                   \
    ({                                                                                             \
        MT m_ = (MT)((CT)(x) < (CT)(a));                                                           \
        V_BLEND(VC, MT, m_, x, a);                                                                 \
    })
#define V_IMAX(VC, MT, CT, a, x)                                                                   \
    ({                                                                                             \
        MT m_ = (MT)((CT)(x) > (CT)(a));                                                           \
        V_BLEND(VC, MT, m_, x, a);                                                                 \
    })

/* ---- loads and stores in the compute type -------------------------------------- */
#define LOAD_NATIVE(VU, p) (*(const VU *)(const void *)(p))
#define STORE_NATIVE(VU, p, v) (*(VU *)(void *)(p) = (v))

/* float16 via F16C (8 lanes) / AVX-512F (16 lanes); imm 0 = round to nearest even. */
#define LOAD_F16_256(VU, p) _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(p)))
#define STORE_F16_256(VU, p, v) _mm_storeu_si128((__m128i *)(void *)(p), _mm256_cvtps_ph((v), 0))
#define LOAD_F16_512(VU, p) _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(const void *)(p)))
#define STORE_F16_512(VU, p, v) _mm256_storeu_si256((__m256i *)(void *)(p), _mm512_cvtps_ph((v), 0))

/* bfloat16: widen by a 16-bit shift; narrow by adding 0x7fff + lsb (round to
 * nearest even) and keeping the top half; NaN becomes its top half | 0x40.
 * (AVX2 here; AVX-512 has its own kernels, BF16_KERNEL_512 below.) */
#define LOAD_BF16_256(VU, p)                                                                       \
    _mm256_castsi256_ps(_mm256_slli_epi32(                                                         \
        _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(const void *)(p))), 16))
#define STORE_BF16_256(VU, p, v)                                                                   \
    do {                                                                                           \
        __m256 f_ = (v);                                                                           \
        __m256i x_ = _mm256_castps_si256(f_);                                                      \
        __m256i hi_ = _mm256_srli_epi32(x_, 16);                                                   \
        __m256i bias_ = _mm256_add_epi32(_mm256_set1_epi32(0x7fff),                                \
                                         _mm256_and_si256(hi_, _mm256_set1_epi32(1)));             \
        __m256i r_ = _mm256_srli_epi32(_mm256_add_epi32(x_, bias_), 16);                           \
        __m256i nan_ = _mm256_castps_si256(_mm256_cmp_ps(f_, f_, _CMP_UNORD_Q));                   \
        r_ = _mm256_blendv_epi8(r_, _mm256_or_si256(hi_, _mm256_set1_epi32(0x40)), nan_);          \
        _mm_storeu_si128(                                                                          \
            (__m128i *)(void *)(p),                                                                \
            _mm_packus_epi32(_mm256_castsi256_si128(r_), _mm256_extracti128_si256(r_, 1)));        \
    } while (0)
/* ---- the kernel template ---------------------------------------------------------
 * T: stored element, VC: compute vector (LANES lanes), VU: unaligned load type,
 * CE: compute element (for the AVERAGE divisor). The two-source case (the ring's
 * hot path) is unrolled by two; the rest of [begin, end) goes to the scalar
 * kernel of the same slot, which computes exactly the same values. Every load of
 * an index happens before its store, so dst may equal any source element-wise. */
#define VEC_KERNEL(fname, TGT, T, VC, VU, MT, CT, CE, LANES, LOAD, STORE, COMBINE, DIVIDE, DTYPE,  \
                   SLOT)                                                                           \
    TGT static void fname(void *dst_, const void *const *srcs, int nsrc, size_t begin, size_t end, \
                          int divisor) {                                                           \
        T *dst = dst_;                                                                             \
        size_t i = begin;                                                                          \
        if (nsrc == 2) {                                                                           \
            const T *a = srcs[0], *b = srcs[1];                                                    \
            for (; i + 2 * (LANES) <= end; i += 2 * (LANES)) {                                     \
                VC a0 = LOAD(VU, a + i), a1 = LOAD(VU, a + i + (LANES));                           \
                VC b0 = LOAD(VU, b + i), b1 = LOAD(VU, b + i + (LANES));                           \
                a0 = COMBINE(VC, MT, CT, a0, b0);                                                  \
                a1 = COMBINE(VC, MT, CT, a1, b1);                                                  \
                if (DIVIDE) {                                                                      \
                    a0 = a0 / (CE)divisor;                                                         \
                    a1 = a1 / (CE)divisor;                                                         \
                }                                                                                  \
                STORE(VU, dst + i, a0);                                                            \
                STORE(VU, dst + i + (LANES), a1);                                                  \
            }                                                                                      \
        }                                                                                          \
        for (; i + (LANES) <= end; i += (LANES)) {                                                 \
            VC acc = LOAD(VU, (const T *)srcs[0] + i);                                             \
            for (int k = 1; k < nsrc; k++) {                                                       \
                VC x = LOAD(VU, (const T *)srcs[k] + i);                                           \
                acc = COMBINE(VC, MT, CT, acc, x);                                                 \
            }                                                                                      \
            if (DIVIDE) acc = acc / (CE)divisor;                                                   \
            STORE(VU, dst + i, acc);                                                               \
        }                                                                                          \
        if (i < end)                                                                               \
            cring__reduce_scalar_kernels.fn[DTYPE][SLOT](dst_, srcs, nsrc, i, end, divisor);       \
    }

/* bfloat16 on AVX-512, 32 elements a step: one 64-byte load widened in two
 * halves by interleaving with zeros (unpacklo/hi: the 16-bit value lands in
 * the top of a 32-bit lane, in a lane order that a pack undoes), and one
 * 64-byte store narrowed by packus after the same rounding as STORE_BF16_*.
 * Two shuffles where the per-16 loads and stores took a widening load and a
 * shift in and a vpmovdw out: a two-source sum in L2 went from 15 to 21 GB/s
 * of output on Zen 4 (26 GB/s with the AVX512_BF16 narrowing below; float32:
 * 37). Element-wise the same arithmetic, so bit-identical to the scalar kernel. */
#define BF16_WIDEN_LO_512(v) ((vf32_512)_mm512_unpacklo_epi16(_mm512_setzero_si512(), (v)))
#define BF16_WIDEN_HI_512(v) ((vf32_512)_mm512_unpackhi_epi16(_mm512_setzero_si512(), (v)))
TARGET_AVX512_DECL static inline __m512i bf16_round_512(vf32_512 v) {
    __m512 f = (__m512)v;
    __m512i x = _mm512_castps_si512(f);
    __m512i hi = _mm512_srli_epi32(x, 16);
    __m512i bias =
        _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(hi, _mm512_set1_epi32(1)));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(x, bias), 16);
    __mmask16 nan = _mm512_cmp_ps_mask(f, f, _CMP_UNORD_Q);
    return _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(hi, _mm512_set1_epi32(0x40)));
}
/* With AVX512_BF16 the narrowing is one vcvtne2ps2bf16 (round to nearest
 * even, NaN -> top half | 0x40: the same as bf16_round_512) plus a word
 * permutation back to memory order; it flushes denormal results to zero, so
 * a step with any denormal result takes the bf16_round_512 path instead. */
#if (defined(__clang__) && __clang_major__ >= 9) || (!defined(__clang__) && __GNUC__ >= 10)
#define HAVE_AVX512BF16_INTRINSICS 1
#define TARGET_AVX512BF16                                                                          \
    __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx512bf16,avx2,f16c,fma")))
TARGET_AVX512BF16 static inline __m512i bf16_narrow_512(vf32_512 lo, vf32_512 hi) {
    const __m512i expo = _mm512_set1_epi32(0x7f800000), mag = _mm512_set1_epi32(0x7fffffff);
    __m512i xl = (__m512i)lo, xh = (__m512i)hi;
    __mmask16 dl = _mm512_mask_test_epi32_mask(_mm512_testn_epi32_mask(xl, expo), xl, mag);
    __mmask16 dh = _mm512_mask_test_epi32_mask(_mm512_testn_epi32_mask(xh, expo), xh, mag);
    if (__builtin_expect(_kortestz_mask16_u8(dl, dh) == 0, 0))
        return _mm512_packus_epi32(bf16_round_512(lo), bf16_round_512(hi));
    /* word r of the conversion holds memory word order[r]: lo's lanes are
     * words 0-3 of each 128-bit lane, hi's words 4-7 */
    const __m512i order =
        _mm512_set_epi16(31, 30, 29, 28, 15, 14, 13, 12, 27, 26, 25, 24, 11, 10, 9, 8, 23, 22, 21,
                         20, 7, 6, 5, 4, 19, 18, 17, 16, 3, 2, 1, 0);
    __m512i b = (__m512i)_mm512_cvtne2ps_pbh((__m512)hi, (__m512)lo);
    return _mm512_permutexvar_epi16(order, b);
}
#endif

#define BF16_PACK_512(lo, hi) _mm512_packus_epi32(bf16_round_512(lo), bf16_round_512(hi))
#define BF16_KERNEL_512(fname, TGT, NARROW, COMBINE, DIVIDE, SLOT)                                 \
    TGT static void fname(void *dst_, const void *const *srcs, int nsrc, size_t begin, size_t end, \
                          int divisor) {                                                           \
        uint16_t *dst = dst_;                                                                      \
        size_t i = begin;                                                                          \
        for (; i + 32 <= end; i += 32) {                                                           \
            __m512i v = _mm512_loadu_si512((const void *)((const uint16_t *)srcs[0] + i));         \
            vf32_512 lo = BF16_WIDEN_LO_512(v), hi = BF16_WIDEN_HI_512(v);                         \
            for (int k = 1; k < nsrc; k++) {                                                       \
                __m512i x = _mm512_loadu_si512((const void *)((const uint16_t *)srcs[k] + i));     \
                lo = COMBINE(vf32_512, vs32_512, vf32_512, lo, BF16_WIDEN_LO_512(x));              \
                hi = COMBINE(vf32_512, vs32_512, vf32_512, hi, BF16_WIDEN_HI_512(x));              \
            }                                                                                      \
            if (DIVIDE) {                                                                          \
                lo = lo / (float)divisor;                                                          \
                hi = hi / (float)divisor;                                                          \
            }                                                                                      \
            _mm512_storeu_si512((void *)(dst + i), NARROW(lo, hi));                                \
        }                                                                                          \
        if (i < end)                                                                               \
            cring__reduce_scalar_kernels.fn[CRING_BFLOAT16][SLOT](dst_, srcs, nsrc, i, end,        \
                                                                  divisor);                        \
    }

/* Five kernels for a floating dtype, four for an integer one. */
#define FLOAT_FAMILY(isa, TGT, name, DTYPE, T, VC, VU, MT, LANES, LOAD, STORE)                     \
    VEC_KERNEL(isa##_##name##_sum, TGT, T, VC, VU, MT, VC, float, LANES, LOAD, STORE, V_SUM, 0,    \
               DTYPE, CRING__K_SUM)                                                                \
    VEC_KERNEL(isa##_##name##_avg, TGT, T, VC, VU, MT, VC, float, LANES, LOAD, STORE, V_SUM, 1,    \
               DTYPE, CRING__K_AVG)                                                                \
    VEC_KERNEL(isa##_##name##_min, TGT, T, VC, VU, MT, VC, float, LANES, LOAD, STORE, V_FMIN, 0,   \
               DTYPE, CRING__K_MIN)                                                                \
    VEC_KERNEL(isa##_##name##_max, TGT, T, VC, VU, MT, VC, float, LANES, LOAD, STORE, V_FMAX, 0,   \
               DTYPE, CRING__K_MAX)                                                                \
    VEC_KERNEL(isa##_##name##_prod, TGT, T, VC, VU, MT, VC, float, LANES, LOAD, STORE, V_PROD, 0,  \
               DTYPE, CRING__K_PROD)
/* float64 divides in double. */
#define DOUBLE_FAMILY(isa, TGT, name, DTYPE, T, VC, VU, MT, LANES)                                 \
    VEC_KERNEL(isa##_##name##_sum, TGT, T, VC, VU, MT, VC, double, LANES, LOAD_NATIVE,             \
               STORE_NATIVE, V_SUM, 0, DTYPE, CRING__K_SUM)                                        \
    VEC_KERNEL(isa##_##name##_avg, TGT, T, VC, VU, MT, VC, double, LANES, LOAD_NATIVE,             \
               STORE_NATIVE, V_SUM, 1, DTYPE, CRING__K_AVG)                                        \
    VEC_KERNEL(isa##_##name##_min, TGT, T, VC, VU, MT, VC, double, LANES, LOAD_NATIVE,             \
               STORE_NATIVE, V_FMIN, 0, DTYPE, CRING__K_MIN)                                       \
    VEC_KERNEL(isa##_##name##_max, TGT, T, VC, VU, MT, VC, double, LANES, LOAD_NATIVE,             \
               STORE_NATIVE, V_FMAX, 0, DTYPE, CRING__K_MAX)                                       \
    VEC_KERNEL(isa##_##name##_prod, TGT, T, VC, VU, MT, VC, double, LANES, LOAD_NATIVE,            \
               STORE_NATIVE, V_PROD, 0, DTYPE, CRING__K_PROD)
/* Integers: VC is the unsigned vector (wrapping + and *), CT the compare view. */
#define INT_FAMILY(isa, TGT, name, DTYPE, T, VC, VU, MT, CT, LANES)                                \
    VEC_KERNEL(isa##_##name##_sum, TGT, T, VC, VU, MT, CT, T, LANES, LOAD_NATIVE, STORE_NATIVE,    \
               V_SUM, 0, DTYPE, CRING__K_SUM)                                                      \
    VEC_KERNEL(isa##_##name##_min, TGT, T, VC, VU, MT, CT, T, LANES, LOAD_NATIVE, STORE_NATIVE,    \
               V_IMIN, 0, DTYPE, CRING__K_MIN)                                                     \
    VEC_KERNEL(isa##_##name##_max, TGT, T, VC, VU, MT, CT, T, LANES, LOAD_NATIVE, STORE_NATIVE,    \
               V_IMAX, 0, DTYPE, CRING__K_MAX)                                                     \
    VEC_KERNEL(isa##_##name##_prod, TGT, T, VC, VU, MT, CT, T, LANES, LOAD_NATIVE, STORE_NATIVE,   \
               V_PROD, 0, DTYPE, CRING__K_PROD)

#define ALL_FAMILIES(isa, TGT, W, F32_LANES, F64_LANES, U8_LANES, U16_LANES, U32_LANES, U64_LANES) \
    FLOAT_FAMILY(isa, TGT, f16, CRING_FLOAT16, uint16_t, vf32_##W, void, vs32_##W, F32_LANES,      \
                 LOAD_F16_##W, STORE_F16_##W)                                                      \
    FLOAT_FAMILY(isa, TGT, f32, CRING_FLOAT32, float, vf32_##W, vf32_##W##_u, vs32_##W, F32_LANES, \
                 LOAD_NATIVE, STORE_NATIVE)                                                        \
    DOUBLE_FAMILY(isa, TGT, f64, CRING_FLOAT64, double, vf64_##W, vf64_##W##_u, vs64_##W,          \
                  F64_LANES)                                                                       \
    INT_FAMILY(isa, TGT, i8, CRING_INT8, uint8_t, vu8_##W, vu8_##W##_u, vs8_##W, vs8_##W,          \
               U8_LANES)                                                                           \
    INT_FAMILY(isa, TGT, u8, CRING_UINT8, uint8_t, vu8_##W, vu8_##W##_u, vs8_##W, vu8_##W,         \
               U8_LANES)                                                                           \
    INT_FAMILY(isa, TGT, i32, CRING_INT32, uint32_t, vu32_##W, vu32_##W##_u, vs32_##W, vs32_##W,   \
               U32_LANES)                                                                          \
    INT_FAMILY(isa, TGT, i64, CRING_INT64, uint64_t, vu64_##W, vu64_##W##_u, vs64_##W, vs64_##W,   \
               U64_LANES)                                                                          \
    INT_FAMILY(isa, TGT, i16, CRING_INT16, uint16_t, vu16_##W, vu16_##W##_u, vs16_##W, vs16_##W,   \
               U16_LANES)                                                                          \
    INT_FAMILY(isa, TGT, u16, CRING_UINT16, uint16_t, vu16_##W, vu16_##W##_u, vs16_##W, vu16_##W,  \
               U16_LANES)                                                                          \
    INT_FAMILY(isa, TGT, u32, CRING_UINT32, uint32_t, vu32_##W, vu32_##W##_u, vs32_##W, vu32_##W,  \
               U32_LANES)                                                                          \
    INT_FAMILY(isa, TGT, u64, CRING_UINT64, uint64_t, vu64_##W, vu64_##W##_u, vs64_##W, vu64_##W,  \
               U64_LANES)

ALL_FAMILIES(avx2, TARGET_AVX2, 256, 8, 4, 32, 16, 8, 4)
FLOAT_FAMILY(avx2, TARGET_AVX2, bf16, CRING_BFLOAT16, uint16_t, vf32_256, void, vs32_256, 8,
             LOAD_BF16_256, STORE_BF16_256)
ALL_FAMILIES(avx512, TARGET_AVX512, 512, 16, 8, 64, 32, 16, 8)
/* bfloat16 on AVX-512: the kernels above, 32 elements a step */
#define BF16_KERNELS_512(name, TGT, NARROW)                                                        \
    BF16_KERNEL_512(avx512_##name##_sum, TGT, NARROW, V_SUM, 0, CRING__K_SUM)                      \
    BF16_KERNEL_512(avx512_##name##_avg, TGT, NARROW, V_SUM, 1, CRING__K_AVG)                      \
    BF16_KERNEL_512(avx512_##name##_min, TGT, NARROW, V_FMIN, 0, CRING__K_MIN)                     \
    BF16_KERNEL_512(avx512_##name##_max, TGT, NARROW, V_FMAX, 0, CRING__K_MAX)                     \
    BF16_KERNEL_512(avx512_##name##_prod, TGT, NARROW, V_PROD, 0, CRING__K_PROD)
BF16_KERNELS_512(bf16p, TARGET_AVX512, BF16_PACK_512)
/* The table's bfloat16 row: the vcvtne2ps2bf16 kernels where the compiler
 * and the CPU have AVX512_BF16 (checked once), else the packus ones. */
#ifdef HAVE_AVX512BF16_INTRINSICS
BF16_KERNELS_512(bf16n, TARGET_AVX512BF16, bf16_narrow_512)
static int have_avx512bf16(void) {
    static int have = -1; /* every thread computes the same value */
    int h = __atomic_load_n(&have, __ATOMIC_RELAXED);
    if (h < 0) {
        /* CRING_REDUCE_BF16=pack keeps the packus kernels (for tests) */
        const char *force = getenv("CRING_REDUCE_BF16");
        h = __builtin_cpu_supports("avx512bf16") && !(force && !strcmp(force, "pack")) ? 1 : 0;
        __atomic_store_n(&have, h, __ATOMIC_RELAXED);
    }
    return h;
}
#else
#define have_avx512bf16() 0
#define avx512_bf16n_sum avx512_bf16p_sum
#define avx512_bf16n_avg avx512_bf16p_avg
#define avx512_bf16n_min avx512_bf16p_min
#define avx512_bf16n_max avx512_bf16p_max
#define avx512_bf16n_prod avx512_bf16p_prod
#endif
#define BF16_DISPATCH_512(op)                                                                      \
    static void avx512_bf16_##op(void *dst, const void *const *srcs, int nsrc, size_t begin,       \
                                 size_t end, int divisor) {                                        \
        (have_avx512bf16() ? avx512_bf16n_##op : avx512_bf16p_##op)(dst, srcs, nsrc, begin, end,   \
                                                                    divisor);                      \
    }
BF16_DISPATCH_512(sum)
BF16_DISPATCH_512(avg)
BF16_DISPATCH_512(min)
BF16_DISPATCH_512(max)
BF16_DISPATCH_512(prod)

/* The two row shapes of the kernel table, kept as rows. */
/* clang-format off */
#define FLOAT_ROW(isa, name)                                                                       \
    {isa##_##name##_sum, isa##_##name##_avg, isa##_##name##_min, isa##_##name##_max,               \
     isa##_##name##_prod}
#define INT_ROW(isa, name)                                                                         \
    {isa##_##name##_sum, NULL, isa##_##name##_min, isa##_##name##_max, isa##_##name##_prod}
/* clang-format on */
#define KERNEL_TABLE(isa, bf16)                                                                    \
    const cring__reduce_kernels_t cring__reduce_##isa##_kernels = {                                \
        .name = #isa,                                                                              \
        .fn =                                                                                      \
            {                                                                                      \
                [CRING_FLOAT16] = FLOAT_ROW(isa, f16),                                             \
                [CRING_BFLOAT16] = FLOAT_ROW(isa, bf16),                                           \
                [CRING_FLOAT32] = FLOAT_ROW(isa, f32),                                             \
                [CRING_FLOAT64] = FLOAT_ROW(isa, f64),                                             \
                [CRING_INT8] = INT_ROW(isa, i8),                                                   \
                [CRING_UINT8] = INT_ROW(isa, u8),                                                  \
                [CRING_INT32] = INT_ROW(isa, i32),                                                 \
                [CRING_INT64] = INT_ROW(isa, i64),                                                 \
                [CRING_INT16] = INT_ROW(isa, i16),                                                 \
                [CRING_UINT16] = INT_ROW(isa, u16),                                                \
                [CRING_UINT32] = INT_ROW(isa, u32),                                                \
                [CRING_UINT64] = INT_ROW(isa, u64),                                                \
            },                                                                                     \
    };

KERNEL_TABLE(avx2, bf16)
KERNEL_TABLE(avx512, bf16)

#else  /* !__x86_64__ */
/* Nothing to build: reduce.c uses the scalar kernels. (ISO C wants a declaration.) */
typedef int cring__reduce_x86_unused_t;
#endif /* __x86_64__ */

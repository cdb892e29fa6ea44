/* reduce_x86.c: AVX2 and AVX-512 variants of the reduction kernels, each compiled
 * with a function-level target attribute so the build needs no -m flags; reduce.c
 * calls them only after checking the CPU. Must stay bit-identical to the scalar
 * kernels (tails are finished by them) and must not allocate. */
#include "reduce/reduce_impl.h"

#if defined(__x86_64__)

#include <immintrin.h>
#include <stdint.h>

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
 * nearest even) and keeping the top half; NaN becomes its top half | 0x40. */
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
#define LOAD_BF16_512(VU, p)                                                                       \
    _mm512_castsi512_ps(_mm512_slli_epi32(                                                         \
        _mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i *)(const void *)(p))), 16))
#define STORE_BF16_512(VU, p, v)                                                                   \
    do {                                                                                           \
        __m512 f_ = (v);                                                                           \
        __m512i x_ = _mm512_castps_si512(f_);                                                      \
        __m512i hi_ = _mm512_srli_epi32(x_, 16);                                                   \
        __m512i bias_ = _mm512_add_epi32(_mm512_set1_epi32(0x7fff),                                \
                                         _mm512_and_si512(hi_, _mm512_set1_epi32(1)));             \
        __m512i r_ = _mm512_srli_epi32(_mm512_add_epi32(x_, bias_), 16);                           \
        __mmask16 nan_ = _mm512_cmp_ps_mask(f_, f_, _CMP_UNORD_Q);                                 \
        r_ = _mm512_mask_mov_epi32(r_, nan_, _mm512_or_si512(hi_, _mm512_set1_epi32(0x40)));       \
        _mm256_storeu_si256((__m256i *)(void *)(p), _mm512_cvtepi32_epi16(r_));                    \
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
    FLOAT_FAMILY(isa, TGT, bf16, CRING_BFLOAT16, uint16_t, vf32_##W, void, vs32_##W, F32_LANES,    \
                 LOAD_BF16_##W, STORE_BF16_##W)                                                    \
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

#define TARGET_AVX2 __attribute__((target("avx2,f16c,fma")))
#define TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512dq,avx512vl,avx2,f16c,fma")))

ALL_FAMILIES(avx2, TARGET_AVX2, 256, 8, 4, 32, 16, 8, 4)
ALL_FAMILIES(avx512, TARGET_AVX512, 512, 16, 8, 64, 32, 16, 8)

/* The two row shapes of the kernel table, kept as rows. */
/* clang-format off */
#define FLOAT_ROW(isa, name)                                                                       \
    {isa##_##name##_sum, isa##_##name##_avg, isa##_##name##_min, isa##_##name##_max,               \
     isa##_##name##_prod}
#define INT_ROW(isa, name)                                                                         \
    {isa##_##name##_sum, NULL, isa##_##name##_min, isa##_##name##_max, isa##_##name##_prod}
/* clang-format on */
#define KERNEL_TABLE(isa)                                                                          \
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

KERNEL_TABLE(avx2)
KERNEL_TABLE(avx512)

#else  /* !__x86_64__ */
/* Nothing to build: reduce.c uses the scalar kernels. (ISO C wants a declaration.) */
typedef int cring__reduce_x86_unused_t;
#endif /* __x86_64__ */

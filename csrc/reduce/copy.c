/* copy.c: a copy with non-temporal (streaming) stores, for large outputs that
 * are not read again soon. glibc's memcpy streams only above a threshold
 * derived from the L3 size, which VMs often report as hundreds of MiB, so we
 * do it ourselves. AVX2 or SSE2 picked at run time; no allocation. */
#include <string.h>

#include "reduce/reduce.h"

#if defined(__x86_64__)
#include <immintrin.h>
#include <stdint.h>

/* Bytes of dst to copy with ordinary stores so that dst becomes 64-aligned. */
static size_t head_bytes(const void *dst) { return (64 - ((uintptr_t)dst & 63)) & 63; }

__attribute__((target("avx2"))) static void stream_avx2(unsigned char *d, const unsigned char *s,
                                                        size_t n) {
    for (; n >= 128; n -= 128, d += 128, s += 128) {
        __m256i a = _mm256_loadu_si256((const __m256i *)(const void *)s);
        __m256i b = _mm256_loadu_si256((const __m256i *)(const void *)(s + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(const void *)(s + 64));
        __m256i e = _mm256_loadu_si256((const __m256i *)(const void *)(s + 96));
        _mm256_stream_si256((__m256i *)(void *)d, a);
        _mm256_stream_si256((__m256i *)(void *)(d + 32), b);
        _mm256_stream_si256((__m256i *)(void *)(d + 64), c);
        _mm256_stream_si256((__m256i *)(void *)(d + 96), e);
    }
    if (n) memcpy(d, s, n);
}

static void stream_sse2(unsigned char *d, const unsigned char *s, size_t n) {
    for (; n >= 64; n -= 64, d += 64, s += 64) {
        __m128i a = _mm_loadu_si128((const __m128i *)(const void *)s);
        __m128i b = _mm_loadu_si128((const __m128i *)(const void *)(s + 16));
        __m128i c = _mm_loadu_si128((const __m128i *)(const void *)(s + 32));
        __m128i e = _mm_loadu_si128((const __m128i *)(const void *)(s + 48));
        _mm_stream_si128((__m128i *)(void *)d, a);
        _mm_stream_si128((__m128i *)(void *)(d + 16), b);
        _mm_stream_si128((__m128i *)(void *)(d + 32), c);
        _mm_stream_si128((__m128i *)(void *)(d + 48), e);
    }
    if (n) memcpy(d, s, n);
}

/* Follows the reduction kernels' choice (and so CRING_REDUCE_ISA): "scalar"
 * means no AVX, and SSE2 is part of x86-64. */
static int use_avx2(void) {
    static int cached = -1; /* a benign race: every thread computes the same value */
    int v = __atomic_load_n(&cached, __ATOMIC_RELAXED);
    if (v < 0) {
        v = strcmp(cring__reduce_isa(), "scalar") != 0;
        __atomic_store_n(&cached, v, __ATOMIC_RELAXED);
    }
    return v;
}

void cring__copy_stream(void *dst, const void *src, size_t n) {
    unsigned char *d = dst;
    const unsigned char *s = src;
    if (n < CRING__COPY_STREAM_MIN_BYTES) {
        memcpy(d, s, n);
        return;
    }
    size_t h = head_bytes(d);
    memcpy(d, s, h);
    if (use_avx2()) stream_avx2(d + h, s + h, n - h);
    else stream_sse2(d + h, s + h, n - h);
    /* Streaming stores are weakly ordered: make them visible before the
     * caller publishes anything. */
    _mm_sfence();
}

const char *cring__copy_stream_isa(void) { return use_avx2() ? "avx2" : "sse2"; }

#else /* !__x86_64__ */

void cring__copy_stream(void *dst, const void *src, size_t n) { memcpy(dst, src, n); }

const char *cring__copy_stream_isa(void) { return "memcpy"; }

#endif

/* reduce.h: element-wise reduction kernels for every (dtype, op) pair, with the
 * vector variant picked at run time from CPU features (never -march=native).
 * Pure computation: no communication, no allocation. */
#ifndef CRING_REDUCE_H
#define CRING_REDUCE_H

#include <stddef.h>

#include "cring/cring.h"

/* 1 when op can reduce dtype (bool and ADASUM never can), else 0. */
int cring__reduce_supported(cring_dtype_t dtype, cring_op_t op);

/* dst[i] = dst[i] (op) src[i] for i < count. AVERAGE behaves as SUM here; the
 * caller divides at the end with cring__reduce_average. float16 and bfloat16
 * are computed in float32 and rounded to nearest even. dst and src may be the
 * same pointer but must not otherwise overlap. Thread-safe. */
void cring__reduce_inplace(cring_dtype_t dtype, cring_op_t op, void *dst, const void *src,
                           size_t count);

/* dst[i] = (op over k < nsrc of srcs[k][i]), and for AVERAGE the result is then
 * divided by divisor (integers: toward zero). nsrc >= 1. float16/bfloat16 are
 * accumulated in float32 and rounded once. dst may equal any srcs[k] (element-
 * wise in place) but must not partially overlap them. Thread-safe. */
void cring__reduce_multi(cring_dtype_t dtype, cring_op_t op, void *dst, const void *const *srcs,
                         int nsrc, size_t count, int divisor);

/* buf[i] = buf[i] / divisor, for the end of an AVERAGE (integers: toward zero;
 * float16/bfloat16 via float32). Thread-safe. */
void cring__reduce_average(cring_dtype_t dtype, void *buf, size_t count, int divisor);

/* dst[i] = (dst_dtype)(src[i] * scale). Used for compression (float32 <->
 * float16/bfloat16) and for pre/post-scaling (same dtype); integers are
 * scaled in double and truncated toward zero. dst may equal src when both
 * dtypes have the same size. Thread-safe. */
void cring__convert(cring_dtype_t dst_dtype, void *dst, cring_dtype_t src_dtype, const void *src,
                    size_t count, double scale);

/* Name of the kernel family chosen for this CPU: "avx512", "avx2" or "scalar".
 * CRING_REDUCE_ISA=scalar|avx2|avx512 caps the choice (for tests). */
const char *cring__reduce_isa(void);

/* memcpy(dst, src, n) with non-temporal stores: the written lines bypass the
 * caches, so use it for large outputs nobody reads soon. Below
 * CRING__COPY_STREAM_MIN_BYTES it is a plain memcpy. Any alignment; dst and
 * src must not overlap. Ends with a store fence, so a release store after it
 * publishes the data. Thread-safe. */
#define CRING__COPY_STREAM_MIN_BYTES 1024
void cring__copy_stream(void *dst, const void *src, size_t n);
/* The variant in use: "avx2", "sse2" (CRING_REDUCE_ISA=scalar) or "memcpy". */
const char *cring__copy_stream_isa(void);

#endif /* CRING_REDUCE_H */

/* convert.c: element-wise dtype conversion with scaling, for compression
 * (float32 <-> float16/bfloat16) and pre/post-scaling of reduction inputs and
 * results. Pure computation on caller buffers. */
#include <math.h>
#include <string.h>

#include "reduce.h"
#include "reduce_impl.h"

static double load(cring_dtype_t dt, const void *p, size_t i) {
    switch (dt) {
    case CRING_FLOAT16: return cring__f16_to_f32(((const uint16_t *)p)[i]);
    case CRING_BFLOAT16: return cring__bf16_to_f32(((const uint16_t *)p)[i]);
    case CRING_FLOAT32: return ((const float *)p)[i];
    case CRING_FLOAT64: return ((const double *)p)[i];
    case CRING_INT8: return ((const int8_t *)p)[i];
    case CRING_UINT8: return ((const uint8_t *)p)[i];
    case CRING_INT32: return ((const int32_t *)p)[i];
    case CRING_INT64: return (double)((const int64_t *)p)[i];
    case CRING_INT16: return ((const int16_t *)p)[i];
    case CRING_UINT16: return ((const uint16_t *)p)[i];
    case CRING_UINT32: return ((const uint32_t *)p)[i];
    case CRING_UINT64: return (double)((const uint64_t *)p)[i];
    default: return 0;
    }
}

static void store(cring_dtype_t dt, void *p, size_t i, double v) {
    switch (dt) {
    case CRING_FLOAT16: ((uint16_t *)p)[i] = cring__f32_to_f16((float)v); break;
    case CRING_BFLOAT16: ((uint16_t *)p)[i] = cring__f32_to_bf16((float)v); break;
    case CRING_FLOAT32: ((float *)p)[i] = (float)v; break;
    case CRING_FLOAT64: ((double *)p)[i] = v; break;
    case CRING_INT8: ((int8_t *)p)[i] = (int8_t)trunc(v); break;
    case CRING_UINT8: ((uint8_t *)p)[i] = (uint8_t)trunc(v); break;
    case CRING_INT32: ((int32_t *)p)[i] = (int32_t)trunc(v); break;
    case CRING_INT64: ((int64_t *)p)[i] = (int64_t)trunc(v); break;
    case CRING_INT16: ((int16_t *)p)[i] = (int16_t)trunc(v); break;
    case CRING_UINT16: ((uint16_t *)p)[i] = (uint16_t)trunc(v); break;
    case CRING_UINT32: ((uint32_t *)p)[i] = (uint32_t)trunc(v); break;
    case CRING_UINT64: ((uint64_t *)p)[i] = (uint64_t)trunc(v); break;
    default: break;
    }
}

void cring__convert(cring_dtype_t dst_dtype, void *dst, cring_dtype_t src_dtype, const void *src,
                    size_t count, double scale) {
    if (dst_dtype == src_dtype && scale == 1.0) {
        if (dst != src) memmove(dst, src, count * cring_dtype_size(dst_dtype));
        return;
    }
    if (dst_dtype == CRING_FLOAT32 && src_dtype == CRING_FLOAT32) {
        const float *s = src;
        float *d = dst, f = (float)scale;
        for (size_t i = 0; i < count; i++) d[i] = s[i] * f;
        return;
    }
    if (dst_dtype == CRING_FLOAT64 && src_dtype == CRING_FLOAT64) {
        const double *s = src;
        double *d = dst;
        for (size_t i = 0; i < count; i++) d[i] = s[i] * scale;
        return;
    }
    if (src_dtype == CRING_FLOAT32 && (dst_dtype == CRING_FLOAT16 || dst_dtype == CRING_BFLOAT16)) {
        const float *s = src;
        uint16_t *d = dst;
        float f = (float)scale;
        if (dst_dtype == CRING_FLOAT16)
            for (size_t i = 0; i < count; i++) d[i] = cring__f32_to_f16(s[i] * f);
        else
            for (size_t i = 0; i < count; i++) d[i] = cring__f32_to_bf16(s[i] * f);
        return;
    }
    if (dst_dtype == CRING_FLOAT32 && (src_dtype == CRING_FLOAT16 || src_dtype == CRING_BFLOAT16)) {
        const uint16_t *s = src;
        float *d = dst, f = (float)scale;
        if (src_dtype == CRING_FLOAT16)
            for (size_t i = 0; i < count; i++) d[i] = cring__f16_to_f32(s[i]) * f;
        else
            for (size_t i = 0; i < count; i++) d[i] = cring__bf16_to_f32(s[i]) * f;
        return;
    }
    for (size_t i = 0; i < count; i++) store(dst_dtype, dst, i, load(src_dtype, src, i) * scale);
}

/* fake_nccl_reduce.c: the fake NCCL's element arithmetic (fake_nccl.h):
 * reading and writing each element type NCCL has, half and bfloat16 by hand,
 * and reducing the ranks' parts as NCCL does. Pure functions; no
 * communicators, streams or I/O. Never used outside tests. */
#include <math.h>
#include <string.h>

#include "fake_nccl.h"

/* fake_nccl.h */
size_t fake__type_size(int dt) {
    static const size_t sizes[NTYPES] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2};
    return dt >= 0 && dt < NTYPES ? sizes[dt] : 0;
}

/* fake_nccl.h */
int fake__is_float(int dt) {
    return dt == FLOAT16 || dt == FLOAT32 || dt == FLOAT64 || dt == BFLOAT16;
}

/* IEEE half to float, subnormals, infinities and NaNs kept. */
static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1f, man = h & 0x3ff, bits;
    if (exp == 0) {
        float f = ldexpf((float)man, -24);
        return sign ? -f : f;
    }
    if (exp == 31) bits = sign | 0x7f800000u | (man << 13);
    else bits = sign | ((exp + 112) << 23) | (man << 13);
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* float to IEEE half, rounded to nearest even; overflow gives infinity. */
static uint16_t float_to_half(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    uint32_t sign = (x >> 16) & 0x8000;
    if ((x & 0x7fffffff) > 0x7f800000) return (uint16_t)(sign | 0x7e00);
    float a = fabsf(f);
    if (a >= 65520.0f) return (uint16_t)(sign | 0x7c00);
    if (a < 6.103515625e-05f) return (uint16_t)(sign | (uint16_t)lrintf(a * 16777216.0f));
    int e;
    float m = frexpf(a, &e); /* a = m * 2^e, 0.5 <= m < 1 */
    long mant = lrintf((m * 2.0f - 1.0f) * 1024.0f);
    int exp = e - 1 + 15;
    if (mant == 1024) {
        mant = 0;
        exp++;
    }
    return (uint16_t)(sign | (uint32_t)(exp << 10) | (uint32_t)mant);
}

/* bfloat16 to float (the upper half of its bits). */
static float bf16_to_float(uint16_t b) {
    uint32_t bits = (uint32_t)b << 16;
    float f;
    memcpy(&f, &bits, 4);
    return f;
}

/* float to bfloat16, rounded to nearest even; NaNs stay quiet NaNs. */
static uint16_t float_to_bf16(float f) {
    uint32_t x;
    memcpy(&x, &f, 4);
    if ((x & 0x7fffffff) > 0x7f800000) return (uint16_t)((x >> 16) | 0x40);
    x += 0x7fff + ((x >> 16) & 1);
    return (uint16_t)(x >> 16);
}

/* fake_nccl.h */
double fake__load_f(const void *p, int dt, size_t i) {
    switch (dt) {
    case FLOAT16: return half_to_float(((const uint16_t *)p)[i]);
    case BFLOAT16: return bf16_to_float(((const uint16_t *)p)[i]);
    case FLOAT32: return ((const float *)p)[i];
    default: return ((const double *)p)[i];
    }
}

/* Element i of p (float type dt) = v, rounded to dt. */
static void store_f(void *p, int dt, size_t i, double v) {
    switch (dt) {
    case FLOAT16: ((uint16_t *)p)[i] = float_to_half((float)v); break;
    case BFLOAT16: ((uint16_t *)p)[i] = float_to_bf16((float)v); break;
    case FLOAT32: ((float *)p)[i] = (float)v; break;
    default: ((double *)p)[i] = v; break;
    }
}

/* fake_nccl.h */
int64_t fake__load_i(const void *p, int dt, size_t i) {
    switch (dt) {
    case INT8: return ((const int8_t *)p)[i];
    case UINT8: return ((const uint8_t *)p)[i];
    case INT32: return ((const int32_t *)p)[i];
    case UINT32: return ((const uint32_t *)p)[i];
    default: return ((const int64_t *)p)[i];
    }
}

/* Element i of p (integer type dt) = v, truncated to dt. */
static void store_i(void *p, int dt, size_t i, int64_t v) {
    switch (dt) {
    case INT8: ((int8_t *)p)[i] = (int8_t)v; break;
    case UINT8: ((uint8_t *)p)[i] = (uint8_t)v; break;
    case INT32: ((int32_t *)p)[i] = (int32_t)v; break;
    case UINT32: ((uint32_t *)p)[i] = (uint32_t)v; break;
    default: ((int64_t *)p)[i] = v; break;
    }
}

/* fake_nccl.h */
void fake__reduce_parts(int nranks, int dt, int op, double scalar,
                        const unsigned char *const *parts, size_t first, size_t count, void *out) {
    for (size_t i = 0; i < count; i++) {
        size_t k = first + i;
        if (fake__is_float(dt) || op >= FIRST_PREMUL) {
            double acc = 0;
            for (int r = 0; r < nranks; r++) {
                double v = fake__is_float(dt) ? fake__load_f(parts[r], dt, k)
                                              : (double)fake__load_i(parts[r], dt, k);
                if (op >= FIRST_PREMUL) v *= scalar;
                if (r == 0) acc = v;
                else if (op == SUM || op == AVG || op >= FIRST_PREMUL) acc += v;
                else if (op == PROD) acc *= v;
                else if (op == MAX) acc = (v > acc || isnan(v)) ? v : acc;
                else if (op == MIN) acc = (v < acc || isnan(v)) ? v : acc;
            }
            if (op == AVG) acc /= nranks;
            if (fake__is_float(dt)) store_f(out, dt, i, acc);
            else store_i(out, dt, i, (int64_t)acc);
        } else {
            uint64_t uacc = 0;
            int64_t acc = 0;
            for (int r = 0; r < nranks; r++) {
                int64_t v = fake__load_i(parts[r], dt, k);
                if (r == 0) {
                    acc = v;
                    uacc = (uint64_t)v;
                } else if (op == SUM || op == AVG) uacc += (uint64_t)v;
                else if (op == PROD) uacc *= (uint64_t)v;
                else if (op == MAX) acc = v > acc ? v : acc;
                else if (op == MIN) acc = v < acc ? v : acc;
            }
            if (op == SUM || op == PROD) acc = (int64_t)uacc;
            if (op == AVG) { /* the sum wraps in the element type, then divides toward zero */
                int64_t wrapped = 0;
                store_i(&wrapped, dt, 0, (int64_t)uacc);
                acc = fake__load_i(&wrapped, dt, 0) / nranks;
            }
            store_i(out, dt, i, acc);
        }
    }
}

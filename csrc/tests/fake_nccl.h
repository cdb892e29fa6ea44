/* fake_nccl.h: what fake_nccl.c and fake_nccl_reduce.c, built together into
 * libfake_nccl.so, share: NCCL's element types and reduction operators (the
 * values of nccl.h) and the element arithmetic. Never used outside tests. */
#ifndef CRING_FAKE_NCCL_H
#define CRING_FAKE_NCCL_H

#include <stddef.h>
#include <stdint.h>

enum {
    INT8 = 0,
    UINT8 = 1,
    INT32 = 2,
    UINT32 = 3,
    INT64 = 4,
    UINT64 = 5,
    FLOAT16 = 6,
    FLOAT32 = 7,
    FLOAT64 = 8,
    BFLOAT16 = 9,
    NTYPES = 10
};
enum { SUM = 0, PROD = 1, MAX = 2, MIN = 3, AVG = 4, FIRST_PREMUL = 5 };

/* Bytes of one element of dt; 0 for a type NCCL lacks. */
size_t fake__type_size(int dt);
/* Whether dt is a floating-point type. */
int fake__is_float(int dt);
/* Element i of p (type dt): floats through double, integers through int64. */
double fake__load_f(const void *p, int dt, size_t i);
int64_t fake__load_i(const void *p, int dt, size_t i);
/* out[i] = op over the nranks parts of parts[r][first + i], i < count, as
 * NCCL computes it (integer sums wrap; an average of integers divides the
 * wrapped sum toward zero); a pre-multiplied sum (op >= FIRST_PREMUL)
 * multiplies each part by scalar first. */
void fake__reduce_parts(int nranks, int dt, int op, double scalar,
                        const unsigned char *const *parts, size_t first, size_t count, void *out);

#endif

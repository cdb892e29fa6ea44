/* dlpack_abi.h: the DLPack ABI (v0.8 unversioned and v1.x versioned structs),
 * declared here from the published layout so the build needs no framework or
 * DLPack headers. Only what cring reads. */
#ifndef CRING_DLPACK_ABI_H
#define CRING_DLPACK_ABI_H

#include <stdint.h>

enum {
    CRING_DL_CPU = 1,
    CRING_DL_CUDA = 2,
    CRING_DL_CUDA_HOST = 3,
    CRING_DL_ROCM = 10,
    CRING_DL_CUDA_MANAGED = 13,
};

enum {
    CRING_DL_INT = 0,
    CRING_DL_UINT = 1,
    CRING_DL_FLOAT = 2,
    CRING_DL_BFLOAT = 4,
    CRING_DL_COMPLEX = 5,
    CRING_DL_BOOL = 6,
};

#define CRING_DL_FLAG_READ_ONLY (1ull << 0)

typedef struct {
    int32_t device_type;
    int32_t device_id;
} cring_dl_device_t;

typedef struct {
    uint8_t code;
    uint8_t bits;
    uint16_t lanes;
} cring_dl_dtype_t;

typedef struct {
    void *data;
    cring_dl_device_t device;
    int32_t ndim;
    cring_dl_dtype_t dtype;
    int64_t *shape;
    int64_t *strides; /* in elements; NULL means compact row-major */
    uint64_t byte_offset;
} cring_dl_tensor_t;

typedef struct cring_dl_managed {
    cring_dl_tensor_t dl_tensor;
    void *manager_ctx;
    void (*deleter)(struct cring_dl_managed *self);
} cring_dl_managed_t;

typedef struct {
    uint32_t major;
    uint32_t minor;
} cring_dl_version_t;

typedef struct cring_dl_managed_versioned {
    cring_dl_version_t version;
    void *manager_ctx;
    void (*deleter)(struct cring_dl_managed_versioned *self);
    uint64_t flags;
    cring_dl_tensor_t dl_tensor;
} cring_dl_managed_versioned_t;

#endif

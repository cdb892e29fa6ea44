/* cuda_api.h: the few CUDA runtime and NCCL types, values and function
 * signatures cring calls, declared here from their published ABI so that the
 * build needs no CUDA or NCCL headers. Never include the official headers next
 * to this one. Nothing here is linked: the functions are looked up with dlsym
 * (loader.c) into the tables below. */
#ifndef CRING_GPU_CUDA_API_H
#define CRING_GPU_CUDA_API_H

#include <stddef.h>

/* ---- CUDA runtime --------------------------------------------------------- */
typedef int cudaError_t; /* 0 is cudaSuccess */
typedef void *cudaStream_t;
typedef void *cudaEvent_t;
#define CRING_CUDA_SUCCESS 0
#define CRING_CUDA_ERROR_NOT_READY 600     /* cudaEventQuery: recorded work still running */
#define CRING_CUDA_ERROR_NOT_SUPPORTED 801 /* e.g. cudaMallocAsync on a device without pools */

/* cudaMemcpyKind */
enum {
    CRING_CUDA_MEMCPY_HOST_TO_DEVICE = 1,
    CRING_CUDA_MEMCPY_DEVICE_TO_HOST = 2,
    CRING_CUDA_MEMCPY_DEVICE_TO_DEVICE = 3,
};
/* cudaHostAlloc flags: cudaHostAllocPortable pins for every device. */
#define CRING_CUDA_HOST_ALLOC_PORTABLE 0x01u
/* cudaEventDisableTiming: an event only for ordering (cheaper to record). */
#define CRING_CUDA_EVENT_DISABLE_TIMING 0x02u
/* cudaStreamNonBlocking: no implicit ordering with the legacy default stream. */
#define CRING_CUDA_STREAM_NON_BLOCKING 0x01u

typedef struct cring__cudart_api {
    cudaError_t (*GetDeviceCount)(int *count);
    cudaError_t (*GetDevice)(int *device);
    cudaError_t (*SetDevice)(int device);
    cudaError_t (*RuntimeGetVersion)(int *version);
    const char *(*GetErrorString)(cudaError_t error);
    cudaError_t (*HostAlloc)(void **ptr, size_t bytes, unsigned int flags);
    cudaError_t (*FreeHost)(void *ptr);
    cudaError_t (*MemcpyAsync)(void *dst, const void *src, size_t bytes, int kind,
                               cudaStream_t stream);
    cudaError_t (*StreamSynchronize)(cudaStream_t stream);
    cudaError_t (*Malloc)(void **ptr, size_t bytes);
    cudaError_t (*Free)(void *ptr);
    cudaError_t (*MemsetAsync)(void *ptr, int value, size_t bytes, cudaStream_t stream);
    cudaError_t (*EventCreateWithFlags)(cudaEvent_t *event, unsigned int flags);
    cudaError_t (*EventDestroy)(cudaEvent_t event);
    cudaError_t (*EventRecord)(cudaEvent_t event, cudaStream_t stream);
    cudaError_t (*EventQuery)(cudaEvent_t event);
    cudaError_t (*EventSynchronize)(cudaEvent_t event);
    cudaError_t (*StreamWaitEvent)(cudaStream_t stream, cudaEvent_t event, unsigned int flags);
    cudaError_t (*StreamCreateWithFlags)(cudaStream_t *stream, unsigned int flags);
    /* stream-ordered allocation, CUDA >= 11.2; NULL when the runtime lacks it */
    cudaError_t (*MallocAsync)(void **ptr, size_t bytes, cudaStream_t stream);
    cudaError_t (*FreeAsync)(void *ptr, cudaStream_t stream);
} cring__cudart_api_t;

/* ---- NCCL ------------------------------------------------------------------ */
#define CRING_NCCL_UNIQUE_ID_BYTES 128
typedef struct {
    char internal[CRING_NCCL_UNIQUE_ID_BYTES];
} ncclUniqueId;
typedef struct ncclComm *ncclComm_t;

typedef enum {
    ncclSuccess = 0,
    ncclUnhandledCudaError = 1,
    ncclSystemError = 2,
    ncclInternalError = 3,
    ncclInvalidArgument = 4,
    ncclInvalidUsage = 5,
    ncclRemoteError = 6,
    ncclInProgress = 7,
} ncclResult_t;

typedef enum {
    ncclInt8 = 0,
    ncclUint8 = 1,
    ncclInt32 = 2,
    ncclUint32 = 3,
    ncclInt64 = 4,
    ncclUint64 = 5,
    ncclFloat16 = 6,
    ncclFloat32 = 7,
    ncclFloat64 = 8,
    ncclBfloat16 = 9,
} ncclDataType_t;

typedef enum {
    ncclSum = 0,
    ncclProd = 1,
    ncclMax = 2,
    ncclMin = 3,
    ncclAvg = 4, /* NCCL >= 2.10 */
    /* values >= 5 are created by ncclRedOpCreatePreMulSum */
} ncclRedOp_t;

typedef enum {
    ncclScalarDevice = 0,
    ncclScalarHostImmediate = 1,
} ncclScalarResidence_t;

typedef struct cring__nccl_api {
    ncclResult_t (*GetVersion)(int *version);
    ncclResult_t (*GetUniqueId)(ncclUniqueId *id);
    ncclResult_t (*CommInitRank)(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank);
    ncclResult_t (*CommDestroy)(ncclComm_t comm);
    ncclResult_t (*CommAbort)(ncclComm_t comm);
    ncclResult_t (*CommGetAsyncError)(ncclComm_t comm, ncclResult_t *async_error);
    const char *(*GetErrorString)(ncclResult_t result);
    const char *(*GetLastError)(ncclComm_t comm); /* NCCL >= 2.13; may be NULL */
    ncclResult_t (*AllReduce)(const void *send, void *recv, size_t count, ncclDataType_t dtype,
                              ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream);
    ncclResult_t (*Broadcast)(const void *send, void *recv, size_t count, ncclDataType_t dtype,
                              int root, ncclComm_t comm, cudaStream_t stream);
    ncclResult_t (*Reduce)(const void *send, void *recv, size_t count, ncclDataType_t dtype,
                           ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream);
    ncclResult_t (*AllGather)(const void *send, void *recv, size_t send_count, ncclDataType_t dtype,
                              ncclComm_t comm, cudaStream_t stream);
    ncclResult_t (*ReduceScatter)(const void *send, void *recv, size_t recv_count,
                                  ncclDataType_t dtype, ncclRedOp_t op, ncclComm_t comm,
                                  cudaStream_t stream);
    ncclResult_t (*GroupStart)(void);
    ncclResult_t (*GroupEnd)(void);
    ncclResult_t (*RedOpCreatePreMulSum)(ncclRedOp_t *op, void *scalar, ncclDataType_t dtype,
                                         ncclScalarResidence_t residence, ncclComm_t comm);
    ncclResult_t (*RedOpDestroy)(ncclRedOp_t op, ncclComm_t comm);
    /* point-to-point, NCCL >= 2.7 (alltoall: one of each per peer in a group) */
    ncclResult_t (*Send)(const void *send, size_t count, ncclDataType_t dtype, int peer,
                         ncclComm_t comm, cudaStream_t stream);
    ncclResult_t (*Recv)(void *recv, size_t count, ncclDataType_t dtype, int peer, ncclComm_t comm,
                         cudaStream_t stream);
} cring__nccl_api_t;

/* NCCL's version code: major*10000 + minor*100 + patch since 2.9, before that
 * major*1000 + minor*100 + patch. */
#define CRING_NCCL_MIN_VERSION_CODE 21003 /* 2.10.3: ncclAvg and bfloat16 */
/* NCCL's one-rank reduce defect (NVIDIA/nccl issue 1950): from 2.27.0 up to
 * 2.29.6, at nranks == 1 the reduce kernels of ncclAvg and ncclPreMulSum
 * leave the last `count % blocks` elements of an out-of-place result
 * unwritten; fixed in 2.29.7. */
#define CRING_NCCL_ONE_RANK_DEFECT_FIRST 22700
#define CRING_NCCL_ONE_RANK_DEFECT_FIXED 22907

#endif /* CRING_GPU_CUDA_API_H */

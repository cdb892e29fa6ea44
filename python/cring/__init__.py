"""cring: collectives for data-parallel training (allreduce, broadcast,
allgather, reducescatter, alltoall, barrier, join) over any DLPack tensor, with a C core that
builds against no framework.

    import cring, numpy as np
    cring.init()
    x = np.full(10, cring.rank(), dtype=np.float32)
    cring.allreduce_(x, op=cring.Sum)

Importing cring never imports torch, Lightning or Ray.
"""

from ._core import (  # the shared types (cring._core sits below the API)
    Adasum,
    Average,
    Compression,
    Compressor,
    CRingError,
    Handle,
    Max,
    Min,
    MismatchError,
    NotInitializedError,
    PeerFailureError,
    Product,
    ReduceOp,
    Sum,
    TimeoutError,
    poll,
    rank,
    size,
    synchronize,
)
from ._api import (
    allgather,
    allgather_async,
    allreduce,
    allreduce_,
    allreduce_async,
    allreduce_async_,
    alltoall,
    alltoall_async,
    barrier,
    broadcast,
    broadcast_,
    broadcast_async,
    broadcast_async_,
    engine_stats,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    reducescatter_async,
    start_timeline,
    stop_timeline,
    cross_rank,
    cross_size,
    init,
    is_initialized,
    join,
    local_rank,
    local_size,
    reducescatter,
    shutdown,
    transport,
)
from ._gpu import cuda_available, nccl_available

__version__ = "0.1.0"

__all__ = [
    "Adasum", "Average", "CRingError", "Compression", "Compressor", "Handle", "Max", "Min",
    "MismatchError", "NotInitializedError", "PeerFailureError", "Product", "ReduceOp", "Sum",
    "TimeoutError", "allgather", "allgather_async", "allreduce", "allreduce_",
    "allreduce_async", "allreduce_async_", "alltoall", "alltoall_async", "barrier", "broadcast", "broadcast_",
    "broadcast_async", "broadcast_async_", "cross_rank", "cross_size", "engine_stats",
    "grouped_allgather", "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter",
    "grouped_reducescatter_async", "init", "is_initialized", "join", "local_rank", "local_size", "poll",
    "rank", "reducescatter", "reducescatter_async", "shutdown", "size", "start_timeline",
    "stop_timeline", "synchronize", "transport", "__version__",
    "cuda_available", "nccl_available",
]

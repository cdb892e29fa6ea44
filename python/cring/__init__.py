"""cring: collectives for data-parallel training (allreduce, broadcast,
allgather, reducescatter, barrier) over any DLPack tensor, with a C core that
builds against no framework.

    import cring, numpy as np
    cring.init()
    x = np.full(10, cring.rank(), dtype=np.float32)
    cring.allreduce_(x, op=cring.Sum)

Importing cring never imports torch, Lightning or Ray.
"""

from ._api import (
    Adasum,
    Average,
    CRingError,
    Max,
    Min,
    MismatchError,
    NotInitializedError,
    PeerFailureError,
    Product,
    ReduceOp,
    Sum,
    TimeoutError,
    allgather,
    allreduce,
    allreduce_,
    barrier,
    broadcast,
    broadcast_,
    cross_rank,
    cross_size,
    init,
    is_initialized,
    local_rank,
    local_size,
    rank,
    reducescatter,
    shutdown,
    size,
    transport,
)

__version__ = "0.1.0"

__all__ = [
    "Adasum", "Average", "CRingError", "Max", "Min", "MismatchError", "NotInitializedError",
    "PeerFailureError", "Product", "ReduceOp", "Sum", "TimeoutError", "allgather", "allreduce",
    "allreduce_", "barrier", "broadcast", "broadcast_", "cross_rank", "cross_size", "init",
    "is_initialized", "local_rank", "local_size", "rank", "reducescatter", "shutdown", "size",
    "transport", "__version__",
]

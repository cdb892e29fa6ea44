"""cring.torch: a drop-in for horovod.torch.

    import cring.torch as hvd
    hvd.init()
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)

Same names, signatures, defaults and semantics as horovod.torch; collectives
run on cring's engine. torch is optional for cring; this module needs it.
Not supported (they raise NotImplementedError): process sets other than
global_process_set, and Adasum.
"""

from .mpi_ops import (
    Adasum,
    Average,
    BF16Compressor,
    Compression,
    Compressor,
    FP16Compressor,
    HorovodInternalError,
    HostsUpdatedInterrupt,
    Max,
    Min,
    NoneCompressor,
    PeerFailureInternalError,
    ProcessSet,
    Product,
    ReduceOp,
    Sum,
    TimeoutInternalError,
    add_process_set,
    allgather,
    allgather_async,
    allgather_object,
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
    broadcast_object,
    ccl_built,
    cring_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    init,
    is_initialized,
    join,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    poll,
    rank,
    reducescatter,
    reducescatter_async,
    remove_process_set,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
    synchronize,
)
from .optimizer import DistributedOptimizer, broadcast_optimizer_state, broadcast_parameters

__all__ = [
    "Adasum", "Average", "BF16Compressor", "Compression", "Compressor", "DistributedOptimizer",
    "FP16Compressor", "HorovodInternalError", "HostsUpdatedInterrupt", "Max", "Min",
    "NoneCompressor", "PeerFailureInternalError", "ProcessSet", "Product", "ReduceOp", "Sum",
    "TimeoutInternalError", "add_process_set", "allgather", "allgather_async",
    "allgather_object", "allreduce", "allreduce_", "allreduce_async", "allreduce_async_",
    "alltoall", "alltoall_async", "barrier", "broadcast", "broadcast_", "broadcast_async",
    "broadcast_async_", "broadcast_object", "broadcast_optimizer_state", "broadcast_parameters",
    "ccl_built", "cring_built", "cross_rank", "cross_size", "cuda_built", "ddl_built",
    "global_process_set", "gloo_built", "gloo_enabled", "grouped_allgather",
    "grouped_allgather_async", "grouped_allreduce", "grouped_allreduce_",
    "grouped_allreduce_async", "grouped_allreduce_async_", "grouped_reducescatter",
    "grouped_reducescatter_async", "init", "is_initialized", "join", "local_rank", "local_size",
    "mpi_built", "mpi_enabled", "mpi_threads_supported", "nccl_built", "poll", "rank",
    "reducescatter", "reducescatter_async", "remove_process_set", "rocm_built", "shutdown",
    "size", "start_timeline", "stop_timeline", "synchronize",
]

from . import elastic  # noqa: E402  (hvd.elastic.run, hvd.elastic.TorchState, as in Horovod)

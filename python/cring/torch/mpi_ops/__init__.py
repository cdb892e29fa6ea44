"""horovod.torch's collective API on cring's engine: the same names,
signatures, defaults and semantics, so that `import cring.torch as hvd` is the
one line a Horovod script changes.

Thin: it translates Horovod's arguments (the deprecated `average=`,
`process_set=`, Horovod's compressor classes), adds autograd functions with
Horovod's gradients and turns communication failures into
HorovodInternalError. Every collective runs through cring's engine
(cring._collectives); nothing here communicates on its own. Must not import anything
but torch, numpy and cring. This package only gathers the names; its modules,
each importing only those above it:

    _basics       reduction ops, Horovod's errors and _run, process sets,
                  init/rank/size, timeline, what this build has
    _compression  Compressor, Compression.none/fp16/bf16, wire-compression planning
    _autograd     the autograd Functions (Horovod's gradients)
    _collectives  allreduce, allgather, broadcast, reducescatter, alltoall
                  (plain, async, in-place, grouped), join, barrier, poll,
                  synchronize
    _objects      broadcast_object, allgather_object
    _sparse       sparse_allreduce_async (allgathers of indices and values)
    _compiled     allreduce, allgather, broadcast and grouped_allreduce as torch
                  operators (cring::*), which _collectives calls while torch.compile traces
"""

from ._basics import (
    Adasum,
    Average,
    HorovodInternalError,
    HostsUpdatedInterrupt,
    Max,
    Min,
    PeerFailureInternalError,
    ProcessSet,
    Product,
    ReduceOp,
    Sum,
    TimeoutInternalError,
    add_process_set,
    ccl_built,
    cring_built,
    cross_rank,
    cross_size,
    cuda_built,
    ddl_built,
    global_process_set,
    gloo_built,
    gloo_enabled,
    init,
    is_initialized,
    local_rank,
    local_size,
    mpi_built,
    mpi_enabled,
    mpi_threads_supported,
    nccl_built,
    rank,
    remove_process_set,
    rocm_built,
    shutdown,
    size,
    start_timeline,
    stop_timeline,
)

# Tests reach these helpers through cring.torch.mpi_ops.
from ._basics import _internal_error as _internal_error
from ._basics import _run as _run
from ._collectives import (
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
    grouped_allgather,
    grouped_allgather_async,
    grouped_allreduce,
    grouped_allreduce_,
    grouped_allreduce_async,
    grouped_allreduce_async_,
    grouped_reducescatter,
    grouped_reducescatter_async,
    join,
    poll,
    reducescatter,
    reducescatter_async,
    synchronize,
)
from ._compression import (
    BF16Compressor,
    Compression,
    Compressor,
    FP16Compressor,
    NoneCompressor,
)
from ._objects import allgather_object, broadcast_object
from ._sparse import sparse_allreduce_async

__all__ = [
    "Adasum",
    "Average",
    "BF16Compressor",
    "Compression",
    "Compressor",
    "FP16Compressor",
    "HorovodInternalError",
    "HostsUpdatedInterrupt",
    "Max",
    "Min",
    "NoneCompressor",
    "PeerFailureInternalError",
    "ProcessSet",
    "Product",
    "ReduceOp",
    "Sum",
    "TimeoutInternalError",
    "add_process_set",
    "allgather",
    "allgather_async",
    "allgather_object",
    "allreduce",
    "allreduce_",
    "allreduce_async",
    "allreduce_async_",
    "alltoall",
    "alltoall_async",
    "barrier",
    "broadcast",
    "broadcast_",
    "broadcast_async",
    "broadcast_async_",
    "broadcast_object",
    "ccl_built",
    "cring_built",
    "cross_rank",
    "cross_size",
    "cuda_built",
    "ddl_built",
    "global_process_set",
    "gloo_built",
    "gloo_enabled",
    "grouped_allgather",
    "grouped_allgather_async",
    "grouped_allreduce",
    "grouped_allreduce_",
    "grouped_allreduce_async",
    "grouped_allreduce_async_",
    "grouped_reducescatter",
    "grouped_reducescatter_async",
    "init",
    "is_initialized",
    "join",
    "local_rank",
    "local_size",
    "mpi_built",
    "mpi_enabled",
    "mpi_threads_supported",
    "nccl_built",
    "poll",
    "rank",
    "reducescatter",
    "reducescatter_async",
    "remove_process_set",
    "rocm_built",
    "shutdown",
    "size",
    "sparse_allreduce_async",
    "start_timeline",
    "stop_timeline",
    "synchronize",
]

# Tracebacks, reprs and pickles name the public classes as before the split:
# cring.torch.mpi_ops.HorovodInternalError, not ..._basics.HorovodInternalError.
for _public_class in (
    HorovodInternalError,
    PeerFailureInternalError,
    TimeoutInternalError,
    Compressor,
    NoneCompressor,
    FP16Compressor,
    BF16Compressor,
    Compression,
):
    _public_class.__module__ = __name__
del _public_class

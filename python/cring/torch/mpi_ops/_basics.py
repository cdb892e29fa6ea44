"""cring.torch's basics: Horovod's reduction ops, its error classes and the
wrapper (_run) that turns cring's communication failures into them, process
sets (cring's own), init/rank/size and what this build has. The
bottom of cring.torch.mpi_ops: it imports no sibling, and runs no collective.
"""

from __future__ import annotations

from typing import Any, Optional

import cring
from cring import _gpu
from cring import elastic as _elastic

# ---- reduction ops (Horovod's numbering; cring uses the same values) -----------------------------

ReduceOp = cring.ReduceOp
Average = cring.Average
Sum = cring.Sum
Adasum = cring.Adasum
Min = cring.Min
Max = cring.Max
Product = cring.Product

# ---- errors --------------------------------------------------------------------------------------


class HorovodInternalError(cring.CRingError):
    """A collective failed because of the communicator (a peer died or timed
    out, a stall was shut down): as in Horovod, shutdown() and init() again
    (elastic training catches this and restores its state). The cring error
    it replaces is its __cause__. Ranks that disagree (cring.MismatchError)
    and bad arguments (TypeError, ValueError) are raised unchanged."""


class PeerFailureInternalError(HorovodInternalError, cring.PeerFailureError):
    """A peer died or closed its connection: both a HorovodInternalError and a
    cring.PeerFailureError."""


class TimeoutInternalError(HorovodInternalError, cring.TimeoutError):
    """A peer did not arrive in time (or a stall was shut down): both a
    HorovodInternalError and a cring.TimeoutError."""


# Horovod's elastic signal that the set of workers changed (cring.elastic raises it).
HostsUpdatedInterrupt = _elastic.HostsUpdatedInterrupt


# ValueError: cring errors that are also argument errors (one call mixing CUDA
# and CPU tensors), raised unchanged like any bad argument.
_PASS_THROUGH = (
    cring.MismatchError,
    cring.NotInitializedError,
    HorovodInternalError,
    ValueError,
)


def _internal_error(error: BaseException) -> Optional[BaseException]:
    """The HorovodInternalError that replaces a cring error, or None when the
    error is raised unchanged (mismatches, not initialised, argument errors)."""
    if not isinstance(error, cring.CRingError) or isinstance(error, _PASS_THROUGH):
        return None
    if isinstance(error, cring.PeerFailureError):
        return PeerFailureInternalError(str(error))
    if isinstance(error, cring.TimeoutError):
        return TimeoutInternalError(str(error))
    return HorovodInternalError(str(error))


def _run(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """Call a cring function, raising communication failures as HorovodInternalError."""
    try:
        return fn(*args, **kwargs)
    except cring.CRingError as error:
        wrapped = _internal_error(error)
        if wrapped is None:
            raise
        raise wrapped from error


# ---- basics --------------------------------------------------------------------------------------


# Process sets are cring's own (each has its own communicator and engine):
# the same class and global set, so `process_set=` takes either module's.
ProcessSet = cring.ProcessSet
global_process_set = cring.global_process_set


def add_process_set(process_set: Any) -> ProcessSet:
    """Register a process set (a ProcessSet or a list of global ranks) on
    every rank and return it: collective, every rank calls it in the same
    order with the same ranks (cring.add_process_set)."""
    return _run(cring.add_process_set, process_set)


def remove_process_set(process_set: Any) -> bool:
    """Stop and forget a process set (collective); False for the global set
    or one not registered."""
    return _run(cring.remove_process_set, process_set)


def init(
    comm: Any = None,
    process_sets: Any = None,
    *,
    rank: Optional[int] = None,
    size: Optional[int] = None,
    addr: Optional[str] = None,
    port: Optional[int] = None,
    secret: Optional[str] = None,
    transport: Optional[str] = None,
    timeout_s: Optional[float] = None,
) -> None:
    """Join the job (Horovod's hvd.init()). Rank, size and the rendezvous come
    from the environment (HOROVOD_RANK/HOROVOD_SIZE, torchrun, mpirun, SLURM,
    cringrun) or from cring.init()'s keyword arguments. A second call while
    initialised does nothing. `process_sets`: ProcessSets (or rank lists) to
    register at once, the same on every rank ("dynamic", Horovod's switch
    for adding sets later, is accepted: cring always allows that). `comm`
    (an MPI communicator or a list of ranks) is not supported: the job is
    every rank; use a process set for a subset."""
    if comm is not None:
        raise NotImplementedError(
            "init(comm=...) is not supported: cring does not run on MPI "
            "communicators or subsets of ranks; every process of the job "
            "takes part"
        )
    if isinstance(process_sets, str):
        if process_sets != "dynamic":
            raise ValueError(f"process_sets must be a list or 'dynamic', got {process_sets!r}")
        process_sets = None
    cring.init(
        rank=rank,
        size=size,
        addr=addr,
        port=port,
        secret=secret,
        transport=transport,
        timeout_s=timeout_s,
        process_sets=process_sets,
    )


shutdown = cring.shutdown
is_initialized = cring.is_initialized
rank = cring.rank
size = cring.size
local_rank = cring.local_rank
local_size = cring.local_size
cross_rank = cring.cross_rank
cross_size = cring.cross_size


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Horovod's start_timeline: rank 0 writes a Chrome-trace timeline in
    Horovod's layout to `file_path` from now on; `mark_cycles` adds a
    CYCLE_START marker per cycle (cring.start_timeline(..., all_ranks=True)
    writes a file per rank)."""
    cring.start_timeline(file_path, mark_cycles=mark_cycles)


def stop_timeline() -> None:
    """Stop writing the timeline."""
    cring.stop_timeline()


# What this build has, answered truthfully and with Horovod's return types:
# cring talks over its own shared memory and TCP transports, with no MPI,
# Gloo, DDL, oneCCL or ROCm; NCCL and the CUDA runtime are loaded at run time,
# so for those two "built" means "usable here".
def mpi_built() -> bool:
    return False


def mpi_enabled() -> bool:
    return False


def mpi_threads_supported() -> bool:
    """False. (Horovod's raises ValueError when MPI is not enabled; cring,
    which never enables MPI, answers instead: docs/horovod_migration.md.)"""
    return False


def gloo_built() -> bool:
    return False


def gloo_enabled() -> bool:
    return False


def nccl_built() -> int:
    """As Horovod's: the version code of the NCCL cring loads at run time
    (ncclGetVersion's, e.g. 22809 for 2.28.9), or 0 when none can be loaded
    (cring never links it)."""
    if not cring.nccl_available():
        return 0
    return int(_gpu.nccl_info().get("version_code") or 0)


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    """True when the CUDA runtime loads and a device is usable."""
    return bool(cring.cuda_available())


def rocm_built() -> bool:
    return False


def cring_built() -> bool:
    return True

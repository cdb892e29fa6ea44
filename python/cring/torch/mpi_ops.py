"""horovod.torch's collective API on cring's engine: the same names,
signatures, defaults and semantics, so that `import cring.torch as hvd` is the
one line a Horovod script changes.

Thin: it translates Horovod's arguments (the deprecated `average=`,
`process_set=`, Horovod's compressor classes), adds autograd functions with
Horovod's gradients and turns communication failures into
HorovodInternalError. Every collective runs through cring's engine
(cring._api); nothing here communicates on its own. Must not import anything
but torch, numpy and cring.
"""

from __future__ import annotations

import io
import pickle
import warnings
from typing import Any, Optional, Sequence

import torch

import cring
from cring import _core
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


_PASS_THROUGH = (cring.MismatchError, cring.NotInitializedError, HorovodInternalError)


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


class ProcessSet:
    """Horovod's handle for a subset of ranks. cring runs every collective on
    all ranks, so the only usable set is `global_process_set`; passing any
    other raises NotImplementedError."""

    def __init__(self, ranks_or_comm: Any = None):
        self._ranks = None if ranks_or_comm is None else list(ranks_or_comm)
        self.process_set_id = 0 if ranks_or_comm is None else None

    @property
    def ranks(self) -> list:
        return list(range(cring.size())) if self._ranks is None else list(self._ranks)

    def size(self) -> int:
        return cring.size() if self._ranks is None else len(self._ranks)

    def rank(self) -> int:
        return cring.rank() if self._ranks is None else self._ranks.index(cring.rank())

    def included(self) -> bool:
        return True if self._ranks is None else cring.rank() in self._ranks

    def __repr__(self) -> str:
        return "ProcessSet(global)" if self is global_process_set else f"ProcessSet({self._ranks})"


global_process_set = ProcessSet()

_NO_PROCESS_SETS = ("process sets are not supported yet: cring runs every collective on all "
                    "ranks; use process_set=global_process_set (the default)")


def _check_process_set(process_set: Any) -> None:
    if process_set is not global_process_set:
        raise NotImplementedError(f"{_NO_PROCESS_SETS} (got {process_set!r})")


def add_process_set(process_set: Any) -> ProcessSet:
    """Not supported: cring has no process sets yet."""
    raise NotImplementedError(_NO_PROCESS_SETS)


def remove_process_set(process_set: Any) -> bool:
    """Not supported: cring has no process sets yet."""
    raise NotImplementedError(_NO_PROCESS_SETS)


def init(comm: Any = None, process_sets: Any = None, *, rank: Optional[int] = None,
         size: Optional[int] = None, addr: Optional[str] = None, port: Optional[int] = None,
         secret: Optional[str] = None, transport: Optional[str] = None,
         timeout_s: Optional[float] = None) -> None:
    """Join the job (Horovod's hvd.init()). Rank, size and the rendezvous come
    from the environment (HOROVOD_RANK/HOROVOD_SIZE, torchrun, mpirun, SLURM,
    cringrun) or from cring.init()'s keyword arguments. A second call while
    initialised does nothing. `comm` (an MPI communicator or a list of ranks)
    and `process_sets` are not supported: cring always uses every rank."""
    if comm is not None:
        raise NotImplementedError("init(comm=...) is not supported: cring does not run on MPI "
                                  "communicators or subsets of ranks; every process of the job "
                                  "takes part")
    if process_sets:
        raise NotImplementedError(f"init(process_sets=...): {_NO_PROCESS_SETS}")
    cring.init(rank=rank, size=size, addr=addr, port=port, secret=secret, transport=transport,
               timeout_s=timeout_s)


shutdown = cring.shutdown
is_initialized = cring.is_initialized
rank = cring.rank
size = cring.size
local_rank = cring.local_rank
local_size = cring.local_size
cross_rank = cring.cross_rank
cross_size = cring.cross_size


def start_timeline(file_path: str, mark_cycles: bool = False) -> None:
    """Write a Chrome-trace timeline from now on (cring writes one file per
    rank: trace.json becomes trace.<rank>.json). `mark_cycles` is accepted and
    ignored."""
    cring.start_timeline(file_path)


def stop_timeline() -> None:
    """Stop writing the timeline."""
    cring.stop_timeline()


# What this build has, answered truthfully: cring talks over its own shared
# memory and TCP transports, with no MPI, Gloo, NCCL, DDL, oneCCL, CUDA or ROCm.
def mpi_built() -> bool:
    return False


def mpi_enabled() -> bool:
    return False


def mpi_threads_supported() -> bool:
    return False


def gloo_built() -> bool:
    return False


def gloo_enabled() -> bool:
    return False


def nccl_built() -> bool:
    """True when NCCL can be loaded at run time (cring never links it)."""
    return cring.nccl_available()


def ddl_built() -> bool:
    return False


def ccl_built() -> bool:
    return False


def cuda_built() -> bool:
    """True when the CUDA runtime loads and a device is usable."""
    return cring.cuda_available()


def rocm_built() -> bool:
    return False


def cring_built() -> bool:
    return True


# ---- compression ---------------------------------------------------------------------------------


class Compressor:
    """Horovod's compression interface: compress(tensor) -> (tensor, ctx)
    before the allreduce, decompress(tensor, ctx) -> tensor after it."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple:
        raise NotImplementedError

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        raise NotImplementedError


class NoneCompressor(Compressor):
    """No compression (the default)."""

    @staticmethod
    def compress(tensor: torch.Tensor) -> tuple:
        return tensor, None

    @staticmethod
    def decompress(tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        return tensor


class _CastCompressor(Compressor):
    """Floating-point tensors travel as `_dtype` and are cast back after.
    In allreduce, float32 tensors are not cast here: they go to cring as they
    are and travel as `_dtype` on the wire (`_wire`), which saves a copy."""

    _dtype: torch.dtype
    _wire: Any

    @classmethod
    def compress(cls, tensor: torch.Tensor) -> tuple:
        if tensor.dtype.is_floating_point and tensor.dtype != cls._dtype:
            return tensor.type(cls._dtype), tensor.dtype
        return tensor, tensor.dtype

    @classmethod
    def decompress(cls, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        if ctx is not None and ctx.is_floating_point and tensor.dtype != ctx:
            return tensor.type(ctx)
        return tensor


class FP16Compressor(_CastCompressor):
    """Floating-point tensors travel as float16."""

    _dtype = torch.float16
    _wire = cring.Compression.fp16


class BF16Compressor(_CastCompressor):
    """Floating-point tensors travel as bfloat16."""

    _dtype = torch.bfloat16
    _wire = cring.Compression.bf16


class Compression:
    """Choices for `compression=` (as in horovod.torch): Compression.none,
    .fp16, .bf16, or any class with Horovod's compress/decompress."""

    none = NoneCompressor
    fp16 = FP16Compressor
    bf16 = BF16Compressor


_WIRE_COMPRESSORS = (FP16Compressor, BF16Compressor)


def _plan_compression(compression: Any, tensors: Sequence[torch.Tensor]) -> tuple:
    """(compressor to run in Python or None, cring wire compression or None)."""
    if compression is None or compression is NoneCompressor or \
            compression is cring.Compression.none:
        return None, None
    if isinstance(compression, cring.Compressor):  # cring's own: float32 on the wire
        return None, compression
    if compression in _WIRE_COMPRESSORS and all(t.dtype == torch.float32 for t in tensors):
        return None, compression._wire
    return compression, None


def _python_compressor(compression: Any) -> Any:
    """The compressor to run in Python for collectives without wire compression."""
    if compression is None or compression is NoneCompressor or \
            compression is cring.Compression.none:
        return None
    if isinstance(compression, cring.Compressor):
        return {"float16": FP16Compressor, "bfloat16": BF16Compressor}[compression.wire_dtype]
    return compression


def _compress_all(compressor: Any, tensors: list) -> tuple:
    pairs = [compressor.compress(t) for t in tensors]
    return [p[0] for p in pairs], [p[1] for p in pairs]


# ---- arguments -----------------------------------------------------------------------------------


def _resolve_op(op: Any, average: Optional[bool]) -> Any:
    """Horovod's handling of the deprecated `average=` next to `op=`."""
    if op is not None:
        if average is not None:
            raise ValueError("The op parameter supersedes average. Please provide only one of "
                             "them.")
        return op
    if average is None:
        return Average
    warnings.warn("Parameter `average` has been replaced with `op` and will be removed; use "
                  "op=Average or op=Sum", DeprecationWarning, stacklevel=3)
    return Average if average else Sum


def _check_op(op: Any) -> Any:
    # cring checks the op itself (unknown ops, Adasum) where it submits
    return Average if op is None else op


def _wants_grad(tensors: Sequence[torch.Tensor]) -> bool:
    return torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in tensors)


def _contiguous(tensor: torch.Tensor) -> torch.Tensor:
    # Incoming gradients are often expanded views (stride 0), which cring refuses.
    return tensor if tensor.is_contiguous() else tensor.contiguous()


# ---- autograd functions (Horovod's gradients) ----------------------------------------------------


class _AllreduceFunction(torch.autograd.Function):
    """Gradient: the incoming gradient, allreduced with the same op and scale factors."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: Optional[str], op: Any, prescale: float,
                postscale: float, wire: Any) -> torch.Tensor:
        ctx.reduction = (op, prescale, postscale, wire)
        return _run(cring.allreduce, tensor, op=op, name=name, compression=wire,
                    prescale_factor=prescale, postscale_factor=postscale)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple:
        op, prescale, postscale, wire = ctx.reduction
        grad = _run(cring.allreduce, _contiguous(grad_output), op=op, compression=wire,
                    prescale_factor=prescale, postscale_factor=postscale)
        return grad, None, None, None, None, None


class _GroupedAllreduceFunction(torch.autograd.Function):
    """Gradient: the incoming gradients, grouped-allreduced with the same op and factors."""

    @staticmethod
    def forward(ctx: Any, name: Optional[str], op: Any, prescale: float, postscale: float,
                wire: Any, *tensors: torch.Tensor) -> tuple:
        ctx.reduction = (op, prescale, postscale, wire)
        return tuple(_run(cring.grouped_allreduce, list(tensors), op=op, name=name,
                          compression=wire, prescale_factor=prescale,
                          postscale_factor=postscale))

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple:
        op, prescale, postscale, wire = ctx.reduction
        grads = _run(cring.grouped_allreduce, [_contiguous(g) for g in grad_outputs], op=op,
                     compression=wire, prescale_factor=prescale, postscale_factor=postscale)
        return (None, None, None, None, None, *grads)


def _row_offsets(rows: list) -> list:
    """Every rank's first dimension for each tensor ([rank][tensor]), by one allgather."""
    counts = torch.tensor(rows, dtype=torch.int64)
    gathered = _run(cring.allgather, counts).view(size(), len(rows))
    before = gathered[:rank()].sum(dim=0) if rank() else torch.zeros(len(rows), dtype=torch.int64)
    return [int(v) for v in before]


class _AllgatherFunction(torch.autograd.Function):
    """Gradient (as Horovod since 0.22): the incoming gradient averaged over
    ranks, then this rank's rows."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: Optional[str]) -> torch.Tensor:
        ctx.input_shape = tensor.shape
        return _run(cring.allgather, tensor, name=name)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple:
        grad = _run(cring.allreduce, _contiguous(grad_output), op=Average)
        rows = 1 if len(ctx.input_shape) == 0 else int(ctx.input_shape[0])
        (offset,) = _row_offsets([rows])
        return grad.narrow(0, offset, rows).reshape(ctx.input_shape), None


class _GroupedAllgatherFunction(torch.autograd.Function):
    """Gradient: as for allgather, for every tensor of the group."""

    @staticmethod
    def forward(ctx: Any, name: Optional[str], *tensors: torch.Tensor) -> tuple:
        ctx.input_shapes = [t.shape for t in tensors]
        return tuple(_run(cring.grouped_allgather, list(tensors), name=name))

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple:
        grads = _run(cring.grouped_allreduce, [_contiguous(g) for g in grad_outputs], op=Average)
        rows = [1 if len(s) == 0 else int(s[0]) for s in ctx.input_shapes]
        offsets = _row_offsets(rows)
        return (None, *(g.narrow(0, o, n).reshape(s)
                        for g, o, n, s in zip(grads, offsets, rows, ctx.input_shapes)))


class _BroadcastFunction(torch.autograd.Function):
    """Gradient (as Horovod since 0.22): the incoming gradient averaged over
    ranks on the root, zero elsewhere."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, root_rank: int,
                name: Optional[str]) -> torch.Tensor:
        ctx.root_rank = root_rank
        return _run(cring.broadcast, tensor, root_rank, name=name)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple:
        grad = _run(cring.allreduce, _contiguous(grad_output), op=Average)
        if rank() != ctx.root_rank:
            grad.zero_()
        return grad, None, None


def _reducescatter_grad_scale(op: Any, prescale: float, postscale: float) -> float:
    # Horovod's reducescatter gradient: allgather of the incoming gradient,
    # times size() for Sum (times 1 for Average), times the scale factors.
    return (size() if op == Sum else 1) * prescale * postscale


class _ReducescatterFunction(torch.autograd.Function):
    """Gradient (Horovod's): the incoming gradient allgathered, times size()
    for Sum, times the scale factors."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, name: Optional[str], op: Any, prescale: float,
                postscale: float) -> torch.Tensor:
        ctx.scale = _reducescatter_grad_scale(op, prescale, postscale)
        return _run(cring.reducescatter, tensor, op=op, name=name, prescale_factor=prescale,
                    postscale_factor=postscale)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple:
        grad = _contiguous(grad_output)
        if ctx.scale != 1:
            grad = grad * ctx.scale
        return _run(cring.allgather, grad), None, None, None, None


class _GroupedReducescatterFunction(torch.autograd.Function):
    """Gradient: as for reducescatter, for every tensor of the group."""

    @staticmethod
    def forward(ctx: Any, name: Optional[str], op: Any, prescale: float, postscale: float,
                *tensors: torch.Tensor) -> tuple:
        ctx.scale = _reducescatter_grad_scale(op, prescale, postscale)
        return tuple(_run(cring.grouped_reducescatter, list(tensors), op=op, name=name,
                          prescale_factor=prescale, postscale_factor=postscale))

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple:
        grads = [_contiguous(g) if ctx.scale == 1 else g * ctx.scale for g in grad_outputs]
        return (None, None, None, None, *_run(cring.grouped_allgather, grads))


# ---- allreduce -----------------------------------------------------------------------------------


def _allreduce(tensor: torch.Tensor, name: Optional[str], op: Any, prescale: float,
               postscale: float, wire: Any) -> torch.Tensor:
    if _wants_grad((tensor,)):
        return _AllreduceFunction.apply(tensor, name, op, prescale, postscale, wire)
    return _run(cring.allreduce, tensor, op=op, name=name, compression=wire,
                prescale_factor=prescale, postscale_factor=postscale)


def allreduce(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
              compression: Any = Compression.none, op: Any = None, prescale_factor: float = 1.0,
              postscale_factor: float = 1.0,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Return a new tensor: `tensor` reduced over all ranks with `op`
    (Average by default; Sum, Min, Max, Product), after multiplying by
    prescale_factor and before multiplying by postscale_factor. The input is
    unchanged. Differentiable: the gradient is the allreduce of the incoming
    gradient with the same op and factors. `average=` is deprecated (True is
    Average, False is Sum); giving both `average` and `op` is a ValueError."""
    op = _check_op(_resolve_op(op, average))
    _check_process_set(process_set)
    python_compressor, wire = _plan_compression(compression, (tensor,))
    if python_compressor is None:
        return _allreduce(tensor, name, op, prescale_factor, postscale_factor, wire)
    compressed, ctx = python_compressor.compress(tensor)
    reduced = _allreduce(compressed, name, op, prescale_factor, postscale_factor, None)
    return python_compressor.decompress(reduced, ctx)


def allreduce_async(tensor: torch.Tensor, average: Optional[bool] = None,
                    name: Optional[str] = None, op: Any = None, prescale_factor: float = 1.0,
                    postscale_factor: float = 1.0,
                    process_set: ProcessSet = global_process_set) -> cring.Handle:
    """Start an allreduce into a new tensor; synchronize(handle) returns it.
    Not differentiable (as in Horovod)."""
    op = _check_op(_resolve_op(op, average))
    _check_process_set(process_set)
    return _run(cring.allreduce_async, tensor, op=op, name=name,
                prescale_factor=prescale_factor, postscale_factor=postscale_factor)


def allreduce_(tensor: torch.Tensor, average: Optional[bool] = None, name: Optional[str] = None,
               op: Any = None, prescale_factor: float = 1.0, postscale_factor: float = 1.0,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Reduce `tensor` over all ranks in place and return it (same storage).
    Not differentiable (as in Horovod)."""
    op = _check_op(_resolve_op(op, average))
    _check_process_set(process_set)
    return _run(cring.allreduce_, tensor, op=op, name=name, prescale_factor=prescale_factor,
                postscale_factor=postscale_factor)


def allreduce_async_(tensor: torch.Tensor, average: Optional[bool] = None,
                     name: Optional[str] = None, op: Any = None, prescale_factor: float = 1.0,
                     postscale_factor: float = 1.0,
                     process_set: ProcessSet = global_process_set) -> cring.Handle:
    """Start an in-place allreduce; synchronize(handle) returns `tensor`."""
    op = _check_op(_resolve_op(op, average))
    _check_process_set(process_set)
    return _run(cring.allreduce_async_, tensor, op=op, name=name,
                prescale_factor=prescale_factor, postscale_factor=postscale_factor)


def grouped_allreduce(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                      name: Optional[str] = None, compression: Any = Compression.none,
                      op: Any = None, prescale_factor: float = 1.0,
                      postscale_factor: float = 1.0,
                      process_set: ProcessSet = global_process_set) -> list:
    """Allreduce a list of tensors as one unit (negotiated and run together);
    returns a list of new tensors. Differentiable, like allreduce."""
    op = _check_op(_resolve_op(op, average))
    _check_process_set(process_set)
    tensors = list(tensors)
    python_compressor, wire = _plan_compression(compression, tensors)
    ctxs = None
    if python_compressor is not None:
        tensors, ctxs = _compress_all(python_compressor, tensors)
    if _wants_grad(tensors):
        reduced = list(_GroupedAllreduceFunction.apply(name, op, prescale_factor,
                                                       postscale_factor, wire, *tensors))
    else:
        reduced = _run(cring.grouped_allreduce, tensors, op=op, name=name, compression=wire,
                       prescale_factor=prescale_factor, postscale_factor=postscale_factor)
    if python_compressor is None:
        return reduced
    return [python_compressor.decompress(t, c) for t, c in zip(reduced, ctxs)]


def grouped_allreduce_async(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                            name: Optional[str] = None, op: Any = None,
                            prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                            process_set: ProcessSet = global_process_set) -> cring.Handle:
    """Start a grouped allreduce into new tensors; synchronize() returns the list."""
    op = _check_op(_resolve_op(op, average))
    _check_process_set(process_set)
    return _run(cring.grouped_allreduce_async, list(tensors), op=op, name=name,
                prescale_factor=prescale_factor, postscale_factor=postscale_factor)


def grouped_allreduce_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                       name: Optional[str] = None, op: Any = None, prescale_factor: float = 1.0,
                       postscale_factor: float = 1.0,
                       process_set: ProcessSet = global_process_set) -> list:
    """Allreduce a list of tensors as one unit, in place; returns the list."""
    op = _check_op(_resolve_op(op, average))
    _check_process_set(process_set)
    return _run(cring.grouped_allreduce_, list(tensors), op=op, name=name,
                prescale_factor=prescale_factor, postscale_factor=postscale_factor)


def grouped_allreduce_async_(tensors: Sequence[torch.Tensor], average: Optional[bool] = None,
                             name: Optional[str] = None, op: Any = None,
                             prescale_factor: float = 1.0, postscale_factor: float = 1.0,
                             process_set: ProcessSet = global_process_set) -> cring.Handle:
    """Start an in-place grouped allreduce; synchronize() returns the list."""
    op = _check_op(_resolve_op(op, average))
    _check_process_set(process_set)
    return _run(cring.grouped_allreduce_async_, list(tensors), op=op, name=name,
                prescale_factor=prescale_factor, postscale_factor=postscale_factor)


# ---- allgather -----------------------------------------------------------------------------------


def allgather(tensor: torch.Tensor, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Concatenate every rank's `tensor` along the first dimension, in rank
    order (first dimensions may differ; the rest and the dtype must match).
    Differentiable: the gradient is the incoming gradient averaged over ranks,
    then this rank's rows (Horovod's)."""
    _check_process_set(process_set)
    if _wants_grad((tensor,)):
        return _AllgatherFunction.apply(tensor, name)
    return _run(cring.allgather, tensor, name=name)


def allgather_async(tensor: torch.Tensor, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> cring.Handle:
    """Start an allgather; synchronize(handle) returns the concatenation."""
    _check_process_set(process_set)
    return _run(cring.allgather_async, tensor, name=name)


def grouped_allgather(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                      process_set: ProcessSet = global_process_set) -> list:
    """Allgather a list of tensors as one unit; returns a list. Differentiable."""
    _check_process_set(process_set)
    tensors = list(tensors)
    if _wants_grad(tensors):
        return list(_GroupedAllgatherFunction.apply(name, *tensors))
    return _run(cring.grouped_allgather, tensors, name=name)


def grouped_allgather_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                            process_set: ProcessSet = global_process_set) -> cring.Handle:
    """Start a grouped allgather; synchronize() returns the list."""
    _check_process_set(process_set)
    return _run(cring.grouped_allgather_async, list(tensors), name=name)


# ---- broadcast -----------------------------------------------------------------------------------


def broadcast(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
              process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Return a new tensor holding root_rank's `tensor`; the input is
    unchanged. Differentiable: the root's gradient is the incoming gradient
    averaged over ranks; the other ranks' gradient is zero (Horovod's)."""
    _check_process_set(process_set)
    if _wants_grad((tensor,)):
        return _BroadcastFunction.apply(tensor, root_rank, name)
    return _run(cring.broadcast, tensor, root_rank, name=name)


def broadcast_async(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                    process_set: ProcessSet = global_process_set) -> cring.Handle:
    """Start a broadcast into a new tensor."""
    _check_process_set(process_set)
    return _run(cring.broadcast_async, tensor, root_rank, name=name)


def broadcast_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
               process_set: ProcessSet = global_process_set) -> torch.Tensor:
    """Overwrite `tensor` with root_rank's values in place and return it."""
    _check_process_set(process_set)
    return _run(cring.broadcast_, tensor, root_rank, name=name)


def broadcast_async_(tensor: torch.Tensor, root_rank: int, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> cring.Handle:
    """Start an in-place broadcast; synchronize(handle) returns `tensor`."""
    _check_process_set(process_set)
    return _run(cring.broadcast_async_, tensor, root_rank, name=name)


# ---- reducescatter -------------------------------------------------------------------------------


def reducescatter(tensor: torch.Tensor, name: Optional[str] = None,
                  compression: Any = Compression.none, op: Any = Average,
                  process_set: ProcessSet = global_process_set, prescale_factor: float = 1.0,
                  postscale_factor: float = 1.0) -> torch.Tensor:
    """Reduce `tensor` over all ranks and return this rank's rows: with n
    rows and P ranks, rank r gets n // P rows, plus one if r < n % P.
    Differentiable, with Horovod's gradient (see _ReducescatterFunction)."""
    op = _check_op(op)
    _check_process_set(process_set)
    python_compressor = _python_compressor(compression)
    ctx = None
    if python_compressor is not None:  # cring has no wire compression for reducescatter
        tensor, ctx = python_compressor.compress(tensor)
    if _wants_grad((tensor,)):
        out = _ReducescatterFunction.apply(tensor, name, op, prescale_factor, postscale_factor)
    else:
        out = _run(cring.reducescatter, tensor, op=op, name=name,
                   prescale_factor=prescale_factor, postscale_factor=postscale_factor)
    return out if python_compressor is None else python_compressor.decompress(out, ctx)


def reducescatter_async(tensor: torch.Tensor, name: Optional[str] = None, op: Any = Average,
                        process_set: ProcessSet = global_process_set,
                        prescale_factor: float = 1.0,
                        postscale_factor: float = 1.0) -> cring.Handle:
    """Start a reducescatter; synchronize(handle) returns this rank's rows."""
    op = _check_op(op)
    _check_process_set(process_set)
    return _run(cring.reducescatter_async, tensor, op=op, name=name,
                prescale_factor=prescale_factor, postscale_factor=postscale_factor)


def grouped_reducescatter(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                          compression: Any = Compression.none, op: Any = Average,
                          process_set: ProcessSet = global_process_set,
                          prescale_factor: float = 1.0, postscale_factor: float = 1.0) -> list:
    """Reducescatter a list of tensors as one unit; returns a list. Differentiable."""
    op = _check_op(op)
    _check_process_set(process_set)
    tensors = list(tensors)
    python_compressor = _python_compressor(compression)
    ctxs = None
    if python_compressor is not None:
        tensors, ctxs = _compress_all(python_compressor, tensors)
    if _wants_grad(tensors):
        outs = list(_GroupedReducescatterFunction.apply(name, op, prescale_factor,
                                                        postscale_factor, *tensors))
    else:
        outs = _run(cring.grouped_reducescatter, tensors, op=op, name=name,
                    prescale_factor=prescale_factor, postscale_factor=postscale_factor)
    if python_compressor is None:
        return outs
    return [python_compressor.decompress(t, c) for t, c in zip(outs, ctxs)]


def grouped_reducescatter_async(tensors: Sequence[torch.Tensor], name: Optional[str] = None,
                                op: Any = Average, process_set: ProcessSet = global_process_set,
                                prescale_factor: float = 1.0,
                                postscale_factor: float = 1.0) -> cring.Handle:
    """Start a grouped reducescatter; synchronize() returns the list."""
    op = _check_op(op)
    _check_process_set(process_set)
    return _run(cring.grouped_reducescatter_async, list(tensors), op=op, name=name,
                prescale_factor=prescale_factor, postscale_factor=postscale_factor)


# ---- not in cring's core yet ---------------------------------------------------------------------


def _splits_list(splits: Any) -> Optional[list]:
    if splits is None:
        return None
    if isinstance(splits, torch.Tensor):
        if splits.dim() != 1 or splits.dtype.is_floating_point:
            raise ValueError(f"splits must be a 1-d integer tensor, got {splits.dtype} "
                             f"with shape {tuple(splits.shape)}")
        return [int(v) for v in splits.tolist()]
    return [int(v) for v in splits]


def _alltoall_result(result: tuple) -> tuple:
    output, received = result
    return output, torch.tensor(received, dtype=torch.int32)


class _AlltoallFunction(torch.autograd.Function):
    """Gradient (Horovod's): the incoming gradient sent back where its rows
    came from, an alltoall with the received splits."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor, splits: Optional[list],
                name: Optional[str]) -> tuple:
        output, received = _alltoall_result(_run(cring.alltoall, tensor, splits=splits, name=name))
        ctx.received = received.tolist()
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor, grad_splits: Any) -> tuple:
        grad, _ = _run(cring.alltoall, _contiguous(grad_output), splits=ctx.received)
        return grad, None, None


def alltoall(tensor: torch.Tensor, splits: Any = None, name: Optional[str] = None,
             process_set: ProcessSet = global_process_set) -> Any:
    """Send `splits[j]` rows of `tensor` (along the first dimension, in
    order) to rank j and receive every rank's rows for this one, in rank
    order. Without splits the first dimension is divided evenly by size()
    (it must divide). Returns the output tensor, and with `splits` also an
    int32 tensor of how many rows came from each rank (Horovod's).
    Differentiable: the gradient goes back the way the rows came."""
    _check_process_set(process_set)
    split_list = _splits_list(splits)
    if _wants_grad((tensor,)):
        output, received = _AlltoallFunction.apply(tensor, split_list, name)
    else:
        output, received = _alltoall_result(_run(cring.alltoall, tensor, splits=split_list,
                                                 name=name))
    return output if splits is None else (output, received)


def alltoall_async(tensor: torch.Tensor, splits: Any = None, name: Optional[str] = None,
                   process_set: ProcessSet = global_process_set) -> cring.Handle:
    """Start an alltoall; synchronize(handle) returns (output, received_splits),
    the latter an int32 tensor."""
    _check_process_set(process_set)
    handle = _run(cring.alltoall_async, tensor, splits=_splits_list(splits), name=name)
    finish = handle._finish
    handle._finish = lambda h: _alltoall_result(finish(h))
    return handle


def join(device: int = -1) -> int:
    """This rank has run out of data (Horovod's join): until every rank has
    joined, the other ranks' allreduces (Sum, Average; DistributedOptimizer's
    gradients) complete with zeros for this rank's part. Returns the rank
    that joined last, the same on every rank. `device` is accepted for
    Horovod compatibility (CPU only)."""
    return _run(cring.join)


# ---- the rest ------------------------------------------------------------------------------------


def barrier(process_set: ProcessSet = global_process_set) -> None:
    """Return once every rank has called barrier()."""
    _check_process_set(process_set)
    _run(cring.barrier)


def poll(handle: cring.Handle) -> bool:
    """True once the asynchronous collective has completed; never blocks."""
    return cring.poll(handle)


def synchronize(handle: cring.Handle) -> Any:
    """Wait for an asynchronous collective and return its result (a tensor,
    or a list for grouped ones); raise its error."""
    return _run(cring.synchronize, handle)


def _pickler() -> Any:
    try:
        import cloudpickle
        return cloudpickle
    except ImportError:
        return pickle


def broadcast_object(obj: Any, root_rank: int = 0, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> Any:
    """Return root_rank's `obj` on every rank: pickled (with cloudpickle when
    installed), its size broadcast, then its bytes. Unnamed calls get
    deterministic names, so every rank must make them in the same order (any
    `obj` is fine on the other ranks, e.g. None)."""
    _check_process_set(process_set)
    base = _core._name("broadcast_object", name)
    is_root = rank() == int(root_rank)
    if is_root:
        buffer = io.BytesIO()
        _pickler().dump(obj, buffer)
        payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
        length = torch.tensor([payload.numel()], dtype=torch.int64)
    else:
        length = torch.zeros(1, dtype=torch.int64)
    _run(cring.broadcast_, length, root_rank, name=f"{base}.sz")
    if not is_root:
        payload = torch.empty(int(length[0]), dtype=torch.uint8)
    _run(cring.broadcast_, payload, root_rank, name=f"{base}.t")
    if is_root:
        return obj
    return _pickler().load(io.BytesIO(payload.numpy().tobytes()))


def allgather_object(obj: Any, name: Optional[str] = None,
                     process_set: ProcessSet = global_process_set) -> list:
    """Return the list of every rank's `obj`, in rank order (pickled with
    cloudpickle when installed; sizes and bytes gathered together)."""
    _check_process_set(process_set)
    base = _core._name("allgather_object", name)
    buffer = io.BytesIO()
    _pickler().dump(obj, buffer)
    payload = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    sizes_handle = _run(cring.allgather_async, torch.tensor([payload.numel()], dtype=torch.int64),
                        name=f"{base}.sz")
    bytes_handle = _run(cring.allgather_async, payload, name=f"{base}.t")
    sizes = [int(n) for n in _run(cring.synchronize, sizes_handle)]
    gathered = _run(cring.synchronize, bytes_handle).numpy()
    objects, start = [], 0
    for n in sizes:
        objects.append(_pickler().load(io.BytesIO(gathered[start:start + n].tobytes())))
        start += n
    return objects

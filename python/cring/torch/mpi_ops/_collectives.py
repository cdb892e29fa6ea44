"""cring.torch's collectives, as horovod.torch names them: allreduce,
allgather, broadcast, reducescatter, alltoall (plain, async, in-place,
grouped), join, barrier and poll/synchronize (the object collectives are
in _objects). Each
translates Horovod's arguments (`average=`, `process_set=`, compressors),
picks the autograd Function when a gradient is wanted and calls cring's
engine through _run; nothing here communicates on its own.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Sequence
from typing import Any, Optional

import torch

import cring
from cring import _C

from . import _compiled
from ._autograd import (
    _AllgatherFunction,
    _AllreduceFunction,
    _alltoall_result,
    _AlltoallFunction,
    _BroadcastFunction,
    _GroupedAllgatherFunction,
    _GroupedAllreduceFunction,
    _GroupedReducescatterFunction,
    _ReducescatterFunction,
)
from ._basics import (
    Average,
    ProcessSet,
    Sum,
    _internal_error,
    _run,
    global_process_set,
)
from ._compression import Compression, _compress_all, _plan_compression, _python_compressor

# ---- arguments -----------------------------------------------------------------------------------


def _resolve_op(op: Any, average: Optional[bool]) -> Any:
    """Horovod's handling of the deprecated `average=` next to `op=`."""
    if op is not None:
        if average is not None:
            raise ValueError(
                "The op parameter supersedes average. Please provide only one of them."
            )
        return op
    if average is None:
        return Average
    warnings.warn(
        "Parameter `average` has been replaced with `op` and will be removed; use "
        "op=Average or op=Sum",
        DeprecationWarning,
        stacklevel=3,
    )
    return Average if average else Sum


def _check_op(op: Any) -> Any:
    # cring checks the op itself (unknown ops, Adasum) where it submits
    return Average if op is None else op


def _wants_grad(tensors: Sequence[torch.Tensor]) -> bool:
    return torch.is_grad_enabled() and any(getattr(t, "requires_grad", False) for t in tensors)


# ---- allreduce -----------------------------------------------------------------------------------


def _allreduce(
    tensor: torch.Tensor,
    name: Optional[str],
    op: Any,
    prescale: float,
    postscale: float,
    wire: Any,
    process_set: Any,
) -> torch.Tensor:
    if _wants_grad((tensor,)):
        return _AllreduceFunction.apply(tensor, name, op, prescale, postscale, wire, process_set)
    return _run(
        cring.allreduce,
        tensor,
        op=op,
        name=name,
        compression=wire,
        prescale_factor=prescale,
        postscale_factor=postscale,
        process_set=process_set,
    )


def allreduce(
    tensor: torch.Tensor,
    average: Optional[bool] = None,
    name: Optional[str] = None,
    compression: Any = Compression.none,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Return a new tensor: `tensor` reduced over all ranks with `op`
    (Average by default; Sum, Min, Max, Product), after multiplying by
    prescale_factor and before multiplying by postscale_factor. The input is
    unchanged. Differentiable: the gradient is the allreduce of the incoming
    gradient with the same op and factors. `average=` is deprecated (True is
    Average, False is Sum); giving both `average` and `op` is a ValueError."""
    op = _check_op(_resolve_op(op, average))
    python_compressor, wire = _plan_compression(compression, (tensor,))
    if torch.compiler.is_compiling():  # an operator in the graph (_compiled.py)
        return _compiled.allreduce(
            tensor,
            name,
            op,
            prescale_factor,
            postscale_factor,
            python_compressor,
            wire,
            process_set,
        )
    if python_compressor is None:
        return _allreduce(tensor, name, op, prescale_factor, postscale_factor, wire, process_set)
    compressed, ctx = python_compressor.compress(tensor)
    reduced = _allreduce(compressed, name, op, prescale_factor, postscale_factor, None, process_set)
    return python_compressor.decompress(reduced, ctx)


def _allreduce_async(
    tensor: torch.Tensor,
    average: Optional[bool] = None,
    name: Optional[str] = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> cring.Handle:
    """Start an allreduce into a new tensor; synchronize(handle) returns it.
    Not differentiable (as in Horovod)."""
    op = _check_op(_resolve_op(op, average))
    return _run(
        cring.allreduce_async,
        tensor,
        op=op,
        name=name,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        process_set=process_set,
    )


def _allreduce_inplace(
    tensor: torch.Tensor,
    average: Optional[bool] = None,
    name: Optional[str] = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Reduce `tensor` over all ranks in place and return it (same storage).
    Not differentiable (as in Horovod)."""
    op = _check_op(_resolve_op(op, average))
    return _run(
        cring.allreduce_,
        tensor,
        op=op,
        name=name,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        process_set=process_set,
    )


def _allreduce_async_inplace(
    tensor: torch.Tensor,
    average: Optional[bool] = None,
    name: Optional[str] = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> cring.Handle:
    """Start an in-place allreduce; synchronize(handle) returns `tensor`."""
    op = _check_op(_resolve_op(op, average))
    return _run(
        cring.allreduce_async_,
        tensor,
        op=op,
        name=name,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        process_set=process_set,
    )


def _from_c(c_function: Any, python_function: Any, name: str) -> Any:
    """c_function (cring._C) as this module's `name`: the Python one's
    docstring and signature (through __wrapped__), called without a Python frame."""
    wrapper = functools.partial(c_function)
    functools.update_wrapper(wrapper, python_function)
    wrapper.__name__ = wrapper.__qualname__ = name
    return wrapper


# allreduce_, allreduce_async_ and allreduce_async resolve Horovod's arguments in C and go on
# to cring.allreduce_ / allreduce_async_ there, so a named torch CUDA tensor
# reaches the engine's queue without a Python frame; what C does not resolve
# (average=, another process set) comes back to the functions above.
_C.torch_allreduce_fallback = _allreduce_inplace
_C.torch_allreduce_async_fallback = _allreduce_async_inplace
_C.torch_allreduce_async_out_fallback = _allreduce_async
_C.torch_error_hook = _internal_error
_C.torch_global_process_set = global_process_set
allreduce_ = _from_c(_C.torch_allreduce_, _allreduce_inplace, "allreduce_")
allreduce_async_ = _from_c(_C.torch_allreduce_async_, _allreduce_async_inplace, "allreduce_async_")
# allreduce_async (out of place) likewise goes on to cring.allreduce_async in C,
# which makes the output of a CPU tensor there (a CUDA tensor comes back to
# _allreduce_async through cring's Python route).
allreduce_async = _from_c(_C.torch_allreduce_async, _allreduce_async, "allreduce_async")


def grouped_allreduce(
    tensors: Sequence[torch.Tensor],
    average: Optional[bool] = None,
    name: Optional[str] = None,
    compression: Any = Compression.none,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list:
    """Allreduce a list of tensors as one unit (negotiated and run together);
    returns a list of new tensors. Differentiable, like allreduce."""
    op = _check_op(_resolve_op(op, average))
    tensors = list(tensors)
    python_compressor, wire = _plan_compression(compression, tensors)
    ctxs = None
    if python_compressor is not None:
        tensors, ctxs = _compress_all(python_compressor, tensors)
    if _wants_grad(tensors):
        reduced = list(
            _GroupedAllreduceFunction.apply(
                name, op, prescale_factor, postscale_factor, wire, process_set, *tensors
            )
        )
    else:
        reduced = _run(
            cring.grouped_allreduce,
            tensors,
            op=op,
            name=name,
            compression=wire,
            prescale_factor=prescale_factor,
            postscale_factor=postscale_factor,
            process_set=process_set,
        )
    if python_compressor is None:
        return reduced
    return [python_compressor.decompress(t, c) for t, c in zip(reduced, ctxs)]


def grouped_allreduce_async(
    tensors: Sequence[torch.Tensor],
    average: Optional[bool] = None,
    name: Optional[str] = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> cring.Handle:
    """Start a grouped allreduce into new tensors; synchronize() returns the list."""
    op = _check_op(_resolve_op(op, average))
    return _run(
        cring.grouped_allreduce_async,
        list(tensors),
        op=op,
        name=name,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        process_set=process_set,
    )


def grouped_allreduce_(
    tensors: Sequence[torch.Tensor],
    average: Optional[bool] = None,
    name: Optional[str] = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> list:
    """Allreduce a list of tensors as one unit, in place; returns the list."""
    op = _check_op(_resolve_op(op, average))
    return _run(
        cring.grouped_allreduce_,
        list(tensors),
        op=op,
        name=name,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        process_set=process_set,
    )


def grouped_allreduce_async_(
    tensors: Sequence[torch.Tensor],
    average: Optional[bool] = None,
    name: Optional[str] = None,
    op: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: ProcessSet = global_process_set,
) -> cring.Handle:
    """Start an in-place grouped allreduce; synchronize() returns the list."""
    op = _check_op(_resolve_op(op, average))
    return _run(
        cring.grouped_allreduce_async_,
        list(tensors),
        op=op,
        name=name,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        process_set=process_set,
    )


# ---- allgather -----------------------------------------------------------------------------------


def allgather(
    tensor: torch.Tensor, name: Optional[str] = None, process_set: ProcessSet = global_process_set
) -> torch.Tensor:
    """Concatenate every rank's `tensor` along the first dimension, in rank
    order (first dimensions may differ; the rest and the dtype must match).
    Differentiable: the gradient is the incoming gradient averaged over ranks,
    then this rank's rows (Horovod's). Inside torch.compile every rank must
    give the same first dimension (an operator's shape is known when traced)."""
    if torch.compiler.is_compiling():  # an operator in the graph (_compiled.py)
        return _compiled.allgather(tensor, name, process_set)
    if _wants_grad((tensor,)):
        return _AllgatherFunction.apply(tensor, name, process_set)
    if process_set is global_process_set:  # cring.allgather's C fast paths take this form
        return _run(cring.allgather, tensor, name=name)
    return _run(cring.allgather, tensor, name=name, process_set=process_set)


def allgather_async(
    tensor: torch.Tensor, name: Optional[str] = None, process_set: ProcessSet = global_process_set
) -> cring.Handle:
    """Start an allgather; synchronize(handle) returns the concatenation."""
    return _run(cring.allgather_async, tensor, name=name, process_set=process_set)


def grouped_allgather(
    tensors: Sequence[torch.Tensor],
    name: Optional[str] = None,
    process_set: ProcessSet = global_process_set,
) -> list:
    """Allgather a list of tensors as one unit; returns a list. Differentiable."""
    tensors = list(tensors)
    if _wants_grad(tensors):
        return list(_GroupedAllgatherFunction.apply(name, process_set, *tensors))
    return _run(cring.grouped_allgather, tensors, name=name, process_set=process_set)


def grouped_allgather_async(
    tensors: Sequence[torch.Tensor],
    name: Optional[str] = None,
    process_set: ProcessSet = global_process_set,
) -> cring.Handle:
    """Start a grouped allgather; synchronize() returns the list."""
    return _run(cring.grouped_allgather_async, list(tensors), name=name, process_set=process_set)


# ---- broadcast -----------------------------------------------------------------------------------


def broadcast(
    tensor: torch.Tensor,
    root_rank: int,
    name: Optional[str] = None,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Return a new tensor holding root_rank's `tensor`; the input is
    unchanged. Differentiable: the root's gradient is the incoming gradient
    averaged over ranks; the other ranks' gradient is zero (Horovod's)."""
    if torch.compiler.is_compiling():  # an operator in the graph (_compiled.py)
        return _compiled.broadcast(tensor, root_rank, name, process_set)
    if _wants_grad((tensor,)):
        return _BroadcastFunction.apply(tensor, root_rank, name, process_set)
    return _run(cring.broadcast, tensor, root_rank, name=name, process_set=process_set)


def broadcast_async(
    tensor: torch.Tensor,
    root_rank: int,
    name: Optional[str] = None,
    process_set: ProcessSet = global_process_set,
) -> cring.Handle:
    """Start a broadcast into a new tensor."""
    return _run(cring.broadcast_async, tensor, root_rank, name=name, process_set=process_set)


def broadcast_(
    tensor: torch.Tensor,
    root_rank: int,
    name: Optional[str] = None,
    process_set: ProcessSet = global_process_set,
) -> torch.Tensor:
    """Overwrite `tensor` with root_rank's values in place and return it."""
    return _run(cring.broadcast_, tensor, root_rank, name=name, process_set=process_set)


def broadcast_async_(
    tensor: torch.Tensor,
    root_rank: int,
    name: Optional[str] = None,
    process_set: ProcessSet = global_process_set,
) -> cring.Handle:
    """Start an in-place broadcast; synchronize(handle) returns `tensor`."""
    return _run(cring.broadcast_async_, tensor, root_rank, name=name, process_set=process_set)


# ---- reducescatter -------------------------------------------------------------------------------


def reducescatter(
    tensor: torch.Tensor,
    name: Optional[str] = None,
    compression: Any = Compression.none,
    op: Any = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> torch.Tensor:
    """Reduce `tensor` over all ranks and return this rank's rows: with n
    rows and P ranks, rank r gets n // P rows, plus one if r < n % P.
    Differentiable, with Horovod's gradient (see _ReducescatterFunction)."""
    op = _check_op(op)
    python_compressor = _python_compressor(compression)
    ctx = None
    if python_compressor is not None:  # cring has no wire compression for reducescatter
        tensor, ctx = python_compressor.compress(tensor)
    if _wants_grad((tensor,)):
        out = _ReducescatterFunction.apply(
            tensor, name, op, prescale_factor, postscale_factor, process_set
        )
    else:
        out = _run(
            cring.reducescatter,
            tensor,
            op=op,
            name=name,
            prescale_factor=prescale_factor,
            postscale_factor=postscale_factor,
            process_set=process_set,
        )
    return out if python_compressor is None else python_compressor.decompress(out, ctx)


def reducescatter_async(
    tensor: torch.Tensor,
    name: Optional[str] = None,
    op: Any = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> cring.Handle:
    """Start a reducescatter; synchronize(handle) returns this rank's rows."""
    op = _check_op(op)
    return _run(
        cring.reducescatter_async,
        tensor,
        op=op,
        name=name,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        process_set=process_set,
    )


def grouped_reducescatter(
    tensors: Sequence[torch.Tensor],
    name: Optional[str] = None,
    compression: Any = Compression.none,
    op: Any = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> list:
    """Reducescatter a list of tensors as one unit; returns a list. Differentiable."""
    op = _check_op(op)
    tensors = list(tensors)
    python_compressor = _python_compressor(compression)
    ctxs = None
    if python_compressor is not None:
        tensors, ctxs = _compress_all(python_compressor, tensors)
    if _wants_grad(tensors):
        outs = list(
            _GroupedReducescatterFunction.apply(
                name, op, prescale_factor, postscale_factor, process_set, *tensors
            )
        )
    else:
        outs = _run(
            cring.grouped_reducescatter,
            tensors,
            op=op,
            name=name,
            prescale_factor=prescale_factor,
            postscale_factor=postscale_factor,
            process_set=process_set,
        )
    if python_compressor is None:
        return outs
    return [python_compressor.decompress(t, c) for t, c in zip(outs, ctxs)]


def grouped_reducescatter_async(
    tensors: Sequence[torch.Tensor],
    name: Optional[str] = None,
    op: Any = Average,
    process_set: ProcessSet = global_process_set,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
) -> cring.Handle:
    """Start a grouped reducescatter; synchronize() returns the list."""
    op = _check_op(op)
    return _run(
        cring.grouped_reducescatter_async,
        list(tensors),
        op=op,
        name=name,
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        process_set=process_set,
    )


# ---- alltoall and join ---------------------------------------------------------------------------


def _splits_list(splits: Any) -> Optional[list]:
    if splits is None:
        return None
    if isinstance(splits, torch.Tensor):
        if splits.dim() != 1 or splits.dtype.is_floating_point:
            raise ValueError(
                f"splits must be a 1-d integer tensor, got {splits.dtype} "
                f"with shape {tuple(splits.shape)}"
            )
        return [int(v) for v in splits.tolist()]
    return [int(v) for v in splits]


def alltoall(
    tensor: torch.Tensor,
    splits: Any = None,
    name: Optional[str] = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Send `splits[j]` rows of `tensor` (along the first dimension, in
    order) to rank j and receive every rank's rows for this one, in rank
    order. Without splits the first dimension is divided evenly by size()
    (it must divide). Returns the output tensor, and with `splits` also an
    int32 tensor of how many rows came from each rank (Horovod's), on the
    device of `splits` when that is a tensor, else on the CPU.
    Differentiable: the gradient goes back the way the rows came."""
    split_list = _splits_list(splits)
    device = splits.device if isinstance(splits, torch.Tensor) else None
    if _wants_grad((tensor,)):
        output, received = _AlltoallFunction.apply(tensor, split_list, name, process_set, device)
    else:
        output, received = _alltoall_result(
            _run(cring.alltoall, tensor, splits=split_list, name=name, process_set=process_set),
            device,
        )
    return output if splits is None else (output, received)


def alltoall_async(
    tensor: torch.Tensor,
    splits: Any = None,
    name: Optional[str] = None,
    process_set: ProcessSet = global_process_set,
) -> cring.Handle:
    """Start an alltoall; synchronize(handle) returns (output, received_splits),
    the latter an int32 tensor on the device of `splits` (CPU without one)."""
    device = splits.device if isinstance(splits, torch.Tensor) else None
    handle = _run(
        cring.alltoall_async,
        tensor,
        splits=_splits_list(splits),
        name=name,
        process_set=process_set,
    )
    finish = handle._finish
    handle._finish = lambda h: _alltoall_result(finish(h), device)
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
    _run(cring.barrier, process_set=process_set)


def poll(handle: cring.Handle) -> bool:
    """True once the asynchronous collective has completed; never blocks."""
    return cring.poll(handle)


def synchronize(handle: cring.Handle) -> Any:
    """Wait for an asynchronous collective and return its result (a tensor,
    or a list for grouped ones); raise its error."""
    return _run(cring.synchronize, handle)

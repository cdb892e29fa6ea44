"""The autograd Functions of cring.torch's differentiable collectives, with
Horovod's gradients (allreduce, allgather, broadcast, reducescatter,
alltoall; single and grouped). Forward and backward call cring through
_basics._run only; the public functions that choose them are in _collectives.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

import cring
from cring import _core

from ._basics import Average, Sum, _run, rank


def _contiguous(tensor: torch.Tensor) -> torch.Tensor:
    # Incoming gradients are often expanded views (stride 0), which cring refuses.
    return tensor if tensor.is_contiguous() else tensor.contiguous()


class _AllreduceFunction(torch.autograd.Function):
    """Gradient: the incoming gradient, allreduced with the same op and scale factors."""

    @staticmethod
    def forward(
        ctx: Any,
        tensor: torch.Tensor,
        name: Optional[str],
        op: Any,
        prescale: float,
        postscale: float,
        wire: Any,
        ps: Any = None,
    ) -> torch.Tensor:
        ctx.reduction, ctx.ps = (op, prescale, postscale, wire), ps
        return _run(
            cring.allreduce,
            tensor,
            op=op,
            name=name,
            compression=wire,
            prescale_factor=prescale,
            postscale_factor=postscale,
            process_set=ps,
        )

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple:
        op, prescale, postscale, wire = ctx.reduction
        grad = _run(
            cring.allreduce,
            _contiguous(grad_output),
            op=op,
            compression=wire,
            prescale_factor=prescale,
            postscale_factor=postscale,
            process_set=ctx.ps,
        )
        return grad, None, None, None, None, None, None


class _GroupedAllreduceFunction(torch.autograd.Function):
    """Gradient: the incoming gradients, grouped-allreduced with the same op and factors."""

    @staticmethod
    def forward(
        ctx: Any,
        name: Optional[str],
        op: Any,
        prescale: float,
        postscale: float,
        wire: Any,
        ps: Any,
        *tensors: torch.Tensor,
    ) -> tuple:
        ctx.reduction, ctx.ps = (op, prescale, postscale, wire), ps
        return tuple(
            _run(
                cring.grouped_allreduce,
                list(tensors),
                op=op,
                name=name,
                compression=wire,
                prescale_factor=prescale,
                postscale_factor=postscale,
                process_set=ps,
            )
        )

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple:
        op, prescale, postscale, wire = ctx.reduction
        grads = _run(
            cring.grouped_allreduce,
            [_contiguous(g) for g in grad_outputs],
            op=op,
            compression=wire,
            prescale_factor=prescale,
            postscale_factor=postscale,
            process_set=ctx.ps,
        )
        return (None, None, None, None, None, None, *grads)


def _size_rank(ps: Any) -> tuple:
    """(size, rank) within process set `ps` (None or the global set: the job's)."""
    return _core._ps_size_rank(_core._ps_id(ps))


def _row_offsets(rows: list, ps: Any) -> list:
    """Every rank's first dimension for each tensor ([rank][tensor]), by one allgather."""
    n, me = _size_rank(ps)
    counts = torch.tensor(rows, dtype=torch.int64)
    gathered = _run(cring.allgather, counts, process_set=ps).view(n, len(rows))
    before = gathered[:me].sum(dim=0) if me else torch.zeros(len(rows), dtype=torch.int64)
    return [int(v) for v in before]


class _AllgatherFunction(torch.autograd.Function):
    """Gradient (as Horovod since 0.22): the incoming gradient averaged over
    ranks, then this rank's rows."""

    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, name: Optional[str], ps: Any = None
    ) -> torch.Tensor:
        ctx.input_shape, ctx.ps = tensor.shape, ps
        return _run(cring.allgather, tensor, name=name, process_set=ps)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple:
        grad = _run(cring.allreduce, _contiguous(grad_output), op=Average, process_set=ctx.ps)
        rows = 1 if len(ctx.input_shape) == 0 else int(ctx.input_shape[0])
        (offset,) = _row_offsets([rows], ctx.ps)
        return grad.narrow(0, offset, rows).reshape(ctx.input_shape), None, None


class _GroupedAllgatherFunction(torch.autograd.Function):
    """Gradient: as for allgather, for every tensor of the group."""

    @staticmethod
    def forward(ctx: Any, name: Optional[str], ps: Any, *tensors: torch.Tensor) -> tuple:
        ctx.input_shapes, ctx.ps = [t.shape for t in tensors], ps
        return tuple(_run(cring.grouped_allgather, list(tensors), name=name, process_set=ps))

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple:
        grads = _run(
            cring.grouped_allreduce,
            [_contiguous(g) for g in grad_outputs],
            op=Average,
            process_set=ctx.ps,
        )
        rows = [1 if len(s) == 0 else int(s[0]) for s in ctx.input_shapes]
        offsets = _row_offsets(rows, ctx.ps)
        return (
            None,
            None,
            *(
                g.narrow(0, o, n).reshape(s)
                for g, o, n, s in zip(grads, offsets, rows, ctx.input_shapes)
            ),
        )


class _BroadcastFunction(torch.autograd.Function):
    """Gradient (as Horovod since 0.22): the incoming gradient averaged over
    ranks on the root, zero elsewhere."""

    @staticmethod
    def forward(
        ctx: Any, tensor: torch.Tensor, root_rank: int, name: Optional[str], ps: Any = None
    ) -> torch.Tensor:
        ctx.root_rank, ctx.ps = root_rank, ps
        return _run(cring.broadcast, tensor, root_rank, name=name, process_set=ps)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple:
        grad = _run(cring.allreduce, _contiguous(grad_output), op=Average, process_set=ctx.ps)
        if rank() != ctx.root_rank:
            grad.zero_()
        return grad, None, None, None


def _reducescatter_grad_scale(op: Any, prescale: float, postscale: float, ps: Any) -> float:
    # Horovod's reducescatter gradient: allgather of the incoming gradient,
    # times the set's size for Sum (times 1 for Average), times the scale factors.
    return (_size_rank(ps)[0] if op == Sum else 1) * prescale * postscale


class _ReducescatterFunction(torch.autograd.Function):
    """Gradient (Horovod's): the incoming gradient allgathered, times size()
    for Sum, times the scale factors."""

    @staticmethod
    def forward(
        ctx: Any,
        tensor: torch.Tensor,
        name: Optional[str],
        op: Any,
        prescale: float,
        postscale: float,
        ps: Any = None,
    ) -> torch.Tensor:
        ctx.scale, ctx.ps = _reducescatter_grad_scale(op, prescale, postscale, ps), ps
        return _run(
            cring.reducescatter,
            tensor,
            op=op,
            name=name,
            prescale_factor=prescale,
            postscale_factor=postscale,
            process_set=ps,
        )

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple:
        grad = _contiguous(grad_output)
        if ctx.scale != 1:
            grad = grad * ctx.scale
        return _run(cring.allgather, grad, process_set=ctx.ps), None, None, None, None, None


class _GroupedReducescatterFunction(torch.autograd.Function):
    """Gradient: as for reducescatter, for every tensor of the group."""

    @staticmethod
    def forward(
        ctx: Any,
        name: Optional[str],
        op: Any,
        prescale: float,
        postscale: float,
        ps: Any,
        *tensors: torch.Tensor,
    ) -> tuple:
        ctx.scale, ctx.ps = _reducescatter_grad_scale(op, prescale, postscale, ps), ps
        return tuple(
            _run(
                cring.grouped_reducescatter,
                list(tensors),
                op=op,
                name=name,
                prescale_factor=prescale,
                postscale_factor=postscale,
                process_set=ps,
            )
        )

    @staticmethod
    def backward(ctx: Any, *grad_outputs: torch.Tensor) -> tuple:
        grads = [_contiguous(g) if ctx.scale == 1 else g * ctx.scale for g in grad_outputs]
        grads = _run(cring.grouped_allgather, grads, process_set=ctx.ps)
        return (None, None, None, None, None, *grads)


def _alltoall_result(result: tuple, device: Any = None) -> tuple:
    """(output, received splits as int32); the splits on `device`, the
    device of the splits tensor the caller gave (Horovod's `splits.new()`),
    else on the CPU."""
    output, received = result
    return output, torch.tensor(received, dtype=torch.int32, device=device)


class _AlltoallFunction(torch.autograd.Function):
    """Gradient (Horovod's): the incoming gradient sent back where its rows
    came from, an alltoall with the received splits."""

    @staticmethod
    def forward(
        ctx: Any,
        tensor: torch.Tensor,
        splits: Optional[list],
        name: Optional[str],
        ps: Any = None,
        device: Any = None,
    ) -> tuple:
        output, received = _alltoall_result(
            _run(cring.alltoall, tensor, splits=splits, name=name, process_set=ps), device
        )
        ctx.received, ctx.ps = received.tolist(), ps
        ctx.mark_non_differentiable(received)
        return output, received

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor, grad_splits: Any) -> tuple:
        grad, _ = _run(
            cring.alltoall, _contiguous(grad_output), splits=ctx.received, process_set=ctx.ps
        )
        return grad, None, None, None, None

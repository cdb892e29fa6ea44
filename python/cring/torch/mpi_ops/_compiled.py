"""cring's collectives as torch operators, for torch.compile: allreduce,
allgather, broadcast and grouped_allreduce registered in the "cring"
namespace (torch.library custom ops) with fake (shape) functions and
Horovod's gradients, so Dynamo puts them in the graph instead of breaking at
cring._C. _collectives takes this route only while torch.compile traces; the
eager path never comes here. Each operator runs cring's ordinary collective
(through _basics._run); nothing here communicates on its own.
"""

# No `from __future__ import annotations`: torch.library.custom_op reads the annotations.

from typing import Any, Optional

import torch
from torch.library import custom_op

import cring
from cring import _core

from ._basics import Average, _run

__all__ = ["allgather", "allreduce", "broadcast", "grouped_allreduce"]

_WIRE = {None: None, "float16": cring.Compression.fp16, "bfloat16": cring.Compression.bf16}

# torch.compile caches compiled graphs (and the backward it derived from these
# operators' formulas) on disk, keyed by the traced graph and not by the formulas: so
# nothing that depends on the rank (or on this file) is baked into a graph. The rank is
# read inside the operators, the number of ranks is an argument, and REVISION, an
# argument of every operator, changes whenever a formula or a shape function does.
REVISION = 1


def _process_set(process_set_id: int) -> Any:
    if process_set_id == 0:
        return cring.global_process_set
    ps = _core._process_sets.get(process_set_id)
    if ps is None:
        raise ValueError(
            f"process set {process_set_id} is not registered (removed since the function was "
            "compiled?)"
        )
    return ps


def _unaliased(out: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    # an operator's output must not share memory with its input (one rank may return it)
    if out is tensor or (
        out.numel() and out.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()
    ):
        return out.clone()
    return out


def _contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


# ---- allreduce --------------------------------------------------------------------------------


@custom_op("cring::allreduce", mutates_args=())
def _allreduce(
    tensor: torch.Tensor,
    name: Optional[str],
    op: int,
    prescale_factor: float,
    postscale_factor: float,
    wire: Optional[str],
    process_set_id: int,
    revision: int,
) -> torch.Tensor:
    out = _run(
        cring.allreduce,
        tensor,
        op=cring.ReduceOp(op),
        name=name,
        compression=_WIRE[wire],
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        process_set=_process_set(process_set_id),
    )
    return _unaliased(out, tensor)


@_allreduce.register_fake
def _(tensor, name, op, prescale_factor, postscale_factor, wire, process_set_id, revision):  # noqa: ANN001, ANN202
    return tensor.new_empty(tensor.shape)


def _allreduce_setup(ctx: Any, inputs: tuple, output: Any) -> None:
    ctx.reduction = inputs[2:]


def _allreduce_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    # Horovod's gradient: the incoming gradient allreduced with the same op and factors
    return (_allreduce(_contiguous(grad), None, *ctx.reduction),) + (None,) * 7


_allreduce.register_autograd(_allreduce_backward, setup_context=_allreduce_setup)


# ---- grouped allreduce (DistributedOptimizer's gradients) -----------------------------------


@custom_op("cring::grouped_allreduce", mutates_args=())
def _grouped_allreduce(
    tensors: list[torch.Tensor],
    name: Optional[str],
    op: int,
    prescale_factor: float,
    postscale_factor: float,
    wire: Optional[str],
    process_set_id: int,
    revision: int,
) -> list[torch.Tensor]:
    out = _run(
        cring.grouped_allreduce,
        list(tensors),
        op=cring.ReduceOp(op),
        name=name,
        compression=_WIRE[wire],
        prescale_factor=prescale_factor,
        postscale_factor=postscale_factor,
        process_set=_process_set(process_set_id),
    )
    return [_unaliased(o, t) for o, t in zip(out, tensors)]


@_grouped_allreduce.register_fake
def _(tensors, name, op, prescale_factor, postscale_factor, wire, process_set_id, revision):  # noqa: ANN001, ANN202
    return [t.new_empty(t.shape) for t in tensors]


# ---- allgather --------------------------------------------------------------------------------


def _rows(tensor: torch.Tensor) -> int:
    return 1 if tensor.dim() == 0 else tensor.shape[0]


@custom_op("cring::allgather", mutates_args=())
def _allgather(
    tensor: torch.Tensor, name: Optional[str], process_set_id: int, size: int, revision: int
) -> torch.Tensor:
    if process_set_id == 0:  # cring.allgather's C fast paths take this form
        out = _run(cring.allgather, tensor, name=name)
    else:
        out = _run(cring.allgather, tensor, name=name, process_set=_process_set(process_set_id))
    if out.shape[0] != _rows(tensor) * size:
        raise ValueError(
            f"allgather{f' {name!r}' if name else ''} under torch.compile needs the same first "
            f"dimension on every rank (compiled for {size} ranks): this rank has "
            f"{_rows(tensor)}, the ranks {out.shape[0]} together. Gather tensors of different "
            "lengths outside the compiled function"
        )
    return _unaliased(out, tensor)


@_allgather.register_fake
def _(tensor, name, process_set_id, size, revision):  # noqa: ANN001, ANN202
    return tensor.new_empty((_rows(tensor) * size, *tensor.shape[1:]))


@custom_op("cring::allgather_grad", mutates_args=())
def _allgather_grad(
    grad: torch.Tensor, rows: int, process_set_id: int, revision: int
) -> torch.Tensor:
    # Horovod's gradient of allgather: the incoming gradient averaged over ranks, then
    # this rank's rows (the rank read here, when it runs)
    out = _run(cring.allreduce, grad, op=Average, process_set=_process_set(process_set_id))
    rank = _core._ps_size_rank(process_set_id)[1]
    return out.narrow(0, rank * rows, rows).clone()


@_allgather_grad.register_fake
def _(grad, rows, process_set_id, revision):  # noqa: ANN001, ANN202
    return grad.new_empty((rows, *grad.shape[1:]))


def _allgather_setup(ctx: Any, inputs: tuple, output: Any) -> None:
    ctx.input_shape, ctx.process_set_id, ctx.revision = inputs[0].shape, inputs[2], inputs[4]


def _allgather_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    rows = 1 if len(ctx.input_shape) == 0 else ctx.input_shape[0]
    mine = _allgather_grad(_contiguous(grad), rows, ctx.process_set_id, ctx.revision)
    return mine.reshape(ctx.input_shape), None, None, None, None


_allgather.register_autograd(_allgather_backward, setup_context=_allgather_setup)


# ---- broadcast --------------------------------------------------------------------------------


@custom_op("cring::broadcast", mutates_args=())
def _broadcast(
    tensor: torch.Tensor, root_rank: int, name: Optional[str], process_set_id: int, revision: int
) -> torch.Tensor:
    out = _run(
        cring.broadcast, tensor, root_rank, name=name, process_set=_process_set(process_set_id)
    )
    return _unaliased(out, tensor)


@_broadcast.register_fake
def _(tensor, root_rank, name, process_set_id, revision):  # noqa: ANN001, ANN202
    return tensor.new_empty(tensor.shape)


def _broadcast_setup(ctx: Any, inputs: tuple, output: Any) -> None:
    ctx.root_rank, ctx.process_set_id, ctx.revision = inputs[1], inputs[3], inputs[4]


@custom_op("cring::broadcast_grad", mutates_args=())
def _broadcast_grad(
    grad: torch.Tensor, root_rank: int, process_set_id: int, revision: int
) -> torch.Tensor:
    # Horovod's gradient of broadcast: the incoming gradient averaged over ranks on the
    # root, zero elsewhere (one operator, so the graph is the same on every rank)
    out = _run(cring.allreduce, grad, op=Average, process_set=_process_set(process_set_id))
    if cring.rank() != root_rank:
        out = torch.zeros_like(out)
    return _unaliased(out, grad)


@_broadcast_grad.register_fake
def _(grad, root_rank, process_set_id, revision):  # noqa: ANN001, ANN202
    return grad.new_empty(grad.shape)


def _broadcast_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    mine = _broadcast_grad(_contiguous(grad), ctx.root_rank, ctx.process_set_id, ctx.revision)
    return mine, None, None, None, None


_broadcast.register_autograd(_broadcast_backward, setup_context=_broadcast_setup)

# A collective must run on every rank even when its result is unused here (another
# rank may use its own): never dead code to the graph's passes.
for _op in (
    _allreduce,
    _grouped_allreduce,
    _allgather,
    _allgather_grad,
    _broadcast,
    _broadcast_grad,
):
    torch.fx.node.has_side_effect(_op._opoverload)


# ---- what _collectives calls while torch.compile traces -------------------------------------


def _wire_name(wire: Any) -> Optional[str]:
    return None if wire is None else wire.wire_dtype


def allreduce(
    tensor: torch.Tensor,
    name: Optional[str],
    op: Any,
    prescale_factor: float,
    postscale_factor: float,
    compressor: Any,
    wire: Any,
    process_set: Any,
) -> torch.Tensor:
    """cring.torch.allreduce as the operator cring::allreduce (a Horovod-style
    compressor runs around it in the graph)."""
    ctx = None
    if compressor is not None:
        tensor, ctx = compressor.compress(tensor)
    out = _allreduce(
        _contiguous(tensor),
        name,
        int(op),
        float(prescale_factor),
        float(postscale_factor),
        _wire_name(wire),
        _core._ps_id(process_set),
        REVISION,
    )
    return out if compressor is None else compressor.decompress(out, ctx)


def allgather(tensor: torch.Tensor, name: Optional[str], process_set: Any) -> torch.Tensor:
    """cring.torch.allgather as the operator cring::allgather: every rank must
    give the same first dimension (checked when it runs)."""
    ps_id = _core._ps_id(process_set)
    size = (
        len(process_set.ranks) if process_set is not None else len(cring.global_process_set.ranks)
    )
    return _allgather(_contiguous(tensor), name, ps_id, size, REVISION)


def broadcast(
    tensor: torch.Tensor, root_rank: int, name: Optional[str], process_set: Any
) -> torch.Tensor:
    """cring.torch.broadcast as the operator cring::broadcast."""
    return _broadcast(
        _contiguous(tensor), int(root_rank), name, _core._ps_id(process_set), REVISION
    )


def grouped_allreduce(
    tensors: list,
    name: Optional[str],
    op: Any,
    prescale_factor: float,
    postscale_factor: float,
    wire: Any,
    process_set: Any,
) -> list:
    """Allreduce tensors of one dtype as one unit, as the operator cring::grouped_allreduce."""
    return _grouped_allreduce(
        [_contiguous(t) for t in tensors],
        name,
        int(op),
        float(prescale_factor),
        float(postscale_factor),
        _wire_name(wire),
        _core._ps_id(process_set),
        REVISION,
    )

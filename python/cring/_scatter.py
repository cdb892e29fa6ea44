"""reducescatter and alltoall (plain, async, grouped): the collectives that
split a tensor's rows among the ranks (of the job or of a process set).
Thin like cring._collectives, whose helpers (tensor description, CUDA
submission) they share: outputs of the caller's kind, names, submission.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import Any, Optional

from . import _C, _gpu
from ._collectives import _cuda_submit, _info
from ._core import (
    _ASYNC,
    _CALLER_WAITS,
    Average,
    Handle,
    _name,
    _ps_id,
    _ps_size_rank,
    _require_init,
    _submit,
    synchronize,
)
from ._tensors import contiguous, dlpack_source, empty_like, result_like


def _reducescatter_async(
    ps: int,
    tensors: list,
    op: Any,
    name: str,
    grouped: bool,
    prescale_factor: float,
    postscale_factor: float,
    caller_waits: bool,
) -> Handle:
    _require_init()
    tensors = [contiguous(x) for x in tensors]
    p, r = _ps_size_rank(ps)
    submit, info = _submit, _info
    # ---- CUDA tensors: the same path on the caller's stream, or host staging (cring._gpu) ----
    if _gpu.any_cuda(tensors):
        if _gpu.host_staged(tensors, name):
            return _gpu.host_reducescatter(
                _submit,
                list(tensors),
                name,
                grouped,
                p,
                r,
                op=op,
                prescale=prescale_factor,
                postscale=postscale_factor,
                caller_waits=caller_waits,
                process_set=ps,
            )
        stream = _gpu.nccl_stream(tensors, name)
        submit, info = functools.partial(_cuda_submit, stream), _gpu.info
    pairs, outs = [], []
    for x in tensors:
        shape, dtype_name = info(x, name)
        if not shape:
            raise ValueError(f"tensor '{name}': reducescatter needs at least one dimension")
        n = shape[0]
        rows = n // p + (1 if r < n % p else 0)
        out = empty_like(x, (rows,) + tuple(shape[1:]), dtype_name)
        pairs.append((dlpack_source(x), dlpack_source(out)))
        outs.append(out)
    finish = (lambda h: outs) if grouped else (lambda h: outs[0])
    return submit(
        _C.REDUCESCATTER,
        name,
        pairs,
        finish,
        op=op,
        prescale=prescale_factor,
        postscale=postscale_factor,
        caller_waits=caller_waits,
        process_set=ps,
    )


def reducescatter_async(
    tensor: Any,
    op: int = Average,
    name: Optional[str] = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> Handle:
    """Start a reducescatter; synchronize() returns this rank's part."""
    ps = _ps_id(process_set)
    return _reducescatter_async(
        ps,
        [tensor],
        op,
        _name("reducescatter", name, ps),
        False,
        prescale_factor,
        postscale_factor,
        False,
    )


def reducescatter(
    tensor: Any,
    op: int = Average,
    name: Optional[str] = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> Any:
    """Reduce `tensor` over all ranks and return this rank's part of the
    result, split along the first dimension: with n rows and P ranks, rank r
    gets n // P rows, plus one if r < n % P."""
    ps = _ps_id(process_set)
    return synchronize(
        _reducescatter_async(
            ps,
            [tensor],
            op,
            _name("reducescatter", name, ps),
            False,
            prescale_factor,
            postscale_factor,
            True,
        )
    )


def grouped_reducescatter_async(
    tensors: Sequence[Any],
    op: int = Average,
    name: Optional[str] = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> Handle:
    """Start a reducescatter of several tensors as one unit."""
    ps = _ps_id(process_set)
    return _reducescatter_async(
        ps,
        list(tensors),
        op,
        _name("grouped_reducescatter", name, ps),
        True,
        prescale_factor,
        postscale_factor,
        False,
    )


def grouped_reducescatter(
    tensors: Sequence[Any],
    op: int = Average,
    name: Optional[str] = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> list:
    """Reducescatter several tensors as one unit; returns a list."""
    ps = _ps_id(process_set)
    return synchronize(
        _reducescatter_async(
            ps,
            list(tensors),
            op,
            _name("grouped_reducescatter", name, ps),
            True,
            prescale_factor,
            postscale_factor,
            True,
        )
    )


def _alltoall_async(ps: int, tensor: Any, splits: Any, name: str, caller_waits: bool) -> Handle:
    _require_init()
    tensor = contiguous(tensor)
    p = _ps_size_rank(ps)[0]
    if splits is not None:
        splits = [int(s) for s in (splits.tolist() if hasattr(splits, "tolist") else splits)]
    flags = _CALLER_WAITS if caller_waits else _ASYNC

    room = None  # a CUDA result's room lent from the framework's allocator

    def submit(x: Any, finish: Any, stream: Optional[int] = None) -> Handle:
        pair = (x, None if room is None else dlpack_source(room))
        return Handle(
            _C.submit(_C.ALLTOALL, name, [pair], 0, 0, 1.0, 1.0, None, flags, splits, stream, ps),
            finish,
        )

    info, like, stream = _info, result_like, None
    # ---- CUDA tensors: NCCL on the caller's stream, or host staging (cring._gpu) ----
    if _gpu.any_cuda([tensor]):
        if _gpu.host_staged([tensor], name):
            return _gpu.host_alltoall(submit, tensor, name, p)
        info, like, stream = _gpu.info, _gpu.result_like, _gpu.nccl_stream([tensor], name)
        # NCCL: the result goes to room of the input's size (torch's allocator) where it fits
        room = _gpu.lent_rooms([tensor], [info(tensor, name)], 1)[0]
        if room is not None:

            def like(x: Any, h: Any, i: int, shape_i: tuple, dtype_i: str) -> Any:
                return _gpu.lent_result(x, h, i, shape_i, dtype_i, room)

    shape, dtype_name = info(tensor, name)
    if not shape:
        raise ValueError(f"tensor '{name}': alltoall needs at least one dimension")

    def finish(h: Any) -> Any:
        received = _C.first_dims(h, 0, p)
        return like(tensor, h, 0, (sum(received),) + tuple(shape[1:]), dtype_name), received

    with _gpu.device_guard(tensor):
        return submit(dlpack_source(tensor), finish, stream)


def alltoall_async(
    tensor: Any, splits: Any = None, name: Optional[str] = None, process_set: Any = None
) -> Handle:
    """Start an alltoall; synchronize() returns (output, received_splits)."""
    ps = _ps_id(process_set)
    return _alltoall_async(ps, tensor, splits, _name("alltoall", name, ps), False)


def alltoall(
    tensor: Any, splits: Any = None, name: Optional[str] = None, process_set: Any = None
) -> tuple:
    """Scatter rows of `tensor` to every rank and gather what they send.

    `splits[j]` rows (in order, along the first dimension) go to rank j;
    without splits the first dimension is divided evenly (it must divide by
    the number of ranks). Returns ``(output, received_splits)``: the rows received from
    every rank in rank order, and how many came from each. Trailing
    dimensions and dtype must match on every rank."""
    ps = _ps_id(process_set)
    return synchronize(_alltoall_async(ps, tensor, splits, _name("alltoall", name, ps), True))

"""The collectives on NumPy, torch or any DLPack tensor: allreduce,
broadcast and allgather, each synchronous, asynchronous and (where Horovod
has them) grouped or in place; reducescatter and alltoall, which split rows
among the ranks, are in cring._scatter. Every one takes `process_set=`
(None: every rank), whose own engine then runs it.

Thin: output allocation of the caller's kind, names, and submission to the C
engine (cring._C), which negotiates, fuses and runs every collective with the
GIL released. Synchronous calls are an async submission plus synchronize():
one code path. Ranks may submit named collectives in any order; unnamed ones
get deterministic names, so those must be called in the same order. CUDA
tensors take the same submission (the marked branches hand cring._gpu what
only it knows: the caller's stream, host staging). Job set-up is in cring._api.
"""

from __future__ import annotations

import functools
import sys as _sys
from collections.abc import Sequence
from typing import Any, Optional

import numpy as _np
from numpy import ndarray as _ndarray

from . import (
    _C,
    _gpu,  # CUDA tensors (see the marked branches below)
)
from ._core import (
    _WAIT_HERE,
    Average,
    Compression,
    Handle,
    _name,
    _ps_id,
    _ps_size_rank,
    _require_init,
    _submit,
    _wire,
    synchronize,
)
from ._tensors import (
    _NUMPY_DTYPES,
    contiguous,
    dlpack_source,
    empty_like,
    refuse_grad_leaf,
    result_like,
)


def _info(x: Any, name: str) -> tuple[tuple[int, ...], str]:
    """Shape and cring dtype name, without reading the tensor through DLPack
    for NumPy arrays and torch tensors (the submission reads it, and checks
    it, once); anything else is described through DLPack."""
    if type(x) is _ndarray:
        dtype_name = _NUMPY_NAMES.get(x.dtype)
        if dtype_name is not None:
            return x.shape, dtype_name
    elif _is_torch(x):
        dtype_name = _TORCH_NAMES.get(x.dtype)
        if dtype_name is not None:
            return tuple(x.shape), dtype_name
    shape, dtype_name, _read_only = _C.tensor_info(dlpack_source(x), name)
    return shape, dtype_name


# the dtypes a NumPy array (and so the CPU path) may have, in cring's names
NUMPY_DTYPES = tuple(_NUMPY_DTYPES)
# keyed by dtype object: NumPy computes `dtype.name` in Python, about 2 us
_NUMPY_NAMES = {_np.dtype(n): n for n in NUMPY_DTYPES}
_TORCH_NAMES: dict = {}  # torch dtype -> cring name, filled when torch is first seen


def _is_torch(x: Any) -> bool:
    torch = _sys.modules.get("torch")
    if torch is None or not isinstance(x, torch.Tensor):
        return False
    if not _TORCH_NAMES:
        for n in (
            "float16",
            "bfloat16",
            "float32",
            "float64",
            "int8",
            "uint8",
            "int16",
            "int32",
            "int64",
            "bool",
            "uint16",
            "uint32",
            "uint64",
        ):
            if hasattr(torch, n):  # torch.uint16/32/64 are new in torch 2.3
                _TORCH_NAMES[getattr(torch, n)] = n
    return True


def _cuda_submit(
    stream: int, collective: int, name: str, pairs: list, finish: Any, **options: Any
) -> Handle:
    """_submit for CUDA tensors on the NCCL path, on the caller's `stream`
    (from _gpu.nccl_stream) and with the tensors' device current; at
    synchronize() the caller's current stream waits on the collective's
    completion event (in C)."""
    with _gpu.device_guard(pairs[0][0]):
        return _submit(collective, name, pairs, finish, stream=stream, **options)


def _allreduce_async(
    ps: int,
    tensors: list,
    in_place: bool,
    op: Any,
    name: str,
    compression: Any,
    prescale_factor: float,
    postscale_factor: float,
    grouped: bool,
    caller_waits: bool,
) -> Handle:
    if in_place:
        refuse_grad_leaf(tensors, "grouped_allreduce_" if grouped else "allreduce_async_")
    else:
        tensors = [contiguous(x) for x in tensors]
    submit, info = _submit, _info
    # ---- CUDA tensors: the same path on the caller's stream, or host staging (cring._gpu) ----
    if _gpu.any_cuda(tensors):
        _require_init()
        if _gpu.host_staged(tensors, name):
            wires = {_wire(compression, _gpu.info(x, name)[1]) for x in tensors}
            return _gpu.host_reduce_like(
                _submit,
                _C.ALLREDUCE,
                list(tensors),
                in_place,
                name,
                grouped,
                op=op,
                prescale=prescale_factor,
                postscale=postscale_factor,
                caller_waits=caller_waits,
                wire=wires.pop() if len(wires) == 1 else None,
                process_set=ps,
            )
        stream = _gpu.nccl_stream(tensors, name)
        submit, info = functools.partial(_cuda_submit, stream), _gpu.info
        if not (compression is None or compression is Compression.none):
            wires = {_wire(compression, info(x, name)[1]) for x in tensors}
            wire = _gpu.wire_dtype(tensors, wires.pop() if len(wires) == 1 else None)
            compression = None
            if wire is not None:  # cast with torch around an allreduce of the casts
                return _gpu.compressed(
                    list(tensors),
                    in_place,
                    wire,
                    grouped,
                    lambda casts: _allreduce_async(
                        ps,
                        casts,
                        True,
                        op,
                        name,
                        None,
                        prescale_factor,
                        postscale_factor,
                        True,
                        caller_waits,
                    ),
                    lambda inner, finish: Handle(inner._h, finish),
                    synchronize,
                )
    pairs, outs, wires = [], [], set()
    plain = compression is None or compression is Compression.none
    for x in tensors:
        src = dlpack_source(x)
        if in_place and plain:  # the common case: no shape or dtype needed here
            pairs.append((src, src))
            outs.append(x)
            continue
        shape, dtype_name = info(x, name)
        wires.add(_wire(compression, dtype_name))
        out = x if in_place else empty_like(x, shape, dtype_name)
        pairs.append((src, src if in_place else dlpack_source(out)))
        outs.append(out)
    wire = wires.pop() if len(wires) == 1 else None
    finish = (lambda h: outs) if grouped else (lambda h: outs[0])
    return submit(
        _C.ALLREDUCE,
        name,
        pairs,
        finish,
        op=op,
        prescale=prescale_factor,
        postscale=postscale_factor,
        wire=wire,
        caller_waits=caller_waits,
        process_set=ps,
    )


def _allreduce_async_out_general(
    tensor: Any,
    op: int = Average,
    name: Optional[str] = None,
    compression: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> Handle:
    """allreduce_async for what _C.allreduce_async does not do itself
    (CUDA and other libraries' tensors, strided ones, compression, scaling,
    process sets)."""
    ps = _ps_id(process_set)
    return _allreduce_async(
        ps,
        [tensor],
        False,
        op,
        _name("allreduce", name, ps),
        compression,
        prescale_factor,
        postscale_factor,
        False,
        False,
    )


# cring.allreduce_async(tensor, op=Average, name=None, compression=None,
# prescale_factor=1.0, postscale_factor=1.0, process_set=None): start an
# allreduce into a new tensor; synchronize() returns it. A contiguous NumPy
# array or CPU torch tensor on the global set, without compression or
# scaling, is queued by _C.allreduce_async without a Python frame (the output
# made by empty_like in C, the engine reading the input and writing the
# output directly); the rest comes back to _allreduce_async_out_general.
_C.allreduce_async_out_fallback = _allreduce_async_out_general
allreduce_async = _C.allreduce_async


def _allreduce_async_inplace_general(
    tensor: Any,
    op: int = Average,
    name: Optional[str] = None,
    compression: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> Handle:
    """allreduce_async_ for what _C.allreduce_async_ does not do itself
    (everything but a named torch CUDA tensor on the NCCL path)."""
    ps = _ps_id(process_set)
    return _allreduce_async(
        ps,
        [tensor],
        True,
        op,
        _name("allreduce", name, ps),
        compression,
        prescale_factor,
        postscale_factor,
        False,
        False,
    )


# cring.allreduce_async_(tensor, op=Average, name=None, compression=None,
# prescale_factor=1.0, postscale_factor=1.0): start an in-place allreduce;
# synchronize() returns the tensor itself. A named torch CUDA tensor goes from
# _C.allreduce_async_ to the engine's queue without a Python frame; the rest
# comes back to _allreduce_async_inplace_general.
_C.allreduce_async_fallback = _allreduce_async_inplace_general
allreduce_async_ = _C.allreduce_async_


def _plain(compression: Any, prescale_factor: float, postscale_factor: float) -> bool:
    return (
        (compression is None or compression is Compression.none)
        and prescale_factor == 1.0
        and postscale_factor == 1.0
    )


def _allreduce_out_general(
    tensor: Any,
    op: int = Average,
    name: Optional[str] = None,
    compression: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> Any:
    """allreduce for what _C.allreduce does not do itself (CUDA and other
    libraries' tensors, strided ones, compression, scaling, process sets)."""
    ps = _ps_id(process_set)
    return synchronize(
        _allreduce_async(
            ps,
            [tensor],
            False,
            op,
            _name("allreduce", name, ps),
            compression,
            prescale_factor,
            postscale_factor,
            False,
            True,
        )
    )


# cring.allreduce(tensor, op=Average, name=None, compression=None,
# prescale_factor=1.0, postscale_factor=1.0, process_set=None): return a new
# tensor of the caller's kind holding the reduction of `tensor` over all
# ranks; the input is unchanged. A contiguous NumPy array or CPU torch tensor
# on the global set, without compression or scaling, is reduced by
# _C.allreduce without a Python frame (the output made by empty_like in C,
# the caller waiting as allreduce_ does); the rest comes back to
# _allreduce_out_general.
_C.allreduce_out_fallback = _allreduce_out_general
allreduce = _C.allreduce


def _allreduce_inplace_general(
    tensor: Any,
    op: int = Average,
    name: Optional[str] = None,
    compression: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> Any:
    """allreduce_ for what _C.allreduce_ does not do itself: generated names,
    compression and scaling, CUDA tensors and other libraries' tensors."""
    refuse_grad_leaf((tensor,), "allreduce_")
    ps = _ps_id(process_set)
    name = _name("allreduce", name, ps)
    if not _plain(compression, prescale_factor, postscale_factor) or _gpu.is_cuda(tensor):
        return synchronize(
            _allreduce_async(
                ps,
                [tensor],
                True,
                op,
                name,
                compression,
                prescale_factor,
                postscale_factor,
                False,
                True,
            )
        )
    src = tensor if type(tensor) is _ndarray else dlpack_source(tensor)
    _C.submit(_C.ALLREDUCE, name, [(src, src)], op, 0, 1.0, 1.0, None, _WAIT_HERE, None, None, ps)
    return tensor


# cring.allreduce_(tensor, op=Average, name=None, compression=None,
# prescale_factor=1.0, postscale_factor=1.0): reduce `tensor` over all ranks
# in place and return the same object. A NumPy array or CPU torch tensor with
# a name is bound and reduced by _C.allreduce_ without a Python frame; the
# rest comes back to _allreduce_inplace_general.
_C.allreduce_fallback = _allreduce_inplace_general
allreduce_ = _C.allreduce_


def grouped_allreduce_async(
    tensors: Sequence[Any],
    op: int = Average,
    name: Optional[str] = None,
    compression: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> Handle:
    """Start one allreduce over a list of tensors, negotiated and run as one
    unit; synchronize() returns the list of results."""
    ps = _ps_id(process_set)
    return _allreduce_async(
        ps,
        list(tensors),
        False,
        op,
        _name("grouped_allreduce", name, ps),
        compression,
        prescale_factor,
        postscale_factor,
        True,
        False,
    )


def grouped_allreduce_async_(
    tensors: Sequence[Any],
    op: int = Average,
    name: Optional[str] = None,
    compression: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> Handle:
    """In-place form of grouped_allreduce_async."""
    ps = _ps_id(process_set)
    return _allreduce_async(
        ps,
        list(tensors),
        True,
        op,
        _name("grouped_allreduce", name, ps),
        compression,
        prescale_factor,
        postscale_factor,
        True,
        False,
    )


def grouped_allreduce(
    tensors: Sequence[Any],
    op: int = Average,
    name: Optional[str] = None,
    compression: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> list:
    """Allreduce a list of tensors as one unit; returns new tensors."""
    ps = _ps_id(process_set)
    return synchronize(
        _allreduce_async(
            ps,
            list(tensors),
            False,
            op,
            _name("grouped_allreduce", name, ps),
            compression,
            prescale_factor,
            postscale_factor,
            True,
            True,
        )
    )


def grouped_allreduce_(
    tensors: Sequence[Any],
    op: int = Average,
    name: Optional[str] = None,
    compression: Any = None,
    prescale_factor: float = 1.0,
    postscale_factor: float = 1.0,
    process_set: Any = None,
) -> list:
    """Allreduce a list of tensors as one unit, in place; returns the list."""
    ps = _ps_id(process_set)
    return synchronize(
        _allreduce_async(
            ps,
            list(tensors),
            True,
            op,
            _name("grouped_allreduce", name, ps),
            compression,
            prescale_factor,
            postscale_factor,
            True,
            True,
        )
    )


def _broadcast_async(
    ps: int, tensor: Any, root_rank: int, name: str, in_place: bool, caller_waits: bool
) -> Handle:
    _require_init()
    if in_place:
        refuse_grad_leaf((tensor,), "broadcast_")
    else:
        tensor = contiguous(tensor)
    root = int(root_rank)  # the C submission checks its range
    submit, info = _submit, _info
    # ---- CUDA tensors: the same path on the caller's stream, or host staging (cring._gpu) ----
    if _gpu.is_cuda(tensor):
        n = _ps_size_rank(0)[0]
        if not ps and not 0 <= root < n:
            raise ValueError(f"tensor '{name}': root_rank {root} is out of range for size {n}")
        if _gpu.host_staged([tensor], name):
            return _gpu.host_reduce_like(
                _submit,
                _C.BROADCAST,
                [tensor],
                in_place,
                name,
                False,
                root=root,
                caller_waits=caller_waits,
                process_set=ps,
            )
        submit, info = functools.partial(_cuda_submit, _gpu.nccl_stream([tensor], name)), _gpu.info
    src = dlpack_source(tensor)
    if in_place:
        return submit(
            _C.BROADCAST,
            name,
            [(src, src)],
            lambda h: tensor,
            root=root,
            caller_waits=caller_waits,
            process_set=ps,
        )
    shape, dtype_name = info(tensor, name)
    out = empty_like(tensor, shape, dtype_name)
    return submit(
        _C.BROADCAST,
        name,
        [(src, dlpack_source(out))],
        lambda h: out,
        root=root,
        caller_waits=caller_waits,
        process_set=ps,
    )


def broadcast_async(
    tensor: Any, root_rank: int, name: Optional[str] = None, process_set: Any = None
) -> Handle:
    """Start a broadcast into a new tensor."""
    ps = _ps_id(process_set)
    return _broadcast_async(ps, tensor, root_rank, _name("broadcast", name, ps), False, False)


def broadcast_async_(
    tensor: Any, root_rank: int, name: Optional[str] = None, process_set: Any = None
) -> Handle:
    """Start an in-place broadcast."""
    ps = _ps_id(process_set)
    return _broadcast_async(ps, tensor, root_rank, _name("broadcast", name, ps), True, False)


def broadcast(
    tensor: Any, root_rank: int, name: Optional[str] = None, process_set: Any = None
) -> Any:
    """Return a new tensor holding root_rank's values; the input is unchanged."""
    ps = _ps_id(process_set)
    return synchronize(
        _broadcast_async(ps, tensor, root_rank, _name("broadcast", name, ps), False, True)
    )


def _broadcast_inplace_general(
    tensor: Any, root_rank: int, name: Optional[str] = None, process_set: Any = None
) -> Any:
    """broadcast_ for what _C.broadcast_ does not do itself: CUDA tensors and
    other libraries' tensors, process sets, and the errors of bad arguments."""
    ps = _ps_id(process_set)
    return synchronize(
        _broadcast_async(ps, tensor, root_rank, _name("broadcast", name, ps), True, True)
    )


# cring.broadcast_(tensor, root_rank, name=None, process_set=None): overwrite
# `tensor` on every rank with root_rank's values; returns it. A NumPy array or
# CPU torch tensor on the global set is bound and broadcast by _C.broadcast_
# without a Python frame (a small one rides the engine's negotiation round);
# the rest comes back to _broadcast_inplace_general.
_C.broadcast_fallback = _broadcast_inplace_general
broadcast_ = _C.broadcast_


def _allgather_async(
    ps: int, tensors: list, name: str, grouped: bool, caller_waits: bool
) -> Handle:
    _require_init()
    tensors = [contiguous(x) for x in tensors]
    p = _ps_size_rank(ps)[0]
    submit, info = _submit, _info
    rooms: list = [None] * len(tensors)
    # ---- CUDA tensors: the same path on the caller's stream, or host staging (cring._gpu) ----
    cuda = _gpu.any_cuda(tensors)
    if cuda:
        if _gpu.host_staged(tensors, name):
            return _gpu.host_allgather(
                _submit, list(tensors), name, grouped, p, caller_waits=caller_waits, process_set=ps
            )
        submit = functools.partial(_cuda_submit, _gpu.nccl_stream(tensors, name))
        info = _gpu.info
    infos = [info(x, name) for x in tensors]
    if cuda:  # results in room from the framework's allocator where it has one
        rooms = _gpu.lent_rooms(tensors, infos, p)
    pairs = [
        (dlpack_source(x), None if room is None else dlpack_source(room))
        for x, room in zip(tensors, rooms)
    ]

    def finish(h: Any) -> Any:
        outs = []
        for i, (x, (shape, dtype_name)) in enumerate(zip(tensors, infos)):
            dims = _C.first_dims(h, i, p)
            shape_i = (sum(dims),) + tuple(shape[1:])
            if cuda:
                outs.append(_gpu.lent_result(x, h, i, shape_i, dtype_name, rooms[i]))
            else:
                outs.append(result_like(x, h, i, shape_i, dtype_name))
        return outs if grouped else outs[0]

    return submit(_C.ALLGATHER, name, pairs, finish, caller_waits=caller_waits, process_set=ps)


def allgather_async(tensor: Any, name: Optional[str] = None, process_set: Any = None) -> Handle:
    """Start an allgather; synchronize() returns the concatenated tensor."""
    ps = _ps_id(process_set)
    return _allgather_async(ps, [tensor], _name("allgather", name, ps), False, False)


def _allgather_general(tensor: Any, name: Optional[str] = None, process_set: Any = None) -> Any:
    """allgather for what _C.allgather does not do itself (everything but a
    NumPy array on the global set). A 0-d tensor gathers as one row."""
    ps = _ps_id(process_set)
    return synchronize(_allgather_async(ps, [tensor], _name("allgather", name, ps), False, True))


# cring.allgather(tensor, name=None, process_set=None) (the docstring is
# _C.allgather's): a NumPy array is gathered by _C.allgather without a Python
# frame (small results copied into a new array, large ones lent through
# _C.allgather_view), and so is a torch CUDA tensor on the NCCL path (its
# result in room from x.new_empty, or, where it did not fit, through
# _C.allgather_cuda_view); the rest comes back to _allgather_general.
_C.allgather_fallback = _allgather_general
_C.allgather_view = lambda x, h, shape: result_like(x, h, 0, shape, "")
# a torch CUDA tensor's result the engine kept in its own memory (uneven)
_C.allgather_cuda_view = lambda x, h, shape: _gpu.result_like(x, h, 0, shape, _gpu.info(x, "")[1])
allgather = _C.allgather


def grouped_allgather_async(
    tensors: Sequence[Any], name: Optional[str] = None, process_set: Any = None
) -> Handle:
    """Start an allgather of several tensors as one unit."""
    ps = _ps_id(process_set)
    return _allgather_async(ps, list(tensors), _name("grouped_allgather", name, ps), True, False)


def grouped_allgather(
    tensors: Sequence[Any], name: Optional[str] = None, process_set: Any = None
) -> list:
    """Allgather several tensors as one unit; returns a list."""
    ps = _ps_id(process_set)
    return synchronize(
        _allgather_async(ps, list(tensors), _name("grouped_allgather", name, ps), True, True)
    )

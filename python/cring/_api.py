"""The user-facing collectives on NumPy, torch or any DLPack tensor.

Thin: argument checks that need shapes, output allocation of the caller's
kind, and calls into cring._C, which does the communication with the GIL
released. Synchronous calls only; every rank must call the same collectives in
the same order.
"""

from __future__ import annotations

import enum
import itertools
import math
import threading
from typing import Any, Optional

import numpy as np

from . import _C, _discovery
from ._tensors import dlpack_source, empty_like

CRingError = _C.CRingError
TimeoutError = _C.TimeoutError  # noqa: A001  (cring.TimeoutError, a CRingError)
PeerFailureError = _C.PeerFailureError
MismatchError = _C.MismatchError
NotInitializedError = _C.NotInitializedError


class ReduceOp(enum.IntEnum):
    """Reduction operations; values follow Horovod's numbering."""

    AVERAGE = 0
    SUM = 1
    ADASUM = 2
    MIN = 3
    MAX = 4
    PRODUCT = 5


Average = ReduceOp.AVERAGE
Sum = ReduceOp.SUM
Adasum = ReduceOp.ADASUM
Min = ReduceOp.MIN
Max = ReduceOp.MAX
Product = ReduceOp.PRODUCT

_state_lock = threading.Lock()
_generation = 0  # how many times this process has initialised (store key namespace)
_topology: dict[str, Any] = {}
_name_counters: dict[str, itertools.count] = {}


def _start_store(addr: str, secret: Optional[str]) -> tuple[Any, int]:
    server = _C.StoreServer(addr, 0, secret)
    return server, server.port


_plan_server: Any = None  # a store started for one init (torchrun/mpirun paths)
# Stores this process serves on a fixed address (rank 0 under MASTER_ADDR/PORT
# or CRING_ADDR/PORT). They outlive shutdown(): a peer that re-initialises
# first must find the store of the next generation at the same address, not a
# dying one, and keys are namespaced by generation so nothing clashes.
_fixed_servers: dict[tuple[str, int], Any] = {}


def init(
    rank: Optional[int] = None,
    size: Optional[int] = None,
    addr: Optional[str] = None,
    port: Optional[int] = None,
    *,
    secret: Optional[str] = None,
    transport: Optional[str] = None,
    timeout_s: Optional[float] = None,
) -> None:
    """Join the job: find rank and size (arguments, then environment), meet the
    other ranks at the rendezvous store and connect the transports.

    Calling init() again while initialised does nothing (as in Horovod).
    """
    global _generation, _topology, _plan_server
    with _state_lock:
        if _C.is_initialized():
            return
        plan = _discovery.plan_init(rank=rank, size=size, addr=addr, port=port, secret=secret,
                                    transport=transport, timeout_s=timeout_s,
                                    generation=_generation, start_store=_start_store)
        _generation += 1
        if plan.serve_store:
            key = (plan.addr, plan.port)
            if key not in _fixed_servers:
                _fixed_servers[key] = _C.StoreServer(plan.addr, plan.port, plan.secret)
            plan.serve_store = False
        try:
            _C.init(plan.rank, plan.size, plan.addr, plan.port, plan.serve_store, plan.secret,
                    plan.job_key, None, plan.transport, plan.timeout_s)
        except BaseException:
            if plan.store_server is not None:
                plan.store_server.stop()
            raise
        finally:
            if plan.cleanup is not None:
                plan.cleanup()
        _plan_server = plan.store_server
        _topology = _C.topology()
        _name_counters.clear()


def shutdown() -> None:
    """Leave the job and free its resources; init() may be called again.
    Does not communicate, so it never blocks on a dead peer. A rendezvous
    store that rank 0 serves on a fixed port keeps running until the process
    exits, so that peers re-initialising first find the next generation."""
    global _topology, _plan_server
    with _state_lock:
        _C.shutdown()
        if _plan_server is not None:
            _plan_server.stop()
            _plan_server = None
        _topology = {}


def is_initialized() -> bool:
    return bool(_C.is_initialized())


def _topo(key: str) -> Any:
    if not _topology:
        raise NotInitializedError("cring has not been initialized; call cring.init() first")
    return _topology[key]


def rank() -> int:
    """This process's rank, 0 <= rank < size()."""
    return _topo("rank")


def size() -> int:
    """Number of ranks in the job."""
    return _topo("size")


def local_rank() -> int:
    """Rank among the processes on this host."""
    return _topo("local_rank")


def local_size() -> int:
    """Number of processes on this host."""
    return _topo("local_size")


def cross_rank() -> int:
    """Rank among the processes that have this process's local rank (the host index)."""
    return _topo("cross_rank")


def cross_size() -> int:
    """Number of processes with this process's local rank (the number of hosts)."""
    return _topo("cross_size")


def transport() -> str:
    """'shm', 'tcp' or 'self' (one rank): what the collectives run over."""
    return _topo("transport")


def _require_init() -> None:
    if not _C.is_initialized():
        raise NotInitializedError("cring has not been initialized; call cring.init() first")


def _name(kind: str, name: Optional[str]) -> str:
    if name is not None:
        return str(name)
    counter = _name_counters.setdefault(kind, itertools.count())
    return f"{kind}.noname.{next(counter)}"


def _op(op: Any) -> int:
    try:
        op = ReduceOp(int(op))
    except (TypeError, ValueError):
        raise ValueError(f"unknown reduction op {op!r}; use cring.Sum, Average, Min, Max or "
                         "Product") from None
    if op == ReduceOp.ADASUM:
        raise NotImplementedError("cring does not implement Adasum; use cring.Average or Sum")
    return int(op)


def _info(x: Any, name: str) -> tuple[tuple[int, ...], str]:
    shape, dtype_name, _read_only = _C.tensor_info(dlpack_source(x), name)
    return shape, dtype_name


def allreduce_(tensor: Any, op: int = Average, name: Optional[str] = None) -> Any:
    """Reduce `tensor` over all ranks in place and return the same object.
    op: cring.Average (default, as in Horovod), Sum, Min, Max or Product."""
    _require_init()
    name = _name("allreduce", name)
    src = dlpack_source(tensor)
    _C.allreduce(src, src, _op(op), name)
    return tensor


def allreduce(tensor: Any, op: int = Average, name: Optional[str] = None) -> Any:
    """Return a new tensor of the caller's kind holding the reduction of
    `tensor` over all ranks; the input is unchanged."""
    _require_init()
    name = _name("allreduce", name)
    shape, dtype_name = _info(tensor, name)
    out = empty_like(tensor, shape, dtype_name)
    _C.allreduce(dlpack_source(tensor), out, _op(op), name)
    return out


def _check_root(root_rank: int, name: str) -> int:
    root = int(root_rank)
    if not 0 <= root < size():
        raise ValueError(f"tensor '{name}': root_rank {root} is out of range for size {size()}")
    return root


def broadcast_(tensor: Any, root_rank: int, name: Optional[str] = None) -> Any:
    """Overwrite `tensor` on every rank with root_rank's values; returns it."""
    _require_init()
    name = _name("broadcast", name)
    src = dlpack_source(tensor)
    _C.broadcast(src, _check_root(root_rank, name), name)
    return tensor


def broadcast(tensor: Any, root_rank: int, name: Optional[str] = None) -> Any:
    """Return a new tensor holding root_rank's values; the input is unchanged."""
    _require_init()
    name = _name("broadcast", name)
    root = _check_root(root_rank, name)
    shape, dtype_name = _info(tensor, name)
    out = empty_like(tensor, shape, dtype_name)
    if rank() == root:
        _C.copy(dlpack_source(tensor), out, name)
    _C.broadcast(out, root, name)
    return out


def _gather_shapes(shape: tuple[int, ...], dtype_name: str, name: str) -> np.ndarray:
    """Every rank's (ndim, first dimension, trailing-shape hash, dtype) as a
    (size, 4) int64 array, checking that only the first dimension differs."""
    trailing = hash(tuple(shape[1:])) & 0x7FFFFFFFFFFFFFFF
    mine = np.array([len(shape), shape[0] if shape else 1, trailing,
                     list(_DTYPE_CODES).index(dtype_name)], dtype=np.int64)
    every = np.empty(size() * 4, dtype=np.int64)
    _C.allgather(mine, every, [4] * size(), name)
    every = every.reshape(size(), 4)
    for r in range(size()):
        if every[r, 0] != every[0, 0] or every[r, 2] != every[0, 2]:
            raise MismatchError(
                f"allgather of tensor '{name}': rank {r} has a tensor of different rank or "
                f"trailing dimensions than rank 0 (only the first dimension may differ)")
        if every[r, 3] != every[0, 3]:
            raise MismatchError(
                f"allgather of tensor '{name}': rank {r} has dtype {_DTYPE_CODES[every[r, 3]]}, "
                f"rank 0 has {_DTYPE_CODES[every[0, 3]]}")
    return every


_DTYPE_CODES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64",
                "bool")


def allgather(tensor: Any, name: Optional[str] = None) -> Any:
    """Concatenate every rank's tensor along the first dimension (which may
    differ between ranks); trailing dimensions and dtype must match."""
    _require_init()
    name = _name("allgather", name)
    shape, dtype_name = _info(tensor, name)
    if not shape:
        shape = (1,)  # a scalar gathers as one row
    every = _gather_shapes(shape, dtype_name, name)
    row = math.prod(shape[1:])
    rows = [int(n) for n in every[:, 1]]
    out = empty_like(tensor, (sum(rows),) + tuple(shape[1:]), dtype_name)
    _C.allgather(dlpack_source(tensor), out, [n * row for n in rows], name)
    return out


def reducescatter(tensor: Any, op: int = Average, name: Optional[str] = None) -> Any:
    """Reduce `tensor` over all ranks and return this rank's part of the
    result, split along the first dimension: with n rows and P ranks, rank r
    gets n // P rows, plus one if r < n % P."""
    _require_init()
    name = _name("reducescatter", name)
    shape, dtype_name = _info(tensor, name)
    if not shape:
        raise ValueError(f"tensor '{name}': reducescatter needs at least one dimension")
    n, p = shape[0], size()
    rows = [n // p + (1 if r < n % p else 0) for r in range(p)]
    row = math.prod(shape[1:])
    out = empty_like(tensor, (rows[rank()],) + tuple(shape[1:]), dtype_name)
    _C.reducescatter(dlpack_source(tensor), out, [k * row for k in rows], _op(op), name)
    return out


def barrier() -> None:
    """Return once every rank has called barrier()."""
    _require_init()
    _C.barrier()

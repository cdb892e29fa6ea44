"""The types every part of cring shares: reduction ops, handles, compression,
the exceptions, the names of unnamed collectives and the job's topology.

The bottom of the Python package: it imports only cring._C, and the API
(cring._api, cring._collectives) and the device modules (cring._gpu) import from it, never the
other way round. It submits requests but builds none of its own.
"""

from __future__ import annotations

import enum
import operator
from typing import Any, Callable, Optional

from . import _C

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

_OP_VALUES = {int(o): int(o) for o in ReduceOp}


def _op(op: Any) -> int:
    """The op code of `op`, for code that needs it before submitting (the C
    submission checks CPU requests' ops itself, with the same messages)."""
    try:
        return _OP_VALUES[op]  # fast path: an int or a ReduceOp
    except (KeyError, TypeError):
        pass
    try:
        op = ReduceOp(op.__index__())
    except (AttributeError, TypeError, ValueError):
        raise ValueError(
            f"unknown reduction op {op!r}; use cring.Sum, Average, Min, Max, Product or Adasum"
        ) from None
    return int(op)


# ---- topology of the current job (cring._api.init fills it, shutdown empties it) ----------------

_topology: dict[str, Any] = {}


def _require_init() -> None:
    if not _C.is_initialized():
        raise NotInitializedError("cring has not been initialized; call cring.init() first")


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


# ---- process sets (cring._api adds and removes them; each has its own engine in C) ------------


class ProcessSet:
    """A subset of the job's ranks that runs collectives together, on its own
    communicator and engine (Horovod's `hvd.ProcessSet`). Build one from a
    list of global ranks and register it with cring.add_process_set(), or
    pass it to cring.init(process_sets=[...]); `process_set_id` is None
    until then. Ranks are kept sorted. Roots (broadcast's root_rank) are
    always global ranks; `rank()` is this process's rank within the set."""

    process_set_id: Optional[int] = None
    ranks: Optional[list] = None
    mpi_comm: Any = None

    def __init__(self, ranks_or_comm: Any):
        try:
            ranks = [operator.index(r) for r in ranks_or_comm]
        except TypeError:
            raise ValueError(
                "ProcessSet takes a list of global ranks (cring runs on no MPI "
                f"communicator), got {ranks_or_comm!r}"
            ) from None
        self.ranks = sorted(ranks)

    def _invalidate(self) -> None:
        self.process_set_id = None

    def size(self) -> Optional[int]:
        """Number of ranks in the set; None while it is not registered."""
        if self.process_set_id is None:
            return None
        return size() if self.process_set_id == 0 else len(self.ranks or ())

    def rank(self) -> Optional[int]:
        """This process's rank within the set (None while it is not
        registered; ValueError when this process is not in it)."""
        if self.process_set_id is None:
            return None
        if self.process_set_id == 0:
            return rank()
        me = rank()
        if me not in (self.ranks or ()):
            raise ValueError(
                f"rank {me} is not in process set {self.process_set_id} ({self.ranks})"
            )
        return self.ranks.index(me)

    def included(self) -> Optional[bool]:
        """Whether this process is in the set (None without ranks)."""
        if self.process_set_id == 0:
            return True
        if self.ranks is None:
            return None
        return rank() in self.ranks

    def __eq__(self, other: Any) -> bool:
        if not isinstance(other, ProcessSet):
            return NotImplemented
        if self is other:
            return True
        return self.process_set_id is not None and (self.process_set_id, self.ranks) == (
            other.process_set_id,
            other.ranks,
        )

    def __hash__(self) -> int:
        return id(self) if self.process_set_id is None else hash(self.process_set_id)

    def __repr__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks})"

    __str__ = __repr__


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0
_process_sets: dict[int, ProcessSet] = {}  # id -> the registered object (not the global one)


def _ps_id(process_set: Any) -> int:
    """The id _C.submit takes for `process_set` (None: the global set). A set
    that was never registered, or was removed, is a ValueError; a rank outside
    a registered set gets its ValueError from the submission."""
    if process_set is None:
        return 0
    ps_id = getattr(process_set, "process_set_id", -1)
    if ps_id == 0:
        return 0
    if not isinstance(process_set, ProcessSet):
        raise TypeError(f"process_set must be a cring.ProcessSet, got {process_set!r}")
    if ps_id is None:
        raise ValueError(
            f"{process_set!r} is not registered: add it with cring.add_process_set() "
            "(or cring.init(process_sets=[...])) on every rank first"
        )
    return ps_id


def _ps_size_rank(ps_id: int) -> tuple[int, int]:
    """(size, rank) of set `ps_id` as seen by this process (a member)."""
    if ps_id == 0:
        return size(), rank()
    ps = _process_sets.get(ps_id)
    me = rank()
    if ps is None:
        raise ValueError(f"process set {ps_id} is not known on rank {me} (removed, or never added)")
    if me not in ps.ranks:
        raise ValueError(f"rank {me} is not in process set {ps_id} (ranks {ps.ranks})")
    return len(ps.ranks), ps.ranks.index(me)


# ---- names of unnamed collectives ---------------------------------------------------------------


class _NameCounters:
    """The per-kind counters of unnamed calls live in cring._C (its fast
    paths name unnamed calls too); cring._api.init clears them."""

    def clear(self) -> None:
        _C.noname_reset()

    def forget_set(self, ps_id: int) -> None:
        """Count a removed process set's unnamed calls from 0 again (a later
        set may get its id with other members)."""
        _C.noname_reset(f".ps{ps_id}")


_name_counters = _NameCounters()


def _name(kind: str, name: Optional[str], ps_id: int = 0) -> str:
    """`name` as a string, or the next deterministic name for an unnamed call
    of this kind ("allreduce.noname.3"; every rank makes unnamed calls in the
    same order). The names cycle, so the response cache serves unnamed calls
    as it does named ones; a call whose name is still in flight waits behind
    the earlier one. Each process set counts its own, so calls on one set
    never shift another's."""
    if name is not None:
        return name if type(name) is str else str(name)
    return _C.noname(kind if not ps_id else f"{kind}.ps{ps_id}")


# ---- compression ---------------------------------------------------------------------------------


class Compressor:
    """Compression for allreduce payloads: float32 tensors travel as
    `wire_dtype` (cast down before, up after); other dtypes are unaffected."""

    def __init__(self, name: str, wire_dtype: Optional[str]):
        self.name = name
        self.wire_dtype = wire_dtype

    def __repr__(self) -> str:
        return f"Compression.{self.name}"


class Compression:
    """Choices for the `compression=` argument (as in Horovod)."""

    none = Compressor("none", None)
    fp16 = Compressor("fp16", "float16")
    bf16 = Compressor("bf16", "bfloat16")


def _wire(compression: Any, dtype_name: str) -> Optional[str]:
    if compression is None:
        return None
    wire = compression.wire_dtype if isinstance(compression, Compressor) else str(compression)
    if wire in (None, "none"):
        return None
    if wire not in ("float16", "bfloat16"):
        raise ValueError(f"compression must be Compression.none, fp16 or bf16, got {compression!r}")
    return wire if dtype_name == "float32" else None


# ---- handles -------------------------------------------------------------------------------------


class Handle:
    """A collective in flight: pass it to cring.poll() or cring.synchronize().
    Usable from any thread; synchronize() returns the result once. Dropping a
    handle never waits: the engine keeps the tensors alive until the
    collective has run, and its result is discarded.

    _finish(h) makes the result at synchronize(); None when _result already
    holds it (the C fast path of allreduce_async_ builds such handles)."""

    __slots__ = ("_h", "_finish", "_result", "_finished")

    def __init__(self, handle: Any, finish: Optional[Callable[[Any], Any]]):
        self._h = handle
        self._finish = finish
        self._finished = False
        self._result: Any = None

    @property
    def name(self) -> str:
        return self._h.name

    def __repr__(self) -> str:
        state = "done" if self._h.done() else "pending"
        return f"<cring.Handle {self._h.name!r} {state}>"


def poll(handle: Handle) -> bool:
    """True once the collective has completed (successfully or not). Never blocks."""
    return bool(handle._h.done())


def synchronize(handle: Handle, block_host: bool = False) -> Any:
    """Wait for the collective and return its result (the output tensor, or
    a list for grouped calls); raise its error (MismatchError, ...). The wait
    runs signal handlers: Ctrl-C raises KeyboardInterrupt at once, and the
    collective then counts as dropped.

    CUDA tensors (the NCCL path): returns once the collective is enqueued on
    cring's stream, with the caller's current stream made to wait for it, as
    torch.distributed's work.wait() does: kernels queued afterwards see the
    result, and the host does not wait for the GPU. block_host=True also waits
    on this thread until the GPU has finished it (as Horovod's synchronize
    did); needed only to read the result from the host without a stream sync,
    or to time it."""
    if not handle._finished:
        handle._h.wait(block_host)
        if handle._finish is not None:
            handle._result = handle._finish(handle._h)
        handle._finished = True
    elif block_host:
        handle._h.wait(True)
    return handle._result


# cring.synchronize is _C.synchronize: the same steps in C for a cring.Handle (no
# Python frame: a tenth of an async allreduce's cost); the function above is its
# fallback for anything else.
_C.synchronize_fallback = synchronize
synchronize = _C.synchronize  # noqa: F811

# _C.allreduce_async_ (the C fast path for torch CUDA tensors) makes handles of this class
_C.handle_wrapper = Handle

_ASYNC, _CALLER_WAITS, _WAIT_HERE = 0, 1, 2  # _C.submit's caller_waits argument


def _submit(
    collective: int,
    name: str,
    pairs: list,
    finish: Callable[[Any], Any],
    *,
    op: Any = 0,
    root: int = 0,
    prescale: float = 1.0,
    postscale: float = 1.0,
    wire: Optional[str] = None,
    caller_waits: bool = False,
    stream: Optional[int] = None,
    process_set: int = 0,
) -> Handle:
    """Submit one request to the engine (NotInitializedError before init());
    the C submission binds and checks every argument once. `stream`: CUDA
    tensors on the NCCL path are exported for it and the submission records
    there the event the engine's CUDA backend waits for. `process_set`: the
    id of the set whose engine runs it (0: the global set)."""
    args = [
        collective,
        name,
        pairs,
        op,
        root,
        float(prescale),
        float(postscale),
        wire,
        _CALLER_WAITS if caller_waits else _ASYNC,
    ]
    if stream is not None or process_set:
        args += [None, stream, process_set]
    return Handle(_C.submit(*args), finish)

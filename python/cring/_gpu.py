"""CUDA tensors: what cring needs in Python beside the one collective path.

A CUDA tensor (DLPack device kDLCUDA) takes the route a CPU tensor takes:
cring._collectives builds the request, cring._C.submit reads the tensor through DLPack
(exported for the caller's stream) and queues it, and the engine negotiates
it by name like any other (any submission order, the response cache,
MismatchError on every rank, stall warnings, the timeline). The submission
records an event on the caller's stream; ready CUDA requests go to the
engine's CUDA backend (csrc/engine/exec_cuda.c), which runs them on cring's
own stream after those events, fused through a device buffer into few NCCL
calls; the handle completes once the work is enqueued, and synchronize()
makes the caller's stream wait on its completion event (cring._C, in C).
Nothing here takes part in that. A named torch CUDA tensor given to
cring.allreduce_ or allreduce_async_ does not even pass through Python.

What is here:
- finding NCCL and the CUDA runtime (loaded into the process's GPU context,
  which the engine's backend uses), and the availability queries;
- which stream a tensor's work is ordered on (use_stream, torch's or CuPy's
  current stream);
- float16/bfloat16 compression of CUDA tensors (a cast with torch around the
  allreduce), and the results of CUDA allgathers (device memory the handle
  owns, handed over through DLPack);
- the host-staged path (CRING_GPU_OPERATIONS=host): copies into pinned host
  buffers, submitted as CPU tensors through the submit function cring._collectives
  passes in, and copies back.

Imports only cring._C, cring._core and cring._tensors (never cring._collectives: no import
loop).
"""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any, Callable, Optional

import numpy as np

from . import _C
from ._core import CRingError
from ._tensors import dlpack_source, empty_like, producer_namespace

_gpu = _C.gpu
_DL_CUDA, _DL_CUDA_MANAGED = 2, 13
_CUDA_DEVICE_TYPES = (_DL_CUDA, _DL_CUDA_MANAGED)

_NCCL_WHEEL_FILES = ("nvidia/nccl/lib/libnccl.so.2",)
_CUDART_WHEEL_FILES = (
    "nvidia/cu13/lib/libcudart.so.13",  # nvidia-cuda-runtime 13.x
    "nvidia/cuda_runtime/lib/libcudart.so.12",  # nvidia-cuda-runtime-cu12
    "nvidia/cuda_runtime/lib/libcudart.so.11.0",
)
_INSTALL_NCCL = (
    "install NCCL with `pip install nvidia-nccl-cu12` (CUDA 12) or `pip install "
    "nvidia-nccl-cu13` (CUDA 13), or point CRING_NCCL_LIBRARY at libnccl.so.2; or set "
    "CRING_GPU_OPERATIONS=host to stage CUDA tensors through host memory and cring's CPU "
    "transports"
)
_INSTALL_CUDART = (
    "install the CUDA runtime with `pip install nvidia-cuda-runtime-cu12` (CUDA 12) or "
    "`pip install nvidia-cuda-runtime` (CUDA 13), or point CRING_CUDART_LIBRARY at "
    "libcudart.so"
)

_loaded: dict[str, tuple[bool, str, int]] = {}  # "nccl"/"cudart" -> (ok, path or error, version)


# ---- availability ----------------------------------------------------------------------------


def _wheel_paths(relative: Sequence[str]) -> list[str]:
    """Candidate library files inside pip wheels on the import path."""
    out: list[str] = []
    for entry in sys.path:
        base = entry or os.getcwd()
        if not os.path.isdir(base):
            continue
        for rel in relative:
            path = os.path.join(base, rel)
            if path not in out:
                out.append(path)
    return out


def _load(kind: str) -> tuple[bool, str, int]:
    """(loaded, path or why not, version); searched once per process."""
    found = _loaded.get(kind)
    if found is None:
        try:
            if kind == "nccl":
                path, version = _gpu.load_nccl(_wheel_paths(_NCCL_WHEEL_FILES))
            else:
                path, version = _gpu.load_cudart(_wheel_paths(_CUDART_WHEEL_FILES))
            found = (True, path, version)
        except CRingError as error:
            found = (False, str(error), 0)
        _loaded[kind] = found
    return found


def nccl_available() -> bool:
    """True when NCCL can be loaded: from CRING_NCCL_LIBRARY, a copy already
    loaded by the process (torch's), an nvidia-nccl-cu12/13 wheel on the import
    path, or the system's libnccl.so.2; version 2.10.3 or newer. Needs no GPU."""
    return _load("nccl")[0]


def cuda_available() -> bool:
    """True when the CUDA runtime loads (CRING_CUDART_LIBRARY, an
    already-loaded copy, an nvidia-cuda-runtime wheel or the system's) and
    reports at least one device."""
    return _load("cudart")[0] and _gpu.device_count()[0] > 0


def nccl_info() -> dict:
    """What nccl_available() found: {'available', 'path', 'version',
    'version_code', 'one_rank_guard', 'error'}. 'one_rank_guard' is True when
    this NCCL has the one-rank reduce defect (2.27.0 to 2.29.6: at one rank,
    ncclAvg and ncclPreMulSum leave the tail of a result unwritten), so cring
    never reduces through those at one rank (docs/gpu.md, "NCCL versions")."""
    ok, where, code = _load("nccl")
    version = None
    if ok:
        major, rest = (
            (code // 10000, code % 10000) if code >= 10000 else (code // 1000, code % 1000)
        )
        version = f"{major}.{rest // 100}.{rest % 100}"
    return {
        "available": ok,
        "path": where if ok else None,
        "version": version,
        "version_code": code or None,
        "one_rank_guard": bool(ok and _gpu.nccl_one_rank_defect(code)),
        "error": None if ok else where,
    }


def cuda_info() -> dict:
    """What cuda_available() found: {'available', 'path', 'runtime_version',
    'device_count', 'error'}."""
    ok, where, version = _load("cudart")
    count, why = _gpu.device_count() if ok else (0, where)
    return {
        "available": ok and count > 0,
        "path": where if ok else None,
        "runtime_version": version or None,
        "device_count": count,
        "error": None if ok and count > 0 else why,
    }


def _device_index(x: Any) -> int:
    try:
        return int(x.__dlpack_device__()[1])
    except Exception:  # noqa: BLE001  (only for a message)
        return 0


def _require_cudart(name: str) -> None:
    ok, why, _ = _load("cudart")
    if not ok:
        raise CRingError(
            f"tensor '{name}' is a CUDA tensor, and CUDA tensors need the CUDA "
            f"runtime, which could not be loaded: {why}; {_INSTALL_CUDART}"
        )


def _mode() -> str:
    value = os.environ.get("CRING_GPU_OPERATIONS", "").strip().lower() or "nccl"
    if value not in ("nccl", "host"):
        raise ValueError(f"CRING_GPU_OPERATIONS must be 'nccl' or 'host', got {value!r}")
    return value


# ---- routing helpers used by cring._api ----------------------------------------------------------


def is_cuda(x: Any) -> bool:
    """Whether x is a CUDA tensor (cheap for torch and NumPy)."""
    if type(x) is np.ndarray:
        return False
    flag = getattr(x, "is_cuda", None)  # torch
    if flag is not None:
        return flag is True
    device = getattr(x, "__dlpack_device__", None)
    if device is None:
        return False
    try:
        return int(device()[0]) in _CUDA_DEVICE_TYPES
    except Exception:  # noqa: BLE001  (a producer that cannot say is not a CUDA tensor)
        return False


def any_cuda(xs: Sequence[Any]) -> bool:
    for x in xs:
        if type(x) is not np.ndarray and is_cuda(x):
            return True
    return False


class MixedDevicesError(CRingError, ValueError):
    """One call mixes CUDA and other tensors. A CRingError (so a
    RuntimeError, which Horovod's users catch) and a ValueError (what cring
    raised before)."""


def host_staged(tensors: Sequence[Any], name: str) -> bool:
    """For a call with CUDA tensors: True when CRING_GPU_OPERATIONS=host (the
    host adapters below run it), False for the NCCL path. Raises ValueError for
    a call that mixes CUDA and other tensors (MixedDevicesError, also a
    RuntimeError), or a bad CRING_GPU_OPERATIONS."""
    cpu = [i for i, x in enumerate(tensors) if not is_cuda(x)]
    if cpu:
        raise MixedDevicesError(
            f"tensor '{name}': every tensor of one call must be on the same device, "
            f"but tensor(s) {cpu} of {len(tensors)} are not CUDA tensors"
        )
    return _mode() == "host"


def info(x: Any, name: str) -> tuple[tuple[int, ...], str]:
    """Shape and cring dtype name of a CUDA tensor, from its attributes (the
    submission reads the tensor itself through DLPack)."""
    try:
        return tuple(int(d) for d in x.shape), str(x.dtype).replace("torch.", "")
    except (AttributeError, TypeError):
        raise TypeError(
            f"tensor '{name}': a CUDA tensor of kind {type(x).__name__} needs "
            "`shape` and `dtype` for an out-of-place call"
        ) from None


def nccl_stream(tensors: Sequence[Any], name: str) -> int:
    """For the NCCL path: check that NCCL can run here (else CRingError saying
    what to install); return the cudaStream_t (an int) the call is ordered
    on, for cring._C.submit. (What NCCL cannot reduce exactly, the engine's
    CUDA backend stages through host memory: every dtype, op and scale factor
    the CPU path takes works.)"""
    for kind, hint, what in (
        ("nccl", _INSTALL_NCCL, "CUDA tensors go through NCCL"),
        ("cudart", _INSTALL_CUDART, "NCCL needs the CUDA runtime"),
    ):
        ok, why, _ = _load(kind)
        if not ok:
            raise CRingError(
                f"tensor '{name}' is on cuda:{_device_index(tensors[0])}: {what}, "
                f"which could not be loaded: {why}; {hint}"
            )
    return raw_stream(tensors[0])


# ---- streams ------------------------------------------------------------------------------------


@contextlib.contextmanager
def use_stream(stream: int) -> Iterator[None]:
    """Within this block, this thread's CUDA collectives are ordered after
    `stream` (a cudaStream_t as an int) instead of the framework's current
    stream, and synchronize() makes `stream` wait for them. Kept in C (per
    thread), so the C fast paths see it too."""
    previous = _gpu.set_thread_stream(int(stream))
    try:
        yield
    finally:
        _gpu.set_thread_stream(previous)


def raw_stream(x: Any) -> int:
    """The cudaStream_t the caller's work on x is ordered on: use_stream()'s,
    torch's or CuPy's current stream, else the legacy default stream (0)."""
    override = _gpu.thread_stream()
    if override is not None:
        return override
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        # the builtin behind torch.cuda.current_stream(x.device).cuda_stream,
        # without its several Python calls (a CUDA build of torch has it)
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        if raw is not None:
            return int(raw(x.device.index))
        return int(torch.cuda.current_stream(x.device).cuda_stream)
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(x, cupy.ndarray):
        return int(cupy.cuda.get_current_stream().ptr)
    return 0


def _dlpack_stream(raw: int) -> int:
    """DLPack spells the legacy default stream 1, since 0 is disallowed there."""
    return raw if raw != 0 else 1


def device_guard(x: Any) -> Any:
    """torch exports a CUDA tensor only while its device is current."""
    torch = sys.modules.get("torch")
    if (
        torch is not None
        and isinstance(x, torch.Tensor)
        and x.is_cuda
        and x.device.index != getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)()
    ):
        return torch.cuda.device(x.device.index)
    return contextlib.nullcontext()


# ---- results and compression on the NCCL path --------------------------------------------------


class _DeviceResult:
    """A CUDA allgather's result (a capsule owning its device memory)
    offered through DLPack, for a library's from_dlpack."""

    __slots__ = ("_capsule", "_device")

    def __init__(self, capsule: Any, device: int):
        self._capsule = capsule
        self._device = device

    def __dlpack__(
        self,
        *,
        stream: Any = None,
        max_version: Any = None,
        dl_device: Any = None,
        copy: Any = None,
    ) -> Any:
        # the consumer's stream already waits for the collective (Handle.wait)
        capsule, self._capsule = self._capsule, None
        return capsule

    def __dlpack_device__(self) -> tuple:
        return (_DL_CUDA, self._device)


def result_like(x: Any, handle: Any, index: int, shape: Sequence[int], dtype_name: str) -> Any:
    """Result `index` of a completed CUDA allgather as a tensor of x's kind,
    without a copy: the device memory moves from the handle into a DLPack
    export that owns it (the consumer's deleter frees it once the last view
    is gone). torch through torch.from_dlpack, other producers through
    their Array-API namespace's from_dlpack, or their module's (CuPy)."""
    shape = tuple(int(d) for d in shape)
    device = _device_index(x)
    if not all(shape):
        return empty_like(x, shape, dtype_name)
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return torch.from_dlpack(_gpu.output_capsule(handle, index, device, shape, dtype_name))
    xp = producer_namespace(x, "from_dlpack")
    if xp is None:
        raise TypeError(
            f"cannot make a CUDA result of kind {type(x).__name__}: neither an "
            "Array-API namespace nor its module has from_dlpack"
        )
    capsule = _gpu.output_capsule(handle, index, device, shape, dtype_name)
    return xp.from_dlpack(_DeviceResult(capsule, device))


def lent_rooms(tensors: Sequence[Any], infos: Sequence[tuple], parts: int) -> list:
    """Room for each CUDA allgather or alltoall result from the framework's
    allocator, lent to the engine with the request (docs/gpu.md, "Results"):
    for a torch tensor, torch.empty of `parts` x its rows on its device (an
    allgather: the world size; an alltoall: 1, the input's own size), so
    torch's caching allocator serves it on the current stream, the one the
    submission orders cring's stream after; a result that fits goes there.
    None (the engine's own memory) for other producers, empty tensors, and a
    use_stream() stream other than torch's."""
    torch = sys.modules.get("torch")
    rooms: list = []
    for x, (shape, _dtype) in zip(tensors, infos):
        room = None
        if (
            torch is not None
            and isinstance(x, torch.Tensor)
            and x.numel() > 0
            and _gpu.thread_stream() is None
        ):
            rows = int(shape[0]) if shape else 1
            room = torch.empty((parts * rows,) + tuple(shape[1:]), dtype=x.dtype, device=x.device)
        rooms.append(room)
    return rooms


def lent_result(
    x: Any, handle: Any, index: int, shape: Sequence[int], dtype_name: str, room: Any
) -> Any:
    """Result `index` of a completed CUDA allgather or alltoall: the lent room
    (its first shape[0] rows) when the engine put it there, else result_like's."""
    if room is not None and _gpu.output_pointer(handle, index) == room.data_ptr():
        rows = int(shape[0])
        return room if room.shape[0] == rows else room[:rows]
    return result_like(x, handle, index, shape, dtype_name)


def wire_dtype(tensors: Sequence[Any], wire: Optional[str]) -> Optional[Any]:
    """The torch dtype to cast float32 CUDA tensors to for compression, or None."""
    if wire is None:
        return None
    torch = sys.modules.get("torch")
    if torch is None or not all(isinstance(x, torch.Tensor) for x in tensors):
        raise NotImplementedError(
            "compression= on CUDA tensors needs torch tensors (cring casts "
            "them with torch); cast the tensors yourself instead"
        )
    return {"float16": torch.float16, "bfloat16": torch.bfloat16}[wire]


def compressed(
    tensors: list,
    in_place: bool,
    wire: Any,
    grouped: bool,
    reduce: Callable[[list], Any],
    wrap: Callable[[Any, Callable], Any],
    wait: Callable[[Any], Any],
) -> Any:
    """float32 CUDA tensors travel as float16/bfloat16: cast with torch,
    allreduce the casts in place (reduce(casts) -> handle), cast back at
    synchronize(). wrap(inner, finish) makes the caller's handle; wait(inner)
    synchronizes the inner one."""
    casts = [x.detach().to(wire) for x in tensors]
    inner = reduce(casts)
    outs = (
        list(tensors) if in_place else [empty_like(x, tuple(x.shape), "float32") for x in tensors]
    )

    def finish(h: Any) -> Any:
        for out, c in zip(outs, wait(inner)):
            out.detach().copy_(c)
        return outs if grouped else outs[0]

    return wrap(inner, finish)


# ---- the host-staged path -----------------------------------------------------------------------
# submit(collective, name, pairs, finish, **options) -> Handle is cring._core._submit,
# passed in by cring._collectives.


def _stage_in(tensors: list, name: str) -> tuple[list, int, int]:
    _require_cudart(name)
    raw = raw_stream(tensors[0])
    dl = _dlpack_stream(raw)
    staged = []
    for x in tensors:
        with device_guard(x):
            staged.append(_gpu.stage_in(dlpack_source(x), dl, raw, name))
    return staged, dl, raw


def _stage_out(pinned: Any, out: Any, dl: int, raw: int, name: str) -> None:
    with device_guard(out):
        _gpu.stage_out(pinned, dlpack_source(out), dl, raw, name)


def host_reduce_like(
    submit: Callable,
    collective: int,
    tensors: list,
    in_place: bool,
    name: str,
    grouped: bool,
    **options: Any,
) -> Any:
    """allreduce and broadcast: stage in, run in place on the pinned copies as
    CPU tensors, copy the results out at synchronize()."""
    staged, dl, raw = _stage_in(tensors, name)
    outs = (
        list(tensors)
        if in_place
        else [empty_like(x, s.shape, s.dtype) for x, s in zip(tensors, staged)]
    )
    hold = [staged]

    def finish(h: Any) -> Any:
        for s, out in zip(hold.pop(), outs):
            _stage_out(s, out, dl, raw, name)
        return outs if grouped else outs[0]

    return submit(collective, name, [(s, s) for s in staged], finish, **options)


def host_allgather(
    submit: Callable, tensors: list, name: str, grouped: bool, size: int, **options: Any
) -> Any:
    staged, dl, raw = _stage_in(tensors, name)

    def finish(h: Any) -> Any:
        outs = []
        for i, (x, s) in enumerate(zip(tensors, staged)):
            dims = _C.first_dims(h, i, size)
            shape = (sum(dims),) + tuple(s.shape[1:])
            pinned = _gpu.pinned(shape, s.dtype)
            h.copy_output(i, pinned)
            out = empty_like(x, shape, s.dtype)
            _stage_out(pinned, out, dl, raw, name)
            outs.append(out)
        staged.clear()
        return outs if grouped else outs[0]

    return submit(_C.ALLGATHER, name, [(s, None) for s in staged], finish, **options)


def host_reducescatter(
    submit: Callable, tensors: list, name: str, grouped: bool, size: int, rank: int, **options: Any
) -> Any:
    staged, dl, raw = _stage_in(tensors, name)
    pinned_outs = []
    for s in staged:
        if not s.shape:
            raise ValueError(f"tensor '{name}': reducescatter needs at least one dimension")
        n = s.shape[0]
        rows = n // size + (1 if rank < n % size else 0)
        pinned_outs.append(_gpu.pinned((rows,) + tuple(s.shape[1:]), s.dtype))

    def finish(h: Any) -> Any:
        outs = []
        for x, pinned in zip(tensors, pinned_outs):
            out = empty_like(x, pinned.shape, pinned.dtype)
            _stage_out(pinned, out, dl, raw, name)
            outs.append(out)
        staged.clear()
        return outs if grouped else outs[0]

    return submit(_C.REDUCESCATTER, name, list(zip(staged, pinned_outs)), finish, **options)


def host_alltoall(submit: Callable, tensor: Any, name: str, size: int) -> Any:
    """alltoall: stage in, run on the pinned copy as a CPU tensor
    (submit(pinned, finish) -> Handle), copy the received rows into a new
    tensor of the input's kind at synchronize(): (output, received_splits)."""
    (staged,), dl, raw = _stage_in([tensor], name)
    if not staged.shape:
        raise ValueError(f"tensor '{name}': alltoall needs at least one dimension")

    def finish(h: Any) -> Any:
        received = _C.first_dims(h, 0, size)
        shape = (sum(received),) + tuple(staged.shape[1:])
        pinned = _gpu.pinned(shape, staged.dtype)
        h.copy_output(0, pinned)
        out = empty_like(tensor, shape, staged.dtype)
        _stage_out(pinned, out, dl, raw, name)
        return out, received

    return submit(staged, finish)


def stats() -> dict:
    """Counters of the GPU layer: NCCL communicators created, groups and NCCL
    calls enqueued, bytes staged through host memory, pinned and device
    allocations, events recorded, stream waits, host waits (block_host) and
    copies into and out of fusion buffers."""
    return dict(_gpu.stats())


__all__ = ["nccl_available", "cuda_available", "nccl_info", "cuda_info", "use_stream", "stats"]

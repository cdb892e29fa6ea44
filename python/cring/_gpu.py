"""CUDA tensors: NCCL collectives on the caller's stream, or, with
CRING_GPU_OPERATIONS=host, a copy through pinned host memory to the CPU
collectives and back.

cring._api routes any call whose tensors are CUDA tensors (DLPack device
kDLCUDA) here; nothing here runs for CPU tensors. NCCL and the CUDA runtime are
loaded at first use (cring._C.gpu, csrc/gpu): building and importing cring
never need them.

How GPU collectives are ordered (the NCCL path): every rank must issue them in
the same order, as with torch.distributed; cring does not reorder them. Before
each call (a grouped call counts once) the ranks exchange a small descriptor
through the CPU engine under the call's name (collective, op, root, dtypes,
shapes, device slot, whether NCCL loaded): a disagreement raises
cring.MismatchError on every rank instead of corrupting memory or hanging
inside NCCL, and the descriptor carries what allgather needs (every rank's
first dimension). Then every tensor's NCCL call is enqueued on the caller's
stream inside one ncclGroupStart/ncclGroupEnd. Nothing waits for the device:
the handle is complete once the work is enqueued, and the result is ready for
any later work on that stream. At world size 1 the exchange is skipped.
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import threading
from typing import Any, Iterator, Optional, Sequence

import numpy as np

from . import _C, _api
from ._tensors import dlpack_source, empty_like

_gpu = _C.gpu
_DL_CUDA, _DL_CUDA_MANAGED = 2, 13
_CUDA_DEVICE_TYPES = (_DL_CUDA, _DL_CUDA_MANAGED)

_NCCL_WHEEL_FILES = ("nvidia/nccl/lib/libnccl.so.2",)
_CUDART_WHEEL_FILES = (
    "nvidia/cu13/lib/libcudart.so.13",          # nvidia-cuda-runtime 13.x
    "nvidia/cuda_runtime/lib/libcudart.so.12",  # nvidia-cuda-runtime-cu12
    "nvidia/cuda_runtime/lib/libcudart.so.11.0",
)
_INSTALL_NCCL = (
    "install NCCL with `pip install nvidia-nccl-cu12` (CUDA 12) or `pip install "
    "nvidia-nccl-cu13` (CUDA 13), or point CRING_NCCL_LIBRARY at libnccl.so.2; or set "
    "CRING_GPU_OPERATIONS=host to stage CUDA tensors through host memory and cring's CPU "
    "transports")
_INSTALL_CUDART = (
    "install the CUDA runtime with `pip install nvidia-cuda-runtime-cu12` (CUDA 12) or "
    "`pip install nvidia-cuda-runtime` (CUDA 13), or point CRING_CUDART_LIBRARY at "
    "libcudart.so")

_lock = threading.RLock()  # GPU collectives are issued one at a time, in call order
_loaded: dict[str, tuple[bool, str, int]] = {}  # "nccl"/"cudart" -> (ok, path or error, version)
_slots: dict[int, int] = {}  # CUDA device -> NCCL communicator slot (this init)
_thread = threading.local()

_DTYPE_CODES = {name: i for i, name in enumerate(
    ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "int32", "int64", "bool"))}
_FLOATING = frozenset(("float16", "bfloat16", "float32", "float64"))
_MAGIC = 0x63756461  # "cuda": marks a GPU call's descriptor


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
        except _C.CRingError as error:
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
    """What nccl_available() found: {'available', 'path', 'version', 'error'}."""
    ok, where, code = _load("nccl")
    version = None
    if ok:
        major, rest = (code // 10000, code % 10000) if code >= 10000 else (code // 1000, code % 1000)
        version = f"{major}.{rest // 100}.{rest % 100}"
    return {"available": ok, "path": where if ok else None, "version": version,
            "version_code": code or None, "error": None if ok else where}


def cuda_info() -> dict:
    """What cuda_available() found: {'available', 'path', 'runtime_version',
    'device_count', 'error'}."""
    ok, where, version = _load("cudart")
    count, why = _gpu.device_count() if ok else (0, where)
    return {"available": ok and count > 0, "path": where if ok else None,
            "runtime_version": version or None, "device_count": count,
            "error": None if ok and count > 0 else why}


def _require_cudart(name: str) -> None:
    ok, why, _ = _load("cudart")
    if not ok:
        raise _api.CRingError(f"tensor '{name}' is a CUDA tensor, and CUDA tensors need the CUDA "
                              f"runtime, which could not be loaded: {why}; {_INSTALL_CUDART}")


def _nccl_problem() -> Optional[str]:
    """None when the NCCL path can run here, else the message to raise."""
    ok, why, _ = _load("nccl")
    if not ok:
        return f"CUDA tensors go through NCCL, which could not be loaded: {why}; {_INSTALL_NCCL}"
    ok, why, _ = _load("cudart")
    if not ok:
        return (f"NCCL needs the CUDA runtime, which could not be loaded: {why}; "
                f"{_INSTALL_CUDART}")
    return None


def _raise_problem(name: str, device: int, problem: str) -> None:
    raise _api.CRingError(f"tensor '{name}' is on cuda:{device}: {problem}")


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


def _same_device(tensors: Sequence[Any], name: str) -> list:
    """The tensors of one call, all CUDA tensors (else a ValueError)."""
    tensors = list(tensors)
    cpu = [i for i, x in enumerate(tensors) if not is_cuda(x)]
    if cpu:
        raise ValueError(f"tensor '{name}': every tensor of one call must be on the same device, "
                         f"but tensor(s) {cpu} of {len(tensors)} are not CUDA tensors")
    return tensors


# ---- streams ------------------------------------------------------------------------------------

@contextlib.contextmanager
def use_stream(stream: int) -> Iterator[None]:
    """Within this block, this thread's CUDA collectives run on `stream` (a
    cudaStream_t as an int) instead of the framework's current stream."""
    previous = getattr(_thread, "stream", None)
    _thread.stream = int(stream)
    try:
        yield
    finally:
        _thread.stream = previous


def _raw_stream(x: Any) -> int:
    """The cudaStream_t the caller's work on x is ordered on: use_stream()'s,
    torch's or CuPy's current stream, else the legacy default stream (0)."""
    override = getattr(_thread, "stream", None)
    if override is not None:
        return override
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return int(torch.cuda.current_stream(x.device).cuda_stream)
    cupy = sys.modules.get("cupy")
    if cupy is not None and isinstance(x, cupy.ndarray):
        return int(cupy.cuda.get_current_stream().ptr)
    return 0


def _streams(x: Any) -> tuple[int, int]:
    """(the value to pass to __dlpack__(stream=...), the cudaStream_t to use).
    DLPack spells the legacy default stream 1, since 0 is disallowed there."""
    raw = _raw_stream(x)
    return (raw if raw != 0 else 1), raw


def _device_guard(x: Any) -> Any:
    """torch exports a CUDA tensor only while its device is current."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(x, torch.Tensor) and x.is_cuda and \
            x.device.index != torch.cuda.current_device():
        return torch.cuda.device(x.device.index)
    return contextlib.nullcontext()


def _order_after(raw_stream: int, outs: Sequence[Any]) -> None:
    """At synchronize(): make torch's current stream wait for the stream the
    collective ran on, when they differ (a stream wait, not a host wait)."""
    torch = sys.modules.get("torch")
    if torch is None or not outs or not isinstance(outs[0], torch.Tensor):
        return
    device = outs[0].device
    current = torch.cuda.current_stream(device)
    if int(current.cuda_stream) == raw_stream:
        return
    ran_on = (torch.cuda.default_stream(device) if raw_stream == 0
              else torch.cuda.ExternalStream(raw_stream, device=device))
    current.wait_stream(ran_on)


# ---- the request object behind a cring.Handle ---------------------------------------------------

class _Enqueued:
    """The raw handle of a GPU collective: complete once enqueued. wait()
    raises NCCL's asynchronous error, if any, and drops the tensor views."""

    __slots__ = ("name", "_slot", "_keep")

    def __init__(self, name: str, slot: Optional[int], keep: list):
        self.name = name
        self._slot = slot
        self._keep = keep

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        self._keep = None
        if self._slot is not None:
            _gpu.check(self._slot)


# ---- agreement ----------------------------------------------------------------------------------

def _describe(view: tuple) -> list[int]:
    """[dtype, ndim, rows, elements per row, shape hash] of a tensor view."""
    shape, dtype = view[4], view[5]
    rows = shape[0] if shape else 1
    row_elems = math.prod(shape[1:])
    return [_DTYPE_CODES[dtype], len(shape), rows, row_elems,
            hash(tuple(shape[1:])) & 0x7FFFFFFFFFFFFFFF]


def _agree(name: str, collective: int, op: int, root: int, scaled: bool, slot: int,
           views: list, ready: bool) -> list[list[int]]:
    """Exchange this call's descriptor with every rank (skipped at size 1) and
    check it: a disagreement raises MismatchError on every rank. Returns every
    rank's descriptor (rank 0's nonce is at index 8)."""
    # a fresh nonce names the store key of a new communicator's NCCL id
    nonce = int.from_bytes(os.urandom(8), "little") >> 2 if slot == _gpu.comm_count() else 0
    header = [_MAGIC, collective, op, root, len(views), slot, int(ready), int(scaled), nonce]
    if _api.size() == 1:
        return [header]
    mine = header + [v for view in views for v in _describe(view)]
    label = f"tensor '{name}'"
    try:
        everyone = _gpu.exchange(name, mine)
    except _api.MismatchError as error:  # a peer ran a CPU collective under this name
        raise _api.MismatchError(f"{label}: this rank passed CUDA tensors, but not every rank "
                                 f"did (or a rank called a different collective): {error}") \
            from None
    strangers = [r for r, d in enumerate(everyone) if len(d) < 9 or d[0] != _MAGIC]
    if strangers:
        raise _api.MismatchError(f"{label}: rank(s) {strangers} did not call a CUDA collective "
                                 "under this name (a CPU tensor, or a different call order)")
    unready = [r for r, d in enumerate(everyone) if not d[6]]
    if unready and ready:
        raise _api.CRingError(f"{label}: NCCL could not be loaded on rank(s) {unready} (see their "
                              f"error); every rank needs NCCL, or set CRING_GPU_OPERATIONS=host "
                              "on every rank")
    fields = (("collective", 1), ("op", 2), ("root rank", 3), ("number of tensors", 4),
              ("CUDA device slot", 5), ("scaling", 7))
    for what, i in fields:
        values = [d[i] for d in everyone]
        if len(set(values)) > 1:
            if what == "collective":
                names = {_C.ALLREDUCE: "allreduce", _C.BROADCAST: "broadcast",
                         _C.ALLGATHER: "allgather", _C.REDUCESCATTER: "reducescatter"}
                values = [names.get(v, v) for v in values]
            if what == "CUDA device slot":
                raise _api.MismatchError(
                    f"{label}: ranks disagree on when to start using a new CUDA device "
                    f"(communicator slots {values}); each rank should use one device")
            raise _api.MismatchError(f"{label}: ranks disagree on the {what}: " +
                                     ", ".join(f"rank {r} {v}" for r, v in enumerate(values)))
    gathers = collective == _C.ALLGATHER
    for t in range(len(views)):
        base = 9 + 5 * t
        parts = [d[base:base + 5] for d in everyone]
        dtypes = {p[0] for p in parts}
        shapes = {(p[1], p[3], p[4]) if gathers else (p[1], p[2], p[3], p[4]) for p in parts}
        if len(dtypes) > 1 or len(shapes) > 1:
            dtype_names = {v: k for k, v in _DTYPE_CODES.items()}
            detail = ", ".join(f"rank {r} {dtype_names.get(p[0], p[0])} with {p[2] * p[3]} "
                               f"elements in {p[2]} rows" for r, p in enumerate(parts))
            what = "dtype" if len(dtypes) > 1 else (
                "trailing dimensions" if gathers else "shape")
            where = f" (tensor {t} of the group)" if len(views) > 1 else ""
            raise _api.MismatchError(f"{label}{where}: ranks disagree on the {what}: {detail}")
    return everyone


# ---- the NCCL path ------------------------------------------------------------------------------

def _nccl_call(collective: int, name: str, tensors: list, *, in_place: bool, op: int = 0,
               root: int = 0, scale: float = 1.0, grouped: bool) -> _api.Handle:
    rank, size = _api.rank(), _api.size()
    dl_stream, raw_stream = _streams(tensors[0])
    problem = _nccl_problem()
    writable = in_place and not (collective == _C.BROADCAST and rank == root)
    with _device_guard(tensors[0]):
        views = [_gpu.view(dlpack_source(x), dl_stream, writable, name) for x in tensors]
    devices = sorted({v[3] for v in views})
    if len(devices) > 1:
        raise ValueError(f"tensor '{name}': every tensor of one call must be on the same CUDA "
                         f"device, got cuda:{devices}")
    device = devices[0]
    if problem is not None and size == 1:
        _raise_problem(name, device, problem)
    reduces = collective in (_C.ALLREDUCE, _C.REDUCESCATTER)
    for v in views:
        if reduces and v[5] == "bool":
            raise TypeError(f"tensor '{name}': op {_api.ReduceOp(op).name.lower()} cannot "
                            "reduce dtype bool")
        if scale != 1.0 and (v[5] not in _FLOATING or op not in (_api.Sum, _api.Average)):
            raise NotImplementedError(
                f"tensor '{name}': prescale_factor/postscale_factor on CUDA tensors apply to "
                f"Sum and Average of floating-point tensors, not {v[5]}")
    if collective == _C.REDUCESCATTER and any(len(v[4]) == 0 for v in views):
        raise ValueError(f"tensor '{name}': reducescatter needs at least one dimension")
    slot = _slots.get(device, len(_slots))
    everyone = _agree(name, collective, op, root, scale != 1.0, slot, views, problem is None)
    if problem is not None:
        _raise_problem(name, device, problem)
    if slot == _gpu.comm_count():
        key = f"cring/gpu/nccl/{everyone[0][8]:x}/{slot}"
        timeout_s = float(os.environ.get("CRING_TIMEOUT_SECONDS") or 600)
        _gpu.comm_create(slot, device, rank, size, key, timeout_s)
        _slots[device] = slot

    outs: list = []
    specs: list = []
    keep: list = [v[0] for v in views]
    for t, (x, v) in enumerate(zip(tensors, views)):
        shape, dtype = v[4], v[5]
        numel = math.prod(shape)
        rank_counts = None
        if collective == _C.ALLGATHER:
            rows = ([d[9 + 5 * t + 2] for d in everyone] if size > 1
                    else [shape[0] if shape else 1])
            row_elems = math.prod(shape[1:])
            rank_counts = [r * row_elems for r in rows]
            out_shape = (sum(rows),) + tuple(shape[1:])
        elif collective == _C.REDUCESCATTER:
            n = shape[0]
            rows = [n // size + (1 if r < n % size else 0) for r in range(size)]
            row_elems = math.prod(shape[1:])
            rank_counts = [r * row_elems for r in rows]
            out_shape = (rows[rank],) + tuple(shape[1:])
        else:
            out_shape = tuple(shape)
        if in_place and collective in (_C.ALLREDUCE, _C.BROADCAST):
            out, recv_ptr = x, v[1]
        else:
            out = empty_like(x, out_shape, dtype)
            with _device_guard(out):
                out_view = _gpu.view(dlpack_source(out), dl_stream, True, name)
            keep.append(out_view[0])
            recv_ptr = out_view[1]
        outs.append(out)
        specs.append((v[1], recv_ptr, dtype, numel, rank_counts))
    _gpu.collective(slot, collective, int(op), int(root), float(scale), raw_stream, name, specs)

    def finish(h: Any) -> Any:
        _order_after(raw_stream, outs)
        return outs if grouped else outs[0]

    return _api.Handle(_Enqueued(name, slot, keep), finish)


def _torch_wire(tensors: list, wire: Optional[str]) -> Optional[Any]:
    """The torch dtype to compress float32 CUDA tensors to, or None."""
    if wire is None:
        return None
    torch = sys.modules.get("torch")
    if torch is None or not all(isinstance(x, torch.Tensor) for x in tensors):
        raise NotImplementedError("compression= on CUDA tensors needs torch tensors (cring casts "
                                  "them with torch); cast the tensors yourself instead")
    return {"float16": torch.float16, "bfloat16": torch.bfloat16}[wire]


def _nccl_allreduce(tensors: list, in_place: bool, op: int, name: str, compression: Any,
                    scale: float, grouped: bool) -> _api.Handle:
    wire = None
    if compression is not None and compression is not _api.Compression.none:
        wires = {_api._wire(compression, str(getattr(x, "dtype", "")).replace("torch.", ""))
                 for x in tensors}
        wire = _torch_wire(tensors, wires.pop() if len(wires) == 1 else None)
    if wire is None:
        return _nccl_call(_C.ALLREDUCE, name, tensors, in_place=in_place, op=op, scale=scale,
                          grouped=grouped)
    # float32 travels as float16/bfloat16: cast with torch, reduce, cast back at synchronize().
    compressed = [x.detach().to(wire) for x in tensors]
    inner = _nccl_call(_C.ALLREDUCE, name, compressed, in_place=True, op=op, scale=scale,
                       grouped=True)
    outs = list(tensors) if in_place else [empty_like(x, tuple(x.shape), "float32")
                                           for x in tensors]

    def finish(h: Any) -> Any:
        reduced = _api.synchronize(inner)
        for out, c in zip(outs, reduced):
            out.detach().copy_(c)
        return outs if grouped else outs[0]

    return _api.Handle(inner._h, finish)


# ---- the host-staged path -----------------------------------------------------------------------

def _stage_in(tensors: list, name: str) -> tuple[list, int, int]:
    _require_cudart(name)
    dl_stream, raw_stream = _streams(tensors[0])
    staged = []
    for x in tensors:
        with _device_guard(x):
            staged.append(_gpu.stage_in(dlpack_source(x), dl_stream, raw_stream, name))
    return staged, dl_stream, raw_stream


def _stage_out(pinned: Any, out: Any, dl_stream: int, raw_stream: int, name: str) -> None:
    with _device_guard(out):
        _gpu.stage_out(pinned, dlpack_source(out), dl_stream, raw_stream, name)


def _host_reduce_like(collective: int, tensors: list, in_place: bool, name: str, grouped: bool,
                      caller_waits: bool, **submit: Any) -> _api.Handle:
    """allreduce and broadcast: stage in, run in place on the pinned copies
    through the engine, copy the results out at synchronize()."""
    staged, dl_stream, raw_stream = _stage_in(tensors, name)
    outs = list(tensors) if in_place else [empty_like(x, s.shape, s.dtype)
                                           for x, s in zip(tensors, staged)]
    hold = [staged]

    def finish(h: Any) -> Any:
        for s, out in zip(hold.pop(), outs):
            _stage_out(s, out, dl_stream, raw_stream, name)
        return outs if grouped else outs[0]

    return _api._submit(collective, name, [(s, s) for s in staged], finish,
                        caller_waits=caller_waits, **submit)


def _host_allreduce(tensors: list, in_place: bool, op: int, name: str, compression: Any,
                    prescale: float, postscale: float, grouped: bool,
                    caller_waits: bool) -> _api.Handle:
    staged_dtypes = set()
    for x in tensors:
        dtype = str(getattr(x, "dtype", "")).replace("torch.", "")
        staged_dtypes.add(_api._wire(compression, dtype))
    wire = staged_dtypes.pop() if len(staged_dtypes) == 1 else None
    return _host_reduce_like(_C.ALLREDUCE, tensors, in_place, name, grouped, caller_waits,
                             op=op, prescale=prescale, postscale=postscale, wire=wire)


def _host_allgather(tensors: list, name: str, grouped: bool, caller_waits: bool) -> _api.Handle:
    staged, dl_stream, raw_stream = _stage_in(tensors, name)
    size = _api.size()

    def finish(h: Any) -> Any:
        outs = []
        for i, (x, s) in enumerate(zip(tensors, staged)):
            dims = _C.first_dims(h, i, size)
            shape = (sum(dims),) + tuple(s.shape[1:])
            pinned = _gpu.pinned(shape, s.dtype)
            h.copy_output(i, pinned)
            out = empty_like(x, shape, s.dtype)
            _stage_out(pinned, out, dl_stream, raw_stream, name)
            outs.append(out)
        staged.clear()
        return outs if grouped else outs[0]

    return _api._submit(_C.ALLGATHER, name, [(s, None) for s in staged], finish,
                        caller_waits=caller_waits)


def _host_reducescatter(tensors: list, op: int, name: str, grouped: bool, prescale: float,
                        postscale: float, caller_waits: bool) -> _api.Handle:
    staged, dl_stream, raw_stream = _stage_in(tensors, name)
    p, r = _api.size(), _api.rank()
    pinned_outs = []
    for s in staged:
        if not s.shape:
            raise ValueError(f"tensor '{name}': reducescatter needs at least one dimension")
        n = s.shape[0]
        rows = n // p + (1 if r < n % p else 0)
        pinned_outs.append(_gpu.pinned((rows,) + tuple(s.shape[1:]), s.dtype))

    def finish(h: Any) -> Any:
        outs = []
        for x, pinned in zip(tensors, pinned_outs):
            out = empty_like(x, pinned.shape, pinned.dtype)
            _stage_out(pinned, out, dl_stream, raw_stream, name)
            outs.append(out)
        staged.clear()
        return outs if grouped else outs[0]

    return _api._submit(_C.REDUCESCATTER, name, list(zip(staged, pinned_outs)), finish, op=op,
                        prescale=prescale, postscale=postscale, caller_waits=caller_waits)


# ---- entry points (called by cring._api for CUDA tensors) ---------------------------------------

def allreduce_async(tensors: list, in_place: bool, op: Any, name: str, compression: Any,
                    prescale_factor: float, postscale_factor: float, grouped: bool,
                    caller_waits: bool) -> _api.Handle:
    _api._require_init()
    op = _api._op(op)
    tensors = _same_device(tensors, name)
    with _lock:
        if _mode() == "host":
            return _host_allreduce(list(tensors), in_place, op, name, compression,
                                   prescale_factor, postscale_factor, grouped, caller_waits)
        scale = float(prescale_factor) * float(postscale_factor)
        return _nccl_allreduce(list(tensors), in_place, op, name, compression, scale, grouped)


def broadcast_async(tensor: Any, root: int, name: str, in_place: bool,
                    caller_waits: bool) -> _api.Handle:
    _api._require_init()
    with _lock:
        if _mode() == "host":
            return _host_reduce_like(_C.BROADCAST, [tensor], in_place, name, False,
                                     caller_waits, root=root)
        return _nccl_call(_C.BROADCAST, name, [tensor], in_place=in_place, root=root,
                          grouped=False)


def allgather_async(tensors: list, name: str, grouped: bool, caller_waits: bool) -> _api.Handle:
    _api._require_init()
    tensors = _same_device(tensors, name)
    with _lock:
        if _mode() == "host":
            return _host_allgather(list(tensors), name, grouped, caller_waits)
        return _nccl_call(_C.ALLGATHER, name, list(tensors), in_place=False, grouped=grouped)


def reducescatter_async(tensors: list, op: Any, name: str, grouped: bool, prescale_factor: float,
                        postscale_factor: float, caller_waits: bool) -> _api.Handle:
    _api._require_init()
    op = _api._op(op)
    tensors = _same_device(tensors, name)
    with _lock:
        if _mode() == "host":
            return _host_reducescatter(list(tensors), op, name, grouped, prescale_factor,
                                       postscale_factor, caller_waits)
        scale = float(prescale_factor) * float(postscale_factor)
        return _nccl_call(_C.REDUCESCATTER, name, list(tensors), in_place=False, op=op,
                          scale=scale, grouped=grouped)


def shutdown() -> None:
    """Destroy this init's NCCL communicators (called by cring.shutdown())."""
    with _lock:
        _slots.clear()
        if _loaded.get("nccl", (False,))[0]:
            _gpu.comms_destroy()


def stats() -> dict:
    """Counters of the GPU layer: NCCL communicators created, groups and NCCL
    calls enqueued, bytes staged through host memory, pinned allocations."""
    return dict(_gpu.stats())


__all__ = ["nccl_available", "cuda_available", "nccl_info", "cuda_info", "use_stream", "stats"]

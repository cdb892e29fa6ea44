"""Stand-ins for a CUDA framework on a machine without a GPU, for the CPU
tests of cring's GPU path against the test doubles libfake_nccl.so and
libfake_cudart.so (csrc/tests/fake_*.c), whose "device memory" is host memory
and whose streams run their work late, as a GPU's do.

- CachingAllocator: torch's CUDA caching allocator, as far as ordering goes.
  A block belongs to the stream it was allocated on; freed, it serves the
  next allocation on that stream at once (work queued on that stream later
  runs after all earlier work there, so this is safe for that stream only);
  a block used on other streams (record_stream) is kept from reuse until
  those streams have run the work they had queued when it was freed (an
  event on each, as torch records). Blocks are never given back to the
  process: a late write by the device never lands in memory the host reuses.
- FakeCudaTensor: a DLPack producer that claims a CUDA device (kDLCUDA) while
  its memory comes from that allocator, with a framework's stream rules:
  made, read (`.array`) and written from the host only after its current
  stream has run what it had queued (as torch's copies and .cpu() wait);
  exports hold the tensor's memory until the consumer's deleter runs (as
  torch's do); exporting for another stream makes that stream wait for the
  current one (the DLPack protocol). Its current stream is the one cring
  orders CUDA work of other libraries on: cring._gpu.use_stream()'s, else
  the legacy default stream.

Each export records the `stream` it was asked for, so tests can check that
cring passes the caller's stream to __dlpack__. Used by the CPU tests of the
GPU path (tests/test_gpu_*.py and their workers); never with a real GPU.
"""

from __future__ import annotations

import atexit
import ctypes
import os
import threading
import weakref
from typing import Any, Optional

import numpy as np

KDL_CUDA = 2


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    _fields_ = [
        ("dl_tensor", _DLTensor),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
    ]


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
_capsule_pointer = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_pointer.restype = ctypes.c_void_p
_capsule_pointer.argtypes = [ctypes.py_object, ctypes.c_char_p]

_capsule_set_name = ctypes.pythonapi.PyCapsule_SetName
_capsule_set_name.restype = ctypes.c_int
_capsule_set_name.argtypes = [ctypes.py_object, ctypes.c_char_p]
_DELETER = ctypes.CFUNCTYPE(None, ctypes.c_void_p)

_CODES = {"i": 0, "u": 1, "f": 2, "b": 6}
_KINDS = {0: "i", 1: "u", 2: "f"}

# ---- the fake runtime's hooks for frameworks (fake_cudart.c; never logged) ------------------

_runtime: Any = None
_runtime_lock = threading.Lock()


def runtime() -> Optional[Any]:
    """The fake CUDA runtime cring loads (the same copy: CRING_CUDART_LIBRARY),
    or None when there is none (then nothing runs late and nothing waits)."""
    global _runtime
    with _runtime_lock:
        if _runtime is None:
            path = os.environ.get("CRING_CUDART_LIBRARY", "")
            lib = False
            try:
                lib = ctypes.CDLL(path) if path else False
                lib.fake_cuda_drain  # noqa: B018  (the fake, not a real runtime)
            except (OSError, AttributeError):
                lib = False
            if lib:
                lib.fake_cuda_drain.argtypes = [ctypes.c_void_p]
                lib.fake_cuda_drain.restype = None
                lib.fake_cuda_order.argtypes = [ctypes.c_void_p, ctypes.c_void_p]
                lib.fake_cuda_mark.argtypes = [ctypes.c_void_p]
                lib.fake_cuda_mark.restype = ctypes.c_void_p
                lib.fake_cuda_reached.argtypes = [ctypes.c_void_p]
                lib.fake_cuda_unmark.argtypes = [ctypes.c_void_p]
                lib.fake_cuda_unmark.restype = None
                lib.fake_cuda_created_stream.argtypes = [ctypes.c_int]
                lib.fake_cuda_created_stream.restype = ctypes.c_ulong
                lib.fake_cuda_kernel.argtypes = [
                    ctypes.c_void_p,
                    ctypes.c_void_p,
                    ctypes.c_int,
                    ctypes.c_size_t,
                    ctypes.c_uint,
                ]
            _runtime = lib
        return _runtime or None


def drain(stream: int) -> None:
    """The host waits until `stream` has run what it had queued."""
    lib = runtime()
    if lib:
        lib.fake_cuda_drain(stream)


def order(waiter: int, waited: int) -> None:
    """`waiter`'s later work runs after what `waited` has queued so far."""
    lib = runtime()
    if lib and waiter != waited:
        lib.fake_cuda_order(waiter, waited)


def kernel(stream: int, ptr: int = 0, value: int = 0, nbytes: int = 0, delay_us: int = 0) -> None:
    """A framework's kernel on `stream`: after delay_us, `value` written over
    nbytes bytes at ptr (nbytes 0: it only takes the time)."""
    lib = runtime()
    if lib:
        lib.fake_cuda_kernel(stream, ptr or None, value, nbytes, delay_us)
    elif nbytes:
        ctypes.memset(ptr, value, nbytes)


def created_stream(k: int = 0) -> int:
    """The k-th stream created with cudaStreamCreateWithFlags in this
    process (0 when none): cring's own stream is the first."""
    lib = runtime()
    return int(lib.fake_cuda_created_stream(k)) if lib else 0


def busy(stream: int, delay_us: int) -> None:
    """`stream` is busy for delay_us with work queued before what comes next
    (a GPU still running earlier kernels there)."""
    kernel(stream, 0, 0, 0, delay_us)


def current_stream() -> int:
    """The stream cring orders a non-framework CUDA tensor's work on: this
    thread's cring._gpu.use_stream() stream, else the legacy default (0)."""
    try:
        from cring import _C

        s = _C.gpu.thread_stream()
    except ImportError:
        s = None
    return 0 if s is None else int(s)


def _dlpack_to_stream(stream: Any) -> Optional[int]:
    """The cudaStream_t a DLPack consumer named (1: the legacy default stream;
    None or -1: no synchronisation asked)."""
    if stream is None or stream == -1:
        return None
    return 0 if int(stream) == 1 else int(stream)


# ---- the caching allocator -----------------------------------------------------------------

_libc = ctypes.CDLL(None)
_libc.malloc.restype = ctypes.c_void_p
_libc.malloc.argtypes = [ctypes.c_size_t]


class _Block:
    __slots__ = ("ptr", "capacity", "stream", "uses")

    def __init__(self, ptr: int, capacity: int, stream: int):
        self.ptr, self.capacity, self.stream = ptr, capacity, stream
        self.uses: set = set()  # streams recorded (record_stream) while allocated


class CachingAllocator:
    """Blocks of "device memory" handed out and taken back as torch's CUDA
    caching allocator does (see the top of the file). Thread-safe."""

    MIN_BLOCK = 512

    def __init__(self) -> None:
        self._free: dict = {}  # stream -> [blocks], the most recently freed last
        self._pending: list = []  # (block, [marks]) freed while other streams used it
        self._lock = threading.Lock()
        self.reused = 0  # allocations served by a freed block

    def allocate(self, nbytes: int, stream: int) -> _Block:
        need = max(self.MIN_BLOCK, (nbytes + self.MIN_BLOCK - 1) // self.MIN_BLOCK * self.MIN_BLOCK)
        with self._lock:
            self._process_pending()
            pool = self._free.get(stream, [])
            for i in range(len(pool) - 1, -1, -1):
                if need <= pool[i].capacity <= 2 * need:
                    self.reused += 1
                    return pool.pop(i)
        raw = _libc.malloc(need + 256)
        if not raw:
            raise MemoryError(f"fake CUDA allocator: {need} bytes")
        block = _Block((raw + 255) // 256 * 256, need, stream)
        ctypes.memset(block.ptr, 0xA5, need)  # never written shows
        return block

    def record_stream(self, block: _Block, stream: int) -> None:
        if stream != block.stream:
            with self._lock:
                block.uses.add(stream)

    def free(self, block: _Block) -> None:
        with self._lock:
            if not block.uses:
                self._free.setdefault(block.stream, []).append(block)
                return
            lib = runtime()
            marks = [lib.fake_cuda_mark(s) for s in block.uses] if lib else []
            block.uses = set()
            self._pending.append((block, marks))

    def _process_pending(self) -> None:
        lib = runtime()
        still = []
        for block, marks in self._pending:
            if lib and not all(lib.fake_cuda_reached(m) for m in marks if m):
                still.append((block, marks))
                continue
            for m in marks:
                if m and lib:
                    lib.fake_cuda_unmark(m)
            self._free.setdefault(block.stream, []).append(block)
        self._pending = still


ALLOCATOR = CachingAllocator()


class _Memory:
    """One allocation: its block, viewed as bytes through the array
    interface (every NumPy view of it has this object as its base); the
    block goes back to the allocator when the last view, tensor and export
    is gone."""

    def __init__(self, nbytes: int, stream: int):
        self.block = ALLOCATOR.allocate(nbytes, stream)
        self.__array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (self.block.ptr, False),
            "version": 3,
        }
        weakref.finalize(self, ALLOCATOR.free, self.block)
        _live_memory[self.block.ptr] = self


def device_array(shape: Any, dtype: Any, stream: int) -> np.ndarray:
    """An uninitialised array of "device memory" from the allocator, on stream."""
    dtype = np.dtype(dtype)
    shape = tuple(int(d) for d in shape) if isinstance(shape, (tuple, list)) else (int(shape),)
    n = int(np.prod(shape)) * dtype.itemsize
    mem = _Memory(n, stream)
    return np.asarray(mem)[:n].view(dtype).reshape(shape)


_live_memory: weakref.WeakValueDictionary = weakref.WeakValueDictionary()  # block ptr -> _Memory


def memory_at(ptr: int) -> Optional[_Memory]:
    """The live allocation holding address ptr, or None (another owner's)."""
    for mem in list(_live_memory.values()):
        if mem.block.ptr <= ptr < mem.block.ptr + max(mem.block.capacity, 1):
            return mem
    return None


def memory_of(a: np.ndarray) -> Optional[_Memory]:
    """The allocation an array views, or None (memory of another owner)."""
    return memory_at(a.ctypes.data)


# ---- DLPack exports that hold their memory ---------------------------------------------------

_live_exports: dict = {}  # manager_ctx -> (shape, managed, what keeps the memory)
_next_export = [1]


@_DELETER
def _export_deleter(managed: int) -> None:
    key = _DLManagedTensor.from_address(managed).manager_ctx
    _live_exports.pop(key, None)


@atexit.register
def _forget_deleters() -> None:
    """Exports still held when Python exits (by a cring that is finalised
    later) must not call back into Python: their deleters go."""
    for _shape, managed, _keep in _live_exports.values():
        managed.deleter = None


def dl_dtype(dtype: np.dtype) -> tuple:
    """DLPack's (code, bits) of a NumPy dtype."""
    return (_CODES[dtype.kind], dtype.itemsize * 8)


def export(a: np.ndarray, device: int, keep: Any) -> Any:
    """A "dltensor" capsule of a's memory as kDLCUDA `device`, holding `keep`
    (what keeps the memory alive) until the consumer's deleter runs."""
    return export_memory(a.ctypes.data, a.shape, dl_dtype(a.dtype), device, keep)


def export_memory(ptr: int, shape: tuple, dtype: tuple, device: int, keep: Any) -> Any:
    """export() of contiguous memory at ptr: shape, DLPack (code, bits)."""
    dims = (ctypes.c_int64 * max(len(shape), 1))(*shape)
    managed = _DLManagedTensor()
    t = managed.dl_tensor
    t.data = ptr
    t.device = _DLDevice(KDL_CUDA, device)
    t.ndim = len(shape)
    t.dtype = _DLDataType(dtype[0], dtype[1], 1)
    t.shape = dims
    t.strides = None
    t.byte_offset = 0
    key = _next_export[0]
    _next_export[0] += 1
    managed.manager_ctx = key
    managed.deleter = ctypes.cast(_export_deleter, ctypes.c_void_p)
    _live_exports[key] = (dims, managed, keep)
    return _capsule_new(ctypes.addressof(managed), b"dltensor", None)


class _Namespace:
    """Just enough of an Array-API namespace for cring to make outputs and to
    take results it hands over through DLPack (engine-owned "device" memory)."""

    @staticmethod
    def empty(shape: Any, dtype: Any = None, device: Any = None) -> FakeCudaTensor:
        return FakeCudaTensor.empty(shape, dtype, device=device or 0)

    @staticmethod
    def from_dlpack(x: Any) -> FakeCudaTensor:
        return consume(x, FakeCudaTensor)


def consume(x: Any, kind: Any) -> Any:
    """What a DLPack consumer does with x's export: take the capsule (renamed
    "used_dltensor", so only the consumer calls the deleter), view the memory
    without a copy, and call the producer's deleter once the last view of it
    is gone, as CuPy and torch do; the views, not the returned object, keep
    the memory alive. Returns kind(array, device=..., wrap=True)."""
    device_type, device = x.__dlpack_device__()
    assert device_type == KDL_CUDA, device_type
    return kind(consume_capsule(x.__dlpack__()), device=device, wrap=True)


def consume_capsule(capsule: Any, raw: bool = False) -> Any:
    """A NumPy view of a consumed "dltensor" capsule's memory (see consume);
    with raw, (its bytes as uint8, shape, DLPack (code, bits)), for dtypes
    NumPy lacks (bfloat16)."""
    address = _capsule_pointer(capsule, b"dltensor")
    if _capsule_set_name(capsule, b"used_dltensor") != 0:
        raise RuntimeError("cannot rename the DLPack capsule")
    t = _DLManagedTensor.from_address(address).dl_tensor
    shape = tuple(t.shape[i] for i in range(t.ndim))
    if raw:
        nbytes = int(np.prod(shape)) * t.dtype.bits // 8
        view = _Export(address, t.data + t.byte_offset, (nbytes,), np.dtype(np.uint8))
        return np.asarray(view), shape, (t.dtype.code, t.dtype.bits)
    dtype = (
        np.dtype(np.bool_)
        if t.dtype.code == 6
        else np.dtype(f"{_KINDS[t.dtype.code]}{t.dtype.bits // 8}")
    )
    return np.asarray(_Export(address, t.data + t.byte_offset, shape, dtype))


class _Export:
    """The consumer's hold on one DLPack export: its memory through the
    array interface (every NumPy view has this object as its base), and the
    producer's deleter called when the last view goes."""

    def __init__(self, managed: int, data: int, shape: tuple, dtype: np.dtype):
        self.__array_interface__ = {
            "shape": shape,
            "typestr": dtype.str,
            "data": (data, False),
            "version": 3,
        }
        weakref.finalize(self, _delete, managed)


def _delete(managed: int) -> None:
    deleter = _DLManagedTensor.from_address(managed).deleter
    if deleter:
        _DELETER(deleter)(managed)


class FakeCudaTensor:
    """A "CUDA" tensor whose memory comes from the caching allocator (a copy
    of `array`, made on the current stream), or, with wrap=True, `array`'s
    own memory (a view of memory another owner keeps: an engine result taken
    through DLPack, a stand-in torch tensor's). See the top of the file."""

    streams_seen: list = []  # (label, stream) for every export, in order

    def __init__(
        self, array: Any, device: int = 0, label: Optional[str] = None, *, wrap: bool = False
    ):
        self.device = int(device)
        self.label = label
        if wrap:
            self._array = array
        else:
            a = np.ascontiguousarray(array)
            stream = current_stream()
            self._array = device_array(a.shape, a.dtype, stream)
            drain(stream)  # the copy in is ordered on the current stream
            np.copyto(self._array, a)

    @classmethod
    def empty(cls, shape: Any, dtype: Any, device: int = 0, **kw: Any) -> FakeCudaTensor:
        """An uninitialised tensor from the allocator, on the current stream."""
        return cls(device_array(shape, dtype, current_stream()), device=device, wrap=True, **kw)

    @property
    def array(self) -> np.ndarray:
        """The memory as a NumPy array, for the host to read or write once
        the current stream has run what it had queued (as torch's .cpu())."""
        drain(current_stream())
        return self._array

    @property
    def dtype(self) -> np.dtype:
        return self._array.dtype

    @property
    def shape(self) -> tuple:
        return self._array.shape

    @property
    def nbytes(self) -> int:
        return self._array.nbytes

    def data_ptr(self) -> int:
        return self._array.ctypes.data

    def record_stream(self, stream: int) -> None:
        """torch.Tensor.record_stream: the memory is not reused after this
        tensor is freed until `stream` has run the work it had queued then."""
        mem = memory_of(self._array)
        if mem is not None:
            ALLOCATOR.record_stream(mem.block, int(stream))

    def __dlpack_device__(self) -> tuple:
        return (KDL_CUDA, self.device)

    def __array_namespace__(self, api_version: Any = None) -> _Namespace:
        return _Namespace()

    def __dlpack__(
        self,
        *,
        stream: Any = None,
        max_version: Any = None,
        dl_device: Any = None,
        copy: Any = None,
    ) -> Any:
        FakeCudaTensor.streams_seen.append((self.label, stream))
        consumer = _dlpack_to_stream(stream)
        if consumer is not None:
            order(consumer, current_stream())
        return export(self._array, self.device, self._array)

    def __repr__(self) -> str:
        return f"FakeCudaTensor(cuda:{self.device}, {self._array!r})"

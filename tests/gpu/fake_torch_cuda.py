"""torch without CUDA, dressed as a CUDA build for cring's CPU tests against
the test doubles (csrc/tests/fake_*.c): install() makes every tensor say
is_cuda and export its memory as kDLCUDA (torch._C._to_dlpack_versioned and
Tensor.__dlpack__, holding the tensor until the consumer's deleter runs, as
torch's export does), gives torch a current stream (0x4242 unless `stream()`
says otherwise) that cring reads through torch._C._cuda_getCurrentRawStream,
and takes the engine's device results through torch.from_dlpack.

"CUDA" tensors made with cuda(t), torch.empty and Tensor.new_empty live in
the caching allocator's memory (tests/gpu/fake_cuda.py: a freed block serves
the next allocation on its stream at once; Tensor.record_stream keeps it
from reuse until the recorded stream has run what it had queued), and every
torch function that reads or writes tensor data runs once the current stream
has run what it had queued (a torch function mode; metadata and views run at
once): what a kernel queued on that stream would see. So a
tensor cring still uses on its own stream, freed and handed out again, shows
as wrong values, as on a GPU. Never used with a real GPU.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.overrides import TorchFunctionMode

import fake_cuda as fc

_current = [0x4242]
_torch_empty = torch.empty  # torch's own, before install() replaces it
# DLPack's (code, bits) of torch's dtypes
_DL = {
    torch.float16: (2, 16),
    torch.float32: (2, 32),
    torch.float64: (2, 64),
    torch.bfloat16: (4, 16),
    torch.int8: (0, 8),
    torch.int16: (0, 16),
    torch.int32: (0, 32),
    torch.int64: (0, 64),
    torch.uint8: (1, 8),
    torch.bool: (6, 8),
}
_FROM_DL = {v: k for k, v in _DL.items()}


def current_stream() -> int:
    """torch's current stream in the stand-in (a cudaStream_t as an int)."""
    return _current[0]


@contextlib.contextmanager
def stream(s: int) -> Iterator[None]:
    """torch.cuda.stream(s): `s` is the current stream within the block."""
    previous = _current[0]
    _current[0] = int(s)
    try:
        yield
    finally:
        _current[0] = previous


def empty(shape: Any, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An uninitialised "CUDA" tensor from the caching allocator, allocated
    on the current stream."""
    shape = tuple(shape) if isinstance(shape, (tuple, list, torch.Size)) else (int(shape),)
    with torch._C.DisableTorchFunction():  # the stand-in's own calls: no stream order
        nbytes = int(np.prod(shape)) * _torch_empty(0, dtype=dtype).element_size()
        raw = fc.device_array((nbytes,), np.uint8, current_stream())
        return torch.from_numpy(raw).view(dtype).reshape(shape)


def cuda(t: torch.Tensor) -> torch.Tensor:
    """A "CUDA" copy of a CPU tensor, made on the current stream."""
    out = empty(t.shape, t.dtype)
    fc.drain(current_stream())
    with torch.no_grad():
        out.copy_(t)
    return out


def record_stream(t: torch.Tensor, s: Any) -> None:
    """Tensor.record_stream(s) for tensors in the allocator's memory (s: a
    stream object with .cuda_stream, or a cudaStream_t)."""
    with torch._C.DisableTorchFunction():
        mem = fc.memory_at(t.data_ptr())
    if mem is not None:
        fc.ALLOCATOR.record_stream(mem.block, int(getattr(s, "cuda_stream", s)))


# torch functions that touch no tensor data (metadata, views): they run at
# once, as on a GPU; every other one runs once the current stream is drained
_METADATA = frozenset(
    "__get__ __set__ is_contiguous view view_as reshape detach numel dim size stride "
    "element_size data_ptr storage_offset untyped_storage __len__ __dlpack_device__ "
    "__dlpack__ record_stream new_empty".split()
)


class _StreamOrdered(TorchFunctionMode):
    """A torch function that reads or writes tensor data (a kernel, or a
    read to the host) runs after what the current stream had queued."""

    def __torch_function__(self, func: Any, types_: Any, args: tuple = (), kwargs: Any = None):
        if getattr(func, "__name__", "") not in _METADATA:
            fc.drain(current_stream())
        return func(*args, **(kwargs or {}))


def _export(t: torch.Tensor, *, stream: Any = None, **kw: Any) -> Any:
    consumer = fc._dlpack_to_stream(stream)
    if consumer is not None:
        fc.order(consumer, current_stream())
    with torch._C.DisableTorchFunction():
        if not t.is_contiguous():
            raise BufferError("the stand-in exports contiguous tensors only")
        return fc.export_memory(t.data_ptr(), tuple(t.shape), _DL[t.dtype], 0, keep=t)


def _from_dlpack(x: Any) -> torch.Tensor:
    capsule = x.__dlpack__() if hasattr(x, "__dlpack__") else x
    raw, shape, dl = fc.consume_capsule(capsule, raw=True)
    with torch._C.DisableTorchFunction():
        return torch.from_numpy(raw).view(_FROM_DL[dl]).reshape(shape)


_mode: list = []


def install() -> None:
    """Dress torch as a CUDA build (see the top of the file); once."""
    if _mode:
        return

    def empty_(*shape: Any, dtype: Any = None, device: Any = None, **kw: Any) -> torch.Tensor:
        if len(shape) == 1 and isinstance(shape[0], (tuple, list, torch.Size)):
            shape = tuple(shape[0])
        return empty(shape, dtype or torch.float32)

    torch.Tensor.is_cuda = property(lambda self: True)
    torch.Tensor.__dlpack__ = _export
    torch.Tensor.__dlpack_device__ = lambda self: (fc.KDL_CUDA, 0)
    torch.Tensor.new_empty = lambda self, shape, **kw: empty(shape, kw.get("dtype") or self.dtype)
    torch.Tensor.record_stream = record_stream
    torch._C._to_dlpack_versioned = _export
    torch._C._cuda_getCurrentRawStream = lambda index: current_stream()
    torch.cuda.current_stream = lambda device=None: types.SimpleNamespace(
        cuda_stream=current_stream()
    )
    torch.cuda.current_device = lambda: None  # a CPU tensor's device index: no guard
    torch.from_dlpack = _from_dlpack
    torch.empty = empty_
    mode = _StreamOrdered()
    mode.__enter__()
    _mode.append(mode)


__all__ = ["install", "cuda", "empty", "stream", "current_stream", "record_stream"]

"""A DLPack producer that claims to live on a CUDA device (kDLCUDA) while its
memory is a NumPy array: with the test doubles libfake_nccl.so and
libfake_cudart.so ("device memory" is host memory) it lets CPU-only CI drive
cring's GPU path end to end. Each export records the `stream` it was asked
for, so tests can check that cring passes the caller's stream to __dlpack__.

Used by tests/test_gpu_loader.py and tests/gpu/fake_worker.py; never with a
real GPU.
"""

from __future__ import annotations

import ctypes
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


class _Namespace:
    """Just enough of an Array-API namespace for cring to make outputs and to
    take results it hands over through DLPack (engine-owned "device" memory)."""

    @staticmethod
    def empty(shape: Any, dtype: Any = None, device: Any = None) -> FakeCudaTensor:
        return FakeCudaTensor(np.empty(shape, dtype=dtype), device=device or 0)

    @staticmethod
    def from_dlpack(x: Any) -> FakeCudaTensor:
        return consume(x, FakeCudaTensor)


def consume(x: Any, kind: Any) -> Any:
    """What a DLPack consumer does with x's export: take the capsule (renamed
    "used_dltensor", so only the consumer calls the deleter), view the memory
    without a copy, and call the producer's deleter once the last view of it
    is gone, as CuPy and torch do; the views, not the returned object, keep
    the memory alive. Returns kind(array, device=...)."""
    device_type, device = x.__dlpack_device__()
    assert device_type == KDL_CUDA, device_type
    capsule = x.__dlpack__()
    address = _capsule_pointer(capsule, b"dltensor")
    if _capsule_set_name(capsule, b"used_dltensor") != 0:
        raise RuntimeError("cannot rename the DLPack capsule")
    t = _DLManagedTensor.from_address(address).dl_tensor
    shape = tuple(t.shape[i] for i in range(t.ndim))
    dtype = (
        np.dtype(np.bool_)
        if t.dtype.code == 6
        else np.dtype(f"{_KINDS[t.dtype.code]}{t.dtype.bits // 8}")
    )
    owner = _Export(address, t.data + t.byte_offset, shape, dtype)
    return kind(np.asarray(owner), device=device)


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
    """`array`'s memory exported through DLPack as device (kDLCUDA, device).
    The object keeps the memory alive (the capsule's deleter is NULL)."""

    streams_seen: list = []  # (label, stream) for every export, in order

    def __init__(self, array: np.ndarray, device: int = 0, label: Optional[str] = None):
        self.array = np.ascontiguousarray(array)
        self.device = int(device)
        self.label = label
        self._exports: list = []

    @property
    def dtype(self) -> np.dtype:
        return self.array.dtype

    @property
    def shape(self) -> tuple:
        return self.array.shape

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
        a = self.array
        shape = (ctypes.c_int64 * max(a.ndim, 1))(*a.shape)
        managed = _DLManagedTensor()
        t = managed.dl_tensor
        t.data = a.ctypes.data
        t.device = _DLDevice(KDL_CUDA, self.device)
        t.ndim = a.ndim
        t.dtype = _DLDataType(_CODES[a.dtype.kind], a.dtype.itemsize * 8, 1)
        t.shape = shape
        t.strides = None
        t.byte_offset = 0
        self._exports.append((shape, managed))  # alive as long as this object
        return _capsule_new(ctypes.addressof(managed), b"dltensor", None)

    def __repr__(self) -> str:
        return f"FakeCudaTensor(cuda:{self.device}, {self.array!r})"

"""A DLPack producer built with ctypes, for inputs no installed library makes
here (a CUDA tensor on a machine without a GPU, odd dtypes)."""

from __future__ import annotations

import ctypes

import numpy as np


class DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class DLManagedTensor(ctypes.Structure):
    _fields_ = [
        ("dl_tensor", DLTensor),
        ("manager_ctx", ctypes.c_void_p),
        ("deleter", ctypes.c_void_p),
    ]


_capsule_new = ctypes.pythonapi.PyCapsule_New
_capsule_new.restype = ctypes.py_object
_capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]


class FakeTensor:
    """Exports `array`'s memory as DLPack with a chosen device type and dtype
    code (deleter NULL: this object keeps the memory alive)."""

    def __init__(self, array: np.ndarray, device_type: int = 1, code: int = 2, bits: int = 32):
        self.array = array
        self.shape = (ctypes.c_int64 * max(array.ndim, 1))(*array.shape)
        self.managed = DLManagedTensor()
        t = self.managed.dl_tensor
        t.data = array.ctypes.data
        t.device = DLDevice(device_type, 0)
        t.ndim = array.ndim
        t.dtype = DLDataType(code, bits, 1)
        t.shape = self.shape
        t.strides = None
        t.byte_offset = 0

    def __dlpack__(self, stream=None):
        return _capsule_new(ctypes.addressof(self.managed), b"dltensor", None)

    def __dlpack_device__(self):
        return (self.managed.dl_tensor.device.device_type, 0)

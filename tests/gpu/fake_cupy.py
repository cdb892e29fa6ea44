"""A CuPy-like DLPack producer for the CPU tests of cring's GPU path: arrays
that claim a CUDA device (kDLCUDA) while their memory is the fake device's
(tests/gpu/fake_cuda.py: the caching allocator and its stream rules), with
`empty` and `from_dlpack` at module level and no `__array_namespace__` on
the arrays, as CuPy has. cring must give such a producer results of its own
kind (fake_cupy.ndarray), made through the module's functions.

Used by tests/gpu/results_worker.py; never with a real GPU.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fake_cuda import FakeCudaTensor, consume, current_stream, device_array


class _Device:
    """Like cupy.cuda.Device: an id, and a context manager."""

    def __init__(self, id: int):
        self.id = int(id)

    def __enter__(self) -> _Device:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def __index__(self) -> int:
        return self.id


class ndarray(FakeCudaTensor):  # noqa: N801 (CuPy's name)
    """A FakeCudaTensor without an Array-API namespace."""

    __array_namespace__ = None  # type: ignore[assignment]

    def __init__(self, array: np.ndarray, device: Any = 0, label: Any = None, wrap: bool = False):
        super().__init__(array, device=int(device), label=label, wrap=wrap)

    @property
    def device(self) -> _Device:  # type: ignore[override]
        return _Device(self._device)

    @device.setter
    def device(self, value: int) -> None:
        self._device = int(value)

    def __dlpack_device__(self) -> tuple:
        return (2, self._device)


ndarray.__module__ = __name__


def empty(shape: Any, dtype: Any = None) -> ndarray:
    """Module-level empty, as cupy.empty (no device=: the current device)."""
    return ndarray(device_array(shape, dtype, current_stream()), wrap=True)


def from_dlpack(x: Any) -> ndarray:
    """Module-level from_dlpack, as cupy.from_dlpack."""
    return consume(x, ndarray)


def asarray(a: Any, dtype: Any = None) -> ndarray:
    return ndarray(np.asarray(a, dtype=dtype))

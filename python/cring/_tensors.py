"""Tensor helpers: make new outputs of the caller's kind (NumPy in, NumPy out;
torch in, torch out; any Array-API library through its namespace, and
libraries such as CuPy through their module's empty/from_dlpack) without
importing any framework that the caller did not already use."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

import numpy as np

from . import _C

_NUMPY_DTYPES = {
    "float16": np.float16,
    "float32": np.float32,
    "float64": np.float64,
    "int8": np.int8,
    "uint8": np.uint8,
    "int32": np.int32,
    "int64": np.int64,
    "bool": np.bool_,
    "int16": np.int16,
    "uint16": np.uint16,
    "uint32": np.uint32,
    "uint64": np.uint64,
}


def dlpack_source(x: Any) -> Any:
    """The object to hand to DLPack: torch tensors that require grad are
    detached (same storage), since torch refuses to export them."""
    if getattr(x, "requires_grad", False) and hasattr(x, "detach"):
        return x.detach()
    return x


def producer_namespace(x: Any, function: str) -> Any:
    """The namespace that makes tensors of x's kind and has `function`
    (empty, from_dlpack): x's Array-API namespace, else the top-level module
    of x's type when it is a tensor library, that is, has from_dlpack (CuPy
    has cupy.empty and cupy.from_dlpack, and no __array_namespace__ on its
    arrays); None when neither has it."""
    namespace = getattr(x, "__array_namespace__", None)
    if namespace is not None:
        xp = namespace()
        if hasattr(xp, function):
            return xp
    module = sys.modules.get(type(x).__module__.partition(".")[0])
    if (
        module is not None
        and module is not np
        and hasattr(module, "from_dlpack")
        and hasattr(module, function)
    ):
        return module
    return None


def contiguous(x: Any) -> Any:
    """`x`, or a contiguous copy of it when it is a strided NumPy array or
    torch tensor: what the out-of-place collectives read (Horovod copies such
    inputs too); in-place ones write the caller's memory, so they refuse them."""
    if isinstance(x, np.ndarray):
        return x if x.flags.c_contiguous else np.ascontiguousarray(x)
    if _is_torch(x) and not x.is_contiguous():
        return x.contiguous()
    return x


def refuse_grad_leaf(tensors: Sequence[Any], what: str) -> None:
    """Torch's rule for in-place operations, for cring's in-place collectives
    (`what`): a leaf tensor that requires grad may not be written while grad
    mode is on (under torch.no_grad() it may). NumPy arrays pass at once."""
    for x in tensors:
        if getattr(x, "requires_grad", False) and getattr(x, "is_leaf", False):
            if sys.modules["torch"].is_grad_enabled():
                raise RuntimeError(
                    "a leaf Variable that requires grad is being used in an in-place operation. "
                    f"(cring's {what} writes the tensor: pass its .data or .detach(), or call it "
                    "under torch.no_grad())"
                )


def _is_torch(x: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(x, torch.Tensor)


def result_like(x: Any, handle: Any, index: int, shape: Sequence[int], dtype_name: str) -> Any:
    """Result `index` of a completed allgather or alltoall as a tensor of x's
    kind: NumPy arrays and CPU torch tensors view the engine's memory without
    a copy (the view keeps the handle alive); other kinds get a copy."""
    shape = tuple(int(d) for d in shape)
    if isinstance(x, np.ndarray):
        return np.frombuffer(handle.output_buffer(index), dtype=x.dtype).reshape(shape)
    if _is_torch(x) and x.device.type == "cpu" and all(shape):
        torch = sys.modules["torch"]
        return torch.frombuffer(handle.output_buffer(index), dtype=x.dtype).reshape(shape)
    out = empty_like(x, shape, dtype_name)
    handle.copy_output(index, dlpack_source(out))
    return out


def empty_like(x: Any, shape: Sequence[int], dtype_name: str) -> Any:
    """A new, uninitialised tensor of x's kind, dtype and device with `shape`.
    A NumPy array or CPU torch tensor of 1 MiB or more lives in a block of
    cring's result cache (a view of it, given back when the last view goes:
    docs/performance.md, "Result memory"), unless CRING_RESULT_CACHE_BYTES=0."""
    shape = tuple(int(d) for d in shape)
    if isinstance(x, np.ndarray):
        made = _C.result_empty(x, shape)
        return np.empty(shape, dtype=x.dtype) if made is None else made
    if _is_torch(x):
        made = _C.result_empty(x, shape)
        if made is not None:
            return made
        torch = sys.modules["torch"]
        return torch.empty(shape, dtype=x.dtype, device=x.device)
    xp = producer_namespace(x, "empty")
    if xp is not None:
        try:
            return xp.empty(shape, dtype=x.dtype, device=getattr(x, "device", None))
        except TypeError:  # no device= (CuPy's module): allocate on x's device
            device = getattr(x, "device", None)
            if hasattr(device, "__enter__") and hasattr(device, "__exit__"):
                with device:
                    return xp.empty(shape, dtype=x.dtype)
            return xp.empty(shape, dtype=x.dtype)
    if dtype_name not in _NUMPY_DTYPES:
        raise TypeError(f"cannot make a NumPy output of dtype {dtype_name} for {type(x).__name__}")
    return np.empty(shape, dtype=_NUMPY_DTYPES[dtype_name])

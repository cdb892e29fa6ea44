"""cring.torch's object collectives, as horovod.torch names them:
broadcast_object and allgather_object. An object is pickled (cloudpickle,
a dependency of cring, as Horovod's; plain pickle without it), then its size
and bytes go through cring's collectives as uint8 tensors."""

from __future__ import annotations

import io
import pickle
from typing import Any, Optional

import torch

import cring
from cring import _core

from ._basics import ProcessSet, _run, global_process_set, rank


def _pickler() -> Any:
    try:
        import cloudpickle

        return cloudpickle
    except ImportError:  # a dependency of cring; plain pickle still takes named objects
        return pickle


def _pickled(obj: Any, what: str) -> bytes:
    """`obj`'s bytes, or a clear error: without cloudpickle (a dependency of
    cring, as of Horovod) lambdas and local functions cannot be pickled."""
    buffer = io.BytesIO()
    pickler = _pickler()
    try:
        pickler.dump(obj, buffer)
    except Exception as e:
        if pickler is not pickle:
            raise
        raise pickle.PicklingError(
            f"{what}: cannot pickle {type(obj).__name__} object ({e}); install cloudpickle "
            "(a dependency of cring: pip install cloudpickle), which pickles lambdas and "
            "local functions"
        ) from e
    return buffer.getvalue()


def broadcast_object(
    obj: Any,
    root_rank: int = 0,
    name: Optional[str] = None,
    process_set: ProcessSet = global_process_set,
) -> Any:
    """Return root_rank's `obj` on every rank: pickled with cloudpickle, its
    size broadcast, then its bytes. Unnamed calls get deterministic names, so
    every rank must make them in the same order (any `obj` is fine on the
    other ranks, e.g. None). When the root cannot pickle `obj`, every rank
    raises (the root the pickling error, the others a RuntimeError)."""
    ps = _core._ps_id(process_set)
    base = _core._name("broadcast_object", name, ps)
    is_root = rank() == int(root_rank)
    failure: Optional[BaseException] = None
    if is_root:
        try:
            data = _pickled(obj, "broadcast_object")
        except Exception as e:
            failure, data = e, b""
        length = torch.tensor([-1 if failure else len(data)], dtype=torch.int64)
    else:
        length = torch.zeros(1, dtype=torch.int64)
    _run(cring.broadcast_, length, root_rank, name=f"{base}.sz", process_set=process_set)
    if failure is not None:
        raise failure
    if int(length[0]) < 0:
        raise RuntimeError(
            f"broadcast_object: root rank {root_rank} could not pickle its object (see its error)"
        )
    if is_root:
        payload = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    else:
        payload = torch.empty(int(length[0]), dtype=torch.uint8)
    _run(cring.broadcast_, payload, root_rank, name=f"{base}.t", process_set=process_set)
    if is_root:
        return obj
    return _pickler().load(io.BytesIO(payload.numpy().tobytes()))


def allgather_object(
    obj: Any, name: Optional[str] = None, process_set: ProcessSet = global_process_set
) -> list:
    """Return the list of every rank's `obj`, in rank order (pickled with
    cloudpickle; sizes and bytes gathered together)."""
    base = _core._name("allgather_object", name, _core._ps_id(process_set))
    payload = torch.frombuffer(bytearray(_pickled(obj, "allgather_object")), dtype=torch.uint8)
    sizes_handle = _run(
        cring.allgather_async,
        torch.tensor([payload.numel()], dtype=torch.int64),
        name=f"{base}.sz",
        process_set=process_set,
    )
    bytes_handle = _run(cring.allgather_async, payload, name=f"{base}.t", process_set=process_set)
    sizes = [int(n) for n in _run(cring.synchronize, sizes_handle)]
    gathered = _run(cring.synchronize, bytes_handle).numpy()
    objects, start = [], 0
    for n in sizes:
        objects.append(_pickler().load(io.BytesIO(gathered[start : start + n].tobytes())))
        start += n
    return objects

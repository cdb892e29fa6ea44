"""What the cring backend runs inside Ray Train worker processes.

Plain functions, shipped to the workers by reference (this module is
importable there because cring is). They only set the environment (and the
current CUDA device), hold rank 0's rendezvous store and shut cring down;
they never run a collective.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from typing import Any, Optional

_lock = threading.Lock()
_store: Any = None  # the StoreServer rank 0's worker serves for the current group
_store_port: Optional[int] = None


def node_id() -> str:
    """The Ray node this worker runs on (its local rank is counted per node)."""
    import ray

    return ray.get_runtime_context().get_node_id()


def start_store(secret: str) -> tuple[str, int]:
    """Serve a fresh rendezvous store in this process on the node's address and
    a port the kernel picks; return (address, port). Replaces a store left from
    an earlier group in the same process."""
    import ray

    from cring import _C

    addr = ray.util.get_node_ip_address()
    global _store, _store_port
    with _lock:
        if _store is not None:
            _store.stop()
            _store = _store_port = None
        server = _C.StoreServer(addr, 0, secret)
        _store, _store_port = server, int(server.port)
        return addr, _store_port


# The index, among this worker's visible CUDA devices, of its GPU (read by the
# Lightning strategy and set_torch_device(); the same name as cring.lightning's).
CUDA_DEVICE_VARIABLE = "CRING_CUDA_DEVICE"


def cuda_device_index(gpu_ids: list, visible: Optional[str]) -> Optional[int]:
    """Where this worker's first GPU (`gpu_ids`, from ray.get_gpu_ids()) is
    among the devices CUDA numbers for it (`visible`, CUDA_VISIBLE_DEVICES):
    0 when Ray gave each worker its own, the position in the list when the
    workers on a node share them (share_cuda_visible_devices). None without
    a GPU, or when CUDA_VISIBLE_DEVICES does not list it (overridden)."""
    if not gpu_ids:
        return None
    own = str(gpu_ids[0]).strip()
    if visible is None or visible.strip() in ("", "NoDevFiles"):
        # Ray left CUDA_VISIBLE_DEVICES alone: every device is visible, numbered as Ray numbers them
        return int(own) if own.isdigit() else None
    entries = [entry.strip() for entry in visible.split(",")]
    return entries.index(own) if own in entries else None


def set_env(env: dict[str, str]) -> None:
    """Give this worker its CRING_* variables (read by cring.init()), and
    CRING_CUDA_DEVICE when Ray gave it a GPU (Ray has set
    CUDA_VISIBLE_DEVICES by now)."""
    import ray

    os.environ.update(env)
    index = cuda_device_index(ray.get_gpu_ids(), os.environ.get("CUDA_VISIBLE_DEVICES"))
    if index is None:
        os.environ.pop(CUDA_DEVICE_VARIABLE, None)
    else:
        os.environ[CUDA_DEVICE_VARIABLE] = str(index)


def set_torch_device() -> Optional[int]:
    """Make this worker's GPU torch's current CUDA device in the calling
    thread (the current device is per thread, so the trainer calls this in
    the thread that runs the training loop). Returns the index, or None when
    there is nothing to set: no GPU for this worker, torch missing, or a
    torch without CUDA."""
    value = os.environ.get(CUDA_DEVICE_VARIABLE)
    if value is None:
        return None
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    index = int(value)
    torch.cuda.set_device(index)
    return index


@contextlib.contextmanager
def on_worker_device() -> Iterator[None]:
    """Ray's train_func_context for cring: entered in the thread that runs
    the training loop, right before the loop (Ray's TorchConfig does the same)."""
    set_torch_device()
    yield


def shutdown() -> None:
    """Leave the cring job if this worker joined it, and stop the store if
    this worker serves it. Safe to call more than once, and when the training
    function already called cring.shutdown()."""
    import cring

    global _store, _store_port
    if cring.is_initialized():
        cring.shutdown()
    with _lock:
        if _store is not None:
            _store.stop()
            _store = _store_port = None

"""What the cring backend runs inside Ray Train worker processes.

Plain functions, shipped to the workers by reference (this module is
importable there because cring is). They only set the environment, hold rank
0's rendezvous store and shut cring down; they never run a collective.
"""

from __future__ import annotations

import os
import threading
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


def set_env(env: dict[str, str]) -> None:
    """Give this worker its CRING_* variables (read by cring.init())."""
    os.environ.update(env)


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

"""The job around the collectives: init() and shutdown(), the topology
queries, join(), barrier(), engine statistics and the timeline. The
collectives themselves are in cring._collectives; the shared types in
cring._core.
"""

from __future__ import annotations

import threading
from typing import Any, Optional

from . import (
    _C,
    _discovery,  # CUDA tensors (see the marked branches below)
    _horovod_env,
)
from ._core import (
    _CALLER_WAITS,
    Handle,
    _name,
    _name_counters,
    _require_init,
    _submit,
    _topo,
    _topology,
    rank,
    size,
    synchronize,
)

_state_lock = threading.Lock()
_generation = 0  # how many times this process has initialised (store key namespace)


def _start_store(addr: str, secret: Optional[str]) -> tuple[Any, int]:
    server = _C.StoreServer(addr, 0, secret)
    return server, server.port


_plan_server: Any = None  # a store started for one init (torchrun/mpirun paths)
# Stores this process serves on a fixed address (rank 0 under MASTER_ADDR/PORT
# or CRING_ADDR/PORT). They outlive shutdown(): a peer that re-initialises
# first must find the store of the next generation at the same address, not a
# dying one, and keys are namespaced by generation so nothing clashes.
_fixed_servers: dict[tuple[str, int], Any] = {}


def init(
    rank: Optional[int] = None,
    size: Optional[int] = None,
    addr: Optional[str] = None,
    port: Optional[int] = None,
    *,
    secret: Optional[str] = None,
    transport: Optional[str] = None,
    timeout_s: Optional[float] = None,
) -> None:
    """Join the job: find rank and size (arguments, then environment), meet the
    other ranks at the rendezvous store and connect the transports.

    Calling init() again while initialised does nothing (as in Horovod).
    """
    global _generation, _plan_server
    with _state_lock:
        if _C.is_initialized():
            return
        _horovod_env.apply_horovod_environment()  # HOROVOD_* knobs, before anything reads CRING_*
        plan = _discovery.plan_init(
            rank=rank,
            size=size,
            addr=addr,
            port=port,
            secret=secret,
            transport=transport,
            timeout_s=timeout_s,
            generation=_generation,
            start_store=_start_store,
        )
        _generation += 1
        if plan.serve_store:
            key = (plan.addr, plan.port)
            if key not in _fixed_servers:
                _fixed_servers[key] = _C.StoreServer(plan.addr, plan.port, plan.secret)
            plan.serve_store = False
        try:
            _C.init(
                plan.rank,
                plan.size,
                plan.addr,
                plan.port,
                plan.serve_store,
                plan.secret,
                plan.job_key,
                None,
                plan.transport,
                plan.timeout_s,
            )
        except BaseException:
            if plan.store_server is not None:
                plan.store_server.stop()
            raise
        finally:
            if plan.cleanup is not None:
                plan.cleanup()
        _plan_server = plan.store_server
        _topology.clear()
        _topology.update(_C.topology())
        _name_counters.clear()


def shutdown() -> None:
    """Leave the job and free its resources; init() may be called again.
    Does not communicate, so it never blocks on a dead peer. A rendezvous
    store that rank 0 serves on a fixed port keeps running until the process
    exits, so that peers re-initialising first find the next generation."""
    global _plan_server
    with _state_lock:
        _C.shutdown()
        if _plan_server is not None:
            _plan_server.stop()
            _plan_server = None
        _topology.clear()


def is_initialized() -> bool:
    return bool(_C.is_initialized())


def local_rank() -> int:
    """Rank among the processes on this host."""
    return _topo("local_rank")


def local_size() -> int:
    """Number of processes on this host."""
    return _topo("local_size")


def cross_rank() -> int:
    """Rank among the processes that have this process's local rank (the host index)."""
    return _topo("cross_rank")


def cross_size() -> int:
    """Number of processes with this process's local rank (the number of hosts)."""
    return _topo("cross_size")


def transport() -> str:
    """'shm', 'tcp' or 'self' (one rank): what the collectives run over."""
    return _topo("transport")


def join() -> int:
    """Declare that this rank has no more data (Horovod's join).

    Until every rank has joined, the other ranks' allreduces with Sum or
    Average complete with zeros as this rank's contribution (so Average still
    divides by size()); any other collective started while a rank has joined
    raises MismatchError on every rank. Collectives this rank started before
    join() complete first; none may be started until it returns. Returns the
    rank that joined last, the same on every rank."""
    _require_init()
    h = _C.submit(_C.JOIN, _name("join", None), [], 0, 0, 1.0, 1.0, None, _CALLER_WAITS)
    return synchronize(Handle(h, lambda h: int(h.value())))


def barrier() -> None:
    """Return once every rank has called barrier()."""
    synchronize(_submit(_C.BARRIER, _name("barrier", None), [], lambda h: None, caller_waits=True))


def engine_stats() -> dict:
    """Counters of the background engine: negotiation cycles, data
    collectives run (a fused batch counts once), tensors completed, tensors
    that went through the fusion buffer, response-cache hits, errors."""
    _require_init()
    return dict(_C.engine_stats())


def _rank_path(path: str) -> str:
    if size() == 1:
        return path
    root, dot, ext = path.rpartition(".")
    if dot and "/" not in ext:
        return f"{root}.{rank()}.{ext}"
    return f"{path}.{rank()}"


def start_timeline(file_path: str) -> str:
    """Write a Chrome-trace timeline (open it in Perfetto or chrome://tracing)
    of every collective from now on. With several ranks each writes its own
    file: "trace.json" becomes "trace.<rank>.json". Returns the path used."""
    _require_init()
    path = _rank_path(str(file_path))
    _C.timeline(path)
    return path


def stop_timeline() -> None:
    """Stop writing the timeline (the file stays valid JSON)."""
    _require_init()
    _C.timeline(None)

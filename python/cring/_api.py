"""The job around the collectives: init() and shutdown(), the topology
queries, join(), barrier(), engine statistics and the timeline. The
collectives themselves are in cring._collectives; the shared types in
cring._core.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterable
from typing import Any, Optional

import numpy as _np

from . import (
    _C,
    _discovery,  # CUDA tensors (see the marked branches below)
    _horovod_env,
)
from ._collectives import allgather_async
from ._core import (
    _CALLER_WAITS,
    Handle,
    ProcessSet,
    _name,
    _name_counters,
    _process_sets,
    _ps_id,
    _ps_size_rank,
    _require_init,
    _submit,
    _topo,
    _topology,
    global_process_set,
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
    process_sets: Optional[Iterable[Any]] = None,
) -> None:
    """Join the job: find rank and size (arguments, then environment), meet the
    other ranks at the rendezvous store and connect the transports.
    `process_sets`: ProcessSets (or lists of global ranks) to add at once,
    in order, as add_process_set() does; every rank must pass the same.

    Calling init() again while initialised does nothing (as in Horovod).
    """
    if not _init(rank, size, addr, port, secret, transport, timeout_s):
        return  # initialised already: nothing changes, no set is added
    seen: dict = {}
    for ps in process_sets or ():
        ps = ps if isinstance(ps, ProcessSet) else ProcessSet(ps)
        if ps.process_set_id is not None:
            continue  # added already (a second init() call)
        if tuple(ps.ranks) in seen:  # Horovod leaves a second copy unregistered
            continue
        seen[tuple(ps.ranks)] = add_process_set(ps)


def _init(
    rank: Optional[int],
    size: Optional[int],
    addr: Optional[str],
    port: Optional[int],
    secret: Optional[str],
    transport: Optional[str],
    timeout_s: Optional[float],
) -> bool:
    global _generation, _plan_server
    with _state_lock:
        if _C.is_initialized():
            return False
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
        global_process_set.ranks = list(range(plan.size))
        return True


def shutdown() -> None:
    """Leave the job and free its resources; init() may be called again.
    Does not communicate, so it never blocks on a dead peer. A rendezvous
    store that rank 0 serves on a fixed port keeps running until the process
    exits, so that peers re-initialising first find the next generation."""
    global _plan_server
    with _state_lock:
        _C.shutdown()  # every process set's engine, then the global one
        for ps in _process_sets.values():
            ps._invalidate()
        _process_sets.clear()
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
    """What the collectives run over: 'shm' (one host), 'tcp' (the flat ring),
    'hier(shm+tcp)' (ranks on several hosts, several on each: shared memory
    within a host, TCP across; CRING_HIERARCHICAL=0 forces the flat ring) or
    'self' (one rank)."""
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


def barrier(process_set: Any = None) -> None:
    """Return once every rank (of `process_set`, default all) has called barrier()."""
    ps = _ps_id(process_set)
    name = _name("barrier", None, ps)
    synchronize(_submit(_C.BARRIER, name, [], lambda h: None, caller_waits=True, process_set=ps))


# ---- process sets: agreed over the global set, then built in C -------------------------------

_ps_lock = threading.Lock()


def _agree(what: str, mine: dict) -> list:
    """Every rank's `mine` (JSON), gathered over the global engine, in rank order."""
    payload = _np.frombuffer(json.dumps(mine).encode(), dtype=_np.uint8).copy()
    name = _name(f"process_set.{what}", None)
    h_sizes = allgather_async(_np.array([payload.size], dtype=_np.int64), name=f"{name}.sz")
    h_bytes = allgather_async(payload, name=f"{name}.t")
    counts = synchronize(h_sizes)
    data = synchronize(h_bytes).tobytes()
    out, start = [], 0
    for n in counts.tolist():
        out.append(json.loads(data[start : start + n].decode()))
        start += n
    return out


def _disagreement(what: str, entries: list, key: str) -> Optional[str]:
    groups: dict = {}
    for r, e in enumerate(entries):
        groups.setdefault(json.dumps(e[key]), []).append(r)
    if len(groups) == 1:
        return None
    parts = [f"rank(s) {ranks} gave {value}" for value, ranks in groups.items()]
    return f"cring.{what}: every rank must pass the same {key}, but " + "; ".join(parts)


def add_process_set(process_set: Any) -> ProcessSet:
    """Register a process set: a ProcessSet or a list of global ranks; returns
    the registered ProcessSet. Collective over all ranks, as in Horovod: every
    rank calls it, in the same order, with the same ranks (ranks outside the
    set too). A disagreement, a duplicate of a registered set, or a bad rank
    raises ValueError on every rank. Members get the set's own communicator
    and engine; collectives on disjoint sets run at the same time."""
    _require_init()
    with _ps_lock:
        ps, error = None, None
        try:
            ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
            if ps.process_set_id is not None:
                error = f"{ps!r} is registered already"
        except ValueError as e:
            error = str(e)
        next_id = max(_process_sets, default=0) + 1
        mine = {"ranks": None if ps is None else ps.ranks, "id": next_id, "error": error}
        entries = _agree("add", mine)
        errors = [f"rank {r}: {e['error']}" for r, e in enumerate(entries) if e["error"]]
        if errors:
            raise ValueError("cring.add_process_set failed: " + "; ".join(errors))
        for key in ("ranks", "id"):
            message = _disagreement("add_process_set", entries, key)
            if message:
                raise ValueError(message)
        ranks = entries[0]["ranks"]
        n = size()
        if not ranks or len(set(ranks)) != len(ranks) or not all(0 <= r < n for r in ranks):
            raise ValueError(
                f"cring.add_process_set: {ranks} must be distinct ranks in [0, {n}), at least one"
            )
        if ranks == list(range(n)) or any(p.ranks == ranks for p in _process_sets.values()):
            raise ValueError(f"cring.add_process_set: a process set with ranks {ranks} exists")
        _C.process_set_add(next_id, ranks)
        ps.process_set_id = next_id
        _process_sets[next_id] = ps
        return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Stop and forget a process set (collective over all ranks, like
    add_process_set). Returns False for the global set or one not registered
    (on every rank: all must pass the same); the object is then unregistered."""
    _require_init()
    ps_id = getattr(process_set, "process_set_id", None)
    with _ps_lock:
        entries = _agree("remove", {"id": ps_id, "error": None})
        message = _disagreement("remove_process_set", entries, "id")
        if message:
            raise ValueError(message)
        if not ps_id or _process_sets.get(ps_id) is None:
            return False
        _process_sets.pop(ps_id)._invalidate()
        _name_counters.forget_set(ps_id)  # a later set may get this id with other members
        if process_set is not None:
            process_set._invalidate()
        return bool(_C.process_set_remove(ps_id))


def process_set_size_rank(process_set: Any = None) -> tuple:
    """(size, rank) of this process in `process_set` (default: the global set)."""
    return _ps_size_rank(_ps_id(process_set))


_KNOBS = ("fusion_threshold_bytes", "cycle_time_ms", "autotune")


def engine_stats() -> dict:
    """Counters of the background engine: negotiation cycles, data
    collectives run (a fused batch counts once), tensors completed, tensors
    that went through the fusion buffer, response-cache hits, errors, CUDA
    allreduces held for their gradient bucket (bucket_held) and releases of
    held ones by the idle rule (bucket_idle_releases; docs/gpu.md); and the
    payload bytes this rank moved per transport (tcp_bytes_sent/_received on
    its sockets, shm_bytes_sent/_received through shared memory)."""
    _require_init()
    return {k: v for k, v in _C.engine_stats().items() if k not in _KNOBS}


def result_cache_stats() -> dict:
    """The memory of large CPU results (docs/performance.md, "Result
    memory"): results of min_bytes (1 MiB) or more that cring allocates
    (out-of-place allreduce, broadcast, reducescatter, allgather, alltoall)
    live in blocks that come back to a process-wide cache when their last
    view is gone. limit_bytes (CRING_RESULT_CACHE_BYTES) bounds idle_bytes,
    what the cache keeps for reuse; lent_bytes is in results still alive;
    reused / mapped count results served from the cache / newly mapped;
    unmapped counts blocks given back to the system. Needs no init()."""
    return dict(_C.result_cache_stats())


def engine_knobs() -> dict:
    """The engine's knobs in force on this rank: fusion_threshold_bytes,
    cycle_time_ms, and autotune: "off", "tuning" (CRING_AUTOTUNE is trying
    values; every rank changes them at the same round) or "settled" (the
    best values are in force for good). See docs/autotune.md."""
    _require_init()
    stats = _C.engine_stats()
    return {k: stats[k] for k in _KNOBS}


def _rank_path(path: str) -> str:
    if size() == 1:
        return path
    root, dot, ext = path.rpartition(".")
    if dot and "/" not in ext:
        return f"{root}.{rank()}.{ext}"
    return f"{path}.{rank()}"


def start_timeline(
    file_path: str, mark_cycles: bool = False, all_ranks: bool = False
) -> Optional[str]:
    """Write a Chrome-trace timeline (open it in Perfetto or chrome://tracing)
    of every collective from now on, in Horovod's layout (a row per tensor,
    NEGOTIATE_ALLREDUCE, ALLREDUCE, QUEUE, ... events). Call it on every rank:
    as in Horovod, rank 0 writes `file_path` and the others write nothing.
    `mark_cycles` adds a CYCLE_START marker per negotiation cycle.
    `all_ranks=True` has every rank write its own file instead ("trace.json"
    becomes "trace.<rank>.json"). Returns the path this rank writes, or None.
    A timeline already being written is replaced."""
    _require_init()
    if all_ranks:
        path = _rank_path(str(file_path))
    elif rank() == 0:
        path = str(file_path)
    else:
        _C.timeline(None)
        return None
    _C.timeline(path, bool(mark_cycles))
    return path


def stop_timeline() -> None:
    """Stop writing the timeline (the file stays valid JSON)."""
    _require_init()
    _C.timeline(None)

"""Elastic training, as in Horovod Elastic: when a worker dies or workers are
added, the others leave the job, meet again in a new *generation* (new ranks
and size, decided by ``cringrun --elastic``), roll back to the last committed
state when something failed, take rank 0's state, and call the training
function again.

    import cring, cring.elastic
    cring.init()

    @cring.elastic.run
    def train(state):
        while state.step < 100:
            ...                       # collectives may raise on a failure
            state.step += 1
            state.commit()            # save; raise HostsUpdatedInterrupt if workers were added

    train(cring.elastic.ObjectState(step=0, weights=np.zeros(10)))

This module holds the worker side: the state, the decorator and the
worker's moves between generations. The protocol it shares with the launcher
(cring/launch/elastic_driver.py) is cring._elastic_protocol. It never imports
torch (cring.torch.elastic adds TorchState). See docs/elastic.md.
"""

from __future__ import annotations

import copy
import functools
import json
import os
import pickle
import sys
import threading
import time
from collections.abc import Iterable, Mapping
from typing import Any, Callable, TypeVar

import numpy as np

from . import _api, _collectives, _core, _discovery
from ._elastic_protocol import Keys, StoreClient

__all__ = [
    "ElasticError",
    "HostsUpdatedInterrupt",
    "ObjectState",
    "State",
    "broadcast_object",
    "run",
]

# Environment set by `cringrun --elastic` on every worker.
ENV_ELASTIC = "CRING_ELASTIC"
ENV_WORKER_ID = "CRING_ELASTIC_WORKER_ID"
ENV_GENERATION = "CRING_ELASTIC_GENERATION"

# After a PeerFailureError the launcher normally publishes the next generation
# within milliseconds (it sees the death itself); a worker asks for one only
# if nothing came after this long (the peer may have left without dying).
_PEER_FAILURE_GRACE_S = 5.0
# While waiting for the other survivors to arrive in a generation, look this
# often whether the launcher has replaced it (a member died meanwhile).
_JOIN_POLL_S = 0.5


class ElasticError(RuntimeError):
    """Elastic training cannot go on in this worker: the job is finishing, the
    launcher left this worker out, or no new generation was formed in time.
    Not caught by :func:`run`."""


class HostsUpdatedInterrupt(RuntimeError):
    """Raised on every rank by :meth:`State.commit` (or
    :meth:`State.check_host_updates`) when the launcher has started new
    workers: :func:`run` re-rendezvouses without restoring the state.
    `skip_sync` is True when no rank is new (no broadcast is needed)."""

    def __init__(self, skip_sync: bool = False):
        super().__init__("the set of workers was updated")
        self.skip_sync = skip_sync


# ---------------------------------------------------------------------------
# The worker's side
# ---------------------------------------------------------------------------


class _Worker:
    """This process as a worker of `cringrun --elastic`: its id, the generation
    it belongs to, and the store where the launcher publishes generations."""

    def __init__(self, env: Mapping[str, str]) -> None:
        try:
            self.worker_id = int(env[ENV_WORKER_ID])
            self.generation = int(env[ENV_GENERATION])
            self._addr, self._port = env["CRING_ADDR"], int(env["CRING_PORT"])
        except (KeyError, ValueError) as exc:
            raise ElasticError(
                f"{ENV_ELASTIC}=1 is set but the elastic environment is "
                f"incomplete or invalid ({exc}); launch with cringrun "
                "--elastic"
            ) from None
        self._secret = env.get("CRING_SECRET") or None
        self.keys = Keys(env.get("CRING_JOB_ID") or "cring")
        self.timeout_s = float(env.get("CRING_TIMEOUT_SECONDS") or _discovery.DEFAULT_TIMEOUT_S)
        self._store: StoreClient | None = None
        self._record: dict | None = None  # the record of self.generation, once read

    # -- store access ----------------------------------------------------------

    def _client(self) -> StoreClient:
        if self._store is None:
            try:
                self._store = StoreClient(
                    self._addr, self._port, self._secret, min(self.timeout_s, 30.0)
                )
            except (OSError, ConnectionError) as exc:
                raise ElasticError(f"cannot reach the elastic launcher's store: {exc}") from None
        return self._store

    def _call(self, method: str, *args: Any) -> Any:
        """A store call; one reconnection if the connection broke (never twice)."""
        for attempt in (0, 1):
            client = self._client()
            try:
                return getattr(client, method)(*args)
            except (OSError, ConnectionError) as exc:
                client.close()
                self._store = None
                if attempt:
                    raise ElasticError(f"the elastic launcher's store failed: {exc}") from None
        raise AssertionError("unreachable")

    def latest_generation(self) -> int:
        value = self._call("get", self.keys.latest, 0.0)
        return int(value) if value else self.generation

    def read_record(self, g: int, timeout_s: float = 0.0) -> dict | None:
        value = self._call("get", self.keys.generation(g), timeout_s)
        return None if value is None else json.loads(value)

    def current_record(self) -> dict:
        if self._record is None or self._record["generation"] != self.generation:
            record = self.read_record(self.generation, self.timeout_s)
            if record is None:
                raise ElasticError(f"generation {self.generation} is not in the store")
            self._record = record
        return self._record

    def request_generation(self, reason: str) -> None:
        n = self._call("add", self.keys.request_count, 1)
        body = {"worker": self.worker_id, "generation": self.generation, "reason": reason}
        self._call("set", self.keys.request(n), json.dumps(body).encode())

    # -- moving to another generation ---------------------------------------------

    def next_record(self, failure: BaseException | None) -> dict:
        """The generation to join after this one: the newest one after a hosts
        update (failure None); after a failure, the one the launcher forms
        next, asking for it unless a peer died (the launcher sees deaths)."""
        if failure is None:
            record = self.read_record(self.latest_generation(), self.timeout_s)
            if record is None or record["generation"] <= self.generation:
                raise ElasticError("hosts were updated but no newer generation is in the store")
            return self._checked(record)
        now = time.monotonic()
        deadline = now + self.timeout_s
        peer_died = isinstance(failure, _core.PeerFailureError)
        request_at = now + _PEER_FAILURE_GRACE_S if peer_died else now
        requested = False
        while True:
            now = time.monotonic()
            if not requested and now >= request_at:
                self.request_generation(f"{type(failure).__name__}: {failure}")
                requested = True
            until = deadline if requested else min(request_at, deadline)
            record = self.read_record(self.generation + 1, max(0.0, until - now))
            if record is not None:
                break
            if time.monotonic() >= deadline:
                raise ElasticError(
                    f"worker {self.worker_id}: no new generation after generation "
                    f"{self.generation} within {self.timeout_s:g} s (CRING_TIMEOUT_SECONDS) "
                    f"after: {failure}"
                )
        if record.get("finished"):
            raise ElasticError(
                f"worker {self.worker_id} cannot continue after '{failure}': "
                f"{record.get('reason', 'the job is finishing')}"
            )
        latest = self.latest_generation()
        if latest > record["generation"]:
            record = self.read_record(latest, self.timeout_s) or record
        return self._checked(record)

    def _checked(self, record: dict) -> dict:
        if str(self.worker_id) not in record["ranks"]:
            raise ElasticError(
                f"worker {self.worker_id} is not part of generation "
                f"{record['generation']} ({record.get('reason', '')})"
            )
        return record

    def join(self, record: dict) -> None:
        """Wait until every worker carried over into the record's generation has
        left the previous one (or the launcher replaced the generation), then
        initialise cring as this worker's rank in it."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            g = record["generation"]
            self.generation, self._record = g, record
            os.environ[ENV_GENERATION] = str(g)
            self._call("set", self.keys.joined(g, self.worker_id), b"1")
            carried = [int(w) for w in record["ranks"] if int(w) not in set(record["added"])]
            keys = [self.keys.joined(g, w) for w in carried]
            while True:
                remaining = deadline - time.monotonic()
                if self._call("wait", keys, max(0.0, min(_JOIN_POLL_S, remaining))):
                    break
                latest = self.latest_generation()
                if latest > g:
                    newer = self.read_record(latest, self.timeout_s)
                    if newer is not None:
                        record = self._checked(newer)
                        break
                if time.monotonic() >= deadline:
                    raise _core.TimeoutError(
                        f"elastic rendezvous: workers of generation {g} did not arrive within "
                        f"{self.timeout_s:g} s (CRING_TIMEOUT_SECONDS)"
                    )
            if record["generation"] == g:
                break
        rank, size = record["ranks"][str(self.worker_id)], record["size"]
        os.environ.update(
            CRING_RANK=str(rank),
            CRING_SIZE=str(size),
            CRING_LOCAL_RANK=str(rank),
            CRING_LOCAL_SIZE=str(size),
        )
        _api.init()
        self._call("set", self.keys.formed(record["generation"]), b"1")


_worker_lock = threading.Lock()
_worker: _Worker | None = None


def _current_worker() -> _Worker | None:
    """This process as an elastic worker, or None when not under cringrun --elastic."""
    global _worker
    with _worker_lock:
        if _worker is None and os.environ.get(ENV_ELASTIC, "") not in ("", "0"):
            _worker = _Worker(os.environ)
        return _worker


# ---------------------------------------------------------------------------
# State
# ---------------------------------------------------------------------------


def broadcast_object(obj: Any, root_rank: int = 0, name: str = "cring.elastic.object") -> Any:
    """root_rank's `obj` on every rank (pickled; NumPy buffers only)."""
    is_root = _core.rank() == root_rank
    if is_root:
        payload = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
        length = np.array([payload.size], np.int64)
    else:
        length = np.zeros(1, np.int64)
    _collectives.broadcast_(length, root_rank, name=f"{name}.bytes")
    if not is_root:
        payload = np.empty(int(length[0]), np.uint8)
    _collectives.broadcast_(payload, root_rank, name=f"{name}.data")
    return obj if is_root else pickle.loads(payload.tobytes())


class State:
    """The state elastic training keeps consistent across ranks (Horovod's
    State). Subclasses implement save(), restore() and sync().

    - commit(): save() a copy of the state, then check_host_updates().
    - restore(): go back to the last save() (after a failure).
    - sync(): take rank 0's state (after every re-rendezvous, and before the
      first call of the training function); afterwards it is also the
      committed state.
    - register_reset_callbacks(callbacks): called, without arguments, after
      every re-rendezvous (e.g. to scale the learning rate by cring.size()).
    """

    def __init__(self) -> None:
        self._reset_callbacks: list[Callable[[], Any]] = []

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], Any]]) -> None:
        callbacks = list(callbacks)
        for cb in callbacks:
            if not callable(cb):
                raise TypeError(f"reset callbacks must be callable, got {cb!r}")
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        self.reset()
        for cb in self._reset_callbacks:
            cb()

    def reset(self) -> None:
        """Hook for subclasses, called after every re-rendezvous before the callbacks."""

    def commit(self) -> None:
        self.save()
        self.check_host_updates()

    def check_host_updates(self) -> None:
        """Raise HostsUpdatedInterrupt on every rank if the launcher has formed
        a newer generation (workers added). All ranks agree through one small
        allreduce, so call it at the same point on every rank. Does nothing
        outside cringrun --elastic."""
        worker = _current_worker()
        if worker is None or not _api.is_initialized():
            return
        # rank 0 asks the store (one request per commit, not one per rank); the
        # allreduce makes every rank take the same decision
        newest = np.array(
            [worker.latest_generation() if _core.rank() == 0 else worker.generation], np.int64
        )
        _collectives.allreduce_(newest, op=_core.Max, name="cring.elastic.host_updates")
        if int(newest[0]) <= worker.generation:
            return
        members = set(worker.current_record()["ranks"])
        record = worker.read_record(int(newest[0]), worker.timeout_s)
        skip_sync = record is not None and set(record["ranks"]) <= members
        raise HostsUpdatedInterrupt(skip_sync=skip_sync)

    def save(self) -> None:
        raise NotImplementedError

    def restore(self) -> None:
        raise NotImplementedError

    def sync(self) -> None:
        raise NotImplementedError


class ObjectState(State):
    """State held as attributes: ObjectState(epoch=0, weights=np.zeros(3)).

    commit() deep-copies every attribute given to the constructor; restore()
    sets them back to (copies of) the committed values; sync() broadcasts
    rank 0's current values (pickled) and commits them. The constructor's
    values are the first commit.
    """

    def __init__(self, **kwargs: Any) -> None:
        super().__init__()
        self._names = list(kwargs)
        for name, value in kwargs.items():
            if name.startswith("_") or hasattr(type(self), name):
                raise ValueError(f"state attribute name {name!r} is reserved")
            setattr(self, name, value)
        self._saved: dict[str, Any] = {}
        self.save()

    def _broadcast(self, obj: Any) -> Any:
        return broadcast_object(obj, 0, name="cring.elastic.state")

    def save(self) -> None:
        self._saved = {name: copy.deepcopy(getattr(self, name)) for name in self._names}

    def restore(self) -> None:
        for name in self._names:
            setattr(self, name, copy.deepcopy(self._saved[name]))

    def sync(self) -> None:
        if self._names:
            values = self._broadcast({name: getattr(self, name) for name in self._names})
            for name, value in values.items():
                setattr(self, name, value)
        self.save()


# ---------------------------------------------------------------------------
# The decorator
# ---------------------------------------------------------------------------

_F = TypeVar("_F", bound=Callable[..., Any])


def _communication_failure(error: BaseException) -> bool:
    """A failure elastic training recovers from: any CRingError but a mismatch
    (a bug: every rank disagrees the same way again) or a missing init()."""
    return isinstance(error, _core.CRingError) and not isinstance(
        error, (_core.MismatchError, _core.NotInitializedError)
    )


def _hosts_updated_types() -> tuple[type, ...]:
    # cring.torch defines its own HostsUpdatedInterrupt for horovod.torch
    # compatibility; treat it the same when it is loaded.
    types: list[type] = [HostsUpdatedInterrupt]
    mpi_ops = sys.modules.get("cring.torch.mpi_ops")
    other = getattr(mpi_ops, "HostsUpdatedInterrupt", None)
    if isinstance(other, type) and other is not HostsUpdatedInterrupt:
        types.append(other)
    return tuple(types)


def _reset(worker: _Worker, failure: BaseException | None) -> None:
    _api.shutdown()
    worker.join(worker.next_record(failure))


def run(func: _F) -> _F:
    """Decorate `train(state, *args, **kwargs)` for elastic training.

    The wrapper calls state.sync() and then train. When a collective fails
    (any cring.CRingError but MismatchError and NotInitializedError, which
    includes cring.torch's HorovodInternalError) it calls state.restore(),
    shuts cring down, joins the next generation that cringrun --elastic forms
    (new rank and size), calls the state's reset callbacks, state.sync() and
    train again. On HostsUpdatedInterrupt it does the same without restore().
    It returns what train returns. Outside cringrun --elastic a failure is
    raised unchanged.
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(state, State):
            raise TypeError(
                f"cring.elastic.run: the first argument must be a "
                f"cring.elastic.State, got {type(state).__name__}"
            )
        hosts_updated = _hosts_updated_types()
        reset_due = False
        failure: BaseException | None = None
        skip_sync = False
        while True:
            try:
                if reset_due:
                    worker = _current_worker()
                    assert worker is not None
                    _reset(worker, failure)
                    reset_due = False
                    state.on_reset()
                if not skip_sync:
                    state.sync()
                skip_sync = False
                return func(state, *args, **kwargs)
            except hosts_updated as interrupt:
                skip_sync = bool(getattr(interrupt, "skip_sync", False))
                failure, reset_due = None, True
            except _core.CRingError as error:
                if not _communication_failure(error) or _current_worker() is None:
                    raise
                state.restore()
                skip_sync, failure, reset_due = False, error, True

    return wrapper  # type: ignore[return-value]

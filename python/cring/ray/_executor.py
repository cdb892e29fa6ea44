"""RayExecutor: Horovod-on-Ray's executor API on cring (start, run, execute, shutdown).

It places one Ray actor per rank with a placement group, gives the actors the
CRING_* environment through the same code the Train backend uses (_backend.
worker_environments, _worker.start_store / set_env / shutdown) and runs
functions on them. It must not hold a second copy of that setup, and it never
runs a collective itself.
"""

from __future__ import annotations

import inspect
import logging
import os
import secrets
import time
import uuid
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError
from ray.util.placement_group import (
    PlacementGroup,
    get_current_placement_group,
    placement_group,
    remove_placement_group,
)
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cring import PeerFailureError

from . import _worker, ray_logger
from ._backend import _TRANSPORTS, CRingConfig, worker_environments

logger = logging.getLogger(__name__)

# How long shutdown() waits for the workers to leave cring before killing them.
_SHUTDOWN_TIMEOUT_S = 30.0
# How often run() looks at the workers while it waits for their results.
_POLL_S = 1.0
# After a survivor reports a dead peer, how long to wait for Ray to say which
# worker died (so the error names it rather than the survivor).
_DEATH_NOTICE_S = 5.0


# The class RayExecutor(settings, min_workers=...) builds: ElasticRayExecutor,
# set by cring.ray._elastic (which imports this module, so this one cannot
# import it).
_ELASTIC_EXECUTOR: Optional[type] = None


class RayWorkerError(PeerFailureError):
    """A RayExecutor worker died (its actor or process is gone) while running a
    function. ``rank`` is its rank; the executor cannot run anything more
    until it is shut down and started again."""

    def __init__(self, message: str, rank: int) -> None:
        super().__init__(message)
        self.rank = rank


@dataclass
class RaySettings:
    """What RayExecutor.create_settings() returns (Horovod's MiniSettings).

    Attributes:
        timeout_s: bound on every wait for a peer (rendezvous and collectives),
            exported as CRING_TIMEOUT_SECONDS: a worker blocked on a dead peer
            raises within it.
        placement_group_timeout_s: how long start() waits for Ray to place
            the workers before raising.
        transport: "auto", "tcp", "shm", or None for the workers' environment.
    """

    timeout_s: float = 30.0
    placement_group_timeout_s: float = 100.0
    transport: Optional[str] = None

    def __post_init__(self) -> None:
        for name in ("timeout_s", "placement_group_timeout_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise TypeError(f"{name} must be a number of seconds, got {value!r}")
            if not value > 0:  # also rejects NaN
                raise ValueError(f"{name} must be positive, got {value!r}")
        if self.transport is not None and self.transport not in _TRANSPORTS:
            raise ValueError(
                f"transport must be one of {', '.join(_TRANSPORTS)} or None, got {self.transport!r}"
            )

    def cring_config(self) -> CRingConfig:
        return CRingConfig(timeout_s=self.timeout_s, transport=self.transport)


class _Worker:
    """One rank: a Ray actor holding the user's executable object (if any)."""

    def __init__(self) -> None:
        self.executable: Any = None

    def node_id(self) -> str:
        return _worker.node_id()

    def start_store(self, secret: str) -> tuple[str, int]:
        return _worker.start_store(secret)

    def set_env(self, env: dict[str, str], extra: dict[str, Any]) -> None:
        _worker.set_env(env)
        os.environ.update({str(k): str(v) for k, v in extra.items()})
        # a sync actor runs every method in this one thread: make its GPU current once
        _worker.set_torch_device()

    def start_executable(self, cls: Optional[type], args: list, kwargs: dict) -> None:
        self.executable = cls(*args, **kwargs) if cls is not None else None

    def execute(self, fn: Callable[[Any], Any], queue: Any = None) -> Any:
        ray_logger.configure(queue)  # the callbacks' queue of this call (None: none)
        return fn(self.executable)

    def run(self, fn: Callable[..., Any], args: list, kwargs: dict, queue: Any = None) -> Any:
        ray_logger.configure(queue)
        return fn(*args, **kwargs)

    def shutdown(self) -> None:
        _worker.shutdown()


def _positive_int(name: str, value: Any, owner: str = "RayExecutor") -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{owner}: {name} must be a positive integer, got {value!r}")
    return value


class RayExecutor:
    """Horovod's ``horovod.ray.RayExecutor`` for cring: one Ray actor per rank,
    placed with a placement group, each with cring's rank, size, local rank and
    rendezvous in its environment, so ``cring.init()`` (or ``hvd.init()`` with
    ``import cring.torch as hvd``) needs no arguments.

        settings = RayExecutor.create_settings(timeout_s=30)
        executor = RayExecutor(settings, num_workers=2, cpus_per_worker=1)
        executor.start()
        results = executor.run(train, kwargs={"epochs": 3})   # one per rank, in rank order
        executor.shutdown()

    Args:
        settings: from :meth:`create_settings`.
        num_workers: number of ranks, one bundle each, packed onto as few
            nodes as possible (placement strategy PACK).
        num_hosts, num_workers_per_host: instead of num_workers: that many
            workers on each of that many distinct nodes (STRICT_SPREAD).
        cpus_per_worker, use_gpu, gpus_per_worker: each worker's resources
            (gpus_per_worker defaults to 1 with use_gpu).
        use_current_placement_group: when called inside a placement group
            (e.g. from a Tune trial), place the workers in it instead of
            creating a new one.
        min_workers, max_workers, reset_limit: Horovod's elastic spelling:
            instead of num_workers, RayExecutor(settings, min_workers=...)
            returns an ElasticRayExecutor (not a RayExecutor) with those
            arguments and cpus_per_worker, use_gpu, gpus_per_worker.
            max_workers without a positive min_workers, or min_workers with
            num_workers or num_hosts, is a ValueError; cooldown_range is
            ignored with a warning, elastic_timeout ignored (the workers'
            waits are bounded by settings.timeout_s).
    """

    @classmethod
    def create_settings(
        cls,
        timeout_s: float = 30,
        ssh_identity_file: Optional[str] = None,
        ssh_str: Optional[str] = None,
        placement_group_timeout_s: float = 100,
        nics: Optional[set] = None,
        transport: Optional[str] = None,
    ) -> RaySettings:
        """Settings for a RayExecutor. ``ssh_identity_file``, ``ssh_str`` and
        ``nics`` are accepted for Horovod's signature and ignored with a
        warning: cring on Ray needs no SSH, and its transports pick the
        address Ray gives the node."""
        ignored = [
            n
            for n, v in (
                ("ssh_identity_file", ssh_identity_file),
                ("ssh_str", ssh_str),
                ("nics", nics),
            )
            if v is not None
        ]
        if ignored:
            warnings.warn(
                f"RayExecutor.create_settings: {', '.join(ignored)} ignored (cring on Ray "
                "uses no SSH and binds to the node address Ray reports)",
                stacklevel=2,
            )
        return RaySettings(
            timeout_s=timeout_s,
            placement_group_timeout_s=placement_group_timeout_s,
            transport=transport,
        )

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        """Horovod's elastic spelling, RayExecutor(settings, min_workers=...,
        max_workers=...), builds an ElasticRayExecutor (cring.ray._elastic
        registers it here; importing cring.ray loads both)."""
        try:
            bound = inspect.signature(cls.__init__).bind(None, *args, **kwargs)
        except TypeError:
            return super().__new__(cls)  # __init__ reports the bad call
        params = bound.arguments
        min_workers, max_workers = params.get("min_workers"), params.get("max_workers")
        if max_workers and (not min_workers or min_workers <= 0):
            raise ValueError(
                "RayExecutor: max_workers needs a positive min_workers (elastic training)"
            )
        if min_workers is None:
            return super().__new__(cls)
        if params.get("num_workers") is not None or params.get("num_hosts") is not None:
            raise ValueError(
                "RayExecutor: Both `min_workers` and `num_workers` provided. Give "
                "min_workers/max_workers (elastic) or num_workers/num_hosts (a fixed number of "
                "workers), not both"
            )
        if params.get("cooldown_range") is not None:
            warnings.warn(
                "RayExecutor: cooldown_range is ignored on Ray (a dead worker's placement group "
                "is requested again at once)",
                stacklevel=2,
            )
        if _ELASTIC_EXECUTOR is None:  # pragma: no cover - cring.ray imports both
            raise RuntimeError("RayExecutor: import cring.ray for elastic training")
        return _ELASTIC_EXECUTOR(
            params["settings"],
            min_workers=min_workers,
            max_workers=max_workers,
            cpus_per_worker=params.get("cpus_per_worker", 1),
            use_gpu=params.get("use_gpu", False),
            gpus_per_worker=params.get("gpus_per_worker"),
            reset_limit=params.get("reset_limit"),
            override_discovery=params.get("override_discovery", True),
        )

    def __init__(
        self,
        settings: RaySettings,
        num_workers: Optional[int] = None,
        num_hosts: Optional[int] = None,
        num_workers_per_host: int = 1,
        cpus_per_worker: float = 1,
        use_gpu: bool = False,
        gpus_per_worker: Optional[float] = None,
        use_current_placement_group: bool = True,
        min_workers: Optional[int] = None,
        max_workers: Optional[int] = None,
        reset_limit: Optional[int] = None,
        cooldown_range: Optional[Any] = None,
        elastic_timeout: float = 600,
        override_discovery: bool = True,
    ) -> None:
        # min_workers and the other elastic arguments: __new__ built an
        # ElasticRayExecutor instead (this __init__ then does not run)
        if not isinstance(settings, RaySettings):
            raise TypeError(
                "RayExecutor: settings must come from RayExecutor.create_settings(), got "
                f"{type(settings).__name__}"
            )
        if (num_workers is None) == (num_hosts is None):
            raise ValueError("RayExecutor: give exactly one of num_workers and num_hosts")
        if num_workers is not None:
            self.num_hosts: Optional[int] = None
            self.num_workers_per_host = 1
            self.num_workers = _positive_int("num_workers", num_workers)
        else:
            self.num_hosts = _positive_int("num_hosts", num_hosts)
            self.num_workers_per_host = _positive_int("num_workers_per_host", num_workers_per_host)
            self.num_workers = self.num_hosts * self.num_workers_per_host
        if isinstance(cpus_per_worker, bool) or not isinstance(cpus_per_worker, (int, float)):
            raise TypeError(
                f"RayExecutor: cpus_per_worker must be a number, got {cpus_per_worker!r}"
            )
        if not cpus_per_worker >= 0:
            raise ValueError(f"RayExecutor: cpus_per_worker must be >= 0, got {cpus_per_worker!r}")
        if gpus_per_worker is not None and not use_gpu:
            raise ValueError("RayExecutor: gpus_per_worker needs use_gpu=True")
        self.settings = settings
        self.cpus_per_worker = cpus_per_worker
        self.use_gpu = bool(use_gpu)
        self.gpus_per_worker = (gpus_per_worker or 1) if use_gpu else 0
        self.use_current_placement_group = use_current_placement_group
        self.workers: list[Any] = []  # the actors, in rank order
        self._placement_group: Optional[PlacementGroup] = None
        self._own_placement_group = False
        self._broken: Optional[str] = None  # why the executor cannot run any more

    # -- start --------------------------------------------------------------------

    def _place(self) -> tuple[PlacementGroup, list[int]]:
        """The placement group and each worker's bundle index (-1: any)."""
        current = get_current_placement_group() if self.use_current_placement_group else None
        if current is not None:
            return current, [-1] * self.num_workers
        per_worker = {"CPU": float(self.cpus_per_worker)}
        if self.gpus_per_worker:
            per_worker["GPU"] = float(self.gpus_per_worker)
        if self.num_hosts is None:
            bundles = [dict(per_worker) for _ in range(self.num_workers)]
            strategy, indices = "PACK", list(range(self.num_workers))
        else:
            per_host = {k: v * self.num_workers_per_host for k, v in per_worker.items()}
            bundles = [dict(per_host) for _ in range(self.num_hosts)]
            strategy = "STRICT_SPREAD"
            indices = [h for h in range(self.num_hosts) for _ in range(self.num_workers_per_host)]
        pg = placement_group(bundles, strategy=strategy)
        self._own_placement_group = True
        try:
            ray.get(pg.ready(), timeout=self.settings.placement_group_timeout_s)
        except GetTimeoutError:
            remove_placement_group(pg)
            raise TimeoutError(
                f"RayExecutor.start: Ray could not place {len(bundles)} bundles of "
                f"{bundles[0]} ({strategy}) within {self.settings.placement_group_timeout_s:g} s "
                f"(placement_group_timeout_s); the cluster has {ray.available_resources()} "
                "available. Ask for fewer workers or resources, or add nodes."
            ) from None
        return pg, indices

    def start(
        self,
        executable_cls: Optional[type] = None,
        executable_args: Optional[list] = None,
        executable_kwargs: Optional[dict] = None,
        extra_env_vars: Optional[dict] = None,
    ) -> None:
        """Place the workers, give them their ranks and rendezvous, and build
        ``executable_cls(*executable_args, **executable_kwargs)`` in each (the
        object ``execute`` passes to its function)."""
        if self.workers:
            raise RuntimeError("RayExecutor.start: already started; call shutdown() first")
        if not ray.is_initialized():
            ray.init()
        self._broken = None
        pg, indices = self._place()
        self._placement_group = pg
        actor_cls = ray.remote(_Worker)
        try:
            actors = [
                actor_cls.options(
                    num_cpus=self.cpus_per_worker,
                    num_gpus=self.gpus_per_worker,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(
                        pg, placement_group_bundle_index=index
                    ),
                ).remote()
                for index in indices
            ]
            self.workers = actors
            node_ids = self._get([a.node_id.remote() for a in actors], "report its node")
            # ranks of one node are consecutive (local ranks 0..n-1 in rank order)
            first_seen: dict[str, int] = {}
            for node in node_ids:
                first_seen.setdefault(node, len(first_seen))
            order = sorted(range(len(actors)), key=lambda i: first_seen[node_ids[i]])
            self.workers = [actors[i] for i in order]
            node_ids = [node_ids[i] for i in order]
            secret = secrets.token_hex(16)
            job_id = f"ray-{uuid.uuid4().hex[:16]}"
            addr, port = self._get([self.workers[0].start_store.remote(secret)], "start")[0]
            envs = worker_environments(
                node_ids, addr, port, secret, job_id, self.settings.cring_config()
            )
            extra = dict(extra_env_vars or {})
            self._get(
                [w.set_env.remote(env, extra) for w, env in zip(self.workers, envs)],
                "set its environment",
            )
            self._get(
                [
                    w.start_executable.remote(
                        executable_cls, list(executable_args or []), dict(executable_kwargs or {})
                    )
                    for w in self.workers
                ],
                "build its executable",
            )
        except BaseException:
            self.shutdown()
            raise
        logger.info(
            "cring: RayExecutor started %d workers, rendezvous at %s:%d (job %s)",
            len(self.workers),
            addr,
            port,
            job_id,
        )

    # -- running --------------------------------------------------------------------

    def _check_running(self, what: str) -> None:
        if not self.workers:
            raise RuntimeError(f"RayExecutor.{what}: call start() first")
        if self._broken is not None:
            raise RuntimeError(
                f"RayExecutor.{what}: {self._broken}; call shutdown() and start() again"
            )

    def _get(self, refs: list, what: str, relay: Optional[_LogRelay] = None) -> list:
        """Every result, in the order of `refs` (rank order). Raises as soon as
        one worker fails: a dead worker gives RayWorkerError naming its rank;
        an exception in the user's function is raised again as itself (Ray's
        RayTaskError subclass of it, whose message names the worker)."""
        index_of = {ref: i for i, ref in enumerate(refs)}
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=_POLL_S)
            if relay is not None:
                relay.drain()
            for ref in done:
                try:
                    ray.get(ref)
                except RayActorError as exc:
                    self._fail(index_of[ref], what, exc)
                except RayTaskError as exc:
                    cause = exc.as_instanceof_cause()
                    if isinstance(cause, PeerFailureError) and pending:
                        # a survivor noticed a dead peer: report the dead one if Ray knows it
                        self._raise_dead_worker(pending, index_of, what)
                    raise cause from None
        return ray.get(list(refs))

    def _raise_dead_worker(self, pending: list, index_of: dict, what: str) -> None:
        """If a still-pending worker turns out dead within _DEATH_NOTICE_S,
        raise RayWorkerError for it."""
        deadline = time.monotonic() + _DEATH_NOTICE_S
        while pending and time.monotonic() < deadline:
            done, pending = ray.wait(
                pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic())
            )
            for ref in done:
                try:
                    ray.get(ref)
                except RayActorError as exc:
                    self._fail(index_of[ref], what, exc)
                except RayTaskError:
                    pass

    def _fail(self, rank: int, what: str, exc: BaseException) -> None:
        self._broken = f"worker {rank} died"
        reason = str(exc).strip().splitlines()
        raise RayWorkerError(
            f"RayExecutor: worker {rank} of {len(self.workers)} died while asked to {what}: "
            f"{reason[0] if reason else type(exc).__name__}",
            rank,
        ) from exc

    def run_remote(
        self,
        fn: Callable[..., Any],
        args: Optional[list] = None,
        kwargs: Optional[dict] = None,
        _queue: Any = None,
    ) -> list:
        """Start ``fn(*args, **kwargs)`` on every worker; its ObjectRefs in rank order."""
        self._check_running("run_remote")
        args, kwargs = list(args or []), dict(kwargs or {})
        return [w.run.remote(fn, args, kwargs, _queue) for w in self.workers]

    def run(
        self,
        fn: Callable[..., Any],
        args: Optional[list] = None,
        kwargs: Optional[dict] = None,
        callbacks: Optional[list] = None,
    ) -> list:
        """``fn(*args, **kwargs)`` on every worker; the results in rank order.
        A worker that dies raises RayWorkerError here as soon as Ray reports
        it; the others, blocked on it in a collective, fail within
        ``timeout_s``. ``callbacks``: called in the driver with every value a
        worker passes to ``cring.ray.ray_logger.log`` (Horovod's)."""
        self._check_running("run")
        relay = _LogRelay.make(callbacks)
        try:
            queue = relay.queue if relay is not None else None
            return self._get(self.run_remote(fn, args, kwargs, queue), "run a function", relay)
        finally:
            if relay is not None:
                relay.close()

    def execute(self, fn: Callable[[Any], Any], callbacks: Optional[list] = None) -> list:
        """``fn(executable)`` on every worker (the object start() built); the
        results in rank order. ``callbacks`` as for run()."""
        self._check_running("execute")
        relay = _LogRelay.make(callbacks)
        try:
            queue = relay.queue if relay is not None else None
            return self._get(
                [w.execute.remote(fn, queue) for w in self.workers], "execute a function", relay
            )
        finally:
            if relay is not None:
                relay.close()

    def execute_single(self, fn: Callable[[Any], Any]) -> Any:
        """``fn(executable)`` on the rank 0 worker only; its result."""
        self._check_running("execute_single")
        return self._get([self.workers[0].execute.remote(fn)], "execute a function")[0]

    # -- shutdown -------------------------------------------------------------------

    def shutdown(self) -> None:
        """Leave cring in every live worker, stop the actors and free the
        placement group. Safe to call twice, and after a worker died."""
        workers, self.workers = self.workers, []
        if workers:
            refs = [w.shutdown.remote() for w in workers]
            ready, _ = ray.wait(refs, num_returns=len(refs), timeout=_SHUTDOWN_TIMEOUT_S)
            for ref in ready:
                try:
                    ray.get(ref)
                except Exception as exc:  # noqa: BLE001  (a dead worker: nothing to leave)
                    logger.info("cring: a worker could not leave cring: %s", exc)
            for w in workers:
                ray.kill(w)
        if self._placement_group is not None and self._own_placement_group:
            remove_placement_group(self._placement_group)
        self._placement_group = None
        self._own_placement_group = False

    def __enter__(self) -> RayExecutor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


class _LogRelay:
    """Horovod's run(..., callbacks=[...]): a Ray queue that the workers'
    ray_logger.log() puts into, drained by the driver while it waits for the
    results; every callback is called with every item, in the driver."""

    def __init__(self, callbacks: list) -> None:
        from ray.util.queue import Queue

        self.callbacks = callbacks
        self.queue = Queue(actor_options={"num_cpus": 0})

    @classmethod
    def make(cls, callbacks: Optional[list]) -> Optional[_LogRelay]:
        if not callbacks:
            return None
        callbacks = list(callbacks)
        for cb in callbacks:
            if not callable(cb):
                raise TypeError(f"callbacks must be callable, got {cb!r}")
        return cls(callbacks)

    def drain(self) -> None:
        n = self.queue.qsize()
        if n:
            for item in self.queue.get_nowait_batch(n):
                for cb in self.callbacks:
                    cb(item)

    def close(self) -> None:
        try:
            self.drain()
        finally:
            self.queue.shutdown()

"""ElasticRayExecutor: elastic training on Ray actors, the launcher's part of
cring.elastic (what `cringrun --elastic` does for processes) done by the driver.

It serves the job's rendezvous store in the driver, places each worker with
its own one-bundle placement group, publishes generation records
(cring._elastic_protocol) when workers die or can be placed again, and
collects the results. The workers run cring.elastic unchanged; this module
never runs a collective and never touches training state. It stays one
file (~740 lines) because its subject is one state machine, the generations
of one job; host discovery's planning is in _hosts.py.
"""

from __future__ import annotations

import json
import logging
import math
import secrets
import time
import uuid
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import ray
from ray.exceptions import RayActorError, RayTaskError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from cring import _C
from cring import _elastic_protocol as protocol

from . import _executor, _hosts
from ._backend import worker_environments
from ._executor import (
    _POLL_S,
    _SHUTDOWN_TIMEOUT_S,
    RaySettings,
    RayWorkerError,
    _LogRelay,
    _positive_int,
    _Worker,
)

logger = logging.getLogger(__name__)

# Once min_workers are placed, how long start() waits for the other groups.
_START_GRACE_S = 5.0


@dataclass
class ElasticRaySettings(RaySettings):
    """What ElasticRayExecutor.create_settings() returns (Horovod's
    ElasticSettings): RaySettings plus the elastic bounds, which the
    executor takes unless given its own min_workers/max_workers/reset_limit.

    Attributes (besides RaySettings'): min_num_proc, max_num_proc (None: as
    many workers as the cluster's resources hold at start(), or, with a
    discovery, as many as it offers), reset_limit, elastic_timeout (with a
    discovery: how long start() waits for min_num_proc workers), verbose
    (kept for Horovod's code, unused), discovery (Horovod's host-discovery
    object, used with ``override_discovery=False``; see ElasticRayExecutor).
    """

    min_num_proc: int = 1
    max_num_proc: Optional[int] = None
    reset_limit: Optional[int] = None
    elastic_timeout: float = 600
    verbose: Any = None
    discovery: Any = None


@dataclass
class _Member:
    worker_id: int
    actor: Any
    group: PlacementGroup
    node_id: str = ""
    host: str = ""  # the discovered host it was placed on (discovery mode)
    ref: Any = None  # the running call, while it runs
    added_in: int = 0  # the generation it was started for
    result: Any = field(default=None)
    done: bool = False


class ElasticRayExecutor:
    """Elastic training on Ray, as Horovod's elastic RayExecutor: workers that
    die leave the job, the others go on from their last ``state.commit()``,
    and workers are added back (up to ``max_workers``) when Ray can place
    them again. The training function uses ``cring.elastic`` (or
    ``cring.torch.elastic``) exactly as under ``cringrun --elastic``:

        def train():
            import cring, cring.elastic
            cring.init()

            @cring.elastic.run
            def loop(state):
                while state.step < 100:
                    ...
                    state.step += 1
                    state.commit()
                return state.step

            return loop(cring.elastic.ObjectState(step=0))

        executor = ElasticRayExecutor(RayExecutor.create_settings(timeout_s=30),
                                      min_workers=1, max_workers=4)
        # or Horovod's spellings:
        #   ElasticRayExecutor(ElasticRayExecutor.create_settings(min_num_proc=1,
        #                      max_num_proc=4), cpus_per_slot=1)
        #   RayExecutor(RayExecutor.create_settings(), min_workers=1, max_workers=4)
        executor.start()
        results = executor.run(train)      # one per worker of the last generation
        executor.shutdown()

    Each worker has its own one-bundle placement group. When a worker dies
    its group is removed and a new one requested: a worker is started in it
    (a new generation, "added") as soon as Ray places it, so the job grows
    back when the resources return. Fewer than ``min_workers`` left, or more
    than ``reset_limit`` new generations, ends ``run`` with RayWorkerError.

    Arguments: ``min_workers`` (default 1), ``max_workers`` (default: as
    many as the cluster's CPUs, and GPUs with use_gpu, hold at start(), at
    least min_workers), ``cpus_per_worker`` (default 1), ``use_gpu``,
    ``gpus_per_worker`` (default 1 with use_gpu), ``reset_limit``. With
    settings from :meth:`create_settings` the bounds default to the
    settings'. Horovod's names are accepted: ``cpus_per_slot``,
    ``gpus_per_slot`` (the same as the ``*_per_worker`` ones; not both),
    ``env_vars`` (added to every worker's environment) and
    ``override_discovery``.

    Host discovery (Horovod's ``settings.discovery`` with
    ``override_discovery=False``): an object whose
    ``find_available_hosts_and_slots()`` returns ``{host: slots}``, asked
    every ``cring.ray.elastic.DISCOVER_HOSTS_FREQUENCY_SECS`` (1 s). Each
    worker is placed on its host through the Ray resource ``node:<host>``
    (every Ray node has one for its address; Horovod's convention, so a
    cluster may also declare such custom resources), up to the host's slots
    and ``max_workers`` in all; a host that leaves the map, or offers fewer
    slots, has its newest workers stopped (a new generation, as for a death).
    start() waits up to ``elastic_timeout`` for ``min_workers``. With the
    default ``override_discovery=True`` a ``settings.discovery`` is ignored
    (with a warning), as Horovod replaces it with its RayHostDiscovery:
    without a discovery workers go wherever Ray's resources allow.
    """

    @staticmethod
    def create_settings(
        min_num_proc: int = 1,
        max_num_proc: Optional[int] = None,
        reset_limit: Optional[int] = None,
        elastic_timeout: float = 600,
        timeout_s: float = 30,
        ssh_identity_file: Optional[str] = None,
        nics: Optional[set] = None,
        min_np: Optional[int] = None,
        max_np: Optional[int] = None,
        placement_group_timeout_s: float = 100,
        transport: Optional[str] = None,
        **kwargs: Any,
    ) -> ElasticRaySettings:
        """Horovod's ElasticRayExecutor.create_settings: the elastic bounds
        and RaySettings' timeouts. ``min_np``/``max_np`` are the deprecated
        spellings of ``min_num_proc``/``max_num_proc``; ``verbose`` is
        accepted; ``ssh_identity_file``, ``nics`` and other Horovod settings
        are ignored with a warning (no SSH on Ray)."""
        if min_np is not None:
            warnings.warn(
                "min_np is deprecated, use min_num_proc", DeprecationWarning, stacklevel=2
            )
            min_num_proc = min_np
        if max_np is not None:
            warnings.warn(
                "max_np is deprecated, use max_num_proc", DeprecationWarning, stacklevel=2
            )
            max_num_proc = max_np
        verbose = kwargs.pop("verbose", None)
        ignored = sorted(kwargs) + [
            n
            for n, v in (("ssh_identity_file", ssh_identity_file), ("nics", nics))
            if v is not None
        ]
        if ignored:
            warnings.warn(
                f"ElasticRayExecutor.create_settings: {', '.join(ignored)} ignored on cring",
                stacklevel=2,
            )
        _positive_int("min_num_proc", min_num_proc, "ElasticRayExecutor.create_settings")
        if max_num_proc is not None:
            _positive_int("max_num_proc", max_num_proc, "ElasticRayExecutor.create_settings")
        return ElasticRaySettings(
            timeout_s=timeout_s,
            placement_group_timeout_s=placement_group_timeout_s,
            transport=transport,
            min_num_proc=min_num_proc,
            max_num_proc=max_num_proc,
            reset_limit=reset_limit,
            elastic_timeout=elastic_timeout,
            verbose=verbose,
        )

    def __init__(
        self,
        settings: RaySettings,
        min_workers: Optional[int] = None,
        max_workers: Optional[int] = None,
        cpus_per_worker: Optional[float] = None,
        use_gpu: bool = False,
        gpus_per_worker: Optional[float] = None,
        reset_limit: Optional[int] = None,
        *,
        cpus_per_slot: Optional[float] = None,
        gpus_per_slot: Optional[float] = None,
        env_vars: Optional[dict] = None,
        override_discovery: bool = True,
    ) -> None:
        if not isinstance(settings, RaySettings):
            raise TypeError(
                "ElasticRayExecutor: settings must come from ElasticRayExecutor.create_settings() "
                f"or RayExecutor.create_settings(), got {type(settings).__name__}"
            )
        discovery = getattr(settings, "discovery", None)
        if not override_discovery:
            if discovery is None or not callable(
                getattr(discovery, "find_available_hosts_and_slots", None)
            ):
                raise ValueError(
                    "ElasticRayExecutor: override_discovery=False needs settings.discovery, an "
                    "object with find_available_hosts_and_slots() -> {host: slots}; got "
                    f"{discovery!r}"
                )
        elif discovery is not None:
            warnings.warn(
                "ElasticRayExecutor: settings.discovery is ignored with override_discovery=True "
                "(as in Horovod); pass override_discovery=False to use it",
                stacklevel=2,
            )
            discovery = None
        self._discovery = discovery
        if isinstance(settings, ElasticRaySettings):
            min_workers = settings.min_num_proc if min_workers is None else min_workers
            max_workers = settings.max_num_proc if max_workers is None else max_workers
            reset_limit = settings.reset_limit if reset_limit is None else reset_limit
        for ours, horovods, value in (
            ("cpus_per_worker", "cpus_per_slot", (cpus_per_worker, cpus_per_slot)),
            ("gpus_per_worker", "gpus_per_slot", (gpus_per_worker, gpus_per_slot)),
        ):
            if value[0] is not None and value[1] is not None:
                raise ValueError(
                    f"ElasticRayExecutor: give {ours} or Horovod's {horovods}, not both"
                )
        cpus_per_worker = cpus_per_slot if cpus_per_worker is None else cpus_per_worker
        cpus_per_worker = 1 if cpus_per_worker is None else cpus_per_worker
        gpus_per_worker = gpus_per_slot if gpus_per_worker is None else gpus_per_worker
        min_workers = 1 if min_workers is None else min_workers
        self.min_workers = _positive_int("min_workers", min_workers, "ElasticRayExecutor")
        if max_workers is not None:
            _positive_int("max_workers", max_workers, "ElasticRayExecutor")
            if max_workers < self.min_workers:
                raise ValueError(
                    f"ElasticRayExecutor: max_workers ({max_workers}) < min_workers ({min_workers})"
                )
        # None: what the cluster holds, decided at start()
        self.max_workers: Optional[int] = max_workers
        if reset_limit is not None and (
            isinstance(reset_limit, bool) or not isinstance(reset_limit, int) or reset_limit < 0
        ):
            raise ValueError(f"ElasticRayExecutor: reset_limit must be >= 0, got {reset_limit!r}")
        if gpus_per_worker is not None and not use_gpu:
            raise ValueError(
                "ElasticRayExecutor: gpus_per_worker (gpus_per_slot) needs use_gpu=True"
            )
        if use_gpu and gpus_per_worker is not None and not gpus_per_worker > 0:
            raise ValueError(
                f"ElasticRayExecutor: gpus_per_worker must be > 0, got {gpus_per_worker!r}"
            )
        if isinstance(cpus_per_worker, bool) or not isinstance(cpus_per_worker, (int, float)):
            raise TypeError(
                f"ElasticRayExecutor: cpus_per_worker must be a number, got {cpus_per_worker!r}"
            )
        self.settings = settings
        self.cpus_per_worker = cpus_per_worker
        self.use_gpu = bool(use_gpu)
        self.gpus_per_worker = (gpus_per_worker or 1) if use_gpu else 0
        self.reset_limit = reset_limit
        self.env_vars = {str(k): str(v) for k, v in (env_vars or {}).items()}
        self.members: list[_Member] = []  # the current generation, in rank order
        self.generation = -1
        self.resets = 0
        self._waiting: dict[Any, PlacementGroup] = {}  # ready() ref -> group not yet placed
        self._group_host: dict[Any, str] = {}  # placement group id -> its host (discovery)
        self._next_discovery_s = 0.0
        self._discovered: dict = {}  # the discovery's last answer
        self._discovery_failing = False
        self._next_worker_id = 0
        self._store: Any = None
        self._client: Optional[protocol.StoreClient] = None
        self._keys: Optional[protocol.Keys] = None
        self._addr = ""
        self._secret = ""
        self._job_id = ""
        self._executable: tuple = (None, [], {})
        self._extra_env: dict = {}
        self._next_request = 1
        self._broken: Optional[str] = None
        self._started = False
        self._max_workers_given = max_workers

    def _cluster_capacity(self) -> int:
        """Workers the whole cluster holds (CPUs, and GPUs with use_gpu), at least min_workers."""
        resources = ray.cluster_resources()
        n = math.inf
        if self.cpus_per_worker:
            n = resources.get("CPU", 0) // self.cpus_per_worker
        if self.gpus_per_worker:
            n = min(n, resources.get("GPU", 0) // self.gpus_per_worker)
        return max(self.min_workers, int(n) if n != math.inf else self.min_workers)

    @property
    def workers(self) -> list:
        """The actors of the current generation, in rank order."""
        return [m.actor for m in self.members]

    # -- placement and generations -----------------------------------------------------

    def _bundle(self, host: str = "") -> dict:
        """What one worker asks Ray for."""
        bundle = {"CPU": float(self.cpus_per_worker)}
        if self.gpus_per_worker:
            bundle["GPU"] = float(self.gpus_per_worker)
        if host:
            bundle.update(_hosts.host_resource(host))
        return bundle

    def _request_group(self, host: str = "") -> None:
        group = placement_group([self._bundle(host)], strategy="PACK")
        self._waiting[group.ready()] = group
        if host:
            self._group_host[group.id] = host

    def _cancel_group(self, ref: Any) -> None:
        group = self._waiting.pop(ref)
        self._group_host.pop(group.id, None)
        remove_placement_group(group)

    def _rediscover(self, running: list[tuple[Any, str]]) -> list:
        """Discovery mode, when a poll is due: ask the discovery for hosts,
        cancel the requests beyond each host's slots, request workers for
        free slots up to max_workers, and return the keys of `running`
        ((key, host) of the workers placed, oldest first) that must stop."""
        now = time.monotonic()
        if self._discovery is None or now < self._next_discovery_s:
            return []
        self._next_discovery_s = now + float(_hosts.DISCOVER_HOSTS_FREQUENCY_SECS)
        try:
            slots = dict(self._discovery.find_available_hosts_and_slots())
        except Exception as exc:  # a flaky discovery: keep what we have, try again
            log = logger.debug if self._discovery_failing else logger.warning
            log("cring: host discovery failed (%r); keeping the workers, asking again", exc)
            self._discovery_failing = True
            return []
        self._discovery_failing = False
        self._discovered = slots
        stop, cancel, hosts = _hosts.plan(
            slots,
            running,
            [(ref, self._group_host.get(g.id, "")) for ref, g in self._waiting.items()],
            self.max_workers,
        )
        for ref in cancel:
            self._cancel_group(ref)
        for host in hosts:
            self._request_group(host)
        return stop

    def _placed_groups(self, timeout_s: float) -> list[PlacementGroup]:
        """Groups Ray has placed (waiting at most timeout_s for the first)."""
        if not self._waiting:
            return []
        refs = list(self._waiting)
        done, _ = ray.wait(refs, num_returns=1, timeout=timeout_s)
        if done:
            done, _ = ray.wait(refs, num_returns=len(refs), timeout=0)
        return [self._waiting.pop(ref) for ref in done]

    def _spawn(self, groups: list[PlacementGroup]) -> list[_Member]:
        actor_cls = ray.remote(_Worker)
        added = []
        for group in groups:
            host = self._group_host.pop(group.id, "")
            actor = actor_cls.options(
                num_cpus=self.cpus_per_worker,
                num_gpus=self.gpus_per_worker,
                max_restarts=0,
                scheduling_strategy=PlacementGroupSchedulingStrategy(group, 0),
            ).remote()
            added.append(_Member(self._next_worker_id, actor, group, host=host))
            self._next_worker_id += 1
        for member, node in zip(added, ray.get([m.actor.node_id.remote() for m in added])):
            member.node_id = node
        return added

    def _publish(self, carried: list[_Member], added: list[_Member], reason: str) -> None:
        """Form generation +1 = carried + added: give the added workers their
        environment and executable, then publish the record."""
        generation = self.generation + 1
        members = carried + added
        for m in added:
            m.added_in = generation
        if added:
            envs = worker_environments(
                [m.node_id for m in members],
                self._addr,
                int(self._store.port),
                self._secret,
                self._job_id,
                self.settings.cring_config(),
            )
            first = len(carried)
            calls = []
            for m, env in zip(added, envs[first:]):
                env.update(
                    CRING_ELASTIC="1",
                    CRING_ELASTIC_WORKER_ID=str(m.worker_id),
                    CRING_ELASTIC_GENERATION=str(generation),
                )
                calls.append(m.actor.set_env.remote(env, self._extra_env))
                calls.append(m.actor.start_executable.remote(*self._executable))
            ray.get(calls)
        assert self._client is not None and self._keys is not None
        record = protocol.make_record(
            generation, [m.worker_id for m in members], [m.worker_id for m in added], reason
        )
        self._client.set(self._keys.generation(generation), record)
        self._client.set(self._keys.latest, str(generation).encode())
        if generation > 0:
            self.resets += 1
        self.generation = generation
        self.members = members
        logger.info(
            "cring: elastic generation %d: %d workers (%s)", generation, len(members), reason
        )

    # -- start ------------------------------------------------------------------------

    def start(
        self,
        executable_cls: Optional[type] = None,
        executable_args: Optional[list] = None,
        executable_kwargs: Optional[dict] = None,
        extra_env_vars: Optional[dict] = None,
    ) -> None:
        """Serve the store, request max_workers placement groups and start
        the first generation with those Ray places: at least min_workers
        within placement_group_timeout_s (else TimeoutError), and the others
        that Ray places within 5 s more (later ones join while run() runs)."""
        if self._started:
            raise RuntimeError("ElasticRayExecutor.start: already started; call shutdown() first")
        if not ray.is_initialized():
            ray.init()
        self._started = True
        self._broken = None
        self._executable = (
            executable_cls,
            list(executable_args or []),
            dict(executable_kwargs or {}),
        )
        self._extra_env = {**self.env_vars, **dict(extra_env_vars or {})}
        if self._max_workers_given is None and self._discovery is None:
            self.max_workers = self._cluster_capacity()
        self._secret = secrets.token_hex(16)
        self._job_id = f"ray-elastic-{uuid.uuid4().hex[:12]}"
        self._keys = protocol.Keys(self._job_id)
        self._addr = ray.util.get_node_ip_address()
        placed: list[PlacementGroup] = []  # placed, no worker yet: freed here on failure
        try:
            self._store = _C.StoreServer(self._addr, 0, self._secret)
            self._client = protocol.StoreClient(
                self._addr, int(self._store.port), self._secret, 10.0
            )
            if self._discovery is None:
                for _ in range(self.max_workers):
                    self._request_group()
                timeout_s = self.settings.placement_group_timeout_s
                what = "placement_group_timeout_s"
            else:
                self._next_discovery_s = 0.0
                timeout_s = getattr(self.settings, "elastic_timeout", 600.0)
                what = "elastic_timeout"
            deadline = time.monotonic() + timeout_s
            while len(placed) < self.min_workers:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(self._unplaced_message(len(placed), timeout_s, what))
                if self._discovery is not None:
                    gone = set(self._rediscover([(g, self._group_host[g.id]) for g in placed]))
                    for g in gone:
                        self._group_host.pop(g.id, None)
                        remove_placement_group(g)
                    placed = [g for g in placed if g not in gone]
                    left = min(left, max(0.0, self._next_discovery_s - time.monotonic()))
                    if not self._waiting:
                        time.sleep(left)  # nothing to wait for until the next poll
                        continue
                placed += self._placed_groups(left)
            # the others get a short grace, so that a free cluster starts at max_workers
            grace_end = min(deadline, time.monotonic() + _START_GRACE_S)
            while self._waiting and time.monotonic() < grace_end:
                placed += self._placed_groups(max(0.0, grace_end - time.monotonic()))
            members, placed = self._spawn(placed), []
            self._publish([], members, "start")
        except BaseException:
            for g in placed:
                self._group_host.pop(g.id, None)
                remove_placement_group(g)
            self.shutdown()
            raise

    def _unplaced_message(self, placed: int, timeout_s: float, what: str) -> str:
        per_worker = self._bundle()
        hosts = ""
        if self._discovery is not None:
            hosts = (
                f"; the discovery offered {self._discovered or 'no hosts'} (each worker also "
                "asks for 0.01 of the resource node:<host>)"
            )
        return (
            f"ElasticRayExecutor.start: Ray placed {placed} of min_workers={self.min_workers} "
            f"workers within {timeout_s:g} s ({what}); each worker asks for {per_worker}"
            f"{hosts}; the cluster has {ray.available_resources()} available of "
            f"{ray.cluster_resources()}. Ask for fewer workers or resources per worker, or "
            "add nodes."
        )

    # -- running ----------------------------------------------------------------------

    def _call(self, member: _Member, call: tuple) -> None:
        method, args = call
        member.ref = getattr(member.actor, method).remote(*args)
        member.done = False

    def _may_reset(self) -> bool:
        return self.reset_limit is None or self.resets < self.reset_limit

    def _fail(self, message: str, rank: int, cause: Optional[BaseException] = None) -> None:
        self._broken = message
        raise RayWorkerError(f"ElasticRayExecutor: {message}", rank) from cause

    def _requests(self) -> Optional[str]:
        """A worker's request for a new generation (after a time-out), if any."""
        assert self._client is not None and self._keys is not None
        reason = None
        while True:
            value = self._client.get(self._keys.request(self._next_request), 0.0)
            if value is None:
                return reason
            self._next_request += 1
            try:
                request = json.loads(value)
            except ValueError:
                continue
            if isinstance(request, dict) and request.get("generation") == self.generation:
                reason = f"worker {request.get('worker')} asked ({request.get('reason', '')})"

    def _finish(self, finished: _Member) -> None:
        """A worker returned: no generation follows; workers started for a
        generation the others never formed are stopped."""
        assert self._client is not None and self._keys is not None
        reason = f"worker {finished.worker_id} has finished, so the job is ending"
        self._client.set(
            self._keys.generation(self.generation + 1),
            protocol.make_final_record(self.generation + 1, reason),
        )
        for group in self._waiting.values():
            remove_placement_group(group)
        self._waiting.clear()
        formed = self._client.get(self._keys.formed(self.generation), 0.0) is not None
        if self.generation > 0 and not formed:
            for m in [m for m in self.members if m.added_in == self.generation and not m.done]:
                logger.info("cring: stopping worker %d, started too late", m.worker_id)
                self.members.remove(m)
                ray.kill(m.actor)
                remove_placement_group(m.group)

    def _loop(self, call: tuple, relay: Optional[_LogRelay] = None) -> list:
        for m in self.members:
            self._call(m, call)
        finishing = False
        while True:
            running = {m.ref: m for m in self.members if not m.done}
            if not running:
                return [m.result for m in self.members]
            growing = not finishing and self._may_reset()
            waits = list(running) + (list(self._waiting) if growing else [])
            poll_s = _POLL_S
            if self._discovery is not None and growing:
                poll_s = min(poll_s, max(0.0, self._next_discovery_s - time.monotonic()))
            ready, _ = ray.wait(waits, num_returns=1, timeout=poll_s)
            if relay is not None:
                relay.drain()
            if ready:
                ready, _ = ray.wait(waits, num_returns=len(waits), timeout=0)
            dead: list[tuple[_Member, Optional[BaseException], str]] = []
            for ref in ready:
                m = running.get(ref)
                if m is None or m not in self.members:  # a group ref, or a worker stopped
                    continue
                try:
                    m.result, m.done = ray.get(ref), True
                except RayActorError as exc:
                    dead.append((m, exc, "died"))
                    continue
                except RayTaskError as exc:
                    self._broken = f"worker {m.worker_id} raised"
                    raise exc.as_instanceof_cause() from None
                if not finishing:
                    finishing = True
                    self._finish(m)
            if growing and not finishing:
                for m in self._rediscover([(m, m.host) for m in self.members if not m.done]):
                    ray.kill(m.actor)  # its host left the discovered set, or has fewer slots
                    dead.append((m, None, f"stopped (host {m.host} offers fewer slots)"))
            if dead:
                ranks = {id(m): r for r, m in enumerate(self.members)}
                what = "; ".join(
                    f"worker {m.worker_id} (rank {ranks[id(m)]} of {len(self.members)}) {verb}"
                    for m, _, verb in dead
                )
                for m, _, _ in dead:
                    self.members.remove(m)
                    remove_placement_group(m.group)
                if finishing:
                    self._fail(f"{what} after another finished", ranks[id(dead[0][0])], dead[0][1])
                if len(self.members) < self.min_workers:
                    self._fail(
                        f"{what}; {len(self.members)} left, fewer than min_workers="
                        f"{self.min_workers}",
                        ranks[id(dead[0][0])],
                        dead[0][1],
                    )
                if not self._may_reset():
                    self._fail(
                        f"{what}; reset_limit={self.reset_limit} reached",
                        ranks[id(dead[0][0])],
                        dead[0][1],
                    )
                for _ in dead:  # placed again when Ray can: the job grows back
                    if self._discovery is None and (
                        len(self.members) + len(self._waiting) < self.max_workers
                    ):
                        self._request_group()  # (with a discovery: at its next poll)
            placed = self._placed_groups(0) if not finishing and self._may_reset() else []
            added = self._spawn(placed) if placed else []
            reason = None
            if dead:
                reason = what
            elif added:
                reason = f"{len(added)} added"
            elif not finishing and self._may_reset():
                reason = self._requests()
            if reason is not None:
                self._publish(list(self.members), added, reason)
                for m in added:
                    self._call(m, call)

    def _check_running(self, what: str) -> None:
        if not self._started or not self.members:
            raise RuntimeError(f"ElasticRayExecutor.{what}: call start() first")
        if self._broken is not None:
            raise RuntimeError(
                f"ElasticRayExecutor.{what}: {self._broken}; call shutdown() and start() again"
            )

    def run(
        self,
        fn: Callable[..., Any],
        args: Optional[list] = None,
        kwargs: Optional[dict] = None,
        callbacks: Optional[list] = None,
    ) -> list:
        """``fn(*args, **kwargs)`` on every worker, including those added
        while it runs; the results of the last generation's workers, in rank
        order. ``fn`` should call ``cring.init()`` and a function decorated
        with ``cring.elastic.run``. ``callbacks``: called in the driver with
        every value a worker passes to ``cring.ray.ray_logger.log``."""
        self._check_running("run")
        return self._relayed(
            callbacks, lambda q: ("run", (fn, list(args or []), dict(kwargs or {}), q))
        )

    def execute(self, fn: Callable[[Any], Any], callbacks: Optional[list] = None) -> list:
        """``fn(executable)`` on every worker, elastic as run()."""
        self._check_running("execute")
        return self._relayed(callbacks, lambda q: ("execute", (fn, q)))

    def _relayed(self, callbacks: Optional[list], call: Callable[[Any], tuple]) -> list:
        relay = _LogRelay.make(callbacks)
        try:
            return self._loop(call(relay.queue if relay is not None else None), relay)
        finally:
            if relay is not None:
                relay.close()

    # -- shutdown -------------------------------------------------------------------

    def shutdown(self) -> None:
        """Stop every worker, free the placement groups and the store."""
        members, self.members = self.members, []
        # a worker still inside run() (after a failure) cannot leave cring: it is only killed
        idle = [m for m in members if m.ref is None or m.done]
        if idle:
            refs = [m.actor.shutdown.remote() for m in idle]
            ray.wait(refs, num_returns=len(refs), timeout=_SHUTDOWN_TIMEOUT_S)
        if members:
            for m in members:
                ray.kill(m.actor)
                remove_placement_group(m.group)
        for group in self._waiting.values():
            remove_placement_group(group)
        self._waiting.clear()
        self._group_host.clear()
        if self._client is not None:
            self._client.close()
            self._client = None
        if self._store is not None:
            self._store.stop()
            self._store = None
        self._started = False
        self.generation = -1
        self.resets = 0

    def __enter__(self) -> ElasticRayExecutor:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()


# RayExecutor(settings, min_workers=...), Horovod's elastic spelling, builds one of these.
_executor._ELASTIC_EXECUTOR = ElasticRayExecutor

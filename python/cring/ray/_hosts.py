"""Host discovery for ElasticRayExecutor (Horovod's ``settings.discovery`` with
``override_discovery=False``): the discovery classes Horovod's Ray modules
export, and the plan that turns a discovered {host: slots} map into workers to
request and workers to stop. Only bookkeeping here: the executor (_elastic.py)
places, starts and stops the workers.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Iterable
from typing import Any, Optional

import ray

__all__ = [
    "DISCOVER_HOSTS_FREQUENCY_SECS",
    "HostDiscovery",
    "RayHostDiscovery",
    "TestDiscovery",
    "host_resource",
    "plan",
]

logger = logging.getLogger(__name__)

# How often ElasticRayExecutor asks a custom discovery for hosts (Horovod's
# name and default; read at every poll, so a test may patch it).
DISCOVER_HOSTS_FREQUENCY_SECS = 1.0


def host_resource(host: str) -> dict:
    """What a worker on `host` asks of Ray besides CPUs and GPUs: a sliver of the
    node resource Ray gives every node (``node:<ip>``), or of a custom resource
    of that name (Horovod's convention)."""
    return {f"node:{host}": 0.01}


class HostDiscovery:
    """Horovod's host discovery interface (horovod.runner.elastic.discovery):
    find_available_hosts_and_slots() -> {host name: slots}."""

    def find_available_hosts_and_slots(self) -> dict:
        raise NotImplementedError()


class RayHostDiscovery(HostDiscovery):
    """Horovod's RayHostDiscovery: every live Ray node (by its address) with as
    many slots as its CPUs (and, with use_gpu, GPUs) hold. Takes Horovod's
    two spellings: ``cpus_per_slot``/``gpus_per_slot`` (horovod.ray.elastic) and
    ``cpus_per_worker``/``gpus_per_worker`` (horovod.ray.elastic_v2), in the same
    positions."""

    def __init__(
        self,
        use_gpu: bool = False,
        cpus_per_worker: float = 1,
        gpus_per_worker: float = 1,
        *,
        cpus_per_slot: Optional[float] = None,
        gpus_per_slot: Optional[float] = None,
    ) -> None:
        self.use_gpu = bool(use_gpu)
        self.cpus_per_worker = cpus_per_worker if cpus_per_slot is None else cpus_per_slot
        self.gpus_per_worker = gpus_per_worker if gpus_per_slot is None else gpus_per_slot
        self.cpus_per_slot, self.gpus_per_slot = self.cpus_per_worker, self.gpus_per_worker

    def find_available_hosts_and_slots(self) -> dict:
        hosts = {}
        for node in ray.nodes():
            if not node.get("alive", node.get("Alive", False)):
                continue
            resources = node.get("Resources", {})
            slots = resources.get("CPU", 0) // self.cpus_per_worker if self.cpus_per_worker else 0
            if self.use_gpu:
                slots = min(slots, resources.get("GPU", 0) // self.gpus_per_worker)
            slots = int(slots)
            if slots:
                hosts[node["NodeManagerAddress"]] = slots
        return hosts


class TestDiscovery(RayHostDiscovery):
    """Horovod's TestDiscovery (examples/ray/basic_ray_elastic.py): the Ray
    nodes, of which one is left out, or taken back, every change_frequency_s
    seconds at random, keeping between min_hosts and max_hosts. Only the
    graceful form: _graceful=False (which kills Ray nodes through the
    autoscaler) is refused."""

    __test__ = False  # not a pytest class

    def __init__(
        self,
        min_hosts: int,
        max_hosts: int,
        change_frequency_s: float,
        use_gpu: bool = False,
        cpus_per_slot: float = 1,
        gpus_per_slot: float = 1,
        verbose: bool = True,
        _graceful: bool = True,
    ) -> None:
        if not _graceful:
            raise NotImplementedError(
                "TestDiscovery(_graceful=False) kills Ray nodes through the autoscaler; cring "
                "supports the graceful form only (hosts are left out of the discovered set)"
            )
        super().__init__(use_gpu, cpus_per_slot, gpus_per_slot)
        self._min_hosts, self._max_hosts = int(min_hosts), int(max_hosts)
        self._change_frequency_s = float(change_frequency_s)
        self._last_change_s: Optional[float] = None
        self.verbose = verbose
        self._removed: set = set()

    def find_available_hosts_and_slots(self) -> dict:
        now = time.monotonic()
        hosts = super().find_available_hosts_and_slots()
        self._removed &= set(hosts)
        if self._last_change_s is None:
            self._last_change_s = now
        elif now - self._last_change_s >= self._change_frequency_s:
            self._last_change_s = now
            present = [h for h in hosts if h not in self._removed]
            if len(present) <= self._min_hosts or (
                len(present) < self._max_hosts and self._removed and random.random() < 0.5
            ):
                if self._removed:
                    self._removed.discard(random.choice(sorted(self._removed)))
            elif present:
                self._removed.add(random.choice(present))
        found = {h: n for h, n in hosts.items() if h not in self._removed}
        if self.verbose:
            logger.info("TestDiscovery: %d hosts: %s", len(found), found)
        return found


def plan(
    slots: dict,
    members: Iterable[tuple[Any, str]],
    waiting: Iterable[tuple[Any, str]],
    max_workers: Optional[int],
) -> tuple[list, list, list]:
    """What to do about a discovered {host: slots} map.

    members, waiting: (key, host) of the running workers (oldest first) and of
    the placement requests not yet placed. Returns (members to stop, requests
    to cancel, hosts to request one worker each on): workers and requests
    beyond a host's slots go (requests first, then the newest workers), and
    free slots are filled in discovery order up to max_workers in all."""
    members, waiting = list(members), list(waiting)
    per_host: dict = {}
    for key, host in members:
        per_host.setdefault(host, [[], []])[0].append(key)
    for key, host in waiting:
        per_host.setdefault(host, [[], []])[1].append(key)
    stop, cancel = [], []
    for host, (running, pending) in per_host.items():
        room = max(0, int(slots.get(host, 0)))
        while pending and len(running) + len(pending) > room:
            cancel.append(pending.pop())
        while len(running) > room:
            stop.append(running.pop())
    kept = sum(len(r) + len(p) for r, p in per_host.values())
    budget = float("inf") if max_workers is None else max(0, max_workers - kept)
    requests = []
    for host, n in slots.items():
        running, pending = per_host.get(host, [[], []])
        for _ in range(max(0, int(n) - len(running) - len(pending))):
            if len(requests) >= budget:
                return stop, cancel, requests
            requests.append(host)
    return stop, cancel, requests

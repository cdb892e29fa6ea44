"""The Ray cluster the Ray tests run on: LocalCluster (ray.init of a new local
instance with this checkout's cring importable on its workers) and the one
cluster that every Ray test module of a pytest process shares (shared()),
started on first use and stopped by the last Ray test (test_ray's
test_no_ray_processes_left, or conftest when a run ends sooner), with a check
that none of its processes is left. Starting a cluster costs about 10 s; the
Ray tests used to start four.

The shared cluster has SHARED_CPUS logical CPUs and SHARED_GPUS declared GPUs
(that this CPU machine does not have), no dashboard. A module that needs a
smaller cluster reserves the rest with a placement group (test_ray_elastic)."""

from __future__ import annotations

import os
import time
import uuid
from pathlib import Path
from typing import Optional

import ray

import cring

WORKERS = Path(__file__).parent / "workers"
CRING_PATH = Path(cring.__file__).resolve().parent.parent  # the cring the tests import
RAY_CLEANUP_TIMEOUT_S = 30
SHARED_CPUS = 4
SHARED_GPUS = 2
# Ray Train's controller polls its workers this often (default 2 s): each
# report, the end of a run and a dead worker wait for the next poll. A fit
# here reports every epoch, so polling 10 times faster halves the time of the
# longer ones. Set in the environment of the tests' Ray instances (ray.init
# passes it to every Ray process); a value already set wins.
RAY_SETTINGS = {"RAY_TRAIN_HEALTH_CHECK_INTERVAL_S": "0.2"}

MARKER_VARIABLE = "CRING_TEST_RAY_CLUSTER"  # in the environment of one LocalCluster's processes


def _environ_has(pid: int, marker: bytes) -> bool:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return marker in f.read().split(b"\0")
    except OSError:  # gone, or another user's
        return False


def ray_processes(marker: str) -> dict[int, str]:
    """pid -> description of every process of the Ray instance whose processes
    carry `marker` (MARKER_VARIABLE=<marker>, which LocalCluster puts in the
    environment they inherit): gcs_server, raylet, Ray's Python agents and
    workers ("ray::..."), and zombies whose parent is one of them or this
    process (a zombie's environment cannot be read, so its parent decides).
    Other Ray instances on the machine, another user's included, never count."""
    tag = f"{MARKER_VARIABLE}={marker}".encode()
    found, zombies, marked = {}, {}, {os.getpid()}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        try:
            with open(f"/proc/{entry}/comm") as f:
                comm = f.read().strip()
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            state, ppid = fields[0], int(fields[1])
        except (OSError, IndexError, ValueError):
            continue
        if not (
            comm in ("raylet", "gcs_server")
            or comm.startswith("ray::")
            or cmd.startswith("ray::")
            or "/ray/core/src/ray/" in cmd
            or ("/site-packages/ray/" in cmd and "pytest" not in cmd)
        ):
            if _environ_has(pid, tag):
                marked.add(pid)  # e.g. a worker's own python, before it renames itself
            continue
        if state == "Z":
            zombies[pid] = (ppid, f"{comm} (zombie): {cmd[:100]}")
        elif _environ_has(pid, tag):
            marked.add(pid)
            found[pid] = f"{comm}: {cmd[:120]}"
    for pid, (ppid, description) in zombies.items():
        if ppid in marked:
            found[pid] = description
    return found


class LocalCluster:
    """ray.init() with this checkout's cring (and the loops in tests/workers)
    importable on the workers; shutdown() stops Ray and reports what is left."""

    def __init__(self, num_cpus: int = SHARED_CPUS, num_gpus: int = SHARED_GPUS) -> None:
        self.num_cpus, self.num_gpus = num_cpus, num_gpus
        # Ray's processes inherit the driver's environment at ray.init(); it is
        # restored at shutdown().
        paths = [str(CRING_PATH), str(WORKERS)]
        if os.environ.get("PYTHONPATH"):
            paths.append(os.environ["PYTHONPATH"])
        self.marker = f"{os.getpid()}-{uuid.uuid4().hex}"
        environment = {
            # every process of this cluster carries the marker (only they are counted)
            MARKER_VARIABLE: self.marker,
            # this checkout's cring and the loops in tests/workers, on every worker
            "PYTHONPATH": os.pathsep.join(paths),
            **{k: os.environ.get(k, v) for k, v in RAY_SETTINGS.items()},
        }
        self.saved = {name: os.environ.get(name) for name in environment}
        os.environ.update(environment)
        # num_gpus declares GPUs Ray may hand out; nothing checks that they exist
        # address="local": a new instance even if another Ray runs on this machine
        self.context = ray.init(
            address="local",
            num_cpus=num_cpus,
            num_gpus=num_gpus,
            include_dashboard=False,
            log_to_driver=True,
        )
        self.address = self.context.address_info["gcs_address"]
        self.stopped = False

    def shutdown(self) -> dict[int, str]:
        """Stop Ray; return the Ray processes of this cluster still present
        after waiting up to RAY_CLEANUP_TIMEOUT_S."""
        if not self.stopped:
            self.stopped = True
            ray.shutdown()
            for name, saved in self.saved.items():
                if saved is None:
                    os.environ.pop(name, None)
                else:
                    os.environ[name] = saved
        deadline = time.monotonic() + RAY_CLEANUP_TIMEOUT_S
        while True:
            left = ray_processes(self.marker)
            if not left or time.monotonic() > deadline:
                return left
            time.sleep(0.2)


_shared: Optional[LocalCluster] = None


def shared() -> LocalCluster:
    """The cluster of this process's Ray tests, started now if none runs."""
    global _shared
    if _shared is None or _shared.stopped:
        _shared = LocalCluster()
    return _shared


def running() -> Optional[LocalCluster]:
    return _shared if _shared is not None and not _shared.stopped else None


def stop_shared() -> dict[int, str]:
    """Stop the shared cluster (if it runs); the processes of it still left
    after RAY_CLEANUP_TIMEOUT_S (an empty dict when all went away)."""
    cluster = running()
    return cluster.shutdown() if cluster is not None else {}

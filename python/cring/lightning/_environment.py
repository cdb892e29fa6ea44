# cring's cluster environment and process launcher for Lightning and Fabric,
# built per Lightning distribution by build_environment()/build_launcher().
# Launching only: nothing here communicates.
"""Who started this process, which rank it is, and starting the other ranks."""

from __future__ import annotations

import atexit
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from types import SimpleNamespace
from typing import Any, Callable, Optional

from ._launch import Launch, check_devices, external_launch


class _CRingEnvironmentBase:
    """A Lightning ClusterEnvironment that understands every launcher cring does.

    Launched externally (one rank per process; nothing more is started) when
    the environment names this process's rank and the world size: cringrun
    and Ray (CRING_RANK/CRING_SIZE), HOROVOD_RANK/HOROVOD_SIZE, torchrun
    (RANK/WORLD_SIZE), Open MPI's mpirun, PMI launchers (MPICH, Intel MPI)
    and SLURM's srun, in that order, as cring.init() reads them.

    Otherwise, as Lightning's default environment: `python train.py` is rank
    0 of its node and the strategy starts devices - 1 more copies of the
    script (LOCAL_RANK=1.. in their environment); with num_nodes > 1 run the
    script on every node with NODE_RANK, MASTER_ADDR and MASTER_PORT set. The
    rendezvous store is served by global rank 0 at MASTER_ADDR:MASTER_PORT
    (a free port when unset).
    """

    _lib: SimpleNamespace  # the Lightning distribution's symbols (set by build_environment)

    def __init__(self) -> None:
        super().__init__()
        self._launch: Optional[Launch] = external_launch()
        self._global_rank = self._launch.rank if self._launch else 0
        self._world_size = self._launch.size if self._launch else 1
        self._main_port = -1

    def __repr__(self) -> str:
        how = f"launched by {self._launch.source}" if self._launch else "launched by Lightning"
        return (
            f"{type(self).__name__}({how}, rank {self._global_rank} of {self._world_size}, "
            f"local rank {self.local_rank()})"
        )

    @property
    def launch(self) -> Optional[Launch]:
        """The external launch this process belongs to, or None."""
        return self._launch

    @property
    def creates_processes_externally(self) -> bool:
        # LOCAL_RANK alone: a process the strategy started (or its parent, afterwards)
        return self._launch is not None or "LOCAL_RANK" in os.environ

    @property
    def main_address(self) -> str:
        return os.environ.get("MASTER_ADDR", "127.0.0.1")

    @property
    def main_port(self) -> int:
        if self._main_port == -1:
            port = os.environ.get("MASTER_PORT")
            self._main_port = int(port) if port else self._lib.find_free_network_port()
        return self._main_port

    @staticmethod
    def detect() -> bool:
        return True

    def world_size(self) -> int:
        return self._world_size

    def set_world_size(self, size: int) -> None:
        if self._launch is None:  # an external launcher's size is the truth
            self._world_size = int(size)

    def global_rank(self) -> int:
        return self._global_rank

    def set_global_rank(self, rank: int) -> None:
        if self._launch is None:
            self._global_rank = int(rank)
        self._lib.rank_zero_only.rank = self._global_rank
        self._lib.fabric_rank_zero_only.rank = self._global_rank
        self._lib.utils_rank_zero_only.rank = self._global_rank

    def local_rank(self) -> int:
        if self._launch is not None:
            return self._launch.local_rank
        return int(os.environ.get("LOCAL_RANK", "0"))

    def node_rank(self) -> int:
        if self._launch is not None:
            return self._launch.node_rank
        return int(os.environ.get("NODE_RANK", os.environ.get("GROUP_RANK", "0")))

    def local_processes(self, num_devices: int) -> int:
        """How many ranks run on this host (for the per-process thread count)."""
        if self._launch is not None:
            return self._launch.local_size or 1
        return num_devices

    def validate_settings(self, num_devices: int, num_nodes: int) -> None:
        if self._launch is not None:
            check_devices(self._launch, num_devices, num_nodes)

    def teardown(self) -> None:
        if self._launch is None:  # as Lightning's own environment does
            os.environ.pop("WORLD_SIZE", None)


def build_environment(lib: SimpleNamespace) -> type:
    return type(
        "CRingEnvironment",
        (_CRingEnvironmentBase, lib.ClusterEnvironment),
        {"_lib": lib, "__module__": "cring.lightning", "__doc__": _CRingEnvironmentBase.__doc__},
    )


# ---- starting the other ranks -----------------------------------------------------------------

# Processes this process started, and whether its run failed: at exit the parent
# waits for its children (so `python train.py` returns when every rank is done),
# or stops them when it failed, in a run or by an uncaught exception (they would
# wait for it until the timeout).
_children: list = []
_state = {"failed": False, "registered": False}


def mark_failed() -> None:
    _state["failed"] = True


def _finish_children() -> None:
    if not _children:
        return
    # an exception that ended this process (Python records it before atexit runs)
    uncaught = getattr(sys, "last_exc", None) or getattr(sys, "last_value", None)
    if _state["failed"] or uncaught is not None:
        live = [p for p in _children if p.poll() is None]
        for p in live:
            p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 5
        for p in live:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
        return
    failed, first_code = [], 0
    for local_rank, p in enumerate(_children, start=1):
        code = p.wait()
        if code:
            failed.append(f"local rank {local_rank} (pid {p.pid}) exited with {code}")
            first_code = first_code or code
    if failed:  # exit with the first failed child's status (after flushing what we can)
        print("cring.lightning: " + "; ".join(failed), file=sys.stderr, flush=True)
        sys.stdout.flush()
        logging.shutdown()
        os._exit(first_code if 0 < first_code < 256 else 1)


class _LauncherMixin:
    """Lightning's subprocess launcher, plus: a per-job CRING_SECRET for the
    children on one node, the parent waiting for its children at exit, and
    the thread count per process taken from the launcher's ranks per host."""

    cluster_environment: Any
    num_processes: int
    num_nodes: int
    procs: list
    _lib: SimpleNamespace

    def launch(self, function: Callable, *args: Any, trainer: Any = None, **kwargs: Any) -> Any:
        env = self.cluster_environment
        env.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        alone = self.num_processes == 1 and self.num_nodes == 1  # nothing to start, no env to set
        if not env.creates_processes_externally and not alone:
            if self.num_nodes == 1:
                # every rank is a child of this process: give the job a secret
                os.environ.setdefault("CRING_SECRET", secrets.token_hex(16))
            self._call_children_scripts()  # type: ignore[attr-defined]
            self._lib.launch_process_observer(self.procs)
            _children.extend(self.procs)
            if self.procs and not _state["registered"]:
                _state["registered"] = True
                atexit.register(_finish_children)
        local = getattr(env, "local_processes", lambda n: n)(self.num_processes)
        self._lib.set_num_threads_if_needed(num_processes=max(1, local))
        return function(*args, **kwargs)


def build_launcher(lib: SimpleNamespace, base: type) -> type:
    return type("_CRingLauncher", (_LauncherMixin, base), {"_lib": lib, "__module__": __name__})

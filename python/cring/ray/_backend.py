"""The Ray Train backend: CRingConfig (a BackendConfig) and its Backend.

On every start of a worker group it picks a fresh job id and secret, starts
the rendezvous store inside rank 0's worker (on that worker's node, on a port
the kernel chose, so nothing can race for it) and gives every worker the
CRING_* variables that cringrun would set; cring.init() then needs no
arguments. A GPU worker also gets CRING_CUDA_DEVICE, and its training loop
starts with that GPU as torch's current device (train_func_context). When
the group stops it shuts cring down in every live worker.
The same Backend class serves Ray Train V1 and V2: both call on_start and
on_shutdown with a worker group offering execute / execute_single(_async).
"""

from __future__ import annotations

import logging
import secrets
import uuid
from dataclasses import dataclass
from typing import Any, Optional

import ray
from ray.exceptions import RayError
from ray.train.backend import Backend, BackendConfig

from . import _worker

logger = logging.getLogger(__name__)

_TRANSPORTS = ("auto", "tcp", "shm")


def _check_seconds(field: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"CRingConfig.{field} must be a number of seconds, got {value!r}")
    if not value > 0:  # also rejects NaN
        raise ValueError(f"CRingConfig.{field} must be positive, got {value!r}")


@dataclass
class CRingConfig(BackendConfig):
    """How the cring backend sets up each worker group.

    Args:
        timeout_s: bound on every wait for a peer (rendezvous and collectives),
            exported as ``CRING_TIMEOUT_SECONDS``; ``None`` keeps cring's
            default (600 s) or a value the workers' environment already has.
        transport: ``"auto"``, ``"tcp"`` or ``"shm"`` (``CRING_TRANSPORT``);
            ``None`` leaves the choice to the workers' environment (default auto).
        shutdown_timeout_s: how long stopping a worker group waits for the
            workers to leave cring before Ray kills them anyway.
        check_data_cpus: with ``datasets=``, make ``fit()`` raise when the
            workers would hold every CPU of the cluster, leaving none for Ray
            Data's read tasks (the run would wait forever). Turn it off on a
            cluster that autoscales.
    """

    timeout_s: Optional[float] = None
    transport: Optional[str] = None
    shutdown_timeout_s: float = 30.0
    check_data_cpus: bool = True

    def __post_init__(self) -> None:
        if self.timeout_s is not None:
            _check_seconds("timeout_s", self.timeout_s)
        if self.transport is not None and self.transport not in _TRANSPORTS:
            raise ValueError(
                f"CRingConfig.transport must be one of {', '.join(_TRANSPORTS)} or "
                f"None, got {self.transport!r}"
            )
        _check_seconds("shutdown_timeout_s", self.shutdown_timeout_s)

    @property
    def backend_cls(self) -> type:
        return _CRingBackend

    @property
    def train_func_context(self) -> Any:
        # the worker's GPU becomes the current device in the loop's own thread
        return _worker.on_worker_device

    # `framework` stays None: Ray's run-state export knows only its own frameworks.

    def to_dict(self) -> dict[str, Any]:
        return {
            "timeout_s": self.timeout_s,
            "transport": self.transport,
            "shutdown_timeout_s": self.shutdown_timeout_s,
            "check_data_cpus": self.check_data_cpus,
        }


def worker_environments(
    node_ids: list[str], addr: str, port: int, secret: str, job_id: str, config: CRingConfig
) -> list[dict[str, str]]:
    """The CRING_* variables of each world rank, given each rank's node.

    Local rank and size count the ranks on the same node in rank order (the
    same order cring's C core uses when it groups ranks by host); the node
    rank numbers the nodes in order of their first rank (as Ray Train does)."""
    size = len(node_ids)
    per_node: dict[str, int] = {}  # node -> ranks on it so far
    node_index: dict[str, int] = {}  # node -> its index in order of first appearance
    local_ranks = []
    for node in node_ids:
        local_ranks.append(per_node.get(node, 0))
        per_node[node] = local_ranks[-1] + 1
        node_index.setdefault(node, len(node_index))
    envs = []
    for rank, node in enumerate(node_ids):
        env = {
            "CRING_RANK": str(rank),
            "CRING_SIZE": str(size),
            "CRING_LOCAL_RANK": str(local_ranks[rank]),
            "CRING_LOCAL_SIZE": str(per_node[node]),
            "CRING_NODE_RANK": str(node_index[node]),
            "CRING_ADDR": addr,
            "CRING_PORT": str(port),
            "CRING_SECRET": secret,
            "CRING_STORE_EXTERNAL": "1",
            "CRING_JOB_ID": job_id,
        }
        if config.timeout_s is not None:
            env["CRING_TIMEOUT_SECONDS"] = repr(float(config.timeout_s))
        if config.transport is not None:
            env["CRING_TRANSPORT"] = config.transport
        envs.append(env)
    return envs


class _CRingBackend(Backend):
    # Every worker sees all GPUs given to the group on its node (so NCCL can use
    # peer-to-peer paths between them); set_env() finds the worker's own GPU
    # among them (CRING_CUDA_DEVICE), and the loop starts with it current.
    share_cuda_visible_devices: bool = True

    def on_start(self, worker_group: Any, backend_config: CRingConfig) -> None:
        node_ids = worker_group.execute(_worker.node_id)
        secret = secrets.token_hex(16)
        job_id = f"ray-{uuid.uuid4().hex[:16]}"
        addr, port = worker_group.execute_single(0, _worker.start_store, secret)
        envs = worker_environments(node_ids, addr, port, secret, job_id, backend_config)
        ray.get(
            [
                worker_group.execute_single_async(rank, _worker.set_env, env)
                for rank, env in enumerate(envs)
            ]
        )
        logger.info("cring: %d workers rendezvous at %s:%d (job %s)", len(envs), addr, port, job_id)

    def on_shutdown(self, worker_group: Any, backend_config: CRingConfig) -> None:
        # Each worker on its own: a dead one must not keep the others in cring.
        # Never raise from here: the group is going away regardless, and Ray
        # must go on to stop (and perhaps restart) it.
        try:
            refs = worker_group.execute_async(_worker.shutdown)
            ready, pending = ray.wait(
                refs, num_returns=len(refs), timeout=backend_config.shutdown_timeout_s
            )
        except Exception as exc:  # noqa: BLE001
            logger.warning("cring: could not ask the workers to shut cring down: %s", exc)
            return
        for ref in ready:
            try:
                ray.get(ref)
            except RayError as exc:
                logger.info(
                    "cring: a worker could not shut cring down (expected if it died): %s", exc
                )
        if pending:
            logger.warning(
                "cring: %d workers did not shut cring down within %.0f s",
                len(pending),
                backend_config.shutdown_timeout_s,
            )

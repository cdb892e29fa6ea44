"""Horovod's ``horovod.ray.ray_logger`` on cring: ``log(info)`` in a worker
sends ``info`` to the driver, where ``RayExecutor.run(..., callbacks=[...])``
and ``ElasticRayExecutor.run(..., callbacks=[...])`` call every callback with
it, in the order the workers logged (per worker).

    from cring.ray import ray_logger

    def train():
        ...
        if hvd.rank() == 0:
            ray_logger.log({"epoch": epoch, "loss": loss})

    executor.run(train, callbacks=[print])

The executors set the queue (``configure``) in every worker before the
function runs, and only when callbacks are given; without them ``log`` warns
once and drops what it is given. Must not import anything of cring (it runs
in the workers through the executor's actor class).
"""

from __future__ import annotations

import warnings
from typing import Any

__all__ = ["configure", "log"]

_queue: Any = None
_warned = False


def configure(queue: Any) -> None:
    """Send what log() is given to `queue` (a ray.util.queue.Queue); None: stop."""
    global _queue
    _queue = queue


def log(info: Any) -> None:
    """Send `info` (anything Ray can serialise, usually a dict) to the driver's callbacks."""
    global _warned
    if _queue is not None:
        _queue.put(info)
    elif not _warned:
        warnings.warn(
            "cring.ray.ray_logger.log: no callbacks were given to the executor's run(); "
            "the logged values are dropped",
            stacklevel=2,
        )
        _warned = True

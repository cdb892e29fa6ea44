"""CRingTrainer: a DataParallelTrainer whose workers are set up for cring.

Ray Train V2 (the default) and V1 (RAY_TRAIN_V2_ENABLED=0) have different
DataParallelTrainer classes; like Ray's own TorchTrainer, the base is chosen
when this module is first imported, so set the variable before importing.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from ray.train.v2._internal.constants import is_v2_enabled

from ._backend import CRingConfig

TRAIN_V2: bool = is_v2_enabled()

if TRAIN_V2:
    from ray.train.v2.api.data_parallel_trainer import DataParallelTrainer as _DataParallelTrainer
else:
    from ray.train.data_parallel_trainer import DataParallelTrainer as _DataParallelTrainer


class CRingTrainer(_DataParallelTrainer):
    """Runs ``train_loop_per_worker`` on ``scaling_config.num_workers`` Ray
    workers, each with cring's rank, size, local rank, local size and
    rendezvous already in its environment, so that ``cring.init()`` (or
    ``cring.torch.init()``) needs no arguments. cring is shut down in every
    worker when the worker group stops; a group restarted after a failure
    (``FailureConfig(max_failures=N)``) gets a fresh rendezvous. With
    ``ScalingConfig(use_gpu=True)`` each worker's GPU is torch's current CUDA
    device when the loop starts (``torch.device("cuda")`` is that GPU), and
    ``CRING_CUDA_DEVICE`` holds its index.

    Args:
        train_loop_per_worker: the function each worker runs, taking no
            argument or the ``train_loop_config`` dict.
        train_loop_config: passed to ``train_loop_per_worker``.
        cring_config: a :class:`CRingConfig` (time-out, transport).
        scaling_config, run_config, datasets, dataset_config: as for any Ray
            Train trainer (``ray.train.ScalingConfig``, ``ray.train.RunConfig``).
        **kwargs: passed on to Ray's DataParallelTrainer.
    """

    def __init__(
        self,
        train_loop_per_worker: Callable[..., Any],
        *,
        train_loop_config: Optional[dict] = None,
        cring_config: Optional[CRingConfig] = None,
        scaling_config: Any = None,
        run_config: Any = None,
        datasets: Optional[dict] = None,
        dataset_config: Any = None,
        **kwargs: Any,
    ) -> None:
        if "backend_config" in kwargs:
            raise TypeError(
                "CRingTrainer sets the backend itself; pass cring_config="
                "CRingConfig(...) instead of backend_config="
            )
        if cring_config is None:
            cring_config = CRingConfig()
        elif not isinstance(cring_config, CRingConfig):
            raise TypeError(
                f"cring_config must be a cring.ray.CRingConfig, got {type(cring_config).__name__}"
            )
        super().__init__(
            train_loop_per_worker,
            train_loop_config=train_loop_config,
            backend_config=cring_config,
            scaling_config=scaling_config,
            run_config=run_config,
            datasets=datasets,
            dataset_config=dataset_config,
            **kwargs,
        )

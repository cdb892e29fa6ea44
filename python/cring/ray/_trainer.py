"""CRingTrainer: a DataParallelTrainer whose workers are set up for cring.

Ray Train V2 (the default) and V1 (RAY_TRAIN_V2_ENABLED=0) have different
DataParallelTrainer classes; like Ray's own TorchTrainer, the base is chosen
when this module is first imported, so set the variable before importing.
It also refuses, before fit(), a run whose datasets could never be read
(check_data_cpus), and names the Tune pattern when Tune is handed a V2 trainer.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import ray
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

        self._cring_config = cring_config

    def fit(self) -> Any:
        if self._cring_config.check_data_cpus:
            check_data_cpus(self.scaling_config, self.datasets)
        return super().fit()

    if TRAIN_V2:
        # Tune asks a trainable for its name only when it is callable: answering
        # with the V2 pattern makes Tuner(CRingTrainer(...)) fail at once with it,
        # instead of with "Improper 'run' - not string nor trainable".
        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            raise TypeError(TUNE_V2_MESSAGE)

        @property
        def _name(self) -> str:
            raise TypeError(TUNE_V2_MESSAGE)


TUNE_V2_MESSAGE = (
    "Tuner(CRingTrainer(...)) is not supported by Ray Train V2 (Ray's own trainers raise "
    "\"Improper 'run'\" here). Tune a function that builds and fits the trainer instead:\n"
    "    def train_driver(config):\n"
    "        CRingTrainer(train_loop, train_loop_config=config, scaling_config=...,\n"
    "                     run_config=ray.train.RunConfig(callbacks=[\n"
    "                         ray.tune.integration.ray_train.TuneReportCallback()])).fit()\n"
    "    ray.tune.Tuner(train_driver, param_space={...}).fit()\n"
    "(see docs/ray.md, Ray Tune)"
)

# What one Ray Data task asks for by default (read and map tasks: num_cpus=1).
_DATA_TASK_CPUS = 1.0


def check_data_cpus(scaling_config: Any, datasets: Optional[dict]) -> None:
    """Raise ValueError when the workers would hold so many of the cluster's
    CPUs that not one Ray Data task could run: the workers would wait in
    get_dataset_shard() forever. Does nothing without datasets, before
    ray.init(), or when the workers do not fit at all (a cluster that must
    autoscale for them anyway)."""
    if not datasets or scaling_config is None or not ray.is_initialized():
        return
    workers = getattr(scaling_config, "max_workers", scaling_config.num_workers)
    if not workers:
        return  # local mode: the loop runs in the driver
    held = workers * float(scaling_config.num_cpus_per_worker)
    if not TRAIN_V2:
        held += float((scaling_config.trainer_resources or {"CPU": 1}).get("CPU", 0))
    total = float(ray.cluster_resources().get("CPU", 0.0))
    if held > total or total - held >= _DATA_TASK_CPUS:
        return
    names = ", ".join(sorted(datasets))
    raise ValueError(
        f"CRingTrainer: the {workers} workers{'' if TRAIN_V2 else ' and the trainer'} hold "
        f"{held:g} of the cluster's {total:g} CPUs, leaving {total - held:g}; Ray Data needs "
        f"{_DATA_TASK_CPUS:g} free CPU to run the tasks that read datasets ({names}), so "
        "fit() would wait forever. Give each worker less CPU (ScalingConfig("
        "resources_per_worker={'CPU': 0.5}): a cring worker mostly waits on its peers), use "
        "fewer workers, or give Ray more CPUs (ray.init(num_cpus=...)). On a cluster that "
        "autoscales, pass cring_config=CRingConfig(check_data_cpus=False)."
    )

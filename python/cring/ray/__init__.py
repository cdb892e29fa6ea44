"""cring.ray: Ray integration: CRingTrainer (Ray Train, the HorovodTrainer
pattern) and RayExecutor (Horovod's executor API); see docs/ray.md.

    import ray.train
    from ray.train import ScalingConfig
    from cring.ray import CRingTrainer

    def train_loop_per_worker(config):
        import cring.torch as hvd
        hvd.init()                  # rank, size and rendezvous come from the backend
        ...
        ray.train.report({"loss": loss})

    result = CRingTrainer(train_loop_per_worker, train_loop_config={"lr": 0.1},
                          scaling_config=ScalingConfig(num_workers=2)).fit()

Needs ``ray[train]``; importing ``cring`` alone never imports Ray.
"""

try:
    import ray.train  # noqa: F401
except ImportError as exc:  # pragma: no cover - depends on the environment
    raise ImportError(
        'cring.ray needs Ray Train, which is not installed: pip install "cring[ray]" '
        "(or pip install 'ray[train]')"
    ) from exc

from ._backend import CRingConfig
from ._elastic import ElasticRayExecutor, ElasticRaySettings
from ._executor import RayExecutor, RaySettings, RayWorkerError
from ._trainer import TRAIN_V2, CRingTrainer

__all__ = [
    "CRingConfig",
    "ElasticRayExecutor",
    "ElasticRaySettings",
    "CRingTrainer",
    "RayExecutor",
    "RaySettings",
    "RayWorkerError",
    "TRAIN_V2",
]

"""horovod.ray.elastic_v2's module path on cring. Horovod's second elastic
executor is ``RayExecutor(settings, min_workers=..., max_workers=...)``, which
on cring builds an ElasticRayExecutor (cring.ray.runner.RayExecutor); this
module exports the discoveries Horovod's does (RayHostDiscovery with
``cpus_per_worker``/``gpus_per_worker``, TestDiscovery). Horovod's internals
ElasticParams and ElasticAdapter have no counterpart."""

from typing import Any

from ._elastic import ElasticRayExecutor
from ._hosts import HostDiscovery, RayHostDiscovery, TestDiscovery

__all__ = ["ElasticRayExecutor", "HostDiscovery", "RayHostDiscovery", "TestDiscovery"]


def __getattr__(name: str) -> Any:
    if name in ("ElasticParams", "ElasticAdapter"):
        raise AttributeError(
            f"cring.ray.elastic_v2 has no {name} (Horovod's internal plumbing of RayExecutor): "
            "pass min_workers, max_workers, reset_limit, cpus_per_worker, use_gpu, "
            "gpus_per_worker and override_discovery to cring.ray.RayExecutor(settings, ...) "
            "directly"
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

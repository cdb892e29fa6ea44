"""horovod.ray.runner's module path on cring: RayExecutor (the same class as
cring.ray.RayExecutor; with min_workers it builds an ElasticRayExecutor, as
Horovod's elastic spelling) and its settings (Horovod's MiniSettings is
cring's RaySettings). Horovod's internals Coordinator, StaticParams and
StaticAdapter have no counterpart."""

from typing import Any

from ._executor import RayExecutor, RaySettings, RayWorkerError

MiniSettings = RaySettings

__all__ = ["MiniSettings", "RayExecutor", "RaySettings", "RayWorkerError"]


def __getattr__(name: str) -> Any:
    if name in ("Coordinator", "StaticParams", "StaticAdapter"):
        raise AttributeError(
            f"cring.ray.runner has no {name} (Horovod's internal plumbing of RayExecutor): "
            "cring's RayExecutor places the workers and serves the rendezvous itself; use "
            "RayExecutor.create_settings() and RayExecutor(settings, ...)"
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

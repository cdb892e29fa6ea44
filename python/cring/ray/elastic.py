"""horovod.ray.elastic's module path on cring: ElasticRayExecutor (the same
class as cring.ray.ElasticRayExecutor) and the host discoveries Horovod's
module exports (RayHostDiscovery, TestDiscovery) for ``settings.discovery``
with ``override_discovery=False`` (docs/ray.md, "Host discovery")."""

from ._elastic import ElasticRayExecutor, ElasticRaySettings
from ._hosts import HostDiscovery, RayHostDiscovery, TestDiscovery

__all__ = [
    "ElasticRayExecutor",
    "ElasticRaySettings",
    "HostDiscovery",
    "RayHostDiscovery",
    "TestDiscovery",
]

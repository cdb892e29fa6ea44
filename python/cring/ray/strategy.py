"""horovod.ray.strategy's module path on cring. Horovod's placement
strategies (BaseStrategy, ColocatedStrategy, PGStrategy,
create_placement_group) are the internals of its RayExecutor; cring's
RayExecutor places workers itself: num_workers packs one bundle per worker
(PACK), num_hosts x num_workers_per_host puts that many on each distinct
node (STRICT_SPREAD), and use_current_placement_group reuses the caller's."""

from typing import Any

__all__: list = []

_REFUSED = ("BaseStrategy", "ColocatedStrategy", "PGStrategy", "create_placement_group")


def __getattr__(name: str) -> Any:
    if name in _REFUSED:
        raise AttributeError(
            f"cring.ray.strategy has no {name}: cring's RayExecutor chooses the placement "
            "itself (RayExecutor(settings, num_workers=N) packs one bundle per worker; "
            "num_hosts=H, num_workers_per_host=W spreads them over H nodes; "
            "use_current_placement_group=True reuses the caller's placement group)"
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

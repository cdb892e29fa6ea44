# Fabric(strategy="cring"): the same machinery as the Trainer strategy, in
# Fabric's strategy interface (setup_module, backward, all_reduce, no_backward_sync).
"""cring's Lightning Fabric strategy."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any, Optional

import torch

from . import _common, _sharded


class _NoBackwardSync:
    """fabric.no_backward_sync(model): backward only accumulates gradients locally."""

    def __init__(self, strategy: Any) -> None:
        self._strategy = strategy

    @contextmanager
    def no_backward_sync(self, module: torch.nn.Module, enabled: bool) -> Iterator[None]:
        if not enabled:
            yield
            return
        with (
            _common.sync_paused(self._strategy._averagers.get(id(module))),
            _sharded.paused(self._strategy._sharded_optimizers),
        ):
            yield


class _CRingFabricStrategyBase(_sharded.FabricSharding, _common.StrategyMixin):
    """Data-parallel training over cring for Lightning Fabric:
    ``Fabric(strategy="cring", accelerator="gpu", devices=2)`` (or "cpu").

    Processes are started as by the Trainer strategy (CRingStrategy). Every
    module given to fabric.setup() starts from rank 0's weights; during
    fabric.backward() each gradient's average over ranks starts as soon as
    autograd produces it, and backward returns with averaged gradients
    (so fabric.clip_gradients() clips the average). Inside
    fabric.no_backward_sync(model) backward does not communicate.
    shard_state=1 or 2 shards the optimizers' state (and, 2, the gradients)
    over the ranks, ZeRO-style (docs/sharded.md).
    """

    _api = "Fabric"
    _rank_zero_only_names = ("fabric_rank_zero_only", "utils_rank_zero_only")

    def __init__(
        self,
        accelerator: Any = None,
        parallel_devices: Optional[list] = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision: Any = None,
        timeout_s: Optional[float] = None,
        shard_state: int = 0,
    ) -> None:
        self._cluster_environment = None
        self._shard_state = _sharded.check_shard_state(shard_state)
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
        )
        self._init_cring_state(timeout_s)
        self._averagers: dict = {}  # id(module) -> GradientAverager
        self._backward_sync_control = _NoBackwardSync(self)

    def _set_world_ranks(self) -> None:
        self._assign_world_ranks()

    def _configure_launcher(self) -> None:
        self._check_devices()
        env = self.cluster_environment
        env.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        self._launcher = self._launcher_class(env, self.num_processes, self.num_nodes)

    def setup_environment(self) -> None:
        super().setup_environment()
        self._set_world_ranks()
        self._init_cring("Fabric")

    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        index = len(self._averagers)
        _common.broadcast_module(module, f"fabric.{index}.initial")
        if not self._shard_state:  # else the sharded optimizers' hooks reduce
            self._averagers[id(module)] = _common.GradientAverager(module, f"fabric.{index}.grad")
        return module

    def module_to_device(self, module: torch.nn.Module) -> None:
        module.to(self.root_device)

    def backward(self, tensor: torch.Tensor, module: Any, *args: Any, **kwargs: Any) -> None:
        for averager in self._averagers.values():
            averager.ensure_hooks()
        self.precision.pre_backward(tensor, module)
        self.precision.backward(tensor, module, *args, **kwargs)
        for averager in self._averagers.values():
            if averager.enabled:
                averager.wait()
        _sharded.synchronize(self._sharded_optimizers)
        self.precision.post_backward(tensor, module)

    def all_reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        return _common.reduce(tensor, group=group, reduce_op=reduce_op)

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        self._barrier()

    def _close_averagers(self) -> None:
        for averager in self._averagers.values():
            averager.close()
        self._averagers.clear()


def build_fabric_strategy(lib: SimpleNamespace, environment: type, launcher: type) -> type:
    return _common.build_strategy_class(
        "CRingFabricStrategy",
        _CRingFabricStrategyBase,
        lib.FabricParallelStrategy,
        lib,
        environment,
        launcher,
    )

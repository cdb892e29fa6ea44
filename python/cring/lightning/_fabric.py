# Fabric(strategy="cring"): the same machinery as the Trainer strategy, in
# Fabric's strategy interface (setup_module, backward, all_reduce, no_backward_sync).
"""cring's Lightning Fabric strategy."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any, Optional

import torch

import cring

from . import _common
from ._environment import _CRingEnvironmentBase


class _NoBackwardSync:
    """fabric.no_backward_sync(model): backward only accumulates gradients locally."""

    def __init__(self, strategy: Any) -> None:
        self._strategy = strategy

    @contextmanager
    def no_backward_sync(self, module: torch.nn.Module, enabled: bool) -> Iterator[None]:
        averager = self._strategy._averagers.get(id(module))
        if not enabled or averager is None or not averager.enabled:
            yield
            return
        averager.enabled = False
        try:
            yield
        finally:
            averager.enabled = True


class _CRingFabricStrategyBase:
    """Data-parallel training over cring for Lightning Fabric:
    ``Fabric(strategy="cring", accelerator="cpu", devices=2)``.

    Processes are started as by the Trainer strategy (CRingStrategy). Every
    module given to fabric.setup() starts from rank 0's weights; during
    fabric.backward() each gradient's average over ranks starts as soon as
    autograd produces it, and backward returns with averaged gradients
    (so fabric.clip_gradients() clips the average). Inside
    fabric.no_backward_sync(model) backward does not communicate.
    """

    strategy_name = "cring"
    _lib: SimpleNamespace
    _environment_class: type
    _launcher_class: type

    def __init__(
        self,
        accelerator: Any = None,
        parallel_devices: Optional[list] = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision: Any = None,
        timeout_s: Optional[float] = None,
    ) -> None:
        self._cluster_environment = None
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision=precision,
        )
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self._timeout_s = timeout_s
        self._num_nodes = 1
        self._averagers: dict = {}  # id(module) -> GradientAverager
        self._owns_cring = False
        self._backward_sync_control = _NoBackwardSync(self)

    @property
    def cluster_environment(self) -> Any:
        return self._cluster_environment

    @cluster_environment.setter
    def cluster_environment(self, env: Any) -> None:
        if env is not None and type(env) in self._lib.auto_environments:
            env = self._environment_class()
        self._cluster_environment = env

    @property
    def root_device(self) -> torch.device:
        return torch.device("cpu")

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = int(num_nodes)

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def _external(self) -> bool:
        env = self.cluster_environment
        return isinstance(env, _CRingEnvironmentBase) and env.launch is not None

    def _set_world_ranks(self) -> None:
        env = self.cluster_environment
        if env is not None and not self._external():
            env.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            env.set_world_size(self.num_nodes * self.num_processes)
        rank = self.global_rank
        self._lib.fabric_rank_zero_only.rank = self._lib.utils_rank_zero_only.rank = rank

    def _configure_launcher(self) -> None:
        if self.parallel_devices and {torch.device(d).type for d in self.parallel_devices} != {
            "cpu"
        }:
            raise ValueError(
                f"strategy 'cring' supports CPU devices only for now (its use of cring's CUDA "
                f"path is not validated yet); got devices "
                f"{self.parallel_devices}. Use Fabric(accelerator='cpu', strategy='cring')"
            )
        env = self.cluster_environment
        env.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)
        self._launcher = self._launcher_class(env, self.num_processes, self.num_nodes)

    def setup_environment(self) -> None:
        super().setup_environment()
        self._set_world_ranks()
        if cring.is_initialized():
            self._owns_cring = False
        else:
            if self._external():
                cring.init(timeout_s=self._timeout_s)
            else:
                env = self.cluster_environment
                cring.init(
                    rank=self.global_rank,
                    size=self.world_size,
                    addr=env.main_address,
                    port=env.main_port,
                    timeout_s=self._timeout_s,
                )
            self._owns_cring = True
        if cring.rank() != self.global_rank or cring.size() != self.world_size:
            raise RuntimeError(
                f"cring is rank {cring.rank()} of {cring.size()}, but Fabric expects "
                f"rank {self.global_rank} of {self.world_size}"
            )

    def setup_module(self, module: torch.nn.Module) -> torch.nn.Module:
        index = len(self._averagers)
        _common.broadcast_module(module, f"fabric.{index}.initial")
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
        self.precision.post_backward(tensor, module)

    def all_reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        return _common.reduce(tensor, group=group, reduce_op=reduce_op)

    def all_gather(
        self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False
    ) -> torch.Tensor:
        return _common.all_gather(tensor, group=group, sync_grads=sync_grads)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return _common.broadcast(obj, src)

    def barrier(self, *args: Any, **kwargs: Any) -> None:
        _common.barrier()

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return _common.reduce_boolean_decision(decision, all=all)

    def teardown(self) -> None:
        for averager in self._averagers.values():
            averager.close()
        self._averagers.clear()
        try:
            super().teardown()
        finally:
            if self._owns_cring and cring.is_initialized():
                cring.shutdown()
            self._owns_cring = False

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            override=True,
            description="Data-parallel training over cring (Horovod-style)",
        )


def build_fabric_strategy(lib: SimpleNamespace, environment: type, launcher: type) -> type:
    return type(
        "CRingFabricStrategy",
        (_CRingFabricStrategyBase, lib.FabricParallelStrategy),
        {
            "_lib": lib,
            "_environment_class": environment,
            "_launcher_class": launcher,
            "__module__": "cring.lightning",
            "__doc__": _CRingFabricStrategyBase.__doc__,
        },
    )

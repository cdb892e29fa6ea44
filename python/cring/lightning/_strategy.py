# Trainer(strategy="cring"): Lightning's data-parallel strategy on cring. The
# class is built per Lightning distribution by build_strategy(); the code is
# written once here. Collectives go through cring (never torch.distributed).
"""cring's Lightning Trainer strategy."""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any, Callable, Optional

import torch

from . import _common, _sharded
from ._environment import mark_failed


class _CRingStrategyBase(_sharded.TrainerSharding, _common.StrategyMixin):
    """Data-parallel training over cring, Horovod-style, for Lightning's Trainer.

        trainer = Trainer(strategy="cring", accelerator="gpu", devices=2)   # or "cpu"

    One rank per process. Started as ``python train.py`` the strategy starts
    devices - 1 more copies of the script, as DDP does; under cringrun,
    mpirun, torchrun, srun or Ray (cring.ray) every process is one rank and
    nothing more is started (use devices=1). On GPUs each rank trains on
    cuda:<local rank> (under Ray: the GPU Ray gave the worker; with one
    visible device: that one), made the current device before anything runs.

    Every rank starts from rank 0's weights. During backward each gradient's
    allreduce (an average) starts the moment autograd has produced it, and
    backward returns once all are averaged, before on_after_backward, gradient
    clipping and the optimizer step. Steps that only accumulate gradients
    (accumulate_grad_batches, or toggle_model(sync_grad=False)) do not
    communicate.

    Arguments:
        cluster_environment: who started the processes; by default cring's
            own environment (CRingEnvironment), which understands all the
            launchers above.
        timeout_s: bound on every wait for a peer (rendezvous, collectives);
            default CRING_TIMEOUT_SECONDS or 600.
        shard_state: 1 or 2 shards the optimizer state (and, 2, the
            gradients) over the ranks, ZeRO-style (docs/sharded.md); 0 (default) does not.
        comm_hook, comm_state: a communication hook and its state, as
            DDPStrategy's ddp_comm_hook/ddp_comm_state (docs/hooks.md): e.g.
            cring.torch.hooks.powerSGD_hook with a PowerSGDState. The
            gradients are averaged bucket by bucket through the hook; a state
            with state_dict() is saved in checkpoints ("cring_comm_state")
            and loaded back on resume. With shard_state=1 the (single)
            optimizer's buckets go through it; not with shard_state=2.
        accelerator, parallel_devices, checkpoint_io, precision_plugin: as for
            every Lightning strategy (CPU or CUDA devices; precision "32",
            "bf16-mixed", "16-mixed" with its gradient scaler, and the rest of
            Lightning's plugins).
    """

    _api = "Trainer"
    _rank_zero_only_names = ("rank_zero_only", "utils_rank_zero_only", "fabric_rank_zero_only")

    def __init__(
        self,
        accelerator: Any = None,
        parallel_devices: Optional[list] = None,
        cluster_environment: Any = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
        timeout_s: Optional[float] = None,
        shard_state: int = 0,
        comm_hook: Optional[Callable] = None,
        comm_state: Any = None,
    ) -> None:
        self._cluster_environment = None
        self._shard_state = _sharded.check_shard_state(shard_state)
        self._comm_hook, self._comm_state = _common.check_comm_hook(
            comm_hook, comm_state, self._shard_state
        )
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=cluster_environment,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        self._init_cring_state(timeout_s)
        self._averager: Optional[_common.GradientAverager] = None

    # ---- sync_batchnorm ------------------------------------------------------------------------

    @property
    def _layer_sync(self) -> Any:
        return self.__dict__.get("_cring_layer_sync")

    @_layer_sync.setter
    def _layer_sync(self, plugin: Any) -> None:
        # Trainer(sync_batchnorm=True) hands every strategy torch's TorchSyncBatchNorm
        # plugin, which needs torch.distributed: cring's converts to cring.torch's instead
        # (a user's own LayerSync plugin is kept as given)
        layer_sync = _layer_sync_module(self._lib)
        if type(plugin) is layer_sync.TorchSyncBatchNorm:
            plugin = _cring_sync_batchnorm_class(self._lib)()
        self.__dict__["_cring_layer_sync"] = plugin

    # ---- environment, devices, ranks (the rest is in _common.StrategyMixin) --------------------

    @property
    def is_distributed(self) -> bool:
        """True with more than one rank: Lightning then syncs sync_dist logging
        and gives every rank its own shard of the data."""
        return self.world_size > 1

    def set_world_ranks(self) -> None:
        self._assign_world_ranks()

    def _check_configuration(self) -> None:
        if self.accelerator is not None:
            self._check_devices()
        env = self.cluster_environment
        if env is not None:
            env.validate_settings(num_devices=self.num_processes, num_nodes=self.num_nodes)

    def _configure_launcher(self) -> None:
        self._check_configuration()
        self._launcher = self._launcher_class(
            self.cluster_environment, self.num_processes, self.num_nodes
        )

    # ---- joining the job -----------------------------------------------------------------------

    def setup_environment(self) -> None:
        super().setup_environment()
        self._lib.reset_seed()
        self.set_world_ranks()
        self._init_cring(
            "Lightning",
            "; if you call cring.init() yourself, launch with the same launcher Lightning sees",
        )

    def setup(self, trainer: Any) -> None:
        self.accelerator.setup(trainer)
        fitting = trainer.state.fn == self._lib.TrainerFn.FITTING
        if fitting and self._layer_sync:
            self.model = self._layer_sync.apply(self.model)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        _common.broadcast_module(self.model, "lightning.initial")  # every rank starts from rank 0's
        if fitting:
            self.setup_optimizers(trainer)
            if not self._shard_state:  # else the sharded optimizers' hooks reduce
                self._averager = _common.make_averager(
                    self.model, self._comm_hook, self._comm_state
                )
        self.setup_precision_plugin()
        if fitting:
            self._lib.optimizers_to_device(self.optimizers, self.root_device)

    def model_to_device(self) -> None:
        self.model.to(self.root_device)

    # ---- gradients -----------------------------------------------------------------------------

    def pre_backward(self, closure_loss: torch.Tensor) -> None:
        super().pre_backward(closure_loss)
        if self._averager is not None:
            self._averager.ensure_hooks()

    def backward(
        self, closure_loss: torch.Tensor, optimizer: Any, *args: Any, **kwargs: Any
    ) -> torch.Tensor:
        # Lightning's sequence, with the gradients averaged as soon as backward returns:
        # on_after_backward, clipping and the step all see averaged gradients, as with DDP
        self.pre_backward(closure_loss)
        module = self.lightning_module
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self.precision_plugin.backward(closure_loss, module, optimizer, *args, **kwargs)
        averager = self._averager
        if averager is not None and averager.enabled:
            averager.wait()
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    @contextmanager
    def block_backward_sync(self) -> Iterator[None]:
        """Within this context backward does not communicate: gradients only
        accumulate locally (Lightning uses it for accumulate_grad_batches)."""
        with _common.sync_paused(self._averager), _sharded.paused(self.optimizers):
            yield

    def optimizer_step(
        self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any
    ) -> Any:
        averager = self._averager
        if averager is not None and averager.enabled and averager.in_flight:
            averager.wait()  # a backward that did not go through the strategy
        return super().optimizer_step(optimizer, closure, model, **kwargs)

    # ---- checkpoints: the communication hook's state ----------------------------------------

    def save_checkpoint(
        self, checkpoint: dict, filepath: Any, storage_options: Optional[Any] = None
    ) -> None:
        checkpoint = _common.with_comm_state(checkpoint, self._comm_state)
        super().save_checkpoint(checkpoint, filepath, storage_options=storage_options)

    def load_checkpoint(self, checkpoint_path: Any, *args: Any, **kwargs: Any) -> Any:
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        _common.load_comm_state(checkpoint, self._comm_state)
        return checkpoint

    # ---- collectives ---------------------------------------------------------------------------

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        """Reduce a tensor over all ranks, in place: reduce_op 'mean' (default),
        'sum', 'min', 'max', 'product' or a torch.distributed.ReduceOp. A value
        that is not a tensor is returned unchanged."""
        return _common.reduce(tensor, group=group, reduce_op=reduce_op)

    def barrier(self, name: Optional[str] = None) -> None:
        _common.barrier()

    # ---- the end -------------------------------------------------------------------------------

    def on_exception(self, exception: BaseException) -> None:
        mark_failed()
        super().on_exception(exception)

    def _close_averagers(self) -> None:
        if self._averager is not None:
            self._averager.close()
            self._averager = None

    def teardown(self) -> None:
        module = self.lightning_module
        trainer = getattr(module, "_trainer", None) if module is not None else None
        if (
            trainer is not None
            and trainer.state.fn == self._lib.TrainerFn.FITTING
            and self._layer_sync
            and self.model is not None
        ):
            self.model = self._layer_sync.revert(self.model)  # plain BatchNorm again, as DDP does
        super().teardown()


def _layer_sync_module(lib: SimpleNamespace) -> Any:
    return importlib.import_module(f"{lib.trainer_pkg}.plugins.layer_sync")


_SYNC_BN_CLASSES: dict = {}


def _cring_sync_batchnorm_class(lib: SimpleNamespace) -> type:
    """Lightning's LayerSync plugin for Trainer(sync_batchnorm=True) on cring:
    apply() converts every BatchNorm to cring.torch.SyncBatchNorm, revert()
    back to the BatchNorm1d/2d/3d it was (the same tensors). One class per
    Lightning distribution (their LayerSync classes differ)."""
    cls = _SYNC_BN_CLASSES.get(lib.flavor)
    if cls is None:
        cls = type(
            "CRingSyncBatchNorm",
            (_CRingSyncBatchNormMixin, _layer_sync_module(lib).LayerSync),
            {"__module__": "cring.lightning", "__doc__": _cring_sync_batchnorm_class.__doc__},
        )
        _SYNC_BN_CLASSES[lib.flavor] = cls
    return cls


class _BatchNormAnyDim(torch.nn.modules.batchnorm._BatchNorm):
    """What revert() gives when the original class is unknown: batch norm of any rank."""

    def _check_input_dim(self, input: torch.Tensor) -> None:
        return


class _CRingSyncBatchNormMixin:
    def apply(self, model: torch.nn.Module) -> torch.nn.Module:
        from cring.torch.sync_batch_norm import SyncBatchNorm

        self._originals = getattr(self, "_originals", {})
        for m in model.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and not isinstance(
                m, SyncBatchNorm
            ):
                self._originals[id(m.running_mean if m.running_mean is not None else m)] = type(m)
        return SyncBatchNorm.convert_sync_batchnorm(model)

    def revert(self, model: torch.nn.Module) -> torch.nn.Module:
        from cring.torch.sync_batch_norm import SyncBatchNorm

        if not isinstance(model, SyncBatchNorm):
            for name, child in model.named_children():
                model.add_module(name, self.revert(child))
            return model
        key = id(model.running_mean if model.running_mean is not None else model)
        cls = getattr(self, "_originals", {}).get(key, _BatchNormAnyDim)
        plain = cls(
            model.num_features, model.eps, model.momentum, model.affine, model.track_running_stats
        )
        if model.affine:
            plain.weight, plain.bias = model.weight, model.bias
        plain.running_mean, plain.running_var = model.running_mean, model.running_var
        plain.num_batches_tracked = model.num_batches_tracked
        plain.training = model.training
        return plain


def build_strategy(lib: SimpleNamespace, environment: type, launcher: type) -> type:
    return _common.build_strategy_class(
        "CRingStrategy", _CRingStrategyBase, lib.ParallelStrategy, lib, environment, launcher
    )

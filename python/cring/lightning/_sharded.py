# Sharded optimizer state (shard_state=1 | 2) in cring's Trainer and Fabric
# strategies: their optimizers become cring.torch DistributedOptimizers with
# shard_state, whose gradient hooks replace the strategy's averager. The
# strategies call in here from a few lines; nothing here imports Lightning.
"""ZeRO stages 1 and 2 for CRingStrategy and CRingFabricStrategy."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from typing import Any

import torch

import cring


def check_shard_state(shard_state: Any) -> int:
    if isinstance(shard_state, bool) or shard_state not in (0, 1, 2):
        raise ValueError(
            f"shard_state must be 0 (no sharding), 1 (optimizer state) or 2 (optimizer state "
            f"and gradients), got {shard_state!r}"
        )
    return int(shard_state)


def _refuse_scaler(shard_state: int, precision: Any) -> None:
    """Stage 2 leaves .grad None, where a gradient scaler (precision
    "16-mixed") looks for infinities and unscales: refuse it at setup."""
    if shard_state == 2 and getattr(precision, "scaler", None) is not None:
        raise ValueError(
            "strategy 'cring' with shard_state=2 keeps only a slice of each gradient, which "
            "the gradient scaler of precision '16-mixed' cannot check or unscale: use "
            "precision 'bf16-mixed' or '32', or shard_state=1"
        )


def is_sharded(optimizer: Any) -> bool:
    return getattr(optimizer, "_zero_stage", 0) > 0


def wrap(
    optimizer: torch.optim.Optimizer,
    shard_state: int,
    prefix: str,
    comm_hook: Any = None,
    comm_state: Any = None,
) -> Any:
    """`optimizer` as a sharded DistributedOptimizer (its hooks reduce the
    gradients, through `comm_hook` if given; collectives named
    `prefix`.<group>.<index>)."""
    from cring.torch.optimizer import DistributedOptimizer

    if is_sharded(optimizer):
        return optimizer
    named = [
        (f"{prefix}.{i}.{j}", p)
        for i, group in enumerate(optimizer.param_groups)
        for j, p in enumerate(group["params"])
    ]
    return DistributedOptimizer(
        optimizer,
        named_parameters=named,
        shard_state=shard_state,
        comm_hook=comm_hook,
        comm_state=comm_state,
    )


def synchronize(optimizers: Any) -> None:
    """Finish the reduction of the gradients a backward pass produced, for
    every sharded optimizer that has some in flight (as the averager's wait())."""
    for opt in optimizers:
        if is_sharded(opt) and (opt._cring_handles or opt._cring_touched):
            opt.synchronize()


@contextmanager
def paused(optimizers: Any) -> Iterator[None]:
    """Within: backward only accumulates gradients locally (no hook reduces)."""
    sharded = [opt for opt in optimizers if is_sharded(opt) and not opt._cring_paused]
    for opt in sharded:
        opt._cring_paused = True
    try:
        yield
    finally:
        for opt in sharded:
            opt._cring_paused = False


@contextmanager
def _stepping(optimizer: Any) -> Iterator[None]:
    """The step of a sharded optimizer whose gradients backward already
    reduced (the strategies synchronize after backward)."""
    with ExitStack() as stack:
        if is_sharded(optimizer):
            stack.enter_context(optimizer.skip_synchronize())
        yield


class TrainerSharding:
    """Mixed into CRingStrategy: after Lightning has built the optimizers
    (configure_optimizers), shard_state wraps them and points their LR
    schedulers at the wrapped ones; backward ends with reduced gradients;
    the step takes them as they are. Checkpoints: Lightning calls
    consolidate_state_dict() (the state is gathered on rank 0, which saves
    it) and load_state_dict() on every rank (each keeps its slices). A fit
    that shuts cring down at its end (the strategy joined it) gathers the
    state on rank 0 first, so trainer.save_checkpoint() after fit() still
    writes the whole of it (Lightning's DDP and FSDP keep their process group
    instead)."""

    _shard_state = 0

    def setup_optimizers(self, trainer: Any) -> None:
        super().setup_optimizers(trainer)  # type: ignore[misc]
        if not self._shard_state:
            return
        _refuse_scaler(self._shard_state, getattr(self, "precision_plugin", None))
        if self._shard_state == 2 and getattr(trainer, "gradient_clip_val", None):
            raise ValueError(
                "strategy 'cring' with shard_state=2 keeps only a slice of each gradient, so "
                "Lightning's gradient clipping would see none: use shard_state=1, or call "
                "optimizer.clip_grad_norm_(max_norm) (all ranks' slices together) in "
                "on_before_optimizer_step"
            )
        originals = list(self.optimizers)  # type: ignore[has-type]
        hook, state = getattr(self, "_comm_hook", None), getattr(self, "_comm_state", None)
        if hook is not None and len(originals) > 1:
            raise ValueError(
                "strategy 'cring' with shard_state and a comm_hook takes one optimizer (the "
                f"hook's state holds one set of buckets), got {len(originals)}"
            )
        wrapped = [
            wrap(opt, self._shard_state, f"lightning.zero{k}", hook, state)
            for k, opt in enumerate(originals)
        ]
        for config in getattr(self, "lr_scheduler_configs", []):
            for old, new in zip(originals, wrapped):
                if getattr(config.scheduler, "optimizer", None) is old:
                    config.scheduler.optimizer = new
        self.optimizers = wrapped

    def post_backward(self, closure_loss: torch.Tensor) -> None:
        synchronize(self.optimizers)  # type: ignore[has-type]
        super().post_backward(closure_loss)  # type: ignore[misc]

    def optimizer_step(self, optimizer: Any, closure: Any, model: Any = None, **kwargs: Any) -> Any:
        with _stepping(optimizer):
            return super().optimizer_step(optimizer, closure, model, **kwargs)  # type: ignore[misc]

    def optimizer_state(self, optimizer: Any) -> dict:
        inner = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer's own
        if is_sharded(inner) and not cring.is_initialized():
            kept = inner._zero_consolidated
            if kept is None:
                raise RuntimeError(
                    "the sharded optimizer state is spread over ranks that have left cring: "
                    "save the checkpoint during fit (ModelCheckpoint, or trainer.save_checkpoint "
                    "in a hook), or call cring.init() before the Trainer so it stays running"
                )
            return kept[1] if self.global_rank == kept[0] else {}  # type: ignore[attr-defined]
        return super().optimizer_state(optimizer)  # type: ignore[misc]

    def teardown(self) -> None:
        # after a fit that ends normally, and before cring goes down with the strategy:
        # the whole state on rank 0 (in host memory, as Lightning moves optimizers to the
        # CPU at teardown) for a save_checkpoint() after fit(). Not after a failure,
        # where the peers may be gone.
        trainer = getattr(getattr(self, "lightning_module", None), "_trainer", None)
        if (
            trainer is not None
            and getattr(self, "_owns_cring", False)
            and cring.is_initialized()
            and trainer.state.fn == "fit"
            and trainer.state.status == "running"
        ):
            for opt in self.optimizers:  # type: ignore[has-type]
                if is_sharded(opt):
                    opt.consolidate_state_dict(0)
                    to, state = opt._zero_consolidated
                    opt._zero_consolidated = (to, _to_cpu(state))
        super().teardown()  # type: ignore[misc]


def _to_cpu(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.cpu()
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cpu(v) for v in value)
    return value


class FabricSharding:
    """Mixed into CRingFabricStrategy: fabric.setup() wraps each optimizer
    (shard_state), fabric.backward() ends with reduced gradients,
    fabric.clip_gradients() clips by the norm of all ranks' slices, and
    fabric.save()/load() go through consolidate_state_dict()/load_state_dict()."""

    _shard_state = 0

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> Any:
        optimizer = super().setup_optimizer(optimizer)  # type: ignore[misc]
        if not self._shard_state:
            return optimizer
        _refuse_scaler(self._shard_state, getattr(self, "precision", None))
        index = len(self._sharded_optimizers)
        optimizer = wrap(optimizer, self._shard_state, f"fabric.zero{index}")
        self._sharded_optimizers.append(optimizer)
        return optimizer

    @property
    def _sharded_optimizers(self) -> list:
        found = self.__dict__.get("_cring_sharded_optimizers")
        if found is None:
            found = self.__dict__["_cring_sharded_optimizers"] = []
        return found

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        with _stepping(optimizer):
            return super().optimizer_step(optimizer, **kwargs)  # type: ignore[misc]

    def clip_gradients_norm(
        self,
        module: torch.nn.Module,
        optimizer: Any,
        max_norm: Any,
        norm_type: Any = 2.0,
        error_if_nonfinite: bool = True,
    ) -> torch.Tensor:
        if not is_sharded(optimizer):
            return super().clip_gradients_norm(  # type: ignore[misc]
                module, optimizer, max_norm, norm_type, error_if_nonfinite
            )
        norm = optimizer.clip_grad_norm_(max_norm, norm_type)
        if error_if_nonfinite and not torch.isfinite(norm):
            raise RuntimeError(
                f"the total norm of order {norm_type} of the gradients is non-finite"
            )
        return norm

"""Elastic training for PyTorch (horovod.torch.elastic on cring):

    import cring.torch as hvd
    import cring.torch.elastic

    hvd.init()
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    @cring.torch.elastic.run
    def train(state):
        for state.epoch in range(state.epoch, epochs):
            for state.batch in range(state.batch, batches_per_epoch):
                ...
                state.commit()
            state.batch = 0

    train(cring.torch.elastic.TorchState(model, optimizer, epoch=0, batch=0))

The decorator, the failure handling and the protocol with
`cringrun --elastic` live in cring.elastic; this module adds the state of
torch objects. Must not import anything but torch, numpy and cring.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from .. import elastic as _elastic
from .functions import broadcast_optimizer_state, broadcast_parameters
from .mpi_ops import broadcast_object, rank

ElasticError = _elastic.ElasticError
HostsUpdatedInterrupt = _elastic.HostsUpdatedInterrupt
State = _elastic.State
run = _elastic.run

__all__ = ["ElasticError", "HostsUpdatedInterrupt", "ObjectState", "State", "TorchState", "run"]

_STATE_DICT, _VALUE = "state_dict", "value"


class ObjectState(_elastic.ObjectState):
    """cring.elastic.ObjectState whose sync() pickles through
    cring.torch.broadcast_object (cloudpickle when installed; tensors allowed)."""

    def _broadcast(self, obj: Any) -> Any:
        return broadcast_object(obj, 0, name="cring.elastic.state")


def _has_state_dict(value: Any) -> bool:
    return (
        not isinstance(value, type)
        and callable(getattr(value, "state_dict", None))
        and callable(getattr(value, "load_state_dict", None))
    )


class TorchState(ObjectState):
    """The state of a torch training loop: TorchState(model, optimizer, epoch=0, ...).

    - commit(): deep copies of model.state_dict() and optimizer.state_dict()
      (and of the state_dict() of any other attribute that has
      state_dict/load_state_dict, e.g. an LR scheduler), and deep copies of
      the other attributes; then checks for added workers.
    - restore(): loads those copies back (the objects stay the same objects;
      the optimizer is given a fresh copy, so the commit survives later steps).
    - sync(): rank 0's parameters and buffers (broadcast_parameters), its
      optimizer state (broadcast_optimizer_state), its other state_dicts and
      attributes (broadcast_object); the result is committed.

    Attributes may be reassigned (state.epoch = 3, state.model = other);
    commit() reads their current values.
    """

    def __init__(self, model: Any = None, optimizer: Any = None, **kwargs: Any) -> None:
        if model is not None and not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"TorchState: model must be a torch.nn.Module, got {type(model).__name__}"
            )
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(
                f"TorchState: optimizer must be a torch.optim.Optimizer, got "
                f"{type(optimizer).__name__}"
            )
        objects = {}
        if model is not None:
            objects["model"] = model
        if optimizer is not None:
            objects["optimizer"] = optimizer
        for name in objects:
            if name in kwargs:
                raise TypeError(f"TorchState got {name!r} twice")
        super().__init__(**objects, **kwargs)

    def save(self) -> None:
        saved = {}
        for name in self._names:
            value = getattr(self, name)
            if _has_state_dict(value):
                saved[name] = (_STATE_DICT, copy.deepcopy(value.state_dict()))
            else:
                saved[name] = (_VALUE, copy.deepcopy(value))
        self._saved = saved

    def restore(self) -> None:
        for name in self._names:
            kind, saved = self._saved[name]
            if kind == _VALUE:
                setattr(self, name, copy.deepcopy(saved))
                continue
            target = getattr(self, name)
            if isinstance(target, torch.nn.Module):
                target.load_state_dict(saved)  # copies into the parameters: no aliasing
            else:
                # torch's Optimizer.load_state_dict keeps the given tensors as its
                # state: give it a copy so that the commit survives the next step
                target.load_state_dict(copy.deepcopy(saved))

    def sync(self) -> None:
        plain = {}
        for name in self._names:
            value = getattr(self, name)
            if isinstance(value, torch.nn.Module):
                broadcast_parameters(value.state_dict(), root_rank=0)
            elif isinstance(value, torch.optim.Optimizer):
                broadcast_optimizer_state(value, root_rank=0)
            elif _has_state_dict(value):
                state = broadcast_object(value.state_dict(), 0, name=f"cring.elastic.{name}")
                if rank() != 0:
                    value.load_state_dict(state)
            else:
                plain[name] = value
        if plain:
            for name, value in self._broadcast(plain).items():
                setattr(self, name, value)
        self.save()

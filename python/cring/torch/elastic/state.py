"""TorchState and ObjectState for cring.torch.elastic (horovod.torch.elastic.state):
what a torch training loop commits, restores and synchronises across elastic
resets. The decorator and the protocol with the launcher live in cring.elastic;
the sampler's bookkeeping in .sampler. Must not import anything but torch and cring.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from ... import elastic as _elastic
from ..functions import broadcast_optimizer_state, broadcast_parameters
from ..mpi_ops import broadcast_object, rank
from .sampler import ElasticSampler

__all__ = ["ObjectState", "TorchState"]

_STATE_DICT, _VALUE = "state_dict", "value"

# Horovod's handler registry (StateHandler subclasses per attribute type) has no
# counterpart: TorchState commits any attribute with state_dict/load_state_dict.
_REFUSED = (
    "StateHandler",
    "ModelStateHandler",
    "OptimizerStateHandler",
    "SamplerStateHandler",
    "get_handler_registry",
    "set_handler_registry",
)


def __getattr__(name: str) -> Any:
    if name in _REFUSED:
        raise AttributeError(
            f"cring.torch.elastic.state has no {name}: cring's TorchState has no handler "
            "registry; it commits, restores and synchronises any attribute that has "
            "state_dict() and load_state_dict() through them (give your object those two "
            "methods instead of registering a handler)"
        )
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
            elif isinstance(value, ElasticSampler):
                # the union of what the ranks processed; re-partitioned over the new ranks
                value._sync(f"cring.elastic.{name}")
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

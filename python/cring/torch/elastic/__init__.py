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
torch objects and ElasticSampler (Horovod's, for a DataLoader whose
partition follows the ranks across resets). Must not import anything but
torch, numpy and cring.
"""

from __future__ import annotations

import copy
import math
import random
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.utils.data

from .. import elastic as _elastic
from .functions import broadcast_optimizer_state, broadcast_parameters
from .mpi_ops import broadcast_object, is_initialized, rank, size

ElasticError = _elastic.ElasticError
HostsUpdatedInterrupt = _elastic.HostsUpdatedInterrupt
State = _elastic.State
run = _elastic.run

__all__ = [
    "ElasticError",
    "ElasticSampler",
    "HostsUpdatedInterrupt",
    "ObjectState",
    "State",
    "TorchState",
    "run",
]

_STATE_DICT, _VALUE = "state_dict", "value"


class ElasticSampler(torch.utils.data.Sampler):
    """Horovod's ElasticSampler: a DistributedSampler whose partition follows
    the current ranks and skips what the job already processed this epoch.

        sampler = ElasticSampler(dataset, shuffle=True, seed=0)
        loader = DataLoader(dataset, batch_size=B, sampler=sampler)
        state = TorchState(model, optimizer, train_sampler=sampler, epoch=0)

        @cring.torch.elastic.run
        def train(state):
            while state.epoch < epochs:
                for batch_idx, batch in enumerate(loader):
                    ...
                    state.train_sampler.record_batch(batch_idx, B)
                    state.commit()
                state.epoch += 1
                state.train_sampler.set_epoch(state.epoch)
                state.commit()

    The epoch's order is a permutation of range(len(dataset)) (seeded by
    seed + epoch when shuffle, else the identity), the same on every rank.
    Each pass (iter) takes the indices of that order not yet processed,
    pads them by repeating the first ones to a multiple of size(), and gives
    rank r every size()-th index from r, as DistributedSampler does.

    - record_batch(batch_idx, batch_size): the batch batch_idx of the current
      pass has been processed *on every rank*: its indices on all ranks
      (which every rank can compute) are marked processed.
    - record_indices(indices): mark these indices processed. At a reset rank
      0's record wins (as for every other state), so give indices the whole
      job has processed (e.g. gathered), not only this rank's.
    - set_epoch(epoch): a new epoch: its order, nothing processed yet. Call it
      at the end of an epoch, before the commit, not at its start after a
      reset (that would forget the progress).
    - state_dict() / load_state_dict(): {"epoch", "processed_indices"}; a
      Horovod state_dict with "processed_num" (a count of the order's first
      indices) is accepted too.

    In a TorchState it is committed, restored and synchronised (rank 0's)
    like the rest of the state, and re-partitioned over the new ranks after
    every reset: what was processed before the last commit is not seen again
    in this epoch, what was not is seen once (up to the padding of the last
    round).
    """

    def __init__(self, dataset: Any, shuffle: bool = True, seed: int = 0) -> None:
        self.dataset = dataset
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.epoch = 0
        self.processed_indices: set[int] = set()
        self.num_replicas = 1
        self.rank = 0
        self.remaining_indices: list[int] = []
        self.num_samples = 0
        self.total_size = 0
        self.indices: list[int] = []  # this rank's indices of the current pass
        self._pass: list[int] = []  # every rank's indices of the current pass, padded
        self.reset()

    def _order(self) -> list[int]:
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        return order

    def reset(self) -> None:
        """Re-partition what is left of the epoch over the current ranks
        (called by set_epoch, load_state_dict and TorchState after a reset)."""
        if is_initialized():
            self.num_replicas, self.rank = size(), rank()
        processed = self.processed_indices
        self.remaining_indices = [i for i in self._order() if i not in processed]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas
        padded = list(self.remaining_indices)
        while padded and len(padded) < self.total_size:
            padded += padded[: self.total_size - len(padded)]
        self._pass = padded
        self.indices = padded[self.rank : self.total_size : self.num_replicas]

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)
        self.processed_indices = set()
        self.reset()

    def get_indices(self, batch_idx: int, batch_size: int) -> list[int]:
        """This rank's indices of batch batch_idx (of batch_size) in the current pass."""
        start = batch_idx * batch_size
        return self.indices[start : min(start + batch_size, len(self.indices))]

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        if batch_idx < 0 or batch_size < 1:
            raise ValueError(
                f"ElasticSampler.record_batch: batch_idx must be >= 0 and batch_size >= 1, "
                f"got {batch_idx}, {batch_size}"
            )
        start = batch_idx * batch_size
        end = min(start + batch_size, self.num_samples)
        n = self.num_replicas
        # position p of rank r's list is index r + n * p of the pass
        self.processed_indices.update(
            self._pass[r + n * p] for p in range(start, end) for r in range(n)
        )

    def record_indices(self, indices: Iterable[int]) -> None:
        self.processed_indices.update(int(i) for i in indices)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "processed_indices": set(self.processed_indices)}

    def load_state_dict(self, state_dict: dict) -> None:
        self.epoch = int(state_dict["epoch"])
        if "processed_indices" in state_dict:
            self.processed_indices = {int(i) for i in state_dict["processed_indices"]}
        elif "processed_num" in state_dict:  # Horovod's later format: a prefix of the order
            self.processed_indices = set(self._order()[: int(state_dict["processed_num"])])
        else:
            raise KeyError(
                "ElasticSampler.load_state_dict: the state has neither 'processed_indices' "
                f"nor 'processed_num' (keys: {sorted(state_dict)})"
            )
        self.reset()

    def __iter__(self) -> Iterator[int]:
        self.reset()
        return iter(list(self.indices))

    def __len__(self) -> int:
        return self.num_samples


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
                # every rank loads it, rank 0 too: loading re-partitions over the new ranks
                value.load_state_dict(
                    broadcast_object(value.state_dict(), 0, name=f"cring.elastic.{name}")
                )
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

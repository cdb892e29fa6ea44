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
`cringrun --elastic` live in cring.elastic; this package adds the state of
torch objects (.state: TorchState, ObjectState) and ElasticSampler
(.sampler), under Horovod's module paths. Must not import anything but
torch, numpy and cring.
"""

from __future__ import annotations

from ... import elastic as _elastic
from ..mpi_ops import init, shutdown
from .sampler import ElasticSampler
from .state import ObjectState, TorchState

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
    "init",
    "run",
    "shutdown",
]

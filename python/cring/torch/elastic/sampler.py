"""ElasticSampler (horovod.torch.elastic.sampler): a DataLoader sampler whose
partition of the epoch follows the ranks across elastic resets and skips what
the job has processed. Only index bookkeeping lives here; TorchState
(cring.torch.elastic.state) commits, restores and synchronises it. Must not
import anything but torch and cring.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.utils.data

from ..mpi_ops import allgather_object, is_initialized, rank, size

__all__ = ["ElasticSampler"]


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
    A partition (made by set_epoch, a TorchState sync, reset(), or an
    iteration after a load_state_dict or a change of ranks) takes the
    indices of that order this rank does not know to be processed, pads
    them by repeating the first ones to a multiple of size(), and gives
    rank r every size()-th index from r, as DistributedSampler does.
    Iterating again without a new partition repeats it (Horovod's
    behaviour). Batch numbers refer to the current partition: after a
    load_state_dict within the same epoch (a TorchState restore) they keep
    doing so until the next partition, while len() and remaining_indices
    already count the loaded record.

    - record_batch(batch_idx, batch_size): this rank has processed batch
      batch_idx of the current partition. processed_indices and
      processed_num count what this rank knows: its own batches, plus, after
      a TorchState sync, every rank's. (While the ranks share one partition,
      since set_epoch or a sync, the sampler also notes the other ranks'
      indices of that batch, so a sync after a rank died still counts that
      rank's committed batches: nothing committed is seen twice.)
    - record_indices(indices): mark these indices processed by this rank.
    - set_epoch(epoch): a new epoch: its order, nothing processed. Call it
      at the end of an epoch, before the commit, not at its start after a
      reset (that would forget the progress).
    - state_dict(): {"epoch", "processed_num", "processed_indices",
      "witnessed_indices"}; load_state_dict() also takes Horovod's
      {"epoch", "processed_num"} (a count of the order's first indices).
    - In a TorchState, sync() gives every rank the union of what the ranks
      processed (those in rank 0's epoch) and re-partitions the rest over the
      new ranks: what was committed as processed is not seen again in this
      epoch, what was not is seen once (up to the padding of the last round).
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
        self.indices: list[int] = []  # this rank's indices of the current partition
        self._pass: list[int] = []  # every rank's indices of the current partition, padded
        self._frame = (1, 0)  # (ranks, rank) the current partition was made for
        self._witnessed: set[int] = set()  # other ranks' batches, noted in a shared partition
        self._shared = False  # every rank made the current partition from the same record
        self._stale = False  # the record changed since the partition was made (a load)
        self._partition(shared=is_initialized())

    # ---- Horovod's count ---------------------------------------------------------------------

    @property
    def processed_num(self) -> int:
        """How many of this epoch's samples this rank knows to be processed."""
        return len(self.processed_indices)

    @processed_num.setter
    def processed_num(self, count: int) -> None:
        # Horovod's meaning of a bare count: the order's first `count` indices
        self.processed_indices = set(self._order()[: int(count)])
        self._witnessed = set()

    # ---- the partition -----------------------------------------------------------------------

    def _order(self) -> list[int]:
        order = list(range(len(self.dataset)))
        if self.shuffle:
            random.Random(self.seed + self.epoch).shuffle(order)
        return order

    def _world(self) -> tuple[int, int]:
        return (size(), rank()) if is_initialized() else (self.num_replicas, self.rank)

    def _count(self) -> None:
        """The epoch's remaining indices and this rank's share of them, for the current ranks."""
        self.num_replicas, self.rank = self._world()
        processed = self.processed_indices
        self.remaining_indices = [i for i in self._order() if i not in processed]
        self.num_samples = math.ceil(len(self.remaining_indices) / self.num_replicas)
        self.total_size = self.num_samples * self.num_replicas

    def _partition(self, shared: bool) -> None:
        """A new partition of the remaining indices; `shared`: every rank makes
        the same one now (set_epoch, a sync), so batches of other ranks may be noted."""
        self._count()
        padded = list(self.remaining_indices)
        while padded and len(padded) < self.total_size:
            padded += padded[: self.total_size - len(padded)]
        self._pass = padded
        self._frame = (self.num_replicas, self.rank)
        self.indices = padded[self.rank : self.total_size : self.num_replicas]
        self._shared, self._stale = shared, False

    def reset(self) -> None:
        """Re-partition what is left of the epoch over the current ranks."""
        self._partition(shared=False)

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)
        self.processed_indices = set()
        self._witnessed = set()
        self._partition(shared=True)

    # ---- recording -----------------------------------------------------------------------------

    def get_indices(self, batch_idx: int, batch_size: int) -> list[int]:
        """This rank's indices of batch batch_idx (of batch_size) in the current partition."""
        start = batch_idx * batch_size
        return self.indices[start : min(start + batch_size, len(self.indices))]

    def record_batch(self, batch_idx: int, batch_size: int) -> None:
        if batch_idx < 0 or batch_size < 1:
            raise ValueError(
                f"ElasticSampler.record_batch: batch_idx must be >= 0 and batch_size >= 1, "
                f"got {batch_idx}, {batch_size}"
            )
        start = batch_idx * batch_size
        end = min(start + batch_size, len(self.indices))
        n, me = self._frame
        # position p of rank r's list is index r + n * p of the partition
        self.processed_indices.update(self._pass[me + n * p] for p in range(start, end))
        if self._shared:
            self._witnessed.update(
                self._pass[r + n * p] for p in range(start, end) for r in range(n) if r != me
            )

    def record_indices(self, indices: Iterable[int]) -> None:
        self.processed_indices.update(int(i) for i in indices)

    # ---- state -----------------------------------------------------------------------------------

    def state_dict(self) -> dict:
        return {
            "epoch": self.epoch,
            "processed_num": self.processed_num,
            "processed_indices": set(self.processed_indices),
            "witnessed_indices": set(self._witnessed),
        }

    def load_state_dict(self, state_dict: dict) -> None:
        epoch = int(state_dict["epoch"])
        same_epoch = epoch == self.epoch
        self.epoch = epoch
        if "processed_indices" in state_dict:
            self.processed_indices = {int(i) for i in state_dict["processed_indices"]}
            self._witnessed = {int(i) for i in state_dict.get("witnessed_indices", ())}
        elif "processed_num" in state_dict:  # Horovod's form: a prefix of the order
            self.processed_num = int(state_dict["processed_num"])
        else:
            raise KeyError(
                "ElasticSampler.load_state_dict: the state has neither 'processed_indices' "
                f"nor 'processed_num' (keys: {sorted(state_dict)})"
            )
        if not same_epoch:
            self._partition(shared=False)
            return
        # Within the epoch (a restore), batch numbers still refer to the current
        # partition until the next iteration, sync or set_epoch re-partitions; the
        # counts (len, remaining_indices) are the loaded record's at once.
        self._count()
        self._stale = True

    def _sync(self, name: str) -> None:
        """TorchState.sync(): every rank takes rank 0's epoch and the union of
        what the ranks in that epoch processed (and noted), then
        re-partitions the rest over the current ranks. Collective."""
        known = self.processed_indices | self._witnessed
        records = allgather_object((self.epoch, known), name=name)
        epoch = records[0][0]
        union: set[int] = set()
        for e, indices in records:
            if e == epoch:
                union |= indices
        self.epoch = epoch
        self.processed_indices = union
        self._witnessed = set()
        self._partition(shared=True)

    # ---- torch's Sampler -----------------------------------------------------------------------

    def __iter__(self) -> Iterator[int]:
        if self._stale or self._world() != self._frame:
            self.reset()  # a record was loaded, or the ranks changed, since the last partition
        return iter(list(self.indices))

    def __len__(self) -> int:
        return self.num_samples

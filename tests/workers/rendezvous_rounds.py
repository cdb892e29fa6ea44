"""Worker for tests/test_fuzz_store.py: join and leave the job ROUNDS times
(every init is a fresh rendezvous through the store), alternating shared
memory and TCP, and check an allreduce, a broadcast and an allgather in each
round. Prints 'ROUNDS OK <rank> <n>' at the end.

Usage: rendezvous_rounds.py ROUNDS"""

from __future__ import annotations

import sys

import numpy as np

import cring

rounds = int(sys.argv[1])
for i in range(rounds):
    cring.init(transport="tcp" if i % 2 else "auto")
    rank, size = cring.rank(), cring.size()
    assert cring.transport() == ("tcp" if i % 2 else "shm")
    x = np.arange(100_003, dtype=np.float64) * (rank + 1)
    cring.allreduce_(x, op=cring.Sum, name="x")
    assert np.array_equal(x, np.arange(100_003, dtype=np.float64) * sum(range(1, size + 1)))
    b = cring.broadcast(np.full(7, rank + i, np.int32), root_rank=size - 1)
    assert (b == size - 1 + i).all()
    g = cring.allgather(np.full((rank + 1, 2), rank, np.int64))
    assert g.shape == (sum(range(1, size + 1)), 2)
    cring.shutdown()
print(f"ROUNDS OK {rank} {rounds}", flush=True)

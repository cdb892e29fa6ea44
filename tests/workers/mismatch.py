"""Worker: provoke each kind of disagreement and check every rank raises."""

import sys

import numpy as np

import cring

cring.init()
rank, size = cring.rank(), cring.size()
cases = {
    "count": lambda: cring.allreduce(np.ones(4 + (rank == 1), np.float32), name="count"),
    "dtype": lambda: cring.allreduce(np.ones(4, np.float32 if rank else np.float64), name="dtype"),
    "op": lambda: cring.allreduce(np.ones(4), op=cring.Sum if rank else cring.Max, name="op"),
    "root": lambda: cring.broadcast(np.ones(4), root_rank=0 if rank else 1, name="root"),
    "trailing": lambda: cring.allgather(np.ones((2, 3 if rank else 4)), name="trailing"),
    "scale": lambda: cring.allreduce(
        np.ones(4, np.int32), op=cring.Sum, prescale_factor=1.0 if rank else 2.0, name="scale"
    ),
}
for what, call in cases.items():
    try:
        call()
    except cring.MismatchError as e:
        expected = {
            "count": "shape float32 [4] vs float32 [5]",
            "dtype": "dtype float64 [4] vs float32 [4]",
            "op": "op max vs sum",
            "root": "root rank 1 vs 0",
            "trailing": "shape float64 [2, 4] vs float64 [2, 3]",
            "scale": "scale factors: prescale 2, postscale 1 vs prescale 1, postscale 1",
        }[what]
        assert "rank 0 vs rank 1" in str(e), str(e)
        assert expected in str(e) and f"'{what}'" in str(e), str(e)
        print(f"rank {rank}: {what}: {e}")
    else:
        print(f"rank {rank}: {what} did not raise")
        sys.exit(1)
    # the engine of agreement stays usable
    total = cring.allreduce(np.ones(2) * rank, op=cring.Sum)
    assert total.tolist() == [sum(range(size))] * 2, total
print(f"rank {rank}: all mismatches raised")
cring.shutdown()

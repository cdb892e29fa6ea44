"""Worker: broadcast_ and allgather on the C fast path, repeated so that the
small ones ride the negotiation round from the response cache: values for
every root, uneven and 0-d first dimensions, sizes on both sides of the
riding and copy limits, NumPy and torch, named and unnamed, mixed with a
small allreduce, results that stay their own across calls, and a root
mismatch still raising on every rank."""

import numpy as np

import cring

cring.init()
rank, size = cring.rank(), cring.size()

for n in [0, 1, 3, 1000, 16384, 16385, 70000]:
    for it in range(3):
        for root in range(size):
            x = np.full(n, float(rank + 1 + it), np.float32)
            assert cring.broadcast_(x, root, name=f"b{n}.{root}") is x
            assert (x == root + 1 + it).all(), (n, root, x[:4])
            x = np.full(n, rank + it, np.int64)
            assert cring.broadcast_(x, root_rank=root) is x and (x == root + it).all()
        y = np.full((n, 2), float(rank + it), np.float64)
        for g in (cring.allgather(y, name=f"g{n}"), cring.allgather(y)):
            assert g.shape == (n * size, 2) and g.dtype == np.float64, g.shape
            for q in range(size):
                assert (g[q * n : (q + 1) * n] == q + it).all(), (n, q)
        z = np.ones(2, np.float32)
        assert cring.allreduce_(z, op=cring.Sum, name="between").tolist() == [float(size)] * 2

for it in range(4):  # first dimensions that differ between ranks, then change
    y = np.arange(rank + 1 + (it >= 2), dtype=np.int32) + 10 * rank
    g = cring.allgather(y, name="uneven")
    want = sum([[10 * q + k for k in range(q + 1 + (it >= 2))] for q in range(size)], [])
    assert g.tolist() == want, (it, g)
    s = cring.allgather(np.array(5.0 + rank + it), name="scalar")
    assert s.tolist() == [5.0 + q + it for q in range(size)], s
# every call's result is its own array (the room made for it): the next
# call, riding the round or not, writes elsewhere
for n in (3, 70000):
    kept = [
        cring.allgather(np.full(n, 10 * it + rank, np.int32), name=f"own{n}") for it in range(3)
    ]
    for it, g in enumerate(kept):
        assert g.flags.writeable and g.tolist() == [
            10 * it + q for q in range(size) for _ in range(n)
        ]
big = cring.allgather(np.full(300_000, rank, np.uint8), name="big")  # lent, not copied
assert big.shape == (300_000 * size,) and [int(big[q * 300_000]) for q in range(size)] == list(
    range(size)
)

try:
    import torch
except ImportError:
    torch = None
if torch is not None:
    for it in range(3):
        t = torch.full((5,), float(rank + it))
        assert cring.broadcast_(t, 0, name="torch.b") is t and t.tolist() == [float(it)] * 5
        g = cring.allgather(torch.full((2,), rank), name="torch.g")
        assert isinstance(g, torch.Tensor) and g.tolist() == sum([[q, q] for q in range(size)], [])

if size > 1:
    for _attempt in range(2):
        try:
            cring.broadcast_(np.ones(4), 0 if rank else 1, name="rootmix")
        except cring.MismatchError as e:
            assert "root rank" in str(e), str(e)
        else:
            raise AssertionError("a root mismatch did not raise")
print(f"rank {rank}: small moves ok", flush=True)
cring.shutdown()

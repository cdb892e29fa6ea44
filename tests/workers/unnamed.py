"""Worker: unnamed calls reuse a cycle of names (the response cache serves
them) and still match across ranks in call order; more of them in flight than
the cycle holds queue behind one another; a disagreement raises on every rank."""

import numpy as np

import cring

cring.init()
rank, size = cring.rank(), cring.size()
total = sum(range(1, size + 1))

# a long synchronous loop: the values of every call, the default op (Average) too
hits_before = cring.engine_stats()["cache_hits"]
x = np.zeros(3, np.float32)
for i in range(300):
    x[:] = rank + 1 + i
    cring.allreduce_(x, op=cring.Sum)
    assert x.tolist() == [float(total + size * i)] * 3, (i, x)
    y = np.full(2, float(rank + i), np.float64)
    cring.allreduce_(y)
    assert y.tolist() == [sum(range(size)) / size + i] * 2, (i, y)
# after the first cycle of names, the response cache serves them (no new records)
hits = cring.engine_stats()["cache_hits"] - hits_before
assert hits >= 600 - 2 * 64 - 8, hits

# more asynchronous unnamed calls in flight than the cycle of names holds
arrays = [np.full(4, float(rank + k), np.float32) for k in range(300)]
handles = [cring.allreduce_async_(a, op=cring.Sum) for a in arrays]
for k, (a, h) in enumerate(zip(arrays, handles)):
    assert cring.synchronize(h) is a
    assert a.tolist() == [float(sum(range(size)) + size * k)] * 4, (k, a)

# allreduce_async_ on the C fast path: named NumPy arrays and CPU torch
# tensors, the default op, a read-only array refused as the sync path does
named = [np.full(3, float(rank + k), np.float64) for k in range(10)]
handles = [cring.allreduce_async_(a, name=f"async.{k}") for k, a in enumerate(named)]
for k, (a, h) in enumerate(zip(named, handles)):
    assert cring.synchronize(h) is a and a.tolist() == [sum(range(size)) / size + k] * 3, a
try:
    import torch
except ImportError:
    torch = None
if torch is not None:
    ts = [torch.full((4,), float(rank + k)) for k in range(5)]
    hs = [cring.allreduce_async_(t, op=cring.Sum, name=f"torch.{k}") for k, t in enumerate(ts)]
    for h in hs:
        cring.synchronize(h)
    for h in [cring.allreduce_async_(t, op=cring.Sum) for t in ts]:
        assert isinstance(cring.synchronize(h), torch.Tensor)
    for k, t in enumerate(ts):
        assert t.tolist() == [float(size * (sum(range(size)) + size * k))] * 4, (k, t)
frozen = np.ones(2)
frozen.flags.writeable = False
try:
    cring.allreduce_async_(frozen, name="frozen")
except ValueError:
    pass
else:
    raise AssertionError("a read-only array was accepted")

# synchronous and asynchronous unnamed calls interleaved differently per rank
# still pair up in call order
if rank == 0:
    h = cring.allreduce_async(np.ones(2, np.float32), op=cring.Sum)
    s = cring.allreduce(np.full(2, 2.0, np.float32), op=cring.Sum)
    a = cring.synchronize(h)
else:
    a = cring.allreduce(np.ones(2, np.float32), op=cring.Sum)
    h = cring.allreduce_async(np.full(2, 2.0, np.float32), op=cring.Sum)
    s = cring.synchronize(h)
assert a.tolist() == [float(size)] * 2 and s.tolist() == [2.0 * size] * 2, (a, s)

# the k-th unnamed call differs between ranks: MismatchError on every rank,
# also once that name is cached, and the next unnamed call works again
for _attempt in range(2):
    for _ in range(64):  # bring the cycle back to a cached name
        cring.allreduce_(np.ones(1, np.float32), op=cring.Sum)
    try:
        cring.allreduce_(np.ones(4 + (rank == 1), np.float32), op=cring.Sum)
    except cring.MismatchError as e:
        assert "noname" in str(e) and "[4] vs float32 [5]" in str(e), str(e)
    else:
        raise AssertionError("an unnamed mismatch did not raise")
    z = cring.allreduce_(np.ones(2, np.float32), op=cring.Sum)
    assert z.tolist() == [float(size)] * 2, z
print(f"rank {rank}: unnamed ok", flush=True)
cring.shutdown()

"""Worker: torch tensors through every collective on 2 ranks."""

import torch

import cring

cring.init()
rank, size = cring.rank(), cring.size()

x = torch.full((1_000_003,), float(rank + 1))
ptr = x.data_ptr()
y = cring.allreduce_(x, op=cring.Sum)
assert y is x and x.data_ptr() == ptr, "in-place allreduce moved the data"
assert torch.all(x == 3.0)

w = torch.ones(5, requires_grad=True)
avg = cring.allreduce(w * (rank + 1), op=cring.Average)
assert isinstance(avg, torch.Tensor) and torch.allclose(avg, torch.full((5,), 1.5))

b = torch.arange(6, dtype=torch.bfloat16) * (rank + 1)
bs = cring.allreduce(b, op=cring.Sum)
assert bs.dtype == torch.bfloat16 and torch.equal(bs, torch.arange(6, dtype=torch.bfloat16) * 3)

g = cring.allgather(torch.full((rank + 1, 2), rank, dtype=torch.int64))
assert isinstance(g, torch.Tensor) and g.shape == (3, 2) and g[1:].eq(1).all()

src = torch.tensor([rank * 10.0, 7.0])
out = cring.broadcast(src, root_rank=1)
assert torch.equal(out, torch.tensor([10.0, 7.0])) and src[0].item() == rank * 10.0

rs = cring.reducescatter(torch.ones(5, 2), op=cring.Sum)
assert rs.shape == ((3, 2) if rank == 0 else (2, 2)) and torch.all(rs == 2)
print("torch ok", flush=True)
cring.shutdown()

"""Worker for tests/test_hvd_parity.py: the Horovod drop-in pieces of
cring.torch on real ranks. sparse_allreduce_async against the dense
allreduce, DistributedOptimizer with sparse gradients (gathered, and
sparse_as_dense) against dense ones, broadcast_optimizer_state on a fresh
optimizer with a parameter that has no gradient, _parameter_names, and
training with uneven data ended by join() and a broadcast from the rank it
returns. Writes <out>/rank<R>.json."""

import json
import sys

import torch

import cring.torch as hvd

out_dir = sys.argv[1]
hvd.init()
rank, size = hvd.rank(), hvd.size()
res = {"rank": rank, "size": size}
torch.manual_seed(100 + rank)  # different data on every rank


def rand_sparse(rows, cols, density):
    t = torch.rand(rows, cols)
    t[t > density] = 0
    return t.to_sparse()


# ---- sparse_allreduce_async == dense allreduce (rank 1 holds no entries at all) ----
errs = []
for i, op in enumerate([hvd.Average, hvd.Sum, hvd.Average]):
    t = rand_sparse(13, 4, 0.3 if not (i == 2 and rank == 1) else 0.0)
    dense = hvd.allreduce(t.to_dense(), op=op, name=f"dense.{i}")
    out = hvd.sparse_allreduce_async(t, name=f"sparse.{i}", op=op)()
    errs.append((out.to_dense() - dense).abs().max().item())
    res.setdefault("sparse_is_sparse", []).append(out.is_sparse)
res["sparse_errors"] = errs
try:
    hvd.sparse_allreduce_async(rand_sparse(3, 3, 0.5), name="bad", op=hvd.Max)
    res["max_error"] = None
except ValueError as e:
    res["max_error"] = str(e)


# ---- DistributedOptimizer with a sparse embedding: three ways, the same training ----
def train(sparse, sparse_as_dense):
    torch.manual_seed(7)
    emb = torch.nn.Embedding(12, 3, sparse=sparse)
    opt = torch.optim.SGD(emb.parameters(), lr=0.5)
    opt = hvd.DistributedOptimizer(opt, sparse_as_dense=sparse_as_dense)
    g = torch.Generator().manual_seed(rank)
    for _step in range(3):
        idx = torch.randint(0, 12, (5 + 2 * rank,), generator=g)  # uneven batches
        opt.zero_grad()
        (emb(idx) ** 2).sum().backward()
        opt.step()
    return emb.weight.detach()


dense_w = train(False, False)
res["sparse_gathered_err"] = (train(True, False) - dense_w).abs().max().item()
res["sparse_as_dense_err"] = (train(True, True) - dense_w).abs().max().item()
res["dense_weights"] = dense_w.flatten().tolist()


# ---- broadcast_optimizer_state on a fresh optimizer, one parameter without gradient ----
class NoGrad(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Parameter(torch.tensor([1, 3], dtype=torch.int32), requires_grad=False)
        self.b = torch.nn.Parameter(torch.rand(4))


m = NoGrad()
before = m.b.detach().clone()
opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=1e-3, nesterov=True)
opt = hvd.DistributedOptimizer(opt, named_parameters=m.named_parameters())
hvd.broadcast_parameters(m.state_dict(), root_rank=0)
hvd.broadcast_optimizer_state(opt, root_rank=0)
res["no_grad_a_grad_is_none"] = m.a.grad is None
res["no_grad_b_grad"] = None if m.b.grad is None else m.b.grad.tolist()
b_root = hvd.broadcast(before, root_rank=0, name="b_before")
res["no_grad_b_unmoved"] = bool(torch.equal(m.b.detach(), b_root))

# ---- _parameter_names ----
model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 2))
opt = hvd.DistributedOptimizer(
    torch.optim.SGD([{"params": model[0].parameters()}, {"params": model[1].parameters()}], lr=0.1)
)
names = opt._parameter_names
res["noname"] = sorted(names.values())
res["noname_keys_are_params"] = all(any(k is p for p in model.parameters()) for k in names)
opt = hvd.DistributedOptimizer(
    torch.optim.SGD(model.parameters(), lr=0.1), named_parameters=model.named_parameters()
)
res["named"] = sorted(opt._parameter_names.values())

# ---- uneven data: join(), then broadcast from the rank join() returns ----
torch.manual_seed(3)
net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
opt = hvd.DistributedOptimizer(
    torch.optim.Adam(net.parameters(), lr=0.01), named_parameters=net.named_parameters()
)
g = torch.Generator().manual_seed(50 + rank)
for _step in range(4 + 3 * rank):  # rank r has 3r more batches than rank 0
    x = torch.randn(8, 4, generator=g)
    opt.zero_grad()
    torch.nn.functional.mse_loss(net(x), x.sum(1, keepdim=True)).backward()
    opt.step()
last = hvd.join()
flat = torch.cat([p.detach().flatten() for p in net.parameters()])
res["join_last"] = last
before_all = hvd.allgather(flat[None], name="w0")
res["join_differ_before"] = not all(torch.equal(before_all[r], before_all[0]) for r in range(size))
hvd.broadcast_parameters(net.state_dict(), root_rank=last)
hvd.broadcast_optimizer_state(opt, root_rank=last)
flat_after = torch.cat([p.detach().flatten() for p in net.parameters()])
every = hvd.allgather(flat_after[None], name="w1")
res["join_same_after"] = all(torch.equal(every[r], every[0]) for r in range(size))
res["join_kept_last"] = bool(torch.equal(every[last], every[0]))
with open(f"{out_dir}/rank{rank}.json", "w") as f:
    json.dump(res, f)

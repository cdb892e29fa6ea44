"""Worker: a short training script written for Horovod, with only the import
changed (`import cring.torch as hvd`).

Each rank starts from its own random weights (broadcast_parameters must fix
that), trains on its shard of a fixed regression set with
DistributedOptimizer, averages its loss with allreduce and gathers per-rank
metadata with allgather_object. Rank 0 also trains the same model on the whole
set in one process: with equal shards, averaged gradients equal full-batch
gradients, so both must end with the same weights. Prints
"rank R: dropin ok ..." when everything held; exits 1 otherwise.
"""

import sys

import torch
import torch.nn.functional as F
from torch import nn

import cring.torch as hvd


def make_model(seed):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))


def train(model, optimizer, x, y, steps):
    losses = []
    for _ in range(steps):
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


hvd.init()
RANK = hvd.rank()
torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
X = torch.randn(240, 8, generator=g, dtype=torch.float64).float()
Y = X @ torch.randn(8, 1, generator=g).double().float() + 0.1
STEPS, LR = 40, 0.05

model = make_model(1234 + hvd.rank())  # different on every rank until the broadcast
optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
hvd.broadcast_parameters(model.state_dict(), root_rank=0)
optimizer = hvd.DistributedOptimizer(
    optimizer, named_parameters=model.named_parameters(), compression=hvd.Compression.none
)
hvd.broadcast_optimizer_state(optimizer, root_rank=0)

shard = slice(hvd.rank(), None, hvd.size())
losses = train(model, optimizer, X[shard], Y[shard], STEPS)
avg_loss = hvd.allreduce(torch.tensor(losses[-1]), name="avg_loss").item()
info = hvd.allgather_object({"rank": hvd.rank(), "steps": STEPS})

flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
weights = hvd.allgather(flat.unsqueeze(0))
problems = []
if not all(torch.equal(weights[0], weights[r]) for r in range(hvd.size())):
    problems.append("ranks ended with different weights")
if info != [{"rank": r, "steps": STEPS} for r in range(hvd.size())]:
    problems.append(f"allgather_object gave {info}")
first = hvd.allreduce(torch.tensor(losses[0]), name="first_loss").item()
if not avg_loss < 0.5 * first:
    problems.append(f"the loss did not fall: {first:.4f} -> {avg_loss:.4f}")
if hvd.rank() == 0:
    reference = make_model(1234)
    train(reference, torch.optim.SGD(reference.parameters(), lr=LR, momentum=0.9), X, Y, STEPS)
    ref = torch.cat([p.detach().reshape(-1) for p in reference.parameters()])
    diff = (ref - flat).abs().max().item()
    if diff > 1e-4:
        problems.append(f"weights differ from single-process full-batch training by {diff:.2e}")
hvd.shutdown()
if problems:
    print(f"rank {RANK}: {'; '.join(problems)}", flush=True)
    sys.exit(1)
print(f"rank {RANK}: dropin ok loss {first:.4f} -> {avg_loss:.4f}", flush=True)

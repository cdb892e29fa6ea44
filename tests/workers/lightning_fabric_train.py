"""Worker: Fabric(strategy="cring", devices=2) started as `python this.py OUTDIR`
(the strategy starts the second process). A float64 MLP trained with gradient
accumulation (fabric.no_backward_sync), gradient clipping and SGD with
momentum, each rank on its half of every batch, against the same training
done here in one process on whole batches. Also the Fabric collectives.
Writes <OUTDIR>/fabric.rank<R>.json."""

import copy
import json
import os
import sys

import lightning as L
import torch

import cring
import cring.lightning  # registers "cring" with Fabric too

STEPS, ACCUMULATE, CLIP = 6, 2, 0.5

fabric = L.Fabric(strategy="cring", accelerator="cpu", devices=2)
fabric.launch()
rank, size = fabric.global_rank, fabric.world_size

torch.manual_seed(0)
model = torch.nn.Sequential(
    torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3)
).double()
reference = copy.deepcopy(model)
initial = copy.deepcopy(model)
if rank == 1:  # setup() must replace these with rank 0's weights
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


optimizer = sgd(model.parameters())
model, optimizer = fabric.setup(model, optimizer)
start_equal = all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))

data = torch.Generator().manual_seed(1)
batches = [
    (
        torch.randn(8, 6, generator=data, dtype=torch.float64),
        torch.randn(8, 3, generator=data, dtype=torch.float64),
    )
    for _ in range(STEPS * ACCUMULATE)
]
tensor_counts = []
for i, (x, y) in enumerate(batches):
    mine = slice(rank * 4, rank * 4 + 4)
    accumulating = (i + 1) % ACCUMULATE != 0
    before = cring.engine_stats()["tensors"]
    with fabric.no_backward_sync(model, enabled=accumulating):
        loss = torch.nn.functional.mse_loss(model(x[mine]), y[mine]) / ACCUMULATE
        fabric.backward(loss)
    tensor_counts.append(cring.engine_stats()["tensors"] - before)
    if not accumulating:
        fabric.clip_gradients(model, optimizer, max_norm=CLIP)
        optimizer.step()
        optimizer.zero_grad()

# the same in one process, on whole batches
ref_opt = sgd(reference.parameters())
clipped = 0
for i, (x, y) in enumerate(batches):
    (torch.nn.functional.mse_loss(reference(x), y) / ACCUMULATE).backward()
    if (i + 1) % ACCUMULATE == 0:
        clipped += int(torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP) > CLIP)
        ref_opt.step()
        ref_opt.zero_grad()

error = max((a - b).abs().max().item() for a, b in zip(model.parameters(), reference.parameters()))
moved = max(
    (a - b).abs().max().item() for a, b in zip(reference.parameters(), initial.parameters())
)
result = {
    "rank": rank,
    "size": size,
    "start_equal": start_equal,
    "max_error": error,
    "moved": moved,
    "clipped_steps": clipped,
    "params": [p.detach().flatten().tolist() for p in model.parameters()],
    "tensor_counts": tensor_counts,
    "all_reduce_sum": fabric.all_reduce(torch.tensor([rank + 1.0]), reduce_op="sum").tolist(),
    "all_reduce_mean": fabric.all_reduce(torch.tensor([rank + 1.0])).tolist(),
    "all_gather": fabric.all_gather(torch.tensor([rank, rank])).tolist(),
    "broadcast": fabric.broadcast(f"from {rank}", src=1),
}
fabric.barrier()
with open(os.path.join(sys.argv[1], f"fabric.rank{rank}.json"), "w") as f:
    json.dump(result, f)
print(f"rank {rank}: max error {error:.3g}", flush=True)

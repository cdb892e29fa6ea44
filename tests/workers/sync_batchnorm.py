"""Worker for tests/test_sync_batchnorm.py: cring.torch.SyncBatchNorm on
uneven per-rank batches against torch's BatchNorm on the concatenated batch
(outputs, input/weight/bias gradients, running statistics, eval mode), and
convert_sync_batchnorm. Writes <out>/rank<R>.json with the largest errors."""

import json
import sys

import torch

import cring.torch as hvd

out_dir = sys.argv[1]
hvd.init()
rank, size = hvd.rank(), hvd.size()
SIZES = [3, 5, 4, 2][:size]  # uneven per-rank batch sizes
C = 4


def batch(shape_tail, seed):
    """Every rank's slice of one global batch (the same on every rank)."""
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(sum(SIZES), C, *shape_tail, generator=g, dtype=torch.float32) * 3 + 7
    start = sum(SIZES[:rank])
    return full, slice(start, start + SIZES[rank])


def compare(reference_cls, shape_tail, seed, momentum=0.1, affine=True):
    full, mine = batch(shape_tail, seed)
    ref = reference_cls(C, momentum=momentum, affine=affine)
    sync = hvd.SyncBatchNorm(C, momentum=momentum, affine=affine)
    if affine:
        with torch.no_grad():
            ref.weight.copy_(torch.linspace(0.5, 2.0, C))
            ref.bias.copy_(torch.linspace(-1.0, 1.0, C))
            sync.weight.copy_(ref.weight)
            sync.bias.copy_(ref.bias)
    g = torch.Generator().manual_seed(seed + 1)
    dy_full = torch.randn(full.shape, generator=g)
    errors = {}
    for step in range(2):  # two steps: running statistics follow torch's update twice
        x_ref = full.clone().requires_grad_()
        y_ref = ref(x_ref)
        (y_ref * dy_full).sum().backward()
        x = full[mine].clone().requires_grad_()
        y = sync(x)
        (y * dy_full[mine]).sum().backward()
        errors[f"out{step}"] = (y - y_ref[mine]).abs().max().item()
        errors[f"dx{step}"] = (x.grad - x_ref.grad[mine]).abs().max().item()
        if affine:
            dw = hvd.allreduce(sync.weight.grad, op=hvd.Sum, name=f"dw{seed}.{step}")
            db = hvd.allreduce(sync.bias.grad, op=hvd.Sum, name=f"db{seed}.{step}")
            errors[f"dw{step}"] = (dw - ref.weight.grad).abs().max().item()
            errors[f"db{step}"] = (db - ref.bias.grad).abs().max().item()
            ref.zero_grad()
            sync.zero_grad()
        errors[f"rm{step}"] = (sync.running_mean - ref.running_mean).abs().max().item()
        errors[f"rv{step}"] = (sync.running_var - ref.running_var).abs().max().item()
    # eval: running statistics, no collective (rank 0 runs it alone, more often)
    ref.eval()
    sync.eval()
    for _ in range(3 if rank == 0 else 1):
        errors["eval"] = (sync(full[mine]) - ref(full[mine])).abs().max().item()
    return errors


results = {"rank": rank, "size": size, "cases": {}}
results["cases"]["1d"] = compare(torch.nn.BatchNorm1d, (), 1)
results["cases"]["1d_seq"] = compare(torch.nn.BatchNorm1d, (6,), 2)
results["cases"]["2d"] = compare(torch.nn.BatchNorm2d, (3, 5), 3)
results["cases"]["3d_cma"] = compare(torch.nn.BatchNorm3d, (2, 2, 3), 4, momentum=None)
results["cases"]["2d_noaffine"] = compare(torch.nn.BatchNorm2d, (3, 3), 5, affine=False)

# convert_sync_batchnorm: nested modules, the same parameter and buffer objects
model = torch.nn.Sequential(
    torch.nn.Conv2d(3, C, 3),
    torch.nn.BatchNorm2d(C),
    torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(C * 4, 8), torch.nn.BatchNorm1d(8)),
)
weight, running = model[1].weight, model[2][2].running_var
converted = hvd.SyncBatchNorm.convert_sync_batchnorm(model)
results["converted"] = [type(m).__name__ for m in converted.modules()]
results["same_tensors"] = converted[1].weight is weight and converted[2][2].running_var is running
# a rank with an empty batch still takes part
x = torch.randn(0 if rank == 0 else 3, C)
bn = hvd.SyncBatchNorm(C)
results["empty_rank_out_shape"] = list(bn(x).shape)
with open(f"{out_dir}/rank{rank}.json", "w") as f:
    json.dump(results, f)

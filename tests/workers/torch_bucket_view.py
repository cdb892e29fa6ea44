"""Worker for test_bucket_view.py: DistributedOptimizer with
gradient_as_bucket_view=True trains exactly like the usual path (zero_grad
both ways, accumulation over two passes, a parameter group added later), its
gradients are views into the shared buckets, and every rank ends identical.
Exits non-zero with a message on the first failure."""

import os
import sys

import torch
import torch.nn.functional as F

import cring
from cring.torch import DistributedOptimizer

# three buckets; the middle one (over 1 MiB) runs alone, in place in the shared region,
# the small ones may be fused by the engine and travel the usual way
os.environ["CRING_BUCKET_BYTES"] = str(1100 << 10)  # the 1.2 MB weight: over the cap


def fail(msg: str) -> None:
    print(f"rank {cring.rank()}: {msg}", flush=True)
    sys.exit(1)


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(48, 600),
        torch.nn.ReLU(),
        torch.nn.Linear(600, 500),
        torch.nn.Linear(500, 5),
    )


def main() -> None:
    torch.set_num_threads(1)
    cring.init()
    rank = cring.rank()
    g = torch.Generator().manual_seed(10 + rank)
    data = [
        (torch.randn(6, 48, generator=g), torch.randint(0, 5, (6,), generator=g)) for _ in range(4)
    ]
    nets, opts = [], []
    for view in (False, True):
        net = model()
        opt = DistributedOptimizer(
            torch.optim.SGD(net.parameters(), lr=0.05, momentum=0.9),
            named_parameters=[(f"bv{int(view)}.{n}", p) for n, p in net.named_parameters()],
            backward_passes_per_step=2,
            gradient_as_bucket_view=view,
        )
        nets.append(net)
        opts.append(opt)
    plain, viewed = opts
    if viewed._cring_buckets is None or len(viewed._cring_buckets.buckets) != 3:
        fail("not the three shared buckets expected")
    if plain._cring_buckets is not None:
        fail("buckets without gradient_as_bucket_view")

    def train(i: int, set_to_none: bool) -> None:
        for net, opt in zip(nets, opts):
            opt.zero_grad(set_to_none=set_to_none)
            for x, y in (data[i % 4], data[(i + 1) % 4]):  # two passes accumulate
                F.cross_entropy(net(x), y).backward()
            opt.step()

    def compare(label: str) -> None:
        for (n, a), b in zip(nets[0].named_parameters(), nets[1].parameters()):
            if not torch.allclose(a, b, rtol=1e-6, atol=1e-7):
                fail(f"{label}: {n} differs from the usual path by {(a - b).abs().max():.2e}")
        flat = torch.cat([p.detach().reshape(-1) for p in nets[1].parameters()])
        ref = cring.broadcast(flat.numpy().copy(), 0, name=f"check.{label}")
        if not (flat.numpy() == ref).all():
            fail(f"{label}: ranks differ")

    for i in range(3):
        train(i, set_to_none=True)
    compare("set_to_none=True")
    layout = viewed._cring_buckets
    for p in nets[1].parameters():
        if p.grad is None or p.grad.data_ptr() != layout.view_of[p].data_ptr():
            fail("a gradient is not its bucket view after step()")
    for i in range(3, 5):
        train(i, set_to_none=False)
    compare("set_to_none=False")

    # a parameter group added later: reduced on the usual path, in both optimizers
    extra = []
    for opt in opts:
        torch.manual_seed(1)
        head = torch.nn.Linear(5, 5)
        opt.add_param_group({"params": list(head.parameters()), "lr": 0.05})
        extra.append(head)
    for i in range(5, 7):
        for net, opt, head in zip(nets, opts, extra):
            opt.zero_grad()
            for x, y in (data[i % 4], data[(i + 1) % 4]):
                F.cross_entropy(head(net(x)), y).backward()
            opt.step()
    compare("after add_param_group")
    w = extra[1].weight.detach().reshape(-1)
    ref = cring.broadcast(w.numpy().copy(), 0, name="check.extra")
    if not (w.numpy() == ref).all():
        fail("the added group's parameters differ between ranks")
    if not torch.allclose(extra[0].weight, extra[1].weight, rtol=1e-6, atol=1e-7):
        fail("the added group differs from the usual path")
    cring.shutdown()
    print(f"rank {rank}: ok", flush=True)


if __name__ == "__main__":
    main()

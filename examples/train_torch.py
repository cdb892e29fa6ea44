"""Data-parallel training with PyTorch and cring: an MLP classifier on
synthetic data, each rank on its own shard, Horovod-style:

  * broadcast_parameters / broadcast_optimizer_state start every rank from
    rank 0's weights and optimizer state;
  * DistributedOptimizer starts each gradient's allreduce the moment backward
    has produced it (the engine fuses those that arrive together) and waits
    for them in step();
  * with --uneven, ranks hold different amounts of data: a rank that runs out
    calls join() (the others' allreduces go on with zeros for it), and once
    all have joined every rank takes the weights and optimizer state of the
    rank join() returns, the last to finish, as Horovod's docs advise.

    cringrun -np 2 python examples/train_torch.py [--uneven]
"""

import argparse
import time

import torch
import torch.nn.functional as F

import cring
from cring.torch import DistributedOptimizer, broadcast_optimizer_state, broadcast_parameters


def make_data(n: int, dim: int, classes: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, dim, generator=g) * 0.4
    labels = torch.randint(0, classes, (n,), generator=g)
    x = centers[labels] + torch.randn(n, dim, generator=g)
    return x, labels


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--samples", type=int, default=40_000)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch", type=int, default=128, help="per-rank batch size")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--uneven", action="store_true",
                        help="rank r drops r * 10%% of its shard, then join() evens out")
    args = parser.parse_args()

    torch.set_num_threads(1)
    cring.init()
    rank, size = cring.rank(), cring.size()
    dim, hidden, classes = 32, 128, 10
    x_all, y_all = make_data(args.samples, dim, classes)
    x, y = x_all[rank::size], y_all[rank::size]  # this rank's shard
    if args.uneven:  # shards of different lengths: ranks run out of data at different steps
        keep = len(x) - len(x) * rank // 10
        x, y = x[:keep], y[:keep]

    torch.manual_seed(1234 + rank)  # deliberately different on every rank...
    model = torch.nn.Sequential(
        torch.nn.Linear(dim, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, hidden), torch.nn.ReLU(),
        torch.nn.Linear(hidden, classes))
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr * size)
    # ...until rank 0's weights and optimizer state are broadcast
    broadcast_parameters(model.state_dict(), root_rank=0)
    broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    steps = len(x) // args.batch
    start = time.perf_counter()
    for epoch in range(args.epochs):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch * size + rank))
        loss_sum = torch.zeros(1, dtype=torch.float64)
        for step in range(steps):
            idx = order[step * args.batch:(step + 1) * args.batch]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x[idx]), y[idx])
            loss.backward()  # each gradient's allreduce starts as soon as it is ready
            optimizer.step()  # waits for what is still in flight, then Adam's step
            loss_sum += loss.item()
        if args.uneven:
            # out of data: until every rank has joined, the others' allreduces complete
            # with zeros for this rank. Ranks that joined early skipped steps, so their
            # weights are behind: take those of the rank that joined last.
            last = cring.join()
            broadcast_parameters(model.state_dict(), root_rank=last)
            broadcast_optimizer_state(optimizer, root_rank=last)
        cring.allreduce_(loss_sum, op=cring.Average, name="loss")
        if rank == 0:
            print(f"epoch {epoch + 1}: mean loss {loss_sum.item() / steps:.4f}", flush=True)
    elapsed = time.perf_counter() - start

    with torch.no_grad():
        accuracy = (model(x_all).argmax(1) == y_all).double().mean().item()
    flat = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    every = cring.allgather(flat[None])
    same = all(torch.equal(every[r], every[0]) for r in range(size))
    samples = cring.allreduce(torch.tensor([steps * args.batch * args.epochs]), op=cring.Sum,
                              name="samples").item()
    if rank == 0:
        stats = cring.engine_stats()
        print(f"trained on {size} ranks over {cring.transport()}: {samples / elapsed:,.0f} "
              f"samples/s, final loss {loss_sum.item() / steps:.4f}, accuracy {accuracy:.3f}, "
              f"{stats['tensors'] / max(stats['collectives'], 1):.1f} tensors per collective, "
              f"parameters identical on all ranks: {same}")
    cring.shutdown()
    if not same:
        raise SystemExit("parameters differ between ranks")


if __name__ == "__main__":
    main()

"""Data-parallel training on Ray Train with cring: the HorovodTrainer pattern.

CRingTrainer starts the workers and gives each its rank, size and the
rendezvous, so `hvd.init()` needs no arguments. Every epoch, rank 0 saves a
checkpoint through ray.train.report(); a restarted run (FailureConfig
max_failures) resumes from it through ray.train.get_checkpoint().

    python examples/train_ray.py                    # a local Ray instance
    python examples/train_ray.py --address auto     # an existing cluster
"""

import argparse
import os
import tempfile
import time

import ray
import ray.train
import torch
import torch.nn.functional as F
from ray.train import FailureConfig, RunConfig, ScalingConfig

from cring.ray import CRingTrainer


def make_data(n: int, dim: int, classes: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    centers = torch.randn(classes, dim, generator=g) * 0.4
    labels = torch.randint(0, classes, (n,), generator=g)
    return centers[labels] + torch.randn(n, dim, generator=g), labels


def train_loop_per_worker(config: dict) -> None:
    import cring.torch as hvd

    torch.set_num_threads(1)
    hvd.init()  # rank, size and rendezvous already provided by the backend
    rank, size = hvd.rank(), hvd.size()
    x_all, y_all = make_data(config["samples"], 32, 10)
    x, y = x_all[rank::size], y_all[rank::size]  # this worker's shard

    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(),
                                torch.nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.9)
    start_epoch = 0
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:  # a restarted run: go on from the last epoch saved
        with checkpoint.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"))
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_epoch = state["epoch"] + 1
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())

    batch = config["batch"]
    for epoch in range(start_epoch, config["epochs"]):
        order = torch.randperm(len(x), generator=torch.Generator().manual_seed(epoch))
        total, steps = 0.0, len(x) // batch
        for step in range(steps):
            idx = order[step * batch:(step + 1) * batch]
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x[idx]), y[idx])
            loss.backward()
            optimizer.step()
            total += loss.item()
        loss = hvd.allreduce(torch.tensor(total / steps), name="epoch_loss").item()
        metrics = {"epoch": epoch, "loss": loss}
        if rank == 0:
            with tempfile.TemporaryDirectory() as d:
                torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(),
                            "epoch": epoch}, os.path.join(d, "state.pt"))
                ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(d))
        else:
            ray.train.report(metrics)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--samples", type=int, default=8000)
    parser.add_argument("--batch", type=int, default=64, help="per-worker batch size")
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--address", help="an existing Ray cluster (default: start one here)")
    parser.add_argument("--storage-path", default=os.path.join(tempfile.gettempdir(),
                                                               "cring_ray_results"))
    parser.add_argument("--name", default=time.strftime("cring_train_ray_%Y%m%d_%H%M%S"),
                        help="run name (Train V2 resumes a run whose name and storage exist)")
    args = parser.parse_args()

    if args.address:
        ray.init(address=args.address)
    else:  # one logical CPU per worker, plus one for Train V1's trainer actor
        ray.init(num_cpus=args.num_workers + 1, include_dashboard=False)
    try:
        trainer = CRingTrainer(
            train_loop_per_worker,
            train_loop_config={"lr": args.lr, "epochs": args.epochs, "samples": args.samples,
                               "batch": args.batch},
            scaling_config=ScalingConfig(num_workers=args.num_workers),
            run_config=RunConfig(name=args.name, storage_path=args.storage_path,
                                 failure_config=FailureConfig(max_failures=1)),
        )
        result = trainer.fit()
        print(f"final loss {result.metrics['loss']:.4f} after {result.metrics['epoch'] + 1} "
              f"epochs on {args.num_workers} workers; checkpoint: {result.checkpoint.path}")
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()

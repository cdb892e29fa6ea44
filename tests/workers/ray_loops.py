"""Training loops that tests/test_ray.py runs on Ray Train workers through
cring.ray.CRingTrainer (this directory is on the Ray workers' PYTHONPATH, so
the functions travel by reference). Each worker writes what it saw to JSON
files under config["outdir"], which the test reads back; the loops only use
cring, torch and ray.train as a user would."""

from __future__ import annotations

import json
import os
import tempfile
import time
from pathlib import Path

import ray.train


def _write(config: dict, name: str, record: dict) -> None:
    path = Path(config["outdir"]) / name
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record))
    os.replace(tmp, path)


def _append(config: dict, name: str, record: dict) -> None:
    with open(Path(config["outdir"]) / name, "a") as f:
        f.write(json.dumps(record) + "\n")


def ranks_and_allreduce(config: dict) -> None:
    """Rank, size, local rank/size, the environment and a few collectives."""
    import numpy as np

    import cring

    cring.init()
    rank, size = cring.rank(), cring.size()
    x = np.arange(7, dtype=np.float64) * (rank + 1)
    summed = cring.allreduce(x, op=cring.Sum)
    averaged = cring.allreduce(np.full(3, float(rank), dtype=np.float32))
    gathered = cring.allgather(np.full((rank + 1, 2), rank, dtype=np.int32))
    ctx = ray.train.get_context()
    _write(
        config,
        f"rank{rank}.json",
        {
            "rank": rank,
            "size": size,
            "local_rank": cring.local_rank(),
            "local_size": cring.local_size(),
            "transport": cring.transport(),
            "ray_world_rank": ctx.get_world_rank(),
            "ray_world_size": ctx.get_world_size(),
            "ray_local_rank": ctx.get_local_rank(),
            "env": {k: v for k, v in os.environ.items() if k.startswith("CRING_")},
            "sum": summed.tolist(),
            "average": averaged.tolist(),
            "gathered": gathered.tolist(),
            "pid": os.getpid(),
        },
    )
    ray.train.report({"rank": rank, "sum_of_ranks_plus_one": float(summed[1])})


def _data(rank: int):
    import torch

    g = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(64, 4, generator=g)
    w_true = torch.tensor([[1.5], [-2.0], [0.5], [3.0]])
    y = x @ w_true + 0.7 + 0.01 * torch.randn(64, 1, generator=g)
    return x, y


def _save_checkpoint(model, optimizer, epoch: int):
    import torch

    tmp = tempfile.mkdtemp()
    torch.save(
        {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch},
        os.path.join(tmp, "state.pt"),
    )
    return ray.train.Checkpoint.from_directory(tmp)


def train_linear(config: dict) -> None:
    """Linear regression with cring.torch's DistributedOptimizer, each rank on
    its own data. Resumes from ray.train.get_checkpoint() when there is one;
    with config["die_at_epoch"], rank 1 kills itself at that epoch the first
    time (a marker file remembers that it happened)."""
    import torch

    import cring.torch as hvd

    torch.set_num_threads(1)
    hvd.init()
    rank = hvd.rank()
    torch.manual_seed(rank)  # different initial weights: broadcast must fix that
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"], momentum=0.5)
    start_epoch = 0
    checkpoint = ray.train.get_checkpoint()
    restored_from = None
    if checkpoint is not None:
        with checkpoint.as_directory() as d:
            state = torch.load(os.path.join(d, "state.pt"))
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start_epoch = state["epoch"] + 1
        restored_from = state["epoch"]
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters())
    _append(
        config,
        f"starts{rank}.jsonl",
        {
            "rank": rank,
            "size": hvd.size(),
            "ray_world_rank": ray.train.get_context().get_world_rank(),
            "start_epoch": start_epoch,
            "restored_from": restored_from,
            "pid": os.getpid(),
            "job_id": os.environ["CRING_JOB_ID"],
            "port": os.environ["CRING_PORT"],
            "time": time.time(),
        },
    )

    x, y = _data(rank)
    die_at = config.get("die_at_epoch")
    marker = Path(config["outdir"]) / "died_once"
    for epoch in range(start_epoch, config["epochs"]):
        if die_at is not None and epoch == die_at and rank == 1 and not marker.exists():
            if hasattr(ray.train, "get_all_reported_checkpoints"):  # Train V2
                # Die only once Ray has committed rank 0's last checkpoint, so
                # that the test knows which epoch the restart must resume from.
                ray.train.get_all_reported_checkpoints(
                    consistency_mode=ray.train.CheckpointConsistencyMode.COMMITTED, timeout_s=60
                )
            marker.write_text(json.dumps({"pid": os.getpid(), "time": time.time()}))
            os._exit(1)  # a crash: no exception, no cleanup
        for _ in range(config["steps_per_epoch"]):
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
        with torch.no_grad():
            local = torch.nn.functional.mse_loss(model(x), y)
        mean_loss = hvd.allreduce(local.detach(), name="epoch_loss").item()
        metrics = {"epoch": epoch, "loss": mean_loss}
        _append(config, f"losses{rank}.jsonl", metrics)
        if rank == 0:
            ray.train.report(metrics, checkpoint=_save_checkpoint(model, optimizer, epoch))
        else:
            ray.train.report(metrics)
    _write(
        config,
        f"final{rank}.json",
        {"params": [p.detach().double().flatten().tolist() for p in model.parameters()]},
    )


def lightning_fit(config: dict) -> None:
    """Trainer(strategy="cring", devices=1) inside the Ray loop: the strategy
    finds CRING_RANK/CRING_SIZE from the backend and launches nothing."""
    import lightning.pytorch as pl
    import torch

    import cring
    import cring.lightning  # noqa: F401  (registers the strategy name "cring")

    torch.set_num_threads(1)

    class Regression(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(int(os.environ["CRING_RANK"]))  # different on each rank
            self.layer = torch.nn.Linear(4, 1)
            self.seen: list[float] = []
            self.epoch_losses: list[float] = []

        def training_step(self, batch, batch_idx):
            x, y = batch
            self.seen.extend(x[:, 0].tolist())
            loss = torch.nn.functional.mse_loss(self.layer(x), y)
            self.log("train_loss", loss, sync_dist=True, on_step=False, on_epoch=True)
            return loss

        def on_train_epoch_end(self) -> None:
            self.epoch_losses.append(float(self.trainer.callback_metrics["train_loss"]))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.05)

    g = torch.Generator().manual_seed(7)  # the same data set on every rank
    x = torch.randn(96, 4, generator=g)
    y = x @ torch.tensor([[1.0], [-1.0], [2.0], [0.5]]) + 0.3
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=8)
    model = Regression()
    trainer = pl.Trainer(
        strategy="cring",
        accelerator="cpu",
        devices=1,
        max_epochs=config["epochs"],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=config["outdir"],
    )
    trainer.fit(model, loader)
    rank = trainer.global_rank
    _write(
        config,
        f"lightning{rank}.json",
        {
            "global_rank": rank,
            "world_size": trainer.world_size,
            "ray_world_rank": ray.train.get_context().get_world_rank(),
            "strategy": type(trainer.strategy).__name__,
            "params": [p.detach().double().flatten().tolist() for p in model.parameters()],
            "seen": model.seen,
            "epoch_losses": model.epoch_losses,
            "cring_initialized_after_fit": cring.is_initialized(),
        },
    )
    ray.train.report({"train_loss": model.epoch_losses[-1], "rank": rank})


def gpu_devices(config: dict) -> None:
    """A use_gpu=True worker on a cluster that declares GPUs it does not have
    (ray.init(num_gpus=2) on a CPU machine with the CPU build of torch):
    report what Ray gave this worker, what cring's worker setup chose, and
    which device the Lightning strategy would train on. torch's CUDA queries
    are patched here, inside the worker, where a CPU build needs them."""
    import contextlib
    from unittest import mock

    import lightning.pytorch as pl
    import numpy as np
    import torch

    import cring
    import cring.lightning  # noqa: F401  (registers the strategy name "cring")
    from cring.ray import _worker

    # What the loop's own thread got before it started (train_func_context):
    # nothing to set on a torch without CUDA.
    at_start = _worker.set_torch_device()
    cring.init()
    rank = cring.rank()
    ranks = cring.allreduce(np.array([float(rank)]), op=cring.Sum)  # the job works
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    count = len([v for v in visible.split(",") if v.strip()])
    current: list = []
    with contextlib.ExitStack() as patched:
        for name, fake in (
            ("is_available", lambda: True),
            ("device_count", lambda: count),
            ("set_device", lambda d: current.append(str(d))),
            ("get_device_capability", lambda d=None: (8, 0)),
            ("get_device_name", lambda d=None: "fake GPU"),
        ):
            patched.enter_context(mock.patch.object(torch.cuda, name, fake))
        set_by_setup = _worker.set_torch_device()  # as train_func_context runs it on a GPU
        trainer = pl.Trainer(
            strategy="cring",
            accelerator="gpu",
            devices=1,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            default_root_dir=config["outdir"],
        )
        root_device = str(trainer.strategy.root_device)
    _write(
        config,
        f"gpu{rank}.json",
        {
            "rank": rank,
            "ray_gpu_ids": [str(i) for i in ray.get_gpu_ids()],
            "cuda_visible_devices": visible,
            "cring_cuda_device": os.environ.get("CRING_CUDA_DEVICE"),
            "local_rank": os.environ.get("CRING_LOCAL_RANK"),
            "set_at_start": at_start,
            "set_by_setup": set_by_setup,
            "set_device_calls": current,
            "lightning_root_device": root_device,
            "sum_of_ranks": float(ranks[0]),
        },
    )
    ray.train.report({"rank": rank})

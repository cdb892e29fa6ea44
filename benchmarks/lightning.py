"""Lightning benchmark: epoch time of Trainer(strategy="cring") against
Trainer(strategy="ddp") (gloo), 2 ranks on CPU, in the same run.

The model is a wide MLP (~19M float32 parameters, 76 MB of gradients) trained
with plain SGD on a tiny batch (4 samples per rank), so that averaging the
gradients dominates a step. Both strategies train it in the same two
processes: the first Trainer (strategy="cring", devices=2) starts the second
process, and the later Trainers run in both. Rounds alternate between

  * strategy="cring",
  * strategy="ddp" (torch DistributedDataParallel over gloo),
  * no communication: each process trains its own copy alone (devices=1),
    the compute and optimizer cost of a step with the same contention,

so that drift on a shared machine hits all of them alike. Each figure is the
median epoch time over rounds (the first epoch of every fit is warm-up and not
counted). The share of an epoch spent communicating is 1 - t(alone) / t(strategy).
After the first round the cring and DDP models (same seed, same batches) must agree.

    python benchmarks/lightning.py [--quick] [--rounds R] [--steps S] [--epochs E]
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time

# This file is called lightning.py: its folder must not shadow the lightning package.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]


def free_ports(n: int) -> list:
    """n distinct free ports (all held open while choosing)."""
    sockets = [socket.socket() for _ in range(n)]
    try:
        for s in sockets:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--epochs", type=int, default=3, help="per fit; the first is warm-up")
    p.add_argument("--steps", type=int, default=10, help="optimizer steps per epoch")
    p.add_argument("--batch", type=int, default=4, help="samples per rank and step")
    p.add_argument("--width", type=int, default=2048)
    p.add_argument("--quick", action="store_true", help="1 round, 2 epochs of 5 steps")
    p.add_argument("--json", help="also write the figures to this file")
    args = p.parse_args()
    if args.quick:
        args.rounds, args.epochs, args.steps = 1, 2, 5
    if args.epochs < 2:
        p.error("--epochs must be >= 2 (the first epoch of every fit is not counted)")
    return args


def main() -> None:
    args = parse()
    # the second process inherits these; rank 0 serves cring's store on one port and
    # torch's on the other, and both stay up for the whole run
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if "BENCH_CRING_PORT" not in os.environ:  # not in the second process: it inherits them
        cring_port, ddp_port = free_ports(2)
        os.environ["BENCH_CRING_PORT"], os.environ["BENCH_DDP_PORT"] = (
            str(cring_port),
            str(ddp_port),
        )
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # two ranks on a two-core machine

    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    import cring.lightning  # noqa: F401  (registers strategy "cring")

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    width = args.width

    class WideMLP(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(
                torch.nn.Linear(1024, 2 * width),
                torch.nn.ReLU(),
                torch.nn.Linear(2 * width, width),
                torch.nn.ReLU(),
                torch.nn.Linear(width, width),
                torch.nn.ReLU(),
                torch.nn.Linear(width, 1024),
            )

        def training_step(self, batch, batch_idx):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=1e-3)

    class EpochTimer(pl.Callback):
        def __init__(self) -> None:
            self.seconds: list = []

        def on_train_epoch_start(self, trainer, module):
            self.start = time.perf_counter()

        def on_train_epoch_end(self, trainer, module):
            self.seconds.append(time.perf_counter() - self.start)

    generator = torch.Generator().manual_seed(0)
    samples = 2 * args.steps * args.batch
    data = TensorDataset(
        torch.randn(samples, 1024, generator=generator),
        torch.randn(samples, 1024, generator=generator),
    )

    def fit(strategy: str):
        port = {"cring": "BENCH_CRING_PORT", "ddp": "BENCH_DDP_PORT"}.get(strategy)
        if port:
            os.environ["MASTER_PORT"] = os.environ[port]
        pl.seed_everything(1, verbose=False)
        model = WideMLP()
        timer = EpochTimer()
        trainer = pl.Trainer(
            strategy=strategy,
            accelerator="cpu",
            devices=1 if strategy == "auto" else 2,
            max_epochs=args.epochs,
            limit_train_batches=args.steps,
            callbacks=[timer],
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(model, DataLoader(data, batch_size=args.batch))
        return model, timer.seconds[1:], trainer

    cases = {"cring": [], "ddp": [], "auto": []}
    agreement = None
    trainer = None
    for r in range(args.rounds):
        models = {}
        for strategy in cases:
            model, seconds, t = fit(strategy)
            trainer = trainer or t
            cases[strategy] += seconds
            models[strategy] = model
        if r == 0:
            agreement = max(
                (a - b).abs().max().item()
                for a, b in zip(models["cring"].parameters(), models["ddp"].parameters())
            )
    rank = trainer.global_rank
    if rank == 0:
        report(args, cases, agreement, sum(p.numel() for p in models["cring"].parameters()))
    for proc in getattr(trainer.strategy.launcher, "procs", []):
        proc.wait()


def report(args, cases, agreement, params) -> None:
    median = {k: statistics.median(v) for k, v in cases.items()}
    alone, ddp, cring = median["auto"], median["ddp"], median["cring"]
    print(
        f"\nWide MLP, {params / 1e6:.1f}M float32 parameters ({params * 4 / 1e6:.0f} MB of "
        f"gradients), batch {args.batch} per rank, {args.steps} steps per epoch, 2 ranks on CPU;"
        f" median of {len(cases['cring'])} epochs per case over {args.rounds} rounds\n"
    )
    print("| case | epoch time | steps/s | time communicating | vs DDP |")
    print("|---|---|---|---|---|")
    rows = [
        ('strategy="cring"', cring),
        ('strategy="ddp" (gloo)', ddp),
        ("no communication (each rank alone)", alone),
    ]
    for name, t in rows:
        share = f"{max(0.0, 1 - alone / t):.0%}" if t is not alone else "-"
        print(f"| {name} | {t:.3f} s | {args.steps / t:.1f} | {share} | {ddp / t:.2f}x |")
    print(
        f"\ncring / DDP epoch-time ratio: {cring / ddp:.3f} (cring is {ddp / cring:.2f}x as fast)"
    )
    print(f"largest difference between the cring and DDP weights after one fit: {agreement:.2e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "median_epoch_seconds": median,
                    "epochs": cases,
                    "params": params,
                    "ratio_cring_over_ddp": cring / ddp,
                    "weight_difference": agreement,
                },
                f,
            )


if __name__ == "__main__":
    sys.exit(main())

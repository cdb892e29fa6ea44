"""Data-parallel training with PyTorch Lightning and cring: an MLP classifier on
synthetic data, Trainer(strategy="cring") on 2 CPU processes.

    python examples/train_lightning.py                  # the strategy starts rank 1 itself
    cringrun -np 2 python examples/train_lightning.py --devices 1   # one rank per process
    (also: mpirun -np 2 ..., torchrun --nproc-per-node 2 ... with --devices 1)

Every rank trains on its own half of each epoch (Lightning's DistributedSampler),
gradients are averaged through cring while backward runs, and the logged
losses (sync_dist=True) are means over the ranks. Prints the final loss and
accuracy on rank 0.
"""

import argparse

import cring.lightning  # noqa: F401  (registers strategy "cring")
import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Timer
from torch.utils.data import DataLoader, TensorDataset


def make_data(n: int, centers: torch.Tensor, seed: int) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, centers.shape[0], (n,), generator=g)
    return TensorDataset(centers[labels] + torch.randn(n, centers.shape[1], generator=g), labels)


class Classifier(L.LightningModule):
    def __init__(self, dim: int, classes: int, lr: float) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(
            torch.nn.Linear(dim, 256),
            torch.nn.ReLU(),
            torch.nn.Linear(256, 256),
            torch.nn.ReLU(),
            torch.nn.Linear(256, classes),
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)
        self.log("train_loss", loss, on_step=False, on_epoch=True, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        logits = self.net(x)
        self.log("val_loss", F.cross_entropy(logits, y), sync_dist=True)
        self.log("val_acc", (logits.argmax(1) == y).float().mean(), sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=self.hparams.lr)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--devices",
        type=int,
        default=2,
        help="processes to start (1 under cringrun, mpirun or torchrun)",
    )
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--samples", type=int, default=20_000)
    parser.add_argument("--batch", type=int, default=128, help="per-rank batch size")
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()

    L.seed_everything(0, verbose=False)
    dim, classes = 32, 10
    centers = torch.randn(classes, dim, generator=torch.Generator().manual_seed(0)) * 0.4
    train = DataLoader(
        make_data(args.samples, centers, seed=1), batch_size=args.batch, shuffle=True
    )
    val = DataLoader(make_data(args.samples // 5, centers, seed=2), batch_size=512)
    model = Classifier(dim, classes, args.lr)
    timer = Timer()
    trainer = L.Trainer(
        strategy="cring",
        accelerator="cpu",
        devices=args.devices,
        max_epochs=args.epochs,
        callbacks=[timer],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, train, val)
    seconds = timer.time_elapsed("train")
    if trainer.is_global_zero:
        m = trainer.callback_metrics
        print(
            f"{trainer.world_size} ranks, {args.epochs} epochs in {seconds:.1f} s: "
            f"final train loss {m['train_loss']:.4f}, val loss {m['val_loss']:.4f}, "
            f"val accuracy {m['val_acc']:.3f}",
            flush=True,
        )


if __name__ == "__main__":
    main()

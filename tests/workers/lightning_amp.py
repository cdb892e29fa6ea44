"""Worker: "16-mixed" with Lightning's GradScaler on 2 ranks, on the CPU (torch's
fp16 autocast and GradScaler("cpu"); Lightning refuses precision="16-mixed"
on accelerator="cpu", so the plugin is given as an instance, as on a GPU it
is picked by name). The strategy averages the *scaled* gradients in backward;
Lightning then unscales them, clips them and lets the scaler step or skip.
On one step rank 1's loss is infinite: the average carries the inf to rank 0,
so both ranks skip that step and halve the scale together (as with DDP).
Writes <outdir>/<label>.rank<R>.json.

    python lightning_amp.py OUTDIR LABEL --strategy cring|ddp
"""

import argparse
import json
import os

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision

import cring.lightning  # noqa: F401  (registers strategy "cring")

parser = argparse.ArgumentParser()
parser.add_argument("outdir")
parser.add_argument("label")
parser.add_argument("--strategy", default="cring")
args = parser.parse_args()

INF_STEP = 3  # the batch of epoch 0 on which rank 1's loss is infinite
INIT_SCALE = 2.0**12


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(11)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
        )
        self.scales: list = []  # the scaler's scale after each optimizer step
        self.steps_taken = 0

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x).float(), y)
        if self.current_epoch == 0 and batch_idx == INF_STEP and self.global_rank == 1:
            loss = loss * float("inf")
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self.scales.append(float(self.trainer.precision_plugin.scaler.get_scale()))

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)


def main() -> None:
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(128, 8, generator=g)
    y = torch.sin(x.sum(dim=1, keepdim=True))
    loader = torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y), batch_size=8, shuffle=False
    )
    model = Model()
    scaler = torch.amp.GradScaler("cpu", init_scale=INIT_SCALE)
    trainer = pl.Trainer(
        strategy=args.strategy,
        accelerator="cpu",
        devices=2,
        max_epochs=2,
        plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)],
        gradient_clip_val=0.5,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=args.outdir,
    )
    trainer.fit(model, loader)
    rank = trainer.global_rank
    record = {
        "rank": rank,
        "world_size": trainer.world_size,
        "plugin": type(trainer.precision_plugin).__name__,
        "scales": model.scales,
        "global_step": trainer.global_step,
        "params": {
            k: v.detach().double().flatten().tolist() for k, v in model.net.state_dict().items()
        },
        "finite": all(bool(torch.isfinite(p).all()) for p in model.parameters()),
    }
    path = os.path.join(args.outdir, f"{args.label}.rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()

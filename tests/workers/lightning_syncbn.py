"""Worker for tests/test_sync_batchnorm.py: Trainer(strategy="cring",
sync_batchnorm=True) on 2 ranks (under cringrun, devices=1). Each rank trains
on its own half of the data; records the batch-norm class during and after
fit, the running statistics and the weights. Writes <out>/rank<R>.json."""

import json
import sys

import lightning.pytorch as pl
import torch

import cring
import cring.lightning  # registers strategy "cring"

out_dir = sys.argv[1]


class Model(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(4, 6), torch.nn.BatchNorm1d(6), torch.nn.ReLU(), torch.nn.Linear(6, 1)
        )
        self.classes_in_fit = set()

    def forward(self, x):
        return self.net(x)

    def training_step(self, batch, batch_idx):
        self.classes_in_fit.add(type(self.net[1]).__name__)
        x, y = batch
        return torch.nn.functional.mse_loss(self(x).squeeze(1), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


g = torch.Generator().manual_seed(1)
x = torch.randn(64, 4, generator=g)
x[1::2] = x[1::2] * 4 + 3  # rank 1's half (odd indices) has other statistics
data = torch.utils.data.TensorDataset(x, x.sum(1))
loader = torch.utils.data.DataLoader(data, batch_size=8, shuffle=False)
model = Model()
trainer = pl.Trainer(
    strategy="cring",
    accelerator="cpu",
    devices=1,
    sync_batchnorm=True,
    max_epochs=2,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
trainer.fit(model, loader)
bn = model.net[1]
result = {
    "rank": trainer.global_rank,
    "size": trainer.world_size,
    "classes_in_fit": sorted(model.classes_in_fit),
    "class_after_fit": type(bn).__name__,
    "running_mean": bn.running_mean.tolist(),
    "running_var": bn.running_var.tolist(),
    "weights": [p.detach().flatten().tolist() for p in model.parameters()],
    "cring_initialized_after": cring.is_initialized(),
}
with open(f"{out_dir}/rank{trainer.global_rank}.json", "w") as f:
    json.dump(result, f)

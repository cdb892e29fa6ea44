"""Worker: Lightning's BoringModel trained with Trainer(strategy=...) on 2 ranks,
recording what tests/test_lightning.py compares between strategy="cring" and
strategy="ddp" (gloo) and between ranks. Writes <outdir>/<label>.rank<R>.json.

    python lightning_fit.py OUTDIR LABEL --strategy cring --devices 2 [--full] [--num-nodes N]
    (--strategy auto --devices auto: what Trainer() chooses by itself)

The main fit: a BoringModel with a second layer, SGD with momentum, gradient
clipping, EarlyStopping on a metric that only rank 1 sees stagnate, a
ModelCheckpoint, sync_dist logging of rank-dependent values, and the
strategy's collectives called directly at the end of training. With --full
also: validate, test and predict on the same Trainer, and a second fit with
accumulate_grad_batches=2.
"""

import argparse
import json
import os
import sys
import time

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import TorchCheckpointIO
from lightning.pytorch.callbacks import Callback, EarlyStopping, ModelCheckpoint
from lightning.pytorch.demos.boring_classes import BoringModel

import cring
import cring.lightning  # registers strategy "cring"

parser = argparse.ArgumentParser()
parser.add_argument("outdir")
parser.add_argument("label")
parser.add_argument("--strategy", default="cring")
parser.add_argument("--devices", type=lambda v: v if v == "auto" else int(v), default=2)
parser.add_argument("--num-nodes", type=int, default=1)
parser.add_argument("--full", action="store_true")
args = parser.parse_args()
# "auto" under cringrun is cring too (cring.lightning makes it so)
CRING = args.strategy == "cring" or (args.strategy == "auto" and "CRING_RANK" in os.environ)
MAX_EPOCHS = 4
T0 = time.monotonic()


class Model(BoringModel):
    """BoringModel's layer plus a small head, so that backward has two stages."""

    def __init__(self):
        super().__init__()
        self.head = torch.nn.Linear(2, 2)
        self.seen = {}  # epoch -> first feature of every training sample this rank saw
        self.max_in_flight = 0
        self.max_grad_norm = 0.0  # what gradient clipping (after averaging) saw
        self.layer.weight.register_hook(self._layer_grad)

    def _layer_grad(self, grad):
        # the first layer's gradient comes last in backward: by then the head's
        # gradients should already be travelling (white-box: the strategy's averager)
        averager = getattr(self.trainer.strategy, "_averager", None) if self._trainer else None
        if averager is not None:
            self.max_in_flight = max(self.max_in_flight, averager.in_flight)
        return grad

    def on_before_optimizer_step(self, optimizer):
        norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in self.parameters()]))
        self.max_grad_norm = max(self.max_grad_norm, float(norm))

    def forward(self, x):
        return self.head(self.layer(x))

    def training_step(self, batch, batch_idx):
        self.seen.setdefault(str(self.current_epoch), []).extend(batch[:, 0].tolist())
        loss = self.step(batch)
        self.log("train_loss", loss, sync_dist=True, on_step=False, on_epoch=True)
        return {"loss": loss}

    def validation_step(self, batch, batch_idx):
        loss = self.step(batch)
        self.log("val_loss", loss, sync_dist=True)
        self.log("rank_mean", float(self.global_rank), sync_dist=True)
        self.log("rank_max", float(self.global_rank), sync_dist=True, reduce_fx="max")
        # not synced: rank 0's signal improves every epoch, rank 1's never does
        self.log("es_signal", 1.0 if self.global_rank == 1 else -float(self.current_epoch))
        return {"x": loss}

    def test_step(self, batch, batch_idx):
        self.log("test_rank_mean", float(self.global_rank), sync_dist=True)
        return {"y": self.step(batch)}

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.02, momentum=0.9)


class RecordingCheckpointIO(TorchCheckpointIO):
    """Notes which rank wrote each checkpoint."""

    def save_checkpoint(self, checkpoint, path, storage_options=None):
        with open(os.path.join(args.outdir, f"{args.label}.saves.{os.getpid()}.txt"), "a") as f:
            f.write(f"{rank_now()} {path}\n")
        super().save_checkpoint(checkpoint, path, storage_options)


def rank_now():
    from lightning.pytorch.utilities.rank_zero import rank_zero_only

    return rank_zero_only.rank


class Collectives(Callback):
    """The strategy's collectives, called directly at the end of training."""

    def __init__(self):
        self.results = {}

    def on_train_end(self, trainer, pl_module):
        s, r = trainer.strategy, trainer.global_rank
        out = self.results
        from torch.distributed import ReduceOp

        for op in ("sum", "mean", "avg", "max", "min"):
            out[f"reduce_{op}"] = s.reduce(
                torch.tensor([r + 1.0, 2.0 * (r + 1)]), reduce_op=op
            ).tolist()
        out["reduce_SUM"] = s.reduce(torch.tensor([r + 1.0]), reduce_op=ReduceOp.SUM).tolist()
        out["reduce_MAX"] = s.reduce(torch.tensor([r + 1.0]), reduce_op=ReduceOp.MAX).tolist()
        out["reduce_int_mean"] = s.reduce(torch.tensor([r + 2]), reduce_op="mean").tolist()
        out["reduce_not_a_tensor"] = s.reduce(3.5)
        out["all_gather"] = s.all_gather(torch.tensor([r, 10 + r])).tolist()
        x = torch.full((2,), r + 1.0, requires_grad=True)
        gathered = s.all_gather(x, sync_grads=True)
        (gathered * torch.tensor([[1.0, 2.0], [3.0, 4.0]])).sum().backward()
        out["all_gather_grad"] = x.grad.tolist()
        out["broadcast"] = s.broadcast({"from": r, "text": f"rank {r}"}, src=1)
        out["all_true"] = s.reduce_boolean_decision(r == 0, all=True)
        out["any_true"] = s.reduce_boolean_decision(r == 0, all=False)
        s.barrier("end")


class TensorCounts(Callback):
    """cring's engine counters around every training batch (tensors reduced)."""

    def __init__(self):
        self.diffs = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.before = cring.engine_stats()["tensors"]

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.diffs.append(cring.engine_stats()["tensors"] - self.before)


def weights(module):
    return {k: v.flatten().tolist() for k, v in module.state_dict().items()}


def trainer_for(**kwargs):
    kwargs.setdefault("max_epochs", MAX_EPOCHS)
    return pl.Trainer(
        strategy=args.strategy,
        accelerator="cpu",
        devices=args.devices,
        num_nodes=args.num_nodes,
        default_root_dir=args.outdir,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **kwargs,
    )


def metrics(trainer):
    return {k: float(v) for k, v in trainer.callback_metrics.items()}


result = {}
pl.seed_everything(7)
model = Model()
early = EarlyStopping(monitor="es_signal", mode="min", patience=1)
ckpt_dir = os.path.join(args.outdir, f"ckpt-{args.label}")
checkpoint = ModelCheckpoint(dirpath=ckpt_dir, filename="model", save_top_k=1)
collectives = Collectives()
trainer = trainer_for(
    gradient_clip_val=0.05,
    callbacks=[early, checkpoint, collectives],
    plugins=[RecordingCheckpointIO()],
)
trainer.fit(model)
rank = trainer.global_rank
dataset = trainer.train_dataloader.dataset
result["fit"] = {
    "weights": weights(model),
    "current_epoch": trainer.current_epoch,
    "stopped_epoch": early.stopped_epoch,
    "seen": model.seen,
    "dataset": dataset.data[:, 0].tolist(),
    "metrics": metrics(trainer),
    "collectives": collectives.results,
    "max_in_flight": model.max_in_flight,
    "max_grad_norm": model.max_grad_norm,
    "gradient_clip_val": trainer.gradient_clip_val,
    "cring_initialized_after": cring.is_initialized(),
    "world_size": trainer.world_size,
    "strategy": type(trainer.strategy).__name__,
    "checkpoint_path": checkpoint.best_model_path,
}
if checkpoint.best_model_path and os.path.exists(checkpoint.best_model_path):
    saved = torch.load(checkpoint.best_model_path, weights_only=False)["state_dict"]
    result["fit"]["checkpoint_weights"] = {k: v.flatten().tolist() for k, v in saved.items()}

if args.full:
    result["validate"] = trainer.validate(model, verbose=False)[0]
    result["validate_cring_after"] = cring.is_initialized()
    result["test"] = trainer.test(model, verbose=False)[0]
    predictions = trainer.predict(model)
    result["predict"] = {"count": sum(len(p) for p in predictions)}
    result["predict_cring_after"] = cring.is_initialized()
    # after the run, the strategy's collectives still communicate (as DDP's do): the
    # usual gathering of every rank's predictions
    count = torch.tensor([rank, sum(len(p) for p in predictions)])
    result["after_run"] = {
        "all_gather": trainer.strategy.all_gather(count).tolist(),
        "reduce_sum": float(trainer.strategy.reduce(torch.tensor(1.0), reduce_op="sum")),
        "broadcast": trainer.strategy.broadcast(f"rank {rank}", src=1),
    }
    trainer.strategy.barrier("after_run")
    if CRING:
        import cring.torch as hvd

        result["after_run"]["hvd_size"] = hvd.size()  # Horovod's strategy left hvd running

    pl.seed_everything(11)
    acc_model = Model()
    counts = TensorCounts() if CRING else Callback()
    acc = trainer_for(
        max_epochs=1, accumulate_grad_batches=2, callbacks=[counts], enable_checkpointing=False
    )
    acc.fit(acc_model)
    result["accumulate"] = {
        "weights": weights(acc_model),
        "tensor_counts": getattr(counts, "diffs", []),
        "params": len(list(acc_model.parameters())),
    }

result["rank"] = rank
result["seconds"] = time.monotonic() - T0
with open(os.path.join(args.outdir, f"{args.label}.rank{rank}.json"), "w") as f:
    json.dump(result, f)
print(f"rank {rank}: done in {result['seconds']:.1f} s", flush=True)
# the process that started the others waits for them (DDP's launcher does not)
for proc in getattr(trainer.strategy.launcher, "procs", []):
    proc.wait()
sys.exit(0)

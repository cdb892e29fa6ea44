"""Worker: trainer.save_checkpoint() after fit() returns, with CRingStrategy
joining cring itself (which stays initialised after fit), one rank per
process under cringrun (devices=1). argv: outdir stage.
For shard_state 0 and `stage`: fit two epochs, save after fit on rank 0 only
(as Lightning 1.9's Horovod test script does: no rank may need the others for
it); the sharded checkpoint's optimizer state must equal the unsharded one's
(the whole state, gathered at the end of fit). Then a new Trainer resumes each checkpoint
(ckpt_path=): it starts from the saved optimizer state, step count and
weights, and two more epochs end with the same weights sharded or not.
Writes <outdir>/rank<R>.json (Checks)."""

import copy
import os
import sys
import warnings

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from zero_common import max_diff, state_diff

import cring
from cring.lightning import CRingStrategy

from engine_common import Checks

warnings.filterwarnings("ignore")
torch.set_num_threads(1)
outdir, stage = sys.argv[1], int(sys.argv[2])
rank, size = int(os.environ["CRING_RANK"]), int(os.environ["CRING_SIZE"])
checks = Checks(outdir, rank, size)
TOL = 1e-6


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(12, 13), torch.nn.Tanh(), torch.nn.Linear(13, 3)
        )
        self.start = None  # (global step, optimizer state) when training starts

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def on_train_start(self):
        # sharded: state_dict() is a collective that gives every rank all of the state
        state = self.trainer.strategy.optimizers[0].state_dict()
        self.start = (self.trainer.global_step, copy.deepcopy(state))  # training changes it

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=0.01)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(7)
        ds = TensorDataset(torch.randn(32, 12, generator=g), torch.randn(32, 3, generator=g))
        return DataLoader(ds, batch_size=4)


def trainer(shard_state: int, epochs: int) -> L.Trainer:
    return L.Trainer(
        strategy=CRingStrategy(shard_state=shard_state),
        accelerator="cpu",
        devices=1,
        max_epochs=epochs,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def vector(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def ckpt(shard_state: int) -> str:
    return os.path.join(outdir, f"after_fit{shard_state}.ckpt")


def save_after_fit():
    for shard_state in (0, stage):
        t = trainer(shard_state, 2)
        t.fit(Model())
        if not cring.is_initialized() or cring.size() != size:
            return "cring is not initialised after fit (the strategy should leave it running)"
        if rank == 0:
            # the strategy's barrier inside save_checkpoint does not wait between runs,
            # so rank 0 can save alone
            t.save_checkpoint(ckpt(shard_state))
        cring.barrier()
    states = [torch.load(ckpt(s), weights_only=False) for s in (0, stage)]
    if states[1]["global_step"] != states[0]["global_step"] or states[0]["global_step"] == 0:
        return f"global steps {states[0]['global_step']} / {states[1]['global_step']}"
    problem = state_diff(states[1]["optimizer_states"][0], states[0]["optimizer_states"][0])
    if problem:
        return f"checkpointed optimizer states: {problem}"
    checks.info["adam_steps"] = [
        float(s["step"]) for s in states[1]["optimizer_states"][0]["state"].values()
    ]
    return None


def resume():
    out = {}
    for shard_state in (0, stage):
        saved = torch.load(ckpt(shard_state), weights_only=False)
        model = Model()
        trainer(shard_state, 4).fit(model, ckpt_path=ckpt(shard_state))
        step, state = model.start
        if step != saved["global_step"]:
            return (
                f"shard_state={shard_state}: resumed at step {step}, saved {saved['global_step']}"
            )
        problem = state_diff(state, saved["optimizer_states"][0])
        if problem:
            return f"shard_state={shard_state}: resumed optimizer state: {problem}"
        out[shard_state] = vector(model)
    checks.info["moved"] = max_diff(
        out[0], torch.cat([t.reshape(-1) for t in saved["state_dict"].values()])
    )
    d = max_diff(out[stage], out[0])
    return f"sharded and unsharded resumes differ by {d:.3g}" if d > TOL else None


checks.check("save_after_fit", save_after_fit)
if not checks.failures:
    checks.check("resume", resume)
checks.finish()

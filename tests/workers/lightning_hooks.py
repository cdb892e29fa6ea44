"""Worker for test_lightning_hooks.py: Trainer(strategy=CRingStrategy(
comm_hook=powerSGD_hook, comm_state=PowerSGDState(...))) under cringrun
(devices=1 per process). argv: outdir.

  1. fit 6 steps (2 plain, then PowerSGD), trainer.save_checkpoint() during
     fit (on_train_end): the checkpoint holds the hook's state;
  2. a new Trainer with a new PowerSGDState resumes it (ckpt_path=): at the
     start of training the state has the saved step count, random
     generator, P and Q; rank 0 its own error feedback, rank 1 none (the
     file is rank 0's: see docs/hooks.md); 4 more steps train;
  3. shard_state=1 with the hook trains too; every rank ends with the same
     weights in every fit.
Writes <outdir>/rank<R>.json (Checks).
"""

import copy
import os
import sys
import warnings

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import cring
from cring.lightning import CRingStrategy
from cring.torch import hooks

from engine_common import Checks

warnings.filterwarnings("ignore")
torch.set_num_threads(1)
outdir = sys.argv[1]
rank, size = int(os.environ["CRING_RANK"]), int(os.environ["CRING_SIZE"])
checks = Checks(outdir, rank, size)
CKPT = os.path.join(outdir, "hooks.ckpt")


class Model(L.LightningModule):
    def __init__(self, save_at_end: bool = False):
        super().__init__()
        torch.manual_seed(3)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(24, 64), torch.nn.Tanh(), torch.nn.Linear(64, 3)
        )
        self.save_at_end = save_at_end
        self.at_start = None  # the hook state's figures when training starts
        self.gathered = None  # every rank's weights at the end

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(7)
        ds = TensorDataset(torch.randn(96, 24, generator=g), torch.randn(96, 3, generator=g))
        return DataLoader(ds, batch_size=4)

    def on_train_start(self):
        state = self.trainer.strategy._comm_state
        self.at_start = copy.deepcopy(state.state_dict())  # training changes its tensors

    def on_train_end(self):
        flat = torch.cat([p.detach().reshape(-1) for p in self.parameters()])
        self.gathered = cring.allgather(flat.view(1, -1), name="lightning.hooks.w")
        if self.save_at_end:
            self.trainer.save_checkpoint(CKPT)


def trainer(state, steps: int, shard_state: int = 0) -> L.Trainer:
    return L.Trainer(
        strategy=CRingStrategy(
            comm_hook=hooks.powerSGD_hook, comm_state=state, shard_state=shard_state
        ),
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def same_everywhere(model) -> bool:
    return all(torch.equal(model.gathered[0], row) for row in model.gathered)


saved = {}


def fit_and_save():
    state = hooks.PowerSGDState(matrix_approximation_rank=2, start_powerSGD_iter=2)
    model = Model(save_at_end=True)
    trainer(state, 6).fit(model)
    if state.iter != 2 or not state.error_dict or not state.q_memory_dict:
        return f"after fit: iter {state.iter}, {len(state.error_dict)} error buffers"
    if not same_everywhere(model):
        return "ranks ended with different weights"
    saved["q"] = {k: v.clone() for k, v in state.q_memory_dict.items()}
    saved["error"] = {k: v.clone() for k, v in state.error_dict.items()}
    saved["weights"] = model.gathered[0].clone()
    ckpt = torch.load(CKPT, weights_only=False)
    if "cring_comm_state" not in ckpt or ckpt["cring_comm_state"]["iter"] != 2:
        return f"the checkpoint holds no hook state: {sorted(ckpt)}"
    return None


def resume():
    state = hooks.PowerSGDState(matrix_approximation_rank=2, start_powerSGD_iter=2)
    model = Model()
    trainer(state, 10).fit(model, ckpt_path=CKPT)
    start = model.at_start
    if start["iter"] != 2:
        return f"resumed at hook step {start['iter']}, saved 2"
    q = saved["q"]
    if start["q_memory"].keys() != q.keys() or not all(
        torch.equal(start["q_memory"][k], q[k]) for k in q
    ):
        return "resumed without the saved Q (warm start)"
    errors = start["error"]
    if rank == 0 and not all(torch.equal(errors[k], saved["error"][k]) for k in saved["error"]):
        return "rank 0 did not take back its error feedback"
    if rank != 0 and errors:
        return "rank 1 took rank 0's error feedback"
    if not same_everywhere(model):
        return "ranks ended with different weights after resuming"
    if torch.equal(model.gathered[0], saved["weights"]):
        return "the resumed fit did not train"
    return None


def sharded():
    state = hooks.PowerSGDState(matrix_approximation_rank=2, start_powerSGD_iter=2)
    model = Model()
    trainer(state, 5, shard_state=1).fit(model)
    if state.iter != 2 or not state.error_dict:
        return f"shard_state=1: iter {state.iter}, {len(state.error_dict)} error buffers"
    return None if same_everywhere(model) else "shard_state=1: ranks differ"


checks.check("fit and save", fit_and_save)
checks.check("resume", resume)
checks.check("shard_state=1", sharded)
checks.finish()

"""Worker: CRingStrategy(shard_state=S) and CRingFabricStrategy(shard_state=S)
against shard_state=0, one rank per process under cringrun (devices=1).
argv: outdir phase stage.
  fit (3 ranks): Trainer fits with Adam, a StepLR schedule, gradient
    clipping (stage 1) and accumulate_grad_batches=2, unsharded and sharded;
    weights and learning rates must agree; each saves a checkpoint
    (trainer.save_checkpoint: Lightning consolidates the sharded state on
    rank 0), whose optimizer states must agree too.
  resume (2 ranks): both checkpoints resumed (ckpt_path=) for two more
    epochs, sharded and unsharded: the same weights.
  fabric (2 ranks): Fabric with fabric.clip_gradients, fabric.save and
    fabric.load into new objects, training on: sharded equals unsharded.
Writes <outdir>/<phase>/rank<R>.json (Checks)."""

import os
import sys
import warnings

import lightning as L
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
from zero_common import max_diff, state_diff

import cring
import cring.lightning
from cring.lightning import CRingFabricStrategy, CRingStrategy

from engine_common import Checks

warnings.filterwarnings("ignore")
torch.set_num_threads(1)
outdir, phase, stage = sys.argv[1], sys.argv[2], int(sys.argv[3])
cring.init()  # ours: the strategies leave it running between fits
rank, size = cring.rank(), cring.size()
os.makedirs(os.path.join(outdir, phase), exist_ok=True)
checks = Checks(os.path.join(outdir, phase), rank, size)
TOL = 1e-6


def data() -> TensorDataset:
    g = torch.Generator().manual_seed(7)
    return TensorDataset(torch.randn(48, 32, generator=g), torch.randn(48, 5, generator=g))


class Model(L.LightningModule):
    """32-33-5: 1259 parameters, divisible by neither 2 nor 3."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(32, 33), torch.nn.Tanh(), torch.nn.Linear(33, 5)
        )

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.Adam(self.parameters(), lr=0.01)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)}

    def train_dataloader(self):
        return DataLoader(data(), batch_size=4)


def trainer(shard_state: int, epochs: int) -> L.Trainer:
    return L.Trainer(
        strategy=CRingStrategy(shard_state=shard_state),
        accelerator="cpu",
        devices=1,
        max_epochs=epochs,
        accumulate_grad_batches=2,
        gradient_clip_val=0.05 if stage == 1 else None,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )


def vector(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def ckpt(shard_state: int) -> str:
    return os.path.join(outdir, f"fit{shard_state}.ckpt")


def fit():
    out = {}
    for shard_state in (0, stage):
        model = Model()
        t = trainer(shard_state, 2)
        t.fit(model)
        t.save_checkpoint(ckpt(shard_state))
        opt = t.strategy.optimizers[0]
        out[shard_state] = (vector(model), opt.param_groups[0]["lr"])
        if shard_state and not hasattr(opt, "consolidate_state_dict"):
            return "the strategy's optimizer is not sharded"
    checks.info["moved"] = max_diff(out[0][0], vector(Model()))
    d = max_diff(out[stage][0], out[0][0])
    if d > TOL:
        return f"sharded and unsharded fits differ by {d:.3g}"
    if out[stage][1] != out[0][1] or out[0][1] >= 0.01:
        return f"learning rates: sharded {out[stage][1]}, unsharded {out[0][1]} (StepLR)"
    cring.barrier()
    states = [torch.load(ckpt(s), weights_only=False)["optimizer_states"][0] for s in (0, stage)]
    problem = state_diff(states[1], states[0])
    return f"checkpointed optimizer states: {problem}" if problem else None


def resume():
    out = {}
    for shard_state in (0, stage):
        model = Model()
        trainer(shard_state, 4).fit(model, ckpt_path=ckpt(shard_state))
        out[shard_state] = vector(model)
    d = max_diff(out[stage], out[0])
    checks.info["diff"] = d
    checks.info["moved"] = max_diff(
        out[0],
        torch.cat(
            [t.reshape(-1) for t in torch.load(ckpt(0), weights_only=False)["state_dict"].values()]
        ),
    )
    return f"sharded and unsharded resumes differ by {d:.3g}" if d > TOL else None


def fabric():
    out = {}
    ds = data()
    for shard_state in (0, stage):
        f = L.Fabric(
            strategy=CRingFabricStrategy(shard_state=shard_state), accelerator="cpu", devices=1
        )
        f.launch()

        def setup():
            torch.manual_seed(3)
            net = torch.nn.Sequential(
                torch.nn.Linear(32, 33), torch.nn.Tanh(), torch.nn.Linear(33, 5)
            )
            return f.setup(net, torch.optim.AdamW(net.parameters(), lr=0.01))

        def train(net, opt, steps, first):
            for i in range(first, first + steps):
                x, y = ds[(i * 8 + rank * 4) % 48 : (i * 8 + rank * 4) % 48 + 4]
                for micro in range(2):
                    with f.no_backward_sync(net, enabled=micro == 0):
                        f.backward(
                            F.mse_loss(
                                net(x[micro * 2 : micro * 2 + 2]), y[micro * 2 : micro * 2 + 2]
                            )
                        )
                f.clip_gradients(net, opt, max_norm=0.05)
                opt.step()
                opt.zero_grad()

        net, opt = setup()
        if shard_state and not hasattr(opt.optimizer, "consolidate_state_dict"):
            return "fabric.setup() did not shard the optimizer"
        train(net, opt, 4, 0)
        path = os.path.join(outdir, f"fabric{shard_state}.ckpt")
        f.save(path, {"model": net, "optimizer": opt})
        net2, opt2 = setup()
        f.load(path, {"model": net2, "optimizer": opt2})
        train(net2, opt2, 4, 4)
        out[shard_state] = vector(net2)
    d = max_diff(out[stage], out[0])
    checks.info["diff"] = d
    return f"sharded and unsharded Fabric runs differ by {d:.3g}" if d > TOL else None


checks.check(phase, {"fit": fit, "resume": resume, "fabric": fabric}[phase])
cring.shutdown()
checks.finish()

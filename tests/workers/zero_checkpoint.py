"""Worker: a checkpoint of a sharded optimizer saved at one world size
resumes at another. argv: outdir phase stage.
  save (run at 3 ranks): train 6 steps with shard_state=stage (Adam, two
    param groups), rank 0 saves the model and opt.state_dict() (a collective)
    to <outdir>/ckpt.pt;
  resume (run at 2 ranks): load it twice, into a sharded optimizer (same
    stage) and into an unsharded one, train both 10 more steps on the same
    data: they must agree within 1e-6, and so must their state dicts.
Writes <outdir>/<phase>.rank<R>.json via Checks (outdir/phase)."""

import os
import sys

import torch
from zero_common import make, max_diff, state_diff, train, vector

import cring

from engine_common import Checks

torch.set_num_threads(1)
outdir, phase, stage = sys.argv[1], sys.argv[2], int(sys.argv[3])
cring.init()
rank, size = cring.rank(), cring.size()
os.makedirs(os.path.join(outdir, phase), exist_ok=True)
checks = Checks(os.path.join(outdir, phase), rank, size)
path = os.path.join(outdir, "ckpt.pt")


def save():
    model, opt = make(rank, "adam", stage, "ckpt")
    train(model, opt, rank, 6)
    state = opt.state_dict()
    if rank == 0:
        torch.save({"model": model.state_dict(), "optimizer": state, "size": size}, path)
    cring.barrier()
    return None


def resume():
    ckpt = torch.load(path, weights_only=False)
    if ckpt["size"] == size:
        return f"the checkpoint was saved at {size} ranks too: nothing is tested"
    runs = {}
    for label, shard_state in (("sharded", stage), ("unsharded", 0)):
        model, opt = make(rank, "adam", shard_state, f"resume.{label}", seed=999)
        model.load_state_dict(ckpt["model"])
        opt.load_state_dict(ckpt["optimizer"])
        train(model, opt, rank, 10, first=6)
        runs[label] = (vector(model), opt.state_dict())
    d = max_diff(runs["sharded"][0], runs["unsharded"][0])
    checks.info["diff"] = d
    checks.info["moved"] = max_diff(
        runs["sharded"][0], torch.cat([t.reshape(-1) for t in ckpt["model"].values()])
    )
    if d > 1e-6:
        return f"sharded and unsharded resumes differ by {d:.3g}"
    problem = state_diff(runs["sharded"][1], runs["unsharded"][1])
    return f"state dicts after resuming: {problem}" if problem else None


checks.check(phase, save if phase == "save" else resume)
cring.shutdown()
checks.finish()

"""Worker for tests/test_elastic.py: elastic training of a tiny torch model
with cring.torch.elastic.TorchState and DistributedOptimizer (SGD with
momentum) under `cringrun --elastic`. The data of rank r at step s is
elastic_torch_data(r, s); the test replays the run without cring.

  --kill W:S          worker W SIGKILLs itself when it is about to run step S
  --kill-during W:S   worker W, on reaching step S, starts a thread that
                      SIGKILLs it 0-5 ms later, wherever it is then
"""

import argparse
import json
import os
import random
import signal
import threading

import torch

import cring.torch as hvd
import cring.torch.elastic


def make_model():
    model = torch.nn.Linear(3, 2)
    with torch.no_grad():
        model.weight.copy_(torch.arange(6, dtype=torch.float32).reshape(2, 3) * 0.1)
        model.bias.copy_(torch.tensor([0.1, -0.1]))
    return model


def make_optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


def data(rank, step):
    x = torch.linspace(-1, 1, 12).reshape(4, 3) * (rank + 1) + 0.01 * step
    y = torch.full((4, 2), rank - 0.5)
    return x, y


def loss_of(model, rank, step):
    x, y = data(rank, step)
    return ((model(x) - y) ** 2).mean()


if __name__ == "__main__":
    torch.set_num_threads(1)
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--commit-every", type=int, required=True)
    parser.add_argument("--kill", action="append", default=[])
    parser.add_argument("--kill-during")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    worker_id = int(os.environ["CRING_ELASTIC_WORKER_ID"])
    kills = {int(w): int(s) for w, s in (item.split(":") for item in args.kill)}
    kill_during = None
    if args.kill_during and int(args.kill_during.split(":")[0]) == worker_id:
        kill_during = int(args.kill_during.split(":")[1])

    hvd.init()
    model = make_model()
    optimizer = hvd.DistributedOptimizer(
        make_optimizer(model), named_parameters=model.named_parameters()
    )
    state = cring.torch.elastic.TorchState(model, optimizer, step=0, sizes=[])

    @cring.torch.elastic.run
    def train(state):
        while state.step < args.steps:
            s = state.step
            if kills.get(worker_id) == s:
                os.kill(os.getpid(), signal.SIGKILL)
            if kill_during == s:
                threading.Timer(
                    random.uniform(0, 0.005), lambda: os.kill(os.getpid(), signal.SIGKILL)
                ).start()
            state.optimizer.zero_grad()
            loss_of(state.model, hvd.rank(), s).backward()
            state.optimizer.step()
            state.sizes.append(hvd.size())
            state.step += 1
            if state.step % args.commit_every == 0:
                state.commit()

    train(state)
    momentum = [optimizer.state[p]["momentum_buffer"].tolist() for p in model.parameters()]
    with open(os.path.join(args.out, f"worker{worker_id}.json"), "w") as f:
        json.dump(
            {
                "worker": worker_id,
                "rank": hvd.rank(),
                "size": hvd.size(),
                "params": [p.detach().tolist() for p in model.parameters()],
                "momentum": momentum,
                "sizes": state.sizes,
            },
            f,
        )
    hvd.shutdown()

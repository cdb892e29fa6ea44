"""Worker for tests/test_elastic.py: elastic training of a tiny torch model
with cring.torch.elastic.TorchState and DistributedOptimizer (SGD with
momentum) under `cringrun --elastic`. The data of rank r at step s is
elastic_torch_data(r, s); the test replays the run without cring.

  --steps, --commit-every, --kill, --kill-during, --out: see elastic_common.py
"""

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
    from elastic_common import Killer, parser  # the test imports this file for its model

    torch.set_num_threads(1)
    args = parser().parse_args()
    me = Killer(args)

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
            me.before_step(s)
            state.optimizer.zero_grad()
            loss_of(state.model, hvd.rank(), s).backward()
            state.optimizer.step()
            state.sizes.append(hvd.size())
            state.step += 1
            if state.step % args.commit_every == 0:
                state.commit()

    train(state)
    momentum = [optimizer.state[p]["momentum_buffer"].tolist() for p in model.parameters()]
    me.write_result(
        {
            "worker": me.worker_id,
            "rank": hvd.rank(),
            "size": hvd.size(),
            "params": [p.detach().tolist() for p in model.parameters()],
            "momentum": momentum,
            "sizes": state.sizes,
        }
    )
    hvd.shutdown()

"""Helpers shared by the torch_opt_*.py workers: a small float64 model whose
parameters include a frozen one and one that only rank 0's samples use,
deterministic per-rank data, distributed training with DistributedOptimizer
and the single-process reference on the concatenated batch."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F

from cring.torch.optimizer import DistributedOptimizer, broadcast_parameters

DIM = 6


class Net(torch.nn.Module):
    """An MLP of `depth` Linear layers (float64), plus a frozen parameter
    (requires_grad False) and `extra`, which only rows owned by rank 0 use:
    on other ranks it gets no gradient at all (grad None)."""

    def __init__(self, seed: int, width: int = 8, depth: int = 3):
        super().__init__()
        torch.manual_seed(seed)
        sizes = [DIM] + [width] * (depth - 1) + [1]
        self.layers = torch.nn.ModuleList(torch.nn.Linear(a, b) for a, b in zip(sizes, sizes[1:]))
        self.frozen = torch.nn.Parameter(torch.randn(width), requires_grad=False)
        self.extra = torch.nn.Parameter(torch.randn(width) * 0.1)
        self.double()

    def forward(self, x: torch.Tensor, owner: torch.Tensor) -> torch.Tensor:
        h = x
        for i, layer in enumerate(self.layers[:-1]):
            h = torch.tanh(layer(h))
            if i == 0:
                h = h + 0.01 * self.frozen
                if bool((owner == 0).any()):
                    h = h + (owner == 0).to(h.dtype)[:, None] * self.extra
        return self.layers[-1](h).squeeze(1)


def batch(step: int, micro: int, rank: int, rows: int = 4) -> tuple:
    """Rank `rank`'s micro-batch `micro` of step `step`: the same on every process."""
    g = torch.Generator().manual_seed(100_000 * step + 1000 * micro + rank)
    x = torch.randn(rows, DIM, generator=g, dtype=torch.float64)
    y = torch.randn(rows, generator=g, dtype=torch.float64)
    return x, y


def vector(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def train_distributed(
    rank: int,
    make_opt: Callable,
    steps: int,
    bpps: int = 1,
    net_kwargs: Any = None,
    on_backward: Any = None,
    **dist_kwargs: Any,
):
    """Every rank starts from its own random model, takes rank 0's through
    broadcast_parameters, then trains on its own data."""
    model = Net(seed=100 + rank, **(net_kwargs or {}))
    broadcast_parameters(model.state_dict(), root_rank=0)
    groups = dist_kwargs.pop("groups", None)
    if callable(groups):
        groups = groups(model)
    opt = DistributedOptimizer(
        make_opt(model.parameters()),
        named_parameters=model.named_parameters(),
        backward_passes_per_step=bpps,
        groups=groups,
        **dist_kwargs,
    )
    for step in range(steps):
        opt.zero_grad()
        for micro in range(bpps):
            x, y = batch(step, micro, rank)
            F.mse_loss(model(x, torch.full((len(x),), rank)), y).backward()
        if on_backward is not None:
            on_backward(step, opt, model)
        opt.step()
    return model, opt


def train_reference(
    size: int, make_opt: Callable, steps: int, bpps: int = 1, net_kwargs: Any = None
):
    """One process, rank 0's initial model, every rank's micro-batch `m`
    concatenated into one batch; the bpps micro-batches accumulate."""
    model = Net(seed=100, **(net_kwargs or {}))
    opt = make_opt(model.parameters())
    for step in range(steps):
        opt.zero_grad()
        for micro in range(bpps):
            parts = [batch(step, micro, r) for r in range(size)]
            x = torch.cat([p[0] for p in parts])
            y = torch.cat([p[1] for p in parts])
            owner = torch.cat([torch.full((len(p[0]),), r) for r, p in enumerate(parts)])
            F.mse_loss(model(x, owner), y).backward()
        opt.step()
    return model


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max())


def jsonable(x: Any) -> Any:
    """Tensors as lists, tuples as lists, everything else as it is (or repr)."""
    if isinstance(x, torch.Tensor):
        return x.tolist()
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [jsonable(v) for v in x]
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return repr(x)

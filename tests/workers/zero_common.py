"""Helpers shared by the zero_*.py workers (sharded optimizer state): a
float32 model whose parameter count is divisible by neither 2 nor 3, with
one parameter large enough to travel alone, a 0-d one, a transposed
(non-contiguous) one, a frozen one and one only rank 0 uses; two param
groups with different learning rates; deterministic per-rank data."""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F

from cring.torch.optimizer import DistributedOptimizer, broadcast_parameters

IN, HID, MID, OUT = 523, 509, 7, 3  # 523 * 509 weights: over 1 MiB of float32


class Net(torch.nn.Module):
    def __init__(self, seed: int) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.big = torch.nn.Linear(IN, HID)
        self.mid = torch.nn.Linear(HID, MID)
        self.out = torch.nn.Linear(MID, OUT)
        self.scale = torch.nn.Parameter(torch.tensor(1.0))  # 0-d
        self.tall = torch.nn.Parameter(torch.randn(OUT, MID).t())  # (MID, OUT), transposed
        self.frozen = torch.nn.Parameter(torch.randn(MID), requires_grad=False)
        self.extra = torch.nn.Parameter(torch.randn(MID) * 0.1)  # only rank 0's rows use it

    def forward(self, x: torch.Tensor, rank: int) -> torch.Tensor:
        h = torch.tanh(self.mid(torch.tanh(self.big(x)))) + 0.01 * self.frozen
        if rank == 0:
            h = h + self.extra
        return (self.out(h) + h @ self.tall) * self.scale


def n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def param_groups(model: torch.nn.Module, lr: float) -> list:
    big = [model.big.weight, model.big.bias]
    rest = [p for n, p in model.named_parameters() if not n.startswith("big.")]
    return [{"params": big, "lr": lr}, {"params": rest, "lr": lr * 3}]


def adam(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.Adam(param_groups(model, 1e-3), weight_decay=1e-2)


def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(param_groups(model, 0.02), momentum=0.9, weight_decay=1e-3)


OPTIMIZERS = {"adam": adam, "sgd": sgd}


def batch(step: int, rank: int, rows: int = 8) -> tuple:
    g = torch.Generator().manual_seed(10_000 * step + rank)
    return torch.randn(rows, IN, generator=g), torch.randn(rows, OUT, generator=g)


def make(
    rank: int, kind: str, shard_state: int, prefix: str, seed: Optional[int] = None, **kwargs: Any
) -> tuple:
    """A model (rank 0's weights everywhere) and its DistributedOptimizer;
    `prefix` keeps the collectives' names apart from other optimizers'."""
    model = Net(seed=100 + rank if seed is None else seed)
    broadcast_parameters(model.state_dict(), root_rank=0)
    opt = DistributedOptimizer(
        OPTIMIZERS[kind](model),
        named_parameters=[(f"{prefix}.{n}", p) for n, p in model.named_parameters()],
        shard_state=shard_state,
        **kwargs,
    )
    return model, opt


def train(
    model: torch.nn.Module,
    opt: torch.optim.Optimizer,
    rank: int,
    steps: int,
    first: int = 0,
    closure: bool = False,
    bpps: int = 1,
    on_backward: Optional[Callable] = None,
) -> None:
    for step in range(first, first + steps):
        opt.zero_grad()
        if closure:

            def loss_fn(step: int = step) -> torch.Tensor:
                x, y = batch(step, rank)
                loss = F.mse_loss(model(x, rank), y)
                loss.backward()
                return loss

            opt.step(loss_fn)
            continue
        for micro in range(bpps):
            x, y = batch(step * bpps + micro, rank)
            F.mse_loss(model(x, rank), y).backward()
        if on_backward is not None:
            on_backward(opt)
        opt.step()


def vector(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest |a - b| / max(1, |b|): an absolute difference below 1, a
    relative one above. Sharded and unsharded runs sum the same float32 values
    in orders that depend on how the engine fused them (timing): at magnitude
    8 one rounding step is already 9.5e-7, so an absolute 1e-6 failed
    identical results by a rounding step."""
    if not a.numel():
        return 0.0
    a, b = a.double(), b.double()
    return float(((a - b).abs() / b.abs().clamp(min=1.0)).max())


def state_diff(a: dict, b: dict) -> Optional[str]:
    """None when two unsharded optimizer state dicts agree (tensors within
    1e-6 by max_diff, everything else equal), else what differs."""
    if [{k: v for k, v in g.items()} for g in a["param_groups"]] != [
        {k: v for k, v in g.items()} for g in b["param_groups"]
    ]:
        return f"param_groups differ: {a['param_groups']} != {b['param_groups']}"
    if sorted(a["state"]) != sorted(b["state"]):
        return f"state indices differ: {sorted(a['state'])} != {sorted(b['state'])}"
    for i in a["state"]:
        sa, sb = a["state"][i], b["state"][i]
        if sorted(sa) != sorted(sb):
            return f"state {i}: keys {sorted(sa)} != {sorted(sb)}"
        for k in sa:
            va, vb = sa[k], sb[k]
            if isinstance(va, torch.Tensor):
                if not isinstance(vb, torch.Tensor) or va.shape != vb.shape or va.dtype != vb.dtype:
                    return f"state {i}.{k}: {va!r:.60} vs {vb!r:.60}"
                if max_diff(va, vb) > 1e-6:
                    return (
                        f"state {i}.{k}: differs by {float((va - vb).abs().max()):.3g} "
                        f"(relative {max_diff(va, vb):.3g})"
                    )
            elif va != vb:
                return f"state {i}.{k}: {va!r} != {vb!r}"
    return None

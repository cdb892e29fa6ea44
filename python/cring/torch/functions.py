"""horovod.torch.functions on cring: broadcast_parameters and
broadcast_optimizer_state, which start every rank from rank root's model and
optimizer (as after loading a checkpoint on one rank); broadcast_object and
allgather_object, which Horovod's module also exports, are mpi_ops' (the same
functions). Uses cring's public API and torch only; the DistributedOptimizer
is in cring.torch.optimizer.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterable, Mapping
from typing import Any, Optional

import numpy as np
import torch

import cring

from .mpi_ops._objects import allgather_object, broadcast_object

__all__ = [
    "allgather_object",
    "broadcast_object",
    "broadcast_parameters",
    "broadcast_optimizer_state",
]


def _synchronize_all(handles: list) -> None:
    """Wait for every handle; raise the first error once all are done."""
    error: Optional[BaseException] = None
    for h in handles:
        try:
            cring.synchronize(h)
        except BaseException as e:
            error = error or e
    if error is not None:
        raise error


def _broadcast_object(obj: Any, root_rank: int, name: str, process_set: Any = None) -> Any:
    """root_rank's `obj`, pickled and broadcast, on every rank."""
    if cring.rank() == root_rank:
        payload = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
        length = np.array([payload.size], np.int64)
    else:
        length = np.zeros(1, np.int64)
    cring.broadcast_(length, root_rank, name=f"{name}.bytes", process_set=process_set)
    if cring.rank() != root_rank:
        payload = np.empty(int(length[0]), np.uint8)
    cring.broadcast_(payload, root_rank, name=f"{name}.data", process_set=process_set)
    return obj if cring.rank() == root_rank else pickle.loads(payload.tobytes())


def broadcast_parameters(params: Any, root_rank: int, process_set: Any = None) -> None:
    """Overwrite, in place, every tensor in `params` with root_rank's values.

    `params`: model.state_dict(), model.named_parameters(),
    model.parameters(), or any mapping or iterable of tensors or of (name,
    tensor) pairs. Every rank must pass the same names (or, unnamed, the same
    number of tensors in the same order). All broadcasts start at once (the
    engine fuses them) and have finished when this returns. `process_set`:
    only its ranks take part (root_rank is a global rank in it).
    """
    if isinstance(params, Mapping):
        items = list(params.items())
    elif isinstance(params, Iterable) and not isinstance(params, (torch.Tensor, str, bytes)):
        items = [x if isinstance(x, tuple) else (None, x) for x in params]
    else:
        raise ValueError(f"invalid params of type: {type(params).__name__}")
    handles, copies, seen = [], [], set()
    for i, item in enumerate(items):
        if len(item) != 2:
            raise ValueError("params must hold tensors or (name, tensor) pairs")
        name, t = item
        label = f"broadcast.{name}" if name is not None else f"broadcast_parameters.{i}"
        if not isinstance(t, torch.Tensor):
            raise ValueError(
                f"broadcast_parameters: {label!r} is a {type(t).__name__}, not a tensor"
            )
        if id(t) in seen:  # a tensor listed twice (tied weights)
            continue
        seen.add(id(t))
        target = t.detach()
        if not target.is_contiguous():
            staged = target.contiguous()
            copies.append((target, staged))
            target = staged
        handles.append(
            cring.broadcast_async_(target, root_rank, name=label, process_set=process_set)
        )
    _synchronize_all(handles)
    for t, staged in copies:
        t.copy_(staged)


def _describe_state(state: Any) -> Optional[dict]:
    """A parameter's optimizer state as root describes it to the others:
    tensors by shape, dtype and device type (their data is broadcast in
    place), everything else by value."""
    if not state:
        return None
    return {
        key: ("tensor", tuple(v.shape), v.dtype, v.device.type)
        if isinstance(v, torch.Tensor) and v.layout == torch.strided
        else ("value", v)
        for key, v in state.items()
    }


def _give_zero_gradients(optimizer: torch.optim.Optimizer, model: Any) -> None:
    """Horovod's preparation of a fresh optimizer (no state yet): every
    trainable parameter without a gradient gets a zero one (sparse for
    SparseAdam and for sparse nn.Embedding layers of `model`), so that code
    written for Horovod finds .grad set afterwards. Unlike Horovod, no step
    is taken: the parameters do not move (weight decay would move them)."""
    sparse_ids = set()
    if model is not None:
        for m in model.modules():
            if isinstance(m, torch.nn.Embedding) and m.sparse:
                sparse_ids.update(id(p) for p in m.parameters())
    all_sparse = isinstance(optimizer, torch.optim.SparseAdam)
    for group in optimizer.param_groups:
        for p in group["params"]:
            if p.requires_grad and p.grad is None:
                zero = torch.zeros_like(p.detach())
                p.grad = zero.to_sparse() if all_sparse or id(p) in sparse_ids else zero


def broadcast_optimizer_state(
    optimizer: torch.optim.Optimizer,
    root_rank: int,
    model: Optional[torch.nn.Module] = None,
    process_set: Any = None,
) -> None:
    """Make every rank's optimizer state equal to root_rank's: the
    hyperparameters of each param group (lr, betas, ...), and each
    parameter's state (Adam's step count and moments, SGD's momentum
    buffer, ...). Tensors are broadcast in place (all at once, fused by the
    engine); other values travel pickled.

    Where root has state that a rank lacks (a fresh optimizer: torch creates
    state lazily), the rank creates the tensors from root's shapes and dtypes,
    so nothing needs to step first and the parameters are never touched;
    where root has none, the rank's state is dropped. Every rank must hold
    the same number of param groups and parameters (ValueError on every rank
    otherwise). Works on a DistributedOptimizer or a plain optimizer.
    `process_set`: only its ranks take part (root_rank is a global rank in it).

    As in Horovod, on a rank whose optimizer has no state yet, trainable
    parameters whose .grad is None get a zero gradient (sparse for
    SparseAdam, and for `model`'s sparse nn.Embedding layers when `model` is
    given); the parameters themselves are not touched.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if not optimizer.state:
        _give_zero_gradients(optimizer, model)
    is_root = cring.rank() == int(root_rank)
    groups = optimizer.param_groups
    params = [p for group in groups for p in group["params"]]
    layout = [len(group["params"]) for group in groups]
    meta = None
    if is_root:
        meta = {
            "layout": layout,
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in groups],
            "state": [_describe_state(optimizer.state.get(p)) for p in params],
        }
    meta = _broadcast_object(meta, root_rank, "broadcast_optimizer_state.meta", process_set)
    # agree on every rank whether the layouts match, so that all raise or none does
    agree = np.array([1 if meta["layout"] == layout else 0], np.int32)
    cring.allreduce_(
        agree, op=cring.Min, name="broadcast_optimizer_state.layout", process_set=process_set
    )
    if not agree[0]:
        raise ValueError(
            f"broadcast_optimizer_state: param groups differ between ranks (rank "
            f"{cring.rank()} has parameters per group {layout}, root rank "
            f"{root_rank} has {meta['layout']})"
        )

    if not is_root:
        for group, root_group in zip(groups, meta["groups"]):
            for key in [k for k in group if k != "params" and k not in root_group]:
                del group[key]
            for key, value in root_group.items():
                mine = group.get(key)
                if (
                    isinstance(mine, torch.Tensor)
                    and isinstance(value, torch.Tensor)
                    and mine.shape == value.shape
                    and mine.dtype == value.dtype
                ):
                    mine.copy_(value)
                else:
                    group[key] = value

    handles, copies = [], []
    for i, (p, description) in enumerate(zip(params, meta["state"])):
        if description is None:
            if not is_root:
                optimizer.state.pop(p, None)
            continue
        mine = optimizer.state.get(p) or {}
        new_state = {}
        for key, (kind, *rest) in description.items():
            if kind == "value":
                new_state[key] = mine[key] if is_root else rest[0]
                continue
            shape, dtype, device_type = rest
            t = mine.get(key)
            if not (
                isinstance(t, torch.Tensor)
                and t.layout == torch.strided
                and tuple(t.shape) == shape
                and t.dtype == dtype
            ):
                device = p.device if p.device.type == device_type else torch.device(device_type)
                t = torch.empty(shape, dtype=dtype, device=device)
            new_state[key] = t
            target = t.detach()
            if not target.is_contiguous():
                staged = target.contiguous()
                copies.append((target, staged))
                target = staged
            handles.append(
                cring.broadcast_async_(
                    target,
                    root_rank,
                    name=f"broadcast_optimizer_state.{i}.{key}",
                    process_set=process_set,
                )
            )
        if not is_root:
            optimizer.state[p] = new_state
    _synchronize_all(handles)
    for t, staged in copies:
        if not is_root:
            t.copy_(staged)

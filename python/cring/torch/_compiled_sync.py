"""DistributedOptimizer.synchronize() and zero_grad() while torch.compile traces
them (a training step compiled with compiled autograd): every trainable
gradient reduced by the operator cring::grouped_allreduce, one per dtype, and
the gradients dropped without leaving the graph.
The gradient hooks do nothing while traced (no lock, no handles); this module
reads the optimizer's settings and never touches its eager bookkeeping.
"""

from __future__ import annotations

from typing import Any

import torch

from .mpi_ops import _compiled

__all__ = ["synchronize", "traceable", "zero_grad"]


def traceable(opt: Any) -> bool:
    """Whether synchronize() may take the operator route: nothing started by an
    eager backward is in flight, and the gradients are reduced as plain dense
    tensors (no Horovod-style compressor, no sharding, no Adasum, no
    communication hook: a hook runs eagerly, docs/hooks.md)."""
    return (
        opt._cring_hook_runner is None
        and not opt._cring_handles
        and not opt._cring_touched
        and opt._cring_torch_compression is None
        and not getattr(opt, "_zero_stage", 0)
    )


def synchronize(opt: Any) -> None:
    """Average (or reduce with opt.op and its scale factors) every trainable
    parameter's gradient over opt.process_set, in place, as synchronize()
    does: a trainable parameter without a gradient gets zeros, a frozen one
    is left alone."""
    if len(opt.process_set.ranks) == 1 or opt._cring_outside:
        opt._cring_synchronized = True
        return
    by_dtype: dict = {}
    # the units' parameters, and those frozen when they joined (trainable again
    # if unfrozen since: the eager path adopts them, this one reduces them too)
    every = [p for unit in opt._cring_units for p in unit.params] + opt._cring_waiting
    for p in every:
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        by_dtype.setdefault(p.grad.dtype, []).append(p)
    for dtype, params in by_dtype.items():
        reduced = _compiled.grouped_allreduce(
            [p.grad for p in params],
            f"compiled.gradients.{str(dtype)[6:]}",
            opt.op,
            opt._cring_prescale,
            opt._cring_postscale,
            opt._cring_engine_compression,
            opt.process_set,
        )
        for p, r in zip(params, reduced):
            p.grad.copy_(r)
    opt._cring_synchronized = True


def zero_grad(opt: Any) -> None:
    """zero_grad(set_to_none=True) while traced: every gradient set to None,
    as torch's Optimizer.zero_grad does (which Dynamo does not trace, so a
    compiled step would break the graph there)."""
    for group in opt.param_groups:
        for p in group["params"]:
            p.grad = None

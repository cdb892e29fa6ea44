"""Which parameters DistributedOptimizer reduces when the trainable set changes
after it was built: a parameter frozen then (requires_grad=False) and
trainable now is reduced from the next step on, like one added by
add_param_group. (Parameters frozen after it was built are skipped where the
optimizer submits.) Holds no state of its own and never communicates.
"""

from __future__ import annotations

from typing import Any, Callable

from . import sharded

__all__ = ["adopt_unfrozen"]


def adopt_unfrozen(opt: Any, make_unit: Callable[[str, tuple], Any]) -> list:
    """Give every parameter of `opt` that requires grad now and has no
    reduction yet one of its own (make_unit(name, (p,)), named as its
    allreduce would have been) and its gradient hook; returns those
    parameters. The caller holds the optimizer's lock. Every rank must
    unfreeze the same parameters in the same step (their allreduces are
    collective). A sharded optimizer (shard_state) plans its slices once and
    is left as it is. With a communication hook the hook's buckets stay the
    ones planned at build time; a parameter unfrozen later is averaged by a
    plain allreduce of its own (docs/hooks.md)."""
    if isinstance(opt, sharded.ShardedMixin):
        return []
    new: list = []
    for i, group in enumerate(opt.param_groups):
        for j, p in enumerate(group["params"]):
            if p.requires_grad and p not in opt._cring_unit_of:
                new.append(p)
                name = opt._cring_names.setdefault(p, f"noname.{i}.{j}")
                unit = make_unit(f"allreduce.{name}", (p,))
                opt._cring_units.append(unit)
                opt._cring_unit_of[p] = unit
                opt._cring_delay[p] = opt.backward_passes_per_step
    if new:
        opt._cring_register_hooks(new)
    return new

"""Which parameters DistributedOptimizer reduces when the trainable set changes
after it was built: a parameter frozen then (requires_grad=False) and
trainable now is reduced from the next step on; the parameters of a group
added by add_param_group join the same way. (Parameters frozen after it was
built are skipped where the optimizer submits.) Holds no state of its own
and never communicates.
"""

from __future__ import annotations

from typing import Any, Callable

from . import sharded

__all__ = ["adopt_unfrozen", "waiting"]


def waiting(params: list, unit_of: dict) -> list:
    """The parameters among `params` without a reduction (frozen when they
    joined the optimizer): the only ones adopt_unfrozen looks at, so that a
    step with nothing frozen pays nothing."""
    return [p for p in params if p not in unit_of]


def adopt_unfrozen(opt: Any, make_unit: Callable[[str, tuple], Any]) -> list:
    """Give every parameter of `opt._cring_waiting` that requires grad now
    one reduction of its own (make_unit(name, (p,)), named as its allreduce
    would have been: every parameter is named when it joins the optimizer)
    and its gradient hook; returns those parameters. The caller holds the
    optimizer's lock. Every rank must unfreeze the same parameters in the
    same step (their allreduces are collective). A sharded optimizer
    (shard_state) plans its slices once and is left as it is. With a
    communication hook the hook's buckets stay the ones planned at build
    time; a parameter unfrozen later is averaged by a plain allreduce of its
    own (docs/hooks.md)."""
    if not opt._cring_waiting or isinstance(opt, sharded.ShardedMixin):
        return []
    new: list = []
    for p in opt._cring_waiting:
        if p.requires_grad and p not in opt._cring_unit_of:
            unit = make_unit(f"allreduce.{opt._cring_names[p]}", (p,))
            opt._cring_units.append(unit)
            opt._cring_unit_of[p] = unit
            opt._cring_delay[p] = opt.backward_passes_per_step
            new.append(p)
    if new:
        opt._cring_waiting = waiting(opt._cring_waiting, opt._cring_unit_of)
        opt._cring_register_hooks(new)
    return new

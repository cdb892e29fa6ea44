"""DistributedOptimizer(op=cring.Adasum): Horovod's delta optimizer for Adasum.
Each rank takes the wrapped optimizer's step locally; what is reduced is the
step each parameter took (delta = new - old), with op=Adasum; every rank then
sets the parameter to old + adasum(deltas). Uses cring.torch's collectives
only; the Average/Sum optimizer is optimizer.py's.

Horovod submits each parameter's delta from a gradient hook (stepping the
optimizer on that parameter alone); this class takes one step over all
parameters in step() and then submits every delta at once. For element-wise
optimizers (SGD, Adam, AdamW, ...) the result is the same; the difference is
that the reduction does not overlap backward.
"""

from __future__ import annotations

from collections.abc import Iterable
from contextlib import contextmanager
from typing import Any, Optional

import torch

import cring

from .sharded_layout import adopt_instance_state

_CLASSES: dict = {}


class _AdasumOptimizer:
    """Mixed in before the wrapped optimizer's class (see make_adasum_optimizer)."""

    _cring_base: type

    def _cring_adasum_setup(
        self, named_parameters: Optional[Iterable], compression: Any, passes: int
    ) -> None:
        params = [p for group in self.param_groups for p in group["params"]]
        if named_parameters is not None:
            named = list(named_parameters)
            if any(not isinstance(pair, tuple) or len(pair) != 2 for pair in named):
                raise ValueError(
                    "named_parameters should be a sequence of tuples (name, parameter), "
                    "usually produced by model.named_parameters()."
                )
            names = [n for n, _ in named]
            dups = sorted({n for n in names if names.count(n) > 1})
            if dups:
                raise ValueError(
                    "Parameter names in named_parameters must be unique. Found duplicates: "
                    + ", ".join(dups)
                )
            by_id = {id(p): n for n, p in named}
            missing = [p for p in params if id(p) not in by_id]
            if missing:
                raise ValueError(
                    "named_parameters was specified, but one or more model parameters were "
                    "not named"
                )
            self._parameter_names = {p: by_id[id(p)] for p in params}
        else:
            self._parameter_names = {
                p: f"noname.{g}.{i}"
                for g, group in enumerate(self.param_groups)
                for i, p in enumerate(group["params"])
            }
        # cring's own compressors travel on the wire (float32 only); Horovod-style
        # objects compress and decompress in Python around the reduction
        if compression is None or isinstance(compression, cring.Compressor):
            self._cring_wire, self._cring_python = compression, None
        else:
            self._cring_wire, self._cring_python = None, compression
        self.backward_passes_per_step = passes

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = passes

    def synchronize(self) -> None:
        """Nothing to wait for: the reduction happens inside step()."""

    @contextmanager
    def skip_synchronize(self) -> Any:
        raise AssertionError(
            "Skipping synchronization is not supported when using Adasum optimizer."
        )
        yield  # pragma: no cover

    def step(self, closure: Any = None) -> Any:
        params = [p for group in self.param_groups for p in group["params"] if p.requires_grad]
        with torch.no_grad():
            start = [p.detach().clone() for p in params]
        loss = self._cring_base.step(self, closure)
        handles = []
        with torch.no_grad():
            for p, old in zip(params, start):
                delta, ctx = p.detach().sub(old).contiguous(), None
                if self._cring_python is not None:
                    delta, ctx = self._cring_python.compress(delta)
                name = f"adasum.{self._parameter_names.get(p, id(p))}"
                handle = cring.allreduce_async_(
                    delta, op=cring.Adasum, name=name, compression=self._cring_wire
                )
                handles.append((p, old, delta, handle, ctx))
            for p, old, delta, handle, ctx in handles:
                cring.synchronize(handle)
                if self._cring_python is not None:
                    delta = self._cring_python.decompress(delta, ctx)
                p.copy_(old.add_(delta.to(old.dtype)))
        return loss


def make_adasum_optimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: Optional[Iterable],
    compression: Any,
    backward_passes_per_step: int,
) -> torch.optim.Optimizer:
    """A subclass instance of optimizer's class sharing its state, whose
    step() reduces each parameter's update with Adasum (module docstring)."""
    size = cring.size()
    if size & (size - 1):
        raise ValueError(
            f"op=cring.Adasum needs a power-of-two number of ranks; this job has {size}"
        )
    base = type(optimizer)
    cls = _CLASSES.get(base)
    if cls is None:
        cls = type(
            base.__name__,
            (_AdasumOptimizer, base),
            {"__module__": __name__, "__qualname__": base.__qualname__, "_cring_base": base},
        )
        _CLASSES[base] = cls
    wrapped = cls.__new__(cls)
    wrapped.__dict__.update(adopt_instance_state(wrapped, optimizer))
    wrapped._cring_adasum_setup(named_parameters, compression, int(backward_passes_per_step))
    return wrapped

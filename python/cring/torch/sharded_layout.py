"""The layout of sharded optimizer state (cring.torch.sharded): which
optimizers can be sharded, each rank's slice of a parameter, the buckets the
gradients and updated slices travel in. Index math and torch views only: no
communication, no optimizer state.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Optional

import numpy as np
import torch

__all__ = [
    "BUCKET_BYTES",
    "DIRECT_BYTES",
    "ELEMENTWISE",
    "SCALAR_KEYS",
    "Bucket",
    "Shard",
    "adopt_instance_state",
    "check_arguments",
    "check_elementwise",
    "flat_grad",
    "flat_view",
    "in_layout",
    "make_buckets",
    "nbytes",
    "split",
]

# torch.optim classes whose step treats every element on its own (state shaped like the
# parameter, plus per-parameter scalars such as the step count): they can step a slice
ELEMENTWISE = tuple(
    getattr(torch.optim, name)
    for name in (
        "SGD",
        "Adam",
        "AdamW",
        "Adamax",
        "Adagrad",
        "Adadelta",
        "RMSprop",
        "Rprop",
        "ASGD",
        "NAdam",
        "RAdam",
    )
    if hasattr(torch.optim, name)
)
# per-parameter scalar state of those classes: never sliced, even for a 0-d parameter
SCALAR_KEYS = frozenset({"step", "eta", "mu", "mu_product"})
# a parameter of at least this many bytes travels alone (its own reducescatter and allgather,
# straight from its memory); smaller ones are packed into buckets of up to BUCKET_BYTES
DIRECT_BYTES = 1 << 20
BUCKET_BYTES = 4 << 20


def check_elementwise(optimizer: torch.optim.Optimizer) -> None:
    """Raise ValueError unless `optimizer`'s step is known to be element-wise."""
    if getattr(optimizer, "cring_elementwise", False) or isinstance(optimizer, ELEMENTWISE):
        return
    name = type(optimizer).__name__
    known = ", ".join(c.__name__ for c in ELEMENTWISE)
    why = {
        "LBFGS": "its step re-evaluates the closure on the full parameters and works on "
        "whole vectors (line search, curvature pairs)",
        "SparseAdam": "it needs sparse gradients, which are not sharded",
        "Adafactor": "it factors its second moment over rows and columns",
        "Muon": "it orthogonalises whole matrices",
    }.get(name, f"it is not one of {known}")
    raise ValueError(
        f"shard_state needs an optimizer whose step is element-wise (each element updated "
        f"from its own gradient and state alone), and {name} is not known to be: {why}. Use "
        f"shard_state=0 with it; if its step really is element-wise, set "
        f"`cring_elementwise = True` on the optimizer or its class"
    )


def check_arguments(optimizer: torch.optim.Optimizer, shard_state: Any, groups: Any) -> int:
    """shard_state as an int, after checking it fits the other arguments."""
    if isinstance(shard_state, bool) or shard_state not in (0, 1, 2):
        raise ValueError(
            f"shard_state must be 0 (no sharding), 1 (optimizer state) or 2 "
            f"(optimizer state and gradients), got {shard_state!r}"
        )
    stage = int(shard_state)
    if stage:
        check_elementwise(optimizer)
    if stage == 2 and groups is not None and not (isinstance(groups, int) and groups == 0):
        raise ValueError(
            "groups= sets the allreduces of shard_state 0 and 1; with shard_state=2 "
            "gradients are reduce-scattered in buckets by size (docs/sharded.md)"
        )
    return stage


def adopt_instance_state(wrapped: Any, original: Any) -> dict:
    """What `wrapped` takes from `original`'s __dict__: all of it but an LR
    scheduler's patch of original.step (a bound call of the wrapped class's
    step on the original, which would bypass the wrapper). The wrapper then
    gets the same patch of its own: both count as stepped for the scheduler."""
    state = dict(original.__dict__)
    patched = state.get("step")
    if patched is None or not getattr(patched, "_wrapped_by_lr_sched", False):
        return state
    del state["step"]
    me, other = weakref.ref(wrapped), weakref.ref(original)

    @functools.wraps(type(wrapped).step)
    def step(*args: Any, **kwargs: Any) -> Any:
        for opt in (me(), other()):
            if opt is not None:
                opt._opt_called = True
        return type(me()).step(me(), *args, **kwargs)

    step._wrapped_by_lr_sched = True  # type: ignore[attr-defined]
    state["step"] = step
    return state


def split(n: int, size: int, rank: int) -> tuple:
    """[lo, hi) of `rank`'s slice of n elements: n // size each, one more
    for the first n % size ranks (cring's reducescatter split)."""
    d, m = divmod(n, size)
    lo = rank * d + min(rank, m)
    return lo, lo + d + (1 if rank < m else 0)


def flat_view(t: torch.Tensor) -> Optional[torch.Tensor]:
    """A 1-D view of `t`'s elements in memory order (no copy), or None when
    its elements are not one dense block (overlapping or with gaps)."""
    if t.is_contiguous():
        return t.view(-1)
    expected = 1
    for d in sorted((d for d in range(t.dim()) if t.size(d) != 1), key=t.stride):
        if t.stride(d) != expected:
            return None
        expected *= t.size(d)
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


def in_layout(value: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`value` (shaped like `like`) laid out in memory as `like` is, so that
    flat views of the two match element for element (a copy only if needed)."""
    if value.stride() == like.stride() and flat_view(value) is not None:
        return value
    out = torch.empty_like(like, dtype=value.dtype, device=value.device)
    out.copy_(value)
    return out


def flat_grad(
    grad: torch.Tensor, param: torch.Tensor, sparse_as_dense: bool, name: str
) -> torch.Tensor:
    if grad.is_sparse:
        if not sparse_as_dense:
            raise NotImplementedError(
                f"parameter '{name}' has a sparse gradient: cring has no sparse reducescatter; "
                "pass sparse_as_dense=True to DistributedOptimizer"
            )
        grad = grad.to_dense()
    flat = flat_view(in_layout(grad, param))
    assert flat is not None
    return flat


class Shard:
    """One parameter and this rank's slice of it: `view` is that slice of the
    parameter's own memory, the tensor the wrapped optimizer steps."""

    __slots__ = ("param", "lo", "hi", "view", "ptr", "stride", "name")

    def __init__(self, param: torch.Tensor, name: str, size: int, rank: int) -> None:
        self.param, self.name = param, name
        self.lo, self.hi = split(param.numel(), size, rank)
        self.view = self.ptr = self.stride = None
        self.attach()

    def attach(self) -> None:
        flat = flat_view(self.param.detach())
        if flat is None:
            raise ValueError(
                f"parameter '{self.name}' {tuple(self.param.shape)} is not one dense "
                "block of memory (strides "
                f"{self.param.stride()}); shard_state needs dense parameters"
            )
        self.view = flat[self.lo : self.hi]
        self.ptr, self.stride = self.param.data_ptr(), self.param.stride()

    def moved(self) -> bool:
        """Whether the parameter got new memory since the view was taken."""
        return self.param.data_ptr() != self.ptr or self.param.stride() != self.stride


class Bucket:
    """One reducescatter (stage 2) and one allgather. `direct`: one large
    parameter, sent straight from its memory. Otherwise small parameters
    packed as a (size, width) matrix whose row q holds rank q's slices of
    each parameter one after another (zero padding at the end). Has the
    attributes of the allreduce path's units (name, params, ready)."""

    __slots__ = (
        "name",
        "params",
        "ready",
        "direct",
        "starts",
        "offsets",
        "width",
        "total",
        "_pack",
        "_unpack",
        "_index",
    )

    def __init__(self, name: str, params: tuple, size: int) -> None:
        self.name, self.params, self.ready = name, params, 0
        self.direct = len(params) == 1 and nbytes(params[0]) >= DIRECT_BYTES
        counts = [p.numel() for p in params]
        self.starts = list(np.cumsum([0] + counts[:-1]))  # each parameter in the concatenation
        self.total = int(sum(counts))
        # offsets[j][q]: where rank q's slice of parameter j sits in row q
        self.offsets, row = [], [0] * size
        for n in counts:
            self.offsets.append(list(row))
            for q in range(size):
                lo, hi = split(n, size, q)
                row[q] += hi - lo
        self.width = row[0]  # rank 0's row is the longest
        self._pack = self._unpack = None
        self._index: dict = {}  # (kind, device) -> index tensor on that device

    def index(self, kind: str, device: torch.device) -> torch.Tensor:
        """The gather index that packs the concatenated gradients (plus one
        zero at the end) into the matrix ('pack'), or the gathered matrix back
        into the concatenated parameters ('unpack')."""
        key = (kind, device)
        found = self._index.get(key)
        if found is not None:
            return found
        if self._pack is None:
            size = len(self.offsets[0]) if self.offsets else 1
            pack = np.full(size * self.width, self.total, np.int64)
            unpack = np.empty(self.total, np.int64)
            for j, p in enumerate(self.params):
                n, start = p.numel(), int(self.starts[j])
                for q in range(size):
                    lo, hi = split(n, size, q)
                    at = q * self.width + self.offsets[j][q]
                    pack[at : at + hi - lo] = np.arange(start + lo, start + hi)
                    unpack[start + lo : start + hi] = np.arange(at, at + hi - lo)
            self._pack, self._unpack = torch.from_numpy(pack), torch.from_numpy(unpack)
        found = self._index[key] = (self._pack if kind == "pack" else self._unpack).to(device)
        return found


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def make_buckets(trainable: list, names: dict, size: int) -> list:
    """Buckets in the order gradients usually arrive (the parameters'
    reverse order), one dtype and device each; empty parameters need none."""
    buckets: list = []
    open_: dict = {}  # (dtype, device) -> [params, bytes]
    for p in reversed(trainable):
        if p.numel() == 0:
            continue
        if nbytes(p) >= DIRECT_BYTES:
            buckets.append(Bucket(names[p], (p,), size))
            continue
        key = (p.dtype, p.device)
        current = open_.get(key)
        if current is not None and current[1] + nbytes(p) > BUCKET_BYTES:
            buckets.append(Bucket(names[current[0][0]], tuple(current[0]), size))
            current = None
        if current is None:
            current = open_[key] = [[], 0]
        current[0].append(p)
        current[1] += nbytes(p)
    for params, _ in open_.values():
        buckets.append(Bucket(names[params[0]], tuple(params), size))
    return buckets

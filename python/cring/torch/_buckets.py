"""Gradient buckets in shared memory for DistributedOptimizer
(gradient_as_bucket_view=True; docs/performance.md, "Zero-copy gradient
buckets"): gradients become views into buckets inside a region every rank on
the host has mapped (cring._C.shared_region), and each bucket's allreduce
reads the peers' buckets in place and writes the result in place. Only the
layout and attaching the views live here; the optimizer submits.
"""

from __future__ import annotations

import ctypes
import os
from typing import Any, Optional

import torch

import cring
from cring import _C

__all__ = ["BucketLayout", "BucketUnit", "build", "plan_units", "requested", "submit"]

_ALIGN_BYTES = 64  # every view starts on a cache line
_PAGE = 4096  # every bucket on a page
DEFAULT_BUCKET_BYTES = 25 << 20  # DDP's default bucket_cap_mb


def requested(flag: Optional[bool]) -> bool:
    """The argument, or CRING_BUCKET_VIEW (1/true/yes) when it is None."""
    if flag is not None:
        return bool(flag)
    return os.environ.get("CRING_BUCKET_VIEW", "0").strip().lower() in ("1", "true", "yes", "on")


def _round_up(n: int, k: int) -> int:
    return (n + k - 1) // k * k


class Bucket:
    """One bucket: `flat` (one dtype, in the region) and each parameter's view."""

    __slots__ = ("flat", "views")

    def __init__(self, flat: torch.Tensor, views: dict) -> None:
        self.flat, self.views = flat, views


class BucketUnit:
    """What the optimizer reduces for one bucket (read like its _Unit):
    one allreduce of `flat`, in place, under `name`."""

    __slots__ = ("name", "params", "ready", "flat")

    def __init__(self, name: str, params: tuple, flat: torch.Tensor) -> None:
        self.name, self.params, self.ready, self.flat = name, params, 0, flat


class BucketLayout:
    """The buckets of one optimizer: parameter -> its bucket and view."""

    def __init__(self, buckets: list) -> None:
        self.buckets = buckets
        self.view_of = {p: v for b in buckets for p, v in b.views.items()}

    def attach(self, p: torch.Tensor) -> None:
        """Make p.grad its view, carrying over the gradient it holds (a
        fresh one after zero_grad(set_to_none=True), or zeros)."""
        grad_into_view(p, self.view_of[p])


def copy_grad(view: torch.Tensor, grad: Optional[torch.Tensor]) -> None:
    """`view` (a slice of a bucket) takes what `grad` holds: zeros for no
    gradient, a sparse one densified. Also the comm hook's buckets'
    (_comm_hook.py)."""
    if grad is None:
        view.zero_()
    elif grad.is_sparse:
        view.copy_(grad.to_dense())
    elif grad.data_ptr() != view.data_ptr():
        view.copy_(grad)


def grad_into_view(p: torch.Tensor, view: torch.Tensor) -> None:
    """p.grad becomes `view`, holding what p.grad held (copy_grad)."""
    if p.grad is not view:
        copy_grad(view, p.grad)
        p.grad = view


def build(params: list, bucket_bytes: int = 0) -> Optional[BucketLayout]:
    """Buckets for the dense CPU parameters `params` (in backward order,
    DDP's way: the last parameters first), each at most bucket_bytes
    (CRING_BUCKET_BYTES, default 25 MiB) unless one parameter is larger.
    Collective: every rank must call it with the same parameters' shapes and
    dtypes. None where the transport has no shared regions (TCP,
    hierarchical, one rank): the optimizer then keeps its usual path."""
    if not bucket_bytes:
        bucket_bytes = int(os.environ.get("CRING_BUCKET_BYTES", DEFAULT_BUCKET_BYTES))
    if cring.size() == 1 or cring.transport() != "shm" or not params:
        return None
    plan: list = []  # [dtype, [(param, offset_bytes)], bytes]
    for p in reversed(params):
        nbytes = _round_up(p.numel() * p.element_size(), _ALIGN_BYTES)
        if plan and plan[-1][0] == p.dtype and plan[-1][2] + nbytes <= bucket_bytes:
            b = plan[-1]
        else:
            b = [p.dtype, [], 0]
            plan.append(b)
        b[1].append((p, b[2]))
        b[2] += nbytes
    total, starts = 0, []
    for b in plan:
        starts.append(total)
        total += _round_up(b[2], _PAGE)
    address = _C.shared_region(total)
    if address is None:
        return None
    raw = (ctypes.c_uint8 * total).from_address(address)
    region = torch.frombuffer(raw, dtype=torch.uint8)  # holds `raw`; the mapping is never undone
    buckets = []
    for (dtype, members, nbytes), start in zip(plan, starts):
        esize = torch.empty((), dtype=dtype).element_size()
        flat = region[start : start + nbytes].view(dtype)
        views: dict = {}
        for p, off in members:
            lo = off // esize
            views[p] = flat[lo : lo + p.numel()].view(p.shape)
        buckets.append(Bucket(flat, views))
    return BucketLayout(buckets)


def eligible(params: list, **conditions: Any) -> bool:
    """Whether every parameter is a dense CPU tensor and every condition holds."""
    return all(conditions.values()) and all(
        p.device.type == "cpu" and p.layout == torch.strided for p in params
    )


def plan_units(opt: Any, trainable: list, groups: Any, compression: Any, process_set: Any) -> tuple:
    """(layout, units) for a DistributedOptimizer with gradient_as_bucket_view,
    or (None, None) where its settings or the transport keep the usual path."""
    ok = eligible(
        trainable,
        plain_units=groups is None,
        op=opt.op in (cring.Average, cring.Sum),
        uncompressed=compression is None or compression is cring.Compression.none,
        global_set=process_set in (None, cring.global_process_set),
        unscaled=opt._cring_prescale == 1.0,
    )
    layout = build(trainable) if ok else None
    if layout is None:
        return None, None
    names = opt._cring_names
    units = [
        BucketUnit(f"allreduce.bucket.{names[next(iter(b.views))]}", tuple(b.views), b.flat)
        for b in layout.buckets
    ]
    return layout, units


def submit(opt: Any, unit: BucketUnit) -> Any:
    """Start the in-place allreduce of one bucket (every view attached first:
    a parameter no hook saw contributes zeros, as on the usual path; one
    frozen since the optimizer was built keeps its .grad, its slot unread)."""
    for p in unit.params:
        if p.requires_grad:
            opt._cring_buckets.attach(p)
    return cring.allreduce_async_(
        unit.flat,
        name=unit.name,
        op=opt.op,
        postscale_factor=opt._cring_postscale,
        process_set=opt.process_set,
    )

"""Sharded optimizer state (ZeRO stages 1 and 2) behind
cring.torch.DistributedOptimizer(shard_state=1 | 2).

Each rank owns a contiguous slice of every parameter (flattened in memory
order, split as cring's reducescatter splits: n // P elements, one more on
the first n % P ranks), keeps the wrapped optimizer's state for its slices
only and steps only them; the updated slices are allgathered. Stage 1 takes
its slices of the allreduced gradients; stage 2 reduce-scatters the
gradients from the gradient hooks, so a rank keeps only its slice of them.
Design and the reasons: docs/sharded.md. Uses cring's public collectives and
torch only; must not import cring.torch.optimizer (which imports this).
"""

from __future__ import annotations

import pickle
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Optional

import numpy as np
import torch

import cring

from . import sharded_layout as _layout

__all__ = ["ELEMENTWISE", "ShardedMixin", "adopt_instance_state", "check_arguments"]

# what DistributedOptimizer and the tests use from the layout
ELEMENTWISE = _layout.ELEMENTWISE
check_arguments = _layout.check_arguments
adopt_instance_state = _layout.adopt_instance_state


def _share_from_rank0(obj: Any, name: str) -> Any:
    """Rank 0's picklable `obj` on every rank."""
    if cring.rank() == 0:
        payload = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
        length = np.array([payload.size], np.int64)
    else:
        length = np.zeros(1, np.int64)
    cring.broadcast_(length, 0, name=f"{name}.bytes")
    if cring.rank() != 0:
        payload = np.empty(int(length[0]), np.uint8)
    cring.broadcast_(payload, 0, name=f"{name}.data")
    return obj if cring.rank() == 0 else pickle.loads(payload.tobytes())


class _Pending:
    """A bucket's reducescatter in flight, with what must stay alive until it ends."""

    __slots__ = ("bucket", "keep", "ctx", "done")

    def __init__(self, bucket: _layout.Bucket, keep: Any, ctx: Any) -> None:
        self.bucket, self.keep, self.ctx, self.done = bucket, keep, ctx, False


_CONSOLIDATED_ELSEWHERE = (
    "consolidate_state_dict(to={to}) gathered the optimizer state on rank {to} only: call "
    "state_dict() there (as with torch's ZeroRedundancyOptimizer), or call state_dict() on every "
    "rank without consolidate_state_dict() to get it everywhere"
)


class ShardedMixin:
    """Placed before the allreduce path's mixin in the wrapped optimizer's
    class (see DistributedOptimizer); `_cring_base` is the wrapped class."""

    _cring_base: type

    # ---- construction ------------------------------------------------------------------------

    def _zero_begin(self, stage: int) -> None:
        """Before the allreduce path's setup (which asks for the units)."""
        if not cring.is_initialized():
            raise RuntimeError(
                "shard_state needs cring.init() (or hvd.init()) before "
                "DistributedOptimizer: the shards depend on rank and size"
            )
        self._zero_stage = stage
        self._zero_size, self._zero_rank = cring.size(), cring.rank()

    def _cring_make_units(self, trainable: list, names: dict, groups: Any) -> list:
        if self._zero_stage == 2:  # the buckets are the units: the hooks reduce-scatter them
            return _layout.make_buckets(trainable, names, self._zero_size)
        return super()._cring_make_units(trainable, names, groups)  # type: ignore[misc]

    def _zero_setup(self) -> None:
        """After the allreduce path's setup: the slices and the allgather buckets."""
        names = self._cring_names
        self._zero_shards: dict = {}  # parameter -> _layout.Shard
        for group in self.param_groups:
            for p in group["params"]:
                if p not in self._zero_shards:
                    self._zero_shards[p] = _layout.Shard(
                        p, names[p], self._zero_size, self._zero_rank
                    )
        self._zero_group_views = [
            [self._zero_shards[p].view for p in group["params"]] for group in self.param_groups
        ]
        if self._zero_stage == 2:
            self._zero_buckets = list(self._cring_units)
        else:
            trainable = [p for p in self._zero_shards if p.requires_grad]
            self._zero_buckets = _layout.make_buckets(trainable, names, self._zero_size)
        self._zero_grads: dict = {}  # parameter -> this rank's slice of its reduced gradient
        self._zero_consolidated: Optional[tuple] = None  # (to, state dict or None)
        if any(p in self.state for p in self._zero_shards):
            # state from before the wrapping (keyed by whole parameters): keep our slices
            unsharded = self._cring_base.state_dict(self)
            self.state = defaultdict(dict)
            self.load_state_dict(unsharded)

    # ---- stage 2: the hooks reduce-scatter ---------------------------------------------------

    def _cring_submit(self, unit: Any) -> None:
        if not isinstance(unit, _layout.Bucket):
            return super()._cring_submit(unit)  # type: ignore[misc]
        size = self._zero_size
        kwargs = dict(
            op=self.op, prescale_factor=self._cring_prescale, postscale_factor=self._cring_postscale
        )
        name = f"zero.reducescatter.{unit.name}"
        grads = []
        for p in unit.params:
            g = p.grad
            if g is None:
                g = torch.zeros_like(p.detach())
            grads.append(_layout.flat_grad(g, p, self.sparse_as_dense, self._cring_names[p]))
        if unit.direct:
            send = grads[0]  # p.grad (or its dense copy): kept until the reducescatter ends
        else:
            g0 = grads[0]
            concatenated = torch.cat(grads + [g0.new_zeros(1)])
            send = concatenated[unit.index("pack", g0.device)].view(size, unit.width)
            for p in unit.params:  # the matrix holds them now: the full gradients can go
                p.grad = None
        compressor, ctx = self._cring_torch_compression, None
        if compressor is not None:  # a Horovod-style compressor, around the reducescatter
            send, ctx = compressor.compress(send)
            send = send.contiguous()
        else:  # cring.Compression.fp16 / bf16: float32 travels cast
            wire = getattr(self._cring_engine_compression, "wire_dtype", None)
            if wire is not None and send.dtype == torch.float32:
                send, ctx = send.to(getattr(torch, wire)), send.dtype
        handle = cring.reducescatter_async(send, name=name, **kwargs)
        self._cring_handles[unit] = [(handle, _Pending(unit, send, ctx))]
        # land the buckets that are done already: their full gradients (or packed copies)
        # go now rather than at synchronize(), which bounds what backward holds at once
        for submitted in self._cring_handles.values():
            for earlier, pending in submitted:
                if isinstance(pending, _Pending) and not pending.done and cring.poll(earlier):
                    try:
                        self._cring_finish(earlier, pending)
                    except BaseException:  # synchronize() raises it
                        pass

    def _cring_finish(self, handle: Any, entries: Any) -> None:
        if not isinstance(entries, _Pending):
            return super()._cring_finish(handle, entries)  # type: ignore[misc]
        if entries.done:
            return
        out = cring.synchronize(handle)
        entries.done, entries.keep = True, None
        if self._cring_torch_compression is not None:
            out = self._cring_torch_compression.decompress(out, entries.ctx)
        elif entries.ctx is not None:
            out = out.to(entries.ctx)
        bucket, rank = entries.bucket, self._zero_rank
        if bucket.direct:
            self._zero_grads[bucket.params[0]] = out
            bucket.params[0].grad = None
            return
        row = out.view(-1)
        for j, p in enumerate(bucket.params):
            lo, hi = _layout.split(p.numel(), self._zero_size, rank)
            at = bucket.offsets[j][rank]
            self._zero_grads[p] = row[at : at + hi - lo]

    # ---- the step ------------------------------------------------------------------------------

    @contextmanager
    def _zero_swapped(self) -> Iterator[None]:
        """Within: each param group lists this rank's slices instead of the parameters."""
        saved = [group["params"] for group in self.param_groups]
        for group, views in zip(self.param_groups, self._zero_group_views):
            group["params"] = views
        try:
            yield
        finally:  # (load_state_dict makes new group dicts: restore by position)
            for group, params in zip(self.param_groups, saved):
                group["params"] = params

    def _zero_refresh(self) -> None:
        """Follow parameters that got new memory (model.to(), p.data = ...):
        new slices, with their state moved over."""
        moved = False
        for shard in self._zero_shards.values():
            if shard.moved():
                old, moved = shard.view, True
                shard.attach()
                if old in self.state:
                    self.state[shard.view] = self.state.pop(old)
        if moved:
            self._zero_group_views = [
                [self._zero_shards[p].view for p in group["params"]] for group in self.param_groups
            ]

    def _zero_check_world(self) -> None:
        if cring.size() != self._zero_size or cring.rank() != self._zero_rank:
            raise RuntimeError(
                f"the optimizer state is sharded over {self._zero_size} ranks (this was rank "
                f"{self._zero_rank}), but cring now has {cring.size()} (rank {cring.rank()}): "
                "save state_dict() before the change and load it into a new DistributedOptimizer"
            )

    def _cring_wrapped_step(self, closure: Any) -> Any:
        """The wrapped optimizer's step on this rank's slices, then the allgather."""
        self._zero_check_world()
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._zero_consolidated = None
        self._zero_refresh()
        full = self._zero_stage == 1 or self._zero_size == 1
        shards = list(self._zero_shards.values())
        for shard in shards:
            if full:
                g = shard.param.grad
                shard.view.grad = (
                    None
                    if g is None
                    else _layout.flat_grad(g, shard.param, True, shard.name)[shard.lo : shard.hi]
                )
            else:
                g = self._zero_grads.get(shard.param)
                if g is None and shard.param.requires_grad and shard.param.numel() == 0:
                    g = shard.view.new_zeros(0)  # in no bucket, but stepped as unsharded
                shard.view.grad = g
        try:
            with self._zero_swapped():
                self._cring_base.step(self)
        finally:
            for shard in shards:
                shard.view.grad = None
        if self._zero_size > 1:
            self._zero_allgather()
        return loss

    def _zero_allgather(self) -> None:
        """Every rank's updated slices into every rank's parameters. A large
        parameter: one in-place broadcast per rank's slice, from its owner
        straight into every rank's parameter (no result to allocate and copy
        out). Packed small ones: an allgather of this rank's row, unpacked.
        Everything is started before anything is waited for."""
        size = self._zero_size
        started: list = []  # (packed bucket or None, handle)
        error: Optional[BaseException] = None
        with torch.no_grad():
            for bucket in self._zero_buckets:
                try:
                    if bucket.direct:
                        flat = _layout.flat_view(bucket.params[0].detach())
                        for q in range(size):
                            lo, hi = _layout.split(flat.numel(), size, q)
                            name = f"zero.allgather.{bucket.name}.{q}"
                            started.append(
                                (None, cring.broadcast_async_(flat[lo:hi], q, name=name))
                            )
                        continue
                    views = [self._zero_shards[p].view for p in bucket.params]
                    pad = bucket.width - sum(v.numel() for v in views)
                    row = torch.cat(views + [views[0].new_zeros(pad)])
                    name = f"zero.allgather.{bucket.name}"
                    started.append((bucket, cring.allgather_async(row, name=name)))
                except BaseException as e:  # still wait for what was started, then raise
                    error = e
                    break
            for bucket, handle in started:
                try:
                    out = cring.synchronize(handle)
                except BaseException as e:
                    error = error or e
                    continue
                if error is not None or bucket is None:
                    continue
                concatenated = out[bucket.index("unpack", out.device)]
                for j, p in enumerate(bucket.params):
                    start = int(bucket.starts[j])
                    _layout.flat_view(p.detach()).copy_(concatenated[start : start + p.numel()])
        if error is not None:
            raise error

    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """torch.nn.utils.clip_grad_norm_ over the reduced gradients of all
        ranks together (stage 2 keeps only slices of them): call it after
        synchronize() and step() in skip_synchronize(). A collective; returns
        the total norm, the same on every rank."""
        norm_type = float(norm_type)
        full = self._zero_stage == 1 or self._zero_size == 1
        grads = []
        for shard in self._zero_shards.values():
            if full:
                g = shard.param.grad
                if g is not None:
                    grads.append(
                        _layout.flat_grad(g, shard.param, True, shard.name)[shard.lo : shard.hi]
                    )
            elif shard.param in self._zero_grads:
                grads.append(self._zero_grads[shard.param])
        norms = [torch.linalg.vector_norm(g.detach(), norm_type).double().cpu() for g in grads]
        inf = norm_type == float("inf")
        if inf:
            local = max((float(n) for n in norms), default=0.0)
        else:
            local = sum(float(n) ** norm_type for n in norms)
        total = torch.tensor([local], dtype=torch.float64)
        if self._zero_size > 1:
            cring.allreduce_(total, op=cring.Max if inf else cring.Sum, name="zero.clip_norm")
        total_norm = total[0] if inf else total[0] ** (1.0 / norm_type)
        coef = min(float(max_norm) / (float(total_norm) + 1e-6), 1.0)
        if coef < 1.0:
            if full:
                for p in self._zero_shards:
                    if p.grad is not None:
                        p.grad.detach().mul_(coef)
            else:
                for g in self._zero_grads.values():
                    g.mul_(coef)
        return total_norm.float()

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)  # type: ignore[misc]
        self._zero_grads.clear()

    def add_param_group(self, param_group: dict) -> None:
        raise NotImplementedError(
            "a sharded DistributedOptimizer cannot take new param groups; "
            "add them to the optimizer before wrapping it"
        )

    # ---- checkpoints -------------------------------------------------------------------------

    def _zero_index(self) -> list:
        """The parameters in state_dict order (torch numbers them by first appearance)."""
        order, seen = [], set()
        for group in self.param_groups:
            for p in group["params"]:
                if id(p) not in seen:
                    seen.add(id(p))
                    order.append(p)
        return order

    def _zero_gather(self, to: Optional[int]) -> Optional[dict]:
        """The unsharded state dict, as the wrapped optimizer would give it:
        on every rank (to=None) or on rank `to` only (None elsewhere; the
        others hold one parameter's gathered state at a time)."""
        self._zero_check_world()
        self._zero_refresh()
        with self._zero_swapped():
            sharded = self._cring_base.state_dict(self)
        params = self._zero_index()
        rank, size = self._zero_rank, self._zero_size
        # rank 0 owns a slice of every non-empty parameter: its state says which entries
        # are slices (gathered) and which are per-parameter values (taken from rank 0)
        meta = None
        if rank == 0:
            meta = {}
            for i, entries in sharded["state"].items():
                shard = self._zero_shards[params[i]]
                meta[i] = {
                    key: ("slice", value.dtype)
                    if _is_slice(value, shard)
                    else ("value", value.cpu() if isinstance(value, torch.Tensor) else value)
                    for key, value in entries.items()
                }
        meta = _share_from_rank0(meta, "zero.state.meta") if size > 1 else meta
        keep = to is None or rank == to
        state: dict = {}
        for i in sorted(meta):
            p = params[i]
            shard, mine = self._zero_shards[p], sharded["state"].get(i, {})
            keys = [k for k, (kind, _) in meta[i].items() if kind == "slice"]
            sends = []
            for k in keys:
                v = mine.get(k)
                if not (isinstance(v, torch.Tensor) and _is_slice(v, shard)):
                    v = torch.zeros(shard.hi - shard.lo, dtype=meta[i][k][1], device=p.device)
                sends.append(v)
            if keys and size > 1:
                gathered = cring.grouped_allgather(sends, name=f"zero.state.{i}")
            else:
                gathered = sends
            if not keep:
                continue
            full = {}
            for k, (kind, value) in meta[i].items():
                if kind == "slice":
                    full[k] = _unflat(gathered[keys.index(k)], p)
                else:
                    full[k] = mine.get(k, value)  # equal on every rank (a step count)
            state[i] = full
        if not keep:
            return None
        out = {k: v for k, v in sharded.items() if k != "state"}
        out["state"] = state
        return out

    def state_dict(self) -> dict:
        """The unsharded state, in the wrapped optimizer's own format (it
        loads into a plain or sharded optimizer at any world size). A
        collective: call it on every rank, which each get all of it, unless
        consolidate_state_dict(to) was called since the last step: then it
        returns that consolidated copy on rank `to` and raises elsewhere."""
        cached = self._zero_consolidated
        if cached is not None:
            to, consolidated = cached
            if consolidated is None:
                raise RuntimeError(_CONSOLIDATED_ELSEWHERE.format(to=to))
            return consolidated
        out = self._zero_gather(None)
        assert out is not None
        return out

    def consolidate_state_dict(self, to: int = 0) -> None:
        """Gather the unsharded state on rank `to` only, for state_dict()
        there (as torch's ZeroRedundancyOptimizer; Lightning calls it before
        saving a checkpoint). A collective: call it on every rank."""
        if not 0 <= int(to) < self._zero_size:
            raise ValueError(
                f"consolidate_state_dict: to={to} is not a rank (size {self._zero_size})"
            )
        self._zero_consolidated = None
        self._zero_consolidated = (int(to), self._zero_gather(int(to)))

    def load_state_dict(self, state_dict: dict) -> None:
        """Load an unsharded state dict (from state_dict() of a sharded or
        plain optimizer, saved at any world size): each rank keeps its slices.
        Not a collective."""
        saved_groups = state_dict["param_groups"]
        saved_ids = [i for group in saved_groups for i in group["params"]]
        mine = [p for group in self.param_groups for p in group["params"]]
        saved_lens = [len(g["params"]) for g in saved_groups]
        lens = [len(g["params"]) for g in self.param_groups]
        if saved_lens != lens:
            raise ValueError(
                f"loaded state dict does not match the optimizer's param groups "
                f"({saved_lens} parameters per group saved, {lens} here)"
            )
        param_of = dict(zip(saved_ids, mine))
        sliced: dict = {}
        for i, entries in state_dict["state"].items():
            p = param_of.get(i)
            if p is None or not isinstance(entries, dict):
                sliced[i] = entries
                continue
            shard = self._zero_shards[p]
            sliced[i] = {k: _slice_of(k, v, p, shard) for k, v in entries.items()}
        shard_dict = dict(state_dict)
        shard_dict["state"] = sliced
        self._zero_consolidated = None
        self._zero_grads.clear()
        self._zero_refresh()
        with self._zero_swapped():
            super().load_state_dict(shard_dict)  # type: ignore[misc]


def _is_slice(value: Any, shard: _layout.Shard) -> bool:
    """Whether a state entry of a shard is element-wise (a slice, gathered)."""
    return (
        isinstance(value, torch.Tensor)
        and value.layout == torch.strided
        and value.dim() == 1
        and value.shape[0] == shard.hi - shard.lo
    )


def _unflat(flat: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A tensor shaped and laid out like `like` holding `flat` (memory order)."""
    if like.is_contiguous():
        return flat.reshape(like.shape).clone()
    out = torch.empty_like(like, dtype=flat.dtype, device=flat.device)
    _layout.flat_view(out).copy_(flat)
    return out


def _slice_of(key: Any, value: Any, param: torch.Tensor, shard: _layout.Shard) -> Any:
    """This rank's slice of an unsharded state entry, or the entry itself
    when it is a per-parameter value (a step count, a scalar)."""
    if not isinstance(value, torch.Tensor) or value.layout != torch.strided:
        return value
    if tuple(value.shape) != tuple(param.shape) or (
        param.dim() == 0 and key in _layout.SCALAR_KEYS
    ):
        return value.clone()  # a step count: not shared with the caller's dict
    flat = _layout.flat_view(_layout.in_layout(value, param))
    assert flat is not None
    return flat[shard.lo : shard.hi].clone()

"""Communication hooks (torch DDP's register_comm_hook API) for
DistributedOptimizer(comm_hook=...) and the Lightning strategy: the buckets a
hook receives (GradBucket) and how they are formed, calling the hook once per
bucket in bucket order, and waiting on what it returns. The built-in hooks
live in cring.torch.hooks (docs/hooks.md). Uses cring's public API and torch
only; must not import cring.torch.optimizer (which imports this) or the hooks.
"""

from __future__ import annotations

import os
import threading
import types
from typing import Any, Callable, Optional

import torch

import cring

from . import _buckets
from .mpi_ops._compression import NoneCompressor

__all__ = [
    "GradBucket",
    "HookAverager",
    "HookRunner",
    "HookUnit",
    "Pending",
    "check_arguments",
    "make_units",
    "optimizer_units",
    "plan_buckets",
]

DEFAULT_FIRST_BUCKET_BYTES = 1 << 20  # DDP's: the last layers' gradients go out early
DEFAULT_BUCKET_BYTES = 25 << 20  # DDP's bucket_cap_mb, and gradient_as_bucket_view's

HookFn = Callable[[Any, "GradBucket"], Any]


def bucket_limits() -> tuple:
    """(first bucket's cap, every other bucket's cap) in bytes: DDP's 1 MiB
    and 25 MiB, or CRING_BUCKET_BYTES for both."""
    env = os.environ.get("CRING_BUCKET_BYTES", "").strip()
    if env:
        cap = int(env)
        if cap <= 0:
            raise ValueError(f"CRING_BUCKET_BYTES must be > 0, got {env!r}")
        return cap, cap
    return DEFAULT_FIRST_BUCKET_BYTES, DEFAULT_BUCKET_BYTES


def plan_buckets(params: list, first_bytes: int, bytes_cap: int) -> list:
    """Parameters (in registration order) cut into buckets as DDP's rebuilt
    buckets are: in reverse order (the order backward usually produces their
    gradients), one dtype and device per bucket, a bucket closed once it
    holds at least its cap (the first of each kind `first_bytes`, later ones
    `bytes_cap`). Returns the buckets as lists of parameters, ordered by the
    position of their first parameter in that reverse order."""
    open_: dict = {}  # (dtype, device) -> [first position, params, bytes, cap]
    made: dict = {}  # (dtype, device) -> buckets of that kind so far
    done: list = []
    for pos, p in enumerate(reversed(params)):
        key = (p.dtype, p.device)
        b = open_.get(key)
        if b is None:
            cap = first_bytes if made.get(key, 0) == 0 else bytes_cap
            b = open_[key] = [pos, [], 0, cap]
            made[key] = made.get(key, 0) + 1
        b[1].append(p)
        b[2] += p.numel() * p.element_size()
        if b[2] >= b[3]:
            done.append(open_.pop(key))
    done.extend(open_.values())
    done.sort(key=lambda b: b[0])
    return [b[1] for b in done]


class GradBucket:
    """What a hook receives, shaped like torch's dist.GradBucket: one flat
    buffer holding the gradients of a few consecutive parameters (one dtype,
    one device), in the order of parameters().

    buffer(): the flat tensor; gradients(): each parameter's gradient as a
    view into it; parameters(); index(): 0 for the bucket backward finishes
    first; is_last(): the bucket with the highest index (the first layers);
    set_buffer(t): copy t into the buffer. cring's additions: name(), a
    prefix for the names of the bucket's collectives (the same on every rank;
    each collective a hook starts needs its own name), and `process_set`,
    the set the gradients are reduced over (the optimizer's).

    A hook returns what the buffer's reduced value will come from: a
    cring.Handle, a torch future, a tensor (or a one-tensor list) of the
    buffer's size, None (the buffer already holds it), or a generator that
    yields cring handles (or tuples of them) and receives their results:
    each yield is a stage; the value it returns is the result."""

    __slots__ = (
        "_index",
        "_count",
        "_flat",
        "_params",
        "_views",
        "_view_of",
        "_name",
        "process_set",
        "_views_attached",
    )

    def __init__(
        self,
        index: int,
        count: int,
        params: tuple,
        name: str,
        process_set: Any,
        as_views: bool,
    ) -> None:
        self._index, self._count, self._params, self._name = index, count, params, name
        self.process_set = process_set
        self._views_attached = as_views
        first = params[0]
        total = sum(p.numel() for p in params)
        self._flat = torch.zeros(total, dtype=first.dtype, device=first.device)
        self._views = []
        at = 0
        for p in params:
            self._views.append(self._flat[at : at + p.numel()].view(p.shape))
            at += p.numel()
        self._view_of = dict(zip(params, self._views))  # attach() runs once per gradient

    # ---- DDP's GradBucket ----------------------------------------------------------------------

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._index == self._count - 1

    def buffer(self) -> torch.Tensor:
        return self._flat

    def gradients(self) -> list:
        return list(self._views)

    def parameters(self) -> list:
        return list(self._params)

    def set_buffer(self, tensor: torch.Tensor) -> None:
        if tensor.numel() != self._flat.numel():
            raise ValueError(
                f"set_buffer: bucket {self._index} holds {self._flat.numel()} elements, "
                f"got a tensor of {tensor.numel()}"
            )
        self._flat.copy_(tensor.reshape(-1))

    # ---- cring's additions ---------------------------------------------------------------------

    def name(self) -> str:
        return self._name

    def __repr__(self) -> str:
        return (
            f"<cring GradBucket {self._index}/{self._count} {self._name!r}: "
            f"{len(self._params)} parameters, {self._flat.numel()} x {self._flat.dtype}>"
        )

    # ---- the gradients in and out --------------------------------------------------------------

    def attach(self, p: torch.Tensor) -> None:
        """gradient_as_bucket_view: make p.grad its view (carrying over what
        it holds), so later backward passes accumulate into the bucket."""
        if self._views_attached:
            _buckets.grad_into_view(p, self._view_of[p])

    def fill(self, sparse_as_dense: bool, what: str) -> None:
        """The buffer takes every gradient (zeros for a parameter without one)."""
        for p, view in zip(self._params, self._views):
            grad = p.grad
            if grad is view:
                continue
            if grad is not None and grad.is_sparse and not sparse_as_dense:
                raise ValueError(
                    f"{what}: a communication hook reduces dense buckets, but a parameter of "
                    f"bucket {self._index} ({tuple(p.shape)}) has a sparse gradient: pass "
                    "sparse_as_dense=True (or use a dense embedding)"
                )
            _buckets.copy_grad(view, grad)
            if self._views_attached:
                p.grad = view

    def unfill(self) -> None:
        """Every gradient takes its part of the (reduced) buffer."""
        for p, view in zip(self._params, self._views):
            grad = p.grad
            if grad is view:
                continue
            if grad is None:
                if p.requires_grad:  # a frozen parameter keeps no gradient
                    p.grad = view.clone()
            elif grad.is_sparse:
                p.grad = view.to_sparse()
            else:
                grad.copy_(view)


# ---- what a hook returned, until it is finished ---------------------------------------------


def _is_handle(x: Any) -> bool:
    return isinstance(x, cring.Handle)


def _handles(awaited: Any) -> tuple:
    return tuple(awaited) if isinstance(awaited, (tuple, list)) else (awaited,)


class Pending:
    """One bucket's hook result in flight. advance() moves a staged
    (generator) hook on without blocking, as far as its collectives have
    completed; finish() waits for the rest and hands the reduced buffer back
    to the gradients. Errors met while advancing are raised by finish()."""

    __slots__ = ("bucket", "_result", "_gen", "_awaited", "_error", "_lock", "_what")

    def __init__(self, bucket: GradBucket, result: Any, what: str) -> None:
        self.bucket, self._what = bucket, what
        self._result: Any = None
        self._gen: Any = None
        self._awaited: Any = None
        self._error: Optional[BaseException] = None
        self._lock = threading.Lock()
        if isinstance(result, types.GeneratorType):
            self._gen = result
            self._step(lambda: next(result))
        else:
            self._result = result

    def _step(self, advance: Callable[[], Any]) -> None:
        try:
            awaited = advance()
        except StopIteration as stop:
            self._gen, self._awaited, self._result = None, None, stop.value
            return
        for h in _handles(awaited):
            if not _is_handle(h):
                self._gen.close()
                raise TypeError(
                    f"{self._what}: a staged hook must yield cring handles (or tuples of them); "
                    f"bucket {self.bucket.index()} yielded {type(h).__name__}"
                )
        self._awaited = awaited

    def _resolve(self) -> Any:
        results = tuple(cring.synchronize(h) for h in _handles(self._awaited))
        return results if isinstance(self._awaited, (tuple, list)) else results[0]

    def done_waiting(self) -> bool:
        """Whether the collectives it waits for (if any) have completed."""
        return self._gen is None or all(cring.poll(h) for h in _handles(self._awaited))

    def _run(self, block: bool) -> None:
        while self._gen is not None:
            if not block and not self.done_waiting():
                return
            try:
                value = self._resolve()
            except BaseException as e:
                gen, self._gen = self._gen, None
                gen.close()
                raise e
            self._step(lambda value=value: self._gen.send(value))

    def staged(self) -> bool:
        """Whether stages remain (and nothing failed)."""
        return self._gen is not None and self._error is None

    def wait_one(self) -> None:
        """Wait for the collectives the current stage waits for (a failure
        is raised by finish())."""
        try:
            for h in _handles(self._awaited):
                cring.synchronize(h)  # the result stays with the handle for the stage
        except BaseException as e:
            with self._lock:
                if self._gen is not None:
                    gen, self._gen = self._gen, None
                    gen.close()
                self._error = e

    def advance(self) -> None:
        """Never waits for a peer (a collective not yet complete is left)."""
        if self._gen is None or self._error is not None:
            return
        with self._lock:
            try:
                self._run(block=False)
            except BaseException as e:  # raised by finish()
                self._error = e

    def finish(self) -> None:
        with self._lock:
            if self._error is not None:
                raise self._error
            self._run(block=True)
            value = self._wait_value(self._result)
        flat = self.bucket.buffer()
        if value is not None and value is not flat:
            if isinstance(value, (list, tuple)) and len(value) == 1:
                value = value[0]
            if not isinstance(value, torch.Tensor) or value.numel() != flat.numel():
                got = (
                    f"a tensor of {value.numel()} elements"
                    if isinstance(value, torch.Tensor)
                    else type(value).__name__
                )
                raise ValueError(
                    f"{self._what}: the hook's result for bucket {self.bucket.index()} must be "
                    f"a tensor of its {flat.numel()} elements (or None), got {got}"
                )
            if value.data_ptr() != flat.data_ptr():
                flat.copy_(value.reshape(-1))
        self.bucket.unfill()

    def _wait_value(self, result: Any) -> Any:
        if result is None or isinstance(result, torch.Tensor):
            return result
        if _is_handle(result):
            return cring.synchronize(result)
        if isinstance(result, torch.futures.Future) or (
            hasattr(result, "wait") and hasattr(result, "then")
        ):
            return result.wait()
        if isinstance(result, (list, tuple)):
            return result
        raise TypeError(
            f"{self._what}: a communication hook returns a cring handle, a torch future, a "
            f"tensor, None or a generator; bucket {self.bucket.index()} got "
            f"{type(result).__name__}"
        )

    def __call__(self) -> None:  # what a plain handle's waiters call on it
        self.finish()


class HookUnit:
    """What DistributedOptimizer reduces for one bucket (read like its
    _Unit: name, params, ready), started through the HookRunner."""

    __slots__ = ("name", "params", "ready", "bucket")

    def __init__(self, bucket: GradBucket) -> None:
        self.name, self.params, self.ready, self.bucket = bucket.name(), bucket._params, 0, bucket


class HookRunner:
    """Calls the hook on each bucket in index order (as DDP does: a bucket
    complete before an earlier one waits for it), so that the hook's state
    sees the same sequence on every rank, and moves staged hooks on. Waiting
    (finish) also goes in index order: every rank then waits for the same
    collective first, which no order of completion can deadlock."""

    def __init__(self, hook: HookFn, state: Any, units: list, sparse_as_dense: bool, what: str):
        self.hook, self.state, self.units = hook, state, units
        self.sparse_as_dense, self.what = sparse_as_dense, what
        self._index = {id(u): i for i, u in enumerate(units)}
        self._ready = [False] * len(units)
        self._next = 0
        self._in_flight: list = []  # Pendings not yet finished, in index order

    def reset(self) -> None:
        """Forget buckets marked ready but not started (a new step begins)."""
        self._ready = [False] * len(self.units)
        self._next = 0
        self._in_flight.clear()

    def ready(self, unit: HookUnit) -> list:
        """`unit`'s gradients are complete: start its bucket and every later
        complete one that was waiting for it. Returns [(unit, Pending)]."""
        self._ready[self._index[id(unit)]] = True
        started = []
        while self._next < len(self.units) and self._ready[self._next]:
            u = self.units[self._next]
            self._next += 1
            for earlier in self._in_flight:
                earlier.advance()
            try:
                started.append((u, self._start(u.bucket)))
            except BaseException:  # the hook failed: the next step starts afresh
                self.reset()
                raise
        if self._next == len(self.units):  # every bucket started: the next step begins afresh
            self._ready = [False] * len(self.units)
            self._next = 0
        return started

    def _start(self, bucket: GradBucket) -> Pending:
        bucket.fill(self.sparse_as_dense, self.what)
        pending = Pending(bucket, self.hook(self.state, bucket), self.what)
        self._in_flight.append(pending)
        return pending

    def finish(self, pending: Pending) -> None:
        """Wait for `pending` (the earliest bucket not finished): while it
        waits, the later buckets' stages move on as their collectives
        complete, so their next collectives start without waiting for it."""
        while True:
            pending.advance()
            if not pending.staged():
                break
            for other in self._in_flight:
                if other is not pending:
                    other.advance()
            pending.wait_one()
        if pending in self._in_flight:
            self._in_flight.remove(pending)
        pending.finish()


def make_units(named: list, prefix: str, process_set: Any, as_views: bool) -> list:
    """HookUnits (one GradBucket each) for the (name, parameter) pairs, given
    in registration order; the collectives of each are named "<prefix>.<its first parameter>"."""
    first, cap = bucket_limits()
    names = {id(p): n for n, p in named}
    parts = plan_buckets([p for _, p in named], first, cap)
    return [
        HookUnit(
            GradBucket(
                i, len(parts), tuple(part), f"{prefix}.{names[id(part[0])]}", process_set, as_views
            )
        )
        for i, part in enumerate(parts)
    ]


def optimizer_units(opt: Any, trainable: list, hook: HookFn, state: Any, as_views: bool) -> tuple:
    """(runner, units) for DistributedOptimizer(comm_hook=hook, comm_state=state)."""
    units = make_units(
        [(opt._cring_names[p], p) for p in trainable], "hook", opt.process_set, as_views
    )
    runner = HookRunner(hook, state, units, opt.sparse_as_dense, "DistributedOptimizer(comm_hook)")
    return runner, units


def check_arguments(
    comm_hook: Any, op: Any, compression: Any, groups: Any, predivide: float, shard_state: int
) -> None:
    """The DistributedOptimizer settings a communication hook cannot be combined with."""
    if not callable(comm_hook):
        raise TypeError(
            f"comm_hook must be callable as hook(state, bucket), got {type(comm_hook).__name__}"
        )
    clashes = []
    if op != cring.Average:
        clashes.append(f"op={op!r} (the hook decides the reduction; the built-in hooks average)")
    if compression not in (None, cring.Compression.none, NoneCompressor):
        clashes.append(
            "compression (compress in the hook instead: cring.torch.hooks.fp16_compress)"
        )
    if groups is not None:
        clashes.append("groups (the hook's buckets are the groups)")
    if predivide != 1.0:
        clashes.append("gradient_predivide_factor")
    if shard_state == 2:
        clashes.append(
            "shard_state=2 (its gradients are reduce-scattered, a hook returns whole buckets; "
            "shard_state=1 works with hooks)"
        )
    if clashes:
        raise ValueError("comm_hook cannot be combined with " + "; ".join(clashes))


# ---- the Lightning strategy's averager with a hook ------------------------------------------


class HookAverager:
    """The Lightning strategy's gradient averaging through a communication
    hook (the interface of lightning._common.GradientAverager): a
    post-accumulate-grad hook per parameter counts what is ready, the comm
    hook runs on each complete bucket (in bucket order), wait() starts the
    rest and finishes all of them. While `enabled` is False nothing is
    communicated. Parameters that require grad at construction are bucketed."""

    def __init__(self, module: torch.nn.Module, prefix: str, hook: HookFn, state: Any) -> None:
        self.enabled = True
        self.active = cring.is_initialized() and cring.size() > 1
        named, seen = [], set()
        for name, p in module.named_parameters():
            if p.requires_grad and id(p) not in seen:
                seen.add(id(p))
                named.append((name, p))
        self.units = make_units(named, prefix, cring.global_process_set, False)
        self._unit_of = {id(p): u for u in self.units for p in u.params}
        self._runner = HookRunner(hook, state, self.units, False, "CRingStrategy(comm_hook)")
        self._pending: dict = {}  # unit -> Pending
        self._seen: set = set()  # parameters whose gradient arrived this step
        self._hooks: dict = {}
        self.ensure_hooks()

    @property
    def in_flight(self) -> int:
        return len(self._pending) + len(self._seen)

    def ensure_hooks(self) -> None:
        if not self.active:
            return
        for u in self.units:
            for p in u.params:
                if id(p) not in self._hooks:
                    self._hooks[id(p)] = p.register_post_accumulate_grad_hook(self._grad_ready)

    def _grad_ready(self, p: torch.Tensor) -> None:
        if not self.enabled:
            return
        unit = self._unit_of[id(p)]
        if id(p) in self._seen or unit in self._pending:
            raise RuntimeError(
                "a gradient arrived twice before the strategy averaged it; with strategy "
                "'cring' call backward through Lightning (return the loss, or "
                "self.manual_backward(loss)), not loss.backward()"
            )
        self._seen.add(id(p))
        unit.ready += 1
        if unit.ready == len(unit.params):
            self._start(unit)

    def _start(self, unit: HookUnit) -> None:
        for u, pending in self._runner.ready(unit):
            self._pending[u] = pending

    def _clear(self) -> None:
        self._pending.clear()
        self._seen.clear()
        for u in self.units:
            u.ready = 0

    def wait(self) -> None:
        """Finish this step's buckets: afterwards every bucketed parameter's
        .grad holds the hook's result."""
        if not self.active:
            return
        error: Optional[BaseException] = None
        try:
            for u in self.units:
                if u not in self._pending:
                    self._start(u)
        except BaseException as e:  # still wait for what was started
            error = e
        pending = list(self._pending.values())  # started in index order
        self._clear()
        for p in pending:
            try:
                self._runner.finish(p)
            except BaseException as e:
                error = error or e
        if error is not None:
            self._runner.reset()
            raise error

    def close(self) -> None:
        """Remove the hooks and let anything still in flight land (errors ignored)."""
        for h in self._hooks.values():
            h.remove()
        self._hooks.clear()
        for p in self._pending.values():
            try:
                p.finish()
            except BaseException:
                pass
        self._clear()
        self._runner.reset()

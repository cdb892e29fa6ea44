"""horovod.torch's DistributedOptimizer on cring's engine (the broadcasts of
parameters and optimizer state are in cring.torch.functions, re-exported here
for code that imports them from this module).

Each gradient's allreduce is submitted the moment backward has finished
accumulating it (a post-accumulate-grad hook on the parameter), so
communication overlaps the rest of backward and the engine fuses the
gradients that arrive together; step() only waits for what is still in
flight. This module uses cring's public API, torch and cring.torch.mpi_ops'
sparse_allreduce_async, nothing else. The variants live beside it
(_buckets.py, _comm_hook.py, _adasum.py, sharded.py, _trainable.py,
_compiled_sync.py); what stays here (~730 lines) is the one class they share:
the per-gradient hooks, submission and synchronize().
"""

from __future__ import annotations

import threading
import warnings
import weakref
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any, Callable, Optional

import torch

import cring

from . import _adasum, _buckets, _comm_hook, _compiled_sync, _trainable
from . import sharded as _sharded
from .functions import broadcast_optimizer_state, broadcast_parameters
from .mpi_ops import sparse_allreduce_async as _sparse_allreduce_async

__all__ = ["DistributedOptimizer", "broadcast_parameters", "broadcast_optimizer_state"]

_ZERO_GRAD_IN_FLIGHT = (
    "optimizer.zero_grad() was called after loss.backward() but before optimizer.step() or "
    "optimizer.synchronize(). This is prohibited as it can cause a race condition."
)
_TOO_MANY_BACKWARDS = (
    "Gradients were computed more than backward_passes_per_step times before call to step(). "
    "Increase backward_passes_per_step to accumulate gradients locally."
)
_STEP_AFTER_SYNCHRONIZE = (
    "optimizer.step() called without optimizer.skip_synchronize() context after "
    "optimizer.synchronize(). This can cause training slowdown. You may want to consider using "
    "optimizer.skip_synchronize() context if you use optimizer.synchronize() in your code."
)


class _Unit:
    """What one allreduce carries: one parameter's gradient, or a group's
    (one grouped allreduce), under one name. `ready` counts the parameters
    whose gradient is final for this step."""

    __slots__ = ("name", "params", "ready")

    def __init__(self, name: str, params: tuple) -> None:
        self.name = name
        self.params = params
        self.ready = 0


class _Entry:
    """One gradient in flight: the parameter, its .grad at submission, the
    dense contiguous tensor holding the result (the grad itself when it
    can be), and what the allreduce runs on (after a torch-side compressor)."""

    __slots__ = ("param", "grad", "buffer", "wire", "compressed", "ctx", "sparse")

    def __init__(
        self,
        param: torch.Tensor,
        grad: torch.Tensor,
        buffer: torch.Tensor,
        wire: torch.Tensor,
        compressed: bool,
        ctx: Any,
        sparse: bool,
    ) -> None:
        self.param, self.grad, self.buffer, self.wire = param, grad, buffer, wire
        self.compressed, self.ctx, self.sparse = compressed, ctx, sparse


def _split_list(items: list, n: int) -> list:
    """`items` cut into n contiguous parts whose lengths differ by at most one."""
    d, r = divmod(len(items), n)
    return [items[i * d + min(i, r) : (i + 1) * d + min(i + 1, r)] for i in range(n)]


class _DistributedOptimizer:
    """Mixed in front of the wrapped optimizer's class (see DistributedOptimizer)."""

    _cring_paused = False  # True: the hooks do nothing (a strategy's no-sync context)

    # ---- construction ------------------------------------------------------------------------

    def _cring_setup(
        self,
        named_parameters: Any,
        compression: Any,
        backward_passes_per_step: int,
        op: Any,
        gradient_predivide_factor: float,
        groups: Any,
        sparse_as_dense: bool,
        process_set: Any = None,
        bucket_view: bool = False,
        comm_hook: Any = None,
        comm_state: Any = None,
    ) -> None:
        if isinstance(compression, cring.Compressor) or compression is None:
            self._cring_engine_compression, self._cring_torch_compression = compression, None
        elif hasattr(compression, "compress") and hasattr(compression, "decompress"):
            # a Horovod-style compressor: compress(t) -> (t', ctx), decompress(t', ctx) -> t.
            # cring.torch's FP16/BF16Compressor name their wire format in `_wire`: float32
            # gradients then travel compressed through the engine, without a cast here
            wire = getattr(compression, "_wire", None)
            self._cring_engine_compression = wire if isinstance(wire, cring.Compressor) else None
            self._cring_torch_compression = compression
        else:
            raise ValueError(
                f"compression must be cring.Compression.none, fp16 or bf16 (or an "
                f"object with compress/decompress), got {compression!r}"
            )
        self._compression = compression
        self.process_set = process_set if process_set is not None else cring.global_process_set
        # Horovod's rule: a rank outside the set leaves its gradients alone
        self._cring_outside = process_set is not None and not self.process_set.included()
        self.op = op
        self.gradient_predivide_factor = float(gradient_predivide_factor)
        self.sparse_as_dense = bool(sparse_as_dense)
        self.backward_passes_per_step = int(backward_passes_per_step)
        if op == cring.Average:
            # the engine divides by size() for Average; split that average around the sum
            self._cring_prescale = 1.0 / self.gradient_predivide_factor
            self._cring_postscale = self.gradient_predivide_factor
        else:
            self._cring_prescale = self._cring_postscale = 1.0

        params: list = []
        seen: set = set()
        for group in self.param_groups:
            for p in group["params"]:
                if id(p) not in seen:
                    seen.add(id(p))
                    params.append(p)
        names = self._cring_names = _parameter_names(self.param_groups, named_parameters)
        trainable = [p for p in params if p.requires_grad]
        self._cring_units = self._cring_make_units(trainable, names, groups)
        self._cring_unit_of = {p: unit for unit in self._cring_units for p in unit.params}
        self._cring_delay = {p: self.backward_passes_per_step for p in trainable}
        self._cring_handles: dict = {}  # _Unit -> [(cring.Handle, [_Entry]), ...]
        self._cring_touched: set = set()  # params that had a backward since the last sync
        self._cring_lock = threading.Lock()
        self._cring_synchronized = False
        self._cring_should_synchronize = True
        self._cring_hook_handles: list = []
        self._cring_buckets: Optional[_buckets.BucketLayout] = None
        self._cring_hook_runner: Optional[_comm_hook.HookRunner] = None
        if comm_hook is not None:  # the hook reduces DDP-style buckets (_comm_hook.py)
            self._cring_hook_runner, self._cring_units = _comm_hook.optimizer_units(
                self, trainable, comm_hook, comm_state, bucket_view
            )
            self._cring_unit_of = {p: u for u in self._cring_units for p in u.params}
        elif bucket_view:  # shared buckets where possible (_buckets.py), else the usual units
            self._cring_buckets, units = _buckets.plan_units(
                self, trainable, groups, compression, process_set
            )
            if units:
                self._cring_units = units
                self._cring_unit_of = {p: u for u in units for p in u.params}
        self._cring_waiting = _trainable.waiting(params, self._cring_unit_of)  # frozen now
        # Hooks are registered even for one rank: an elastic job can grow
        # later. With one rank they do nothing (checked per call).
        self._cring_register_hooks(trainable)

    def _cring_make_units(self, trainable: list, names: dict, groups: Any) -> list:
        """What each hook-started reduction carries (the sharded path buckets)."""
        return _make_units(trainable, names, groups)

    def _cring_wrapped_step(self, closure: Optional[Callable[[], Any]]) -> Any:
        """The wrapped optimizer's step (the sharded path steps slices)."""
        return super().step(closure)  # type: ignore[misc]

    def _cring_register_hooks(self, trainable: list) -> None:
        me = weakref.ref(self)
        handles = self._cring_hook_handles
        for p in trainable:
            if hasattr(p, "register_post_accumulate_grad_hook"):  # torch >= 2.1

                def hook(param: torch.Tensor) -> None:
                    if torch.compiler.is_compiling():
                        return  # compiled autograd: step() reduces (_compiled_sync.py)
                    opt = me()
                    if opt is not None:
                        opt._cring_grad_ready(param)

                handles.append(p.register_post_accumulate_grad_hook(hook))
            else:  # Horovod's way: a hook on the parameter's gradient accumulator
                grad_acc = p.expand_as(p).grad_fn.next_functions[0][0]
                pref = weakref.ref(p)

                def acc_hook(*_: Any, pref: Any = pref) -> None:
                    opt, param = me(), pref()
                    if opt is not None and param is not None:
                        opt._cring_grad_ready(param)

                handles.append((grad_acc, grad_acc.register_hook(acc_hook)))
        # the hooks go when the optimizer does, so a dropped optimizer never submits
        weakref.finalize(self, _remove_hooks, handles)

    # ---- the hook: one gradient is final ---------------------------------------------------

    def _cring_grad_ready(self, p: torch.Tensor) -> None:
        if cring.size() == 1 or self._cring_paused or self._cring_outside:
            return
        with self._cring_lock:
            unit = self._cring_unit_of.get(p)
            if unit is None:
                return
            if self._cring_delay[p] <= 0 or unit in self._cring_handles:
                raise AssertionError(_TOO_MANY_BACKWARDS)
            self._cring_delay[p] -= 1
            self._cring_touched.add(p)
            if isinstance(unit, _buckets.BucketUnit):
                self._cring_buckets.attach(p)  # later passes accumulate into the view
            elif isinstance(unit, _comm_hook.HookUnit):
                unit.bucket.attach(p)  # the same, with gradient_as_bucket_view
            if self._cring_delay[p] == 0:
                unit.ready += 1
                if unit.ready == len(unit.params):
                    self._cring_submit(unit)

    def _cring_submit(self, unit: _Unit) -> None:
        """Start the allreduce of `unit`'s gradients (zeros for a parameter
        that has none: another rank may have one, and every rank must submit)."""
        if isinstance(unit, _comm_hook.HookUnit):  # the hook's turn, in bucket order
            for started, pending in self._cring_hook_runner.ready(unit):
                self._cring_handles[started] = [(pending, [])]
            return
        if isinstance(unit, _buckets.BucketUnit):  # in place: the views hold the result
            entry = _Entry(unit.params[0], unit.flat, unit.flat, unit.flat, False, None, False)
            self._cring_handles[unit] = [(_buckets.submit(self, unit), [entry])]
            return
        entries = []
        compressor = self._cring_torch_compression
        sparse_submitted: list = []  # gathers of sparse gradients, started as met
        for p in unit.params:
            if not p.requires_grad and not isinstance(self, _sharded.ShardedMixin):
                continue  # frozen since the optimizer was built: left alone, as under DDP
            grad = p.grad
            if grad is None:
                grad = p.grad = torch.zeros_like(p.detach())
            sparse = grad.is_sparse
            if sparse and not self.sparse_as_dense:
                # Horovod's way: allgather the indices and values (not compressed)
                name = unit.name if len(unit.params) == 1 else f"{unit.name}.{self._cring_names[p]}"
                entry = _Entry(p, grad, grad, grad, False, None, True)
                # process_set: the attribute helper psets' DistributedOptimizer(process_set=) sets
                process_set = getattr(self, "process_set", None)
                kwargs = {} if process_set is None else {"process_set": process_set}
                handle = _sparse_allreduce_async(grad, name, self.op, **kwargs)
                sparse_submitted.append((handle, [entry]))
                continue
            if sparse:
                buffer = grad.to_dense()
            else:
                buffer = grad if grad.is_contiguous() else grad.contiguous()
            ctx, wire = None, buffer
            compressed = compressor is not None and not (
                buffer.dtype == torch.float32 and self._cring_engine_compression is not None
            )
            if compressed:
                wire, ctx = compressor.compress(buffer)
                if not wire.is_contiguous():
                    wire = wire.contiguous()
            entries.append(_Entry(p, grad, buffer, wire, compressed, ctx, sparse))
        kwargs = dict(
            op=self.op,
            compression=self._cring_engine_compression,
            prescale_factor=self._cring_prescale,
            postscale_factor=self._cring_postscale,
            process_set=self.process_set,
        )
        submitted = self._cring_handles[unit] = sparse_submitted
        if not entries:
            return
        if len(entries) == 1:
            submitted.append(
                (cring.allreduce_async_(entries[0].wire, name=unit.name, **kwargs), entries)
            )
        else:
            # one grouped allreduce per dtype: the engine reduces a group in one dtype
            by_dtype: dict = {}
            for e in entries:
                by_dtype.setdefault(e.wire.dtype, []).append(e)
            for dtype, part in by_dtype.items():
                name = unit.name if len(by_dtype) == 1 else f"{unit.name}.{str(dtype)[6:]}"
                handle = cring.grouped_allreduce_async_([e.wire for e in part], name=name, **kwargs)
                submitted.append((handle, part))

    def _cring_finish(self, handle: Any, entries: list) -> None:
        if isinstance(handle, _comm_hook.Pending):
            self._cring_hook_runner.finish(handle)
            return
        if not isinstance(handle, cring.Handle):  # a sparse gradient's gather
            (e,) = entries
            reduced = handle()
            # in place, as Horovod does: the .grad object the caller holds is the result
            e.grad.zero_().add_(reduced.to(e.grad.dtype))
            return
        cring.synchronize(handle)
        compressor = self._cring_torch_compression
        for e in entries:
            if e.compressed:
                out = compressor.decompress(e.wire, e.ctx)
                if out is not e.buffer:
                    e.buffer.copy_(out)
            if e.sparse:
                e.param.grad = e.buffer.to_sparse()
            elif e.buffer is not e.grad:
                e.grad.copy_(e.buffer)

    # ---- the public methods ------------------------------------------------------------------

    @property
    def _parameter_names(self) -> dict:
        """Horovod's attribute: parameter -> the name its gradient is reduced
        under (the allreduce is "allreduce.<name>"). Read-only."""
        return dict(self._cring_names)

    def synchronize(self) -> None:
        """Finish every gradient's allreduce: start those not started yet
        (parameters whose gradient did not arrive by a hook, and gradients
        accumulated fewer than backward_passes_per_step times), then wait for
        all of them. Afterwards every .grad holds the reduced gradient."""
        if torch.compiler.is_compiling() and _compiled_sync.traceable(self):
            return _compiled_sync.synchronize(self)  # one operator per dtype in the graph
        if cring.size() == 1 or self._cring_outside:
            self._cring_synchronized = True
            return
        error: Optional[BaseException] = None
        with self._cring_lock:
            try:
                _trainable.adopt_unfrozen(self, _Unit)
                for unit in self._cring_units:
                    if unit not in self._cring_handles:
                        self._cring_submit(unit)
            except BaseException as e:  # still wait for what was started, then raise
                error = e
            pending = [x for submitted in self._cring_handles.values() for x in submitted]
            self._cring_handles.clear()
            self._cring_touched.clear()
            for unit in self._cring_units:
                unit.ready = 0
            for p in self._cring_delay:
                self._cring_delay[p] = self.backward_passes_per_step
        for handle, entries in pending:
            try:
                self._cring_finish(handle, entries)
            except BaseException as e:
                error = error or e
        if error is not None:
            raise error
        self._cring_synchronized = True

    @contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """Within this context step() does not synchronize; use it after an
        explicit synchronize(), e.g. to clip the reduced gradients:

            loss.backward()
            optimizer.synchronize()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            with optimizer.skip_synchronize():
                optimizer.step()
        """
        self._cring_should_synchronize = False
        try:
            yield
        finally:
            self._cring_should_synchronize = True

    def step(self, closure: Optional[Callable[[], Any]] = None) -> Any:
        """Wait for the gradients still in flight, then take the wrapped
        optimizer's step. With a closure, the gradients its backward
        produces are reduced before the wrapped step uses them."""
        if not self._cring_should_synchronize:
            self._cring_synchronized = False
            return self._cring_wrapped_step(closure)
        if closure is None:
            if self._cring_synchronized:
                warnings.warn(_STEP_AFTER_SYNCHRONIZE, stacklevel=2)
            self.synchronize()
            self._cring_synchronized = False
            return self._cring_wrapped_step(None)
        if self._cring_handles or self._cring_touched:
            self.synchronize()  # an earlier backward's gradients

        def synchronized_closure() -> Any:
            loss = closure()
            self.synchronize()
            return loss

        self._cring_synchronized = False
        try:
            return self._cring_wrapped_step(synchronized_closure)
        finally:
            self._cring_synchronized = False

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The wrapped zero_grad; raises AssertionError (as Horovod does)
        while gradients are being reduced or accumulated for a step."""
        if self._cring_handles or self._cring_touched:
            raise AssertionError(_ZERO_GRAD_IN_FLIGHT)
        if set_to_none and torch.compiler.is_compiling():
            return _compiled_sync.zero_grad(self)
        return super().zero_grad(set_to_none)  # type: ignore[misc]

    def add_param_group(self, param_group: dict) -> None:
        """The wrapped add_param_group; the new group's trainable parameters
        are reduced like the others (each alone, never in a shared bucket),
        named "noname.<group>.<index>" (by position in the group, frozen ones
        counted) unless already named."""
        super().add_param_group(param_group)  # type: ignore[misc]
        if not hasattr(self, "_cring_units"):
            return
        index = len(self.param_groups) - 1
        group = self.param_groups[index]["params"]
        with self._cring_lock:
            # named by position in the group, frozen ones too (as at build), so
            # that one unfrozen later never takes another's name
            for j, p in enumerate(group):
                self._cring_names.setdefault(p, f"noname.{index}.{j}")
            self._cring_waiting += _trainable.waiting(group, self._cring_unit_of)
            _trainable.adopt_unfrozen(self, _Unit)

    def set_backward_passes_per_step(self, passes: int) -> None:
        if int(passes) < 1:
            raise ValueError(f"backward_passes_per_step must be >= 1, got {passes}")
        self.backward_passes_per_step = int(passes)
        for p in self._cring_delay:
            self._cring_delay[p] = self.backward_passes_per_step

    def load_state_dict(self, state_dict: dict) -> None:
        # what is in flight writes into .grad: let it land, then start afresh
        for submitted in list(self._cring_handles.values()):
            for handle, _ in submitted:
                try:
                    handle() if not isinstance(handle, cring.Handle) else cring.synchronize(handle)
                except cring.CRingError:
                    pass
        self._cring_handles.clear()
        self._cring_touched.clear()
        for unit in self._cring_units:
            unit.ready = 0
        if self._cring_hook_runner is not None:
            self._cring_hook_runner.reset()
        for p in self._cring_delay:
            self._cring_delay[p] = self.backward_passes_per_step
        self._cring_synchronized = False
        self._cring_should_synchronize = True
        super().load_state_dict(state_dict)  # type: ignore[misc]


def _remove_hooks(handles: list) -> None:
    for h in handles:
        if isinstance(h, tuple):
            h = h[1]
        h.remove()


def _parameter_names(param_groups: list, named_parameters: Any) -> dict:
    """Parameter -> the name its allreduce is known by (without the prefix)."""
    if named_parameters is None:
        return {
            p: f"noname.{i}.{j}"
            for i, group in enumerate(param_groups)
            for j, p in enumerate(group["params"])
        }
    named = list(named_parameters)
    if any(not isinstance(x, tuple) or len(x) != 2 for x in named):
        raise ValueError(
            "named_parameters should be a sequence of tuples (name, parameter), "
            "usually produced by model.named_parameters()."
        )
    seen, dups = set(), set()
    for name, _ in named:
        (dups if name in seen else seen).add(name)
    if dups:
        raise ValueError(
            "Parameter names in named_parameters must be unique. Found duplicates: "
            + ", ".join(sorted(str(d) for d in dups))
        )
    names = {p: str(name) for name, p in sorted(named, key=lambda x: str(x[0]))}
    unnamed = [
        f"{i}.{j} {tuple(p.shape)}"
        for i, group in enumerate(param_groups)
        for j, p in enumerate(group["params"])
        if p not in names
    ]
    if unnamed:
        raise ValueError(
            "named_parameters was specified, but one or more model parameters were "
            "not named (param_group.index shape): " + ", ".join(unnamed)
        )
    return names


def _make_units(trainable: list, names: dict, groups: Any) -> list:
    """One _Unit per allreduce: per parameter, or per group of parameters."""
    if groups is None or (isinstance(groups, int) and not isinstance(groups, bool) and groups == 0):
        parts = [[p] for p in trainable]
    elif isinstance(groups, int) and not isinstance(groups, bool):
        if groups < 0:
            raise ValueError(
                f"groups should be a non-negative integer or a list of lists of "
                f"torch.Tensor, got {groups}"
            )
        parts = [part for part in _split_list(trainable, groups) if part]
    elif isinstance(groups, (list, tuple)):
        in_optimizer = {id(p) for p in trainable}
        grouped: set = set()
        parts = []
        for group in groups:
            if isinstance(group, torch.Tensor) or not isinstance(group, Iterable):
                raise ValueError("groups must be a list of lists of torch.Tensor")
            part = []
            for p in group:
                if not isinstance(p, torch.Tensor):
                    raise ValueError("groups must consist of torch.Tensor.")
                if id(p) in grouped:
                    raise ValueError("A parameter can only appear once in groups.")
                grouped.add(id(p))
                if id(p) in in_optimizer:
                    part.append(p)
                elif not p.requires_grad:
                    continue
                else:
                    raise ValueError(
                        "groups holds a tensor that is not a parameter of the optimizer"
                    )
            if part:
                parts.append(part)
        parts += [[p] for p in trainable if id(p) not in grouped]
        order = {id(p): i for i, p in enumerate(trainable)}
        parts.sort(key=lambda part: min(order[id(p)] for p in part))
    else:
        raise ValueError(
            "groups should be a non-negative integer or a list of lists of "
            f"torch.Tensor, got {type(groups).__name__}"
        )
    units = []
    for part in parts:
        prefix = "allreduce." if len(part) == 1 else "grouped_allreduce."
        units.append(_Unit(prefix + names[part[0]], tuple(part)))
    return units


_CLASSES: dict = {}


def _distributed_class(base: type, sharded: bool) -> type:
    cls = _CLASSES.get((base, sharded))
    if cls is None:
        # the wrapped class's name, so that repr() and logs read as before
        mixins = (
            (_sharded.ShardedMixin, _DistributedOptimizer) if sharded else (_DistributedOptimizer,)
        )
        cls = type(
            base.__name__,
            (*mixins, base),
            {"__module__": __name__, "__qualname__": base.__qualname__, "_cring_base": base},
        )
        _CLASSES[(base, sharded)] = cls
    return cls


def DistributedOptimizer(
    optimizer: torch.optim.Optimizer,
    named_parameters: Optional[Iterable] = None,
    compression: Any = cring.Compression.none,
    backward_passes_per_step: int = 1,
    op: Any = cring.Average,
    gradient_predivide_factor: float = 1.0,
    groups: Any = None,
    sparse_as_dense: bool = False,
    shard_state: int = 0,
    process_set: Any = None,
    gradient_as_bucket_view: Optional[bool] = None,
    comm_hook: Any = None,
    comm_state: Any = None,
) -> torch.optim.Optimizer:
    """Wrap `optimizer` so that gradients are reduced over all ranks before
    each step, as horovod.torch.DistributedOptimizer does.

    The result is an instance of a subclass of the optimizer's class (with
    the same name), sharing its param_groups, state and defaults, so
    isinstance checks, state_dict() and LR schedulers keep working; use it
    instead of the original from now on.

    Each parameter's allreduce starts the moment backward has accumulated its
    gradient, so communication overlaps the rest of backward, and the engine
    fuses the gradients that arrive together. step() waits for what is still
    in flight (synchronize()) and then takes the wrapped step.

    Arguments:
        named_parameters: (name, parameter) pairs, usually
            model.named_parameters(): the allreduce of parameter `name` is
            called "allreduce.<name>". Names must be unique and must cover
            every parameter of the optimizer. Without them, parameters are
            named by position: "allreduce.noname.<group>.<index>".
        compression: cring.Compression.none, fp16 or bf16 (float32 gradients
            travel as 16-bit), or a Horovod-style compressor object.
        backward_passes_per_step: gradients accumulate locally (summed by
            autograd) over this many backward passes; the allreduce starts on
            the last one.
        op: cring.Average (default) or cring.Sum (Min, Max, Product work too).
            cring.Adasum, with more than one rank, gives Horovod's delta
            optimizer: each rank steps locally and the parameters' updates
            are combined with Adasum (docs/adasum.md).
        gradient_predivide_factor: with Average, gradients are multiplied by
            1 / factor before the sum and by factor / size() after it.
        groups: an int n: the trainable parameters, in order, are cut into n
            contiguous groups; or a list of lists of parameters (the rest
            alone). Each group is one grouped allreduce, started once all of
            its gradients are ready.
        sparse_as_dense: allreduce sparse gradients (nn.Embedding(sparse=True))
            as dense tensors (the result is made sparse again). Without it a
            sparse gradient's indices and values are allgathered, as Horovod
            does (sparse_allreduce_async; op Average or Sum only), which is
            smaller while few rows are touched. Either way every rank must
            produce a sparse gradient for that parameter in that step.

        shard_state: 0 (default): every rank holds the whole optimizer state.
            1 or 2 (ZeRO stages 1 and 2, docs/sharded.md): each rank keeps the
            state of its own slice of every parameter and steps only that
            slice; the updated slices are allgathered within step(). Stage 1
            allreduces gradients as above; stage 2 reduce-scatters them, so a
            rank keeps only its slice (p.grad is None after synchronize()).
            Needs an element-wise optimizer (SGD, Adam, AdamW, ...; not LBFGS);
            state_dict() is then a collective giving the unsharded state, and
            load_state_dict() takes one saved at any world size.
        process_set: reduce gradients over this cring.ProcessSet's ranks only
            (default: all); a rank outside it keeps its own gradients.
        gradient_as_bucket_view: True (or None with CRING_BUCKET_VIEW=1):
            gradients become views into buckets of about 25 MiB
            (CRING_BUCKET_BYTES) in memory every rank on the host maps, and
            each bucket is reduced in place, reading the peers' buckets where
            they lie (DDP's gradient_as_bucket_view, over shared memory;
            docs/performance.md). Every rank must pass the same value. Over
            TCP, across hosts, with compression, groups, shard_state, a
            process set, gradient_predivide_factor or an op other than
            Average/Sum the usual path is taken. Parameters added later with
            add_param_group are reduced the usual way.
        comm_hook, comm_state: torch DDP's communication hook API
            (register_comm_hook(state, hook); docs/hooks.md): the trainable
            parameters are cut into DDP's buckets and hook(comm_state,
            bucket) reduces each one, e.g. cring.torch.hooks.powerSGD_hook
            with a PowerSGDState, or fp16_compress, bf16_compress, int8_hook.
            The hook averages over process_set; not with op, compression,
            groups, gradient_predivide_factor or shard_state=2. With
            gradient_as_bucket_view the gradients are views into the buckets.

    Parameters that do not require grad are left alone, judged at each step:
    one frozen (requires_grad_(False)) after the optimizer was built gets no
    gradient and no reduction, so the wrapped optimizer skips it, as under
    DDP; one frozen when it was built and trainable later is reduced from
    then on. Every rank must freeze and unfreeze the same parameters in the
    same step. (With shard_state the trainable set stays the one the
    optimizer was built with.) A trainable parameter with no gradient at step() gets a zero
    gradient that is reduced like the others (another rank may have one), as
    in Horovod.
    With one rank the wrapped optimizer runs unchanged.
    """
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if isinstance(optimizer, _DistributedOptimizer):
        raise ValueError("optimizer is already a cring DistributedOptimizer")
    if comm_hook is not None:
        _comm_hook.check_arguments(
            comm_hook, op, compression, groups, gradient_predivide_factor, shard_state
        )
    if op == cring.Adasum and cring.size() > 1:  # Horovod's delta optimizer: _adasum.py
        if shard_state or groups is not None or gradient_predivide_factor != 1.0:
            raise ValueError(
                "op=cring.Adasum takes no shard_state, groups or gradient_predivide_factor"
            )
        return _adasum.make_adasum_optimizer(
            optimizer, named_parameters, compression, backward_passes_per_step
        )
    try:
        op = cring.ReduceOp(int(op))
    except (TypeError, ValueError):
        raise ValueError(f"unknown reduction op {op!r}; use cring.Average or cring.Sum") from None
    if gradient_predivide_factor != 1.0 and op != cring.Average:
        raise ValueError("gradient_predivide_factor not supported with op != Average")
    if not gradient_predivide_factor > 0:
        raise ValueError(f"gradient_predivide_factor must be > 0, got {gradient_predivide_factor}")
    if int(backward_passes_per_step) < 1:
        raise ValueError(f"backward_passes_per_step must be >= 1, got {backward_passes_per_step}")
    shard_state = _sharded.check_arguments(optimizer, shard_state, groups)
    if shard_state and process_set not in (None, cring.global_process_set):
        raise NotImplementedError("shard_state with a process_set other than the global one")
    cls = _distributed_class(type(optimizer), shard_state > 0)
    wrapped = cls.__new__(cls)
    # share everything the original holds (param_groups, state, defaults, hooks) instead of
    # re-running its __init__, which may need arguments we do not know; not an LR scheduler's
    # patch of the original's step, which would bypass ours (the wrapper gets its own)
    wrapped.__dict__.update(_sharded.adopt_instance_state(wrapped, optimizer))
    if shard_state:
        wrapped._zero_begin(shard_state)
    wrapped._cring_setup(
        named_parameters,
        compression,
        backward_passes_per_step,
        op,
        gradient_predivide_factor,
        groups,
        sparse_as_dense,
        process_set,
        _buckets.requested(gradient_as_bucket_view) and not shard_state,
        comm_hook,
        comm_state,
    )
    if shard_state:
        wrapped._zero_setup()
    return wrapped

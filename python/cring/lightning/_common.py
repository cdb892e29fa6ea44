# What the Lightning and Fabric strategies share, written against torch and cring
# only: reduce-op names, the gradient averager, the collectives in Lightning's
# conventions and the strategy code both classes have in common
# (StrategyMixin). Launcher detection is _launch.py. Nothing here imports Lightning.
"""Shared machinery of cring's Lightning and Fabric strategies."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any, Optional

import torch

import cring

from ._environment import _CRingEnvironmentBase
from ._launch import CUDA_DEVICE_VARIABLE, cuda_device_index

# ---- reduce operations --------------------------------------------------------------------------

_OP_NAMES = {
    "mean": cring.Average,
    "avg": cring.Average,
    "average": cring.Average,
    "sum": cring.Sum,
    "min": cring.Min,
    "max": cring.Max,
    "product": cring.Product,
    "prod": cring.Product,
}


def resolve_op(reduce_op: Any) -> cring.ReduceOp:
    """cring's op for Lightning's `reduce_op`: a name ('mean'/'avg', 'sum',
    'min', 'max', 'product'), torch.distributed.ReduceOp.{SUM, AVG, MIN, MAX,
    PRODUCT}, or a cring.ReduceOp (cring.Adasum included: floating CPU tensors,
    a power-of-two number of ranks; see docs/adasum.md). None means sum, as in
    Lightning's DDP."""
    if reduce_op is None:
        return cring.Sum
    if isinstance(reduce_op, cring.ReduceOp):
        return reduce_op
    if isinstance(reduce_op, str):
        op = _OP_NAMES.get(reduce_op.lower())
        if op is not None:
            return op
    else:
        torch_op = getattr(torch.distributed, "ReduceOp", None)
        kinds = tuple(k for k in (torch_op, getattr(torch_op, "RedOpType", None)) if k)
        if kinds and isinstance(reduce_op, kinds):
            for name, op in (
                ("SUM", cring.Sum),
                ("AVG", cring.Average),
                ("MIN", cring.Min),
                ("MAX", cring.Max),
                ("PRODUCT", cring.Product),
            ):
                if reduce_op == getattr(torch_op, name):
                    return op
    raise ValueError(
        f"reduce_op={reduce_op!r} is not supported by strategy 'cring': use 'mean', 'sum', 'min', "
        "'max' or 'product', torch.distributed.ReduceOp.SUM/AVG/MIN/MAX/PRODUCT, or a "
        "cring.ReduceOp"
    )


def _check_group(group: Any) -> None:
    if group is not None:
        raise ValueError(
            "strategy 'cring' has no process groups: pass group=None (every rank takes part)"
        )


def _distributed() -> bool:
    return cring.is_initialized() and cring.size() > 1


# the device kinds the strategy trains on (cring's collectives take CPU and CUDA tensors)
DEVICE_KINDS = ("cpu", "cuda")


def _check_device(tensor: torch.Tensor, what: str) -> None:
    if tensor.device.type not in DEVICE_KINDS:
        raise ValueError(
            f"{what}: strategy 'cring' works on CPU and CUDA tensors, got a tensor on "
            f"{tensor.device}"
        )


# ---- collectives in Lightning's conventions ---------------------------------------------------


def reduce(tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
    """Reduce `tensor` over all ranks in place and return it, as Lightning's
    DDP does (integer means round toward zero); anything that is not a
    tensor comes back unchanged."""
    op = resolve_op(reduce_op)
    _check_group(group)
    if not isinstance(tensor, torch.Tensor) or not _distributed():
        return tensor
    _check_device(tensor, "reduce")
    with torch.no_grad():
        work = tensor.detach()
        if work.dtype == torch.bool:
            # bools: sum, mean and max are "any", min and product "all"
            work = work.to(torch.uint8)
            op = cring.Min if op in (cring.Min, cring.Product) else cring.Max
        elif not work.is_contiguous():
            work = work.contiguous()
        cring.allreduce_(work, op=op)
        if work.data_ptr() != tensor.data_ptr() or work.dtype != tensor.dtype:
            tensor.detach().copy_(work)
    return tensor


class _AllGather(torch.autograd.Function):
    """All ranks' tensors stacked on a new first dimension; the gradient of
    each rank's input is the sum over ranks of the gradient of its slice (as
    torch.distributed.nn.all_gather, which Lightning's DDP uses)."""

    @staticmethod
    def forward(ctx: Any, tensor: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return cring.allgather(tensor.detach().unsqueeze(0).contiguous())

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        mine = cring.reducescatter(grad_output.contiguous(), op=cring.Sum)
        return mine.squeeze(0)


def all_gather(tensor: torch.Tensor, group: Any = None, sync_grads: bool = False) -> torch.Tensor:
    """Every rank's `tensor` stacked on a new first dimension (world_size, *shape).
    With sync_grads, gradients flow back to each rank's input."""
    _check_group(group)
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"all_gather needs a tensor, got {type(tensor).__name__}")
    if not cring.is_initialized():
        return tensor
    _check_device(tensor, "all_gather")
    if sync_grads and tensor.requires_grad and torch.is_grad_enabled():
        return _AllGather.apply(tensor)
    with torch.no_grad():
        return cring.allgather(tensor.detach().unsqueeze(0).contiguous())


def broadcast(obj: Any, src: int = 0) -> Any:
    """Rank `src`'s `obj` (any picklable object) on every rank."""
    if not _distributed():
        return obj
    if not 0 <= int(src) < cring.size():
        raise ValueError(f"broadcast: src={src} is not a rank (size is {cring.size()})")
    import cring.torch as ct

    return ct.broadcast_object(obj, root_rank=int(src))


def barrier() -> None:
    if _distributed():
        cring.barrier()


def reduce_boolean_decision(decision: bool, all: bool = True) -> bool:
    """True when every rank (all=True) or some rank (all=False) decided True."""
    if not _distributed():
        return bool(decision)
    flag = torch.tensor([1 if decision else 0], dtype=torch.int32)
    cring.allreduce_(flag, op=cring.Min if all else cring.Max)
    return bool(flag[0])


def broadcast_module(module: torch.nn.Module, prefix: str) -> None:
    """Overwrite every parameter and buffer of `module` with rank 0's values."""
    if not _distributed():
        return
    handles, copies, seen = [], [], set()
    named = list(module.named_parameters()) + list(module.named_buffers())
    with torch.no_grad():
        for name, t in named:
            if t is None or id(t) in seen:
                continue
            seen.add(id(t))
            _check_device(t, f"parameter or buffer {name!r}")
            target = t.detach()
            if not target.is_contiguous():
                staged = target.contiguous()
                copies.append((target, staged))
                target = staged
            handles.append(cring.broadcast_async_(target, 0, name=f"{prefix}.{name}"))
        _wait_all(handles)
        for target, staged in copies:
            target.copy_(staged)


def _wait_all(handles: list) -> None:
    error: Optional[BaseException] = None
    for handle in handles:
        try:
            cring.synchronize(handle)
        except BaseException as e:  # wait for the rest, then raise the first
            error = error or e
    if error is not None:
        raise error


# ---- gradient averaging -----------------------------------------------------------------------


class GradientAverager:
    """Averages the gradients of a module's parameters over all ranks.

    Each parameter's allreduce starts from a post-accumulate-grad hook the
    moment autograd has finished its gradient, so communication overlaps the
    rest of backward and cring's engine fuses what arrives together; wait()
    (called by the strategy right after backward) submits what did not come
    through a hook and waits for everything. While `enabled` is False (gradient
    accumulation) the hooks do nothing and no communication happens.

    A trainable parameter without a gradient at wait() gets a zero gradient
    that is averaged with the others' (another rank may have one), as in
    Horovod; a parameter with requires_grad=False is left alone.
    """

    def __init__(self, module: torch.nn.Module, prefix: str) -> None:
        self.enabled = True
        self.active = _distributed()
        self._params: list = []  # (name, parameter), each parameter once
        seen: set = set()
        for name, p in module.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                self._params.append((f"{prefix}.{name}", p))
        self._hooks: dict = {}  # id(parameter) -> hook handle
        self._in_flight: dict = {}  # id(parameter) -> (parameter, grad, staged copy, handle)
        self.ensure_hooks()

    @property
    def in_flight(self) -> int:
        """Gradients whose allreduce has started and not been waited for."""
        return len(self._in_flight)

    def ensure_hooks(self) -> None:
        """Hook every parameter that requires grad now (parameters may be
        unfrozen during training)."""
        if not self.active:
            return
        for name, p in self._params:
            if p.requires_grad and id(p) not in self._hooks:

                def hook(param: torch.Tensor, name: str = name) -> None:
                    self._grad_ready(name, param)

                self._hooks[id(p)] = p.register_post_accumulate_grad_hook(hook)

    def _grad_ready(self, name: str, p: torch.Tensor) -> None:
        if not self.enabled:
            return
        if id(p) in self._in_flight:
            raise RuntimeError(
                f"the gradient of {name!r} is still being averaged from an earlier backward pass; "
                "with strategy 'cring' call backward through Lightning (return the loss, or "
                "self.manual_backward(loss); fabric.backward(loss) in Fabric), not loss.backward()"
            )
        self._submit(name, p)

    def _submit(self, name: str, p: torch.Tensor) -> None:
        grad = p.grad
        if grad is None:
            grad = p.grad = torch.zeros_like(p.detach())
        if grad.is_sparse:
            raise NotImplementedError(
                f"parameter {name!r} has a sparse gradient; cring has no sparse allreduce "
                "(use a dense embedding, e.g. sparse=False)"
            )
        _check_device(grad, f"gradient of {name!r}")
        staged = None if grad.is_contiguous() else grad.contiguous()
        handle = cring.allreduce_async_(
            grad if staged is None else staged, op=cring.Average, name=name
        )
        self._in_flight[id(p)] = (p, grad, staged, handle)

    def wait(self) -> None:
        """Finish averaging this step's gradients: afterwards every trainable
        parameter's .grad holds the mean over ranks."""
        if not self.active:
            return
        error: Optional[BaseException] = None
        try:
            for name, p in self._params:
                if p.requires_grad and id(p) not in self._in_flight:
                    self._submit(name, p)
        except BaseException as e:  # still wait for what was started
            error = e
        pending = list(self._in_flight.values())
        self._in_flight.clear()
        for _, grad, staged, handle in pending:
            try:
                cring.synchronize(handle)
                if staged is not None:
                    grad.copy_(staged)
            except BaseException as e:
                error = error or e
        if error is not None:
            raise error

    def close(self) -> None:
        """Remove the hooks and let anything still in flight land (errors ignored)."""
        for hook in self._hooks.values():
            hook.remove()
        self._hooks.clear()
        pending = list(self._in_flight.values())
        self._in_flight.clear()
        for _, _, _, handle in pending:
            try:
                cring.synchronize(handle)
            except BaseException:
                pass


COMM_STATE_KEY = "cring_comm_state"  # where a checkpoint keeps the hook's state


def check_comm_hook(comm_hook: Any, comm_state: Any, shard_state: int) -> tuple:
    """The strategy's comm_hook/comm_state arguments, checked."""
    if comm_hook is None:
        if comm_state is not None:
            raise ValueError("comm_state was given without a comm_hook")
        return None, None
    if not callable(comm_hook):
        raise TypeError(
            f"comm_hook must be callable as hook(state, bucket), got {type(comm_hook).__name__}"
        )
    if shard_state == 2:
        raise ValueError(
            "comm_hook cannot be combined with shard_state=2 (its gradients are "
            "reduce-scattered; a hook returns whole buckets): use shard_state=1 or 0"
        )
    return comm_hook, comm_state


def make_averager(module: torch.nn.Module, comm_hook: Any, comm_state: Any) -> Any:
    """The strategy's averager: through the communication hook when there is one."""
    if comm_hook is None:
        return GradientAverager(module, "lightning.grad")
    from cring.torch._comm_hook import HookAverager

    return HookAverager(module, "lightning.hook", comm_hook, comm_state)


def with_comm_state(checkpoint: dict, comm_state: Any) -> dict:
    """`checkpoint` with the hook state's state_dict() added (rank 0's is the
    one written; docs/hooks.md says what each rank takes back)."""
    if comm_state is None or not hasattr(comm_state, "state_dict"):
        return checkpoint
    return {**checkpoint, COMM_STATE_KEY: comm_state.state_dict()}


def load_comm_state(checkpoint: Any, comm_state: Any) -> None:
    if (
        comm_state is not None
        and hasattr(comm_state, "load_state_dict")
        and isinstance(checkpoint, dict)
        and COMM_STATE_KEY in checkpoint
    ):
        comm_state.load_state_dict(checkpoint[COMM_STATE_KEY])


@contextmanager
def sync_paused(averager: Optional[GradientAverager]) -> Iterator[None]:
    """Within this context backward does not communicate: gradients only
    accumulate locally (no-op without an enabled averager)."""
    if averager is None or not averager.enabled:
        yield
        return
    averager.enabled = False
    try:
        yield
    finally:
        averager.enabled = True


# ---- what the Trainer and Fabric strategies share ---------------------------------------------


class StrategyMixin:
    """The parts of CRingStrategy and CRingFabricStrategy that are the same:
    environment, devices and ranks, joining cring, collectives, teardown and
    registration. A strategy class lists it before Lightning's base class and
    sets the attributes below."""

    strategy_name = "cring"
    _lib: SimpleNamespace  # set by build_strategy_class
    _environment_class: type
    _launcher_class: type
    _api = ""  # "Trainer" or "Fabric", for messages
    _rank_zero_only_names: tuple = ()  # the rank_zero_only objects in _lib that get the rank

    def _init_cring_state(self, timeout_s: Optional[float]) -> None:
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self._timeout_s = timeout_s
        self._num_nodes = 1
        self._root_device_cache: Optional[tuple] = None  # (inputs, device)
        self._owns_cring = False

    # ---- environment, devices, ranks -----------------------------------------------------------

    @property
    def cluster_environment(self) -> Any:
        return self._cluster_environment

    @cluster_environment.setter
    def cluster_environment(self, env: Any) -> None:
        # Lightning offers the environment it detected by itself; cring's understands
        # those launchers (and mpirun without mpi4py), so it takes their place. Any
        # other environment (Kubeflow, LSF, your own) is used as given.
        if env is not None and type(env) in self._lib.auto_environments:
            env = self._environment_class()
        self._cluster_environment = env

    @property
    def root_device(self) -> torch.device:
        """This rank's device: the CPU, or the CUDA device cuda_device_index()
        picks for its launch and local rank (the strategy's setup makes it the
        current device, and the model lives there)."""
        devices = self.parallel_devices
        if not devices:
            return torch.device("cpu")
        first = torch.device(devices[0])
        if first.type != "cuda":
            return first
        env = self.cluster_environment
        key = (
            tuple(str(d) for d in devices),
            self.local_rank,
            os.environ.get(CUDA_DEVICE_VARIABLE),
        )
        cached = getattr(self, "_root_device_cache", None)
        if cached is None or cached[0] != key:
            launch = env.launch if isinstance(env, _CRingEnvironmentBase) else None
            requested = [torch.device(d).index or 0 for d in devices]
            index = cuda_device_index(launch, self.local_rank, requested, torch.cuda.device_count)
            cached = self._root_device_cache = (key, torch.device("cuda", index))
        return cached[1]

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = int(num_nodes)

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def distributed_sampler_kwargs(self) -> dict:
        return {"num_replicas": self.world_size, "rank": self.global_rank}

    def _external(self) -> bool:
        env = self.cluster_environment
        return isinstance(env, _CRingEnvironmentBase) and env.launch is not None

    def _assign_world_ranks(self) -> None:
        env = self.cluster_environment
        if env is not None and not self._external():
            env.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            env.set_world_size(self.num_nodes * self.num_processes)
        rank = self.global_rank
        for name in self._rank_zero_only_names:
            getattr(self._lib, name).rank = rank

    def _check_devices(self) -> None:
        """CPU or CUDA devices, one kind per job (MPS, XLA and the rest are refused)."""
        kinds = {torch.device(d).type for d in self.parallel_devices or ()}
        if len(kinds) > 1 or not kinds <= set(DEVICE_KINDS):
            raise ValueError(
                f"strategy 'cring' trains on CPU or CUDA devices (one kind per job); got devices "
                f"{self.parallel_devices}. Use {self._api}(accelerator='cpu', strategy='cring') "
                f"or {self._api}(accelerator='gpu', strategy='cring') on NVIDIA GPUs"
            )
        if kinds == {"cuda"}:
            self.root_device  # noqa: B018  (a rank without a GPU fails here, not at fit)

    # ---- joining the job -----------------------------------------------------------------------

    def _init_cring(self, expected_by: str, hint: str = "") -> None:
        if cring.is_initialized():  # the user (or cring.ray) joined already: theirs to shut down
            self._owns_cring = False
        else:
            if self._external():
                cring.init(timeout_s=self._timeout_s)
            else:
                env = self.cluster_environment
                cring.init(
                    rank=self.global_rank,
                    size=self.world_size,
                    addr=env.main_address,
                    port=env.main_port,
                    timeout_s=self._timeout_s,
                )
            self._owns_cring = True
        if cring.rank() != self.global_rank or cring.size() != self.world_size:
            raise RuntimeError(
                f"cring is rank {cring.rank()} of {cring.size()}, but {expected_by} expects rank "
                f"{self.global_rank} of {self.world_size}{hint}"
            )

    # ---- collectives ---------------------------------------------------------------------------

    def all_gather(
        self, tensor: torch.Tensor, group: Any = None, sync_grads: bool = False
    ) -> torch.Tensor:
        return all_gather(tensor, group=group, sync_grads=sync_grads)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return broadcast(obj, src)

    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        return reduce_boolean_decision(decision, all=all)

    # ---- the end -------------------------------------------------------------------------------

    def _close_averagers(self) -> None:
        raise NotImplementedError

    def teardown(self) -> None:
        self._close_averagers()
        try:
            super().teardown()  # type: ignore[misc]
        finally:
            if self._owns_cring and cring.is_initialized():
                cring.shutdown()
            self._owns_cring = False

    @classmethod
    def register_strategies(cls, strategy_registry: Any) -> None:
        strategy_registry.register(
            cls.strategy_name,
            cls,
            override=True,
            description="Data-parallel training over cring (Horovod-style)",
        )


def build_strategy_class(
    name: str, mixin: type, base: type, lib: SimpleNamespace, environment: type, launcher: type
) -> type:
    """The strategy class `name` for one Lightning distribution: `mixin` on `base`."""
    return type(
        name,
        (mixin, base),
        {
            "_lib": lib,
            "_environment_class": environment,
            "_launcher_class": launcher,
            "__module__": "cring.lightning",
            "__doc__": mixin.__doc__,
        },
    )

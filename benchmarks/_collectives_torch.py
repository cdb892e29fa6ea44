"""The torch-tensor backends of benchmarks/collectives.py (issue 20's DeepSpeed
comparison): cring.torch's allreduce_ and DeepSpeed's shared-memory
allreduce (deepspeed.comm.inference_all_reduce), float32 and bfloat16, on the
same torch tensors in the same loop. Imported only by the worker of these
two libraries; no processes are started here."""

from __future__ import annotations

from typing import Any, Callable

from _collectives_common import dtype_of


class TorchBuffers:
    """Buffers and checks on torch tensors, shared by both backends (which
    have the methods of _collectives_worker.Backend; not imported from there,
    so the worker can import this module without a loop)."""

    torch: Any
    rank: int
    size: int
    allocates_output = False

    def alloc(self, elems: int, value: float, dtype: str = "float32") -> Any:
        return self.torch.full((elems,), value, dtype=getattr(self.torch, dtype))

    def values(self, buf: Any) -> Any:
        return buf.float().numpy()


class CringTorchBackend(TorchBuffers):
    """cring.torch (the horovod.torch drop-in) over shared memory: named
    in-place allreduce_ on the tensor, as a training loop calls it."""

    def __init__(self) -> None:
        import torch

        import cring.torch as ct

        torch.set_num_threads(1)
        self.torch, self.ct = torch, ct
        ct.init()
        self.rank, self.size = ct.rank(), ct.size()
        import cring

        self.transport = f"cring.torch {getattr(cring, '__version__', '')} over {cring.transport()}"

    def unsupported(self, collective: str) -> str:
        return ""

    def barrier(self) -> None:
        self.ct.barrier()

    def bind(self, collective: str, inp: Any, out: Any, name: str) -> Callable[[], Any]:
        ct = self.ct
        op = ct.Sum
        return lambda: ct.allreduce_(inp, op=op, name=name)

    def max_of(self, value: float) -> float:
        x = self.torch.tensor([value], dtype=self.torch.float64)
        self.ct.allreduce_(x, op=self.ct.Max, name="bench.calibrate")
        return float(x[0])

    def close(self) -> None:
        self.ct.shutdown()


# DeepSpeed's shm kernels: float32 needs vector level 1 (AVX2), bfloat16 and
# float16 level 2 (AVX-512BW); below that inference_all_reduce silently falls
# back to torch.distributed's allreduce, which is not what this row measures.
NEEDED_LEVEL = {"float32": (1, "AVX2"), "bfloat16": (2, "AVX-512BW")}


class DeepSpeedBackend(TorchBuffers):
    """deepspeed.comm.inference_all_reduce: DeepSpeed's shared-memory
    allreduce for CPU inference (its deepspeed_shm_comm op, built with ninja
    on first use), initialised over gloo as its docs say. The parent sets
    LOCAL_SIZE (without it the op crashes)."""

    def __init__(self) -> None:
        import torch

        torch.set_num_threads(1)
        import deepspeed
        import deepspeed.comm as dc
        import deepspeed.comm.comm as dc_state

        self.torch, self.dc = torch, dc
        dc.init_distributed(dist_backend="gloo")
        self.rank, self.size = dc.get_rank(), dc.get_world_size()
        backend = dc_state.cdb
        self.op_built = getattr(backend, "shm_comm_op", None) is not None
        self.level = int(getattr(backend, "shm_vector_kernel_level", 0) or 0)
        self.transport = f"deepspeed {deepspeed.__version__} shm (kernel level {self.level})"

    def unsupported(self, collective: str) -> str:
        if not self.op_built:
            return "DeepSpeed's deepspeed_shm_comm op did not build (g++ and ninja needed)"
        need, isa = NEEDED_LEVEL[dtype_of(collective)[0]]
        if self.level < need:
            return f"{dtype_of(collective)[0]} needs {isa} for DeepSpeed's shm kernel"
        return ""

    def barrier(self) -> None:
        self.dc.barrier()

    def bind(self, collective: str, inp: Any, out: Any, name: str) -> Callable[[], Any]:
        dc = self.dc
        return lambda: dc.inference_all_reduce(inp)

    def max_of(self, value: float) -> float:
        import torch.distributed as dist

        x = self.torch.tensor([value], dtype=self.torch.float64)
        dist.all_reduce(x, op=dist.ReduceOp.MAX)
        return float(x[0])

    def close(self) -> None:
        import torch.distributed as dist

        dist.destroy_process_group()

"""The worker side of benchmarks/collectives.py: one process per rank and
library, measuring what the parent asks over its control socket (a backend
per library: cring on NumPy arrays, cring.torch on torch tensors, gloo,
mpi4py, DeepSpeed's shared-memory allreduce). Started by the parent as
`collectives.py --worker LIB`; never run directly."""

from __future__ import annotations

import argparse
import json
import math
import socket
import time
from typing import Any, Callable

from _collectives_common import (
    MAX_CALLS_PER_REP,
    ROTATE_FROM_BYTES,
    TARGET_REP_S,
    WORLD,
    dtype_of,
)

# --------------------------------------------------------------------------- workers


class Backend:
    """One library's calls on its own kind of buffer. bind() returns a
    lambda that makes the call as user code writes it (keywords included),
    so every library pays the same one Python frame on top of its own
    call. (A functools.partial with keywords would copy a dict per call and
    hand it to callees that take keywords by vectorcall as a dict to unpack,
    a cost user code does not pay and that differs between libraries.)"""

    rank: int
    size: int
    allocates_output = False  # allgather returns a new array instead of filling `out`

    def alloc(self, elems: int, value: float, dtype: str = "float32") -> Any: ...
    def values(self, buf: Any) -> Any: ...  # NumPy float32 values for checking
    def unsupported(self, collective: str) -> str:  # why this backend cannot, or ""
        return "" if dtype_of(collective)[0] == "float32" else "float32 only"

    def barrier(self) -> None: ...
    def bind(self, collective: str, inp: Any, out: Any, name: str) -> Callable[[], Any]: ...
    def max_of(self, value: float) -> float: ...
    def close(self) -> None: ...


class CringBackend(Backend):
    allocates_output = True

    def __init__(self) -> None:
        import numpy as np

        import cring

        self.np, self.cring = np, cring
        cring.init()
        self.rank, self.size = cring.rank(), cring.size()
        self.transport = f"cring {getattr(cring, '__version__', '')} over {cring.transport()}"

    def alloc(self, elems: int, value: float, dtype: str = "float32") -> Any:
        return self.np.full(elems, value, self.np.float32)

    def values(self, buf: Any) -> Any:
        return buf

    def barrier(self) -> None:
        self.cring.barrier()

    def bind(self, collective: str, inp: Any, out: Any, name: str) -> Callable[[], Any]:
        c = self.cring
        op = c.Sum
        if collective == "allreduce":
            return lambda: c.allreduce_(inp, op=op, name=name)
        if collective == "allreduce-oop":  # cring allocates the result
            return lambda: c.allreduce(inp, op=op, name=name)
        if collective == "broadcast":
            return lambda: c.broadcast_(inp, 0, name=name)
        return lambda: c.allgather(inp, name=name)  # cring allocates the result

    def max_of(self, value: float) -> float:
        x = self.np.array([value], self.np.float64)
        self.cring.allreduce_(x, op=self.cring.Max, name="bench.calibrate")
        return float(x[0])

    def close(self) -> None:
        self.cring.shutdown()


class GlooBackend(Backend):
    def __init__(self) -> None:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)  # two ranks on a two-core machine
        self.torch, self.dist = torch, dist
        dist.init_process_group("gloo", init_method="env://")
        self.rank, self.size = dist.get_rank(), dist.get_world_size()
        self.transport = f"torch {torch.__version__} gloo"
        # all_gather_into_tensor is deprecated in favour of all_gather_single in newer torch
        self.all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

    def alloc(self, elems: int, value: float, dtype: str = "float32") -> Any:
        return self.torch.full((elems,), value, dtype=self.torch.float32)

    def values(self, buf: Any) -> Any:
        return buf.numpy()

    def barrier(self) -> None:
        self.dist.barrier()

    def bind(self, collective: str, inp: Any, out: Any, name: str) -> Callable[[], Any]:
        dist, all_gather = self.dist, self.all_gather
        if collective == "allreduce":
            return lambda: dist.all_reduce(inp)
        if collective == "allreduce-oop":  # torch.distributed reduces in place: copy first
            return lambda: (out.copy_(inp), dist.all_reduce(out))
        if collective == "broadcast":
            return lambda: dist.broadcast(inp, 0)
        return lambda: all_gather(out, inp)

    def max_of(self, value: float) -> float:
        x = self.torch.tensor([value], dtype=self.torch.float64)
        self.dist.all_reduce(x, op=self.dist.ReduceOp.MAX)
        return float(x[0])

    def close(self) -> None:
        self.dist.destroy_process_group()


class MpiBackend(Backend):
    def __init__(self) -> None:
        import numpy as np
        from mpi4py import MPI

        self.np, self.MPI = np, MPI
        self.comm = MPI.COMM_WORLD
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        self.transport = MPI.Get_library_version().split(",")[0].strip()

    def alloc(self, elems: int, value: float, dtype: str = "float32") -> Any:
        return self.np.full(elems, value, self.np.float32)

    def values(self, buf: Any) -> Any:
        return buf

    def barrier(self) -> None:
        self.comm.Barrier()

    def bind(self, collective: str, inp: Any, out: Any, name: str) -> Callable[[], Any]:
        comm, in_place, op = self.comm, self.MPI.IN_PLACE, self.MPI.SUM
        if collective == "allreduce":
            return lambda: comm.Allreduce(in_place, inp, op=op)
        if collective == "allreduce-oop":
            return lambda: comm.Allreduce(inp, out, op=op)
        if collective == "broadcast":
            return lambda: comm.Bcast(inp, root=0)
        return lambda: comm.Allgather(inp, out)

    def max_of(self, value: float) -> float:
        return float(self.comm.allreduce(value, op=self.MPI.MAX))

    def close(self) -> None:
        pass


def make_backend(library: str) -> Backend:
    if library in ("cring-torch", "deepspeed"):
        from _collectives_torch import CringTorchBackend, DeepSpeedBackend

        return CringTorchBackend() if library == "cring-torch" else DeepSpeedBackend()
    if library.startswith("cring"):
        return CringBackend()
    if library == "gloo":
        return GlooBackend()
    if library == "mpi":
        return MpiBackend()
    raise ValueError(f"unknown library {library!r}")


def measure(
    b: Backend,
    collective: str,
    nbytes: int,
    reps: int,
    rotate_bytes: int,
    rotate_from_bytes: int = ROTATE_FROM_BYTES,
) -> dict:
    """Time one collective at one size; returns this rank's seconds per call
    for each repetition."""
    n = b.size
    dtype, es = dtype_of(collective)
    if collective == "allgather":
        in_elems = max(1, nbytes // (es * n))
        out_elems = in_elems * n
        nbytes = out_elems * es
        footprint = (in_elems + out_elems) * es
    elif collective == "allreduce-oop":  # into a separate output of the same size
        in_elems = out_elems = max(1, nbytes // es)
        nbytes = in_elems * es
        footprint = 2 * nbytes
    else:
        in_elems, out_elems = max(1, nbytes // es), 0
        nbytes = in_elems * es
        footprint = nbytes
    # Rotate over buffers totalling more than the last-level cache once a
    # call's data no longer fits in a core's own caches; smaller messages stay
    # cache-resident in real use too (and an index per call would cost more
    # than the collective).
    count = 1 if footprint < rotate_from_bytes else max(2, math.ceil(rotate_bytes / footprint))
    name = f"bench.{collective}.{nbytes}"
    calls = []
    for _ in range(count):
        inp = b.alloc(in_elems, b.rank + 1.0, dtype)
        out = b.alloc(out_elems, 0.0, dtype) if out_elems and not b.allocates_output else None
        calls.append(b.bind(collective, inp, out, name))
    k = 0

    def run(ncalls: int) -> None:
        nonlocal k
        if count == 1:
            f = calls[0]
            for _ in range(ncalls):
                f()
        else:
            for _ in range(ncalls):
                calls[k % count]()
                k += 1

    # warm-up (first use of a name, connections, scratch space), then agree
    # on how many calls make a repetition of about TARGET_REP_S
    run(1)
    b.barrier()
    t0 = time.perf_counter()
    run(3)
    per_call = b.max_of((time.perf_counter() - t0) / 3)
    per_rep = max(1, min(MAX_CALLS_PER_REP, int(TARGET_REP_S / max(per_call, 1e-9))))
    run(min(per_rep, 200))  # a little more warm-up for small sizes

    times = []
    for _ in range(reps):
        b.barrier()
        t0 = time.perf_counter()
        run(per_rep)
        times.append((time.perf_counter() - t0) / per_rep)

    calls.clear()  # free the rotation set before checking
    check(b, collective, in_elems, name, dtype)
    return {
        "collective": collective,
        "bytes": nbytes,
        "calls_per_rep": per_rep,
        "buffers": count,
        "buffer_bytes": footprint * count,
        "times_s": times,
    }


def check(b: Backend, collective: str, in_elems: int, name: str, dtype: str) -> None:
    """One more call on fresh values; raise if the result is wrong."""
    import numpy as np

    n, r = b.size, b.rank
    if collective == "allreduce-oop":
        buf = b.alloc(in_elems, r + 1.0, dtype)
        out = None if b.allocates_output else b.alloc(in_elems, 0.0, dtype)
        result = b.bind(collective, buf, out, name)()
        got = b.values(result if b.allocates_output else out)
        want = np.full(in_elems, n * (n + 1) / 2, np.float32)
        if not np.array_equal(b.values(buf), np.full(in_elems, r + 1.0, np.float32)):
            raise SystemExit(f"rank {r}: {collective} changed its input")
    elif collective.startswith("allreduce"):
        buf = b.alloc(in_elems, r + 1.0, dtype)
        b.bind(collective, buf, None, name)()
        got, want = b.values(buf), np.full(in_elems, n * (n + 1) / 2, np.float32)
    elif collective == "broadcast":
        buf = b.alloc(in_elems, 7.0 if r == 0 else -1.0)
        b.bind(collective, buf, None, name)()
        got, want = b.values(buf), np.full(in_elems, 7.0, np.float32)
    else:
        out = None if b.allocates_output else b.alloc(in_elems * n, 0.0)
        result = b.bind(collective, b.alloc(in_elems, r + 1.0), out, name)()
        got = b.values(result if b.allocates_output else out)
        want = np.repeat(np.arange(1, n + 1, dtype=np.float32), in_elems)
    if not np.array_equal(got, want):
        raise SystemExit(
            f"rank {r}: {collective} of {in_elems} {dtype} gave wrong values "
            f"(first {got[:4]!r}, expected {want[:4]!r})"
        )


def worker(args: argparse.Namespace) -> None:
    """One rank of one library: connect to the parent's control socket, then
    measure what it asks for, one (collective, size) at a time. Between
    requests the rank sleeps in recv(), so an idle library takes no CPU from
    the one being measured."""
    library = args.worker
    b = make_backend(library)
    if b.size != WORLD:
        raise SystemExit(f"{library}: expected {WORLD} ranks, got {b.size}")
    host, port = args.control.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as conn, conn.makefile("rw") as f:
        f.write(
            json.dumps(
                {"library": library, "rank": b.rank, "transport": getattr(b, "transport", "")}
            )
            + "\n"
        )
        f.flush()
        for line in f:
            request = json.loads(line)
            if request["cmd"] == "exit":
                break
            why = b.unsupported(request["collective"])
            if why:  # e.g. DeepSpeed's bfloat16 kernel on a CPU without AVX-512BW
                f.write(json.dumps({"skipped": why}) + "\n")
                f.flush()
                continue
            result = measure(
                b,
                request["collective"],
                request["bytes"],
                request["reps"],
                request["rotate_bytes"],
                request.get("rotate_from_bytes", ROTATE_FROM_BYTES),
            )
            f.write(json.dumps(result) + "\n")
            f.flush()
    b.close()

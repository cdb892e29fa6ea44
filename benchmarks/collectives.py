"""Collective benchmark: cring against torch.distributed (gloo) and Open MPI
(mpi4py), two ranks on this machine, in one invocation.

    python benchmarks/collectives.py [--sizes 8 1K 1M 64M] [--quick] [--out DIR]

(under cringrun, rank 0 runs it and the other ranks exit). It starts every
library's two ranks itself, all at once:
  cring-shm  cring over shared memory   (python -m cring.run -np 2, CRING_TRANSPORT=shm)
  cring-tcp  cring over TCP on loopback (python -m cring.run -np 2, CRING_TRANSPORT=tcp)
  gloo       torch.distributed, gloo backend (two processes, env:// rendezvous)
  mpi        mpi4py on Open MPI         (mpirun -np 2)
and then, for each collective and size, has the libraries measure it one
after another (the others sleep on a control socket meanwhile), so the times
a ratio compares were taken seconds apart; `--rounds` repeats the whole
sweep. One thread per rank (OPENBLAS_NUM_THREADS=1, OMP_NUM_THREADS=1).

Collectives: allreduce (float32 sum, in place: MPI_IN_PLACE for mpi4py),
broadcast (root 0, in place) and allgather (every rank sends size/2 bytes;
the gathered result is `size` bytes, as nccl-tests counts it; cring returns a
new array, the peers fill a preallocated one). Every call is made from
Python on the library's usual buffer: NumPy arrays for cring and mpi4py,
torch tensors for gloo; cring's calls are named, as a training loop's are.

Timing: warm-up calls, then `--reps` repetitions, each started by the
library's own barrier and timing back-to-back calls (as many as fit in about
5 ms; one for large sizes). A rank's time for a repetition is its elapsed
time divided by the calls; a repetition's time is the largest over ranks;
the figure reported is the median over the repetitions of all rounds. From
1 MiB of data per call the buffers are rotated: each call uses the next of
several buffers whose total exceeds the last-level cache, so large sizes are
not measured from cache.
After timing, one more call on fresh values is checked.

Prints a table per collective (time, algbw, busbw per library, and the ratio
of cring's time to each peer's), writes DIR/collectives.csv,
DIR/collectives.png (busbw against size, log-log), DIR/collectives.json
(summary) and DIR/collectives_raw.json (every rank's repetitions), and checks
the targets of issue 7. DIR defaults to benchmarks/results.
"""

from __future__ import annotations

import argparse
import csv
import importlib.util
import json
import math
import os
import platform
import select
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional

HERE = Path(__file__).resolve()
RESULTS = HERE.parent / "results"
LIBRARIES = ("cring-shm", "cring-tcp", "gloo", "mpi")
PEERS = ("gloo", "mpi")
COLLECTIVES = ("allreduce", "broadcast", "allgather")
WORLD = 2
KiB, MiB = 1 << 10, 1 << 20
# 8 B, then powers of 4 from 16 B to 256 MiB (1 KiB, 1 MiB and 64 MiB among them)
DEFAULT_SIZES = [8] + [4**k for k in range(2, 15)]
QUICK_SIZES = [8, KiB, MiB, 64 * MiB]
TARGET_REP_S = 0.005  # small sizes: back-to-back calls per repetition, about this long
MAX_CALLS_PER_REP = 20000
# set by an outer cringrun; the libraries' own launchers set their own
LAUNCHER_VARS = (
    "CRING_RANK",
    "CRING_SIZE",
    "CRING_LOCAL_RANK",
    "CRING_LOCAL_SIZE",
    "CRING_ADDR",
    "CRING_PORT",
    "CRING_SECRET",
    "CRING_JOB_ID",
    "CRING_STORE_EXTERNAL",
)
ROTATE_FROM_BYTES = MiB  # rotate buffers once a call touches this much (L2 is 2 MiB here)


def busbw_factor(collective: str, n: int) -> float:
    """nccl-tests' bus bandwidth factor: algbw * factor is comparable to the
    hardware's bandwidth whatever the algorithm."""
    return {"allreduce": 2 * (n - 1) / n, "allgather": (n - 1) / n, "broadcast": 1.0}[collective]


def parse_size(text: str) -> int:
    units = {
        "": 1,
        "B": 1,
        "K": KiB,
        "KB": KiB,
        "KIB": KiB,
        "M": MiB,
        "MB": MiB,
        "MIB": MiB,
        "G": 1 << 30,
        "GB": 1 << 30,
        "GIB": 1 << 30,
    }
    t = text.strip().upper()
    digits = t.rstrip("KMGIB")
    if not digits or t[len(digits) :] not in units:
        raise argparse.ArgumentTypeError(
            f"size {text!r}: expected a byte count like 8, 4K, 1M, 64M"
        )
    value = int(float(digits) * units[t[len(digits) :]])
    if value < 4 * WORLD:
        raise argparse.ArgumentTypeError(f"size {text!r}: at least {4 * WORLD} bytes")
    return value


def fmt_size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", MiB), ("KiB", KiB)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def llc_bytes() -> int:
    """Size of the largest CPU cache (sysfs), 64 MiB if unknown."""
    best = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            text = (index / "size").read_text().strip()
        except OSError:
            continue
        scale = {"K": KiB, "M": MiB, "G": 1 << 30}.get(text[-1:], 1)
        best = max(best, int(text.rstrip("KMG")) * scale)
    return best or 64 * MiB


def machine() -> dict:
    model = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "nproc": os.cpu_count(),
        "cpu": model or platform.processor(),
        "llc_bytes": llc_bytes(),
        "python": platform.python_version(),
    }


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

    def alloc(self, elems: int, value: float) -> Any: ...
    def values(self, buf: Any) -> Any: ...  # a NumPy view for checking
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

    def alloc(self, elems: int, value: float) -> Any:
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

    def alloc(self, elems: int, value: float) -> Any:
        return self.torch.full((elems,), value, dtype=self.torch.float32)

    def values(self, buf: Any) -> Any:
        return buf.numpy()

    def barrier(self) -> None:
        self.dist.barrier()

    def bind(self, collective: str, inp: Any, out: Any, name: str) -> Callable[[], Any]:
        dist, all_gather = self.dist, self.all_gather
        if collective == "allreduce":
            return lambda: dist.all_reduce(inp)
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

    def alloc(self, elems: int, value: float) -> Any:
        return self.np.full(elems, value, self.np.float32)

    def values(self, buf: Any) -> Any:
        return buf

    def barrier(self) -> None:
        self.comm.Barrier()

    def bind(self, collective: str, inp: Any, out: Any, name: str) -> Callable[[], Any]:
        comm, in_place, op = self.comm, self.MPI.IN_PLACE, self.MPI.SUM
        if collective == "allreduce":
            return lambda: comm.Allreduce(in_place, inp, op=op)
        if collective == "broadcast":
            return lambda: comm.Bcast(inp, root=0)
        return lambda: comm.Allgather(inp, out)

    def max_of(self, value: float) -> float:
        return float(self.comm.allreduce(value, op=self.MPI.MAX))

    def close(self) -> None:
        pass


def make_backend(library: str) -> Backend:
    if library.startswith("cring"):
        return CringBackend()
    if library == "gloo":
        return GlooBackend()
    if library == "mpi":
        return MpiBackend()
    raise ValueError(f"unknown library {library!r}")


def measure(b: Backend, collective: str, nbytes: int, reps: int, rotate_bytes: int) -> dict:
    """Time one collective at one size; returns this rank's seconds per call
    for each repetition."""
    n = b.size
    if collective == "allgather":
        in_elems = max(1, nbytes // (4 * n))
        out_elems = in_elems * n
        nbytes = out_elems * 4
        footprint = (in_elems + out_elems) * 4
    else:
        in_elems, out_elems = max(1, nbytes // 4), 0
        nbytes = in_elems * 4
        footprint = nbytes
    # Rotate over buffers totalling more than the last-level cache once a
    # call's data no longer fits in a core's own caches; smaller messages stay
    # cache-resident in real use too (and an index per call would cost more
    # than the collective).
    count = 1 if footprint < ROTATE_FROM_BYTES else max(2, math.ceil(rotate_bytes / footprint))
    name = f"bench.{collective}.{nbytes}"
    calls = []
    for _ in range(count):
        inp = b.alloc(in_elems, b.rank + 1.0)
        out = b.alloc(out_elems, 0.0) if out_elems and not b.allocates_output else None
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
    check(b, collective, in_elems, name)
    return {
        "collective": collective,
        "bytes": nbytes,
        "calls_per_rep": per_rep,
        "buffers": count,
        "buffer_bytes": footprint * count,
        "times_s": times,
    }


def check(b: Backend, collective: str, in_elems: int, name: str) -> None:
    """One more call on fresh values; raise if the result is wrong."""
    import numpy as np

    n, r = b.size, b.rank
    if collective == "allreduce":
        buf = b.alloc(in_elems, r + 1.0)
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
            f"rank {r}: {collective} of {in_elems} float32 gave wrong values "
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
            result = measure(
                b, request["collective"], request["bytes"], request["reps"], request["rotate_bytes"]
            )
            f.write(json.dumps(result) + "\n")
            f.flush()
    b.close()


# --------------------------------------------------------------------------- parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(procs: list) -> None:
    """End processes this script started (each leads its own session)."""
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def start(library: str, control: str) -> tuple:
    """Start one library's ranks; returns (processes, None) or ([], why not)."""
    worker_args = [str(HERE), "--worker", library, "--control", control]
    # one thread per rank for every library: NumPy's OpenBLAS and torch's
    # OpenMP pools would otherwise add threads that compete for the two cores
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    if library.startswith("cring"):
        env["CRING_TRANSPORT"] = library.split("-")[1]
        cmds = [
            [sys.executable, "-m", "cring.run", "-np", str(WORLD), sys.executable, *worker_args]
        ]
        envs = [env]
    elif library == "gloo":
        if importlib.util.find_spec("torch") is None:
            return [], "torch is not installed"
        port = free_port()
        envs = [
            dict(
                env,
                RANK=str(r),
                WORLD_SIZE=str(WORLD),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=str(port),
            )
            for r in range(WORLD)
        ]
        cmds = [[sys.executable, *worker_args]] * WORLD
    else:
        mpirun = shutil.which("mpirun")
        if mpirun is None:
            return [], "mpirun not found (apt-get install -y openmpi-bin libopenmpi-dev)"
        if importlib.util.find_spec("mpi4py") is None:
            return [], "mpi4py is not installed"
        cmds = [
            [
                mpirun,
                "--allow-run-as-root",
                "--oversubscribe",
                "-np",
                str(WORLD),
                sys.executable,
                *worker_args,
            ]
        ]
        envs = [env]
    return [subprocess.Popen(c, env=e, start_new_session=True) for c, e in zip(cmds, envs)], None


class Group:
    """One library's running ranks and their control connections."""

    def __init__(self, library: str, procs: list):
        self.library, self.procs = library, procs
        self.conns: dict = {}  # rank -> control socket
        self.files: dict = {}  # rank -> its file (JSON lines)
        self.transport = ""
        self.failed: Optional[str] = None

    def fail(self, why: str) -> None:
        self.failed = why
        stop(self.procs)
        print(f"  {self.library}: stopped ({why})", flush=True)

    def request(self, message: dict, timeout_s: float) -> Optional[list]:
        """Send to every rank, return their replies in rank order (None on
        failure: a rank that exits or does not answer within timeout_s stops
        the library)."""
        try:
            for f in self.files.values():
                f.write(json.dumps(message) + "\n")
                f.flush()
            if message["cmd"] == "exit":
                return []
            replies: dict = {}
            deadline = time.monotonic() + timeout_s
            while len(replies) < len(self.files):
                waiting = {
                    self.conns[rank].fileno(): (rank, f)
                    for rank, f in self.files.items()
                    if rank not in replies
                }
                ready, _, _ = select.select(list(waiting), [], [], 0.5)
                for fd in ready:
                    rank, f = waiting[fd]
                    line = f.readline()
                    if not line:
                        raise ConnectionError(f"rank {rank} exited")
                    replies[rank] = json.loads(line)
                if not ready and any(p.poll() is not None for p in self.procs):
                    raise ConnectionError("a rank exited")
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no answer within {timeout_s:.0f} s")
            return [replies[rank] for rank in sorted(replies)]
        except (OSError, ValueError, ConnectionError) as e:
            self.fail(
                f"{message.get('collective', '')} {fmt_size(message.get('bytes', 0))}: "
                f"{e or type(e).__name__}"
            )
            return None


def start_groups(libraries: list, timeout_s: float) -> tuple:
    """Start every library's ranks at once and wait until each rank has
    connected. Returns ({library: Group}, {library: why skipped}, the
    listening control socket)."""
    server = socket.create_server(("127.0.0.1", 0))
    control = f"127.0.0.1:{server.getsockname()[1]}"
    groups, notes = {}, {}
    for lib in libraries:
        procs, why = start(lib, control)
        if why:
            notes[lib] = why
            print(f"  {lib}: skipped ({why})", flush=True)
        else:
            groups[lib] = Group(lib, procs)
    deadline = time.monotonic() + timeout_s
    pending = WORLD * len(groups)
    server.settimeout(0.5)
    while pending and time.monotonic() < deadline:
        try:
            conn, _ = server.accept()
        except socket.timeout:
            for g in groups.values():  # a library whose ranks died will not connect
                if (
                    g.failed is None
                    and len(g.files) < WORLD
                    and any(p.poll() not in (None, 0) for p in g.procs)
                ):
                    pending -= WORLD - len(g.files)
                    g.fail("a rank exited during start-up")
            continue
        conn.settimeout(timeout_s)
        f = conn.makefile("rw")
        hello = json.loads(f.readline())
        g = groups[hello["library"]]
        g.files[hello["rank"]], g.conns[hello["rank"]] = f, conn
        g.transport = hello.get("transport", "")
        pending -= 1
    for g in groups.values():
        if g.failed is None and len(g.files) < WORLD:
            g.fail(f"not connected after {timeout_s:.0f} s")
    return groups, notes, server


def summarise(samples: dict) -> dict:
    """{(collective, bytes): row} from {(collective, bytes): [(rank replies), ...]}:
    per repetition the slowest rank, then the median over all repetitions."""
    rows: dict = {}
    for key, rounds in samples.items():
        reps = [max(ts) for replies in rounds for ts in zip(*(r["times_s"] for r in replies))]
        first = rounds[0][0]
        t = statistics.median(reps)
        algbw = first["bytes"] / t / 1e9
        rows[key] = {
            "time_s": t,
            "algbw": algbw,
            "busbw": algbw * busbw_factor(key[0], WORLD),
            "calls_per_rep": first["calls_per_rep"],
            "reps": len(reps),
            "buffers": first["buffers"],
            "buffer_bytes": first["buffer_bytes"],
            "spread": (max(reps) - min(reps)) / t if t else 0.0,
        }
    return rows


def fmt_time(t: Optional[float]) -> str:
    if t is None:
        return "-"
    if t < 1e-3:
        return f"{t * 1e6:.2f}us" if t < 1e-5 else f"{t * 1e6:.1f}us"
    return f"{t * 1e3:.2f}ms" if t < 0.1 else f"{t * 1e3:.0f}ms"


def fmt_bw(x: Optional[float]) -> str:
    if x is None:
        return "-"
    if x >= 100:
        return f"{x:.0f}"
    return f"{x:.2f}" if x >= 1 else f"{x:.3f}" if x >= 0.001 else f"{x:.0e}"


def print_tables(data: dict, libs: list, collectives: list, sizes: list) -> None:
    cring_libs = [l for l in libs if l.startswith("cring")]
    peers = [l for l in libs if l in PEERS]
    ratios = [(c, p) for c in cring_libs for p in peers]
    short = {"cring-shm": "shm", "cring-tcp": "tcp", "gloo": "gloo", "mpi": "mpi"}
    for collective in collectives:
        keys = sorted(
            {
                k[1]
                for l in libs
                for k in data.get(l, {})
                if isinstance(k, tuple) and k[0] == collective
            }
        )
        print(
            f"\n{collective}{' (float32 sum, in place)' if collective == 'allreduce' else ''}"
            f"   time per call | algbw GB/s | busbw GB/s (x{busbw_factor(collective, WORLD):g})"
            f" | ratio = cring time / peer time"
        )
        head = f"{'size':>8s} |" + "".join(f"{short[l]:>9s}" for l in libs) + " |"
        head += "".join(f"{short[l]:>7s}" for l in libs) + " |"
        head += "".join(f"{short[l]:>7s}" for l in libs) + " |"
        head += "".join(f"{short[c] + '/' + short[p]:>9s}" for c, p in ratios)
        print(head)
        print("-" * len(head))
        for nbytes in keys:
            get = [data.get(l, {}).get((collective, nbytes)) for l in libs]
            line = f"{fmt_size(nbytes):>8s} |"
            line += "".join(f"{fmt_time(g and g['time_s']):>9s}" for g in get) + " |"
            line += "".join(f"{fmt_bw(g and g['algbw']):>7s}" for g in get) + " |"
            line += "".join(f"{fmt_bw(g and g['busbw']):>7s}" for g in get) + " |"
            for c, p in ratios:
                a = data.get(c, {}).get((collective, nbytes))
                z = data.get(p, {}).get((collective, nbytes))
                line += f"{a['time_s'] / z['time_s']:>9.3f}" if a and z else f"{'-':>9s}"
            print(line)


def write_csv(path: Path, data: dict, libs: list) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(
            [
                "collective",
                "bytes",
                "library",
                "time_us",
                "algbw_GBps",
                "busbw_GBps",
                "vs_gloo",
                "vs_mpi",
                "calls_per_rep",
                "reps",
                "buffers",
                "buffer_bytes",
                "rep_spread",
            ]
        )
        for lib in libs:
            for key, row in sorted(
                (k, v) for k, v in data.get(lib, {}).items() if isinstance(k, tuple)
            ):
                vs = []
                for peer in PEERS:
                    other = data.get(peer, {}).get(key)
                    vs.append(
                        f"{row['time_s'] / other['time_s']:.4g}"
                        if other and lib.startswith("cring")
                        else ""
                    )
                w.writerow(
                    [
                        key[0],
                        key[1],
                        lib,
                        f"{row['time_s'] * 1e6:.4g}",
                        f"{row['algbw']:.4g}",
                        f"{row['busbw']:.4g}",
                        *vs,
                        row["calls_per_rep"],
                        row["reps"],
                        row["buffers"],
                        row["buffer_bytes"],
                        f"{row['spread']:.3g}",
                    ]
                )


def plot(path: Path, data: dict, libs: list, collectives: list, title: str) -> Optional[str]:
    try:
        import matplotlib
    except ImportError:
        return "matplotlib is not installed (pip install matplotlib==3.11.2)"
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    style = {
        "cring-shm": ("tab:red", "o"),
        "cring-tcp": ("tab:orange", "s"),
        "gloo": ("tab:blue", "^"),
        "mpi": ("tab:green", "v"),
    }
    label = {
        "cring-shm": "cring (shared memory)",
        "cring-tcp": "cring (TCP)",
        "gloo": "torch.distributed gloo",
        "mpi": "Open MPI (mpi4py)",
    }
    fig, axes = plt.subplots(
        1, len(collectives), figsize=(5 * len(collectives), 4.4), squeeze=False
    )
    for ax, collective in zip(axes[0], collectives):
        for lib in libs:
            pts = sorted(
                (k[1], v["busbw"])
                for k, v in data.get(lib, {}).items()
                if isinstance(k, tuple) and k[0] == collective
            )
            if pts:
                color, marker = style[lib]
                ax.plot(
                    [p[0] for p in pts],
                    [p[1] for p in pts],
                    marker=marker,
                    color=color,
                    label=label[lib],
                    markersize=4,
                )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(collective + (" (float32 sum)" if collective == "allreduce" else ""))
        ax.set_xlabel("message size (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        ax.grid(True, which="both", alpha=0.3)
        ticks = [1 << k for k in range(3, 31, 4)]
        ax.set_xticks(ticks, [fmt_size(t).replace(" ", "") for t in ticks])
    axes[0][0].legend(fontsize=8)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return None


TARGETS = [
    # (label, library, peer, collective, sizes, limit)
    ("allreduce 64 MiB vs Open MPI", "cring-shm", "mpi", "allreduce", [64 * MiB], 0.5),
    ("allreduce 64 MiB vs gloo", "cring-shm", "gloo", "allreduce", [64 * MiB], 0.25),
    ("allreduce 1 MiB vs Open MPI", "cring-shm", "mpi", "allreduce", [MiB], 0.7),
    ("allreduce 8 B..1 KiB vs mpi4py (worst size)", "cring-shm", "mpi", "allreduce", "small", 1.0),
    ("allreduce 8 B..1 KiB vs gloo (worst size)", "cring-shm", "gloo", "allreduce", "small", 0.05),
    (
        "allreduce 64 MiB, CRING_TRANSPORT=tcp vs gloo",
        "cring-tcp",
        "gloo",
        "allreduce",
        [64 * MiB],
        0.7,
    ),
    ("broadcast 1 MiB vs Open MPI", "cring-shm", "mpi", "broadcast", [MiB], 1.0),
    ("broadcast 64 MiB vs Open MPI", "cring-shm", "mpi", "broadcast", [64 * MiB], 1.0),
    ("allgather 1 MiB vs Open MPI", "cring-shm", "mpi", "allgather", [MiB], 1.0),
    ("allgather 64 MiB vs Open MPI", "cring-shm", "mpi", "allgather", [64 * MiB], 1.0),
]


def worst_ratio(data: dict, lib: str, peer: str, collective: str, sizes: Any) -> tuple:
    """(largest cring/peer time ratio over `sizes`, the size where it is)."""
    if sizes == "small":
        sizes = sorted(
            k[1]
            for k in data.get(lib, {})
            if isinstance(k, tuple) and k[0] == collective and 8 <= k[1] <= KiB
        )
    worst, worst_size = None, None
    for s in sizes:
        a = data.get(lib, {}).get((collective, s))
        z = data.get(peer, {}).get((collective, s))
        if a and z:
            r = a["time_s"] / z["time_s"]
            if worst is None or r > worst:
                worst, worst_size = r, s
    return worst, worst_size


def check_targets(data: dict, per_round: list) -> list:
    """[(label, ratio or None, worst size, limit, verdict, per-round ratios)]
    for issue 7's targets; the verdict uses the medians over all rounds."""
    out = []
    for label, lib, peer, collective, sizes, limit in TARGETS:
        worst, worst_size = worst_ratio(data, lib, peer, collective, sizes)
        rounds = [worst_ratio(d, lib, peer, collective, sizes)[0] for d in per_round]
        verdict = "n/a" if worst is None else ("PASS" if worst <= limit else "MISS")
        out.append((label, worst, worst_size, limit, verdict, rounds))
    return out


def parent(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    info = machine()
    rotate_bytes = int(info["llc_bytes"] * args.rotate_factor)
    print(
        f"collectives benchmark: {WORLD} ranks, {info['nproc']} CPUs ({info['cpu']}), "
        f"last-level cache {fmt_size(info['llc_bytes'])}; {args.reps} repetitions x "
        f"{args.rounds} rounds per size; buffers rotated over >= {fmt_size(rotate_bytes)} "
        f"per rank\nstarting {', '.join(args.libraries)} ...",
        flush=True,
    )
    t_start = time.monotonic()
    groups, notes, server = start_groups(args.libraries, args.timeout)
    # samples[lib][(collective, bytes)] = one list of rank replies per round
    samples: dict = {lib: {} for lib in groups}
    short = {"cring-shm": "shm", "cring-tcp": "tcp", "gloo": "gloo", "mpi": "mpi"}
    try:
        for r in range(args.rounds):
            for collective in args.collectives:
                for nbytes in args.sizes:
                    # every library in turn on the same size: a ratio compares
                    # times taken seconds apart
                    line = []
                    for lib, g in groups.items():
                        if g.failed:
                            continue
                        replies = g.request(
                            {
                                "cmd": "measure",
                                "collective": collective,
                                "bytes": nbytes,
                                "reps": args.reps,
                                "rotate_bytes": rotate_bytes,
                            },
                            args.timeout,
                        )
                        if replies is None:
                            continue
                        key = (collective, replies[0]["bytes"])
                        samples[lib].setdefault(key, []).append(replies)
                        t = statistics.median(
                            max(ts) for ts in zip(*(x["times_s"] for x in replies))
                        )
                        line.append(f"{short[lib]} {fmt_time(t)}")
                    print(
                        f"  round {r + 1}/{args.rounds} {collective:9s} {fmt_size(nbytes):>8s}: "
                        + ", ".join(line),
                        flush=True,
                    )
    except KeyboardInterrupt:
        print("interrupted: reporting what was measured", flush=True)
    finally:
        for g in groups.values():
            if not g.failed:
                g.request({"cmd": "exit"}, 10)
        for g in groups.values():
            try:
                for p in g.procs:
                    p.wait(30)
            except subprocess.TimeoutExpired:
                stop(g.procs)
        server.close()
    print(f"measured in {time.monotonic() - t_start:.0f} s", flush=True)

    data: dict = {}
    per_round: list = [{} for _ in range(args.rounds)]
    for lib, g in groups.items():
        notes[lib] = g.failed and f"failed: {g.failed}" or g.transport
        if samples.get(lib):
            data[lib] = summarise(samples[lib])
            for r, one in enumerate(per_round):
                one[lib] = summarise(
                    {k: v[r : r + 1] for k, v in samples[lib].items() if len(v) > r}
                )
    (out / "collectives_raw.json").write_text(
        json.dumps(
            {
                lib: [{"collective": k[0], "bytes": k[1], "rounds": v} for k, v in s.items()]
                for lib, s in samples.items()
            }
        )
    )
    libs = [l for l in LIBRARIES if l in data]
    if not libs:
        print("no library produced results", file=sys.stderr)
        return 1
    print_tables(data, libs, args.collectives, args.sizes)
    csv_path, png_path = out / "collectives.csv", out / "collectives.png"
    write_csv(csv_path, data, libs)
    title = (
        f"{WORLD} ranks on {info['nproc']} CPUs ({info['cpu']}); median of "
        f"{args.reps * args.rounds}; "
        f"buffers rotated over > last-level cache"
    )
    why = plot(png_path, data, libs, args.collectives, title)
    print(f"\nwrote {csv_path}" + (f" and {png_path}" if why is None else f" (no plot: {why})"))
    (out / "collectives.json").write_text(
        json.dumps(
            {
                "machine": info,
                "libraries": notes,
                "reps": args.reps,
                "rounds": args.rounds,
                "sizes": args.sizes,
                "collectives": args.collectives,
                "rows": [
                    {"library": l, "collective": k[0], "bytes": k[1], **v}
                    for l in libs
                    for k, v in data[l].items()
                ],
            },
            indent=1,
        )
    )

    print("\ntargets (issue 7): cring's time / the peer's time in this run")
    multi = args.rounds > 1
    print(
        f"{'case':48s} {'measured':>9s} {'target':>8s}  result" + ("   per round" if multi else "")
    )
    for label, ratio, size, limit, verdict, rounds in check_targets(data, per_round):
        where = f" (worst at {fmt_size(size)})" if "worst" in label and size else ""
        m = f"{ratio:.3f}" if ratio is not None else "-"
        each = " ".join("-" if r is None else f"{r:.3f}" for r in rounds) if multi else ""
        print(f"{label:48s} {m:>9s} {'<= ' + format(limit, 'g'):>8s}  {verdict:4s}  {each}{where}")
    print("training targets: see python benchmarks/train.py")
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--sizes",
        nargs="+",
        type=parse_size,
        default=None,
        help="message sizes in bytes (suffixes K, M, G); default 8 B and "
        "powers of 4 from 16 B to 256 MiB",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="sizes 8 B, 1 KiB, 1 MiB, 64 MiB, 5 repetitions (about a minute)",
    )
    parser.add_argument(
        "--reps",
        type=int,
        default=None,
        help="timed repetitions per size and round (default 10, --quick 5)",
    )
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="measure every size this many times; the median is taken over "
        "the repetitions of all rounds (default 2)",
    )
    parser.add_argument("--libraries", nargs="+", choices=LIBRARIES, default=list(LIBRARIES))
    parser.add_argument("--collectives", nargs="+", choices=COLLECTIVES, default=list(COLLECTIVES))
    parser.add_argument("--out", default=str(RESULTS), help="output folder (default %(default)s)")
    parser.add_argument(
        "--rotate-factor",
        type=float,
        default=1.1,
        help="rotated buffers per rank total this times the last-level cache",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=600,
        help="seconds allowed for start-up and for each size (default "
        "%(default)s); a library that takes longer is stopped",
    )
    parser.add_argument("--worker", choices=LIBRARIES, help=argparse.SUPPRESS)
    parser.add_argument("--control", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.reps is None:
        args.reps = 5 if args.quick else 10
    if args.rounds is None:
        args.rounds = 2
    if args.reps < 1 or args.rounds < 1:
        parser.error("--reps and --rounds must be at least 1")
    if args.sizes is None:
        args.sizes = QUICK_SIZES if args.quick else DEFAULT_SIZES
    if args.worker:
        worker(args)
        return 0
    if os.environ.get("CRING_RANK", "0") != "0":
        return 0  # under cringrun: rank 0 runs the benchmark, which starts its own ranks
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())

"""Collective benchmark: cring against torch.distributed (gloo) and Open MPI
(mpi4py), two ranks on this machine, in one invocation.

    python benchmarks/collectives.py [--sizes 8 1K 1M 64M] [--quick] [--out DIR]
    python benchmarks/collectives.py --loop [--loop-calls N] [--rounds R]

(under cringrun, rank 0 runs it and the other ranks exit). It starts every
library's two ranks itself, all at once:
  cring-shm  cring over shared memory   (python -m cring.run -np 2, CRING_TRANSPORT=shm)
  cring-tcp  cring over TCP on loopback (python -m cring.run -np 2, CRING_TRANSPORT=tcp)
  gloo       torch.distributed, gloo backend (two processes, env:// rendezvous)
  mpi        mpi4py on Open MPI         (mpirun -np 2)
  cring-torch  cring.torch's allreduce_ on torch tensors, over shared memory
  deepspeed  DeepSpeed's shared-memory allreduce (deepspeed.comm.inference_all_reduce
             on torch tensors; two processes, env://, LOCAL_SIZE=2)
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

The last two measure only allreduce, float32 and bfloat16 (`allreduce-bf16`),
as issue 20's DeepSpeed comparison; both run by default when DeepSpeed is
installed (see docs/performance.md), and are skipped with a note when it is not,
or when the CPU lacks the ISA its kernel needs (AVX2 for float32, AVX-512BW
for bfloat16).

Prints a table per collective (time, algbw, busbw per library, and the ratio
of cring's time to each peer's), writes DIR/collectives.csv,
DIR/collectives.png (busbw against size, log-log), DIR/collectives.json
(summary) and DIR/collectives_raw.json (every rank's repetitions), and checks
the targets of issue 7 and issue 20's rows (small broadcast and allgather;
cring.torch against DeepSpeed's shared-memory allreduce).
DIR defaults to benchmarks/results.

--loop (benchmarks/_collectives_loop.py) times plain long loops of the small
calls instead, as a user writes them, against mpi4py in the same loops, and
checks issue 20's loop targets (allreduce_ named, unnamed and default-op
<= 1.0x mpi4py; broadcast_ and allgather 8 B..64 KiB <= 1.5x).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import select
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Optional

from _collectives_common import (
    COLLECTIVES,
    DEEPSPEED_INSTALL,
    DEFAULT_SIZES,
    HERE,
    LAUNCHER_VARS,
    LIBRARIES,
    QUICK_SIZES,
    RESULTS,
    SHORT,
    TORCH_LIBRARIES,
    WORLD,
    fmt_size,
    machine,
    parse_size,
    supports,
)
from _collectives_loop import loop_main
from _collectives_report import check_targets, fmt_time, plot, print_tables, summarise, write_csv
from _collectives_worker import worker

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
    if library in TORCH_LIBRARIES and importlib.util.find_spec("torch") is None:
        return [], "torch is not installed"
    if library == "deepspeed" and importlib.util.find_spec("deepspeed") is None:
        return [], f"deepspeed is not installed; {DEEPSPEED_INSTALL}"
    if library.startswith("cring"):
        env["CRING_TRANSPORT"] = "tcp" if library == "cring-tcp" else "shm"
        cmds = [
            [sys.executable, "-m", "cring.run", "-np", str(WORLD), sys.executable, *worker_args]
        ]
        envs = [env]
    elif library in ("gloo", "deepspeed"):
        if importlib.util.find_spec("torch") is None:
            return [], "torch is not installed"
        port = free_port()
        # torchrun's variables; DeepSpeed's shm op also needs LOCAL_SIZE (the
        # ranks on this host; it crashes without it)
        envs = [
            dict(
                env,
                RANK=str(r),
                WORLD_SIZE=str(WORLD),
                LOCAL_RANK=str(r),
                LOCAL_SIZE=str(WORLD),
                LOCAL_WORLD_SIZE=str(WORLD),
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


def stop_groups(groups: dict, server: socket.socket) -> None:
    """Ask every library's ranks to exit (those still answering), wait for
    them (killing what does not exit within 30 s) and close the control
    server start_groups opened."""
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
    try:
        for r in range(args.rounds):
            for collective in args.collectives:
                if not any(supports(lib, collective) for lib in groups):
                    continue
                for nbytes in args.sizes:
                    # every library in turn on the same size: a ratio compares
                    # times taken seconds apart
                    line = []
                    for lib, g in groups.items():
                        if g.failed or not supports(lib, collective):
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
                        if replies[0].get("skipped"):
                            line.append(f"{SHORT[lib]} skipped ({replies[0]['skipped']})")
                            continue
                        key = (collective, replies[0]["bytes"])
                        samples[lib].setdefault(key, []).append(replies)
                        t = statistics.median(
                            max(ts) for ts in zip(*(x["times_s"] for x in replies))
                        )
                        line.append(f"{SHORT[lib]} {fmt_time(t)}")
                    print(
                        f"  round {r + 1}/{args.rounds} {collective:9s} {fmt_size(nbytes):>8s}: "
                        + ", ".join(line),
                        flush=True,
                    )
    except KeyboardInterrupt:
        print("interrupted: reporting what was measured", flush=True)
    finally:
        stop_groups(groups, server)
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

    print("\ntargets (issues 7 and 20): cring's time / the peer's time in this run")
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
    parser.add_argument(
        "--libraries",
        nargs="+",
        choices=LIBRARIES,
        default=None,
        help="default: all; cring-torch only where deepspeed is installed (it is the "
        "DeepSpeed comparison's cring side)",
    )
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
    parser.add_argument(
        "--loop",
        action="store_true",
        help="time plain long loops of small calls instead (allreduce_ named, unnamed and "
        "default-op, broadcast_, allgather; 8 B to 64 KiB) against mpi4py in the same loops; "
        "--libraries picks among cring-shm, cring-tcp and mpi (default cring-shm and mpi)",
    )
    parser.add_argument(
        "--loop-calls",
        type=int,
        default=20000,
        help="calls per loop with --loop (a tenth from 64 KiB on; default %(default)s)",
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
    if args.loop:
        if args.libraries is None:
            args.libraries = ["cring-shm", "mpi"]
        if args.reps == (5 if args.quick else 10):
            args.reps = 3
        return loop_main(args)
    if args.libraries is None:
        args.libraries = list(LIBRARIES)
        if importlib.util.find_spec("deepspeed") is None:
            args.libraries.remove("cring-torch")
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())

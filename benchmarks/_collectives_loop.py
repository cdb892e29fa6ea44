"""benchmarks/collectives.py --loop: plain long Python loops, as a user writes
them, for the small calls (issue 20): `for _ in range(N): cring.allreduce_(x,
...)` named, unnamed and with the default op, broadcast_ and allgather,
against mpi4py's Allreduce(MPI.IN_PLACE, ...), Bcast and Allgather in the same
loops under mpirun. No harness between the calls: each case is one loop of N
calls after a barrier, timed by rank 0, best of --reps; the libraries run one
after another, alternating, --rounds times, and each ratio takes each
library's best over all rounds. Runs its ranks itself; prints a table and
checks issue 20's loop targets. No processes outlive it."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from _collectives_common import LAUNCHER_VARS, WORLD, fmt_size

HERE = Path(__file__).resolve()
SMALL = [8, 1024, 64 * 1024]
# (case, collective, bytes, how cring calls it)
CASES = (
    [("allreduce_ named", "allreduce", 8, "named")]
    + [("allreduce_ unnamed", "allreduce", 8, "unnamed")]
    + [("allreduce_ default op", "allreduce", 8, "default")]
    + [(f"allreduce_ {fmt_size(n)}", "allreduce", n, "named") for n in SMALL[1:]]
    + [(f"broadcast_ {fmt_size(n)}", "broadcast", n, "named") for n in SMALL]
    + [(f"allgather {fmt_size(n)}", "allgather", n, "named") for n in SMALL]
)
# issue 20's acceptance in this mode: (case prefix, limit of cring / mpi4py)
LIMITS = {"allreduce_": 1.0, "broadcast_": 1.5, "allgather": 1.5}


def calls_for(nbytes: int, n: int) -> int:
    return n if nbytes <= 1024 else max(n // 10, 100)


def run_cring(n: int, reps: int) -> dict:
    import numpy as np

    import cring

    cring.init()
    out = {}
    for case, coll, nbytes, how in CASES:
        x = np.ones(nbytes // 4, np.float32)
        half = np.ones(nbytes // 4 // WORLD or 1, np.float32)  # the result is nbytes
        if coll == "allreduce":
            f = {
                "named": lambda x=x: cring.allreduce_(x, op=cring.Sum, name="loop"),
                "unnamed": lambda x=x: cring.allreduce_(x, op=cring.Sum),
                "default": lambda x=x: cring.allreduce_(x),
            }[how]
        elif coll == "broadcast":
            f = lambda x=x: cring.broadcast_(x, 0, name="loop.b")  # noqa: E731
        else:
            f = lambda h=half: cring.allgather(h, name="loop.g")  # noqa: E731
        calls = calls_for(nbytes, n)
        best = float("inf")
        for _ in range(reps):
            cring.barrier()
            t = time.perf_counter()
            for _ in range(calls):
                f()
            best = min(best, (time.perf_counter() - t) / calls)
        out[case] = best
    rank = cring.rank()
    cring.shutdown()
    return out if rank == 0 else {}


def run_mpi(n: int, reps: int) -> dict:
    import numpy as np
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    out = {}
    for case, coll, nbytes, _how in CASES:
        x = np.ones(nbytes // 4, np.float32)
        half = np.ones(nbytes // 4 // WORLD or 1, np.float32)
        recv = np.empty(half.size * comm.size, np.float32)
        if coll == "allreduce":
            f = lambda x=x: comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)  # noqa: E731
        elif coll == "broadcast":
            f = lambda x=x: comm.Bcast(x, 0)  # noqa: E731
        else:
            f = lambda h=half, r=recv: comm.Allgather(h, r)  # noqa: E731
        calls = calls_for(nbytes, n)
        best = float("inf")
        for _ in range(reps):
            comm.Barrier()
            t = time.perf_counter()
            for _ in range(calls):
                f()
            best = min(best, (time.perf_counter() - t) / calls)
        out[case] = best
    return out if comm.rank == 0 else {}


def worker(library: str, n: int, reps: int) -> None:
    result = run_mpi(n, reps) if library == "mpi" else run_cring(n, reps)
    if result:
        print("LOOP-RESULT " + json.dumps(result), flush=True)


def launch(library: str, n: int, reps: int, timeout_s: float) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARS}
    env.setdefault("OPENBLAS_NUM_THREADS", "1")
    env.setdefault("OMP_NUM_THREADS", "1")
    me = [sys.executable, str(HERE), library, str(n), str(reps)]
    if library == "mpi":
        cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(WORLD), *me]
    else:
        env["CRING_TRANSPORT"] = library.split("-")[1]
        cmd = [sys.executable, "-m", "cring.run", "-np", str(WORLD), *me]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        print(f"--loop: {library} took over {timeout_s:.0f} s; left out")
        return {}
    for line in proc.stdout.splitlines():
        if "LOOP-RESULT " in line:
            return json.loads(line.split("LOOP-RESULT ", 1)[1])
    print(f"--loop: {library} gave no result (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    return {}


def loop_main(args: argparse.Namespace) -> int:
    """Run the loop mode; returns the exit status (0, or 1 when a library
    gave nothing)."""
    libraries = [lib for lib in args.libraries if lib in ("cring-shm", "cring-tcp", "mpi")]
    best: dict = {lib: {} for lib in libraries}
    for _ in range(args.rounds):
        for lib in libraries:
            for case, t in launch(lib, args.loop_calls, args.reps, args.timeout).items():
                best[lib][case] = min(t, best[lib].get(case, float("inf")))
    mpi = best.get("mpi", {})
    cring_libs = [lib for lib in libraries if lib != "mpi"]
    head = f"{'case':28s}" + "".join(f"{lib:>12s}" for lib in libraries)
    head += "".join(f"{lib + '/mpi':>16s}" for lib in cring_libs if mpi)
    print(f"\nplain loops, {WORLD} ranks, best of {args.reps} x {args.rounds} rounds (us a call)")
    print(head)
    verdicts = []
    for case, *_ in CASES:
        row = f"{case:28s}"
        for lib in libraries:
            t = best[lib].get(case)
            row += f"{t * 1e6:12.2f}" if t else f"{'-':>12s}"
        for lib in cring_libs:
            if mpi.get(case) and best[lib].get(case):
                ratio = best[lib][case] / mpi[case]
                row += f"{ratio:15.2f}x"
                if lib == "cring-shm":
                    limit = LIMITS[case.split()[0]]
                    verdicts.append((case, ratio, limit))
        print(row)
    if verdicts:
        print("\nissue 20 loop targets (cring-shm / mpi4py):")
        for case, ratio, limit in verdicts:
            ok = "PASS" if ratio <= limit else "MISS"
            print(f"  {case:28s} {ratio:6.2f}x  (<= {limit}x)  {ok}")
    return 0 if all(best[lib] for lib in libraries) else 1


if __name__ == "__main__":
    worker(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))
